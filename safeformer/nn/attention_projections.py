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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attend import _grad_select
from .attention_calls import AttentionModule, _positive_int, check_kv_input
from .modules import HeadRMSNorm, PolarAngles, _rename_keys
from .options import Options, self_only


@dataclass(frozen=True)
class ProjectionOptions(Options):
    """The projections' keywords (x-transformers' names), read by ``init_projections`` and ``init_rotation`` (their
    meanings are documented there); ``bias`` also gives the output projection its bias."""

    bias: bool = False
    use_latent_q: bool = False
    dim_latent_q: int | None = None
    use_latent_kv: bool = False
    dim_latent_kv: int | None = None
    latent_rope_subheads: int | None = None
    rotate_num_heads: int | None = self_only(None)


@dataclass(frozen=True)
class NormOptions(Options):
    """The norms' keywords (x-transformers' names), read by ``init_norms`` (their meanings are documented there)."""

    qk_norm: bool = False
    qk_norm_eps: float | None = None
    qk_norm_dim_scale: bool = False
    qk_norm_groups: int = 1
    qk_norm_scale: float = 10.0
    qk_rmsnorm: bool = False
    k_rmsnorm: bool = False
    value_rmsnorm: bool = False
    learned_value_residual_mix: bool = False


def init_projections(attn: AttentionModule, o: ProjectionOptions, dim: int, heads: int, kv_heads: int,
                     dim_head: int) -> None:
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
    for name, on, width in (("dim_latent_q", o.use_latent_q, o.dim_latent_q), ("dim_latent_kv", o.use_latent_kv, o.dim_latent_kv)):
        if on and not _positive_int(width):
            raise ValueError(f"use_{name[4:]} needs {name}, a positive integer, got {width!r}")
        if width is not None and not on:
            raise ValueError(f"{name} was given but use_{name[4:]} is off; set use_{name[4:]}=True")
    if o.latent_rope_subheads is not None:
        if not o.use_latent_kv:
            raise ValueError("latent_rope_subheads splits the keys of multi-latent attention: it needs use_latent_kv")
        if not _positive_int(o.latent_rope_subheads) or o.latent_rope_subheads >= kv_heads or kv_heads != heads:
            raise ValueError(f"latent_rope_subheads must be a positive integer below kv_heads={kv_heads}, without "
                             f"grouped-query attention (kv_heads == heads), got {o.latent_rope_subheads!r}")
    attn.rope_subheads = o.latent_rope_subheads or 0
    attn.to_latent_q = nn.Linear(dim, o.dim_latent_q, bias=False) if o.use_latent_q else None
    attn.to_latent_kv = nn.Linear(attn.dim_context, o.dim_latent_kv, bias=False) if o.use_latent_kv else None
    q_in = o.dim_latent_q if o.use_latent_q else dim
    kv_in = o.dim_latent_kv if o.use_latent_kv else attn.dim_context
    attn.to_q = nn.Linear(q_in, heads * dim_head, bias=o.bias)
    attn.to_k = nn.Linear(kv_in, (kv_heads - attn.rope_subheads) * dim_head, bias=o.bias)
    attn.to_v = nn.Linear(kv_in, kv_heads * attn.dim_value, bias=o.bias)
    attn.to_rotateable_k = nn.Linear(attn.dim_context, attn.rope_subheads * dim_head, bias=False) \
        if attn.rope_subheads else None


