"""The static decode step on the nets it used to send to the dynamic cache: a hybrid RNN beside attention, a looped
wrapper, a probabilistic continuous wrapper's generation (``decode_step.py``, ``attention_step.py``).

What must hold: ``net(new, cache=static)`` computes what the dynamic ``KVCache`` path computes (float64: 1e-10) with
left-padded prompts and NaN planted in the masked slots of the cache it is built from; the generation APIs give the
same tokens / values with and without the static step (and do run it); what the dynamic path cannot cache, the step
refuses by name.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_static_cache import (
    DIM,
    J,
    V,
    _count_static_steps,
    _dynamic_and_static,
    _eager_and_fixed_steps,
    _inputs,
    _net,
    _plant,
)

import safeformer as sf
from safeformer.decoding.generation import beam_search_tokens
from safeformer.decoding.static import build_static_cache, static_reason

HYBRIDS = {
    "gru": lambda: dict(attn_hybrid_module=torch.nn.GRU(DIM, DIM, batch_first=True)),
    "lstm 2 layers, learned mix": lambda: dict(attn_hybrid_module=torch.nn.LSTM(DIM, DIM, num_layers=2, batch_first=True),
                                               attn_hybrid_learned_mix=True),
    "rnn, alibi": lambda: dict(attn_hybrid_module=torch.nn.RNN(DIM, DIM, batch_first=True), alibi_pos_bias=True,
                               rotary_pos_emb=False),
}


def _hybrid_net(name: str):
    return _net(**{"rotary_pos_emb": True, **HYBRIDS[name]()})


# ------------------------------------------------------------------------------------------------
# attn_hybrid_module
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("input_kw", [dict(), dict(left_pad=True)], ids=["plain", "left pad"])
@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_rnn_step_equals_dynamic_with_nan_in_padded_slots(name, input_kw):
    """The module's state continues in the static cache: each step's logits are the dynamic cache's (float64, 1e-10),
    also when the cache it is built from holds NaN in its padded slots."""
    net = _hybrid_net(name)
    assert static_reason(net) is None, static_reason(net)
    prompts, kw = _inputs(**input_kw)
    dyn, stat = _dynamic_and_static(net, prompts, kw, steps=5, poison=_plant(math.nan))
    assert torch.isfinite(stat).all()
    assert float((stat - dyn).abs().max()) < 1e-10, name


def test_hybrid_state_is_what_the_step_carries():
    """The state buffers matter (the test above could not pass with a state the step ignored): zeroing them after the
    prefill changes the next logits; each step writes the new state in place (same buffers, new values)."""
    net = _hybrid_net("gru").double()
    prompts, kw = _inputs(left_pad=True)
    feed = torch.randint(0, V, (prompts.shape[0], 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw)
        kept = build_static_cache(net, cache, cache.length + 1)
        zeroed = build_static_cache(net, cache, cache.length + 1)
        for slots in zeroed.layers:
            if slots is not None:
                for t in slots.state:
                    t.zero_()
        buf = kept.layers[0].state[0]
        before = buf.clone()
        a, b = net(feed, cache=kept), net(feed, cache=zeroed)
    assert float((a - b).abs().max()) > 1e-4
    assert kept.layers[0].state[0] is buf and not torch.equal(buf, before)


def test_hybrid_generation_and_beam_search_same_tokens_static_and_dynamic(monkeypatch):
    """Greedy generation with left-padded prompts and CFG, and beam search (which reorders the state buffers too):
    the tokens of the dynamic cache, the static step run."""
    net = _net(rotary_pos_emb=True, use_adaptive_layernorm=True, dim_condition=8,
               attn_hybrid_module=torch.nn.GRU(DIM, DIM, batch_first=True))
    model = sf.AutoregressiveWrapper(net.float())
    prompts, kw = _inputs(left_pad=True, condition=True)
    kw = {k: v.float() if v.is_floating_point() else v for k, v in kw.items()}
    calls = _count_static_steps(monkeypatch)
    static = model.generate(prompts, 8, temperature=0.0, cond_scale=2.0, **kw)
    assert calls[0] > 0, "the static step did not run"
    n = calls[0]
    dynamic = model.generate(prompts, 8, temperature=0.0, cond_scale=2.0, static_cache=False, **kw)
    assert calls[0] == n and torch.equal(static, dynamic)
    tok_s, score_s = beam_search_tokens(net, prompts, 5, beams=3, **kw)
    assert calls[0] > n
    monkeypatch.setattr("safeformer.decoding.decode.static_reason", lambda net: "off for the comparison")
    tok_d, score_d = beam_search_tokens(net, prompts, 5, beams=3, **kw)
    assert torch.equal(tok_s, tok_d)
    torch.testing.assert_close(score_s, score_d)


def test_hybrid_modules_the_dynamic_cache_cannot_continue_stay_refused(monkeypatch):
    """``attn_hybrid_fold_axial_dim > 1`` folds positions across the module's batch: the dynamic path refuses a cache,
    so does the step (named); generation re-encodes and never runs the step."""
    net = _net(rotary_pos_emb=True, attn_hybrid_module=torch.nn.GRU(DIM, DIM, batch_first=True),
               attn_hybrid_fold_axial_dim=2)
    assert "attn_hybrid_fold_axial_dim" in static_reason(net)
    calls = _count_static_steps(monkeypatch)
    prompts, _ = _inputs()
    model = sf.AutoregressiveWrapper(net)
    a = model.generate(prompts, 4, temperature=0.0)
    b = model.generate(prompts, 4, temperature=0.0, cache_kv=False)
    assert calls[0] == 0 and torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# looped=True
# ------------------------------------------------------------------------------------------------


def _looped_net(**layer_kw):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=64, looped=True, max_looped_steps=3, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=4, dim_head=8, pre_and_post_norm=True, rotary_pos_emb=True, **layer_kw))
    with torch.no_grad():  # a strong exit gate: samples exit at different runs
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return net.eval()


def _plant_looped(value: float):
    plant = _plant(value)

    def poison(cache):
        for step in cache.looped_prompt_kv or ():
            for k, v in step:
                keep = cache.mask[:, None, :k.shape[2], None]
                k.masked_fill_(~keep, value)
                v.masked_fill_(~keep, value)
        return plant(cache)

    return poison


LOOP_MODES = [
    ("every run (forward's defaults)", dict()),
    ("looped_steps=2", dict(looped_steps=2)),
    ("inference, no exit", dict(looped_inference=True)),
    ("inference, early exit", dict(looped_inference=True, looped_exit_prob_threshold=0.5)),
    ("inference, looped_steps=2", dict(looped_inference=True, looped_steps=2)),
]


@pytest.mark.parametrize("input_kw", [dict(), dict(left_pad=True)], ids=["plain", "left pad"])
@pytest.mark.parametrize("mode", [m for _, m in LOOP_MODES], ids=[n for n, _ in LOOP_MODES])
def test_looped_step_equals_dynamic_with_nan_in_padded_slots(mode, input_kw):
    """Each loop run on its own slots, the early exit per sample, the exit run's keys/values kept for later positions
    (``looped_inference``): the dynamic cache's logits (float64, 1e-10), NaN planted in the padded slots of every
    loop step's prompt keys/values, the samples reordered midway (beam search: every loop step's slots, once)."""
    net = _looped_net().double()
    assert static_reason(net) is None
    prompts, kw = _inputs(**input_kw)
    feed = torch.randint(0, V, (prompts.shape[0], 5), generator=torch.Generator().manual_seed(5))
    settings = net._loop_settings(mode.get("looped_steps"), None, None, mode.get("looped_inference", False),
                                  mode.get("looped_exit_prob_threshold", 0.9))
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw, **mode)
        dyn, c = [], cache
        reorder = torch.tensor([2, 0, 0])
        for t in range(5):
            if t == 2:
                c = c.index_select(reorder)
            out, c = net(feed[:, t:t + 1], cache=c, return_cache=True, **mode)
            dyn.append(out[:, -1])
        if "mask" in kw:
            cache = _plant_looped(math.nan)(cache)
        static = build_static_cache(net, cache, cache.length + 5, loop=settings)
        stat = []
        for t in range(5):
            if t == 2:
                static.index_select_(reorder)
            stat.append(net(feed[:, t:t + 1], cache=static)[:, -1])
    dyn, stat = torch.stack(dyn, 1), torch.stack(stat, 1)
    assert torch.isfinite(stat).all()
    assert float((stat - dyn).abs().max()) < 1e-10
    if mode.get("looped_exit_prob_threshold") == 0.5:  # the early exit was exercised: samples left at other runs
        assert len(set(c.exit_indices[:, 1:].flatten().tolist())) > 1


@pytest.mark.parametrize("gen_kw", [dict(), dict(looped_exit_prob_threshold=0.5), dict(looped_steps=2)],
                         ids=["max steps", "early exit", "looped_steps"])
def test_looped_generation_same_tokens_static_and_dynamic(gen_kw, monkeypatch):
    model = sf.AutoregressiveWrapper(_looped_net())
    prompts, kw = _inputs(left_pad=True)
    calls = _count_static_steps(monkeypatch)
    static = model.generate(prompts, 8, temperature=0.0, **kw, **gen_kw)
    assert calls[0] > 0, "the static step did not run"
    n = calls[0]
    dynamic = model.generate(prompts, 8, temperature=0.0, static_cache=False, **kw, **gen_kw)
    kept, inter = model.generate(prompts, 8, temperature=0.0, return_intermediates=True, **kw, **gen_kw)
    assert calls[0] == n, "the dynamic paths ran the static step"
    assert torch.equal(static, dynamic) and torch.equal(static, kept)
    assert inter.exit_indices.shape == (3, 8)


def test_looped_refusals_are_named():
    net = _looped_net()
    prompts, _ = _inputs()
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, looped_steps=2)
    with pytest.raises(ValueError, match="loop steps"):
        build_static_cache(net, cache, cache.length + 2)  # the defaults run 3
    with pytest.raises(ValueError, match="looped=True"):
        build_static_cache(_net(rotary_pos_emb=True), cache, cache.length + 2, loop={"steps": 2})


LOOPED_HYBRIDS = {
    "gru": lambda: torch.nn.GRU(DIM, DIM, batch_first=True),
    "lstm 2 layers": lambda: torch.nn.LSTM(DIM, DIM, num_layers=2, batch_first=True),
}


def _looped_hybrid_net(module: str):
    torch.manual_seed(1)  # (the module's init: the test's exits do not depend on what ran before)
    return _looped_net(attn_hybrid_module=LOOPED_HYBRIDS[module]())


def _looped_hybrid_logits(net, prompts, kw, mode: dict, steps: int, poison=None):
    """Teacher-forced outputs of ``steps`` positions on the dynamic cache and on the static step (the samples
    reordered midway on both), and the dynamic cache's exit indices."""
    feed = torch.randint(0, V, (prompts.shape[0], steps), generator=torch.Generator().manual_seed(5))
    settings = net._loop_settings(mode.get("looped_steps"), None, None, mode.get("looped_inference", False),
                                  mode.get("looped_exit_prob_threshold", 0.9))
    reorder = torch.tensor([2, 0, 1])
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw, **mode)
        dyn, c = [], cache
        for t in range(steps):
            if t == 2:
                c = c.index_select(reorder)
            out, c = net(feed[:, t:t + 1], cache=c, return_cache=True, **mode)
            dyn.append(out[:, -1])
        if poison is not None:
            cache = poison(cache)
        static = build_static_cache(net, cache, cache.length + steps, loop=settings)
        stat = []
        for t in range(steps):
            if t == 2:
                static.index_select_(reorder)
            stat.append(net(feed[:, t:t + 1], cache=static)[:, -1])
    return torch.stack(dyn, 1), torch.stack(stat, 1), c.exit_indices


