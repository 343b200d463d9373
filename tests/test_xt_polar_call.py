"""x-transformers' PoPE call argument ``polar_pos_emb = (freqs, bias)`` (``PolarEmbedding.forward``'s form) on
``Attention.forward`` and ``AttentionLayers.forward`` in safeformer.

Each is checked against x-transformers itself: the same keyword call on both models, safeformer's loaded from
x-transformers' (perturbed) weights strictly (and back), outputs and gradients (input, parameters, the angles' bias)
at the real positions of a right-padded batch (float32, 1e-5). Safety: NaN planted at padded inputs and in the
angles of positions no sample uses reaches no output and no gradient, a padded sample equals itself alone, and bad
values raise errors naming ``polar_pos_emb``.

Shape legend: b batch, n positions, c model width, h heads, N angle rows given, d head dim.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
from helpers import perturb_params
from x_transformers.x_transformers import PolarEmbedding as XPolar

import safeformer as sf

DIM, HEADS, DIM_HEAD = 16, 2, 8
NAN = float("nan")
MASK = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
POS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5])  # N = 9 custom positions: the last n rows are used
pytestmark = pytest.mark.usefixtures("one_thread")


def _angles(heads: int = HEADS, seed: int = 0, positions: torch.Tensor = POS):
    """x-transformers' ``PolarEmbedding(d, heads)(positions)`` with a non-zero learned bias: ``(freqs (1, N, d), bias
    (heads, 1, d))``, the bias a leaf that takes a gradient."""
    torch.manual_seed(seed)
    pope = XPolar(DIM_HEAD, heads)
    with torch.no_grad():
        pope.learned_bias.uniform_(-6.0, 0.0)
    freqs, bias = pope(positions)
    return freqs.detach(), bias.detach().clone().requires_grad_()


def _attention_pair(opts: dict, seed: int = 0):
    torch.manual_seed(seed)
    peer = perturb_params(xt.x_transformers.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, **opts), seed).eval()
    ours = sf.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, **opts).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours, peer


def _compare(ours, peer, x: torch.Tensor, rows: torch.Tensor, angles, **kw) -> None:
    """Outputs at the real rows, and the gradients of a loss on them (input, every parameter, the angles' bias): the
    same in both models."""
    weight = torch.randn(*rows.shape, x.shape[-1])
    res = []
    for model in (ours, peer):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        freqs, bias = angles[0], angles[1].detach().clone().requires_grad_()
        out = model(xi, polar_pos_emb=(freqs, bias), **kw)
        out = out[0] if isinstance(out, tuple) else out
        (out[rows] * weight[rows]).sum().backward()
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        res.append((out.detach()[rows], xi.grad[rows], bias.grad, grads))
    torch.testing.assert_close(res[0][:3], res[1][:3], atol=1e-5, rtol=1e-5)
    assert res[0][3].keys() == res[1][3].keys() and res[0][3]
    torch.testing.assert_close(res[0][3], res[1][3], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Attention.forward(polar_pos_emb=)
# ---------------------------------------------------------------------------------------------------------------

ATTN = {"plain": {}, "causal": dict(causal=True), "gqa_shared_bias": dict(kv_heads=1),
        "qk_norm_dim_scale": dict(qk_norm=True, qk_norm_dim_scale=True), "explicit_softclamp": dict(
            softclamp_logits=True), "zero_kv_value_dim": dict(add_zero_kv=True, value_dim_head=6)}


@pytest.mark.parametrize("case", list(ATTN))
def test_attention_polar_matches_x_transformers(case):
    opts = ATTN[case]
    ours, peer = _attention_pair(opts, seed=1)
    angles = _angles(1 if "kv_heads" in opts else HEADS)
    x = torch.randn(2, 7, DIM)
    _compare(ours, peer, x, MASK, angles, mask=MASK)
    with torch.no_grad():  # the angles are used
        assert not torch.allclose(ours(x, mask=MASK)[MASK], ours(x, mask=MASK, polar_pos_emb=angles)[MASK])


def test_attention_polar_cross_attention_and_weights_match_x_transformers():
    """In cross-attention the keys take the last ``j`` rows of ``freqs + bias`` (x-transformers'); the weights of
    ``return_intermediates`` are x-transformers' too."""
    ours, peer = _attention_pair({}, seed=2)
    ctx = torch.randn(2, 6, DIM)
    ctx_mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    rows = torch.ones(2, 7, dtype=torch.bool)
    _compare(ours, peer, torch.randn(2, 7, DIM), rows, _angles(), context=ctx, context_mask=ctx_mask)
    x, angles = torch.randn(2, 7, DIM), _angles()
    with torch.no_grad():
        (o1, i1), (o2, i2) = (m(x, mask=MASK, polar_pos_emb=angles, return_intermediates=True) for m in (ours, peer))
    w1, w2 = i1.post_softmax_attn.transpose(1, 2)[MASK], i2.post_softmax_attn.transpose(1, 2)[MASK]
    torch.testing.assert_close(w1[..., :5], w2[..., :5], atol=1e-6, rtol=1e-5)
    assert i1.cached_kv[0].shape[-1] == 2 * DIM_HEAD  # the keys after PoPE (x-transformers keeps them before)


def test_attention_polar_padding_nan_and_alone():
    """NaN in padded rows of ``x`` and in the angles of the positions every sample pads reaches nothing; a padded
    sample equals itself alone (its angles the same rows)."""
    ours, _ = _attention_pair(dict(causal=True), seed=3)
    mask = torch.tensor([[True] * 5 + [False] * 2, [True] * 4 + [False] * 3])
    freqs, bias = _angles()
    freqs = freqs.clone()
    freqs[:, -2:] = NAN  # rows of positions 5 and 6, padding in both samples
    x = torch.where(mask[..., None], torch.randn(2, 7, DIM), NAN).requires_grad_()
    out = ours(x, mask=mask, polar_pos_emb=(freqs, bias))
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(bias.grad).all()
    assert (out[~mask] == 0).all() and (x.grad[~mask] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    with torch.no_grad():
        alone = ours(x[1:, :4], polar_pos_emb=(freqs[:, :-3], bias))
    torch.testing.assert_close(out[1, :4].detach(), alone[0], atol=1e-5, rtol=1e-5)


def test_attention_polar_bad_values_are_named():
    attn = sf.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD)
    x, (freqs, bias) = torch.randn(2, 7, DIM), _angles()
    bad_freqs = freqs.clone()
    bad_freqs[0, -1, 0] = float("inf")
    for value, exc in (((freqs,), TypeError), (freqs, TypeError), ((freqs.long(), bias), TypeError),
                       ((freqs, "x"), TypeError), ((freqs.expand(2, -1, -1), bias), ValueError),
                       ((freqs[:, :6], bias), ValueError), ((freqs[..., :4], bias), ValueError),
                       ((freqs, torch.zeros(3, 1, DIM_HEAD)), ValueError), ((bad_freqs, bias), ValueError)):
        with pytest.raises(exc, match="polar_pos_emb"):
            attn(x, polar_pos_emb=value)
    _, inter = attn(x, polar_pos_emb=(freqs, bias), return_intermediates=True)
    rpe = xt.x_transformers.RotaryEmbedding(4)(torch.arange(7))
    for kw in (dict(cache=inter), dict(rotary_pos_emb=rpe), dict(mem=torch.randn(2, 3, DIM))):
        with pytest.raises(ValueError, match="polar_pos_emb"):
            attn(x, polar_pos_emb=(freqs, bias), **kw)
    for opts in (dict(num_mem_kv=2), dict(l2_distance=True), dict(kv_heads=1)):  # kv_heads: a per-head bias
        with pytest.raises(ValueError, match="polar_pos_emb"):
            sf.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, **opts)(x, polar_pos_emb=(freqs, bias))


# ---------------------------------------------------------------------------------------------------------------
# AttentionLayers.forward(polar_pos_emb=)
# ---------------------------------------------------------------------------------------------------------------

def _stack_pair(opts: dict, seed: int = 0):
    """``(ours, peer)``: x-transformers' ``Decoder`` with ``opts`` (weights perturbed) and safeformer's loaded from it
    (strictly both ways, the stack's own PoPE's ``inv_freq`` buffer included)."""
    torch.manual_seed(seed)
    peer = perturb_params(xt.Decoder(dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD, **opts), seed).eval()
    ours = sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, **opts).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours, peer


