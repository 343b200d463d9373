"""``torch.func`` transforms and second derivatives through ``attend``, ``varlen_attention`` and whole models.

- ``torch.func.grad`` / ``vjp`` / ``vmap`` / ``jacrev`` / ``hessian`` through ``attend`` (default backend,
  masks with dead rows and masked keys) and through a ``TransformerWrapper`` / ``Decoder`` called with a
  padding mask (``torch.func.functional_call``): the results equal a plain float64 reference within
  dtype-tied tolerances and equal eager autograd.
- Double backward (``create_graph=True``: R1, WGAN-GP gradient penalties) through the default backend (the
  CPU flash kernel, its lean path ``_SelectedFlashAttention`` and the generic path) works:
  ``gradcheck`` / ``gradgradcheck`` in float64, and float32 / bfloat16 second-order gradients equal the
  float64 reference.
- NaN planted in dead queries and masked keys/values reaches no output and no first- or second-order
  gradient, under every transform.

Mask semantics everywhere: bool, True = may attend; a dead row (no key to see) outputs exactly 0.
Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim.
"""

from __future__ import annotations

import copy
import math
import sys

import helpers as hp
import pytest
import torch
from helpers import ATTEND_TOL, NAN, assert_close, assert_finite, assert_zero

import safeformer as sf
from safeformer import attend
from safeformer.core.attend import SelectedMask, prepare_mask
from safeformer.core.varlen import VarlenPlan, substitute_varlen_kernel, varlen_attention, varlen_layout

A = sys.modules["safeformer.core.attend"]  # (the package's ``attend`` attribute is the function)
KINDS = ("padding", "full", "causal_padding")
DTYPES = (torch.float32, torch.bfloat16)
KERNEL_PLAN = VarlenPlan("varlen", "forced by the test: the substituted kernel runs")


# ----------------------------------------------------------------------------------------------------
# the float64 reference and the cases
# ----------------------------------------------------------------------------------------------------


def ref64(q, k, v, allowed, scale=None, bias=None):
    """Plain softmax attention in float64. ``allowed``: bool ``(b, 1, i, j)``, True = may attend.

    What ``attend`` promises, in the plainest code: q at dead rows and k, v at masked keys are selected to
    0 first (a NaN there reaches nothing), masked logits are -inf, and a dead row outputs exactly 0.
    """
    q, k, v = (t.double() for t in (q, k, v))
    row_ok = allowed.any(-1, keepdim=True)  # (b, 1, i, 1)
    key_ok = allowed.any(-2).unsqueeze(-1)  # (b, 1, j, 1)
    q = torch.where(row_ok, q, 0.0)
    k, v = torch.where(key_ok, k, 0.0), torch.where(key_ok, v, 0.0)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    logits = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (b, h, i, j)
    if bias is not None:
        logits = logits + bias.double()
    logits = torch.where(row_ok, logits.masked_fill(~allowed, -math.inf), 0.0)  # a dead row: thrown away below
    weights = torch.where(allowed, logits.softmax(-1), 0.0)
    return weights @ v  # (b, h, i, e)


def make_case(kind: str, dtype=torch.float32, *, h=2, hkv=2, b=3, i=5, j=6, d=8, seed=0, plant=NAN):
    """Inputs with dead rows and masked keys (``plant`` written there), ``attend``'s kwargs, the bool
    ``allowed (b, 1, i, j)``, the dead rows ``(b, i)``, the masked keys ``(b, j)`` and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, j, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, j, d, generator=gen).to(dtype)
    up = torch.randn(b, h, i, d, generator=gen)
    causal = torch.ones(i, j, dtype=torch.bool).tril(j - i)  # bottom-right
    if kind in ("padding", "causal_padding"):
        pad = torch.ones(b, j, dtype=torch.bool)
        pad[0, j - 2:] = False  # two masked keys
        pad[1] = False  # a fully padded sample: every row dead
        if kind == "padding":
            kwargs, allowed = dict(mask=pad), pad[:, None, None, :].expand(b, 1, i, j)
        else:
            pad[2, : j - i + 1] = False  # the first query of sample 2 sees no key: one dead row
            kwargs, allowed = dict(mask=pad, causal=True), (pad[:, None, :] & causal)[:, None]
    elif kind == "full":
        full = torch.rand(b, i, j, generator=gen) < 0.6
        full[:, :, 0] = True
        full[0, 2] = False  # a dead row
        full[2, 1:3] = False  # two more
        full[:, :, j - 1] = False  # a masked key in every sample
        kwargs, allowed = dict(mask=full), full[:, None]
    else:
        raise ValueError(kind)
    dead = ~allowed.any(-1)[:, 0]  # (b, i)
    masked = ~allowed.any(-2)[:, 0]  # (b, j)
    if plant is not None:
        q = torch.where(dead[:, None, :, None], plant, q)
        k = torch.where(masked[:, None, :, None], plant, k)
        v = torch.where(masked[:, None, :, None], plant, v)
    return q, k, v, kwargs, allowed.contiguous(), dead, masked, up


def ref_grads(q, k, v, allowed, up, **kw):
    """The float64 reference output and its gradients at q, k, v against ``up``."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = ref64(*leaves, allowed, **kw)
    return out, torch.autograd.grad(out, leaves, up.double())


def assert_selected_away(gq, gk, gv, dead, masked, what):
    """Gradients exactly 0 at dead rows of q and masked keys of k, v (and finite everywhere)."""
    for name, g in (("q", gq), ("k", gk), ("v", gv)):
        assert_finite(g, f"{what}: grad {name}")
    assert_zero(gq.transpose(1, 2)[dead], f"{what}: grad q at dead rows")
    assert_zero(gk.transpose(1, 2)[masked], f"{what}: grad k at masked keys")
    assert_zero(gv.transpose(1, 2)[masked], f"{what}: grad v at masked keys")


