"""Tests for ``safeformer.debug`` (find_nonfinite, mask_report, plot_mask) and the wrappers'
``check_finite`` mode (docs/safety.md, S9).

Shape legend: b batch, n positions, j context length, c model width, h heads, i queries.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from safeformer import ContinuousTransformerWrapper, Decoder, Encoder, TransformerWrapper
from safeformer.debug import find_nonfinite, mask_report, plot_mask

NAN, INF = float("nan"), float("inf")


def small_decoder(seed: int = 0, **kw) -> TransformerWrapper:
    torch.manual_seed(seed)
    return TransformerWrapper(
        num_tokens=23, max_seq_len=16,
        # the padded path: these tests name shapes of the padded layout (the unpadded path packs real tokens)
        attn_layers=Decoder(dim=16, depth=2, heads=2, dim_head=8, cross_attend=True, unpadded=kw.pop("unpadded", False), **kw),
    )


def decoder_inputs(seed: int = 0):
    """Tokens with left padding in sample 0 (dead rows under causal), a context whose sample 1 is all padding."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 23, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[2, 5:] = False  # right padding
    context = torch.randn(3, 4, 16, generator=gen)
    context_mask = torch.ones(3, 4, dtype=torch.bool)
    context_mask[1] = False  # dropped condition: dead cross-attention rows
    context_mask[2, 2:] = False
    return x, dict(mask=mask, context=context, context_mask=context_mask)


def no_hooks_left(model: nn.Module) -> bool:
    for m in model.modules():
        if m._forward_hooks or m._backward_hooks or m._forward_pre_hooks or getattr(m, "_backward_pre_hooks", None):
            return False
    return all(not p._backward_hooks for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# find_nonfinite
# ----------------------------------------------------------------------------------------------------


def test_find_nonfinite_names_the_module_with_a_planted_nan_weight():
    model = small_decoder()
    assert model.attn_layers.layer_kinds[4] == "cross"
    with torch.no_grad():
        model.attn_layers.layers[4][1].to_v.weight[3, 5] = NAN
    x, kw = decoder_inputs()
    report = find_nonfinite(model, x, **kw)
    assert not report.finite
    f = report.forward
    assert f.module == "attn_layers.layers.4.1.to_v"
    assert f.module_type == "Linear" and f.phase == "forward" and f.what == "output"
    # a NaN weight in row 3 makes output feature 3 NaN at every (sample, context position): 0 * NaN = NaN
    assert f.shape == (3, 4, 16)
    assert (f.nan, f.posinf, f.neginf) == (12, 0, 0)
    assert f.first_index == (0, 0, 3)
    assert report.forward_offenders[0] == "attn_layers.layers.4.1.to_v"
    assert "attn_layers.layers.4.1.to_v" in str(report) and "12 NaN" in str(report)
    assert "attn_layers.layers.4.1.to_v.weight" in report.nonfinite_parameters
    assert no_hooks_left(model)


def test_find_nonfinite_counts_inf_in_a_norm():
    model = small_decoder()
    with torch.no_grad():
        model.attn_layers.layers[2][0][0].gamma[1] = -INF  # the feed-forward's pre-norm of layer 1
    x, kw = decoder_inputs()
    report = find_nonfinite(model, x, **kw)
    f = report.forward
    assert f.module == "attn_layers.layers.2.0.0" and f.module_type == "LayerNorm"
    assert f.nan == 0 and f.posinf + f.neginf == 3 * 7  # every position's feature 1, the sign its normed value's
    assert f.first_index == (0, 0, 1)


class _SqrtAbs(nn.Module):
    """Finite forward, NaN backward at 0: d|x|^0.5/dx = sign(x) / (2 sqrt|x|) = 0 * inf."""

    def forward(self, x):
        return torch.sqrt(x.abs())


def test_find_nonfinite_backward_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), _SqrtAbs(), nn.Linear(6, 2))
    with torch.no_grad():  # positive inputs and weights: every unit > 0 except unit 0, exactly 0 after the ReLU
        model[0].weight.abs_()
        model[0].bias.copy_(torch.tensor([-100.0, 1, 1, 1, 1, 1]))
    x = torch.rand(5, 4)
    report = find_nonfinite(model, x)
    assert report.forward is None and report.backward_ran
    b = report.backward
    assert (b.module, b.module_type, b.what) == ("2", "_SqrtAbs", "grad_input[0]")
    assert b.incoming_finite is True and report.incoming is None  # the NaN is made inside: the module is blamed
    assert b.shape == (5, 6) and b.nan == 5 and b.first_index == (0, 0)
    # ReLU's backward *selects* (x <= 0 -> 0), so the NaN at unit 0 never reaches the first Linear: the
    # report still names the module that made a non-finite gradient although every .grad ends finite
    assert report.nonfinite_parameters == ()
    assert not report.finite
    assert "backward" in str(report) and "'2' (_SqrtAbs)" in str(report)


