"""Precision, per-sample condition dropping, and limits tested at the boundary.

A. Half-precision *accuracy* against float64 references (not mere finiteness), with tolerances tied
   to the dtype (``helpers.ATTEND_TOL``): rotary positions up to 8192 (angles in float32 even for a ``.half()``
   model), ``guided_logits`` (float32 result, no overflow, ``-inf`` kept, rescale over finite tokens),
   ``safe_cross_entropy``, ``masked_mean``, ``return_pooled`` of a ``.half()`` model, RMSNorm / LayerNorm.
B. Condition dropping at ``0 < p < 1``: a true per-sample draw, each sample's result bit for bit that of
   its conditioned or unconditioned run, and a dropped sample's context never read (NaN there).
C. Every limit at the boundary: ``max_seq_len`` exactly and one more, ``top_k`` k = 1 / v / v + 1,
   ``top_p`` 1.0 and next to a cumulative-mass boundary, ``min_p`` 0 and 1, drop probability 0 / 1 and
   just outside, ``guidance_rescale`` 0 / 1 and just outside, temperature 0, dropout 0 and 1, a context
   of length 0 and 1, ``kv_heads`` = heads and 1.

References are written plainly in float64 (``helpers.references``). Shape legend: b batch,
n positions, h heads, d head dim, j context length, c width, v vocabulary.
"""

from __future__ import annotations

import copy
import math

import helpers as hp
import pytest
import torch
import torch.nn.functional as F
from helpers import ATTEND_TOL, assert_bitwise, assert_close, assert_finite, assert_zero
from torch import Tensor

import safeformer as sf

