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
  ``weight = g + offset``; ``SimpleRMSNorm`` gets ``weight = 1`` and ``ScaleNorm`` (one scalar gain)
  ``weight = g`` on every feature. These differ only by the epsilon: x-transformers divides by
  ``max(||x||, 1e-12)``, safeformer by ``sqrt(mean(x^2) + eps)``; the converted norms get
  ``eps = 1e-12`` instead of the default ``1e-6`` (which differs by about ``5e-7 / mean(x^2)``
  relative). That eps is the converted stack's ``norm_eps``, so it is saved with its config.
- Grouped-query heads. x-transformers gives query head ``n`` the key/value head ``n % h_kv``
  (``repeat 'b h n d -> b (r h) n d'``); safeformer gives query head ``m`` the key/value head
  ``m // g``. The query heads are permuted (rows of ``to_q``, columns of ``to_out``, entries of a
  per-head sink) to match.
- A GLU ``mult_bias`` is folded into the columns of the feed-forward's output projection; a
  feed-forward without biases gets zero biases; an attention without an output projection (one
  head) gets the identity. A tied embedding (``logits = h @ E.T * tie_embedding_scale``) stays tied
  (``tie_embedding=True`` with the same ``tie_embedding_scale``): same parameters, same count.
- Positions. Both count positions from 0 and scale a learned absolute embedding by ``c ** -0.5``;
  rotary positions rotate interleaved pairs of the first ``rotary_emb_dim`` features per head with
  base 10000. x-transformers numbers positions ``0..n-1`` whatever the mask; safeformer counts real
  tokens (so left padding does not shift positions). The two agree at every real position when
  padding is on the right.
- ALiBi. Both add ``-slope_h * |i - j|`` to the scaled logits of self-attention, with the same
  geometric slopes (``alibi_slopes``), 0 for memory keys. Only whole-head ALiBi converts
  (``alibi_num_heads == heads``), and not with grouped-query heads ``1 < h_kv < h`` (the permutation
  above would move the fixed slopes to other heads). x-transformers keeps its absolute position
  embedding next to ALiBi unless told otherwise; safeformer drops it, so such a model is refused.
- qk-norm. x-transformers' ``attn_qk_norm`` l2-normalises q and k per head, multiplies them by
  ``a`` and ``b`` (1, or the learned ``qk_norm_q_scale (h, 1, d)`` / ``qk_norm_k_scale (h_kv, 1, d)``
  of ``qk_norm_dim_scale``) and scales the logits by ``s`` (``qk_norm_scale``, default 10, or
  ``d ** -0.5`` with ``qk_norm_dim_scale``): ``logit = s * sum_e qhat_e a_e khat_e b_e``.
  safeformer's RMSNorm gives ``q' = qhat * sqrt(d) * w_q`` (and ``k'`` alike) and the logit
  ``d ** -0.5 * q' . k' = sqrt(d) * sum_e qhat_e khat_e w_q,e w_k,e``. They agree when
  ``w_q,e * w_k,e = p_e = s * a_e * b_e / sqrt(d)``; the converter sets ``w_k = sqrt(|p|)`` and
  ``w_q = sign(p) * sqrt(|p|)``. With ``qk_norm_dim_scale`` safeformer's ``attn_qk_norm_dim_scale``
  has gains per head: ``w_q = a * c`` (query heads permuted), ``w_k = b * c`` with ``c ** 2 * sqrt(d) = s``;
  ``qk_norm_groups > 1`` (normalising groups of features) does not convert. ``attn_value_rmsnorm``'s
  ``gamma (h, 1, d)`` is the value norm's weight (``attn_kv_heads == heads`` only), and
  ``attn_orthog_projected_values`` keeps ``to_out`` (its columns permuted once per concatenated part). The q/k norms keep safeformer's epsilon
  (``rsqrt(mean(q^2) + 1e-6)`` against ``1 / max(||q||, 1e-12)``): a relative difference of about
  ``5e-7 / mean(q^2)`` in each normalised q and k.
- Memory. ``num_memory_tokens`` rows ``memory_tokens (m, c)`` and per-attention memory keys/values
  ``mem_k, mem_v (h_kv, m, d)`` (``attn_num_mem_kv``) are copied as they are; a learned sink
  ``head_attn_sink (h,)`` is permuted with the query heads; ``attn_softclamp_logits`` keeps its value.
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

import functools
import inspect
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .encoder_decoder import XTransformer
from .generation import AutoregressiveWrapper
from .layers import AttentionLayers, CrossAttender, Decoder, Encoder, _defaults
from .modules import DynamicTanh, RMSNorm, alibi_slopes
from .wrappers import TransformerWrapper

__all__ = ["from_x_transformers"]

# x-transformers' RMS norms divide by max(||x||, 1e-12); safeformer's RMSNorm by sqrt(mean(x^2) + eps).
# A converted model's RMSNorm instances get this eps (not 1e-6) so that the two agree to float32
# rounding; it is small enough to match and large enough that rsqrt(eps) ** 3 (in the backward of an
# all-zero row) stays finite in float32. It is passed as the stack's ``norm_eps``, so it is part of
# the saved config and survives save_pretrained / from_pretrained.
_RMS_EPS = 1e-12

# Module classes that introduce an option safeformer cannot represent, and the option's name.
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
    "Conv2d": "attn_pre_talking_heads / attn_post_talking_heads / attn_pre_scale_post_talking_heads",
    "GLU": "attn_on_attn (an nn.GLU output projection)",
    "ReLU": "a custom feed-forward activation",
    "PrefixDecoder": "PrefixDecoder (use Decoder or Encoder)",
}


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
    if type(norm) in (xt.RMSNorm, xt.SimpleRMSNorm, xt.ScaleNorm):
        return "rms"
    if type(norm).__name__ == "DynamicTanh" and type(norm).__module__ == xt.LayerNorm.__module__:
        return "dyt"  # use_dynamic_tanh (unit offsets folded in by copy_norm)
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
    raise AssertionError("unreachable: checked by _norm_kind")


