"""Layer stacks: ``AttentionLayers`` and its presets ``Encoder``, ``Decoder``, ``CrossAttender``.

Shape legend: b batch, n new positions (queries), p cached positions, j context length,
c model width, c_ctx context width, h heads, d head dim.

Masks are built once per forward, here at the top of the stack, and passed down to every block.
Masks follow the one convention (bool, True = real / may attend):
- ``mask (b, n)``: padding of the sequence itself (becomes a ``(b, 1, 1, p + n)`` key mask, combined
  with the causal mask for a decoder only when there is padding: otherwise ``is_causal`` reaches the
  flash kernel).
- ``context_mask (b, j)``: padding of the context. An all-False row (a dropped condition) or a
  zero-length context makes every cross-attention an exact no-op for that sample (S2).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attend import prepare_mask
from .masks import causal_mask, validate_mask
from .modules import (
    AdaptiveLayerScale,
    AdaptiveNorm,
    Attention,
    FeedForward,
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    make_norm,
    positions_from_mask,
)
from .pretrained import Configurable
from .varlen import VarlenPlan, plan_varlen, varlen_layout

__all__ = ["KVCache", "LayerIntermediates", "AttnIntermediate", "AttentionLayers", "Encoder", "Decoder", "CrossAttender"]


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
        lead: ``(b,)`` real rows before the tokens (memory, class and prefix rows), set by the wrappers:
            the tokens' absolute positions start after them. ``lead_slots``: those rows' slots.

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

    @property
    def batch_size(self) -> int:
        return int(self.count.shape[0])

    @property
    def length(self) -> int:
        """p, the number of cached positions (real or padding)."""
        return self.self_kv[0][0].shape[2] if self.self_kv else int(self.positions.shape[1])

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
            condition_mask=sel(self.condition_mask), lead=sel(self.lead),
        )


@dataclass
class AttnIntermediate:
    """One attention block's weights, as x-transformers' ``Intermediates`` names them.

    Attributes:
        post_softmax_attn: ``(b, h, i, j)`` float32 weights (memory keys first); rows of padded
            queries and dead rows, and columns of masked keys, are exactly 0.
        layer_type: ``"a"`` (self-attention) or ``"c"`` (cross-attention).
    """

    post_softmax_attn: Tensor
    layer_type: str


@dataclass
class LayerIntermediates:
    """What ``return_hiddens`` / ``return_intermediates`` returns besides the output.

    Attributes:
        hiddens: the residual stream entering each layer, ``(b, n, c)`` each (padded positions 0).
        last_hidden: the output of the stack (after the final norm).
        attn_intermediates: one ``AttnIntermediate`` per attention block that ran, in order.
        cache: the ``KVCache`` when ``return_cache`` was asked too.
        memory_tokens: the memory tokens' outputs ``(b, M, c)`` (set by the wrapper).
    """

    hiddens: list[Tensor] = field(default_factory=list)
    last_hidden: Tensor | None = None
    attn_intermediates: list[AttnIntermediate] = field(default_factory=list)
    cache: KVCache | None = None
    memory_tokens: Tensor | None = None

    @property
    def attn_maps(self) -> list[Tensor]:
        """The ``post_softmax_attn`` of every attention block."""
        return [a.post_softmax_attn for a in self.attn_intermediates]


# x-transformers' spelling -> safeformer's name (or a function of the value giving {name: value}); None:
# accepted and ignored (what it chose is automatic here). The README's "Moving from x-transformers" table
# lists them. Only options safeformer supports are here: anything else is an unknown keyword.
LAYER_ALIASES: dict[str, object] = {
    "attn_dim_head": "dim_head",
    "attn_kv_heads": "kv_heads",
    "attn_one_kv_head": lambda v: {"kv_heads": 1} if v else {},
    "cross_attn_dim_context": "dim_context",
    "attn_flash": None,
}


_DEFAULT = object()


def owner_cls(owner: str):
    from .pretrained import _REGISTRY

    return _REGISTRY.get(owner, AttentionLayers)


def _defaults(cls) -> dict:
    import inspect

    for klass in cls.__mro__:  # the first __init__ with named parameters (Encoder & co. pass **kwargs on)
        params = inspect.signature(klass.__init__).parameters
        if any(p.kind == p.KEYWORD_ONLY for p in params.values()):
            return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    return {}


def translate_aliases(owner: str, given: dict, aliases: dict, table: dict) -> dict:
    """``given`` (the canonical arguments as bound) updated with ``aliases`` translated through ``table``.

    Raises:
        TypeError: an unknown keyword (the closest valid names suggested), or one option given twice
            under two spellings.
    """
    import difflib

    out = dict(given)
    for key, value in aliases.items():
        if key not in table:
            valid = sorted(set(given) | set(table))
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}{hint}")
        target = table[key]
        if target is None:
            continue
        updates = target(value) if callable(target) else {target: value}
        if "_unsupported" in updates:
            raise TypeError(f"{owner}: x-transformers' option {updates['_unsupported']} is not supported by safeformer")
        defaults = _defaults(owner_cls(owner))
        for name, v in updates.items():
            if name in given and given[name] != defaults.get(name, _DEFAULT):  # also set under its own name
                raise TypeError(f"{owner}: {name!r} is given twice, as {name!r} and as {key!r}")
            out[name] = v
    return out


# the padding fraction from which "auto" runs the stack on real tokens only: measured with
# `python benchmarks/unpadded.py --sweep` (benchmarks/results/unpadded_threshold.md), the unpadded path
# already wins at 6-12% padding on the CPU (0.95x / 0.89x the padded path's step time)
UNPADDED_THRESHOLD = 0.1


class AttentionLayers(Configurable, nn.Module):
    """A pre-norm stack of attention and feed-forward blocks.

    Args:
        dim: model width c.
        depth: number of layers; each is [self-attention] [cross-attention] feed-forward.
        heads: query heads.
        dim_head: head dim.
        kv_heads: key/value heads for grouped-query attention (default ``heads``).
        causal: causal self-attention (a decoder).
        cross_attend: add a cross-attention block to every layer (takes ``context``).
        only_cross: cross-attention without self-attention (``CrossAttender``).
        dim_context: context width c_ctx (default ``dim``).
        ff_mult: feed-forward hidden width multiplier.
        ff_glu: gated feed-forward (GEGLU; SwiGLU with ``ff_swish``).
        ff_swish: SiLU activation in the feed-forward.
        use_rmsnorm: RMSNorm instead of LayerNorm.
        norm_eps: the norms' epsilon (default 1e-5 for LayerNorm, 1e-6 for RMSNorm).
        rotary_pos_emb: rotary positions in self-attention.
        rotary_emb_dim: features per head that rotate (default ``dim_head // 2``).
        rotary_theta: rotary base.
        alibi_pos_bias: ALiBi bias in self-attention.
        attn_qk_norm: RMS-normalise queries and keys.
        attn_dropout: attention dropout.
        ff_dropout: feed-forward dropout.
        attn_bias: biases in the attention projections.
        backend: ``attend`` backend for every attention.
        use_adaptive_layernorm: every norm is an adaptive LayerNorm (DiT's AdaLN) driven by a
            per-sample ``condition (b, dim_condition)`` passed to ``forward``.
        use_adaptive_rmsnorm: the same with RMSNorm.
        use_adaptive_layerscale: gate each residual branch by the condition (AdaLN-zero style).
        dim_condition: K, the condition's width (default ``dim``).
        adaptive_null: what a dropped condition becomes (``condition_mask`` False, or no condition):
            ``"learned"`` (a learned null condition, trained with CFG dropping) or ``"zeros"``.
        layer_dropout: during training, each residual branch of each sample is skipped with this
            probability (stochastic depth); 0 at evaluation.
        cross_attn_tokens_dropout: during training, each context token is dropped (masked) with this
            probability, per sample; a sample may lose every token (a dead row: safe, adds exactly 0).
        unpadded: run norms, projections, feed-forward and residuals on the real tokens only (packed),
            attention on the padded layout: ``True``, ``False`` or ``"auto"`` (when at least
            ``UNPADDED_THRESHOLD`` of the positions are padding, in a forward without a cache). Costs one
            host sync (the size of the gather); results equal the padded path to the dtype's tolerance.
        attn_num_mem_kv: learned memory key/value pairs per attention block (self and cross), seen by
            every query (see ``Attention(num_mem_kv=...)``); with them no row is dead.
        attn_head_learned_sink: a learned per-head attention sink (``Attention(learned_sink=True)``).
        attn_softclamp_logits: softclamp the attention logits (ALiBi bias included), ``tanh(l / v) * v``
            with ``v = attn_logit_softclamp_value`` (explicit float32 attention, no fused kernel).
        attn_qk_norm_eps: the epsilon of the q/k norms of ``attn_qk_norm`` (default 1e-6).
        checkpoint_layers: activation checkpointing: during training, each block (its norm, attention
            or feed-forward, and gate) keeps no activations and is recomputed in the backward pass
            (``torch.utils.checkpoint``, non-reentrant, RNG state preserved): identical gradients,
            lower peak memory, about one more forward of compute.
    """

    def __init__(
        self,
        *,
        dim: int,
        depth: int,
        heads: int = 8,
        dim_head: int = 64,
        kv_heads: int | None = None,
        causal: bool = False,
        cross_attend: bool = False,
        only_cross: bool = False,
        dim_context: int | None = None,
        ff_mult: float = 4,
        ff_glu: bool = False,
        ff_swish: bool = False,
        use_rmsnorm: bool = False,
        norm_eps: float | None = None,
        rotary_pos_emb: bool = False,
        rotary_emb_dim: int | None = None,
        rotary_theta: float = 10000.0,
        alibi_pos_bias: bool = False,
        attn_qk_norm: bool = False,
        attn_dropout: float = 0.0,
        ff_dropout: float = 0.0,
        attn_bias: bool = False,
        backend: str = "auto",
        use_adaptive_layernorm: bool = False,
        use_adaptive_rmsnorm: bool = False,
        use_adaptive_layerscale: bool = False,
        dim_condition: int | None = None,
        adaptive_null: str = "learned",
        layer_dropout: float = 0.0,
        cross_attn_tokens_dropout: float = 0.0,
        checkpoint_layers: bool = False,
        unpadded: bool | str = "auto",
        attn_num_mem_kv: int = 0,
        attn_head_learned_sink: bool = False,
        attn_softclamp_logits: bool = False,
        attn_logit_softclamp_value: float = 50.0,
        attn_qk_norm_eps: float | None = None,
        **aliases,
    ):
        if aliases:  # x-transformers' spellings, through the one explicit table (never prefix routing)
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            AttentionLayers.__init__(self, **translate_aliases(type(self).__name__, given, aliases, LAYER_ALIASES))
            return
        super().__init__()
        self._set_config(
            dim=dim, depth=depth, heads=heads, dim_head=dim_head, kv_heads=kv_heads, causal=causal,
            cross_attend=cross_attend, only_cross=only_cross, dim_context=dim_context, ff_mult=ff_mult,
            ff_glu=ff_glu, ff_swish=ff_swish, use_rmsnorm=use_rmsnorm, norm_eps=norm_eps, rotary_pos_emb=rotary_pos_emb,
            rotary_emb_dim=rotary_emb_dim, rotary_theta=rotary_theta, alibi_pos_bias=alibi_pos_bias,
            attn_qk_norm=attn_qk_norm, attn_dropout=attn_dropout, ff_dropout=ff_dropout, attn_bias=attn_bias,
            backend=backend, use_adaptive_layernorm=use_adaptive_layernorm, use_adaptive_rmsnorm=use_adaptive_rmsnorm,
            use_adaptive_layerscale=use_adaptive_layerscale, dim_condition=dim_condition, adaptive_null=adaptive_null,
            layer_dropout=layer_dropout, cross_attn_tokens_dropout=cross_attn_tokens_dropout,
            checkpoint_layers=checkpoint_layers, unpadded=unpadded, attn_num_mem_kv=attn_num_mem_kv,
            attn_head_learned_sink=attn_head_learned_sink, attn_softclamp_logits=attn_softclamp_logits,
            attn_logit_softclamp_value=attn_logit_softclamp_value, attn_qk_norm_eps=attn_qk_norm_eps,
        )
        if unpadded not in (True, False, "auto"):
            raise ValueError(f"unpadded must be True, False or 'auto', got {unpadded!r}")
        self.unpadded = unpadded
        if not isinstance(checkpoint_layers, bool):
            raise TypeError(f"checkpoint_layers must be a bool, got {checkpoint_layers!r}")
        self.checkpoint_layers = checkpoint_layers
        if use_adaptive_layernorm and use_adaptive_rmsnorm:
            raise ValueError("choose one of use_adaptive_layernorm and use_adaptive_rmsnorm, not both")
        self.adaptive = use_adaptive_layernorm or use_adaptive_rmsnorm or use_adaptive_layerscale
        if dim_condition is not None and not self.adaptive:
            raise ValueError("dim_condition was given but nothing uses a condition; set use_adaptive_layernorm, "
                             "use_adaptive_rmsnorm or use_adaptive_layerscale")
        if adaptive_null not in ("learned", "zeros"):
            raise ValueError(f"adaptive_null must be 'learned' or 'zeros', got {adaptive_null!r}")
        for name, p in (("layer_dropout", layer_dropout), ("cross_attn_tokens_dropout", cross_attn_tokens_dropout)):
            if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0):
                raise ValueError(f"{name} must be in [0, 1), got {p!r}")
        if cross_attn_tokens_dropout > 0 and not (cross_attend or only_cross):
            raise ValueError("cross_attn_tokens_dropout needs cross-attention (cross_attend=True)")
        self.layer_dropout = float(layer_dropout)
        self.cross_attn_tokens_dropout = float(cross_attn_tokens_dropout)
        self.dim_condition = (dim if dim_condition is None else dim_condition) if self.adaptive else None
        if self.adaptive and (isinstance(self.dim_condition, bool) or not isinstance(self.dim_condition, int)
                              or self.dim_condition <= 0):
            raise ValueError(f"dim_condition must be a positive integer, got {self.dim_condition!r}")
        if self.adaptive and adaptive_null == "learned":
            self.null_condition = nn.Parameter(torch.zeros(self.dim_condition))  # (K,)
        elif self.adaptive:
            self.register_buffer("null_condition", torch.zeros(self.dim_condition), persistent=False)
        else:
            self.null_condition = None
        if dim <= 0 or depth <= 0:
            raise ValueError(f"dim and depth must be positive, got dim={dim}, depth={depth}")
        if rotary_pos_emb and alibi_pos_bias:
            raise ValueError("choose one relative position scheme: rotary_pos_emb or alibi_pos_bias, not both")
        if only_cross and causal:
            raise ValueError("only_cross=True has no self-attention, so causal=True has no meaning")
        self.dim = dim
        self.causal = causal
        self.has_cross = cross_attend or only_cross
        self.only_cross = only_cross
        self.dim_context = dim if dim_context is None else dim_context
        rotary_emb_dim = dim_head // 2 if rotary_emb_dim is None else rotary_emb_dim
        if rotary_pos_emb and not (0 < rotary_emb_dim <= dim_head):
            raise ValueError(f"rotary_emb_dim must be in (0, dim_head={dim_head}], got {rotary_emb_dim}")
        self.rotary = RotaryEmbedding(rotary_emb_dim, theta=rotary_theta) if rotary_pos_emb else None
        if alibi_pos_bias:
            self.register_buffer("alibi_slopes", alibi_slopes(heads), persistent=False)
        else:
            self.alibi_slopes = None
        self.has_relative_positions = rotary_pos_emb or alibi_pos_bias

        def attention(context_dim: int | None) -> Attention:
            return Attention(
                dim, heads=heads, dim_head=dim_head, kv_heads=kv_heads, dim_context=context_dim,
                qk_norm=attn_qk_norm, dropout=attn_dropout, bias=attn_bias, backend=backend,
                num_mem_kv=attn_num_mem_kv, learned_sink=attn_head_learned_sink,
                softclamp_logits=attn_softclamp_logits, logit_softclamp_value=attn_logit_softclamp_value,
                qk_norm_eps=attn_qk_norm_eps,
            )

        adaptive_norm = use_adaptive_layernorm or use_adaptive_rmsnorm

        def norm() -> nn.Module:
            if adaptive_norm:
                return AdaptiveNorm(dim, self.dim_condition, rms=use_adaptive_rmsnorm, eps=norm_eps)
            return make_norm(dim, use_rmsnorm, norm_eps)

        def block(module: nn.Module) -> nn.ModuleList:
            parts = [norm(), module]
            if use_adaptive_layerscale:
                parts.append(AdaptiveLayerScale(dim, self.dim_condition))
            return nn.ModuleList(parts)

        kinds, blocks = [], []
        for _ in range(depth):
            if not only_cross:
                kinds.append("self")
                blocks.append(block(attention(None)))
            if self.has_cross:
                kinds.append("cross")
                blocks.append(block(attention(self.dim_context)))
            kinds.append("ff")
            blocks.append(block(FeedForward(dim, mult=ff_mult, glu=ff_glu, swish=ff_swish, dropout=ff_dropout)))
        self.layer_kinds = tuple(kinds)
        self.layers = nn.ModuleList(blocks)
        self.final_norm = norm()
        # the unpadded path packs tokens; memory keys, sinks and softclamp run on the padded path only
        self.packable = attn_num_mem_kv == 0 and not attn_head_learned_sink and not attn_softclamp_logits
        if unpadded is True and not self.packable:
            raise ValueError("unpadded=True cannot run attn_num_mem_kv, attn_head_learned_sink or "
                             "attn_softclamp_logits (they run on the padded path); use unpadded='auto' or False")

    def _check_inputs(self, x, mask, context, context_mask, cache) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (b, n, dim={self.dim}), got {getattr(x, 'shape', type(x))}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        b, n = x.shape[:2]
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
        if cache is not None:
            self._check_cache(cache, x)
            if context is not None and cache.cross_kv is None and self.has_cross:
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
            if self.only_cross and (cache is None or cache.cross_kv is None):
                raise ValueError("a CrossAttender (only_cross=True) needs a context")
            return
        if not self.has_cross:
            raise ValueError("context was given but this stack has no cross-attention; build it with cross_attend=True")
        if not isinstance(context, Tensor) or context.dim() != 3:
            raise ValueError(f"context must be a tensor of shape (b, j, dim_context), got {getattr(context, 'shape', type(context))}")
        if context.shape[0] != b or context.shape[-1] != self.dim_context:
            raise ValueError(
                f"context must have shape (b={b}, j, dim_context={self.dim_context}), got {tuple(context.shape)}"
            )
        if context.device != x.device:
            raise ValueError(f"context is on {context.device}, expected {x.device}")
        if _dtype_differs(context, x):
            raise TypeError(f"context has dtype {context.dtype}, expected {x.dtype} (the dtype of the model's hidden "
                            f"states); convert it with context.to({x.dtype})")
        if context_mask is not None:
            validate_mask(context_mask, "context_mask", shape=(b, context.shape[1]), device=x.device)

    def _check_cache(self, cache, x: Tensor) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache returned by forward(..., return_cache=True), got {type(cache).__name__}")
        n_self = sum(kind == "self" for kind in self.layer_kinds)
        if len(cache.self_kv) != n_self:
            raise ValueError(f"cache holds {len(cache.self_kv)} self-attention layers, this stack has {n_self}")
        n_cross = sum(kind == "cross" for kind in self.layer_kinds)
        if cache.cross_kv is not None and len(cache.cross_kv) != n_cross:
            raise ValueError(f"cache holds {len(cache.cross_kv)} cross-attention layers, this stack has {n_cross}")
        b = x.shape[0]
        if cache.batch_size != b:
            raise ValueError(f"cache is for a batch of {cache.batch_size} samples, x has {b}; "
                             f"use cache.index_select(...) to repeat or reorder its samples")
        if cache.count.device != x.device:
            raise ValueError(f"cache is on {cache.count.device}, expected {x.device} (the device of x)")
        p = cache.length
        if cache.mask is not None:
            validate_mask(cache.mask, "cache.mask", shape=(b, p), device=x.device)
        for k, v in cache.self_kv:
            if k.shape[0] != b or k.shape[2] != p or v.shape[:3] != k.shape[:3] or _dtype_differs(k, x):
                raise ValueError(f"cache.self_kv holds keys {tuple(k.shape)} {k.dtype} and values {tuple(v.shape)}, "
                                 f"expected (b={b}, h_kv, p={p}, d) in {x.dtype}")
        if cache.cross_kv is not None:
            for k, v in cache.cross_kv:
                if k.shape[0] != b or v.shape[:3] != k.shape[:3] or _dtype_differs(k, x):
                    raise ValueError(f"cache.cross_kv holds keys {tuple(k.shape)} {k.dtype} and values "
                                     f"{tuple(v.shape)}, expected (b={b}, h_kv, j, d) in {x.dtype}")
            if cache.context_mask is not None:
                j = cache.cross_kv[0][0].shape[2] if cache.cross_kv else cache.context_mask.shape[1]
                validate_mask(cache.context_mask, "cache.context_mask", shape=(b, j), device=x.device)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
        condition: Tensor | None = None,
        condition_mask: Tensor | None = None,
        cache: KVCache | None = None,
        return_cache: bool = False,
        return_hiddens: bool = False,
        pos: Tensor | None = None,
    ) -> Tensor | tuple:
        """Run the stack.

        Args:
            x: ``(b, n, c)``.
            mask: ``(b, n)`` padding of ``x`` (True = real). Padded positions are selected to 0 at the
                input and never reach another position.
            context: ``(b, j, c_ctx)`` for cross-attention, or ``None`` to skip the cross-attention
                blocks for the whole batch. ``j`` may be 0.
            context_mask: ``(b, j)`` padding of the context; an all-False row drops the condition
                of that sample exactly (its cross-attention adds exactly 0).
            attn_mask: an extra self-attention mask ``(b, n, p + n)`` or ``(n, p + n)`` (True = may attend).
            positions: ``(b, n)``, ``(1, n)`` or ``(n,)`` integer token positions (for rotary and
                ALiBi); by default the count of real tokens (see ``positions_from_mask``), continuing
                from the cache.
            condition: ``(b, K)`` for adaptive norms / layerscale (``use_adaptive_*``); ``None`` is the
                null condition for every sample.
            condition_mask: ``(b,)`` bool, False = this sample's condition is dropped (the null
                condition replaces it, whatever the row holds: NaN included).
            cache: a ``KVCache`` from an earlier call: ``x`` holds only the new positions. The cache
                keeps the context (its keys/values and ``context_mask``) and the condition of the call
                that built it; they may be passed again only as the very same tensors (else
                ``ValueError``).
            return_cache: also return the updated cache.
            pos: x-transformers' name for ``positions``.
            return_hiddens: also return a ``LayerIntermediates``: the residual stream entering each
                layer, the attention weights of every attention block (explicit float32 attention:
                slower, ``(b, h, i, j)`` memory), the final hidden states. Padded positions, dead rows
                and masked keys are exactly 0 in all of them.

        Returns:
            ``(b, n, c)`` hidden states after the final norm, then the cache if ``return_cache``, then
            the ``LayerIntermediates`` if ``return_hiddens``.
        """
        if pos is not None:  # x-transformers' name for positions
            if positions is not None:
                raise ValueError("pass positions or pos (x-transformers' name for it), not both")
            positions = pos
        self._check_inputs(x, mask, context, context_mask, cache)
        b, n, _ = x.shape
        device = x.device
        past = cache.length if cache is not None else 0
        if mask is not None:
            x = torch.where(mask[..., None], x, 0.0)

        # self-attention mask: built once here, passed to every block
        key_pad = None
        if mask is not None or (cache is not None and cache.mask is not None):
            old = cache.mask if cache is not None and cache.mask is not None else torch.ones(b, past, dtype=torch.bool, device=device)
            new = mask if mask is not None else torch.ones(b, n, dtype=torch.bool, device=device)
            key_pad = torch.cat((old, new), dim=1)  # (b, p + n)
        self_mask = None if key_pad is None else key_pad[:, None, None, :]  # (b, 1, 1, p + n)
        if attn_mask is not None:
            validate_mask(attn_mask, "attn_mask", device=device)
            if attn_mask.shape not in ((b, n, past + n), (n, past + n)):
                raise ValueError(f"attn_mask must have shape (b, n, p + n) = ({b}, {n}, {past + n}) or (n, p + n), got {tuple(attn_mask.shape)}")
            extra = attn_mask[:, None] if attn_mask.dim() == 3 else attn_mask[None, None]
            self_mask = extra if self_mask is None else self_mask & extra
        causal = self.causal
        if causal and self_mask is not None and n > 1:
            self_mask = self_mask & causal_mask(n, past + n, device=device)  # (b, 1, n, p + n)
            causal = False
        elif causal and past > 0 and n > 1:
            self_mask = causal_mask(n, past + n, device=device)  # (1, 1, n, p + n)
            causal = False

        if positions is None:
            positions = positions_from_mask(mask, n, device, offset=None if cache is None else cache.count)
        else:
            positions = _check_positions(positions, b, n, device)
        rotary = None
        if self.rotary is not None:
            angles = self.rotary(positions, dtype=x.dtype)  # (b|1, 1, n, d_rot), float32 or wider
            rotary = (angles, angles)
        bias = None
        all_positions = positions if cache is None else torch.cat(_broadcast_batch(cache.positions, positions), dim=1)
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes, positions, all_positions).to(x.dtype)  # (b|1, h, n, p + n)
        if self_mask is not None and self_mask.shape[2] > 1 and bias is None:
            # a mask that varies per query (padding + causal): prepared once, one kernel mask for all layers
            self_mask = prepare_mask(self_mask, dtype=x.dtype)

        # cross-attention: context padded positions are selected away before any projection
        use_cross = self.has_cross and (context is not None or (cache is not None and cache.cross_kv is not None))
        cached_cross = cache is not None and cache.cross_kv is not None
        user_context = context  # the cache keeps a reference to what the user passed (not a copy)
        if cached_cross:  # the cache answers for the context (checked: the same tensors, or none passed)
            context, context_mask = cache.context, cache.context_mask
            user_context = context
        cross_mask = None
        if cached_cross:
            cross_mask = None if context_mask is None else context_mask[:, None, None, :]
        elif context is not None:
            if self.training and self.cross_attn_tokens_dropout > 0 and context.shape[1] > 0:
                # each context token dropped per sample; a sample may lose them all (a dead row, safe)
                keep = torch.rand(b, context.shape[1], device=device) >= self.cross_attn_tokens_dropout
                context_mask = keep if context_mask is None else context_mask & keep
            if context_mask is not None:
                context = torch.where(context_mask[..., None], context, 0.0)
                cross_mask = context_mask[:, None, None, :]  # (b, 1, 1, j)

        cond = self._condition(condition, condition_mask, cache, b, x)  # (b, K) or None

        if not return_hiddens and self._use_unpadded(mask, cache, return_cache, attn_mask):
            return self._forward_unpadded(x, mask, positions, context if use_cross else None,
                                          context_mask, cross_mask, cond)

        # a cache is input too: only a cache with padding has masked slots, and what they hold (its own
        # finite projections, or whatever a user put there) is selected away by attend, not trusted
        self_clean = attn_mask is None and (cache is None or cache.mask is None)
        cross_clean = not cached_cross or context_mask is None
        drop_path = self.training and self.layer_dropout > 0
        recompute = self.checkpoint_layers and self.training and torch.is_grad_enabled() and not return_cache \
            and cache is None and not return_hiddens
        self_kv, cross_kv = [], []

        def branch(kind: str, parts: nn.ModuleList, x: Tensor, cond: Tensor | None, past_kv, cached):
            """One residual branch: norm, block, gate. Returns ``(out, kv)``."""
            norm, block = parts[0], parts[1]
            h = norm(x, cond) if cond is not None and isinstance(norm, AdaptiveNorm) else norm(x)
            kv = None
            if kind == "self":
                # masked keys and dead rows are padding, selected to 0 at the input (unless attn_mask hides
                # real positions): the block need not select its inputs again
                res = block(h, mask=self_mask, causal=causal, rotary=rotary, bias=bias, past_kv=past_kv,
                            return_attn=return_hiddens, _inputs_finite=self_clean)
            elif kind == "cross":
                res = block(h, None if cached is not None else context, mask=cross_mask, kv=cached,
                            return_attn=return_hiddens, _inputs_finite=cross_clean)  # a new context was selected above
            else:
                res = (block(h), None)
            out, kv = res[0], res[1]
            if len(res) > 2:  # the attention weights: padded queries' rows are 0
                attn_maps.append(res[2] if mask is None else torch.where(mask[:, None, :, None], res[2], 0.0))
            if len(parts) > 2:  # adaptive layerscale: the condition gates the branch
                out = parts[2](out, cond)
            return out, kv

        hiddens, attn_maps = [], []
        first_kind = self.layer_kinds[0]
        for kind, parts in zip(self.layer_kinds, self.layers):
            if return_hiddens and kind == first_kind:  # the residual stream entering each layer
                hiddens.append(x if mask is None else torch.where(mask[..., None], x, 0.0))
            if kind == "cross" and not use_cross:
                continue
            past_kv = cache.self_kv[len(self_kv)] if kind == "self" and cache is not None else None
            cached = None
            if kind == "cross" and cache is not None and cache.cross_kv is not None:
                cached = cache.cross_kv[len(cross_kv)]
            if recompute:  # keeps no activations; recomputed (same RNG draws) in the backward pass
                out = checkpoint(lambda x, c, k=kind, p=parts: branch(k, p, x, c, None, None)[0], x, cond,
                                 use_reentrant=False)
                kv = None
            else:
                out, kv = branch(kind, parts, x, cond, past_kv, cached)
            if kind == "self":
                self_kv.append(kv)
            elif kind == "cross":
                cross_kv.append(kv)
            if drop_path:  # stochastic depth: a sample skips this branch (kept ones rescaled)
                keep = torch.rand(b, 1, 1, device=device) >= self.layer_dropout
                out = torch.where(keep, out / (1.0 - self.layer_dropout), 0.0)
            x = x + out
        x = self.final_norm(x, cond) if cond is not None and isinstance(self.final_norm, AdaptiveNorm) else self.final_norm(x)
        if mask is not None:  # padded positions leave as exact zeros (and pass back no gradient)
            x = torch.where(mask[..., None], x, 0.0)
        intermediates = None
        if return_hiddens:
            kinds = [k for k in self.layer_kinds if k != "ff" and (k == "self" or use_cross)]
            intermediates = LayerIntermediates(
                hiddens=hiddens, last_hidden=x,
                attn_intermediates=[AttnIntermediate(post_softmax_attn=w, layer_type="a" if k == "self" else "c")
                                    for w, k in zip(attn_maps, kinds)],
            )
        if not return_cache:
            return x if intermediates is None else (x, intermediates)
        count = torch.full((b,), n, device=device, dtype=torch.long) if mask is None else mask.sum(1)
        if cache is not None:
            count = cache.count + count
        new_cache = KVCache(
            self_kv=self_kv, cross_kv=cross_kv if use_cross else None, mask=key_pad,
            context_mask=context_mask if use_cross else None, count=count, positions=all_positions,
            context=user_context if use_cross else None,
            condition=cond, condition_input=condition if cache is None else cache.condition_input,
            condition_mask=condition_mask if cache is None else cache.condition_mask,
        )
        if intermediates is not None:
            intermediates.cache = new_cache
            return x, new_cache, intermediates
        return x, new_cache

    def _use_unpadded(self, mask, cache, return_cache, attn_mask) -> bool:
        """Run token-wise work on the real tokens only? (``unpadded``: True, False or "auto")."""
        if mask is None or cache is not None or return_cache or attn_mask is not None or self.unpadded is False \
                or mask.numel() == 0 or not self.packable:
            return False
        if torch.compiler.is_compiling():  # the gather's size is data-dependent: the padded path compiles
            return False
        if self.unpadded is True:
            return True
        padded = 1.0 - float(mask.sum()) / max(mask.numel(), 1)  # one host sync (the gather needs one anyway)
        return padded >= UNPADDED_THRESHOLD

    def _length_groups(self, mask: Tensor, positions: Tensor, idx: Tensor) -> list:
        """Self-attention layouts of the unpadded path: samples sorted by their number of real tokens and
        split into groups (a dynamic programme over ``sum(b_g * L_g**2)`` plus a fixed cost per group);
        each group's real tokens are compacted to the left of a ``(b_g, L_g)`` layout, in order. Real tokens
        keep their order, so causal and key-padding attention see exactly the keys of the padded path.

        Returns a list of ``(tok (T_g,), dest (T_g,), b_g, L_g, key_pad (b_g, L_g), pos (b_g, L_g))``.
        """
        b, n = mask.shape
        counts = mask.sum(1).tolist()  # a second host sync: the layouts are sizes
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
        device = mask.device
        pos_p = positions.expand(b, n).reshape(-1).index_select(0, idx)  # (T,)
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
            groups.append((tok_t, dest_t, len(samples), L, key_pad, pos))
        return groups

    def _forward_unpadded(self, x, mask, positions, context, context_mask, cross_mask, cond):
        """The stack on real tokens only: norms, projections, feed-forward, residuals (and the wrapper's
        output head) run on the packed ``(T, c)`` real tokens. Self-attention runs per group of samples of
        similar length on a compacted layout (``_length_groups``; causal without a mask tensor), and
        cross-attention on the padded query layout; q, k, v are scattered into zeros, so every slot that
        is not a real token is an exact zero. Same results to the dtype's tolerance, padded outputs 0."""
        b, n, c = x.shape
        idx = mask.reshape(-1).nonzero().squeeze(1)  # (T,): a host sync (the gather's size)
        bi = torch.div(idx, n, rounding_mode="floor")  # (T,) the sample of each real token
        vplan = None if self.only_cross else self._varlen_plan(x)
        if vplan is not None and vplan.path == "varlen":  # CUDA: Flash varlen over the packed tokens, no layout
            pos_p = positions.expand(b, n).reshape(-1).index_select(0, idx)  # (T,)
            groups = ("varlen", varlen_layout(mask.sum(1).tolist(), device=x.device), pos_p, vplan)
        else:
            groups = self._length_groups(mask, positions, idx) if not self.only_cross else []
        rotary_fn = None if self.rotary is None else (lambda pos, dt: self.rotary(pos, dtype=dt))
        bias_fn = None if self.alibi_slopes is None else (lambda pos, dt: alibi_bias(self.alibi_slopes, pos, pos).to(dt))
        self_layout = (groups, self.causal, rotary_fn, bias_fn)
        xp = x.reshape(b * n, c).index_select(0, idx)  # (T, c)
        condp = None if cond is None else cond.index_select(0, bi)  # (T, K)
        ctx_pad = None
        if context is not None:  # the context's keys/values from its real tokens only
            j = context.shape[1]
            if context_mask is not None:
                cidx = context_mask.reshape(-1).nonzero().squeeze(1)
                ctx_p = context.reshape(b * j, context.shape[-1]).index_select(0, cidx)
                ctx_pad = (cidx, ctx_p, j)
            else:
                ctx_pad = (None, context.reshape(b * j, context.shape[-1]), j)
        drop_path = self.training and self.layer_dropout > 0
        recompute = self.checkpoint_layers and self.training and torch.is_grad_enabled()

        def branch(kind: str, parts: nn.ModuleList, xp: Tensor, condp: Tensor | None) -> Tensor:
            norm, block = parts[0], parts[1]
            h = norm(xp, condp) if condp is not None and isinstance(norm, AdaptiveNorm) else norm(xp)
            if kind == "self":
                out = block(h, _packed=(idx, bi, b, n, self_layout))[0]
            elif kind == "cross":
                out = block(h, ctx_pad, mask=cross_mask, _packed=(idx, bi, b, n))[0]
            else:
                out = block(h)
            if len(parts) > 2:
                out = parts[2](out, condp)
            return out

        for kind, parts in zip(self.layer_kinds, self.layers):
            if kind == "cross" and context is None:
                continue
            if recompute:
                out = checkpoint(lambda t, c_, k=kind, p=parts: branch(k, p, t, c_), xp, condp, use_reentrant=False)
            else:
                out = branch(kind, parts, xp, condp)
            if drop_path:
                keep = (torch.rand(b, device=x.device) >= self.layer_dropout).index_select(0, bi)[:, None]
                out = torch.where(keep, out / (1.0 - self.layer_dropout), 0.0)
            xp = xp + out
        final = self.final_norm
        xp = final(xp, condp) if condp is not None and isinstance(final, AdaptiveNorm) else final(xp)
        return xp.new_zeros(b * n, c).index_copy(0, idx, xp).view(b, n, c)  # padded positions exactly 0

    def _varlen_plan(self, x: Tensor) -> VarlenPlan:
        """Whether the unpadded path's self-attention runs the varlen kernel (``plan_varlen``: CUDA,
        half precision, no ALiBi, no dropout) or the compacted padded groups."""
        attn = next(parts[1] for kind, parts in zip(self.layer_kinds, self.layers) if kind == "self")
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return plan_varlen(device_type=x.device.type, dtype=dtype, head_dim=attn.dim_head, heads=attn.heads,
                           kv_heads=attn.kv_heads, causal=self.causal, has_bias=self.alibi_slopes is not None,
                           dropout_p=attn.dropout if self.training else 0.0, backend=attn.backend)

    def _condition(self, condition, condition_mask, cache, b: int, x: Tensor) -> Tensor | None:
        """The ``(b, K)`` condition of the adaptive layers: the user's, with the null condition selected in
        for dropped samples (``condition_mask`` False) or for all (``condition=None``)."""
        if not self.adaptive:
            if condition is not None or condition_mask is not None:
                raise ValueError("condition was given but this stack has no adaptive layers; build it with "
                                 "use_adaptive_layernorm=True (or use_adaptive_rmsnorm / use_adaptive_layerscale)")
            return None
        if condition_mask is not None and condition is None:
            raise ValueError("condition_mask was given without a condition; pass condition=... as well")
        if cache is not None and cache.condition is not None:
            if condition is not None and not (condition is cache.condition_input and condition_mask is cache.condition_mask):
                raise ValueError("condition was passed with a cache built with another: the cache answers for the "
                                 "condition of the call that built it (pass the very same tensors, or none)")
            return cache.condition
        null = self.null_condition.to(x.dtype)[None].expand(b, -1)  # (b, K)
        if condition is None:
            return null
        if not isinstance(condition, Tensor) or condition.dim() != 2 or tuple(condition.shape) != (b, self.dim_condition):
            raise ValueError(f"condition must have shape (b={b}, dim_condition={self.dim_condition}), got "
                             f"{getattr(condition, 'shape', type(condition))}")
        if not condition.is_floating_point():
            raise TypeError(f"condition must be a floating-point tensor, got dtype {condition.dtype}")
        if condition.device != x.device:
            raise ValueError(f"condition is on {condition.device}, expected {x.device}")
        if _dtype_differs(condition, x):
            raise TypeError(f"condition has dtype {condition.dtype}, expected {x.dtype}")
        if condition_mask is None:
            return condition
        validate_mask(condition_mask, "condition_mask", shape=(b,), device=x.device)
        return torch.where(condition_mask[:, None], condition, null)  # a dropped row is selected away


def _dtype_differs(t: Tensor, x: Tensor) -> bool:
    """``t`` cannot meet ``x`` in one matmul: dtypes differ outside autocast (which mixes them itself)."""
    return t.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type)


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


