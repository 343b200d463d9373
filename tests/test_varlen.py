"""``safeformer.core.varlen``: the plan (``plan_varlen``), the packed self-attention (``varlen_attention``) on
every path (the per-segment reference; a substituted CPU kernel with ``varlen_attn``'s signature, which
checks the calling convention; PyTorch's real varlen Flash kernel on a CUDA machine), empty segments kept
away from every kernel (S1, S6), and clear errors (S9). Every result is compared with a float64
reference computed per segment (``helpers.ref_attend``), with dtype-tied tolerances.

Shape legend: T packed tokens, b segments, h query heads, h_kv key/value heads, d head dim.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ATTEND_TOL, DEVICES, NAN, assert_close, assert_finite, assert_zero, grads, ref_attend
from hypothesis import given
from hypothesis import strategies as st

import safeformer as sf
import safeformer.core.varlen as varlen_mod
from safeformer import attend
from safeformer.core.varlen import (
    VarlenLayout,
    VarlenPlan,
    plan_varlen,
    substitute_varlen_kernel,
    varlen_attention,
    varlen_kernel_available,
    varlen_layout,
)

HALF = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_PLAN = VarlenPlan("varlen", "forced by the test: the substituted kernel runs")
REAL_KERNEL = torch.cuda.is_available() and varlen_kernel_available("cuda")
needs_real_kernel = pytest.mark.skipif(not REAL_KERNEL, reason="needs CUDA with PyTorch's varlen Flash kernel (sm80+)")


# ----------------------------------------------------------------------------------------------------
# helpers: inputs, the float64 reference, a CPU kernel with varlen_attn's signature
# ----------------------------------------------------------------------------------------------------


def make_inputs(lengths, h, hkv, d, dtype, device="cpu", seed=0, magnitude=1.0):
    """Leaf q ``(T, h, d)``, k, v ``(T, h_kv, d)`` in ``dtype``, and an upstream gradient ``(T, h, d)``."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = (torch.randn(T, h, d, generator=g) * magnitude).to(dtype).to(device).requires_grad_()
    k = (torch.randn(T, hkv, d, generator=g) * magnitude).to(dtype).to(device).requires_grad_()
    v = torch.randn(T, hkv, d, generator=g).to(dtype).to(device).requires_grad_()
    up = torch.randn(T, h, d, generator=g).to(dtype).to(device)
    return q, k, v, up


def reference64(q, k, v, lengths, causal, scale=None):
    """Per-segment float64 attention in the plainest code (one query row at a time), on the CPU."""
    outs, start = [], 0
    h, d = q.shape[1], q.shape[2]
    for n in lengths:
        if n == 0:
            continue
        seg = [t[start:start + n].double().cpu().transpose(0, 1)[None] for t in (q, k, v)]  # (1, h|h_kv, n, d)
        outs.append(ref_attend(*seg, scale=scale, causal=causal)[0].transpose(0, 1))  # (n, h, d)
        start += n
    return torch.cat(outs) if outs else torch.zeros(0, h, d, dtype=torch.float64)


def check_against_reference(out, inputs, up, lengths, causal, dtype, scale=None, what=""):
    """``out`` and the gradients of ``(out * up).sum()`` equal the float64 reference within ``ATTEND_TOL[dtype]``."""
    q, k, v = inputs
    leaves64 = [t.detach().double().cpu().requires_grad_() for t in inputs]
    ref = reference64(*leaves64, lengths, causal, scale)
    assert_close(out, ref, f"{what} output", dtype, table=ATTEND_TOL)
    got = grads(out, [q, k, v], up)
    want = grads(ref, leaves64, up.double().cpu(), missing_is_zero=True)  # no segment: a constant reference
    for name, a, e in zip("qkv", got, want):
        assert_close(a, e, f"{what} grad {name}", dtype, table=ATTEND_TOL)


