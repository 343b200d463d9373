"""What the safety contract (docs/safety.md, S1-S9) is checked on, and the checks its clauses share.

- where: ``DEVICES``, the dtypes and ``attend`` backends of each device, the SDPA backends of the CPU;
- how much: ``n_examples`` and ``examples`` (hypothesis settings), ``single_thread``;
- checks: ``grads`` (a missing gradient is a failure, not a zero), ``assert_dead_rows_zero`` (S2),
  ``assert_grads_match`` (S3 bit for bit, S5/S7 within tolerance), ``assert_clear_errors`` (S9: the
  documented exception, naming the argument).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from torch import Tensor

from .numerics import assert_bitwise, assert_close, assert_zero

__all__ = [
    "DEVICES", "SDPA_BACKENDS", "ALL_BACKENDS", "dtypes_for", "backends_for", "backend_takes",
    "device_dtype_backend_params",
    "n_examples", "examples", "single_thread", "grads", "assert_grads_match", "assert_dead_rows_zero",
    "names_argument", "assert_clear_errors",
]

# ----------------------------------------------------------------------------------------------------
# devices, dtypes, backends
# ----------------------------------------------------------------------------------------------------

DEVICES: list[str] = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SDPA_BACKENDS = ("auto", "math", "flash")  # the SDPA backends that exist on CPU
ALL_BACKENDS = SDPA_BACKENDS + ("reference",)

_ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _dtype_works(device: str, dtype: torch.dtype) -> bool:
    """True if SDPA runs forward and backward in ``dtype`` on ``device`` (all three do on CPU in torch 2.13)."""
    try:
        q = torch.randn(1, 1, 2, 8, device=device, dtype=dtype, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        return bool(torch.isfinite(q.grad).all())
    except RuntimeError:
        return False


def dtypes_for(device: str) -> list[torch.dtype]:
    """The floating dtypes attention supports on ``device`` (float32, bfloat16, float16)."""
    return [dt for dt in _ALL_DTYPES if _dtype_works(device, dt)]


def backends_for(device: str) -> list[str]:
    """The ``attend`` backends that exist on ``device``: the reference path plus its SDPA kernels."""
    if device == "cuda":
        return ["auto", "reference", "math", "flash", "efficient", "cudnn"]
    return ["auto", "reference", "math", "flash"]


@functools.cache
def backend_takes(device: str, dtype: torch.dtype, backend: str) -> bool:
    """Whether ``attend(..., backend=backend)`` takes ``dtype`` on ``device`` at all: a fused kernel that
    refuses a dtype outright (flash and cuDNN take no float32 on CUDA) says so with the named ``ValueError``
    "cannot run these inputs" (or "refused these inputs"); any other error is not hidden here (the tests then meet it)."""
    import safeformer as sf

    q = torch.randn(1, 2, 4, 16, device=device, dtype=dtype)
    try:
        sf.attend(q, q, q, backend=backend)
    except ValueError as err:
        if "cannot run these inputs" in str(err) or "refused these inputs" in str(err):
            return False
        raise
    return True


def device_dtype_backend_params() -> list[tuple[str, torch.dtype, str]]:
    """Every (device, dtype, backend) combination to parametrize the contract tests over (a backend that
    refuses a dtype outright on a device is left out of that pair: its refusal has its own tests)."""
    return [(dev, dt, be) for dev in DEVICES for dt in dtypes_for(dev) for be in backends_for(dev)
            if backend_takes(dev, dt, be)]


# ----------------------------------------------------------------------------------------------------
# how much
# ----------------------------------------------------------------------------------------------------


def n_examples(k: int) -> int:
    """``k`` hypothesis examples: at most the profile's few in the quick tier (``dev``), ``k`` in the full
    tier (``ci``), more under ``HYPOTHESIS_PROFILE=thorough``."""
    most = settings.default.max_examples
    if most < 10:  # the dev profile
        return min(k, most)
    return max(k, most // 4) if most > 30 else k


def examples(k: int) -> settings:
    """Hypothesis settings for a property test: ``n_examples(k)`` examples, no deadline, no example
    database (each commit draws its own examples, see conftest.py)."""
    return settings(
        max_examples=n_examples(k), deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run with one intra-op thread: tiny tensors run faster so, and the machine is shared."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------


def grads(out: Tensor, inputs: Sequence[Tensor], upstream: Tensor, *, missing_is_zero: bool = False) -> list[Tensor]:
    """Gradients of ``(out * upstream).sum()`` w.r.t. ``inputs``.

    An input the graph misses is a failure (a missing gradient is not a zero one), unless
    ``missing_is_zero`` (for a float64 reference, whose output may depend on no input at all): then it
    gets zeros. The graph is kept, so a test may ask again with another upstream gradient.
    """
    if missing_is_zero and not out.requires_grad:
        return [torch.zeros_like(x) for x in inputs]
    got = torch.autograd.grad(out, list(inputs), grad_outputs=upstream.to(out.dtype), retain_graph=True,
                              allow_unused=missing_is_zero)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, inputs)]


def assert_grads_match(
    got: Mapping[str, Tensor | None],
    want: Mapping[str, Tensor | None],
    what: str,
    dtype: torch.dtype | None = None,
    *,
    skip: Sequence[str] = (),
) -> None:
    """The gradients ``{name: grad or None}`` of two runs (e.g. ``models.param_grads``) match: bit for bit,
    or within the tolerance of ``dtype`` when given. Where ``want`` has none, ``got`` must have none or
    exactly 0; within a tolerance, a missing gradient also matches an all-zero one."""
    for k, g in want.items():
        if k in skip:
            continue
        mine = got[k]
        if g is None or (mine is None and dtype is not None):
            assert (g is None or not bool(g.any())) and (mine is None or not bool(mine.any())), f"{what}: grad of {k}"
        elif dtype is None:
            assert mine is not None, f"{what}: no grad of {k} (a missing gradient is not a zero one)"
            assert_bitwise(mine, g, f"{what}: grad of {k}")
        else:
            assert_close(mine.double(), g.double(), f"{what}: grad of {k}", dtype)


def assert_dead_rows_zero(seen: Sequence[tuple[str, torch.nn.Module, Tensor, tuple]], dead: Mapping[str, Tensor]) -> set[str]:
    """S2 over the attention calls that ``models.capture_attention`` recorded: each output ``(b, i, c)`` is
    exactly 0 at the rows ``dead[role] (b, i)`` marks, and a random gradient arriving at those rows passes
    exactly 0 into the module's parameters and its inputs (no gradient path counts as 0). Returns the
    roles that had a dead row."""
    g = torch.Generator().manual_seed(0)
    checked = set()
    for role, mod, out, args in seen:
        rows = dead[role]
        assert tuple(out.shape[:2]) == tuple(rows.shape), f"{role}: output {tuple(out.shape)} vs dead rows {tuple(rows.shape)}"
        if not rows.any():
            continue
        assert_zero(out[rows], f"{role} attention output at dead rows")
        upstream = torch.zeros_like(out)
        upstream[rows] = torch.randn(upstream[rows].shape, generator=g)
        params = list(mod.named_parameters())
        inputs = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
        got = torch.autograd.grad(out, [p for _, p in params] + inputs, upstream, retain_graph=True, allow_unused=True)
        for name, gr in zip([n for n, _ in params] + [f"input {k}" for k in range(len(inputs))], got):
            assert_zero(gr, f"{role}: gradient from dead rows into {name}", none_ok=True)
        checked.add(role)
    return checked


def names_argument(message: str, name: str) -> bool:
    """``message`` names ``name`` as a whole word (``mask`` is not named by ``prepend_mask`` or ``x.mask``)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message) is not None


def assert_clear_errors(calls: Sequence[tuple[str, Callable[[], object], type, str]], where: str = "") -> None:
    """S9: each ``(what, call, exception type, argument)`` raises that exception (or a subclass), and
    its message names the argument."""
    for what, call, exc, name in calls:
        with pytest.raises(exc) as info:
            call()
        assert names_argument(str(info.value), name), (
            f"{where}{what}: the {exc.__name__} does not name {name!r}: {info.value}"
        )
