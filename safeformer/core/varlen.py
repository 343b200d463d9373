"""Variable-length self-attention over packed real tokens.

Shape legend: T real tokens in all (packed, segment after segment, in order), b segments (samples),
h query heads, h_kv key/value heads (``h % h_kv == 0``: query head ``n`` uses key/value head
``n // (h // h_kv)``), d head dim, L the longest segment.

Segment ``s`` holds tokens ``cu_seqlens[s]:cu_seqlens[s + 1]`` of the packed tensors; its tokens attend to
each other only (block-diagonal attention), causally when asked (token ``t`` of a segment sees tokens
``0..t`` of the same segment). On CUDA this runs PyTorch's Flash varlen kernel
(``torch.nn.attention.varlen.varlen_attn``); elsewhere, and whenever ``plan_varlen`` says the kernel
cannot run the inputs, a per-segment float32 reference.

How it is safe whatever the kernel does (docs/safety.md, S1, S6):
1. Self-attention over real tokens has no dead rows and no masked keys: every token sees at least itself.
   So nothing here is selected away; a NaN at a real token is real input (the user's NaN, S9) and must
   surface, not be hidden.
2. Empty segments (a fully padded sample) own no token. They are dropped from ``cu_seqlens`` before the
   call, so the kernel never sees a zero-length sequence, forward or backward; with every segment empty
   (T = 0) the kernel is not called at all (Flash refuses a batch of 0 sequences) and the result is an
   empty output still tied to q, k, v, whose gradients are then (empty) zeros.
3. ``cu_seqlens`` covers ``[0, T)`` exactly (the lengths must sum to T): Flash's varlen backward allocates
   dq, dk, dv with ``empty_like`` and writes only the rows of its sequences, so a token outside every
   sequence would get uninitialised memory as its gradient.
4. The kernel's backward has no derivative of its own: a backward with ``create_graph=True`` (a gradient
   penalty) goes around it, through the per-segment reference recomputed on the same q, k, v, whose
   gradients autograd can differentiate again; under ``torch.func`` transforms the reference runs instead
   of the kernel.
The tests prove 2 by substituting a kernel (``substitute_varlen_kernel``) that writes NaN into the
output and into dq, dk, dv whenever it is handed a zero-length segment.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .attend import BACKENDS, _KernelApart

__all__ = [
    "VarlenPlan",
    "plan_varlen",
    "VarlenLayout",
    "varlen_layout",
    "varlen_attention",
    "varlen_kernel_available",
    "substitute_varlen_kernel",
]

try:  # torch >= 2.10; the keyword-only form (scale, window_size, enable_gqa) from about 2.12
    from torch.nn.attention.varlen import varlen_attn as _torch_varlen_attn
except ImportError:  # pragma: no cover - older torch
    _torch_varlen_attn = None

# The varlen kernel varlen_attention calls, with varlen_attn's signature:
# ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=, window_size=, enable_gqa=)``.
# Tests replace it (``substitute_varlen_kernel``) with one that misbehaves on purpose (S6).
_varlen_kernel: Callable[..., Tensor] | None = _torch_varlen_attn

_HALF = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256  # flash_api.cpp mha_varlen_fwd / mha_varlen_bwd: "head dimension at most 256"


@contextlib.contextmanager
def substitute_varlen_kernel(fn: Callable[..., Tensor]) -> Iterator[None]:
    """Run ``varlen_attention``'s kernel path with ``fn`` in place of ``varlen_attn`` (a testing hook).

    ``fn`` receives ``(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=, window_size=, enable_gqa=)``
    with q ``(T, h, d)``, k and v ``(T, h_kv, d)``, ``cu_seq_q`` and ``cu_seq_k`` the same int32 tensor
    ``(b' + 1,)`` (empty segments dropped), and returns ``(T, h, d)``. Which path runs is still
    ``plan_varlen``'s choice (pass ``plan=`` to ``varlen_attention`` to force the kernel path on the CPU).
    """
    global _varlen_kernel
    old, _varlen_kernel = _varlen_kernel, fn
    try:
        yield
    finally:
        _varlen_kernel = old


def _kernel_signature_ok(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False
    return all(name in params for name in ("scale", "window_size", "enable_gqa"))


_TORCH_KERNEL_OK = _torch_varlen_attn is not None and _kernel_signature_ok(_torch_varlen_attn)


@functools.cache
def _cuda_device_ok(index: int) -> bool:
    if torch.version.hip is not None:  # ROCm: varlen_attn's Flash path is not the CUDA one; not vetted here
        return False
    flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    return bool(flash_built) and torch.cuda.get_device_capability(index) >= (8, 0)


def varlen_kernel_available(device: torch.device | str | None = None) -> bool:
    """Can PyTorch's varlen Flash kernel run on ``device`` (default: the current CUDA device)?

    True when ``torch.nn.attention.varlen.varlen_attn`` exists with ``scale``, ``window_size`` and
    ``enable_gqa`` (torch 2.12 or newer), this torch build has Flash attention, the device is CUDA (not
    ROCm) and its compute capability is 8.0 (Ampere) or newer, which Flash requires forward and backward.
    """
    if not _TORCH_KERNEL_OK:
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return _cuda_device_ok(torch.cuda.current_device() if dev.index is None else dev.index)


@dataclass(frozen=True)
class VarlenPlan:
    """How one packed self-attention runs; a plain function of dtype, device, head shape and options.

    Attributes:
        path: ``"varlen"`` (PyTorch's Flash varlen kernel over ``cu_seqlens``) or ``"padded"`` (the
            kernel cannot run these inputs: the stacks use their compacted padded groups,
            ``varlen_attention`` its per-segment reference).
        reason: why, in words (for logs, tests and benchmarks).
        window_size: ``(-1, 0)`` causal, ``(-1, -1)`` bidirectional: what the kernel is handed.
        enable_gqa: ``h != h_kv``: the kernel shares each key/value head among ``h // h_kv`` query heads.
    """

    path: str
    reason: str
    window_size: tuple[int, int] = (-1, -1)
    enable_gqa: bool = False


def plan_varlen(
    *,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    heads: int,
    kv_heads: int,
    causal: bool,
    has_bias: bool = False,
    dropout_p: float = 0.0,
    backend: str = "auto",
    kernel_available: bool | None = None,
) -> VarlenPlan:
    """Choose between PyTorch's varlen Flash kernel and the padded path for one packed self-attention.

    ``"varlen"`` only where ``varlen_attn`` runs the inputs: CUDA, float16 or bfloat16, ``head_dim`` a
    multiple of 8 and at most 256 (forward and backward), no additive bias (the kernel takes none: ALiBi
    and relative-position biases run padded), no attention dropout (``varlen_attn`` fixes dropout at 0),
    backend ``"auto"`` or ``"flash"`` (any other asks for a specific kernel), and the kernel available
    on the machine (torch version, Flash build, compute capability 8.0 or newer).

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ...
        dtype: the dtype of q, k, v.
        head_dim: d (that of q, k and v alike).
        heads, kv_heads: h and h_kv.
        causal: causal self-attention within each segment.
        has_bias: an additive bias (ALiBi, relative positions) is given.
        dropout_p: attention dropout (pass 0 at evaluation).
        backend: the ``attend`` backend asked for, one of ``BACKENDS``.
        kernel_available: whether the varlen kernel runs here; ``None`` asks
            ``varlen_kernel_available()`` (the current CUDA device), only when every other rule allows
            varlen. Tests pass it explicitly.

    Returns:
        a ``VarlenPlan``.

    Raises:
        ValueError: an unknown backend, head counts that do not divide, a head dim that is not positive,
            or a dropout outside ``[0, 1)``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, value in (("head_dim", head_dim), ("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads % kv_heads != 0:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    window = (-1, 0) if causal else (-1, -1)
    gqa = heads != kv_heads

    def padded(reason: str) -> VarlenPlan:
        return VarlenPlan("padded", reason, window, gqa)

    if backend not in ("auto", "flash"):
        return padded(f"backend={backend!r} asks for another kernel than Flash")
    if device_type != "cuda":
        return padded(f"varlen_attn runs Flash on CUDA only, not on {device_type!r}")
    if dtype not in _HALF:
        return padded(f"Flash takes float16 and bfloat16 only, not {dtype}")
    if head_dim % 8 != 0 or head_dim > _MAX_HEAD_DIM:
        return padded(f"Flash needs head_dim a multiple of 8 and at most {_MAX_HEAD_DIM}, got {head_dim}")
    if has_bias:
        return padded("varlen_attn takes no additive bias (ALiBi, relative positions)")
    if dropout_p > 0:
        return padded(f"varlen_attn has no attention dropout (dropout_p={dropout_p})")
    if kernel_available is None:
        kernel_available = varlen_kernel_available()
    if not kernel_available:
        return padded("no varlen kernel here (torch older than 2.12, no Flash build, ROCm, or a GPU older than sm80)")
    return VarlenPlan("varlen", "Flash varlen over cu_seqlens", window, gqa)


@dataclass(frozen=True)
class VarlenLayout:
    """The segments of a packed batch, built once (e.g. at the top of a stack) and shared by every layer.

    Attributes:
        lengths: the lengths of the non-empty segments, in order (empty segments dropped: they own no token).
        total: T, their sum.
        max_len: L, the longest (0 when there is none).
        cu_seqlens: int32 ``(len(lengths) + 1,)`` cumulative offsets ``[0, ..., T]`` on the tokens' device;
            ``None`` when T == 0 (no kernel call then).
    """

    lengths: tuple[int, ...]
    total: int
    max_len: int
    cu_seqlens: Tensor | None


def varlen_layout(lengths: Sequence[int] | Tensor, device: torch.device | str | None = None) -> VarlenLayout:
    """Build a ``VarlenLayout`` from the per-sample counts of real tokens.

    Args:
        lengths: ``(b,)`` non-negative counts, a sequence of ints or a 1-d integer tensor (read on the host:
            one device sync for a CUDA tensor; the packed path has these counts as a list already).
            Zeros are allowed (fully padded samples) and dropped.
        device: where ``cu_seqlens`` goes (that of q, k, v).

    Raises:
        TypeError: lengths of a non-integer kind (floats, bools).
        ValueError: a negative length, or a tensor that is not 1-d.
    """
    if isinstance(lengths, Tensor):
        if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"lengths must be an integer tensor or a sequence of ints, got a {lengths.dtype} tensor")
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be 1-d (b,), got shape {tuple(lengths.shape)}")
        counts = [int(n) for n in lengths.tolist()]
    elif isinstance(lengths, (list, tuple)):
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"lengths must hold ints, got {n!r} ({type(n).__name__}) in {list(lengths)!r}")
        counts = list(lengths)
    else:
        raise TypeError(f"lengths must be an integer tensor or a sequence of ints, got {type(lengths).__name__}")
    if any(n < 0 for n in counts):
        raise ValueError(f"lengths must be >= 0, got {counts}")
    kept = tuple(n for n in counts if n > 0)
    total = sum(kept)
    cu = None
    if total > 0:
        offsets = [0]
        for n in kept:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)  # (b' + 1,)
    return VarlenLayout(kept, total, max(kept, default=0), cu)


