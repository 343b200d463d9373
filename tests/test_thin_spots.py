"""Tests aimed at spots where a plausible one-line bug would have gone unnoticed.

- hyper-connections (``num_residual_streams > 1``): freshly initialised parameters equal x-transformers'
  for the same constructor call (their names are x-transformers', their values deterministic);
- the converter on grouped key/value heads together with the attention gates (full and low rank, value
  and output gates, SwiGLU values): logits equal x-transformers' on the same weights;
- refusals nothing else exercised: a looped wrapper over a stack without post-norms, and the mask
  memo of one validation scope re-checking a mask against another device, shape or an in-place change;
- ``compose_guidance(space="logprobs")`` with banned tokens, against a float64 hand computation by name
  (the mappings in the same and in different orders);
- the belief-state wrapper's guided backward decoding against separate passes, step by step;
- ``top_a`` at the edges of its parameters: the best token always survives.

Shape legend: b batch, n positions, v vocabulary, d width.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import safeformer as sf
from safeformer.core.masks import validate_mask, validation_scope
from safeformer.decoding.generation import top_a
from safeformer.research.belief_state import BeliefStateWrapper, reverse_real

logging.getLogger("x_transformers").setLevel(logging.ERROR)
try:  # x-transformers logs through loguru
    from loguru import logger as _loguru

    _loguru.disable("x_transformers")
except ImportError:  # pragma: no cover
    pass

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------
# hyper-connections: initial values equal x-transformers'
# ----------------------------------------------------------------------------------------------------

HYPER_CALLS = {
    "streams4": dict(depth=2, num_residual_streams=4),
    "streams3_depth4": dict(depth=4, num_residual_streams=3),  # layer_index % S wraps
    "qkv_views": dict(depth=2, num_residual_streams=3, qkv_receive_diff_residuals=True),
    "cross": dict(depth=2, num_residual_streams=2, cross_attend=True),
    "lime": dict(depth=2, num_residual_streams=2, integrate_layers=True),
    "custom_layers": dict(depth=2, num_residual_streams=3, custom_layers=("a", "f", "f", "a", "f")),
    "sinkhorn_iters": dict(depth=2, num_residual_streams=2, hyper_conn_sinkhorn_iters=2),
}


@pytest.mark.parametrize("name", list(HYPER_CALLS))
def test_hyper_connections_start_where_x_transformers_start(name):
    xt = pytest.importorskip("x_transformers")
    kw = dict(dim=16, heads=2, attn_dim_head=8, **HYPER_CALLS[name])
    torch.manual_seed(0)
    theirs = xt.Decoder(**kw)
    torch.manual_seed(0)
    ours = sf.Decoder(**kw)
    hyper = [layer[2] for layer in ours.layers]
    residuals = [layer[2] for layer in theirs.layers]
    assert all(type(r).__name__ == "HyperConnection" for r in residuals)
    assert len(hyper) == len(residuals)
    torch.testing.assert_close(ours.stream_emb, theirs.stream_emb, rtol=0, atol=0)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    static_alphas = set()
    for i, (mine, other) in enumerate(zip(hyper, residuals)):
        assert mine.sinkhorn_iters == other.sinkhorn_iters and mine.num_input_views == other.num_input_views
        mp, op = dict(mine.named_parameters()), dict(other.named_parameters())
        assert mp.keys() == op.keys(), f"layer {i}: parameter names differ"
        for pname, p in op.items():
            assert mp[pname].shape == p.shape, f"layer {i}: {pname} has shape {tuple(mp[pname].shape)}, x-transformers {tuple(p.shape)}"
            assert torch.equal(mp[pname], p), f"layer {i}: {pname} starts at other values than x-transformers'"
        static_alphas.add(mine.static_alpha.detach().numpy().tobytes())
    assert len(static_alphas) > 1, "every layer's static alpha is the same: the layer index did not reach it"


def test_hyper_connections_static_mix_by_hand():
    # independent of x-transformers: layer i's branch input starts on stream i % S, the streams keep
    # themselves (identity), and each stream takes the branch output with beta = 2 sigmoid(1)
    s, v = 3, 3
    block = [layer[2] for layer in sf.Decoder(dim=8, depth=4, heads=2, attn_dim_head=4, num_residual_streams=s,
                                               qkv_receive_diff_residuals=True).layers]
    for i, hc in enumerate(block):
        views = hc.num_input_views
        want = torch.zeros(s, views + s)
        want[i % s, :views] = 1.0
        want[:, views:] = torch.eye(s)
        assert torch.equal(hc.static_alpha.detach(), want), f"layer {i}"
        assert torch.equal(hc.static_beta.detach(), torch.ones(s))
        assert (hc.dynamic_alpha_fn == 0).all() and (hc.dynamic_beta_fn == 0).all()
        assert hc.dynamic_alpha_scale.item() == pytest.approx(1e-2) and hc.dynamic_beta_scale.item() == pytest.approx(1e-2)
    assert [hc.num_input_views for hc in block] == [v, 1] * 4  # depth 4: attention, feed-forward, ...


# ----------------------------------------------------------------------------------------------------
# the converter: grouped key/value heads with the attention gates
# ----------------------------------------------------------------------------------------------------

V, N, B, DIM = 37, 9, 3, 32

GATED_GQA = {
    "gqa_low_rank_output_gate": dict(attn_kv_heads=2, attn_output_gate=True, attn_output_gate_rank=4),
    "gqa_low_rank_value_gate": dict(attn_kv_heads=2, attn_gate_values=True, attn_gate_values_rank=4),
    "gqa_low_rank_both_no_silu": dict(attn_kv_heads=2, attn_gate_values=True, attn_gate_values_rank=4,
                                      attn_output_gate=True, attn_output_gate_rank=3, attn_low_rank_silu_gates=False),
    "gqa_headwise_gates": dict(attn_kv_heads=2, attn_gate_values=True, attn_gate_values_headwise=True,
                               attn_output_gate=True, attn_output_gate_headwise=True),
    "gqa_swiglu_values": dict(attn_kv_heads=2, attn_gate_values=True, attn_swiglu_values=True),
    "gqa_cross_low_rank_swiglu": dict(attn_kv_heads=2, cross_attend=True, attn_gate_values=True,
                                      attn_gate_values_rank=4, attn_swiglu_values=True, attn_output_gate=True,
                                      attn_output_gate_rank=4),
    "mqa_rotary_low_rank_output_gate": dict(attn_one_kv_head=True, rotary_pos_emb=True, attn_output_gate=True,
                                            attn_output_gate_rank=2),
    "mqa_encoder_headwise_output_low_rank_values": dict(layers="Encoder", attn_kv_heads=1, attn_gate_values=True,
                                                        attn_gate_values_rank=4, attn_output_gate=True,
                                                        attn_output_gate_headwise=True),
}


def _xt_model(cfg: dict, seed: int = 0) -> nn.Module:
    """An x-transformers TransformerWrapper with every parameter moved off its init (gates included)."""
    xt = pytest.importorskip("x_transformers")
    cfg = dict(cfg)
    layers = getattr(xt, cfg.pop("layers", "Decoder"))
    torch.manual_seed(seed)
    model = xt.TransformerWrapper(num_tokens=V, max_seq_len=16,
                                  attn_layers=layers(dim=DIM, depth=2, heads=4, attn_dim_head=8, **cfg))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen) * (p.detach().abs().mean() + 0.1))
    return model.eval()


@pytest.mark.parametrize("name", list(GATED_GQA))
def test_converter_grouped_kv_heads_with_gates_matches_x_transformers(name):
    cfg = GATED_GQA[name]
    theirs = _xt_model(cfg)
    ours = sf.from_x_transformers(theirs)
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (B, N), generator=gen)
    mask = torch.arange(N)[None] < torch.tensor([N, 6, 2])[:, None]
    kw = {}
    if cfg.get("cross_attend"):
        kw = dict(context=torch.randn(B, 5, DIM, generator=gen),
                  context_mask=torch.arange(5)[None] < torch.tensor([5, 3, 1])[:, None])
    with torch.no_grad():
        want, got = theirs(x, mask=mask, **kw), ours(x, mask=mask, **kw)
    assert got.shape == want.shape
    assert torch.isfinite(got[mask]).all()
    err = (want[mask] - got[mask]).abs().max().item()
    assert err <= 1e-5, f"max |x-transformers - safeformer| = {err:.3g}"
    assert want[mask].abs().max() > 0.1  # not trivially small
    # the gates matter: without them the logits are other ones (a gate dropped in conversion would show)
    attn = next(m for m in theirs.modules() if type(m).__name__ == "Attention")
    gate = attn.to_output_gate if getattr(attn, "to_output_gate", None) is not None else attn.to_v_gate
    with torch.no_grad():
        for p in gate.parameters():
            p.mul_(3.0)
        moved = theirs(x, mask=mask, **kw)
    assert (moved[mask] - want[mask]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------
# refusals: the looped wrapper's routing check, the mask memo
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [
    dict(),  # no residual routing at all
    dict(depth=4, unet_skips=True),  # routing, but no post-norms
    dict(num_residual_streams=2),  # hyper-connections without post-norms
])
def test_looped_wrapper_refuses_a_stack_without_post_norms(layers):
    kw = dict(dict(dim=16, depth=2, heads=2, attn_dim_head=8), **layers)
    with pytest.raises(ValueError, match=r"looped=True needs attn_layers built with pre_and_post_norm=True"):
        sf.TransformerWrapper(num_tokens=11, max_seq_len=8, looped=True, attn_layers=sf.Decoder(**kw))


def test_looped_wrapper_checks_and_the_accepted_stack():
    layers = lambda: sf.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, pre_and_post_norm=True)  # noqa: E731
    net = sf.TransformerWrapper(num_tokens=11, max_seq_len=8, looped=True, max_looped_steps=2, attn_layers=layers())
    out = net(torch.arange(6).reshape(1, 6) % 11)
    assert out.shape == (1, 6, 11) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="choose one of looped and recycling"):
        sf.TransformerWrapper(num_tokens=11, max_seq_len=8, looped=True, recycling=True, attn_layers=layers())
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="max_looped_steps must be a positive integer"):
            sf.TransformerWrapper(num_tokens=11, max_seq_len=8, looped=True, max_looped_steps=bad, attn_layers=layers())
    plain = sf.TransformerWrapper(num_tokens=11, max_seq_len=8, attn_layers=sf.Decoder(dim=16, depth=1, heads=2))
    with pytest.raises(ValueError, match="looped_steps given to a model built without looped=True"):
        plain(torch.arange(4)[None], looped_steps=2)
    with pytest.raises(ValueError, match="looped_exit_prob_threshold must be a probability"):
        net(torch.arange(4)[None], looped_exit_prob_threshold=1.5)


def test_mask_memo_checks_again_for_another_device():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with validation_scope():
        validate_mask(mask, "mask", shape=(2, 3), device=torch.device("cpu"))
        # the same tensor, already checked for the CPU, is not on the meta device: still an error
        with pytest.raises(ValueError, match=r"mask is on cpu, expected meta"):
            validate_mask(mask, "mask", shape=(2, 3), device=torch.device("meta"))
        validate_mask(mask, "mask", shape=(2, 3))  # no device asked: fine
        with pytest.raises(ValueError, match=r"context_mask is on cpu, expected meta"):
            validate_mask(mask, "context_mask", shape=(2, 3), device="meta")
        with pytest.raises(ValueError, match=r"mask must have shape \(2, 4\), got \(2, 3\)"):
            validate_mask(mask, "mask", shape=(2, 4), device=torch.device("cpu"))
    meta = torch.ones(2, 3, dtype=torch.bool, device="meta")
    with validation_scope():
        validate_mask(meta, "mask", device="meta")
        with pytest.raises(ValueError, match=r"mask is on meta, expected cpu"):
            validate_mask(meta, "mask", device="cpu")


def test_mask_memo_checks_again_after_an_in_place_change():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with validation_scope():
        validate_mask(mask, "mask", shape=(2, 3))
        mask.resize_(2, 4)  # the same tensor object, another shape
        with pytest.raises(ValueError, match=r"mask must have shape \(2, 3\), got \(2, 4\)"):
            validate_mask(mask, "mask", shape=(2, 3))


# ----------------------------------------------------------------------------------------------------
# compose_guidance in log-probability space with banned tokens
# ----------------------------------------------------------------------------------------------------


def _guided_by_hand(uncond, conds, scales):
    """float64: each branch log-softmaxed, then ``u + sum_k s_k (c_k - u)`` by name; a token banned in
    uncond or in a branch with a non-zero scale is -inf."""
    u = uncond.double().log_softmax(-1)
    out = u.clone()
    banned = u == NEG_INF
    for name, s in scales.items():
        if s == 0:
            continue
        c = conds[name].double().log_softmax(-1)
        banned |= c == NEG_INF
        out = out + s * torch.where(c == NEG_INF, 0.0, c - torch.where(u == NEG_INF, 0.0, u))
    return out.masked_fill(banned, NEG_INF), banned


def _branches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    v = 9
    uncond = torch.randn(2, v, generator=g) * 2
    conds = {name: torch.randn(2, v, generator=g) * 2 for name in ("text", "style", "thickness")}
    uncond[:, 0] = NEG_INF  # banned everywhere
    for t in (uncond, *conds.values()):
        t[:, 0] = NEG_INF
    conds["style"][0, 3] = NEG_INF  # banned in one branch only
    conds["thickness"][1, 5] = NEG_INF  # in a branch at scale 0 in one of the cases below
    uncond[1, 7] = NEG_INF  # banned in the unconditional branch only
    return uncond, conds


@pytest.mark.parametrize("order", ["same", "different"])
@pytest.mark.parametrize("scales", [
    {"text": 3.0, "style": -1.5, "thickness": 0.5},
    {"text": 2.0, "style": 0.7, "thickness": 0.0},
    {"text": 1.0},
])
def test_compose_guidance_logprobs_with_banned_tokens_by_name(order, scales):
    uncond, conds = _branches()
    conds = {k: conds[k] for k in scales} | {k: v for k, v in conds.items() if k not in scales}
    if order == "different":
        conds = dict(reversed(list(conds.items())))
        assert list(conds) != list(scales) or len(scales) == 1
    got = sf.compose_guidance(uncond, conds, scales, space="logprobs")
    want, banned = _guided_by_hand(uncond, conds, scales)
    assert got.dtype == torch.float32 and got.shape == uncond.shape
    assert (got[banned] == NEG_INF).all(), "a banned token is not -inf"
    assert torch.isfinite(got[~banned]).all(), "a token that no branch bans is not finite"
    assert banned[:, 0].all() and banned[1, 7]
    if scales.get("style"):
        assert banned[0, 3]
    assert not banned[1, 5] or scales.get("thickness"), "a branch at scale 0 banned a token"
    torch.testing.assert_close(got[~banned].double(), want[~banned], rtol=1e-6, atol=1e-5)


def test_compose_guidance_logprobs_is_not_the_logit_space_answer():
    # a sanity check of the hand computation: the two spaces give other numbers on these branches
    uncond, conds = _branches(1)
    scales = {"text": 2.0, "style": 0.5}
    a = sf.compose_guidance(uncond, conds, scales, space="logprobs")
    b = sf.compose_guidance(uncond, conds, scales, space="logits")
    live = torch.isfinite(a)
    assert (a[live] - b[live]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------
# the belief-state wrapper: guided backward decoding
# ----------------------------------------------------------------------------------------------------

BV, BD = 13, 16


def _belief_model() -> BeliefStateWrapper:
    def decoder(seed):
        torch.manual_seed(seed)
        return sf.TransformerWrapper(num_tokens=BV, max_seq_len=24, attn_layers=sf.Decoder(
            dim=BD, depth=1, heads=2, dim_head=8, rotary_pos_emb=True, cross_attend=True, dim_context=BD))

    fwd, bwd = decoder(0), decoder(1)
    torch.manual_seed(2)
    return BeliefStateWrapper(fwd, bwd).double().eval()


def _backward_logits(model, out_rev, tok, ctx, ctx_mask):
    """The backward head's logits ``(b, v)`` for the reversed sequence ``out_rev`` (every position real)."""
    b = out_rev.shape[0]
    f = model.forward_decoder(tok, return_embeddings=True, context=ctx, context_mask=ctx_mask)
    prefix = model.suffix_token[None, None].expand(b, 1, -1)
    h = model.backward_decoder(out_rev, prepend_embeds=prefix, excise_prepend_embeds=True, return_embeddings=True,
                               context=ctx, context_mask=ctx_mask)
    return model.text_head(torch.cat((f, h[:, -1:]), -1)).chunk(2, -1)[1][:, -1]


