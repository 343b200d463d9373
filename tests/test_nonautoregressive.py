"""``NonAutoregressiveWrapper``: masked-token training and MaskGIT decoding with guidance
(safeformer/nonautoregressive.py).

The clause-by-clause probe runs in test_doors.py (``probe_non_autoregressive``); this file checks what
the wrapper means: the loss is the cross-entropy of the hidden real tokens only (by hand), garbage at
padding and in masked or dropped conditions never matters (loss and every gradient bit for bit), a batch
with nothing hidden is exactly 0 with zero gradients, the hidden fraction follows the schedule, decoding
reveals tokens per the schedule and keeps what it revealed, leaves no ``mask_id``, runs every guidance
branch in one forward per step, and its guided logits equal the formula from separate forward passes;
bad arguments are clear errors. Last, a smoke test of examples/maskgit_digits.py.

Shape legend: b batch, n positions, v logits, j context length, m prefix length, K condition width.
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
from safeformer.decoding.nonautoregressive import cosine_schedule, hidden_counts, linear_schedule

NAN, INF = float("nan"), float("inf")
V, MASK_ID = 9, 8  # tokens 0..7 are real, 8 hides
C, CC, K = 16, 6, 3
KINDS = ("context", "prepend", "condition")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


def _net(*, dtype=torch.float64, cross=True, adaptive=True, logits_dim=V - 1, seed=0, max_seq_len=16):
    torch.manual_seed(seed)
    net = sf.TransformerWrapper(num_tokens=V, logits_dim=logits_dim, max_seq_len=max_seq_len, attn_layers=sf.Encoder(
        dim=C, depth=2, heads=2, dim_head=8, cross_attend=cross, dim_context=CC,
        use_adaptive_layernorm=adaptive, use_adaptive_layerscale=adaptive, dim_condition=K if adaptive else None))
    with torch.no_grad():  # the adaptive projections start at zero: make the condition matter
        for name, p in net.named_parameters():
            if "to_gamma" in name or "to_beta" in name or "to_gate" in name or "null_condition" in name:
                p.copy_(torch.randn(p.shape) * 0.5)
    return net.to(dtype)


def _model(**kw):
    wrapper_kw = {k: kw.pop(k) for k in ("cond_drop_prob", "cond_drop_all_prob", "steps", "schedule", "pad_value",
                                         "no_replace_prob", "random_token_prob") if k in kw}
    return sf.NonAutoregressiveWrapper(_net(**kw), mask_id=MASK_ID, **wrapper_kw)


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


def _subset(conds: dict, kinds) -> dict:
    names = {"context": ("context", "context_mask"), "prepend": ("prepend_embeds", "prepend_mask"),
             "condition": ("condition", "condition_mask")}
    return {name: conds[name] for k in kinds for name in names[k] if name in conds}


def _tokens(b=3, n=8, seed=2, left=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V - 1, (b, n), generator=g)
    return x, sf.padding_mask(torch.tensor([n, n - 3, 1][:b]), n, left=left)


# ----------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
def test_loss_is_the_cross_entropy_of_the_hidden_real_tokens(left):
    model = _model(no_replace_prob=0.0, random_token_prob=0.0)  # plain hiding: every hidden token holds mask_id
    x, mask = _tokens(left=left)
    conds = _conds()
    losses = model(x, mask=mask, generator=torch.Generator().manual_seed(5), **conds)
    got = losses.loss  # x-transformers' Losses namedtuple: no token critic here
    assert losses.generator_loss is got and losses.critic_loss is None
    inp, hidden = model.hide_tokens(x, mask, generator=torch.Generator().manual_seed(5))  # eval: no drops drawn
    assert not bool((hidden & ~mask).any()), "a padded position was hidden"
    assert torch.equal(inp[hidden], torch.full_like(inp[hidden], MASK_ID)) and torch.equal(inp[~hidden], x[~hidden])
    with torch.no_grad():
        logp = model.net(inp, mask=mask, excise_prepend_embeds=True, **conds).log_softmax(-1)
    nll = -logp.gather(-1, x.clamp(0, V - 2)[..., None])[..., 0]
    hp.assert_close(got.detach(), nll[hidden].mean(), "loss", torch.float64)
    none = model(x, mask=mask, reduction="none", generator=torch.Generator().manual_seed(5), **conds).loss
    hp.assert_zero(none[~hidden], "per-position loss where nothing was hidden")
    hp.assert_close(none[hidden].detach(), nll[hidden], "per-position loss", torch.float64)


def _loss_and_grads(model, x, mask, seed=5, **kw):
    model.zero_grad(set_to_none=True)
    loss = model(x, mask=mask, generator=torch.Generator().manual_seed(seed), **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("value", [NAN, INF, -INF, 1e4], ids=["nan", "inf", "-inf", "1e4"])
def test_garbage_at_padding_and_in_masked_conditions_never_matters(value):
    model = _model(dtype=torch.float32, cond_drop_prob={"context": 0.5, "prepend": 0.5, "condition": 0.5}).train()
    x, mask = _tokens(left=True)
    conds = _conds(dtype=torch.float32)
    clean = _loss_and_grads(model, x, mask, **conds)
    dirty_x = x.masked_fill(~mask, 10**6 if value == value else -3)
    dirty = dict(conds)
    dirty["context"] = conds["context"].masked_fill(~conds["context_mask"][..., None], value)
    dirty["prepend_embeds"] = conds["prepend_embeds"].masked_fill(~conds["prepend_mask"][..., None], value)
    dirty["condition"] = conds["condition"].masked_fill(~conds["condition_mask"][:, None], value)
    got = _loss_and_grads(model, dirty_x, mask, **dirty)
    hp.assert_bitwise(got[0], clean[0], "loss")
    assert set(got[1]) == set(clean[1])
    for name, g in clean[1].items():
        hp.assert_bitwise(got[1][name], g, f"grad of {name}")


def test_nothing_hidden_is_exactly_zero_with_zero_gradients():
    model = _model(dtype=torch.float32)
    x, _ = _tokens()
    conds = _conds(dtype=torch.float32)
    _, normal = _loss_and_grads(model, x, None, **conds)
    none = torch.zeros_like(x, dtype=torch.bool)
    loss, grads = _loss_and_grads(model, x.masked_fill(~none, -5), none, **conds)
    assert loss.item() == 0.0
    assert set(grads) == set(normal), "a parameter got None instead of a zero gradient"
    for name, g in grads.items():
        hp.assert_zero(g, f"grad of {name}")


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_hidden_count_follows_the_schedule(schedule):
    """Per sample, ``max(1, ceil(gamma(r) * n_real))`` real tokens are hidden with ``r`` the first draw;
    over many samples the hidden fraction averages the schedule's mean (2/pi for cosine, 1/2 linear)."""
    model = _model(schedule=schedule, max_seq_len=64)
    b, n = 4000, 40
    lengths = torch.randint(0, n + 1, (b,), generator=torch.Generator().manual_seed(0))
    mask = sf.padding_mask(lengths, n)
    x = torch.zeros(b, n, dtype=torch.long)
    _, hidden = model.hide_tokens(x, mask, generator=torch.Generator().manual_seed(1))
    r = torch.rand(b, generator=torch.Generator().manual_seed(1), dtype=torch.float32).double()
    gamma = {"cosine": cosine_schedule, "linear": linear_schedule}[schedule](r)
    want = torch.minimum(torch.ceil(gamma * lengths).long().clamp(min=1), lengths)
    assert torch.equal(hidden.sum(1), want)
    assert not bool((hidden & ~mask).any())
    _, hidden = model.hide_tokens(x, None, generator=torch.Generator().manual_seed(2))  # every position real
    frac = hidden.sum(1).double().mean() / n
    mean = (2 / math.pi if schedule == "cosine" else 0.5) + 0.5 / n  # the ceil adds half a token on average
    assert abs(float(frac) - mean) < 0.02, (float(frac), mean)  # 4 sigma of 4000 draws
    per_pos = hidden.double().mean(0)  # each position equally likely to be hidden
    assert float(per_pos.max() - per_pos.min()) < 0.1


