"""x-transformers' ``Attend`` (``x_transformers.attend.Attend``): the scoring part of an attention, on safeformer's
``attend``.

It is two things, as in x-transformers:

- the part ``Attention.attend`` that owns the options turning logits into weights (sigmoid, hard, gumbel softmax,
  sparse top-k, l2 distance, cog, inverted, selective, talking heads, a custom attention function, CoPE, the
  learned sink) and their parameters, under x-transformers' state-dict keys (``attend.head_attn_sink``,
  ``attend.pre_softmax_talking_heads.weight``, ``attend.cope.pos_emb``); ``Attention`` reads its options from it;
- a module projects use on its own for the attention of their own blocks (joint text-image attention, robotics
  heads): ``Attend(dropout=..., causal=...)(q, k, v, mask=...)`` returning ``(out, intermediates)``.

Used alone, a query whose keys are all masked gives exactly 0 with zero gradient (x-transformers gives 0 there too,
but NaN planted in a masked key or value reaches its output as ``0 * NaN``), masked keys and values never reach an
output or a gradient, and plain softmax attention keeps the fused kernels (the scoring options run the explicit
float32 path, ``attention_scoring._explicit_attention``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attend import attend, sdpa_allowed_from_kwargs
from ..core.cache import AttnIntermediate
from ..core.masks import packed_sequence_mask
from .attention_scoring import CoPE, ScoringOptions, _explicit_attention, init_scoring
from .options import unknown_keyword

__all__ = ["Attend"]

_SDP_DEFAULT = dict(enable_flash=True, enable_math=True, enable_mem_efficient=True)


class Attend(nn.Module):
    """Attention over given queries, keys and values (x-transformers' ``Attend``), and ``Attention``'s scoring part.

    Args (x-transformers' keywords and meanings):
        dropout: attention dropout (training only).
        causal: bottom-right aligned causal masking (a KV cache's alignment); a single query is not masked.
        heads: the number of query heads (talking heads and the learned sink need it).
        pre_talking_heads, post_talking_heads, pre_scale_post_talking_heads: learned ``(h, h)`` mixes of the heads'
            logits / weights (``Conv2d(h, h, 1)``, the identity at init).
        sparse_topk, sparse_topk_straight_through: each query keeps its ``sparse_topk`` largest live logits.
        scale: logit scale (default ``d ** -0.5``).
        qk_norm, flash, onnxable: accepted (the kernel is chosen by ``attend``; weights are float32 on the
            explicit path either way).
        l2_distance: logits ``-|q - k|^2 * scale``.
        sigmoid, hard, gumbel_softmax (``gumbel_softmax_temp``, ``gumbel_softmax_hard``), cog_signed: how the
            logits become weights (see ``attention_scoring``'s docstring).
        custom_attn_fn: a callable ``logits (b, h, i, j) -> weights`` in place of the softmax. As in x-transformers,
            masked logits reach it as ``-finfo.max``; here the weights of masked keys and of queries that may attend
            to nothing are then set to exactly 0 (whatever the function gives there), so no masked value reaches the
            output.
        softclamp_logits, logit_softclamp_value: ``tanh(logits / v) * v`` before masking.
        add_zero_kv: one zero key and value before the others, seen by every query (no row is dead).
        head_learned_sink: a learned logit per head for a zero key/value (an attention sink).
        selective: selective attention (causal only).
        cope: a ``CoPE`` module (contextual positions), or ``None``.
        inverted_attention: each key's weights are a softmax over the queries that may see it, then L1 over the keys.
        sdp_kwargs: the SDPA kernels the fused path may choose among (``enable_flash``, ``enable_mem_efficient``,
            ``enable_math``, ``enable_cudnn``), x-transformers' ``torch.backends.cuda.sdp_kernel`` keywords.
        flash_pack_seq: calls take ``flash_pack_seq_kwargs`` (flash-attn's ``cu_seqlens_q`` / ``cu_seqlens_k``): one
            sequence of packed documents, each query seeing the keys of its own document (a block-diagonal mask on
            safeformer's kernels; x-transformers needs the flash-attn package on CUDA).
        backend: ``attend``'s backend (``"auto"``).
        **scoring: the other fields of the scoring family (``attention_scoring.ScoringOptions``).
    """

    def __init__(self, *, dropout: float = 0.0, causal: bool = False, heads: int | None = None,
                 pre_talking_heads: bool = False, post_talking_heads: bool = False,
                 pre_scale_post_talking_heads: bool = False, sparse_topk: int | None = None,
                 sparse_topk_straight_through: bool = False, scale: float | None = None, qk_norm: bool = False,
                 l2_distance: bool = False, sigmoid: bool = False, gumbel_softmax: bool = False,
                 gumbel_softmax_temp: float = 1.0, gumbel_softmax_hard: bool = True, cog_signed: bool = False,
                 custom_attn_fn=None, flash: bool = False, softclamp_logits: bool = False,
                 logit_softclamp_value: float = 50.0, add_zero_kv: bool = False, head_learned_sink: bool = False,
                 selective: bool = False, hard: bool = False, cope: nn.Module | None = None, onnxable: bool = False,
                 inverted_attention: bool = False, sdp_kwargs: dict | None = None, flash_pack_seq: bool = False,
                 backend: str = "auto", **scoring):
        super().__init__()
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale)):
            raise ValueError(f"scale must be a finite number or None, got {scale!r}")
        if head_learned_sink and add_zero_kv:
            raise ValueError("choose one of add_zero_kv and head_learned_sink (each is one extra zero key)")
        if head_learned_sink and not heads:
            raise ValueError("head_learned_sink needs heads (the number of query heads)")
        if head_learned_sink and inverted_attention:
            raise ValueError("inverted_attention with a learned sink is not supported (the sink's weight would be "
                             "normalised over the queries)")
        if softclamp_logits and not (isinstance(logit_softclamp_value, (int, float)) and math.isfinite(
                logit_softclamp_value) and logit_softclamp_value > 0 and not isinstance(logit_softclamp_value, bool)):
            raise ValueError(f"logit_softclamp_value must be a positive finite number, got {logit_softclamp_value!r}")
        if cope is not None and not isinstance(cope, CoPE):
            raise TypeError(f"cope must be a safeformer CoPE module or None, got {type(cope).__name__}")
        if not isinstance(flash_pack_seq, bool):
            raise TypeError(f"flash_pack_seq must be True or False, got {flash_pack_seq!r}")
        self.flash_pack_seq = flash_pack_seq
        given = locals()
        for key in scoring:  # the scoring family's other fields (safeformer's own options) are keywords too
            if key not in ScoringOptions.names():
                raise unknown_keyword("Attend", key, [*ScoringOptions.names(), *given])
        init_scoring(self, ScoringOptions(**{n: given[n] for n in ScoringOptions.names() if n in given}, **scoring),
                     causal, heads)
        self.sdpa_allowed = sdpa_allowed_from_kwargs(_SDP_DEFAULT if sdp_kwargs is None else sdp_kwargs,
                                                     "sdp_kwargs (attend_sdp_kwargs)")
        self.dropout = float(dropout)
        self.causal = causal
        self.scale = None if scale is None else float(scale)
        self.add_zero_kv = bool(add_zero_kv)
        self.backend = backend
        self.softclamp_value = float(logit_softclamp_value) if softclamp_logits else None
        self.head_attn_sink = nn.Parameter(torch.zeros(heads)) if head_learned_sink else None
        self.cope = cope
        self.kv_tiled = True  # x-transformers' grouped heads: query head n reads key/value head n % h_kv
        self.laser_value = None  # LASER is an Attention option (its values)

    @property
    def explicit(self) -> bool:
        """Whether a call runs the explicit float32 path (a scoring option no fused kernel has)."""
        return bool(self.options_explicit or self.cope is not None or self.softclamp_value is not None
                    or self.l2_distance)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, attn_bias: Tensor | None = None,
                prev_attn: Tensor | None = None, attn_delta: Tensor | None = None, row_mask: Tensor | None = None,
                flash_pack_seq_kwargs: dict | None = None, causal: bool | None = None) -> tuple[Tensor, AttnIntermediate]:
        """Attend.

        Args:
            q: ``(b, h, i, d)``; k: ``(b, h_kv, j, d)``; v: ``(b, h_kv, j, e)`` (``h % h_kv == 0``).
            mask: bool, True = may attend: ``(b, j)`` key padding or anything broadcastable to ``(b, h, i, j)``.
            attn_bias: additive float bias broadcastable to ``(b, h, i, j)``.
            prev_attn: residual attention: the logits ``(b|1, h, i, j)`` of the attention before, added to these.
            attn_delta: ``(b|1, h, i, j)`` added to the weights after the softmax (x-transformers'); at masked keys
                and dead rows it adds nothing here.
            row_mask: ``(b, i)`` bool, False = this query attends to nothing (its output is exactly 0).
            causal: overrides the module's ``causal`` for this call.
            flash_pack_seq_kwargs: with ``flash_pack_seq``, the packed documents' offsets (batch 1, no ``mask``).

        Returns:
            ``(out (b, h, i, e), intermediates)``: on the explicit path (a scoring option, ``prev_attn`` or
            ``attn_delta``) the intermediates hold the weights and logits; on the fused path none (as x-transformers'
            flash path).
        """
        if flash_pack_seq_kwargs is not None:
            if not self.flash_pack_seq:
                raise TypeError("flash_pack_seq_kwargs needs Attend(flash_pack_seq=True)")
            if q.shape[0] != 1 or mask is not None:
                raise ValueError("flash_pack_seq_kwargs describe one packed sequence (batch 1): not with mask")
            mask = packed_sequence_mask(flash_pack_seq_kwargs, q.shape[2], k.shape[2], q.device)
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
            mask = rows if mask is None else (mask[:, None, None, :] if mask.dim() == 2 else mask) & rows
        if self.head_attn_sink is not None and self.head_attn_sink.shape[0] != h:
            raise ValueError(f"head_learned_sink was built for {self.head_attn_sink.shape[0]} heads, got {h}")
        if k.shape[1] != h and (h % k.shape[1] != 0):
            raise ValueError(f"the query heads ({h}) must be a multiple of the key/value heads ({k.shape[1]})")
        extra = self.add_zero_kv or self.head_attn_sink is not None
        if self.explicit or prev_attn is not None or attn_delta is not None:
            return self._explicit(q, k, v, mask, attn_bias, prev_attn, attn_delta, causal, extra)
        if extra:  # the zero key goes first: bottom-right aligned causality keeps it visible to every query
            k, v, mask, attn_bias = self._zero_key(q, k, v, mask, attn_bias, sink_bias=True)
        if 1 < k.shape[1] < h:  # x-transformers' pairing: query head n reads n % h_kv
            k, v = k.repeat(1, h // k.shape[1], 1, 1), v.repeat(1, h // v.shape[1], 1, 1)
        backend = self.sdpa_allowed if self.sdpa_allowed is not None and self.backend == "auto" else self.backend
        out = attend(q, k, v, mask=mask, causal=causal, bias=attn_bias, scale=self.scale,
                     dropout_p=self.dropout if self.training else 0.0, backend=backend)
        return out, AttnIntermediate(post_softmax_attn=None, layer_type=None)

    def _explicit(self, q, k, v, mask, bias, prev_attn, attn_delta, causal, extra):
        """The explicit float32 path of a standalone call (``_explicit_attention`` with this module's options; it
        checks ``prev_attn`` and ``attn_delta`` against the logits' shape)."""
        if extra:  # the zero key first; its logit gains no prev_attn and its weight no delta (x-transformers pads too)
            k, v, mask, bias = self._zero_key(q, k, v, mask, bias, sink_bias=False)
            prev_attn, attn_delta = _zero_first(prev_attn, k.shape[2] - 1), _zero_first(attn_delta, k.shape[2] - 1)
        out, weights, logits = _explicit_attention(
            q, k, v, mask=mask, causal=causal, bias=bias, softclamp=self.softclamp_value,
            dropout_p=self.dropout if self.training else 0.0, sink=self.head_attn_sink, scoring=self,
            return_logits=True, prev_attn=prev_attn, scale=self.scale, attn_delta=attn_delta)
        return out, AttnIntermediate(post_softmax_attn=weights, layer_type=None, pre_softmax_attn=logits)

    def _zero_key(self, q, k, v, mask, bias, *, sink_bias: bool):
        """One zero key/value first (``add_zero_kv`` or the sink's), seen by every query; with ``sink_bias`` the
        sink's logit goes into the bias (the fused path); the explicit path writes it itself."""
        b, h, i, _ = q.shape
        k = torch.cat((k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3]), k), dim=2)
        v = torch.cat((v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3]), v), dim=2)
        if mask is not None:
            full = mask[:, None, None, :] if mask.dim() == 2 else mask
            while full.dim() < 4:
                full = full[None]
            mask = torch.cat((torch.ones_like(full[..., :1]), full), dim=-1)
        if self.head_attn_sink is not None and sink_bias:
            sink = self.head_attn_sink.to(q.dtype).view(1, h, 1, 1).expand(b, h, i, 1)
            rest = torch.zeros(b, h, i, k.shape[2] - 1, dtype=q.dtype, device=q.device) if bias is None else \
                torch.broadcast_to(bias, (b, h, i, k.shape[2] - 1))
            bias = torch.cat((sink, rest), dim=-1)
        elif bias is not None:
            bias = torch.cat((torch.zeros_like(torch.broadcast_to(bias, (b, h, i, bias.shape[-1]))[..., :1]),
                              torch.broadcast_to(bias, (b, h, i, bias.shape[-1]))), dim=-1)
        return k, v, mask, bias


def _zero_first(t, j: int):
    """``t (..., j|1)`` over the keys, with a 0 for the zero key put first; anything else as it is (the explicit path
    names a wrong shape)."""
    if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[-1] not in (1, j):
        return t
    return F.pad(t.expand(*t.shape[:-1], j), (1, 0))
