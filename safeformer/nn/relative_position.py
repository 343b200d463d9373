"""T5's bucketed relative position bias (x-transformers' ``RelativePositionBias``, ``rel_pos_bias=True``).

A learned bias per head and bucket of the distance ``key position - query position``: exact buckets for
small distances, log-spaced ones up to ``max_distance``, one bucket beyond (both directions, or only the
past with ``causal``). safeformer reads the distance from the positions it gives every token (real tokens
counted, so left padding moves nothing), where x-transformers uses ``arange``; with no padding or right
padding the two are the same.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["RelativePositionBias"]


class RelativePositionBias(nn.Module):
    """T5's relative position bias.

    Args:
        scale: the bias's factor (x-transformers' stack passes ``dim_head ** 0.5``).
        causal: one-sided buckets (keys after the query share bucket 0).
        num_buckets: buckets (half per direction without ``causal``).
        max_distance: distances from here on share the last bucket.
        heads: one bias per head.
    """

    def __init__(self, scale: float, causal: bool = False, num_buckets: int = 32, max_distance: int = 128, heads: int = 8):
        super().__init__()
        if num_buckets < 2 or (not causal and num_buckets < 4):
            raise ValueError(f"num_buckets must be at least {2 if causal else 4}, got {num_buckets}")
        max_exact = (num_buckets if causal else num_buckets // 2) // 2
        if max_distance <= max_exact:
            raise ValueError(f"max_distance must exceed the exact buckets ({max_exact}), got {max_distance}")
        self.scale = float(scale)
        self.causal = bool(causal)
        self.num_buckets = int(num_buckets)
        self.max_distance = int(max_distance)
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position: Tensor, causal: bool = True, num_buckets: int = 32,
                                  max_distance: int = 128) -> Tensor:
        """The bucket of each ``key position - query position`` (x-transformers' and T5's rule)."""
        ret = torch.zeros_like(relative_position)
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret = ret + (n < 0).long() * num_buckets
            n = n.abs()
        else:
            n = n.clamp(min=0)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        # log-spaced buckets; n < max_exact takes the exact branch (the clamp keeps log finite there)
        large = max_exact + (torch.log(n.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
                             * (num_buckets - max_exact)).long()
        large = large.clamp(max=num_buckets - 1)
        return ret + torch.where(is_small, n, large)

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``(b, h, i, j)`` from integer positions ``(b|1, i)`` of the queries and ``(b|1, j)`` of the keys."""
        rel = k_pos[:, None, :].long() - q_pos[:, :, None].long()  # (b, i, j)
        bucket = self._relative_position_bucket(rel, causal=self.causal, num_buckets=self.num_buckets,
                                                max_distance=self.max_distance)
        return self.relative_attention_bias(bucket).permute(0, 3, 1, 2) * self.scale

    def forward(self, i: int, j: int) -> Tensor:
        """x-transformers' call: ``(h, i, j)`` for the last ``i`` of ``j`` positions."""
        device = self.relative_attention_bias.weight.device
        q = torch.arange(j - i, j, device=device)[None]
        k = torch.arange(j, device=device)[None]
        return self.bias(q, k)[0]