def graph_names(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return names


# ----------------------------------------------------------------------------------------------------
# torch.func through attend
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_func_grad_and_vjp_equal_reference_and_eager(kind, dtype):
    q, k, v, kw, allowed, dead, masked, up = make_case(kind, dtype, h=4, hkv=2)
    ref, ref_g = ref_grads(q, k, v, allowed, up)

    out, vjp_fn = torch.func.vjp(lambda q, k, v: attend(q, k, v, **kw), q, k, v)
    assert_close(out, ref, "vjp output", dtype, table=ATTEND_TOL)
    assert_zero(out.transpose(1, 2)[dead], "vjp output at dead rows")
    got_vjp = vjp_fn(up.to(dtype))

    loss = lambda q, k, v: (attend(q, k, v, **kw).float() * up).sum()  # noqa: E731
    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = torch.autograd.grad(attend(*leaves, **kw), leaves, up.to(dtype))
    for name, a, b_, e, r in zip("qkv", got, got_vjp, eager, ref_g):
        assert_close(a, r, f"func.grad {name}", dtype, table=ATTEND_TOL)
        assert_close(b_, r, f"func.vjp {name}", dtype, table=ATTEND_TOL)
        assert_close(a, e.double(), f"func.grad {name} vs eager", dtype, table=ATTEND_TOL)
    assert_selected_away(*got, dead, masked, "func.grad")
    assert_selected_away(*got_vjp, dead, masked, "func.vjp")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_func_vmap_and_per_sample_grads(kind, dtype):
    """vmap over the batch (q, k, v and the mask batched): each sample's output equals the reference;
    per-sample gradients (vmap of grad) equal the eager gradients (the samples are independent)."""
    q, k, v, kw, allowed, dead, masked, up = make_case(kind, dtype)
    mask = kw["mask"]
    causal = kw.get("causal", False)
    one = lambda q, k, v, m: attend(q[None], k[None], v[None], mask=m[None], causal=causal)[0]  # noqa: E731
    out = torch.func.vmap(one)(q, k, v, mask)
    ref, ref_g = ref_grads(q, k, v, allowed, up)
    assert_close(out, ref, "vmap output", dtype, table=ATTEND_TOL)
    assert_zero(out.transpose(1, 2)[dead], "vmap output at dead rows")

    loss = lambda q, k, v, m, u: (one(q, k, v, m).float() * u).sum()  # noqa: E731
    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, mask, up)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = torch.autograd.grad(attend(*leaves, **kw), leaves, up.to(dtype))
    for name, a, e, r in zip("qkv", per_sample, eager, ref_g):
        assert_close(a, r, f"vmap(grad) {name}", dtype, table=ATTEND_TOL)
        assert_close(a, e.double(), f"vmap(grad) {name} vs eager", dtype, table=ATTEND_TOL)
    assert_selected_away(*per_sample, dead, masked, "vmap(grad)")


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_func_jacrev_and_hessian_equal_reference(kind, dtype):
    q, k, v, kw, allowed, dead, masked, up = make_case(kind, dtype, i=3, j=4, d=4)
    jac = torch.func.jacrev(lambda q, k, v: attend(q, k, v, **kw), argnums=(0, 1, 2))(q, k, v)
    want = torch.func.jacrev(lambda q, k, v: ref64(q, k, v, allowed), argnums=(0, 1, 2))(
        *(t.double() for t in (q, k, v)))
    for name, a, e in zip("qkv", jac, want):
        assert_close(a, e, f"jacrev wrt {name}", dtype, table=ATTEND_TOL)
    # the columns of the Jacobian at dead queries (b, i) and masked keys (b, j): exactly 0
    assert_zero(jac[0].permute(4, 6, 5, 7, 0, 1, 2, 3)[dead], "jacobian columns of dead queries")
    assert_zero(jac[1].permute(4, 6, 5, 7, 0, 1, 2, 3)[masked], "jacobian columns of masked keys")
    assert_zero(jac[2].permute(4, 6, 5, 7, 0, 1, 2, 3)[masked], "jacobian columns of masked values")

    w = up[:, :, :, :4].to(dtype)
    scalar = lambda q: (attend(q, k, v, **kw) * w).sum().pow(2)  # noqa: E731
    hess = torch.func.hessian(scalar)(q)
    want_h = torch.func.hessian(lambda q: (ref64(q, k, v, allowed) * w.double()).sum().pow(2))(q.double())
    assert hess.shape == (*q.shape, *q.shape)
    assert_close(hess, want_h, "hessian wrt q", dtype, table=ATTEND_TOL)


