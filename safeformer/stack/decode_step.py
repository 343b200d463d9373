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
A net whose logits are wider than its vocabulary (``logits_dim > num_tokens``) may sample an id that is no token:
its step embeds the id clamped into the vocabulary and records the first such id in the cache on the device
(``StaticKVCache.bad_token``, no assertion), and the engine reads the record at its periodic host check
(``StaticKVCache.check_tokens``), raising the ``ValueError`` the dynamic cache raises when fed that id, before it
returns anything (a caller running the steps itself checks the same way: the outputs from that step on are void).

``step_refusal(net)`` (``decoding.static.static_reason``) says why a net cannot decode this way (the engine then
uses the dynamic cache): the wrapper options ``_wrapper_refusal`` names, attention options that need the whole
sequence, a module's own ``static_step_refusal``. A test-time-trained module (``decoding.xl.TTTModuleWrapper``, its
per-sample fast weights fixed while decoding) is called as a module, as the dynamic path calls it. A probabilistic
continuous wrapper runs on the step: its output is the forward's, ``stack((mean, variance)) (2, B, 1, d)``. An
``attn_hybrid_module`` (a ``torch.nn`` RNN, what the dynamic cache continues) keeps its recurrent state in its
block's slots (``SelfSlots.state``, written in place by each step). A ``looped=True`` wrapper runs its stack
several times at the new position (``_looped_runs``: the forward's loop, with the settings given when the cache was
built), each loop step on its own slots (``LoopPlan``), the position advanced once; with a hybrid module every run
starts from the one recurrent state the dynamic cache keeps, which after the runs is, per sample, the state of the
run it exited at (``_share_state``).
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import attend as _attend_module
from ..core.cache import KVCache
from ..core.static_cache import StaticKVCache
from ..nn.attention_step import (
    AttentionStep,
    SelfSlots,
    StepInputs,
    attention_step,
    context_slots,
    cross_step,
    rotary_tables,
    self_slots,
    self_step,
)
from ..nn.block import apply_norm, residual_update
from ..nn.modules import LayerNorm
from ..nn.relative_position import RelativePositionBias
from ..nn.xt_modules import Residual
from .wrapper_run import embed_rows

__all__ = ["build_static_cache", "step_refusal", "stack_step", "wrapper_step", "check_step_call"]


def _wrapper_refusal(net) -> str | None:
    custom = [name for name, on in (("recycling", getattr(net, "recycling", False)),
                                    ("memory_tokens_interspersed_every",
                                     getattr(net, "memory_tokens_interspersed_every", None) is not None)) if on]
    if custom:  # the step embeds and reads out with the wrapper's plain parts only
        return f"the wrapper has {', '.join(custom)} (run as the wrapper's forward runs them)"
    return None


def _token_range(net) -> int | None:
    """``num_tokens`` of a token wrapper whose logits are wider (``logits_dim > num_tokens``: a sampled id may be no
    token) or whose head's width is unknown (a custom or a wrapped head), whose steps record such ids
    (``StaticKVCache.record_tokens``); ``None`` for any other net."""
    if getattr(type(net), "static_step_input", None) != "tokens":
        return None
    head = getattr(net, "to_logits", None)
    width = getattr(head, "out_features", None)
    if head is not None and not isinstance(width, int):  # a custom or wrapped head (a TTTModuleWrapper) of unknown
        return net.num_tokens  # width: recorded too (never a fatal device-side assert)
    return net.num_tokens if isinstance(width, int) and width > net.num_tokens else None


def _attention_refusal(stack, mixer) -> str | None:
    hybrid = getattr(mixer, "hybrid", None)
    if hybrid is not None and not hybrid.can_cache:  # (no KV cache either: the engine re-encodes)
        return hybrid.cache_refusal()
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