def test_find_nonfinite_falls_back_to_output_hooks_for_inplace_modules():
    """Full backward hooks cannot wrap nn.ReLU(inplace=True): the gradients of module outputs are checked."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), _SqrtAbs(), nn.Linear(6, 2))
    with torch.no_grad():
        model[0].weight.abs_()
        model[0].bias.copy_(torch.tensor([-100.0, 1, 1, 1, 1, 1]))
    report = find_nonfinite(model, torch.rand(5, 4))
    assert report.backward_hooks == "output"
    b = report.backward
    # the NaN gradient made by _SqrtAbs ('2') arrives at the output of the ReLU ('1') that it consumed
    assert (b.module, b.what, b.shape, b.nan) == ("1", "grad_output", (5, 6), 5)
    assert "culprit is what consumed that output" in str(report)
    assert no_hooks_left(model)


def test_find_nonfinite_a_nonfinite_loss_is_reported_and_blamed_above_the_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    report = find_nonfinite(model, torch.randn(2, 3), loss_fn=lambda out: (out / 0.0).sum())
    assert report.loss_finding is not None and report.loss_finding.phase == "loss"
    assert not math.isfinite(report.loss)
    assert report.backward is not None and report.backward.incoming_finite is False
    # d/d out of (out / 0).sum() is inf everywhere: it arrives at the outputs from outside the model
    assert report.incoming is report.backward and report.backward.phase == "incoming"
    assert report.backward.module == "" and report.backward.posinf == 2 * 3
    assert not report.finite


def masked_regression_setup(seed: int = 0):
    """A continuous encoder, a padding mask (sample 1: positions 4, 5 padded), targets NaN at padded positions."""
    torch.manual_seed(seed)
    model = ContinuousTransformerWrapper(
        max_seq_len=16, dim_in=5, dim_out=3, attn_layers=Encoder(dim=16, depth=2, heads=2, dim_head=8),
    )
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 5, generator=gen)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    target = torch.randn(2, 6, 3, generator=gen)
    target[~mask] = NAN  # padding in the targets: never real, but a multiplied mask lets it into the gradient
    return model, x, mask, target


def test_find_nonfinite_nan_targets_under_a_multiplied_mask_blame_the_loss_not_the_last_layer():
    model, x, mask, target = masked_regression_setup()
    m = mask[..., None].float()

    # d loss / d out = 2 (out - target) * mask = 0 * NaN = NaN at the padded positions: the gradient
    # that reaches the model's outputs is already NaN, and project_out (the last layer) is innocent
    report = find_nonfinite(model, x, mask=mask, loss_fn=lambda out: ((out - target) ** 2 * m).sum())
    assert report.forward is None and report.backward_ran and not report.finite
    inc = report.incoming
    assert inc is not None and report.backward is inc
    assert (inc.phase, inc.module, inc.module_type, inc.what) == ("incoming", "", "ContinuousTransformerWrapper", "grad of output")
    assert inc.incoming_finite is False
    assert inc.shape == (2, 6, 3) and (inc.nan, inc.posinf, inc.neginf) == (2 * 3, 0, 0)
    assert inc.first_index == (1, 4, 0)
    assert inc.positions == ((1, 4), (1, 5)) and inc.position_count == 2
    text = str(report)
    assert "outside the model" in text and "first at output index (1, 4, 0)" in text and "(1, 4), (1, 5)" in text
    assert "torch.where(mask, target, 0)" in text and "0 * NaN" in text
    assert "first backward" not in text and "'project_out' (Linear)" not in text
    # the parameters' .grad are still reported as they are: a fact, not a blame
    assert "project_out.weight" in report.nonfinite_parameters
    assert no_hooks_left(model) and all(p.grad is None for p in model.parameters())

    # a torch.where on the final per-position loss makes the loss finite but not its gradient:
    # where's backward sends 0 to the padded (out - target) ** 2, whose backward is 0 * 2 * NaN = NaN
    report = find_nonfinite(
        model, x, mask=mask, loss_fn=lambda out: torch.where(mask[..., None], (out - target) ** 2, 0.0).sum(),
    )
    assert report.loss_finding is None and math.isfinite(report.loss)
    assert report.incoming is not None and report.backward is report.incoming
    assert report.incoming.first_index == (1, 4, 0) and report.incoming.position_count == 2


def test_find_nonfinite_incoming_gradient_is_checked_with_the_output_hook_fallback():
    """Models with in-place modules use output hooks; the loss is still blamed before any module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    target = torch.randn(5, 2)
    target[3] = INF
    keep = torch.ones(5, 1)
    keep[3] = 0.0
    report = find_nonfinite(model, torch.rand(5, 4), loss_fn=lambda out: ((out - target) ** 2 * keep).sum())
    assert report.backward_hooks == "output"
    assert report.incoming is not None and report.backward is report.incoming
    assert report.incoming.first_index == (3, 0) and report.incoming.positions == ((3,),)
    assert report.incoming.nan == 2  # (out - inf) ** 2 * 0 = inf * 0 = NaN in the gradient, for both features
    assert "culprit is what consumed that output" not in str(report)
    assert no_hooks_left(model)