@dataclass
class _AttnOptions:
    """The attention options safeformer represents, as one x-transformers ``Attention`` uses them.
    ``qk_gain``: the product ``p (d,)`` of the q and k RMSNorm gains (see the module docstring), or
    None when ``qk_norm`` is off or cannot be mapped (a problem was recorded then)."""

    qk_norm: bool = False
    qk_gain: Tensor | None = None
    qk_head_gains: tuple | None = None  # qk_norm_dim_scale: (w_q (h, d) in x-transformers' head order, w_k (h_kv, d))
    value_rmsnorm: bool = False
    orthog: tuple = ()  # the orthog_projected_values options, as AttentionLayers keywords
    value_mix: bool = False  # a learned value residual mix (every self-attention but the first: not in key())
    dd_alibi: tuple = ()  # data_dependent_alibi: (("attn_data_dependent_alibi", True), ("..._kwargs", {...}))
    mem_kv: int = 0
    sink: bool = False
    softclamp: float | None = None
    gates: tuple = ()  # the gated-attention options, as AttentionLayers keywords (sorted items)

    def key(self) -> tuple:
        return (self.qk_norm, self.qk_head_gains is not None, self.value_rmsnorm, self.orthog, self.mem_kv, self.sink,
                self.softclamp, self.gates, repr(self.dd_alibi))


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


def _qk_gain(name: str, attn, problems: _Problems) -> Tensor | tuple | None:
    """``p (d,)`` with ``w_q * w_k = p`` (float64), or None (a problem recorded); with ``qk_norm_dim_scale``
    the per-head gains ``(w_q (h, d), w_k (h_kv, d))`` (x-transformers' head order)."""
    groups = getattr(attn, "qk_norm_groups", 1)
    if groups != 1:
        problems.add(f"attn_qk_norm with qk_norm_groups={groups} (x-transformers l2-normalises {groups} groups of "
                     f"features per head; safeformer's q/k RMSNorm normalises the whole head)", name)
        return None
    h, h_kv = attn.heads, attn.kv_heads
    d = attn.to_q.out_features // h
    scale = attn.attend.scale
    scale = d**-0.5 if scale is None else float(scale)

    def per_head(t, rows: int) -> Tensor:  # 1 or (rows, 1, d) -> (rows, d)
        if isinstance(t, Tensor):
            return t.detach().to(device="cpu", dtype=torch.float64).reshape(rows, d)
        return torch.full((rows, d), float(t), dtype=torch.float64)

    a = per_head(attn.qk_norm_q_scale, h)  # (h, d)
    if isinstance(attn.qk_norm_q_scale, Tensor) or isinstance(attn.qk_norm_k_scale, Tensor):
        # qk_norm_dim_scale: safeformer's per-head gains w_q = a * c, w_k = b * c with c ** 2 * sqrt(d) = s
        c = math.sqrt(scale) * d**-0.25
        return a * c, per_head(attn.qk_norm_k_scale, h_kv) * c
    b = per_head(attn.qk_norm_k_scale, h_kv)[[n % h_kv for n in range(h)]]  # (h, d): x-transformers' kv head of n
    prod = scale * a * b / math.sqrt(d)  # (h, d)
    if not torch.allclose(prod, prod[:1].expand_as(prod), rtol=1e-6, atol=0.0):
        problems.add("attn_qk_norm_dim_scale with per-head scales whose products qk_norm_q_scale * qk_norm_k_scale "
                     "differ between heads (safeformer's q/k RMSNorm gains are shared by every head)", name)
        return None
    return prod.mean(dim=0)  # (d,)


