"""Building blocks: norms, feed-forward, positional schemes, and the ``Attention`` module.

Shape legend: b batch, n sequence positions, h query heads, h_kv key/value heads, i queries, j keys,
d head dim, c model width, c_ctx context width.

Masks follow safeformer's one convention (bool, True = may attend / is real); see ``masks.py``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .options import Options

__all__ = [
    "grow_linear_biases",
    "TokenEmbedding",
    "RMSNorm",
    "Derf",
    "AdaptiveNorm",
    "AdaptiveRMSNorm",
    "make_norm",
    "FeedForward",
    "AbsolutePositionalEmbedding",
    "RotaryEmbedding",
    "PolarEmbedding",
    "apply_polar_pos_emb",
    "apply_rotary",
    "alibi_slopes",
    "alibi_bias",
    "stack_alibi_slopes",
    "positions_from_mask",
]


class RMSNorm(nn.Module):
    """RMS normalisation with a learned gain ``g`` (x-transformers' name); statistics in float32 (S7).

    x-transformers' constructor: ``RMSNorm(dim, unit_offset=False)``; with ``unit_offset`` the gain is
    stored as ``g + 1`` (initialised at 0, so weight decay pulls it towards the identity).
    """

    def __init__(self, dim: int, unit_offset: bool = False, *, eps: float = 1e-6):
        super().__init__()
        if isinstance(unit_offset, float) and not isinstance(unit_offset, bool):  # the old positional eps
            raise TypeError("RMSNorm's second argument is unit_offset (x-transformers' order); pass eps=... by name")
        self.eps = eps
        self.unit_offset = bool(unit_offset)
        self.scale = dim**0.5  # x-transformers' attribute (its F.normalize(x) * sqrt(dim) is this norm)
        self.g = nn.Parameter(torch.full((dim,), 0.0 if unit_offset else 1.0))
        self._register_load_state_dict_pre_hook(_rename_keys({"weight": "g"}))  # its weight was stored as g is

    @property
    def weight(self) -> Tensor:
        """The effective gain ``g + unit_offset`` (``g`` itself without the offset)."""
        return self.g + 1.0 if self.unit_offset else self.g

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (self.g.to(xf.dtype) + float(self.unit_offset))).to(x.dtype)


def grow_linear_biases(*names: str):
    """A load-state-dict pre-hook (``with_module=True``) for checkpoints of earlier safeformer whose ``nn.Linear``
    children ``names`` had a bias where x-transformers' have none: a saved bias makes the layer grow one."""

    def hook(module: nn.Module, state_dict, prefix, *_args) -> None:
        for name in names:
            lin = getattr(module, name, None)
            if isinstance(lin, nn.Linear) and lin.bias is None and prefix + name + ".bias" in state_dict:
                lin.bias = nn.Parameter(lin.weight.new_zeros(lin.out_features))

    return hook


def _rename_keys(names: dict[str, str], *, prefixes: bool = False):
    """A load-state-dict pre-hook reading a checkpoint of earlier safeformer: each ``prefix + old`` key (when the
    new one is absent) under its new name; with ``prefixes``, every key starting ``prefix + old`` moved under
    ``prefix + new``."""

    def hook(state_dict, prefix, *_args) -> None:
        for old, new in names.items():
            if prefixes:
                for key in [k for k in state_dict if k.startswith(prefix + old)]:
                    state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)
            elif prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)

    return hook


class HeadRMSNorm(nn.Module):
    """RMS normalisation of ``x (..., h, d)`` over ``d`` with a learned gain per head, x-transformers'
    ``MultiheadRMSNorm`` parameter ``gamma (h, 1, d)``; statistics in float32 (S7). ``init``: the gain's initial
    value; with ``unit_offset`` the gain is ``gamma + 1`` (``gamma`` starting at 0, as there)."""

    def __init__(self, heads: int, dim: int, *, eps: float = 1e-6, init: float = 1.0, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = bool(unit_offset)
        self.gamma = nn.Parameter(torch.full((heads, 1, dim), 0.0 if unit_offset else float(init)))
        self._register_load_state_dict_pre_hook(_legacy_head_gain)

    @property
    def weight(self) -> Tensor:
        """The stored gain as ``(h, d)`` (a view of ``gamma``)."""
        return self.gamma[:, 0]

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (self.gamma[:, 0].to(xf.dtype) + float(self.unit_offset))).to(x.dtype)


def _legacy_head_gain(state_dict, prefix, *_args) -> None:
    """Earlier safeformer stored the per-head gain as ``weight (h, d)``: it is ``gamma (h, 1, d)``."""
    if prefix + "weight" in state_dict and prefix + "gamma" not in state_dict:
        state_dict[prefix + "gamma"] = state_dict.pop(prefix + "weight").unsqueeze(1)


class DynamicTanh(nn.Module):
    """x-transformers' ``DynamicTanh`` (a norm-free replacement of the norms): ``tanh(a * x) * gamma + beta``
    with a learned scalar ``a`` (``pre_tanh_scale``, ``init_alpha`` at init), in float32 (S7); the same parameter
    names, so x-transformers' weights load as they are. Elementwise: a zero row stays ``beta``, finite. With
    ``unit_offset`` (x-transformers' ``norm_add_unit_offset``) the scale and gain are stored as offsets from
    ``init_alpha`` and 1 (both start at 0)."""

    def __init__(self, dim: int, init_alpha: float = 1.0, unit_offset: bool = False):
        super().__init__()
        self.pre_tanh_scale_offset = float(init_alpha) if unit_offset else 0.0
        self.gamma_offset = float(unit_offset)
        self.pre_tanh_scale = nn.Parameter(torch.tensor(0.0 if unit_offset else float(init_alpha)))
        self.gamma = nn.Parameter(torch.full((dim,), 1.0 - float(unit_offset)))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        a = self.pre_tanh_scale.to(dtype) + self.pre_tanh_scale_offset
        out = torch.tanh(x.to(dtype) * a) * (self.gamma.to(dtype) + self.gamma_offset) + self.beta.to(dtype)
        return out.to(x.dtype)


class Derf(nn.Module):
    """x-transformers' ``Derf`` (https://arxiv.org/abs/2512.10938, a norm-free replacement of the norms):
    ``erf(alpha * x + s) * gamma + beta`` with learned scalars ``alpha`` (``init_alpha``, 0.5) and ``s``
    (``init_bias``, 0), in float32 (S7). With ``unit_offset`` (x-transformers' ``norm_add_unit_offset``) ``alpha``
    and ``gamma`` are stored minus 1, as there. Elementwise: a zero row stays ``erf(s) * gamma + beta``, finite."""

    def __init__(self, dim: int, init_alpha: float = 0.5, init_bias: float = 0.0, unit_offset: bool = False):
        super().__init__()
        self.scale_offset = 1.0 if unit_offset else 0.0
        self.alpha = nn.Parameter(torch.tensor(float(init_alpha) - self.scale_offset))
        self.s = nn.Parameter(torch.tensor(float(init_bias)))
        self.gamma = nn.Parameter(torch.full((dim,), 1.0 - self.scale_offset))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        o = self.scale_offset
        out = torch.erf(x.to(dtype) * (self.alpha.to(dtype) + o) + self.s.to(dtype)) * (self.gamma.to(dtype) + o) \
            + self.beta.to(dtype)
        return out.to(x.dtype)


class TorchLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (parameters ``weight`` / ``bias``) with its statistics (and their gradients) computed in
    float32 (S7): where x-transformers uses ``nn.LayerNorm`` itself (a hyper-connection's norm).

    PyTorch's CPU kernel keeps a half-precision input's mean and inverse std in half precision, which
    makes the gradients of inputs of large magnitude several tolerances off.
    """

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        w = None if self.weight is None else self.weight.to(dtype)
        b = None if self.bias is None else self.bias.to(dtype)
        return F.layer_norm(x.to(dtype), self.normalized_shape, w, b, self.eps).to(x.dtype)


def _offset_gain(module: nn.Module, gain: Tensor, unit_offset: bool) -> Tensor:
    """``gain + 1`` with ``unit_offset`` (else ``gain``). Without autograd (inference, decoding) the sum is kept
    on ``module`` and recomputed only when ``gain`` changes (its version counter moves with every in-place update,
    an optimizer step included), so a decode step does not add it again per norm call."""
    if not unit_offset:
        return gain
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or gain.is_inference():
        return gain + 1.0  # (an inference tensor has no version counter to key the kept sum on)
    key = (gain, gain._version, gain.device, gain.dtype)
    kept = module.__dict__.get("_offset_gain_kept")
    if kept is None or kept[0][0] is not gain or kept[0][1:] != key[1:]:
        with torch.no_grad():
            kept = (key, gain + 1.0)
        module.__dict__["_offset_gain_kept"] = kept
    return kept[1]


class LayerNorm(nn.Module):
    """x-transformers' bias-free ``LayerNorm(dim, unit_offset=False)``: ``layer_norm(x) * (gamma + unit_offset)``,
    its parameter named ``gamma`` as there; statistics (and their gradients) in float32 (S7), one fused kernel.

    Args:
        dim: features.
        unit_offset: ``gamma`` is stored minus 1 (initialised at 0).
        eps: the variance epsilon (1e-5, as ``nn.LayerNorm``).
        bias: a learned shift ``bias`` as well (not in x-transformers; checkpoints of earlier safeformer, whose
            norms had one, load into a norm that grows it).
    """

    def __init__(self, dim: int, unit_offset: bool = False, *, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.unit_offset = bool(unit_offset)
        self.eps = float(eps)
        self.normalized_shape = (dim,)
        self.ln = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)  # x-transformers' child (no parameters)
        self.gamma = nn.Parameter(torch.full((dim,), 1.0 - float(unit_offset)))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self._register_load_state_dict_pre_hook(_legacy_layer_norm, with_module=True)

    @property
    def weight(self) -> Tensor:
        """The effective gain ``gamma + unit_offset``."""
        return self.gamma + float(self.unit_offset) if self.unit_offset else self.gamma

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.gamma.dtype == torch.float32:  # nothing to promote: the same bits
            return F.layer_norm(x, self.normalized_shape, _offset_gain(self, self.gamma, self.unit_offset), self.bias,
                                self.eps)
        dtype = torch.promote_types(x.dtype, torch.float32)
        b = None if self.bias is None else self.bias.to(dtype)
        return F.layer_norm(x.to(dtype), self.normalized_shape, self.weight.to(dtype), b, self.eps).to(x.dtype)


def _legacy_layer_norm(module: LayerNorm, state_dict, prefix, *_args) -> None:
    """Earlier safeformer's norms were ``nn.LayerNorm``s: ``weight`` is ``gamma``, and a saved ``bias`` makes this
    norm grow one (its outputs stay those of the saved model)."""
    if prefix + "weight" in state_dict and prefix + "gamma" not in state_dict:  # stored without the unit offset
        state_dict[prefix + "gamma"] = state_dict.pop(prefix + "weight") - float(module.unit_offset)
    if prefix + "bias" in state_dict and module.bias is None:
        module.bias = nn.Parameter(torch.zeros_like(module.gamma))


def make_norm(dim: int, use_rmsnorm: bool, eps: float | None = None, unit_offset: bool = False) -> nn.Module:
    if use_rmsnorm:
        return RMSNorm(dim, unit_offset, eps=1e-6 if eps is None else eps)
    return LayerNorm(dim, unit_offset, eps=1e-5 if eps is None else eps)


class AdaptiveNorm(nn.Module):
    """Adaptive normalisation (x-transformers' ``AdaptiveLayerNorm`` / ``AdaptiveRMSNorm``): a LayerNorm or RMSNorm
    without its own gain, scaled by a projection of a condition: ``norm(x) * (1 + to_gamma(c))``.

    The projection starts at zero, so an untrained layer is the plain norm. Statistics in float32 (S7). A
    checkpoint of earlier safeformer, whose adaptive LayerNorm also shifted by ``to_beta(c)``, loads with that
    shift.

    Args:
        dim: features c.
        dim_condition: the condition's width K.
        rms: RMSNorm instead of LayerNorm (no shift then, as RMSNorm has none).
        eps: the norm's epsilon.
    """

    def __init__(self, dim: int, dim_condition: int, *, rms: bool = False, eps: float | None = None):
        super().__init__()
        self.rms = rms
        self.eps = (1e-6 if rms else 1e-5) if eps is None else eps
        self.ln = None if rms else nn.LayerNorm(dim, elementwise_affine=False, eps=self.eps)  # x-transformers' child
        self.to_gamma = nn.Linear(dim_condition, dim, bias=False)
        self.to_beta = None  # x-transformers' AdaptiveLayerNorm has no shift; earlier safeformer's checkpoints grow it
        nn.init.zeros_(self.to_gamma.weight)
        self._register_load_state_dict_pre_hook(_legacy_adaptive_shift, with_module=True)

    def forward(self, x: Tensor, condition: Tensor) -> Tensor:
        """``x (b, n, c)``, ``condition (b, K)`` -> ``(b, n, c)``."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        if self.rms:
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            mean = xf.mean(-1, keepdim=True)
            normed = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + self.eps)
        per = (lambda t: t) if x.dim() == 2 else (lambda t: t[:, None])  # packed (T, c) rows: one condition each
        out = normed * (1 + per(self.to_gamma(condition).to(xf.dtype)))  # (b, 1, c) per sample
        if self.to_beta is not None:
            out = out + per(self.to_beta(condition).to(xf.dtype))
        return out.to(x.dtype)


def _legacy_adaptive_shift(norm: AdaptiveNorm, state_dict, prefix, *_args) -> None:
    """Earlier safeformer's adaptive LayerNorm had a shift ``to_beta``: a checkpoint holding one grows it."""
    if prefix + "to_beta.weight" in state_dict and norm.to_beta is None:
        w = state_dict[prefix + "to_beta.weight"]
        norm.to_beta = nn.Linear(w.shape[1], w.shape[0], bias=False, device=norm.to_gamma.weight.device,
                                 dtype=norm.to_gamma.weight.dtype)


class AdaptiveRMSNorm(AdaptiveNorm):
    """x-transformers' ``AdaptiveRMSNorm(dim, dim_condition=None)``: RMSNorm without a gain, scaled by
    ``1 + W c`` (``W`` starts at zero). ``forward(x (b, n, c), condition=(b, K) or (b, n, K))``.

    Statistics in float32 (S7); ``eps`` (default 1e-6) sits where x-transformers' ``F.normalize`` clamps the
    norm at 1e-12, so the two agree to about 1e-6 relative for rows of ordinary size, and a row of zeros
    (padding) stays exactly 0 in both.
    """

    def __init__(self, dim: int, dim_condition: int | None = None, *, eps: float | None = None):
        super().__init__(dim, dim if dim_condition is None else dim_condition, rms=True, eps=eps)

    def forward(self, x: Tensor, condition: Tensor) -> Tensor:
        if not isinstance(condition, Tensor) or condition.dim() not in (2, 3) or condition.shape[0] != x.shape[0]:
            raise ValueError(f"condition must have shape (b={x.shape[0]}, dim_condition) or (b, n, dim_condition), "
                             f"got {getattr(condition, 'shape', type(condition))}")
        if condition.dim() == 3 and x.dim() == 3:  # one condition per position
            xf = x.to(torch.promote_types(x.dtype, torch.float32))
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1 + self.to_gamma(condition).to(xf.dtype))).to(x.dtype)
        return super().forward(x, condition)