@pytest.mark.parametrize("cache_kv", [False, True])
def test_guided_backward_decoding_equals_separate_passes(cache_kv):
    """Each greedy step of guided ``decode_backwards`` is the argmax of ``guided_logits(cond, uncond, s)``,
    the conditional pass with the context, the unconditional one with it dropped (in both decoders),
    every pass on the tokens decoded so far."""
    model = _belief_model()
    g = torch.Generator().manual_seed(5)
    b, n, steps = 3, 4, 4
    prompts = torch.randint(0, BV, (b, n), generator=g)
    ctx = torch.randn(b, 2, BD, generator=g, dtype=torch.float64)
    on, off = torch.ones(b, 2, dtype=torch.bool), torch.zeros(b, 2, dtype=torch.bool)
    tok = torch.randint(0, BV, (b, 1), generator=torch.Generator().manual_seed(11))  # the random prefix token
    differs = False
    plain = model.generate_with_suffix_cond(prompts, steps, decode_backwards=True, temperature=0.0, context=ctx,
                                            cache_kv=cache_kv, generator=torch.Generator().manual_seed(11))
    for scale in (0.0, 3.0, -1.5, 1.0):
        got = model.generate_with_suffix_cond(prompts, steps, decode_backwards=True, temperature=0.0, context=ctx,
                                              cond_scale=scale, cache_kv=cache_kv,
                                              generator=torch.Generator().manual_seed(11))
        assert got.shape == (b, steps)
        out = reverse_real(prompts, None)
        with torch.no_grad():
            for t in range(steps):
                cond = _backward_logits(model, out, tok, ctx, on)
                uncond = _backward_logits(model, out, tok, ctx, off)
                guided = sf.guided_logits(cond, uncond, scale)
                top2 = guided.topk(2, -1).values
                assert (top2[:, 0] - top2[:, 1]).min() > 1e-9, "a near tie: the comparison would say nothing"
                assert torch.equal(got[:, t], guided.argmax(-1)), f"scale {scale}, step {t}"
                out = torch.cat((out, got[:, t: t + 1]), -1)
        if scale == 1.0:
            assert torch.equal(got, plain)
        if scale == 0.0:  # the unconditional branch alone: the context dropped
            dropped = model.generate_with_suffix_cond(prompts, steps, decode_backwards=True, temperature=0.0,
                                                      context=ctx, context_mask=off, cache_kv=cache_kv,
                                                      generator=torch.Generator().manual_seed(11))
            assert torch.equal(got, dropped)
        differs |= not torch.equal(got, plain)
    assert differs, "guidance never changed a token: the test would not see a wrong branch"


