"""Wrappers: ``TransformerWrapper`` (tokens in, logits out) and ``ContinuousTransformerWrapper``
(vectors in and out). The encoder-decoder ``XTransformer`` builds on generation: ``encoder_decoder.py``.

Shape legend: b batch, n positions, j context length, c model width, v vocabulary size.
Masks: bool, True = real position / may attend (``masks.py``).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn

from .cache import LayerIntermediates, resolve_cache
from .conditions import Conditions, check_condition_tensor, condition_kwargs
from .layers import AttentionLayers, KVCache, _last, translate_aliases
from .losses import masked_mean
from .masks import check_finite as _check_finite
from .masks import check_lengths, checked_once, validate_mask
from .modules import AbsolutePositionalEmbedding, l2norm, positions_from_mask
from .pretrained import Configurable

__all__ = ["TransformerWrapper", "ContinuousTransformerWrapper"]

# x-transformers' TransformerWrapper options whose parameters keep x-transformers' state-dict keys here
XT_OPTION_PARAMETERS = ("to_mixture.0.weight", "combine_mixture.weight", "recycled_proj.weight",
                        "to_next_embed_pred.0.weight", "to_next_embed_pred.2.weight")


def xt_wrapper_option_kwargs(model) -> dict:
    """The safeformer ``TransformerWrapper`` keywords for an x-transformers ``TransformerWrapper``'s
    ``mixture_of_softmax``, ``recycling``, ``add_continuous_pred_head``, ``squeeze_out_last_dim`` and
    ``input_not_include_cache`` (for ``from_x_transformers``; ``copy_xt_wrapper_option_weights`` copies
    their parameters)."""
    kw: dict = {}
    if getattr(model, "to_mixture", None) is not None:
        kw.update(mixture_of_softmax=True, mixture_of_softmax_k=model.combine_mixture.out_features)
    if getattr(model, "recycling", False):
        kw.update(recycling=True, train_max_recycle_steps=model.train_max_recycle_steps)
    for name in ("add_continuous_pred_head", "squeeze_out_last_dim", "input_not_include_cache"):
        if getattr(model, name, False):
            kw[name] = True
    return kw


def xt_continuous_wrapper_kwargs(model) -> dict:
    """The safeformer ``ContinuousTransformerWrapper`` keywords (all but ``attn_layers``) of an x-transformers
    ``ContinuousTransformerWrapper``: ``dim_in`` / ``dim_out`` from its projections (``project_in`` /
    ``project_out`` as given when they are not ``nn.Linear`` or ``nn.Identity``), ``probabilistic``,
    ``max_seq_len`` (``None`` when it has no absolute position embedding), memory tokens, pooling.
    ``copy_xt_continuous_projections`` then copies the projections (x-transformers' have no bias: safeformer's
    are zeroed). For ``from_x_transformers``, which converts the stack."""
    pin, pout = model.project_in, model.project_out
    kw: dict = dict(probabilistic=bool(getattr(model, "probabilistic", False)),
                    average_pool_embed=bool(getattr(model, "average_pool_embed", False)))
    has_abs = type(model.pos_emb).__name__ == "AbsolutePositionalEmbedding"
    kw["max_seq_len"] = model.max_seq_len if has_abs else None
    kw["use_abs_pos_emb"] = has_abs
    mem = getattr(model, "memory_tokens", None)
    kw["num_memory_tokens"] = int(mem.shape[0]) if mem is not None else None
    if isinstance(pin, nn.Linear):
        kw["dim_in"] = pin.in_features
    elif not isinstance(pin, nn.Identity):
        kw["project_in"] = pin
    if isinstance(pout, nn.Linear):
        kw["dim_out"] = pout.out_features // (2 if kw["probabilistic"] else 1)
    elif not isinstance(pout, nn.Identity):
        kw["project_out"] = pout
    return kw


@torch.no_grad()
def copy_xt_continuous_projections(sf_model: nn.Module, xt_model: nn.Module) -> None:
    """Copy an x-transformers ``ContinuousTransformerWrapper``'s ``nn.Linear`` projections (and absolute
    position embedding and memory tokens) into ``sf_model`` built from ``xt_continuous_wrapper_kwargs``; the
    (probabilistic) output layout is the same interleaved one in both libraries."""
    for name in ("project_in", "project_out"):
        theirs, ours = getattr(xt_model, name), getattr(sf_model, name)
        if isinstance(theirs, nn.Linear) and isinstance(ours, nn.Linear) and ours is not theirs:
            ours.weight.copy_(theirs.weight)
            if ours.bias is not None:
                ours.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(ours.bias))
    if sf_model.pos_emb is not None and type(xt_model.pos_emb).__name__ == "AbsolutePositionalEmbedding":
        sf_model.pos_emb.emb.weight.copy_(xt_model.pos_emb.emb.weight)
    if getattr(sf_model, "memory_tokens", None) is not None:
        sf_model.memory_tokens.copy_(xt_model.memory_tokens)


@torch.no_grad()
def copy_xt_wrapper_option_weights(sf_model: nn.Module, xt_model: nn.Module) -> None:
    """Copy the parameters of those options (same keys in both libraries) from ``xt_model`` into ``sf_model``."""
    theirs, ours = xt_model.state_dict(), dict(sf_model.named_parameters())
    for key in XT_OPTION_PARAMETERS:
        if key in theirs and key in ours:
            ours[key].copy_(theirs[key].to(ours[key].dtype))


# x-transformers' spelling -> safeformer's name for the wrappers (see layers.LAYER_ALIASES); None: accepted
# and ignored. Names the same in both libraries need no entry.
WRAPPER_ALIASES: dict[str, object] = {
    "emb_frac_gradient": lambda v: {} if v == 1.0 else {"_unsupported": f"emb_frac_gradient={v}"},
    "post_emb_norm": lambda v: {} if not v else {"_unsupported": "post_emb_norm=True"},
    "scaled_sinu_pos_emb": lambda v: {} if not v else {"_unsupported": "scaled_sinu_pos_emb=True"},
}


def _conditions(context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask, conditions: dict) -> Conditions:
    """The named condition keywords and the further kinds (``**conditions``) as one ``Conditions``; named
    explicitly, not read from ``locals()``, so ``torch.compile(fullgraph=True)`` traces a forward (a frame
    whose closures hold cells not yet assigned cannot be read whole)."""
    return Conditions.from_kwargs(dict(context=context, context_mask=context_mask, prepend_embeds=prepend_embeds,
                                       prepend_mask=prepend_mask, condition=condition, condition_mask=condition_mask,
                                       **conditions))


def _check_layers(attn_layers) -> None:
    if not isinstance(attn_layers, AttentionLayers):
        raise TypeError(
            f"attn_layers must be an Encoder, Decoder, CrossAttender or AttentionLayers, got {type(attn_layers).__name__}"
        )


def _check_tokens(x, name: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be token ids of shape (b, n), got {getattr(x, 'shape', type(x))}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype}")


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
    return x


class _Wrapper(Configurable, nn.Module):
    """Shared plumbing: positions, the optional absolute embedding, the finite-input check."""

    attn_layers: AttentionLayers

    def get_config(self) -> dict:
        """As ``Configurable.get_config``; a model built with a custom module (x-transformers' ``token_emb``,
        ``to_logits``, ``project_in``, ``project_out``) has no JSON config: a clear error instead."""
        custom = [k for k in ("token_emb", "to_logits", "project_in", "project_out")
                  if isinstance(self._sf_config.get(k), nn.Module)]
        if custom:
            raise ValueError(f"{type(self).__name__} built with a custom {', '.join(custom)} module has no JSON config "
                             "(save_pretrained / get_config): save its state_dict and rebuild it with the same modules")
        return super().get_config()

    def _init_positions(self, dim: int, max_seq_len: int | None, use_abs_pos_emb: bool, l2norm_embed: bool = False) -> None:
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0):
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self.max_seq_len = max_seq_len
        use_abs = use_abs_pos_emb and not self.attn_layers.has_relative_positions and max_seq_len is not None
        self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len, l2norm_embed=l2norm_embed) if use_abs else None

    def _init_fixed_tokens(self, dim: int, num_memory_tokens, use_cls_token: bool = False, num_cls_tokens: int = 1) -> None:
        """Learned rows placed before the sequence on the call that starts it: memory tokens, then
        class tokens (x-transformers' order). They are always real, take no absolute position, and
        are cut from the outputs."""
        num_memory_tokens = 0 if num_memory_tokens is None else num_memory_tokens
        for name, value in (("num_memory_tokens", num_memory_tokens), ("num_cls_tokens", num_cls_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        self.num_memory_tokens = num_memory_tokens
        self.memory_tokens = nn.Parameter(torch.randn(num_memory_tokens, dim)) if num_memory_tokens else None
        self.num_cls_tokens = num_cls_tokens if use_cls_token else 0
        if use_cls_token and num_cls_tokens < 1:
            raise ValueError(f"use_cls_token=True needs num_cls_tokens >= 1, got {num_cls_tokens}")
        self.cls_token = nn.Parameter(torch.randn(num_cls_tokens, dim) * 0.02) if use_cls_token else None

    @property
    def can_cache_kv(self) -> bool:
        """x-transformers' flag: whether incremental decoding may pass a cache (safeformer's KV cache keeps
        memory, class and prefix rows; recycling, which reruns the stack, cannot, nor attention that sums over
        the whole sequence: ``attn_orthog_projected_values``, ``attn_data_dependent_alibi``). Generation then
        recomputes the sequence each step."""
        if getattr(self, "recycling", False):
            return False
        return not any(getattr(blk.mixer, "orthog", False) or getattr(blk.mixer, "to_forget_gates", None) is not None
                       for blk in self.attn_layers.layers if blk.kind != "ff")

    @property
    def can_cache_kv_outside_max_seq_len(self) -> bool:
        """x-transformers' flag: no absolute position embedding bounds the length."""
        return self.pos_emb is None

    @property
    def num_fixed_tokens(self) -> int:
        return getattr(self, "num_memory_tokens", 0) + getattr(self, "num_cls_tokens", 0)

    def _positions(self, mask: Tensor | None, b: int, n: int, device, cache: KVCache | None, lead_slots: int = 0) -> Tensor:
        """Positions of the ``n`` new rows (real rows counted, continuing from the cache). ``lead_slots``:
        rows of this call before the tokens (memory, class and prefix rows), which take no absolute
        position; the tokens' absolute positions must stay below ``max_seq_len``."""
        past = 0 if cache is None else cache.length - cache.lead_slots
        tokens = n - lead_slots
        if self.pos_emb is not None and past + tokens > self.max_seq_len:
            raise ValueError(
                f"sequence of {past + tokens} token positions ({past} cached + {tokens} new) is longer than "
                f"max_seq_len={self.max_seq_len}"
            )
        return positions_from_mask(mask, n, device, offset=None if cache is None else cache.count)

    def _check_pos(self, pos, b: int, n: int, device) -> Tensor:
        """x-transformers' ``pos``: ``(n,)`` or ``(b, n)`` integer positions of the tokens."""
        if not isinstance(pos, Tensor) or pos.dtype == torch.bool or pos.is_floating_point() or pos.is_complex():
            raise TypeError(f"pos must be a tensor of integer positions, got {getattr(pos, 'dtype', type(pos))}")
        if not (pos.dim() == 1 and pos.shape[0] == n) and not (pos.dim() == 2 and tuple(pos.shape) in ((b, n), (1, n))):
            raise ValueError(f"pos must have shape (n,) = ({n},) or (b, n) = ({b}, {n}), got {tuple(pos.shape)}")
        if pos.device != device:
            raise ValueError(f"pos is on {pos.device}, expected {device}")
        if pos.numel() and bool((pos < 0).any()):
            raise ValueError("pos holds negative positions")
        if self.pos_emb is not None and pos.numel() and bool((pos >= self.max_seq_len).any()):
            raise ValueError(f"pos holds position {int(pos.max())}, outside the absolute embedding's "
                             f"[0, max_seq_len={self.max_seq_len})")
        return pos if pos.dim() == 2 else pos[None]

    def _check_conditions(self, conds: Conditions, check: bool) -> Conditions:
        """The context's rank, dtype and mask here (the stack checks the rest); with ``check``, NaN/inf at
        real positions of every kind of condition."""
        context, context_mask = conds.context, conds.context_mask
        if context is not None:
            if not isinstance(context, Tensor) or context.dim() != 3:
                raise ValueError(f"context must have shape (b, j, dim_context), got {getattr(context, 'shape', type(context))}")
            if not context.is_floating_point():
                raise TypeError(f"context must be a floating-point tensor, got dtype {context.dtype}")
        if context is not None and context_mask is not None:
            validate_mask(context_mask, "context_mask", shape=tuple(context.shape[:2]), device=context.device)
        if check:
            conds.check_finite()
        return conds

    def _run(self, x, mask, conds: Conditions, attn_mask, cache, return_cache, *, pos=None, return_hiddens=False):
        """Positions, the fixed rows and the prefix, the stack. Returns ``(h (b, m + n, c), new cache or
        None, mask (b, m + n) or None, m, fixed outputs (b, F, c) or None, intermediates or None, the
        unpadded plan or None)``."""
        b, n = x.shape[:2]
        m = 0
        prepend_embeds, prepend_mask = conds.prepend_embeds, conds.prepend_mask
        if cache is not None:  # the cache is input: checked before the wrapper reads its rows (lead, positions)
            kinds = self.attn_layers.layer_kinds
            KVCache.check(cache, x, kinds.count("self"), kinds.count("cross"))
        if pos is not None:
            if prepend_embeds is not None or (cache is None and self.num_fixed_tokens):
                raise ValueError("pos (custom positions) cannot be combined with prepend_embeds, memory tokens or "
                                 "class tokens: it gives positions to the tokens only")
            pos = self._check_pos(pos, b, n, x.device)
        if prepend_mask is not None and prepend_embeds is None:
            raise ValueError("prepend_mask was given without prepend_embeds; pass prepend_embeds=... as well")
        if prepend_embeds is not None:
            if cache is not None:
                raise ValueError("prepend_embeds with a cache: the prefix belongs to the first call, the one that "
                                 "builds the cache (the cache keeps it)")
            if attn_mask is not None:
                raise ValueError("prepend_embeds and attn_mask cannot be combined (attn_mask covers the tokens only)")
            dim = self.attn_layers.dim
            check_condition_tensor(prepend_embeds, "prepend_embeds", (b, None, dim), x.device,
                                   shape_text=f"(b={b}, m, dim={dim})")
            m = prepend_embeds.shape[1]
            if prepend_mask is not None:
                validate_mask(prepend_mask, "prepend_mask", shape=(b, m), device=x.device)
            if mask is not None or prepend_mask is not None:
                ones = lambda k: torch.ones(b, k, dtype=torch.bool, device=x.device)  # noqa: E731
                mask = torch.cat((ones(m) if prepend_mask is None else prepend_mask, ones(n) if mask is None else mask), 1)
            x = torch.cat((prepend_embeds.to(x.dtype), x), dim=1)  # (b, m + n, c): masked rows selected away below
        fixed = self.num_fixed_tokens if cache is None else 0  # memory and class tokens: the first call only
        if fixed:
            if attn_mask is not None:
                raise ValueError("attn_mask cannot be combined with memory or class tokens (it covers the tokens only)")
            rows = [t for t in (getattr(self, "memory_tokens", None), getattr(self, "cls_token", None)) if t is not None]
            x = torch.cat((torch.cat(rows).to(x.dtype)[None].expand(b, -1, -1), x), dim=1)  # (b, F + m + n, c)
            if mask is not None:
                mask = torch.cat((torch.ones(b, fixed, dtype=torch.bool, device=x.device), mask), dim=1)
        lead_slots = fixed + m  # memory, class and prefix rows: before the tokens, no absolute position
        positions = self._positions(mask, b, lead_slots + n, x.device, cache, lead_slots)
        if cache is None:  # the real rows before the tokens, per sample: the tokens' positions start after them
            lead = positions.new_full((b,), lead_slots) if mask is None else mask[:, :lead_slots].sum(1)
        else:
            lead = cache.lead if cache.lead is not None else positions.new_zeros(b)
        if pos is not None:
            positions = pos
        if self.pos_emb is not None:  # tokens only, numbered from 0 (x-transformers' convention)
            abs_pos = positions if pos is not None else (positions - lead[:, None]).clamp(min=0)
            pe = self.pos_emb(abs_pos).to(x.dtype)
            x = x + pe if not lead_slots else torch.cat((x[:, :lead_slots], x[:, lead_slots:] + pe[:, lead_slots:]), dim=1)
        x = self.emb_dropout(x)
        # the unpadded path decided once (one host sync): the stack runs it, the output head reuses it
        plan = self.attn_layers.plan_unpadded(
            mask, cache=cache, return_cache=return_cache, attn_mask=attn_mask, return_hiddens=return_hiddens)
        out = self.attn_layers(
            x, mask=mask, attn_mask=attn_mask, positions=positions, cache=cache, **conds.stack_kwargs(),
            return_cache=return_cache, return_hiddens=return_hiddens, unpadded_plan=plan,
        )
        out = out if isinstance(out, tuple) else (out,)
        h = out[0]
        new_cache = out[1] if return_cache else None
        intermediates = out[-1] if return_hiddens else None
        for c in (new_cache, None if intermediates is None else intermediates.cache):
            if c is not None:  # the cache remembers the rows before the tokens
                c.lead = lead if lead.dim() == 1 else lead.expand(b)
                c.lead_slots = lead_slots if cache is None else cache.lead_slots
        fixed_out = None
        if fixed:
            fixed_out, h = h[:, :fixed], h[:, fixed:]
            mask = None if mask is None else mask[:, fixed:]
            if intermediates is not None and self.num_memory_tokens:
                intermediates.memory_tokens = fixed_out[:, :self.num_memory_tokens]
        return h, new_cache, mask, m, fixed_out, intermediates, plan


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


