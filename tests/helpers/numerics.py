"""Comparisons that NaN can never pass, and the dtype-tied tolerances they use.

Every comparison fails on a NaN in either tensor, and on an inf unless a test says it expects one
(``assert_bitwise(..., inf_ok=True)``); ``assert_zero`` and ``assert_finite`` check the one tensor given.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_padded_equals_alone",
    "perturb_params",
    "INF", "NAN", "ATTEND_TOL", "MODEL_TOL",
    "assert_finite", "assert_close", "assert_bitwise", "assert_zero",
]

NAN = float("nan")
INF = float("inf")

# (atol, rtol) of one attention call (``attend``, a kernel, a varlen segment, a rotation, guidance) computed
# in a dtype against a float64 reference computed from the same (already rounded) inputs. In the spirit of
# flash-attention's tests, tied to the dtype: about five units of its epsilon for the half types (bfloat16
# 2**-7, float16 2**-10), about twice what the same attention done plainly in that dtype errs by; for
# float32 room for different summation orders in the kernels' forward and backward passes.
ATTEND_TOL = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (5e-5, 5e-5),
    torch.bfloat16: (4e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}

# (atol, rtol) of a module or a whole model (projections, norms, several layers) computed in a dtype
# against a float64 reference computed from the same weights and inputs: wider for the half types, whose
# rounding accumulates over the layers.
MODEL_TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (6e-2, 6e-2),
    torch.float16: (8e-3, 8e-3),
}


def assert_finite(t: Tensor | None, what: str = "tensor") -> None:
    """Fail unless ``t`` is a tensor with no NaN and no inf (``None``: no gradient reached it, a failure)."""
    assert t is not None, f"{what} is None (no gradient reached it)"
    t = t.detach()
    bad = ~torch.isfinite(t)
    assert not bool(bad.any()), (
        f"{what} holds {int(bad.sum())} non-finite value(s) ({int(torch.isnan(t).sum())} NaN), "
        f"first at {tuple(bad.nonzero()[0].tolist())}"
    )


def assert_close(
    actual: Tensor,
    expected: Tensor,
    what: str = "result",
    dtype: torch.dtype | None = None,
    *,
    table: dict[torch.dtype, tuple[float, float]] = MODEL_TOL,
    slack: Tensor | None = None,
) -> None:
    """``actual`` equals ``expected`` (usually a float64 reference) within the tolerance of ``dtype``.

    ``dtype`` is the dtype ``actual`` was computed in (default: its own); ``table`` maps it to
    ``(atol, rtol)``: ``MODEL_TOL`` (modules, models) or ``ATTEND_TOL`` (one attention call). An element
    passes when ``|actual - expected| <= atol * max(1, max|expected|) + rtol * |expected| + slack``: the
    absolute part grows with the largest magnitude of ``expected`` (gradients can be large), the relative
    part applies elementwise, ``slack`` (broadcast to ``expected``'s shape, default 0) is what a test
    knows the computation must err by on top. Both tensors must be finite (NaN never passes) and have the
    same shape.
    """
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_finite(actual, what)
    assert_finite(expected, f"expected {what}")
    if actual.numel() == 0:
        return
    dtype = dtype or actual.dtype
    atol, rtol = table[dtype]
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = max(1.0, float(e.abs().max()))
    err = (a - e).abs()
    bound = atol * scale + rtol * e.abs()
    if slack is not None:
        bound = bound + slack.detach().double().cpu()
    worst = int((err - bound).flatten().argmax())
    assert bool((err <= bound).all()), (
        f"{what} ({dtype}): max error {float(err.max()):.3g}; "
        f"at {tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))} "
        f"got {float(a.flatten()[worst]):.8g}, expected {float(e.flatten()[worst]):.8g} "
        f"(bound {float(bound.flatten()[worst]):.3g}: atol {atol}*{scale:.3g}, rtol {rtol})"
    )


def assert_bitwise(actual: Tensor, expected: Tensor, what: str = "result", *, inf_ok: bool = False) -> None:
    """Same shape, dtype and exactly the same values, all finite; with ``inf_ok`` an inf passes where
    ``expected`` holds the same one (e.g. logits a filter set to -inf). NaN never passes."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"
    )
    actual, expected = actual.detach(), expected.detach()
    if inf_ok:
        assert not bool(actual.isnan().any()), f"{what} holds {int(actual.isnan().sum())} NaN"
    else:
        assert_finite(actual, what)
    diff = actual != expected
    assert not bool(diff.any()), (
        f"{what} differs at {int(diff.sum())} element(s), first at {tuple(diff.nonzero()[0].tolist())}: "
        f"{float(actual[diff][0])} vs {float(expected[diff][0])}"
    )


def assert_zero(t: Tensor | None, what: str = "tensor", *, none_ok: bool = False) -> None:
    """Every element of ``t`` is exactly ``0.0`` (a NaN is not zero). ``None`` (no gradient path) fails
    unless ``none_ok``."""
    if t is None:
        assert none_ok, f"{what} is None (no gradient reached it)"
        return
    t = t.detach()
    nz = t != 0  # NaN != 0 is True
    assert not bool(nz.any()), (
        f"{what} must be exactly 0 but has {int(nz.sum())} nonzero element(s), first "
        f"{float(t[nz][0])} at {tuple(nz.nonzero()[0].tolist())}"
    )


def perturb_params(model: torch.nn.Module, seed: int = 0, scale: float = 0.3, relative: bool = False) -> torch.nn.Module:
    """Every parameter moved off its initial value by ``scale * N(0, 1)`` (seeded; ``relative``: times the
    parameter's mean magnitude + 0.1): weights at init (zeros, ones) would hide what a comparison means to see."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            step = scale * torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.add_(step * (p.abs().mean() + 0.1) if relative else step)
    return model


def check_padded_equals_alone(model: torch.nn.Module, dim: int, mask: Tensor) -> None:
    """A stack under padding ``mask (b, n)`` (its last sample may be entirely padding), NaN at every padded position:
    outputs and gradients finite, padded positions exactly 0 with no gradient, and each sample with a real token
    equal to it alone."""
    torch.manual_seed(3)
    x = torch.randn(*mask.shape, dim)
    x = torch.where(mask[..., None], x, float("nan")).requires_grad_()
    out = model(x, mask=mask)
    assert torch.isfinite(out).all() and (out[~mask] == 0).all()
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        for s in range(mask.shape[0]):
            if mask[s].any():
                alone = model(x[s: s + 1, mask[s]].detach())
                torch.testing.assert_close(out[s, mask[s]].detach(), alone[0], atol=1e-5, rtol=1e-5)
