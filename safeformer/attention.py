"""The ``Attention`` module: projections, heads, grouped-query attention, rotary, qk-norm, memory
keys/values, sinks and softclamp, for self- and cross-attention, with a KV cache.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim, c model
width, c_ctx context width, T packed real tokens.

One seam for every path: ``_project_q`` / ``_project_kv`` compute q, k, v (positions first,
``(..., heads, d)``) and ``_output`` produces the output, for the padded path, the explicit float32 path
and the unpadded layouts (``unpadded.py``). A new option on queries, keys or outputs is written once.
Masks follow safeformer's one convention (bool, True = may attend / is real); see ``masks.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attend import BACKENDS, PreparedMask, SelectedMask, _grad_select, attend, masked_linear
from .cache import AttnIntermediate
from .hybrid import make_hybrid
from .masks import as_attention_mask, causal_mask, checked_once, combine_masks, validate_mask
from .modules import HeadRMSNorm, RMSNorm, apply_rotary

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
        qk_norm: RMS-normalise queries and keys per head before the dot product, with learned gains (an
            effective logit scale of ``sqrt(dim_head)`` at init; x-transformers' ``qk_norm`` is an L2 norm with a
            fixed scale of 10, which ``from_x_transformers`` maps onto the gains).
        dropout: attention dropout (training only).
        bias: use biases in the projections.
        backend: ``attend`` backend (``"auto"`` picks per call).
        num_mem_kv: learned memory key/value pairs ``mem_k, mem_v (h_kv, num_mem_kv, d)`` prepended to
            the keys of every call (x-transformers' ``attn_num_mem_kv``): every query may always see
            them (bias 0 under ALiBi), so no row is dead; masked keys still reach nothing.
        learned_sink: (x-transformers' ``head_learned_sink``, accepted too) a learned per-head sink logit ``head_attn_sink (h,)`` (x-transformers'
            ``attn_head_learned_sink``): one more key with logit ``head_attn_sink[h]`` and value 0, so a
            row's weights may sum to less than 1; a row with no other key gives exactly 0, after the output
            projection's bias too (a dead row for the no-op rule: a dropped context adds nothing). Its gradient
            flows through the additive mask, which PyTorch's flash and cuDNN kernels do not
            differentiate: with ``backend='flash'``/``'cudnn'`` a sink trains on the math kernel.
        softclamp_logits: ``tanh((logits + bias) / value) * value`` before masking and softmax
            (``logit_softclamp_value``, default 50); runs the explicit float32 path (no fused kernel).
        qk_norm_eps: the epsilon of the q/k RMS norms (default 1e-6).
        gate_values, output_gate: gated attention (x-transformers' options of these names): the attention
            output, before ``to_out``, times ``sigmoid(x_gate(x) + h_gate(out))`` (SiLU with ``swiglu_values``),
            the x gate reading the queries' input, the h gate the attention output; ``*_headwise``: one
            logit per head; ``*_rank``: a low-rank projection (``low_rank_silu_gates``: SiLU between). The
            projections start at zero. A dead row stays exactly 0 (its output is 0 before the gate).
        zero_init_output: ``to_out`` starts at zero (x-transformers' name).
        gate_value_heads: x-transformers' per-head gate: each head's output times ``sigmoid(Linear(x))`` (weight 0,
            bias 10 at init), before the gates above; padded rows' ``x`` is selected to 0 first.
        dim_out: the output width (default ``dim``).
        l2_distance: logits ``-|q - k|^2 * d ** -0.5`` (x-transformers' l2 distance attention).
        cog_signed: cog attention: the softmax of ``|logits|``, the weights given back the logits' signs (the sink's
            logit too); weights may be negative.
        sigmoid: weights ``sigmoid(logits)``, unnormalised (masked keys and dead rows 0).
        gumbel_softmax, gumbel_softmax_temp, gumbel_softmax_hard: weights sampled by a gumbel softmax of temperature
            ``gumbel_softmax_temp`` (hard: the one-hot of the sample with the soft weights' gradient); the noise is
            drawn in evaluation too, as x-transformers; ``log_prob_from_hard_attend`` reads the picked keys' log
            probabilities from the intermediates.
        inverted_attention: (cross-attention) each key's weights are a softmax over the queries that may see it (a
            padded query takes none), then each query's weights are L1-normalised over its keys; no KV cache, no
            memory keys or sink.
        laser, laser_softclamp_value: LASER attention: ``log(weights @ exp(softclamp(v)))`` (a dead row stays 0, never
            ``log(0)``); not with ``cog_signed``.
        use_latent_q, dim_latent_q, use_latent_kv, dim_latent_kv, latent_rope_subheads: multi-latent attention:
            queries (keys and values) projected from a bias-less latent ``Linear(dim, dim_latent_*)`` of the input;
            the last ``latent_rope_subheads`` key heads straight from the input, and only those heads (of the queries and
            keys) rotated by rotary positions (decoupled rope).
        use_cope, cope_max_pos: contextual positions (CoPE, causal attention): a key's position is the sum of
            ``sigmoid(logit)`` over the visible keys from it on (masked keys count 0), its logit gains ``q . pos_emb``
            at that position (interpolated). ``cope_talking_heads`` / ``cope_soft_onehot_pos`` are refused.
        use_rel_proj_pos_bias, rel_proj_num_distance_basis, rel_proj_max_dist: self-attention bias of
            ``RelativeProjPositionalBias`` (from the queries' input, at the positions ``forward(positions=...)``
            gives, index positions by default).
            The scoring options (``cog_signed`` to ``use_cope``) run the explicit float32 attention: no fused kernel,
            padded path only; ``l2_distance`` alone runs the fused kernels (``[2q, 1] . [k, -|k|^2]``), padded path
            only.
        hybrid_module, hybrid_fold_axial_dim, hybrid_mask_kwarg, hybrid_learned_mix: a user's sequence module
            (a ``GRU`` say) beside self-attention, the two outputs RMS-normalised per head and averaged before
            ``to_out`` (x-transformers' names; see ``hybrid.HybridBranch`` for padding and the KV cache).
    """

    def __init__(
        self,
        dim: int,
        dim_head: int = 64,
        dim_context: int | None = None,
        heads: int = 8,
        causal: bool = False,
        flash: bool = False,
        *,
        kv_heads: int | None = None,
        one_kv_head: bool = False,
        qk_norm: bool = False,
        dropout: float = 0.0,
        bias: bool = False,
        backend: str = "auto",
        num_mem_kv: int = 0,
        learned_sink: bool = False,
        head_learned_sink: bool = False,
        softclamp_logits: bool = False,
        logit_softclamp_value: float = 50.0,
        qk_norm_eps: float | None = None,
        gate_values: bool = False,
        gate_value_heads: bool = False,
        zero_init_output: bool = False,
        gate_values_rank: int | None = None,
        gate_values_headwise: bool = False,
        output_gate: bool = False,
        output_gate_rank: int | None = None,
        output_gate_headwise: bool = False,
        swiglu_values: bool = False,
        low_rank_silu_gates: bool = True,
        qk_norm_dim_scale: bool = False,
        value_rmsnorm: bool = False,
        orthog_projected_values: bool = False,
        orthog_projected_values_per_head: bool = False,
        learned_value_residual_mix: bool = False,
        data_dependent_alibi: bool = False,
        data_dependent_alibi_kwargs: dict | None = None,
        dim_out: int | None = None,
        l2_distance: bool = False,
        cog_signed: bool = False,
        sigmoid: bool = False,
        inverted_attention: bool = False,
        gumbel_softmax: bool = False,
        gumbel_softmax_temp: float = 1.0,
        gumbel_softmax_hard: bool = True,
        laser: bool = False,
        laser_softclamp_value: float = 15.0,
        use_latent_q: bool = False,
        dim_latent_q: int | None = None,
        use_latent_kv: bool = False,
        dim_latent_kv: int | None = None,
        latent_rope_subheads: int | None = None,
        use_cope: bool = False,
        cope_max_pos: int = 16,
        cope_soft_onehot_pos: bool = False,
        cope_talking_heads: bool = False,
        use_rel_proj_pos_bias: bool = False,
        rel_proj_num_distance_basis: int = 16,
        rel_proj_max_dist: int = 1024,
        hybrid_module: nn.Module | None = None,
        hybrid_mask_kwarg: str | None = None,
        hybrid_fold_axial_dim: int | None = None,
        hybrid_learned_mix: bool = False,
    ):
        super().__init__()
        if one_kv_head:  # x-transformers' spelling of kv_heads=1
            if kv_heads not in (None, 1):
                raise ValueError(f"one_kv_head=True means kv_heads=1, got kv_heads={kv_heads}")
            kv_heads = 1
        learned_sink = learned_sink or head_learned_sink  # x-transformers' spelling
        if not isinstance(causal, bool) or not isinstance(flash, bool):
            raise TypeError(f"causal and flash must be bools, got causal={causal!r}, flash={flash!r}")
        self.causal = causal
        self.flash = flash
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
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.dim_context = dim if dim_context is None else dim_context
        self.dropout = dropout
        self.backend = backend
        # multi-latent attention (x-transformers' use_latent_q / use_latent_kv, DeepSeek's MLA): queries and/or keys
        # and values projected from a bias-less latent of the input; latent_rope_subheads: the last such key heads
        # come straight from the input (their "decoupled rope" heads), the others from the latent
        for name, on, width in (("dim_latent_q", use_latent_q, dim_latent_q), ("dim_latent_kv", use_latent_kv, dim_latent_kv)):
            if on and not _positive_int(width):
                raise ValueError(f"use_{name[4:]} needs {name}, a positive integer, got {width!r}")
            if width is not None and not on:
                raise ValueError(f"{name} was given but use_{name[4:]} is off; set use_{name[4:]}=True")
        if latent_rope_subheads is not None:
            if not use_latent_kv:
                raise ValueError("latent_rope_subheads splits the keys of multi-latent attention: it needs use_latent_kv")
            if not _positive_int(latent_rope_subheads) or latent_rope_subheads >= kv_heads or kv_heads != heads:
                raise ValueError(f"latent_rope_subheads must be a positive integer below kv_heads={kv_heads}, without "
                                 f"grouped-query attention (kv_heads == heads), got {latent_rope_subheads!r}")
        self.rope_subheads = latent_rope_subheads or 0
        self.to_latent_q = nn.Linear(dim, dim_latent_q, bias=False) if use_latent_q else None
        self.to_latent_kv = nn.Linear(self.dim_context, dim_latent_kv, bias=False) if use_latent_kv else None
        q_in = dim_latent_q if use_latent_q else dim
        kv_in = dim_latent_kv if use_latent_kv else self.dim_context
        self.to_q = nn.Linear(q_in, heads * dim_head, bias=bias)
        self.to_k = nn.Linear(kv_in, (kv_heads - self.rope_subheads) * dim_head, bias=bias)
        self.to_v = nn.Linear(kv_in, kv_heads * dim_head, bias=bias)
        self.to_rotateable_k = nn.Linear(self.dim_context, self.rope_subheads * dim_head, bias=False) \
            if self.rope_subheads else None
        if inverted_attention and (num_mem_kv or learned_sink):
            raise ValueError("inverted_attention with memory keys or a learned sink is not supported (every query, padded "
                             "ones too, would share their softmax over the queries)")
        self._init_scoring(heads, dim_head, causal, flash, l2_distance=l2_distance, cog_signed=cog_signed, sigmoid=sigmoid,
                           inverted_attention=inverted_attention, gumbel_softmax=gumbel_softmax,
                           gumbel_softmax_temp=gumbel_softmax_temp, gumbel_softmax_hard=gumbel_softmax_hard, laser=laser,
                           laser_softclamp_value=laser_softclamp_value, use_cope=use_cope, cope_max_pos=cope_max_pos,
                           cope_soft_onehot_pos=cope_soft_onehot_pos, cope_talking_heads=cope_talking_heads)
        self.rel_proj_pos_bias = None
        if use_rel_proj_pos_bias:
            self.rel_proj_pos_bias = RelativeProjPositionalBias(dim, heads, num_distance_basis=rel_proj_num_distance_basis,
                                                                max_dist=rel_proj_max_dist)
        eps = 1e-6 if qk_norm_eps is None else qk_norm_eps
        if qk_norm_dim_scale and not qk_norm:
            raise ValueError("qk_norm_dim_scale scales the q/k norms per head and feature: it needs qk_norm=True")
        if qk_norm_dim_scale:  # per-head gains, d ** -0.25 each at init: logits sum_e qhat_e khat_e (x-transformers)
            self.q_norm = HeadRMSNorm(heads, dim_head, eps=eps, init=dim_head**-0.25)
            self.k_norm = HeadRMSNorm(kv_heads, dim_head, eps=eps, init=dim_head**-0.25)
        else:
            self.q_norm = RMSNorm(dim_head, eps=eps) if qk_norm else None
            self.k_norm = RMSNorm(dim_head, eps=eps) if qk_norm else None
        # x-transformers' value_rmsnorm: RMS-normalise each value head, gain (1 + weight) per kv head
        self.v_norm = HeadRMSNorm(kv_heads, dim_head, eps=eps, unit_offset=True) if value_rmsnorm else None
        self.orthog_projected_values = bool(orthog_projected_values)
        self.orthog_projected_values_per_head = bool(orthog_projected_values_per_head)
        orthog_parts = int(self.orthog_projected_values) + int(self.orthog_projected_values_per_head)
        # x-transformers' learned_value_residual_mix: the value residual's mix per position and kv head,
        # sigmoid(Linear(x)); without it a given value_residual is mixed in at 0.5
        self.to_value_residual_mix = nn.Linear(dim, kv_heads) if learned_value_residual_mix else None
        # x-transformers' data_dependent_alibi (forgetting transformer): log forget gates per position and head,
        # summed between key and query as an additive bias (causal: one gate per head; else two, one per direction)
        dd = dict(bias_init=5.0, post_log_scale=1.0)
        unknown = set(data_dependent_alibi_kwargs or {}) - set(dd)
        if unknown or (data_dependent_alibi_kwargs and not data_dependent_alibi):
            raise ValueError(f"data_dependent_alibi_kwargs takes bias_init and post_log_scale with data_dependent_alibi=True, "
                             f"got {data_dependent_alibi_kwargs!r}")
        dd.update(data_dependent_alibi_kwargs or {})
        self.dd_alibi_causal = causal
        self.dd_alibi_post_log_scale = float(dd["post_log_scale"])
        self.to_forget_gates = None
        if data_dependent_alibi:
            self.to_forget_gates = nn.Linear(dim, heads * (1 if causal else 2))
            nn.init.constant_(self.to_forget_gates.bias, float(dd["bias_init"]))
        if orthog_parts and value_rmsnorm:
            raise ValueError("orthog_projected_values projects onto the values before value_rmsnorm: the two together "
                             "are not supported")
        if dim_out is not None and not _positive_int(dim_out):
            raise ValueError(f"dim_out must be a positive integer, got {dim_out!r}")
        self.dim_out = dim if dim_out is None else dim_out
        self.to_out = nn.Linear(heads * dim_head * max(1, orthog_parts), self.dim_out, bias=bias)
        if zero_init_output:  # x-transformers' zero_init_output: the block starts as the identity of the residual
            nn.init.zeros_(self.to_out.weight)
            if self.to_out.bias is not None:
                nn.init.zeros_(self.to_out.bias)
        self.num_mem_kv = num_mem_kv
        if num_mem_kv > 0:
            self.mem_k = nn.Parameter(torch.randn(kv_heads, num_mem_kv, dim_head))  # (h_kv, M, d)
            self.mem_v = nn.Parameter(torch.randn(kv_heads, num_mem_kv, dim_head))
        self.head_attn_sink = nn.Parameter(torch.zeros(heads)) if learned_sink else None  # (h,)
        self.softclamp_value = float(logit_softclamp_value) if softclamp_logits else None
        # gated attention (x-transformers' gate_values / output_gate, HyGA): one gate logit per head or per
        # feature, from the queries' input (x gate) and/or the attention output (h gate), summed, then
        # sigmoid (SiLU with swiglu_values) times the attention output, before to_out
        for name, on, rank, headwise in (("gate_values", gate_values, gate_values_rank, gate_values_headwise),
                                         ("output_gate", output_gate, output_gate_rank, output_gate_headwise)):
            if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
                raise ValueError(f"{name}_rank must be a positive integer, got {rank!r}")
            if (rank is not None or headwise) and not on:
                raise ValueError(f"{name}_rank / {name}_headwise were given but {name} is off; set {name}=True")
            if rank is not None and headwise:
                raise ValueError(f"{name}_rank cannot be set with {name}_headwise (the headwise gate projects to heads directly)")
        if swiglu_values and not (gate_values or output_gate):
            raise ValueError("swiglu_values changes the gate's activation: it needs gate_values or output_gate")
        inner = heads * dim_head
        act = nn.SiLU() if low_rank_silu_gates else None
        self.to_v_gate = _gate_linear(dim, heads if gate_values_headwise else inner, gate_values_rank, act) \
            if gate_values else None
        # x-transformers' gate_value_heads: each head's output times sigmoid(Linear(x)), open at init (bias 10)
        self.to_v_head_gate = None
        if gate_value_heads:
            self.to_v_head_gate = nn.Linear(dim, heads)
            nn.init.zeros_(self.to_v_head_gate.weight)
            nn.init.constant_(self.to_v_head_gate.bias, 10.0)
        self.to_output_gate = _gate_linear(inner, heads if output_gate_headwise else inner, output_gate_rank, act) \
            if output_gate else None
        self.gate_activation = F.silu if swiglu_values else torch.sigmoid
        # x-transformers' hybrid_module: a user's sequence module beside attention, mixed in before to_out (hybrid.py)
        self.hybrid = make_hybrid(hybrid_module, dim=dim, heads=heads, dim_head=dim_head, causal=causal,
                                  fold_axial_dim=hybrid_fold_axial_dim, mask_kwarg=hybrid_mask_kwarg,
                                  learned_mix=hybrid_learned_mix)

    def _init_scoring(self, heads: int, dim_head: int, causal: bool, flash: bool, *, l2_distance, cog_signed, sigmoid,
                      inverted_attention, gumbel_softmax, gumbel_softmax_temp, gumbel_softmax_hard, laser,
                      laser_softclamp_value, use_cope, cope_max_pos, cope_soft_onehot_pos, cope_talking_heads) -> None:
        """The options that change how logits become weights (x-transformers' ``Attend`` options); each runs the
        explicit float32 path (``_explicit_attention``), which applies them in x-transformers' order."""
        if sum(map(bool, (l2_distance, sigmoid, gumbel_softmax))) > 1:
            raise ValueError("choose at most one of l2_distance, sigmoid and gumbel_softmax")
        if laser and cog_signed:
            raise ValueError("laser takes the log of weights @ exp(values): cog_signed's negative weights can make it "
                             "0 or negative (NaN in x-transformers); use one of them")
        for name, value in (("gumbel_softmax_temp", gumbel_softmax_temp), ("laser_softclamp_value", laser_softclamp_value)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if use_cope:
            if not causal:
                raise ValueError("use_cope (contextual positions) counts the keys up to each query: it needs causal=True")
            if cope_talking_heads or cope_soft_onehot_pos:
                raise ValueError("cope_talking_heads and cope_soft_onehot_pos are not supported (use_cope without them "
                                 "is)")
            if not _positive_int(cope_max_pos):
                raise ValueError(f"cope_max_pos must be a positive integer, got {cope_max_pos!r}")
        elif cope_talking_heads or cope_soft_onehot_pos:
            raise ValueError("cope_talking_heads / cope_soft_onehot_pos were given but use_cope is off")
        self.l2_distance = bool(l2_distance)
        self.cog_signed = bool(cog_signed)
        self.inverted = bool(inverted_attention)
        self.score = "sigmoid" if sigmoid else "gumbel" if gumbel_softmax else "softmax"
        self.gumbel_temp, self.gumbel_hard = float(gumbel_softmax_temp), bool(gumbel_softmax_hard)
        self.laser_value = float(laser_softclamp_value) if laser else None
        self.cope = CoPE(dim_head, cope_max_pos) if use_cope else None

    @property
    def explicit(self) -> bool:
        """Whether every call runs the explicit float32 path (softclamped logits, cog, sigmoid, inverted, gumbel,
        laser, CoPE: what no fused kernel does); such a module runs on the padded path only. (l2 distance alone runs
        the fused kernels, through ``_l2_kernel_inputs``, on the padded path too.)"""
        return (self.softclamp_value is not None or self.cog_signed or self.inverted or self.score != "softmax"
                or self.laser_value is not None or self.cope is not None
                or (self.l2_distance and self.head_attn_sink is not None))  # the sink's logit is no distance

    def _check_scoring_call(self, context, kv, past_kv, causal: bool, rotary) -> None:
        """The calls the scoring options cannot serve, refused by name (never computed as something else)."""
        cross = context is not None or kv is not None
        if self.inverted and not cross:
            raise ValueError("inverted_attention normalises each key's weights over the queries: it is cross-attention "
                             "only (x-transformers' cross_attn_inverted_attention)")
        if self.inverted and kv is not None:
            raise ValueError("inverted_attention normalises over the queries of one call: it runs without a KV cache "
                             "(a cached context would see the new queries alone)")
        if self.rel_proj_pos_bias is not None and cross:
            raise ValueError("use_rel_proj_pos_bias gives relative positions within one sequence: self-attention only")

    def _rotate(self, t: Tensor, angles: Tensor) -> Tensor:
        """Rotary positions on ``t (b, h|h_kv, n, d)``; with ``latent_rope_subheads`` on its last that many heads only
        (multi-latent attention's decoupled rope, as x-transformers' ``rotate_num_heads``)."""
        r = self.rope_subheads
        if not r:
            return apply_rotary(t, angles)
        return torch.cat((t[:, :-r], apply_rotary(t[:, -r:], angles)), dim=1)

    @torch.no_grad()
    def qk_clip_(self, pre_softmax_attn, tau: float = 100.0) -> None:
        """MuonClip's qk-clip (Kimi K2, x-transformers' ``qk_clip_``): for each head whose largest logit in
        ``pre_softmax_attn`` exceeds ``tau``, scale its query and key projections in place so that the logit
        becomes ``tau`` (``gamma = tau / max``: queries by ``gamma / s``, keys by ``s``, ``s = sqrt`` of the
        smallest ``gamma`` of the heads sharing the key head, so each head's logits scale by its own ``gamma``;
        biases and memory keys too). Heads at or below ``tau`` are left as they are.

        Args:
            pre_softmax_attn: ``(b, h, i, j)`` logits, or the ``AttnIntermediate`` whose ``pre_softmax_attn``
                holds them (masked keys ``-inf`` and dead rows 0 never trigger a clip, ``tau`` being positive).
            tau: the largest logit allowed, a positive number.

        Raises:
            ValueError: no logits (a ``flash=True`` module records none), a bad ``tau``, or q/k norms whose gains the
                heads share (``qk_norm`` without ``qk_norm_dim_scale``: the norms undo a weight scale).
        """
        logits = pre_softmax_attn if isinstance(pre_softmax_attn, Tensor) else \
            getattr(pre_softmax_attn, "pre_softmax_attn", None)
        if not isinstance(logits, Tensor) or logits.dim() != 4 or logits.shape[1] != self.heads:
            raise ValueError(f"qk_clip_ needs the logits (b, h={self.heads}, i, j) or an AttnIntermediate holding them "
                             f"(return_intermediates=True, flash=False), got {getattr(logits, 'shape', type(logits))}")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"tau must be a positive finite number, got {tau!r}")
        if self.q_norm is not None and not isinstance(self.q_norm, HeadRMSNorm):
            raise ValueError("qk_clip_ cannot clip a module with qk_norm: its norms (gains shared by the heads) undo a "
                             "weight scale; use qk_norm_dim_scale=True (per-head gains, which qk_clip_ scales)")
        top = logits.detach().float().amax(dim=(0, 2, 3))  # (h,)
        gamma = torch.where(top > tau, tau / top.clamp_min(tau), torch.ones_like(top))  # (h,) in (0, 1]
        g = self.heads // self.kv_heads
        k_scale = gamma.view(self.kv_heads, g).amin(dim=1).sqrt()  # (h_kv,)
        q_scale = gamma / k_scale.repeat_interleave(g)  # (h,)
        d = self.dim_head
        if self.q_norm is not None:  # per-head gains (h, d): the norms set the size of q and k
            self.q_norm.weight.mul_(q_scale.to(self.q_norm.weight.dtype)[:, None])
            self.k_norm.weight.mul_(k_scale.to(self.k_norm.weight.dtype)[:, None])
            return
        qs = q_scale.repeat_interleave(d)
        self.to_q.weight.mul_(qs.to(self.to_q.weight.dtype)[:, None])
        if self.to_q.bias is not None:
            self.to_q.bias.mul_(qs.to(self.to_q.bias.dtype))
        ks = k_scale.repeat_interleave(d)  # (h_kv * d,): to_k's heads first, then the rotateable ones
        n_k = self.to_k.weight.shape[0]
        self.to_k.weight.mul_(ks[:n_k].to(self.to_k.weight.dtype)[:, None])
        if self.to_k.bias is not None:
            self.to_k.bias.mul_(ks[:n_k].to(self.to_k.bias.dtype))
        if self.to_rotateable_k is not None:
            self.to_rotateable_k.weight.mul_(ks[n_k:].to(self.to_rotateable_k.weight.dtype)[:, None])
        if self.num_mem_kv:
            self.mem_k.mul_(k_scale.to(self.mem_k.dtype)[:, None, None])

    def muon_parameters(self) -> list[nn.Parameter]:
        """The matrices Muon should optimise (x-transformers' ``muon_parameters``): the value and output projections'
        weights (queries and keys are left to qk-clip and the other optimiser)."""
        return [self.to_v.weight, self.to_out.weight]

    @property
    def extra_keys(self) -> int:
        """Keys every query sees besides the inputs' own: the sink (if any) and the memory keys."""
        return self.num_mem_kv + (self.head_attn_sink is not None)

    @property
    def packable(self) -> bool:
        """Whether the unpadded (packed) path can run this module (no extra keys, no softclamp)."""
        return (self.extra_keys == 0 and not self.explicit and not self.l2_distance and not self.orthog
                and self.to_forget_gates is None
                and self.rel_proj_pos_bias is None and not self.rope_subheads and self.hybrid is None)

    @property
    def orthog(self) -> bool:
        """Whether the output is projected orthogonally to the values (x-transformers'
        ``orthog_projected_values``): one projection over a sample's whole sequence, so it runs on the
        padded path, in self-attention, without a KV cache."""
        return self.orthog_projected_values or self.orthog_projected_values_per_head

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

    def _project_q(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        """Queries ``(..., h, d)`` of ``x (..., c)``, q-normed (through the latent with ``use_latent_q``)."""
        if self.to_latent_q is not None:  # bias-less: a selected (zero) row stays 0
            q = self.to_q(self._linear(self.to_latent_q, x, keep))
        else:
            q = self._linear(self.to_q, x, keep)
        q = q.unflatten(-1, (self.heads, self.dim_head))
        return q if self.q_norm is None else self.q_norm(q)

    def _project_kv(self, source: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values ``(..., h_kv, d)`` of ``source (..., c_ctx)``, k-normed (not rotated); with
        ``use_latent_kv`` both come from one bias-less latent of ``source`` (the last ``latent_rope_subheads`` key
        heads from ``source`` itself)."""
        if self.to_latent_kv is not None:
            latent = self._linear(self.to_latent_kv, source, keep)
            k, v = self.to_k(latent), self.to_v(latent)
            if self.to_rotateable_k is not None:
                k = torch.cat((k, self._linear(self.to_rotateable_k, source, keep)), dim=-1)
        else:
            k, v = self._linear(self.to_k, source, keep), self._linear(self.to_v, source, keep)
        k = k.unflatten(-1, (self.kv_heads, self.dim_head))
        v = v.unflatten(-1, (self.kv_heads, self.dim_head))
        if self.v_norm is not None:  # a selected (zero) source gives v = 0 (or the bias), finite
            v = self.v_norm(v)
        return (k if self.k_norm is None else self.k_norm(k)), v

    def _output(self, out: Tensor, x: Tensor, keep: Tensor | None = None, rows_ok: Tensor | None = None,
                values: Tensor | None = None) -> Tensor:
        """``out (..., h, d)`` -> ``(..., c)``: the output projection. ``x (..., c)`` is the queries' input (what
        an output option such as a per-head gate reads); ``keep``: rows selected to 0 before the projection
        (whatever a kernel returned for padded queries never reaches ``to_out``); ``rows_ok``: rows that
        are exactly 0 after it (a bias would move dead rows off 0). ``values (b, i, h_kv, d)``: with
        ``orthog_projected_values``, the new values (masked ones selected to 0) that ``out`` is projected off."""
        if self.to_v_head_gate is not None:  # padded rows' x selected to 0 first; a dead row's out is 0 and stays 0
            xs = x if keep is None else torch.where(keep[..., None], x, 0.0)
            out = out * torch.sigmoid(self.to_v_head_gate(xs))[..., None].to(out.dtype)
        if self.to_v_gate is not None or self.to_output_gate is not None:
            out = self._gate(out, x, keep)
        flat = out.flatten(-2) if values is None else self._orthog(out, values)
        out = self._linear(self.to_out, flat, keep)
        return out if rows_ok is None else torch.where(rows_ok[..., None], out, 0.0)

    def _orthog(self, out: Tensor, values: Tensor) -> Tensor:
        """x-transformers' ``orthog_project``: ``out (b, i, h, d)`` minus its projection onto the values
        ``(b, i, h_kv, d)`` (each query head paired with its key/value head), both flattened over the whole
        sample (positions, heads and features), in float64; once per option (``_per_head`` flattens the same
        way), concatenated: ``(b, i, parts * h * d)``. Dead rows of ``out`` and masked values are 0 here, so
        they add nothing to the dot product or the norm."""
        g = self.heads // self.kv_heads
        vv = values.repeat_interleave(g, dim=-2) if g > 1 else values  # query head m uses kv head m // g
        o, y = out.flatten(1).double(), vv.flatten(1).double()
        unit = F.normalize(y, dim=-1)
        proj = (o - (o * unit).sum(-1, keepdim=True) * unit).to(out.dtype).reshape(*out.shape[:2], -1)
        parts = int(self.orthog_projected_values) + int(self.orthog_projected_values_per_head)
        return proj if parts == 1 else torch.cat([proj] * parts, dim=-1)

    def _gate(self, out: Tensor, x: Tensor, keep: Tensor | None) -> Tensor:
        """Gated attention: ``out (..., h, d) * act(x gate + h gate)``. The x gate reads ``x`` with the rows
        ``keep`` drops selected to 0 first; a dead row's ``out`` is 0, so it stays 0 whatever its gate."""
        h, d = self.heads, self.dim_head

        def heads_of(g: Tensor) -> Tensor:  # (..., h) -> (..., h, 1); (..., h * d) -> (..., h, d)
            return g[..., None] if g.shape[-1] == h and h * d != h else g.unflatten(-1, (h, d))

        logits = 0.0
        if self.to_v_gate is not None:
            xs = x if keep is None else torch.where(keep[..., None], x, 0.0)
            logits = logits + heads_of(self.to_v_gate(xs))
        if self.to_output_gate is not None:
            logits = logits + heads_of(self.to_output_gate(out.flatten(-2)))
        return out * self.gate_activation(logits)

    def project_kv(self, source: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values ``(b, h_kv, j, d)`` of ``source (b, j, c_ctx)`` (normed, not yet rotated);
        ``keep (b|1, j)``: positions of ``source`` selected to 0 first where False."""
        if source.shape[-1] != self.dim_context:
            raise ValueError(
                f"context must have feature size {self.dim_context} (dim_context), got shape {tuple(source.shape)}"
            )
        k, v = self._project_kv(source, keep)
        return k.transpose(1, 2), v.transpose(1, 2)

    @checked_once
    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        *,
        causal: bool | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
        rotary_pos_emb: tuple[Tensor, object] | None = None,
        bias: Tensor | None = None,
        attn_bias: Tensor | None = None,
        kv: tuple[Tensor, Tensor] | None = None,
        past_kv: tuple[Tensor, Tensor] | None = None,
        cache: AttnIntermediate | None = None,
        return_intermediates: bool = False,
        return_attn: bool = False,
        layout=None,
        value_residual: Tensor | None = None,
        kv_input: tuple[Tensor, Tensor] | None = None,
        hybrid=None,
        additional_key_values: tuple[Tensor, Tensor] | None = None,
        additional_key_value_mask: Tensor | None = None,
        kv_input_residual: Tensor | None = None,
        positions: tuple[Tensor, Tensor] | None = None,
        prev_attn: Tensor | None = None,
        _return_kv: bool = False,
    ):
        """Attend from ``x (b, i, c)``; x-transformers' call: ``attn(x)`` returns the output tensor.

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
                ``mix`` learned per position and head (``learned_value_residual_mix``) or 0.5. Keys/values
                handed in (``kv``, a cross-attention cache) are used as they are (mixed when cached).
            layout: the unpadded path's layout (``GroupedSelfLayout``, ``VarlenSelfLayout`` or
                ``PackedCrossLayout``, built by ``unpadded.py``): ``x`` is then the ``(T, c)`` packed real
                tokens, and the output too.
            kv_input: ``(k_input, v_input)``, each ``(b, i, c)`` like ``x``: self-attention projects its new keys
                from ``k_input`` and its new values from ``v_input`` (``x`` gives the queries; x-transformers'
                ``qkv_receive_diff_residuals``, which the stack passes). Padded layout, no ``context``.
            additional_key_values: ``(k, v)``, each ``(b, h_a, a, d)`` (x-transformers' keyword): ``a`` more keys
                and values every query sees (not rotated, not normed; no causal limit), e.g. another model's
                cached ones. ``h_a`` divides ``heads``: with ``h_a != kv_heads`` query head ``m`` uses added head
                ``n % h_a``, ``n`` being ``m``'s x-transformers index (so converted weights match x-transformers;
                ``m // g`` when ``h_a == kv_heads``). Not with ``data_dependent_alibi``, ``orthog_projected_values``
                or the unpadded layouts; they come after the memory keys in ``return_attn``'s weights.
            additional_key_value_mask: ``(b, a)`` bool, True = a real added key; masked ones (whatever they
                hold, NaN included) reach no output and no gradient.
            kv_input_residual: ``(b|1, j|1, c_src)`` added to the keys'/values' input (``x``, or ``context``)
                before their projections (x-transformers' keyword); rows of masked keys are selected away.
                Not with precomputed keys/values (``kv``).
            positions: ``(q_pos (b|1, i), k_pos (b|1, j))`` integer positions of the queries and keys, for
                ``use_rel_proj_pos_bias`` (the stack passes the real tokens' positions); default the index
                positions, the queries the last ``i`` keys.
            prev_attn: ``(b, h, i, j)`` the logits of the attention before (x-transformers' residual attention,
                ``residual_attn``): added to this one's scaled logits before the bias; runs the explicit float32
                path. Entries this call masks are selected away (the ``-inf`` the stack's logits hold there included).
            _return_kv: safeformer's own stack: return ``(out, (k, v))`` (and the weights and logits with
                ``return_attn``).

        Returns:
            ``out (b, i, c)``; ``(out, AttnIntermediate)`` with ``return_intermediates``; ``(out, weights)``
            with ``return_attn``. Rows that may attend to no key are exactly 0 after the output projection,
            and pass zero gradient (S2).
        """
        if layout is not None:
            from .unpadded import attend_layout  # the unpadded path's layouts live there

            if additional_key_values is not None or kv_input_residual is not None:
                raise ValueError("additional_key_values and kv_input_residual run on the padded layout only")
            out = attend_layout(self, x, layout)
            return (out, None) if _return_kv else out
        causal = self.causal if causal is None else causal
        if attn_bias is not None:  # x-transformers' name
            if bias is not None:
                raise ValueError("pass bias or attn_bias (x-transformers' name for it), not both")
            bias = attn_bias
        if cache is not None:
            kv, past_kv = self._from_cache(cache, context, kv, past_kv)
        pad = None
        if context_mask is not None or attn_mask is not None:
            mask, pad = self._xt_masks(x, context, kv, mask, context_mask, attn_mask)
        if rotary_pos_emb is not None:
            if rotary is not None:
                raise ValueError("pass rotary or rotary_pos_emb (x-transformers' form), not both")
            rotary = self._rotary_from_xt(rotary_pos_emb, x, context, kv)
        want_weights = return_attn or (return_intermediates and not self.flash)
        res = self._forward(x, context, mask=mask, causal=causal, rotary=rotary, bias=bias, kv=kv,
                            past_kv=past_kv, return_attn=want_weights, pad=pad, value_residual=value_residual,
                            kv_input=kv_input, hybrid=hybrid,
                            added=self._check_added(additional_key_values, additional_key_value_mask, x),
                            kv_residual=kv_input_residual, positions=positions, prev_attn=prev_attn)
        if _return_kv:
            return res if return_attn else res[:2]
        out, kv_out = res[:2]
        weights, logits = (res[2], res[3]) if want_weights else (None, None)
        if return_intermediates:
            cross = context is not None or kv is not None
            values = None
            if kv_out is not None and value_residual is None:  # the new positions' values (x-transformers' values)
                v_all = kv_out[1]
                new = v_all.shape[2] if kv is not None else (context if context is not None else x).shape[1]
                values = v_all[:, :, v_all.shape[2] - new:]
            return out, AttnIntermediate(post_softmax_attn=weights, layer_type="c" if cross else "a", cached_kv=kv_out,
                                         pre_softmax_attn=logits, values=values)
        if return_attn:
            return out, weights
        return out

    def _from_cache(self, cache, context, kv, past_kv):
        """``(kv, past_kv)`` from an ``AttnIntermediate`` passed as ``cache`` (x-transformers' decoding)."""
        if kv is not None or past_kv is not None:
            raise ValueError("pass cache (an AttnIntermediate) or kv / past_kv, not both")
        cached = getattr(cache, "cached_kv", None)
        if cached is None:
            raise TypeError(f"cache must be what return_intermediates=True returned (an AttnIntermediate with "
                            f"cached_kv), got {type(cache).__name__}")
        if cache.layer_type == "c":
            if context is not None:
                raise ValueError("a cross-attention cache answers for its context: pass context only on the first call")
            return cached, None
        return None, cached

    def _xt_masks(self, x, context, kv, mask, context_mask, attn_mask):
        """x-transformers' ``context_mask`` and ``attn_mask`` folded into the one ``mask``; returns the mask
        and, in self-attention with a ``(b, j)`` padding mask, that padding of ``x`` (its rows exactly 0)."""
        b, i = x.shape[:2]
        cross = context is not None or kv is not None
        pad = None
        if isinstance(mask, SelectedMask):
            raise ValueError("context_mask and attn_mask are x-transformers' keywords; the stack passes one mask")
        if context_mask is not None:
            if not cross:
                raise ValueError("context_mask was given without a context; pass context=... as well")
            j = context.shape[1] if context is not None else kv[0].shape[2]
            validate_mask(context_mask, "context_mask", shape=(b, j), device=x.device)
            full = context_mask[:, None, None, :]  # (b, 1, 1, j)
            if mask is not None:  # then mask is the padding of x: its rows are dead (exactly 0)
                validate_mask(mask, "mask", shape=(b, i), device=x.device)
                full = full & mask[:, None, :, None]  # (b, 1, i, j)
            mask = full
        if attn_mask is not None:
            validate_mask(attn_mask, "attn_mask", device=x.device)
            if attn_mask.dim() not in (2, 3, 4) or (attn_mask.dim() == 3 and attn_mask.shape[0] not in (1, self.heads)):
                raise ValueError(f"attn_mask must be (i, j), (h={self.heads}, i, j) or (b|1, h|1, i, j) (x-transformers' "
                                 f"layouts: a 3-d mask is per head), got {tuple(attn_mask.shape)}")
            extra = attn_mask if attn_mask.dim() == 4 else attn_mask[None] if attn_mask.dim() == 3 else attn_mask[None, None]
            if mask is not None and not cross and isinstance(mask, Tensor) and mask.dim() == 2:
                validate_mask(mask, "mask", device=x.device)
                if mask.shape[0] == b and mask.shape[1] >= i:
                    pad = mask[:, mask.shape[1] - i:]  # padding of x itself: rows exactly 0
                mask = mask[:, None, None, :]
            mask = extra if mask is None else as_attention_mask(mask, b, self.heads, i, extra.shape[-1]) & extra
        return mask, pad

    def _rotary_from_xt(self, rotary_pos_emb, x, context, kv):
        """x-transformers' ``(freqs, xpos_scale)`` -> safeformer's ``(q_angles, k_angles)``."""
        if not (isinstance(rotary_pos_emb, (tuple, list)) and len(rotary_pos_emb) == 2):
            raise ValueError("rotary_pos_emb must be (freqs, xpos_scale) as RotaryEmbedding returns it")
        freqs, scale = rotary_pos_emb
        if isinstance(scale, Tensor) or scale != 1:
            raise ValueError("rotary_pos_emb with an xpos scale (use_xpos=True) is not supported; use xpos-free rotary")
        if not isinstance(freqs, Tensor) or freqs.dim() not in (2, 3):
            raise ValueError(f"rotary_pos_emb freqs must be (b|1, n, d_rot), got {getattr(freqs, 'shape', type(freqs))}")
        if context is not None or kv is not None:
            raise ValueError("rotary_pos_emb rotates self-attention only (x-transformers' context_rotary_pos_emb "
                             "is not supported)")
        if freqs.dim() == 2:
            freqs = freqs[None]
        i = x.shape[1]
        if freqs.shape[-2] < i:
            raise ValueError(f"rotary_pos_emb covers {freqs.shape[-2]} positions, fewer than the {i} queries")
        ang = freqs[:, None, -i:]  # (b|1, 1, i, d_rot): the new positions (queries and new keys alike)
        return ang, ang

    def _forward(self, x, context, *, mask=None, causal=False, rotary=None, bias=None, kv=None, past_kv=None,
                 return_attn=False, pad=None, value_residual=None, kv_input=None, hybrid=None, positions=None,
                 added=None, kv_residual=None, prev_attn=None):
        """The attention itself: ``(out, (k, v))`` (and the weights with ``return_attn``). ``pad (b, i)``:
        padding of ``x`` in self-attention when ``mask`` no longer shows it (an ``attn_mask`` was folded in)."""
        inputs_finite = isinstance(mask, SelectedMask)
        if inputs_finite:  # the stack selected its padded inputs to 0: nothing to select again here
            mask = mask.mask
        self._check_call(x, context, kv, past_kv)
        if self.hybrid is not None and (context is not None or kv is not None or (past_kv is not None and hybrid is None)):
            raise ValueError("hybrid_module runs beside self-attention, and continues its state through a layer "
                             "stack's KV cache only (not cross-attention, not Attention(cache=...))")
        if self.orthog and (context is not None or kv is not None or past_kv is not None):
            raise ValueError("orthog_projected_values projects onto the values of the sequence itself: it runs in "
                             "self-attention without a KV cache (a cache would project the new positions alone, so "
                             "cached and uncached results would differ); decode with cache_kv=False")
        if self.to_forget_gates is not None and (context is not None or kv is not None or past_kv is not None):
            raise ValueError("data_dependent_alibi sums forget gates over the sequence itself: it runs in self-attention "
                             "without a KV cache; decode with cache_kv=False")
        self._check_scoring_call(context, kv, past_kv, causal, rotary)
        if added is not None and (self.orthog or self.to_forget_gates is not None):
            raise ValueError("additional_key_values cannot be combined with orthog_projected_values or "
                             "data_dependent_alibi (both are defined over the sequence's own keys)")
        if kv_residual is not None and (kv is not None or kv_input is not None):
            raise ValueError("kv_input_residual is added to the input of the keys/values: not with precomputed keys/"
                             "values (kv, a cross-attention cache) or kv_input")
        b, i = x.shape[:2]
        source = x if context is None else context
        if kv is not None:
            j = kv[0].shape[2]
        else:
            j = source.shape[1] + (past_kv[0].shape[2] if past_kv is not None else 0)
        self_pad = None  # (b, i): in self-attention, a (b, j) padding mask marks padding of x itself
        if not inputs_finite and context is None and kv is None and isinstance(mask, Tensor):
            self_pad = _self_padding(mask, b, i, j)
        if pad is not None:
            self_pad = pad if self_pad is None else self_pad & pad
        if self.rel_proj_pos_bias is not None:  # from the queries' input, padded rows selected to 0 first
            xs = x if self_pad is None else torch.where(self_pad[..., None], x, 0.0)
            rp = self.rel_proj_pos_bias(xs, seq_len_k=j, positions=positions).to(x.dtype)  # (b, h, i, j)
            bias = rp if bias is None else bias + rp
        if self.to_forget_gates is not None:  # the forget-gate bias over the real positions, added to any bias
            reach = None if bias is None else bias.to(x.dtype) != float("-inf")
            _, real = _alive(mask, causal, b, self.heads, i, j, x.device, reach)
            if self_pad is not None:
                real = self_pad if real is None else real & self_pad
            dd = self._forget_bias(x, real)  # (b, h, i, i)
            bias = dd if bias is None else bias + dd
        user_mask, j_user = mask, j
        if added is not None:  # the added keys come before the sequence's own (after sink and memory keys)
            mask, bias = _prepend_keys(mask, bias, added[2], b, self.heads, i, j, added[0].shape[2], x.device)
            j = j + added[0].shape[2]
        ext = self.extra_keys
        sink_only = None  # (b|1, i): rows that see a real key; with the sink alone a row is dead (adds exactly 0)
        if self.head_attn_sink is not None and self.num_mem_kv == 0:
            reach = None if bias is None else bias.to(x.dtype) != float("-inf")
            sink_only, _ = _alive(mask, causal, b, self.heads, i, j, x.device, reach)
        if ext:  # the sink and memory keys come first; every query sees them (bottom-right causal keeps that)
            mask, bias = self._extend(mask, bias, b, i, j, x, sink_only)
            j = j + ext
        if inputs_finite and self.to_out.bias is None and self_pad is None and not self.orthog and self.hybrid is None:
            rows_ok, keys_ok = None, None  # nothing to select: attend zeroes dead rows itself
        else:
            reach = None
            if bias is not None and isinstance(bias, Tensor) and bias.is_floating_point():
                reach = bias.to(x.dtype) != float("-inf")  # a bias of -inf (in x's dtype) masks its key too
            rows_ok, keys_ok = _alive(mask, causal, b, self.heads, i, j, x.device, reach)
        if self_pad is not None:
            # padded positions of x are no queries either: selected to 0 at the input and at the output
            # (the mask stays a broadcast key padding mask: no (b, 1, i, j) tensor for the kernel)
            rows_ok = self_pad if rows_ok is None else rows_ok & self_pad
        # select masked inputs away *before* the projections: a NaN there would otherwise reach the
        # projection weights' gradients (0 * NaN) even though attend() never uses it
        # (masked_linear: the projection of the selected input, saving x itself rather than the copy)
        q = self._project_q(x, rows_ok).transpose(1, 2)  # (b, h, i, d)
        if self_pad is not None:  # the kernel sees padded queries as live rows: keep its backward there out
            q = _grad_select(self_pad[:, None, :, None], q)
        if kv is not None:
            k, v = kv
        else:
            new_keep = None if keys_ok is None else keys_ok[:, j - source.shape[1]:]
            if kv_input is None:  # new keys (kv_input_residual: x-transformers' residual added to their input)
                k, v = self.project_kv(source if kv_residual is None else source + kv_residual, new_keep)
            else:  # qkv_receive_diff_residuals: keys and values of their own inputs
                k, v = self.project_kv(self._check_kv_input(kv_input, x, context, kv)[0], new_keep)[0], \
                    self.project_kv(kv_input[1], new_keep)[1]
            if value_residual is not None:
                v = self._mix_values(v, value_residual, source, new_keep, context is None)
            if rotary is not None:
                k = self._rotate(k, rotary[1])
            if self.orthog:  # the new values (b, i, h_kv, d), masked ones selected to 0
                v_orthog = v.transpose(1, 2) if keys_ok is None else \
                    torch.where(keys_ok[:, j - i:, None, None], v.transpose(1, 2), 0.0)
            if past_kv is not None:
                k = torch.cat((past_kv[0], k), dim=2)
                v = torch.cat((past_kv[1], v), dim=2)
        if rotary is not None:
            q = self._rotate(q, rotary[0])
        if self_pad is not None:  # keys that only padded queries see are masked keys too: guard their gradients
            seen = as_attention_mask(user_mask, b, self.heads, i, j_user) & self_pad[:, None, :, None]  # (b, 1, i, j)
            if causal:
                seen = seen & causal_mask(i, j_user, device=x.device)
            key_seen = seen.any(dim=-2, keepdim=True).any(dim=1, keepdim=True).transpose(-1, -2)  # (b, 1, j, 1)
            k, v = _grad_select(key_seen, k), _grad_select(key_seen, v)
        kv_out = (k, v)  # for the cache: without the memory keys
        if ext:  # a sample whose queries are all padding sends its memory keys no gradient (the kernel's
            # backward there is not trusted)
            k, v = self._prepend_extra(k, v, None if self_pad is None else self_pad.any(dim=1))
        if added is not None:
            k, v = self._insert_added(k, v, added, ext)
        logits = None
        if return_attn or self.explicit or prev_attn is not None:
            out, weights, *more = _explicit_attention(
                q, k, v, mask=mask, causal=causal, bias=bias, softclamp=self.softclamp_value,
                dropout_p=self.dropout if self.training else 0.0, sink=self.head_attn_sink, scoring=self,
                return_logits=return_attn, prev_attn=prev_attn,
            )
            logits = more[0] if more else None
            if self.head_attn_sink is not None:
                weights = weights[..., 1:]  # the sink's weight is not a key's
                logits = None if logits is None else logits[..., 1:]
            if self_pad is not None:
                weights = torch.where(self_pad[:, None, :, None], weights, 0.0)
                logits = None if logits is None else torch.where(self_pad[:, None, :, None], logits, 0.0)
        else:
            weights = None
            out = None
        # q at dead rows and new k, v at masked keys are finite here (their inputs were selected to 0
        # above). Keys/values handed in (kv, past_kv) are input like any other: attend selects their
        # masked positions itself, unless the stack vouches for them (its own cache, a SelectedMask).
        # A bias can mask keys too: then attend selects as well (its selections also guard the gradients).
        if out is None:
            backend = self.backend
            if backend in ("flash", "cudnn") and ((self.head_attn_sink is not None and torch.is_grad_enabled())
                                                  or self.to_forget_gates is not None or k.shape[-1] != v.shape[-1]
                                                  or (bias is not None and bias.requires_grad)):
                backend = "math"  # the sink's gradient and learned biases (forget gates, T5) flow through the mask;
                # PoPE's keys (2 d features) differ from the values' d, which those kernels refuse
            selected = inputs_finite or (kv is None and past_kv is None and bias is None)
            e, scale = v.shape[-1], None
            if self.l2_distance:  # -|q - k|^2 * scale through the kernel (softmax alone: explicit otherwise)
                q, k, v = _l2_kernel_inputs(q, k, v, keys_ok)
                scale = self.dim_head**-0.5
            out = attend(
                q, k, v, mask=SelectedMask(mask) if selected else mask, causal=causal, bias=bias,
                dropout_p=self.dropout if self.training else 0.0, backend=backend, scale=scale,
            )[..., :e]  # (b, h, i, d)
        # padded queries: selected before to_out; dead rows: exactly 0 after it (a bias would move them)
        zero_rows = rows_ok if rows_ok is not None and (self.to_out.bias is not None or self_pad is not None
                                                        or self.hybrid is not None) else None

        values = None
        out = out.transpose(1, 2)  # (b, i, h, d)
        if self.orthog:  # dead rows and padded queries are 0 before the projection (it sums over the sample)
            values = v_orthog
            if rows_ok is not None:
                out = torch.where(rows_ok[:, :, None, None], out, 0.0)
        if self.hybrid is not None:  # the hybrid module's output mixed in (dead rows: 0 after to_out all the same)
            out = self.hybrid(out, x, hybrid, self_pad)
        out = self._output(out, x, self_pad, zero_rows, values)  # (b, i, c)
        if return_attn:
            return out, kv_out, weights, logits
        return out, kv_out

    def _forget_bias(self, x: Tensor, real: Tensor | None) -> Tensor:
        """x-transformers' ``DataDependentAlibi``: ``F = cumsum(logsigmoid(Linear(x)) * post_log_scale)`` over the
        positions (float32; masked positions add 0, their x selected to 0 first), then ``F[i] - F[j]`` (causal),
        or that below the diagonal plus ``R[j] - R[i]`` of the second gates above it. ``(b, h, i, i)``."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        keep = None if real is None else real.expand(x.shape[0], x.shape[1])
        g = F.logsigmoid(self._linear(self.to_forget_gates, x, keep).to(dtype)) * self.dd_alibi_post_log_scale
        if keep is not None:
            g = torch.where(keep[..., None], g, 0.0)
        g = g.transpose(1, 2).cumsum(dim=-1)  # (b, h * (1|2), i)
        if self.dd_alibi_causal:
            return (g[..., :, None] - g[..., None, :]).to(x.dtype)
        f, r = g.chunk(2, dim=1)
        return ((f[..., :, None] - f[..., None, :]).tril() + (r[..., None, :] - r[..., :, None]).triu()).to(x.dtype)

    @staticmethod
    def _check_kv_input(kv_input, x: Tensor, context, kv) -> tuple[Tensor, Tensor]:
        if context is not None or kv is not None:
            raise ValueError("kv_input (separate key and value inputs) is for self-attention only: pass no context")
        if not (isinstance(kv_input, (tuple, list)) and len(kv_input) == 2
                and all(isinstance(t, Tensor) and t.shape == x.shape for t in kv_input)):
            raise ValueError(f"kv_input must be a pair (k_input, v_input) of tensors shaped like x {tuple(x.shape)}")
        return kv_input

    def _mix_values(self, v: Tensor, residual: Tensor, source: Tensor, keep: Tensor | None, self_attn: bool) -> Tensor:
        """``lerp(residual, v, mix)`` for the new values ``v (b, h_kv, j, d)`` (x-transformers' value residual);
        ``mix (b, h_kv, j, 1)`` from the source rows (masked ones selected to 0 first), or 0.5."""
        if not isinstance(residual, Tensor) or residual.shape != v.shape:
            raise ValueError(f"value_residual must have the new values' shape {tuple(v.shape)}, "
                             f"got {getattr(residual, 'shape', type(residual))}")
        if self.to_value_residual_mix is None:
            return residual.lerp(v, 0.5)
        if not self_attn:
            raise ValueError("learned_value_residual_mix reads the queries' input: self-attention only")
        mix = torch.sigmoid(self._linear(self.to_value_residual_mix, source, keep)).transpose(1, 2)[..., None]
        return residual.lerp(v, mix.to(v.dtype))

    def _extend(self, mask, bias, b: int, i: int, j: int, x: Tensor, real_rows: Tensor | None = None):
        """The mask and bias over ``[sink?, memory keys, keys]``: the extra keys visible to every query,
        at bias 0 (the sink at its learned logit). ``real_rows (b|1, i)``: with a sink and no memory keys,
        the rows that see a real key; the others do not see the sink either (dead rows: exactly 0, their
        gradients too, whatever a kernel does with them)."""
        ext = self.extra_keys
        if isinstance(mask, PreparedMask):
            mask = mask.combined
        if mask is None and real_rows is not None:
            mask = torch.ones(1, 1, 1, j, dtype=torch.bool, device=x.device)
        if mask is not None:
            m = as_attention_mask(mask, b, self.heads, i, j)  # (b|1, h|1, i|1, j)
            m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
            front = m.new_ones(*m.shape[:-1], ext)
            if real_rows is not None:
                front = real_rows[:, None, :, None]  # (b|1, 1, i, 1)
                lead = torch.broadcast_shapes(m.shape[:-1], front.shape[:-1])
                m, front = m.expand(*lead, j), front.expand(*lead, 1)
            mask = torch.cat((front, m), dim=-1)
        if bias is not None or self.head_attn_sink is not None:
            if bias is None:
                bias = x.new_zeros(1, 1, 1, j)
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).to(x.dtype)  # (b|1, h|1, i|1, j)
            front = bias.new_zeros(*bias.shape[:-1], ext)
            if self.head_attn_sink is not None:  # the sink's logit, per head
                bias = bias.expand(bias.shape[0], self.heads, *bias.shape[2:])
                sink = self.head_attn_sink.to(bias.dtype)[None, :, None, None].expand(*bias.shape[:-1], 1)
                front = torch.cat((sink, bias.new_zeros(*bias.shape[:-1], ext - 1)), dim=-1)
            bias = torch.cat((front, bias), dim=-1)
        return mask, bias

    def _check_added(self, added, added_mask, x: Tensor):
        """``additional_key_values`` checked: ``(k, v, mask or None)`` with masked keys/values selected to 0
        (so nothing a masked slot holds reaches a product, forward or backward), or ``None``."""
        if added is None:
            if added_mask is not None:
                raise ValueError("additional_key_value_mask was given without additional_key_values")
            return None
        if not (isinstance(added, (tuple, list)) and len(added) == 2
                and all(isinstance(t, Tensor) and t.dim() == 4 for t in added)):
            raise ValueError(f"additional_key_values must be a pair (k, v) of tensors (b, h_a, a, d), got "
                             f"{type(added).__name__}")
        k, v = added
        b = x.shape[0]
        if k.shape[0] != b or k.shape[3] != self.dim_head or v.shape != k.shape or k.shape[1] == 0 \
                or self.heads % k.shape[1]:
            raise ValueError(f"additional_key_values must be (k, v), each (b={b}, h_a, a, d={self.dim_head}) with h_a "
                             f"dividing heads={self.heads}, got {tuple(k.shape)} and {tuple(v.shape)}")
        mixed_ok = torch.is_autocast_enabled(x.device.type)
        for t, label in ((k, "keys"), (v, "values")):
            if not t.is_floating_point() or (t.dtype != x.dtype and not mixed_ok) or t.device != x.device:
                raise ValueError(f"additional_key_values {label} are {t.dtype} on {t.device}, expected {x.dtype} on "
                                 f"{x.device} (those of x)")
        if added_mask is not None:
            validate_mask(added_mask, "additional_key_value_mask", shape=(b, k.shape[2]), device=x.device)
            keep = added_mask[:, None, :, None]  # (b, 1, a, 1)
            k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
        return k, v, added_mask

    def _insert_added(self, k: Tensor, v: Tensor, added: tuple, at: int) -> tuple[Tensor, Tensor]:
        """``[sink?, memory, added, keys]``: the added keys/values after the first ``at`` keys. With ``h_a`` heads
        other than ``kv_heads`` both are expanded to the query heads: ours as grouped-query attention pairs them
        (``m // g``), the added ones as x-transformers does (its query head ``n`` uses added head ``n % h_a``)."""
        ak, av = added[0].to(k.dtype), added[1].to(v.dtype)
        h_a = ak.shape[1]
        if h_a != k.shape[1]:
            g = self.heads // self.kv_heads
            m = torch.arange(self.heads, device=k.device)
            idx = ((m % g) * self.kv_heads + m // g) % h_a  # our query head m is x-transformers' head n
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            ak, av = ak.index_select(1, idx), av.index_select(1, idx)
        return (torch.cat((k[:, :, :at], ak, k[:, :, at:]), dim=2),
                torch.cat((v[:, :, :at], av, v[:, :, at:]), dim=2))

    def _prepend_extra(self, k: Tensor, v: Tensor, live: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``[sink?, memory, keys]``: the sink key and value are 0 (its logit comes from the bias).
        ``live (b,)``: samples with a live query; the others' memory keys get no gradient."""
        b = k.shape[0]
        parts_k, parts_v = [], []
        if self.head_attn_sink is not None:
            parts_k.append(k.new_zeros(b, self.kv_heads, 1, self.dim_head))
            parts_v.append(v.new_zeros(b, self.kv_heads, 1, v.shape[-1]))
        if self.num_mem_kv:
            mk, mv = self.mem_k.to(k.dtype), self.mem_v.to(v.dtype)
            if self.k_norm is not None:  # (h_kv, M, d): the norm reads heads second to last
                mk = self.k_norm(mk.transpose(0, 1)).transpose(0, 1)
            mk, mv = mk[None].expand(b, -1, -1, -1), mv[None].expand(b, -1, -1, -1)
            if live is not None:
                mk, mv = _grad_select(live[:, None, None, None], mk), _grad_select(live[:, None, None, None], mv)
            parts_k.append(mk)
            parts_v.append(mv)
        return torch.cat((*parts_k, k), dim=2), torch.cat((*parts_v, v), dim=2)

    def _check_call(self, x, context, kv, past_kv) -> None:
        """The door's checks of ``forward``'s tensors (S9); the masks are checked where they are read."""
        if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor of shape (b, i, dim), got {getattr(x, 'shape', type(x))}")
        b = x.shape[0]
        if context is not None and (not isinstance(context, Tensor) or context.dim() != 3 or context.shape[0] != b):
            raise ValueError(f"context must have shape (b={b}, j, dim_context), got {getattr(context, 'shape', type(context))}")
        mixed_ok = torch.is_autocast_enabled(x.device.type)  # autocast mixes dtypes on purpose
        if context is not None and context.dtype != x.dtype and not mixed_ok:
            raise TypeError(f"context has dtype {context.dtype}, expected {x.dtype} (the dtype of x)")
        if kv is not None and past_kv is not None:
            raise ValueError("pass kv (cross-attention keys/values) or past_kv (self-attention cache), not both")
        if kv is not None:
            self._check_kv(kv, "kv", b, x, mixed_ok)
        if past_kv is not None:
            self._check_kv(past_kv, "past_kv", b, x, mixed_ok)

    def _check_kv(self, kv, name: str, b: int, x: Tensor, mixed_ok: bool = False) -> None:
        ok = isinstance(kv, (tuple, list)) and len(kv) == 2 and all(isinstance(t, Tensor) and t.dim() == 4 for t in kv)
        if not ok:
            raise ValueError(f"{name} must be a pair of tensors (k, v) of shape (b, h_kv, j, d), got {type(kv).__name__}")
        k, v = kv
        want = (b, self.kv_heads, None, self.dim_head)
        for t, label in ((k, "keys"), (v, "values")):
            # PoPE keys (the stack's polar_pos_emb, which sets polar_keys) carry 2 d features
            d = self.dim_head * (2 if label == "keys" and getattr(self, "polar_keys", False) else 1)
            if any(w is not None and w != s for w, s in zip(want[:3] + (d,), t.shape)):
                raise ValueError(f"{name} {label} must have shape (b={b}, h_kv={self.kv_heads}, j, d={d}), got {tuple(t.shape)}")
            if (t.dtype != x.dtype and not mixed_ok) or not t.is_floating_point() or t.device != x.device:
                raise ValueError(f"{name} {label} are {t.dtype} on {t.device}, expected {x.dtype} on {x.device} (those of x)")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"{name} keys and values must have the same length, got {tuple(k.shape)} and {tuple(v.shape)}")


class CoPE(nn.Module):
    """Contextual position encoding (x-transformers' ``CoPE``, arXiv 2405.18719): a query's position of key ``j``
    is the sum of ``sigmoid(logit)`` over the visible keys from ``j`` on (clamped to ``max_pos - 1``), and its
    logit gains ``q . pos_emb[p]`` interpolated between the integer positions around it. Masked keys count 0
    (selected, never multiplied)."""

    def __init__(self, dim_head: int, max_pos: int):
        super().__init__()
        self.max_pos = max_pos
        self.pos_emb = nn.Parameter(torch.zeros(max_pos, dim_head))  # (P, d)

    def forward(self, q: Tensor, logits: Tensor, allowed: Tensor) -> Tensor:
        """``q (b, h, i, d)``, ``logits (b, h, i, j)`` (masked ones may be ``-inf``), ``allowed`` broadcastable
        to the logits -> the positions' logits ``(b, h, i, j)``."""
        gates = torch.where(allowed, torch.sigmoid(torch.where(allowed, logits, 0.0)), 0.0)
        pos = gates.flip(-1).cumsum(dim=-1).flip(-1).clamp(max=self.max_pos - 1)  # (b, h, i, j)
        logits_int = q @ self.pos_emb.to(q.dtype).t()  # (b, h, i, P)
        floor = pos.floor()
        w = pos - floor
        lo = logits_int.gather(-1, floor.long())
        hi = logits_int.gather(-1, pos.ceil().long())
        return hi * w + lo * (1 - w)


class RelativeProjPositionalBias(nn.Module):
    """x-transformers' ``RelativeProjPositionalBias`` (the Inkling model's relative positions): per query and head
    ``num_distance_basis`` weights ``Linear(x)`` mix learned distance curves ``distance_bank (D, max_dist)``; the
    bias of query ``i`` and key ``j`` is the mixed curve at distance ``pos_i - pos_j``, and 0 outside
    ``[0, max_dist)`` (keys after the query, or too far back).

    ``forward(x, seq_len_k=None, positions=None)``: ``x (b, i, dim)`` the queries' input -> ``(b, h, i, j)``; the
    queries are the last ``i`` of ``j = seq_len_k`` keys (default ``i``), at index positions, unless
    ``positions = (q_pos (b|1, i), k_pos (b|1, j))`` gives them (the stack passes the real tokens' positions, so
    padding between tokens adds no distance).
    """

    def __init__(self, dim: int, heads: int, num_distance_basis: int = 16, max_dist: int = 1024):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("num_distance_basis", num_distance_basis),
                            ("max_dist", max_dist)):
            if not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.heads, self.num_distance_basis, self.max_dist = heads, num_distance_basis, max_dist
        self.to_distance_weights = nn.Linear(dim, heads * num_distance_basis)
        self.distance_bank = nn.Parameter(torch.randn(num_distance_basis, max_dist) * 0.02)

    def forward(self, x: Tensor, seq_len_k: int | None = None, positions: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor (b, i, dim), got {getattr(x, 'shape', type(x))}")
        b, i, device = x.shape[0], x.shape[1], x.device
        if positions is None:
            j = i if seq_len_k is None else int(seq_len_k)
            if j < i:
                raise ValueError(f"seq_len_k ({j}) must be at least the number of queries ({i})")
            q_pos = (torch.arange(i, device=device) + (j - i))[None]
            k_pos = torch.arange(j, device=device)[None]
        else:
            ok = isinstance(positions, (tuple, list)) and len(positions) == 2 and all(
                isinstance(t, Tensor) and t.dim() == 2 and t.shape[0] in (1, b) and not t.is_floating_point()
                for t in positions)
            if not ok or positions[0].shape[1] != i or (seq_len_k is not None and positions[1].shape[1] != seq_len_k):
                raise ValueError(f"positions must be (q_pos (b|1, i={i}), k_pos (b|1, j)) integer tensors, got "
                                 f"{[getattr(t, 'shape', type(t)) for t in positions] if isinstance(positions, (tuple, list)) else type(positions)}")
            q_pos, k_pos = positions
        dist = q_pos[:, :, None] - k_pos[:, None, :]  # (b|1, i, j)
        valid = (dist >= 0) & (dist < self.max_dist)
        w = self.to_distance_weights(x).unflatten(-1, (self.heads, self.num_distance_basis)).transpose(1, 2)
        curves = w @ self.distance_bank.to(w.dtype)  # (b, h, i, max_dist)
        idx = dist.clamp(0, self.max_dist - 1)[:, None].expand(b, self.heads, i, dist.shape[-1])
        return torch.where(valid[:, None], curves.gather(-1, idx), 0.0)  # (b, h, i, j)


def log_prob_from_hard_attend(intermediates) -> Tensor:
    """x-transformers' ``log_prob_from_hard_attend``: for ``Attention(gumbel_softmax=True)``'s intermediates, the log
    probability ``(b, h, i)`` of the key each query picked (the arg-max of ``post_softmax_attn``) under the softmax
    of ``pre_softmax_attn`` (masked keys ``-inf``: probability 0). A row that attended to nothing (all weights 0:
    a dead row, a padded query) gives 0."""
    pre = getattr(intermediates, "pre_softmax_attn", None)
    post = getattr(intermediates, "post_softmax_attn", None)
    if not isinstance(pre, Tensor) or not isinstance(post, Tensor) or pre.shape != post.shape:
        raise ValueError("log_prob_from_hard_attend needs intermediates with pre_softmax_attn and post_softmax_attn of "
                         "one shape (return_intermediates=True from an Attention built without flash=True)")
    if pre.shape[-1] == 0:  # no keys: nothing was picked
        return pre.new_zeros(pre.shape[:-1])
    picked = post.abs().argmax(dim=-1, keepdim=True)
    log_prob = pre.log_softmax(dim=-1).gather(-1, picked).squeeze(-1)  # (b, h, i)
    return torch.where((post != 0).any(dim=-1), log_prob, 0.0)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _LowRankLinear(nn.Module):
    """``up(act(down(x)))`` without biases, ``up`` starting at zero (x-transformers' ``LoRALinear``; the same
    parameter names, so its weights load as they are)."""

    def __init__(self, dim_in: int, dim_out: int, rank: int, activation: nn.Module | None):
        super().__init__()
        self.down = nn.Linear(dim_in, rank, bias=False)
        self.up = nn.Linear(rank, dim_out, bias=False)
        nn.init.zeros_(self.up.weight)
        self.activation = activation if activation is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.activation(self.down(x)))


def _gate_linear(dim_in: int, dim_out: int, rank: int | None, activation: nn.Module | None) -> nn.Module:
    """The gate's projection: a bias-less linear starting at zero, or a low-rank one of ``rank``."""
    if rank is None:
        linear = nn.Linear(dim_in, dim_out, bias=False)
        nn.init.zeros_(linear.weight)
        return linear
    if not (rank < dim_in or rank < dim_out):
        raise ValueError(f"the gate's rank ({rank}) must be below its input ({dim_in}) or output ({dim_out}) width")
    return _LowRankLinear(dim_in, dim_out, rank, activation)


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, *, mask=None, causal: bool = False, bias: Tensor | None = None,
                        softclamp: float | None = None, dropout_p: float = 0.0,
                        sink: Tensor | None = None, scoring: Attention | None = None,
                        return_logits: bool = False, prev_attn: Tensor | None = None) -> tuple[Tensor, ...]:
    """Attention written out in float32 (float64 for float64 inputs), returning its weights too.

    For what no fused kernel does: the weights themselves (``return_attn``), logit softclamping
    (``tanh(logits / s) * s``, after the bias and before the mask, as x-transformers) and the scoring options of
    ``scoring`` (an ``Attention``: ``l2_distance``, ``cog_signed``, ``use_cope``, ``sigmoid``, ``gumbel_softmax``,
    ``inverted_attention``, ``laser``), in x-transformers' order: logits (``-|q - k|^2 * scale`` with
    l2 distance), bias, softclamp, cog's sign taken off, masking, CoPE, sink, then softmax / sigmoid / gumbel
    softmax over the keys (over the queries with inverted attention, then L1-normalised over the keys), cog's sign
    put back, weights times values (``log(weights @ exp(softclamp(v)))`` with laser).

    Safe like ``attend``: q at dead rows and k, v at masked keys are selected to 0 first (no ``0 * NaN``), masked
    logits are selected to ``-inf``, a dead row's logits to 0, and the weights of masked keys and dead rows to
    exactly 0 afterwards, so a dead row outputs 0 with zero gradient.

    ``sink (h,)``: key 0 is a learned sink whose logit is ``sink[h]`` (not clamped).

    ``prev_attn (b|1, h, i, j)``: x-transformers' residual attention, the logits of the layer before, added to the
    scaled logits before the bias (its masked entries selected to 0 first: a ``-inf`` there reaches nothing).

    Returns:
        ``out (b, h, i, e)`` in q's dtype and ``weights (b, h, i, j)`` in float32 (or float64); with
        ``return_logits`` also the logits the weights came from (masked keys ``-inf``, dead rows 0).
    """
    b, h, i, d = q.shape
    hkv, j = k.shape[1], k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    if isinstance(mask, PreparedMask):
        mask = mask.combined
    m = None if mask is None else as_attention_mask(mask, b, h, i, j)
    reach = None
    if bias is not None:  # -inf in q's dtype masks its key, as in attend (-1e9 in float16 included)
        reach = bias.to(q.dtype) != float("-inf")
        bias = bias.to(dtype)
    c = causal_mask(i, j, device=q.device) if causal and i > 1 or (causal and i > j) else None
    if c is not None and c.dim() < 4:
        c = c.reshape((1,) * (4 - c.dim()) + tuple(c.shape))
    combined = combine_masks(m, c, reach)
    if combined is not None and combined.dim() < 4:
        combined = combined.reshape((1,) * (4 - combined.dim()) + tuple(combined.shape))
    if hkv != h:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    if j == 0:
        w = q.new_zeros(b, h, i, 0, dtype=dtype) + (q.sum() + k.sum() + v.sum()) * 0
        out = w.new_zeros(b, h, i, v.shape[-1]).to(q.dtype) + w.sum() * 0
        return (out, w, w) if return_logits else (out, w)
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    row_ok = col_ok = None
    if combined is not None:
        row_ok = combined.any(dim=-1, keepdim=True)  # (b|1, h|1, i, 1)
        key_ok = combined.any(dim=-2, keepdim=True).transpose(-1, -2)  # (b|1, h|1, j, 1)
        col_ok = key_ok.transpose(-1, -2)  # (b|1, h|1, 1, j)
        qf = torch.where(row_ok, qf, 0.0)
        kf, vf = torch.where(key_ok, kf, 0.0), torch.where(key_ok, vf, 0.0)
    opt = scoring
    scale = d**-0.5
    if opt is not None and opt.l2_distance:  # -|q - k|^2 * scale (x-transformers' l2 distance attention)
        sq = (qf * qf).sum(-1, keepdim=True) + (kf * kf).sum(-1)[..., None, :] - 2 * (qf @ kf.transpose(-1, -2))
        logits = -sq.clamp_min(0.0) * scale  # (b, h, i, j)
    else:
        logits = (qf @ kf.transpose(-1, -2)) * scale  # (b, h, i, j)
    if prev_attn is not None:  # residual attention: the previous layer's logits (masked there or here: 0)
        if prev_attn.dim() != 4 or tuple(prev_attn.shape[-3:]) != (h, i, j):
            raise ValueError(f"prev_attn (residual attention) must be the logits (b, h={h}, i={i}, j={j}) of the "
                             f"attention before, got {tuple(prev_attn.shape)}")
        prev = prev_attn.to(dtype)
        logits = logits + (prev if combined is None else torch.where(combined, prev, 0.0))
    if bias is not None:  # the bias first, then the clamp (x-transformers' order); -inf is masked below
        logits = logits + torch.where(reach, bias, 0.0)
    if softclamp is not None:
        logits = torch.tanh(logits / softclamp) * softclamp
    sign = None
    if opt is not None and opt.cog_signed:  # cog attention: softmax of |logits|, weights signed back
        sign, logits = logits.sign(), logits.abs()
    if combined is not None:
        logits = torch.where(combined, logits, float("-inf"))
    if opt is not None and opt.cope is not None:  # contextual positions from the gates of the visible keys
        allowed = combined if combined is not None else torch.ones(1, 1, 1, j, dtype=torch.bool, device=q.device)
        if sink is not None:  # the sink is no key of the sequence (x-transformers adds it after CoPE)
            allowed = allowed & (torch.arange(j, device=q.device) > 0)
        pos_logits = opt.cope(qf, logits, allowed)
        logits = logits + pos_logits if combined is None else torch.where(combined, logits + pos_logits, float("-inf"))
    if sink is not None:  # key 0 is the sink: its logit is the learned one, never clamped (x-transformers)
        s = sink.to(dtype)[None, :, None, None].expand(b, h, i, 1)
        if sign is not None:
            sign = torch.cat((s.sign(), sign[..., 1:].expand(b, h, i, j - 1)), dim=-1)
            s = s.abs()
        logits = torch.cat((s, logits[..., 1:].expand(b, h, i, j - 1)), dim=-1)
    inverted = opt is not None and opt.inverted
    dim = -2 if inverted else -1
    ok = None if combined is None else (col_ok if inverted else row_ok)  # the softmax's live lines
    if ok is not None:
        logits = torch.where(ok, logits, 0.0)  # a dead line: finite logits, weights selected to 0 below
    live = None if combined is None else combined & row_ok
    score = "softmax" if opt is None else opt.score
    if score == "sigmoid":
        weights = torch.sigmoid(logits)
    elif score == "gumbel":
        weights = _gumbel_softmax(logits, combined, dim, opt.gumbel_temp, opt.gumbel_hard)
    else:
        weights = logits.softmax(dim=dim)
    if live is not None:
        weights = torch.where(live, weights, 0.0)
    if inverted:  # normalised over the queries first: now L1 over each query's keys (x-transformers' l1norm)
        weights = weights / weights.abs().sum(-1, keepdim=True).clamp_min(1e-8)
    if sign is not None:
        weights = weights * sign
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    if opt is not None and opt.laser_value is not None:  # laser: log(weights @ exp(softclamp(v)))
        t = opt.laser_value
        ev = torch.exp(torch.tanh(vf / t) * t)
        if sink is not None:  # the sink holds no value: its weight adds nothing (x-transformers drops it before @ v)
            ev = torch.cat((torch.zeros_like(ev[..., :1, :]), ev[..., 1:, :]), dim=-2)
        wv = weights @ ev
        alive = torch.ones_like(wv[..., :1], dtype=torch.bool) if row_ok is None else row_ok.expand_as(wv[..., :1])
        out = torch.where(alive, torch.log(torch.where(alive, wv, 1.0).clamp_min(torch.finfo(dtype).tiny)), 0.0)
    else:
        out = weights @ vf
    if return_logits:
        if live is not None:
            logits = torch.where(combined, logits, float("-inf"))
            logits = torch.where(row_ok, logits, 0.0)
        return out.to(q.dtype), weights, logits
    return out.to(q.dtype), weights


def _l2_kernel_inputs(q: Tensor, k: Tensor, v: Tensor, keys_ok: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """l2-distance attention as a dot product for the fused kernels: ``[2q, 1] . [k, -|k|^2] = -|q - k|^2 + |q|^2``,
    the row's constant ``|q|^2`` cancelling in the softmax. q, k and v are zero-padded to one head dim, a multiple of
    8 (what the fused kernels take); the caller keeps the first ``d`` output features. ``keys_ok (b|1, j)``: masked
    keys selected to 0 before ``|k|^2`` (else a NaN held there would reach its gradient as ``0 * NaN``)."""
    d = q.shape[-1]
    width = -(-(d + 1) // 8) * 8
    if keys_ok is not None and keys_ok.shape[-1] == k.shape[2]:
        k = torch.where(keys_ok[:, None, :, None], k, 0.0)
    kf = k.to(torch.promote_types(k.dtype, torch.float32))
    norm = (kf * kf).sum(-1, keepdim=True).to(k.dtype)  # (b, h_kv, j, 1), summed in float32 at least
    q2 = F.pad(torch.cat((2 * q, torch.ones_like(q[..., :1])), dim=-1), (0, width - d - 1))
    k2 = F.pad(torch.cat((k, -norm), dim=-1), (0, width - d - 1))
    return q2, k2, F.pad(v, (0, width - v.shape[-1]))


def _gumbel_softmax(logits: Tensor, allowed: Tensor | None, dim: int, temp: float, hard: bool) -> Tensor:
    """``F.gumbel_softmax`` over ``dim`` with the noise added at allowed entries only (a masked ``-inf`` logit stays
    ``-inf``: the noise is finite, ``-log(-log(u))`` with ``u`` kept inside (0, 1)); ``hard``: the one-hot of the
    sample, with the soft weights' gradient (straight-through)."""
    tiny = torch.finfo(logits.dtype).tiny
    u = torch.rand_like(logits).clamp(tiny, 1.0 - torch.finfo(logits.dtype).eps)
    noise = -torch.log(-torch.log(u))
    noisy = logits + noise if allowed is None else torch.where(allowed, logits + noise, logits)
    soft = (noisy / temp).softmax(dim=dim)
    if not hard:
        return soft
    one_hot = torch.zeros_like(soft).scatter_(dim, soft.argmax(dim=dim, keepdim=True), 1.0)
    return one_hot - soft.detach() + soft


def _prepend_keys(mask, bias, added_mask: Tensor | None, b: int, h: int, i: int, j: int, a: int, device):
    """The mask and bias over ``[a added keys, j keys]``: ``added_mask (b, a)`` in front (``None``: all real),
    bias 0 there (every query sees the added keys, whatever the positions)."""
    if isinstance(mask, PreparedMask):
        mask = mask.combined
    if mask is not None or added_mask is not None:
        m = torch.ones(1, 1, 1, j, dtype=torch.bool, device=device) if mask is None else as_attention_mask(mask, b, h, i, j)
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        front = torch.ones(1, 1, 1, a, dtype=torch.bool, device=device) if added_mask is None \
            else added_mask[:, None, None, :]
        lead = torch.broadcast_shapes(m.shape[:-1], front.shape[:-1])
        mask = torch.cat((front.expand(*lead, a), m.expand(*lead, j)), dim=-1)  # (b|1, h|1, i|1, a + j)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(*bias.shape[:-1], j)
        bias = torch.cat((bias.new_zeros(*bias.shape[:-1], a), bias), dim=-1)
    return mask, bias


def _self_padding(mask: Tensor, b: int, i: int, j: int) -> Tensor | None:
    """``(b, i)`` which positions of x are real, when ``mask`` is a key padding mask of self-attention
    (``(b, j)`` or ``(b, 1, 1, j)``; the last ``i`` keys are x's own positions); otherwise ``None``."""
    if mask.dtype != torch.bool or j < i:
        return None
    if mask.dim() == 2 and tuple(mask.shape) == (b, j):
        pad = mask
    elif mask.dim() == 4 and mask.shape[0] == b and mask.shape[1] == 1 and mask.shape[2] == 1 and mask.shape[3] == j:
        pad = mask[:, 0, 0]
    else:
        return None
    return pad[:, j - i:]


def _alive(mask: Tensor | None, causal: bool, b: int, h: int, i: int, j: int, device,
           reach: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """Which queries ``(b|1, i)`` may attend to some key and which keys ``(b|1, j)`` some query may see
    (in any head); ``(None, None)`` when every query and key is live. ``reach``: where an additive bias
    is not ``-inf`` (broadcastable to ``(b, h, i, j)``)."""
    if j == 0:
        return torch.zeros(1, i, dtype=torch.bool, device=device), torch.zeros(1, 0, dtype=torch.bool, device=device)
    if isinstance(mask, PreparedMask):
        mask = mask.combined
    m = None if mask is None else as_attention_mask(mask, b, h, i, j)
    if m is not None and m.device != torch.device(device):
        raise ValueError(f"mask is on {m.device}, expected {device} (the device of the inputs)")
    if reach is not None:
        if reach.dim() > 4 or any(s not in (1, f) for s, f in zip(reach.shape[::-1], (j, i, h, b))):
            raise ValueError(f"bias must broadcast to (b, h, i, j) = ({b}, {h}, {i}, {j}), got {tuple(reach.shape)}")
        reach = reach.reshape((1,) * (4 - reach.dim()) + tuple(reach.shape))
    c = causal_mask(i, j, device=device) if causal and (i > j or ((m is not None or reach is not None) and i > 1)) else None
    combined = combine_masks(m, c, reach)  # (b|1, h|1, i|1, j|1)
    if combined is None:
        return None, None
    rows = combined.any(dim=-1).any(dim=1).expand(combined.shape[0], i)
    keys = combined.any(dim=-2).any(dim=1).expand(combined.shape[0], j)
    return rows, keys

