"""``Attention``'s additive-bias options, which run on the fused kernels (padded path, self-attention): the relative
projection bias (``RelativeProjPositionalBias``) and x-transformers' data-dependent ALiBi (forget gates).

Shape legend: b batch, h query heads, i queries, j keys, c model width, D distance curves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention_calls import AttentionModule, _positive_int
from .attention_keys import alive
from .modules import _rename_keys
from .options import Options, self_only


@dataclass(frozen=True)
class BiasOptions(Options):
    """The bias options' keywords (x-transformers' names), read by ``init_biases``: the relative projection bias
    (``RelativeProjPositionalBias``), data-dependent ALiBi (``init_forget_gates``) and the window of
    ``max_attend_past`` (``init_window``)."""

    use_rel_proj_pos_bias: bool = self_only(False)
    rel_proj_num_distance_basis: int = self_only(16)
    rel_proj_max_dist: int = self_only(1024)
    data_dependent_alibi: bool = self_only(False)
    data_dependent_alibi_kwargs: dict | None = self_only(None)
    data_dependent_alibi_per_row: bool = self_only(False)
    data_dependent_alibi_per_row_dim_head: int = self_only(8)
    max_attend_past: int | None = None


def init_biases(attn: AttentionModule, o: BiasOptions, dim: int, heads: int, causal: bool) -> None:
    """The bias options of ``attn``, checked and set: ``rel_proj_pos_bias``, the window, ``data_dependent_alibi``."""
    attn.rel_proj_pos_bias = RelativeProjPositionalBias(
        dim, heads, num_distance_basis=o.rel_proj_num_distance_basis, max_dist=o.rel_proj_max_dist,
    ) if o.use_rel_proj_pos_bias else None
    init_window(attn, o.max_attend_past)
    init_forget_gates(attn, dim, heads, causal, o.data_dependent_alibi, o.data_dependent_alibi_kwargs,
                      o.data_dependent_alibi_per_row, o.data_dependent_alibi_per_row_dim_head)


class RelativeProjPositionalBias(nn.Module):
    """x-transformers' ``RelativeProjPositionalBias`` (the Inkling model's relative positions): per query and head
    ``num_distance_basis`` weights ``Linear(x)`` mix learned distance curves ``distance_bank (D, max_dist)``; the
    bias of query ``i`` and key ``j`` is the mixed curve at distance ``pos_i - pos_j``, and 0 outside
    ``[0, max_dist)`` (keys after the query, or too far back).

    ``forward(x, seq_len_k=None, positions=None)``: ``x (b, i, dim)`` the queries' input -> ``(b, h, i, j)``; the
    queries are the last ``i`` of ``j = seq_len_k`` keys (default ``i``), at index positions, unless
    ``positions = (q_pos (b|1, i), k_pos (b|1, j))`` gives them (the stack passes the real tokens' positions, so
    padding between tokens adds no distance).
    """

    def __init__(self, dim: int, heads: int, num_distance_basis: int = 16, max_dist: int = 1024):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("num_distance_basis", num_distance_basis),
                            ("max_dist", max_dist)):
            if not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.heads, self.num_distance_basis, self.max_dist = heads, num_distance_basis, max_dist
        # x-transformers' Sequential(Linear, Rearrange): key to_distance_weights.0.*
        self.to_distance_weights = nn.Sequential(nn.Linear(dim, heads * num_distance_basis))
        self._register_load_state_dict_pre_hook(_rename_keys({"to_distance_weights.weight": "to_distance_weights.0.weight",
                                                              "to_distance_weights.bias": "to_distance_weights.0.bias"}))
        self.distance_bank = nn.Parameter(torch.randn(num_distance_basis, max_dist) * 0.02)

    def forward(self, x: Tensor, seq_len_k: int | None = None, positions: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor (b, i, dim), got {getattr(x, 'shape', type(x))}")
        b, i, device = x.shape[0], x.shape[1], x.device
        if positions is None:
            j = i if seq_len_k is None else int(seq_len_k)
            if j < i:
                raise ValueError(f"seq_len_k ({j}) must be at least the number of queries ({i})")
            q_pos = (torch.arange(i, device=device) + (j - i))[None]
            k_pos = torch.arange(j, device=device)[None]
        else:
            ok = isinstance(positions, (tuple, list)) and len(positions) == 2 and all(
                isinstance(t, Tensor) and t.dim() == 2 and t.shape[0] in (1, b) and not t.is_floating_point()
                for t in positions)
            if not ok or positions[0].shape[1] != i or (seq_len_k is not None and positions[1].shape[1] != seq_len_k):
                raise ValueError(f"positions must be (q_pos (b|1, i={i}), k_pos (b|1, j)) integer tensors, got "
                                 f"{[getattr(t, 'shape', type(t)) for t in positions] if isinstance(positions, (tuple, list)) else type(positions)}")
            q_pos, k_pos = positions
        dist = q_pos[:, :, None] - k_pos[:, None, :]  # (b|1, i, j)
        valid = (dist >= 0) & (dist < self.max_dist)
        w = self.to_distance_weights(x).unflatten(-1, (self.heads, self.num_distance_basis)).transpose(1, 2)
        curves = w @ self.distance_bank.to(w.dtype)  # (b, h, i, max_dist)
        idx = dist.clamp(0, self.max_dist - 1)[:, None].expand(b, self.heads, i, dist.shape[-1])
        return torch.where(valid[:, None], curves.gather(-1, idx), 0.0)  # (b, h, i, j)


class DataDependentAlibi(nn.Module):
    """The parameters of x-transformers' ``DataDependentAlibi`` / ``PerRowDataDependentAlibi`` under its names (the
    attention's ``data_dependent_alibi``): ``to_forget_gates``, a ``Sequential`` whose first layer is the linear map
    of the queries' input: ``Linear(dim, heads * (1|2))`` with bias ``bias_init`` (a gate per position and head, two
    without ``causal``), or per row ``Linear(dim, 2 * heads * per_row_dim_head, bias=False)`` (a small query and key
    per head, whose scaled product is the gate of each query-key pair). The attention computes the bias
    (``forget_bias``)."""

    def __init__(self, dim: int, heads: int, causal: bool, bias_init: float = 5.0, post_log_scale: float = 1.0,
                 per_row_dim_head: int | None = None):
        super().__init__()
        self.causal, self.post_log_scale, self.per_row_dim_head = causal, float(post_log_scale), per_row_dim_head
        if per_row_dim_head is None:
            lin = nn.Linear(dim, heads * (1 if causal else 2))
            nn.init.constant_(lin.bias, float(bias_init))
        else:
            lin = nn.Linear(dim, 2 * heads * per_row_dim_head, bias=False)
        self.to_forget_gates = nn.Sequential(lin)


def init_forget_gates(attn: AttentionModule, dim: int, heads: int, causal: bool, data_dependent_alibi: bool,
                      data_dependent_alibi_kwargs: dict | None, per_row: bool = False, per_row_dim_head: int = 8) -> None:
    """x-transformers' ``data_dependent_alibi`` (forgetting transformer), checked and set on ``attn`` as
    ``data_dependent_alibi`` (``DataDependentAlibi``): log forget gates summed between key and query as an additive
    bias, per position and head (causal: one gate per head; else two, one per direction), or with
    ``data_dependent_alibi_per_row`` per query-key pair (causal only; ``data_dependent_alibi_per_row_dim_head``
    features per small query and key). ``data_dependent_alibi_kwargs``: ``bias_init`` (default 5, not per row) and
    ``post_log_scale`` (default 1), which scales the log gates."""
    dd = dict(post_log_scale=1.0) if per_row else dict(bias_init=5.0, post_log_scale=1.0)
    unknown = set(data_dependent_alibi_kwargs or {}) - set(dd)
    if unknown or (data_dependent_alibi_kwargs and not data_dependent_alibi):
        raise ValueError(f"data_dependent_alibi_kwargs takes {' and '.join(dd)} with data_dependent_alibi=True, "
                         f"got {data_dependent_alibi_kwargs!r}")
    if per_row and not (data_dependent_alibi and causal):
        raise ValueError("data_dependent_alibi_per_row gates each query-key pair of data_dependent_alibi: it needs "
                         "data_dependent_alibi=True and a causal attention (x-transformers' too)")
    if per_row and not _positive_int(per_row_dim_head):
        raise ValueError(f"data_dependent_alibi_per_row_dim_head must be a positive integer, got {per_row_dim_head!r}")
    dd.update(data_dependent_alibi_kwargs or {})
    attn.data_dependent_alibi = DataDependentAlibi(dim, heads, causal, **dd, per_row_dim_head=per_row_dim_head
                                                   if per_row else None) if data_dependent_alibi else None
    if data_dependent_alibi:  # earlier safeformer held the linear map as the attention's to_forget_gates
        attn._register_load_state_dict_pre_hook(_rename_keys({"to_forget_gates.weight": "data_dependent_alibi.to_forget_gates.0.weight",
                                                              "to_forget_gates.bias": "data_dependent_alibi.to_forget_gates.0.bias"}))


def init_window(attn: AttentionModule, max_attend_past: int | None) -> None:
    """x-transformers' ``max_attend_past``, checked and set on ``attn``: a query sees no key more than that many
    positions before it (an additive ``-inf`` over those keys; memory keys are always seen)."""
    if max_attend_past is not None and (not _positive_int(max_attend_past)):
        raise ValueError(f"max_attend_past must be a positive integer or None, got {max_attend_past!r}")
    attn.max_attend_past = max_attend_past


def option_bias(attn: AttentionModule, x: Tensor, mask, bias, causal: bool, self_pad: Tensor | None, j: int,
                positions) -> Tensor:
    """``bias`` plus the bias options of ``attn`` (the window of ``max_attend_past``, the relative projection bias,
    then the forget gates'), for the queries' input ``x (b, i, c)`` and ``j`` keys: ``(b, h, i, j)``. ``self_pad
    (b, i)``: padded positions of ``x`` (their ``x`` selected to 0 first; no real position for the forget gates);
    ``positions``: ``forward``'s ``(q_pos, k_pos)`` (the real tokens' from a stack; by default the index positions,
    the queries the last ``i`` of the ``j`` keys)."""
    b, i = x.shape[:2]
    if attn.max_attend_past is not None:  # x-transformers' window: keys too far back are masked (-inf)
        q_pos, k_pos = positions if positions is not None else (
            torch.arange(j - i, j, device=x.device), torch.arange(j, device=x.device))
        far = (q_pos[..., :, None] - k_pos[..., None, :]) > attn.max_attend_past  # (b|1, i, j) or (i, j)
        window = torch.zeros(far.shape, dtype=x.dtype, device=x.device).masked_fill(far, float("-inf"))
        window = window.reshape((-1, 1) + tuple(far.shape[-2:]))  # (b|1, 1, i, j)
        bias = window if bias is None else bias + window
    if attn.rel_proj_pos_bias is not None:  # from the queries' input, padded rows selected to 0 first
        xs = x if self_pad is None else torch.where(self_pad[..., None], x, 0.0)
        rp = attn.rel_proj_pos_bias(xs, seq_len_k=j, positions=positions).to(x.dtype)  # (b, h, i, j)
        bias = rp if bias is None else bias + rp
    if attn.to_forget_gates is not None:  # the forget-gate bias over the real positions, added to any bias
        reach = None if bias is None else bias.to(x.dtype) != float("-inf")
        _, real = alive(mask, causal, b, attn.heads, i, j, x.device, reach)
        if self_pad is not None:
            real = self_pad if real is None else real & self_pad
        dd = forget_bias(attn, x, real)  # (b, h, i, i)
        bias = dd if bias is None else bias + dd
    return bias


def forget_bias(attn: AttentionModule, x: Tensor, real: Tensor | None) -> Tensor:
    """x-transformers' ``DataDependentAlibi``: ``F = cumsum(logsigmoid(Linear(x)) * post_log_scale)`` over the
    positions (float32; masked positions add 0, their x selected to 0 first), then ``F[i] - F[j]`` (causal),
    or that below the diagonal plus ``R[j] - R[i]`` of the second gates above it. ``(b, h, i, i)``."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    dd = attn.data_dependent_alibi
    keep = None if real is None else real.expand(x.shape[0], x.shape[1])
    if dd.per_row_dim_head is not None:
        return _per_row_bias(attn, dd, x, keep, dtype)
    g = F.logsigmoid(attn._linear(dd.to_forget_gates[0], x, keep).to(dtype)) * dd.post_log_scale
    if keep is not None:
        g = torch.where(keep[..., None], g, 0.0)
    g = g.transpose(1, 2).cumsum(dim=-1)  # (b, h * (1|2), i)
    if dd.causal:
        return (g[..., :, None] - g[..., None, :]).to(x.dtype)
    f, r = g.chunk(2, dim=1)
    return ((f[..., :, None] - f[..., None, :]).tril() + (r[..., None, :] - r[..., :, None]).triu()).to(x.dtype)


def _per_row_bias(attn: AttentionModule, dd: DataDependentAlibi, x: Tensor, keep: Tensor | None, dtype) -> Tensor:
    """x-transformers' ``PerRowDataDependentAlibi``: per head a small query and key ``(d_g)`` of each position, the
    gate of a pair ``logsigmoid(q_i . k_j / sqrt(d_g)) * post_log_scale`` for the keys before the query (a masked key
    adds 0: its gate is selected away, whatever its input held), summed from each key up to the query. ``(b, h, i, i)``."""
    d = dd.per_row_dim_head
    qk = attn._linear(dd.to_forget_gates[0], x, keep).to(dtype).unflatten(-1, (2, attn.heads, d))  # (b, i, 2, h, d)
    q, k = qk.permute(2, 0, 3, 1, 4)  # (b, h, i, d) each
    g = F.logsigmoid((q @ k.transpose(-1, -2)) * d**-0.5) * dd.post_log_scale  # (b, h, i, i)
    n = x.shape[1]
    before = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)  # key j before query i
    ok = before if keep is None else before & keep[:, None, None, :]
    g = torch.where(ok, g, 0.0)
    return g.flip(-1).cumsum(-1).flip(-1).to(x.dtype)  # sum over keys j..i-1
