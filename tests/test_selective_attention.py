"""x-transformers' selective attention (``attn_selective``; https://arxiv.org/abs/2410.02703, 3.3): head 0's positive
logits let each token hide keys from the queries after it. Parity with x-transformers on right padding is in
``tests/test_state_dict_parity.py``; here what differs on purpose: padded queries gate nothing, so a left-padded
sample equals itself alone, whatever its padded slots hold; and it runs without a KV cache, as there.

Shape legend: b batch, n positions.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

V = 20


def _net(**kw):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=sf.Decoder(
        dim=32, depth=2, heads=4, attn_dim_head=8, attn_selective=True, rotary_pos_emb=True, **kw))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return net.eval()


@pytest.mark.parametrize("kw", [{}, dict(attn_num_mem_kv=2), dict(attn_head_learned_sink=True)],
                         ids=["plain", "memory", "sink"])
def test_left_padded_sample_equals_itself_alone_and_padding_reaches_nothing(kw):
    net = _net(**kw)
    ids = torch.randint(0, V, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    out = net(ids, mask=mask)
    alone = net(ids[1:, 3:])
    torch.testing.assert_close(out[1, 3:], alone[0], rtol=1e-5, atol=1e-5)
    emb = net.token_emb(ids).detach()
    x = torch.where(mask[..., None], emb, torch.full_like(emb, float("nan"))).requires_grad_()
    h = net.attn_layers(x, mask=mask)
    h[mask].sum().backward()
    assert torch.isfinite(h).all() and torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()


def test_it_selects_keys_away():
    """On the same weights, selective attention differs from plain attention (so the gate runs)."""
    net = _net()
    plain = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=sf.Decoder(
        dim=32, depth=2, heads=4, attn_dim_head=8, rotary_pos_emb=True)).eval()
    plain.load_state_dict(net.state_dict())
    ids = torch.randint(0, V, (1, 8))
    assert (net(ids) - plain(ids)).abs().max() > 1e-3


def test_no_kv_cache_and_generation_reencodes():
    net = _net()
    assert not net.can_cache_kv and not net.attn_layers.layers[0].mixer.packable
    _, cache = net.attn_layers(torch.randn(1, 4, 32), return_cache=True)
    with pytest.raises(ValueError, match="selective attention gates each query by the queries before it"):
        net.attn_layers(torch.randn(1, 1, 32), cache=cache)
    gen = sf.AutoregressiveWrapper(net)
    prompts = torch.randint(0, V, (2, 4))
    mask = torch.tensor([[False, True, True, True], [True] * 4])
    a = gen.generate(prompts, 4, mask=mask, temperature=0.0)
    b = gen.generate(prompts[1:], 4, temperature=0.0)
    assert torch.equal(a[1], b[0])


def test_checks():
    with pytest.raises(ValueError, match="selective attention .* needs causal=True"):
        sf.Attention(16, heads=2, selective=True)
    enc = sf.Encoder(dim=16, depth=1, heads=2, cross_attend=True, attn_selective=False)
    assert not enc.layers[0].mixer.selective
    dec = sf.Decoder(dim=16, depth=1, heads=2, cross_attend=True, attn_selective=True)  # self-attention only
    assert dec.layers[0].mixer.selective and not dec.layers[1].mixer.selective


def test_from_x_transformers_converts_it():
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=xt.Decoder(
        dim=32, depth=2, heads=4, attn_dim_head=8, attn_selective=True))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    net = sf.from_x_transformers(model).eval()
    model.eval()
    ids = torch.randint(0, V, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    torch.testing.assert_close(net(ids, mask=mask)[mask], model(ids, mask=mask)[mask], rtol=1e-5, atol=1e-5)
