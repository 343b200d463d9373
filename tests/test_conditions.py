"""Conditioning: prefixes, adaptive norms, per-condition dropping and guidance (safeformer/conditions.py).

The clause-by-clause contract runs over these doors in test_contract_models.py (cases
``TransformerWrapper-prefix`` and ``Decoder-adaptive``) and test_doors.py (``drop_conditions``,
``compose_guidance``); this file checks what the conditions mean: an all-False prefix is no prefix, a
padded prefix is the shorter one, a dropped condition's contents never matter, cached generation equals
uncached for each kind, and guidance over several conditions equals the formula computed by hand from
separate forward passes.

Shape legend: b batch, n tokens, m prefix length, j context length, K condition width, v vocabulary.
"""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf

NAN = float("nan")
V, C, K = 11, 16, 3


def _net(dtype=torch.float64, *, cross=True, adaptive=True, rotary=True, seed=0):
    torch.manual_seed(seed)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=sf.Decoder(
        dim=C, depth=2, heads=2, dim_head=8, cross_attend=cross, rotary_pos_emb=rotary,
        use_adaptive_layernorm=adaptive, use_adaptive_layerscale=adaptive, dim_condition=K if adaptive else None))
    with torch.no_grad():  # the adaptive projections start at zero: make the condition matter
        for name, p in net.named_parameters():
            if "to_gamma" in name or "to_beta" in name or "to_gate" in name or "null_condition" in name:
                p.copy_(torch.randn(p.shape) * 0.5)
    return net.to(dtype).eval()


def _inputs(b=3, n=5, j=4, m=3, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randint(0, V, (b, n), generator=g),
        context=torch.randn(b, j, C, generator=g).to(dtype),
        context_mask=torch.tensor([[True, True, False, True], [False] * 4, [True, False, False, False]])[:b, :j],
        prepend_embeds=torch.randn(b, m, C, generator=g).to(dtype),
        prepend_mask=torch.tensor([[True, True, True], [False, True, False], [False, False, False]])[:b, :m],
        condition=torch.randn(b, K, generator=g).to(dtype),
        condition_mask=torch.tensor([True, False, True])[:b],
    )


# ----------------------------------------------------------------------------------------------------
# prefix
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary", [False, True], ids=["abs-pos", "rotary"])
def test_all_false_prefix_row_equals_no_prefix(rotary):
    net = _net(rotary=rotary, cross=False, adaptive=False)
    inp = _inputs()
    pre = inp["prepend_embeds"].clone()
    pre[2] = NAN  # sample 2's prefix is all masked: its contents never matter
    out = net(inp["x"], prepend_embeds=pre, prepend_mask=inp["prepend_mask"], excise_prepend_embeds=True)
    alone = net(inp["x"][2:])
    hp.assert_close(out[2:], alone, "all-False prefix vs no prefix", torch.float64)


@pytest.mark.parametrize("rotary", [False, True], ids=["abs-pos", "rotary"])
def test_padded_prefix_equals_the_shorter_prefix_alone(rotary):
    net = _net(rotary=rotary, cross=False, adaptive=False)
    inp = _inputs()
    pre, pm = inp["prepend_embeds"].clone(), inp["prepend_mask"]
    pre[~pm] = float("inf")
    out = net(inp["x"], prepend_embeds=pre, prepend_mask=pm, excise_prepend_embeds=True)
    for s in range(3):
        alone = net(inp["x"][s : s + 1], prepend_embeds=inp["prepend_embeds"][s : s + 1, pm[s]], excise_prepend_embeds=True)
        hp.assert_close(out[s : s + 1], alone, f"sample {s}: padded prefix vs its real rows alone", torch.float64)


def test_prefix_outputs_come_first_unless_excised_and_padded_rows_are_zero():
    net = _net(cross=False, adaptive=False)
    inp = _inputs()
    full = net(inp["x"], prepend_embeds=inp["prepend_embeds"], prepend_mask=inp["prepend_mask"], return_embeddings=True)
    assert full.shape == (3, 3 + 5, C)
    hp.assert_zero(full[:, :3][~inp["prepend_mask"]], "hidden states at masked prefix rows")
    excised = net(inp["x"], prepend_embeds=inp["prepend_embeds"], prepend_mask=inp["prepend_mask"],
                  return_embeddings=True, excise_prepend_embeds=True)
    hp.assert_bitwise(excised, full[:, 3:], "excised outputs")


# ----------------------------------------------------------------------------------------------------
# adaptive condition
# ----------------------------------------------------------------------------------------------------


