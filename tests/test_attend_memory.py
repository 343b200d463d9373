"""The memory-lean paths of ``safeformer.core.attend``: ``_SelectedFlashAttention`` and ``masked_linear``.

On PyTorch's CPU flash kernel, ``attend`` selects q, k, v (dead rows, masked keys) inside one autograd
function that saves the caller's tensors and selects again in the backward, instead of handing SDPA
selected copies that SDPA saves (with those copies the padding-mask peak was 1.45x the unmasked one). These
tests show that the lean path gives exactly the generic path's results (forward, gradients, every
dtype, garbage planted where the masks hide it), that it runs exactly where it should, and that it
saves no q/k/v-sized copy: counted from the autograd graph's saved tensors and from every allocation,
not timed, so nothing here can be flaky.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    INF,
    NAN,
    allowed_matrix,
    assert_bitwise,
    assert_finite,
    assert_zero,
    mask_from_lengths,
    plant,
    single_thread,
)
from torch import nn

import safeformer  # noqa: F401  (loads safeformer.core.attend)
from safeformer import attend
from safeformer.core.attend import SelectedMask
from safeformer.testing import prepare_mask, substitute_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
from memory import TensorMemory  # noqa: E402  (the benchmark's allocation meter)

A = sys.modules["safeformer.core.attend"]  # the module (``safeformer.core.attend`` is also the function's name)
masked_linear = A.masked_linear

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DTYPE_IDS = [str(dt).removeprefix("torch.") for dt in DTYPES]
KINDS = ("padding", "left_padding_causal", "full", "per_head", "bias", "prepared", "cross_causal")


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equal on one thread (how the suite runs); with more threads the CPU kernel's gemms may
    round a tiny chunk differently, so a few units of the dtype's epsilon are allowed there."""
    if torch.get_num_threads() == 1:
        assert_bitwise(actual, expected, what)
    else:
        assert_finite(actual, what)
        eps = torch.finfo(actual.dtype).eps
        torch.testing.assert_close(actual, expected, atol=8 * eps, rtol=8 * eps, msg=what)