STACKS = {"no_own_pope": ({}, HEADS), "own_pope": (dict(polar_pos_emb=True), HEADS),
          "cross_attend": (dict(cross_attend=True), HEADS), "gqa_shared_bias": (dict(attn_kv_heads=1), 1)}


@pytest.mark.parametrize("case", list(STACKS))
def test_stack_polar_matches_x_transformers(case):
    """The given angles are every self-attention's PoPE, in place of the stack's own (x-transformers' meaning)."""
    opts, bias_heads = STACKS[case]
    ours, peer = _stack_pair(opts, seed=4)
    angles = _angles(bias_heads, seed=5)
    x = torch.randn(2, 7, DIM)
    kw = dict(context=torch.randn(2, 3, DIM)) if opts.get("cross_attend") else {}
    _compare(ours, peer, x, MASK, angles, mask=MASK, **kw)
    with torch.no_grad():
        assert not torch.allclose(ours(x, mask=MASK, **kw)[MASK], ours(x, mask=MASK, polar_pos_emb=angles, **kw)[MASK])


def test_stack_polar_padding_nan_alone_and_refusals():
    stack = perturb_params(sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD), 6).eval()
    mask = torch.tensor([[True] * 5 + [False] * 2, [True] * 4 + [False] * 3])
    freqs, bias = _angles(seed=6)
    freqs = freqs.clone()
    freqs[:, -2:] = NAN
    x = torch.where(mask[..., None], torch.randn(2, 7, DIM), NAN).requires_grad_()
    out, inter = stack(x, mask=mask, polar_pos_emb=(freqs, bias), return_hiddens=True)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(bias.grad).all()
    assert (out[~mask] == 0).all() and inter.cache is None  # a cache would hold keys of these angles only
    with torch.no_grad():
        alone = stack(x[1:, :4], polar_pos_emb=(freqs[:, :-3], bias))
    torch.testing.assert_close(out[1, :4].detach(), alone[0], atol=1e-5, rtol=1e-5)

    x, good = torch.randn(2, 5, DIM), _angles(seed=7)
    with pytest.raises(TypeError, match="polar_pos_emb"):
        stack(x, polar_pos_emb=good[0])
    with pytest.raises(ValueError, match="polar_pos_emb"):
        stack(x, polar_pos_emb=(good[0].expand(2, -1, -1), good[1]))
    rpe = xt.x_transformers.RotaryEmbedding(4)(torch.arange(5))
    for kw in (dict(return_cache=True), dict(mems=[torch.randn(2, 3, DIM)] * 2), dict(rotary_pos_emb=rpe)):
        with pytest.raises(ValueError, match="polar_pos_emb"):
            stack(x, polar_pos_emb=good, **kw)
    for other in (sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True),
                  sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, attn_num_mem_kv=2),
                  sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, attn_l2_distance=True)):
        with pytest.raises(ValueError, match="polar_pos_emb"):
            other(x, polar_pos_emb=good)
    with pytest.raises(ValueError, match="polar_pos_emb"):  # no self-attention to apply it to
        sf.CrossAttender(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD)(x, context=torch.randn(2, 3, DIM),
                                                                            polar_pos_emb=good)