def _check_attention(name: str, attn, xt, xt_attend, problems: _Problems, training_only: list[str]) -> _AttnOptions:
    """Records what ``attn`` uses that safeformer cannot represent; returns the options it can."""
    opts = _AttnOptions(qk_norm=bool(attn.qk_norm), mem_kv=int(getattr(attn, "num_mem_kv", 0)))
    flags = {
        "head_scale": "attn_head_scale",
        "attn_on_attn": "attn_on_attn",
        "laser": "attn_laser",
        "qkv_receive_diff_residuals": "qkv_receive_diff_residuals",
        "use_latent_q": "attn_use_latent_q (multi-latent attention)",
        "use_latent_kv": "attn_use_latent_kv (multi-latent attention)",
    }
    for attr, option in flags.items():
        if getattr(attn, attr, False):
            problems.add(f"{option}", name)
    if opts.qk_norm:
        gain = _qk_gain(name, attn, problems)
        if isinstance(gain, tuple):
            opts.qk_head_gains = gain
        else:
            opts.qk_gain = gain
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
        ("hybrid_module", "attn_hybrid_module"),
        ("to_rotateable_k", "attn_latent_rope_subheads"),
        ("rel_proj_pos_bias", "attn_use_rel_proj_pos_bias"),
        ("q_rmsnorm", "attn_qk_rmsnorm"),
        ("k_rmsnorm", "attn_k_rmsnorm"),
    ):
        if getattr(attn, attr, None) is not None:
            problems.add(f"{option}", name)
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
    if getattr(attn, "rotate_num_heads", attn.heads) != attn.heads:
        problems.add(f"rotate_num_heads={attn.rotate_num_heads} < heads={attn.heads}", name)
    if getattr(attn, "sublayer_dropout", None) is not None:
        training_only.append("attn_sublayer_dropout")
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
    plain_softmax = isinstance(fn, functools.partial) and fn.func is F.softmax and fn.keywords.get("dim") == -1
    if not plain_softmax:
        problems.add("a non-softmax attention function (attn_sigmoid / attn_hard / attn_sparse_topk / "
                     "attn_gumbel_softmax / attn_custom_attn_fn)", name)
    dim_head = attn.to_q.out_features // attn.heads
    # with qk-norm the logit scale is part of the mapped q/k gains (_qk_gain)
    if not opts.qk_norm and att.scale is not None and not math.isclose(att.scale, dim_head**-0.5, rel_tol=1e-12):
        problems.add(f"an attention scale {att.scale} != dim_head ** -0.5", name)
    for attr, option in (
        ("selective", "attn_selective"),
        ("cog_signed", "attn_cog_signed"),
        ("l2_distance", "attn_l2_distance"),
        ("add_zero_kv", "attn_add_zero_kv"),
        ("inverted_attention", "inverted_attention"),
        ("flash_pack_seq", "attn_flash_pack_seq"),
    ):
        if getattr(att, attr, False):
            problems.add(f"{option}", name)
    for attr in ("pre_softmax_talking_heads", "post_softmax_talking_heads", "pre_scale_post_talking_heads", "cope"):
        if getattr(att, attr, None) is not None:
            problems.add(f"attn_{attr.replace('softmax_', '')}", name)
    opts.sink = bool(getattr(att, "head_learned_sink", False))
    if getattr(att, "softclamp_logits", False):
        opts.softclamp = float(att.logit_softclamp_value)
    return opts


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
        if getattr(proj_in, "up_softclamp_value", None) is not None or isinstance(act, functools.partial):
            problems.add("ff_glu_softclamp", name)
            return None
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
    if type(act) is nn.GELU and act.approximate == "none":
        info["swish"] = False
    elif type(act) is nn.SiLU:
        info["swish"] = True
    else:
        problems.add(f"a feed-forward activation {act!r} (safeformer has exact GELU and SiLU)", name)
        return None
    if parts and _norm_kind(parts[0], xt) is not None:
        problems.add("ff_post_act_ln", name)
        return None
    dropout = 0.0
    if parts and isinstance(parts[0], nn.Dropout):
        dropout = parts.pop(0).p
    if not parts or not isinstance(parts[0], nn.Linear):
        problems.add("a feed-forward without a final Linear", name)
        return None
    info["out"] = parts.pop(0)
    if parts and isinstance(parts[0], nn.Dropout):
        parts.pop(0)
        training_only.append("ff_sublayer_dropout")
    if parts:
        problems.add(f"extra feed-forward modules {[type(m).__name__ for m in parts]}", name)
        return None
    info["dropout"] = dropout
    return info


def _allowed_types(xt, xt_attend) -> set[type]:
    import einops.layers.torch as einops_torch

    allowed = {
        xt.TransformerWrapper, xt.TokenEmbedding, xt.AbsolutePositionalEmbedding, xt.AttentionLayers, xt.Encoder,
        xt.Decoder, xt.CrossAttender, xt.LayerNorm, xt.RMSNorm, xt.SimpleRMSNorm, xt.ScaleNorm, xt.Attention,
        xt_attend.Attend, xt.FeedForward, xt.GLU, xt.Residual, xt.RotaryEmbedding, xt.AlibiPositionalBias,
        nn.Embedding, nn.Linear, nn.LayerNorm, nn.Dropout, nn.Identity, nn.ModuleList, nn.Sequential, nn.GELU,
        nn.SiLU, einops_torch.Rearrange, nn.Sigmoid,  # Sigmoid: the value residual mix (_check_attention)
    }
    dyt = getattr(sys.modules.get(xt.LayerNorm.__module__), "DynamicTanh", None)
    if dyt is not None:  # use_dynamic_tanh (read by _norm_kind)
        allowed.add(dyt)
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
        if (tname == "MultiheadRMSNorm" and mname.endswith(".value_rmsnorm")) or (
                tname == "DataDependentAlibi" and mname.endswith(".data_dependent_alibi")) or (
                tname == "Lambda" and isinstance(getattr(module, "fn", None), functools.partial)
                and getattr(module.fn.func, "__name__", "") == "softclamp"):  # converted (_check_attention, _parse_ff)
            flagged.append(mname)
            continue
        option = _TYPE_OPTIONS.get(tname, f"a {tname} module")
        problems.add(f"{option} ({tname})", mname or None)
        flagged.append(mname)



