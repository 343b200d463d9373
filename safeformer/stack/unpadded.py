"""The unpadded path: a layer stack run on the real tokens only.

Shape legend: b batch, n positions, T real tokens in all (packed, sample after sample, in order),
c model width, K condition width, j context length, L a group's longest sample.

Norms, projections, feed-forward, residuals (and a wrapper's output head) run on the packed ``(T, c)``
real tokens; attention runs on a layout chosen here, once per forward:

- ``VarlenSelfLayout``: CUDA's varlen kernel over the packed tokens (``plan_varlen`` chose it);
- ``GroupedSelfLayout``: samples sorted by length and split into groups (``length_groups``), each
  group's real tokens compacted to the left of a ``(b_g, L_g)`` layout, in order, so causal attention
  needs no mask tensor;
- ``PackedCrossLayout``: cross-attention from the packed queries, scattered into the padded query
  layout, to the context's real rows.

``plan_unpadded`` decides whether the path runs (``unpadded``: True, False or ``"auto"`` above
``UNPADDED_THRESHOLD`` padding) with one host sync (the per-sample counts), and returns an
``UnpaddedPlan`` that the stack and the wrapper's output head both reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..core.attend import SelectedMask, attend, from_kernel_heads, to_kernel_heads
from ..core.varlen import (
    VarlenLayout,
    VarlenPlan,
    plan_varlen,
    varlen_attention,
    varlen_kernel_available,
    varlen_layout,
)
from ..nn.block import apply_norm
from ..nn.modules import alibi_bias, apply_rotary

__all__ = ["UNPADDED_THRESHOLD", "UnpaddedPlan", "plan_unpadded", "LengthGroup", "GroupedSelfLayout",
           "VarlenSelfLayout", "PackedCrossLayout", "length_groups", "stack_varlen_plan", "forward_unpadded", "attend_layout"]

# the padding fraction from which "auto" runs the stack on real tokens only: measured with
# `python benchmarks/unpadded.py --sweep` (benchmarks/results/unpadded_threshold.md), the unpadded path
# already wins at 6-12% padding on the CPU (0.95x / 0.89x the padded path's step time)
UNPADDED_THRESHOLD = 0.1


@dataclass(frozen=True)
class UnpaddedPlan:
    """The real tokens of a ``(b, n)`` batch, found once per forward.

    Attributes:
        idx: ``(T,)`` flat positions of the real tokens in ``(b, n)``, in order.
        bi: ``(T,)`` the sample of each real token.
        counts: real tokens per sample (on the host).
        b, n: the padded batch's shape.
    """

    idx: Tensor
    bi: Tensor
    counts: tuple[int, ...]
    b: int
    n: int

    def pack(self, t: Tensor) -> Tensor:
        """``(b, n, ...)`` -> ``(T, ...)``: the real tokens' rows."""
        return t.reshape(self.b * self.n, *t.shape[2:]).index_select(0, self.idx)

    def unpack(self, t: Tensor) -> Tensor:
        """``(T, ...)`` -> ``(b, n, ...)``: padded positions exactly 0."""
        return t.new_zeros(self.b * self.n, *t.shape[1:]).index_copy(0, self.idx, t).view(self.b, self.n, *t.shape[1:])


def auto_unpads_on(device: torch.device) -> bool:
    """Whether ``unpadded="auto"`` may take the unpadded path on ``device``: everywhere but on CUDA without
    PyTorch's varlen Flash kernel (see ``plan_unpadded``)."""
    return torch.device(device).type != "cuda" or varlen_kernel_available(device)


def plan_unpadded(mode, mask: Tensor | None, *, packable: bool = True, cache=None, return_cache: bool = False,
                  attn_mask: Tensor | None = None, return_hiddens: bool = False) -> UnpaddedPlan | None:
    """The plan of the unpadded path, or ``None`` when the padded path runs.

    ``mode`` is the stack's ``unpadded`` (True, False or ``"auto"``: at least ``UNPADDED_THRESHOLD`` of the
    positions are padding; on CUDA only where PyTorch's varlen Flash kernel runs). The path needs a padding
    mask and no cache, extra mask or intermediates; it does not run under ``torch.compile`` (the gather's
    size is data-dependent). One host sync: the counts.

    On CUDA without the varlen kernel (torch before 2.12, or a GPU before sm80) ``"auto"`` keeps the padded
    path: measured on an H200 with torch 2.11 (benchmarks/results/unpadded_cuda.md), the unpadded path's
    length groups made a training step 2.0x-2.5x slower than the padded path, and its group layout cost
    six host syncs per forward.
    """
    if mask is None or cache is not None or return_cache or attn_mask is not None or return_hiddens \
            or mode is False or mask.numel() == 0 or not packable or torch.compiler.is_compiling() \
            or torch._C._are_functorch_transforms_active():  # a gather of data-dependent size: padded under torch.func
        return None
    if mode == "auto" and not auto_unpads_on(mask.device):
        return None
    b, n = mask.shape
    counts = tuple(mask.sum(1).tolist())  # the one host sync: every size below derives from it
    total = sum(counts)
    if mode != "auto" or 1.0 - total / max(b * n, 1) >= UNPADDED_THRESHOLD:
        idx = torch.nonzero_static(mask.reshape(-1), size=total).squeeze(1)  # (T,)
        return UnpaddedPlan(idx, torch.div(idx, n, rounding_mode="floor"), counts, b, n)
    return None