# ----------------------------------------------------------------------------------------------------
# decoding
# ----------------------------------------------------------------------------------------------------


def test_hidden_counts_per_step():
    n_real = torch.tensor([16, 5, 0])
    got = hidden_counts(cosine_schedule, 4, n_real)
    want = torch.stack([torch.floor(torch.cos(torch.tensor((s + 1) / 4 * math.pi / 2, dtype=torch.float64)) * n_real).long()
                        for s in range(4)])
    want[-1] = 0
    assert torch.equal(got, want), (got, want)


class _Recorder:
    """Records the token ids the net sees at each decoding step (its batch of branches)."""

    def __init__(self, net):
        self.inputs: list[torch.Tensor] = []
        self.handle = net.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.inputs.append(args[0].clone())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("steps", [1, 3, 6, 20])
def test_decoding_reveals_per_schedule_keeps_what_it_revealed_and_leaves_no_mask_id(steps):
    model = _model(pad_value=3)
    conds = _conds()
    n = 8
    mask = sf.padding_mask(torch.tensor([8, 5, 1]), n)
    with _Recorder(model.net) as rec:
        out = model.generate(seq_len=n, mask=mask, steps=steps, temperature=0.7, cond_scale=2.0, choice_temperature=1.0, **conds)
    assert out.shape == (3, n) and not bool((out == MASK_ID).any())
    assert bool((out[~mask] == 3).all()), "padded positions hold pad_value"
    assert len(rec.inputs) == steps, "one forward per step"
    seqs = [inp[:3] for inp in rec.inputs] + [out]
    counts = hidden_counts(cosine_schedule, steps, mask.sum(1))
    hidden = mask.sum(1)
    for s in range(steps):
        assert torch.equal((seqs[s] == MASK_ID).logical_and(mask).sum(1), hidden), f"step {s}: hidden count"
        revealed = mask & (seqs[s] != MASK_ID)
        assert torch.equal(seqs[s + 1][revealed], seqs[s][revealed]), f"step {s}: a revealed token changed"
        hidden = torch.minimum(counts[s], (hidden - 1).clamp(min=0))


