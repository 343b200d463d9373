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

x-transformers' further options: BERT's corruption of the hidden tokens (``no_replace_prob``,
``random_token_prob``), self-conditioning on the previous embeddings (``self_cond``), a token critic
(``token_critic``, ``self_token_critic``) that learns which sampled tokens are wrong and, at generation,
decides which tokens are hidden again, and re-hiding tokens already revealed (``can_mask_prev_unmasked``).
Randomness follows x-transformers' draws: without a ``generator`` the coin flips come from Python's
``random`` and the tensors from torch's global generator, in x-transformers' order; with one, everything
is drawn from it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
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

__all__ = ["NonAutoregressiveWrapper", "Losses", "SelfCritic"]

_IGNORE = -100
_NEG_INF = float("-inf")


class Losses(NamedTuple):
    """What ``NonAutoregressiveWrapper.forward`` returns (x-transformers' ``Losses`` namedtuple).

    Attributes:
        loss: the loss to train on (``loss.backward()``): the masked-token loss, plus
            ``critic_loss_weight * critic_loss`` with a token critic (the critic loss alone with
            ``only_train_critic``).
        generator_loss: the masked-token loss (the same tensor as ``loss`` without a critic); ``None`` with
            ``only_train_critic``.
        critic_loss: the token critic's binary cross-entropy; ``None`` without a critic or with
            ``only_train_generator``.
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


def _uniform(generator: torch.Generator | None) -> float:
    """One number in ``[0, 1)``: Python's ``random()`` (x-transformers' coin flips) without a generator."""
    return random.random() if generator is None else float(torch.rand((), generator=generator, dtype=torch.float64))


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device, dtype=torch.float32) -> Tensor:
    """``torch.rand`` of ``shape`` from ``generator`` (drawn on its device), or torch's global generator."""
    draw_on = device if generator is None else generator.device
    return torch.rand(shape, generator=generator, device=draw_on, dtype=dtype).to(device)


def mask_subset(mask: Tensor, prob: float, min_mask: int = 0, *, generator: torch.Generator | None = None) -> Tensor:
    """x-transformers' ``get_mask_subset_prob``: of each row's True positions of ``mask (b, n)``, a uniformly
    chosen ``ceil(max(count * prob, min_mask))`` (at most all of them; the same draw and arithmetic as
    x-transformers)."""
    b, n = mask.shape
    num = (mask.sum(dim=-1, keepdim=True) * prob).clamp(min=min_mask)
    scores = _rand((b, n), generator, mask.device).masked_fill(~mask, -1)
    randperm = scores.argsort(dim=-1).argsort(dim=-1).float() - (~mask).sum(dim=-1, keepdim=True)
    return (randperm < num) & mask


