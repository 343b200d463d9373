"""The static KV cache: preallocated per-block slots written in place, one position per sample per step.

Shape legend: B samples (guidance branches times batch), L the cache's capacity (prefix + prompt + new
positions), K the adaptive condition's width.

After the prompt (the prefill, an ordinary forward that returns a ``KVCache``), every decode step adds one
position per sample. The dynamic ``KVCache`` grows by concatenation and is checked again as input each step; a
``StaticKVCache`` is built once from it (``TransformerWrapper.static_cache``) and then passed to the model's
own forward, ``net(new, cache=static)``, one position per call:

- each attention block keeps its slots (``layers``; what they hold is the attention part's business,
  ``nn/attention_step.py``): a self-attention's keys and values ``(B, h_kv, L, d)`` written in place at slot
  ``length`` (every sample writes the same slot: left-padded prompts leave padding slots, which ``valid``
  marks, and per-sample positions ``count`` count real tokens only, so padding never shifts a position and is
  never read);
- every slot a step may read is finite: masked slots were selected to 0 when the cache was built, slots not yet
  written are 0;
- ``fixed``: every step attends over all ``L`` slots with the validity mask and takes its slot from the 0-d
  tensor ``slot``, so every step has the same shapes (``torch.compile(fullgraph=True)`` builds one graph; on a
  GPU, CUDA graphs); otherwise over the written slots only (a view of the buffers);
- ``bad_token``: a net whose logits are wider than its vocabulary (``logits_dim > num_tokens``) may sample an id
  that is no token. Its step embeds the id clamped into the vocabulary and records on the device the first id
  outside it (no host read per step); whoever runs the steps reads the record at its periodic host check
  (``check_tokens``: the ``ValueError`` the dynamic cache raises when it is fed that id), and every output from
  that step on is void.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["StaticKVCache"]


@dataclass
class StaticKVCache:
    """What the decode steps share and keep.

    Attributes:
        layers: per block run (``runs``), the attention's slots (``SelfSlots`` / ``ContextSlots``), ``None`` for a
            feed-forward block and for a cross-attention run without a context (it adds nothing).
        valid: ``(B, L)`` which slots hold a real position (padding and unwritten slots are False).
        positions: ``(B, L)`` the position of each slot's token (ALiBi's distances).
        count: ``(B,)`` the next position of each sample (real rows so far).
        lead: ``(B,)`` real rows before the tokens (absolute positions start after them).
        condition: ``(B, K)`` the adaptive condition of the prefill, or ``None``.
        length: slots written so far (a host integer: every sample writes the same slot).
        padded: whether any slot before ``length`` is padding (the eager step then passes ``valid`` as a mask).
        fixed: every step runs on fixed shapes (see the module docstring); ``slot`` its 0-d slot tensor.
        rotary: the rotary tables of every position ``[0, L]`` (``nn.attention_step.rotary_tables``), shaped
            ``(L + 1, 1, 1, .)`` so that a step's ``index_select`` at the positions is its rotation, or ``None``.
        dtype: the stack's hidden-state dtype (what a step's input must have: continuous wrappers' values are cast).
        position_table: ``dynamic_pos_bias``' MLP at every distance the cache can hold (``DynamicPositionBias.table``),
            or ``None`` (no such bias, or computed per step: a net with forward hooks).
        needs_angles: some attention rotates with its own code (``StepPlan.own_qkv``): each step computes the stack's
            position pair at the new position for it.
        block_plans: per block run, how a net without hooks runs it without the module calls (``BlockPlan``: a
            float32 LayerNorm's kept gain, a plain feed-forward's parts; ``None`` for a block with separate q/k/v
            inputs); ``None`` altogether with forward hooks (then every block is called as a module, so that they
            run). Not used while autograd records (the kept gain and fused weights are copies).
        plain_residual: per block, whether its residual update is the plain ``stream + out`` (x-transformers'
            ``Residual`` unscaled, no hooks), ``None`` with forward hooks.
        runs: the blocks each step runs, in order (their indices; ``weight_tie_layers`` / ``layers_execute_order`` run
            some more than once, each run with its own slots).
        reads_positions: some part of the step reads ``positions`` (ALiBi, a relative position bias, a window, an
            attention option): each step then writes the new slot's position; otherwise ``positions`` keeps the
            prefill's.
        final_norm: the stack's final norm as ``F.layer_norm``'s arguments (a float32 ``LayerNorm``, its gain kept
            once), or ``None`` (its own call); only with ``block_plans``.
        program: the flat per-run program of a net without hooks whose blocks share nothing but the stream (no
            residual routing, residual attention, value residual, ``ff_deep_embed``, separate q/k/v inputs): one
            entry per block run (``decode_step._Run``), or ``None`` (the general loop).
        loop: a looped wrapper's runs (``decode_step.LoopPlan``: every loop step's own slots, the early exit), or
            ``None``; each run of the stack reads ``layers`` = its loop step's.
        held: the stack's step does not advance the position (set while a looped wrapper's runs read the same
            one; the wrapper advances it once after them).
        token_range: the vocabulary size ``num_tokens`` of a token wrapper whose logits are wider
            (``logits_dim > num_tokens``): its steps record ids outside ``[0, token_range)`` in ``bad_token`` instead
            of asserting; ``None`` otherwise (an id outside the vocabulary is an asynchronous assertion).
        bad_token: with ``token_range``, ``(3,)`` int64 on the cache's device: ``(seen, id, row)``, the first step
            input id outside the vocabulary and its sample (``seen`` 0: none yet); read by ``check_tokens``.
    """

    layers: list
    valid: Tensor
    positions: Tensor
    count: Tensor
    lead: Tensor
    condition: Tensor | None
    length: int
    padded: bool
    fixed: bool
    slot: Tensor | None
    rotary: object
    dtype: object
    position_table: Tensor | None = None
    needs_angles: bool = False
    block_plans: list | None = None
    plain_residual: list | None = None
    runs: tuple = ()
    reads_positions: bool = True
    final_norm: tuple | None = None
    program: tuple | None = None
    loop: object = None
    held: bool = False
    token_range: int | None = None
    bad_token: Tensor | None = None
    _spare: list | None = field(default=None, repr=False)

    @property
    def capacity(self) -> int:
        """L, the slots the cache has room for."""
        return int(self.valid.shape[1])

    @property
    def batch_size(self) -> int:
        return int(self.count.shape[0])

    def record_tokens(self, x: Tensor) -> Tensor:
        """``x (B, 1)`` a step's token ids, with ``token_range``: the first id outside ``[0, token_range)`` (row-major,
        as the dynamic cache names it) recorded in ``bad_token`` unless one was recorded before, all on the device
        (no host read; fixed shapes: compiles); returns ``x`` clamped into the vocabulary (what the step embeds)."""
        n = self.token_range
        if x.numel():
            flat = x.reshape(-1).long()
            bad = (flat < 0) | (flat >= n)
            row = bad.long().argmax()  # the first bad sample (0 when none)
            new = torch.stack((bad.any().long(), flat.gather(0, row[None])[0], row))
            rec = self.bad_token
            rec.copy_(torch.where(rec[0] > 0, rec, new))
        return x.clamp(0, n - 1)

    def check_tokens(self) -> None:
        """Raise the dynamic cache's ``ValueError`` when a step was fed an id outside the vocabulary (``bad_token``;
        one host read); nothing without ``token_range``."""
        if self.bad_token is None:
            return
        seen, tok, row = (int(v) for v in self.bad_token.tolist())
        if seen:  # the wording of the wrapper's forward (wrapper_forward), the position of the step's x (B, 1)
            raise ValueError(f"x holds token id {tok} at real position {(row, 0)}, outside the vocabulary "
                             f"[0, num_tokens={self.token_range}); padded positions (mask False) may hold anything")

    def index_select_(self, index: Tensor) -> None:
        """Keep (repeat, reorder) the samples ``index (B',)`` in place (beam search). When the batch keeps its
        size, the keys and values are gathered into a second set of buffers allocated once (then the two swap),
        so a reorder per step allocates nothing."""
        same = int(index.shape[0]) == self.batch_size
        spares = self._spare if same else None
        slots = self._slots()
        if same and spares is None:  # the first reorder of this size: allocate the spare set once
            spares = [s.spare() for s in slots]
        olds = []
        for i, s in enumerate(slots):
            olds.append(s.select_(index, None if spares is None else spares[i]))
        self._spare = olds if same else None
        sel = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        self.valid, self.positions, self.count, self.lead = sel(self.valid), sel(self.positions), sel(self.count), \
            sel(self.lead)
        self.condition = sel(self.condition)

    def _slots(self) -> list:
        """Every block run's slots once (a looped wrapper's loop steps share their context slots)."""
        seen, out = set(), []
        for layers in (self.loop.layers if self.loop is not None else (self.layers,)):
            for s in layers:
                if s is not None and id(s) not in seen:
                    seen.add(id(s))
                    out.append(s)
        return out
