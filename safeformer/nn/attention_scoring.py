"""How ``Attention``'s logits become weights, and the attention call of each path.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys (sink and memory keys included), d head
dim, e value dim, P CoPE positions.

- the scoring options (x-transformers' ``Attend`` options: l2 distance, cog, sigmoid, gumbel softmax, inverted
  attention, LASER, CoPE) and logit softclamping, built and checked by ``init_scoring``; each runs the explicit
  float32 path, ``_explicit_attention``, which applies them in x-transformers' order (l2 distance alone runs the
  fused kernels through ``_l2_kernel_inputs``);
- the attention call of one forward: ``explicit_call`` (the explicit path, which also gives the weights) or
  ``kernel_call`` (``attend``, the fused kernels);
- ``log_prob_from_hard_attend``, read from a gumbel-softmax module's intermediates.

Safe like ``attend``: what a masked key or a dead row holds reaches no output and no gradient, and a dead row
outputs exactly 0.

``init_scoring``: The options that change how logits become weights, checked, set on ``attn`` (``l2_distance``, ``cog_signed``,

``inverted``, ``score``, ``gumbel_temp``, ``gumbel_hard``, ``laser_value``, ``cope``).

Args (``Attention``'s keywords):
    l2_distance: logits ``-|q - k|^2 * d ** -0.5`` (x-transformers' l2 distance attention).
    cog_signed: cog attention: the softmax of ``|logits|``, the weights given back the logits' signs (the sink's
        logit too); weights may be negative.
    sigmoid: weights ``sigmoid(logits)``, unnormalised (masked keys and dead rows 0).
    gumbel_softmax, gumbel_softmax_temp, gumbel_softmax_hard: weights sampled by a gumbel softmax of temperature
        ``gumbel_softmax_temp`` (hard: the one-hot of the sample with the soft weights' gradient); the noise is
        drawn in evaluation too, as x-transformers; ``log_prob_from_hard_attend`` reads the picked keys' log
        probabilities from the intermediates.
    inverted_attention: (cross-attention) each key's weights are a softmax over the queries that may see it (a
        padded query takes none), then each query's weights are L1-normalised over its keys; no KV cache, no
        memory keys or sink (``num_mem_kv``, ``learned_sink``: the module's, refused beside it).
    laser, laser_softclamp_value: LASER attention: ``log(weights @ exp(softclamp(v)))`` (a dead row stays 0, never
        ``log(0)``); not with ``cog_signed``.
    sparse_topk: x-transformers' sparse top-k attention: each query keeps its ``sparse_topk`` largest logits
        among the keys it may see (ties kept; all of them when fewer are live) and softmaxes over those; the
        others weigh exactly 0. Not with sigmoid, gumbel softmax, l2 distance or inverted attention.
        ``sparse_topk_straight_through``: the backward pass goes through the softmax over every live key (the
        forward stays the top-k one), as x-transformers'.
    pre_talking_heads, post_talking_heads, pre_scale_post_talking_heads: x-transformers' talking heads, each a
        learned ``(h, h)`` mix of the heads (``Conv2d(h, h, 1)``, the identity at init): of the logits before the
        softmax (added to them), of the weights after it, and a scale of the weights made from the logits. They
        mix only what a query may see: masked keys' logits enter as 0 and their weights stay 0, and a dead row
        stays 0 (x-transformers mixes the raw logits of masked keys too, which only differs when heads are masked
        differently).
    hard: x-transformers' hard attention: each query's weights are the one-hot of its largest live logit (the
        first on ties) forward, the softmax's gradient backward; a dead row stays 0.
    selective: x-transformers' selective attention (causal self-attention): head 0's positive logits let each token
        hide keys from the queries after it (``_selective``); padded queries hide nothing and a sample's first real
        key is never hidden; no KV cache.
    use_cope, cope_max_pos: contextual positions (CoPE, causal attention): a key's position is the sum of
        ``sigmoid(logit)`` over the visible keys from it on (masked keys count 0), its logit gains ``q . pos_emb``
        at that position (interpolated). ``cope_talking_heads`` / ``cope_soft_onehot_pos`` are refused.

These options (``cog_signed`` to ``use_cope``) run the explicit float32 attention: no fused kernel, padded path
only; ``l2_distance`` alone runs the fused kernels (``[2q, 1] . [k, -|k|^2]``), padded path only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attend import PreparedMask, SelectedMask, attend, from_kernel_heads, to_kernel_heads
from ..core.masks import as_attention_mask, causal_mask, combine_masks
from .attention_calls import AttentionModule, _positive_int, check_delta
from .modules import _rename_keys
from .options import Options, self_only


@dataclass(frozen=True)
class ScoringOptions(Options):
    """The keywords of x-transformers' ``Attend`` that change how logits become weights (``init_scoring``; their
    meanings are in this module's docstring): the options of ``Attention.attend``, the scoring part."""

    l2_distance: bool = False
    cog_signed: bool = False
    sigmoid: bool = False
    inverted_attention: bool = False
    gumbel_softmax: bool = False
    gumbel_softmax_temp: float = 1.0
    gumbel_softmax_hard: bool = True
    sparse_topk: int | None = None
    sparse_topk_straight_through: bool = False
    hard: bool = False
    pre_talking_heads: bool = False
    post_talking_heads: bool = False
    pre_scale_post_talking_heads: bool = False
    selective: bool = self_only(False)
    custom_attn_fn: Callable | None = None

    @property
    def explicit(self) -> bool:
        """Whether these options run the explicit float32 path (what no fused kernel does; l2 distance alone runs
        the kernels inside ``Attention``)."""
        return bool(self.cog_signed or self.sigmoid or self.inverted_attention or self.gumbel_softmax or self.hard
                    or self.sparse_topk is not None or self.pre_talking_heads or self.post_talking_heads
                    or self.pre_scale_post_talking_heads or self.selective or self.custom_attn_fn is not None)