def init_norms(attn: AttentionModule, o: NormOptions, dim: int, heads: int, kv_heads: int, dim_head: int) -> None:
    """The norms of ``attn``'s queries, keys and values (``q_norm``, ``k_norm``, ``v_norm``), x-transformers'
    ``qk_norm_q_scale`` / ``qk_norm_k_scale`` and the learned mix of the value residual (``to_value_residual_mix``),
    checked and set.

    Args (``Attention``'s keywords, x-transformers' meanings):
        qk_norm: L2-normalise queries and keys per head (per group of ``dim_head / qk_norm_groups`` features), the
            logits scaled by ``qk_norm_scale`` (default 10) instead of ``dim_head ** -0.5``.
        qk_norm_eps: the L2 norm's floor (default 1e-12, x-transformers' ``F.normalize``); also the RMS norms'
            epsilon (default 1e-12 after ``qk_norm``, whose output is already L2-normalised; 1e-6 without).
        qk_norm_dim_scale: learned per-head, per-feature scales ``qk_norm_q_scale (h, 1, d)`` /
            ``qk_norm_k_scale (h_kv, 1, d)``, ``d ** 0.25`` at init, and the ordinary ``dim_head ** -0.5`` logit
            scale; needs ``qk_norm``.
        qk_norm_groups, qk_norm_scale: as above.
        value_rmsnorm: x-transformers' ``value_rmsnorm``: each value head RMS-normalised, gain ``1 + weight`` per
            kv head.
        learned_value_residual_mix: x-transformers' ``learned_value_residual_mix``: the value residual's mix per
            position and kv head, ``sigmoid(Linear(x))``; without it a given ``value_residual`` is mixed in at 0.5.
        qk_rmsnorm, k_rmsnorm: x-transformers' ``MultiheadRMSNorm`` of the queries and keys (``q_rmsnorm``,
            ``k_rmsnorm``: gain ``1 + gamma (h, 1, d)``), or of the keys only, after ``qk_norm``; memory keys are
            not RMS-normed, as there. One of them at most.
    """
    if o.qk_rmsnorm and o.k_rmsnorm:
        raise ValueError("choose one of qk_rmsnorm and k_rmsnorm (qk_rmsnorm norms the keys too)")
    rms_eps = (1e-12 if o.qk_norm else 1e-6) if o.qk_norm_eps is None else o.qk_norm_eps
    attn.q_rmsnorm = HeadRMSNorm(heads, dim_head, eps=rms_eps, unit_offset=True) if o.qk_rmsnorm else None
    attn.k_rmsnorm = HeadRMSNorm(kv_heads, dim_head, eps=rms_eps, unit_offset=True) if o.qk_rmsnorm or o.k_rmsnorm \
        else None
    if o.qk_norm_dim_scale and not o.qk_norm:
        raise ValueError("qk_norm_dim_scale scales the q/k norms per head and feature: it needs qk_norm=True")
    if isinstance(o.qk_norm_groups, bool) or not isinstance(o.qk_norm_groups, int) or o.qk_norm_groups < 1 \
            or dim_head % o.qk_norm_groups:
        raise ValueError(f"qk_norm_groups must be a positive integer dividing dim_head={dim_head}, got {o.qk_norm_groups!r}")
    if isinstance(o.qk_norm_scale, bool) or not isinstance(o.qk_norm_scale, (int, float)) \
            or not math.isfinite(o.qk_norm_scale) or o.qk_norm_scale <= 0:
        raise ValueError(f"qk_norm_scale must be a positive finite number, got {o.qk_norm_scale!r}")
    if o.qk_norm_eps is not None and not (isinstance(o.qk_norm_eps, (int, float)) and 0 < o.qk_norm_eps < 1):
        raise ValueError(f"qk_norm_eps must be a number in (0, 1), got {o.qk_norm_eps!r}")
    eps = 1e-12 if o.qk_norm_eps is None else float(o.qk_norm_eps)
    # the kernels scale logits by d ** -0.5: x-transformers' qk_norm_scale s is a multiplier sqrt(s * sqrt(d)) on
    # both normalised q and k (with qk_norm_dim_scale the learned scales are the multipliers)
    mult = 1.0 if o.qk_norm_dim_scale else math.sqrt(float(o.qk_norm_scale) * math.sqrt(dim_head))
    attn.q_norm = QKL2Norm(o.qk_norm_groups, mult, eps) if o.qk_norm else None
    attn.k_norm = QKL2Norm(o.qk_norm_groups, mult, eps) if o.qk_norm else None
    attn.qk_norm_groups, attn.qk_norm_scale = o.qk_norm_groups, float(o.qk_norm_scale)
    if o.qk_norm_dim_scale:
        attn.qk_norm_q_scale = nn.Parameter(torch.full((heads, 1, dim_head), dim_head**0.25))
        attn.qk_norm_k_scale = nn.Parameter(torch.full((kv_heads, 1, dim_head), dim_head**0.25))
        attn._register_load_state_dict_pre_hook(_legacy_qk_norm, with_module=True)
    else:
        attn.qk_norm_q_scale = attn.qk_norm_k_scale = None
    # x-transformers' value_rmsnorm: RMS-normalise each value head, gain (1 + weight) per kv head
    attn.value_rmsnorm = HeadRMSNorm(kv_heads, attn.dim_value, eps=1e-6 if o.qk_norm_eps is None else o.qk_norm_eps,
                                     unit_offset=True) if o.value_rmsnorm else None  # x-transformers' name
    if o.value_rmsnorm:  # earlier safeformer named it v_norm
        attn._register_load_state_dict_pre_hook(_rename_keys({"v_norm.weight": "value_rmsnorm.weight"}))
    # x-transformers' learned_value_residual_mix: the value residual's mix per position and kv head,
    # sigmoid(Linear(x)); without it a given value_residual is mixed in at 0.5
    attn.to_value_residual_mix = nn.Sequential(nn.Linear(dim, kv_heads), nn.Sigmoid()) \
        if o.learned_value_residual_mix else None  # x-transformers' Sequential(Linear, Sigmoid): keys .0.*
    if o.learned_value_residual_mix:  # earlier safeformer held the Linear itself
        attn._register_load_state_dict_pre_hook(_rename_keys({
            "to_value_residual_mix.weight": "to_value_residual_mix.0.weight",
            "to_value_residual_mix.bias": "to_value_residual_mix.0.bias"}))