@dataclass(frozen=True)
class FeedForwardOptions(Options):
    """``FeedForward``'s keywords beside its four positional ones (x-transformers' names; their meanings are in
    ``FeedForward``'s docstring): the feed-forward family, checked once when made; the stack's ``ff_<name>``
    spellings and ``FeedForward``'s signature are read from these fields."""

    swish: bool = False
    relu_squared: bool = False
    dropout: float = 0.0
    no_bias: bool = False
    zero_init_output: bool = False
    softclamp_value: float | None = None
    custom_activation: Callable | None = None
    glu_softclamp: bool = False
    glu_gate_softclamp_value: float | None = None
    glu_up_softclamp_value: float | None = None
    glu_mult_bias: bool = False
    solu: bool = False
    post_act_ln: bool = False
    sublayer_dropout: float = 0.0
    output_proj_depth: int | None = None


class FeedForward(nn.Module):
    """Position-wise feed-forward: GELU MLP, or gated GEGLU / SwiGLU.

    x-transformers' constructor (its order for the first arguments): ``FeedForward(dim, dim_out=None,
    mult=4, glu=False, ...)``.

    Args:
        dim: input width.
        dim_out: output width (default ``dim``).
        mult: hidden width multiplier.
        glu: gate the hidden layer (GEGLU, or SwiGLU with ``swish=True``).
        swish: use SiLU instead of GELU as the activation.
        relu_squared: use ``relu(x) ** 2`` as the activation.
        dropout: dropout on the hidden layer.
        no_bias: no biases in the projections (as in x-transformers, a gated input projection keeps its bias).
        zero_init_output: the output projection starts at zero (the branch starts as an exact no-op).
        softclamp_value: ``tanh(h / v) * v`` on the hidden layer before the activation (x-transformers' name).
            With ``glu`` x-transformers ignores it: so does this module, with a ``UserWarning`` (see ``glu_softclamp``).
        custom_activation: a module (deep-copied) or function used as the activation instead of GELU / SiLU /
            ReLU² (x-transformers' ``custom_activation``); it must map finite inputs to finite outputs.
        glu_softclamp: with ``glu`` (GELU or SiLU), x-transformers' situ-GLU: ``softclamp(up, glu_up_softclamp_value)
            * softclamp(gate, glu_gate_softclamp_value) * Phi(gate)`` (``sigmoid(gate)`` for SiLU); the values default
            to 4 (gate) and 25 (up), as there. Given without ``glu_softclamp`` they do nothing (as in x-transformers),
            with a ``UserWarning``.
        glu_mult_bias: with ``glu``, a learned per-feature gain (``mult_bias``, ones at init) on the gated hidden
            layer (x-transformers' ``GLU(mult_bias=True)``).
        solu: the SoLU activation, ``LayerNorm(softmax(h) * h)`` over the hidden features (bias-free LayerNorm
            with a learned gain ``solu_norm``; x-transformers' ``SoLU``).
        post_act_ln: a bias-free LayerNorm (gain ``post_act_norm``) on the hidden layer after the activation.
        sublayer_dropout: dropout on the output (after the output projection).
        output_proj_depth: the output projection initialised with OLMo's depth-scaled normal, std
            ``(2 * hidden * output_proj_depth) ** -0.5`` (ignored with ``zero_init_output``, as in x-transformers).
    """

    def __init__(self, dim: int, dim_out: int | None = None, mult: float = 4, glu: bool = False, **options):
        super().__init__()
        if not isinstance(glu, bool):
            raise TypeError(f"ff glu must be True or False, got {glu!r}")
        if isinstance(mult, bool) or not isinstance(mult, (int, float)):
            raise TypeError(f"ff mult must be a number, got {mult!r}")
        self.options = FeedForwardOptions.of("FeedForward", options)  # checked once (the signature: below the class)
        self._build(dim, dim_out, mult, glu, self.options)

    def _build(self, dim: int, dim_out: int | None, mult: float, glu: bool, o: FeedForwardOptions) -> None:
        """The parts of a feed-forward of ``o``'s options, checked."""
        import warnings

        for name, v in (("softclamp_value", o.softclamp_value), ("glu_gate_softclamp_value", o.glu_gate_softclamp_value),
                        ("glu_up_softclamp_value", o.glu_up_softclamp_value)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise ValueError(f"ff {name} must be a positive finite number, got {v!r}")
        if o.softclamp_value is not None and glu:
            warnings.warn("ff softclamp_value has no effect with glu (x-transformers ignores it there too); "
                          "ff_glu_softclamp clamps a gated feed-forward", UserWarning, stacklevel=4)
        self.softclamp_value = None if o.softclamp_value is None or glu else float(o.softclamp_value)
        if mult <= 0:
            raise ValueError(f"ff mult must be positive, got {mult}")
        if sum(map(bool, (o.swish, o.relu_squared, o.solu, o.custom_activation is not None))) > 1:
            raise ValueError("choose one activation: swish, relu_squared, solu or custom_activation")
        if o.glu_mult_bias and not glu:
            raise ValueError("ff glu_mult_bias is the gain of a gated feed-forward: it needs glu=True")
        for name, p in (("dropout", o.dropout), ("sublayer_dropout", o.sublayer_dropout)):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise ValueError(f"ff {name} must be a probability in [0, 1), got {p!r}")
        if o.output_proj_depth is not None and (isinstance(o.output_proj_depth, bool) or not isinstance(o.output_proj_depth, int)
                                              or o.output_proj_depth < 1):
            raise ValueError(f"ff output_proj_depth must be a positive integer, got {o.output_proj_depth!r}")
        if o.custom_activation is not None and not callable(o.custom_activation):
            raise TypeError(f"ff custom_activation must be a module or a function, got {type(o.custom_activation).__name__}")
        if o.glu_softclamp and (not glu or o.relu_squared or o.custom_activation is not None):
            raise ValueError("ff glu_softclamp clamps the gate of a GELU / SiLU gated feed-forward: it needs glu=True "
                             "and no relu_squared / custom_activation")
        if not o.glu_softclamp and (o.glu_gate_softclamp_value is not None or o.glu_up_softclamp_value is not None):
            warnings.warn("ff glu_gate_softclamp_value / glu_up_softclamp_value have no effect without glu_softclamp "
                          "(as in x-transformers)", UserWarning, stacklevel=4)
        self.glu_softclamp = (float(4.0 if o.glu_gate_softclamp_value is None else o.glu_gate_softclamp_value),
                              float(25.0 if o.glu_up_softclamp_value is None else o.glu_up_softclamp_value)) \
            if o.glu_softclamp else None
        inner = int(dim * mult)
        self.glu = glu
        if o.custom_activation is not None:
            act = deepcopy(o.custom_activation) if isinstance(o.custom_activation, nn.Module) else _Lambda(o.custom_activation)
        else:
            act = nn.SiLU() if o.swish else _ReluSquared() if o.relu_squared else _SoLU(inner) if o.solu else nn.GELU()
        # x-transformers' module tree: ff = Sequential(project_in, [LayerNorm], Dropout, Linear, [Dropout]), project_in
        # a GLU (proj, mult_bias; its input projection always has a bias) or Sequential(Linear, [softclamp], act)
        if glu:
            project_in = _GLU(dim, inner, act, o.glu_mult_bias)
        else:
            clamp = [_Lambda(partial(_softclamp, value=self.softclamp_value))] if self.softclamp_value is not None else []
            project_in = nn.Sequential(nn.Linear(dim, inner, bias=not o.no_bias), *clamp, act)
        proj_out = nn.Linear(inner, dim if dim_out is None else dim_out, bias=not o.no_bias)
        self.ff = nn.Sequential(*[m for m in (project_in, LayerNorm(inner) if o.post_act_ln else None, nn.Dropout(o.dropout),
                                              proj_out, nn.Dropout(o.sublayer_dropout) if o.sublayer_dropout > 0 else None)
                                  if m is not None])
        self._register_load_state_dict_pre_hook(_legacy_feed_forward, with_module=True)
        if o.zero_init_output:
            nn.init.zeros_(proj_out.weight)
            if proj_out.bias is not None:
                nn.init.zeros_(proj_out.bias)
        elif o.output_proj_depth is not None:  # OLMo's depth-scaled init (x-transformers' init_depth_scaled_)
            nn.init.normal_(proj_out.weight, std=(2 * inner * o.output_proj_depth) ** -0.5)

    # the parts, by what they are (x-transformers' positions in ``ff`` depend on the options)
    @property
    def proj_in(self) -> nn.Linear:
        return self.ff[0].proj if self.glu else self.ff[0][0]

    @property
    def act(self) -> nn.Module:
        return self.ff[0].act if self.glu else self.ff[0][-1]

    @property
    def proj_out(self) -> nn.Linear:
        return next(m for m in self.ff if isinstance(m, nn.Linear))

    @property
    def mult_bias(self) -> nn.Parameter | None:
        return self.ff[0].mult_bias if self.glu else None

    @property
    def solu_norm(self) -> Tensor | None:
        act = self.act
        return act.norm.gamma if isinstance(act, _SoLU) else None

    @property
    def post_act_norm(self) -> Tensor | None:
        return self.ff[1].gamma if isinstance(self.ff[1], LayerNorm) else None

    @property
    def sublayer_dropout(self) -> nn.Dropout | None:
        return self.ff[-1] if isinstance(self.ff[-1], nn.Dropout) and self.ff[-1] is not self.dropout else None

    @property
    def dropout(self) -> nn.Dropout:
        return self.ff[2] if isinstance(self.ff[1], LayerNorm) else self.ff[1]

    def muon_parameters(self) -> list[nn.Parameter]:
        """The matrices Muon should optimise (x-transformers' ``muon_parameters``): every linear layer's weight."""
        return [m.weight for m in self.modules() if isinstance(m, nn.Linear)]

    def step_plan(self) -> tuple | None:
        """What a decode step may run as three functions (``F.linear``, the activation, ``F.linear`` on the layers'
        own parameters, the same bits): ``(proj_in, act, proj_out)`` where this is a plain MLP in evaluation (no gate,
        clamp, SoLU or post-activation norm, a GELU / SiLU / ReLU, plain ``nn.Linear``, idle dropouts, no hooks on
        the parts), else ``None``. The decode step reads it once per cache, for a net without hooks."""
        if self.training or self.glu or self.softclamp_value is not None or self.solu_norm is not None \
                or self.post_act_norm is not None or len(self.ff) != 3:
            return None
        pi, act, po = self.proj_in, self.act, self.proj_out
        parts = (pi, act, po, self.ff[0], self.ff[1])
        if type(pi) is not nn.Linear or type(po) is not nn.Linear or type(act) not in (nn.GELU, nn.SiLU, nn.ReLU) \
                or any(m._forward_hooks or m._forward_pre_hooks for m in parts):
            return None
        return pi, act, po

    def forward(self, x: Tensor, deep_embed: Tensor | None = None) -> Tensor:
        """The feed-forward of ``x (..., dim)``.

        Args:
            x: the input.
            deep_embed: x-transformers' deep embedding of this block: a multiplier of the output (after the output
                projection and its dropout), any floating shape that broadcasts to the output's without growing it,
                e.g. ``(b, n, dim_out)``: the wrapper's ``ff_deep_embed`` rows of this block for the tokens. The
                product follows torch's type promotion, as in x-transformers.
        """
        h = self._hidden(x)
        for i, m in enumerate(self.ff):  # after the input part: [LayerNorm], dropout, projection, [dropout]
            if i:
                h = m(h)
        if deep_embed is not None:
            h = h * _checked_deep_embed(deep_embed, h)
        return h

    def _hidden(self, x: Tensor) -> Tensor:
        """The input part of ``ff`` (``ff[0]``): the projection, the activation or gate, ``mult_bias``."""
        h = self.proj_in(x)
        if self.glu:
            h, gate = h.chunk(2, dim=-1)
            if self.glu_softclamp is not None:  # situ-GLU: both factors soft-clamped
                g, u = self.glu_softclamp
                gate_p = torch.special.ndtr(gate) if isinstance(self.act, nn.GELU) else torch.sigmoid(gate)
                h = torch.tanh(h / u) * u * (torch.tanh(gate / g) * g * gate_p)
            else:
                h = h * self.act(gate)
            mult_bias = self.ff[0].mult_bias
            if mult_bias is not None:
                h = h * mult_bias
        else:
            for i, m in enumerate(self.ff[0]):  # after the projection: the soft clamp, then the activation
                if i:
                    h = m(h)
        return h


# the signature read from the family's fields (x-transformers' keywords, their defaults and types)
FeedForward.__init__.__signature__ = inspect.signature(FeedForward.__init__).replace(parameters=[
    *[p for p in inspect.signature(FeedForward.__init__).parameters.values() if p.kind != p.VAR_KEYWORD],
    *FeedForwardOptions.parameters()])


def _checked_deep_embed(deep_embed, out: Tensor) -> Tensor:
    """``FeedForward.forward``'s ``deep_embed`` checked against the block's output ``out``: a floating tensor on its
    device whose shape broadcasts to ``out``'s without growing it."""
    if not isinstance(deep_embed, Tensor):
        raise TypeError(f"FeedForward deep_embed must be a tensor, got {type(deep_embed).__name__}")
    if not deep_embed.is_floating_point():
        raise TypeError(f"FeedForward deep_embed must be a floating-point tensor, got dtype {deep_embed.dtype}")
    try:
        fits = torch.broadcast_shapes(deep_embed.shape, out.shape) == out.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"FeedForward deep_embed of shape {tuple(deep_embed.shape)} does not broadcast to the "
                         f"output's shape {tuple(out.shape)} (e.g. (b, n, dim_out))")
    if deep_embed.device != out.device:
        raise ValueError(f"FeedForward deep_embed is on {deep_embed.device}, expected {out.device}")
    return deep_embed


