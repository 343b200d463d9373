"""Losses and masked reductions: a cross-entropy and a mean that stay finite over zero counted
positions (S8), and the shifted next-token loss of a token model.

Shape legend: b batch, n positions, v vocabulary size.
Masks: bool, True = real position (``masks.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import _shape, check_token_ids, validate_mask

__all__ = ["masked_mean", "safe_cross_entropy", "next_token_loss", "next_embed_loss"]


def masked_mean(x: Tensor, mask: Tensor | None, dim: int = 1, keepdim: bool = False) -> Tensor:
    """Mean of ``x`` over ``dim`` counting only positions where ``mask`` is True.

    ``x`` is ``(b, n, ...)`` and ``mask`` ``(b, n)`` for ``dim=1``. Positions that are masked are selected
    away (a NaN there does not reach the result), and a mean over zero valid positions is ``0`` with
    zero gradient, not NaN (S8). The sum and the count are accumulated in float32 (float64 for float64
    inputs), so a half-precision mean of many large values does not overflow (S7); the result is cast
    back to ``x``'s dtype.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    acc = torch.promote_types(x.dtype, torch.float32)
    if mask is None:
        return x.mean(dim=dim, keepdim=keepdim, dtype=acc).to(x.dtype)
    validate_mask(mask, "mask", device=x.device)
    if mask.shape != x.shape[: mask.dim()]:
        raise ValueError(f"mask must have shape {tuple(x.shape[: mask.dim()])} (leading dims of x), got {_shape(mask)}")
    m = mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=dim, keepdim=keepdim, dtype=acc)
    count = m.sum(dim=dim, keepdim=keepdim).to(acc)
    return (total / count.clamp(min=1)).to(x.dtype)


