"""Per-condition guidance scales are bound to their branches by name, at every door that takes them.

A mapping ``{"context": 3.0, "condition": 1.5}`` means the same as ``{"condition": 1.5, "context": 3.0}``.
Each door is run with its mappings (the scales, and for ``compose_guidance`` / ``compose_values`` the branches
too) in every order, and compared with a float64 computation by name from separate passes, one per branch;
negative scales and zero scales are among the cases.

Shape legend: b batch, n prompt positions, j context positions, v vocabulary, d value width.
"""

from __future__ import annotations

import itertools

import helpers as hp
import pytest
import torch

import safeformer as sf
from safeformer.core.conditions import compose_values
from safeformer.decoding.generation import AutoregressiveWrapper

VOCAB, DIM, CTX, K = 11, 16, 6, 3
SCALE_SETS = (
    {"context": 3.0, "condition": 1.5},
    {"context": 2.0, "condition": -1.0, "prepend": 0.5},
    {"joint": 1.5, "context": -0.5, "prepend": 2.0, "condition": 0.0},
    {"joint": 0.0, "condition": 2.5, "context": 1.0},
)


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


def orders(mapping: dict) -> list[dict]:
    """``mapping`` written in every order of its keys."""
    return [{k: mapping[k] for k in perm} for perm in itertools.permutations(mapping)]


def by_name(uncond: torch.Tensor, branches: dict, scales: dict) -> torch.Tensor:
    """``uncond + sum_k s_k (branch_k - uncond)`` in float64, looked up by name."""
    u = uncond.double()
    out = u.clone()
    for name, s in scales.items():
        out = out + s * (branches[name].double() - u)
    return out


# ----------------------------------------------------------------------------------------------------
# the combining functions
# ----------------------------------------------------------------------------------------------------


def test_compose_guidance_binds_scales_by_name_in_any_order():
    """The finding: with every branch at a nonzero scale, the scales were paired with branches by position."""
    u = torch.zeros(1, 3, dtype=torch.float64)
    a = torch.tensor([[1.0, 0, 0]], dtype=torch.float64)
    b = torch.tensor([[0.0, 1, 0]], dtype=torch.float64)
    want = torch.tensor([[2.0, -1.0, 0.0]], dtype=torch.float64)
    for conds in orders({"a": a, "b": b}):
        for scales in orders({"a": 2.0, "b": -1.0}):
            got = sf.compose_guidance(u, conds, scales)
            assert torch.equal(got, want), f"branches {list(conds)}, scales {list(scales)}: {got.tolist()}"


@pytest.mark.parametrize("space", ["logits", "logprobs"])
@pytest.mark.parametrize("rescale", [0.0, 0.7])
def test_compose_guidance_every_order_against_float64(space, rescale):
    g = torch.Generator().manual_seed(3)
    u = torch.randn(4, 9, generator=g)
    branches = {k: torch.randn(4, 9, generator=g) for k in ("joint", "context", "prepend", "condition")}
    u[1, 2] = float("-inf")  # a banned token stays banned
    branches["context"][0, 5] = float("-inf")
    scales = {"joint": 0.5, "context": 2.0, "prepend": -1.5, "condition": 0.0}
    prep = (lambda t: t.double().log_softmax(-1)) if space == "logprobs" else (lambda t: t.double())
    banned = (u == float("-inf")) | (branches["context"] == float("-inf"))
    clean = {k: torch.where(banned, 0.0, prep(t)) for k, t in branches.items()}
    want = by_name(torch.where(banned, 0.0, prep(u)), clean, scales)
    if rescale:
        ref = clean["joint"]
        live = ~banned

        def std(x):
            n = live.sum(-1, keepdim=True).double()
            mean = torch.where(live, x, 0.0).sum(-1, keepdim=True) / n
            return (torch.where(live, (x - mean) ** 2, 0.0).sum(-1, keepdim=True) / (n - 1)).sqrt()

        want = rescale * want * std(ref) / std(want) + (1 - rescale) * want
    want = want.float().masked_fill(banned, float("-inf"))
    first = None
    for conds in orders(branches):
        for sc in orders(scales):
            got = sf.compose_guidance(u, conds, sc, space=space, guidance_rescale=rescale,
                                      reference=conds["joint"] if rescale else None)
            what = f"{space}, branches {list(conds)}, scales {list(sc)}"
            assert torch.equal(got == float("-inf"), banned), f"{what}: the banned tokens"
            hp.assert_close(got.masked_fill(banned, 0.0), want.masked_fill(banned, 0.0), what, torch.float32)
            first = got if first is None else first
            assert torch.equal(got, first), f"order changed the result: branches {list(conds)}, scales {list(sc)}"