def _legacy_qk_norm(attn: AttentionModule, state_dict, prefix, *_args) -> None:
    """Earlier safeformer's qk-norm was an RMSNorm with gains ``w_q``, ``w_k`` (``(d,)``, or ``(h, d)`` per head):
    its logits ``d ** -0.5 * sum_e (qhat_e sqrt(d) w_q,e) (khat_e sqrt(d) w_k,e)`` are x-transformers'
    ``qk_norm_dim_scale`` ones with ``qk_norm_q_scale = w_q * sqrt(d)`` and ``qk_norm_k_scale = w_k * sqrt(d)`` (a
    checkpoint in format 1 reads with ``qk_norm_dim_scale=True``)."""
    for old, new, rows in (("q_norm.weight", "qk_norm_q_scale", attn.heads),
                           ("k_norm.weight", "qk_norm_k_scale", attn.kv_heads)):
        factor = attn.dim_head**0.5
        if prefix + old in state_dict and prefix + new not in state_dict:
            w = state_dict.pop(prefix + old) * factor
            state_dict[prefix + new] = w.reshape(-1, 1, attn.dim_head).expand(rows, 1, attn.dim_head).clone()


class QKL2Norm(nn.Module):
    """x-transformers' ``qk_norm`` of queries or keys ``(..., h, d)``: each head's features L2-normalised per group of
    ``d / groups`` (``x / max(||x||, eps)``), times a fixed ``mult``; in float32 or wider (S7). A zero row stays 0."""

    def __init__(self, groups: int = 1, mult: float = 1.0, eps: float = 1e-12):
        super().__init__()
        self.groups, self.mult, self.eps = int(groups), float(mult), float(eps)

    def forward(self, t: Tensor) -> Tensor:
        wide = t.to(torch.promote_types(t.dtype, torch.float32))
        if self.groups > 1:
            wide = wide.unflatten(-1, (self.groups, -1))
        out = F.normalize(wide, dim=-1, eps=self.eps)
        if self.groups > 1:
            out = out.flatten(-2)
        return (out * self.mult if self.mult != 1.0 else out).to(t.dtype)


def project_qkv(attn: AttentionModule, x: Tensor, source: Tensor, context, kv, past_kv, kv_input, kv_residual,
                value_residual, rotary, rows_ok, keys_ok, self_pad, j: int, mods=None) -> tuple:
    """One call's queries, keys and values: ``q (b, h, i, d)`` of ``x (b, i, c)``, and ``k, v (b, h_kv, j', d)``:
    ``kv`` as handed in, or the new ones of ``source`` (``x`` or the context; ``kv_input``: separate key and value
    inputs; ``kv_residual`` added to the input), the ``value_residual`` mixed in, rotated (``rotary``), after
    ``past_kv``. ``rows_ok (b|1, i)`` / ``keys_ok (b|1, j)`` (``j`` counting the extra keys): the rows and keys
    selected to 0 before the projections; ``self_pad (b, i)``: padded queries, whose gradient the kernel's backward
    does not reach. Returns ``(q, k, v, v_orthog)``, ``v_orthog (b, i, h_kv, d)`` the new values (masked ones 0)
    with ``orthog_projected_values``, else ``None``. ``mods``: x-transformers' ``q_delta`` / ``k_delta`` / ``v_delta``
    (``attention_calls.Modulations``), added to the new projections."""
    # select masked inputs away *before* the projections: a NaN there would otherwise reach the
    # projection weights' gradients (0 * NaN) even though attend() never uses it
    # (masked_linear: the projection of the selected input, saving x itself rather than the copy)
    q = attn._project_q(x, rows_ok, None if mods is None else mods.q).transpose(1, 2)  # (b, h, i, d)
    if self_pad is not None:  # the kernel sees padded queries as live rows: keep its backward there out
        q = _grad_select(self_pad[:, None, :, None], q)
    v_orthog = None
    if kv is not None:
        k, v = kv
    else:
        new_keep = None if keys_ok is None else keys_ok[:, j - source.shape[1]:]
        deltas = (None, None) if mods is None else (mods.k, mods.v)
        if kv_input is None:  # new keys (kv_input_residual: x-transformers' residual added to their input)
            k, v = attn.project_kv(source if kv_residual is None else source + kv_residual, new_keep, deltas)
        else:  # qkv_receive_diff_residuals: keys and values of their own inputs
            k, v = attn.project_kv(check_kv_input(kv_input, x, context, kv)[0], new_keep, deltas)[0], \
                attn.project_kv(kv_input[1], new_keep, deltas)[1]
        if value_residual is not None:
            v = mix_values(attn, v, value_residual, source, new_keep, context is None)
        if rotary is not None:
            k = _rotated(attn, k, rotary[1])
        if attn.orthog:  # the new values (b, i, h_kv, d), masked ones selected to 0
            v_orthog = v.transpose(1, 2) if keys_ok is None else \
                torch.where(keys_ok[:, j - x.shape[1]:, None, None], v.transpose(1, 2), 0.0)
        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=2)
            v = torch.cat((past_kv[1], v), dim=2)
    if rotary is not None:
        q = _rotated(attn, q, rotary[0])
    return q, k, v, v_orthog


