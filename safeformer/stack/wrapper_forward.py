"""One forward of a ``TransformerWrapper``, in phases, and the checks and inputs it builds.

Shape legend: b batch, n positions, m prefix rows, j context length, c model width, e embedding width,
v vocabulary size, L feed-forward blocks.

``TransformerWrapper.forward`` gathers its keywords into one ``WrapperCall`` and runs the phases on it:

- ``resolve_call``: the door: token ids, masks, the cache protocol, the conditions and every flag checked;
- ``embed_call``: the token embeddings with the further and summed embeddings, the deep embeddings' rows and the
  stack's extra keyword inputs (added keys/values, Transformer-XL memories);
- ``run_call``: the stack (once, recycled or looped; memory, class and prefix rows are placed by ``_Wrapper._run``)
  and what the intermediates gather from it (looped outputs, attention pooling, z-loss, initial embeddings);
- ``head_call``: the output (pooled, class rows or per position) and the head's logits;
- ``finish_call``: ``forward``'s return value (the next-embedding prediction, memories, cache, intermediates).

``ContinuousTransformerWrapper.forward`` runs ``continuous_mask`` (the door: ``x``, the mask, ``lens``,
``seq_start_pos``, ``sum_embeds``), ``continuous_new_rows`` (the cache protocol, the finite check, padded rows
zeroed), the stack (``_Wrapper._run``) and ``continuous_output``.

The module also holds the helpers a wrapper's forward shares (token ids, conditions, start masks, memories,
added keys/values, logit entropies and the attention z-loss); ``wrappers.py`` re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from ..core.cache import KVCache, LayerIntermediates, check_weight_dtype, resolve_cache
from ..core.conditions import Conditions, condition_kwargs
from ..core.losses import masked_mean
from ..core.masks import check_finite as _check_finite
from ..core.masks import check_lengths, check_token_ids, validate_mask
from .layers import _last, mems_unsupported
from .stack_forward import check_transform_block_inputs, transform_block_input
from .wrapper_options import _flag

# the ``TransformerWrapper`` these phases serve (typed as a module: the class imports this file)
WrapperModule = nn.Module



def _conditions(context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask, conditions: dict) -> Conditions:
    """The named condition keywords and the further kinds (``**conditions``) as one ``Conditions``; named
    explicitly, not read from ``locals()``, so ``torch.compile(fullgraph=True)`` traces a forward (a frame
    whose closures hold cells not yet assigned cannot be read whole)."""
    return Conditions.from_kwargs(dict(context=context, context_mask=context_mask, prepend_embeds=prepend_embeds,
                                       prepend_mask=prepend_mask, condition=condition, condition_mask=condition_mask,
                                       **conditions))


_check_tokens = check_token_ids


def _token_ids(x, name: str):
    """``x`` as integer token ids: x-transformers reads a float tensor of ids with ``.long()``; safeformer
    takes one whose every value is a whole number (the same ids) and refuses any other (x-transformers would
    truncate 1.7 to 1 silently)."""
    if isinstance(x, Tensor) and x.dim() == 2 and x.dtype.is_floating_point:
        if x.numel() and not bool((torch.isfinite(x) & (x == x.round())).all()):
            raise TypeError(f"{name} must hold integer token ids; a float tensor is read only when every value is a "
                            f"whole number (convert with {name}.long() after rounding as you mean it)")
        x = x.long()
    _check_tokens(x, name)
    if x.dtype not in (torch.int64, torch.int32):  # uint8 / int8 / int16 ids: the same ids as the embedding reads them
        x = x.long()
    return x


def intersperse_layout(mask: Tensor | None, b: int, n: int, every: int, M: int, device):
    """Where x-transformers' interspersed memory tokens go: ``M`` memory rows before each segment of ``every`` real
    tokens, counted per sample. Returns ``(slot (b, n): each token's row in the interleaved sequence, start (b, n):
    tokens that open a segment, blocks (b, n): memory blocks at or before each token, N: the interleaved length,
    rows (b, N): which interleaved rows are real)``."""
    real = torch.ones(b, n, dtype=torch.bool, device=device) if mask is None else mask
    rank = real.long().cumsum(dim=1) - 1
    start = real & (rank % every == 0)
    blocks = start.long().cumsum(dim=1)
    slot = torch.arange(n, device=device) + M * blocks  # a row inserted before each segment's first token
    N = n + M * (-(-n // every))
    rows = torch.zeros(b, N + 1, dtype=torch.bool, device=device).scatter(1, slot, real)
    first = torch.where(start[..., None], slot[..., None] - M + torch.arange(M, device=device), N)  # (b, n, M)
    rows = rows.scatter(1, first.reshape(b, n * M), start[..., None].expand(-1, -1, M).reshape(b, n * M))
    return slot, start, blocks, N, rows[:, :N]


def _cached_slots(cache, n: int, cache_age: int) -> int:
    """How many token slots before ``x``'s first position the cache holds (0 without one, or when ``x``
    holds the whole sequence)."""
    if cache is None:
        return 0
    kv = cache.cache if isinstance(cache, LayerIntermediates) else cache
    if not isinstance(kv, KVCache):
        return 0
    cached = kv.length - kv.lead_slots
    return cached if not isinstance(cache, LayerIntermediates) or n == cache_age else 0


def _start_mask(seq_start_pos, mask: Tensor | None, b: int, n: int, device, offset: int = 0,
                incremental: bool = False) -> Tensor:
    """``mask`` with the positions before ``seq_start_pos (b,)`` marked as (left) padding; ``offset``: the
    index of ``x``'s first position in the whole sequence (cached positions before it). ``incremental``: ``x``
    is a piece of a longer sequence (``input_not_include_cache``), whose start may lie beyond it."""
    t = check_lengths(seq_start_pos, "seq_start_pos", b, max_len=None if incremental else n + offset, device=device)
    started = offset + torch.arange(n, device=device)[None] >= t[:, None]  # (b, n)
    return started if mask is None else mask & started


def stack_keywords(return_gumbel_log_probs: bool = False, rotary_pos_emb=None, in_attn_cond=None,
                   self_attn_kv_mask: Tensor | None = None, context_pos: Tensor | None = None,
                   attn_bias: Tensor | None = None, layers_execute_order: tuple[int, ...] | None = None,
                   repeat_blocks=None, self_attn_kv_residuals: Tensor | None = None,
                   cross_attn_kv_residuals: Tensor | None = None, flash_pack_seq_kwargs: dict | None = None,
                   polar_pos_emb=None, flash_pack_seq_context_kwargs: dict | None = None,
                   transform_block_inputs=None, deep_embeds_and_ids=None, self_attn_additional_kv=None,
                   additional_kv_mask: Tensor | None = None, detach_additional_kv: bool = False,
                   route_additional_kv_to_top: bool = True) -> dict:
    """The ``AttentionLayers.forward`` keywords that x-transformers' wrappers hand on to their stack through
    ``**kwargs``, as a dict of those given (not ``None``; ``return_gumbel_log_probs`` when True, a ``TypeError``
    when not a bool; the added keys/values' switches with them). The stack checks each (and refuses
    ``polar_pos_emb`` / ``flash_pack_seq_context_kwargs`` by name); any of them makes it run the padded path."""
    _flag(return_gumbel_log_probs, "return_gumbel_log_probs")
    given = dict(rotary_pos_emb=rotary_pos_emb, in_attn_cond=in_attn_cond, self_attn_kv_mask=self_attn_kv_mask,
                 context_pos=context_pos, attn_bias=attn_bias, layers_execute_order=layers_execute_order,
                 repeat_blocks=repeat_blocks, self_attn_kv_residuals=self_attn_kv_residuals,
                 cross_attn_kv_residuals=cross_attn_kv_residuals, flash_pack_seq_kwargs=flash_pack_seq_kwargs,
                 polar_pos_emb=polar_pos_emb, flash_pack_seq_context_kwargs=flash_pack_seq_context_kwargs,
                 transform_block_inputs=transform_block_inputs, deep_embeds_and_ids=deep_embeds_and_ids,
                 self_attn_additional_kv=self_attn_additional_kv, additional_kv_mask=additional_kv_mask)
    out = {k: v for k, v in given.items() if v is not None}
    if return_gumbel_log_probs:
        out["return_gumbel_log_probs"] = True
    if self_attn_additional_kv is not None or additional_kv_mask is not None:
        out.update(detach_additional_kv=detach_additional_kv, route_additional_kv_to_top=route_additional_kv_to_top)
    return out


def read_stack_keywords(extra: dict, hiddens: bool) -> dict:
    """``extra`` (``stack_keywords``) for a stack run that builds its intermediates (``hiddens``) or not: without
    them nothing reads the attention log probabilities, so ``return_gumbel_log_probs`` is not handed on (the
    stack would return intermediates no one asked for)."""
    if hiddens or "return_gumbel_log_probs" not in extra:
        return extra
    return {k: v for k, v in extra.items() if k != "return_gumbel_log_probs"}


def _additional_kv(net, additional, mask, detach, to_top) -> dict | None:
    """The stack keywords of x-transformers' extra self-attention keys/values (``None`` when not given)."""
    if additional is None and mask is None:
        return None
    if getattr(net, "recycling", False):
        raise ValueError("self_attn_additional_kv is not supported with recycling")
    return dict(self_attn_additional_kv=additional, additional_kv_mask=mask, detach_additional_kv=detach,
                route_additional_kv_to_top=to_top)


