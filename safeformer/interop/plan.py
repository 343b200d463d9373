"""The plan of a conversion for ``from_x_transformers`` (``convert``): checks, then safeformer's keywords.

``_plan_wrapper`` checks an x-transformers ``TransformerWrapper`` (recording every problem, see ``checks``) in
three passes, the wrapper (``_check_wrapper``), the stack (``_check_stack``) and its layers (``_check_layers``),
and turns what they found into the keywords of the safeformer stack (``_stack_kwargs``, one phase per option
family) and wrapper (``_wrapper_kwargs``): a ``_Plan``, which ``build`` turns into the model.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..nn.modules import alibi_slopes
from ..stack.layers import CrossAttender, Decoder, Encoder
from ..stack.wrappers import xt_wrapper_option_kwargs
from .checks import (
    _RMS_EPS,
    _TALKING_HEADS,
    _TYPE_OPTIONS,
    _AttnOptions,
    _check_attention,
    _check_module_types,
    _ff_no_bias,
    _norm_kind,
    _parse_ff,
    _Problems,
    _unwrap,
)


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


@dataclass(frozen=True)
class _WrapperInfo:
    """What ``_check_wrapper`` found in the wrapper, for the plan."""

    num_memory_tokens: int
    tied: bool
    to_logits: Any  # the output head (the first of several), or None
    has_abs: bool
    l2norm_embed: bool
    ff_deep: bool
    pool_kwargs: dict | None
    extra: dict  # wrapper keywords read as they are


@dataclass(frozen=True)
class _StackInfo:
    """What ``_check_stack`` found in the stack (options, layer pattern, positions), for the plan."""

    types: tuple
    cross: bool
    only_cross: bool
    rotary: Any  # x-transformers' RotaryEmbedding, or None
    rotary_dim: int | None
    rotary_opts: dict
    alibi: bool
    alibi_opts: dict
    routing: dict
    polar: bool
    t5_opts: dict
    block: tuple


@dataclass(frozen=True)
class _BranchInfo:
    """The branch wrappers and norm placement every layer shares (``_branch_info``)."""

    scale: float
    macaron: bool
    layerscale: bool
    adaptive_layerscale: bool
    sandwich_norm: bool
    pre_norm: bool
    post_norms: bool
    shifts: list[int]


@dataclass(frozen=True)
class _LayersInfo:
    """What ``_check_layers`` found in the layers, for the plan."""

    norm_kinds: set[str]
    attn_shapes: set[tuple]
    attn_opts: dict[int, _AttnOptions]
    cross_dims: set[int]
    mem_kv: dict[str, set[int]]
    attn_dropouts: set[float]
    drops: dict[str, list[float]]
    ff_ok: list[dict]
    wrappers: _BranchInfo
    cond_width: int | None
    self_scoring: tuple
    inverted: list[bool]


@dataclass(frozen=True)
class _Scan:
    """What the per-layer checks read besides the layer: x-transformers' modules, the stack, the problems."""

    xt: Any
    xt_attend: Any
    dim: int
    causal: bool
    problems: _Problems
    training_only: list[str]


@dataclass
class _LayerTally:
    """What ``_check_layers`` gathers layer by layer, to check across the layers."""

    norm_kinds: set[str] = field(default_factory=set)
    attn_shapes: set[tuple] = field(default_factory=set)
    attn_keys: set[tuple] = field(default_factory=set)
    attn_opts: dict[int, _AttnOptions] = field(default_factory=dict)
    mem_kv: dict[str, set[int]] = field(default_factory=lambda: {"a": set(), "c": set()})
    cross_dims: set[int] = field(default_factory=set)
    attn_dropouts: set[float] = field(default_factory=set)
    drops: dict[str, list[float]] = field(default_factory=lambda: {"a": [], "c": []})  # per layer, self and cross
    self_scoring: set[tuple] = field(default_factory=set)
    inverted: list[bool] = field(default_factory=list)  # per cross-attention block
    ff_infos: list[dict | None] = field(default_factory=list)
    present: dict[str, set[bool]] = field(
        default_factory=lambda: {"pre": set(), "sandwich": set(), "post": set(), "layerscale": set()})
    scales: dict[str, set[float]] = field(default_factory=lambda: {"attn": set(), "ff": set()})
    shifts: list[int] = field(default_factory=list)
    adaptive_gates: set[bool] = field(default_factory=set)
    cond_width: int | None = None