def safe_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy whose mean over zero counted targets is ``0.0`` with zero gradient (S8).

    Args:
        logits: ``(b, n, c)`` or ``(N, c)`` scores.
        target: ``(b, n)`` or ``(N,)`` class indices; ``ignore_index`` marks positions that do not count.
        ignore_index: the index of targets to ignore (padding).
        reduction: ``"mean"`` (over counted targets), ``"sum"`` or ``"none"``.
        label_smoothing: as in ``F.cross_entropy``.

    Logits at ignored positions are selected away before the loss, so a NaN there reaches neither
    the loss nor any gradient.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"target must hold integer class indices, got dtype {target.dtype}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits must have shape (*target.shape, num_classes) = ({', '.join(map(str, target.shape))}, c), "
            f"got {_shape(logits)}"
        )
    c = logits.shape[-1]
    flat_logits = logits.reshape(-1, c)
    flat_target = target.reshape(-1).long()
    valid = flat_target != ignore_index
    safe_logits = torch.where(valid[:, None], flat_logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    safe_target = torch.where(valid, flat_target, torch.zeros_like(flat_target))
    losses = F.cross_entropy(safe_logits.to(torch.promote_types(logits.dtype, torch.float32)), safe_target, reduction="none", label_smoothing=label_smoothing)
    losses = torch.where(valid, losses, torch.zeros_like(losses))
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum().clamp(min=1).to(losses.dtype)


def next_token_loss(
    net, tokens: Tensor, mask: Tensor | None, ignore_index: int, pad_value: int, *,
    name: str = "x", mask_name: str = "mask", mask_prob: float = 0.0, return_outputs: bool = False,
    next_embed_weight: float = 0.0, **kwargs,
):
    """Shifted next-token loss of a ``TransformerWrapper`` on ``tokens (b, n)``.

    A target counts when it and the position that predicts it are both real (not ``ignore_index``,
    not masked), so a left-padded sample scores exactly the targets it would score alone.

    ``mask_prob``: a forgetful causal mask (x-transformers' ``mask_prob``): ``min(int(n' * mask_prob),
    n' - 1)`` random input positions per sample (of the ``n'`` the net reads), never the first, are hidden as
    keys from every query (they still predict their own targets). ``return_outputs``: return ``(loss,
    (logits (b, n - 1, v), LayerIntermediates))`` (the net run with ``return_intermediates=True``).
    ``next_embed_weight``: for a net built with ``add_continuous_pred_head``, x-transformers' continuous
    loss (``next_embed_loss``) added with this weight; the net then reads all ``n`` positions (the last
    one's embedding is the last target), and its logits of the first ``n - 1`` are the same (causal).
    """
    check_token_ids(tokens, name)
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
    # host, in the loss only (never inside attend); under torch.compile the mask is always passed (no read).
    inp_mask = real[:, :-1]
    if mask is None and not torch.compiler.is_compiling() and not bool((tokens == ignore_index).any()):
        inp_mask = None
    counted = real[:, 1:] & real[:, :-1]
    target = torch.where(counted, target, torch.full_like(target, ignore_index))
    embed_weight = float(next_embed_weight) if getattr(net, "add_continuous_pred_head", False) else 0.0
    if embed_weight:  # every position is read: the last one's embedding is the last continuous target
        inp = torch.where(real, tokens, torch.full_like(tokens, pad_value))
        inp_mask = None if inp_mask is None else real
        kwargs["return_next_embed_pred"] = True
    n_inp = inp.shape[1]
    if mask_prob > 0 and n_inp > 1:
        if "prepend_embeds" in kwargs:
            raise ValueError("mask_prob (a forgetful causal mask over the tokens) cannot be combined with prepend_embeds")
        rand = torch.randn(inp.shape, device=inp.device)
        rand[:, 0] = -torch.finfo(rand.dtype).max  # the first position is never hidden
        hidden = rand.topk(min(int(n_inp * mask_prob), n_inp - 1), dim=-1).indices
        keys = torch.ones_like(inp, dtype=torch.bool).scatter(1, hidden, False)  # (b, n - 1): keys every query may see
        kwargs["attn_mask"] = keys[:, None, :].expand(-1, n_inp, -1)
    out = net(inp, mask=inp_mask, return_intermediates=return_outputs, **kwargs)
    logits, intermediates = out if return_outputs else (out, None)
    if embed_weight:
        logits, (embed_pred, initial) = logits
        logits = logits[:, :-1]
    loss = safe_cross_entropy(logits, target, ignore_index=ignore_index)
    if embed_weight:
        loss = loss + next_embed_loss(embed_pred, initial, counted) * embed_weight
    return (loss, (logits, intermediates)) if return_outputs else loss


def next_embed_loss(next_embed_pred: Tensor, initial_embeds: Tensor, counted: Tensor) -> Tensor:
    """x-transformers' ``add_continuous_pred_head`` loss (its ``AutoregressiveWrapper``, weight
    ``next_embed_loss_weight = 0.1`` there): the L1 distance of each position's prediction of the next
    position's embedding, ``next_embed_pred[:, :-1]``, to that embedding, ``initial_embeds[:, 1:]``
    (detached), averaged over the features and the ``counted (b, n - 1)`` targets. Values at uncounted
    targets are selected away before any arithmetic; no counted target gives 0.0 with zero gradients.
    Computed in float32 at least.
    """
    if next_embed_pred.shape != initial_embeds.shape or next_embed_pred.dim() != 3:
        raise ValueError(f"next_embed_pred and initial_embeds must both be (b, n, c), got {_shape(next_embed_pred)} "
                         f"and {_shape(initial_embeds)}")
    b, n, _ = next_embed_pred.shape
    if counted.dtype != torch.bool or tuple(counted.shape) != (b, max(n - 1, 0)):
        raise ValueError(f"counted must be a bool tensor (b, n - 1) = ({b}, {max(n - 1, 0)}), got {_shape(counted)}")
    acc = torch.promote_types(next_embed_pred.dtype, torch.float32)
    sel = counted[..., None]
    pred = torch.where(sel, next_embed_pred[:, :-1].to(acc), 0.0)
    target = torch.where(sel, initial_embeds[:, 1:].detach().to(acc), 0.0)
    per = (pred - target).abs().mean(dim=-1)  # (b, n - 1)
    return per.sum() / counted.sum().clamp(min=1).to(acc)