class ContinuousMems(tuple):
    """Transformer-XL memories of a ``ContinuousTransformerWrapper`` (``return_mems=True``): a tuple (x-transformers'
    type there) of one ``(b, m, c)`` tensor per self-attention block, with ``masks`` as ``Mems`` has them."""

    masks: list | None = None


class Mems(list):
    """Transformer-XL memories (``TransformerWrapper(return_mems=True)``): a list of one ``(b, m, c)`` tensor per
    self-attention block, as x-transformers returns them, with ``masks``: their padding (one ``(b, m)`` bool per
    block, True = real) or ``None``. Passed back as ``mems=``, the masks come along (unless ``mem_masks`` is given)."""

    masks: list | None = None


def _check_mems_call(net, mems, mem_masks, return_mems, detach_mems, cache, return_cache, return_attn, prepend_embeds,
                     conditions, pos):
    """``forward(mems=, mem_masks=, return_mems=, detach_mems=)`` checked: the memories in the stack's order
    (``shift_mem_down`` applied) and their masks."""
    _flag(return_mems, "return_mems")
    _flag(detach_mems, "detach_mems")
    if mems is None and not return_mems:
        if mem_masks is not None:
            raise ValueError("mem_masks was given without mems")
        return None, None
    for what, bad in (("a KV cache (cache / return_cache)", cache is not None or return_cache),
                      ("prepend_embeds", prepend_embeds is not None or conditions.get("prepend_embeds") is not None),
                      ("memory or class tokens",
                       net.num_fixed_tokens or getattr(net, "memory_tokens_interspersed_every", None)),
                      ("recycling", getattr(net, "recycling", False)), ("a looped model", getattr(net, "looped", False)),
                      ("return_attn (ask return_intermediates)", return_attn and return_mems),
                      ("pos (custom positions; the memories sit at -m .. -1 before the counted real tokens)",
                       pos is not None),
                      (mems_unsupported(net.attn_layers), mems_unsupported(net.attn_layers) is not None)):
        if bad:
            raise ValueError(f"mems / return_mems (Transformer-XL memories) cannot be combined with {what}")
    if mems is not None and mem_masks is None:
        mem_masks = getattr(mems, "masks", None)
    if mems is not None and getattr(net, "shift_mem_down", 0):
        mems = list(mems)
        k = net.shift_mem_down
        mems = [*mems[k:], *mems[:k]]
        if isinstance(mem_masks, (list, tuple)):
            mem_masks = [*mem_masks[k:], *mem_masks[:k]]
    return (None if mems is None else list(mems)), mem_masks


