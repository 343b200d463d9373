"""x-transformers' module options (hybrid attention, ALiBi slopes, xpos, PoPE, Derf, adaptive-norm MLP, custom
feed-forward activations): the math against x-transformers on copied weights (or a float64 reference), and the
padding rules (a padded sample equals the sample alone; NaN planted at padded positions reaches nothing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import safeformer as sf
from safeformer.nn.attention import Attention

xt = pytest.importorskip("x_transformers")
from x_transformers.x_transformers import Attention as XAttention  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _finite_grads(model) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# ------------------------------------------------------------------------------------------------------
# hybrid attention (attn_hybrid_module)
# ------------------------------------------------------------------------------------------------------


def _copy_hybrid_attention(xa: nn.Module, sa: Attention) -> None:
    state = {}
    for k, v in xa.state_dict().items():
        if k.startswith("hybrid_norms."):
            state["hybrid." + k.replace(".gamma", ".weight")] = v.reshape(v.shape[0], v.shape[-1])
        elif k.startswith(("hybrid_module.", "hybrid_mix.")):
            state["hybrid." + k] = v
        else:
            state[k] = v
    sa.load_state_dict(state)


@pytest.mark.parametrize("causal,fold,bidirectional,learned_mix", [(True, 1, False, False), (False, 2, True, True)])
def test_hybrid_attention_matches_x_transformers(causal, fold, bidirectional, learned_mix):
    dim, heads, dh = 16, 2, 8
    gru = nn.GRU(dim, heads * dh // (2 if bidirectional else 1), batch_first=True, bidirectional=bidirectional)
    xa = XAttention(dim=dim, heads=heads, dim_head=dh, causal=causal, hybrid_module=gru, hybrid_fold_axial_dim=fold,
                    hybrid_learned_mix=learned_mix)
    sa = Attention(dim, heads=heads, dim_head=dh, causal=causal, hybrid_module=gru, hybrid_fold_axial_dim=fold,
                   hybrid_learned_mix=learned_mix)
    _copy_hybrid_attention(xa, sa)
    x = torch.randn(2, 6, dim)
    torch.testing.assert_close(sa(x), xa(x), atol=1e-5, rtol=1e-5)


def _decoder(module, **kw):
    return sf.TransformerWrapper(num_tokens=50, max_seq_len=32, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=2, attn_dim_head=8, rotary_pos_emb=True, attn_hybrid_module=module, **kw)).eval()


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_hybrid_decoder_padding_and_cache(rnn):
    module = nn.GRU(16, 16, batch_first=True) if rnn == "gru" else nn.LSTM(16, 16, batch_first=True)
    model = _decoder(module)
    x = torch.randint(0, 50, (2, 5))
    alone = model(x)
    # sample 0 left-padded by 2, sample 1 right-padded by 2: each equals the sample alone
    xp = torch.zeros(2, 7, dtype=torch.long)
    xp[0, 2:], xp[1, :5] = x[0], x[1]
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 2:], mask[1, :5] = True, True
    out = model(xp, mask=mask)
    torch.testing.assert_close(out[0, 2:], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :5], alone[1], atol=1e-5, rtol=1e-5)
    assert bool((out[~mask] == 0).all())
    # cached decoding from the left-padded prompt: the state continues after each sample's last real token
    first, cache = model(xp[:1, :4], mask=mask[:1, :4], return_cache=True)
    steps = [first]
    for t in range(4, 7):
        o, cache = model(xp[:1, t:t + 1], cache=cache, return_cache=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1)[0, 2:], alone[0], atol=1e-5, rtol=1e-5)
    # a new position that is padding does not move the state
    o1, c1 = model(x[:1, :3], return_cache=True)
    _, c2 = model(x[:1, 3:4], mask=torch.zeros(1, 1, dtype=torch.bool), cache=c1, return_cache=True)
    o3 = model(x[:1, 3:4], cache=c2)
    o3_ref = model(x[:1, 3:4], cache=c1)
    assert o1.shape == (1, 3, 50)
    torch.testing.assert_close(o3, o3_ref, atol=1e-5, rtol=1e-5)


def test_hybrid_encoder_bidirectional_fold_padding_nan():
    enc = sf.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8, attn_hybrid_fold_axial_dim=3,
                     attn_hybrid_module=nn.GRU(16, 8, batch_first=True, bidirectional=True))
    x = torch.randn(2, 7, 16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, 4:] = False  # right padding
    xn = x.clone().requires_grad_(True)
    planted = torch.where(mask[..., None], xn, float("nan"))
    out = enc(planted, mask=mask)
    assert bool(torch.isfinite(out).all())
    out.square().sum().backward()
    assert bool(torch.isfinite(xn.grad).all()) and bool((xn.grad[~mask] == 0).all())
    assert _finite_grads(enc)
    torch.testing.assert_close(out[0, 3:], enc(x[:1, 3:])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :4], enc(x[1:, :4])[0], atol=1e-5, rtol=1e-5)
    # a sample of padding only: exact zeros, no NaN
    out = enc(x, mask=torch.tensor([[False] * 7, [True] * 7]))
    assert bool((out[0] == 0).all()) and bool(torch.isfinite(out).all())


class _CausalConv(nn.Module):
    """A generic (non-RNN) causal module: a depthwise causal convolution, ``(b, n, c) -> (b, n, c)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, groups=dim)

    def forward(self, x, mask=None):
        if mask is not None:
            x = torch.where(mask[..., None], x, 0.0)
        h = nn.functional.pad(x.transpose(1, 2), (2, 0))
        return self.conv(h).transpose(1, 2)


