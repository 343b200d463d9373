"""``FreeTransformer`` (x-transformers' ``free_transformer``): losses and sampling against x-transformers on the
same weights (float32, the same random draws), ``BinaryMapper`` against a float64 reference, padding (a padded
sample equals the sample alone; NaN at masked embeddings reaches nothing), the KV cache, errors, checkpoints."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import safeformer as sf
from safeformer.research.free_transformer import NAT, BinaryMapper, FreeTransformer

V, C, H, DH, BITS = 13, 32, 4, 8, 3


def make(head: int = 2, per: bool = True, **kw) -> FreeTransformer:
    torch.manual_seed(0)
    return FreeTransformer(num_tokens=V, dim=C, heads=H, attn_dim_head=DH, dec_head_depth=head, dec_tail_depth=2,
                           enc_depth=1, max_seq_len=32, latent_bits=BITS, per_token_latents=per, **kw)


def sharpen(model) -> None:
    """Bit logits far from 0, so the KL term is not clipped to 0 by its threshold."""
    with torch.no_grad():
        model.to_latent_bit_logits.weight.mul_(30)


# ----------------------------------------------------------------------------------------------------
# x-transformers on the same weights
# ----------------------------------------------------------------------------------------------------


def _converted(xt_model, **kw) -> FreeTransformer:
    import x_transformers as xt

    def stack(s, final_norm=True):
        if not final_norm:  # from_x_transformers wants a final norm: convert a copy that has one
            twin = xt.Decoder(dim=C, depth=len(s.layers) // 2, heads=H, attn_dim_head=DH, rotary_pos_emb=True,
                              use_rmsnorm=True)
            twin.load_state_dict(s.state_dict(), strict=False)
            s = twin
        w = xt.TransformerWrapper(num_tokens=4, max_seq_len=0, use_abs_pos_emb=False, attn_layers=s)
        return sf.from_x_transformers(w).attn_layers.state_dict()

    ours = make(**kw, norm_eps=1e-12)  # x-transformers' RMS norms divide by max(|x|, 1e-12)
    top = {k: v for k, v in xt_model.state_dict().items() if not k.startswith(("encoder.", "decoder_"))}
    ours.load_state_dict(top, strict=False)
    ours.encoder.load_state_dict(stack(xt_model.encoder))
    ours.decoder_tail.load_state_dict(stack(xt_model.decoder_tail))
    if ours.decoder_head is not None:
        ours.decoder_head.load_state_dict(stack(xt_model.decoder_head, final_norm=False), strict=False)
    return ours


@pytest.mark.parametrize("head,per", list(itertools.product((0, 2), (False, True))))
def test_matches_x_transformers(head, per):
    pytest.importorskip("x_transformers")
    from x_transformers.free_transformer import FreeTransformer as XFree

    torch.manual_seed(0)
    theirs = XFree(num_tokens=V, dim=C, heads=H, attn_dim_head=DH, dec_head_depth=head, dec_tail_depth=2,
                   enc_depth=1, max_seq_len=32, latent_bits=BITS, per_token_latents=per)
    ours = _converted(theirs, head=head, per=per)
    sharpen(theirs), sharpen(ours)
    seq, lat = torch.randint(0, V, (2, 9)), torch.randint(0, V, (2, 5))
    assert_losses_match(theirs, ours, seq, lat)
    theirs.eval(), ours.eval()
    prompt = torch.randint(0, V, (2, 3))
    for latents in (torch.tensor([1, 6]), torch.tensor(5), None):
        torch.manual_seed(2)
        want = theirs.generate(prompt, 10, latents=latents)
        torch.manual_seed(2)
        assert torch.equal(ours.generate(prompt, 10, latents=latents), want)


# ----------------------------------------------------------------------------------------------------
# the binary mapper against float64
# ----------------------------------------------------------------------------------------------------


def test_binary_mapper_float64_reference():
    torch.manual_seed(3)
    m = BinaryMapper(BITS, kl_loss_threshold=0.1).double()
    logits = (torch.randn(4, BITS, dtype=torch.float64) * 3).requires_grad_()
    mask = torch.tensor([True, False, True, True])
    torch.manual_seed(4)
    one_hot, aux = m(logits, straight_through=True, calc_aux_loss=True, mask=mask)
    torch.manual_seed(4)
    u = torch.rand(4, BITS, dtype=torch.float64)
    lg = torch.where(mask[:, None], logits.detach(), 0.0)
    bits = (u <= lg.sigmoid()).long()
    idx = (bits * 2 ** torch.arange(BITS)).sum(-1)
    assert torch.equal(one_hot.detach().argmax(-1), idx)
    p = lg.sigmoid()
    entropy = -(p * p.log() + (1 - p) * (1 - p).log()).sum(-1)
    kl = torch.relu(BITS * math.log(2) - entropy - 0.1)
    assert torch.allclose(aux, kl[mask].mean())
    codes = torch.tensor([[(c >> k) & 1 for k in range(BITS)] for c in range(2**BITS)], dtype=torch.float64)
    w = torch.randn(2**BITS, dtype=torch.float64)
    g = torch.autograd.grad((one_hot * w).sum(), logits)[0]
    lr = logits.detach().clone().requires_grad_()
    pr = torch.where(mask[:, None], lr, 0.0).sigmoid()
    soft_r = (pr[:, None, :] ** codes * (1 - pr[:, None, :]) ** (1 - codes)).prod(-1)
    g_ref = torch.autograd.grad((soft_r * w).sum(), lr)[0]
    assert torch.allclose(g, g_ref) and not g[~mask].any()
    assert NAT == math.log(2)
    # a fully masked input: no NaN, a loss of 0
    _, aux0 = m(logits, calc_aux_loss=True, mask=torch.zeros(4, dtype=torch.bool))
    assert aux0.item() == 0.0


# ----------------------------------------------------------------------------------------------------
# padding, masked content, the cache
# ----------------------------------------------------------------------------------------------------


def _fixed_bits(monkeypatch):
    """Deterministic latent bits (bit = logit >= 0) for comparisons across batch shapes."""
    monkeypatch.setattr(torch, "rand_like", lambda t, **kw: torch.full_like(t, 0.5, **kw))


@pytest.mark.parametrize("per", [False, True])
def test_padded_sample_equals_alone(per, monkeypatch):
    _fixed_bits(monkeypatch)
    model = make(per=per, pad_id=V)
    sharpen(model)
    seq, lat = torch.randint(0, V, (1, 6)), torch.randint(0, V, (1, 4))
    want = model(seq, lat if not per else None, return_all_losses=True)
    for left in (False, True):
        pad = torch.full((1, 3), V)
        sp = torch.cat((pad, seq), 1) if left else torch.cat((seq, pad), 1)
        lp = torch.cat((pad, lat), 1) if left else torch.cat((lat, pad), 1)
        got = model(sp, lp if not per else None, return_all_losses=True)
        assert torch.allclose(got[0], want[0], atol=1e-5), (left, got, want)
        assert torch.allclose(got[1][1], want[1][1], atol=1e-5)
    # a batch: the padded sample beside a full one gives its own latents and logits
    other = torch.randint(0, V, (1, 9))
    batch = torch.cat((torch.cat((seq, torch.full((1, 3), V)), 1), other))
    lat_one = model.encode_to_latents(model._embed(seq, seq != V), mask=seq != V)
    emb = model._embed(batch, batch != V)
    lat_b = model.encode_to_latents(emb, mask=batch != V)
    assert torch.allclose(lat_b[0, :6] if per else lat_b[0], lat_one[0], atol=1e-6)


def test_nan_at_masked_embeddings_stays_out():
    model = make(per=True).train()
    b, n = 3, 5
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    emb = torch.randn(b, n, C)

    def run(value):
        e = torch.where(mask[..., None], emb, value).requires_grad_()
        torch.manual_seed(0)
        one_hot, kl = model.encode_to_latents(e, mask=mask, return_kl_loss=True)
        out = torch.cat((kl[None], one_hot.flatten()))
        return out, torch.autograd.grad((out * torch.linspace(-1, 1, out.numel())).sum(), e)[0]

    clean, g_clean = run(0.0)
    for value in (float("nan"), float("inf"), 1e4):
        dirty, g = run(value)
        assert torch.equal(dirty, clean) and torch.isfinite(g).all() and torch.equal(g, g_clean)
        assert not g[~mask].any()


def test_generate_padded_prompt_and_cache():
    model = make(pad_id=V).eval()
    prompt = torch.randint(0, V, (1, 3))
    torch.manual_seed(7)
    alone = model.generate(prompt, 8, latents=3)
    torch.manual_seed(7)
    padded = model.generate(torch.cat((torch.full((1, 2), V), prompt), 1), 10, latents=3)
    assert torch.equal(padded[:, 2:], alone)
    torch.manual_seed(7)
    assert torch.equal(model.generate(prompt, 8, latents=3, use_kv_cache=False), alone)
    torch.manual_seed(7)
    assert torch.equal(model.generate(prompt[0], 8, latents=3), alone[0])
    codes = torch.nn.functional.one_hot(torch.tensor([3]), 2**BITS).float()
    torch.manual_seed(7)
    assert torch.equal(model.generate(prompt, 8, latents=codes), alone)


def probe_free_transformer(seed: int, value: float):
    """``FreeTransformer.encode_to_latents`` in training (one latent per position), ``value`` planted at padded
    embeddings (a sample with none real); out: the KL term and the straight-through one-hot latents; plus the
    loss of a padded batch (pad_id) beside them."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    model = make(per=True, pad_id=V).train()
    b, n = 3, 5
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    lengths[0], lengths[-1] = 0, n
    mask = sf.padding_mask(lengths, n, left=bool(seed % 2))
    emb = torch.where(mask[..., None], torch.randn(b, n, C, generator=g), value).requires_grad_()
    torch.manual_seed(seed)
    one_hot, kl = model.encode_to_latents(emb, mask=mask, return_kl_loss=True)
    seq = torch.where(mask, torch.randint(0, V, (b, n), generator=g), V)
    loss = model(seq)
    out = torch.cat((kl[None], loss[None], one_hot.flatten()))
    return Probe(out, {"embeds": emb}, {"embeds": ~mask[..., None].expand_as(emb)}, bad_calls=[
        ("float ids", lambda: model(seq.float()), TypeError, "seq"),
        ("ids outside the vocabulary", lambda: model(seq + 100), ValueError, "seq"),
        ("latent sequence of another batch", lambda: model(seq, seq[:2]), ValueError, "seq_for_latents"),
        ("mask of wrong shape", lambda: model.encode_to_latents(emb, mask=mask[:, 1:]), ValueError, "mask"),
        ("latent index out of range", lambda: model.generate(seq[-1:], n + 2, latents=2**BITS), ValueError, "latents"),
        ("latents of wrong width", lambda: model.generate(seq[-1:], n + 2, latents=torch.zeros(3)), ValueError, "latents"),
        ("a prompt ending in padding", lambda: model.generate(seq[:1], n + 2), ValueError, "prompts"),
        ("dim_latent other than dim", lambda: make(dim_latent=C + 1), ValueError, "dim_latent"),
    ])