def _new_mems(net, mems, mem_masks, hiddens, mask, detach: bool) -> Mems:
    """x-transformers' new memories: per self-attention block the old memory then the stream that entered the block
    (padded rows 0), the last ``max_mem_len`` positions; their masks alongside (``None`` when all is real)."""
    keep = net.max_mem_len
    b, n = hiddens[0].shape[:2] if hiddens else (0, 0)
    if mems is not None:
        masks = mem_masks if isinstance(mem_masks, (list, tuple)) else [mem_masks] * len(mems)
        new = [torch.cat((m_, h.to(m_.dtype)), dim=1) for m_, h in zip(mems, hiddens)]
    else:
        masks = [None] * len(hiddens)
        new = list(hiddens)
    if mask is None and all(mm is None for mm in masks):
        new_masks = None
    else:
        ones = lambda k: torch.ones(b, k, dtype=torch.bool, device=hiddens[0].device)  # noqa: E731
        cur = ones(n) if mask is None else mask
        made: dict = {}  # one tensor per distinct old mask: blocks that shared a mask share the new one

        def extend(mm, t):
            if id(mm) not in made:
                full = cur if mems is None else torch.cat((ones(t.shape[1] - n) if mm is None else mm, cur), dim=1)
                made[id(mm)] = full[:, full.shape[1] - min(keep, full.shape[1]):]
            return made[id(mm)]

        new_masks = [extend(mm, t) for mm, t in zip(masks, new)]
    new = [t[:, t.shape[1] - min(keep, t.shape[1]):] for t in new]
    if detach:
        new = [t.detach() for t in new]
    out = Mems(new)
    out.masks = new_masks
    return out


def logit_entropies(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """x-transformers' ``calc_entropy``: the entropy of each position's softmax, ``(...)`` from ``logits (..., v)``,
    in float32 at least; banned logits (``-inf``) add 0 (never ``0 * log 0``); positions where ``mask (b, n)`` is False
    give 0."""
    acc = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = acc.log_softmax(dim=-1)
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1)
    return ent if mask is None else torch.where(mask, ent, 0.0)


def attn_z_loss(inter: LayerIntermediates, rows: Tensor | None, weight: float) -> Tensor:
    """x-transformers' ``calc_z_loss`` over the ``pre_softmax_attn`` of every attention block in ``inter``:
    ``weight * mean over real query rows of sum over heads of (sum over blocks of logsumexp over keys)^2``. Masked
    keys (``-inf``) are left out of each logsumexp; a row with no key (a dead row: its weights are all 0) adds 0;
    ``rows (b, N)``: which query rows are real (padded rows are left out of the mean). Finite, and so is its gradient.
    """
    maps = [(a.pre_softmax_attn, a.post_softmax_attn) for a in inter.attn_intermediates]
    if not maps or any(logit is None or w is None for logit, w in maps):
        raise ValueError("return_attn_z_loss needs every attention block's logits and weights (the explicit path): "
                         "not with attention that returns none (Attention(flash=True))")
    lse = 0.0
    for logit, w in maps:  # (b, h, N, j)
        alive = w.sum(dim=-1) > 0  # (b, h, N): a row with a key has weights summing to (about) 1
        safe = torch.where(alive[..., None], logit, 0.0)
        lse = lse + torch.where(alive, safe.logsumexp(dim=-1), 0.0)
    per_row = lse.square().sum(dim=1)  # (b, N)
    if rows is None:
        return per_row.mean() * weight
    return torch.where(rows, per_row, 0.0).sum() / rows.sum().clamp(min=1) * weight



def check_xt_call(net, token_emb_kwargs, to_logits_kwargs, return_next_embed_pred, recycle_steps, cache,
                  return_cache=False) -> None:
    """x-transformers' call keywords of ``net`` (a ``TransformerWrapper``) checked against its options: the custom
    modules' keywords, the continuous head, recycling and the cache. Returns nothing; raises on a bad call."""
    for name, kw, custom in (("token_emb_kwargs", token_emb_kwargs, net.custom_token_emb),
                             ("to_logits_kwargs", to_logits_kwargs, net.custom_to_logits)):
        if kw is not None and not isinstance(kw, dict):
            raise TypeError(f"{name} must be a dict, got {type(kw).__name__}")
        if kw and not custom:
            raise ValueError(f"{name} was given but the model has no custom {name[:-7]} module to receive it")
    _flag(return_next_embed_pred, "return_next_embed_pred")
    if return_next_embed_pred and not net.add_continuous_pred_head:
        raise ValueError("return_next_embed_pred=True needs add_continuous_pred_head=True")
    if return_next_embed_pred and net.memory_tokens_interspersed_every is not None:
        raise ValueError("return_next_embed_pred cannot be combined with memory_tokens_interspersed_every")
    if recycle_steps is not None:
        if not net.recycling:
            raise ValueError("recycle_steps was given but the model was built without recycling=True")
        if isinstance(recycle_steps, bool) or not isinstance(recycle_steps, int) or recycle_steps < 1:
            raise ValueError(f"recycle_steps must be a positive integer, got {recycle_steps!r}")
    if net.recycling:
        if recycle_steps is None and not net.training:
            raise ValueError("a recycling model needs recycle_steps in eval mode (x-transformers' rule)")
        if cache is not None or return_cache:
            raise ValueError("recycling runs the whole stack several times: no KV cache (x-transformers' rule)")


