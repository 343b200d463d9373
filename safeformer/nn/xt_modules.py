"""x-transformers' small parts under their own names (``x_transformers.x_transformers``'s norms, positional
biases, embeddings, residual gates, activations and ``apply_rotary_pos_emb``).

Each has x-transformers 2.31.10's constructor, parameter and buffer names and shapes (``state_dict`` keys load
strictly both ways), initialisation and numbers on the same weights; the math is safeformer's where safeformer
already computes it (``modules.LayerNorm``, ``modules.l2norm``, ``modules.apply_rotary``, ``modules.alibi_bias``,
ALiBi slopes). Every forward is a door: a wrong dtype, shape or device is a ``TypeError`` / ``ValueError``
naming the argument, and finite inputs give finite outputs and gradients (an all-zero row of ``ScaleNorm`` /
``SimpleRMSNorm`` is 0, its gradient ``1 / eps`` as in x-transformers: finite in float32 and wider).

Shape legend: b batch, n positions, h heads, i queries, j keys, c features, v vocabulary.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..nn import modules as _m

__all__ = [
    "apply_rotary_pos_emb",
    "LayerNorm",
    "ScaleNorm",
    "SimpleRMSNorm",
    "DynamicTanh",
    "ScaledSinusoidalEmbedding",
    "AlibiPositionalBias",
    "DynamicPositionBias",
    "TokenEmbedding",
    "Residual",
    "GRUGating",
    "LayerScale",
    "GLU",
    "ReluSquared",
    "Scale",
]


# ----------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------


def _float(x, name: str, *, dim: int | None = None, min_ndim: int = 1, like: Tensor | None = None,
           same_dtype: bool = False) -> Tensor:
    """``x`` is a floating tensor of at least ``min_ndim`` dims, last dim ``dim``, on ``like``'s device (and
    of its dtype with ``same_dtype``); else a ``TypeError`` (type, dtype) or ``ValueError`` (shape, device)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(x.shape)}")
    if dim is not None and x.shape[-1] != dim:
        raise ValueError(f"{name} must have {dim} features in its last dim, got shape {tuple(x.shape)}")
    if like is not None:
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device}, the module's parameters on {like.device}")
        if same_dtype and x.dtype != like.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, the module's parameters {like.dtype}: cast one of them")
    return x