class _Poison(torch.autograd.Function):
    """Writes NaN into ``rows`` of x in the forward and into ``rows`` of the gradient in the backward."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        return x.index_fill(0, rows, NAN)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_fill(0, rows, NAN), None


def cpu_varlen_kernel(calls: list | None = None, *, poison_empty: bool = False):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` (same signature) in plain torch ops.

    It checks what the real kernel's C++ checks (flash_api.cpp mha_varlen_fwd: int32 contiguous
    cu_seqlens of one length, q/k/v with a contiguous last dim, heads that divide, GQA only with
    ``enable_gqa`` as varlen_attn itself checks), records each call in ``calls``, and computes per-segment
    attention in float32 (float64 for float64), causal for ``window_size == (-1, 0)``.

    With ``poison_empty`` it misbehaves on purpose (S6) when handed a zero-length segment: it writes NaN
    into the output row where that segment starts (the first token of the next segment; the last token
    for an empty segment at the end) and into dq, dk, dv at that row in the backward.
    """

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32, "cu_seqlens must be int32"
        assert cu_seq_q.is_contiguous() and cu_seq_q.shape == cu_seq_k.shape and cu_seq_q.device == query.device
        assert all(t.stride(-1) == 1 for t in (query, key, value)), "Flash needs a contiguous last dim"
        assert cu_seq_q.numel() >= 2, "Flash: batch size must be positive"
        hq, hk = query.shape[1], key.shape[1]
        if not enable_gqa and hq != hk:
            raise ValueError(f"Expect query and key/value to have the same number of heads, got {hq} and {hk}")
        cu = cu_seq_q.tolist()
        if calls is not None:
            calls.append({"cu_q": cu, "cu_k": cu_seq_k.tolist(), "max_q": max_q, "max_k": max_k, "scale": scale,
                          "window_size": window_size, "enable_gqa": enable_gqa, "T": query.shape[0],
                          "heads": (hq, hk), "dtype": query.dtype})
        T = query.shape[0]
        bad = [min(cu[s], T - 1) for s in range(len(cu) - 1) if cu[s] == cu[s + 1] and T > 0]
        rows = torch.tensor(sorted(set(bad)), dtype=torch.long, device=query.device)
        if poison_empty and bad:
            query, key, value = (_Poison.apply(t, rows) for t in (query, key, value))
        dtype = torch.promote_types(query.dtype, torch.float32)
        causal = window_size == (-1, 0)
        out = []
        for s in range(len(cu) - 1):
            a, b = cu[s], cu[s + 1]
            if a == b:
                continue
            qs = query[a:b].to(dtype).transpose(0, 1)  # (h, n, d)
            ks = key[a:b].to(dtype).transpose(0, 1).repeat_interleave(hq // hk, dim=0)
            vs = value[a:b].to(dtype).transpose(0, 1).repeat_interleave(hq // hk, dim=0)
            logits = qs @ ks.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
            if causal:
                logits = logits.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool, device=query.device).tril(), -torch.inf)
            out.append((logits.softmax(-1) @ vs).transpose(0, 1))
        out = torch.cat(out).to(query.dtype) if out else query.new_zeros(0, hq, query.shape[-1])
        if poison_empty and bad:
            out = _Poison.apply(out, rows)
        return out

    return kernel


# ----------------------------------------------------------------------------------------------------
# plan_varlen: a table of cases
# ----------------------------------------------------------------------------------------------------

BASE = dict(device_type="cuda", dtype=torch.bfloat16, head_dim=64, heads=8, kv_heads=8, causal=True,
            has_bias=False, dropout_p=0.0, backend="auto", kernel_available=True)