def test_compose_values_every_order_against_float64():
    g = torch.Generator().manual_seed(4)
    u = torch.randn(3, 5, dtype=torch.float64, generator=g)
    branches = {k: torch.randn(3, 5, dtype=torch.float64, generator=g) for k in ("context", "prepend", "condition")}
    scales = {"context": 2.0, "prepend": -0.75, "condition": 1.25}
    want = by_name(u, branches, scales)
    for conds in orders(branches):
        for sc in orders(scales):
            got = compose_values(u, conds, sc)
            hp.assert_close(got, want, f"branches {list(conds)}, scales {list(sc)}", torch.float64)


# ----------------------------------------------------------------------------------------------------
# the model doors: generate, next_token_logits, beam_search
# ----------------------------------------------------------------------------------------------------


def make_model() -> AutoregressiveWrapper:
    torch.manual_seed(0)
    net = sf.TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=32,
        attn_layers=sf.Decoder(dim=DIM, depth=2, heads=2, dim_head=8, cross_attend=True, dim_context=CTX,
                               use_adaptive_layernorm=True, dim_condition=K),
    )
    with torch.no_grad():  # weights far from their init, so every branch differs from the others
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return AutoregressiveWrapper(net).eval()


def model_inputs(b: int = 3, n: int = 5, j: int = 4, m: int = 2):
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, VOCAB, (b, n), generator=g)
    ctx = torch.randn(b, j, CTX, generator=g)
    ctx_mask = torch.ones(b, j, dtype=torch.bool)
    ctx_mask[1, 2:] = False
    ctx[1, 2:] = float("nan")  # padded context slots hold NaN: they must stay out of every branch
    pre = torch.randn(b, m, DIM, generator=g)
    cond = torch.randn(b, K, generator=g)
    return prompts, dict(context=ctx, context_mask=ctx_mask, prepend_embeds=pre, condition=cond)


def separate_passes(model, prompts, conds) -> dict[str, torch.Tensor]:
    """Each branch's next-token logits from its own forward: ``joint`` keeps every condition, ``uncond``
    drops them all, ``<kind>`` keeps only that kind (a dropped kind: an all-False mask)."""
    b = prompts.shape[0]
    none = torch.zeros(b, dtype=torch.bool)
    dropped = dict(context_mask=torch.zeros_like(conds["context_mask"]),
                   prepend_mask=torch.zeros(b, conds["prepend_embeds"].shape[1], dtype=torch.bool),
                   condition_mask=none)
    kept = dict(context_mask=conds["context_mask"], prepend_mask=None, condition_mask=None)
    mask_of = {"context": "context_mask", "prepend": "prepend_mask", "condition": "condition_mask"}
    out = {}
    with torch.no_grad():
        for branch in ("joint", "uncond", "context", "prepend", "condition"):
            masks = {mask_of[k]: (kept if branch in ("joint", k) else dropped)[mask_of[k]] for k in mask_of}
            logits = model.net(prompts, context=conds["context"], prepend_embeds=conds["prepend_embeds"],
                               condition=conds["condition"], **masks)
            out[branch] = logits[:, -1]
    return out


