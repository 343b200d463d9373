"""The door of ``Attention.forward``: the checks of a call's tensors and of the options it combines, x-transformers'
call keywords (``cache``, ``context_mask``, ``attn_mask``, ``attn_bias``, ``rotary_pos_emb``) folded into
safeformer's, and the ``AttnIntermediate`` a call returns.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim, c model width,
c_ctx context width, d_rot rotated features.

A function that needs the ``Attention`` it serves takes it as ``attn`` and only reads it (heads, options).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.attend import SelectedMask
from ..core.cache import AttnIntermediate, check_weight_dtype
from ..core.masks import as_attention_mask, packed_sequence_mask, validate_mask
from .modules import PolarAngles

# the ``Attention`` module these option families serve: they read its parts (typed as a module so that they need
# not import the class, which imports them)
AttentionModule = nn.Module



def _positive_int(value) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) above 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_call(attn: AttentionModule, x, context, kv, past_kv) -> None:
    """The door's checks of ``forward``'s tensors (S9): ``x (b, i, c)``, ``context (b, j, c_ctx)`` and the keys/values
    handed in (``kv`` or ``past_kv``); the masks are checked where they are read. Raises ``ValueError`` or
    ``TypeError`` naming the argument."""
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor of shape (b, i, dim), got {getattr(x, 'shape', type(x))}")
    check_weight_dtype(x, attn)
    b = x.shape[0]
    if context is not None and (not isinstance(context, Tensor) or context.dim() != 3 or context.shape[0] != b):
        raise ValueError(f"context must have shape (b={b}, j, dim_context), got {getattr(context, 'shape', type(context))}")
    mixed_ok = torch.is_autocast_enabled(x.device.type)  # autocast mixes dtypes on purpose
    if context is not None and context.dtype != x.dtype and not mixed_ok:
        raise TypeError(f"context has dtype {context.dtype}, expected {x.dtype} (the dtype of x)")
    if kv is not None and past_kv is not None:
        raise ValueError("pass kv (cross-attention keys/values) or past_kv (self-attention cache), not both")
    if kv is not None:
        check_kv(attn, kv, "kv", b, x, mixed_ok)
    if past_kv is not None:
        check_kv(attn, past_kv, "past_kv", b, x, mixed_ok)


def check_kv(attn: AttentionModule, kv, name: str, b: int, x: Tensor, mixed_ok: bool = False) -> None:
    """``kv`` (named ``name`` in errors) is a pair ``(k, v)``, each ``(b, h_kv, j, d)`` (PoPE keys ``2 d``), in
    ``x``'s dtype (any float under autocast) and on its device."""
    ok = isinstance(kv, (tuple, list)) and len(kv) == 2 and all(isinstance(t, Tensor) and t.dim() == 4 for t in kv)
    if not ok:
        raise ValueError(f"{name} must be a pair of tensors (k, v) of shape (b, h_kv, j, d), got {type(kv).__name__}")
    k, v = kv
    want = (b, attn.kv_heads, None, attn.dim_head)
    for t, label in ((k, "keys"), (v, "values")):
        # PoPE keys (the stack's polar_pos_emb, which sets polar_keys) carry 2 d features
        d = attn.dim_head * (2 if getattr(attn, "polar_keys", False) else 1) if label == "keys" else attn.dim_value
        if any(w is not None and w != s for w, s in zip(want[:3] + (d,), t.shape)):
            raise ValueError(f"{name} {label} must have shape (b={b}, h_kv={attn.kv_heads}, j, d={d}), got {tuple(t.shape)}")
        if (t.dtype != x.dtype and not mixed_ok) or not t.is_floating_point() or t.device != x.device:
            raise ValueError(f"{name} {label} are {t.dtype} on {t.device}, expected {x.dtype} on {x.device} (those of x)")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{name} keys and values must have the same length, got {tuple(k.shape)} and {tuple(v.shape)}")