def test_find_nonfinite_with_a_finite_incoming_gradient_still_blames_the_module():
    """A correct masked loss (padding selected away) lets the NaN made inside the backward be blamed as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), _SqrtAbs(), nn.Linear(6, 2))
    with torch.no_grad():
        model[0].weight.abs_()
        model[0].bias.copy_(torch.tensor([-100.0, 1, 1, 1, 1, 1]))
    keep = torch.tensor([True, True, False, True, True])[:, None]
    target = torch.randn(5, 2)
    target[~keep[:, 0]] = NAN
    clean = torch.where(keep, target, 0.0)
    report = find_nonfinite(model, torch.rand(5, 4), loss_fn=lambda out: torch.where(keep, out - clean, 0.0).pow(2).sum())
    assert report.incoming is None and report.loss_finding is None
    b = report.backward
    assert (b.phase, b.module, b.module_type, b.what) == ("backward", "2", "_SqrtAbs", "grad_input[0]")
    assert b.incoming_finite is True and b.nan == 5  # unit 0 of every row: sqrt's backward at 0 is g / 0, NaN even for g = 0
    assert "outside the model" not in str(report) and "'2' (_SqrtAbs)" in str(report)


def test_find_nonfinite_masked_loss_that_selects_padding_away_is_all_finite():
    model, x, mask, target = masked_regression_setup()
    clean = torch.where(mask[..., None], target, 0.0)  # the fix the report suggests
    m = mask[..., None].float()
    losses = {
        "select the targets, then multiply": lambda out: ((out - clean) ** 2 * m).sum(),
        "index the real positions": lambda out: ((out[mask] - target[mask]) ** 2).sum(),
        "finite targets, multiplied mask": lambda out: ((out - torch.nan_to_num(target)) ** 2 * m).sum(),
    }
    for name, loss_fn in losses.items():
        report = find_nonfinite(model, x, mask=mask, loss_fn=loss_fn)
        assert report.finite, f"{name}: {report}"
        assert report.incoming is None and report.backward is None and report.nonfinite_parameters == ()
        assert report.backward_ran and math.isfinite(report.loss)
        assert str(report).startswith("NonFiniteReport: all finite"), name


def test_find_nonfinite_clean_safeformer_model_with_dead_rows_is_all_finite():
    model = small_decoder()
    x, kw = decoder_inputs()
    ctx = kw["context"].clone()
    ctx[~kw["context_mask"]] = NAN  # garbage in padded context: masked, so harmless (S3)
    report = find_nonfinite(model, x, **{**kw, "context": ctx})
    assert report.finite, str(report)
    assert report.forward is None and report.backward is None and report.nonfinite_parameters == ()
    assert report.backward_ran and report.outputs_checked > 20 and report.gradients_checked > 20
    assert math.isfinite(report.loss)
    assert str(report).startswith("NonFiniteReport: all finite")
    mr = mask_report(padding_mask=kw["mask"], causal=True, context_mask=kw["context_mask"])
    assert mr.section("self").dead_per_sample == [3, 0, 2] and mr.section("cross").dead_per_sample == [3, 7, 2]


def test_find_nonfinite_leaves_the_model_as_it_found_it():
    model = small_decoder(attn_dropout=0.0)
    model.train()
    model.attn_layers.layers[0].eval()  # a submodule in another mode must keep it
    sentinels = {}
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, 7.0)
        sentinels[name] = p.grad
    x, kw = decoder_inputs()
    ctx = kw["context"].clone().requires_grad_(True)
    ctx_grad = torch.ones_like(ctx)
    ctx.grad = ctx_grad
    report = find_nonfinite(model, x, train=False, **{**kw, "context": ctx})
    assert report.finite
    assert model.training and not model.attn_layers.layers[0].training and model.attn_layers.layers[1].training
    for name, p in model.named_parameters():
        assert p.grad is sentinels[name] and bool((p.grad == 7.0).all())
    assert ctx.grad is ctx_grad and bool((ctx.grad == 1.0).all())
    assert no_hooks_left(model)


def test_find_nonfinite_removes_hooks_when_the_model_raises():
    model = small_decoder()
    x, kw = decoder_inputs()
    with pytest.raises(ValueError, match="context"):
        find_nonfinite(model, x, mask=kw["mask"], context=torch.randn(3, 4, 5))  # wrong context width
    assert no_hooks_left(model)
    assert all(p.grad is None for p in model.parameters())


def test_find_nonfinite_rejects_non_modules():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        find_nonfinite(lambda t: t, torch.zeros(1))


# ----------------------------------------------------------------------------------------------------
# mask_report
# ----------------------------------------------------------------------------------------------------


def reference_self_dead(pad: torch.Tensor, causal: bool) -> list[list[bool]]:
    """Plain loops: query q of sample s is dead if it is padding or sees no real key (k <= q under causal)."""
    b, n = pad.shape
    out = []
    for s in range(b):
        row = []
        for q in range(n):
            keys = [k for k in range(n) if pad[s, k] and (not causal or k <= q)]
            row.append(not pad[s, q] or not keys)
        out.append(row)
    return out


def test_mask_report_left_padding_under_causal():
    pad = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    rep = mask_report(padding_mask=pad, causal=True).section("self")
    assert rep.dead_per_sample == [2, 0]
    assert rep.reason_counts(0) == {("query_padding",): 2, ("causal", "key_padding"): 2}
    assert rep.dead[0, 0].tolist() == [True, True, False, False, False]
    assert "left padding under a causal mask" in str(rep)


def test_mask_report_right_padding_is_query_padding_only():
    pad = torch.tensor([[True, True, True, False, False]])
    rep = mask_report(padding_mask=pad, causal=True).section("self")
    assert rep.dead_per_sample == [2]
    assert rep.reason_counts(0) == {("query_padding",): 2}  # padded queries still see real keys before them


def test_mask_report_fully_padded_sample_has_both_padding_reasons():
    pad = torch.tensor([[False, False, False], [True, False, True]])
    rep = mask_report(padding_mask=pad).section("self")
    assert rep.dead_per_sample == [3, 1]
    assert rep.reason_counts(0) == {("key_padding",): 3, ("query_padding",): 3}
    assert rep.reason_counts(1) == {("query_padding",): 1}


def test_mask_report_empty_context_zero_length_and_all_false():
    pad = torch.tensor([[True, True, False], [True, True, True]])
    cm = torch.tensor([[True, False], [False, False]])
    rep = mask_report(padding_mask=pad, context_mask=cm)
    cross = rep.section("cross")
    assert cross.dead_per_sample == [1, 3]
    assert cross.reason_counts(0) == {("query_padding",): 1}
    assert cross.reason_counts(1) == {("context",): 3}
    assert rep.dead_per_sample == [1 + 1, 0 + 3]
    zero = mask_report(padding_mask=pad, context_length=0).section("cross")
    assert zero.keys == 0 and zero.dead_per_sample == [3, 3]
    assert zero.reason_counts(0) == {("context",): 3, ("query_padding",): 1}
    assert "empty context" in str(zero)
    alone = mask_report(context_length=0)  # no query information: one query per sample
    assert alone.dead_per_sample == [1]


def test_mask_report_combined_mask_with_heads():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 4, 5, generator=gen) < 0.3
    mask[1, 2, 1] = False
    rep = mask_report(mask)
    sec = rep.section("mask")
    want = [sum(not bool(mask[s, h, q].any()) for h in range(3) for q in range(4)) for s in range(2)]
    assert sec.dead_per_sample == want and sum(want) > 0
    assert all(set(sec.reason_counts(s)) <= {("mask",)} for s in range(2))
    assert sec.reason_counts(1)[("mask",)] == want[1]


def test_mask_report_causal_with_more_queries_than_keys():
    mask = torch.ones(4, 2, dtype=torch.bool)  # (i, j): bottom-right causal hides every key from queries 0, 1
    sec = mask_report(mask, causal=True).section("self")
    assert sec.dead_per_sample == [2]
    assert sec.reason_counts(0) == {("causal",): 2}


@st.composite
def padding_cases(draw):
    b, n = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    left = draw(st.booleans())
    pad = torch.zeros(b, n, dtype=torch.bool)
    for s, length in enumerate(lengths):
        if left:
            pad[s, n - length:] = True
        else:
            pad[s, :length] = True
    if draw(st.booleans()):  # holes
        holes = draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, n - 1)), max_size=4))
        for s, q in holes:
            pad[s, q] = False
    return pad, draw(st.booleans())


@given(padding_cases())  # examples per test: the profile in conftest.py (30 by default)
def test_mask_report_matches_plain_loops_and_every_reason_really_kills(case):
    pad, causal = case
    sec = mask_report(padding_mask=pad, causal=causal).section("self")
    ref = reference_self_dead(pad, causal)
    b, n = pad.shape
    assert sec.dead[:, 0].tolist() == ref
    explained = torch.zeros(b, n, dtype=torch.bool)
    for reason, where in sec.reasons.items():
        for s, q in where[:, 0].nonzero().tolist():
            explained[s, q] = True
            # the factors of the reason alone leave no key for this query
            keys = [k for k in range(n)
                    if ("query_padding" not in reason or pad[s, q])
                    and ("key_padding" not in reason or pad[s, k])
                    and ("causal" not in reason or k <= q)]
            assert not keys, f"reason {reason} does not kill row {q} of sample {s}"
    assert explained.tolist() == ref  # every dead row has a reason, and only dead rows have one


def test_mask_report_errors():
    with pytest.raises(TypeError, match="padding_mask"):
        mask_report(padding_mask=torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs a mask"):
        mask_report()
    with pytest.raises(ValueError, match="padding_mask must have shape"):
        mask_report(padding_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="context_length=3 disagrees"):
        mask_report(context_mask=torch.ones(2, 4, dtype=torch.bool), context_length=3)
    with pytest.raises(ValueError, match="disagree on n"):
        mask_report(torch.ones(2, 4, 4, dtype=torch.bool), padding_mask=torch.ones(2, 5, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------------
# plot_mask
# ----------------------------------------------------------------------------------------------------


def _red_pixels(path) -> int:
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))[..., :3]  # (H, W, 3) floats in [0, 1]
    target = torch.tensor([214, 39, 40]) / 255.0
    close = (torch.from_numpy(img.copy()) - target).abs().max(-1).values < 0.03
    return int(close.sum())


def test_plot_mask_highlights_dead_rows(tmp_path):
    pytest.importorskip("matplotlib")
    alive = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    dead = alive.clone()
    dead[2] = False
    p_alive = plot_mask(alive, tmp_path / "alive.png")
    p_dead = plot_mask(torch.stack([alive, dead]), tmp_path / "dead.png", sample=1)
    for p in (p_alive, p_dead):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _red_pixels(p_alive) == 0
    assert _red_pixels(p_dead) > 100  # the dead row's band


def test_plot_mask_errors(tmp_path):
    with pytest.raises(TypeError, match="mask"):
        plot_mask(torch.ones(3, 3), tmp_path / "x.png")
    with pytest.raises(ValueError, match="sample=5"):
        plot_mask(torch.ones(2, 3, 3, dtype=torch.bool), tmp_path / "x.png", sample=5)


# ----------------------------------------------------------------------------------------------------
# check_finite on the wrappers (S9)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_check_finite_context_real_position_raises(value):
    model = small_decoder()
    model.check_finite = True
    x, kw = decoder_inputs()
    ctx = kw["context"].clone()
    ctx[2, 1, 3] = value  # position 1 of sample 2 is real
    with pytest.raises(ValueError, match=r"context holds a non-finite value .* \(2, 1\)"):
        model(x, **{**kw, "context": ctx})


def test_check_finite_context_padded_positions_are_fine_and_change_nothing():
    model = TransformerWrapper(
        num_tokens=23, max_seq_len=16, check_finite=True,
        attn_layers=Decoder(dim=16, depth=2, heads=2, dim_head=8, cross_attend=True),
    )
    x, kw = decoder_inputs()
    ctx = kw["context"].clone()
    clean = ctx.masked_fill(~kw["context_mask"][..., None], 0.0)
    ctx[~kw["context_mask"]] = NAN
    ctx[2, 3, 0] = INF
    out = model(x, **{**kw, "context": ctx})
    ref = model(x, **{**kw, "context": clean})
    real = kw["mask"]
    assert torch.isfinite(out[real]).all()
    assert torch.equal(out[real], ref[real])


def test_check_finite_forward_kwarg_overrides_the_model_setting():
    model = small_decoder()  # check_finite=False
    x, kw = decoder_inputs()
    ctx = kw["context"].clone()
    ctx[0, 0, 0] = NAN
    with pytest.raises(ValueError, match="context"):
        model(x, **{**kw, "context": ctx}, check_finite=True)
    model.check_finite = True
    out = model(x, **{**kw, "context": ctx}, check_finite=False)  # no check: the user's NaN flows
    assert torch.isnan(out[0][kw["mask"][0]]).any()
    assert torch.isfinite(out[1:][kw["mask"][1:]]).all()


def test_check_finite_context_without_mask_checks_everything():
    model = small_decoder()
    x, kw = decoder_inputs()
    ctx = kw["context"].clone()
    ctx[1, 3, 2] = NAN  # would be padding under the mask, but no mask is given
    with pytest.raises(ValueError, match="context"):
        model(x, mask=kw["mask"], context=ctx, check_finite=True)


def continuous(check: bool) -> ContinuousTransformerWrapper:
    torch.manual_seed(0)
    return ContinuousTransformerWrapper(
        max_seq_len=16, dim_in=5, dim_out=3, check_finite=check,
        attn_layers=Encoder(dim=16, depth=1, heads=2, dim_head=8, cross_attend=True),
    )


@pytest.mark.parametrize("value", [NAN, INF])
def test_check_finite_continuous_x_real_position_raises(value):
    model = continuous(True)
    x = torch.randn(2, 6, 5)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    x[1, 3, 4] = value  # real
    with pytest.raises(ValueError, match=r"^x holds a non-finite value .* \(1, 3\)"):
        model(x, mask=mask)


def test_check_finite_continuous_padded_x_and_context_are_fine():
    model = continuous(True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, generator=gen)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    ctx = torch.randn(2, 3, 16, generator=gen)
    cm = torch.tensor([[True, True, False], [False, False, False]])
    ref = model(x, mask=mask, context=ctx, context_mask=cm)
    bad_x, bad_ctx = x.clone(), ctx.clone()
    bad_x[~mask] = NAN
    bad_ctx[~cm] = -INF
    out = model(bad_x, mask=mask, context=bad_ctx, context_mask=cm)
    assert torch.isfinite(out[mask]).all() and torch.equal(out[mask], ref[mask])
    bad_ctx[0, 1, 0] = NAN  # a real context position
    with pytest.raises(ValueError, match="context"):
        model(x, mask=mask, context=bad_ctx, context_mask=cm)
