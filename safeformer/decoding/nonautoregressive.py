"""Non-autoregressive (masked-token) modelling, MaskGIT / MUSE style, with classifier-free guidance.

Training hides a random fraction of each sample's real tokens behind ``mask_id`` (the fraction drawn
from the schedule) and scores the model's predictions of the hidden tokens only. Generation starts from
an all-hidden sequence and, over ``steps`` parallel steps, predicts every hidden position, keeps the
most confident predictions and hides the others again, until nothing is hidden.

Shape legend: b batch, n positions, v logits (vocabulary), j context length, m prefix length,
K adaptive-condition width, r guidance branches.
Masks follow the one convention (bool, True = real position; see ``masks.py``). Note the two meanings
of "mask" here: ``mask`` is always the padding mask; hidden tokens are "hidden" (they hold ``mask_id``).

The schedule ``gamma(r)`` maps the fraction of the way through ``r`` in ``[0, 1]`` to the fraction of
real tokens hidden: ``"cosine"`` is ``cos(pi r / 2)`` (MaskGIT), ``"linear"`` is ``1 - r``; any callable
on a float tensor with values in ``[0, 1]`` works. After step ``s`` of ``S``,
``floor(gamma((s + 1) / S) * n_real)`` tokens stay hidden (at least one token is revealed per step, and
none stays hidden after the last).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.conditions import (
    CONDITION_KINDS,
    Conditions,
    GuidanceSchedule,
    check_drop_kinds,
    condition_kwargs,
    drop_conditions,
    drop_probabilities,
)
from ..core.losses import safe_cross_entropy
from ..core.masks import check_token_ids, checked_once, validate_mask
from ..stack.wrappers import TransformerWrapper
from .continuous import (
    _check_count,
    _check_guidance_rescale,
    _check_prob,
    _check_temperature,
    _conditions_of,
    _negatives,
)
from .decode import GuidedForward
from .generation import _resolve_filter, check_pad_value, guided_logits_combine, sample_logits

__all__ = ["NonAutoregressiveWrapper", "Losses"]

_IGNORE = -100
_NEG_INF = float("-inf")


class Losses(NamedTuple):
    """What ``NonAutoregressiveWrapper.forward`` returns (x-transformers' ``Losses`` namedtuple).

    Attributes:
        loss: the loss to train on (``loss.backward()``).
        generator_loss: the masked-token loss; the same tensor as ``loss`` (safeformer has no token critic).
        critic_loss: x-transformers' token-critic loss; always ``None`` here.
    """

    loss: Tensor
    generator_loss: Tensor | None
    critic_loss: Tensor | None


def cosine_schedule(r: Tensor) -> Tensor:
    """``cos(pi r / 2)``: the fraction of tokens hidden at time ``r`` (MaskGIT, arXiv 2202.04200)."""
    return torch.cos(r * (math.pi / 2))


def linear_schedule(r: Tensor) -> Tensor:
    """``1 - r``."""
    return 1.0 - r


SCHEDULES: dict[str, Callable[[Tensor], Tensor]] = {"cosine": cosine_schedule, "linear": linear_schedule}


def _resolve_schedule(schedule) -> Callable[[Tensor], Tensor]:
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)} or a callable, got {schedule!r}")
        return SCHEDULES[schedule]
    if not callable(schedule):
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)} or a callable, got {schedule!r}")
    probe = torch.linspace(0.0, 1.0, 65, dtype=torch.float64)
    try:
        vals = schedule(probe)
    except Exception as err:  # noqa: BLE001 - any failure is the schedule's
        raise ValueError(f"schedule must map a float tensor of times in [0, 1] to fractions; calling it failed: {err}") from err
    if not isinstance(vals, Tensor) or vals.shape != probe.shape or not vals.is_floating_point():
        raise ValueError(f"schedule must return a float tensor of the shape of its input, got {getattr(vals, 'shape', type(vals))}")
    if not bool(torch.isfinite(vals).all()) or bool(((vals < 0) | (vals > 1)).any()):
        raise ValueError("schedule must return fractions in [0, 1] for times in [0, 1] (got values outside, or NaN/inf)")
    return schedule


def hidden_counts(schedule: Callable[[Tensor], Tensor], steps: int, n_real: Tensor) -> Tensor:
    """``(steps, b)``: how many of each sample's ``n_real (b,)`` tokens stay hidden after each step,
    ``floor(gamma((s + 1) / steps) * n_real)``, 0 after the last step (before the at-least-one-revealed
    rule, which depends on what is still hidden)."""
    times = torch.arange(1, steps + 1, dtype=torch.float64) / steps
    frac = schedule(times).to(torch.float64).clamp(0.0, 1.0).to(n_real.device)  # (steps,)
    counts = torch.floor(frac[:, None] * n_real[None].to(torch.float64)).long()
    counts[-1] = 0
    return torch.minimum(counts, n_real[None])


MDLM_WEIGHT_MAX = 1e6


def mdlm_loss_weight(schedule_fn: Callable[[Tensor], Tensor], r: Tensor) -> Tensor:
    """The continuous-time MDLM weight ``-gamma'(r) / gamma(r)`` of times ``r (b,)`` (float64), with
    ``gamma`` the hidden fraction: the derivative by autograd, the weight clamped to ``[0, 1e6]`` (a schedule
    that reaches 0, or rises somewhere, gives a finite, non-negative weight)."""
    t = r.detach().double().requires_grad_(True)
    with torch.enable_grad():
        g = schedule_fn(t)
        (dg,) = torch.autograd.grad(g.sum(), t, allow_unused=True)
    if dg is None:  # a constant schedule: no change of the hidden fraction, no weight
        return torch.zeros_like(r, dtype=torch.float64)
    g = g.detach().clamp(min=0.0)
    w = torch.where(g > 0, -dg / g.clamp(min=torch.finfo(torch.float64).tiny), torch.full_like(g, MDLM_WEIGHT_MAX))
    return torch.nan_to_num(w, nan=0.0, posinf=MDLM_WEIGHT_MAX).clamp(0.0, MDLM_WEIGHT_MAX)


class NonAutoregressiveWrapper(Configurable, nn.Module):
    """Masked-token training and iterative parallel decoding (MaskGIT) around a bidirectional
    ``TransformerWrapper``, with every kind of condition droppable and guided.

    Args:
        net: a ``TransformerWrapper`` whose layers are an ``Encoder`` (not causal). Its vocabulary
            holds ``mask_id``; its outputs (``logits_dim``, default ``num_tokens``) are the tokens it
            can produce, and ``mask_id`` is never produced (its logit is banned when it has one).
        mask_id: the id of the hidden token, in ``[0, num_tokens)``. Real tokens may not hold it.
        steps: default number of decoding steps (>= 1).
        schedule: ``"cosine"`` (default), ``"linear"`` or a callable ``gamma(r)`` (see module doc).
        pad_value: the id written at padded positions of ``generate``'s output (not ``mask_id``).
        cond_drop_prob: during training, the probability of dropping each sample's condition: one
            number for every kind given, or ``{"context": p_c, "prepend": p_p, "condition": p_a}``.
        cond_drop_all_prob: in addition, the probability that a sample loses every condition at once.
        use_simple_mdlm_loss_weight: weight each sample's loss by the continuous-time MDLM weight of its
            time ``r`` (Sahoo et al., arXiv 2406.07524): ``-gamma'(r) / gamma(r)`` (``1 / (1 - r)`` for the
            linear schedule), ``gamma'`` by autograd in float64, clamped to ``[0, 1e6]``. x-transformers'
            option of the same name (on by default there) computes ``gamma'(r) / (1 - gamma(r))``, which is
            negative for every decreasing schedule (its loss falls as the cross-entropy rises); safeformer
            keeps the paper's sign and denominator, and leaves it off by default.

    Example:
        >>> net = TransformerWrapper(num_tokens=18, logits_dim=17, max_seq_len=64,
        ...     attn_layers=Encoder(dim=128, depth=4, heads=4, cross_attend=True, dim_context=10))
        >>> model = NonAutoregressiveWrapper(net, mask_id=17, cond_drop_prob=0.2)
        >>> model(images, context=label, context_mask=label_mask).loss.backward()
        >>> samples = model.generate(seq_len=64, context=label, cond_scale=3.0)   # (b, 64), no 17 left
    """

    def __init__(
        self,
        net: TransformerWrapper,
        *,
        mask_id: int,
        steps: int = 18,
        schedule: str | Callable[[Tensor], Tensor] = "cosine",
        pad_value: int = 0,
        cond_drop_prob: float | dict[str, float] = 0.0,
        cond_drop_all_prob: float = 0.0,
        use_simple_mdlm_loss_weight: bool = False,
    ):
        super().__init__()
        if not isinstance(net, TransformerWrapper):
            raise TypeError(f"net must be a TransformerWrapper, got {type(net).__name__}")
        if not isinstance(use_simple_mdlm_loss_weight, bool):
            raise TypeError(f"use_simple_mdlm_loss_weight must be a bool, got {use_simple_mdlm_loss_weight!r}")
        if net.attn_layers.causal:
            raise ValueError("net must be bidirectional (attn_layers=Encoder(...)): a masked-token model reads both sides")
        if net.return_only_embed:
            raise ValueError("net must return logits (return_only_embed=False)")
        v = net.num_tokens
        if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < v:
            raise ValueError(f"mask_id must be a token id in [0, num_tokens={v}), got {mask_id!r}")
        logits_dim = self._logits_dim(net)
        if logits_dim > v:
            raise ValueError(f"the net's logits_dim={logits_dim} exceeds num_tokens={v}: generated ids must be valid inputs")
        if logits_dim - (1 if mask_id < logits_dim else 0) < 1:
            raise ValueError(f"the net can produce no token but mask_id={mask_id} (logits_dim={logits_dim})")
        _check_count(steps, "steps", 1)
        schedule_fn = _resolve_schedule(schedule)
        check_pad_value(pad_value)
        if pad_value == mask_id:
            raise ValueError(f"pad_value must differ from mask_id={mask_id} (no mask_id is left in an output)")
        probs = drop_probabilities(cond_drop_prob)
        check_drop_kinds(net.attn_layers, cond_drop_prob)
        _check_prob(cond_drop_all_prob, "cond_drop_all_prob")
        self._set_config_from(NonAutoregressiveWrapper.__init__, locals())
        self.net = net
        self.mask_id = mask_id
        self.steps = steps
        self.schedule = schedule
        self.schedule_fn = schedule_fn
        self.use_simple_mdlm_loss_weight = use_simple_mdlm_loss_weight
        self.pad_value = pad_value
        self.num_tokens = v
        self.logits_dim = logits_dim
        self.cond_drop_probs = probs
        self.cond_drop_prob = max(probs.values())
        self.cond_drop_all_prob = float(cond_drop_all_prob)
        self.max_seq_len = net.max_seq_len

    def get_config(self) -> dict[str, Any]:
        if not isinstance(self.schedule, str):
            raise ValueError("this wrapper's schedule is a callable, which a checkpoint (JSON) cannot hold: save the "
                             "net (model.net.save_pretrained(...)) and rebuild the wrapper with the same schedule")
        return super().get_config()

    @staticmethod
    def _logits_dim(net: TransformerWrapper) -> int:
        return net.num_tokens if net.to_logits is None else net.to_logits.out_features

    def _check_tokens(self, x, mask, name: str = "x") -> None:
        check_token_ids(x, name)
        if mask is not None:
            validate_mask(mask, "mask", shape=tuple(x.shape), device=x.device)
        real = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
        bad = real & ((x < 0) | (x >= self.logits_dim) | (x == self.mask_id))
        if x.numel() and bool(bad.any()):  # one host sync per training step
            where = tuple(bad.nonzero()[0].tolist())
            tok = int(x[where])
            why = (f"mask_id={self.mask_id} (the hidden token) at a real position" if tok == self.mask_id else
                   f"{tok}, outside the tokens the net can predict [0, logits_dim={self.logits_dim})")
            raise ValueError(f"{name} holds {why} at {where}; padded positions (mask False) may hold anything")

    # ------------------------------------------------------------------------------------------------
    # training
    # ------------------------------------------------------------------------------------------------

    def hide_tokens(self, x: Tensor, mask: Tensor | None = None, *,
                    generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Hide a random fraction of each sample's real tokens (the training corruption).

        Per sample a time ``r ~ U(0, 1)`` is drawn, and ``max(1, ceil(gamma(r) * n_real))`` of its real
        tokens (all of them at most; none when it has none) are chosen uniformly and replaced by
        ``mask_id``. Padded positions are never chosen.

        Returns:
            ``(hidden_x (b, n), hidden (b, n) bool)``: the corrupted ids and which positions were hidden.
        """
        return self._hide(x, mask, generator)[:2]

    def _hide(self, x: Tensor, mask: Tensor | None, generator) -> tuple[Tensor, Tensor, Tensor]:
        """``hide_tokens``'s result and the times ``r (b,)`` drawn (float64)."""
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise ValueError(f"x must be token ids of shape (b, n), got {getattr(x, 'shape', type(x))}")
        b, n = x.shape
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
        real = torch.ones(b, n, dtype=torch.bool, device=x.device) if mask is None else mask
        n_real = real.sum(dim=1)  # (b,)
        draw_on = x.device if generator is None else generator.device
        r = torch.rand(b, generator=generator, device=draw_on).to(x.device)
        frac = self.schedule_fn(r.double()).clamp(0.0, 1.0)
        k = torch.ceil(frac * n_real.double()).long().clamp(min=1)
        k = torch.minimum(k, n_real)
        scores = torch.rand(b, n, generator=generator, device=draw_on).to(x.device)
        scores = torch.where(real, scores, 2.0)  # padding ranks last, never chosen
        rank = scores.argsort(dim=1).argsort(dim=1)
        hidden = (rank < k[:, None]) & real
        return torch.where(hidden, torch.full_like(x, self.mask_id), x), hidden, r.double()

    @checked_once
    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        prepend_embeds: Tensor | None = None,
        prepend_mask: Tensor | None = None,
        condition: Tensor | None = None,
        condition_mask: Tensor | None = None,
        reduction: str = "mean",
        generator: torch.Generator | None = None,
        **conditions,
    ) -> Losses:
        """Masked-token cross-entropy of ``x (b, n)``.

        Args:
            x: token ids; real ones in ``[0, logits_dim)`` and not ``mask_id``; padded positions may hold
                anything (they are never looked up, hidden or scored).
            mask: ``(b, n)`` padding mask (True = real).
            context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask: the
                conditions (see ``conditions.py``); in training mode each is dropped per sample
                (``cond_drop_prob``, ``cond_drop_all_prob``).
            reduction: ``"mean"`` over hidden real positions (exactly 0 with zero gradient when none is
                hidden: an all-padding batch), ``"sum"``, or ``"none"``: ``(b, n)``, exactly 0 at
                positions not hidden.
            generator: the random source of the hiding (``hide_tokens``) and of condition dropping.

        Returns:
            ``Losses(loss, generator_loss, critic_loss)`` (x-transformers' namedtuple): train on ``.loss``;
            ``generator_loss`` is the same tensor and ``critic_loss`` is ``None`` (no token critic).
        """
        conditions = condition_kwargs("NonAutoregressiveWrapper.forward", conditions)
        self._check_tokens(x, mask)
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        b = x.shape[0]
        conds = _conditions_of(self.net, b, x.device, {**locals(), **conditions})
        if self.training and (self.cond_drop_prob > 0 or self.cond_drop_all_prob > 0):
            conds, _ = drop_conditions(conds, self.cond_drop_probs, all_prob=self.cond_drop_all_prob, generator=generator)
        inp, hidden, r = self._hide(x, mask, generator)
        logits = self.net(inp, mask=mask, **conds.kwargs())  # (b, n, v)
        target = torch.where(hidden, x, torch.full_like(x, _IGNORE))
        if not self.use_simple_mdlm_loss_weight:
            loss = safe_cross_entropy(logits, target, ignore_index=_IGNORE, reduction=reduction)
            return Losses(loss, loss, None)
        per = safe_cross_entropy(logits, target, ignore_index=_IGNORE, reduction="none")  # (b, n), 0 where not hidden
        per = per * mdlm_loss_weight(self.schedule_fn, r).to(per.dtype)[:, None]
        if reduction == "none":
            return Losses(per, per, None)
        total = per.sum()
        loss = total if reduction == "sum" else total / hidden.sum().clamp(min=1).to(per.dtype)
        return Losses(loss, loss, None)

    # ------------------------------------------------------------------------------------------------
    # generation
    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, batch_size: int | None = None, seq_len: int | None = None, *, mask: Tensor | None = None,
        context: Tensor | None = None, context_mask: Tensor | None = None, prepend_embeds: Tensor | None = None,
        prepend_mask: Tensor | None = None, condition: Tensor | None = None, condition_mask: Tensor | None = None,
        cond_scale: float | Mapping[str, float] | Callable[[int], float | Mapping[str, float]] = 1.0,
        guidance_rescale: float = 0.0, guidance_interval: tuple[int, int] | None = None, guidance_space: str = "logits",
        negative_context: Tensor | None = None, negative_context_mask: Tensor | None = None,
        negative_prepend_embeds: Tensor | None = None, negative_prepend_mask: Tensor | None = None,
        negative_condition: Tensor | None = None, temperature: float = 1.0, choice_temperature: float = 0.0,
        filter_logits_fn: Callable[..., Tensor] | str | None = None, filter_kwargs: dict[str, Any] | None = None,
        steps: int | None = None, **conditions,
    ) -> Tensor:
        """Iterative parallel decoding (MaskGIT), optionally with classifier-free guidance.

        Args:
            batch_size: how many samples (default: the conditions' batch size).
            seq_len: positions per sample (default: the net's ``max_seq_len``).
            mask: ``(b, seq_len)`` which positions exist (True); padded ones hold ``pad_value`` in the
                output. Default: all.
            context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask: the
                conditions. A sample whose context (or prefix) is all masked is simply unconditional.
            cond_scale: a number (``uncond + s * (joint - uncond)``; 1.0 runs one branch, 0.0 is
                unconditional), a mapping ``{"joint": s, "context": s_c, "prepend": s_p,
                "condition": s_a}``, or a callable ``step -> number | mapping``. Every branch runs in one
                batched forward per step; the logits are combined by ``compose_guidance``.
            guidance_rescale, guidance_interval, guidance_space: as in ``AutoregressiveWrapper.generate``
                (the interval counts decoding steps).
            negative_*: the unconditional branch's conditions in place of the dropped ones.
            temperature: sampling temperature of each hidden position (0 = argmax).
            choice_temperature: Gumbel noise on the confidences that decide what stays (MaskGIT's
                randomised choice), annealed to 0 over the steps; 0 keeps exactly the most confident.
            filter_logits_fn, filter_kwargs: ``top_k`` / ``top_p`` / ``min_p`` (or a callable) on each
                position's guided logits, after the temperature (see ``sample_logits``).
            steps: decoding steps (default: the wrapper's ``steps``).

        Returns:
            ``(b, seq_len)`` token ids; none is ``mask_id``.
        """
        conditions = condition_kwargs("NonAutoregressiveWrapper.generate", conditions, negatives=True)
        device = next(self.net.parameters()).device
        d = _prepare_generate(self, {**locals(), **conditions}, device)
        if d.b == 0:  # nothing to generate: empty in, empty out
            return torch.full((0, d.n), self.pad_value, dtype=torch.long, device=device)
        real = torch.ones(d.b, d.n, dtype=torch.bool, device=device) if mask is None else mask
        counts = hidden_counts(self.schedule_fn, d.steps, real.sum(1))  # (steps, b)
        was_training = self.training
        self.eval()
        try:
            engine = GuidedForward(self.net, d.b, d.conds, d.negatives, d.schedule,
                                   guided_logits_combine(d.schedule, d.guidance_rescale, d.guidance_space),
                                   need_joint=d.guidance_rescale > 0, cache_kv=False, read="all", steps=d.steps)
            seq = _reveal(self, engine, d, real, mask, counts)
        finally:
            self.train(was_training)
        return torch.where(real, seq, torch.full_like(seq, self.pad_value))