def test_hybrid_generic_module_rules():
    dec = sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_module=_CausalConv(16))
    x = torch.randn(1, 5, 16)
    xp = torch.cat((torch.randn(1, 2, 16), x), 1)
    mask = torch.tensor([[False, False] + [True] * 5])
    torch.testing.assert_close(dec(xp, mask=mask)[:, 2:], dec(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="only a torch.nn GRU"):  # no known state layout: no cache
        _, cache = dec(x[:, :2], return_cache=True)
        dec(x[:, 2:3], cache=cache)
    # a non-causal generic module with padding needs the mask keyword
    enc = sf.Encoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_module=_CausalConv(16))
    with pytest.raises(ValueError, match="attn_hybrid_mask_kwarg"):
        enc(xp, mask=mask)
    enc = sf.Encoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_module=_CausalConv(16),
                     attn_hybrid_mask_kwarg="mask")
    torch.testing.assert_close(enc(xp, mask=mask)[:, 2:], enc(x), atol=1e-5, rtol=1e-5)


def test_hybrid_refusals():
    gru = nn.GRU(16, 16, batch_first=True)
    with pytest.raises(ValueError, match="batch_first"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_module=nn.GRU(16, 16))
    with pytest.raises(ValueError, match="bidirectional"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8,
                   attn_hybrid_module=nn.GRU(16, 8, batch_first=True, bidirectional=True))
    with pytest.raises(ValueError, match="cross"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, cross_attend=True, attn_hybrid_module=gru)
    with pytest.raises(ValueError, match="need attn_hybrid_module"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_fold_axial_dim=2)
    with pytest.raises(ValueError, match="unpadded=True"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_module=gru, unpadded=True)
    with pytest.raises(ValueError, match="must return"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_module=nn.GRU(16, 4, batch_first=True))(
            torch.randn(1, 3, 16))
    folded = _decoder(gru, attn_hybrid_fold_axial_dim=2)
    assert not folded.can_cache_kv and _decoder(gru).can_cache_kv
    from safeformer.decoding.static import static_reason

    # a cacheable RNN decodes on the static step (its state in the static cache); a folded one does not cache
    assert static_reason(_decoder(gru)) is None and "attn_hybrid_fold_axial_dim" in static_reason(folded)
    _, cache = folded(torch.randint(0, 50, (1, 3)), return_cache=True)
    with pytest.raises(ValueError, match="fold"):
        folded(torch.randint(0, 50, (1, 1)), cache=cache)


def test_hybrid_generation_cached_equals_uncached_left_padded():
    model = _decoder(nn.GRU(16, 16, batch_first=True))
    gen = sf.AutoregressiveWrapper(model)
    prompts = torch.randint(0, 50, (2, 4))
    mask = torch.tensor([[False, True, True, True], [True, True, True, True]])
    a = gen.generate(prompts, 4, mask=mask, temperature=0.0, cache_kv=True)
    b = gen.generate(prompts, 4, mask=mask, temperature=0.0, cache_kv=False)
    assert torch.equal(a, b)


