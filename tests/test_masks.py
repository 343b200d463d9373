"""Tests for ``safeformer.core.masks``: the one mask convention (bool, True = may attend / is real), its
validation (S9), the mask builders, and the safe reductions (S8).

Shape legend: b batch, h heads, i queries, j keys, n sequence positions, c classes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ATTEND_TOL,
    INF,
    NAN,
    assert_bitwise,
    assert_close,
    assert_finite,
    assert_zero,
    causal_allowed,
    dense_masks,
    dtypes_for,
    mask_from_lengths,
    padding_masks,
    plant,
)
from hypothesis import given
from hypothesis import strategies as st

from safeformer.core.losses import masked_mean, safe_cross_entropy
from safeformer.core.masks import (
    _same_device,
    alive_keys,
    alive_rows,
    as_attention_mask,
    causal_mask,
    check_finite,
    combine_masks,
    dead_rows,
    key_padding_mask,
    padding_mask,
    query_padding_mask,
    validate_mask,
)

DTYPES = dtypes_for("cpu")
NON_BOOL = [torch.int64, torch.int32, torch.uint8, torch.int8, torch.float32, torch.float16, torch.bfloat16]

# ----------------------------------------------------------------------------------------------------
# validate_mask (S9)
# ----------------------------------------------------------------------------------------------------


def test_validate_mask_returns_the_mask_itself():
    m = torch.tensor([[True, False, True]])
    assert validate_mask(m) is m
    assert validate_mask(m, "context_mask", shape=(1, 3), device=torch.device("cpu")) is m
    assert validate_mask(m, shape=(None, 3), device="cpu") is m
    assert validate_mask(m, shape=(None, None)) is m


@pytest.mark.parametrize("dtype", NON_BOOL, ids=str)
def test_validate_mask_non_bool_is_type_error_naming_argument(dtype):
    """0/1 integer masks (HF) and float masks are refused, never read as bool: the message names the
    argument, the dtype it got and the convention."""
    with pytest.raises(TypeError, match=rf"context_mask must have dtype torch\.bool.*got {dtype}"):
        validate_mask(torch.ones(2, 3, dtype=dtype), "context_mask")
    with pytest.raises(TypeError, match=r"True = may attend"):
        validate_mask(torch.ones(2, 3, dtype=dtype))


@pytest.mark.parametrize("value", [[True, False], None, 1, "mask"], ids=["list", "none", "int", "str"])
def test_validate_mask_non_tensor_is_type_error(value):
    with pytest.raises(TypeError, match=rf"key_mask must be a torch\.bool tensor.*got {type(value).__name__}"):
        validate_mask(value, "key_mask")


@pytest.mark.parametrize(
    ("shape", "expected", "pattern"),
    [
        ((2, 3), (2, 4), r"mask must have shape \(2, 4\), got \(2, 3\)"),
        ((2, 3), (2, 3, 1), r"mask must have shape \(2, 3, 1\), got \(2, 3\)"),
        ((2, 3, 1), (2, 3), r"mask must have shape \(2, 3\), got \(2, 3, 1\)"),
        ((3, 2), (2, None), r"mask must have shape \(2, \*\), got \(3, 2\)"),
        ((0,), (1,), r"mask must have shape \(1\), got \(0,\)"),
    ],
)
def test_validate_mask_wrong_shape_is_value_error(shape, expected, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_mask(torch.ones(shape, dtype=torch.bool), shape=expected)


def test_validate_mask_wrong_device_is_value_error():
    """A mask on another device than the inputs is refused with both devices named."""
    m = torch.ones(2, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"padding_mask is on meta, expected cpu"):
        validate_mask(m, "padding_mask", device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"is on cpu, expected meta"):
        validate_mask(torch.ones(2, dtype=torch.bool), device="meta")


def test_same_device_matches_type_and_index():
    """'cuda' (no index) matches any cuda index; different indices or types do not match."""
    assert _same_device(torch.device("cuda"), torch.device("cuda:1"))
    assert _same_device(torch.device("cuda:0"), torch.device("cuda:0"))
    assert not _same_device(torch.device("cuda:0"), torch.device("cuda:1"))
    assert not _same_device(torch.device("cpu"), torch.device("cuda"))
    assert _same_device("cpu", torch.device("cpu"))


# ----------------------------------------------------------------------------------------------------
# padding masks
# ----------------------------------------------------------------------------------------------------


@given(lengths=st.lists(st.integers(0, 7), min_size=0, max_size=4), extra=st.integers(0, 3), left=st.booleans())
def test_padding_mask_left_and_right(lengths, extra, left):
    """True at each sample's real positions: the first `length` ones (right padding) or the last ones
    (left padding); the default length is the longest sample."""
    n = (max(lengths) if lengths else 0) + extra
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    got = padding_mask(lengths_t, n, left=left)
    assert got.dtype == torch.bool and got.shape == (len(lengths), n)
    assert torch.equal(got, mask_from_lengths(lengths, n, left=left))
    assert torch.equal(got.sum(-1), lengths_t)
    default = padding_mask(lengths_t, left=left)
    assert default.shape == (len(lengths), max(lengths) if lengths else 0)
    assert torch.equal(default, mask_from_lengths(lengths, default.shape[1], left=left))


def test_padding_mask_examples():
    lengths = torch.tensor([3, 0, 1])
    assert padding_mask(lengths, 4).tolist() == [
        [True, True, True, False], [False, False, False, False], [True, False, False, False]]
    assert padding_mask(lengths, 4, left=True).tolist() == [
        [False, True, True, True], [False, False, False, False], [False, False, False, True]]
    assert padding_mask(torch.tensor([], dtype=torch.long)).shape == (0, 0)


def test_key_and_query_padding_masks_stay_broadcast():
    """(b, j) -> (b, 1, 1, j) and (b, i) -> (b, 1, i, 1), as views of the same storage (nothing dense)."""
    m = mask_from_lengths([2, 0, 3], 4)
    k = key_padding_mask(m, 3, 4)
    q = query_padding_mask(m, 3, 4)
    assert k.shape == (3, 1, 1, 4) and q.shape == (3, 1, 4, 1)
    assert k.data_ptr() == m.data_ptr() and q.data_ptr() == m.data_ptr()
    assert torch.equal(k[:, 0, 0], m) and torch.equal(q[:, 0, :, 0], m)
    with pytest.raises(ValueError, match=r"ctx_mask must have shape \(3, 5\), got \(3, 4\)"):
        key_padding_mask(m, 3, 5, name="ctx_mask")
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 4\)"):
        query_padding_mask(m, 2, 4)
    with pytest.raises(TypeError, match=r"mask must have dtype torch\.bool"):
        key_padding_mask(m.long(), 3, 4)


# ----------------------------------------------------------------------------------------------------
# as_attention_mask
# ----------------------------------------------------------------------------------------------------


def _meaning(mask4d: torch.Tensor, b, h, i, j) -> torch.Tensor:
    return mask4d.expand(b, h, i, j)


@given(b=st.integers(1, 4), h=st.integers(1, 3), i=st.integers(1, 5), j=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_as_attention_mask_accepted_shapes(b, h, i, j, seed):
    """Each accepted shape keeps its meaning and its broadcast shape: (b, j) is key padding, (i, j) one
    mask for all samples (unless b == i, where 2-d is key padding), (b, i, j) per sample, 4-d with
    each size full or 1 unchanged. The results are views (no copy, nothing dense)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.rand(s, generator=g) < 0.5

    kp = rnd(b, j)
    got = as_attention_mask(kp, b, h, i, j)
    assert got.shape == (b, 1, 1, j) and got.data_ptr() == kp.data_ptr()
    for bi in range(b):
        for qi in range(i):
            assert torch.equal(_meaning(got, b, h, i, j)[bi, :, qi], kp[bi].expand(h, j))

    if b != i:
        ij = rnd(i, j)
        got = as_attention_mask(ij, b, h, i, j)
        assert got.shape == (1, 1, i, j) and torch.equal(got[0, 0], ij)

    bij = rnd(b, i, j)
    got = as_attention_mask(bij, b, h, i, j)
    assert got.shape == (b, 1, i, j) and torch.equal(got[:, 0], bij)

    for shape in [(b, h, i, j), (1, 1, 1, j), (b, 1, i, 1), (1, h, 1, 1), (1, 1, 1, 1)]:
        m = rnd(*shape)
        assert as_attention_mask(m, b, h, i, j) is m


