"""Tests for ``safeformer.research.dpo.DPO``: the loss against a float64 reference in plain code, the safety
contract (padding and fully padded pairs, garbage ids at padded positions, NaN/inf at masked context
slots, pairs and batches with no counted target), named errors, and parity with x-transformers' ``DPO``
on converted weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_finite, assert_zero

import safeformer as sf
from safeformer.research.dpo import DPO, dpo_from_x_transformers, dpo_xt_masks

V, B, N = 11, 4, 8


def make_model(seed: int = 0, dtype=torch.float32, cross: bool = False) -> sf.TransformerWrapper:
    torch.manual_seed(seed)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=1, heads=2, dim_head=8, cross_attend=cross))
    return net.to(dtype)


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def batch(seed: int = 0):
    """Two sequences, prompt masks of different lengths, right padding; pair 0 has a fully padded
    unpreferred sequence (so it does not count)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, V, (B, N), generator=g)
    l_ = torch.randint(0, V, (B, N), generator=g)
    prompt_len = torch.tensor([2, 3, 1, 4])
    prompt_mask = torch.arange(N)[None] < prompt_len[:, None]
    w_len, l_len = torch.tensor([5, 8, 6, 8]), torch.tensor([0, 6, 8, 7])
    w_mask = torch.arange(N)[None] < w_len[:, None]
    l_mask = torch.arange(N)[None] < l_len[:, None]
    return w, l_, prompt_mask, w_mask, l_mask


def ref_loss(policy, ref, w, l_, prompt_mask, w_mask, l_mask, beta):
    """Float64 DPO by hand: per-target log-probs from each model on the real tokens alone."""
    def mean_lp(model, seq, mask):
        out = []
        for i in range(seq.shape[0]):
            n = int(mask[i].sum())
            if n < 2:
                out.append(None)
                continue
            s = seq[i, :n][None]
            lp = model(s[:, :-1]).double().log_softmax(-1)[0]  # (n - 1, v)
            lp = lp.gather(-1, s[0, 1:, None])[:, 0]
            keep = ~prompt_mask[i, 1:n]
            out.append(lp[keep].mean() if keep.any() else None)
        return out

    pw, pl, rw, rl = mean_lp(policy, w, w_mask), mean_lp(policy, l_, l_mask), mean_lp(ref, w, w_mask), mean_lp(ref, l_, l_mask)
    losses = []
    for i in range(w.shape[0]):
        if pw[i] is None or pl[i] is None:
            losses.append(torch.zeros((), dtype=torch.float64))
            continue
        losses.append(-F.logsigmoid(beta * ((pw[i] - pl[i]) - (rw[i] - rl[i]))))
    return torch.stack(losses)


def test_loss_matches_float64_reference():
    net = make_model(dtype=torch.float64)
    dpo = DPO(net, beta=0.5)
    perturb(dpo.policy_model)  # the policy moves away from the reference
    w, l_, pm, wm, lm = batch()
    got = dpo(w, l_, prompt_mask=pm, preferred_seq_mask=wm, unpreferred_seq_mask=lm, reduction="none")
    want = ref_loss(dpo.policy_model.eval(), dpo.ref_model, w, l_, pm, wm, lm, 0.5)
    assert_close(got, want, "per-pair DPO loss", torch.float64)
    assert got[0].item() == 0.0  # a fully padded unpreferred sequence: the pair does not count
    mean = dpo(w, l_, prompt_mask=pm, preferred_seq_mask=wm, unpreferred_seq_mask=lm)
    assert_close(mean, want[1:].mean(), "mean over counting pairs", torch.float64)


def test_pad_id_and_left_padding_are_the_same_loss():
    pad = 0
    dpo = DPO(make_model(dtype=torch.float64), beta=0.3, pad_id=pad)
    perturb(dpo.policy_model)
    dpo.eval()
    w, l_, pm, wm, lm = batch(1)
    w = torch.where(wm, w.clamp(min=1), pad)
    l_ = torch.where(lm, l_.clamp(min=1), pad)
    by_pad = dpo(w, l_, prompt_mask=pm, reduction="none")
    by_mask = dpo(w, l_, prompt_mask=pm, preferred_seq_mask=wm, unpreferred_seq_mask=lm, reduction="none")
    assert_close(by_pad, by_mask, "pad_id against explicit masks", torch.float64)

    def left(t, m, fill):  # move each row's real tokens to the right end, garbage in front
        out = torch.full_like(t, fill)
        for i in range(t.shape[0]):
            k = int(m[i].sum())
            if k:
                out[i, N - k:] = t[i, :k]
        return out

    lm = wm  # left padding moves both sequences of a pair by the same amount: give them one length
    l_ = torch.where(lm, l_.clamp(min=1), pad)
    lw, ll, lwm, lpm = left(w, wm, 10**6), left(l_, wm, -7), left(wm, wm, False), left(pm & wm, wm, False)
    got = dpo(lw, ll, prompt_mask=lpm, preferred_seq_mask=lwm, unpreferred_seq_mask=lwm, reduction="none")
    want = dpo(w, l_, prompt_mask=pm, preferred_seq_mask=wm, unpreferred_seq_mask=wm, reduction="none")
    assert_close(got, want, "left padding", torch.float64)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e4])
