"""Tests for ``safeformer.research.belief_state.BeliefStateWrapper``: the loss against a float64 reference that runs
each prefix and each reversed suffix alone, the safety contract (lens, left and right padding, fully padded
samples, garbage ids at padded positions, NaN/inf at masked context slots, an all-ignored batch), the
reversal (padding never becomes a real position), generation (cached = uncached, padded prompts and
suffixes, guidance from separate passes), named errors, and parity with x-transformers on converted
weights."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, assert_finite, assert_zero
from test_dpo import check_probe

import safeformer as sf
from safeformer.research.belief_state import BeliefStateWrapper, belief_state_from_x_transformers, flip, reverse_real

V, D = 13, 16


def make_decoder(seed: int = 0, cross: bool = False, dtype=torch.float32) -> sf.TransformerWrapper:
    torch.manual_seed(seed)
    return sf.TransformerWrapper(num_tokens=V, max_seq_len=24, attn_layers=sf.Decoder(
        dim=D, depth=1, heads=2, dim_head=8, rotary_pos_emb=True, cross_attend=cross, dim_context=D)).to(dtype)


def make_model(dtype=torch.float32, cross: bool = False, shared: bool = False, **kw) -> BeliefStateWrapper:
    fwd = make_decoder(0, cross, dtype)
    bwd = None if shared else make_decoder(1, cross, dtype)
    torch.manual_seed(2)
    return BeliefStateWrapper(fwd, bwd, **kw).to(dtype)


def _used_params(model: BeliefStateWrapper):
    """The parameters a forward uses (the decoders' own output heads are not: x-transformers' too)."""
    return [(n, p) for n, p in model.named_parameters() if not n.endswith("to_logits.weight")]


# ----------------------------------------------------------------------------------------------------
# the float64 reference: every prefix and every reversed suffix run alone
# ----------------------------------------------------------------------------------------------------


def ref_sample(model: BeliefStateWrapper, tokens: torch.Tensor, lw=None, **cond):
    """Per-pair ``(ce_forward, ce_backward, ce_distance, weight)`` of one sample ``tokens (L,)``, by hand."""
    L = tokens.shape[0]
    suffix_tok = model.suffix_token[None, None]
    out = []
    for fi in range(L):
        f = model.forward_decoder(tokens[None, : fi + 1], return_embeddings=True, **cond)[0, -1]
        for bi in range(fi + 2, L + 1):
            rev = tokens[bi:].flip(0)[None]
            bs = model.backward_decoder(rev, prepend_embeds=suffix_tok, return_embeddings=True, **cond)[0, -1]
            pair = torch.cat((f, bs))
            lf, lb = model.text_head(pair).chunk(2)
            ce_f = -lf.log_softmax(-1)[tokens[fi + 1]]
            ce_b = -lb.log_softmax(-1)[tokens[bi - 1]]
            ce_d = torch.zeros((), dtype=pair.dtype)
            if model.to_distance_logits is not None:
                dl = model.to_distance_logits(pair).log_softmax(-1)
                ce_d = -dl[min(bi - fi, model.max_pred_distance - 1)]
            w = 1.0 if lw is None else float(lw(fi, bi))
            out.append((ce_f, ce_b, ce_d, w))
    return out


def ref_losses(model, seqs, lengths, lw=None, **cond):
    """(per-sample losses ``(b,)``, batch mean) from ``ref_sample``; 0 for a sample with no pair."""
    bw, dw = model.backward_ar_loss_weight, model.pred_distance_loss_weight
    per, all_pairs = [], []
    for i, L in enumerate(lengths):
        c = {k: v[i: i + 1] for k, v in cond.items()}
        pairs = ref_sample(model, seqs[i, :L], lw, **c)
        all_pairs.extend(pairs)
        if not pairs:
            per.append(torch.zeros((), dtype=torch.float64))
            continue
        d = torch.stack([p[2] for p in pairs]).mean() * dw
        per.append(sum((p[0] + d) * p[3] + (p[1] + d) * p[3] * bw for p in pairs) / (2 * len(pairs)))
    d = torch.stack([p[2] for p in all_pairs]).mean() * dw
    mean = sum((p[0] + d) * p[3] + (p[1] + d) * p[3] * bw for p in all_pairs) / (2 * len(all_pairs))
    return torch.stack(per), mean


def _batch(seed=0, b=4, n=7):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, V, (b, n), generator=g)
    lengths = [n, 0, 4, 1][:b]
    return seqs, lengths


@pytest.mark.parametrize("pred_distance", [False, True])
def test_loss_matches_float64_reference(pred_distance):
    model = make_model(torch.float64, backward_ar_loss_weight=0.4, pred_distance=pred_distance, max_pred_distance=4,
                       pred_distance_loss_weight=0.7).eval()
    seqs, lengths = _batch()
    lens = torch.tensor(lengths)
    got = model(seqs, lens=lens, reduction="none")
    want, want_mean = ref_losses(model, seqs, lengths)
    assert_close(got, want, "per-sample belief-state loss", torch.float64)
    assert got[1].item() == 0.0 and got[3].item() == 0.0  # 0 and 1 real tokens: no pair
    assert_close(model(seqs, lens=lens), want_mean, "mean belief-state loss", torch.float64)


def test_loss_weight_by_fb_indices_matches_reference():
    model = make_model(torch.float64).eval()
    seqs, lengths = _batch(1)
    fn = lambda fb: 1.0 / (fb[:, 1] - fb[:, 0]).double()  # noqa: E731
    got = model(seqs, lens=torch.tensor(lengths), loss_weight_by_fb_indices=fn)
    _, want = ref_losses(model, seqs, lengths, lw=lambda fi, bi: 1.0 / (bi - fi))
    assert_close(got, want, "weighted loss", torch.float64)
    per_dir = lambda fb: torch.stack((torch.ones(len(fb)), torch.zeros(len(fb))), -1).double()  # noqa: E731
    only_fwd = model(seqs, lens=torch.tensor(lengths), loss_weight_by_fb_indices=per_dir)
    model2 = BeliefStateWrapper(model.forward_decoder, model.backward_decoder, text_head=model.text_head,
                                backward_ar_loss_weight=0.0).double()
    with torch.no_grad():
        model2.suffix_token.copy_(model.suffix_token)
    _, half = ref_losses(model2, seqs, lengths)
    assert_close(only_fwd, half, "per-direction weights", torch.float64)


def test_padding_forms_agree_and_lens_n_is_no_padding():
    """lens, a right-padding mask, a left-padding mask and each sample alone give the same losses; lens of
    n equals no lens (x-transformers' flip is off by one there)."""
    model = make_model(torch.float64, pred_distance=True).eval()
    seqs, lengths = _batch(2)
    b, n = seqs.shape
    lens = torch.tensor(lengths)
    by_lens = model(seqs, lens=lens, reduction="none")
    right = sf.padding_mask(lens, n)
    left = sf.padding_mask(lens, n, left=True)
    lseqs = torch.full_like(seqs, 10**6)
    for i, L in enumerate(lengths):
        if L:
            lseqs[i, n - L:] = seqs[i, :L]
    assert_close(model(seqs, mask=right, reduction="none"), by_lens, "right-padding mask", torch.float64)
    assert_close(model(lseqs, mask=left, reduction="none"), by_lens, "left padding", torch.float64)
    for i, L in enumerate(lengths):
        if L >= 2:
            alone = model(seqs[i: i + 1, :L], reduction="none")
            assert_close(alone[0], by_lens[i], f"sample {i} alone", torch.float64)
    full = torch.full((b,), n)
    assert_close(model(seqs, lens=full), model(seqs), "lens = n", torch.float64)


def test_reverse_keeps_padding_in_place():
    x = torch.tensor([[1, 2, 3, 0, 0], [0, 0, 4, 5, 6], [7, 0, 8, 0, 9], [0, 0, 0, 0, 0]])
    real = x != 0
    assert torch.equal(reverse_real(x, real), torch.tensor([[3, 2, 1, 0, 0], [0, 0, 6, 5, 4], [9, 0, 8, 0, 7], [0] * 5]))
    h = torch.randn(4, 5, 3)
    rh = reverse_real(h, real)
    assert torch.equal(rh[~real], h[~real])  # padded rows stay, untouched
    assert torch.equal(flip(x, lens=torch.tensor([3, 5, 0, 2]))[0], torch.tensor([3, 2, 1, 0, 0]))
    assert torch.equal(flip(x), x.flip(1))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e4])
