"""What a layer stack keeps and returns besides its output: the KV cache and the intermediates.

Shape legend: b batch, p cached positions, j context length, h_kv key/value heads, d head dim,
c model width, K adaptive-condition width.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from .masks import seen_in_scope, validate_mask

__all__ = ["KVCache", "AttnIntermediate", "LayerIntermediates", "resolve_cache"]


@dataclass
class KVCache:
    """What incremental decoding keeps between steps. Returned by ``forward(..., return_cache=True)``.

    Attributes:
        self_kv: per self-attention block, keys and values ``(b, h_kv, p, d)`` (rotary applied).
        cross_kv: per cross-attention block, the context's keys and values, computed once; ``None``
            when the stack ran without a context.
        mask: ``(b, p)`` which cached positions are real; ``None`` when all are.
        context_mask: ``(b, j)`` the context's padding mask, or ``None``.
        count: ``(b,)`` real tokens seen per sample (the next token's position).
        positions: ``(b|1, p)`` positions of the cached tokens (for ALiBi).
        context: the context tensor ``cross_kv`` was computed from (a reference, no copy): a later
            call may pass this same tensor (and the same ``context_mask``) again; any other context
            with a cache is an error, never silently ignored.
        condition: ``(b, K)`` the adaptive-norm condition in use (nulls in place of dropped ones);
            ``condition_input`` / ``condition_mask``: what the user passed (references), which a later
            call may pass again (the same tensors), like ``context``.
        hybrid: per self-attention with ``attn_hybrid_module``, the module's recurrent state after the cached
            positions: a tuple of batch-first tensors ``(b, ...)``, or a string saying why it cannot continue.
        lead: ``(b,)`` real rows before the tokens (memory, class and prefix rows), set by the wrappers:
            the tokens' absolute positions start after them. ``lead_slots``: those rows' slots.
        looped_prompt_kv: a ``looped`` wrapper's prompt keys/values per loop step (per step, per self-attention
            block, ``(k, v)`` covering the first slots): at loop step i the cached prompt slots are read from
            entry i. ``exit_indices``: ``(b, t)`` the loop step each decoded call exited at, per sample.

    A cache is input like any other: whatever its masked slots hold (positions where ``mask`` or
    ``context_mask`` is False) reaches no output and no gradient.
    """

    self_kv: list[tuple[Tensor, Tensor]]
    cross_kv: list[tuple[Tensor, Tensor]] | None
    mask: Tensor | None
    context_mask: Tensor | None
    count: Tensor
    positions: Tensor
    context: Tensor | None = None
    condition: Tensor | None = None
    condition_input: Tensor | None = None
    condition_mask: Tensor | None = None
    lead: Tensor | None = None
    lead_slots: int = 0
    hybrid: list | None = None
    looped_prompt_kv: list | None = None
    exit_indices: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.count.shape[0])

    @property
    def length(self) -> int:
        """p, the number of cached positions (real or padding)."""
        return self.self_kv[0][0].shape[2] if self.self_kv else int(self.positions.shape[1])

    @staticmethod
    def check(cache, x: Tensor, n_self: int, n_cross: int) -> None:
        """Raise a clear error unless ``cache`` fits a stack of ``n_self`` self- and ``n_cross``
        cross-attention blocks run on ``x (b, n, c)``: batch, device, dtype, lengths and masks (S9)."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache returned by forward(..., return_cache=True), got {type(cache).__name__}")
        if seen_in_scope(cache, ("KVCache", tuple(x.shape[:1]), x.dtype, str(x.device), n_self, n_cross)):
            return  # checked already in this call (the wrapper checks it before its stack does)
        if len(cache.self_kv) != n_self:
            raise ValueError(f"cache holds {len(cache.self_kv)} self-attention layers, this stack has {n_self}")
        if cache.cross_kv is not None and len(cache.cross_kv) != n_cross:
            raise ValueError(f"cache holds {len(cache.cross_kv)} cross-attention layers, this stack has {n_cross}")
        b = x.shape[0]
        if cache.batch_size != b:
            raise ValueError(f"cache is for a batch of {cache.batch_size} samples, x has {b}; "
                             f"use cache.index_select(...) to repeat or reorder its samples")
        if cache.count.device != x.device:
            raise ValueError(f"cache is on {cache.count.device}, expected {x.device} (the device of x)")
        p = cache.length

        def integer(t) -> bool:
            return isinstance(t, Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)

        if not integer(cache.count) or tuple(cache.count.shape) != (b,):
            raise ValueError(f"cache.count must be an integer tensor of shape (b,) = ({b},), got {getattr(cache.count, 'shape', None)}")
        pos = cache.positions
        if not integer(pos) or pos.dim() != 2 or pos.shape[0] not in (1, b) or pos.shape[1] != p:
            raise ValueError(f"cache.positions must be integer positions of shape (b|1, p) = ({b}, {p}), got "
                             f"{getattr(pos, 'shape', type(pos))}")
        if cache.lead is not None and (not integer(cache.lead) or tuple(cache.lead.shape) != (b,)):
            raise ValueError(f"cache.lead must be an integer tensor of shape (b,) = ({b},), got {getattr(cache.lead, 'shape', None)}")
        for name in ("context", "condition", "condition_input"):
            t = getattr(cache, name)
            if t is not None and (not isinstance(t, Tensor) or t.dim() < 2 or t.shape[0] != b):
                raise ValueError(f"cache.{name} is for a batch of {getattr(t, 'shape', [None])[0]} samples, x has {b}")
        if cache.mask is not None:
            validate_mask(cache.mask, "cache.mask", shape=(b, p), device=x.device)
        for k, v in cache.self_kv:
            if k.shape[0] != b or k.shape[2] != p or v.shape[:3] != k.shape[:3] or _dtype_differs(k, x):
                raise ValueError(f"cache.self_kv holds keys {tuple(k.shape)} {k.dtype} and values {tuple(v.shape)}, "
                                 f"expected (b={b}, h_kv, p={p}, d) in {x.dtype}")
        if cache.exit_indices is not None and (not integer(cache.exit_indices) or cache.exit_indices.dim() != 2
                                               or cache.exit_indices.shape[0] != b):
            raise ValueError(f"cache.exit_indices must be integer loop steps of shape (b={b}, t)")
        for step in cache.looped_prompt_kv or ():
            if len(step) != n_self or any(k.shape[0] != b or k.shape[2] > p or v.shape[:3] != k.shape[:3]
                                          or k.shape[1] != kk.shape[1] or k.shape[3] != kk.shape[3]
                                          for (k, v), (kk, _) in zip(step, cache.self_kv)):
                raise ValueError(f"cache.looped_prompt_kv must hold, per loop step, one (k, v) per self-attention "
                                 f"block shaped like cache.self_kv (b={b}, at most p={p} slots)")
        for state in cache.hybrid or ():
            if isinstance(state, tuple) and any(not isinstance(t, Tensor) or t.shape[0] != b for t in state):
                raise ValueError(f"cache.hybrid holds a state that is not batch-first for b={b}")
        if cache.cross_kv is not None:
            for k, v in cache.cross_kv:
                if k.shape[0] != b or v.shape[:3] != k.shape[:3] or _dtype_differs(k, x):
                    raise ValueError(f"cache.cross_kv holds keys {tuple(k.shape)} {k.dtype} and values "
                                     f"{tuple(v.shape)}, expected (b={b}, h_kv, j, d) in {x.dtype}")
            if cache.context_mask is not None:
                j = cache.cross_kv[0][0].shape[2] if cache.cross_kv else cache.context_mask.shape[1]
                validate_mask(cache.context_mask, "cache.context_mask", shape=(b, j), device=x.device)

    def index_select(self, index: Tensor) -> KVCache:
        """The cache of the samples ``index`` (a ``(b',)`` long tensor), e.g. to repeat or reorder."""

        def sel(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, index)

        return replace(
            self,
            self_kv=[(sel(k), sel(v)) for k, v in self.self_kv],
            cross_kv=None if self.cross_kv is None else [(sel(k), sel(v)) for k, v in self.cross_kv],
            mask=sel(self.mask), context_mask=sel(self.context_mask), count=sel(self.count),
            positions=self.positions if self.positions.shape[0] == 1 else sel(self.positions),
            context=sel(self.context), condition=sel(self.condition), condition_input=sel(self.condition_input),
            condition_mask=sel(self.condition_mask), lead=sel(self.lead), exit_indices=sel(self.exit_indices),
            looped_prompt_kv=None if self.looped_prompt_kv is None else [[(sel(k), sel(v)) for k, v in step]
                                                                         for step in self.looped_prompt_kv],
            hybrid=None if self.hybrid is None else [s if isinstance(s, str) or s is None else tuple(sel(t) for t in s)
                                                     for s in self.hybrid],
        )