NAN, INF = float("nan"), float("inf")
HALF = [torch.float16, torch.bfloat16]
LOW = [torch.float32, torch.float16, torch.bfloat16]
DT_IDS = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float64) -> Tensor:
    return (torch.randn(*shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


# ====================================================================================================
# A. Half-precision accuracy
# ====================================================================================================

# ---------------------------------------------------------------------------------------------------- rotary


def assert_rotated_close(out: Tensor, t: Tensor, pos: Tensor, rot_dim: int, dtype: torch.dtype, what: str) -> None:
    """``out`` is ``t (b, h, n, d)`` rotated by ``pos (b, n)``, within ``ATTEND_TOL[dtype]`` plus what a float32
    angle must err by.

    An angle ``pos * inv_freq`` computed in float32 is off by up to about ``2 * 2**-24 * |angle|`` (the
    rounding of ``inv_freq`` and of the product): at position 8192 that is ~1e-3 rad, below the half
    types' tolerance but above float32's. That slack, times the length of the rotated pair, is added to
    the bound (0 for float64). An angle computed in float16 or bfloat16 is off by radians, not by 1e-3.
    """
    assert out.dtype == t.dtype, f"{what}: {out.dtype}, not {t.dtype}"
    eps = 0.0 if dtype == torch.float64 else 2.0**-24
    max_angle = float(pos.abs().max())
    t64 = t.double()
    pair_len = (t64[..., :rot_dim].reshape(*t.shape[:-1], rot_dim // 2, 2).norm(dim=-1)).repeat_interleave(2, dim=-1)
    slack = torch.zeros_like(t64)
    slack[..., :rot_dim] = 4 * eps * max_angle * pair_len
    assert_close(out, hp.ref_rotate(t, pos[:, None], rot_dim), what, dtype, table=ATTEND_TOL, slack=slack)


@pytest.mark.parametrize("dtype", [torch.float64, *LOW], ids=lambda d: DT_IDS[d])
def test_apply_rotary_at_positions_up_to_8192_matches_float64(dtype):
    rot_dim, d = 16, 24  # 8 features pass through untouched
    pos = torch.cat((torch.arange(0, 4), torch.arange(2045, 2052), torch.arange(8192 - 21, 8193)))[None]  # (1, 33)
    pos = torch.cat((pos, pos.flip(-1)))  # (2, 33): per-sample positions
    t = _randn(2, 3, pos.shape[1], d, seed=1, scale=3.0, dtype=dtype)
    angles = sf.RotaryEmbedding(rot_dim).angles(pos, dtype=dtype)
    assert angles.dtype == torch.promote_types(dtype, torch.float32), f"angles computed in {angles.dtype}"
    out = sf.apply_rotary(t, angles)
    assert_rotated_close(out, t, pos, rot_dim, dtype, "apply_rotary")
    assert_bitwise(out[..., rot_dim:], t[..., rot_dim:], "features past rotary_emb_dim")


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: DT_IDS[d])
def test_rotary_of_a_half_cast_stack_computes_angles_in_float32(dtype):
    """A ``.to(half)`` stack asks its RotaryEmbedding for half angles; they must still come out float32
    and right up to position 8191 (float16 holds integers exactly only up to 2048, bfloat16 up to 256)."""
    layers = sf.Decoder(dim=32, depth=1, heads=2, dim_head=16, rotary_pos_emb=True).to(dtype)
    pos = torch.tensor([[3, 255, 257, 2047, 2049, 4099, 8190, 8191]])
    angles = layers.rotary(pos, dtype=dtype)
    assert angles.dtype == torch.float32, f"a {dtype} model computed its rotary angles in {angles.dtype}"
    inv = torch.tensor([10000.0 ** (-2.0 * k / 8) for k in range(4)], dtype=torch.float64)
    expected = (pos.double()[..., None] * inv).repeat_interleave(2, dim=-1)[:, None]  # (1, 1, n, 8)
    assert_close(angles, expected, "rotary angles of a half model", torch.float32, table=ATTEND_TOL)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: DT_IDS[d])
def test_half_attention_with_rotary_at_large_positions_matches_float64(dtype, kv_heads):
    """``Attention.to(half)`` with rotary angles at positions ~8000 against ``hp.ref_attention`` in float64
    (same half weights and inputs, rotation as a complex product)."""
    attn = hp.seeded_module(lambda: sf.Attention(32, heads=2, dim_head=16, kv_heads=kv_heads), seed=3).to(dtype)
    n = 12
    x = _randn(2, n, 32, seed=4, dtype=dtype)
    pos = torch.stack((torch.arange(8192 - n, 8192), torch.arange(4000, 4000 + 2 * n, 2)))  # (2, n)
    rot = sf.RotaryEmbedding(8)
    angles = rot.angles(pos, dtype=dtype)
    out = attn(x, causal=True, rotary=(angles, angles))
    assert out.dtype == dtype
    expected = hp.ref_attention(attn, x, causal=True, q_pos=pos, k_pos=pos, rot_dim=8)
    assert_close(out, expected, f"{dtype} attention with rotary at positions near 8192", dtype, table=ATTEND_TOL)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: DT_IDS[d])
def test_half_rotary_stack_at_large_positions_matches_float64(dtype):
    """A whole ``.to(half)`` rotary decoder with explicit positions 8180..8191 against ``hp.ref_stack``."""
    layers = hp.seeded_module(
        lambda: sf.Decoder(dim=32, depth=1, heads=2, dim_head=16, rotary_pos_emb=True), seed=5
    ).to(dtype)
    n = 12
    x = _randn(2, n, 32, seed=6, dtype=dtype)
    pos = torch.arange(8192 - n, 8192)[None].expand(2, n)
    out = layers(x, positions=pos)
    expected = hp.ref_stack(layers, x, positions=pos)
    hp.assert_close(out, expected, f"{dtype} rotary decoder at positions near 8192")


# ---------------------------------------------------------------------------------------------------- guided_logits


def guidance_inputs(dtype: torch.dtype, seed: int = 0, spread: float = 4.0) -> tuple[Tensor, Tensor]:
    """``(cond, uncond)`` of shape (5, 40) in ``dtype`` with -inf in one branch, the other, or both; a row
    with one finite token and a row with none."""
    cond = _randn(5, 40, seed=seed, scale=spread, dtype=dtype)
    uncond = (cond.double() + _randn(5, 40, seed=seed + 1, scale=spread / 2)).to(dtype)
    g = _gen(seed + 2)
    cond = cond.masked_fill(torch.rand(5, 40, generator=g) < 0.15, -INF)
    uncond = uncond.masked_fill(torch.rand(5, 40, generator=g) < 0.15, -INF)
    uncond[1, :3] = -INF
    cond[1, :3] = -INF  # banned in both
    cond[3, 1:] = -INF  # one finite token left (if uncond keeps it)
    uncond[3, 0] = cond[3, 0] = 2.0
    cond[4] = -INF  # nothing left
    return cond, uncond


@pytest.mark.parametrize("phi", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("scale", [0.0, 1.0, 3.0, 50.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float64, *LOW], ids=lambda d: DT_IDS[d])
def test_guided_logits_matches_float64_formula_in_float32_or_wider(dtype, scale, phi):
    cond, uncond = guidance_inputs(dtype)
    out = sf.guided_logits(cond, uncond, scale, phi)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == want, f"guided logits of {dtype} inputs are {out.dtype}, expected {want}"
    assert not bool(out.isnan().any()), "guided logits hold NaN"
    banned = torch.isneginf(cond) | torch.isneginf(uncond)
    assert bool(torch.isneginf(out[banned]).all()), "a token at -inf in either branch must stay exactly -inf"
    assert not bool(torch.isinf(out[~banned]).any()), f"a finite token overflowed (scale {scale})"
    expected = hp.ref_guidance(cond, uncond, scale, phi)
    assert_close(out[~banned], expected[~banned], f"guided logits (s={scale}, phi={phi})", want, table=ATTEND_TOL)


PLUS_INF_BUG = (  # fixed: kept as the description of the regression
    "guided_logits treats only -inf as banned: a +inf logit (a token forced by a logits processor) gives "
    "NaN: uncond=+inf makes uncond + s * (cond - uncond) = inf - inf, and with guidance_rescale > 0 the "
    "std of a row holding +inf is NaN, which spreads to the whole row"
)


@pytest.mark.parametrize(("branch", "phi"), [
    ("uncond", 0.0), ("uncond", 0.5), ("cond", 0.0), ("cond", 0.5),
])
def test_guided_logits_with_a_plus_inf_logit_gives_no_nan(branch, phi):
    """NaN never appears (refusing the input with ValueError would do as well)."""
    cond = torch.tensor([[1.0, 2.0, 3.0, -INF]])
    uncond = torch.tensor([[0.0, 2.5, 1.0, 0.0]])
    (cond if branch == "cond" else uncond)[0, 0] = INF
    try:
        out = sf.guided_logits(cond, uncond, 3.0, phi)
    except ValueError:
        return
    assert not bool(out.isnan().any()), f"guided logits {out.tolist()} hold NaN"
    assert bool(torch.isneginf(out[0, 3]))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: DT_IDS[d])
def test_guided_logits_of_half_inputs_past_the_half_range_stay_finite_and_exact(dtype):
    """cond = 60000, uncond = -60000 (both finite in float16): ``uncond + 3 (cond - uncond)`` = 300000 is
    far past float16's 65504; the float32 result must hold it."""
    cond = torch.tensor([[60000.0, 1.0, -INF, 0.0]], dtype=dtype)
    uncond = torch.tensor([[-60000.0, 2.0, 5.0, -INF]], dtype=dtype)
    out = sf.guided_logits(cond, uncond, 3.0)
    c, u = cond.double(), uncond.double()
    expected = torch.tensor([[float(u[0, 0] + 3 * (c[0, 0] - u[0, 0])), 4.0, -INF, -INF]], dtype=torch.float64)
    assert bool(torch.isneginf(out[:, 2:]).all())
    assert_close(out[:, :2], expected[:, :2], "guided logits beyond the float16 range", torch.float32, table=ATTEND_TOL)


# ---------------------------------------------------------------------------------------------------- cross-entropy

IGNORE = -100


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("spread", [3.0, 3000.0], ids=["ordinary", "wide"])
@pytest.mark.parametrize("dtype", LOW, ids=lambda d: DT_IDS[d])
def test_safe_cross_entropy_of_half_logits_matches_float64_log_softmax(dtype, spread, smoothing):
    """The loss (float32 or wider) within float32 tolerance of the float64 reference; the gradient (in the
    logits' dtype) within ``ATTEND_TOL[dtype]``, taken of the *sum* of counted losses so that its entries are
    ``p - y``, of order 1 (not 1/N, which the absolute tolerance would swallow). Ignored rows hold NaN."""
    N, v = 24, 50
    logits = _randn(N, v, seed=7, scale=spread, dtype=dtype)
    target = torch.randint(0, v, (N,), generator=_gen(8))
    target[::3] = IGNORE
    logits[::3] = NAN  # ignored rows: never read
    logits.requires_grad_(True)
    loss = sf.safe_cross_entropy(logits, target, ignore_index=IGNORE, label_smoothing=smoothing)
    assert loss.dtype == torch.promote_types(dtype, torch.float32)
    clean = torch.where((target != IGNORE)[:, None], logits.detach().double(), 0.0).requires_grad_(True)
    ref = hp.ref_cross_entropy(clean, target, smoothing, ignore_index=IGNORE)
    assert_close(loss.detach(), ref.detach(), "loss", torch.float32, table=ATTEND_TOL)
    count = int((target != IGNORE).sum())
    (loss * count).backward()
    (ref * count).backward()
    assert logits.grad is not None and logits.grad.dtype == dtype
    assert_close(logits.grad, clean.grad, "d(sum of losses)/d logits", dtype, table=ATTEND_TOL)
    assert_zero(logits.grad[::3], "gradient of ignored (NaN) rows")


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", LOW, ids=lambda d: DT_IDS[d])
def test_safe_cross_entropy_with_every_target_ignored_is_exactly_zero_with_zero_gradient(dtype, smoothing):
    logits = _randn(2, 5, 11, seed=9, dtype=dtype).masked_fill(torch.rand(2, 5, 1, generator=_gen(1)) < 0.5, NAN)
    logits.requires_grad_(True)
    target = torch.full((2, 5), IGNORE)
    loss = sf.safe_cross_entropy(logits, target, ignore_index=IGNORE, label_smoothing=smoothing)
    assert_zero(loss.detach().reshape(1), "loss with every target ignored")
    loss.backward()
    assert logits.grad is not None, "no gradient reached the logits (a missing gradient is not a zero gradient)"
    assert_zero(logits.grad, "gradient with every target ignored")


# ---------------------------------------------------------------------------------------------------- masked_mean


@pytest.mark.parametrize("use_mask", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: DT_IDS[d])
def test_masked_mean_of_8000_tens_is_ten_in_half(dtype, use_mask):
    """The sum 80000 overflows float16 (max 65504); accumulated in float32 the mean is exactly 10."""
    x = torch.full((2, 8000, 3), 10.0, dtype=dtype)
    mask = torch.ones(2, 8000, dtype=torch.bool) if use_mask else None
    out = sf.masked_mean(x, mask, dim=1)
    assert out.dtype == dtype
    assert_bitwise(out, torch.full((2, 3), 10.0, dtype=dtype), "mean of 8000 tens")


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: DT_IDS[d])
def test_masked_mean_of_random_half_values_matches_float64(dtype):
    x = (_randn(4, 3000, 5, seed=10, scale=30.0) + 40.0).to(dtype)  # large and all positive: a half sum overflows
    mask = torch.rand(4, 3000, generator=_gen(11)) < 0.8
    mask[3, :2999] = False  # one valid position
    x = x.masked_fill(~mask[..., None], NAN).requires_grad_(True)
    out = sf.masked_mean(x, mask, dim=1)
    x64 = torch.where(mask[..., None], x.detach().double(), 0.0).requires_grad_(True)
    expected = x64.sum(1) / mask.sum(1, keepdim=True).double()
    assert_close(out, expected.detach(), "masked mean", dtype, table=ATTEND_TOL)
    up = _randn(4, 5, seed=12)
    out.backward(up.to(dtype))
    expected.backward(up)
    # the gradient 1/count is tiny; compare it scaled by the count, where it is the upstream gradient
    count = mask.sum(1).double()[:, None, None].expand(x.shape)
    assert_close((x.grad.double() * count)[mask], (x64.grad * count)[mask], "count * d mean / d x", dtype, table=ATTEND_TOL)
    assert_zero(x.grad[~mask], "gradient at masked (NaN) positions")


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: DT_IDS[d])
def test_masked_mean_over_no_valid_position_is_zero_with_zero_gradient(dtype):
    x = _randn(3, 6, 4, seed=13, dtype=dtype).masked_fill(torch.ones(3, 6, 1, dtype=torch.bool), NAN)
    x.requires_grad_(True)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    out = sf.masked_mean(x, mask, dim=1)
    assert_zero(out.detach(), "mean over nothing")
    out.sum().backward()
    assert x.grad is not None, "no gradient reached x"
    assert_zero(x.grad, "gradient of a mean over nothing")


