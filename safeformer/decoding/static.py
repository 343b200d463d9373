"""A static KV cache and a fixed-shape decode step: what generation runs after the prompt.

Shape legend: B samples (guidance branches times batch), h query heads, h_kv key/value heads, L the
cache's capacity (prefix + prompt + new positions), d head dim, c model width, j context length.

After the prompt (the prefill, an ordinary forward that returns a ``KVCache``), every step adds one
position per sample. The dynamic ``KVCache`` grows by concatenation each step and is checked again as
input each step; ``StaticKVCache`` is built once from it instead:

- one preallocated buffer per self-attention block, ``(B, h_kv, L, d)``, written in place at slot
  ``length`` (every sample writes the same slot: left-padded prompts leave padding slots, which
  ``valid (B, L)`` marks, and per-sample positions ``count (B,)`` count real tokens only, so padding
  never shifts a position and is never re-selected);
- every slot the step may read is finite: the prompt's masked slots are selected to 0 once, when the
  cache is built (whatever a cache handed in held there), and slots not yet written are 0;
- the context's keys/values (cross-attention) are taken from the prefill, their masked keys selected to 0
  once, and the kernel mask built once (a sample with no context key sees key 0 and its output is
  selected to exactly 0 after the kernel: a dropped condition adds exactly nothing, as in ``attend``);
- rotary angles are a table over positions ``[0, L)``, built once.

``StaticDecoder.step`` runs one position through the net's own parts (the embedding, each block's norm,
``Attention``'s projection and output seams, the feed-forward, the head), so it computes what the net's
``forward`` with a cache computes, without re-checking or re-selecting anything: nothing in it reads a
value back to the host. Eager, it attends over the written slots only (a view of the buffers); compiled
(``compile=True``), over all ``L`` slots with the validity mask, so every step has the same shapes and
``torch.compile(fullgraph=True)`` builds one graph (on a GPU, CUDA graphs with ``mode="reduce-overhead"``).

``static_reason(net)`` says why a net cannot use the static step (the engine then uses the dynamic
cache, which runs every option): attention with memory keys, a learned sink or softclamped logits (they
run the explicit path), and forward hooks on its modules (FSDP2's all-gathers, a user's probes: the step
calls the modules' parts, not their ``forward``, so hooks would not run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attend import from_kernel_heads, to_kernel_heads
from ..core.cache import KVCache
from ..nn.block import apply_norm
from ..nn.modules import FeedForward, LayerNorm

__all__ = ["StaticKVCache", "StaticDecoder", "static_reason", "compile_options", "capacity_bucket"]

# the module (the package's ``attend`` name is the function): its ``_kernel`` is the fused kernel in use,
# which tests replace with one that misbehaves on purpose
from ..core import attend as _attend_module  # noqa: E402


def static_reason(net) -> str | None:
    """Why ``net`` cannot decode with the static step (``None`` when it can)."""
    from ..stack.wrappers import ContinuousTransformerWrapper, TransformerWrapper

    if not isinstance(net, (TransformerWrapper, ContinuousTransformerWrapper)):
        return f"{type(net).__name__} is not a TransformerWrapper or ContinuousTransformerWrapper"
    stack = net.attn_layers
    custom = [name for name, on in (("a custom token_emb", getattr(net, "custom_token_emb", False)),
                                    ("a custom to_logits", getattr(net, "custom_to_logits", False)),
                                    ("recycling", getattr(net, "recycling", False)),
                                    ("a mixture of softmaxes", getattr(net, "to_mixture", None) is not None),
                                    ("squeeze_out_last_dim", getattr(net, "squeeze_out_last_dim", False)),
                                    ("a probabilistic head", getattr(net, "probabilistic", False)),
                                    ("ff_deep_embed", getattr(net, "ff_deep_embed", None) is not None),
                                    ("looped=True (the stack runs several times, with early exit)",
                                     getattr(net, "looped", False)),
                                    ("emb_dim != dim (a projection of the embeddings)",
                                     getattr(net, "project_emb", None) is not None),
                                    ("num_output_heads > 1", getattr(net, "num_output_heads", 1) > 1),
                                    ("sigsoftmax_logits", getattr(net, "sigsoftmax_logits", False)),
                                    ("memory_tokens_interspersed_every",
                                     getattr(net, "memory_tokens_interspersed_every", None) is not None)) if on]
    if custom:  # the step embeds and reads out with the wrapper's plain parts only
        return f"the wrapper has {', '.join(custom)} (run as the wrapper's forward runs them)"
    width = getattr(net.to_logits, "out_features", None) if isinstance(net, TransformerWrapper) else None
    if width is not None and width > net.num_tokens:
        # a sampled id may be no token: the dynamic path names it (a host read per step), the step would not
        return "logits_dim is larger than num_tokens (a sampled id may be outside the vocabulary)"
    if not stack.causal:
        return "the stack is not causal"
    if getattr(stack, "static_step_reason", None):
        return stack.static_step_reason
    if getattr(stack, "add_value_residual", False):
        return "add_value_residual passes the first attention's values to the others (the step does not)"
    for blk in stack.layers:
        if blk.kind != "ff" and (blk.mixer.extra_keys or blk.mixer.explicit):
            return ("attention with memory keys, a learned sink, softclamped logits or another scoring option (cog, "
                    "sigmoid, gumbel, laser, CoPE, inverted) runs the explicit path")
        if blk.kind != "ff" and blk.mixer.max_attend_past is not None:
            return "attn_max_attend_past masks keys by their distance (the step's masks do not)"
        if blk.kind != "ff" and (blk.mixer.rel_proj_pos_bias is not None or blk.mixer.rope_subheads
                                 or blk.mixer.l2_distance or blk.mixer.rotate_num_heads != blk.mixer.heads):
            return ("attn_use_rel_proj_pos_bias, attn_latent_rope_subheads, rotate_num_heads and attn_l2_distance run "
                    "on the dynamic path")
        if getattr(stack, "polar_pos_emb", None) is not None:
            return "polar_pos_emb (PoPE) runs on the dynamic path"
        if getattr(stack, "rel_pos", None) is not None:
            return "rel_pos_bias / dynamic_pos_bias (a relative position bias module) runs on the dynamic path"
        if getattr(stack.rotary, "use_xpos", False):
            return "rotary_xpos centers its scales on each call's positions (no KV cache)"
        if blk.kind != "ff" and getattr(blk.mixer, "hybrid", None) is not None:
            return "attn_hybrid_module runs a sequence module beside attention (the step calls attention's parts only)"
        if blk.kind != "ff" and blk.mixer.orthog:
            return "attn_orthog_projected_values projects over the whole sequence (no KV cache)"
        if blk.kind != "ff" and blk.mixer.to_forget_gates is not None:
            return "attn_data_dependent_alibi sums forget gates over the whole sequence (no KV cache)"
    from torch.nn.modules import module as _module

    for m in net.modules():  # a module may say why the step cannot run it (``static_step_refusal``)
        refusal = getattr(m, "static_step_refusal", None)
        if isinstance(refusal, str):
            return refusal
    if _module._global_forward_hooks or _module._global_forward_pre_hooks or any(
            m._forward_hooks or m._forward_pre_hooks for m in net.modules()):
        # the step calls the modules' parts, not their forward: hooks (FSDP2's all-gathers, a user's probes)
        # would not run, so such a net decodes on the dynamic path, which calls every module
        return "forward hooks are registered on its modules (they run only on module calls)"
    return None


@dataclass
class StaticKVCache:
    """Preallocated keys/values of every self-attention block, written in place, plus what every step shares.

    Attributes:
        keys, values: per self-attention block, ``(B, h_kv, L, d)``; slots ``>= length`` are 0.
        valid: ``(B, L)`` which slots hold a real position (padding and unwritten slots are False).
        positions: ``(B, L)`` the position of each slot's token (for ALiBi).
        count: ``(B,)`` the next position of each sample (real rows so far).
        lead: ``(B,)`` real rows before the tokens (absolute positions start after them).
        cross: per cross-attention block, the context's keys/values ``(B, h_kv, j, d)`` (masked keys 0);
            ``None`` without a context.
        cross_mask: ``(B, 1, 1, j)`` the kernel's mask (a sample with no key sees key 0), or ``None``.
        cross_live: ``(B, 1, 1)`` samples that see some context key, or ``None`` (all do).
        condition: ``(B, K)`` the adaptive condition, or ``None``.
        length: slots written so far (a host integer: every sample writes the same slot).
        padded: whether any slot before ``length`` is padding (the eager step then passes ``valid``).
    """

    keys: list[Tensor]
    values: list[Tensor]
    valid: Tensor
    positions: Tensor
    count: Tensor
    lead: Tensor
    cross: list[tuple[Tensor, Tensor]] | None
    cross_mask: Tensor | None
    cross_live: Tensor | None
    condition: Tensor | None
    length: int
    padded: bool

    @property
    def capacity(self) -> int:
        return int(self.valid.shape[1])

    @classmethod
    def from_cache(cls, cache: KVCache, capacity: int, x: Tensor, n_self: int, n_cross: int) -> StaticKVCache:
        """The static form of ``cache`` (checked as input, like any cache) with room for ``capacity`` slots.

        Args:
            cache: a ``KVCache`` from ``forward(..., return_cache=True)``.
            capacity: L, at least ``cache.length``.
            x: a tensor with the batch, dtype and device of the stack's hidden states (checks only).
            n_self, n_cross: the stack's self- and cross-attention blocks.
        """
        KVCache.check(cache, x, n_self, n_cross)
        p = cache.length
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < p:
            raise ValueError(f"capacity must be an integer >= the cache's length {p}, got {capacity!r}")
        b, device = cache.batch_size, cache.count.device
        valid = torch.zeros(b, capacity, dtype=torch.bool, device=device)
        valid[:, :p] = True if cache.mask is None else cache.mask
        keys, values = [], []
        for k, v in cache.self_kv:
            kb = k.new_zeros(*k.shape[:2], capacity, k.shape[3])
            vb = v.new_zeros(*v.shape[:2], capacity, v.shape[3])
            if cache.mask is None:
                kb[:, :, :p], vb[:, :, :p] = k, v
            else:  # masked slots selected to 0 once: the steps read them as plain zeros
                keep = cache.mask[:, None, :, None]
                kb[:, :, :p], vb[:, :, :p] = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
            keys.append(kb)
            values.append(vb)
        positions = torch.zeros(b, capacity, dtype=torch.long, device=device)
        positions[:, :p] = cache.positions.to(torch.long)
        cross = cross_mask = cross_live = None
        if cache.cross_kv is not None:
            cm = cache.context_mask
            if cm is None:
                cross = [(k, v) for k, v in cache.cross_kv]
            else:
                keep = cm[:, None, :, None]
                cross = [(torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)) for k, v in cache.cross_kv]
                live = cm.any(dim=1)  # (B,)
                first = torch.zeros_like(cm)
                if cm.shape[1]:
                    first[:, 0] = True
                cross_mask = (cm | (~live[:, None] & first))[:, None, None, :]  # a dead row sees key 0
                cross_live = live[:, None, None]
        lead = cache.lead if cache.lead is not None else torch.zeros(b, dtype=torch.long, device=device)
        return cls(keys, values, valid, positions, cache.count.clone(), lead, cross, cross_mask, cross_live,
                   cache.condition, p, cache.mask is not None)


def compile_options(device, mode: str | None = None) -> dict:
    """How the step is compiled on ``device``: the keywords for ``torch.compile`` besides ``fullgraph``.

    A GPU: ``mode="reduce-overhead"`` (CUDA graphs: the fixed-shape step is recorded once and replayed,
    no launch per kernel). A CPU: inductor's C++ wrapper (``cpp_wrapper``), which calls the generated
    kernels from C++ rather than from Python (measured here: a 4-layer dim-256 step 1.0 ms eager, 0.77 ms
    compiled with the Python wrapper, 0.54 ms with the C++ one). ``mode`` given: that mode, as asked.
    """
    if mode is not None:
        return {"mode": mode}
    if torch.device(device).type == "cuda":
        return {"mode": "reduce-overhead"}
    return {"options": {"cpp_wrapper": True}}


def capacity_bucket(needed: int, bucket: int = 64) -> int:
    """The compiled step's capacity for ``needed`` slots: rounded up to a multiple of ``bucket``, so that
    generations of nearby lengths share one compiled graph (its shapes include the capacity)."""
    return -(-needed // bucket) * bucket


def _rotary_tables(stack, capacity: int, dtype: torch.dtype, device, compiled: bool = False):
    """Rotary at every position ``[0, capacity]``, one angle per pair of features (features past the rotary
    width: angle 0, passed through).

    Eager: ``cis (capacity + 1, d / 2)``, unit complex numbers ``cos + i sin`` (complex64; complex128 for a
    float64 model): ``_rotate`` multiplies the pairs by them, one op. ``compiled``: ``(cos, sin, swap)`` real
    tables ``(capacity + 1, d)`` and a pair swap, ``t * cos + t[..., swap] * sin`` (inductor fuses it; it
    generates no complex code). Both give ``apply_rotary``'s bits (tested)."""
    d = stack.layers[0].mixer.dim_head if stack.layers[0].kind != "ff" else stack.layers[1].mixer.dim_head
    positions = torch.arange(capacity + 1, device=device)[None]
    angles = stack.rotary.angles(positions, dtype=dtype)[0, 0]  # (L + 1, d_rot), pairs share an angle
    if not compiled:
        half = angles[:, 0::2]  # (L + 1, d_rot / 2)
        cis = torch.ones(capacity + 1, d // 2, device=device,
                         dtype=torch.complex128 if half.dtype == torch.float64 else torch.complex64)
        cis[:, : half.shape[1]] = torch.complex(half.cos(), half.sin())
        return cis
    rot = angles.shape[-1]
    cos = torch.ones(capacity + 1, d, dtype=angles.dtype, device=device)
    sin = torch.zeros(capacity + 1, d, dtype=angles.dtype, device=device)
    cos[:, :rot] = angles.cos()
    sign = torch.tensor([-1.0, 1.0], dtype=angles.dtype, device=device).repeat(rot // 2)
    sin[:, :rot] = angles.sin() * sign
    swap = torch.arange(d, device=device).view(-1, 2).flip(-1).flatten()
    return cos, sin, swap


def _rotate(t: Tensor, rot) -> Tensor:
    """``apply_rotary`` at each sample's position, through ``_rotary_tables`` taken at the positions: the pairs
    ``(x1, x2)`` of ``t (..., d)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)``, each a product then a sum as
    ``apply_rotary`` computes them. ``rot``: ``cis (B, 1, 1, d / 2)`` (the pairs as complex numbers times it), or
    ``(cos, sin, swap)`` (the compiled step). Computed in the tables' real dtype, then cast back."""
    if isinstance(rot, tuple):
        cos, sin, swap = rot
        tf = t.to(cos.dtype)
        return (tf * cos + tf.index_select(-1, swap) * sin).to(t.dtype)
    tf = t.to(torch.float64 if rot.dtype == torch.complex128 else torch.float32).unflatten(-1, (-1, 2))
    if tf.stride(-1) != 1 or tf.storage_offset() % 2 or any(st % 2 for st in tf.stride()[:-1]):
        tf = tf.contiguous()  # a complex view needs whole pairs in memory
    return torch.view_as_real(torch.view_as_complex(tf) * rot).flatten(-2).to(t.dtype)


@dataclass(frozen=True)
class _FusedQKV:
    """A self-attention block's q/k/v projections as one product: the three weights (and biases) concatenated
    once per decoder, ``F.linear(h, weight, bias)`` split in ``sizes`` (``h d``, ``h_kv d``, ``h_kv d``). Each output
    feature is the same dot product as in ``to_q`` / ``to_k`` / ``to_v``, so this is ``Attention._project_q`` /
    ``_project_kv`` (without a ``keep``) in one call instead of three (the tests check it bit for bit)."""

    weight: Tensor
    bias: Tensor | None
    sizes: tuple[int, int, int]
    rotate_together: bool  # no q/k norm between the projection and the rotation: q and k rotate as one tensor


def _fused_qkv(mixer) -> _FusedQKV | None:
    """The fused projection of ``mixer`` (an ``Attention``), or ``None`` where its projections are not three plain
    ``nn.Linear`` of the same input (latent q/kv, rotary sub-heads, wrapped projections): the step then calls
    ``_project_q`` / ``_project_kv``."""
    lins = (mixer.to_q, mixer.to_k, mixer.to_v)
    if (mixer.to_latent_q is not None or mixer.to_latent_kv is not None or mixer.rope_subheads
            or any(type(lin) is not nn.Linear for lin in lins)):
        return None
    biases = [lin.bias for lin in lins]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in lins])
        bias = None if biases[0] is None else torch.cat(biases)
    sizes = tuple(int(lin.out_features) for lin in lins)
    return _FusedQKV(weight, bias, sizes, not mixer.qk_normed)