@dataclass(frozen=True)
class _Decoding:
    """A checked ``NonAutoregressiveWrapper.generate`` call: its size, steps, sampling options and guidance."""

    b: int
    n: int
    steps: int
    temperature: float
    choice_temperature: float
    guidance_rescale: float
    guidance_space: str
    filter_fn: Callable[..., Tensor] | None
    filter_kwargs: dict[str, Any] | None
    conds: Conditions
    negatives: Conditions
    schedule: GuidanceSchedule


def _batch_size(given: Conditions, batch_size) -> int:
    """The batch size: ``batch_size``, or the conditions' when it is None (the two must agree), checked."""
    sized = [(CONDITION_KINDS[k].value, t) for k, t in ((k, given.pair(k)[0]) for k in given.kinds())
             if isinstance(t, Tensor) and t.dim() >= 1]
    b, source = (int(sized[0][1].shape[0]), sized[0][0]) if sized else (None, None)
    if batch_size is None:
        if b is None:
            raise ValueError("batch_size is needed when no condition gives the batch size")
        batch_size = b
    batch_size = _check_count(batch_size, "batch_size", 0)
    if b is not None and b != batch_size:
        raise ValueError(f"batch_size={batch_size} but {source} holds {b} samples")
    return batch_size


def _prepare_generate(wrapper, kw: Mapping, device) -> _Decoding:
    """Every check of ``generate``'s arguments ``kw`` (its keywords), in order: the checked call."""
    b = _batch_size(Conditions.from_kwargs(kw), kw["batch_size"])
    seq_len, steps, mask = kw["seq_len"], kw["steps"], kw["mask"]
    n = wrapper.max_seq_len if seq_len is None else _check_count(seq_len, "seq_len", 1)
    if wrapper.net.pos_emb is not None and n > wrapper.max_seq_len:
        raise ValueError(f"seq_len={n} is more than the model's max_seq_len={wrapper.max_seq_len}")
    steps = wrapper.steps if steps is None else _check_count(steps, "steps", 1)
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n), device=device)
    temperature = _check_temperature(kw["temperature"])
    choice_temperature = _check_temperature(kw["choice_temperature"], "choice_temperature")
    guidance_rescale = _check_guidance_rescale(kw["guidance_rescale"])
    guidance_space = kw["guidance_space"]
    if guidance_space not in ("logits", "logprobs"):
        raise ValueError(f"guidance_space must be 'logits' or 'logprobs', got {guidance_space!r}")
    filter_fn, filter_kwargs = _resolve_filter(kw["filter_logits_fn"]), kw["filter_kwargs"]
    if filter_kwargs is not None and filter_fn is None:
        raise ValueError("filter_kwargs was given without filter_logits_fn; name the filter it is for")
    conds = _conditions_of(wrapper.net, b, device, kw)
    negatives = _negatives(wrapper.net, b, device, kw)
    conds = conds.with_empty_for(negatives, b)
    schedule = GuidanceSchedule.build(kw["cond_scale"], conds.kinds(), kw["guidance_interval"], guidance_rescale,
                                      has_uncond=bool(conds.kinds()), steps=steps)
    return _Decoding(b, n, steps, temperature, choice_temperature, guidance_rescale, guidance_space, filter_fn,
                     filter_kwargs, conds, negatives, schedule)