PLAN_TABLE = [
    ("cuda-bf16-d64-causal", {}, "varlen", "Flash varlen"),
    ("cuda-fp16-d128-bidirectional", dict(dtype=torch.float16, head_dim=128, causal=False), "varlen", "Flash varlen"),
    ("cuda-bf16-d256", dict(head_dim=256), "varlen", "Flash varlen"),
    ("cuda-bf16-d8", dict(head_dim=8), "varlen", "Flash varlen"),
    ("cuda-gqa", dict(heads=8, kv_heads=2), "varlen", "Flash varlen"),
    ("cuda-backend-flash", dict(backend="flash"), "varlen", "Flash varlen"),
    ("cpu", dict(device_type="cpu"), "padded", "CUDA only"),
    ("mps", dict(device_type="mps"), "padded", "CUDA only"),
    ("cuda-float32", dict(dtype=torch.float32), "padded", "float16 and bfloat16"),
    ("cuda-float64", dict(dtype=torch.float64), "padded", "float16 and bfloat16"),
    ("cuda-alibi-bias", dict(has_bias=True), "padded", "bias"),
    ("cuda-dropout", dict(dropout_p=0.1), "padded", "dropout"),
    ("cuda-head-dim-too-large", dict(head_dim=320), "padded", "at most 256"),
    ("cuda-head-dim-not-multiple-of-8", dict(head_dim=60), "padded", "multiple of 8"),
    ("cuda-backend-math", dict(backend="math"), "padded", "backend='math'"),
    ("cuda-backend-reference", dict(backend="reference"), "padded", "backend='reference'"),
    ("cuda-backend-efficient", dict(backend="efficient"), "padded", "backend='efficient'"),
    ("cuda-backend-cudnn", dict(backend="cudnn"), "padded", "backend='cudnn'"),
    ("cuda-no-kernel", dict(kernel_available=False), "padded", "no varlen kernel"),
]


@pytest.mark.parametrize("name,change,path,reason", PLAN_TABLE, ids=[row[0] for row in PLAN_TABLE])
def test_plan_varlen_table(name, change, path, reason):
    plan = plan_varlen(**{**BASE, **change})
    assert plan.path == path, f"{name}: {plan}"
    assert reason in plan.reason, f"{name}: reason {plan.reason!r} does not say {reason!r}"


@pytest.mark.parametrize("causal,window", [(True, (-1, 0)), (False, (-1, -1))])
@pytest.mark.parametrize("heads,kv_heads,gqa", [(8, 8, False), (8, 2, True), (4, 1, True)])
def test_plan_varlen_calling_convention(causal, window, heads, kv_heads, gqa):
    plan = plan_varlen(**{**BASE, "causal": causal, "heads": heads, "kv_heads": kv_heads})
    assert (plan.path, plan.window_size, plan.enable_gqa) == ("varlen", window, gqa)
    assert isinstance(plan.window_size, tuple)  # varlen_attn tests `window_size == (-1, 0)`: a list is not causal


def test_plan_varlen_asks_the_machine_only_when_every_other_rule_allows(monkeypatch):
    asked = []
    monkeypatch.setattr(varlen_mod, "varlen_kernel_available", lambda *a: asked.append(a) or False)
    assert plan_varlen(**{**BASE, "device_type": "cpu", "kernel_available": None}).path == "padded"
    assert plan_varlen(**{**BASE, "dtype": torch.float32, "kernel_available": None}).path == "padded"
    assert asked == []
    plan = plan_varlen(**{**BASE, "kernel_available": None})
    assert asked and plan.path == "padded" and "no varlen kernel" in plan.reason


def test_varlen_kernel_available_on_this_machine():
    assert not varlen_kernel_available("cpu")
    if not torch.cuda.is_available():
        assert not varlen_kernel_available()
        assert plan_varlen(**{**BASE, "kernel_available": None}).path == "padded"


@pytest.mark.parametrize("change,exc,text", [
    (dict(backend="fast"), ValueError, "backend"),
    (dict(heads=6, kv_heads=4), ValueError, "kv_heads"),
    (dict(head_dim=0), ValueError, "head_dim"),
    (dict(kv_heads=True), ValueError, "kv_heads"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
], ids=["backend", "heads", "head_dim", "bool-kv-heads", "dropout-1", "dropout-negative"])
def test_plan_varlen_rejects_bad_arguments(change, exc, text):
    with pytest.raises(exc, match=text):
        plan_varlen(**{**BASE, **change})


# ----------------------------------------------------------------------------------------------------
# varlen_attention against the float64 reference: reference path and substituted kernel path
# ----------------------------------------------------------------------------------------------------

PATHS = ("reference", "kernel")


@st.composite
def segments(draw):
    lengths = draw(st.lists(st.integers(0, 6), min_size=0, max_size=5))
    hkv = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([8, 16]))
    causal = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.3]))
    return lengths, hkv * g, hkv, d, causal, scale


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=[str(dt).removeprefix("torch.") for dt in CPU_DTYPES])
@given(case=segments(), seed=st.integers(0, 2**16))
def test_varlen_attention_matches_float64_reference(path, dtype, case, seed):
    """S1/S5/S7: outputs and the gradients of q, k, v equal a per-segment float64 reference (lengths 0
    included, GQA, causal or not, a custom scale), on the reference path and on the kernel path."""
    lengths, h, hkv, d, causal, scale = case
    q, k, v, up = make_inputs(lengths, h, hkv, d, dtype, seed=seed)
    calls = []
    with substitute_varlen_kernel(cpu_varlen_kernel(calls, poison_empty=True)):
        if path == "kernel":
            out = varlen_attention(q, k, v, lengths, causal=causal, scale=scale, plan=KERNEL_PLAN)
        else:
            out = varlen_attention(q, k, v, lengths, causal=causal, scale=scale)  # CPU: plans the reference
    assert out.shape == q.shape and out.dtype == dtype
    check_against_reference(out, (q, k, v), up, lengths, causal, dtype, scale, f"{path} {lengths}")
    assert len(calls) == (1 if path == "kernel" and sum(lengths) > 0 else 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (6, 1)])