def _check_wrapper(model, xt, problems: _Problems, training_only: list[str], dim: int) -> dict:
    """The wrapper's options: a problem for each one safeformer has not; returns what the plan reads."""
    if not isinstance(model.project_emb, (nn.Identity,)) and type(model.project_emb).__name__ != "Identity":
        problems.add("emb_dim != dim (an embedding projection)")
    if not isinstance(model.token_emb, xt.TokenEmbedding):
        problems.add(f"a custom token_emb {type(model.token_emb).__name__}")
    if model.embeds is not None:
        problems.add("embed_num_tokens (extra embeddings)")
    if getattr(model, "ff_deep_embed", None) is not None:
        problems.add("ff_deep_embed")
    if type(model.post_emb_norm).__name__ != "Identity":
        problems.add("post_emb_norm")
    if getattr(model, "recycling", False):
        problems.add("recycling")
    if getattr(model, "looped", False):
        problems.add("looped")
    if getattr(model, "attn_pool", None) is not None:
        problems.add("attn_pool")
    if getattr(model, "to_mixture", None) is not None:
        problems.add("mixture_of_softmax")
    if getattr(model, "sigsoftmax_logits", False):
        problems.add("sigsoftmax_logits")
    if getattr(model, "has_multiple_heads", False):
        problems.add("num_output_heads > 1")
    num_memory_tokens = int(getattr(model, "num_memory_tokens", 0) or 0)
    if num_memory_tokens:
        if getattr(model, "memory_tokens_interspersed_every", None) is not None:
            problems.add(f"memory_tokens_interspersed_every={model.memory_tokens_interspersed_every}")
    if getattr(model, "add_continuous_pred_head", False):
        problems.add("add_continuous_pred_head (its head would not be converted)")
    if getattr(model, "emb_frac_gradient", 1.0) != 1.0:
        training_only.append(f"emb_frac_gradient={model.emb_frac_gradient}")
    tied = False
    to_logits = model.to_logits
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
    if getattr(model, "squeeze_out_last_dim", False) and isinstance(to_logits, nn.Linear) and to_logits.out_features == 1:
        problems.add("squeeze_out_last_dim with logits_dim=1")
    has_abs = isinstance(model.pos_emb, xt.AbsolutePositionalEmbedding)
    l2norm_embed = bool(getattr(model, "l2norm_embed", False))
    if has_abs and bool(model.pos_emb.l2norm_embed) != l2norm_embed:
        problems.add("l2norm_embed on the position embedding only")
    return dict(num_memory_tokens=num_memory_tokens, tied=tied, to_logits=to_logits, has_abs=has_abs,
                l2norm_embed=l2norm_embed)


def _check_stack(layers, xt, problems: _Problems, training_only: list[str], has_abs: bool) -> dict:
    """The stack's options and layer pattern, its relative positions; returns what the plan reads."""
    for attr, option in (
        ("residual_attn", "residual_attn"),
        ("cross_residual_attn", "cross_residual_attn"),
        ("softclamp_output", "softclamp_output"),
        ("sandwich_norm", "sandwich_norm"),
        ("pre_and_post_norm", "pre_and_post_norm"),
        ("need_condition", "adaptive norms / adaptive layerscale (a condition input)"),
        ("unet_skips", "unet_skips"),
        ("reinject_input", "reinject_input"),
    ):
        if getattr(layers, attr, False):
            problems.add(option)
    if not getattr(layers, "pre_norm", True):
        problems.add("post-norm (pre_norm=False)")
    if getattr(layers, "num_residual_streams", 1) > 1:
        problems.add(f"num_residual_streams={layers.num_residual_streams}")
    if getattr(layers, "learned_reinject_input_gate", None) is not None:
        problems.add("learned_reinject_input_gate")
    rel_pos = getattr(layers, "rel_pos", None)
    alibi = rel_pos is not None and type(rel_pos) is xt.AlibiPositionalBias
    if rel_pos is not None and not alibi:
        problems.add(_TYPE_OPTIONS.get(type(rel_pos).__name__, "a relative position bias"))
    if getattr(layers, "polar_pos_emb", None) is not None:
        problems.add("polar_pos_emb")
    if any(p > 0 for p in getattr(layers, "layer_dropouts", ())):
        training_only.append("layer_dropout")
    if getattr(layers, "cross_attn_tokens_dropout", 0) > 0:
        training_only.append("cross_attn_tokens_dropout")
    if tuple(layers.layers_execute_order) != tuple(range(len(layers.layer_types))):
        problems.add("layers_execute_order / weight_tie_layers (layers run in a custom order or repeated)")

    types = tuple(layers.layer_types)
    cross = "c" in types
    only_cross = cross and "a" not in types
    block = ("c", "f") if only_cross else (("a", "c", "f") if cross else ("a", "f"))
    depth = len(types) // len(block)
    if depth == 0 or types != block * depth:
        problems.add(
            f"a custom layer pattern {''.join(types)!r} (custom_layers / par_ratio / sandwich_coef / macaron / "
            f"only_attn); safeformer runs {''.join(block)!r} per layer"
        )

    rotary = layers.rotary_pos_emb
    rotary_dim = None
    rotary_opts: dict = {}
    if rotary is not None:
        rotary_dim = rotary.inv_freq.numel() * 2
        if getattr(rotary, "scale", None) is not None:
            problems.add("rotary_xpos")
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
    if alibi:
        if rel_pos.heads != rel_pos.total_heads:
            problems.add(f"alibi_num_heads={rel_pos.heads} < heads={rel_pos.total_heads} (ALiBi on some heads only; "
                         f"safeformer's ALiBi covers every head)")
        elif not torch.allclose(rel_pos.slopes.detach().double().cpu().flatten(),
                                alibi_slopes(rel_pos.heads).double(), rtol=1e-6, atol=0):
            problems.add("custom ALiBi slopes (rel_pos_kwargs slopes=...)")
        if rotary is not None:
            problems.add("rotary_pos_emb and alibi_pos_bias together (safeformer takes one relative position scheme)")
        if has_abs:
            problems.add("alibi_pos_bias with the absolute position embedding x-transformers keeps next to it "
                         "(safeformer drops it under ALiBi); such a model trained with use_abs_pos_emb=False or "
                         "disable_abs_pos_emb=True converts")
    return dict(types=types, cross=cross, only_cross=only_cross, depth=depth, rotary=rotary, rotary_dim=rotary_dim,
                rotary_opts=rotary_opts,
                alibi=alibi)