def _check_wrapper(model, xt, problems: _Problems, training_only: list[str], dim: int) -> _WrapperInfo:
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
    if type(model.post_emb_norm).__name__ == "LayerNorm" and isinstance(getattr(model.post_emb_norm, "gamma", None),
                                                                        nn.Parameter):
        extra["post_emb_norm"] = True  # gamma copied by _build_wrapper (unit offset folded in)
    elif type(model.post_emb_norm).__name__ != "Identity":
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
    if getattr(model, "emb_frac_gradient", 1.0) != 1.0:  # the same gradient scale (the forward is unchanged)
        extra["emb_frac_gradient"] = float(model.emb_frac_gradient)
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
    return _WrapperInfo(num_memory_tokens=num_memory_tokens, tied=tied, to_logits=to_logits, has_abs=has_abs,
                        l2norm_embed=l2norm_embed, ff_deep=ff_deep, pool_kwargs=pool_kwargs, extra=extra)


def _check_stack(layers, xt, problems: _Problems, training_only: list[str], has_abs: bool) -> _StackInfo:
    """The stack's options and layer pattern, its relative positions; returns what the plan reads."""
    routing = _routing_options(layers, xt, problems)
    for attr in ("residual_attn", "cross_residual_attn"):  # no parameters: the options as they are
        if getattr(layers, attr, False):
            routing[attr] = True
    if getattr(layers, "softclamp_output", False):
        routing.update(softclamp_output=True, softclamp_output_value=float(layers.softclamp_output_value))
    rel_pos = getattr(layers, "rel_pos", None)
    alibi = rel_pos is not None and type(rel_pos) is xt.AlibiPositionalBias
    t5_opts = _relative_bias_options(layers, rel_pos, alibi, xt, problems, has_abs)
    polar = getattr(layers, "polar_pos_emb", None)
    _check_polar(polar, problems, has_abs)
    if any(p > 0 for p in getattr(layers, "layer_dropouts", ())):
        training_only.append("layer_dropout")
    if getattr(layers, "cross_attn_tokens_dropout", 0) > 0:
        training_only.append("cross_attn_tokens_dropout")
    types = tuple(layers.layer_types)
    cross = "c" in types
    only_cross = cross and "a" not in types
    block = ("c", "f") if only_cross else (("a", "c", "f") if cross else ("a", "f"))

    rotary = layers.rotary_pos_emb
    rotary_dim, rotary_opts = _rotary_options(rotary, problems, has_abs)
    alibi_opts = _alibi_options(rel_pos, rotary, problems) if alibi else {}
    return _StackInfo(types=types, cross=cross, only_cross=only_cross, rotary=rotary, rotary_dim=rotary_dim,
                      rotary_opts=rotary_opts, alibi=alibi, alibi_opts=alibi_opts, routing=routing,
                      polar=polar is not None, t5_opts=t5_opts, block=block)


def _relative_bias_options(layers, rel_pos, alibi: bool, xt, problems: _Problems, has_abs: bool) -> dict:
    """The stack keywords of a T5 (``rel_pos_bias``) or dynamic position bias; any other relative bias refused."""
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
    return t5_opts