def _branch_logits(net, seq, mask, conds, keep, negative=None):
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
        return net(seq, mask=mask, excise_prepend_embeds=True, **kw).double()


SCALES = {
    "joint": (3.0, "logits"),
    "per-kind": ({"joint": 0.5, "context": 2.0, "prepend": -0.5, "condition": 1.5}, "logits"),
    "per-kind-reordered": ({"condition": 1.5, "prepend": -0.5, "context": 2.0, "joint": 0.5}, "logits"),
    "a-zero-scale": ({"condition": 0.0, "prepend": -1.0, "context": 2.0}, "logits"),
    "logprobs": ({"context": 2.5, "condition": 1.5}, "logprobs"),
    "logprobs-reordered": ({"condition": 1.5, "context": 2.5}, "logprobs"),
    "schedule": (lambda s: [1.0, {"context": 3.0}, 0.0][s], "logits"),
}


@pytest.mark.parametrize("scale", list(SCALES), ids=list(SCALES))
def test_guided_logits_equal_the_formula_from_separate_passes(scale):
    """At every step, the logits sampled from equal ``uncond + sum_k s_k (cond_k - uncond)`` of separate
    forward passes on that step's sequence (``mask_id`` banned)."""
    model = _model(steps=3)
    conds = _conds()
    mask = sf.padding_mask(torch.tensor([8, 5, 2]), 8)
    cond_scale, space = SCALES[scale]
    seen = []

    def capture(logits):
        seen.append(logits.clone())
        return logits

    with _Recorder(model.net) as rec:
        model.generate(seq_len=8, mask=mask, cond_scale=cond_scale, guidance_space=space, filter_logits_fn=capture, **conds)
    assert len(seen) == 3
    for s in range(3):
        seq = rec.inputs[s][:3]
        sc = cond_scale(s) if callable(cond_scale) else cond_scale
        sc = sc if isinstance(sc, dict) else {"joint": sc}
        br = {"uncond": _branch_logits(model.net, seq, mask, conds, set()),
              "joint": _branch_logits(model.net, seq, mask, conds, set(KINDS))}
        for kind in KINDS:
            br[kind] = _branch_logits(model.net, seq, mask, conds, {kind})
        if space == "logprobs":
            br = {k: v.log_softmax(-1) for k, v in br.items()}
        want = br["uncond"] + sum(v * (br[k] - br["uncond"]) for k, v in sc.items())
        got = seen[s].reshape(3, 8, -1)
        assert bool((got[..., MASK_ID] == -INF).all()) if got.shape[-1] > MASK_ID else True
        hp.assert_close(got[mask].double(), want[mask], f"step {s} with scale {sc}", torch.float64)


