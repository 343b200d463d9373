"""Shared helpers for the safety-contract suite (SAFETY_CONTRACT.md, S1-S9).

Every module test reuses these: the devices and dtypes to run on, dtype-tied tolerances, a comparison
that NaN can never pass, hypothesis strategies that draw masks with dead rows on purpose, a kernel that
misbehaves on purpose (S6), a float64 reference attention in the plainest code, and ``plant`` to put
garbage at masked positions.

Shape legend: b batch, h query heads, h_kv key/value heads, g = h // h_kv, i queries, j keys,
d head dim (q, k), e head dim (v), n sequence positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import Tensor

NAN = float("nan")
INF = float("inf")

# ----------------------------------------------------------------------------------------------------
# Devices, dtypes, backends, tolerances
# ----------------------------------------------------------------------------------------------------

DEVICES: list[str] = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

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


def device_dtype_backend_params() -> list[tuple[str, torch.dtype, str]]:
    """Every (device, dtype, backend) combination to parametrize the contract tests over."""
    return [(dev, dt, be) for dev in DEVICES for dt in dtypes_for(dev) for be in backends_for(dev)]


# (atol, rtol) of a result computed in a dtype against a float64 reference computed from the same
# (already rounded) inputs. In the spirit of flash-attention's tests, tied to the dtype: about five units
# of its epsilon for the half types (bfloat16 2**-7, float16 2**-10), about twice what the same attention
# done plainly in that dtype errs by; for float32 room for different summation orders in the kernels'
# forward and backward passes. The absolute part scales with max(1, max|expected|).
_TOL = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (5e-5, 5e-5),
    torch.bfloat16: (4e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}


def tol(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing a result computed in ``dtype`` with a float64 reference."""
    return _TOL[dtype]


def assert_all_finite(t: Tensor | None, what: str = "tensor") -> None:
    """Fail unless ``t`` is a tensor with no NaN and no inf."""
    assert t is not None, f"{what} is None (no gradient reached it)"
    bad = ~torch.isfinite(t)
    assert not bool(bad.any()), (
        f"{what} holds {int(bad.sum())} non-finite value(s) ({int(torch.isnan(t).sum())} NaN), "
        f"first at {tuple(bad.nonzero()[0].tolist())}"
    )


def assert_close_finite(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str = "result") -> None:
    """``actual`` (computed in ``dtype``) equals ``expected`` (float64) within ``tol(dtype)``; NaN always fails.

    The absolute tolerance scales with the size of ``expected`` (gradients can be large); the relative
    one applies elementwise. Both tensors must be finite and have the same shape.
    """
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_all_finite(actual, what)
    assert_all_finite(expected, f"reference {what}")
    if actual.numel() == 0:
        return
    atol, rtol = tol(dtype)
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = max(1.0, float(e.abs().max()))
    err = (a - e).abs()
    bound = atol * scale + rtol * e.abs()
    excess = err - bound
    worst = int(excess.flatten().argmax())
    assert bool((err <= bound).all()), (
        f"{what} ({dtype}) differs from the float64 reference: max error {float(err.max()):.3g} "
        f"at {tuple(torch.unravel_index(torch.tensor(worst), a.shape))}, "
        f"got {float(a.flatten()[worst]):.6g}, expected {float(e.flatten()[worst]):.6g} "
        f"(atol {atol}*{scale:.3g}, rtol {rtol})"
    )


def assert_exactly_zero(t: Tensor | None, what: str = "tensor") -> None:
    """Fail unless every element of ``t`` is exactly ``0.0`` (a NaN is not zero)."""
    assert t is not None, f"{what} is None (no gradient reached it)"
    nz = t != 0  # NaN != 0 is True
    assert not bool(nz.any()), (
        f"{what} must be exactly 0 but has {int(nz.sum())} nonzero element(s), first "
        f"{float(t[nz][0])} at {tuple(nz.nonzero()[0].tolist())}"
    )