def test_garbage_in_masked_slots_reaches_nothing(value):
    """Garbage ids at padded positions and ``value`` at masked context slots change neither the loss nor
    a gradient; every gradient is present and finite."""
    net = make_model(cross=True)
    dpo = DPO(net, beta=0.1)
    perturb(dpo.policy_model)
    w, l_, pm, wm, lm = batch(2)
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(B, 3, 16, generator=g)
    ctx_mask = torch.tensor([[True, False, True], [False] * 3, [True] * 3, [True, True, False]])

    def run(w_, l2, c):
        c = c.clone().requires_grad_()
        dpo.zero_grad()
        loss = dpo(w_, l2, prompt_mask=pm, preferred_seq_mask=wm, unpreferred_seq_mask=lm, context=c, context_mask=ctx_mask)
        loss.backward()
        return loss, c.grad, [p.grad.clone() for p in dpo.parameters()]

    clean = run(w, l_, ctx)
    dirty = run(torch.where(wm, w, 10**6), torch.where(lm, l_, -5), ctx.masked_fill(~ctx_mask[..., None], value))
    assert_finite(dirty[0], "loss")
    assert torch.equal(clean[0], dirty[0])
    assert_finite(dirty[1], "context grad")
    assert_zero(dirty[1][~ctx_mask], "gradient at masked context slots")
    for a, b_ in zip(clean[2], dirty[2]):
        assert_finite(b_, "policy grad")
        assert torch.equal(a, b_)
    assert all(p.grad is None for p in dpo.ref_model.parameters())


def test_no_counted_target_is_zero_loss_with_zero_gradients():
    dpo = DPO(make_model(), beta=0.1)
    w, l_, pm, wm, lm = batch(4)
    cases = {
        "all prompt": dict(prompt_mask=torch.ones(B, N, dtype=torch.bool)),
        "all padding": dict(prompt_mask=pm, preferred_seq_mask=torch.zeros(B, N, dtype=torch.bool),
                            unpreferred_seq_mask=lm),
        "prompt covers every real token": dict(prompt_mask=torch.arange(N)[None].expand(B, N) < 5,
                                               preferred_seq_mask=torch.arange(N)[None].expand(B, N) < 5),
    }
    for name, kw in cases.items():
        dpo.zero_grad()
        loss = dpo(w, l_, **kw)
        loss.backward()
        assert loss.item() == 0.0, name
        for p in dpo.parameters():
            assert_zero(p.grad, f"{name}: policy gradient", none_ok=True)


def test_reference_is_frozen_and_parameters_are_the_policy():
    net = make_model()
    dpo = DPO(net)
    assert dpo.policy_model is net
    assert all(not p.requires_grad for p in dpo.ref_model.parameters())
    assert {id(p) for p in dpo.parameters()} == {id(p) for p in net.parameters()}
    dpo.train()
    w, l_, pm, _, _ = batch()
    dpo(w, l_, prompt_mask=pm)
    assert dpo.ref_model.training  # the mode it was in is restored


def test_named_errors():
    dpo = DPO(make_model())
    w, l_, pm, wm, lm = batch()
    with pytest.raises(TypeError, match="TransformerWrapper"):
        DPO(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="causal"):
        DPO(sf.TransformerWrapper(num_tokens=V, max_seq_len=8, attn_layers=sf.Encoder(dim=8, depth=1)))
    with pytest.raises(ValueError, match="beta"):
        DPO(make_model(), beta=0.0)
    with pytest.raises(TypeError, match="pad_id"):
        DPO(make_model(), pad_id=1.5)
    with pytest.raises(ValueError, match="unpreferred_seq"):
        dpo(w, l_[:, :-1], prompt_mask=pm)
    with pytest.raises(TypeError, match="preferred_seq"):
        dpo(w.float(), l_, prompt_mask=pm)
    with pytest.raises(TypeError, match="prompt_mask"):
        dpo(w, l_, prompt_mask=pm.int())
    with pytest.raises(ValueError, match="prompt_mask"):
        dpo(w, l_, prompt_mask=pm[:, :-1])
    with pytest.raises(TypeError, match="preferred_seq_mask"):
        dpo(w, l_, prompt_mask=pm, preferred_seq_mask=wm.float())
    with pytest.raises(ValueError, match="reduction"):
        dpo(w, l_, prompt_mask=pm, reduction="sum")
    with pytest.raises(ValueError, match="x holds token id"):
        dpo(w + V, l_, prompt_mask=pm)
    with pytest.raises(TypeError, match="DPO"):
        dpo_from_x_transformers(make_model())


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


