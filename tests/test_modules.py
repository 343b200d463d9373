"""Tests for safeformer/modules.py: norms, feed-forward, positions, and the ``Attention`` module.

Every numeric check compares with a float64 reference written plainly in ``helpers.references``
(one head and one sample at a time, softmax by hand, rotary as a complex rotation).

Shape legend: b batch, n positions, i queries, j keys, h heads, h_kv key/value heads, d head dim,
c model width.
"""

from __future__ import annotations

import math

import helpers as hp
import pytest
import torch
from helpers import CTX_DIM, DIM, DIM_HEAD, NAN
from hypothesis import given
from hypothesis import strategies as st

import safeformer as sf


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield



# ----------------------------------------------------------------------------------------------------
# norms
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_float64_reference(dtype):
    norm = hp.seeded_module(lambda: sf.RMSNorm(DIM))
    x = torch.randn(3, 5, DIM).to(dtype)
    out = norm.to(dtype)(x)
    assert out.dtype == dtype
    want = hp.ref_rms_norm(x.double(), norm.weight.detach().double(), norm.eps)
    hp.assert_close(out, want, f"RMSNorm in {dtype}", dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_statistics_in_float32_for_large_half_inputs(dtype):
    """x ** 2 overflows float16 at |x| > 256: statistics must be kept in float32 (S7)."""
    norm = sf.RMSNorm(DIM).to(dtype)
    x = (torch.randn(2, 4, DIM) * 3e4).clamp(-6e4, 6e4).to(dtype)
    out = norm(x)
    hp.assert_finite(out, "RMSNorm of large half inputs")
    hp.assert_close(out, hp.ref_rms_norm(x.double(), torch.ones(DIM, dtype=torch.float64), norm.eps), "RMSNorm", dtype)


def test_make_norm_picks_rmsnorm_or_layernorm_and_they_differ():
    rms, ln = sf.nn.modules.make_norm(DIM, True), sf.nn.modules.make_norm(DIM, False)
    assert isinstance(rms, sf.RMSNorm) and isinstance(ln, sf.nn.modules.LayerNorm) and ln.bias is None  # x-transformers
    x = torch.randn(2, 3, DIM, dtype=torch.float64) + 2.0  # a mean offset: LayerNorm removes it, RMSNorm does not
    hp.assert_close(ln.double()(x), hp.ref_layer_norm(x, torch.ones(DIM).double(), torch.zeros(DIM).double(), ln.eps), "LayerNorm", torch.float64)
    hp.assert_close(rms.double()(x), hp.ref_rms_norm(x, torch.ones(DIM).double(), rms.eps), "RMSNorm", torch.float64)
    with torch.no_grad():
        assert float((ln.double()(x) - rms.double()(x)).abs().max()) > 0.5


# ----------------------------------------------------------------------------------------------------
# feed-forward
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("glu,swish,name", [(False, False, "GELU"), (True, False, "GEGLU"), (True, True, "SwiGLU"), (False, True, "SiLU")])
def test_feed_forward_matches_float64_reference(glu, swish, name):
    ff = hp.seeded_module(lambda: sf.FeedForward(DIM, mult=2, glu=glu, swish=swish)).double()
    assert ff.proj_in.out_features == 2 * DIM * (2 if glu else 1) and ff.proj_out.in_features == 2 * DIM
    x = torch.randn(3, 4, DIM, dtype=torch.float64)
    hp.assert_close(ff(x), hp.ref_feed_forward(ff, x), name, torch.float64)
    ff32 = hp.copy_weights(sf.FeedForward(DIM, mult=2, glu=glu, swish=swish), ff)
    hp.assert_close(ff32(x.float()), hp.ref_feed_forward(ff, x), f"{name} float32", torch.float32)


def test_feed_forward_gates_differ_from_plain_mlp():
    """GEGLU and SwiGLU are gated (the product of two projections), not the ungated MLP."""
    x = torch.randn(2, 3, DIM, dtype=torch.float64)
    geglu = hp.seeded_module(lambda: sf.FeedForward(DIM, glu=True)).double()
    swiglu = hp.copy_weights(sf.FeedForward(DIM, glu=True, swish=True).double(), geglu)
    with torch.no_grad():
        assert float((geglu(x) - swiglu(x)).abs().max()) > 1e-3


@pytest.mark.parametrize("mult", [0, -1.0])
def test_feed_forward_rejects_bad_mult(mult):
    with pytest.raises(ValueError, match="mult"):
        sf.FeedForward(DIM, mult=mult)


# ----------------------------------------------------------------------------------------------------
# positions
# ----------------------------------------------------------------------------------------------------


def test_positions_from_mask_counts_real_tokens():
    mask = torch.tensor([[False, False, True, True], [True, True, False, False], [True, False, True, True], [False] * 4])
    pos = sf.positions_from_mask(mask, 4, "cpu")
    want = hp.ref_positions(mask, 4, 4)
    assert torch.equal(pos[mask], want[mask])  # real tokens: 0, 1, 2, ... whatever the padding
    # documented for padding: the position of the last real token before it (0 before any)
    assert pos.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1], [0, 0, 1, 2], [0, 0, 0, 0]]
    assert torch.equal(sf.positions_from_mask(None, 3, "cpu"), torch.tensor([[0, 1, 2]]))
    offset = torch.tensor([5, 0, 2, 7])
    assert torch.equal(sf.positions_from_mask(mask, 4, "cpu", offset=offset), pos + offset[:, None])