def build_static_cache(net, cache: KVCache, capacity: int, *, fixed: bool = False, fast: bool = True,
                       loop: dict | None = None) -> StaticKVCache:
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
        loop: a ``looped=True`` wrapper's settings for every step (``TransformerWrapper._loop_settings``' dict: the
            runs, ``looped_steps``' fixed count, ``looped_inference`` and its exit threshold), as the forward's looped
            keywords give them (the step takes none); ``None``: the forward's defaults (every one of
            ``max_looped_steps`` runs, each keeping its own keys/values).
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
    views = [False] * len(stack.layers) if stack.routing is None else [v == 3 for v in stack.routing.views]
    settings = _loop_of(net, cache, loop)
    prompt_kv = None if settings is None else cache.looped_prompt_kv
    layers = _run_slots(stack, cache, capacity, fast, runs, views, None if prompt_kv is None else prompt_kv[0])
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
        # shaped (L + 1, 1, 1, .) once: a step's index_select at the positions is its rotation (B, 1, 1, .)
        rotary = (rotary[0][:, None, None], rotary[1][:, None, None], rotary[2]) if fixed else rotary[:, None, None]
    slot = torch.full((), p, dtype=torch.long, device=device) if fixed else None
    table = None  # dynamic_pos_bias: its MLP at every distance up to the capacity, once (not with hooks: shards)
    if stack.rel_pos is not None and not isinstance(stack.rel_pos, RelativePositionBias) and fast:
        with torch.no_grad():
            table = stack.rel_pos.table(capacity + 1, device)
    plans = [getattr(sl, "plan", None) for sl in layers]
    own = any(getattr(pl, "own_qkv", False) for pl in plans)
    reads_positions = (stack.alibi_slopes is not None or stack.rel_pos is not None
                       or any(getattr(pl, "options", False) for pl in plans))
    static = StaticKVCache(layers, valid, positions, cache.count.clone(), lead, cache.condition, p, cache.mask is not None,
                           fixed, slot, rotary, ref.dtype, table, own, runs=runs, reads_positions=reads_positions)
    static.token_range = _token_range(net)
    if static.token_range is not None:  # (seen, id, row) of the first step input outside the vocabulary
        static.bad_token = torch.zeros(3, dtype=torch.long, device=device)
    if settings is not None:  # a looped wrapper: every run of the stack on its own slots
        static.loop = _loop_plan(stack, cache, capacity, fast, runs, views, layers, prompt_kv, settings)
    if fast:
        _plan_blocks(net, static, views)
    return static


def _run_slots(stack, cache: KVCache, capacity: int, fast: bool, runs: tuple, views: list, prompt_kv=None,
               first: list | None = None) -> list:
    """Per block run, its slots (``None``: a feed-forward, a cross-attention without context keys). ``prompt_kv``: a
    looped wrapper's keys/values of one loop step for the cache's first slots (``KVCache.looped_prompt_kv``);
    ``first``: the first loop step's slots, whose plans (and context slots: every run reads the same context) the
    other loop steps share."""
    layers, i_self, i_cross = [], 0, 0
    for j, idx in enumerate(runs):  # one entry per block run (weight_tie_layers repeats blocks)
        blk = stack.layers[idx]
        if blk.kind == "self":
            k, v = cache.self_kv[i_self]
            if prompt_kv is not None:  # this loop step's own keys/values of the first slots (the dynamic cache's)
                pk, pv = prompt_kv[i_self]
                k, v = torch.cat((pk, k[:, :, pk.shape[2]:]), 2), torch.cat((pv, v[:, :, pv.shape[2]:]), 2)
            # add_value_residual: every self-attention after the first mixes its values
            layers.append(self_slots(blk.mixer, k, v, cache.mask, capacity, fast, stack.add_value_residual and i_self > 0,
                                     views[idx], _hybrid_state(blk.mixer, cache, i_self),
                                     None if first is None else first[j].plan))
            i_self += 1
        elif blk.kind == "cross" and cache.cross_kv is not None:
            k, v = cache.cross_kv[i_cross]
            i_cross += 1  # a zero-length context: cross-attention adds exactly 0 (no slots, the block is skipped)
            seen = k.shape[2] or blk.mixer.num_mem_kv or blk.mixer.add_zero_kv  # keys every query reads
            if first is not None:
                layers.append(first[j])
            else:
                layers.append(context_slots(blk.mixer, k, v, cache.context_mask, fast) if seen else None)
        else:
            layers.append(None)
    return layers


