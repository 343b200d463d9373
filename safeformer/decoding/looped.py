"""A looped net (``TransformerWrapper(looped=True)``) under ``AutoregressiveWrapper``: x-transformers' looped loss,
and the net call that decodes it with ``looped_inference`` (and keeps the last KV cache, for
``generate(return_intermediates=True)``).

Shape legend: b batch, n positions, L loop steps, v vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.cache import LayerIntermediates
from ..core.losses import next_token_loss, safe_cross_entropy

__all__ = ["NetCall", "looped_call", "looped_loss"]


def looped_loss(wrapper, x: Tensor, mask: Tensor | None, return_outputs: bool, kwargs: dict):
    """x-transformers' looped loss (see ``AutoregressiveWrapper``'s ``looped_loss_threshold_exit``) over the net's
    ``all_pred_logits`` and ``exit_logits``; uncounted targets are selected away before any arithmetic.
    ``wrapper``: the ``AutoregressiveWrapper`` (its net and its loss options)."""
    if getattr(wrapper.net, "add_continuous_pred_head", False):
        raise ValueError("a looped net with add_continuous_pred_head: the looped loss does not take the continuous "
                         "loss (train one or the other)")
    ignore_index = wrapper.ignore_index
    found: dict = {}  # the runs' logits and exit logits, without the intermediates (the explicit path)
    res = next_token_loss(wrapper.net, x, mask, ignore_index, wrapper.pad_value, mask_prob=wrapper.mask_prob,
                          return_outputs=return_outputs, looped_pred_all_logits=True, _loop_out=found, **kwargs)
    logits, inter = res[1] if return_outputs else (None, None)
    real = x != ignore_index
    if mask is not None:
        real = real & mask
    counted = real[:, 1:] & real[:, :-1]  # (b, n - 1), as next_token_loss counts them
    target = torch.where(counted, x[:, 1:], ignore_index)
    k = counted.shape[1]
    preds = torch.stack([t[:, :k] for t in found["all_pred_logits"]], dim=1)  # (b, L, n - 1, v)
    exits = torch.stack([t[:, :k, 0] for t in found["exit_logits"]], dim=1).float()  # (b, L, n - 1)
    steps = preds.shape[1]
    targets = target[:, None].expand(-1, steps, -1)
    losses = safe_cross_entropy(preds, targets, ignore_index=ignore_index, reduction="none")  # (b, L, n - 1)
    sel = counted[:, None].expand(-1, steps, -1)
    exits = torch.where(sel, exits, 0.0)
    with torch.no_grad():
        change = losses[:, 1:] - losses[:, :-1]
        exit_target = torch.sigmoid(wrapper.looped_loss_slope * (change + wrapper.looped_loss_threshold_exit))
        cont = F.logsigmoid(-exits)
        cum_continue = torch.cat((torch.zeros_like(cont[:, :1]), cont[:, :-1]), dim=1).cumsum(dim=1)
        step_exit = torch.cat((F.logsigmoid(exits[:, :-1]), torch.zeros_like(exits[:, :1])), dim=1)  # last: exit
        exit_probs = (step_exit + cum_continue).exp()
    exit_loss = F.binary_cross_entropy_with_logits(exits[:, :-1], exit_target, reduction="none")
    exit_loss = torch.where(sel[:, 1:], exit_loss, 0.0).sum() / sel[:, 1:].sum().clamp(min=1)
    loss = torch.where(sel, losses * exit_probs, 0.0).sum() / sel.sum().clamp(min=1)
    loss = loss + exit_loss * wrapper.looped_exit_loss_weight
    return (loss, (logits, inter)) if return_outputs else loss


class NetCall:
    """The net with fixed forward keywords (a looped net's settings) for the decode engine, keeping the last KV cache
    it returned (``generate(return_intermediates=True)``). Not a ``TransformerWrapper``: the engine calls the net's
    forward with these keywords; after the prompt it decodes on the static step with the same loop settings
    (``static_net`` / ``static_loop``, ``decoding/static.py``), or on the dynamic cache when it must keep it."""

    static_refusal = "generate(return_intermediates=True) returns the dynamic KV cache"

    def __init__(self, net, kwargs: dict, keep_cache: bool = True):
        self.net, self.kwargs, self.cache, self.keep_cache = net, kwargs, None, keep_cache

    @property
    def static_net(self):
        """The wrapper the static step runs, ``None`` when the dynamic cache must be kept (``static_refusal``)."""
        return None if self.keep_cache else self.net

    @property
    def static_loop(self) -> dict | None:
        """The loop settings of the forward keywords (``build_static_cache``'s ``loop``), ``None`` for a net that
        is not looped."""
        if not getattr(self.net, "looped", False):
            return None
        kw = self.kwargs
        return self.net._loop_settings(kw.get("looped_steps"), kw.get("max_looped_steps"), None,
                                       kw.get("looped_inference", False), kw.get("looped_exit_prob_threshold", 0.9))

    static_read = None

    def __call__(self, *args, **kwargs):
        out = self.net(*args, **kwargs, **self.kwargs)
        if kwargs.get("return_cache"):
            self.cache = out[1]
        return out

    def __getattr__(self, name: str):
        return getattr(self.net, name)

    def intermediates(self) -> LayerIntermediates:
        kv = self.cache
        return LayerIntermediates(cache=kv, exit_indices=None if kv is None else kv.exit_indices,
                                  looped_prompt_kv_cache=None if kv is None else kv.looped_prompt_kv)


def looped_call(net, looped_steps, max_looped_steps, looped_exit_prob_threshold,
                return_intermediates) -> NetCall | None:
    """What ``generate`` decodes: ``None`` (the net itself), or a ``NetCall`` with a looped net's settings (checked
    here) or keeping the KV cache for ``return_intermediates`` (a bool, checked first)."""
    if not isinstance(return_intermediates, bool):
        raise TypeError(f"return_intermediates must be True or False, got {return_intermediates!r}")
    net_kwargs = {}
    if getattr(net, "looped", False):
        net_kwargs = dict(looped_inference=True, looped_steps=looped_steps, max_looped_steps=max_looped_steps,
                          looped_exit_prob_threshold=looped_exit_prob_threshold)
        net._loop_settings(looped_steps, max_looped_steps, None, True, looped_exit_prob_threshold)  # checks
    elif looped_steps is not None or max_looped_steps is not None or looped_exit_prob_threshold != 0.9:
        raise ValueError("looped_steps, max_looped_steps and looped_exit_prob_threshold are for a net built with "
                         "looped=True")
    return NetCall(net, net_kwargs, return_intermediates) if net_kwargs or return_intermediates else None