def check_kv_input(kv_input, x: Tensor, context, kv) -> tuple[Tensor, Tensor]:
    """``kv_input``, checked: a pair ``(k_input, v_input)`` shaped like ``x``, in self-attention only."""
    if context is not None or kv is not None:
        raise ValueError("kv_input (separate key and value inputs) is for self-attention only: pass no context")
    if not (isinstance(kv_input, (tuple, list)) and len(kv_input) == 2
            and all(isinstance(t, Tensor) and t.shape == x.shape for t in kv_input)):
        raise ValueError(f"kv_input must be a pair (k_input, v_input) of tensors shaped like x {tuple(x.shape)}")
    return kv_input


def check_option_call(attn: AttentionModule, context, kv, past_kv, hybrid, added, kv_input, kv_residual) -> None:
    """The calls the module's options cannot serve, refused by name (never computed as something else): the hybrid
    module, orthogonal projected values and forget gates beside cross-attention or a cache, inverted attention in
    self-attention or with a cache, the relative projection bias in cross-attention, added keys beside options over
    the sequence's own keys, and ``kv_input_residual`` beside keys/values handed in."""
    if attn.hybrid is not None and (context is not None or kv is not None or (past_kv is not None and hybrid is None)):
        raise ValueError("hybrid_module runs beside self-attention, and continues its state through a layer "
                         "stack's KV cache only (not cross-attention, not Attention(cache=...))")
    if attn.orthog and (context is not None or kv is not None or past_kv is not None):
        raise ValueError("orthog_projected_values projects onto the values of the sequence itself: it runs in "
                         "self-attention without a KV cache (a cache would project the new positions alone, so "
                         "cached and uncached results would differ); decode with cache_kv=False")
    if attn.cache_refusal is not None and not attn.orthog and (context is not None or kv is not None
                                                               or past_kv is not None):
        raise ValueError(f"{attn.cache_refusal}: it runs in self-attention without a KV cache; decode with "
                         f"cache_kv=False")
    cross = context is not None or kv is not None
    if attn.inverted and (kv is not None or past_kv is not None):
        raise ValueError("inverted_attention normalises over the queries of one call: it runs without a KV cache "
                         "(a cache would see the new queries alone)")
    if attn.rel_proj_pos_bias is not None and cross:
        raise ValueError("use_rel_proj_pos_bias gives relative positions within one sequence: self-attention only")
    if added is not None and (attn.orthog or attn.to_forget_gates is not None):
        raise ValueError("additional_key_values cannot be combined with orthog_projected_values or "
                         "data_dependent_alibi (both are defined over the sequence's own keys)")
    if kv_residual is not None and (kv is not None or kv_input is not None):
        raise ValueError("kv_input_residual is added to the input of the keys/values: not with precomputed keys/"
                         "values (kv, a cross-attention cache) or kv_input")


def check_kv_residual(kv_residual, x: Tensor, source: Tensor) -> None:
    """``kv_input_residual`` checked against the keys'/values' input ``source (b, j, c_src)`` (``x`` or the context):
    a ``(b|1, j|1, c_src)`` float tensor in ``source``'s dtype (any float under autocast), on its device."""
    b, j, c = source.shape
    if not isinstance(kv_residual, Tensor):
        raise TypeError(f"kv_input_residual must be a tensor (b|1, j|1, c_src), got {type(kv_residual).__name__}")
    if not kv_residual.is_floating_point() or (kv_residual.dtype != source.dtype
                                               and not torch.is_autocast_enabled(x.device.type)):
        raise TypeError(f"kv_input_residual has dtype {kv_residual.dtype}, expected {source.dtype} (the dtype of the "
                        f"keys'/values' input)")
    shape = tuple(kv_residual.shape)
    if len(shape) != 3 or shape[0] not in (1, b) or shape[1] not in (1, j) or shape[2] != c:
        raise ValueError(f"kv_input_residual must have shape (b|1, j|1, c_src) = ({b}|1, {j}|1, {c}) (the keys'/values' "
                         f"input), got {shape}")
    if kv_residual.device != source.device:
        raise ValueError(f"kv_input_residual is on {kv_residual.device}, expected {source.device}")


