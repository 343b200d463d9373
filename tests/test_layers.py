"""Tests for safeformer/layers.py: AttentionLayers, Encoder, Decoder, CrossAttender and the KV cache.

Whole stacks are compared with ``helpers.ref_stack``, a float64 pre-norm stack built from the
module's weights with loops (``ref_attention``, ``ref_feed_forward``, ``ref_norm``).

Shape legend: b batch, n positions, p cached positions, j context positions, h heads, c model width.
"""

from __future__ import annotations

import helpers as hp
import pytest
import torch
from helpers import CTX_DIM, DIM, DIM_HEAD, HEADS
from hypothesis import given
from hypothesis import strategies as st

import safeformer as sf


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield



BASE = dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD)
STACKS = {
    "encoder_layernorm": (sf.Encoder, dict()),
    "encoder_rmsnorm_alibi": (sf.Encoder, dict(use_rmsnorm=True, alibi_pos_bias=True, heads=4)),
    "decoder_rotary_mqa": (sf.Decoder, dict(kv_heads=1, rotary_pos_emb=True, rotary_emb_dim=4)),
    "decoder_cross_geglu_qknorm": (sf.Decoder, dict(cross_attend=True, dim_context=CTX_DIM, ff_glu=True, attn_qk_norm=True)),
    "decoder_alibi_swiglu_bias": (sf.Decoder, dict(alibi_pos_bias=True, ff_glu=True, ff_swish=True, attn_bias=True, heads=4, kv_heads=2)),
    "decoder_cross_rotary_gqa": (sf.Decoder, dict(cross_attend=True, dim_context=CTX_DIM, rotary_pos_emb=True, heads=4, kv_heads=2)),
    "cross_attender_rmsnorm": (sf.CrossAttender, dict(dim_context=CTX_DIM, use_rmsnorm=True)),
    "encoder_cross": (sf.Encoder, dict(cross_attend=True, dim_context=CTX_DIM, ff_mult=2)),
}


def build(name: str, **extra) -> sf.AttentionLayers:
    cls, kw = STACKS[name]
    return hp.seeded_module(lambda: cls(**{**BASE, **kw, **extra}))


def ref_dtype(layers: sf.AttentionLayers) -> torch.dtype:
    """The precision a float64 stack reaches: rotary angles of integer positions are float32."""
    return torch.float32 if layers._sf_config["rotary_pos_emb"] else torch.float64


def has_ctx(layers: sf.AttentionLayers) -> bool:
    return layers.has_cross


MASK = torch.tensor([
    [True, True, True, True, True, True],
    [False, False, True, True, True, True],  # left padding
    [True, True, True, True, False, False],  # right padding
    [True, False, True, True, False, True],  # holes
    [False] * 6,  # fully padded
])
CTX_MASK = torch.tensor([
    [True, True, True, True, True],
    [False] * 5,  # empty context
    [True, True, False, True, False],
    [False, False, True, True, True],
    [True, False, False, False, False],
])


