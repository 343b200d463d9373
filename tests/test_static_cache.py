"""The static KV cache and the decode step on it: the net's own forward at one position (``decode_step.py``).

What must hold: ``net(new, cache=static)`` computes what the net's ``forward`` with a dynamic ``KVCache``
computes (float64: to rounding; every dtype: to its tolerance against float64), for every option it
runs; the generation APIs give the same tokens with and without it (plain, padded context, left-padded
prompts, CFG with two and three branches, beam search, the continuous wrapper, compiled); NaN/inf planted
in the masked slots of the cache it is built from, or written by a kernel into dead rows, never reach an
output; nets it cannot run fall back to the dynamic cache; errors are named.
"""

from __future__ import annotations

import math

import helpers as hp
import pytest
import torch

import safeformer as sf
from safeformer.decoding.generation import beam_search_tokens
from safeformer.decoding.static import StaticStep, build_static_cache, capacity_bucket, compile_options, static_reason

V, DIM, J = 23, 32, 3


def _net(**layer_kw):
    wrapper_kw = {k: layer_kw.pop(k) for k in ("tie_embedding", "l2norm_embed", "num_memory_tokens", "logits_dim") if k in layer_kw}
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=sf.Decoder(dim=DIM, depth=2, heads=4, dim_head=8, **layer_kw),
                                **wrapper_kw)
    with torch.no_grad():  # off the init: non-trivial norms, biases, null condition
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return net.eval()


def _inputs(b: int = 3, n: int = 6, *, left_pad=False, context=None, dead_context=False, condition=False,
            prefix=False, g=None):
    g = torch.Generator().manual_seed(1) if g is None else g
    kw = {}
    prompts = torch.randint(0, V, (b, n), generator=g)
    mask = None
    if left_pad:
        lens = torch.tensor([n, 2, 4][:b])
        mask = torch.arange(n)[None] >= (n - lens[:, None])
        kw["mask"] = mask
    if context is not None:
        kw["context"] = torch.randn(b, context, DIM, generator=g, dtype=torch.float64)
        if context:
            cm = torch.rand(b, context, generator=g) > 0.3
            cm[:, 0] = True
            if dead_context:
                cm[-1] = False  # a dropped condition: a dead cross-attention row in every step
            kw["context_mask"] = cm
    if condition:
        kw["condition"] = torch.randn(b, 8, generator=g, dtype=torch.float64)
        kw["condition_mask"] = torch.tensor([True, False, True][:b])
    if prefix:
        kw["prepend_embeds"] = torch.randn(b, 2, DIM, generator=g, dtype=torch.float64)
        kw["prepend_mask"] = torch.tensor([[True, True], [False, True], [False, False]][:b])
    return prompts, kw


# (name, layer / wrapper options, input options)
CONFIGS = [
    ("rotary", dict(rotary_pos_emb=True), dict()),
    ("rotary partial, left padding", dict(rotary_pos_emb=True, rotary_emb_dim=4), dict(left_pad=True)),
    ("alibi, left padding", dict(alibi_pos_bias=True), dict(left_pad=True)),
    ("absolute positions, memory tokens", dict(num_memory_tokens=2), dict(left_pad=True)),
    ("cross, dropped context, bias, gqa, qk norm", dict(rotary_pos_emb=True, cross_attend=True, attn_bias=True, kv_heads=2,
                                                       attn_qk_norm=True), dict(context=J, dead_context=True)),
    ("cross, zero-length context", dict(rotary_pos_emb=True, cross_attend=True), dict(context=0)),
    ("adaptive rmsnorm + layerscale", dict(rotary_pos_emb=True, use_adaptive_rmsnorm=True, use_adaptive_layerscale=True,
                                           dim_condition=8), dict(condition=True)),
    ("adaptive layernorm, cross, prefix", dict(rotary_pos_emb=True, use_adaptive_layernorm=True, dim_condition=8,
                                               cross_attend=True), dict(condition=True, context=J, prefix=True)),
    ("glu, rmsnorm, tied, l2norm embed", dict(rotary_pos_emb=True, ff_glu=True, ff_swish=True, use_rmsnorm=True,
                                              tie_embedding=True, l2norm_embed=True), dict(left_pad=True)),
]


def _cast(kw: dict, dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}


def _dynamic_and_static(net, prompts, kw, steps: int, dtype=torch.float64, poison=None):
    """Teacher-forced next-token logits of ``steps`` positions: the dynamic cache's and the static step's."""
    net = net.to(dtype)
    kw = _cast(kw, dtype)
    g = torch.Generator().manual_seed(5)
    feed = torch.randint(0, V, (prompts.shape[0], steps), generator=g)
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw)
        dyn, c = [], cache
        for t in range(steps):
            lg, c = net(feed[:, t:t + 1], cache=c, return_cache=True)
            dyn.append(lg[:, -1])
        if poison is not None:
            cache = poison(cache)
        static = build_static_cache(net, cache, cache.length + steps)
        stat = [net(feed[:, t:t + 1], cache=static)[:, -1] for t in range(steps)]
    return torch.stack(dyn, 1), torch.stack(stat, 1)


def _assert_step_equals_dynamic(net, input_kw: dict, steps: int, perturb: bool = False) -> None:
    """``net`` runs on the step (``static_reason`` None) and its logits equal the dynamic cache's (float64, 1e-10);
    ``perturb``: parameters moved off their init first, so that a part the step skipped would show."""
    if perturb:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    assert static_reason(net) is None, static_reason(net)
    prompts, kw = _inputs(**input_kw)
    dyn, stat = _dynamic_and_static(net, prompts, kw, steps=steps)
    assert float((stat - dyn).abs().max()) < 1e-10


