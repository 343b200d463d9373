"""Named tests for the doors a fourth outside review found open (one test, or a few, per finding).

Each failed on the code before its fix: the value residual and residual attention leaking what masked
slots hold, raw errors from bad value residuals, ``kv_input_residual``, ``GPTVAE.generate`` latents and
``NeoMLP`` inputs, a missing T5 bias gradient on the unpadded path, and the packed RNN of a hybrid
module under ``torch.func``.

Shape legend: b batch, h heads, h_kv key/value heads, i queries, j keys, d head dim, n positions, c width.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad

import safeformer as sf

NAN, INF = float("nan"), float("inf")


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _grads(module, leaves, out):
    """``out``'s gradients by every parameter of ``module`` and by ``leaves``, cleared first."""
    module.zero_grad(set_to_none=True)
    for t in leaves:
        t.grad = None
    out.backward(_randn(*out.shape, seed=7))
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()] + [t.grad.clone() for t in leaves]


def _same(a, b):
    assert len(a) == len(b)
    for s, t in zip(a, b):
        assert (s is None) == (t is None)
        if s is not None:
            assert torch.isfinite(s).all() and torch.isfinite(t).all()
            torch.testing.assert_close(s, t, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# 1. Attention(value_residual=): what the residual holds at masked keys reaches nothing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("learned_mix", [False, True])
@pytest.mark.parametrize("value", [NAN, INF, -INF, 1e4])
def test_value_residual_at_masked_keys_reaches_nothing(learned_mix, value):
    """``value_residual (b, h_kv, j, d)`` with garbage at a masked key (and at every key of an all-padding
    sample): the real rows' outputs and every gradient are finite and equal to those with zeros planted there,
    and the residual's gradient at masked slots is exactly 0."""
    torch.manual_seed(0)
    attn = sf.Attention(dim=16, heads=2, dim_head=8, learned_value_residual_mix=learned_mix)
    mask = torch.tensor([[True, True, False, True], [False, False, False, False], [True, True, True, True]])
    x = _randn(3, 4, 16, seed=1).requires_grad_()
    results = []
    for plant in (0.0, value):
        vr = _randn(3, 2, 4, 8, seed=2)
        vr[:, :, :][~mask[:, None, :].expand(3, 2, 4)] = plant
        vr.requires_grad_()
        out = attn(x, mask=mask, value_residual=vr)
        assert torch.isfinite(out).all()
        assert out[~mask].eq(0).all()
        results.append((out.detach(), _grads(attn, (x, vr), out), vr))
    (out0, g0, _), (out1, g1, vr1) = results
    torch.testing.assert_close(out0, out1)
    _same(g0, g1)
    assert vr1.grad[~mask[:, None, :].expand(3, 2, 4)].eq(0).all()


# ----------------------------------------------------------------------------------------------------
# 2. Attention(prev_attn=): what residual attention's logits hold at masked entries reaches nothing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, INF, -INF, 1e4])
@pytest.mark.parametrize("causal", [False, True])
def test_prev_attn_at_padded_queries_reaches_no_gradient(value, causal):
    """``prev_attn (b, h, i, j)`` with garbage on the rows of padded queries and the columns of masked keys
    (an all-padding sample included): outputs and the gradients of ``x``, the parameters and ``prev_attn`` are
    finite and equal to those with zeros planted there; ``prev_attn``'s gradient there is exactly 0."""
    torch.manual_seed(0)
    attn = sf.Attention(dim=16, heads=2, dim_head=8, causal=causal)
    mask = torch.tensor([[True, True, False, True], [False, False, False, False], [False, True, True, True]])
    masked = ~(mask[:, None, :, None] & mask[:, None, None, :]).expand(3, 2, 4, 4)  # padded rows or keys
    x = _randn(3, 4, 16, seed=1).requires_grad_()
    results = []
    for plant in (0.0, value):
        prev = _randn(3, 2, 4, 4, seed=2)
        prev[masked] = plant
        prev.requires_grad_()
        out = attn(x, mask=mask, prev_attn=prev)
        assert torch.isfinite(out).all()
        results.append((out.detach(), _grads(attn, (x, prev), out), prev))
    (out0, g0, _), (out1, g1, prev1) = results
    torch.testing.assert_close(out0, out1)
    _same(g0, g1)
    assert prev1.grad[masked].eq(0).all()


def test_prev_attn_dead_rows_of_an_empty_context_reach_no_gradient():
    """Cross-attention with an all-False ``context_mask`` for one sample: ``prev_attn`` NaN on that sample and at
    a masked key gives finite gradients, exactly 0 at those entries."""
    torch.manual_seed(0)
    attn = sf.Attention(dim=16, heads=2, dim_head=8)
    x, ctx = _randn(2, 3, 16, seed=1).requires_grad_(), _randn(2, 4, 16, seed=2)
    cm = torch.tensor([[False] * 4, [True, True, False, True]])
    prev = _randn(2, 2, 3, 4, seed=3)
    prev[0] = NAN
    prev[1, :, :, 2] = NAN
    prev.requires_grad_()
    out = attn(x, context=ctx, context_mask=cm, prev_attn=prev)
    out.sum().backward()
    assert out[0].eq(0).all() and torch.isfinite(out).all()
    assert torch.isfinite(x.grad).all() and prev.grad[0].eq(0).all() and prev.grad[1, :, :, 2].eq(0).all()


def test_value_residual_at_masked_context_keys_reaches_nothing():
    """Cross-attention (grouped-query) with an all-False and a partial ``context_mask``: NaN in the value residual at
    masked context keys reaches no output and no gradient, exactly 0 there."""
    torch.manual_seed(0)
    attn = sf.Attention(dim=16, heads=2, dim_head=8, kv_heads=1)
    x, ctx = _randn(2, 3, 16, seed=1).requires_grad_(), _randn(2, 5, 16, seed=2)
    cm = torch.tensor([[True, False, True, True, False], [False] * 5])
    vr = _randn(2, 1, 5, 8, seed=3)
    vr[~cm[:, None, :]] = NAN
    vr.requires_grad_()
    out = attn(x, context=ctx, context_mask=cm, value_residual=vr)
    out.sum().backward()
    assert torch.isfinite(out).all() and out[1].eq(0).all() and torch.isfinite(x.grad).all()
    assert vr.grad[~cm[:, None, :]].eq(0).all()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters() if p.grad is not None)