def unpadded_call(attn: AttentionModule, x: Tensor, layout, additional_key_values, kv_input_residual, return_kv: bool):
    """``attn`` on the unpadded path (``forward(layout=...)``): ``x (T, c)`` the packed real tokens -> ``(T, c)``
    (``(out, None)`` with ``return_kv``), through the layout's own ``attend`` (the unpadded path's layouts, built by
    the stack, know how to run an attention module on their arrangement); the keywords it cannot take refused."""
    if not callable(getattr(layout, "attend", None)):
        raise TypeError(f"layout must be an unpadded layout, got {type(layout).__name__}")
    if additional_key_values is not None or kv_input_residual is not None:
        raise ValueError("additional_key_values and kv_input_residual run on the padded layout only")
    out = layout.attend(attn, x)
    return (out, None) if return_kv else out


def fold_xt_call(attn: AttentionModule, x: Tensor, context, mask, context_mask, attn_mask, bias, attn_bias, kv, past_kv,
                 cache, rotary, rotary_pos_emb) -> tuple:
    """x-transformers' call keywords folded into safeformer's, checked in this order: ``attn_bias`` (its name for
    ``bias``), ``cache`` (an ``AttnIntermediate``: its ``cached_kv``), ``context_mask`` and ``attn_mask`` (into the
    one ``mask``), ``rotary_pos_emb`` (its ``(freqs, xpos_scale)`` form). Returns ``(mask, pad, bias, kv, past_kv,
    rotary)``; ``pad (b, i)``: in self-attention with an ``attn_mask`` beside a ``(b, j)`` padding mask, that
    padding of ``x`` (its rows exactly 0), else ``None``."""
    if attn_bias is not None:  # x-transformers' name
        if bias is not None:
            raise ValueError("pass bias or attn_bias (x-transformers' name for it), not both")
        bias = attn_bias
    if cache is not None:
        kv, past_kv = from_cache(cache, context, kv, past_kv)
    pad = None
    if context_mask is not None or attn_mask is not None:
        mask, pad = xt_masks(attn, x, context, kv, mask, context_mask, attn_mask)
    if rotary_pos_emb is not None:
        if rotary is not None:
            raise ValueError("pass rotary or rotary_pos_emb (x-transformers' form), not both")
        rotary = rotary_from_xt(rotary_pos_emb, x, context, kv)
    return mask, pad, bias, kv, past_kv, rotary


def from_cache(cache, context, kv, past_kv):
    """``(kv, past_kv)`` from an ``AttnIntermediate`` passed as ``cache`` (x-transformers' decoding)."""
    if kv is not None or past_kv is not None:
        raise ValueError("pass cache (an AttnIntermediate) or kv / past_kv, not both")
    cached = getattr(cache, "cached_kv", None)
    if cached is None:
        raise TypeError(f"cache must be what return_intermediates=True returned (an AttnIntermediate with "
                        f"cached_kv), got {type(cache).__name__}")
    if cache.layer_type == "c":
        if context is not None:
            raise ValueError("a cross-attention cache answers for its context: pass context only on the first call")
        return cached, None
    return None, cached