@pytest.mark.parametrize("form", ("bias", "prepared", "selected", "causal", "none"))
def test_func_transforms_on_every_attend_form(form):
    """A bias (with a gradient), a PreparedMask, a SelectedMask, causal without a mask, and no mask at all:
    grad and vmap (over a stack of inputs) equal the float64 reference."""
    q, k, v, kw, allowed, dead, masked, up = make_case("padding", plant=None, h=4, hkv=2, i=5, j=6)
    bias = torch.randn(1, 4, 5, 6)
    ones = torch.ones(3, 1, 5, 6, dtype=torch.bool)
    fn, allow = {
        "bias": (lambda q, k, v, bias: attend(q, k, v, mask=kw["mask"], bias=bias), allowed),
        "prepared": (lambda q, k, v, bias: attend(q, k, v, mask=prepare_mask(allowed)), allowed),
        "selected": (lambda q, k, v, bias: attend(q, k, v, mask=SelectedMask(kw["mask"])), allowed),
        "causal": (lambda q, k, v, bias: attend(q, k, v, causal=True), ones & torch.ones(5, 6, dtype=torch.bool).tril(1)),
        "none": (lambda q, k, v, bias: attend(q, k, v), ones),
    }[form]
    got = torch.func.grad(lambda q, k, v, bias: (fn(q, k, v, bias) * up).sum(), argnums=(0, 1, 2, 3))(q, k, v, bias)
    leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
    ref = ref64(*leaves[:3], allow, bias=leaves[3] if form == "bias" else None)
    want = torch.autograd.grad(ref, leaves, up.double(), allow_unused=True)
    for n, a, e in zip(("q", "k", "v", "bias"), got, want):
        e = torch.zeros_like(a, dtype=torch.float64) if e is None else e
        assert_close(a, e, f"{form}: grad {n}", torch.float32, table=ATTEND_TOL)
    stack = lambda t, u: torch.stack([t, u])  # noqa: E731
    out = torch.func.vmap(lambda q, k, v, bias: fn(q, k, v, bias))(stack(q, 2 * q), stack(k, k), stack(v, -v),
                                                                    stack(bias, -bias))
    want_out = ref64(2 * q, k, -v, allow, bias=-bias if form == "bias" else None)
    assert_close(out[1], want_out, f"{form}: vmap output", torch.float32, table=ATTEND_TOL)


# ----------------------------------------------------------------------------------------------------
# torch.func through a whole model
# ----------------------------------------------------------------------------------------------------


def _wrapper(seed=0):
    torch.manual_seed(seed)
    return sf.TransformerWrapper(num_tokens=11, max_seq_len=8,
                                 attn_layers=sf.Decoder(dim=16, depth=1, heads=2, dim_head=8))


def _tokens():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 11, (3, 8), generator=gen)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1] = False  # a fully padded sample
    x[0, 6] = 999  # padded positions may hold anything
    return x, mask


@pytest.mark.parametrize("unpadded", ("auto", False))
def test_func_grad_and_jacrev_through_transformer_wrapper(unpadded):
    model = hp.set_unpadded(_wrapper(), unpadded)
    x, mask = _tokens()
    params = {n: p.detach() for n, p in model.named_parameters()}
    up = torch.randn(3, 8, 11, generator=torch.Generator().manual_seed(2))

    logits = lambda p: torch.func.functional_call(model, p, (x,), dict(mask=mask))  # noqa: E731
    got = torch.func.grad(lambda p: (logits(p) * up).sum())(params)

    model.zero_grad()
    (model(x, mask=mask) * up).sum().backward()
    model64 = hp.set_backend(copy.deepcopy(model).double(), "reference")
    model64.zero_grad()
    (model64(x, mask=mask) * up.double()).sum().backward()
    for n, p in model.named_parameters():
        assert_close(got[n], p.grad.double(), f"func.grad of {n} vs eager", torch.float32)
        assert_close(got[n], dict(model64.named_parameters())[n].grad, f"func.grad of {n} vs float64", torch.float32)

    # jacrev: the Jacobian of the logits, contracted with the upstream gradient, is the gradient
    small = {"attn_layers.layers.0.1.to_q.weight", "token_emb.emb.weight"} & set(params)
    assert small, sorted(params)
    jac = torch.func.jacrev(lambda sub: logits({**params, **sub}))({n: params[n] for n in small})
    for n in small:
        contracted = (jac[n] * up.reshape(*up.shape, *(1,) * params[n].dim())).sum((0, 1, 2))
        assert_close(contracted, got[n], f"jacrev of {n} contracted", torch.float32)
        assert_finite(jac[n], f"jacrev of {n}")


def test_func_vmap_over_an_ensemble_of_transformer_wrappers():
    """vmap over stacked parameters (model ensembling), with a padding mask that has a fully padded sample."""
    models = [_wrapper(0), _wrapper(1)]
    x, mask = _tokens()
    params, buffers = torch.func.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    call = lambda p, b: torch.func.functional_call(base, (p, b), (x,), dict(mask=mask))  # noqa: E731
    out = torch.func.vmap(call)(params, buffers)
    grads = torch.func.vmap(torch.func.grad(lambda p, b: call(p, b).pow(2).mean()))(params, buffers)
    for n_model, model in enumerate(models):
        with torch.no_grad():
            want = model(x, mask=mask)
        assert_close(out[n_model], want.double(), f"ensemble output {n_model}", torch.float32)
        model.zero_grad()
        model(x, mask=mask).pow(2).mean().backward()
        for n, p in model.named_parameters():
            assert_close(grads[n][n_model], p.grad.double(), f"ensemble grad of {n}", torch.float32)


def test_func_vmap_over_the_tokens_of_a_transformer_wrapper():
    model = _wrapper()
    x, mask = _tokens()
    params = {n: p.detach() for n, p in model.named_parameters()}
    one = lambda xx, mm: torch.func.functional_call(model, params, (xx[None],), dict(mask=mm[None]))[0]  # noqa: E731
    out = torch.func.vmap(one)(x, mask)
    with torch.no_grad():
        assert_close(out, model(x, mask=mask).double(), "vmap over tokens", torch.float32)