@dataclass(frozen=True)
class LengthGroup:
    """Samples of similar length compacted to the left of a ``(b_g, L)`` layout.

    Attributes:
        tok: ``(T_g,)`` the group's tokens (indices into the packed tokens); ``dest``: their slots in
            the flattened ``(b_g * L)`` layout. ``key_pad (b_g, L)``: real slots; ``pos (b_g, L)``: positions.
    """

    tok: Tensor
    dest: Tensor
    b: int
    length: int
    key_pad: Tensor
    pos: Tensor


@dataclass(frozen=True)
class GroupedSelfLayout:
    """Self-attention per length group (``length_groups``); ``rotary(pos, dtype)``, ``bias(pos, dtype)``
    give the angles and the additive bias of a group's positions."""

    groups: tuple[LengthGroup, ...]
    causal: bool
    rotary: Callable | None
    bias: Callable | None

    def attend(self, attn, h: Tensor) -> Tensor:
        """``Attention`` ``attn`` on this layout (``attend_layout``)."""
        return attend_layout(attn, h, self)


@dataclass(frozen=True)
class VarlenSelfLayout:
    """Self-attention with the varlen kernel over the packed tokens (CUDA; ``plan_varlen`` chose it)."""

    layout: VarlenLayout
    positions: Tensor  # (T,)
    plan: VarlenPlan
    causal: bool
    rotary: Callable | None

    def attend(self, attn, h: Tensor) -> Tensor:
        """``Attention`` ``attn`` on this layout (``attend_layout``)."""
        return attend_layout(attn, h, self)


@dataclass(frozen=True)
class PackedCrossLayout:
    """Cross-attention from packed queries: ``rows`` are the context's real rows ``(R, c_ctx)`` at flat
    positions ``cidx`` of ``(b, j)`` (``None``: every row is real); ``mask (b, 1, 1, j)`` its padding."""

    plan: UnpaddedPlan
    rows: Tensor
    cidx: Tensor | None
    j: int
    mask: Tensor | None

    def attend(self, attn, h: Tensor) -> Tensor:
        """``Attention`` ``attn`` on this layout (``attend_layout``)."""
        return attend_layout(attn, h, self)


def length_groups(plan: UnpaddedPlan, positions: Tensor) -> tuple[LengthGroup, ...]:
    """Samples sorted by their number of real tokens and split into groups (a dynamic programme over
    ``sum(b_g * L_g**2)`` plus a fixed cost per group). Real tokens keep their order, so causal and
    key-padding attention see exactly the keys of the padded path."""
    b, n, counts = plan.b, plan.n, plan.counts
    offsets = [0]
    for cnt in counts:
        offsets.append(offsets[-1] + cnt)
    order = sorted((s for s in range(b) if counts[s] > 0), key=lambda s: counts[s])
    lens = [counts[s] for s in order]
    overhead = max(n * n // 8, 64)
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):  # best[j]: cost of the first j samples
        for i in range(max(0, j - 64), j):
            cost = best[i] + (j - i) * lens[j - 1] ** 2 + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], len(order)
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    device = plan.idx.device
    pos_p = plan.pack(positions.expand(b, n)[..., None])[:, 0]  # (T,)
    groups = []
    for i, j in reversed(bounds):
        samples = order[i:j]
        L = counts[samples[-1]]
        tok, dest = [], []
        for slot, smp in enumerate(samples):
            tok.extend(range(offsets[smp], offsets[smp] + counts[smp]))
            dest.extend(range(slot * L, slot * L + counts[smp]))
        tok_t = torch.tensor(tok, device=device)
        dest_t = torch.tensor(dest, device=device)
        cnt = torch.tensor([counts[smp] for smp in samples], device=device)
        key_pad = torch.arange(L, device=device)[None] < cnt[:, None]  # (b_g, L_g)
        pos = torch.zeros(len(samples) * L, dtype=pos_p.dtype, device=device)
        pos = pos.index_copy(0, dest_t, pos_p.index_select(0, tok_t)).view(len(samples), L)
        groups.append(LengthGroup(tok_t, dest_t, len(samples), L, key_pad, pos))
    return tuple(groups)