def test_all_branches_run_in_one_forward_per_step():
    model = _model(steps=4)
    conds = _conds()
    with _Recorder(model.net) as rec:
        model.generate(seq_len=6, cond_scale={"context": 2.0, "prepend": 1.0, "condition": 1.5}, **conds)
    assert [tuple(t.shape) for t in rec.inputs] == [(12, 6)] * 4  # uncond + 3 kinds, 3 samples each
    with _Recorder(model.net) as rec:
        model.generate(seq_len=6, cond_scale=1.0, **conds)
    assert [tuple(t.shape) for t in rec.inputs] == [(3, 6)] * 4  # plain conditional: one branch
    with _Recorder(model.net) as rec:
        zero = model.generate(seq_len=6, cond_scale=0.0, temperature=0.0, **conds)
    assert [tuple(t.shape) for t in rec.inputs] == [(3, 6)] * 4  # unconditional: one branch
    dropped = dict(conds, context_mask=conds["context_mask"] & False, prepend_mask=conds["prepend_mask"] & False,
                   condition_mask=conds["condition_mask"] & False)
    assert torch.equal(zero, model.generate(seq_len=6, temperature=0.0, **dropped)), "cond_scale=0 is every condition dropped"


def test_a_sample_with_an_empty_context_decodes_unconditionally():
    model = _model(adaptive=False, steps=4)
    conds = _subset(_conds(), ("context",))
    out = model.generate(seq_len=8, cond_scale=4.0, temperature=0.0, **conds)
    alone = model.generate(1, 8, temperature=0.0)  # no condition at all
    assert torch.equal(out[1:2], alone), "sample 1's context is all masked: it is unconditional"


def test_padded_sample_decodes_what_it_decodes_alone():
    """S4 for decoding: with right padding, a sample decodes the tokens it decodes alone at its length."""
    model = _model(steps=5)
    conds = _conds()
    lengths = [8, 5, 2]
    mask = sf.padding_mask(torch.tensor(lengths), 8)
    out = model.generate(seq_len=8, mask=mask, cond_scale=2.0, temperature=0.0, **conds)
    for s, n in enumerate(lengths):
        alone = model.generate(seq_len=n, cond_scale=2.0, temperature=0.0, **{k: v[s : s + 1] for k, v in conds.items()})
        assert torch.equal(out[s : s + 1, :n], alone), f"sample {s}"


def test_negative_context_replaces_the_empty_one_in_the_unconditional_branch():
    model = _model(adaptive=False, steps=1)
    conds = _subset(_conds(), ("context",))
    neg = torch.randn(1, 2, CC, dtype=torch.float64)
    seen = []
    model.generate(seq_len=6, cond_scale=2.0, negative_context=neg, filter_logits_fn=lambda t: seen.append(t) or t, **conds)
    seq = torch.full((3, 6), MASK_ID)
    u = _branch_logits(model.net, seq, None, conds, set(), negative={"context": {"context": neg.expand(3, -1, -1)}})
    j = _branch_logits(model.net, seq, None, conds, {"context"})
    want = u + 2.0 * (j - u)
    hp.assert_close(seen[0].reshape(3, 6, -1).double(), want, "negative context", torch.float64)


def test_custom_schedule_and_logits_dim_including_mask_id():
    """A callable schedule, and a net that has a logit for ``mask_id``: it is banned, never produced."""
    torch.manual_seed(0)
    net = _net(logits_dim=V, adaptive=False, cross=False)
    with torch.no_grad():
        net.to_logits.weight[MASK_ID] = 0.0
        net.to_logits.weight[MASK_ID, 0] = 50.0  # mask_id would win everywhere if allowed
    model = sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, steps=3, schedule=lambda r: (1 - r) ** 2)
    out = model.generate(4, 10, temperature=1.0)
    assert not bool((out == MASK_ID).any())
    loss = model(torch.randint(0, V - 1, (2, 10))).loss
    hp.assert_finite(loss, "loss")