def assert_bitwise_equal(actual: Tensor, expected: Tensor, what: str = "result") -> None:
    """Same shape, dtype and exactly the same values, all finite (NaN never passes)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"
    )
    assert_all_finite(actual, what)
    diff = actual != expected
    assert not bool(diff.any()), (
        f"{what} changed at {int(diff.sum())} element(s), first at {tuple(diff.nonzero()[0].tolist())}: "
        f"{float(actual[diff][0])} vs {float(expected[diff][0])}"
    )


def grads(out: Tensor, inputs: Sequence[Tensor], upstream: Tensor) -> list[Tensor]:
    """Gradients of ``(out * upstream).sum()`` w.r.t. ``inputs``; an input the graph misses is a failure.

    The graph is kept, so a test may ask again with another upstream gradient.
    """
    return list(torch.autograd.grad(out, list(inputs), grad_outputs=upstream.to(out.dtype), retain_graph=True))


def reference_grads(out: Tensor, inputs: Sequence[Tensor], upstream: Tensor) -> list[Tensor]:
    """Like ``grads`` for the reference: an input the output does not depend on gets zeros."""
    if not out.requires_grad:
        return [torch.zeros_like(x, dtype=torch.float64) for x in inputs]
    got = torch.autograd.grad(out, list(inputs), grad_outputs=upstream.to(out.dtype), allow_unused=True)
    return [torch.zeros_like(x, dtype=torch.float64) if g is None else g for g, x in zip(got, inputs)]


# ----------------------------------------------------------------------------------------------------
# Planting garbage
# ----------------------------------------------------------------------------------------------------


def plant(x: Tensor, masked_positions: Tensor, value: float) -> Tensor:
    """A copy of ``x`` with ``value`` (NaN, +inf, -inf, anything) at ``masked_positions``.

    ``masked_positions`` is a bool tensor over the leading dims of ``x`` (e.g. ``(b, h_kv, j)`` for k of
    shape ``(b, h_kv, j, d)``); it is broadcast over the trailing feature dims.
    """
    pos = masked_positions.to(x.device)
    pos = pos.reshape(*pos.shape, *([1] * (x.dim() - pos.dim())))
    fill = torch.tensor(value, dtype=torch.float64).to(x.dtype)  # -3e38 in float16 is -inf, as a cast gives
    return x.masked_fill(pos, fill.to(x.device))


PLANT_VALUES = (NAN, INF, -INF, 1e4, -3e38)


# ----------------------------------------------------------------------------------------------------
# The plainest float64 attention
# ----------------------------------------------------------------------------------------------------


def causal_allowed(i: int, j: int) -> Tensor:
    """``(i, j)``: bottom-right aligned causal, written as loops: query q sees key k iff k <= q + (j - i)."""
    allowed = torch.zeros(i, j, dtype=torch.bool)
    for qi in range(i):
        for kj in range(j):
            allowed[qi, kj] = kj <= qi + (j - i)
    return allowed


def allowed_matrix(b: int, h: int, i: int, j: int, mask4d: Tensor | None, causal: bool) -> Tensor:
    """The combined ``(b, h, i, j)`` bool matrix: the user's mask AND (bottom-right) causal."""
    allowed = torch.ones(b, h, i, j, dtype=torch.bool)
    if mask4d is not None:
        allowed = allowed & mask4d.cpu()
    if causal:
        allowed = allowed & causal_allowed(i, j)
    return allowed