def test_func_grad_through_a_decoder_with_nan_at_padded_positions():
    """Continuous inputs with NaN at padded positions: parameter and input gradients under torch.func.grad
    equal eager autograd and a float64 model, and the input gradient is exactly 0 at padded positions."""
    torch.manual_seed(0)
    dec = sf.Decoder(dim=16, depth=2, heads=2, dim_head=8)
    x = torch.randn(3, 6, 16)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0] * 6, [1] * 6], dtype=torch.bool)
    x = torch.where(mask[..., None], x, NAN)
    up = torch.randn(3, 6, 16)
    params = {n: p.detach() for n, p in dec.named_parameters()}
    loss = lambda p, x: (torch.func.functional_call(dec, p, (x,), dict(mask=mask)) * up).sum()  # noqa: E731
    gp, gx = torch.func.grad(loss, argnums=(0, 1))(params, x)
    assert_zero(gx[~mask], "input grad at padded positions")
    xl = x.clone().requires_grad_()
    (dec(xl, mask=mask) * up).sum().backward()
    dec64 = hp.set_backend(copy.deepcopy(dec).double(), "reference")
    x64 = x.double().requires_grad_()
    (dec64(x64, mask=mask) * up.double()).sum().backward()
    assert_close(gx, xl.grad.double(), "input grad vs eager", torch.float32)
    assert_close(gx, x64.grad, "input grad vs float64", torch.float32)
    for n, p in dec.named_parameters():
        assert_close(gp[n], p.grad.double(), f"grad of {n} vs eager", torch.float32)
        assert_close(gp[n], dict(dec64.named_parameters())[n].grad, f"grad of {n} vs float64", torch.float32)


# ----------------------------------------------------------------------------------------------------
# double backward through the default backend
# ----------------------------------------------------------------------------------------------------

# name -> (case kind, h, h_kv, i, j, what else, the autograd node that must be in the graph)
PATHS = {
    "lean": ("padding", 2, 2, 4, 5, None, "_SelectedFlashAttentionBackward"),
    "lean-full-gqa": ("full", 4, 2, 4, 5, None, "_SelectedFlashAttentionBackward"),
    "lean-causal": ("causal_padding", 2, 2, 4, 5, None, "_SelectedFlashAttentionBackward"),
    "selected": ("padding", 4, 2, 4, 5, "selected", "_ReferenceSecondOrderBackward"),
    "prepared": ("full", 2, 2, 4, 5, "prepared", "_SelectedFlashAttentionBackward"),
    "bias": ("padding", 2, 2, 4, 5, "bias", "_ReferenceSecondOrderBackward"),
    "causal-no-mask": ("padding", 2, 2, 5, 5, "causal", "_ReferenceSecondOrderBackward"),
}


def path_case(name, dtype, plant=None, seed=0):
    """(fn(q, k, v[, bias]), inputs, allowed, dead, masked, up, bias, node) for one attend path. A
    SelectedMask promises finite inputs at dead rows and masked keys, and causal attention without a
    mask has neither: nothing is planted there."""
    kind, h, hkv, i, j, extra, node = PATHS[name]
    plant = None if extra in ("selected", "causal") else plant
    q, k, v, kw, allowed, dead, masked, up = make_case(kind, dtype, h=h, hkv=hkv, i=i, j=j, d=4, plant=plant, seed=seed)
    bias = None
    if extra == "selected":
        kw = dict(mask=SelectedMask(kw["mask"]))
    elif extra == "prepared":
        kw = dict(mask=prepare_mask(allowed))
    elif extra == "bias":
        bias = torch.randn(1, h, i, j, generator=torch.Generator().manual_seed(3)).to(dtype)
    elif extra == "causal":
        kw = dict(causal=True)
        allowed = torch.ones(q.shape[0], 1, i, j, dtype=torch.bool) & torch.ones(i, j, dtype=torch.bool).tril(j - i)
        dead, masked = ~allowed.any(-1)[:, 0], ~allowed.any(-2)[:, 0]
    if bias is None:
        fn = lambda q, k, v: attend(q, k, v, **kw)  # noqa: E731
        return fn, [q, k, v], allowed, dead, masked, up, None, node
    fn = lambda q, k, v, bias: attend(q, k, v, **kw, bias=bias)  # noqa: E731
    return fn, [q, k, v, bias], allowed, dead, masked, up, bias, node


@pytest.mark.parametrize("name", PATHS)
def test_gradcheck_and_gradgradcheck_in_float64(name):
    fn, inputs, *_, node = path_case(name, torch.float64)
    inputs = [t.requires_grad_() for t in inputs]
    assert node in graph_names(fn(*inputs)), sorted(graph_names(fn(*inputs)))
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def penalty_grads(fn, inputs, up, w):
    """First-order gradients (create_graph=True) of ``(out * up).sum()``, then the gradients of the penalty
    ``sum_n (g_n * w_n).sum() + (g_n ** 2).sum()`` (R1 / WGAN-GP style) at every input."""
    out = fn(*inputs)
    first = torch.autograd.grad((out.double() * up).sum(), inputs, create_graph=True)
    pen = sum((g.double() * wn).sum() + g.double().pow(2).sum() for g, wn in zip(first, w))
    second = torch.autograd.grad(pen, inputs)
    return out, first, second


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", PATHS)
def test_second_order_gradients_equal_float64_with_nan_planted(name, dtype):
    fn, inputs, allowed, dead, masked, up, bias, _ = path_case(name, dtype, plant=NAN)
    leaves = [t.clone().requires_grad_() for t in inputs]
    w = [torch.randn(t.shape, generator=torch.Generator().manual_seed(5 + n)).double() for n, t in enumerate(inputs)]
    out, first, second = penalty_grads(fn, leaves, up.double(), w)

    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    ref_fn = lambda q, k, v, bias=None: ref64(q, k, v, allowed, bias=bias)  # noqa: E731
    ref_out, ref_first, ref_second = penalty_grads(ref_fn, leaves64, up.double(), w)
    assert_close(out, ref_out, f"{name}: output", dtype, table=ATTEND_TOL)
    for n, a, e in zip(("q", "k", "v", "bias"), first, ref_first):
        assert_close(a, e, f"{name}: first-order grad {n}", dtype, table=ATTEND_TOL)
    for n, a, e in zip(("q", "k", "v", "bias"), second, ref_second):
        assert_close(a, e, f"{name}: second-order grad {n}", dtype, table=ATTEND_TOL)
    assert_selected_away(*first[:3], dead, masked, f"{name}: first order")
    assert_selected_away(*second[:3], dead, masked, f"{name}: second order")