@dataclass
class AttnIntermediate:
    """One attention block's weights, as x-transformers' ``Intermediates`` names them.

    Attributes:
        post_softmax_attn: ``(b, h, i, j)`` float32 weights (memory keys first); rows of padded
            queries and dead rows, and columns of masked keys, are exactly 0. ``None`` from an
            ``Attention(flash=True)`` (as x-transformers).
        layer_type: ``"a"`` (self-attention) or ``"c"`` (cross-attention).
        cached_kv: from ``Attention(..., return_intermediates=True)``: the keys and values ``(b, h_kv, j, d)``
            it used (rotated, memory keys left out), which ``Attention(..., cache=this)`` continues from.
        pre_softmax_attn: ``(b, h, i, j)`` float32 logits the weights came from (bias, softclamp and the scoring
            options included; x-transformers' name, what ``qk_clip_`` reads): masked keys ``-inf``, rows of padded
            queries and dead rows 0. ``None`` where the weights are.
        values: from ``Attention(..., return_intermediates=True)``: the values ``(b, h_kv, j_new, d)`` of the new
            positions (a masked position's input is selected to 0 before its projection), what x-transformers' value
            residual passes on as ``value_residual=``
            to later blocks; ``None`` when this block mixed a ``value_residual`` in itself (x-transformers would
            store its own values before the mix: pass the first block's values on, as its stack does).
    """

    post_softmax_attn: Tensor | None
    layer_type: str
    cached_kv: tuple[Tensor, Tensor] | None = None
    pre_softmax_attn: Tensor | None = None
    values: Tensor | None = None