def _hybrid_state(mixer, cache: KVCache, index: int):
    """The prefill's state of self-attention ``index``'s hybrid module (``KVCache.hybrid``, as the dynamic cache reads
    it: ``stack_forward._hybrid_call``), ``None`` (its initial state) after no position or without a module."""
    if getattr(mixer, "hybrid", None) is None or cache.length == 0:
        return None
    states = cache.hybrid
    if states is None or index >= len(states) or states[index] is None:
        raise ValueError("this cache holds no state of the hybrid module (attn_hybrid_module): it must come from "
                         "this stack's own forward")
    return states[index]


class LoopPlan(NamedTuple):
    """How a looped wrapper's step runs (``build_static_cache``'s ``loop``): ``layers``, per loop step, its own slots
    of every block run (the first is the cache's ``layers``); ``early``: stop per sample once its cumulative exit
    probability reaches ``threshold`` (x-transformers' looped inference without ``looped_steps``; every run is
    computed, a sample keeps the output of the run it exited at: what the dynamic path's batch break gives);
    ``shared``: ``looped_inference``: the new slot of every loop step then holds the keys/values of the run each
    sample exited at (the dynamic cache keeps that run's); otherwise each loop step keeps its own. ``stateful``: some
    self-attention has an ``attn_hybrid_module``, whose one state every run starts from (each loop step's buffers
    hold it) and after the runs is, per sample, the state of the run it exited at (``_share_state``)."""

    layers: tuple
    early: bool
    threshold: float
    shared: bool
    stateful: bool = False


def _loop_of(net, cache: KVCache, loop: dict | None) -> dict | None:
    """A looped wrapper's loop settings for the step (``None`` for a wrapper that is not looped): ``loop`` (its
    ``_loop_settings``), or the forward's defaults (a call without looped keywords); checked against the cache."""
    if not getattr(net, "looped", False):
        if loop is not None:
            raise ValueError("loop settings given for a net built without looped=True")
        return None
    settings = net._loop_settings(None, None, None, False, 0.9) if loop is None else loop
    held = cache.looped_prompt_kv
    if held is not None and len(held) < settings["steps"]:
        raise ValueError(f"the cache holds the prompt's keys/values of {len(held)} loop steps; the step runs up to "
                         f"{settings['steps']} (generate the prompt with at least as many)")
    return settings


def _loop_plan(stack, cache: KVCache, capacity: int, fast: bool, runs: tuple, views: list, first: list, prompt_kv,
               settings: dict) -> LoopPlan:
    layers = [first]
    for i in range(1, settings["steps"]):
        layers.append(_run_slots(stack, cache, capacity, fast, runs, views,
                                 None if prompt_kv is None else prompt_kv[i], first))
    infer = bool(settings["inference"])
    stateful = any(type(sl) is SelfSlots and bool(sl.state) for sl in first)
    return LoopPlan(tuple(layers), infer and not settings["fixed"], float(settings["threshold"]), infer, stateful)


def _plan_blocks(net, c: StaticKVCache, views: list) -> None:
    """A net without hooks: how each block run goes without the module calls (``block_plans``, ``plain_residual``,
    the final norm's ``F.layer_norm`` arguments) and, where no option threads anything from block to block, the
    step's flat program (``program``: one ``_Run`` per block run)."""
    stack = net.attn_layers
    blocks = [stack.layers[i] for i in c.runs]
    c.block_plans = [_block_plan(stack.layers[i], c.dtype, views[i]) for i in c.runs]
    c.plain_residual = [type(blk.residual) is Residual and blk.residual.residual_scale is None
                        and blk.residual.scale_residual_constant == 1 for blk in blocks]
    c.final_norm = _layer_norm_args(stack.final_norm, c.dtype)
    flat = (stack.routing is None and not stack.residual_attn and not stack.cross_residual_attn
            and not stack.add_value_residual and getattr(net, "ff_deep_embed", None) is None
            and all(bp is not None for bp in c.block_plans))
    if flat:
        c.program = tuple(_Run(_KINDS[blk.kind], blk, blk.mixer, bp.norm, _ff_functions(bp.ff), bp.finish, plain,
                               blk.residual)
                          for blk, bp, plain in zip(blocks, c.block_plans, c.plain_residual))