@pytest.mark.parametrize("mode", [m for _, m in LOOP_MODES], ids=[n for n, _ in LOOP_MODES])
@pytest.mark.parametrize("module", list(LOOPED_HYBRIDS))
def test_looped_hybrid_step_equals_dynamic_with_nan_in_padded_slots(module, mode):
    """A looped wrapper with ``attn_hybrid_module``: every loop run of a position starts from the one recurrent state
    the dynamic cache keeps, which is then the state of the last run the dynamic loop computed (early exit: the last
    any sample ran, where its batch stops); the dynamic cache's outputs (float64, 1e-10), left-padded prompts with
    NaN in the padded slots of every loop step's prompt keys/values, the samples reordered midway."""
    net = _looped_hybrid_net(module).double()
    assert static_reason(net) is None, static_reason(net)
    prompts, kw = _inputs(left_pad=True)
    dyn, stat, exits = _looped_hybrid_logits(net, prompts, kw, mode, 6, poison=_plant_looped(math.nan))
    assert torch.isfinite(stat).all()
    assert float((stat - dyn).abs().max()) < 1e-10
    if mode.get("looped_exit_prob_threshold") == 0.5:
        # exercised: a batch that stopped before the last run (its state kept), and one whose samples exit apart
        last = exits[:, 1:].max(0).values
        assert bool((last < 2).any())
        assert bool((exits[:, 1:].min(0).values < last).any())