def test_dropped_adaptive_condition_is_the_null_whatever_it_holds():
    net = _net()
    inp = _inputs()
    cond = inp["condition"].clone().requires_grad_()
    dirty = inp["condition"].clone()
    dirty[1] = NAN
    dirty.requires_grad_()
    kw = dict(context=inp["context"], context_mask=inp["context_mask"], condition_mask=inp["condition_mask"])
    a = net(inp["x"], condition=cond, **kw)
    b = net(inp["x"], condition=dirty, **kw)
    hp.assert_bitwise(b, a, "output with NaN in a dropped condition")
    null = net(inp["x"][1:2], context=inp["context"][1:2], context_mask=inp["context_mask"][1:2])  # no condition
    hp.assert_close(a[1:2], null, "a dropped condition vs none", torch.float64)
    b.sum().backward()
    hp.assert_zero(dirty.grad[1], "grad of a dropped condition")
    hp.assert_finite(dirty.grad, "grad of the conditions")


def test_zero_null_condition_option():
    torch.manual_seed(0)
    dec = sf.Decoder(dim=C, depth=1, heads=2, dim_head=8, use_adaptive_rmsnorm=True, dim_condition=K, adaptive_null="zeros")
    for p in dec.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 3, C)
    hp.assert_bitwise(dec(x), dec(x, condition=torch.zeros(2, K)), "no condition vs zeros")
    assert not any("null_condition" in n for n, _ in dec.named_parameters())


# ----------------------------------------------------------------------------------------------------
# dropping for CFG
# ----------------------------------------------------------------------------------------------------


def test_each_condition_dropped_independently_with_its_own_probability():
    b = 4000
    conds = sf.Conditions(torch.zeros(b, 2, C), None, torch.zeros(b, 1, C), None, torch.zeros(b, K))
    _, dropped = sf.drop_conditions(conds, {"context": 0.1, "prepend": 0.5, "condition": 0.0}, all_prob=0.2,
                                    generator=torch.Generator().manual_seed(0))
    rate = {k: float(v.float().mean()) for k, v in dropped.items()}
    # with all_prob: p + 0.2 - 0.2 p; within 4 sigma of a binomial over 4000 draws
    for kind, p in (("context", 0.1), ("prepend", 0.5), ("condition", 0.0)):
        want = p + 0.2 - 0.2 * p
        assert abs(rate[kind] - want) < 4 * (want * (1 - want) / b) ** 0.5 + 1e-9, (kind, rate[kind], want)
    every = dropped["context"] & dropped["prepend"] & dropped["condition"]
    assert abs(float(every.float().mean()) - 0.2) < 0.03, "all-dropped samples must be trained too"
    # condition has p = 0: only the all-drop removes it, and an all-drop removes every kind
    assert not bool((dropped["condition"] & ~(dropped["context"] & dropped["prepend"])).any())
    both = float((dropped["context"] & dropped["prepend"] & ~dropped["condition"]).float().mean())
    assert abs(both - 0.8 * 0.1 * 0.5) < 0.02, "context and prepend are drawn independently"


def test_training_loss_with_dropped_conditions_never_sees_their_contents():
    """``AutoregressiveWrapper`` drops each kind per sample; NaN in what was dropped changes neither the
    loss nor any gradient, and every dropped sample's loss term is the one without that condition."""
    net = _net(torch.float32)
    model = sf.AutoregressiveWrapper(net, cond_drop_prob={"context": 0.5, "prepend": 0.5, "condition": 0.5}).train()
    inp = _inputs(b=3, dtype=torch.float32)
    kw = {k: v for k, v in inp.items() if k != "x"}

    def run(poison: bool):
        torch.manual_seed(5)
        probe = sf.Conditions(kw["context"], kw["context_mask"], kw["prepend_embeds"], kw["prepend_mask"],
                              kw["condition"], kw["condition_mask"])
        torch.manual_seed(5)
        _, dropped = sf.drop_conditions(probe, model.cond_drop_probs)
        args = {k: v.clone() for k, v in kw.items()}
        if poison:
            args["context"][dropped["context"]] = NAN
            args["prepend_embeds"][dropped["prepend"]] = NAN
            args["condition"][dropped["condition"]] = NAN
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = model(inp["x"], **args)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, dropped

    clean, g_clean, dropped = run(False)
    assert any(bool(d.any()) for d in dropped.values()) and any(bool((~d).any()) for d in dropped.values())
    dirty, g_dirty, _ = run(True)
    hp.assert_bitwise(dirty, clean, "loss with NaN in dropped conditions")
    for n, g in g_clean.items():
        hp.assert_bitwise(g_dirty[n], g, f"grad of {n}")


# ----------------------------------------------------------------------------------------------------
# cached == uncached generation, per kind
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kinds", [("context",), ("prepend",), ("condition",), ("context", "prepend", "condition")],
                         ids=["context", "prefix", "condition", "all"])