def _check_polar(polar, problems: _Problems, has_abs: bool) -> None:
    """PoPE (``polar_pos_emb``): finite frequencies and no absolute positions beside it. Its learned per-head key
    bias (query heads permuted) and its ``inv_freq`` buffer (any base, or edited frequencies) are copied by
    ``_build_wrapper``."""
    if polar is not None:
        if not torch.isfinite(polar.inv_freq.detach()).all():
            problems.add("polar_pos_emb with non-finite frequencies (inv_freq)")
        if has_abs:
            problems.add("polar_pos_emb with the absolute position embedding (disable_abs_pos_emb=False): safeformer "
                         "drops it next to relative positions")


def _rotary_options(rotary, problems: _Problems, has_abs: bool) -> tuple[int | None, dict]:
    """``(rotary_emb_dim, the other rotary keywords)`` of x-transformers' rotary embedding (``(None, {})`` without)."""
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
        # (frequencies that are no geometric series of one base, edited ones, are copied as they are: _build_wrapper)
        base = float(inv[1] ** (-rotary_dim / 2)) if rotary_dim > 2 and float(inv[1]) > 0 else 10000.0
        if not torch.isfinite(inv).all() or not math.isfinite(base) or base <= 0:
            problems.add("rotary frequencies (inv_freq) that are not finite")
        elif not math.isclose(base, 10000.0, rel_tol=1e-6):
            rotary_opts["rotary_theta"] = base
        if has_abs:
            problems.add("absolute and rotary positions together (disable_abs_pos_emb=False with rotary)")
    return rotary_dim, rotary_opts


def _alibi_options(rel_pos, rotary, problems: _Problems) -> dict:
    """The ALiBi keywords beyond ``alibi_pos_bias`` (``alibi_num_heads``, custom slopes); rotary beside it refused."""
    alibi_opts: dict = {}
    # the first rel_pos.heads heads take the slopes, the others none (alibi_num_heads, rel_pos_kwargs)
    slopes = rel_pos.slopes.detach().double().cpu().flatten()
    if rel_pos.heads != rel_pos.total_heads:
        alibi_opts["alibi_num_heads"] = int(rel_pos.heads)
    if not torch.allclose(slopes, alibi_slopes(rel_pos.heads).double(), rtol=1e-6, atol=0):
        alibi_opts["rel_pos_kwargs"] = {"slopes": slopes.tolist()}
    if rotary is not None:
        problems.add("rotary_pos_emb and alibi_pos_bias together (safeformer takes one relative position scheme)")
    return alibi_opts


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


def _check_layers(layers, xt, xt_attend, types: tuple, dim: int, problems: _Problems, training_only: list[str],
                  routing: dict) -> _LayersInfo:
    """Per layer: norms, residuals, attention and feed-forward blocks, which must agree across layers (but for
    the per-layer feed-forward widths and dropouts, and the self-attention dropouts)."""
    scan = _Scan(xt=xt, xt_attend=xt_attend, dim=dim, causal=layers.causal, problems=problems,
                 training_only=training_only)
    tally = _LayerTally()
    for k, ((pre, post_branch, post_main), wrapped, _) in enumerate(layers.layers):
        name = f"attn_layers.layers.{k}"
        kind = types[k] if k < len(types) else "?"
        _tally_norms(scan, tally, name, (("pre", pre), ("sandwich", post_branch), ("post", post_main)))
        w = _unwrap(wrapped, xt)
        blk = w.inner
        _tally_branch_wrappers(scan, tally, name, kind, w)
        if kind in ("a", "c") and type(blk) is xt.Attention:
            _tally_attention(scan, tally, name, kind, k, blk)
        elif kind == "f" and type(blk) is xt.FeedForward:
            tally.ff_infos.append(_parse_ff(name, blk, xt, problems, training_only))
    wrappers = _branch_info(tally, problems)
    _check_final_norm(layers.final_norm, xt, tally, problems)
    _check_layers_agree(tally, problems)
    ff_ok = [f for f in tally.ff_infos if f is not None]
    _check_feed_forwards(ff_ok, dim, problems)
    return _LayersInfo(norm_kinds=tally.norm_kinds, attn_shapes=tally.attn_shapes, attn_opts=tally.attn_opts,
                       cross_dims=tally.cross_dims, mem_kv=tally.mem_kv, attn_dropouts=tally.attn_dropouts,
                       drops=tally.drops, ff_ok=ff_ok, wrappers=wrappers, cond_width=tally.cond_width,
                       self_scoring=next(iter(tally.self_scoring), ()), inverted=tally.inverted)


