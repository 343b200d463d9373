"""``Attention``'s keys: which queries and keys of a call are live, and the keys every query sees besides the
inputs' own (the learned sink, the memory keys, x-transformers' ``additional_key_values``), laid out
``[sink?, memory keys, added keys, keys]`` in the keys, the mask and the bias.

Shape legend: b batch, h query heads, h_kv key/value heads, h_a added key heads, i queries, j keys, a added keys,
M memory keys, d head dim.

A masked or padded key reaches no output and no gradient: what the extra keys add is visible to every live query
(bias 0, the sink at its learned logit), and a row that sees no real key sees no sink either (a dead row: exactly 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.attend import PreparedMask, _grad_select
from ..core.masks import as_attention_mask, causal_mask, combine_masks, validate_mask
from .attention_calls import AttentionModule
from .options import Options


@dataclass(frozen=True)
class KeyOptions(Options):
    """The extra keys' keywords (x-transformers' names), read by ``init_extra_keys`` (documented there)."""

    num_mem_kv: int = 0
    learned_sink: bool = False
    head_learned_sink: bool = False
    add_zero_kv: bool = False

    @property
    def sink(self) -> bool:
        """A learned sink, in either spelling (``head_learned_sink``: x-transformers')."""
        return self.learned_sink or self.head_learned_sink


def init_extra_keys(attn: AttentionModule, o: KeyOptions, heads: int, kv_heads: int, dim_head: int) -> None:
    """The memory keys and the sink, set on ``attn``.

    Args (``Attention``'s keywords, checked by its constructor):
        num_mem_kv: learned memory key/value pairs ``mem_k, mem_v (h_kv, num_mem_kv, d)`` prepended to
            the keys of every call (x-transformers' ``attn_num_mem_kv``): every query may always see
            them (bias 0 under ALiBi), so no row is dead; masked keys still reach nothing.
        learned_sink: (x-transformers' ``head_learned_sink``, accepted too) a learned per-head sink logit
            ``head_attn_sink (h,)`` (x-transformers' ``attn_head_learned_sink``): one more key with logit
            ``head_attn_sink[h]`` and value 0, so a row's weights may sum to less than 1; a row with no other key
            gives exactly 0, after the output projection's bias too (a dead row for the no-op rule: a dropped context
            adds nothing). Its gradient flows through the additive mask, which PyTorch's flash and cuDNN kernels do
            not differentiate: with ``backend='flash'``/``'cudnn'`` a sink trains on the math kernel.
        add_zero_kv: x-transformers' zero key/value: one more key, all zeros (logit 0, bias 0) with a zero value,
            that every query sees (after the sink, before the memory keys): no row is dead, and a query with no other
            key outputs 0 (before the output projection's bias).
    """
    if not isinstance(o.add_zero_kv, bool):
        raise TypeError(f"add_zero_kv must be True or False, got {o.add_zero_kv!r}")
    attn.add_zero_kv = o.add_zero_kv
    attn.num_mem_kv = o.num_mem_kv
    if o.num_mem_kv > 0:
        attn.mem_k = nn.Parameter(torch.randn(kv_heads, o.num_mem_kv, dim_head))  # (h_kv, M, d)
        attn.mem_v = nn.Parameter(torch.randn(kv_heads, o.num_mem_kv, attn.dim_value))
    attn.attend.head_attn_sink = nn.Parameter(torch.zeros(heads)) if o.sink else None  # (h,), x-transformers' key


def key_layout(attn: AttentionModule, x: Tensor, mask, bias, causal: bool, added, inputs_finite: bool,
               self_pad: Tensor | None, j: int) -> tuple:
    """The mask and bias of one call over ``[sink?, memory keys, added keys, the j keys]``, and which queries and keys
    are live. ``added``: ``check_added``'s triple or ``None``; ``inputs_finite``: the stack selected its padded inputs
    to 0 already; ``self_pad (b, i)``: padded positions of ``x`` in self-attention (no queries either).

    Returns ``(mask, bias, j, rows_ok, keys_ok)``: ``j`` counting the extra keys, ``rows_ok (b|1, i)`` the queries
    that see a key and ``keys_ok (b|1, j)`` the keys some query sees (``None``: all, or nothing to select)."""
    b, i = x.shape[:2]
    if added is not None:  # the added keys come before the sequence's own (after sink and memory keys)
        mask, bias = prepend_keys(mask, bias, added[2], b, attn.heads, i, j, added[0].shape[2], x.device)
        j = j + added[0].shape[2]
    ext = attn.extra_keys
    sink_only = None  # (b|1, i): rows that see a real key; with the sink alone a row is dead (adds exactly 0)
    if attn.head_attn_sink is not None and attn.num_mem_kv == 0 and not attn.add_zero_kv:
        reach = None if bias is None else bias.to(x.dtype) != float("-inf")
        sink_only, _ = alive(mask, causal, b, attn.heads, i, j, x.device, reach)
    if ext:  # the sink and memory keys come first; every query sees them (bottom-right causal keeps that)
        mask, bias = extend(attn, mask, bias, b, i, j, x, sink_only)
        j = j + ext
    if inputs_finite and attn.out_bias is None and self_pad is None and not attn.orthog and attn.hybrid is None:
        rows_ok, keys_ok = None, None  # nothing to select: attend zeroes dead rows itself
    else:
        reach = None
        if bias is not None and isinstance(bias, Tensor) and bias.is_floating_point():
            reach = bias.to(x.dtype) != float("-inf")  # a bias of -inf (in x's dtype) masks its key too
        rows_ok, keys_ok = alive(mask, causal, b, attn.heads, i, j, x.device, reach)
    if self_pad is not None:
        # padded positions of x are no queries either: selected to 0 at the input and at the output
        # (the mask stays a broadcast key padding mask: no (b, 1, i, j) tensor for the kernel)
        rows_ok = self_pad if rows_ok is None else rows_ok & self_pad
    return mask, bias, j, rows_ok, keys_ok


def all_keys(attn: AttentionModule, k: Tensor, v: Tensor, user_mask, j_user: int, self_pad: Tensor | None, causal: bool,
             added) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """The keys and values attention reads, from the call's ``k, v (b, h_kv, j_user, d)`` (cached ones first):
    keys that only padded queries (``self_pad (b, i)`` False) see guarded (no gradient), then ``[sink?, memory,
    added, keys]``. ``user_mask``: the call's mask over the ``j_user`` keys. Returns ``(k, v, (k_seq, v_seq))``,
    the last pair without the extra keys (what a cache keeps)."""
    if self_pad is not None:  # keys that only padded queries see are masked keys too: guard their gradients
        b, i = self_pad.shape
        seen = as_attention_mask(user_mask, b, attn.heads, i, j_user) & self_pad[:, None, :, None]  # (b, 1, i, j)
        if causal:
            seen = seen & causal_mask(i, j_user, device=k.device)
        key_seen = seen.any(dim=-2, keepdim=True).any(dim=1, keepdim=True).transpose(-1, -2)  # (b, 1, j, 1)
        k, v = _grad_select(key_seen, k), _grad_select(key_seen, v)
    kv_out = (k, v)  # for the cache: without the memory keys
    ext = attn.extra_keys
    if ext:  # a sample whose queries are all padding sends its memory keys no gradient (the kernel's
        # backward there is not trusted)
        k, v = prepend_extra(attn, k, v, None if self_pad is None else self_pad.any(dim=1))
    if added is not None:
        k, v = insert_added(attn, k, v, added, ext)
    return k, v, kv_out


def extend(attn: AttentionModule, mask, bias, b: int, i: int, j: int, x: Tensor, real_rows: Tensor | None = None):
    """The mask and bias over ``[sink?, memory keys, keys]``: the extra keys visible to every query,
    at bias 0 (the sink at its learned logit). ``real_rows (b|1, i)``: with a sink and no memory keys,
    the rows that see a real key; the others do not see the sink either (dead rows: exactly 0, their
    gradients too, whatever a kernel does with them)."""
    ext = attn.extra_keys
    if isinstance(mask, PreparedMask):
        mask = mask.combined
    if mask is None and real_rows is not None:
        mask = torch.ones(1, 1, 1, j, dtype=torch.bool, device=x.device)
    if mask is not None:
        m = as_attention_mask(mask, b, attn.heads, i, j)  # (b|1, h|1, i|1, j)
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        front = m.new_ones(*m.shape[:-1], ext)
        if real_rows is not None:
            front = real_rows[:, None, :, None]  # (b|1, 1, i, 1)
            lead = torch.broadcast_shapes(m.shape[:-1], front.shape[:-1])
            m, front = m.expand(*lead, j), front.expand(*lead, 1)
        mask = torch.cat((front, m), dim=-1)
    if bias is not None or attn.head_attn_sink is not None:
        if bias is None:
            bias = x.new_zeros(1, 1, 1, j)
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).to(x.dtype)  # (b|1, h|1, i|1, j)
        front = bias.new_zeros(*bias.shape[:-1], ext)
        if attn.head_attn_sink is not None:  # the sink's logit, per head
            bias = bias.expand(bias.shape[0], attn.heads, *bias.shape[2:])
            sink = attn.head_attn_sink.to(bias.dtype)[None, :, None, None].expand(*bias.shape[:-1], 1)
            front = torch.cat((sink, bias.new_zeros(*bias.shape[:-1], ext - 1)), dim=-1)
        bias = torch.cat((front, bias), dim=-1)
    return mask, bias


