"""x-transformers' multi-step (rollout) loss of ``ContinuousAutoregressiveWrapper`` (``forward(rollout_steps=k)``,
``k >= 2``): from a random cut of each sample's real steps the model predicts ``k`` steps, each fed back as the next
input, scored against the real steps that follow.

Shape legend: b batch, n positions of ``x``, d = dim_in features, k rollout steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.conditions import Conditions
from .decode import last_real

__all__ = ["rollout_loss"]


def _histories(x: Tensor, mask: Tensor | None, steps: int, generator):
    """Each sample's real steps compacted to the left, a cut drawn per sample, and from them ``(seq (b, h, d),
    seq_mask (b, h), targets (b, k, d), counted (b, k))``: the right-padded histories before the cuts, the ``k``
    steps after them, and which samples are long enough to count (more than ``k`` real steps)."""
    b, n, d = x.shape
    device = x.device
    real = torch.ones(b, n, dtype=torch.bool, device=device) if mask is None else mask
    lengths = real.sum(1)  # (b,)
    # the real steps first, in order (any padding layout): x compacted to the left
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices
    xc = torch.where(real[..., None], x, 0.0).gather(1, order[..., None].expand(-1, -1, d))
    valid = lengths > steps  # (b,): at least one history step and ``steps`` targets
    span = (lengths - steps).clamp(min=1)  # cuts 1 .. L - k
    u = torch.rand(b, generator=generator, device=device)
    cut = torch.where(valid, 1 + (u * span).floor().long().clamp(max=span - 1), torch.ones_like(lengths))
    hist = int(cut.max()) if b else 1
    ar = torch.arange(hist, device=device)
    seq, seq_mask = xc[:, :hist], ar[None] < cut[:, None]  # right-padded histories
    tidx = (cut[:, None] + torch.arange(steps, device=device)[None]).clamp(max=n - 1)  # (b, k)
    targets = xc.gather(1, tidx[..., None].expand(-1, -1, d))
    counted = valid[:, None].expand(b, steps)
    return seq, seq_mask, targets, counted


def rollout_loss(wrapper, x: Tensor, mask: Tensor | None, conds: Conditions, steps, reduction: str,
                 generator) -> Tensor:
    """The ``steps``-step rollout loss (see ``ContinuousAutoregressiveWrapper.forward``); ``wrapper``: the
    ``ContinuousAutoregressiveWrapper`` (its model, its split of the head, its sampling and its loss)."""
    b = x.shape[0]
    seq, seq_mask, targets, counted = _histories(x, mask, steps, generator)
    preds = []
    kw = conds.kwargs()
    for t in range(steps):
        out = wrapper._model(seq, mask=seq_mask, **kw)
        last = last_real(out, seq_mask)  # (b, dim_out)
        preds.append(last)
        if t + 1 < steps:
            mean, log_var = wrapper._split(last)
            nxt = mean if log_var is None else wrapper._draw(mean, log_var, 1.0, generator).detach()
            nxt = nxt.to(x.dtype)[:, None]
            seq = torch.cat((seq, nxt), dim=1)
            seq_mask = torch.cat((seq_mask, torch.ones(b, 1, dtype=torch.bool, device=x.device)), dim=1)
    out = torch.stack(preds, dim=1)  # (b, k, dim_out)
    per = wrapper._per_target(out, targets, counted)
    acc = torch.promote_types(out.dtype, torch.float32)
    return wrapper._reduce(per, counted, reduction, acc)
