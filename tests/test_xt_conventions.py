"""x-transformers' calling conventions: ``Attention``'s call and return (``attn(x)`` is a tensor,
``return_intermediates``, ``cache=``, ``context_mask``, ``attn_mask``, ``rotary_pos_emb``), and
``ContinuousTransformerWrapper`` without ``max_seq_len``; each compared with x-transformers' own module on
the same weights, and for the safety contract (NaN at masked positions reaches nothing, dead rows are exact
zeros). The S1-S9 suite runs the ``Attention-*`` cases through the same calls (``helpers.models``).
"""

from __future__ import annotations

import importlib

import helpers as hp
import pytest
import torch

import safeformer as sf

NAN = float("nan")
xt = pytest.importorskip("x_transformers")
xx = importlib.import_module("x_transformers.x_transformers")
F64 = torch.float64


def _pair(causal=False, dim_context=None, flash=False, **opts):
    """x-transformers' ``Attention`` and safeformer's, same weights, float64."""
    torch.manual_seed(0)
    theirs = xx.Attention(dim=16, heads=2, dim_head=8, causal=causal, dim_context=dim_context, **opts).double()
    ours = sf.Attention(16, heads=2, dim_head=8, causal=causal, dim_context=dim_context, flash=flash).double()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


PAD = torch.tensor([[True] * 6, [True, True, True, True, False, False], [True, True, False, False, False, False]])


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_call_returns_a_tensor_like_x_transformers(causal):
    theirs, ours = _pair(causal=causal)
    x = torch.randn(3, 6, 16, dtype=F64)
    out = ours(x, mask=PAD)
    assert isinstance(out, torch.Tensor) and out.shape == x.shape
    hp.assert_close(out, theirs(x, mask=PAD), f"self-attention causal={causal}", torch.float32)  # both zero padded rows; x-transformers softmaxes in float32
    dirty = x.clone()
    dirty[~PAD] = NAN
    hp.assert_bitwise(ours(dirty, mask=PAD), out, "NaN at padded positions changes nothing")


def test_cross_attention_with_context_mask_like_x_transformers():
    theirs, ours = _pair(dim_context=12)
    x, ctx = torch.randn(3, 4, 16, dtype=F64), torch.randn(3, 5, 12, dtype=F64)
    cmask = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    out = ours(x, ctx, context_mask=cmask)
    hp.assert_close(out[:2], theirs(x[:2], ctx[:2], context_mask=cmask[:2]), "cross-attention", torch.float32)
    hp.assert_zero(out[2], "an empty context adds exactly 0")
    dirty = ctx.clone()
    dirty[~cmask] = NAN
    hp.assert_bitwise(ours(x, dirty, context_mask=cmask), out, "NaN at masked context positions changes nothing")
    # with context_mask, mask is the padding of x: its rows are exactly 0
    qmask = torch.tensor([[True] * 4, [True, False, True, False], [True] * 4])
    rows = ours(x, ctx, mask=qmask, context_mask=cmask)
    hp.assert_zero(rows[~qmask], "padded queries")
    hp.assert_bitwise(rows[qmask], out[qmask], "the real queries are unchanged")


def test_return_intermediates_and_cache_decode_like_x_transformers():
    theirs, ours = _pair(causal=True)
    x = torch.randn(2, 5, 16, dtype=F64)
    out, inter = ours(x, return_intermediates=True)
    out_t, inter_t = theirs(x, return_intermediates=True)
    hp.assert_close(out, out_t, "output", torch.float32)
    hp.assert_close(inter.post_softmax_attn.double(), inter_t.post_softmax_attn, "post_softmax_attn", torch.float32)
    for mine, other in zip(inter.cached_kv, inter_t.cached_kv):
        hp.assert_close(mine, other, "cached_kv", F64)
    # x-transformers' decoding: the intermediates are the cache, the call takes the new position only
    head, cache = ours(x[:, :3], return_intermediates=True)
    steps = [head]
    for t in range(3, 5):
        step, cache = ours(x[:, t : t + 1], cache=cache, return_intermediates=True)
        steps.append(step)
    hp.assert_close(torch.cat(steps, 1), out, "cached = uncached", F64)
    _, cache = ours(x[:, :4], return_intermediates=True)
    _, cache_t = theirs(x[:, :4], return_intermediates=True)
    hp.assert_close(ours(x[:, 4:], cache=cache), theirs(x[:, 4:], cache=cache_t), "one step, both caches", torch.float32)


