"""The attention part's decode step: one new position per sample over keys and values it keeps in place.

Shape legend: B samples (guidance branches times batch), h query heads, h_kv key/value heads, L the cache's
capacity, d head dim, c model width, j context length.

``Attention.forward(h, cache=AttentionStep(slots, inputs))`` (``h (B, 1, c)``) is the attention's own forward
for one position over a ``StaticKVCache`` (``core/static_cache.py``): the stack hands each attention block its
slots (``SelfSlots``: preallocated keys and values ``(B, h_kv, L, d)`` written in place at the step's slot;
``ContextSlots``: the context's keys and values, computed once) and the inputs every block of the step shares
(``StepInputs``: the slot, the self-attention mask, the rotation at each sample's position). Nothing here reads a
value back to the host, re-checks or re-selects anything: the slots were checked and their masked entries
selected to 0 when the cache was built, so every slot the kernel reads is finite.

The attention owns how it runs the step (``StepPlan``): where its projections are plain ``nn.Linear`` it
concatenates the q/k/v weights once per cache and calls one product per step (the same dot products, so the
same bits: tested), and calls ``to_q`` / ``to_out`` as functions; otherwise it calls its own seams
(``_project_q``, ``_project_kv``, ``_output``). A net with forward hooks (FSDP2's all-gathers, a user's probes)
gets no plan: its weights may be shards between calls, so every step calls the seams, inside the modules'
calls, which run the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import attend as _attend_module
from ..core.attend import from_kernel_heads, to_kernel_heads

__all__ = ["StepInputs", "SelfSlots", "ContextSlots", "AttentionStep", "StepPlan", "step_plan", "self_slots",
           "context_slots", "attention_step", "self_step", "cross_step", "rotary_tables", "rotate"]


class StepInputs(NamedTuple):
    """What every attention block of one step shares (built once per step by the stack).

    Attributes:
        slot: the slot the new position is written at: a host integer (eager: attend over slots ``[0, slot]``) or
            a 0-d long tensor (``fixed``: attend over every slot with the mask, fixed shapes for a compiled step).
        fixed: whether the step runs on fixed shapes.
        self_mask: ``(B, 1|h, 1, n_keys)`` bool mask of the slots a query may read, or an additive float bias with
            ``-inf`` at the unreadable ones (ALiBi), or ``None`` (every slot ``[0, slot]`` is readable).
        n_keys: the key slots read.
        rot: the rotation at each sample's position (``rotary_tables`` taken there), or ``None``.
        count: ``(B,)`` the new position of each sample (real tokens before it).
        positions: ``(B, n_keys)`` the position of each slot read (a window's distances, ``max_attend_past``).
        angles: the stack's position pair at the new position in the form ``Attention.forward`` takes
            (``(angles, angles)`` of rotary, PoPE's ``PolarAngles`` pair), for attentions that rotate with their own
            code (``StepPlan.own_qkv``), or ``None``.
        value_residual: ``(B, h_kv, 1, e)`` the first self-attention's new values (``add_value_residual``), or ``None``.
        planned: the plans' weights made once per cache (fused q/k/v) may be used: not when autograd records (their
            copies would pass no gradient to the parameters), then the seams run.
    """

    slot: int | Tensor
    fixed: bool
    self_mask: Tensor | None
    n_keys: int
    rot: object
    count: Tensor | None = None
    positions: Tensor | None = None
    angles: tuple | None = None
    value_residual: Tensor | None = None
    planned: bool = True


@dataclass(frozen=True)
class StepPlan:
    """How an attention runs the step: its fused q/k/v weights (self-attention), whether its query projection
    (cross-attention) and output projection are plain ``nn.Linear`` (called as functions).

    ``fused``: ``(weight, bias, sizes, rotate_together)``: the three weights (and biases) concatenated once,
    ``F.linear(h, weight, bias)`` split in ``sizes`` (``h d``, ``h_kv d``, ``h_kv d``); ``rotate_together``: no q/k
    norm sits between the projection and the rotation, so q and k rotate as one tensor. ``explicit``: the scoring
    options run on the explicit path (``attention_scoring.explicit_call``: softclamped logits, another score, sparse
    top-k, talking heads, ...), over the slots as over any keys (they are per-query: the new query's row is what the
    whole sequence's forward computes for it). ``own_qkv``: the attention projects and rotates with its own
    ``project_qkv`` (rotary on some heads only, latent rope sub-heads, PoPE, a value residual), given ``angles``.
    ``q_proj`` / ``out_proj``: the plain query / output projection's ``(weight, bias)`` (the parameters themselves,
    read once: no module attribute lookup per step), with ``plain_q`` / ``plain_out``; ``q_normed``: a query norm
    runs after the plain query projection (``norm_q``; otherwise it is the identity and is not called)."""

    fused: tuple | None = None
    plain_q: bool = False
    plain_out: bool = False
    explicit: bool = False
    own_qkv: bool = False
    options: bool = False  # any of: extra keys, l2 distance, a window, the projected position bias
    gqa: bool = False  # fewer key/value heads than query heads
    q_proj: tuple | None = None
    out_proj: tuple | None = None
    q_normed: bool = True


@dataclass
class SelfSlots:
    """A self-attention block's keys and values ``(B, h_kv, L, d)``: slots ``>= length`` are 0, masked slots 0.
    ``state``: with ``attn_hybrid_module``, the module's recurrent state after the positions so far, batch-first
    ``(B, layers * directions, H)`` (an LSTM: ``(h, c)``), written in place by each step; ``()`` without one."""

    keys: Tensor
    values: Tensor
    plan: StepPlan
    state: tuple = ()

    def _buffers(self) -> tuple:
        return (self.keys, self.values, *self.state)

    def _set(self, buffers) -> None:
        self.keys, self.values, *state = buffers
        self.state = tuple(state)

    def spare(self) -> tuple:
        """Buffers shaped like the keys, values and state (what ``select_`` gathers into)."""
        return tuple(torch.empty_like(t) for t in self._buffers())

    def select_(self, index: Tensor, spare: tuple | None) -> tuple | None:
        """Keep the samples ``index``; with ``spare`` (buffers of the same shape) gather into them and return the
        old ones (the next call's spare), so that a reorder of the same batch size allocates nothing."""
        if spare is None:
            self._set([t.index_select(0, index) for t in self._buffers()])
            return None
        for t, out in zip(self._buffers(), spare):
            torch.index_select(t, 0, index, out=out)
        old = self._buffers()
        self._set(spare)
        return old


@dataclass
class ContextSlots:
    """A cross-attention block's context keys and values ``(B, h_kv, j, d)`` (masked keys 0), the kernel's mask
    ``(B, 1, 1, j)`` (a sample with no context key sees key 0, its output then selected to 0) or ``None``, and
    ``live (B, 1, 1)``: the samples that see some context key (``None``: all do)."""

    keys: Tensor
    values: Tensor
    mask: Tensor | None
    live: Tensor | None
    plan: StepPlan

    def spare(self) -> None:
        return None

    def select_(self, index: Tensor, spare=None) -> None:
        sel = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        self.keys, self.values, self.mask, self.live = sel(self.keys), sel(self.values), sel(self.mask), sel(self.live)
        return None


class AttentionStep(NamedTuple):
    """``Attention.forward``'s ``cache=`` for one decode step: this block's slots and the step's shared inputs."""

    slots: SelfSlots | ContextSlots
    inputs: StepInputs


def step_plan(attn, kind: str, fast: bool, value_residual: bool = False) -> StepPlan:
    """The plan of ``attn`` for a ``kind`` (``"self"`` / ``"cross"``) block; ``fast=False``: the seams only;
    ``value_residual``: it projects with its own ``project_qkv`` (a value residual, separate q/k/v inputs)."""
    own = bool(attn.rope_subheads or attn.rotate_num_heads < attn.heads or getattr(attn, "polar_keys", False)
               or value_residual)
    options = bool(attn.extra_keys or attn.l2_distance or attn.max_attend_past is not None
                   or attn.rel_proj_pos_bias is not None)
    common = dict(explicit=bool(attn.explicit), options=options, gqa=attn.kv_heads != attn.heads)
    if not fast or own:
        return StepPlan(own_qkv=own and kind == "self", **common)
    plain_out = (attn.to_v_head_gate is None and attn.to_v_gate is None and attn.to_output_gate is None
                 and attn.head_scale_params is None and (attn.sublayer_dropout is None or not attn.training)
                 and type(attn.to_out) is nn.Linear)
    common["out_proj"] = (attn.to_out.weight, attn.to_out.bias) if plain_out else None
    if kind == "cross":
        plain_q = attn.to_latent_q is None and type(attn.to_q) is nn.Linear
        return StepPlan(plain_q=plain_q, plain_out=plain_out, q_proj=(attn.to_q.weight, attn.to_q.bias) if plain_q
                        else None, q_normed=bool(attn.qk_normed), **common)
    return StepPlan(fused=_fused_qkv(attn), plain_out=plain_out, **common)


def _fused_qkv(attn) -> tuple | None:
    """The fused projection of ``attn``, or ``None`` where its projections are not three plain ``nn.Linear`` of the
    same input (latent q/kv, rotary sub-heads, wrapped projections): the step then calls the seams."""
    lins = (attn.to_q, attn.to_k, attn.to_v)
    if (attn.to_latent_q is not None or attn.to_latent_kv is not None or attn.rope_subheads
            or any(type(lin) is not nn.Linear for lin in lins)):
        return None
    biases = [lin.bias for lin in lins]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in lins])
        bias = None if biases[0] is None else torch.cat(biases)
    return weight, bias, tuple(int(lin.out_features) for lin in lins), not attn.qk_normed


