"""Direct preference optimisation (x-transformers' ``DPO``), on a safeformer ``TransformerWrapper``.

Shape legend: b batch (preference pairs), n sequence positions, v vocabulary size.
Masks follow the one convention (bool, True = real position; see ``masks.py``).

The loss (Rafailov et al., appendix B): for each pair, the mean log-probability of the counted targets
of the preferred and of the unpreferred sequence, under the trained policy and a frozen copy of it (the
reference), and ``-logsigmoid(beta * ((pi_w - pi_l) - (ref_w - ref_l)))``.

Which targets count: target ``t`` (predicted from position ``t - 1``) counts when position ``t`` is not
in the prompt (``prompt_mask`` False) and both ``t`` and ``t - 1`` are real (the sequence's mask, or
``seq != pad_id``). Ids at padded positions are never looked up, and the model sees the padding as
padding (masked), so left padding changes nothing. A pair in which either sequence has no counted
target does not count: it contributes exactly 0 (not NaN, not ``log 2``) and no gradient, and the loss
is the mean over the pairs that count (exactly 0, with zero gradients, when none does).

Differences from x-transformers: x-transformers reads ``prompt_mask`` and the sequence masks at the
predicting position (``mask[:, :-1]``), so it skips the first response token and counts the prediction
of the first padding token; and it averages pairs with no counted target in as ``log 2``. Giving
x-transformers the masks shifted left by one (``dpo_xt_masks``) makes the two agree on right-padded
batches (``tests/test_dpo.py``).
"""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.losses import safe_cross_entropy
from ..core.masks import check_token_ids, checked_once, validate_mask
from ..core.xt_helpers import exists, maybe_and_mask  # noqa: F401  (x-transformers' helpers of this module)
from ..interop.convert import register_converter
from ..stack.wrappers import TransformerWrapper

__all__ = ["DPO", "dpo_from_x_transformers", "dpo_xt_masks"]


_check_ids = check_token_ids


