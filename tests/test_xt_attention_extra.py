"""x-transformers' ``Attention(gate_value_heads=True)``: a per-head output gate read from the queries' input (used by
projects that build their own blocks from x-transformers' ``Attention``)."""

import pytest
import torch

import safeformer as sf


def _pair():
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    theirs = xt.Attention(dim=32, heads=4, dim_head=8, gate_value_heads=True).eval()
    ours = sf.Attention(dim=32, heads=4, dim_head=8, gate_value_heads=True).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def test_gate_value_heads_equals_x_transformers():
    theirs, ours = _pair()
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    ctx = torch.randn(2, 4, 32)  # cross-attention too (the gate reads the queries' input)
    t2 = pytest.importorskip("x_transformers").Attention(dim=32, heads=4, dim_head=8, gate_value_heads=True).eval()
    o2 = sf.Attention(dim=32, heads=4, dim_head=8, gate_value_heads=True).eval()
    o2.load_state_dict(t2.state_dict())
    torch.testing.assert_close(o2(x, ctx), t2(x, ctx), rtol=1e-5, atol=1e-5)


def test_gate_value_heads_formula_float64():
    _, ours = _pair()
    ours = ours.double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    plain = sf.Attention(dim=32, heads=4, dim_head=8).double().eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "head_gate" not in k})
    # the gated output = to_out(per-head attention * sigmoid(W x + b)): undo to_out by hooking its input
    seen = {}
    plain.to_out.register_forward_hook(lambda m, inp, out: seen.__setitem__("plain", inp[0]))
    ours.to_out.register_forward_hook(lambda m, inp, out: seen.__setitem__("gated", inp[0]))
    plain(x), ours(x)
    gate = torch.sigmoid(ours.to_v_head_gate(x))  # (b, n, h)
    want = (seen["plain"].unflatten(-1, (4, 8)) * gate[..., None]).flatten(-2)
    torch.testing.assert_close(seen["gated"], want)


def test_padding_and_dead_rows():
    _, ours = _pair()
    x = torch.randn(1, 4, 32)
    padded = torch.full((1, 7, 32), float("nan"))
    padded[0, 3:] = x[0]
    mask = torch.tensor([[False] * 3 + [True] * 4])
    padded.requires_grad_()
    out = ours(padded, mask=mask)
    out.sum().backward()
    torch.testing.assert_close(out[0, 3:], ours(x)[0], rtol=1e-5, atol=1e-5)
    assert (out[0, :3] == 0).all() and torch.isfinite(padded.grad).all()
    ctx = torch.randn(1, 3, 32)
    dropped = ours(x, ctx, context_mask=torch.zeros(1, 3, dtype=torch.bool))
    assert (dropped == 0).all()  # a dead row stays exactly 0 through the gate


def test_intermediate_values_feed_a_value_residual_as_in_x_transformers():
    """``Attention(..., return_intermediates=True).values``: the new positions' values, which a later block takes
    as ``value_residual=`` (how projects build ResFormer blocks from x-transformers' ``Attention``)."""
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(1)
    t1 = xt.Attention(dim=32, heads=4, dim_head=8).eval()
    t2 = xt.Attention(dim=32, heads=4, dim_head=8, learned_value_residual_mix=True).eval()
    o1 = sf.Attention(dim=32, heads=4, dim_head=8).eval()
    o2 = sf.Attention(dim=32, heads=4, dim_head=8, learned_value_residual_mix=True).eval()
    with torch.no_grad():
        for t in (t1, t2):
            for p in t.parameters():
                p.normal_(0, 0.3)
    o1.load_state_dict(t1.state_dict())
    o2.load_state_dict({k.replace("to_value_residual_mix.0", "to_value_residual_mix"): v
                        for k, v in t2.state_dict().items()})
    x = torch.randn(2, 5, 32)
    a, ia = t1(x, return_intermediates=True)
    b, ib = o1(x, return_intermediates=True)
    torch.testing.assert_close(ib.values, ia.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2(b, value_residual=ib.values), t2(a, value_residual=ia.values), rtol=1e-5, atol=1e-5)
    _, i2 = o2(b, value_residual=ib.values, return_intermediates=True)
    assert i2.values is None  # a block that mixed a value residual in: pass the first block's values on


def test_zero_init_output():
    attn = sf.Attention(dim=16, heads=2, dim_head=8, zero_init_output=True, bias=True)
    assert (attn.to_out.weight == 0).all() and (attn.to_out.bias == 0).all()
    assert (attn(torch.randn(1, 3, 16)) == 0).all()


def test_module_valued_options_cannot_be_saved_as_json(tmp_path):
    """A user's module as an option (a GRU beside attention, a custom activation) has no JSON config: saving says
    so instead of failing inside the JSON encoder."""
    m = sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, ff_custom_activation=torch.nn.Tanh())
    with pytest.raises(ValueError, match="no JSON config"):
        m.save_pretrained(tmp_path / "m")
