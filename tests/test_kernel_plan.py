"""The kernel path for CUDA inputs, checked on any machine.

``plan_attention`` is a plain function of shapes, dtype, device type and mask kind, so the plan for
CUDA inputs can be checked without a GPU. ``tests/test_attend.py`` checks single plans; this file
checks the properties the performance story rests on, over grids of shapes and at the module level:

- the flash kernel stays eligible (no mask tensor at all) for unmasked attention, causal-only
  self-attention (``is_causal=True``) and a KV-cache decode step (one query sees every key);
- a padding mask reaches the kernel in its broadcast shape: ``(b, 1, 1, j)``, or ``(b, 1, i, j)`` once
  combined with a causal mask; never a dense ``(b, h, i, j)`` tensor;
- inside the model stacks (``Decoder``, cross-attention, ``TransformerWrapper``, the KV cache) the
  masks handed to the kernel have exactly those shapes, recorded with ``substitute_kernel``, and the
  plan the same calls would get for CUDA half-precision inputs keeps flash wherever there is no mask;
- the fast select that ``attend`` uses on large CPU tensors (a bitwise AND in place of
  ``torch.where``) is bit-for-bit ``torch.where``, NaN and inf included, forward and backward.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim, n sequence
positions, p cached positions, c model width.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import ATTEND_TOL, INF, NAN, RecordingKernel, assert_bitwise, assert_close, mask_from_lengths, ref_attend

import safeformer as sf
from safeformer.testing import plan_attention, substitute_kernel

attend_module = importlib.import_module("safeformer.core.attend")  # the module (``safeformer.core.attend`` is the function)

HALF = (torch.float16, torch.bfloat16)


def cuda_plan(**overrides):
    kwargs = dict(device_type="cuda", dtype=torch.float16, head_dim=64, q_len=128, k_len=128, heads=8, kv_heads=8,
                  mask_kind="none", causal=False)
    kwargs.update(overrides)
    return plan_attention(**kwargs)


# ----------------------------------------------------------------------------------------------------
# plan_attention for CUDA inputs, over grids
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (8, 1)])
def test_flash_kept_for_unmasked_and_causal_only(dtype, head_dim, heads, kv_heads):
    """No mask, causal-only self-attention, and a KV-cache decode step all run flash with no mask tensor;
    grouped-query heads go to flash through enable_gqa (no repeated key/value heads)."""
    common = dict(dtype=dtype, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    cases = {
        "unmasked self": dict(q_len=128, k_len=128, causal=False),
        "unmasked cross": dict(q_len=128, k_len=77, causal=False),
        "causal self": dict(q_len=128, k_len=128, causal=True),
        "decode step": dict(q_len=1, k_len=300, causal=True),
    }
    for name, case in cases.items():
        plan = cuda_plan(**common, **case)
        assert plan.path == "sdpa", name
        assert plan.expected == "flash", name
        assert plan.sdpa_backends[0] == "flash", name
        assert plan.mask_form == ("is_causal" if name == "causal self" else "none"), name
        assert plan.expand_kv is False, name


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2)])
@pytest.mark.parametrize(("q_len", "k_len", "causal"), [(128, 128, False), (128, 77, False), (128, 128, True),
                                                         (1, 300, True), (16, 300, True)])
def test_padding_uses_a_broadcast_mask_on_a_mask_taking_kernel(dtype, heads, kv_heads, q_len, k_len, causal):
    """A padding mask (with or without causal) is a broadcast bool tensor, handed to the memory-efficient
    kernel (flash takes no mask); its key/value heads are repeated for it only under grouped-query heads."""
    plan = cuda_plan(dtype=dtype, heads=heads, kv_heads=kv_heads, q_len=q_len, k_len=k_len, causal=causal,
                     mask_kind="padding")
    assert plan.mask_form == "broadcast"
    assert plan.expected == "efficient"
    assert "flash" not in plan.sdpa_backends
    assert plan.sdpa_backends[-1] == "math"  # the fallback that takes any input
    assert plan.expand_kv is (heads != kv_heads)


def test_float32_causal_needs_no_mask_tensor_either():
    """Without half precision flash is out, but causal-only attention still passes is_causal, no tensor."""
    plan = cuda_plan(dtype=torch.float32, causal=True)
    assert (plan.expected, plan.mask_form) == ("efficient", "is_causal")
    plan = cuda_plan(dtype=torch.float32, head_dim=12, causal=True)
    assert (plan.expected, plan.mask_form, plan.sdpa_backends) == ("math", "is_causal", ("math",))


@pytest.mark.parametrize("head_dim", [4, 12, 264, 512])
def test_auto_never_refuses_an_unusual_head_dim(head_dim):
    """Head dims the fused kernels cannot take fall back without an error, masked or not."""
    for mask_kind in ("none", "padding", "full"):
        plan = cuda_plan(head_dim=head_dim, mask_kind=mask_kind, causal=True)
        assert plan.path == "sdpa" and "math" in plan.sdpa_backends
        if head_dim % 8 != 0:
            assert plan.expected == "math"
        if mask_kind != "none":
            assert plan.expected != "flash"


def test_plan_is_a_pure_function_of_its_arguments():
    """The same arguments give the same (frozen) plan; nothing depends on tensor values or state."""
    a = cuda_plan(mask_kind="padding", kv_heads=2)
    b = cuda_plan(mask_kind="padding", kv_heads=2)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.expected = "flash"  # frozen dataclass


# ----------------------------------------------------------------------------------------------------
# What the kernel receives, from attend and from the model stacks
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def plans(monkeypatch):
    """Records the arguments of every ``plan_attention`` call that ``attend`` makes."""
    seen: list[dict] = []
    real = attend_module.plan_attention

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(attend_module, "plan_attention", spy)
    return seen


def as_cuda_half(kwargs: dict):
    """The plan the same call would get for CUDA float16 inputs."""
    return plan_attention(**{**kwargs, "device_type": "cuda", "dtype": torch.float16})


def assert_no_dense_mask(calls: list) -> None:
    for c in calls:
        if c.mask_shape is not None:
            assert len(c.mask_shape) == 4 and c.mask_shape[1] == 1, f"a mask with a head dimension reached the kernel: {c}"
            # bool, or the stack's shared additive mask in q's dtype (a PreparedMask, padding + causal)
            assert c.mask_dtype in (torch.bool, torch.float32), c


B, N, J, DIM, HEADS, DIM_HEAD = 3, 10, 7, 32, 4, 8


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (B, N), generator=g)
    pad = mask_from_lengths([10, 6, 3], N)  # right padding
    context = torch.randn(B, J, DIM, generator=g)
    ctx_mask = mask_from_lengths([7, 2, 0], J)  # the last sample's condition dropped (all False)
    return tokens, pad, context, ctx_mask


def model(cross=False, kv_heads=None, seed=0):
    torch.manual_seed(seed)
    return sf.TransformerWrapper(
        num_tokens=50, max_seq_len=64,
        attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, kv_heads=kv_heads,
                               cross_attend=cross, rotary_pos_emb=True),
    ).eval()


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_decoder_without_padding_runs_is_causal_and_keeps_flash(plans, kv_heads):
    """An unpadded decoder hands the kernel no mask tensor (is_causal=True), and on CUDA in half precision
    the same calls would run flash."""
    net = model(kv_heads=kv_heads)
    tokens, *_ = inputs()
    rec = RecordingKernel()
    with substitute_kernel(rec):
        out = net(tokens)
    assert len(rec.calls) == 2
    for c in rec.calls:
        assert c.mask_shape is None and c.is_causal is True
        assert c.enable_gqa is (kv_heads is not None)
    for kw in plans:
        plan = as_cuda_half(kw)
        assert (plan.expected, plan.mask_form, plan.expand_kv) == ("flash", "is_causal", False)
    reference = model(kv_heads=kv_heads)(tokens)  # the same weights without the recorder
    assert_bitwise(out, reference, "logits through the recording kernel")


def test_decoder_with_padding_hands_the_kernel_b_1_i_j_at_most(plans):
    """Padding combined with causal: one (b, 1, n, n) mask, never (b, h, n, n), prepared once and shared
    by every layer (one storage: the kernels' saved tensors do not hold a copy per layer); the real
    positions match each sample run alone (the recorder changed nothing)."""
    net = model()
    net.attn_layers.unpadded = False  # the padded path (the unpadded one: test_layers.py)
    tokens, pad, *_ = inputs()
    rec = RecordingKernel()
    with substitute_kernel(rec):
        out = net(tokens, mask=pad)
    assert [c.mask_shape for c in rec.calls] == [(B, 1, N, N)] * 2
    assert all(c.is_causal is False for c in rec.calls)
    assert rec.calls[0].mask_ptr == rec.calls[1].mask_ptr  # the same tensor for both layers
    assert_no_dense_mask(rec.calls)
    for kw in plans:
        assert kw["mask_kind"] == "full" and kw["causal"] is False
        plan = as_cuda_half(kw)
        assert (plan.mask_form, plan.expected) == ("broadcast", "efficient")
    for s, length in enumerate(pad.sum(1).tolist()):
        alone = net(tokens[s : s + 1, :length])
        assert_close(out[s : s + 1, :length], alone.double(), f"sample {s} alone", torch.float32, table=ATTEND_TOL)


def test_cross_attention_context_mask_reaches_the_kernel_as_b_1_1_j(plans):
    """A context padding mask (a dropped condition included) is a bool (b, 1, 1, j) mask; the unpadded
    self-attention beside it still runs is_causal with no mask (flash on CUDA)."""
    net = model(cross=True)
    tokens, _, context, ctx_mask = inputs()
    rec = RecordingKernel()
    with substitute_kernel(rec):
        net(tokens, context=context, context_mask=ctx_mask)
    self_calls, cross_calls = rec.calls[0::2], rec.calls[1::2]
    assert [c.mask_shape for c in self_calls] == [None, None] and all(c.is_causal for c in self_calls)
    assert [c.mask_shape for c in cross_calls] == [(B, 1, 1, J)] * 2
    assert all(c.k_shape == (B, HEADS, J, DIM_HEAD) for c in cross_calls)
    assert_no_dense_mask(rec.calls)
    kinds = [(kw["mask_kind"], as_cuda_half(kw).expected, as_cuda_half(kw).mask_form) for kw in plans]
    assert kinds == [("none", "flash", "is_causal"), ("padding", "efficient", "broadcast")] * 2


def test_cross_attention_without_context_mask_keeps_flash(plans):
    """A context without a mask is unmasked cross-attention: no mask tensor, flash on CUDA."""
    net = model(cross=True)
    tokens, _, context, _ = inputs()
    rec = RecordingKernel()
    with substitute_kernel(rec):
        net(tokens, context=context)
    assert all(c.mask_shape is None for c in rec.calls)
    assert all(as_cuda_half(kw).expected == "flash" for kw in plans)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic cache", "static cache"])
@pytest.mark.parametrize("padded", [False, True])
def test_kv_cache_decode_steps(plans, padded, static):
    """Decoding with the cache: a step's single query sees every cached key, so an unpadded prompt needs
    no mask at all (flash on CUDA) and a left-padded one a (b, 1, 1, p + 1) key mask; cross-attention
    keeps its (b, 1, 1, j) mask. The dynamic cache plans each step with ``plan_attention``; the static
    step hands the kernel the same forms directly (a view of its validity mask, or none; the context's
    mask, built once), so SDPA picks flash or the memory-efficient kernel alike. The generated tokens
    equal those of the uncached path."""
    net = model(cross=True)
    tokens, _, context, ctx_mask = inputs()
    prompt_mask = mask_from_lengths([4, 2, 3], 4, left=True) if padded else None
    prompts = tokens[:, :4]
    rec = RecordingKernel()
    with substitute_kernel(rec):
        cached = sf.generate_tokens(net, prompts, 5, mask=prompt_mask, context=context, context_mask=ctx_mask,
                                    temperature=0.0, cache_kv=True, static_cache=static)
    steps = [c for c in rec.calls if c.q_shape[2] == 1]  # one query per step (after the prompt)
    assert len(steps) == 4 * 2 * 2  # 4 steps after the prompt, 2 layers, self then cross in each
    for t, c in enumerate(steps[0::2]):  # self-attention over the cache: p = prompt + tokens so far
        p = 4 + 1 + t // 2
        assert c.k_shape[2] == p and c.is_causal is False
        assert c.mask_shape == ((B, 1, 1, p) if padded else None)
    for c in steps[1::2]:  # cross-attention to the cached context keys
        assert c.k_shape[2] == J and c.mask_shape == (B, 1, 1, J)
    assert_no_dense_mask(rec.calls)
    step_plans = [kw for kw in plans if kw["q_len"] == 1][0::2]
    if static:
        assert step_plans == []  # the static step plans nothing per step: the forms above are fixed
    else:
        assert len(step_plans) == 8
        assert all(as_cuda_half(kw).expected == ("efficient" if padded else "flash") for kw in step_plans)
    uncached = sf.generate_tokens(net, prompts, 5, mask=prompt_mask, context=context, context_mask=ctx_mask,
                                  temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)


# ----------------------------------------------------------------------------------------------------
# The fast select on large CPU tensors
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("keep_shape", [(2, 1, 128, 1), (2, 1, 1, 1), (1, 4, 128, 1), (2, 4, 128, 64)])
def test_bitwise_select_is_torch_where(dtype, keep_shape):
    """``_select`` on a tensor large enough for the bitwise path equals ``torch.where(keep, x, 0.0)`` bit
    for bit, with NaN, +-inf and -0.0 in kept and dropped places, and so does its gradient."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 128, 64, generator=g).to(dtype)
    assert x.numel() >= 65536  # the bitwise path
    x[0, 0, 0, :4] = torch.tensor([NAN, INF, -INF, -0.0], dtype=dtype)
    x[1, 3, 127, :4] = torch.tensor([NAN, INF, -INF, -0.0], dtype=dtype)
    keep = torch.rand(keep_shape, generator=g) > 0.3
    keep.view(-1)[0] = False
    leaf_a, leaf_b = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast = attend_module._select(keep, leaf_a)
    slow = torch.where(keep, leaf_b, 0.0)
    assert fast.dtype == dtype and fast.shape == slow.shape
    same_bits = fast.detach().view(attend_module._INT_VIEW[dtype]) == slow.detach().view(attend_module._INT_VIEW[dtype])
    assert bool(same_bits.all())
    upstream = torch.randn(slow.shape, generator=g).to(dtype)
    upstream[0, 0, 0, 0] = NAN  # a NaN gradient into a dropped place must not pass
    fast.backward(upstream)
    slow.backward(upstream)
    ga, gb = leaf_a.grad, leaf_b.grad
    assert bool((ga.view(attend_module._INT_VIEW[dtype]) == gb.view(attend_module._INT_VIEW[dtype])).all())
    assert not bool(torch.isnan(ga[0, 0, 0, 0]))


def test_bitwise_select_broadcast_x_and_which_path_runs():
    """x smaller than the result (broadcast) gets its gradient summed back. Large CPU tensors that need a
    gradient take the custom autograd function, large ones that don't take the plain bitwise form, and
    small ones ``torch.where`` itself; every path gives the ``torch.where`` values."""
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(2, 4, 128, 64, generator=g) > 0.5
    x = torch.randn(1, 4, 128, 64, generator=g, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = attend_module._SelectOrZero.apply(keep, x)
    ref = torch.where(keep, x2, 0.0)
    assert_bitwise(out.detach(), ref.detach(), "broadcast select")
    out.sum().backward()
    ref.sum().backward()
    assert_bitwise(x.grad, x2.grad, "gradient summed over the broadcast batch")

    big, small = torch.randn(2, 4, 128, 64, generator=g), torch.randn(3, 5, generator=g)
    keep_big, keep_small = keep[:, :, :, :1], torch.tensor([[True], [False], [True]])
    assert type(attend_module._select(keep_big, big.requires_grad_()).grad_fn).__name__ == "_SelectOrZeroBackward"
    with torch.no_grad():
        plain = attend_module._select(keep_big, big)
    assert plain.grad_fn is None
    assert_bitwise(plain, torch.where(keep_big, big.detach(), 0.0), "no-grad bitwise select")
    assert type(attend_module._select(keep_small, small.requires_grad_()).grad_fn).__name__ == "WhereBackward0"


def test_attend_large_padded_input_matches_float64_reference():
    """attend on inputs large enough for the bitwise select: NaN planted in padded keys/values and in the
    fully padded sample changes nothing, the output matches float64 and dead rows pass zero gradient."""
    g = torch.Generator().manual_seed(3)
    b, h, n, d = 2, 4, 128, 64
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    mask = mask_from_lengths([77, 0], n)  # sample 1: every row dead
    for t in (k, v):
        t[~mask[:, None, :, None].expand_as(t)] = NAN
    q[1] = INF
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sf.attend(*leaves, mask=mask)
    ref = ref_attend(q, k, v, mask[:, None, None, :])
    assert_close(out, ref, "large padded attend", torch.float32, table=ATTEND_TOL)
    out.backward(torch.randn(out.shape, generator=g))
    for name, leaf in zip("qkv", leaves):
        assert bool(torch.isfinite(leaf.grad).all()), name
        assert bool((leaf.grad[1] == 0).all()), f"grad of {name} of the fully padded sample"


def test_kernel_mask_hands_dead_rows_the_first_key():
    """The kernel mask (a cached first-key tensor and one ``where``) is the combined mask with every dead row
    seeing its first key only; made first under inference mode, the cached tensor still serves autograd."""
    attend_module._FIRST_KEY.clear()
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 1, 1, 9), (2, 1, 5, 9), (2, 4, 5, 9), (1, 1, 4, 1)]:
        combined = torch.rand(shape, generator=g) > 0.6
        combined[0] = False  # a sample with dead rows only
        row_ok = combined.any(-1, keepdim=True)
        j = 9
        with torch.inference_mode():
            got = attend_module._kernel_mask(combined, None, None, row_ok, j, torch.float32)
        first = torch.arange(combined.shape[-1]) == 0 if combined.shape[-1] > 1 else torch.ones(1, dtype=torch.bool)
        expected = combined | (~row_ok & first)
        assert torch.equal(got, expected), shape
        assert bool(got.any(-1).all()), "a row sees no key"
    assert all(not t.is_inference() for t in attend_module._FIRST_KEY.values())
    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
    out = sf.attend(q, k, v, mask=mask_from_lengths([3, 0], 5), backend="math")  # uses the cached tensor
    out.sum().backward()
    assert bool((q.grad[1] == 0).all())