@pytest.mark.parametrize("name,layer_kw,input_kw", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_static_step_equals_dynamic_cache_float64(name, layer_kw, input_kw):
    net = _net(**dict(layer_kw))
    prompts, kw = _inputs(**input_kw)
    assert static_reason(net) is None, name
    dyn, stat = _dynamic_and_static(net, prompts, kw, steps=5)
    hp.assert_close(stat, dyn, f"static step logits ({name})")
    assert float((stat - dyn).abs().max()) < 1e-10


FAST_CONFIGS = CONFIGS + [
    ("value rmsnorm, gqa, bias", dict(rotary_pos_emb=True, attn_value_rmsnorm=True, kv_heads=2, attn_bias=True), dict()),
    ("gated values (the output seam)", dict(rotary_pos_emb=True, attn_gate_values=True), dict(left_pad=True)),
    ("cross, gated values, bias, dropped context", dict(rotary_pos_emb=True, cross_attend=True, attn_gate_values=True,
                                                        attn_bias=True), dict(context=J, dead_context=True)),
    ("geglu feed-forward (the module)", dict(rotary_pos_emb=True, ff_glu=True), dict()),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,layer_kw,input_kw", FAST_CONFIGS, ids=[c[0] for c in FAST_CONFIGS])
def test_fast_plan_equals_the_seams_bit_for_bit(name, layer_kw, input_kw, dtype):
    """The attention's step plan (one fused q/k/v product, q and k rotated together, the plain query and output
    projections as functions) computes what its seams (``_project_q``, ``_project_kv``, ``_output``) compute, bit
    for bit; attentions with options the plan does not cover keep the seams."""
    net = _net(**dict(layer_kw)).to(dtype)
    prompts, kw = _inputs(**input_kw)
    kw = _cast(kw, dtype)
    feed = torch.randint(0, V, (prompts.shape[0], 5), generator=torch.Generator().manual_seed(5))
    outs = {}
    with torch.no_grad():
        for fast in (True, False):
            _, cache = net(prompts, return_cache=True, **kw)
            static = build_static_cache(net, cache, cache.length + 5, fast=fast)
            outs[fast] = torch.stack([net(feed[:, t:t + 1], cache=static)[:, -1] for t in range(5)], 1)
            if fast:
                plan = [None if slots is None else slots.plan for slots in static.layers]
    assert torch.isfinite(outs[True]).all()
    assert torch.equal(outs[True], outs[False]), name
    kinds = [blk.kind for blk in net.attn_layers.layers]
    fused = [p.fused is not None for p, k in zip(plan, kinds) if k == "self"]
    assert all(fused), name  # every config here has plain q/k/v projections
    plain_out = [p.plain_out for p, k in zip(plan, kinds) if k != "ff" and p is not None]
    assert all(plain_out) != ("gated" in name), name
    assert all(p.plain_q for p, k in zip(plan, kinds) if k == "cross" and p is not None), name


FLAT_CONFIGS = [
    ("rotary, cross, dropped context", dict(rotary_pos_emb=True, cross_attend=True, attn_bias=True),
     dict(context=J, dead_context=True)),
    ("alibi, left padding", dict(alibi_pos_bias=True), dict(left_pad=True)),
    ("adaptive norms and layerscale", dict(rotary_pos_emb=True, use_adaptive_layernorm=True, use_adaptive_layerscale=True,
                                           dim_condition=8), dict(condition=True)),
    ("macaron, sandwich norm, geglu, layerscale", dict(rotary_pos_emb=True, macaron=True, sandwich_norm=True, ff_glu=True,
                                                       use_layerscale=True), dict(left_pad=True)),
    ("rmsnorm (its own call), silu ff", dict(rotary_pos_emb=True, use_rmsnorm=True, ff_swish=True), dict()),
    ("repeated blocks", dict(rotary_pos_emb=True, cross_attend=True, layers_execute_order=(1, 0, 1, 2)), dict(context=J)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,layer_kw,input_kw", FLAT_CONFIGS, ids=[c[0] for c in FLAT_CONFIGS])
def test_flat_program_equals_the_block_loop_bit_for_bit(name, layer_kw, input_kw, dtype):
    """A net without hooks whose blocks share nothing but the stream runs the step as one flat program (``program``:
    the norms, attention steps, feed-forward functions and residual adds without the per-block dispatch): the same
    bits as the general block loop, and the dynamic cache's logits; the final norm's kept gain too."""
    net = _net(**dict(layer_kw)).to(dtype)
    prompts, kw = _inputs(**input_kw)
    kw = _cast(kw, dtype)
    feed = torch.randint(0, V, (prompts.shape[0], 4), generator=torch.Generator().manual_seed(5))
    outs = {}
    with torch.no_grad():
        for flat in (True, False):
            _, cache = net(prompts, return_cache=True, **kw)
            static = build_static_cache(net, cache, cache.length + 4)
            assert static.program is not None, name
            if not flat:
                static.program = static.final_norm = None
            outs[flat] = torch.stack([net(feed[:, t:t + 1], cache=static)[:, -1] for t in range(4)], 1)
            assert static.reads_positions == ("alibi" in name)
    assert torch.isfinite(outs[True]).all()
    assert torch.equal(outs[True], outs[False]), name
    if dtype == torch.float64:  # (the same fed tokens: _dynamic_and_static draws them with the same seed)
        dyn, _ = _dynamic_and_static(net, prompts, kw, steps=4)
        assert float((outs[True] - dyn).abs().max()) < 1e-10


@pytest.mark.parametrize("option", [dict(residual_attn=True), dict(num_residual_streams=2), dict(add_value_residual=True)],
                         ids=["residual attention", "hyper-connections", "value residual"])
def test_options_threading_state_between_blocks_keep_the_block_loop(option):
    """Residual attention's logits, the residual streams and a value residual pass from block to block: no flat program
    (the general loop runs them); a net with a forward hook gets no plan at all."""
    net = _net(rotary_pos_emb=True, **option)
    prompts, _ = _inputs()
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True)
        assert build_static_cache(net, cache, cache.length + 1).program is None
        plain = _net(rotary_pos_emb=True)
        _, cache = plain(prompts, return_cache=True)
        handle = plain.attn_layers.final_norm.register_forward_hook(lambda *a: None)
        try:
            static = build_static_cache(plain, cache, cache.length + 1)
        finally:
            handle.remove()
        assert static.program is None and static.block_plans is None and static.final_norm is None


def test_fast_plan_keeps_latent_projections_on_the_seams():
    net = _net(rotary_pos_emb=True, attn_use_latent_q=True, attn_dim_latent_q=16)
    prompts, kw = _inputs()
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw)
        static = build_static_cache(net, cache, cache.length + 2)
    assert all(s.plan.fused is None for s, blk in zip(static.layers, net.attn_layers.layers) if blk.kind == "self")


@pytest.mark.parametrize("dtype", hp.dtypes_for("cpu"), ids=str)
@pytest.mark.parametrize("name,layer_kw,input_kw", [CONFIGS[1], CONFIGS[4], CONFIGS[7]], ids=[CONFIGS[i][0] for i in (1, 4, 7)])
def test_static_step_in_every_dtype_against_float64(name, layer_kw, input_kw, dtype):
    """In float32 / bfloat16 / float16 the static step is as accurate as the dtype allows (against the float64
    dynamic cache on the same weights, the same fed tokens)."""
    prompts, kw = _inputs(**input_kw)
    ref, _ = _dynamic_and_static(_net(**dict(layer_kw)), prompts, kw, steps=4)
    _, stat = _dynamic_and_static(_net(**dict(layer_kw)), prompts, kw, steps=4, dtype=dtype)
    hp.assert_close(stat.double(), ref, f"static step logits in {dtype} ({name})", dtype)


def _plant(value: float):
    """Put ``value`` into every masked slot of a cache: prompt padding and masked context keys/values."""

    def poison(cache):
        for k, v in cache.self_kv:
            if cache.mask is not None:
                k.masked_fill_(~cache.mask[:, None, :, None], value)
                v.masked_fill_(~cache.mask[:, None, :, None], value)
        if cache.cross_kv is not None and cache.context_mask is not None:
            for k, v in cache.cross_kv:
                k.masked_fill_(~cache.context_mask[:, None, :, None], value)
                v.masked_fill_(~cache.context_mask[:, None, :, None], value)
        return cache

    return poison


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_masked_cache_slots_never_reach_the_output(value):
    """NaN/inf in the masked slots of the cache the static one is built from (left padding of the prompt,
    masked and dropped context keys) changes no output bit."""
    net = _net(rotary_pos_emb=True, cross_attend=True, attn_bias=True)
    prompts, kw = _inputs(left_pad=True, context=J, dead_context=True)
    _, clean = _dynamic_and_static(net, prompts, kw, steps=4, dtype=torch.float32)
    _, poisoned = _dynamic_and_static(net, prompts, kw, steps=4, dtype=torch.float32, poison=_plant(value))
    hp.assert_bitwise(poisoned, clean, "static step under planted masked slots")


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_kernel_writing_nan_into_dead_rows_changes_nothing(bias):
    """S6 on the static step: a kernel that writes NaN into the rows it is told are dead (the samples whose
    context is dropped, in cross-attention) and into keyless rows leaves the outputs bit for bit."""
    net = _net(rotary_pos_emb=True, cross_attend=True, attn_bias=bias)
    prompts, kw = _inputs(left_pad=True, context=J, dead_context=True)
    dead = ~kw["context_mask"].any(1)

    def told(q, k, v, attn_mask):
        return dead[:, None, None] if k.shape[2] == J and q.shape[0] == dead.shape[0] else None

    with sf.testing.substitute_kernel(hp.faithful_kernel()):
        _, clean = _dynamic_and_static(net, prompts, kw, steps=4, dtype=torch.float32)
    kernel = hp.NaNKernel(told)
    with sf.testing.substitute_kernel(kernel):
        _, poisoned = _dynamic_and_static(net, prompts, kw, steps=4, dtype=torch.float32)
    assert kernel.poisoned > 0, "the NaN kernel never saw a dead row: the test would prove nothing"
    hp.assert_bitwise(poisoned, clean, "static step under the NaN kernel")


def _eager_and_fixed_steps(net, prompts, kw: dict, feed, **build_kw) -> list[tuple]:
    """``feed (B, T)`` decoded one id at a time on a fresh static cache of ``net``'s prefill, eagerly and then on fixed
    shapes compiled as one graph (``fullgraph=True``, eager backend): per mode ``(outputs (B, T, ...), static)``."""
    torch._dynamo.reset()
    runs = []
    with torch.no_grad():
        for fixed in (False, True):
            _, cache = net(prompts, return_cache=True, **kw)
            static = build_static_cache(net, cache, cache.length + feed.shape[1], fixed=fixed, **build_kw)
            fn = torch.compile(net, fullgraph=True, dynamic=False, backend="eager") if fixed else net
            step = []
            for t in range(feed.shape[1]):
                step.append(fn(feed[:, t:t + 1], cache=static)[:, -1])
                static.length += 1 if fixed else 0  # (the compiled step advances the slot tensor, not the count)
            runs.append((torch.stack(step, 1), static))
    return runs


def _count_static_steps(monkeypatch) -> list[int]:
    calls = [0]
    orig = StaticStep.step

    def step(self, new):
        calls[0] += 1
        return orig(self, new)

    monkeypatch.setattr(StaticStep, "step", step)
    return calls


GEN_CASES = [
    ("plain", dict(rotary_pos_emb=True), dict(), {}),
    ("padded context", dict(rotary_pos_emb=True, cross_attend=True), dict(context=J, dead_context=True), {}),
    ("left-padded prompts", dict(rotary_pos_emb=True), dict(left_pad=True), {}),
    ("CFG 2 branches", dict(rotary_pos_emb=True, cross_attend=True), dict(context=J), dict(cond_scale=3.0)),
    ("CFG 3 branches", dict(rotary_pos_emb=True, cross_attend=True, use_adaptive_layernorm=True, dim_condition=8),
     dict(context=J, condition=True, left_pad=True), dict(cond_scale={"context": 2.0, "condition": 1.5})),
    ("CFG rescale, logprobs, eos", dict(alibi_pos_bias=True, cross_attend=True), dict(context=J, left_pad=True),
     dict(cond_scale=2.0, guidance_rescale=0.5, guidance_space="logprobs", eos_token=3)),
]


@pytest.mark.parametrize("name,layer_kw,input_kw,gen_kw", GEN_CASES, ids=[c[0] for c in GEN_CASES])
def test_generate_same_tokens_static_and_dynamic(name, layer_kw, input_kw, gen_kw, monkeypatch):
    model = sf.AutoregressiveWrapper(_net(**dict(layer_kw)).float())
    prompts, kw = _inputs(**input_kw)
    kw = _cast(kw, torch.float32)
    calls = _count_static_steps(monkeypatch)
    static = model.generate(prompts, 12, temperature=0.0, **kw, **gen_kw)
    assert calls[0] > 0, "the static step did not run"
    n = calls[0]
    dynamic = model.generate(prompts, 12, temperature=0.0, static_cache=False, **kw, **gen_kw)
    assert calls[0] == n, "static_cache=False still ran the static step"
    assert torch.equal(static, dynamic), name


def test_sampling_with_filters_same_draws_static_and_dynamic():
    model = sf.AutoregressiveWrapper(_net(rotary_pos_emb=True, cross_attend=True).float())
    prompts, kw = _inputs(context=J)
    kw = _cast(kw, torch.float32)
    outs = []
    for static in (True, False):
        torch.manual_seed(7)
        outs.append(model.generate(prompts, 10, temperature=0.8, filter_logits_fn="top_p", filter_kwargs={"p": 0.9},
                                   cond_scale=2.0, static_cache=static, **kw))
    assert torch.equal(*outs)


def test_beam_search_same_beams_static_and_dynamic(monkeypatch):
    net = _net(rotary_pos_emb=True, cross_attend=True).float()
    prompts, kw = _inputs(context=J, left_pad=True)
    kw = _cast(kw, torch.float32)
    calls = _count_static_steps(monkeypatch)
    tok_s, score_s = beam_search_tokens(net, prompts, 6, beams=3, cond_scale=2.0, **kw)
    assert calls[0] > 0
    monkeypatch.setattr("safeformer.decoding.decode.static_reason", lambda net: "off for the comparison")
    tok_d, score_d = beam_search_tokens(net, prompts, 6, beams=3, cond_scale=2.0, **kw)
    assert torch.equal(tok_s, tok_d)
    hp.assert_close(score_s, score_d, "beam scores")


def test_continuous_generation_static_equals_dynamic(monkeypatch):
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(dim_in=5, dim_out=5, max_seq_len=32,
                                          attn_layers=sf.Decoder(dim=DIM, depth=2, heads=4, dim_head=8, rotary_pos_emb=True,
                                                                 cross_attend=True))
    model = sf.ContinuousAutoregressiveWrapper(net).eval()
    g = torch.Generator().manual_seed(2)
    start = torch.randn(3, 4, 5, generator=g)
    mask = torch.tensor([[True] * 4, [False, False, True, True], [False, True, True, True]])
    ctx = torch.randn(3, J, DIM, generator=g)
    cm = torch.tensor([[True, True, False], [False] * 3, [True, False, False]])
    calls = _count_static_steps(monkeypatch)
    static = model.generate(start, 6, mask=mask, context=ctx, context_mask=cm, cond_scale=2.0)
    assert calls[0] > 0
    monkeypatch.setattr("safeformer.decoding.decode.static_reason", lambda net: "off for the comparison")
    dynamic = model.generate(start, 6, mask=mask, context=ctx, context_mask=cm, cond_scale=2.0)
    hp.assert_close(static, dynamic, "continuous values, static vs dynamic")
    assert float((static - dynamic).abs().max()) < 1e-5


def test_probabilistic_continuous_head_runs_on_the_step():
    """x-transformers' probabilistic head (``probabilistic=True``): the step reads it out as the forward does,
    ``stack((mean, variance)) (2, B, 1, d)``, the dynamic cache's values (float64, 1e-10) with left-padded inputs, a
    padded context and NaN planted in the padded input rows; ``StaticStep`` returns the new position ``(2, B, d)``."""
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(dim_in=5, dim_out=5, max_seq_len=32, probabilistic=True, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=4, dim_head=8, rotary_pos_emb=True, cross_attend=True)).double().eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert static_reason(net) is None
    g = torch.Generator().manual_seed(2)
    start = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True] * 4, [False, False, True, True], [False, True, True, True]])
    start[~mask] = math.nan
    ctx = torch.randn(3, J, DIM, generator=g, dtype=torch.float64)
    cm = torch.tensor([[True, True, False], [False] * 3, [True, False, False]])
    feed = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    with torch.no_grad():
        out, cache = net(start, mask=mask, context=ctx, context_mask=cm, return_cache=True)
        assert out.shape == (2, 3, 4, 5)
        dyn, c = [], cache
        for t in range(4):
            o, c = net(feed[:, t:t + 1], cache=c, return_cache=True)
            dyn.append(o[:, :, -1])
        step = StaticStep(net, cache, cache.length + 4)
        stat = [step.step(feed[:, t:t + 1]) for t in range(4)]
    dyn, stat = torch.stack(dyn, 2), torch.stack(stat, 2)
    assert stat.shape == (2, 3, 4, 5) and torch.isfinite(stat).all() and bool((stat[1] > 0).all())
    assert float((stat - dyn).abs().max()) < 1e-10