def add_embeds(net, emb: Tensor, x: Tensor, mask: Tensor | None, sum_embeds, embed_ids) -> Tensor:
    """x-transformers' ``embed_ids`` (the ``embed_num_tokens`` embeddings) and ``sum_embeds`` added to the token
    embeddings ``emb (b, n, emb_dim)``; padded positions are selected away (ids there never looked up)."""
    b, n = x.shape
    if (net.embeds is None) != (not embed_ids):
        raise ValueError("embed_ids must be given exactly when the model was built with embed_num_tokens "
                         f"(names {sorted(k[:-6] for k in net.embeds) if net.embeds is not None else []})")
    if embed_ids:
        if not isinstance(embed_ids, dict) or set(embed_ids) != {k[:-6] for k in net.embeds}:
            raise ValueError(f"embed_ids must hold one (b, n) id tensor per name of embed_num_tokens "
                             f"{sorted(k[:-6] for k in net.embeds)}, got {sorted(embed_ids) if isinstance(embed_ids, dict) else embed_ids!r}")
        for name, ids in embed_ids.items():
            table = net.embeds[f"{name}_embed"]
            ids = _token_ids(ids, f"embed_ids[{name!r}]")
            if tuple(ids.shape) != (b, n) or ids.device != x.device:
                raise ValueError(f"embed_ids[{name!r}] must have shape (b, n) = ({b}, {n}) on {x.device}, got "
                                 f"{tuple(ids.shape)} on {ids.device}")
            if mask is not None:
                ids = torch.where(mask, ids, 0)
            if ids.numel() and bool(((ids < 0) | (ids >= table.num_embeddings)).any()):
                raise ValueError(f"embed_ids[{name!r}] holds an id outside [0, {table.num_embeddings}) at a real "
                                 f"position")
            emb = emb + table(ids).to(emb.dtype)
    if sum_embeds is not None:
        if not isinstance(sum_embeds, Tensor) or tuple(sum_embeds.shape) != (b, n, net.emb_dim) \
                or not sum_embeds.is_floating_point() or sum_embeds.device != x.device:
            raise ValueError(f"sum_embeds must be floating-point of shape (b, n, emb_dim) = ({b}, {n}, {net.emb_dim}) "
                             f"on {x.device}, got {getattr(sum_embeds, 'shape', type(sum_embeds))}")
        emb = emb + (sum_embeds if mask is None else torch.where(mask[..., None], sum_embeds, 0.0)).to(emb.dtype)
    if mask is not None and (embed_ids or sum_embeds is not None):
        emb = torch.where(mask[..., None], emb, 0.0)
    return emb


def pool_tokens(net, h: Tensor, full_mask: Tensor | None, cache, want_inter: bool, inter) -> Tensor | None:
    """x-transformers' ``attn_pool``: the learned queries attend over the real positions of ``h`` (prefix
    included; memory and class rows are not there), ``(b, num_pooled_tokens, dim_pooled_tokens)``. Run for an
    encoder on every call and for a decoder when the intermediates are asked for (x-transformers' rule); the
    result also goes on the intermediates as ``attn_pooled_tokens``. Not with a KV cache: ``h`` then holds only
    the new positions (an encoder refuses, a decoder's intermediates carry ``None``)."""
    if net.attn_pool is None:
        return None
    encoder = not net.attn_layers.causal
    if not (encoder or want_inter):
        return None
    if cache is not None:
        if encoder:
            raise ValueError("attn_pool pools the whole sequence: not with a KV cache (this call's hidden states "
                             "hold only the new positions)")
        pooled = None
    else:
        pooled = net.attn_pool(h, mask=full_mask)  # (b, P, d_pool): a sample with no real position pools to 0
    if inter is not None:
        inter.attn_pooled_tokens = pooled
    return pooled


