"""Small x-transformers 2.31.10 parameters: ``FeedForward.forward(deep_embed=)``, ``XTransformer.forward(attn_mask=)``,
``ContinuousAutoregressiveWrapper(loss_fn=)``, ``LayerIntermediates.block_hiddens`` / ``cache_length`` and
``AbsolutePositionalEmbedding.forward(x, pos, seq_start_pos, offset)``.

Each is compared with x-transformers' own module built with the same call, on the same (perturbed) weights loaded
strictly both ways: outputs and gradients in float32 at 1e-5. Padded slots hold NaN or garbage where they can, and
bad values are errors that name the argument.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from helpers import perturb_params
from torch import nn

import safeformer as sf

xt = pytest.importorskip("x_transformers")
xtc = pytest.importorskip("x_transformers.continuous")
xx = pytest.importorskip("x_transformers.x_transformers")

NAN = float("nan")
TOL = dict(atol=1e-5, rtol=1e-5)


def _twins(make_xt, make_sf, seed: int = 1):
    """x-transformers' module (perturbed off its init) and safeformer's, with its weights loaded strictly both ways."""
    torch.manual_seed(0)
    a = perturb_params(make_xt(), seed, relative=True)
    b = make_sf()
    b.load_state_dict(a.state_dict(), strict=True)
    a.load_state_dict(b.state_dict(), strict=True)
    return a, b


def _params(a: nn.Module, b: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    pb = dict(b.named_parameters())
    return [(k, p, pb[k]) for k, p in a.named_parameters()]


def _check_grads(a: nn.Module, b: nn.Module) -> None:
    for k, p, q in _params(a, b):
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), k
            continue
        assert q.grad is not None, k
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m, k=k: f"{k}: {m}")


def _args(fn) -> list[str]:
    return [n for n in inspect.signature(fn).parameters if n != "self"]


# ---------------------------------------------------------------------------------------------------
# FeedForward.forward(x, deep_embed=None)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("glu", [False, True])
def test_feed_forward_deep_embed_matches_x_transformers(glu):
    assert _args(sf.FeedForward.forward) == _args(xx.FeedForward.forward) == ["x", "deep_embed"]
    a, b = _twins(lambda: xx.FeedForward(8, mult=2, glu=glu), lambda: sf.FeedForward(8, mult=2, glu=glu))
    torch.manual_seed(2)
    x = torch.randn(2, 5, 8)
    deep = (1 + 0.5 * torch.randn(2, 5, 8)).requires_grad_()
    deep2 = deep.detach().clone().requires_grad_()
    want, got = a(x, deep_embed=deep), b(x, deep_embed=deep2)
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.allclose(got, b(x), atol=1e-3)  # the multiplier reached the output
    g = torch.randn_like(want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(deep2.grad, deep.grad, **TOL)
    _check_grads(a, b)
    torch.testing.assert_close(b(x, deep_embed=deep2[:1, :, :]), a(x, deep_embed=deep[:1]), **TOL)  # broadcast
    torch.testing.assert_close(b(x, None), a(x), **TOL)


def test_feed_forward_deep_embed_bad_values_are_named():
    ff = sf.FeedForward(8, mult=2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="deep_embed"):
        ff(x, deep_embed=torch.ones(2, 5, 4))
    with pytest.raises(ValueError, match="deep_embed"):
        ff(x, deep_embed=torch.ones(3, 2, 5, 8))  # would grow the output
    with pytest.raises(TypeError, match="deep_embed"):
        ff(x, deep_embed=torch.ones(2, 5, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="deep_embed"):
        ff(x, deep_embed=[1.0])


# ---------------------------------------------------------------------------------------------------
# XTransformer.forward(src, tgt, mask=None, attn_mask=None, src_prepend_embeds=None)
# ---------------------------------------------------------------------------------------------------

XT_KW = dict(dim=16, enc_num_tokens=20, enc_depth=1, enc_heads=2, enc_max_seq_len=8, dec_num_tokens=20,
             dec_depth=1, dec_heads=2, dec_max_seq_len=8, enc_attn_dim_head=8, dec_attn_dim_head=8)


def _src_masks():
    torch.manual_seed(4)
    b, j = 3, 6
    src = torch.randint(0, 20, (b, j))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0]], dtype=torch.bool)
    attn = torch.rand(b, 1, j, j) > 0.4
    attn |= torch.eye(j, dtype=torch.bool)  # every real query keeps a real key (its own)
    return src, mask, attn


def test_xtransformer_attn_mask_matches_x_transformers():
    params = _args(xt.XTransformer.forward)
    assert _args(sf.XTransformer.forward)[:len(params)] == params  # the same positional order
    a, b = _twins(lambda: xt.XTransformer(**XT_KW), lambda: sf.XTransformer(**XT_KW))
    src, mask, attn = _src_masks()
    tgt = torch.randint(0, 20, (3, 7))
    want, got = a(src, tgt, mask, attn), b(src, tgt, mask, attn)  # positionally, as x-transformers is called
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.allclose(got, b(src, tgt, mask=mask), atol=1e-4)  # the mask reached the encoder
    want.backward()
    got.backward()
    _check_grads(a, b)
    torch.testing.assert_close(b(src, tgt, mask=mask, attn_mask=attn[0, 0]), a(src, tgt, mask=mask,
                                                                              attn_mask=attn[0, 0]), **TOL)


def test_xtransformer_generate_attn_mask_matches_x_transformers():
    a, b = _twins(lambda: xt.XTransformer(**XT_KW), lambda: sf.XTransformer(**XT_KW))
    a.eval()
    src, mask, attn = _src_masks()
    start = torch.ones(3, 1, dtype=torch.long)
    want = a.generate(src, start, 4, mask=mask, attn_mask=attn, temperature=0.0)
    got = b.generate(src, start, 4, mask=mask, attn_mask=attn, temperature=0.0)
    assert torch.equal(got, want)


def test_xtransformer_attn_mask_dead_row_and_padding_are_safe():
    torch.manual_seed(0)
    m = perturb_params(sf.XTransformer(**XT_KW), 1, relative=True)
    src, mask, attn = _src_masks()
    attn = attn.clone()
    attn[1, 0, 2] = False  # sample 1's real query 2 may attend to no key: a dead row
    src_pad = torch.where(mask, src, 10**6)  # padded ids are never looked up
    enc = m.encode(src_pad, mask, attn_mask=attn)
    assert torch.isfinite(enc).all()
    # the dead row reads no key: other tokens' contents do not reach it
    other = src.clone()
    other[1, [0, 1, 3]] = (other[1, [0, 1, 3]] + 7) % 20
    enc2 = m.encode(other, mask, attn_mask=attn)
    torch.testing.assert_close(enc2[1, 2], enc[1, 2], atol=0, rtol=0)
    assert not torch.allclose(enc2[1, 3], enc[1, 3])
    # a padded sample equals itself alone
    alone = m.encode(src[1:2, :4], attn_mask=attn[1:2, :, :4, :4])
    torch.testing.assert_close(enc[1, :4], alone[0], **TOL)
    tgt = torch.randint(0, 20, (3, 5))
    loss = m(src_pad, tgt, mask, attn)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_xtransformer_attn_mask_bad_values_are_named():
    m = sf.XTransformer(**XT_KW)
    src, mask, attn = _src_masks()
    tgt = torch.randint(0, 20, (3, 5))
    with pytest.raises(TypeError, match="attn_mask"):
        m(src, tgt, mask, attn.float())
    with pytest.raises(ValueError, match="attn_mask"):
        m(src, tgt, mask, attn[..., :4])
    with pytest.raises(ValueError, match="attn_mask"):
        m(src, tgt, mask, attn, torch.randn(3, 2, 16))  # a prefix the mask does not cover


# ---------------------------------------------------------------------------------------------------
# ContinuousAutoregressiveWrapper(net, loss_fn=None, ...)
# ---------------------------------------------------------------------------------------------------


def _cont_net(lib, probabilistic: bool = False):
    layers = (sf if lib is sf else xt).Decoder(dim=16, depth=1, heads=2, attn_dim_head=8)
    return lib.ContinuousTransformerWrapper(dim_in=3, dim_out=3, max_seq_len=16, probabilistic=probabilistic,
                                            attn_layers=layers)


class _Weighted(nn.Module):
    """A loss with a parameter: a learned per-feature weight of the smooth L1 error."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, pred, target):
        return nn.functional.smooth_l1_loss(pred, target, reduction="none") * self.weight


