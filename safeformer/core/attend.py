"""``attend``: the safe attention function every attention in safeformer runs through.

Shape legend: b batch, h query heads, g = h // h_kv query heads per key/value head, i queries,
j keys, d head dim (q, k), e head dim (v).

How it is safe whatever the kernel does (docs/safety.md, S1-S3, S6):
1. The masks are combined (user mask, bottom-right causal) in their broadcast shape.
2. Masked keys (no query may see them) have k and v *selected* to 0, and dead rows (a query that may
   see no key) have q selected to 0, so NaN/inf there cannot reach any product (``0 * NaN``).
3. The kernel never sees a dead row: dead rows are handed a mask that lets them see one key (the
   first), so every kernel computes a finite, ordinary softmax for them.
4. The kernel's output for dead rows is then selected to exactly 0; since the incoming gradient for
   those rows is then exactly 0 too, they pass zero gradient into q, k, v and the bias.
None of these steps reads a tensor's value on the host: the forward has no device sync and compiles
with ``torch.compile(fullgraph=True)``.

On the CPU in eager mode two lean paths skip the selected copies where they change nothing (a CPU
tensor's value is read on the host there; no device sync): a forward needing no gradient runs the kernel
on q, k, v as given and accepts the output when it is finite (``_optimistic``: a masked key weighs exactly
0, so it can reach a live row only as a NaN or inf), else it runs the selecting path; with a gradient,
``_SelectedFlashAttention`` does the same when the norms of q, k, v bound every product (``_bounded``).
PyTorch's own CPU flash kernel is then handed dead rows fully masked (it skips them); their result is
replaced all the same, and in the backward their log-sum-exp is +inf (weight 0 on every key).

On the CPU flash kernel (eager, no dropout) steps 2-4 run inside one autograd function,
``_SelectedFlashAttention``: it saves the caller's q, k, v and the masks instead of the selected
copies, calls the kernel's forward and backward ops itself on selected copies made per chunk of
(batch, head) pairs, and so keeps no q, k, v-sized copy alive between the forward and the backward.

Second derivatives and ``torch.func``: the fused kernels have no second derivative, so a backward with
``create_graph=True`` (a gradient penalty) goes around them (``_ReferenceSecondOrder``, and
``_SelectedFlashAttention``'s own backward): it returns the gradients of the reference math recomputed
on the same selected inputs, as a graph autograd differentiates again; an ordinary backward is the
kernel's own, untouched. Under ``torch.func`` transforms (grad, vmap, jacrev, ...) ``backend="auto"``
runs the reference math and the selections are ``torch.where``: no custom autograd function is used.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .masks import as_attention_mask, causal_mask, combine_masks

__all__ = ["attend", "plan_attention", "AttentionPlan", "BACKENDS", "substitute_kernel", "PreparedMask", "prepare_mask"]

BACKENDS = ("auto", "reference", "math", "flash", "efficient", "cudnn")

_SDPA_BACKEND = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

# The fused kernel attend() calls. Tests replace it (``substitute_kernel``) with one that misbehaves
# on purpose, to prove that safety does not rest on the kernel (S6).
_kernel: Callable[..., Tensor] = F.scaled_dot_product_attention


@contextlib.contextmanager
def substitute_kernel(fn: Callable[..., Tensor]) -> Iterator[None]:
    """Run ``attend`` with ``fn`` in place of ``F.scaled_dot_product_attention`` (a testing hook).

    ``fn`` receives the same arguments as SDPA: ``(q, k, v, attn_mask=, dropout_p=, is_causal=,
    scale=, enable_gqa=)``.
    """
    global _kernel
    old, _kernel = _kernel, fn
    try:
        yield
    finally:
        _kernel = old


# float dtype -> the integer dtype of the same width, for ``_select``'s bitwise path
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}


class _SelectOrZero(torch.autograd.Function):
    """``torch.where(keep, x, 0.0)`` computed as a bitwise AND of x's bits with all-ones or all-zeros.

    The result is bit-for-bit that of ``torch.where`` (x's bits, or +0.0: a NaN or inf at a dropped
    position is gone, not multiplied by 0), but the CPU runs it vectorised, where ``torch.where`` with a
    broadcast condition runs a scalar loop (about 7x slower on large tensors, measured in
    benchmarks/NOTES.md). The backward selects the incoming gradient the same way. (Old-style
    ``forward(ctx, ...)``: a ``setup_context`` makes every ``apply`` bind arguments with ``inspect``.)
    """

    @staticmethod
    def forward(ctx, keep: Tensor, x: Tensor) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.x_shape = x.shape
        return _bitwise_select(keep, x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        g = _select(keep, grad)
        return None, (g if g.shape == ctx.x_shape else g.sum_to_size(ctx.x_shape))


class _GradSelect(torch.autograd.Function):
    """Identity in the forward; the backward selects the incoming gradient with ``keep`` (zeros elsewhere).

    ``attend`` puts it on q, k, v when they are known to be finite where masked (so no forward copy is
    needed) to keep a kernel whose backward misbehaves on dead rows or masked keys out of the gradients.
    """

    @staticmethod
    def forward(ctx, keep: Tensor, x: Tensor) -> Tensor:
        ctx.save_for_backward(keep)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return None, torch.where(keep, grad, 0.0)


def _no_double_backward_with_dropout(kernel: str, dropout_p: float) -> RuntimeError:
    return RuntimeError(
        f"attend: double backward (create_graph=True, e.g. a gradient penalty) through the fused '{kernel}' "
        f"SDPA kernel with attention dropout (dropout_p={dropout_p}) is not supported: the kernel has no second "
        f"derivative and its dropout mask cannot be recomputed; build the model with backend='math' (or "
        f"'reference'), e.g. Decoder(..., backend='math'), or use attn_dropout=0"
    )


class _ReferenceSecondOrder(torch.autograd.Function):
    """Identity on a fused kernel's output; a backward with ``create_graph=True`` goes around the kernel.

    PyTorch's flash, memory-efficient and cuDNN kernels have no second derivative. In an ordinary
    backward this passes the gradient on to the kernel's own backward, untouched (it saves q, k, v and
    the mask, which the kernel's node saves anyway: no copy). In a backward with ``create_graph=True``
    (a gradient penalty: R1, WGAN-GP) it passes the kernel no gradient (its node, handed none, returns
    none: PyTorch's flash and memory-efficient backward ops check for it) and returns instead the
    gradients of the reference math (``_reference``: an explicit float32 softmax) at the kernel's own
    inputs, as a graph autograd can differentiate again. The kernel's inputs are already selected (dead
    rows of q, masked keys of k and v are 0 or known finite) and the output's dead rows are selected
    after this, so the recomputation sees no NaN and sends none back. Attention dropout cannot be
    recomputed (the kernel's random mask is its own): that case alone keeps a clear error.
    """

    @staticmethod
    def forward(ctx, out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, call: tuple) -> Tensor:
        # call: (is_causal, scale, dropout_p, kernel name), one argument (each costs ``apply`` time)
        ctx.save_for_backward(q, k, v, attn_mask)
        ctx.call = call
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if not torch.is_grad_enabled():  # an ordinary backward: the kernel's own
            return grad, None, None, None, None, None
        is_causal, scale, dropout_p, kernel = ctx.call
        if dropout_p > 0:  # backward(create_graph=True) with the kernel's random dropout mask
            raise _no_double_backward_with_dropout(kernel, dropout_p)
        q, k, v, attn_mask = ctx.saved_tensors
        dq, dk, dv, dmask = _reference_vjp(grad, q, k, v, attn_mask, is_causal, scale, ctx.needs_input_grad[1:5])
        return None, dq, dk, dv, dmask, None


# whether the running backward keeps the graph (retain_graph=True); a private torch function, so a fallback
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)

# the kernels run by ``_KernelApart`` rather than followed by ``_ReferenceSecondOrder``: cuDNN's backward op
# (``_cudnn_attention_backward``) does not check for an undefined incoming gradient as flash's and the
# memory-efficient one's do
_KERNELS_APART = frozenset({"cudnn"})


class _KernelApart(torch.autograd.Function):
    """A kernel run on q, k, v (and the mask) in an autograd graph of its own; ``create_graph=True`` goes around it.

    For a kernel whose autograd node cannot simply be skipped in a backward with ``create_graph=True``: a
    ``torch.library`` custom op (the varlen kernel) or a backward op that needs a gradient (cuDNN) would
    run its backward there, on zeros, and leave in the graph a node that refuses the second
    differentiation. So the kernel runs on detached inputs, in a graph only this function reaches: an
    ordinary backward runs that graph's backward (the kernel's own; the detached inputs share the
    storage of q, k, v: no copy), a backward with ``create_graph=True`` returns instead the gradients of
    ``reference`` (plain differentiable ops computing the same attention) at q, k, v and the mask, as a
    graph autograd can differentiate again.

    ``run``: ``(call, reference, dropout_p, kernel name)``; ``call`` and ``reference`` take
    ``(q, k, v, mask)``. One argument: each costs ``apply`` time.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, run: tuple) -> Tensor:
        call, ctx.reference, ctx.dropout_p, ctx.kernel = run
        with torch.enable_grad():
            inner = tuple(t if t is None else t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, mask))
            out = call(*inner)
        ctx.save_for_backward(q, k, v, mask)
        ctx.inner = (inner, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        needs = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():  # backward(create_graph=True): the reference, differentiable again
            if ctx.dropout_p > 0:
                raise _no_double_backward_with_dropout(ctx.kernel, ctx.dropout_p)
            return (*_graph_vjp(ctx.reference, ctx.saved_tensors, grad, needs), None)
        if ctx.inner is None:
            raise RuntimeError(f"the '{ctx.kernel}' kernel's graph was freed by an earlier backward; pass "
                               f"retain_graph=True to the first backward to run it twice")
        inner, out = ctx.inner
        keep = _keep_graph()
        if not keep:  # the kernel's graph (its saved output, log-sum-exp) goes as soon as it has run
            ctx.inner = None
        wrt = [t for t, need in zip(inner, needs) if need]
        if not out.requires_grad or not wrt:  # a kernel with no gradient (a substituted one, in tests)
            return None, None, None, None, None
        got = iter(torch.autograd.grad(out, wrt, grad, retain_graph=keep, allow_unused=True))
        return (*(next(got) if need else None for need in needs), None)


def _graph_vjp(fn: Callable[..., Tensor], inputs, grad: Tensor, needs) -> tuple:
    """The gradients of ``fn(*inputs)`` against ``grad`` at the ``inputs`` whose entry of ``needs`` is True
    (``None`` elsewhere), as a graph autograd can differentiate again (``create_graph=True``)."""
    with torch.enable_grad():
        out = fn(*inputs)
        wrt = [t for t, need in zip(inputs, needs) if need]
        got = iter(torch.autograd.grad(out, wrt, grad, create_graph=True, allow_unused=True) if wrt else ())
    return tuple(next(got) if need else None for need in needs)


def _reference_vjp(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                   scale: float, needs, row_ok: Tensor | None = None, key_ok: Tensor | None = None):
    """The gradients at (q, k, v, attn_mask) of ``_reference`` attention against ``grad``, as a graph autograd
    can differentiate again (a backward with ``create_graph=True`` through a fused kernel).

    With ``row_ok`` / ``key_ok`` (q, k, v as the caller passed them), q is selected to 0 at dead rows, k
    and v at masked keys, and the output at dead rows, as ``attend`` does: a NaN there reaches nothing.
    Entries of ``needs`` (4 bools) that are False give ``None``.
    """

    def reference(q, k, v, attn_mask):
        if row_ok is not None:
            q = torch.where(row_ok, q, 0.0)
        if key_ok is not None:
            k, v = torch.where(key_ok, k, 0.0), torch.where(key_ok, v, 0.0)
        out = _reference(q, k, v, attn_mask, is_causal, scale, 0.0)
        return out if row_ok is None else torch.where(row_ok, out, 0.0)

    return _graph_vjp(reference, (q, k, v, attn_mask), grad, needs)


def _grad_select(keep: Tensor, x: Tensor) -> Tensor:
    if not x.requires_grad or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return x if not x.requires_grad else torch.where(keep, x, 0.0)
    return _GradSelect.apply(keep, x)


def _bitwise_select(keep: Tensor, x: Tensor) -> Tensor:
    it = _INT_VIEW[x.dtype]
    return (x.view(it) & keep.to(it).neg_()).view(x.dtype)  # True -> all ones (-1), False -> 0


def _select(keep: Tensor, x: Tensor) -> Tensor:
    """``torch.where(keep, x, 0.0)``; the bitwise form for large CPU tensors in eager mode."""
    if (x.device.type != "cpu" or x.dtype not in _INT_VIEW or x.numel() < 65536 or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()):
        return torch.where(keep, x, 0.0)
    if torch.is_grad_enabled() and x.requires_grad:
        return _SelectOrZero.apply(keep, x)
    return _bitwise_select(keep, x)


@dataclass(frozen=True)
class PreparedMask:
    """An attention mask combined and prepared once, for every ``attend`` call of a stack to share.

    A layer stack builds one at the top of its forward (padding + causal, ``(b, 1, i, j)``) and hands
    the same object to every layer: the dead rows are found once, and every layer passes the *same*
    additive tensor to the kernel, so the kernels' saved tensors share one storage instead of one
    float copy of the mask per layer.

    Attributes:
        combined: bool ``(b|1, h|1, i, j)``, True = may attend (every mask and causal already in it).
        row_ok: bool ``(b|1, h|1, i, 1)``, False on dead rows.
        additive: ``(b|1, h|1, i, j)`` float, 0 where the kernel may attend and ``-inf`` elsewhere; a
            dead row may attend to the first key (so no kernel sees a dead row).
        key_ok: bool ``(b|1, h|1, j, 1)``, False on masked keys (no query may see them).
    """

    combined: Tensor
    row_ok: Tensor
    additive: Tensor
    key_ok: Tensor | None = None


@dataclass(frozen=True)
class SelectedMask:
    """A mask (a tensor, a ``PreparedMask`` or ``None``) passed with the caller's word that q at dead rows
    and k, v at masked keys are finite already: its own modules selected their inputs to 0 before the
    projections (or the keys/values are their own cache). ``attend`` then skips its three selections
    of q, k, v (copies and their backward passes); dead rows are still handed a key and still come out
    exactly 0 with zero gradient, and the gradients at dead rows and masked keys are still selected.

    Made by safeformer's layer stack for its own blocks: a trusted value passed down instead of a flag.
    """

    mask: Tensor | PreparedMask | None = None


def _per_head(attn, t, order: Tensor):
    """``t`` with its query-head dim (dim 1, when it has ``h`` entries) in ``order``; masks and biases broadcast
    over the heads pass as they are (a ``PreparedMask`` / ``SelectedMask`` field by field)."""
    if isinstance(t, SelectedMask):
        return SelectedMask(_per_head(attn, t.mask, order))
    if isinstance(t, PreparedMask):
        return PreparedMask(*(None if f is None else _per_head(attn, f, order)
                              for f in (t.combined, t.row_ok, t.additive, t.key_ok)))
    if isinstance(t, Tensor) and t.dim() == 4 and t.shape[1] == attn.heads:
        return t.index_select(1, order)
    return t


def to_kernel_heads(attn, q: Tensor, mask=None, bias=None) -> tuple:
    """``q (b, h, i, d)`` and any per-head mask / bias in the order the fused kernels pair heads with key/value
    heads (interleaved); unchanged unless ``attn.kv_tiled`` (x-transformers' tiled grouped-query heads)."""
    order = attn.kernel_head_order
    if order is None:
        return q, mask, bias
    return q.index_select(1, order), _per_head(attn, mask, order), _per_head(attn, bias, order)


def from_kernel_heads(attn, out: Tensor) -> Tensor:
    """A kernel's ``out (b, h, i, e)`` back in the module's head order (see ``to_kernel_heads``)."""
    return out if attn.kernel_head_restore is None else out.index_select(1, attn.kernel_head_restore)


def prepare_mask(mask: Tensor, *, dtype: torch.dtype = torch.float32) -> PreparedMask:
    """Prepare a 4-d bool attention mask ``(b|1, h|1, i, j)`` (True = may attend) for ``attend``.

    Args:
        mask: the combined mask; pass ``causal=False`` to ``attend`` with the result (causal belongs
            in the mask already).
        dtype: the dtype of the additive kernel mask (that of q; another dtype is converted per call).
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        raise TypeError(f"prepare_mask needs a 4-d torch.bool mask, got {getattr(mask, 'dtype', type(mask))} "
                        f"of shape {tuple(getattr(mask, 'shape', ()))}")
    row_ok = mask.any(dim=-1, keepdim=True)
    j = mask.shape[-1]
    dead_sees = ~row_ok
    if j > 1:
        dead_sees = dead_sees & (torch.arange(j, device=mask.device) == 0)
    kernel = mask | dead_sees
    additive = torch.zeros(kernel.shape, dtype=dtype, device=mask.device).masked_fill(~kernel, float("-inf"))
    return PreparedMask(mask, row_ok, additive, mask.any(dim=-2, keepdim=True).transpose(-1, -2))


@dataclass(frozen=True)
class AttentionPlan:
    """How one ``attend`` call runs; a plain function of shapes, dtype, device and mask kind.

    Attributes:
        path: ``"reference"`` (explicit float32 softmax) or ``"sdpa"``.
        sdpa_backends: the SDPA backends allowed, in order of preference; empty = leave the choice
            to PyTorch's dispatcher among all of them.
        expected: the backend expected to run (``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``,
            or ``"reference"``), for tests and benchmarks.
        mask_form: ``"none"`` (no mask tensor), ``"is_causal"`` (SDPA's ``is_causal=True``, no mask
            tensor), ``"broadcast"`` (a bool mask in its broadcast shape, e.g. ``(b, 1, 1, j)``) or
            ``"bias"`` (a float additive tensor, when the caller gives a bias).
        expand_kv: repeat key/value heads for grouped-query attention instead of ``enable_gqa``
            (for kernels that do not take it).
    """

    path: str
    sdpa_backends: tuple[str, ...]
    expected: str
    mask_form: str
    expand_kv: bool


def plan_attention(
    *,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    q_len: int,
    k_len: int,
    heads: int,
    kv_heads: int,
    mask_kind: str,
    causal: bool,
    has_bias: bool = False,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> AttentionPlan:
    """Choose the path, the kernel and the mask form for one attention call.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        dtype: the dtype of q, k, v.
        head_dim: d.
        q_len, k_len: i and j.
        heads, kv_heads: h and h_kv.
        mask_kind: ``"none"`` (no user mask), ``"padding"`` (the mask broadcasts over queries:
            ``(b, 1, 1, j)``), or ``"full"`` (it varies per query).
        causal: bottom-right causal masking requested.
        has_bias: an additive bias is given.
        dropout_p: attention dropout.
        backend: the requested backend, one of ``BACKENDS``.

    Returns:
        an ``AttentionPlan``.

    Raises:
        ValueError: an unknown backend, or one that cannot run these inputs on this device.
    """
    allowed = None
    if isinstance(backend, tuple):  # "auto" among these SDPA kernels only (x-transformers' sdp_kwargs)
        allowed = check_sdpa_allowed(backend)
        backend = "auto"
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if mask_kind not in ("none", "padding", "full"):
        raise ValueError(f"mask_kind must be 'none', 'padding' or 'full', got {mask_kind!r}")
    mask_form = _mask_form(q_len=q_len, k_len=k_len, mask_kind=mask_kind, causal=causal, has_bias=has_bias)
    if backend == "reference":
        return AttentionPlan("reference", (), "reference", mask_form, expand_kv=True)
    if device_type == "cuda":
        plan = _cuda_plan(dtype, head_dim, mask_form, gqa=kv_heads != heads, backend=backend, allowed=allowed)
    else:
        plan = _other_device_plan(device_type, mask_form, dropout_p, backend)
    if allowed is not None and device_type != "cuda":
        plan = _restricted_cpu_plan(plan, allowed, dropout_p, device_type)
    return plan


SDPA_KERNELS = ("flash", "efficient", "math", "cudnn")


def check_sdpa_allowed(allowed) -> tuple[str, ...]:
    """``allowed`` (the SDPA kernels ``attend`` may choose among) checked: a non-empty tuple of ``SDPA_KERNELS``."""
    if not isinstance(allowed, tuple) or not allowed or any(a not in SDPA_KERNELS for a in allowed):
        raise ValueError(f"the SDPA kernels allowed must be a non-empty tuple of {SDPA_KERNELS}, got {allowed!r}")
    return allowed


def sdpa_allowed_from_kwargs(sdp_kwargs, name: str = "sdp_kwargs") -> tuple[str, ...] | None:
    """x-transformers' ``sdp_kwargs`` (``dict(enable_flash=..., enable_math=..., enable_mem_efficient=...,
    enable_cudnn=...)``, ``torch.backends.cuda.sdp_kernel``'s keywords, a kernel not named enabled as there) as the
    kernels ``attend`` may choose among;
    ``None`` when flash, memory-efficient and math are all enabled (x-transformers' default: no restriction)."""
    keys = {"enable_flash": "flash", "enable_mem_efficient": "efficient", "enable_math": "math",
            "enable_cudnn": "cudnn"}
    if not isinstance(sdp_kwargs, dict) or any(k not in keys for k in sdp_kwargs) \
            or any(not isinstance(v, bool) for v in sdp_kwargs.values()):
        raise ValueError(f"{name} must be a dict of bools with keys among {tuple(keys)}, got {sdp_kwargs!r}")
    on = tuple(name for key, name in keys.items() if sdp_kwargs.get(key, True))  # unnamed: enabled (sdp_kernel's)
    if not on:
        raise ValueError(f"{name} enables no attention kernel: {sdp_kwargs!r}")
    if {"flash", "efficient", "math"} <= set(on):
        return None
    return tuple(k for k in SDPA_KERNELS if k in on)


def _restricted_cpu_plan(plan: AttentionPlan, allowed: tuple[str, ...], dropout_p: float,
                         device_type: str) -> AttentionPlan:
    """The CPU (other device) plan among ``allowed``: PyTorch's CPU flash kernel (no dropout) or math."""
    usable = [k for k in ("flash", "math") if k in allowed and not (k == "flash" and (dropout_p > 0 or
                                                                                       device_type != "cpu"))]
    if not usable:
        raise ValueError(f"none of the SDPA kernels allowed ({', '.join(allowed)}) runs on {device_type!r} here "
                         f"(the CPU has flash without dropout, and math)")
    if len(usable) == 2:
        return plan  # PyTorch's own choice between the two
    return AttentionPlan("sdpa", (usable[0],), usable[0], plan.mask_form, expand_kv=False)


def _mask_form(*, q_len: int, k_len: int, mask_kind: str, causal: bool, has_bias: bool) -> str:
    """The plan's ``mask_form``: keep the flash kernel eligible by passing no mask tensor whenever we can."""
    causal_noop = causal and q_len <= 1  # one query, bottom-right aligned, sees every key
    needs_causal_tensor = causal and not causal_noop and not (q_len == k_len and mask_kind == "none" and not has_bias)
    if has_bias:
        return "bias"
    if mask_kind != "none" or needs_causal_tensor:
        return "broadcast"
    if causal and not causal_noop:
        return "is_causal"
    return "none"


def _cuda_plan(dtype: torch.dtype, head_dim: int, mask_form: str, *, gqa: bool, backend: str,
               allowed: tuple[str, ...] | None = None) -> AttentionPlan:
    """The SDPA plan on CUDA: the fused kernels in order of preference (``"auto"``, among ``allowed`` when given),
    or the one requested."""
    half = dtype in (torch.float16, torch.bfloat16)
    has_tensor = mask_form in ("broadcast", "bias")
    flash_ok = half and head_dim % 8 == 0 and head_dim <= 256 and not has_tensor
    efficient_ok = dtype in (torch.float16, torch.bfloat16, torch.float32) and head_dim % 8 == 0
    cudnn_ok = half and head_dim % 8 == 0 and head_dim <= 128
    if backend == "auto":
        if flash_ok:
            order = ("flash", "efficient", "math")
        elif efficient_ok:
            order = ("efficient", "math")
        else:
            order = ("math",)
        if allowed is not None:
            ok = {"math": True, "flash": flash_ok, "efficient": efficient_ok, "cudnn": cudnn_ok}
            order = tuple(k for k in ("flash", "efficient", "cudnn", "math") if k in allowed and ok[k])
            if not order:
                raise ValueError(f"none of the SDPA kernels allowed ({', '.join(allowed)}) can run these inputs on "
                                 f"cuda (dtype {dtype}, head_dim {head_dim}, mask form {mask_form!r})")
        expected = order[0]
        # enable_gqa reaches flash and math; the memory-efficient kernel wants equal head counts.
        return AttentionPlan("sdpa", order, expected, mask_form, expand_kv=gqa and expected in ("efficient", "cudnn"))
    ok = {"math": True, "flash": flash_ok, "efficient": efficient_ok, "cudnn": cudnn_ok}[backend]
    if not ok:
        raise ValueError(
            f"backend={backend!r} cannot run these inputs on cuda (dtype {dtype}, head_dim {head_dim}, "
            f"mask form {mask_form!r}); flash needs float16/bfloat16, head_dim % 8 == 0 and <= 256 and no "
            f"mask tensor; efficient needs head_dim % 8 == 0; cudnn float16/bfloat16, head_dim <= 128"
        )
    return AttentionPlan("sdpa", (backend,), backend, mask_form, expand_kv=gqa and backend in ("efficient", "cudnn"))


def _other_device_plan(device_type: str, mask_form: str, dropout_p: float, backend: str) -> AttentionPlan:
    """The SDPA plan on the CPU (and any other device): PyTorch has the math kernel and a CPU flash kernel, which
    takes masks."""
    if backend in ("efficient", "cudnn"):
        raise ValueError(f"backend={backend!r} runs on CUDA only; inputs are on {device_type!r}")
    if backend == "auto":
        if device_type == "cpu":  # PyTorch's CPU flash kernel takes masks but not dropout
            return AttentionPlan("sdpa", (), "math" if dropout_p > 0 else "flash", mask_form, expand_kv=False)
        return AttentionPlan("sdpa", (), "math", mask_form, expand_kv=False)
    if backend == "flash" and device_type != "cpu":
        raise ValueError(f"backend='flash' runs on CUDA and CPU, not on {device_type!r}")
    return AttentionPlan("sdpa", (backend,), backend, mask_form, expand_kv=False)


def _select_copy(keep: Tensor, x: Tensor) -> Tensor:
    """``torch.where(keep, x, 0.0)`` outside autograd (inside an autograd function's forward/backward);
    bitwise on the CPU at every size (a chunk's slices are often below ``_select``'s threshold)."""
    if x.dtype in _INT_VIEW and x.device.type == "cpu":
        return _bitwise_select(keep, x)
    return torch.where(keep, x, 0.0)


def _select_(keep: Tensor, x: Tensor) -> Tensor:
    """``x`` selected in place (``x`` is a tensor this module owns): what ``_select_copy`` returns, no copy."""
    if x.dtype in _INT_VIEW:
        it = _INT_VIEW[x.dtype]
        x.view(it).bitwise_and_(keep.to(it).neg_())
    else:
        x.masked_fill_(~keep, 0.0)
    return x


# ---- the CPU flash kernel with selection on the way in --------------------------------------------
#
# The generic path hands SDPA *selected copies* of q, k, v, which SDPA's autograd node saves for its
# backward while the caller keeps the originals alive: three extra q/k/v-sized tensors between the
# forward and the backward (1.45x the unmasked peak, benchmarks/memory.py). On the CPU flash kernel
# ``_SelectedFlashAttention`` instead saves the originals and the masks, and makes the selected copies
# only for the duration of each kernel call, one chunk of (batch, key/value head) pairs at a time, so
# that even those transient copies are a fraction of q, k, v. The kernel computes each (batch, head)
# independently (the same blocking whatever the batch), so chunking changes no bit of the result on one
# thread; with several, a tiny chunk's gemms may round differently (a unit in the last place, forward).

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_FUSED_SELECT = True  # private switch (tests): False = always the generic path (select copies, then _kernel)
_BOUNDED = True  # private switch (tests): False = the fused path always selects copies
_CHUNKS_MAX = 16  # kernel calls per attend call, at most: transient copies are >= 1/16 of q, k, v...
_CHUNK_MIN_SCORES = 1 << 20  # ...but no chunk with fewer attention scores (pairs * i * j) than this: a
# chunk costs a few small ops (~40 us on a CPU core), which must stay small next to its kernel call


def _split(n: int, parts: int) -> list[slice]:
    """``range(n)`` cut into ``parts`` consecutive slices whose lengths differ by at most one."""
    bounds = [n * p // parts for p in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def _chunks(b: int, hkv: int, g: int, i: int, j: int, *, backward: bool) -> list[tuple[slice, slice]]:
    """Chunks of (batch, key/value head) pairs, as (batch slice, key/value head slice) rectangles.

    Each chunk holds at least ``per`` pairs: enough for at most ``_CHUNKS_MAX`` chunks, for
    ``_CHUNK_MIN_SCORES`` attention scores, and for one work item per thread, so that chunking costs no
    parallelism: the flash backward parallelises over (batch, query head) pairs, the forward over
    (batch, query head, block of queries) (its blocks: 256 queries from 768 on, 64 from 192, else 32).
    """
    units = b * hkv
    items = g if backward else g * -(-i // (256 if i >= 768 else 64 if i >= 192 else 32))  # work items per pair
    per = max(-(-units // _CHUNKS_MAX), -(-torch.get_num_threads() // items),
              -(-_CHUNK_MIN_SCORES // max(g * i * j, 1)))
    if per * 2 > units:
        return [(slice(None), slice(None))]
    if per >= hkv:  # whole batch entries per chunk
        return [(batch, slice(None)) for batch in _split(b, b // -(-per // hkv))]
    return [(slice(n, n + 1), heads) for n in range(b) for heads in _split(hkv, hkv // per)]


def _part(t: Tensor | None, batch: slice, heads: slice) -> Tensor | None:
    """The chunk's slice of ``t``; dims of size 1 broadcast and are kept whole."""
    if t is None:
        return None
    return t[batch if t.shape[0] > 1 else slice(None), heads if t.shape[1] > 1 else slice(None)]


def _q_heads(kv_heads: slice, g: int) -> slice:
    return kv_heads if kv_heads.start is None else slice(kv_heads.start * g, kv_heads.stop * g)


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The additive mask SDPA makes of a bool mask before calling the kernel (0 / -inf in q's dtype)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _selected_inputs(q, k, v, row_ok, key_ok, mask, batch, kv_heads, g, last_mask: list):
    """The chunk's query heads, selected q, k, v and kernel mask; ``last_mask`` keeps the last converted
    mask, ``[key, mask]``, for the next chunk that slices the same part of it (a ``(b, 1, i, j)`` mask is
    converted once per batch entry, not once per head chunk)."""
    qh = _q_heads(kv_heads, g)
    qc = _select_copy(_part(row_ok, batch, qh), q[batch, qh])
    kc = _select_copy(_part(key_ok, batch, kv_heads), k[batch, kv_heads])
    vc = _select_copy(_part(key_ok, batch, kv_heads), v[batch, kv_heads])
    if mask is None or mask.dtype != torch.bool:
        return qh, qc, kc, vc, _part(mask, batch, qh)
    key = (batch.start, batch.stop) if mask.shape[0] > 1 else None, (qh.start, qh.stop) if mask.shape[1] > 1 else None
    if not last_mask or last_mask[0] != key:
        last_mask[:] = [key, None]  # the old one is freed before the new one is made
        last_mask[1] = _float_mask(_part(mask, batch, qh), q.dtype)
    return qh, qc, kc, vc, last_mask[1]


def _flash_selected_forward(q, k, v, row_ok, key_ok, mask, scale, is_causal, keep_lse, bounded=False):
    """(out, logsumexp or None): the CPU flash kernel on q, k, v selected per chunk; dead rows of out = 0.

    ``bounded``: q, k, v pass ``_bounded`` (nothing they hold at dead rows or masked keys can change a
    live row): one kernel call on q, k, v as given, no selected copies; the log-sum-exp of a dead row is
    +inf, so that the backward gives it a weight of exactly 0 on every key.
    """
    if bounded:
        o, l = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=_float_mask(mask, q.dtype), scale=scale)
        _select_(row_ok, o)  # dead rows: exactly 0
        if keep_lse:
            l.masked_fill_(~row_ok[..., 0], float("inf"))
        return o, (l if keep_lse else None)
    b, h, i, _ = q.shape
    hkv, j, e = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    chunks = _chunks(b, hkv, g, i, j, backward=False)
    out = lse = None
    last_mask: list = []
    for batch, kv_heads in chunks:
        qh, qc, kc, vc, m = _selected_inputs(q, k, v, row_ok, key_ok, mask, batch, kv_heads, g, last_mask)
        o, l = _FLASH_CPU(qc, kc, vc, 0.0, is_causal, attn_mask=m, scale=scale)
        del qc, kc, vc, m
        _select_(_part(row_ok, batch, qh), o)  # dead rows: exactly 0 (the backward does not read them)
        if len(chunks) == 1:
            return o, (l if keep_lse else None)
        if out is None:
            out = q.new_empty((b, h, i, e))
            lse = l.new_empty((b, i, h)).transpose(1, 2) if keep_lse else None  # the kernel's layout
        out[batch, qh].copy_(o)
        if keep_lse:
            lse[batch, qh].copy_(l)
        del o, l
    return out, lse


# the dtypes whose products ``_bounded`` bounds (the kernel computes in them)
_BOUNDED_DTYPES = {torch.float32: torch.finfo(torch.float32).max / 16, torch.float64: torch.finfo(torch.float64).max / 16}


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t))  # NaN or inf for a NaN, an inf or an overflow


def _bounded(q: Tensor, k: Tensor, v: Tensor, scale: float) -> float | None:
    """The norm of v when the norms of q, k, v bound every number the flash kernel forms from them far
    below the dtype's largest (``|q_r . k_c| <= |q| |k|``; a NaN or inf fails), else ``None``.

    Then a masked key's logit is finite before its ``-inf`` and its weight exactly 0, and ``0 * x`` is 0
    for whatever finite x a masked key or a dead row holds: running the kernel on q, k, v as given
    changes no bit of a live row, forward or backward (with a bounded incoming gradient, ``_grad_bounded``),
    and a dead row with a log-sum-exp of +inf weighs every key 0. Reads three numbers on the host (CPU).
    """
    limit = _BOUNDED_DTYPES.get(q.dtype)
    if limit is None:
        return None
    nv = _norm(v)
    if not nv < limit or not _norm(q) * _norm(k) * max(abs(scale), 1.0) < limit:
        return None
    return nv


def _grad_bounded(grad: Tensor, nv: float) -> bool:
    """Whether the incoming gradient keeps the backward's products bounded (``|grad_r . v_c|``, NaN/inf fail)."""
    return _norm(grad) * max(nv, 1.0) < _BOUNDED_DTYPES[grad.dtype]


class _SelectedFlashAttention(torch.autograd.Function):
    """The CPU flash kernel on q, k, v selected to 0 at dead rows / masked keys, saving the originals.

    Forward and backward equal (bit for bit) ``_select`` of q, k, v, then SDPA's flash kernel, then
    ``_select`` of the output, with the gradients selected the same way; but what it saves between the
    two passes is the caller's q, k, v (alive anyway), the small masks, the output and the log-sum-exp,
    not selected copies. (Old-style ``forward(ctx, ...)``, as ``_SelectOrZero``.) A backward with
    ``create_graph=True`` returns instead the gradients of the reference math on the same selections
    (``_reference_vjp``), which autograd can differentiate again: the kernel's backward has no derivative.

    When q, k, v are ``_bounded`` (float32/float64, no NaN, inf or overflow anywhere) the selections
    change no bit of what the kernel computes for live rows: the forward runs the kernel once on q, k, v
    as given, and so does the backward when the incoming gradient is bounded too (``_grad_bounded``);
    dead rows get a log-sum-exp of +inf (weight 0 on every key, so they pass exactly 0 to k and v). The
    gradients are selected afterwards in every case.
    """

    @staticmethod
    def forward(ctx, q, k, v, row_ok, key_ok, mask, plain, scale, is_causal):
        # mask: the kernel mask (a dead row sees the first key); plain: the same without that (dead rows all
        # masked), for the bounded path, where a dead row's result is replaced anyway (and the kernel skips it)
        nv = _bounded(q, k, v, scale) if _BOUNDED else None
        out, lse = _flash_selected_forward(q, k, v, row_ok, key_ok, plain if nv is not None else mask, scale,
                                           is_causal, keep_lse=True, bounded=nv is not None)
        ctx.save_for_backward(q, k, v, row_ok, key_ok, mask, plain, out, lse)
        ctx.scale, ctx.is_causal, ctx.v_norm = scale, is_causal, nv
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, row_ok, key_ok, mask, plain, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): the kernel's backward has no derivative;
            # the reference math's gradients, selected as in the forward, as a graph (a gradient penalty)
            dq, dk, dv, _ = _reference_vjp(grad, q, k, v, mask, ctx.is_causal, ctx.scale,
                                           (*ctx.needs_input_grad[:3], False), row_ok, key_ok)
            return dq, dk, dv, None, None, None, None, None, None
        if ctx.v_norm is not None and _grad_bounded(grad, ctx.v_norm):  # one call on q, k, v as given
            # (a dead row's log-sum-exp is +inf: weight 0 on every key, whatever the mask gives it)
            dq, dk, dv = _FLASH_CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, ctx.is_causal,
                                             attn_mask=_float_mask(plain, q.dtype), scale=ctx.scale)
            _select_(row_ok, dq), _select_(key_ok, dk), _select_(key_ok, dv)  # whatever the kernel wrote there
            return dq, dk, dv, None, None, None, None, None, None
        b, h, i, _ = q.shape
        hkv, j = k.shape[1], k.shape[2]
        g = h // hkv
        chunks = _chunks(b, hkv, g, i, j, backward=True)
        dq = dk = dv = None
        last_mask: list = []
        for batch, kv_heads in chunks:
            qh, qc, kc, vc, m = _selected_inputs(q, k, v, row_ok, key_ok, mask, batch, kv_heads, g, last_mask)
            rows = _part(row_ok, batch, qh)
            go = _select_copy(rows, grad[batch, qh])  # dead rows pass no gradient into the kernel
            dqc, dkc, dvc = _FLASH_CPU_BACKWARD(go, qc, kc, vc, out[batch, qh], lse[batch, qh], 0.0, ctx.is_causal,
                                                attn_mask=m, scale=ctx.scale)
            del go, qc, kc, vc, m
            keys = _part(key_ok, batch, kv_heads)
            _select_(rows, dqc), _select_(keys, dkc), _select_(keys, dvc)  # whatever the kernel wrote there
            if len(chunks) == 1:
                return dqc, dkc, dvc, None, None, None, None, None, None
            if dq is None:  # in the caller's layouts: a leaf's .grad takes them without a copy
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            dq[batch, qh].copy_(dqc)
            dk[batch, kv_heads].copy_(dkc)
            dv[batch, kv_heads].copy_(dvc)
            del dqc, dkc, dvc
        return dq, dk, dv, None, None, None, None, None, None


def _fused_select_ok(plan: AttentionPlan, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                     is_causal: bool, scale: float, dropout_p: float) -> bool:
    """Whether ``_SelectedFlashAttention`` runs what the generic path would run (SDPA's CPU flash kernel).

    Anything else keeps the generic path: a substituted kernel (tests), other devices and kernels,
    dropout, tracing (``torch.compile``, functorch), autocast, tensor subclasses, a mask or bias that
    needs a gradient. The kernel is the one PyTorch's dispatcher picks for the same call.
    """
    if not (_FUSED_SELECT and _kernel is F.scaled_dot_product_attention and plan.path == "sdpa"
            and plan.expected == "flash" and not plan.expand_kv and q.device.type == "cpu" and dropout_p == 0
            and q.dtype in _INT_VIEW):
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() or torch.is_autocast_enabled("cpu"):
        return False
    if any(type(t) not in (Tensor, nn.Parameter) or t.stride(-1) != 1 for t in (q, k, v)):
        return False
    if attn_mask is not None and (type(attn_mask) is not Tensor or attn_mask.requires_grad):
        return False
    backends = [_SDPA_BACKEND[name] for name in plan.sdpa_backends]
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return choice == SDPBackend.FLASH_ATTENTION.value


def _flash_selected(q, k, v, row_ok, key_ok, attn_mask, plain, scale, is_causal) -> Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _SelectedFlashAttention.apply(q, k, v, row_ok, key_ok, attn_mask, plain, scale, is_causal)
    return _flash_selected_forward(q, k, v, row_ok, key_ok, attn_mask, scale, is_causal, keep_lse=False)[0]


class _MaskedLinear(torch.autograd.Function):
    """``F.linear(torch.where(keep[..., None], x, 0), weight, bias)`` that saves x, not the selected copy.

    The weight gradient needs the selected input: the backward selects it again (a transient copy).
    The gradient of x is selected (exactly 0 at dropped rows). The products are those of autograd's
    ``linear`` (``addmm``/``mm`` on the rows flattened), so the results equal the plain expression's.
    The backward is differentiable (a gradient penalty), as the plain expression's is.
    """

    @staticmethod
    def forward(ctx, x, keep, weight, bias):
        ctx.save_for_backward(x, keep, weight)
        ctx.has_bias = bias is not None
        return F.linear(_select_copy(keep[..., None], x), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, keep, weight = ctx.saved_tensors
        rows_keep = keep[..., None]
        graph = torch.is_grad_enabled()  # backward(create_graph=True): autograd records what follows
        g2 = grad.reshape(-1, grad.shape[-1])  # (rows, out)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = g2.mm(weight).view(x.shape)  # (..., in)
            dx = torch.where(rows_keep, dx, 0.0) if graph else _select_(rows_keep, dx)
        if ctx.needs_input_grad[2]:
            xs = torch.where(rows_keep, x, 0.0) if graph else _select_copy(rows_keep, x)  # transient
            dw = xs.reshape(-1, x.shape[-1]).t().mm(g2).t()  # (out, in)
            del xs
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = g2.sum(0)
        return dx, None, dw, db


def masked_linear(x: Tensor, keep: Tensor, linear: nn.Linear) -> Tensor:
    """``linear(torch.where(keep[..., None], x, 0.0))`` without keeping the selected copy for the backward.

    Rows of ``x`` where ``keep`` is False are selected to 0 before the projection (a NaN or inf there
    reaches neither the output nor any gradient, S3), but unlike the plain expression, whose ``linear``
    saves the selected copy for its weight gradient, this saves ``x`` itself (which the caller holds
    anyway) and selects it again in the backward. Same values and gradients as the plain expression.

    Args:
        x: ``(..., in_features)``.
        keep: bool ``(...)``, broadcastable to ``x.shape[:-1]`` (e.g. ``(b, n)`` or ``(b, 1)``); True = keep.
        linear: an ``nn.Linear`` (a subclass with its own ``forward`` gets the plain expression).

    Returns:
        ``(..., out_features)``; a dropped row is ``linear.bias`` (or 0 without a bias).
    """
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"keep must be a torch.bool tensor, got {getattr(keep, 'dtype', type(keep))}")
    if keep.device != x.device:
        raise ValueError(f"keep is on {keep.device}, expected {x.device} (the device of x)")
    try:
        fits = torch.broadcast_shapes(keep.shape, x.shape[:-1]) == x.shape[:-1]
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"keep {tuple(keep.shape)} must broadcast to x.shape[:-1] = {tuple(x.shape[:-1])}")
    weight, bias = linear.weight, linear.bias
    if (type(linear).forward is not nn.Linear.forward or not torch.is_grad_enabled() or not weight.requires_grad
            or x.dim() < 2 or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch.is_autocast_enabled(x.device.type) or type(x) is not Tensor
            or x.dtype != weight.dtype):  # nothing saved to spare, or something autograd should see whole
        return linear(torch.where(keep[..., None], x, 0.0))
    return _MaskedLinear.apply(x, keep, weight, bias)


_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_WIDE = (torch.float32, torch.float64)


def _validate(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale, dropout_p: float) -> None:
    if (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and bias is None and scale is None
            and dropout_p == 0 and type(dropout_p) is float):  # the common call: its checks, quickly
        qs, ks, vs = q.shape, k.shape, v.shape
        if (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and q.dtype in _FLOATS and q.dtype == k.dtype == v.dtype
                and qs[0] == ks[0] == vs[0] and ks[:3] == vs[:3] and qs[3] == ks[3] > 0 and vs[3] > 0
                and ks[1] > 0 and qs[1] % ks[1] == 0 and q.device == k.device == v.device):
            return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {'(b, h, i, d)' if name == 'q' else '(b, h_kv, j, d)'}, got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"q, k, v must share the batch size, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on (b, h_kv, j), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if d == 0 or v.shape[-1] == 0:
        raise ValueError(f"the head dims must be positive, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"q and k must share the head dim d, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"the query heads h={h} must be a multiple of the key/value heads h_kv={hkv} (k {tuple(k.shape)})")
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor (an additive bias), got {getattr(bias, 'dtype', type(bias))}")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device}, expected {q.device}")
        if bias.dim() > 4 or any(s not in (1, full) for s, full in zip(bias.shape[::-1], (k.shape[2], q.shape[2], h, b))):
            raise ValueError(
                f"bias must broadcast to (b, h, i, j) = ({b}, {h}, {q.shape[2]}, {k.shape[2]}), got {tuple(bias.shape)}"
            )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    bias: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Scaled dot-product attention that no mask can make non-finite.

    Args:
        q: ``(b, h, i, d)`` queries.
        k: ``(b, h_kv, j, d)`` keys; ``h % h_kv == 0`` (grouped-query attention: query head ``n``
            uses key/value head ``n // (h // h_kv)``).
        v: ``(b, h_kv, j, e)`` values.
        mask: bool, ``True`` = query may attend to key. ``(b, j)`` key padding, ``(i, j)``,
            ``(b, i, j)`` or ``(b|1, h|1, i|1, j|1)``. Kept in its broadcast shape. A ``PreparedMask``
            (a stack's mask combined once), or a ``SelectedMask`` (a mask whose masked inputs the caller
            already selected to 0).
        causal: bottom-right aligned causal masking: query ``q_idx`` may attend key ``k_idx`` iff
            ``k_idx <= q_idx + (j - i)`` (what a KV cache needs). Combined with ``mask``.
        bias: float additive bias broadcastable to ``(b, h, i, j)`` (ALiBi, relative positions).
        scale: logit scale; default ``d ** -0.5``.
        dropout_p: attention dropout probability (pass 0 at evaluation).
        backend: ``"auto"``, ``"reference"`` (explicit float32 softmax), or an SDPA backend:
            ``"math"``, ``"flash"``, ``"efficient"``, ``"cudnn"``.

    Returns:
        ``(b, h, i, e)``. Rows of dead queries are exactly 0 and pass zero gradient; masked keys and
        values never reach an output or a gradient.

    Raises:
        TypeError, ValueError: wrong dtypes, shapes, devices or backend (S9).
    """
    if bias is None and scale is None and type(dropout_p) is float and dropout_p == 0.0 and backend == "auto":
        # the common no-gradient CPU calls, quickly
        out = _key_padding_call(q, k, v, mask, causal) if mask is not None else _unmasked_call(q, k, v, causal)
        if out is not None:
            return out
    _validate(q, k, v, bias, scale, dropout_p)
    inputs_finite = isinstance(mask, SelectedMask)
    if inputs_finite:
        mask = mask.mask
    b, h, i, d = q.shape
    j = k.shape[2]
    prepared, user = _user_mask(mask, causal, q, b, h, i, j)
    plan = _call_plan(q, k, user, causal, bias, dropout_p, backend)
    scale = d**-0.5 if scale is None else float(scale)

    if j == 0 or i == 0:  # no keys (every row is dead) or no queries: no kernel call
        return _empty_output(q, k, v, bias)

    is_causal = plan.mask_form == "is_causal"
    combined, bias, prepared = _combined_mask(user, prepared, bias, causal and not is_causal and i > 1, q, b, h, i, j)
    if combined is not None:
        return _masked_call(plan, q, k, v, combined, prepared, bias, is_causal, scale, dropout_p, inputs_finite)
    attn_mask = bias.to(q.dtype) if bias is not None else None
    return _kernel_call(plan, q, k, v, attn_mask, is_causal, scale, dropout_p)


def _user_mask(mask, causal: bool, q: Tensor, b: int, h: int, i: int, j: int) -> tuple:
    """``(prepared, user)``: the ``PreparedMask`` given (or ``None``) and the mask as a bool tensor in its broadcast
    shape ``(b|1, h|1, i|1, j|1)`` (or ``None``), checked against q's device."""
    user = None
    prepared = mask if isinstance(mask, PreparedMask) else None
    if prepared is not None:
        if causal:
            raise ValueError("a PreparedMask holds the causal part already; pass causal=False with it")
        mask = prepared.combined
    if mask is not None:
        if type(mask) is Tensor and mask.dtype == torch.bool and mask.dim() == 2 and mask.shape[0] == b and mask.shape[1] == j:
            user = mask.view(b, 1, 1, j)  # (b, j) key padding: what as_attention_mask returns, quickly
        else:
            user = as_attention_mask(mask, b, h, i, j, name="mask")
        if not (user.is_cpu and q.is_cpu) and user.device != q.device:
            raise ValueError(f"mask is on {user.device}, expected {q.device} (the device of q)")
    return prepared, user


def _call_plan(q: Tensor, k: Tensor, user: Tensor | None, causal: bool, bias: Tensor | None, dropout_p: float,
               backend: str) -> AttentionPlan:
    """``plan_attention`` for one ``attend`` call; the reference math under ``torch.func`` transforms."""
    b, h, i, d = q.shape
    mask_kind = "none" if user is None else ("padding" if user.shape[2] == 1 else "full")
    plan = plan_attention(
        device_type=q.device.type, dtype=q.dtype, head_dim=d, q_len=i, k_len=k.shape[2], heads=h, kv_heads=k.shape[1],
        mask_kind=mask_kind, causal=causal, has_bias=bias is not None, dropout_p=dropout_p, backend=backend,
    )
    if (backend == "auto" or isinstance(backend, tuple)) and plan.path == "sdpa" and plan.expected != "math" \
            and torch._C._are_functorch_transforms_active():
        # torch.func (grad, vmap, jacrev, ...): the fused kernels have no batching rule on the CPU and no
        # second derivative anywhere; the reference math is plain differentiable ops that every transform
        # (and any nesting of them) takes
        plan = AttentionPlan("reference", (), "reference", plan.mask_form, expand_kv=True)
    return plan


def _empty_output(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """``(b, h, i, e)`` zeros for a call with no keys or no queries; keeps the graph so that q, k, v (and the
    bias) get (zero) gradients."""
    b, h, i, _ = q.shape
    dead = torch.zeros((), dtype=torch.bool, device=q.device)
    anchor = k.sum() + v.sum() + (bias.sum() if bias is not None else 0.0)  # empty sums: exactly 0
    return torch.where(dead, q.sum(-1, keepdim=True), 0.0).expand(b, h, i, v.shape[-1]) + anchor * 0


def _combined_mask(user: Tensor | None, prepared: PreparedMask | None, bias: Tensor | None, causal_tensor: bool,
                   q: Tensor, b: int, h: int, i: int, j: int) -> tuple:
    """``(combined, bias, prepared)``: the user mask, the causal tensor (when ``causal_tensor``) and the keys the
    bias reaches combined in their broadcast shape (4-d; never ``(b, h, i, j)`` for padding; ``None`` when there is
    nothing to mask), the bias in q's dtype, and the ``PreparedMask`` still usable (``None`` with a bias)."""
    causal_part = causal_mask(i, j, device=q.device) if causal_tensor else None  # (1, 1, i, j)
    reach = None
    if bias is not None:
        # a bias of -inf (or one so negative that it is -inf in the compute dtype, e.g. -1e9 in float16)
        # masks its key as surely as a False does: the bias takes part in finding dead rows and masked keys
        bias = bias.to(q.dtype)
        reach = bias != float("-inf")  # (b|1, h|1, i|1, j|1); a NaN bias masks nothing: it is the user's NaN
        if prepared is not None:
            prepared, user = None, as_attention_mask(prepared.combined, b, h, i, j, name="mask")
    # broadcast shape, never (b, h, i, j) for padding
    combined = user if causal_part is None and reach is None else combine_masks(user, causal_part, reach)
    if combined is not None and combined.dim() < 4:
        combined = combined.reshape((1,) * (4 - combined.dim()) + tuple(combined.shape))
    return combined, bias, prepared


def _masked_call(plan: AttentionPlan, q: Tensor, k: Tensor, v: Tensor, combined: Tensor,
                 prepared: PreparedMask | None, bias: Tensor | None, is_causal: bool, scale: float, dropout_p: float,
                 inputs_finite: bool) -> Tensor:
    """``attend`` with a ``combined`` mask: the optimistic CPU forward, the fused CPU flash path, or q, k, v
    selected at dead rows / masked keys, the kernel, and the output's dead rows selected to 0."""
    h, hkv, j = q.shape[1], k.shape[1], k.shape[2]
    row_ok = prepared.row_ok if prepared is not None else combined.any(dim=-1, keepdim=True)
    if _optimistic_ok(plan, q, k, v, bias, dropout_p):  # a CPU forward needing no gradient
        out = _optimistic(plan, q, k, v, combined, prepared, bias, row_ok, is_causal, scale, check=not inputs_finite)
        if out is not None:
            return out
    attn_mask = _kernel_mask(combined, prepared, bias, row_ok, j, q.dtype)
    key_ok = _key_ok(combined, prepared, h, hkv, j)
    if not inputs_finite and _fused_select_ok(plan, q, k, v, attn_mask, is_causal, scale, dropout_p):
        # the CPU flash kernel with the selections inside: no selected copy outlives the call
        # dead rows: 0; a backward with create_graph=True runs the reference math (a gradient penalty)
        plain = combined if bias is None and prepared is None else attn_mask  # dead rows not handed a key
        return _flash_selected(q, k, v, row_ok, key_ok, attn_mask, plain, scale, is_causal)
    if not inputs_finite:
        q = _select(row_ok, q)  # the selections' backward also zeroes what a kernel sends back there
        k = _select(key_ok, k)
        v = _select(key_ok, v)
    elif torch.is_grad_enabled():
        # the inputs are finite there already; still, a kernel's backward may write NaN into the
        # gradients of dead rows and masked keys (S6): select those gradients away (no forward copy)
        q = _grad_select(row_ok, q)
        k = _grad_select(key_ok, k)
        v = _grad_select(key_ok, v)
    out = _kernel_call(plan, q, k, v, attn_mask, is_causal, scale, dropout_p)
    return _select(row_ok, out)  # dead rows: exactly 0, whatever the kernel returned


def _key_padding_call(q, k, v, mask, causal: bool) -> Tensor | None:
    """``attend(q, k, v, mask=mask, causal=causal)`` for a ``(b, j)`` key padding mask (or a ``SelectedMask``
    of one), on the CPU, in eager mode, with no gradient to compute: what the general code below does for
    it (the same checks, plan, kernel mask, ``_optimistic``), in a few lines, since at decode shapes the
    kernel is short and every step costs. ``None`` where it does not apply (the general code then runs:
    anything else, an error to report, an output that is not finite)."""
    check = True
    if type(mask) is SelectedMask:
        mask, check = mask.mask, False
    if not (type(mask) is Tensor and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and _FUSED_SELECT and _kernel is F.scaled_dot_product_attention and q.is_cpu and mask.is_cpu):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and mask.dim() == 2 and mask.dtype == torch.bool):
        return None
    b, h, i, d = qs
    j = ks[2]
    if not (i and j and (i == 1 or not causal) and mask.shape[0] == b and mask.shape[1] == j
            and q.dtype in _FLOATS and q.dtype == k.dtype == v.dtype and ks[0] == b and ks[:3] == vs[:3]
            and ks[3] == d and vs[3] and ks[1] and h % ks[1] == 0 and k.is_cpu and v.is_cpu):
        return None
    if ((torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()):
        return None
    combined = mask.view(b, 1, 1, j)
    return _optimistic(_CPU_PADDING_PLAN, q, k, v, combined, None, None, combined.any(dim=-1, keepdim=True), False,
                       d**-0.5, check)


def _unmasked_call(q, k, v, causal: bool) -> Tensor | None:
    """``attend(q, k, v)`` with no mask (and no causal part, or one query: a decode step sees every key), on
    the CPU, eager, with no gradient to compute: no row is dead (``j > 0``) and nothing is masked, so the
    general code would call the kernel on q, k, v as given (``_CPU_UNMASKED_PLAN``); this does it without
    the general code's steps. ``None`` where it does not apply."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and _kernel is F.scaled_dot_product_attention
            and q.is_cpu):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4):
        return None
    b, h, i, d = qs
    if not (i and ks[2] and (i == 1 or not causal) and q.dtype in _FLOATS and q.dtype == k.dtype == v.dtype
            and ks[0] == b and ks[:3] == vs[:3] and ks[3] == d and vs[3] and ks[1] and h % ks[1] == 0
            and k.is_cpu and v.is_cpu):
        return None
    if ((torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()):
        return None
    if ks[1] != h:
        return _kernel(q, k, v, scale=d**-0.5, enable_gqa=True)
    return _kernel(q, k, v, scale=d**-0.5)


# what ``plan_attention`` returns for every call ``_unmasked_call`` takes (CPU, backend "auto", no mask, no
# causal tensor, no bias, no dropout): the kernel on q, k, v as given (tests check the equality)
_CPU_UNMASKED_PLAN = AttentionPlan("sdpa", (), "flash", "none", expand_kv=False)


# what ``plan_attention`` returns for every call ``_key_padding_call`` takes (CPU, backend "auto", a padding
# mask, no causal tensor, no bias, no dropout): PyTorch's dispatcher picks the kernel (tests check the equality)
_CPU_PADDING_PLAN = AttentionPlan("sdpa", (), "flash", "broadcast", expand_kv=False)


_FIRST_KEY: dict = {}  # (j, device) -> bool (j,), True at key 0 only: what a dead row is handed


def _first_key(j: int, device: torch.device) -> Tensor:
    """bool ``(j,)``, True at the first key only; made once per (j, device) in eager mode."""
    if torch.compiler.is_compiling():
        return torch.arange(j, device=device) == 0
    key = (j, device)
    t = _FIRST_KEY.get(key)
    if t is None:
        if len(_FIRST_KEY) >= 64:
            _FIRST_KEY.clear()
        with torch.inference_mode(False):  # an ordinary tensor, whatever mode the first call ran in
            t = torch.arange(j, device=device) == 0
        _FIRST_KEY[key] = t
    return t


def _kernel_mask(combined: Tensor, prepared: PreparedMask | None, bias: Tensor | None, row_ok: Tensor, j: int,
                 dtype: torch.dtype) -> Tensor:
    """The mask the kernel gets, from the combined mask and ``row_ok (b|1, h|1, i, 1)`` (False on dead
    rows). No kernel sees a dead row: a dead row is handed one (finite) key to see, the first, which costs
    a kernel no more than a fully masked row (every key at bias 0, with an additive bias)."""
    if bias is not None:
        fill = torch.where(row_ok, float("-inf"), 0.0).to(dtype)
        return torch.where(combined, bias, fill)  # a dead row sees every key at bias 0
    if prepared is not None:  # the stack's shared additive mask: one storage for every layer
        return prepared.additive if prepared.additive.dtype == dtype else prepared.additive.to(dtype)
    if combined.shape[-1] == j > 1:  # a dead row sees the first key: (b|1, h|1, i, j)
        return torch.where(row_ok, combined, _first_key(j, combined.device))
    return combined | ~row_ok


def _key_ok(combined: Tensor, prepared: PreparedMask | None, h: int, hkv: int, j: int) -> Tensor:
    """``key_ok (b|1, h_kv|1, j, 1)``: False on masked keys (no query of the key/value head's group sees them)."""
    if prepared is not None and prepared.key_ok is not None and prepared.key_ok.shape[1] == 1:
        return prepared.key_ok  # (b|1, 1, j, 1)
    key_ok = combined.any(dim=-2, keepdim=True)  # (b|1, h|1, 1, j)
    if key_ok.shape[1] == h and hkv != h:  # a key is live for a kv head if any head of its group sees it
        key_ok = key_ok.reshape(key_ok.shape[0], hkv, h // hkv, 1, j).any(dim=2)
    return key_ok.transpose(-1, -2)  # (b|1, h_kv|1, j, 1)


def _optimistic_ok(plan: AttentionPlan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, dropout_p: float) -> bool:
    """Whether ``_optimistic`` may run: a forward needing no gradient, on the CPU, in eager mode."""
    return (_FUSED_SELECT and not dropout_p and q.is_cpu and plan.path == "sdpa"
            and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and (_kernel is F.scaled_dot_product_attention or _OPTIMISTIC_ANY_KERNEL)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active())


_OPTIMISTIC_ANY_KERNEL = False  # private switch (tests): run ``_optimistic`` with a substituted kernel too


def _optimistic(plan: AttentionPlan, q, k, v, combined: Tensor, prepared: PreparedMask | None, bias: Tensor | None,
                row_ok: Tensor, is_causal: bool, scale: float, check: bool) -> Tensor | None:
    """A forward with no gradient, on the CPU: the kernel on q, k, v as given (no selected copies), dead
    rows then 0. With ``check``, ``None`` when the output is not finite: the caller runs the selecting
    path instead.

    A masked key reaches a live row only through a weight of exactly 0 (its logit is ``-inf``), so
    whatever finite numbers it (or a dead row) holds change no bit of a live row. What it holds can
    change a live row only by making something NaN or inf there: a NaN or inf in its value
    (``0 * inf``), a NaN or overflowing logit (``inf - inf``). So a finite output is the selecting path's
    output, and a non-finite one (this, or the caller's own NaN at a real position) is computed again by
    the selecting path. Without ``check`` (a ``SelectedMask``: the caller vouches for those inputs) the
    output is returned as it is. Reads one or two numbers on the host (CPU tensors: no device sync):
    whether every row is live (then the kernel gets the mask as it is, and nothing is zeroed), and the
    sum of the output.
    """
    live = row_ok.all().item()  # the common case: no dead row, nothing to hand a key, nothing to zero
    if prepared is None and bias is None and (live or _kernel is F.scaled_dot_product_attention):
        attn_mask = combined  # PyTorch's kernel may see a dead row: its result is replaced below (and skipped)
    else:
        attn_mask = _kernel_mask(combined, prepared, bias, row_ok, k.shape[2], q.dtype)
    if plan.sdpa_backends or plan.expand_kv or k.shape[1] != q.shape[1]:
        out = _run_sdpa(plan, q, k, v, attn_mask, is_causal, scale, 0.0)
    else:  # what _run_sdpa does here, without its generality
        if attn_mask is not None and q.is_cuda:
            attn_mask = _cuda_kernel_mask(attn_mask, k.shape[2])
        out = _kernel(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale)
    if not live:
        if _kernel is F.scaled_dot_product_attention:
            out = _select_(row_ok, out)  # dead rows: exactly 0, in place (SDPA's output is a new tensor)
        else:
            out = torch.where(row_ok, out, 0.0)
    if not check:
        return out
    total = out.sum() if out.dtype in _WIDE else out.sum(dtype=torch.float32)  # float16's range is too short
    return out if math.isfinite(total.item()) else None


def _kernel_call(plan: AttentionPlan, q, k, v, attn_mask, is_causal: bool, scale: float, dropout_p: float) -> Tensor:
    """The planned kernel (or the reference math) on inputs already selected. The fused kernels have no
    second derivative: a backward with create_graph=True goes around the kernel, through the reference
    math on the same inputs."""
    if plan.path == "reference" or q.numel() == 0:  # an empty batch, head or query set: nothing for a kernel
        return _reference(q, k, v, attn_mask, is_causal, scale, dropout_p)
    graph = (plan.expected != "math" and torch.is_grad_enabled() and not torch.compiler.is_compiling()
             and not torch._C._are_functorch_transforms_active())
    if graph and plan.expected in _KERNELS_APART:
        return _KernelApart.apply(q, k, v, attn_mask, (
            lambda q, k, v, m: _run_sdpa(plan, q, k, v, m, is_causal, scale, dropout_p),
            lambda q, k, v, m: _reference(q, k, v, m, is_causal, scale, 0.0), dropout_p, plan.expected))
    out = _run_sdpa(plan, q, k, v, attn_mask, is_causal, scale, dropout_p)
    if graph and out.requires_grad:
        out = _ReferenceSecondOrder.apply(out, q, k, v, attn_mask, (is_causal, scale, dropout_p, plan.expected))
    return out


def _expand_kv(k: Tensor, v: Tensor, h: int) -> tuple[Tensor, Tensor]:
    g = h // k.shape[1]
    if g == 1:
        return k, v
    return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def _cuda_kernel_mask(attn_mask: Tensor, j: int) -> Tensor:
    """A mask as CUDA's memory-efficient kernel can read it: every key's slot present (a mask broadcast over
    the keys, such as a query-padding mask ``(b, 1, i, 1)``, is padded to 8 and then expanded by PyTorch,
    which leaves a last dimension of stride 0 that the kernel refuses), the last dimension contiguous, and
    the storage 16-byte aligned with row strides a multiple of 8 (else the kernel reads misaligned
    addresses). Masks that already are so are returned as they are (no copy)."""
    if torch.compiler.is_compiling():  # no data pointer under tracing; the compiled kernels choose their own layout
        return attn_mask
    aligned = (attn_mask.shape[-1] == j and attn_mask.stride(-1) == 1 and attn_mask.data_ptr() % 16 == 0
               and all(st % 8 == 0 for st, n in zip(attn_mask.stride()[:-1], attn_mask.shape[:-1]) if n > 1))
    if aligned:
        return attn_mask
    shape = (*attn_mask.shape[:-1], j)
    padded = attn_mask.new_empty(*shape[:-1], -(-j // 8) * 8)[..., :j]  # rows 8-aligned, storage fresh
    return padded.copy_(attn_mask.expand(shape))


def _run_sdpa(plan: AttentionPlan, q, k, v, attn_mask, is_causal, scale, dropout_p) -> Tensor:
    h = q.shape[1]
    if attn_mask is not None and q.is_cuda and k.shape[2] > 0:
        attn_mask = _cuda_kernel_mask(attn_mask, k.shape[2])
    if plan.expand_kv:
        k, v = _expand_kv(k, v, h)
    gqa = k.shape[1] != h
    kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if gqa:
        kwargs["enable_gqa"] = True
    if not plan.sdpa_backends:
        return _kernel(q, k, v, **kwargs)
    backends = [_SDPA_BACKEND[name] for name in plan.sdpa_backends]
    try:
        with sdpa_kernel(backends):
            return _kernel(q, k, v, **kwargs)
    except RuntimeError as err:
        if "No viable backend" not in str(err) and "No available kernel" not in str(err):
            raise
        raise ValueError(
            f"the SDPA backend(s) {list(plan.sdpa_backends)} refused these inputs (q {tuple(q.shape)} {q.dtype} "
            f"on {q.device}, mask {None if attn_mask is None else tuple(attn_mask.shape)}, dropout_p={dropout_p}); "
            f"use backend='auto' or 'math'"
        ) from err


def _reference(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float, dropout_p: float) -> Tensor:
    """Explicit softmax attention in float32 (float64 for float64 inputs): the plainest correct code."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    k, v = _expand_kv(k, v, q.shape[1])
    logits = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale  # (b, h, i, j)
    if is_causal:
        attn_mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, float("-inf"))
        else:
            logits = logits + attn_mask.to(dtype)
    weights = logits.softmax(dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return (weights @ v.to(dtype)).to(q.dtype)  # (b, h, i, e)