@pytest.mark.parametrize(("prev", "error"), [(torch.zeros(2, 2, 4, 4, dtype=torch.long), TypeError),
                                             (torch.zeros(2, 2, 4, 4, dtype=torch.bool), TypeError),
                                             (torch.zeros(5, 2, 4, 4), ValueError), (torch.zeros(2, 4, 4), ValueError)],
                         ids=["long", "bool", "batch", "3d"])
def test_prev_attn_of_another_dtype_or_shape_is_refused_by_name(prev, error):
    attn = sf.Attention(dim=16, heads=2, dim_head=8)
    with pytest.raises(error, match="prev_attn"):
        attn(_randn(2, 4, 16), mask=torch.ones(2, 4, dtype=torch.bool), prev_attn=prev)


# ----------------------------------------------------------------------------------------------------
# 3. value_residual / kv_input_residual: bad dtypes and shapes get errors naming the argument
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.long, torch.bool])
def test_value_residual_of_another_dtype_is_refused_by_name(dtype):
    attn = sf.Attention(dim=16, heads=2, dim_head=8)
    x = _randn(2, 4, 16)
    with pytest.raises(TypeError, match="value_residual"):
        attn(x, value_residual=torch.zeros(2, 2, 4, 8, dtype=dtype))


def test_value_residual_of_another_shape_is_refused_by_name():
    attn = sf.Attention(dim=16, heads=2, dim_head=8)
    with pytest.raises(ValueError, match="value_residual"):
        attn(_randn(2, 4, 16), value_residual=torch.zeros(2, 2, 3, 8))
    with pytest.raises(TypeError, match="value_residual"):
        attn(_randn(2, 4, 16), value_residual=[[0.0]])