def self_slots(attn, k: Tensor, v: Tensor, mask: Tensor | None, capacity: int, fast: bool,
               value_residual: bool = False, views: bool = False, state=None,
               plan: StepPlan | None = None) -> SelfSlots:
    """``attn``'s slots from a prefill's keys and values ``(B, h_kv, p, d)`` (``mask (B, p)``: which are real): room
    for ``capacity`` slots, masked slots selected to 0 once (whatever a cache handed in held there). ``value_residual``
    / ``views``: it mixes a value residual / gets separate query, key and value inputs (its own ``project_qkv``).
    ``state``: with ``attn_hybrid_module``, the prefill cache's state of the module (``KVCache.hybrid``; ``None``: the
    initial state, zeros), copied into buffers the steps write in place. ``plan``: a plan already made for ``attn``
    (another loop step's slots of the same block run), or ``None``."""
    p = k.shape[2]
    kb = k.new_zeros(*k.shape[:2], capacity, k.shape[3])
    vb = v.new_zeros(*v.shape[:2], capacity, v.shape[3])
    if mask is None:
        kb[:, :, :p], vb[:, :, :p] = k, v
    else:
        keep = mask[:, None, :, None]
        kb[:, :, :p], vb[:, :, :p] = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    plan = step_plan(attn, "self", fast, value_residual or views) if plan is None else plan
    return SelfSlots(kb, vb, plan, () if attn.hybrid is None else _hybrid_state(attn.hybrid, state, k))