@pytest.mark.parametrize("cond_scale", [1.0, 2.5, "per-kind"])
def test_cached_generation_equals_uncached(kinds, cond_scale):
    net = _net(torch.float64)
    model = sf.AutoregressiveWrapper(net)
    inp = _inputs()
    kw = {}
    for k in kinds:
        names = {"context": ("context", "context_mask"), "prepend": ("prepend_embeds", "prepend_mask"),
                 "condition": ("condition", "condition_mask")}[k]
        kw.update({name: inp[name] for name in names})
    scale = {k: 1.5 + i for i, k in enumerate(kinds)} if cond_scale == "per-kind" else cond_scale
    prompts = inp["x"][:, :2]
    a = model.generate(prompts, 5, temperature=0.0, cache_kv=True, cond_scale=scale, **kw)
    b = model.generate(prompts, 5, temperature=0.0, cache_kv=False, cond_scale=scale, **kw)
    assert torch.equal(a, b), f"cached {a.tolist()} vs uncached {b.tolist()}"
    la = model.next_token_logits(prompts, cond_scale=scale, cache_kv=True, **kw)
    lb = model.next_token_logits(prompts, cond_scale=scale, cache_kv=False, **kw)
    hp.assert_close(la, lb, "first-step logits cached vs uncached", torch.float64)


# ----------------------------------------------------------------------------------------------------
# guidance over several conditions = the formula by hand
# ----------------------------------------------------------------------------------------------------


def _branch_logits(net, prompts, inp, keep: set[str], **neg):
    """Last-position logits of one forward with only the kinds in ``keep`` real (the others dropped)."""
    b = prompts.shape[0]
    kw = dict(context=inp["context"], context_mask=inp["context_mask"] & ("context" in keep),
              prepend_embeds=inp["prepend_embeds"], prepend_mask=inp["prepend_mask"] & ("prepend" in keep),
              condition=inp["condition"], condition_mask=inp["condition_mask"] & ("condition" in keep),
              excise_prepend_embeds=True)
    if "condition" in neg and "condition" not in keep:
        kw.update(condition=neg["condition"], condition_mask=torch.ones(b, dtype=torch.bool))
    with torch.no_grad():
        return net(prompts, **kw)[:, -1].double()


@pytest.mark.parametrize("space", ["logits", "logprobs"])
def test_per_condition_guidance_equals_the_formula_from_separate_passes(space):
    net = _net(torch.float64)
    model = sf.AutoregressiveWrapper(net)
    inp = _inputs()
    prompts = inp["x"][:, :3]
    scales = {"joint": 0.5, "context": 2.0, "prepend": -0.5, "condition": 1.5}
    got = model.next_token_logits(prompts, cond_scale=scales, guidance_space=space,
                                  **{k: v for k, v in inp.items() if k != "x"})
    branch = {name: _branch_logits(net, prompts, inp, keep) for name, keep in (
        ("uncond", set()), ("joint", {"context", "prepend", "condition"}), ("context", {"context"}),
        ("prepend", {"prepend"}), ("condition", {"condition"}))}
    if space == "logprobs":
        branch = {k: v.log_softmax(-1) for k, v in branch.items()}
    want = branch["uncond"] + sum(s * (branch[k] - branch["uncond"]) for k, s in scales.items())
    hp.assert_close(got.double(), want, f"compositional guidance ({space}) vs by hand", torch.float64)


def test_joint_scale_number_equals_the_two_branch_formula_with_every_kind():
    net = _net(torch.float64)
    model = sf.AutoregressiveWrapper(net)
    inp = _inputs()
    prompts = inp["x"][:, :2]
    got = model.next_token_logits(prompts, cond_scale=3.0, **{k: v for k, v in inp.items() if k != "x"})
    u = _branch_logits(net, prompts, inp, set())
    j = _branch_logits(net, prompts, inp, {"context", "prepend", "condition"})
    hp.assert_close(got.double(), u + 3.0 * (j - u), "joint guidance vs by hand", torch.float64)


def test_negative_condition_replaces_the_null_in_the_unconditional_branch():
    net = _net(torch.float64)
    model = sf.AutoregressiveWrapper(net)
    inp = _inputs()
    prompts = inp["x"][:, :2]
    neg = torch.randn(3, K, dtype=torch.float64)
    got = model.next_token_logits(prompts, cond_scale=2.0, condition=inp["condition"],
                                  condition_mask=inp["condition_mask"], negative_condition=neg)
    with torch.no_grad():
        j = net(prompts, condition=inp["condition"], condition_mask=inp["condition_mask"])[:, -1]
        u = net(prompts, condition=neg)[:, -1]
    hp.assert_close(got.double(), u + 2.0 * (j - u), "negative condition", torch.float64)