@dataclass(frozen=True)
class LogitOptions(Options):
    """``Attention``'s own scoring keywords beside ``Attend``'s (``init_attention_scoring``): softclamped logits,
    LASER, CoPE and the SDPA kernels the fused path may choose among (``attend_sdp_kwargs``)."""

    softclamp_logits: bool = False
    logit_softclamp_value: float = 50.0
    laser: bool = False
    laser_softclamp_value: float = 15.0
    use_cope: bool = self_only(False)
    cope_max_pos: int = self_only(16)
    cope_soft_onehot_pos: bool = self_only(False)
    cope_talking_heads: bool = self_only(False)
    attend_sdp_kwargs: dict | None = None


def init_scoring(scorer: nn.Module, o: ScoringOptions, causal: bool, heads: int | None = 1) -> None:
    """The options of x-transformers' ``Attend`` that change how logits become weights, checked and set on ``scorer``
    (the ``Attend`` part: ``l2_distance``, ``cog_signed``, ``inverted``, ``score``, ``gumbel_temp``, ``gumbel_hard``,
    ``sparse_topk``, ``selective``, ``custom_attn_fn`` and the talking heads' convs); each keyword is documented in
    this module's docstring ("``init_scoring``")."""
    for name, on in (("l2_distance", o.l2_distance), ("cog_signed", o.cog_signed), ("sigmoid", o.sigmoid),
                     ("inverted_attention", o.inverted_attention), ("gumbel_softmax", o.gumbel_softmax),
                     ("gumbel_softmax_hard", o.gumbel_softmax_hard), ("hard", o.hard), ("selective", o.selective),
                     ("sparse_topk_straight_through", o.sparse_topk_straight_through),
                     ("pre_talking_heads", o.pre_talking_heads), ("post_talking_heads", o.post_talking_heads),
                     ("pre_scale_post_talking_heads", o.pre_scale_post_talking_heads)):
        if not isinstance(on, bool):
            raise TypeError(f"{name} must be True or False, got {on!r}")
    if o.custom_attn_fn is not None and not callable(o.custom_attn_fn):
        raise TypeError(f"custom_attn_fn must be a callable (logits -> weights), got {type(o.custom_attn_fn).__name__}")
    if sum(map(bool, (o.l2_distance, o.sigmoid, o.gumbel_softmax, o.hard, o.sparse_topk is not None))) > 1:
        raise ValueError("choose at most one of l2_distance, sigmoid, gumbel_softmax, hard and sparse_topk")
    if o.custom_attn_fn is not None and (o.sigmoid or o.gumbel_softmax or o.hard or o.sparse_topk is not None):
        raise ValueError("custom_attn_fn replaces the softmax: not with sigmoid, gumbel_softmax, hard or sparse_topk "
                         "(x-transformers would ignore them)")
    if not (isinstance(o.gumbel_softmax_temp, (int, float)) and not isinstance(o.gumbel_softmax_temp, bool)
            and math.isfinite(o.gumbel_softmax_temp) and o.gumbel_softmax_temp > 0):
        raise ValueError(f"gumbel_softmax_temp must be a positive finite number, got {o.gumbel_softmax_temp!r}")
    if o.sparse_topk is not None:
        if not _positive_int(o.sparse_topk):
            raise ValueError(f"sparse_topk must be a positive integer, got {o.sparse_topk!r}")
        if o.sigmoid or o.gumbel_softmax or o.l2_distance or o.inverted_attention:
            raise ValueError("sparse_topk keeps the top logits of a softmax: not with sigmoid, gumbel_softmax, "
                             "l2_distance or inverted_attention")
    if o.sparse_topk_straight_through and o.sparse_topk is None:
        raise ValueError("sparse_topk_straight_through needs sparse_topk")
    talking = o.pre_talking_heads or o.post_talking_heads or o.pre_scale_post_talking_heads
    if talking and o.inverted_attention:
        raise ValueError("talking heads mix the heads' logits over the keys: not with inverted_attention")
    if talking and not _positive_int(heads):
        raise ValueError(f"talking heads mix the heads: heads must be a positive integer, got {heads!r}")
    for name, on in (("pre_softmax_talking_heads", o.pre_talking_heads),
                     ("post_softmax_talking_heads", o.post_talking_heads),
                     ("pre_scale_post_talking_heads", o.pre_scale_post_talking_heads)):
        conv = None
        if on:  # x-transformers' Conv2d(h, h, 1, bias=False), the identity (dirac) at init
            conv = nn.Conv2d(heads, heads, 1, bias=False)
            nn.init.dirac_(conv.weight)
        setattr(scorer, name, conv)  # x-transformers' keys: attend.<name>.weight
    if o.selective and (not causal or o.inverted_attention):
        raise ValueError("selective attention lets a token hide itself from later queries: it needs causal=True "
                         "(x-transformers' too)")
    scorer.selective = o.selective
    scorer.sparse_topk = o.sparse_topk
    scorer.sparse_topk_straight_through = o.sparse_topk_straight_through
    scorer.l2_distance = o.l2_distance
    scorer.cog_signed = o.cog_signed
    scorer.inverted = o.inverted_attention
    scorer.custom_attn_fn = o.custom_attn_fn
    scorer.score = ("custom" if o.custom_attn_fn is not None else "sigmoid" if o.sigmoid else "gumbel" if o.gumbel_softmax
                    else "hard" if o.hard else "softmax")
    scorer.gumbel_temp, scorer.gumbel_hard = float(o.gumbel_softmax_temp), o.gumbel_softmax_hard
    scorer.options_explicit = o.explicit  # the family says which path its options need