def test_kernel_calling_convention(device, causal, h, hkv):
    """The kernel is handed int32 cu_seqlens without the empty segments, the true longest length, the
    causal window (-1, 0) as a tuple (or (-1, -1)), enable_gqa exactly when h != h_kv, and the scale."""
    lengths = [3, 0, 2, 0, 0, 4, 0]
    q, k, v, up = make_inputs(lengths, h, hkv, 8, torch.float32, device)
    calls = []
    with substitute_varlen_kernel(cpu_varlen_kernel(calls)):
        out = varlen_attention(q, k, v, lengths, causal=causal, plan=KERNEL_PLAN)
    assert len(calls) == 1
    call = calls[0]
    assert call["cu_q"] == call["cu_k"] == [0, 3, 5, 9]
    assert (call["max_q"], call["max_k"], call["T"]) == (4, 4, 9)
    assert call["window_size"] == ((-1, 0) if causal else (-1, -1)) and isinstance(call["window_size"], tuple)
    assert call["enable_gqa"] is (h != hkv) and call["heads"] == (h, hkv)
    assert call["scale"] == pytest.approx(8**-0.5)
    check_against_reference(out, (q, k, v), up, lengths, causal, torch.float32)


def test_kernel_receives_a_contiguous_last_dim():
    lengths = [2, 3]
    q, k, v, up = make_inputs(lengths, 2, 2, 8, torch.float32)
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # (T, h, d), stride(-1) != 1
    assert qt.stride(-1) != 1
    with substitute_varlen_kernel(cpu_varlen_kernel()):
        out = varlen_attention(qt, k, v, lengths, causal=True, plan=KERNEL_PLAN)
    check_against_reference(out, (qt, k, v), up, lengths, True, torch.float32)


# ----------------------------------------------------------------------------------------------------
# empty segments never reach a kernel (S1, S6)
# ----------------------------------------------------------------------------------------------------

EMPTY_CASES = [[0, 3, 2], [3, 0, 2], [3, 2, 0], [0, 0, 4, 0, 1, 0], [1, 0, 0, 0, 1]]


def test_poisoned_kernel_does_poison_when_handed_an_empty_segment():
    """The positive control: the NaN kernel below is not harmless when it is handed an empty segment."""
    q, k, v, up = make_inputs([3, 2], 2, 2, 8, torch.float32)
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    out = cpu_varlen_kernel(poison_empty=True)(q, k, v, cu, cu, 3, 3, window_size=(-1, 0))
    assert torch.isnan(out[3]).all()
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], grad_outputs=torch.zeros_like(out))
    assert torch.isnan(dq[3]).all() and torch.isnan(dk[3]).all() and torch.isnan(dv[3]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=[str(dt).removeprefix("torch.") for dt in CPU_DTYPES])