def xt_masks(attn: AttentionModule, x, context, kv, mask, context_mask, attn_mask):
    """x-transformers' ``context_mask`` and ``attn_mask`` folded into the one ``mask``; returns the mask
    and, in self-attention with a ``(b, j)`` padding mask, that padding of ``x`` (its rows exactly 0)."""
    b, i = x.shape[:2]
    cross = context is not None or kv is not None
    pad = None
    if isinstance(mask, SelectedMask):
        raise ValueError("context_mask and attn_mask are x-transformers' keywords; the stack passes one mask")
    if context_mask is not None:
        if not cross:
            raise ValueError("context_mask was given without a context; pass context=... as well")
        j = context.shape[1] if context is not None else kv[0].shape[2]
        validate_mask(context_mask, "context_mask", shape=(b, j), device=x.device)
        full = context_mask[:, None, None, :]  # (b, 1, 1, j)
        if mask is not None:  # then mask is the padding of x: its rows are dead (exactly 0)
            validate_mask(mask, "mask", shape=(b, i), device=x.device)
            full = full & mask[:, None, :, None]  # (b, 1, i, j)
        mask = full
    if attn_mask is not None:
        validate_mask(attn_mask, "attn_mask", device=x.device)
        if attn_mask.dim() not in (2, 3, 4) or (attn_mask.dim() == 3 and attn_mask.shape[0] not in (1, attn.heads)):
            raise ValueError(f"attn_mask must be (i, j), (h={attn.heads}, i, j) or (b|1, h|1, i, j) (x-transformers' "
                             f"layouts: a 3-d mask is per head), got {tuple(attn_mask.shape)}")
        extra = attn_mask if attn_mask.dim() == 4 else attn_mask[None] if attn_mask.dim() == 3 else attn_mask[None, None]
        if mask is not None and not cross and isinstance(mask, Tensor) and mask.dim() == 2:
            validate_mask(mask, "mask", device=x.device)
            if mask.shape[0] == b and mask.shape[1] >= i:
                pad = mask[:, mask.shape[1] - i:]  # padding of x itself: rows exactly 0
            mask = mask[:, None, None, :]
        mask = extra if mask is None else as_attention_mask(mask, b, attn.heads, i, extra.shape[-1]) & extra
    return mask, pad


def _xt_angles(rotary_pos_emb, name: str, n: int, what: str) -> Tensor:
    """The angles ``(b|1, 1, n, d_rot)`` of the last ``n`` positions of x-transformers' ``(freqs, xpos_scale)``."""
    if not (isinstance(rotary_pos_emb, (tuple, list)) and len(rotary_pos_emb) == 2):
        raise ValueError(f"{name} must be (freqs, xpos_scale) as RotaryEmbedding returns it")
    freqs, scale = rotary_pos_emb
    if isinstance(scale, Tensor) or scale != 1:
        raise ValueError(f"{name} with an xpos scale (use_xpos=True) is not supported; use xpos-free rotary")
    if not isinstance(freqs, Tensor) or freqs.dim() not in (2, 3):
        raise ValueError(f"{name} freqs must be (b|1, n, d_rot), got {getattr(freqs, 'shape', type(freqs))}")
    if freqs.dim() == 2:
        freqs = freqs[None]
    if freqs.shape[-2] < n:
        raise ValueError(f"{name} covers {freqs.shape[-2]} positions, fewer than the {n} {what}")
    return freqs[:, None, -n:]


def rotary_from_xt(rotary_pos_emb, x, context, kv, context_rotary_pos_emb=None):
    """x-transformers' ``(freqs, xpos_scale)`` -> safeformer's ``(q_angles, k_angles)``: the queries' and new keys'
    angles; in cross-attention the context keys' from ``context_rotary_pos_emb`` (x-transformers needs both)."""
    ang = _xt_angles(rotary_pos_emb, "rotary_pos_emb", x.shape[1], "queries")
    if context is None and kv is None:
        if context_rotary_pos_emb is not None:
            raise ValueError("context_rotary_pos_emb rotates the context's keys: it needs context")
        return ang, ang  # (b|1, 1, i, d_rot): the new positions (queries and new keys alike)
    if context is None or context_rotary_pos_emb is None:
        raise ValueError("rotary_pos_emb in cross-attention rotates the queries; the context's keys need "
                         "context_rotary_pos_emb (x-transformers' too), and precomputed kv cannot be rotated here")
    return ang, _xt_angles(context_rotary_pos_emb, "context_rotary_pos_emb", context.shape[1], "context keys")


