"""Import of x-transformers models: ``from_x_transformers(model)``.

Converts an ``x_transformers.TransformerWrapper`` (``Decoder``, ``Encoder`` or ``CrossAttender``
layers) into the equivalent ``safeformer.TransformerWrapper`` with the same weights, so that a
trained model gains safeformer's safety contract; an ``x_transformers.AutoregressiveWrapper`` into a
``safeformer.AutoregressiveWrapper`` and an ``x_transformers.XTransformer`` into a
``safeformer.XTransformer`` around such converted nets (each side's options, where encoder and decoder
differ, in its ``enc_options`` / ``dec_options``). Options that change the numbers and have no
safeformer equivalent raise one ``ValueError`` listing all of them.

Shape legend: c model width, h query heads, h_kv key/value heads, g = h // h_kv, d head dim,
v vocabulary size, f feed-forward hidden width, m memory tokens / memory key-value pairs.

How the numbers are matched (x-transformers 2.x, read from its source):
- Norms. x-transformers' ``LayerNorm`` is ``nn.LayerNorm(c, elementwise_affine=False)(x) * (gamma +
  offset)`` with ``offset = 1`` by default (``norm_add_unit_offset``): it becomes an ``nn.LayerNorm``
  with ``weight = gamma + offset`` and ``bias = 0`` (exact). Its ``RMSNorm`` is
  ``F.normalize(x) * sqrt(c) * (g + offset)``: it becomes safeformer's ``RMSNorm`` with
  ``weight = g + offset``. ``ScaleNorm`` and ``SimpleRMSNorm`` become safeformer's own (``use_scalenorm``:
  one scalar gain ``g + offset``; ``use_simple_rmsnorm``: no parameter), exact. The RMS norms differ only
  by the epsilon: x-transformers divides by
  ``max(||x||, 1e-12)``, safeformer by ``sqrt(mean(x^2) + eps)``; the converted norms get
  ``eps = 1e-12`` instead of the default ``1e-6`` (which differs by about ``5e-7 / mean(x^2)``
  relative). That eps is the converted stack's ``norm_eps``, so it is saved with its config.
- Grouped-query heads. Both give query head ``n`` the key/value head ``n % h_kv`` (safeformer's default
  ``kv_head_order="tiled"``): the heads keep their order (the converter's head permutation is the identity).
- Feed-forwards keep their keywords: a GLU ``mult_bias`` is the learned ``ff_glu_mult_bias``, one without
  biases is built with ``ff_no_bias``, ReLU squared, SoLU, the post-activation LayerNorm and the sublayer
  dropout are ``ff_relu_squared``, ``ff_solu``, ``ff_post_act_ln`` and ``ff_sublayer_dropout`` (gains with
  their unit offsets folded in). An attention without an output projection (one head) gets the identity. A tied embedding (``logits = h @ E.T * tie_embedding_scale``) stays tied
  (``tie_embedding=True`` with the same ``tie_embedding_scale``): same parameters, same count.
- Positions. Both count positions from 0 and scale a learned absolute embedding by ``c ** -0.5``;
  rotary positions rotate interleaved pairs of the first ``rotary_emb_dim`` features per head with
  base 10000. x-transformers numbers positions ``0..n-1`` whatever the mask; safeformer counts real
  tokens (so left padding does not shift positions). The two agree at every real position when
  padding is on the right.
- ALiBi. Both add ``-slope_h * |i - j|`` to the scaled logits of self-attention, with the same
  geometric slopes (``alibi_slopes``), 0 for memory keys. ``alibi_num_heads`` (ALiBi on the first heads)
  and custom slopes (``rel_pos_kwargs``) carry over; with grouped-query heads ``1 < h_kv < h`` the slopes
  are permuted with the query heads (given explicitly), so there only whole-head ALiBi converts (the
  permutation would move the biased heads off the first ones). Both keep the absolute position embedding next
  to ALiBi unless ``disable_abs_pos_emb`` says otherwise.
- qk-norm. safeformer's ``attn_qk_norm`` is x-transformers' (L2 norm per head or group, ``qk_norm_scale``,
  ``qk_norm_dim_scale``'s ``qk_norm_q_scale`` / ``qk_norm_k_scale``): the options and scales carry over as
  they are (the query scales permuted with grouped-query heads). ``attn_value_rmsnorm``'s
  ``gamma (h, 1, d)`` is the value norm's weight (``attn_kv_heads == heads`` only), and
  ``attn_orthog_projected_values`` keeps ``to_out`` (its columns permuted once per concatenated part).
- Memory. ``num_memory_tokens`` rows ``memory_tokens (m, c)`` and per-attention memory keys/values
  ``mem_k, mem_v (h_kv, m, d)`` (``attn_num_mem_kv``) are copied as they are; a learned sink
  ``head_attn_sink (h,)`` is permuted with the query heads; ``attn_softclamp_logits`` keeps its value.
- Routing and branch wrappers. x-transformers' per-layer residual modules (``Residual`` scales, ``GRUGating``,
  ``MVSplitResidualUpdate``), ``DynamicLIMe``, ``ConcatCombine`` skips, post-norms and the reinjection
  projections map parameter for parameter onto ``block.ResidualRouting`` (same layer index); the branch
  wrappers (``Scale``, ``LayerScale``, ``ShiftTokens``, macaron's ``Scale(0.5)``) onto safeformer's block
  options (``LayerScale`` and ``Derf`` unit offsets folded in). The layer pattern and execution order are
  rebuilt by keywords and checked against the built stack. Per-head parameters (T5 bias, PoPE bias, ALiBi
  slopes, the relative projection bias) are permuted with the query heads.
- XTransformer. The encoder and the decoder's net convert as above, each on its own; the
  ``safeformer.XTransformer`` is then built from their configs: the shared layer arguments
  (``dim_head``, ``kv_heads``, ``rotary_pos_emb``, ``ff_glu``, ``use_rmsnorm``, dropouts) take the
  encoder's values, and ``enc_options`` / ``dec_options`` hold every other option off its default
  (and the decoder's shared ones where they differ), layer or wrapper (``norm_eps``,
  ``attn_qk_norm``, ``num_memory_tokens``, ``l2norm_embed``, ``tie_embedding``, ...). The nets it
  builds are checked option for option against the converted ones before the weights are loaded.
  What it cannot express is refused: encoder and decoder of different widths (it has one ``dim``),
  an encoder with an output head, a decoder with ``logits_dim`` or without a head, and wrapper
  options no side takes (``use_cls_token``, ``average_pool_embed``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..decoding.encoder_decoder import XTransformer
from ..decoding.generation import AutoregressiveWrapper
from ..nn.modules import AdaptiveNorm, Derf, DynamicTanh, LayerNorm, RMSNorm, alibi_slopes
from ..nn.xt_modules import ScaleNorm as XtScaleNorm
from ..nn.xt_modules import SimpleRMSNorm as XtSimpleRMSNorm
from ..stack.layers import AttentionLayers, CrossAttender, Decoder, Encoder, _defaults
from ..stack.wrappers import XT_OPTION_PARAMETERS, TransformerWrapper, xt_wrapper_option_kwargs

__all__ = ["from_x_transformers"]

# x-transformers' RMS norms divide by max(||x||, 1e-12); safeformer's RMSNorm by sqrt(mean(x^2) + eps).
# A converted model's RMSNorm instances get this eps (not 1e-6) so that the two agree to float32
# rounding; it is small enough to match and large enough that rsqrt(eps) ** 3 (in the backward of an
# all-zero row) stays finite in float32. It is passed as the stack's ``norm_eps``, so it is part of
# the saved config and survives save_pretrained / from_pretrained.
_RMS_EPS = 1e-12

# Module classes that introduce an option, and its name: what a module of this class is refused as where the
# converter does not read it (many of these convert where x-transformers puts them, see _check_module_types).
_TYPE_OPTIONS = {
    "ShiftTokens": "shift_tokens",
    "Scale": "macaron, or a float scale_residual / depth_scale_residual (a scaled branch)",
    "LayerScale": "use_layerscale",
    "AdaptiveLayerScale": "use_adaptive_layerscale",
    "GRUGating": "gate_residual",
    "HyperConnection": "num_residual_streams > 1 (hyper-connections)",
    "OrthogonalResidualUpdate": "orthog_residual",
    "MVSplitResidualUpdate": "mv_split_residual",
    "GatedMultiResidual": "gated_multi_residual",
    "DynamicTanh": "use_dynamic_tanh",
    "Derf": "use_derf",
    "AdaptiveLayerNorm": "use_adaptive_layernorm",
    "AdaptiveRMSNorm": "use_adaptive_rmsnorm",
    "MultiheadRMSNorm": "attn_qk_rmsnorm / attn_k_rmsnorm / attn_value_rmsnorm / hybrid_module",
    "ConcatCombine": "unet_skips",
    "DynamicLIMe": "integrate_layers",
    "AttentionResidual": "attn_aggregated_residuals",
    "ReluSquared": "ff_relu_squared",
    "SoLU": "ff_solu",
    "CoPE": "attn_use_cope",
    "Lambda": "ff_softclamp_value",
    "RelativePositionBias": "rel_pos_bias",
    "DynamicPositionBias": "dynamic_pos_bias",
    "DataDependentAlibi": "attn_data_dependent_alibi",
    "PerRowDataDependentAlibi": "attn_data_dependent_alibi",
    "RelativeProjPositionalBias": "attn_use_rel_proj_pos_bias",
    "PolarEmbedding": "polar_pos_emb",
    "ScaledSinusoidalEmbedding": "scaled_sinu_pos_emb",
    "AttentionPool": "attn_pool",
    "FoldAxially": "attn_hybrid_module",
    "GLU": "attn_on_attn (an nn.GLU output projection)",
    "ReLU": "a custom feed-forward activation",
    "PrefixDecoder": "PrefixDecoder (use Decoder or Encoder)",
}


# x-transformers' residual routing modules: converted (or refused with the reason) by _check_stack / _routing_options
_ROUTING_TYPES = ("DynamicLIMe", "ConcatCombine", "OrthogonalResidualUpdate", "MVSplitResidualUpdate", "HyperConnection")


def _xt():
    try:
        import x_transformers.attend as xt_attend
        import x_transformers.x_transformers as xt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("from_x_transformers needs x-transformers: pip install x-transformers") from err
    return xt, xt_attend


class _Problems:
    """Collects every unsupported option found, to raise them all at once."""

    def __init__(self, parent: _Problems | None = None, prefix: str = "") -> None:
        self.items: dict[str, list[str]] = {} if parent is None else parent.items
        self.prefix = prefix

    def scoped(self, prefix: str) -> _Problems:
        """The same collection, with every location under ``prefix`` (a submodule of a wrapper)."""
        return _Problems(self, f"{self.prefix}.{prefix}" if self.prefix else prefix)

    def add(self, text: str, where: str | None = None) -> None:
        if self.prefix:
            where = self.prefix if where is None else f"{self.prefix}.{where}"
        wheres = self.items.setdefault(text, [])
        if where is not None and where not in wheres:
            wheres.append(where)

    def raise_if_any(self) -> None:
        if not self.items:
            return
        lines = []
        for text, wheres in self.items.items():
            if wheres:
                shown = ", ".join(wheres[:4]) + (f" and {len(wheres) - 4} more" if len(wheres) > 4 else "")
                text = f"{text} (at {shown})"
            lines.append(f"  - {text}")
        raise ValueError(
            f"from_x_transformers: this x-transformers model uses {len(lines)} option(s) that safeformer cannot "
            f"represent exactly:\n" + "\n".join(lines)
        )


def _norm_kind(norm, xt) -> str | None:
    """``"layer"``, ``"rms"`` or None (unsupported) for an x-transformers norm module."""
    if type(norm) is xt.LayerNorm:
        return "layer"
    if type(norm) is xt.RMSNorm:
        return "rms"
    if type(norm) is xt.ScaleNorm:
        return "scale"  # use_scalenorm (one scalar gain)
    if type(norm) is xt.SimpleRMSNorm:
        return "simple_rms"  # use_simple_rmsnorm (no parameter)
    if type(norm).__name__ == "DynamicTanh" and type(norm).__module__ == xt.LayerNorm.__module__:
        return "dyt"  # use_dynamic_tanh (unit offsets folded in by copy_norm)
    if type(norm).__name__ == "Derf" and type(norm).__module__ == xt.LayerNorm.__module__:
        return "derf"  # use_derf (unit offsets folded in by copy_norm)
    if type(norm) is getattr(xt, "AdaptiveLayerNorm", None):
        return "ada_layer"  # use_adaptive_layernorm: norm(x) * (1 + W c)
    if type(norm) is getattr(xt, "AdaptiveRMSNorm", None):
        return "ada_rms"  # use_adaptive_rmsnorm
    return None


def _norm_weights(norm, xt) -> tuple[Tensor, Tensor | None, list[str]]:
    """``(weight, bias or None, consumed parameter names relative to the norm)``."""
    if type(norm) is xt.LayerNorm:
        return norm.gamma.detach() + float(norm.unit_offset), None, ["gamma"]
    if type(norm) is xt.RMSNorm:
        return norm.g.detach() + float(norm.unit_offset), None, ["g"]
    if type(norm) is xt.ScaleNorm:
        dim = round(norm.scale**2)
        return (norm.g.detach() + float(norm.unit_offset)).expand(dim).clone(), None, ["g"]
    if type(norm) is xt.SimpleRMSNorm:
        dim = round(norm.scale**2)
        return torch.ones(dim), None, []
    if type(norm).__name__ == "DynamicTanh":  # copied by copy_norm parameter by parameter
        return norm.gamma.detach(), None, ["pre_tanh_scale", "gamma", "beta"]
    if type(norm).__name__ == "Derf":  # copied by copy_norm parameter by parameter
        return norm.gamma.detach(), None, ["alpha", "s", "gamma", "beta"]
    if type(norm).__name__ in ("AdaptiveLayerNorm", "AdaptiveRMSNorm"):  # copied by copy_norm
        return norm.to_gamma.weight.detach(), None, []
    raise AssertionError("unreachable: checked by _norm_kind")


@dataclass
class _AttnOptions:
    """The attention options safeformer represents, as one x-transformers ``Attention`` uses them.
    The qk-norm options are x-transformers' own (``qk_norm_dim_scale``, ``qk_norm_groups``, ``qk_norm_scale``)."""

    qk_norm: bool = False
    qk_dim_scale: bool = False  # qk_norm_dim_scale: the learned qk_norm_q_scale / qk_norm_k_scale
    qk_groups: int = 1
    qk_scale: float = 10.0
    value_rmsnorm: bool = False
    orthog: tuple = ()  # the orthog_projected_values options, as AttentionLayers keywords
    value_mix: bool = False  # a learned value residual mix (every self-attention but the first: not in key())
    dd_alibi: tuple = ()  # data_dependent_alibi: (("attn_data_dependent_alibi", True), ("..._kwargs", {...}))
    mem_kv: int = 0
    sink: bool = False
    softclamp: float | None = None
    gates: tuple = ()  # the gated-attention options, as AttentionLayers keywords (sorted items)
    hybrid: tuple = ()  # attn_hybrid_module: (fold_axial_dim, mask_kwarg, learned_mix, the module's type name)
    scoring: tuple = ()  # the scoring options every attention of a stack shares (attn_l2_distance, ...), sorted items
    self_scoring: tuple = ()  # self-attention only (CoPE, the relative projection bias), sorted items
    inverted: bool = False  # cross-attention only (cross_attn_inverted_attention, per block)
    head_scale: bool = False  # attn_head_scale: a learned gain per head (permuted with the query heads)
    sparse_topk: tuple | None = None  # (attn_sparse_topk, attn_sparse_topk_straight_through)
    hard: bool = False  # attn_hard
    zero_kv: bool = False  # attn_add_zero_kv
    rotate_heads: int | None = None  # rotate_num_heads (the last heads rotary positions rotate)
    talking_heads: tuple = ()  # the Attend's talking-heads convs present: ("pre_softmax_talking_heads", ...)
    sublayer_dropout: float = 0.0  # attn_sublayer_dropout

    def key(self) -> tuple:
        return (self.qk_norm, self.qk_dim_scale, self.qk_groups, self.qk_scale, self.value_rmsnorm, self.orthog, self.mem_kv, self.sink,
                self.softclamp, self.gates, repr(self.dd_alibi), self.scoring, self.hybrid, self.head_scale,
                self.sublayer_dropout, self.sparse_topk, self.hard, self.talking_heads, self.zero_kv)
        # (rotate_heads is left out: x-transformers' stack gives it to its self-attentions only, all alike)