def _validate(q: Tensor, k: Tensor, v: Tensor, causal, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims {'(T, h, d)' if name == 'q' else '(T, h_kv, d)'}, got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape (T, h_kv, d), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"self-attention: k, v must be (T, h_kv, d) with q's T and d, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[2] == 0:
        raise ValueError(f"the head dim must be positive, got q {tuple(q.shape)}")
    h, hkv = q.shape[1], k.shape[1]
    if h == 0 or hkv == 0 or h % hkv != 0:
        raise ValueError(f"the query heads h={h} must be a positive multiple of the key/value heads h_kv={hkv}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Sequence[int] | Tensor | VarlenLayout,
    max_len: int | None = None,
    *,
    causal: bool,
    scale: float | None = None,
    backend: str = "auto",
    plan: VarlenPlan | None = None,
) -> Tensor:
    """Self-attention within each segment of packed tokens; no empty segment reaches a kernel.

    Args:
        q: ``(T, h, d)`` queries of the real tokens, segment after segment (rotary and qk-norm applied).
        k: ``(T, h_kv, d)`` keys of the same tokens; ``h % h_kv == 0``.
        v: ``(T, h_kv, d)`` values.
        lengths: the real tokens per sample ``(b,)``, summing to T: a list of ints, a 1-d integer tensor
            (one host read), or a ``VarlenLayout`` built once for every layer. Zeros are fine.
        max_len: optional check: the caller's bound on the longest segment; a smaller one than the
            longest length is an error (Flash would skip the tokens past it). The kernel is always
            handed the true longest length.
        causal: token ``t`` of a segment sees tokens ``0..t`` of its segment (else all of its segment).
        scale: logit scale; default ``d ** -0.5``.
        backend: ``"auto"``, ``"reference"`` (per-segment float32 softmax) or another ``attend`` backend
            (which plans the reference here: only Flash has a varlen kernel).
        plan: a ``VarlenPlan`` already made by the caller (``plan_varlen``), used as is; then leave
            ``backend`` at ``"auto"``.

    Returns:
        ``(T, h, d)`` in q's dtype.

    Raises:
        TypeError, ValueError: wrong dtypes, shapes, devices, lengths, or both ``plan`` and ``backend`` (S9).
    """
    _validate(q, k, v, causal, scale)
    T, h, d = q.shape
    hkv = k.shape[1]
    if isinstance(lengths, VarlenLayout):
        layout = lengths
        if layout.cu_seqlens is not None and layout.cu_seqlens.device != q.device:
            raise ValueError(f"lengths (a VarlenLayout) has cu_seqlens on {layout.cu_seqlens.device}, expected {q.device}")
    else:
        layout = varlen_layout(lengths, device=q.device)
    if layout.total != T:
        raise ValueError(f"lengths must sum to the number of tokens T={T} (q {tuple(q.shape)}), got {layout.total} "
                         f"from segments {list(layout.lengths)}")
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < layout.max_len:
            raise ValueError(f"max_len must be an int >= the longest length {layout.max_len}, got {max_len!r}")
    if plan is not None:
        if not isinstance(plan, VarlenPlan) or plan.path not in ("varlen", "padded"):
            raise TypeError(f"plan must be a VarlenPlan with path 'varlen' or 'padded', got {plan!r}")
        if backend != "auto":
            raise ValueError(f"pass plan or backend, not both (got plan {plan.path!r} and backend={backend!r})")
    else:
        plan = plan_varlen(device_type=q.device.type, dtype=q.dtype, head_dim=d, heads=h, kv_heads=hkv,
                           causal=causal, backend=backend, kernel_available=varlen_kernel_available(q.device))
    scale = d**-0.5 if scale is None else float(scale)

    if T == 0:  # every segment is empty: no kernel call; keep the graph so that q, k, v get (zero) gradients
        anchor = q.sum() + k.sum() + v.sum()  # empty sums: exactly 0
        return q.new_zeros(0, h, d) + anchor * 0

    if plan.path == "padded" or torch._C._are_functorch_transforms_active():
        # torch.func (grad, vmap, jacrev, ...): the kernel has no batching rule and no second derivative;
        # the reference is plain differentiable ops that every transform takes
        return _reference(q, k, v, layout, causal, scale)
    return _run_kernel(q, k, v, layout, causal, scale)


def _run_kernel(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, causal: bool, scale: float) -> Tensor:
    kernel = _varlen_kernel
    if kernel is None:
        raise ValueError("the varlen plan needs torch.nn.attention.varlen.varlen_attn (torch 2.12 or newer); "
                         "plan with plan_varlen(), which falls back to the padded path")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # Flash: contiguous last dim
    cu = layout.cu_seqlens  # (b' + 1,) int32, strictly increasing: no zero-length segment reaches the kernel

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = kernel(q, k, v, cu, cu, layout.max_len, layout.max_len, scale=scale,
                     window_size=(-1, 0) if causal else (-1, -1),  # a tuple: varlen_attn tests `== (-1, 0)`
                     enable_gqa=k.shape[1] != q.shape[1])  # (T, h, d)
        if not isinstance(out, Tensor) or out.shape != q.shape:
            raise RuntimeError(f"the varlen kernel returned {getattr(out, 'shape', type(out))}, expected {tuple(q.shape)}")
        return out

    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            and not torch.compiler.is_compiling()):
        # the kernel's backward has no derivative, and as a custom op it cannot be skipped in a backward with
        # create_graph=True: its graph is kept apart, and such a backward runs the reference instead
        return _KernelApart.apply(q, k, v, None, (lambda q, k, v, _: call(q, k, v),
                                                  lambda q, k, v, _: _reference(q, k, v, layout, causal, scale),
                                                  0.0, "varlen Flash"))
    return call(q, k, v)


def _reference(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, causal: bool, scale: float) -> Tensor:
    """Per-segment attention with an explicit softmax in float32 (float64 for float64 inputs)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    g = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in layout.lengths:
        qs = q[start:start + n].to(dtype).transpose(0, 1)  # (h, n, d)
        ks = k[start:start + n].to(dtype).transpose(0, 1).repeat_interleave(g, dim=0)  # (h, n, d)
        vs = v[start:start + n].to(dtype).transpose(0, 1).repeat_interleave(g, dim=0)
        logits = (qs @ ks.transpose(-1, -2)) * scale  # (h, n, n)
        if causal:  # the diagonal stays: no row is dead
            logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        outs.append((logits.softmax(dim=-1) @ vs).transpose(0, 1))  # (n, h, d)
        start += n
    return torch.cat(outs, dim=0).to(q.dtype)  # (T, h, d)