@pytest.mark.parametrize("path", ("lean", "generic"))
def test_second_order_on_large_cpu_tensors(path):
    """Tensors of >= 65536 elements, on the lean path (chunked) and on the generic one, where the bitwise
    selections (``_SelectOrZero``) are in the graph and their backward is differentiated too; NaN planted
    in dead rows and masked keys reaches no first- or second-order gradient."""
    b, h, i, j, d = 2, 4, 128, 128, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for n in (i, j, j))
    pad = torch.ones(b, j, dtype=torch.bool)
    pad[0, 100:] = False
    pad[1, :] = False
    allowed = pad[:, None, None, :].expand(b, 1, i, j)
    dead, masked = ~allowed.any(-1)[:, 0], ~pad
    q = torch.where(dead[:, None, :, None], NAN, q)
    k, v = (torch.where(masked[:, None, :, None], NAN, t) for t in (k, v))
    up = torch.randn(b, h, i, d, generator=gen).double()
    w = [torch.randn(t.shape, generator=gen).double() for t in (q, k, v)]
    sdpa = A.F.scaled_dot_product_attention
    kernel = sdpa if path == "lean" else lambda *args, **kwargs: sdpa(*args, **kwargs)  # not SDPA: the generic path
    chunk_min = A._CHUNK_MIN_SCORES
    A._CHUNK_MIN_SCORES = 1  # several chunks on the lean path
    try:
        with A.substitute_kernel(kernel):
            fn = lambda q, k, v: attend(q, k, v, mask=pad)  # noqa: E731
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            node = "_SelectedFlashAttentionBackward" if path == "lean" else "_SelectOrZeroBackward"
            assert node in graph_names(fn(*leaves))
            out, first, second = penalty_grads(fn, leaves, up, w)
    finally:
        A._CHUNK_MIN_SCORES = chunk_min
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, ref_first, ref_second = penalty_grads(lambda q, k, v: ref64(q, k, v, allowed), leaves64, up, w)
    for n, a, e in zip("qkv", first, ref_first):
        assert_close(a, e, f"first-order grad {n}", torch.float32, table=ATTEND_TOL)
    for n, a, e in zip("qkv", second, ref_second):
        assert_close(a, e, f"second-order grad {n}", torch.float32, table=ATTEND_TOL)
    assert_selected_away(*second, dead, masked, "second order")


@pytest.mark.parametrize("name", ("lean", "lean-full-gqa", "bias"))
def test_second_order_with_a_kernel_that_writes_nan(name):
    """S6: a substituted kernel writing NaN into the outputs of dead rows and into the gradients of dead
    rows and masked keys (in every backward, create_graph or not) reaches no first- or second-order
    gradient; both still equal the float64 reference."""
    fn, inputs, allowed, dead, masked, up, bias, _ = path_case(name, torch.float32, plant=NAN)
    kernel = hp.NaNKernel(dead[:, None, :])
    leaves = [t.clone().requires_grad_() for t in inputs]
    w = [torch.randn(t.shape, generator=torch.Generator().manual_seed(7 + n)).double() for n, t in enumerate(inputs)]
    with A.substitute_kernel(kernel):
        out, first, second = penalty_grads(fn, leaves, up.double(), w)
    assert kernel.poisoned > 0, "the kernel never misbehaved"
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    ref_fn = lambda q, k, v, bias=None: ref64(q, k, v, allowed, bias=bias)  # noqa: E731
    ref_out, ref_first, ref_second = penalty_grads(ref_fn, leaves64, up.double(), w)
    assert_close(out, ref_out, f"{name}: output", torch.float32, table=ATTEND_TOL)
    for n, a, e in zip(("q", "k", "v", "bias") * 2, first + second, ref_first + ref_second):
        assert_close(a, e, f"{name}: grad {n}", torch.float32, table=ATTEND_TOL)
    assert_selected_away(*second[:3], dead, masked, f"{name}: second order")


def test_ordinary_backward_never_recomputes():
    """The first-order path is the kernel's own backward: the reference recomputation runs only in a
    backward with create_graph=True."""
    calls = []
    real = A._reference_vjp

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    A._reference_vjp = spy
    try:
        for name in ("lean", "selected", "bias"):
            fn, inputs, *_ = path_case(name, torch.float32)
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = fn(*leaves)
            torch.autograd.grad(out.sum(), leaves, retain_graph=True)
            assert calls == [], name
            torch.autograd.grad(out.sum(), leaves, create_graph=True)
            assert len(calls) == 1, name
            calls.clear()
    finally:
        A._reference_vjp = real


