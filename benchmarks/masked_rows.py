"""Masked-row backend matrix: what every attention kernel does with queries that have no key to attend.

A *dead row* is a query whose every key is masked (an empty or dropped context, left padding under a
causal mask, more queries than keys under bottom-right causal alignment, a sample that is all padding).
safeformer promises that no mask makes ``attend`` produce NaN/inf, forward or backward, on any kernel,
and that dead rows come out exactly 0 and pass exactly 0 gradient. This script puts that promise next
to what the kernels do on their own.

The implementations, each run where it accepts the inputs on the current device:

  sdpa[math|flash|efficient|cudnn]  ``F.scaled_dot_product_attention`` restricted to one backend with
                                    ``torch.nn.attention.sdpa_kernel`` (on CPU: math and flash, PyTorch's
                                    CPU flash kernel); the mask as a bool ``(b, 1, i, j)`` tensor, bottom-
                                    right causal as ``causal_lower_right`` when there is no other mask
  sf.attend[<backend>]              ``safeformer.attend(q, k, v, mask=, causal=, bias=, backend=)`` for
                                    every backend it has on the device (auto, reference, math, flash; on
                                    CUDA also efficient, cudnn); the mask as ``(b, j)`` key padding
  xt.Attend, xt.Attend(flash)       x-transformers' ``Attend`` (its einsum path, and its SDPA path with
                                    the dispatcher's choice of kernel), when x-transformers is installed

The dtypes: float32, bfloat16, float16 (those SDPA runs forward and backward on the device).

The cases (h = 2 heads, head dim 64; every case has dead rows):

  empty_context        cross-attention to a context whose every key is masked, in every sample
  zero_length_context  cross-attention to a context of length 0 (k, v of shape (b, h, 0, d))
  cfg_drop             classifier-free guidance: one sample's context mask all False (condition dropped)
  left_pad_causal      causal self-attention, sample 0 left-padded: its first query rows see no key
  q_gt_k_causal        12 queries, 8 keys, bottom-right causal: the first 4 query rows see no key
  all_padding          causal self-attention with one sample that is all padding
  f32_additive_mask    a float32 additive mask (0 / -inf: left padding + causal) whatever the dtype of q
                       (bfloat16 and float16 rows: a mask dtype that is not q's); safeformer takes it as
                       ``bias=``, x-transformers as ``attn_bias=``, SDPA as ``attn_mask=``
  seq_<n>              causal self-attention, left padding, at n = 64, 128, 192, 320, 1088 (around
                       multiples of 128, where the kernels' tiles end); ``--quick``: 16, 40, 136

What is recorded per (implementation, dtype, case), from one forward and one backward with a random
upstream gradient at every query row (dead rows included):

  accepted   whether it ran, else the exception (and the first warning saying why, for SDPA)
  kernel     the attention op the run dispatched to, from ``torch.profiler``'s op names: flash,
             efficient, cudnn, math (SDPA's math op), bmm+softmax (explicit matmuls and softmax)
  out        non-finite values in the output; grads: non-finite values in the gradients of q, k, v
  dead rows  the output at dead rows exactly 0; dq dead: the gradient of q at dead rows exactly 0
  no-grad    a forward under ``torch.no_grad`` (inference paths differ): finite, dead rows exactly 0
  err out    max |out - reference| over live rows; err grad: max |grad - reference| / max |reference|
             over q (live rows), k and v; the reference is the float64 softmax of the same inputs.
             Above the dtype's tolerance (float32 1e-3, bfloat16 5e-2, float16 1e-2) they are listed
             as "live rows off" / "gradients off"
  host sync  (CUDA only) a forward and backward under ``torch.cuda.set_sync_debug_mode("error")``:
             "none", or the synchronizing call it raised on

Output: a markdown table (device, torch, CUDA and cuDNN versions at the top; a per-implementation
summary, the findings, then one table per case) written to ``--out`` and printed. Exit status 0 unless
a safeformer ``attend`` row shows a non-finite value, a non-zero dead row or dead-row gradient, or an
exception other than the ``TypeError``/``ValueError`` refusal its contract allows; what the other
implementations do is reported as findings, not as errors.

Usage:
    python benchmarks/masked_rows.py                    # the current device (CUDA when available)
    python benchmarks/masked_rows.py --quick            # shorter lengths: the CPU dry run, seconds
    python benchmarks/masked_rows.py --device cpu --out /tmp/masked_rows_cpu.md
    python benchmarks/masked_rows.py --cases cfg_drop q_gt_k_causal --dtypes bfloat16
    bash benchmarks/gpu_proof.sh --part masked          # on a GPU machine (docs/testing.md)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.profiler import ProfilerActivity, profile

import safeformer as sf
from safeformer.core.attend import BACKENDS

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, DIM = 2, 64
LENGTHS = (64, 128, 192, 320, 1088)
QUICK_LENGTHS = (16, 40, 136)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |out - reference| over live rows above which a row is listed as "live rows off"
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
SDPA = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


# ----------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One masking situation: shapes, and the mask in its three forms (key padding, causal, additive).

    ``allowed`` (bool ``(b, 1, i, j)``, True = may attend) is the ground truth the reference and the
    dead rows come from.
    """

    name: str
    what: str
    b: int
    i: int
    j: int
    causal: bool = False
    key_pad: Tensor | None = None  # (b, j) bool, True = a real key
    additive: Tensor | None = None  # (b, 1, i, j) float32: 0 or -inf
    allowed: Tensor = field(init=False)

    def __post_init__(self) -> None:
        device = next((t.device for t in (self.key_pad, self.additive) if t is not None), torch.device("cpu"))
        a = torch.ones(self.b, 1, self.i, self.j, dtype=torch.bool, device=device)
        if self.key_pad is not None:
            a = a & self.key_pad[:, None, None, :]
        if self.causal:  # bottom-right aligned: query q sees key k iff k <= q + (j - i)
            a = a & torch.ones(self.i, self.j, dtype=torch.bool, device=device).tril(self.j - self.i)
        if self.additive is not None:
            a = a & (self.additive != float("-inf"))
        self.allowed = a

    def to(self, device: torch.device) -> Case:
        moved = Case(self.name, self.what, self.b, self.i, self.j, self.causal,
                     None if self.key_pad is None else self.key_pad.to(device),
                     None if self.additive is None else self.additive.to(device))
        moved.allowed = self.allowed.to(device)  # a case with neither mask tensor (q_gt_k_causal) too
        return moved