def _count(v, name: str, *, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    return v


def _finite_number(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


# ----------------------------------------------------------------------------------------------------
# rotary
# ----------------------------------------------------------------------------------------------------


def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, scale=1) -> Tensor:
    """x-transformers' ``apply_rotary_pos_emb``: rotate the first ``freqs.shape[-1]`` features of ``t`` (partial
    rotary: the rest pass unchanged) by the last ``n`` positions of ``freqs``; computed in float32 or wider.

    Args:
        t: ``(b, h, n, c)`` or ``(b, n, c)``.
        freqs: angles ``(b|1, n_f, rot)`` (``RotaryEmbedding.forward``) or ``(b|1, 1, n_f, rot)``, ``n_f >= n``,
            ``rot`` even and at most ``c``.
        scale: 1, a finite number, or xpos' scales shaped like ``freqs``, multiplying the rotated features.
    """
    _float(t, "t", min_ndim=2)
    _float(freqs, "freqs", min_ndim=3, like=t)
    if freqs.dim() > 4 or freqs.dim() > t.dim():
        raise ValueError(f"freqs must be (b, n, rot) or (b, 1, n, rot) and have no more dims than t, got freqs "
                         f"{tuple(freqs.shape)} for t {tuple(t.shape)}")
    rot, n = freqs.shape[-1], t.shape[-2]
    if rot % 2 or rot > t.shape[-1]:
        raise ValueError(f"freqs' last dim (the rotary dim, {rot}) must be even and at most t's last dim {t.shape[-1]}")
    if freqs.shape[-2] < n:
        raise ValueError(f"freqs holds {freqs.shape[-2]} positions, fewer than t's {n}")
    freqs = freqs[..., freqs.shape[-2] - n:, :]
    if isinstance(scale, Tensor):
        _float(scale, "scale", min_ndim=freqs.dim(), like=t)
        if scale.dim() != freqs.dim():
            raise ValueError(f"scale must be shaped like freqs, got {tuple(scale.shape)}")
        scale = scale[..., scale.shape[-2] - n:, :] if scale.shape[-2] >= n else scale
    else:
        _finite_number(scale, "scale")
    if t.dim() == 4 and freqs.dim() == 3:
        freqs = freqs[:, None]
        scale = scale[:, None] if isinstance(scale, Tensor) else scale
    shape = t.shape[:-1] + (rot,)
    for name, v in (("freqs", freqs), ("scale", scale)):
        if isinstance(v, Tensor):
            try:
                ok = torch.broadcast_shapes(v.shape, shape) == shape
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(f"{name} {tuple(v.shape)} does not broadcast to t's rotated part {tuple(shape)}")
    return _m.apply_rotary(t, freqs, scale)


# ----------------------------------------------------------------------------------------------------
# norms
# ----------------------------------------------------------------------------------------------------


class LayerNorm(nn.Module):
    """x-transformers' bias-less ``LayerNorm``: ``layer_norm(x) * (gamma + unit_offset)`` (statistics in float32).

    Args:
        dim: features.
        unit_offset: ``gamma`` is stored minus 1 (initialised at 0).
    """

    def __init__(self, dim: int, unit_offset: bool = False):
        super().__init__()
        self.dim = _count(dim, "dim", low=1)
        self.unit_offset = bool(unit_offset)
        self.ln = _m.TorchLayerNorm(dim, elementwise_affine=False)
        self.gamma = nn.Parameter(torch.ones(dim))
        nn.init.constant_(self.gamma, 1.0 - float(unit_offset))

    def forward(self, x: Tensor) -> Tensor:
        _float(x, "x", dim=self.dim, like=self.gamma)
        return self.ln(x) * (self.gamma + float(self.unit_offset))


class ScaleNorm(nn.Module):
    """x-transformers' ``ScaleNorm``: ``x / max(||x||, 1e-12) * sqrt(dim) * (g + unit_offset)`` with one learned
    scalar ``g``; an all-zero row gives 0.

    Args:
        dim: features.
        unit_offset: ``g`` is stored minus 1 (initialised at 0).
    """

    def __init__(self, dim: int, unit_offset: bool = False):
        super().__init__()
        self.dim = _count(dim, "dim", low=1)
        self.unit_offset = bool(unit_offset)
        self.scale = dim**0.5
        self.g = nn.Parameter(torch.zeros(1))
        nn.init.constant_(self.g, 1.0 - float(unit_offset))

    def forward(self, x: Tensor) -> Tensor:
        _float(x, "x", dim=self.dim, like=self.g)
        return _m.l2norm(x) * self.scale * (self.g + float(self.unit_offset))


class SimpleRMSNorm(nn.Module):
    """x-transformers' ``SimpleRMSNorm``: ``x / max(||x||, 1e-12) * sqrt(dim)``, no parameter; an all-zero row
    gives 0.

    Args:
        dim: features (other keywords are accepted and ignored, as in x-transformers).
    """

    def __init__(self, dim: int, **kwargs):
        super().__init__()
        self.dim = _count(dim, "dim", low=1)
        self.scale = dim**0.5

    def forward(self, x: Tensor) -> Tensor:
        _float(x, "x", dim=self.dim)
        return _m.l2norm(x) * self.scale


class DynamicTanh(_m.DynamicTanh):
    """x-transformers' ``DynamicTanh``: ``tanh(x * (pre_tanh_scale + a0)) * (gamma + g0) + beta`` in float32,
    ``a0 = init_alpha`` and ``g0 = 1`` with ``unit_offset`` (parameters then start at 0), else 0.

    Args:
        dim: features.
        init_alpha: the initial pre-tanh scale.
        gamma, beta: ignored, as in x-transformers (a ``UserWarning`` when not 1 / 0).
        unit_offset: store the scale and gain as offsets from their initial values.
    """

    def __init__(self, dim: int, init_alpha: float = 1.0, gamma: float = 1.0, beta: float = 0.0,
                 unit_offset: bool = False):
        init_alpha = _finite_number(init_alpha, "init_alpha")
        super().__init__(_count(dim, "dim", low=1), init_alpha, unit_offset=unit_offset)
        self.dim = dim
        if gamma != 1.0 or beta != 0.0:
            warnings.warn("DynamicTanh's gamma / beta arguments do nothing (x-transformers ignores them too): the "
                          "gain starts at 1 and the bias at 0", UserWarning, stacklevel=2)

    def forward(self, x: Tensor) -> Tensor:
        _float(x, "x", dim=self.dim, like=self.gamma)
        return super().forward(x)


# ----------------------------------------------------------------------------------------------------
# positions
# ----------------------------------------------------------------------------------------------------


class ScaledSinusoidalEmbedding(nn.Module):
    """x-transformers' ``ScaledSinusoidalEmbedding``: ``cat(sin(p * f), cos(p * f)) * scale``, ``f = theta **
    (-k / (dim / 2))``, a learned scalar ``scale`` (``dim ** -0.5`` at init); angles in float32.

    Args:
        dim: features (even).
        theta: the frequency base.
    """

    def __init__(self, dim: int, theta: float = 10000):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
            raise ValueError(f"dim must be a positive even integer, got {dim!r}")
        _finite_number(theta, "theta")
        self.scale = nn.Parameter(torch.ones(1) * dim**-0.5)
        half_dim = dim // 2
        freq_seq = torch.arange(half_dim).float() / half_dim
        self.register_buffer("inv_freq", theta**-freq_seq, persistent=False)

    def forward(self, x: Tensor, pos: Tensor | None = None, seq_start_pos: Tensor | None = None, offset: int = 0) -> Tensor:
        """``x (b, n, ...)`` gives ``n`` (and the device); ``pos (n,)`` or ``(b, n)`` (integer or finite float,
        default ``arange(n) + offset``); ``seq_start_pos (b,)`` is subtracted. Returns ``(n, dim)``, or
        ``(b, n, dim)`` for per-sample positions."""
        if not isinstance(x, Tensor) or x.dim() < 2:
            raise ValueError(f"x must be a tensor (b, n, ...), got {getattr(x, 'shape', type(x).__name__)}")
        if x.device != self.inv_freq.device:
            raise ValueError(f"x is on {x.device}, the module's buffers on {self.inv_freq.device}")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise ValueError(f"offset must be an integer, got {offset!r}")
        if pos is None:
            pos = torch.arange(x.shape[1], device=x.device) + offset
        elif (not isinstance(pos, Tensor) or pos.dim() not in (1, 2) or pos.dtype == torch.bool or pos.is_complex()
              or pos.device != x.device):
            raise ValueError(f"pos must be a real tensor (n,) or (b, n) on x's device, got "
                             f"{getattr(pos, 'dtype', type(pos).__name__)} {tuple(getattr(pos, 'shape', ()))}")
        elif pos.is_floating_point() and not bool(torch.isfinite(pos).all()):
            raise ValueError("pos must hold finite positions")
        if seq_start_pos is not None:
            if (not isinstance(seq_start_pos, Tensor) or seq_start_pos.dim() != 1 or seq_start_pos.is_floating_point()
                    or seq_start_pos.dtype == torch.bool or seq_start_pos.device != x.device):
                raise ValueError(f"seq_start_pos must be an integer tensor (b,) on x's device, got "
                                 f"{getattr(seq_start_pos, 'dtype', type(seq_start_pos).__name__)}")
            pos = pos - seq_start_pos[:, None]
        emb = pos.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        return torch.cat((emb.sin(), emb.cos()), dim=-1) * self.scale


class AlibiPositionalBias(nn.Module):
    """x-transformers' ``AlibiPositionalBias``: ``-slope * |j - i|`` on the first ``heads`` of ``total_heads``
    heads (the others 0); slopes geometric (``alibi_slopes``) or given (finite, non-negative). No state_dict
    entry (the buffers are not persistent).

    Args:
        heads: heads with a bias.
        total_heads: all heads (default ``heads``).
        slopes: ``heads`` custom slopes.
    """

    def __init__(self, heads: int, total_heads: int | None = None, slopes: list[float] | None = None, **kwargs):
        super().__init__()
        self.heads = _count(heads, "heads", low=1)
        self.total_heads = heads if total_heads is None else _count(total_heads, "total_heads", low=heads)
        values = _m.stack_alibi_slopes(heads, heads, slopes)  # validated: finite, non-negative, one per head
        self.register_buffer("slopes", values[:, None, None], persistent=False)
        self.register_buffer("bias", None, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.slopes.device

    def _pad(self, bias: Tensor) -> Tensor:
        return F.pad(bias, (0, 0, 0, 0, 0, self.total_heads - bias.shape[-3]))

    def forward_custom_pos(self, pos_i: Tensor, pos_j: Tensor | None = None) -> Tensor:
        """Positions ``(i,)``, ``(b, i)`` or per head ``(b, heads, i)`` (and ``pos_j`` likewise, default
        ``pos_i``) -> ``(total_heads, i, j)`` / ``(b, total_heads, i, j)``."""
        pos_j = pos_i if pos_j is None else pos_j
        for name, p in (("pos_i", pos_i), ("pos_j", pos_j)):
            if not isinstance(p, Tensor) or p.dtype == torch.bool or p.is_complex() or not 1 <= p.dim() <= 3:
                raise ValueError(f"{name} must be a real tensor (i,), (b, i) or (b, h, i), got "
                                 f"{getattr(p, 'dtype', type(p).__name__)} {tuple(getattr(p, 'shape', ()))}")
            if p.device != self.device:
                raise ValueError(f"{name} is on {p.device}, the module's buffers on {self.device}")
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise ValueError(f"{name} must hold finite positions")
        try:
            bias = -(pos_j[..., None, :] - pos_i[..., :, None]).abs()
        except RuntimeError as e:
            raise ValueError(f"pos_i {tuple(pos_i.shape)} and pos_j {tuple(pos_j.shape)} do not broadcast: {e}") from None
        if bias.dim() == 3:
            bias = bias[:, None]
        if bias.dim() == 4 and bias.shape[1] not in (1, self.heads):
            raise ValueError(f"per-head positions must have {self.heads} heads, got {tuple(bias.shape)}")
        return self._pad(bias * self.slopes)

    def forward(self, i: int, j: int) -> Tensor:
        """``(total_heads, i, j)``: queries are the last ``i`` of ``j`` positions."""
        _count(i, "i")
        _count(j, "j")
        if self.bias is not None and self.bias.shape[-1] >= j and self.bias.shape[-2] >= i and i and j:
            return self.bias[..., -i:, -j:]
        k_pos = torch.arange(j, device=self.device)
        q_pos = torch.arange(j - i, j, device=self.device)
        bias = self._pad(_m.alibi_bias(self.slopes.flatten(), q_pos[None], k_pos[None])[0])
        if i and j:
            self.register_buffer("bias", bias, persistent=False)
        return bias


class DynamicPositionBias(nn.Module):
    """x-transformers' ``DynamicPositionBias``: an MLP from the relative distance (optionally ``sign * log(1 + |d|)``)
    to one bias per head.

    Args:
        dim: the MLP's width.
        heads: output heads.
        depth: MLP layers (at least 1).
        log_distance: feed the log distance.
        norm: a norm after each hidden linear layer.
    """

    def __init__(self, dim: int, *, heads: int, depth: int, log_distance: bool = False, norm: bool = False):
        super().__init__()
        _count(dim, "dim", low=1)
        _count(heads, "heads", low=1)
        _count(depth, "depth", low=1)
        self.log_distance = log_distance
        self.mlp = nn.ModuleList([])
        first = [nn.Linear(1, dim)] + ([LayerNorm(dim)] if norm else []) + [nn.SiLU()]
        self.mlp.append(nn.Sequential(*first))
        for _ in range(depth - 1):
            layer = [nn.Linear(dim, dim)] + ([_m.TorchLayerNorm(dim)] if norm else []) + [nn.SiLU()]
            self.mlp.append(nn.Sequential(*layer))
        self.mlp.append(nn.Linear(dim, heads))

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def bias(self, q_pos: Tensor, k_pos: Tensor, table: Tensor | None = None) -> Tensor:
        """``(b, h, i, j)`` from integer positions ``(b|1, i)`` of the queries and ``(b|1, j)`` of the keys: the MLP
        of each distance ``q - k`` (what a stack's ``dynamic_pos_bias`` adds to its self-attention logits; the
        positions count real tokens). The MLP runs once per distance in ``[-(m - 1), m - 1]``, ``m - 1`` the
        largest ``|q - k|`` (one host read: the span), or is read from ``table`` (``self.table(span)``, every
        distance ``|q - k| < span``)."""
        dist = q_pos[:, :, None].long() - k_pos[:, None, :].long()  # (b, i, j)
        if table is None:
            span = int(dist.abs().max()) + 1 if dist.numel() else 1
            table = self.table(span, dist.device)
        span = (table.shape[0] + 1) // 2
        idx = (dist + span - 1).clamp(0, 2 * span - 2)
        return table[idx].permute(0, 3, 1, 2)  # (b, h, i, j)

    def table(self, span: int, device=None) -> Tensor:
        """``(2 span - 1, h)``: the MLP at every distance in ``[-(span - 1), span - 1]`` (row ``d + span - 1``), what
        ``bias`` looks distances up in; a decode step builds it once for its cache's capacity (no host read per
        step)."""
        dtype = self.mlp[-1].weight.dtype
        pos = torch.arange(-span + 1, span, device=self.device if device is None else device).to(dtype)[:, None]
        if self.log_distance:
            pos = torch.sign(pos) * torch.log(pos.abs() + 1)
        for layer in self.mlp:
            pos = layer(pos)  # (2 span - 1, h)
        return pos

    def forward(self, i: int, j: int) -> Tensor:
        """``(heads, i, j)``: queries are the last ``i`` of ``j`` positions (``i <= j``)."""
        _count(i, "i")
        _count(j, "j")
        if i > j:
            raise ValueError(f"i ({i}) must be at most j ({j}): the queries are the last i of the j positions")
        device, dtype = self.device, self.mlp[-1].weight.dtype
        if j == 0:
            return torch.zeros(self.mlp[-1].out_features, 0, 0, device=device, dtype=dtype)
        q = torch.arange(j - i, j, device=device)
        k = torch.arange(j, device=device)
        indices = q[:, None] - k[None, :] + (j - 1)  # in [0, 2j - 2]
        pos = torch.arange(-j + 1, j, device=device).to(dtype)[:, None]
        if self.log_distance:
            pos = torch.sign(pos) * torch.log(pos.abs() + 1)
        for layer in self.mlp:
            pos = layer(pos)
        return pos[indices].permute(2, 0, 1)


# ----------------------------------------------------------------------------------------------------
# embedding
# ----------------------------------------------------------------------------------------------------


class TokenEmbedding(nn.Module):
    """x-transformers' ``TokenEmbedding``: ``emb(x)`` (L2-normalised with ``l2norm_embed``).

    Args:
        dim: features.
        num_tokens: vocabulary size.
        l2norm_embed: normalise each embedding (``init_`` then draws std 1e-5).
    """

    def __init__(self, dim: int, num_tokens: int, l2norm_embed: bool = False):
        super().__init__()
        self.l2norm_embed = l2norm_embed
        self.emb = nn.Embedding(_count(num_tokens, "num_tokens", low=1), _count(dim, "dim", low=1))

    def forward(self, x: Tensor) -> Tensor:
        """``x``: integer ids of any shape in ``[0, num_tokens)`` (a float tensor of whole numbers is read as
        ids, as x-transformers' ``.long()`` does; a fractional one is refused)."""
        if not isinstance(x, Tensor) or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"x must be a tensor of integer token ids, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.device != self.emb.weight.device:
            raise ValueError(f"x is on {x.device}, the embedding on {self.emb.weight.device}")
        if x.is_floating_point():
            if x.numel() and not bool((torch.isfinite(x) & (x == x.round())).all()):
                raise TypeError("x must hold integer token ids; a float tensor is read only when every value is a "
                                "whole number")
        v = self.emb.num_embeddings
        if x.numel() and not bool(((x >= 0) & (x < v)).all()):
            raise ValueError(f"x holds token ids outside [0, num_tokens={v}): min {x.min().item()}, max {x.max().item()}")
        out = self.emb(x.long())
        return _m.l2norm(out) if self.l2norm_embed else out

    def init_(self) -> None:
        """x-transformers' initialisation: Kaiming normal, or std 1e-5 with ``l2norm_embed``."""
        if self.l2norm_embed:
            nn.init.normal_(self.emb.weight, std=1e-5)
            return
        nn.init.kaiming_normal_(self.emb.weight)


# ----------------------------------------------------------------------------------------------------
# residuals
# ----------------------------------------------------------------------------------------------------


def _residual_pair(x, residual, dim: int, like: Tensor | None, ndim: int | None = None) -> None:
    _float(x, "x", dim=dim, like=like, same_dtype=ndim is not None)
    _float(residual, "residual", dim=dim, like=x, same_dtype=ndim is not None)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"x must be (b, n, c), got shape {tuple(x.shape)}")


class Residual(nn.Module):
    """x-transformers' ``Residual``: ``x + residual * residual_scale * scale_residual_constant``.

    Args:
        dim: features.
        scale_residual: a learned per-feature ``residual_scale`` (ones at init).
        scale_residual_constant: a fixed factor on the residual.
    """

    def __init__(self, dim: int, scale_residual: bool = False, scale_residual_constant: float = 1.0, **kwargs):
        super().__init__()
        self.dim = _count(dim, "dim", low=1)
        self.residual_scale = nn.Parameter(torch.ones(dim)) if scale_residual else None
        self.scale_residual_constant = _finite_number(scale_residual_constant, "scale_residual_constant")

    def prepare(self, residual: Tensor):
        return residual, residual, dict()

    def forward(self, x: Tensor, residual: Tensor, **kwargs) -> Tensor:
        _residual_pair(x, residual, self.dim, self.residual_scale)
        if self.residual_scale is not None:
            residual = residual * self.residual_scale
        if self.scale_residual_constant != 1:
            residual = residual * self.scale_residual_constant
        return x + residual


class GRUGating(nn.Module):
    """x-transformers' ``GRUGating``: a ``GRUCell`` per position, ``x`` the input and ``residual`` the state.

    Args:
        dim: features.
        scale_residual: a learned per-feature ``residual_scale`` on the state (ones at init).
    """

    def __init__(self, dim: int, scale_residual: bool = False, **kwargs):
        super().__init__()
        self.dim = _count(dim, "dim", low=1)
        self.gru = nn.GRUCell(dim, dim)
        self.residual_scale = nn.Parameter(torch.ones(dim)) if scale_residual else None

    def prepare(self, residual: Tensor):
        return residual, residual, dict()

    def forward(self, x: Tensor, residual: Tensor, **kwargs) -> Tensor:
        """``x``, ``residual``: ``(b, n, dim)`` of the module's dtype."""
        _residual_pair(x, residual, self.dim, self.gru.weight_ih, ndim=3)
        if self.residual_scale is not None:
            residual = residual * self.residual_scale
        out = self.gru(x.reshape(-1, self.dim), residual.reshape(-1, self.dim))
        return out.reshape_as(x)


# ----------------------------------------------------------------------------------------------------
# branch wrappers and activations
# ----------------------------------------------------------------------------------------------------


def _first_output(out, name: str, dim: int | None = None) -> None:
    first = out if isinstance(out, Tensor) else (tree_flatten(out)[0] or [None])[0]
    if not isinstance(first, Tensor) or not first.is_floating_point():
        raise TypeError(f"{name} must return a float tensor (or a tuple whose first item is one), got "
                        f"{type(first).__name__}")
    if dim is not None and (first.dim() == 0 or first.shape[-1] != dim):
        raise ValueError(f"{name}'s output must have {dim} features in its last dim, got shape {tuple(first.shape)}")


class LayerScale(nn.Module):
    """x-transformers' ``LayerScale``: ``fn(x, **kwargs) * (gamma + unit_offset)`` (the first output of a tuple).

    Args:
        fn: the branch.
        dim: features of ``fn``'s output.
        init_value: ``gamma`` at init.
        unit_offset: ``gamma`` is stored minus 1.
    """

    def __init__(self, fn: nn.Module, dim: int, init_value: float = 0.0, unit_offset: bool = False):
        super().__init__()
        if not callable(fn):
            raise TypeError(f"fn must be a module or a function, got {type(fn).__name__}")
        self.unit_offset = bool(unit_offset)
        self.fn = fn
        self.dim = _count(dim, "dim", low=1)
        self.gamma = nn.Parameter(torch.zeros(dim))
        nn.init.constant_(self.gamma, _finite_number(init_value, "init_value") - float(unit_offset))

    def forward(self, x, **kwargs):
        out = self.fn(x, **kwargs)
        _first_output(out, "fn", self.dim)
        gamma = self.gamma + float(self.unit_offset)
        if isinstance(out, Tensor):
            return out * gamma
        out, *rest = out
        return out * gamma, *rest


class Scale(nn.Module):
    """x-transformers' ``Scale``: the first tensor of ``fn(*args, **kwargs)`` times ``scale`` (``fn`` default identity).

    Args:
        scale: a finite number (``None`` or 1: unchanged).
        fn: the wrapped module.
    """

    def __init__(self, scale, fn: nn.Module | None = None):
        super().__init__()
        if scale is not None:
            if isinstance(scale, Tensor):
                if not scale.is_floating_point() or not bool(torch.isfinite(scale).all()):
                    raise ValueError("scale must be finite (a float tensor or a number)")
            else:
                _finite_number(scale, "scale")
        if fn is not None and not callable(fn):
            raise TypeError(f"fn must be a module or a function, got {type(fn).__name__}")
        self.scale = scale
        self.fn = fn if fn is not None else nn.Identity()

    def forward(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        _first_output(out, "fn")
        if self.scale is None or (not isinstance(self.scale, Tensor) and self.scale == 1.0):
            return out
        tensors, spec = tree_flatten(out)
        first, *rest = tensors
        return tree_unflatten([first * self.scale, *rest], spec)


def _softclamp(t: Tensor, value: float) -> Tensor:
    return (t / value).tanh() * value


class GLU(nn.Module):
    """x-transformers' ``GLU``: ``up * activation(gate) * mult_bias`` from one projection to ``2 * dim_out``;
    with ``softclamp`` (GELU or SiLU) the situ-GLU ``softclamp(up) * softclamp(gate) * Phi(gate)`` (``sigmoid``
    for SiLU).

    Args:
        dim_in, dim_out: widths.
        activation: the gate's activation (a module or function).
        mult_bias: a learned per-feature multiplier (ones at init).
        softclamp: soft-clamp the gate and the up projection.
        gate_softclamp_value, up_softclamp_value: their bounds.
    """

    def __init__(self, dim_in: int, dim_out: int, activation: Callable, mult_bias: bool = False, softclamp: bool = False,
                 gate_softclamp_value: float = 4.0, up_softclamp_value: float = 25.0):
        super().__init__()
        if not callable(activation):
            raise TypeError(f"activation must be a module or a function, got {type(activation).__name__}")
        self.dim_in = _count(dim_in, "dim_in", low=1)
        _count(dim_out, "dim_out", low=1)
        if softclamp:
            if not isinstance(activation, (nn.GELU, nn.SiLU)):
                raise ValueError("softclamp of the glu gate needs an nn.GELU or nn.SiLU activation, got "
                                 f"{type(activation).__name__}")
            for name, v in (("gate_softclamp_value", gate_softclamp_value), ("up_softclamp_value", up_softclamp_value)):
                if _finite_number(v, name) <= 0:
                    raise ValueError(f"{name} must be positive, got {v!r}")
            self.gate_softclamp = (float(gate_softclamp_value), isinstance(activation, nn.GELU))
        else:
            self.gate_softclamp = None
        self.act = activation
        self.up_softclamp_value = float(up_softclamp_value) if softclamp else None
        self.proj = nn.Linear(dim_in, dim_out * 2)
        self.mult_bias = nn.Parameter(torch.ones(dim_out)) if mult_bias else 1.0

    def forward(self, x: Tensor) -> Tensor:
        _float(x, "x", dim=self.dim_in, like=self.proj.weight, same_dtype=True)
        up, gate = self.proj(x).chunk(2, dim=-1)
        if self.up_softclamp_value is not None:
            up = _softclamp(up, self.up_softclamp_value)
        if self.gate_softclamp is not None:
            value, gelu = self.gate_softclamp
            act = _softclamp(gate, value) * (torch.special.ndtr(gate) if gelu else gate.sigmoid())
        else:
            act = self.act(gate)
        return up * act * self.mult_bias


class ReluSquared(_m._ReluSquared):
    """x-transformers' ``ReluSquared``: ``relu(x) ** 2``."""

    def forward(self, x: Tensor) -> Tensor:
        _float(x, "x", min_ndim=0)
        return super().forward(x)