@pytest.mark.parametrize("shape", [(2, 4, 15), (2, 3, 16), (3, 4, 16), (4, 16), (16,), (1, 2, 4, 16)])
def test_kv_input_residual_of_another_shape_is_refused_by_name(shape):
    """``kv_input_residual`` must be ``(b|1, j|1, c_src)``: a wrong width, length, batch or rank is a
    ``ValueError`` naming it (a 2-d one is not broadcast into a guess)."""
    attn = sf.Attention(dim=16, heads=2, dim_head=8)
    with pytest.raises(ValueError, match="kv_input_residual"):
        attn(_randn(2, 4, 16), kv_input_residual=torch.zeros(shape))


def test_kv_input_residual_of_a_context_has_the_context_width():
    attn = sf.Attention(dim=16, heads=2, dim_head=8, dim_context=12)
    x, ctx = _randn(2, 3, 16), _randn(2, 5, 12)
    out = attn(x, context=ctx, kv_input_residual=_randn(1, 1, 12))  # broadcast over batch and keys
    assert out.shape == (2, 3, 16)
    with pytest.raises(ValueError, match="kv_input_residual"):
        attn(x, context=ctx, kv_input_residual=_randn(2, 5, 16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.long, torch.bool])
def test_kv_input_residual_of_another_dtype_is_refused_by_name(dtype):
    attn = sf.Attention(dim=16, heads=2, dim_head=8)
    with pytest.raises(TypeError, match="kv_input_residual"):
        attn(_randn(2, 4, 16), kv_input_residual=torch.zeros(2, 4, 16, dtype=dtype))


def test_residuals_of_another_dtype_mix_under_autocast():
    """Autocast mixes dtypes on purpose: a float32 value residual and kv input residual beside bfloat16 values."""
    attn = sf.Attention(dim=16, heads=2, dim_head=8)
    x = _randn(2, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x, value_residual=_randn(2, 2, 4, 8), kv_input_residual=_randn(2, 4, 16))
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------------------
# 4. Decoder(rel_pos_bias=True) on the unpadded path: an all-padding batch gives zero, not missing, gradients
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unpadded", [True, "auto"])
def test_rel_pos_bias_all_padding_unpadded_gives_zero_gradient(unpadded):
    torch.manual_seed(0)
    dec = sf.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, rel_pos_bias=True, unpadded=unpadded)
    x = _randn(2, 4, 16).requires_grad_()
    out = dec(x, mask=torch.zeros(2, 4, dtype=torch.bool))
    out.sum().backward()
    missing = [name for name, p in dec.named_parameters() if p.grad is None]
    assert not missing, missing
    assert dec.rel_pos.relative_attention_bias.weight.grad.eq(0).all()


# ----------------------------------------------------------------------------------------------------
# 5. attn_hybrid_module=<an RNN> with a padding mask under torch.func
# ----------------------------------------------------------------------------------------------------


