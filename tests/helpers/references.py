"""float64 references, written as plainly as possible: loops over samples, heads and query rows.

``ref_attend`` is the one reference attention (q, k, v in; masked keys selected away by indexing, never
multiplied by 0, so garbage there cannot reach the result); ``ref_attention`` runs it with an
``Attention`` module's weights, ``ref_stack`` a whole pre-norm layer stack, ``ref_wrapper`` a
``TransformerWrapper``. The rest: norms, feed-forward, rotary positions (a complex rotation), ALiBi,
classifier-free guidance, cross-entropy.

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim (q, k),
e head dim (v), m memory keys, n sequence positions, c model width, v vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

import safeformer as sf
from safeformer.nn.modules import LayerNorm

from .numerics import INF

__all__ = [
    "causal_allowed", "allowed_matrix", "ref_attend", "ref_attention",
    "ref_layer_norm", "ref_rms_norm", "ref_norm", "ref_gelu", "ref_silu", "ref_feed_forward",
    "ref_rotate", "ref_alibi_slopes", "ref_positions", "ref_stack", "ref_wrapper",
    "ref_guidance", "ref_cross_entropy",
]

# ----------------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------------


def causal_allowed(i: int, j: int) -> Tensor:
    """``(i, j)``: bottom-right aligned causal, written as loops: query q sees key k iff k <= q + (j - i)."""
    allowed = torch.zeros(i, j, dtype=torch.bool)
    for qi in range(i):
        for kj in range(j):
            allowed[qi, kj] = kj <= qi + (j - i)
    return allowed


def allowed_matrix(b: int, h: int, i: int, j: int, mask4d: Tensor | None, causal: bool) -> Tensor:
    """The combined ``(b, h, i, j)`` bool matrix: the user's mask (broadcast) AND (bottom-right) causal."""
    allowed = torch.ones(b, h, i, j, dtype=torch.bool)
    if mask4d is not None:
        allowed = allowed & mask4d.cpu()
    if causal:
        allowed = allowed & causal_allowed(i, j)
    return allowed


def ref_attend(q: Tensor, k: Tensor, v: Tensor, mask4d: Tensor | None = None, scale: float | None = None, *,
               causal: bool = False, bias: Tensor | None = None, softclamp: float | None = None,
               sink: Tensor | None = None, mem_kv: tuple[Tensor, Tensor] | None = None, tiled: bool = False) -> Tensor:
    """Attention in float64, one query row at a time: ``(b, h, i, d), (b, h_kv, j, d), (b, h_kv, j, e)
    -> (b, h, i, e)``.

    Masked keys (``mask4d``, broadcast to ``(b, h, i, j)``, True = may attend; and bottom-right causal)
    are *selected away*, so garbage there cannot reach the result. Grouped-query attention by
    ``repeat_interleave`` (``attend``'s pairing: query head ``n`` reads key head ``n // g``), or with ``tiled``
    x-transformers' (``n % h_kv``, an ``Attention``'s default). Per row, the logits ``k . q * scale`` (scale ``d ** -0.5`` by default) of the
    memory keys ``mem_kv = (mem_k (h_kv, m, d), mem_v (h_kv, m, e))`` (every query sees them) and of the
    allowed keys, plus ``bias`` (broadcast to ``(b, h, i, j)``; 0 for memory keys), clamped to
    ``tanh(logit / softclamp) * softclamp``; then a learned sink (``sink (h,)``: one more key, logit
    ``sink[h]`` unclamped, value 0). A row with no key at all is 0. Differentiable.
    """
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    b, h, i, d = q.shape
    h_kv, j, e = k.shape[1], k.shape[2], v.shape[-1]
    g = h // h_kv
    k = k.repeat(1, g, 1, 1) if tiled else k.repeat_interleave(g, dim=1)  # (b, h, j, d)
    v = v.repeat(1, g, 1, 1) if tiled else v.repeat_interleave(g, dim=1)  # (b, h, j, e)
    m = 0 if mem_kv is None else mem_kv[0].shape[1]
    if m:
        mem_k, mem_v = (t.double().cpu().repeat(g, 1, 1) if tiled else t.double().cpu().repeat_interleave(g, dim=0)
                        for t in mem_kv)  # (h, m, d|e)
    scale = d**-0.5 if scale is None else scale
    allowed = allowed_matrix(b, h, i, j, mask4d, causal)
    full_bias = None if bias is None else bias.double().cpu().expand(b, h, i, j)
    sink = None if sink is None else sink.double().cpu()
    rows = []
    for bi in range(b):
        for hi in range(h):
            for qi in range(i):
                keys = allowed[bi, hi, qi].nonzero().flatten()
                kk, vv = k[bi, hi, keys], v[bi, hi, keys]  # (n_keys, d), (n_keys, e)
                if m:
                    kk, vv = torch.cat((mem_k[hi], kk)), torch.cat((mem_v[hi], vv))
                logits = (kk @ q[bi, hi, qi]) * scale  # (m + n_keys,)
                if full_bias is not None:
                    logits = logits + torch.cat((torch.zeros(m, dtype=torch.float64), full_bias[bi, hi, qi, keys]))
                if softclamp is not None:
                    logits = torch.tanh(logits / softclamp) * softclamp
                if sink is not None:
                    logits = torch.cat((sink[hi].reshape(1), logits))
                    vv = torch.cat((torch.zeros(1, e, dtype=torch.float64), vv))
                if len(logits) == 0:
                    rows.append(torch.zeros(e, dtype=torch.float64))
                    continue
                weights = torch.exp(logits - logits.max())
                weights = weights / weights.sum()
                rows.append(weights @ vv)  # (e,)
    if not rows:
        return torch.zeros(b, h, i, e, dtype=torch.float64)
    return torch.stack(rows).reshape(b, h, i, e)


