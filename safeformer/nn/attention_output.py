"""``Attention``'s output options: the output projection, the gates (value gates, per-head gates, output gates) and
the values' orthogonal projection, built and checked here and applied by ``Attention._output`` (the one output seam)
and ``output_phase``.

Shape legend: b batch, i queries, h query heads, h_kv key/value heads, d head dim, c model width, r a gate's rank.

A dead row's attention output is 0 before these options and stays exactly 0 after them (a gate multiplies it; the
output projection's bias is selected away there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention_calls import AttentionModule, _positive_int, plus_kept
from .options import Options, self_only


@dataclass(frozen=True)
class OutputOptions(Options):
    """The output projection's keywords (x-transformers' names), read by ``init_out`` (documented there)."""

    dim_out: int | None = None
    project_out: bool | None = None
    on_attn: bool = False
    zero_init_output: bool = False
    orthog_projected_values: bool = self_only(False)
    orthog_projected_values_per_head: bool = self_only(False)
    head_scale: bool = False
    sublayer_dropout: float = 0.0
    output_proj_depth: int | None = None


@dataclass(frozen=True)
class GateOptions(Options):
    """The output gates' keywords (x-transformers' names), read by ``init_gates`` (documented there)."""

    gate_values: bool = False
    gate_values_rank: int | None = None
    gate_values_headwise: bool = False
    gate_value_heads: bool = False
    output_gate: bool = False
    output_gate_rank: int | None = None
    output_gate_headwise: bool = False
    swiglu_values: bool = False
    low_rank_silu_gates: bool = True


def init_out(attn: AttentionModule, o: OutputOptions, dim: int, heads: int, dim_head: int, bias: bool,
             value_rmsnorm: bool, dim_value: int | None = None) -> None:
    """The output projection ``to_out`` of ``attn`` (its width ``dim_out``), checked and set.

    Args (``Attention``'s keywords):
        dim_out: the output width (default ``dim``).
        project_out: whether there is an output projection (x-transformers' rule by default: with more than one
            head, ``dim_out != dim`` or ``on_attn``; a single head whose width is already ``dim_out`` has none,
            ``to_out`` is the identity). A single head of another width keeps its projection (x-transformers' model
            would not run); ``project_out=False`` then is an error.
        on_attn: x-transformers' attention on attention: ``to_out`` is ``Sequential(Linear(h * e, 2 * dim_out),
            GLU())``, the output gated by a second projection of itself.
        dim_value: the value head width e (``value_dim_head``; default ``dim_head``).
        zero_init_output: ``to_out`` starts at zero (x-transformers' name).
        orthog_projected_values, orthog_projected_values_per_head: x-transformers' orthogonal projected values:
            the attention output minus its projection onto the values, over a sample's whole sequence, once per
            option, concatenated before ``to_out`` (self-attention without a KV cache; not with ``value_rmsnorm``).
    """
    attn.orthog_projected_values = bool(o.orthog_projected_values)
    attn.orthog_projected_values_per_head = bool(o.orthog_projected_values_per_head)
    orthog_parts = int(attn.orthog_projected_values) + int(attn.orthog_projected_values_per_head)
    if orthog_parts and value_rmsnorm:
        raise ValueError("orthog_projected_values projects onto the values before value_rmsnorm: the two together "
                         "are not supported")
    if o.dim_out is not None and not _positive_int(o.dim_out):
        raise ValueError(f"dim_out must be a positive integer, got {o.dim_out!r}")
    attn.dim_out = dim if o.dim_out is None else o.dim_out
    _make_to_out(attn, heads * (dim_value or dim_head) * max(1, orthog_parts), dim, heads, bias, o.project_out,
                 o.on_attn)
    if not isinstance(o.head_scale, bool):
        raise TypeError(f"head_scale must be True or False, got {o.head_scale!r}")
    attn.head_scale_params = nn.Parameter(torch.ones(1, heads, 1, 1)) if o.head_scale else None
    if isinstance(o.sublayer_dropout, bool) or not isinstance(o.sublayer_dropout, (int, float)) \
            or not 0 <= o.sublayer_dropout < 1:
        raise ValueError(f"sublayer_dropout must be a probability in [0, 1), got {o.sublayer_dropout!r}")
    attn.sublayer_dropout = nn.Dropout(o.sublayer_dropout) if o.sublayer_dropout > 0 else None
    if o.output_proj_depth is not None and not _positive_int(o.output_proj_depth):
        raise ValueError(f"output_proj_depth must be a positive integer, got {o.output_proj_depth!r}")
    linear = out_linear(attn)
    if (o.zero_init_output or o.output_proj_depth is not None) and linear is None:
        raise ValueError("zero_init_output / output_proj_depth initialise the output projection: this attention has "
                         "none (project_out=False, or one head of width dim_out)")
    if o.zero_init_output:  # x-transformers' zero_init_output: the block starts as the identity of the residual
        nn.init.zeros_(linear.weight)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)
    elif o.output_proj_depth is not None:  # OLMo's depth-scaled init (x-transformers' init_depth_scaled_)
        nn.init.normal_(linear.weight, std=(2 * linear.in_features * o.output_proj_depth) ** -0.5)


def _make_to_out(attn: AttentionModule, inner: int, dim: int, heads: int, bias: bool, project_out, on_attn) -> None:
    """``attn.to_out`` as x-transformers builds it: a linear map of the ``inner`` features to ``dim_out``, the
    identity (no projection), or with ``on_attn`` a linear map to ``2 * dim_out`` and a GLU."""
    if project_out is not None and not isinstance(project_out, bool):
        raise TypeError(f"project_out must be True, False or None, got {project_out!r}")
    if not isinstance(on_attn, bool):
        raise TypeError(f"on_attn must be True or False, got {on_attn!r}")
    if on_attn and project_out is False:
        raise ValueError("on_attn gates the output projection: not with project_out=False")
    need = project_out if project_out is not None else (heads > 1 or attn.dim_out != dim or on_attn)
    if not need and inner != attn.dim_out:
        if project_out is False:
            raise ValueError(f"project_out=False leaves the heads' {inner} features as the output, but dim_out is "
                             f"{attn.dim_out}: they must be equal")
        need = True  # one head of another width: x-transformers' identity would not fit the residual
    if on_attn:
        attn.to_out = nn.Sequential(nn.Linear(inner, attn.dim_out * 2, bias=bias), nn.GLU())
    else:
        attn.to_out = nn.Linear(inner, attn.dim_out, bias=bias) if need else nn.Identity()


def out_linear(attn: AttentionModule) -> nn.Linear | None:
    """The linear map of ``attn``'s output projection (``to_out``, or its first part with ``on_attn``), or ``None``
    when there is none (the identity)."""
    out = attn.to_out
    if isinstance(out, nn.Sequential):
        out = out[0]
    return out if isinstance(out, nn.Linear) else None


def init_gates(attn: AttentionModule, o: GateOptions, dim: int, heads: int, dim_head: int) -> None:
    """The gates of ``attn``'s output (``to_v_gate``, ``to_v_head_gate``, ``to_output_gate``, ``gate_activation``),
    checked and set.

    Args (``Attention``'s keywords):
        gate_values, output_gate: gated attention (x-transformers' options of these names, HyGA): the attention
            output, before ``to_out``, times ``sigmoid(x_gate(x) + h_gate(out))`` (SiLU with ``swiglu_values``),
            the x gate reading the queries' input, the h gate the attention output; ``*_headwise``: one
            logit per head; ``*_rank``: a low-rank projection (``low_rank_silu_gates``: SiLU between). The
            projections start at zero. A dead row stays exactly 0 (its output is 0 before the gate).
        gate_value_heads: x-transformers' per-head gate: each head's output times ``sigmoid(Linear(x))`` (weight 0,
            bias 10 at init), before the gates above; padded rows' ``x`` is selected to 0 first.
    """
    for name, on, rank, headwise in (("gate_values", o.gate_values, o.gate_values_rank, o.gate_values_headwise),
                                     ("output_gate", o.output_gate, o.output_gate_rank, o.output_gate_headwise)):
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
            raise ValueError(f"{name}_rank must be a positive integer, got {rank!r}")
        if (rank is not None or headwise) and not on:
            raise ValueError(f"{name}_rank / {name}_headwise were given but {name} is off; set {name}=True")
        if rank is not None and headwise:
            raise ValueError(f"{name}_rank cannot be set with {name}_headwise (the headwise gate projects to heads directly)")
    if o.swiglu_values and not (o.gate_values or o.output_gate):
        raise ValueError("swiglu_values changes the gate's activation: it needs gate_values or output_gate")
    inner = heads * attn.dim_value
    act = nn.SiLU() if o.low_rank_silu_gates else None
    attn.to_v_gate = _gate_linear(dim, heads if o.gate_values_headwise else inner, o.gate_values_rank, act) \
        if o.gate_values else None
    # x-transformers' gate_value_heads: each head's output times sigmoid(Linear(x)), open at init (bias 10)
    attn.to_v_head_gate = None
    if o.gate_value_heads:
        attn.to_v_head_gate = nn.Linear(dim, heads)
        nn.init.zeros_(attn.to_v_head_gate.weight)
        nn.init.constant_(attn.to_v_head_gate.bias, 10.0)
    attn.to_output_gate = _gate_linear(inner, heads if o.output_gate_headwise else inner, o.output_gate_rank, act) \
        if o.output_gate else None
    attn.gate_activation = F.silu if o.swiglu_values else torch.sigmoid


class _LowRankLinear(nn.Module):
    """``up(act(down(x)))`` without biases, ``up`` starting at zero (x-transformers' ``LoRALinear``; the same
    parameter names, so its weights load as they are)."""

    def __init__(self, dim_in: int, dim_out: int, rank: int, activation: nn.Module | None):
        super().__init__()
        self.down = nn.Linear(dim_in, rank, bias=False)
        self.up = nn.Linear(rank, dim_out, bias=False)
        nn.init.zeros_(self.up.weight)
        self.activation = activation if activation is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.activation(self.down(x)))


def _gate_linear(dim_in: int, dim_out: int, rank: int | None, activation: nn.Module | None) -> nn.Module:
    """The gate's projection: a bias-less linear starting at zero, or a low-rank one of ``rank``."""
    if rank is None:
        linear = nn.Linear(dim_in, dim_out, bias=False)
        nn.init.zeros_(linear.weight)
        return linear
    if not (rank < dim_in or rank < dim_out):
        raise ValueError(f"the gate's rank ({rank}) must be below its input ({dim_in}) or output ({dim_out}) width")
    return _LowRankLinear(dim_in, dim_out, rank, activation)


def output_phase(attn: AttentionModule, out: Tensor, x: Tensor, hybrid, self_pad: Tensor | None, rows_ok: Tensor | None,
                 v_orthog: Tensor | None, o_delta: Tensor | None = None) -> Tensor:
    """One padded call's output ``(b, i, c)`` from the attention's ``out (b, h, i, d)``: dead rows and padded
    queries 0 before the orthogonal projection (it sums over the sample), the hybrid module's output mixed in,
    then ``attn._output``: padded queries (``self_pad (b, i)``) selected before ``to_out``, dead rows (``rows_ok
    (b|1, i)`` False) exactly 0 after it where a bias, padding, the hybrid branch or ``o_delta`` (x-transformers'
    output modulation ``(b, i, h * e)``) would move them."""
    zero_rows = rows_ok if rows_ok is not None and (attn.out_bias is not None or self_pad is not None
                                                    or attn.hybrid is not None or o_delta is not None) else None
    values = None
    out = out.transpose(1, 2)  # (b, i, h, d)
    if attn.orthog:  # dead rows and padded queries are 0 before the projection (it sums over the sample)
        values = v_orthog
        if rows_ok is not None:
            out = torch.where(rows_ok[:, :, None, None], out, 0.0)
    if attn.hybrid is not None:  # the hybrid module's output mixed in (dead rows: 0 after to_out all the same)
        out = attn.hybrid(out, x, hybrid, self_pad)
    return attn._output(out, x, self_pad, zero_rows, values, o_delta)  # (b, i, c)


def attention_output(attn: AttentionModule, out: Tensor, x: Tensor, keep: Tensor | None = None,
                     rows_ok: Tensor | None = None, values: Tensor | None = None,
                     o_delta: Tensor | None = None) -> Tensor:
    """``Attention._output``: ``out (..., h, d)`` -> ``(..., c)``, the output projection. ``x (..., c)`` is the
    queries' input (what an output option such as a per-head gate reads); ``keep``: rows selected to 0 before the
    projection (whatever a kernel returned for padded queries never reaches ``to_out``); ``rows_ok``: rows that are
    exactly 0 after it (a bias would move dead rows off 0). ``values (b, i, h_kv, d)``: with
    ``orthog_projected_values``, the new values (masked ones selected to 0) that ``out`` is projected off.
    ``o_delta (..., h * d)``: x-transformers' output modulation, added to the merged heads before the gates (selected
    to 0 where ``keep`` is False)."""
    if attn.head_scale_params is not None:  # x-transformers' head_scale (Normformer): one learned gain per head
        out = out * attn.head_scale_params.reshape(-1, 1).to(out.dtype)
    if attn.to_v_head_gate is not None:  # padded rows' x selected to 0 first; a dead row's out is 0 and stays 0
        xs = x if keep is None else torch.where(keep[..., None], x, 0.0)
        out = out * torch.sigmoid(attn.to_v_head_gate(xs))[..., None].to(out.dtype)
    if o_delta is not None:
        out = plus_kept(out.flatten(-2), o_delta, keep).unflatten(-1, out.shape[-2:])
    if attn.to_v_gate is not None or attn.to_output_gate is not None:
        out = gate(attn, out, x, keep)
    flat = out.flatten(-2) if values is None else orthog_project(attn, out, values)
    out = attn._linear(attn.to_out, flat, keep)
    if attn.sublayer_dropout is not None:
        out = attn.sublayer_dropout(out)
    return out if rows_ok is None else torch.where(rows_ok[..., None], out, 0.0)


def gate(attn: AttentionModule, out: Tensor, x: Tensor, keep: Tensor | None) -> Tensor:
    """Gated attention: ``out (..., h, d) * act(x gate + h gate)``. The x gate reads ``x`` with the rows
    ``keep`` drops selected to 0 first; a dead row's ``out`` is 0, so it stays 0 whatever its gate."""
    h, d = attn.heads, attn.dim_value

    def heads_of(g: Tensor) -> Tensor:  # (..., h) -> (..., h, 1); (..., h * d) -> (..., h, d)
        return g[..., None] if g.shape[-1] == h and h * d != h else g.unflatten(-1, (h, d))

    logits = 0.0
    if attn.to_v_gate is not None:
        xs = x if keep is None else torch.where(keep[..., None], x, 0.0)
        logits = logits + heads_of(attn.to_v_gate(xs))
    if attn.to_output_gate is not None:
        logits = logits + heads_of(attn.to_output_gate(out.flatten(-2)))
    return out * attn.gate_activation(logits)


def orthog_project(attn: AttentionModule, out: Tensor, values: Tensor) -> Tensor:
    """x-transformers' ``orthog_project``: ``out (b, i, h, d)`` minus its projection onto the values
    ``(b, i, h_kv, d)`` (each query head paired with its key/value head), both flattened over the whole
    sample (positions, heads and features), in float64; once per option (``_per_head`` flattens the same
    way), concatenated: ``(b, i, parts * h * d)``. Dead rows of ``out`` and masked values are 0 here, so
    they add nothing to the dot product or the norm."""
    g = attn.heads // attn.kv_heads
    if g > 1:  # each query head beside the values of its key/value head (n % h_kv tiled, n // g interleaved)
        vv = values.repeat(1, 1, g, 1) if attn.kv_head_order == "tiled" else values.repeat_interleave(g, dim=-2)
    else:
        vv = values
    o, y = out.flatten(1).double(), vv.flatten(1).double()
    unit = F.normalize(y, dim=-1)
    proj = (o - (o * unit).sum(-1, keepdim=True) * unit).to(out.dtype).reshape(*out.shape[:2], -1)
    parts = int(attn.orthog_projected_values) + int(attn.orthog_projected_values_per_head)
    return proj if parts == 1 else torch.cat([proj] * parts, dim=-1)


def check_head_scale(attn: AttentionModule) -> None:
    """``head_scale`` beside a hybrid module is refused: x-transformers scales the heads before the hybrid output
    is mixed in, safeformer's hybrid mix comes first."""
    if attn.head_scale_params is not None and attn.hybrid is not None:
        raise ValueError("head_scale scales the attention heads before the hybrid module's output is mixed in "
                         "(x-transformers' order): the two together are not supported")