def _step_inputs(stack, c: StaticKVCache) -> StepInputs:
    """The step's self-attention mask (an ALiBi bias in it), the key slots it reads and the rotation at each sample's
    position, the new slot marked valid (and its position written, where a part of the step reads positions)."""
    count = c.count
    if c.fixed:
        slot = c.slot
        c.valid.index_fill_(1, slot[None], True)
        self_mask, n_keys = c.valid[:, None, None, :], c.capacity
        if c.reads_positions:  # the new slot's position (ALiBi's and T5's distances, a window's)
            c.positions.index_copy_(1, slot[None], count[:, None])
    else:
        slot = c.length
        c.valid.select(1, slot).fill_(True)
        n_keys = slot + 1
        self_mask = c.valid[:, None, None, :n_keys] if c.padded else None
        if c.reads_positions:
            c.positions.select(1, slot).copy_(count)
    rot = c.rotary
    if type(rot) is tuple:  # the fixed step's real tables at each sample's position
        rot = (rot[0].index_select(0, count), rot[1].index_select(0, count), rot[2])
    elif rot is not None:  # cis (B, 1, 1, d / 2)
        rot = rot.index_select(0, count)
    if not c.reads_positions:
        return StepInputs(slot, c.fixed, self_mask, n_keys, rot, count, None, _angles(stack, c),
                          planned=not torch.is_grad_enabled())
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
    return StepInputs(slot, c.fixed, self_mask, n_keys, rot, count, positions, _angles(stack, c),
                      planned=not torch.is_grad_enabled())


def _angles(stack, c: StaticKVCache):
    """The position pair ``Attention.forward`` takes, at each sample's new position, for attentions that rotate with
    their own code (``needs_angles``), or ``None``."""
    if not c.needs_angles:
        return None
    pos = c.count[:, None]
    if stack.polar_pos_emb is not None:
        return stack.polar_pos_emb.pair(pos, c.dtype)
    if stack.rotary is not None:
        a = stack.rotary.angles(pos, dtype=c.dtype)  # (B, 1, 1, d_rot)
        return a, a
    return None


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
    ff = blk.mixer.step_plan() if blk.kind == "ff" and hasattr(blk.mixer, "step_plan") else None
    return BlockPlan(_layer_norm_args(blk.norm, dtype), blk.gate is not None or blk.scale != 1.0
                     or blk.norms[1] is not None, ff)


def _layer_norm_args(norm, dtype: torch.dtype) -> tuple | None:
    """A float32 ``LayerNorm``'s ``(shape, gain, bias, eps)`` for ``F.layer_norm`` (the gain with its unit offset
    added once: the same bits as its forward), or ``None`` (the norm's own call)."""
    if type(norm) is LayerNorm and dtype == torch.float32 and norm.gamma.dtype == torch.float32:
        with torch.no_grad():
            return norm.normalized_shape, norm.weight.detach().clone(), norm.bias, norm.eps
    return None


_KINDS = {"self": 1, "cross": 2, "ff": 0}
_ACTS = {nn.GELU: lambda act: functools.partial(F.gelu, approximate=act.approximate),
         nn.SiLU: lambda act: F.silu, nn.ReLU: lambda act: F.relu}


def _ff_functions(ff: tuple | None) -> tuple | None:
    """A plain feed-forward's parts ``(proj_in, act, proj_out)`` (``FeedForward.step_plan``) as what its forward
    computes: ``(w_in, b_in, act, w_out, b_out)``, the activation a function (``nn.GELU``'s ``F.gelu`` with its
    ``approximate``, ``F.silu``, ``F.relu``: the modules' own forward)."""
    if ff is None:
        return None
    pi, act, po = ff
    return pi.weight, pi.bias, _ACTS[type(act)](act), po.weight, po.bias


