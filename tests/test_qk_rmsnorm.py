"""x-transformers' ``qk_rmsnorm`` / ``k_rmsnorm`` (``Attention``'s ``q_rmsnorm`` / ``k_rmsnorm``, gain ``1 + gamma`` per
head): its checkpoints load (``tests/test_state_dict_parity.py``), and every path agrees: the padded forward, the
unpadded one, cached decoding on the dynamic and the static step, with NaN planted in padded slots.

Shape legend: b batch, n positions.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf
from safeformer.decoding.static import static_reason

V = 30


def _net(**kw):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=sf.Decoder(
        dim=32, depth=2, heads=4, attn_dim_head=8, rotary_pos_emb=True, **kw))
    with torch.no_grad():  # gains off their init, so that a skipped norm shows
        for name, p in net.named_parameters():
            if "rmsnorm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return net.eval()


@pytest.mark.parametrize("kw", [dict(attn_qk_rmsnorm=True), dict(attn_k_rmsnorm=True, attn_kv_heads=2),
                                dict(attn_qk_rmsnorm=True, attn_qk_norm=True, attn_num_mem_kv=2)],
                         ids=["qk", "k+gqa", "qk+l2+memory"])
def test_cached_static_and_unpadded_paths_agree_with_the_padded_forward(kw):
    net = _net(**kw)
    memory = "attn_num_mem_kv" in kw  # memory keys run on the padded path (not the unpadded one)
    assert static_reason(net) is None  # the static step runs the norms (its fused plan keeps them), memory keys too
    gen = sf.AutoregressiveWrapper(net)
    prompts = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])  # left padding
    static = gen.generate(prompts, 6, mask=mask, temperature=0.0, cache_kv=True)
    uncached = gen.generate(prompts, 6, mask=mask, temperature=0.0, cache_kv=False)
    assert torch.equal(static, uncached)
    if memory:
        return
    # the unpadded path (a mostly padded batch) equals the padded one
    ids = torch.randint(0, V, (3, 8))
    pad = torch.zeros(3, 8, dtype=torch.bool)
    pad[0, :2] = pad[1, :8] = pad[2, :1] = True
    padded = net(ids, mask=pad)
    net.attn_layers.unpadded = True
    packed = net(ids, mask=pad)
    net.attn_layers.unpadded = "auto"
    torch.testing.assert_close(packed[pad], padded[pad], rtol=1e-5, atol=1e-5)


def test_nan_in_padded_slots_reaches_no_output_and_no_gradient():
    net = _net(attn_qk_rmsnorm=True, attn_num_mem_kv=2).train()
    x = torch.randn(2, 6, 32, requires_grad=True)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    x_in = torch.where(mask[..., None], x, torch.full_like(x, float("nan")))
    out = net.attn_layers(x_in, mask=mask)
    out[mask].sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in net.attn_layers.parameters() if p.grad is not None)
    assert net.attn_layers.layers[0].mixer.q_rmsnorm.gamma.grad.abs().sum() > 0


def test_both_norms_are_refused_and_the_default_builds_nothing():
    with pytest.raises(ValueError, match="choose one of qk_rmsnorm and k_rmsnorm"):
        sf.Decoder(dim=16, depth=1, heads=2, attn_qk_rmsnorm=True, attn_k_rmsnorm=True)
    plain = sf.Decoder(dim=16, depth=1, heads=2)
    assert not any("rmsnorm" in k for k in plain.state_dict())


@pytest.mark.parametrize("kw", [dict(attn_qk_rmsnorm=True), dict(attn_k_rmsnorm=True, attn_kv_heads=2),
                                dict(attn_qk_rmsnorm=True, attn_qk_norm=True, attn_num_mem_kv=2)],
                         ids=["qk", "k+gqa", "qk+l2+memory"])
def test_from_x_transformers_converts_it(kw):
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=xt.Decoder(dim=32, depth=2, heads=4, **kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    net = sf.from_x_transformers(model).eval()
    model.eval()
    ids = torch.randint(0, V, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    torch.testing.assert_close(net(ids, mask=mask)[mask], model(ids, mask=mask)[mask], rtol=1e-5, atol=2e-5)