def _func_grad_equals_autograd(model, x, mask):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        return functional_call(model, p, (x,), {"mask": mask}).square().sum()

    g_func, gx_func = grad(loss, argnums=(0, 1))(params, x)
    x_leaf = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    model(x_leaf, mask=mask).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(g_func[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(gx_func, x_leaf.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rnn", ["gru", "lstm2", "rnn_relu"])
def test_hybrid_rnn_under_torch_func_grad_equals_autograd(rnn):
    """A decoder whose attention runs a ``torch.nn`` RNN beside it, with a padding mask (left and right padding,
    an all-padding sample): ``torch.func.grad`` equals ordinary autograd."""
    torch.manual_seed(0)
    module = {"gru": torch.nn.GRU(16, 16, batch_first=True),
              "lstm2": torch.nn.LSTM(16, 16, num_layers=2, batch_first=True),
              "rnn_relu": torch.nn.RNN(16, 16, nonlinearity="relu", bias=False, batch_first=True)}[rnn]
    dec = sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_module=module)
    mask = torch.tensor([[True] * 3 + [False] * 2, [False] + [True] * 4, [False] * 5])
    _func_grad_equals_autograd(dec, _randn(3, 5, 16), mask)


@pytest.mark.parametrize("fold", [1, 2])
def test_hybrid_bidirectional_rnn_under_torch_func_grad_equals_autograd(fold):
    """An encoder with a two-layer bidirectional GRU beside its attention (folded axially too): each direction
    starts at its sample's own end under ``torch.func`` as with packing."""
    torch.manual_seed(0)
    enc = sf.Encoder(dim=16, depth=1, heads=2, attn_dim_head=8, attn_hybrid_fold_axial_dim=fold,
                     attn_hybrid_module=torch.nn.GRU(16, 8, num_layers=2, bidirectional=True, batch_first=True))
    mask = torch.tensor([[True] * 3 + [False] * 2, [False, True, False, True, True], [True] * 5])
    _func_grad_equals_autograd(enc, _randn(3, 5, 16), mask)


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_hybrid_rnn_steps_equal_the_packed_sequence(kind, bidirectional):
    """What runs under a transform (the module's cells step by step, padded steps moving no state) equals the
    packed sequence's outputs at real positions and its final states, with an initial state and an empty row."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from safeformer.nn.hybrid import _run_rnn_stepwise

    torch.manual_seed(0)
    rnn = getattr(torch.nn, kind)(6, 5, num_layers=2, bidirectional=bidirectional, batch_first=True)
    x, lens = _randn(4, 7, 6), torch.tensor([7, 3, 0, 5])
    real = torch.arange(7)[None] < lens[:, None]
    h0 = _randn(2 * (2 if bidirectional else 1), 4, 5, seed=1)
    hx = (h0, _randn(*h0.shape, seed=2)) if kind == "LSTM" else h0
    packed = pack_padded_sequence(x, lens.clamp(min=1), batch_first=True, enforce_sorted=False)
    want, h_want = rnn(packed, hx)
    want = pad_packed_sequence(want, batch_first=True, total_length=7)[0]
    got, h_got = _run_rnn_stepwise(rnn, x, real, hx)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    assert got[~real].eq(0).all()
    pairs = zip(*(t if isinstance(t, tuple) else (t,) for t in (h_want, h_got, hx)))
    for w, g, init in pairs:  # an empty row keeps its initial state
        torch.testing.assert_close(g, torch.where((lens == 0)[None, :, None], init, w), rtol=1e-5, atol=1e-6)


def test_hybrid_rnn_under_vmap_equals_the_batch():
    """``torch.vmap`` over samples of a hybrid decoder with a padding mask gives the batched forward."""
    torch.manual_seed(0)
    dec = sf.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8,
                     attn_hybrid_module=torch.nn.GRU(16, 16, batch_first=True)).eval()
    x, mask = _randn(3, 5, 16), torch.tensor([[True] * 3 + [False] * 2, [False] + [True] * 4, [True] * 5])
    want = dec(x, mask=mask)
    got = torch.vmap(lambda xi, mi: dec(xi[None], mask=mi[None])[0])(x, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# 6. GPTVAE.generate's latents and mask_for_latents; NeoMLP's input dtype
# ----------------------------------------------------------------------------------------------------


def _vae():
    torch.manual_seed(0)
    return sf.GPTVAE(num_tokens=10, dim=16, depth=1, enc_depth=1, max_seq_len=8, heads=2, attn_dim_head=8).eval()


@pytest.mark.parametrize("mask", [torch.ones(2, 3, dtype=torch.bool), "abc"], ids=["bool", "str"])
def test_gpt_vae_generate_refuses_mask_for_latents_without_seq(mask):
    with pytest.raises(ValueError, match="mask_for_latents"):
        _vae().generate(torch.randint(0, 10, (2, 3)), 3, mask_for_latents=mask)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_gpt_vae_generate_refuses_latents_of_another_dtype(dtype):
    with pytest.raises(TypeError, match="latents"):
        _vae().generate(torch.randint(0, 10, (2, 3)), 3, latents=torch.zeros(2, 16, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_neo_mlp_refuses_input_of_another_float_dtype(dtype):
    torch.manual_seed(0)
    mlp = sf.NeoMLP(dim_in=3, dim_hidden=2, dim_out=2, dim_model=16, depth=1)
    with pytest.raises(TypeError, match="x has dtype"):
        mlp(torch.zeros(2, 3, dtype=dtype))
    if dtype != torch.float64:  # autocast mixes on purpose (it leaves float64 as it is)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.isfinite(mlp(torch.zeros(2, 3, dtype=dtype))).all()
