"""``NonAutoregressiveWrapper``'s x-transformers options: ``self_cond``, ``self_cond_train_prob``,
``no_replace_prob``, ``random_token_prob``, ``can_mask_prev_unmasked``, ``token_critic``,
``self_token_critic``, ``critic_loss_weight``, ``forward(only_train_generator=, only_train_critic=,
generator_sample_temperature=)`` and ``generate(noise_level_scale=)``.

Against x-transformers 2.31.10 on the same (perturbed) weights: the same state_dict keys (strict load both
ways); the training losses and every gradient with the same seeds (both draw the same numbers in the same
order: torch's global generator and Python's ``random``); one-step generation. Multi-step generation draws
differently (safeformer's sampler, guidance and schedule rounding), so there it is checked structurally:
self-conditioning feeds each step the last step's embeddings, the critic decides what is hidden again, and
``can_mask_prev_unmasked`` lets a revealed token be hidden again. The safety contract: a padded sample
equals itself alone, garbage and NaN in padded or masked slots change nothing, an all-padding batch is 0
with zero gradients; bad values are errors naming the keyword.

Shape legend: b batch, n positions, v logits, j context length.
"""

from __future__ import annotations

import importlib
import random

import helpers as hp
import pytest
import torch
import torch.nn.functional as F

import safeformer as sf
from safeformer.decoding.nonautoregressive import SelfCritic, mask_subset

xt = pytest.importorskip("x_transformers")
xnar = importlib.import_module("x_transformers.nonautoregressive_wrapper")

V, MASK_ID, N, D, CC = 9, 8, 8, 16, 5  # tokens 0..7 are real, 8 hides; the net produces 0..7
NAN = float("nan")
TOL = dict(atol=1e-5, rtol=1e-5)