def _check_layers(layers, xt, xt_attend, types: tuple, dim: int, problems: _Problems, training_only: list[str]) -> dict:
    """Per layer: norms, residuals, attention and feed-forward blocks, which must agree across layers."""
    norm_kinds: set[str] = set()
    attn_shapes: set[tuple] = set()
    attn_keys: set[tuple] = set()
    attn_opts: dict[int, _AttnOptions] = {}
    cross_dims: set[int] = set()
    attn_dropouts: set[float] = set()
    ff_infos: list[dict | None] = []
    for k, ((pre, post_branch, post_main), blk, residual) in enumerate(layers.layers):
        name = f"attn_layers.layers.{k}"
        kind = types[k] if k < len(types) else "?"
        if pre is None:
            problems.add("no pre-norm", name)
        else:
            nk = _norm_kind(pre, xt)
            if nk is None:
                problems.add(f"{_TYPE_OPTIONS.get(type(pre).__name__, type(pre).__name__)}", name)
            else:
                norm_kinds.add(nk)
                if nk == "layer" and pre.ln.eps != 1e-5:
                    problems.add(f"a LayerNorm eps {pre.ln.eps} != 1e-5", name)
        if post_branch is not None:
            problems.add("sandwich_norm", name)
        if post_main is not None:
            problems.add("post-norm / pre_and_post_norm", name)
        if type(residual) is xt.Residual:
            if residual.residual_scale is not None:
                problems.add("scale_residual", name)
            if residual.scale_residual_constant != 1:
                problems.add(f"scale_residual_constant={residual.scale_residual_constant}", name)
        if kind in ("a", "c") and type(blk) is xt.Attention:
            opts = _check_attention(name, blk, xt, xt_attend, problems, training_only)
            attn_opts[k] = opts
            attn_keys.add(opts.key())
            dh = blk.to_q.out_features // blk.heads
            attn_shapes.add((blk.heads, blk.kv_heads, dh))
            attn_dropouts.add(blk.attend.dropout)
            if blk.to_v.out_features != blk.kv_heads * dh:
                problems.add("attn_value_dim_head != dim_head", name)
            out_features = blk.to_out.out_features if isinstance(blk.to_out, nn.Linear) else blk.heads * dh
            if out_features != dim:
                problems.add(f"attn_dim_out={out_features} != dim", name)
            if kind == "a":
                if blk.to_k.in_features != dim:
                    problems.add("attn_dim_context on self-attention", name)
                if blk.causal != layers.causal:
                    problems.add(f"a self-attention with causal={blk.causal} in a stack with causal={layers.causal}", name)
            else:
                cross_dims.add(blk.to_k.in_features)
                if blk.causal:
                    problems.add("a causal cross-attention", name)
        elif kind == "f" and type(blk) is xt.FeedForward:
            ff_infos.append(_parse_ff(name, blk, xt, problems, training_only))
    final = layers.final_norm
    if _norm_kind(final, xt) is None:
        if type(final).__name__ == "Identity":
            problems.add("no final norm (pre_norm_has_final_norm=False or post-norm)")
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
    if len(cross_dims) > 1:
        problems.add(f"cross-attention layers of different context widths: {sorted(cross_dims)}")
    if len(attn_dropouts) > 1:
        problems.add(f"attention layers of different dropout: {sorted(attn_dropouts)}")
    ff_ok = [f for f in ff_infos if f is not None]
    ff_kinds = {(f["glu"], f["swish"], f["out"].in_features, f["dropout"], f.get("softclamp")) for f in ff_ok}
    if len(ff_kinds) > 1:
        problems.add(f"feed-forward layers of different (glu, swish, hidden width, dropout, softclamp): "
                     f"{sorted(ff_kinds, key=repr)}")
    for f in ff_ok:
        if f["out"].out_features != dim or f["in"].in_features != dim:
            problems.add("ff_dim_out != dim")
    return dict(norm_kinds=norm_kinds, attn_shapes=attn_shapes, attn_opts=attn_opts, cross_dims=cross_dims,
                attn_dropouts=attn_dropouts, ff_ok=ff_ok)