def _flag(v, name: str) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")


def _check_xt_head_options(token_emb, to_logits, tie_embedding, return_only_embed, mixture_of_softmax, mos_k,
                           recycling, recycle_steps, use_cls_token, average_pool_embed, squeeze_out_last_dim,
                           add_continuous_pred_head, input_not_include_cache) -> None:
    """The x-transformers wrapper options' types and the combinations safeformer refuses (S9)."""
    for name, mod in (("token_emb", token_emb), ("to_logits", to_logits)):
        if mod is not None and not isinstance(mod, nn.Module):
            raise TypeError(f"{name} must be an nn.Module, got {type(mod).__name__}")
    for v, name in ((squeeze_out_last_dim, "squeeze_out_last_dim"), (mixture_of_softmax, "mixture_of_softmax"),
                    (add_continuous_pred_head, "add_continuous_pred_head"), (recycling, "recycling"),
                    (input_not_include_cache, "input_not_include_cache")):
        _flag(v, name)
    if token_emb is not None and tie_embedding:
        raise ValueError("tie_embedding=True ties the output to the built-in nn.Embedding: not with a custom token_emb")
    if to_logits is not None and (tie_embedding or return_only_embed):
        raise ValueError("to_logits (a custom output head) cannot be combined with tie_embedding or return_only_embed")
    if mixture_of_softmax:
        if isinstance(mos_k, bool) or not isinstance(mos_k, int) or mos_k < 1:
            raise ValueError(f"mixture_of_softmax_k must be a positive integer, got {mos_k!r}")
        if return_only_embed:
            raise ValueError("mixture_of_softmax needs an output head (not return_only_embed)")
        if use_cls_token or average_pool_embed:
            raise ValueError("mixture_of_softmax mixes per-position softmaxes: not with use_cls_token or average_pool_embed")
    if recycling and (isinstance(recycle_steps, bool) or not isinstance(recycle_steps, int) or recycle_steps < 1):
        raise ValueError(f"train_max_recycle_steps must be a positive integer, got {recycle_steps!r}")