@pytest.mark.parametrize("lengths", EMPTY_CASES, ids=[str(c) for c in EMPTY_CASES])
@pytest.mark.parametrize("causal", [True, False])
def test_empty_segments_never_reach_the_kernel(device, dtype, lengths, causal):
    """S6: a kernel that writes NaN into outputs and gradients when handed a zero-length segment leaves
    every output and gradient finite and equal to the float64 reference: it is never handed one."""
    q, k, v, up = make_inputs(lengths, 4, 2, 8, dtype, device)
    calls = []
    with substitute_varlen_kernel(cpu_varlen_kernel(calls, poison_empty=True)):
        out = varlen_attention(q, k, v, lengths, causal=causal, plan=KERNEL_PLAN)
        check_against_reference(out, (q, k, v), up, lengths, causal, dtype, what=f"{lengths}")
    assert len(calls) == 1
    cu = calls[0]["cu_q"]
    assert all(a < b for a, b in zip(cu, cu[1:])), f"the kernel was handed an empty segment: {cu}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lengths", [[0, 0, 0], [0], []], ids=["three-empty", "one-empty", "no-segment"])
def test_all_segments_empty_calls_no_kernel_and_gives_zero_gradients(device, path, lengths):
    """S1: T = 0 gives an empty (0, h, d) output tied to q, k, v (exactly-zero gradients), no kernel call."""
    q, k, v, up = make_inputs(lengths, 4, 2, 8, torch.float32, device)
    calls = []
    with substitute_varlen_kernel(cpu_varlen_kernel(calls, poison_empty=True)):
        out = varlen_attention(q, k, v, lengths, causal=True, plan=KERNEL_PLAN if path == "kernel" else None)
    assert calls == []
    assert out.shape == (0, 4, 8) and out.requires_grad
    for g, x in zip(torch.autograd.grad(out, [q, k, v], grad_outputs=up), (q, k, v)):
        assert g.shape == x.shape
        assert_zero(g, "gradient")


def test_no_anomaly_with_empty_segments():
    """S1: ``torch.autograd.detect_anomaly()`` raises nothing, on the reference and the kernel path."""
    lengths = [0, 4, 0, 2, 0]
    for plan in (None, KERNEL_PLAN):
        q, k, v, up = make_inputs(lengths, 2, 1, 8, torch.float32)
        with torch.autograd.detect_anomaly(), substitute_varlen_kernel(cpu_varlen_kernel()):
            out = varlen_attention(q, k, v, lengths, causal=True, plan=plan)
            (out * up).sum().backward()
        for x in (q, k, v):
            assert_finite(x.grad, "gradient")


# ----------------------------------------------------------------------------------------------------
# same answer as attend on the padded layout (S5), numerical stability (S7), double backward
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [True, False])
def test_equals_attend_on_the_padded_layout(path, causal):
    """S5: varlen_attention on packed tokens == ``attend`` on the right-padded layout with a key padding
    mask (and causal), at every real token, in float64."""
    lengths, n, h, hkv, d = [3, 0, 5, 1], 5, 4, 2, 8
    q, k, v, _ = make_inputs(lengths, h, hkv, d, torch.float64)
    b = len(lengths)
    pad = torch.arange(n)[None] < torch.tensor(lengths)[:, None]  # (b, n)
    idx = pad.reshape(-1).nonzero().squeeze(1)  # (T,) the packed order: sample-major

    def padded(t):  # (T, h, d) -> (b, h, n, d), zeros at padding
        full = t.new_zeros(b * n, t.shape[1], d).index_copy(0, idx, t)
        return full.view(b, n, t.shape[1], d).transpose(1, 2)

    want = attend(padded(q), padded(k), padded(v), mask=pad, causal=causal)  # (b, h, n, d)
    want = want.transpose(1, 2).reshape(b * n, h, d).index_select(0, idx)  # (T, h, d)
    with substitute_varlen_kernel(cpu_varlen_kernel()):
        got = varlen_attention(q, k, v, lengths, causal=causal, plan=KERNEL_PLAN if path == "kernel" else None)
    assert_close(got, want.detach(), "varlen vs attend", torch.float64, table=ATTEND_TOL)


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_large_logits_half_precision(dtype):
    """S7: logits of magnitude up to about 1e4 in float16/bfloat16 give finite outputs and gradients that
    agree with the float64 reference (softmax statistics in float32)."""
    lengths = [5, 0, 7, 3]
    q, k, v, up = make_inputs(lengths, 2, 2, 16, dtype, magnitude=100.0)
    with torch.no_grad():
        logits = (q.double()[:5] @ k.double()[:5].transpose(-1, -2)).abs().max() * 16**-0.5
    assert logits > 1e3
    out = varlen_attention(q, k, v, lengths, causal=True)
    check_against_reference(out, (q, k, v), up, lengths, True, dtype, what="large logits")


