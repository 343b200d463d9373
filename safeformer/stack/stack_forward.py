"""One forward of a layer stack (``AttentionLayers.forward``), in phases, and the checks and inputs it builds.

Shape legend: b batch, n new positions (queries), p cached positions, m memory slots, j context length,
c model width, c_ctx context width, h heads, h_kv key/value heads, d head dim, L feed-forward blocks.

``AttentionLayers.forward`` gathers its keywords into one ``StackCall`` (as given) and runs the phases, each
returning one immutable, typed value the next ones read:

- ``resolve_call``: x-transformers' spellings and cache protocol resolved, every input checked (the door): a
  ``ResolvedCall``;
- ``share_inputs``: what every block of the call shares, built once (masks, positions, rotary angles and
  bias, the context, the adaptive condition, the attention blocks' keywords) and whether the call runs the
  unpadded path: the ``LayerInputs``;
- ``run_blocks``: the blocks in order (the padded path), collecting keys/values and intermediates;
- ``finish_call``: the final norm, the intermediates and the cache, in ``forward``'s return form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..core.attend import PreparedMask, SelectedMask, prepare_mask
from ..core.cache import (
    AttnIntermediate,
    KVCache,
    LayerIntermediates,
    _dtype_differs,
    attach_cached_kv,
    check_weight_dtype,
    resolve_cache,
)
from ..core.conditions import adaptive_condition
from ..core.masks import as_attention_mask, causal_mask, combine_masks, packed_sequence_mask, validate_mask
from ..nn.attention_calls import check_polar_module, check_polar_pos_emb, polar_angles
from ..nn.attention_scoring import log_prob_from_hard_attend
from ..nn.block import Block, apply_norm, residual_update
from ..nn.hybrid import HybridCall
from ..nn.modules import alibi_bias, positions_from_mask
from .unpadded import UnpaddedPlan

# the ``AttentionLayers`` these phases run (typed as a module: the class imports this file)
StackModule = nn.Module



@dataclass(frozen=True)
class StackCall:
    """One call of ``AttentionLayers.forward`` as given, an immutable value: its keywords (documented on
    ``forward``, which passes each one by name rather than reading ``locals()``, so that ``torch.compile`` traces it
    whole). Each phase reads it and returns its own typed value: ``resolve_call`` a ``ResolvedCall``,
    ``share_inputs`` the ``LayerInputs`` every block reads, ``run_blocks`` the stream and a ``BlocksOut``, which
    ``finish_call`` reads.
    """

    x: Tensor
    mask: Tensor | None
    context: Tensor | None
    context_mask: Tensor | None
    attn_mask: Tensor | None
    positions: Tensor | None
    condition: Tensor | None
    condition_mask: Tensor | None
    cache: KVCache | LayerIntermediates | None
    return_cache: bool
    return_hiddens: bool
    pos: Tensor | None
    unpadded_plan: UnpaddedPlan | None
    cache_age: int
    context_pos: Tensor | None
    causal: bool | None
    ff_deep_embeds: Tensor | None
    deep_embeds_and_ids: tuple | None
    self_attn_additional_kv: list | LayerIntermediates | None
    additional_kv_mask: Tensor | None
    detach_additional_kv: bool
    route_additional_kv_to_top: bool
    self_attn_kv_residuals: Tensor | None
    cross_attn_kv_residuals: Tensor | None
    seq_pos_offset: int | None
    repeat_blocks: tuple | None
    layers_execute_order: tuple | None
    mems: list | None
    mem_masks: Tensor | list | None
    attn_bias: Tensor | None = None
    transform_block_inputs: object = None
    rotary_pos_emb: tuple | None = None
    in_attn_cond: Tensor | None = None
    gumbel_log_probs: bool = False
    polar_pos_emb: tuple | None = None
    packed_context: Tensor | None = None


@dataclass(frozen=True)
class ResolvedCall:
    """Phase 1's value (``resolve_call``): the call's inputs as resolved and checked, once.

    ``x``, ``mask``, ``positions``, ``cache``, ``ff_deep_embeds`` after x-transformers' spellings and cache protocol;
    ``b``, ``n``; ``causal`` (this call's causality); ``padded_only`` (an option the unpadded path does not run);
    ``order`` (the blocks' indices, ``None``: each once); ``per_block`` (extra keywords per attention block, by
    ``id(block)``); ``mem`` (the checked Transformer-XL memories); ``xpos``; ``user_rotary`` (x-transformers'
    ``rotary_pos_emb``, or ``polar_pos_emb``, in the stack's ``(q, k)`` form); ``inject`` (``in_attn_cond``, padded
    rows 0)."""

    x: Tensor
    mask: Tensor | None
    positions: Tensor | None
    cache: KVCache | None
    ff_deep_embeds: Tensor | None
    b: int
    n: int
    causal: bool
    padded_only: bool
    order: tuple | None
    per_block: dict
    mem: _Mems | None
    xpos: bool
    user_rotary: tuple | None
    inject: Tensor | None


@dataclass(frozen=True)
class BlockKeywords:
    """The keywords every self-attention, cross-attention and inverted cross-attention block of the padded path
    takes in one call, built once (``_block_arguments``); read, never written."""

    self_attn: dict
    cross_attn: dict
    inverted: dict


@dataclass(frozen=True)
class LayerInputs:
    """Phase 2's value (``share_inputs``): what every block of the call reads, built once and handed to each.

    ``x`` (padded rows 0); ``positions`` (the real tokens'); ``context`` / ``context_mask`` as the blocks read them;
    ``sa`` / ``ca`` (``SelfAttentionInputs`` / ``CrossAttentionInputs``); ``cond`` (``(b, K)`` or ``None``);
    ``cross_rotary`` (the angles of ``context_pos``); ``unpadded_plan`` (``None``: the padded path); ``blocks``
    (the attention blocks' keywords on the padded path)."""

    x: Tensor
    positions: Tensor
    context: Tensor | None
    context_mask: Tensor | None
    sa: SelfAttentionInputs
    ca: CrossAttentionInputs
    cond: Tensor | None
    cross_rotary: tuple | None
    unpadded_plan: UnpaddedPlan | None
    blocks: BlockKeywords | None = None


@dataclass(frozen=True)
class BlocksOut:
    """What ``run_blocks`` leaves for ``finish_call``: each attention block's keys/values (``self_kv``, ``cross_kv``,
    ``(b, h_kv, p + n, d)``), the hybrid modules' states and, with ``return_hiddens``, the hidden states (and
    ``block_hiddens``, the stream at each default block's end) and the attention maps and logits; ``last_stream`` the residual routing's stream(s) before ``softclamp_output`` and the
    sum."""

    self_kv: list
    cross_kv: list
    hiddens: list
    layer_hiddens: list
    last_stream: Tensor | None
    attn_maps: list
    logit_maps: list
    hybrid_states: list
    block_hiddens: list | None = None


def resolve_call(stack: StackModule, call: StackCall) -> ResolvedCall:
    """Phase 1 (the door): x-transformers' spellings (``pos``, ``deep_embeds_and_ids``, ``seq_pos_offset``) and
    cache protocol resolved, then every input checked once: the ``ResolvedCall``."""
    x, mask, positions, cache, ff_deep_embeds = call.x, call.mask, call.positions, call.cache, call.ff_deep_embeds
    context, context_mask, return_cache = call.context, call.context_mask, call.return_cache
    if call.pos is not None:  # x-transformers' name for positions
        if positions is not None:
            raise ValueError("pass positions or pos (x-transformers' name for it), not both")
        positions = call.pos
    deep_embeds_and_ids = call.deep_embeds_and_ids
    if deep_embeds_and_ids is not None:  # x-transformers' form: the rows of the ids
        if ff_deep_embeds is not None:
            raise ValueError("pass ff_deep_embeds or deep_embeds_and_ids (x-transformers' form of it), not both")
        if not isinstance(deep_embeds_and_ids, (tuple, list)) or len(deep_embeds_and_ids) != 2:
            raise TypeError("deep_embeds_and_ids must be a pair (embeds (V, L, c), ids (b, n))")
        ff_deep_embeds = deep_embeds_and_ids[0][deep_embeds_and_ids[1]]  # (b, n, L, c)
    if call.seq_pos_offset is not None:  # x-transformers' seq_pos_offset: x's first token is at this position
        positions = _offset_positions(positions, call.seq_pos_offset, x, mask)
    n_given = x.shape[1] if isinstance(x, Tensor) and x.dim() == 3 else None
    if isinstance(x, Tensor) and x.dim() == 3:
        cache, keep = resolve_cache(cache, x.shape[1], call.cache_age)
        if keep is not None:  # x-transformers' protocol: the new positions are the last cache_age
            x, mask, positions = _last(x, keep), _last(mask, keep), _last(positions, keep)
            ff_deep_embeds = _last(ff_deep_embeds, keep)
    check_inputs(stack, x, mask, context, context_mask, cache)
    b, n, _ = x.shape
    call_causal = _check_causal_override(stack, call.causal, cache, return_cache)
    ff_deep_embeds = _check_ff_deep_embeds(stack, ff_deep_embeds, x, mask)
    padded_only = ff_deep_embeds is not None or call_causal != stack.causal  # the unpadded path runs neither
    order = _execution_order(stack, call.repeat_blocks, call.layers_execute_order, cache, return_cache,
                             call.unpadded_plan)
    padded_only = padded_only or order is not None
    if ff_deep_embeds is not None and order is not None:
        raise ValueError("ff_deep_embeds holds one row per feed-forward block: not with weight_tie_layers, "
                         "layers_execute_order or repeat_blocks (they run blocks again)")
    # x-transformers' extra keys/values and key/value residuals: keywords per attention block (padded path)
    per_block = _extra_kv_kwargs(stack, call.self_attn_additional_kv, call.additional_kv_mask,
                                 call.detach_additional_kv, call.route_additional_kv_to_top,
                                 call.self_attn_kv_residuals, call.cross_attn_kv_residuals,
                                 x, mask, context, context_mask, cache, n_given)
    padded_only = padded_only or bool(per_block)
    mem = _check_mems(stack, call.mems, call.mem_masks, x, mask, cache, return_cache, call.attn_mask, order, positions)
    padded_only = padded_only or mem is not None
    if call.attn_bias is not None:
        _check_attn_bias(stack, call.attn_bias, x, cache, mem)
    check_transform_block_inputs(call.transform_block_inputs)
    user_rotary = user_rotary_pos_emb(stack, call.rotary_pos_emb, x, mask, cache, return_cache, mem)
    if call.polar_pos_emb is not None:  # x-transformers' PoPE angles: the stack's (q, k) form, as rotary's
        user_rotary = user_polar_pos_emb(stack, call, x, mask, cache, mem, user_rotary)
    inject = in_attn_condition(stack, call.in_attn_cond, x, mask)
    padded_only = padded_only or call.attn_bias is not None or call.transform_block_inputs is not None \
        or user_rotary is not None or inject is not None or call.packed_context is not None
    if isinstance(positions, Tensor) and positions.dim() == 3:  # per-head ALiBi positions (x-transformers')
        if cache is not None or return_cache:
            raise ValueError("positions per head (b, h, n) run without a KV cache (the cache keeps one position "
                             "per token); pass (b, n) positions to decode with a cache")
        padded_only = True
    xpos = stack.rotary is not None and stack.rotary.use_xpos
    if xpos and (cache is not None or return_cache or call.context_pos is not None):
        raise ValueError("rotary_xpos runs without a KV cache (its scales are centered on the positions of each "
                         "call: cached keys would keep an old center) and rotates self-attention only (no "
                         "context_pos); decode with cache_kv=False")
    return ResolvedCall(x=x, mask=mask, positions=positions, cache=cache, ff_deep_embeds=ff_deep_embeds, b=b, n=n,
                        causal=call_causal, padded_only=padded_only, order=order, per_block=per_block, mem=mem,
                        xpos=xpos, user_rotary=user_rotary, inject=inject)


def share_inputs(stack: StackModule, call: StackCall, r: ResolvedCall) -> LayerInputs:
    """Phase 2: what every block of the call shares, built once: ``x`` with padded rows selected to 0, the
    self-attention inputs (``sa``: masks, positions, rotary angles, bias; the kernel masks of memories whose
    masks differ per block), the context (``ca``), the adaptive condition (``cond``, ``(b, K)``), the rotary
    angles of ``context_pos``, the unpadded plan (``None``: the padded path) and, on the padded path, the attention
    blocks' keywords: the ``LayerInputs``."""
    x, mask, cache, attn_mask, positions = r.x, r.mask, r.cache, call.attn_mask, r.positions
    mem, call_causal, b, n, return_cache = r.mem, r.causal, r.b, r.n, call.return_cache
    context_pos, unpadded_plan, padded_only = call.context_pos, call.unpadded_plan, r.padded_only
    if mask is not None:
        x = torch.where(mask[..., None], x, 0.0)
    sa = self_attention_inputs(stack, x, mask, cache, attn_mask, positions, causal=call_causal,
                               mem_len=0 if mem is None else mem.length,
                               mem_mask=None if mem is None else mem.masks[0])
    if r.user_rotary is not None:  # x-transformers' rotary_pos_emb: the given angles replace the stack's
        sa = replace(sa, rotary=r.user_rotary)
    if mem is not None:  # the kernel masks of the blocks whose memory mask differs from the first's
        mem.kernel_masks = {}
        first = mem.masks[0]
        for t_mask in mem.masks[1:]:
            same = t_mask is first or (isinstance(t_mask, Tensor) and isinstance(first, Tensor)
                                       and t_mask.shape == first.shape and torch.equal(t_mask, first))
            if not same and id(t_mask) not in mem.kernel_masks:
                mem.kernel_masks[id(t_mask)] = self_attention_inputs(
                    stack, x, mask, cache, attn_mask, positions, causal=call_causal, mem_len=mem.length,
                    mem_mask=t_mask).mask
        if mem.kernel_masks and sa.bias is not None:
            raise ValueError("mem_masks that differ per block cannot be combined with alibi_pos_bias or rel_pos_bias "
                             "(the bias counts the memory positions once for all blocks): pass one mem_masks tensor")
    ca = cross_attention_inputs(stack, call.context, call.context_mask, cache, b)
    if call.packed_context is not None:  # packed context documents: each query document sees its own
        ca = replace(ca, mask=call.packed_context if ca.mask is None else ca.mask & call.packed_context)
    positions, context, context_mask, use_cross = sa.positions, ca.context, ca.context_mask, ca.used

    cond = adaptive_condition(stack, call.condition, call.condition_mask, cache, b, x)  # (b, K) or None
    if cond is not None and stack.adaptive_mlp is not None and (cache is None or cache.condition is None):
        cond = stack.adaptive_mlp(cond)  # (b, K * expansion); a cache keeps it transformed

    cross_rotary = None
    if context_pos is not None:  # x-transformers' rotary cross-attention: keys at the context's positions
        cross_rotary = _cross_rotary(stack, context_pos, context if use_cross else None, cache, return_cache,
                                     unpadded_plan, sa.rotary, x)
    if unpadded_plan is None:
        if context_pos is None and not padded_only:  # the rotary cross-attention runs on the padded path
            unpadded_plan = stack.plan_unpadded(mask, cache=cache, return_cache=return_cache, attn_mask=attn_mask,
                                                return_hiddens=call.return_hiddens)
    elif not isinstance(unpadded_plan, UnpaddedPlan) or (unpadded_plan.b, unpadded_plan.n) != (b, n) or mask is None:
        raise ValueError("unpadded_plan must be the plan_unpadded(...) of this call's mask")
    elif padded_only:
        raise ValueError("a causal override, ff_deep_embeds, additional keys/values and key/value residuals run "
                         "on the padded path: pass no unpadded_plan")
    inputs = LayerInputs(x=x, positions=positions, context=context, context_mask=context_mask, sa=sa, ca=ca,
                         cond=cond, cross_rotary=cross_rotary, unpadded_plan=unpadded_plan)
    return inputs if unpadded_plan is not None else replace(inputs, blocks=_block_arguments(stack, call, r, inputs))


def _block_arguments(stack: StackModule, call: StackCall, r: ResolvedCall, inp: LayerInputs) -> BlockKeywords:
    """The keywords every self-attention, cross-attention and inverted cross-attention block of the padded path
    takes in this call."""
    mask, cache, sa, ca, b, n = r.mask, r.cache, inp.sa, inp.ca, r.b, r.n
    context, cross_mask, use_cross = inp.context, ca.mask, ca.used
    # a cache is input too: only a cache with padding has masked slots, and what they hold (its own
    # finite projections, or whatever a user put there) is selected away by attend, not trusted
    # (masked keys and dead rows are padding, selected to 0 at the input unless attn_mask hides real positions)
    self_clean = call.attn_mask is None and (cache is None or cache.mask is None)
    # a new context was selected above (not a packed one: its keys after the last document are not)
    cross_clean = (not ca.cached or inp.context_mask is None) and call.packed_context is None
    self_args = dict(mask=SelectedMask(sa.mask) if self_clean else sa.mask, causal=sa.causal, rotary=sa.rotary,
                     bias=sa.bias if call.attn_bias is None else _selected_bias(stack, call, r, sa),  # one or the other
                     return_attn=call.return_hiddens, _return_kv=True)
    cross_args = dict(mask=SelectedMask(cross_mask) if cross_clean else cross_mask, causal=False,
                      return_attn=call.return_hiddens, _return_kv=True, rotary=inp.cross_rotary)
    if stack.self_positions:  # the real tokens' positions (rel_proj_pos_bias, max_attend_past)
        self_args["positions"] = (inp.positions, sa.all_positions)
    inverted_args = cross_args
    if mask is not None and use_cross and stack.inverted_cross:
        # inverted cross-attention normalises over the queries: padded ones take none
        q_pad = mask[:, None, :, None]  # (b, 1, n, 1)
        j_ctx = context.shape[1] if context is not None else 0
        full = q_pad.expand(b, 1, n, j_ctx) if cross_mask is None else q_pad & cross_mask
        inverted_args = dict(cross_args, mask=full)
    return BlockKeywords(self_args, cross_args, inverted_args)


@dataclass
class _BlockRun:
    """What ``run_blocks`` carries from block to block in one call: the keywords of the attention blocks, and
    what the blocks leave (keys/values, hybrid states, the first values, the last logits)."""

    keywords: BlockKeywords
    self_kv: list
    cross_kv: list
    hybrid_states: list  # attn_hybrid_module: each self-attention's recurrent state after this call
    first_values: dict  # add_value_residual: the first self- and cross-attention's values (new positions)
    prev_logits: dict  # residual_attn / cross_residual_attn: the last self- / cross-attention's logits


def _run_block(stack: StackModule, r: ResolvedCall, inp: LayerInputs, run: _BlockRun, block: Block, x: Tensor, cond: Tensor | None,
               past_kv=None, cached=None) -> tuple[Tensor, tuple]:
    """One block on ``x`` with this call's keywords: ``(branch output, extra)``, ``extra`` the attention's
    keys/values (and weights, logits) or ``()`` for a feed-forward."""
    mask, per_block = r.mask, r.per_block
    shift = {"shift_mask": mask} if block.shifts else {}  # shift_tokens: padded positions read as 0
    if block.kind == "self":
        at = len(run.self_kv)
        hy = _hybrid_call(block.mixer, mask, r.cache, at)  # attn_hybrid_module's input and state
        args = dict(run.keywords.self_attn, return_attn=True, prev_attn=run.prev_logits.get("self")) \
            if stack.residual_attn else run.keywords.self_attn
        if r.mem is not None:  # Transformer-XL: this block's memory keys/values before the sequence's own
            past_kv, args = _mem_kv(stack, r.mem, block, at, cond, inp.sa), _mem_args(r.mem, at, args)
        res = block(x, cond, past_kv=past_kv, value_residual=run.first_values.get("self"), **shift,
                    **({} if hy is None else {"hybrid": hy}), **args, **per_block.get(id(block), {}))
        if stack.residual_attn:
            run.prev_logits["self"] = res[1][2]
        if hy is not None:
            run.hybrid_states.append(hy.state_out)
        return res
    if block.kind == "cross":
        vr = run.first_values.get("cross") if cached is None else None  # a cached context is mixed already
        args = run.keywords.inverted if getattr(block.mixer, "inverted", False) else run.keywords.cross_attn
        if stack.cross_residual_attn:
            args = dict(args, return_attn=True, prev_attn=run.prev_logits.get("cross"))
        res = block(x, cond, None if cached is not None else inp.context, kv=cached, value_residual=vr,
                    **per_block.get(id(block), {}), **shift, **args)
        if stack.cross_residual_attn:
            run.prev_logits["cross"] = res[1][2]
        return res
    return block(x, cond, **shift)


def run_blocks(stack: StackModule, call: StackCall, r: ResolvedCall, shared: LayerInputs) -> tuple[Tensor, BlocksOut]:
    """Phase 3, the padded path: the blocks in order (``r.order``, or each once), with the residual routing,
    stochastic depth and activation checkpointing. Returns the stream ``(b, n, c)`` before the final norm and the
    ``BlocksOut``: each attention block's keys/values, the hybrid modules' states and (``return_hiddens``) the
    hidden states and attention maps, padded positions 0."""
    mask, cache, cond = r.mask, r.cache, shared.cond
    cached_cross, use_cross = shared.ca.cached, shared.ca.used
    return_hiddens, ff_deep_embeds, b, n, x = call.return_hiddens, r.ff_deep_embeds, r.b, r.n, shared.x
    state = _BlockRun(shared.blocks, self_kv=[], cross_kv=[], hybrid_states=[], first_values={},
                      prev_logits={})
    self_kv, cross_kv, first_values = state.self_kv, state.cross_kv, state.first_values
    recompute = _recompute(stack, call, r)
    hiddens, attn_maps, logit_maps = [], [], []
    block_hiddens = [] if return_hiddens else None  # x-transformers' stream at each default block's end
    ff_seen = 0  # feed-forward blocks run so far (ff_deep_embeds' index)

    def run(block: Block, x: Tensor, cond: Tensor | None, past_kv=None, cached=None) -> tuple[Tensor, tuple]:
        return _run_block(stack, r, shared, state, block, x, cond, past_kv, cached)

    hidden_kind = "self" if "self" in stack.layer_kinds else stack.layer_kinds[0]  # return_hiddens' hiddens
    route, layer_hiddens = None, []  # the residual routing's state (x-transformers' residual options)
    if stack.routing is not None:
        x, route = stack.routing.begin(x, mask, cond)
        route.inject = r.inject if r.inject is not None else route.inject  # in_attn_cond (not reinject_input)
    for ind, idx in enumerate(range(len(stack.layers)) if r.order is None else r.order):
        block = stack.layers[idx]
        if call.transform_block_inputs is not None and ind % stack.len_default_block == 0 and ind > 0:
            x = transform_block_input(call.transform_block_inputs, ind // stack.len_default_block + 1, x, mask)
        if return_hiddens and block.kind == hidden_kind:  # the stream entering each self-attention (x-transformers)
            hiddens.append(_masked(x if route is None else stack.routing.view(x), mask))
        inp = x  # the block's input
        if route is not None:
            x, inp = stack.routing.enter(route, idx, x)
        elif return_hiddens:
            layer_hiddens.append(x)
        if route is None and r.inject is not None:  # in_attn_cond: added to the branch input, not the stream
            inp = x + r.inject
        if block.kind == "cross" and not use_cross:
            if route is not None:  # the routing runs on, the branch adding nothing (as for a dropped context)
                x = stack.routing.leave(route, idx, None)
            _note_block_end(stack, block_hiddens, ind, x)
            continue
        if recompute:  # keeps no activations; recomputed (same RNG draws) in the backward pass
            out = checkpoint(lambda t, c, blk=block: run(blk, t, c)[0], inp, cond, use_reentrant=False)
            extra = (None,)
        else:
            past_kv = cache.self_kv[len(self_kv)] if cache is not None and block.kind == "self" else None
            cached = cache.cross_kv[len(cross_kv)] if cached_cross and block.kind == "cross" else None
            out, extra = run(block, inp, cond, past_kv, cached)
        if block.kind == "ff" and ff_deep_embeds is not None:  # ff_deep_embed: per-token scale of the branch
            out = out * ff_deep_embeds[:, :, ff_seen].to(out.dtype)
            ff_seen += 1
        if block.kind != "ff":
            (self_kv if block.kind == "self" else cross_kv).append(extra[0])
            if stack.add_value_residual and block.kind not in first_values:  # its values of the new positions
                first_values[block.kind] = extra[0][1][:, :, -n:] if block.kind == "self" else extra[0][1]
        if return_hiddens and len(extra) > 1:  # the attention weights and logits: padded queries' rows are 0
            attn_maps.append(_masked_rows(extra[1], mask))
            logit_maps.extend(_masked_rows(e, mask) for e in extra[2:3])
        out = _stochastic_depth(stack, out, b)
        x = residual_update(block[2], out, x) if route is None else stack.routing.leave(route, idx, out)
        _note_block_end(stack, block_hiddens, ind, x)
    last_stream = None
    if route is not None:
        last_stream = x
        x = stack.routing.finish(x)  # the streams summed
        layer_hiddens = route.layer_hiddens
    return x, BlocksOut(self_kv=self_kv, cross_kv=cross_kv, hiddens=hiddens, layer_hiddens=layer_hiddens,
                        last_stream=last_stream, attn_maps=attn_maps, logit_maps=logit_maps,
                        hybrid_states=state.hybrid_states, block_hiddens=block_hiddens)


def _note_block_end(stack: StackModule, block_hiddens: list | None, ind: int, x: Tensor) -> None:
    """x-transformers' ``block_hiddens``: after the ``ind``-th block run (execution order), when it ends a default
    block (``(ind + 1) % len_default_block == 0``, or ``ind`` is the index of the stack's last layer, as there), the
    stream ``x`` is kept (several residual streams ``(b, n, S, c)`` as ``(b S, n, c)``, x-transformers' layout).
    Nothing when ``block_hiddens`` is ``None`` (no ``return_hiddens``)."""
    if block_hiddens is not None and ((ind + 1) % stack.len_default_block == 0 or ind == len(stack.layers) - 1):
        block_hiddens.append(_last_hidden(x, x if x.dim() == 4 else None))


def _check_attn_bias(stack: StackModule, attn_bias, x: Tensor, cache, mem) -> None:
    """x-transformers' ``forward(attn_bias=...)``: an additive float bias of every self-attention's logits,
    broadcastable to ``(b, h, n, p + n)`` (``p`` cached positions or memory slots).

    Raises:
        TypeError: not a floating tensor.
        ValueError: its shape does not broadcast, or the stack has its own position bias (x-transformers asserts
            against ALiBi / T5 / dynamic position bias with it, and its data-dependent ALiBi replaces it).
    """
    if not isinstance(attn_bias, Tensor) or not attn_bias.is_floating_point():
        raise TypeError(f"attn_bias must be a floating tensor (an additive bias of the self-attention logits), got "
                        f"{getattr(attn_bias, 'dtype', type(attn_bias).__name__)}")
    if stack.alibi_slopes is not None or stack.rel_pos is not None:
        raise ValueError("attn_bias is an additive self-attention bias: not with alibi_pos_bias, rel_pos_bias or "
                         "dynamic_pos_bias (the stack's own position bias; x-transformers asserts against both)")
    if any(blk.kind == "self" and blk.mixer.to_forget_gates is not None for blk in stack.layers):
        raise ValueError("attn_bias with attn_data_dependent_alibi: x-transformers replaces the given bias by the "
                         "forget gates' (it would be silently dropped); pass one of them")
    b, n = x.shape[:2]
    j = n + (cache.length if cache is not None else mem.length if mem is not None else 0)
    h = next((blk.mixer.heads for blk in stack.layers if blk.kind == "self"), None)
    if h is None:
        raise ValueError("attn_bias biases self-attention: this stack has none")
    if attn_bias.device != x.device or attn_bias.dim() > 4 or any(
            s not in (1, f) for s, f in zip(attn_bias.shape[::-1], (j, n, h, b))):
        raise ValueError(f"attn_bias must broadcast to (b, h, n, p + n) = ({b}, {h}, {n}, {j}) on {x.device}, got "
                         f"{tuple(attn_bias.shape)} on {attn_bias.device}")


def _selected_bias(stack: StackModule, call: StackCall, r: ResolvedCall, sa: SelfAttentionInputs) -> Tensor:
    """``attn_bias`` with 0 wherever a query may not attend (padded queries, masked keys, causal, ``attn_mask``):
    what it holds there (NaN, inf) reaches no output and no gradient. ``(b|1, h|1, n, j)``."""
    bias, b, n = call.attn_bias, r.b, r.n
    j = n + (r.cache.length if r.cache is not None else r.mem.length if r.mem is not None else 0)
    m = sa.mask.combined if isinstance(sa.mask, PreparedMask) else sa.mask
    h = next(blk.mixer.heads for blk in stack.layers if blk.kind == "self")
    keep = None if m is None else as_attention_mask(m, b, h, n, j)
    if sa.causal or r.causal:
        keep = combine_masks(keep, causal_mask(n, j, device=bias.device))
    if r.mask is not None:
        keep = combine_masks(keep, r.mask[:, None, :, None])
    return bias if keep is None else torch.where(keep, bias, 0.0)


def check_transform_block_inputs(hook) -> None:
    """x-transformers' ``transform_block_inputs``: ``None``, a callable ``(depth, x) -> x`` or a dict ``{depth:
    x -> x}`` (``depth`` counted from 1: layers 2, 3, ... of the stack)."""
    if hook is None or (callable(hook) and not isinstance(hook, dict)):
        return
    if not isinstance(hook, dict) or not all(isinstance(k, int) and not isinstance(k, bool) and callable(v)
                                             for k, v in hook.items()):
        raise TypeError("transform_block_inputs must be a callable (depth, x) -> x or a dict {depth (int): "
                        f"callable x -> x}}, got {type(hook).__name__}")


def transform_block_input(hook, depth: int, x: Tensor, mask: Tensor | None) -> Tensor:
    """The stream entering layer ``depth`` (from 2) through x-transformers' ``transform_block_inputs``. The hook sees
    the stream as x-transformers holds it (``(b S, n, c)`` with several residual streams) with padded positions
    exactly 0, and its result's padded positions are selected to 0 again (whatever it put there reaches nothing)."""
    fn = hook.get(depth) if isinstance(hook, dict) else (lambda t: hook(depth, t))
    if fn is None:
        return x
    streams = x.dim() == 4  # (b, n, S, c): the residual streams
    keep = None if mask is None else (mask[..., None, None] if streams else mask[..., None])
    t = x if keep is None else torch.where(keep, x, 0.0)
    t = t.movedim(-2, 1).flatten(0, 1) if streams else t  # (b S, n, c), x-transformers' layout
    out = fn(t)
    if not isinstance(out, Tensor) or out.shape != t.shape:
        raise ValueError(f"transform_block_inputs at depth {depth} must return a tensor of the stream's shape "
                         f"{tuple(t.shape)}, got {tuple(getattr(out, 'shape', ())) or type(out).__name__}")
    out = out.unflatten(0, (x.shape[0], x.shape[2])).movedim(1, -2) if streams else out
    return out if keep is None else torch.where(keep, out, 0.0)


def user_rotary_pos_emb(stack: StackModule, rotary_pos_emb, x: Tensor, mask: Tensor | None, cache,
                        return_cache: bool, mem) -> tuple | None:
    """x-transformers' ``forward(rotary_pos_emb=(freqs, xpos_scale))``: the rotary angles every self-attention uses in
    place of the stack's own (x-transformers' ``RotaryEmbedding.forward`` form: ``freqs (b|1, N, d_rot)`` or ``(N,
    d_rot)``, of which the last ``n`` rotate the queries and keys; ``xpos_scale`` 1, ``None`` or a positive
    ``(b|1, N, d_rot)`` multiplying queries, its inverse multiplying keys). Returns the stack's ``(q, k)`` form
    ``(b|1, 1, n, d_rot)`` with padded positions' angles 0 and scales 1 (what they hold reaches nothing), or ``None``.

    Raises:
        TypeError: not a pair.
        ValueError: a bad shape, dtype, device or scale; with a KV cache, Transformer-XL memories or PoPE.
    """
    if rotary_pos_emb is None:
        return None
    if not (isinstance(rotary_pos_emb, (tuple, list)) and len(rotary_pos_emb) == 2):
        raise TypeError(f"rotary_pos_emb must be a pair (freqs, xpos_scale) as RotaryEmbedding returns it, got "
                        f"{type(rotary_pos_emb).__name__}")
    freqs, scale = rotary_pos_emb
    b, n = x.shape[:2]
    dims = [blk.mixer.dim_head for blk in stack.layers if blk.kind == "self"]
    if not isinstance(freqs, Tensor) or not freqs.is_floating_point() or freqs.dim() not in (2, 3) \
            or freqs.device != x.device:
        raise ValueError(f"rotary_pos_emb's freqs must be a float tensor (b|1, N, d_rot) or (N, d_rot) on {x.device}, "
                         f"got {getattr(freqs, 'dtype', type(freqs).__name__)} {tuple(getattr(freqs, 'shape', ()))}")
    freqs = freqs[None] if freqs.dim() == 2 else freqs
    rot = freqs.shape[-1]
    if not dims or freqs.shape[0] not in (1, b) or freqs.shape[1] < n or rot == 0 or rot % 2 or rot > min(dims):
        raise ValueError(f"rotary_pos_emb's freqs must have shape (b|1, N >= n, d_rot) with (b, n) = ({b}, {n}) and an "
                         f"even d_rot <= dim_head ({min(dims) if dims else 'no self-attention'}), got "
                         f"{tuple(freqs.shape)}")
    if cache is not None or return_cache or mem is not None or stack.polar_pos_emb is not None:
        raise ValueError("rotary_pos_emb runs without a KV cache or Transformer-XL memories (x-transformers rotates "
                         "every cached key again with the freqs of each call; safeformer's cache holds keys rotated "
                         "once) and not with polar_pos_emb")
    keep = None if mask is None else mask[:, None, :, None]  # (b, 1, n, 1)
    ang = freqs[:, None, -n:]  # (b|1, 1, n, d_rot)
    ang = ang if keep is None else torch.where(keep, ang, 0.0)
    if scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale == 1):
        return ang, ang
    if not isinstance(scale, Tensor) or not scale.is_floating_point() or scale.dim() != 3 \
            or scale.shape[0] not in (1, b) or scale.shape[1] < n or scale.shape[2] not in (1, rot) \
            or scale.device != x.device:
        raise ValueError(f"rotary_pos_emb's xpos_scale must be 1, None or a float tensor (b|1, N >= {n}, d_rot) on "
                         f"{x.device}, got {getattr(scale, 'dtype', scale)} {tuple(getattr(scale, 'shape', ()))}")
    sc = scale[:, None, -n:]
    sc = sc if keep is None else torch.where(keep, sc, 1.0)
    if not bool(((sc > 0) & torch.isfinite(sc) & torch.isfinite(1.0 / sc)).all()):  # one host read
        raise ValueError("rotary_pos_emb's xpos_scale must be positive and finite, with a finite inverse, at every "
                         "real position (keys are divided by it)")
    return (ang, sc), (ang, sc ** -1.0)


def user_polar_pos_emb(stack: StackModule, call: StackCall, x: Tensor, mask: Tensor | None, cache, mem,
                       user_rotary) -> tuple:
    """x-transformers' ``forward(polar_pos_emb=(freqs, bias))``: the PoPE angles every self-attention uses in place
    of the stack's own (with or without ``polar_pos_emb=True``): ``freqs (1, N, d)`` (``PolarEmbedding.forward``'s
    form), the last ``n`` rows for the queries and keys, the keys' angles ``freqs + bias`` (``bias`` broadcasting to
    ``(h, N, d)``, ``PolarEmbedding``'s ``(h, 1, d)``). Returns the stack's ``(q, k)`` PoPE form
    (``attention_calls.polar_angles``) with padded positions' angles 0 (what they hold reaches nothing).

    Raises:
        TypeError: not a pair of float tensors.
        ValueError: a bad shape, a non-finite angle at a real position; with a KV cache, memories, extra keys/values,
            rotary positions (x-transformers would apply both) or attention options PoPE cannot meet.
    """
    refusal = ("a KV cache (x-transformers applies each call's angles to every cached key again; safeformer's cache "
               "holds keys after PoPE)" if cache is not None or call.return_cache else
               "Transformer-XL memories" if mem is not None else
               "self_attn_additional_kv (their keys have d features, PoPE's 2 d)"
               if call.self_attn_additional_kv is not None else
               "rotary positions (rotary_pos_emb; x-transformers would rotate and apply PoPE both)"
               if user_rotary is not None or stack.rotary is not None else None)
    if refusal is not None:
        raise ValueError(f"polar_pos_emb (PoPE angles given to the call) is not supported with {refusal}")
    mixers = [blk.mixer for blk in stack.layers if blk.kind == "self"]
    if not mixers:
        raise ValueError("polar_pos_emb applies PoPE to self-attention: this stack has none")
    n = x.shape[1]
    freqs, key_angles = check_polar_pos_emb(call.polar_pos_emb, mixers[0].heads, mixers[0].dim_head, n, x.device)
    for attn in mixers:
        if (attn.heads, attn.dim_head) != (mixers[0].heads, mixers[0].dim_head):
            raise ValueError("polar_pos_emb gives one set of angles: its self-attention blocks must share heads and "
                             "dim_head")
        check_polar_module(attn, key_angles)
    return polar_angles(freqs, key_angles, n, n, mask, mask)


def packed_context_mask(stack: StackModule, x, context, context_mask, cache, kwargs) -> Tensor:
    """x-transformers' ``forward(flash_pack_seq_context_kwargs=...)`` (flash-attn's ``cu_seqlens_q`` of ``x``'s
    documents, ``cu_seqlens_k`` of the context's) of a stack whose cross-attention is built with
    ``attn_flash_pack_seq=True``: one packed sequence and one packed context as the cross-attention mask ``(1, 1, n,
    j)``, query document ``d`` seeing context document ``d`` only (a query after the last document sees nothing).

    Raises:
        TypeError: no such cross-attention, or bad offsets (``masks.packed_sequence_mask``).
        ValueError: a batch other than 1, with ``context_mask`` (x-transformers asserts) or a cache.
    """
    blocks = [blk.mixer for blk in stack.layers if blk.kind == "cross"]
    if not blocks or not all(m.flash_pack_seq for m in blocks):
        raise TypeError("flash_pack_seq_context_kwargs needs a stack with cross-attention built with "
                        "attn_flash_pack_seq=True")
    if not (isinstance(x, Tensor) and x.dim() == 3 and x.shape[0] == 1 and isinstance(context, Tensor)
            and context.dim() == 3 and context.shape[0] == 1) or context_mask is not None or cache is not None:
        raise ValueError("flash_pack_seq_context_kwargs describe one packed sequence and its packed context (x and "
                         "context of batch 1): not with context_mask or a cache (x-transformers asserts the same)")
    return packed_sequence_mask(kwargs, x.shape[1], context.shape[1], x.device, name="flash_pack_seq_context_kwargs")


def in_attn_condition(stack: StackModule, cond, x: Tensor, mask: Tensor | None) -> Tensor | None:
    """x-transformers' ``forward(in_attn_cond=...)`` (in-attention conditioning): ``(b, c)`` or ``(b|1, n|1, c)``
    added to the input of every block's branch (after its residual is taken, before its pre-norm), as
    ``reinject_input``'s projection is. Returns it as ``(b|1, n|1, c)``, ``(b, n, c)`` with padded positions 0
    (what it holds there reaches nothing), or ``None``.

    Raises:
        TypeError: not a floating tensor of the stream's dtype.
        ValueError: a bad shape or device, or with ``reinject_input`` (x-transformers asserts).
    """
    if cond is None:
        return None
    b, n, c = x.shape
    if not isinstance(cond, Tensor) or not cond.is_floating_point() or _dtype_differs(cond, x):
        raise TypeError(f"in_attn_cond must be a float tensor (b, dim) or (b, n|1, dim) of dtype {x.dtype}, got "
                        f"{getattr(cond, 'dtype', type(cond).__name__)}")
    cond = cond[:, None] if cond.dim() == 2 else cond
    if cond.dim() != 3 or cond.shape[0] not in (1, b) or cond.shape[1] not in (1, n) or cond.shape[2] != c \
            or cond.device != x.device:
        raise ValueError(f"in_attn_cond must have shape (b, dim) or (b|1, n|1, dim) with (b, n, dim) = ({b}, {n}, "
                         f"{c}) on {x.device}, got {tuple(cond.shape)} on {cond.device}")
    if getattr(stack, "reinject_input_proj", None) is not None:
        raise ValueError("in_attn_cond takes the place of reinject_input's projection: not with reinject_input=True "
                         "(x-transformers asserts)")
    return cond if mask is None else torch.where(mask[..., None], cond, 0.0)


def set_log_probs(attn_intermediates: list) -> None:
    """x-transformers' ``forward(return_gumbel_log_probs=True)``: each attention block's intermediate gets
    ``log_probs (b, h, i)``, the log probability of the key each query picked (``log_prob_from_hard_attend``; 0 for
    padded queries and dead rows, which pick nothing)."""
    for inter in attn_intermediates:
        if inter.pre_softmax_attn is None or inter.post_softmax_attn is None:
            raise ValueError("return_gumbel_log_probs reads each attention's logits and weights: not with "
                             "attention blocks built with flash=True (they keep neither)")
        inter.log_probs = log_prob_from_hard_attend(inter)


def _recompute(stack: StackModule, call: StackCall, r: ResolvedCall) -> bool:
    """Whether the blocks run under activation checkpointing in this call (training, with gradients, no cache)."""
    return stack.checkpoint_layers and stack.training and torch.is_grad_enabled() and not call.return_cache \
        and r.cache is None and not call.return_hiddens


def _masked(h: Tensor, mask: Tensor | None) -> Tensor:
    """``h (b, n, ...)`` with padded positions exactly 0."""
    return h if mask is None else torch.where(mask[..., None], h, 0.0)


def _masked_rows(m: Tensor, mask: Tensor | None) -> Tensor:
    """Attention weights or logits ``(b, h, n, j)`` with padded queries' rows exactly 0."""
    return m if mask is None else torch.where(mask[:, None, :, None], m, 0.0)


def _stochastic_depth(stack: StackModule, out: Tensor, b: int) -> Tensor:
    """A branch's output under ``layer_dropout`` in training: each sample skips it with that probability."""
    if not (stack.training and stack.layer_dropout > 0):
        return out
    keep = torch.rand(b, 1, 1, device=out.device) >= stack.layer_dropout
    return torch.where(keep, out / (1.0 - stack.layer_dropout), 0.0)


def _last_hidden(x: Tensor, stream: Tensor | None) -> Tensor:
    """``layer_hiddens``' last entry as x-transformers gives it: the stream before ``softclamp_output`` (the routing's
    ``stream``, when it ran) and, with several residual streams ``(b, n, S, c)``, the streams apart as ``(b S, n, c)``."""
    if stream is None:
        return x
    return stream.movedim(-2, 1).flatten(0, 1) if stream.dim() == 4 else stream


def _mask_hidden(h: Tensor, mask: Tensor) -> Tensor:
    """A ``layer_hiddens`` entry with padded positions exactly 0: ``(b, n, c)``, ``(V, b, n, c)`` (the views of
    hyper-connections' separate q/k/v inputs) or ``(b S, n, c)`` (the residual streams apart)."""
    if h.dim() == 4:
        return torch.where(mask[None, :, :, None], h, 0.0)
    if h.shape[0] != mask.shape[0]:
        mask = mask.repeat_interleave(h.shape[0] // mask.shape[0], dim=0)
    return torch.where(mask[..., None], h, 0.0)


def finish_call(stack: StackModule, call: StackCall, r: ResolvedCall, inp: LayerInputs, x: Tensor, out: BlocksOut
                ) -> Tensor | tuple:
    """Phase 4: the final norm of the stream ``x (b, n, c)`` (padded positions exact zeros), the intermediates
    (``return_hiddens``) and the new cache (``return_cache``) from ``out``, in ``forward``'s return form."""
    mask, cache, cond, b, n = r.mask, r.cache, inp.cond, r.b, r.n
    layer_hiddens = out.layer_hiddens
    if call.return_hiddens:  # x-transformers' layer_hiddens: every block's input, then the stream before the final norm
        layer_hiddens = [*layer_hiddens, _last_hidden(x, out.last_stream)]
        if mask is not None:
            layer_hiddens = [_mask_hidden(h, mask) for h in layer_hiddens]
    x = apply_norm(stack.final_norm, x, cond)
    if mask is not None:  # padded positions leave as exact zeros (and pass back no gradient)
        x = torch.where(mask[..., None], x, 0.0)
    intermediates = None
    if call.return_hiddens:
        order, logit_maps = r.order, out.logit_maps
        ran = stack.layer_kinds if order is None else [stack.layer_kinds[i] for i in order]
        kinds = [k for k in ran if k != "ff" and (k == "self" or inp.ca.used)]
        intermediates = LayerIntermediates(
            hiddens=out.hiddens, last_hidden=x, layer_hiddens=layer_hiddens,
            attn_intermediates=[AttnIntermediate(post_softmax_attn=w, layer_type="a" if k == "self" else "c",
                                                 pre_softmax_attn=logit_maps[t] if t < len(logit_maps) else None)
                                for t, (w, k) in enumerate(zip(out.attn_maps, kinds))],
            block_hiddens=_block_hiddens(out.block_hiddens, x, mask),
        )
        if call.gumbel_log_probs:
            set_log_probs(intermediates.attn_intermediates)
    cache_args = (cache, mask, b, n, x.device, out.self_kv, out.cross_kv, inp.sa, inp.ca, cond, call.condition,
                  call.condition_mask, out.hybrid_states)
    if intermediates is not None and r.causal == stack.causal and inp.sa.all_positions.dim() == 2 \
            and not r.xpos and r.mem is None and r.user_rotary is None:  # the
        # cache (x-transformers' protocol; not with positions per head, which a cache does not keep;
        # not after a causal override: its keys/values are not what the stack's own causality continues from)
        intermediates.cache = _new_cache(*cache_args)
        attach_cached_kv(intermediates)  # x-transformers' per-block cached_kv (the cache's own tuples)
    if not call.return_cache:
        return x if intermediates is None else (x, intermediates)
    if intermediates is not None:
        return x, intermediates.cache, intermediates
    return x, _new_cache(*cache_args)


def _block_hiddens(block_hiddens: list | None, x: Tensor, mask: Tensor | None) -> list | None:
    """x-transformers' ``block_hiddens`` of one call: the stream at each default block's end, the last replaced by
    the output ``x`` (after the final norm, its padded positions 0 already); padded positions exactly 0, as in
    ``layer_hiddens``."""
    if not block_hiddens:
        return block_hiddens
    kept = block_hiddens[:-1] if mask is None else [_mask_hidden(h, mask) for h in block_hiddens[:-1]]
    return [*kept, x]


def _execution_order(stack: StackModule, repeat_blocks, layers_execute_order, cache, return_cache: bool,
                     unpadded_plan) -> tuple[int, ...] | None:
    """The blocks' indices in the order this call runs them (``None``: each once, in order), after the checks
    of ``repeat_blocks`` / ``layers_execute_order`` and of the residual routing against the cache and plan."""
    routing = stack.routing
    if stack.cache_refusal is not None and (cache is not None or return_cache):
        raise ValueError(stack.cache_refusal)
    if routing is not None and routing.sequence_wide and (cache is not None or return_cache):
        raise ValueError("orthog_residual and mv_split_residual reduce over the whole sample: they run without a KV "
                         "cache (a cache would reduce over the new positions alone); decode with cache_kv=False")
    if routing is not None and unpadded_plan is not None:
        raise ValueError("the residual routing options run on the padded path: pass no unpadded_plan")
    if repeat_blocks is None and layers_execute_order is None:
        return stack.default_order  # the constructor's (weight_tie_layers, layers_execute_order), or None
    if repeat_blocks is not None and layers_execute_order is not None:
        raise ValueError("pass repeat_blocks or layers_execute_order, not both")
    if repeat_blocks is not None and stack.has_custom_layer_types:
        raise ValueError("repeat_blocks repeats layers of the default layout: not with custom_layers, par_ratio or "
                         "sandwich_coef (pass layers_execute_order)")
    num = len(stack.layers)
    if repeat_blocks is not None:
        order = _resolve_repeat_blocks(repeat_blocks, num // stack.len_default_block, stack.len_default_block)
    else:
        if not isinstance(layers_execute_order, (tuple, list)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num for i in layers_execute_order):
            raise ValueError(f"layers_execute_order must be a sequence of block indices in [0, {num}), got "
                             f"{layers_execute_order!r}")
        order = tuple(layers_execute_order)
    if cache is not None or return_cache:
        raise ValueError("repeat_blocks / layers_execute_order run without a KV cache (the cache holds one entry per "
                         "attention block)")
    if unpadded_plan is not None:
        raise ValueError("repeat_blocks / layers_execute_order run on the padded path: pass no unpadded_plan")
    if routing is not None and routing.integrators is not None:
        raise ValueError("integrate_layers mixes one input per block: not with repeat_blocks / layers_execute_order")
    return order


def _resolve_repeat_blocks(repeat_blocks, num_layers: int, len_layer: int) -> tuple[int, ...]:
    """x-transformers' ``resolve_repeat_blocks_to_layer_execute_order``: ``((start, end), repeats)`` specs (layers,
    ``end`` included) -> the blocks' indices."""
    if isinstance(repeat_blocks, (tuple, list)) and len(repeat_blocks) == 2 and isinstance(repeat_blocks[1], int) \
            and not isinstance(repeat_blocks[1], bool):
        repeat_blocks = (repeat_blocks,)
    spans: dict[int, tuple[int, int]] = {}
    for spec in repeat_blocks if isinstance(repeat_blocks, (tuple, list)) else ():
        ok = isinstance(spec, (tuple, list)) and len(spec) == 2
        span, repeats = spec if ok else (None, None)
        start, end = (span, span) if isinstance(span, int) else tuple(span) if isinstance(span, (tuple, list)) \
            and len(span) == 2 else (None, None)
        if not (ok and all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, repeats))
                and 0 <= start <= end < num_layers and repeats >= 1):
            raise ValueError(f"repeat_blocks must be ((start, end), repeats) specs with 0 <= start <= end < {num_layers} "
                             f"layers and repeats >= 1 (or a tuple of them), got {repeat_blocks!r}")
        spans[start] = (end, repeats)
    if not spans:
        raise ValueError(f"repeat_blocks must be ((start, end), repeats) or a tuple of them, got {repeat_blocks!r}")
    layers, cur = [], 0
    while cur < num_layers:
        if cur not in spans:
            layers.append(cur)
            cur += 1
            continue
        end, repeats = spans[cur]
        layers.extend(list(range(cur, end + 1)) * repeats)
        cur = end + 1
    return tuple(i for layer in layers for i in range(layer * len_layer, (layer + 1) * len_layer))

def _offset_positions(positions, offset, x, mask) -> Tensor:
    """x-transformers' ``seq_pos_offset``: the positions of ``x``'s tokens, real ones counted from ``offset``."""
    if positions is not None:
        raise ValueError("pass positions (pos) or seq_pos_offset, not both")
    if isinstance(offset, Tensor) and offset.numel() == 1 and not offset.is_floating_point():
        offset = int(offset)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"seq_pos_offset must be a non-negative integer, got {offset!r}")
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must have shape (b, n, dim), got {getattr(x, 'shape', type(x))}")
    if mask is not None:
        validate_mask(mask, "mask", shape=tuple(x.shape[:2]), device=x.device)
    return positions_from_mask(mask, x.shape[1], x.device) + offset


def _intermediates_kv(additional, add_mask, x: Tensor) -> tuple:
    """``self_attn_additional_kv`` given as another model's ``LayerIntermediates``: its cache's self-attention
    keys/values (as the cache holds them) and their padding combined with ``add_mask``; anything else unchanged."""
    if not isinstance(additional, LayerIntermediates):
        return additional, add_mask
    kv = additional.cache
    if not isinstance(kv, KVCache):
        raise TypeError("self_attn_additional_kv is a LayerIntermediates without a cache: pass the "
                        "intermediates of a return_intermediates / return_hiddens call")
    if kv.mask is not None:  # its padding: those slots are no keys
        if add_mask is not None:
            validate_mask(add_mask, "additional_kv_mask", shape=tuple(kv.mask.shape), device=x.device)
        add_mask = kv.mask if add_mask is None else kv.mask & add_mask
    return list(kv.self_kv), add_mask


def _extra_kv_kwargs(stack, additional, add_mask, detach: bool, to_top: bool, self_res, cross_res, x: Tensor, mask,
                     context, context_mask, cache, n_given) -> dict:
    """x-transformers' ``self_attn_additional_kv`` and ``*_kv_residuals`` checked and split per attention block:
    ``{id(block): Attention keywords}``. Residuals are selected to 0 at padded rows (of ``x``, or the context)
    here, once; the added keys' mask is applied by the attention itself."""
    per: dict = {}
    if additional is None and add_mask is None and self_res is None and cross_res is None:
        return per
    for name, flag in (("detach_additional_kv", detach), ("route_additional_kv_to_top", to_top)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    selfs = [blk for blk in stack.layers if blk.kind == "self"]
    crosses = [blk for blk in stack.layers if blk.kind == "cross"]
    b, n = x.shape[:2]
    keep = n if n_given is not None and n_given != n else None  # x-transformers' cache protocol kept the last n
    if additional is None:
        if add_mask is not None:
            raise ValueError("additional_kv_mask was given without self_attn_additional_kv")
    else:
        additional, add_mask = _intermediates_kv(additional, add_mask, x)
        if not isinstance(additional, (list, tuple)):
            raise TypeError(f"self_attn_additional_kv must be a list of (k, v) pairs (or None) per self-attention "
                            f"block, or a LayerIntermediates; got {type(additional).__name__}")
        if not selfs:
            raise ValueError("self_attn_additional_kv needs self-attention blocks (this stack has none)")
        additional = list(additional)
        if to_top:  # x-transformers: the last pairs go to the top blocks
            additional = [None] * (len(selfs) - len(additional)) + additional[max(0, len(additional) - len(selfs)):]
        else:
            additional = (additional + [None] * len(selfs))[: len(selfs)]
        for blk, pair in zip(selfs, additional):
            if pair is None:
                continue
            if detach and isinstance(pair, (tuple, list)):
                pair = tuple(t.detach() if isinstance(t, Tensor) else t for t in pair)
            per[id(blk)] = dict(additional_key_values=pair, additional_key_value_mask=add_mask)
    for name, res, blocks, rows in (("self_attn_kv_residuals", self_res, selfs, mask),
                                    ("cross_attn_kv_residuals", cross_res, crosses, context_mask)):
        if res is None:
            continue
        cross = name.startswith("cross")
        if not isinstance(res, Tensor) or not res.is_floating_point() or res.dim() not in (3, 4):
            raise ValueError(f"{name} must be a float tensor (b, n, c) or (layers, b, n, c), got "
                             f"{getattr(res, 'shape', type(res))}")
        if res.dim() == 3:  # x-transformers: a 3-d residual goes to the first block only
            res = res[None]
        if not blocks:
            raise ValueError(f"{name} needs {'cross' if cross else 'self'}-attention blocks (this stack has none)")
        if res.shape[0] > len(blocks):
            raise ValueError(f"{name} holds {res.shape[0]} residuals, the stack has {len(blocks)} such blocks")
        if (res.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type)) or res.device != x.device:
            raise ValueError(f"{name} is {res.dtype} on {res.device}, expected {x.dtype} on {x.device}")
        if cross:
            if cache is not None and cache.cross_kv is not None:
                raise ValueError("cross_attn_kv_residuals with a cached context: the cache holds the context's keys/"
                                 "values as the first call computed them (pass the residuals on that call)")
            if context is None:
                raise ValueError("cross_attn_kv_residuals are added to the context: pass context=... as well")
            if res.shape[-1] != stack.dim_context or res.shape[1] not in (1, b) or res.shape[2] not in (1, context.shape[1]):
                raise ValueError(f"{name} must have shape (layers, b|1, j|1, dim_context) with (b, j, dim_context) = "
                                 f"({b}, {context.shape[1]}, {stack.dim_context}), got {tuple(res.shape)}")
        else:
            if keep is not None and res.shape[2] == n_given:  # x-transformers' cache protocol: the new positions
                res = res[:, :, -keep:]
            if res.shape[-1] != stack.dim or res.shape[1] not in (1, b) or res.shape[2] not in (1, n):
                raise ValueError(f"{name} must have shape (layers, b|1, n|1, dim) with (b, n, dim) = ({b}, {n}, "
                                 f"{stack.dim}), got {tuple(res.shape)}")
        if rows is not None:  # padded rows hold nothing that reaches a key or value
            res = torch.where(rows[None, :, :, None], res, 0.0)
        for blk, r in zip(blocks, res):
            per.setdefault(id(blk), {})["kv_input_residual"] = r
    return per


def _last(t, keep: int):
    """The last ``keep`` positions of ``t (b|1, n, ...)`` (``None`` stays ``None``; ``(n,)`` positions too)."""
    if t is None or not isinstance(t, Tensor):
        return t
    return t[-keep:] if t.dim() == 1 else t[:, -keep:]


@dataclass
class _Mems:
    """Transformer-XL memories of one call, checked: one ``(b, m, c)`` per self-attention block, their masks
    (``(b, m)`` or ``None`` per block), ``m``, and the kernel masks of blocks whose memory mask is another tensor."""

    mems: list
    masks: list
    length: int
    kernel_masks: dict | None = None


def _check_mems(stack: StackModule, mems, mem_masks, x: Tensor, mask, cache, return_cache: bool, attn_mask, order,
                positions) -> _Mems | None:
    """The checked memories of ``forward(mems=..., mem_masks=...)`` (``None`` without memories)."""
    if mems is None:
        if mem_masks is not None:
            raise ValueError("mem_masks was given without mems")
        return None
    n_self = sum(blk.kind == "self" for blk in stack.layers)
    reason = mems_unsupported(stack)
    if reason is not None:
        raise ValueError(f"mems (Transformer-XL memories) cannot be combined with {reason}")
    if not isinstance(mems, (list, tuple)) or len(mems) != n_self:
        raise ValueError(f"mems must be a list of one (b, m, c) tensor per self-attention block ({n_self}), got "
                         f"{type(mems).__name__}{'' if not isinstance(mems, (list, tuple)) else f' of {len(mems)}'}")
    for what, bad in (("a KV cache (cache / return_cache)", cache is not None or return_cache),
                      ("attn_mask", attn_mask is not None), ("repeat_blocks / layers_execute_order", order is not None),
                      ("positions per head", isinstance(positions, Tensor) and positions.dim() == 3)):
        if bad:
            raise ValueError(f"mems (Transformer-XL memories) cannot be combined with {what}")
    b, _, c = x.shape
    m = None
    for t, mem in enumerate(mems):
        if not isinstance(mem, Tensor) or mem.dim() != 3 or mem.shape[0] != b or mem.shape[2] != c \
                or not mem.is_floating_point() or mem.device != x.device or (m is not None and mem.shape[1] != m):
            raise ValueError(f"mems[{t}] must be a floating-point (b, m, c) = ({b}, m, {c}) tensor on {x.device}, the "
                             f"same m for every block, got {getattr(mem, 'shape', type(mem))}")
        if _dtype_differs(mem, x):
            raise TypeError(f"mems[{t}] has dtype {mem.dtype}, expected {x.dtype} (the dtype of the model's hidden "
                            f"states); convert it with .to({x.dtype})")
        m = mem.shape[1]
    if mem_masks is None or isinstance(mem_masks, Tensor):
        masks = [mem_masks] * n_self
    elif isinstance(mem_masks, (list, tuple)) and len(mem_masks) == n_self:
        masks = list(mem_masks)
    else:
        raise ValueError(f"mem_masks must be None, one (b, m) bool tensor or a list of one per self-attention block "
                         f"({n_self}), got {type(mem_masks).__name__}")
    for t, mm in enumerate(masks):
        if mm is not None:
            validate_mask(mm, f"mem_masks[{t}]", shape=(b, m), device=x.device)
    if any(mm is None for mm in masks) and not all(mm is None for mm in masks):
        ones = torch.ones(b, m, dtype=torch.bool, device=x.device)
        masks = [ones if mm is None else mm for mm in masks]
    return _Mems(list(mems), masks, m)


def mems_unsupported(stack: StackModule) -> str | None:
    """The stack option that Transformer-XL memories do not run with (``None``: they run)."""
    for what, bad in (("residual routing (hyper-connections, residual streams)", stack.routing is not None),
                      ("shift_tokens", any(blk.shifts for blk in stack.layers)),
                      ("add_value_residual", stack.add_value_residual),
                      ("rotary_xpos", stack.rotary is not None and stack.rotary.use_xpos),
                      ("polar_pos_emb", getattr(stack, "polar_pos_emb", None) is not None),
                      ("attn_hybrid_module", any(getattr(blk.mixer, "hybrid", None) is not None
                                                 for blk in stack.layers if blk.kind == "self")),
                      ("attn_orthog_projected_values (a projection over the whole sequence)",
                       any(getattr(blk.mixer, "orthog", False) for blk in stack.layers if blk.kind == "self")),
                      ("attn_data_dependent_alibi (forget gates summed over the whole sequence)",
                       any(getattr(blk.mixer, "to_forget_gates", None) is not None
                           for blk in stack.layers if blk.kind == "self")),
                      ("attn_max_attend_past", any(getattr(blk.mixer, "max_attend_past", None) is not None
                                                   for blk in stack.layers if blk.kind != "ff")),
                      ("attn_selective (each query gated by the queries before it)",
                       any(getattr(blk.mixer, "selective", False) for blk in stack.layers if blk.kind == "self"))):
        if bad:
            return what
    return None


def _mem_kv(stack: StackModule, mem: _Mems, block: Block, t: int, cond, sa: SelfAttentionInputs):
    """Block ``t``'s memory keys and values ``(b, h_kv, m, d)``: its normed memory projected (masked slots selected
    to 0 first, so whatever they hold reaches nothing), the keys rotated at positions ``-m .. -1``."""
    src, keep = mem.mems[t], mem.masks[t]
    if keep is not None:
        src = torch.where(keep[..., None], src, 0.0)
    k, v = block.mixer.project_kv(apply_norm(block.norm, src, cond))
    if sa.rotary is not None and mem.length:
        pos = _mem_positions(keep, mem.length, src.device)  # (b|1, m)
        k = block.mixer._rotate(k, stack.rotary.angles(pos, dtype=src.dtype))
    return k, v


def _mem_positions(keep: Tensor | None, m: int, device) -> Tensor:
    """Positions of ``m`` memory slots before the segment: ``-m .. -1`` (x-transformers'); with padding ``keep (b, m)``
    the real slots are counted (the last real one at -1), as in the sample without its padding."""
    if keep is None:
        return torch.arange(-m, 0, device=device)[None]  # (1, m)
    count = keep.long().cumsum(1)  # (b, m)
    return count - count[:, -1:] - 1


def _mem_args(mem: _Mems, t: int, args: dict) -> dict:
    """The self-attention keywords of block ``t``: its own kernel mask when its memory mask is another tensor."""
    km = mem.kernel_masks.get(id(mem.masks[t])) if mem.kernel_masks else None
    if km is None:
        return args
    return dict(args, mask=SelectedMask(km) if isinstance(args.get("mask"), SelectedMask) else km)


def _check_causal_override(stack: StackModule, causal, cache, return_cache: bool) -> bool:
    """The causality of this call: the stack's, or ``causal`` (x-transformers' ``forward(causal=...)``)."""
    if causal is None or causal == stack.causal:
        if causal is not None and not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool or None, got {causal!r}")
        return stack.causal
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool or None, got {causal!r}")
    if cache is not None or return_cache:
        raise ValueError(f"causal={causal} overrides a stack built with causal={stack.causal}: not with a KV cache "
                         "(the cached positions were computed with the stack's own causality)")
    if any(blk.kind == "self" and getattr(blk.mixer, "to_forget_gates", None) is not None for blk in stack.layers):
        raise ValueError(f"causal={causal} cannot override the causality of attn_data_dependent_alibi (its forget "
                         "gates are built for one direction or two)")
    return causal


def _check_ff_deep_embeds(stack: StackModule, deep, x: Tensor, mask) -> Tensor | None:
    """``ff_deep_embeds`` checked: ``(b, n, L, c)`` floating point on ``x``'s device; padded rows read as 1."""
    if deep is None:
        return None
    b, n = x.shape[:2]
    num_ff = stack.layer_kinds.count("ff")
    if not isinstance(deep, Tensor) or not deep.is_floating_point() or tuple(deep.shape) != (b, n, num_ff, stack.dim):
        raise ValueError(f"ff_deep_embeds must be a float tensor of shape (b, n, feed-forward blocks, dim) = "
                         f"({b}, {n}, {num_ff}, {stack.dim}), got {getattr(deep, 'shape', type(deep))}")
    if deep.device != x.device:
        raise ValueError(f"ff_deep_embeds is on {deep.device}, expected {x.device}")
    return deep if mask is None else torch.where(mask[:, :, None, None], deep, 1.0)


def _new_cache(cache, mask, b: int, n: int, device, self_kv, cross_kv, sa, ca, cond, condition,
               condition_mask, hybrid_states=None) -> KVCache:
    """The cache after a forward: the old one's positions and conditions, the new keys/values."""
    count = torch.full((b,), n, device=device, dtype=torch.long) if mask is None else mask.sum(1)
    if cache is not None:
        count = cache.count + count
    return KVCache(
        self_kv=self_kv, cross_kv=cross_kv if ca.used else None, mask=sa.key_pad,
        context_mask=ca.context_mask if ca.used else None, count=count, positions=sa.all_positions,
        context=ca.user_context if ca.used else None,
        condition=cond, condition_input=condition if cache is None else cache.condition_input,
        condition_mask=condition_mask if cache is None else cache.condition_mask,
        hybrid=hybrid_states or None,
    )


def _hybrid_call(mixer, mask, cache, index: int):
    """The ``HybridCall`` of a self-attention with ``attn_hybrid_module`` (``None`` without one): the padding of
    the new positions and the recurrent state the cache holds for it."""
    if getattr(mixer, "hybrid", None) is None:
        return None
    state = None
    if cache is not None and cache.length > 0:
        states = cache.hybrid
        if states is None or index >= len(states) or states[index] is None:
            raise ValueError("this cache holds no state of the hybrid module (attn_hybrid_module): it must come from "
                             "this stack's own forward")
        state = states[index]
    return HybridCall(real=mask, state=state)


def check_inputs(stack: StackModule, x, mask, context, context_mask, cache) -> None:
    """The stack's door: shapes, dtypes, devices and masks of everything ``forward`` takes (S9), once."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != stack.dim:
        raise ValueError(f"x must have shape (b, n, dim={stack.dim}), got {getattr(x, 'shape', type(x))}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if len(stack.layers):
        check_weight_dtype(x, stack.layers[0]._parts[1])  # the first block's mixer: the first matmul x meets
    b, n = x.shape[:2]
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n), device=x.device)
    if cache is not None:
        KVCache.check(cache, x, stack.executed_kinds.count("self"), stack.executed_kinds.count("cross"))
        if context is not None and cache.cross_kv is None and stack.has_cross:
            raise ValueError(
                "context was passed with a cache built without one: the cached positions never saw it. "
                "Pass the context on the first call (the one that builds the cache)"
            )
        if context is not None and cache.cross_kv is not None:
            same = context is cache.context and (context_mask is cache.context_mask or (
                context_mask is None and cache.context_mask is None))
            if not same:
                raise ValueError(
                    "context was passed with a cache that already holds a context's keys/values: the cache "
                    "answers for the context (and context_mask) of the call that built it. Pass context only "
                    "on that first call (or the very same context and context_mask tensors again); to change "
                    "the condition, start without a cache"
                )
    if context is None:
        if context_mask is not None:
            raise ValueError("context_mask was given without a context; pass context=... as well")
        if stack.only_cross and (cache is None or cache.cross_kv is None):
            raise ValueError("a CrossAttender (only_cross=True) needs a context")
        return
    if not stack.has_cross:
        raise ValueError("context was given but this stack has no cross-attention; build it with cross_attend=True")
    if not isinstance(context, Tensor) or context.dim() != 3:
        raise ValueError(f"context must be a tensor of shape (b, j, dim_context), got {getattr(context, 'shape', type(context))}")
    if context.shape[0] != b or context.shape[-1] != stack.dim_context:
        raise ValueError(
            f"context must have shape (b={b}, j, dim_context={stack.dim_context}), got {tuple(context.shape)}"
        )
    if context.device != x.device:
        raise ValueError(f"context is on {context.device}, expected {x.device}")
    if _dtype_differs(context, x):
        raise TypeError(f"context has dtype {context.dtype}, expected {x.dtype} (the dtype of the model's hidden "
                        f"states); convert it with context.to({x.dtype})")
    if context_mask is not None:
        validate_mask(context_mask, "context_mask", shape=(b, context.shape[1]), device=x.device)


@dataclass(frozen=True)
class SelfAttentionInputs:
    """What every self-attention block of one forward shares, built once: the combined mask (a
    ``PreparedMask`` when it varies per query), whether the kernel applies causal itself, rotary angles,
    the ALiBi bias, the key padding ``(b, p + n)`` and the positions (new, and cached + new)."""

    mask: object
    causal: bool
    rotary: tuple[Tensor, Tensor] | None
    bias: Tensor | None
    key_pad: Tensor | None
    positions: Tensor
    all_positions: Tensor


def self_attention_inputs(stack: StackModule, x: Tensor, mask, cache, attn_mask, positions,
                          causal: bool | None = None, mem_len: int = 0, mem_mask: Tensor | None = None
                          ) -> SelfAttentionInputs:
    b, n = x.shape[:2]
    device = x.device
    past = cache.length if cache is not None else mem_len  # earlier keys: the cache's, or Transformer-XL memories
    # self-attention mask: built once here, passed to every block
    key_pad = None
    if mask is not None or (cache is not None and cache.mask is not None) or mem_mask is not None:
        old = cache.mask if cache is not None and cache.mask is not None else mem_mask if mem_mask is not None \
            else torch.ones(b, past, dtype=torch.bool, device=device)
        new = mask if mask is not None else torch.ones(b, n, dtype=torch.bool, device=device)
        key_pad = torch.cat((old, new), dim=1)  # (b, p + n)
    self_mask = None if key_pad is None else key_pad[:, None, None, :]  # (b, 1, 1, p + n)
    if attn_mask is not None:
        validate_mask(attn_mask, "attn_mask", device=device)
        heads = next((blk.mixer.heads for blk in stack.layers if blk.kind == "self"), 1)
        four_d = attn_mask.dim() == 4 and attn_mask.shape[0] in (1, b) and attn_mask.shape[1] in (1, heads) \
            and tuple(attn_mask.shape[2:]) == (n, past + n)  # x-transformers' (b|1, h|1, n, p + n)
        if attn_mask.shape not in ((b, n, past + n), (n, past + n)) and not four_d:
            raise ValueError(f"attn_mask must have shape (b, n, p + n) = ({b}, {n}, {past + n}), (n, p + n) or "
                             f"(b|1, h|1, n, p + n) with h={heads}, got {tuple(attn_mask.shape)}")
        extra = attn_mask if four_d else attn_mask[:, None] if attn_mask.dim() == 3 else attn_mask[None, None]
        self_mask = extra if self_mask is None else self_mask & extra
    causal = stack.causal if causal is None else causal
    if causal and self_mask is not None and n > 1:
        self_mask = self_mask & causal_mask(n, past + n, device=device)  # (b, 1, n, p + n)
        causal = False
    elif causal and past > 0 and n > 1:
        self_mask = causal_mask(n, past + n, device=device)  # (1, 1, n, p + n)
        causal = False

    given = positions is not None
    if positions is None:
        positions = positions_from_mask(mask, n, device, offset=None if cache is None else cache.count)
    elif isinstance(positions, Tensor) and positions.dim() == 3:  # x-transformers' custom ALiBi positions per head
        heads = stack.alibi_slopes.shape[0] if stack.alibi_slopes is not None else None
        if heads is None or stack.rotary is not None:
            raise ValueError("positions per head (b, h, n) are ALiBi's (x-transformers' custom ALiBi positions): they "
                             "need alibi_pos_bias=True and no rotary_pos_emb")
        if positions.shape[0] not in (1, b) or positions.shape[1] not in (1, heads) or positions.shape[2] != n:
            raise ValueError(f"positions per head must have shape (b|1, h|1, n) = ({b}, {heads}, {n}), got "
                             f"{tuple(positions.shape)}")
        positions = _check_positions(positions.flatten(0, 1), positions.shape[0] * positions.shape[1], n,
                                     device).reshape(positions.shape)
    else:
        positions = _check_positions(positions, b, n, device)
    rotary = None
    if stack.rotary is not None:
        angles = stack.rotary.angles(positions, dtype=x.dtype)  # (b|1, 1, n, d_rot), float32 or wider
        rotary = (angles, angles)
        if stack.rotary.use_xpos:  # xpos: queries times the scale, keys times its inverse (the stack's pair form)
            _check_xpos_span(stack, positions, given, n, x.dtype)
            scale = stack.rotary.xpos_scale(positions, dtype=x.dtype)  # (b|1, 1, n, d_rot)
            rotary = ((angles, scale), (angles, scale ** -1.0))
    elif stack.polar_pos_emb is not None:  # PoPE: the (query, key) forms apply_rotary takes
        rotary = stack.polar_pos_emb.pair(positions, x.dtype)
    bias = None
    all_positions = positions if cache is None else torch.cat(_broadcast_batch(cache.positions, positions), dim=1)
    if cache is None and mem_len:  # x-transformers' memory positions: -m .. -1 before the segment's own
        mem_pos = _mem_positions(mem_mask, mem_len, device).to(positions.dtype)  # (b|1, m)
        all_positions = torch.cat(_broadcast_batch(mem_pos, positions), dim=1)
    if stack.alibi_slopes is not None:
        bias = alibi_bias(stack.alibi_slopes, positions, all_positions).to(x.dtype)  # (b|1, h, n, p + n)
    elif stack.rel_pos is not None:
        bias = stack.rel_pos.bias(positions, all_positions).to(x.dtype)  # (b|1, h, n, p + n)
    if self_mask is not None and self_mask.shape[2] > 1 and bias is None:
        # a mask that varies per query (padding + causal): prepared once, one kernel mask for all layers
        self_mask = prepare_mask(self_mask, dtype=x.dtype)
    return SelfAttentionInputs(self_mask, causal, rotary, bias, key_pad, positions, all_positions)


@dataclass(frozen=True)
class CrossAttentionInputs:
    """The context every cross-attention block of one forward shares: the context (masked rows selected
    to 0) or the cache's, its mask ``(b, j)`` and kernel mask ``(b, 1, 1, j)``, whether cross-attention
    runs at all (``used``) and whether the cache holds its keys/values (``cached``); ``user_context``
    is what the cache keeps a reference to."""

    context: Tensor | None
    context_mask: Tensor | None
    mask: Tensor | None
    used: bool
    cached: bool
    user_context: Tensor | None


def cross_attention_inputs(stack: StackModule, context, context_mask, cache, b: int) -> CrossAttentionInputs:
    # cross-attention: context padded positions are selected away before any projection
    use_cross = stack.has_cross and (context is not None or (cache is not None and cache.cross_kv is not None))
    cached_cross = cache is not None and cache.cross_kv is not None
    user_context = context  # the cache keeps a reference to what the user passed (not a copy)
    if cached_cross:  # the cache answers for the context (checked: the same tensors, or none passed)
        context, context_mask = cache.context, cache.context_mask
        user_context = context
    cross_mask = None
    if cached_cross:
        cross_mask = None if context_mask is None else context_mask[:, None, None, :]
    elif context is not None:
        if stack.training and stack.cross_attn_tokens_dropout > 0 and context.shape[1] > 0:
            # each context token dropped per sample; a sample may lose them all (a dead row, safe)
            keep = torch.rand(b, context.shape[1], device=context.device) >= stack.cross_attn_tokens_dropout
            context_mask = keep if context_mask is None else context_mask & keep
        if context_mask is not None:
            context = torch.where(context_mask[..., None], context, 0.0)
            cross_mask = context_mask[:, None, None, :]  # (b, 1, 1, j)
    return CrossAttentionInputs(context, context_mask, cross_mask, use_cross, cached_cross, user_context)


def _cross_rotary(stack, context_pos, context, cache, return_cache, unpadded_plan, rotary, x):
    """``(q_angles, k_angles)`` for cross-attention with ``context_pos`` (the checks of that keyword)."""
    if not stack.has_cross or context is None:
        raise ValueError("context_pos gives the context's positions: it needs cross-attention and a context")
    if stack.rotary is None:
        raise ValueError("context_pos rotates cross-attention keys: it needs rotary_pos_emb=True")
    if cache is not None or return_cache:
        raise ValueError("context_pos does not run with a KV cache (the cache keeps the context's keys as "
                         "they were built)")
    if unpadded_plan is not None:
        raise ValueError("context_pos runs on the padded path: pass no unpadded_plan")
    cpos = _check_positions(context_pos, context.shape[0], context.shape[1], x.device)
    return rotary[0], stack.rotary.angles(cpos, dtype=x.dtype)


def _check_xpos_span(stack, positions: Tensor, given: bool, n: int, dtype) -> None:
    """Refuse positions whose xpos scales ``s ** (+-span / scale_base)`` would leave the dtype's range (sqrt of
    its largest value, leaving room for the features they multiply). One host read for positions given."""
    import math

    span = n if not given else int((positions.amax() - positions.amin()).item()) + 1
    if span * math.log(3.5) / stack.rotary.scale_base > 0.5 * math.log(torch.finfo(dtype).max):
        raise ValueError(f"rotary_xpos over {span} positions would scale queries/keys by 3.5 ** (+-{span} / "
                         f"rotary_xpos_scale_base={stack.rotary.scale_base:g}), beyond what {dtype} holds; use a "
                         f"larger rotary_xpos_scale_base, a wider dtype or shorter sequences")


def _check_positions(positions, b: int, n: int, device) -> Tensor:
    """``positions`` as ``(b|1, n)``: accepts ``(b, n)``, ``(1, n)`` and ``(n,)`` (shared by every sample)."""
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions must be a tensor of integer positions, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex() or positions.is_floating_point():
        raise TypeError(f"positions must hold integer positions, got dtype {positions.dtype}")
    if positions.dim() == 1 and positions.shape[0] == n:
        positions = positions[None]
    if positions.dim() != 2 or positions.shape[1] != n or positions.shape[0] not in (1, b):
        raise ValueError(f"positions must have shape (b, n) = ({b}, {n}), (1, n) or (n,), got {tuple(positions.shape)}")
    if positions.device != torch.device(device) and not (positions.device.type == torch.device(device).type):
        raise ValueError(f"positions is on {positions.device}, expected {device}")
    return positions


def _broadcast_batch(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if a.shape[0] == b.shape[0]:
        return a, b
    size = max(a.shape[0], b.shape[0])
    return a.expand(size, -1), b.expand(size, -1)