def test_hybrid_dead_row_is_zero():
    sa = Attention(16, heads=2, dim_head=8, hybrid_module=nn.GRU(16, 16, batch_first=True), bias=True)
    x = torch.randn(1, 4, 16)
    attn_mask = torch.ones(4, 4, dtype=torch.bool)
    attn_mask[1] = False  # query 1 may attend to nothing
    out = sa(x, attn_mask=attn_mask)
    assert bool((out[0, 1] == 0).all()) and bool(torch.isfinite(out).all())


# ------------------------------------------------------------------------------------------------------
# ALiBi: custom slopes (rel_pos_kwargs), alibi_num_heads, positions per head
# ------------------------------------------------------------------------------------------------------


def _xt_alibi_pair(heads=2):
    import x_transformers as X

    xm = X.TransformerWrapper(num_tokens=50, max_seq_len=32, use_abs_pos_emb=False, attn_layers=X.Decoder(
        dim=16, depth=2, heads=heads, attn_dim_head=8, alibi_pos_bias=True)).eval()
    sm = sf.from_x_transformers(xm).eval()
    return xm.attn_layers, sm.attn_layers


@pytest.mark.parametrize("per_head", [False, True])
def test_custom_alibi_matches_x_transformers(per_head):
    xl, sl = _xt_alibi_pair()
    slopes = torch.tensor([0.7, 0.0])  # the second head unbiased: alibi_num_heads=1 in both
    xl.rel_pos.slopes = slopes.reshape(2, 1, 1)
    sl.alibi_slopes = slopes.clone()
    x = torch.randn(2, 4, 16)
    pos = torch.tensor([[[0, 1, 2, 4], [1, 3, 5, 7]], [[2, 3, 4, 5], [6, 8, 9, 10]]]) if per_head else \
        torch.tensor([[0, 1, 2, 4], [3, 5, 6, 9]])
    torch.testing.assert_close(sl(x, pos=pos), xl(x, pos=pos), atol=1e-5, rtol=1e-5)


def test_custom_alibi_options_and_padding():
    dec = sf.Decoder(dim=16, depth=1, heads=4, attn_dim_head=8, alibi_pos_bias=True, alibi_num_heads=2,
                     rel_pos_kwargs=dict(slopes=[0.5, 0.25]))
    assert dec.alibi_slopes.tolist() == [0.5, 0.25, 0.0, 0.0]
    x = torch.randn(1, 5, 16)
    pos = torch.randint(0, 9, (1, 4, 5))
    xp = torch.cat((torch.full((1, 2, 16), float("nan")), x), 1)
    pp = torch.cat((torch.full((1, 4, 2), 99), pos), 2)
    mask = torch.tensor([[False, False] + [True] * 5])
    out = dec(xp, mask=mask, pos=pp)
    torch.testing.assert_close(out[:, 2:], dec(x, pos=pos), atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(out).all())
    for bad in (dict(rel_pos_kwargs=dict(slopes=[-1.0, 1.0])), dict(rel_pos_kwargs=dict(slopes=[1.0])),
                dict(rel_pos_kwargs=dict(num_buckets=3)), dict(alibi_num_heads=5)):
        with pytest.raises(ValueError):
            sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, alibi_pos_bias=True, **bad)
    with pytest.raises(ValueError, match="alibi_pos_bias"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, rel_pos_kwargs=dict(slopes=[1.0, 1.0]))
    with pytest.raises(ValueError, match="KV cache"):
        dec(x, pos=pos, return_cache=True)
    rot = sf.Decoder(dim=16, depth=1, heads=4, attn_dim_head=8, rotary_pos_emb=True)
    with pytest.raises(ValueError, match="ALiBi"):
        rot(x, pos=pos)


# ------------------------------------------------------------------------------------------------------
# rotary xpos
# ------------------------------------------------------------------------------------------------------