def _hybrid_state(branch, state, k: Tensor) -> tuple:
    """The hybrid module's state buffers ``(B, layers * directions, H)`` (an LSTM: two), from the prefill's ``state``
    (batch-first tensors) or zeros (``None``: the module's initial state)."""
    if isinstance(state, str) or not branch.can_cache:
        raise ValueError(f"the static decode step cannot continue the hybrid module: "
                         f"{state if isinstance(state, str) else branch.cache_refusal()}")
    rnn = branch.hybrid_module.fn
    if state is None:
        shape = (k.shape[0], rnn.num_layers * (2 if rnn.bidirectional else 1), rnn.hidden_size)
        return tuple(k.new_zeros(shape) for _ in range(2 if isinstance(rnn, nn.LSTM) else 1))
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in state)


def context_slots(attn, k: Tensor, v: Tensor, context_mask: Tensor | None, fast: bool) -> ContextSlots:
    """``attn``'s slots from the context's keys and values ``(B, h_kv, j, d)`` and its mask ``(B, j)``."""
    plan = step_plan(attn, "cross", fast)
    if context_mask is None:
        return ContextSlots(k, v, None, None, plan)
    keep = context_mask[:, None, :, None]
    if attn.num_mem_kv or attn.add_zero_kv:  # every query reads the memory (or zero) keys: no row without a key
        return ContextSlots(torch.where(keep, k, 0.0), torch.where(keep, v, 0.0), context_mask[:, None, None, :],
                            None, plan)
    live = context_mask.any(dim=1)  # (B,)
    first = torch.zeros_like(context_mask)
    if context_mask.shape[1]:
        first[:, 0] = True
    kernel_mask = (context_mask | (~live[:, None] & first))[:, None, None, :]  # a dead row sees key 0
    return ContextSlots(torch.where(keep, k, 0.0), torch.where(keep, v, 0.0), kernel_mask, live[:, None, None], plan)


