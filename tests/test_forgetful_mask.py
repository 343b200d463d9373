"""``AutoregressiveWrapper(mask_prob=)`` (x-transformers' forgetful causal mask) and ``forward(return_outputs=True)``."""

from __future__ import annotations

import math

import helpers as hp
import pytest
import torch

import safeformer as sf
from safeformer.core.losses import safe_cross_entropy

V = 17


def _model(mask_prob=0.0):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=32,
                                attn_layers=sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, rotary_pos_emb=True))
    return sf.AutoregressiveWrapper(net, mask_prob=mask_prob).double()


def _hidden_keys(seed: int, b: int, n_inp: int, p: float) -> torch.Tensor:
    """The keys the wrapper hides for this seed, drawn the way it documents (never the first position)."""
    torch.manual_seed(seed)
    rand = torch.randn(b, n_inp)
    rand[:, 0] = -torch.finfo(rand.dtype).max
    hidden = rand.topk(min(int(n_inp * p), n_inp - 1), dim=-1).indices
    return torch.ones(b, n_inp, dtype=torch.bool).scatter(1, hidden, False)


@pytest.mark.parametrize("p", [0.15, 0.5, 0.9])
def test_forgetful_mask_hides_the_drawn_keys_from_every_query(p):
    model = _model(p)
    x = torch.randint(0, V, (3, 12))
    torch.manual_seed(11)
    loss = model(x)
    keys = _hidden_keys(11, 3, 11, p)
    assert int((~keys).sum(1)[0]) == min(int(11 * p), 10) and bool(keys[:, 0].all())
    logits = model.net(x[:, :-1], attn_mask=keys[:, None, :].expand(-1, 11, -1))
    expected = safe_cross_entropy(logits, x[:, 1:])
    hp.assert_close(loss, expected, "loss under the forgetful mask")
    plain = _model(0.0)(x)
    assert not torch.allclose(loss, plain), "the mask changed nothing: the test would prove nothing"


def test_forgetful_mask_with_left_padding_and_planted_nan_stays_finite():
    """A query whose visible keys are all hidden or padding is a dead row: the loss and every gradient stay
    finite, and the padded positions' contents (NaN embeddings cannot be planted in ids, so any id) do not
    matter."""
    model = _model(0.9)
    x = torch.randint(0, V, (3, 10))
    mask = torch.arange(10)[None] >= torch.tensor([[0], [5], [8]])
    for seed in range(5):
        torch.manual_seed(seed)
        loss = model(x, mask=mask)
        loss.backward()
        hp.assert_finite(loss, "loss")
        for name, prm in model.named_parameters():
            assert prm.grad is not None, name
            hp.assert_finite(prm.grad, name)
        model.zero_grad()
        torch.manual_seed(seed)
        other = model(torch.where(mask, x, (x + 5) % V), mask=mask)  # padded ids differ
        hp.assert_bitwise(other, loss.detach(), "loss with other ids at padded positions")


def test_return_outputs_gives_the_loss_logits_and_intermediates():
    model = _model()
    x = torch.randint(0, V, (2, 9))
    loss, (logits, inter) = model(x, return_outputs=True)
    hp.assert_close(loss, model(x), "loss")
    hp.assert_close(logits, model.net(x[:, :-1]), "logits")
    assert isinstance(inter, sf.LayerIntermediates) and len(inter.attn_intermediates) == 2


@pytest.mark.parametrize("bad", [1.0, -0.1, math.nan, True, "0.1"])
def test_mask_prob_is_checked(bad):
    net = _model().net
    with pytest.raises(ValueError, match="mask_prob"):
        sf.AutoregressiveWrapper(net, mask_prob=bad)


def test_mask_prob_with_a_prefix_is_a_named_error():
    model = _model(0.3)
    with pytest.raises(ValueError, match="mask_prob"):
        model(torch.randint(0, V, (2, 6)), prepend_embeds=torch.randn(2, 2, 16, dtype=torch.float64))


def test_return_outputs_is_checked():
    with pytest.raises(TypeError, match="return_outputs"):
        _model()(torch.randint(0, V, (2, 6)), return_outputs=1)


def _xt_pred_head_pair():
    """x-transformers' TransformerWrapper(add_continuous_pred_head=True) and safeformer's on the same weights."""
    xt = pytest.importorskip("x_transformers")
    from safeformer.stack.wrappers import copy_xt_wrapper_option_weights

    torch.manual_seed(0)
    xnet = xt.TransformerWrapper(num_tokens=V, max_seq_len=16, add_continuous_pred_head=True,
                                 attn_layers=xt.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, rotary_pos_emb=True,
                                                        rotary_emb_dim=8))
    with torch.no_grad():
        for p in xnet.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    plain = xt.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=xnet.attn_layers)
    plain.load_state_dict(xnet.state_dict(), strict=False)
    converted = sf.from_x_transformers(plain)
    ours = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=converted.attn_layers,
                                 add_continuous_pred_head=True, use_abs_pos_emb=converted.pos_emb is not None)
    ours.load_state_dict(converted.state_dict(), strict=False)
    with torch.no_grad():
        copy_xt_wrapper_option_weights(ours, xnet)
    return xt.AutoregressiveWrapper(xnet), sf.AutoregressiveWrapper(ours)


def test_continuous_pred_head_loss_as_x_transformers():
    """With add_continuous_pred_head the loss adds x-transformers' continuous next-embedding term (weight 0.1):
    the same loss on the same weights, and with next_embed_loss_weight=0 the plain cross-entropy."""
    theirs, ours = _xt_pred_head_pair()
    x = torch.randint(0, V, (3, 9))
    hp.assert_close(ours(x), theirs(x).detach(), "loss with the continuous head", torch.float32)
    plain = sf.AutoregressiveWrapper(ours.net, next_embed_loss_weight=0.0)(x)
    assert not torch.allclose(plain, ours(x)), "the continuous term changed nothing: the test would prove nothing"
    hp.assert_close(plain, safe_cross_entropy(ours.net(x[:, :-1]), x[:, 1:]), "loss without the continuous term")


def test_continuous_pred_head_with_padding_and_all_ignored():
    _, ours = _xt_pred_head_pair()
    x = torch.randint(0, V, (3, 9))
    mask = torch.arange(9)[None] >= torch.tensor([[0], [4], [9]])  # the last sample is all padding
    loss = ours(x, mask=mask)
    loss.backward()
    hp.assert_finite(loss, "loss")
    for name, prm in ours.named_parameters():
        assert prm.grad is not None, name
        hp.assert_finite(prm.grad, name)
    ours.zero_grad()
    nothing = ours(x, mask=torch.zeros_like(mask))
    nothing.backward()
    hp.assert_zero(nothing, "loss of an all-padding batch")
    for name, prm in ours.named_parameters():
        hp.assert_zero(prm.grad, name, none_ok=True)