class _CacheLength:
    """``LayerIntermediates.cache_length`` (a dataclass field, as in x-transformers): the positions the carried
    ``cache`` holds, read from it; without a cache, the value given (default 0). With a cache it can only be set to
    the cache's own length: safeformer continues from the ``KVCache``, so another value would mean nothing."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}_given"

    def __get__(self, obj, objtype=None) -> int | None:
        if obj is None:  # the dataclass' default: "not given"
            return None
        cache = obj.__dict__.get("cache")
        if cache is not None:
            return cache.length
        return obj.__dict__.get(self._slot) or 0

    def __set__(self, obj, value) -> None:
        if value is None:
            obj.__dict__[self._slot] = None
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"cache_length must be a non-negative integer (or None), got {value!r}")
        cache = obj.__dict__.get("cache")
        if cache is not None and value != cache.length:
            raise ValueError(f"cache_length is the length of the carried KVCache ({cache.length}); safeformer "
                             f"continues from that cache, so it cannot be set to {value} (trim the cache instead)")
        obj.__dict__[self._slot] = value


@dataclass
class LayerIntermediates:
    """What ``return_hiddens`` / ``return_intermediates`` returns besides the output.

    Attributes:
        hiddens: the residual stream entering each layer, ``(b, n, c)`` each (padded positions 0).
        last_hidden: the output of the stack (after the final norm).
        attn_intermediates: one ``AttnIntermediate`` per attention block that ran, in order.
        cache: the ``KVCache`` when ``return_cache`` was asked too.
        memory_tokens: the memory tokens' outputs ``(b, M, c)`` (set by the wrapper).
        layer_hiddens: x-transformers' count: the input of every block run (attention, feed-forward), then the
            stream before the final norm (padded positions 0).

    Set by the wrappers (x-transformers' fields, ``None`` unless the option or keyword that fills them is used):

    Attributes:
        attn_pooled_tokens: ``attn_pool``'s pooled tokens ``(b, P, d_pool)``.
        logits: an encoder with ``attn_pool`` returns its pooled tokens; its logits go here.
        logit_entropies: ``forward(return_logit_entropies=True)``: the entropy of each position's softmax
            ``(b, n)`` (padded positions 0).
        attn_z_loss: ``forward(return_attn_z_loss=True)``: the scalar z-loss over the attention logits.
        initial_embeds: the embeddings entering the stack ``(b, n, c)`` (padded rows 0).
        last_layer_hiddens: the stack's output for the prefix and token rows ``(b, m + n, c)`` (memory and class rows
            cut; padded rows 0), before any pooling or head.
        exit_logits: a ``looped`` model's exit-gate logits ``(b, n, 1)``, one per loop step that computed them.
        all_pred_logits: a ``looped`` model's logits ``(b, n, v)`` after each loop step (when asked for).
        exit_indices: a ``looped`` model's last loop step per sample, ``(b, t)`` (one column per call, carried by
            the cache across decoding calls).
        mems: ``TransformerWrapper(return_mems=True)``'s new Transformer-XL memories (a ``Mems`` list, one per
            self-attention block); mem_masks: their padding (one ``(b, m)`` bool per block) or ``None``.
        looped_prompt_kv_cache: a ``looped`` model's prompt keys/values of every loop step (from a
            ``looped_inference`` call on a prompt), in safeformer's form: per step, per self-attention block,
            ``(k, v)`` ``(b, h_kv, p, d)``.
        block_hiddens: x-transformers' field, filled by the stacks' ``return_hiddens``: the stream at the end of
            each default block (every ``len_default_block`` layers run, and at the index of the stack's last
            layer, as x-transformers counts), ``(b, n, c)`` each (``(b S, n, c)`` with several residual streams),
            the last replaced by the output after the final norm; padded positions 0. ``None`` otherwise.
        cache_length: x-transformers' field: the positions the cache holds after this call (the earlier ones and
            the new ones), read from ``cache`` (0 without one); it can be set only to that value (see
            ``_CacheLength``).
    """

    hiddens: list[Tensor] = field(default_factory=list)
    last_hidden: Tensor | None = None
    attn_intermediates: list[AttnIntermediate] = field(default_factory=list)
    cache: KVCache | None = None
    memory_tokens: Tensor | None = None
    layer_hiddens: list[Tensor] = field(default_factory=list)
    attn_pooled_tokens: Tensor | None = None
    logits: Tensor | None = None
    logit_entropies: Tensor | None = None
    attn_z_loss: Tensor | None = None
    initial_embeds: Tensor | None = None
    last_layer_hiddens: Tensor | None = None
    exit_logits: list[Tensor] | None = None
    all_pred_logits: list[Tensor] | None = None
    exit_indices: Tensor | None = None
    looped_prompt_kv_cache: tuple | None = None
    mems: list[Tensor] | None = None
    mem_masks: list[Tensor] | None = None
    block_hiddens: list[Tensor] | None = None
    cache_length: int | None = _CacheLength()  # noqa: RUF009  (a descriptor: read from the cache)

    @property
    def attn_maps(self) -> list[Tensor]:
        """The ``post_softmax_attn`` of every attention block."""
        return [a.post_softmax_attn for a in self.attn_intermediates]


def _dtype_differs(t: Tensor, x: Tensor) -> bool:
    """``t`` cannot meet ``x`` in one matmul: dtypes differ outside autocast (which mixes them itself)."""
    return t.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type)


def first_linear(module: nn.Module) -> nn.Linear | None:
    """The first ``nn.Linear`` inside ``module`` (itself included): the first matmul its input meets. Found once
    per module and kept as a plain attribute (a tuple, so not a submodule: the state dict is unchanged)."""
    found = module.__dict__.get("_sf_first_linear")
    if found is None:
        found = (next((m for m in module.modules() if isinstance(m, nn.Linear)), None),)
        module.__dict__["_sf_first_linear"] = found
    return found[0]


def check_weight_dtype(x: Tensor, module: nn.Module | None, name: str = "x") -> None:
    """``x`` (named ``name``) meets ``module``'s first linear weight in a matmul: outside autocast their dtypes
    must agree. A ``TypeError`` naming the argument, instead of the matmul's error from deep inside."""
    if module is None or torch.compiler.is_compiling():  # a compiled graph meets the matmul's own check at trace
        return
    lin = first_linear(module)
    if lin is None or not isinstance(lin.weight, Tensor):
        return
    w = lin.weight.dtype
    if x.dtype != w and w.is_floating_point and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{name} has dtype {x.dtype}, but the model's weights are {w}: convert it with {name}.to({w}) "
                        f"(or the model with .to({x.dtype}), or run under torch.autocast)")


