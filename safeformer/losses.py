"""Losses shared by the wrappers: the shifted next-token loss of a token model.

Shape legend: b batch, n positions, v vocabulary size.
Masks: bool, True = real position (``masks.py``). The safe cross-entropy itself lives in ``masks.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import safe_cross_entropy, validate_mask

__all__ = ["next_token_loss"]


def next_token_loss(
    net, tokens: Tensor, mask: Tensor | None, ignore_index: int, pad_value: int, *,
    name: str = "x", mask_name: str = "mask", **kwargs,
) -> Tensor:
    """Shifted next-token loss of a ``TransformerWrapper`` on ``tokens (b, n)``.

    A target counts when it and the position that predicts it are both real (not ``ignore_index``,
    not masked), so a left-padded sample scores exactly the targets it would score alone.
    """
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        raise ValueError(f"{name} must be token ids of shape (b, n), got {getattr(tokens, 'shape', type(tokens))}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if mask is not None:
        validate_mask(mask, mask_name, shape=tuple(tokens.shape), device=tokens.device)
    real = tokens != ignore_index
    if mask is not None:
        real = real & mask
    inp, target = tokens[:, :-1], tokens[:, 1:]
    inp = torch.where(real[:, :-1], inp, torch.full_like(inp, pad_value))  # ignored ids are not looked up
    # ignored inputs (ignore_index, or mask False) are padding: masked, so left padding changes nothing
    # (S4). Without a user mask and without ignored tokens no mask is passed, so the decoder keeps the
    # mask-free causal path (is_causal, the flash kernel); telling the two apart reads one bool on the
    # host, in the loss only (never inside attend).
    inp_mask = real[:, :-1]
    if mask is None and not bool((tokens == ignore_index).any()):
        inp_mask = None
    counted = real[:, 1:] & real[:, :-1]
    target = torch.where(counted, target, torch.full_like(target, ignore_index))
    logits = net(inp, mask=inp_mask, **kwargs)
    return safe_cross_entropy(logits, target, ignore_index=ignore_index)
