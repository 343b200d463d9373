"""The logit filters speak x-transformers: ``top_k(logits, frac_num_tokens=, k=)``, ``top_p(logits, thres=)``,
``min_p``, ``top_a`` give x-transformers' results on the same logits (no ties, no mass exactly at the threshold)."""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf

xt_ar = pytest.importorskip("x_transformers.autoregressive_wrapper")


def _logits(seed: int, v: int = 37) -> torch.Tensor:
    return torch.randn(4, v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("kw", [dict(), dict(frac_num_tokens=0.3), dict(k=5), dict(k=100)], ids=str)
def test_top_k_as_x_transformers(kw):
    x = _logits(0)
    hp.assert_bitwise(sf.top_k(x, **kw), xt_ar.top_k(x, **kw), f"top_k({kw})", inf_ok=True)


@pytest.mark.parametrize("thres", [0.5, 0.9, 0.99])
def test_top_p_as_x_transformers(thres):
    x = _logits(1)
    hp.assert_bitwise(sf.top_p(x, thres=thres), xt_ar.top_p(x, thres=thres), f"top_p(thres={thres})", inf_ok=True)
    hp.assert_bitwise(sf.top_p(x, thres), xt_ar.top_p(x, thres), f"top_p({thres}) positional", inf_ok=True)


@pytest.mark.parametrize("name,kw", [("min_p", dict(min_p=0.2)), ("top_a", dict(min_p_pow=2.0, min_p_ratio=0.1))])
def test_min_p_and_top_a_as_x_transformers(name, kw):
    x = _logits(2)
    hp.assert_bitwise(getattr(sf, name)(x, **kw), getattr(xt_ar, name)(x, **kw), name, inf_ok=True)


def test_filter_arguments_named_errors():
    x = _logits(3)
    with pytest.raises(TypeError, match="frac_num_tokens is a fraction"):
        sf.top_k(x, 3)  # a count in x-transformers' frac_num_tokens place: k=3 is the spelling
    with pytest.raises(ValueError, match="not both"):
        sf.top_p(x, 0.9, thres=0.8)
    with pytest.raises(ValueError, match="frac_num_tokens"):
        sf.top_k(x, frac_num_tokens=0.0)