def attention_step(attn, h: Tensor, step: AttentionStep, kv_input: tuple | None = None,
                   prev_attn: Tensor | None = None):
    """The output ``(B, 1, c)`` of ``attn`` for the new position ``h (B, 1, c)``; a self-attention writes its new key
    and value at the step's slot first. ``kv_input``: separate key and value inputs ``(B, 1, c)`` each (the stack's
    ``qkv_receive_diff_residuals`` / ``integrate_layers`` views). ``prev_attn``: the previous attention's logits
    (``residual_attn``): then ``(out, logits)`` are returned, the logits ``(B, h, 1, n)`` for the next."""
    slots, inputs = step
    kernel = _attend_module._kernel  # read per call: tests substitute a misbehaving kernel
    if type(slots) is SelfSlots:
        return self_step(attn, slots, h, inputs, kernel, kv_input, prev_attn)
    return cross_step(attn, slots, h, kernel, prev_attn)


def self_step(attn, s: SelfSlots, h: Tensor, inputs: StepInputs, kernel, kv_input=None, prev_attn=None):
    """``attention_step`` of a self-attention block on its slots ``s`` (``kernel``: the fused kernel, read once per
    step by the caller): what the stack's step calls directly for a net without hooks."""
    slot, rot = inputs.slot, inputs.rot
    if s.plan.fused is not None and kv_input is None and inputs.planned:
        q, k, v = _project_fused(attn, s.plan.fused, h, rot)
    elif s.plan.own_qkv or kv_input is not None:  # the attention's own projections, rotation and value mix
        from .attention_projections import project_qkv

        q, k, v, _ = project_qkv(attn, h, h, None, None, None, kv_input, None, inputs.value_residual, inputs.angles,
                                 None, None, None, 1)
    else:
        q = attn._project_q(h).transpose(1, 2)  # (B, h, 1, d)
        k, v = attn._project_kv(h)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, h_kv, 1, d)
        if rot is not None:
            q, k = rotate(q, rot), rotate(k, rot)
    kb, vb = s.keys, s.values
    if inputs.fixed:
        kb.index_copy_(2, slot[None], k)
        vb.index_copy_(2, slot[None], v)
    else:
        kb.narrow(2, slot, 1).copy_(k)
        vb.narrow(2, slot, 1).copy_(v)
        kb, vb = kb.narrow(2, 0, inputs.n_keys), vb.narrow(2, 0, inputs.n_keys)
    self_mask, plan = inputs.self_mask, s.plan
    if plan.options:
        if attn.max_attend_past is not None:  # x-transformers' window: slots too far back are not read
            self_mask = _window(self_mask, (inputs.count[:, None] - inputs.positions) > attn.max_attend_past)
        if attn.rel_proj_pos_bias is not None:  # its bias from the new position's input and the slots' distances
            rp = attn.rel_proj_pos_bias(h, seq_len_k=inputs.n_keys, positions=(inputs.count[:, None], inputs.positions))
            self_mask = _plus_bias(self_mask, rp.to(h.dtype))
        if attn.extra_keys:  # [sink?, zero key?, memory keys] before the slots, seen by every query
            kb, vb, self_mask = _with_extra(attn, kb, vb, self_mask, h)
    logits = None
    if plan.explicit or prev_attn is not None:
        out, logits = _explicit(attn, q, kb, vb, self_mask, prev_attn)
    elif plan.options and attn.l2_distance:  # the attention's own kernel seam (its keys widened by |k|^2)
        out = _kernel_seam(attn, q, kb, vb, self_mask)
    else:
        q, mask_h, _ = to_kernel_heads(attn, q, self_mask)  # x-transformers' tiled kv heads: interleaved
        out = from_kernel_heads(attn, kernel(q, kb, vb, attn_mask=mask_h, enable_gqa=plan.gqa))
    out = out.transpose(1, 2)  # (B, 1, h, d)
    if s.state:  # attn_hybrid_module: its output on the new position mixed in, its state carried on
        out = _hybrid_step(attn.hybrid, s, out, h)
    if plan.out_proj is not None:
        out = F.linear(out.flatten(-2), *plan.out_proj)
    else:
        out = attn._output(out, h)
    return out if prev_attn is None else (out, logits)