# ---------------------------------------------------------------------------------------------------- pooling


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_half_model_return_pooled_over_1024_tokens_is_the_float64_mean_of_its_embeddings(padded):
    """A ``.half()`` encoder whose final norm is shifted to ~70: the 1024-position sum (~72000) is past
    float16's range, so a pooled mean accumulated in float16 is inf (or far off)."""
    model = hp.seeded_module(lambda: sf.TransformerWrapper(
        num_tokens=50, max_seq_len=1024, attn_layers=sf.Encoder(dim=32, depth=1, heads=2, dim_head=16)), seed=14)
    model.attn_layers.final_norm = sf.nn.modules.LayerNorm(32, unit_offset=True, bias=True)  # a shift to set
    with torch.no_grad():
        model.attn_layers.final_norm.bias.add_(70.0)
    model = model.half().eval()
    x = torch.randint(0, 50, (2, 1024), generator=_gen(15))
    mask = None
    if padded:
        mask = torch.ones(2, 1024, dtype=torch.bool)
        mask[1, :100] = False  # left padding
    with torch.no_grad():
        pooled = model(x, mask=mask, return_pooled=True)
        emb = model(x, mask=mask, return_embeddings=True)
    assert pooled.dtype == torch.float16 and tuple(pooled.shape) == (2, 32)
    assert_finite(emb, "embeddings")
    keep = torch.ones(2, 1024, dtype=torch.bool) if mask is None else mask
    expected = (emb.double() * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).double()
    assert float(expected.abs().min()) > 60  # the shift took hold: the sum is past float16's range
    assert_close(pooled, expected, "pooled output of a half model", torch.float16, table=ATTEND_TOL)


# ---------------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3], ids=["tiny", "unit", "huge"])
@pytest.mark.parametrize("dtype", LOW, ids=lambda d: DT_IDS[d])
def test_rmsnorm_in_half_matches_float64(dtype, magnitude):
    """x ** 2 overflows float16 at |x| > 256 and underflows below ~2e-4: statistics must be float32."""
    norm = hp.seeded_module(lambda: sf.RMSNorm(48), seed=16).to(dtype)
    x = _randn(3, 7, 48, seed=17, scale=magnitude, dtype=dtype).requires_grad_(True)
    out = norm(x)
    assert out.dtype == dtype
    x64 = x.detach().double().requires_grad_(True)
    expected = hp.ref_norm(norm, x64)
    assert_close(out, expected.detach(), "RMSNorm", dtype, table=ATTEND_TOL)
    up = _randn(3, 7, 48, seed=18)
    out.backward(up.to(dtype))
    expected.backward(up)
    assert_close(x.grad * magnitude, x64.grad * magnitude, "magnitude * RMSNorm gradient", dtype, table=ATTEND_TOL)


LAYERNORM_GRAD_BUG = (
    "torch's CPU LayerNorm backward in float16/bfloat16 loses the gradient of inputs whose mean is large "
    "against their spread (x ~ 300 + N(0, 1): errors of 2-10% of the largest entry; the same half inputs "
    "through a float32 LayerNorm are within 4e-5). safeformer's RMSNorm keeps its statistics in float32 "
    "(S7), but make_norm(use_rmsnorm=False) returns a plain nn.LayerNorm run in the model's dtype."
)


def layernorm_case(dtype: torch.dtype, offset: float) -> tuple[torch.nn.LayerNorm, Tensor]:
    """The stack's own final LayerNorm (``use_rmsnorm=False``) cast to ``dtype``, and inputs of magnitude
    ~1000 (offset 0) or 300 + N(0, 1) (the variance of x ~ 1e6 overflows float16 in a naive kernel)."""
    layers = hp.seeded_module(lambda: sf.Encoder(dim=48, depth=1, heads=2, dim_head=8), seed=19).to(dtype)
    norm = layers.final_norm
    assert isinstance(norm, sf.nn.modules.LayerNorm)
    x = (_randn(3, 7, 48, seed=20, scale=1000.0 if offset == 0 else 1.0) + offset).to(dtype)
    return norm, x


@pytest.mark.parametrize("offset", [0.0, 300.0], ids=["centred", "offset"])
@pytest.mark.parametrize("dtype", LOW, ids=lambda d: DT_IDS[d])
def test_model_layernorm_forward_in_half_matches_float64(dtype, offset):
    norm, x = layernorm_case(dtype, offset)
    out = norm(x)
    assert out.dtype == dtype
    assert_close(out, hp.ref_norm(norm, x.double()).detach(), "LayerNorm", dtype, table=ATTEND_TOL)


def _layernorm_grad_params():
    for dtype in LOW:
        for offset in (0.0, 300.0):
            yield pytest.param(dtype, offset, id=f"{DT_IDS[dtype]}-{'offset' if offset else 'centred'}")


@pytest.mark.parametrize(("dtype", "offset"), list(_layernorm_grad_params()))
def test_model_layernorm_gradient_in_half_matches_float64(dtype, offset):
    norm, x = layernorm_case(dtype, offset)
    x.requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    up = _randn(3, 7, 48, seed=21)
    norm(x).backward(up.to(dtype))
    hp.ref_norm(norm, x64).backward(up)
    s = 1000.0 if offset == 0 else 1.0  # the gradient scales as 1 / std(x): compare it at order 1
    assert_close(x.grad.double() * s, x64.grad * s, "std(x) * LayerNorm gradient", dtype, table=ATTEND_TOL)


