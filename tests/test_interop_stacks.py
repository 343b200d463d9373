"""``from_x_transformers`` of a bare layer stack, a ``ContinuousTransformerWrapper`` and a
``ContinuousAutoregressiveWrapper``: the same numbers at every real position on the same weights, in the
model's training mode, device and dtype; what safeformer does not build is refused by name."""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")
xc = pytest.importorskip("x_transformers.continuous")

MASK = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] + [False] * 5])


def _perturbed(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("cls,opts", [
    ("Encoder", dict()), ("Decoder", dict(rotary_pos_emb=True)), ("Decoder", dict(cross_attend=True, ff_glu=True)),
    ("Encoder", dict(use_rmsnorm=True, attn_kv_heads=1)), ("CrossAttender", dict()),
], ids=["encoder", "decoder-rotary", "decoder-cross-glu", "encoder-rms-gqa", "cross-attender"])
def test_bare_stacks_convert(cls, opts):
    torch.manual_seed(0)
    theirs = _perturbed(getattr(xt, cls)(dim=16, depth=2, heads=2, **opts)).eval()
    ours = sf.from_x_transformers(theirs)
    assert isinstance(ours, getattr(sf, cls)) and not ours.training
    x = torch.randn(3, 6, 16)
    kw = dict(context=torch.randn(3, 4, 16)) if cls == "CrossAttender" or opts.get("cross_attend") else {}
    with torch.no_grad():
        want, got = theirs(x, mask=MASK, **kw), ours(x, mask=MASK, **kw)
    torch.testing.assert_close(got[MASK], want[MASK], atol=1e-5, rtol=1e-5)
    assert bool((got[~MASK] == 0).all())


def test_stack_conversion_keeps_dtype_and_training_mode():
    theirs = xt.Encoder(dim=16, depth=1, heads=2).double().train()
    ours = sf.from_x_transformers(theirs)
    assert ours.training and all(p.dtype == torch.float64 for p in ours.parameters())


@pytest.mark.parametrize("opts", [dict(), dict(probabilistic=True), dict(scaled_sinu_pos_emb=True), dict(max_seq_len=0),
                                  dict(num_memory_tokens=2), dict(use_abs_pos_emb=False)],
                         ids=["plain", "probabilistic", "scaled-sinu", "no-positions", "memory-tokens", "no-abs"])
def test_continuous_wrapper_converts(opts):
    torch.manual_seed(1)
    kw = dict(dim_in=8, dim_out=8, max_seq_len=16)
    kw.update(opts)
    theirs = _perturbed(xc.ContinuousTransformerWrapper(**kw, attn_layers=xt.Decoder(dim=16, depth=2, heads=2))).eval()
    ours = sf.from_x_transformers(theirs)
    assert isinstance(ours, sf.ContinuousTransformerWrapper)
    x = torch.randn(3, 6, 8)
    with torch.no_grad():
        want, got = theirs(x, mask=MASK), ours(x, mask=MASK)
    if opts.get("probabilistic"):  # (2, b, n, d): mean and variance
        want, got = want[:, MASK], got[:, MASK]
    else:
        want, got = want[MASK], got[MASK]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opts", [dict(), dict(use_l1_loss=True), dict(equal_loss_weight_batch=True)],
                         ids=["mse", "l1", "equal-weight"])
def test_continuous_autoregressive_wrapper_converts(opts):
    torch.manual_seed(2)
    net = xc.ContinuousTransformerWrapper(dim_in=8, dim_out=8, max_seq_len=16,
                                          attn_layers=xt.Decoder(dim=16, depth=2, heads=2))
    theirs = xc.ContinuousAutoregressiveWrapper(_perturbed(net), **opts).eval()
    ours = sf.from_x_transformers(theirs)
    assert isinstance(ours, sf.ContinuousAutoregressiveWrapper)
    x = torch.randn(3, 7, 8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    # padded: x-transformers also counts the target after a sample's last real input (a padded position's
    # value); safeformer counts a target only where it is real: equal to x-transformers' per-position losses
    # over the counted pairs
    mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2, [True] * 3 + [False] * 4])
    with torch.no_grad():
        out = theirs.net(x[:, :-1], mask=mask[:, :-1])
        per = (out - x[:, 1:]).abs() if opts.get("use_l1_loss") else (out - x[:, 1:]).square()
        counted = mask[:, :-1] & mask[:, 1:]
        if opts.get("equal_loss_weight_batch"):  # x-transformers' batch_masked_mean: features summed, then per sample
            per = per.sum(-1)
            want = torch.stack([per[i][counted[i]].mean() for i in range(3)]).mean()
        else:
            want = per.mean(-1)[counted].mean()
        torch.testing.assert_close(ours(x, mask=mask), want, atol=1e-5, rtol=1e-5)


def test_continuous_refusals_name_the_option():
    with pytest.raises(ValueError, match="attn_gumbel_softmax"):
        sf.from_x_transformers(xc.ContinuousTransformerWrapper(dim_in=8, max_seq_len=16, attn_layers=xt.Encoder(
            dim=16, depth=1, heads=2, attn_gumbel_softmax=True)))
    custom = xc.ContinuousAutoregressiveWrapper(
        xc.ContinuousTransformerWrapper(dim_in=8, dim_out=8, max_seq_len=16, attn_layers=xt.Decoder(dim=16, depth=1)),
        loss_fn=torch.nn.SmoothL1Loss(reduction="none"))
    with pytest.raises(ValueError, match="custom loss_fn SmoothL1Loss"):
        sf.from_x_transformers(custom)
    with pytest.raises(TypeError, match="model must be"):
        sf.from_x_transformers(torch.nn.Linear(2, 2))
