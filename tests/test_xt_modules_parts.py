"""x-transformers' small parts (``safeformer.nn.xt_modules``, re-exported by ``safeformer.x_transformers``) against
x-transformers 2.31.10's own classes: the same initialisation from the same seed, ``state_dict`` loading strictly
both ways, the same outputs and gradients on the same (perturbed) weights in float64 and float32, edge inputs
(all-zero rows, length 1 and 0), and clear errors naming the argument. The door probes at the end are run by
``test_doors.py`` (registered in ``doors.py``).

Shape legend: b batch, n positions, h heads, i queries, j keys, c features, v vocabulary.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from doors import Probe, _gen, _leaf, _lengths_mask
from helpers import perturb_params
from torch import nn

import safeformer as sf
import safeformer.x_transformers as sfx
from safeformer.nn import xt_modules as xm

xx = pytest.importorskip("x_transformers.x_transformers")
F64 = torch.float64

# ----------------------------------------------------------------------------------------------------
# the cases: (id, name, constructor args (a function of the module namespace), inputs, call)
# ----------------------------------------------------------------------------------------------------


def _x(shape=(2, 4, 6), zero_row=True):
    def make(g, dtype):
        x = torch.randn(*shape, generator=g, dtype=dtype)
        if zero_row and x.dim() == 3 and x.shape[1] > 1:
            x[0, 1] = 0.0  # an all-zero row
            x[1, 0] = 0.5  # a constant row
        return [x]
    return make


def _pair(shape=(2, 4, 6)):
    def make(g, dtype):
        return [torch.randn(*shape, generator=g, dtype=dtype), torch.randn(*shape, generator=g, dtype=dtype)]
    return make


def _none(g, dtype):
    return []


def _call(m, *xs, **kw):
    return m(*xs, **kw)


def _linear(ns):
    torch.manual_seed(5)
    return nn.Linear(6, 6)


CASES = [
    ("LayerNorm", "LayerNorm", lambda ns: ((6,), {}), _x(), _call),
    ("LayerNorm-offset", "LayerNorm", lambda ns: ((6,), {"unit_offset": True}), _x(), _call),
    ("LayerNorm-len1", "LayerNorm", lambda ns: ((6,), {}), _x((2, 1, 6)), _call),
    ("LayerNorm-len0", "LayerNorm", lambda ns: ((6,), {}), _x((2, 0, 6)), _call),
    ("ScaleNorm", "ScaleNorm", lambda ns: ((6,), {}), _x(), _call),
    ("ScaleNorm-offset", "ScaleNorm", lambda ns: ((6,), {"unit_offset": True}), _x(), _call),
    ("ScaleNorm-len0", "ScaleNorm", lambda ns: ((6,), {}), _x((2, 0, 6)), _call),
    ("SimpleRMSNorm", "SimpleRMSNorm", lambda ns: ((6,), {}), _x(), _call),
    ("SimpleRMSNorm-kwargs", "SimpleRMSNorm", lambda ns: ((6,), {"unit_offset": True}), _x((2, 1, 6)), _call),
    ("DynamicTanh", "DynamicTanh", lambda ns: ((6,), {}), _x(), _call),
    ("DynamicTanh-offset", "DynamicTanh", lambda ns: ((6,), {"init_alpha": 0.5, "unit_offset": True}), _x(), _call),
    ("ScaledSinusoidal", "ScaledSinusoidalEmbedding", lambda ns: ((8,), {}), _x((2, 5, 8)), _call),
    ("ScaledSinusoidal-offset", "ScaledSinusoidalEmbedding", lambda ns: ((8,), {"theta": 100}), _x((2, 5, 8)),
     lambda m, x: m(x, offset=3)),
    ("ScaledSinusoidal-pos", "ScaledSinusoidalEmbedding", lambda ns: ((8,), {}), _x((2, 3, 8)),
     lambda m, x: m(x, pos=torch.tensor([0.5, 7.0, 4000.0]))),
    ("ScaledSinusoidal-len0", "ScaledSinusoidalEmbedding", lambda ns: ((8,), {}), _x((2, 0, 8)), _call),
    ("Alibi", "AlibiPositionalBias", lambda ns: ((4,), {}), _none, lambda m: m(3, 5)),
    ("Alibi-partial", "AlibiPositionalBias", lambda ns: ((3,), {"total_heads": 5}), _none, lambda m: m(1, 1)),
    ("Alibi-slopes", "AlibiPositionalBias", lambda ns: ((2,), {"slopes": [0.5, 0.25]}), _none, lambda m: m(4, 4)),
    ("Alibi-custom-pos", "AlibiPositionalBias", lambda ns: ((3,), {"total_heads": 4}), _none,
     lambda m: m.forward_custom_pos(torch.tensor([[0, 2, 5], [1, 1, 9]]), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))),
    ("Alibi-per-head-pos", "AlibiPositionalBias", lambda ns: ((2,), {}), _none,
     lambda m: m.forward_custom_pos(torch.arange(12).reshape(1, 2, 6))),
    ("DynamicPositionBias", "DynamicPositionBias", lambda ns: ((8,), {"heads": 2, "depth": 1}), _none,
     lambda m: m(3, 5)),
    ("DynamicPositionBias-deep", "DynamicPositionBias",
     lambda ns: ((8,), {"heads": 3, "depth": 3, "log_distance": True, "norm": True}), _none, lambda m: m(4, 4)),
    ("DynamicPositionBias-len1", "DynamicPositionBias", lambda ns: ((8,), {"heads": 2, "depth": 2, "norm": True}),
     _none, lambda m: m(1, 1)),
    ("TokenEmbedding", "TokenEmbedding", lambda ns: ((8, 11), {}), _none,
     lambda m: m(torch.tensor([[0, 3, 10, 3], [1, 2, 2, 9]]))),
    ("TokenEmbedding-l2", "TokenEmbedding", lambda ns: ((8, 11), {"l2norm_embed": True}), _none,
     lambda m: m(torch.tensor([[0, 3, 10]]))),
    ("TokenEmbedding-len0", "TokenEmbedding", lambda ns: ((8, 11), {}), _none,
     lambda m: m(torch.zeros(2, 0, dtype=torch.long))),
    ("Residual", "Residual", lambda ns: ((6,), {}), _pair(), _call),
    ("Residual-scaled", "Residual", lambda ns: ((6,), {"scale_residual": True, "scale_residual_constant": 0.5}),
     _pair(), _call),
    ("GRUGating", "GRUGating", lambda ns: ((6,), {}), _pair(), _call),
    ("GRUGating-scaled", "GRUGating", lambda ns: ((6,), {"scale_residual": True}), _pair((2, 1, 6)), _call),
    ("GRUGating-len0", "GRUGating", lambda ns: ((6,), {}), _pair((2, 0, 6)), _call),
    ("LayerScale", "LayerScale", lambda ns: ((_linear(ns), 6), {}), _x(), _call),
    ("LayerScale-offset", "LayerScale", lambda ns: ((_linear(ns), 6), {"init_value": 0.1, "unit_offset": True}),
     _x(), _call),
    ("GLU-gelu", "GLU", lambda ns: ((6, 4, nn.GELU()), {}), _x(), _call),
    ("GLU-silu-multbias", "GLU", lambda ns: ((6, 4, nn.SiLU()), {"mult_bias": True}), _x(), _call),
    ("GLU-softclamp-gelu", "GLU", lambda ns: ((6, 4, nn.GELU()),
                                              {"softclamp": True, "gate_softclamp_value": 0.5, "up_softclamp_value": 0.7}),
     _x(), _call),
    ("GLU-softclamp-silu", "GLU", lambda ns: ((6, 4, nn.SiLU()), {"softclamp": True}), _x((2, 1, 6)), _call),
    ("ReluSquared", "ReluSquared", lambda ns: ((), {}), _x(), _call),
    ("Scale", "Scale", lambda ns: ((0.5,), {}), _x(), _call),
    ("Scale-fn", "Scale", lambda ns: ((0.5, _linear(ns)), {}), _x(), _call),
    ("Scale-one", "Scale", lambda ns: ((1.0, _linear(ns)), {}), _x(), _call),
]
IDS = [c[0] for c in CASES]


def _build(case, ns, dtype=torch.float32):
    _, name, args, _, _ = case
    a, kw = args(ns)
    torch.manual_seed(0)
    return getattr(ns, name)(*a, **kw).to(dtype)


def _pair_of_modules(case, dtype):
    theirs = _build(case, xx, dtype)
    perturb_params(theirs, seed=1, relative=True)
    ours = _build(case, sfx, dtype)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def _run(case, m, dtype, seed=3):
    xs = [x.requires_grad_() for x in case[3](_gen(seed), dtype)]
    out = case[4](m, *xs)
    out = out[0] if isinstance(out, tuple) else out
    return out, xs


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_keys_same_init_and_strict_load_both_ways(case):
    ours, theirs = _build(case, sfx), _build(case, xx)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for k, v in theirs.state_dict().items():  # the same initialisation from the same seed
        assert ours.state_dict()[k].shape == v.shape and torch.equal(ours.state_dict()[k], v), k
    assert {k for k, _ in ours.named_buffers()} == {k for k, _ in theirs.named_buffers()}
    perturb_params(theirs, seed=2, relative=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    perturb_params(ours, seed=4, relative=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for k, v in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_outputs_and_gradients_equal_x_transformers(case, dtype):
    if dtype == F64 and case[1] == "DynamicPositionBias":
        pytest.skip("x-transformers' DynamicPositionBias feeds float32 distances: float32 only")
    ours, theirs = _pair_of_modules(case, dtype)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
    got, xs_o = _run(case, ours, dtype)
    want, xs_t = _run(case, theirs, dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tol)
    if not got.requires_grad:
        return
    u = torch.randn(got.shape, generator=_gen(7), dtype=got.dtype)
    po, pt = [p for p in ours.parameters()], [p for p in theirs.parameters()]
    go = torch.autograd.grad((got * u).sum(), xs_o + po, allow_unused=True)
    gt = torch.autograd.grad((want * u).sum(), xs_t + pt, allow_unused=True)
    for a, b in zip(go, gt):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.isfinite(a).all()
            # a zero row's gradient through x / max(|x|, 1e-12) is of order 1e12: compare relatively
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, float(b.abs().amax()) if b.numel() else 1.0))


# ----------------------------------------------------------------------------------------------------
# apply_rotary_pos_emb
# ----------------------------------------------------------------------------------------------------


def _rot_inputs(kind, dtype):
    g = _gen(11)
    rot = xx.RotaryEmbedding(8, use_xpos=kind == "xpos", scale_base=16)
    if kind == "partial3d":  # F5-TTS: (b, n, h * d) with the rotary dim of one head
        freqs, scale = rot.forward_from_seq_len(5)
        return torch.randn(2, 5, 16, generator=g, dtype=dtype), freqs.to(dtype), scale
    if kind == "len1":
        freqs, scale = rot(torch.arange(7))
        return torch.randn(2, 3, 1, 12, generator=g, dtype=dtype), freqs.to(dtype), scale
    if kind == "xpos":
        freqs, scale = rot(torch.arange(6))
        return torch.randn(2, 3, 4, 8, generator=g, dtype=dtype), freqs.to(dtype), scale.to(dtype)
    if kind == "number":
        freqs, _ = rot(torch.arange(4000, 4006)[None].expand(2, 6))
        return torch.randn(2, 3, 6, 10, generator=g, dtype=dtype), freqs.to(dtype), 2.0
    freqs, scale = rot(torch.arange(9))
    return torch.randn(2, 3, 6, 8, generator=g, dtype=dtype), freqs.to(dtype), scale


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["full", "partial3d", "len1", "xpos", "number"])
def test_apply_rotary_pos_emb_equals_x_transformers(kind, dtype):
    t, freqs, scale = _rot_inputs(kind, dtype)
    t1, t2 = t.clone().requires_grad_(), t.clone().requires_grad_()
    got, want = sfx.apply_rotary_pos_emb(t1, freqs, scale), xx.apply_rotary_pos_emb(t2, freqs, scale)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **tol)
    u = torch.randn(got.shape, generator=_gen(2), dtype=dtype)
    (ga,), (gb,) = torch.autograd.grad((got * u).sum(), [t1]), torch.autograd.grad((want * u).sum(), [t2])
    torch.testing.assert_close(ga, gb, **tol)
    if kind == "partial3d":
        assert torch.equal(got[..., 8:], t[..., 8:]), "the features past the rotary dim pass unchanged"


def test_apply_rotary_pos_emb_length_zero_and_half_precision():
    freqs, _ = xx.RotaryEmbedding(8).forward_from_seq_len(4)
    assert sfx.apply_rotary_pos_emb(torch.randn(2, 3, 0, 8), freqs).shape == (2, 3, 0, 8)
    t = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    got = sfx.apply_rotary_pos_emb(t, freqs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), xx.apply_rotary_pos_emb(t, freqs).float(), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------------------
# edges: zero rows finite both ways, length 0 where x-transformers fails, init_, caching
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ScaleNorm", "SimpleRMSNorm", "LayerNorm", "DynamicTanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_all_zero_rows_are_finite_forward_and_backward(name, dtype):
    m = getattr(sfx, name)(6).to(dtype)
    x = torch.zeros(2, 3, 6, dtype=dtype, requires_grad=True)
    out = m(x)
    (g,) = torch.autograd.grad((out * torch.randn(out.shape, dtype=dtype)).sum(), [x])
    assert torch.isfinite(out).all() and torch.isfinite(g).all()
    if name != "DynamicTanh":
        assert (out == 0).all()


def test_dynamic_position_bias_and_alibi_of_no_position():
    dpb = sfx.DynamicPositionBias(8, heads=2, depth=2, norm=True)
    assert dpb(0, 0).shape == (2, 0, 0) and dpb(0, 3).shape == (2, 0, 3)
    alibi = sfx.AlibiPositionalBias(2, 3)
    assert alibi(0, 4).shape == (3, 0, 4)
    big = alibi(4, 6)
    assert torch.equal(alibi(2, 3), xx.AlibiPositionalBias(2, 3)(2, 3)) and alibi.bias is big  # cached as there


def test_token_embedding_init_matches_and_float_ids():
    for l2 in (False, True):
        ours, theirs = sfx.TokenEmbedding(8, 11, l2norm_embed=l2), xx.TokenEmbedding(8, 11, l2norm_embed=l2)
        torch.manual_seed(1)
        ours.init_()
        torch.manual_seed(1)
        theirs.init_()
        assert torch.equal(ours.emb.weight, theirs.emb.weight)
    ids = torch.tensor([[1.0, 4.0, 10.0]])
    assert torch.equal(ours(ids), theirs(ids))


def test_scaled_sinusoidal_per_sample_start_positions():
    """``seq_start_pos`` (per sample) gives ``(b, n, dim)``: each sample's row equals 1-D positions shifted
    (x-transformers 2.31.10 raises here: its einsum takes 1-D positions only)."""
    emb = sfx.ScaledSinusoidalEmbedding(8)
    x = torch.randn(2, 4, 8)
    out = emb(x, seq_start_pos=torch.tensor([0, 2]))
    assert out.shape == (2, 4, 8)
    assert torch.equal(out[1], emb(x, pos=torch.arange(4) - 2))


def test_dynamic_tanh_ignored_arguments_warn_as_x_transformers_ignores_them():
    with pytest.warns(UserWarning, match="gamma"):
        m = sfx.DynamicTanh(4, gamma=2.0)
    assert torch.equal(m.gamma, torch.ones(4))


def test_names_are_importable_from_safeformer_x_transformers_as_from_x_transformers():
    for name in xm.__all__:
        assert getattr(sfx, name) is getattr(xm, name) and name in sfx.__all__
        assert hasattr(xx, name), f"x-transformers has no {name}"
    assert importlib.import_module("safeformer.x_transformers").apply_rotary_pos_emb is xm.apply_rotary_pos_emb


# ----------------------------------------------------------------------------------------------------
# clear errors
# ----------------------------------------------------------------------------------------------------


def _bad_calls():
    x = torch.randn(2, 3, 6)
    freqs, _ = sfx.RotaryEmbedding(8).forward_from_seq_len(3)
    gru, res = sfx.GRUGating(6), sfx.Residual(6)
    dpb, alibi = sfx.DynamicPositionBias(8, heads=2, depth=1), sfx.AlibiPositionalBias(2)
    sin, tok = sfx.ScaledSinusoidalEmbedding(8), sfx.TokenEmbedding(8, 11)
    glu, ls = sfx.GLU(6, 4, nn.GELU()), sfx.LayerScale(nn.Linear(6, 5), 6)
    return [
        ("integer t", lambda: sfx.apply_rotary_pos_emb(x.long(), freqs), TypeError, "t"),
        ("integer freqs", lambda: sfx.apply_rotary_pos_emb(x, freqs.long()), TypeError, "freqs"),
        ("freqs wider than t", lambda: sfx.apply_rotary_pos_emb(torch.randn(2, 3, 4), freqs), ValueError, "freqs"),
        ("freqs too short", lambda: sfx.apply_rotary_pos_emb(torch.randn(2, 5, 8), freqs), ValueError, "freqs"),
        ("freqs 2-D", lambda: sfx.apply_rotary_pos_emb(torch.randn(2, 3, 8), freqs[0]), ValueError, "freqs"),
        ("freqs of another batch", lambda: sfx.apply_rotary_pos_emb(torch.randn(2, 3, 8), freqs.expand(3, 3, 8)),
         ValueError, "freqs"),
        ("freqs on another device", lambda: sfx.apply_rotary_pos_emb(torch.randn(2, 3, 8), freqs.to("meta")),
         ValueError, "freqs"),
        ("infinite scale", lambda: sfx.apply_rotary_pos_emb(torch.randn(2, 3, 8), freqs, float("inf")), ValueError, "scale"),
        ("LayerNorm of wrong width", lambda: sfx.LayerNorm(5)(x), ValueError, "x"),
        ("integer x to ScaleNorm", lambda: sfx.ScaleNorm(6)(x.long()), TypeError, "x"),
        ("SimpleRMSNorm of wrong width", lambda: sfx.SimpleRMSNorm(4)(x), ValueError, "x"),
        ("DynamicTanh of a list", lambda: sfx.DynamicTanh(6)([1.0]), TypeError, "x"),
        ("odd sinusoidal dim", lambda: sfx.ScaledSinusoidalEmbedding(7), ValueError, "dim"),
        ("sinusoidal bool pos", lambda: sin(x, pos=torch.ones(3, dtype=torch.bool)), ValueError, "pos"),
        ("sinusoidal inf pos", lambda: sin(x, pos=torch.tensor([0.0, float("inf"), 1.0])), ValueError, "pos"),
        ("sinusoidal float seq_start_pos", lambda: sin(x, seq_start_pos=torch.zeros(2)), ValueError, "seq_start_pos"),
        ("negative alibi slope", lambda: sfx.AlibiPositionalBias(2, slopes=[0.5, -1.0]), ValueError, "slopes"),
        ("NaN alibi slope", lambda: sfx.AlibiPositionalBias(2, slopes=[0.5, float("nan")]), ValueError, "slopes"),
        ("total_heads below heads", lambda: sfx.AlibiPositionalBias(3, total_heads=2), ValueError, "total_heads"),
        ("negative i", lambda: alibi(-1, 3), ValueError, "i"),
        ("float pos_i", lambda: alibi.forward_custom_pos(torch.tensor([0.0, float("nan")])), ValueError, "pos_i"),
        ("per-head positions of other heads", lambda: alibi.forward_custom_pos(torch.zeros(1, 3, 4, dtype=torch.long)),
         ValueError, "heads"),
        ("dynamic bias i > j", lambda: dpb(4, 3), ValueError, "i"),
        ("dynamic bias depth 0", lambda: sfx.DynamicPositionBias(8, heads=2, depth=0), ValueError, "depth"),
        ("token id out of range", lambda: tok(torch.tensor([[0, 11]])), ValueError, "x"),
        ("negative token id", lambda: tok(torch.tensor([[-1, 2]])), ValueError, "x"),
        ("fractional token id", lambda: tok(torch.tensor([[1.5]])), TypeError, "x"),
        ("bool token ids", lambda: tok(torch.tensor([[True]])), TypeError, "x"),
        ("residual of another shape", lambda: res(x, x[:, :2]), ValueError, "residual"),
        ("integer residual", lambda: res(x, x.long()), TypeError, "residual"),
        ("GRUGating of 2-D x", lambda: gru(x[0], x[0]), ValueError, "x"),
        ("GRUGating of another dtype", lambda: gru(x.double(), x.double()), TypeError, "x"),
        ("GRUGating residual of another dtype", lambda: gru(x, x.double()), TypeError, "residual"),
        ("GLU of wrong width", lambda: glu(torch.randn(2, 3, 5)), ValueError, "x"),
        ("GLU softclamp with ReLU", lambda: sfx.GLU(6, 4, nn.ReLU(), softclamp=True), ValueError, "activation"),
        ("LayerScale fn of another width", lambda: ls(x), ValueError, "fn"),
        ("ReluSquared of ints", lambda: sfx.ReluSquared()(x.long()), TypeError, "x"),
        ("Scale of inf", lambda: sfx.Scale(float("inf")), ValueError, "scale"),
        ("Scale over a non-tensor", lambda: sfx.Scale(0.5, lambda t: "no")(x), TypeError, "fn"),
    ]


def test_bad_inputs_are_clear_errors():
    import helpers as hp

    hp.assert_clear_errors(_bad_calls(), "xt_modules: ")


# ----------------------------------------------------------------------------------------------------
# door probes (tests/doors.py): position-wise parts with garbage planted at padded positions
# ----------------------------------------------------------------------------------------------------

_PART_BAD = {
    "LayerNorm": ("LayerNorm of wrong width", "x"), "ScaleNorm": ("integer x to ScaleNorm", "x"),
    "SimpleRMSNorm": ("SimpleRMSNorm of wrong width", "x"), "DynamicTanh": ("DynamicTanh of a list", "x"),
    "Residual": ("residual of another shape", "residual"), "GRUGating": ("GRUGating of another dtype", "x"),
    "LayerScale": ("LayerScale fn of another width", "fn"), "GLU": ("GLU of wrong width", "x"),
    "ReluSquared": ("ReluSquared of ints", "x"), "Scale": ("Scale over a non-tensor", "fn"),
    "apply_rotary_pos_emb": ("freqs wider than t", "freqs"), "TokenEmbedding": ("token id out of range", "x"),
    "ScaledSinusoidalEmbedding": ("sinusoidal inf pos", "pos"), "AlibiPositionalBias": ("float pos_i", "pos_i"),
    "DynamicPositionBias": ("dynamic bias i > j", "i"),
}


def _bad(name):
    what, _ = _PART_BAD[name]
    return [c for c in _bad_calls() if c[0] == what]


def _rowwise_part(name, g):
    torch.manual_seed(0)
    c = 6
    resid = torch.randn(3, 4, c, generator=g)
    fns = {
        "LayerNorm": lambda: sfx.LayerNorm(c, unit_offset=True),
        "ScaleNorm": lambda: sfx.ScaleNorm(c),
        "SimpleRMSNorm": lambda: sfx.SimpleRMSNorm(c),
        "DynamicTanh": lambda: sfx.DynamicTanh(c, init_alpha=0.7, unit_offset=True),
        "Residual": lambda: (lambda m: lambda x: m(x, resid))(sfx.Residual(c, scale_residual=True)),
        "GRUGating": lambda: (lambda m: lambda x: m(x, resid))(sfx.GRUGating(c, scale_residual=True)),
        "LayerScale": lambda: sfx.LayerScale(nn.Linear(c, c), c, init_value=0.5),
        "GLU": lambda: (lambda m: lambda x: m(x)[..., :2].repeat(1, 1, 3))(
            sfx.GLU(c, 2, nn.SiLU(), mult_bias=True, softclamp=True)),
        "ReluSquared": lambda: sfx.ReluSquared(),
        "Scale": lambda: sfx.Scale(0.5, nn.Linear(c, c)),
    }
    return fns[name](), c


def probe_part(name: str, seed: int, value: float) -> Probe:
    """One door per part: position-wise parts take ``x (b, n, c)`` with ``value`` planted at padded positions
    (which must stay there); the positional parts run at far positions."""
    g = _gen(seed)
    if name in ("apply_rotary_pos_emb",):
        b, h, n, d = 2, 2, 5, 12
        mask = _lengths_mask(g, b, n, left=True)
        pos = sf.positions_from_mask(mask, n, "cpu") + 10**5
        x = _leaf(torch.randn(b, h, n, d, generator=g), ~mask[:, None, :, None], value)
        freqs, scale = sfx.RotaryEmbedding(8)(pos)
        out = sfx.apply_rotary_pos_emb(x, freqs, scale)
        where = ~mask[:, None, :, None].expand_as(x)
        return Probe(out, {"x": x}, {"x": where}, compare=~where, masked_grad_zero=False, bad_calls=_bad(name))
    if name == "TokenEmbedding":
        torch.manual_seed(0)
        emb = sfx.TokenEmbedding(6, 9, l2norm_embed=bool(seed % 2))
        ids = torch.randint(0, 9, (3, 4), generator=g)
        return Probe(emb(ids), {"weight": emb.emb.weight}, bad_calls=_bad(name))
    if name == "ScaledSinusoidalEmbedding":
        emb = sfx.ScaledSinusoidalEmbedding(8)
        out = emb(torch.zeros(2, 3, 8), pos=torch.tensor([0, 10**6, 2**40]), seq_start_pos=torch.tensor([0, 7]))
        return Probe(out, {"scale": emb.scale}, bad_calls=_bad(name))
    if name == "AlibiPositionalBias":
        alibi = sfx.AlibiPositionalBias(3, total_heads=4)
        mask = _lengths_mask(g, 2, 5, left=True)
        pos = sf.positions_from_mask(mask, 5, "cpu") + 10**6
        return Probe(alibi.forward_custom_pos(pos), bad_calls=_bad(name))
    if name == "DynamicPositionBias":
        torch.manual_seed(0)
        dpb = sfx.DynamicPositionBias(8, heads=2, depth=2, log_distance=bool(seed % 2), norm=True)
        return Probe(dpb(5, 40), {"weight": dpb.mlp[0][0].weight}, bad_calls=_bad(name))
    fn, c = _rowwise_part(name, g)
    b, n = 3, 4
    mask = _lengths_mask(g, b, n)
    x = _leaf(torch.randn(b, n, c, generator=g), ~mask[..., None], value)
    x_in = x
    out = fn(x_in)
    return Probe(out, {"x": x}, {"x": ~mask[..., None].expand_as(x)}, compare=mask[..., None].expand_as(out),
                 masked_grad_zero=False, bad_calls=_bad(name))


@pytest.mark.parametrize("name", xm.__all__)
def test_every_part_has_a_probe_and_a_clear_error(name):
    p = probe_part(name, 0, 0.0)
    assert p.out is not None and torch.isfinite(p.out).all() and p.bad_calls