def test_looped_hybrid_state_is_shared_by_the_runs():
    """The state buffers of every loop step hold the one kept state after a step (the test above could not pass
    with per-run states: each run would continue its own), and the step wrote them (new values)."""
    net = _looped_hybrid_net("gru").double()
    prompts, kw = _inputs(left_pad=True)
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw)
        static = build_static_cache(net, cache, cache.length + 1)
        bufs = [layers[0].state[0] for layers in static.loop.layers]
        before = bufs[0].clone()
        net(torch.tensor([[1], [2], [3]]), cache=static)
    assert static.loop.stateful and len(bufs) == 3
    assert not torch.equal(bufs[0], before)
    assert all(torch.equal(b, bufs[-1]) for b in bufs)


@pytest.mark.parametrize("gen_kw", [dict(), dict(looped_exit_prob_threshold=0.5)], ids=["max steps", "early exit"])
def test_looped_hybrid_generation_same_tokens_static_and_dynamic(gen_kw, monkeypatch):
    model = sf.AutoregressiveWrapper(_looped_hybrid_net("lstm 2 layers"))
    prompts, kw = _inputs(left_pad=True)
    calls = _count_static_steps(monkeypatch)
    static = model.generate(prompts, 8, temperature=0.0, **kw, **gen_kw)
    assert calls[0] > 0, "the static step did not run"
    n = calls[0]
    dynamic = model.generate(prompts, 8, temperature=0.0, static_cache=False, **kw, **gen_kw)
    assert calls[0] == n and torch.equal(static, dynamic)


