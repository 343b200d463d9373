"""Tests for ``safeformer.research.gpt_vae.GPTVAE``: the loss against a float64 reference (each sample alone, on
its real tokens), the safety contract (padding, left padding, fully padded samples and latent sources,
garbage ids at padded positions, an all-padding batch, the KL term at extreme weights, dropped latents),
guidance against the dropped latent, named errors, and parity with x-transformers on converted weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_finite, assert_zero
from test_dpo import check_probe

import safeformer as sf
from safeformer.research.gpt_vae import GPTVAE, gpt_vae_from_x_transformers

V, B, N, D, L = 13, 4, 8, 16, 6


def make_model(seed: int = 0, dtype=torch.float64, **kw) -> GPTVAE:
    torch.manual_seed(seed)
    opts = dict(num_tokens=V, dim=D, depth=1, enc_depth=1, max_seq_len=16, dim_latent=L, heads=2, attn_dim_head=8,
                pad_id=0, vae_kl_div_floor=0.01)
    m = GPTVAE(**{**opts, **kw}).to(dtype)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def batch(seed: int = 0, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, V, (B, N), generator=g)
    lens = torch.tensor([N, 5, 1, 0])  # sample 2: no target; sample 3: fully padded
    mask = torch.arange(N)[None] < lens[:, None]
    return torch.where(mask, seq, pad), mask, lens


def ref_loss(model, seq, lens, seq_lat=None, lens_lat=None):
    """Float64 loss by hand, noise 0: per sample, the encoder on its real latent tokens alone, the
    decoder on its real tokens alone; cross-entropy averaged over every counted target; KL over samples
    with a real latent position."""
    seq_lat, lens_lat = (seq, lens) if seq_lat is None else (seq_lat, lens_lat)
    nll, count, kls = [], 0, []
    for i in range(seq.shape[0]):
        k = int(lens_lat[i])
        pooled = model.encoder(seq_lat[i, :k][None])[0] if k else torch.zeros(D, dtype=torch.float64)
        mean, log_var = model.to_latent_mean_log_variance(pooled).chunk(2)
        if k:
            kl = F.relu(0.5 * (log_var.exp() + mean.square() - log_var - 1) - model.vae_kl_div_floor).sum()
            kls.append(kl)
        n = int(lens[i])
        if n >= 2:
            prefix = model.from_latent_to_prepend_token(mean)[None, None]
            logits = model.decoder(seq[i, : n - 1][None], prepend_embeds=prefix)[0, 1:]  # (n - 1, v)
            lp = logits.log_softmax(-1).gather(-1, seq[i, 1:n, None])[:, 0]
            nll.append(-lp.sum())
            count += n - 1
    ar = torch.stack(nll).sum() / count
    kl = torch.stack(kls).sum() / len(kls)
    return ar, kl


def zero_noise(b=B):
    return torch.zeros(b, L, dtype=torch.float64)


def test_loss_matches_float64_reference():
    model = make_model().eval()
    seq, mask, lens = batch()
    total, (ar, kl) = model(seq, return_all_losses=True, noise=zero_noise())
    want_ar, want_kl = ref_loss(model, seq, lens)
    assert_close(ar, want_ar, "next-token loss", torch.float64)
    assert_close(kl, want_kl, "KL over samples with a real position", torch.float64)
    assert_close(total, want_ar + want_kl, "total", torch.float64)
    # a separate sequence for the latents, with its own padding (sample 0's fully padded)
    g = torch.Generator().manual_seed(9)
    lat_lens = torch.tensor([0, 3, 8, 2])
    lat = torch.where(torch.arange(N)[None] < lat_lens[:, None], torch.randint(1, V, (B, N), generator=g), 0)
    _, (ar, kl) = model(seq, lat, return_all_losses=True, noise=zero_noise())
    want_ar, want_kl = ref_loss(model, seq, lens, lat, lat_lens)
    assert_close(ar, want_ar, "next-token loss, separate latent sequence", torch.float64)
    assert_close(kl, want_kl, "KL, separate latent sequence", torch.float64)


def test_left_padding_and_garbage_ids_equal_right_padding():
    model = make_model(pad_id=-1).eval()
    seq, mask, lens = batch(1, pad=-1)
    right = model(seq, noise=zero_noise())
    left = torch.full_like(seq, 10**6)
    lmask = torch.zeros_like(mask)
    for i in range(B):
        n = int(lens[i])
        if n:
            left[i, N - n:] = seq[i, :n]
            lmask[i, N - n:] = True
    got = model(left, mask=lmask, noise=zero_noise())
    assert_close(got, right, "left padding with garbage ids", torch.float64)
    lat = model.encode_to_latents(left, mask=lmask, noise=zero_noise())
    assert_close(lat, model.encode_to_latents(seq, noise=zero_noise()), "left-padded latents", torch.float64)


def test_garbage_ids_at_padded_positions_change_no_gradient():
    model = make_model(dtype=torch.float32, pad_id=-1).train()
    seq, mask, _ = batch(2, pad=-1)

    def run(s):
        model.zero_grad()
        noise = torch.randn(B, L, generator=torch.Generator().manual_seed(3)).requires_grad_()
        torch.manual_seed(4)  # the same latent dropout
        loss = model(s, mask=mask, noise=noise)
        loss.backward()
        return loss, noise.grad, [p.grad.clone() for p in model.parameters()]

    clean, dirty = run(seq), run(torch.where(mask, seq, 10**6))
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    for a, b in zip(clean[2], dirty[2]):
        assert_finite(b, "parameter gradient")
        assert torch.equal(a, b)


def test_all_padding_batch_is_zero_loss_with_zero_gradients():
    model = make_model(dtype=torch.float32).train()
    seq = torch.zeros(B, N, dtype=torch.long)  # every token is pad_id
    loss, (ar, kl) = model(seq, return_all_losses=True)
    loss.backward()
    assert loss.item() == 0.0 and ar.item() == 0.0 and kl.item() == 0.0
    for name, p in model.named_parameters():
        assert_zero(p.grad, f"grad of {name}")  # present and zero
    assert_finite(model.encode_to_latents(seq), "latents of fully padded samples")


def test_kl_is_finite_at_extreme_weights():
    model = make_model(dtype=torch.float32)
    with torch.no_grad():
        model.to_latent_mean_log_variance[0].bias.fill_(1e4)
    seq, _, _ = batch(3)
    loss, (_, kl) = model(seq, return_all_losses=True)
    assert_finite(kl, "KL")
    assert_finite(loss, "loss")


def test_dropped_latent_is_no_prefix():
    model = make_model(latents_dropout_prob=1.0).train()
    model.decoder.eval()
    model.encoder.eval()
    seq, mask, _ = batch(4)
    _, (ar, _) = model(seq, return_all_losses=True)
    want = sf.AutoregressiveWrapper(model.decoder, ignore_index=0)(seq, mask=mask)
    assert_close(ar, want, "next-token loss with every latent dropped", torch.float64)


def test_generate_guidance_against_no_latent():
    model = make_model().eval()
    seq, mask, _ = batch(5)
    prompts = seq[:2, :3]
    latents = torch.randn(L, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    plain = model.generate(prompts, 5, latents=latents, temperature=0.0)
    assert plain.shape == (2, 5)
    assert torch.equal(model.generate(prompts, 5, latents=latents, temperature=0.0, cond_scale=1.0), plain)
    none = model.generate(prompts, 5, temperature=0.0)
    assert torch.equal(model.generate(prompts, 5, latents=latents, temperature=0.0, cond_scale=0.0), none)
    guided = model.generate(prompts, 5, latents=latents, temperature=0.0, cond_scale=1e30)
    assert guided.shape == (2, 5) and bool(((guided >= 0) & (guided < V)).all())
    # latents from a sequence (its padding respected), and one 1-D prompt
    from_seq = model.generate(prompts, 4, seq_for_latents=seq[:2], temperature=0.0)
    assert from_seq.shape == (2, 4)
    assert model.generate(prompts[0], 4, latents=latents, temperature=0.0).shape == (1, 4)


def test_named_errors():
    model = make_model()
    seq, mask, _ = batch()
    for call, exc, text in [
        (lambda: model(seq.float()), TypeError, "seq"),
        (lambda: model(seq[0]), ValueError, "seq"),
        (lambda: model(seq, seq[:2]), ValueError, "seq_for_latents"),
        (lambda: model(seq, mask=mask.int()), TypeError, "mask"),
        (lambda: model(seq, mask=mask[:, 1:]), ValueError, "mask"),
        (lambda: model(seq, mask_for_latents=mask), ValueError, "mask_for_latents"),
        (lambda: model(seq, noise=torch.zeros(B, L + 1)), ValueError, "noise"),
        (lambda: model(seq + V), ValueError, "token id"),
        (lambda: model.generate(seq[:, :2], 3, latents=torch.zeros(L + 1)), ValueError, "latents"),
        (lambda: model.generate(seq[:, :2], 3, latents=torch.zeros(L), seq_for_latents=seq), ValueError, "seq_for_latents"),
        (lambda: make_model(pad_id=0.5), TypeError, "pad_id"),
        (lambda: make_model(latents_dropout_prob=2), ValueError, "latents_dropout_prob"),
        (lambda: make_model(vae_kl_div_floor=-1), ValueError, "vae_kl_div_floor"),
        (lambda: make_model(encoder=3), TypeError, "encoder"),
        (lambda: gpt_vae_from_x_transformers(torch.nn.Linear(2, 2)), TypeError, "GPTVAE"),
    ]:
        with pytest.raises(exc, match=text):
            call()


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


def _xt_model(pad_id=0):
    pytest.importorskip("x_transformers")
    from x_transformers.gpt_vae import GPTVAE as XGPTVAE

    torch.manual_seed(0)
    m = XGPTVAE(num_tokens=V, dim=D, depth=2, enc_depth=1, max_seq_len=16, dim_latent=L, heads=2, attn_dim_head=8,
                pad_id=pad_id, vae_kl_div_floor=0.01, vae_kl_loss_weight=0.5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.eval()


def test_parity_with_x_transformers():
    xm = _xt_model()
    sm = gpt_vae_from_x_transformers(xm)
    assert not sm.training and sm.pad_id == 0 and sm.vae_kl_loss_weight == 0.5
    seq, _, _ = batch(7)
    seq, lat = seq[:3], torch.randint(1, V, (3, 5), generator=torch.Generator().manual_seed(8))
    for args in ((seq,), (seq, lat)):
        torch.manual_seed(3)
        want, (w_ar, w_kl) = xm(*args, return_all_losses=True)
        torch.manual_seed(3)
        got, (g_ar, g_kl) = sm(*args, return_all_losses=True)
        for a, b in ((got, want), (g_ar, w_ar), (g_kl, w_kl)):
            assert abs(a.item() - b.item()) < 1e-5
    torch.manual_seed(4)
    want = xm.encode_to_latents(seq)
    torch.manual_seed(4)
    got = sm.encode_to_latents(seq)
    assert (got - want).abs().max().item() < 1e-5
    prompts = seq[:, :3]
    assert torch.equal(sm.generate(prompts, 6, latents=want, temperature=0.0),
                       xm.generate(prompts, 6, latents=want, temperature=0.0))
    torch.manual_seed(5)
    w = xm.generate(prompts, 6, seq_for_latents=lat, temperature=0.0)
    torch.manual_seed(5)
    assert torch.equal(sm.generate(prompts, 6, seq_for_latents=lat, temperature=0.0), w)


def test_parity_gradients_with_x_transformers():
    xm = _xt_model()
    sm = gpt_vae_from_x_transformers(xm)
    seq, _, _ = batch(8)
    seq = seq[:3]
    torch.manual_seed(6)
    xm(seq).backward()
    torch.manual_seed(6)
    sm(seq).backward()
    for a, b in ((sm.to_latent_mean_log_variance[0].weight, xm.to_latent_mean_log_variance[0].weight),
                 (sm.from_latent_to_prepend_token[0].weight, xm.from_latent_to_prepend_token[0].weight),
                 (sm.decoder.token_emb.weight, xm.decoder.token_emb.emb.weight),
                 (sm.encoder.token_emb.weight, xm.encoder.token_emb.emb.weight)):
        assert (a.grad - b.grad).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------------
# the door probe (for tests/doors.py)
# ----------------------------------------------------------------------------------------------------


def probe_gpt_vae(seed: int, value: float):
    """``GPTVAE`` in training (latent dropout drawn from a fixed seed; the noise is the leaf): right or
    left padding with garbage ids at padded positions (``10**6`` when ``value`` is planted), a sample with
    no target and a fully padded latent source. Out: ``(ar_loss, kl)``. An all-padding batch is a loss of
    0 with zero gradients."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    b, n = 4, 7
    model = make_model(dtype=torch.float32, pad_id=-1, latents_dropout_prob=0.3).train()
    lengths = torch.randint(2, n + 1, (b,), generator=g)
    lengths[0], lengths[-1] = 1, n
    mask = sf.padding_mask(lengths, n, left=bool(seed % 2))
    lat_lengths = torch.randint(1, n + 1, (b,), generator=g)
    lat_lengths[1] = 0
    lat_mask = sf.padding_mask(lat_lengths, n, left=bool(seed % 2))
    garbage = -1 if value == 0 else 10**6
    seq = torch.where(mask, torch.randint(0, V, (b, n), generator=g), garbage)
    lat = torch.where(lat_mask, torch.randint(0, V, (b, n), generator=g), garbage)
    noise = torch.randn(b, L, generator=g).requires_grad_()
    torch.manual_seed(seed)
    _, (ar, kl) = model(seq, lat, True, mask=mask, mask_for_latents=lat_mask, noise=noise)
    none = model(seq, lat, mask=torch.zeros_like(mask), mask_for_latents=torch.zeros_like(lat_mask), noise=noise)
    grads = torch.autograd.grad(none, [noise, *model.parameters()], allow_unused=True)
    assert none.item() == 0.0 and all(gr is None or not bool(gr.any()) for gr in grads), \
        "an all-padding batch is not a loss of 0 with zero gradients"
    return Probe(torch.stack([ar, kl]), {"noise": noise}, bad_calls=[
        ("float ids", lambda: model(seq.float()), TypeError, "seq"),
        ("int mask", lambda: model(seq, mask=mask.int()), TypeError, "mask"),
        ("mask of wrong shape", lambda: model(seq, mask=mask[:, 1:]), ValueError, "mask"),
        ("latent sequence of another batch", lambda: model(seq, lat[:2]), ValueError, "seq_for_latents"),
        ("noise of wrong shape", lambda: model(seq, mask=mask, noise=noise[:, 1:]), ValueError, "noise"),
        ("latents of wrong width", lambda: model.generate(seq[:, :2], 2, latents=torch.zeros(L + 1)), ValueError, "latents"),
    ])


def test_door_probe_clauses():
    check_probe(probe_gpt_vae, has_dead=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite_and_all_padding_is_zero(dtype):
    model = make_model(dtype=dtype).train()
    seq, _, _ = batch(9)
    loss, (ar, kl) = model(seq, return_all_losses=True)
    assert torch.isfinite(loss) and torch.isfinite(kl)
    model.zero_grad()
    none = model(torch.zeros_like(seq))
    none.backward()
    assert none.item() == 0.0
    for name, p in model.named_parameters():
        assert_zero(p.grad, f"grad of {name}")