def test_flash_true_gives_no_weights_as_x_transformers():
    _, ours = _pair(flash=True)
    out, inter = ours(torch.randn(1, 3, 16, dtype=F64), return_intermediates=True)
    assert inter.post_softmax_attn is None and inter.cached_kv[0].shape == (1, 2, 3, 8)


def test_cross_attention_cache_answers_for_the_context():
    _, ours = _pair(dim_context=12)
    x, ctx = torch.randn(2, 4, 16, dtype=F64), torch.randn(2, 5, 12, dtype=F64)
    cmask = torch.tensor([[True] * 5, [False] * 5])
    full = ours(x, ctx, context_mask=cmask)
    _, cache = ours(x[:, :1], ctx, context_mask=cmask, return_intermediates=True)
    assert cache.layer_type == "c"
    hp.assert_close(ours(x[:, 1:], cache=cache, context_mask=cmask), full[:, 1:], "from the cache", F64)
    with pytest.raises(ValueError, match="context"):
        ours(x, ctx, cache=cache)


@pytest.mark.parametrize("shape", ["ij", "hij", "bhij"])
def test_attn_mask_like_x_transformers(shape):
    """x-transformers' layouts: ``(i, j)``, ``(h, i, j)`` (a 3-d mask is per head) and ``(b, h, i, j)``."""
    theirs, ours = _pair()
    x = torch.randn(3, 6, 16, dtype=F64)
    g = torch.Generator().manual_seed(3)
    am = torch.rand(3, 2, 6, 6, generator=g) > 0.4
    am[..., 0] = True  # every query keeps a key (x-transformers gives NaN-free rows only then)
    am = {"ij": am[0, 0], "hij": am[0], "bhij": am}[shape]
    hp.assert_close(ours(x, attn_mask=am), theirs(x, attn_mask=am), f"attn_mask {shape}", torch.float32)
    # with a padding mask too: padded rows exactly 0, as x-transformers zeroes them
    out = ours(x, mask=PAD, attn_mask=am)
    hp.assert_zero(out[~PAD], "padded rows")
    dead = am.expand(3, 2, 6, 6).clone()
    dead[0, :, 2] = False  # a query with no key left in any head: exactly 0, never NaN
    out = ours(x, attn_mask=dead)
    hp.assert_zero(out[0, 2], "a dead row")


def test_rotary_pos_emb_like_x_transformers():
    theirs, ours = _pair(causal=True)
    rot_t, rot = xx.RotaryEmbedding(4), sf.RotaryEmbedding(4)
    x = torch.randn(2, 5, 16, dtype=F64)
    hp.assert_close(ours(x, rotary_pos_emb=rot.forward_from_seq_len(5)),
                    theirs(x, rotary_pos_emb=rot_t.forward_from_seq_len(5)), "rotary", torch.float32)
    with pytest.raises(ValueError, match="xpos"):
        ours(x, rotary_pos_emb=(rot.forward_from_seq_len(5)[0], torch.ones(1)))
    with pytest.raises(ValueError, match="rotary"):
        ours(x, rotary=(torch.zeros(1, 1, 5, 4),) * 2, rotary_pos_emb=rot.forward_from_seq_len(5))


def test_attention_refuses_mixed_spellings_and_foreign_caches():
    _, ours = _pair()
    x = torch.randn(1, 3, 16, dtype=F64)
    bias = torch.zeros(1, 2, 3, 3, dtype=F64)
    with pytest.raises(ValueError, match="attn_bias"):
        ours(x, bias=bias, attn_bias=bias)
    with pytest.raises(TypeError, match="cache"):
        ours(x, cache=object())
    with pytest.raises(ValueError, match="attn_mask"):
        ours(x, attn_mask=torch.ones(5, 3, 3, dtype=torch.bool))  # 3-d is per head: 5 is not h
    with pytest.raises(ValueError, match="context_mask"):
        ours(x, context_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="kv_heads"):
        sf.Attention(16, heads=4, one_kv_head=True, kv_heads=2)
    assert sf.Attention(16, heads=4, one_kv_head=True).kv_heads == 1
    assert sf.Attention(16, 8, None, 4, True).causal  # x-transformers' positional order