def _cont_twins(loss_fn_xt, loss_fn_sf, probabilistic: bool = False, **kw):
    return _twins(lambda: xtc.ContinuousAutoregressiveWrapper(_cont_net(xtc, probabilistic), loss_fn_xt, **kw),
                  lambda: sf.ContinuousAutoregressiveWrapper(_cont_net(sf, probabilistic), loss_fn_sf, **kw))


def test_continuous_loss_fn_signature_and_state_dict():
    assert _args(sf.ContinuousAutoregressiveWrapper.__init__)[:4] == \
        _args(xtc.ContinuousAutoregressiveWrapper.__init__) == ["net", "loss_fn", "use_l1_loss", "equal_loss_weight_batch"]
    a, b = _cont_twins(_Weighted(), _Weighted())
    assert "loss_fn.weight" in b.state_dict()
    torch.testing.assert_close(b.loss_fn.weight, a.loss_fn.weight, atol=0, rtol=0)


@pytest.mark.parametrize("make", [_Weighted, lambda: nn.SmoothL1Loss(reduction="none"),
                                  lambda: (lambda p, t: (p - t).abs().pow(1.5).sum(-1))])
def test_continuous_loss_fn_matches_x_transformers_without_mask(make):
    a, b = _cont_twins(make(), make())
    torch.manual_seed(5)
    x = torch.randn(2, 7, 3)
    want, got = a(x), b(x)
    torch.testing.assert_close(got, want, **TOL)
    want.backward()
    got.backward()
    _check_grads(a, b)