def inputs(layers: sf.AttentionLayers, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(MASK.shape[0], MASK.shape[1], DIM, generator=g).to(dtype)
    kw = dict(mask=MASK)
    if has_ctx(layers):
        kw.update(context=torch.randn(CTX_MASK.shape[0], CTX_MASK.shape[1], CTX_DIM, generator=g).to(dtype), context_mask=CTX_MASK)
    return x, kw


# ----------------------------------------------------------------------------------------------------
# the stack against a float64 reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(STACKS))
def test_stack_matches_float64_reference(name):
    layers = build(name).double()
    x, kw = inputs(layers)
    out = layers(x, **kw)
    want = hp.ref_stack(layers, x, **kw)
    hp.assert_close(out[MASK], want[MASK], name, ref_dtype(layers))
    out32 = hp.copy_weights(build(name), layers)(x.float(), **{k: (v.float() if v.is_floating_point() else v) for k, v in kw.items()})
    hp.assert_close(out32[MASK], want[MASK], f"{name} in float32", torch.float32)


@pytest.mark.parametrize("name", ["encoder_layernorm", "decoder_rotary_mqa", "decoder_alibi_swiglu_bias"])
def test_attn_mask_restricts_self_attention(name):
    layers = build(name).double()
    x, kw = inputs(layers)
    g = torch.Generator().manual_seed(5)
    for extra in (torch.rand(6, 6, generator=g) > 0.3, torch.rand(5, 6, 6, generator=g) > 0.3):
        out = layers(x, attn_mask=extra, **kw)
        want = hp.ref_stack(layers, x, attn_mask=extra, **kw)
        hp.assert_close(out[MASK], want[MASK], f"{name} with attn_mask {tuple(extra.shape)}", ref_dtype(layers))


@pytest.mark.parametrize("name", ["decoder_rotary_mqa", "encoder_rmsnorm_alibi"])
def test_relative_positions_are_shift_invariant(name):
    """Rotary and ALiBi see only position differences: shifting every position by 7 changes nothing,
    and explicit positions equal to the default ones give the default output."""
    layers = build(name).double()
    x, kw = inputs(layers)
    default = layers(x, **kw)
    pos = sf.positions_from_mask(MASK, MASK.shape[1], "cpu")
    hp.assert_close(layers(x, positions=pos, **kw), default, "explicit default positions", torch.float64)
    hp.assert_close(layers(x, positions=pos + 7, **kw)[MASK], default[MASK], "positions + 7", torch.float32)
    want = hp.ref_stack(layers, x, positions=pos + 7, **kw)
    hp.assert_close(layers(x, positions=pos + 7, **kw)[MASK], want[MASK], "positions + 7 vs reference", torch.float32)


def test_structure_follows_the_configuration():
    enc = sf.Encoder(**BASE)
    dec = sf.Decoder(**BASE, cross_attend=True, use_rmsnorm=True)
    ca = sf.CrossAttender(**BASE)
    assert enc.layer_kinds == ("self", "ff") * 2 and not enc.causal
    assert dec.layer_kinds == ("self", "cross", "ff") * 2 and dec.causal
    assert ca.layer_kinds == ("cross", "ff") * 2 and not ca.causal
    LayerNorm = sf.nn.modules.LayerNorm
    assert all(isinstance(blk[0][0], LayerNorm) for blk in enc.layers) and isinstance(enc.final_norm, LayerNorm)
    assert all(isinstance(blk[0][0], sf.RMSNorm) for blk in dec.layers) and isinstance(dec.final_norm, sf.RMSNorm)
    # x-transformers' layer: [norms, block, residual], norms = [pre, post-branch (sandwich), post-main]
    assert all(len(blk) == 3 and len(blk[0]) == 3 and blk[0][1] is None and blk[0][2] is None for blk in enc.layers)
    gqa = sf.Decoder(**{**BASE, "heads": 4}, kv_heads=2)
    attn = gqa.layers[0][1]
    assert (attn.heads, attn.kv_heads) == (4, 2)
    assert attn.to_k.out_features == 2 * DIM_HEAD and attn.to_q.out_features == 4 * DIM_HEAD
    glu = sf.Encoder(**BASE, ff_glu=True, ff_mult=2)
    assert glu.layers[1][1].proj_in.out_features == 2 * 2 * DIM


# ----------------------------------------------------------------------------------------------------
# padding invariance
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(STACKS))
def test_padded_batch_equals_each_sample_alone(name):
    """Left padding, right padding and holes: every real position equals the sample run alone, with
    its context's padding removed (an all-False context = a zero-length context alone)."""
    layers = build(name).double()
    x, kw = inputs(layers)
    out = layers(x, **kw)
    for s in range(MASK.shape[0]):
        if not MASK[s].any():
            continue
        alone_kw = {}
        if has_ctx(layers):
            alone_kw["context"] = kw["context"][s : s + 1, CTX_MASK[s]]
        alone = layers(x[s : s + 1, MASK[s]], **alone_kw)
        hp.assert_close(out[s, MASK[s]], alone[0], f"{name}: sample {s}", torch.float64)


