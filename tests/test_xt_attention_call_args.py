"""x-transformers' ``Attention.forward`` modulations and memories: ``q_delta``, ``k_delta``, ``v_delta`` (added to the
projections before the heads split), ``o_delta`` (to the merged heads before the gates), ``attn_delta`` (to the
weights) and ``mem`` / ``mem_mask`` (memories every query sees first): x-transformers' numbers on the same weights,
and what a padded slot, a masked memory or a masked (future) key holds reaches nothing."""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")

CONFIGS = {
    "plain": dict(),
    "mem_kv": dict(num_mem_kv=2),
    "sink": dict(head_learned_sink=True),
    "latent_kv": dict(use_latent_kv=True, dim_latent_kv=8),
    "gqa_gates": dict(kv_heads=1, gate_values=True, output_gate=True),
    "value_dim_head": dict(value_dim_head=6),
}


def _pair(opts: dict, causal: bool = False):
    torch.manual_seed(0)
    theirs = xt.Attention(16, heads=2, dim_head=8, causal=causal, **opts)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    ours = sf.Attention(16, heads=2, dim_head=8, causal=causal, **opts)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _deltas(ours, g, b=2, n=5) -> dict:
    return dict(q_delta=0.2 * torch.randn(b, n, ours.to_q.out_features, generator=g),
                k_delta=0.2 * torch.randn(b, n, ours.to_k.out_features, generator=g),
                v_delta=0.2 * torch.randn(b, n, ours.to_v.out_features, generator=g),
                o_delta=0.2 * torch.randn(b, n, ours.heads * ours.dim_value, generator=g))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deltas_memories_and_attn_delta_equal_x_transformers(name):
    theirs, ours = _pair(CONFIGS[name])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g)
    d = _deltas(ours, g)
    torch.testing.assert_close(ours(x, **d), theirs(x, **d), atol=1e-5, rtol=1e-5)
    mem = torch.randn(2, 3, 16, generator=g)
    mem_mask = torch.tensor([[True, True, True], [False, True, True]])
    torch.testing.assert_close(ours(x, mem=mem, mem_mask=mem_mask), theirs(x, mem=mem, mem_mask=mem_mask),
                               atol=1e-5, rtol=1e-5)
    j = 5 + CONFIGS[name].get("num_mem_kv", 0) + int(bool(CONFIGS[name].get("head_learned_sink")))
    delta = 0.1 * torch.randn(2, 2, 5, j, generator=g)
    torch.testing.assert_close(ours(x, attn_delta=delta), theirs(x, attn_delta=delta), atol=1e-5, rtol=1e-5)


def test_padded_slots_and_masked_memories_reach_nothing():
    _, ours = _pair(CONFIGS["gqa_gates"])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 16, generator=g)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    d = _deltas(ours, g)
    for t in d.values():
        t[~mask] = float("nan")
    x[~mask] = float("nan")
    mem = torch.randn(2, 3, 16, generator=g)
    mem_mask = torch.tensor([[True, True, True], [False, True, True]])
    mem[~mem_mask] = float("inf")
    leaves = {k: v.clone().requires_grad_() for k, v in d.items()}
    xs, ms = x.clone().requires_grad_(), mem.clone().requires_grad_()
    out = ours(xs, mask=mask, mem=ms, mem_mask=mem_mask, **leaves)
    assert torch.isfinite(out[mask]).all() and (out[~mask] == 0).all()
    out[mask].sum().backward()
    for t in [xs, ms, *leaves.values()]:
        assert torch.isfinite(t.grad).all()
    assert (ms.grad[~mem_mask] == 0).all()
    alone = ours(x[1:2, :3], mem=mem[1:2, 1:], **{k: v[1:2, :3] for k, v in d.items()})
    torch.testing.assert_close(out[1:2, :3].detach(), alone.detach(), atol=1e-5, rtol=1e-5)


def test_o_delta_leaves_a_row_with_no_key_at_zero():
    _, ours = _pair({})
    x = torch.randn(2, 4, 16)
    ctx = torch.randn(2, 3, 16)
    cmask = torch.tensor([[True] * 3, [False] * 3])
    out = ours(x, context=ctx, context_mask=cmask, o_delta=torch.ones(2, 4, 16))
    assert (out[1] == 0).all() and (out[0] != 0).any()


def test_attn_delta_reaches_no_future_key():
    """x-transformers adds the delta at causally masked entries too (the future's values reach the output); here
    a query's output depends on no later position."""
    _, ours = _pair({}, causal=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, 16, generator=g)
    delta = torch.randn(1, 2, 5, 5, generator=g)
    x2 = x.clone()
    x2[:, 3:] = torch.randn(1, 2, 16, generator=g)
    a, b = ours(x, attn_delta=delta), ours(x2, attn_delta=delta)
    torch.testing.assert_close(a[:, :3], b[:, :3])


