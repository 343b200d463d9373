"""A user's sequence module run beside self-attention (x-transformers' ``attn_hybrid_module``, Hymba style).

Shape legend: b batch, n positions, c model width, h heads, d head dim, a the fold (``hybrid_fold_axial_dim``),
m positions per fold.

The module (a ``torch.nn.GRU`` say) reads the attention's input ``x (b, n, c)`` and returns ``(b, n, h * d)`` (or
``(b, h, n, d)``), optionally with a recurrent state as its second output. Its output and the attention's are each
RMS-normalised per head and averaged (or mixed by a learned gate), before the attention's output projection.

Padding (mask False) never reaches a real position: the module's input at padded positions is selected to 0, and
each sample's real tokens are moved to the front, in order, before the module runs (so a left-padded sample reads
as the sample alone). A ``torch.nn`` ``GRU`` / ``LSTM`` / ``RNN`` then runs on the packed real tokens only
(``pack_padded_sequence``: each direction of a bidirectional one starts and stops at the sample's own ends; one
host sync for the lengths; under a ``torch.func`` transform, which cannot read them, its cells step through the
sequence instead, a padded step moving no state: the same results). Another module sees the real tokens followed
by zeros, so it must be causal (a decoder's is taken to be) or take the mask through ``hybrid_mask_kwarg``. Its output at padded positions is 0.
The module reads the padding mask only: an ``attn_mask`` (document masks, prefix masks) does not reach it.
"""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .modules import HeadRMSNorm
from .options import Options, self_only

__all__ = ["HybridBranch", "HybridCall", "FoldAxially"]


@dataclass
class HybridCall:
    """One forward's hybrid input from the stack: ``real (b, n)`` (``None``: every position is real), the
    recurrent ``state`` the cache holds (``None``: the initial state), whether a cache was asked for; the
    branch sets ``state_out`` (batch-first tensors, or a string saying why the state cannot be continued)."""

    real: Tensor | None = None
    state: object = None
    state_out: object = None