def test_door_probe_clauses():
    from test_dpo import check_probe

    check_probe(probe_free_transformer, has_dead=False, seeds=(0, 1))


def test_checkpoint_round_trip(tmp_path):
    model = make(head=0, per=False, ff_glu=True).eval()
    model.save_pretrained(tmp_path)
    back = FreeTransformer.from_pretrained(tmp_path).eval()
    seq = torch.randint(0, V, (2, 6))
    torch.manual_seed(0)
    want = model(seq)
    torch.manual_seed(0)
    assert torch.equal(back(seq), want)


def assert_losses_match(theirs, ours, seq, lat, atol: float = 1e-5, each=None) -> None:
    """x-transformers' FreeTransformer and ours, the same random draws: equal total, autoregressive and KL losses
    (without and with a separate sequence for the latents) and equal gradients on the token embedding; ``each()``
    runs after each pair of calls (a further check)."""
    for seq_for_latents in (None, lat):
        torch.manual_seed(1)
        want, (want_ar, want_kl) = theirs(seq, seq_for_latents, return_all_losses=True)
        torch.manual_seed(1)
        got, (got_ar, got_kl) = ours(seq, seq_for_latents, return_all_losses=True)
        assert want_kl.item() > 0
        for a, b in ((want, got), (want_ar, got_ar), (want_kl, got_kl)):
            assert torch.allclose(a, b, atol=atol, rtol=atol), (a.item(), b.item())
        if each is not None:
            each()
        gw = torch.autograd.grad(want, theirs.token_emb.weight)[0]
        gg = torch.autograd.grad(got, ours.token_emb.weight)[0]
        assert torch.allclose(gw, gg, atol=atol, rtol=1e-4)
