"""Import of x-transformers models: ``from_x_transformers(model)``.

Converts an ``x_transformers.TransformerWrapper`` (``Decoder``, ``Encoder`` or ``CrossAttender``
layers) into the equivalent ``safeformer.TransformerWrapper`` with the same weights, so that a
trained model gains safeformer's safety contract; an ``x_transformers.AutoregressiveWrapper`` into a
``safeformer.AutoregressiveWrapper`` and an ``x_transformers.XTransformer`` into a
``safeformer.XTransformer`` around such converted nets (each side's options, where encoder and decoder
differ, in its ``enc_options`` / ``dec_options``). Options that change the numbers and have no
safeformer equivalent raise one ``ValueError`` listing all of them.

This module holds the entry points (``from_x_transformers``, ``register_converter``) and the conversions of
what wraps a net (autoregressive and continuous wrappers, ``XTransformer``, bare stacks); a net itself converts
in three steps, each in its own module: ``checks`` reads single x-transformers modules (norms, attentions,
feed-forwards, module types) and collects the problems, ``plan`` checks a ``TransformerWrapper`` and plans the
safeformer keywords (``_plan_wrapper``), ``build`` constructs the model of a plan and copies the weights in
(``_build_wrapper``).

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
  rotary positions rotate interleaved pairs of the first ``rotary_emb_dim`` features per head; the rotary and
  PoPE frequencies (their ``inv_freq`` buffers: any base, edited values) are copied as they are, the rotary
  base also read back into ``rotary_theta``. x-transformers numbers positions ``0..n-1`` whatever the mask; safeformer counts real
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

import inspect
from collections.abc import Callable

import torch
from torch import nn

from ..decoding.encoder_decoder import XTransformer
from ..decoding.generation import AutoregressiveWrapper
from ..stack.layers import AttentionLayers, _defaults
from ..stack.wrappers import TransformerWrapper
from .build import _build_wrapper
from .checks import _Problems
from .plan import _check_autoregressive, _plan_wrapper

__all__ = ["from_x_transformers"]


def _xt():
    try:
        import x_transformers.attend as xt_attend
        import x_transformers.x_transformers as xt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("from_x_transformers needs x-transformers: pip install x-transformers") from err
    return xt, xt_attend


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
        return _convert_autoregressive(model, xt, xt_attend, problems, training_only, drop_training_only)
    return _convert_net(model, xt, xt_attend, problems, training_only, drop_training_only)


def _convert_autoregressive(model, xt, xt_attend, problems: _Problems, training_only: list[str],
                            drop_training_only: bool) -> AutoregressiveWrapper:
    """x-transformers' ``AutoregressiveWrapper``: its net converted, the same loss options."""
    plan = _check_autoregressive(model, xt, xt_attend, problems, training_only)
    _raise_problems(problems, training_only, drop_training_only)
    net = _build_wrapper(plan, xt)
    problems.raise_if_any()
    loss_options = {k: getattr(model, k) for k in ("next_embed_loss_weight", "looped_loss_threshold_exit",
                                                   "looped_loss_slope", "looped_exit_loss_weight") if hasattr(model, k)}
    sf = AutoregressiveWrapper(net, ignore_index=model.ignore_index, pad_value=model.pad_value, **loss_options)
    sf.train(model.training)
    return sf


def _convert_net(model, xt, xt_attend, problems: _Problems, training_only: list[str], drop_training_only: bool):
    """A continuous wrapper, a bare stack or a ``TransformerWrapper`` (anything else: ``TypeError``)."""
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