def graph_names(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind ``t``."""
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    return names


@contextlib.contextmanager
def lean_path(on: bool, *, chunk_min_scores: int | None = None):
    """Switch the lean path on/off (and force chunking on small tensors with ``chunk_min_scores=1``)."""
    old = A._FUSED_SELECT, A._CHUNK_MIN_SCORES
    A._FUSED_SELECT = on
    if chunk_min_scores is not None:
        A._CHUNK_MIN_SCORES = chunk_min_scores
    try:
        yield
    finally:
        A._FUSED_SELECT, A._CHUNK_MIN_SCORES = old


def make_case(kind: str, dtype: torch.dtype, *, h: int = 4, hkv: int = 2, value: float = NAN, seed: int = 0):
    """Inputs and ``attend`` kwargs for one mask kind, with garbage planted at dead rows of q and at masked
    keys of k and v (``value`` in q and v, its negation in k), and an upstream gradient with NaN at dead rows.

    Returns (q, k, v, kwargs, upstream, dead (b, h, i), masked_keys (b, h_kv, j)).
    """
    g = torch.Generator().manual_seed(seed)
    b, i, j, d = 3, 24, 20, 16
    causal, bias, mask4 = False, None, None
    kwargs: dict = {"scale": 0.3}
    pad = mask_from_lengths([j - 6, j, 0], j)  # (b, j); the last sample fully padded: dead rows
    if kind == "padding":
        kwargs["mask"], mask4 = pad, pad[:, None, None, :]
    elif kind == "left_padding_causal":  # left padding + causal: the first rows of a sample are dead
        i = j
        left = mask_from_lengths([j - 7, j, 3], j, left=True)
        kwargs["mask"], kwargs["causal"], causal, mask4 = left, True, True, left[:, None, None, :]
    elif kind == "cross_causal":  # i < j, bottom-right causal, padded keys: a (b, 1, i, j) kernel mask
        i = 9
        kwargs["mask"], kwargs["causal"], causal, mask4 = pad, True, True, pad[:, None, None, :]
    elif kind == "full":  # (b, 1, i, j): a dead row and a masked key in every sample
        m = torch.rand(b, 1, i, j, generator=g) > 0.4
        m[:, :, 3] = False
        m[..., 5] = False
        kwargs["mask"], mask4 = m, m
    elif kind == "per_head":  # (b, h, i, j): a key masked for every head, a row dead in one head only
        m = torch.rand(b, h, i, j, generator=g) > 0.4
        m[..., 2] = False
        m[:, 1, 7] = False
        kwargs["mask"], mask4 = m, m
    elif kind == "bias":  # a bias of -inf masks as surely as False: a dead row made by the bias
        bias = torch.randn(1, h, i, j, generator=g).to(dtype)
        bias = bias.masked_fill(torch.rand(1, h, i, j, generator=g) > 0.8, float("-inf"))
        bias[:, :, 4] = float("-inf")
        kwargs["mask"], kwargs["bias"], mask4 = pad, bias, pad[:, None, None, :]
    elif kind == "prepared":  # a stack's PreparedMask: padding + causal, with a float additive kernel mask
        i = j
        m = pad[:, None, None, :] & torch.ones(i, j, dtype=torch.bool).tril()
        kwargs["mask"], mask4 = prepare_mask(m, dtype=dtype), m
    else:
        raise ValueError(kind)
    allowed = allowed_matrix(b, h, i, j, mask4, causal)  # (b, h, i, j)
    if bias is not None:
        allowed = allowed & (bias != float("-inf"))
    dead = ~allowed.any(-1)  # (b, h, i)
    masked_keys = ~allowed.reshape(b, hkv, h // hkv, i, j).any(2).any(-2)  # (b, h_kv, j)
    assert dead.any() and masked_keys.any() and (~dead).any(), "the case must have dead rows, masked keys and live rows"
    q = plant(torch.randn(b, h, i, d, generator=g).to(dtype), dead, value)
    k = plant(torch.randn(b, hkv, j, d, generator=g).to(dtype), masked_keys, -value)
    v = plant(torch.randn(b, hkv, j, d, generator=g).to(dtype), masked_keys, value)
    upstream = plant(torch.randn(b, h, i, d, generator=g).to(dtype), dead, NAN)
    return q, k, v, kwargs, upstream, dead, masked_keys


def run(q, k, v, kwargs, upstream):
    """``attend`` on fresh leaves; returns (out, dq, dk, dv, autograd node names)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, **kwargs)
    names = graph_names(out)
    out.backward(upstream)
    return (out.detach(), *(t.grad for t in leaves)), names


# ----------------------------------------------------------------------------------------------------
# the lean path gives the generic path's results
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["one-call", "chunked"])
@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lean_path_equals_generic_path(dtype, kind, hkv, chunked):
    value = NAN if hkv != 1 else INF
    q, k, v, kwargs, upstream, dead, masked_keys = make_case(kind, dtype, hkv=hkv, value=value)
    with lean_path(True, chunk_min_scores=1 if chunked else None):
        lean, names = run(q, k, v, kwargs, upstream)
        with torch.no_grad():
            lean_nograd = attend(q, k, v, **kwargs)
    assert "_SelectedFlashAttentionBackward" in names, f"the lean path did not run: {sorted(names)}"
    with lean_path(False):
        generic, names = run(q, k, v, kwargs, upstream)
    assert "_SelectedFlashAttentionBackward" not in names
    for what, a, b in zip(("out", "dq", "dk", "dv"), lean, generic):
        assert_same(a, b, f"{what} ({kind}, {dtype}, h_kv={hkv}, chunked={chunked})")
    assert_same(lean_nograd, generic[0], "out under no_grad")
    out, dq, dk, dv = lean
    assert_zero(out.transpose(1, 2)[dead.transpose(1, 2)], "out at dead rows")
    assert_zero(dq[dead], "dq at dead rows")
    assert_zero(dk[masked_keys], "dk at masked keys")
    assert_zero(dv[masked_keys], "dv at masked keys")