def reference_attention64(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask4d: Tensor | None = None,
    scale: float | None = None,
    *,
    causal: bool = False,
    bias: Tensor | None = None,
) -> Tensor:
    """Attention in float64, one query row at a time, in the plainest code.

    Masked keys are *selected away* (indexing), never multiplied by 0, so garbage there cannot reach the
    result. A dead row (no allowed key) is 0. Grouped-query attention by ``repeat_interleave``; causal is
    bottom-right aligned; ``bias`` is added to the logits of the allowed keys. Differentiable.
    """
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    b, h, i, d = q.shape
    h_kv, j, e = k.shape[1], k.shape[2], v.shape[-1]
    k = k.repeat_interleave(h // h_kv, dim=1)  # (b, h, j, d)
    v = v.repeat_interleave(h // h_kv, dim=1)  # (b, h, j, e)
    scale = d**-0.5 if scale is None else scale
    allowed = allowed_matrix(b, h, i, j, mask4d, causal)
    full_bias = None if bias is None else bias.double().cpu().expand(b, h, i, j)
    rows = []
    for bi in range(b):
        for hi in range(h):
            for qi in range(i):
                keys = allowed[bi, hi, qi].nonzero().flatten()
                if len(keys) == 0:
                    rows.append(torch.zeros(e, dtype=torch.float64))
                    continue
                logits = (k[bi, hi, keys] @ q[bi, hi, qi]) * scale  # (n_keys,)
                if full_bias is not None:
                    logits = logits + full_bias[bi, hi, qi, keys]
                weights = torch.exp(logits - logits.max())
                weights = weights / weights.sum()
                rows.append(weights @ v[bi, hi, keys])  # (e,)
    if not rows:
        return torch.zeros(b, h, i, e, dtype=torch.float64)
    return torch.stack(rows).reshape(b, h, i, e)


# ----------------------------------------------------------------------------------------------------
# Kernels that misbehave on purpose (S6) or record what they are given
# ----------------------------------------------------------------------------------------------------

_REAL_SDPA = F.scaled_dot_product_attention


def _kernel_dead_rows(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """``(b|1, h|1, i, 1)``: rows the kernel is handed with no key to attend to."""
    i, j = q.shape[-2], k.shape[-2]
    if attn_mask is None:  # SDPA's is_causal is top-left aligned: row r sees keys 0..r, so only j == 0 kills
        return torch.full((1, 1, i, 1), j == 0, dtype=torch.bool, device=q.device)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask != -INF
    rows = ~allowed.any(dim=-1, keepdim=True)  # (b|1, h|1, i|1, 1)
    while rows.dim() < 4:
        rows = rows[None]
    return rows


def _old_kernel(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale, enable_gqa: bool) -> Tensor:
    """Attention as kernels before torch 2.5 computed it: a plain softmax, so a row with no key to
    attend to is NaN in the forward pass, and its backward puts NaN into q, k and v even when the
    gradient flowing into that row is 0 (softmax backward multiplies by the NaN output)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale  # (b, h, i, j)
    if is_causal:
        attn_mask = torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # an additive -inf, so NaN flows back
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=q.device).masked_fill(~attn_mask, -INF)
    if attn_mask is not None:
        logits = logits + attn_mask.to(dtype)
    return (logits.softmax(dim=-1) @ v.to(dtype)).to(q.dtype)


def _kernel_masked_keys(attn_mask: Tensor | None, bad_rows: Tensor, b: int, j: int) -> Tensor:
    """``(b|1, 1, j, 1)``: keys that no row outside ``bad_rows`` may attend to, by the kernel's mask."""
    if attn_mask is None:
        return torch.zeros(1, 1, j, 1, dtype=torch.bool, device=bad_rows.device)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask != -INF
    while allowed.dim() < 4:
        allowed = allowed[None]
    seen = (allowed & ~bad_rows).any(dim=-2).any(dim=1)  # (b|1, j)
    return ~seen[:, None, :, None]


class PoisonedSDPA(torch.autograd.Function):
    """The real SDPA, then NaN (or ``value``) written where a kernel misbehaving on purpose would:

    forward: into every row of ``bad_rows (b|1, h|1, i, 1)``; backward: into the gradient of q at those
    rows, and into the gradients of k and v at ``bad_keys (b|1, 1, j, 1)``, whatever gradient flows
    in (a kernel that is wrong on dead rows is wrong in its backward too). The backward recomputes
    the real SDPA to get the true gradients first.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, bad_rows, bad_keys, value):
        ctx.save_for_backward(q, k, v, attn_mask, bad_rows, bad_keys)
        ctx.args = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        ctx.value = value
        out = _REAL_SDPA(q, k, v, attn_mask=attn_mask, **ctx.args)
        return out.clone().masked_fill_(bad_rows, value)  # in place on a clone: the kernel's memory layout kept

    @staticmethod
    def backward(ctx, grad):
        q, k, v, attn_mask, bad_rows, bad_keys = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out = _REAL_SDPA(qq, kk, vv, attn_mask=attn_mask, **ctx.args)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad)
        dq, dk, dv = _fill(dq, bad_rows, ctx.value), _fill(dk, bad_keys, ctx.value), _fill(dv, bad_keys, ctx.value)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _fill(t: Tensor, where: Tensor, value: float) -> Tensor:
    """``t`` with ``value`` at ``where``, in place when ``t`` owns its memory (the layout a kernel chose
    is kept); an expanded tensor (e.g. a broadcast zero gradient) is copied first."""
    if 0 in t.stride() or t._base is not None:
        t = t.clone()
    return t.masked_fill_(where, value)


def poisoned_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, bad_rows: Tensor, value: float = NAN) -> Tensor:
    """``PoisonedSDPA`` with the masked keys found from the kernel's mask and ``bad_rows``."""
    b, h, i = q.shape[:3]
    bad_rows = bad_rows.expand(b, h, i, 1)
    bad_keys = _kernel_masked_keys(attn_mask, bad_rows, b, k.shape[-2])
    return PoisonedSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, bad_rows, bad_keys, value)


def nan_kernel(dead: Tensor | None = None, *, value: float = NAN, calls: list | None = None) -> Callable[..., Tensor]:
    """A stand-in for ``F.scaled_dot_product_attention`` that misbehaves on dead rows (S6).

    It runs the real SDPA and writes ``value`` (NaN by default) into the rows handed to it with no key
    to attend to (mask row all False / all -inf) and into every row that ``dead`` marks (bool,
    broadcastable to ``(b, h, i)``: the rows the test knows are dead, which a safe caller may have
    handed over as ordinary rows). Its backward writes ``value`` into the gradient of q at those rows
    and into the gradients of k and v at the keys that no other row may see, whatever gradient flows
    in; rows handed no key at all also get the NaN gradients of a pre-2.5 softmax (into every key of
    their sample). ``calls``, if given, receives one dict per call.
    """

    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if calls is not None:
            calls.append(_describe(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))
        keyless = _kernel_dead_rows(q, k, attn_mask, is_causal)  # (b|1, h|1, i|1, 1)
        rows = keyless if dead is None else keyless | dead.to(q.device)[..., None]
        out = poisoned_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, rows, value)
        if bool(keyless.any()):  # rows handed no key at all: a pre-2.5 softmax's NaN gradients as well
            old = _old_kernel(q, k, v, attn_mask, is_causal, scale, enable_gqa)
            out = torch.where(keyless, old, out).masked_fill(keyless, value)
        return out

    return kernel


def recording_kernel(calls: list) -> Callable[..., Tensor]:
    """A stand-in for SDPA that appends a description of each call to ``calls`` and runs the real SDPA."""

    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(_describe(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))
        return _REAL_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    return kernel


def _describe(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> dict:
    return {
        "q_shape": tuple(q.shape),
        "k_shape": tuple(k.shape),
        "mask_shape": None if attn_mask is None else tuple(attn_mask.shape),
        "mask_dtype": None if attn_mask is None else attn_mask.dtype,
        "rows_without_keys": None if attn_mask is None else int(_kernel_dead_rows(q, k, attn_mask, is_causal).sum()),
        "is_causal": is_causal,
        "dropout_p": dropout_p,
        "scale": scale,
        "enable_gqa": enable_gqa,
    }


# ----------------------------------------------------------------------------------------------------
# Hypothesis strategies: masks with dead rows on purpose
# ----------------------------------------------------------------------------------------------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mask_from_lengths(lengths: Sequence[int], n: int, *, left: bool = False) -> Tensor:
    """``(b, n)`` padding mask written plainly: True at the ``lengths[s]`` real positions of sample s."""
    mask = torch.zeros(len(lengths), n, dtype=torch.bool)
    for s, length in enumerate(lengths):
        if left:
            mask[s, n - length :] = True
        else:
            mask[s, :length] = True
    return mask


@st.composite
def padding_masks(draw, b: int, n: int, *, side: str | None = None, holes: bool = True) -> Tensor:
    """``(b, n)`` padding masks (True = real). Fully padded samples (length 0) and full ones on purpose;
    padding on the right or the left (``side`` fixes it), and sometimes scattered holes."""
    lengths = draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    if b and n and draw(st.booleans()):  # a fully padded sample on purpose
        lengths[draw(st.integers(0, b - 1))] = 0
    left = draw(st.sampled_from(["right", "left"])) == "left" if side is None else side == "left"
    mask = mask_from_lengths(lengths, n, left=left)
    if holes and b and n and draw(st.integers(0, 3)) == 0:
        mask &= torch.rand(b, n, generator=_generator(draw(st.integers(0, 2**31)))) < 0.7
    return mask


@st.composite
def dense_masks(draw, shape: tuple[int, ...]) -> Tensor:
    """A random bool mask of ``shape`` (last two dims ``(i, j)``) with dead rows on purpose: some rows
    all False, sometimes a whole leading slice (a sample, a head) all False, sometimes all False/True."""
    *lead, i, j = shape
    density = draw(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]))
    mask = torch.rand(shape, generator=_generator(draw(st.integers(0, 2**31)))) < density
    if i and draw(st.booleans()):  # some rows all False, in every sample/head
        rows = draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=i, unique=True))
        mask[..., rows, :] = False
    if lead and lead[0] and draw(st.booleans()):  # one sample all False
        mask[draw(st.integers(0, lead[0] - 1))] = False
    return mask