def _xt_dpo(pad_id=None):
    xt = pytest.importorskip("x_transformers")
    from x_transformers.dpo import DPO as XDPO

    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g) * (p.abs().mean() + 0.1))
    d = XDPO(model, beta=0.2, pad_id=pad_id)
    with torch.no_grad():  # the policy moves away from the reference
        for p in d.policy_model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return d.eval()


def test_parity_with_x_transformers():
    xd = _xt_dpo()
    sd = dpo_from_x_transformers(xd).eval()
    assert sd.beta == 0.2
    w, l_, pm, wm, lm = batch(5)
    lm[0] = wm[0]  # every pair counts in both (x-transformers averages a non-counting pair in as log 2)
    w_pm, w_m = dpo_xt_masks(pm, wm)
    _, l_m = dpo_xt_masks(pm, lm)
    want = xd(w, l_, prompt_mask=w_pm, preferred_seq_mask=w_m, unpreferred_seq_mask=l_m)
    got = sd(w, l_, prompt_mask=pm, preferred_seq_mask=wm, unpreferred_seq_mask=lm)
    assert_close(got, want, "DPO loss against x-transformers", torch.float32)
    assert abs(got.item() - want.item()) < 1e-5
    # without padding the prompt shift alone makes them agree
    full = torch.ones(B, N, dtype=torch.bool)
    want = xd(w, l_, prompt_mask=dpo_xt_masks(pm)[0])
    got = sd(w, l_, prompt_mask=pm, preferred_seq_mask=full, unpreferred_seq_mask=full)
    assert abs(got.item() - want.item()) < 1e-5


def test_parity_gradients_with_x_transformers():
    xd = _xt_dpo(pad_id=0)
    sd = dpo_from_x_transformers(xd)
    assert sd.pad_id == 0
    w, l_, pm, wm, lm = batch(6)
    lm[0] = wm[0]
    w, l_ = torch.where(wm, w.clamp(min=1), 0), torch.where(lm, l_.clamp(min=1), 0)
    w_pm, w_m = dpo_xt_masks(pm, wm)
    _, l_m = dpo_xt_masks(pm, lm)
    xd(w, l_, prompt_mask=w_pm, preferred_seq_mask=w_m, unpreferred_seq_mask=l_m).backward()
    sd(w, l_, prompt_mask=pm).backward()
    x_emb = xd.policy_model.token_emb.emb.weight.grad
    s_emb = sd.policy_model.token_emb.weight.grad
    assert_close(s_emb, x_emb, "token embedding gradient", torch.float32)


# ----------------------------------------------------------------------------------------------------
# the door probe (for tests/doors.py) and the clauses run on it here
# ----------------------------------------------------------------------------------------------------