def test_as_attention_mask_two_d_is_key_padding_when_b_equals_i():
    m = torch.tensor([[True, False, False], [True, True, True]])
    got = as_attention_mask(m, 2, 4, 2, 3)
    assert got.shape == (2, 1, 1, 3) and torch.equal(got[:, 0, 0], m)


@pytest.mark.parametrize(
    ("shape", "pattern"),
    [
        ((2, 4), r"attn_mask of 2 dims must be a key padding mask \(b, j\) = \(2, 5\) or an \(i, j\) = \(3, 5\).*got \(2, 4\)"),
        ((5, 2), r"got \(5, 2\)"),
        ((3, 2, 5), r"attn_mask of 3 dims must have shape \(b, i, j\) = \(2, 3, 5\), got \(3, 2, 5\)"),
        ((1, 3, 5), r"got \(1, 3, 5\)"),
        ((2, 2, 3, 5), r"size 2 for 'h'"),
        ((2, 4, 3, 4), r"size 4 for 'j'"),
        ((3, 1, 1, 5), r"size 3 for 'b'"),
        ((2, 1, 2, 5), r"size 2 for 'i'"),
        ((5,), r"attn_mask must have shape \(b, j\), \(i, j\), \(b, i, j\) or \(b\|1, h\|1, i\|1, j\|1\).*got \(5,\)"),
        ((), r"got \(\)"),
        ((1, 2, 4, 3, 5), r"got \(1, 2, 4, 3, 5\)"),
    ],
)
def test_as_attention_mask_rejects_other_shapes(shape, pattern):
    """Nothing is broadcast into a different meaning: every other shape is a ValueError naming it."""
    with pytest.raises(ValueError, match=pattern):
        as_attention_mask(torch.ones(shape, dtype=torch.bool), 2, 4, 3, 5, name="attn_mask")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32], ids=str)
