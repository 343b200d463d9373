"""The decode step as the model's own forward: ``net(new, cache=static)`` on a ``StaticKVCache``.

Shape legend: B samples, c model width, v vocabulary (or output features), L the cache's capacity.

``build_static_cache(net, cache, capacity)`` turns a prefill's ``KVCache`` into a ``StaticKVCache``
(``core/static_cache.py``), checking it once: each attention block run gets its slots from the attention part
(``nn/attention_step.py``); the rotary and position-bias tables and the validity mask are built once. Then
``net(new (B, 1), cache=static)`` (a ``ContinuousTransformerWrapper``: ``new (B, 1, dim_in)``) is the wrapper's
ordinary forward at one position: it embeds the new position with its own code (``wrapper_step``), runs its stack
(``AttentionLayers.forward`` -> ``stack_step``: every block run, with the residual routing; an attention block
through ``Attention.forward`` with its ``AttentionStep``) and reads out its head. Hooks on any module run, as in
any forward: blocks, norms, attentions and the stack are called as modules. Only a net without any hook when the
cache was built, and with no autograd recording, runs the same parts without the module calls (``BlockPlan``:
a float32 LayerNorm's gain kept once, a plain feed-forward's three parts, the fused q/k/v weights), which is the
same code and the same numbers (tested bit for bit against the seams).

Per step nothing is re-checked but the new input's metadata (every other argument of the forward is refused by
name, ``check_step_call``; no value is read back to the host: a token id's range is an asynchronous assertion);
the door checks of the prompt, the conditions and the cache ran once, at the prefill and when the cache was built.

``step_refusal(net)`` (``decoding.static.static_reason``) says why a net cannot decode this way (the engine then
uses the dynamic cache): a hybrid module's recurrent state, a looped or probabilistic wrapper, logits wider than the
vocabulary, test-time-trained modules.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.cache import KVCache
from ..core.static_cache import StaticKVCache
from ..nn.attention_step import AttentionStep, StepInputs, attention_step, context_slots, rotary_tables, self_slots
from ..nn.block import apply_norm, residual_update
from ..nn.modules import LayerNorm
from ..nn.relative_position import RelativePositionBias
from ..nn.xt_modules import Residual
from .wrapper_run import embed_rows

__all__ = ["build_static_cache", "step_refusal", "stack_step", "wrapper_step", "check_step_call"]


def _wrapper_refusal(net) -> str | None:
    custom = [name for name, on in (("recycling", getattr(net, "recycling", False)),
                                    ("squeeze_out_last_dim", getattr(net, "squeeze_out_last_dim", False)),
                                    ("a probabilistic head", getattr(net, "probabilistic", False)),
                                    ("looped=True (the stack runs several times, with early exit)",
                                     getattr(net, "looped", False)),
                                    ("num_output_heads > 1", getattr(net, "num_output_heads", 1) > 1),
                                    ("memory_tokens_interspersed_every",
                                     getattr(net, "memory_tokens_interspersed_every", None) is not None)) if on]
    if custom:  # the step embeds and reads out with the wrapper's plain parts only
        return f"the wrapper has {', '.join(custom)} (run as the wrapper's forward runs them)"
    width = getattr(net.to_logits, "out_features", None) if hasattr(net, "num_tokens") else None
    if width is not None and width > net.num_tokens:
        # a sampled id may be no token: the dynamic path names it (a host read per step), the step would not
        return "logits_dim is larger than num_tokens (a sampled id may be outside the vocabulary)"
    return None


def _attention_refusal(stack, mixer) -> str | None:
    if getattr(mixer, "hybrid", None) is not None:
        return "attn_hybrid_module runs a sequence module beside attention (its state is the dynamic cache's)"
    if mixer.orthog:
        return "attn_orthog_projected_values projects over the whole sequence (no KV cache)"
    if mixer.to_forget_gates is not None:
        return "attn_data_dependent_alibi sums forget gates over the whole sequence (no KV cache)"
    return None


def step_refusal(net) -> str | None:
    """Why ``net`` cannot decode on a ``StaticKVCache`` (``None`` when it can)."""
    if getattr(type(net), "static_step_input", None) not in ("tokens", "values"):  # the two wrappers say which
        return f"{type(net).__name__} is not a TransformerWrapper or ContinuousTransformerWrapper"
    reason = _wrapper_refusal(net)
    if reason is not None:
        return reason
    stack = net.attn_layers
    if not stack.causal:
        return "the stack is not causal"
    if getattr(stack, "static_step_reason", None):
        return stack.static_step_reason
    if getattr(stack.rotary, "use_xpos", False):
        return "rotary_xpos centers its scales on each call's positions (no KV cache)"
    for blk in stack.layers:
        reason = None if blk.kind == "ff" else _attention_refusal(stack, blk.mixer)
        if reason is not None:
            return reason
    for m in net.modules():  # a module may say why the step cannot run it (``static_step_refusal``)
        refusal = getattr(m, "static_step_refusal", None)
        if isinstance(refusal, str):
            return refusal
    return None


def _hooked(net) -> bool:
    from torch.nn.modules import module as _module

    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in net.modules()))


def build_static_cache(net, cache: KVCache, capacity: int, *, fixed: bool = False, fast: bool = True) -> StaticKVCache:
    """The static form of the prefill's ``cache`` for ``net``, with room for ``capacity`` slots.

    Args:
        net: a ``TransformerWrapper`` or ``ContinuousTransformerWrapper`` the step can run (``step_refusal``).
        cache: a ``KVCache`` from ``net(..., return_cache=True)`` (checked as input, like any cache: whatever its
            masked slots hold is selected to 0 here).
        capacity: L, at least ``cache.length``: the prefill's slots plus one per decode step.
        fixed: every step on fixed shapes (attention over all ``L`` slots with the validity mask): what a compiled
            step needs (one graph).
        fast: let the attention blocks run plain projections as functions on fused weights (the same bits; not when
            a module has forward hooks, whose weights may be shards between calls).
    """
    reason = step_refusal(net)
    if reason is not None:
        raise ValueError(f"the static decode step cannot run this net: {reason}")
    stack = net.attn_layers
    ref = stack.null_condition if stack.null_condition is not None else next(net.parameters())
    device = cache.count.device if isinstance(cache, KVCache) else ref.device
    probe = torch.empty(cache.batch_size if isinstance(cache, KVCache) else 0, 0, stack.dim, dtype=ref.dtype,
                        device=device)
    kinds = stack.executed_kinds  # one cache entry per attention block run
    KVCache.check(cache, probe, kinds.count("self"), kinds.count("cross"))
    p = cache.length
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < p:
        raise ValueError(f"capacity must be an integer >= the cache's length {p}, got {capacity!r}")
    fast = fast and not _hooked(net)
    runs = tuple(range(len(stack.layers))) if stack.default_order is None else tuple(stack.default_order)
    layers, i_self, i_cross = [], 0, 0
    views = [False] * len(stack.layers) if stack.routing is None else [v == 3 for v in stack.routing.views]
    for idx in runs:  # one entry per block run (weight_tie_layers repeats blocks)
        blk = stack.layers[idx]
        if blk.kind == "self":
            k, v = cache.self_kv[i_self]  # add_value_residual: every self-attention after the first mixes its values
            layers.append(self_slots(blk.mixer, k, v, cache.mask, capacity, fast, stack.add_value_residual and i_self > 0,
                                     views[idx]))
            i_self += 1
        elif blk.kind == "cross" and cache.cross_kv is not None:
            k, v = cache.cross_kv[i_cross]
            i_cross += 1  # a zero-length context: cross-attention adds exactly 0 (no slots, the block is skipped)
            seen = k.shape[2] or blk.mixer.num_mem_kv or blk.mixer.add_zero_kv  # keys every query reads
            layers.append(context_slots(blk.mixer, k, v, cache.context_mask, fast) if seen else None)
        else:
            layers.append(None)
    b = cache.batch_size
    valid = torch.zeros(b, capacity, dtype=torch.bool, device=device)
    valid[:, :p] = True if cache.mask is None else cache.mask
    positions = torch.zeros(b, capacity, dtype=torch.long, device=device)
    positions[:, :p] = cache.positions.to(torch.long)
    lead = cache.lead if cache.lead is not None else torch.zeros(b, dtype=torch.long, device=device)
    rotary = None
    if stack.rotary is not None:  # cos/sin of every position the generation may reach
        dim_head = next(blk.mixer.dim_head for blk in stack.layers if blk.kind != "ff")
        rotary = rotary_tables(stack.rotary, dim_head, capacity, ref.dtype, device, fixed=fixed)
    slot = torch.full((), p, dtype=torch.long, device=device) if fixed else None
    table = None  # dynamic_pos_bias: its MLP at every distance up to the capacity, once (not with hooks: shards)
    if stack.rel_pos is not None and not isinstance(stack.rel_pos, RelativePositionBias) and fast:
        with torch.no_grad():
            table = stack.rel_pos.table(capacity + 1, device)
    own = any(getattr(getattr(sl, "plan", None), "own_qkv", False) for sl in layers)
    blocks = [stack.layers[i] for i in runs]
    block_plans = [_block_plan(stack.layers[i], ref.dtype, views[i]) for i in runs] if fast else None
    plain = [type(blk.residual) is Residual and blk.residual.residual_scale is None
             and blk.residual.scale_residual_constant == 1 for blk in blocks] if fast else None
    return StaticKVCache(layers, valid, positions, cache.count.clone(), lead, cache.condition, p, cache.mask is not None,
                         fixed, slot, rotary, ref.dtype, table, own, block_plans, plain, runs)


def _step_inputs(stack, c: StaticKVCache) -> StepInputs:
    """The step's self-attention mask (an ALiBi bias in it), the key slots it reads and the rotation at each sample's
    position, the new slot marked valid."""
    if c.fixed:
        slot = c.slot
        c.valid.index_fill_(1, slot[None], True)
        self_mask, n_keys = c.valid[:, None, None, :], c.capacity
    else:
        slot = c.length
        c.valid[:, slot] = True
        n_keys = slot + 1
        self_mask = c.valid[:, None, None, :n_keys] if c.padded else None
    rot = None
    if isinstance(c.rotary, tuple):  # the fixed step's real tables at each sample's position
        cos, sin, swap = c.rotary
        rot = (cos.index_select(0, c.count)[:, None, None, :], sin.index_select(0, c.count)[:, None, None, :], swap)
    elif c.rotary is not None:  # cis (B, 1, 1, d / 2)
        rot = c.rotary.index_select(0, c.count)[:, None, None, :]
    if c.fixed:  # the new slot's position (ALiBi's and T5's distances, a window's)
        c.positions.index_copy_(1, slot[None], c.count[:, None])
    else:
        c.positions[:, slot] = c.count
    positions = c.positions[:, :n_keys]
    bias = None
    if stack.alibi_slopes is not None:  # (the stack's buffer: read where it lives)
        dist = (c.count[:, None] - positions).abs().to(torch.promote_types(c.dtype, torch.float32))
        bias = (-stack.alibi_slopes.to(dist.dtype)[None, :, None, None] * dist[:, None, None, :]).to(c.dtype)  # (B, h, 1, n)
    elif isinstance(stack.rel_pos, RelativePositionBias):  # T5's bucketed bias of each slot's distance (B, h, 1, n)
        bias = stack.rel_pos.bias(c.count[:, None], positions).to(c.dtype)
    elif stack.rel_pos is not None:  # dynamic_pos_bias: its MLP's table at every distance up to the capacity
        table = c.position_table if c.position_table is not None else stack.rel_pos.table(c.capacity + 1)
        bias = stack.rel_pos.bias(c.count[:, None], positions, table=table).to(c.dtype)
    if bias is not None:
        self_mask = bias if self_mask is None else bias.masked_fill(~self_mask, float("-inf"))
    angles = None
    if c.needs_angles:  # the position pair Attention.forward takes, at each sample's new position
        pos = c.count[:, None]
        if stack.polar_pos_emb is not None:
            angles = stack.polar_pos_emb.pair(pos, c.dtype)
        elif stack.rotary is not None:
            a = stack.rotary.angles(pos, dtype=c.dtype)  # (B, 1, 1, d_rot)
            angles = (a, a)
    return StepInputs(slot, c.fixed, self_mask, n_keys, rot, c.count, positions, angles,
                      planned=not torch.is_grad_enabled())


def _room(c: StaticKVCache) -> None:
    if c.length >= c.capacity:
        raise ValueError(f"the static cache is full ({c.capacity} slots)")


class BlockPlan(NamedTuple):
    """How the step runs one block run of a net without hooks (built once per cache): a float32 LayerNorm's
    ``(shape, gain, bias, eps)`` for ``F.layer_norm`` (its gain with the unit offset added once) or ``None`` (the
    norm's own call), whether the branch needs ``Block.finish`` (a gate, a scale, a sandwich norm), and a plain
    feed-forward's three parts (``FeedForward.step_plan``) or ``None``."""

    norm: tuple | None
    finish: bool
    ff: tuple | None


def _block_plan(blk, dtype: torch.dtype, views: bool) -> BlockPlan | None:
    if views or blk.shifts:  # separate q/k/v inputs, token shifts: the block's own forward
        return None
    norm = blk.norm
    plan = None
    if type(norm) is LayerNorm and dtype == torch.float32 and norm.gamma.dtype == torch.float32:
        with torch.no_grad():
            plan = (norm.normalized_shape, norm.weight.detach().clone(), norm.bias, norm.eps)
    ff = blk.mixer.step_plan() if blk.kind == "ff" and hasattr(blk.mixer, "step_plan") else None
    return BlockPlan(plan, blk.gate is not None or blk.scale != 1.0 or blk.norms[1] is not None, ff)


class _Carry:
    """What passes from one block run of a step to the next: the logits of the last self- and cross-attention
    (``residual_attn`` / ``cross_residual_attn``; ``True`` before the first) and the feed-forwards run so far."""

    __slots__ = ("prev", "prev_cross", "ff_seen")

    def __init__(self, stack):
        self.prev = True if stack.residual_attn else None
        self.prev_cross = True if stack.cross_residual_attn else None
        self.ff_seen = 0


def _normed(blk, bp: BlockPlan, x: Tensor, cond: Tensor | None) -> Tensor:
    if bp.norm is not None and x.dtype == torch.float32:
        return F.layer_norm(x, *bp.norm)
    return apply_norm(blk.norm, x, cond)


def _block_out(c: StaticKVCache, i: int, blk, slots, inp, cond, inputs: StepInputs, carry: _Carry,
               ff_deep: Tensor | None) -> Tensor | None:
    """The branch output of block run ``i`` on ``inp``, or ``None`` (a cross-attention without context keys adds
    nothing). With a plan (no hooks, no autograd) the block's parts run without the module calls, the same code."""
    if blk.kind != "ff" and slots is None:
        return None
    bp = c.block_plans[i] if c.block_plans is not None and inputs.planned else None
    if blk.kind == "ff":
        if bp is not None and bp.ff is not None:
            pi, act, po = bp.ff
            out = F.linear(act(F.linear(_normed(blk, bp, inp, cond), pi.weight, pi.bias)), po.weight, po.bias)
            out = blk.finish(out, cond) if bp.finish else out
        else:
            out, _ = blk(inp, cond)
        if ff_deep is not None:  # ff_deep_embed: this feed-forward's multiplier of the branch
            out = out * ff_deep[:, :, carry.ff_seen].to(out.dtype)
            carry.ff_seen += 1
        return out
    prev = carry.prev if blk.kind == "self" else carry.prev_cross
    step = AttentionStep(slots, inputs)
    if bp is not None:
        res = attention_step(blk.mixer, _normed(blk, bp, inp, cond), step, None, prev)
        out, logits = res if prev is not None else (res, None)
        out = blk.finish(out, cond) if bp.finish else out
    elif prev is not None:
        out, (logits,) = blk(inp, cond, cache=step, prev_attn=prev)
    else:
        (out, _), logits = blk(inp, cond, cache=step), None
    if prev is not None:  # residual attention: these logits reach the next attention of the kind
        if blk.kind == "self":
            carry.prev = logits
        else:
            carry.prev_cross = logits
    return out


def stack_step(stack, x: Tensor, c: StaticKVCache, ff_deep: Tensor | None = None) -> Tensor:
    """``AttentionLayers.forward(x (B, 1, c), cache=static)``: one position through every block run (a block called as
    a module, an attention block with its ``AttentionStep``; a net without hooks runs the same parts without the
    calls), then the final norm; the cache advances one slot. ``ff_deep (B, 1, L, c)``: the feed-forward blocks'
    per-token multipliers (``ff_deep_embeds``)."""
    compiling = torch.compiler.is_compiling()
    if not compiling:
        if not isinstance(x, Tensor) or x.dim() != 3 or tuple(x.shape) != (c.batch_size, 1, stack.dim):
            raise ValueError(f"x must have shape (b, 1, dim) = ({c.batch_size}, 1, {stack.dim}) with a StaticKVCache "
                             f"(one new position per sample), got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        if x.device != c.count.device:
            raise ValueError(f"x is on {x.device}, the cache on {c.count.device}")
        _room(c)
    inputs = _step_inputs(stack, c)
    cond, routing, carry = c.condition, stack.routing, _Carry(stack)
    route, first_self = None, True
    if routing is not None:  # x-transformers' residual options, per token (the stack's forward runs the same)
        x, route = routing.begin(x, None, cond)
    for i, (idx, slots) in enumerate(zip(c.runs, c.layers)):  # i: the run, idx: the block (repeated ones too)
        blk = stack.layers[idx]
        inp = x
        if route is not None:
            x, inp = routing.enter(route, idx, x)
        out = _block_out(c, i, blk, slots, inp, cond, inputs, carry, ff_deep)
        if blk.kind == "self":
            if first_self and stack.add_value_residual:  # its new values, for the others
                inputs = inputs._replace(value_residual=slots.values.index_select(2, inputs.slot[None]) if c.fixed
                                         else slots.values.narrow(2, inputs.slot, 1))
            first_self = False
        if route is not None:
            x = routing.leave(route, idx, out)
        elif out is not None:  # x-transformers' Residual: stream + out (residual_update: the other forms, hooks)
            x = x + out if c.plain_residual is not None and c.plain_residual[i] else residual_update(blk.residual, out, x)
    if route is not None:
        x = routing.finish(x)
    x = apply_norm(stack.final_norm, x, cond)
    c.count.add_(1)
    if c.fixed:
        c.slot.add_(1)
    if not compiling:  # a compiled step's caller advances the host count (a Python int in the graph would recompile)
        c.length += 1
    return x


_STEP_FREE = ("self", "x", "cache", "return_cache", "check_finite", "__class__")


@functools.cache
def _signature(fn) -> tuple[dict, str | None]:
    """``fn``'s defaults by name and its ``**`` parameter's name (or ``None``)."""
    params = inspect.signature(fn).parameters.values()
    return ({p.name: p.default for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD},
            next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None))


def check_step_call(fn, given: dict) -> None:
    """A forward ``fn`` called with a ``StaticKVCache`` (``given``: its arguments, e.g. its ``locals()``): ``x`` the new
    position of every sample and nothing else (the context, the conditions and the masks are the prefill's, held by
    the cache); every other argument must be at its default, or it is refused by name. Metadata only."""
    defaults, var_kw = _signature(fn)
    extra = sorted(given.get(var_kw) or ()) if var_kw is not None else []
    for name, default in defaults.items():
        value = given.get(name, default)
        if name in _STEP_FREE or value is None or value is default:
            continue
        if type(value) is type(default) and isinstance(value, (bool, int, float, str)) and value == default:
            continue
        extra.append(name)
    if extra:
        raise ValueError(f"a StaticKVCache step takes the new position only (the prefill's context, conditions and "
                         f"masks are in the cache); got {', '.join(extra)}")


def wrapper_step(net, x: Tensor, c: StaticKVCache, tokens: bool) -> Tensor:
    """``net(x, cache=static)``: ``x (B, 1)`` token ids (``tokens``) or ``(B, 1, dim_in)`` values; returns the
    output ``(B, 1, v)`` at the new position."""
    if not torch.compiler.is_compiling():
        b = c.batch_size
        want = (b, 1) if tokens else (b, 1, "dim_in")
        if not isinstance(x, Tensor) or x.dim() != len(want) or tuple(x.shape[:2]) != (b, 1):
            raise ValueError(f"x must have shape {want} with a StaticKVCache (one new position per sample), got "
                             f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        if x.device != c.count.device:
            raise ValueError(f"x is on {x.device}, the cache on {c.count.device}")
        if tokens:
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"x must hold integer token ids, got {x.dtype}")
            # asynchronous (no host read on a GPU: the failure surfaces at the next synchronisation)
            torch._assert_async(((x >= 0) & (x < net.num_tokens)).all(),
                                f"x holds token ids outside [0, {net.num_tokens}) (num_tokens)")
    # the wrapper's own parts, in its forward's order: the embedding (a custom one checked), the absolute position,
    # then post_emb_norm, dropout and the projection to the model width (embed_rows), the stack, the head
    h = net._embed(x, None, None) if tokens else net.project_in(x.to(c.dtype))
    if net.pos_emb is not None:
        h = h + net.pos_emb.embed_positions((c.count - c.lead).clamp(min=0)[:, None]).to(h.dtype)
    deep = None if getattr(net, "ff_deep_embed", None) is None else net.ff_deep_embed[x].to(h.dtype)  # (B, 1, L, c)
    h = embed_rows(net, h, 0)
    if c.block_plans is not None and not torch.is_grad_enabled():  # no hooks anywhere: the stack's step, uncalled
        h = stack_step(net.attn_layers, h, c, deep)  # (the arguments were checked at this door)
    else:
        h = net.attn_layers(h, cache=c, ff_deep_embeds=deep)
    return net._head(h) if tokens else net.project_out(h)