@pytest.mark.parametrize("name", ["decoder_cross_geglu_qknorm", "decoder_cross_rotary_gqa", "encoder_cross", "cross_attender_rmsnorm"])
def test_per_sample_empty_context_equals_no_context(name):
    """A sample whose context is all-False (or, alone, zero-length) gets what ``context=None`` gives it."""
    layers = build(name).double()
    x, kw = inputs(layers)
    out = layers(x, **kw)
    s = 1  # CTX_MASK[1] is all False
    x1, m1 = x[s : s + 1], MASK[s : s + 1]
    if isinstance(layers, sf.CrossAttender):  # needs a context: the zero-length one stands for "none"
        ref = layers(x1, mask=m1, context=kw["context"][s : s + 1, :0])
    else:
        ref = layers(x1, mask=m1)
    hp.assert_close(out[s][MASK[s]], ref[0][MASK[s]], "all-False context vs no context", torch.float64)
    hp.assert_close(layers(x1, mask=m1, context=kw["context"][s : s + 1, :0])[0][MASK[s]], ref[0][MASK[s]], "zero-length context", torch.float64)


# ----------------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------------

DECODERS = ["decoder_rotary_mqa", "decoder_cross_geglu_qknorm", "decoder_alibi_swiglu_bias", "decoder_cross_rotary_gqa"]


def decode(layers, x, kw, prefix: int, chunk: int):
    mask = kw["mask"]
    first = {k: v for k, v in kw.items() if k != "mask"}
    out, cache = layers(x[:, :prefix], mask=mask[:, :prefix], return_cache=True, **first)
    outs = [out]
    t = prefix
    while t < x.shape[1]:
        out, cache = layers(x[:, t : t + chunk], mask=mask[:, t : t + chunk], cache=cache, return_cache=True)
        outs.append(out)
        t += chunk
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("prefix,chunk", [(1, 1), (3, 1), (2, 2), (1, 3)])
def test_cached_decoding_equals_full_forward(name, prefix, chunk):
    """Decoding in steps (one or more tokens a step) with the KV cache, left padding, a fully padded
    sample and an empty context cached, equals the full forward at every real position."""
    layers = build(name).double()
    x, kw = inputs(layers)
    full = layers(x, **kw)
    inc, cache = decode(layers, x, kw, prefix, chunk)
    hp.assert_close(inc[MASK], full[MASK], f"{name} prefix {prefix} chunk {chunk}", torch.float64)
    assert cache.length == MASK.shape[1]
    assert torch.equal(cache.count, MASK.sum(1))
    assert torch.equal(cache.mask, MASK)
    assert len(cache.self_kv) == 2
    if has_ctx(layers):
        assert cache.cross_kv is not None and len(cache.cross_kv) == 2
        assert torch.equal(cache.context_mask, CTX_MASK)
        assert cache.cross_kv[0][0].shape[2] == CTX_MASK.shape[1]
    else:
        assert cache.cross_kv is None


@hp.examples(10)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=3), ctx_lengths=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    prefix=st.integers(1, 5), name=st.sampled_from(DECODERS),
)
def test_cached_decoding_property(lengths, ctx_lengths, prefix, name):
    """Random left padding (dead rows when a prefix holds only padding) and per-sample context lengths."""
    b, n = len(lengths), 5
    layers = build(name)
    mask = sf.padding_mask(torch.tensor(lengths), n, left=True)
    g = torch.Generator().manual_seed(sum(lengths) + 10 * prefix)
    x = torch.randn(b, n, DIM, generator=g)
    kw = dict(mask=mask)
    if has_ctx(layers):
        kw.update(context=torch.randn(b, 4, CTX_DIM, generator=g), context_mask=sf.padding_mask(torch.tensor(ctx_lengths[:b]), 4))
    full = layers(x, **kw)
    inc, _ = decode(layers, x, kw, min(prefix, n), 1)
    hp.assert_close(inc[mask], full[mask], name, torch.float32)
    hp.assert_finite(inc, "cached outputs, padding included")