def test_garbage_in_masked_slots_reaches_nothing(value):
    """Garbage ids at padded positions and ``value`` at masked context slots change neither the loss nor a
    gradient; every used parameter gets a finite gradient."""
    model = make_model(cross=True, pred_distance=True, backward_ar_loss_weight=0.5)
    seqs, lengths = _batch(3)
    lens = torch.tensor(lengths)
    real = sf.padding_mask(lens, seqs.shape[1])
    g = torch.Generator().manual_seed(4)
    ctx = torch.randn(4, 3, D, generator=g)
    ctx_mask = torch.tensor([[True, False, True], [False] * 3, [True] * 3, [False, True, False]])

    def run(s, c):
        c = c.clone().requires_grad_()
        model.zero_grad()
        loss = model(s, lens=lens, context=c, context_mask=ctx_mask)
        loss.backward()
        return loss, c.grad, [p.grad.clone() for _, p in _used_params(model)]

    clean = run(seqs, ctx)
    dirty = run(torch.where(real, seqs, 10**6), ctx.masked_fill(~ctx_mask[..., None], value))
    assert_finite(dirty[0], "loss")
    assert torch.equal(clean[0], dirty[0])
    assert_zero(dirty[1][~ctx_mask], "gradient at masked context slots")
    for a, b_ in zip(clean[2], dirty[2]):
        assert_finite(b_, "parameter gradient")
        assert torch.equal(a, b_)