@pytest.mark.parametrize("option", [dict(attn_hybrid_module=torch.nn.GRU(DIM, DIM, batch_first=True),
                                         attn_hybrid_fold_axial_dim=2)], ids=["folded hybrid module"])
def test_options_the_step_does_not_run_fall_back_to_the_dynamic_cache(option, monkeypatch):
    net = _net(rotary_pos_emb=True, **option)
    assert static_reason(net) is not None
    calls = _count_static_steps(monkeypatch)
    model = sf.AutoregressiveWrapper(net)
    prompts, _ = _inputs()
    a = model.generate(prompts, 5, temperature=0.0)
    b = model.generate(prompts, 5, temperature=0.0, cache_kv=False)
    assert calls[0] == 0 and torch.equal(a, b)


EXPLICIT_OPTIONS = [dict(attn_softclamp_logits=True), dict(attn_sigmoid=True), dict(attn_sparse_topk=2),
                    dict(attn_pre_talking_heads=True, attn_post_talking_heads=True), dict(attn_laser=True),
                    dict(attn_cog_signed=True), dict(attn_use_cope=True), dict(attn_hard=True)]


@pytest.mark.parametrize("input_kw", [dict(left_pad=True), dict(context=J, dead_context=True)], ids=["left pad", "context"])
@pytest.mark.parametrize("option", EXPLICIT_OPTIONS, ids=[next(iter(o)) for o in EXPLICIT_OPTIONS])
def test_explicit_scoring_options_run_on_the_step(option, input_kw):
    """The scoring options of the explicit path are per query: the step runs them over the slots and gives the
    dynamic cache's logits (float64, to rounding), alibi or rotary, self- and cross-attention."""
    net = _net(rotary_pos_emb=True, cross_attend="context" in input_kw, **option)
    _assert_step_equals_dynamic(net, input_kw, steps=4)