def test_reference_path_has_second_derivatives():
    lengths = [2, 0, 3]
    q, k, v, _ = make_inputs(lengths, 2, 1, 8, torch.float64)
    fn = lambda q, k, v: varlen_attention(q, k, v, lengths, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


def test_kernel_path_gradcheck_and_gradgradcheck():
    lengths = [2, 0, 3]
    q, k, v, _ = make_inputs(lengths, 2, 1, 8, torch.float64)
    with substitute_varlen_kernel(cpu_varlen_kernel()):
        fn = lambda q, k, v: varlen_attention(q, k, v, lengths, causal=True, plan=KERNEL_PLAN)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v))
        assert torch.autograd.gradgradcheck(fn, (q, k, v))


# ----------------------------------------------------------------------------------------------------
# lengths: list, tensor and layout agree; bad input gets a clear error (S9)
# ----------------------------------------------------------------------------------------------------


def test_lengths_as_list_tensor_and_layout_agree():
    lengths = [3, 0, 2, 4]
    q, k, v, _ = make_inputs(lengths, 2, 2, 8, torch.float32)
    layout = varlen_layout(lengths)
    assert isinstance(layout, VarlenLayout)
    assert (layout.lengths, layout.total, layout.max_len) == ((3, 2, 4), 9, 4)
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert varlen_layout([0, 0]).cu_seqlens is None
    outs = [varlen_attention(q, k, v, lens, causal=True) for lens in (lengths, torch.tensor(lengths), layout,
                                                                       torch.tensor(lengths, dtype=torch.int32))]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch.equal(varlen_attention(q, k, v, lengths, 4, causal=True), outs[0])  # a max_len that fits
    assert torch.equal(varlen_attention(q, k, v, lengths, 100, causal=True), outs[0])


def test_substitute_varlen_kernel_restores_the_kernel_after_an_error():
    before = varlen_mod._varlen_kernel
    with pytest.raises(KeyError), substitute_varlen_kernel(lambda *a, **kw: None):
        raise KeyError("boom")
    assert varlen_mod._varlen_kernel is before


def test_bad_kernel_output_is_a_clear_error():
    q, k, v, _ = make_inputs([2, 2], 2, 2, 8, torch.float32)
    with substitute_varlen_kernel(lambda q, *a, **kw: q[:1]), pytest.raises(RuntimeError, match="varlen kernel returned"):
        varlen_attention(q, k, v, [2, 2], causal=False, plan=KERNEL_PLAN)