def test_constructor_errors():
    net = _net()
    cases = [
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=-1), ValueError, "mask_id"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=True), ValueError, "mask_id"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, steps=1.5), ValueError, "steps"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, schedule=lambda r: r * 2), ValueError, "schedule"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, schedule=lambda r: r[:3]), ValueError, "schedule"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, schedule=3), ValueError, "schedule"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, pad_value=MASK_ID), ValueError, "pad_value"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, pad_value=True), TypeError, "pad_value"),
        (lambda: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, cond_drop_prob=-0.1), ValueError, "cond_drop_prob"),
        (lambda: sf.NonAutoregressiveWrapper(_net(cross=False), mask_id=MASK_ID, cond_drop_prob={"context": 0.1}), ValueError, "context"),
        (lambda: sf.NonAutoregressiveWrapper(_net(logits_dim=V + 1), mask_id=MASK_ID), ValueError, "logits_dim"),
        (lambda: sf.NonAutoregressiveWrapper(sf.ContinuousTransformerWrapper(max_seq_len=8, attn_layers=sf.Encoder(dim=8, depth=1)),
                                             mask_id=0), TypeError, "TransformerWrapper"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()


def test_call_errors():
    model = _model()
    x, mask = _tokens()
    conds = _conds()
    too_big = x.clone()
    too_big[0, 0] = V - 1 + 0  # == MASK_ID
    outside = x.clone()
    outside[0, 1] = V + 3
    cases = [
        (lambda: model(too_big), ValueError, "mask_id"),
        (lambda: model(outside), ValueError, "logits_dim"),
        (lambda: model(x, reduction="avg"), ValueError, "reduction"),
        (lambda: model(x, mask=mask[:, :-1]), ValueError, "mask"),
        (lambda: model(x[0]), ValueError, "x"),
        (lambda: model(x, context=conds["context"][:2]), ValueError, "context"),
        (lambda: model.generate(3, 0), ValueError, "seq_len"),
        (lambda: model.generate(-1, 4), ValueError, "batch_size"),
        (lambda: model.generate(3, 4, mask=mask), ValueError, "mask"),
        (lambda: model.generate(3, 4, temperature=-1.0), ValueError, "temperature"),
        (lambda: model.generate(3, 4, choice_temperature=INF), ValueError, "choice_temperature"),
        (lambda: model.generate(3, 4, guidance_space="probs", cond_scale=2.0, **conds), ValueError, "guidance_space"),
        (lambda: model.generate(3, 4, guidance_rescale=2.0), ValueError, "guidance_rescale"),
        (lambda: model.generate(3, 4, filter_kwargs={"k": 2}), ValueError, "filter_kwargs"),
        (lambda: model.generate(3, 4, filter_logits_fn="top_q"), ValueError, "filter_logits_fn"),
        (lambda: model.generate(3, 4, negative_context=conds["context"][:, :, :-1], **conds), ValueError, "negative_context"),
        (lambda: model.generate(3, 17, **conds), ValueError, "max_seq_len"),  # 17 > 16 (a prefix takes no absolute position)
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()


def test_save_and_load_round_trip(tmp_path):
    model = _model(dtype=torch.float32, steps=5, schedule="linear", cond_drop_prob=0.1)
    model.save_pretrained(tmp_path / "ckpt")
    back = sf.NonAutoregressiveWrapper.from_pretrained(tmp_path / "ckpt")
    assert (back.mask_id, back.steps, back.schedule) == (MASK_ID, 5, "linear")
    x, mask = _tokens()
    model.eval()
    back.eval()
    gen = torch.Generator().manual_seed(0)
    hp.assert_bitwise(back(x, mask=mask, generator=gen).loss,
                      model(x, mask=mask, generator=torch.Generator().manual_seed(0)).loss, "loss after reloading")
    custom = sf.NonAutoregressiveWrapper(_net(), mask_id=MASK_ID, schedule=lambda r: 1 - r)
    with pytest.raises(ValueError, match="schedule"):  # never saved as another schedule
        custom.save_pretrained(tmp_path / "custom")


# ----------------------------------------------------------------------------------------------------
# the example
# ----------------------------------------------------------------------------------------------------


@pytest.mark.full
def test_maskgit_digits_example_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("maskgit_digits", ROOT / "examples" / "maskgit_digits.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules["maskgit_digits"] = example
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(example)
        result = example.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "cond_scale" in printed and "accuracy" in printed
    assert set(result["accuracy"]) == {0.0, 1.0, 3.0}
    assert all(0.0 <= a <= 1.0 for a in result["accuracy"].values())
    assert result["real_accuracy"] >= 0.9, "the classifier must recognise real digits"
    assert math.isfinite(result["final_loss"])
    assert result["mask_id_left"] == 0
    png = tmp_path / "maskgit_digits.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
