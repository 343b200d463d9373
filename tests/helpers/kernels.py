"""Stand-ins for ``F.scaled_dot_product_attention``, for ``safeformer.substitute_kernel``.

``RecordingKernel`` records what each call hands the kernel and runs the real SDPA. ``NaNKernel`` (S6: the
kernel is not trusted) also misbehaves on purpose, in the forward AND the backward pass: it writes NaN (or
``value``) into every dead row it is handed or told about, and its backward writes it into the gradients
of those rows and of the keys no other row may see, whatever gradient flows in; a row handed no key at all
also gets the NaN gradients of a pre-2.5 softmax (into every key of its sample).

Shape legend: b batch, h query heads, i queries, j keys, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .numerics import INF, NAN

__all__ = ["REAL_SDPA", "KernelCall", "RecordingKernel", "NaNKernel", "faithful_kernel"]

REAL_SDPA = F.scaled_dot_product_attention

# rows a test knows are dead: a bool tensor broadcastable to (b, h, i), or a function of the call
# (q, k, v, attn_mask) giving one (or None: no row); by role, (b, i) tensors or such functions
DeadRows = Tensor | Callable[..., Tensor | None] | Mapping[str, Tensor | Callable[..., Tensor | None]] | None


def keyless_rows(q: Tensor, k: Tensor, attn_mask: Tensor | None) -> Tensor:
    """``(b|1, h|1, i, 1)``: rows the kernel is handed with no key to attend to (mask row all False or all
    -inf). Without a mask (SDPA's ``is_causal`` is top-left aligned: row r sees keys 0..r) only ``j == 0``."""
    i, j = q.shape[-2], k.shape[-2]
    if attn_mask is None:
        return torch.full((1, 1, i, 1), j == 0, dtype=torch.bool, device=q.device)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask != -INF
    rows = ~allowed.any(dim=-1, keepdim=True)  # (b|1, h|1, i|1, 1)
    while rows.dim() < 4:
        rows = rows[None]
    return rows


@dataclass
class KernelCall:
    """What one kernel call was handed (shapes as tuples)."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    mask_shape: tuple[int, ...] | None
    mask_dtype: torch.dtype | None
    mask_ptr: int | None  # the mask's storage: the same tensor handed to several calls has one
    rows_without_keys: int | None  # rows the mask leaves without a key (None: no mask)
    is_causal: bool  # as handed over (not converted)
    dropout_p: float
    scale: float | None
    enable_gqa: bool
    max_abs_logit: float  # the largest |q . k| * scale, masked keys included

    @classmethod
    def of(cls, q, k, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> KernelCall:
        with torch.no_grad():
            kk = k.float()
            if kk.shape[1] != q.shape[1]:
                kk = kk.repeat_interleave(q.shape[1] // kk.shape[1], dim=1)
            logits = (q.float() @ kk.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
            top = float(logits.abs().max()) if logits.numel() else 0.0
        masked = attn_mask is not None
        return cls(
            q_shape=tuple(q.shape), k_shape=tuple(k.shape),
            mask_shape=tuple(attn_mask.shape) if masked else None,
            mask_dtype=attn_mask.dtype if masked else None,
            mask_ptr=attn_mask.data_ptr() if masked else None,
            rows_without_keys=int(keyless_rows(q, k, attn_mask).sum()) if masked else None,
            is_causal=is_causal, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa, max_abs_logit=top,
        )


class RecordingKernel:
    """SDPA that appends a ``KernelCall`` to ``self.calls`` for each call, then runs ``self.attend``
    (the real SDPA here)."""

    def __init__(self) -> None:
        self.calls: list[KernelCall] = []

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        self.calls.append(KernelCall.of(q, k, attn_mask, dropout_p, is_causal, scale, enable_gqa))
        return self.attend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def attend(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Tensor:
        return REAL_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)


class NaNKernel(RecordingKernel):
    """A kernel that misbehaves on dead rows (S6), forward and backward; it records its calls too.

    It runs the real SDPA, then writes ``value`` (NaN by default) into

    - every row handed to it with no key to attend to (mask row all False or all -inf), and
    - every row ``dead`` marks, the rows the test knows are dead (which a safe caller may have handed
      over as ordinary rows): a bool tensor broadcastable to ``(b, h, i)``; or a function
      ``dead(q, k, v, attn_mask)`` giving one (or ``None``); or a mapping ``{role: (b, i) tensor or such
      a function}`` read for the role of the ``Attention`` now running (``self.role``, set by
      ``models.track_roles``; a tensor applies to calls of exactly ``b`` samples and ``i`` rows).

    Backward: ``value`` into the gradient of q at those rows and into the gradients of k and v at the
    keys no other row may see, whatever gradient flows in; rows handed no key at all also send the NaN
    gradients of a pre-2.5 softmax into every key of their sample. ``self.poisoned`` counts the rows
    ``(sample, query)`` it poisoned, so a test can show that it fired.
    """

    def __init__(self, dead: DeadRows = None, *, value: float = NAN):
        super().__init__()
        self.dead = dead
        self.value = value
        self.role: str | None = None
        self.poisoned = 0

    def told(self, q, k, v, attn_mask) -> Tensor | None:
        """The rows ``dead`` marks for this call, broadcastable to ``(b, h, i)``, or ``None``."""
        dead = self.dead
        if isinstance(dead, Mapping):
            dead = dead.get(self.role) if self.role is not None else None
            if isinstance(dead, Tensor):
                b, i = q.shape[0], q.shape[2]
                return dead[:, None, :] if tuple(dead.shape) == (b, i) else None
        if callable(dead):
            return dead(q, k, v, attn_mask)
        return dead

    def attend(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Tensor:
        b, h, i = q.shape[:3]
        keyless = keyless_rows(q, k, attn_mask)  # (b|1, h|1, i, 1)
        told = self.told(q, k, v, attn_mask)
        rows = keyless if told is None else keyless | told.to(q.device)[..., None]
        rows = rows.expand(b, h, i, 1)
        self.poisoned += int(rows.any(1).sum())
        bad_keys = _keys_only_bad_rows_see(attn_mask, rows, k.shape[-2])
        out = PoisonedSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, rows, bad_keys, self.value)
        if bool(keyless.any()):  # rows handed no key at all: a pre-2.5 softmax's NaN gradients as well
            old = _pre25_sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa)
            out = torch.where(keyless, old, out).masked_fill(keyless, self.value)
        return out


def faithful_kernel() -> NaNKernel:
    """The same substituted kernel writing 0 instead of NaN and told of no dead row: what a poisoned run
    is compared with, bit for bit (a substituted kernel returns its gradients from one autograd node,
    which can change the order in which the engine sums gradients by an ulp; comparing like with like
    keeps the test exact)."""
    return NaNKernel(value=0.0)


def _keys_only_bad_rows_see(attn_mask: Tensor | None, bad_rows: Tensor, j: int) -> Tensor:
    """``(b|1, 1, j, 1)``: keys that no row outside ``bad_rows (b, h, i, 1)`` may attend to, by the mask."""
    if attn_mask is None:
        return torch.zeros(1, 1, j, 1, dtype=torch.bool, device=bad_rows.device)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask != -INF
    while allowed.dim() < 4:
        allowed = allowed[None]
    seen = (allowed & ~bad_rows).any(dim=-2).any(dim=1)  # (b|1, j)
    return ~seen[:, None, :, None]


def _pre25_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale, enable_gqa: bool) -> Tensor:
    """Attention as kernels before torch 2.5 computed it: a plain softmax, so a row with no key to
    attend to is NaN in the forward pass, and its backward puts NaN into q, k and v even when the
    gradient flowing into that row is 0 (softmax backward multiplies by the NaN output)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale  # (b, h, i, j)
    if is_causal:
        attn_mask = torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # an additive -inf, so NaN flows back
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=q.device).masked_fill(~attn_mask, -INF)
    if attn_mask is not None:
        logits = logits + attn_mask.to(dtype)
    return (logits.softmax(dim=-1) @ v.to(dtype)).to(q.dtype)


