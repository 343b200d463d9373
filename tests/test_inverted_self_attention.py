"""Inverted attention in non-causal self-attention (x-transformers' ``Attention(inverted_attention=True)``): the
same numbers as x-transformers without padding; a padded query takes no share of a key's weights (x-transformers'
padded queries do); causal masking and a KV cache are refused (the future, or the other queries, would leak); the
stack's ``attn_inverted_attention`` is dropped as x-transformers' stack drops it, with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")


def _pair():
    torch.manual_seed(0)
    theirs = xt.Attention(16, heads=2, dim_head=8, inverted_attention=True)
    ours = sf.Attention(16, heads=2, dim_head=8, inverted_attention=True)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def test_equals_x_transformers_without_padding():
    theirs, ours = _pair()
    x = torch.randn(2, 5, 16, requires_grad=True)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_padded_queries_take_no_share_and_leak_nothing():
    _, ours = _pair()
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    x[~mask] = float("nan")
    x.requires_grad_()
    out = ours(x, mask=mask)
    assert torch.isfinite(out[mask]).all()
    out[mask].sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()
    torch.testing.assert_close(out[1:2, :4], ours(x[1:2, :4].detach()), atol=1e-5, rtol=1e-5)


def test_causal_and_cache_are_refused_by_name():
    _, ours = _pair()
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="inverted_attention"):
        ours(x, causal=True)
    with pytest.raises(ValueError, match="inverted_attention"):
        sf.Attention(16, heads=2, causal=True, inverted_attention=True)(x)
    _, inter = sf.Attention(16, heads=2, dim_head=8)(x, return_intermediates=True)
    with pytest.raises(ValueError, match="inverted_attention"):
        ours(x[:, :1], cache=inter)


def test_the_stack_drops_attn_inverted_attention_as_x_transformers_does():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = sf.Encoder(dim=16, depth=1, heads=2, attn_inverted_attention=True)
    assert any("attn_inverted_attention" in str(w.message) for w in caught)
    assert not any(getattr(m, "inverted", False) for m in net.modules() if isinstance(m, sf.Attention))
    torch.manual_seed(0)
    theirs = xt.Encoder(dim=16, depth=1, heads=2, attn_inverted_attention=True)
    ours = sf.Encoder(dim=16, depth=1, heads=2)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 4, 16)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
