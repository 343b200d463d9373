"""x-transformers' ``Attend`` module (``x_transformers.attend.Attend``) on safeformer's ``attend``.

Projects that write their own attention (joint text-image attention, robotics heads) use x-transformers'
``Attend`` for the softmax part alone: ``Attend(dropout=..., causal=...)(q, k, v, mask=...)`` returning
``(out, intermediates)``. This module is that, with ``attend`` underneath: a query whose keys are all masked
gives exactly 0 (x-transformers gives 0 there too, but NaN planted in a masked key or value reaches its
output: ``0 * NaN``), masked keys and values never reach an output or a gradient, and the fused kernels stay.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.attend import attend
from ..core.cache import AttnIntermediate

__all__ = ["Attend"]

# x-transformers' Attend options this module does not implement: accepted only at their defaults
_OFF = dict(pre_talking_heads=False, post_talking_heads=False, pre_scale_post_talking_heads=False, sparse_topk=None,
            sparse_topk_straight_through=False, l2_distance=False, sigmoid=False, gumbel_softmax=False,
            gumbel_softmax_temp=1.0, gumbel_softmax_hard=True, cog_signed=False, custom_attn_fn=None, softclamp_logits=False,
            logit_softclamp_value=50.0, selective=False, hard=False, cope=None, inverted_attention=False,
            flash_pack_seq=False)


class Attend(nn.Module):
    """Softmax attention over given queries, keys and values (x-transformers' ``Attend``).

    Args:
        dropout: attention dropout (training only).
        causal: bottom-right aligned causal masking (a KV cache's alignment); a single query is not masked.
        heads: accepted (x-transformers uses it for talking heads and sinks); with ``head_learned_sink`` the
            number of query heads.
        scale: logit scale (default ``d ** -0.5``).
        qk_norm, flash, onnxable, sdp_kwargs: accepted; the kernel is chosen by ``attend`` (``backend``).
        add_zero_kv: one zero key and value before the others, seen by every query (no row is dead).
        head_learned_sink: a learned logit per head for a zero key/value (an attention sink).
        backend: ``attend``'s backend (``"auto"``).

    Other x-transformers options (talking heads, sparse top-k, sigmoid / hard / gumbel / L2 / signed
    attention, softclamp, inverted attention, custom score functions, packed sequences) are accepted at their
    defaults only: anything else is a ``TypeError`` naming the option.
    """

    def __init__(self, *, dropout: float = 0.0, causal: bool = False, heads: int | None = None,
                 scale: float | None = None, qk_norm: bool = False, flash: bool = False, add_zero_kv: bool = False,
                 head_learned_sink: bool = False, onnxable: bool = False, sdp_kwargs: dict | None = None,
                 backend: str = "auto", **options):
        super().__init__()
        for name, value in options.items():
            if name not in _OFF:
                raise TypeError(f"Attend.__init__() got an unexpected keyword argument {name!r}")
            if value != _OFF[name]:
                raise TypeError(f"Attend: x-transformers' option {name}={value!r} is not supported by safeformer's "
                                f"Attend (use safeformer's Attention for the options it has)")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if head_learned_sink and add_zero_kv:
            raise ValueError("choose one of add_zero_kv and head_learned_sink (each is one extra zero key)")
        if head_learned_sink and not heads:
            raise ValueError("head_learned_sink needs heads (the number of query heads)")
        self.dropout = float(dropout)
        self.causal = bool(causal)
        self.scale = scale
        self.add_zero_kv = bool(add_zero_kv)
        self.backend = backend
        self.head_attn_sink = nn.Parameter(torch.zeros(heads)) if head_learned_sink else None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, attn_bias: Tensor | None = None,
                prev_attn: Tensor | None = None, attn_delta: Tensor | None = None, row_mask: Tensor | None = None,
                flash_pack_seq_kwargs: dict | None = None, causal: bool | None = None) -> tuple[Tensor, AttnIntermediate]:
        """Attend.

        Args:
            q: ``(b, h, i, d)``; k, v: ``(b, h_kv, j, d)`` (``h % h_kv == 0``).
            mask: bool, True = may attend: ``(b, j)`` key padding or anything broadcastable to ``(b, h, i, j)``.
            attn_bias: additive float bias broadcastable to ``(b, h, i, j)``.
            row_mask: ``(b, i)`` bool, False = this query attends to nothing (its output is exactly 0).
            causal: overrides the module's ``causal`` for this call.
            prev_attn, attn_delta, flash_pack_seq_kwargs: x-transformers' residual attention, attention
                deltas and packed sequences: only ``None`` is accepted.

        Returns:
            ``(out (b, h, i, d), intermediates)``; the intermediates hold no weights (as x-transformers' flash
            path).
        """
        for name, value in (("prev_attn", prev_attn), ("attn_delta", attn_delta),
                            ("flash_pack_seq_kwargs", flash_pack_seq_kwargs)):
            if value is not None:
                raise TypeError(f"Attend: {name} is not supported by safeformer's Attend (pass None)")
        if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)):
            raise ValueError("q, k and v must be (b, h, n, d) tensors")
        b, h, i, _ = q.shape
        causal = self.causal if causal is None else bool(causal)
        if causal and i == 1:  # x-transformers: a single query sees every key
            causal = False
        if mask is not None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool):
            raise TypeError("mask must be a bool tensor (True = may attend)")
        if row_mask is not None:
            if not isinstance(row_mask, Tensor) or row_mask.dtype != torch.bool or row_mask.shape != (b, i):
                raise ValueError(f"row_mask must be a (b, i) = ({b}, {i}) bool tensor")
            rows = row_mask[:, None, :, None]
            if mask is None:
                mask = rows
            else:
                mask = (mask[:, None, None, :] if mask.dim() == 2 else mask) & rows
        if self.add_zero_kv or self.head_attn_sink is not None:
            # the zero key goes first: bottom-right aligned causality keeps it visible to every query
            k, v, mask, attn_bias = self._zero_key(q, k, v, mask, attn_bias)
        if 1 < k.shape[1] < h and h % k.shape[1] == 0:  # x-transformers' pairing: query head n reads n % h_kv
            k, v = k.repeat(1, h // k.shape[1], 1, 1), v.repeat(1, h // v.shape[1], 1, 1)
        out = attend(q, k, v, mask=mask, causal=causal, bias=attn_bias, scale=self.scale,
                     dropout_p=self.dropout if self.training else 0.0, backend=self.backend)
        return out, AttnIntermediate(post_softmax_attn=None, layer_type=None)

    def _zero_key(self, q, k, v, mask, bias):
        b, h, i, _ = q.shape
        k = torch.cat((k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3]), k), dim=2)
        v = torch.cat((v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3]), v), dim=2)
        if mask is not None:
            full = mask[:, None, None, :] if mask.dim() == 2 else mask
            while full.dim() < 4:
                full = full[None]
            mask = torch.cat((torch.ones_like(full[..., :1]), full), dim=-1)
        if self.head_attn_sink is not None:
            if self.head_attn_sink.shape[0] != h:
                raise ValueError(f"head_learned_sink was built for {self.head_attn_sink.shape[0]} heads, got {h}")
            sink = self.head_attn_sink.to(q.dtype).view(1, h, 1, 1).expand(b, h, i, 1)
            rest = torch.zeros(b, h, i, k.shape[2] - 1, dtype=q.dtype, device=q.device) if bias is None else \
                torch.broadcast_to(bias, (b, h, i, k.shape[2] - 1))
            bias = torch.cat((sink, rest), dim=-1)
        elif bias is not None:
            bias = torch.cat((torch.zeros_like(torch.broadcast_to(bias, (b, h, i, bias.shape[-1]))[..., :1]),
                              torch.broadcast_to(bias, (b, h, i, bias.shape[-1]))), dim=-1)
        return k, v, mask, bias