def _xt_xpos_pair(scale_base=4.0):
    import x_transformers as X
    from x_transformers.x_transformers import RotaryEmbedding as XRotary

    xm = X.TransformerWrapper(num_tokens=50, max_seq_len=32, use_abs_pos_emb=False, attn_layers=X.Decoder(
        dim=16, depth=2, heads=2, attn_dim_head=8, rotary_pos_emb=True, rotary_emb_dim=8)).eval()
    cfg = sf.from_x_transformers(xm).get_config()
    state = sf.from_x_transformers(xm).state_dict()
    cfg["attn_layers"]["config"].update(rotary_xpos=True, rotary_xpos_scale_base=scale_base)
    sm = sf.TransformerWrapper.from_config(cfg).eval()
    sm.load_state_dict(state)
    xm.attn_layers.rotary_pos_emb = XRotary(8, use_xpos=True, scale_base=scale_base)
    return xm, sm


def test_rotary_xpos_matches_x_transformers():
    xm, sm = _xt_xpos_pair()
    x = torch.randint(0, 50, (2, 9))
    torch.testing.assert_close(sm(x), xm(x), atol=1e-5, rtol=1e-5)
    pos = torch.tensor([[0, 1, 2, 4, 5, 6, 7, 9, 12], [1, 3, 5, 7, 8, 9, 10, 11, 12]])
    e = torch.randn(2, 9, 16)
    torch.testing.assert_close(sm.attn_layers(e, pos=pos), xm.attn_layers(e, pos=pos), atol=1e-5, rtol=1e-5)
    # the module's own call: freqs and scale as x-transformers'
    from x_transformers.x_transformers import RotaryEmbedding as XRotary

    t = torch.arange(7)
    (f1, s1), (f2, s2) = sf.RotaryEmbedding(8, use_xpos=True, scale_base=4)(t), XRotary(8, use_xpos=True, scale_base=4)(t)
    torch.testing.assert_close(f1, f2)
    torch.testing.assert_close(s1, s2)


def test_rotary_xpos_padding_nan_and_refusals():
    _, sm = _xt_xpos_pair()
    x = torch.randint(0, 50, (1, 6))
    xp = torch.cat((torch.zeros(1, 2, dtype=torch.long), x, torch.zeros(1, 1, dtype=torch.long)), 1)
    mask = torch.tensor([[False, False] + [True] * 6 + [False]])
    torch.testing.assert_close(sm(xp, mask=mask)[:, 2:8], sm(x), atol=1e-5, rtol=1e-5)
    e = torch.randn(1, 9, 16)
    e[~mask] = float("nan")
    e.requires_grad_(True)
    out = sm.attn_layers(e, mask=mask)
    out.sum().backward()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(e.grad).all()) and _finite_grads(sm)
    assert not sm.can_cache_kv
    from safeformer.decoding.static import static_reason

    assert "xpos" in static_reason(sm)
    with pytest.raises(ValueError, match="KV cache"):
        sm(x, return_cache=True)
    _, inter = sm(x, return_intermediates=True)
    assert inter.cache is None
    with pytest.raises(ValueError, match="causal"):
        sf.Encoder(dim=16, depth=1, heads=2, rotary_xpos=True)
    with pytest.raises(ValueError, match="float16"):  # scales beyond float16's range
        sm.half().attn_layers(torch.randn(1, 200, 16).half())


# ------------------------------------------------------------------------------------------------------
# PoPE (polar_pos_emb)
# ------------------------------------------------------------------------------------------------------


def _xt_polar_pair():
    import x_transformers as X
    from x_transformers.x_transformers import PolarEmbedding as XPolar

    xm = X.TransformerWrapper(num_tokens=50, max_seq_len=32, use_abs_pos_emb=False, attn_layers=X.Decoder(
        dim=16, depth=2, heads=2, attn_dim_head=8)).eval()
    conv = sf.from_x_transformers(xm)
    cfg = conv.get_config()
    cfg["attn_layers"]["config"].update(polar_pos_emb=True, polar_bias_uniform_init=True)
    sm = sf.TransformerWrapper.from_config(cfg).eval()
    missing, unexpected = sm.load_state_dict(conv.state_dict(), strict=False)
    assert missing == ["attn_layers.polar_pos_emb.learned_bias"] and not unexpected
    xm.attn_layers.polar_pos_emb = XPolar(8, 2)
    xm.attn_layers.polar_pos_emb.learned_bias.data.copy_(sm.attn_layers.polar_pos_emb.learned_bias.data)
    return xm, sm


