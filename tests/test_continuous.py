"""``ContinuousAutoregressiveWrapper``: next-step losses on vectors (MSE, L1, Gaussian NLL) and guided
generation (safeformer/continuous.py).

The clause-by-clause probe runs in test_doors.py (``probe_continuous_autoregressive``); this file checks
what the wrapper means: the losses equal the formulas by hand, garbage at padded targets and in masked
or dropped conditions never matters (loss and every gradient bit for bit), an all-padding batch is a
loss of exactly 0 with zero gradients, guided generation equals the formula computed from separate
forward passes (joint, per kind, per step), all branches run in one batched forward sharing one cache,
cached equals uncached, and bad arguments are clear errors. Last, a smoke test of
examples/continuous_signal.py.

Shape legend: b batch, n steps, d features (dim_in), j context length, m prefix length, K condition
width, C model width.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import helpers as hp
import pytest
import torch

import safeformer as sf
from safeformer.core.conditions import VALUE_LIMIT

NAN, INF = float("nan"), float("inf")
GARBAGE = (NAN, INF, -INF, 1e4)
C, CC, K, D = 16, 6, 3, 2
KINDS = ("context", "prepend", "condition")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


def _net(*, probabilistic=False, d=D, dtype=torch.float64, cross=True, adaptive=True, rotary=False, seed=0):
    torch.manual_seed(seed)
    net = sf.ContinuousTransformerWrapper(dim_in=d, dim_out=2 * d if probabilistic else d, max_seq_len=32, attn_layers=sf.Decoder(
        dim=C, depth=2, heads=2, dim_head=8, cross_attend=cross, dim_context=CC, rotary_pos_emb=rotary,
        use_adaptive_layernorm=adaptive, use_adaptive_layerscale=adaptive, dim_condition=K if adaptive else None))
    with torch.no_grad():  # the adaptive projections start at zero: make the condition matter
        for name, p in net.named_parameters():
            if "to_gamma" in name or "to_beta" in name or "to_gate" in name or "null_condition" in name:
                p.copy_(torch.randn(p.shape) * 0.5)
    return net.to(dtype)


def _model(probabilistic=False, **kw):
    loss = kw.pop("loss", "mse")
    wrapper_kw = {k: kw.pop(k) for k in ("cond_drop_prob", "cond_drop_all_prob", "min_variance") if k in kw}
    return sf.ContinuousAutoregressiveWrapper(_net(probabilistic=probabilistic, **kw), probabilistic=probabilistic,
                                              loss=loss, **wrapper_kw)


def _conds(b=3, j=4, m=3, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(
        context=torch.randn(b, j, CC, generator=g).to(dtype),
        context_mask=torch.tensor([[True, True, False, True], [False] * 4, [True, False, False, False]])[:b, :j],
        prepend_embeds=torch.randn(b, m, C, generator=g).to(dtype),
        prepend_mask=torch.tensor([[True, True, True], [False, True, False], [False, False, False]])[:b, :m],
        condition=torch.randn(b, K, generator=g).to(dtype),
        condition_mask=torch.tensor([True, False, True])[:b],
    )


def _seq(b=3, n=6, d=D, dtype=torch.float64, seed=2, left=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, generator=g).to(dtype)
    lengths = torch.tensor([n, n - 2, 1][:b])
    return x, sf.padding_mask(lengths, n, left=left)


def _subset(conds: dict, kinds) -> dict:
    names = {"context": ("context", "context_mask"), "prepend": ("prepend_embeds", "prepend_mask"),
             "condition": ("condition", "condition_mask")}
    return {name: conds[name] for k in kinds for name in names[k] if name in conds}


# ----------------------------------------------------------------------------------------------------
# the losses
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mse", "l1", "gaussian"])
@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
def test_loss_equals_the_formula_by_hand(kind, left):
    """Mean over counted targets (a target counts when it and the position predicting it are real) of
    the per-target loss averaged over features; the Gaussian NLL with the floored variance."""
    probabilistic = kind == "gaussian"
    model = _model(probabilistic, loss="mse" if probabilistic else kind, min_variance=0.05)
    x, mask = _seq(left=left)
    conds = _conds()
    got = model(x, mask=mask, **conds)
    with torch.no_grad():
        out = model.net(x[:, :-1], mask=mask[:, :-1], excise_prepend_embeds=True, **conds)
    tgt = x[:, 1:]
    if probabilistic:
        mean, raw = out[..., :D], out[..., D:]
        var = raw.exp() + 0.05
        per = 0.5 * (var.log() + (tgt - mean) ** 2 / var)
    else:
        per = (out - tgt) ** 2 if kind == "mse" else (out - tgt).abs()
    counted = mask[:, 1:] & mask[:, :-1]
    want = per.mean(-1)[counted].mean()
    hp.assert_close(got.detach(), want, f"{kind} loss", torch.float64)
    none = model(x, mask=mask, reduction="none", **conds)
    assert none.shape == counted.shape
    hp.assert_zero(none[~counted], "per-target losses that do not count")
    hp.assert_close(model(x, mask=mask, reduction="sum", **conds).detach(), per.mean(-1)[counted].sum(), "sum", torch.float64)


def test_gaussian_nll_is_finite_for_extreme_log_variances():
    """Raw log-variances of +-1e4 (exp overflows float32 either way) give a finite loss and gradient:
    the floor is a logaddexp and nothing is exponentiated upward."""
    model = _model(True, dtype=torch.float32)
    x, mask = _seq(dtype=torch.float32)
    old = model.net.project_out  # x-transformers' projection has no bias: one with a bias to set
    model.net.project_out = torch.nn.Linear(old.in_features, old.out_features, dtype=old.weight.dtype)
    with torch.no_grad():
        model.net.project_out.weight.copy_(old.weight)
        model.net.project_out.bias.zero_()
        model.net.project_out.bias[D:] = torch.tensor([1e4, -1e4])
    loss = model(x, mask=mask)
    loss.backward()
    hp.assert_finite(loss, "loss")
    for name, p in model.named_parameters():
        if p.grad is not None:
            hp.assert_finite(p.grad, f"grad of {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_stays_finite(dtype):
    """S7: the loss is computed in float32 (errors of 300 square to 9e4, beyond float16), and guided
    values beyond the dtype's range (a scale of 1e6) saturate instead of becoming inf."""
    model = _model(True, dtype=torch.float32).to(dtype)
    x, mask = _seq(dtype=dtype)
    conds = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _conds(dtype=torch.float32).items()}
    loss = model(x * 300, mask=mask, **conds)
    assert loss.dtype == torch.float32
    loss.backward()
    hp.assert_finite(loss, "loss")
    for name, p in model.named_parameters():
        if p.grad is not None:
            hp.assert_finite(p.grad, f"grad of {name}")
    start, smask = _start(dtype=dtype)
    # saturated values are fed back: they stay within what the net takes (a quarter of float16's range)
    out = model.generate(start, 3, mask=smask, cond_scale=1e6, temperature=1.0, **conds)
    assert out.dtype == dtype
    hp.assert_finite(out, "generated with cond_scale=1e6")
    if dtype == torch.float16:
        bound = min(torch.finfo(dtype).max / 4, VALUE_LIMIT)
        assert bool((out.abs() == bound).any()), "the guided value should have saturated"