def attach_cached_kv(intermediates: LayerIntermediates) -> None:
    """x-transformers' intermediates carry each attention block's keys and values (``cached_kv``): here the
    ``KVCache``'s own tuples, so that code written for x-transformers can read them, and edit them (see
    ``_edited_cache``)."""
    cache = intermediates.cache
    if not isinstance(cache, KVCache):
        return
    self_kv, cross_kv = iter(cache.self_kv), iter(cache.cross_kv or ())
    for inter in intermediates.attn_intermediates:
        inter.cached_kv = next(self_kv if inter.layer_type == "a" else cross_kv, None)


def _edited_cache(intermediates: LayerIntermediates, kv: KVCache) -> KVCache:
    """The ``KVCache`` of ``intermediates``, rebuilt from its blocks' ``cached_kv`` where code written for
    x-transformers replaced them (e.g. regrouping the batch, or keeping the first ``p`` positions). Only a cache
    with nothing per sample besides the keys and values can be rebuilt so (no padding, no context padding,
    positions ``0..p-1``, no condition, no leading rows, no recurrent state): otherwise the edit is refused,
    never ignored."""
    attn = intermediates.attn_intermediates or []
    selfs = [a.cached_kv for a in attn if a.layer_type == "a"]
    crosses = [a.cached_kv for a in attn if a.layer_type == "c"]
    own_cross = list(kv.cross_kv or ())
    if len(selfs) != len(kv.self_kv) or (crosses and len(crosses) != len(own_cross)):
        return kv  # intermediates of another shape (their cached_kv were never attached): the cache as it is
    same = all(e is not None and e[0] is o[0] and e[1] is o[1] for e, o in zip(selfs + crosses, kv.self_kv + own_cross))
    if same:
        return kv
    if any(e is None or len(e) != 2 or not all(isinstance(t, Tensor) and t.dim() == 4 for t in e)
           for e in selfs + crosses):
        raise ValueError("cache: every attn_intermediates[i].cached_kv must be a pair of (b, h_kv, p, d) tensors")
    p_expected = torch.arange(kv.length, device=kv.positions.device)
    plain = (kv.mask is None and kv.context_mask is None and kv.condition is None and kv.lead_slots == 0
             and (kv.lead is None or not bool(kv.lead.any())) and kv.hybrid is None and kv.looped_prompt_kv is None
             and bool((kv.positions == p_expected).all()))
    if not plain:
        raise ValueError("cache: its cached_kv were edited, but the cache holds padding, a padded context, a "
                         "condition, leading rows or a recurrent state that the edit does not say how to change; "
                         "edit the KVCache (intermediates.cache) instead")
    b, _, p, _ = selfs[0][0].shape if selfs else crosses[0][0].shape
    for k, v in selfs:
        if k.shape[0] != b or v.shape[0] != b or k.shape[2] != p or v.shape[2] != p:
            raise ValueError(f"cache: edited self-attention cached_kv disagree in batch or length ({tuple(k.shape)} "
                             f"and {tuple(v.shape)}, expected batch {b} and length {p})")
    for k, v in crosses:
        if k.shape[0] != b or v.shape[0] != b or k.shape[2] != v.shape[2]:
            raise ValueError(f"cache: edited cross-attention cached_kv must have batch {b} and one context length")
    device = kv.count.device
    return KVCache(self_kv=[tuple(e) for e in selfs], cross_kv=[tuple(e) for e in crosses] if crosses else kv.cross_kv,
                   mask=None, context_mask=None, count=torch.full((b,), p, dtype=kv.count.dtype, device=device),
                   positions=torch.arange(p, device=device)[None], context=None,
                   lead=None if kv.lead is None else kv.lead.new_zeros(b))