POSITION_OPTIONS = [dict(rel_pos_bias=True), dict(rotary_pos_emb=True, attn_max_attend_past=3),
                    dict(rotary_pos_emb=True, attn_use_rel_proj_pos_bias=True, attn_max_attend_past=3),
                    dict(alibi_pos_bias=True, attn_max_attend_past=2), dict(rel_pos_bias=True, attn_max_attend_past=4),
                    dict(dynamic_pos_bias=True), dict(dynamic_pos_bias=True, dynamic_pos_bias_log_distance=True,
                                                      dynamic_pos_bias_norm=True)]


@pytest.mark.parametrize("input_kw", [dict(left_pad=True), dict(context=J, dead_context=True)], ids=["left pad", "context"])
@pytest.mark.parametrize("option", POSITION_OPTIONS, ids=["t5 bias", "window, rotary", "projected bias, window", "window, alibi", "window, t5",
                                                            "dynamic bias", "dynamic bias, log, norm"])
def test_position_options_run_on_the_step(option, input_kw):
    """T5's bucketed bias, ``dynamic_pos_bias`` (its MLP's table over every distance the cache can hold, built once)
    and ``max_attend_past``'s window read the slots' positions (real tokens counted): the step
    gives the dynamic cache's logits past the window's reach (float64, to rounding)."""
    net = _net(cross_attend="context" in input_kw, **option)
    _assert_step_equals_dynamic(net, input_kw, steps=6)


