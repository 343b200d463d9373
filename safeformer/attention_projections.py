"""``Attention``'s projection options and the projection phase of one call.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim, c model width, c_ctx
context width.

- ``init_projections``: the q/k/v projections, with multi-latent attention (latent queries and keys/values, the
  decoupled rope sub-heads);
- ``init_norms``: the q/k norms, the value norm and the learned value-residual mix;
- ``project_qkv``: one call's queries, keys and values through ``Attention``'s projection seam (``_project_q``,
  ``project_kv``), the value residual mixed in, rotated, the cache prepended;
- ``qk_clip_``: MuonClip's in-place clip of the query and key projections.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .attend import _grad_select
from .attention_calls import _positive_int, check_kv_input
from .modules import HeadRMSNorm, RMSNorm, _rename_keys

if TYPE_CHECKING:
    from .attention import Attention


def init_projections(attn: Attention, dim: int, heads: int, kv_heads: int, dim_head: int, bias: bool, *,
                     use_latent_q: bool, dim_latent_q: int | None, use_latent_kv: bool, dim_latent_kv: int | None,
                     latent_rope_subheads: int | None) -> None:
    """The projections ``to_q``, ``to_k``, ``to_v`` (biases with ``bias``) of ``attn``, from ``dim`` and its
    ``dim_context``, with multi-latent attention checked and set (``to_latent_q``, ``to_latent_kv``,
    ``to_rotateable_k``, ``rope_subheads``).

    Args (``Attention``'s keywords):
        use_latent_q, dim_latent_q, use_latent_kv, dim_latent_kv, latent_rope_subheads: multi-latent attention
            (x-transformers' ``use_latent_q`` / ``use_latent_kv``, DeepSeek's MLA): queries (keys and values)
            projected from a bias-less latent ``Linear(dim, dim_latent_*)`` of the input; the last
            ``latent_rope_subheads`` key heads straight from the input, and only those heads (of the queries and
            keys) rotated by rotary positions (decoupled rope).
    """
    for name, on, width in (("dim_latent_q", use_latent_q, dim_latent_q), ("dim_latent_kv", use_latent_kv, dim_latent_kv)):
        if on and not _positive_int(width):
            raise ValueError(f"use_{name[4:]} needs {name}, a positive integer, got {width!r}")
        if width is not None and not on:
            raise ValueError(f"{name} was given but use_{name[4:]} is off; set use_{name[4:]}=True")
    if latent_rope_subheads is not None:
        if not use_latent_kv:
            raise ValueError("latent_rope_subheads splits the keys of multi-latent attention: it needs use_latent_kv")
        if not _positive_int(latent_rope_subheads) or latent_rope_subheads >= kv_heads or kv_heads != heads:
            raise ValueError(f"latent_rope_subheads must be a positive integer below kv_heads={kv_heads}, without "
                             f"grouped-query attention (kv_heads == heads), got {latent_rope_subheads!r}")
    attn.rope_subheads = latent_rope_subheads or 0
    attn.to_latent_q = nn.Linear(dim, dim_latent_q, bias=False) if use_latent_q else None
    attn.to_latent_kv = nn.Linear(attn.dim_context, dim_latent_kv, bias=False) if use_latent_kv else None
    q_in = dim_latent_q if use_latent_q else dim
    kv_in = dim_latent_kv if use_latent_kv else attn.dim_context
    attn.to_q = nn.Linear(q_in, heads * dim_head, bias=bias)
    attn.to_k = nn.Linear(kv_in, (kv_heads - attn.rope_subheads) * dim_head, bias=bias)
    attn.to_v = nn.Linear(kv_in, kv_heads * dim_head, bias=bias)
    attn.to_rotateable_k = nn.Linear(attn.dim_context, attn.rope_subheads * dim_head, bias=False) \
        if attn.rope_subheads else None


def init_norms(attn: Attention, dim: int, heads: int, kv_heads: int, dim_head: int, *, qk_norm: bool,
               qk_norm_eps: float | None, qk_norm_dim_scale: bool, value_rmsnorm: bool,
               learned_value_residual_mix: bool) -> None:
    """The norms of ``attn``'s queries, keys and values (``q_norm``, ``k_norm``, ``v_norm``) and the learned mix of
    the value residual (``to_value_residual_mix``), checked and set.

    Args (``Attention``'s keywords):
        qk_norm: RMS-normalise queries and keys per head before the dot product, with learned gains (an
            effective logit scale of ``sqrt(dim_head)`` at init; x-transformers' ``qk_norm`` is an L2 norm with a
            fixed scale of 10, which ``from_x_transformers`` maps onto the gains).
        qk_norm_eps: the epsilon of the q/k RMS norms (default 1e-6).
        qk_norm_dim_scale: per-head gains of the q/k norms, ``d ** -0.25`` each at init (logits
            ``sum_e qhat_e khat_e``, x-transformers); needs ``qk_norm``.
        value_rmsnorm: x-transformers' ``value_rmsnorm``: each value head RMS-normalised, gain ``1 + weight`` per
            kv head.
        learned_value_residual_mix: x-transformers' ``learned_value_residual_mix``: the value residual's mix per
            position and kv head, ``sigmoid(Linear(x))``; without it a given ``value_residual`` is mixed in at 0.5.
    """
    eps = 1e-6 if qk_norm_eps is None else qk_norm_eps
    if qk_norm_dim_scale and not qk_norm:
        raise ValueError("qk_norm_dim_scale scales the q/k norms per head and feature: it needs qk_norm=True")
    if qk_norm_dim_scale:  # per-head gains, d ** -0.25 each at init: logits sum_e qhat_e khat_e (x-transformers)
        attn.q_norm = HeadRMSNorm(heads, dim_head, eps=eps, init=dim_head**-0.25)
        attn.k_norm = HeadRMSNorm(kv_heads, dim_head, eps=eps, init=dim_head**-0.25)
    else:
        attn.q_norm = RMSNorm(dim_head, eps=eps) if qk_norm else None
        attn.k_norm = RMSNorm(dim_head, eps=eps) if qk_norm else None
    # x-transformers' value_rmsnorm: RMS-normalise each value head, gain (1 + weight) per kv head
    attn.v_norm = HeadRMSNorm(kv_heads, dim_head, eps=eps, unit_offset=True) if value_rmsnorm else None
    # x-transformers' learned_value_residual_mix: the value residual's mix per position and kv head,
    # sigmoid(Linear(x)); without it a given value_residual is mixed in at 0.5
    attn.to_value_residual_mix = nn.Sequential(nn.Linear(dim, kv_heads), nn.Sigmoid()) \
        if learned_value_residual_mix else None  # x-transformers' Sequential(Linear, Sigmoid): keys .0.*
    if learned_value_residual_mix:  # earlier safeformer held the Linear itself
        attn._register_load_state_dict_pre_hook(_rename_keys({
            "to_value_residual_mix.weight": "to_value_residual_mix.0.weight",
            "to_value_residual_mix.bias": "to_value_residual_mix.0.bias"}))


def project_qkv(attn: Attention, x: Tensor, source: Tensor, context, kv, past_kv, kv_input, kv_residual,
                value_residual, rotary, rows_ok, keys_ok, self_pad, j: int) -> tuple:
    """One call's queries, keys and values: ``q (b, h, i, d)`` of ``x (b, i, c)``, and ``k, v (b, h_kv, j', d)``:
    ``kv`` as handed in, or the new ones of ``source`` (``x`` or the context; ``kv_input``: separate key and value
    inputs; ``kv_residual`` added to the input), the ``value_residual`` mixed in, rotated (``rotary``), after
    ``past_kv``. ``rows_ok (b|1, i)`` / ``keys_ok (b|1, j)`` (``j`` counting the extra keys): the rows and keys
    selected to 0 before the projections; ``self_pad (b, i)``: padded queries, whose gradient the kernel's backward
    does not reach. Returns ``(q, k, v, v_orthog)``, ``v_orthog (b, i, h_kv, d)`` the new values (masked ones 0)
    with ``orthog_projected_values``, else ``None``."""
    # select masked inputs away *before* the projections: a NaN there would otherwise reach the
    # projection weights' gradients (0 * NaN) even though attend() never uses it
    # (masked_linear: the projection of the selected input, saving x itself rather than the copy)
    q = attn._project_q(x, rows_ok).transpose(1, 2)  # (b, h, i, d)
    if self_pad is not None:  # the kernel sees padded queries as live rows: keep its backward there out
        q = _grad_select(self_pad[:, None, :, None], q)
    v_orthog = None
    if kv is not None:
        k, v = kv
    else:
        new_keep = None if keys_ok is None else keys_ok[:, j - source.shape[1]:]
        if kv_input is None:  # new keys (kv_input_residual: x-transformers' residual added to their input)
            k, v = attn.project_kv(source if kv_residual is None else source + kv_residual, new_keep)
        else:  # qkv_receive_diff_residuals: keys and values of their own inputs
            k, v = attn.project_kv(check_kv_input(kv_input, x, context, kv)[0], new_keep)[0], \
                attn.project_kv(kv_input[1], new_keep)[1]
        if value_residual is not None:
            v = mix_values(attn, v, value_residual, source, new_keep, context is None)
        if rotary is not None:
            k = attn._rotate(k, rotary[1])
        if attn.orthog:  # the new values (b, i, h_kv, d), masked ones selected to 0
            v_orthog = v.transpose(1, 2) if keys_ok is None else \
                torch.where(keys_ok[:, j - x.shape[1]:, None, None], v.transpose(1, 2), 0.0)
        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=2)
            v = torch.cat((past_kv[1], v), dim=2)
    if rotary is not None:
        q = attn._rotate(q, rotary[0])
    return q, k, v, v_orthog


def mix_values(attn: Attention, v: Tensor, residual: Tensor, source: Tensor, keep: Tensor | None,
               self_attn: bool) -> Tensor:
    """``lerp(residual, v, mix)`` for the new values ``v (b, h_kv, j, d)`` (x-transformers' value residual);
    ``mix (b, h_kv, j, 1)`` from the source rows (masked ones selected to 0 first), or 0.5. ``keep (b|1, j)``: the
    residual's masked slots are selected to 0 before the mix, so nothing held there reaches a product."""
    if not isinstance(residual, Tensor):
        raise TypeError(f"value_residual must be a tensor {tuple(v.shape)} (b, h_kv, j, d), got {type(residual).__name__}")
    if not residual.is_floating_point() or (residual.dtype != v.dtype and not torch.is_autocast_enabled(v.device.type)):
        raise TypeError(f"value_residual has dtype {residual.dtype}, expected {v.dtype} (the dtype of the values)")
    if residual.shape != v.shape:
        raise ValueError(f"value_residual must have the new values' shape {tuple(v.shape)} (b, h_kv, j, d), "
                         f"got {tuple(residual.shape)}")
    if residual.device != v.device:
        raise ValueError(f"value_residual is on {residual.device}, expected {v.device} (the device of the values)")
    residual = residual.to(v.dtype)  # autocast: the values' dtype
    if keep is not None:
        residual = torch.where(keep[:, None, :, None], residual, 0.0)
    if attn.to_value_residual_mix is None:
        return residual.lerp(v, 0.5)
    if not self_attn:
        raise ValueError("learned_value_residual_mix reads the queries' input: self-attention only")
    mix = torch.sigmoid(attn._linear(attn.to_value_residual_mix[0], source, keep)).transpose(1, 2)[..., None]
    return residual.lerp(v, mix.to(v.dtype))


def qk_clip_(attn: Attention, pre_softmax_attn, tau: float = 100.0) -> None:
    """MuonClip's qk-clip (Kimi K2, x-transformers' ``qk_clip_``): for each head whose largest logit in
    ``pre_softmax_attn`` exceeds ``tau``, scale ``attn``'s query and key projections in place so that the logit
    becomes ``tau`` (``gamma = tau / max``: queries by ``gamma / s``, keys by ``s``, ``s = sqrt`` of the
    smallest ``gamma`` of the heads sharing the key head, so each head's logits scale by its own ``gamma``;
    biases and memory keys too). Heads at or below ``tau`` are left as they are. Run without gradients.

    Args:
        pre_softmax_attn: ``(b, h, i, j)`` logits, or the ``AttnIntermediate`` whose ``pre_softmax_attn``
            holds them (masked keys ``-inf`` and dead rows 0 never trigger a clip, ``tau`` being positive).
        tau: the largest logit allowed, a positive number.

    Raises:
        ValueError: no logits (a ``flash=True`` module records none), a bad ``tau``, or q/k norms whose gains the
            heads share (``qk_norm`` without ``qk_norm_dim_scale``: the norms undo a weight scale).
    """
    logits = pre_softmax_attn if isinstance(pre_softmax_attn, Tensor) else \
        getattr(pre_softmax_attn, "pre_softmax_attn", None)
    if not isinstance(logits, Tensor) or logits.dim() != 4 or logits.shape[1] != attn.heads:
        raise ValueError(f"qk_clip_ needs the logits (b, h={attn.heads}, i, j) or an AttnIntermediate holding them "
                         f"(return_intermediates=True, flash=False), got {getattr(logits, 'shape', type(logits))}")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a positive finite number, got {tau!r}")
    if attn.q_norm is not None and not isinstance(attn.q_norm, HeadRMSNorm):
        raise ValueError("qk_clip_ cannot clip a module with qk_norm: its norms (gains shared by the heads) undo a "
                         "weight scale; use qk_norm_dim_scale=True (per-head gains, which qk_clip_ scales)")
    top = logits.detach().float().amax(dim=(0, 2, 3))  # (h,)
    gamma = torch.where(top > tau, tau / top.clamp_min(tau), torch.ones_like(top))  # (h,) in (0, 1]
    g = attn.heads // attn.kv_heads
    k_scale = gamma.view(attn.kv_heads, g).amin(dim=1).sqrt()  # (h_kv,)
    q_scale = gamma / k_scale.repeat_interleave(g)  # (h,)
    d = attn.dim_head
    if attn.q_norm is not None:  # per-head gains (h, d): the norms set the size of q and k
        attn.q_norm.weight.mul_(q_scale.to(attn.q_norm.weight.dtype)[:, None])
        attn.k_norm.weight.mul_(k_scale.to(attn.k_norm.weight.dtype)[:, None])
        return
    qs = q_scale.repeat_interleave(d)
    attn.to_q.weight.mul_(qs.to(attn.to_q.weight.dtype)[:, None])
    if attn.to_q.bias is not None:
        attn.to_q.bias.mul_(qs.to(attn.to_q.bias.dtype))
    ks = k_scale.repeat_interleave(d)  # (h_kv * d,): to_k's heads first, then the rotateable ones
    n_k = attn.to_k.weight.shape[0]
    attn.to_k.weight.mul_(ks[:n_k].to(attn.to_k.weight.dtype)[:, None])
    if attn.to_k.bias is not None:
        attn.to_k.bias.mul_(ks[:n_k].to(attn.to_k.bias.dtype))
    if attn.to_rotateable_k is not None:
        attn.to_rotateable_k.weight.mul_(ks[n_k:].to(attn.to_rotateable_k.weight.dtype)[:, None])
    if attn.num_mem_kv:
        attn.mem_k.mul_(k_scale.to(attn.mem_k.dtype)[:, None, None])


def init_rotation(attn: Attention, heads: int, kv_heads: int, rotate_num_heads: int | None) -> None:
    """``attn.rotate_num_heads`` (x-transformers' attribute): how many of the last heads rotary positions rotate.

    Args (``Attention``'s keyword):
        rotate_num_heads: rotary positions on the last that many query heads only (and as many of the key/value
            heads, all of them when fewer), as x-transformers'; default every head. Not with ``latent_rope_subheads``
            (which sets it, as there), nor below ``heads`` with grouped key/value heads (nor in x-transformers). The
            dynamic KV path, padded path only.
    """
    if rotate_num_heads is not None:
        if isinstance(rotate_num_heads, bool) or not isinstance(rotate_num_heads, int) \
                or not 0 < rotate_num_heads <= heads:
            raise ValueError(f"rotate_num_heads must be an integer in [1, heads={heads}], got {rotate_num_heads!r}")
        if attn.rope_subheads:
            raise ValueError("rotate_num_heads cannot be set with latent_rope_subheads (which sets it)")
        if rotate_num_heads < heads and kv_heads < heads:
            raise ValueError("rotate_num_heads < heads with grouped key/value heads (kv_heads < heads) is not "
                             "supported (nor in x-transformers)")
    attn.rotate_num_heads = attn.rope_subheads or (heads if rotate_num_heads is None else rotate_num_heads)