def test_double_backward_with_dropout_through_a_fused_kernel_is_a_clear_error():
    """The one case left: a fused kernel's dropout mask cannot be recomputed (only reachable on CUDA, where
    the fused kernels take dropout; the autograd function is exercised directly here)."""
    q = torch.randn(1, 1, 2, 4, requires_grad=True)
    out = A._ReferenceSecondOrder.apply(q * 1.0, q, q, q, None, (False, 0.5, 0.1, "efficient"))
    (g,) = torch.autograd.grad(out.sum(), q)  # first order: fine
    assert_finite(g)
    with pytest.raises(RuntimeError, match="dropout.*backend='math'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


# An SDPA stand-in built as a torch.library custom op whose backward op has no autograd formula and needs
# a gradient (as cuDNN's): ``attend`` runs such a kernel apart (``_KernelApart``), checked here on the CPU
# by treating the flash plan as one of ``_KERNELS_APART``.


def _sdpa_parts(q, k, v, mask, is_causal, scale):
    dt = torch.promote_types(q.dtype, torch.float32)
    g = q.shape[1] // k.shape[1]
    qs, ks, vs = q.to(dt), k.to(dt).repeat_interleave(g, 1), v.to(dt).repeat_interleave(g, 1)
    logits = qs @ ks.transpose(-1, -2) * scale
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.to(dt)
    return qs, ks, vs, logits.softmax(-1), g


@torch.library.custom_op("safeformer_test::sdpa_fwd", mutates_args=())
def _lib_sdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                  scale: float) -> torch.Tensor:
    _, _, vs, p, _ = _sdpa_parts(q, k, v, mask, is_causal, scale)
    return (p @ vs).to(q.dtype)


@torch.library.custom_op("safeformer_test::sdpa_bwd", mutates_args=())
def _lib_sdpa_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qs, ks, vs, p, g = _sdpa_parts(q, k, v, mask, is_causal, scale)
    go = grad.to(p.dtype)
    dp = go @ vs.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # the gradient of the logits (and of an additive mask)
    b, hk = k.shape[:2]
    dq = (ds @ ks * scale).to(q.dtype)
    dk = (ds.transpose(-1, -2) @ qs * scale).reshape(b, hk, g, *k.shape[2:]).sum(2).to(k.dtype)
    dv = (p.transpose(-1, -2) @ go).reshape(b, hk, g, *v.shape[2:]).sum(2).to(v.dtype)
    dmask = ds.sum_to_size(mask.shape).to(mask.dtype) if mask is not None and mask.is_floating_point() else q.new_zeros(0)
    return dq, dk, dv, dmask


def _lib_sdpa_setup(ctx, inputs, output):
    q, k, v, mask, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _lib_sdpa_backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv, dmask = torch.ops.safeformer_test.sdpa_bwd(grad, q, k, v, mask, ctx.is_causal, ctx.scale)
    return dq, dk, dv, (dmask if dmask.numel() else None), None, None


_lib_sdpa_fwd.register_autograd(_lib_sdpa_backward, setup_context=_lib_sdpa_setup)


def library_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return torch.ops.safeformer_test.sdpa_fwd(q, k, v, attn_mask, is_causal, q.shape[-1] ** -0.5 if scale is None else scale)


@pytest.mark.parametrize("name", ("lean", "lean-full-gqa", "bias", "causal-no-mask"))
def test_kernel_apart_first_and_second_order(name, monkeypatch):
    """A kernel that must be kept apart (a custom op whose backward needs a gradient, as cuDNN's): the
    ordinary backward is the kernel's own, bit for bit (and runs twice with retain_graph=True); second
    derivatives equal the float64 reference, NaN planted at dead rows and masked keys reaches none."""
    monkeypatch.setattr(A, "_KERNELS_APART", frozenset({"flash"}))
    fn, inputs, allowed, dead, masked, up, bias, _ = path_case(name, torch.float32, plant=NAN)
    with A.substitute_kernel(library_sdpa):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        assert "_KernelApartBackward" in graph_names(out)
        first = torch.autograd.grad(out, leaves, up.float(), retain_graph=True)
        again = torch.autograd.grad(out, leaves, up.float())
        monkeypatch.setattr(A, "_KERNELS_APART", frozenset())  # the same kernel, followed (no second order)
        plain = [t.clone().requires_grad_() for t in inputs]
        want = torch.autograd.grad(fn(*plain), plain, up.float())
        monkeypatch.setattr(A, "_KERNELS_APART", frozenset({"flash"}))
        hp.assert_bitwise(out, fn(*plain), "output")
        for n, a, b_, e in zip(("q", "k", "v", "bias"), first, again, want):
            hp.assert_bitwise(a, e, f"{name}: grad {n}")
            hp.assert_bitwise(b_, e, f"{name}: grad {n}, second backward")
        w = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9 + n)).double() for n, t in enumerate(inputs)]
        leaves = [t.clone().requires_grad_() for t in inputs]
        _, first, second = penalty_grads(fn, leaves, up.double(), w)
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    ref_fn = lambda q, k, v, bias=None: ref64(q, k, v, allowed, bias=bias)  # noqa: E731
    _, ref_first, ref_second = penalty_grads(ref_fn, leaves64, up.double(), w)
    for n, a, e in zip(("q", "k", "v", "bias") * 2, first + second, ref_first + ref_second):
        assert_close(a, e, f"{name}: grad {n}", torch.float32, table=ATTEND_TOL)
    assert_selected_away(*second[:3], dead, masked, f"{name}: second order")


def test_kernel_apart_gradgradcheck(monkeypatch):
    monkeypatch.setattr(A, "_KERNELS_APART", frozenset({"flash"}))
    fn, inputs, *_ = path_case("bias", torch.float64)
    with A.substitute_kernel(library_sdpa):
        inputs = [t.requires_grad_() for t in inputs]
        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