def test_all_ignored_batch_is_zero_loss_with_zero_gradients():
    model = make_model(pred_distance=True, backward_ar_loss_weight=0.3)
    seqs, _ = _batch(5)
    for lens in (torch.tensor([0, 1, 0, 1]), torch.tensor([1, 1, 1, 1])):
        model.zero_grad()
        loss = model(seqs, lens=lens)
        loss.backward()
        assert loss.item() == 0.0
        for name, p in _used_params(model):
            assert_zero(p.grad, f"gradient of {name}")
    model.zero_grad()
    one = model(seqs[:, :1])  # a single position: no pair at all
    one.backward()
    assert one.item() == 0.0


def test_subsampled_pairs_follow_the_generator():
    model = make_model(train_frac_forward_backward_pairs=0.3).eval()
    seqs, _ = _batch(6)
    a = model(seqs, generator=torch.Generator().manual_seed(1))
    b = model(seqs, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and torch.isfinite(a)


# ----------------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------------


def test_generation_cached_equals_uncached_and_padding_changes_nothing():
    model = make_model(cross=True).eval()
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, V, (3, 4), generator=g)
    pmask = torch.tensor([[True] * 4, [False, False, True, True], [False, True, True, True]])
    suffix = torch.randint(0, V, (3, 3), generator=g)
    smask = torch.tensor([[True] * 3, [False, True, True], [True, True, False]])
    ctx = torch.randn(3, 2, D, generator=g)
    ctx_mask = torch.tensor([[True, True], [False, False], [True, False]])
    kw = dict(suffix=suffix, suffix_mask=smask, context=ctx, context_mask=ctx_mask, temperature=0.0)
    want = model.generate_with_suffix_cond(prompts, 5, mask=pmask, **kw)
    got = model.generate_with_suffix_cond(torch.where(pmask, prompts, 10**6), 5, mask=pmask, cache_kv=True,
                                          **{**kw, "suffix": torch.where(smask, suffix, -3),
                                             "context": ctx.masked_fill(~ctx_mask[..., None], float("nan"))})
    assert torch.equal(got, want)
    for i in range(3):  # each sample alone: its real prompt, its real suffix
        alone = model.generate_with_suffix_cond(prompts[i][pmask[i]][None], 5, suffix=suffix[i][smask[i]][None],
                                                context=ctx[i: i + 1, ctx_mask[i]], temperature=0.0)
        assert torch.equal(alone[0], want[i])
    back = model.generate_with_suffix_cond(prompts, 4, mask=pmask, decode_backwards=True, temperature=0.0,
                                           generator=torch.Generator().manual_seed(0))
    back_c = model.generate_with_suffix_cond(prompts, 4, mask=pmask, decode_backwards=True, temperature=0.0,
                                             cache_kv=True, generator=torch.Generator().manual_seed(0))
    assert back.shape == (3, 4) and torch.equal(back, back_c)
    one = model.generate_with_suffix_cond(prompts[0], 3, suffix=suffix[0], temperature=0.0)
    assert one.shape == (3,) and torch.equal(one, model.generate_with_suffix_cond(
        prompts[:1], 3, suffix=suffix[:1], temperature=0.0)[0])
    assert model.generate_with_suffix_cond(prompts[:0], 3).shape == (0, 3)