class _Run(NamedTuple):
    """One block run of the flat program (a net without hooks, no option threading state between blocks): its
    kind (0 feed-forward, 1 self-, 2 cross-attention), the block and its mixer, the norm's ``F.layer_norm``
    arguments (or ``None``: its call), a plain feed-forward's functions (``_ff_functions``, or ``None``: the
    mixer's call), whether ``Block.finish`` runs, whether the residual is the plain ``stream + out`` and the
    residual module (``residual_update`` otherwise)."""

    kind: int
    blk: nn.Module
    mixer: nn.Module
    norm: tuple | None
    ff: tuple | None
    finish: bool
    plain: bool
    residual: nn.Module


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
    return _run_stack(stack, x, c, ff_deep, compiling)


def _run_stack(stack, x: Tensor, c: StaticKVCache, ff_deep: Tensor | None, compiling: bool) -> Tensor:
    """``stack_step`` on an input already checked (the wrapper's step embeds it itself)."""
    inputs = _step_inputs(stack, c)
    if c.program is not None and ff_deep is None and inputs.planned:
        x = _flat_runs(x, c, inputs)
    else:
        x = _block_runs(stack, x, c, inputs, ff_deep)
    if c.final_norm is not None and inputs.planned and x.dtype == torch.float32:
        x = F.layer_norm(x, *c.final_norm)
    else:
        x = apply_norm(stack.final_norm, x, c.condition)
    if not c.held:  # (a looped wrapper's runs: it advances once after them)
        _advance(c, compiling)
    return x


def _advance(c: StaticKVCache, compiling: bool) -> None:
    """The cache one position further."""
    c.count.add_(1)
    if c.fixed:
        c.slot.add_(1)
    if not compiling:  # a compiled step's caller advances the host count (a Python int in the graph would recompile)
        c.length += 1


def _flat_runs(x: Tensor, c: StaticKVCache, inputs: StepInputs) -> Tensor:
    """The block runs of ``c.program`` (a net without hooks, nothing threaded between blocks but the stream): the
    parts ``_block_runs`` runs for such a net, the same calls in the same order, without its per-block dispatch."""
    cond, kernel = c.condition, _attend_module._kernel  # (read per step: tests substitute a misbehaving kernel)
    for (kind, blk, mixer, norm, ff, finish, plain, residual), slots in zip(c.program, c.layers):
        if kind and slots is None:  # a cross-attention without context keys adds nothing
            continue
        h = F.layer_norm(x, *norm) if norm is not None and x.dtype == torch.float32 else apply_norm(blk.norm, x, cond)
        if kind == 1:
            out = self_step(mixer, slots, h, inputs, kernel)
        elif kind == 2:
            out = cross_step(mixer, slots, h, kernel)
        elif ff is not None:
            w_in, b_in, act, w_out, b_out = ff
            out = F.linear(act(F.linear(h, w_in, b_in)), w_out, b_out)
        else:
            out = mixer(h)
        if finish:  # a gate, a scale, a sandwich norm
            out = blk.finish(out, cond)
        x = x + out if plain else residual_update(residual, out, x)
    return x


def _block_runs(stack, x: Tensor, c: StaticKVCache, inputs: StepInputs, ff_deep: Tensor | None) -> Tensor:
    """Every block run of the step, with the residual routing, residual attention's logits, the value residual and
    the feed-forwards' per-token multipliers; blocks called as modules (hooks) unless planned."""
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
    return x


_STEP_FREE = ("self", "x", "cache", "return_cache", "check_finite", "__class__")


@functools.cache
def _signature(fn) -> tuple[dict, str | None, tuple, tuple]:
    """``fn``'s defaults by name, its ``**`` parameter's name (or ``None``), and the names checked with their defaults
    (two tuples, for the one-pass test of a call that gave nothing but ``x``)."""
    params = inspect.signature(fn).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
    names = tuple(n for n in defaults if n not in _STEP_FREE)
    return (defaults, next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None), names,
            tuple(defaults[n] for n in names))