def stack_varlen_plan(stack, x: Tensor) -> VarlenPlan:
    """Whether ``stack``'s self-attention runs the varlen kernel (``plan_varlen``: CUDA, half precision,
    no ALiBi, no dropout) or the compacted padded groups."""
    attn = next(blk.mixer for blk in stack.layers if blk.kind == "self")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return plan_varlen(device_type=x.device.type, dtype=dtype, head_dim=attn.dim_head, heads=attn.heads,
                       kv_heads=attn.kv_heads, causal=stack.causal,
                       has_bias=stack.alibi_slopes is not None or getattr(stack, "rel_pos", None) is not None,
                       dropout_p=attn.dropout if stack.training else 0.0, backend=attn.backend)


def _self_layout(stack, plan: UnpaddedPlan, positions: Tensor, x: Tensor):
    vplan = stack_varlen_plan(stack, x)
    rotary = None if stack.rotary is None else (lambda pos, dt: stack.rotary.angles(pos, dtype=dt))
    if vplan.path == "varlen":
        pos_p = plan.pack(positions.expand(plan.b, plan.n)[..., None])[:, 0]  # (T,)
        return VarlenSelfLayout(varlen_layout(list(plan.counts), device=x.device), pos_p, vplan, stack.causal, rotary)

    slopes, rel_pos = stack.alibi_slopes, getattr(stack, "rel_pos", None)
    bias = None if slopes is None else (lambda pos, dt: alibi_bias(slopes, pos, pos).to(dt))
    if rel_pos is not None:  # T5's relative position bias
        bias = lambda pos, dt: rel_pos.bias(pos, pos).to(dt)  # noqa: E731
    return GroupedSelfLayout(length_groups(plan, positions), stack.causal, rotary, bias)


def forward_unpadded(stack, x: Tensor, plan: UnpaddedPlan, positions: Tensor, context: Tensor | None,
                     context_mask: Tensor | None, cond: Tensor | None) -> Tensor:
    """``stack``'s blocks on the real tokens of ``x (b, n, c)``; returns ``(b, n, c)``, padded rows 0.

    Same results as the padded path to the dtype's tolerance: q, k, v are scattered into zeros, so every
    slot that is not a real token is an exact zero.
    """
    b = plan.b
    self_layout = None if stack.only_cross else _self_layout(stack, plan, positions, x)
    xp = plan.pack(x)  # (T, c)
    condp = None if cond is None else cond.index_select(0, plan.bi)  # (T, K)
    cross_layout = None
    if context is not None:  # the context's keys/values from its real rows only
        j = context.shape[1]
        flat = context.reshape(b * j, context.shape[-1])
        if context_mask is not None:
            cidx = context_mask.reshape(-1).nonzero().squeeze(1)
            cross_layout = PackedCrossLayout(plan, flat.index_select(0, cidx), cidx, j, context_mask[:, None, None, :])
        else:
            cross_layout = PackedCrossLayout(plan, flat, None, j, None)
    drop_path = stack.training and stack.layer_dropout > 0
    recompute = stack.checkpoint_layers and stack.training and torch.is_grad_enabled()

    def branch(block, xp: Tensor, condp: Tensor | None) -> Tensor:
        if block.kind == "ff":
            return block(xp, condp)[0]
        return block(xp, condp, layout=self_layout if block.kind == "self" else cross_layout)[0]

    for block in stack.layers:
        if block.kind == "cross" and context is None:
            continue
        if recompute:
            out = checkpoint(lambda t, c_, blk=block: branch(blk, t, c_), xp, condp, use_reentrant=False)
        else:
            out = branch(block, xp, condp)
        if drop_path:
            keep = (torch.rand(b, device=x.device) >= stack.layer_dropout).index_select(0, plan.bi)[:, None]
            out = torch.where(keep, out / (1.0 - stack.layer_dropout), 0.0)
        xp = xp + out
    return plan.unpack(apply_norm(stack.final_norm, xp, condp))