MASK_KINDS = ("none", "key_padding", "shared", "full", "per_head", "query_padding")


@st.composite
def attention_masks(draw, b: int, h: int, i: int, j: int, kind: str) -> tuple[Tensor | None, Tensor | None]:
    """``(mask as given to attend, the same as a 4-d (b|1, h|1, i|1, j|1) mask for the reference)``.

    Kinds: ``none``; ``key_padding`` ``(b, j)``; ``shared`` ``(i, j)`` (given 4-d when ``b == i``, where
    a 2-d mask reads as key padding); ``full`` ``(b, i, j)``; ``per_head`` ``(b, h, i, j)``;
    ``query_padding`` ``(b, 1, i, 1)`` (padded queries are dead rows).
    """
    if kind == "none":
        return None, None
    if kind == "key_padding":
        m = draw(padding_masks(b, j))
        return m, m[:, None, None, :]
    if kind == "query_padding":
        m = draw(padding_masks(b, i))[:, None, :, None]
        return m, m
    if kind == "shared":
        m = draw(dense_masks((i, j)))
        return (m[None, None] if b == i else m), m[None, None]
    if kind == "full":
        m = draw(dense_masks((b, i, j)))
        return m, m[:, None]
    if kind == "per_head":
        m = draw(dense_masks((b, h, i, j)))
        return m, m
    raise ValueError(f"unknown mask kind {kind!r}")