def _plain_q(mixer) -> bool:
    """Whether ``mixer._project_q`` (no ``keep``) is ``to_q`` (a plain ``nn.Linear``) split in heads, then q-normed."""
    return mixer.to_latent_q is None and type(mixer.to_q) is nn.Linear


class _BlockPlan(NamedTuple):
    """How the step runs one block: its fused q/k/v projection (self-attention), whether its query projection
    (cross-attention), output projection and feed-forward are plain (called as functions), and whether the
    branch needs ``Block.finish`` (a gate, a scale, a sandwich norm)."""

    fused: _FusedQKV | None
    plain_q: bool
    plain_out: bool
    plain_ff: tuple | None  # (proj_in, act, proj_out) of a plain feed-forward, read once per decoder
    finish: bool
    norm: tuple | None  # a float32 LayerNorm's (weight, bias, eps, shape), its effective gain computed once


def _plain_output(mixer) -> bool:
    """Whether ``mixer._output`` (no ``keep``, no ``rows_ok``, no ``values``) is only ``to_out`` of the flattened
    heads: no head, value or output gate, a plain ``nn.Linear``."""
    return (mixer.to_v_head_gate is None and mixer.to_v_gate is None and mixer.to_output_gate is None
            and mixer.head_scale_params is None and (mixer.sublayer_dropout is None or not mixer.training)
            and type(mixer.to_out) is nn.Linear)


