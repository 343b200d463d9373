"""``_Wrapper._run`` in phases: the rows a wrapper hands its stack, and the stack's call.

Shape legend: b batch, n tokens (this call's new positions), m prefix rows, F fixed rows (memory, then class
tokens), c model width, e embedding width, C the absolute embedding's width, L feed-forward blocks.

``_Wrapper._run`` (both wrappers, and the research wrappers built on them) runs:

- ``place_rows``: the cache and ``pos`` checked, the prefix (``prepend_embeds``) placed before the tokens, the
  positions (real rows counted, continuing from the cache), the absolute embedding, the embedding dropout and
  projection, then the memory and class rows before everything (on the call that starts the sequence);
- ``stack_runner``: the stack's keywords for this call (causality, deep embeddings, added keys/values), the
  unpadded plan (decided once) and the stack as a function of its input and cache, which ``_run`` calls once or
  hands to the looped run (``_Wrapper._loop``);
- ``finish_run``: the rows before the tokens remembered by the new cache(s), the memory and class rows' outputs
  cut from the stream (and put on the intermediates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.cache import KVCache
from ..core.conditions import Conditions, check_condition_tensor
from ..core.masks import validate_mask

# the ``_Wrapper`` these phases serve (typed as a module: the class imports this file)
WrapperModule = nn.Module


class _ScaleGradient(torch.autograd.Function):
    """Identity in the forward (the same values, bit for bit); the backward multiplies the incoming gradient by
    ``frac``. x-transformers writes it ``x * frac + x.detach() * (1 - frac)``: the same gradient, and values equal
    up to rounding."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, frac: float) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.frac = inputs[1]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.frac, None


def embedding_gradient(net: WrapperModule, x: Tensor) -> Tensor:
    """x-transformers' ``emb_frac_gradient``: ``x`` (the summed, normalised embeddings and the prefix rows) unchanged,
    the gradient flowing back into them scaled by ``net.emb_frac_gradient`` (1: untouched)."""
    frac = getattr(net, "emb_frac_gradient", 1.0)
    if frac == 1.0 or not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return _ScaleGradient.apply(x, frac)


def embed_rows(net: WrapperModule, x: Tensor, m: int) -> Tensor:
    """x-transformers' order after the absolute positions: ``post_emb_norm`` on the tokens' rows (after the ``m``
    prefix rows), ``emb_frac_gradient`` on every row, the embedding dropout, then the projection to the model width
    (``emb_dim``)."""
    norm = getattr(net, "post_emb_norm", None)
    if norm is not None:  # x-transformers' post_emb_norm: the tokens' summed embeddings, before the prefix rows
        x = norm(x) if not m else torch.cat((x[:, :m], norm(x[:, m:])), dim=1)
    x = net.emb_dropout(embedding_gradient(net, x))
    if getattr(net, "project_emb", None) is not None:
        x = net.project_emb(x)  # (b, m + n, c)
    return x


@dataclass(frozen=True)
class RunRows:
    """The rows of one ``_run`` call, as the stack gets them.

    Attributes:
        x: ``(b, F + m + n, c)`` the fixed rows, the prefix and the tokens (positions added, dropout and the
            embedding projection applied).
        mask: ``(b, F + m + n)`` bool (True = real) or ``None`` (every row real).
        positions: the rows' positions for rotary / ALiBi, ``(b|1, F + m + n)`` (or the checked ``pos``).
        lead: ``(b,)`` or ``(1,)`` the real rows before the tokens, per sample (the cache remembers them).
        lead_slots: ``F + m``, the rows before the tokens.
        m: the prefix rows.
        fixed: ``F``, the memory and class rows of this call (0 with a cache).
        b, n: the batch and the tokens of this call.
    """

    x: Tensor
    mask: Tensor | None
    positions: Tensor
    lead: Tensor
    lead_slots: int
    m: int
    fixed: int
    b: int
    n: int