@pytest.mark.parametrize("kw,exc,word", [
    (dict(q_delta=torch.zeros(2, 5, 15)), ValueError, "q_delta"),
    (dict(k_delta=torch.zeros(2, 5, 16, dtype=torch.long)), TypeError, "k_delta"),
    (dict(v_delta="x"), TypeError, "v_delta"),
    (dict(o_delta=torch.zeros(3, 5, 16)), ValueError, "o_delta"),
    (dict(attn_delta=torch.zeros(2, 2, 5, 4)), ValueError, "attn_delta"),
    (dict(mem=torch.zeros(2, 3, 15)), ValueError, "mem"),
    (dict(mem_mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "mem_mask"),
    (dict(mem=torch.zeros(2, 3, 16), mem_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, "mem_mask"),
    (dict(mem=torch.zeros(2, 3, 16), context=torch.zeros(2, 3, 16)), ValueError, "mem"),
])
def test_bad_values_are_named(kw, exc, word):
    _, ours = _pair({})
    with pytest.raises(exc, match=word):
        ours(torch.randn(2, 5, 16), **kw)


def _bias_modules():
    import safeformer.x_transformers as S

    X = xt.x_transformers
    return {"t5": (X.RelativePositionBias(scale=8**0.5, causal=True, heads=2),
                   S.RelativePositionBias(scale=8**0.5, causal=True, heads=2)),
            "alibi": (X.AlibiPositionalBias(heads=2, total_heads=2), S.AlibiPositionalBias(heads=2, total_heads=2)),
            "dynamic": (X.DynamicPositionBias(dim=16, heads=2, depth=2), S.DynamicPositionBias(dim=16, heads=2, depth=2))}


@pytest.mark.parametrize("kind", ["t5", "alibi", "dynamic"])
def test_rel_pos_modules_as_x_transformers(kind):
    """``Attention.forward(rel_pos=)``: x-transformers' position-bias modules (safeformer's of the same names) give
    this call's bias, memory keys at 0; with a right-padded mask the real positions agree too."""
    theirs, ours = _pair(dict(num_mem_kv=2), causal=True)
    a, b = _bias_modules()[kind]
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    torch.testing.assert_close(ours(x, rel_pos=b, mask=mask)[mask], theirs(x, rel_pos=a, mask=mask)[mask],
                               atol=1e-5, rtol=1e-5)
    if kind == "alibi":  # custom positions
        pos = torch.arange(5)[None].expand(2, 5).float() * 2
        torch.testing.assert_close(ours(x, rel_pos=b, pos=pos), theirs(x, rel_pos=a, pos=pos), atol=1e-5, rtol=1e-5)


def test_rel_pos_bad_calls_are_named():
    _, ours = _pair({})
    a, b = _bias_modules()["t5"]
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="pos"):
        ours(x, pos=torch.arange(3)[None].float())
    with pytest.raises(TypeError, match="AlibiPositionalBias"):
        ours(x, rel_pos=b, pos=torch.arange(3)[None].float())
    with pytest.raises(ValueError, match="rel_pos or attn_bias"):
        ours(x, rel_pos=b, attn_bias=torch.zeros(1, 2, 3, 3))
    with pytest.raises(TypeError, match="rel_pos"):
        ours(x, rel_pos=3)


def test_context_rotary_pos_emb_as_x_transformers():
    """Rotary cross-attention of ``Attention`` alone: the queries rotated by ``rotary_pos_emb``, the context's keys by
    ``context_rotary_pos_emb`` (x-transformers needs both); a padded context key reaches nothing."""
    theirs, ours = _pair({})
    rot = xt.x_transformers.RotaryEmbedding(8)
    g = torch.Generator().manual_seed(4)
    x, ctx = torch.randn(2, 5, 16, generator=g), torch.randn(2, 4, 16, generator=g)
    cmask = torch.tensor([[True] * 4, [True] * 2 + [False] * 2])
    fq, fk = rot(torch.arange(5).float() + 4), rot(torch.arange(4).float())
    kw = dict(context=ctx, context_mask=cmask, rotary_pos_emb=fq, context_rotary_pos_emb=fk)
    torch.testing.assert_close(ours(x, **kw), theirs(x, **kw), atol=1e-5, rtol=1e-5)
    planted = ctx.clone()
    planted[~cmask] = float("nan")
    assert torch.isfinite(ours(x, **dict(kw, context=planted))).all()
    with pytest.raises(ValueError, match="context_rotary_pos_emb"):
        ours(x, context=ctx, rotary_pos_emb=fq)
    with pytest.raises(ValueError, match="context_rotary_pos_emb"):
        ours(x, rotary_pos_emb=fq, context_rotary_pos_emb=fk)