def init_attention_scoring(attn: AttentionModule, o: LogitOptions, dim_head: int, causal: bool, num_mem_kv: int,
                           learned_sink: bool) -> None:
    """``Attention``'s own scoring keywords (x-transformers' ``Attention`` ones, beside its ``Attend``'s, which
    ``attn.attend`` holds): LASER (``laser_value``) and CoPE (``attend.cope``), and how they and the memory keys or sink
    sit with ``attn.attend``'s options; documented in this module's docstring ("``init_scoring``")."""
    scorer = attn.attend
    if scorer.inverted and (num_mem_kv or learned_sink):
        raise ValueError("inverted_attention with memory keys or a learned sink is not supported (every query, padded "
                         "ones too, would share their softmax over the queries)")
    if o.laser and scorer.cog_signed:
        raise ValueError("laser takes the log of weights @ exp(values): cog_signed's negative weights can make it "
                         "0 or negative (NaN in x-transformers); use one of them")
    if not (isinstance(o.laser_softclamp_value, (int, float)) and not isinstance(o.laser_softclamp_value, bool)
            and math.isfinite(o.laser_softclamp_value) and o.laser_softclamp_value > 0):
        raise ValueError(f"laser_softclamp_value must be a positive finite number, got {o.laser_softclamp_value!r}")
    if o.use_cope:
        if not causal:
            raise ValueError("use_cope (contextual positions) counts the keys up to each query: it needs causal=True")
        if o.cope_talking_heads or o.cope_soft_onehot_pos:
            raise ValueError("cope_talking_heads and cope_soft_onehot_pos are not supported (use_cope without them "
                             "is)")
        if not _positive_int(o.cope_max_pos):
            raise ValueError(f"cope_max_pos must be a positive integer, got {o.cope_max_pos!r}")
    elif o.cope_talking_heads or o.cope_soft_onehot_pos:
        raise ValueError("cope_talking_heads / cope_soft_onehot_pos were given but use_cope is off")
    attn.laser_value = float(o.laser_softclamp_value) if o.laser else None
    scorer.cope = CoPE(dim_head, o.cope_max_pos) if o.use_cope else None


def legacy_scorer_keys():
    """Earlier safeformer held the scorer's parameters on the attention itself: their keys move under ``attend.``."""
    names = ("head_attn_sink", "pre_softmax_talking_heads.weight", "post_softmax_talking_heads.weight",
             "pre_scale_post_talking_heads.weight", "cope.pos_emb")
    return _rename_keys({n: "attend." + n for n in names})


class CoPE(nn.Module):
    """Contextual position encoding (x-transformers' ``CoPE``, arXiv 2405.18719): a query's position of key ``j``
    is the sum of ``sigmoid(logit)`` over the visible keys from ``j`` on (clamped to ``max_pos - 1``), and its
    logit gains ``q . pos_emb[p]`` interpolated between the integer positions around it. Masked keys count 0
    (selected, never multiplied)."""

    def __init__(self, dim_head: int, max_pos: int):
        super().__init__()
        self.max_pos = max_pos
        self.pos_emb = nn.Parameter(torch.zeros(max_pos, dim_head))  # (P, d)

    def forward(self, q: Tensor, logits: Tensor, allowed: Tensor) -> Tensor:
        """``q (b, h, i, d)``, ``logits (b, h, i, j)`` (masked ones may be ``-inf``), ``allowed`` broadcastable
        to the logits -> the positions' logits ``(b, h, i, j)``."""
        gates = torch.where(allowed, torch.sigmoid(torch.where(allowed, logits, 0.0)), 0.0)
        pos = gates.flip(-1).cumsum(dim=-1).flip(-1).clamp(max=self.max_pos - 1)  # (b, h, i, j)
        logits_int = q @ self.pos_emb.to(q.dtype).t()  # (b, h, i, P)
        floor = pos.floor()
        w = pos - floor
        lo = logits_int.gather(-1, floor.long())
        hi = logits_int.gather(-1, pos.ceil().long())
        return hi * w + lo * (1 - w)


# ------------------------------------------------------------------------------------------------
# the attention call of one forward: the explicit path or the fused kernels
# ------------------------------------------------------------------------------------------------