def test_absolute_positional_embedding_scale_and_clamp():
    emb = hp.seeded_module(lambda: sf.AbsolutePositionalEmbedding(DIM, 6))
    pos = torch.tensor([[0, 3, 5, 9]])
    out = emb.embed_positions(pos)
    w = emb.emb.weight.detach()
    want = torch.stack([w[0], w[3], w[5], w[5]]) * DIM**-0.5  # positions past the table clamp to its end
    hp.assert_close(out[0], want, "absolute positions", torch.float32)


@pytest.mark.parametrize("rot_dim", [2, 4, 8])
def test_rotary_matches_complex_rotation(rot_dim):
    rot = sf.RotaryEmbedding(rot_dim, theta=100.0)
    pos = torch.tensor([[0, 1, 5, 2, 11]])
    t = torch.randn(1, 2, 5, DIM_HEAD, dtype=torch.float64)
    got = sf.apply_rotary(t, rot.angles(pos).double())
    for h in range(2):
        want = hp.ref_rotate(t[0, h], pos[0], rot_dim, 100.0)
        hp.assert_close(got[0, h], want, f"rotary (rot_dim {rot_dim})", torch.float32)  # angles are float32
    assert torch.equal(got[..., rot_dim:], t[..., rot_dim:])  # features past rot_dim pass through


def test_rotary_scores_depend_only_on_relative_position():
    rot = sf.RotaryEmbedding(DIM_HEAD)
    q, k = torch.randn(1, 1, 1, DIM_HEAD, dtype=torch.float64), torch.randn(1, 1, 1, DIM_HEAD, dtype=torch.float64)

    def score(pq, pk):
        return float(sf.apply_rotary(q, rot.angles(torch.tensor([[pq]])).double()) @ sf.apply_rotary(k, rot.angles(torch.tensor([[pk]])).double()).transpose(-1, -2))

    assert score(7, 3) == pytest.approx(score(4, 0), abs=1e-5)
    assert score(10, 10) == pytest.approx(float(q @ k.transpose(-1, -2)), abs=1e-5)


@pytest.mark.parametrize("bad", [0, 3, -2])
def test_rotary_rejects_odd_or_nonpositive_dim(bad):
    with pytest.raises(ValueError, match="rotary_emb_dim"):
        sf.RotaryEmbedding(bad)


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8, 12, 16])
def test_alibi_slopes_follow_the_paper(heads):
    got = sf.alibi_slopes(heads)
    assert got.tolist() == pytest.approx(hp.ref_alibi_slopes(heads), rel=1e-6)
    if heads == 8:
        assert got.tolist() == pytest.approx([2.0 ** -(k + 1) for k in range(8)])


def test_alibi_bias_is_minus_slope_times_distance():
    slopes = torch.tensor([0.5, 0.25])
    qp, kp = torch.tensor([[0, 1, 4]]), torch.tensor([[2, 0, 1, 4]])
    bias = sf.alibi_bias(slopes, qp, kp)
    assert bias.shape == (1, 2, 3, 4)
    for h in range(2):
        for i in range(3):
            for j in range(4):
                assert float(bias[0, h, i, j]) == -float(slopes[h]) * abs(int(qp[0, i]) - int(kp[0, j]))


# ----------------------------------------------------------------------------------------------------
# Attention against a float64 reference
# ----------------------------------------------------------------------------------------------------


def _attention(**kw) -> sf.Attention:
    return hp.seeded_module(lambda: sf.Attention(DIM, dim_head=DIM_HEAD, **{"heads": 4, **kw}))