def _check_cache_and_pos(net: WrapperModule, x: Tensor, conds: Conditions, cache, pos):
    """The cache (it is input: checked before the wrapper reads its rows) and x-transformers' ``pos``, checked;
    returns ``pos`` as ``(b|1, n)`` or ``None``."""
    b, n = x.shape[:2]
    if cache is not None:  # the cache is input: checked before the wrapper reads its rows (lead, positions)
        kinds = getattr(net.attn_layers, "executed_kinds", net.attn_layers.layer_kinds)  # blocks run, repeats too
        KVCache.check(cache, x, kinds.count("self"), kinds.count("cross"))
    if pos is not None:
        if conds.prepend_embeds is not None or (cache is None and net.num_fixed_tokens):
            raise ValueError("pos (custom positions) cannot be combined with prepend_embeds, memory tokens or "
                             "class tokens: it gives positions to the tokens only")
        pos = net._check_pos(pos, b, n, x.device)
    return pos


def _with_prefix(net: WrapperModule, x: Tensor, mask: Tensor | None, conds: Conditions, attn_mask, cache):
    """``(x, mask, m)``: the prefix ``prepend_embeds (b, m, c)`` checked and placed before the tokens (its mask
    before theirs); ``m`` is 0 without one."""
    b, n = x.shape[:2]
    prepend_embeds, prepend_mask = conds.prepend_embeds, conds.prepend_mask
    if prepend_mask is not None and prepend_embeds is None:
        raise ValueError("prepend_mask was given without prepend_embeds; pass prepend_embeds=... as well")
    if prepend_embeds is None:
        return x, mask, 0
    if cache is not None:
        raise ValueError("prepend_embeds with a cache: the prefix belongs to the first call, the one that "
                         "builds the cache (the cache keeps it)")
    if attn_mask is not None:
        raise ValueError("prepend_embeds and attn_mask cannot be combined (attn_mask covers the tokens only)")
    dim = net.attn_layers.dim
    if getattr(net, "project_emb", None) is not None:
        raise ValueError(f"prepend_embeds with emb_dim={net.emb_dim} != dim={dim} is not supported (x-transformers "
                         f"projects a prefix of width emb_dim; safeformer's conditions take the model width)")
    check_condition_tensor(prepend_embeds, "prepend_embeds", (b, None, dim), x.device,
                           shape_text=f"(b={b}, m, dim={dim})")
    m = prepend_embeds.shape[1]
    if prepend_mask is not None:
        validate_mask(prepend_mask, "prepend_mask", shape=(b, m), device=x.device)
    if mask is not None or prepend_mask is not None:
        ones = lambda k: torch.ones(b, k, dtype=torch.bool, device=x.device)  # noqa: E731
        mask = torch.cat((ones(m) if prepend_mask is None else prepend_mask, ones(n) if mask is None else mask), 1)
    x = torch.cat((prepend_embeds.to(x.dtype), x), dim=1)  # (b, m + n, c): masked rows selected away below
    return x, mask, m


def place_rows(net: WrapperModule, x: Tensor, mask: Tensor | None, conds: Conditions, attn_mask, cache,
               pos) -> RunRows:
    """The rows the stack runs on: ``x (b, n, e)`` (the tokens' embeddings) with the prefix, the positions, the
    absolute embedding, the dropout and the projection, then the memory and class rows (see ``RunRows``)."""
    b, n = x.shape[:2]
    pos = _check_cache_and_pos(net, x, conds, cache, pos)
    x, mask, m = _with_prefix(net, x, mask, conds, attn_mask, cache)
    fixed = net.num_fixed_tokens if cache is None else 0  # memory and class tokens: the first call only
    if fixed:
        if attn_mask is not None:
            raise ValueError("attn_mask cannot be combined with memory or class tokens (it covers the tokens only)")
        if mask is not None:
            mask = torch.cat((torch.ones(b, fixed, dtype=torch.bool, device=x.device), mask), dim=1)
    lead_slots = fixed + m  # memory, class and prefix rows: before the tokens, no absolute position
    positions = net._positions(mask, b, lead_slots + n, x.device, cache, lead_slots)
    if cache is None:  # the real rows before the tokens, per sample: the tokens' positions start after them
        lead = positions.new_full((b,), lead_slots) if mask is None else mask[:, :lead_slots].sum(1)
    else:
        lead = cache.lead if cache.lead is not None else positions.new_zeros(b)
    if pos is not None:
        positions = pos
    if net.pos_emb is not None:  # tokens only, numbered from 0 (x-transformers' convention)
        abs_pos = positions if pos is not None else (positions - lead[:, None]).clamp(min=0)
        pe = net.pos_emb.embed_positions(abs_pos).to(x.dtype)  # (b|1, F + m + n, C)
        x = x + pe[:, lead_slots:] if not m else torch.cat((x[:, :m], x[:, m:] + pe[:, lead_slots:]), dim=1)
    # x-transformers' order: the norm, the gradient fraction, dropout and the embedding projection (emb_dim) on
    # the prefix and tokens, then the memory and class rows (model width) before them (dropped out too in its
    # ContinuousTransformerWrapper)
    x = embed_rows(net, x, m)
    if fixed:
        rows = [t for t in (getattr(net, "memory_tokens", None), getattr(net, "cls_token", None)) if t is not None]
        rows = torch.cat(rows).to(x.dtype)[None].expand(b, -1, -1)  # (b, F, c)
        x = torch.cat((net.emb_dropout(rows) if net.dropout_fixed_rows else rows, x), dim=1)  # (b, F + m + n, c)
    return RunRows(x=x, mask=mask, positions=positions, lead=lead, lead_slots=lead_slots, m=m, fixed=fixed, b=b, n=n)


