"""The safety contract (docs/safety.md) for ``safeformer.core.attend``, one named test per clause.

Every property test draws batch sizes, query/key lengths (0 included), head counts and GQA ratios,
every mask kind with dead rows on purpose, causal on/off, and garbage (NaN, +-inf, huge) planted at
masked keys/values and dead queries; it runs on every backend of the device and every dtype, and
compares against a float64 reference in the plainest code (``helpers.ref_attend``).

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d/e head dims.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from helpers import (
    ATTEND_TOL,
    DEVICES,
    INF,
    NAN,
    AttnCase,
    NaNKernel,
    RecordingKernel,
    assert_bitwise,
    assert_close,
    assert_finite,
    assert_zero,
    attention_cases,
    attention_masks,
    backend_takes,
    backends_for,
    device_dtype_backend_params,
    dtypes_for,
    faithful_kernel,
    grads,
    mask_from_lengths,
    plant,
    ref_attend,
)
from hypothesis import assume, given, reject
from hypothesis import strategies as st

import safeformer as sf
from safeformer import attend
from safeformer.testing import AttentionPlan, plan_attention, substitute_kernel

PARAMS = device_dtype_backend_params()
PARAM_IDS = [f"{dev}-{str(dt).removeprefix('torch.')}-{be}" for dev, dt, be in PARAMS]
SDPA_PARAMS = [p for p in PARAMS if p[2] != "reference"]
SDPA_IDS = [f"{dev}-{str(dt).removeprefix('torch.')}-{be}" for dev, dt, be in SDPA_PARAMS]
HALF_PARAMS = [p for p in PARAMS if p[1] in (torch.float16, torch.bfloat16)]
HALF_IDS = [f"{dev}-{str(dt).removeprefix('torch.')}-{be}" for dev, dt, be in HALF_PARAMS]
DEVICE_BACKENDS = [(dev, be) for dev in DEVICES for be in backends_for(dev)]
DEVICE_BACKEND_IDS = [f"{dev}-{be}" for dev, be in DEVICE_BACKENDS]
# the float32 tests: a fused kernel that refuses float32 outright on a device (flash, cuDNN on CUDA) is left out
F32_BACKENDS = [(dev, be) for dev, be in DEVICE_BACKENDS if backend_takes(dev, torch.float32, be)]
F32_BACKEND_IDS = [f"{dev}-{be}" for dev, be in F32_BACKENDS]


FUSED = ("flash", "efficient", "cudnn")


def attend_on(device, backend, q, k, v, **kwargs):
    """attend(q, k, v, backend=backend, ...); on CUDA a fused backend may refuse inputs it cannot run (a
    ValueError that says so, S9): hypothesis drops that example. On the CPU every backend must accept
    every drawn case."""
    try:
        return attend(q, k, v, backend=backend, **kwargs)
    except ValueError as err:
        if device == "cuda" and backend in FUSED and ("cannot run these inputs" in str(err)
                                                      or "refused these inputs" in str(err)):
            reject()
        raise


def skip_if_no_mask_taken(device, backend):
    """CUDA flash takes no mask tensor: a test whose every example has a mask cannot reach it (its
    refusal is tested by the planner's tests)."""
    if device == "cuda" and backend == "flash":
        pytest.skip("flash takes no mask tensor on CUDA: every example of this test has one")


def run(case: AttnCase, dtype, device, backend, *, garbage=True, **kwargs):
    """attend() on the case's leaf inputs; returns (out, (q, k, v)).

    On CUDA a fused backend may refuse inputs it cannot run (a ValueError, S9): hypothesis drops that
    example. On the CPU every backend must accept every drawn case.
    """
    q, k, v = case.inputs(dtype, device, garbage=garbage)
    out = attend_on(device, backend, q, k, v, mask=None if case.mask is None else case.mask.to(device),
                    causal=case.causal, **kwargs)
    return out, (q, k, v)


def reference(case: AttnCase, q, k, v, upstream=None, **kwargs):
    """The float64 reference output for the same (rounded, garbage-planted) inputs, and its gradients."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    out = ref_attend(*leaves, case.mask4d, causal=case.causal, **kwargs)
    if upstream is None:
        return out.detach(), None
    return out.detach(), grads(out, leaves, upstream.double().cpu(), missing_is_zero=True)


def expand_rows(rows, e):
    """(b, h, i) row selector -> (b, h, i, e) element selector."""
    return rows[..., None].expand(*rows.shape, e)


# ----------------------------------------------------------------------------------------------------
# S1 finite
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype", "backend"), PARAMS, ids=PARAM_IDS)
@given(case=attention_cases())
def test_s1_finite(device, dtype, backend, case):
    """Every mask (dead rows, all-False, j == 0, fully padded samples), garbage at masked positions:
    the output and the gradients of q, k, v are finite."""
    out, inputs = run(case, dtype, device, backend)
    assert out.shape == (case.b, case.h, case.i, case.e) and out.dtype == dtype
    assert_finite(out, "output")
    if case.j == 0:  # every row is dead; gradients are covered by test_s1_zero_length_context_*
        assert_zero(out, "output with no keys")
        return
    for name, g in zip("qkv", grads(out, inputs, case.upstream(dtype, device))):
        assert_finite(g, f"grad of {name}")


# ----------------------------------------------------------------------------------------------------
# S2 dead rows are exactly zero
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype", "backend"), PARAMS, ids=PARAM_IDS)
@given(case=attention_cases(allow_empty=False, kinds=("key_padding", "full", "per_head", "query_padding", "shared")))
def test_s2_dead_rows_exactly_zero(device, dtype, backend, case):
    """Dead rows give exactly 0.0 and pass exactly zero gradient into q, k, v."""
    skip_if_no_mask_taken(device, backend)
    dead = case.dead()
    assume(bool(dead.any()))
    out, inputs = run(case, dtype, device, backend)
    dead_el = expand_rows(dead, case.e).to(device)
    assert_zero(out[dead_el], "output at dead rows")
    # an upstream gradient on dead rows only reaches nothing
    only_dead = case.upstream(dtype, device) * dead_el
    gq, gk, gv = grads(out, inputs, only_dead)
    for name, g in (("q", gq), ("k", gk), ("v", gv)):
        assert_zero(g, f"grad of {name} from dead rows only")
    # with a gradient everywhere, a dead query still receives exactly zero
    gq, _, _ = grads(out, inputs, case.upstream(dtype, device))
    assert_zero(gq[expand_rows(dead, case.d).to(device)], "grad of q at dead rows")


# ----------------------------------------------------------------------------------------------------
# S3 no leak from masked keys
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype", "backend"), PARAMS, ids=PARAM_IDS)
@given(case=attention_cases(allow_empty=False), other=st.sampled_from([NAN, INF, -INF, 123.0]))
def test_s3_no_leak_from_masked_keys(device, dtype, backend, case, other):
    """Garbage (NaN, +-inf, other numbers) at masked keys/values and dead (padded) queries changes no
    output bit and no gradient bit, and the gradient at those positions is exactly zero."""
    masked = case.masked_keys()
    dead = case.dead()
    clean_out, clean_in = run(case, dtype, device, backend, garbage=False)
    out, inputs = run(case, dtype, device, backend, garbage=True)
    assert_bitwise(out, clean_out, "output with garbage at masked positions")
    q2, k2, v2 = (t.detach() for t in case.clean(dtype, device))  # a second garbage value
    q2, k2, v2 = plant(q2, dead, other), plant(k2, masked, other), plant(v2, masked, other)
    out2 = attend_on(device, backend, q2, k2, v2, mask=None if case.mask is None else case.mask.to(device),
                     causal=case.causal)
    assert_bitwise(out2, clean_out, f"output with {other} at masked positions")

    upstream = case.upstream(dtype, device)
    for name, g, g_clean, where in zip(
        "qkv", grads(out, inputs, upstream), grads(clean_out, clean_in, upstream), (dead, masked, masked)
    ):
        assert_bitwise(g, g_clean, f"grad of {name} with garbage at masked positions")
        assert_zero(g[where.to(device)], f"grad of {name} at masked positions")


# ----------------------------------------------------------------------------------------------------
# S4 padding invariance (attend level: a padded batch == each sample alone)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype", "backend"), PARAMS, ids=PARAM_IDS)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    extra=st.integers(0, 3),
    left=st.booleans(),
    causal=st.booleans(),
    query_mask=st.booleans(),
    gqa=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    garbage=st.sampled_from([NAN, INF, -INF]),
    seed=st.integers(0, 2**31),
)
def test_s4_padded_batch_equals_each_sample_alone(
    device, dtype, backend, lengths, extra, left, causal, query_mask, gqa, garbage, seed
):
    """Self-attention over a right- or left-padded batch, garbage (NaN, +-inf) in every padded q, k, v
    position: each sample's real positions equal the sample run alone. The mask is the key padding
    (b, n), or query & key padding (b, 1, n, n), which makes the padded queries dead rows (exactly 0).
    With key padding alone a padded query is a real row to attend: its garbage stays in its own row."""
    skip_if_no_mask_taken(device, backend)
    h, h_kv = gqa
    n = max(lengths) + extra
    d = 8
    gen = torch.Generator().manual_seed(seed)
    real = mask_from_lengths(lengths, n, left=left)  # (b, n)
    b = len(lengths)
    q = torch.randn(b, h, n, d, generator=gen).to(dtype)
    k = torch.randn(b, h_kv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, h_kv, n, d, generator=gen).to(dtype)
    qp, kp, vp = (plant(t, ~real[:, None, :].expand(b, t.shape[1], n), garbage).to(device) for t in (q, k, v))
    mask = real[:, None, :, None] & real[:, None, None, :] if query_mask else real
    batched = attend_on(device, backend, qp, kp, vp, mask=mask.to(device), causal=causal)
    for s in range(b):
        pos = real[s].nonzero().flatten()
        alone = attend_on(device, backend, q[s : s + 1, :, pos].to(device), k[s : s + 1, :, pos].to(device),
                          v[s : s + 1, :, pos].to(device), causal=causal)
        assert_close(batched[s : s + 1, :, pos.to(device)], alone.double(), f"sample {s} padded vs alone", dtype, table=ATTEND_TOL)
        ref = ref_attend(q[s : s + 1, :, pos], k[s : s + 1, :, pos], v[s : s + 1, :, pos], causal=causal)
        assert_close(alone, ref, f"sample {s} alone vs float64 reference", dtype, table=ATTEND_TOL)
        if query_mask:
            assert_zero(batched[s, :, ~real[s].to(device)], f"padded queries of sample {s}")


# ----------------------------------------------------------------------------------------------------
# S5 same answer on every path
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype", "backend"), PARAMS, ids=PARAM_IDS)
@given(data=st.data())
def test_s5_backends_agree(device, dtype, backend, data):
    """Every backend's output and gradients match the float64 reference to the dtype's tolerance,
    dead rows (exactly 0) and garbage at masked positions included. (Backends other than CPU flash
    also get a value head dim e != d.)"""
    case = data.draw(attention_cases(allow_empty=False, same_head_dims=backend == "flash"))
    out, inputs = run(case, dtype, device, backend)
    upstream = case.upstream(dtype, device)
    ref_out, ref_grads = reference(case, *inputs, upstream=upstream)
    assert_close(out, ref_out, "output", dtype, table=ATTEND_TOL)
    for name, g, rg in zip("qkv", grads(out, inputs, upstream), ref_grads):
        assert_close(g, rg, f"grad of {name}", dtype, table=ATTEND_TOL)


@pytest.mark.parametrize(("device", "dtype", "backend"), PARAMS, ids=PARAM_IDS)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    chunk=st.integers(1, 3),
    gqa=st.sampled_from([(2, 2), (4, 2), (2, 1)]),
    seed=st.integers(0, 2**31),
)
def test_s5_kv_cache_path_equals_full_causal(device, dtype, backend, lengths, chunk, gqa, seed):
    """The KV-cache path (a chunk of new queries against every cached key, bottom-right causal, the
    left-padding mask of the prompt batch) equals full causal attention, dead (padded) rows included."""
    skip_if_no_mask_taken(device, backend)
    h, h_kv = gqa
    n, d = max(lengths), 8
    b = len(lengths)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(b, h_kv, n, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(b, h_kv, n, d, generator=gen).to(device=device, dtype=dtype)
    real = mask_from_lengths(lengths, n, left=True).to(device)  # (b, n), left padding
    full = attend_on(device, backend, q, k, v, mask=real, causal=True)
    ref = ref_attend(q, k, v, real[:, None, None].cpu(), causal=True)
    assert_close(full, ref, "full causal", dtype, table=ATTEND_TOL)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        step = attend_on(device, backend, q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], mask=real[:, :stop],
                         causal=True)
        assert_close(step, ref[:, :, start:stop], f"cached queries {start}:{stop}", dtype, table=ATTEND_TOL)
        dead = ~real[:, start:stop]  # a padded query sees only padding: a dead row
        assert_zero(step.transpose(1, 2)[dead], "dead rows of the cached step")


def test_s5_reference_path_equals_sdpa_path_float64():
    """In float64 the reference path and the SDPA math path agree to rounding, dead rows included."""
    torch.manual_seed(1)
    b, h, h_kv, i, j, d = 2, 4, 2, 5, 7, 8
    q, k, v = torch.randn(b, h, i, d, dtype=torch.float64), torch.randn(b, h_kv, j, d, dtype=torch.float64), \
        torch.randn(b, h_kv, j, d, dtype=torch.float64)
    mask = torch.rand(b, h, i, j) < 0.5
    mask[0, :, 1] = False
    mask[1] = False
    outs = {be: attend(q, k, v, mask=mask, causal=True, backend=be) for be in ("reference", "math", "flash", "auto")}
    ref = ref_attend(q, k, v, mask, causal=True)
    for be, out in outs.items():
        assert_close(out, ref, f"{be} output", torch.float64, table=ATTEND_TOL)
    assert_zero(outs["math"][1], "fully masked sample")


# ----------------------------------------------------------------------------------------------------
# S6 the guarantee does not trust the kernel
# ----------------------------------------------------------------------------------------------------


def test_nan_kernel_poisons_what_it_should():
    """The S6 stand-in really misbehaves: a row handed to it with no key is NaN forward and sends NaN
    gradients into q, k, v backward (as kernels before torch 2.5 did), even with zero gradient flowing
    into that row; a row the test marks dead is NaN forward; every other row is the real SDPA result."""
    q, k, v = (torch.randn(2, 1, n, 4, requires_grad=True) for n in (3, 5, 5))
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = False
    told = torch.zeros(2, 1, 3, dtype=torch.bool)
    told[1, 0, 2] = True
    out = NaNKernel(told)(q, k, v, attn_mask=mask)
    poisoned = torch.zeros(2, 1, 3, dtype=torch.bool)
    poisoned[0, 0, 1] = poisoned[1, 0, 2] = True
    assert bool(torch.isnan(out[poisoned]).all())
    real = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_bitwise(out[~poisoned], real[~poisoned], "unpoisoned rows")
    _, gk, _ = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) * ~poisoned[..., None])
    assert bool(torch.isnan(gk[0]).all())  # the dead row's NaN reached every key of its sample
    assert_finite(gk[1], "grad of k where the kernel saw no dead row")
    float_mask = torch.zeros(2, 1, 3, 5).masked_fill(~mask, -INF)
    assert bool(torch.isnan(NaNKernel(value=INF)(q, k, v, attn_mask=float_mask)[0, 0, 1]).all() == 0)
    kernel = NaNKernel(value=INF)
    out_inf = kernel(q, k, v, attn_mask=float_mask)
    assert bool((out_inf[0, 0, 1] == INF).all()) and kernel.calls[0].rows_without_keys == 1
    assert kernel.calls[0].mask_shape == (2, 1, 3, 5)


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize(("device", "dtype", "backend"), SDPA_PARAMS, ids=SDPA_IDS)
@given(case=attention_cases(allow_empty=False), with_bias=st.booleans())
def test_s6_kernel_not_trusted(device, dtype, backend, value, case, with_bias):
    """With a kernel that is NaN forward and backward on every dead row it is handed, and writes NaN
    (or inf) into every truly dead row, attend's output and gradients are finite and bit-for-bit those
    of the real kernel; with and without an additive bias (garbage where masked)."""
    kwargs = {}
    if with_bias:
        gen = torch.Generator().manual_seed(case.seed + 3)
        bias = torch.randn(1, case.h, case.i, case.j, generator=gen)
        kwargs["bias"] = bias.masked_fill((~case.allowed()).all(0, keepdim=True), case.planted).to(device)
    upstream = case.upstream(dtype, device)
    # the reference run goes through the same substituted kernel writing nothing: its gradients come out
    # of one autograd node, which can change the engine's summation order by an ulp on the math backend
    with substitute_kernel(faithful_kernel()):
        out, inputs = run(case, dtype, device, backend, **kwargs)
        g_real = grads(out, inputs, upstream)
    with substitute_kernel(NaNKernel(case.dead().to(device), value=value)):
        bad_out, bad_inputs = run(case, dtype, device, backend, **kwargs)
        g_bad = grads(bad_out, bad_inputs, upstream)
    assert_bitwise(bad_out, out, "output under a kernel that poisons dead rows")
    for name, g, g0 in zip("qkv", g_bad, g_real):
        assert_bitwise(g, g0, f"grad of {name} under a kernel that poisons dead rows")


# ----------------------------------------------------------------------------------------------------
# S7 numerically stable
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype", "backend"), HALF_PARAMS, ids=HALF_IDS)
@given(
    b=st.integers(1, 2),
    i=st.integers(1, 6),
    j=st.integers(1, 6),
    causal=st.booleans(),
    kind=st.sampled_from(["none", "key_padding", "full"]),
    data=st.data(),
)
def test_s7_large_logits_half_precision(device, dtype, backend, b, i, j, causal, kind, data):
    """Scaled logits up to |1e4| in float16/bfloat16 with gaps of >= 1000 between keys: the softmax is
    one-hot, so the output must be exactly the value of the best allowed key (dead rows 0), with
    finite gradients matching the float64 reference."""
    h, h_kv, d = 2, 1, 16
    seed = data.draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    mask, mask4d = data.draw(attention_masks(b, h, i, j, kind))
    # q = +-50 * ones, k_j = c_j * ones with distinct c_j in {-50, -45, ..., 50}: logit = +-200 * c_j
    signs = torch.randint(0, 2, (b, h, i, 1), generator=gen) * 2 - 1
    q = (50.0 * signs * torch.ones(b, h, i, d)).to(dtype)
    c = torch.stack([torch.randperm(21, generator=gen)[:j] * 5.0 - 50.0 for _ in range(b * h_kv)]).reshape(b, h_kv, j, 1)
    k = (c * torch.ones(b, h_kv, j, d)).to(dtype)
    v = torch.randn(b, h_kv, j, d, generator=gen).to(dtype)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    logits = (q.double() @ k.double().repeat_interleave(h // h_kv, 1).transpose(-1, -2)) * d**-0.5
    assert float(logits.detach().abs().max()) <= 1e4
    out = attend_on(device, backend, q, k, v, mask=None if mask is None else mask.to(device), causal=causal)
    ref = ref_attend(q, k, v, mask4d, causal=causal)
    assert_close(out, ref, "output with logits up to 1e4", dtype, table=ATTEND_TOL)
    upstream = torch.randn(b, h, i, d, generator=gen).to(device=device, dtype=dtype)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_g = grads(ref_attend(*leaves, mask4d, causal=causal), leaves, upstream.double().cpu(), missing_is_zero=True)
    gq, gk, gv = grads(out, (q, k, v), upstream)
    assert_finite(gq, "grad of q")
    assert_finite(gk, "grad of k")
    assert_close(gv, ref_g[2], "grad of v", dtype, table=ATTEND_TOL)
    # the softmax is one-hot: dq and dk are 0 up to the rounding of dO . O
    assert float(gq.abs().max()) < 0.5 and float(gk.abs().max()) < 0.5


@pytest.mark.parametrize(("device", "dtype", "backend"), HALF_PARAMS, ids=HALF_IDS)
@given(case=attention_cases(allow_empty=False, kinds=("none", "key_padding", "full", "per_head")))
def test_s7_softmax_statistics_kept_in_float32(device, dtype, backend, case):
    """Logits near 300 that differ by about 1: rounded to float16 (spacing 0.25) or bfloat16 (spacing
    2) the logits alone would move the softmax weights by 10-100 %. Computed in float32 the result is
    the exact one up to the output's own rounding: |error| <= eps(dtype) * max|output|."""
    gen = torch.Generator().manual_seed(case.seed)
    a = math.sqrt(300 / math.sqrt(case.d))  # (a * 1) . (a * 1) * d ** -0.5 == 300
    q = a + 0.1 * torch.randn(case.b, case.h, case.i, case.d, generator=gen, dtype=torch.float64)
    k = a + 0.1 * torch.randn(case.b, case.h_kv, case.j, case.d, generator=gen, dtype=torch.float64)
    v = torch.randn(case.b, case.h_kv, case.j, case.e, generator=gen, dtype=torch.float64)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    mask = None if case.mask is None else case.mask.to(device)
    out = attend_on(device, backend, q.to(device), k.to(device), v.to(device), mask=mask, causal=case.causal)
    ref = ref_attend(q, k, v, case.mask4d, causal=case.causal)
    assert_finite(out, "output")
    err = float((out.double().cpu() - ref).abs().max())
    bound = torch.finfo(dtype).eps * max(1.0, float(ref.abs().max()))
    assert err <= bound, f"error {err:.3g} > {bound:.3g}: logits or softmax statistics not kept in float32"


@pytest.mark.parametrize(("device", "dtype", "backend"), HALF_PARAMS, ids=HALF_IDS)
@given(case=attention_cases(allow_empty=False, kinds=("none", "key_padding", "full", "per_head")))
def test_s7_large_random_logits_stay_finite_and_convex(device, dtype, backend, case):
    """Random q, k scaled so the largest |logit| is about 1e4: outputs and gradients are finite, each
    output is a convex combination of the values its row may see (within rounding), dead rows 0."""
    q, k, v = case.clean(torch.float64, "cpu")
    top = float((q @ k.repeat_interleave(case.h // case.h_kv, 1).transpose(-1, -2)).abs().max()) * case.d**-0.5
    s = math.sqrt(1e4 / top) if top > 0 else 1.0
    q, k, v = ((q * s).to(dtype), (k * s).to(dtype), v.to(dtype))
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    out = attend_on(device, backend, q, k, v, mask=None if case.mask is None else case.mask.to(device),
                    causal=case.causal)
    assert_finite(out, "output")
    for name, g in zip("qkv", grads(out, (q, k, v), case.upstream(dtype, device))):
        assert_finite(g, f"grad of {name}")
    allowed = case.allowed()  # (b, h, i, j)
    vv = v.detach().double().cpu().repeat_interleave(case.h // case.h_kv, 1)[:, :, None]  # (b, h, 1, j, e)
    lo = torch.where(allowed[..., None], vv, INF).amin(-2)
    hi = torch.where(allowed[..., None], vv, -INF).amax(-2)
    o = out.detach().double().cpu()
    slack = 2 * ATTEND_TOL[dtype][0] * max(1.0, float(v.detach().abs().max()))
    alive = ~case.dead()[..., None].expand_as(o)
    assert bool(((o >= lo - slack) & (o <= hi + slack))[alive].all()), "an output left the convex hull of its values"
    assert_zero(o[~alive], "dead rows")


# ----------------------------------------------------------------------------------------------------
# S9 bad input gets a clear error
# ----------------------------------------------------------------------------------------------------


def _qkv(b=2, h=4, h_kv=2, i=3, j=5, d=8, dtype=torch.float32):
    return torch.randn(b, h, i, d, dtype=dtype), torch.randn(b, h_kv, j, d, dtype=dtype), torch.randn(b, h_kv, j, d, dtype=dtype)


BAD_INPUTS = {
    "int mask": (lambda q, k, v: dict(mask=torch.ones(2, 5, dtype=torch.int64)), TypeError, r"mask.*torch\.bool.*int64"),
    "float mask": (lambda q, k, v: dict(mask=torch.ones(2, 5)), TypeError, r"mask.*torch\.bool.*float32"),
    "uint8 mask": (lambda q, k, v: dict(mask=torch.ones(2, 5, dtype=torch.uint8)), TypeError, r"mask.*uint8"),
    "mask wrong 2-d shape": (lambda q, k, v: dict(mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"mask.*\(2, 4\)"),
    "mask (i, b)": (lambda q, k, v: dict(mask=torch.ones(3, 2, dtype=torch.bool)), ValueError, r"mask.*\(3, 2\)"),
    "mask 3-d wrong": (lambda q, k, v: dict(mask=torch.ones(1, 3, 5, dtype=torch.bool)), ValueError, r"mask.*\(b, i, j\).*\(1, 3, 5\)"),
    "mask 4-d h_kv heads": (lambda q, k, v: dict(mask=torch.ones(2, 2, 3, 5, dtype=torch.bool)), ValueError, r"mask.*\(2, 2, 3, 5\)"),
    "mask 1-d": (lambda q, k, v: dict(mask=torch.ones(5, dtype=torch.bool)), ValueError, r"mask.*\(5,\)"),
    "mask 5-d": (lambda q, k, v: dict(mask=torch.ones(1, 2, 4, 3, 5, dtype=torch.bool)), ValueError, r"mask"),
    "mask on another device": (lambda q, k, v: dict(mask=torch.ones(2, 5, dtype=torch.bool, device="meta")), ValueError, r"mask.*meta"),
    "unknown backend": (lambda q, k, v: dict(backend="triton"), ValueError, r"backend.*'triton'"),
    "efficient on cpu": (lambda q, k, v: dict(backend="efficient"), ValueError, r"efficient.*CUDA"),
    "cudnn on cpu": (lambda q, k, v: dict(backend="cudnn"), ValueError, r"cudnn.*CUDA"),
    "dropout 1": (lambda q, k, v: dict(dropout_p=1.0), ValueError, r"dropout_p"),
    "dropout negative": (lambda q, k, v: dict(dropout_p=-0.1), ValueError, r"dropout_p"),
    "scale nan": (lambda q, k, v: dict(scale=NAN), ValueError, r"scale"),
    "scale inf": (lambda q, k, v: dict(scale=INF), ValueError, r"scale"),
    "int bias": (lambda q, k, v: dict(bias=torch.zeros(1, 4, 3, 5, dtype=torch.int64)), TypeError, r"bias"),
    "bias wrong shape": (lambda q, k, v: dict(bias=torch.zeros(1, 2, 3, 5)), ValueError, r"bias.*\(1, 2, 3, 5\)"),
    "bias 5-d": (lambda q, k, v: dict(bias=torch.zeros(1, 1, 4, 3, 5)), ValueError, r"bias"),
    "bias other device": (lambda q, k, v: dict(bias=torch.zeros(1, 4, 3, 5, device="meta")), ValueError, r"bias.*meta"),
}


@pytest.mark.parametrize("what", list(BAD_INPUTS))
def test_s9_bad_input_errors(what):
    """A bad mask, bias, backend, dropout or scale raises TypeError/ValueError naming it and what it got."""
    make, exc, pattern = BAD_INPUTS[what]
    q, k, v = _qkv()
    with pytest.raises(exc, match=pattern):
        attend(q, k, v, **make(q, k, v))


BAD_TENSORS = {
    "q 3-d": (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dims.*\(4, 3, 8\)"),
    "k 5-d": (lambda q, k, v: (q, k[None], v), ValueError, r"k must have 4 dims"),
    "int q": (lambda q, k, v: (q.long(), k, v), TypeError, r"q must be a floating-point.*int64"),
    "list v": (lambda q, k, v: (q, k, v.tolist()), TypeError, r"v must be a tensor.*list"),
    "mixed dtypes": (lambda q, k, v: (q, k.half(), v), TypeError, r"dtype.*float32.*float16"),
    "batch mismatch": (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"batch"),
    "k/v length mismatch": (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, r"k and v.*\(b, h_kv, j\)"),
    "head dim mismatch": (lambda q, k, v: (q, k[..., :4], v), ValueError, r"head dim"),
    "heads not a multiple": (lambda q, k, v: (q[:, :3], k, v), ValueError, r"h=3.*h_kv=2"),
    "zero kv heads": (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, r"h_kv=0"),
}


@pytest.mark.parametrize("what", list(BAD_TENSORS))
def test_s9_bad_qkv_errors(what):
    """Wrongly shaped or typed q, k, v raise an error naming the tensor and the shape or dtype it got."""
    make, exc, pattern = BAD_TENSORS[what]
    with pytest.raises(exc, match=pattern):
        attend(*make(*_qkv()))


def test_s9_two_d_mask_is_key_padding_when_b_equals_i():
    """When b == i a 2-d mask is read as key padding (b, j), as documented, never silently as (i, j)."""
    q, k, v = _qkv(b=3, h=2, h_kv=2, i=3, j=4)
    m = torch.tensor([[True, False, False, False], [True, True, False, False], [True, True, True, True]])
    out = attend(q, k, v, mask=m, backend="reference")
    ref = ref_attend(q, k, v, m[:, None, None, :])
    assert_close(out, ref, "2-d mask read as (b, j)", torch.float32, table=ATTEND_TOL)


# ----------------------------------------------------------------------------------------------------
# plan_attention: a plain function of shapes, dtype, device and mask kind
# ----------------------------------------------------------------------------------------------------


def _plan(**overrides):
    kwargs = dict(device_type="cuda", dtype=torch.float16, head_dim=64, q_len=16, k_len=16, heads=8, kv_heads=8,
                  mask_kind="none", causal=False)
    kwargs.update(overrides)
    return plan_attention(**kwargs)


def test_plan_cuda_no_mask_half_is_flash():
    plan = _plan()
    assert isinstance(plan, AttentionPlan)
    assert (plan.path, plan.expected, plan.mask_form, plan.expand_kv) == ("sdpa", "flash", "none", False)
    assert plan.sdpa_backends[0] == "flash" and "math" in plan.sdpa_backends


def test_plan_causal_square_no_mask_is_is_causal():
    assert _plan(causal=True).mask_form == "is_causal"
    assert _plan(causal=True).expected == "flash"
    assert _plan(causal=True, device_type="cpu").mask_form == "is_causal"
    assert _plan(causal=True, q_len=4, k_len=16).mask_form == "broadcast"  # bottom-right needs a tensor
    assert _plan(causal=True, q_len=1, k_len=16).mask_form == "none"  # one query sees every key
    assert _plan(causal=True, mask_kind="padding").mask_form == "broadcast"
    assert _plan(causal=True, has_bias=True).mask_form == "bias"


def test_plan_cuda_padding_mask_is_broadcast_efficient():
    plan = _plan(mask_kind="padding")
    assert (plan.mask_form, plan.expected, plan.expand_kv) == ("broadcast", "efficient", False)
    assert "flash" not in plan.sdpa_backends


def test_plan_gqa_with_efficient_expands_kv():
    assert _plan(mask_kind="padding", kv_heads=2).expand_kv is True
    assert _plan(kv_heads=2).expand_kv is False  # flash takes enable_gqa
    assert _plan(kv_heads=2, backend="efficient").expand_kv is True
    assert _plan(kv_heads=2, backend="cudnn").expand_kv is True
    assert _plan(kv_heads=2, backend="math").expand_kv is False


def test_plan_cuda_float32_and_odd_head_dim():
    assert _plan(dtype=torch.float32).expected == "efficient"
    assert _plan(head_dim=12).expected == "math"
    assert _plan(dtype=torch.float64).expected == "math"
    with pytest.raises(ValueError, match=r"backend='flash'.*float32"):
        _plan(dtype=torch.float32, backend="flash")
    with pytest.raises(ValueError, match=r"backend='flash'.*'broadcast'"):
        _plan(mask_kind="padding", backend="flash")
    with pytest.raises(ValueError, match=r"backend='cudnn'.*head_dim 192"):
        _plan(head_dim=192, backend="cudnn")


def test_plan_cpu():
    assert _plan(device_type="cpu").expected == "flash"
    assert _plan(device_type="cpu", backend="math").sdpa_backends == ("math",)
    assert _plan(device_type="cpu", backend="reference") == AttentionPlan("reference", (), "reference", "none", True)
    for backend in ("efficient", "cudnn"):
        with pytest.raises(ValueError, match=rf"backend='{backend}' runs on CUDA only.*'cpu'"):
            _plan(device_type="cpu", backend=backend)


def test_plan_rejects_unknown_backend_and_mask_kind():
    with pytest.raises(ValueError, match=r"backend must be one of.*'xformers'"):
        _plan(backend="xformers")
    with pytest.raises(ValueError, match=r"mask_kind.*'dense'"):
        _plan(mask_kind="dense")


# ----------------------------------------------------------------------------------------------------
# What the kernel is handed
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "math", "flash"])
@pytest.mark.parametrize(("h", "h_kv"), [(4, 4), (4, 2), (3, 1)])
def test_padding_mask_never_materialized(backend, h, h_kv):
    """A (b, j) key padding mask reaches the kernel as a bool (b, 1, 1, j), not (b, h, i, j); with
    causal it is (b, 1, i, j) at most: no head dimension is ever materialized."""
    b, i, j = 3, 5, 7
    q, k, v = _qkv(b=b, h=h, h_kv=h_kv, i=i, j=j)
    mask = mask_from_lengths([7, 3, 0], j)
    rec = RecordingKernel()
    with substitute_kernel(rec):
        out = attend(q, k, v, mask=mask, backend=backend)
        out_causal = attend(q, k, v, mask=mask, causal=True, backend=backend)
    assert rec.calls[0].mask_shape == (b, 1, 1, j) and rec.calls[0].mask_dtype == torch.bool
    assert rec.calls[0].is_causal is False
    assert rec.calls[1].mask_shape == (b, 1, i, j) and rec.calls[1].mask_dtype == torch.bool
    assert rec.calls[0].k_shape == (b, h_kv, j, 8) and rec.calls[0].enable_gqa == (h != h_kv)
    assert_close(out, ref_attend(q, k, v, mask[:, None, None]), "padding output", torch.float32, table=ATTEND_TOL)
    ref_causal = ref_attend(q, k, v, mask[:, None, None], causal=True)
    assert_close(out_causal, ref_causal, "padding+causal output", torch.float32, table=ATTEND_TOL)


@pytest.mark.parametrize("backend", ["auto", "math", "flash"])
def test_causal_square_without_mask_passes_is_causal(backend):
    """causal with i == j and no mask reaches the kernel as is_causal=True with no mask tensor; i != j
    as a bottom-right (1, 1, i, j) mask; a single query as neither."""
    rec = RecordingKernel()
    with substitute_kernel(rec):
        q, k, v = _qkv(i=6, j=6)
        square = attend(q, k, v, causal=True, backend=backend)
        q2, k2, v2 = _qkv(i=3, j=6)
        rect = attend(q2, k2, v2, causal=True, backend=backend)
        q3, k3, v3 = _qkv(i=1, j=6)
        single = attend(q3, k3, v3, causal=True, backend=backend)
    assert rec.calls[0].is_causal is True and rec.calls[0].mask_shape is None
    assert rec.calls[1].is_causal is False and rec.calls[1].mask_shape == (1, 1, 3, 6)
    assert rec.calls[2].is_causal is False and rec.calls[2].mask_shape is None
    assert_close(square, ref_attend(q, k, v, causal=True), "square causal", torch.float32, table=ATTEND_TOL)
    assert_close(rect, ref_attend(q2, k2, v2, causal=True), "bottom-right causal", torch.float32, table=ATTEND_TOL)
    assert_close(single, ref_attend(q3, k3, v3), "single query", torch.float32, table=ATTEND_TOL)


def test_kernel_never_sees_a_dead_row():
    """The mask handed to the kernel lets every row see at least one key, whatever the user's mask; the
    one live row of an almost all-False mask gets exactly the value of its one key, the rest exactly 0."""
    q, k, v = _qkv(b=2, h=4, h_kv=2, i=4, j=5)
    mask = torch.zeros(2, 4, 4, 5, dtype=torch.bool)
    mask[0, 1, 2, 3] = True  # query head 1 uses key/value head 0
    rec = RecordingKernel()
    with substitute_kernel(rec):
        out = attend(q, k, v, mask=mask, causal=True, backend="math")
    assert rec.calls[0].mask_shape == (2, 4, 4, 5)
    assert rec.calls[0].rows_without_keys == 0
    dead = torch.ones(2, 4, 4, dtype=torch.bool)
    dead[0, 1, 2] = False
    assert_zero(out[dead], "dead rows")
    assert_close(out[0, 1, 2], v[0, 0, 3].double(), "the one live row", torch.float32, table=ATTEND_TOL)


# ----------------------------------------------------------------------------------------------------
# torch.compile, bias, dropout, zero-size dims
# ----------------------------------------------------------------------------------------------------


@pytest.mark.full
def test_compile_fullgraph_matches_eager():
    """attend with a mask and causal compiles with fullgraph=True (no host sync, no graph break) and
    the compiled forward and backward equal eager."""
    torch._dynamo.reset()

    def f(q, k, v, mask):
        return attend(q, k, v, mask=mask, causal=True)

    compiled = torch.compile(f, fullgraph=True)
    q, k, v = _qkv(b=3, h=4, h_kv=2, i=5, j=7)
    mask = mask_from_lengths([7, 2, 0], 7, left=True)
    k_bad = plant(k, ~mask[:, None, :].expand(3, 2, 7), NAN).requires_grad_()
    q, v = q.requires_grad_(), v.requires_grad_()
    eager = f(q, k_bad, v, mask)
    got = compiled(q, k_bad, v, mask)
    assert_close(got, eager.double(), "compiled output", torch.float32, table=ATTEND_TOL)
    assert_zero(got[2], "fully padded sample")
    up = torch.randn_like(eager)
    compiled_grads = torch.autograd.grad(got, (q, k_bad, v), up)  # compiled backward: no retain_graph
    for name, g, g0 in zip("qkv", compiled_grads, grads(eager, (q, k_bad, v), up)):
        assert_close(g, g0.double(), f"compiled grad of {name}", torch.float32, table=ATTEND_TOL)


@pytest.mark.parametrize(("device", "backend"), F32_BACKENDS, ids=F32_BACKEND_IDS)
@given(case=attention_cases(allow_empty=False, kinds=("none", "key_padding", "full", "per_head")),
       bias_batch=st.booleans())
def test_bias_nan_at_masked_positions_does_not_leak(device, backend, case, bias_batch):
    """An additive bias with NaN/inf wherever the combined mask is False (and in dead rows) gives the
    same output as a clean bias, matches the float64 reference, and its gradient there is exactly 0."""
    dtype = torch.float32
    gen = torch.Generator().manual_seed(case.seed + 7)
    bias_clean = torch.randn(case.b if bias_batch else 1, case.h, case.i, case.j, generator=gen)
    not_allowed = ~case.allowed()  # (b, h, i, j)
    if not bias_batch:
        not_allowed = not_allowed.all(dim=0, keepdim=True)
    bias_bad = bias_clean.masked_fill(not_allowed, case.planted)
    trainable = not (device == "cpu" and backend == "flash")  # CPU flash takes no mask gradient
    bias_bad = bias_bad.to(device).requires_grad_(trainable)
    q, k, v = case.inputs(dtype, device)
    mask = None if case.mask is None else case.mask.to(device)
    out = attend_on(device, backend, q, k, v, mask=mask, causal=case.causal, bias=bias_bad)
    bias_clean = bias_clean.to(device).requires_grad_(trainable)  # same autograd needs: same kernel
    out_clean = attend_on(device, backend, q, k, v, mask=mask, causal=case.causal, bias=bias_clean)
    assert_bitwise(out, out_clean, "output with garbage bias at masked positions")
    ref, _ = reference(case, q, k, v, bias=bias_clean.detach())
    assert_close(out, ref, "output with bias", dtype, table=ATTEND_TOL)
    if trainable:
        (g_bias,) = grads(out, (bias_bad,), case.upstream(dtype, device))
        assert_finite(g_bias, "grad of bias")
        assert_zero(g_bias[not_allowed.to(device)], "grad of bias at masked positions")


def test_trainable_bias_on_cpu_flash_is_a_clear_error():
    """CPU flash cannot return a mask gradient: asking for it is a ValueError that names the way out."""
    q, k, v = _qkv()
    bias = torch.zeros(1, 4, 3, 5, requires_grad=True)
    with pytest.raises(ValueError, match=r"\['flash'\] refused.*'auto' or 'math'"):
        attend(q, k, v, bias=bias, backend="flash")


@pytest.mark.parametrize(("device", "backend"), [p for p in F32_BACKENDS if p != ("cpu", "flash")],
                         ids=[i for p, i in zip(F32_BACKENDS, F32_BACKEND_IDS) if p != ("cpu", "flash")])
@given(case=attention_cases(allow_empty=False, kinds=("key_padding", "full", "per_head", "query_padding")))
def test_dropout_finite_dead_rows_zero(device, backend, case):
    """With dropout_p > 0: finite output and gradients, dead rows exactly 0 passing zero gradient,
    masked keys exactly zero gradient, and dropout does act on live rows."""
    torch.manual_seed(case.seed)
    out, inputs = run(case, torch.float32, device, backend, dropout_p=0.5)
    assert_finite(out, "output with dropout")
    dead = expand_rows(case.dead(), case.e).to(device)
    assert_zero(out[dead], "dead rows with dropout")
    gq, gk, gv = grads(out, inputs, case.upstream(torch.float32, device))
    for name, g in (("q", gq), ("k", gk), ("v", gv)):
        assert_finite(g, f"grad of {name} with dropout")
    masked = case.masked_keys().to(device)
    assert_zero(gk[masked], "grad of k at masked keys with dropout")
    assert_zero(gv[masked], "grad of v at masked keys with dropout")
    out_dead_only = grads(out, inputs, case.upstream(torch.float32, device) * dead)
    for name, g in zip("qkv", out_dead_only):
        assert_zero(g, f"grad of {name} from dead rows with dropout")


@pytest.mark.parametrize("backend", ["auto", "reference", "math"])
def test_dropout_is_unbiased(backend):
    """Dropout keeps the expectation: the mean over many samples of one problem is the dropout-free output."""
    torch.manual_seed(3)
    n, h, i, j, d = 4096, 2, 3, 4, 8
    q1, k1, v1 = torch.randn(1, h, i, d), torch.randn(1, h, j, d), torch.randn(1, h, j, d)
    mask = torch.tensor([[True, True, True, False]])
    expected = attend(q1, k1, v1, mask=mask, backend=backend)
    rep = lambda t: t.expand(n, *t.shape[1:])
    out = attend(rep(q1), rep(k1), rep(v1), mask=rep(mask), dropout_p=0.3, backend=backend)
    assert not torch.equal(out[0], expected[0])  # dropout acted
    assert_finite(out, "output with dropout")
    err = (out.mean(0) - expected[0]).abs().max()
    assert float(err) < 0.08, f"mean over {n} dropout samples is off by {float(err)}"


@pytest.mark.parametrize(("device", "backend"), F32_BACKENDS, ids=F32_BACKEND_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("b", "i", "j"), [(0, 4, 5), (2, 0, 5), (2, 4, 0), (0, 0, 0), (2, 0, 0)])
def test_zero_size_dims(device, backend, causal, b, i, j):
    """b == 0, i == 0 or j == 0 work, with and without a mask: the output has the right shape and is 0
    when there are no keys, and q, v get finite (zero) gradients."""
    for mask in (None, torch.ones(b, j, dtype=torch.bool)):
        q, k, v = (t.to(device).requires_grad_() for t in _qkv(b=b, h=4, h_kv=2, i=i, j=j))
        out = attend(q, k, v, mask=None if mask is None else mask.to(device), causal=causal, backend=backend)
        assert out.shape == (b, 4, i, 8) and out.dtype == torch.float32
        if j == 0:
            assert_zero(out, "output with no keys")
        else:
            assert_finite(out, "output")
        if b * i == 0:
            continue
        gq, gv = torch.autograd.grad(out, (q, v), torch.ones_like(out))
        assert_zero(gq, "grad of q with no keys")
        assert gv.shape == v.shape


@pytest.mark.parametrize("backend", ["auto", "reference", "math", "flash"])
def test_s1_zero_length_context_queries_pass_zero_gradient(backend):
    """A zero-length context (j == 0, e.g. an empty cross-attention context): exactly 0 out, and NaN in
    the queries still gives exactly zero gradient into them."""
    q = torch.full((2, 4, 3, 8), NAN).requires_grad_()
    k, v = torch.randn(2, 2, 0, 8, requires_grad=True), torch.randn(2, 2, 0, 8, requires_grad=True)
    with torch.autograd.detect_anomaly():
        out = attend(q, k, v, mask=torch.ones(2, 0, dtype=torch.bool), backend=backend)
        (gq,) = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert_zero(out, "output with no keys")
    assert_zero(gq, "grad of q with no keys")


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_s1_zero_length_context_gradient_reaches_k(backend):
    """With j == 0 every input, k included, gets a (zero) gradient: a key projection fed by an empty
    context must not drop out of the graph (DDP would report it as an unused parameter)."""
    q = torch.randn(2, 4, 3, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 0, 8, requires_grad=True), torch.randn(2, 2, 0, 8, requires_grad=True)
    out = attend(q, k, v, backend=backend)
    gq, gk, gv = grads(out, (q, k, v), torch.ones_like(out))
    assert gk.shape == k.shape and gv.shape == v.shape
    assert_zero(gq, "grad of q")


@pytest.mark.parametrize("dtype", dtypes_for("cpu"), ids=str)
def test_scale_argument(dtype):
    """An explicit scale is used in place of d ** -0.5, on every backend."""
    q, k, v = _qkv(dtype=dtype)
    mask = mask_from_lengths([5, 2], 5)
    ref = ref_attend(q, k, v, mask[:, None, None], scale=0.7)
    for backend in backends_for("cpu"):
        out = attend(q, k, v, mask=mask, scale=0.7, backend=backend)
        assert_close(out, ref, f"{backend} with scale=0.7", dtype, table=ATTEND_TOL)
    default = attend(q, k, v, mask=mask)
    assert_close(default, ref_attend(q, k, v, mask[:, None, None]), "default scale", dtype, table=ATTEND_TOL)


def test_s2_fully_masked_sample_passes_no_gradient_through_attend():
    """A sample whose context is fully padded: exactly 0 output and exactly 0 gradient into its q, k, v,
    with NaN in all of its k and v (a kernel given a NaN V would return NaN)."""
    q, k, v = _qkv(b=2, h=2, h_kv=2, i=3, j=4)
    mask = torch.tensor([[True, True, False, True], [False, False, False, False]])
    second = torch.zeros(2, 2, 4, dtype=torch.bool)  # (b, h_kv, j)
    second[1] = True
    k, v, q = plant(k, second, NAN).requires_grad_(), plant(v, second, INF).requires_grad_(), q.requires_grad_()
    with torch.autograd.detect_anomaly():
        out = attend(q, k, v, mask=mask)
        gq, gk, gv = grads(out, (q, k, v), torch.randn_like(out))
    assert_zero(out[1], "fully padded sample")
    for name, g in (("q", gq), ("k", gk), ("v", gv)):
        assert_zero(g[1], f"grad of {name} in the fully padded sample")
        assert_finite(g, f"grad of {name}")
    assert_zero(gk[0, :, 2], "grad of k at the padded key")
    assert_close(out[:1], ref_attend(q[:1], k[:1], v[:1], mask[:1, None, None]), "live sample", torch.float32, table=ATTEND_TOL)


def test_dead_rows_left_padding_causal():
    """Left padding + causal self-attention: the padded queries are dead rows (exactly 0), the real ones
    match each sample alone."""
    n = 5
    lengths = [5, 3, 1]
    mask = mask_from_lengths(lengths, n, left=True)
    q, k, v = _qkv(b=3, h=2, h_kv=1, i=n, j=n)
    out = attend(q, k, v, mask=mask, causal=True)
    for s, length in enumerate(lengths):
        assert_zero(out[s, :, : n - length], f"left padding rows of sample {s}")
        alone = ref_attend(q[s : s + 1, :, n - length :], k[s : s + 1, :, n - length :],
                                      v[s : s + 1, :, n - length :], causal=True)
        assert_close(out[s : s + 1, :, n - length :], alone, f"sample {s}", torch.float32, table=ATTEND_TOL)




@pytest.mark.parametrize("backend", ["auto", "reference", "math", "flash"])
def test_prepared_mask_equals_plain_mask(backend):
    """A PreparedMask (what a stack builds once for all its layers) gives bit-for-bit the outputs and
    gradients of the same bool mask, dead rows exactly 0; causal=True beside it is refused."""
    g = torch.Generator().manual_seed(3)
    b, h, n, d = 3, 4, 9, 8
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[0, :4] = False  # left padding: rows 0-3 dead under causal
    pad[2] = False  # a fully padded sample
    mask = pad[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    qkv = [torch.randn(b, h, n, d, generator=g, requires_grad=True) for _ in range(3)]
    out_plain = attend(*qkv, mask=mask, backend=backend)
    grads_plain = torch.autograd.grad(out_plain.sum(), qkv)
    prepared = sf.testing.prepare_mask(mask)
    out_prep = attend(*qkv, mask=prepared, backend=backend)
    grads_prep = torch.autograd.grad(out_prep.sum(), qkv)
    assert_close(out_prep, out_plain.double(), "prepared vs plain mask", torch.float32, table=ATTEND_TOL)
    for a, e in zip(grads_prep, grads_plain):
        assert_close(a, e.double(), "grad, prepared vs plain mask", torch.float32, table=ATTEND_TOL)
    assert_zero(out_prep[2], "fully padded sample")
    assert_zero(out_prep[0, :, :4], "dead rows of the left-padded sample")
    with pytest.raises(ValueError, match="causal"):
        attend(*qkv, mask=prepared, causal=True)
    with pytest.raises(TypeError, match="bool"):
        sf.testing.prepare_mask(mask.float())


# ----------------------------------------------------------------------------------------------------
# The lean CPU paths: no selected copies where nothing needs selecting
# ----------------------------------------------------------------------------------------------------

ATTEND_MODULE = __import__("sys").modules["safeformer.core.attend"]  # the module (``safeformer.core.attend`` is the function)
MODERATE = 1e3  # finite garbage: the lean paths keep it (a weight of exactly 0); HUGE overflows a logit
HUGE = 1e30


def _spy(name: str):
    """Wrap ``safeformer.core.attend.<name>``; returns (calls list of results, restore function)."""
    real = getattr(ATTEND_MODULE, name)
    calls = []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out)
        return out

    setattr(ATTEND_MODULE, name, spy)
    return calls, lambda: setattr(ATTEND_MODULE, name, real)


def _lean_case(b, h, h_kv, i, j, dtype, value, *, dead_sample=True, seed=0):
    """Left-padded keys (the last sample fully padded when ``dead_sample``: all its rows dead), ``value``
    planted at dead rows of q, masked keys of k (negated) and v. Returns (q, k, v, mask (b, j), dead (b, h, i),
    masked (b, h_kv, j))."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, j + 1, (b,), generator=g).tolist()
    if dead_sample:
        lengths[-1] = 0
    mask = mask_from_lengths(lengths, j, left=True)
    dead = (~mask.any(-1))[:, None, None].expand(b, h, i)
    masked = (~mask)[:, None, :].expand(b, h_kv, j)
    q = plant(torch.randn(b, h, i, 8, generator=g).to(dtype), dead, value)
    k = plant(torch.randn(b, h_kv, j, 8, generator=g).to(dtype), masked, -value)
    v = plant(torch.randn(b, h_kv, j, 8, generator=g).to(dtype), masked, value)
    return q, k, v, mask, dead, masked


@contextlib.contextmanager
def _generic_path():
    """attend with its lean paths off: select copies, then the kernel (the path they must equal)."""
    old = ATTEND_MODULE._FUSED_SELECT
    ATTEND_MODULE._FUSED_SELECT = False
    try:
        yield
    finally:
        ATTEND_MODULE._FUSED_SELECT = old


@pytest.mark.parametrize("value", [MODERATE, HUGE, NAN, INF, -INF], ids=["moderate", "huge", "nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize(("b", "h", "h_kv", "i", "j"), [(3, 4, 4, 1, 9), (4, 4, 2, 1, 64), (1, 2, 1, 1, 1), (3, 2, 2, 6, 11)])
def test_lean_no_grad_forward_is_safe_and_exact(b, h, h_kv, i, j, dtype, value):
    """A forward with no gradient on the CPU (a decode step at i = 1): the kernel runs on q, k, v as given;
    with finite garbage at dead rows and masked keys the output is accepted (the lean path), bit for bit
    the selecting path's and close to the float64 reference, dead rows exactly 0; with NaN, inf or a
    logit that overflows, the check sees it and the selecting path runs: the same result."""
    q, k, v, mask, dead, _ = _lean_case(b, h, h_kv, i, j, dtype, value)
    calls, restore = _spy("_optimistic")
    try:
        with torch.no_grad():
            out = attend(q, k, v, mask=mask)
            out_causal = attend(q, k, v, mask=mask, causal=True) if i == 1 else out
    finally:
        restore()
    assert calls, "the no-gradient CPU path did not run"
    lean_taken = calls[0] is not None
    # finite garbage (a huge one too: its logit is -inf once masked) leaves live rows finite; NaN or inf in a
    # masked value makes them NaN (0 * inf); with no live row at all there is nothing to leak into
    expected = value in (MODERATE, HUGE) or bool(dead.all())
    assert lean_taken == expected, f"the lean output was {'accepted' if lean_taken else 'refused'} with {value} planted"
    with _generic_path(), torch.no_grad():
        generic = attend(q, k, v, mask=mask)
    assert_bitwise(out, generic, "lean output vs the selecting path")
    assert_bitwise(out_causal, generic, "a single query with causal=True")
    assert_zero(out[dead], "dead rows")
    ref = ref_attend(q, k, v, mask[:, None, None, :])
    assert_close(out, ref, "lean output vs float64", dtype, table=ATTEND_TOL)


@pytest.mark.parametrize("vouched", [False, True], ids=["mask", "selected-mask"])
def test_key_padding_quick_path_is_chosen_where_expected(vouched):
    """The quick path for a (b, j) key padding mask runs for a no-gradient CPU call (causal allowed at one
    query), and leaves everything else to the general code; its plan is plan_attention's."""
    q, k, v, mask, _, _ = _lean_case(3, 4, 2, 1, 16, torch.float32, 1.0)
    wrap = ATTEND_MODULE.SelectedMask if vouched else (lambda m: m)
    calls, restore = _spy("_key_padding_call")
    try:
        def taken(fn) -> bool:
            calls.clear()
            fn()
            return bool(calls) and calls[-1] is not None

        with torch.no_grad():
            assert taken(lambda: attend(q, k, v, mask=wrap(mask)))
            assert taken(lambda: attend(q, k, v, mask=wrap(mask), causal=True))
            assert not taken(lambda: attend(q, k, v, mask=wrap(mask), backend="math"))
            assert not taken(lambda: attend(q, k, v, mask=wrap(mask), scale=0.3))
            assert not taken(lambda: attend(q, k, v, mask=wrap(mask[:, None, None, :])))
            q6 = torch.randn(3, 4, 6, 8)
            assert not taken(lambda: attend(q6, k, v, mask=wrap(mask), causal=True))
            assert not taken(lambda: attend(q, k, v, mask=wrap(mask), bias=torch.zeros(1, 1, 1, 16)))
            with substitute_kernel(faithful_kernel()):
                assert not taken(lambda: attend(q, k, v, mask=wrap(mask)))
        qg = q.clone().requires_grad_()
        assert not taken(lambda: attend(qg, k, v, mask=wrap(mask)))
    finally:
        restore()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for heads, kv_heads in ((4, 4), (4, 2)):
            for causal, i in ((False, 1), (True, 1), (False, 7)):
                plan = plan_attention(device_type="cpu", dtype=dtype, head_dim=8, q_len=i, k_len=16, heads=heads,
                                      kv_heads=kv_heads, mask_kind="padding", causal=causal)
                assert plan == ATTEND_MODULE._CPU_PADDING_PLAN, plan


def test_unmasked_quick_path_is_chosen_where_expected_and_exact():
    """The quick path for an unmasked no-gradient CPU call (causal allowed at one query): chosen there only,
    bit for bit the general code's output (forced through it with a scale of d ** -0.5, which the quick
    path passes too), close to float64; its plan is plan_attention's."""
    g = torch.Generator().manual_seed(3)
    calls, restore = _spy("_unmasked_call")
    try:
        def taken(fn) -> bool:
            calls.clear()
            fn()
            return bool(calls) and calls[-1] is not None

        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            for heads, kv_heads, i in ((4, 4, 1), (4, 2, 1), (4, 2, 5)):
                q = torch.randn(2, heads, i, 8, generator=g).to(dtype)
                k, v = (torch.randn(2, kv_heads, 9, 8, generator=g).to(dtype) for _ in range(2))
                with torch.no_grad():
                    assert taken(lambda q=q, k=k, v=v: attend(q, k, v))
                    quick = attend(q, k, v)
                    assert not taken(lambda q=q, k=k, v=v: attend(q, k, v, scale=8 ** -0.5))
                    general = attend(q, k, v, scale=8 ** -0.5)
                    assert taken(lambda q=q, k=k, v=v: attend(q, k, v, causal=True)) == (i == 1)
                    assert not taken(lambda q=q, k=k, v=v: attend(q, k, v, backend="math"))
                    with substitute_kernel(faithful_kernel()):
                        assert not taken(lambda q=q, k=k, v=v: attend(q, k, v))
                assert_bitwise(quick, general, f"unmasked quick path {dtype}")
                assert_close(quick.double(), ref_attend(q.double(), k.double(), v.double()), "unmasked quick path",
                             dtype, table=ATTEND_TOL)
                kept = q.clone().requires_grad_()
                assert not taken(lambda kept=kept, k=k, v=v: attend(kept, k, v))
                plan = plan_attention(device_type="cpu", dtype=dtype, head_dim=8, q_len=i, k_len=9, heads=heads,
                                      kv_heads=kv_heads, mask_kind="none", causal=False)
                assert plan == ATTEND_MODULE._CPU_UNMASKED_PLAN, plan
    finally:
        restore()


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_lean_no_grad_forward_kernel_not_trusted(value):
    """S6 on the lean no-gradient path (forced onto a substituted kernel): a kernel that poisons every
    truly dead row gives bit for bit the faithful kernel's output, dead rows exactly 0."""
    q, k, v, mask, dead, _ = _lean_case(4, 4, 2, 1, 12, torch.float32, MODERATE)
    old = ATTEND_MODULE._OPTIMISTIC_ANY_KERNEL
    ATTEND_MODULE._OPTIMISTIC_ANY_KERNEL = True
    calls, restore = _spy("_optimistic")
    try:
        with torch.no_grad():
            with substitute_kernel(faithful_kernel()):
                good = attend(q, k, v, mask=mask)
            with substitute_kernel(NaNKernel(dead, value=value)) as _:
                bad = attend(q, k, v, mask=mask)
    finally:
        restore()
        ATTEND_MODULE._OPTIMISTIC_ANY_KERNEL = old
    assert len(calls) == 2 and all(c is not None for c in calls), "the lean path did not run"
    assert_bitwise(bad, good, "output under a kernel that poisons dead rows")
    assert_zero(bad[dead], "dead rows")


@pytest.mark.parametrize(("value", "upstream_value"), [(MODERATE, MODERATE), (MODERATE, NAN), (HUGE, MODERATE),
                                                       (NAN, MODERATE), (-INF, MODERATE)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("h", "h_kv", "i", "j", "causal"), [(4, 4, 1, 9, False), (4, 2, 7, 7, False),
                                                             (4, 1, 5, 9, True), (2, 2, 16, 16, True)])
def test_bounded_fused_path_forward_backward(h, h_kv, i, j, causal, dtype, value, upstream_value):
    """With a gradient on the CPU flash kernel: when the norms of q, k, v (and of the incoming gradient)
    bound every product, the kernel runs on them as given (no selected copies), forward and backward;
    otherwise it selects copies. Either way: bit for bit the selecting path, close to the float64
    reference, dead rows exactly 0 with zero gradients, masked keys exactly zero gradients; garbage
    (finite, huge, NaN, inf) at dead rows, masked keys and in the upstream gradient at dead rows."""
    q, k, v, mask, dead, masked = _lean_case(3, h, h_kv, i, j, dtype, value, seed=i + j)
    if causal:  # left padding + causal: the first rows of a sample see only padding (dead too)
        allowed = mask[:, None, None, :] & torch.ones(i, j, dtype=torch.bool).tril(j - i)
        dead = (~allowed.any(-1)).expand(3, h, i)
        masked = (~allowed.any(-2).squeeze(1))[:, None, :].expand(3, h_kv, j)
        q = plant(q, dead, value)
        k, v = plant(k, masked, -value), plant(v, masked, value)
    g = torch.Generator().manual_seed(7)
    upstream = plant(torch.randn(3, h, i, 8, generator=g).to(dtype), dead, upstream_value)
    bounded, restore = _spy("_bounded")
    grad_ok, restore2 = _spy("_grad_bounded")
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, mask=mask, causal=causal)
        out.backward(upstream)
    finally:
        restore()
        restore2()
    assert len(bounded) == 1, "the fused CPU flash path did not run"
    # float64 bounds a product of two huge (1e30) numbers too: no overflow, a weight of exactly 0
    expected = value == MODERATE or (value == HUGE and dtype == torch.float64)
    assert (bounded[0] is not None) == expected, f"bounded={bounded[0]} with {value} planted"
    if bounded[0] is not None:
        assert grad_ok == [upstream_value == MODERATE]  # NaN in the upstream gradient: the selecting backward
    with _generic_path():
        gleaves = [t.clone().requires_grad_() for t in (q, k, v)]
        gout = attend(*gleaves, mask=mask, causal=causal)
        gout.backward(upstream)
    assert_bitwise(out, gout, "output vs the selecting path")
    for name, a, b_ in zip("qkv", leaves, gleaves):
        assert_bitwise(a.grad, b_.grad, f"grad of {name} vs the selecting path")
    assert_zero(out[dead], "dead rows")
    assert_zero(leaves[0].grad[dead], "grad of q at dead rows")
    assert_zero(leaves[1].grad[masked], "grad of k at masked keys")
    assert_zero(leaves[2].grad[masked], "grad of v at masked keys")
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attend(*ref_leaves, mask[:, None, None, :], causal=causal)
    ref.backward(upstream.double().nan_to_num(0.0) * ~dead[..., None])
    assert_close(out, ref, "output vs float64", dtype, table=ATTEND_TOL)
    for name, a, r in zip("qkv", leaves, ref_leaves):
        assert_close(a.grad, r.grad, f"grad of {name} vs float64", dtype, table=ATTEND_TOL)
