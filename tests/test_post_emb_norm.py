"""x-transformers' ``TransformerWrapper(post_emb_norm=True)``: a ``LayerNorm`` of the tokens' summed embeddings (token,
position, further embeddings) before the prefix rows. Parity and strict loads: ``tests/test_state_dict_parity.py``;
here the paths agree (static decode step, dynamic cache, uncached) and padding reaches nothing.

Shape legend: b batch, n positions.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

V = 20


def _net(**kw):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, post_emb_norm=True, attn_layers=sf.Decoder(
        dim=32, depth=2, heads=4, attn_dim_head=8), **kw)
    with torch.no_grad():
        net.post_emb_norm.gamma.add_(torch.randn_like(net.post_emb_norm.gamma))
    return net.eval()


@pytest.mark.parametrize("kw", [{}, dict(emb_dim=16)], ids=["plain", "emb_dim"])
def test_decoding_paths_agree_and_left_padding_changes_nothing(kw):
    net = _net(**kw)
    assert "post_emb_norm.gamma" in net.state_dict()
    gen = sf.AutoregressiveWrapper(net)
    prompts = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    static = gen.generate(prompts, 6, mask=mask, temperature=0.0)
    assert torch.equal(static, gen.generate(prompts, 6, mask=mask, temperature=0.0, cache_kv=False))
    assert torch.equal(static, gen.generate(prompts, 6, mask=mask, temperature=0.0, static_cache=False))
    assert torch.equal(static[0], gen.generate(prompts[:1, 2:], 6, temperature=0.0)[0])


def test_with_prefix_rows_it_stays_finite_and_the_norm_takes_gradients():
    net = _net().train()
    ids = torch.randint(0, V, (2, 6))
    prefix = torch.randn(2, 3, 32) * 5
    out = net(ids, prepend_embeds=prefix, return_embeddings=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and net.post_emb_norm.gamma.grad.abs().sum() > 0


def test_refuses_a_non_bool():
    with pytest.raises(TypeError, match="post_emb_norm must be True or False"):
        sf.TransformerWrapper(num_tokens=V, max_seq_len=8, post_emb_norm=1, attn_layers=sf.Decoder(dim=16, depth=1))