class FoldAxially(nn.Module):
    """x-transformers' ``FoldAxially``: with ``axial_dim`` a > 1, ``fn`` runs on ``x (b, n, c)`` folded as
    ``(b * a, ceil(n / a), c)`` (position ``t`` in fold ``t % a``), and its output unfolded back."""

    def __init__(self, axial_dim: int, fn: nn.Module):
        super().__init__()
        self.axial_dim = axial_dim
        self.fn = fn

    def fold(self, t: Tensor) -> Tensor:
        """``(b, n, ...)`` -> ``(b * a, m, ...)``, zero-padded at the end to ``m * a`` positions."""
        a = self.axial_dim
        if a == 1:
            return t
        b, n = t.shape[:2]
        m = math.ceil(n / a)
        if m * a != n:
            t = torch.cat((t, t.new_zeros(b, m * a - n, *t.shape[2:])), dim=1)
        return t.reshape(b, m, a, *t.shape[2:]).transpose(1, 2).reshape(b * a, m, *t.shape[2:])

    def unfold(self, t: Tensor, n: int) -> Tensor:
        a = self.axial_dim
        if a == 1:
            return t
        ba, m = t.shape[:2]
        return t.reshape(ba // a, a, m, *t.shape[2:]).transpose(1, 2).reshape(ba // a, m * a, *t.shape[2:])[:, :n]

    def forward(self, x: Tensor, *args, **kwargs):
        out = self.fn(self.fold(x), *args, **kwargs)
        if isinstance(out, Tensor):
            return self.unfold(out, x.shape[1])
        return (self.unfold(out[0], x.shape[1]), *out[1:])


class HybridBranch(nn.Module):
    """x-transformers' hybrid attention branch (``Attention(hybrid_module=..., hybrid_fold_axial_dim=...,
    hybrid_mask_kwarg=..., hybrid_learned_mix=...)``), self-attention only.

    Args:
        module: the sequence module (deep-copied, as x-transformers does), ``(b, n, c) -> (b, n, h * d)``. A
            ``torch.nn`` RNN must be ``batch_first=True`` (else it would mix samples); in a causal stack it must
            not be bidirectional (it would read future positions).
        dim, heads, dim_head: the attention's widths.
        causal: the attention is causal (a decoder).
        fold_axial_dim: x-transformers' ``hybrid_fold_axial_dim`` (default 1): the module runs on every a-th
            position (``FoldAxially``).
        mask_kwarg: the keyword under which a non-causal module takes the ``(b, n)`` mask (of the moved real
            tokens: True first), as x-transformers passes it; not for a ``torch.nn`` RNN (packed instead).
        learned_mix: mix by ``sigmoid(Linear(x))`` per position and head instead of the mean.

    KV cache: a unidirectional ``torch.nn`` ``GRU`` / ``LSTM`` / ``RNN`` with ``fold_axial_dim=1`` carries its state
    in the cache (a position whose mask is False does not advance it); any other module refuses a cache.
    Padded (non-packed) path only. The static decode step runs such a module too: its state is kept in the
    ``StaticKVCache``'s slots and written in place each step (``attention_step``: the module's own call on the
    one new position); ``StaticStep(compile=True)`` compiles it with dynamo's ``allow_rnn`` (its tracing of
    ``torch.nn`` RNNs, off by default).
    """

    def __init__(self, module: nn.Module, *, dim: int, heads: int, dim_head: int, causal: bool,
                 fold_axial_dim: int | None = None, mask_kwarg: str | None = None, learned_mix: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"attn_hybrid_module must be a torch.nn.Module, got {type(module).__name__}")
        fold = 1 if fold_axial_dim is None else fold_axial_dim
        if isinstance(fold, bool) or not isinstance(fold, int) or fold < 1:
            raise ValueError(f"attn_hybrid_fold_axial_dim must be a positive integer, got {fold_axial_dim!r}")
        self.rnn = isinstance(module, nn.RNNBase)
        if self.rnn:
            if not module.batch_first:
                raise ValueError("attn_hybrid_module: a torch.nn RNN must be built with batch_first=True (it reads "
                                 "x as (b, n, c); time-first it would mix the samples of a batch)")
            if module.bidirectional and causal:
                raise ValueError("attn_hybrid_module: a bidirectional RNN reads future positions; a causal stack "
                                 "(Decoder) needs a unidirectional one")
            if mask_kwarg is not None:
                raise ValueError("attn_hybrid_mask_kwarg: a torch.nn RNN takes no mask (safeformer runs it on the "
                                 "packed real tokens of each sample); leave it None")
            if getattr(module, "proj_size", 0):
                raise ValueError("attn_hybrid_module: an LSTM with proj_size is not supported")
        if mask_kwarg is not None and not isinstance(mask_kwarg, str):
            raise TypeError(f"attn_hybrid_mask_kwarg must be a keyword name (str), got {mask_kwarg!r}")
        self.heads, self.dim_head, self.causal = heads, dim_head, causal
        self.mask_kwarg = mask_kwarg
        self.hybrid_module = FoldAxially(fold, deepcopy(module))
        # x-transformers' MultiheadRMSNorm pair: F.normalize * sqrt(d) * (1 + gamma), gamma per head at 0
        self.hybrid_norms = nn.ModuleList([HeadRMSNorm(heads, dim_head, eps=1e-12, unit_offset=True) for _ in range(2)])
        self.hybrid_mix = nn.Linear(dim, heads, bias=False) if learned_mix else None

    @property
    def fold(self) -> int:
        return self.hybrid_module.axial_dim

    @property
    def can_cache(self) -> bool:
        """Whether the module's state can continue through a KV cache."""
        return self.rnn and self.fold == 1

    def cache_refusal(self) -> str:
        if not self.rnn:
            return ("attn_hybrid_module: only a torch.nn GRU / LSTM / RNN carries its state through the KV cache "
                    "(this module's state layout is unknown); decode with cache_kv=False")
        return ("attn_hybrid_fold_axial_dim > 1 folds the positions across samples of the module: its state cannot be "
                "continued by a KV cache; decode with cache_kv=False")

    # ------------------------------------------------------------------------------------------------

    def _state_in(self, state):
        """The cache's batch-first state -> the module's ``hx`` (RNN: ``(L * D, b, H)``; LSTM: a pair)."""
        if state is None:
            return None
        if isinstance(state, str):
            raise ValueError(f"this cache cannot continue the hybrid module: {state}")
        hs = tuple(s.transpose(0, 1).contiguous() for s in state)
        return hs if isinstance(self.hybrid_module.fn, nn.LSTM) else hs[0]

    @staticmethod
    def _state_out(hx) -> tuple:
        hs = hx if isinstance(hx, tuple) else (hx,)
        return tuple(s.transpose(0, 1) for s in hs)  # batch-first (b, L * D, H)

    def _run_rnn(self, xs: Tensor, real: Tensor | None, hx):
        """The RNN on ``xs (b, n, c)`` whose real tokens are a prefix of each sample (``real``); returns
        ``(out (b, n, H'), hx after each sample's last real token)``."""
        fold, rnn = self.hybrid_module, self.hybrid_module.fn
        n = xs.shape[1]
        if real is None:
            out, h = rnn(fold.fold(xs), hx)
            return fold.unfold(out, n), h
        xf, rf = fold.fold(xs), fold.fold(real)  # (b * a, m, c), (b * a, m)
        if torch._C._are_functorch_transforms_active():  # packing reads the lengths on the host: step instead
            out, h = _run_rnn_stepwise(rnn, xf, rf, hx)
            return fold.unfold(out, n), h
        lengths = rf.sum(dim=1)  # (b * a,)
        packed = pack_padded_sequence(xf, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
        out, h = rnn(packed, hx)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=xf.shape[1])
        empty = lengths == 0  # no real token: the state does not move (the clamped step read a zero input)
        if hx is None:
            keep = tuple(torch.where(empty[None, :, None], 0.0, s) for s in (h if isinstance(h, tuple) else (h,)))
        else:
            hs, h0 = (h, hx) if isinstance(h, tuple) else ((h,), (hx,))
            keep = tuple(torch.where(empty[None, :, None], s0, s) for s, s0 in zip(hs, h0))
        return fold.unfold(out, n), (keep if isinstance(h, tuple) else keep[0])

    def module_out(self, x: Tensor, real: Tensor | None, state) -> tuple[Tensor, object]:
        """The module's output ``(b, n, h, d)`` (0 at padded positions) and its state after the call."""
        b, n = x.shape[:2]
        if real is not None:  # each sample's real tokens first, in order (a stable sort), padding after as 0
            order = torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices  # (b, n)
            xs = torch.where(real[..., None], x, 0.0).gather(1, order[..., None].expand(-1, -1, x.shape[-1]))
            real_c = real.gather(1, order)  # a prefix of True per sample
        else:
            xs, real_c, order = x, None, None
        if self.rnn:
            if real_c is None and n % self.fold:  # the fold's own zero padding is not read either (packed)
                real_c = torch.ones(b, n, dtype=torch.bool, device=x.device)
            out, hx = self._run_rnn(xs, real_c, self._state_in(state))
            new_state = self._state_out(hx)
        else:
            if state is not None:
                raise ValueError(self.cache_refusal())
            kwargs = {}
            if real is not None and not self.causal:
                if self.mask_kwarg is None:
                    raise ValueError("attn_hybrid_module in a non-causal stack with a padding mask: it would read the "
                                     "padded positions' zeros after each sample's real tokens. Pass "
                                     "attn_hybrid_mask_kwarg (the keyword your module takes the (b, n) mask under), "
                                     "or use a torch.nn GRU / LSTM / RNN (run on the packed real tokens)")
                kwargs[self.mask_kwarg] = self.hybrid_module.fold(real_c)
            res = self.hybrid_module(xs, **kwargs)
            out = res if isinstance(res, Tensor) else res[0]
            new_state = None
        if out.dim() == 4 and out.shape[1] == self.heads:  # x-transformers' (b, h, n, d)
            out = out.transpose(1, 2)
        elif out.dim() == 3 and out.shape[-1] == self.heads * self.dim_head:
            out = out.unflatten(-1, (self.heads, self.dim_head))
        if out.shape[:2] != (b, n) or out.shape[2:] != (self.heads, self.dim_head):
            raise ValueError(f"attn_hybrid_module must return (b, n, heads * dim_head) = ({b}, {n}, "
                             f"{self.heads * self.dim_head}) or (b, heads, n, dim_head), got {tuple(out.shape)}")
        if order is not None:  # back to the positions (scatter = gather by the inverse permutation)
            inverse = order.argsort(dim=1)
            out = out.gather(1, inverse[:, :, None, None].expand(-1, -1, *out.shape[2:]))
            out = torch.where(real[:, :, None, None], out, 0.0)
        if not self.can_cache:
            new_state = self.cache_refusal()
        return out, new_state

    def forward(self, attn_out: Tensor, x: Tensor, call: HybridCall | None, pad: Tensor | None) -> Tensor:
        """``attn_out (b, n, h, d)`` mixed with the module's output on ``x (b, n, c)``. ``call``: the stack's
        input (``real`` positions, cached ``state``); ``pad (b, n)``: the attention's own padding of ``x`` (a
        standalone call)."""
        real = pad if call is None or call.real is None else call.real
        state = None if call is None else call.state
        hybrid_out, new_state = self.module_out(x, real, state)
        if call is not None:
            call.state_out = new_state
        a = self.hybrid_norms[0](attn_out)
        hy = self.hybrid_norms[1](hybrid_out.to(attn_out.dtype))
        if self.hybrid_mix is None:
            return 0.5 * (a + hy)
        xs = x if real is None else torch.where(real[..., None], x, 0.0)
        mix = torch.sigmoid(self.hybrid_mix(xs))[..., None]  # (b, n, h, 1)
        return torch.lerp(a, hy, mix.to(a.dtype))


def _cell(mode: str, x: Tensor, state: tuple, w_ih: Tensor, w_hh: Tensor, b_ih, b_hh) -> tuple:
    """One step of a ``torch.nn`` RNN cell (``mode`` as ``nn.RNNBase`` names it) written out, so that every
    ``torch.func`` transform has its rules: ``state`` ``(h,)`` or ``(h, c)`` -> the new one."""
    gi, gh = F.linear(x, w_ih, b_ih), F.linear(state[0], w_hh, b_hh)
    if mode == "GRU":
        (ir, iz, i_n), (hr, hz, hn) = gi.chunk(3, dim=-1), gh.chunk(3, dim=-1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * hn)
        return ((1 - z) * n + z * state[0],)
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, dim=-1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    return (torch.tanh(gi + gh) if mode == "RNN_TANH" else torch.relu(gi + gh),)


def _run_rnn_stepwise(rnn: nn.RNNBase, x: Tensor, real: Tensor, hx):
    """``rnn`` on ``x (B, m, c)`` one step at a time from its own weights, as on packed sequences: ``real (B, m)`` a
    prefix of True per row; a step at a padded position moves no state (each direction starts at its row's own
    end). No host read, so it runs under ``torch.func``. Returns ``(out (B, m, D * H), hx)`` like the module."""
    batch, m = real.shape
    dirs = 2 if rnn.bidirectional else 1
    lstm = rnn.mode == "LSTM"
    if hx is None:
        zero = x.new_zeros(rnn.num_layers * dirs, batch, rnn.hidden_size)
        hx = (zero, zero) if lstm else zero
    h0 = hx if lstm else (hx,)
    inp, finals = x, []
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w = [getattr(rnn, f"weight_ih{sfx}"), getattr(rnn, f"weight_hh{sfx}")]
            w += [getattr(rnn, f"bias_ih{sfx}"), getattr(rnn, f"bias_hh{sfx}")] if rnn.bias else [None, None]
            state = tuple(s[layer * dirs + d] for s in h0)
            steps = [None] * m
            for t in (range(m - 1, -1, -1) if d else range(m)):
                live = real[:, t, None]  # (B, 1)
                new = _cell(rnn.mode, inp[:, t], state, *w)
                state = tuple(torch.where(live, a, s) for a, s in zip(new, state))
                steps[t] = torch.where(live, state[0], 0.0)
            outs.append(torch.stack(steps, dim=1) if m else inp.new_zeros(batch, 0, rnn.hidden_size))
            finals.append(state)
        inp = torch.cat(outs, dim=-1)
        if rnn.dropout and rnn.training and layer < rnn.num_layers - 1:
            inp = F.dropout(inp, rnn.dropout, training=True)
    hs = tuple(torch.stack([f[k] for f in finals]) for k in range(len(h0)))
    return inp, (hs if lstm else hs[0])


@dataclass(frozen=True)
class HybridOptions(Options):
    """x-transformers' hybrid keywords (``HybridBranch`` documents them): a user's sequence module beside
    self-attention."""

    hybrid_module: nn.Module | None = self_only(None)
    hybrid_mask_kwarg: str | None = self_only(None)
    hybrid_fold_axial_dim: int | None = self_only(None)
    hybrid_learned_mix: bool = self_only(False)


def make_hybrid(o: HybridOptions, *, dim: int, heads: int, dim_head: int, causal: bool) -> HybridBranch | None:
    """``HybridBranch`` for ``o.hybrid_module``, or ``None`` without one (then the other options must stay unset)."""
    if o.hybrid_module is None:
        if o.hybrid_fold_axial_dim is not None or o.hybrid_mask_kwarg is not None or o.hybrid_learned_mix:
            raise ValueError("attn_hybrid_fold_axial_dim / attn_hybrid_mask_kwarg / attn_hybrid_learned_mix need "
                             "attn_hybrid_module")
        return None
    return HybridBranch(o.hybrid_module, dim=dim, heads=heads, dim_head=dim_head, causal=causal,
                        fold_axial_dim=o.hybrid_fold_axial_dim, mask_kwarg=o.hybrid_mask_kwarg,
                        learned_mix=o.hybrid_learned_mix)
