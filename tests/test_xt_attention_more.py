"""x-transformers' attention scoring options in safeformer: l2 distance, cog (signed weights), sigmoid, gumbel
softmax, laser, inverted cross-attention, CoPE, the relative projection bias, multi-latent attention, ``dim_out``,
MuonClip's qk-clip and Muon's parameter groups.

Each option is checked against x-transformers' own ``Attention`` on the same weights (float32), and for the
contract: a padded sample equals the sample alone, NaN planted at padded positions reaches no output and no
gradient, dead rows are exact zeros, and the calls an option cannot serve are refused by name. The S1-S9 suite
runs the cases of ``helpers/cases_attention.py`` too.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")

NAN = float("nan")
DIM, HEADS, DH = 16, 4, 8


def _copy_attention(src: torch.nn.Module, dst: sf.Attention) -> sf.Attention:
    """x-transformers' ``Attention`` weights into safeformer's: the state dict, strictly (the same keys)."""
    dst.load_state_dict(src.state_dict(), strict=True)
    return dst


def _pair(seed: int = 0, **opts) -> tuple[torch.nn.Module, sf.Attention]:
    torch.manual_seed(seed)
    theirs = xt.Attention(DIM, dim_head=DH, heads=HEADS, **opts)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "sink" in name or "pos_emb" in name:
                p.normal_()
    mine = sf.Attention(DIM, dim_head=DH, heads=HEADS, **opts)
    return theirs.eval(), _copy_attention(theirs, mine).eval()


PAD = torch.tensor([[True, True, True, True, False, False], [True] * 6])  # (b, n): sample 0 ends in padding


@pytest.mark.parametrize("opts", [
    dict(l2_distance=True), dict(cog_signed=True), dict(cog_signed=True, head_learned_sink=True), dict(sigmoid=True),
    dict(laser=True, laser_softclamp_value=3.0), dict(l2_distance=True, laser=True, one_kv_head=True),
    dict(laser=True, head_learned_sink=True, num_mem_kv=2), dict(l2_distance=True, head_learned_sink=True, num_mem_kv=1),
    dict(use_cope=True, causal=True, cope_max_pos=4), dict(use_cope=True, causal=True, head_learned_sink=True),
    dict(use_rel_proj_pos_bias=True, rel_proj_max_dist=4), dict(use_rel_proj_pos_bias=True, causal=True),
    dict(use_latent_q=True, dim_latent_q=12, use_latent_kv=True, dim_latent_kv=10, latent_rope_subheads=2),
    dict(dim_out=24, l2_distance=True, causal=True),
], ids=["l2", "cog", "cog+sink", "sigmoid", "laser", "l2+laser+mqa", "laser+sink+memkv", "l2+sink+memkv", "cope", "cope+sink", "relproj", "relproj-causal",
        "mla", "dim_out"])
def test_self_attention_matches_x_transformers(opts):
    """Same weights, same input: the same output at real positions, with a key padding mask; NaN planted at the
    padded positions reaches no output and no gradient (x-transformers' output there is not compared)."""
    theirs, mine = _pair(**opts)
    x = torch.randn(2, 6, DIM)
    want = theirs(x, mask=PAD)
    got = mine(x, mask=PAD)
    torch.testing.assert_close(got[PAD], want[PAD], atol=1e-5, rtol=1e-5)
    assert bool((got[~PAD] == 0).all())
    planted = x.clone()
    planted[~PAD] = NAN
    planted.requires_grad_()
    out = mine(planted, mask=PAD)
    torch.testing.assert_close(out, got, atol=0, rtol=0)
    out.square().sum().backward()
    assert bool(torch.isfinite(planted.grad).all()) and bool((planted.grad[~PAD] == 0).all())
    assert bool((planted.grad[PAD] != 0).any())
    assert all(bool(torch.isfinite(p.grad).all()) for p in mine.parameters() if p.grad is not None)


@pytest.mark.parametrize("opts", [dict(), dict(sigmoid=True), dict(cog_signed=True, l2_distance=True)],
                         ids=["softmax", "sigmoid", "cog+l2"])
def test_inverted_cross_attention_matches_x_transformers(opts):
    """Inverted cross-attention (softmax over the queries, then L1 over the keys) equals x-transformers' with a
    query mask and a context mask, at real queries; a fully masked context gives exact zeros."""
    theirs, mine = _pair(inverted_attention=True, dim_context=12, **opts)
    x, ctx = torch.randn(2, 6, DIM), torch.randn(2, 5, 12)
    cmask = torch.tensor([[True, True, False, True, False], [False] * 5])
    want = theirs(x, context=ctx, mask=PAD, context_mask=cmask)
    got = mine(x, context=ctx, mask=PAD, context_mask=cmask)
    torch.testing.assert_close(got[PAD], want[PAD], atol=1e-5, rtol=1e-5)
    assert bool((got[1] == 0).all()) and bool((got[~PAD] == 0).all())
    # planted NaN at padded queries and masked context rows: nothing moves, gradients finite
    xp, cp = x.clone(), ctx.clone()
    xp[~PAD], cp[~cmask] = NAN, NAN
    xp.requires_grad_(), cp.requires_grad_()
    out = mine(xp, context=cp, mask=PAD, context_mask=cmask)
    torch.testing.assert_close(out, got, atol=0, rtol=0)
    out.square().sum().backward()
    assert bool(torch.isfinite(xp.grad).all()) and bool(torch.isfinite(cp.grad).all())
    assert bool((cp.grad[~cmask] == 0).all()) and bool((xp.grad[~PAD] == 0).all())


def test_inverted_padded_queries_equal_the_sample_alone():
    """Each key's softmax runs over the real queries only: sample 0 padded to 6 equals it alone (4 queries)."""
    _, mine = _pair(inverted_attention=True, dim_context=12)
    x, ctx = torch.randn(2, 6, DIM), torch.randn(2, 5, 12)
    cmask = torch.tensor([[True, True, False, True, True], [True] * 5])
    both = mine(x, context=ctx, mask=PAD, context_mask=cmask)
    alone = mine(x[:1, :4], context=ctx[:1, cmask[0]])
    torch.testing.assert_close(both[0, :4], alone[0], atol=1e-6, rtol=1e-6)


def test_cross_attender_inverted_per_layer_and_refusals():
    """``cross_attn_inverted_attention`` takes one bool per cross-attention block; the stack's padded queries take
    no weight (padded == alone); a causal stack, a wrong-length tuple, self-attention and a KV cache are refused."""
    torch.manual_seed(0)
    ca = sf.CrossAttender(dim=DIM, depth=3, heads=2, dim_head=DH, dim_context=12,
                          cross_attn_inverted_attention=(True, False, True))
    assert [blk.mixer.inverted for blk in ca.layers if blk.kind == "cross"] == [True, False, True]
    x, ctx = torch.randn(2, 6, DIM), torch.randn(2, 5, 12)
    cmask = torch.tensor([[True, False, True, True, True], [True] * 5])
    xp = x.clone()
    xp[~PAD] = NAN
    both = ca(xp, mask=PAD, context=ctx, context_mask=cmask)
    alone = ca(x[:1, :4], context=ctx[:1, cmask[0]])
    torch.testing.assert_close(both[0, :4], alone[0], atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(both).all())
    with pytest.raises(ValueError, match="causal"):
        sf.Decoder(dim=DIM, depth=1, cross_attend=True, cross_attn_inverted_attention=True)
    with pytest.raises(ValueError, match="one per"):
        sf.CrossAttender(dim=DIM, depth=2, cross_attn_inverted_attention=(True,))
    with pytest.raises(ValueError, match="future would leak"):
        sf.Attention(DIM, inverted_attention=True, causal=True)(x)
    _, cache = ca(x, context=ctx, return_cache=True)
    with pytest.raises(ValueError, match="KV cache"):
        ca(x[:, :1], cache=cache)


def test_cog_weights_are_signed_and_rows_dead_exactly_zero():
    """Cog attention's weights carry the logits' signs; padded rows and masked keys are exact zeros in the
    weights and the logits (masked keys -inf there, as the intermediates document)."""
    _, mine = _pair(cog_signed=True, causal=True)
    out, inter = mine(torch.randn(2, 6, DIM), mask=PAD, return_intermediates=True)
    w, logits = inter.post_softmax_attn, inter.pre_softmax_attn
    assert bool((w < 0).any())
    assert bool((w[0, :, 4:] == 0).all()) and bool((w[0, :, :, 4:] == 0).all())
    assert bool((logits[0, :, 4:] == 0).all()) and bool((logits[0, :, :4, 4:] == float("-inf")).all())
    torch.testing.assert_close(w.abs().sum(-1)[PAD[:, None].expand(2, HEADS, 6)],
                               torch.ones(2 * HEADS * 6 - HEADS * 2), atol=1e-6, rtol=0)


def test_stack_options_padded_equal_alone_and_cache_equals_full():
    """A decoder with l2 distance, CoPE, laser and the relative projection bias: a left-padded sample equals
    itself alone, NaN at the padding reaches nothing, and KV-cache decoding equals the full forward."""
    torch.manual_seed(0)
    dec = sf.Decoder(dim=DIM, depth=2, heads=2, dim_head=DH, attn_l2_distance=True,
                     attn_use_cope=True, attn_laser=True, attn_use_rel_proj_pos_bias=True, attn_rel_proj_max_dist=3)
    for blk in dec.layers:
        if blk.kind == "self":
            torch.nn.init.normal_(blk.mixer.cope.pos_emb)
    mask = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    x = torch.randn(2, 6, DIM)
    xp = x.clone()
    xp[~mask] = NAN
    xp.requires_grad_()
    both = dec(xp, mask=mask)
    alone = dec(x[:1, 2:])
    torch.testing.assert_close(both[0, 2:], alone[0], atol=1e-5, rtol=1e-5)
    both.square().sum().backward()
    assert bool(torch.isfinite(xp.grad).all()) and bool((xp.grad[~mask] == 0).all())
    full = dec(x[1:])
    out, cache = dec(x[1:, :3], return_cache=True)
    outs = [out]
    for t in range(3, 6):
        out, cache = dec(x[1:, t:t + 1], cache=cache, return_cache=True)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unpadded"):
        sf.Decoder(dim=DIM, depth=1, attn_l2_distance=True, unpadded=True)


def test_relative_proj_bias_module_matches_x_transformers():
    torch.manual_seed(0)
    theirs = xt.x_transformers.RelativeProjPositionalBias(dim=DIM, heads=HEADS, num_distance_basis=5, max_dist=4)
    mine = sf.RelativeProjPositionalBias(DIM, HEADS, num_distance_basis=5, max_dist=4)
    mine.load_state_dict(theirs.state_dict(), strict=True)  # x-transformers' keys
    x = torch.randn(2, 5, DIM)
    torch.testing.assert_close(mine(x, seq_len_k=7), theirs(x, seq_len_k=7), atol=1e-6, rtol=1e-6)
    import safeformer.x_transformers as sfx

    assert sfx.RelativeProjPositionalBias is sf.RelativeProjPositionalBias


def test_gumbel_hard_attention_picks_an_allowed_key_and_log_probs():
    """Hard gumbel attention: one allowed key per real query (never a padded or future one), the straight-through
    gradient reaches the projections, and ``log_prob_from_hard_attend`` gives the picked key's log probability."""
    _, mine = _pair(gumbel_softmax=True, causal=True)
    x = torch.randn(2, 6, DIM, requires_grad=True)
    out, inter = mine(x, mask=PAD, return_intermediates=True)
    w = inter.post_softmax_attn
    real_rows = PAD[:, None, :].expand(2, HEADS, 6)
    assert bool((w.sum(-1)[real_rows] == 1).all()) and bool((w[~real_rows] == 0).all())
    assert bool((w[0, :, :, 4:] == 0).all()) and bool((w.triu(1) == 0).all())
    lp = sf.log_prob_from_hard_attend(inter)
    assert lp.shape == (2, HEADS, 6) and bool((lp[real_rows] <= 0).all()) and bool((lp[~real_rows] == 0).all())
    want = inter.pre_softmax_attn.log_softmax(-1).gather(-1, w.argmax(-1, keepdim=True))[..., 0]
    torch.testing.assert_close(lp[real_rows], want[real_rows])
    out.square().sum().backward()
    assert bool(torch.isfinite(x.grad).all()) and mine.to_q.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_qk_clip_caps_each_heads_largest_logit(kv_heads):
    """After ``qk_clip_`` every head's largest logit is at most tau and heads below tau are untouched, grouped heads
    included. (x-transformers' ``qk_clip_`` scales the projections' input columns, not the heads' rows, so it is not
    compared: it runs only where ``dim == heads * dim_head`` and then scales the wrong axis.)"""
    theirs, mine = _pair(kv_heads=kv_heads, causal=True)
    with torch.no_grad():
        for m in (theirs, mine):
            m.to_q.weight.mul_(torch.tensor([8.0, 1.0, 6.0, 0.5]).repeat_interleave(DH)[:, None])
    x = torch.randn(2, 6, DIM)
    _, inter = mine(x, mask=PAD, return_intermediates=True)
    top = inter.pre_softmax_attn.detach().amax(dim=(0, 2, 3))
    tau = float(top.sort().values[1]) + 1e-3  # two heads above, two at or below
    q0 = mine.to_q.weight.clone()
    mine.qk_clip_(inter, tau=tau)
    _, after = mine(x, mask=PAD, return_intermediates=True)
    new_top = after.pre_softmax_attn.amax(dim=(0, 2, 3))
    clipped = top > tau
    torch.testing.assert_close(new_top[clipped], torch.full_like(new_top[clipped], tau), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(new_top[~clipped], top[~clipped], atol=1e-5, rtol=1e-5)
    assert not torch.equal(mine.to_q.weight, q0)
    with pytest.raises(ValueError, match="tau"):
        mine.qk_clip_(after, tau=0.0)
    with pytest.raises(ValueError, match="qk_norm"):
        sf.Attention(DIM, qk_norm=True).qk_clip_(torch.zeros(1, 8, 2, 2))


def test_stack_qk_clip_and_muon_parameters():
    """``TransformerWrapper.attn_qk_clip_`` clips every attention block from the intermediates (cross-attention
    included); ``muon_parameters`` groups the matrices as x-transformers does."""
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=2, dim_head=DH, cross_attend=True))
    ids, ctx = torch.randint(0, 20, (2, 6)), torch.randn(2, 3, DIM)
    attns = [blk.mixer for blk in model.attn_layers.layers if blk.kind != "ff"]
    with torch.no_grad():
        for a in attns:
            a.to_q.weight.mul_(30.0)
    _, inter = model(ids, context=ctx, return_intermediates=True)
    assert len(inter.attn_intermediates) == 4 and all(t.pre_softmax_attn is not None for t in inter.attn_intermediates)
    model.attn_qk_clip_(inter, tau=5.0)
    _, after = model(ids, context=ctx, return_intermediates=True)
    # the first block is clipped exactly; later blocks see inputs that the clip above them moved
    torch.testing.assert_close(after.attn_intermediates[0].pre_softmax_attn.amax(dim=(0, 2, 3)), torch.full((2,), 5.0))
    assert all(float(t.pre_softmax_attn.detach().max()) <= 7.5 for t in after.attn_intermediates)
    _, no_ctx = model(ids, return_intermediates=True)
    model.attn_qk_clip_(no_ctx, tau=5.0)  # the self-attention blocks alone
    with pytest.raises(ValueError, match="pair"):
        model.attn_qk_clip_(sf.LayerIntermediates(attn_intermediates=inter.attn_intermediates[:1]))
    enc = sf.Encoder(dim=DIM, depth=2, heads=2, dim_head=DH)
    theirs = xt.Encoder(dim=DIM, depth=2, heads=2, attn_dim_head=DH)
    assert len(enc.muon_parameters()) == len(theirs.muon_parameters()) == 8
    assert len(sf.Attention(DIM, dim_out=12).muon_parameters()) == 2
    assert len(sf.FeedForward(DIM, glu=True).muon_parameters()) == 2