def test_cache_index_select_reorders_samples():
    layers = build("decoder_cross_rotary_gqa").double()
    x, kw = inputs(layers)
    _, cache = layers(x[:, :4], mask=MASK[:, :4], context=kw["context"], context_mask=CTX_MASK, return_cache=True)
    order = torch.tensor([3, 0, 1])
    out = layers(x[order, 4:], mask=MASK[order, 4:], cache=cache.index_select(order))
    full = layers(x[order], mask=MASK[order], context=kw["context"][order], context_mask=CTX_MASK[order])
    m = MASK[order, 4:]
    hp.assert_close(out[m], full[:, 4:][m], "reordered cache", ref_dtype(layers))


def test_cache_index_select_repeats_a_single_sample():
    layers = build("decoder_rotary_mqa").double()
    x = torch.randn(1, 4, DIM, dtype=torch.float64)
    _, cache = layers(x[:, :3], return_cache=True)
    rep = cache.index_select(torch.tensor([0, 0]))
    out = layers(x[:, 3:].expand(2, 1, DIM), cache=rep)
    full = layers(x)
    hp.assert_close(out, full[:, 3:].expand(2, 1, DIM), "repeated cache", torch.float32)


# ----------------------------------------------------------------------------------------------------
# what the kernel receives
# ----------------------------------------------------------------------------------------------------


def _record(layers, *args, **kwargs):
    rec = hp.RecordingKernel()
    with sf.testing.substitute_kernel(rec):
        out = layers(*args, **kwargs)
    return rec.calls, out


def test_padding_masks_stay_broadcast():
    """Padding masks reach the kernel as bool (b, 1, 1, j) (encoder, cross-attention) or as one additive
    (b, 1, n, n) (decoder: padding and causal combined, prepared once), never as a dense (b, h, i, j)."""
    b, n, j = MASK.shape[0], MASK.shape[1], CTX_MASK.shape[1]
    enc = hp.set_unpadded(build("encoder_cross", heads=4), False)  # the padded path (unpadded: below)
    calls, _ = _record(enc, torch.randn(b, n, DIM), mask=MASK, context=torch.randn(b, j, CTX_DIM), context_mask=CTX_MASK)
    assert len(calls) == 4
    for c in calls:
        assert c.mask_dtype == torch.bool and c.mask_shape == (b, 1, 1, c.k_shape[2]), c
    dec = hp.set_unpadded(build("decoder_cross_rotary_gqa"), False)
    calls, _ = _record(dec, torch.randn(b, n, DIM), mask=MASK, context=torch.randn(b, j, CTX_DIM), context_mask=CTX_MASK)
    self_calls = [c for c in calls if c.k_shape[2] == n]
    cross_calls = [c for c in calls if c.k_shape[2] == j]
    assert len(self_calls) == 2 and len(cross_calls) == 2
    # padding + causal: the stack's PreparedMask, one additive float mask shared by every layer
    assert all(c.mask_shape == (b, 1, n, n) and c.mask_dtype == torch.float32 and not c.is_causal for c in self_calls), self_calls
    assert all(c.mask_shape == (b, 1, 1, j) and c.mask_dtype == torch.bool for c in cross_calls), cross_calls
    assert all(c.enable_gqa and c.k_shape[1] == 2 and c.q_shape[1] == 4 for c in calls), "GQA should reach the kernel unexpanded"