def test_chunking_splits_batch_and_heads():
    """The chunk plan covers every (batch, key/value head) pair once, in at most _CHUNKS_MAX pieces."""
    for b, hkv, g in [(2, 8, 1), (3, 8, 1), (1, 8, 1), (4, 2, 4), (7, 3, 1), (2, 10, 1), (32, 16, 2)]:
        for backward in (False, True):
            chunks = A._chunks(b, hkv, g, 4096, 4096, backward=backward)
            seen = torch.zeros(b, hkv, dtype=torch.int64)
            for batch, heads in chunks:
                seen[batch, heads] += 1
            assert bool((seen == 1).all()), (b, hkv, g, chunks)
            assert len(chunks) <= A._CHUNKS_MAX
            if torch.get_num_threads() == 1:
                assert len(chunks) > 1
    for backward in (False, True):  # short sequences: one kernel call
        assert A._chunks(2, 8, 1, 64, 64, backward=backward) == [(slice(None), slice(None))]


def test_lean_path_double_backward_works():
    """A gradient penalty through the fused kernel works: the backward with create_graph is the reference
    math's, differentiable again, and finite with NaN planted at masked slots."""
    q, k, v, kwargs, upstream, *_ = make_case("padding", torch.float32, value=1.0)
    q.requires_grad_()
    out = attend(q, k, v, **kwargs)
    assert "_SelectedFlashAttentionBackward" in graph_names(out)
    (g,) = torch.autograd.grad((out * upstream.nan_to_num()).sum(), q, create_graph=True)
    g.pow(2).sum().backward()
    assert_finite(q.grad, "double-backward gradient of q")


def _lean_ran(fn) -> bool:
    calls = []
    real = A._flash_selected_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    A._flash_selected_forward = spy
    try:
        fn()
    finally:
        A._flash_selected_forward = real
    return bool(calls)