def prepend_extra(attn: AttentionModule, k: Tensor, v: Tensor, live: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``[sink?, memory, keys]``: the sink key and value are 0 (its logit comes from the bias).
    ``live (b,)``: samples with a live query; the others' memory keys get no gradient."""
    b = k.shape[0]
    parts_k, parts_v = [], []
    if attn.head_attn_sink is not None:
        parts_k.append(k.new_zeros(b, attn.kv_heads, 1, attn.dim_head))
        parts_v.append(v.new_zeros(b, attn.kv_heads, 1, v.shape[-1]))
    if attn.add_zero_kv:  # x-transformers' zero key and value (the key's logit is 0)
        parts_k.append(k.new_zeros(b, attn.kv_heads, 1, k.shape[-1]))
        parts_v.append(v.new_zeros(b, attn.kv_heads, 1, v.shape[-1]))
    if attn.num_mem_kv:
        mk, mv = attn.mem_k.to(k.dtype), attn.mem_v.to(v.dtype)
        if attn.k_norm is not None:  # (h_kv, M, d): the norm reads heads second to last
            mk = attn.norm_k(mk.transpose(0, 1), memory=True).transpose(0, 1)
        mk, mv = mk[None].expand(b, -1, -1, -1), mv[None].expand(b, -1, -1, -1)
        if live is not None:
            mk, mv = _grad_select(live[:, None, None, None], mk), _grad_select(live[:, None, None, None], mv)
        parts_k.append(mk)
        parts_v.append(mv)
    return torch.cat((*parts_k, k), dim=2), torch.cat((*parts_v, v), dim=2)


def check_added(attn: AttentionModule, added, added_mask, x: Tensor):
    """``additional_key_values`` checked: ``(k, v, mask or None)`` with masked keys/values selected to 0
    (so nothing a masked slot holds reaches a product, forward or backward), or ``None``."""
    if added is None:
        if added_mask is not None:
            raise ValueError("additional_key_value_mask was given without additional_key_values")
        return None
    if not (isinstance(added, (tuple, list)) and len(added) == 2
            and all(isinstance(t, Tensor) and t.dim() == 4 for t in added)):
        raise ValueError(f"additional_key_values must be a pair (k, v) of tensors (b, h_a, a, d), got "
                         f"{type(added).__name__}")
    k, v = added
    b = x.shape[0]
    if k.shape[0] != b or k.shape[3] != attn.dim_head or v.shape[:3] != k.shape[:3] or v.shape[3] != attn.dim_value \
            or k.shape[1] == 0 or attn.heads % k.shape[1]:
        raise ValueError(f"additional_key_values must be (k, v), each (b={b}, h_a, a, d={attn.dim_head}) (values "
                         f"d={attn.dim_value}) with h_a "
                         f"dividing heads={attn.heads}, got {tuple(k.shape)} and {tuple(v.shape)}")
    mixed_ok = torch.is_autocast_enabled(x.device.type)
    for t, label in ((k, "keys"), (v, "values")):
        if not t.is_floating_point() or (t.dtype != x.dtype and not mixed_ok) or t.device != x.device:
            raise ValueError(f"additional_key_values {label} are {t.dtype} on {t.device}, expected {x.dtype} on "
                             f"{x.device} (those of x)")
    if added_mask is not None:
        validate_mask(added_mask, "additional_key_value_mask", shape=(b, k.shape[2]), device=x.device)
        keep = added_mask[:, None, :, None]  # (b, 1, a, 1)
        k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    return k, v, added_mask


def insert_added(attn: AttentionModule, k: Tensor, v: Tensor, added: tuple, at: int) -> tuple[Tensor, Tensor]:
    """``[sink?, memory, added, keys]``: the added keys/values after the first ``at`` keys. With ``h_a`` heads
    other than ``kv_heads`` both are expanded to the query heads: ours as the module pairs them (tiled, ``n % h_kv``,
    or interleaved, ``n // g``), the added ones as x-transformers does (query head ``n`` uses added head
    ``n % h_a``)."""
    ak, av = added[0].to(k.dtype), added[1].to(v.dtype)
    h_a = ak.shape[1]
    if h_a != k.shape[1]:
        g = attn.heads // attn.kv_heads
        n = torch.arange(attn.heads, device=k.device)
        if attn.kv_head_order == "tiled":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
            idx = n % h_a
        else:  # our query head m is x-transformers' head (m % g) * h_kv + m // g
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            idx = ((n % g) * attn.kv_heads + n // g) % h_a
        ak, av = ak.index_select(1, idx), av.index_select(1, idx)
    return (torch.cat((k[:, :, :at], ak, k[:, :, at:]), dim=2),
            torch.cat((v[:, :, :at], av, v[:, :, at:]), dim=2))


def prepend_keys(mask, bias, added_mask: Tensor | None, b: int, h: int, i: int, j: int, a: int, device):
    """The mask and bias over ``[a added keys, j keys]``: ``added_mask (b, a)`` in front (``None``: all real),
    bias 0 there (every query sees the added keys, whatever the positions)."""
    if isinstance(mask, PreparedMask):
        mask = mask.combined
    if mask is not None or added_mask is not None:
        m = torch.ones(1, 1, 1, j, dtype=torch.bool, device=device) if mask is None else as_attention_mask(mask, b, h, i, j)
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        front = torch.ones(1, 1, 1, a, dtype=torch.bool, device=device) if added_mask is None \
            else added_mask[:, None, None, :]
        lead = torch.broadcast_shapes(m.shape[:-1], front.shape[:-1])
        mask = torch.cat((front.expand(*lead, a), m.expand(*lead, j)), dim=-1)  # (b|1, h|1, i|1, a + j)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(*bias.shape[:-1], j)
        bias = torch.cat((bias.new_zeros(*bias.shape[:-1], a), bias), dim=-1)
    return mask, bias


def query_padding(mask, pad: Tensor | None, own: bool, b: int, i: int, j: int) -> Tensor | None:
    """``(b, i)`` which positions of the queries' input ``x`` are real, in self-attention: what a ``(b, j)`` padding
    ``mask`` says of x's own (last ``i``) positions, when ``own`` (self-attention on keys of its own, inputs not
    selected by the stack already), and ``pad (b, i)`` (an ``attn_mask`` was folded into the mask); ``None``: all."""
    self_pad = None
    if own and isinstance(mask, Tensor):
        self_pad = self_padding(mask, b, i, j)
    if pad is not None:
        self_pad = pad if self_pad is None else self_pad & pad
    return self_pad


def self_padding(mask: Tensor, b: int, i: int, j: int) -> Tensor | None:
    """``(b, i)`` which positions of x are real, when ``mask`` is a key padding mask of self-attention
    (``(b, j)`` or ``(b, 1, 1, j)``; the last ``i`` keys are x's own positions); otherwise ``None``."""
    if mask.dtype != torch.bool or j < i:
        return None
    if mask.dim() == 2 and tuple(mask.shape) == (b, j):
        pad = mask
    elif mask.dim() == 4 and mask.shape[0] == b and mask.shape[1] == 1 and mask.shape[2] == 1 and mask.shape[3] == j:
        pad = mask[:, 0, 0]
    else:
        return None
    return pad[:, j - i:]


def alive(mask: Tensor | None, causal: bool, b: int, h: int, i: int, j: int, device,
          reach: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """Which queries ``(b|1, i)`` may attend to some key and which keys ``(b|1, j)`` some query may see
    (in any head); ``(None, None)`` when every query and key is live. ``reach``: where an additive bias
    is not ``-inf`` (broadcastable to ``(b, h, i, j)``)."""
    if j == 0:
        return torch.zeros(1, i, dtype=torch.bool, device=device), torch.zeros(1, 0, dtype=torch.bool, device=device)
    if isinstance(mask, PreparedMask):
        mask = mask.combined
    m = None if mask is None else as_attention_mask(mask, b, h, i, j)
    if m is not None and m.device != torch.device(device):
        raise ValueError(f"mask is on {m.device}, expected {device} (the device of the inputs)")
    if reach is not None:
        if reach.dim() > 4 or any(s not in (1, f) for s, f in zip(reach.shape[::-1], (j, i, h, b))):
            raise ValueError(f"bias must broadcast to (b, h, i, j) = ({b}, {h}, {i}, {j}), got {tuple(reach.shape)}")
        reach = reach.reshape((1,) * (4 - reach.dim()) + tuple(reach.shape))
    c = causal_mask(i, j, device=device) if causal and (i > j or ((m is not None or reach is not None) and i > 1)) else None
    combined = combine_masks(m, c, reach)  # (b|1, h|1, i|1, j|1)
    if combined is None:
        return None, None
    rows = combined.any(dim=-1).any(dim=1).expand(combined.shape[0], i)
    keys = combined.any(dim=-2).any(dim=1).expand(combined.shape[0], j)
    return rows, keys