ATTN_CONFIGS = {
    "mha": dict(),
    "gqa": dict(kv_heads=2),
    "mqa": dict(kv_heads=1),
    "qk_norm": dict(qk_norm=True),
    "bias": dict(bias=True),
    "gqa_qknorm_bias": dict(kv_heads=2, qk_norm=True, bias=True),
}


@pytest.mark.parametrize("name", list(ATTN_CONFIGS))
@pytest.mark.parametrize("backend", hp.ALL_BACKENDS)
def test_attention_self_matches_float64_reference(name, backend):
    attn = _attention(backend=backend, **ATTN_CONFIGS[name])
    x = torch.randn(3, 5, DIM, dtype=torch.float64)
    key_pad = torch.tensor([[True] * 5, [True, True, True, False, False], [False] * 5])
    allowed = key_pad[:, None, None, :]
    for causal in (False, True):
        want = hp.ref_attention(attn, x, allowed=allowed, causal=causal)
        want = torch.where(key_pad[..., None], want, 0.0)  # a (b, j) mask in self-attention pads x itself
        for dtype in (torch.float64, torch.float32):
            out = attn.to(dtype)(x.to(dtype), mask=key_pad, causal=causal)
            hp.assert_close(out, want, f"{name} {backend} causal={causal} {dtype}", dtype)
            _, inter = attn(x.to(dtype), mask=key_pad, causal=causal, return_intermediates=True)
            k, v = inter.cached_kv
            assert k.shape == (3, attn.kv_heads, 5, DIM_HEAD) and v.shape == k.shape
        hp.assert_zero(out[2], "fully padded sample (dead rows)")




@pytest.mark.parametrize("name", list(ATTN_CONFIGS))
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_attention_causal_left_padding_matches_reference(name, backend):
    """Left padding under causal masking: queries before the first real key are dead rows (exactly 0)."""
    attn = _attention(backend=backend, **ATTN_CONFIGS[name]).double()
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    key_pad = torch.tensor([[False, False, True, True, True], [False, True, True, True, True]])
    out = attn(x, mask=key_pad, causal=True)
    hp.assert_zero(out[0, :2], "sample 0, queries before the first real key")
    hp.assert_zero(out[1, :1], "sample 1, query before the first real key")
    hp.assert_close(out, hp.ref_attention(attn, x, allowed=key_pad[:, None, None, :], causal=True), name, torch.float64)