EXTRA_KEY_OPTIONS = [dict(attn_num_mem_kv=2), dict(attn_head_learned_sink=True), dict(attn_add_zero_kv=True),
                     dict(attn_num_mem_kv=2, attn_head_learned_sink=True, attn_qk_norm=True, kv_heads=2),
                     dict(attn_num_mem_kv=2, attn_softclamp_logits=True), dict(attn_head_learned_sink=True, attn_sparse_topk=2),
                     dict(attn_l2_distance=True), dict(attn_l2_distance=True, attn_head_learned_sink=True)]


@pytest.mark.parametrize("input_kw", [dict(left_pad=True), dict(context=J, dead_context=True), dict(context=0)],
                         ids=["left pad", "dropped context", "zero-length context"])
@pytest.mark.parametrize("option", EXTRA_KEY_OPTIONS, ids=["memory kv", "sink", "zero kv", "memory kv, sink, qk norm, gqa",
                                                            "memory kv, softclamp", "sink, sparse top-k", "l2 distance",
                                                            "l2 distance, sink"])
def test_extra_keys_run_on_the_step(option, input_kw):
    """Memory keys, a learned sink and a zero key sit before the slots (the attention part's own ``prepend_extra`` /
    ``extend``); in cross-attention a sample without context keys still reads the memory and zero keys (the sink
    alone leaves it a dead row, exactly 0): the dynamic cache's logits (float64, to rounding)."""
    net = _net(rotary_pos_emb=True, cross_attend="context" in input_kw, **option)
    _assert_step_equals_dynamic(net, input_kw, steps=4)


ROUTING_OPTIONS = [dict(num_residual_streams=2), dict(gated_multi_residual=True, residual_fn_kwargs=dict(read_gate_rank=4)),
                   dict(reinject_input=True, learned_reinject_input_gate=True), dict(pre_and_post_norm=True),
                   dict(pre_norm=False), dict(scale_residual=True, scale_residual_constant=0.5), dict(gate_residual=True),
                   dict(softclamp_output=True), dict(attn_aggregated_residuals=True,
                                                     attn_aggregated_residual_kwargs=dict(lora_rank=4)),
                   dict(weight_tie_layers=True), dict(layers_execute_order=(1, 0, 1)),
                   dict(weight_tie_layers=True, num_residual_streams=2), dict(integrate_layers=True),
                   dict(num_residual_streams=2, qkv_receive_diff_residuals=True), dict(residual_attn=True),
                   dict(residual_attn=True, attn_softclamp_logits=True),
                   dict(cross_residual_attn=True, residual_attn=True, cross_attend=True),
                   dict(attn_value_dim_head=12, kv_heads=2, attn_gate_values=True)]


@pytest.mark.parametrize("input_kw", [dict(left_pad=True), dict(context=J, dead_context=True)], ids=["left pad", "context"])
@pytest.mark.parametrize("option", ROUTING_OPTIONS, ids=[next(iter(o)) for o in ROUTING_OPTIONS])
def test_residual_routing_and_value_width_run_on_the_step(option, input_kw):
    """The stack's residual routing is per token (hyper-connections, gated streams, reinjection, post-norms, scaled or
    gated residuals, aggregated residuals, separate query/key/value inputs): the step runs it as the stack's forward
    does, repeated blocks once per run with their own slots (``weight_tie_layers``, ``layers_execute_order``), each
    self-attention's logits to the next (``residual_attn``), and values of another width;
    the dynamic cache's logits (float64, to rounding), parameters off their init so that a skipped part shows."""
    net = _net(**{"rotary_pos_emb": True, "cross_attend": "context" in input_kw, **option})
    _assert_step_equals_dynamic(net, input_kw, steps=5, perturb=True)


