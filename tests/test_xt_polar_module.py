"""The stack's PoPE (``AttentionLayers(polar_pos_emb=True)``) against x-transformers: the ``PolarEmbedding`` module's
state (x-transformers' persistent ``inv_freq`` buffer beside ``learned_bias``), strict loads both ways, the loaded
frequencies used, earlier safeformer checkpoints without the buffer, and PoPE with ``qk_norm``'s fixed logit scale
(applied after PoPE, as x-transformers does); ``attn_l2_distance`` with PoPE is refused by name.

Each comparison builds both models with the same keywords, perturbs x-transformers' weights, loads them into
safeformer strictly (and back), and compares outputs and gradients (input and every parameter) at the real positions
of a right-padded batch.

Shape legend: b batch, n positions, c model width, h heads, d head dim.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
from helpers import check_padded_equals_alone, perturb_params
from x_transformers.x_transformers import PolarEmbedding as XPolar

import safeformer as sf
from safeformer.nn.modules import PolarEmbedding

DIM, HEADS, DIM_HEAD = 16, 2, 8
MASK = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(depth: int = 2, seed: int = 0, **opts):
    """``(ours, peer)``: x-transformers' ``AttentionLayers(polar_pos_emb=True, **opts)`` (weights perturbed) and
    safeformer's, each loaded from the other strictly."""
    torch.manual_seed(seed)
    peer = perturb_params(xt.x_transformers.AttentionLayers(
        dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, polar_pos_emb=True, **opts), seed).eval()
    ours = sf.AttentionLayers(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, polar_pos_emb=True,
                              **opts).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours, peer


def _run(model, x: torch.Tensor, weight: torch.Tensor):
    """Outputs at the real positions of ``MASK`` and the gradients of a loss on them (input, every parameter)."""
    model.zero_grad()
    xi = x.clone().requires_grad_()
    out = model(xi, mask=MASK)
    (out[MASK] * weight[MASK]).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach()[MASK], xi.grad[MASK], grads


def _compare(ours, peer, dtype: torch.dtype = torch.float32, seed: int = 1) -> None:
    ours.to(dtype), peer.to(dtype)
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(2, 7, DIM, generator=g, dtype=dtype), torch.randn(2, 7, DIM, generator=g, dtype=dtype)
    got, want = _run(ours, x, weight), _run(peer, x, weight)
    torch.testing.assert_close(got[:2], want[:2], atol=1e-5, rtol=1e-5)
    assert got[2].keys() == want[2].keys() and "polar_pos_emb.learned_bias" in got[2]
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the module: x-transformers' state, its frequencies used
# ---------------------------------------------------------------------------------------------------------------

def test_polar_module_state_matches_x_transformers():
    ours, peer = PolarEmbedding(DIM_HEAD, HEADS), XPolar(DIM_HEAD, HEADS)
    want = {k: (v.shape, v.dtype) for k, v in peer.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in ours.state_dict().items()} == want
    assert set(want) == {"inv_freq", "learned_bias"}
    assert torch.equal(ours.inv_freq, peer.inv_freq)  # the same float32 values
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in peer.named_modules()]
    # another base's frequencies, loaded: x-transformers' numbers (the constructor's base plays no part)
    other = XPolar(DIM_HEAD, HEADS, base=500)
    with torch.no_grad():
        other.learned_bias.uniform_(-6.0, 0.0)
    ours.load_state_dict(other.state_dict(), strict=True)
    for t in (torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), torch.arange(12).reshape(2, 6)):
        torch.testing.assert_close(ours(t), other(t), atol=0, rtol=0)
    peer.load_state_dict(ours.state_dict(), strict=True)
    assert torch.equal(peer.inv_freq, other.inv_freq)


def test_polar_frequencies_below_float32():
    """Cast to bfloat16, the constructor's frequencies are read in float32 (S7); other loaded ones as rounded."""
    module = PolarEmbedding(DIM_HEAD, HEADS).to(torch.bfloat16)
    exact = XPolar(DIM_HEAD, HEADS).inv_freq
    assert module.inv_freq.dtype == torch.bfloat16
    assert torch.equal(module.frequencies(), exact) and module.angles(torch.arange(3)[None]).dtype == torch.float32
    module.load_state_dict(XPolar(DIM_HEAD, HEADS, base=500).state_dict())
    other = XPolar(DIM_HEAD, HEADS, base=500).inv_freq
    got = module.frequencies()
    assert torch.equal(got, other.to(torch.bfloat16).float()) and not torch.equal(got, exact)


# ---------------------------------------------------------------------------------------------------------------
# the stack: strict loads, the loaded frequencies, earlier checkpoints
# ---------------------------------------------------------------------------------------------------------------

def test_stack_polar_strict_load_and_parity():
    ours, peer = _pair()
    assert ours.state_dict().keys() == peer.state_dict().keys()
    assert ours.polar_pos_emb.inv_freq.dtype == peer.polar_pos_emb.inv_freq.dtype == torch.float32
    _compare(ours, peer)