def intermediates(res: tuple, want_weights: bool, x: Tensor, context, kv, value_residual) -> tuple:
    """``(out, AttnIntermediate)`` of one call's result ``res = (out, (k, v)[, weights, logits])`` (the weights and
    logits there when ``want_weights``): the keys and values used (``cached_kv``), the new positions' values
    (x-transformers' ``values``; not with a ``value_residual``), the weights and the logits."""
    out, kv_out = res[:2]
    weights, logits = (res[2], res[3]) if want_weights else (None, None)
    cross = context is not None or kv is not None
    values = None
    if kv_out is not None and value_residual is None:  # the new positions' values (x-transformers' values)
        v_all = kv_out[1]
        new = v_all.shape[2] if kv is not None else (context if context is not None else x).shape[1]
        values = v_all[:, :, v_all.shape[2] - new:]
    return out, AttnIntermediate(post_softmax_attn=weights, layer_type="c" if cross else "a", cached_kv=kv_out,
                                 pre_softmax_attn=logits, values=values)


def refuse_xt_call(owner: str, **given) -> None:
    """x-transformers' call keywords safeformer does not take: a ``TypeError`` naming the first one given (not
    ``None``); nothing when none is."""
    for name, value in given.items():
        if value is not None:
            raise TypeError(f"{owner}: x-transformers' option {name} is not supported by safeformer")


@dataclass(frozen=True)
class Modulations:
    """x-transformers' per-call modulations of one attention call (``q_delta``, ``k_delta``, ``v_delta`` added to the
    projections before the heads are split, ``o_delta`` to the output, ``attn_delta`` to the weights), checked."""

    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    o: Tensor | None = None
    attn: Tensor | None = None