def test_guidance_equals_the_formula_on_separate_passes():
    """One guided greedy step is the argmax of ``guided_logits(cond, uncond, s)``, where the unconditional
    pass has the empty suffix and the context dropped (in both decoders, as in training)."""
    model = make_model(cross=True).eval()
    g = torch.Generator().manual_seed(8)
    prompts = torch.randint(0, V, (2, 3), generator=g)
    suffix = torch.randint(0, V, (2, 2), generator=g)
    ctx = torch.randn(2, 2, D, generator=g)
    with torch.no_grad():
        def step_logits(suf, context_mask):
            h = model.forward_decoder(prompts, context=ctx, context_mask=context_mask, return_embeddings=True)[:, -1:]
            s = model._suffix_embed(suf, None, 2, prompts.device, torch.float32,
                                    sf.Conditions(context=ctx, context_mask=context_mask))
            return model.text_head(torch.cat((h, s), -1)).chunk(2, -1)[0][:, -1]
        cond = step_logits(suffix, torch.ones(2, 2, dtype=torch.bool))
        uncond = step_logits(None, torch.zeros(2, 2, dtype=torch.bool))
    for scale in (0.0, 3.0, -1.5):
        want = sf.guided_logits(cond, uncond, scale).argmax(-1)
        got = model.generate_with_suffix_cond(prompts, 1, suffix=suffix, context=ctx, cond_scale=scale, temperature=0.0)
        assert torch.equal(got[:, 0], want)
    plain = model.generate_with_suffix_cond(prompts, 1, suffix=suffix, context=ctx, temperature=0.0)
    assert torch.equal(plain[:, 0], cond.argmax(-1))
    big = model.generate_with_suffix_cond(prompts, 3, suffix=suffix, context=ctx, cond_scale=1e30, temperature=1.0,
                                          filter_logits_fn="top_k", filter_kwargs={"k": 2})
    assert big.shape == (2, 3)