def test_unpadded_path_hands_the_kernels_compacted_layouts():
    """On the unpadded path, self-attention runs on compacted per-group layouts: a decoder hands the kernel
    is_causal and no mask tensor, an encoder a (b_g, 1, 1, L_g) key padding; cross-attention keeps the
    broadcast (b, 1, 1, j) context mask."""
    b, n, j = MASK.shape[0], MASK.shape[1], CTX_MASK.shape[1]
    dec = hp.set_unpadded(build("decoder_cross_rotary_gqa"), True)
    calls, _ = _record(dec, torch.randn(b, n, DIM), mask=MASK, context=torch.randn(b, j, CTX_DIM), context_mask=CTX_MASK)
    cross = [c for c in calls if c.mask_shape == (b, 1, 1, j)]
    self_calls = [c for c in calls if c not in cross]
    assert len(cross) == 2 and self_calls
    assert all(c.is_causal and c.mask_shape is None for c in self_calls), self_calls
    real = int(MASK.sum(1).max())
    assert all(c.q_shape[2] <= real for c in self_calls), "a group's layout is as long as its longest sample"
    enc = hp.set_unpadded(build("encoder_cross", heads=4), True)
    calls, _ = _record(enc, torch.randn(b, n, DIM), mask=MASK, context=torch.randn(b, j, CTX_DIM), context_mask=CTX_MASK)
    for c in calls:
        assert c.mask_dtype == torch.bool and c.mask_shape[1:3] == (1, 1), c


def test_decoder_without_padding_passes_is_causal_and_no_mask():
    dec = build("decoder_rotary_mqa")
    x = torch.randn(2, 5, DIM)
    calls, out = _record(dec, x)
    assert len(calls) == 2
    assert all(c.is_causal and c.mask_shape is None for c in calls), calls
    hp.assert_close(out, hp.ref_stack(dec, x), "is_causal path vs reference", torch.float32)
    # a step with the cache: one query sees every cached key, no mask and no is_causal needed
    _, cache = dec(x[:, :4], return_cache=True)
    calls, step = _record(dec, x[:, 4:], cache=cache)
    assert all(not c.is_causal and c.mask_shape is None for c in calls), calls
    hp.assert_close(step, out[:, 4:], "one cached step", torch.float32)
    # several new tokens after a cache: a bottom-right causal mask (1, 1, n, p + n), still not per head
    _, cache = dec(x[:, :2], return_cache=True)
    calls, chunk = _record(dec, x[:, 2:], cache=cache)
    assert all(c.mask_shape == (1, 1, 3, 5) for c in calls), calls
    hp.assert_close(chunk, out[:, 2:], "three cached steps at once", torch.float32)


def test_alibi_reaches_the_kernel_as_a_float_bias():
    enc = build("encoder_rmsnorm_alibi")
    calls, _ = _record(enc, torch.randn(5, 6, DIM), mask=MASK)
    assert all(c.mask_dtype == torch.float32 and c.mask_shape[1:] == (4, 6, 6) for c in calls), calls