def _padding(j: int, left: list[int] | None = None, right: list[int] | None = None) -> Tensor:
    """A ``(b, j)`` key padding mask: ``left[s]`` padded keys first and ``right[s]`` last in sample s."""
    b = len(left or right or [])
    left, right = left or [0] * b, right or [0] * b
    pos = torch.arange(j)
    return torch.stack([(pos >= lo) & (pos < j - hi) for lo, hi in zip(left, right)])


def build_cases(lengths: tuple[int, ...]) -> list[Case]:
    """Every case, the ``seq_<n>`` ones at ``lengths``."""
    additive = torch.zeros(2, 1, 12, 12).masked_fill(
        ~(_padding(12, left=[4, 0])[:, None, None, :] & torch.ones(12, 12, dtype=torch.bool).tril()), float("-inf"))
    cases = [
        Case("empty_context", "cross-attention to a context whose every key is masked, in every sample",
             b=2, i=8, j=6, key_pad=torch.zeros(2, 6, dtype=torch.bool)),
        Case("zero_length_context", "cross-attention to a context of length 0 (k, v of shape (b, h, 0, d))",
             b=2, i=8, j=0, key_pad=torch.zeros(2, 0, dtype=torch.bool)),
        Case("cfg_drop", "cross-attention; sample 1's context mask all False (a dropped CFG condition), "
             "sample 2's context right-padded by 3", b=3, i=8, j=7, key_pad=_padding(7, right=[0, 7, 3])),
        Case("left_pad_causal", "causal self-attention, sample 0 left-padded by 5: its first 5 query rows "
             "see no key", b=2, i=12, j=12, causal=True, key_pad=_padding(12, left=[5, 0])),
        Case("q_gt_k_causal", "12 queries, 8 keys, bottom-right causal, no other mask: the first 4 query rows "
             "see no key (SDPA gets causal_lower_right)", b=2, i=12, j=8, causal=True),
        Case("all_padding", "causal self-attention; sample 1 all padding (every row dead), sample 0 "
             "right-padded by 3", b=2, i=12, j=12, causal=True, key_pad=_padding(12, right=[3, 12])),
        Case("f32_additive_mask", "a float32 additive mask (0 / -inf: sample 0 left-padded by 4, causal) "
             "whatever the dtype of q", b=2, i=12, j=12, additive=additive),
    ]
    for n in lengths:
        pad = n // 3 + 1
        cases.append(Case(f"seq_{n}", f"causal self-attention at length {n}, sample 0 left-padded by {pad}, "
                          f"sample 1 right-padded by {n // 5}", b=2, i=n, j=n, causal=True,
                          key_pad=_padding(n, left=[pad, 0]) & _padding(n, right=[0, n // 5])))
    return cases


# ----------------------------------------------------------------------------------------------------
# implementations
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Impl:
    name: str
    family: str  # "sdpa", "safeformer" or "x-transformers"
    call: Callable[[Tensor, Tensor, Tensor, Case], Tensor]


def _sdpa(backend: SDPBackend) -> Callable[[Tensor, Tensor, Tensor, Case], Tensor]:
    def call(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
        if case.additive is not None:
            mask = case.additive
        elif case.key_pad is None and case.causal:
            mask = causal_lower_right(case.i, case.j)
        else:
            mask = case.allowed
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return call


def _safeformer(backend: str) -> Callable[[Tensor, Tensor, Tensor, Case], Tensor]:
    def call(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
        # looked up at each call, so a test can plant a failure in sf.attend
        return sf.attend(q, k, v, mask=case.key_pad, causal=case.causal, bias=case.additive, backend=backend)
    return call


def _xt(flash: bool) -> Callable[[Tensor, Tensor, Tensor, Case], Tensor]:
    from x_transformers.attend import Attend

    modules = {causal: Attend(causal=causal, flash=flash) for causal in (False, True)}

    def call(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
        return modules[case.causal](q, k, v, mask=case.key_pad, attn_bias=case.additive)[0]
    return call


def implementations(device: torch.device) -> tuple[list[Impl], str]:
    """The implementations to run on ``device``, and x-transformers' version (or why it is missing)."""
    cuda = device.type == "cuda"
    impls = [Impl(f"sdpa[{name}]", "sdpa", _sdpa(b)) for name, b in SDPA.items()
             if cuda or name in ("math", "flash")]
    impls += [Impl(f"sf.attend[{name}]", "safeformer", _safeformer(name)) for name in BACKENDS
              if cuda or name not in ("efficient", "cudnn")]
    try:
        xt_version = importlib.metadata.version("x-transformers")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations its imports raise
            impls += [Impl("xt.Attend", "x-transformers", _xt(False)),
                      Impl("xt.Attend(flash)", "x-transformers", _xt(True))]
    except (ImportError, importlib.metadata.PackageNotFoundError) as err:
        xt_version = f"not available ({_short(err, 80)}): its rows are left out"
    return impls, xt_version


def dtypes_for(device: torch.device) -> list[torch.dtype]:
    """The dtypes SDPA runs forward and backward in on ``device``."""
    out = []
    for dtype in DTYPES.values():
        try:
            q = torch.randn(1, 1, 2, 8, device=device, dtype=dtype, requires_grad=True)
            F.scaled_dot_product_attention(q, q, q).sum().backward()
            if bool(torch.isfinite(q.grad).all()):
                out.append(dtype)
        except RuntimeError:
            pass
    return out


# ----------------------------------------------------------------------------------------------------
# one run
# ----------------------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    impl: str
    family: str
    dtype: str
    accepted: bool
    note: str = ""  # the exception, when not accepted (or when the backward failed)
    unexpected: bool = False  # an exception outside the implementation's documented refusals
    kernel: str = "—"
    out_bad: int = 0
    grad_bad: dict[str, int] = field(default_factory=dict)
    dead_out: int = 0
    dead_dq: int = 0
    nograd: str = "—"
    err_out: float | None = None
    err_grad: float | None = None
    sync: str = "—"
    tol: float = 0.0

    @property
    def problems(self) -> list[str]:
        """What is wrong with this row, in the words of the findings."""
        if not self.accepted:
            return ["error (not a refusal)"] if self.unexpected else []
        p = []
        if self.out_bad:
            p.append("non-finite output")
        if any(self.grad_bad.values()):
            p.append("non-finite gradient")
        if self.dead_out:
            p.append("dead rows not 0")
        if self.dead_dq:
            p.append("dq at dead rows not 0")
        if self.nograd.startswith("error"):
            p.append("no-grad forward failed")
        else:
            p += [f"no-grad forward: {what}" for what in ("non-finite", "dead rows not 0") if what in self.nograd]
        if self.err_out is not None and not self.err_out <= self.tol:
            p.append("live rows off")
        if self.err_grad is not None and not self.err_grad <= self.tol:
            p.append("gradients off")
        if self.note:
            p.append("backward failed")
        if self.sync not in ("none", "—"):
            p.append("host sync")
        return p

    @property
    def breaks_promise(self) -> bool:
        """For a safeformer row: a non-finite value, a non-zero dead row or dead-row gradient, an unexpected error."""
        if self.unexpected:
            return True
        return self.accepted and bool(self.out_bad or any(self.grad_bad.values()) or self.dead_out or self.dead_dq
                                      or self.nograd not in ("ok", "—") or self.note)


def _short(err: BaseException | str, limit: int = 110) -> str:
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kernel(names: set[str]) -> str:
    """The attention kernel(s) a profile shows, from its op names."""
    low = {n.lower() for n in names}
    found = []
    if any("cudnn" in n and "attention" in n for n in low):
        found.append("cudnn")
    if any("flash" in n for n in low):
        found.append("flash")
    if any("efficient_attention" in n for n in low):
        found.append("efficient")
    if any("_scaled_dot_product_attention_math" in n for n in low):
        found.append("math")
    if not found and any(n.endswith(("::bmm", "::matmul", "::einsum", "::baddbmm")) for n in low) \
            and any("softmax" in n for n in low):
        found.append("bmm+softmax")
    return "+".join(found) or "none"


@contextlib.contextmanager
def _profiler_log_filtered():
    """torch's profiler writes a line to stderr (the C++ file descriptor) at each start and stop: keep those
    out of the output, and pass on anything else written meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if not line.rstrip().endswith(("profiler_start", "profiler_stop")):
                    print(line, file=sys.stderr)


def reference(q: Tensor, k: Tensor, v: Tensor, upstream: Tensor, allowed: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The float64 output (dead rows 0) and the gradients of ``(out * upstream).sum()`` w.r.t. q, k, v."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    dead = ~allowed.any(-1, keepdim=True)  # (b, 1, i, 1)
    logits = (q64 @ k64.transpose(-1, -2)) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~(allowed | dead), float("-inf"))  # dead rows see every key: finite, then 0
    out = torch.where(dead, 0.0, logits.softmax(-1) @ v64)
    grads = torch.autograd.grad(out, leaves, upstream.double(), allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def _count_bad(t: Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def _rel(got: Tensor, want: Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    scale = max(float(want.abs().max()), 1e-12)
    return float((got.double() - want).abs().max()) / scale


def run_one(impl: Impl, case: Case, inputs: dict, device: torch.device) -> Row:
    """One forward and backward of ``impl`` on ``case``'s inputs, checked against the float64 reference."""
    q, k, v, upstream = inputs["q"], inputs["k"], inputs["v"], inputs["up"]
    dtype_name = str(q.dtype).removeprefix("torch.")
    row = Row(case.name, impl.name, impl.family, dtype_name, accepted=True, tol=TOLERANCE[q.dtype])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _profiler_log_filtered(), profile(activities=[ProfilerActivity.CPU]) as prof:
            try:
                out = impl.call(*leaves, case)
                if tuple(out.shape) != tuple(q.shape[:3]) + (v.shape[-1],):
                    raise RuntimeError(f"output of shape {tuple(out.shape)}, expected {tuple(q.shape[:3]) + (v.shape[-1],)}")
            except Exception as err:  # noqa: BLE001  # a refusal is a finding, whatever its type
                row.accepted = False
                said = [str(w.message) for w in caught if "profiler" not in str(w.message).lower()]
                why = next((m for m in said if any(x in m for x in ("not used", "support", "requires"))), "")
                row.note = _short(err) + (f" ({_short(why, 90)})" if why and impl.family == "sdpa" else "")
                row.unexpected = impl.family == "safeformer" and not isinstance(err, (TypeError, ValueError))
                return row
            try:
                grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)
            except Exception as err:  # noqa: BLE001
                grads = None
                row.note = "backward: " + _short(err)
                row.unexpected = impl.family == "safeformer"
    row.kernel = _kernel({e.key for e in prof.key_averages()})

    dead = (~case.allowed.any(-1)).expand(case.b, q.shape[1], case.i)  # (b, h, i)
    live = ~dead
    ref_out, ref_grads = inputs["ref"]
    out = out.detach()
    row.out_bad = _count_bad(out)
    row.dead_out = int((out[dead] != 0).sum())
    if bool(live.any()):
        row.err_out = float((out[live].double() - ref_out[live]).abs().max())
    if grads is not None:
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        row.grad_bad = {name: _count_bad(g) for name, g in zip("qkv", grads)}
        row.dead_dq = int((grads[0][dead] != 0).sum())
        row.err_grad = max(_rel(grads[0][live], ref_grads[0][live]), _rel(grads[1], ref_grads[1]),
                           _rel(grads[2], ref_grads[2]))

    try:  # inference paths differ (no autograd function, optimistic paths): check them too
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said in the run above
            plain = impl.call(q, k, v, case)
        bad, nonzero = _count_bad(plain), int((plain[dead] != 0).sum())
        row.nograd = "ok" if not bad and not nonzero else ", ".join(
            ([f"{bad} non-finite"] if bad else []) + ([f"dead rows not 0 ({nonzero} values)"] if nonzero else []))
    except Exception as err:  # noqa: BLE001
        row.nograd = "error: " + _short(err, 60)
        row.unexpected = row.unexpected or (impl.family == "safeformer" and not isinstance(err, (TypeError, ValueError)))

    if device.type == "cuda" and grads is not None:
        row.sync = host_sync(impl, case, q, k, v, upstream)
    return row


def host_sync(impl: Impl, case: Case, q: Tensor, k: Tensor, v: Tensor, upstream: Tensor) -> str:
    """Run a forward and backward with CUDA's sync debug mode at "error": "none", or what raised."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    up = upstream.to(q.dtype)
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said in the first run
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = impl.call(*leaves, case)
            torch.autograd.grad(out, leaves, up, allow_unused=True)
            result = "none"
        except Exception as err:  # noqa: BLE001
            result = ("SYNC: " if "synchroniz" in str(err).lower() else "error: ") + _short(err, 70)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return result


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    """q, k, v and the upstream gradient of ``case`` in ``dtype`` (the same for every implementation), and
    the float64 reference computed from those very values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case.b, HEADS, case.i, DIM, generator=g).to(device, dtype)
    k = torch.randn(case.b, HEADS, case.j, DIM, generator=g).to(device, dtype)
    v = torch.randn(case.b, HEADS, case.j, DIM, generator=g).to(device, dtype)
    up = torch.randn(case.b, HEADS, case.i, DIM, generator=g).to(device, dtype)
    return dict(q=q, k=k, v=v, up=up, ref=reference(q, k, v, up, case.allowed.to(device)))


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------


def environment(device: torch.device, xt_version: str, quick: bool) -> list[str]:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        where = f"{torch.cuda.get_device_name(device)} (compute capability {p.major}.{p.minor})"
    else:
        where = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} thread(s))"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "not available"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return [
        f"- device: {device.type}: {where}",
        f"- torch {torch.__version__}; CUDA {torch.version.cuda or 'none (CPU build)'}; cuDNN {cudnn}; "
        f"Python {platform.python_version()}",
        f"- x-transformers: {xt_version}",
        f"- safeformer commit {commit}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        + ("; --quick (short lengths)" if quick else ""),
        f"- shapes: {HEADS} heads, head dim {DIM}; live-row tolerance "
        + ", ".join(f"{str(d).removeprefix('torch.')} {t:g}" for d, t in TOLERANCE.items()),
    ]


def _count(n: int, what: str = "") -> str:
    return "0" if n == 0 else f"**{n}**{what}"


def _grads_cell(row: Row) -> str:
    if not row.grad_bad:
        return "—"
    bad = [f"{name} {n}" for name, n in row.grad_bad.items() if n]
    return "finite" if not bad else "**non-finite: " + ", ".join(bad) + "**"


def _err(x: float | None, tol: float | None = None) -> str:
    if x is None:
        return "—"
    text = f"{x:.1e}"
    return f"**{text}**" if tol is not None and not x <= tol else text


def render(rows: list[Row], cases: list[Case], env: list[str], device: torch.device) -> tuple[str, list[Row]]:
    """The markdown report, and the safeformer rows that break its promise."""
    cuda = device.type == "cuda"
    lines = ["# Masked rows: what each attention kernel does with queries that have no key", "",
             "Written by `benchmarks/masked_rows.py` (its docstring says what each column measures).", "", *env, ""]

    impls = list(dict.fromkeys(r.impl for r in rows))
    lines += ["## Summary per implementation", "",
              "Counts of (case, dtype) runs; bold = a problem.", "",
              "| implementation | runs | accepted | non-finite output | non-finite gradient | dead rows not 0 "
              "| dq at dead rows not 0 | no-grad forward bad | live rows off | gradients off | errors (not refusals)"
              + (" | host sync |" if cuda else " |"),
              "|---" * (11 + cuda) + "|"]
    for name in impls:
        mine = [r for r in rows if r.impl == name]
        ok = [r for r in mine if r.accepted]
        cells = [name, str(len(mine)), str(len(ok)),
                 _count(sum(bool(r.out_bad) for r in ok)), _count(sum(any(r.grad_bad.values()) for r in ok)),
                 _count(sum(bool(r.dead_out) for r in ok)), _count(sum(bool(r.dead_dq) for r in ok)),
                 _count(sum(r.nograd not in ("ok", "—") for r in ok)),
                 _count(sum(r.err_out is not None and not r.err_out <= r.tol for r in ok)),
                 _count(sum(r.err_grad is not None and not r.err_grad <= r.tol for r in ok)),
                 _count(sum(r.unexpected for r in mine))]
        if cuda:
            cells.append(_count(sum(r.sync.startswith("SYNC") for r in ok)))
        lines.append("| " + " | ".join(cells) + " |")

    failures = [r for r in rows if r.family == "safeformer" and r.breaks_promise]
    lines += ["", "## Findings", ""]
    grouped: dict[tuple[str, str], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for p in r.problems:
            grouped[(r.impl, p)][r.case].append(r.dtype)
    if failures:
        lines.append(f"- **safeformer's promise broken in {len(failures)} run(s)** (the exit status is 1).")
    else:
        lines.append("- safeformer `attend`: every accepted run finite forward and backward, dead rows and their "
                     "q gradient exactly 0.")
    for r in rows:
        if not r.accepted and not r.unexpected:
            grouped[(r.impl, f"did not run ({_short(r.note, 70)})")][r.case].append(r.dtype)
    for (impl, problem), by_case in sorted(grouped.items(), key=lambda item: impls.index(item[0][0])):
        where = "; ".join(f"{case} ({', '.join(dts)})" for case, dts in by_case.items())
        lines.append(f"- {impl}: {problem} in {where}")

    header = ("| implementation | dtype | accepted | kernel | out | grads | dead rows | dq dead | no-grad | err out "
              "| err grad" + (" | host sync |" if cuda else " |"))
    for case in cases:
        mine = [r for r in rows if r.case == case.name]
        if not mine:
            continue
        n_dead = int((~case.allowed.any(-1)).sum())
        lines += ["", f"## {case.name}", "",
                  f"{case.what}. b={case.b}, i={case.i}, j={case.j}; {n_dead} of {case.b * case.i} (sample, query) rows dead.",
                  "", header, "|---" * (11 + cuda) + "|"]
        for r in mine:
            if not r.accepted:
                cells = [r.impl, r.dtype, ("**ERROR** " if r.unexpected else "no: ") + r.note] + ["—"] * (8 + cuda)
            else:
                cells = [r.impl, r.dtype, "yes" + (f" ({r.note})" if r.note else ""), r.kernel,
                         "finite" if not r.out_bad else f"**{r.out_bad} non-finite**", _grads_cell(r),
                         "exactly 0" if not r.dead_out else f"**{r.dead_out} not 0**",
                         "—" if not r.grad_bad else ("exactly 0" if not r.dead_dq else f"**{r.dead_dq} not 0**"),
                         r.nograd if r.nograd in ("ok", "—") else f"**{r.nograd}**",
                         _err(r.err_out, r.tol), _err(r.err_grad, r.tol)]
                if cuda:
                    cells.append(r.sync if not r.sync.startswith("SYNC") else f"**{r.sync}**")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", failures


# ----------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS} instead of {LENGTHS}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None,
                   help="the markdown file (default benchmarks/results/masked_rows_<device>.md; with --quick a "
                        "temporary folder)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="the seq_<n> cases' lengths")
    p.add_argument("--cases", nargs="+", default=None, help="run only these cases (names as in the table)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES), help="run only these dtypes")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on CPU)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    lengths = tuple(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS))
    cases = build_cases(lengths)
    if args.cases:
        unknown = set(args.cases) - {c.name for c in cases}
        if unknown:
            print(f"masked_rows.py: unknown case(s) {sorted(unknown)}; the cases: {[c.name for c in cases]}",
                  file=sys.stderr)
            return 2
        cases = [c for c in cases if c.name in args.cases]
    dtypes = [d for d in dtypes_for(device) if args.dtypes is None or str(d).removeprefix("torch.") in args.dtypes]
    impls, xt_version = implementations(device)

    rows = []
    for n, case in enumerate(cases):
        moved = case.to(device)
        for dtype in dtypes:
            inputs = make_inputs(moved, dtype, device, seed=1000 + n)
            for impl in impls:
                rows.append(run_one(impl, moved, inputs, device))

    text, failures = render(rows, cases, environment(device, xt_version, args.quick), device)
    out = args.out
    if out is None:
        folder = Path(tempfile.mkdtemp(prefix="masked_rows_")) if args.quick else RESULTS
        out = folder / f"masked_rows_{device.type}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    sf_rows = [r for r in rows if r.family == "safeformer"]
    peers = sorted({r.impl for r in rows if r.family != "safeformer" and r.problems})
    if failures:
        shown = "; ".join(f"{r.impl} {r.dtype} {r.case}: {', '.join(r.problems)}" for r in failures[:5])
        verdict = f"safeformer FAILED in {len(failures)} of {len(sf_rows)} runs ({shown})"
    else:
        refused = sum(not r.accepted for r in sf_rows)
        verdict = (f"safeformer ok in {len(sf_rows)} runs (finite, dead rows and their q gradient exactly 0"
                   + (f"; {refused} refused with a clear error)" if refused else ")"))
    print(f"summary: {len(rows)} runs on {device.type}; {verdict}; peers with findings: "
          f"{', '.join(peers) or 'none'}; table in {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