def _plain_ff(mixer) -> bool:
    """Whether ``mixer`` is a ``FeedForward`` computing ``proj_out(act(proj_in(x)))`` with a GELU or SiLU (no gate,
    no soft clamp, its dropout idle: generation runs in eval mode), so the step calls the three functions."""
    return (type(mixer) is FeedForward and not mixer.glu and mixer.softclamp_value is None
            and mixer.solu_norm is None and mixer.post_act_norm is None
            and (mixer.sublayer_dropout is None or not mixer.training)
            and type(mixer.act) in (nn.GELU, nn.SiLU) and type(mixer.proj_in) is nn.Linear
            and type(mixer.proj_out) is nn.Linear and (not mixer.training or mixer.dropout.p == 0))


def _layer_norm_plan(norm, dtype: torch.dtype) -> tuple | None:
    """A float32 ``LayerNorm``'s ``(weight, bias, eps, shape)`` for ``F.layer_norm``, its gain (``gamma`` plus the
    unit offset) computed once per decoder (the weights do not change while it decodes); else ``None``."""
    if type(norm) is not LayerNorm or dtype != torch.float32:
        return None
    with torch.no_grad():
        return norm.weight.detach().clone(), None if norm.bias is None else norm.bias.detach(), norm.eps, \
            norm.normalized_shape


