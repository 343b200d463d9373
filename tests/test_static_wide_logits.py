"""The static decode step on a token wrapper whose logits are wider than its vocabulary (``logits_dim > num_tokens``).

What must hold: a sampled id may then be no token. The dynamic cache names it when fed it (a ``ValueError`` before
it is embedded); the step embeds the id clamped into the vocabulary, records the first such id on the device
(``StaticKVCache.bad_token``, no host read per step), and the engine's host check raises the same ``ValueError``
before returning anything. On ids in range the step is the dynamic cache (float64: 1e-10) and generation gives the
same tokens; a net with ``logits_dim == num_tokens`` keeps its asynchronous assertion (no record).
"""

from __future__ import annotations

import re

import pytest
import torch
from test_static_cache import (
    DIM,
    J,
    V,
    _assert_step_equals_dynamic,
    _count_static_steps,
    _eager_and_fixed_steps,
    _host_reads,
    _inputs,
    _net,
)

import safeformer as sf
from safeformer.decoding.generation import beam_search_tokens
from safeformer.decoding.static import build_static_cache, static_reason

EXTRA = 4  # logits columns past the vocabulary


def _biased_net(extra_bias: float, cross: bool = False):
    """A net whose head has a bias: the ``EXTRA`` columns past the vocabulary get ``extra_bias`` (-1e4: never
    sampled; +1e4: always sampled)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(DIM, V + EXTRA)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=64, logits_dim=V + EXTRA, to_logits=head,
                                attn_layers=sf.Decoder(dim=DIM, depth=2, heads=4, dim_head=8, rotary_pos_emb=True,
                                                        cross_attend=cross))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        head.bias[V:] = extra_bias
    return net.eval()


def _message_id(err: pytest.ExceptionInfo) -> int:
    found = re.search(r"token id (-?\d+) at real position", str(err.value))
    assert found, str(err.value)
    return int(found.group(1))


def test_wide_logits_run_on_the_step():
    assert static_reason(_net(rotary_pos_emb=True, logits_dim=V + EXTRA)) is None
    assert static_reason(_biased_net(-1e4)) is None


@pytest.mark.parametrize("input_kw", [dict(), dict(left_pad=True)], ids=["plain", "left pad"])
def test_wide_logits_step_equals_dynamic_float64(input_kw):
    """Ids in range: the step's logits are the dynamic cache's (float64, 1e-10), all ``logits_dim`` columns."""
    _assert_step_equals_dynamic(_net(rotary_pos_emb=True, logits_dim=V + EXTRA), input_kw, steps=5, perturb=True)


def test_record_only_for_wide_logits():
    """``logits_dim == num_tokens`` keeps the assertion (no record); a wider head records, nothing while in range."""
    prompts, kw = _inputs(left_pad=True)
    with torch.no_grad():
        same = _net(rotary_pos_emb=True)
        _, cache = same(prompts, return_cache=True, **kw)
        static = build_static_cache(same, cache, cache.length + 1)
        assert static.token_range is None and static.bad_token is None
        with pytest.raises(RuntimeError, match="outside"):  # CPU: the asynchronous assertion raises at once
            same(torch.full((3, 1), V), cache=static)
        wide = _net(rotary_pos_emb=True, logits_dim=V + EXTRA)
        _, cache = wide(prompts, return_cache=True, **kw)
        static = build_static_cache(wide, cache, cache.length + 2)
        assert static.token_range == V
        wide(torch.tensor([[0], [V - 1], [5]]), cache=static)
        static.check_tokens()  # in range: nothing recorded
        assert static.bad_token.tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad", [V + 2, -1], ids=["past the vocabulary", "negative"])
def test_direct_step_records_the_bad_id_then_the_check_raises(bad):
    """``net(bad_id, cache=static)`` raises nothing itself (no host read), the step embeds a valid id (finite
    logits), and the check raises the dynamic cache's error naming the first bad id and its sample; a later bad id
    does not overwrite it."""
    net = _net(rotary_pos_emb=True, logits_dim=V + EXTRA)
    prompts, kw = _inputs(left_pad=True)
    feed = torch.tensor([[3], [bad], [V + 3]])
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True, **kw)
        with pytest.raises(ValueError) as dyn:
            net(feed, cache=cache, return_cache=True)
        static = build_static_cache(net, cache, cache.length + 2)
        out = net(feed, cache=static)
        assert torch.isfinite(out).all()
        net(torch.tensor([[V + 1], [0], [0]]), cache=static)  # a later bad id in another sample
        with pytest.raises(ValueError) as stat:
            static.check_tokens()
    assert _message_id(stat) == bad
    assert str(stat.value) == str(dyn.value)


@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "cfg"])
def test_generate_same_tokens_when_no_bad_id_is_sampled(cfg, monkeypatch):
    """The extra columns at -1e4: never sampled; static and dynamic give the same tokens (the static step ran)."""
    model = sf.AutoregressiveWrapper(_biased_net(-1e4, cross=cfg))
    prompts, kw = _inputs(left_pad=True, context=J if cfg else None)
    kw = {k: v.float() if v.is_floating_point() else v for k, v in kw.items()}
    gen_kw = dict(cond_scale=2.0) if cfg else {}
    calls = _count_static_steps(monkeypatch)
    outs = []
    for static in (True, False):
        torch.manual_seed(7)
        outs.append(model.generate(prompts, 20, temperature=1.0, static_cache=static, **kw, **gen_kw))
    assert calls[0] > 0, "the static step did not run"
    assert torch.equal(*outs)
    assert int(outs[0].max()) < V


@pytest.mark.parametrize("seq_len,eos_check_every", [(6, 16), (40, 4)], ids=["end check", "periodic check"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_generate_raises_on_a_sampled_bad_id(static, seq_len, eos_check_every, monkeypatch):
    """The extra columns at +1e4: the first sampled id is no token; feeding it raises the dynamic cache's error on
    both paths, naming an id >= num_tokens (the static one at the host check: periodic or at the end)."""
    model = sf.AutoregressiveWrapper(_biased_net(1e4))
    prompts, kw = _inputs(left_pad=True)
    calls = _count_static_steps(monkeypatch)
    with pytest.raises(ValueError, match="outside the vocabulary") as err:
        model.generate(prompts, seq_len, temperature=0.0, static_cache=static, eos_check_every=eos_check_every, **kw)
    assert V <= _message_id(err) < V + EXTRA
    if static:  # greedy: the same id as the dynamic path's
        assert calls[0] > 0, "the static step did not run"
        assert calls[0] <= eos_check_every, "the periodic check did not stop the generation"
        with pytest.raises(ValueError) as dyn:
            model.generate(prompts, seq_len, temperature=0.0, static_cache=False, **kw)
        assert str(err.value) == str(dyn.value)


def test_a_bad_id_sampled_last_is_returned_on_both_paths():
    """The last step's id is never fed (neither path embeds it): both return it, the same tokens."""
    model = sf.AutoregressiveWrapper(_biased_net(1e4))
    prompts, kw = _inputs(left_pad=True)
    outs = [model.generate(prompts, 1, temperature=0.0, static_cache=s, **kw) for s in (True, False)]
    assert torch.equal(*outs) and int(outs[0].min()) >= V


