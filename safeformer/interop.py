"""Import of x-transformers models: ``from_x_transformers(model)``.

Converts an ``x_transformers.TransformerWrapper`` (``Decoder``, ``Encoder`` or ``CrossAttender``
layers) into the equivalent ``safeformer.TransformerWrapper`` with the same weights, so that a
trained model gains safeformer's safety contract. Options that change the numbers and have no
safeformer equivalent raise one ``ValueError`` listing all of them.

Shape legend: c model width, h query heads, h_kv key/value heads, g = h // h_kv, d head dim,
v vocabulary size, f feed-forward hidden width.

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
  ``m // g``. The query heads are permuted (rows of ``to_q``, columns of ``to_out``) to match.
- A GLU ``mult_bias`` is folded into the columns of the feed-forward's output projection; a
  feed-forward without biases gets zero biases; an attention without an output projection (one
  head) gets the identity. A tied embedding (``logits = h @ E.T * tie_embedding_scale``) becomes an
  untied ``to_logits`` holding ``E * tie_embedding_scale``.
- Positions. Both count positions from 0 and scale a learned absolute embedding by ``c ** -0.5``;
  rotary positions rotate interleaved pairs of the first ``rotary_emb_dim`` features per head with
  base 10000. x-transformers numbers positions ``0..n-1`` whatever the mask; safeformer counts real
  tokens (so left padding does not shift positions). The two agree at every real position when
  padding is on the right.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import CrossAttender, Decoder, Encoder
from .modules import RMSNorm
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
    "LoRALinear": "attn_gate_values / attn_output_gate",
    "CoPE": "attn_use_cope",
    "Lambda": "ff_softclamp_value",
    "AlibiPositionalBias": "alibi_pos_bias",
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

    def __init__(self) -> None:
        self.items: dict[str, list[str]] = {}

    def add(self, text: str, where: str | None = None) -> None:
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
    raise AssertionError("unreachable: checked by _norm_kind")


def _check_attention(name: str, attn, xt, xt_attend, problems: _Problems, training_only: list[str]) -> None:
    flags = {
        "qk_norm": "attn_qk_norm",
        "head_scale": "attn_head_scale",
        "attn_on_attn": "attn_on_attn",
        "orthog_projected_values": "attn_orthog_projected_values",
        "orthog_projected_values_per_head": "attn_orthog_projected_values_per_head",
        "laser": "attn_laser",
        "qkv_receive_diff_residuals": "qkv_receive_diff_residuals",
        "use_latent_q": "attn_use_latent_q (multi-latent attention)",
        "use_latent_kv": "attn_use_latent_kv (multi-latent attention)",
    }
    for attr, option in flags.items():
        if getattr(attn, attr, False):
            problems.add(f"{option}", name)
    if getattr(attn, "num_mem_kv", 0):
        problems.add(f"attn_num_mem_kv={attn.num_mem_kv}", name)
    if getattr(attn, "max_attend_past", None) is not None:
        problems.add(f"attn_max_attend_past={attn.max_attend_past}", name)
    for attr, option in (
        ("to_v_head_gate", "attn_gate_value_heads"),
        ("to_v_gate", "attn_gate_values"),
        ("to_output_gate", "attn_output_gate"),
        ("hybrid_module", "attn_hybrid_module"),
        ("to_rotateable_k", "attn_latent_rope_subheads"),
        ("data_dependent_alibi", "attn_data_dependent_alibi"),
        ("rel_proj_pos_bias", "attn_use_rel_proj_pos_bias"),
        ("q_rmsnorm", "attn_qk_rmsnorm"),
        ("k_rmsnorm", "attn_k_rmsnorm"),
        ("value_rmsnorm", "attn_value_rmsnorm"),
    ):
        if getattr(attn, attr, None) is not None:
            problems.add(f"{option}", name)
    if isinstance(attn.to_value_residual_mix, nn.Module):
        problems.add("learned_value_residual_mix", name)
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
        return
    fn = att.attn_fn
    plain_softmax = isinstance(fn, functools.partial) and fn.func is F.softmax and fn.keywords.get("dim") == -1
    if not plain_softmax:
        problems.add("a non-softmax attention function (attn_sigmoid / attn_hard / attn_sparse_topk / "
                     "attn_gumbel_softmax / attn_custom_attn_fn)", name)
    dim_head = attn.to_q.out_features // attn.heads
    if att.scale is not None and not math.isclose(att.scale, dim_head**-0.5, rel_tol=1e-12):
        problems.add(f"an attention scale {att.scale} != dim_head ** -0.5", name)
    for attr, option in (
        ("selective", "attn_selective"),
        ("cog_signed", "attn_cog_signed"),
        ("l2_distance", "attn_l2_distance"),
        ("add_zero_kv", "attn_add_zero_kv"),
        ("head_learned_sink", "attn_head_learned_sink"),
        ("softclamp_logits", "attn_softclamp_logits"),
        ("inverted_attention", "inverted_attention"),
        ("flash_pack_seq", "attn_flash_pack_seq"),
    ):
        if getattr(att, attr, False):
            problems.add(f"{option}", name)
    for attr in ("pre_softmax_talking_heads", "post_softmax_talking_heads", "pre_scale_post_talking_heads", "cope"):
        if getattr(att, attr, None) is not None:
            problems.add(f"attn_{attr.replace('softmax_', '')}", name)


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
        xt_attend.Attend, xt.FeedForward, xt.GLU, xt.Residual, xt.RotaryEmbedding, nn.Embedding, nn.Linear,
        nn.LayerNorm, nn.Dropout, nn.Identity, nn.ModuleList, nn.Sequential, nn.GELU, nn.SiLU, einops_torch.Rearrange,
    }
    try:
        from torch_einops_utils.nn import Identity

        allowed.add(Identity)
    except ImportError:  # pragma: no cover
        pass
    return allowed


def from_x_transformers(model: nn.Module, *, drop_training_only: bool = False) -> TransformerWrapper:
    """Convert an ``x_transformers.TransformerWrapper`` into the equivalent safeformer model.

    Supported: ``Decoder``, ``Encoder`` and ``CrossAttender`` layers, with or without
    ``cross_attend`` (and ``cross_attn_dim_context``); pre-norm ``LayerNorm``, ``RMSNorm``,
    ``SimpleRMSNorm`` or ``ScaleNorm``; learned absolute or rotary positions (``rotary_emb_dim``);
    GELU or SiLU feed-forwards, gated (``ff_glu``, with ``ff_glu_mult_bias``) or not, with or without
    biases (``ff_no_bias``); grouped-query attention (``attn_kv_heads``, ``attn_one_kv_head``);
    ``attn_flash`` on or off; a tied embedding; ``logits_dim``; attention, feed-forward and
    embedding dropout.

    Args:
        model: an ``x_transformers.TransformerWrapper``.
        drop_training_only: options that change only training (``layer_dropout``,
            ``cross_attn_tokens_dropout``, sublayer dropouts, ``emb_frac_gradient``) raise like any
            other unsupported option by default; with ``True`` they are dropped instead (the
            converted model then trains without them, and evaluates the same).

    Returns:
        a ``safeformer.TransformerWrapper`` on the model's device and dtype, in the model's training
        mode, whose logits equal the original's at every real position (right padding; see the
        module docstring for the positions and the RMSNorm epsilon).

    Raises:
        TypeError: ``model`` is not an ``x_transformers.TransformerWrapper``.
        ValueError: the model uses options safeformer cannot represent; the message lists all of them.
    """
    xt, xt_attend = _xt()
    if not isinstance(model, xt.TransformerWrapper):
        raise TypeError(f"model must be an x_transformers.TransformerWrapper, got {type(model).__name__}")
    problems = _Problems()
    training_only: list[str] = []
    layers = model.attn_layers
    dim = layers.dim

    # ---- every module must be of a type we know; others name the option that made them
    allowed = _allowed_types(xt, xt_attend)
    flagged: list[str] = []
    for mname, module in model.named_modules():
        if type(module) in allowed or any(mname.startswith(f + ".") for f in flagged):
            continue
        tname = type(module).__name__
        option = _TYPE_OPTIONS.get(tname, f"a {tname} module")
        problems.add(f"{option} ({tname})", mname or "<model>")
        flagged.append(mname)

    # ---- the wrapper
    if not isinstance(model.project_emb, (nn.Identity,)) and type(model.project_emb).__name__ != "Identity":
        problems.add("emb_dim != dim (an embedding projection)")
    if not isinstance(model.token_emb, xt.TokenEmbedding):
        problems.add(f"a custom token_emb {type(model.token_emb).__name__}")
    elif model.token_emb.l2norm_embed:
        problems.add("l2norm_embed")
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
    if getattr(model, "cls_token", None) is not None:
        problems.add("use_cls_token")
    if getattr(model, "average_pool_embed", False):
        problems.add("average_pool_embed")
    if getattr(model, "to_mixture", None) is not None:
        problems.add("mixture_of_softmax")
    if getattr(model, "sigsoftmax_logits", False):
        problems.add("sigsoftmax_logits")
    if getattr(model, "has_multiple_heads", False):
        problems.add("num_output_heads > 1")
    if getattr(model, "num_memory_tokens", 0):
        problems.add(f"num_memory_tokens={model.num_memory_tokens}")
    if getattr(model, "add_continuous_pred_head", False):
        problems.add("add_continuous_pred_head (its head would not be converted)")
    if getattr(model, "emb_frac_gradient", 1.0) != 1.0:
        training_only.append(f"emb_frac_gradient={model.emb_frac_gradient}")
    tied = False
    to_logits = model.to_logits
    if to_logits is None:
        problems.add("return_only_embed (no to_logits)")
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
    if has_abs and model.pos_emb.l2norm_embed:
        problems.add("l2norm_embed")

    # ---- the layer stack
    for attr, option in (
        ("residual_attn", "residual_attn"),
        ("cross_residual_attn", "cross_residual_attn"),
        ("softclamp_output", "softclamp_output"),
        ("sandwich_norm", "sandwich_norm"),
        ("pre_and_post_norm", "pre_and_post_norm"),
        ("add_value_residual", "add_value_residual"),
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
    if getattr(layers, "rel_pos", None) is not None:
        problems.add(_TYPE_OPTIONS.get(type(layers.rel_pos).__name__, "a relative position bias"))
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
    if rotary is not None:
        rotary_dim = rotary.inv_freq.numel() * 2
        if getattr(rotary, "scale", None) is not None:
            problems.add("rotary_xpos")
        if getattr(rotary, "interpolation_factor", 1.0) != 1.0:
            problems.add(f"rotary_interpolation_factor={rotary.interpolation_factor}")
        expected = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        if not torch.allclose(rotary.inv_freq.detach().float().cpu(), expected, rtol=1e-6, atol=0):
            problems.add("rotary_base_rescale_factor (a rotary base other than 10000)")
        if has_abs:
            problems.add("absolute and rotary positions together (disable_abs_pos_emb=False with rotary)")

    # ---- per layer: norms, residuals, blocks
    norm_kinds: set[str] = set()
    attn_shapes: set[tuple] = set()
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
            _check_attention(name, blk, xt, xt_attend, problems, training_only)
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
    if len(cross_dims) > 1:
        problems.add(f"cross-attention layers of different context widths: {sorted(cross_dims)}")
    if len(attn_dropouts) > 1:
        problems.add(f"attention layers of different dropout: {sorted(attn_dropouts)}")
    ff_ok = [f for f in ff_infos if f is not None]
    ff_kinds = {(f["glu"], f["swish"], f["out"].in_features, f["dropout"]) for f in ff_ok}
    if len(ff_kinds) > 1:
        problems.add(f"feed-forward layers of different (glu, swish, hidden width, dropout): {sorted(ff_kinds)}")
    for f in ff_ok:
        if f["out"].out_features != dim or f["in"].in_features != dim:
            problems.add("ff_dim_out != dim")

    if training_only and not drop_training_only:
        for t in dict.fromkeys(training_only):
            problems.add(f"{t} (training only; pass drop_training_only=True to drop it)")
    problems.raise_if_any()

    # ---- build the safeformer model
    heads, kv_heads, dim_head = next(iter(attn_shapes)) if attn_shapes else (1, 1, dim)
    ff0 = ff_ok[0] if ff_ok else None
    hidden = ff0["out"].in_features if ff0 else 4 * dim
    ff_mult = hidden / dim
    if int(dim * ff_mult) != hidden:
        problems.add(f"a feed-forward hidden width {hidden} that is not int(dim * mult) for any float mult")
        problems.raise_if_any()
    stack_kwargs = dict(
        dim=dim, depth=depth, heads=heads, dim_head=dim_head, kv_heads=kv_heads if kv_heads != heads else None,
        ff_mult=ff_mult, ff_glu=bool(ff0 and ff0["glu"]), ff_swish=bool(ff0 and ff0["swish"]),
        use_rmsnorm=norm_kinds == {"rms"}, norm_eps=_RMS_EPS if norm_kinds == {"rms"} else None, attn_dropout=float(next(iter(attn_dropouts), 0.0)),
        ff_dropout=float(ff0["dropout"]) if ff0 else 0.0,
    )
    if rotary is not None:
        stack_kwargs.update(rotary_pos_emb=True, rotary_emb_dim=rotary_dim)
    if cross:
        stack_kwargs.update(dim_context=next(iter(cross_dims)))
    if only_cross:
        sf_layers = CrossAttender(**stack_kwargs)
    elif layers.causal:
        sf_layers = Decoder(cross_attend=cross, **stack_kwargs)
    else:
        sf_layers = Encoder(cross_attend=cross, **stack_kwargs)
    num_tokens = model.token_emb.emb.num_embeddings
    logits_dim = to_logits.out_features if isinstance(to_logits, nn.Linear) else num_tokens
    max_seq_len = model.max_seq_len if model.max_seq_len > 0 else 1
    sf = TransformerWrapper(
        num_tokens=num_tokens, max_seq_len=max_seq_len, attn_layers=sf_layers, emb_dropout=model.emb_dropout.p,
        use_abs_pos_emb=has_abs, logits_dim=logits_dim if logits_dim != num_tokens else None,
    )

    ref = model.token_emb.emb.weight
    sf = sf.to(device=ref.device, dtype=ref.dtype)  # before copying: no precision is lost on the way

    # ---- copy the weights, recording which x-transformers parameters were used
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
        put(dst.weight, weight)
        if isinstance(dst, nn.LayerNorm):
            dst.bias.zero_()
        elif isinstance(dst, RMSNorm):
            if dst.eps != _RMS_EPS:
                raise AssertionError(f"converted RMSNorm has eps {dst.eps}, expected {_RMS_EPS}")
        else:
            raise AssertionError(f"unexpected norm {type(dst).__name__}")

    g = heads // kv_heads
    # our query head m = kv * g + r  <->  x-transformers query head n = r * kv_heads + kv
    perm = [(m % g) * kv_heads + m // g for m in range(heads)]
    rows = torch.tensor([p * dim_head + e for p in perm for e in range(dim_head)], device=ref.device)

    with torch.no_grad():
        put(sf.token_emb.weight, take(model.token_emb.emb.weight))
        if has_abs:
            put(sf.pos_emb.emb.weight, take(model.pos_emb.emb.weight))
        if tied:
            put(sf.to_logits.weight, take(model.token_emb.emb.weight) * model.tie_embedding_scale)
        else:
            put(sf.to_logits.weight, take(to_logits.weight))
        for k, ((pre, _, _), blk, _) in enumerate(layers.layers):
            norm, dst = sf.attn_layers.layers[k]
            copy_norm(norm, pre)
            if types[k] in ("a", "c"):
                put(dst.to_q.weight, take(blk.to_q.weight)[rows])
                put(dst.to_k.weight, take(blk.to_k.weight))
                put(dst.to_v.weight, take(blk.to_v.weight))
                if isinstance(blk.to_out, nn.Linear):
                    put(dst.to_out.weight, take(blk.to_out.weight)[:, rows])
                else:
                    put(dst.to_out.weight, torch.eye(dim, dtype=ref.dtype, device=ref.device)[:, rows])
            else:
                info = _parse_ff(f"attn_layers.layers.{k}", blk, xt, _Problems(), [])
                put(dst.proj_in.weight, take(info["in"].weight))
                put(dst.proj_in.bias, take(info["in"].bias) if info["in"].bias is not None else torch.zeros_like(dst.proj_in.bias))
                w_out = take(info["out"].weight)
                if info["mult_bias"] is not None:
                    w_out = w_out * take(info["mult_bias"])[None, :]
                put(dst.proj_out.weight, w_out)
                put(dst.proj_out.bias, take(info["out"].bias) if info["out"].bias is not None else torch.zeros_like(dst.proj_out.bias))
        copy_norm(sf.attn_layers.final_norm, final)

    unused = [n for n, p in model.named_parameters() if id(p) not in used]
    if unused:
        problems.add(f"parameters with no safeformer counterpart: {', '.join(unused)}")
        problems.raise_if_any()

    sf.train(model.training)
    return sf
