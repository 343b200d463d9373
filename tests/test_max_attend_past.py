"""x-transformers' ``max_attend_past`` (``attn_max_attend_past``): a query sees no key more than that many positions
before it; memory keys are always seen. Parity with x-transformers on right padding (self- and cross-attention) is in
``tests/test_state_dict_parity.py``; here what safeformer adds: the distance counts real tokens (a left-padded sample
equals itself alone), NaN in padded slots reaches nothing, and cached decoding equals uncached.

Shape legend: b batch, n positions, i queries, j keys.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf
from safeformer.decoding.static import static_reason

V, W = 20, 3


def _net(**kw):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=sf.Decoder(
        dim=32, depth=2, heads=4, attn_dim_head=8, attn_max_attend_past=W, rotary_pos_emb=True, **kw))
    return net.eval()


def test_module_alone_equals_an_explicit_window_mask():
    torch.manual_seed(0)
    attn = sf.Attention(16, heads=2, dim_head=8, causal=True, max_attend_past=W).eval()
    plain = sf.Attention(16, heads=2, dim_head=8, causal=True).eval()
    plain.load_state_dict(attn.state_dict())
    x = torch.randn(2, 9, 16)
    i = torch.arange(9)
    window = (i[:, None] - i[None, :]) <= W  # (i, j): True = may attend
    torch.testing.assert_close(attn(x), plain(x, attn_mask=window), rtol=1e-6, atol=1e-6)
    assert (attn(x) - plain(x)).abs().max() > 1e-4  # the window does mask


@pytest.mark.parametrize("kw", [{}, dict(attn_num_mem_kv=2)], ids=["plain", "memory"])
def test_left_padded_sample_equals_itself_alone_and_padding_reaches_nothing(kw):
    net = _net(**kw)
    ids = torch.randint(0, V, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :4] = False
    out = net(ids, mask=mask)
    torch.testing.assert_close(out[1, 4:], net(ids[1:, 4:])[0], rtol=1e-5, atol=1e-5)
    emb = net.token_emb(ids).detach()
    x = torch.where(mask[..., None], emb, torch.full_like(emb, float("nan"))).requires_grad_()
    h = net.attn_layers(x, mask=mask)
    h[mask].sum().backward()
    assert torch.isfinite(h).all() and torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()


def test_cached_decoding_equals_uncached():
    net = _net()
    assert static_reason(net) is None  # the static step runs it (its window reads the slots' positions)
    gen = sf.AutoregressiveWrapper(net)
    prompts = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    cached = gen.generate(prompts, 8, mask=mask, temperature=0.0, cache_kv=True)
    uncached = gen.generate(prompts, 8, mask=mask, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_refuses_a_window_that_is_not_a_positive_integer(bad):
    # a value of another type is refused by its family (an integer or None), a non-positive one by the option
    text = "max_attend_past must be a positive integer" if type(bad) is int else "max_attend_past must be an integer"
    with pytest.raises(ValueError, match=text):
        sf.Attention(16, heads=2, max_attend_past=bad)
