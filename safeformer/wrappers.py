"""Wrappers: ``TransformerWrapper`` (tokens in, logits out) and ``ContinuousTransformerWrapper``
(vectors in and out). The encoder-decoder ``XTransformer`` builds on generation: ``encoder_decoder.py``.

Shape legend: b batch, n positions, j context length, c model width, v vocabulary size.
Masks: bool, True = real position / may attend (``masks.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .cache import resolve_cache
from .conditions import Conditions, check_condition_tensor, condition_kwargs
from .layers import AttentionLayers, KVCache, _last, translate_aliases
from .losses import masked_mean
from .masks import check_finite as _check_finite
from .masks import check_lengths, checked_once, validate_mask
from .modules import AbsolutePositionalEmbedding, l2norm, positions_from_mask
from .pretrained import Configurable

__all__ = ["TransformerWrapper", "ContinuousTransformerWrapper"]


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


def _start_mask(seq_start_pos, mask: Tensor | None, b: int, n: int, device) -> Tensor:
    """``mask`` with the positions before ``seq_start_pos (b,)`` marked as (left) padding."""
    t = check_lengths(seq_start_pos, "seq_start_pos", b, max_len=n, device=device)
    started = torch.arange(n, device=device)[None] >= t[:, None]  # (b, n)
    return started if mask is None else mask & started


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
        dim = attn_layers.dim
        self.num_tokens = num_tokens
        self.attn_layers = attn_layers
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.l2norm_embed = l2norm_embed
        if l2norm_embed:
            nn.init.normal_(self.token_emb.weight, std=1e-5)
        self._init_positions(dim, max_seq_len, use_abs_pos_emb, l2norm_embed)
        self._init_fixed_tokens(dim, num_memory_tokens, use_cls_token, num_cls_tokens)
        self.average_pool_embed = average_pool_embed
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.tie_embedding = tie_embedding
        self.tie_embedding_scale = 1.0 if tie_embedding_scale is None else float(tie_embedding_scale)
        self.return_only_embed = return_only_embed
        has_head = not (tie_embedding or return_only_embed)
        self.to_logits = nn.Linear(dim, num_tokens if logits_dim is None else logits_dim, bias=False) if has_head else None
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
        pos: Tensor | None = None,
        seq_start_pos: Tensor | None = None,
        return_intermediates: bool = False,
        return_attn: bool = False,
        return_hiddens: bool = False,
        cache_age: int = 1,
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

        Returns:
            logits ``(b, n, v)`` (or embeddings / pooled; ``(b, v)`` with ``average_pool_embed`` or one
            class token), then the cache if ``return_cache``, then the intermediates if
            ``return_intermediates`` / ``return_hiddens``, or the attention weights if ``return_attn``.
        """
        conditions = condition_kwargs("TransformerWrapper.forward", conditions)
        x = _token_ids(x, "x")
        b, n = x.shape
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
        if seq_start_pos is not None:
            mask = _start_mask(seq_start_pos, mask, b, n, x.device)
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
        emb = self.token_emb(x)
        if self.l2norm_embed:
            emb = l2norm(emb)
        h, new_cache, full_mask, m, fixed_out, inter, plan = self._run(
            emb, mask, conds, attn_mask, cache, return_cache,
            pos=pos, return_hiddens=want_inter,
        )

        def result(out):
            extra = ((new_cache,) if return_cache else ()) + (
                (inter,) if return_intermediates or return_hiddens else (inter.attn_maps,) if return_attn else ())
            return (out, *extra) if extra else out

        if return_pooled:
            return result(masked_mean(h, full_mask, dim=1))  # (b, c), prefix included
        if self.average_pool_embed:  # the head on the mean of the real positions (prefix included)
            pooled = masked_mean(h, full_mask, dim=1)  # (b, c): a fully padded sample pools to 0
            return result(pooled if return_embeddings or self.return_only_embed else self._head(pooled))
        if self.cls_token is not None and fixed_out is not None:
            cls = fixed_out[:, self.num_memory_tokens:]  # (b, C, c)
            cls = cls[:, 0] if cls.shape[1] == 1 else cls
            return result(cls if return_embeddings or self.return_only_embed else self._head(cls))
        if excise_prepend_embeds and m:
            h = h[:, m:]
            full_mask = None if full_mask is None else full_mask[:, m:]
        if return_embeddings or self.return_only_embed:
            out = h
        elif plan is not None and plan.n == h.shape[1]:
            # the output head on the stack's real tokens only (padded rows are exact zeros: their logits are 0)
            out = plan.unpack(self._head(plan.pack(h)))
        else:
            out = self._head(h)  # (b, n, v)
        return result(out)

    def _head(self, h: Tensor) -> Tensor:
        if self.tie_embedding:
            logits = h @ self.token_emb.weight.t()
            return logits if self.tie_embedding_scale == 1.0 else logits * self.tie_embedding_scale
        return self.to_logits(h)


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
        **aliases,
    ):
        if aliases:
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            ContinuousTransformerWrapper.__init__(self, **translate_aliases(type(self).__name__, given, aliases, WRAPPER_ALIASES))
            return
        super().__init__()
        _check_layers(attn_layers)
        self._set_config_from(ContinuousTransformerWrapper.__init__, locals())
        dim = attn_layers.dim
        self.attn_layers = attn_layers
        self.dim_in = dim if dim_in is None else dim_in
        self.project_in = nn.Identity() if dim_in is None else nn.Linear(dim_in, dim)
        self.project_out = nn.Identity() if dim_out is None else nn.Linear(dim, dim_out)
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
        extra = ((new_cache,) if return_cache else ()) + (
            (inter,) if return_intermediates or return_hiddens else (inter.attn_maps,) if return_attn else ())
        return (out, *extra) if extra else out