def check_delta(name: str, t, shape: tuple, x: Tensor) -> Tensor | None:
    """``t`` (named ``name``) a float tensor on ``x``'s device broadcasting to ``shape`` without growing it."""
    if t is None:
        return None
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, expected {x.device} (the device of x)")
    try:
        ok = torch.broadcast_shapes(t.shape, shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must broadcast to {shape}, got {tuple(t.shape)}")
    return t


def xt_modulations(attn: AttentionModule, x: Tensor, context, kv, past_kv, layout, rotary, mem, mem_mask, added,
                   added_mask, deltas: dict) -> tuple:
    """x-transformers' ``mem`` / ``mem_mask`` and ``*_delta`` call keywords checked: ``(Modulations or None, added,
    added_mask)``. ``mem (b, m, c)``: memories whose keys and values every query sees before the sequence's own
    (self-attention; ``mem_mask (b, m)``, True = real, selected to 0 before their projections), handed on as
    ``additional_key_values``."""
    if layout is not None or kv is not None:
        raise ValueError("mem, mem_mask and the *_delta keywords act on the projections of this call: not with "
                         "layout (the unpadded path) or precomputed kv")
    b, i = x.shape[:2]
    if mem_mask is not None and mem is None:
        raise ValueError("mem_mask was given without mem")
    if mem is not None:
        if context is not None or rotary is not None or past_kv is not None or added is not None:
            raise ValueError("mem (x-transformers' memories) is self-attention without rotary positions, a KV cache "
                             "or additional_key_values here")
        if not isinstance(mem, Tensor) or mem.dim() != 3 or mem.shape[0] != b or mem.shape[2] != x.shape[2]:
            raise ValueError(f"mem must be (b={b}, m, c={x.shape[2]}), got "
                             f"{tuple(mem.shape) if isinstance(mem, Tensor) else type(mem).__name__}")
        if mem_mask is not None:
            validate_mask(mem_mask, "mem_mask", shape=(b, mem.shape[1]), device=x.device)
        added, added_mask = attn.project_kv(mem, mem_mask), mem_mask
    n_src = (x if context is None else context).shape[1]
    mods = Modulations(
        q=check_delta("q_delta", deltas["q_delta"], (b, i, attn.to_q.out_features), x),
        k=check_delta("k_delta", deltas["k_delta"], (b, n_src, attn.to_k.out_features), x),
        v=check_delta("v_delta", deltas["v_delta"], (b, n_src, attn.to_v.out_features), x),
        o=check_delta("o_delta", deltas["o_delta"], (b, i, attn.heads * attn.dim_value), x),
        attn=deltas["attn_delta"])
    if all(t is None for t in (mods.q, mods.k, mods.v, mods.o, mods.attn)):
        mods = None
    return mods, added, added_mask


def plus_kept(t: Tensor, delta: Tensor | None, keep: Tensor | None) -> Tensor:
    """``t + delta``, the delta selected to 0 where ``keep (..)`` is False (a masked row's delta reaches nothing)."""
    if delta is None:
        return t
    delta = delta.to(t.dtype)
    return t + (delta if keep is None else torch.where(keep[..., None], delta, 0.0))


def packed_call_mask(attn: AttentionModule, x: Tensor, context, mask, context_mask, attn_mask, cache, kwargs) -> Tensor:
    """x-transformers' ``flash_pack_seq_kwargs`` of one ``Attention(flash_pack_seq=True)`` call (one sequence of
    packed documents, flash-attn's ``cu_seqlens_q`` / ``cu_seqlens_k``) as its ``attn_mask (1, 1, i, j)``: each query
    sees the keys of its own document (causally with ``causal``), a position after the last document none."""
    if not attn.flash_pack_seq:
        raise TypeError("flash_pack_seq_kwargs needs Attention(flash_pack_seq=True) (attn_flash_pack_seq=True)")
    if x.shape[0] != 1 or any(m is not None for m in (mask, context_mask, attn_mask, cache)):
        raise ValueError("flash_pack_seq_kwargs describe one packed sequence (batch 1): not with mask, context_mask, "
                         "attn_mask or a cache")
    return packed_sequence_mask(kwargs, x.shape[1], (x if context is None else context).shape[1], x.device)


def xt_rel_pos_bias(x: Tensor, context, cache, rel_pos, pos, attn_bias) -> Tensor:
    """x-transformers' ``Attention.forward(rel_pos=, pos=)``: the bias of a position-bias module (its
    ``RelativePositionBias``, ``DynamicPositionBias`` or ``AlibiPositionalBias``: ``rel_pos(i, j)``, queries and keys
    at their indices, the last ``i`` queries of ``j`` keys), or ALiBi's at custom positions
    (``rel_pos.forward_custom_pos(pos)``), as this call's ``attn_bias`` (memory keys and the sink get 0)."""
    if rel_pos is None:
        raise ValueError("pos (custom positions) needs rel_pos, an AlibiPositionalBias")
    if attn_bias is not None:
        raise ValueError("pass rel_pos or attn_bias, not both (x-transformers asserts the same)")
    if pos is not None:
        if not hasattr(rel_pos, "forward_custom_pos"):
            raise TypeError(f"pos (custom positions) needs an AlibiPositionalBias as rel_pos, got {type(rel_pos).__name__}")
        return rel_pos.forward_custom_pos(pos)
    if not callable(rel_pos):
        raise TypeError(f"rel_pos must be a position-bias module called as rel_pos(i, j), got {type(rel_pos).__name__}")
    past = 0 if cache is None or getattr(cache, "cached_kv", None) is None else cache.cached_kv[0].shape[2]
    return rel_pos(x.shape[1], (x if context is None else context).shape[1] + past)


def check_polar_pos_emb(polar_pos_emb, heads: int, dim_head: int, n_needed: int, device,
                        owner: str = "polar_pos_emb") -> tuple[Tensor, Tensor]:
    """x-transformers' PoPE call argument ``polar_pos_emb = (freqs, bias)`` as ``PolarEmbedding.forward`` returns it,
    checked: ``freqs (1, N, d)`` float angles of ``N >= n_needed`` positions (the last ones used, as
    x-transformers' ``apply_polar_pos_emb`` takes them), ``bias`` the keys' extra angles (a float tensor or number
    broadcasting to ``(h|1, N, d)``, ``PolarEmbedding``'s ``(h, 1, d)``). Returns ``(freqs (1, N, d), key angles
    (1|h, N, d))``.

    Raises:
        TypeError: not a pair, or not float tensors.
        ValueError: a bad shape, device or length. ``freqs`` with a leading dimension other than 1 is refused:
            x-transformers broadcasts it against the heads, not the samples (per-sample angles of ``(b, n)``
            positions would be read as per-head ones), so its meaning is not what it looks like.
    """
    if not (isinstance(polar_pos_emb, (tuple, list)) and len(polar_pos_emb) == 2):
        raise TypeError(f"{owner} must be a pair (freqs, bias) as PolarEmbedding returns it, got "
                        f"{type(polar_pos_emb).__name__}")
    freqs, bias = polar_pos_emb
    if not isinstance(freqs, Tensor) or not freqs.is_floating_point():
        raise TypeError(f"{owner}'s freqs must be a float tensor (1, N, d), got "
                        f"{getattr(freqs, 'dtype', type(freqs).__name__)}")
    if freqs.dim() != 3 or freqs.shape[0] != 1 or freqs.shape[2] != dim_head or freqs.shape[1] < n_needed \
            or freqs.device != torch.device(device):
        raise ValueError(f"{owner}'s freqs must have shape (1, N >= {n_needed}, d={dim_head}) on {device} (one set "
                         f"of angles for the batch: x-transformers broadcasts a leading dimension against the heads), "
                         f"got {tuple(freqs.shape)} on {freqs.device}")
    if isinstance(bias, (int, float)) and not isinstance(bias, bool):
        bias = torch.tensor(float(bias), device=freqs.device, dtype=freqs.dtype)
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        raise TypeError(f"{owner}'s bias must be a float tensor (h|1, 1|N, d) or a number, got "
                        f"{getattr(bias, 'dtype', type(bias).__name__)}")
    full = (heads, freqs.shape[1], dim_head)
    try:
        ok = bias.dim() <= 3 and torch.broadcast_shapes(bias.shape, full) == torch.Size(full)
    except RuntimeError:
        ok = False
    if not ok or bias.device != freqs.device:
        raise ValueError(f"{owner}'s bias must broadcast to (h, N, d) = {full} on {freqs.device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")
    return freqs, freqs + bias


def check_polar_module(attn: AttentionModule, key_angles: Tensor, owner: str = "polar_pos_emb") -> None:
    """The attention options a PoPE call argument cannot run with, refused by name: memory keys and the decoupled
    or partial rotary heads (keys of ``d`` features beside PoPE's ``2 d``), l2-distance logits (safeformer applies
    PoPE's query gain as a multiplier of q, which changes distances), and a per-head ``bias`` with grouped-query
    heads (one key per group, x-transformers would widen it). (qk_norm's fixed scale is applied after PoPE, as
    x-transformers' logit scale: ``attention_projections._rotated``.)"""
    if attn.num_mem_kv:
        raise ValueError(f"{owner} (PoPE) gives keys 2 d features: not with num_mem_kv (memory keys have d)")
    if attn.rope_subheads or attn.rotate_num_heads < attn.heads:
        raise ValueError(f"{owner} (PoPE) applies to every head: not with latent_rope_subheads or rotate_num_heads")
    if attn.l2_distance:
        raise ValueError(f"{owner} (PoPE) is not supported with l2-distance attention (l2_distance): safeformer "
                         f"scales PoPE's queries, which changes l2 distances")
    if key_angles.shape[0] != 1 and attn.kv_heads != attn.heads:
        raise ValueError(f"{owner}'s bias is per head ({key_angles.shape[0]}): not with grouped-query heads "
                         f"(kv_heads={attn.kv_heads} < heads={attn.heads}); pass a bias shared by the heads")


def polar_angles(freqs: Tensor, key_angles: Tensor, i: int, j: int, keep_q: Tensor | None, keep_k: Tensor | None,
                 owner: str = "polar_pos_emb") -> tuple:
    """The ``(query, key)`` PoPE forms ``apply_rotary`` takes (``modules.PolarAngles``) from the checked
    ``freqs (1, N, d)`` and ``key_angles (1|h, N, d)``: the last ``i`` rows for the queries, the last ``j`` for the
    keys (as x-transformers' ``apply_polar_pos_emb``). ``keep_q (b, i)`` / ``keep_k (b, j)``: positions whose angles
    are selected to 0 where False (what they hold there reaches nothing). The queries carry a gain ``sqrt(2)``:
    the kernels scale logits by ``(2 d) ** -0.5`` for PoPE's ``2 d`` features, x-transformers by ``d ** -0.5``.

    Raises:
        ValueError: an angle at a kept position is not finite (one host read).
    """
    qf = freqs[:, None, freqs.shape[1] - i:]  # (1, 1, i, d)
    kf = key_angles[None, :, key_angles.shape[1] - j:]  # (1, 1|h, j, d)
    if keep_q is not None:
        qf = torch.where(keep_q[:, None, :, None], qf, 0.0)  # (b, 1, i, d)
    if keep_k is not None:
        kf = torch.where(keep_k[:, None, :, None], kf, 0.0)  # (b, 1|h, j, d)
    if not bool(torch.isfinite(qf).all() & torch.isfinite(kf).all()):
        raise ValueError(f"{owner} holds a non-finite angle (freqs or freqs + bias) at a position it is used for")
    return PolarAngles(qf, 2.0 ** 0.5), PolarAngles(kf)


def polar_from_xt(attn: AttentionModule, polar_pos_emb, x: Tensor, context, mask, context_mask, others: dict) -> tuple:
    """x-transformers' ``Attention.forward(polar_pos_emb=(freqs, bias))``: PoPE on this call's queries (the last
    ``i`` angles of ``freqs``) and keys (the last ``j`` of ``freqs + bias``; in cross-attention the context's), as
    the stack's ``rotary`` pair. ``others``: the call's keywords PoPE cannot meet (refused by name when given).
    Angles at padded positions (a ``(b, i)`` self-attention ``mask``; ``context_mask``, and ``mask`` beside it, in
    cross-attention) are selected to 0."""
    for name, value in others.items():
        if value is not None:
            raise ValueError(f"polar_pos_emb (PoPE given to the call) cannot be combined with {name} (safeformer "
                             f"keeps keys after PoPE, x-transformers before it; PoPE replaces rotary positions)")
    if context is not None and (not isinstance(context, Tensor) or context.dim() != 3):
        raise ValueError(f"context must have shape (b, j, dim_context), got {getattr(context, 'shape', type(context))}")
    if attn.qkv_receive_diff_residuals and isinstance(x, Tensor) and x.dim() == 4:
        x = x[0]  # the queries' input of the (3, b, i, c) stack
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a floating-point tensor of shape (b, i, dim), got {getattr(x, 'shape', type(x))}")
    b, i = x.shape[:2]
    j = i if context is None else context.shape[1]
    freqs, key_angles = check_polar_pos_emb(polar_pos_emb, attn.heads, attn.dim_head, max(i, j), x.device)
    check_polar_module(attn, key_angles)
    keep_q = keep_k = None
    plain = isinstance(mask, Tensor) and not isinstance(mask, SelectedMask) and mask.dtype == torch.bool \
        and mask.shape == (b, i)
    if context is None and plain:
        keep_q = keep_k = mask
    elif context is not None and isinstance(context_mask, Tensor) and context_mask.dtype == torch.bool \
            and context_mask.shape == (b, j):
        keep_k, keep_q = context_mask, mask if plain else None
    return polar_angles(freqs, key_angles, i, j, keep_q, keep_k)