def test_named_errors():
    model = make_model(cross=True)
    seqs, _ = _batch()
    with pytest.raises(TypeError, match="forward_decoder"):
        BeliefStateWrapper(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="causal"):
        BeliefStateWrapper(sf.TransformerWrapper(num_tokens=V, max_seq_len=8, attn_layers=sf.Encoder(dim=D, depth=1)))
    with pytest.raises(ValueError, match="backward_decoder"):
        BeliefStateWrapper(make_decoder(), sf.TransformerWrapper(num_tokens=V + 1, max_seq_len=8,
                                                                 attn_layers=sf.Decoder(dim=D, depth=1)))
    with pytest.raises(ValueError, match="train_frac_forward_backward_pairs"):
        BeliefStateWrapper(make_decoder(), train_frac_forward_backward_pairs=0.0)
    with pytest.raises(ValueError, match="cond_on_distance_prob"):
        BeliefStateWrapper(make_decoder(), cond_on_distance_prob=1.0)
    with pytest.raises(TypeError, match="seq"):
        model(seqs.float())
    with pytest.raises(ValueError, match="lens"):
        model(seqs, lens=torch.tensor([1, 2, 3, 99]))
    with pytest.raises(ValueError, match="lens or mask"):
        model(seqs, lens=torch.tensor([1, 2, 3, 4]), mask=seqs > 0)
    with pytest.raises(TypeError, match="mask"):
        model(seqs, mask=(seqs > 0).int())
    with pytest.raises(ValueError, match="reduction"):
        model(seqs, reduction="sum")
    with pytest.raises(ValueError, match="loss_weight_by_fb_indices"):
        model(seqs, loss_weight_by_fb_indices=lambda fb: torch.ones(3))
    with pytest.raises(TypeError, match="contxt"):
        model(seqs, contxt=torch.randn(4, 2, D))
    p = seqs[:, :2]
    with pytest.raises(ValueError, match="mask"):
        model.generate_with_suffix_cond(p, 2, mask=torch.zeros(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="suffix"):
        model.generate_with_suffix_cond(p, 2, suffix=seqs[:2, :2])
    with pytest.raises(ValueError, match="suffix_mask"):
        model.generate_with_suffix_cond(p, 2, suffix_mask=torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="cond_scale"):
        model.generate_with_suffix_cond(p, 2, cond_scale=2.0)
    with pytest.raises(ValueError, match="cond_scale"):
        model.generate_with_suffix_cond(p, 2, suffix=p, cond_scale=float("nan"))
    with pytest.raises(ValueError, match="temperature"):
        model.generate_with_suffix_cond(p, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="seq_len"):
        model.generate_with_suffix_cond(p, -1)
    with pytest.raises(ValueError, match="filter_logits_fn"):
        model.generate_with_suffix_cond(p, 1, filter_logits_fn="top_z")
    with pytest.raises(TypeError, match="BeliefStateWrapper"):
        belief_state_from_x_transformers(make_decoder())


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


def _xt_model(**kw):
    xt = pytest.importorskip("x_transformers")
    from x_transformers.belief_state_wrapper import BeliefStateWrapper as XB

    def dec(seed):
        torch.manual_seed(seed)
        return xt.TransformerWrapper(num_tokens=V, max_seq_len=24, attn_layers=xt.Decoder(
            dim=D, depth=2, heads=2, attn_dim_head=8, rotary_pos_emb=True))

    shared = kw.pop("shared", False)
    f = dec(0)
    torch.manual_seed(3)
    return XB(f, f if shared else dec(1), **kw)


@pytest.mark.parametrize("kw", [dict(), dict(backward_ar_loss_weight=0.5, pred_distance=True),
                                dict(shared=True, pred_distance=True, max_pred_distance=5)])
def test_parity_with_x_transformers(kw):
    xb = _xt_model(**kw)
    sb = belief_state_from_x_transformers(xb)
    assert (sb.backward_decoder is sb.forward_decoder) == (xb.backward_decoder is xb.forward_decoder)
    seqs = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(9))
    want, got = xb(seqs), sb(seqs)
    assert abs(got.item() - want.item()) < 1e-5
    want.backward()
    got.backward()
    assert_close(sb.suffix_token.grad, xb.suffix_token.grad, "suffix token gradient", torch.float32)
    assert_close(sb.forward_decoder.token_emb.weight.grad, xb.forward_decoder.token_emb.emb.weight.grad,
                 "forward token embedding gradient", torch.float32)
    suffix = torch.randint(0, V, (3, 2), generator=torch.Generator().manual_seed(10))
    for temperature in (0.0, 1.25):
        for extra in (dict(suffix=suffix), dict(), dict(decode_backwards=True)):
            torch.manual_seed(11)
            want = xb.generate_with_suffix_cond(seqs[:, :3], 5, temperature=temperature, **extra)
            torch.manual_seed(11)
            got = sb.generate_with_suffix_cond(seqs[:, :3], 5, temperature=temperature, **extra)
            assert torch.equal(got, want), (temperature, extra)


def test_parity_loss_weights_and_subsampling_with_x_transformers():
    """``loss_weight_by_fb_indices`` (x-transformers applies it when ``backward_ar_loss_weight != 1``) and
    pair subsampling from the same global seed."""
    xb = _xt_model(backward_ar_loss_weight=0.25, pred_distance=True, train_frac_forward_backward_pairs=0.5)
    sb = belief_state_from_x_transformers(xb)
    seqs = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(12))
    for fn in (lambda fb: 1.0 / (fb[:, 1] - fb[:, 0]).float(), lambda fb: torch.rand(len(fb), 2, generator=torch.Generator().manual_seed(0))):
        torch.manual_seed(13)
        want = xb(seqs, loss_weight_by_fb_indices=fn)
        torch.manual_seed(13)
        got = sb(seqs, loss_weight_by_fb_indices=fn)
        assert abs(got.item() - want.item()) < 1e-5