def _legacy_feed_forward(ff: FeedForward, state_dict, prefix, *_args) -> None:
    """Earlier safeformer's ``FeedForward`` held ``proj_in``, ``mult_bias``, ``solu_norm``, ``post_act_norm`` and
    ``proj_out`` itself: their keys moved into x-transformers' ``ff`` (a gated ``no_bias`` input projection saved
    without its bias reads as a zero bias)."""
    if not any(k.startswith(prefix) and k[len(prefix):].split(".")[0] in
               ("proj_in", "proj_out", "mult_bias", "solu_norm", "post_act_norm") for k in state_dict):
        return
    names = {id(p): n for n, p in ff.named_parameters()}
    moves = {"proj_in.weight": ff.proj_in.weight, "proj_in.bias": ff.proj_in.bias, "mult_bias": ff.mult_bias,
             "solu_norm": ff.solu_norm, "post_act_norm": ff.post_act_norm, "proj_out.weight": ff.proj_out.weight,
             "proj_out.bias": ff.proj_out.bias}
    for old, param in moves.items():
        if param is not None and prefix + old in state_dict:
            state_dict[prefix + names[id(param)]] = state_dict.pop(prefix + old)
    bias = ff.proj_in.bias
    if ff.glu and prefix + "proj_in.weight" not in state_dict and prefix + names[id(bias)] not in state_dict:
        state_dict[prefix + names[id(bias)]] = torch.zeros_like(bias)