def test_looped_hybrid_early_exit_sample_alone_equals_batched():
    """Each sample keeps the hybrid state of the run it exits at (``_Wrapper._loop`` merges it per sample, as the keys
    and values): a sample decodes in a batch as it does alone."""
    net = _looped_hybrid_net("gru").double()
    prompts, _ = _inputs()
    mode = dict(looped_inference=True, looped_exit_prob_threshold=0.5)
    feed = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(5))

    def run(rows):
        with torch.no_grad():
            _, c = net(prompts[rows], return_cache=True, **mode)
            outs = []
            for t in range(6):
                out, c = net(feed[rows, t:t + 1], cache=c, return_cache=True, **mode)
                outs.append(out[:, -1])
        return torch.stack(outs, 1)

    batched = run(slice(None))
    for i in range(3):
        assert float((run(slice(i, i + 1))[0] - batched[i]).abs().max()) < 1e-10


@pytest.mark.parametrize("kind", ["hybrid", "looped early exit", "looped hybrid early exit"])
def test_fixed_shape_step_compiles_in_one_graph(kind):
    """The fixed-shape step of both (attention over every slot, the loop unrolled, no host read) traces as one graph
    (``fullgraph=True``; dynamo's ``allow_rnn`` for the RNN, as ``StaticStep`` compiles it) and gives the eager
    step's logits."""
    if kind == "hybrid":
        net, mode, settings = _hybrid_net("gru"), {}, None
    else:
        net = _looped_net(**({} if kind == "looped early exit" else
                             {"attn_hybrid_module": torch.nn.GRU(DIM, DIM, batch_first=True)}))
        mode = dict(looped_inference=True, looped_exit_prob_threshold=0.5)
        settings = net._loop_settings(None, None, None, True, 0.5)
    prompts, kw = _inputs(left_pad=True)
    feed = torch.randint(0, V, (3, 3), generator=torch.Generator().manual_seed(5))
    with torch._dynamo.config.patch(allow_rnn=True):
        runs = _eager_and_fixed_steps(net, prompts, {**kw, **mode}, feed, loop=settings)
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# probabilistic continuous generation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_probabilistic_continuous_generation_runs_on_the_step(dtype, monkeypatch):
    """x-transformers' probabilistic net under ``ContinuousAutoregressiveWrapper``: generation decodes on the static
    step (its ``(2, B, d)`` mean and variance read as the engine's pairs) and draws the dynamic path's values for the
    same generator (float64: 1e-10; float32: 1e-5), with left-padded starts holding NaN and a padded context, CFG."""
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(dim_in=5, dim_out=5, max_seq_len=32, probabilistic=True, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=4, dim_head=8, rotary_pos_emb=True, cross_attend=True)).to(dtype)
    model = sf.ContinuousAutoregressiveWrapper(net).eval()
    g = torch.Generator().manual_seed(2)
    start = torch.randn(3, 4, 5, generator=g, dtype=dtype)
    mask = torch.tensor([[True] * 4, [False, False, True, True], [False, True, True, True]])
    start[~mask] = math.nan
    ctx = torch.randn(3, J, DIM, generator=g, dtype=dtype)
    cm = torch.tensor([[True, True, False], [False] * 3, [True, False, False]])
    calls = _count_static_steps(monkeypatch)

    def gen(temperature):
        return model.generate(start, 6, mask=mask, context=ctx, context_mask=cm, cond_scale=2.0,
                              temperature=temperature, generator=torch.Generator().manual_seed(3))

    static, mean_s = gen(1.0), gen(0.0)
    assert calls[0] == 10, "the static step did not run every step after the prompt"
    monkeypatch.setattr("safeformer.decoding.decode.static_reason", lambda net: "off for the comparison")
    dynamic, mean_d = gen(1.0), gen(0.0)
    assert calls[0] == 10
    assert torch.isfinite(static).all() and not torch.equal(static, mean_s)  # the draws moved off the mean
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert float((static - dynamic).abs().max()) < tol
    assert float((mean_s - mean_d).abs().max()) < tol


@pytest.mark.parametrize("options", [dict(num_output_heads=2), dict(logits_dim=1, squeeze_out_last_dim=True)],
                         ids=["output heads", "squeezed"])
def test_wrapper_heads_run_on_the_step_as_the_forward(options):
    """Several output heads (a tuple of logits) and ``squeeze_out_last_dim``: ``net(new, cache=static)`` gives what the
    dynamic cache gives (float64, left padding)."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=64, **options,
                                attn_layers=sf.Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True)).double().eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    assert static_reason(net) is None
    prompts = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])  # left padding
    feed = torch.randint(0, V, (2, 3))
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)  # noqa: E731
    with torch.no_grad():
        _, cache = net(prompts, mask=mask, return_cache=True)
        static = build_static_cache(net, cache, cache.length + 3)
        for t in range(3):
            dyn, cache = net(feed[:, t:t + 1], cache=cache, return_cache=True)
            out = net(feed[:, t:t + 1], cache=static)
            assert len(as_tuple(out)) == len(as_tuple(dyn))
            for a, b in zip(as_tuple(out), as_tuple(dyn)):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
