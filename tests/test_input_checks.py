"""Inputs checked at every door (docs/safety.md, S9): hostile arguments are a ``ValueError`` or ``TypeError``
that names the argument the user passed, never a raw error from deep inside, never silently accepted.

Covers the classes an outside review found unchecked: NaN at real positions of a prefix or an adaptive
condition (with ``check_finite``), negative or out-of-range lengths (``lens``, ``seq_start_pos``,
``padding_mask``), ``drop_conditions``' arguments, a KV cache of another batch, and the names in errors
(``negative_*``, never an internal spelling). A hypothesis test draws such arguments for every door.

Shape legend: b batch, n positions, j context length, m prefix length, c width, K condition width.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest
import torch
from helpers import examples
from hypothesis import given
from hypothesis import strategies as st

import safeformer as sf

B, N, J, M, C, K, V = 3, 5, 4, 2, 8, 3, 9


def _net(check_finite=False, cross=True, adaptive=True, causal=True):
    torch.manual_seed(0)
    layers = (sf.Decoder if causal else sf.Encoder)(
        dim=C, depth=1, heads=2, dim_head=4, cross_attend=cross, use_adaptive_layernorm=adaptive,
        dim_condition=K if adaptive else None)
    return sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=layers, check_finite=check_finite)


def _conds():
    g = torch.Generator().manual_seed(0)
    return dict(context=torch.randn(B, J, C, generator=g), context_mask=torch.ones(B, J, dtype=torch.bool),
                prepend_embeds=torch.randn(B, M, C, generator=g), prepend_mask=torch.ones(B, M, dtype=torch.bool),
                condition=torch.randn(B, K, generator=g), condition_mask=torch.ones(B, dtype=torch.bool))


def _names(err: BaseException, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", str(err)) is not None


# ----------------------------------------------------------------------------------------------------
# NaN at real positions of every kind of condition (check_finite)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["context", "prepend_embeds", "condition"])
def test_check_finite_covers_every_kind_of_condition(kind):
    net = _net(check_finite=True)
    x = torch.randint(0, V, (B, N))
    conds = _conds()
    bad = conds[kind].clone()
    bad[1].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=rf"^{kind} holds a non-finite value"):
        net(x, **{**conds, kind: bad})
    mask_name = {"context": "context_mask", "prepend_embeds": "prepend_mask", "condition": "condition_mask"}[kind]
    mask = conds[mask_name].clone()
    mask[1] = False if kind == "condition" else mask[1].fill_(False)
    out = net(x, **{**conds, kind: bad, mask_name: mask})  # a masked (dropped) NaN is nobody's business
    assert torch.isfinite(out).all()
    model = sf.AutoregressiveWrapper(net)
    with pytest.raises(ValueError, match=rf"^{kind} holds a non-finite value"):
        model(x, **{**conds, kind: bad})
    neg = {"negative_" + kind: bad}
    with pytest.raises(ValueError, match=rf"negative_{kind} holds a non-finite value"):
        model.generate(x[:, :2], 2, **conds, **neg, cond_scale=2.0)


# ----------------------------------------------------------------------------------------------------
# lengths
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, exc", [([2, -1, 1], ValueError), ([2, 6, 1], ValueError), ([2.0, 1.0, 1.0], TypeError)])
def test_lengths_are_checked(value, exc):
    lengths = torch.tensor(value)
    net = _net(causal=False, cross=False, adaptive=False)
    with pytest.raises(exc, match="seq_start_pos"):
        net(torch.randint(0, V, (B, N)), seq_start_pos=lengths)
    cont = sf.ContinuousTransformerWrapper(dim_in=2, max_seq_len=16, attn_layers=sf.Encoder(dim=C, depth=1, heads=2, dim_head=4))
    with pytest.raises(exc, match="lens"):
        cont(torch.randn(B, N, 2), lens=lengths)
    with pytest.raises(exc, match="lengths"):
        sf.padding_mask(lengths, N)
    ok = torch.tensor([0, N, 2])
    assert sf.padding_mask(ok, N).sum(1).tolist() == [0, N, 2]
    assert net(torch.randint(0, V, (B, N)), seq_start_pos=ok).shape == (B, N, V)


# ----------------------------------------------------------------------------------------------------
# drop_conditions
# ----------------------------------------------------------------------------------------------------


def _drop_cases():
    c = _conds()
    conds = sf.Conditions(c["context"], c["context_mask"], condition=c["condition"])
    return [
        ("an unknown kind", lambda: sf.drop_conditions(conds, {"text": 0.1}), ValueError, "text"),
        ("a probability above 1", lambda: sf.drop_conditions(conds, {"context": 1.5}), ValueError, "probs"),
        ("a negative probability", lambda: sf.drop_conditions(conds, -0.1), ValueError, "probs"),
        ("all_prob above 1", lambda: sf.drop_conditions(conds, {}, all_prob=1.5), ValueError, "all_prob"),
        ("a string where a mapping belongs", lambda: sf.drop_conditions(conds, "0.5"), TypeError, "probs"),
        ("a float mask", lambda: sf.drop_conditions(replace(conds, context_mask=c["context_mask"].float()), 0.5),
         TypeError, "context_mask"),
        ("a (b, 1) condition mask", lambda: sf.drop_conditions(
            replace(conds, condition_mask=torch.ones(B, 1, dtype=torch.bool)), 0.5), ValueError, "condition_mask"),
        ("kinds of different batches", lambda: sf.drop_conditions(replace(conds, condition=c["condition"][:2]), 0.5),
         ValueError, "condition"),
        ("a mask without its tensor", lambda: sf.drop_conditions(sf.Conditions(context_mask=c["context_mask"],
                                                                               condition=c["condition"]), 0.5),
         ValueError, "context_mask"),
        ("not a Conditions", lambda: sf.drop_conditions(c, 0.5), TypeError, "conds"),
        ("nulls of an unknown kind", lambda: sf.drop_conditions(conds, 0.5, nulls={"text": (c["context"], None)}),
         ValueError, "text"),
        ("a null of another batch", lambda: sf.drop_conditions(conds, 0.5, nulls={"context": (c["context"][:1], None)}),
         ValueError, "nulls['context']"),
    ]


@pytest.mark.parametrize("what, call, exc, name", _drop_cases(), ids=[c[0] for c in _drop_cases()])
def test_drop_conditions_arguments_are_checked(what, call, exc, name):
    with pytest.raises(exc) as info:
        call()
    assert name in str(info.value), f"{what}: {info.value}"


def test_drop_conditions_accepts_one_number_for_every_kind():
    c = _conds()
    conds = sf.Conditions(c["context"], c["context_mask"], condition=c["condition"])
    out, dropped = sf.drop_conditions(conds, 1.0)
    assert not out.context_mask.any() and not out.condition_mask.any()
    assert set(dropped) == {"context", "condition"}


# ----------------------------------------------------------------------------------------------------
# caches of another batch; the names in errors
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["batch", "lead", "count", "positions", "context", "condition"])
def test_a_cache_of_another_batch_is_a_clear_error(field):
    net = _net()
    x = torch.randint(0, V, (B, N))
    c = _conds()
    _, cache = net(x, context=c["context"], condition=c["condition"], return_cache=True)
    bad = {
        "batch": cache.index_select(torch.tensor([0, 1])),
        "lead": replace(cache, lead=torch.zeros(2, dtype=torch.long)),
        "count": replace(cache, count=cache.count[:2]),
        "positions": replace(cache, positions=torch.zeros(2, N, dtype=torch.long)),
        "context": replace(cache, context=c["context"][:2]),
        "condition": replace(cache, condition=c["condition"][:2]),
    }[field]
    with pytest.raises(ValueError, match="cache"):
        net(x[:, :1], cache=bad)


def test_errors_name_the_arguments_the_user_passed():
    """A wrong negative condition is named as the user spelled it (``negative_*``), never an internal
    spelling such as ``uncond_*``."""
    model = sf.AutoregressiveWrapper(_net())
    c = _conds()
    prompts = torch.randint(0, V, (B, 2))
    cases = [
        ("negative_prepend_embeds", dict(negative_prepend_embeds=torch.randn(B, M, C + 1))),
        ("negative_prepend_mask", dict(negative_prepend_embeds=c["prepend_embeds"], negative_prepend_mask=c["prepend_mask"].long())),
        ("negative_condition", dict(negative_condition=torch.randn(B, K + 1))),
        ("negative_context", dict(negative_context=torch.randn(B, J, C + 1))),
    ]
    for name, kw in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            model.generate(prompts, 2, **c, **kw, cond_scale=2.0)
        assert _names(info.value, name) and "uncond" not in str(info.value), f"{name}: {info.value}"
    with pytest.raises(TypeError, match="negative_contxt"):
        model.generate(prompts, 2, negative_contxt=c["context"])


# ----------------------------------------------------------------------------------------------------
# hypothesis: hostile arguments at every door that takes conditions
# ----------------------------------------------------------------------------------------------------

HOSTILE = {
    # name -> (keyword overrides, exception type, the name the message must carry)
    "float context_mask": (lambda c: dict(context_mask=c["context_mask"].float()), TypeError, "context_mask"),
    "(b, 1) condition_mask": (lambda c: dict(condition_mask=torch.ones(B, 1, dtype=torch.bool)), ValueError, "condition_mask"),
    "prefix of another batch": (lambda c: dict(prepend_embeds=c["prepend_embeds"][:2], prepend_mask=None), ValueError, "prepend_embeds"),
    "condition of another width": (lambda c: dict(condition=torch.randn(B, K + 1)), ValueError, "condition"),
    "context of another batch": (lambda c: dict(context=c["context"][:2], context_mask=None), ValueError, "context"),
    "prepend_mask without prefix": (lambda c: dict(prepend_embeds=None), ValueError, "prepend_mask"),
    "int prepend_mask": (lambda c: dict(prepend_mask=c["prepend_mask"].long()), TypeError, "prepend_mask"),
    "an unknown condition keyword": (lambda c: dict(contxt=c["context"]), TypeError, "contxt"),
}


def _doors():
    net = _net()
    ar = sf.AutoregressiveWrapper(net)
    cont_net = sf.ContinuousTransformerWrapper(dim_in=2, dim_out=2, max_seq_len=16, attn_layers=sf.Decoder(
        dim=C, depth=1, heads=2, dim_head=4, cross_attend=True, use_adaptive_layernorm=True, dim_condition=K))
    cont = sf.ContinuousAutoregressiveWrapper(cont_net)
    nar = sf.NonAutoregressiveWrapper(_net(causal=False), mask_id=V - 1)
    x = torch.randint(0, V - 1, (B, N))
    start = torch.randn(B, 3, 2)
    return {
        "TransformerWrapper": lambda kw: net(x, **kw),
        "ContinuousTransformerWrapper": lambda kw: cont_net(start, **kw),
        "AutoregressiveWrapper.forward": lambda kw: ar(x, **kw),
        "AutoregressiveWrapper.generate": lambda kw: ar.generate(x[:, :2], 2, cond_scale=2.0, **kw),
        "AutoregressiveWrapper.beam_search": lambda kw: ar.beam_search(x[:, :2], 2, beams=2, **kw),
        "generate_tokens": lambda kw: sf.generate_tokens(net, x[:, :2], 2, **kw),
        "ContinuousAutoregressiveWrapper.forward": lambda kw: cont(start, **kw),
        "ContinuousAutoregressiveWrapper.generate": lambda kw: cont.generate(start, 2, cond_scale=2.0, **kw),
        "NonAutoregressiveWrapper.forward": lambda kw: nar(x, **kw),
        "NonAutoregressiveWrapper.generate": lambda kw: nar.generate(B, N, cond_scale=2.0, **kw),
    }


DOORS = _doors()


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
@pytest.mark.parametrize("door", sorted(DOORS))
def test_hostile_condition_arguments_at_every_door(door, hostile):
    """Every door that takes conditions, against every hostile argument."""
    change, exc, name = HOSTILE[hostile]
    c = _conds()
    kw = {k: v for k, v in {**c, **change(c)}.items() if v is not None}
    with pytest.raises(exc) as info:
        DOORS[door](kw)
    assert _names(info.value, name), f"{door} with {hostile}: the error does not name {name!r}: {info.value}"


@given(door=st.sampled_from(sorted(DOORS)), sample=st.integers(0, B - 1), value=st.sampled_from([float("nan"), float("inf")]),
       kind=st.sampled_from(["context", "prepend_embeds", "condition"]))
@examples(4)
def test_garbage_in_a_dropped_condition_changes_nothing_at_every_door(door, sample, value, kind):
    """Hypothesis: NaN/inf planted in one sample's condition, with that sample's mask False (dropped), is
    accepted at every door and reaches no output (S3): the result equals the one with zeros planted."""
    c = _conds()
    mask_name = {"context": "context_mask", "prepend_embeds": "prepend_mask", "condition": "condition_mask"}[kind]
    c[mask_name] = c[mask_name].clone()
    c[mask_name][sample] = False
    outs = []
    for planted in (value, 0.0):
        kw = dict(c)
        kw[kind] = c[kind].clone()
        kw[kind][sample] = planted
        torch.manual_seed(7)
        random.seed(7)  # the masked-token wrapper's corruption flips Python's coins (x-transformers' draws)
        out = DOORS[door](kw)
        outs.append(out[0] if isinstance(out, tuple) else out)
    assert torch.equal(torch.nan_to_num(outs[0].float(), 7.0), torch.nan_to_num(outs[1].float(), 7.0)) \
        and not torch.isnan(outs[0].float()).any(), f"{door}: planted {value} in a dropped {kind} changed the result"



def test_an_input_in_another_float_dtype_than_the_weights_is_a_type_error_naming_it():
    """A float64 input to a float32 model (or float32 to a float16 one) is a ``TypeError`` naming the argument
    at every door that takes floats first (stack, ``Attention``, the continuous wrapper, memories), not the
    matmul's error from inside; under autocast the dtypes mix on purpose and run."""
    torch.manual_seed(0)
    stack = sf.Decoder(dim=C, depth=1, heads=2, dim_head=4)
    attn = sf.Attention(dim=C, heads=2, dim_head=4)
    cont = sf.ContinuousTransformerWrapper(dim_in=3, dim_out=3, max_seq_len=16,
                                           attn_layers=sf.Decoder(dim=C, depth=1, heads=2, dim_head=4)).half()
    x64 = torch.randn(B, N, C, dtype=torch.float64)
    for call, name in ((lambda: stack(x64), "x"), (lambda: attn(x64), "x"), (lambda: cont(torch.randn(B, N, 3)), "x"),
                       (lambda: stack(x64.float(), mems=[x64[:, :2]]), r"mems\[0\]")):
        with pytest.raises(TypeError, match=rf"^{name} has dtype"):
            call()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(stack(x64.bfloat16()).float()).all()
    assert stack.double()(x64).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_token_ids_of_any_integer_dtype_are_the_same_ids(dtype):
    """Token ids stored as uint8 / int8 / int16 / int32 are read as the same ids as int64: the forward, the
    autoregressive loss and generation give the same results (the embedding itself takes int32 and int64 only)."""
    net = _net(cross=False, adaptive=False)
    wrapper = sf.AutoregressiveWrapper(net)
    x = torch.randint(0, V, (B, N))
    with torch.no_grad():
        assert torch.equal(net(x.to(dtype)), net(x))
        assert torch.equal(wrapper(x.to(dtype)), wrapper(x))
    assert torch.equal(wrapper.generate(x.to(dtype), 3, temperature=0.0), wrapper.generate(x, 3, temperature=0.0))


def test_an_eos_token_outside_the_vocabulary_is_refused():
    """An ``eos_token`` that no step can draw (negative, or ``>= num_tokens``) would never stop a sample: a
    ``ValueError`` naming it."""
    wrapper = sf.AutoregressiveWrapper(_net(cross=False, adaptive=False))
    for eos in (-1, V):
        with pytest.raises(ValueError, match="eos_token"):
            wrapper.generate(torch.randint(0, V, (B, N)), 3, eos_token=eos)