def _gate_options(name: str, attn, problems: _Problems) -> tuple:
    """x-transformers' gated attention (``to_v_gate``, ``to_output_gate``) as safeformer's ``attn_*`` options
    (sorted ``(keyword, value)`` pairs, defaults left out)."""
    out: dict = {}
    silu_between = set()
    for attr, prefix, headwise in (("to_v_gate", "attn_gate_values", "gate_values_headwise"),
                                   ("to_output_gate", "attn_output_gate", "output_gate_headwise")):
        gate = getattr(attn, attr, None)
        if gate is None:
            continue
        out[prefix] = True
        if getattr(attn, headwise, False):
            out[f"{prefix}_headwise"] = True
        if isinstance(gate, nn.Linear):
            if gate.bias is not None:
                problems.add(f"a bias in {attr}", name)
        elif isinstance(getattr(gate, "down", None), nn.Linear) and isinstance(getattr(gate, "up", None), nn.Linear):
            out[f"{prefix}_rank"] = int(gate.down.out_features)
            silu_between.add(getattr(gate, "maybe_activation", None) is F.silu)
        else:
            problems.add(f"{prefix} with a projection of type {type(gate).__name__}", name)
    if not out:
        return ()
    if len(silu_between) > 1:
        problems.add("low-rank attention gates with different activations", name)
    if silu_between == {False}:
        out["attn_low_rank_silu_gates"] = False
    act = getattr(attn, "to_v_gate_activation", F.sigmoid)
    if act is F.silu:
        out["attn_swiglu_values"] = True
    elif act not in (F.sigmoid, torch.sigmoid):
        problems.add("an attention gate activation other than sigmoid or SiLU", name)
    return tuple(sorted(out.items()))


def _qk_options(attn) -> tuple[bool, int, float]:
    """x-transformers' qk-norm of ``attn`` as safeformer's keywords: ``(qk_norm_dim_scale, qk_norm_groups,
    qk_norm_scale)`` (the same meanings; the scales are copied as they are)."""
    dim_scale = isinstance(attn.qk_norm_q_scale, Tensor)
    return dim_scale, int(getattr(attn, "qk_norm_groups", 1)), float(getattr(attn, "qk_norm_scale", 10))


def _check_attention(name: str, attn, xt, xt_attend, problems: _Problems, training_only: list[str]) -> _AttnOptions:
    """Records what ``attn`` uses that safeformer cannot represent; returns the options it can."""
    opts = _AttnOptions(qk_norm=bool(attn.qk_norm), mem_kv=int(getattr(attn, "num_mem_kv", 0)))
    flags = {
        "attn_on_attn": "attn_on_attn",
    }
    opts.head_scale = bool(getattr(attn, "head_scale", False))
    for attr, option in flags.items():
        if getattr(attn, attr, False):
            problems.add(f"{option}", name)
    if opts.qk_norm:
        opts.qk_dim_scale, opts.qk_groups, opts.qk_scale = _qk_options(attn)
    opts.orthog = tuple((f"attn_{attr}", True) for attr in ("orthog_projected_values", "orthog_projected_values_per_head")
                        if getattr(attn, attr, False))
    if getattr(attn, "value_rmsnorm", None) is not None:
        opts.value_rmsnorm = True
        if attn.kv_heads != attn.heads:
            problems.add("attn_value_rmsnorm with grouped key/value heads (x-transformers' gains are per query head)", name)
    opts.gates = _gate_options(name, attn, problems)
    if getattr(attn, "max_attend_past", None) is not None:
        problems.add(f"attn_max_attend_past={attn.max_attend_past}", name)
    for attr, option in (
        ("to_v_head_gate", "attn_gate_value_heads"),
        ("q_rmsnorm", "attn_qk_rmsnorm"),
        ("k_rmsnorm", "attn_k_rmsnorm"),
    ):
        if getattr(attn, attr, None) is not None:
            problems.add(f"{option}", name)
    hybrid = getattr(attn, "hybrid_module", None)
    if hybrid is not None:  # x-transformers builds it folded (hybrid_fold_axial_dim) with its two head norms
        if type(hybrid).__name__ != "FoldAxially" or getattr(attn, "hybrid_norms", None) is None:
            problems.add("attn_hybrid_module without hybrid_fold_axial_dim", name)
        else:
            opts.hybrid = (int(hybrid.axial_dim), getattr(attn, "hybrid_mask_kwarg", None),
                           getattr(attn, "hybrid_mix", None) is not None, type(hybrid.fn).__name__)
    dd = getattr(attn, "data_dependent_alibi", None)
    if dd is not None:
        lin = dd.to_forget_gates[0] if isinstance(getattr(dd, "to_forget_gates", None), nn.Sequential) else None
        if type(dd).__name__ != "DataDependentAlibi" or not isinstance(lin, nn.Linear) or lin.bias is None:
            problems.add(f"attn_data_dependent_alibi of type {type(dd).__name__} (per-row gates)", name)
        else:
            opts.dd_alibi = (("attn_data_dependent_alibi", True),
                             ("attn_data_dependent_alibi_kwargs", dict(post_log_scale=float(dd.post_log_scale))))
            if bool(dd.causal) != bool(attn.causal):
                problems.add("attn_data_dependent_alibi whose causal differs from its attention's", name)
    if isinstance(attn.to_value_residual_mix, nn.Module):
        mix = attn.to_value_residual_mix
        if not (isinstance(mix, nn.Sequential) and isinstance(mix[0], nn.Linear) and mix[0].bias is not None
                and isinstance(mix[1], nn.Sigmoid)):
            problems.add("learned_value_residual_mix with a custom mixer", name)
        elif attn.kv_heads != attn.heads:
            problems.add("learned_value_residual_mix with grouped key/value heads (x-transformers mixes per query "
                         "head)", name)
        opts.value_mix = True
    rope_subheads = attn.to_rotateable_k is not None if hasattr(attn, "to_rotateable_k") else False
    if getattr(attn, "rotate_num_heads", attn.heads) != attn.heads and not rope_subheads:
        opts.rotate_heads = int(attn.rotate_num_heads)  # rotate_num_heads (self-attention: the stack's keyword)
    if getattr(attn, "sublayer_dropout", None) is not None:
        opts.sublayer_dropout = float(attn.sublayer_dropout.p)  # attn_sublayer_dropout
    for lin in ("to_q", "to_k", "to_v"):
        if getattr(attn, lin).bias is not None:
            problems.add(f"a bias in {lin}", name)
    if isinstance(attn.to_out, nn.Linear) and attn.to_out.bias is not None:
        problems.add("a bias in to_out", name)
    elif not isinstance(attn.to_out, (nn.Linear, nn.Identity)) and type(attn.to_out).__name__ != "Identity":
        problems.add("attn_on_attn or a custom output projection", name)

    att = attn.attend
    if type(att) is not xt_attend.Attend:
        problems.add(f"a custom Attend class {type(att).__name__}", name)
        return opts
    fn = att.attn_fn
    attn_dim = -2 if getattr(att, "inverted_attention", False) else -1  # inverted: a softmax over the queries
    plain_softmax = isinstance(fn, functools.partial) and fn.func is F.softmax and fn.keywords.get("dim") == attn_dim
    sigmoid = fn is F.sigmoid or fn is torch.sigmoid
    topk = isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == "sparse_topk_attn" \
        and fn.keywords.get("dim", -1) == -1 and float(fn.keywords.get("temperature", 1.0)) == 1.0
    hard = isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == "one_hot_straight_through" \
        and fn.keywords.get("dim", -1) == -1 and float(fn.keywords.get("temperature", 1.0)) == 1.0
    if topk:  # attn_sparse_topk (+ attn_sparse_topk_straight_through): safeformer's own
        opts.sparse_topk = (int(fn.keywords["sparse_topk"]), bool(fn.keywords.get("straight_through", False)))
    elif hard:  # attn_hard
        opts.hard = True
    elif not plain_softmax and not sigmoid:
        problems.add("a non-softmax attention function (attn_gumbel_softmax / attn_custom_attn_fn)", name)
    opts.talking_heads = tuple(n for n in _TALKING_HEADS if isinstance(getattr(att, n, None), nn.Conv2d))
    opts.zero_kv = bool(getattr(att, "add_zero_kv", False))  # attn_add_zero_kv
    opts.scoring, opts.self_scoring = _scoring_options(name, attn, att, sigmoid, problems)
    opts.inverted = bool(getattr(att, "inverted_attention", False))
    dim_head = attn.to_q.out_features // attn.heads
    # with qk-norm the logit scale is part of the mapped q/k gains (_qk_gain)
    if not opts.qk_norm and att.scale is not None and not math.isclose(att.scale, dim_head**-0.5, rel_tol=1e-12):
        problems.add(f"an attention scale {att.scale} != dim_head ** -0.5", name)
    for attr, option in (
        ("selective", "attn_selective"),
        ("flash_pack_seq", "attn_flash_pack_seq"),
    ):
        if getattr(att, attr, False):
            problems.add(f"{option}", name)
    for attr in _TALKING_HEADS:  # a conv of another shape than (h, h, 1, 1) without bias is no talking heads
        conv = getattr(att, attr, None)
        if conv is not None and (not isinstance(conv, nn.Conv2d) or conv.bias is not None
                                 or tuple(conv.weight.shape) != (attn.heads, attn.heads, 1, 1)):
            problems.add(f"{_TALKING_HEADS[attr]} of another shape", name)
    opts.sink = bool(getattr(att, "head_learned_sink", False))
    if opts.sink and getattr(attn, "laser", False):
        problems.add("attn_laser with attn_head_learned_sink (x-transformers' sink adds nothing to weights @ exp(v); "
                     "safeformer's sink key holds a zero value, exp(0) = 1, so its weight enters the log)", name)
    if getattr(att, "softclamp_logits", False):
        opts.softclamp = float(att.logit_softclamp_value)
    return opts