def ref_attention(attn: sf.Attention, x: Tensor, context: Tensor | None = None, *, allowed: Tensor | None = None,
                  causal: bool = False, queries: Tensor | None = None, q_pos: Tensor | None = None,
                  k_pos: Tensor | None = None, rot_dim: int = 0, theta: float = 10000.0, alibi: bool = False) -> Tensor:
    """float64 multi-head attention with ``attn``'s weights: projections (and their biases), qk-norm,
    rotary or ALiBi positions, memory keys, learned sink and logit softclamp, then ``ref_attend``.

    Args:
        attn: the module whose weights (and options) are used.
        x: ``(b, i, c)`` queries' input.
        context: ``(b, j, c_ctx)`` or ``None`` (self-attention).
        allowed: bool ``(b, h, i, j)`` (or broadcastable), True = may attend.
        causal: also require ``key <= query + (j - i)``.
        queries: bool ``(b, i)``: real queries; the output of the others is 0 (padding).
        q_pos, k_pos: ``(b, i)`` and ``(b, j)`` positions for rotary (``rot_dim > 0``) or ALiBi.
        rot_dim, theta: rotary features per head and base.
        alibi: add ``-slope_h * |q_pos - k_pos|``.

    Returns:
        ``(b, i, c)``; a query that sees no key in any head gives exactly 0.
    """
    P = {n: p.detach().double() for n, p in attn.named_parameters()}
    x = x.detach().double()
    src = x if context is None else context.detach().double()
    b, i, _ = x.shape
    j = src.shape[1]
    h, h_kv, d = attn.heads, attn.kv_heads, attn.dim_head

    def project(t: Tensor, name: str, heads: int) -> Tensor:  # (b, n, c) -> (b, heads, n, d)
        y = t @ P[f"{name}.weight"].T
        if f"{name}.bias" in P:
            y = y + P[f"{name}.bias"]
        return y.reshape(b, -1, heads, d).transpose(1, 2)

    q, k, v = project(x, "to_q", h), project(src, "to_k", h_kv), project(src, "to_v", h_kv)
    if attn.q_norm is not None:  # x-transformers' qk-norm: L2 per head (or group), a multiplier or learned scales
        q = ref_l2norm(q, attn.qk_norm_groups) * attn.q_norm.mult
        k = ref_l2norm(k, attn.qk_norm_groups) * attn.k_norm.mult
        if attn.qk_norm_q_scale is not None:
            q = q * attn.qk_norm_q_scale.detach().double()  # (h, 1, d)
            k = k * attn.qk_norm_k_scale.detach().double()
    if rot_dim:
        q = ref_rotate(q, q_pos[:, None], rot_dim, theta)
        k = ref_rotate(k, k_pos[:, None], rot_dim, theta)
    bias = None
    if alibi:
        slopes = torch.tensor(ref_alibi_slopes(h), dtype=torch.float64)[None, :, None, None]
        bias = -slopes * (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs().double()  # (b, h, i, j)
    mem_kv = (P["mem_k"], P["mem_v"]) if "mem_k" in P else None
    sink = P.get("attend.head_attn_sink")
    o = ref_attend(q, k, v, allowed, 1.0 / math.sqrt(d), causal=causal, bias=bias,
                   softclamp=getattr(attn, "softclamp_value", None), sink=sink, mem_kv=mem_kv,
                   tiled=attn.kv_head_order == "tiled")  # (b, h, i, d)
    y = o.transpose(1, 2).reshape(b, i, h * d) @ P["to_out.weight"].T
    if "to_out.bias" in P:
        y = y + P["to_out.bias"]
    live = allowed_matrix(b, h, i, j, allowed, causal).any(-1).any(1)  # (b, i): sees a key in some head
    if mem_kv is not None or sink is not None:
        live = torch.ones(b, i, dtype=torch.bool)
    if queries is not None:
        live = live & queries.cpu()
    return torch.where(live[..., None], y, torch.zeros((), dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------
# norms, feed-forward, positions
# ----------------------------------------------------------------------------------------------------


def ref_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def ref_l2norm(x: Tensor, groups: int = 1) -> Tensor:
    """``x`` L2-normalised over each group of its last dim's features (x-transformers' ``l2norm``, floor 1e-12)."""
    shape = x.shape
    t = x.double().reshape(*shape[:-1], groups, shape[-1] // groups)
    return (t / t.norm(dim=-1, keepdim=True).clamp_min(1e-12)).reshape(shape)


def ref_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight


def ref_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """float64 reference of a safeformer norm module (``LayerNorm``: gain ``gamma`` plus its unit offset, an optional
    shift; or ``RMSNorm``)."""
    if isinstance(norm, LayerNorm):
        bias = torch.zeros((), dtype=torch.float64) if norm.bias is None else norm.bias.detach().double()
        return ref_layer_norm(x, norm.weight.detach().double(), bias, norm.eps)
    assert isinstance(norm, sf.RMSNorm), type(norm)
    return ref_rms_norm(x, norm.weight.detach().double(), norm.eps)


def ref_gelu(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def ref_silu(x: Tensor) -> Tensor:
    return x / (1.0 + torch.exp(-x))


def ref_feed_forward(ff: sf.FeedForward, x: Tensor) -> Tensor:
    """float64 reference of ``FeedForward``: Linear, activation (or gate), Linear."""
    w1, b1 = ff.proj_in.weight.detach().double(), ff.proj_in.bias.detach().double()
    w2, b2 = ff.proj_out.weight.detach().double(), ff.proj_out.bias.detach().double()
    act = ref_silu if isinstance(ff.act, nn.SiLU) else ref_gelu
    h = x @ w1.T + b1
    if ff.glu:
        half = h.shape[-1] // 2
        h = h[..., :half] * act(h[..., half:])
    else:
        h = act(h)
    return h @ w2.T + b2


def ref_rotate(t: Tensor, pos: Tensor, rot_dim: int, theta: float = 10000.0) -> Tensor:
    """``t (..., n, d)`` in float64 with features ``(2p, 2p+1)`` turned by the angle
    ``pos * theta ** (-2p / rot_dim)`` (a complex product); features past ``rot_dim`` pass through.
    ``pos (..., n)`` broadcasts against ``t``'s leading dims (e.g. ``(b, 1, n)`` for ``t (b, h, n, d)``)."""
    t = t.double()
    out = t.clone()
    for p in range(rot_dim // 2):
        ang = pos.double() * theta ** (-2.0 * p / rot_dim)
        z = torch.complex(t[..., 2 * p], t[..., 2 * p + 1]) * torch.polar(torch.ones_like(ang), ang)
        out[..., 2 * p], out[..., 2 * p + 1] = z.real, z.imag
    return out


def ref_alibi_slopes(heads: int) -> list[float]:
    """The ALiBi slopes of the paper: geometric from ``2 ** (-8 / n)``; for non-powers of two the
    closest power of two, then every other slope of twice that many."""

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (k + 1) / n) for k in range(n)]

    if heads & (heads - 1) == 0:
        return geometric(heads)
    closest = 2 ** int(math.floor(math.log2(heads)))
    return geometric(closest) + geometric(2 * closest)[0::2][: heads - closest]


def ref_positions(mask: Tensor | None, b: int, n: int, offset: Tensor | None = None) -> Tensor:
    """Position of each real token = number of real tokens before it (padding: don't care)."""
    if mask is None:
        pos = torch.arange(n).expand(b, n)
    else:
        pos = torch.stack([torch.tensor([int(mask[s, :t].sum()) for t in range(n)], dtype=torch.long) for s in range(b)]) if n else torch.zeros(b, 0, dtype=torch.long)
    return pos if offset is None else pos + offset[:, None]


# ----------------------------------------------------------------------------------------------------
# stacks and wrappers
# ----------------------------------------------------------------------------------------------------


def ref_stack(layers: sf.AttentionLayers, x: Tensor, *, mask: Tensor | None = None, context: Tensor | None = None,
              context_mask: Tensor | None = None, attn_mask: Tensor | None = None,
              positions: Tensor | None = None) -> Tensor:
    """float64 reference of ``AttentionLayers.forward`` (pre-norm; no cache) from its weights.

    ``attn_mask`` ``(b, n, n)`` or ``(n, n)`` further restricts self-attention; ``positions`` ``(b, n)``
    replaces the default positions. Compare only real positions: the position given to a padded
    query is not part of the contract.
    """
    x = x.detach().double()
    b, n, _ = x.shape
    if mask is not None:
        x = x * mask[..., None].double()
    key_ok = torch.ones(b, 1, 1, n, dtype=torch.bool) if mask is None else mask[:, None, None, :]
    if attn_mask is not None:
        key_ok = key_ok & (attn_mask[:, None] if attn_mask.dim() == 3 else attn_mask[None, None])
    pos = ref_positions(mask, b, n) if positions is None else positions.expand(b, n)
    cfg = layers._sf_config
    rot_dim = 0
    if cfg["rotary_pos_emb"]:
        rot_dim = cfg["rotary_emb_dim"] or cfg["dim_head"] // 2
    ctx = None
    if context is not None:
        ctx = context.detach().double()
        ctx_ok = torch.ones(b, 1, 1, ctx.shape[1], dtype=torch.bool) if context_mask is None else context_mask[:, None, None, :]
        if context_mask is not None:
            ctx = torch.where(context_mask[..., None], ctx, torch.zeros((), dtype=torch.float64))
    for kind, layer in zip(layers.layer_kinds, layers.layers):
        norm, block = layer.norm, layer.mixer
        hn = ref_norm(norm, x)
        if kind == "self":
            out = ref_attention(block, hn, allowed=key_ok, causal=layers.causal, q_pos=pos, k_pos=pos,
                                rot_dim=rot_dim, theta=cfg["rotary_theta"], alibi=cfg["alibi_pos_bias"])
        elif kind == "cross":
            if ctx is None:
                continue
            out = ref_attention(block, hn, ctx, allowed=ctx_ok)
        else:
            out = ref_feed_forward(block, hn)
        x = x + out
    return ref_norm(layers.final_norm, x)


def ref_wrapper(model: sf.TransformerWrapper, ids: Tensor, mask: Tensor | None = None, *, head: bool = True,
                **ctx) -> Tensor:
    """float64 logits ``(b, n, v)`` of a ``TransformerWrapper`` (``head=False``: its final hidden states
    ``(b, n, c)``): token embedding plus scaled absolute position (positions count the real tokens), the
    stack (``ref_stack``, given ``mask`` and ``ctx``: context, context_mask), the (tied) head."""
    b, n = ids.shape
    emb = model.token_emb.weight.detach().double()
    h = emb[torch.where(mask, ids, 0) if mask is not None else ids]
    if model.pos_emb is not None:
        h = h + model.pos_emb.emb.weight.detach().double()[ref_positions(mask, b, n)] * model.pos_emb.scale
    h = ref_stack(model.attn_layers, h, mask=mask, **ctx)
    if not head:
        return h
    if model.tie_embedding:
        return h @ emb.T * model.tie_embedding_scale
    return h @ model.to_logits.weight.detach().double().T


# ----------------------------------------------------------------------------------------------------
# guidance and losses
# ----------------------------------------------------------------------------------------------------


def ref_guidance(cond: Tensor, uncond: Tensor, scale: float, phi: float) -> Tensor:
    """Classifier-free guidance in float64, one row (last dim) at a time over its finite tokens:
    ``g = u + s (c - u)``; with ``phi`` > 0 ``phi * g * std(c) / std(g) + (1 - phi) * g`` (unbiased std over
    the finite tokens; a row with fewer than two finite tokens, or a flat guided row, is left as guided).
    A token at -inf in either branch is -inf."""
    c, u = cond.double().reshape(-1, cond.shape[-1]), uncond.double().reshape(-1, cond.shape[-1])
    out = torch.full_like(c, -INF)
    for r in range(c.shape[0]):
        live = ~(torch.isneginf(c[r]) | torch.isneginf(u[r]))
        cl, ul = c[r][live], u[r][live]
        g = ul + scale * (cl - ul)
        if phi > 0 and int(live.sum()) >= 2:
            sg = g.std()
            if float(sg.detach()) != 0.0:
                g = phi * (g * cl.std() / sg) + (1 - phi) * g
        out[r][live] = g
    return out.reshape(cond.shape)


def ref_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0, ignore_index: int = -100) -> Tensor:
    """Mean over counted targets (``target != ignore_index``) of ``(1 - eps) * nll + eps * mean_c(-log p_c)``
    in float64; ``logits (..., v)``, ``target (...)``; 0 when no target counts."""
    logp = logits.double().reshape(-1, logits.shape[-1]).log_softmax(-1)  # (N, v)
    target = torch.as_tensor(target).reshape(-1)
    valid = target != ignore_index
    nll = -logp.gather(-1, torch.where(valid, target, 0)[:, None])[:, 0]
    per = (1 - smoothing) * nll + smoothing * (-logp.mean(-1))
    per = torch.where(valid, per, torch.zeros((), dtype=torch.float64))
    return per.sum() / valid.sum().clamp(min=1)