# the plain corruption (every hidden token holds mask_id): both libraries default to 0.15 and 0.1
PLAIN = dict(no_replace_prob=0.0, random_token_prob=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


def _net(lib, *, logits_dim=V - 1, cross=False):
    dim_head = "attn_dim_head" if lib is xt else "dim_head"
    extra = dict(cross_attend=True, dim_context=CC) if cross else {}
    return lib.TransformerWrapper(num_tokens=V, logits_dim=logits_dim, max_seq_len=N,
                                  attn_layers=lib.Encoder(dim=D, depth=1, heads=2, **{dim_head: 8}, **extra))


def _pair(critic: bool = False, steps: int = 18, **kw):
    """x-transformers' wrapper and safeformer's from the same keyword call, on the same perturbed weights
    (x-transformers' loaded into safeformer's strictly); both in training mode."""
    made = []
    for lib, cls in ((xt, xnar.NonAutoregressiveWrapper), (sf, sf.NonAutoregressiveWrapper)):
        torch.manual_seed(0)
        tc = _net(lib, logits_dim=1) if critic else None
        made.append(cls(_net(lib), mask_id=MASK_ID, steps=steps, schedule="linear", token_critic=tc,
                        use_simple_mdlm_loss_weight=False, **kw))
    theirs, ours = made
    hp.perturb_params(theirs, seed=3, scale=0.2)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _run(model, x, seed, **kw):
    """The losses and every parameter's gradient of one forward from ``seed`` (torch and Python)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    random.seed(seed)
    out = model(x, **kw)
    out.loss.backward()
    return out, {k: p.grad for k, p in model.named_parameters()}


CONFIGS = {
    "plain": dict(**PLAIN),
    "bert-corruption": dict(no_replace_prob=0.3, random_token_prob=0.4),
    "x-transformers-corruption": dict(no_replace_prob=0.15, random_token_prob=0.1),
    "self-cond-always": dict(self_cond=True, self_cond_train_prob=1.0, **PLAIN),
    "self-cond-never": dict(self_cond=True, self_cond_train_prob=0.0, **PLAIN),
    "self-cond-corrupt": dict(self_cond=True, no_replace_prob=0.2, random_token_prob=0.2),
    "self-critic": dict(self_token_critic=True, critic_loss_weight=0.3, **PLAIN),
    "critic": dict(critic=True, random_token_prob=0.3, no_replace_prob=0.0),
    "everything": dict(self_cond=True, self_token_critic=True, no_replace_prob=0.3, random_token_prob=0.4,
                       critic_loss_weight=2.0),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_keys_and_strict_load_both_ways(name):
    theirs, ours = _pair(**CONFIGS[name])
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())  # the order within the net differs
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for k, v in ours.state_dict().items():
        hp.assert_bitwise(v, theirs.state_dict()[k], k)
    if CONFIGS[name].get("self_token_critic"):
        assert isinstance(ours.token_critic, SelfCritic) and ours.token_critic.net is ours.net


FORWARD_KW = {
    "default": {},
    "temperature": dict(generator_sample_temperature=0.7),
    "only-generator": dict(only_train_generator=True),
    "only-critic": dict(only_train_critic=True),
}


@pytest.mark.parametrize("call", sorted(FORWARD_KW))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_losses_and_gradients_equal_x_transformers(name, call):
    """Seeds 0..3: both draw the same numbers (coin flips both ways among them), so the same tokens are hidden,
    kept, randomised, self-conditioned and sampled for the critic."""
    cfg = CONFIGS[name]
    has_critic = cfg.get("critic") or cfg.get("self_token_critic")
    if call == "only-critic" and not has_critic:
        pytest.skip("only_train_critic needs a critic (an error here: test_bad_values_name_the_keyword)")
    theirs, ours = _pair(**cfg)
    x = torch.randint(0, V - 1, (3, N), generator=torch.Generator().manual_seed(7))
    for seed in range(4):
        got, got_grads = _run(ours, x, seed, **FORWARD_KW[call])
        want, want_grads = _run(theirs, x, seed, **FORWARD_KW[call])
        assert type(got).__name__ == "Losses" and got._fields == want._fields
        for field, a, b in zip(got._fields, got, want):
            assert (a is None) == (b is None), f"{field}: {a} vs {b}"
            if a is not None:
                torch.testing.assert_close(a, b, **TOL, msg=lambda m, f=field, s=seed: f"seed {s} {name} {f}: {m}")
        assert set(got_grads) == set(want_grads)
        for k, g in want_grads.items():
            assert (g is None) == (got_grads[k] is None), f"seed {seed}: gradient presence of {k}"
            if g is not None:
                torch.testing.assert_close(got_grads[k], g, **TOL, msg=lambda m, k=k, s=seed: f"seed {s} grad {k}: {m}")


def test_the_bare_call_corrupts_and_trains_as_x_transformers():
    """``no_replace_prob`` / ``random_token_prob`` not given: both libraries use x-transformers' defaults (0.15 / 0.1),
    so the same bare call hides, keeps and randomises the same tokens: losses and every gradient equal for seeds
    0..7 (``_pair`` names ``use_simple_mdlm_loss_weight=False``, a documented difference of defaults). The defaults
    do corrupt: some seed's loss differs from the plain corruption's (the test can fail)."""
    theirs, ours = _pair()
    assert (ours.no_replace_prob, ours.random_token_prob) == (theirs.no_replace_prob, theirs.random_token_prob)
    assert (ours.no_replace_prob, ours.random_token_prob) == (0.15, 0.1)
    _, plain = _pair(**PLAIN)
    x = torch.randint(0, V - 1, (3, N), generator=torch.Generator().manual_seed(7))
    differs = 0
    for seed in range(8):
        got, got_grads = _run(ours, x, seed)
        want, want_grads = _run(theirs, x, seed)
        torch.testing.assert_close(got.loss, want.loss, **TOL, msg=lambda m, s=seed: f"seed {s} loss: {m}")
        assert got.critic_loss is None and want.critic_loss is None and set(got_grads) == set(want_grads)
        for k, g in want_grads.items():
            assert (g is None) == (got_grads[k] is None), f"seed {seed}: gradient presence of {k}"
            if g is not None:
                torch.testing.assert_close(got_grads[k], g, **TOL, msg=lambda m, k=k, s=seed: f"seed {s} grad {k}: {m}")
        differs += not torch.allclose(got.loss, _run(plain, x, seed)[0].loss)
    assert differs > 0


def test_mask_subset_is_x_transformers_get_mask_subset_prob():
    g = torch.Generator().manual_seed(0)
    for seed in range(5):
        mask = torch.rand(4, 11, generator=g) < 0.6
        for prob, min_mask in ((0.0, 0), (0.15, 0), (0.5, 0), (1.0, 0), (0.1, 2)):
            torch.manual_seed(seed)
            want = xnar.get_mask_subset_prob(mask, prob, min_mask)
            torch.manual_seed(seed)
            got = mask_subset(mask, prob, min_mask)
            assert torch.equal(got, want), (seed, prob)
            assert not bool((got & ~mask).any())


@pytest.mark.parametrize("name", ["plain", "self-cond-always", "everything"])
def test_one_step_generation_equals_x_transformers(name):
    """One step reveals everything: the (self-conditioned on ``null_embed``) argmax, as x-transformers' samples at
    temperature 1e-3 (its Gumbel noise is then 1e-3 of the logits' scale)."""
    theirs, ours = _pair(steps=1, **CONFIGS[name])
    torch.manual_seed(4)
    random.seed(4)
    want = theirs.generate(batch_size=3)
    got = ours.generate(3, N, temperature=0.0)
    assert torch.equal(got, want)
    assert theirs.training and ours.training, "generate must restore training mode"


def test_noise_level_scale_is_checked_and_the_critic_reads_filled_sequences():
    _, model = _pair(critic=True, steps=4, **PLAIN)
    seen = []
    forward = model.token_critic.forward

    def spy(x, mask=None):
        seen.append(x.clone())
        return forward(x, mask=mask)

    model.token_critic.forward = spy
    out = model.generate(2, N, noise_level_scale=0.5)
    assert len(seen) == 4 and not bool((out == MASK_ID).any())
    assert all(not bool((s == MASK_ID).any()) for s in seen), "the critic saw a hidden token"
    with pytest.raises(ValueError, match="noise_level_scale"):
        model.generate(2, N, noise_level_scale=NAN)


# ---------------------------------------------------------------------------------------------------
# generation, structurally
# ---------------------------------------------------------------------------------------------------


def _cond_model(**kw):
    torch.manual_seed(0)
    model = sf.NonAutoregressiveWrapper(_net(sf, cross=True), mask_id=MASK_ID, steps=3, schedule="linear", **kw)
    return hp.perturb_params(model, seed=2, scale=0.2)


def test_self_conditioning_feeds_each_step_the_last_steps_embeddings():
    """Guided (two branches in one batched call): at step 0 every row gets ``to_self_cond(null_embed)``,
    at step s > 0 each row ``to_self_cond`` of its own embeddings at step s - 1."""
    model = _cond_model(self_cond=True)
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((kwargs["sum_embeds"].clone(), out[1].clone(), kwargs["mask"]))

    handle = model.net.register_forward_hook(hook, with_kwargs=True)
    try:
        ctx = torch.randn(2, 3, CC)
        mask = hp.mask_from_lengths([N, 5], N)
        out = model.generate(2, N, mask=mask, context=ctx, cond_scale=2.0)
    finally:
        handle.remove()
    assert len(calls) == 3 and calls[0][0].shape[0] == 4, "the two guidance branches run in one call per step"
    with torch.no_grad():
        first = model.to_self_cond(model.null_embed).expand_as(calls[0][0])
        hp.assert_bitwise(calls[0][0], first, "step 0's sum_embeds")
        for s in (1, 2):
            hp.assert_bitwise(calls[s][0], model.to_self_cond(calls[s - 1][1]), f"step {s}'s sum_embeds")
    assert not bool((out[mask] == MASK_ID).any()) and bool((out[~mask] == model.pad_value).all())


def _scripted_critic(model, scores_per_step: list[list[float]]):
    """The critic's ``forward`` replaced by fixed scores per call (one call per step); records its inputs."""
    calls = []

    def fake(x, mask=None):
        calls.append(x.clone())
        s = torch.tensor(scores_per_step[len(calls) - 1])
        return s.expand(x.shape[0], -1)[..., None]

    model.token_critic.forward = fake
    return calls


@pytest.mark.parametrize("can_mask", [False, True])
def test_critic_decides_what_stays_hidden_and_can_mask_prev_unmasked(can_mask):
    """Linear schedule, 3 steps, 6 tokens: 4 then 2 stay hidden. Step 0's scores reveal positions 0 and 1;
    step 1 scores them highest (the most likely wrong): hidden again only with ``can_mask_prev_unmasked``."""
    n = 6
    model = _cond_model(self_token_critic=True, can_mask_prev_unmasked=can_mask)
    inputs = []
    handle = model.net.register_forward_pre_hook(lambda m, a: inputs.append(a[0].clone()))
    _scripted_critic(model, [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [9.0, 8.0, 0.0, 1.0, 2.0, 3.0], [0.0] * 6])
    try:
        out = model.generate(2, n, noise_level_scale=0.0)
    finally:
        handle.remove()
    hidden = [(t == MASK_ID) for t in inputs]
    assert len(inputs) == 3 and bool(hidden[0].all())
    assert torch.equal(hidden[1][0], torch.tensor([False, False, True, True, True, True]))
    want = [True, True, False, False, False, False] if can_mask else [False, False, False, False, True, True]
    assert torch.equal(hidden[2][0], torch.tensor(want)), hidden[2]
    assert not bool((out == MASK_ID).any())


def test_without_a_critic_revealed_tokens_may_be_hidden_again_only_when_allowed():
    """The same net and seed; the hidden counts follow the schedule either way; a revealed token is hidden again
    (somewhere in a 40-sample batch) only with ``can_mask_prev_unmasked``."""
    for can_mask in (False, True):
        model = _cond_model(can_mask_prev_unmasked=can_mask)
        model.steps = 4
        inputs = []
        handle = model.net.register_forward_pre_hook(lambda m, a, seen=inputs: seen.append(a[0].clone()))
        torch.manual_seed(0)
        try:
            out = model.generate(40, N, temperature=1.0)
        finally:
            handle.remove()
        hidden = [t == MASK_ID for t in inputs]
        counts = [int(h[0].sum()) for h in hidden]
        assert counts == [8, 6, 4, 2], counts
        rehidden = any(bool((hidden[s + 1] & ~hidden[s]).any()) for s in range(3))
        assert rehidden == can_mask
        assert not bool((out == MASK_ID).any())


# ---------------------------------------------------------------------------------------------------
# the safety contract
# ---------------------------------------------------------------------------------------------------


def _contract_model(**kw):
    torch.manual_seed(0)
    model = sf.NonAutoregressiveWrapper(_net(sf, cross=True), mask_id=MASK_ID, schedule="cosine", self_cond=True,
                                        self_cond_train_prob=1.0, no_replace_prob=0.3, random_token_prob=0.4,
                                        self_token_critic=True, **kw)
    return hp.perturb_params(model, seed=5, scale=0.2).train()


def test_a_padded_sample_equals_itself_alone():
    """Per-position losses of a right-padded batch (garbage ids at padding) equal each sample's alone, computed by
    hand from the corrupted ids ``hide_tokens`` replays: the self-conditioned logits, the critic's argmax
    sample (temperature 0) and its binary cross-entropy."""
    model = _contract_model()
    x = torch.randint(0, V - 1, (3, N), generator=torch.Generator().manual_seed(1))
    lengths = [N, 5, 2]
    mask = hp.mask_from_lengths(lengths, N)
    x = x.masked_fill(~mask, 10**6)
    out = model(x, False, False, 0.0, mask=mask, reduction="none", generator=torch.Generator().manual_seed(3))
    inp, hidden = model.hide_tokens(x, mask, generator=torch.Generator().manual_seed(3))
    assert bool(hidden.any(1).all()) and not bool((hidden & ~mask).any())
    net = model.net
    for i, n in enumerate(lengths):
        with torch.no_grad():
            xi, hi = inp[i:i + 1, :n], hidden[i:i + 1, :n]
            emb = net(xi, return_embeddings=True)
            logits = net(xi, sum_embeds=model.to_self_cond(emb))
            ce = F.cross_entropy(logits.transpose(1, 2), x[i:i + 1, :n], reduction="none")
            gen = torch.where(hi, ce, 0.0)
            sampled = logits.argmax(-1)
            crit = model.token_critic(torch.where(hi, sampled, x[i:i + 1, :n]))[..., 0]
            bce = F.binary_cross_entropy_with_logits(crit, (sampled != x[i:i + 1, :n]).float(), reduction="none")
        torch.testing.assert_close(out.generator_loss[i:i + 1, :n].detach(), gen, **TOL)
        torch.testing.assert_close(out.critic_loss[i:i + 1, :n].detach(), bce, **TOL)
        torch.testing.assert_close(out.loss[i:i + 1, :n].detach(), gen + bce, **TOL)
        for t in out:
            hp.assert_zero(t[i, n:], f"sample {i}'s padded positions")


def _losses_and_grads(model, x, mask, ctx, ctx_mask, seed=3, **kw):
    model.zero_grad(set_to_none=True)
    out = model(x, mask=mask, context=ctx, context_mask=ctx_mask, generator=torch.Generator().manual_seed(seed), **kw)
    out.loss.backward()
    return out, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("call", sorted(FORWARD_KW))
def test_nan_and_garbage_in_padded_slots_change_nothing(call):
    model = _contract_model(critic_loss_weight=0.5)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, V - 1, (3, N), generator=g)
    mask = hp.mask_from_lengths([N, 4, 1], N, left=True)
    ctx = torch.randn(3, 4, CC, generator=g)
    ctx_mask = torch.tensor([[True, True, False, False], [False] * 4, [True, False, True, False]])
    clean, clean_grads = _losses_and_grads(model, x, mask, ctx, ctx_mask, **FORWARD_KW[call])
    dirty, dirty_grads = _losses_and_grads(model, x.masked_fill(~mask, -7), mask,
                                           ctx.masked_fill(~ctx_mask[..., None], NAN), ctx_mask, **FORWARD_KW[call])
    for field, a, b in zip(clean._fields, dirty, clean):
        assert (a is None) == (b is None)
        if a is not None:
            hp.assert_bitwise(a, b, field)
    for k, grad in clean_grads.items():
        if grad is None:
            assert dirty_grads[k] is None, k
        else:
            hp.assert_bitwise(dirty_grads[k], grad, f"grad of {k}")


def test_an_all_padding_batch_is_zero_with_zero_gradients():
    model = _contract_model()
    x = torch.full((2, N), -3)
    none = torch.zeros(2, N, dtype=torch.bool)
    out, grads = _losses_and_grads(model, x, none, torch.full((2, 3, CC), NAN), torch.zeros(2, 3, dtype=torch.bool))
    for field, t in zip(out._fields, out):
        assert float(t.detach()) == 0.0, field
    present = {k: gr for k, gr in grads.items() if gr is not None}
    assert "to_self_cond.weight" in present and "token_critic.to_logits.weight" in present
    for k, gr in present.items():
        hp.assert_zero(gr, f"grad of {k}")


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------


def test_bad_values_name_the_keyword():
    net = _net(sf)
    make = lambda **kw: sf.NonAutoregressiveWrapper(net, mask_id=MASK_ID, **kw)  # noqa: E731
    calls = [
        ("self_cond_train_prob above 1", lambda: make(self_cond=True, self_cond_train_prob=1.5), ValueError,
         "self_cond_train_prob"),
        ("no_replace_prob below 0", lambda: make(no_replace_prob=-0.1), ValueError, "no_replace_prob"),
        ("random_token_prob NaN", lambda: make(random_token_prob=NAN), ValueError, "random_token_prob"),
        ("self_cond not a bool", lambda: make(self_cond=1), TypeError, "self_cond"),
        ("can_mask_prev_unmasked not a bool", lambda: make(can_mask_prev_unmasked="yes"), TypeError,
         "can_mask_prev_unmasked"),
        ("self_token_critic not a bool", lambda: make(self_token_critic=None), TypeError, "self_token_critic"),
        ("both critics", lambda: make(self_token_critic=True, token_critic=_net(sf, logits_dim=1)), ValueError,
         "self_token_critic"),
        ("critic not a wrapper", lambda: make(token_critic=torch.nn.Linear(2, 1)), TypeError, "token_critic"),
        ("critic with many logits", lambda: make(token_critic=_net(sf)), ValueError, "token_critic"),
        ("critic_loss_weight inf", lambda: make(critic_loss_weight=float("inf")), ValueError, "critic_loss_weight"),
        ("critic_loss_weight a string", lambda: make(critic_loss_weight="1"), ValueError, "critic_loss_weight"),
        ("self_cond with emb_dim not the width", lambda: sf.NonAutoregressiveWrapper(sf.TransformerWrapper(
            num_tokens=V, max_seq_len=N, emb_dim=8, attn_layers=sf.Encoder(dim=D, depth=1, heads=2)),
            mask_id=MASK_ID, self_cond=True), ValueError, "self_cond"),
    ]
    plain, critic = make(), make(self_token_critic=True)
    x = torch.randint(0, V - 1, (2, N))
    calls += [
        ("only_train_critic without a critic", lambda: plain(x, only_train_critic=True), ValueError,
         "only_train_critic"),
        ("both only_train_*", lambda: critic(x, True, True), ValueError, "only_train_generator"),
        ("only_train_generator not a bool", lambda: critic(x, only_train_generator=1), TypeError,
         "only_train_generator"),
        ("negative generator_sample_temperature", lambda: critic(x, generator_sample_temperature=-1.0), ValueError,
         "generator_sample_temperature"),
        ("NaN generator_sample_temperature", lambda: critic(x, generator_sample_temperature=NAN), ValueError,
         "generator_sample_temperature"),
    ]
    hp.assert_clear_errors(calls, "NonAutoregressiveWrapper")


def test_options_survive_save_and_load(tmp_path):
    for i, kw in enumerate([dict(self_cond=True, self_token_critic=True, no_replace_prob=0.2),
                            dict(token_critic=_net(sf, logits_dim=1), can_mask_prev_unmasked=True,
                                 random_token_prob=0.3, critic_loss_weight=0.5)]):
        model = hp.perturb_params(sf.NonAutoregressiveWrapper(_net(sf), mask_id=MASK_ID, **kw), seed=i)
        model.save_pretrained(tmp_path / str(i))
        again = sf.NonAutoregressiveWrapper.from_pretrained(tmp_path / str(i))
        assert list(again.state_dict()) == list(model.state_dict())
        for k, v in model.state_dict().items():
            hp.assert_bitwise(again.state_dict()[k], v, k)
        for name in ("self_cond", "no_replace_prob", "random_token_prob", "can_mask_prev_unmasked",
                     "critic_loss_weight"):
            assert getattr(again, name) == getattr(model, name), name
        assert type(again.token_critic) is type(model.token_critic)