@dataclass(eq=False, frozen=True)
class WrapperCall:
    """One call of ``TransformerWrapper.forward``, an immutable value: its keywords as given (the first block of
    fields, documented in ``wrappers.py``'s module docstring; ``forward`` passes each one by name rather than reading
    ``locals()``, so that ``torch.compile`` traces it whole; ``loop_out`` is ``_loop_out``, ``conditions`` the further
    condition kinds), then what the phases derive from them, each phase returning a new value
    (``dataclasses.replace``) that the next one reads:

    - ``resolve_call``: ``x`` (``(b, n)`` ids, padded ids 0), ``mask``, ``pos``, ``cache``, ``cache_age``,
      ``sum_embeds``, ``embed_ids``, ``mems``, ``mem_masks`` as resolved (the new positions only); ``b``, ``n``;
      ``conds`` (the checked ``Conditions``); ``z_weight``; ``give_inter`` (the intermediates are returned) and
      ``want_inter`` (the stack gathers them); ``loop`` (the looped settings or ``None``);
    - ``embed_call``: ``emb (b, n, e)``, ``ff_deep (b, n, L, c)`` or ``None``, ``extra_kv`` (stack keywords);
    - ``run_call``: the stack's ``h (b, rows, c)``, ``new_cache``, ``full_mask``, ``m`` (prefix rows), ``fixed_out``
      (memory and class rows' outputs), ``inter``, ``plan`` (the unpadded plan); ``pooled_tokens``; ``init``;
    - ``head_call``: ``h`` and ``full_mask`` (prefix cut when excised), ``emb_out``, ``logits``, ``pooled_out``,
      ``embeddings_only``.
    """

    x: Tensor
    mask: Tensor | None
    context: Tensor | None
    context_mask: Tensor | None
    attn_mask: Tensor | None
    return_embeddings: bool
    return_pooled: bool
    cache: object
    return_cache: bool
    check_finite: bool | None
    prepend_embeds: Tensor | None
    prepend_mask: Tensor | None
    excise_prepend_embeds: bool
    condition: Tensor | None
    condition_mask: Tensor | None
    pos: Tensor | None
    seq_start_pos: Tensor | None
    return_intermediates: bool
    return_attn: bool
    return_hiddens: bool
    cache_age: int
    token_emb_kwargs: dict | None
    to_logits_kwargs: dict | None
    return_next_embed_pred: bool
    recycle_steps: int | None
    input_not_include_cache: bool | None
    causal: bool | None
    self_attn_additional_kv: object
    additional_kv_mask: Tensor | None
    detach_additional_kv: bool
    route_additional_kv_to_top: bool
    looped_steps: int | None
    max_looped_steps: int | None
    looped_pred_all_logits: bool | None
    looped_inference: bool
    looped_exit_prob_threshold: float
    return_logits_and_embeddings: bool
    return_embeddings_and_intermediates: bool
    return_logit_entropies: bool
    sum_embeds: Tensor | None
    embed_ids: dict | None
    return_attn_z_loss: bool
    attn_z_loss_weight: float | None
    loop_out: dict | None
    mems: object
    mem_masks: object
    return_mems: bool
    detach_mems: bool
    conditions: dict
    transform_token_embeds: object = None
    transform_block_inputs: object = None
    stack_extra: dict = field(default_factory=dict)  # AttentionLayers.forward keywords handed on (rotary_pos_emb, ...)
    # derived by the phases
    b: int = 0
    n: int = 0
    conds: Conditions | None = None
    z_weight: float = 0.0
    give_inter: bool = False
    want_inter: bool = False
    loop: dict | None = None
    emb: Tensor | None = None
    ff_deep: Tensor | None = None
    extra_kv: dict | None = None
    h: Tensor | None = None
    new_cache: object = None
    full_mask: Tensor | None = None
    m: int = 0
    fixed_out: Tensor | None = None
    inter: LayerIntermediates | None = None
    plan: object = None
    pooled_tokens: Tensor | None = None
    init: Tensor | None = None
    emb_out: object = None
    logits: object = None
    pooled_out: Tensor | None = None
    embeddings_only: bool = False


def resolve_call(net: WrapperModule, c: WrapperCall) -> WrapperCall:
    """The door: ``c``'s token ids, masks, cache protocol (x-transformers' ``LayerIntermediates`` cache cut to the
    new positions), conditions, flags and looped settings checked and resolved (see ``WrapperCall``)."""
    conditions = condition_kwargs("TransformerWrapper.forward", c.conditions)
    x = _token_ids(c.x, "x")
    b, n = x.shape
    check_xt_call(net, c.token_emb_kwargs, c.to_logits_kwargs, c.return_next_embed_pred, c.recycle_steps, c.cache,
                  c.return_cache)
    incl = net.input_not_include_cache if c.input_not_include_cache is None else c.input_not_include_cache
    _flag(incl, "input_not_include_cache")
    cache_age = n if incl and isinstance(c.cache, LayerIntermediates) and c.cache_age == 1 else c.cache_age
    mask, pos, sum_embeds, embed_ids = c.mask, c.pos, c.sum_embeds, c.embed_ids
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n), device=x.device)
    if c.seq_start_pos is not None:
        mask = _start_mask(c.seq_start_pos, mask, b, n, x.device, offset=_cached_slots(c.cache, n, cache_age),
                           incremental=incl)
    cache, keep = resolve_cache(c.cache, n, cache_age, lead_slots=True)
    if keep is not None:  # x-transformers' protocol: the last cache_age positions are new
        whole = lambda t: _last(t, keep) if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[1] == n else t  # noqa: E731
        sum_embeds = whole(sum_embeds)
        if isinstance(embed_ids, dict):
            embed_ids = {k: whole(v) for k, v in embed_ids.items()}
        x, mask, pos, n = x[:, -keep:], _last(mask, keep), _last(pos, keep), keep
    if mask is not None:
        x = torch.where(mask, x, torch.zeros_like(x))
    if not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active() and x.numel() \
            and bool(((x < 0) | (x >= net.num_tokens)).any()):  # (under vmap the embedding's own check)
        bad = ((x < 0) | (x >= net.num_tokens)).nonzero()[0].tolist()  # reached only on error
        raise ValueError(f"x holds token id {int(x[tuple(bad)])} at real position {tuple(bad)}, outside the "
                         f"vocabulary [0, num_tokens={net.num_tokens}); padded positions (mask False) may hold anything")
    conds = net._check_conditions(_conditions(c.context, c.context_mask, c.prepend_embeds, c.prepend_mask,
                                              c.condition, c.condition_mask, conditions),
                                  net.check_finite if c.check_finite is None else c.check_finite)
    for v, name in ((c.return_logits_and_embeddings, "return_logits_and_embeddings"),
                    (c.return_embeddings_and_intermediates, "return_embeddings_and_intermediates"),
                    (c.return_logit_entropies, "return_logit_entropies"), (c.return_attn_z_loss, "return_attn_z_loss")):
        _flag(v, name)
    z_weight = net.attn_z_loss_weight if c.attn_z_loss_weight is None else c.attn_z_loss_weight
    if isinstance(z_weight, bool) or not isinstance(z_weight, (int, float)) or not math.isfinite(z_weight):
        raise ValueError(f"attn_z_loss_weight must be a finite number, got {z_weight!r}")
    give_inter = c.return_intermediates or c.return_hiddens or c.return_logit_entropies or c.return_attn_z_loss
    want_inter = give_inter or c.return_attn or c.return_embeddings_and_intermediates
    mems, mem_masks = _check_mems_call(net, c.mems, c.mem_masks, c.return_mems, c.detach_mems, cache,
                                       c.return_cache, c.return_attn, c.prepend_embeds, conditions, pos)
    loop = net._loop_settings(c.looped_steps, c.max_looped_steps, c.looped_pred_all_logits, c.looped_inference,
                              c.looped_exit_prob_threshold)
    return replace(c, conditions=conditions, input_not_include_cache=incl, cache_age=cache_age, sum_embeds=sum_embeds,
                   embed_ids=embed_ids, x=x, mask=mask, pos=pos, cache=cache, b=b, n=n, conds=conds, z_weight=z_weight,
                   give_inter=give_inter, mems=mems, mem_masks=mem_masks,
                   want_inter=want_inter or c.return_mems,  # the memories are the hiddens
                   loop=loop)