def check_step_call(fn, given: dict) -> None:
    """A forward ``fn`` called with a ``StaticKVCache`` (``given``: its arguments, e.g. its ``locals()``): ``x`` the new
    position of every sample and nothing else (the context, the conditions and the masks are the prefill's, held by
    the cache); every other argument must be at its default, or it is refused by name. Metadata only."""
    defaults, var_kw, names, values = _signature(fn)
    if (var_kw is None or not given.get(var_kw)) and all(map(operator.is_, map(given.get, names), values)):
        return  # every argument the very object of its default (what a call with x alone binds)
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


def _check_new(net, x: Tensor, c: StaticKVCache, tokens: bool) -> None:
    """The step input's metadata (its shape, device and dtype), the cache's room, then the token ids' range as an
    asynchronous assertion (no host read on a GPU: a failure surfaces at the next synchronisation); a net with
    ``logits_dim > num_tokens`` records such ids in the cache instead (``StaticKVCache.record_tokens``)."""
    b = c.batch_size
    if not isinstance(x, Tensor) or x.dim() != (2 if tokens else 3) or tuple(x.shape[:2]) != (b, 1):
        want = (b, 1) if tokens else (b, 1, "dim_in")
        raise ValueError(f"x must have shape {want} with a StaticKVCache (one new position per sample), got "
                         f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    if x.device != c.count.device:
        raise ValueError(f"x is on {x.device}, the cache on {c.count.device}")
    if tokens:
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"x must hold integer token ids, got {x.dtype}")
        _room(c)
        n = net.num_tokens
        if c.token_range is None:  # (logits_dim > num_tokens: recorded in the cache instead, wrapper_step)
            torch._assert_async(((x >= 0) & (x < n)).all(), f"x holds token ids outside [0, {n}) (num_tokens)")
    else:
        _room(c)


def wrapper_step(net, x: Tensor, c: StaticKVCache, tokens: bool) -> Tensor:
    """``net(x, cache=static)``: ``x (B, 1)`` token ids (``tokens``) or ``(B, 1, dim_in)`` values; returns the
    output ``(B, 1, v)`` at the new position."""
    compiling = torch.compiler.is_compiling()
    if not compiling:
        _check_new(net, x, c, tokens)
    if tokens and c.token_range is not None:  # an id outside the vocabulary recorded, the clamped id embedded
        x = c.record_tokens(x)
    # the wrapper's own parts, in its forward's order: the embedding (a custom one checked), the absolute position,
    # then post_emb_norm, dropout and the projection to the model width (embed_rows), the stack, the head
    h = net._embed(x, None, None) if tokens else net.project_in(x.to(c.dtype))
    if net.pos_emb is not None:
        h = h + net.pos_emb.embed_positions((c.count - c.lead).clamp(min=0)[:, None]).to(h.dtype)
    deep = None if getattr(net, "ff_deep_embed", None) is None else net.ff_deep_embed[x].to(h.dtype)  # (B, 1, L, c)
    h = embed_rows(net, h, 0)
    h = _stack_once(net, h, c, deep, compiling) if c.loop is None else _looped_runs(net, h, c, deep, compiling)
    if tokens:  # (a tuple with num_output_heads > 1; squeeze_out_last_dim applied, as the forward does)
        return net._squeeze(net._head(h))
    out = net.project_out(h)
    return _gaussian_head(out) if getattr(net, "probabilistic", False) else out


def _stack_once(net, h: Tensor, c: StaticKVCache, deep: Tensor | None, compiling: bool) -> Tensor:
    """The wrapper's stack on the new position: the stack's step uncalled (no hooks anywhere, no autograd: its input
    made here, the room checked), or the stack called as a module."""
    if c.block_plans is not None and not torch.is_grad_enabled():
        return _run_stack(net.attn_layers, h, c, deep, compiling)
    return net.attn_layers(h, cache=c, ff_deep_embeds=deep)


