"""Masks with dead rows on purpose, hypothesis strategies that draw them, and garbage to plant.

Two levels: ``AttnCase`` / ``attention_cases`` draw whole ``attend`` problems (q, k, v shapes, every mask
kind, causal, the garbage to plant); ``Scenario`` / ``scenarios`` draw a batch layout for the model stack
(padding of the sequence and of a context).

Shape legend: b batch, h query heads, h_kv key/value heads, i queries, j keys, d head dim (q, k),
e head dim (v), n sequence positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor

from .numerics import INF, NAN
from .references import allowed_matrix

__all__ = [
    "PLANT_VALUES", "MASK_KINDS", "generator", "plant", "mask_from_lengths",
    "padding_masks", "dense_masks", "attention_masks", "AttnCase", "attention_cases",
    "Scenario", "scenarios", "fixed_scenario", "causal_dead", "full_dead", "ctx_dead",
]

PLANT_VALUES = (NAN, INF, -INF, 1e4, -3e38)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def plant(x: Tensor, masked_positions: Tensor, value: float) -> Tensor:
    """A copy of ``x`` with ``value`` (NaN, +inf, -inf, anything) at ``masked_positions``.

    ``masked_positions`` is a bool tensor over the leading dims of ``x`` (e.g. ``(b, h_kv, j)`` for k of
    shape ``(b, h_kv, j, d)``); it is broadcast over the trailing feature dims.
    """
    pos = masked_positions.to(x.device)
    pos = pos.reshape(*pos.shape, *([1] * (x.dim() - pos.dim())))
    fill = torch.tensor(value, dtype=torch.float64).to(x.dtype)  # -3e38 in float16 is -inf, as a cast gives
    return x.masked_fill(pos, fill.to(x.device))


def mask_from_lengths(lengths: Sequence[int], n: int, *, left: bool = False) -> Tensor:
    """``(b, n)`` padding mask written plainly: True at the ``lengths[s]`` real positions of sample s."""
    mask = torch.zeros(len(lengths), n, dtype=torch.bool)
    for s, length in enumerate(lengths):
        if left:
            mask[s, n - length :] = True
        else:
            mask[s, :length] = True
    return mask


# ----------------------------------------------------------------------------------------------------
# attend-level problems
# ----------------------------------------------------------------------------------------------------


@st.composite
def padding_masks(draw, b: int, n: int, *, side: str | None = None, holes: bool = True) -> Tensor:
    """``(b, n)`` padding masks (True = real). Fully padded samples (length 0) and full ones on purpose;
    padding on the right or the left (``side`` fixes it), and sometimes scattered holes."""
    lengths = draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    if b and n and draw(st.booleans()):  # a fully padded sample on purpose
        lengths[draw(st.integers(0, b - 1))] = 0
    left = draw(st.sampled_from(["right", "left"])) == "left" if side is None else side == "left"
    mask = mask_from_lengths(lengths, n, left=left)
    if holes and b and n and draw(st.integers(0, 3)) == 0:
        mask &= torch.rand(b, n, generator=generator(draw(st.integers(0, 2**31)))) < 0.7
    return mask


@st.composite
def dense_masks(draw, shape: tuple[int, ...]) -> Tensor:
    """A random bool mask of ``shape`` (last two dims ``(i, j)``) with dead rows on purpose: some rows
    all False, sometimes a whole leading slice (a sample, a head) all False, sometimes all False/True."""
    *lead, i, j = shape
    density = draw(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]))
    mask = torch.rand(shape, generator=generator(draw(st.integers(0, 2**31)))) < density
    if i and draw(st.booleans()):  # some rows all False, in every sample/head
        rows = draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=i, unique=True))
        mask[..., rows, :] = False
    if lead and lead[0] and draw(st.booleans()):  # one sample all False
        mask[draw(st.integers(0, lead[0] - 1))] = False
    return mask


MASK_KINDS = ("none", "key_padding", "shared", "full", "per_head", "query_padding")


@st.composite
def attention_masks(draw, b: int, h: int, i: int, j: int, kind: str) -> tuple[Tensor | None, Tensor | None]:
    """``(mask as given to attend, the same as a 4-d (b|1, h|1, i|1, j|1) mask for the reference)``.

    Kinds: ``none``; ``key_padding`` ``(b, j)``; ``shared`` ``(i, j)`` (given 4-d when ``b == i``, where
    a 2-d mask reads as key padding); ``full`` ``(b, i, j)``; ``per_head`` ``(b, h, i, j)``;
    ``query_padding`` ``(b, 1, i, 1)`` (padded queries are dead rows).
    """
    if kind == "none":
        return None, None
    if kind == "key_padding":
        m = draw(padding_masks(b, j))
        return m, m[:, None, None, :]
    if kind == "query_padding":
        m = draw(padding_masks(b, i))[:, None, :, None]
        return m, m
    if kind == "shared":
        m = draw(dense_masks((i, j)))
        return (m[None, None] if b == i else m), m[None, None]
    if kind == "full":
        m = draw(dense_masks((b, i, j)))
        return m, m[:, None]
    if kind == "per_head":
        m = draw(dense_masks((b, h, i, j)))
        return m, m
    raise ValueError(f"unknown mask kind {kind!r}")


@dataclass
class AttnCase:
    """One drawn attention problem: shapes, a mask (with dead rows on purpose), causal, garbage to plant."""

    b: int
    h: int
    h_kv: int
    i: int
    j: int
    d: int
    e: int
    kind: str
    mask: Tensor | None  # as passed to attend
    mask4d: Tensor | None  # the same, 4-d, for the reference
    causal: bool
    planted: float  # the garbage put at masked keys and dead queries
    seed: int

    def allowed(self) -> Tensor:
        """``(b, h, i, j)`` combined mask."""
        return allowed_matrix(self.b, self.h, self.i, self.j, self.mask4d, self.causal)

    def dead(self) -> Tensor:
        """``(b, h, i)``: dead rows."""
        return ~self.allowed().any(dim=-1)

    def masked_keys(self) -> Tensor:
        """``(b, h_kv, j)``: keys no query of any head sharing the key/value head may attend to."""
        a = self.allowed().any(dim=-2)  # (b, h, j)
        return ~a.reshape(self.b, self.h_kv, self.h // self.h_kv, self.j).any(dim=2)

    def clean(self, dtype: torch.dtype = torch.float32, device: str = "cpu", scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v drawn from the case's seed (no garbage), rounded to ``dtype``; not leaves."""
        g = generator(self.seed)
        q = torch.randn(self.b, self.h, self.i, self.d, generator=g, dtype=torch.float64) * scale
        k = torch.randn(self.b, self.h_kv, self.j, self.d, generator=g, dtype=torch.float64) * scale
        v = torch.randn(self.b, self.h_kv, self.j, self.e, generator=g, dtype=torch.float64)
        return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))

    def inputs(self, dtype: torch.dtype = torch.float32, device: str = "cpu", *, garbage: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Leaf q, k, v (requires_grad) with ``planted`` at masked keys/values and dead queries."""
        q, k, v = self.clean(dtype, device)
        if garbage:
            q = plant(q, self.dead(), self.planted)
            k = plant(k, self.masked_keys(), self.planted)
            v = plant(v, self.masked_keys(), self.planted)
        return tuple(t.detach().requires_grad_() for t in (q, k, v))

    def upstream(self, dtype: torch.dtype = torch.float64, device: str = "cpu") -> Tensor:
        """A random upstream gradient ``(b, h, i, e)`` for the output."""
        g = generator(self.seed + 1)
        return torch.randn(self.b, self.h, self.i, self.e, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


@st.composite
def attention_cases(
    draw,
    *,
    max_b: int = 3,
    max_len: int = 6,
    kinds: Sequence[str] = MASK_KINDS,
    causal: bool | None = None,
    allow_empty: bool = True,
    same_head_dims: bool = True,
) -> AttnCase:
    """Random attention problems: batch 0..max_b, lengths 0..max_len (0 only if ``allow_empty``),
    grouped-query ratios 1..3, every mask kind, causal on/off (``causal`` fixes it), self-attention
    (``i == j``) half of the time, garbage (NaN, +-inf, huge) to plant at masked positions."""
    lo = 0 if allow_empty else 1
    b = draw(st.integers(lo, max_b))
    h_kv = draw(st.integers(1, 2))
    h = h_kv * draw(st.integers(1, 3))
    i = draw(st.integers(lo, max_len))
    j = i if draw(st.booleans()) else draw(st.integers(lo, max_len))
    d = draw(st.sampled_from([8, 16]))
    e = d if same_head_dims else draw(st.sampled_from([4, 8, 16]))
    kind = draw(st.sampled_from(list(kinds)))
    mask, mask4d = draw(attention_masks(b, h, i, j, kind))
    is_causal = draw(st.booleans()) if causal is None else causal
    planted = draw(st.sampled_from(PLANT_VALUES))
    seed = draw(st.integers(0, 2**31))
    return AttnCase(b, h, h_kv, i, j, d, e, kind, mask, mask4d, is_causal, planted, seed)


# ----------------------------------------------------------------------------------------------------
# model-level batch layouts
# ----------------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    """A batch layout: ``seq_mask (b, n)`` padding of the sequence and ``ctx_mask (b, j)`` of the context."""

    seq_mask: Tensor
    ctx_mask: Tensor
    seed: int = 0

    @property
    def b(self) -> int:
        return self.seq_mask.shape[0]

    @property
    def n(self) -> int:
        return self.seq_mask.shape[1]

    @property
    def j(self) -> int:
        return self.ctx_mask.shape[1]

    def generator(self) -> torch.Generator:
        return generator(self.seed)


@st.composite
def scenarios(
    draw,
    *,
    max_b: int = 3,
    min_n: int = 1,
    max_n: int = 6,
    max_j: int = 5,
    styles: tuple[str, ...] = ("left", "right", "holes"),
    force_dead: bool = True,
) -> Scenario:
    """Draw a batch layout. Sequence rows are left-padded, right-padded or have holes; context rows
    are arbitrary; ``j`` may be 0. With ``force_dead`` one sample is fully padded, or has an all-False
    context, or both (dead rows on purpose)."""
    b = draw(st.integers(1, max_b))
    n = draw(st.integers(min_n, max_n))
    j = draw(st.integers(0, max_j))
    seq, ctx = [], []
    for _ in range(b):
        style = draw(st.sampled_from(styles))
        length = draw(st.integers(0, n))
        bits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        seq.append(bits if style == "holes" else mask_from_lengths([length], n, left=style == "left")[0].tolist())
        ctx.append(draw(st.lists(st.booleans(), min_size=j, max_size=j)))
    if force_dead:
        victim = draw(st.integers(0, b - 1))
        what = draw(st.sampled_from(("seq", "ctx", "both")))
        if what in ("seq", "both"):
            seq[victim] = [False] * n
        if what in ("ctx", "both"):
            ctx[victim] = [False] * j
    seed = draw(st.integers(0, 2**20))
    return Scenario(torch.tensor(seq, dtype=torch.bool).reshape(b, n), torch.tensor(ctx, dtype=torch.bool).reshape(b, j), seed)


def fixed_scenario() -> Scenario:
    """A hand-made layout with every kind of dead row: left padding, a fully padded sample, an all-False
    context, right padding with a hole in the context."""
    seq = torch.tensor([
        [False, False, True, True, True, True],
        [True, True, True, True, False, False],
        [False, False, False, False, False, False],
        [False, True, True, True, True, True],
    ])
    ctx = torch.tensor([
        [True, True, False, True, False],
        [False, False, False, False, False],
        [True, True, True, True, True],
        [True, True, True, False, False],
    ])
    return Scenario(seq, ctx, seed=1)


def causal_dead(mask: Tensor) -> Tensor:
    """``(b, n)``: under causal masking with key padding, a query is dead iff no real key is at or before it."""
    return mask.long().cumsum(1) == 0


def full_dead(mask: Tensor) -> Tensor:
    """``(b, n)``: without causal masking, every query of a sample with no real key is dead."""
    return (~mask.any(1, keepdim=True)).expand_as(mask)


def ctx_dead(ctx_mask: Tensor, i: int) -> Tensor:
    """``(b, i)``: every query of a sample whose context is empty or fully masked is dead."""
    return (~ctx_mask.any(1, keepdim=True)).expand(ctx_mask.shape[0], i)