class PoisonedSDPA(torch.autograd.Function):
    """The real SDPA, then ``value`` written into every row of ``bad_rows (b, h, i, 1)``; backward: into
    the gradient of q at those rows and into the gradients of k and v at ``bad_keys (b|1, 1, j, 1)``,
    whatever gradient flows in. The backward recomputes the real SDPA to get the true gradients first."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, bad_rows, bad_keys, value):
        ctx.save_for_backward(q, k, v, attn_mask, bad_rows, bad_keys)
        ctx.args = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        ctx.value = value
        out = REAL_SDPA(q, k, v, attn_mask=attn_mask, **ctx.args)
        return out.clone().masked_fill_(bad_rows, value)  # in place on a clone: the kernel's memory layout kept

    @staticmethod
    def backward(ctx, grad):
        q, k, v, attn_mask, bad_rows, bad_keys = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out = REAL_SDPA(qq, kk, vv, attn_mask=attn_mask, **ctx.args)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad)
        dq, dk, dv = _fill(dq, bad_rows, ctx.value), _fill(dk, bad_keys, ctx.value), _fill(dv, bad_keys, ctx.value)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _fill(t: Tensor, where: Tensor, value: float) -> Tensor:
    """``t`` with ``value`` at ``where``, in place when ``t`` owns its memory (the layout a kernel chose
    is kept); an expanded tensor (e.g. a broadcast zero gradient) is copied first."""
    if 0 in t.stride() or t._base is not None:
        t = t.clone()
    return t.masked_fill_(where, value)
