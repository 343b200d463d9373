"""Test-time-trained modules (``XLAutoregressiveWrapper``'s ``TTTModuleWrapper``) on the static decode step.

What must hold: a ``TransformerWrapper`` whose modules an ``XLAutoregressiveWrapper`` wrapped for test-time training
(plain paths, a low-rank path, the head), holding per-sample fast weights its ``generate`` trained on a prompt, runs
on the static step (``static_reason`` None), and ``net(new, cache=static)`` computes what the dynamic ``KVCache``
computes (float64: 1e-10) with left-padded prompts and NaN planted in the padded slots; the fast weights are read
(not the shared parameters); generation gives the dynamic cache's tokens and does run the step; a token id outside
the vocabulary fed to the step raises the dynamic cache's ``ValueError`` (the wrapped head's width is unknown to
the step: it records instead of asserting).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_static_cache import _count_static_steps, _plant

import safeformer as sf
from safeformer.decoding.static import StaticStep, build_static_cache, static_reason
from safeformer.decoding.xl import TTTModuleWrapper, XLAutoregressiveWrapper

V, D, B = 23, 16, 3
PATHS = ("attn_layers.layers.0.1.to_v", "attn_layers.layers.1.1.ff.0.0", "attn_layers.layers.2.1.to_q", "to_logits")
LOW_RANK = (("attn_layers.layers.2.1.to_k", 4),)


def _trained(dtype=torch.float64):
    """An XL wrapper with test-time-trained modules whose ``generate`` left per-sample fast weights (a different
    prompt per sample: different fast weights), and its net in evaluation."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, max_mem_len=8, attn_layers=sf.Decoder(
        dim=D, depth=2, heads=2, dim_head=8, rotary_pos_emb=True))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    xl = XLAutoregressiveWrapper(net, tbptt_steps=2, ttt_module_paths=PATHS, ttt_low_rank_paths=LOW_RANK,
                                 ttt_lr=0.5).to(dtype)
    with torch.no_grad():  # (the low-rank factor starting at 0 moved too, so that it counts)
        xl.ttt_wrappers[LOW_RANK[0][0]].module.weight_b.normal_(std=0.3)
    prompt = torch.randint(0, V, (B, 21), generator=torch.Generator().manual_seed(1))
    xl.generate(prompt, 2, temperature=0.0)  # the prompt trains the fast weights (two segments)
    return xl, net.eval()


def _prompts():
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, V, (B, 6), generator=g)
    mask = torch.arange(6)[None] >= torch.tensor([0, 3, 1])[:, None]  # left padding
    return prompts, mask, torch.randint(0, V, (B, 5), generator=g)


def _teacher_forced(net, prompts, mask, feed, poison=None):
    with torch.no_grad():
        _, cache = net(prompts, mask=mask, return_cache=True)
        dyn, c = [], cache
        for t in range(feed.shape[1]):
            out, c = net(feed[:, t:t + 1], cache=c, return_cache=True)
            dyn.append(out[:, -1])
        if poison is not None:
            cache = poison(cache)
        static = build_static_cache(net, cache, cache.length + feed.shape[1])
        stat = [net(feed[:, t:t + 1], cache=static)[:, -1] for t in range(feed.shape[1])]
    return torch.stack(dyn, 1), torch.stack(stat, 1)


def test_fast_weights_step_equals_dynamic_float64_left_padded_nan():
    xl, net = _trained()
    wrappers = xl.ttt_wrappers
    assert len(wrappers) == len(PATHS) + len(LOW_RANK)
    assert all(w.batch_params is not None for w in wrappers.values())
    w = wrappers[PATHS[0]].batch_params["weight"]  # per sample, trained off the shared weight
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[0], wrappers[PATHS[0]].module.weight)
    assert static_reason(net) is None, static_reason(net)
    prompts, mask, feed = _prompts()
    dyn, stat = _teacher_forced(net, prompts, mask, feed, poison=_plant(math.nan))
    assert torch.isfinite(stat).all()
    assert float((stat - dyn).abs().max()) < 1e-10
    # the step read the fast weights: the shared parameters alone give other logits
    TTTModuleWrapper.reset_all(xl)
    plain, _ = _teacher_forced(net, prompts, mask, feed)
    assert float((plain - stat).abs().max()) > 1e-3


def test_fast_weights_static_cache_holds_no_plan_of_a_wrapped_module():
    """The wrapped projections are no ``nn.Linear``: no fused q/k/v weights (the step calls the attention's seams,
    hence the wrappers), no feed-forward plan (the feed-forward is called)."""
    _, net = _trained()
    prompts, mask, _ = _prompts()
    with torch.no_grad():
        _, cache = net(prompts, mask=mask, return_cache=True)
    static = build_static_cache(net, cache, cache.length + 1)
    attn_plans = [sl.plan for sl in static.layers if sl is not None]
    assert attn_plans[0].fused is None and attn_plans[1].fused is None  # blocks 0 (to_v) and 2 (to_q, to_k)
    assert static.block_plans[1].ff is None  # block 1: its proj_in wrapped
    assert static.token_range == V  # the wrapped head's width is unknown: ids recorded


def test_fast_weights_generation_same_tokens_static_and_dynamic(monkeypatch):
    _, net = _trained(torch.float32)
    model = sf.AutoregressiveWrapper(net)
    prompts, mask, _ = _prompts()
    calls = _count_static_steps(monkeypatch)
    static = model.generate(prompts, 8, temperature=0.0, mask=mask)
    assert calls[0] > 0, "the static step did not run"
    n = calls[0]
    dynamic = model.generate(prompts, 8, temperature=0.0, mask=mask, static_cache=False)
    assert calls[0] == n and torch.equal(static, dynamic)


def test_fast_weights_bad_token_raises_the_dynamic_error():
    _, net = _trained()
    prompts, mask, _ = _prompts()
    bad = torch.tensor([[1], [V + 2], [0]])
    with torch.no_grad():
        _, cache = net(prompts, mask=mask, return_cache=True)
        with pytest.raises(ValueError, match="outside the vocabulary") as dyn:
            net(bad, cache=cache)
        step = StaticStep(net, cache, cache.length + 1)
        step.step(bad)
        with pytest.raises(ValueError, match="outside the vocabulary") as stat:
            step.check_tokens()
    assert str(stat.value) == str(dyn.value)