OWN_QKV_OPTIONS = [dict(rotary_pos_emb=True, rotate_num_heads=2), dict(rotary_pos_emb=True, add_value_residual=True),
                   dict(alibi_pos_bias=True, add_value_residual=True, learned_value_residual_mix=False),
                   dict(polar_pos_emb=True), dict(polar_pos_emb=True, attn_qk_norm=True, attn_qk_norm_dim_scale=True),
                   dict(rotary_pos_emb=True, attn_use_latent_q=True, attn_dim_latent_q=16, attn_use_latent_kv=True,
                        attn_dim_latent_kv=16, attn_latent_rope_subheads=2)]


@pytest.mark.parametrize("input_kw", [dict(left_pad=True), dict(context=J, dead_context=True)], ids=["left pad", "context"])
@pytest.mark.parametrize("option", OWN_QKV_OPTIONS, ids=["rotate some heads", "value residual", "value residual, alibi",
                                                         "pope", "pope, qk norm", "latent rope sub-heads"])
def test_attentions_with_their_own_rotation_run_on_the_step(option, input_kw):
    """Rotary on some heads only, PoPE, latent rope sub-heads and the value residual run the attention's own
    ``project_qkv`` on the step, given the stack's position pair at the new position (and the first self-attention's
    new values): the dynamic cache's logits (float64, to rounding), parameters off their init."""
    net = _net(cross_attend="context" in input_kw, **option)
    _assert_step_equals_dynamic(net, input_kw, steps=5, perturb=True)


@pytest.mark.parametrize("option", [dict(attn_gumbel_softmax=True),
                                    dict(attn_custom_attn_fn=lambda logits: (logits * 0.5).softmax(-1))],
                         ids=["gumbel softmax", "custom attention function"])
def test_sampled_and_custom_scoring_run_on_the_step(option):
    """A gumbel softmax draws its noise per slot read (eagerly: the slots the dynamic cache holds, so the same seed
    draws the same noise) and a custom function sees the slots' logits: the dynamic cache's tokens."""
    model = sf.AutoregressiveWrapper(_net(rotary_pos_emb=True, cross_attend=True, **option).float())
    assert static_reason(model.net) is None
    prompts, kw = _inputs(left_pad=True, context=J, dead_context=True)
    kw = _cast(kw, torch.float32)
    outs = []
    for static in (True, False):
        torch.manual_seed(3)
        outs.append(model.generate(prompts, 6, temperature=0.0, static_cache=static, **kw))
    assert torch.equal(*outs)


@pytest.mark.parametrize("option", [dict(rotary_pos_emb=True), dict(rotary_pos_emb=True, ff_glu=True, attn_gate_values=True),
                                    dict(alibi_pos_bias=True, attn_num_mem_kv=2)], ids=["rotary", "glu, gated values", "alibi, memory"])
def test_a_step_under_autograd_gives_the_dynamic_gradients(option):
    """With autograd recording, the step uses no weight copies (fused q/k/v, kept norm gains): every parameter gets the
    gradient the dynamic cache's step gives it (float64), none is missing."""
    net = _net(cross_attend=True, **option).double()
    prompts, kw = _inputs(left_pad=True, context=J, dead_context=True)
    kw = _cast(kw, torch.float64)
    feed = torch.randint(0, V, (prompts.shape[0], 1), generator=torch.Generator().manual_seed(2))
    grads = []
    for static in (False, True):
        net.zero_grad()
        _, cache = net(prompts, return_cache=True, **kw)
        step_cache = build_static_cache(net, cache, cache.length + 1) if static else cache
        net(feed, cache=step_cache).sum().backward()
        grads.append({n: p.grad for n, p in net.named_parameters()})
    for name, g in grads[0].items():
        assert (g is None) == (grads[1][name] is None), f"{name}: a gradient missing on one path"
        if g is not None:
            torch.testing.assert_close(grads[1][name], g, rtol=1e-9, atol=1e-10, msg=name)


def test_logits_wider_than_the_vocabulary_run_on_the_step():
    """A sampled id may then be no token: the step records it and the engine raises at its host check
    (test_static_wide_logits.py)."""
    assert static_reason(_net(rotary_pos_emb=True, logits_dim=V + 4)) is None
    assert static_reason(_net(rotary_pos_emb=True, logits_dim=V)) is None


