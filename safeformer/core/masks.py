"""The one mask convention of safeformer, and the helpers built on it.

A mask is a ``torch.bool`` tensor, ``True`` = this query may attend to this key (or: this position
is real). True in row i, column j means query i attends to key j. No other convention is accepted
silently: integer or float masks raise ``TypeError`` (S9).

Shape legend: b batch, h heads, i queries, j keys, n sequence positions, d feature size.

Canonical attention-mask shape: ``(b|1, h|1, i|1, j|1)``, broadcastable to ``(b, h, i, j)``. Padding
masks stay broadcast: a key padding mask ``(b, j)`` becomes ``(b, 1, 1, j)``, a query padding mask
``(b, i)`` becomes ``(b, 1, i, 1)``; neither ever becomes a dense ``(b, h, i, j)`` tensor.

Words (see docs/safety.md):
- dead row: a query that may attend to no key once every mask is combined.
- masked key: a key that no query may attend to (a column of the combined mask that is all False).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

__all__ = [
    "validate_mask",
    "check_lengths",
    "padding_mask",
    "key_padding_mask",
    "query_padding_mask",
    "as_attention_mask",
    "causal_mask",
    "combine_masks",
    "dead_rows",
    "alive_rows",
    "alive_keys",
    "check_finite",
]


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


# The masks validated in the current call of the outermost door (``checked_once``): each mask is checked
# once per call against each requirement, however many layers below the door receive it. Keyed by the
# tensor's identity and version (an in-place change is checked again); the tensors are held so that an
# identity cannot be reused within the call.
_VALIDATED: ContextVar[dict | None] = ContextVar("safeformer_validated_masks", default=None)


@contextmanager
def validation_scope() -> Iterator[None]:
    """Within this scope ``validate_mask`` checks each mask once per requirement (the outermost door
    opens it; a module used on its own opens its own, so it still validates)."""
    if _VALIDATED.get() is not None:
        yield
        return
    token = _VALIDATED.set({})
    try:
        yield
    finally:
        _VALIDATED.reset(token)


def checked_once(fn: Callable) -> Callable:
    """Decorator for a door's ``forward``: its masks are validated once per call (``validation_scope``)."""

    @functools.wraps(fn)
    def door(*args, **kwargs):
        if torch.compiler.is_compiling() or _VALIDATED.get() is not None:  # an inner door: the scope is open
            return fn(*args, **kwargs)
        token = _VALIDATED.set({})
        try:
            return fn(*args, **kwargs)
        finally:
            _VALIDATED.reset(token)

    return door


def seen_in_scope(obj, requirement) -> bool:
    """Whether ``obj`` was already checked against ``requirement`` in the current validation scope (and
    records it): a door's checks of a value it hands on (a cache) run once per call."""
    seen = None if torch.compiler.is_compiling() else _VALIDATED.get()
    if seen is None:
        return False
    key = (id(obj), requirement)
    if key in seen:
        return True
    seen[key] = obj
    return False