def test_continuous_reduced_loss_fn_matches_x_transformers_without_mask():
    a, b = _cont_twins(nn.MSELoss(), nn.MSELoss())  # reduced: x-transformers takes its mean as it is
    x = torch.randn(2, 7, 3)
    torch.testing.assert_close(b(x), a(x), **TOL)
    with pytest.raises(ValueError, match="loss_fn"):
        b(x, mask=torch.ones(2, 7, dtype=torch.bool))  # padded targets could not be left out


def _masked_batch():
    torch.manual_seed(6)
    x = torch.randn(3, 7, 3)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 6 + [0]], dtype=torch.bool)
    return x, mask


@pytest.mark.parametrize("equal", [False, True])
def test_continuous_loss_fn_with_padding_counts_real_targets_only(equal):
    """x-transformers' meaning (``loss_fn``'s unreduced losses, their mean over the counted targets) on the targets
    safeformer counts: a target and the position predicting it both real (x-transformers also counts the padded
    target after a sample's last real step: the documented difference)."""
    a, b = _cont_twins(_Weighted(), _Weighted(), equal_loss_weight_batch=equal)
    x, mask = _masked_batch()
    counted = mask[:, 1:] & mask[:, :-1]
    out = a.net(x[:, :-1], mask=mask[:, :-1])
    loss = a.loss_fn(out, x[:, 1:])
    if equal:
        want = (torch.where(counted[..., None], loss, 0).sum((1, 2)) / counted.sum(1)).mean()
    else:
        want = loss[counted].mean()
    x_nan = torch.where(mask[..., None], x, NAN)  # padding holds NaN
    got = b(x_nan, mask=mask)
    torch.testing.assert_close(got, want, **TOL)
    want.backward()
    got.backward()
    _check_grads(a, b)
    assert all(torch.isfinite(p.grad).all() for p in b.parameters())
    per = b(x_nan, mask=mask, reduction="none")
    assert per.shape == (3, 6) and torch.equal(per[~counted], torch.zeros_like(per[~counted]))
    torch.testing.assert_close(per[1, :3], b(x[1:2, :4], reduction="none")[0], **TOL)  # equals itself alone