def test_lean_path_only_where_it_runs_what_sdpa_would():
    """Everything the lean path cannot reproduce exactly keeps the generic path: a substituted kernel
    (the S6 tests' NaN kernels), the math and reference backends, dropout, inputs vouched for by the
    caller, a bias that needs a gradient, autocast; and no mask needs no selection at all."""
    q, k, v, kwargs, *_ = make_case("padding", torch.float32, value=1.0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert _lean_ran(lambda: attend(q, k, v, **kwargs))
    assert _lean_ran(lambda: attend(q, k, v, backend="flash", **kwargs))
    assert not _lean_ran(lambda: attend(q, k, v))
    assert not _lean_ran(lambda: attend(q, k, v, backend="math", **kwargs))
    assert not _lean_ran(lambda: attend(q, k, v, backend="reference", **kwargs))
    assert not _lean_ran(lambda: attend(q, k, v, dropout_p=0.1, **kwargs))
    vouched = {**kwargs, "mask": SelectedMask(kwargs["mask"])}
    assert not _lean_ran(lambda: attend(q, k, v, **vouched))
    with substitute_kernel(lambda *a, **kw: F.scaled_dot_product_attention(*a, **kw)):
        assert not _lean_ran(lambda: attend(q, k, v, **kwargs))
    bias = torch.zeros(1, q.shape[1], q.shape[2], k.shape[2], requires_grad=True)
    assert not _lean_ran(lambda: attend(q, k, v, bias=bias, **kwargs))
    assert _lean_ran(lambda: attend(q, k, v, bias=bias.detach(), **kwargs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _lean_ran(lambda: attend(q, k, v, **kwargs))
    with lean_path(False):
        assert not _lean_ran(lambda: attend(q, k, v, **kwargs))


# ----------------------------------------------------------------------------------------------------
# memory: counted, not timed
# ----------------------------------------------------------------------------------------------------


def saved_bytes(fn, inputs) -> int:
    """Bytes of the distinct storages that the autograd graph built by ``fn()`` saves for its backward,
    not counting the storages of ``inputs`` (which the caller holds anyway)."""
    exclude = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lean_path_saves_no_copies_of_q_k_v(dtype):
    """With a padding mask, the graph saves what the unmasked call saves (the output and the
    log-sum-exp) plus masks smaller than one q; the generic path saves three q/k/v-sized copies more."""
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 4, 256, 32
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = mask_from_lengths([n // 2, 0], n)  # (b, n); the second sample fully padded
    one = q.numel() * q.element_size()
    unmasked = saved_bytes(lambda: attend(q, k, v), (q, k, v))
    lean = saved_bytes(lambda: attend(q, k, v, mask=mask), (q, k, v))
    with lean_path(False):
        generic = saved_bytes(lambda: attend(q, k, v, mask=mask), (q, k, v))
    assert unmasked >= one  # the kernel saves its output: the meter sees saved tensors
    assert lean - unmasked < one // 4, f"the lean path saves {lean - unmasked} bytes more than no mask (one q: {one})"
    assert generic - unmasked >= 3 * one, "the generic path should save selected copies of q, k, v (the meter is blind)"


def peak_bytes(fn) -> int:
    """Peak bytes of the storages aten ops allocate during ``fn`` (the meter of benchmarks/memory.py)."""
    with TensorMemory() as meter:
        fn()
    return meter.peak


@pytest.fixture
def one_thread():
    """The chunk plan keeps one work item per thread: pin the thread count so the peak is the same
    wherever the suite runs."""
    with single_thread():
        yield


def test_lean_path_peak_memory_close_to_unmasked(one_thread):
    """Forward+backward and no-grad forward on leaf q, k, v: with a padding mask the peak footprint
    (inputs + everything allocated) is at most 1.1x the unmasked one (the generic path: well above)."""
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 8, 1024, 64
    q, k, v = (torch.randn(b, h, n, d, generator=g).requires_grad_() for _ in range(3))
    upstream = torch.randn(b, h, n, d, generator=g)
    mask = mask_from_lengths([700, 0], n)
    one = q.numel() * q.element_size()

    def fwd_bwd(m):
        def f():
            attend(q, k, v, mask=m).backward(upstream)
            q.grad = k.grad = v.grad = None
        return f

    def fwd(m):
        def f():
            with torch.no_grad():
                attend(q, k, v, mask=m)
        return f

    for make, what, existing in ((fwd_bwd, "forward+backward", 4 * one), (fwd, "forward (no grad)", 3 * one)):
        # existing: q, k, v (and the upstream gradient)
        base = existing + peak_bytes(make(None))
        lean = existing + peak_bytes(make(mask))
        with lean_path(False):
            generic = existing + peak_bytes(make(mask))
        assert lean <= 1.1 * base, f"{what}: padding mask peak {lean / base:.3f}x the unmasked one"
        assert generic > 1.25 * base, f"{what}: the generic path measured {generic / base:.3f}x (the meter is blind)"


# ----------------------------------------------------------------------------------------------------
# masked_linear
# ----------------------------------------------------------------------------------------------------


def plain_masked_linear(x, keep, linear):
    return linear(torch.where(keep[..., None], x, 0.0))


def _linear_run(fn, x, keep, linear, upstream):
    xl = x.clone().requires_grad_()
    linear.zero_grad(set_to_none=True)
    y = fn(xl, keep, linear)
    names = graph_names(y)
    y.backward(upstream)
    params = [linear.weight.grad] + ([linear.bias.grad] if linear.bias is not None else [])
    return [y.detach(), xl.grad, *params], names


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("shapes", [((3, 50, 64), (3, 50)), ((3, 50, 64), (3, 1)), ((40, 64), (40,)),
                                    ((2, 3, 300, 96), (2, 1, 300))], ids=["rows", "samples", "2d", "4d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_masked_linear_equals_plain_expression(dtype, bias, shapes, value):
    """Same output and gradients as ``linear(torch.where(keep[..., None], x, 0))``, garbage at dropped
    rows of x reaching nothing; x's gradient is exactly 0 there."""
    shape, keep_shape = shapes
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(shape[-1], 48, bias=bias).to(dtype)
    keep = torch.rand(keep_shape, generator=g) > 0.4
    keep.view(-1)[0] = False
    x = plant(torch.randn(shape, generator=g).to(dtype), ~keep.expand(shape[:-1]), value)
    upstream = torch.randn(*shape[:-1], 48, generator=g).to(dtype)
    lean, names = _linear_run(masked_linear, x, keep, linear, upstream)
    assert "_MaskedLinearBackward" in names, sorted(names)
    plain, _ = _linear_run(plain_masked_linear, x, keep, linear, upstream)
    for what, a, b in zip(("y", "dx", "dW", "db"), lean, plain):
        assert_bitwise(a, b, f"masked_linear {what}")
    assert_zero(lean[1][~keep.expand(shape[:-1])], "dx at dropped rows")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_masked_linear_double_backward_equals_plain_expression(bias):
    """A gradient penalty through masked_linear (as through an Attention with backend='math') gives the
    plain expression's second derivatives (to float64 rounding: the graphs order the products
    differently), NaN at dropped rows included."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(16, 8, bias=bias).double()
    keep = torch.rand(3, 10, generator=g) > 0.4
    x = plant(torch.randn(3, 10, 16, generator=g).double(), ~keep, NAN)
    results = []
    for fn in (masked_linear, plain_masked_linear):
        xl = x.clone().requires_grad_()
        linear.zero_grad(set_to_none=True)
        y = fn(xl, keep, linear)
        (dx,) = torch.autograd.grad((y * y.detach()).sum(), xl, create_graph=True)
        (dx.square().sum() + y.square().mean()).backward()
        results.append([xl.grad, linear.weight.grad] + ([linear.bias.grad] if bias else []))
    for what, a, b in zip(("dx", "dW", "db"), *results):
        assert_finite(a, f"second derivative {what}")
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"second derivative {what}")


def test_masked_linear_saves_x_not_a_copy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, 64, generator=g).requires_grad_()
    keep = mask_from_lengths([128, 60, 0, 5], 128)
    linear = nn.Linear(64, 32)
    one = x.numel() * x.element_size()
    inputs = (x, linear.weight, linear.bias)
    lean = saved_bytes(lambda: masked_linear(x, keep, linear), inputs)
    plain = saved_bytes(lambda: plain_masked_linear(x, keep, linear), inputs)
    assert plain >= one, "the plain expression saves its selected copy (the meter is blind otherwise)"
    assert lean < one // 8, f"masked_linear saved {lean} bytes besides x and the parameters (x: {one})"


def test_masked_linear_falls_back_and_checks_its_arguments():
    x = torch.randn(2, 5, 8)
    keep = torch.tensor([[True] * 5, [False] * 5])
    linear = nn.Linear(8, 4)
    with torch.no_grad():  # nothing saved, nothing to spare: the plain expression
        assert_bitwise(masked_linear(x, keep, linear), plain_masked_linear(x, keep, linear))
    frozen = nn.Linear(8, 4).requires_grad_(False)
    assert "_MaskedLinearBackward" not in graph_names(masked_linear(x.requires_grad_(), keep, frozen))
    with pytest.raises(TypeError, match="keep"):
        masked_linear(x, keep.long(), linear)
    with pytest.raises(ValueError, match="keep"):
        masked_linear(x, torch.ones(3, 5, dtype=torch.bool), linear)