def _hybrid_step(branch, s: SelfSlots, out: Tensor, h: Tensor) -> Tensor:
    """The hybrid branch's forward (``HybridBranch.forward``) on the new position ``h (B, 1, c)`` (a real one) from the
    state the slots hold, mixed with the attention's ``out (B, 1, h, d)``; the new state written into the buffers."""
    from .hybrid import HybridCall

    state = s.state if not torch.is_grad_enabled() else tuple(t.clone() for t in s.state)  # (autograd: not the buffers)
    call = HybridCall(state=state)
    mixed = branch(out, h, call, None)
    for buf, new in zip(s.state, call.state_out):
        buf.copy_(new)
    return mixed


def cross_step(attn, s: ContextSlots, h: Tensor, kernel, prev_attn=None):
    """``attention_step`` of a cross-attention block over its context slots ``s``."""
    plan = s.plan
    if plan.q_proj is not None:
        q = F.linear(h, *plan.q_proj).unflatten(-1, (attn.heads, attn.dim_head))
        q = (attn.norm_q(q) if plan.q_normed else q).transpose(1, 2)
    else:
        q = attn._project_q(h).transpose(1, 2)
    keys, values, mask = s.keys, s.values, s.mask
    if plan.options and attn.extra_keys:
        keys, values, mask = _with_extra(attn, keys, values, mask, h)
    logits = None
    if plan.explicit or prev_attn is not None:
        out, logits = _explicit(attn, q, keys, values, mask, prev_attn)
    elif plan.options and attn.l2_distance:
        out = _kernel_seam(attn, q, keys, values, mask)
    else:
        q, mask_h, _ = to_kernel_heads(attn, q, mask)
        out = from_kernel_heads(attn, kernel(q, keys, values, attn_mask=mask_h, enable_gqa=plan.gqa))
    if s.live is not None:  # a sample with no context key: exactly 0 (after a bias too)
        out = torch.where(s.live[..., None], out, 0.0)
    if plan.out_proj is not None:
        weight, bias = plan.out_proj
        out = F.linear(out.transpose(1, 2).flatten(-2), weight, bias)
        out = out if s.live is None or bias is None else torch.where(s.live[:, :, 0, None], out, 0.0)
    else:
        rows_ok = None if s.live is None or attn.out_bias is None else s.live[:, :, 0]  # (only with a dropped context)
        out = attn._output(out.transpose(1, 2), h, None, rows_ok)
    if prev_attn is None:
        return out
    if s.live is not None:  # a sample without context keys: its logits are 0, as the stack's forward gives them
        logits = torch.where(s.live[..., None], logits, 0.0)
    return out, logits