def test_generation_under_autocast_same_tokens():
    model = sf.AutoregressiveWrapper(_net(rotary_pos_emb=True, cross_attend=True).float())
    prompts, kw = _inputs(context=J, dead_context=True, left_pad=True)
    kw = _cast(kw, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = model.generate(prompts, 8, temperature=0.0, cond_scale=2.0, **kw)
        b = model.generate(prompts, 8, temperature=0.0, cond_scale=2.0, static_cache=False, **kw)
    assert torch.equal(a, b)


def test_forward_hooks_run_on_every_static_step(monkeypatch):
    """The step is the modules' own forward: hooks on them (FSDP2's all-gathers, a user's probes) run on every
    step, and such a net keeps the static cache, with the dynamic cache's tokens; its attention blocks then run
    their seams (no fused weights copied while the hooks may hold the parameters as shards)."""
    net = _net(rotary_pos_emb=True)
    seen = []
    handle = net.attn_layers.layers[0].mixer.register_forward_hook(lambda *a: seen.append(1))
    try:
        assert static_reason(net) is None
        calls = _count_static_steps(monkeypatch)
        model = sf.AutoregressiveWrapper(net)
        static = model.generate(_inputs()[0], 4, temperature=0.0)
        assert calls[0] == 3 and len(seen) == 4  # the prompt, then one forward per new token
        with torch.no_grad():
            _, cache = net(_inputs()[0], return_cache=True)
            assert all(s is None or s.plan.fused is None for s in build_static_cache(net, cache, cache.length + 1).layers)
        dynamic = model.generate(_inputs()[0], 4, temperature=0.0, static_cache=False)
        assert torch.equal(static, dynamic)
    finally:
        handle.remove()
    with torch.no_grad():
        assert any(s is not None and s.plan.fused is not None for s in build_static_cache(net, cache, cache.length + 1).layers)


def test_nan_logits_in_guidance_raise_after_the_loop():
    """Guided generation reads the NaN flag every ``eos_check_every`` steps and at the end (no read per step):
    NaN logits are still a named error, never sampled tokens returned."""
    net = _net(rotary_pos_emb=True, cross_attend=True).float()
    with torch.no_grad():
        net.to_logits.weight[0, 0] = math.nan
    prompts, kw = _inputs(context=J)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        sf.AutoregressiveWrapper(net).generate(prompts, 5, cond_scale=3.0, **_cast(kw, torch.float32))


def test_eos_stops_at_a_check_and_pads_after():
    model = sf.AutoregressiveWrapper(_net(rotary_pos_emb=True).float())
    prompts, _ = _inputs()
    free = model.generate(prompts, 20, temperature=0.0)
    eos = int(free[0, 2])
    for every in (1, 4, 50):
        out = model.generate(prompts, 20, temperature=0.0, eos_token=eos, eos_check_every=every)
        for s in range(out.shape[0]):
            hits = (free[s] == eos).nonzero()
            stop = int(hits[0]) + 1 if len(hits) else 20
            assert torch.equal(out[s, :stop], free[s, :stop])
            assert bool((out[s, stop:] == model.pad_value).all())


@pytest.mark.parametrize("kw,err", [(dict(static_cache=1), TypeError), (dict(compile="yes"), TypeError),
                                    (dict(eos_check_every=0), ValueError), (dict(eos_check_every=True), ValueError)])
def test_generation_options_are_checked(kw, err):
    model = sf.AutoregressiveWrapper(_net(rotary_pos_emb=True))
    with pytest.raises(err, match=next(iter(kw))):
        model.generate(_inputs()[0], 3, **kw)


def test_static_cache_checks_its_input_and_its_room():
    net = _net(rotary_pos_emb=True, cross_attend=True).float()
    prompts, kw = _inputs(context=J)
    kw = _cast(kw, torch.float32)
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw)
        with pytest.raises(ValueError, match="capacity"):
            build_static_cache(net, cache, cache.length - 1)
        bad = cache.index_select(torch.tensor([0, 1]))
        bad.count = cache.count  # a batch of 3 counted, its keys, values and context for 2
        with pytest.raises(ValueError, match=r"cache\.\w+ .*2"):
            build_static_cache(net, bad, 10)
        static = build_static_cache(net, cache, cache.length + 1)
        with pytest.raises(ValueError, match="new position only.*context"):  # the prefill's context is in the cache
            net(prompts[:, :1], cache=static, context=kw["context"])
        for extra in (dict(rotary_pos_emb=torch.zeros(1)), dict(transform_block_inputs=lambda *a: a[1]),
                      dict(return_gumbel_log_probs=True), dict(cache_age=2), dict(some_condition=torch.zeros(3, 2))):
            with pytest.raises(ValueError, match=f"new position only.*{next(iter(extra))}"):  # every argument, by name
                net(prompts[:, :1], cache=static, **extra)
        with pytest.raises(ValueError, match="new position only.*mask"):
            net.attn_layers(torch.zeros(prompts.shape[0], 1, DIM), cache=static, mask=torch.ones(3, 1, dtype=torch.bool))
        with pytest.raises(ValueError, match="shape"):
            net(prompts[:, :2], cache=static)
        with pytest.raises(RuntimeError, match="num_tokens"):  # an asynchronous check: no host read on a GPU
            net(torch.full_like(prompts[:, :1], V), cache=static)
        with pytest.raises(TypeError, match="token ids"):
            net(prompts[:, :1].float(), cache=static)
        with pytest.raises(ValueError, match="shape"):
            net.attn_layers(torch.zeros(prompts.shape[0], 2, DIM), cache=static)
        assert static.length == cache.length  # refused calls advance nothing (the range check runs last)
        out, same = net(prompts[:, :1], cache=static, return_cache=True)
        assert same is static and static.length == cache.length + 1 and out.shape == (prompts.shape[0], 1, V)
        with pytest.raises(ValueError, match="full"):
            net(prompts[:, :1], cache=static)
    with pytest.raises(ValueError, match="static decode step cannot run"):
        build_static_cache(_net(attn_hybrid_module=torch.nn.GRU(DIM, DIM, batch_first=True),
                                attn_hybrid_fold_axial_dim=2), cache, 20)


def test_compile_plan_and_capacity_buckets():
    assert compile_options("cuda") == {"mode": "reduce-overhead"}
    assert compile_options("cpu") == {"options": {"cpp_wrapper": True}}
    assert compile_options("cpu", "default") == {"mode": "default"}
    assert [capacity_bucket(n) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]


@pytest.mark.slow
def test_compiled_step_gives_the_eager_tokens():
    """``compile=True`` (fixed shapes, attention over every slot with the validity mask): the same greedy
    tokens as the eager static step and the dynamic cache, guided, with left padding and a padded context."""
    model = sf.AutoregressiveWrapper(_net(rotary_pos_emb=True, cross_attend=True).float())
    prompts, kw = _inputs(left_pad=True, context=J, dead_context=True)
    kw = _cast(kw, torch.float32)
    eager = model.generate(prompts, 8, temperature=0.0, cond_scale=2.0, **kw)
    compiled = model.generate(prompts, 8, temperature=0.0, cond_scale=2.0, compile=True, **kw)
    assert torch.equal(eager, compiled)


def _host_reads(fn) -> int:
    """How many times ``fn`` reads a tensor's value back to the host (``bool``, ``int``, ``float``, ``item``,
    ``tolist``)."""
    count = [0]
    names = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name):
        def read(self, *a, **k):
            count[0] += 1
            return originals[name](self, *a, **k)
        return read

    try:
        for n in names:
            setattr(torch.Tensor, n, counting(n))
        fn()
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
    return count[0]