@pytest.mark.parametrize("use_rmsnorm", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: DT_IDS[d])
def test_half_stack_on_large_inputs_matches_float64(dtype, use_rmsnorm):
    """A whole ``.to(half)`` encoder fed inputs of magnitude ~300 (the norms' squares overflow float16)."""
    layers = hp.seeded_module(
        lambda: sf.Encoder(dim=32, depth=1, heads=2, dim_head=16, use_rmsnorm=use_rmsnorm), seed=22
    ).to(dtype)
    x = (_randn(2, 9, 32, seed=23, scale=300.0)).to(dtype)
    mask = torch.tensor([[True] * 9, [False] * 3 + [True] * 6])
    out = layers(x, mask=mask)
    expected = hp.ref_stack(layers, x, mask=mask)
    hp.assert_close(out[mask], expected[mask], f"{dtype} stack on large inputs")
    assert_zero(out[~mask], "padded positions")


# ====================================================================================================
# B. Condition dropping at 0 < p < 1
# ====================================================================================================

B, J, CTX, VOCAB, DIM = 64, 5, 8, 19, 16
SEED = 1234


def binomial_ok(k: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    """``k`` successes of ``n`` draws at ``p`` lie within ``sigmas`` standard deviations of ``n p``."""
    return abs(k - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def expected_draw(b: int, p: float, seed: int) -> Tensor:
    """The samples dropped after ``torch.manual_seed(seed)``: safeformer draws ``torch.rand(b) < p``
    (``XTransformer`` keeps ``rand >= p``: the same samples) as the first random call of the step."""
    torch.manual_seed(seed)
    return torch.rand(b) < p


def context_batch(b: int = B, j: int = J, seed: int = 30) -> tuple[Tensor, Tensor]:
    ctx = _randn(b, j, CTX, seed=seed, scale=2.0, dtype=torch.float32)
    lengths = torch.randint(1, j + 1, (b,), generator=_gen(seed + 1))
    mask = torch.arange(j)[None] < lengths[:, None]  # (b, j) right padding, at least one real position
    return ctx, mask


def split_per_sample(got: Tensor, cond: Tensor, uncond: Tensor, what: str) -> Tensor:
    """Each sample of ``got`` (b, ...) must equal bit for bit its conditioned run or its unconditioned
    run; returns which samples were the unconditioned (dropped) ones."""
    flat = lambda t: t.detach().flatten(1)  # noqa: E731
    assert not bool((flat(cond) == flat(uncond)).all(1).any()), f"{what}: a sample's condition changes nothing"
    is_cond = (flat(got) == flat(cond)).all(1)
    is_uncond = (flat(got) == flat(uncond)).all(1)
    neither = ~(is_cond | is_uncond)
    assert not bool(neither.any()), (
        f"{what}: samples {neither.nonzero().flatten().tolist()} equal neither their conditioned nor their "
        f"unconditioned run bit for bit"
    )
    return is_uncond


@pytest.mark.parametrize("given_mask", [True, False], ids=["mask", "no-mask"])
def test_drop_condition_at_half_is_a_per_sample_draw_of_whole_rows(given_mask):
    ctx, mask = context_batch()
    if not given_mask:
        mask = torch.ones(B, J, dtype=torch.bool)
    want = expected_draw(B, 0.5, SEED)
    torch.manual_seed(SEED)
    ctx2, mask2 = sf.core.conditions.drop_condition(mask if given_mask else None, 0.5, context=ctx)
    assert ctx2 is ctx  # the empty null condition changes only the mask
    dropped = ~mask2.any(1)
    assert 0 < int(dropped.sum()) < B and binomial_ok(int(dropped.sum()), B, 0.5), int(dropped.sum())
    assert torch.equal(dropped, want), "the dropped samples are not the per-sample draw torch.rand(b) < p"
    assert torch.equal(mask2[~dropped], mask[~dropped]), "a kept sample's mask changed"
    # another draw drops other samples: the pattern is drawn, not fixed
    torch.manual_seed(SEED + 1)
    _, mask3 = sf.core.conditions.drop_condition(mask, 0.5, context=ctx)
    assert not torch.equal(~mask3.any(1), dropped)


def test_drop_condition_at_half_with_null_context_swaps_whole_rows():
    ctx, mask = context_batch()
    null = _randn(2, CTX, seed=31, dtype=torch.float32)  # two null tokens
    want = expected_draw(B, 0.5, SEED)
    torch.manual_seed(SEED)
    ctx2, mask2 = sf.core.conditions.drop_condition(mask, 0.5, context=ctx, null_context=null)
    assert tuple(ctx2.shape) == (B, J, CTX) and tuple(mask2.shape) == (B, J)
    null_row = torch.cat((null, torch.zeros(J - 2, CTX)))
    null_mask = torch.tensor([True, True] + [False] * (J - 2))
    is_null = (ctx2 == null_row).flatten(1).all(1) & (mask2 == null_mask).all(1)
    is_kept = (ctx2 == ctx).flatten(1).all(1) & (mask2 == mask).all(1)
    assert bool((is_null ^ is_kept).all()), "a row is neither the null condition nor the sample's own"
    assert torch.equal(is_null, want)
    assert 0 < int(is_null.sum()) < B and binomial_ok(int(is_null.sum()), B, 0.5)


def make_ar(null_context: str, p: float = 0.5, seed: int = 32) -> sf.AutoregressiveWrapper:
    torch.manual_seed(seed)
    net = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(
        dim=DIM, depth=1, heads=2, dim_head=8, cross_attend=True, dim_context=CTX))
    model = sf.AutoregressiveWrapper(net, cond_drop_prob=p, null_context=null_context)
    if model.null_token is not None:
        with torch.no_grad():
            model.null_token.copy_(_randn(1, CTX, seed=33, dtype=torch.float32))  # not ~0: it must matter
    return model


def capture_logits(net: torch.nn.Module) -> tuple[list[Tensor], torch.utils.hooks.RemovableHandle]:
    seen: list[Tensor] = []
    return seen, net.register_forward_hook(lambda mod, args, out: seen.append(out))


@pytest.mark.parametrize("null_context", ["empty", "learned"])
def test_autoregressive_training_at_half_drops_whole_samples_exactly(null_context):
    """In training at ``cond_drop_prob=0.5``, every sample's logits are bit for bit those of the batch run
    with its condition (mask as given) or without it (all-False mask / the learned null token), the
    unconditioned ones are the drawn samples, and the loss is the loss of those logits."""
    model = make_ar(null_context).train()
    x = torch.randint(0, VOCAB, (B, 8), generator=_gen(34))
    ctx, mask = context_batch()
    seen, handle = capture_logits(model.net)
    torch.manual_seed(SEED)
    loss = model(x, context=ctx, context_mask=mask)
    handle.remove()
    (got,) = seen
    with torch.no_grad():
        none = torch.zeros(B, dtype=torch.bool)
        cond_ctx, cond_mask = sf.core.conditions.drop_condition(mask, context=ctx, null_context=model.null_token, dropped=none)
        unc_ctx, unc_mask = sf.core.conditions.drop_condition(mask, context=ctx, null_context=model.null_token, dropped=~none)
        cond = model.net(x[:, :-1], context=cond_ctx, context_mask=cond_mask)
        uncond = model.net(x[:, :-1], context=unc_ctx, context_mask=unc_mask)
    dropped = split_per_sample(got, cond, uncond, "training logits")
    assert 0 < int(dropped.sum()) < B and binomial_ok(int(dropped.sum()), B, 0.5), int(dropped.sum())
    assert torch.equal(dropped, expected_draw(B, 0.5, SEED))
    expected_loss = sf.safe_cross_entropy(torch.where(dropped[:, None, None], uncond, cond), x[:, 1:])
    assert_bitwise(loss.detach(), expected_loss, "loss")


@pytest.mark.parametrize("null_context", ["empty", "learned"])
def test_autoregressive_training_at_half_never_reads_a_dropped_context(null_context):
    """The drawn samples' contexts filled with NaN: loss and every gradient bit for bit unchanged, finite."""
    x = torch.randint(0, VOCAB, (B, 8), generator=_gen(35))
    ctx, mask = context_batch()
    dropped = expected_draw(B, 0.5, SEED)
    runs = []
    for poisoned in (False, True):
        model = make_ar(null_context).train()
        c = ctx.masked_fill(dropped[:, None, None], NAN) if poisoned else ctx.clone()
        c.requires_grad_(True)
        torch.manual_seed(SEED)
        loss = model(x, context=c, context_mask=mask)
        loss.backward()
        runs.append((loss.detach(), hp.param_grads(model), c.grad))
    (loss0, grads0, cg0), (loss1, grads1, cg1) = runs
    assert_bitwise(loss1, loss0, "loss with NaN in the dropped contexts")
    for name, g in grads0.items():
        assert g is not None, f"no gradient for {name}"
        assert_bitwise(grads1[name], g, f"gradient of {name}")
    assert_bitwise(cg1, cg0, "gradient of the context")
    assert_zero(cg1[dropped], "gradient of the dropped contexts")
    assert bool((cg1[~dropped] != 0).any())


def make_xt(p: float = 0.5, seed: int = 36) -> sf.XTransformer:
    torch.manual_seed(seed)
    return sf.XTransformer(dim=DIM, enc_num_tokens=VOCAB, enc_max_seq_len=8, dec_num_tokens=VOCAB,
                           dec_max_seq_len=8, enc_depth=1, dec_depth=1, enc_heads=2, dec_heads=2, dim_head=8,
                           cond_drop_prob=p)


@pytest.mark.parametrize("src_padded", [False, True], ids=["no-src-mask", "src-mask"])
def test_xtransformer_training_at_half_drops_whole_samples_exactly(src_padded):
    xt = make_xt().train()
    src = torch.randint(0, VOCAB, (B, 6), generator=_gen(37))
    tgt = torch.randint(0, VOCAB, (B, 7), generator=_gen(38))
    src_mask = None
    if src_padded:
        src_mask = torch.arange(6)[None] < torch.randint(1, 7, (B,), generator=_gen(39))[:, None]
    seen, handle = capture_logits(xt.decoder.net)
    torch.manual_seed(SEED)
    loss = xt(src, tgt, mask=src_mask)
    handle.remove()
    (got,) = seen
    with torch.no_grad():
        enc = xt.encode(src, src_mask)
        full = torch.ones(B, 6, dtype=torch.bool) if src_mask is None else src_mask
        cond = xt.decoder.net(tgt[:, :-1], context=enc, context_mask=full)
        uncond = xt.decoder.net(tgt[:, :-1], context=enc, context_mask=torch.zeros(B, 6, dtype=torch.bool))
    dropped = split_per_sample(got, cond, uncond, "XTransformer training logits")
    assert 0 < int(dropped.sum()) < B and binomial_ok(int(dropped.sum()), B, 0.5), int(dropped.sum())
    assert torch.equal(dropped, expected_draw(B, 0.5, SEED))
    expected_loss = sf.safe_cross_entropy(torch.where(dropped[:, None, None], uncond, cond), tgt[:, 1:])
    assert_bitwise(loss.detach(), expected_loss, "XTransformer loss")


def test_xtransformer_training_at_half_never_reads_a_dropped_source():
    """The drawn samples' encoder outputs replaced by NaN (a forward hook): loss and every gradient bit
    for bit unchanged and finite."""
    src = torch.randint(0, VOCAB, (B, 6), generator=_gen(40))
    tgt = torch.randint(0, VOCAB, (B, 7), generator=_gen(41))
    dropped = expected_draw(B, 0.5, SEED)
    runs = []
    for poisoned in (False, True):
        xt = make_xt().train()
        handle = None
        if poisoned:
            handle = xt.encoder.register_forward_hook(
                lambda mod, args, out: out.masked_fill(dropped[:, None, None], NAN))
        torch.manual_seed(SEED)
        loss = xt(src, tgt)
        loss.backward()
        if handle is not None:
            handle.remove()
        runs.append((loss.detach(), hp.param_grads(xt)))
    (loss0, grads0), (loss1, grads1) = runs
    assert_bitwise(loss1, loss0, "loss with NaN in the dropped sources' encodings")
    for name, g in grads0.items():
        assert g is not None, f"no gradient for {name}"
        assert_bitwise(grads1[name], g, f"gradient of {name}")


# ====================================================================================================
# C. Limits at the boundary
# ====================================================================================================

M = 12  # max_seq_len of the boundary models


def abs_model(kind: str, cross: bool = False, seed: int = 50) -> sf.TransformerWrapper:
    layers = {"encoder": sf.Encoder, "decoder": sf.Decoder}[kind]
    extra = dict(cross_attend=True, dim_context=CTX) if cross else {}
    return hp.seeded_module(lambda: sf.TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=M, attn_layers=layers(dim=DIM, depth=1, heads=2, dim_head=8, **extra)), seed=seed)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_sequence_of_exactly_max_seq_len_matches_float64_and_one_more_is_refused(kind):
    model = abs_model(kind)
    assert model.pos_emb is not None
    x = torch.randint(0, VOCAB, (2, M), generator=_gen(51))
    out = model(x, return_embeddings=True)
    h0 = model.token_emb(x).double() + model.pos_emb.emb.weight.double() * model.pos_emb.scale  # rows 0..M-1
    hp.assert_close(out, hp.ref_stack(model.attn_layers, h0), "a sequence of exactly max_seq_len")
    with pytest.raises(ValueError, match=f"max_seq_len={M}"):
        model(torch.randint(0, VOCAB, (2, M + 1)))


