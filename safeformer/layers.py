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

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attend import SelectedMask, prepare_mask
from .attention import Attention
from .block import Block, apply_norm
from .cache import AttnIntermediate, KVCache, LayerIntermediates, _dtype_differs, resolve_cache
from .conditions import adaptive_condition
from .masks import causal_mask, checked_once, validate_mask
from .modules import (
    AdaptiveLayerScale,
    AdaptiveNorm,
    DynamicTanh,
    FeedForward,
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    make_norm,
    positions_from_mask,
)
from .pretrained import Configurable
from .unpadded import UNPADDED_THRESHOLD, UnpaddedPlan, forward_unpadded, plan_unpadded

__all__ = ["KVCache", "LayerIntermediates", "AttnIntermediate", "AttentionLayers", "Encoder", "Decoder", "CrossAttender",
           "PrefixDecoder", "TransformerBlock", "UNPADDED_THRESHOLD"]


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
        rotary_interpolation_factor: positions are divided by it (x-transformers' name; at least 1).
        rotary_base_rescale_factor: the base times ``factor ** (d_rot / (d_rot - 2))`` (NTK-aware scaling,
            x-transformers' name).
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
        attn_gate_values, attn_gate_values_rank, attn_gate_values_headwise, attn_output_gate,
            attn_output_gate_rank, attn_output_gate_headwise, attn_swiglu_values, attn_low_rank_silu_gates:
            gated attention in every attention block (``Attention(gate_values=..., ...)``, x-transformers'
            names).
        attn_qk_norm_dim_scale: with ``attn_qk_norm``, learned gains per head and feature on the q/k norms,
            ``d ** -0.25`` at init (x-transformers' name: logits ``sum_e qhat_e khat_e`` at init).
        attn_value_rmsnorm: RMS-normalise each value head, gain ``1 + w`` per key/value head (x-transformers'
            ``MultiheadRMSNorm``; memory values are not normalised, as there).
        add_value_residual: every attention after the first of its kind (self or cross) mixes the first one's
            values into its own, ``lerp(v_first, v, mix)`` (x-transformers' name, ResFormer); ``mix`` is
            ``sigmoid(Linear(x))`` per position and head in self-attention (``learned_value_residual_mix``,
            default True, as there), 0.5 otherwise. Padded path only, no static decode step; not with
            ``attn_value_rmsnorm`` or ``checkpoint_layers``.
        learned_value_residual_mix: see ``add_value_residual``.
        ff_softclamp_value: softclamp the feed-forward's hidden layer before its activation (``FeedForward``).
        rotary_xpos: accepted at ``False`` only (x-transformers' xpos scaling is not supported).
        use_dynamic_tanh, dynamic_tanh_init_alpha: every norm (the final one too) is ``DynamicTanh``:
            ``tanh(a * x) * gamma + beta`` with a learned scalar ``a`` starting at ``dynamic_tanh_init_alpha``.
        attn_data_dependent_alibi, attn_data_dependent_alibi_kwargs: x-transformers' forgetting-transformer bias in
            self-attention: per position and head a log forget gate ``logsigmoid(Linear(x))`` (bias ``bias_init``,
            default 5, times ``post_log_scale``), summed between key and query (two gates, one per direction,
            without ``causal``); masked positions add nothing. Padded path only, no KV cache (decode with
            ``cache_kv=False``); not with ``alibi_pos_bias``.
        attn_orthog_projected_values, attn_orthog_projected_values_per_head: self-attention's output minus its
            projection onto the sequence's own values, over the whole sample (x-transformers' "belief
            attention"; both: the two copies concatenated into ``to_out``). Masked positions add nothing;
            padded path only, and no KV cache (decode with ``cache_kv=False``).
        pre_norm_has_final_norm: end with the final norm (x-transformers' name; ``False`` leaves the
            stream as the last residual left it, as ``TransformerBlock`` does by default).
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
        rotary_interpolation_factor: float = 1.0,
        rotary_base_rescale_factor: float = 1.0,
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
        pre_norm_has_final_norm: bool = True,
        attn_gate_values: bool = False,
        attn_gate_values_rank: int | None = None,
        attn_gate_values_headwise: bool = False,
        attn_output_gate: bool = False,
        attn_output_gate_rank: int | None = None,
        attn_output_gate_headwise: bool = False,
        attn_swiglu_values: bool = False,
        attn_low_rank_silu_gates: bool = True,
        attn_qk_norm_dim_scale: bool = False,
        attn_value_rmsnorm: bool = False,
        attn_orthog_projected_values: bool = False,
        attn_orthog_projected_values_per_head: bool = False,
        add_value_residual: bool = False,
        learned_value_residual_mix: bool = True,
        attn_data_dependent_alibi: bool = False,
        attn_data_dependent_alibi_kwargs: dict | None = None,
        ff_softclamp_value: float | None = None,
        rotary_xpos: bool = False,
        use_dynamic_tanh: bool = False,
        dynamic_tanh_init_alpha: float = 1.0,
        **aliases,
    ):
        if aliases:  # x-transformers' spellings, through the one explicit table (never prefix routing)
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            AttentionLayers.__init__(self, **translate_aliases(type(self).__name__, given, aliases, LAYER_ALIASES))
            return
        super().__init__()
        self._set_config_from(AttentionLayers.__init__, locals())
        _check_options(**self._sf_config)
        self.unpadded = unpadded
        self.checkpoint_layers = checkpoint_layers
        self.adaptive = use_adaptive_layernorm or use_adaptive_rmsnorm or use_adaptive_layerscale
        self.layer_dropout = float(layer_dropout)
        self.cross_attn_tokens_dropout = float(cross_attn_tokens_dropout)
        self.dim_condition = (dim if dim_condition is None else dim_condition) if self.adaptive else None
        if self.adaptive and adaptive_null == "learned":
            self.null_condition = nn.Parameter(torch.zeros(self.dim_condition))  # (K,)
        elif self.adaptive:
            self.register_buffer("null_condition", torch.zeros(self.dim_condition), persistent=False)
        else:
            self.null_condition = None
        self.dim = dim
        self.causal = causal
        self.has_cross = cross_attend or only_cross
        self.only_cross = only_cross
        self.dim_context = dim if dim_context is None else dim_context
        rotary_emb_dim = dim_head // 2 if rotary_emb_dim is None else rotary_emb_dim
        self.rotary = RotaryEmbedding(rotary_emb_dim, theta=rotary_theta, interpolation_factor=rotary_interpolation_factor,
                                      base_rescale_factor=rotary_base_rescale_factor) if rotary_pos_emb else None
        if alibi_pos_bias:
            self.register_buffer("alibi_slopes", alibi_slopes(heads), persistent=False)
        else:
            self.alibi_slopes = None
        self.has_relative_positions = rotary_pos_emb or alibi_pos_bias

        if add_value_residual and (attn_value_rmsnorm or checkpoint_layers):
            raise ValueError("add_value_residual cannot be combined with attn_value_rmsnorm or checkpoint_layers")
        self.add_value_residual = bool(add_value_residual)
        if rotary_xpos is not False:
            raise ValueError("rotary_xpos (x-transformers' xpos length extrapolation) is not supported; only "
                             "rotary_xpos=False is accepted")
        if attn_data_dependent_alibi and alibi_pos_bias:
            raise ValueError("choose one of alibi_pos_bias and attn_data_dependent_alibi, not both")
        first_self = [True]

        def attention(context_dim: int | None) -> Attention:
            orthog = context_dim is None  # the projection onto the sequence's own values: self-attention only
            learned_mix = bool(add_value_residual and learned_value_residual_mix and context_dim is None
                               and not first_self[0])  # x-transformers: every self-attention but the first
            first_self[0] = first_self[0] and context_dim is not None
            return Attention(
                dim, heads=heads, dim_head=dim_head, kv_heads=kv_heads, dim_context=context_dim,
                qk_norm=attn_qk_norm, dropout=attn_dropout, bias=attn_bias, backend=backend,
                num_mem_kv=attn_num_mem_kv, learned_sink=attn_head_learned_sink,
                softclamp_logits=attn_softclamp_logits, logit_softclamp_value=attn_logit_softclamp_value,
                qk_norm_eps=attn_qk_norm_eps, gate_values=attn_gate_values, gate_values_rank=attn_gate_values_rank,
                gate_values_headwise=attn_gate_values_headwise, output_gate=attn_output_gate,
                output_gate_rank=attn_output_gate_rank, output_gate_headwise=attn_output_gate_headwise,
                swiglu_values=attn_swiglu_values, low_rank_silu_gates=attn_low_rank_silu_gates,
                qk_norm_dim_scale=attn_qk_norm_dim_scale, value_rmsnorm=attn_value_rmsnorm,
                orthog_projected_values=attn_orthog_projected_values and orthog,
                orthog_projected_values_per_head=attn_orthog_projected_values_per_head and orthog,
                learned_value_residual_mix=learned_mix, causal=causal if orthog else False,
                data_dependent_alibi=attn_data_dependent_alibi and orthog,
                data_dependent_alibi_kwargs=attn_data_dependent_alibi_kwargs if attn_data_dependent_alibi and orthog else None,
            )

        adaptive_norm = use_adaptive_layernorm or use_adaptive_rmsnorm

        if use_dynamic_tanh and (adaptive_norm or use_rmsnorm):
            raise ValueError("use_dynamic_tanh replaces the norms: choose it or use_rmsnorm / adaptive norms, not both")

        def norm() -> nn.Module:
            if use_dynamic_tanh:
                return DynamicTanh(dim, init_alpha=dynamic_tanh_init_alpha)
            if adaptive_norm:
                return AdaptiveNorm(dim, self.dim_condition, rms=use_adaptive_rmsnorm, eps=norm_eps)
            return make_norm(dim, use_rmsnorm, norm_eps)

        def block(kind: str, module: nn.Module) -> Block:
            return Block(kind, norm(), module, AdaptiveLayerScale(dim, self.dim_condition) if use_adaptive_layerscale else None)

        blocks = []
        for _ in range(depth):
            if not only_cross:
                blocks.append(block("self", attention(None)))
            if self.has_cross:
                blocks.append(block("cross", attention(self.dim_context)))
            blocks.append(block("ff", FeedForward(dim, mult=ff_mult, glu=ff_glu, swish=ff_swish, dropout=ff_dropout,
                                                   softclamp_value=ff_softclamp_value)))
        self.layers = nn.ModuleList(blocks)
        self.layer_kinds = tuple(blk.kind for blk in blocks)
        self.final_norm = norm() if pre_norm_has_final_norm else nn.Identity()
        # the unpadded path packs tokens; Attention.packable says which options run on the padded path only
        self.packable = all(blk.mixer.packable for blk in blocks if blk.kind != "ff") and not self.add_value_residual
        if unpadded is True and not self.packable:
            raise ValueError("unpadded=True cannot run attn_num_mem_kv, attn_head_learned_sink, attn_softclamp_logits "
                             "attn_orthog_projected_values, attn_data_dependent_alibi or add_value_residual (they run "
                             "on the padded path); "
                             "use unpadded='auto' or False")

    def plan_unpadded(self, mask: Tensor | None, *, cache=None, return_cache: bool = False,
                      attn_mask: Tensor | None = None, return_hiddens: bool = False) -> UnpaddedPlan | None:
        """Whether (and on which real tokens) ``forward`` runs the unpadded path: see ``unpadded.py``."""
        return plan_unpadded(self.unpadded, mask, packable=self.packable, cache=cache, return_cache=return_cache,
                             attn_mask=attn_mask, return_hiddens=return_hiddens)

    @checked_once
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
        unpadded_plan: UnpaddedPlan | None = None,
        cache_age: int = 1,
        context_pos: Tensor | None = None,
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
            attn_mask: an extra self-attention mask ``(b, n, p + n)``, ``(n, p + n)`` or, per head as
                x-transformers passes it, ``(b|1, h|1, n, p + n)`` (True = may attend). A 3-d mask is per sample
                here (x-transformers reads a 3-d mask as ``(h, i, j)``: pass 4-d masks to mean per head).
            positions: ``(b, n)``, ``(1, n)`` or ``(n,)`` integer token positions (for rotary and
                ALiBi); by default the count of real tokens (see ``positions_from_mask``), continuing
                from the cache.
            condition: ``(b, K)`` for adaptive norms / layerscale (``use_adaptive_*``); ``None`` is the
                null condition for every sample.
            condition_mask: ``(b,)`` bool, False = this sample's condition is dropped (the null
                condition replaces it, whatever the row holds: NaN included).
            cache: a ``KVCache`` from an earlier call: ``x`` holds only the new positions; or
                (x-transformers' protocol) the ``LayerIntermediates`` an earlier ``return_hiddens=True`` call
                returned: ``x`` (and ``mask``, ``positions``) then holds the whole sequence so far or only the
                new positions, the last ``cache_age`` (default 1) being new; only those are computed and
                returned. The ``KVCache`` stays the canonical form (the intermediates carry one). The cache
                keeps the context (its keys/values and ``context_mask``) and the condition of the call
                that built it; they may be passed again only as the very same tensors (else
                ``ValueError``).
            return_cache: also return the updated cache.
            pos: x-transformers' name for ``positions``.
            context_pos: ``(b, j)``, ``(1, j)`` or ``(j,)`` integer positions of the context (x-transformers'
                keyword): cross-attention then rotates its queries by the tokens' positions and its keys by
                these (``rotary_pos_emb`` needed). Padded path, no KV cache.
            unpadded_plan: the ``plan_unpadded`` of this call (a wrapper computes it once to run its output
                head on the same real tokens); by default the stack plans itself.
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
        if isinstance(x, Tensor) and x.dim() == 3:
            cache, keep = resolve_cache(cache, x.shape[1], cache_age)
            if keep is not None:  # x-transformers' protocol: the new positions are the last cache_age
                x, mask, positions = _last(x, keep), _last(mask, keep), _last(positions, keep)
        check_inputs(self, x, mask, context, context_mask, cache)
        b, n, _ = x.shape
        device = x.device
        if mask is not None:
            x = torch.where(mask[..., None], x, 0.0)
        sa = self_attention_inputs(self, x, mask, cache, attn_mask, positions)
        ca = cross_attention_inputs(self, context, context_mask, cache, b)
        self_mask, causal, rotary, bias, positions = sa.mask, sa.causal, sa.rotary, sa.bias, sa.positions
        context, context_mask, cross_mask, use_cross, cached_cross = ca.context, ca.context_mask, ca.mask, ca.used, ca.cached

        cond = adaptive_condition(self, condition, condition_mask, cache, b, x)  # (b, K) or None

        cross_rotary = None
        if context_pos is not None:  # x-transformers' rotary cross-attention: keys at the context's positions
            cross_rotary = _cross_rotary(self, context_pos, context if use_cross else None, cache, return_cache,
                                         unpadded_plan, sa.rotary, x)
        if unpadded_plan is None:
            if context_pos is None:  # the rotary cross-attention runs on the padded path
                unpadded_plan = self.plan_unpadded(mask, cache=cache, return_cache=return_cache, attn_mask=attn_mask,
                                                   return_hiddens=return_hiddens)
        elif not isinstance(unpadded_plan, UnpaddedPlan) or (unpadded_plan.b, unpadded_plan.n) != (b, n) or mask is None:
            raise ValueError("unpadded_plan must be the plan_unpadded(...) of this call's mask")
        if unpadded_plan is not None:
            return forward_unpadded(self, x, unpadded_plan, positions, context if use_cross else None, context_mask, cond)

        # a cache is input too: only a cache with padding has masked slots, and what they hold (its own
        # finite projections, or whatever a user put there) is selected away by attend, not trusted
        # (masked keys and dead rows are padding, selected to 0 at the input unless attn_mask hides real positions)
        self_clean = attn_mask is None and (cache is None or cache.mask is None)
        cross_clean = not cached_cross or context_mask is None  # a new context was selected above
        self_args = dict(mask=SelectedMask(self_mask) if self_clean else self_mask, causal=causal, rotary=rotary,
                         bias=bias, return_attn=return_hiddens, _return_kv=True)
        cross_args = dict(mask=SelectedMask(cross_mask) if cross_clean else cross_mask, causal=False,
                          return_attn=return_hiddens, _return_kv=True, rotary=cross_rotary)
        recompute = self.checkpoint_layers and self.training and torch.is_grad_enabled() and not return_cache \
            and cache is None and not return_hiddens
        self_kv, cross_kv, hiddens, attn_maps = [], [], [], []
        first_values: dict = {}  # add_value_residual: the first self- and cross-attention's values (new positions)

        def run(block: Block, x: Tensor, cond: Tensor | None, past_kv=None, cached=None) -> tuple[Tensor, tuple]:
            if block.kind == "self":
                return block(x, cond, past_kv=past_kv, value_residual=first_values.get("self"), **self_args)
            if block.kind == "cross":
                vr = first_values.get("cross") if cached is None else None  # a cached context is mixed already
                return block(x, cond, None if cached is not None else context, kv=cached, value_residual=vr,
                             **cross_args)
            return block(x, cond)

        for block in self.layers:
            if return_hiddens and block.kind == self.layer_kinds[0]:  # the residual stream entering each layer
                hiddens.append(x if mask is None else torch.where(mask[..., None], x, 0.0))
            if block.kind == "cross" and not use_cross:
                continue
            if recompute:  # keeps no activations; recomputed (same RNG draws) in the backward pass
                out = checkpoint(lambda t, c, blk=block: run(blk, t, c)[0], x, cond, use_reentrant=False)
                extra = (None,)
            else:
                past_kv = cache.self_kv[len(self_kv)] if cache is not None and block.kind == "self" else None
                cached = cache.cross_kv[len(cross_kv)] if cached_cross and block.kind == "cross" else None
                out, extra = run(block, x, cond, past_kv, cached)
            if block.kind != "ff":
                (self_kv if block.kind == "self" else cross_kv).append(extra[0])
                if self.add_value_residual and block.kind not in first_values:  # its values of the new positions
                    first_values[block.kind] = extra[0][1][:, :, -n:] if block.kind == "self" else extra[0][1]
            if len(extra) > 1:  # the attention weights: padded queries' rows are 0
                attn_maps.append(extra[1] if mask is None else torch.where(mask[:, None, :, None], extra[1], 0.0))
            if self.training and self.layer_dropout > 0:  # stochastic depth: a sample skips this branch
                keep = torch.rand(b, 1, 1, device=device) >= self.layer_dropout
                out = torch.where(keep, out / (1.0 - self.layer_dropout), 0.0)
            x = x + out
        x = apply_norm(self.final_norm, x, cond)
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
        if intermediates is not None:  # the intermediates carry the cache (x-transformers' protocol)
            intermediates.cache = _new_cache(cache, mask, b, n, device, self_kv, cross_kv, sa, ca, cond, condition,
                                             condition_mask)
        if not return_cache:
            return x if intermediates is None else (x, intermediates)
        if intermediates is not None:
            return x, intermediates.cache, intermediates
        new_cache = _new_cache(cache, mask, b, n, device, self_kv, cross_kv, sa, ca, cond, condition, condition_mask)
        return x, new_cache



def _last(t, keep: int):
    """The last ``keep`` positions of ``t (b|1, n, ...)`` (``None`` stays ``None``; ``(n,)`` positions too)."""
    if t is None or not isinstance(t, Tensor):
        return t
    return t[-keep:] if t.dim() == 1 else t[:, -keep:]


def _check_options(*, dim, depth, dim_head, causal, cross_attend, only_cross, rotary_pos_emb, rotary_emb_dim,
                   alibi_pos_bias, use_adaptive_layernorm, use_adaptive_rmsnorm, use_adaptive_layerscale,
                   dim_condition, adaptive_null, layer_dropout, cross_attn_tokens_dropout, checkpoint_layers,
                   unpadded, **_) -> None:
    """``AttentionLayers``' options that must agree with each other (the modules check their own)."""
    if unpadded not in (True, False, "auto"):
        raise ValueError(f"unpadded must be True, False or 'auto', got {unpadded!r}")
    if not isinstance(checkpoint_layers, bool):
        raise TypeError(f"checkpoint_layers must be a bool, got {checkpoint_layers!r}")
    if use_adaptive_layernorm and use_adaptive_rmsnorm:
        raise ValueError("choose one of use_adaptive_layernorm and use_adaptive_rmsnorm, not both")
    adaptive = use_adaptive_layernorm or use_adaptive_rmsnorm or use_adaptive_layerscale
    # dim_condition without an adaptive option is unused, as in x-transformers (a condition passed to forward
    # is then refused: nothing would read it)
    if adaptive_null not in ("learned", "zeros"):
        raise ValueError(f"adaptive_null must be 'learned' or 'zeros', got {adaptive_null!r}")
    for name, p in (("layer_dropout", layer_dropout), ("cross_attn_tokens_dropout", cross_attn_tokens_dropout)):
        if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0):
            raise ValueError(f"{name} must be in [0, 1), got {p!r}")
    if cross_attn_tokens_dropout > 0 and not (cross_attend or only_cross):
        raise ValueError("cross_attn_tokens_dropout needs cross-attention (cross_attend=True)")
    k = (dim if dim_condition is None else dim_condition) if adaptive else None
    if adaptive and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
        raise ValueError(f"dim_condition must be a positive integer, got {k!r}")
    if dim <= 0 or depth <= 0:
        raise ValueError(f"dim and depth must be positive, got dim={dim}, depth={depth}")
    if rotary_pos_emb and alibi_pos_bias:
        raise ValueError("choose one relative position scheme: rotary_pos_emb or alibi_pos_bias, not both")
    if only_cross and causal:
        raise ValueError("only_cross=True has no self-attention, so causal=True has no meaning")
    rot = dim_head // 2 if rotary_emb_dim is None else rotary_emb_dim
    if rotary_pos_emb and not (0 < rot <= dim_head):
        raise ValueError(f"rotary_emb_dim must be in (0, dim_head={dim_head}], got {rot}")


def _new_cache(cache, mask, b: int, n: int, device, self_kv, cross_kv, sa, ca, cond, condition,
               condition_mask) -> KVCache:
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
    )


def check_inputs(stack: AttentionLayers, x, mask, context, context_mask, cache) -> None:
    """The stack's door: shapes, dtypes, devices and masks of everything ``forward`` takes (S9), once."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != stack.dim:
        raise ValueError(f"x must have shape (b, n, dim={stack.dim}), got {getattr(x, 'shape', type(x))}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    b, n = x.shape[:2]
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n), device=x.device)
    if cache is not None:
        KVCache.check(cache, x, stack.layer_kinds.count("self"), stack.layer_kinds.count("cross"))
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


def self_attention_inputs(stack: AttentionLayers, x: Tensor, mask, cache, attn_mask, positions) -> SelfAttentionInputs:
    b, n = x.shape[:2]
    device = x.device
    past = cache.length if cache is not None else 0
    # self-attention mask: built once here, passed to every block
    key_pad = None
    if mask is not None or (cache is not None and cache.mask is not None):
        old = cache.mask if cache is not None and cache.mask is not None else torch.ones(b, past, dtype=torch.bool, device=device)
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
    causal = stack.causal
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
    if stack.rotary is not None:
        angles = stack.rotary.angles(positions, dtype=x.dtype)  # (b|1, 1, n, d_rot), float32 or wider
        rotary = (angles, angles)
    bias = None
    all_positions = positions if cache is None else torch.cat(_broadcast_batch(cache.positions, positions), dim=1)
    if stack.alibi_slopes is not None:
        bias = alibi_bias(stack.alibi_slopes, positions, all_positions).to(x.dtype)  # (b|1, h, n, p + n)
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


def cross_attention_inputs(stack: AttentionLayers, context, context_mask, cache, b: int) -> CrossAttentionInputs:
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


class PrefixDecoder(AttentionLayers):
    """A prefix-LM stack (x-transformers' ``PrefixDecoder``): causal self-attention, except that the first
    ``prefix_attn_len`` positions of each sample see each other both ways.

    ``forward(x, prefix_attn_len=None, attn_mask=None, **kwargs)``: ``prefix_attn_len`` is an int or a
    ``(b,)`` integer tensor counting positions of ``x`` (padding included, as x-transformers counts);
    ``attn_mask`` is combined with the prefix mask. With a ``cache`` the new positions are causal over
    everything cached (the prefix was the first call's). Masks, padding and the cache are as
    ``AttentionLayers.forward``: a real query always sees itself, so no row of a real position is dead.
    """

    def __init__(self, **kwargs):
        _no_causal(kwargs, "PrefixDecoder")
        super().__init__(causal=False, **kwargs)
        self._sf_config.pop("causal")

    def forward(self, x: Tensor, *args, attn_mask: Tensor | None = None, prefix_attn_len=None, **kwargs):
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"x must have shape (b, n, dim={self.dim}), got {getattr(x, 'shape', type(x))}")
        b, n, device = x.shape[0], x.shape[1], x.device
        cache = kwargs.get("cache")
        past = cache.length if isinstance(cache, KVCache) else 0
        allowed = causal_mask(n, past + n, device=device).reshape(n, past + n)  # bottom-right
        if prefix_attn_len is not None and past == 0:
            if isinstance(prefix_attn_len, bool) or not isinstance(prefix_attn_len, (int, Tensor)):
                raise TypeError(f"prefix_attn_len must be an int or a (b,) integer tensor, got {type(prefix_attn_len).__name__}")
            if isinstance(prefix_attn_len, int):
                prefix_attn_len = torch.full((b,), prefix_attn_len, device=device)
            if prefix_attn_len.shape != (b,) or prefix_attn_len.is_floating_point() or prefix_attn_len.dtype == torch.bool:
                raise ValueError(f"prefix_attn_len must be an int or a (b={b},) integer tensor, got "
                                 f"{prefix_attn_len.dtype} {tuple(prefix_attn_len.shape)}")
            if bool(((prefix_attn_len < 0) | (prefix_attn_len > n)).any()):
                raise ValueError(f"prefix_attn_len must be in [0, n={n}], got {prefix_attn_len.tolist()}")
            in_prefix = torch.arange(n, device=device) < prefix_attn_len.to(device)[:, None]  # (b, n) keys
            allowed = allowed[None] | in_prefix[:, None, :]  # (b, n, n): every query sees the prefix
        if attn_mask is not None:
            validate_mask(attn_mask, "attn_mask", device=device)
            allowed = allowed & attn_mask
        if allowed.dim() == 3 and allowed.shape[0] != b:
            allowed = allowed.expand(b, -1, -1)
        return super().forward(x, *args, attn_mask=allowed, **kwargs)


class TransformerBlock(AttentionLayers):
    """x-transformers' ``TransformerBlock(dim, depth=1, pre_norm_has_final_norm=False, **options)``: an
    ``AttentionLayers`` of one layer by default, without the final norm."""

    def __init__(self, *args, **kwargs):
        if len(args) > 1:
            raise TypeError("TransformerBlock takes dim as its only positional argument")
        if args:
            if "dim" in kwargs:
                raise TypeError("TransformerBlock got dim twice")
            kwargs["dim"] = args[0]
        kwargs.setdefault("depth", 1)
        kwargs.setdefault("pre_norm_has_final_norm", False)
        super().__init__(**kwargs)