class TransformerWrapper(_Wrapper):
    """Token ids in, logits out.

    Args:
        num_tokens: vocabulary size v.
        max_seq_len: longest sequence (for the absolute position embedding).
        attn_layers: an ``Encoder``, ``Decoder``, ``CrossAttender`` or ``AttentionLayers``.
        emb_dropout: dropout on the embeddings.
        use_abs_pos_emb: learned absolute positions (skipped when the layers use rotary or ALiBi).
        tie_embedding: the output projection shares the token embedding's weights.
        return_only_embed: no output projection: the model returns hidden states (an encoder).
        logits_dim: output size (default ``num_tokens``).
        tie_embedding_scale: with ``tie_embedding``, logits are ``h @ E.T * tie_embedding_scale``
            (default 1; x-transformers' default is ``dim ** -0.5``, which ``from_x_transformers`` keeps).
        num_memory_tokens: learned memory (register) tokens placed before the sequence on the call that
            starts it: every position may attend to them; they take no absolute position and are cut
            from the output (``LayerIntermediates.memory_tokens`` holds theirs).
        l2norm_embed: L2-normalise the token (and absolute position) embeddings, initialised with std
            1e-5 (x-transformers' ``l2norm_embed``).
        average_pool_embed: the output is the masked mean over real positions, projected by the head:
            ``(b, logits_dim)`` (a fully padded sample pools to 0, never NaN).
        use_cls_token: learned class token(s) before the sequence (after the memory tokens); the output
            is theirs: ``(b, logits_dim)`` for one, ``(b, num_cls_tokens, logits_dim)`` for several.
        num_cls_tokens: how many class tokens.
        check_finite: by default, check that real positions of float inputs (``context``) are finite
            and raise ``ValueError`` naming the argument otherwise (S9); costs a device sync.

    Example:
        >>> model = TransformerWrapper(num_tokens=256, max_seq_len=128,
        ...     attn_layers=Decoder(dim=64, depth=2, heads=4, cross_attend=True))
        >>> logits = model(tokens, mask=mask, context=ctx, context_mask=ctx_mask)  # (b, n, 256)
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        max_seq_len: int,
        attn_layers: AttentionLayers,
        emb_dropout: float = 0.0,
        use_abs_pos_emb: bool = True,
        tie_embedding: bool = False,
        logits_dim: int | None = None,
        return_only_embed: bool = False,
        check_finite: bool = False,
        tie_embedding_scale: float | None = None,
        num_memory_tokens: int | None = None,
        l2norm_embed: bool = False,
        average_pool_embed: bool = False,
        use_cls_token: bool = False,
        num_cls_tokens: int = 1,
        token_emb: nn.Module | None = None,
        to_logits: nn.Module | None = None,
        squeeze_out_last_dim: bool = False,
        mixture_of_softmax: bool = False,
        mixture_of_softmax_k: int = 4,
        add_continuous_pred_head: bool = False,
        recycling: bool = False,
        train_max_recycle_steps: int = 4,
        input_not_include_cache: bool = False,
        **aliases,
    ):
        if aliases:  # other spellings through the one table (unknown names get suggestions)
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            TransformerWrapper.__init__(self, **translate_aliases(type(self).__name__, given, aliases, WRAPPER_ALIASES))
            return
        super().__init__()
        _check_layers(attn_layers)
        self._set_config_from(TransformerWrapper.__init__, locals())
        if tie_embedding_scale is not None and not tie_embedding:
            raise ValueError("tie_embedding_scale was given without tie_embedding=True")
        if tie_embedding_scale is not None and (isinstance(tie_embedding_scale, bool) or not isinstance(
                tie_embedding_scale, (int, float)) or not math.isfinite(tie_embedding_scale)):
            raise ValueError(f"tie_embedding_scale must be a finite number, got {tie_embedding_scale!r}")
        if average_pool_embed and use_cls_token:
            raise ValueError("choose one of average_pool_embed and use_cls_token, not both")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if logits_dim is not None and (isinstance(logits_dim, bool) or not isinstance(logits_dim, int) or logits_dim <= 0):
            raise ValueError(f"logits_dim must be a positive integer or None (= num_tokens), got {logits_dim!r}")
        if tie_embedding and logits_dim not in (None, num_tokens):
            raise ValueError("tie_embedding=True needs logits_dim == num_tokens")
        _check_xt_head_options(token_emb, to_logits, tie_embedding, return_only_embed, mixture_of_softmax,
                               mixture_of_softmax_k, recycling, train_max_recycle_steps, use_cls_token,
                               average_pool_embed, squeeze_out_last_dim, add_continuous_pred_head,
                               input_not_include_cache)
        dim = attn_layers.dim
        self.num_tokens = num_tokens
        self.attn_layers = attn_layers
        self.custom_token_emb = token_emb is not None
        self.token_emb = nn.Embedding(num_tokens, dim) if token_emb is None else token_emb
        self.l2norm_embed = l2norm_embed
        if l2norm_embed and not self.custom_token_emb:
            nn.init.normal_(self.token_emb.weight, std=1e-5)
        self._init_positions(dim, max_seq_len, use_abs_pos_emb, l2norm_embed)
        self._init_fixed_tokens(dim, num_memory_tokens, use_cls_token, num_cls_tokens)
        self.average_pool_embed = average_pool_embed
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.tie_embedding = tie_embedding
        self.tie_embedding_scale = 1.0 if tie_embedding_scale is None else float(tie_embedding_scale)
        self.return_only_embed = return_only_embed
        has_head = not (tie_embedding or return_only_embed)
        self.custom_to_logits = to_logits is not None
        if to_logits is not None:
            self.to_logits = to_logits
        else:
            self.to_logits = nn.Linear(dim, num_tokens if logits_dim is None else logits_dim, bias=False) if has_head else None
        self.check_finite = check_finite
        self.squeeze_out_last_dim = squeeze_out_last_dim
        # mixture of softmaxes (x-transformers' mixture_of_softmax): k heads' softmaxes mixed per position; the
        # output is then log-probabilities
        self.output_is_log_prob = mixture_of_softmax
        # (a Sequential, as in x-transformers: the same state-dict keys, to_mixture.0.weight)
        self.to_mixture = nn.Sequential(nn.Linear(dim, dim * mixture_of_softmax_k, bias=False)) if mixture_of_softmax else None
        self.combine_mixture = nn.Linear(dim, mixture_of_softmax_k, bias=False) if mixture_of_softmax else None
        self.mixture_of_softmax_k = mixture_of_softmax_k
        self.add_continuous_pred_head = add_continuous_pred_head
        self.to_next_embed_pred = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.SiLU(), nn.Linear(dim, dim, bias=False)) \
            if add_continuous_pred_head else None
        self.recycling = recycling
        self.recycled_proj = nn.Linear(dim, dim, bias=False) if recycling else None
        self.train_max_recycle_steps = train_max_recycle_steps
        self.input_not_include_cache = input_not_include_cache
        if self.custom_token_emb and hasattr(self.token_emb, "init_"):  # x-transformers calls it on construction
            self.token_emb.init_()

    @checked_once
    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        return_embeddings: bool = False,
        return_pooled: bool = False,
        cache: KVCache | None = None,
        return_cache: bool = False,
        check_finite: bool | None = None,
        prepend_embeds: Tensor | None = None,
        prepend_mask: Tensor | None = None,
        excise_prepend_embeds: bool = False,
        condition: Tensor | None = None,
        condition_mask: Tensor | None = None,
        pos: Tensor | None = None,
        seq_start_pos: Tensor | None = None,
        return_intermediates: bool = False,
        return_attn: bool = False,
        return_hiddens: bool = False,
        cache_age: int = 1,
        token_emb_kwargs: dict | None = None,
        to_logits_kwargs: dict | None = None,
        return_next_embed_pred: bool = False,
        recycle_steps: int | None = None,
        input_not_include_cache: bool | None = None,
        **conditions,
    ):
        """Run the model.

        Args:
            x: ``(b, n)`` token ids. Ids at padded positions are never looked up (any value is fine).
            mask: ``(b, n)`` bool padding mask, True = real token.
            context: ``(b, j, c_ctx)`` for cross-attention (``j`` may be 0), or ``None``.
            context_mask: ``(b, j)`` bool; an all-False row drops that sample's condition exactly.
            attn_mask: extra self-attention mask ``(b, n, n)`` / ``(n, n)`` (True = may attend).
            return_embeddings: return hidden states ``(b, n, c)`` instead of logits.
            return_pooled: return the mean of hidden states over real positions, ``(b, c)``; a fully
                padded sample gives 0, not NaN (S8).
            cache: a ``KVCache`` from an earlier call; ``x`` holds only the new tokens. Or (x-transformers'
                protocol) the ``LayerIntermediates`` of an earlier ``return_intermediates=True`` call: ``x`` (and
                ``mask``, ``pos``) then holds the whole sequence so far or only the new tokens, the last
                ``cache_age`` (default 1) being new; only those are computed and returned.
            return_cache: also return the updated ``KVCache``.
            check_finite: override the model's ``check_finite`` for this call.
            prepend_embeds: ``(b, m, dim)`` a prefix of embeddings placed before the tokens (prefix
                conditioning, as in x-transformers). Only on a call without a cache.
            prepend_mask: ``(b, m)`` bool, True = real prefix row. Masked rows are padding: selected
                away, not counted in positions, so an all-False row is exactly no prefix and a padded
                prefix equals the shorter prefix alone.
            excise_prepend_embeds: return outputs for the tokens only, ``(b, n, ...)``; by default
                the prefix positions come first, ``(b, m + n, ...)`` (padded prefix rows are 0).
            condition, condition_mask: the adaptive-norm condition ``(b, K)`` and which samples keep
                it ``(b,)`` (see ``AttentionLayers.forward``).
            pos: ``(n,)`` or ``(b, n)`` integer positions of the tokens, for the absolute embedding and
                for rotary / ALiBi (x-transformers' ``pos``); by default real tokens are counted.
            seq_start_pos: ``(b,)`` where each sample starts (x-transformers' ``seq_start_pos``): the
                positions before it are left padding (combined with ``mask``), whatever they hold.
            return_intermediates: also return a ``LayerIntermediates`` (hidden states entering each
                layer, attention weights of every attention block, memory tokens' outputs). Runs the
                explicit attention path (float32 weights, ``(b, h, i, j)`` memory).
            return_attn: also return the list of attention weights ``(b, h, i, j)`` (float32; padded
                queries, dead rows and masked keys exactly 0).
            return_hiddens: the same as ``return_intermediates``.
            token_emb_kwargs, to_logits_kwargs: keywords for a custom ``token_emb`` / ``to_logits`` module.
            return_next_embed_pred: with ``add_continuous_pred_head``, return ``(out, (next_embed_pred,
                initial_embeds))``: the head's prediction of the next position's embedding ``(b, n, c)`` and
                the embeddings entering the stack (x-transformers' ``init_embed``; padded rows 0).
            recycle_steps: with ``recycling``, how many times the stack runs (default: a random number in
                ``[1, train_max_recycle_steps]`` in training; needed in eval mode).
            input_not_include_cache: with a ``LayerIntermediates`` cache, ``x`` holds only the new positions
                (all of them new; x-transformers' option); default the model's ``input_not_include_cache``.

        Returns:
            logits ``(b, n, v)`` (or embeddings / pooled; ``(b, v)`` with ``average_pool_embed`` or one
            class token), then the cache if ``return_cache``, then the intermediates if
            ``return_intermediates`` / ``return_hiddens``, or the attention weights if ``return_attn``.
        """
        conditions = condition_kwargs("TransformerWrapper.forward", conditions)
        x = _token_ids(x, "x")
        b, n = x.shape
        self._check_xt_call(token_emb_kwargs, to_logits_kwargs, return_next_embed_pred, recycle_steps, cache,
                            return_cache)
        if input_not_include_cache is None:
            input_not_include_cache = self.input_not_include_cache
        _flag(input_not_include_cache, "input_not_include_cache")
        if input_not_include_cache and isinstance(cache, LayerIntermediates) and cache_age == 1:
            cache_age = n  # every position of x is new
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
        if seq_start_pos is not None:
            mask = _start_mask(seq_start_pos, mask, b, n, x.device, offset=_cached_slots(cache, n, cache_age),
                               incremental=input_not_include_cache)
        cache, keep = resolve_cache(cache, n, cache_age, lead_slots=True)
        if keep is not None:  # x-transformers' protocol: the last cache_age positions are new
            x, mask, pos, n = x[:, -keep:], _last(mask, keep), _last(pos, keep), keep
        if mask is not None:
            x = torch.where(mask, x, torch.zeros_like(x))
        if not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active() and x.numel() \
                and bool(((x < 0) | (x >= self.num_tokens)).any()):  # (under vmap the embedding's own check)
            bad = ((x < 0) | (x >= self.num_tokens)).nonzero()[0].tolist()  # reached only on error
            raise ValueError(f"x holds token id {int(x[tuple(bad)])} at real position {tuple(bad)}, outside the "
                             f"vocabulary [0, num_tokens={self.num_tokens}); padded positions (mask False) may hold anything")
        conds = self._check_conditions(_conditions(context, context_mask, prepend_embeds, prepend_mask, condition,
                                                   condition_mask, conditions),
                                       self.check_finite if check_finite is None else check_finite)
        want_inter = return_intermediates or return_hiddens or return_attn
        emb = self._embed(x, mask, token_emb_kwargs)
        if self.recycling:
            h, new_cache, full_mask, m, fixed_out, inter, plan = self._recycle(
                emb, mask, conds, attn_mask, recycle_steps, pos, want_inter or return_next_embed_pred)
        else:
            h, new_cache, full_mask, m, fixed_out, inter, plan = self._run(
                emb, mask, conds, attn_mask, cache, return_cache,
                pos=pos, return_hiddens=want_inter or return_next_embed_pred,
            )

        def result(out):
            if self.squeeze_out_last_dim and out.shape[-1] == 1 and not (return_embeddings or self.return_only_embed
                                                                         or return_pooled):
                out = out[..., 0]
            if return_next_embed_pred:
                hid = h[:, m:] if excise_prepend_embeds and m else h
                init = inter.hiddens[0] if inter.hiddens else None
                if init is not None and self.num_fixed_tokens and cache is None:
                    init = init[:, self.num_fixed_tokens:]
                if init is not None and excise_prepend_embeds and m:
                    init = init[:, m:]
                out = (out, (self.to_next_embed_pred(hid), init))
            extra = ((new_cache,) if return_cache else ()) + (
                (inter,) if return_intermediates or return_hiddens else (inter.attn_maps,) if return_attn else ())
            return (out, *extra) if extra else out

        if return_pooled:
            return result(masked_mean(h, full_mask, dim=1))  # (b, c), prefix included
        if self.average_pool_embed:  # the head on the mean of the real positions (prefix included)
            pooled = masked_mean(h, full_mask, dim=1)  # (b, c): a fully padded sample pools to 0
            return result(pooled if return_embeddings or self.return_only_embed else self._head(pooled, **(to_logits_kwargs or {})))
        if self.cls_token is not None and fixed_out is not None:
            cls = fixed_out[:, self.num_memory_tokens:]  # (b, C, c)
            cls = cls[:, 0] if cls.shape[1] == 1 else cls
            return result(cls if return_embeddings or self.return_only_embed else self._head(cls, **(to_logits_kwargs or {})))
        if excise_prepend_embeds and m:
            h = h[:, m:]
            full_mask = None if full_mask is None else full_mask[:, m:]
        if return_embeddings or self.return_only_embed:
            out = h
        elif self.custom_to_logits or self.to_mixture is not None:
            out = self._head(h, **(to_logits_kwargs or {}))
            if full_mask is not None:  # padded rows: exactly 0 (a custom head may add a bias)
                out = torch.where(full_mask.reshape(*full_mask.shape, *([1] * (out.dim() - 2))), out, 0.0)
        elif plan is not None and plan.n == h.shape[1]:
            # the output head on the stack's real tokens only (padded rows are exact zeros: their logits are 0)
            out = plan.unpack(self._head(plan.pack(h)))
        else:
            out = self._head(h)  # (b, n, v)
        return result(out)

    def _head(self, h: Tensor, **to_logits_kwargs) -> Tensor:
        if self.tie_embedding:
            logits = h @ self.token_emb.weight.t()
            return logits if self.tie_embedding_scale == 1.0 else logits * self.tie_embedding_scale
        if self.to_mixture is None:
            return self.to_logits(h, **to_logits_kwargs)
        # mixture of softmaxes: log(sum_k pi_k softmax(W h_k)), in float32 at least; a log-probability whose
        # every term is a softmax weight, computed as a logsumexp (never log 0 = -inf from underflow)
        acc = torch.promote_types(h.dtype, torch.float32)
        weights = self.combine_mixture(h).to(acc).log_softmax(dim=-1)  # (..., k)
        parts = self.to_mixture(h).unflatten(-1, (self.mixture_of_softmax_k, h.shape[-1]))  # (..., k, c)
        logp = self.to_logits(parts, **to_logits_kwargs).to(acc).log_softmax(dim=-1)  # (..., k, v)
        return torch.logsumexp(logp + weights[..., None], dim=-2).to(h.dtype)

    def _embed(self, x: Tensor, mask: Tensor | None, token_emb_kwargs: dict | None) -> Tensor:
        """``(b, n, c)`` token embeddings; a custom ``token_emb``'s output is checked and its padded rows zeroed."""
        if not self.custom_token_emb:
            emb = self.token_emb(x)
            return l2norm(emb) if self.l2norm_embed else emb
        emb = self.token_emb(x, **(token_emb_kwargs or {}))
        dim = self.attn_layers.dim
        if not isinstance(emb, Tensor) or tuple(emb.shape) != (*x.shape, dim) or not emb.is_floating_point():
            raise ValueError(f"token_emb must return floating-point embeddings of shape (b, n, dim) = "
                             f"({x.shape[0]}, {x.shape[1]}, {dim}), got {getattr(emb, 'shape', type(emb))}")
        return emb if mask is None else torch.where(mask[..., None], emb, 0.0)

    def _check_xt_call(self, token_emb_kwargs, to_logits_kwargs, return_next_embed_pred, recycle_steps, cache,
                       return_cache=False) -> None:
        for name, kw, custom in (("token_emb_kwargs", token_emb_kwargs, self.custom_token_emb),
                                 ("to_logits_kwargs", to_logits_kwargs, self.custom_to_logits)):
            if kw is not None and not isinstance(kw, dict):
                raise TypeError(f"{name} must be a dict, got {type(kw).__name__}")
            if kw and not custom:
                raise ValueError(f"{name} was given but the model has no custom {name[:-7]} module to receive it")
        _flag(return_next_embed_pred, "return_next_embed_pred")
        if return_next_embed_pred and not self.add_continuous_pred_head:
            raise ValueError("return_next_embed_pred=True needs add_continuous_pred_head=True")
        if recycle_steps is not None:
            if not self.recycling:
                raise ValueError("recycle_steps was given but the model was built without recycling=True")
            if isinstance(recycle_steps, bool) or not isinstance(recycle_steps, int) or recycle_steps < 1:
                raise ValueError(f"recycle_steps must be a positive integer, got {recycle_steps!r}")
        if self.recycling:
            if recycle_steps is None and not self.training:
                raise ValueError("a recycling model needs recycle_steps in eval mode (x-transformers' rule)")
            if cache is not None or return_cache:
                raise ValueError("recycling runs the whole stack several times: no KV cache (x-transformers' rule)")

    def _recycle(self, emb, mask, conds, attn_mask, steps, pos, want_inter):
        """x-transformers' recycling: the stack runs ``steps`` times, each run's input the embeddings plus
        ``recycled_proj`` of the previous run's (detached) output; only the last run takes gradients."""
        if steps is None:
            steps = int(torch.randint(1, self.train_max_recycle_steps + 1, ()).item())
        if self.num_fixed_tokens or conds.prepend_embeds is not None:
            raise ValueError("recycling with memory, class tokens or prepend_embeds is not supported")
        out = None
        for i in range(steps):
            with torch.no_grad() if i < steps - 1 else contextlib.nullcontext():
                inp = emb
                if out is not None:
                    prev = out[0].detach()  # padded rows of the stack's output are exact zeros
                    inp = emb + self.recycled_proj(prev)
                out = self._run(inp, mask, conds, attn_mask, None, False, pos=pos,
                                return_hiddens=want_inter and i == steps - 1)
        return out


def split_mean_log_var(raw: Tensor) -> tuple[Tensor, Tensor]:
    """x-transformers' probabilistic layout: ``raw (..., 2 d)`` read as ``(d, 2)`` pairs, ``(mean, log-variance)``."""
    pairs = raw.unflatten(-1, (raw.shape[-1] // 2, 2))
    return pairs[..., 0], pairs[..., 1]


def capped_log_var(log_var: Tensor) -> Tensor:
    """The log-variance capped so that its ``exp`` stays finite in its dtype (and its gradient with it)."""
    return log_var.clamp(max=math.log(torch.finfo(log_var.dtype).max) - 0.05)


def gaussian_head(raw: Tensor) -> Tensor:
    """``stack((mean, variance))`` ``(2, ..., d)`` from the head's ``raw (..., 2 d)`` (x-transformers'
    ``probabilistic`` output), the variance finite."""
    mean, log_var = split_mean_log_var(raw)
    return torch.stack((mean, capped_log_var(log_var).exp()))


class ContinuousTransformerWrapper(_Wrapper):
    """Vectors in, vectors out.

    Args:
        dim_in: input feature size (``None``: inputs already have the model width).
        dim_out: output feature size (``None``: return hidden states).
        max_seq_len: longest sequence (for the absolute position embedding); ``None`` (or 0, as in
            x-transformers): no absolute position embedding (positions then come from the stack's rotary
            or ALiBi, or there are none), and no length limit.
        attn_layers: the layer stack.
        emb_dropout, use_abs_pos_emb, check_finite: as in ``TransformerWrapper``; ``check_finite``
            checks ``x`` as well as ``context``.
        num_memory_tokens, average_pool_embed: as in ``TransformerWrapper`` (x-transformers' names);
            with ``average_pool_embed`` the output is ``(b, dim_out)``.
        probabilistic: x-transformers' Gaussian head: ``project_out`` gives ``2 * dim_out`` features, read
            interleaved as ``(mean, log-variance)`` pairs per feature, and the output is
            ``stack((mean, variance))``: ``(2, b, n, dim_out)`` (``(2, b, dim_out)`` pooled). The variance is
            ``exp(log-variance)`` with the log-variance capped just below ``log`` of the dtype's largest finite
            value (never inf). Needs ``dim_out``; ``return_embeddings`` returns the hidden states as usual.
            ``ContinuousAutoregressiveWrapper(net)`` trains such a net with the Gaussian NLL.
        project_in, project_out: x-transformers' custom modules in place of ``nn.Linear(dim_in, dim)`` and
            ``nn.Linear(dim, dim_out)``; they must act on each position alone (the KV cache and the static
            decode step run them one position at a time). ``dim_in`` is read from an ``nn.Linear``
            ``project_in`` and needed otherwise (safeformer checks the input width); ``dim_out`` likewise
            from an ``nn.Linear`` ``project_out``. Padded positions are zeroed before ``project_in`` runs.
    """

    def __init__(
        self,
        *,
        max_seq_len: int | None = None,
        attn_layers: AttentionLayers,
        dim_in: int | None = None,
        dim_out: int | None = None,
        emb_dropout: float = 0.0,
        use_abs_pos_emb: bool = True,
        check_finite: bool = False,
        num_memory_tokens: int | None = None,
        average_pool_embed: bool = False,
        probabilistic: bool = False,
        project_in: nn.Module | None = None,
        project_out: nn.Module | None = None,
        **aliases,
    ):
        if aliases:
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            ContinuousTransformerWrapper.__init__(self, **translate_aliases(type(self).__name__, given, aliases, WRAPPER_ALIASES))
            return
        super().__init__()
        _check_layers(attn_layers)
        if not isinstance(probabilistic, bool):
            raise TypeError(f"probabilistic must be a bool, got {probabilistic!r}")
        if probabilistic and dim_out is None:
            raise ValueError("probabilistic=True needs dim_out (the head gives a mean and a variance per output feature)")
        for name, mod in (("project_in", project_in), ("project_out", project_out)):
            if mod is not None and not isinstance(mod, nn.Module):
                raise TypeError(f"{name} must be an nn.Module, got {type(mod).__name__}")
        if project_in is not None and dim_in is None:
            if not isinstance(project_in, nn.Linear):
                raise ValueError("project_in that is not an nn.Linear needs dim_in: the width of the inputs it reads "
                                 "(checked on every call)")
            dim_in = project_in.in_features
        if project_out is not None and dim_out is None and isinstance(project_out, nn.Linear):
            dim_out = project_out.out_features // (2 if probabilistic else 1)
        if probabilistic and project_out is not None and isinstance(project_out, nn.Linear) \
                and project_out.out_features != 2 * dim_out:
            raise ValueError(f"probabilistic=True: project_out must give 2 * dim_out = {2 * dim_out} features "
                             f"(a mean and a log-variance per feature), got {project_out.out_features}")
        if probabilistic and dim_out is None:
            raise ValueError("probabilistic=True needs dim_out (the head gives a mean and a variance per output feature)")
        self._set_config_from(ContinuousTransformerWrapper.__init__, locals())
        dim = attn_layers.dim
        self.attn_layers = attn_layers
        self.dim_in = dim if dim_in is None else dim_in
        self.dim_out = dim_out
        self.probabilistic = probabilistic
        if project_in is not None:
            self.project_in = project_in
        else:
            self.project_in = nn.Identity() if dim_in is None else nn.Linear(dim_in, dim)
        if project_out is not None:
            self.project_out = project_out
        else:
            out_features = None if dim_out is None else dim_out * (2 if probabilistic else 1)
            self.project_out = nn.Identity() if dim_out is None else nn.Linear(dim, out_features)
        # x-transformers: no max_seq_len (or 0) means no absolute position embedding
        self._init_positions(dim, None if max_seq_len == 0 else max_seq_len, use_abs_pos_emb)
        self._init_fixed_tokens(dim, num_memory_tokens)
        self.average_pool_embed = average_pool_embed
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.check_finite = check_finite

    @checked_once
    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        return_embeddings: bool = False,
        return_pooled: bool = False,
        cache: KVCache | None = None,
        return_cache: bool = False,
        check_finite: bool | None = None,
        prepend_embeds: Tensor | None = None,
        prepend_mask: Tensor | None = None,
        excise_prepend_embeds: bool = False,
        condition: Tensor | None = None,
        condition_mask: Tensor | None = None,
        lens: Tensor | None = None,
        pos: Tensor | None = None,
        return_intermediates: bool = False,
        return_attn: bool = False,
        return_hiddens: bool = False,
        cache_age: int = 1,
        **conditions,
    ):
        """Run the model on ``x (b, n, dim_in)``; arguments as in ``TransformerWrapper.forward``;
        ``lens (b,)`` (x-transformers' name) gives right-padded lengths instead of a mask.

        Values at padded positions of ``x`` (mask False) are selected away before any use: NaN or
        inf there reaches no output and no gradient.
        """
        conditions = condition_kwargs("ContinuousTransformerWrapper.forward", conditions)
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim_in:
            raise ValueError(f"x must have shape (b, n, dim_in={self.dim_in}), got {getattr(x, 'shape', type(x))}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        b, n, _ = x.shape
        check = self.check_finite if check_finite is None else check_finite
        if lens is not None:
            if mask is not None:
                raise ValueError("pass mask or lens, not both")
            check_lengths(lens, "lens", b, max_len=n, device=x.device)
            mask = torch.arange(n, device=x.device)[None] < lens.to(x.device)[:, None]
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
        cache, keep = resolve_cache(cache, n, cache_age, lead_slots=True)
        if keep is not None:  # x-transformers' protocol: the last cache_age positions are new
            x, mask, pos, n = x[:, -keep:], _last(mask, keep), _last(pos, keep), keep
        if check:
            _check_finite(x, mask, "x")
        if mask is not None:
            x = torch.where(mask[..., None], x, 0.0)
        conds = self._check_conditions(_conditions(context, context_mask, prepend_embeds, prepend_mask, condition,
                                                   condition_mask, conditions), check)
        want_inter = return_intermediates or return_hiddens or return_attn
        h, new_cache, full_mask, m, _, inter, _ = self._run(
            self.project_in(x), mask, conds, attn_mask, cache, return_cache,
            pos=pos, return_hiddens=want_inter,
        )
        if excise_prepend_embeds and m and not (return_pooled or self.average_pool_embed):
            h = h[:, m:]
        if return_pooled:
            out = masked_mean(h, full_mask, dim=1)
        elif self.average_pool_embed:
            pooled = masked_mean(h, full_mask, dim=1)  # (b, c): a fully padded sample pools to 0
            out = pooled if return_embeddings else self.project_out(pooled)
        elif return_embeddings:
            out = h
        else:
            out = self.project_out(h)
        if self.probabilistic and not return_embeddings and not return_pooled:
            out = gaussian_head(out)
        extra = ((new_cache,) if return_cache else ()) + (
            (inter,) if return_intermediates or return_hiddens else (inter.attn_maps,) if return_attn else ())
        return (out, *extra) if extra else out
