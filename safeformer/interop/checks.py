"""Checks of x-transformers modules for ``from_x_transformers`` (``convert``): what each module uses.

The pieces the plan (``plan``) and the build (``build``) share: ``_Problems`` (every unsupported option, raised
at once), the norms (``_norm_kind``, ``_norm_weights``), one attention's options (``_check_attention``, into
``_AttnOptions``), one feed-forward's pieces (``_parse_ff``), the module types known (``_check_module_types``)
and the branch wrappers taken off a block (``_unwrap``). See ``convert``'s module docstring for how the numbers
are matched.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    qk_rmsnorm: bool = False  # q_rmsnorm and k_rmsnorm (x-transformers' MultiheadRMSNorm)
    k_rmsnorm: bool = False  # k_rmsnorm only
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
    on_attn: bool = False  # attn_on_attn: to_out is Sequential(Linear, GLU)
    value_dim_head: int | None = None  # attn_value_dim_head (None: dim_head)
    custom_fn: object = None  # attn_custom_attn_fn: the user's function itself

    def key(self) -> tuple:
        return (self.qk_norm, self.qk_dim_scale, self.qk_groups, self.qk_scale, self.value_rmsnorm, self.qk_rmsnorm,
                self.k_rmsnorm, self.orthog, self.mem_kv, self.sink,
                self.softclamp, self.gates, repr(self.dd_alibi), self.scoring, self.hybrid, self.head_scale,
                self.sublayer_dropout, self.sparse_topk, self.hard, self.talking_heads, self.zero_kv, self.on_attn,
                self.value_dim_head, self.custom_fn)
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
    _check_attention_norms(name, attn, opts, problems)
    _check_attention_modules(name, attn, opts, problems)
    _check_attention_projections(name, attn, opts, problems)
    att = attn.attend
    if type(att) is not xt_attend.Attend:
        problems.add(f"a custom Attend class {type(att).__name__}", name)
        return opts
    _check_attend(name, attn, att, opts, problems)
    return opts


def _check_attention_norms(name: str, attn, opts: _AttnOptions, problems: _Problems) -> None:
    """Head scale, qk-norm, value norm, orthogonal values and gates of ``attn`` into ``opts`` (the rest refused)."""
    opts.head_scale = bool(getattr(attn, "head_scale", False))
    if opts.qk_norm:
        opts.qk_dim_scale, opts.qk_groups, opts.qk_scale = _qk_options(attn)
    opts.orthog = tuple((f"attn_{attr}", True) for attr in ("orthog_projected_values", "orthog_projected_values_per_head")
                        if getattr(attn, attr, False))
    if getattr(attn, "value_rmsnorm", None) is not None:
        opts.value_rmsnorm = True
        if attn.kv_heads != attn.heads:
            problems.add("attn_value_rmsnorm with grouped key/value heads (x-transformers' gains are per query head)", name)
    opts.gates = _gate_options(name, attn, problems)
    opts.qk_rmsnorm = getattr(attn, "q_rmsnorm", None) is not None
    opts.k_rmsnorm = not opts.qk_rmsnorm and getattr(attn, "k_rmsnorm", None) is not None
    for attr, option in (
        ("to_v_head_gate", "attn_gate_value_heads"),
    ):
        if getattr(attn, attr, None) is not None:
            problems.add(f"{option}", name)


def _check_attention_modules(name: str, attn, opts: _AttnOptions, problems: _Problems) -> None:
    """The hybrid module, data-dependent ALiBi and learned value residual mix of ``attn`` into ``opts``."""
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
        per_row = type(dd).__name__ == "PerRowDataDependentAlibi"
        if not (type(dd).__name__ == "DataDependentAlibi" or per_row) or not isinstance(lin, nn.Linear) \
                or (lin.bias is None) != per_row:
            problems.add(f"attn_data_dependent_alibi of type {type(dd).__name__}", name)
        else:
            opts.dd_alibi = (("attn_data_dependent_alibi", True),
                             ("attn_data_dependent_alibi_kwargs", dict(post_log_scale=float(dd.post_log_scale))))
            if per_row:  # its scale is dim_head ** -0.5
                opts.dd_alibi += (("attn_data_dependent_alibi_per_row", True),
                                  ("attn_data_dependent_alibi_per_row_dim_head", round(float(dd.scale) ** -2)))
            if bool(getattr(dd, "causal", True)) != bool(attn.causal):  # per row: causal only
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


def _check_attention_projections(name: str, attn, opts: _AttnOptions, problems: _Problems) -> None:
    """Rotated heads and sublayer dropout of ``attn`` into ``opts``; projection biases and custom outputs refused."""
    rope_subheads = attn.to_rotateable_k is not None if hasattr(attn, "to_rotateable_k") else False
    if getattr(attn, "rotate_num_heads", attn.heads) != attn.heads and not rope_subheads:
        opts.rotate_heads = int(attn.rotate_num_heads)  # rotate_num_heads (self-attention: the stack's keyword)
    if getattr(attn, "sublayer_dropout", None) is not None:
        opts.sublayer_dropout = float(attn.sublayer_dropout.p)  # attn_sublayer_dropout
    for lin in ("to_q", "to_k", "to_v"):
        if getattr(attn, lin).bias is not None:
            problems.add(f"a bias in {lin}", name)
    out = attn.to_out
    glu = isinstance(out, nn.Sequential) and len(out) == 2 and isinstance(out[0], nn.Linear) \
        and isinstance(out[1], nn.GLU) and out[1].dim == -1
    if glu:  # attn_on_attn
        opts.on_attn = True
        out = out[0]
    if isinstance(out, nn.Linear) and out.bias is not None:
        problems.add("a bias in to_out", name)
    elif not isinstance(out, (nn.Linear, nn.Identity)) and type(out).__name__ != "Identity":
        problems.add("a custom output projection", name)


def _attend_function(name: str, att, opts: _AttnOptions, problems: _Problems) -> bool:
    """The attention function of ``att`` (softmax, sigmoid, sparse top-k, hard) into ``opts``; whether it is sigmoid."""
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
    elif isinstance(fn, functools.partial) and fn.func is F.gumbel_softmax:
        problems.add("attn_gumbel_softmax (sampled)", name)
    elif not plain_softmax and not sigmoid:  # attn_custom_attn_fn: the same function
        opts.custom_fn = fn
    return sigmoid


def _check_attend(name: str, attn, att, opts: _AttnOptions, problems: _Problems) -> None:
    """The options of ``attn``'s ``Attend`` ``att`` (function, talking heads, scoring, sink, softclamp) into ``opts``."""
    sigmoid = _attend_function(name, att, opts, problems)
    opts.talking_heads = tuple(n for n in _TALKING_HEADS if isinstance(getattr(att, n, None), nn.Conv2d))
    opts.zero_kv = bool(getattr(att, "add_zero_kv", False))  # attn_add_zero_kv
    opts.scoring, opts.self_scoring = _scoring_options(name, attn, att, sigmoid, problems)
    opts.inverted = bool(getattr(att, "inverted_attention", False))
    dim_head = attn.to_q.out_features // attn.heads
    # with qk-norm the logit scale is part of the mapped q/k gains (_qk_gain)
    if not opts.qk_norm and att.scale is not None and not math.isclose(att.scale, dim_head**-0.5, rel_tol=1e-12):
        problems.add(f"an attention scale {att.scale} != dim_head ** -0.5", name)
    for attr, option in (
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


def _scoring_options(name: str, attn, att, sigmoid: bool, problems: _Problems) -> tuple[tuple, tuple]:
    """x-transformers' attention scoring options of ``attn`` (its ``Attend`` ``att``) as safeformer's stack keywords:
    ``(shared by every attention, self-attention only)``, each sorted ``(keyword, value)`` pairs, defaults left out."""
    out: dict = {}
    if getattr(attn, "max_attend_past", None) is not None:  # every attention of x-transformers' stack, cross too
        out["attn_max_attend_past"] = int(attn.max_attend_past)
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
    if getattr(att, "selective", False):  # self-attention only (x-transformers' needs causal)
        own["attn_selective"] = True
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
        if (tname == "MultiheadRMSNorm" and mname.endswith((".value_rmsnorm", ".q_rmsnorm", ".k_rmsnorm"))) or (
                tname in ("DataDependentAlibi", "PerRowDataDependentAlibi") and mname.endswith(".data_dependent_alibi")) or (
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
                tname == "GLU" and mname.endswith(".to_out.1")) or (  # attn_on_attn (_check_attention_projections)
                tname == "RelativeProjPositionalBias" and mname.endswith(".rel_proj_pos_bias")) or (
                tname == "Lambda" and isinstance(getattr(module, "fn", None), functools.partial)
                and getattr(module.fn.func, "__name__", "") == "softclamp"):  # converted (_check_attention, _parse_ff)
            flagged.append(mname)
            continue
        option = _TYPE_OPTIONS.get(tname, f"a {tname} module")
        problems.add(f"{option} ({tname})", mname or None)
        flagged.append(mname)


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