def _looped_runs(net, x: Tensor, c: StaticKVCache, deep: Tensor | None, compiling: bool) -> Tensor:
    """A looped wrapper's runs of its stack at the new position (``_Wrapper._loop`` on one position): each run on the
    previous run's output over its own loop step's slots; with early exit each sample keeps the output of the run at
    which its cumulative exit probability reached the threshold (every run computed: no host read), and with
    ``looped_inference`` every loop step's new slot then holds that run's keys/values. The position advances once."""
    lp = c.loop
    steps, b = len(lp.layers), x.shape[0]
    exit_index = torch.full((b,), steps - 1, dtype=torch.long, device=x.device)
    if lp.early:
        active = torch.ones(b, dtype=torch.bool, device=x.device)
        cum_exit = torch.zeros(b, dtype=torch.float32, device=x.device)
        cum_continue = torch.zeros_like(cum_exit)
    h_out = None
    c.held = True
    try:
        for i, layers in enumerate(lp.layers):
            c.layers = layers
            h = _stack_once(net, x, c, deep, compiling)
            if lp.early:  # the dynamic loop's order: keep this run where active, then decide
                h_out = h if h_out is None else torch.where(active[:, None, None], h, h_out)
                exit_index = torch.where(active, i, exit_index)
                if i < steps - 1:
                    logit = net.exit_gate(h)[:, -1, 0].float()  # (B,)
                    cum_exit = cum_exit + (cum_continue + F.logsigmoid(logit)).exp()
                    cum_continue = cum_continue + F.logsigmoid(-logit)
                    active = active & (cum_exit < lp.threshold)
            else:
                h_out = h
            x = h
    finally:
        c.held, c.layers = False, lp.layers[0]
    if lp.shared:
        _share_new_slot(c, exit_index)
    if lp.stateful:  # each sample's state of the run it exits at (the dynamic loop merges it per sample)
        _share_state(c, exit_index)
    _advance(c, compiling)
    return h_out


def _share_new_slot(c: StaticKVCache, exit_index: Tensor) -> None:
    """``looped_inference``: the new slot of every loop step's self-attention slots set to the keys/values of the run
    each sample exited at (``exit_index (B,)``), as the dynamic cache keeps them for later positions."""
    slot = c.slot if c.fixed else c.length
    for group in zip(*c.loop.layers):
        if type(group[0]) is not SelfSlots:
            continue
        for name in ("keys", "values"):
            bufs = [getattr(s, name) for s in group]
            new = torch.stack([t.index_select(2, slot[None]) if c.fixed else t.narrow(2, slot, 1) for t in bufs])
            pick = new.gather(0, exit_index.reshape(1, -1, 1, 1, 1).expand(1, *new.shape[1:]))[0]  # (B, h_kv, 1, d)
            for t in bufs:
                if c.fixed:
                    t.index_copy_(2, slot[None], pick)
                else:
                    t.narrow(2, slot, 1).copy_(pick)


def _share_state(c: StaticKVCache, run: Tensor) -> None:
    """``attn_hybrid_module`` in a looped wrapper: every loop step's state buffers set, per sample, to the state its
    run ``run (B,)`` left (its exit run): the one state the dynamic cache keeps (``_Wrapper._loop`` merges the runs'
    states per sample, as the keys and values), from which every run of the next position starts. Each run read its buffers before
    writing them, and all held the kept state (the prefill's, then this one)."""
    for group in zip(*c.loop.layers):
        if type(group[0]) is not SelfSlots or not group[0].state:
            continue
        for bufs in zip(*(s.state for s in group)):  # one state tensor (an LSTM: h, then c) of every loop step
            new = torch.stack(bufs)  # (steps, B, layers, H)
            kept = new.gather(0, run.reshape(1, -1, 1, 1).expand(1, *new.shape[1:]))[0]
            for t in bufs:
                t.copy_(kept)


def _gaussian_head(raw: Tensor) -> Tensor:
    """x-transformers' probabilistic head as the continuous wrapper's forward reads it out (``wrappers.gaussian_head``,
    which imports this module): ``raw (..., 2 d)`` as ``(d, 2)`` pairs ``(mean, log-variance)``, the log-variance
    capped so that its ``exp`` stays finite; ``stack((mean, variance)) (2, ..., d)``."""
    pairs = raw.unflatten(-1, (raw.shape[-1] // 2, 2))
    log_var = pairs[..., 1].clamp(max=math.log(torch.finfo(raw.dtype).max) - 0.05)
    return torch.stack((pairs[..., 0], log_var.exp()))