# ----------------------------------------------------------------------------------------------------
# top_a at the edges of its parameters
# ----------------------------------------------------------------------------------------------------


def _rows():
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.randn(5, 11, generator=g) * 3,  # ordinary rows
        torch.tensor([[2.0, 2.0, 1.0, -1.0, 0.0]]),  # a tie at the top
        torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]]),  # all tied
        torch.tensor([[NEG_INF, 3.0, NEG_INF, 2.9, -50.0]]),  # banned entries
        torch.tensor([[NEG_INF, NEG_INF, 0.0, NEG_INF, NEG_INF]]),  # one token left
        torch.tensor([[80.0, 0.0, -80.0, 79.99, 1e-3]]),  # a near-certain best
        torch.tensor([[1e-7, 0.0, 0.0, 0.0, 0.0]]),  # the best by a hair
    ]
    return rows


@pytest.mark.parametrize("min_p_pow, min_p_ratio", [
    (2.0, 0.02), (2.0, 1.0), (1.0, 1.0), (1e-6, 1.0), (1e-6, 0.5), (0.5, 1.0), (1e6, 1.0), (1e300, 1.0),
    (1e300, 0.0), (2.0, 0.0), (3, 1),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_top_a_keeps_the_best_token(min_p_pow, min_p_ratio, dtype):
    for logits in _rows():
        logits = logits.to(dtype)
        out = top_a(logits, min_p_pow=min_p_pow, min_p_ratio=min_p_ratio)
        assert out.dtype == logits.dtype and out.shape == logits.shape
        assert not out.isnan().any()
        best = logits == logits.amax(-1, keepdim=True)
        assert torch.equal(out[best], logits[best]), "a best token was filtered out"
        kept = out > NEG_INF
        assert torch.equal(out[kept], logits[kept]), "a kept token changed its logit"
        assert (out[logits == NEG_INF] == NEG_INF).all(), "a banned token came back"
        # the rule itself: kept exactly where p >= min(ratio * p_max ** pow, p_max)
        probs = logits.double().softmax(-1)
        top = probs.amax(-1, keepdim=True)
        limit = torch.minimum(top.pow(min_p_pow) * min_p_ratio, top)
        clear = (probs - limit).abs() > 1e-6 * limit.clamp_min(1e-30)  # not at the boundary
        assert torch.equal(kept[clear], (probs >= limit)[clear] & (logits > NEG_INF)[clear])


def test_top_a_ratio_one_keeps_only_the_best_and_its_ties():
    logits = torch.tensor([[2.0, 2.0, 1.9, -1.0], [0.0, 5.0, 4.0, NEG_INF]])
    out = top_a(logits, min_p_pow=0.5, min_p_ratio=1.0)  # p_max ** 0.5 > p_max: the limit is p_max
    assert torch.equal(out > NEG_INF, torch.tensor([[True, True, False, False], [False, True, False, False]]))


def test_top_a_with_logits_beyond_the_float32_range():
    # float64 logits far outside float32's range are ordinary logits: the filter still filters
    big = 1e39
    logits = torch.tensor([[big, big - 1e24, big - 1e25, -big]], dtype=torch.float64)
    assert logits.unique().numel() == 4
    out = top_a(logits, min_p_pow=2.0, min_p_ratio=0.5)
    assert torch.equal(out > NEG_INF, torch.tensor([[True, False, False, False]])), out
    assert out[0, 0] == logits[0, 0]


def test_top_a_refuses_bad_parameters_by_name():
    logits = torch.zeros(1, 4)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match="min_p_pow"):
            top_a(logits, min_p_pow=bad)
    for bad in (-0.1, 1.5, float("nan"), True, None):
        with pytest.raises(ValueError, match="min_p_ratio"):
            top_a(logits, min_p_ratio=bad)


@pytest.mark.parametrize("l2norm_embed", [False, True])
def test_token_embedding_starts_as_x_transformers_does(l2norm_embed):
    """The token embedding's initial distribution is x-transformers' (Kaiming normal: std sqrt(2 / emb_dim);
    std 1e-5 under l2norm_embed), not nn.Embedding's std 1: a fresh model's logits have x-transformers' scale."""
    import x_transformers as xt

    v, d = 4096, 256
    want = 1e-5 if l2norm_embed else (2 / d) ** 0.5
    torch.manual_seed(0)
    ours = sf.TransformerWrapper(num_tokens=v, max_seq_len=8, l2norm_embed=l2norm_embed,
                                 attn_layers=sf.Decoder(dim=d, depth=1, heads=2))
    theirs = xt.TransformerWrapper(num_tokens=v, max_seq_len=8, l2norm_embed=l2norm_embed,
                                   attn_layers=xt.Decoder(dim=d, depth=1, heads=2))
    for name, w in (("safeformer", ours.token_emb.weight), ("x-transformers", theirs.token_emb.emb.weight)):
        std = w.detach().double().std().item()
        assert abs(std / want - 1) < 0.02, f"{name}: token embedding std {std:.3g}, expected {want:.3g}"