def _bad_calls():
    q, k, v, _ = make_inputs([2, 3], 4, 2, 8, torch.float32)
    call = lambda *a, **kw: lambda: varlen_attention(*a, **kw)  # noqa: E731
    return [
        ("lengths sum to less than T", call(q, k, v, [2, 2], causal=True), ValueError, "lengths must sum"),
        ("lengths sum to more than T", call(q, k, v, [2, 3, 1], causal=True), ValueError, "lengths must sum"),
        ("cu_seqlens given as lengths", call(q, k, v, [0, 2, 5], causal=True), ValueError, "lengths must sum"),
        ("negative length", call(q, k, v, [6, -1], causal=True), ValueError, "lengths must be >= 0"),
        ("float lengths tensor", call(q, k, v, torch.tensor([2.0, 3.0]), causal=True), TypeError, "lengths"),
        ("bool lengths tensor", call(q, k, v, torch.tensor([True, True]), causal=True), TypeError, "lengths"),
        ("2-d lengths tensor", call(q, k, v, torch.tensor([[2, 3]]), causal=True), ValueError, "lengths"),
        ("float in lengths list", call(q, k, v, [2.0, 3], causal=True), TypeError, "lengths"),
        ("bool in lengths list", call(q, k, v, [True, 4], causal=True), TypeError, "lengths"),
        ("lengths of another kind", call(q, k, v, "23", causal=True), TypeError, "lengths"),
        ("max_len below the longest", call(q, k, v, [2, 3], 2, causal=True), ValueError, "max_len"),
        ("q of 4 dims", call(q[None], k, v, [2, 3], causal=True), ValueError, "q must have 3 dims"),
        ("heads that do not divide", call(q[:, :3], k, v, [2, 3], causal=True), ValueError, "h_kv"),
        ("k and v differ", call(q, k, v[:, :1], [2, 3], causal=True), ValueError, "k and v"),
        ("k of another T", call(q, k[:4], v[:4], [2, 3], causal=True), ValueError, "self-attention"),
        ("dtypes differ", call(q, k.double(), v, [2, 3], causal=True), TypeError, "dtype"),
        ("integer q", call(q.long(), k, v, [2, 3], causal=True), TypeError, "floating-point"),
        ("causal as a tensor", call(q, k, v, [2, 3], causal=torch.tensor(True)), TypeError, "causal"),
        ("scale inf", call(q, k, v, [2, 3], causal=True, scale=float("inf")), ValueError, "scale"),
        ("plan and backend", call(q, k, v, [2, 3], causal=True, plan=KERNEL_PLAN, backend="math"), ValueError, "plan or backend"),
        ("plan of another kind", call(q, k, v, [2, 3], causal=True, plan="varlen"), TypeError, "VarlenPlan"),
        ("unknown backend", call(q, k, v, [2, 3], causal=True, backend="fast"), ValueError, "backend"),
        ("layout on another device", call(q, k, v, varlen_layout([2, 3], device="meta"), causal=True), ValueError, "cu_seqlens"),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("what,fn,exc,text", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_gets_a_clear_error(what, fn, exc, text):
    with pytest.raises(exc, match=text):
        fn()


def test_causal_is_required():
    q, k, v, _ = make_inputs([2], 2, 2, 8, torch.float32)
    with pytest.raises(TypeError, match="causal"):
        varlen_attention(q, k, v, [2])


# ----------------------------------------------------------------------------------------------------
# PyTorch's real varlen Flash kernel (CUDA machines with sm80+ only)
# ----------------------------------------------------------------------------------------------------


@needs_real_kernel
def test_plan_on_this_cuda_device_is_varlen():
    plan = plan_varlen(device_type="cuda", dtype=torch.bfloat16, head_dim=64, heads=8, kv_heads=2, causal=True)
    assert plan.path == "varlen", plan.reason


@needs_real_kernel
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h,hkv,d", [(4, 4, 64), (8, 2, 64), (4, 1, 128), (2, 2, 8), (2, 1, 256)])
@pytest.mark.parametrize("lengths", [[0, 37, 1, 0, 130, 5, 0], [1, 0, 1, 1, 0]], ids=["mixed", "one-token-each"])
def test_real_kernel_matches_float64_reference(dtype, causal, h, hkv, d, lengths):
    """The real kernel (planned, not forced) with empty segments at the start, middle and end, long and
    one-token segments: output and gradients equal the float64 reference within the dtype's tolerance.
    One token per segment with GQA and no window is Flash's "seqlenq_ngroups_swapped" forward, which
    reshapes q to (b, h_kv, g, d): right only when every handed segment has exactly one token."""
    q, k, v, up = make_inputs(lengths, h, hkv, d, dtype, "cuda", seed=d + h)
    cu = [0]
    for n in lengths:
        if n:
            cu.append(cu[-1] + n)
    calls = []
    real = varlen_mod._varlen_kernel

    def spy(*args, **kwargs):
        calls.append(args[3].tolist())
        return real(*args, **kwargs)

    with substitute_varlen_kernel(spy):
        out = varlen_attention(q, k, v, lengths, causal=causal)
    assert calls == [cu]
    check_against_reference(out, (q, k, v), up, lengths, causal, dtype, what="real kernel")


@needs_real_kernel
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_real_kernel_large_logits(dtype):
    lengths = [50, 0, 70]
    q, k, v, up = make_inputs(lengths, 4, 2, 64, dtype, "cuda", magnitude=12.0)
    out = varlen_attention(q, k, v, lengths, causal=True)
    check_against_reference(out, (q, k, v), up, lengths, True, dtype, what="real kernel, large logits")


@needs_real_kernel
def test_real_kernel_all_empty_and_double_backward():
    q, k, v, up = make_inputs([0, 0], 4, 2, 64, torch.bfloat16, "cuda")
    out = varlen_attention(q, k, v, [0, 0], causal=True)
    assert out.shape == (0, 4, 64)
    assert_zero(torch.autograd.grad(out, q, grad_outputs=up)[0], "gradient")
    q, k, v, up = make_inputs([3, 4], 4, 2, 64, torch.bfloat16, "cuda")
    out = varlen_attention(q, k, v, [3, 4], causal=True)
    (g,) = torch.autograd.grad((out * up).sum(), q, create_graph=True)
    g.float().pow(2).sum().backward()
    assert_finite(q.grad, "double-backward gradient of q")


@needs_real_kernel
def test_real_kernel_with_a_cuda_lengths_tensor_and_layout():
    lengths = [4, 0, 9]
    q, k, v, _ = make_inputs(lengths, 4, 4, 64, torch.float16, "cuda")
    a = varlen_attention(q, k, v, lengths, causal=True)
    b = varlen_attention(q, k, v, torch.tensor(lengths, device="cuda"), causal=True)
    c = varlen_attention(q, k, v, varlen_layout(lengths, device="cuda"), causal=True)
    assert torch.equal(a, b) and torch.equal(a, c)


# ----------------------------------------------------------------------------------------------------
# the stack's unpadded path with the varlen kernel (what CUDA runs), on the CPU with the stand-in kernel
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers_cls,opts", [
    (sf.Decoder, dict(rotary_pos_emb=True, kv_heads=1, cross_attend=True, attn_qk_norm=True)),
    (sf.Encoder, dict(ff_glu=True)),
], ids=["decoder-rotary-gqa-cross-qknorm", "encoder"])
def test_stack_unpadded_varlen_path_equals_padded_path(monkeypatch, layers_cls, opts):
    """``AttentionLayers(unpadded=True)`` with the varlen plan (forced here; on CUDA ``plan_varlen`` picks it)
    hands the kernel the packed real tokens with their segment offsets (empty samples dropped) and gives
    the padded path's outputs and gradients; NaN at padded positions reaches nothing."""
    import safeformer.stack.unpadded

    torch.manual_seed(0)
    stack = layers_cls(dim=32, depth=2, heads=4, dim_head=8, **opts).double()
    mask = torch.tensor([[True] * 6, [False, False, True, True, True, False], [False] * 6, [True, True] + [False] * 4])
    x = torch.randn(4, 6, 32, dtype=torch.float64)
    x[~mask] = NAN
    kw = {}
    if opts.get("cross_attend"):
        kw = dict(context=torch.randn(4, 3, 32, dtype=torch.float64), context_mask=torch.tensor(
            [[True, True, False], [False] * 3, [True] * 3, [True, False, False]]))

    def run(unpadded: bool):
        stack.unpadded = unpadded
        xi = x.clone().requires_grad_()
        out = stack(xi, mask=mask, **kw)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in stack.named_parameters() if p.grad is not None}
        stack.zero_grad(set_to_none=True)
        return out.detach(), xi.grad, grads

    want = run(False)
    plan = VarlenPlan("varlen", "forced for the test", (-1, 0) if stack.causal else (-1, -1), False)
    monkeypatch.setattr(safeformer.stack.unpadded, "stack_varlen_plan", lambda stack, x: plan)
    calls: list = []
    with substitute_varlen_kernel(cpu_varlen_kernel(calls)):
        got = run(True)
    assert calls and calls[0]["cu_q"] == [0, 6, 9, 11]  # the empty sample owns no segment
    assert all(c["window_size"] == ((-1, 0) if stack.causal else (-1, -1)) for c in calls)
    torch.testing.assert_close(got[0][mask], want[0][mask])
    assert bool((got[0][~mask] == 0).all()) and bool(torch.isfinite(got[1]).all())
    torch.testing.assert_close(got[1], want[1])
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, msg=name)