def validate_mask(
    mask: Tensor,
    name: str = "mask",
    *,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Check that ``mask`` is a bool tensor of the expected shape on the expected device.

    Args:
        mask: the mask to check.
        name: the argument's name, used in the error message.
        shape: the expected shape; ``None`` entries match any size.
        device: the expected device (compared by type and index).

    Returns:
        ``mask`` unchanged.

    Raises:
        TypeError: ``mask`` is not a tensor or not ``torch.bool``.
        ValueError: wrong number of dimensions, wrong size, or wrong device.
    """
    seen = None if torch.compiler.is_compiling() else _VALIDATED.get()
    # an inference tensor (made in torch.inference_mode) has no version counter: checked each time
    if seen is not None and isinstance(mask, Tensor) and not mask.is_inference():
        key = (id(mask), mask._version, shape, None if device is None else str(torch.device(device)))
        if key in seen:
            return mask
        _check_mask(mask, name, shape, device)
        seen[key] = mask
        return mask
    _check_mask(mask, name, shape, device)
    return mask


def _check_mask(mask, name: str, shape, device) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.bool tensor (True = may attend), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must have dtype torch.bool (True = may attend / is real), got {mask.dtype}; "
            f"convert 0/1 integer masks with `{name}.bool()` and check that 1 means 'keep'"
        )
    if shape is not None:
        ok = mask.dim() == len(shape) and all(e is None or e == s for e, s in zip(shape, mask.shape))
        if not ok:
            want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {_shape(mask)}")
    if device is not None and not _same_device(mask.device, device):
        raise ValueError(f"{name} is on {mask.device}, expected {device} (the device of the inputs)")


def _same_device(a: torch.device, b: torch.device) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def check_token_ids(t, name: str = "x") -> Tensor:
    """``t`` is a ``(b, n)`` tensor of integer token ids (any integer dtype): else a ``ValueError`` (shape) or a
    ``TypeError`` (dtype) naming ``name``. Returns ``t``."""
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be token ids of shape (b, n), got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    return t


def check_lengths(lengths, name: str, b: int | None = None, max_len: int | None = None, device=None) -> Tensor:
    """Per-sample lengths (or start positions): an integer tensor ``(b,)`` with values in ``[0, max_len]``,
    else a clear error naming ``name`` (S9). One host sync (the values), at the door."""
    if not isinstance(lengths, Tensor) or lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise TypeError(f"{name} must be an integer tensor (b,), got {getattr(lengths, 'dtype', type(lengths).__name__)}")
    if lengths.dim() != 1 or (b is not None and lengths.shape[0] != b):
        raise ValueError(f"{name} must have shape (b,){'' if b is None else f' = ({b},)'}, got {tuple(lengths.shape)}")
    if device is not None and not _same_device(lengths.device, device):
        raise ValueError(f"{name} is on {lengths.device}, expected {device}")
    if lengths.numel() and not torch.compiler.is_compiling():
        low, high = int(lengths.min()), int(lengths.max())
        if low < 0 or (max_len is not None and high > max_len):
            bound = "" if max_len is None else f", at most {max_len}"
            raise ValueError(f"{name} must hold values >= 0{bound}; got {low if low < 0 else high}")
    return lengths


def padding_mask(lengths: Tensor, max_len: int | None = None, *, left: bool = False) -> Tensor:
    """Build a ``(b, n)`` padding mask from per-sample lengths (True = real position).

    Args:
        lengths: ``(b,)`` integer lengths, each in ``[0, max_len]`` (checked: one host sync).
        max_len: ``n``; defaults to ``lengths.max()``.
        left: real positions at the end (left padding) instead of the start.
    """
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0):
        raise ValueError(f"max_len must be an integer >= 0, got {max_len!r}")
    check_lengths(lengths, "lengths", max_len=max_len)
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(max_len, device=lengths.device)
    if left:
        return pos[None, :] >= (max_len - lengths[:, None])
    return pos[None, :] < lengths[:, None]


def key_padding_mask(mask: Tensor, batch: int, keys: int, name: str = "mask") -> Tensor:
    """Validate a ``(b, j)`` key padding mask and return it as ``(b, 1, 1, j)``."""
    validate_mask(mask, name, shape=(batch, keys))
    return mask[:, None, None, :]


def query_padding_mask(mask: Tensor, batch: int, queries: int, name: str = "mask") -> Tensor:
    """Validate a ``(b, i)`` query padding mask and return it as ``(b, 1, i, 1)``."""
    validate_mask(mask, name, shape=(batch, queries))
    return mask[:, None, :, None]


def as_attention_mask(mask: Tensor, b: int, h: int, i: int, j: int, name: str = "mask") -> Tensor:
    """Validate ``mask`` for attention of shape ``(b, h, i, j)`` and return it 4-d, still broadcast.

    Accepted shapes: ``(b, j)`` key padding, ``(i, j)`` one mask for all samples, ``(b, i, j)``,
    ``(b|1, h|1, i|1, j|1)``. A ``(b, j)`` and an ``(i, j)`` reading are ambiguous when ``b == i``;
    the 2-d form is always read as key padding ``(b, j)`` then, as in every safeformer module.
    Nothing is broadcast into a different meaning: any other shape raises ``ValueError``.
    """
    validate_mask(mask, name)
    s = _shape(mask)
    if mask.dim() == 2:
        if s == (b, j):
            return mask[:, None, None, :]
        if s == (i, j):
            return mask[None, None, :, :]
        raise ValueError(
            f"{name} of 2 dims must be a key padding mask (b, j) = ({b}, {j}) or an (i, j) = ({i}, {j}) "
            f"mask, got {s}"
        )
    if mask.dim() == 3:
        if s == (b, i, j):
            return mask[:, None, :, :]
        raise ValueError(f"{name} of 3 dims must have shape (b, i, j) = ({b}, {i}, {j}), got {s}")
    if mask.dim() == 4:
        for got, full, label in zip(s, (b, h, i, j), "bhij"):
            if got != full and got != 1:
                raise ValueError(
                    f"{name} of 4 dims must broadcast to (b, h, i, j) = ({b}, {h}, {i}, {j}) with each size "
                    f"either full or 1; got {s} (size {got} for '{label}')"
                )
        return mask
    raise ValueError(
        f"{name} must have shape (b, j), (i, j), (b, i, j) or (b|1, h|1, i|1, j|1) for attention of "
        f"(b, h, i, j) = ({b}, {h}, {i}, {j}); got {s}"
    )


def causal_mask(i: int, j: int, device: torch.device | str | None = None) -> Tensor:
    """Bottom-right aligned causal mask ``(1, 1, i, j)``: query q may see key k iff ``k <= q + (j - i)``.

    With ``i == j`` this is the usual lower-triangular mask; with ``i < j`` (a KV cache holding earlier
    keys) the last query sees every key. With ``i > j`` the first ``i - j`` queries are dead rows.
    """
    qi = torch.arange(i, device=device)[:, None]
    kj = torch.arange(j, device=device)[None, :]
    return (kj <= qi + (j - i))[None, None]


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of broadcastable masks, skipping ``None``; ``None`` when all are ``None``.

    The result has the broadcast shape of its inputs, never more.
    """
    out = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else out & m
    return out


def alive_rows(mask: Tensor) -> Tensor:
    """``(..., i, 1)``: True where a query row may attend to at least one key."""
    return mask.any(dim=-1, keepdim=True)


def dead_rows(mask: Tensor) -> Tensor:
    """``(..., i, 1)``: True where a query row may attend to no key (a dead row)."""
    return ~alive_rows(mask)


def alive_keys(mask: Tensor) -> Tensor:
    """``(..., 1, j)``: True where at least one query may attend to the key (the rest are masked keys)."""
    return mask.any(dim=-2, keepdim=True)


def check_finite(x: Tensor, mask: Tensor | None, name: str) -> None:
    """Raise ``ValueError`` if a real (unmasked) position of ``x`` holds NaN or inf.

    ``mask`` is ``(b, n)`` for ``x`` ``(b, n, ...)`` (or ``None``: every position is real). This syncs
    with the device; it runs only when the user asks for checks.
    """
    if not x.is_floating_point():
        return
    bad = ~torch.isfinite(x)
    if x.dim() > 2:
        bad = bad.flatten(2).any(-1)
    if mask is not None:
        validate_mask(mask, "mask", shape=tuple(bad.shape), device=x.device)
        bad = bad & mask
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name} holds a non-finite value (NaN or inf) at real position {tuple(where)}; "
            f"{int(bad.sum())} real position(s) in all. Padded positions (mask False) may hold anything."
        )