def test_continuous_loss_fn_probabilistic_net_gets_x_transformers_mean_and_variance():
    a, b = _cont_twins(xtc.GaussianNLL(), xtc.GaussianNLL(), probabilistic=True)
    x = torch.randn(2, 6, 3)
    want, got = a(x), b(x)
    torch.testing.assert_close(got, want, **TOL)
    want.backward()
    got.backward()
    _check_grads(a, b)
    default = sf.ContinuousAutoregressiveWrapper(b.net)  # the built-in Gaussian NLL: the same numbers
    torch.testing.assert_close(default(x), got, **TOL)


def test_continuous_loss_fn_bad_values_are_named():
    net = _cont_net(sf)
    with pytest.raises(TypeError, match="loss_fn"):
        sf.ContinuousAutoregressiveWrapper(net, 3)
    with pytest.raises(ValueError, match="loss_fn"):
        sf.ContinuousAutoregressiveWrapper(net, nn.L1Loss(reduction="none"), use_l1_loss=True)
    with pytest.raises(ValueError, match="loss_fn"):
        sf.ContinuousAutoregressiveWrapper(_cont_net(sf), nn.L1Loss(reduction="none"), loss="l1")
    x, mask = _masked_batch()
    bad = sf.ContinuousAutoregressiveWrapper(net, lambda p, t: (p - t).abs().mean(0))
    with pytest.raises(ValueError, match="loss_fn"):
        bad(x, mask=mask)
    ints = sf.ContinuousAutoregressiveWrapper(net, lambda p, t: (p > t).long())
    with pytest.raises(TypeError, match="loss_fn"):
        ints(x, mask=mask)
    narrow = sf.ContinuousAutoregressiveWrapper(net, lambda p, t: (p - t).abs().sum(-1), equal_loss_weight_batch=True)
    with pytest.raises(ValueError, match="loss_fn"):
        narrow(x, mask=mask)


# ---------------------------------------------------------------------------------------------------
# LayerIntermediates: block_hiddens, cache_length
# ---------------------------------------------------------------------------------------------------


def test_layer_intermediates_has_x_transformers_fields():
    ours = {f.name: f for f in dataclasses.fields(sf.LayerIntermediates)}
    theirs = {f.name for f in dataclasses.fields(xx.LayerIntermediates)}
    assert {"block_hiddens", "cache_length"} <= theirs
    assert theirs <= set(ours)
    inter = sf.LayerIntermediates()
    assert inter.block_hiddens is None and inter.cache_length == 0
    assert sf.LayerIntermediates(cache_length=4).cache_length == 4
    with pytest.raises(ValueError, match="cache_length"):
        sf.LayerIntermediates(cache_length=-1)
    with pytest.raises(ValueError, match="cache_length"):
        sf.LayerIntermediates(cache_length=True)


def test_layer_intermediates_cache_length_matches_x_transformers():
    kw = dict(num_tokens=20, max_seq_len=16, attn_layers=None)
    a, b = _twins(lambda: xt.TransformerWrapper(**{**kw, "attn_layers": xt.Decoder(dim=16, depth=1, heads=2)}),
                  lambda: sf.TransformerWrapper(**{**kw, "attn_layers": sf.Decoder(dim=16, depth=1, heads=2)}))
    a.eval(), b.eval()
    ids = torch.randint(0, 20, (2, 5))
    _, ia = a(ids, return_intermediates=True)
    _, ib = b(ids, return_intermediates=True)
    assert ib.cache_length == ia.cache_length == 5
    ids = torch.cat((ids, torch.randint(0, 20, (2, 1))), dim=1)
    _, ia = a(ids, cache=ia, return_intermediates=True)
    _, ib = b(ids, cache=ib, return_intermediates=True)
    assert ib.cache_length == ia.cache_length == 6
    assert dataclasses.replace(ib).cache_length == 6
    with pytest.raises(ValueError, match="cache_length"):
        ib.cache_length = 5  # safeformer continues from the KVCache: another length would mean nothing