def _scoring_options(name: str, attn, att, sigmoid: bool, problems: _Problems) -> tuple[tuple, tuple]:
    """x-transformers' attention scoring options of ``attn`` (its ``Attend`` ``att``) as safeformer's stack keywords:
    ``(shared by every attention, self-attention only)``, each sorted ``(keyword, value)`` pairs, defaults left out."""
    out: dict = {}
    for attr in ("l2_distance", "cog_signed"):
        if getattr(att, attr, False):
            out[f"attn_{attr}"] = True
    if sigmoid:
        out["attn_sigmoid"] = True
    if getattr(attn, "laser", False):
        out["attn_laser"] = True
        if float(attn.laser_softclamp_value) != 15.0:
            out["attn_laser_softclamp_value"] = float(attn.laser_softclamp_value)
    for kind in ("q", "kv"):
        latent = getattr(attn, f"to_latent_{kind}", None)
        if latent is not None:
            out.update({f"attn_use_latent_{kind}": True, f"attn_dim_latent_{kind}": int(latent.out_features)})
    if getattr(attn, "to_rotateable_k", None) is not None:
        out["attn_latent_rope_subheads"] = int(attn.to_rotateable_k.out_features // (attn.to_q.out_features // attn.heads))
    own: dict = {}
    cope = getattr(att, "cope", None)
    if cope is not None:
        own.update(attn_use_cope=True, attn_cope_max_pos=int(cope.max_pos))
        if cope.soft_onehot or cope.talking_heads is not None:
            problems.add("attn_use_cope with cope_soft_onehot_pos / cope_talking_heads", name)
    rel = getattr(attn, "rel_proj_pos_bias", None)
    if rel is not None:
        basis, max_dist = rel.distance_bank.shape
        own.update(attn_use_rel_proj_pos_bias=True, attn_rel_proj_num_distance_basis=int(basis),
                   attn_rel_proj_max_dist=int(max_dist))
    return tuple(sorted(out.items())), tuple(sorted(own.items()))


def _parse_ff(name: str, ff, xt, problems: _Problems, training_only: list[str]) -> dict | None:
    """The pieces of an x-transformers FeedForward, or None when its structure is unsupported."""
    parts = list(ff.ff)
    if not parts:
        problems.add("an empty feed-forward", name)
        return None
    proj_in = parts.pop(0)
    info: dict = {}
    if type(proj_in) is xt.GLU:
        info["glu"] = True
        act = proj_in.act
        if isinstance(act, functools.partial):  # ff_glu_softclamp: softclamp_gelu / softclamp_silu of the gate
            fname = getattr(act.func, "__name__", "")
            if fname not in ("softclamp_gelu", "softclamp_silu") or set(act.keywords) != {"value"} \
                    or getattr(proj_in, "up_softclamp_value", None) is None:
                problems.add(f"a feed-forward gate activation {fname or act!r}", name)
                return None
            info["glu_softclamp"] = (float(act.keywords["value"]), float(proj_in.up_softclamp_value))
            act = nn.SiLU() if fname == "softclamp_silu" else nn.GELU()
        info["in"] = proj_in.proj
        info["mult_bias"] = proj_in.mult_bias if isinstance(proj_in.mult_bias, Tensor) else None
    elif isinstance(proj_in, nn.Sequential):
        inner = list(proj_in)
        if len(inner) == 3 and type(inner[1]).__name__ == "Lambda" and isinstance(getattr(inner[1], "fn", None),
                                                                                functools.partial) \
                and inner[1].fn.func.__name__ == "softclamp" and set(inner[1].fn.keywords) == {"value"}:
            info["softclamp"] = float(inner[1].fn.keywords["value"])  # ff_softclamp_value
            inner = [inner[0], inner[2]]
        if len(inner) != 2 or not isinstance(inner[0], nn.Linear):
            kinds = ", ".join(type(m).__name__ for m in inner)
            problems.add(f"a feed-forward input of [{kinds}] (ff_softclamp_value or a custom activation)", name)
            return None
        info["glu"] = False
        info["in"], act = inner
        info["mult_bias"] = None
    else:
        problems.add(f"a feed-forward input {type(proj_in).__name__}", name)
        return None
    info["act"] = None
    info["relu_squared"], info["solu"] = False, None
    if type(act) is nn.GELU and act.approximate == "none":
        info["swish"] = False
    elif type(act) is nn.SiLU:
        info["swish"] = True
    elif type(act).__name__ == "ReluSquared" and type(act).__module__ == xt.LayerNorm.__module__:
        info["swish"], info["relu_squared"] = False, True  # ff_relu_squared
    elif type(act).__name__ == "SoLU" and type(act).__module__ == xt.LayerNorm.__module__ \
            and type(act.norm) is xt.LayerNorm:
        info["swish"], info["solu"] = False, act.norm  # ff_solu: its LayerNorm's gain is copied
    elif isinstance(act, nn.Module) and type(act).__module__.startswith("torch.nn") and not list(act.parameters()) \
            and not list(act.buffers()):
        info["swish"], info["act"] = False, act  # ff_custom_activation: a parameter-free torch.nn activation, copied
    else:
        problems.add(f"a feed-forward activation {act!r} (safeformer takes GELU, SiLU, ReLU squared, SoLU or a "
                     f"parameter-free torch.nn module as ff_custom_activation)", name)
        return None
    info["post_act_ln"] = None
    if parts and type(parts[0]) is xt.LayerNorm:  # ff_post_act_ln: its gain is copied
        info["post_act_ln"] = parts.pop(0)
    elif parts and _norm_kind(parts[0], xt) is not None:
        problems.add(f"ff_post_act_ln with a {type(parts[0]).__name__}", name)
        return None
    dropout = 0.0
    if parts and isinstance(parts[0], nn.Dropout):
        dropout = parts.pop(0).p
    if not parts or not isinstance(parts[0], nn.Linear):
        problems.add("a feed-forward without a final Linear", name)
        return None
    info["out"] = parts.pop(0)
    info["sublayer_dropout"] = 0.0
    if parts and isinstance(parts[0], nn.Dropout):
        info["sublayer_dropout"] = float(parts.pop(0).p)  # ff_sublayer_dropout
    if parts:
        problems.add(f"extra feed-forward modules {[type(m).__name__ for m in parts]}", name)
        return None
    info["dropout"] = dropout
    return info


def _ff_no_bias(info: dict) -> bool:
    """An x-transformers feed-forward built with ``no_bias=True`` (neither projection has a bias)."""
    return info["out"].bias is None and (info["glu"] or info["in"].bias is None)


# x-transformers' talking-heads convs (on its Attend) -> safeformer's stack keywords (the same names on Attention)
_TALKING_HEADS = {"pre_softmax_talking_heads": "attn_pre_talking_heads",
                  "post_softmax_talking_heads": "attn_post_talking_heads",
                  "pre_scale_post_talking_heads": "attn_pre_scale_post_talking_heads"}


def _allowed_types(xt, xt_attend) -> set[type]:
    import einops.layers.torch as einops_torch

    allowed = {
        xt.TransformerWrapper, xt.TokenEmbedding, xt.AbsolutePositionalEmbedding, xt.AttentionLayers, xt.Encoder,
        xt.Decoder, xt.CrossAttender, xt.LayerNorm, xt.RMSNorm, xt.SimpleRMSNorm, xt.ScaleNorm, xt.Attention,
        xt_attend.Attend, xt.FeedForward, xt.GLU, xt.Residual, xt.RotaryEmbedding, xt.AlibiPositionalBias,
        nn.Embedding, nn.Linear, nn.LayerNorm, nn.Dropout, nn.Identity, nn.ModuleList, nn.Sequential, nn.GELU,
        nn.SiLU, einops_torch.Rearrange, nn.Sigmoid,  # Sigmoid: the value residual mix (_check_attention)
        nn.Conv2d,  # the talking heads (read by _check_attention); any other conv is flagged there by its owner
        nn.ModuleDict,  # embed_num_tokens (read by _check_wrapper)
        xt.AttentionPool,  # attn_pool (read by _check_wrapper; its pooler Attention is an allowed type)
        xt.Scale, xt.LayerScale, xt.ShiftTokens,  # branch wrappers (read by _check_layers through _unwrap)
        xt.GRUGating, nn.GRUCell,  # gate_residual (read by _routing_options)
        xt.AdaptiveLayerNorm, xt.AdaptiveRMSNorm, xt.AdaptiveLayerScale,  # adaptive norms and gates (_check_layers)
    }
    dyt = getattr(sys.modules.get(xt.LayerNorm.__module__), "DynamicTanh", None)
    if dyt is not None:  # use_dynamic_tanh (read by _norm_kind)
        allowed.add(dyt)
    derf = getattr(sys.modules.get(xt.LayerNorm.__module__), "Derf", None)
    if derf is not None:  # use_derf (read by _norm_kind)
        allowed.add(derf)
    if hasattr(xt, "LoRALinear"):  # the low-rank attention gates (read by _gate_options)
        allowed.add(xt.LoRALinear)
    try:
        from torch_einops_utils.nn import Identity

        allowed.add(Identity)
    except ImportError:  # pragma: no cover
        pass
    return allowed


@dataclass
class _Plan:
    """What converting one x-transformers ``TransformerWrapper`` takes, found before anything is built."""

    model: nn.Module
    problems: _Problems
    layers_cls: type
    stack_kwargs: dict
    wrapper_kwargs: dict
    types: tuple
    heads: int
    kv_heads: int
    dim_head: int
    tied: bool
    attn_opts: dict[int, _AttnOptions] = field(default_factory=dict)


def _check_module_types(model, xt, xt_attend, problems: _Problems) -> None:
    """Every module must be of a type we know; the others name the option that made them."""
    allowed = _allowed_types(xt, xt_attend)
    flagged: list[str] = []
    for mname, module in model.named_modules():
        if type(module) in allowed or any(mname.startswith(f + ".") for f in flagged):
            continue
        tname = type(module).__name__
        if tname in _ROUTING_TYPES and type(module).__module__ == xt.Residual.__module__:  # read by _check_stack
            flagged.append(mname)
            continue
        if (tname == "MultiheadRMSNorm" and mname.endswith(".value_rmsnorm")) or (
                tname == "DataDependentAlibi" and mname.endswith(".data_dependent_alibi")) or (
                tname == "CoPE" and mname.endswith(".attend.cope")) or (
                tname == "RelativePositionBias" and mname == "attn_layers.rel_pos") or (
                tname == "DynamicPositionBias" and mname == "attn_layers.rel_pos") or (
                mname.startswith("attn_layers.rel_pos.mlp.") and type(module).__module__.startswith(
                    ("torch.nn", xt.LayerNorm.__module__))) or (
                tname == "FoldAxially" and mname.endswith(".hybrid_module")) or (
                tname == "MultiheadRMSNorm" and re.search(r"\.hybrid_norms\.[01]$", mname)) or (
                re.search(r"\.ff\.0(\.act|\.\d+)$", mname) and type(module).__module__.startswith("torch.nn")) or (
                tname == "PolarEmbedding" and mname == "attn_layers.polar_pos_emb") or (
                tname in ("ReluSquared", "SoLU") and re.search(r"\.ff\.0\.(1|act)$", mname)) or (
                tname == "ScaledSinusoidalEmbedding" and mname == "pos_emb") or (
                tname == "RelativeProjPositionalBias" and mname.endswith(".rel_proj_pos_bias")) or (
                tname == "Lambda" and isinstance(getattr(module, "fn", None), functools.partial)
                and getattr(module.fn.func, "__name__", "") == "softclamp"):  # converted (_check_attention, _parse_ff)
            flagged.append(mname)
            continue
        option = _TYPE_OPTIONS.get(tname, f"a {tname} module")
        problems.add(f"{option} ({tname})", mname or None)
        flagged.append(mname)



def _check_wrapper(model, xt, problems: _Problems, training_only: list[str], dim: int) -> dict:
    """The wrapper's options: a problem for each one safeformer has not; returns what the plan reads."""
    extra: dict = {}  # wrapper keywords read as they are (their parameters: the same names, see _build_wrapper)
    if isinstance(model.project_emb, nn.Linear):  # emb_dim != dim: embeddings of another width, projected
        extra["emb_dim"] = int(model.project_emb.in_features)
    elif not isinstance(model.project_emb, (nn.Identity,)) and type(model.project_emb).__name__ != "Identity":
        problems.add(f"a custom embedding projection {type(model.project_emb).__name__}")
    if not isinstance(model.token_emb, xt.TokenEmbedding):
        problems.add(f"a custom token_emb {type(model.token_emb).__name__}")
    if model.embeds is not None:  # embed_num_tokens: {name}_embed tables
        if all(k.endswith("_embed") and isinstance(e, nn.Embedding) for k, e in model.embeds.items()):
            extra["embed_num_tokens"] = {k[: -len("_embed")]: int(e.num_embeddings) for k, e in model.embeds.items()}
        else:
            problems.add("embed_num_tokens with custom embedding tables")
    ff_deep = getattr(model, "ff_deep_embed", None) is not None  # the same table, copied as it is
    if type(model.post_emb_norm).__name__ != "Identity":
        problems.add("post_emb_norm")
    if getattr(model, "looped", False):  # the looped LM: its exit gate is copied by _build_wrapper
        extra.update(looped=True, max_looped_steps=int(model.train_max_looped_steps))
    # mixture_of_softmax, recycling, add_continuous_pred_head, squeeze_out_last_dim, input_not_include_cache: the
    # same options there, their parameters under the same names (wrappers.copy_xt_wrapper_option_weights)
    extra.update(xt_wrapper_option_kwargs(model))
    pool = getattr(model, "attn_pool", None)
    pool_kwargs = None
    if pool is not None:  # one attention over the stack's output: the same parameters (depth > 1: a CrossAttender)
        if type(pool.pooler).__name__ != "Attention" or getattr(pool, "add_residual", False):
            problems.add("attn_pool with attn_pool_depth > 1")
        else:
            pool_kwargs = dict(attn_pool=True, num_pooled_tokens=int(pool.queries.shape[0]),
                               dim_pooled_tokens=int(pool.queries.shape[1]))
    if getattr(model, "sigsoftmax_logits", False):
        extra["sigsoftmax_logits"] = True
    to_logits = model.to_logits
    if getattr(model, "has_multiple_heads", False):  # a ModuleList of heads alike: checked through the first
        extra["num_output_heads"] = len(to_logits)
        to_logits = to_logits[0]
    num_memory_tokens = int(getattr(model, "num_memory_tokens", 0) or 0)
    if num_memory_tokens:
        if getattr(model, "memory_tokens_interspersed_every", None) is not None:  # memory rows before every segment
            extra["memory_tokens_interspersed_every"] = int(model.memory_tokens_interspersed_every)
    if getattr(model, "emb_frac_gradient", 1.0) != 1.0:
        training_only.append(f"emb_frac_gradient={model.emb_frac_gradient}")
    tied = False
    if to_logits is None:
        pass  # return_only_embed: an encoder that returns hidden states
    elif isinstance(to_logits, nn.Linear):
        if to_logits.bias is not None:
            problems.add("a to_logits with a bias")
        if to_logits.in_features != dim:
            problems.add(f"a to_logits of in_features {to_logits.in_features} != dim {dim}")
    elif not isinstance(to_logits, nn.Module) and hasattr(model, "tie_embedding_scale"):
        tied = True
    else:
        problems.add(f"a custom to_logits {type(to_logits).__name__}")
    sinu = type(model.pos_emb).__name__ == "ScaledSinusoidalEmbedding"
    if sinu:
        extra["scaled_sinu_pos_emb"] = True  # x-transformers' scaled sinusoids: their learned scale is copied
        half = model.pos_emb.inv_freq.numel()
        if half > 1 and not math.isclose(float(model.pos_emb.inv_freq[1]), 10000 ** (-1 / half), rel_tol=1e-5):
            problems.add("scaled_sinu_pos_emb with a theta other than 10000")
    has_abs = isinstance(model.pos_emb, xt.AbsolutePositionalEmbedding) or sinu
    l2norm_embed = bool(getattr(model, "l2norm_embed", False))
    if has_abs and not sinu and bool(model.pos_emb.l2norm_embed) != l2norm_embed:
        problems.add("l2norm_embed on the position embedding only")
    return dict(num_memory_tokens=num_memory_tokens, tied=tied, to_logits=to_logits, has_abs=has_abs,
                l2norm_embed=l2norm_embed, ff_deep=ff_deep, pool_kwargs=pool_kwargs, extra=extra)


def _check_stack(layers, xt, problems: _Problems, training_only: list[str], has_abs: bool) -> dict:
    """The stack's options and layer pattern, its relative positions; returns what the plan reads."""
    routing = _routing_options(layers, xt, problems)
    for attr in ("residual_attn", "cross_residual_attn"):  # no parameters: the options as they are
        if getattr(layers, attr, False):
            routing[attr] = True
    if getattr(layers, "softclamp_output", False):
        routing.update(softclamp_output=True, softclamp_output_value=float(layers.softclamp_output_value))
    rel_pos = getattr(layers, "rel_pos", None)
    alibi = rel_pos is not None and type(rel_pos) is xt.AlibiPositionalBias
    t5_opts: dict = {}
    if rel_pos is not None and type(rel_pos) is getattr(xt, "RelativePositionBias", None):  # T5's bucketed bias
        t5_opts = dict(rel_pos_bias=True, rel_pos_num_buckets=int(rel_pos.num_buckets),
                       rel_pos_max_distance=int(rel_pos.max_distance))
        if bool(rel_pos.causal) != bool(layers.causal):
            problems.add("rel_pos_bias whose causal differs from its stack's")
        if has_abs:
            problems.add("rel_pos_bias with the absolute position embedding (disable_abs_pos_emb=False): safeformer "
                         "drops it next to relative positions")
    elif rel_pos is not None and type(rel_pos) is getattr(xt, "DynamicPositionBias", None):  # dynamic_pos_bias
        mlp = list(rel_pos.mlp)
        norm = any(isinstance(m, (nn.LayerNorm, xt.LayerNorm)) for m in mlp[0])
        width = mlp[-1].in_features
        if width != layers.dim // 4:
            problems.add(f"dynamic_pos_bias of width {width} (safeformer's is dim // 4 = {layers.dim // 4}, as "
                         f"x-transformers builds it)")
        t5_opts = dict(dynamic_pos_bias=True, dynamic_pos_bias_mlp_depth=len(mlp) - 1)
        if rel_pos.log_distance:
            t5_opts["dynamic_pos_bias_log_distance"] = True
        if norm:
            t5_opts["dynamic_pos_bias_norm"] = True
    elif rel_pos is not None and not alibi:
        problems.add(_TYPE_OPTIONS.get(type(rel_pos).__name__, "a relative position bias"))
    polar = getattr(layers, "polar_pos_emb", None)
    if polar is not None:  # PoPE: its learned per-head key bias is copied (query heads permuted) by _build_wrapper
        dim_head = polar.inv_freq.numel()
        want = 1.0 / (10000.0 ** (torch.arange(0, dim_head, dtype=torch.float64) / dim_head))
        if not torch.allclose(polar.inv_freq.detach().double().cpu(), want, rtol=1e-6, atol=0):
            problems.add("polar_pos_emb with a base other than 10000")
        if has_abs:
            problems.add("polar_pos_emb with the absolute position embedding (disable_abs_pos_emb=False): safeformer "
                         "drops it next to relative positions")
    if any(p > 0 for p in getattr(layers, "layer_dropouts", ())):
        training_only.append("layer_dropout")
    if getattr(layers, "cross_attn_tokens_dropout", 0) > 0:
        training_only.append("cross_attn_tokens_dropout")
    types = tuple(layers.layer_types)
    cross = "c" in types
    only_cross = cross and "a" not in types
    block = ("c", "f") if only_cross else (("a", "c", "f") if cross else ("a", "f"))

    rotary = layers.rotary_pos_emb
    rotary_dim = None
    rotary_opts: dict = {}
    if rotary is not None:
        rotary_dim = rotary.inv_freq.numel() * 2
        if getattr(rotary, "scale", None) is not None:  # xpos: a decay of the logits with the distance
            rotary_opts.update(rotary_xpos=True, rotary_xpos_scale_base=float(rotary.scale_base))
        interp = float(getattr(rotary, "interpolation_factor", 1.0))
        if interp != 1.0:
            rotary_opts["rotary_interpolation_factor"] = interp
        # the base (rotary_base_rescale_factor folded in) read back from the frequencies: inv_freq[1] = base^(-2/d)
        inv = rotary.inv_freq.detach().double().cpu()
        base = float(inv[1] ** (-rotary_dim / 2)) if rotary_dim > 2 else 10000.0
        if not math.isclose(base, 10000.0, rel_tol=1e-6):
            rotary_opts["rotary_theta"] = base
        expected = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        if not torch.allclose(inv, expected, rtol=1e-6, atol=0):
            problems.add("rotary frequencies that are not a geometric series of one base")
        if has_abs:
            problems.add("absolute and rotary positions together (disable_abs_pos_emb=False with rotary)")
    alibi_opts: dict = {}
    if alibi:  # the first rel_pos.heads heads take the slopes, the others none (alibi_num_heads, rel_pos_kwargs)
        slopes = rel_pos.slopes.detach().double().cpu().flatten()
        if rel_pos.heads != rel_pos.total_heads:
            alibi_opts["alibi_num_heads"] = int(rel_pos.heads)
        if not torch.allclose(slopes, alibi_slopes(rel_pos.heads).double(), rtol=1e-6, atol=0):
            alibi_opts["rel_pos_kwargs"] = {"slopes": slopes.tolist()}
        if rotary is not None:
            problems.add("rotary_pos_emb and alibi_pos_bias together (safeformer takes one relative position scheme)")
    return dict(types=types, cross=cross, only_cross=only_cross, rotary=rotary, rotary_dim=rotary_dim,
                rotary_opts=rotary_opts,
                alibi=alibi, alibi_opts=alibi_opts, routing=routing, polar=polar is not None, t5_opts=t5_opts,
                block=block)


def _layer_pattern(layers, types: tuple, block: tuple, macaron: bool) -> tuple[dict, int | None]:
    """``(safeformer keywords that rebuild x-transformers' layer pattern and execution order, depth)``: the default
    ``block`` per layer (with macaron's leading feed-forward, or without feed-forwards: ``only_attn``), else
    ``custom_layers`` (what par_ratio / sandwich_coef built too); ``weight_tie_layers`` or ``layers_execute_order``
    for a custom order. The built stack is checked against both (``_build_wrapper``)."""
    order = tuple(layers.layers_execute_order)
    out: dict = {}
    candidates = [(("f",) + block, {"macaron": True}), (block, {}), (tuple(t for t in block if t != "f"),
                                                                     {"only_attn": True})]
    for base, opts in candidates:
        if opts.get("macaron") and not macaron:
            continue
        if base and len(types) % len(base) == 0 and types == base * (len(types) // len(base)):
            out, depth = dict(opts), len(types) // len(base)
            break
    else:
        out, depth = {"custom_layers": types}, int(getattr(layers, "depth", 0)) or None
    if order != tuple(range(len(types))):
        if "custom_layers" not in out and depth == 1 and len(order) % len(types) == 0 \
                and order == tuple(range(len(types))) * (len(order) // len(types)):
            out["weight_tie_layers"], depth = True, len(order) // len(types)
        else:
            out["layers_execute_order"] = order
            if "custom_layers" in out:
                depth = None
    return out, depth


def _routing_options(layers, xt, problems: _Problems) -> dict:
    """x-transformers' residual routing options of ``layers`` as safeformer's ``AttentionLayers`` keywords
    (``block.ResidualRouting``; defaults left out); what has no exact counterpart is recorded in ``problems``."""
    out: dict = {}
    for attr in ("unet_skips", "reinject_input", "pre_and_post_norm"):
        if getattr(layers, attr, False):
            out[attr] = True
    if getattr(layers, "learned_reinject_input_gate", None) is not None:
        out["learned_reinject_input_gate"] = True
    residuals = [layer[2] for layer in layers.layers]
    kinds = {type(r).__name__ for r in residuals}
    if "HyperConnection" in kinds:
        problems.add(f"num_residual_streams={layers.num_residual_streams} (hyper-connections): x-transformers' Sinkhorn "
                     "step normalises each stream's 1 x S row of the residual mixing matrix on its own, which makes "
                     "its mix the all-ones matrix (every stream summed into each); safeformer mixes the streams by a "
                     "doubly stochastic S x S matrix, so the same weights give other outputs")
    if kinds == {"OrthogonalResidualUpdate"}:
        out["orthog_residual"] = True
        if any(getattr(r, "residual_scale", None) is not None for r in residuals):
            problems.add("scale_residual with orthog_residual")
    elif kinds and kinds <= {"Residual", "GRUGating"}:
        if kinds == {"GRUGating"}:
            out["gate_residual"] = True
        elif len(kinds) > 1:
            problems.add("gate_residual on some layers only")
        learned = {getattr(r, "residual_scale", None) is not None for r in residuals}
        if learned == {True}:
            out["scale_residual"] = True  # a float branch scale (x-transformers' float scale_residual) joins it later
        elif len(learned) > 1:
            problems.add("scale_residual on some layers only")
        constants = {float(getattr(r, "scale_residual_constant", 1.0)) for r in residuals}
        if len(constants) > 1:
            problems.add(f"different scale_residual_constant per layer: {sorted(constants)}")
        elif constants != {1.0}:
            out["scale_residual_constant"] = constants.pop()
    elif kinds == {"MVSplitResidualUpdate"}:
        out["mv_split_residual"] = True
        learned = {bool(r.learned) for r in residuals}
        if learned == {True}:
            out["residual_fn_kwargs"] = {"learned": True}
        elif len(learned) > 1:
            problems.add("mv_split_residual with learned and static updates mixed")
    integrators = [m for m in getattr(layers, "layer_integrators", ()) if m is not None]
    if integrators and all(type(m).__name__ == "DynamicLIMe" for m in integrators):
        out["integrate_layers"] = True
        softmax = {isinstance(m.to_weights[-1], nn.Softmax) for m in integrators}
        if softmax == {False}:
            out["layer_integrate_use_softmax"] = False
        elif len(softmax) > 1:
            problems.add("integrate_layers with softmax and ReLU weights mixed")
        if any(m.to_weights[0] is None for m in integrators):
            problems.add("integrate_layers without its RMSNorm (DynamicLIMe(norm=False))")
    diff_views = any(getattr(_unwrap(blk, xt).inner, "qkv_receive_diff_residuals", False) for _, blk, _ in layers.layers)
    if diff_views and "integrate_layers" not in out and "HyperConnection" not in kinds:
        problems.add("qkv_receive_diff_residuals")
    return out


@dataclass
class _Wrapped:
    """An x-transformers branch module without its wrappers (outermost first: ``Scale`` (a float residual scale),
    ``LayerScale``, ``ShiftTokens``, macaron's ``Scale(0.5)``)."""

    inner: nn.Module
    scale: float = 1.0  # the product of the Scale wrappers (macaron's half step of a feed-forward included)
    layerscale: nn.Module | None = None
    shifts: tuple = ()


def _unwrap(layer, xt) -> _Wrapped:
    out = _Wrapped(layer)
    while True:
        m = out.inner
        if type(m) is xt.Scale:
            out.scale *= 1.0 if m.scale is None else float(m.scale)
            out.inner = m.fn
        elif type(m) in (xt.LayerScale, getattr(xt, "AdaptiveLayerScale", None)) and out.layerscale is None:
            out.layerscale, out.inner = m, m.fn
        elif type(m) is xt.ShiftTokens and not out.shifts:
            out.shifts, out.inner = tuple(m.shifts), m.fn
        else:
            return out


def _check_layers(layers, xt, xt_attend, types: tuple, dim: int, problems: _Problems, training_only: list[str],
                  routing: dict) -> dict:
    """Per layer: norms, residuals, attention and feed-forward blocks, which must agree across layers (but for
    the per-layer feed-forward widths and dropouts, and the self-attention dropouts)."""
    norm_kinds: set[str] = set()
    attn_shapes: set[tuple] = set()
    attn_keys: set[tuple] = set()
    attn_opts: dict[int, _AttnOptions] = {}
    mem_kv: dict[str, set[int]] = {"a": set(), "c": set()}
    cross_dims: set[int] = set()
    attn_dropouts: set[float] = set()
    drops: dict[str, list[float]] = {"a": [], "c": []}  # per layer, self- and cross-attention dropouts
    self_scoring: set[tuple] = set()
    inverted: list[bool] = []  # per cross-attention block
    ff_infos: list[dict | None] = []
    present: dict[str, set[bool]] = {"pre": set(), "sandwich": set(), "post": set(), "layerscale": set()}
    scales: dict[str, set[float]] = {"attn": set(), "ff": set()}
    shifts: list[int] = []
    adaptive_gates: set[bool] = set()
    cond_width = None
    for k, ((pre, post_branch, post_main), wrapped, _) in enumerate(layers.layers):
        name = f"attn_layers.layers.{k}"
        kind = types[k] if k < len(types) else "?"
        for what, norm in (("pre", pre), ("sandwich", post_branch), ("post", post_main)):
            present[what].add(norm is not None)
            if norm is None:
                continue
            nk = _norm_kind(norm, xt)
            if nk is not None and nk.startswith("ada_"):
                cond_width = int(norm.to_gamma.in_features)
            if nk is None:
                problems.add(f"{_TYPE_OPTIONS.get(type(norm).__name__, type(norm).__name__)}", name)
            else:
                norm_kinds.add(nk)
                if nk in ("layer", "ada_layer") and norm.ln.eps != 1e-5:
                    problems.add(f"a LayerNorm eps {norm.ln.eps} != 1e-5", name)
        w = _unwrap(wrapped, xt)
        blk = w.inner
        scales["ff" if kind == "f" else "attn"].add(w.scale)
        present["layerscale"].add(w.layerscale is not None)
        if w.layerscale is not None:
            adaptive_gates.add(type(w.layerscale) is not xt.LayerScale)
            if hasattr(w.layerscale, "to_gamma"):
                cond_width = int(w.layerscale.to_gamma.in_features)
        amount = max((abs(t) for t in w.shifts), default=0)
        if w.shifts and tuple(w.shifts) != tuple(range(0 if layers.causal else -amount, amount + 1)):
            problems.add(f"shift_tokens with shifts {w.shifts}", name)
        shifts.append(amount)
        if kind in ("a", "c") and type(blk) is xt.Attention:
            opts = _check_attention(name, blk, xt, xt_attend, problems, training_only)
            attn_opts[k] = opts
            mem_kv[kind].add(opts.mem_kv)  # may differ between the kinds (x-transformers' cross_attn_num_mem_kv)
            attn_keys.add(replace(opts, mem_kv=0).key())
            if kind == "a":
                self_scoring.add(opts.self_scoring)
            else:
                inverted.append(opts.inverted)
            dh = blk.to_q.out_features // blk.heads
            attn_shapes.add((blk.heads, blk.kv_heads, dh))
            attn_dropouts.add(blk.attend.dropout)
            drops[kind].append(float(blk.attend.dropout))
            if blk.to_v.out_features != blk.kv_heads * dh:
                problems.add("attn_value_dim_head != dim_head", name)
            out_features = blk.to_out.out_features if isinstance(blk.to_out, nn.Linear) else blk.heads * dh
            if out_features != dim:
                problems.add(f"attn_dim_out={out_features} != dim", name)
            if kind == "a":
                kv_in = blk.to_latent_kv if getattr(blk, "to_latent_kv", None) is not None else blk.to_k
                if kv_in.in_features != dim:
                    problems.add("attn_dim_context on self-attention", name)
                if blk.causal != layers.causal:
                    problems.add(f"a self-attention with causal={blk.causal} in a stack with causal={layers.causal}", name)
            else:
                cross_dims.add((blk.to_latent_kv if getattr(blk, "to_latent_kv", None) is not None else blk.to_k).in_features)
                if blk.causal:
                    problems.add("a causal cross-attention", name)
        elif kind == "f" and type(blk) is xt.FeedForward:
            ff_infos.append(_parse_ff(name, blk, xt, problems, training_only))
    for what, option in (("pre", "pre_norm"), ("sandwich", "sandwich_norm"), ("post", "post-norms"),
                         ("layerscale", "use_layerscale")):
        if len(present[what]) > 1:
            problems.add(f"{option} on some layers only")
    # one branch scale (x-transformers' float scale_residual / depth_scale_residual) for every branch, feed-forwards
    # possibly at half of it (macaron)
    attn_scale = next(iter(scales["attn"]), next(iter(scales["ff"]), 1.0))
    macaron = bool(scales["attn"]) and scales["ff"] == {attn_scale * 0.5}
    if len(scales["attn"]) > 1 or not (scales["ff"] <= {attn_scale} or macaron):
        problems.add(f"branches scaled differently: attention {sorted(scales['attn'])}, feed-forward {sorted(scales['ff'])}")
    wrappers = dict(scale=attn_scale, macaron=macaron, layerscale=present["layerscale"] == {True},
                    adaptive_layerscale=bool(adaptive_gates) and adaptive_gates == {True},
                    sandwich_norm=present["sandwich"] == {True}, pre_norm=present["pre"] != {False},
                    post_norms=present["post"] == {True}, shifts=shifts)
    final = layers.final_norm
    if _norm_kind(final, xt) is None:
        if type(final).__name__ == "Identity":
            pass  # pre_norm_has_final_norm=False or pre_and_post_norm (post-norm is refused above)
        else:
            problems.add(_TYPE_OPTIONS.get(type(final).__name__, type(final).__name__), "attn_layers.final_norm")
    else:
        norm_kinds.add(_norm_kind(final, xt))
    if len(norm_kinds) > 1:
        problems.add(f"LayerNorm and RMS norms mixed ({sorted(norm_kinds)})")
    if len(attn_shapes) > 1:
        problems.add(f"attention layers of different (heads, kv_heads, dim_head): {sorted(attn_shapes)}")
    if len(attn_keys) > 1:
        problems.add(f"attention layers that differ in (qk_norm, num_mem_kv, head_learned_sink, logit softclamp, gates): "
                     f"{sorted(attn_keys, key=repr)}")
    for kind, counts in mem_kv.items():
        if len(counts) > 1:
            problems.add(f"{'self' if kind == 'a' else 'cross'}-attention layers with different num_mem_kv: {sorted(counts)}")
    if len(self_scoring) > 1:
        problems.add(f"self-attention layers with different CoPE / relative projection bias options: "
                     f"{sorted(self_scoring, key=repr)}")
    if len(cross_dims) > 1:
        problems.add(f"cross-attention layers of different context widths: {sorted(cross_dims)}")
    ff_ok = [f for f in ff_infos if f is not None]
    ff_kinds = {(f["glu"], f["swish"], f.get("softclamp"), f.get("glu_softclamp"), repr(f["act"]), f["relu_squared"],
                 f["solu"] is not None, f["post_act_ln"] is not None, f["sublayer_dropout"], _ff_no_bias(f),
                 f["mult_bias"] is not None) for f in ff_ok}
    if len(ff_kinds) > 1:  # (widths and dropouts may differ per layer)
        problems.add(f"feed-forward layers of different (glu, swish, softclamp, glu softclamp, activation, relu squared, "
                     f"solu, post-activation norm, sublayer dropout, no bias, mult bias): {sorted(ff_kinds, key=repr)}")
    for f in ff_ok:
        if (f["in"].bias is None) != (f["out"].bias is None) and not f["glu"]:
            problems.add("a feed-forward with a bias on one projection only")
        if f["glu"] and f["in"].bias is None:
            problems.add("a gated feed-forward without an input bias")
    for f in ff_ok:
        if f["out"].out_features != dim or f["in"].in_features != dim:
            problems.add("ff_dim_out != dim")
    return dict(norm_kinds=norm_kinds, attn_shapes=attn_shapes, attn_opts=attn_opts, cross_dims=cross_dims, mem_kv=mem_kv,
                attn_dropouts=attn_dropouts, drops=drops, ff_ok=ff_ok, wrappers=wrappers, cond_width=cond_width,
                self_scoring=next(iter(self_scoring), ()), inverted=inverted)


def _attn_dropouts(drops: dict[str, list[float]], only_cross: bool, problems: _Problems) -> tuple:
    """``(attn_dropout, cross-attention dropout or None)``: one number, or one per layer (the self-attentions';
    the cross-attentions' with ``only_cross``), and the cross-attentions' own value where it differs from what
    ``attn_dropout`` gives them (a sequence gives them 0)."""
    own, cross = (drops["c"], []) if only_cross else (drops["a"], drops["c"])
    own = own or [0.0]
    attn_dropout = own[0] if len(set(own)) == 1 else tuple(own)
    if not cross:
        return attn_dropout, None
    if len(set(cross)) > 1:
        problems.add(f"cross-attention layers of different dropout: {cross}")
    given = attn_dropout if isinstance(attn_dropout, float) else 0.0
    return attn_dropout, (cross[0] if cross[0] != given else None)


def _plan_wrapper(model, xt, xt_attend, problems: _Problems, training_only: list[str]) -> _Plan:
    """Checks an x-transformers ``TransformerWrapper`` (recording every problem) and plans its conversion."""
    layers = model.attn_layers
    dim = layers.dim
    _check_module_types(model, xt, xt_attend, problems)
    w = _check_wrapper(model, xt, problems, training_only, dim)
    num_memory_tokens, tied, to_logits, has_abs, l2norm_embed = (
        w["num_memory_tokens"], w["tied"], w["to_logits"], w["has_abs"], w["l2norm_embed"])
    st = _check_stack(layers, xt, problems, training_only, has_abs)
    types, cross, only_cross, rotary, rotary_dim, alibi = (
        st["types"], st["cross"], st["only_cross"], st["rotary"], st["rotary_dim"], st["alibi"])
    ly = _check_layers(layers, xt, xt_attend, types, dim, problems, training_only, st["routing"])
    norm_kinds, attn_shapes, attn_opts, cross_dims, ff_ok = (
        ly["norm_kinds"], ly["attn_shapes"], ly["attn_opts"], ly["cross_dims"], ly["ff_ok"])

    heads, kv_heads, dim_head = next(iter(attn_shapes)) if attn_shapes else (1, 1, dim)
    alibi_opts = dict(st["alibi_opts"])
    opts0 = next(iter(attn_opts.values()), _AttnOptions())

    # ---- the safeformer configuration
    ff0 = ff_ok[0] if ff_ok else None
    mults = []
    for hidden in [f["out"].in_features for f in ff_ok] or [4 * dim]:
        mults.append(hidden / dim)
        if int(dim * mults[-1]) != hidden:
            problems.add(f"a feed-forward hidden width {hidden} that is not int(dim * mult) for any float mult")
    ff_mult = mults[0] if len(set(mults)) == 1 else tuple(mults)  # per layer (x-transformers' ff_mult sequence)
    ff_drops = [float(f["dropout"]) for f in ff_ok] or [0.0]
    ff_dropout = ff_drops[0] if len(set(ff_drops)) == 1 else tuple(ff_drops)
    attn_dropout, cross_dropout = _attn_dropouts(ly["drops"], only_cross, problems)
    rms = norm_kinds == {"rms"}
    ada = len(norm_kinds) == 1 and next(iter(norm_kinds)).startswith("ada_")
    stack_kwargs = dict(
        dim=dim, depth=None, heads=heads, dim_head=dim_head, kv_heads=kv_heads if kv_heads != heads else None,
        ff_mult=ff_mult, ff_glu=bool(ff0 and ff0["glu"]), ff_swish=bool(ff0 and ff0["swish"]),
        use_rmsnorm=rms, norm_eps=_RMS_EPS if rms or norm_kinds == {"ada_rms"} else None,
        use_dynamic_tanh=norm_kinds == {"dyt"}, use_adaptive_layernorm=norm_kinds == {"ada_layer"},
        use_adaptive_rmsnorm=norm_kinds == {"ada_rms"},
        use_derf=norm_kinds == {"derf"},
        use_scalenorm=norm_kinds == {"scale"}, use_simple_rmsnorm=norm_kinds == {"simple_rms"},
        attn_dropout=attn_dropout, ff_dropout=ff_dropout,
    )
    stack_kwargs.update(st["routing"])
    wr = ly["wrappers"]
    pattern, stack_kwargs["depth"] = _layer_pattern(layers, types, st["block"], wr["macaron"])
    stack_kwargs.update(pattern)
    if wr["scale"] != 1.0:  # a float branch scale: with a learned residual scale x-transformers' float scale_residual
        stack_kwargs["scale_residual" if st["routing"].get("scale_residual") else "depth_scale_residual"] = wr["scale"]
    for key in ("macaron", "sandwich_norm"):
        if wr[key]:
            stack_kwargs[key] = True
    if wr["layerscale"]:
        stack_kwargs["use_adaptive_layerscale" if wr["adaptive_layerscale"] else "use_layerscale"] = True
    if ada or wr["adaptive_layerscale"]:  # the condition's width (before x-transformers' adaptive_condition_mlp)
        mlp = getattr(layers, "adaptive_mlp", None)
        if isinstance(mlp, nn.Sequential):
            first = mlp[0]
            stack_kwargs.update(dim_condition=int(first.in_features), adaptive_condition_mlp=True,
                                adaptive_condition_mlp_expansion=int(first.out_features // first.in_features))
            if first.out_features % first.in_features or first.bias is not None or len(mlp) != 2 \
                    or not isinstance(mlp[1], nn.SiLU):
                problems.add("adaptive_condition_mlp of another shape")
        elif ly["cond_width"] is not None:
            stack_kwargs.update(dim_condition=ly["cond_width"])
    if not wr["pre_norm"]:  # post-norm: the norms after each residual update (no final norm)
        stack_kwargs["pre_norm"] = False
        if not wr["post_norms"]:
            problems.add("no pre-norm and no post-norm")
    elif wr["post_norms"] and not st["routing"].get("pre_and_post_norm"):
        problems.add("post-norms without pre_and_post_norm")
    if any(wr["shifts"]):
        shifts = wr["shifts"]
        stack_kwargs["shift_tokens"] = shifts[0] if len(set(shifts)) == 1 else tuple(shifts)
    if type(layers.final_norm).__name__ == "Identity" and wr["pre_norm"] and not st["routing"].get("pre_and_post_norm"):
        stack_kwargs.update(pre_norm_has_final_norm=False)
    if cross_dropout is not None:  # x-transformers' cross_attn_dropout
        stack_kwargs.setdefault("cross_attn_kwargs", {})["dropout"] = cross_dropout
    if rotary is not None:
        stack_kwargs.update(rotary_pos_emb=True, rotary_emb_dim=rotary_dim, **st["rotary_opts"])
    if alibi:
        stack_kwargs.update(alibi_pos_bias=True, **alibi_opts)
    if st["polar"]:
        stack_kwargs.update(polar_pos_emb=True)
    stack_kwargs.update(st["t5_opts"])
    if cross:
        stack_kwargs.update(dim_context=next(iter(cross_dims), dim))
    if opts0.qk_norm or opts0.value_rmsnorm:  # x-transformers l2-normalises (F.normalize, eps 1e-12)
        stack_kwargs.update(attn_qk_norm_eps=_RMS_EPS)
    if opts0.qk_norm:
        stack_kwargs.update(attn_qk_norm=True)
        if opts0.qk_dim_scale:
            stack_kwargs.update(attn_qk_norm_dim_scale=True)
        else:
            stack_kwargs.update(attn_qk_norm_scale=opts0.qk_scale)
        if opts0.qk_groups != 1:
            stack_kwargs.update(attn_qk_norm_groups=opts0.qk_groups)
    if opts0.value_rmsnorm:
        stack_kwargs.update(attn_value_rmsnorm=True)
    if getattr(layers, "add_value_residual", False):
        stack_kwargs.update(add_value_residual=True,
                            learned_value_residual_mix=any(o.value_mix for o in attn_opts.values()))
    if ff0 is not None and ff0.get("softclamp") is not None:
        stack_kwargs.update(ff_softclamp_value=ff0["softclamp"])
    if ff0 is not None and ff0.get("glu_softclamp") is not None:
        gate, up = ff0["glu_softclamp"]
        stack_kwargs.update(ff_glu_softclamp=True, ff_glu_gate_softclamp_value=gate, ff_glu_up_softclamp_value=up)
    if ff0 is not None and ff0["act"] is not None:
        stack_kwargs.update(ff_custom_activation=copy.deepcopy(ff0["act"]))
    if ff0 is not None:  # x-transformers' further feed-forward keywords (the same in every layer: checked above)
        for key, on in (("ff_relu_squared", ff0["relu_squared"]), ("ff_solu", ff0["solu"] is not None),
                        ("ff_post_act_ln", ff0["post_act_ln"] is not None), ("ff_no_bias", _ff_no_bias(ff0)),
                        ("ff_glu_mult_bias", ff0["mult_bias"] is not None)):
            if on:
                stack_kwargs[key] = True
        if ff0["sublayer_dropout"]:
            stack_kwargs["ff_sublayer_dropout"] = ff0["sublayer_dropout"]
    if opts0.dd_alibi:
        if cross:
            problems.add("attn_data_dependent_alibi with cross-attention (safeformer biases self-attention only)")
        stack_kwargs.update(dict(opts0.dd_alibi))
    if opts0.orthog:
        if cross:
            problems.add("attn_orthog_projected_values with cross-attention (safeformer projects self-attention only)")
        stack_kwargs.update(dict(opts0.orthog))
    self_mem, cross_mem = (max(ly["mem_kv"][k], default=0) for k in ("a", "c"))
    if only_cross:
        self_mem = cross_mem
    if self_mem:
        stack_kwargs.update(attn_num_mem_kv=self_mem)
    if cross and cross_mem != self_mem:  # x-transformers' cross_attn_num_mem_kv
        stack_kwargs.setdefault("cross_attn_kwargs", {})["num_mem_kv"] = cross_mem
    if opts0.sink:
        stack_kwargs.update(attn_head_learned_sink=True)
    if opts0.head_scale:
        stack_kwargs.update(attn_head_scale=True)
    if opts0.hard:
        stack_kwargs.update(attn_hard=True)
    if opts0.zero_kv:
        stack_kwargs.update(attn_add_zero_kv=True)
    if opts0.rotate_heads is not None:
        stack_kwargs.update(rotate_num_heads=opts0.rotate_heads)
    for conv in opts0.talking_heads:  # x-transformers' talking heads: the stack keyword of each conv
        stack_kwargs[_TALKING_HEADS[conv]] = True
    if opts0.sparse_topk is not None:
        stack_kwargs.update(attn_sparse_topk=opts0.sparse_topk[0])
        if opts0.sparse_topk[1]:
            stack_kwargs.update(attn_sparse_topk_straight_through=True)
    if opts0.sublayer_dropout:
        stack_kwargs.update(attn_sublayer_dropout=opts0.sublayer_dropout)
    if opts0.softclamp is not None:
        stack_kwargs.update(attn_softclamp_logits=True, attn_logit_softclamp_value=opts0.softclamp)
    stack_kwargs.update(dict(opts0.gates))
    stack_kwargs.update(dict(opts0.scoring))
    if opts0.hybrid:  # the module itself: every layer's copy gets its own weights in _build_wrapper
        fold, mask_kwarg, learned_mix, _ = opts0.hybrid
        first = next(_unwrap(blk, xt).inner for k, (_, blk, _) in enumerate(layers.layers) if k in attn_opts)
        stack_kwargs.update(attn_hybrid_module=copy.deepcopy(first.hybrid_module.fn), attn_hybrid_fold_axial_dim=fold,
                            attn_hybrid_mask_kwarg=mask_kwarg, attn_hybrid_learned_mix=learned_mix)
    stack_kwargs.update(dict(ly["self_scoring"]))
    if any(ly["inverted"]):
        inv = ly["inverted"]
        stack_kwargs.update(cross_attn_inverted_attention=True if all(inv) else tuple(inv))
    layers_cls = CrossAttender if only_cross else (Decoder if layers.causal else Encoder)
    if not only_cross:
        stack_kwargs.update(cross_attend=cross)

    num_tokens = model.token_emb.emb.num_embeddings if isinstance(model.token_emb, xt.TokenEmbedding) else 1
    logits_dim = to_logits.out_features if isinstance(to_logits, nn.Linear) else num_tokens
    wrapper_kwargs = dict(
        num_tokens=num_tokens, max_seq_len=model.max_seq_len,
        emb_dropout=model.emb_dropout.p, use_abs_pos_emb=has_abs, logits_dim=logits_dim if logits_dim != num_tokens else None,
    )
    if to_logits is None:
        wrapper_kwargs.update(return_only_embed=True)
    if tied:
        wrapper_kwargs.update(tie_embedding=True, tie_embedding_scale=float(model.tie_embedding_scale))
    if num_memory_tokens:
        wrapper_kwargs.update(num_memory_tokens=num_memory_tokens)
    if l2norm_embed:
        wrapper_kwargs.update(l2norm_embed=True)
    if getattr(model, "cls_token", None) is not None:
        wrapper_kwargs.update(use_cls_token=True, num_cls_tokens=int(model.cls_token.shape[0]))
    if getattr(model, "average_pool_embed", False):
        wrapper_kwargs.update(average_pool_embed=True)
    if getattr(model, "max_mem_len", 0):  # Transformer-XL memories (the stack checks what runs beside them)
        wrapper_kwargs.update(max_mem_len=int(model.max_mem_len), shift_mem_down=int(getattr(model, "shift_mem_down", 0)))
    if w["ff_deep"]:
        wrapper_kwargs.update(ff_deep_embed=True)
    if w["pool_kwargs"] is not None:
        wrapper_kwargs.update(w["pool_kwargs"])
    wrapper_kwargs.update(w["extra"])
    return _Plan(
        model=model, problems=problems, layers_cls=layers_cls, stack_kwargs=stack_kwargs, wrapper_kwargs=wrapper_kwargs,
        types=types, heads=heads, kv_heads=kv_heads, dim_head=dim_head, tied=tied, attn_opts=attn_opts,
    )


def _build_wrapper(plan: _Plan, xt) -> TransformerWrapper:
    """The safeformer model of a checked plan, with the x-transformers weights copied in. Parameters
    left unused are recorded as problems (the caller raises)."""
    model = plan.model
    layers = model.attn_layers
    dim = layers.dim
    try:
        sf = TransformerWrapper(attn_layers=plan.layers_cls(**plan.stack_kwargs), **plan.wrapper_kwargs)
    except (TypeError, ValueError) as err:  # options each convertible, but not together in safeformer
        plan.problems.add(f"no safeformer model takes this combination of options: {err}")
        plan.problems.raise_if_any()
    built = (tuple(sf.attn_layers.layer_types), tuple(sf.attn_layers.layers_execute_order))
    if built != (tuple(layers.layer_types), tuple(layers.layers_execute_order)):
        plan.problems.add(f"a layer pattern / execution order safeformer builds otherwise: {built} for "
                          f"{(tuple(layers.layer_types), tuple(layers.layers_execute_order))}")
        plan.problems.raise_if_any()
    ref = model.token_emb.emb.weight
    sf = sf.to(device=ref.device, dtype=ref.dtype)  # before copying: no precision is lost on the way

    used: set[int] = set()

    def take(t: Tensor) -> Tensor:
        used.add(id(t))
        return t.detach()

    def put(dst: Tensor, src: Tensor) -> None:
        if dst.shape != src.shape:
            raise AssertionError(f"shape mismatch converting weights: {tuple(dst.shape)} vs {tuple(src.shape)}")
        dst.copy_(src)

    def copy_norm(dst: nn.Module, src) -> None:
        weight, _, names = _norm_weights(src, xt)
        for n in names:
            used.add(id(getattr(src, n)))
        if isinstance(dst, AdaptiveNorm):  # norm(x) * (1 + W c): x-transformers' has no shift (to_beta stays 0)
            put(dst.to_gamma.weight, take(src.to_gamma.weight))
            if dst.to_beta is not None:
                dst.to_beta.weight.zero_()
            if dst.rms and dst.eps != _RMS_EPS:
                raise AssertionError(f"converted adaptive RMSNorm has eps {dst.eps}, expected {_RMS_EPS}")
            return
        if isinstance(dst, DynamicTanh):  # x-transformers' unit offsets (norm_add_unit_offset) moved to ours
            put(dst.pre_tanh_scale, src.pre_tanh_scale.detach() + float(src.pre_tanh_scale_offset)
                - dst.pre_tanh_scale_offset)
            put(dst.gamma, src.gamma.detach() + float(src.gamma_offset) - dst.gamma_offset)
            put(dst.beta, src.beta.detach())
            return
        if isinstance(dst, XtScaleNorm):  # one scalar gain, x-transformers' unit offset folded in
            put(dst.g, src.g.detach() + float(src.unit_offset) - float(dst.unit_offset))
            return
        if isinstance(dst, XtSimpleRMSNorm):  # no parameter
            return
        if isinstance(dst, Derf):  # erf(alpha * x + s) * gamma + beta, x-transformers' unit offsets folded in
            offset = float(src.scale_offset) - dst.scale_offset
            put(dst.alpha, src.alpha.detach() + offset)
            put(dst.s, src.s.detach())
            put(dst.gamma, src.gamma.detach() + offset)
            put(dst.beta, src.beta.detach())
            return
        gain = dst.gamma if isinstance(dst, LayerNorm) else dst.g  # stored minus our unit offset
        put(gain, weight.to(gain.dtype) - float(dst.unit_offset))
        if isinstance(dst, LayerNorm):
            if dst.bias is not None:
                dst.bias.zero_()
        elif isinstance(dst, RMSNorm):
            if dst.eps != _RMS_EPS:
                raise AssertionError(f"converted RMSNorm has eps {dst.eps}, expected {_RMS_EPS}")
        else:
            raise AssertionError(f"unexpected norm {type(dst).__name__}")

    def copy_gates(dst, blk) -> None:
        """Gate projections with the query heads permuted: per-feature outputs by ``rows``, per-head outputs by
        ``perm``, and the output gate's input (the attention output) by ``rows``."""
        for attr in ("to_v_gate", "to_output_gate"):
            src_gate, dst_gate = getattr(blk, attr, None), getattr(dst, attr)
            if src_gate is None:
                continue
            last_src = src_gate if isinstance(src_gate, nn.Linear) else src_gate.up
            last_dst = dst_gate if isinstance(dst_gate, nn.Linear) else dst_gate.up
            out_idx = perm if last_src.out_features == heads and last_src.out_features != heads * dim_head else rows
            first_src = src_gate if isinstance(src_gate, nn.Linear) else src_gate.down
            first_dst = dst_gate if isinstance(dst_gate, nn.Linear) else dst_gate.down
            if isinstance(src_gate, nn.Linear):
                w = take(src_gate.weight)[out_idx]
                put(dst_gate.weight, w[:, rows] if attr == "to_output_gate" else w)
            else:
                w_in = take(first_src.weight)
                put(first_dst.weight, w_in[:, rows] if attr == "to_output_gate" else w_in)
                put(last_dst.weight, take(last_src.weight)[out_idx])

    def copy_same(dst: nn.Module, src: nn.Module) -> None:
        """Every parameter of ``src`` into ``dst``'s parameter of the same name."""
        mine = dict(dst.named_parameters())
        if set(mine) != {n for n, _ in src.named_parameters()}:
            raise AssertionError(f"parameters differ: {sorted(mine)} vs {[n for n, _ in src.named_parameters()]}")
        for n, p in src.named_parameters():
            put(mine[n], take(p))

    def copy_routing(routing) -> None:
        """x-transformers' residual routing parameters (LIMe, U-Net skips, input reinjection, post-norms, the
        mean/variance split updates) into ``block.ResidualRouting``, layer by layer."""
        stack = sf.attn_layers
        for i, ((_, _, post_main), _, residual) in enumerate(layers.layers):
            mine = stack.layers[i]
            if mine[0][2] is not None:
                copy_norm(mine[0][2], post_main)
            if routing.mv_split:
                copy_same(mine[2], residual)
            if getattr(mine[2], "residual_scale", None) is not None:  # scale_residual
                put(mine[2].residual_scale, take(residual.residual_scale))
            if getattr(mine[2], "gru", None) is not None:  # gate_residual
                copy_same(mine[2].gru, residual.gru)
            if routing.integrators is not None:
                lime_norm, lime_linear = layers.layer_integrators[i].to_weights[:2]
                weight, _, names = _norm_weights(lime_norm, xt)
                used.update(id(getattr(lime_norm, n)) for n in names)
                dst_norm = stack.layer_integrators[i].to_weights[0]
                put(dst_norm.g, weight - float(dst_norm.unit_offset))
                copy_same(stack.layer_integrators[i].to_weights[1], lime_linear)
            src_skip = layers.skip_combines[i]
            dst_skip = stack.skip_combines[i]
            if (src_skip is None) != (dst_skip is None) or (
                    dst_skip is not None and dst_skip.prev_layer_ind != src_skip.prev_layer_ind):
                plan.problems.add(f"unet_skips paired differently at layer {i}")
            elif dst_skip is not None:
                copy_same(dst_skip.combine, src_skip.combine)
        for attr in ("reinject_input_proj", "learned_reinject_input_gate"):
            if getattr(stack, attr) is not None:
                copy_same(getattr(stack, attr), getattr(layers, attr))

    heads, kv_heads, dim_head = plan.heads, plan.kv_heads, plan.dim_head
    perm = torch.arange(heads, device=ref.device)  # both order grouped-query heads as x-transformers (tiled)
    rows = (perm[:, None] * dim_head + torch.arange(dim_head, device=ref.device)[None, :]).reshape(-1)

    with torch.no_grad():
        put(sf.token_emb.weight, take(model.token_emb.emb.weight))
        if plan.wrapper_kwargs.get("scaled_sinu_pos_emb"):
            put(sf.pos_emb.scale, take(model.pos_emb.scale))
        elif plan.wrapper_kwargs.get("use_abs_pos_emb"):
            put(sf.pos_emb.emb.weight, take(model.pos_emb.emb.weight))
        if plan.wrapper_kwargs.get("num_memory_tokens"):
            put(sf.memory_tokens, take(model.memory_tokens))
        if plan.wrapper_kwargs.get("use_cls_token"):
            put(sf.cls_token, take(model.cls_token))
        if not plan.tied and model.to_logits is not None:
            if isinstance(model.to_logits, nn.ModuleList):  # num_output_heads
                for mine, theirs in zip(sf.to_logits, model.to_logits, strict=True):
                    copy_same(mine, theirs)
            else:
                put(sf.to_logits.weight, take(model.to_logits.weight))
        if plan.wrapper_kwargs.get("emb_dim") is not None:
            copy_same(sf.project_emb, model.project_emb)
        if plan.wrapper_kwargs.get("embed_num_tokens"):
            copy_same(sf.embeds, model.embeds)
        if plan.wrapper_kwargs.get("looped"):
            copy_same(sf.exit_gate, model.exit_gate)
        theirs = dict(model.named_parameters())
        for key in XT_OPTION_PARAMETERS:  # the wrapper options' parameters, same names in both
            if key in theirs:
                put(sf.get_parameter(key), take(theirs[key]))
        if plan.stack_kwargs.get("rel_pos_bias"):  # Embedding(num_buckets, h): per query head
            put(sf.attn_layers.rel_pos.relative_attention_bias.weight,
                take(layers.rel_pos.relative_attention_bias.weight)[:, perm])
        if plan.stack_kwargs.get("dynamic_pos_bias"):  # the MLP as it is, its last layer's rows per query head
            src, dst = layers.rel_pos, sf.attn_layers.rel_pos
            for (name, p_dst), (_, p_src) in zip(dst.named_parameters(), src.named_parameters()):
                last = name.startswith(f"mlp.{len(dst.mlp) - 1}.")
                put(p_dst, take(p_src)[perm] if last else take(p_src))
        if plan.stack_kwargs.get("polar_pos_emb"):  # (h, 1, d): per query head
            put(sf.attn_layers.polar_pos_emb.learned_bias, take(layers.polar_pos_emb.learned_bias)[perm])
        if plan.wrapper_kwargs.get("ff_deep_embed"):
            put(sf.ff_deep_embed, take(model.ff_deep_embed))
        if plan.wrapper_kwargs.get("attn_pool"):  # the pool's heads are its own: nothing to permute
            src = dict(model.attn_pool.named_parameters())
            for name, dst_p in sf.attn_pool.named_parameters():
                put(dst_p, take(src[name]))
        for k, ((pre, post_branch, _), wrapped, _) in enumerate(layers.layers):
            block = sf.attn_layers.layers[k]
            norm, dst = block.norm, block.mixer
            w = _unwrap(wrapped, xt)
            blk = w.inner
            if pre is not None:
                copy_norm(norm, pre)
            if post_branch is not None:  # sandwich_norm: the block's norm at index 3
                copy_norm(block[0][1], post_branch)
            if isinstance(w.layerscale, xt.LayerScale):  # x-transformers' unit offset moved to ours
                put(block.gate.gamma, take(w.layerscale.gamma) + float(w.layerscale.unit_offset)
                    - float(block.gate.unit_offset))
            elif w.layerscale is not None:  # use_adaptive_layerscale: sigmoid(W c + b)
                copy_same(block.gate.to_gamma, w.layerscale.to_gamma)
            if plan.types[k] in ("a", "c"):
                put(dst.to_q.weight, take(blk.to_q.weight)[rows])
                put(dst.to_k.weight, take(blk.to_k.weight))
                put(dst.to_v.weight, take(blk.to_v.weight))
                if isinstance(blk.to_out, nn.Linear):  # orthog_projected_values: one copy of rows per part
                    parts = blk.to_out.in_features // (heads * dim_head)
                    cols = torch.cat([rows + p * heads * dim_head for p in range(parts)])
                    put(dst.to_out.weight, take(blk.to_out.weight)[:, cols])
                else:
                    put(dst.to_out.weight, torch.eye(dim, dtype=ref.dtype, device=ref.device)[:, rows])
                opts = plan.attn_opts[k]
                if opts.dd_alibi:  # Linear(dim, heads * (1|2)): the query heads permuted within each direction
                    lin = blk.data_dependent_alibi.to_forget_gates[0]
                    idx = torch.cat([perm + part * heads for part in range(lin.out_features // heads)])
                    put(dst.to_forget_gates.weight, take(lin.weight)[idx])
                    put(dst.to_forget_gates.bias, take(lin.bias)[idx])
                if opts.value_mix:  # Linear(dim, heads) + sigmoid; heads == kv_heads (checked)
                    lin = blk.to_value_residual_mix[0]
                    put(dst.to_value_residual_mix[0].weight, take(lin.weight)[perm])
                    put(dst.to_value_residual_mix[0].bias, take(lin.bias)[perm])
                if opts.value_rmsnorm:  # gamma (h, 1, d), h == h_kv (checked): kv heads are not permuted
                    put(dst.value_rmsnorm.gamma, take(blk.value_rmsnorm.gamma).reshape(kv_heads, 1, dim_head))
                if opts.qk_dim_scale:  # (h, 1, d) per query head (permuted), (h_kv, 1, d) per key head
                    put(dst.qk_norm_q_scale, take(blk.qk_norm_q_scale)[perm])
                    put(dst.qk_norm_k_scale, take(blk.qk_norm_k_scale))
                for attr in ("to_latent_q", "to_latent_kv", "to_rotateable_k"):  # multi-latent attention
                    if getattr(blk, attr, None) is not None:  # (latent features and key heads are not permuted)
                        put(getattr(dst, attr).weight, take(getattr(blk, attr).weight))
                if getattr(blk.attend, "cope", None) is not None:  # one table shared by every head
                    put(dst.cope.pos_emb, take(blk.attend.cope.pos_emb))
                if getattr(blk, "rel_proj_pos_bias", None) is not None:  # Linear(dim, heads * basis): heads permuted
                    src_rel, dst_rel = blk.rel_proj_pos_bias, dst.rel_proj_pos_bias
                    lin = src_rel.to_distance_weights[0]
                    basis = src_rel.distance_bank.shape[0]
                    idx = (perm[:, None] * basis + torch.arange(basis, device=perm.device)[None, :]).reshape(-1)
                    put(dst_rel.to_distance_weights[0].weight, take(lin.weight)[idx])
                    put(dst_rel.to_distance_weights[0].bias, take(lin.bias)[idx])
                    put(dst_rel.distance_bank, take(src_rel.distance_bank))
                if opts.hybrid:  # the module's parameters by name; its norms and mix per query head (not permuted:
                    src_h, dst_h = blk, dst.hybrid  # grouped-query heads are refused)
                    copy_same(dst_h.hybrid_module, src_h.hybrid_module)
                    for j in range(2):
                        put(dst_h.hybrid_norms[j].gamma, take(src_h.hybrid_norms[j].gamma).reshape(heads, 1, dim_head))
                    if dst_h.hybrid_mix is not None:
                        put(dst_h.hybrid_mix.weight, take(src_h.hybrid_mix.weight))
                if opts.mem_kv:  # key/value heads are not permuted
                    put(dst.mem_k, take(blk.mem_k))
                    put(dst.mem_v, take(blk.mem_v))
                if opts.sink:
                    put(dst.head_attn_sink, take(blk.attend.head_attn_sink)[perm])
                for conv in opts.talking_heads:  # (h, h, 1, 1): rows and columns permuted with the query heads
                    put(getattr(dst, conv).weight, take(getattr(blk.attend, conv).weight)[perm][:, perm])
                if opts.head_scale:  # (1, h, 1, 1), permuted with the query heads
                    put(dst.head_scale_params, take(blk.head_scale_params)[:, perm])
                copy_gates(dst, blk)
            else:
                info = _parse_ff(f"attn_layers.layers.{k}", blk, xt, _Problems(), [])
                put(dst.proj_in.weight, take(info["in"].weight))
                if dst.proj_in.bias is not None:
                    put(dst.proj_in.bias, take(info["in"].bias))
                put(dst.proj_out.weight, take(info["out"].weight))
                if dst.proj_out.bias is not None:
                    put(dst.proj_out.bias, take(info["out"].bias))
                if info["mult_bias"] is not None:  # ff_glu_mult_bias: the learned gain itself
                    put(dst.mult_bias, take(info["mult_bias"]))
                for gain, norm in ((dst.solu_norm, info["solu"]), (dst.post_act_norm, info["post_act_ln"])):
                    if norm is not None:  # a bias-free LayerNorm: its gain, the unit offset folded in
                        put(gain, take(norm.gamma) + float(norm.unit_offset))
        if type(layers.final_norm).__name__ != "Identity":
            copy_norm(sf.attn_layers.final_norm, layers.final_norm)
        if sf.attn_layers.routing is not None:
            copy_routing(sf.attn_layers.routing)
        if getattr(sf.attn_layers, "adaptive_mlp", None) is not None:  # adaptive_condition_mlp
            copy_same(sf.attn_layers.adaptive_mlp, layers.adaptive_mlp)

    unused = [n for n, p in model.named_parameters() if id(p) not in used]
    if unused:
        plan.problems.add(f"parameters with no safeformer counterpart: {', '.join(unused)}")
    sf.train(model.training)
    return sf


def _check_autoregressive(ar, xt, xt_attend, problems: _Problems, training_only: list[str]) -> _Plan | None:
    """Checks an x-transformers ``AutoregressiveWrapper`` and plans the conversion of its net."""
    net = ar.net
    if not isinstance(net, xt.TransformerWrapper):
        problems.add(f"an AutoregressiveWrapper around a {type(net).__name__} (safeformer's takes a TransformerWrapper)")
        return None
    plan = _plan_wrapper(net, xt, xt_attend, problems.scoped("net"), training_only)
    if getattr(ar, "mask_prob", 0.0) > 0:
        problems.add(f"mask_prob={ar.mask_prob} (random input masking in the loss, in evaluation mode too)")
    if getattr(ar, "add_attn_z_loss", False):
        problems.add("add_attn_z_loss (safeformer's z-loss counts the n - 1 positions the loss reads, x-transformers' "
                     "all n: different loss values)")
    if not net.attn_layers.causal:
        problems.add("an AutoregressiveWrapper around a non-causal net (safeformer's needs a Decoder)")
    pad = ar.pad_value
    if isinstance(pad, bool) or not isinstance(pad, int):
        problems.add(f"pad_value={pad!r} (safeformer needs an int)")
    if isinstance(ar.ignore_index, bool) or not isinstance(ar.ignore_index, int):
        problems.add(f"ignore_index={ar.ignore_index!r} (safeformer needs an int)")
    return plan


def _effective_config(net: TransformerWrapper) -> dict:
    """A converted net's configuration, flattened, with defaults spelled out and ignored options
    dropped, so that two nets built differently but alike compare equal."""
    cfg = dict(net._sf_config)
    cfg.pop("attn_layers")
    lc = dict(net.attn_layers._sf_config)
    cfg["use_abs_pos_emb"] = net.pos_emb is not None
    if not cfg.get("tie_embedding"):
        cfg.pop("tie_embedding_scale", None)
    if cfg.get("logits_dim") == cfg.get("num_tokens"):
        cfg["logits_dim"] = None
    if lc.get("kv_heads") is None:
        lc["kv_heads"] = lc.get("heads")
    if lc.get("dim_context") is None:
        lc["dim_context"] = lc.get("dim")
    if lc.get("rotary_pos_emb"):
        lc["rotary_emb_dim"] = lc.get("rotary_emb_dim") or lc["dim_head"] // 2
    else:
        lc.pop("rotary_emb_dim", None)
        lc.pop("rotary_theta", None)
    if lc.get("norm_eps") is None:
        lc["norm_eps"] = 1e-6 if lc.get("use_rmsnorm") else 1e-5
    for key in ("ff_mult", "attn_dropout", "ff_dropout"):  # a number, or one per layer (a list once saved)
        if key in lc:
            value = lc[key]
            lc[key] = tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else float(value)
    if not lc.get("attn_softclamp_logits"):
        lc.pop("attn_logit_softclamp_value", None)
    out = {f"attn_layers.{k}": v for k, v in lc.items()}
    out["attn_layers.class"] = type(net.attn_layers).__name__
    out.update(cfg)
    return out


def _side_config(net: TransformerWrapper) -> tuple[dict, dict]:
    """A converted net's layer options and wrapper options (``get_config()``, the nested stack left out)."""
    layers = net.attn_layers.get_config()
    wrapper = {k: v for k, v in net.get_config().items() if k != "attn_layers"}
    return layers, wrapper


def _xtransformer_kwargs(sf_enc: TransformerWrapper, sf_dec: TransformerWrapper, ar, tie_token_emb: bool,
                         problems: _Problems) -> dict:
    """safeformer ``XTransformer`` arguments that rebuild the converted nets: what the constructor sets
    per side (``enc_depth``, ``dec_heads``, ...), the layer options it shares (``dim_head``, ``ff_glu``,
    ...) with the encoder's values, and in ``enc_options`` / ``dec_options`` every other option that is
    not at its default (and the decoder's shared options where they differ from the encoder's). What
    no argument can express is recorded in ``problems``."""
    from ..decoding.encoder_decoder import _WRAPPER_SIDE

    params = inspect.signature(XTransformer.__init__).parameters
    layer_defaults, wrapper_defaults = _defaults(AttentionLayers), _defaults(TransformerWrapper)
    shared = [n for n in params if n in layer_defaults and n != "dim"]  # dim_head, kv_heads, rotary_pos_emb, ...
    kwargs: dict = dict(tie_token_emb=tie_token_emb, ignore_index=ar.ignore_index, pad_value=ar.pad_value)
    sides: dict[str, dict] = {}
    dims: dict[str, int] = {}
    for side, net, where in (("enc", sf_enc, "encoder"), ("dec", sf_dec, "decoder.net")):
        layers, wrapper = _side_config(net)
        want_cls, want_cross = ("Encoder", False) if side == "enc" else ("Decoder", True)
        got_cls = type(net.attn_layers).__name__
        if got_cls != want_cls or bool(layers.get("cross_attend")) != want_cross:
            shown = f"{got_cls}(cross_attend={bool(layers.get('cross_attend'))})"
            problems.add(f"{where} layers {shown}: safeformer's XTransformer builds {want_cls}(cross_attend={want_cross})")
        for key in ("causal", "cross_attend", "only_cross"):
            layers.pop(key, None)
        dims[where] = layers.pop("dim")
        for key in ("depth", "heads"):
            kwargs[f"{side}_{key}"] = layers.pop(key)
        for key in ("num_tokens", "max_seq_len"):
            kwargs[f"{side}_{key}"] = wrapper.pop(key)
        if layers.get("dim_context") == dims["encoder"]:
            layers["dim_context"] = None  # the decoder cross-attends to the encoder's width, as by default
        only_embed, logits_dim = wrapper.pop("return_only_embed"), wrapper.pop("logits_dim")
        if side == "enc" and not only_embed:
            problems.add("an encoder with an output head (to_logits): safeformer's XTransformer encoder returns "
                         "embeddings only (return_only_embed=True); x-transformers' XTransformer never uses that head, "
                         "so model.encoder.to_logits = None before converting drops it", where)
        if side == "dec" and only_embed:
            problems.add("a decoder without an output head (return_only_embed=True; safeformer's XTransformer decoder "
                         "predicts its tokens)", where)
        if side == "dec" and logits_dim is not None:
            problems.add(f"logits_dim={logits_dim} != num_tokens={kwargs['dec_num_tokens']} (safeformer's "
                         f"XTransformer decoder predicts its own tokens)", where)
        options = {k: v for k, v in layers.items() if k in shared or v != layer_defaults.get(k)}
        for key, value in wrapper.items():
            if value == wrapper_defaults.get(key):
                continue
            if key in _WRAPPER_SIDE:
                options[key] = value
            else:
                problems.add(f"{key}={value!r} (safeformer's XTransformer takes no {side}_{key} option)", where)
        sides[side] = options
    if dims["encoder"] != dims["decoder.net"]:
        problems.add(f"encoder dim={dims['encoder']} and decoder dim={dims['decoder.net']} (safeformer's XTransformer "
                     f"has one dim for both)")
    kwargs["dim"] = dims["decoder.net"]
    enc, dec = sides["enc"], sides["dec"]
    for name in shared:  # the shared argument takes the encoder's value; the decoder's overrides it where it differs
        kwargs[name] = enc.pop(name)
        if dec[name] == kwargs[name]:
            dec.pop(name)
    kwargs.update(enc_options=enc or None, dec_options=dec or None)
    return kwargs


def _convert_xtransformer(model, xt, xt_attend, problems: _Problems, training_only: list[str],
                          drop_training_only: bool) -> XTransformer:
    enc, ar = model.encoder, model.decoder
    plan_enc = _plan_wrapper(enc, xt, xt_attend, problems.scoped("encoder"), training_only)
    plan_dec = _check_autoregressive(ar, xt, xt_attend, problems.scoped("decoder"), training_only)
    if getattr(model, "cross_attn_tokens_dropout", 0.0) > 0:
        training_only.append(f"cross_attn_tokens_dropout={model.cross_attn_tokens_dropout} (XTransformer)")
    _raise_problems(problems, training_only, drop_training_only)
    sf_enc, sf_dec = _build_wrapper(plan_enc, xt), _build_wrapper(plan_dec, xt)
    problems.raise_if_any()

    tie_token_emb = ar.net.token_emb is enc.token_emb
    kwargs = _xtransformer_kwargs(sf_enc, sf_dec, ar, tie_token_emb, problems)
    problems.raise_if_any()
    try:
        sf = XTransformer(**kwargs)
    except (TypeError, ValueError) as err:
        problems.add(f"no safeformer XTransformer takes this configuration: {err}")
        problems.raise_if_any()
    # a safety net: the nets built must be the converted ones, option for option
    for side, built, converted in (("encoder", sf.encoder, sf_enc), ("decoder.net", sf.decoder.net, sf_dec)):
        want, got = _effective_config(converted), _effective_config(built)
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                problems.add(f"{side} {key}={want.get(key)!r}: safeformer's XTransformer builds {key}={got.get(key)!r} "
                             f"(convert model.encoder and model.decoder on their own instead)")
    problems.raise_if_any()
    ref = enc.token_emb.emb.weight
    sf = sf.to(device=ref.device, dtype=ref.dtype)
    sf.encoder.load_state_dict(sf_enc.state_dict())
    sf.decoder.net.load_state_dict(sf_dec.state_dict())
    sf.train(model.training)
    return sf


def _raise_problems(problems: _Problems, training_only: list[str], drop_training_only: bool) -> None:
    if training_only and not drop_training_only:
        for t in dict.fromkeys(training_only):
            problems.add(f"{t} (training only; pass drop_training_only=True to drop it)")
    problems.raise_if_any()


# x-transformers' other wrappers: (its module, its class) -> (safeformer's module, the converter there)
_OTHER_WRAPPERS: dict[tuple[str, str], tuple[Callable, bool]] = {}


def register_converter(xt_module: str, xt_name: str, convert: Callable, takes_drop: bool = False) -> None:
    """``from_x_transformers`` converts an instance of x-transformers' ``xt_module.xt_name`` with ``convert`` (called
    with ``drop_training_only=`` when ``takes_drop``). The research wrappers register theirs when they are imported
    (``safeformer`` imports them all), so this module never imports them."""
    _OTHER_WRAPPERS[(xt_module, xt_name)] = (convert, takes_drop)


def _convert_other_wrapper(model: nn.Module, drop_training_only: bool):
    """The safeformer twin of one of x-transformers' other wrappers (``_OTHER_WRAPPERS``), or ``None``."""
    import importlib

    for (xt_module, xt_name), (convert, takes_drop) in _OTHER_WRAPPERS.items():
        try:
            cls = getattr(importlib.import_module(xt_module), xt_name)
        except (ImportError, AttributeError):  # an x-transformers version without it
            continue
        if isinstance(model, cls):
            return convert(model, drop_training_only=drop_training_only) if takes_drop else convert(model)
    return None


def _carrier(layers, xt, *, max_seq_len: int = 0, pos_emb=None) -> nn.Module:
    """An x-transformers ``TransformerWrapper`` around ``layers`` (one token, ``max_seq_len=0``: no absolute
    positions unless ``pos_emb`` is given), on their device and dtype: what the stack converts through."""
    ref = next(layers.parameters(), None)
    use_abs = pos_emb is not None and type(pos_emb).__name__ == "AbsolutePositionalEmbedding"
    carrier = xt.TransformerWrapper(num_tokens=1, max_seq_len=max_seq_len if use_abs else 0, attn_layers=layers,
                                    use_abs_pos_emb=use_abs)
    if ref is not None:
        carrier.token_emb.to(device=ref.device, dtype=ref.dtype)
        carrier.to_logits.to(device=ref.device, dtype=ref.dtype)
    if use_abs:
        carrier.pos_emb.to(device=pos_emb.emb.weight.device, dtype=pos_emb.emb.weight.dtype)
        with torch.no_grad():
            carrier.pos_emb.load_state_dict(pos_emb.state_dict())
    return carrier.train(layers.training)


def _convert_stack(layers, xt, drop_training_only: bool) -> AttentionLayers:
    """A bare x-transformers ``Encoder`` / ``Decoder`` / ``CrossAttender`` / ``AttentionLayers``: converted through a
    carrier wrapper, the stack returned."""
    return from_x_transformers(_carrier(layers, xt), drop_training_only=drop_training_only).attn_layers


def _convert_continuous(model, xt, drop_training_only: bool):
    """x-transformers' ``ContinuousTransformerWrapper``: the stack through a carrier (with the wrapper's absolute
    positions), the wrapper's keywords, projections, positions and memory tokens copied."""
    from ..stack.wrappers import (
        ContinuousTransformerWrapper,
        copy_xt_continuous_projections,
        xt_continuous_wrapper_kwargs,
    )

    problems = _Problems()
    if getattr(model, "max_mem_len", 0):
        problems.add(f"max_mem_len={model.max_mem_len} (Transformer-XL memories in the continuous wrapper)")
    if not isinstance(getattr(model, "post_emb_norm", nn.Identity()), nn.Identity):
        problems.add("post_emb_norm")
    pos = model.pos_emb
    sinu = type(pos).__name__ == "ScaledSinusoidalEmbedding"
    if isinstance(pos, nn.Module) and not sinu and type(pos).__name__ != "AbsolutePositionalEmbedding" \
            and any(True for _ in pos.parameters()):
        problems.add(f"a position embedding {type(pos).__name__}")
    problems.raise_if_any()
    layers = _convert_stack(model.attn_layers, xt, drop_training_only) if pos is None or not isinstance(
        pos, nn.Module) or sinu else from_x_transformers(
            _carrier(model.attn_layers, xt, max_seq_len=model.max_seq_len, pos_emb=pos),
            drop_training_only=drop_training_only).attn_layers
    kw = xt_continuous_wrapper_kwargs(model)
    if sinu:
        kw.update(scaled_sinu_pos_emb=True, use_abs_pos_emb=True, max_seq_len=model.max_seq_len or 0)
    ref = next(model.parameters())
    out = ContinuousTransformerWrapper(attn_layers=layers, emb_dropout=model.emb_dropout.p, **kw)
    out = out.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        copy_xt_continuous_projections(out, model)
        if sinu:
            out.pos_emb.scale.copy_(pos.scale)
    return out.train(model.training)


def _convert_continuous_autoregressive(model, xt, drop_training_only: bool):
    """x-transformers' ``ContinuousAutoregressiveWrapper``: its net converted, the same loss (mean squared error,
    L1 with ``use_l1_loss``, the Gaussian NLL of a probabilistic net; a custom ``loss_fn`` is refused)."""
    from ..decoding.continuous import ContinuousAutoregressiveWrapper

    fn = model.loss_fn
    kind = type(fn).__name__
    if kind not in ("MSELoss", "L1Loss", "GaussianNLL") or getattr(fn, "reduction", "none") != "none":
        problems = _Problems()
        problems.add(f"a custom loss_fn {kind} (safeformer takes mse, l1 or the probabilistic Gaussian NLL)")
        problems.raise_if_any()
    net = _convert_continuous(model.net, xt, drop_training_only)
    out = ContinuousAutoregressiveWrapper(net, probabilistic=bool(model.probabilistic),
                                          use_l1_loss=kind == "L1Loss",
                                          equal_loss_weight_batch=bool(model.equal_loss_weight_batch))
    return out.train(model.training)


def from_x_transformers(
    model: nn.Module, *, drop_training_only: bool = False
) -> TransformerWrapper | AutoregressiveWrapper | XTransformer:
    """Convert an x-transformers model into the equivalent safeformer model, with the same weights.

    Converts an ``x_transformers.TransformerWrapper`` into a ``safeformer.TransformerWrapper``, an
    ``x_transformers.AutoregressiveWrapper`` into a ``safeformer.AutoregressiveWrapper`` (same
    ``ignore_index`` and ``pad_value``), a bare layer stack (``Encoder``, ``Decoder``, ``CrossAttender``,
    ``AttentionLayers``) into the same safeformer class, a ``ContinuousTransformerWrapper`` and a
    ``ContinuousAutoregressiveWrapper`` into safeformer's (same loss), and an ``x_transformers.XTransformer`` into a
    ``safeformer.XTransformer`` (same ``tie_token_emb``, ``ignore_index`` and ``pad_value``; what its
    encoder and decoder set differently, ``enc_<option>`` / ``dec_<option>`` in x-transformers, lands
    in its ``enc_options`` / ``dec_options``, so the converted model saves and reloads as it is).

    Supported in the nets: ``Decoder``, ``Encoder`` and ``CrossAttender`` layers, with or without
    ``cross_attend`` (and ``cross_attn_dim_context``); pre-norm ``LayerNorm``, ``RMSNorm``,
    ``SimpleRMSNorm`` or ``ScaleNorm``; learned absolute, rotary (``rotary_emb_dim``) or ALiBi
    positions; GELU or SiLU feed-forwards, gated (``ff_glu``, with ``ff_glu_mult_bias``) or not, with
    or without biases (``ff_no_bias``); grouped-query attention (``attn_kv_heads``,
    ``attn_one_kv_head``); ``attn_qk_norm`` (see the module docstring for what maps);
    ``num_memory_tokens``, ``attn_num_mem_kv``, ``attn_head_learned_sink``, ``attn_softclamp_logits``;
    gated attention (``attn_gate_values``, ``attn_output_gate``, per feature, per head or low rank,
    ``attn_swiglu_values``; the gates' heads permuted with the query heads); ``attn_flash`` on or off; a tied embedding (kept tied); ``logits_dim``; ``return_only_embed``;
    attention, feed-forward and embedding dropout (one number, or one per layer). Also: the residual routing
    options (``unet_skips``, ``reinject_input`` / ``learned_reinject_input_gate``, ``pre_and_post_norm``,
    ``integrate_layers``, ``orthog_residual``, ``mv_split_residual``), per-layer ``ff_mult``; layer patterns
    (``custom_layers``, ``par_ratio``, ``sandwich_coef``, ``macaron``, ``only_attn``, ``weight_tie_layers``,
    ``layers_execute_order``), ``sandwich_norm``, ``pre_norm=False``, ``pre_norm_has_final_norm=False``,
    ``scale_residual`` (bool or float) / ``scale_residual_constant`` / float ``depth_scale_residual``,
    ``gate_residual``, ``use_layerscale``, ``softclamp_output``, ``shift_tokens``, ``residual_attn`` /
    ``cross_residual_attn``; scoring (``attn_l2_distance``, ``attn_cog_signed``, ``attn_sigmoid``, ``attn_laser``,
    multi-latent attention, ``attn_use_cope``, ``attn_use_rel_proj_pos_bias``, ``cross_attn_inverted_attention``);
    positions (``rotary_xpos``, ``polar_pos_emb``, ``rel_pos_bias``, ``alibi_num_heads``, custom ALiBi slopes);
    ``use_derf``, ``ff_custom_activation`` (a parameter-free ``torch.nn`` module), ``ff_glu_softclamp``,
    ``attn_hybrid_module``; in the wrapper ``emb_dim``, ``embed_num_tokens``, ``num_output_heads``,
    ``sigsoftmax_logits``, ``memory_tokens_interspersed_every``, ``looped``, ``mixture_of_softmax``,
    ``recycling``, ``add_continuous_pred_head``, ``squeeze_out_last_dim``. Hyper-connections
    (``num_residual_streams > 1``) are refused: x-transformers 2.31.10's residual mix is not safeformer's.

    Also x-transformers' other wrappers (``_OTHER_WRAPPERS``): ``DPO``, ``XValTransformerWrapper``,
    ``XValAutoregressiveWrapper``, ``NeoMLP``, ``ContinuousTransformerAutoencoder``, ``GPTVAE``,
    ``BeliefStateWrapper``, ``NextLatentWrapper``, ``MultiInputTransformerWrapper``, ``EntropyBasedTokenizer``,
    ``FreeTransformer`` and ``UniversalPretrainWrapper`` (their converters live beside the safeformer classes).

    Args:
        model: an ``x_transformers.TransformerWrapper``, ``AutoregressiveWrapper`` or ``XTransformer``.
        drop_training_only: options that change only training (``layer_dropout``,
            ``cross_attn_tokens_dropout``, sublayer dropouts, ``emb_frac_gradient``) raise like any
            other unsupported option by default; with ``True`` they are dropped instead (the
            converted model then trains without them, and evaluates the same).

    Returns:
        the safeformer model on the model's device and dtype, in the model's training mode, whose
        logits (and loss, and greedy generations) equal the original's at every real position (right
        padding; see the module docstring for the positions and the epsilons).

    Raises:
        TypeError: ``model`` is none of these.
        ValueError: the model uses options safeformer cannot represent; the message lists all of them.
    """
    xt, xt_attend = _xt()
    from x_transformers.autoregressive_wrapper import AutoregressiveWrapper as XTAutoregressiveWrapper

    converted = _convert_other_wrapper(model, drop_training_only)
    if converted is not None:
        return converted
    problems = _Problems()
    training_only: list[str] = []
    if isinstance(model, xt.XTransformer):
        return _convert_xtransformer(model, xt, xt_attend, problems, training_only, drop_training_only)
    if isinstance(model, XTAutoregressiveWrapper):
        plan = _check_autoregressive(model, xt, xt_attend, problems, training_only)
        _raise_problems(problems, training_only, drop_training_only)
        net = _build_wrapper(plan, xt)
        problems.raise_if_any()
        loss_options = {k: getattr(model, k) for k in ("next_embed_loss_weight", "looped_loss_threshold_exit",
                                                       "looped_loss_slope", "looped_exit_loss_weight") if hasattr(model, k)}
        sf = AutoregressiveWrapper(net, ignore_index=model.ignore_index, pad_value=model.pad_value, **loss_options)
        sf.train(model.training)
        return sf
    import x_transformers.continuous as xt_continuous

    if isinstance(model, xt_continuous.ContinuousAutoregressiveWrapper):
        return _convert_continuous_autoregressive(model, xt, drop_training_only)
    if isinstance(model, xt_continuous.ContinuousTransformerWrapper):
        return _convert_continuous(model, xt, drop_training_only)
    if isinstance(model, xt.AttentionLayers):
        return _convert_stack(model, xt, drop_training_only)
    if not isinstance(model, xt.TransformerWrapper):
        raise TypeError(
            "model must be an x_transformers.TransformerWrapper, AutoregressiveWrapper, XTransformer, "
            f"ContinuousTransformerWrapper, ContinuousAutoregressiveWrapper or a layer stack, got {type(model).__name__}"
        )
    plan = _plan_wrapper(model, xt, xt_attend, problems, training_only)
    _raise_problems(problems, training_only, drop_training_only)
    sf = _build_wrapper(plan, xt)
    problems.raise_if_any()
    return sf