# ----------------------------------------------------------------------------------------------------
# configuration and input errors (S9)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,exc,match", [
    (lambda: sf.Encoder(**BASE, rotary_pos_emb=True, alibi_pos_bias=True), ValueError, "rotary_pos_emb or alibi_pos_bias"),
    (lambda: sf.AttentionLayers(**BASE, only_cross=True, causal=True), ValueError, "only_cross"),
    (lambda: sf.Encoder(**BASE, causal=True), TypeError, "causal"),
    (lambda: sf.Decoder(**BASE, causal=False), TypeError, "causal"),
    (lambda: sf.CrossAttender(**BASE, cross_attend=True), TypeError, "cross_attend"),
    (lambda: sf.CrossAttender(**BASE, only_cross=False), TypeError, "only_cross"),
    (lambda: sf.Encoder(dim=0, depth=1), ValueError, "dim"),
    (lambda: sf.Encoder(dim=DIM, depth=0), ValueError, "depth"),
    (lambda: sf.Decoder(**BASE, rotary_pos_emb=True, rotary_emb_dim=DIM_HEAD + 2), ValueError, "rotary_emb_dim"),
    (lambda: sf.Decoder(**BASE, rotary_pos_emb=True, rotary_emb_dim=3), ValueError, "rotary_emb_dim"),
    (lambda: sf.Encoder(**{**BASE, "heads": 4}, kv_heads=3), ValueError, "kv_heads"),
    (lambda: sf.Encoder(**BASE, backend="turbo"), ValueError, "backend"),
    (lambda: sf.Encoder(**BASE, ff_mult=0), ValueError, "mult"),
    (lambda: sf.Encoder(**BASE, rotary=True), TypeError, "rotary"),
    (lambda: sf.Decoder(**BASE, crossattend=True), TypeError, "crossattend"),
])
def test_configuration_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_input_errors_name_the_argument():
    dec = build("decoder_cross_geglu_qknorm")
    enc = build("encoder_layernorm")
    x, ctx = torch.randn(2, 3, DIM), torch.randn(2, 4, CTX_DIM)
    good = torch.ones(2, 3, dtype=torch.bool)
    cases = [
        (lambda: dec(x, mask=good.int()), TypeError, r"^mask must have dtype torch.bool"),
        (lambda: dec(x, mask=torch.ones(2, 1, dtype=torch.bool)), ValueError, r"^mask must have shape \(2, 3\), got \(2, 1\)"),
        (lambda: dec(x, mask=torch.ones(3, dtype=torch.bool)), ValueError, r"^mask must have shape"),
        (lambda: dec(x, context=ctx, context_mask=torch.ones(2, 4)), TypeError, r"^context_mask must have dtype"),
        (lambda: dec(x, context=ctx, context_mask=torch.ones(1, 4, dtype=torch.bool)), ValueError, r"^context_mask must have shape \(2, 4\)"),
        (lambda: dec(x, context_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, "context_mask was given without a context"),
        (lambda: dec(x, context=torch.randn(2, 4, CTX_DIM + 1)), ValueError, r"^context must have shape \(b=2, j, dim_context=12\)"),
        (lambda: dec(x, context=torch.randn(2, CTX_DIM)), ValueError, r"^context must be a tensor of shape"),
        (lambda: enc(x, context=ctx), ValueError, "no cross-attention"),
        (lambda: dec(torch.randn(2, 3, DIM + 1)), ValueError, r"^x must have shape \(b, n, dim=16\)"),
        (lambda: dec(x, attn_mask=torch.ones(3, 4, dtype=torch.bool)), ValueError, r"^attn_mask must have shape"),
        (lambda: dec(x, attn_mask=torch.ones(3, 3)), TypeError, r"^attn_mask must have dtype"),
        (lambda: sf.CrossAttender(**BASE)(torch.randn(2, 3, DIM)), ValueError, "needs a context"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.parametrize("name", ["encoder_cross", "decoder_cross_rotary_gqa", "cross_attender_rmsnorm"])
def test_zero_length_sequence(name):
    """n == 0 (and j == 0): an empty output of the right shape, and a finite backward."""
    layers = build(name)
    x = torch.randn(2, 0, DIM, requires_grad=True)
    ctx = torch.randn(2, 0, CTX_DIM, requires_grad=True)
    out = layers(x, mask=torch.zeros(2, 0, dtype=torch.bool), context=ctx, context_mask=torch.zeros(2, 0, dtype=torch.bool))
    assert out.shape == (2, 0, DIM)
    out.sum().backward()
    assert x.grad.shape == (2, 0, DIM)
    for pname, p in layers.named_parameters():
        hp.assert_zero(p.grad, f"grad of {pname}", none_ok=True)


def test_norm_eps_reaches_every_norm():
    for use_rms, default in ((False, 1e-5), (True, 1e-6)):
        norms = [m for m in sf.Encoder(**BASE, use_rmsnorm=use_rms).modules() if isinstance(m, (torch.nn.LayerNorm, sf.RMSNorm))]
        assert len(norms) == 5 and all(m.eps == default for m in norms)
        layers = sf.Encoder(**BASE, use_rmsnorm=use_rms, norm_eps=0.25)
        norms = [m for m in layers.modules() if isinstance(m, (torch.nn.LayerNorm, sf.RMSNorm))]
        assert len(norms) == 5 and all(m.eps == 0.25 for m in norms)
        assert layers.get_config()["norm_eps"] == 0.25
        x = torch.randn(2, 3, DIM, dtype=torch.float64)
        hp.assert_close(layers.double()(x), hp.ref_stack(layers, x), f"norm_eps=0.25 (rmsnorm={use_rms})", torch.float64)
