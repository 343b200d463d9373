"""Tests for ``safeformer.research.continuous_autoencoder.ContinuousTransformerAutoencoder``: latents and losses
against a float64 reference (each sample alone, on its real positions), the safety contract (padding,
left padding, fully padded samples, NaN/inf at padded positions, an all-padding batch, the KL term at
extreme weights, dropped latents), named errors, and parity with x-transformers on converted weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise, assert_close, assert_finite, assert_zero
from test_dpo import check_probe

import safeformer as sf
from safeformer.research.continuous_autoencoder import (
    ContinuousTransformerAutoencoder,
    VariationalLatentBottleneck,
    continuous_autoencoder_from_x_transformers,
)

B, N, C, D, L = 4, 7, 6, 16, 8


def make_model(seed: int = 0, dtype=torch.float32, **kw) -> ContinuousTransformerAutoencoder:
    torch.manual_seed(seed)
    opts = dict(dim=D, enc_depth=1, dec_depth=1, max_seq_len=16, dim_input=C, dim_latent=L, heads=2,
                attn_dim_head=8, deterministic_bottleneck_kwargs=dict(activation=torch.nn.Tanh()))
    return ContinuousTransformerAutoencoder(**{**opts, **kw}).to(dtype)


def lens_batch(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, C, generator=g).to(dtype)
    lens = torch.tensor([N, 3, 0, 5])  # sample 2 is fully padded
    return x, lens, torch.arange(N)[None] < lens[:, None]


def ref_sample(model, x, kind):
    """Float64 latents and per-sample reconstruction loss of one unpadded sample ``x (n, c)``."""
    n = x.shape[0]
    enc = model.encoder(x[None], return_embeddings=True)[0]  # (n, d)
    pooled = enc.mean(0)
    if kind == "deterministic":
        latent = model.bottleneck.activation(model.bottleneck.proj(pooled))
    else:
        mean, log_var = model.bottleneck.to_mean_log_var(pooled).chunk(2)
        latent = mean  # the noise is 0 in this reference (passed as zeros below)
    prefix = model.from_latent_to_prepend_token(latent)[None, None]
    recon = model.decoder(x[None], prepend_embeds=prefix, excise_prepend_embeds=True)[0]
    assert recon.shape == (n, x.shape[1])
    err = (recon - x).square() if model.loss_type == "l2" else (recon - x).abs()
    return latent, err.mean()


class _ZeroNoise(VariationalLatentBottleneck):
    def forward(self, x, return_unreduced_loss=False, *, noise=None):
        return super().forward(x, return_unreduced_loss, noise=torch.zeros(x.shape[0], self.dim_latent, dtype=x.dtype))


@pytest.mark.parametrize("kind", ["deterministic", "variational"])
@pytest.mark.parametrize("loss_type", ["l1", "l2"])
def test_matches_float64_reference(kind, loss_type):
    model = make_model(dtype=torch.float64, bottleneck_type=kind, loss_type=loss_type).eval()
    if kind == "variational":
        bn = _ZeroNoise(D, L).double()
        bn.load_state_dict(model.bottleneck.state_dict())
        model.bottleneck = bn
    x, lens, mask = lens_batch(dtype=torch.float64)
    total, (recon, aux) = model(x, lens=lens, return_all_losses=True, return_unreduced_loss=True)
    latents = model.encode(x, lens=lens)
    for i in range(B):
        n = int(lens[i])
        if n == 0:
            assert recon[i].item() == 0.0 and total[i].item() == 0.0
            assert_finite(latents[i], "latent of a fully padded sample")
            continue
        lat, rl = ref_sample(model, x[i, :n], kind)
        assert_close(latents[i], lat, f"latent {i}", torch.float64)
        assert_close(recon[i], rl, f"reconstruction loss {i}", torch.float64)
    if kind == "variational":
        mean, log_var = model.bottleneck.to_mean_log_var(
            torch.stack([model.encoder(x[i, : int(lens[i])][None], return_embeddings=True)[0].mean(0) if lens[i] else
                         torch.zeros(D, dtype=torch.float64) for i in range(B)])).chunk(2, -1)
        kl = 0.5 * (log_var.exp() + mean.square() - log_var - 1).sum(-1)
        kl = torch.where(lens > 0, kl, 0.0)
        assert_close(aux, kl, "per-sample KL", torch.float64)
        _, (_, aux_mean) = model(x, lens=lens, return_all_losses=True)
        assert_close(aux_mean, kl.sum() / 3, "KL mean over samples with a real position", torch.float64)
    else:
        assert aux is None
    # the reduced reconstruction loss is the mean over every real element (x-transformers' masked mean)
    _, (recon_mean, _) = model(x, lens=lens, return_all_losses=True)
    assert_close(recon_mean, (recon * lens).sum() / lens.sum(), "reduced reconstruction loss", torch.float64)


def test_left_padding_and_mask_equal_lens():
    model = make_model(dtype=torch.float64, bottleneck_type="deterministic").eval()
    x, lens, mask = lens_batch(1, torch.float64)
    by_lens = model(x, lens=lens, return_unreduced_loss=True)
    by_mask = model(x, mask=mask, return_unreduced_loss=True)
    assert torch.equal(by_lens, by_mask)
    left = torch.full_like(x, float("nan"))
    lmask = torch.zeros_like(mask)
    for i in range(B):
        n = int(lens[i])
        if n:
            left[i, N - n:] = x[i, :n]
            lmask[i, N - n:] = True
    got = model(left, mask=lmask, return_unreduced_loss=True)
    assert_close(got, by_lens, "left padding", torch.float64)
    assert_close(model.encode(left, mask=lmask), model.encode(x, lens=lens), "left-padded latents", torch.float64)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e4])
def test_garbage_at_padded_positions_reaches_nothing(value):
    model = make_model(bottleneck_type="variational").train()
    x, lens, mask = lens_batch(2)

    def run(inp):
        inp = inp.clone().requires_grad_()
        model.zero_grad()
        torch.manual_seed(5)  # the same noise and latent dropout
        loss = model(inp, lens=lens)
        loss.backward()
        return loss, inp.grad, [p.grad.clone() for p in model.parameters()]

    clean, dirty = run(x), run(x.masked_fill(~mask[..., None], value))
    assert_finite(dirty[0], "loss")
    assert torch.equal(clean[0], dirty[0])
    assert_finite(dirty[1], "seq grad")
    assert_zero(dirty[1][~mask], "gradient at padded positions")
    assert_bitwise(dirty[1], clean[1], "seq grad")
    for a, b in zip(clean[2], dirty[2]):
        assert_finite(b, "parameter grad")
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["deterministic", "variational"])
def test_all_padding_batch_is_zero_loss_with_zero_gradients(kind):
    model = make_model(bottleneck_type=kind).train()
    x = torch.full((B, N, C), float("nan")).requires_grad_()
    lens = torch.zeros(B, dtype=torch.long)
    loss, (recon, aux) = model(x, lens=lens, return_all_losses=True)
    loss.backward()
    assert loss.item() == 0.0 and recon.item() == 0.0
    assert aux is None or aux.item() == 0.0
    assert_zero(x.grad, "seq grad")
    for name, p in model.named_parameters():
        assert_zero(p.grad, f"grad of {name}")  # present and zero
    latents = model.encode(x, lens=lens)
    assert_finite(latents, "latents of fully padded samples")


def test_kl_is_finite_at_extreme_weights():
    model = make_model(bottleneck_type="variational")
    with torch.no_grad():
        model.bottleneck.to_mean_log_var[0].bias.fill_(1e4)
    x, lens, _ = lens_batch(3)
    loss, (_, aux) = model(x, lens=lens, return_all_losses=True, return_unreduced_loss=True)
    assert_finite(aux, "KL")
    half = make_model(bottleneck_type="variational")
    with torch.no_grad():
        half.bottleneck.to_mean_log_var[0].bias.fill_(60.0)  # exp(60) overflows float32 without the clamp
    _, (_, aux) = half(x, lens=lens, return_all_losses=True)
    assert_finite(aux, "KL with a large log variance")


def test_dropped_latent_is_no_prefix():
    model = make_model(latents_dropout_prob=1.0).train()
    x, lens, mask = lens_batch(4)
    model.decoder.eval()  # no other randomness; the dropout module stays in training mode
    _, (recon, _) = model(x, lens=lens, return_all_losses=True, return_unreduced_loss=True)
    xs = torch.where(mask[..., None], x, 0.0)
    out = model.decoder(xs, mask=mask)
    err = (out - xs).square()
    want = sf.masked_mean(err.flatten(1), mask[..., None].expand_as(err).flatten(1), dim=1)
    assert_close(recon, want, "reconstruction with every latent dropped", torch.float32)


def test_named_errors():
    model = make_model()
    x, lens, mask = lens_batch()
    for call, exc, text in [
        (lambda: model(x[..., :-1]), ValueError, "seq"),
        (lambda: model(x.long()), TypeError, "seq"),
        (lambda: model(x, lens=lens.float()), TypeError, "lens"),
        (lambda: model(x, lens=lens[:-1]), ValueError, "lens"),
        (lambda: model(x, lens=lens + N), ValueError, "lens"),
        (lambda: model(x, lens=lens, mask=mask), ValueError, "lens or mask"),
        (lambda: model(x, mask=mask.int()), TypeError, "mask"),
        (lambda: model(x, mask=mask[:, :-1]), ValueError, "mask"),
        (lambda: make_model(loss_type="l3"), ValueError, "loss_type"),
        (lambda: make_model(bottleneck_type="vq"), ValueError, "bottleneck_type"),
        (lambda: make_model(latents_dropout_prob=1.5), ValueError, "latents_dropout_prob"),
        (lambda: make_model(bottleneck=3), TypeError, "bottleneck"),
        (lambda: continuous_autoencoder_from_x_transformers(torch.nn.Linear(2, 2)), TypeError, "ContinuousTransformerAutoencoder"),
    ]:
        with pytest.raises(exc, match=text):
            call()


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


def _xt_model(kind, dim_input, loss_type="l2"):
    pytest.importorskip("x_transformers")
    from x_transformers.continuous_autoencoder import ContinuousTransformerAutoencoder as XCAE

    torch.manual_seed(0)
    m = XCAE(dim=D, enc_depth=2, dec_depth=2, max_seq_len=16, dim_input=dim_input, dim_latent=L, heads=2,
             attn_dim_head=8, bottleneck_type=kind, loss_type=loss_type,
             deterministic_bottleneck_kwargs=dict(activation=torch.nn.Tanh()))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.eval()


@pytest.mark.parametrize("kind", ["deterministic", "variational"])
@pytest.mark.parametrize("dim_input", [D, C])
@pytest.mark.parametrize("loss_type", ["l1", "l2"])
def test_parity_with_x_transformers(kind, dim_input, loss_type):
    xm = _xt_model(kind, dim_input, loss_type)
    sm = continuous_autoencoder_from_x_transformers(xm)
    assert not sm.training and sm.loss_type == loss_type
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 10, dim_input, generator=g)
    lens = torch.tensor([10, 4, 7])
    for kw in (dict(lens=lens), {}):
        for unreduced in (False, True):
            torch.manual_seed(3)
            want, (w_rec, w_aux) = xm(x, return_all_losses=True, return_unreduced_loss=unreduced, **kw)
            torch.manual_seed(3)
            got, (g_rec, g_aux) = sm(x, return_all_losses=True, return_unreduced_loss=unreduced, **kw)
            assert (got - want).abs().max().item() < 1e-5
            assert (g_rec - w_rec).abs().max().item() < 1e-5
            assert (w_aux is None) == (g_aux is None)
            if w_aux is not None:
                assert (g_aux - w_aux).abs().max().item() < 1e-5
        torch.manual_seed(4)
        want = xm.encode(x, **kw)
        torch.manual_seed(4)
        got = sm.encode(x, **kw)
        assert (got - want).abs().max().item() < 1e-5


def test_parity_gradients_with_x_transformers():
    xm = _xt_model("variational", C)
    sm = continuous_autoencoder_from_x_transformers(xm)
    x = torch.randn(3, 10, C, generator=torch.Generator().manual_seed(5))
    lens = torch.tensor([10, 4, 7])
    torch.manual_seed(6)
    xm(x, lens=lens).backward()
    torch.manual_seed(6)
    sm(x, lens=lens).backward()
    for a, b in ((sm.bottleneck.to_mean_log_var[0].weight, xm.bottleneck.to_mean_log_var[0].weight),
                 (sm.from_latent_to_prepend_token[0].weight, xm.from_latent_to_prepend_token[0].weight),
                 (sm.encoder.project_in.weight, xm.encoder.project_in.weight)):
        assert (a.grad - b.grad).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------------
# the door probe (for tests/doors.py)
# ----------------------------------------------------------------------------------------------------


def probe_continuous_autoencoder(seed: int, value: float):
    """``ContinuousTransformerAutoencoder`` (variational, in training: noise and latent dropout drawn
    from a fixed seed): right or left padding, sample 0 fully padded (its loss is exactly 0), ``value``
    at every padded position. An all-padding batch is a loss of 0 with zero gradients."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    b, n = 4, 6
    model = make_model(bottleneck_type="variational", latents_dropout_prob=0.3).train()
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    lengths[0], lengths[-1] = 0, n
    mask = sf.padding_mask(lengths, n, left=bool(seed % 2))
    x = torch.randn(b, n, C, generator=g).masked_fill(~mask[..., None], value).requires_grad_()
    torch.manual_seed(seed)
    out = model(x, mask=mask, return_unreduced_loss=True)  # (b,)
    torch.manual_seed(seed)
    assert_finite(model.encode(x, mask=mask), "latents")
    none = model(x, mask=torch.zeros_like(mask))
    grads = torch.autograd.grad(none, [x, *model.parameters()], allow_unused=True)
    assert none.item() == 0.0 and all(gr is None or not bool(gr.any()) for gr in grads), \
        "an all-padding batch is not a loss of 0 with zero gradients"
    return Probe(out, {"seq": x}, {"seq": ~mask[..., None].expand_as(x)}, dead=lengths == 0, bad_calls=[
        ("seq of wrong width", lambda: model(x[..., 1:]), ValueError, "seq"),
        ("integer seq", lambda: model(x.detach().long()), TypeError, "seq"),
        ("float lens", lambda: model(x, lens=lengths.float()), TypeError, "lens"),
        ("lens out of range", lambda: model(x, lens=lengths + n), ValueError, "lens"),
        ("int mask", lambda: model(x, mask=mask.int()), TypeError, "mask"),
        ("lens and mask", lambda: model(x, lens=lengths, mask=mask), ValueError, "lens or mask"),
    ])