def test_as_attention_mask_rejects_non_bool(dtype):
    with pytest.raises(TypeError, match=rf"attn_mask must have dtype torch\.bool.*{dtype}"):
        as_attention_mask(torch.ones(2, 5, dtype=dtype), 2, 4, 3, 5, name="attn_mask")


# ----------------------------------------------------------------------------------------------------
# causal_mask, combine_masks, dead_rows, alive_rows, alive_keys
# ----------------------------------------------------------------------------------------------------


@given(i=st.integers(0, 8), j=st.integers(0, 8))
def test_causal_mask_bottom_right(i, j):
    """Query q sees key k iff k <= q + (j - i): lower triangular for i == j, the last query sees every
    key for i <= j, and for i > j the first i - j queries are dead rows."""
    m = causal_mask(i, j)
    assert m.shape == (1, 1, i, j) and m.dtype == torch.bool
    assert torch.equal(m[0, 0], causal_allowed(i, j))
    rows_alive = m[0, 0].any(-1)
    if i == j:
        assert torch.equal(m[0, 0], torch.ones(i, i, dtype=torch.bool).tril())
    if i and j and i <= j:
        assert bool(m[0, 0, -1].all())  # the newest query sees the whole cache
        assert bool(rows_alive.all())
    if i > j:
        assert not bool(rows_alive[: i - j].any())  # dead rows
        assert bool(rows_alive[i - j :].all())
        assert torch.equal(dead_rows(m)[0, 0, :, 0], torch.arange(i) < i - j)