def probe_dpo(seed: int, value: float):
    """``DPO`` with a cross-attending policy: right- or left-padded pairs (pair 0's unpreferred sequence
    fully padded, so the pair does not count), garbage ids at padded positions and ``value`` at masked
    context slots (sample 1's context entirely masked). Per-pair losses of pairs that do not count are
    exactly 0; a batch with no counted target is a loss of 0 with zero gradients."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    b, n, j, c = 4, 7, 3, 16
    torch.manual_seed(0)
    dpo = DPO(make_model(cross=True), beta=0.2).train()
    perturb(dpo.policy_model, seed=1)
    lengths = [torch.randint(3, n + 1, (b,), generator=g) for _ in range(2)]
    lengths[1][0] = 0
    lengths[0][-1] = lengths[1][-1] = n
    left = bool(seed % 2)
    masks = [sf.padding_mask(ln, n, left=left) for ln in lengths]
    prompt_len = torch.randint(1, 3, (b,), generator=g)
    # the prompt: each sequence's first real positions (both sequences of a pair share one prompt_mask,
    # so under left padding it is drawn on the preferred one)
    first = masks[0].long().cumsum(1)
    prompt_mask = masks[0] & (first <= prompt_len[:, None])
    seqs = [torch.randint(0, V, (b, n), generator=g) for _ in range(2)]
    garbage = 0 if value == 0 else 10**6
    seqs = [torch.where(m, s, torch.full_like(s, garbage)) for s, m in zip(seqs, masks)]
    ctx_mask = torch.rand(b, j, generator=g) < 0.6
    ctx_mask[1] = False
    ctx_mask[-1] = True
    ctx = torch.randn(b, j, c, generator=g)
    ctx = ctx.masked_fill(~ctx_mask[..., None], value).requires_grad_()
    kw = dict(prompt_mask=prompt_mask, preferred_seq_mask=masks[0], unpreferred_seq_mask=masks[1],
              context=ctx, context_mask=ctx_mask)
    out = dpo(*seqs, reduction="none", **kw)  # (b,)
    counted = [~prompt_mask[:, 1:] & m[:, 1:] & m[:, :-1] for m in masks]
    dead = ~(counted[0].any(1) & counted[1].any(1))

    none = dpo(*seqs, **{**kw, "prompt_mask": torch.ones(b, n, dtype=torch.bool)})
    grads = torch.autograd.grad(none, [ctx, *dpo.parameters()], allow_unused=True)
    assert none.item() == 0.0 and all(gr is None or not bool(gr.any()) for gr in grads), \
        "a batch with no counted target is not a loss of 0 with zero gradients"
    w, l_ = seqs
    return Probe(out, {"context": ctx}, {"context": ~ctx_mask[..., None].expand_as(ctx)}, dead=dead, bad_calls=[
        ("sequences of different shapes", lambda: dpo(w, l_[:, :-1], prompt_mask=prompt_mask), ValueError, "unpreferred_seq"),
        ("float ids", lambda: dpo(w.float(), l_, prompt_mask=prompt_mask), TypeError, "preferred_seq"),
        ("int prompt_mask", lambda: dpo(w, l_, prompt_mask=prompt_mask.int()), TypeError, "prompt_mask"),
        ("prompt_mask of wrong shape", lambda: dpo(w, l_, prompt_mask=prompt_mask[:, 1:]), ValueError, "prompt_mask"),
        ("float sequence mask", lambda: dpo(w, l_, prompt_mask=prompt_mask, unpreferred_seq_mask=masks[1].float()),
         TypeError, "unpreferred_seq_mask"),
        ("unknown reduction", lambda: dpo(w, l_, prompt_mask=prompt_mask, reduction="sum"), ValueError, "reduction"),
        ("beta of 0", lambda: DPO(make_model(), beta=0), ValueError, "beta"),
        ("context of wrong width", lambda: dpo(w, l_, prompt_mask=prompt_mask, context=torch.randn(b, j, c + 1)),
         ValueError, "context"),
    ])


def check_probe(probe_fn, has_dead: bool, seeds=(0, 1, 2, 3)) -> None:
    """The registry's clauses (tests/test_doors.py: S1, S2, S3, S9) on one probe, for a few seeds."""
    import doors
    import helpers as hp

    def grads(p, seed):
        u = torch.randn(p.out.shape, generator=torch.Generator().manual_seed(seed)).to(p.out.dtype)
        if p.compare is not None:
            u = u * p.compare
        names = list(p.leaves)
        got = torch.autograd.grad((p.out * u).sum(), [p.leaves[k] for k in names], allow_unused=True)
        assert all(gr is not None for gr in got), "a leaf received no gradient"
        return dict(zip(names, got))

    def sel(t, where):
        return t.detach() if where is None else t.detach()[where]

    for seed in seeds:
        clean = probe_fn(seed, 0.0)
        g_clean = grads(clean, seed)
        if has_dead:
            assert clean.dead is not None and bool(clean.dead.any()), "the probe drew no dead output"
            hp.assert_zero(clean.out.detach()[clean.dead], "dead outputs")
        for value in doors.PLANT_VALUES:
            dirty = probe_fn(seed, value)
            hp.assert_finite(sel(dirty.out, dirty.compare), "output")
            hp.assert_bitwise(sel(dirty.out, dirty.compare), sel(clean.out, clean.compare), "output")
            for k, gr in grads(dirty, seed).items():
                masked = dirty.masked.get(k)
                keep = None if masked is None else ~masked
                hp.assert_finite(sel(gr, keep), f"grad of {k}")
                hp.assert_bitwise(sel(gr, keep), sel(g_clean[k], keep), f"grad of {k}")
                if masked is not None and dirty.masked_grad_zero:
                    hp.assert_zero(gr[masked], f"grad of {k} at masked positions")
    hp.assert_clear_errors(probe_fn(0, 0.0).bad_calls)


def test_door_probe_clauses():
    check_probe(probe_dpo, has_dead=True)


def test_checkpoint_round_trip_keeps_the_reference(tmp_path):
    dpo = DPO(make_model(), beta=0.3, pad_id=0)
    perturb(dpo.policy_model)  # policy and reference now differ
    dpo.save_pretrained(tmp_path)
    back = DPO.from_pretrained(tmp_path)
    assert back.beta == 0.3 and back.pad_id == 0
    for a, b in zip(dpo.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    assert all(not p.requires_grad for p in back.ref_model.parameters())
    w, l_, pm, _, _ = batch()
    assert torch.equal(dpo.eval()(w, l_, prompt_mask=pm), back.eval()(w, l_, prompt_mask=pm))