def _rotated(attn: AttentionModule, t: Tensor, angles) -> Tensor:
    """``t (b, h|h_kv, n, d)`` rotated by ``angles`` (``attn._rotate``). PoPE (``PolarAngles``) after ``qk_norm``'s
    fixed multiplier ``m`` (which stands for x-transformers' logit scale ``qk_norm_scale``): x-transformers scales
    the logits after PoPE, so ``m`` leaves the normalised features before PoPE's softplus and multiplies its result
    (the logits then equal x-transformers' ``qk_norm_scale * q . k``)."""
    m = attn.q_norm.mult if isinstance(angles, PolarAngles) and attn.q_norm is not None else 1.0
    if m == 1.0:
        return attn._rotate(t, angles)
    wide = t.to(torch.promote_types(t.dtype, torch.float32)) / m
    return attn._rotate(wide, PolarAngles(angles.freqs, angles.gain * m)).to(t.dtype)


def mix_values(attn: AttentionModule, v: Tensor, residual: Tensor, source: Tensor, keep: Tensor | None,
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


def qk_clip_(attn: AttentionModule, pre_softmax_attn, tau: float = 100.0) -> None:
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
    if attn.q_norm is not None and attn.qk_norm_q_scale is None:
        raise ValueError("qk_clip_ cannot clip a module with qk_norm: its norms undo a weight scale; use "
                         "qk_norm_dim_scale=True (per-head scales qk_norm_q_scale / qk_norm_k_scale, which qk_clip_ "
                         "scales)")
    top = logits.detach().float().amax(dim=(0, 2, 3))  # (h,)
    gamma = torch.where(top > tau, tau / top.clamp_min(tau), torch.ones_like(top))  # (h,) in (0, 1]
    g = attn.heads // attn.kv_heads
    if attn.kv_head_order == "tiled":  # query head n reads key head n % h_kv
        k_scale = gamma.view(g, attn.kv_heads).amin(dim=0).sqrt()  # (h_kv,)
        q_scale = gamma / k_scale.repeat(g)  # (h,)
    else:  # query head n reads key head n // g
        k_scale = gamma.view(attn.kv_heads, g).amin(dim=1).sqrt()
        q_scale = gamma / k_scale.repeat_interleave(g)
    d = attn.dim_head
    if attn.q_norm is not None:  # per-head scales (h, 1, d): they set the size of q and k
        attn.qk_norm_q_scale.mul_(q_scale.to(attn.qk_norm_q_scale.dtype)[:, None, None])
        attn.qk_norm_k_scale.mul_(k_scale.to(attn.qk_norm_k_scale.dtype)[:, None, None])
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


def init_rotation(attn: AttentionModule, o: ProjectionOptions, heads: int, kv_heads: int) -> None:
    """``attn.rotate_num_heads`` (x-transformers' attribute): how many of the last heads rotary positions rotate.

    Args (``Attention``'s keyword):
        rotate_num_heads: rotary positions on the last that many query heads only (and as many of the key/value
            heads, all of them when fewer), as x-transformers'; default every head. Not with ``latent_rope_subheads``
            (which sets it, as there), nor below ``heads`` with grouped key/value heads (nor in x-transformers). The
            dynamic KV path, padded path only.
    """
    if o.rotate_num_heads is not None:
        if isinstance(o.rotate_num_heads, bool) or not isinstance(o.rotate_num_heads, int) \
                or not 0 < o.rotate_num_heads <= heads:
            raise ValueError(f"rotate_num_heads must be an integer in [1, heads={heads}], got {o.rotate_num_heads!r}")
        if attn.rope_subheads:
            raise ValueError("rotate_num_heads cannot be set with latent_rope_subheads (which sets it)")
        if o.rotate_num_heads < heads and kv_heads < heads:
            raise ValueError("rotate_num_heads < heads with grouped key/value heads (kv_heads < heads) is not "
                             "supported (nor in x-transformers)")
    attn.rotate_num_heads = attn.rope_subheads or (heads if o.rotate_num_heads is None else o.rotate_num_heads)