def test_stack_polar_uses_the_loaded_frequencies():
    ours, peer = _pair()
    with torch.no_grad():  # another frequency per feature: the numbers must follow the buffer
        peer.polar_pos_emb.inv_freq.mul_(torch.linspace(0.5, 3.0, DIM_HEAD))
    ours.load_state_dict(peer.state_dict(), strict=True)
    assert torch.equal(ours.polar_pos_emb.inv_freq, peer.polar_pos_emb.inv_freq)
    _compare(ours, peer)


def test_wrapper_polar_key_and_earlier_checkpoint():
    peer = perturb_params(xt.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=xt.Decoder(
        dim=DIM, depth=1, heads=HEADS, attn_dim_head=DIM_HEAD, polar_pos_emb=True))).eval()
    ours = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=DIM, depth=1, heads=HEADS, attn_dim_head=DIM_HEAD, polar_pos_emb=True)).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    assert "attn_layers.polar_pos_emb.inv_freq" in ours.state_dict()
    tokens = torch.randint(0, 20, (2, 7))
    want = ours(tokens, mask=MASK).detach()
    # a checkpoint of earlier safeformer (no inv_freq) loads strictly; the buffer takes the constructor's values,
    # whatever the module held before
    old = {k: v for k, v in ours.state_dict().items() if not k.endswith("inv_freq")}
    with torch.no_grad():
        ours.attn_layers.polar_pos_emb.inv_freq.mul_(2.0)
    assert not torch.allclose(ours(tokens, mask=MASK), want)
    ours.load_state_dict(old, strict=True)
    assert torch.equal(ours.attn_layers.polar_pos_emb.inv_freq, XPolar(DIM_HEAD, HEADS).inv_freq)
    torch.testing.assert_close(ours(tokens, mask=MASK)[MASK], want[MASK], atol=0, rtol=0)
    torch.testing.assert_close(ours(tokens, mask=MASK)[MASK], peer(tokens, mask=MASK)[MASK], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# qk_norm's fixed scale after PoPE; l2 distance refused
# ---------------------------------------------------------------------------------------------------------------

def test_stack_polar_qk_norm_matches_x_transformers():
    """x-transformers scales the logits by ``qk_norm_scale`` after PoPE: the scale never reaches PoPE's softplus.
    float32 with a moderate scale; the default scale (10, logits up to ~40) in float64, where x-transformers still
    computes PoPE in float32 (its ``apply_polar_pos_emb``) but the logits' rounding no longer dominates."""
    _compare(*_pair(depth=1, attn_qk_norm=True, attn_qk_norm_scale=2.0))
    _compare(*_pair(attn_qk_norm=True), dtype=torch.float64)
    _compare(*_pair(attn_qk_norm=True, attn_qk_norm_dim_scale=True))


def test_attention_call_polar_qk_norm_matches_x_transformers():
    """``Attention.forward(polar_pos_emb=)`` with ``qk_norm``'s fixed scale (refused before): x-transformers'
    numbers."""
    torch.manual_seed(0)
    pope = XPolar(DIM_HEAD, HEADS)
    with torch.no_grad():
        pope.learned_bias.uniform_(-6.0, 0.0)
    angles = pope(torch.arange(7))
    peer = perturb_params(xt.x_transformers.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, qk_norm=True)).double()
    ours = sf.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, qk_norm=True).double()
    ours.load_state_dict(peer.state_dict(), strict=True)
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    got, want = (m(x, mask=MASK, polar_pos_emb=angles) for m in (ours, peer))
    got, want = (t[0] if isinstance(t, tuple) else t for t in (got, want))
    torch.testing.assert_close(got[MASK], want[MASK], atol=1e-5, rtol=1e-5)


def test_stack_polar_qk_norm_padding_and_cache():
    """NaN at padded positions reaches nothing, a padded sample equals itself alone, and cached decoding equals the
    full pass (the cached keys carry PoPE and the scale)."""
    ours, _ = _pair(attn_qk_norm=True, causal=True)
    check_padded_equals_alone(ours, DIM, torch.tensor([[True] * 6, [True] * 4 + [False] * 2]))
    x = torch.randn(2, 6, DIM)
    with torch.no_grad():
        full = ours(x)
        out, cache = ours(x[:, :3], return_cache=True)
        steps = [out]
        for t in range(3, 6):
            o, cache = ours(x[:, t:t + 1], cache=cache, return_cache=True)
            steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_polar_l2_distance_refused_by_name():
    for build in (lambda: sf.AttentionLayers(dim=DIM, depth=1, heads=HEADS, polar_pos_emb=True, attn_l2_distance=True),
                  lambda: sf.Decoder(dim=DIM, depth=1, heads=HEADS, polar_pos_emb=True, attn_l2_distance=True)):
        with pytest.raises(ValueError, match="attn_l2_distance"):
            build()
    angles = XPolar(DIM_HEAD, HEADS)(torch.arange(7))
    attn = sf.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, l2_distance=True)
    with pytest.raises(ValueError, match="l2_distance"):
        attn(torch.randn(2, 7, DIM), polar_pos_emb=angles)