def _with_extra(attn, k: Tensor, v: Tensor, mask: Tensor | None, h: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """The slots with ``attn``'s extra keys before them (``attention_keys.prepend_extra``: the sink's and the zero
    key's key and value 0, the memory keys normed as its keys are) and the mask or bias over them
    (``attention_keys.extend``: every query sees them, the sink at its learned logit); the live samples' rows all
    see a real key (their own new one), so nothing else changes."""
    from .attention_keys import extend, prepend_extra

    n = k.shape[2]
    k, v = prepend_extra(attn, k, v)
    bias = None
    if mask is not None and mask.is_floating_point():
        mask, bias = None, mask
    mask, bias = extend(attn, mask, bias, h.shape[0], 1, n, h)
    if bias is None:
        return k, v, mask
    return k, v, bias if mask is None else bias.masked_fill(~mask, float("-inf"))


def _plus_bias(mask: Tensor | None, bias: Tensor) -> Tensor:
    """``mask`` (``None``, a bool mask or an additive bias) with ``bias`` added (``-inf`` where the mask is False)."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return mask + bias


def _kernel_seam(attn, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """The attention's own fused-kernel call (``attention_scoring.kernel_call``, which widens l2 distance's keys),
    over slots that are finite (masked ones 0): ``mask`` a bool mask of the readable slots or an additive bias."""
    from .attention_scoring import kernel_call

    bias = None
    if mask is not None and mask.is_floating_point():
        mask, bias = None, mask
    return kernel_call(attn, q, k, v, mask, False, bias, None, True)


def _window(mask: Tensor | None, far: Tensor) -> Tensor:
    """``mask`` (``None``, a bool mask or an additive bias) with the slots ``far (B, n)`` unreadable as well (the
    new position's own slot is never far: no row loses every key)."""
    far = far[:, None, None, :]
    if mask is None:
        return ~far
    if mask.dtype == torch.bool:
        return mask & ~far
    return mask.masked_fill(far, float("-inf"))


def _explicit(attn, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, prev_attn: Tensor | None = None) -> tuple:
    """The explicit path over the slots: ``(out (B, h, 1, e), logits or None)``, the logits (for the next attention's
    ``prev_attn``: ``residual_attn``) when ``prev_attn`` is given (a tensor, or ``True`` for the first attention).
    ``mask``: a bool mask of the readable slots or an additive bias with ``-inf`` at the others (ALiBi)."""
    from .attention_scoring import explicit_call

    bias = None
    if mask is not None and mask.is_floating_point():
        mask, bias = None, mask
    want = prev_attn is not None
    out, _, logits = explicit_call(attn, q, k, v, mask, False, bias, None, want,
                                   prev_attn if isinstance(prev_attn, Tensor) else None)
    return out, logits


def _project_fused(attn, fused: tuple, h: Tensor, rot) -> tuple[Tensor, Tensor, Tensor]:
    """``q (B, h, 1, d)``, ``k, v (B, h_kv, 1, d)`` of ``h (B, 1, c)`` through the fused projection, q/k/v-normed and
    rotated as ``_project_q`` / ``_project_kv`` and ``rotate`` do (q and k rotated as one tensor when no norm sits
    between the projection and the rotation)."""
    weight, bias, (nq, nk, _), rotate_together = fused
    heads, kv_heads, d = attn.heads, attn.kv_heads, attn.dim_head
    qkv = F.linear(h, weight, bias)  # (B, 1, h d + 2 h_kv d)
    v = qkv[..., nq + nk:].unflatten(-1, (kv_heads, -1))  # (values may be another width: value_dim_head)
    if attn.v_norm is not None:
        v = attn.v_norm(v)
    if rot is not None and rotate_together:
        qk = rotate(qkv[..., :nq + nk].unflatten(-1, (heads + kv_heads, d)), rot)  # (B, 1, h + h_kv, d)
        return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)
    q = qkv[..., :nq].unflatten(-1, (heads, d))
    k = qkv[..., nq:nq + nk].unflatten(-1, (kv_heads, d))
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if rot is not None:
        q, k = rotate(q, rot), rotate(k, rot)
    return q, k, v.transpose(1, 2)