def test_door_probe_clauses():
    check_probe(probe_continuous_autoencoder, has_dead=True)


def test_fully_padded_loss_term_uses_functional_l1():
    # guards the l1 path against broadcasting: recon and target share a shape
    model = make_model(loss_type="l1").eval()
    x, lens, mask = lens_batch(6)
    _, (recon, _) = model(x, lens=lens, return_all_losses=True, return_unreduced_loss=True)
    out = model.decoder(torch.where(mask[..., None], x, 0.0), mask=mask,
                        prepend_embeds=model.from_latent_to_prepend_token(model.encode(x, lens=lens))[:, None],
                        excise_prepend_embeds=True)
    err = F.l1_loss(out, torch.where(mask[..., None], x, 0.0), reduction="none")
    want = sf.masked_mean(err.flatten(1), mask[..., None].expand_as(err).flatten(1), dim=1)
    assert_close(recon, want, "l1 reconstruction", torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite_and_all_padding_is_zero(dtype):
    model = make_model(bottleneck_type="variational", dtype=dtype).train()
    x, lens, mask = lens_batch(7)
    x = (x * 100).to(dtype).masked_fill(~mask[..., None], float("nan"))
    loss, (_, aux) = model(x, lens=lens, return_all_losses=True)
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and torch.isfinite(aux)
    model.zero_grad()
    none = model(x, lens=torch.zeros_like(lens))
    none.backward()
    assert none.item() == 0.0
    for name, p in model.named_parameters():
        assert_zero(p.grad, f"grad of {name}")