def gumbel_sample(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """x-transformers' ``gumbel_sample``: ``argmax(logits / max(temperature, 1e-10) + gumbel)`` over the last
    dimension, the noise ``-log(-log(u + 1e-10) + 1e-10)`` of ``u ~ U(0, 1)`` (finite for every ``u``)."""
    u = _rand(tuple(logits.shape), generator, logits.device, logits.dtype)
    noise = -torch.log(-torch.log(u + 1e-10) + 1e-10)
    return (logits / max(temperature, 1e-10) + noise).argmax(dim=-1)


class SelfCritic(nn.Module):
    """x-transformers' self token critic (Nijkamp et al., NAACL 2021): the generator's own net, its embeddings
    read by ``to_logits = nn.Linear(dim, 1)``: ``(b, n, 1)``, how likely each token is wrong.

    Args:
        net: the wrapper's ``TransformerWrapper`` (shared, not copied).
    """

    def __init__(self, net: TransformerWrapper):
        super().__init__()
        self.net = net
        self.to_logits = nn.Linear(net.attn_layers.dim, 1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``(b, n, 1)`` critic logits of token ids ``x (b, n)`` under the padding mask ``mask``."""
        return self.to_logits(self.net(x, mask=mask, return_embeddings=True))


def _check_options(net: TransformerWrapper, kw: Mapping[str, Any]) -> None:
    """The x-transformers options of ``NonAutoregressiveWrapper.__init__`` (its keywords ``kw``), checked."""
    for name in ("self_cond", "can_mask_prev_unmasked", "self_token_critic"):
        if not isinstance(kw[name], bool):
            raise TypeError(f"{name} must be a bool, got {kw[name]!r}")
    for name in ("self_cond_train_prob", "no_replace_prob", "random_token_prob"):
        _check_prob(kw[name], name)
    w = kw["critic_loss_weight"]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise ValueError(f"critic_loss_weight must be a finite number, got {w!r}")
    critic = kw["token_critic"]
    if kw["self_token_critic"] and critic is not None:
        raise ValueError("self_token_critic=True and token_critic are exclusive: give one critic")
    if critic is not None:
        if not isinstance(critic, TransformerWrapper):
            raise TypeError(f"token_critic must be a TransformerWrapper, got {type(critic).__name__}")
        if critic.return_only_embed or NonAutoregressiveWrapper._logits_dim(critic) != 1:
            raise ValueError("token_critic must return one logit per position (logits_dim=1)")
        if critic.num_tokens < NonAutoregressiveWrapper._logits_dim(net):
            raise ValueError(f"token_critic's num_tokens={critic.num_tokens} cannot read every token the net "
                             f"produces (logits_dim={NonAutoregressiveWrapper._logits_dim(net)})")
    if kw["self_cond"] and net.emb_dim != net.attn_layers.dim:
        raise ValueError(f"self_cond needs the net's emb_dim ({net.emb_dim}) equal to its width "
                         f"({net.attn_layers.dim}): the embeddings are fed back as token embeddings")


def _check_forward_options(wrapper, only_train_generator, only_train_critic, generator_sample_temperature) -> None:
    """``NonAutoregressiveWrapper.forward``'s critic options, checked."""
    for name, v in (("only_train_generator", only_train_generator), ("only_train_critic", only_train_critic)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    if only_train_generator and only_train_critic:
        raise ValueError("only_train_generator and only_train_critic are exclusive: train one, or both (neither)")
    if only_train_critic and wrapper.token_critic is None:
        raise ValueError("only_train_critic needs a token critic (token_critic= or self_token_critic=True)")
    if generator_sample_temperature is not None:
        _check_temperature(generator_sample_temperature, "generator_sample_temperature")


def _critic_loss(token_critic: nn.Module, logits: Tensor, x: Tensor, hidden: Tensor, mask: Tensor | None,
                 temperature: float, reduction: str, generator) -> Tensor:
    """The token critic's binary cross-entropy (x-transformers): the hidden tokens replaced by a Gumbel
    sample of ``logits`` at ``temperature``, the label of each real position whether the sample there
    differs from ``x``; padded positions never count (0 over none)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    sampled = gumbel_sample(logits, temperature, generator)
    generated = torch.where(hidden, sampled, x)
    critic = token_critic(generated, mask=mask)[..., 0]
    critic = critic.to(torch.promote_types(critic.dtype, torch.float32))
    labels = (sampled != x).to(critic.dtype)
    per = F.binary_cross_entropy_with_logits(critic, labels, reduction="none")
    if mask is not None:
        per = torch.where(mask, per, 0.0)
    if reduction == "none":
        return per
    total = per.sum()
    count = max(x.numel(), 1) if mask is None else mask.sum().clamp(min=1)
    return total if reduction == "sum" else total / count


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
        self_cond: self-conditioning: the net's input embeddings get ``to_self_cond(e)`` added
            (``nn.Linear(dim, dim, bias=False)``), ``e`` the previous prediction's embeddings: at generation
            the last step's, in training (with probability ``self_cond_train_prob``) a first pass's, without
            gradient; else the learned ``null_embed`` (``(dim,)``).
        self_cond_train_prob: the probability, per training step, of self-conditioning on a first pass.
        no_replace_prob: in training, the fraction of the hidden tokens left as they are (still scored), as in
            BERT; applied on half of the steps (a coin flip), as in x-transformers. Default 0.15, as there.
        random_token_prob: in training, the fraction of the remaining hidden tokens replaced by a uniformly
            random id in ``[0, num_tokens)`` instead of ``mask_id`` (still scored); on half of the steps.
            Default 0.1, as in x-transformers (0 turns either off).
        can_mask_prev_unmasked: at generation, whether a token revealed at an earlier step may be hidden
            again (judged by the model's probability of the token it holds, or by the critic).
        token_critic: a ``TransformerWrapper`` with ``logits_dim=1`` that scores each token of a sampled
            sequence: trained (binary cross-entropy) to tell where the generator's sample differs from the
            data, and at generation it decides which tokens are hidden again (the highest scores, with
            annealed Gumbel noise ``noise_level_scale``).
        self_token_critic: use the net itself as the critic: ``token_critic = SelfCritic(net)`` (its
            embeddings read by ``nn.Linear(dim, 1)``). Not together with ``token_critic``.
        critic_loss_weight: the critic loss's weight in ``loss``.

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
        self_cond: bool = False,
        self_cond_train_prob: float = 0.75,
        no_replace_prob: float = 0.15,
        random_token_prob: float = 0.1,
        can_mask_prev_unmasked: bool = False,
        token_critic: TransformerWrapper | None = None,
        self_token_critic: bool = False,
        critic_loss_weight: float = 1.0,
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
        _check_options(net, locals())
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
        self.dim = net.emb_dim
        self.no_replace_prob = float(no_replace_prob)
        self.random_token_prob = float(random_token_prob)
        self.can_mask_prev_unmasked = can_mask_prev_unmasked
        self.self_cond = self_cond
        self.self_cond_train_prob = float(self_cond_train_prob)
        if self_cond:  # x-transformers' parameters, in its order (the same draws from the same seed)
            self.null_embed = nn.Parameter(torch.randn(self.dim))
            self.to_self_cond = nn.Linear(self.dim, self.dim, bias=False)
        self.token_critic = SelfCritic(net) if self_token_critic else token_critic
        self.critic_loss_weight = float(critic_loss_weight)

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
        ``mask_id`` (x-transformers' draws: ``r``, then a random permutation of the positions; without
        padding the same tokens as x-transformers from the same numbers). Padded positions are never chosen.
        With ``no_replace_prob`` / ``random_token_prob`` some chosen tokens keep their id or get a random one.

        Returns:
            ``(hidden_x (b, n), hidden (b, n) bool)``: the corrupted ids and which positions were chosen
            (the positions the loss scores).
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
        r = _rand((b,), generator, x.device)
        frac = self.schedule_fn(r.double()).clamp(0.0, 1.0)
        k = torch.ceil(frac * n_real.double()).long().clamp(min=1)
        k = torch.minimum(k, n_real)
        perm = _rand((b, n), generator, x.device).argsort(dim=1)  # x-transformers' batched random permutation
        if mask is not None:  # the real positions ranked 0..n_real-1 in the permutation's order; padding last
            perm = torch.where(real, perm, perm + n).argsort(dim=1).argsort(dim=1)
        hidden = (perm < k[:, None]) & real
        return self._corrupt(x, hidden, generator), hidden, r.double()

    def _corrupt(self, x: Tensor, hidden: Tensor, generator) -> Tensor:
        """x-transformers' corruption of the ``hidden (b, n)`` tokens of ``x``: ``mask_id``, except (each on
        a coin flip) a ``no_replace_prob`` fraction left as is and a ``random_token_prob`` fraction of the
        rest replaced by random ids."""
        replace, frac_left = hidden, 1.0
        if self.no_replace_prob > 0 and _uniform(generator) < 0.5:
            frac_left -= self.no_replace_prob
            replace = replace & ~mask_subset(hidden, self.no_replace_prob, generator=generator)
        if self.random_token_prob > 0 and _uniform(generator) < 0.5:
            chosen = mask_subset(replace, self.random_token_prob * frac_left, generator=generator)
            draw_on = x.device if generator is None else generator.device
            ids = torch.randint(0, self.num_tokens, tuple(x.shape), generator=generator, device=draw_on).to(x.device)
            x = torch.where(chosen, ids, x)
            replace = replace & ~chosen
        return torch.where(replace, torch.full_like(x, self.mask_id), x)

    @checked_once
    def forward(
        self,
        x: Tensor,
        only_train_generator: bool = False,
        only_train_critic: bool = False,
        generator_sample_temperature: float | None = None,
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
        """Masked-token cross-entropy of ``x (b, n)`` (and the token critic's loss, with one).

        Args:
            x: token ids; real ones in ``[0, logits_dim)`` and not ``mask_id``; padded positions may hold
                anything (they are never looked up, hidden or scored).
            only_train_generator: with a critic, return the masked-token loss alone (no critic pass).
            only_train_critic: with a critic, the generator runs without gradient and ``loss`` is the
                critic loss alone (``generator_loss`` is ``None``).
            generator_sample_temperature: the temperature of the Gumbel sample the critic judges; ``None``
                draws one uniformly in ``[0, 1)`` per call (x-transformers).
            mask: ``(b, n)`` padding mask (True = real).
            context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask: the
                conditions (see ``conditions.py``); in training mode each is dropped per sample
                (``cond_drop_prob``, ``cond_drop_all_prob``).
            reduction: ``"mean"`` over hidden real positions (exactly 0 with zero gradient when none is
                hidden: an all-padding batch), ``"sum"``, or ``"none"``: ``(b, n)``, exactly 0 at
                positions not hidden. The critic loss is reduced over real positions the same way.
            generator: the random source of the hiding (``hide_tokens``), of condition dropping and of the
                critic's sample; without it x-transformers' sources (Python's ``random``, torch's global).

        Returns:
            ``Losses(loss, generator_loss, critic_loss)`` (x-transformers' namedtuple): train on ``.loss``.
        """
        conditions = condition_kwargs("NonAutoregressiveWrapper.forward", conditions)
        self._check_tokens(x, mask)
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        _check_forward_options(self, only_train_generator, only_train_critic, generator_sample_temperature)
        b = x.shape[0]
        conds = _conditions_of(self.net, b, x.device, {**locals(), **conditions})
        if self.training and (self.cond_drop_prob > 0 or self.cond_drop_all_prob > 0):
            conds, _ = drop_conditions(conds, self.cond_drop_probs, all_prob=self.cond_drop_all_prob, generator=generator)
        inp, hidden, r = self._hide(x, mask, generator)
        with torch.no_grad() if only_train_critic else nullcontext():
            logits = self.net(inp, mask=mask, **self._self_condition(inp, mask, conds.kwargs(), generator))
            loss = self._generator_loss(logits, x, hidden, r, reduction)
        if self.token_critic is None or only_train_generator:
            return Losses(loss, loss, None)
        temperature = _uniform(generator) if generator_sample_temperature is None else generator_sample_temperature
        critic_loss = _critic_loss(self.token_critic, logits.detach(), x, hidden, mask, temperature, reduction,
                                   generator)
        if only_train_critic:
            return Losses(critic_loss, None, critic_loss)
        return Losses(loss + critic_loss * self.critic_loss_weight, loss, critic_loss)

    def _self_condition(self, inp: Tensor, mask: Tensor | None, kwargs: dict, generator) -> dict:
        """The net's keywords ``kwargs`` with self-conditioning's ``sum_embeds``: ``to_self_cond`` of a first
        pass's embeddings (no gradient) with probability ``self_cond_train_prob``, else of ``null_embed``."""
        if not self.self_cond:
            return kwargs
        b, n = inp.shape
        embeds = self.null_embed
        if _uniform(generator) < self.self_cond_train_prob:
            with torch.no_grad():
                embeds = self.net(inp, mask=mask, return_embeddings=True, **kwargs).detach()
        return {**kwargs, "sum_embeds": self.to_self_cond(embeds).expand(b, n, self.dim)}

    def _generator_loss(self, logits: Tensor, x: Tensor, hidden: Tensor, r: Tensor, reduction: str) -> Tensor:
        """The cross-entropy of the ``hidden`` tokens of ``x`` (MDLM-weighted with the option)."""
        target = torch.where(hidden, x, torch.full_like(x, _IGNORE))
        if not self.use_simple_mdlm_loss_weight:
            return safe_cross_entropy(logits, target, ignore_index=_IGNORE, reduction=reduction)
        per = safe_cross_entropy(logits, target, ignore_index=_IGNORE, reduction="none")  # (b, n), 0 where not hidden
        per = per * mdlm_loss_weight(self.schedule_fn, r).to(per.dtype)[:, None]
        if reduction == "none":
            return per
        total = per.sum()
        return total if reduction == "sum" else total / hidden.sum().clamp(min=1).to(per.dtype)

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
        steps: int | None = None, noise_level_scale: float = 1.0, **conditions,
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
            noise_level_scale: with a token critic, the scale of the Gumbel noise added to its scores
                (annealed to 0 over the steps), as in x-transformers.

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
            net = _SelfConditioned(self) if self.self_cond else self.net
            engine = GuidedForward(net, d.b, d.conds, d.negatives, d.schedule,
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
    noise_level_scale: float
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
    noise_level_scale = _check_temperature(kw["noise_level_scale"], "noise_level_scale")
    return _Decoding(b, n, steps, temperature, choice_temperature, guidance_rescale, guidance_space, filter_fn,
                     filter_kwargs, noise_level_scale, conds, negatives, schedule)


class _SelfConditioned:
    """The wrapper's net in the decode engine's protocol with self-conditioning: each call adds
    ``to_self_cond`` of the previous step's embeddings (``null_embed`` at the first) to the input embeddings
    and keeps the new ones, per run of the engine (every guidance branch's rows its own). Not a module."""

    def __init__(self, wrapper: NonAutoregressiveWrapper):
        self.wrapper = wrapper
        self.embeds: dict[int, Tensor] = {}
        self.calls = 0
        self.period = 1  # the engine's runs per step (set once the engine is built)

    def __call__(self, x: Tensor, *, mask: Tensor | None = None, return_cache: bool = False, **kwargs) -> Tensor:
        w, key = self.wrapper, self.calls % self.period
        self.calls += 1
        b, n = x.shape
        last = self.embeds.get(key, w.null_embed)
        sum_embeds = w.to_self_cond(last).expand(b, n, w.dim)
        logits, self.embeds[key] = w.net(x, mask=mask, sum_embeds=sum_embeds, return_logits_and_embeddings=True,
                                         **kwargs)
        return logits


def _scores(wrapper, d: _Decoding, logits: Tensor, sampled: Tensor, seq: Tensor, hidden: Tensor, mask: Tensor | None,
            s: int) -> Tensor:
    """``(b, n)`` how sure step ``s`` is of each position (the least sure stay hidden): the guided probability
    of the token drawn (of the token held, at a revealed position), with MaskGIT's annealed Gumbel noise
    (``choice_temperature``); with a token critic, minus its score of the filled-in sequence, with
    x-transformers' annealed Gumbel noise (``noise_level_scale``)."""
    b, n, steps, device = d.b, d.n, d.steps, seq.device
    filled = torch.where(hidden, sampled, seq)
    anneal = 1.0 - (s + 1) / steps
    if wrapper.token_critic is not None:
        critic = wrapper.token_critic(filled, mask=mask)[..., 0]
        critic = critic.to(torch.promote_types(critic.dtype, torch.float32))
        u = torch.rand(critic.shape, device=device, dtype=critic.dtype)
        noise = -torch.log(-torch.log(u + 1e-10) + 1e-10)
        return -(critic + d.noise_level_scale * noise * anneal)
    held = filled.clamp(max=logits.shape[-1] - 1).reshape(-1, 1)  # padding holds mask_id: read anything there
    conf = logits.softmax(dim=-1).gather(1, held).reshape(b, n)
    if d.choice_temperature > 0:
        u = torch.rand(conf.shape, device=device, dtype=conf.dtype).clamp(1e-20, 1.0 - 1e-7)
        gumbel = -torch.log((-torch.log(u)).clamp(min=1e-20))  # finite: u in (0, 1)
        conf = torch.log(conf.clamp(min=1e-38)) + d.choice_temperature * anneal * gumbel
    return conf


def _reveal(wrapper, engine: GuidedForward, d: _Decoding, real: Tensor, mask: Tensor | None, counts: Tensor) -> Tensor:
    """MaskGIT's loop: each step every hidden position is predicted (guided), the most confident predictions are kept
    and the others hidden again, ``counts[s] (b,)`` of them (at least one revealed per step; with
    ``can_mask_prev_unmasked`` tokens revealed earlier compete too); returns ``(b, n)``."""
    b, n, steps, device = d.b, d.n, d.steps, real.device
    if isinstance(engine.net, _SelfConditioned):
        engine.net.period = len(engine.runs)
    seq = torch.full((b, n), wrapper.mask_id, dtype=torch.long, device=device)
    hidden = real.clone()
    for s in range(steps):
        logits = engine(seq, mask, None, s)  # (b, n, v), every branch in one batched forward
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if wrapper.mask_id < logits.shape[-1]:
            logits[..., wrapper.mask_id] = _NEG_INF  # the hidden token is never produced
        flat = logits.reshape(b * n, -1)
        sampled = sample_logits(flat, d.temperature, d.filter_fn, d.filter_kwargs).reshape(b, n)
        conf = _scores(wrapper, d, flat, sampled, seq, hidden, mask, s)
        # revealed tokens stay (unless they may be hidden again), padding always
        conf = torch.where((real if wrapper.can_mask_prev_unmasked else hidden), conf, float("inf"))
        k = torch.minimum(counts[s], (hidden.sum(1) - 1).clamp(min=0))  # reveal at least one per step
        rank = conf.argsort(dim=1, stable=True).argsort(dim=1)
        still = (rank < k[:, None]) & real
        seq = torch.where(hidden & ~still, sampled, seq)
        seq = torch.where(still, torch.full_like(seq, wrapper.mask_id), seq)
        hidden = still
    return seq