def _tally_norms(scan: _Scan, tally: _LayerTally, name: str, norms: tuple) -> None:
    """One layer's norms (pre, sandwich, post; each ``(what, module or None)``): their kinds and presence."""
    for what, norm in norms:
        tally.present[what].add(norm is not None)
        if norm is None:
            continue
        nk = _norm_kind(norm, scan.xt)
        if nk is not None and nk.startswith("ada_"):
            tally.cond_width = int(norm.to_gamma.in_features)
        if nk is None:
            scan.problems.add(f"{_TYPE_OPTIONS.get(type(norm).__name__, type(norm).__name__)}", name)
        else:
            tally.norm_kinds.add(nk)
            if nk in ("layer", "ada_layer") and norm.ln.eps != 1e-5:
                scan.problems.add(f"a LayerNorm eps {norm.ln.eps} != 1e-5", name)


def _tally_branch_wrappers(scan: _Scan, tally: _LayerTally, name: str, kind: str, w) -> None:
    """One layer's branch wrappers (``_unwrap``): its scale, layer scale and token shifts."""
    tally.scales["ff" if kind == "f" else "attn"].add(w.scale)
    tally.present["layerscale"].add(w.layerscale is not None)
    if w.layerscale is not None:
        tally.adaptive_gates.add(type(w.layerscale) is not scan.xt.LayerScale)
        if hasattr(w.layerscale, "to_gamma"):
            tally.cond_width = int(w.layerscale.to_gamma.in_features)
    amount = max((abs(t) for t in w.shifts), default=0)
    if w.shifts and tuple(w.shifts) != tuple(range(0 if scan.causal else -amount, amount + 1)):
        scan.problems.add(f"shift_tokens with shifts {w.shifts}", name)
    tally.shifts.append(amount)