def _norm(norm, x: Tensor, cond: Tensor | None, plan: tuple | None = None) -> Tensor:
    """``apply_norm``; a float32 ``LayerNorm`` straight to ``F.layer_norm`` (what its float32 promotion computes)."""
    if plan is not None and x.dtype == torch.float32:
        weight, bias, eps, shape = plan
        return F.layer_norm(x, shape, weight, bias, eps)
    if type(norm) is LayerNorm and x.dtype == torch.float32:
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return apply_norm(norm, x, cond)


class StaticDecoder:
    """One position per sample per call, on a ``StaticKVCache``: ``step(new) -> out (B, ...)``.

    Args:
        net: a ``TransformerWrapper`` (``new``: token ids ``(B,)``) or ``ContinuousTransformerWrapper``
            (``new``: vectors ``(B, dim_in)``) around a causal stack (see ``static_reason``).
        cache: the prefill's ``KVCache``.
        capacity: slots for the prefill plus every new position.
        compile: compile the step (``torch.compile(fullgraph=True)``); every step then attends over all
            ``capacity`` slots with the validity mask (fixed shapes, one graph).
        fast: where a block's parts are plain (``_fused_qkv``, ``_plain_output``, ``_plain_ff``), run them as
            functions on fused weights instead of through the modules' seams: the same numbers, fewer calls
            per step (``False``: always the seams; the tests compare the two bit for bit).
    """

    def __init__(self, net, cache: KVCache, capacity: int, *, compile: bool = False, compile_mode: str | None = None,
                 fast: bool = True):
        reason = static_reason(net)
        if reason is not None:
            raise ValueError(f"the static decode step cannot run this net: {reason}")
        from ..stack.wrappers import TransformerWrapper

        self.net, self.stack = net, net.attn_layers
        self.tokens = isinstance(net, TransformerWrapper)
        stack = self.stack
        ref = stack.null_condition if stack.null_condition is not None else next(net.parameters())
        probe = torch.empty(cache.batch_size, 0, stack.dim, dtype=ref.dtype, device=cache.count.device)
        kinds = stack.layer_kinds
        self.cache = StaticKVCache.from_cache(cache, capacity, probe, kinds.count("self"), kinds.count("cross"))
        self.dtype = ref.dtype
        self.rotary_tables = None
        if stack.rotary is not None:  # cos/sin of every position the generation may reach
            self.rotary_tables = _rotary_tables(stack, int(capacity), self.dtype, probe.device, compiled=compile)
        # per block: which of its parts the step calls as functions on (fused) weights (see _BlockPlan)
        self.plan = [_BlockPlan(_fused_qkv(blk.mixer) if blk.kind == "self" and fast else None,
                                blk.kind == "cross" and fast and _plain_q(blk.mixer),
                                blk.kind != "ff" and fast and _plain_output(blk.mixer),
                                (blk.mixer.proj_in, blk.mixer.act, blk.mixer.proj_out)
                                if blk.kind == "ff" and fast and _plain_ff(blk.mixer) else None,
                                blk._parts[2] is not None or blk.scale != 1.0 or blk._post_norm is not None,
                                _layer_norm_plan(blk.norm, self.dtype) if fast else None)
                     for blk in stack.layers]
        self.final_norm_plan = _layer_norm_plan(stack.final_norm, self.dtype) if fast else None
        self.compiled = compile
        self._step = self._forward
        if compile:
            self.slot = torch.zeros((), dtype=torch.long, device=probe.device)
            self._step = torch.compile(self._forward_full, fullgraph=True, dynamic=False,
                                       **compile_options(probe.device, compile_mode))

    def step(self, new: Tensor) -> Tensor:
        """The output ``(B, ...)`` (logits, or values) for the position after the cache, ``new`` being written
        at the next slot. Raises ``ValueError`` when the cache is full."""
        c = self.cache
        if c.length >= c.capacity:
            raise ValueError(f"the static cache is full ({c.capacity} slots)")
        if self.compiled:
            self.slot.fill_(c.length)
            out = self._step(new, self.slot)
        else:
            out = self._step(new, c.length)
        c.length += 1
        return out

    def select(self, index: Tensor) -> None:
        """Keep (repeat, reorder) the samples ``index (B',)`` (beam search). When the batch keeps its size,
        keys and values are gathered into a second set of buffers allocated once (then the two swap), so
        a reorder per step allocates nothing."""
        c = self.cache
        sel = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        same = int(index.shape[0]) == c.valid.shape[0]
        spare = getattr(self, "_spare", None) if same else None
        if same and spare is None:
            spare = ([torch.empty_like(k) for k in c.keys], [torch.empty_like(v) for v in c.values])
        if spare is not None:
            for src, dst in ((c.keys, spare[0]), (c.values, spare[1])):
                for a, b in zip(src, dst):
                    torch.index_select(a, 0, index, out=b)
            self._spare = (c.keys, c.values)
            c.keys, c.values = spare
        else:
            c.keys, c.values = [sel(k) for k in c.keys], [sel(v) for v in c.values]
            self._spare = None
        c.valid, c.positions, c.count, c.lead = sel(c.valid), sel(c.positions), sel(c.count), sel(c.lead)
        if c.cross is not None:
            c.cross = [(sel(k), sel(v)) for k, v in c.cross]
        c.cross_mask, c.cross_live, c.condition = sel(c.cross_mask), sel(c.cross_live), sel(c.condition)

    # ------------------------------------------------------------------------------------------------

    def _embed(self, new: Tensor) -> Tensor:
        net, c = self.net, self.cache
        if self.tokens:
            x = net.token_emb(new)[:, None]  # (B, 1, c)
            if net.l2norm_embed:
                from ..nn.modules import l2norm

                x = l2norm(x)
        else:
            x = net.project_in(new[:, None].to(self.dtype))
        if net.pos_emb is not None:
            x = x + net.pos_emb.embed_positions((c.count - c.lead).clamp(min=0)[:, None]).to(x.dtype)
        if getattr(net, "post_emb_norm", None) is not None:
            x = net.post_emb_norm(x)
        return x

    def _head(self, h: Tensor) -> Tensor:
        return self.net._head(h) if self.tokens else self.net.project_out(h)

    def _forward(self, new: Tensor, slot, full: bool = False) -> Tensor:
        """One step: ``slot`` is a host integer (eager: attend over slots ``[0, slot]``) or a 0-d tensor
        (``full``: attend over every slot with the mask, fixed shapes)."""
        c, stack = self.cache, self.stack
        kernel = _attend_module._kernel
        x = self._embed(new)
        cond = c.condition
        self_mask, n_keys, rot = self._step_inputs(slot, full)
        i_self = i_cross = 0
        for blk, plan in zip(stack.layers, self.plan):
            norm, mixer, gate = blk._parts
            h = _norm(norm, x, cond, plan.norm)
            if blk.kind == "self":
                out = self._self_attention(mixer, plan, h, rot, self_mask, i_self, slot, n_keys, full, kernel)
                i_self += 1
            elif blk.kind == "cross":
                if c.cross is None:
                    continue
                k, v = c.cross[i_cross]
                i_cross += 1
                if k.shape[2] == 0:  # a zero-length context: cross-attention adds exactly 0
                    continue
                out = self._cross_attention(mixer, plan, h, k, v, kernel)
            elif plan.plain_ff is not None:
                pi, act, po = plan.plain_ff
                out = F.linear(act(F.linear(h, pi.weight, pi.bias)), po.weight, po.bias)
            else:
                out = mixer(h)
            if plan.finish:
                out = blk.finish(out, cond)  # gate / layerscale, macaron's half step, sandwich norm
            x = x + out
        x = _norm(stack.final_norm, x, cond, self.final_norm_plan)
        c.count.add_(1)
        return self._head(x[:, 0])

    def _step_inputs(self, slot, full: bool):
        """The step's self-attention mask (an ALiBi bias in it), the number of key slots it reads, and the rotation
        at each sample's position (``None`` without rotary), the new slot marked valid."""
        c, stack = self.cache, self.stack
        if full:
            c.valid.index_fill_(1, slot[None], True)
            self_mask = c.valid[:, None, None, :]
            n_keys = c.capacity
        else:
            c.valid[:, slot] = True
            n_keys = slot + 1
            self_mask = c.valid[:, None, None, :n_keys] if c.padded else None
        rot = None
        if isinstance(self.rotary_tables, tuple):  # the compiled step's real tables at each sample's position
            cos, sin, swap = self.rotary_tables
            rot = (cos.index_select(0, c.count)[:, None, None, :], sin.index_select(0, c.count)[:, None, None, :], swap)
        elif self.rotary_tables is not None:  # cis (B, 1, 1, d / 2)
            rot = self.rotary_tables.index_select(0, c.count)[:, None, None, :]
        if stack.alibi_slopes is not None:
            if full:
                c.positions.index_copy_(1, slot[None], c.count[:, None])
            else:
                c.positions[:, slot] = c.count
            pos = c.positions[:, :n_keys]
            dist = (c.count[:, None] - pos).abs().to(torch.promote_types(self.dtype, torch.float32))
            bias = -stack.alibi_slopes.to(dist.dtype)[None, :, None, None] * dist[:, None, None, :]  # (B, h, 1, n)
            bias = bias.to(self.dtype)
            self_mask = bias if self_mask is None else bias.masked_fill(~self_mask, float("-inf"))
        return self_mask, n_keys, rot

    def _self_attention(self, mixer, plan: _BlockPlan, h: Tensor, rot, self_mask, i_self: int, slot, n_keys,
                        full: bool, kernel) -> Tensor:
        """A self-attention block's output for ``h (B, 1, c)``, its new key and value written at ``slot`` of its
        buffers (the ``i_self``-th)."""
        c = self.cache
        if plan.fused is not None:
            q, k, v = self._project_fused(mixer, plan.fused, h, rot)
        else:
            q = mixer._project_q(h).transpose(1, 2)  # (B, h, 1, d)
            k, v = mixer._project_kv(h)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, h_kv, 1, d)
            if rot is not None:
                q, k = _rotate(q, rot), _rotate(k, rot)
        kb, vb = c.keys[i_self], c.values[i_self]
        if full:
            kb.index_copy_(2, slot[None], k)
            vb.index_copy_(2, slot[None], v)
        else:
            kb.narrow(2, slot, 1).copy_(k)
            vb.narrow(2, slot, 1).copy_(v)
            kb, vb = kb.narrow(2, 0, n_keys), vb.narrow(2, 0, n_keys)
        q, mask_h, _ = to_kernel_heads(mixer, q, self_mask)  # x-transformers' tiled kv heads: interleaved
        out = from_kernel_heads(mixer, kernel(q, kb, vb, attn_mask=mask_h, enable_gqa=mixer.kv_heads != mixer.heads))
        if plan.plain_out:
            return F.linear(out.transpose(1, 2).flatten(-2), mixer.to_out.weight, mixer.to_out.bias)
        return mixer._output(out.transpose(1, 2), h)

    def _cross_attention(self, mixer, plan: _BlockPlan, h: Tensor, k: Tensor, v: Tensor, kernel) -> Tensor:
        """A cross-attention block's output for ``h (B, 1, c)`` over the cached context keys and values ``k, v``."""
        c = self.cache
        if plan.plain_q:
            q = F.linear(h, mixer.to_q.weight, mixer.to_q.bias).unflatten(-1, (mixer.heads, mixer.dim_head))
            q = mixer.norm_q(q).transpose(1, 2)
        else:
            q = mixer._project_q(h).transpose(1, 2)
        q, mask_h, _ = to_kernel_heads(mixer, q, c.cross_mask)
        out = from_kernel_heads(mixer, kernel(q, k, v, attn_mask=mask_h, enable_gqa=mixer.kv_heads != mixer.heads))
        if c.cross_live is not None:  # a sample with no context key: exactly 0 (after a bias too)
            out = torch.where(c.cross_live[..., None], out, 0.0)
        rows_ok = None if c.cross_live is None or mixer.out_bias is None else c.cross_live[:, :, 0]
        if plan.plain_out:
            out = F.linear(out.transpose(1, 2).flatten(-2), mixer.to_out.weight, mixer.to_out.bias)
            return out if rows_ok is None else torch.where(rows_ok[..., None], out, 0.0)
        return mixer._output(out.transpose(1, 2), h, None, rows_ok)

    @staticmethod
    def _project_fused(mixer, fused: _FusedQKV, h: Tensor, rot) -> tuple[Tensor, Tensor, Tensor]:
        """``q (B, h, 1, d)``, ``k, v (B, h_kv, 1, d)`` of ``h (B, 1, c)`` through the fused projection, q/k/v-normed
        and rotated as ``_project_q`` / ``_project_kv`` and ``_rotate`` do (q and k rotated as one tensor when no
        norm sits between the projection and the rotation)."""
        heads, kv_heads, d = mixer.heads, mixer.kv_heads, mixer.dim_head
        nq, nk, _ = fused.sizes
        qkv = F.linear(h, fused.weight, fused.bias)  # (B, 1, h d + 2 h_kv d)
        v = qkv[..., nq + nk:].unflatten(-1, (kv_heads, d))
        if mixer.v_norm is not None:
            v = mixer.v_norm(v)
        if rot is not None and fused.rotate_together:
            qk = _rotate(qkv[..., :nq + nk].unflatten(-1, (heads + kv_heads, d)), rot)  # (B, 1, h + h_kv, d)
            return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)
        q = qkv[..., :nq].unflatten(-1, (heads, d))
        k = qkv[..., nq:nq + nk].unflatten(-1, (kv_heads, d))
        q, k = mixer.norm_q(q), mixer.norm_k(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if rot is not None:
            q, k = _rotate(q, rot), _rotate(k, rot)
        return q, k, v.transpose(1, 2)

    def _forward_full(self, new: Tensor, slot: Tensor) -> Tensor:
        return self._forward(new, slot, full=True)