@pytest.mark.parametrize("gen_kw", [dict(), dict(cond_scale=3.0, eos_token=5), dict(cond_scale=2.0, guidance_rescale=0.5)],
                         ids=["plain", "guided, eos", "guided, rescale"])
def test_no_host_read_per_step(gen_kw):
    """The decode loop reads nothing back to the host between checks: a generation of 14 tokens reads as
    often as one of 4 (both under ``eos_check_every``); the dynamic cache reads per step (the counter works)."""
    model = sf.AutoregressiveWrapper(_net(rotary_pos_emb=True, cross_attend=True).float())
    prompts, kw = _inputs(context=J, left_pad=True)
    kw = _cast(kw, torch.float32)

    def reads(n, **extra):
        return _host_reads(lambda: model.generate(prompts, n, temperature=0.0, **kw, **gen_kw, **extra))

    assert reads(4) == reads(14)
    assert reads(14, static_cache=False) > reads(4, static_cache=False)


WRAPPER_OPTIONS = [dict(to_logits=torch.nn.Sequential(torch.nn.Linear(DIM, V))), dict(token_emb=torch.nn.Embedding(V, DIM)),
                   dict(emb_dim=16, post_emb_norm=True), dict(sigsoftmax_logits=True),
                   dict(mixture_of_softmax=True, mixture_of_softmax_k=3), dict(l2norm_embed=True, scaled_sinu_pos_emb=True),
                   dict(ff_deep_embed=True)]


@pytest.mark.parametrize("option", WRAPPER_OPTIONS, ids=["custom to_logits", "custom token_emb", "emb_dim, post_emb_norm",
                                                         "sigsoftmax", "mixture of softmaxes", "l2norm, scaled sinusoidal",
                                                         "ff deep embed"])
def test_wrapper_parts_run_on_the_step(option):
    """The step embeds and reads out with the wrapper's own code (``_embed``, ``embed_rows``, ``_head``): custom
    modules, a narrower embedding, the sigsoftmax and the mixture head, the feed-forwards' per-token multipliers
    (``ff_deep_embed``) give the dynamic cache's logits (float64), parameters off their init."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=4, dim_head=8, rotary_pos_emb=True, cross_attend=True), **option)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert static_reason(net) is None
    for input_kw in (dict(left_pad=True), dict(context=J, dead_context=True)):
        prompts, kw = _inputs(**input_kw)
        dyn, stat = _dynamic_and_static(net, prompts, kw, steps=4)
        assert float((stat - dyn).abs().max()) < 1e-10


def test_recycling_keeps_the_dynamic_path():
    """Recycling runs the stack several times per call: the step cannot run it (x-transformers' rule: recycle_steps
    in eval mode, which generate does not pass)."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=sf.Decoder(dim=DIM, depth=1, heads=4, dim_head=8,
                                                                                      rotary_pos_emb=True), recycling=True).eval()
    assert "recycling" in static_reason(net)
    with pytest.raises(ValueError, match="recycle_steps"):
        sf.AutoregressiveWrapper(net).generate(_inputs()[0], 4, temperature=0.0)


@pytest.mark.parametrize("option", [dict(attn_orthog_projected_values=True), dict(attn_data_dependent_alibi=True)],
                         ids=["orthog projected values", "data-dependent alibi"])
def test_attention_over_the_whole_sequence_generates_without_a_cache(option):
    """Options that sum over the whole sequence cannot continue from a cache (``can_cache_kv`` False):
    generation recomputes each step, with the tokens of ``cache_kv=False``."""
    net = _net(**option)
    assert not net.can_cache_kv and static_reason(net) is not None
    model = sf.AutoregressiveWrapper(net)
    prompts, _ = _inputs(left_pad=True)
    a = model.generate(prompts, 4, temperature=0.0, mask=_inputs(left_pad=True)[1]["mask"])
    b = model.generate(prompts, 4, temperature=0.0, mask=_inputs(left_pad=True)[1]["mask"], cache_kv=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim_head,rot_dim", [(16, 16), (32, 16), (64, 32)])
def test_rotary_tables_give_apply_rotarys_values(dtype, dim_head, rot_dim):
    """The static step's rotary (complex pairs times ``cis`` eagerly, the real tables in the compiled step) gives
    ``apply_rotary``'s values exactly, at per-sample positions, partial rotary widths and a strided input (q and k
    sliced out of one fused projection)."""
    from safeformer.nn.attention_step import rotary_tables, rotate
    from safeformer.nn.modules import apply_rotary

    stack = sf.Decoder(dim=4 * dim_head, depth=1, heads=4, dim_head=dim_head, rotary_pos_emb=True,
                       rotary_emb_dim=rot_dim)
    cap = 40
    positions = torch.tensor([0, 7, 39])
    cis = rotary_tables(stack.rotary, dim_head, cap, dtype, "cpu")
    cos, sin, swap = rotary_tables(stack.rotary, dim_head, cap, dtype, "cpu", fixed=True)
    g = torch.Generator().manual_seed(0)
    fused = (torch.randn(3, 1, 3 * 4 * dim_head, generator=g, dtype=torch.float64) * 8).to(dtype)
    t = fused[..., : 2 * 4 * dim_head].unflatten(-1, (8, dim_head))  # (B, 1, heads, d), strided
    eager = rotate(t, cis.index_select(0, positions)[:, None, None, :])
    tables = rotate(t, (cos.index_select(0, positions)[:, None, None, :],
                         sin.index_select(0, positions)[:, None, None, :], swap))
    angles = stack.rotary.angles(positions[:, None], dtype=dtype)  # (B, 1, 1, rot)
    want = apply_rotary(t.transpose(1, 2), angles).transpose(1, 2)  # (B, heads, 1, d) as the stack rotates
    assert eager.dtype == dtype and torch.equal(eager, want)
    assert torch.equal(tables, want)