def _transformed_embeds(fn, emb: Tensor, mask: Tensor | None) -> Tensor:
    """``fn(emb)`` checked (a tensor of the same shape and dtype), its padded rows selected to 0 (whatever ``fn``
    wrote there, NaN included)."""
    if not callable(fn):
        raise TypeError(f"transform_token_embeds must be callable, got {type(fn).__name__}")
    out = fn(emb)
    if not isinstance(out, Tensor) or out.shape != emb.shape or out.dtype != emb.dtype:
        raise ValueError(f"transform_token_embeds must return a tensor of shape {tuple(emb.shape)} and dtype "
                         f"{emb.dtype}, got {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    return out if mask is None else torch.where(mask[..., None], out, 0.0)


def embed_call(net: WrapperModule, c: WrapperCall) -> WrapperCall:
    """``c.emb (b, n, e)``: the token embeddings plus the further and summed embeddings; ``c.ff_deep``: each
    token's deep-embedding rows ``(b, n, L, c)`` or ``None``; ``c.extra_kv``: the stack's added keys/values,
    Transformer-XL memories and ``transform_block_inputs`` (its depth 1 applied here) as stack keywords, or
    ``None``."""
    emb = net._embed(c.x, c.mask, c.token_emb_kwargs)
    check_transform_block_inputs(c.transform_block_inputs)
    if c.transform_token_embeds is not None:  # x-transformers' hook on the token embeddings; padded rows re-zeroed
        emb = _transformed_embeds(c.transform_token_embeds, emb, c.mask)
    elif c.transform_block_inputs is not None:  # x-transformers: its depth 1 is the token embeddings
        emb = transform_block_input(c.transform_block_inputs, 1, emb, c.mask)
    emb = add_embeds(net, emb, c.x, c.mask, c.sum_embeds, c.embed_ids)
    # ff_deep_embed: each token's rows of multipliers, one per feed-forward block (padded ids were zeroed)
    ff_deep = None if net.ff_deep_embed is None else net.ff_deep_embed[c.x].to(emb.dtype)  # (b, n, L, c)
    extra_kv = _additional_kv(net, c.self_attn_additional_kv, c.additional_kv_mask, c.detach_additional_kv,
                              c.route_additional_kv_to_top)
    if c.mems is not None:  # Transformer-XL memories: stack keywords (padded path)
        extra_kv = dict(extra_kv or {}, mems=c.mems, mem_masks=c.mem_masks)
    if c.transform_block_inputs is not None:  # depths 2, 3, ...: the stack's (padded path)
        extra_kv = dict(extra_kv or {}, transform_block_inputs=c.transform_block_inputs)
    stack_extra = read_stack_keywords(c.stack_extra, c.want_inter or c.return_next_embed_pred)
    if stack_extra:  # x-transformers' keywords of the stack, handed on (padded path)
        extra_kv = dict(extra_kv or {}, **stack_extra)
    return replace(c, emb=emb, ff_deep=ff_deep, extra_kv=extra_kv)


def run_call(net: WrapperModule, c: WrapperCall) -> WrapperCall:
    """The stack on ``c.emb`` (recycled, or once / looped with the memory, class and prefix rows), then what the
    intermediates gather from its output: the looped runs' outputs, the pooled tokens, the z-loss and the initial
    embeddings (see ``WrapperCall`` for the fields set)."""
    hiddens = c.want_inter or c.return_next_embed_pred
    if net.recycling:
        out = net._recycle(c.emb, c.mask, c.conds, c.attn_mask, c.recycle_steps, c.pos, hiddens, causal=c.causal,
                           ff_deep=c.ff_deep, extra_kv=c.extra_kv)
    else:
        out = net._run(c.emb, c.mask, c.conds, c.attn_mask, c.cache, c.return_cache, pos=c.pos, return_hiddens=hiddens,
                       causal=c.causal, ff_deep=c.ff_deep, extra_kv=c.extra_kv, loop=c.loop)
    h, new_cache, full_mask, m, fixed_out, inter, plan = out
    if c.loop is not None and (inter is not None or c.loop_out is not None):
        found = net._loop_outputs(c.loop, fixed_out is not None, m if c.excise_prepend_embeds else 0, full_mask,
                                  c.to_logits_kwargs)
        if c.loop_out is not None:
            c.loop_out.update(found)
        if inter is not None:
            for key, value in found.items():
                setattr(inter, key, value)
            if inter.cache is not None:
                inter.looped_prompt_kv_cache = inter.cache.looped_prompt_kv
    pooled_tokens = pool_tokens(net, h, full_mask, c.cache, c.return_intermediates or c.return_hiddens, inter)
    if inter is not None:
        inter.last_layer_hiddens = h
    if c.return_attn_z_loss:  # over every row the stack ran (memory, class and prefix rows included)
        rows = full_mask
        if net.memory_tokens_interspersed_every is not None and rows is not None:  # the interleaved rows
            rows = intersperse_layout(rows, c.b, c.n, net.memory_tokens_interspersed_every, net.num_memory_tokens,
                                      rows.device)[4]
        elif rows is not None and fixed_out is not None:
            rows = torch.cat((rows.new_ones(c.b, fixed_out.shape[1]), rows), dim=1)
        inter.attn_z_loss = attn_z_loss(inter, rows, c.z_weight)
    init = None
    if inter is not None and inter.hiddens and net.memory_tokens_interspersed_every is None:
        # the embeddings entering the stack, for the tokens' rows
        init = inter.hiddens[0]
        if net.num_fixed_tokens and c.cache is None:
            init = init[:, net.num_fixed_tokens:]
        if c.excise_prepend_embeds and m:
            init = init[:, m:]
        inter.initial_embeds = init
    return replace(c, new_cache=new_cache, plan=plan, pooled_tokens=pooled_tokens, init=init, h=h, full_mask=full_mask,
                   m=m, fixed_out=fixed_out, inter=inter)


def head_call(net: WrapperModule, c: WrapperCall) -> WrapperCall:
    """The call's output: ``c.emb_out`` (pooled ``(b, c)``, class rows ``(b, c)`` / ``(b, C, c)`` or per position
    ``(b, n, c)``, the prefix cut when excised), ``c.logits`` (the head on it, squeezed; ``None`` when not needed),
    ``c.pooled_out`` (an encoder's attention-pooled tokens) and the logit entropies on the intermediates."""
    h, full_mask, m, inter = c.h, c.full_mask, c.m, c.inter
    head_kw = c.to_logits_kwargs or {}
    embeddings_only = c.return_embeddings or net.return_only_embed or c.return_embeddings_and_intermediates
    if c.return_logits_and_embeddings and (embeddings_only or c.return_pooled or not net.has_head):
        raise ValueError("return_logits_and_embeddings needs the output head: not with return_embeddings, "
                         "return_embeddings_and_intermediates, return_pooled or return_only_embed")
    need_logits = not embeddings_only or c.return_logit_entropies
    logits = pooled_out = entropy_mask = None
    if c.return_pooled:
        emb_out = masked_mean(h, full_mask, dim=1)  # (b, c), prefix included
        need_logits = False
    elif net.average_pool_embed:  # the head on the mean of the real positions (prefix included)
        emb_out = masked_mean(h, full_mask, dim=1)  # (b, c): a fully padded sample pools to 0
        logits = net._head(emb_out, **head_kw) if need_logits and net.has_head else None
    elif net.cls_token is not None and c.fixed_out is not None:
        cls = c.fixed_out[:, net.num_memory_tokens:]  # (b, C, c)
        emb_out = cls[:, 0] if cls.shape[1] == 1 else cls
        logits = net._head(emb_out, **head_kw) if need_logits and net.has_head else None
    else:
        if c.excise_prepend_embeds and m:
            h = h[:, m:]
            full_mask = None if full_mask is None else full_mask[:, m:]
        emb_out = h
        # x-transformers: an encoder with attn_pool returns its pooled tokens (the logits go on the intermediates)
        if c.pooled_tokens is not None and not net.attn_layers.causal and not embeddings_only:
            pooled_out = c.pooled_tokens
            need_logits = inter is not None or c.return_logits_and_embeddings
        if need_logits and net.has_head:
            logits = net._logits(h, full_mask, c.plan, c.to_logits_kwargs)
            entropy_mask = full_mask
    if logits is not None:
        logits = net._squeeze(logits)
    if c.return_logit_entropies:
        if logits is None:
            raise ValueError("return_logit_entropies needs logits: not with return_pooled or return_only_embed")
        inter = inter if inter is not None else LayerIntermediates()
        ent = lambda t: logit_entropies(t, entropy_mask if t.dim() == 3 else None)  # noqa: E731
        inter.logit_entropies = tuple(ent(t) for t in logits) if isinstance(logits, tuple) else ent(logits)
    return replace(c, h=h, full_mask=full_mask, inter=inter, emb_out=emb_out, logits=logits, pooled_out=pooled_out,
                   embeddings_only=embeddings_only)


def finish_call(net: WrapperModule, c: WrapperCall):
    """``forward``'s return value: the output (logits, embeddings, pooled tokens or a pair of them), with the
    next-embedding prediction, then the new memories, the cache and the intermediates or attention maps asked for."""
    inter, emb_out, logits, h, m = c.inter, c.emb_out, c.logits, c.h, c.m
    if c.return_logits_and_embeddings:
        out = (logits, emb_out)
    elif c.return_embeddings_and_intermediates:
        out = (emb_out, inter)
    elif c.embeddings_only or c.return_pooled:
        out = emb_out
    elif c.pooled_out is not None:
        if inter is not None:
            inter.logits = logits
        out = c.pooled_out
    else:
        out = logits
    if c.return_next_embed_pred:
        hid = h[:, m:] if c.excise_prepend_embeds and m and emb_out is not h else h
        out = (out, (net.to_next_embed_pred(hid), c.init))
    if c.return_mems:
        new_mems = _new_mems(net, c.mems, c.mem_masks, inter.hiddens, c.mask, c.detach_mems)
        if not c.give_inter:
            return out, new_mems
        inter.mems, inter.mem_masks = new_mems, new_mems.masks
    extra = ((c.new_cache,) if c.return_cache else ()) + (
        (inter,) if c.give_inter else (inter.attn_maps,) if c.return_attn else ())
    return (out, *extra) if extra else out


# ----------------------------------------------------------------------------------------------------
# ContinuousTransformerWrapper.forward's phases
# ----------------------------------------------------------------------------------------------------


def continuous_mask(net: WrapperModule, x, mask: Tensor | None, lens, seq_start_pos, sum_embeds) -> Tensor | None:
    """The continuous wrapper's door: ``x (b, n, dim_in)`` and ``sum_embeds`` checked; returns the padding mask
    ``(b, n)`` (from ``mask`` or ``lens``, with ``seq_start_pos``) or ``None``."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != net.dim_in:
        raise ValueError(f"x must have shape (b, n, dim_in={net.dim_in}), got {getattr(x, 'shape', type(x))}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    check_weight_dtype(x, net.project_in)
    b, n, _ = x.shape
    if lens is not None:
        if mask is not None:
            raise ValueError("pass mask or lens, not both")
        check_lengths(lens, "lens", b, max_len=n, device=x.device)
        mask = torch.arange(n, device=x.device)[None] < lens.to(x.device)[:, None]
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n), device=x.device)
    if seq_start_pos is not None:
        check_lengths(seq_start_pos, "seq_start_pos", b, max_len=n, device=x.device)
        start = torch.arange(n, device=x.device)[None] >= seq_start_pos.to(x.device)[:, None]
        mask = start if mask is None else mask & start
    if sum_embeds is not None:
        dim = net.attn_layers.dim
        if not isinstance(sum_embeds, Tensor) or sum_embeds.shape != (b, n, dim) \
                or not sum_embeds.is_floating_point() or sum_embeds.device != x.device:
            raise ValueError(f"sum_embeds must be a float tensor of shape (b={b}, n={n}, dim={dim}) on "
                             f"{x.device}, got {getattr(sum_embeds, 'dtype', type(sum_embeds).__name__)} "
                             f"{tuple(getattr(sum_embeds, 'shape', ()))}")
    return mask


def continuous_new_rows(x: Tensor, mask: Tensor | None, pos, sum_embeds, cache, cache_age: int,
                        input_not_include_cache: bool, check: bool) -> tuple:
    """``(x, mask, pos, sum_embeds, cache)`` for the new positions only (x-transformers' ``LayerIntermediates``
    cache protocol resolved), ``x`` checked finite at real positions (with ``check``) and its padded rows selected
    to 0 (NaN or inf there reaches nothing)."""
    n = x.shape[1]
    _flag(input_not_include_cache, "input_not_include_cache")
    if input_not_include_cache and isinstance(cache, LayerIntermediates) and cache_age == 1:
        cache_age = n  # every position of x is new
    cache, keep = resolve_cache(cache, n, cache_age, lead_slots=True)
    if keep is not None:  # x-transformers' protocol: the last cache_age positions are new
        x, mask, pos = x[:, -keep:], _last(mask, keep), _last(pos, keep)
        sum_embeds = _last(sum_embeds, keep)
    if check:
        _check_finite(x, mask, "x")
    if mask is not None:
        x = torch.where(mask[..., None], x, 0.0)
    return x, mask, pos, sum_embeds, cache


def continuous_output(net: WrapperModule, h: Tensor, full_mask: Tensor | None, m: int, *, excise_prepend_embeds,
                      return_pooled, return_embeddings) -> Tensor:
    """The continuous wrapper's output from the stack's ``h (b, m + n, c)``: pooled ``(b, c)``, the hidden states,
    or ``project_out`` of either (before the probabilistic head); the prefix cut when excised."""
    if excise_prepend_embeds and m and not (return_pooled or net.average_pool_embed):
        h = h[:, m:]
    if return_pooled:
        out = masked_mean(h, full_mask, dim=1)
    elif net.average_pool_embed:
        pooled = masked_mean(h, full_mask, dim=1)  # (b, c): a fully padded sample pools to 0
        out = pooled if return_embeddings else net.project_out(pooled)
    elif return_embeddings:
        out = h
    else:
        out = net.project_out(h)
    return out


def continuous_mems(net: WrapperModule, mems, mem_masks, return_mems, cache, return_cache: bool, return_attn: bool,
                    prepend_embeds, pos) -> dict | None:
    """The continuous wrapper's Transformer-XL keywords checked as ``TransformerWrapper`` checks them (no cache,
    prefix, memory tokens, custom ``pos`` or ``return_attn`` beside them); returns the stack's keywords for the
    memories (``mems``, ``mem_masks``: a ``ContinuousMems`` or ``Mems`` brings its masks) or ``None``."""
    mems, mem_masks = _check_mems_call(net, mems, mem_masks, return_mems, True, cache, return_cache, return_attn,
                                       prepend_embeds, {}, pos)
    return None if mems is None else dict(mems=mems, mem_masks=mem_masks)


def continuous_returns(net: WrapperModule, out, new_cache, inter, full_mask: Tensor | None, *, return_cache: bool,
                       give_inter: bool, return_attn: bool, return_mems: bool):
    """The continuous wrapper's return value, x-transformers' forms: ``out``, then the cache, the intermediates or
    the attention maps; with ``return_mems`` and no intermediates ``(out, mems)``, the new memories a
    ``ContinuousMems`` of this segment's stream entering each self-attention block, the last ``max_mem_len``
    positions, detached (x-transformers' continuous wrapper keeps no older memory in them); with the
    intermediates, they go on it (``mems``, ``mem_masks``)."""
    if return_mems:
        made = _new_mems(net, None, None, inter.hiddens, full_mask, True)
        new_mems = ContinuousMems(made)
        new_mems.masks = made.masks
        if not give_inter:
            return out, new_mems
        inter.mems, inter.mem_masks = new_mems, new_mems.masks
    extra = ((new_cache,) if return_cache else ()) + (
        (inter,) if give_inter else (inter.attn_maps,) if return_attn else ())
    return (out, *extra) if extra else out