# ---------------------------------------------------------------------------------------------------
# AbsolutePositionalEmbedding.forward(x, pos=None, seq_start_pos=None, offset=0)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("l2norm_embed", [False, True])
def test_absolute_positional_embedding_matches_x_transformers(l2norm_embed):
    assert _args(sf.AbsolutePositionalEmbedding.forward) == _args(xx.AbsolutePositionalEmbedding.forward)
    a, b = _twins(lambda: xx.AbsolutePositionalEmbedding(8, 10, l2norm_embed=l2norm_embed),
                  lambda: sf.AbsolutePositionalEmbedding(8, 10, l2norm_embed=l2norm_embed))
    ids = torch.randint(0, 50, (2, 6))
    emb = torch.randn(2, 6, 8)
    pos = torch.tensor([[0, 1, 2, 3, 9, 4], [5, 5, 1, 0, 2, 8]])
    start = torch.tensor([0, 2])
    calls = [((ids,), {}), ((emb,), {}), ((ids,), dict(offset=3)), ((ids, pos), {}),
             ((ids,), dict(seq_start_pos=start)), ((ids,), dict(pos=pos, seq_start_pos=start)),
             ((ids,), dict(seq_start_pos=start, offset=4))]
    for args, kw in calls:
        want, got = a(*args, **kw), b(*args, **kw)
        assert got.shape == want.shape, (args, kw)
        torch.testing.assert_close(got, want, **TOL)
        g = torch.randn_like(want)
        a.zero_grad(), b.zero_grad()
        (want * g).sum().backward()
        (got * g).sum().backward()
        _check_grads(a, b)


def test_absolute_positional_embedding_bad_values_are_named():
    emb = sf.AbsolutePositionalEmbedding(8, 6)
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seq_len"):
        emb(torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="offset"):
        emb(ids, offset=3)
    with pytest.raises(ValueError, match="offset"):
        emb(ids, offset=-1)
    with pytest.raises(TypeError, match="pos"):
        emb(ids, pos=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="pos"):
        emb(ids, pos=torch.tensor([[0, 1, 2, 6]] * 2))
    with pytest.raises(TypeError, match="seq_start_pos"):
        emb(ids, seq_start_pos=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="x"):
        emb(torch.zeros(4, dtype=torch.long))


def test_absolute_positional_embedding_positions_form_for_the_stacks():
    emb = sf.AbsolutePositionalEmbedding(8, 6)
    w = emb.emb.weight.detach()
    out = emb.embed_positions(torch.tensor([[0, 3, 5, 9]]))
    torch.testing.assert_close(out[0], torch.stack([w[0], w[3], w[5], w[5]]) * 8**-0.5, atol=0, rtol=0)


def test_wrapper_absolute_positions_under_left_padding():
    """The stacks' own use of the module: a left-padded sample equals itself alone (positions count real tokens)."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=sf.Decoder(dim=16, depth=1, heads=2))
    net.eval()
    ids = torch.randint(0, 20, (2, 5))
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]], dtype=torch.bool)
    out = net(ids, mask=mask)
    alone = net(ids[1:, 2:])
    torch.testing.assert_close(out[1, 2:], alone[0], **TOL)
    a = xt.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=xt.Decoder(dim=16, depth=1, heads=2))
    a.load_state_dict(net.state_dict(), strict=True)
    a.eval()
    torch.testing.assert_close(out[0], a(ids[:1])[0], **TOL)


def test_attention_qkv_receive_diff_residuals_matches_x_transformers():
    """``Attention(qkv_receive_diff_residuals=True)`` alone: ``x (3, b, n, c)`` holds the queries', keys' and values'
    inputs (x-transformers' hyper-connection views); padding in the key/value inputs reaches nothing."""
    torch.manual_seed(0)
    theirs = xt.Attention(16, heads=2, dim_head=8, qkv_receive_diff_residuals=True)
    ours = sf.Attention(16, heads=2, dim_head=8, qkv_receive_diff_residuals=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(3, 2, 5, 16)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    torch.testing.assert_close(ours(x, mask=mask)[mask], theirs(x, mask=mask)[mask], atol=1e-5, rtol=1e-5)
    planted = x.clone()
    planted[:, ~mask] = float("nan")
    planted.requires_grad_()
    out = ours(planted, mask=mask)
    out[mask].sum().backward()
    assert torch.isfinite(out[mask]).all() and torch.isfinite(planted.grad).all()
    with pytest.raises(ValueError, match="qkv_receive_diff_residuals"):
        ours(x[0])
    with pytest.raises(TypeError, match="qkv_receive_diff_residuals"):
        sf.Attention(16, qkv_receive_diff_residuals=1)