def test_refusals_name_the_option():
    x = torch.randn(1, 3, DIM)
    with pytest.raises(ValueError, match="use_cope"):
        sf.Attention(DIM, use_cope=True)
    with pytest.raises(ValueError, match="cope_talking_heads"):
        sf.Attention(DIM, use_cope=True, causal=True, cope_talking_heads=True)
    with pytest.raises(ValueError, match="at most one"):
        sf.Attention(DIM, sigmoid=True, l2_distance=True)
    with pytest.raises(ValueError, match="self-attention only"):
        sf.Attention(DIM, use_rel_proj_pos_bias=True)(x, context=torch.randn(1, 2, DIM))
    with pytest.raises(ValueError, match="dim_latent_q"):
        sf.Attention(DIM, use_latent_q=True)
    with pytest.raises(ValueError, match="latent_rope_subheads"):
        sf.Decoder(dim=DIM, depth=1, heads=4, attn_kv_heads=2, attn_use_latent_kv=True, attn_dim_latent_kv=8,
                   attn_latent_rope_subheads=1)
    with pytest.raises(ValueError, match="laser"):
        sf.Attention(DIM, laser=True, cog_signed=True)
    with pytest.raises(ValueError, match="memory keys"):
        sf.CrossAttender(dim=DIM, depth=1, attn_num_mem_kv=2, cross_attn_inverted_attention=True)
    with pytest.raises(ValueError, match="dim_out"):
        sf.Attention(DIM, dim_out=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_large_logits_stay_finite(dtype):
    """The explicit path computes in float32: with logits in the thousands, half-precision outputs and gradients
    stay finite, and padded rows exact zeros (laser's exp included: its softclamp bounds the values)."""
    torch.manual_seed(0)
    dec = sf.Decoder(dim=DIM, depth=1, heads=2, dim_head=DH, cross_attend=True, dim_context=12, attn_l2_distance=True,
                     attn_laser=True, attn_use_cope=True, attn_use_rel_proj_pos_bias=True)
    with torch.no_grad():
        for blk in dec.layers:
            if blk.kind != "ff":
                blk.mixer.to_q.weight.mul_(60.0)
                blk.mixer.to_k.weight.mul_(60.0)
    dec = dec.to(dtype)
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    x = torch.randn(2, 6, DIM, dtype=dtype, requires_grad=True)
    ctx = torch.randn(2, 3, 12, dtype=dtype)
    out = dec(x, mask=mask, context=ctx, context_mask=torch.tensor([[True, True, False], [False] * 3]))
    assert bool(torch.isfinite(out).all()) and bool((out[~mask] == 0).all())
    out[mask].float().square().sum().backward()
    assert bool(torch.isfinite(x.grad).all())
    assert all(bool(torch.isfinite(p.grad).all()) for p in dec.parameters() if p.grad is not None)


def test_stack_intermediates_and_static_step_reason():
    """The stack's intermediates carry the logits (masked keys -inf, padded rows 0); generation with a per-query
    scoring option and a relative projection bias run on the static step."""
    from safeformer.decoding.static import static_reason

    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=sf.Decoder(
        dim=DIM, depth=1, heads=2, dim_head=DH, attn_cog_signed=True))
    mask = torch.tensor([[False, True, True, True], [True] * 4])
    _, inter = model(torch.randint(0, 20, (2, 4)), mask=mask, return_intermediates=True)
    logits = inter.attn_intermediates[0].pre_softmax_attn
    assert bool((logits[0, :, 0] == 0).all()) and bool((logits[0, :, 1:, 0] == float("-inf")).all())
    assert bool((logits.triu(1)[1] == float("-inf")).sum() == 2 * 6)
    assert static_reason(model) is None
    model2 = sf.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=sf.Decoder(
        dim=DIM, depth=1, heads=2, dim_head=DH, attn_use_rel_proj_pos_bias=True))
    assert static_reason(model2) is None  # the step reads its bias from the new position's input and the slots