def test_attention_bias_matches_x_transformers():
    theirs, ours = _pair()
    x = torch.randn(2, 4, 16, dtype=F64)
    bias = torch.randn(2, 4, 4, dtype=F64)  # (h, i, j), x-transformers' alibi layout
    hp.assert_close(ours(x, attn_bias=bias), theirs(x, attn_bias=bias), "attn_bias", torch.float32)


def test_continuous_wrapper_without_max_seq_len_like_x_transformers():
    """No ``max_seq_len``: no absolute position embedding, as in x-transformers (positions from rotary)."""
    torch.manual_seed(0)
    from x_transformers.continuous import ContinuousTransformerWrapper as XTContinuous

    theirs = XTContinuous(dim_in=3, dim_out=2, attn_layers=xt.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8,
                                                                      rotary_pos_emb=True)).double().eval()
    assert not any(n.startswith("pos_emb") for n, _ in theirs.named_parameters())
    conv = sf.from_x_transformers(xt.TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=theirs.attn_layers,
                                                        use_abs_pos_emb=False))
    ours = sf.ContinuousTransformerWrapper(dim_in=3, dim_out=2, attn_layers=conv.attn_layers).double().eval()
    assert ours.pos_emb is None and ours.max_seq_len is None
    with torch.no_grad():  # x-transformers' projections, bias-free in both
        for mine, other in ((ours.project_in, theirs.project_in), (ours.project_out, theirs.project_out)):
            assert mine.bias is None and other.bias is None
            mine.weight.copy_(other.weight)
    x = torch.randn(2, 7, 3, dtype=F64)
    hp.assert_close(ours(x), theirs(x), "continuous without max_seq_len", torch.float32)
    assert sf.ContinuousTransformerWrapper(max_seq_len=0, attn_layers=sf.Encoder(dim=8, depth=1, heads=1, dim_head=8)).pos_emb is None
    with pytest.raises(ValueError, match="max_seq_len"):
        sf.ContinuousTransformerWrapper(max_seq_len=-1, attn_layers=sf.Encoder(dim=8, depth=1, heads=1, dim_head=8))


# ---------------------------------------------------------------------------------------------------
# the cache protocol: the LayerIntermediates of return_hiddens / return_intermediates as cache=
# ---------------------------------------------------------------------------------------------------

def _decoder_pair():
    """x-transformers' ``Decoder`` (rotary) and safeformer's on the same weights."""
    torch.manual_seed(0)
    theirs = xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, rotary_pos_emb=True).eval()
    conv = sf.from_x_transformers(xt.TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=theirs,
                                                        use_abs_pos_emb=False))
    return theirs.double(), conv.attn_layers.double().eval()


@pytest.mark.parametrize("whole", [False, True], ids=["new-positions", "whole-sequence"])
def test_stack_decodes_from_its_intermediates_like_x_transformers(whole):
    theirs, ours = _decoder_pair()
    seq = torch.randn(2, 9, 16, dtype=F64)
    parallel = ours(seq)
    out, cache = ours(seq[:, :5], return_hiddens=True)
    _, cache_t = theirs(seq[:, :5], return_hiddens=True)
    steps = [out[:, -1:]]
    for t in range(5, 9):
        inp = seq[:, : t + 1] if whole else seq[:, t : t + 1]
        out, cache = ours(inp, cache=cache, return_hiddens=True)
        out_t, cache_t = theirs(inp, cache=cache_t, return_hiddens=True)
        assert out.shape == (2, 1, 16)  # only the new position is computed and returned
        hp.assert_close(out, out_t, f"step {t} against x-transformers", torch.float32)
        steps.append(out)
    hp.assert_close(torch.cat(steps, 1), parallel[:, 4:], "cached = parallel", F64)
    assert isinstance(cache.cache, sf.KVCache) and cache.cache.length == 9  # the canonical form inside