def test_causal_mask_examples_and_device():
    assert causal_mask(2, 4)[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert causal_mask(3, 1)[0, 0].tolist() == [[False], [False], [True]]
    assert causal_mask(2, 2, device="meta").device.type == "meta"


def test_combine_masks_none_and_identity():
    m = torch.tensor([[True, False]])
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    assert combine_masks(None, m, None) is m


@given(b=st.integers(1, 3), i=st.integers(1, 5), j=st.integers(1, 5), data=st.data())
def test_combine_masks_keeps_broadcast_shape(b, i, j, data):
    """The AND of masks has their broadcast shape, never more: padding stays (b, 1, 1, j), padding and
    causal give (b, 1, i, j), query and key padding (b, 1, i, j); never a head dimension."""
    kp = data.draw(padding_masks(b, j))[:, None, None, :]  # (b, 1, 1, j)
    qp = data.draw(padding_masks(b, i))[:, None, :, None]  # (b, 1, i, 1)
    causal = causal_mask(i, j)  # (1, 1, i, j)
    assert combine_masks(kp, None) is kp
    both = combine_masks(kp, causal)
    assert both.shape == (b, 1, i, j)
    assert torch.equal(both, kp.expand(b, 1, i, j) & causal.expand(b, 1, i, j))
    qk = combine_masks(qp, kp)
    assert qk.shape == (b, 1, i, j)
    for bi in range(b):
        for qi in range(i):
            for kj in range(j):
                assert bool(qk[bi, 0, qi, kj]) == (bool(qp[bi, 0, qi, 0]) and bool(kp[bi, 0, 0, kj]))
    three = combine_masks(qp, None, kp, causal)
    assert three.shape == (b, 1, i, j) and torch.equal(three, qk & causal)


@given(data=st.data(), b=st.integers(1, 3), h=st.integers(1, 2), i=st.integers(0, 5), j=st.integers(0, 5))
def test_dead_rows_alive_rows_alive_keys(data, b, h, i, j):
    """dead_rows / alive_rows are (..., i, 1), alive_keys (..., 1, j), computed here by loops."""
    m = data.draw(dense_masks((b, h, i, j)))
    alive, dead, keys = alive_rows(m), dead_rows(m), alive_keys(m)
    assert alive.shape == dead.shape == (b, h, i, 1) and keys.shape == (b, h, 1, j)
    assert torch.equal(dead, ~alive)
    for bi in range(b):
        for hi in range(h):
            for qi in range(i):
                assert bool(alive[bi, hi, qi, 0]) == any(bool(m[bi, hi, qi, kj]) for kj in range(j))
            for kj in range(j):
                assert bool(keys[bi, hi, 0, kj]) == any(bool(m[bi, hi, qi, kj]) for qi in range(i))


def test_dead_rows_padding_stays_broadcast():
    """A key padding mask (b, 1, 1, j) with a fully padded sample: one dead 'row' per sample, broadcast."""
    m = mask_from_lengths([2, 0], 3)[:, None, None, :]
    assert dead_rows(m).shape == (2, 1, 1, 1)
    assert dead_rows(m).flatten().tolist() == [False, True]
    assert alive_keys(m).flatten().tolist() == [True, True, False, False, False, False]


# ----------------------------------------------------------------------------------------------------
# masked_mean (S8)
# ----------------------------------------------------------------------------------------------------


def _masked_mean64(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(b, n, d) -> (b, d): plain loops, 0 for a sample with no real position."""
    b, n, d = x.shape
    out = torch.zeros(b, d, dtype=torch.float64)
    for bi in range(b):
        real = [p for p in range(n) if mask[bi, p]]
        for p in real:
            out[bi] += x[bi, p].double()
        if real:
            out[bi] /= len(real)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(b=st.integers(1, 4), n=st.integers(0, 7), d=st.integers(1, 5), garbage=st.sampled_from([NAN, INF, -INF]), data=st.data())
def test_masked_mean_matches_reference_and_does_not_leak(dtype, b, n, d, garbage, data):
    """The mean over real positions equals the float64 loop; NaN/inf at padded positions changes no
    bit; a sample with no real position gives exactly 0; gradient is 1/count at real positions and
    exactly 0 at padded ones and in empty samples."""
    mask = data.draw(padding_masks(b, n))
    seed = data.draw(st.integers(0, 2**31))
    x_clean = torch.randn(b, n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x = plant(x_clean, ~mask, garbage).requires_grad_()
    got = masked_mean(x, mask, dim=1)
    assert got.shape == (b, d) and got.dtype == dtype
    assert_close(got, _masked_mean64(x_clean, mask), "masked mean", dtype, table=ATTEND_TOL)
    assert_bitwise(got, masked_mean(x_clean, mask, dim=1), "masked mean with garbage in padding")
    empty = mask.sum(-1) == 0
    assert_zero(got[empty], "mean over zero real positions")
    with torch.autograd.detect_anomaly():
        (g,) = torch.autograd.grad(got, x, torch.ones_like(got))
    assert_zero(g[~mask], "grad at padded positions")
    count = mask.sum(-1, keepdim=True).clamp(min=1).to(torch.float64)
    expected = (1 / count)[:, :, None].expand(b, n, d) * mask[:, :, None]
    assert_close(g, expected, "grad of masked mean", dtype, table=ATTEND_TOL)


def test_masked_mean_zero_valid_positions_is_zero_with_zero_grad():
    x = torch.full((2, 3, 4), NAN, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = masked_mean(x, mask)
    out.sum().backward()
    assert_zero(out, "masked mean of nothing")
    assert_zero(x.grad, "its gradient")
    assert masked_mean(torch.zeros(2, 0, 4), torch.zeros(2, 0, dtype=torch.bool)).tolist() == [[0.0] * 4] * 2


def test_masked_mean_keepdim_none_mask_and_errors():
    x = torch.randn(2, 5, 3)
    mask = mask_from_lengths([5, 2], 5)
    assert masked_mean(x, mask, keepdim=True).shape == (2, 1, 3)
    assert_close(masked_mean(x, mask, keepdim=True)[:, 0], _masked_mean64(x, mask), "keepdim", torch.float32, table=ATTEND_TOL)
    assert_close(masked_mean(x, None), x.double().mean(1), "no mask", torch.float32, table=ATTEND_TOL)
    assert_close(masked_mean(x, torch.ones(2, 5, dtype=torch.bool)), x.double().mean(1), "all real", torch.float32, table=ATTEND_TOL)
    with pytest.raises(TypeError, match=r"mask must have dtype torch\.bool.*int64"):
        masked_mean(x, mask.long())
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 5\).*got \(2, 4\)"):
        masked_mean(x, mask[:, :4])
    with pytest.raises(ValueError, match=r"got \(5, 2\)"):
        masked_mean(x, mask.T.contiguous())


# ----------------------------------------------------------------------------------------------------
# safe_cross_entropy (S8)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_safe_cross_entropy_all_ignored_is_exactly_zero_with_zero_grad(dtype, reduction):
    """All targets ignored (an all-padding batch): the loss is exactly 0.0 and the gradient exactly 0,
    even with NaN logits everywhere (F.cross_entropy returns NaN for the mean here)."""
    logits = torch.full((2, 3, 5), NAN, dtype=dtype, requires_grad=True)
    target = torch.full((2, 3), -100)
    with torch.autograd.detect_anomaly():
        loss = safe_cross_entropy(logits, target, reduction=reduction)
        (g,) = torch.autograd.grad(loss.sum(), logits)
    assert loss.shape == (() if reduction != "none" else (2, 3))
    assert_zero(loss, "loss over no targets")
    assert_zero(g, "its gradient")
    assert torch.isnan(F.cross_entropy(torch.zeros(6, 5), target.reshape(6)))  # what S8 guards against


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(b=st.integers(1, 3), n=st.integers(1, 5), c=st.integers(2, 6), smoothing=st.sampled_from([0.0, 0.1]),
       ignore_index=st.sampled_from([-100, -1]), garbage=st.sampled_from([NAN, INF, -INF]), data=st.data())
def test_safe_cross_entropy_matches_torch_on_valid_and_does_not_leak(dtype, reduction, b, n, c, smoothing, ignore_index, garbage, data):
    """On the counted targets the loss and its gradient equal F.cross_entropy (float64); NaN/inf
    logits at ignored positions change no bit of the loss and get exactly zero gradient."""
    seed = data.draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    valid = data.draw(padding_masks(b, n))
    target = torch.where(valid, torch.randint(0, c, (b, n), generator=g), ignore_index)
    clean = torch.randn(b, n, c, generator=g).to(dtype)
    logits = plant(clean, ~valid, garbage).requires_grad_()
    loss = safe_cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing)
    assert_bitwise(loss, safe_cross_entropy(clean, target, ignore_index=ignore_index, reduction=reduction,
                                                  label_smoothing=smoothing), "loss with garbage at ignored logits")
    ref_logits = clean.double().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, c), target.reshape(-1), ignore_index=ignore_index,
                          reduction=reduction, label_smoothing=smoothing)
    if reduction == "none":
        ref = ref.reshape(b, n)
    elif reduction == "mean" and not bool(valid.any()):
        ref = torch.zeros((), dtype=torch.float64) + 0 * ref_logits.sum()  # torch gives NaN here; S8 says 0
    assert_close(loss, ref, f"{reduction} loss", dtype, table=ATTEND_TOL)
    up = torch.randn(loss.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(loss, logits, up.to(loss.dtype))
    (ref_grad,) = torch.autograd.grad(ref, ref_logits, up)
    assert_close(grad, ref_grad, "grad of logits", dtype, table=ATTEND_TOL)
    assert_zero(grad[~valid], "grad at ignored positions")


def test_safe_cross_entropy_flat_logits_and_int32_targets():
    logits = torch.randn(6, 4)
    target = torch.tensor([0, 3, -100, 1, -100, 2], dtype=torch.int32)
    got = safe_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.double(), target.long())
    assert_close(got, ref, "flat logits", torch.float32, table=ATTEND_TOL)


@pytest.mark.parametrize(
    ("logits", "target", "kwargs", "exc", "pattern"),
    [
        (torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), {"reduction": "max"}, ValueError, r"reduction.*'max'"),
        (torch.randn(2, 3, 4), torch.zeros(2, 3), {}, TypeError, r"target must hold integer class indices.*float32"),
        (torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), {}, ValueError, r"\(2, 4, c\), got \(2, 3, 4\)"),
        (torch.randn(6, 4), torch.zeros(2, 3, dtype=torch.long), {}, ValueError, r"got \(6, 4\)"),
    ],
)
def test_safe_cross_entropy_errors(logits, target, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        safe_cross_entropy(logits, target, **kwargs)


# ----------------------------------------------------------------------------------------------------
# check_finite (S9)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_check_finite_reports_real_positions_only(bad):
    """A non-finite value at a real position raises ValueError naming the tensor and the (b, n)
    position; at a padded position it is allowed; without a mask every position is real."""
    x = torch.randn(2, 4, 3)
    mask = mask_from_lengths([4, 2], 4)
    padded = x.clone()
    padded[1, 3, 0] = bad
    assert check_finite(padded, mask, "context") is None
    with pytest.raises(ValueError, match=r"context holds a non-finite value \(NaN or inf\) at real position \(1, 3\); 1 real"):
        check_finite(padded, None, "context")
    real = x.clone()
    real[1, 1, 2] = bad
    real[0, 2, 0] = bad
    with pytest.raises(ValueError, match=r"x holds a non-finite value .* at real position \(0, 2\); 2 real position"):
        check_finite(real, mask, "x")
    assert check_finite(x, mask, "x") is None
    assert check_finite(torch.tensor([[1, 2]]), None, "tokens") is None  # integer tensors hold no NaN


def test_check_finite_two_d_input():
    x = torch.tensor([[1.0, NAN], [2.0, 3.0]])
    assert check_finite(x, torch.tensor([[True, False], [True, True]]), "x") is None
    with pytest.raises(ValueError, match=r"at real position \(0, 1\)"):
        check_finite(x, torch.ones(2, 2, dtype=torch.bool), "x")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32], ids=str)
def test_check_finite_rejects_non_bool_mask(dtype):
    x = torch.randn(2, 4, 3)
    with pytest.raises(TypeError, match=r"mask.*torch\.bool"):
        check_finite(x, torch.ones(2, 4, dtype=dtype), "x")


def test_check_finite_rejects_wrong_mask_shape():
    x = torch.randn(3, 3, 2)
    x[0, 1, 0] = NAN
    with pytest.raises(ValueError, match=r"mask.*shape"):
        check_finite(x, torch.tensor([True, False, True]), "x")


def test_contract_helpers_never_pass_nan():
    """The suite's own comparisons: NaN (and inf) fail every one of them, even against NaN."""
    x = torch.randn(2, 3, 4)
    assert_finite(x)
    y = x.clone()
    y[1, 2, 3] = NAN
    for check in (
        lambda: assert_finite(y),
        lambda: assert_close(y, y.double(), "result", torch.float32, table=ATTEND_TOL),
        lambda: assert_close(x, y.double(), "result", torch.float32, table=ATTEND_TOL),
        lambda: assert_bitwise(y, y),
        lambda: assert_zero(torch.tensor([0.0, NAN])),
        lambda: assert_close(torch.tensor([INF]), torch.tensor([INF], dtype=torch.float64), "result", torch.float32, table=ATTEND_TOL),
        lambda: assert_close(x + 1e-3, x.double(), "result", torch.float32, table=ATTEND_TOL),
    ):
        with pytest.raises(AssertionError):
            check()
    assert_close(x + 1e-7, x.double(), "result", torch.float32, table=ATTEND_TOL)
    with pytest.raises(ValueError, match=r"at real position \(1, 2\)"):
        check_finite(y, None, "y")