@pytest.mark.parametrize("name", ["mha", "mqa", "gqa_qknorm_bias"])
def test_attention_cross_matches_float64_reference(name):
    attn = _attention(dim_context=CTX_DIM, **ATTN_CONFIGS[name])
    x = torch.randn(3, 4, DIM, dtype=torch.float64)
    ctx = torch.randn(3, 6, CTX_DIM, dtype=torch.float64)
    cmask = torch.tensor([[True, True, False, True, False, False], [False] * 6, [True] * 6])
    out = attn.double()(x, ctx, mask=cmask)
    hp.assert_close(out, hp.ref_attention(attn, x, ctx, allowed=cmask[:, None, None, :]), name, torch.float64)
    hp.assert_zero(out[1], "all-False context")


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_mask_forms_agree(kv_heads):
    """``(b, j)``, ``(i, j)``, ``(b, i, j)`` and per-head ``(b, h, i, j)`` masks mean what they say."""
    attn = _attention(kv_heads=kv_heads).double()
    b, i = 2, 5
    x = torch.randn(b, i, DIM, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    per_head = torch.rand(b, 4, i, i, generator=g) > 0.5
    per_head[0, 1] = False  # one head fully dead for sample 0
    per_head[1, :, 2] = False  # one query dead in every head
    forms = {
        "(b, j)": (torch.tensor([[True, True, False, True, True], [False, True, True, True, False]]), None),
        "(i, j)": (torch.rand(i, i, generator=g) > 0.4, None),
        "(b, i, j)": (torch.rand(b, i, i, generator=g) > 0.4, None),
        "(b, h, i, j)": (per_head, None),
        "(1, 1, i, j)": ((torch.rand(1, 1, i, i, generator=g) > 0.4), None),
    }
    for label, (mask, _) in forms.items():
        if label == "(b, j)":
            allowed = mask[:, None, None, :]
        elif label == "(i, j)":
            allowed = mask[None, None]
        elif label == "(b, i, j)":
            allowed = mask[:, None]
        else:
            allowed = mask
        out = attn(x, mask=mask)
        want = hp.ref_attention(attn, x, allowed=allowed)
        if label == "(b, j)":  # in self-attention a padding mask pads x itself: padded rows are exactly 0
            want = torch.where(mask[..., None], want, 0.0)
        hp.assert_close(out, want, f"mask {label}", torch.float64)
    out = attn(x, mask=per_head)
    hp.assert_zero(out[1, 2], "a query dead in every head")


def test_attention_rotary_and_alibi_match_reference():
    attn = _attention(kv_heads=2).double()
    rot = sf.RotaryEmbedding(4)
    pos = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    key_pad = torch.tensor([[False, False, True, True, True], [True] * 5])
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    angles = rot.angles(pos).double()
    out = attn(x, mask=key_pad, causal=True, rotary=(angles, angles))
    want = hp.ref_attention(attn, x, allowed=key_pad[:, None, None, :], causal=True, q_pos=pos, k_pos=pos, rot_dim=4)
    hp.assert_close(out[key_pad], want[key_pad], "rotary", torch.float32)
    bias = sf.alibi_bias(sf.alibi_slopes(4), pos, pos).double()
    out = attn(x, mask=key_pad, causal=True, bias=bias)
    want = hp.ref_attention(attn, x, allowed=key_pad[:, None, None, :], causal=True, q_pos=pos, k_pos=pos, alibi=True)
    hp.assert_close(out, want, "ALiBi", torch.float64)


@hp.examples(10)
@given(
    b=st.integers(1, 3), n=st.integers(1, 6), kv=st.sampled_from([1, 2, 4]), qk_norm=st.booleans(),
    bias=st.booleans(), seed=st.integers(0, 1000),
)
def test_attention_property_float32_vs_float64(b, n, kv, qk_norm, bias, seed):
    """Random sizes and per-sample padding (dead rows included): float32 on every backend = float64 reference."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, n + 1, (b,), generator=g)
    key_pad = sf.padding_mask(lengths, n, left=bool(seed % 2))
    x = torch.randn(b, n, DIM, generator=g)
    attn = _attention(kv_heads=kv, qk_norm=qk_norm, bias=bias)
    want = hp.ref_attention(attn, x.double(), allowed=key_pad[:, None, None, :], causal=True)
    want = torch.where(key_pad[..., None], want, 0.0)  # padded positions of x are no queries
    for backend in hp.ALL_BACKENDS:
        hp.set_backend(attn, backend)
        out = attn(x, mask=key_pad, causal=True)
        hp.assert_close(out, want, f"backend {backend}", torch.float32)


def test_attention_kv_cache_matches_full_forward():
    """Self-attention one query at a time with ``past_kv`` (rotary applied before caching) = full causal."""
    attn = _attention(kv_heads=2, qk_norm=True).double()
    rot = sf.RotaryEmbedding(4)
    n = 6
    x = torch.randn(2, n, DIM, dtype=torch.float64)
    key_pad = torch.tensor([[False, False, True, True, True, True], [True] * n])
    pos = sf.positions_from_mask(key_pad, n, "cpu")
    ang = rot.angles(pos).double()
    full = attn(x, mask=key_pad, causal=True, rotary=(ang, ang))
    out, inter = attn(x[:, :2], mask=key_pad[:, :2], causal=True, rotary=(ang[:, :, :2], ang[:, :, :2]),
                      return_intermediates=True)
    steps = [out]
    for t in range(2, n):
        a = ang[:, :, t : t + 1]
        out, inter = attn(x[:, t : t + 1], mask=key_pad[:, : t + 1], causal=True, rotary=(a, a), cache=inter,
                          return_intermediates=True)
        steps.append(out)
    hp.assert_close(torch.cat(steps, 1), full, "cached vs full", torch.float64)
    hp.assert_zero(full[0, :2], "left padding under causal: dead rows")


# ----------------------------------------------------------------------------------------------------
# S2 at the module level: an empty context contributes exactly nothing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("backend", hp.ALL_BACKENDS)
def test_attention_all_false_context_is_exactly_zero_with_zero_grads(bias, kv_heads, backend):
    attn = hp.seeded_module(lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, kv_heads=kv_heads, dim_context=CTX_DIM,
                                                 bias=bias, qk_norm=True, backend=backend))
    x = torch.randn(2, 3, DIM, requires_grad=True)
    ctx = torch.randn(2, 4, CTX_DIM, requires_grad=True)
    for label, kwargs in (("all-False mask", dict(context=ctx, mask=torch.zeros(2, 4, dtype=torch.bool))),
                          ("zero-length context", dict(context=ctx[:, :0]))):
        attn.zero_grad(set_to_none=True)
        x.grad = ctx.grad = None
        out = attn(x, **kwargs)
        hp.assert_zero(out, f"{label}: output")
        (out * torch.randn_like(out)).sum().backward()
        for name in ("to_q", "to_k", "to_v", "to_out"):
            lin = getattr(attn, name)
            hp.assert_zero(lin.weight.grad, f"{label}: grad of {name}.weight", none_ok=True)
            if bias:
                hp.assert_zero(lin.bias.grad, f"{label}: grad of {name}.bias", none_ok=True)
        hp.assert_zero(x.grad, f"{label}: grad of x", none_ok=True)
        hp.assert_zero(ctx.grad, f"{label}: grad of context", none_ok=True)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_attention_dropout_keeps_dead_rows_zero(backend):
    attn = hp.seeded_module(lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, dim_context=CTX_DIM, dropout=0.5, backend=backend))
    x, ctx = torch.randn(2, 3, DIM), torch.randn(2, 4, CTX_DIM)
    mask = torch.tensor([[True, False, True, True], [False] * 4])
    attn.train()
    out = attn(x, ctx, mask=mask)
    hp.assert_finite(out, "output with dropout")
    hp.assert_zero(out[1], "dead rows with dropout")
    attn.eval()  # no dropout at evaluation: equals the float64 reference
    out = attn(x, ctx, mask=mask)
    hp.assert_close(out, hp.ref_attention(attn, x, ctx, allowed=mask[:, None, None, :]), "eval mode", torch.float32)


# ----------------------------------------------------------------------------------------------------
# S3 at the module level
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_masked_context_garbage_changes_no_output(qk_norm):
    attn = hp.seeded_module(lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, dim_context=CTX_DIM, qk_norm=qk_norm))
    x, ctx = torch.randn(2, 3, DIM), torch.randn(2, 5, CTX_DIM)
    mask = torch.tensor([[True, True, False, True, False], [False] * 5])
    clean = attn(x, ctx, mask=mask)
    for value in (NAN, math.inf, -math.inf):
        dirty = torch.where(mask[..., None], ctx, value)
        out = attn(x, dirty, mask=mask)
        hp.assert_bitwise(out, clean, f"output with {value} in masked context")


def _masked_context_grads(qk_norm: bool):
    attn = hp.seeded_module(lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, dim_context=CTX_DIM, qk_norm=qk_norm))
    x = torch.randn(2, 3, DIM)
    mask = torch.tensor([[True, True, False, True, False], [False] * 5])
    ctx = torch.where(mask[..., None], torch.randn(2, 5, CTX_DIM), NAN).requires_grad_()
    out = attn(x, ctx, mask=mask)
    out.sum().backward()
    return attn, ctx, mask


def test_attention_qk_norm_masked_context_gets_zero_gradient():
    _, ctx, mask = _masked_context_grads(qk_norm=True)
    hp.assert_zero(ctx.grad[~mask], "grad of masked context positions")


def test_attention_masked_context_gets_zero_gradient_without_qk_norm():
    _, ctx, mask = _masked_context_grads(qk_norm=False)
    hp.assert_zero(ctx.grad[~mask], "grad of masked context positions")
    hp.assert_finite(ctx.grad[mask], "grad of real context positions")


def test_attention_masked_context_keeps_parameter_grads_finite():
    attn, _, _ = _masked_context_grads(qk_norm=False)
    for name, p in attn.named_parameters():
        hp.assert_finite(p.grad, f"grad of {name}")


# ----------------------------------------------------------------------------------------------------
# S9 at the module level
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(heads=0), "heads"),
    (dict(dim_head=0), "dim_head"),
    (dict(heads=4, kv_heads=3), "kv_heads"),
    (dict(kv_heads=0), "kv_heads"),
    (dict(backend="fast"), "backend"),
    (dict(dropout=1.0), "dropout"),
    (dict(dropout=-0.1), "dropout"),
])
def test_attention_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sf.Attention(DIM, **kwargs)


def test_attention_rejects_bad_masks_and_context():
    attn = sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, dim_context=CTX_DIM)
    x, ctx = torch.randn(2, 3, DIM), torch.randn(2, 4, CTX_DIM)
    with pytest.raises(TypeError, match=r"^mask must have dtype torch.bool.*got torch.int64"):
        attn(x, ctx, mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask .*\(2, 5\)"):
        attn(x, ctx, mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"context must have feature size 12.*\(2, 4, 16\)"):
        attn(x, torch.randn(2, 4, DIM))
    with pytest.raises(ValueError, match="mask is on meta"):
        attn(x, ctx, mask=torch.ones(2, 4, dtype=torch.bool, device="meta"))
