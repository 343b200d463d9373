"""Tests for ``safeformer.research.neo_mlp.NeoMLP``: the Fourier features and the readout against float64 formulas,
a missing-feature mask equal to removing those input nodes (float64), NaN/inf at missing features
reaching no output and no gradient, a sample with every feature missing, named errors, and parity with
x-transformers' ``NeoMLP`` on converted weights."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, assert_finite, assert_zero

from safeformer.research.neo_mlp import NeoMLP, neo_mlp_from_x_transformers

I, H, O, D, B = 5, 6, 3, 16, 4
VALUES = [float("nan"), float("inf"), -float("inf"), 1e4]
MASK = torch.tensor([[True] * I, [False] * I, [True, False, True, False, True], [False, True, True, True, True]])


def make(dtype=torch.float32) -> NeoMLP:
    torch.manual_seed(0)
    m = NeoMLP(dim_in=I, dim_hidden=H, dim_out=O, dim_model=D, depth=2, encoder_kwargs=dict(attn_dim_head=8, heads=2))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.to(dtype).eval()


def test_fourier_and_readout_match_float64_formula():
    m = make(torch.float64)
    x = torch.randn(B, I, dtype=torch.float64)
    w, b = m.random_fourier[0].proj.weight[:, 0], m.random_fourier[0].proj.bias
    fourier = torch.cos(2 * math.pi * (x[..., None] * w + b))
    assert_close(m.random_fourier[0](x), fourier, "random Fourier features", torch.float64)
    assert not m.random_fourier[0].proj.weight.requires_grad
    out, (_, _, out_emb) = m(x, return_embeds=True)
    want = torch.einsum("bnd,nd->bn", out_emb, m.to_output_weights) + m.to_output_bias
    assert_close(out, want, "readout", torch.float64)


def test_missing_features_equal_removed_nodes_float64():
    m = make(torch.float64)
    x = torch.randn(B, I, dtype=torch.float64)
    got, (inp, _, _) = m(x, return_embeds=True, mask=MASK)
    for s in range(B):
        keep = MASK[s]
        emb = m.random_fourier(x[s, keep]) + m.input_embed[keep]
        seq = torch.cat((emb, m.hidden_embed, m.output_embed))[None]
        out_emb = m.transformer(seq)[0, -O:]
        want = (out_emb * m.to_output_weights).sum(-1) + m.to_output_bias
        assert_close(got[s], want, f"sample {s} against its present features alone", torch.float64)
    assert_zero(inp[~MASK], "embeddings of missing inputs")


@pytest.mark.parametrize("value", VALUES)
def test_garbage_at_missing_features_reaches_nothing(value):
    m = make()
    x = torch.randn(B, I)

    def run(x_):
        x_ = x_.clone().requires_grad_()
        m.zero_grad()
        out = m(x_, mask=MASK)
        out.square().sum().backward()
        return out, x_.grad, [p.grad.clone() for p in m.parameters() if p.requires_grad]

    clean, dirty = run(x), run(x.masked_fill(~MASK, value))
    assert_finite(dirty[0], "output")
    assert torch.equal(clean[0], dirty[0])
    assert_finite(dirty[1], "x grad")
    assert_zero(dirty[1][~MASK], "gradient at missing features")
    for a, b in zip(clean[2], dirty[2]):
        assert_finite(b, "parameter grad")
        assert torch.equal(a, b)


def test_unbatched_and_no_mask_equal_all_present():
    m = make()
    x = torch.randn(B, I)
    full = torch.ones(B, I, dtype=torch.bool)
    assert_close(m(x, mask=full), m(x), "all-present mask", torch.float32)
    assert_close(m(x[1]), m(x)[1], "unbatched", torch.float32)
    assert_close(m(x[2], mask=MASK[2]), m(x, mask=MASK)[2], "unbatched with a mask", torch.float32)


def test_named_errors():
    m = make()
    x = torch.randn(B, I)
    with pytest.raises(ValueError, match="dim_in"):
        m(torch.randn(B, I + 1))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        m(torch.ones(B, I, dtype=torch.long))
    with pytest.raises(TypeError, match="mask"):
        m(x, mask=MASK.int())
    with pytest.raises(ValueError, match="mask"):
        m(x, mask=MASK[:, :-1])
    with pytest.raises(ValueError, match="dim_model"):
        NeoMLP(dim_in=I, dim_hidden=H, dim_out=O, dim_model=0, depth=1)
    with pytest.raises(TypeError, match="attn_lazer"):
        NeoMLP(dim_in=I, dim_hidden=H, dim_out=O, dim_model=D, depth=1, encoder_kwargs=dict(attn_lazer=True))
    with pytest.raises(TypeError, match="NeoMLP"):
        neo_mlp_from_x_transformers(torch.nn.Linear(2, 2))


def test_parity_with_x_transformers():
    pytest.importorskip("x_transformers")
    from x_transformers.neo_mlp import NeoMLP as XNeoMLP

    torch.manual_seed(0)
    xm = XNeoMLP(dim_in=I, dim_hidden=H, dim_out=O, dim_model=D, depth=2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in xm.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    xm.eval()
    sm = neo_mlp_from_x_transformers(xm)
    x = torch.randn(B, I, requires_grad=True)
    want, (_, _, w_out) = xm(x, return_embeds=True)
    got, (_, _, g_out) = sm(x, return_embeds=True)
    assert (got - want).abs().max() < 1e-5
    assert_close(g_out, w_out, "output node embeddings", torch.float32)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (wx,) = torch.autograd.grad(want.sum(), x)
    assert_close(gx, wx, "input gradient", torch.float32)
    assert_close(sm(x[0]), xm(x[0]), "unbatched", torch.float32)


# ----------------------------------------------------------------------------------------------------
# the door probe (for tests/doors.py) and the clauses run on it here
# ----------------------------------------------------------------------------------------------------


def probe_neo_mlp(seed: int, value: float):
    """``NeoMLP`` with a missing-feature mask (sample 0 with every feature missing, the last with none),
    ``value`` planted at every missing feature."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    m = make()
    mask = torch.rand(B, I, generator=g) < 0.6
    mask[0], mask[-1] = False, True
    x = torch.randn(B, I, generator=g).masked_fill(~mask, value).requires_grad_()
    out = m(x, mask=mask)
    return Probe(out, {"x": x}, {"x": ~mask}, bad_calls=[
        ("x of wrong width", lambda: m(torch.randn(B, I + 1)), ValueError, "x"),
        ("integer x", lambda: m(torch.ones(B, I, dtype=torch.long)), TypeError, "x"),
        ("int mask", lambda: m(x, mask=mask.int()), TypeError, "mask"),
        ("mask of wrong shape", lambda: m(x, mask=mask[:, 1:]), ValueError, "mask"),
        ("depth of 0", lambda: NeoMLP(dim_in=I, dim_hidden=H, dim_out=O, dim_model=D, depth=0), ValueError, "depth"),
    ])


def test_door_probe_clauses():
    from test_dpo import check_probe

    check_probe(probe_neo_mlp, has_dead=False)


def test_checkpoint_round_trip(tmp_path):
    m = make()
    m.save_pretrained(tmp_path)
    back = NeoMLP.from_pretrained(tmp_path).eval()
    x = torch.randn(B, I)
    assert torch.equal(m(x, mask=MASK), back(x, mask=MASK))