def test_polar_matches_x_transformers_and_caches():
    xm, sm = _xt_polar_pair()
    assert float(sm.attn_layers.polar_pos_emb.learned_bias.detach().min()) < 0  # uniform init in [-2 pi, 0]
    x = torch.randint(0, 50, (2, 7))
    full = sm(x)
    torch.testing.assert_close(full, xm(x), atol=1e-5, rtol=1e-5)
    out, cache = sm(x[:, :4], return_cache=True)
    steps = [out]
    for t in range(4, 7):
        o, cache = sm(x[:, t:t + 1], cache=cache, return_cache=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    # the module's own call and apply_polar_pos_emb as x-transformers'
    from x_transformers.x_transformers import PolarEmbedding as XPolar
    from x_transformers.x_transformers import apply_polar_pos_emb as x_apply

    from safeformer.nn.modules import PolarEmbedding, apply_polar_pos_emb

    t, q = torch.arange(5), torch.randn(1, 2, 5, 8)
    (f1, b1), (f2, b2) = PolarEmbedding(8, 2)(t), XPolar(8, 2)(t)
    torch.testing.assert_close(f1, f2)
    torch.testing.assert_close(apply_polar_pos_emb(q, f1 + b1), x_apply(q, f2 + b2))


def test_polar_padding_nan_and_refusals():
    _, sm = _xt_polar_pair()
    x = torch.randint(0, 50, (1, 5))
    xp = torch.cat((torch.zeros(1, 2, dtype=torch.long), x), 1)
    mask = torch.tensor([[False, False] + [True] * 5])
    torch.testing.assert_close(sm(xp, mask=mask)[:, 2:], sm(x), atol=1e-5, rtol=1e-5)
    e = torch.randn(1, 7, 16)
    e[~mask] = float("nan")
    e.requires_grad_(True)
    out = sm.attn_layers(e, mask=mask)
    out.sum().backward()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(e.grad).all()) and _finite_grads(sm)
    from safeformer.decoding.static import static_reason

    assert static_reason(sm) is None and sm.can_cache_kv  # the decode step runs PoPE (the attention's own rotation)
    for bad in (dict(rotary_pos_emb=True), dict(kv_heads=1), dict(attn_num_mem_kv=2)):
        with pytest.raises(ValueError, match="polar_pos_emb"):
            sf.Decoder(dim=16, depth=1, heads=2, polar_pos_emb=True, **bad)
    with pytest.raises(ValueError, match="unpadded=True"):
        sf.Decoder(dim=16, depth=1, heads=2, polar_pos_emb=True, unpadded=True)


# ------------------------------------------------------------------------------------------------------
# Derf, adaptive_condition_mlp, ff_custom_activation, situ-GLU softclamp
# ------------------------------------------------------------------------------------------------------


def _left_padded_equals_alone(model, dim=16, **kw):
    x = torch.randn(1, 5, dim)
    xp = torch.cat((torch.full((1, 2, dim), float("nan")), x), 1).requires_grad_(True)
    mask = torch.tensor([[False, False] + [True] * 5])
    out = model(xp, mask=mask, **kw)
    torch.testing.assert_close(out[:, 2:], model(x, **kw), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(xp.grad).all()) and _finite_grads(model)


def test_derf_formula_x_transformers_and_padding():
    from x_transformers.x_transformers import Derf as XDerf

    norm = sf.nn.modules.Derf(8)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(3, 8, dtype=torch.float64)
    n64 = norm.double()
    torch.testing.assert_close(n64(x), torch.erf(n64.alpha * x + n64.s) * n64.gamma + n64.beta)
    peer = XDerf(8).double()
    peer.load_state_dict(n64.state_dict())
    torch.testing.assert_close(n64(x), peer(x))
    dec = sf.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, use_derf=True)
    assert sum(isinstance(m, sf.nn.modules.Derf) for m in dec.modules()) == 5  # 4 pre-norms and the final norm
    _left_padded_equals_alone(dec)
    with pytest.raises(ValueError, match="use_derf"):
        sf.Decoder(dim=16, depth=1, heads=2, use_derf=True, use_rmsnorm=True)