def _no_causal(kwargs: dict, name: str) -> None:
    if "causal" in kwargs:
        raise TypeError(f"{name} sets causal itself; use AttentionLayers(causal=...) to choose")


class Encoder(AttentionLayers):
    """Bidirectional ``AttentionLayers`` (every position sees every real position)."""

    def __init__(self, **kwargs):
        _no_causal(kwargs, "Encoder")
        super().__init__(causal=False, **kwargs)
        self._sf_config.pop("causal")


class Decoder(AttentionLayers):
    """Causal ``AttentionLayers``; with ``cross_attend=True`` it takes ``context`` and ``context_mask``."""

    def __init__(self, **kwargs):
        _no_causal(kwargs, "Decoder")
        super().__init__(causal=True, **kwargs)
        self._sf_config.pop("causal")


class CrossAttender(AttentionLayers):
    """Cross-attention and feed-forward blocks only (no self-attention); needs a ``context``."""

    def __init__(self, **kwargs):
        for key in ("causal", "cross_attend", "only_cross"):
            if key in kwargs:
                raise TypeError(f"CrossAttender sets {key} itself")
        super().__init__(cross_attend=True, only_cross=True, **kwargs)
        for key in ("causal", "cross_attend", "only_cross"):
            self._sf_config.pop(key)