def resolve_cache(cache, n: int, cache_age: int, lead_slots: bool = False) -> tuple[KVCache | None, int | None]:
    """x-transformers' cache protocol: ``cache`` may be the ``LayerIntermediates`` an earlier call returned
    (``return_hiddens`` / ``return_intermediates``), and the input then holds the whole sequence so far or
    only its last ``cache_age`` positions (the new ones). Returns the ``KVCache`` (the canonical form) and
    how many trailing input positions to keep (``None``: keep all, a ``KVCache`` was passed as is).

    ``n``: the input's length; ``lead_slots``: the cache's leading rows (memory, class, prefix rows of a
    wrapper) are not input positions.

    Raises:
        TypeError: a ``LayerIntermediates`` without its cache (from a call that could not build one).
        ValueError: ``cache_age`` out of range, or an input whose length is neither the new positions nor
            the cached positions plus the new ones.
    """
    if not isinstance(cache, LayerIntermediates):
        if cache_age != 1:
            raise ValueError("cache_age applies to a LayerIntermediates cache (x-transformers' protocol); with a "
                             "KVCache the input holds the new positions only")
        return cache, None
    if not isinstance(cache.cache, KVCache):
        raise TypeError("cache is a LayerIntermediates without a KVCache: pass the intermediates returned by a "
                        "forward with return_hiddens=True / return_intermediates=True")
    if isinstance(cache_age, bool) or not isinstance(cache_age, int) or not 1 <= cache_age <= n:
        raise ValueError(f"cache_age must be an integer in [1, n={n}] (the new positions at the end of the input), "
                         f"got {cache_age!r}")
    kv = _edited_cache(cache, cache.cache)
    cached = kv.length - (kv.lead_slots if lead_slots else 0)
    if n not in (cache_age, cached + cache_age):
        raise ValueError(f"with a LayerIntermediates cache of {cached} positions the input must hold the new "
                         f"{cache_age} position(s) or the whole sequence ({cached + cache_age}), got {n}")
    return kv, cache_age
