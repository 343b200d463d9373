"""The ``Attention`` module: projections, heads, grouped-query attention, rotary, qk-norm, memory
keys/values, sinks and softclamp, for self- and cross-attention, with a KV cache.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim, c model
width, c_ctx context width, T packed real tokens.

One seam for every path: ``_project_q`` / ``_project_kv`` compute q, k, v (positions first,
``(..., heads, d)``) and ``_output`` produces the output, for the padded path, the explicit float32 path
and the unpadded layouts (``unpadded.py``). A new option on queries, keys or outputs is written once.
Masks follow safeformer's one convention (bool, True = may attend / is real); see ``masks.py``.

The options live beside this module, each built and checked by its own builder and applied in its phase of a call:
``attention_projections`` (projections, multi-latent attention, norms, the value residual, qk-clip),
``attention_scoring`` (how logits become weights, the explicit float32 path and the kernel call),
``attention_bias`` (the relative projection bias, data-dependent ALiBi), ``attention_keys`` (live rows and keys;
the sink, memory and added keys), ``attention_output`` (the output projection, gates, orthogonal projected values)
and ``attention_calls`` (the door's checks, x-transformers' call keywords, the intermediates).

``Attention.forward``: Attend from ``x (b, i, c)``; x-transformers' call: ``attn(x)`` returns the output tensor.

Args:
    x: queries' input.
    context: ``(b, j, c_ctx)`` for cross-attention; ``None`` for self-attention.
    mask: bool attention mask as ``attend`` takes it (True = may attend); a ``SelectedMask`` from
        the stack says ``x`` at dead rows and the source at masked keys are 0 already. In self-attention a
        ``(b, j)`` (or ``(b, 1, 1, j)``) padding mask marks padding of ``x`` itself: a padded
        position is neither a key nor a query, whatever it holds, and its output is exactly 0.
        With ``context_mask`` given, ``mask (b, i)`` is the padding of ``x`` (its rows exactly 0).
    context_mask: ``(b, j)`` padding of the context (x-transformers' keyword): an all-False row
        makes the sample's output exactly 0.
    attn_mask: an extra mask ``(i, j)``, ``(h, i, j)`` or ``(b|1, h|1, i, j)`` (True = may attend; a
        3-d mask is per head, as in x-transformers), combined with the others.
    causal: bottom-right causal masking; default the module's ``causal``.
    rotary: ``(q_angles, k_angles)``, each ``(b|1, 1, n, d_rot)``, for the new queries and new keys.
    rotary_pos_emb: x-transformers' form ``(freqs (b|1, n_k, d_rot), xpos_scale)`` as returned by
        ``RotaryEmbedding.forward`` (``xpos_scale`` must be 1: xpos is not supported); the last
        ``i`` rows rotate the queries, the last new-key rows the new keys.
    bias: additive attention bias (ALiBi); ``attn_bias``: x-transformers' name for it.
    kv: precomputed keys/values (cross-attention with a cache); ``context`` is then unused.
    past_kv: cached self-attention keys/values to prepend (already rotated).
        ``kv`` and ``past_kv`` come from ``return_intermediates`` (``cached_kv``); whatever they
        hold at masked key positions (NaN, inf) reaches no output and no gradient.
    cache: an ``AttnIntermediate`` from an earlier ``return_intermediates`` call (x-transformers'
        decoding): its ``cached_kv`` are the past keys/values (self-attention) or the context's
        (cross-attention, then ``context`` is not needed).
    return_intermediates: also return an ``AttnIntermediate`` with ``cached_kv`` (the keys and
        values used, rotated, without memory keys), ``post_softmax_attn`` (the weights, float32,
        computed by the explicit path; ``None`` when the module was built with ``flash=True``, as
        in x-transformers) and ``pre_softmax_attn`` (the logits they came from, what ``qk_clip_`` reads).
    return_attn: also return the weights ``(b, h, i, M + j)`` in float32 (memory keys first; the
        sink's weight left out): masked keys and dead rows are exactly 0 (and padded queries, in
        self-attention).
    value_residual: ``(b, h_kv, j_new, d)`` the first attention's values of the same positions
        (x-transformers' ``add_value_residual``): the new values become ``lerp(value_residual, v, mix)``,
        ``mix`` learned per position and head (``learned_value_residual_mix``) or 0.5; in the values' dtype.
        Its slots at masked keys (NaN included) reach no output and no gradient. Keys/values
        handed in (``kv``, a cross-attention cache) are used as they are (mixed when cached).
    layout: the unpadded path's layout (``GroupedSelfLayout``, ``VarlenSelfLayout`` or
        ``PackedCrossLayout``, built by ``unpadded.py``): ``x`` is then the ``(T, c)`` packed real
        tokens, and the output too.
    kv_input: ``(k_input, v_input)``, each ``(b, i, c)`` like ``x``: self-attention projects its new keys
        from ``k_input`` and its new values from ``v_input`` (``x`` gives the queries; x-transformers'
        ``qkv_receive_diff_residuals``, which the stack passes). Padded layout, no ``context``.
    additional_key_values: ``(k, v)``, each ``(b, h_a, a, d)`` (x-transformers' keyword): ``a`` more keys
        and values every query sees (not rotated, not normed; no causal limit), e.g. another model's
        cached ones. ``h_a`` divides ``heads``: query head ``n`` uses added head ``n % h_a`` (x-transformers';
        with ``kv_head_order="interleaved"`` and ``h_a == kv_heads``, ``n // g``). Not with ``data_dependent_alibi``, ``orthog_projected_values``
        or the unpadded layouts; they come after the memory keys in ``return_attn``'s weights.
    additional_key_value_mask: ``(b, a)`` bool, True = a real added key; masked ones (whatever they
        hold, NaN included) reach no output and no gradient.
    kv_input_residual: ``(b|1, j|1, c_src)`` added to the keys'/values' input (``x``, or ``context``)
        before their projections (x-transformers' keyword), in its dtype; rows of masked keys are selected away.
        Not with precomputed keys/values (``kv``).
    positions: ``(q_pos (b|1, i), k_pos (b|1, j))`` integer positions of the queries and keys, for
        ``use_rel_proj_pos_bias`` (the stack passes the real tokens' positions); default the index
        positions, the queries the last ``i`` keys.
    prev_attn: ``(b, h, i, j)`` the logits of the attention before (x-transformers' residual attention,
        ``residual_attn``): added to this one's scaled logits before the bias; runs the explicit float32
        path. Entries this call masks, and padded queries' rows, are selected away (the ``-inf`` the stack's
        logits hold there included): they reach no output and no gradient.
    _return_kv: safeformer's own stack: return ``(out, (k, v))`` (and the weights and logits with
        ``return_attn``).
    rel_pos, pos: x-transformers' position-bias module (``RelativePositionBias``, ``DynamicPositionBias``,
        ``AlibiPositionalBias``) and ALiBi's custom positions: the call's bias at the tokens' indices.
    mem, mem_mask: memories ``(b, m, c)`` (and their mask) whose keys and values every query also sees.
    context_rotary_pos_emb: the context's rotary angles (rotary cross-attention; ``rotary_pos_emb`` the queries').
    polar_pos_emb: x-transformers' PoPE ``(freqs (1, N, d), bias)``: PoPE on this call's queries and keys
        (``attention_calls.polar_from_xt``; not with a cache).
    q_delta, k_delta, v_delta, o_delta, attn_delta: additive modulations of the queries, keys, values, output
        heads and logits; at padded rows and masked keys they reach nothing.
    flash_pack_seq_kwargs: packed documents (flash-attn's ``cu_seqlens_*``) as a block-diagonal mask.
    cache: also an ``AttentionStep`` (``attention_step.py``): one decode step over the slots of a ``StaticKVCache``,
        ``x (B, 1, c)``; the stack passes it, every other argument at its default.

Returns:
    ``out (b, i, c)``; ``(out, AttnIntermediate)`` with ``return_intermediates``; ``(out, weights)``
    with ``return_attn``. Rows that may attend to no key are exactly 0 after the output projection,
    and pass zero gradient (S2).

Paths (``Attention._decide_paths``, once at construction):

- ``orthog``: the output is projected orthogonally to the values (x-transformers' ``orthog_projected_values``): one
  projection over a sample's whole sequence, so it runs on the padded path, in self-attention, without a KV cache;
- ``qk_normed``: a norm of queries or keys sits between the projection and the rotation;
- ``explicit``: every call runs the explicit float32 path (softclamped logits, cog, sigmoid, inverted, gumbel, laser,
  CoPE, sparse top-k, talking heads: what no fused kernel does); such a module runs on the padded path only (l2
  distance alone runs the fused kernels, through ``_l2_kernel_inputs``, on the padded path too);
- ``packable``: the unpadded (packed) path can run it (no extra keys, no explicit path, ...).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor, nn

from ..core.attend import BACKENDS, SelectedMask, masked_linear
from ..core.cache import AttnIntermediate
from ..core.masks import checked_once
from .attention_bias import RelativeProjPositionalBias, init_biases, option_bias
from .attention_calls import (
    _positive_int,
    check_call,
    check_kv_residual,
    check_option_call,
    fold_xt_call,
    intermediates,
    packed_call_mask,
    plus_kept,
    polar_from_xt,
    rotary_from_xt,
    unpadded_call,
    xt_modulations,
    xt_rel_pos_bias,
)
from .attention_config import SELF_ONLY, AttentionConfig, HeadOptions, signature
from .attention_keys import all_keys, check_added, init_extra_keys, key_layout, query_padding
from .attention_output import _LowRankLinear as _LowRankLinear  # re-exported: the module path it had
from .attention_output import (
    attention_output,
    check_head_scale,
    init_gates,
    init_out,
    out_linear,
    output_phase,
)
from .attention_projections import init_norms, init_projections, init_rotation, project_qkv, qk_clip_
from .attention_scoring import CoPE as CoPE  # re-exported: the module path it had
from .attention_scoring import _explicit_attention as _explicit_attention  # re-exported (tests call it)
from .attention_scoring import (
    explicit_call,
    init_attention_scoring,
    kernel_call,
    legacy_scorer_keys,
    log_prob_from_hard_attend,
)
from .attention_step import AttentionStep, attention_step
from .hybrid import make_hybrid
from .modules import apply_rotary
from .xt_attend import Attend

__all__ = ["Attention", "RelativeProjPositionalBias", "log_prob_from_hard_attend"]


class Attention(nn.Module):
    """Multi-head attention for self- and cross-attention, with grouped-query heads and a KV cache.

    ``forward(x)`` attends within ``x``; ``forward(x, context)`` attends from ``x`` to ``context``. Both
    return the output tensor, as x-transformers' ``Attention`` does (``return_intermediates=True`` adds an
    ``AttnIntermediate`` whose ``cached_kv`` a later call continues from with ``cache=``).

    Args (x-transformers' order for the first six):
        dim: model width c.
        dim_head: head dim d.
        dim_context: width of the context for cross-attention; default ``dim``.
        heads: query heads h.
        causal: bottom-right causal masking by default (``forward(causal=...)`` overrides it per call).
        flash: accepted for x-transformers (the kernel is chosen per call); with ``flash=True``
            ``return_intermediates`` gives no attention weights, as in x-transformers.
        kv_heads: key/value heads (grouped-query attention); default ``heads``. ``one_kv_head=True``:
            x-transformers' spelling of ``kv_heads=1``.
        kv_head_order: which key/value head a query head reads with ``1 < kv_heads < heads``: ``"tiled"`` (the
            default, x-transformers': head ``n`` reads ``n % kv_heads``, so its weights load as they are) or
            ``"interleaved"`` (``n // (heads / kv_heads)``, earlier safeformer's; its checkpoints load with it).
        qk_norm_groups, qk_norm_scale: x-transformers' qk-norm options (the L2 norm per group of
            ``dim_head / qk_norm_groups`` features; the logit scale, default 10).
        dropout: attention dropout (training only).
        bias: use biases in the projections.
        backend: ``attend`` backend (``"auto"`` picks per call).
        softclamp_logits: ``tanh((logits + bias) / value) * value`` before masking and softmax
            (``logit_softclamp_value``, default 50); runs the explicit float32 path (no fused kernel).
        hybrid_module, hybrid_fold_axial_dim, hybrid_mask_kwarg, hybrid_learned_mix: a user's sequence module
            (a ``GRU`` say) beside self-attention, the two outputs RMS-normalised per head and averaged before
            ``to_out`` (x-transformers' names; see ``hybrid.HybridBranch`` for padding and the KV cache).
        **xt_options: x-transformers' other ``Attention`` keywords (``xt_defaults.ATTENTION_DEFAULT_ONLY``) at their
            default, ``onnxable`` at any value; another value, or an unknown keyword, is a ``TypeError`` naming it.

    The other keywords are x-transformers' options, each documented by the builder that checks it:
    ``attention_projections.init_projections`` (multi-latent attention: ``use_latent_*``, ``dim_latent_*``,
    ``latent_rope_subheads``; ``rotate_num_heads``: ``init_rotation``) and ``init_norms`` (``qk_norm*``, ``value_rmsnorm``, ``learned_value_residual_mix``),
    the scoring part ``attend`` (``xt_attend.Attend``, checked by ``attention_scoring.init_scoring``: ``l2_distance``,
    ``cog_signed``, ``sigmoid``, ``gumbel_softmax*``, ``inverted_attention``, ``sparse_topk*``, ``hard``, ``selective``,
    talking heads, ``custom_attn_fn``, ``attend_sdp_kwargs``), ``init_attention_scoring`` (``laser*``, ``use_cope*``),
    ``attention_bias`` (``use_rel_proj_pos_bias``,
    ``rel_proj_*``: ``RelativeProjPositionalBias``; ``data_dependent_alibi*``: ``init_forget_gates``),
    ``attention_keys.init_extra_keys`` (``num_mem_kv``, ``learned_sink``, ``add_zero_kv``), ``attention_output.init_out``
    (``dim_out``, ``project_out``, ``on_attn``, ``zero_init_output``, ``orthog_projected_values*``, ``head_scale``,
    ``sublayer_dropout``, ``output_proj_depth``), ``init_gates`` (``gate_values*``, ``gate_value_heads``, ``output_gate*``,
    ``swiglu_values``, ``low_rank_silu_gates``) and ``_init_inputs`` (``value_dim_head``, ``qkv_receive_diff_residuals``).
    """

    # options for self-attention only (read from the families' fields): a stack leaves them out of its
    # cross-attention blocks (they read the sequence's own positions or values, or run a module beside self-attention)
    SELF_ONLY = SELF_ONLY

    def __init__(self, dim: int, dim_head: int = 64, dim_context: int | None = None, heads: int = 8,
                 causal: bool = False, flash: bool = False, **options):
        # the keywords, checked once into one frozen value (the signature below is read from its families' fields)
        self._build(AttentionConfig.from_keywords(dim, dim_head, dim_context, heads, causal, flash, **options))

    @classmethod
    def from_config(cls, config: AttentionConfig) -> Attention:
        """The ``Attention`` of ``config`` (an ``AttentionConfig``, whose keywords were checked when it was made)."""
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        attn = cls.__new__(cls)
        attn._build(config)
        return attn

    def _build(self, cfg: AttentionConfig) -> None:
        """The parts of ``cfg``, each family built and checked by its own builder, in its parameters' order."""
        super().__init__()
        self.config = cfg
        dim, dim_head, heads, causal, keys = cfg.dim, cfg.dim_head, cfg.heads, cfg.causal, cfg.keys
        kv_heads = _init_core(self, cfg)
        _init_inputs(self, cfg.core, heads, kv_heads, dim_head, cfg.hybrid.hybrid_module)
        # x-transformers' Attend: the scoring options and their parameters (sink, talking heads)
        self.attend = Attend(causal=causal, heads=heads, sdp_kwargs=cfg.logits.attend_sdp_kwargs, qk_norm=cfg.norms.qk_norm,
                             flash_pack_seq=cfg.core.flash_pack_seq, **cfg.scoring.__dict__)
        self._register_load_state_dict_pre_hook(legacy_scorer_keys())
        init_projections(self, cfg.projections, dim, heads, kv_heads, dim_head)
        init_attention_scoring(self, cfg.logits, dim_head, causal, keys.num_mem_kv, keys.sink)
        init_biases(self, cfg.biases, dim, heads, causal)
        init_norms(self, cfg.norms, dim, heads, kv_heads, dim_head)
        init_out(self, cfg.output, dim, heads, dim_head, cfg.projections.bias, cfg.norms.value_rmsnorm,
                 self.dim_value)
        init_extra_keys(self, keys, heads, kv_heads, dim_head)
        init_rotation(self, cfg.projections, heads, kv_heads)
        init_gates(self, cfg.gates, dim, heads, dim_head)
        # x-transformers' hybrid_module: a user's sequence module beside attention, mixed in before to_out (hybrid.py)
        self.hybrid = make_hybrid(cfg.hybrid, dim=dim, heads=heads, dim_head=dim_head, causal=causal)
        check_head_scale(self)
        _decide_paths(self)

    @property
    def to_forget_gates(self) -> nn.Module | None:
        """The data-dependent ALiBi's linear map (``data_dependent_alibi.to_forget_gates[0]``), or ``None``."""
        return None if self.data_dependent_alibi is None else self.data_dependent_alibi.to_forget_gates[0]


    def _rotate(self, t: Tensor, angles: Tensor) -> Tensor:
        """Rotary positions on ``t (b, h|h_kv, n, d)``; with ``latent_rope_subheads`` on its last that many heads only
        (multi-latent attention's decoupled rope, as x-transformers' ``rotate_num_heads``)."""
        r = self.rope_subheads or (self.rotate_num_heads if self.rotate_num_heads < self.heads else 0)
        if not r:
            return apply_rotary(t, angles)
        return torch.cat((t[:, :-r], apply_rotary(t[:, -r:], angles)), dim=1)

    @torch.no_grad()
    def qk_clip_(self, pre_softmax_attn, tau: float = 100.0) -> None:
        """MuonClip's qk-clip (Kimi K2, x-transformers' ``qk_clip_``): scale the query and key projections in place
        so that no head's largest logit in ``pre_softmax_attn`` (the logits ``(b, h, i, j)``, or the
        ``AttnIntermediate`` holding them) exceeds ``tau``; see ``attention_projections.qk_clip_``."""
        qk_clip_(self, pre_softmax_attn, tau)

    def muon_parameters(self) -> list[nn.Parameter]:
        """The matrices Muon should optimise (x-transformers' ``muon_parameters``): the value and output projections'
        weights (queries and keys are left to qk-clip and the other optimiser)."""
        out = out_linear(self)
        return [self.to_v.weight] + ([] if out is None else [out.weight])

    @property
    def out_bias(self) -> Tensor | None:
        """The output projection's bias (``None`` without one, or without a projection): a bias moves a dead row's
        output off 0, so the paths select dead rows after the projection only when there is one."""
        out = out_linear(self)
        return None if out is None else out.bias

    @property
    def extra_keys(self) -> int:
        """Keys every query sees besides the inputs' own: the sink (if any) and the memory keys."""
        return self.num_mem_kv + (self.head_attn_sink is not None) + self.add_zero_kv

    # ------------------------------------------------------------------------------------------------
    # the one projection seam and the one output seam, used by every path (padded, explicit, packed)
    # ------------------------------------------------------------------------------------------------

    @staticmethod
    def _linear(linear: nn.Linear, x: Tensor, keep: Tensor | None) -> Tensor:
        """``linear(x)``; with ``keep (...)`` the rows where it is False are selected to 0 first (saving x
        itself for the backward, not the selected copy)."""
        if keep is None:
            return linear(x)
        if not isinstance(linear, nn.Linear):  # a wrapped projection (e.g. a TTTModuleWrapper): the plain expression
            return linear(torch.where(keep[..., None], x, 0.0))
        return masked_linear(x, keep, linear)

    def _project_q(self, x: Tensor, keep: Tensor | None = None, delta: Tensor | None = None) -> Tensor:
        """Queries ``(..., h, d)`` of ``x (..., c)``, q-normed (through the latent with ``use_latent_q``); ``delta``:
        x-transformers' ``q_delta``, added before the heads are split (selected to 0 where ``keep`` is False)."""
        if self.to_latent_q is not None:  # bias-less: a selected (zero) row stays 0
            q = self.to_q(self._linear(self.to_latent_q, x, keep))
        else:
            q = self._linear(self.to_q, x, keep)
        return self.norm_q(plus_kept(q, delta, keep).unflatten(-1, (self.heads, self.dim_head)))

    @property
    def v_norm(self) -> nn.Module | None:
        """The value heads' RMS norm (x-transformers' ``value_rmsnorm``), or ``None``."""
        return self.value_rmsnorm

    def norm_q(self, q: Tensor) -> Tensor:
        """Queries ``(..., h, d)`` through x-transformers' ``qk_norm`` (and ``qk_norm_q_scale``) and ``qk_rmsnorm``,
        each if on."""
        q = _qk_normed(self.q_norm, self.qk_norm_q_scale, q)
        return q if self.q_rmsnorm is None else _rms_normed(self.q_rmsnorm, self.q_norm, q)

    def norm_k(self, k: Tensor, memory: bool = False) -> Tensor:
        """Keys ``(..., h_kv, d)`` through x-transformers' ``qk_norm`` (and ``qk_norm_k_scale``) and ``qk_rmsnorm`` /
        ``k_rmsnorm``, each if on; ``memory`` keys take the first only, as there."""
        k = _qk_normed(self.k_norm, self.qk_norm_k_scale, k)
        return k if self.k_rmsnorm is None or memory else _rms_normed(self.k_rmsnorm, self.k_norm, k)

    def _project_kv(self, source: Tensor, keep: Tensor | None = None, deltas: tuple = (None, None)) -> tuple:
        """Keys and values ``(..., h_kv, d)`` of ``source (..., c_ctx)``, k-normed (not rotated); with
        ``use_latent_kv`` both come from one bias-less latent of ``source`` (the last ``latent_rope_subheads`` key
        heads from ``source`` itself)."""
        if self.to_latent_kv is not None:
            latent = self._linear(self.to_latent_kv, source, keep)
            k, v = plus_kept(self.to_k(latent), deltas[0], keep), plus_kept(self.to_v(latent), deltas[1], keep)
            if self.to_rotateable_k is not None:
                k = torch.cat((k, self._linear(self.to_rotateable_k, source, keep)), dim=-1)
        else:
            k, v = (plus_kept(self._linear(lin, source, keep), d, keep) for lin, d in zip((self.to_k, self.to_v), deltas))
        k = k.unflatten(-1, (self.kv_heads, self.dim_head))
        v = v.unflatten(-1, (self.kv_heads, self.dim_value))
        if self.v_norm is not None:  # a selected (zero) source gives v = 0 (or the bias), finite
            v = self.v_norm(v)
        return self.norm_k(k), v

    _output = attention_output  # the one output seam (attention_output.attention_output)

    def project_kv(self, source: Tensor, keep: Tensor | None = None, deltas: tuple = (None, None)) -> tuple:
        """Keys and values ``(b, h_kv, j, d)`` of ``source (b, j, c_ctx)`` (normed, not yet rotated);
        ``keep (b|1, j)``: positions of ``source`` selected to 0 first where False; ``deltas``: x-transformers'
        ``(k_delta, v_delta)``."""
        if source.shape[-1] != self.dim_context:
            raise ValueError(
                f"context must have feature size {self.dim_context} (dim_context), got shape {tuple(source.shape)}"
            )
        k, v = self._project_kv(source, keep, deltas)
        return k.transpose(1, 2), v.transpose(1, 2)

    @checked_once
    def forward(
        self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None,
        context_mask: Tensor | None = None, attn_mask: Tensor | None = None, *, causal: bool | None = None,
        rotary: tuple[Tensor, Tensor] | None = None, rotary_pos_emb: tuple[Tensor, object] | None = None,
        bias: Tensor | None = None, attn_bias: Tensor | None = None, kv: tuple[Tensor, Tensor] | None = None,
        past_kv: tuple[Tensor, Tensor] | None = None, cache: AttnIntermediate | None = None,
        return_intermediates: bool = False, return_attn: bool = False, layout=None,
        value_residual: Tensor | None = None, kv_input: tuple[Tensor, Tensor] | None = None, hybrid=None,
        additional_key_values: tuple[Tensor, Tensor] | None = None, additional_key_value_mask: Tensor | None = None,
        kv_input_residual: Tensor | None = None, positions: tuple[Tensor, Tensor] | None = None,
        prev_attn: Tensor | None = None, _return_kv: bool = False, rel_pos=None, pos=None, mem=None, mem_mask=None,
        context_rotary_pos_emb=None, polar_pos_emb=None, q_delta=None, k_delta=None, v_delta=None, o_delta=None,
        attn_delta=None, flash_pack_seq_kwargs=None,
    ):
        """Attend from ``x (b, i, c)``; x-transformers' call: ``attn(x)`` returns the output tensor ``(b, i, c)``
        (``(out, AttnIntermediate)`` with ``return_intermediates``, ``(out, weights)`` with ``return_attn``); a row
        that may attend to no key is exactly 0 with zero gradient (S2). Every keyword is documented in this module's
        docstring (``help(safeformer.nn.attention)``, "``Attention.forward``")."""
        if type(cache) is AttentionStep:  # one decode step over the slots of a StaticKVCache (attention_step.py)
            return attention_step(self, x, cache, kv_input, prev_attn)
        if polar_pos_emb is not None:  # x-transformers' PoPE (freqs, bias): the stack's rotary pair, PoPE's form
            rotary = polar_from_xt(self, polar_pos_emb, x, context, mask, context_mask, dict(
                rotary=rotary, rotary_pos_emb=rotary_pos_emb, context_rotary_pos_emb=context_rotary_pos_emb, kv=kv,
                past_kv=past_kv, cache=cache, mem=mem, additional_key_values=additional_key_values, layout=layout))
        if context_rotary_pos_emb is not None:  # x-transformers' rotary cross-attention: query and context angles
            rotary, rotary_pos_emb = rotary_from_xt(rotary_pos_emb, x, context, kv, context_rotary_pos_emb), None
        if rel_pos is not None or pos is not None:  # x-transformers' position bias module (T5, dynamic, ALiBi)
            attn_bias = xt_rel_pos_bias(x, context, cache, rel_pos, pos, attn_bias)
        if flash_pack_seq_kwargs is not None:  # packed documents: a block-diagonal attn_mask
            attn_mask = packed_call_mask(self, x, context, mask, context_mask, attn_mask, cache, flash_pack_seq_kwargs)
        if self.qkv_receive_diff_residuals:  # x-transformers': x stacks the queries', keys' and values' inputs
            x, kv_input = _split_qkv_inputs(x, context, kv_input)
        if layout is not None:
            return unpadded_call(self, x, layout, additional_key_values, kv_input_residual, _return_kv)
        causal = self.causal if causal is None else causal
        pad = None
        if (attn_bias is not None or cache is not None or context_mask is not None or attn_mask is not None
                or rotary_pos_emb is not None):  # x-transformers' keywords
            mask, pad, bias, kv, past_kv, rotary = fold_xt_call(self, x, context, mask, context_mask, attn_mask, bias,
                                                                attn_bias, kv, past_kv, cache, rotary, rotary_pos_emb)
        mods = None
        if not (mem is None and mem_mask is None and q_delta is None and k_delta is None and v_delta is None
                and o_delta is None and attn_delta is None):
            mods, additional_key_values, additional_key_value_mask = xt_modulations(
                self, x, context, kv, past_kv, layout, rotary, mem, mem_mask, additional_key_values,
                additional_key_value_mask, dict(q_delta=q_delta, k_delta=k_delta, v_delta=v_delta, o_delta=o_delta,
                                                attn_delta=attn_delta))
        want_weights = return_attn or (return_intermediates and not self.flash)
        res = self._forward(x, context, mask=mask, causal=causal, rotary=rotary, bias=bias, kv=kv,
                            past_kv=past_kv, return_attn=want_weights, pad=pad, value_residual=value_residual,
                            kv_input=kv_input, hybrid=hybrid,
                            added=check_added(self, additional_key_values, additional_key_value_mask, x),
                            kv_residual=kv_input_residual, positions=positions, prev_attn=prev_attn, mods=mods)
        if _return_kv:
            return res if return_attn else res[:2]
        if return_intermediates:
            return intermediates(res, want_weights, x, context, kv, value_residual)
        if return_attn:
            return res[0], res[2]
        return res[0]

    def _forward(self, x, context, *, mask=None, causal=False, rotary=None, bias=None, kv=None, past_kv=None,
                 return_attn=False, pad=None, value_residual=None, kv_input=None, hybrid=None, positions=None,
                 added=None, kv_residual=None, prev_attn=None, mods=None):
        """The attention itself, phase by phase (checks, biases, keys, projections, the attention call, output):
        ``(out, (k, v))`` (and the weights and logits with ``return_attn``). ``pad (b, i)``: padding of ``x`` in
        self-attention when ``mask`` no longer shows it (an ``attn_mask`` was folded in)."""
        inputs_finite = isinstance(mask, SelectedMask)
        if inputs_finite:  # the stack selected its padded inputs to 0: nothing to select again here
            mask = mask.mask
        check_call(self, x, context, kv, past_kv)
        check_option_call(self, context, kv, past_kv, hybrid, added, kv_input, kv_residual)
        if self.inverted and causal:
            raise ValueError("inverted_attention normalises each key's weights over the queries: with causal "
                             "masking a query would see later queries through it (the future would leak); use it "
                             "without causal")
        b, i = x.shape[:2]
        source = x if context is None else context
        if kv_residual is not None:
            check_kv_residual(kv_residual, x, source)
        j = kv[0].shape[2] if kv is not None else source.shape[1] + (0 if past_kv is None else past_kv[0].shape[2])
        self_pad = query_padding(mask, pad, not inputs_finite and context is None and kv is None, b, i, j)  # (b, i)
        if self.rel_proj_pos_bias is not None or self.to_forget_gates is not None or self.max_attend_past is not None:
            bias = option_bias(self, x, mask, bias, causal, self_pad, j, positions)
        user_mask, j_user = mask, j
        mask, bias, j, rows_ok, keys_ok = key_layout(self, x, mask, bias, causal, added, inputs_finite, self_pad, j)
        q, k, v, v_orthog = project_qkv(self, x, source, context, kv, past_kv, kv_input, kv_residual, value_residual,
                                        rotary, rows_ok, keys_ok, self_pad, j, mods)
        k, v, kv_out = all_keys(self, k, v, user_mask, j_user, self_pad, causal, added)
        attn_delta = None if mods is None else mods.attn
        if return_attn or self.explicit or prev_attn is not None or attn_delta is not None:
            out, weights, logits = explicit_call(self, q, k, v, mask, causal, bias, self_pad, return_attn, prev_attn,
                                                 attn_delta)
        else:
            weights = logits = None
            selected = inputs_finite or (kv is None and past_kv is None and bias is None)  # see kernel_call
            out = kernel_call(self, q, k, v, mask, causal, bias, keys_ok, selected)
        out = output_phase(self, out, x, hybrid, self_pad, rows_ok, v_orthog, None if mods is None else mods.o)
        if return_attn:
            return out, kv_out, weights, logits
        return out, kv_out


# the scorer's parameters, read where x-transformers keeps them (``attention.attend``: its Attend)
# and the scoring options, which the part owns (``Attend``; read here by the paths that run them)
for _name in ("head_attn_sink", "pre_softmax_talking_heads", "post_softmax_talking_heads",
              "pre_scale_post_talking_heads", "cope", "score", "inverted", "l2_distance", "cog_signed", "selective",
              "sparse_topk", "sparse_topk_straight_through", "gumbel_temp", "gumbel_hard", "custom_attn_fn"):
    setattr(Attention, _name, property(lambda self, _n=_name: getattr(self.attend, _n),
                                       doc=f"``attend.{_name}`` (the scoring part, x-transformers' ``Attend``)."))


# the signature read from the option families' fields (x-transformers' keywords, their defaults and types)
Attention.__init__.__signature__ = signature(inspect.signature(Attention.__init__))


def _rms_normed(rms: nn.Module, l2: nn.Module | None, t: Tensor) -> Tensor:
    """``t`` through x-transformers' ``q_rmsnorm`` / ``k_rmsnorm`` after its qk-norm: the L2 norm's multiplier (which
    stands for x-transformers' logit scale ``qk_norm_scale``, the kernels scaling by ``d ** -0.5``) applied after it,
    where x-transformers' logit scale applies too."""
    out = rms(t)
    return out if l2 is None else out * l2.mult


def _qk_normed(norm: nn.Module | None, scale: Tensor | None, t: Tensor) -> Tensor:
    """``t (..., heads, d)`` L2-normalised by ``norm`` and times the learned ``scale (heads, 1, d)``, if any."""
    if norm is None:
        return t
    t = norm(t)
    return t if scale is None else t * scale[:, 0].to(t.dtype)


def _init_head_order(attn: Attention, heads: int, kv_heads: int, kv_head_order: str) -> None:
    """Which key/value head each query head reads with grouped-query heads (``1 < kv_heads < heads``):
    ``"tiled"`` (x-transformers': query head ``n`` reads ``n % kv_heads``) or ``"interleaved"`` (earlier
    safeformer's, SDPA's ``enable_gqa``: ``n // (heads / kv_heads)``). The fused kernels pair heads interleaved:
    with ``"tiled"`` the queries enter them in ``kernel_head_order`` and leave in ``kernel_head_restore``."""
    if kv_head_order not in ("tiled", "interleaved"):
        raise ValueError(f"kv_head_order must be 'tiled' (x-transformers') or 'interleaved', got {kv_head_order!r}")
    attn.kv_head_order = kv_head_order
    attn.kv_tiled = kv_head_order == "tiled" and 1 < kv_heads < heads
    if attn.kv_tiled:
        g = heads // kv_heads
        order = torch.tensor([(m % g) * kv_heads + m // g for m in range(heads)])  # kernel head m: our head order[m]
        attn.register_buffer("kernel_head_order", order, persistent=False)
        attn.register_buffer("kernel_head_restore", torch.argsort(order), persistent=False)
    else:
        attn.kernel_head_order = attn.kernel_head_restore = None


def _init_core(attn: Attention, cfg: AttentionConfig) -> int:
    """``Attention``'s core keywords checked and set on ``attn`` (``causal``, ``flash``, ``heads``, ``kv_heads``,
    ``dim_head``, ``dim_context``, ``dropout``, ``backend``, ``softclamp_value``), with the numbers the options check
    first (``num_mem_kv``, ``logit_softclamp_value``). Returns ``kv_heads``, ``one_kv_head`` and the default
    applied."""
    dim, dim_head, dim_context, heads, causal, flash = (cfg.dim, cfg.dim_head, cfg.dim_context, cfg.heads, cfg.causal,
                                                        cfg.flash)
    kv_heads, one_kv_head, dropout, backend = cfg.core.kv_heads, cfg.core.one_kv_head, cfg.core.dropout, cfg.core.backend
    num_mem_kv = cfg.keys.num_mem_kv
    softclamp_logits, logit_softclamp_value = cfg.logits.softclamp_logits, cfg.logits.logit_softclamp_value
    if one_kv_head:  # x-transformers' spelling of kv_heads=1
        if kv_heads not in (None, 1):
            raise ValueError(f"one_kv_head=True means kv_heads=1, got kv_heads={kv_heads}")
        kv_heads = 1
    if not isinstance(causal, bool) or not isinstance(flash, bool):
        raise TypeError(f"causal and flash must be bools, got causal={causal!r}, flash={flash!r}")
    attn.causal = causal
    attn.flash = flash
    kv_heads = heads if kv_heads is None else kv_heads
    if isinstance(num_mem_kv, bool) or not isinstance(num_mem_kv, int) or num_mem_kv < 0:
        raise ValueError(f"num_mem_kv (attn_num_mem_kv) must be a non-negative integer, got {num_mem_kv!r}")
    if softclamp_logits and not (isinstance(logit_softclamp_value, (int, float)) and not isinstance(
            logit_softclamp_value, bool) and math.isfinite(logit_softclamp_value) and logit_softclamp_value > 0):
        raise ValueError(f"logit_softclamp_value must be a positive finite number, got {logit_softclamp_value!r}")
    if heads <= 0 or dim_head <= 0:
        raise ValueError(f"heads and dim_head must be positive, got heads={heads}, dim_head={dim_head}")
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"attention dropout must be in [0, 1), got {dropout}")
    attn.heads, attn.kv_heads, attn.dim_head = heads, kv_heads, dim_head
    attn.dim_context = dim if dim_context is None else dim_context
    attn.dropout = dropout
    attn.backend = backend
    attn.softclamp_value = float(logit_softclamp_value) if softclamp_logits else None
    return kv_heads


def _split_qkv_inputs(x, context, kv_input) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``x (3, b, n, c)`` of an ``Attention(qkv_receive_diff_residuals=True)``: the queries' input and ``kv_input``."""
    if not isinstance(x, Tensor) or x.dim() != 4 or x.shape[0] != 3:
        raise ValueError("with qkv_receive_diff_residuals, x must be (3, b, n, c): the queries', keys' and values' "
                         f"inputs stacked, got {tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if context is not None or kv_input is not None:
        raise ValueError("qkv_receive_diff_residuals reads keys and values from x: not with context or kv_input")
    return x[0], (x[1], x[2])


def _init_inputs(attn: Attention, o: HeadOptions, heads: int, kv_heads: int, dim_head: int, hybrid_module) -> None:
    """The grouped heads' pairing (``head_order``: ``_init_head_order``'s arguments), the value head width ``dim_value`` (x-transformers' ``value_dim_head``; default ``dim_head``): the values,
    the attention output per head and the output projection's input are that wide, the queries and keys
    ``dim_head``; with ``qkv_receive_diff_residuals`` the call's ``x`` is ``(3, b, n, c)``, the queries', keys' and
    values' inputs (x-transformers' hyper-connection views); with ``flash_pack_seq`` a call takes
    ``flash_pack_seq_kwargs``, one sequence of packed documents (``masks.packed_sequence_mask``)."""
    _init_head_order(attn, heads, kv_heads, o.kv_head_order)
    attn.qkv_receive_diff_residuals, attn.flash_pack_seq = o.qkv_receive_diff_residuals, o.flash_pack_seq
    if o.value_dim_head is not None and not _positive_int(o.value_dim_head):
        raise ValueError(f"value_dim_head must be a positive integer, got {o.value_dim_head!r}")
    attn.dim_value = dim_head if o.value_dim_head is None else o.value_dim_head
    if attn.dim_value != dim_head:
        if hybrid_module is not None:
            raise ValueError("value_dim_head != dim_head with hybrid_module is not supported (the hybrid branch "
                             "is mixed in per head of width dim_head)")


def _decide_paths(attn: Attention) -> None:
    """Which paths ``attn`` runs, decided once from its parts (``orthog``, ``qk_normed``, ``explicit``,
    ``packable``: see "Paths" in this module's docstring)."""
    attn.orthog = bool(attn.orthog_projected_values or attn.orthog_projected_values_per_head)
    # a norm of queries or keys between the projection and the rotation (the decode step's fused plan reads it)
    attn.qk_normed = any(n is not None for n in (attn.q_norm, attn.k_norm, attn.q_rmsnorm, attn.k_rmsnorm))
    attn.explicit = bool(
        attn.attend.options_explicit or attn.softclamp_value is not None or attn.laser_value is not None
        or attn.cope is not None
        or (attn.l2_distance and attn.head_attn_sink is not None))  # the sink's logit is no distance
    # why a call cannot continue from a KV cache (an option over the sequence's own positions), or None
    attn.cache_refusal = (
        "orthog_projected_values projects onto the values of the sequence itself" if attn.orthog else
        "data_dependent_alibi sums forget gates over the sequence itself" if attn.data_dependent_alibi is not None
        else "selective attention gates each query by the queries before it" if attn.selective else None)
    # the keys' and queries' positions reach the bias options (the stack passes the real tokens')
    attn.needs_positions = attn.rel_proj_pos_bias is not None or attn.max_attend_past is not None
    attn.packable = bool(attn.extra_keys == 0 and not attn.explicit and not attn.l2_distance and not attn.orthog
                         and attn.max_attend_past is None
                         and attn.to_forget_gates is None and attn.rel_proj_pos_bias is None
                         and not attn.rope_subheads and attn.hybrid is None
                         and attn.rotate_num_heads == attn.heads and attn.dim_value == attn.dim_head)