def test_beam_search_raises_on_a_fed_bad_id():
    net = _biased_net(1e4)
    prompts, kw = _inputs(left_pad=True)
    with pytest.raises(ValueError, match="outside the vocabulary") as err:
        beam_search_tokens(net, prompts, 4, beams=2, **kw)
    assert V <= _message_id(err) < V + EXTRA


def test_fixed_shape_step_records_in_one_graph():
    """The record is device ops on fixed shapes: the fixed step traces as one graph (``fullgraph=True``) with a bad id
    fed, gives the eager step's logits, and its record raises the eager record's error."""
    net = _net(rotary_pos_emb=True, logits_dim=V + EXTRA)
    prompts, kw = _inputs(left_pad=True)
    feed = torch.tensor([[1, 2, 3], [4, V + 1, 6], [7, 8, V + 3]])
    runs = _eager_and_fixed_steps(net, prompts, kw, feed)
    errors = []
    for _, static in runs:
        with pytest.raises(ValueError) as err:
            static.check_tokens()
        errors.append(str(err.value))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=1e-4, rtol=1e-4)
    assert errors[0] == errors[1] and f"token id {V + 1} at real position (1, 0)" in errors[0]


def test_no_host_read_per_step_with_wide_logits():
    """The record costs no host read per step: a generation of 14 tokens reads as often as one of 4."""
    model = sf.AutoregressiveWrapper(_biased_net(-1e4))
    prompts, kw = _inputs(left_pad=True)

    def reads(n):
        return _host_reads(lambda: model.generate(prompts, n, temperature=0.0, **kw))

    assert reads(4) == reads(14)


def test_a_custom_head_of_unknown_width_is_recorded_not_asserted():
    """A custom ``to_logits`` whose width the wrapper cannot read (no ``out_features``) may be wider than the
    vocabulary: its steps record bad ids like a wide head's (never the fatal device-side assertion); a built-in or
    ``nn.Linear`` head of the vocabulary's width keeps the assertion."""
    torch.manual_seed(0)
    layers = dict(dim=DIM, depth=1, heads=4, dim_head=8, rotary_pos_emb=True)
    unknown = sf.TransformerWrapper(num_tokens=V, max_seq_len=64, logits_dim=V + EXTRA,
                                    to_logits=torch.nn.Sequential(torch.nn.Linear(DIM, V + EXTRA)),
                                    attn_layers=sf.Decoder(**layers)).eval()
    exact = sf.TransformerWrapper(num_tokens=V, max_seq_len=64, to_logits=torch.nn.Linear(DIM, V),
                                  attn_layers=sf.Decoder(**layers)).eval()
    prompts = torch.randint(0, V, (2, 4))
    with torch.no_grad():
        for net, recorded in ((unknown, True), (exact, False)):
            _, cache = net(prompts, return_cache=True)
            static = build_static_cache(net, cache, cache.length + 1)
            assert (static.token_range == V) is recorded
            if recorded:
                assert torch.isfinite(net(torch.full((2, 1), V + 1), cache=static)).all()
                with pytest.raises(ValueError, match=f"token id {V + 1} at real position"):
                    static.check_tokens()
            else:
                with pytest.raises(RuntimeError, match="outside"):
                    net(torch.full((2, 1), V + 1), cache=static)