def test_decoupled_rope_matches_x_transformers():
    """Multi-latent attention with rotary positions rotates only the last ``latent_rope_subheads`` heads, as
    x-transformers' decoupled rope; a stack with it decodes with the KV cache as its full forward."""
    theirs, mine = _pair(use_latent_kv=True, dim_latent_kv=10, latent_rope_subheads=2, causal=True)
    rot = xt.x_transformers.RotaryEmbedding(4)
    x = torch.randn(2, 6, DIM)
    emb = rot.forward_from_seq_len(6)
    torch.testing.assert_close(mine(x, mask=PAD, rotary_pos_emb=emb)[PAD], theirs(x, mask=PAD, rotary_pos_emb=emb)[PAD],
                               atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    dec = sf.Decoder(dim=DIM, depth=2, heads=4, dim_head=DH, rotary_pos_emb=True, attn_use_latent_q=True,
                     attn_dim_latent_q=12, attn_use_latent_kv=True, attn_dim_latent_kv=10, attn_latent_rope_subheads=2)
    full = dec(x)
    out, cache = dec(x[:, :4], return_cache=True)
    out2 = dec(x[:, 4:], cache=cache)
    torch.testing.assert_close(torch.cat((out, out2), 1), full, atol=1e-5, rtol=1e-5)


def test_fused_l2_kernel_path_cache_and_planted_nan():
    """l2 distance alone runs the fused kernels: equal to the explicit float32 path (return_attn) and to the
    float64 module; a decoder decodes with the KV cache as its full forward; NaN in a past_kv's masked slots reaches
    no output and no gradient (its |k|^2 is selected away first)."""
    torch.manual_seed(0)
    attn = sf.Attention(DIM, dim_head=DH, heads=HEADS, kv_heads=2, causal=True, l2_distance=True)
    assert not attn.explicit
    x = torch.randn(2, 6, DIM)
    fused = attn(x, mask=PAD)
    explicit, _ = attn(x, mask=PAD, return_attn=True)
    wide = attn.double()(x.double(), mask=PAD)
    attn.float()
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.double(), wide, atol=1e-5, rtol=1e-5)
    pk, pv = torch.randn(2, 2, 3, DH), torch.randn(2, 2, 3, DH)
    pmask = torch.tensor([[True, False, True], [True, True, True]])
    pk[0, :, 1], pv[0, :, 1] = NAN, NAN
    pk.requires_grad_(), pv.requires_grad_()
    full_mask = torch.cat((pmask, torch.ones(2, 2, dtype=torch.bool)), 1)
    out = attn(x[:, :2], mask=full_mask, past_kv=(pk, pv))
    assert bool(torch.isfinite(out).all())
    out.square().sum().backward()
    assert bool(torch.isfinite(pk.grad).all()) and bool((pk.grad[0, :, 1] == 0).all())
    assert bool(torch.isfinite(pv.grad).all()) and bool((pv.grad[0, :, 1] == 0).all())
    dec = sf.Decoder(dim=DIM, depth=2, heads=2, dim_head=DH, attn_l2_distance=True, rotary_pos_emb=True)
    full = dec(x)
    first, cache = dec(x[:, :3], return_cache=True)
    rest = [dec(x[:, t:t + 1], cache=cache, return_cache=True) for t in range(3, 4)]
    torch.testing.assert_close(torch.cat((first, rest[0][0]), 1), full[:, :4], atol=1e-5, rtol=1e-5)
