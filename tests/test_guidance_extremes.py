"""Guidance at any finite scale: finite results, the conditional answer where the branches agree, the
saturated answer (the order of ``s * (cond - uncond)``) where the formula would overflow, and one rule for
NaN in a branch whatever its scale (docs/safety.md, "Guidance at any scale").

Shape legend: b batch, v vocabulary, d features.
"""

from __future__ import annotations

import pytest
import torch
from helpers import examples
from hypothesis import given
from hypothesis import strategies as st

import safeformer as sf
from safeformer.core.conditions import compose_values

HUGE = (3.0e38, 1e39, 1e150, 1e300, -1e39, -1e300)


def _logits(b=5, v=12, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(b, v, generator=g) * 4).to(dtype)
    c = (u.double() + torch.randn(b, v, generator=g, dtype=torch.float64)).to(dtype)
    c[0] = u[0]  # row 0: the branches agree
    return u, c


@pytest.mark.parametrize("scale", HUGE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_compose_guidance_at_huge_scales_is_finite_and_keeps_the_order(scale, dtype):
    u, c = _logits(dtype=dtype)
    out = sf.compose_guidance(u, {"joint": c}, {"joint": scale})
    assert torch.isfinite(out).all(), f"scale {scale}: {out}"
    assert torch.equal(out[0], c[0].to(out.dtype)), "branches that agree give the conditional answer at any scale"
    direction = (c.double() - u.double()) * (1 if scale > 0 else -1)
    rows = slice(1, None)
    assert torch.equal(out[rows].argmax(-1), direction[rows].argmax(-1)), "the saturated order is that of s * (c - u)"
    probs = out.softmax(-1)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(5, dtype=probs.dtype))


@given(st.floats(min_value=-1e308, max_value=1e308, allow_nan=False, allow_infinity=False),
       st.integers(min_value=0, max_value=2**16))
@examples(2)
def test_compose_guidance_any_finite_scale(scale, seed):
    """Hypothesis: every finite scale gives finite logits; agreeing rows are unchanged; a moderate scale
    equals the float64 formula."""
    u, c = _logits(seed=seed)
    banned = torch.zeros_like(u, dtype=torch.bool)
    banned[2, 3] = True
    c = c.masked_fill(banned, float("-inf"))
    out = sf.compose_guidance(u, {"joint": c}, {"joint": scale})
    assert not torch.isnan(out).any() and torch.isfinite(out[~banned]).all()
    if scale != 0:  # a token banned in a branch taking part stays banned (at scale 0 the branch takes no part)
        assert torch.equal(out[banned], torch.full((1,), float("-inf")))
    assert torch.equal(out[0], c[0])
    assert torch.equal(sf.guided_logits(c, u, scale)[banned], torch.full((1,), float("-inf")))
    if abs(scale) < 1e30:
        ref = u.double() + scale * (c.double() - u.double())
        live = ~banned
        torch.testing.assert_close(out[live].double(), ref[live], rtol=2e-6, atol=2e-6 * max(1.0, abs(scale)))


@pytest.mark.parametrize("scale", [0.0, 1.0, 3.0, 1e39])
def test_nan_in_a_branch_is_refused_at_every_scale(scale):
    """One rule: NaN (or +inf) in any branch given is a clear error, whether or not its scale reads it."""
    u, c = _logits()
    c[1, 2] = float("nan")
    with pytest.raises(ValueError, match="joint logits hold NaN"):
        sf.compose_guidance(u, {"joint": c, "other": u.clone()}, {"joint": scale, "other": 1.0})
    with pytest.raises(ValueError, match="NaN"):
        sf.guided_logits(c, u, scale)
    u2 = u.clone()
    u2[0, 0] = float("inf")
    with pytest.raises(ValueError, match="uncond logits hold NaN or \\+inf"):
        sf.compose_guidance(u2, {"joint": u}, {"joint": scale})


def _model(seed=0):
    torch.manual_seed(seed)
    net = sf.TransformerWrapper(num_tokens=17, max_seq_len=32, attn_layers=sf.Decoder(
        dim=16, depth=1, heads=2, dim_head=8, cross_attend=True, rotary_pos_emb=True))
    return sf.AutoregressiveWrapper(net).eval()


@pytest.mark.parametrize("scale", [1e39, 1e300, -1e39])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=0.7, filter_logits_fn="top_k", filter_kwargs={"k": 5})])
def test_generation_at_huge_scales(scale, sampling):
    """Tokens are valid ids, never all 0 from a NaN; a sample whose context is dropped (its branches agree)
    gets exactly the tokens of plain conditional sampling, greedy and sampled (same seed)."""
    model = _model()
    prompts = torch.randint(0, 17, (3, 4), generator=torch.Generator().manual_seed(1))
    ctx = torch.randn(3, 5, 16)
    ctx_mask = torch.ones(3, 5, dtype=torch.bool)
    ctx_mask[1] = False  # sample 1: no context, so conditional == unconditional
    torch.manual_seed(5)
    guided = model.generate(prompts, 8, context=ctx, context_mask=ctx_mask, cond_scale=scale, **sampling)
    assert guided.shape == (3, 8) and bool(((guided >= 0) & (guided < 17)).all())
    torch.manual_seed(5)
    plain = model.generate(prompts, 8, context=ctx, context_mask=ctx_mask, cond_scale=1.0, **sampling)
    assert torch.equal(guided[1], plain[1]), f"agreeing branches at scale {scale}: {guided[1]} vs {plain[1]}"
    if sampling["temperature"] == 0.0:  # greedy: the saturated answer is the argmax of s * (cond - uncond)
        logits = model.next_token_logits(prompts, context=ctx, context_mask=ctx_mask, cond_scale=scale)
        assert torch.isfinite(logits).all()
        cond = model.next_token_logits(prompts, context=ctx, context_mask=ctx_mask, cond_scale=1.0)
        uncond = model.next_token_logits(prompts, context=ctx, context_mask=ctx_mask, cond_scale=0.0)
        want = ((cond.double() - uncond.double()) * (1 if scale > 0 else -1)).argmax(-1)
        assert torch.equal(guided[[0, 2], 0], want[[0, 2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [1e39, 1e300, -1e300])
def test_continuous_guidance_saturates(dtype, scale):
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(dim_in=4, dim_out=8, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=1, heads=2, dim_head=8, cross_attend=True)).to(dtype)
    model = sf.ContinuousAutoregressiveWrapper(net, probabilistic=True).eval()
    start = torch.randn(2, 3, 4, dtype=dtype)
    ctx = torch.randn(2, 5, 16, dtype=dtype)
    ctx_mask = torch.ones(2, 5, dtype=torch.bool)
    ctx_mask[1] = False
    for temperature in (0.0, 1.0):
        out = model.generate(start, 4, context=ctx, context_mask=ctx_mask, cond_scale=scale, temperature=temperature)
        assert torch.isfinite(out).all(), f"{dtype} scale {scale}: {out}"
    torch.manual_seed(3)
    guided = model.generate(start, 4, context=ctx, context_mask=ctx_mask, cond_scale=scale, temperature=0.0)
    plain = model.generate(start, 4, context=ctx, context_mask=ctx_mask, cond_scale=1.0, temperature=0.0)
    torch.testing.assert_close(guided[1], plain[1]), "agreeing branches: the conditional value"
    u = torch.randn(3, 6)
    v = compose_values(u, {"joint": u + 1}, {"joint": scale})
    assert torch.isfinite(v).all()