def test_kv_cache_reaching_exactly_max_seq_len_is_accepted_and_one_more_is_refused():
    model = abs_model("decoder").eval()
    x = torch.randint(0, VOCAB, (2, M + 1), generator=_gen(52))
    with torch.no_grad():
        full = model(x[:, :M])
        _, cache = model(x[:, : M - 1], return_cache=True)
        last, cache = model(x[:, M - 1 : M], cache=cache, return_cache=True)  # the M-th position
    hp.assert_close(last[:, 0], full[:, -1].double(), "the M-th position decoded from a cache", dtype=torch.float32)
    with pytest.raises(ValueError, match=f"max_seq_len={M}"):
        model(x[:, M:], cache=cache)


def greedy64(net: sf.TransformerWrapper, prompts: Tensor, steps: int) -> Tensor:
    """Greedy decoding of a float64 copy, recomputing the whole sequence each step; refuses near-ties."""
    net64 = copy.deepcopy(net).double().eval()
    seq = prompts
    with torch.no_grad():
        for _ in range(steps):
            logits = net64(seq)[:, -1]
            top2 = logits.topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-5, "near-tie in the reference: change the seed"
            seq = torch.cat((seq, logits.argmax(-1, keepdim=True)), dim=1)
    return seq[:, prompts.shape[1]:]