def explicit_call(attn: AttentionModule, q: Tensor, k: Tensor, v: Tensor, mask, causal: bool, bias, self_pad,
                  return_attn: bool, prev_attn, attn_delta: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``attn``'s attention on the explicit path: ``q (b, h, i, d)``, ``k, v (b, h_kv, j, d)`` (the sink's key first,
    if any) -> ``(out (b, h, i, e), weights (b, h, i, j'), logits or None)``, the sink's column left out of the
    weights and logits (``j' = j - 1`` with a sink), and padded queries' rows (``self_pad (b, i)`` False) 0 in both;
    the logits only with ``return_attn``. ``prev_attn`` at padded queries' rows is selected to 0 first (their rows
    see keys in the kernel, but reach nothing)."""
    if self_pad is not None and isinstance(prev_attn, Tensor) and prev_attn.is_floating_point() \
            and prev_attn.dim() == 4 and prev_attn.shape[0] in (1, q.shape[0]) and prev_attn.shape[2] == q.shape[2] \
            and prev_attn.device == q.device:  # (the checks themselves are _explicit_logits')
        prev_attn = torch.where(self_pad[:, None, :, None], prev_attn, 0.0)
    if attn.head_attn_sink is not None and isinstance(prev_attn, Tensor) and prev_attn.dim() == 4 \
            and prev_attn.shape[-1] == k.shape[2] - 1:  # the logits handed on leave the sink's column out (below):
        prev_attn = F.pad(prev_attn, (1, 0))  # the sink's logit is this attention's own, never the one before
    if attn.inverted and self_pad is not None:  # a padded query takes no share of a key's weights over the queries
        m = mask.combined if isinstance(mask, PreparedMask) else mask
        rows = self_pad[:, None, :, None]
        mask = rows if m is None else as_attention_mask(m, q.shape[0], q.shape[1], q.shape[2], k.shape[2]) & rows
    out, weights, *more = _explicit_attention(
        q, k, v, mask=mask, causal=causal, bias=bias, softclamp=attn.softclamp_value,
        dropout_p=attn.dropout if attn.training else 0.0, sink=attn.head_attn_sink, scoring=attn,
        return_logits=return_attn, prev_attn=prev_attn, attn_delta=attn_delta,
    )
    logits = more[0] if more else None
    if attn.head_attn_sink is not None:
        weights = weights[..., 1:]  # the sink's weight is not a key's
        logits = None if logits is None else logits[..., 1:]
    if self_pad is not None:
        weights = torch.where(self_pad[:, None, :, None], weights, 0.0)
        logits = None if logits is None else torch.where(self_pad[:, None, :, None], logits, 0.0)
    return out, weights, logits


def kernel_call(attn: AttentionModule, q: Tensor, k: Tensor, v: Tensor, mask, causal: bool, bias, keys_ok,
                selected: bool) -> Tensor:
    """``attn``'s attention through ``attend`` (the fused kernels): ``q (b, h, i, d)``, ``k (b, h_kv, j, d|2d)``,
    ``v (b, h_kv, j, e)`` -> ``out (b, h, i, e)``. ``keys_ok (b|1, j)``: the keys some query sees, which l2 distance
    selects before ``|k|^2``.

    ``selected``: whether q at dead rows and k, v at masked keys are finite already, so that ``attend`` is told so
    and selects nothing. New q, k, v are (their inputs were selected to 0 before the projections); keys/values handed
    in (``kv``, ``past_kv``) are input like any other, which ``attend`` selects itself unless the stack vouches for
    them (its own cache, a ``SelectedMask``); a bias can mask keys too, and then ``attend`` selects as well (its
    selections also guard the gradients)."""
    backend = attn.backend
    if backend == "auto" and attn.attend.sdpa_allowed is not None:  # attend_sdp_kwargs: among these kernels only
        backend = attn.attend.sdpa_allowed
    if backend in ("flash", "cudnn") and ((attn.head_attn_sink is not None and torch.is_grad_enabled())
                                          or attn.to_forget_gates is not None or k.shape[-1] != v.shape[-1]
                                          or (bias is not None and bias.requires_grad)):
        backend = "math"  # the sink's gradient and learned biases (forget gates, T5) flow through the mask;
        # PoPE's keys (2 d features) differ from the values' d, which those kernels refuse
    e, scale = v.shape[-1], None
    if attn.l2_distance:  # -|q - k|^2 * scale through the kernel (softmax alone: explicit otherwise)
        q, k, v = _l2_kernel_inputs(q, k, v, keys_ok)
        scale = attn.dim_head**-0.5
    grouped = k.shape[1] != q.shape[1]  # keys still per key/value head (not expanded to the query heads)
    if grouped:
        q, mask, bias = to_kernel_heads(attn, q, mask, bias)
    out = attend(
        q, k, v, mask=SelectedMask(mask) if selected else mask, causal=causal, bias=bias,
        dropout_p=attn.dropout if attn.training else 0.0, backend=backend, scale=scale,
    )[..., :e]  # (b, h, i, d)
    return from_kernel_heads(attn, out) if grouped else out


def _l2_kernel_inputs(q: Tensor, k: Tensor, v: Tensor, keys_ok: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """l2-distance attention as a dot product for the fused kernels: ``[2q, 1] . [k, -|k|^2] = -|q - k|^2 + |q|^2``,
    the row's constant ``|q|^2`` cancelling in the softmax. q, k and v are zero-padded to one head dim, a multiple of
    8 (what the fused kernels take); the caller keeps the first ``d`` output features. ``keys_ok (b|1, j)``: masked
    keys selected to 0 before ``|k|^2`` (else a NaN held there would reach its gradient as ``0 * NaN``)."""
    d = q.shape[-1]
    width = -(-(d + 1) // 8) * 8
    if keys_ok is not None and keys_ok.shape[-1] == k.shape[2]:
        k = torch.where(keys_ok[:, None, :, None], k, 0.0)
    kf = k.to(torch.promote_types(k.dtype, torch.float32))
    norm = (kf * kf).sum(-1, keepdim=True).to(k.dtype)  # (b, h_kv, j, 1), summed in float32 at least
    q2 = F.pad(torch.cat((2 * q, torch.ones_like(q[..., :1])), dim=-1), (0, width - d - 1))
    k2 = F.pad(torch.cat((k, -norm), dim=-1), (0, width - d - 1))
    return q2, k2, F.pad(v, (0, width - v.shape[-1]))


# ------------------------------------------------------------------------------------------------
# the explicit float32 path
# ------------------------------------------------------------------------------------------------


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, *, mask=None, causal: bool = False, bias: Tensor | None = None,
                        softclamp: float | None = None, dropout_p: float = 0.0,
                        sink: Tensor | None = None, scoring: AttentionModule | None = None,
                        return_logits: bool = False, prev_attn: Tensor | None = None, scale: float | None = None,
                        attn_delta: Tensor | None = None) -> tuple[Tensor, ...]:
    """Attention written out in float32 (float64 for float64 inputs), returning its weights too.

    For what no fused kernel does: the weights themselves (``return_attn``), logit softclamping
    (``tanh(logits / s) * s``, after the bias and before the mask, as x-transformers) and the scoring options of
    ``scoring`` (an ``Attention``: ``l2_distance``, ``cog_signed``, ``use_cope``, ``sigmoid``, ``gumbel_softmax``,
    ``inverted_attention``, ``laser``), in x-transformers' order: logits (``-|q - k|^2 * scale`` with
    l2 distance), bias, softclamp, cog's sign taken off, masking, CoPE, sink, then softmax / sigmoid / gumbel
    softmax over the keys (over the queries with inverted attention, then L1-normalised over the keys), cog's sign
    put back, weights times values (``log(weights @ exp(softclamp(v)))`` with laser).

    Safe like ``attend``: q at dead rows and k, v at masked keys are selected to 0 first (no ``0 * NaN``), masked
    logits are selected to ``-inf``, a dead row's logits to 0, and the weights of masked keys and dead rows to
    exactly 0 afterwards, so a dead row outputs 0 with zero gradient.

    ``sink (h,)``: key 0 is a learned sink whose logit is ``sink[h]`` (not clamped).

    ``prev_attn (b|1, h, i, j)``: x-transformers' residual attention, the logits of the layer before, added to the
    scaled logits before the bias (its masked entries selected to 0 first: a ``-inf`` there reaches nothing).

    ``scale``: the logit scale (default ``d ** -0.5``). ``attn_delta (b|1, h, i, j)``: added to the weights after the
    softmax (x-transformers' ``Attend``), at live entries only (a masked key or a dead row stays 0).

    Returns:
        ``out (b, h, i, e)`` in q's dtype and ``weights (b, h, i, j)`` in float32 (or float64); with
        ``return_logits`` also the logits the weights came from (masked keys ``-inf``, dead rows 0).
    """
    b, h, i, d = q.shape
    hkv, j = k.shape[1], k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    if isinstance(mask, PreparedMask):
        mask = mask.combined
    m = None if mask is None else as_attention_mask(mask, b, h, i, j)
    reach = None
    if bias is not None:  # -inf in q's dtype masks its key, as in attend (-1e9 in float16 included)
        reach = bias.to(q.dtype) != float("-inf")
        bias = bias.to(dtype)
    c = causal_mask(i, j, device=q.device) if causal and i > 1 or (causal and i > j) else None
    if c is not None and c.dim() < 4:
        c = c.reshape((1,) * (4 - c.dim()) + tuple(c.shape))
    combined = combine_masks(m, c, reach)
    if combined is not None and combined.dim() < 4:
        combined = combined.reshape((1,) * (4 - combined.dim()) + tuple(combined.shape))
    if hkv != h and scoring is not None and scoring.kv_tiled:  # x-transformers' query head n reads n % h_kv
        k, v = k.repeat(1, h // hkv, 1, 1), v.repeat(1, h // hkv, 1, 1)
    elif hkv != h:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    if j == 0:
        w = q.new_zeros(b, h, i, 0, dtype=dtype) + (q.sum() + k.sum() + v.sum()) * 0
        out = w.new_zeros(b, h, i, v.shape[-1]).to(q.dtype) + w.sum() * 0
        return (out, w, w) if return_logits else (out, w)
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    row_ok = col_ok = None
    if combined is not None:
        row_ok = combined.any(dim=-1, keepdim=True)  # (b|1, h|1, i, 1)
        key_ok = combined.any(dim=-2, keepdim=True).transpose(-1, -2)  # (b|1, h|1, j, 1)
        col_ok = key_ok.transpose(-1, -2)  # (b|1, h|1, 1, j)
        qf = torch.where(row_ok, qf, 0.0)
        kf, vf = torch.where(key_ok, kf, 0.0), torch.where(key_ok, vf, 0.0)
    logits, sign, pre_scale = _explicit_logits(qf, kf, combined, reach, bias, softclamp, sink, scoring, prev_attn,
                                               scale)
    weights, live = _explicit_weights(logits, combined, row_ok, col_ok, sign, scoring, dropout_p, pre_scale,
                                      attn_delta)
    out = _explicit_values(weights, vf, row_ok, sink, scoring)
    if return_logits:
        if live is not None:
            logits = torch.where(combined, logits, float("-inf"))
            logits = torch.where(row_ok, logits, 0.0)
        return out.to(q.dtype), weights, logits
    return out.to(q.dtype), weights


def _explicit_logits(qf: Tensor, kf: Tensor, combined: Tensor | None, reach: Tensor | None, bias: Tensor | None,
                     softclamp: float | None, sink: Tensor | None, opt: AttentionModule | None,
                     prev_attn: Tensor | None, scale: float | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The explicit path's logits ``(b, h, i, j)`` from ``qf (b, h, i, d)`` and ``kf (b, h, j, d)`` (float32 or
    float64, selected already): scaled dot products (or l2 distances), plus ``prev_attn`` and the bias (``reach``:
    where it is not ``-inf``), softclamped, cog's sign taken off, masked to ``-inf`` where ``combined`` is False,
    CoPE's position logits added, the sink's logit in column 0. Returns ``(logits, sign, pre_scale)``, ``sign`` the
    cog signs (``None`` without ``cog_signed``), ``pre_scale`` the talking heads' scale of the weights (or ``None``)."""
    b, h, i, d = qf.shape
    j = kf.shape[2]
    dtype = qf.dtype
    scale = d**-0.5 if scale is None else scale
    if opt is not None and opt.l2_distance:  # -|q - k|^2 * scale (x-transformers' l2 distance attention)
        sq = (qf * qf).sum(-1, keepdim=True) + (kf * kf).sum(-1)[..., None, :] - 2 * (qf @ kf.transpose(-1, -2))
        logits = -sq.clamp_min(0.0) * scale  # (b, h, i, j)
    else:
        logits = (qf @ kf.transpose(-1, -2)) * scale  # (b, h, i, j)
    if prev_attn is not None:  # residual attention: the previous layer's logits (masked there or here: 0)
        if not isinstance(prev_attn, Tensor) or not prev_attn.is_floating_point():
            raise TypeError(f"prev_attn (residual attention) must be float logits, got "
                            f"{getattr(prev_attn, 'dtype', type(prev_attn))}")
        if prev_attn.dim() != 4 or tuple(prev_attn.shape[-3:]) != (h, i, j) or prev_attn.shape[0] not in (1, b):
            raise ValueError(f"prev_attn (residual attention) must be the logits (b={b}|1, h={h}, i={i}, j={j}) of the "
                             f"attention before, got {tuple(prev_attn.shape)}")
        if prev_attn.device != qf.device:
            raise ValueError(f"prev_attn is on {prev_attn.device}, expected {qf.device} (the device of the queries)")
        prev = prev_attn.to(dtype)
        logits = logits + (prev if combined is None else torch.where(combined, prev, 0.0))
    pre_scale = None
    if opt is not None and (opt.pre_softmax_talking_heads is not None or opt.pre_scale_post_talking_heads is not None):
        seen = logits if combined is None else torch.where(combined, logits, 0.0)  # what a query may see, mixed
        if opt.pre_scale_post_talking_heads is not None:
            pre_scale = _mix_heads(opt.pre_scale_post_talking_heads, seen)
        if opt.pre_softmax_talking_heads is not None:
            logits = logits + _mix_heads(opt.pre_softmax_talking_heads, seen)
    if bias is not None:  # the bias first, then the clamp (x-transformers' order); -inf is masked below
        logits = logits + torch.where(reach, bias, 0.0)
    if softclamp is not None:
        logits = torch.tanh(logits / softclamp) * softclamp
    sign = None
    if opt is not None and opt.cog_signed:  # cog attention: softmax of |logits|, weights signed back
        sign, logits = logits.sign(), logits.abs()
    if combined is not None:
        logits = torch.where(combined, logits, float("-inf"))
    if opt is not None and opt.cope is not None:  # contextual positions from the gates of the visible keys
        allowed = combined if combined is not None else torch.ones(1, 1, 1, j, dtype=torch.bool, device=qf.device)
        if sink is not None:  # the sink is no key of the sequence (x-transformers adds it after CoPE)
            allowed = allowed & (torch.arange(j, device=qf.device) > 0)
        pos_logits = opt.cope(qf, logits, allowed)
        logits = logits + pos_logits if combined is None else torch.where(combined, logits + pos_logits, float("-inf"))
    if opt is not None and opt.selective:  # x-transformers' selective attention, after CoPE, before the sink
        logits = _selective(logits, combined)
    if sink is not None:  # key 0 is the sink: its logit is the learned one, never clamped (x-transformers)
        s = sink.to(dtype)[None, :, None, None].expand(b, h, i, 1)
        if sign is not None:
            sign = torch.cat((s.sign(), sign[..., 1:].expand(b, h, i, j - 1)), dim=-1)
            s = s.abs()
        logits = torch.cat((s, logits[..., 1:].expand(b, h, i, j - 1)), dim=-1)
    return logits, sign, pre_scale


def _selective(logits: Tensor, combined: Tensor | None) -> Tensor:
    """x-transformers' selective attention (https://arxiv.org/abs/2410.02703, 3.3): head 0's positive logits are
    gates by which each query hides keys from the queries after it, summed down the queries and taken off every head's
    logits. The first new key, a query's own key and keys before the new ones (memory, sink, cache) are never
    hidden. Only what a query may see gates: masked entries and dead rows (padded queries) add nothing, whatever
    their logits, so padding in front of a sequence hides nothing (x-transformers' padded queries gate too)."""
    i, j = logits.shape[-2:]
    head = logits[:, 0]  # (b, i, j)
    seen = combined[:, 0] if combined is not None else None
    gate = F.relu(head if seen is None else torch.where(seen, head, 0.0))
    key = torch.arange(j, device=logits.device)[None, :]
    own = torch.arange(i, device=logits.device)[:, None] + (j - i)  # each query's own key
    first = torch.full((gate.shape[0], 1, 1), j - i, device=logits.device)  # the first new key (x-transformers' sos)
    if seen is not None:  # a sample's first real new key: with padding in front, not column j - i
        live = seen.any(dim=-2) & (key >= j - i)  # (b, j)
        first = torch.where(live, key, j).amin(dim=-1).view(-1, 1, 1)
    gate = torch.where((key >= j - i) & (key != first) & (key != own), gate, 0.0)  # not older keys, the first, its own
    gate = F.pad(gate, (0, 0, 1, -1)).cumsum(dim=-2)  # a query is gated by the queries before it
    return logits - gate[:, None]


def _mix_heads(conv: nn.Conv2d, t: Tensor) -> Tensor:
    """x-transformers' talking heads: ``t (b, h, i, j)`` mixed over the heads by ``conv``'s ``(h, h)`` weight."""
    return torch.einsum("bhij,gh->bgij", t, conv.weight[:, :, 0, 0].to(t.dtype))


def _explicit_weights(logits: Tensor, combined: Tensor | None, row_ok: Tensor | None, col_ok: Tensor | None,
                      sign: Tensor | None, opt: AttentionModule | None, dropout_p: float,
                      pre_scale: Tensor | None = None, attn_delta: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The explicit path's weights ``(b, h, i, j)`` from its ``logits``: softmax, sigmoid or gumbel softmax over the
    keys (over the queries with inverted attention, then L1 over the keys), 0 at masked keys and dead rows
    (``row_ok (b|1, h|1, i, 1)``; ``col_ok (b|1, h|1, 1, j)``: the keys some query sees), cog's ``sign`` put back,
    dropout. Returns ``(weights, live)``, ``live`` where ``combined`` allows and the row is alive (``None``
    without a mask)."""
    inverted = opt is not None and opt.inverted
    dim = -2 if inverted else -1
    ok = None if combined is None else (col_ok if inverted else row_ok)  # the softmax's live lines
    if ok is not None:
        logits = torch.where(ok, logits, 0.0)  # a dead line: finite logits, weights selected to 0 below
    topk = None if opt is None else opt.sparse_topk
    soft = None
    if topk is not None and logits.shape[-1] > 0:  # x-transformers' sparse top-k: the rest of a row at -inf
        if opt.sparse_topk_straight_through:  # the gradient of the softmax over every live key
            soft = logits.softmax(dim=-1)
        kth = logits.topk(min(topk, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = torch.where((logits >= kth) & (logits > float("-inf")), logits, float("-inf"))
    live = None if combined is None else combined & row_ok
    score = "softmax" if opt is None else opt.score
    if score == "sigmoid":
        weights = torch.sigmoid(logits)
    elif score == "custom":
        weights = _custom_weights(opt.custom_attn_fn, logits)
    elif score == "gumbel":
        weights = _gumbel_softmax(logits, combined, dim, opt.gumbel_temp, opt.gumbel_hard)
    elif score == "hard":  # the one-hot of the largest logit forward, the softmax's gradient backward
        soft = logits.softmax(dim=dim)
        one_hot = torch.zeros_like(soft).scatter(dim, logits.argmax(dim=dim, keepdim=True), 1.0)
        weights = one_hot + soft - soft.detach()
        soft = None
    else:
        weights = logits.softmax(dim=dim)
    if soft is not None:  # straight through: the top-k weights forward, the full softmax's gradient backward
        weights = weights.detach() + soft - soft.detach()
    if live is not None:
        weights = torch.where(live, weights, 0.0)
    if inverted:  # normalised over the queries first: now L1 over each query's keys (x-transformers' l1norm)
        weights = weights / weights.abs().sum(-1, keepdim=True).clamp_min(1e-8)
    if attn_delta is not None:  # x-transformers' attention delta, after the softmax; nothing at masked entries
        delta = check_delta("attn_delta (over the sink, memory and added keys first)", attn_delta,
                            tuple(weights.shape), weights).to(weights.dtype)
        weights = weights + (delta if live is None else torch.where(live, delta, 0.0))
    if sign is not None:
        weights = weights * sign
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    if opt is not None and (opt.post_softmax_talking_heads is not None or pre_scale is not None):
        if opt.post_softmax_talking_heads is not None:  # x-transformers' order: after dropout
            weights = _mix_heads(opt.post_softmax_talking_heads, weights)
        if pre_scale is not None:
            weights = weights * pre_scale
        if live is not None:  # what the mix moved onto a masked key or a dead row: back to 0
            weights = torch.where(live, weights, 0.0)
    return weights, live


def _explicit_values(weights: Tensor, vf: Tensor, row_ok: Tensor | None, sink: Tensor | None,
                     opt: AttentionModule | None) -> Tensor:
    """``weights (b, h, i, j) @ vf (b, h, j, e)`` -> ``(b, h, i, e)``; with LASER ``log(weights @ exp(softclamp(v)))``,
    the sink's value adding nothing and a dead row (``row_ok`` False) exactly 0 (never ``log(0)``)."""
    if opt is not None and opt.laser_value is not None:  # laser: log(weights @ exp(softclamp(v)))
        t = opt.laser_value
        ev = torch.exp(torch.tanh(vf / t) * t)
        if sink is not None:  # the sink holds no value: its weight adds nothing (x-transformers drops it before @ v)
            ev = torch.cat((torch.zeros_like(ev[..., :1, :]), ev[..., 1:, :]), dim=-2)
        wv = weights @ ev
        alive = torch.ones_like(wv[..., :1], dtype=torch.bool) if row_ok is None else row_ok.expand_as(wv[..., :1])
        return torch.where(alive, torch.log(torch.where(alive, wv, 1.0).clamp_min(torch.finfo(vf.dtype).tiny)), 0.0)
    return weights @ vf


def _custom_weights(fn, logits: Tensor) -> Tensor:
    """A custom attention function's weights: ``fn`` sees the logits with masked entries at ``-finfo.max`` (as in
    x-transformers, where a ``-inf`` could make an ordinary function NaN); the caller sets the weights of masked
    entries and dead rows to 0 afterwards."""
    big = -torch.finfo(logits.dtype).max
    weights = fn(torch.where(logits == float("-inf"), big, logits))
    if not isinstance(weights, Tensor) or weights.shape != logits.shape or not weights.is_floating_point():
        raise ValueError(f"custom_attn_fn must return float weights of the logits' shape {tuple(logits.shape)}, got "
                         f"{tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__}")
    return weights.to(logits.dtype)


def _gumbel_softmax(logits: Tensor, allowed: Tensor | None, dim: int, temp: float, hard: bool) -> Tensor:
    """``F.gumbel_softmax`` over ``dim`` with the noise added at allowed entries only (a masked ``-inf`` logit stays
    ``-inf``: the noise is finite, ``-log(-log(u))`` with ``u`` kept inside (0, 1)); ``hard``: the one-hot of the
    sample, with the soft weights' gradient (straight-through)."""
    tiny = torch.finfo(logits.dtype).tiny
    u = torch.rand_like(logits).clamp(tiny, 1.0 - torch.finfo(logits.dtype).eps)
    noise = -torch.log(-torch.log(u))
    noisy = logits + noise if allowed is None else torch.where(allowed, logits + noise, logits)
    soft = (noisy / temp).softmax(dim=dim)
    if not hard:
        return soft
    one_hot = torch.zeros_like(soft).scatter_(dim, soft.argmax(dim=dim, keepdim=True), 1.0)
    return one_hot - soft.detach() + soft


def log_prob_from_hard_attend(intermediates) -> Tensor:
    """x-transformers' ``log_prob_from_hard_attend``: for ``Attention(gumbel_softmax=True)``'s intermediates, the log
    probability ``(b, h, i)`` of the key each query picked (the arg-max of ``post_softmax_attn``) under the softmax
    of ``pre_softmax_attn`` (masked keys ``-inf``: probability 0). A row that attended to nothing (all weights 0:
    a dead row, a padded query) gives 0."""
    pre = getattr(intermediates, "pre_softmax_attn", None)
    post = getattr(intermediates, "post_softmax_attn", None)
    if not isinstance(pre, Tensor) or not isinstance(post, Tensor) or pre.shape != post.shape:
        raise ValueError("log_prob_from_hard_attend needs intermediates with pre_softmax_attn and post_softmax_attn of "
                         "one shape (return_intermediates=True from an Attention built without flash=True)")
    if pre.shape[-1] == 0:  # no keys: nothing was picked
        return pre.new_zeros(pre.shape[:-1])
    picked = post.abs().argmax(dim=-1, keepdim=True)
    log_prob = pre.log_softmax(dim=-1).gather(-1, picked).squeeze(-1)  # (b, h, i)
    return torch.where((post != 0).any(dim=-1), log_prob, 0.0)