def _reveal(wrapper, engine: GuidedForward, d: _Decoding, real: Tensor, mask: Tensor | None, counts: Tensor) -> Tensor:
    """MaskGIT's loop: each step every hidden position is predicted (guided), the most confident predictions are kept
    and the others hidden again, ``counts[s] (b,)`` of them (at least one revealed per step); returns ``(b, n)``."""
    b, n, steps, device = d.b, d.n, d.steps, real.device
    seq = torch.full((b, n), wrapper.mask_id, dtype=torch.long, device=device)
    hidden = real.clone()
    for s in range(steps):
        logits = engine(seq, mask, None, s)  # (b, n, v), every branch in one batched forward
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if wrapper.mask_id < logits.shape[-1]:
            logits[..., wrapper.mask_id] = _NEG_INF  # the hidden token is never produced
        flat = logits.reshape(b * n, -1)
        sampled = sample_logits(flat, d.temperature, d.filter_fn, d.filter_kwargs).reshape(b, n)
        # confidence: the guided probability of the token drawn (the most confident stay)
        conf = flat.softmax(dim=-1).gather(1, sampled.reshape(-1, 1)).reshape(b, n)
        if d.choice_temperature > 0:
            u = torch.rand(conf.shape, device=device, dtype=conf.dtype).clamp(1e-20, 1.0 - 1e-7)
            gumbel = -torch.log((-torch.log(u)).clamp(min=1e-20))  # finite: u in (0, 1)
            conf = torch.log(conf.clamp(min=1e-38)) + d.choice_temperature * (1.0 - (s + 1) / steps) * gumbel
        conf = torch.where(hidden, conf, float("inf"))  # revealed tokens and padding stay
        k = torch.minimum(counts[s], (hidden.sum(1) - 1).clamp(min=0))  # reveal at least one per step
        rank = conf.argsort(dim=1, stable=True).argsort(dim=1)
        still = (rank < k[:, None]) & hidden
        seq = torch.where(hidden & ~still, sampled, seq)
        seq = torch.where(still, torch.full_like(seq, wrapper.mask_id), seq)
        hidden = still
    return seq