def _plan_wrapper(model, xt, xt_attend, problems: _Problems, training_only: list[str]) -> _Plan:
    """Checks an x-transformers ``TransformerWrapper`` (recording every problem) and plans its conversion."""
    layers = model.attn_layers
    dim = layers.dim
    _check_module_types(model, xt, xt_attend, problems)
    w = _check_wrapper(model, xt, problems, training_only, dim)
    num_memory_tokens, tied, to_logits, has_abs, l2norm_embed = (
        w["num_memory_tokens"], w["tied"], w["to_logits"], w["has_abs"], w["l2norm_embed"])
    st = _check_stack(layers, xt, problems, training_only, has_abs)
    types, cross, only_cross, depth, rotary, rotary_dim, alibi = (
        st["types"], st["cross"], st["only_cross"], st["depth"], st["rotary"], st["rotary_dim"], st["alibi"])
    ly = _check_layers(layers, xt, xt_attend, types, dim, problems, training_only)
    norm_kinds, attn_shapes, attn_opts, cross_dims, attn_dropouts, ff_ok = (
        ly["norm_kinds"], ly["attn_shapes"], ly["attn_opts"], ly["cross_dims"], ly["attn_dropouts"], ly["ff_ok"])

    heads, kv_heads, dim_head = next(iter(attn_shapes)) if attn_shapes else (1, 1, dim)
    if alibi and 1 < kv_heads < heads:
        problems.add(f"alibi_pos_bias with grouped-query heads (attn_kv_heads={kv_heads} of heads={heads}): "
                     f"safeformer groups query heads the other way round, and its ALiBi slopes are fixed per head index")
    opts0 = next(iter(attn_opts.values()), _AttnOptions())

    # ---- the safeformer configuration
    ff0 = ff_ok[0] if ff_ok else None
    hidden = ff0["out"].in_features if ff0 else 4 * dim
    ff_mult = hidden / dim
    if int(dim * ff_mult) != hidden:
        problems.add(f"a feed-forward hidden width {hidden} that is not int(dim * mult) for any float mult")
    rms = norm_kinds == {"rms"}
    stack_kwargs = dict(
        dim=dim, depth=max(depth, 1), heads=heads, dim_head=dim_head, kv_heads=kv_heads if kv_heads != heads else None,
        ff_mult=ff_mult, ff_glu=bool(ff0 and ff0["glu"]), ff_swish=bool(ff0 and ff0["swish"]),
        use_rmsnorm=rms, norm_eps=_RMS_EPS if rms else None, use_dynamic_tanh=norm_kinds == {"dyt"},
        attn_dropout=float(next(iter(attn_dropouts), 0.0)),
        ff_dropout=float(ff0["dropout"]) if ff0 else 0.0,
    )
    if rotary is not None:
        stack_kwargs.update(rotary_pos_emb=True, rotary_emb_dim=rotary_dim, **st["rotary_opts"])
    if alibi:
        stack_kwargs.update(alibi_pos_bias=True)
    if cross:
        stack_kwargs.update(dim_context=next(iter(cross_dims), dim))
    if opts0.qk_norm or opts0.value_rmsnorm:  # x-transformers l2-normalises (F.normalize, eps 1e-12)
        stack_kwargs.update(attn_qk_norm_eps=_RMS_EPS)
    if opts0.qk_norm:
        stack_kwargs.update(attn_qk_norm=True)
    if opts0.qk_head_gains is not None:
        stack_kwargs.update(attn_qk_norm_dim_scale=True)
    if opts0.value_rmsnorm:
        stack_kwargs.update(attn_value_rmsnorm=True)
    if getattr(layers, "add_value_residual", False):
        stack_kwargs.update(add_value_residual=True,
                            learned_value_residual_mix=any(o.value_mix for o in attn_opts.values()))
    if ff0 is not None and ff0.get("softclamp") is not None:
        stack_kwargs.update(ff_softclamp_value=ff0["softclamp"])
    if opts0.dd_alibi:
        if cross:
            problems.add("attn_data_dependent_alibi with cross-attention (safeformer biases self-attention only)")
        stack_kwargs.update(dict(opts0.dd_alibi))
    if opts0.orthog:
        if cross:
            problems.add("attn_orthog_projected_values with cross-attention (safeformer projects self-attention only)")
        stack_kwargs.update(dict(opts0.orthog))
    if opts0.mem_kv:
        stack_kwargs.update(attn_num_mem_kv=opts0.mem_kv)
    if opts0.sink:
        stack_kwargs.update(attn_head_learned_sink=True)
    if opts0.softclamp is not None:
        stack_kwargs.update(attn_softclamp_logits=True, attn_logit_softclamp_value=opts0.softclamp)
    stack_kwargs.update(dict(opts0.gates))
    layers_cls = CrossAttender if only_cross else (Decoder if layers.causal else Encoder)
    if not only_cross:
        stack_kwargs.update(cross_attend=cross)

    num_tokens = model.token_emb.emb.num_embeddings if isinstance(model.token_emb, xt.TokenEmbedding) else 1
    logits_dim = to_logits.out_features if isinstance(to_logits, nn.Linear) else num_tokens
    wrapper_kwargs = dict(
        num_tokens=num_tokens, max_seq_len=model.max_seq_len if model.max_seq_len > 0 else 1,
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
    sf = TransformerWrapper(attn_layers=plan.layers_cls(**plan.stack_kwargs), **plan.wrapper_kwargs)
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
        if isinstance(dst, DynamicTanh):  # x-transformers' unit offsets (norm_add_unit_offset) folded in
            put(dst.pre_tanh_scale, src.pre_tanh_scale.detach() + float(src.pre_tanh_scale_offset))
            put(dst.gamma, src.gamma.detach() + float(src.gamma_offset))
            put(dst.beta, src.beta.detach())
            return
        put(dst.weight, weight)
        if isinstance(dst, nn.LayerNorm):
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

    heads, kv_heads, dim_head = plan.heads, plan.kv_heads, plan.dim_head
    g = heads // kv_heads
    # our query head m = kv * g + r  <->  x-transformers query head n = r * kv_heads + kv
    perm = torch.tensor([(m % g) * kv_heads + m // g for m in range(heads)], device=ref.device)
    rows = (perm[:, None] * dim_head + torch.arange(dim_head, device=ref.device)[None, :]).reshape(-1)

    with torch.no_grad():
        put(sf.token_emb.weight, take(model.token_emb.emb.weight))
        if plan.wrapper_kwargs.get("use_abs_pos_emb"):
            put(sf.pos_emb.emb.weight, take(model.pos_emb.emb.weight))
        if plan.wrapper_kwargs.get("num_memory_tokens"):
            put(sf.memory_tokens, take(model.memory_tokens))
        if plan.wrapper_kwargs.get("use_cls_token"):
            put(sf.cls_token, take(model.cls_token))
        if not plan.tied and model.to_logits is not None:
            put(sf.to_logits.weight, take(model.to_logits.weight))
        for k, ((pre, _, _), blk, _) in enumerate(layers.layers):
            norm, dst = sf.attn_layers.layers[k][:2]
            copy_norm(norm, pre)
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
                    put(dst.to_value_residual_mix.weight, take(lin.weight)[perm])
                    put(dst.to_value_residual_mix.bias, take(lin.bias)[perm])
                if opts.value_rmsnorm:  # gamma (h, 1, d), h == h_kv (checked): kv heads are not permuted
                    put(dst.v_norm.weight, take(blk.value_rmsnorm.gamma).reshape(kv_heads, dim_head))
                if opts.qk_head_gains is not None:
                    w_q, w_k = opts.qk_head_gains
                    put(dst.q_norm.weight, w_q[perm.cpu()].to(ref.dtype).to(ref.device))
                    put(dst.k_norm.weight, w_k.to(ref.dtype).to(ref.device))
                    take(blk.qk_norm_q_scale)
                    take(blk.qk_norm_k_scale)
                elif opts.qk_norm:
                    p = opts.qk_gain  # (d,) float64: w_q * w_k = p
                    w_k = p.abs().sqrt()
                    put(dst.k_norm.weight, w_k.to(ref.dtype).to(ref.device))
                    put(dst.q_norm.weight, (torch.sign(p) * w_k).to(ref.dtype).to(ref.device))
                    for t in (blk.qk_norm_q_scale, blk.qk_norm_k_scale):
                        if isinstance(t, Tensor):
                            take(t)
                if opts.mem_kv:  # key/value heads are not permuted
                    put(dst.mem_k, take(blk.mem_k))
                    put(dst.mem_v, take(blk.mem_v))
                if opts.sink:
                    put(dst.head_attn_sink, take(blk.attend.head_attn_sink)[perm])
                copy_gates(dst, blk)
            else:
                info = _parse_ff(f"attn_layers.layers.{k}", blk, xt, _Problems(), [])
                put(dst.proj_in.weight, take(info["in"].weight))
                put(dst.proj_in.bias, take(info["in"].bias) if info["in"].bias is not None else torch.zeros_like(dst.proj_in.bias))
                w_out = take(info["out"].weight)
                if info["mult_bias"] is not None:
                    w_out = w_out * take(info["mult_bias"])[None, :]
                put(dst.proj_out.weight, w_out)
                put(dst.proj_out.bias, take(info["out"].bias) if info["out"].bias is not None else torch.zeros_like(dst.proj_out.bias))
        copy_norm(sf.attn_layers.final_norm, layers.final_norm)

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
        problems.add("add_attn_z_loss")
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
    relative = lc.get("rotary_pos_emb") or lc.get("alibi_pos_bias")
    cfg["use_abs_pos_emb"] = bool(cfg.get("use_abs_pos_emb")) and not relative
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
    if "ff_mult" in lc:
        lc["ff_mult"] = float(lc["ff_mult"])
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
    from .encoder_decoder import _WRAPPER_SIDE

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
    for side, built, converted in (("encoder", sf.encoder, sf_enc), ("decoder.net", sf.decoder, sf_dec)):
        want, got = _effective_config(converted), _effective_config(built)
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                problems.add(f"{side} {key}={want.get(key)!r}: safeformer's XTransformer builds {key}={got.get(key)!r} "
                             f"(convert model.encoder and model.decoder on their own instead)")
    problems.raise_if_any()
    ref = enc.token_emb.emb.weight
    sf = sf.to(device=ref.device, dtype=ref.dtype)
    sf.encoder.load_state_dict(sf_enc.state_dict())
    sf.decoder.load_state_dict(sf_dec.state_dict())
    sf.train(model.training)
    return sf


def _raise_problems(problems: _Problems, training_only: list[str], drop_training_only: bool) -> None:
    if training_only and not drop_training_only:
        for t in dict.fromkeys(training_only):
            problems.add(f"{t} (training only; pass drop_training_only=True to drop it)")
    problems.raise_if_any()


# x-transformers' other wrappers: (its module, its class) -> (safeformer's module, the converter there)
_OTHER_WRAPPERS: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("x_transformers.dpo", "DPO"): ("safeformer.dpo", "dpo_from_x_transformers", False),
    ("x_transformers.xval", "XValTransformerWrapper"): ("safeformer.xval", "xval_from_x_transformers", False),
    ("x_transformers.xval", "XValAutoregressiveWrapper"): ("safeformer.xval", "xval_from_x_transformers", False),
    ("x_transformers.neo_mlp", "NeoMLP"): ("safeformer.neo_mlp", "neo_mlp_from_x_transformers", False),
    ("x_transformers.continuous_autoencoder", "ContinuousTransformerAutoencoder"):
        ("safeformer.continuous_autoencoder", "continuous_autoencoder_from_x_transformers", False),
    ("x_transformers.gpt_vae", "GPTVAE"): ("safeformer.gpt_vae", "gpt_vae_from_x_transformers", False),
    ("x_transformers.belief_state_wrapper", "BeliefStateWrapper"):
        ("safeformer.belief_state", "belief_state_from_x_transformers", True),
    ("x_transformers.next_latent_wrapper", "NextLatentWrapper"):
        ("safeformer.next_latent", "next_latent_from_x_transformers", True),
    ("x_transformers.multi_input", "MultiInputTransformerWrapper"):
        ("safeformer.multi_input", "multi_input_from_x_transformers", True),
    ("x_transformers.entropy_based_tokenizer", "EntropyBasedTokenizer"):
        ("safeformer.entropy_tokenizer", "entropy_tokenizer_from_x_transformers", True),
}


def _convert_other_wrapper(model: nn.Module, drop_training_only: bool):
    """The safeformer twin of one of x-transformers' other wrappers (``_OTHER_WRAPPERS``), or ``None``."""
    import importlib

    for (xt_module, xt_name), (sf_module, converter, takes_drop) in _OTHER_WRAPPERS.items():
        try:
            cls = getattr(importlib.import_module(xt_module), xt_name)
        except (ImportError, AttributeError):  # an x-transformers version without it
            continue
        if isinstance(model, cls):
            convert = getattr(importlib.import_module(sf_module), converter)
            return convert(model, drop_training_only=drop_training_only) if takes_drop else convert(model)
    return None


def from_x_transformers(
    model: nn.Module, *, drop_training_only: bool = False
) -> TransformerWrapper | AutoregressiveWrapper | XTransformer:
    """Convert an x-transformers model into the equivalent safeformer model, with the same weights.

    Converts an ``x_transformers.TransformerWrapper`` into a ``safeformer.TransformerWrapper``, an
    ``x_transformers.AutoregressiveWrapper`` into a ``safeformer.AutoregressiveWrapper`` (same
    ``ignore_index`` and ``pad_value``) and an ``x_transformers.XTransformer`` into a
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
    attention, feed-forward and embedding dropout.

    Also x-transformers' ``DPO``, ``XValTransformerWrapper``, ``XValAutoregressiveWrapper``, ``NeoMLP``,
    ``MultiInputTransformerWrapper`` and ``EntropyBasedTokenizer`` (their converters live beside the
    safeformer classes: ``safeformer.dpo``, ``.xval``, ``.neo_mlp``, ``.multi_input``, ``.entropy_tokenizer``).

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
        TypeError: ``model`` is none of the three.
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
        sf = AutoregressiveWrapper(net, ignore_index=model.ignore_index, pad_value=model.pad_value)
        sf.train(model.training)
        return sf
    if not isinstance(model, xt.TransformerWrapper):
        raise TypeError(
            "model must be an x_transformers.TransformerWrapper, AutoregressiveWrapper or XTransformer, "
            f"got {type(model).__name__}"
        )
    plan = _plan_wrapper(model, xt, xt_attend, problems, training_only)
    _raise_problems(problems, training_only, drop_training_only)
    sf = _build_wrapper(plan, xt)
    problems.raise_if_any()
    return sf