class DPO(Configurable, nn.Module):
    """x-transformers' ``DPO(model, beta=0.1, pad_id=None)``: the policy ``model`` and a frozen copy of it.

    Args:
        model: a causal ``TransformerWrapper`` (``attn_layers=Decoder(...)``), the policy to train.
        beta: the DPO temperature (> 0).
        pad_id: when given, positions holding ``pad_id`` are padding (unless a sequence mask is passed).

    ``parameters()`` yields the policy's parameters only (as in x-transformers), so an optimizer built
    from it never touches the reference.
    """

    def __init__(self, model: TransformerWrapper, *, beta: float = 0.1, pad_id: int | None = None):
        super().__init__()
        if not isinstance(model, TransformerWrapper):
            raise TypeError(f"model must be a safeformer TransformerWrapper, got {type(model).__name__} "
                            "(convert an x-transformers DPO with dpo_from_x_transformers)")
        if not model.attn_layers.causal:
            raise ValueError("model must be causal (attn_layers=Decoder(...)) for sequence log-probabilities")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (beta > 0 and beta < float("inf")):
            raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
        if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int)):
            raise TypeError(f"pad_id must be an int or None, got {pad_id!r}")
        self._set_config_from(DPO.__init__, locals())
        self.policy_model = model
        self.ref_model = deepcopy(model)
        for p in self.ref_model.parameters():
            p.requires_grad_(False)
        self.beta = float(beta)
        self.pad_id = pad_id

    def parameters(self, recurse: bool = True):
        return self.policy_model.parameters(recurse)

    def _real(self, seq: Tensor, seq_mask: Tensor | None, name: str) -> Tensor | None:
        if seq_mask is not None:
            validate_mask(seq_mask, name, shape=tuple(seq.shape), device=seq.device)
            return seq_mask
        if self.pad_id is not None:
            return seq != self.pad_id
        return None

    @staticmethod
    def _log_probs(model: TransformerWrapper, seq: Tensor, real: Tensor | None, counted: Tensor, kwargs) -> Tensor:
        """``(b, n - 1)`` log-probabilities of the targets ``seq[:, 1:]``, exactly 0 where not counted."""
        inp = seq[:, :-1]
        inp_mask = None if real is None else real[:, :-1]
        logits = model(inp, mask=inp_mask, **kwargs)  # (b, n - 1, v)
        target = torch.where(counted, seq[:, 1:], torch.full_like(seq[:, 1:], -100))
        return -safe_cross_entropy(logits, target, ignore_index=-100, reduction="none")

    @checked_once
    def forward(
        self,
        preferred_seq: Tensor,
        unpreferred_seq: Tensor,
        *,
        prompt_mask: Tensor,
        preferred_seq_mask: Tensor | None = None,
        unpreferred_seq_mask: Tensor | None = None,
        reduction: str = "mean",
        **net_kwargs,
    ) -> Tensor:
        """The DPO loss of ``b`` preference pairs.

        Args:
            preferred_seq, unpreferred_seq: ``(b, n)`` token ids (prompt then response), same shape.
            prompt_mask: ``(b, n)`` bool, True = a prompt position (its target never counts).
            preferred_seq_mask, unpreferred_seq_mask: ``(b, n)`` bool padding masks (True = real); by
                default ``seq != pad_id`` when ``pad_id`` is set, else every position is real.
            reduction: ``"mean"`` (over the pairs that count) or ``"none"`` (``(b,)``, 0 for a pair that
                does not count).
            net_kwargs: conditions passed to both models (``context``, ``context_mask``,
                ``prepend_embeds``, ``prepend_mask``, ``condition``, ...).

        Returns:
            the scalar loss (or ``(b,)`` losses with ``reduction="none"``).
        """
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        _check_ids(preferred_seq, "preferred_seq")
        _check_ids(unpreferred_seq, "unpreferred_seq")
        if preferred_seq.shape != unpreferred_seq.shape:
            raise ValueError(f"unpreferred_seq must have the shape of preferred_seq {tuple(preferred_seq.shape)}, "
                             f"got {tuple(unpreferred_seq.shape)}")
        if preferred_seq.shape[1] < 2:
            raise ValueError(f"preferred_seq needs at least 2 positions (a prompt token and a target), got {tuple(preferred_seq.shape)}")
        if not isinstance(prompt_mask, Tensor):
            raise TypeError(f"prompt_mask must be a bool tensor of shape {tuple(preferred_seq.shape)}, got {type(prompt_mask).__name__}")
        validate_mask(prompt_mask, "prompt_mask", shape=tuple(preferred_seq.shape), device=preferred_seq.device)
        sides = []
        for seq, seq_mask, name in ((preferred_seq, preferred_seq_mask, "preferred_seq_mask"),
                                    (unpreferred_seq, unpreferred_seq_mask, "unpreferred_seq_mask")):
            real = self._real(seq, seq_mask, name)
            counted = ~prompt_mask[:, 1:]
            if real is not None:
                counted = counted & real[:, 1:] & real[:, :-1]
            sides.append((seq, real, counted))
        pair_counts = sides[0][2].any(1) & sides[1][2].any(1)  # (b,): both sides have a counted target

        def mean_log_prob(model, seq, real, counted):
            lp = self._log_probs(model, seq, real, counted, net_kwargs)  # (b, n - 1), 0 where not counted
            return lp.sum(1) / counted.sum(1).clamp(min=1).to(lp.dtype)  # (b,)

        was_training = self.ref_model.training
        self.ref_model.eval()
        try:
            with torch.no_grad():
                ref_w, ref_l = (mean_log_prob(self.ref_model, *s) for s in sides)
        finally:
            self.ref_model.train(was_training)
        pol_w, pol_l = (mean_log_prob(self.policy_model, *s) for s in sides)
        logits = self.beta * ((pol_w - pol_l) - (ref_w - ref_l))
        logits = torch.where(pair_counts, logits, torch.zeros_like(logits))
        losses = torch.where(pair_counts, -F.logsigmoid(logits), torch.zeros_like(logits))  # (b,)
        if reduction == "none":
            return losses
        return losses.sum() / pair_counts.sum().clamp(min=1).to(losses.dtype)


def dpo_xt_masks(prompt_mask: Tensor, seq_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The masks to give x-transformers' ``DPO`` so that it counts the targets safeformer's ``DPO`` counts
    (x-transformers reads them at the predicting position): ``prompt_mask`` shifted left by one, and the
    sequence mask ``real[t] & real[t + 1]``. Returns ``(prompt_mask, seq_mask)``."""
    validate_mask(prompt_mask, "prompt_mask")
    shifted = torch.cat((prompt_mask[:, 1:], torch.zeros_like(prompt_mask[:, :1])), 1)
    if seq_mask is None:
        return shifted, None
    validate_mask(seq_mask, "seq_mask", shape=tuple(prompt_mask.shape), device=prompt_mask.device)
    return shifted, torch.cat((seq_mask[:, 1:] & seq_mask[:, :-1], torch.zeros_like(seq_mask[:, :1])), 1)


def dpo_from_x_transformers(xt_dpo) -> DPO:
    """Convert an x-transformers ``DPO`` (its policy and its reference, each through
    ``from_x_transformers``), with ``beta`` and ``pad_id``."""
    from ..interop.convert import from_x_transformers

    for attr in ("policy_model", "ref_model", "beta", "pad_id"):
        if not hasattr(xt_dpo, attr):
            raise TypeError(f"expected an x_transformers DPO, got {type(xt_dpo).__name__} (no {attr!r})")
    policy = from_x_transformers(xt_dpo.policy_model)
    dpo = DPO(policy, beta=xt_dpo.beta, pad_id=xt_dpo.pad_id)
    ref = from_x_transformers(xt_dpo.ref_model)
    dpo.ref_model.load_state_dict(ref.state_dict())
    return dpo


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.dpo", "DPO", dpo_from_x_transformers)