def rotary_tables(rotary, dim_head: int, capacity: int, dtype: torch.dtype, device, fixed: bool = False):
    """``rotary`` (a ``RotaryEmbedding``) at every position ``[0, capacity]``, one angle per pair of features
    (features past the rotary width: angle 0, passed through).

    Eager: ``cis (capacity + 1, d / 2)``, unit complex numbers ``cos + i sin`` (complex64; complex128 for a float64
    model): ``rotate`` multiplies the pairs by them, one op. ``fixed`` (the compiled step): ``(cos, sin, swap)`` real
    tables ``(capacity + 1, d)`` and a pair swap, ``t * cos + t[..., swap] * sin`` (inductor fuses it; it generates
    no complex code). Both give ``apply_rotary``'s bits (tested)."""
    d = dim_head
    positions = torch.arange(capacity + 1, device=device)[None]
    angles = rotary.angles(positions, dtype=dtype)[0, 0]  # (L + 1, d_rot), pairs share an angle
    if not fixed:
        half = angles[:, 0::2]  # (L + 1, d_rot / 2)
        cis = torch.ones(capacity + 1, d // 2, device=device,
                         dtype=torch.complex128 if half.dtype == torch.float64 else torch.complex64)
        cis[:, : half.shape[1]] = torch.complex(half.cos(), half.sin())
        return cis
    rot = angles.shape[-1]
    cos = torch.ones(capacity + 1, d, dtype=angles.dtype, device=device)
    sin = torch.zeros(capacity + 1, d, dtype=angles.dtype, device=device)
    cos[:, :rot] = angles.cos()
    sign = torch.tensor([-1.0, 1.0], dtype=angles.dtype, device=device).repeat(rot // 2)
    sin[:, :rot] = angles.sin() * sign
    swap = torch.arange(d, device=device).view(-1, 2).flip(-1).flatten()
    return cos, sin, swap


def rotate(t: Tensor, rot) -> Tensor:
    """``apply_rotary`` at each sample's position, through ``rotary_tables`` taken at the positions: the pairs
    ``(x1, x2)`` of ``t (..., d)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)``, each a product then a sum as
    ``apply_rotary`` computes them. ``rot``: ``cis (B, 1, 1, d / 2)`` (the pairs as complex numbers times it), or
    ``(cos, sin, swap)`` (the compiled step). Computed in the tables' real dtype, then cast back."""
    if isinstance(rot, tuple):
        cos, sin, swap = rot
        tf = t.to(cos.dtype)
        return (tf * cos + tf.index_select(-1, swap) * sin).to(t.dtype)
    tf = t.to(torch.float64 if rot.dtype == torch.complex128 else torch.float32).unflatten(-1, (-1, 2))
    if tf.stride(-1) != 1 or tf.storage_offset() % 2 or any(st % 2 for st in tf.stride()[:-1]):
        tf = tf.contiguous()  # a complex view needs whole pairs in memory
    return torch.view_as_real(torch.view_as_complex(tf) * rot).flatten(-2).to(t.dtype)