@dataclass
class AttnCase:
    """One drawn attention problem: shapes, a mask (with dead rows on purpose), causal, garbage to plant."""

    b: int
    h: int
    h_kv: int
    i: int
    j: int
    d: int
    e: int
    kind: str
    mask: Tensor | None  # as passed to attend
    mask4d: Tensor | None  # the same, 4-d, for the reference
    causal: bool
    planted: float  # the garbage put at masked keys and dead queries
    seed: int

    def allowed(self) -> Tensor:
        """``(b, h, i, j)`` combined mask."""
        return allowed_matrix(self.b, self.h, self.i, self.j, self.mask4d, self.causal)

    def dead(self) -> Tensor:
        """``(b, h, i)``: dead rows."""
        return ~self.allowed().any(dim=-1)

    def masked_keys(self) -> Tensor:
        """``(b, h_kv, j)``: keys no query of any head sharing the key/value head may attend to."""
        a = self.allowed().any(dim=-2)  # (b, h, j)
        return ~a.reshape(self.b, self.h_kv, self.h // self.h_kv, self.j).any(dim=2)

    def clean(self, dtype: torch.dtype = torch.float32, device: str = "cpu", scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v drawn from the case's seed (no garbage), rounded to ``dtype``; not leaves."""
        g = _generator(self.seed)
        q = torch.randn(self.b, self.h, self.i, self.d, generator=g, dtype=torch.float64) * scale
        k = torch.randn(self.b, self.h_kv, self.j, self.d, generator=g, dtype=torch.float64) * scale
        v = torch.randn(self.b, self.h_kv, self.j, self.e, generator=g, dtype=torch.float64)
        return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))

    def inputs(self, dtype: torch.dtype = torch.float32, device: str = "cpu", *, garbage: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Leaf q, k, v (requires_grad) with ``planted`` at masked keys/values and dead queries."""
        q, k, v = self.clean(dtype, device)
        if garbage:
            q = plant(q, self.dead(), self.planted)
            k = plant(k, self.masked_keys(), self.planted)
            v = plant(v, self.masked_keys(), self.planted)
        return tuple(t.detach().requires_grad_() for t in (q, k, v))

    def upstream(self, dtype: torch.dtype = torch.float64, device: str = "cpu") -> Tensor:
        """A random upstream gradient ``(b, h, i, e)`` for the output."""
        g = _generator(self.seed + 1)
        return torch.randn(self.b, self.h, self.i, self.e, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


@st.composite
def attention_cases(
    draw,
    *,
    max_b: int = 3,
    max_len: int = 6,
    kinds: Sequence[str] = MASK_KINDS,
    causal: bool | None = None,
    allow_empty: bool = True,
    same_head_dims: bool = True,
) -> AttnCase:
    """Random attention problems: batch 0..max_b, lengths 0..max_len (0 only if ``allow_empty``),
    grouped-query ratios 1..3, every mask kind, causal on/off (``causal`` fixes it), self-attention
    (``i == j``) half of the time, garbage (NaN, +-inf, huge) to plant at masked positions."""
    lo = 0 if allow_empty else 1
    b = draw(st.integers(lo, max_b))
    h_kv = draw(st.integers(1, 2))
    h = h_kv * draw(st.integers(1, 3))
    i = draw(st.integers(lo, max_len))
    j = i if draw(st.booleans()) else draw(st.integers(lo, max_len))
    d = draw(st.sampled_from([8, 16]))
    e = d if same_head_dims else draw(st.sampled_from([4, 8, 16]))
    kind = draw(st.sampled_from(list(kinds)))
    mask, mask4d = draw(attention_masks(b, h, i, j, kind))
    is_causal = draw(st.booleans()) if causal is None else causal
    planted = draw(st.sampled_from(PLANT_VALUES))
    seed = draw(st.integers(0, 2**31))
    return AttnCase(b, h, h_kv, i, j, d, e, kind, mask, mask4d, is_causal, planted, seed)