class _GLU(nn.Module):
    """x-transformers' ``GLU`` parameters (``proj``, ``mult_bias``) for ``FeedForward(glu=True)``; the feed-forward
    computes (it also runs the situ-GLU clamp)."""

    def __init__(self, dim: int, inner: int, act: nn.Module, mult_bias: bool):
        super().__init__()
        self.act = act
        self.proj = nn.Linear(dim, inner * 2)
        self.mult_bias = nn.Parameter(torch.ones(inner)) if mult_bias else None


class _SoLU(nn.Module):
    """x-transformers' ``SoLU``: ``LayerNorm(softmax(h) * h)`` over the hidden features (its ``norm.gamma``); the
    softmax in float32 or wider (S7)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = LayerNorm(dim)

    def forward(self, h: Tensor) -> Tensor:
        wide = h.to(torch.promote_types(h.dtype, torch.float32))
        return self.norm((wide.softmax(dim=-1) * wide).to(h.dtype))


def _softclamp(t: Tensor, value: float) -> Tensor:
    return torch.tanh(t / value) * value


def _gain_layer_norm(x: Tensor, gain: Tensor, eps: float = 1e-5) -> Tensor:
    """x-transformers' bias-free ``LayerNorm``: ``layer_norm(x) * gain``, statistics in float32 (S7)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return (F.layer_norm(x.to(wide), x.shape[-1:], eps=eps) * gain.to(wide)).to(x.dtype)


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


class _ReluSquared(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


def positions_from_mask(mask: Tensor | None, n: int, device, offset: Tensor | None = None) -> Tensor:
    """Position of each token counting only real tokens: ``(b, n)`` (or ``(1, n)`` without a mask).

    Position p is the p-th real token of its sample, so left padding does not shift positions (S4).
    Padded positions get the position of the last real token before them (0 before any); they are
    masked anyway.
    ``offset`` ``(b,)`` adds the real tokens already seen (a KV cache).
    """
    if mask is None:
        pos = torch.arange(n, device=device)[None, :]
    else:
        pos = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    if offset is not None:
        pos = pos + offset[:, None]
    return pos


class TokenEmbedding(nn.Module):
    """The wrapper's token embedding as x-transformers holds it: ``emb`` (an ``nn.Embedding``; key
    ``token_emb.emb.weight``), ``weight`` being its table. ``forward(ids)`` looks the ids up (the wrapper normalises
    with ``l2norm_embed`` itself). A checkpoint of earlier safeformer (``token_emb.weight``) loads."""

    def __init__(self, dim: int, num_tokens: int):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)
        self._register_load_state_dict_pre_hook(_rename_keys({"weight": "emb.weight"}))

    @property
    def weight(self) -> nn.Parameter:
        return self.emb.weight

    @property
    def num_embeddings(self) -> int:
        return self.emb.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.emb.embedding_dim

    def forward(self, x: Tensor) -> Tensor:
        return self.emb(x)


class AbsolutePositionalEmbedding(nn.Module):
    """Learned absolute positions (x-transformers' module): ``emb`` (``nn.Embedding(max_seq_len, dim)``), scaled by
    ``dim ** -0.5``; with ``l2norm_embed`` each position's vector is L2-normalised instead of scaled (the wrapper
    initialises the table with std 1e-5 then, as x-transformers' ``TransformerWrapper`` does).

    ``forward(x, pos=None, seq_start_pos=None, offset=0)`` is x-transformers' call; ``embed_positions(positions)``
    is the stacks' (per-sample positions, e.g. real tokens counted under left padding).
    """

    def __init__(self, dim: int, max_seq_len: int, l2norm_embed: bool = False):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.l2norm_embed = l2norm_embed
        self.scale = 1.0 if l2norm_embed else dim**-0.5
        self.emb = nn.Embedding(max_seq_len, dim)
        if l2norm_embed:
            nn.init.normal_(self.emb.weight, std=1e-5)

    def forward(self, x: Tensor, pos: Tensor | None = None, seq_start_pos: Tensor | None = None,
                offset: int = 0) -> Tensor:
        """x-transformers' call: the embeddings of the positions of ``x``'s ``n = x.shape[1]`` positions.

        Args:
            x: the sequence (token ids ``(b, n)`` or embeddings ``(b, n, c)``): only its length ``n`` (at most
                ``max_seq_len``) and device are read.
            pos: integer positions (e.g. ``(b, n)`` or ``(n,)``), each in ``[0, max_seq_len)``; default
                ``arange(n) + offset``.
            seq_start_pos: ``(b,)`` integer: each sample starts at this index (left padding before it):
                positions become ``max(pos - seq_start_pos, 0)``.
            offset: added to the default positions (ignored when ``pos`` is given, as in x-transformers).

        Returns:
            ``emb(pos) * scale`` (L2-normalised with ``l2norm_embed``): ``(n, dim)`` for the default positions,
            ``pos``'s shape plus ``dim`` otherwise (``(b, n, dim)`` with ``seq_start_pos``).
        """
        if not isinstance(x, Tensor) or x.dim() < 2:
            raise ValueError(f"x must be a tensor of shape (b, n, ...), got {getattr(x, 'shape', type(x))}")
        n = x.shape[1]
        if n > self.max_seq_len:
            raise ValueError(f"x has {n} positions but the absolute positional embedding has max_seq_len "
                             f"{self.max_seq_len}")
        if pos is None:
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
            if offset + n > self.max_seq_len:
                raise ValueError(f"offset {offset} + {n} positions exceeds max_seq_len {self.max_seq_len}")
            pos = torch.arange(n, device=x.device) + offset
        else:
            _check_int_tensor(pos, "pos")
        if seq_start_pos is not None:
            _check_int_tensor(seq_start_pos, "seq_start_pos")
            pos = (pos - seq_start_pos[..., None]).clamp(min=0)
        if pos.numel() and bool(((pos < 0) | (pos >= self.max_seq_len)).any()):
            raise ValueError(f"{'pos' if seq_start_pos is None else 'pos - seq_start_pos'} must lie in "
                             f"[0, max_seq_len={self.max_seq_len}), got values from {int(pos.min())} to {int(pos.max())}")
        return self._embed(pos)

    def embed_positions(self, positions: Tensor) -> Tensor:
        """The stacks' call: the embeddings ``(b, n, dim)`` of per-sample ``positions (b|1, n)``; positions past
        the table take its last row."""
        return self._embed(positions.clamp(max=self.max_seq_len - 1))

    def _embed(self, pos: Tensor) -> Tensor:
        out = self.emb(pos) * self.scale
        return l2norm(out) if self.l2norm_embed else out