def test_adaptive_condition_mlp_is_an_mlp_before_the_adaptive_layers():
    kw = dict(dim=16, depth=2, heads=2, attn_dim_head=8, use_adaptive_rmsnorm=True, use_adaptive_layerscale=True)
    with_mlp = sf.Decoder(**kw, dim_condition=6, adaptive_condition_mlp=True, adaptive_condition_mlp_expansion=2)
    plain = sf.Decoder(**kw, dim_condition=12)
    state = {k: v for k, v in with_mlp.state_dict().items() if not k.startswith(("adaptive_mlp", "null_condition"))}
    with torch.no_grad():  # the adaptive projections start at zero: perturb them so the condition matters
        for k in state:
            if "to_gamma" in k or "to_gate" in k:
                state[k] = torch.randn_like(state[k]) * 0.3
    with_mlp.load_state_dict(state, strict=False)
    plain.load_state_dict(state, strict=False)
    x, c = torch.randn(2, 5, 16), torch.randn(2, 6)
    c_mlp = torch.nn.functional.silu(c @ with_mlp.adaptive_mlp[0].weight.T)
    full = with_mlp(x, condition=c)
    torch.testing.assert_close(full, plain(x, condition=c_mlp), atol=1e-5, rtol=1e-5)
    # the cache keeps the transformed condition: cached decoding equals the full pass
    out, cache = with_mlp(x[:, :3], condition=c, return_cache=True)
    steps = [out]
    for t in range(3, 5):
        o, cache = with_mlp(x[:, t:t + 1], cache=cache, return_cache=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    _left_padded_equals_alone(with_mlp, condition=c[:1])
    with pytest.raises(ValueError, match="adaptive"):
        sf.Decoder(dim=16, depth=1, heads=2, adaptive_condition_mlp=True)


def _xt_ff_state(ff) -> dict:
    return ff.state_dict()  # x-transformers' keys (ff.0.0 / ff.0.proj, ff.2)


@pytest.mark.parametrize("opts", [dict(custom_activation=nn.Sigmoid()),
                                  dict(glu=True, custom_activation=nn.Tanh()),
                                  dict(glu=True, glu_softclamp=True, glu_gate_softclamp_value=0.5),
                                  dict(glu=True, swish=True, glu_softclamp=True, glu_up_softclamp_value=0.7)])
def test_ff_options_match_x_transformers(opts):
    from x_transformers.x_transformers import FeedForward as XFF

    ff = sf.FeedForward(8, mult=2, **opts).double()
    peer = XFF(8, mult=2, **opts).double()
    peer.load_state_dict(_xt_ff_state(ff))
    x = torch.randn(3, 8, dtype=torch.float64) * 4
    torch.testing.assert_close(ff(x), peer(x))


def test_ff_stack_options_padding_and_warnings():
    dec = sf.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, ff_custom_activation=nn.Sigmoid())
    acts = [blk.mixer.act for blk in dec.layers if blk.kind == "ff"]
    assert all(isinstance(a, nn.Sigmoid) for a in acts) and acts[0] is not acts[1]  # a copy per layer
    _left_padded_equals_alone(dec)
    dec = sf.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, ff_glu=True, ff_glu_softclamp=True,
                     ff_glu_gate_softclamp_value=2.0)
    _left_padded_equals_alone(dec)
    with pytest.warns(UserWarning, match="no effect"):
        sf.Decoder(dim=16, depth=1, heads=2, ff_glu=True, ff_softclamp_value=10.0)
    with pytest.warns(UserWarning, match="no effect"):
        sf.Decoder(dim=16, depth=1, heads=2, ff_glu=True, ff_glu_gate_softclamp_value=10.0)
    for bad in (dict(ff_glu_softclamp=True), dict(ff_glu=True, ff_glu_softclamp=True, ff_custom_activation=nn.Tanh()),
                dict(ff_swish=True, ff_custom_activation=nn.Tanh()), dict(ff_glu_gate_softclamp_value=-1.0)):
        with pytest.raises(ValueError):
            sf.Decoder(dim=16, depth=1, heads=2, **bad)