def test_guidance_schedule_callable_and_interval():
    """A per-step schedule equals guiding each step with its own scale (checked step by step against
    ``next_token_logits`` on the tokens generated so far); outside ``guidance_interval`` the fully
    conditional branch is sampled."""
    net = _net(torch.float64)
    model = sf.AutoregressiveWrapper(net)
    inp = _inputs()
    kw = dict(context=inp["context"], context_mask=inp["context_mask"], condition=inp["condition"])
    prompts = inp["x"][:, :2]
    for cond_scale, interval, per_step in (
        (lambda t: [1.0, 3.0, {"context": 2.0, "condition": 0.5}][t], None, [1.0, 3.0, {"context": 2.0, "condition": 0.5}]),
        (4.0, (1, 2), [1.0, 4.0, 1.0]),
    ):
        seen = []

        def capture(logits, seen=seen):
            seen.append(logits.clone())
            return logits

        torch.manual_seed(0)
        toks = model.generate(prompts, 3, cond_scale=cond_scale, guidance_interval=interval, filter_logits_fn=capture, **kw)
        assert len(seen) == 3
        for t, scale in enumerate(per_step):
            want = model.next_token_logits(torch.cat((prompts, toks[:, :t]), 1), cond_scale=scale, **kw)
            hp.assert_close(seen[t].double(), want.double(), f"step {t} with scale {scale}", torch.float64)
    plain = model.next_token_logits(prompts, cond_scale=1.0, **kw)
    assert not torch.allclose(model.next_token_logits(prompts, cond_scale=4.0, **kw), plain), "guidance must matter here"


def test_guidance_argument_errors():
    net = _net(torch.float64)
    model = sf.AutoregressiveWrapper(net)
    inp = _inputs()
    p = inp["x"][:, :2]
    with pytest.raises(ValueError, match="prepend"):  # a scale for a condition not given
        model.generate(p, 1, context=inp["context"], cond_scale={"prepend": 2.0})
    with pytest.raises(ValueError, match="guidance_interval"):
        model.generate(p, 1, context=inp["context"], cond_scale=2.0, guidance_interval=(3, 1))
    with pytest.raises(ValueError, match="guidance_space"):
        model.generate(p, 1, context=inp["context"], cond_scale=2.0, guidance_space="probs")
    with pytest.raises(ValueError, match="condition"):
        model.generate(p, 1, condition=torch.randn(3, K + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="prepend_embeds"):
        model.generate(p, 1, prepend_embeds=torch.randn(3, 2, C + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="cond_scale"):
        model.generate(p, 1, context=inp["context"], cond_scale={"joint": float("inf")})


# ----------------------------------------------------------------------------------------------------
# regularisers around conditions
# ----------------------------------------------------------------------------------------------------


def test_cross_attn_tokens_dropout_may_empty_a_sample_safely():
    torch.manual_seed(0)
    dec = sf.Decoder(dim=C, depth=2, heads=2, dim_head=8, cross_attend=True, cross_attn_tokens_dropout=0.9)
    x = torch.randn(8, 3, C, requires_grad=True)
    ctx = torch.randn(8, 2, C)
    ctx[:, 1] = NAN  # masked by context_mask: never matters, dropped or not
    cm = torch.tensor([[True, False]] * 8)
    dec.train()
    with torch.autograd.detect_anomaly():
        out = dec(x, context=ctx, context_mask=cm)
        out.sum().backward()
    hp.assert_finite(out, "output")
    hp.assert_finite(x.grad, "grad of x")
    dec.eval()
    a, b = dec(x, context=ctx, context_mask=cm), dec(x, context=ctx, context_mask=cm)
    hp.assert_bitwise(a, b, "no token dropout at evaluation")


def test_layer_dropout_is_per_sample_in_training_and_off_at_evaluation():
    torch.manual_seed(0)
    dec = sf.Decoder(dim=C, depth=3, heads=2, dim_head=8, layer_dropout=0.5)
    x = torch.randn(16, 3, C)
    dec.eval()
    ref = dec(x)
    hp.assert_bitwise(dec(x), ref, "evaluation is deterministic")
    dec.train()
    out = dec(x)
    differs = (out - ref).abs().flatten(1).amax(1) > 1e-6
    assert 0 < int(differs.sum()) < 16 or int(differs.sum()) == 16  # some branches skipped per sample
    assert len({tuple(r.tolist()) for r in (out - ref).abs().flatten(1).amax(1, keepdim=True)}) > 1, "the draw is per sample"
    with pytest.raises(ValueError, match="layer_dropout"):
        sf.Decoder(dim=C, depth=1, layer_dropout=1.0)
    with pytest.raises(ValueError, match="cross_attn_tokens_dropout"):
        sf.Decoder(dim=C, depth=1, cross_attn_tokens_dropout=0.1)