@pytest.mark.parametrize("scales", SCALE_SETS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_next_token_logits_every_order_against_separate_passes(scales):
    model = make_model()
    prompts, conds = model_inputs()
    branches = separate_passes(model, prompts, conds)
    uncond = branches.pop("uncond")
    want = by_name(uncond, branches, scales).float()
    first = None
    for sc in orders(scales):
        with torch.no_grad():
            got = model.next_token_logits(prompts, cond_scale=sc, **conds)
        hp.assert_close(got, want, f"cond_scale in the order {list(sc)}", torch.float32)
        first = got if first is None else first
        assert torch.equal(got, first), f"cond_scale in the order {list(sc)} changed the logits"


def test_generate_and_beam_search_every_order():
    model = make_model()
    prompts, conds = model_inputs()
    scales = {"condition": 1.5, "context": 3.0, "prepend": -0.5}
    outs, beams = [], []
    for sc in orders(scales):
        with torch.no_grad():
            outs.append(model.generate(prompts, 4, temperature=0.0, cond_scale=sc, **conds))
            beams.append(model.beam_search(prompts, 3, beams=2, cond_scale=sc, **conds)[0])
    assert all(torch.equal(o, outs[0]) for o in outs), "generate: the mapping's order changed the tokens"
    assert all(torch.equal(o, beams[0]) for o in beams), "beam_search: the mapping's order changed the tokens"
    # the first greedy token is the argmax of the guided logits computed by name from separate passes
    branches = separate_passes(model, prompts, conds)
    uncond = branches.pop("uncond")
    assert torch.equal(outs[0][:, 0], by_name(uncond, branches, scales).argmax(-1))


def test_negative_conditions_every_order():
    """With negative conditions the unconditional branch runs on them; the scales still bind by name."""
    model = make_model()
    prompts, conds = model_inputs()
    neg = torch.randn(prompts.shape[0], 2, CTX, generator=torch.Generator().manual_seed(5))
    first = None
    for sc in orders({"context": 2.0, "condition": -1.5}):
        with torch.no_grad():
            got = model.next_token_logits(prompts, cond_scale=sc, negative_context=neg, **conds)
        assert torch.isfinite(got).all()
        first = got if first is None else first
        assert torch.equal(got, first), f"cond_scale in the order {list(sc)} changed the logits"
    with torch.no_grad():
        neg_uncond = model.net(prompts, context=neg, prepend_embeds=conds["prepend_embeds"],
                               prepend_mask=torch.zeros(prompts.shape[0], 2, dtype=torch.bool),
                               condition=conds["condition"],
                               condition_mask=torch.zeros(prompts.shape[0], dtype=torch.bool))[:, -1]
    branches = separate_passes(model, prompts, conds)
    hp.assert_close(first, by_name(neg_uncond, branches, {"context": 2.0, "condition": -1.5}).float(),
                    "negative context, against separate passes", torch.float32)


def test_continuous_generate_every_order():
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(
        dim_in=4, dim_out=4, max_seq_len=16,
        attn_layers=sf.Decoder(dim=DIM, depth=1, heads=2, dim_head=8, cross_attend=True, dim_context=CTX,
                               use_adaptive_layernorm=True, dim_condition=K),
    )
    model = sf.ContinuousAutoregressiveWrapper(net).eval()
    g = torch.Generator().manual_seed(2)
    start = torch.randn(2, 3, 4, generator=g)
    conds = dict(context=torch.randn(2, 3, CTX, generator=g), condition=torch.randn(2, K, generator=g))
    scales = {"context": 2.5, "condition": -0.5, "joint": 0.25}
    outs = []
    for sc in orders(scales):
        with torch.no_grad():
            outs.append(model.generate(start, 3, cond_scale=sc, **conds))
    assert all(torch.equal(o, outs[0]) for o in outs), "the mapping's order changed the generated values"
    # the first step against separate passes, by name
    b = start.shape[0]
    with torch.no_grad():
        def step(ctx_keep: bool, cond_keep: bool):
            return net(start, context=conds["context"],
                       context_mask=torch.full((b, 3), ctx_keep), condition=conds["condition"],
                       condition_mask=torch.full((b,), cond_keep))[:, -1]
        branches = {"joint": step(True, True), "context": step(True, False), "condition": step(False, True)}
        uncond = step(False, False)
    hp.assert_close(outs[0][:, 0], by_name(uncond, branches, scales).float(), "first step vs separate passes",
                    torch.float32)


def test_xval_generate_every_order_and_a_zero_scale():
    """The xVal wrapper combines the logits and the number by the same names; a scale of 0 is not a branch."""
    from safeformer.research.xval import XValAutoregressiveWrapper, XValTransformerWrapper

    torch.manual_seed(0)
    net = XValTransformerWrapper(num_tokens=10, max_seq_len=16, numerical_token_id=9,
                                 attn_layers=sf.Decoder(dim=DIM, depth=1, heads=2, dim_head=8, cross_attend=True))
    model = XValAutoregressiveWrapper(net).eval()
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, 10, (2, 4), generator=g)
    x_num = torch.randn(2, 4, generator=g)
    ctx = torch.randn(2, 3, DIM, generator=g)
    for scales in ({"joint": -0.5, "context": 2.0}, {"joint": 0.0, "context": 2.0}):
        outs = []
        for sc in orders(scales):
            with torch.no_grad():
                res = model.generate(x, x_num, 3, context=ctx, cond_scale=sc, temperature=0.0)
            outs.append((res.sampled_token_ids, res.sampled_numbers))
        for toks, nums in outs[1:]:
            assert torch.equal(toks, outs[0][0]) and torch.equal(nums, outs[0][1]), f"{scales}: order changed the output"


def test_branch_names_cannot_alias_the_unconditional_branch_or_the_reference():
    """A branch called 'uncond' is refused (it would replace the unconditional branch); a branch called
    'reference' is an ordinary branch, not the rescale's reference."""
    u = torch.zeros(1, 4, dtype=torch.float64)
    a = torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 0, 3, -3]], dtype=torch.float64)
    with pytest.raises(ValueError, match="uncond"):
        sf.compose_guidance(u, {"uncond": a}, {"uncond": 2.0})
    with pytest.raises(TypeError, match="mappings"):
        sf.compose_guidance(u, [a], {"a": 2.0})
    got = sf.compose_guidance(u, {"reference": a}, {"reference": 2.0}, guidance_rescale=0.5, reference=ref)
    want = sf.compose_guidance(u, {"b": a}, {"b": 2.0}, guidance_rescale=0.5, reference=ref)
    assert torch.equal(got, want)