def attend_layout(attn, h: Tensor, layout) -> Tensor:
    """``Attention`` ``attn`` on the unpadded path: its projections and output projection (its one seam) on
    the packed real tokens ``h (T, c)``, attention on ``layout``'s own arrangement of them (padded slots
    exact zeros)."""
    if not attn.packable:  # one place says why: the extra keys and the clamp run on the padded path
        raise ValueError("memory keys/values, a learned sink and softclamp run on the padded path only")
    dropout_p = attn.dropout if attn.training else 0.0
    if isinstance(layout, VarlenSelfLayout):  # CUDA: Flash varlen over the packed tokens
        q, (k, v) = attn._project_q(h), attn._project_kv(h)  # (T, h, d), (T, h_kv, d)
        if layout.rotary is not None:
            angles = layout.rotary(layout.positions[None], q.dtype)[0, 0][:, None]  # (T, 1, rot)
            q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        order, restore = attn.kernel_head_order, attn.kernel_head_restore  # (T, h, d): heads on dim 1
        q = q if order is None else q.index_select(1, order)
        out = varlen_attention(q, k, v, layout.layout, causal=layout.causal, plan=layout.plan)
        return attn._output(out if restore is None else out.index_select(1, restore), h)
    if isinstance(layout, GroupedSelfLayout):  # self-attention on compacted per-group layouts
        q_all, (k_all, v_all) = attn._project_q(h), attn._project_kv(h)  # (T, h, d), (T, h_kv, d)
        out_all = q_all.new_zeros(q_all.shape)
        for g in layout.groups:
            q, k, v = (_scatter(t.index_select(0, g.tok), g.dest, g.b, g.length) for t in (q_all, k_all, v_all))
            if layout.rotary is not None:
                angles = layout.rotary(g.pos, q.dtype)
                q, k = apply_rotary(q, angles), apply_rotary(k, angles)
            bias = None if layout.bias is None else layout.bias(g.pos, q.dtype)
            # real tokens are compacted to the left in order: causal needs no mask tensor (a real query
            # sees no padded key), a bidirectional stack needs the key padding
            key_pad = None if layout.causal and bias is None else g.key_pad
            backend = attn.backend  # a learned bias (T5's) trains through the mask: not on flash / cuDNN
            if backend in ("flash", "cudnn") and bias is not None and bias.requires_grad:
                backend = "math"
            q, _, bias = to_kernel_heads(attn, q, None, bias)  # x-transformers' tiled kv heads: interleaved
            o = from_kernel_heads(attn, attend(q, k, v, mask=SelectedMask(key_pad), causal=layout.causal, bias=bias,
                                               dropout_p=dropout_p, backend=backend))
            o = o.transpose(1, 2).flatten(0, 1).index_select(0, g.dest)  # (T_g, h, d)
            out_all = out_all.index_copy(0, g.tok, o)
        if not layout.groups:  # no real token at all: the projections still take part (zero gradients, no
            # missing ones: a data-parallel reduction expects every parameter on every rank)
            out_all = out_all + (q_all.sum() + k_all.sum() + v_all.sum()) * 0  # empty sums: exactly 0
            if layout.bias is not None:  # a learned bias (T5's) too: zero gradients, not missing ones
                none = torch.zeros(1, 0, dtype=torch.long, device=h.device)
                out_all = out_all + layout.bias(none, out_all.dtype).sum() * 0
        return attn._output(out_all, h)
    if not isinstance(layout, PackedCrossLayout):
        raise TypeError(f"layout must be an unpadded layout, got {type(layout).__name__}")
    plan = layout.plan
    q = _scatter(attn._project_q(h), plan.idx, plan.b, plan.n)  # (b, h, n, d)
    k, v = (_scatter(t, layout.cidx, plan.b, layout.j) for t in attn._project_kv(layout.rows))  # (b, h_kv, j, d)
    q = to_kernel_heads(attn, q)[0]
    out = from_kernel_heads(attn, attend(q, k, v, mask=SelectedMask(layout.mask), dropout_p=dropout_p,
                                         backend=attn.backend))
    out = plan.pack(out.transpose(1, 2))  # (T, h, d)
    rows_ok = None
    if attn.out_bias is not None:  # a bias would move dead rows off 0
        if layout.j == 0:  # a zero-length context: every row is dead
            rows_ok = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        elif layout.mask is not None:
            rows_ok = layout.mask.any(dim=-1).any(dim=1).expand(plan.b, plan.n).reshape(-1).index_select(0, plan.idx)
    return attn._output(out, h, rows_ok=rows_ok)


def _scatter(t: Tensor, index: Tensor | None, b: int, n: int) -> Tensor:
    """Packed rows ``(T, h, d)`` placed at flat positions ``index`` of ``(b, n)`` among zeros (``None``:
    ``t`` holds every position) -> ``(b, h, n, d)``."""
    if index is not None:
        t = t.new_zeros(b * n, *t.shape[1:]).index_copy(0, index, t)
    return t.view(b, n, *t.shape[1:]).transpose(1, 2)