def stack_runner(net: WrapperModule, rows: RunRows, conds: Conditions, attn_mask, cache, return_cache: bool, *,
                 return_hiddens: bool, causal, ff_deep, extra_kv):
    """``(stack, plan)``: ``stack(inp, cache, return_cache) -> (h, new cache or None, intermediates or None)``, the
    stack on the rows' mask and positions with this call's keywords, and the unpadded plan it runs (``None`` for
    the padded path, which the deep embeddings, an overridden causality and added keys/values take)."""
    b, lead_slots = rows.b, rows.lead_slots
    stack_kw = {}
    if causal is not None:
        stack_kw["causal"] = causal
    if ff_deep is not None:
        if lead_slots:  # memory, class and prefix rows have no token: their multipliers are 1
            ff_deep = torch.cat((ff_deep.new_ones(b, lead_slots, *ff_deep.shape[2:]), ff_deep), dim=1)
        stack_kw["ff_deep_embeds"] = ff_deep
    # the unpadded path decided once (one host sync): the stack runs it, the output head reuses it
    if extra_kv:  # x-transformers' self_attn_additional_kv & co. (the stack checks them; padded path)
        stack_kw.update(extra_kv)
    padded_only = ff_deep is not None or (causal is not None and causal != net.attn_layers.causal) or bool(extra_kv)
    mask, positions = rows.mask, rows.positions
    plan = None if padded_only else net.attn_layers.plan_unpadded(
        mask, cache=cache, return_cache=return_cache, attn_mask=attn_mask, return_hiddens=return_hiddens)

    def stack(inp: Tensor, c, rc: bool):
        out = net.attn_layers(
            inp, mask=mask, attn_mask=attn_mask, positions=positions, cache=c, **conds.stack_kwargs(),
            return_cache=rc, return_hiddens=return_hiddens, unpadded_plan=plan, **stack_kw,
        )
        out = out if isinstance(out, tuple) else (out,)
        return out[0], out[1] if rc else None, out[-1] if return_hiddens else None

    return stack, plan


def finish_run(net: WrapperModule, rows: RunRows, cache, h: Tensor, new_cache, intermediates, plan) -> tuple:
    """``_run``'s return value: the new cache(s) remember the rows before the tokens; the memory and class rows'
    outputs are cut from ``h`` and its mask (the memory tokens' go on the intermediates)."""
    b, fixed, lead, mask = rows.b, rows.fixed, rows.lead, rows.mask
    for c in (new_cache, None if intermediates is None else intermediates.cache):
        if c is not None:  # the cache remembers the rows before the tokens
            c.lead = lead if lead.dim() == 1 else lead.expand(b)
            c.lead_slots = rows.lead_slots if cache is None else cache.lead_slots
    fixed_out = None
    if fixed:
        fixed_out, h = h[:, :fixed], h[:, fixed:]
        mask = None if mask is None else mask[:, fixed:]
        if intermediates is not None and net.num_memory_tokens:
            intermediates.memory_tokens = fixed_out[:, :net.num_memory_tokens]
    return h, new_cache, mask, rows.m, fixed_out, intermediates, plan