def _loss_and_grads(model, x, mask, **kw):
    model.zero_grad(set_to_none=True)
    loss = model(x, mask=mask, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("probabilistic", [False, True], ids=["mse", "gaussian"])
@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("value", GARBAGE, ids=["nan", "inf", "-inf", "1e4"])
def test_garbage_at_padded_steps_never_matters(probabilistic, left, value):
    """NaN/inf at padded steps of x (which are both inputs and targets), at masked context and prefix
    positions and in a dropped adaptive condition: the loss and every gradient equal the clean ones bit
    for bit, and are finite."""
    model = _model(probabilistic, dtype=torch.float32)
    x, mask = _seq(dtype=torch.float32, left=left)
    conds = _conds(dtype=torch.float32)
    clean = _loss_and_grads(model, x, mask, **conds)
    dirty_x = x.masked_fill(~mask[..., None], value)
    dirty = dict(conds)
    dirty["context"] = conds["context"].masked_fill(~conds["context_mask"][..., None], value)
    dirty["prepend_embeds"] = conds["prepend_embeds"].masked_fill(~conds["prepend_mask"][..., None], value)
    dirty["condition"] = conds["condition"].masked_fill(~conds["condition_mask"][:, None], value)
    got = _loss_and_grads(model, dirty_x, mask, **dirty)
    hp.assert_bitwise(got[0], clean[0], "loss")
    assert set(got[1]) == set(clean[1])
    for name, g in clean[1].items():
        hp.assert_bitwise(got[1][name], g, f"grad of {name}")
    xg = dirty_x.clone().requires_grad_()
    model(xg, mask=mask, **dirty).backward()
    hp.assert_zero(xg.grad[~mask], "grad at padded steps")
    hp.assert_finite(xg.grad, "grad of x")


@pytest.mark.parametrize("probabilistic", [False, True], ids=["mse", "gaussian"])
def test_all_padding_batch_is_exactly_zero_with_zero_gradients(probabilistic):
    model = _model(probabilistic, dtype=torch.float32)
    x, _ = _seq(dtype=torch.float32)
    conds = _conds(dtype=torch.float32)
    _, normal = _loss_and_grads(model, x, None, **conds)
    none = torch.zeros(x.shape[:2], dtype=torch.bool)
    loss, grads = _loss_and_grads(model, x.masked_fill(~none[..., None], NAN), none, **conds)
    assert loss.item() == 0.0 and loss.dtype == torch.float32
    assert set(grads) == set(normal), "a parameter got None instead of a zero gradient"
    for name, g in grads.items():
        hp.assert_zero(g, f"grad of {name}")
    # one step per sample: no target at all
    loss, grads = _loss_and_grads(model, x[:, :1], None, **conds)
    assert loss.item() == 0.0
    for name, g in grads.items():
        hp.assert_zero(g, f"grad of {name} (one step, no target)")


def test_padded_sample_scores_what_it_scores_alone():
    """S4: a sample's summed loss is the same alone, right-padded or left-padded in a batch."""
    model = _model(True, rotary=True)
    conds = _conds()
    for left in (False, True):
        x, mask = _seq(left=left)
        per = model(x, mask=mask, reduction="none", **conds).sum(1)
        for s in range(3):
            alone = model(x[s : s + 1, mask[s]], reduction="sum", **{k: v[s : s + 1] for k, v in conds.items()})
            hp.assert_close(per[s], alone.detach(), f"sample {s} (left={left})", torch.float64)


# ----------------------------------------------------------------------------------------------------
# dropping conditions for CFG
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("probabilistic", [False, True], ids=["mse", "gaussian"])
def test_dropped_conditions_contents_never_matter(probabilistic):
    """In training mode every kind is dropped per sample: NaN in whatever was dropped changes neither
    the loss nor any gradient, and a dropped sample's loss is the one computed without that condition."""
    probs = {"context": 0.5, "prepend": 0.5, "condition": 0.5}
    model = _model(probabilistic, dtype=torch.float32, cond_drop_prob=probs, cond_drop_all_prob=0.2).train()
    x, mask = _seq(b=3, dtype=torch.float32)
    x, mask = torch.cat([x, x]), torch.cat([mask, mask])
    conds = {k: torch.cat([v, v]) for k, v in _conds(dtype=torch.float32).items()}
    seed = 2
    _, dropped = sf.drop_conditions(sf.Conditions(**conds), probs, all_prob=0.2, generator=torch.Generator().manual_seed(seed))
    assert all(bool(d.any()) and bool((~d).any()) for d in dropped.values()), "pick a seed that drops some of each kind"
    poisoned = dict(conds)
    poisoned["context"] = conds["context"].masked_fill(dropped["context"][:, None, None], NAN)
    poisoned["prepend_embeds"] = conds["prepend_embeds"].masked_fill(dropped["prepend"][:, None, None], NAN)
    poisoned["condition"] = conds["condition"].masked_fill(dropped["condition"][:, None], NAN)

    def run(kw):
        model.zero_grad(set_to_none=True)
        loss = model(x, mask=mask, generator=torch.Generator().manual_seed(seed), **kw)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    clean, g_clean = run(conds)
    dirty, g_dirty = run(poisoned)
    hp.assert_bitwise(dirty, clean, "loss with NaN in dropped conditions")
    for n, g in g_clean.items():
        hp.assert_bitwise(g_dirty[n], g, f"grad of {n}")
    per = model(x, mask=mask, reduction="none", generator=torch.Generator().manual_seed(seed), **poisoned)
    model.eval()
    explicit = dict(conds)
    explicit["context_mask"] = conds["context_mask"] & ~dropped["context"][:, None]
    explicit["prepend_mask"] = conds["prepend_mask"] & ~dropped["prepend"][:, None]
    explicit["condition_mask"] = conds["condition_mask"] & ~dropped["condition"]
    want = model(x, mask=mask, reduction="none", **explicit)
    hp.assert_close(per.detach(), want.detach(), "per-target loss vs the conditions dropped by hand", torch.float32)


def test_cond_drop_arguments_are_checked():
    net = _net(cross=False, adaptive=False)
    with pytest.raises(ValueError, match="cond_drop_prob"):
        sf.ContinuousAutoregressiveWrapper(net, cond_drop_prob=1.5)
    with pytest.raises(ValueError, match="text"):
        sf.ContinuousAutoregressiveWrapper(net, cond_drop_prob={"text": 0.1})
    with pytest.raises(ValueError, match="context"):
        sf.ContinuousAutoregressiveWrapper(net, cond_drop_prob={"context": 0.1})  # no cross-attention
    with pytest.raises(ValueError, match="cond_drop_all_prob"):
        sf.ContinuousAutoregressiveWrapper(net, cond_drop_all_prob=True)


# ----------------------------------------------------------------------------------------------------
# guided generation
# ----------------------------------------------------------------------------------------------------


def _branch_out(net, seq, seq_mask, conds, keep, negative=None):
    """Last-real-step output (b, dim_out) of one forward with only the kinds in ``keep`` real."""
    kw = {}
    for kind in KINDS:
        sub = _subset(conds, (kind,))
        if not sub:
            continue
        if kind not in keep:
            if negative and kind in negative:
                sub = negative[kind]
            else:
                mname = [k for k in sub if k.endswith("mask")][0]
                sub[mname] = sub[mname] & False
        kw.update(sub)
    with torch.no_grad():
        out = net(seq, mask=seq_mask, excise_prepend_embeds=True, **kw)
    idx = torch.where(seq_mask, torch.arange(seq.shape[1]), -1).amax(1)
    return out[torch.arange(seq.shape[0]), idx].double()


def _start(b=3, n0=3, d=D, dtype=torch.float64, seed=4):
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(b, n0, d, generator=g).to(dtype)
    mask = sf.padding_mask(torch.tensor([n0, 1, 2][:b]), n0, left=True)
    return start, mask


SCALES = {
    "joint": 3.0,
    "per-kind": {"joint": 0.5, "context": 2.0, "prepend": -0.5, "condition": 1.5},
    "schedule": lambda t: [1.0, 2.0, {"context": 3.0}, 0.0][t],
}


@pytest.mark.parametrize("scale", list(SCALES), ids=list(SCALES))
def test_guided_generation_equals_the_formula_from_separate_passes(scale):
    """Every generated step equals ``uncond + sum_k s_k (cond_k - uncond)`` of separate uncached forward
    passes on the steps so far (each branch with only its kinds kept), step by step."""
    model = _model()
    conds = _conds()
    start, smask = _start()
    cond_scale = SCALES[scale]
    out = model.generate(start, 4, mask=smask, cond_scale=cond_scale, **conds)
    assert out.shape == (3, 4, D)
    for t in range(4):
        seq = torch.cat((start, out[:, :t]), 1)
        sm = torch.cat((smask, torch.ones(3, t, dtype=torch.bool)), 1)
        s = cond_scale(t) if callable(cond_scale) else cond_scale
        s = s if isinstance(s, dict) else {"joint": s}
        br = {"uncond": _branch_out(model.net, seq, sm, conds, set()), "joint": _branch_out(model.net, seq, sm, conds, set(KINDS))}
        for kind in KINDS:
            br[kind] = _branch_out(model.net, seq, sm, conds, {kind})
        want = br["uncond"] + sum(v * (br[k] - br["uncond"]) for k, v in s.items())
        hp.assert_close(out[:, t], want, f"step {t} with scale {s}", torch.float64)


def test_probabilistic_guides_the_mean_and_samples_with_the_joint_variance():
    model = _model(True, min_variance=1e-3)
    conds = _subset(_conds(), ("context", "condition"))
    start, smask = _start()
    with torch.no_grad():
        u = _branch_out(model.net, start, smask, conds, set())
        j = _branch_out(model.net, start, smask, conds, {"context", "condition"})
    mean = u[:, :D] + 2.5 * (j[:, :D] - u[:, :D])
    log_var = torch.logaddexp(j[:, D:], torch.tensor(math.log(1e-3), dtype=torch.float64))
    greedy = model.generate(start, 1, mask=smask, cond_scale=2.5, temperature=0.0, **conds)
    hp.assert_close(greedy[:, 0], mean, "temperature 0: the guided mean", torch.float64)
    noise = torch.randn(3, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    drawn = model.generate(start, 1, mask=smask, cond_scale=2.5, temperature=0.7,
                           generator=torch.Generator().manual_seed(9), **conds)
    want = mean + torch.exp(0.5 * log_var) * math.sqrt(0.7) * noise
    hp.assert_close(drawn[:, 0], want, "a draw: guided mean, joint variance * temperature", torch.float64)


@pytest.mark.parametrize("probabilistic", [False, True], ids=["mse", "gaussian"])
@pytest.mark.parametrize("kinds", [(), ("context",), ("prepend",), ("condition",), KINDS],
                         ids=["none", "context", "prefix", "condition", "all"])
@pytest.mark.parametrize("cond_scale", [1.0, 2.5, "per-kind"])
def test_cached_generation_equals_uncached(probabilistic, kinds, cond_scale):
    model = _model(probabilistic, rotary=True)
    conds = _subset(_conds(), kinds)
    start, smask = _start()
    scale = {k: 1.5 + i for i, k in enumerate(kinds)} if cond_scale == "per-kind" else cond_scale
    kw = dict(mask=smask, cond_scale=scale, temperature=0.5, **conds)
    a = model.generate(start, 5, cache_kv=True, generator=torch.Generator().manual_seed(0), **kw)
    b = model.generate(start, 5, cache_kv=False, generator=torch.Generator().manual_seed(0), **kw)
    hp.assert_close(a, b, "cached vs uncached", torch.float64)


def test_all_branches_run_in_one_batched_forward_sharing_one_cache():
    model = _model()
    conds = _conds()
    start, smask = _start()
    calls = []

    def record(module, args, kwargs):
        calls.append((args[0].shape[0], args[0].shape[1], kwargs.get("cache") is not None))

    handle = model.net.register_forward_pre_hook(record, with_kwargs=True)
    try:
        model.generate(start, 4, mask=smask, cond_scale={"context": 2.0, "condition": 1.5}, **conds)
    finally:
        handle.remove()
    # branches: uncond, context, condition (no joint: not asked for) = 3 * b, one forward per step
    assert calls == [(9, 3, False), (9, 1, True), (9, 1, True), (9, 1, True)], calls
    calls.clear()
    handle = model.net.register_forward_pre_hook(record, with_kwargs=True)
    try:
        model.generate(start, 2, mask=smask, cond_scale=1.0, **conds)  # plain: one branch
    finally:
        handle.remove()
    assert calls == [(3, 3, False), (3, 1, True)], calls
    calls.clear()
    handle = model.net.register_forward_pre_hook(record, with_kwargs=True)
    try:
        zero = model.generate(start, 2, mask=smask, cond_scale=0.0, **conds)  # unconditional: one branch
    finally:
        handle.remove()
    assert calls == [(3, 3, False), (3, 1, True)], calls
    dropped = dict(conds, context_mask=conds["context_mask"] & False, prepend_mask=conds["prepend_mask"] & False,
                   condition_mask=conds["condition_mask"] & False)
    hp.assert_close(zero, model.generate(start, 2, mask=smask, **dropped), "cond_scale=0 vs every condition dropped",
                    torch.float64)


def test_left_padded_start_equals_each_start_alone():
    """S4 for generation: a left-padded batch generates what each start generates alone."""
    model = _model(rotary=True)
    conds = _conds()
    start, smask = _start()
    start = start.masked_fill(~smask[..., None], NAN)
    out = model.generate(start, 4, mask=smask, cond_scale=2.0, **conds)
    hp.assert_finite(out, "generated")
    for s in range(3):
        alone = model.generate(start[s : s + 1, smask[s]], 4, cond_scale=2.0, **{k: v[s : s + 1] for k, v in conds.items()})
        hp.assert_close(out[s : s + 1], alone, f"sample {s} alone", torch.float64)


def test_sample_with_an_empty_context_is_unconditional_and_negatives_replace_the_null():
    model = _model(adaptive=False)
    conds = _subset(_conds(), ("context",))
    start, smask = _start()
    out = model.generate(start, 3, mask=smask, cond_scale=4.0, **conds)
    plain = model.generate(start[1:2], 3, mask=smask[1:2])  # sample 1's context is all masked
    hp.assert_close(out[1:2], plain, "an empty context is no condition, whatever the scale", torch.float64)
    neg = torch.randn(1, 2, CC, dtype=torch.float64)
    got = model.generate(start, 1, mask=smask, cond_scale=2.0, negative_context=neg, **conds)
    u = _branch_out(model.net, start, smask, conds, set(), negative={"context": {"context": neg.expand(3, -1, -1)}})
    j = _branch_out(model.net, start, smask, conds, {"context"})
    hp.assert_close(got[:, 0], u + 2.0 * (j - u), "negative context in the unconditional branch", torch.float64)


def test_guidance_rescale_pulls_the_std_toward_the_joint_branch():
    model = _model(adaptive=False)
    conds = _subset(_conds(), ("context",))
    start, smask = _start()
    got = model.generate(start, 1, mask=smask, cond_scale=3.0, guidance_rescale=0.6, **conds)
    u = _branch_out(model.net, start, smask, conds, set())
    j = _branch_out(model.net, start, smask, conds, {"context"})
    g = u + 3.0 * (j - u)
    rescaled = g * j.std(-1, keepdim=True) / g.std(-1, keepdim=True)
    hp.assert_close(got[:, 0], 0.6 * rescaled + 0.4 * g, "rescaled guidance", torch.float64)


def test_generate_argument_errors():
    model = _model()
    conds = _conds()
    start, smask = _start()
    one = _model(d=1)
    cases = [
        (lambda: model.generate(start.long(), 2), TypeError, "start"),
        (lambda: model.generate(start[:, :, :1], 2), ValueError, "start"),
        (lambda: model.generate(start[:, :0], 2), ValueError, "n0 = 0"),
        (lambda: model.generate(start, 2, mask=smask.int()), TypeError, "mask"),
        (lambda: model.generate(start, 2.0), ValueError, "seq_len"),
        (lambda: model.generate(start, 2, guidance_rescale=1.5), ValueError, "guidance_rescale"),
        (lambda: one.generate(start[..., :1], 2, context=conds["context"], cond_scale=2.0, guidance_rescale=0.5), ValueError, "dim_in"),
        (lambda: model.generate(start, 2, cond_scale={"joint": INF}, **conds), ValueError, "cond_scale"),
        (lambda: model.generate(start, 2, guidance_interval=(3, 1), cond_scale=2.0, **conds), ValueError, "guidance_interval"),
        (lambda: model.generate(start, 2, context=conds["context"][:, :, :-1]), ValueError, "context"),
        (lambda: model.generate(start, 2, condition=conds["condition"][:2]), ValueError, "condition"),
        (lambda: model.generate(start, 2, negative_condition=conds["condition"]), ValueError, "negative_condition"),
        (lambda: model.generate(start, 2, negative_context=conds["context"][:, :, :-1]), ValueError, "negative_context"),
        (lambda: model.generate(start, 2, prepend_mask=conds["prepend_mask"]), ValueError, "prepend_mask"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()


def test_constructor_errors():
    with pytest.raises(TypeError, match="ContinuousTransformerWrapper"):
        sf.ContinuousAutoregressiveWrapper(sf.TransformerWrapper(num_tokens=5, max_seq_len=8, attn_layers=sf.Decoder(dim=8, depth=1)))
    with pytest.raises(ValueError, match="loss"):
        sf.ContinuousAutoregressiveWrapper(_net(), loss="huber")
    with pytest.raises(ValueError, match="probabilistic"):
        sf.ContinuousAutoregressiveWrapper(_net(probabilistic=True), probabilistic=True, loss="l1")
    with pytest.raises(ValueError, match="min_variance"):
        sf.ContinuousAutoregressiveWrapper(_net(probabilistic=True), probabilistic=True, min_variance=0.0)
    with pytest.raises(ValueError, match="dim_out"):
        sf.ContinuousAutoregressiveWrapper(_net(probabilistic=True))
    with pytest.raises(TypeError, match="probabilistic"):
        sf.ContinuousAutoregressiveWrapper(_net(), probabilistic=1)


def test_save_and_load_round_trip(tmp_path):
    model = _model(True, dtype=torch.float32, cond_drop_prob={"context": 0.2})
    model.save_pretrained(tmp_path / "ckpt")
    back = sf.ContinuousAutoregressiveWrapper.from_pretrained(tmp_path / "ckpt")
    assert back.probabilistic and back.cond_drop_probs == model.cond_drop_probs
    x, mask = _seq(dtype=torch.float32)
    model.eval()
    back.eval()
    hp.assert_bitwise(back(x, mask=mask), model(x, mask=mask), "loss after reloading")


# ----------------------------------------------------------------------------------------------------
# the example
# ----------------------------------------------------------------------------------------------------


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_continuous_signal_example_smoke(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        example = _load_example("continuous_signal")
        result = example.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "cond_scale" in printed and "accuracy" in printed
    assert set(result["accuracy"]) == {0.0, 1.0, 3.0}
    assert all(0.0 <= a <= 1.0 for a in result["accuracy"].values())
    assert result["real_accuracy"] >= 0.9, "the classifier must recognise real signals"
    assert math.isfinite(result["final_loss"])
    png = tmp_path / "continuous_signal.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