@pytest.mark.parametrize("cache_kv", [True, False], ids=["cache", "no-cache"])
def test_generate_up_to_exactly_max_seq_len_positions_and_not_one_more(cache_kv):
    """A prompt of n and seq_len new tokens need n + seq_len - 1 positions (the last token is never fed)."""
    model = sf.AutoregressiveWrapper(abs_model("decoder", seed=53))
    n = 4
    prompts = torch.randint(0, VOCAB, (3, n), generator=_gen(54))
    steps = M - n + 1  # n + steps - 1 == M
    tokens = model.generate(prompts, steps, temperature=0.0, cache_kv=cache_kv)
    assert torch.equal(tokens, greedy64(model.net, prompts, steps))
    with pytest.raises(ValueError, match=f"max_seq_len={M}"):
        model.generate(prompts, steps + 1, temperature=0.0, cache_kv=cache_kv)


def test_training_on_exactly_max_seq_len_plus_one_tokens_is_accepted_and_one_more_refused():
    """The last token is only a target: M + 1 tokens feed exactly M positions."""
    model = sf.AutoregressiveWrapper(abs_model("decoder", seed=81))
    x = torch.randint(0, VOCAB, (2, M + 1), generator=_gen(82))
    loss = model(x)
    net64 = copy.deepcopy(model.net).double()
    ref = F.cross_entropy(net64(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    assert_close(loss.detach(), ref, "loss over M + 1 tokens", torch.float32, table=ATTEND_TOL)
    with pytest.raises(ValueError, match=f"max_seq_len={M}"):
        model(torch.randint(0, VOCAB, (2, M + 2)))


def test_xtransformer_limits_at_the_boundary():
    """Source of exactly enc_max_seq_len (8) and target of dec_max_seq_len + 1 accepted, one more refused;
    generation of dec_max_seq_len tokens after one start token accepted and greedy, one more refused."""
    xt = make_xt(0.0, seed=83)
    src = torch.randint(0, VOCAB, (2, 8), generator=_gen(84))
    tgt = torch.randint(0, VOCAB, (2, 9), generator=_gen(85))
    loss = xt(src, tgt)
    xt64 = copy.deepcopy(xt).double()
    logits64 = xt64.decoder.net(tgt[:, :-1], context=xt64.encode(src))
    ref = F.cross_entropy(logits64.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1))
    assert_close(loss.detach(), ref, "XTransformer loss at both limits", torch.float32, table=ATTEND_TOL)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        xt(torch.randint(0, VOCAB, (2, 9)), tgt)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        xt(src, torch.randint(0, VOCAB, (2, 10)))
    start = torch.zeros(2, 1, dtype=torch.long)
    tokens = xt.generate(src, start, 8, temperature=0.0)
    enc64, seq = xt64.eval().encode(src), start
    with torch.no_grad():
        for _ in range(8):
            step = xt64.decoder.net(seq, context=enc64)[:, -1]
            top2 = step.topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-5, "near-tie in the reference: change the seed"
            seq = torch.cat((seq, step.argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(tokens, seq[:, 1:])
    with pytest.raises(ValueError, match="max_seq_len=8"):
        xt.generate(src, start, 9, temperature=0.0)


# ---------------------------------------------------------------------------------------------------- filters


def filter_logits(seed: int = 55, v: int = 10) -> Tensor:
    x = _randn(4, v, seed=seed, scale=2.0, dtype=torch.float32)
    x[1, 3] = -INF  # a token already banned
    x[2, 5] = x[2].max()  # a tie at the top
    return x


def test_top_k_of_one_keeps_exactly_the_top_token_even_on_ties():
    x = filter_logits()
    out = sf.top_k(x, k=1)
    kept = torch.isfinite(out)
    assert torch.equal(kept.sum(-1), torch.ones(4, dtype=torch.long))
    assert torch.equal(out[kept], x.max(-1).values), "the kept token is not a largest logit"
    assert bool(torch.isneginf(out[~kept]).all())


@pytest.mark.parametrize("k", [10, 11, 10**6], ids=["v", "v+1", "huge"])
def test_top_k_of_v_or_more_keeps_every_token(k):
    x = filter_logits()
    assert_bitwise(sf.top_k(x, k=k), x, f"top_k(k={k})", inf_ok=True)


@pytest.mark.parametrize("k", [0, -1, 1.0, True], ids=["zero", "negative", "float", "bool"])
def test_top_k_below_one_or_not_an_integer_is_refused(k):
    with pytest.raises(ValueError, match="top_k"):
        sf.top_k(filter_logits(), k=k)


def test_top_p_of_exactly_one_keeps_every_token_even_of_vanishing_mass():
    x = filter_logits()
    x[0, 0] = -80.0  # probability ~1e-35: a cumulative mass would never reach it in float32
    assert_bitwise(sf.top_p(x, 1.0), x, "top_p(1.0)", inf_ok=True)


@pytest.mark.parametrize(("p", "kept"), [
    (0.4 - 1e-4, 1), (0.4 + 1e-4, 2), (0.7 - 1e-4, 2), (0.7 + 1e-4, 3), (0.9 - 1e-4, 3), (0.9 + 1e-4, 4),
])
def test_top_p_next_to_a_cumulative_mass_boundary(p, kept):
    """Probabilities 0.4, 0.3, 0.2, 0.1 (shuffled): the masses above the tokens are 0, 0.4, 0.7, 0.9, and a
    token is kept iff the mass ranked above it is below p."""
    probs = torch.tensor([0.2, 0.4, 0.1, 0.3], dtype=torch.float64)
    x = probs.log().float()[None]
    out = sf.top_p(x, p)
    want = probs > (probs.sort(descending=True).values[kept - 1] - 1e-12)
    assert torch.equal(torch.isfinite(out[0]), want), f"p={p}: kept {torch.isfinite(out[0]).tolist()}"
    assert torch.equal(out[0][want], x[0][want])


@pytest.mark.parametrize(("p", "kept"), [(0.25, 1), (0.5 - 1e-6, 2), (0.5, 2), (0.5 + 1e-6, 3), (0.75, 3), (0.75 + 1e-6, 4)])
def test_top_p_at_an_exact_cumulative_mass_boundary(p, kept):
    """Four equal logits: probabilities exactly 1/4 and masses above exactly 0, 1/4, 1/2, 3/4 in float32;
    a token whose mass above equals p is dropped (kept iff mass above < p)."""
    out = sf.top_p(torch.zeros(1, 4), p)
    assert int(torch.isfinite(out).sum()) == kept


@pytest.mark.parametrize("p", [0.0, -1e-9, 1 + 1e-9, NAN])
def test_top_p_outside_zero_one_is_refused(p):
    with pytest.raises(ValueError, match="top_p"):
        sf.top_p(filter_logits(), p)


def test_min_p_of_zero_keeps_every_token():
    x = filter_logits()
    x[0, 0] = -200.0  # probability exactly 0 in float32: still not below 0 * max
    assert_bitwise(sf.min_p(x, 0.0), x, "min_p(0)", inf_ok=True)


def test_min_p_of_one_keeps_exactly_the_tokens_tied_at_the_top():
    x = filter_logits()
    x[3, 0] = x[3].max() - 1e-3  # close, not tied: dropped
    out = sf.min_p(x, 1.0)
    top = x == x.max(-1, keepdim=True).values
    assert torch.equal(torch.isfinite(out), top)
    assert int(top[2].sum()) == 2  # both tied tokens survive
    assert torch.equal(out[top], x[top])


@pytest.mark.parametrize("m", [-1e-9, 1 + 1e-9, NAN])
def test_min_p_outside_zero_one_is_refused(m):
    with pytest.raises(ValueError, match="min_p"):
        sf.min_p(filter_logits(), m)


# ---------------------------------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("fn", [None, "top_k", "top_p", "min_p"])
def test_temperature_zero_is_the_argmax_whatever_the_filter(fn):
    x = filter_logits()
    x[2, 5] += 1e-3  # no tie: one argmax per row
    kwargs = {"top_k": {"k": 3}, "top_p": {"p": 0.5}, "min_p": {"min_p": 0.5}}.get(fn)
    for seed in range(3):
        torch.manual_seed(seed)
        assert torch.equal(sf.sample_logits(x, 0.0, fn, kwargs), x.argmax(-1))


def test_generate_at_temperature_zero_is_greedy():
    model = sf.AutoregressiveWrapper(abs_model("decoder", seed=56))
    prompts = torch.randint(0, VOCAB, (3, 3), generator=_gen(57))
    assert torch.equal(model.generate(prompts, 6, temperature=0.0), greedy64(model.net, prompts, 6))


TINY_TEMPERATURE_BUG = (
    "sample_logits accepts any finite temperature > 0, but divides float32 logits by it: once |logits| / "
    "temperature passes float32's max (3.4e38; temperature 1e-40 for logits of order 1), or the temperature "
    "rounds to 0 in float32 (1e-300), the quotient is +-inf or NaN, softmax gives NaN, and "
    "torch.multinomial raises a raw RuntimeError ('probability tensor contains either inf, nan or "
    "element < 0') instead of the greedy limit (or a ValueError naming temperature)"
)


@pytest.mark.parametrize("temperature", [
    1e-30, 1e-40, 1e-300,
])
def test_a_tiny_positive_temperature_samples_the_argmax(temperature):
    x = filter_logits()
    x[2, 5] += 1e-3
    assert torch.equal(sf.sample_logits(x, temperature), x.argmax(-1))


@pytest.mark.parametrize("t", [-1e-9, INF, NAN])
def test_temperature_below_zero_or_not_finite_is_refused(t):
    with pytest.raises(ValueError, match="temperature"):
        sf.sample_logits(filter_logits(), t)


# ---------------------------------------------------------------------------------------------------- drop probability


def test_drop_condition_at_exactly_zero_and_one_keeps_all_and_drops_all():
    ctx, mask = context_batch()
    torch.manual_seed(SEED)
    _, kept = sf.core.conditions.drop_condition(mask, 0.0, context=ctx)
    _, gone = sf.core.conditions.drop_condition(mask, 1.0, context=ctx)
    assert torch.equal(kept, mask)
    assert not bool(gone.any())


@pytest.mark.parametrize("p", [-1e-9, 1 + 1e-9, NAN])
def test_drop_probability_just_outside_zero_one_is_refused_everywhere(p):
    ctx, mask = context_batch(4)
    with pytest.raises(ValueError, match="drop probability"):
        sf.core.conditions.drop_condition(mask, p, context=ctx)
    with pytest.raises(ValueError, match="cond_drop_prob"):
        make_ar("empty", p)
    with pytest.raises(ValueError, match="cond_drop_prob"):
        make_xt(p)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_autoregressive_training_at_drop_probability_zero_and_one_is_all_kept_or_all_dropped(p):
    model = make_ar("empty", p).train()
    x = torch.randint(0, VOCAB, (8, 6), generator=_gen(58))
    ctx, mask = context_batch(8)
    seen, handle = capture_logits(model.net)
    model(x, context=ctx, context_mask=mask)
    handle.remove()
    with torch.no_grad():
        cond = model.net(x[:, :-1], context=ctx, context_mask=mask)
        uncond = model.net(x[:, :-1], context=ctx, context_mask=torch.zeros_like(mask))
    dropped = split_per_sample(seen[0], cond, uncond, f"training logits at cond_drop_prob={p}")
    assert bool((dropped == (p == 1.0)).all()), dropped.tolist()


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_xtransformer_training_at_drop_probability_zero_and_one_is_all_kept_or_all_dropped(p):
    xt = make_xt(p).train()
    src = torch.randint(0, VOCAB, (8, 6), generator=_gen(59))
    tgt = torch.randint(0, VOCAB, (8, 5), generator=_gen(60))
    seen, handle = capture_logits(xt.decoder.net)
    xt(src, tgt)
    handle.remove()
    with torch.no_grad():
        enc = xt.encode(src)
        cond = xt.decoder.net(tgt[:, :-1], context=enc, context_mask=torch.ones(8, 6, dtype=torch.bool))
        uncond = xt.decoder.net(tgt[:, :-1], context=enc, context_mask=torch.zeros(8, 6, dtype=torch.bool))
    if p == 0.0:  # no mask at all is passed: compare within float32 (a mask-free path is another kernel call)
        hp.assert_close(seen[0], cond.double(), "XTransformer at cond_drop_prob=0", dtype=torch.float32)
        assert not bool(torch.isclose(seen[0], uncond, atol=1e-3).all())
    else:
        assert bool(split_per_sample(seen[0], cond, uncond, "XTransformer at cond_drop_prob=1").all())


# ---------------------------------------------------------------------------------------------------- guidance_rescale


def test_guidance_rescale_at_zero_is_plain_guidance_and_at_one_the_full_rescale():
    cond, uncond = guidance_inputs(torch.float32, seed=61)
    plain = sf.guided_logits(cond, uncond, 3.0)
    assert_bitwise(sf.guided_logits(cond, uncond, 3.0, 0.0), plain, "guidance_rescale=0", inf_ok=True)
    full = sf.guided_logits(cond, uncond, 3.0, 1.0)
    banned = torch.isneginf(full)
    expected = hp.ref_guidance(cond, uncond, 3.0, 1.0)
    assert torch.equal(banned, torch.isneginf(expected))
    assert_close(full[~banned], expected[~banned], "guidance_rescale=1", torch.float32, table=ATTEND_TOL)
    # phi = 1: each row with >= 2 finite tokens has exactly the std of its conditional logits
    for r in (0, 1, 2):
        live = ~banned[r]
        assert abs(float(full[r][live].double().std()) - float(cond[r][live].double().std())) < 1e-4


@pytest.mark.parametrize("phi", [-1e-9, 1 + 1e-9, NAN])
def test_guidance_rescale_just_outside_zero_one_is_refused_everywhere(phi):
    cond, uncond = guidance_inputs(torch.float32)
    with pytest.raises(ValueError, match="guidance_rescale"):
        sf.guided_logits(cond, uncond, 3.0, phi)
    model = make_ar("empty", 0.0)
    prompts = torch.randint(0, VOCAB, (2, 3), generator=_gen(62))
    ctx, mask = context_batch(2)
    with pytest.raises(ValueError, match="guidance_rescale"):
        model.generate(prompts, 2, context=ctx, context_mask=mask, cond_scale=3.0, guidance_rescale=phi)
    with pytest.raises(ValueError, match="guidance_rescale"):
        make_xt().generate(prompts, prompts[:, :1], 2, cond_scale=3.0, guidance_rescale=phi)


@pytest.mark.parametrize("phi", [0.0, 1.0])
def test_generate_with_guidance_rescale_at_zero_and_one_uses_the_guided_formula(phi):
    """The first-step logits of guided generation at phi = 0 / 1 equal the formula on the two branches."""
    model = make_ar("empty", 0.0).eval()
    prompts = torch.randint(0, VOCAB, (4, 3), generator=_gen(63))
    ctx, mask = context_batch(4)
    got = model.next_token_logits(prompts, context=ctx, context_mask=mask, cond_scale=3.0, guidance_rescale=phi)
    with torch.no_grad():
        cond = model.net(prompts, context=ctx, context_mask=mask)[:, -1]
        uncond = model.net(prompts, context=ctx, context_mask=torch.zeros_like(mask))[:, -1]
    assert_close(got, hp.ref_guidance(cond, uncond, 3.0, phi), f"guided logits, phi={phi}", torch.float32, table=ATTEND_TOL)


# ---------------------------------------------------------------------------------------------------- dropout


def test_attend_dropout_zero_is_no_dropout_and_one_is_refused():
    q, k, v = (_randn(2, 2, 5, 8, seed=s, dtype=torch.float32) for s in (64, 65, 66))
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    plain = sf.attend(q, k, v, mask=mask)
    assert_bitwise(sf.attend(q, k, v, mask=mask, dropout_p=0.0), plain, "attend with dropout_p=0")
    allowed = mask[:, None, None, :].expand(2, 2, 5, 5)
    assert_close(plain, hp.ref_attend(q, k, v, allowed), "attend", torch.float32, table=ATTEND_TOL)
    for p in (1.0, 1 + 1e-9, -1e-9, NAN):
        with pytest.raises(ValueError, match="dropout_p"):
            sf.attend(q, k, v, mask=mask, dropout_p=p)
    with pytest.raises(ValueError, match="dropout"):
        sf.Attention(16, heads=2, dim_head=8, dropout=1.0)
    with pytest.raises(ValueError, match="dropout"):
        sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, attn_dropout=1.0)


def test_attention_module_with_dropout_zero_in_training_equals_evaluation():
    attn = hp.seeded_module(lambda: sf.Attention(16, heads=2, dim_head=8, dropout=0.0), seed=67)
    x = _randn(2, 5, 16, seed=68, dtype=torch.float32)
    out_eval = attn.eval()(x, causal=True)
    out_train = attn.train()(x, causal=True)
    assert_bitwise(out_train, out_eval, "attention with dropout=0 in training")


# ---------------------------------------------------------------------------------------------------- context length


def test_context_of_length_zero_is_exactly_no_context():
    model = abs_model("decoder", cross=True, seed=69)
    x = torch.randint(0, VOCAB, (3, 6), generator=_gen(70))
    ctx = torch.zeros(3, 0, CTX, requires_grad=True)
    out = model(x, context=ctx, context_mask=torch.zeros(3, 0, dtype=torch.bool))
    ref = model(x)
    assert_bitwise(out, ref, "logits with a context of length 0")
    out.sum().backward()
    assert ctx.grad is not None and tuple(ctx.grad.shape) == (3, 0, CTX)


def test_guided_generation_with_a_context_of_length_zero_is_plain_generation():
    model = make_ar("empty", 0.0)
    prompts = torch.randint(0, VOCAB, (3, 3), generator=_gen(71))
    ctx = torch.zeros(3, 0, CTX)
    guided = model.generate(prompts, 5, temperature=0.0, context=ctx, cond_scale=4.0)
    assert torch.equal(guided, model.generate(prompts, 5, temperature=0.0))


def test_context_of_length_one_matches_float64_and_masked_is_no_context():
    model = abs_model("decoder", cross=True, seed=72)
    x = torch.randint(0, VOCAB, (3, 6), generator=_gen(73))
    ctx = _randn(3, 1, CTX, seed=74, scale=2.0, dtype=torch.float32)
    out = model(x, context=ctx, return_embeddings=True)
    h0 = model.token_emb(x).double() + model.pos_emb.emb.weight[:6].double() * model.pos_emb.scale
    expected = hp.ref_stack(model.attn_layers, h0, context=ctx)
    hp.assert_close(out, expected, "a context of length 1")
    assert not bool(torch.isclose(out, model(x, return_embeddings=True), atol=1e-3).all())  # it mattered
    masked = model(x, context=ctx.masked_fill(torch.ones(3, 1, 1, dtype=torch.bool), NAN),
                   context_mask=torch.zeros(3, 1, dtype=torch.bool))
    assert_bitwise(masked, model(x), "a masked context of length 1 (holding NaN)")


# ---------------------------------------------------------------------------------------------------- kv heads


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["kv=heads", "kv=2", "kv=1"])
def test_attention_with_kv_heads_equal_to_heads_or_one_matches_float64(kv_heads):
    attn = hp.seeded_module(lambda: sf.Attention(16, heads=4, dim_head=8, kv_heads=kv_heads), seed=75)
    assert attn.to_k.out_features == kv_heads * 8
    x = _randn(2, 6, 16, seed=76, dtype=torch.float32).requires_grad_(True)
    mask = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    out = attn(x, mask=mask, causal=True)
    x64 = x.detach().double().requires_grad_(True)
    expected = hp.ref_attention(attn, x64, allowed=mask[:, None, None, :], causal=True)
    hp.assert_close(out[mask], expected[mask], f"attention with kv_heads={kv_heads}")
    assert_zero(out[~mask], "padded queries")
    (out * _randn(2, 6, 16, seed=77, dtype=torch.float32)).sum().backward()
    assert_finite(x.grad, "grad of x")
    assert_zero(x.grad[~mask], "grad of padded positions")


@pytest.mark.parametrize("kv_heads", [0, 3, 8])
def test_kv_heads_that_do_not_divide_heads_are_refused(kv_heads):
    with pytest.raises(ValueError, match="kv_heads"):
        sf.Attention(16, heads=4, dim_head=8, kv_heads=kv_heads)


# ---------------------------------------------------------------------------------------------------- bools

BOOL_BUG = (
    "numeric hyperparameters accept bool silently (isinstance(True, int)): sample_logits(temperature=False) "
    "is greedy, top_p(p=True) / min_p(min_p=True) / guidance_rescale=True / cond_drop_prob=True mean 1, "
    "attend(dropout_p=False) means 0, while top_k(k=True) and guided_logits(cond_scale=True) are refused"
)


def test_a_bool_passed_as_a_number_is_refused_like_top_k_and_cond_scale_refuse_it():
    x = filter_logits()
    ctx, mask = context_batch(4)
    q = _randn(1, 1, 3, 8, seed=80, dtype=torch.float32)
    for refused in (lambda: sf.top_k(x, k=True), lambda: sf.guided_logits(x, x, True)):  # the library's own rule
        with pytest.raises((TypeError, ValueError)):
            refused()
    cases = {
        "sample_logits(temperature=False)": lambda: sf.sample_logits(x, False),
        "top_p(p=True)": lambda: sf.top_p(x, True),
        "min_p(min_p=True)": lambda: sf.min_p(x, True),
        "guided_logits(guidance_rescale=True)": lambda: sf.guided_logits(x, x, 2.0, True),
        "drop_condition(p=True)": lambda: sf.core.conditions.drop_condition(mask, True, context=ctx),
        "AutoregressiveWrapper(cond_drop_prob=True)": lambda: make_ar("empty", True),
        "XTransformer(cond_drop_prob=True)": lambda: make_xt(True),
        "attend(dropout_p=False)": lambda: sf.attend(q, q, q, dropout_p=False),
    }
    accepted = []
    for name, call in cases.items():
        try:
            call()
        except (TypeError, ValueError):
            continue
        accepted.append(name)
    assert not accepted, f"a bool was taken for a number by: {accepted}"