def test_kernel_apart_with_dropout_is_a_clear_error_in_double_backward():
    q = torch.randn(1, 1, 2, 4, requires_grad=True)
    run = (lambda q, k, v, m: q * 2.0, lambda q, k, v, m: q * 2.0, 0.1, "cudnn")
    out = A._KernelApart.apply(q, q, q, None, run)
    (g,) = torch.autograd.grad(out.sum(), q, retain_graph=True)
    assert_close(g, torch.full_like(q, 2.0, dtype=torch.float64), "first order", torch.float32)
    with pytest.raises(RuntimeError, match="dropout.*backend='math'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("model_kind", ("encoder", "decoder-padded", "wrapper-embeddings"))
def test_gradient_penalty_through_models_equals_float64(model_kind):
    """An R1 penalty (the squared norm of the input gradient) through a model on the default backend, with
    a padding mask (a fully padded sample) and NaN at padded inputs: the parameter gradients equal a
    float64 copy on the reference backend, and are finite."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0] * 6, [1] * 6], dtype=torch.bool)
    if model_kind == "wrapper-embeddings":
        model = sf.TransformerWrapper(num_tokens=11, max_seq_len=6, attn_layers=sf.Encoder(dim=16, depth=1, heads=2,
                                                                                          dim_head=8))
        x = torch.randint(0, 11, (3, 6))
        with torch.no_grad():  # unit-scale embeddings: the penalty's second-order float32 noise stays in tolerance
            model.token_emb.weight.normal_()

        def run(m, dtype):
            emb = m.token_emb(x).to(dtype).detach().requires_grad_()  # WGAN-GP style: the penalty at the embeddings
            return emb, m.attn_layers(emb, mask=mask)
    else:
        stack = sf.Encoder if model_kind == "encoder" else sf.Decoder
        model = stack(dim=16, depth=2, heads=2, dim_head=8)
        if model_kind == "decoder-padded":
            hp.set_unpadded(model, False)
        x = torch.where(mask[..., None], torch.randn(3, 6, 16), NAN)

        def run(m, dtype):
            xin = x.to(dtype).requires_grad_()
            return xin, m(xin, mask=mask)

    model64 = hp.set_backend(copy.deepcopy(model).double(), "reference")
    got = {}
    for m, dtype in ((model, torch.float32), (model64, torch.float64)):
        xin, out = run(m, dtype)
        (g,) = torch.autograd.grad(out.sum(), xin, create_graph=True)
        assert_zero(g[~mask], f"{model_kind}: input grad at padded positions ({dtype})")
        m.zero_grad()
        g.pow(2).sum().backward()
        got[dtype] = hp.param_grads(m)
    reached = [n for n, gr in got[torch.float32].items() if gr is not None and "to_q" in n]
    assert reached, "the penalty's gradient never reached attention's queries"
    for n, gr in got[torch.float32].items():
        if gr is not None:  # (the final norm's bias: the input gradient does not depend on it)
            assert_finite(gr, f"{model_kind}: penalty grad of {n}")
    hp.assert_grads_match(got[torch.float32], got[torch.float64], f"{model_kind}: penalty", torch.float32)


# ----------------------------------------------------------------------------------------------------
# varlen: the kernel path's second derivatives, and transforms
# ----------------------------------------------------------------------------------------------------


def cpu_varlen_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False):
    """varlen_attn's forward in plain ops (per-segment softmax, in the inputs' dtype), for the custom op below."""
    outs, cu = [], cu_seq_q.tolist()
    g = query.shape[1] // key.shape[1]
    for a, b in zip(cu, cu[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (query, key, value))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        logits = qs @ ks.transpose(-1, -2) * scale
        if window_size == (-1, 0):
            logits = logits.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        outs.append((logits.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs)


# A stand-in for varlen_attn built the way the real one is: a torch.library custom op whose registered
# backward calls another custom op that has no autograd formula (the real one: _varlen_attn_backward,
# Flash's backward). A backward with create_graph=True that ran the kernel's backward would leave a node
# that refuses the second differentiation ("no autograd formula was registered").


def _segments(cu: torch.Tensor):
    cu = cu.tolist()
    return list(zip(cu, cu[1:]))


@torch.library.custom_op("safeformer_test::varlen_fwd", mutates_args=())
def _lib_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float,
                    causal: bool) -> torch.Tensor:
    return cpu_varlen_kernel(q, k, v, cu, cu, 0, 0, scale=scale, window_size=(-1, 0) if causal else (-1, -1),
                             enable_gqa=True).clone()


@torch.library.custom_op("safeformer_test::varlen_bwd", mutates_args=())
def _lib_varlen_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                    scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention's backward written out, per segment (float32 at least)."""
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    for a, b in _segments(cu):
        dt = torch.promote_types(q.dtype, torch.float32)
        qs, go = (t[a:b].to(dt).transpose(0, 1) for t in (q, grad))  # (h, n, d)
        ks, vs = (t[a:b].to(dt).transpose(0, 1).repeat_interleave(hq // hk, 0) for t in (k, v))
        logits = qs @ ks.transpose(-1, -2) * scale
        if causal:
            logits = logits.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        p = logits.softmax(-1)
        dp = go @ vs.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[a:b] = (ds @ ks).transpose(0, 1).to(q.dtype)
        dk[a:b] = (ds.transpose(-1, -2) @ qs).reshape(hk, hq // hk, b - a, -1).sum(1).transpose(0, 1).to(k.dtype)
        dv[a:b] = (p.transpose(-1, -2) @ go).reshape(hk, hq // hk, b - a, -1).sum(1).transpose(0, 1).to(v.dtype)
    return dq, dk, dv


def _lib_setup(ctx, inputs, output):
    q, k, v, cu, scale, causal = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale, ctx.causal = scale, causal


LIB_BACKWARD_CALLS: list[int] = []


def _lib_backward(ctx, grad):
    LIB_BACKWARD_CALLS.append(1)
    q, k, v, cu = ctx.saved_tensors
    dq, dk, dv = torch.ops.safeformer_test.varlen_bwd(grad, q, k, v, cu, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None


_lib_varlen_fwd.register_autograd(_lib_backward, setup_context=_lib_setup)


def library_varlen_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False):
    return torch.ops.safeformer_test.varlen_fwd(query, key, value, cu_seq_q, scale, window_size == (-1, 0))


def varlen_ref64(q, k, v, lengths, causal):
    outs, start = [], 0
    for n in lengths:
        if n:
            seg = [t[start:start + n].double().transpose(0, 1)[None] for t in (q, k, v)]  # (1, h, n, d)
            allowed = torch.ones(1, 1, n, n, dtype=torch.bool)
            if causal:
                allowed = allowed.tril()
            outs.append(ref64(*seg, allowed)[0].transpose(0, 1))
            start += n
    return torch.cat(outs)


def varlen_inputs(dtype, lengths=(2, 0, 3), h=2, hkv=1, d=4):
    gen = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q, k, v = (torch.randn(T, n, d, generator=gen).to(dtype) for n in (h, hkv, hkv))
    return q, k, v, torch.randn(T, h, d, generator=gen).double()


def test_varlen_kernel_path_first_order_is_the_kernels_own():
    """An ordinary backward runs the kernel's own backward (once), bit for bit what the kernel gives alone,
    and twice with retain_graph=True."""
    lengths = [2, 0, 3]
    q, k, v, up = varlen_inputs(torch.float32, lengths, h=4, hkv=2)
    layout = varlen_layout(lengths)
    with substitute_varlen_kernel(library_varlen_kernel):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, layout, causal=True, plan=KERNEL_PLAN)
        assert "_KernelApartBackward" in graph_names(out)
        LIB_BACKWARD_CALLS.clear()
        got = torch.autograd.grad(out, leaves, up.float(), retain_graph=True)
        again = torch.autograd.grad(out, leaves, up.float())
        assert len(LIB_BACKWARD_CALLS) == 2
    alone = [t.clone().requires_grad_() for t in (q, k, v)]
    direct = library_varlen_kernel(*alone, layout.cu_seqlens, layout.cu_seqlens, layout.max_len, layout.max_len,
                                   scale=4**-0.5, window_size=(-1, 0), enable_gqa=True)
    want = torch.autograd.grad(direct, alone, up.float())
    hp.assert_bitwise(out, direct, "output")
    for n, a, b_, e in zip("qkv", got, again, want):
        hp.assert_bitwise(a, e, f"grad {n}")
        hp.assert_bitwise(b_, e, f"grad {n}, second backward")


def test_varlen_kernel_path_second_derivatives():
    """A kernel built as the real one (a custom op whose backward has no derivative): gradcheck and
    gradgradcheck in float64, and a float32 gradient penalty equals the float64 reference."""
    lengths = [2, 0, 3]
    q, k, v, up = varlen_inputs(torch.float64, lengths)
    with substitute_varlen_kernel(library_varlen_kernel):
        fn = lambda q, k, v: varlen_attention(q, k, v, lengths, causal=True, plan=KERNEL_PLAN)  # noqa: E731
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        assert torch.autograd.gradcheck(fn, leaves)
        assert torch.autograd.gradgradcheck(fn, leaves)
        q32, k32, v32, _ = varlen_inputs(torch.float32, lengths)
        leaves32 = [t.clone().requires_grad_() for t in (q32, k32, v32)]
        w = [torch.randn(t.shape, dtype=torch.float64) for t in leaves32]
        _, first, second = penalty_grads(fn, leaves32, up, w)
    leaves64 = [t.detach().double().requires_grad_() for t in (q32, k32, v32)]
    _, ref_first, ref_second = penalty_grads(lambda q, k, v: varlen_ref64(q, k, v, lengths, True), leaves64, up, w)
    for n, a, e in zip("qkv" * 2, first + second, ref_first + ref_second):
        assert_close(a, e, f"varlen penalty grads {n}", torch.float32, table=ATTEND_TOL)


def test_varlen_under_func_transforms():
    """Under torch.func the kernel path runs the reference (the kernel has no batching rule)."""
    lengths = [2, 0, 3]
    q, k, v, up = varlen_inputs(torch.float32, lengths, h=2, hkv=2)
    with substitute_varlen_kernel(library_varlen_kernel):
        fn = lambda q, k, v: varlen_attention(q, k, v, lengths, causal=False, plan=KERNEL_PLAN)  # noqa: E731
        got = torch.func.grad(lambda q, k, v: (fn(q, k, v) * up).sum(), argnums=(0, 1, 2))(q, k, v)
        stacked = torch.func.vmap(fn)(torch.stack([q, 2 * q]), torch.stack([k, k]), torch.stack([v, -v]))
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(varlen_ref64(*leaves64, lengths, False), leaves64, up)
    for n, a, e in zip("qkv", got, want):
        assert_close(a, e, f"varlen func.grad {n}", torch.float32, table=ATTEND_TOL)
    assert_close(stacked[1], varlen_ref64(2 * q, k, -v, lengths, False), "varlen vmap", torch.float32, table=ATTEND_TOL)