def test_wrapper_decodes_from_its_intermediates_with_padding():
    """``TransformerWrapper``: the whole sequence so far with the intermediates as the cache (x-transformers'
    test_kv_cache flow), with a left-padded prompt: masked cache slots are still selected away."""
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=32, max_seq_len=16, num_memory_tokens=2,
                                  attn_layers=sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, cross_attend=True,
                                                         dim_context=12)).double().eval()
    x = torch.randint(0, 32, (2, 8))
    mask = torch.tensor([[False, False, True, True, True, True, True, True], [True] * 8])
    ctx = torch.randn(2, 5, 12, dtype=F64)
    full = model(x, mask=mask, context=ctx)
    logits, inter = model(x[:, :6], mask=mask[:, :6], context=ctx, return_intermediates=True)
    k, v = inter.cache.self_kv[0]
    k[0, :, 2], v[0, :, 2] = NAN, NAN  # the first two are memory rows; slots 2, 3 are the left padding
    for t in range(6, 8):
        logits, inter = model(x[:, : t + 1], mask=mask[:, : t + 1], context=ctx, cache=inter, return_intermediates=True)
        assert logits.shape == (2, 1, 32)
        hp.assert_close(logits[:, 0], full[:, t], f"step {t}", F64)
    with pytest.raises(ValueError, match="whole sequence"):
        model(x[:, :3], cache=inter)


def test_continuous_wrapper_decodes_from_its_intermediates():
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(dim_in=3, dim_out=3, attn_layers=sf.Decoder(
        dim=16, depth=1, heads=2, dim_head=8, rotary_pos_emb=True)).double().eval()
    xs = torch.randn(2, 7, 3, dtype=F64)
    full = net(xs)
    out, inter = net(xs[:, :4], return_intermediates=True)
    out, inter = net(xs[:, :6], cache=inter, cache_age=2, return_intermediates=True)  # two new positions
    hp.assert_close(out, full[:, 4:6], "two new positions", F64)
    out, inter = net(xs[:, 6:], cache=inter, return_intermediates=True)  # the new position only
    hp.assert_close(out, full[:, 6:], "the new position only", F64)


def test_cache_protocol_refuses_what_it_cannot_read():
    dec = sf.Decoder(dim=8, depth=1, heads=1, dim_head=8)
    x = torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match="KVCache"):
        dec(x, cache=sf.LayerIntermediates())
    _, kv = dec(x, return_cache=True)
    with pytest.raises(ValueError, match="cache_age"):
        dec(x[:, :1], cache=kv, cache_age=2)
    _, inter = dec(x, return_hiddens=True)
    with pytest.raises(ValueError, match="cache_age"):
        dec(x[:, :1], cache=inter, cache_age=0)


def test_float_token_ids_are_read_when_whole_numbers():
    """x-transformers reads float ids with ``.long()``: safeformer reads whole numbers alike and refuses the
    others (x-transformers would truncate them silently)."""
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=10, max_seq_len=8, attn_layers=sf.Decoder(dim=8, depth=1, heads=1, dim_head=8))
    ids = torch.randint(0, 10, (2, 5))
    hp.assert_bitwise(model(ids.float()), model(ids), "whole-number float ids")
    with pytest.raises(TypeError, match="whole number"):
        model(ids.float() + 0.5)


def test_stack_takes_x_transformers_per_head_attn_mask():
    """``AttentionLayers(attn_mask=(b|1, h|1, n, n))`` as x-transformers passes it (a 3-d mask stays per sample
    in safeformer; 4-d means per head in both)."""
    torch.manual_seed(0)
    theirs = xt.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8).eval()
    conv = sf.from_x_transformers(xt.TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=theirs,
                                                        use_abs_pos_emb=False))
    theirs, ours = theirs.double(), conv.attn_layers.double().eval()
    x = torch.randn(3, 6, 16, dtype=F64)
    g = torch.Generator().manual_seed(5)
    am = torch.rand(3, 2, 6, 6, generator=g) > 0.4
    am[..., 0] = True
    hp.assert_close(ours(x, attn_mask=am), theirs(x, attn_mask=am), "per-head attn_mask", torch.float32)
    hp.assert_close(ours(x, attn_mask=am[:1]), theirs(x, attn_mask=am[:1]), "(1, h, n, n)", torch.float32)
    dead = am.clone()
    dead[1, :, 4] = False  # a query with no key in any head: finite, and no NaN reaches the other positions
    out = ours(x, attn_mask=dead)
    assert bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="attn_mask"):
        ours(x, attn_mask=torch.ones(3, 5, 6, 6, dtype=torch.bool))