def _check_int_tensor(t, name: str) -> None:
    """``t`` is an integer (not bool) tensor, else a ``TypeError`` naming ``name``."""
    if not isinstance(t, Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")


class ScaledSinusoidalPositions(nn.Module):
    """x-transformers' ``ScaledSinusoidalEmbedding`` on per-sample positions ``(b|1, n)``: ``cat(sin(p * f),
    cos(p * f)) * scale`` with ``f = 10000 ** (-k / (dim / 2))`` and one learned ``scale`` (``dim ** -0.5`` at init;
    its state-dict key is x-transformers' ``scale``); angles in float32."""

    def __init__(self, dim: int, theta: float = 10000):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
            raise ValueError(f"scaled_sinu_pos_emb needs an even embedding width, got {dim!r}")
        self.scale = nn.Parameter(torch.ones(1) * dim**-0.5)
        half = dim // 2
        self.register_buffer("inv_freq", theta ** -(torch.arange(half).float() / half), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # (b|1, n, dim / 2)
        return torch.cat((angles.sin(), angles.cos()), dim=-1) * self.scale

    def embed_positions(self, positions: Tensor) -> Tensor:
        """The stacks' call (as ``AbsolutePositionalEmbedding.embed_positions``): per-sample positions ``(b|1, n)``."""
        return self.forward(positions)


def l2norm(t: Tensor, eps: float = 1e-12) -> Tensor:
    """``t / max(||t||, eps)`` over the last dim, computed in float32 or wider (a zero vector stays 0)."""
    tf = t.to(torch.promote_types(t.dtype, torch.float32))
    return F.normalize(tf, dim=-1, eps=eps).to(t.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on the first ``dim`` features of each head (interleaved pairs).

    x-transformers' constructor and calls: ``RotaryEmbedding(dim, use_xpos=False, scale_base=512,
    interpolation_factor=1., base=10000, base_rescale_factor=1.)``; ``forward(t)`` takes positions ``(n,)``
    or ``(b, n)`` and returns ``(freqs (b|1, n, dim), scale)``, ``scale`` being 1, or with ``use_xpos`` xpos'
    ``(b|1, n, dim)`` scales ``s ** ((t - c) / scale_base)``, ``s = (2k + 0.4 dim) / (1.4 dim)`` per pair ``k`` and
    ``c = (max(t) + 1) // 2``; ``forward_from_seq_len(n)`` is ``forward(arange(n))``. ``apply_rotary(t, freqs,
    scale)`` rotates with them (x-transformers' ``apply_rotary_pos_emb``; queries take ``scale``, keys
    ``scale ** -1``, so a logit decays as ``s ** ((t_i - t_j) / scale_base)``: the center cancels). Angles and
    scales are computed in float32 (float64 for float64 positions requested through ``angles``), never lower (S7).

    ``theta`` is safeformer's name for ``base``. The angles read the persistent ``inv_freq`` buffer (x-transformers'
    state, ``frequencies``), so a loaded checkpoint's frequencies (a rescaled base, edited values) are the ones used.
    """

    def __init__(self, dim: int, use_xpos: bool = False, scale_base: float = 512, interpolation_factor: float = 1.0,
                 base: float = 10000.0, base_rescale_factor: float = 1.0, *, theta: float | None = None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim % 2 != 0 or dim <= 0:
            raise ValueError(f"rotary_emb_dim must be a positive even number, got {dim}")
        if not isinstance(use_xpos, bool):
            raise TypeError(f"use_xpos must be a bool, got {use_xpos!r}")
        if use_xpos and (isinstance(scale_base, bool) or not isinstance(scale_base, (int, float))
                         or not math.isfinite(scale_base) or scale_base <= 0):
            raise ValueError(f"the xpos scale_base (rotary_xpos_scale_base) must be a positive finite number, got "
                             f"{scale_base!r}")
        self.use_xpos, self.scale_base = use_xpos, float(scale_base)
        if not interpolation_factor >= 1.0:
            raise ValueError(f"interpolation_factor must be at least 1, got {interpolation_factor}")
        if theta is not None:
            if base != 10000.0:
                raise ValueError("pass theta or base (x-transformers' name for it), not both")
            base = theta
        if base_rescale_factor != 1.0:
            if dim <= 2:
                raise ValueError("base_rescale_factor needs a rotary dim above 2")
            base = base * base_rescale_factor ** (dim / (dim - 2))
        self.dim, self.theta = dim, float(base)
        self.interpolation_factor = float(interpolation_factor)
        # x-transformers' persistent buffers (its state-dict keys); the angles read inv_freq (``frequencies``), in
        # float32 or wider whatever dtype it was cast to
        self.register_buffer("inv_freq", _rotary_inv_freq(dim, self.theta, torch.float32))
        self.register_buffer("scale", (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim) if use_xpos else None)
        self._register_load_state_dict_pre_hook(_own_buffers_if_missing, with_module=True)

    def angles(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``positions (b, n)`` -> angles ``(b, 1, n, dim)`` in ``dtype`` (float32, or float64 for a
        float64 model); never lower, whatever dtype the module's buffers were cast to. What the stack uses."""
        dtype = torch.promote_types(dtype, torch.float32)
        freqs = positions.to(dtype)[..., None] * self.frequencies(dtype).to(positions.device)  # (b, n, dim/2)
        if self.interpolation_factor != 1.0:
            freqs = freqs / self.interpolation_factor
        freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # (b, n, dim)
        return freqs[:, None]

    def frequencies(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The ``inv_freq (dim/2,)`` buffer's frequencies in ``dtype`` (float32 or wider), what the angles use: a
        checkpoint's edited frequencies (a rescaled base) count, as in x-transformers. Where the buffer holds the
        constructor's value (``theta ** (-2k / dim)``: equal to within the rounding of the buffer's dtype, at least
        two float32 ulps, as computed on another device) that value is computed in ``dtype`` itself, so a float64
        model keeps float64 angles and a buffer cast below float32 (``.half()``) still gives float32 ones (S7);
        selected per element, no host sync."""
        dtype = torch.promote_types(dtype, torch.float32)
        buf = self.inv_freq
        exact = _rotary_inv_freq(self.dim, self.theta, dtype, buf.device)
        made = exact if dtype == torch.float32 else _rotary_inv_freq(self.dim, self.theta, torch.float32, buf.device)
        tol = max(torch.finfo(buf.dtype).eps, 2.0**-22)
        same = (buf.to(torch.float32) - made).abs() <= made * tol
        return torch.where(same, exact, buf.to(dtype))

    def xpos_scale(self, positions: Tensor, dtype: torch.dtype = torch.float32, per_sample: bool = True) -> Tensor:
        """xpos' query scales ``(b|1, 1, n, dim)`` for ``positions (b|1, n)``: ``s ** ((t - c) / scale_base)`` with
        ``c = (max(t) + 1) // 2`` per sample (``per_sample``; else over all of ``positions``, as x-transformers'
        module does). Keys take the inverse."""
        dtype = torch.promote_types(dtype, torch.float32)
        base = (torch.arange(0, self.dim, 2, device=positions.device, dtype=dtype) + 0.4 * self.dim) / (1.4 * self.dim)
        top = positions.amax(dim=-1, keepdim=True) if per_sample else positions.amax()
        power = (positions - (top + 1) // 2).to(dtype) / self.scale_base  # (b, n)
        scale = base ** power[..., None]  # (b, n, dim/2)
        return torch.stack((scale, scale), dim=-1).flatten(-2)[:, None]

    def forward(self, t: Tensor, offset: int = 0, *, dtype: torch.dtype | None = None):
        """x-transformers' call: positions ``t (n,)`` or ``(b, n)`` -> ``(freqs (b|1, n, dim), scale)`` in
        float32 (``scale``: 1, or xpos' ``(b|1, n, dim)``). (``dtype=...``: the stack's older call,
        ``angles(t, dtype)``.)"""
        if dtype is not None:
            return self.angles(t, dtype)
        if not isinstance(t, Tensor) or t.dim() not in (1, 2) or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"positions t must be an integer tensor of shape (n,) or (b, n), got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if offset != 0:
            raise ValueError("offset is not applied by x-transformers' RotaryEmbedding either; add it to the positions")
        t2 = t if t.dim() == 2 else t[None]
        return self.angles(t2)[:, 0], (self.xpos_scale(t2, per_sample=False)[:, 0] if self.use_xpos else 1.0)

    def forward_from_seq_len(self, seq_len: int):
        """``forward(arange(seq_len))``: ``(freqs (1, seq_len, dim), 1.)``."""
        return self.forward(torch.arange(seq_len))


def _rotary_inv_freq(dim: int, theta: float, dtype: torch.dtype, device=None) -> Tensor:
    """Rotary frequencies ``theta ** (-2k / dim)``, ``k < dim / 2``, computed in ``dtype`` (x-transformers' formula)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=dtype) / dim))


def _own_buffers_if_missing(module: nn.Module, state_dict, prefix, *_args) -> None:
    """A checkpoint of earlier safeformer holds no ``inv_freq`` / ``scale`` buffers: read as the module's own."""
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set and prefix + name not in state_dict:
            state_dict[prefix + name] = buf


class PolarAngles:
    """The stack's PoPE form for ``apply_rotary``: angles ``(b|1, h|1, n, d)`` and a gain on the result (the queries'
    ``sqrt(2)`` keeps the logit scale at ``d ** -0.5`` although PoPE doubles the features to ``2 d``)."""

    __slots__ = ("freqs", "gain")

    def __init__(self, freqs: Tensor, gain: float = 1.0):
        self.freqs, self.gain = freqs, gain


def _polar_inv_freq(dim: int, base: float, device=None) -> Tensor:
    """PoPE's frequencies ``base ** (-k / dim)``, ``k < dim``, as x-transformers computes them (float32)."""
    return 1.0 / (base ** (torch.arange(0, dim, device=device).float() / dim))


def _polar_inv_freq_if_missing(module: nn.Module, state_dict, prefix, *_args) -> None:
    """A ``PolarEmbedding`` checkpoint of earlier safeformer holds no ``inv_freq``: read the constructor's."""
    if prefix + "inv_freq" not in state_dict:
        buf = module.inv_freq
        state_dict[prefix + "inv_freq"] = _polar_inv_freq(module.dim, module.base, buf.device).to(buf.dtype)


class PolarEmbedding(nn.Module):
    """x-transformers' ``PolarEmbedding(dim, heads, bias_uniform_init=False, base=10000)`` (PoPE,
    https://arxiv.org/abs/2509.10534): a head's ``d`` features become ``2 d``, ``softplus(t) * cos(f)`` and
    ``softplus(t) * sin(f)`` with ``f = position * base ** (-k / d)`` per feature ``k``; keys' angles add a learned
    per-head ``learned_bias (h, 1, d)``, clamped to ``[-2 pi, 0]``. Values keep ``d`` features. Computed in float32
    or wider (S7); ``softplus`` is finite for every finite input.

    ``forward(t)`` (positions ``(n,)`` or ``(b, n)``) returns x-transformers' ``(freqs (b|1, n, d), bias)``;
    ``apply_polar_pos_emb(t, freqs)`` applies them; ``pair(positions, dtype)`` is the stack's form.

    State: x-transformers' ``learned_bias`` and its persistent ``inv_freq (d,)`` buffer (the frequencies
    ``base ** (-k / d)`` computed in float32); the angles use the buffer's values, so a checkpoint holding other
    frequencies gives x-transformers' numbers. A checkpoint of earlier safeformer without the buffer reads the
    constructor's frequencies. Cast below float32 (``.half()``), a buffer still holding the constructor's values
    (rounded) is read as them in float32 (S7); other values are read as rounded.
    """

    def __init__(self, dim: int, heads: int, bias_uniform_init: bool = False, base: float = 10000.0):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"PolarEmbedding dim must be a positive integer, got {dim!r}")
        self.dim, self.base = dim, float(base)
        self.register_buffer("inv_freq", _polar_inv_freq(dim, self.base))  # persistent: x-transformers' key
        self.learned_bias = nn.Parameter(torch.zeros(heads, 1, dim))
        if bias_uniform_init:
            with torch.no_grad():
                self.learned_bias.uniform_(-2.0 * math.pi, 0.0)
        self._register_load_state_dict_pre_hook(_polar_inv_freq_if_missing, with_module=True)

    def frequencies(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The ``inv_freq (d,)`` buffer's values in ``dtype`` (float32 or wider); where the buffer, cast below
        float32, holds a constructor value rounded, that value in full (selected per element: no host sync)."""
        dtype = torch.promote_types(dtype, torch.float32)
        buf = self.inv_freq
        if torch.promote_types(buf.dtype, torch.float32) == buf.dtype:
            return buf.to(dtype)
        exact = _polar_inv_freq(self.dim, self.base, buf.device)
        return torch.where(exact.to(buf.dtype) == buf, exact, buf.to(torch.float32)).to(dtype)

    def angles(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``positions (b, n)`` -> ``(b, n, d)`` angles in float32 or wider (positions times ``inv_freq``)."""
        dtype = torch.promote_types(dtype, torch.float32)
        return positions.to(dtype)[..., None] * self.frequencies(dtype)

    def bias(self) -> Tensor:
        return self.learned_bias.clamp(-2.0 * math.pi, 0.0)

    def forward(self, t: Tensor, offset: int = 0):
        if not isinstance(t, Tensor) or t.dim() not in (1, 2) or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"positions t must be an integer tensor of shape (n,) or (b, n), got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if offset != 0:
            raise ValueError("offset is not applied by x-transformers' PolarEmbedding either; add it to the positions")
        return self.angles(t if t.dim() == 2 else t[None]), self.bias()

    def pair(self, positions: Tensor, dtype: torch.dtype) -> tuple[PolarAngles, PolarAngles]:
        """``(query, key)`` forms for ``apply_rotary`` from ``positions (b|1, n)``."""
        f = self.angles(positions, dtype)[:, None]  # (b|1, 1, n, d)
        return PolarAngles(f, math.sqrt(2.0)), PolarAngles(f + self.bias().to(f.dtype)[None])  # keys: (b|1, h, n, d)


def apply_polar_pos_emb(t: Tensor, freqs: Tensor) -> Tensor:
    """x-transformers' ``apply_polar_pos_emb``: ``t (b, h, n, d)`` -> ``(b, h, n, 2 d)``, ``cat(softplus(t) cos(f),
    softplus(t) sin(f))`` with the last ``n`` rows of ``freqs (b|h|1, n_k, d)`` (or ``(b|1, h|1, n, d)``), in float32
    or wider."""
    return _polar(t, freqs)


def _polar(t: Tensor, freqs: Tensor, gain: float = 1.0) -> Tensor:
    if freqs.dim() == 3:
        freqs = freqs[:, -t.shape[-2]:]
    tf = F.softplus(t.to(torch.promote_types(t.dtype, torch.float32)))
    if gain != 1.0:
        tf = tf * gain
    freqs = freqs.to(tf.dtype)
    return torch.cat((tf * freqs.cos(), tf * freqs.sin()), dim=-1).to(t.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = x.unbind(dim=-1)
    return rearrange(torch.stack((-x2, x1), dim=-1), "... d r -> ... (d r)")


def apply_rotary(t: Tensor, freqs, scale=1.0) -> Tensor:
    """Rotate the first ``freqs.shape[-1]`` features of ``t (b, h, n, d)``; computed in float32 or wider.

    ``freqs``: angles ``(b|1, 1, n, rot)`` (``RotaryEmbedding.angles``), or x-transformers' ``(b|1, n_k, rot)``
    from ``RotaryEmbedding.forward``, whose last ``n`` positions rotate ``t`` (``apply_rotary_pos_emb``); or a pair
    ``(angles, scale)`` (the stack's xpos form). ``scale``: 1, or xpos' scales shaped like ``freqs``, multiplying
    the rotated features (x-transformers' ``apply_rotary_pos_emb(t, freqs, scale)``)."""
    if isinstance(freqs, PolarAngles):  # the stack's PoPE form
        return _polar(t, freqs.freqs, freqs.gain)
    if isinstance(freqs, tuple):
        if isinstance(scale, Tensor) or scale != 1:
            raise ValueError("pass the xpos scale in the (angles, scale) pair or as scale, not both")
        freqs, scale = freqs
    if freqs.dim() == 3 and t.dim() == 4:  # x-transformers' (b, n_k, rot): the last n positions
        freqs = freqs[:, None, -t.shape[-2]:]
        if isinstance(scale, Tensor) and scale.dim() == 3:
            scale = scale[:, None, -t.shape[-2]:]
    rot = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    tf = t_rot.to(torch.promote_types(t.dtype, torch.float32))
    freqs = freqs.to(tf.dtype)
    t_rot = tf * freqs.cos() + _rotate_half(tf) * freqs.sin()
    if isinstance(scale, Tensor):
        t_rot = t_rot * scale.to(tf.dtype)
    elif scale != 1:
        t_rot = t_rot * float(scale)
    return torch.cat((t_rot.to(t.dtype), t_pass), dim=-1)


def alibi_slopes(heads: int) -> Tensor:
    """The ALiBi head slopes (geometric, as in the paper; interleaved for non-powers of two)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**k for k in range(n)]

    if math.log2(heads).is_integer():
        return torch.tensor(power_of_two(heads))
    closest = 2 ** math.floor(math.log2(heads))
    extra = power_of_two(2 * closest)[0::2][: heads - closest]
    return torch.tensor(power_of_two(closest) + extra)


def stack_alibi_slopes(heads: int, alibi_num_heads: int | None = None, slopes=None) -> Tensor:
    """The ``(heads,)`` slopes of a stack's ALiBi (x-transformers' ``alibi_num_heads`` and
    ``rel_pos_kwargs=dict(slopes=[...])``): the first ``alibi_num_heads`` heads (default all) take ``slopes``
    (default the geometric ones), the other heads 0 (no bias).

    Raises:
        ValueError: ``alibi_num_heads`` outside ``[1, heads]``, or slopes that are not ``alibi_num_heads``
            finite non-negative numbers (a negative slope would reward distance without bound: +inf logits).
    """
    n = heads if alibi_num_heads is None else alibi_num_heads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= heads:
        raise ValueError(f"alibi_num_heads must be an integer in [1, heads={heads}], got {alibi_num_heads!r}")
    if slopes is None:
        values = alibi_slopes(n)
    else:
        values = torch.as_tensor(slopes, dtype=torch.float32, device="cpu").flatten()  # checked here (not meta)
        if values.numel() != n or not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
            raise ValueError(f"ALiBi slopes (rel_pos_kwargs['slopes']) must be {n} finite non-negative numbers (one per "
                             f"ALiBi head), got {slopes!r}")
    return torch.cat((values.float(), values.new_zeros(heads - n, dtype=torch.float32)))


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``-slope * |q_pos - k_pos|``: ``(b, h, i, j)`` from positions ``(b, i)`` and ``(b, j)``, or per head
    ``(b, h, i)`` and ``(b, h, j)`` (x-transformers' custom ALiBi positions across heads)."""
    if q_pos.dim() == 3 or k_pos.dim() == 3:
        q3 = q_pos if q_pos.dim() == 3 else q_pos[:, None]
        k3 = k_pos if k_pos.dim() == 3 else k_pos[:, None]
        dist = (q3[..., :, None] - k3[..., None, :]).abs().float()  # (b, h|1, i, j)
    else:
        dist = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs().float()
    return -slopes.to(dist.device)[None, :, None, None] * dist