def packed_sequence_mask(kwargs, n_q: int, n_k: int, device, name: str = "flash_pack_seq_kwargs") -> Tensor:
    """x-transformers' packed sequences (``flash_pack_seq_kwargs``: flash-attn's ``flash_attn_varlen_func``
    keywords ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``) as a bool mask ``(1, 1, n_q,
    n_k)``: query ``t`` of document ``d`` (``cu_seqlens_q[d] <= t < cu_seqlens_q[d + 1]``) may attend to the keys of
    document ``d`` only. Positions after the last document belong to none (their rows are dead: 0).

    Raises:
        TypeError, ValueError: ``kwargs`` not such a dict (named ``name``), offsets not 1-d integer tensors starting
            at 0, decreasing, past the sequence, or with different numbers of documents.
    """
    if not isinstance(kwargs, dict) or not {"cu_seqlens_q", "cu_seqlens_k"} <= set(kwargs) \
            or set(kwargs) - {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}:
        raise TypeError(f"{name} must be a dict of cu_seqlens_q, cu_seqlens_k (and max_seqlen_q, max_seqlen_k), got "
                        f"{kwargs if not isinstance(kwargs, dict) else sorted(kwargs)!r}")
    docs = []
    for key, n in (("cu_seqlens_q", n_q), ("cu_seqlens_k", n_k)):
        cu = kwargs[key]
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.dtype == torch.bool \
                or cu.numel() < 2:
            raise TypeError(f"{name}[{key!r}] must be a 1-d integer tensor of document offsets, got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)}")
        cu = cu.to(device=device, dtype=torch.long)
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > n:
            raise ValueError(f"{name}[{key!r}] must start at 0, never decrease and end at most at the sequence "
                             f"length {n}, got {cu.tolist()}")
        docs.append(torch.searchsorted(cu[1:], torch.arange(n, device=device), right=True))  # (n,): doc index
    if kwargs["cu_seqlens_q"].numel() != kwargs["cu_seqlens_k"].numel():
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k must hold the same number of documents")
    n_docs = kwargs["cu_seqlens_q"].numel() - 1
    for key in ("max_seqlen_q", "max_seqlen_k"):
        if key in kwargs and (isinstance(kwargs[key], bool) or not isinstance(kwargs[key], int) or kwargs[key] < 0):
            raise ValueError(f"{name}[{key!r}] must be a non-negative int, got {kwargs[key]!r}")
    return ((docs[0][:, None] == docs[1][None, :]) & (docs[0][:, None] < n_docs))[None, None]
