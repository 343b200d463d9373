"""One residual branch of a layer stack: norm, mixer (attention or feed-forward), adaptive gate; and the
stack's residual routing (x-transformers' options that change how the residual stream flows between
branches: hyper-connections, LIMe, U-Net skips, input reinjection, post-norms, orthogonal and mean/variance
split residual updates).

Shape legend: b batch, n positions, T packed real tokens, c model width, K condition width, S residual
streams, L layer hiddens so far, V input views (1, or 3 for separate query/key/value inputs).

``Block`` is shared by the padded path (``x (b, n, c)``, ``condition (b, K)``) and the unpadded path
(``x (T, c)``, ``condition (T, K)``: one condition row per real token). The stack adds the branch to the
residual stream itself, after stochastic depth: a block only computes the branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.losses import masked_mean
from .modules import AdaptiveNorm, RMSNorm, TorchLayerNorm, _rename_keys

__all__ = ["Block", "apply_norm", "ShiftTokens", "AdaptiveLayerScale", "shift_tokens", "HyperConnection", "DynamicLIMe",
           "AttentionResidual", "GatedMultiResidual", "ConcatCombine", "MVSplitResidualUpdate",
           "ResidualRouting", "sinkhorn", "orthog_residual_update", "OrthogonalResidualUpdate",
           "residual_update"]


def apply_norm(norm: nn.Module | None, x: Tensor, condition: Tensor | None) -> Tensor:
    """``norm(x, condition)`` for an adaptive norm (when a condition is given), else ``norm(x)``; no norm
    (``None``: x-transformers' empty slot) is the identity."""
    if norm is None:
        return x
    if condition is not None and isinstance(norm, AdaptiveNorm):
        return norm(x, condition)
    return norm(x)


class ShiftTokens(nn.Module):
    """x-transformers' ``ShiftTokens(shifts, fn)``: the input's feature segments shifted along the positions
    (segment ``k`` by ``shifts[k]``; a padded position reads as 0 with ``mask``), then ``fn``."""

    def __init__(self, shifts, fn: nn.Module):
        super().__init__()
        self.fn = fn
        self.shifts = tuple(int(k) for k in shifts)

    def forward(self, x: Tensor, *args, mask: Tensor | None = None, **kwargs):
        return self.fn(shift_tokens(x, self.shifts, mask), *args, **kwargs)


class AdaptiveLayerScale(nn.Module):
    """x-transformers' ``AdaptiveLayerScale(fn, dim, dim_condition=None, init_bias_value=-2.)``: the branch gated
    by the condition (AdaLN-zero style), ``fn(x) * sigmoid(to_gamma(c))``; ``to_gamma``'s weight starts at zero and
    its bias at ``init_bias_value``, so each branch starts scaled by ``sigmoid(-2) = 0.12``."""

    def __init__(self, fn: nn.Module, dim: int, dim_condition: int | None = None, init_bias_value: float = -2.0):
        super().__init__()
        self.fn = fn
        self.to_gamma = nn.Linear(dim if dim_condition is None else dim_condition, dim)
        nn.init.zeros_(self.to_gamma.weight)
        nn.init.constant_(self.to_gamma.bias, init_bias_value)
        self._register_load_state_dict_pre_hook(_rename_keys({"to_gate.": "to_gamma."}, prefixes=True))

    def gate(self, out: Tensor, condition: Tensor) -> Tensor:
        """``out (b, n, c)`` (or packed ``(T, c)`` rows, one condition each) times the gate of ``condition``."""
        gate = self.to_gamma(condition).sigmoid().to(out.dtype)
        return out * (gate if out.dim() == 2 or gate.dim() == 3 else gate[:, None])

    def forward(self, x: Tensor, *args, condition: Tensor, **kwargs):
        out = self.fn(x, *args, **kwargs)
        if isinstance(out, Tensor):
            return self.gate(out, condition)
        first, *rest = out
        return self.gate(first, condition), *rest


def _gate(gate: nn.Module, out: Tensor, condition: Tensor | None) -> Tensor:
    """A branch output through its layerscale (learned, or adaptive when a condition is given)."""
    if isinstance(gate, AdaptiveLayerScale):
        return gate.gate(out, condition) if condition is not None else out
    return out * (gate.gamma + float(gate.unit_offset)).to(out.dtype)


class Block(nn.ModuleList):
    """One layer of the stack as x-transformers builds it: ``[norms, block, residual]`` (a ``ModuleList``, so
    ``state_dict`` keys and indexing are x-transformers'):

    - ``norms``: ``[pre_branch_norm, post_branch_norm, post_main_norm]`` (``None`` where absent): the pre-norm,
      the sandwich norm of the branch output, the post-norm of the stream (``pre_norm=False`` /
      ``pre_and_post_norm``, applied by the stack's residual routing);
    - ``block``: the mixer (``Attention`` or ``FeedForward``), wrapped as x-transformers wraps it: macaron's
      ``Scale(0.5)``, ``ShiftTokens``, ``LayerScale`` / ``AdaptiveLayerScale``, a float residual ``Scale``;
    - ``residual``: the residual update (``Residual``, ``GRUGating``, a ``HyperConnection``, ...).

    Args:
        kind: ``"self"``, ``"cross"`` or ``"ff"``.
        norms: the three norms (modules or ``None``).
        branch: the (wrapped) mixer.
        residual: the residual update module.
    """

    def __init__(self, kind: str, norms, branch: nn.Module, residual: nn.Module):
        if kind not in ("self", "cross", "ff"):
            raise ValueError(f"kind must be 'self', 'cross' or 'ff', got {kind!r}")
        super().__init__([nn.ModuleList(list(norms)), branch, residual])
        self.kind = kind
        self._derive()
        self._register_load_state_dict_pre_hook(_legacy_block, with_module=True)

    def _derive(self) -> None:
        """The mixer, gate, token shifts and output scale, read once from the wrapped branch."""
        m, gate, shifts, scale, wrappers = self[1], None, (), 1.0, 0
        while True:
            if type(m).__name__ == "Scale" and hasattr(m, "fn"):
                scale *= 1.0 if m.scale is None else float(m.scale)
            elif isinstance(m, ShiftTokens):
                shifts = m.shifts
            elif hasattr(m, "fn") and (hasattr(m, "gamma") or isinstance(m, AdaptiveLayerScale)):
                gate = m
            else:
                break
            m, wrappers = m.fn, wrappers + 1
        self.scale, self.shifts = scale, shifts  # macaron's half step times a float residual scale; shift_tokens
        self.wrappers = wrappers
        norms = self[0]
        # plain references to the registered parts (no second registration): read once per branch, every step
        object.__setattr__(self, "_parts", (norms[0], m, gate))
        object.__setattr__(self, "_post_norm", norms[1])
        object.__setattr__(self, "_residual", self._modules.get("2"))

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # a slice of the parts is a plain list of them, not a Block
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        super().__setitem__(idx, module)
        self._derive()

    @property
    def norms(self) -> nn.ModuleList:
        return self[0]

    @property
    def norm(self) -> nn.Module | None:
        return self._parts[0]

    @property
    def mixer(self) -> nn.Module:
        return self._parts[1]

    @property
    def gate(self) -> nn.Module | None:
        return self._parts[2]

    @property
    def residual(self) -> nn.Module:
        return self._residual

    def forward(self, x: Tensor, condition: Tensor | None = None, *args, **kwargs) -> tuple[Tensor, tuple]:
        """The branch of ``x``: ``(out, extra)``, ``extra`` being what the mixer returned besides its
        output (an attention's keys/values and weights; nothing for a feed-forward). A module call, so a
        block can be its own FSDP2 unit (``fully_shard(block)``) and hooks on it run."""
        norm, mixer, gate = self._parts
        shift_mask = kwargs.pop("shift_mask", None)
        if isinstance(x, tuple):  # (q, k, v) inputs (qkv_receive_diff_residuals): each normed, keys/values apart
            q, k, v = (self._shifted(apply_norm(norm, t, condition), shift_mask) for t in x)
            res = mixer(q, *args, kv_input=(k, v), **kwargs)
        else:
            res = mixer(self._shifted(apply_norm(norm, x, condition), shift_mask), *args, **kwargs)
        out, extra = (res[0], tuple(res[1:])) if isinstance(res, tuple) else (res, ())
        return self.finish(out, condition), extra

    def _shifted(self, h: Tensor, mask: Tensor | None) -> Tensor:
        return shift_tokens(h, self.shifts, mask) if self.shifts else h

    def finish(self, out: Tensor, condition: Tensor | None = None) -> Tensor:
        """The branch output after the mixer: gated (adaptive layerscale, or layerscale), scaled (macaron's
        half step, a float residual scale), sandwich-normed; what the stack adds to the residual stream. A
        cross-attention row that is exactly 0 (no context key) stays 0 through the sandwich norm."""
        gate = self._parts[2]
        # a cross-attention row with no context key is exactly 0 before the gate, and must add exactly 0 (S2)
        live = (out != 0).any(-1, keepdim=True) if self._post_norm is not None and self.kind == "cross" else None
        if gate is not None:  # adaptive layerscale (the condition gates the branch) or a learned layerscale
            out = _gate(gate, out, condition)
        if self.scale != 1.0:
            out = out * self.scale
        if self._post_norm is not None:
            normed = apply_norm(self._post_norm, out, condition)
            out = normed if live is None else torch.where(live, normed, 0.0)  # the norm's shift must not revive it
        return out


def _legacy_block(block: Block, state_dict, prefix, *_args) -> None:
    """Earlier safeformer's layer was ``[norm, mixer, gate?, post_norm?]``: its keys moved to x-transformers'
    ``[norms, block, residual]`` (the mixer under its wrappers' ``fn``)."""
    if not any(k.startswith(prefix) and _legacy_block_key(k[len(prefix):]) for k in state_dict):
        return
    fn = "fn." * block.wrappers
    gate_at = "fn." * _gate_depth(block)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        head, _, tail = rest.partition(".")
        if head == "0" and not tail.split(".")[0].isdigit():
            new = "0.0." + tail
        elif head == "1":
            new = "1." + fn + tail
        elif head == "2" and tail.split(".")[0] in ("gamma", "to_gate"):
            new = "1." + gate_at + tail.replace("to_gate", "to_gamma", 1)
        elif head == "3":
            new = "0.1." + tail
        else:
            continue
        state_dict[prefix + new] = state_dict.pop(key)


def _legacy_block_key(rest: str) -> bool:
    head, _, tail = rest.partition(".")
    first = tail.split(".")[0]
    return (head == "0" and not first.isdigit()) or head == "3" or (head == "2" and first in ("gamma", "to_gate"))


def _gate_depth(block: Block) -> int:
    """How many wrappers sit above the layerscale in ``block``'s branch."""
    m, depth = block[1], 0
    while m is not block.gate and hasattr(m, "fn"):
        m, depth = m.fn, depth + 1
    return depth


def shift_tokens(h: Tensor, shifts: tuple[int, ...], mask: Tensor | None = None) -> Tensor:
    """x-transformers' token shift: the features of ``h (b, n, c)`` split in ``len(shifts)`` segments of ``c //
    len(shifts)`` (the rest unshifted); segment ``s`` is moved ``shifts[s]`` tokens along the sequence (later for a
    positive shift), zeros filling in. With ``mask (b, n)`` the shift runs over each sample's real tokens in order
    (padding, left, right or between, is skipped, as in the sample alone): a real position never reads a padded
    one, and padded positions leave as 0."""
    if mask is not None:  # real tokens first, in order; padded slots 0
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # (b, n)
        real = torch.arange(h.shape[1], device=h.device) < mask.sum(1, keepdim=True)  # (b, n)
        h = torch.where(real[..., None], h.gather(1, order[..., None].expand_as(h)), 0.0)
    n, width = h.shape[1], h.shape[-1] // len(shifts)
    parts = []
    for s, amount in enumerate(shifts):
        seg = h[..., s * width:(s + 1) * width]
        amount = max(-n, min(n, amount))
        if amount > 0:
            seg = F.pad(seg, (0, 0, amount, 0))[:, :n]
        elif amount < 0:
            seg = F.pad(seg, (0, 0, 0, -amount))[:, -amount:]
        parts.append(seg)
    out = torch.cat((*parts, h[..., len(shifts) * width:]), dim=-1)
    if mask is not None:  # back to the positions, padded ones 0
        out = torch.zeros_like(out).scatter(1, order[..., None].expand_as(out), out)
        out = torch.where(mask[..., None], out, 0.0)
    return out


# ------------------------------------------------------------------------------------------------------
# residual routing: what x-transformers' AttentionLayers options do between the branches
# ------------------------------------------------------------------------------------------------------


def sinkhorn(t: Tensor, iters: int = 5) -> Tensor:
    """A doubly stochastic matrix from logits ``t (..., S, S)``: a softmax over the rows' axis (``-2``), then
    ``iters`` rounds of L1 normalisation of the rows and of the columns (Sinkhorn-Knopp), in float32 or wider."""
    dtype = t.dtype
    t = t.to(torch.promote_types(dtype, torch.float32)).softmax(dim=-2)
    for _ in range(iters):
        t = F.normalize(t, p=1, dim=-1)
        t = F.normalize(t, p=1, dim=-2)
    return t.to(dtype)


class HyperConnection(nn.Module):
    """Dynamic hyper-connections (https://arxiv.org/abs/2409.19606, Algorithm 2) with manifold-constrained
    residual mixing (https://arxiv.org/abs/2512.24880): ``S`` residual streams ``(..., S, c)`` feed the branch a
    learned per-token mixture of themselves (``V`` input views), are mixed among themselves by a doubly
    stochastic ``S x S`` matrix, and each takes the branch output times its own gate. Every weight is computed
    per token (positions never meet). Parameter names are x-transformers'.

    Args:
        dim: c.
        layer_index: the layer's index in the stack (its static input weight starts on stream ``index % S``).
        num_residual_streams: S.
        num_input_views: V (3: separate query, key and value inputs for self-attention).
        sinkhorn_iters: Sinkhorn-Knopp rounds of the residual mixing matrix.
    """

    def __init__(self, dim: int, *, layer_index: int, num_residual_streams: int, num_input_views: int = 1,
                 sinkhorn_iters: int = 5):
        super().__init__()
        s, v = num_residual_streams, num_input_views
        self.num_residual_streams, self.num_input_views, self.sinkhorn_iters = s, v, sinkhorn_iters
        self.norm = TorchLayerNorm(dim, bias=False)  # x-transformers' nn.LayerNorm: weight
        self.static_beta = nn.Parameter(torch.ones(s))
        init_alpha0 = torch.zeros(s, v)
        init_alpha0[layer_index % s, :] = 1.0
        self.static_alpha = nn.Parameter(torch.cat([init_alpha0, torch.eye(s)], dim=1))  # (S, V + S)
        self.dynamic_alpha_fn = nn.Parameter(torch.zeros(dim, s + v))
        self.dynamic_alpha_scale = nn.Parameter(torch.ones(()) * 1e-2)
        self.dynamic_beta_fn = nn.Parameter(torch.zeros(dim))
        self.dynamic_beta_scale = nn.Parameter(torch.ones(()) * 1e-2)

    def prepare(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``streams (..., S, c)`` -> ``(branch input (..., c) or (V, ..., c), mixed streams (..., S, c),
        beta (..., S))``."""
        v = self.num_input_views
        normed = self.norm(streams)
        alpha = (normed @ self.dynamic_alpha_fn) * self.dynamic_alpha_scale + self.static_alpha  # (..., S, V + S)
        alpha = torch.cat((alpha[..., :v].sigmoid(), sinkhorn(alpha[..., v:], self.sinkhorn_iters)), dim=-1)
        mixed = torch.einsum("...st,...sd->...td", alpha, streams)  # (..., V + S, c): stream s to output t
        beta = self.static_beta + torch.sigmoid(normed @ self.dynamic_beta_fn) * 2 * self.dynamic_beta_scale
        beta = beta.sigmoid() * 2  # (..., S)
        branch = mixed[..., 0, :] if v == 1 else mixed[..., :v, :].movedim(-2, 0)
        return branch, mixed[..., v:, :], beta

    def forward(self, out: Tensor, streams: Tensor, beta: Tensor) -> Tensor:
        """The streams after the branch: ``streams + out * beta`` per stream (``out (..., c)``)."""
        return streams + out[..., None, :] * beta[..., None].to(out.dtype)


class DynamicLIMe(nn.Module):
    """Layer-integrated memory (LIMe, https://arxiv.org/abs/2502.09245, dynamic version): the branch input is
    a per-token learned mixture of the streams entering every layer so far (``hiddens (L, ..., c)``), weighted
    by ``softmax(Linear(RMSNorm(x)))`` over the ``L`` layers (``ReLU`` without ``use_softmax``), once per view.

    Args:
        dim: c.
        num_layers: L, the hiddens it mixes (the layer's index + 1).
        num_views: V.
        use_softmax: softmax weights (else ReLU).
    """

    def __init__(self, dim: int, num_layers: int, num_views: int = 1, use_softmax: bool = True):
        super().__init__()
        self.num_layers, self.num_views, self.use_softmax = num_layers, num_views, use_softmax
        # x-transformers' Sequential(RMSNorm, Linear, ...): keys to_weights.0.g, to_weights.1.*
        self.to_weights = nn.Sequential(RMSNorm(dim), nn.Linear(dim, num_views * num_layers))
        self._register_load_state_dict_pre_hook(_rename_keys({"norm.": "to_weights.0.", "to_weights.weight":
                                                              "to_weights.1.weight", "to_weights.bias":
                                                              "to_weights.1.bias"}, prefixes=True))

    def forward(self, x: Tensor, hiddens: list[Tensor]) -> Tensor:
        """``x (..., c)``, ``hiddens``: L tensors ``(..., c)`` -> ``(..., c)``, or ``(V, ..., c)`` with views."""
        if len(hiddens) != self.num_layers:
            raise ValueError(f"DynamicLIMe expects {self.num_layers} layer hiddens, got {len(hiddens)}")
        w = self.to_weights(x).unflatten(-1, (self.num_views, self.num_layers))  # (..., V, L)
        w = w.softmax(dim=-1) if self.use_softmax else F.relu(w)
        out = torch.einsum("...vl,l...d->v...d", w, torch.stack(hiddens))  # (V, ..., c)
        return out[0] if self.num_views == 1 else out


DEFAULT_ATTN_RESIDUAL_LORA_RANK = 64  # x-transformers' default rank of AttentionResidual's query delta

class LoRALinear(nn.Module):
    """x-transformers' ``LoRALinear(dim_in, dim_out, dim=rank, activation)``: ``up(activation(down(x)))`` without
    biases, ``up`` starting at zero (so the low-rank delta starts at 0). Its parameter names are x-transformers'
    (``down``, ``up``, and ``maybe_activation`` when the activation is a module)."""

    def __init__(self, dim_in: int, dim_out: int, rank: int, activation: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        self.down = nn.Linear(dim_in, rank, bias=False)
        self.up = nn.Linear(rank, dim_out, bias=False)
        nn.init.zeros_(self.up.weight)
        self.maybe_activation = activation if activation is not None else _identity

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.maybe_activation(self.down(x)))


def _identity(t: Tensor) -> Tensor:
    return t


class AttentionResidual(nn.Module):
    """x-transformers' ``attn_aggregated_residuals`` (https://arxiv.org/abs/2601.21582,
    https://arxiv.org/abs/2603.15031): each block's input is an attention, per token, over the inputs of every
    block so far (``hiddens (L, ..., c)``, the latest last): the query is the latest hidden plus a low-rank delta of
    it (``norm(h_L + LoRA(RMSNorm(h_L)))``), the keys the RMS-normed hiddens, the values the hiddens themselves;
    softmax over the ``L`` hiddens, scaled by ``c ** -0.5``. Positions never meet (a padded position reads only
    itself). Module names are x-transformers' (``to_keys``, ``to_query``, ``norm``: torch ``nn.RMSNorm``).

    Args:
        dim: c.
        num_views: V (3: separate query, key and value inputs for self-attention).
        lora_rank: the rank of the query delta (x-transformers' default 64; below ``dim``).
        lora_activation: an activation between the delta's two projections (``None``: none).
    """

    def __init__(self, dim: int, num_views: int = 1, lora_rank: int | None = DEFAULT_ATTN_RESIDUAL_LORA_RANK,
                 lora_activation: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        rank = DEFAULT_ATTN_RESIDUAL_LORA_RANK if lora_rank is None else lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < dim:
            raise ValueError(f"attn_aggregated_residual_kwargs' lora_rank must be a positive integer below dim={dim} "
                             f"(x-transformers' default is {DEFAULT_ATTN_RESIDUAL_LORA_RANK}), got {rank!r}")
        if lora_activation is not None and not callable(lora_activation):
            raise TypeError(f"attn_aggregated_residual_kwargs' lora_activation must be callable (a module or a "
                            f"function) or None, got {type(lora_activation).__name__}")
        self.scale = dim**-0.5
        self.num_views = num_views
        self.multiple_views = num_views > 1
        self.to_keys = nn.RMSNorm(dim)
        self.to_query = nn.Sequential(nn.RMSNorm(dim), LoRALinear(dim, dim * num_views, rank, lora_activation))
        self.norm = nn.RMSNorm(dim)

    def forward(self, past_deltas: list[Tensor] | Tensor | None = None, hiddens: list[Tensor] | Tensor | None = None,
                ) -> Tensor:
        """The mixture of the hiddens ``(L, ..., c)`` (a list of ``(..., c)`` or one stacked tensor): ``(..., c)``,
        or ``(V, ..., c)`` with views. x-transformers' calls: ``(hiddens)``, ``(x, hiddens)`` (``x`` unread: the
        latest hidden is the query) or ``(hiddens=...)``."""
        if hiddens is None:
            hiddens = past_deltas
        if hiddens is None or (not isinstance(hiddens, Tensor) and len(hiddens) == 0):
            raise ValueError("AttentionResidual needs at least one hidden to attend over")
        stacked = hiddens if isinstance(hiddens, Tensor) else torch.stack(list(hiddens))  # (L, ..., c)
        latest = stacked[-1]
        delta = self.to_query(latest).unflatten(-1, (self.num_views, -1)).movedim(-2, 0)  # (V, ..., c)
        query = self.norm(latest[None] + delta)
        keys = self.to_keys(stacked)
        logits = torch.einsum("v...d,l...d->vl...", query, keys) * self.scale  # (V, L, ...)
        out = torch.einsum("vl...,l...d->v...d", logits.softmax(dim=1), stacked)
        return out if self.multiple_views else out[0]


class GatedMultiResidual(nn.Module):
    """x-transformers' ``gated_multi_residual`` (https://qwen.ai/blog?id=qwen3.8-flash-next): ``S`` residual streams
    ``(..., S, c)`` (``num_residual_streams``; 1 allowed) feed the branch ``sum_s gate_s * RMSNorm(stream_s) * gain_s
    / S``, an elementwise read gate (``sigmoid`` of a static logit, anchored on the layer's own stream, plus a
    low-rank data-dependent part), and each stream takes the branch output times its own write gate (``2 sigmoid``,
    static plus dynamic). The streams themselves are not mixed. The read gate normalises, so the stack drops the
    pre-norm of each block (x-transformers then norms the streams after every block and keeps the final norm).
    Every gate is computed per token (positions never meet). Parameter names are x-transformers'.

    Args:
        dim: c.
        layer_index: the layer's index in the stack (its static read gate opens on stream ``index % S``).
        num_residual_streams: S.
        num_input_views: V (3: separate query, key and value inputs for self-attention).
        read_gate_rank: the rank of the shared bottleneck of the dynamic gates (``residual_fn_kwargs``' key).
    """

    def __init__(self, dim: int, *, layer_index: int, num_residual_streams: int, num_input_views: int = 1,
                 read_gate_rank: int | None = None):
        super().__init__()
        if isinstance(read_gate_rank, bool) or not isinstance(read_gate_rank, int) or read_gate_rank < 1:
            raise ValueError("gated_multi_residual needs residual_fn_kwargs=dict(read_gate_rank=<positive int>) (the "
                             f"rank of its gates' bottleneck), got read_gate_rank={read_gate_rank!r}")
        s, v = num_residual_streams, num_input_views
        self.num_residual_streams, self.num_input_views = s, v
        self.read_norm = nn.RMSNorm(dim, elementwise_affine=False)
        self.read_gain = nn.Parameter(torch.ones(s, dim))
        static_read_logit = torch.zeros(v, s, dim)
        static_read_logit[:, layer_index % s] = 1.0
        self.static_read_logit = nn.Parameter(static_read_logit)
        self.static_write_logit = nn.Parameter(torch.zeros(s))
        self.to_bottleneck = nn.Linear(dim * s, read_gate_rank, bias=False)
        self.to_read_gate = nn.Linear(read_gate_rank, dim * s * v, bias=False)
        self.to_write_gate = nn.Linear(read_gate_rank, s, bias=False)
        nn.init.zeros_(self.to_read_gate.weight)
        nn.init.zeros_(self.to_write_gate.weight)
        self.dynamic_gate_scale = nn.Parameter(torch.ones(()) * 1e-2)

    def prepare(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``streams (..., S, c)`` -> ``(branch input (..., c) or (V, ..., c), the streams unchanged (..., S, c),
        beta (..., S))``."""
        s, v = self.num_residual_streams, self.num_input_views
        normed = self.read_norm(streams) * self.read_gain  # (..., S, c)
        dynamic = F.silu(self.to_bottleneck(normed.flatten(-2) / s)) * self.dynamic_gate_scale  # (..., rank)
        read = self.to_read_gate(dynamic) + self.static_read_logit.flatten()  # (..., V S c)
        read = read.sigmoid().unflatten(-1, (v, s, streams.shape[-1]))  # (..., V, S, c)
        branch = (read * normed[..., None, :, :]).sum(dim=-2) / s  # (..., V, c)
        branch = branch[..., 0, :] if v == 1 else branch.movedim(-2, 0)
        beta = (self.to_write_gate(dynamic) + self.static_write_logit).sigmoid() * 2  # (..., S)
        return branch, streams, beta

    def forward(self, out: Tensor, streams: Tensor, beta: Tensor) -> Tensor:
        """The streams after the branch: ``streams + out * beta`` per stream (``out (..., c)``)."""
        return streams + out[..., None, :] * beta[..., None].to(out.dtype)


class ConcatCombine(nn.Module):
    """U-Net skip (x-transformers' ``unet_skips``): ``Linear([skip, x])`` replaces the stream, the skip being
    the stream that entered layer ``prev_layer_ind`` (in execution order)."""

    def __init__(self, dim: int, prev_layer_ind: int):
        super().__init__()
        self.prev_layer_ind = prev_layer_ind
        self.combine = nn.Linear(dim * 2, dim, bias=False)

    def forward(self, x: Tensor, prev_layers: list[Tensor]) -> Tensor:
        return self.combine(torch.cat((prev_layers[self.prev_layer_ind], x), dim=-1))


def _seq_mean(t: Tensor, mask: Tensor | None) -> Tensor:
    """The mean over positions ``(b, 1, c)`` of ``t (b, n, c)``, real positions only (masked ones selected)."""
    return masked_mean(t, mask, dim=1, keepdim=True)


class MVSplitResidualUpdate(nn.Module):
    """Mean/variance split residual update (x-transformers' ``mv_split_residual``, https://arxiv.org/abs/2605.06169):
    ``residual + (out - mean(out)) * beta + (mean(out) - mean(residual)) * alpha``, the means over the real
    positions of each sample; ``alpha``, ``beta`` learned per feature, or (``learned``) linear in ``mean(out)``."""

    def __init__(self, dim: int, init_alpha: float = 0.0, init_beta: float = 0.03, learned: bool = False):
        super().__init__()
        self.learned = bool(learned)
        if self.learned:
            self.to_alpha, self.to_beta = nn.Linear(dim, dim), nn.Linear(dim, dim)
            for lin, init in ((self.to_alpha, init_alpha), (self.to_beta, init_beta)):
                nn.init.zeros_(lin.weight)
                nn.init.constant_(lin.bias, init)
        else:
            self.alpha = nn.Parameter(torch.ones(dim) * init_alpha)
            self.beta = nn.Parameter(torch.ones(dim) * init_beta)

    def forward(self, out: Tensor, residual: Tensor, mask: Tensor | None = None) -> Tensor:
        mean_out, mean_res = _seq_mean(out, mask), _seq_mean(residual, mask)
        alpha = self.to_alpha(mean_out) if self.learned else self.alpha
        beta = self.to_beta(mean_out) if self.learned else self.beta
        return residual + (out - mean_out) * beta + (mean_out - mean_res) * alpha


def orthog_residual_update(out: Tensor, residual: Tensor, mask: Tensor | None = None) -> Tensor:
    """x-transformers' ``orthog_residual`` (https://arxiv.org/abs/2505.11881): ``residual`` plus the part of ``out``
    orthogonal to it, both flattened over each sample's real positions and features, in float64 (masked
    positions selected to 0 first: they add nothing to the dot product or the norm, and gain nothing)."""
    if mask is not None:
        out, residual = torch.where(mask[..., None], out, 0.0), torch.where(mask[..., None], residual, 0.0)
    o, r = out.flatten(1).double(), residual.flatten(1).double()
    unit = F.normalize(r, dim=-1)
    orthog = o - (o * unit).sum(-1, keepdim=True) * unit
    return residual + orthog.to(out.dtype).reshape(out.shape)


def residual_update(residual: nn.Module, out: Tensor, stream: Tensor) -> Tensor:
    """The stream after a branch gave ``out``, through x-transformers' ``Residual`` (``stream * residual_scale *
    scale_residual_constant + out``) or ``GRUGating`` (a GRU cell per token, ``out`` the input, the stream the
    state). Hooks on the module run when it has any (its own call then; the math is the same)."""
    if residual._forward_hooks or residual._forward_pre_hooks:
        return residual(out, stream)
    scale = getattr(residual, "residual_scale", None)
    if scale is not None:
        stream = stream * scale.to(stream.dtype)
    gru = getattr(residual, "gru", None)
    if gru is not None:
        c = out.shape[-1]
        return gru(out.reshape(-1, c), stream.reshape(-1, c)).reshape(out.shape)
    const = getattr(residual, "scale_residual_constant", 1.0)
    if const != 1.0:
        stream = stream * const
    return stream + out


class OrthogonalResidualUpdate(nn.Module):
    """x-transformers' ``OrthogonalResidualUpdate``: ``residual`` plus the part of the branch ``out`` orthogonal to it
    (per sample, over its real positions; see ``orthog_residual_update``)."""

    def forward(self, out: Tensor, residual: Tensor, mask: Tensor | None = None) -> Tensor:
        return orthog_residual_update(out, residual, mask)


def _unet_skips(stack: nn.Module, dim: int, len_block: int, depth: int) -> None:
    """x-transformers' U-Net pairing: the first block of each latter-half layer takes a skip (``ConcatCombine``)."""
    kinds = stack.layer_kinds
    skip_indices = [i * len_block for i in range(depth // len_block)]
    for i in range(len(kinds)):
        if i % len_block == 0 and i // len_block >= depth / 2:
            if not skip_indices:
                raise ValueError(f"unet_skips pairs layers as x-transformers does ({depth // len_block} skips "
                                 f"for depth={depth} with {len_block} blocks per layer): this depth leaves a "
                                 "latter-half layer without a skip; use a deeper stack")
            stack.skip_combines[i] = ConcatCombine(dim, skip_indices.pop())


def _residual_module(dim: int, index: int, streams: int, views: int, *, hyper_conn_sinkhorn_iters: int,
                     gated_multi_residual: bool, mv_split_residual: bool, orthog_residual: bool, gate_residual: bool,
                     scale_residual: bool, scale_residual_constant: float, residual_fn_kwargs: dict | None) -> nn.Module:
    """Layer ``index``'s residual update, as x-transformers picks it (``views``: the branch's input views)."""
    from .xt_modules import GRUGating, Residual

    if gated_multi_residual:
        return GatedMultiResidual(dim, layer_index=index, num_residual_streams=streams, num_input_views=views,
                                  **(residual_fn_kwargs or {}))
    if streams > 1:
        return HyperConnection(dim, layer_index=index, num_residual_streams=streams, num_input_views=views,
                               sinkhorn_iters=hyper_conn_sinkhorn_iters)
    if mv_split_residual:
        return MVSplitResidualUpdate(dim, **(residual_fn_kwargs or {}))
    if orthog_residual:
        return OrthogonalResidualUpdate()
    if gate_residual:
        return GRUGating(dim, scale_residual=bool(scale_residual))
    return Residual(dim, scale_residual=bool(scale_residual), scale_residual_constant=scale_residual_constant)


@dataclass
class RouteState:
    """One forward's routing state: the streams' pending residual (and gates), the layer hiddens (LIMe's and
    x-transformers' ``layer_hiddens``), the skips, the reinjected input, the padding mask and condition."""

    mask: Tensor | None
    condition: Tensor | None
    inject: Tensor | None = None
    layer_hiddens: list[Tensor] = field(default_factory=list)
    skips: list[Tensor] = field(default_factory=list)
    pending: tuple = ()


class ResidualRouting(nn.Module):
    """How the residual stream flows between the branches of an ``AttentionLayers``, for x-transformers'
    options (built by the stack only when one is on; without them the stack adds each branch to one stream).

    Per layer (in execution order), ``enter`` gives the branch input and ``leave`` takes the branch output:

    - U-Net skips: before layer ``i`` of the latter half, the stream becomes ``Linear([skip, stream])``.
    - hyper-connections (``num_residual_streams`` S > 1): the stream is ``S`` streams ``(b, n, S, c)``
      (``x + stream_emb``), mixed per token by each layer's ``HyperConnection`` and summed at the end.
    - ``gated_multi_residual``: ``S`` streams (``S`` may be 1) read through each layer's ``GatedMultiResidual`` (an
      elementwise gate, no pre-norm), a post-norm of the streams after each layer, summed at the end.
    - LIMe (``integrate_layers``): the branch input mixes the inputs of every layer so far, per token;
      ``attn_aggregated_residuals``: it attends over them, per token (``AttentionResidual``).
    - separate query/key/value inputs (``qkv_receive_diff_residuals``): three views for self-attention.
    - ``reinject_input``: ``Linear(x_in)`` (gated with ``learned_reinject_input_gate``) added to each branch input.
    - residual update: ``stream + out`` (or per stream, gated), ``orthog_residual``, ``mv_split_residual``.
    - ``pre_and_post_norm``, or post-norm (``pre_norm=False``): a norm of the stream after each residual update.
    - ``scale_residual`` / ``scale_residual_constant``: the stream scaled (a learned per-feature scale from 1, a
      constant) before the branch is added; ``gate_residual``: a GRU cell per token updates the stream instead.
    - ``softclamp_output``: ``tanh(x / v) * v`` of the stream(s) after the last layer.

    All of them are per token, except ``orthog_residual`` and ``mv_split_residual``, which reduce over the
    sample's real positions (padding selected away): they run without a KV cache.
    """

    def __init__(self, stack: nn.Module, dim: int, *, len_block: int, depth: int, num_residual_streams: int = 1,
                 qkv_receive_diff_residuals: bool = False, integrate_layers: bool = False,
                 layer_integrate_use_softmax: bool = True, hyper_conn_sinkhorn_iters: int = 5, unet_skips: bool = False,
                 reinject_input: bool = False, learned_reinject_input_gate: bool = False,
                 pre_and_post_norm: bool = False, orthog_residual: bool = False, mv_split_residual: bool = False,
                 residual_fn_kwargs: dict | None = None, post_norm: bool = False, scale_residual: bool = False,
                 scale_residual_constant: float = 1.0, gate_residual: bool = False,
                 softclamp_output_value: float | None = None, norm: Callable[[], nn.Module] | None = None,
                 attn_aggregated_residuals: bool = False, attn_aggregated_residual_kwargs: dict | None = None,
                 gated_multi_residual: bool = False):
        super().__init__()
        kinds = stack.layer_kinds
        s = num_residual_streams
        # LIMe always gives self-attention three views; attn_aggregated_residuals and the residual streams do
        # with qkv_receive_diff_residuals
        views = qkv_receive_diff_residuals or integrate_layers
        first_self = kinds.index("self") if "self" in kinds else -1
        self.views = [3 if kind == "self" and views and not (integrate_layers and i == first_self) else 1
                      for i, kind in enumerate(kinds)]
        self.num_residual_streams = s
        # every parameter lives where x-transformers keeps it: the stack (stream_emb, layer_integrators,
        # skip_combines, reinject_input_proj, learned_reinject_input_gate) and each layer's norms and residual
        stack.stream_emb = nn.Parameter(torch.zeros(s, dim)) if s > 1 else None
        self.hyper = s > 1 or bool(gated_multi_residual)  # the stream is (b, n, S, c): S streams (S may be 1)
        if integrate_layers:
            stack.layer_integrators = nn.ModuleList([
                DynamicLIMe(dim, i + 1, num_views=v, use_softmax=layer_integrate_use_softmax)
                for i, v in enumerate(self.views)])
        elif attn_aggregated_residuals:
            stack.layer_integrators = nn.ModuleList([
                AttentionResidual(dim, num_views=v, **(attn_aggregated_residual_kwargs or {})) for v in self.views])
        self.lime = bool(integrate_layers)
        self.integrate = bool(integrate_layers or attn_aggregated_residuals)
        self.unet = bool(unet_skips)
        if unet_skips:
            _unet_skips(stack, dim, len_block, depth)
        stack.reinject_input_proj = nn.Linear(dim, dim, bias=False) if reinject_input else None
        stack.learned_reinject_input_gate = nn.Linear(dim, 1, bias=False) if learned_reinject_input_gate else None
        self.post_norm = bool(pre_and_post_norm or post_norm or gated_multi_residual)
        hc_views = qkv_receive_diff_residuals and not integrate_layers  # else LIMe makes the views
        for i, blk in enumerate(stack.layers):
            if self.post_norm:
                blk.norms[2] = norm()
            blk[2] = _residual_module(
                dim, i, s, self.views[i] if hc_views else 1, hyper_conn_sinkhorn_iters=hyper_conn_sinkhorn_iters,
                gated_multi_residual=gated_multi_residual, mv_split_residual=mv_split_residual,
                orthog_residual=orthog_residual, gate_residual=gate_residual, scale_residual=scale_residual,
                scale_residual_constant=scale_residual_constant, residual_fn_kwargs=residual_fn_kwargs)
        self.scaled = bool(scale_residual) or scale_residual_constant != 1.0 or bool(gate_residual)
        self.softclamp_output_value = None if softclamp_output_value is None else float(softclamp_output_value)
        self.orthog_residual = bool(orthog_residual)
        self.mv_split = bool(mv_split_residual)
        object.__setattr__(self, "_stack", stack)  # read, not registered: the stack owns the parameters

    @property
    def integrators(self):
        """LIMe's integrators (``integrate_layers``: one per block, each mixing a fixed number of hiddens), or
        ``None`` (``attn_aggregated_residuals``' ``AttentionResidual`` attends over any number of hiddens)."""
        return self._stack.layer_integrators if self.lime else None

    @property
    def sequence_wide(self) -> bool:
        """Whether a residual update reduces over the sample's positions (no KV cache then)."""
        return self.orthog_residual or self.mv_split

    def begin(self, x: Tensor, mask: Tensor | None, condition: Tensor | None) -> tuple[Tensor, RouteState]:
        """The stream(s) from the stack's input ``x (b, n, c)`` (padded positions 0 already)."""
        stack = self._stack
        state = RouteState(mask, condition)
        if stack.reinject_input_proj is not None:
            state.inject = stack.reinject_input_proj(x)
            if stack.learned_reinject_input_gate is not None:
                state.inject = state.inject * stack.learned_reinject_input_gate(x).sigmoid()
        if stack.stream_emb is not None:
            x = x[..., None, :] + stack.stream_emb.to(x.dtype)  # (b, n, S, c)
        elif self.hyper:  # gated_multi_residual with one stream: (b, n, 1, c)
            x = x[..., None, :]
        return x, state

    def view(self, x: Tensor) -> Tensor:
        """The stream as one ``(b, n, c)`` tensor (the streams summed)."""
        return x if not self.hyper else x.sum(dim=-2)

    def enter(self, state: RouteState, i: int, x: Tensor) -> tuple[Tensor, Tensor | tuple]:
        """``(stream, branch input)`` of layer ``i``; the branch input is ``(q, k, v)`` with three views."""
        stack = self._stack
        if self.unet:
            state.skips.append(x)
            combine = stack.skip_combines[i]
            if combine is not None:
                x = combine(x, state.skips)
        if self.hyper:
            inp, inner, beta = stack.layers[i][2].prepare(x)
            state.pending = (inner, beta)
        else:
            inp = x
            state.pending = (x,)
        state.layer_hiddens.append(inp)
        if self.integrate:
            inp = stack.layer_integrators[i](inp, state.layer_hiddens)
        if state.inject is not None:
            inp = inp + state.inject
        return x, (tuple(inp) if self.views[i] == 3 else inp)

    def leave(self, state: RouteState, i: int, out: Tensor | None) -> Tensor:
        """The stream after layer ``i``'s branch gave ``out (b, n, c)`` (``None``: a branch that adds nothing)."""
        layer = self._stack.layers[i]
        residual, inner = layer[2], state.pending[0]
        if out is None and self.scaled:  # a skipped cross-attention updates as a zero branch would
            out = torch.zeros_like(inner)
        if out is None:
            x = inner
        elif self.hyper:
            x = residual(out, inner, state.pending[1])
        elif self.orthog_residual or self.mv_split:
            x = residual(out, inner, state.mask)
        else:
            x = residual_update(residual, out, inner)
        post = layer[0][2]
        if post is not None and self.hyper and state.condition is not None:  # one stream (S > 1 is refused)
            x = apply_norm(post, x[..., 0, :], state.condition)[..., None, :]
        elif post is not None:
            x = apply_norm(post, x, state.condition)
        return x

    def finish(self, x: Tensor) -> Tensor:
        """The stream(s) after the last layer: ``softclamp_output`` (``tanh(x / v) * v``, per stream), then the
        streams summed."""
        if self.softclamp_output_value is not None:
            v = self.softclamp_output_value
            x = torch.tanh(x / v) * v
        return self.view(x)