def _tally_attention(scan: _Scan, tally: _LayerTally, name: str, kind: str, k: int, blk) -> None:
    """One self- (``kind`` "a") or cross-attention (``kind`` "c"): its options, shape, dropout and context width."""
    problems, dim = scan.problems, scan.dim
    opts = _check_attention(name, blk, scan.xt, scan.xt_attend, problems, scan.training_only)
    tally.attn_opts[k] = opts
    tally.mem_kv[kind].add(opts.mem_kv)  # may differ between the kinds (x-transformers' cross_attn_num_mem_kv)
    tally.attn_keys.add(replace(opts, mem_kv=0).key())
    if kind == "a":
        tally.self_scoring.add(opts.self_scoring)
    else:
        tally.inverted.append(opts.inverted)
    dh = blk.to_q.out_features // blk.heads
    tally.attn_shapes.add((blk.heads, blk.kv_heads, dh))
    tally.attn_dropouts.add(blk.attend.dropout)
    tally.drops[kind].append(float(blk.attend.dropout))
    dv = blk.to_v.out_features // blk.kv_heads
    if dv != dh:  # attn_value_dim_head
        opts.value_dim_head = dv
    out = blk.to_out[0] if isinstance(blk.to_out, nn.Sequential) else blk.to_out
    out_features = (out.out_features // (2 if out is not blk.to_out else 1)) if isinstance(out, nn.Linear) \
        else blk.heads * dv
    if out_features != dim:
        problems.add(f"attn_dim_out={out_features} != dim", name)
    if kind == "a":
        kv_in = blk.to_latent_kv if getattr(blk, "to_latent_kv", None) is not None else blk.to_k
        if kv_in.in_features != dim:
            problems.add("attn_dim_context on self-attention", name)
        if blk.causal != scan.causal:
            problems.add(f"a self-attention with causal={blk.causal} in a stack with causal={scan.causal}", name)
    else:
        tally.cross_dims.add(
            (blk.to_latent_kv if getattr(blk, "to_latent_kv", None) is not None else blk.to_k).in_features)
        if blk.causal:
            problems.add("a causal cross-attention", name)


def _branch_info(tally: _LayerTally, problems: _Problems) -> _BranchInfo:
    """The branch wrappers and norm placement every layer must share (one branch scale, macaron's half of it)."""
    present, scales = tally.present, tally.scales
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
    adaptive_gates = tally.adaptive_gates
    return _BranchInfo(scale=attn_scale, macaron=macaron, layerscale=present["layerscale"] == {True},
                       adaptive_layerscale=bool(adaptive_gates) and adaptive_gates == {True},
                       sandwich_norm=present["sandwich"] == {True}, pre_norm=present["pre"] != {False},
                       post_norms=present["post"] == {True}, shifts=tally.shifts)


def _check_final_norm(final, xt, tally: _LayerTally, problems: _Problems) -> None:
    """The stack's final norm: a known kind (counted with the others) or none (``Identity``)."""
    if _norm_kind(final, xt) is None:
        if type(final).__name__ == "Identity":
            pass  # pre_norm_has_final_norm=False or pre_and_post_norm (post-norm is refused above)
        else:
            problems.add(_TYPE_OPTIONS.get(type(final).__name__, type(final).__name__), "attn_layers.final_norm")
    else:
        tally.norm_kinds.add(_norm_kind(final, xt))


def _check_layers_agree(tally: _LayerTally, problems: _Problems) -> None:
    """The norms and attentions of every layer must agree (one kind, shape, option set and context width)."""
    if len(tally.norm_kinds) > 1:
        problems.add(f"LayerNorm and RMS norms mixed ({sorted(tally.norm_kinds)})")
    if len(tally.attn_shapes) > 1:
        problems.add(f"attention layers of different (heads, kv_heads, dim_head): {sorted(tally.attn_shapes)}")
    if len(tally.attn_keys) > 1:
        problems.add(f"attention layers that differ in (qk_norm, num_mem_kv, head_learned_sink, logit softclamp, gates): "
                     f"{sorted(tally.attn_keys, key=repr)}")
    for kind, counts in tally.mem_kv.items():
        if len(counts) > 1:
            problems.add(f"{'self' if kind == 'a' else 'cross'}-attention layers with different num_mem_kv: {sorted(counts)}")
    if len(tally.self_scoring) > 1:
        problems.add(f"self-attention layers with different CoPE / relative projection bias options: "
                     f"{sorted(tally.self_scoring, key=repr)}")
    if len(tally.cross_dims) > 1:
        problems.add(f"cross-attention layers of different context widths: {sorted(tally.cross_dims)}")


def _check_feed_forwards(ff_ok: list[dict], dim: int, problems: _Problems) -> None:
    """The parsed feed-forwards must agree (but for widths and dropouts), with biases and widths safeformer builds."""
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
    st = _check_stack(layers, xt, problems, training_only, w.has_abs)
    ly = _check_layers(layers, xt, xt_attend, st.types, dim, problems, training_only, st.routing)
    heads, kv_heads, dim_head = next(iter(ly.attn_shapes)) if ly.attn_shapes else (1, 1, dim)

    # ---- the safeformer configuration
    stack_kwargs = _stack_kwargs(layers, xt, st, ly, (heads, kv_heads, dim_head), problems)
    layers_cls = CrossAttender if st.only_cross else (Decoder if layers.causal else Encoder)
    if not st.only_cross:
        stack_kwargs.update(cross_attend=st.cross)
    wrapper_kwargs = _wrapper_kwargs(model, xt, w)
    return _Plan(
        model=model, problems=problems, layers_cls=layers_cls, stack_kwargs=stack_kwargs, wrapper_kwargs=wrapper_kwargs,
        types=st.types, heads=heads, kv_heads=kv_heads, dim_head=dim_head, tied=w.tied, attn_opts=ly.attn_opts,
    )


def _stack_kwargs(layers, xt, st: _StackInfo, ly: _LayersInfo, shape: tuple[int, int, int], problems: _Problems) -> dict:
    """The safeformer stack's keywords (but ``cross_attend``), phase by phase, in the order the checks found them."""
    opts0 = next(iter(ly.attn_opts.values()), _AttnOptions())
    ff0 = ly.ff_ok[0] if ly.ff_ok else None
    stack_kwargs, cross_dropout = _core_kwargs(layers.dim, shape, ly, st.only_cross, problems)
    stack_kwargs.update(st.routing)
    _branch_kwargs(stack_kwargs, layers, st, ly, problems)
    _norm_placement_kwargs(stack_kwargs, layers, st, ly.wrappers, problems)
    _position_kwargs(stack_kwargs, st, ly, cross_dropout, layers.dim)
    _qk_value_kwargs(stack_kwargs, layers, opts0, ly.attn_opts)
    _ff_kwargs(stack_kwargs, ff0)
    _attention_kwargs(stack_kwargs, st, ly, opts0, problems)
    _attention_module_kwargs(stack_kwargs, layers, xt, ly, opts0)
    return stack_kwargs


def _core_kwargs(dim: int, shape: tuple[int, int, int], ly: _LayersInfo, only_cross: bool,
                 problems: _Problems) -> tuple[dict, float | None]:
    """``(the widths, heads, feed-forward multipliers, dropouts and norm keywords, the cross-attention dropout)``."""
    heads, kv_heads, dim_head = shape
    norm_kinds, ff_ok = ly.norm_kinds, ly.ff_ok
    ff0 = ff_ok[0] if ff_ok else None
    mults = []
    for hidden in [f["out"].in_features for f in ff_ok] or [4 * dim]:
        mults.append(hidden / dim)
        if int(dim * mults[-1]) != hidden:
            problems.add(f"a feed-forward hidden width {hidden} that is not int(dim * mult) for any float mult")
    ff_mult = mults[0] if len(set(mults)) == 1 else tuple(mults)  # per layer (x-transformers' ff_mult sequence)
    ff_drops = [float(f["dropout"]) for f in ff_ok] or [0.0]
    ff_dropout = ff_drops[0] if len(set(ff_drops)) == 1 else tuple(ff_drops)
    attn_dropout, cross_dropout = _attn_dropouts(ly.drops, only_cross, problems)
    rms = norm_kinds == {"rms"}
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
    return stack_kwargs, cross_dropout


def _branch_kwargs(stack_kwargs: dict, layers, st: _StackInfo, ly: _LayersInfo, problems: _Problems) -> None:
    """The layer pattern and depth, the branch scale, macaron, sandwich norms, layer scales and their condition."""
    wr = ly.wrappers
    pattern, stack_kwargs["depth"] = _layer_pattern(layers, st.types, st.block, wr.macaron)
    stack_kwargs.update(pattern)
    if wr.scale != 1.0:  # a float branch scale: with a learned residual scale x-transformers' float scale_residual
        stack_kwargs["scale_residual" if st.routing.get("scale_residual") else "depth_scale_residual"] = wr.scale
    for key in ("macaron", "sandwich_norm"):
        if getattr(wr, key):
            stack_kwargs[key] = True
    if wr.layerscale:
        stack_kwargs["use_adaptive_layerscale" if wr.adaptive_layerscale else "use_layerscale"] = True
    norm_kinds = ly.norm_kinds
    ada = len(norm_kinds) == 1 and next(iter(norm_kinds)).startswith("ada_")
    if ada or wr.adaptive_layerscale:  # the condition's width (before x-transformers' adaptive_condition_mlp)
        mlp = getattr(layers, "adaptive_mlp", None)
        if isinstance(mlp, nn.Sequential):
            first = mlp[0]
            stack_kwargs.update(dim_condition=int(first.in_features), adaptive_condition_mlp=True,
                                adaptive_condition_mlp_expansion=int(first.out_features // first.in_features))
            if first.out_features % first.in_features or first.bias is not None or len(mlp) != 2 \
                    or not isinstance(mlp[1], nn.SiLU):
                problems.add("adaptive_condition_mlp of another shape")
        elif ly.cond_width is not None:
            stack_kwargs.update(dim_condition=ly.cond_width)


def _norm_placement_kwargs(stack_kwargs: dict, layers, st: _StackInfo, wr: _BranchInfo, problems: _Problems) -> None:
    """Pre- or post-norm, the token shifts and whether a pre-norm stack has its final norm."""
    if not wr.pre_norm:  # post-norm: the norms after each residual update (no final norm)
        stack_kwargs["pre_norm"] = False
        if not wr.post_norms:
            problems.add("no pre-norm and no post-norm")
    elif wr.post_norms and not st.routing.get("pre_and_post_norm"):
        problems.add("post-norms without pre_and_post_norm")
    if any(wr.shifts):
        shifts = wr.shifts
        stack_kwargs["shift_tokens"] = shifts[0] if len(set(shifts)) == 1 else tuple(shifts)
    if type(layers.final_norm).__name__ == "Identity" and wr.pre_norm and not st.routing.get("pre_and_post_norm"):
        stack_kwargs.update(pre_norm_has_final_norm=False)


def _position_kwargs(stack_kwargs: dict, st: _StackInfo, ly: _LayersInfo, cross_dropout: float | None,
                     dim: int) -> None:
    """The cross-attention dropout and context width, and the position keywords (rotary, ALiBi, PoPE, T5)."""
    if cross_dropout is not None:  # x-transformers' cross_attn_dropout
        stack_kwargs.setdefault("cross_attn_kwargs", {})["dropout"] = cross_dropout
    if st.rotary is not None:
        stack_kwargs.update(rotary_pos_emb=True, rotary_emb_dim=st.rotary_dim, **st.rotary_opts)
    if st.alibi:
        stack_kwargs.update(alibi_pos_bias=True, **dict(st.alibi_opts))
    if st.polar:
        stack_kwargs.update(polar_pos_emb=True)
    stack_kwargs.update(st.t5_opts)
    if st.cross:
        stack_kwargs.update(dim_context=next(iter(ly.cross_dims), dim))


def _qk_value_kwargs(stack_kwargs: dict, layers, opts0: _AttnOptions, attn_opts: dict[int, _AttnOptions]) -> None:
    """The qk-norm, value norm and value residual keywords."""
    if opts0.qk_norm or opts0.value_rmsnorm or opts0.qk_rmsnorm or opts0.k_rmsnorm:  # x-transformers l2-normalises
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
    if opts0.qk_rmsnorm or opts0.k_rmsnorm:
        stack_kwargs.update({"attn_qk_rmsnorm" if opts0.qk_rmsnorm else "attn_k_rmsnorm": True})
    if getattr(layers, "add_value_residual", False):
        stack_kwargs.update(add_value_residual=True,
                            learned_value_residual_mix=any(o.value_mix for o in attn_opts.values()))


def _ff_kwargs(stack_kwargs: dict, ff0: dict | None) -> None:
    """The feed-forward keywords of the first feed-forward (the others agree: checked by ``_check_feed_forwards``)."""
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


def _attention_kwargs(stack_kwargs: dict, st: _StackInfo, ly: _LayersInfo, opts0: _AttnOptions,
                      problems: _Problems) -> None:
    """The attention keywords: ALiBi's data-dependent gates, projected values, memory, sinks and scoring functions."""
    cross, only_cross = st.cross, st.only_cross
    if opts0.dd_alibi:
        if cross:
            problems.add("attn_data_dependent_alibi with cross-attention (safeformer biases self-attention only)")
        stack_kwargs.update(dict(opts0.dd_alibi))
    if opts0.orthog:
        if cross:
            problems.add("attn_orthog_projected_values with cross-attention (safeformer projects self-attention only)")
        stack_kwargs.update(dict(opts0.orthog))
    self_mem, cross_mem = (max(ly.mem_kv[k], default=0) for k in ("a", "c"))
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
    for key, value in (("attn_on_attn", opts0.on_attn or None), ("attn_value_dim_head", opts0.value_dim_head),
                       ("attn_custom_attn_fn", opts0.custom_fn)):
        if value is not None:
            stack_kwargs[key] = value
    if opts0.softclamp is not None:
        stack_kwargs.update(attn_softclamp_logits=True, attn_logit_softclamp_value=opts0.softclamp)


def _attention_module_kwargs(stack_kwargs: dict, layers, xt, ly: _LayersInfo, opts0: _AttnOptions) -> None:
    """The gates, the scoring options, the hybrid module and the inverted cross-attention keywords."""
    stack_kwargs.update(dict(opts0.gates))
    stack_kwargs.update(dict(opts0.scoring))
    if opts0.hybrid:  # the module itself: every layer's copy gets its own weights in _build_wrapper
        fold, mask_kwarg, learned_mix, _ = opts0.hybrid
        first = next(_unwrap(blk, xt).inner for k, (_, blk, _) in enumerate(layers.layers) if k in ly.attn_opts)
        stack_kwargs.update(attn_hybrid_module=copy.deepcopy(first.hybrid_module.fn), attn_hybrid_fold_axial_dim=fold,
                            attn_hybrid_mask_kwarg=mask_kwarg, attn_hybrid_learned_mix=learned_mix)
    stack_kwargs.update(dict(ly.self_scoring))
    if any(ly.inverted):
        inv = ly.inverted
        stack_kwargs.update(cross_attn_inverted_attention=True if all(inv) else tuple(inv))


def _wrapper_kwargs(model, xt, w: _WrapperInfo) -> dict:
    """The safeformer wrapper's keywords."""
    to_logits = w.to_logits
    num_tokens = model.token_emb.emb.num_embeddings if isinstance(model.token_emb, xt.TokenEmbedding) else 1
    logits_dim = to_logits.out_features if isinstance(to_logits, nn.Linear) else num_tokens
    wrapper_kwargs = dict(
        num_tokens=num_tokens, max_seq_len=model.max_seq_len,
        emb_dropout=model.emb_dropout.p, use_abs_pos_emb=w.has_abs, logits_dim=logits_dim if logits_dim != num_tokens else None,
    )
    if to_logits is None:
        wrapper_kwargs.update(return_only_embed=True)
    if w.tied:
        wrapper_kwargs.update(tie_embedding=True, tie_embedding_scale=float(model.tie_embedding_scale))
    if w.num_memory_tokens:
        wrapper_kwargs.update(num_memory_tokens=w.num_memory_tokens)
    if w.l2norm_embed:
        wrapper_kwargs.update(l2norm_embed=True)
    if getattr(model, "cls_token", None) is not None:
        wrapper_kwargs.update(use_cls_token=True, num_cls_tokens=int(model.cls_token.shape[0]))
    if getattr(model, "average_pool_embed", False):
        wrapper_kwargs.update(average_pool_embed=True)
    if getattr(model, "max_mem_len", 0):  # Transformer-XL memories (the stack checks what runs beside them)
        wrapper_kwargs.update(max_mem_len=int(model.max_mem_len), shift_mem_down=int(getattr(model, "shift_mem_down", 0)))
    if w.ff_deep:
        wrapper_kwargs.update(ff_deep_embed=True)
    if w.pool_kwargs is not None:
        wrapper_kwargs.update(w.pool_kwargs)
    wrapper_kwargs.update(w.extra)
    return wrapper_kwargs


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
