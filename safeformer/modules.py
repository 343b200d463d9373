"""Building blocks: norms, feed-forward, positional schemes, and the ``Attention`` module.

Shape legend: b batch, n sequence positions, h query heads, h_kv key/value heads, i queries, j keys,
d head dim, c model width, c_ctx context width.

Masks follow safeformer's one convention (bool, True = may attend / is real); see ``masks.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

__all__ = [
    "RMSNorm",
    "AdaptiveNorm",
    "AdaptiveLayerScale",
    "make_norm",
    "FeedForward",
    "AbsolutePositionalEmbedding",
    "RotaryEmbedding",
    "apply_rotary",
    "alibi_slopes",
    "alibi_bias",
    "positions_from_mask",
]


class RMSNorm(nn.Module):
    """RMS normalisation with a learned gain; statistics in float32 (S7)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.to(xf.dtype)).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` with its statistics (and their gradients) computed in float32 (S7).

    PyTorch's CPU kernel keeps a half-precision input's mean and inverse std in half precision, which
    makes the gradients of inputs of large magnitude several tolerances off.
    """

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        w = None if self.weight is None else self.weight.to(dtype)
        b = None if self.bias is None else self.bias.to(dtype)
        return F.layer_norm(x.to(dtype), self.normalized_shape, w, b, self.eps).to(x.dtype)


def make_norm(dim: int, use_rmsnorm: bool, eps: float | None = None) -> nn.Module:
    if use_rmsnorm:
        return RMSNorm(dim, eps=1e-6 if eps is None else eps)
    return LayerNorm(dim, eps=1e-5 if eps is None else eps)


class AdaptiveNorm(nn.Module):
    """Adaptive normalisation (DiT's AdaLN): a LayerNorm or RMSNorm without its own gain, scaled (and,
    for LayerNorm, shifted) by projections of a condition: ``norm(x) * (1 + gamma(c)) + beta(c)``.

    The projections start at zero, so an untrained layer is the plain norm. Statistics in float32 (S7).

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
        self.to_gamma = nn.Linear(dim_condition, dim, bias=False)
        self.to_beta = None if rms else nn.Linear(dim_condition, dim, bias=False)
        nn.init.zeros_(self.to_gamma.weight)
        if self.to_beta is not None:
            nn.init.zeros_(self.to_beta.weight)

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


class AdaptiveLayerScale(nn.Module):
    """Gates a residual branch by the condition (AdaLN-zero style): ``branch * sigmoid(W c + b)``.

    ``W`` starts at zero and ``b`` at ``init_bias`` (x-transformers' ``use_adaptive_layerscale``), so each
    branch starts scaled by ``sigmoid(-2) = 0.12``.
    """

    def __init__(self, dim: int, dim_condition: int, init_bias: float = -2.0):
        super().__init__()
        self.to_gate = nn.Linear(dim_condition, dim)
        nn.init.zeros_(self.to_gate.weight)
        nn.init.constant_(self.to_gate.bias, init_bias)

    def forward(self, out: Tensor, condition: Tensor) -> Tensor:
        gate = self.to_gate(condition).sigmoid().to(out.dtype)
        return out * (gate if out.dim() == 2 else gate[:, None])  # packed (T, c) rows: one condition each


class FeedForward(nn.Module):
    """Position-wise feed-forward: GELU MLP, or gated GEGLU / SwiGLU.

    Args:
        dim: input and output width.
        mult: hidden width multiplier.
        glu: gate the hidden layer (GEGLU, or SwiGLU with ``swish=True``).
        swish: use SiLU instead of GELU as the activation.
        dropout: dropout on the hidden layer.
    """

    def __init__(self, dim: int, *, mult: float = 4, glu: bool = False, swish: bool = False, dropout: float = 0.0):
        super().__init__()
        if mult <= 0:
            raise ValueError(f"ff mult must be positive, got {mult}")
        inner = int(dim * mult)
        self.glu = glu
        self.act = nn.SiLU() if swish else nn.GELU()
        self.proj_in = nn.Linear(dim, inner * (2 if glu else 1))
        self.dropout = nn.Dropout(dropout)
        self.proj_out = nn.Linear(inner, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj_in(x)
        if self.glu:
            h, gate = h.chunk(2, dim=-1)
            h = h * self.act(gate)
        else:
            h = self.act(h)
        return self.proj_out(self.dropout(h))


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


class AbsolutePositionalEmbedding(nn.Module):
    """Learned absolute positions, scaled by ``dim ** -0.5``; takes per-sample positions ``(b, n)``.

    With ``l2norm_embed`` each position's vector is L2-normalised instead of scaled (x-transformers'
    ``l2norm_embed``, initialised with std 1e-5).
    """

    def __init__(self, dim: int, max_seq_len: int, l2norm_embed: bool = False):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.l2norm_embed = l2norm_embed
        self.scale = 1.0 if l2norm_embed else dim**-0.5
        self.emb = nn.Embedding(max_seq_len, dim)
        if l2norm_embed:
            nn.init.normal_(self.emb.weight, std=1e-5)

    def forward(self, positions: Tensor) -> Tensor:
        out = self.emb(positions.clamp(max=self.max_seq_len - 1)) * self.scale  # (b, n, c)
        return l2norm(out) if self.l2norm_embed else out


def l2norm(t: Tensor, eps: float = 1e-12) -> Tensor:
    """``t / max(||t||, eps)`` over the last dim, computed in float32 or wider (a zero vector stays 0)."""
    tf = t.to(torch.promote_types(t.dtype, torch.float32))
    return F.normalize(tf, dim=-1, eps=eps).to(t.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on the first ``dim`` features of each head (interleaved pairs)."""

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2 != 0 or dim <= 0:
            raise ValueError(f"rotary_emb_dim must be a positive even number, got {dim}")
        self.dim, self.theta = dim, theta

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``positions (b, n)`` -> angles ``(b, 1, n, dim)`` in ``dtype`` (float32, or float64 for a
        float64 model); never lower, whatever dtype the module's buffers were cast to."""
        dtype = torch.promote_types(dtype, torch.float32)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, device=positions.device, dtype=dtype) / self.dim))
        freqs = positions.to(dtype)[..., None] * inv_freq  # (b, n, dim/2)
        freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # (b, n, dim)
        return freqs[:, None]


def _rotate_half(x: Tensor) -> Tensor:
    x = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = x.unbind(dim=-1)
    return rearrange(torch.stack((-x2, x1), dim=-1), "... d r -> ... (d r)")


def apply_rotary(t: Tensor, freqs: Tensor) -> Tensor:
    """Rotate the first ``freqs.shape[-1]`` features of ``t (b, h, n, d)``; computed in float32 or wider."""
    rot = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    tf = t_rot.to(torch.promote_types(t.dtype, torch.float32))
    freqs = freqs.to(tf.dtype)
    t_rot = tf * freqs.cos() + _rotate_half(tf) * freqs.sin()
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


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``-slope * |q_pos - k_pos|``: ``(b, h, i, j)`` from positions ``(b, i)`` and ``(b, j)``."""
    dist = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs().float()
    return -slopes.to(dist.device)[None, :, None, None] * dist
