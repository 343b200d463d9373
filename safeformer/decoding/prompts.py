"""Prompts in every form ``AutoregressiveWrapper.generate`` takes: token ids ``(b, n)`` with a padding ``mask``,
right-padded ids with their lengths (x-transformers' ``prompt_lens``), or a list of 1-D prompts of any lengths
(left-padded here). Masks follow the one convention (bool, True = real position)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["left_pad", "batch_prompts"]


def left_pad(prompts, pad_value: int = 0) -> tuple[Tensor, Tensor]:
    """``(tokens (b, n), mask (b, n))`` from ``b`` 1-D token tensors of any lengths, left-padded.

    Raises:
        ValueError / TypeError: an empty list, a prompt that is not 1-D, empty or not integer, or
        prompts on different devices.
    """
    if len(prompts) == 0:
        raise ValueError("prompts is an empty list: nothing to generate (pass at least one prompt)")
    for k, p in enumerate(prompts):
        if not isinstance(p, Tensor) or p.dim() != 1:
            raise ValueError(f"prompts[{k}] must be a 1-D tensor of token ids, got {getattr(p, 'shape', type(p))}")
        if p.dtype.is_floating_point or p.dtype == torch.bool or p.is_complex():
            raise TypeError(f"prompts[{k}] must hold integer token ids, got dtype {p.dtype}")
        if p.numel() == 0:
            raise ValueError(f"prompts[{k}] is empty: every prompt needs at least one token")
        if p.device != prompts[0].device:
            raise ValueError(f"prompts[{k}] is on {p.device}, prompts[0] on {prompts[0].device}")
    n = max(p.numel() for p in prompts)
    tokens = torch.full((len(prompts), n), pad_value, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros(len(prompts), n, dtype=torch.bool, device=prompts[0].device)
    for k, p in enumerate(prompts):
        tokens[k, n - p.numel():] = p
        mask[k, n - p.numel():] = True
    return tokens, mask


def _lengths_mask(prompts, prompt_lens) -> Tensor:
    """The mask ``(b, n)`` of right-padded ``prompts`` of lengths ``prompt_lens (b,)``, checked."""
    if not isinstance(prompts, Tensor) or prompts.dim() != 2:
        raise ValueError(f"prompts must be token ids of shape (b, n), got {getattr(prompts, 'shape', type(prompts))}")
    b, n = prompts.shape
    if not isinstance(prompt_lens, Tensor) or prompt_lens.shape != (b,):
        raise ValueError(f"prompt_lens must be a tensor of shape (b={b},), got {getattr(prompt_lens, 'shape', type(prompt_lens))}")
    if prompt_lens.dtype.is_floating_point or prompt_lens.dtype == torch.bool or prompt_lens.is_complex():
        raise TypeError(f"prompt_lens must hold integer lengths, got dtype {prompt_lens.dtype}")
    if prompt_lens.device != prompts.device:
        raise ValueError(f"prompt_lens is on {prompt_lens.device}, expected {prompts.device} (the device of the prompts)")
    if bool(((prompt_lens < 1) | (prompt_lens > n)).any()):
        raise ValueError(f"prompt_lens must be in [1, n={n}] (every prompt needs a token), got {prompt_lens.tolist()}")
    return torch.arange(n, device=prompts.device)[None, :] < prompt_lens[:, None]  # (b, n), right padding


def batch_prompts(prompts, mask, prompt_lens, pad_value: int) -> tuple[Tensor, Tensor | None]:
    """``(prompts (b, n), mask)`` from any form ``generate`` takes (x-transformers' included); a list of prompts
    is left-padded with ``pad_value``."""
    if isinstance(prompts, (list, tuple)):  # x-transformers' way: 1-D prompts of different lengths
        if mask is not None:
            raise ValueError("mask was given with a list of prompts: the list's lengths are the mask")
        if prompt_lens is not None:
            raise ValueError("prompt_lens was given with a list of prompts: the list's lengths are the lengths")
        prompts, mask = left_pad(prompts, pad_value)
        return prompts, mask
    if prompt_lens is not None:  # x-transformers' way: right-padded prompts and their lengths
        if mask is not None:
            raise ValueError("pass mask or prompt_lens, not both (prompt_lens is the mask of right-padded prompts)")
        mask = _lengths_mask(prompts, prompt_lens)
    return prompts, mask