def test_x_transformers_flip_off_by_one_is_not_copied():
    """With ``lens = n`` x-transformers' loss differs from its own loss without lens (its backward states
    are shifted by one); safeformer's equals its loss without lens, which equals x-transformers' there."""
    xb = _xt_model()
    sb = belief_state_from_x_transformers(xb)
    seqs = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(14))
    lens = torch.full((2,), 8)
    assert abs(sb(seqs, lens=lens).item() - xb(seqs).item()) < 1e-5
    assert abs(xb(seqs, lens=lens).item() - xb(seqs).item()) > 1e-4


# ----------------------------------------------------------------------------------------------------
# the door probe (for tests/doors.py) and the clauses run on it here
# ----------------------------------------------------------------------------------------------------


def probe_belief_state(seed: int, value: float):
    """``BeliefStateWrapper`` with cross-attending decoders, distance prediction and a backward weight:
    right- or left-padded samples (sample 0 fully padded, sample 2 one real token: neither counts),
    garbage ids at padded positions and ``value`` at masked context slots (sample 1's context entirely
    masked). Per-sample losses of samples with fewer than 2 real tokens are exactly 0; an all-ignored
    batch is a loss of 0 with zero gradients; garbage in masked slots changes no guided sample."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    b, n, j = 4, 6, 3
    model = make_model(cross=True, pred_distance=True, backward_ar_loss_weight=0.5, max_pred_distance=4).train()
    lengths = torch.randint(2, n + 1, (b,), generator=g)
    lengths[0], lengths[2], lengths[-1] = 0, 1, n
    mask = sf.padding_mask(lengths, n, left=bool(seed % 2))
    seqs = torch.randint(0, V, (b, n), generator=g)
    garbage = 0 if value == 0 else 10**6
    seqs = torch.where(mask, seqs, torch.full_like(seqs, garbage))
    ctx_mask = torch.rand(b, j, generator=g) < 0.6
    ctx_mask[1] = False
    ctx_mask[-1] = True
    ctx_clean = torch.randn(b, j, D, generator=g)
    ctx = ctx_clean.masked_fill(~ctx_mask[..., None], value).requires_grad_()
    out = model(seqs, mask=mask, context=ctx, context_mask=ctx_mask, reduction="none")  # (b,)
    dead = lengths < 2

    none = model(seqs, mask=mask & (torch.arange(n) < 1), context=ctx, context_mask=ctx_mask)
    grads = torch.autograd.grad(none, [ctx] + [p for _, p in _used_params(model)], allow_unused=True)
    assert none.item() == 0.0 and all(gr is not None and not bool(gr.any()) for gr in grads), \
        "an all-ignored batch is not a loss of 0 with zero gradients"

    model.eval()
    prompts = torch.randint(0, V, (b, 2), generator=g)
    with torch.no_grad():
        kw = dict(suffix=prompts, context_mask=ctx_mask, cond_scale=2.5, temperature=0.0)
        want = model.generate_with_suffix_cond(prompts, 2, context=ctx_clean, **kw)
        got = model.generate_with_suffix_cond(prompts, 2, context=ctx.detach(), cache_kv=True, **kw)
        assert torch.equal(got, want), "garbage in masked context slots changed guided generation"
    model.train()
    return Probe(out, {"context": ctx}, {"context": ~ctx_mask[..., None].expand_as(ctx)}, dead=dead, bad_calls=[
        ("float ids", lambda: model(seqs.float()), TypeError, "seq"),
        ("lens out of range", lambda: model(seqs, lens=torch.full((b,), n + 1)), ValueError, "lens"),
        ("int mask", lambda: model(seqs, mask=mask.int()), TypeError, "mask"),
        ("unknown reduction", lambda: model(seqs, reduction="sum"), ValueError, "reduction"),
        ("context of wrong width", lambda: model(seqs, context=torch.randn(b, j, D + 1)), ValueError, "context"),
        ("an all-padding prompt", lambda: model.generate_with_suffix_cond(prompts, 1, mask=torch.zeros(b, 2, dtype=torch.bool)),
         ValueError, "mask"),
        ("suffix of another batch", lambda: model.generate_with_suffix_cond(prompts, 1, suffix=prompts[:1, :1].expand(2, 1)),
         ValueError, "suffix"),
        ("guidance with nothing to drop", lambda: model.generate_with_suffix_cond(prompts, 1, cond_scale=2.0),
         ValueError, "cond_scale"),
        ("negative temperature", lambda: model.generate_with_suffix_cond(prompts, 1, temperature=-1.0), ValueError, "temperature"),
    ])


def test_door_probe_clauses():
    check_probe(probe_belief_state, has_dead=True)


def test_prefix_conditions_reach_both_decoders_and_an_empty_prefix_is_none():
    """A prefix condition sits before the suffix token in the backward decoder; an all-False
    ``prepend_mask`` row is exactly no prefix, and an adaptive condition reaches both decoders."""
    model = make_model(torch.float64).eval()
    seqs, lengths = _batch(15)
    lens = torch.tensor(lengths)
    pre = torch.randn(4, 2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    none = torch.zeros(4, 2, dtype=torch.bool)
    with_empty = model(seqs, lens=lens, prepend_embeds=pre.masked_fill(~none[..., None], float("nan")),
                       prepend_mask=none, reduction="none")
    assert torch.equal(with_empty, model(seqs, lens=lens, reduction="none"))
    some = torch.tensor([[True, True], [False, True], [True, False], [False, False]])
    got = model(seqs, lens=lens, prepend_embeds=pre, prepend_mask=some, reduction="none")
    for i in (0, 2):  # each sample alone with its real prefix rows
        alone = model(seqs[i: i + 1, :lengths[i]], prepend_embeds=pre[i: i + 1, some[i]], reduction="none")
        assert_close(got[i], alone[0], f"sample {i} with its prefix alone", torch.float64)
    assert not torch.equal(got[0], with_empty[0])

    def ada(seed):
        torch.manual_seed(seed)
        return sf.TransformerWrapper(num_tokens=V, max_seq_len=24, attn_layers=sf.Decoder(
            dim=D, depth=1, heads=2, use_adaptive_layernorm=True, dim_condition=3))

    m2 = BeliefStateWrapper(ada(0), ada(1))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the adaptive norms start as the identity: move them
        for p in m2.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    cond = torch.randn(4, 3)
    a = m2(seqs, lens=lens, condition=cond, reduction="none")
    b = m2(seqs, lens=lens, condition=cond, condition_mask=torch.tensor([True, True, False, True]), reduction="none")
    assert torch.equal(a[[0, 1, 3]], b[[0, 1, 3]]) and not torch.equal(a[2], b[2])


def test_cond_on_distance_skips_the_distance_loss_as_x_transformers_does():
    import random

    xb = _xt_model(pred_distance=True, cond_on_distance=True, cond_on_distance_prob=0.5)
    sb = belief_state_from_x_transformers(xb)
    seqs = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(16))
    for seed in range(4):  # the same draws from Python's random module
        random.seed(seed)
        want = xb(seqs)
        random.seed(seed)
        got = sb(seqs)
        assert abs(got.item() - want.item()) < 1e-5


def test_generation_with_a_prefix_condition():
    """A prefix condition reaches both decoders at sampling as in training: cached equals uncached, an
    all-False ``prepend_mask`` (NaN in its rows) is exactly no prefix, and guidance drops it."""
    model = make_model().eval()
    g = torch.Generator().manual_seed(17)
    prompts = torch.randint(0, V, (3, 2), generator=g)
    suffix = torch.randint(0, V, (3, 2), generator=g)
    pre = torch.randn(3, 2, D, generator=g)
    pmask = torch.tensor([[True, True], [False, False], [True, False]])
    kw = dict(suffix=suffix, prepend_embeds=pre, prepend_mask=pmask, temperature=0.0)
    want = model.generate_with_suffix_cond(prompts, 4, **kw)
    assert torch.equal(model.generate_with_suffix_cond(prompts, 4, cache_kv=True, **kw), want)
    nan_pre = pre.masked_fill(~pmask[..., None], float("nan"))
    none = model.generate_with_suffix_cond(prompts[1:2], 4, suffix=suffix[1:2], temperature=0.0)
    assert torch.equal(model.generate_with_suffix_cond(prompts, 4, **{**kw, "prepend_embeds": nan_pre})[1], none[0])
    guided = model.generate_with_suffix_cond(prompts, 4, cond_scale=2.0, cache_kv=True, **{**kw, "prepend_embeds": nan_pre})
    assert guided.shape == (3, 4)
