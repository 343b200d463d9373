"""x-transformers' per-kind spelling of attention options: ``cross_attn_<Attention keyword>`` applies to the
cross-attention blocks only (``cross_attn_num_mem_kv=4``, the option one project turns on "for preventing nan
when dropping out text condition"), kept in the config as ``cross_attn_kwargs`` and converted by
``from_x_transformers``."""

import pytest
import torch

import safeformer as sf


def _mem(stack):
    return [(blk.kind, blk.mixer.num_mem_kv) for blk in stack.layers if blk.kind != "ff"]


def test_cross_attn_spelling_reaches_cross_blocks_only():
    d = sf.Decoder(dim=32, depth=2, heads=2, dim_head=16, cross_attend=True, attn_num_mem_kv=2,
                   cross_attn_num_mem_kv=4)
    assert _mem(d) == [("self", 2), ("cross", 4), ("self", 2), ("cross", 4)]
    assert d.get_config()["cross_attn_kwargs"] == {"num_mem_kv": 4}
    again = sf.Decoder(**d.get_config())  # the config round-trips
    assert _mem(again) == _mem(d)


def test_cross_attn_kwargs_and_spelling_merge():
    d = sf.Decoder(dim=32, depth=1, heads=2, dim_head=16, cross_attend=True, cross_attn_kwargs={"qk_norm": True},
                   cross_attn_num_mem_kv=3)
    cross = [b.mixer for b in d.layers if b.kind == "cross"][0]
    selfa = [b.mixer for b in d.layers if b.kind == "self"][0]
    assert cross.num_mem_kv == 3 and cross.q_norm is not None and selfa.q_norm is None and selfa.num_mem_kv == 0


def test_unknown_cross_attn_spelling_is_an_error():
    with pytest.raises(TypeError, match="cross_attn_bogus"):
        sf.Decoder(dim=32, depth=1, cross_attend=True, cross_attn_bogus=1)


def test_dropped_condition_with_cross_memory_stays_finite():
    torch.manual_seed(0)
    d = sf.Decoder(dim=32, depth=2, heads=2, dim_head=16, cross_attend=True, cross_attn_num_mem_kv=4)
    x = torch.randn(2, 5, 32, requires_grad=True)
    ctx = torch.randn(2, 3, 32)
    ctx[1] = float("nan")  # a dropped condition's padding holds garbage
    ctx_mask = torch.tensor([[True, True, False], [False, False, False]])
    out = d(x, context=ctx, context_mask=ctx_mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    # the dropped sample equals itself with any other (masked) context: the memory keys are all it sees
    out2 = d(x[1:], context=torch.zeros(1, 3, 32), context_mask=ctx_mask[1:])
    torch.testing.assert_close(out[1:], out2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(cross_attn_num_mem_kv=4), dict(attn_num_mem_kv=2, cross_attn_num_mem_kv=4)])
def test_converts_from_x_transformers(kw):
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    m = xt.TransformerWrapper(num_tokens=50, max_seq_len=16, attn_layers=xt.Decoder(
        dim=32, depth=2, heads=2, attn_dim_head=16, cross_attend=True, **kw))
    s = sf.from_x_transformers(m)
    m.eval(), s.eval()
    x, c = torch.randint(0, 50, (2, 7)), torch.randn(2, 3, 32)
    torch.testing.assert_close(s(x, context=c), m(x, context=c), rtol=1e-5, atol=1e-5)
    assert s.attn_layers.get_config()["cross_attn_kwargs"] == {"num_mem_kv": 4}
