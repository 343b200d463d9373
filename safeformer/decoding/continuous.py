"""Continuous autoregressive modelling: next-step regression (MSE / L1) or a Gaussian likelihood over
vectors, with classifier-free guidance (CFG) at sampling time.

Shape legend: b batch, n positions of ``x``, n0 start positions, t generated positions (``seq_len``),
d = dim_in features, j context length, m prefix length, K adaptive-condition width, r guidance branches.
Masks follow the one convention (bool, True = real position; see ``masks.py``).

Guidance on continuous outputs is the plain formula, computed in float32 (float64 for float64 models):

    guided = uncond + sum_k s_k * (cond_k - uncond)

on the predicted value (or, for ``probabilistic=True``, on the predicted mean). A probabilistic model
samples around the guided mean with the variance of the **joint** (fully conditional) branch: guidance
moves the centre of the next step toward the condition, the spread stays the conditional model's own
(extrapolating log-variances would give spreads that no branch predicted). Every branch (unconditional,
joint, one per guided kind) runs in one batched forward of ``r * b`` samples sharing one KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.conditions import (
    VALUE_LIMIT,
    Conditions,
    GuidanceSchedule,
    check_drop_kinds,
    compose_values,
    condition_kwargs,
    drop_conditions,
    drop_probabilities,
)
from ..core.masks import checked_once, validate_mask
from ..core.xt_helpers import default_lazy_unless_module as default  # noqa: F401  (x-transformers' helper of this module)
from ..core.xt_helpers import exists  # noqa: F401
from ..stack.wrappers import ContinuousTransformerWrapper, capped_log_var, gaussian_head, split_mean_log_var
from .decode import GuidedForward, autoregress
from .rollout import rollout_loss

__all__ = ["ContinuousAutoregressiveWrapper", "ContinuousTransformerWrapper"]

_LOSSES = ("mse", "l1")
_REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------------------------------
# helpers shared with nonautoregressive.py: conditions, negatives, guidance branches
# ----------------------------------------------------------------------------------------------------


def _conditions_of(net, b: int, device, kw: Mapping) -> Conditions:
    """The conditions passed to a wrapper's call, checked against the net (S9)."""
    return Conditions.from_kwargs(kw).check(net, b, device)


def _check_prob(p, name: str) -> float:
    if isinstance(p, bool) or not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    return float(p)


def _negatives(net, b: int, device, kw: Mapping) -> Conditions:
    """The unconditional branch's conditions in place of the dropped ones (batch ``b`` or 1), checked."""
    return Conditions.from_kwargs(kw, prefix="negative_").expand_batch(b).check(net, b, device, prefix="negative_")


def _check_guidance_rescale(guidance_rescale) -> float:
    if isinstance(guidance_rescale, bool) or not (isinstance(guidance_rescale, (int, float)) and 0.0 <= guidance_rescale <= 1.0):
        raise ValueError(f"guidance_rescale must be in [0, 1], got {guidance_rescale!r}")
    return float(guidance_rescale)


def _check_temperature(temperature, name: str = "temperature") -> float:
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {temperature!r}")
    return float(temperature)


def _check_count(v, name: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


class _RawHead:
    """A net with x-transformers' ``probabilistic=True`` read before its Gaussian head: ``(b, n, 2 d)``, the
    interleaved ``(mean, log-variance)`` pairs, in the decode engine's net protocol. The static step
    (``decoding/static.py``) runs the net itself (``static_net``), whose step output is the forward's
    ``stack((mean, variance)) (2, B, d)`` at the new position; ``static_read`` lays it out as those pairs, the
    log-variance as ``log(variance)`` (the capped one's ``exp`` and back: equal to rounding, and the same floor
    after). Not a module: the net's parameters stay registered once, under ``net``."""

    static_loop = None
    static_refusal = None

    def __init__(self, net: ContinuousTransformerWrapper):
        self.net = net

    @property
    def static_net(self) -> ContinuousTransformerWrapper:
        return self.net

    @staticmethod
    def static_read(out: Tensor) -> Tensor:
        """The step's ``stack((mean, variance)) (2, B, d)`` as ``(B, 2 d)`` pairs ``(mean, log-variance)``."""
        return torch.stack((out[0], out[1].log()), dim=-1).flatten(-2)

    def __call__(self, x, **kw):
        out = self.net(x, return_embeddings=True, **kw)
        if isinstance(out, tuple):
            return (self.net.project_out(out[0]), *out[1:])
        return self.net.project_out(out)


# x-transformers' variance floors: F.gaussian_nll_loss's eps (training) and sample_from_mean_variance's
XT_NLL_EPS = 1e-6
XT_SAMPLE_EPS = 1e-5


def _check_net_args(net, probabilistic, loss, min_variance, use_l1_loss,
                    equal_loss_weight_batch) -> tuple[str, int, bool]:
    """``ContinuousAutoregressiveWrapper``'s checks of its net and loss options, in order: returns ``(loss, dim_in,
    net_probabilistic)`` (``loss`` is ``"l1"`` with x-transformers' ``use_l1_loss=True``)."""
    for name, flag in (("use_l1_loss", use_l1_loss), ("equal_loss_weight_batch", equal_loss_weight_batch)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if use_l1_loss:  # x-transformers' spelling of loss="l1"
        if loss not in ("mse", "l1"):
            raise ValueError(f"use_l1_loss=True with loss={loss!r}: pass one of them")
        loss = "l1"
    if not isinstance(net, ContinuousTransformerWrapper):
        raise TypeError(f"net must be a ContinuousTransformerWrapper, got {type(net).__name__}")
    if not net.attn_layers.causal:
        raise ValueError("net must be causal (attn_layers=Decoder(...)) for next-step training and generation")
    if not isinstance(probabilistic, bool):
        raise TypeError(f"probabilistic must be a bool, got {probabilistic!r}")
    if loss not in _LOSSES:
        raise ValueError(f"loss must be one of {list(_LOSSES)}, got {loss!r}")
    if probabilistic and loss != "mse":
        raise ValueError(f"loss={loss!r} with probabilistic=True: a probabilistic model is trained with the "
                         "Gaussian negative log-likelihood (leave loss at its default)")
    if isinstance(min_variance, bool) or not (isinstance(min_variance, (int, float)) and math.isfinite(min_variance) and min_variance > 0):
        raise ValueError(f"min_variance must be a finite number > 0, got {min_variance!r}")
    dim_in = net.dim_in
    net_probabilistic = bool(getattr(net, "probabilistic", False))
    if net_probabilistic and probabilistic:
        raise ValueError("probabilistic=True here and on the net: the net's probabilistic=True (x-transformers' "
                         "spelling) already makes this wrapper probabilistic, with x-transformers' layout; "
                         "leave probabilistic out here")
    if net_probabilistic:
        dim_out = net.dim_out
        want = dim_in
    else:
        dim_out = net.project_out.out_features if isinstance(net.project_out, nn.Linear) else net.attn_layers.dim
        want = 2 * dim_in if probabilistic else dim_in
    if net_probabilistic and dim_out != want:
        raise ValueError(f"a probabilistic net's dim_out must equal dim_in = {dim_in} (its mean is fed back as "
                         f"input), got dim_out={dim_out}")
    if dim_out != want:
        what = "2 * dim_in (a mean and a log-variance per feature)" if probabilistic else "dim_in (it is fed back as input)"
        raise ValueError(f"the net's dim_out must be {what} = {want} with probabilistic={probabilistic}, got dim_out={dim_out}")
    return loss, dim_in, net_probabilistic


def _check_loss_fn(loss_fn, probabilistic: bool, loss: str, use_l1_loss: bool) -> None:
    """``loss_fn`` is ``None`` or a module / function, and not given together with a loss it would replace."""
    if loss_fn is None:
        return
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a module or a function (pred, target) -> loss, got {type(loss_fn).__name__}")
    if probabilistic:
        raise ValueError("loss_fn with probabilistic=True: that option trains with its own Gaussian likelihood "
                         "(a net with probabilistic=True hands loss_fn x-transformers' stack((mean, variance)))")
    if use_l1_loss or loss != "mse":
        raise ValueError("loss_fn replaces the built-in loss: pass it or use_l1_loss / loss, not both")


def _custom_loss(wrapper, out: Tensor, target: Tensor, counted: Tensor) -> Tensor:
    """``wrapper.loss_fn(pred, target)`` with x-transformers' ``pred``: the net's output ``(b, t, d)`` (for a
    probabilistic net ``stack((mean, variance))``, ``(2, b, t, d)``), in float32 (float64 for float64 models). Where
    a target does not count, ``pred`` and ``target`` are 0 (whatever the padding held); the result is unchecked."""
    acc = torch.promote_types(out.dtype, torch.float32)
    zero = torch.zeros((), dtype=acc, device=out.device)
    sel = counted[..., None]
    pred = torch.where(sel, out.to(acc), zero)
    pred = gaussian_head(pred) if wrapper.net_probabilistic else pred
    loss = wrapper.loss_fn(pred, torch.where(sel, target.to(acc), zero))
    if not isinstance(loss, Tensor) or not loss.is_floating_point():
        raise TypeError(f"loss_fn must return a floating-point tensor, got "
                        f"{getattr(loss, 'dtype', type(loss).__name__)}")
    return loss


def _custom_per_target(wrapper, loss: Tensor, counted: Tensor) -> Tensor:
    """``(b, t)`` from ``loss_fn``'s unreduced ``loss (b, t, ...)``: the mean over its trailing dims, exactly 0
    where a target does not count (x-transformers' ``loss[mask]``, then the mean, as ``_reduce`` sums)."""
    b, t = counted.shape
    if loss.dim() < 2 or tuple(loss.shape[:2]) != (b, t):
        raise ValueError(f"loss_fn must return unreduced losses of shape (b, n - 1, ...) = ({b}, {t}, ...) (e.g. "
                         f"nn.MSELoss(reduction='none')) so that targets that do not count are left out, got "
                         f"{tuple(loss.shape)}")
    width = loss[0, 0].numel() if b * t else 0
    if wrapper.equal_loss_weight_batch and b * t and width != wrapper.dim_in:
        raise ValueError(f"loss_fn with equal_loss_weight_batch=True must return (b, n - 1, dim_in={wrapper.dim_in}) "
                         f"losses (x-transformers sums them over the features), got {tuple(loss.shape)}")
    acc = torch.promote_types(loss.dtype, torch.float32)
    per = loss.to(acc) if loss.dim() == 2 else loss.to(acc).flatten(2).mean(-1)
    return torch.where(counted, per, torch.zeros((), dtype=acc, device=loss.device))


def _legacy_model_keys(state_dict, prefix, *_args) -> None:
    """Earlier safeformer registered the net a second time as ``_model``: those duplicate keys are dropped."""
    for key in [k for k in state_dict if k.startswith(prefix + "_model.")]:
        del state_dict[key]


# ----------------------------------------------------------------------------------------------------
# the wrapper
# ----------------------------------------------------------------------------------------------------


class ContinuousAutoregressiveWrapper(Configurable, nn.Module):
    """Next-step loss, CFG training and (guided) generation around a causal ``ContinuousTransformerWrapper``.

    The net reads ``x (b, n, d)`` and predicts, at each position, the next vector: its value
    (``dim_out = dim_in``), or with ``probabilistic=True`` a mean and a log-variance per feature
    (``dim_out = 2 * dim_in``: the first half is the mean).

    Args:
        net: a ``ContinuousTransformerWrapper`` whose layers are a ``Decoder`` (``cross_attend=True``
            for a context, ``use_adaptive_layernorm=True`` for a condition).
        loss_fn: x-transformers' custom loss: a module (registered, its parameters in the state dict) or function
            ``loss_fn(pred, target)`` called with the net's prediction ``(b, n - 1, dim_out)`` (a probabilistic net:
            ``stack((mean, variance))``, ``(2, b, n - 1, d)``) and the targets ``(b, n - 1, d)``, returning
            unreduced losses ``(b, n - 1, ...)`` (e.g. ``nn.SmoothL1Loss(reduction="none")``); the loss is their
            mean over the counted targets (``reduction="none"``: the mean over the trailing dims per target). As
            in x-transformers, without a mask a reduced (0-d) result is accepted and returned as it is. Where a
            target does not count, both arguments hold 0 whatever the padding held, and its loss is selected
            away. It must map finite inputs to finite outputs. ``None`` (default): x-transformers' default, the
            mean squared error (``use_l1_loss``: absolute error; a probabilistic net: Gaussian NLL).
        probabilistic: predict a Gaussian per feature and train with its negative log-likelihood
            ``0.5 * (log var + (x - mean)^2 / var)`` (the constant ``0.5 log 2 pi`` left out, as in
            ``F.gaussian_nll_loss``), computed in float32 as ``0.5 * (lv + (x - mean)^2 * exp(-lv))``
            with ``lv = logaddexp(raw, log(min_variance))``: the variance ``exp(raw) + min_variance``
            never falls below ``min_variance`` and nothing is divided or exponentiated upward.
        loss: ``"mse"`` (default) or ``"l1"`` for a deterministic model.
        min_variance: the variance floor of a probabilistic model (> 0).
        cond_drop_prob: during training, the probability of dropping each sample's condition: one
            number for every kind given, or ``{"context": p_c, "prepend": p_p, "condition": p_a}``.
        cond_drop_all_prob: in addition, the probability that a sample loses every condition at once.
        use_l1_loss: x-transformers' spelling of ``loss="l1"``.
        equal_loss_weight_batch: x-transformers' option: ``reduction="mean"`` weighs every sample the same
            instead of every target: per sample, the loss summed over its counted targets and the features
            divided by its counted targets (x-transformers' ``batch_masked_mean``: the features are summed),
            then the mean over the batch (a sample with no counted target contributes 0). As in x-transformers
            it applies to a call with a mask; without one every sample has as many targets and the loss is the
            plain mean.

    A dropped context or prefix is an all-False mask row (an exact no-op); a dropped adaptive condition
    is the stack's null condition. Dropped contents are selected away, never multiplied.

    x-transformers' spelling, ``ContinuousTransformerWrapper(..., probabilistic=True)`` wrapped as
    ``ContinuousAutoregressiveWrapper(net)``, is probabilistic too, with x-transformers' conventions: the
    net's ``dim_out = dim_in``, its head interleaves ``(mean, log-variance)`` pairs, the loss is
    ``F.gaussian_nll_loss(mean, x, var)`` (variance floored at 1e-6; computed from the log-variance,
    ``0.5 * (lv + (x - mean)^2 * exp(-lv))`` with ``lv = max(log-variance, log 1e-6)``, so it never
    overflows), and sampling draws ``N(mean, (max(var, 1e-5) ** 0.5 * temperature) ** 2)``. Passing
    ``probabilistic=True`` here as well is an error (the two layouts differ).

    Example:
        >>> net = ContinuousTransformerWrapper(dim_in=1, dim_out=2, max_seq_len=64,
        ...     attn_layers=Decoder(dim=64, depth=2, heads=4, cross_attend=True, dim_context=10))
        >>> model = ContinuousAutoregressiveWrapper(net, probabilistic=True, cond_drop_prob=0.2)
        >>> loss = model(x, mask=mask, context=label, context_mask=label_mask); loss.backward()
        >>> new = model.generate(start, 32, context=label, cond_scale=3.0)   # (b, 32, 1)
    """

    def __init__(
        self,
        net: ContinuousTransformerWrapper,
        loss_fn: nn.Module | Callable[[Tensor, Tensor], Tensor] | None = None,
        use_l1_loss: bool = False,
        equal_loss_weight_batch: bool = False,
        *,
        probabilistic: bool = False,
        loss: str = "mse",
        min_variance: float = 1e-6,
        cond_drop_prob: float | dict[str, float] = 0.0,
        cond_drop_all_prob: float = 0.0,
    ):
        super().__init__()
        _check_loss_fn(loss_fn, probabilistic, loss, use_l1_loss)
        loss, dim_in, net_probabilistic = _check_net_args(net, probabilistic, loss, min_variance, use_l1_loss,
                                                          equal_loss_weight_batch)
        probs = drop_probabilities(cond_drop_prob)
        check_drop_kinds(net.attn_layers, cond_drop_prob)
        _check_prob(cond_drop_all_prob, "cond_drop_all_prob")
        self._set_config_from(ContinuousAutoregressiveWrapper.__init__, locals())
        self.net = net
        self._register_load_state_dict_pre_hook(_legacy_model_keys)
        self.loss_fn = loss_fn
        self.net_probabilistic = net_probabilistic
        self.probabilistic = probabilistic or net_probabilistic
        self.loss = loss
        self.min_variance = float(min_variance)
        self.dim_in = dim_in
        self.cond_drop_probs = probs
        self.cond_drop_prob = max(probs.values())
        self.cond_drop_all_prob = float(cond_drop_all_prob)
        self.equal_loss_weight_batch = equal_loss_weight_batch
        self.max_seq_len = net.max_seq_len

    @property
    def _model(self):
        """What the loss and the decode engine call: the net (its raw head for x-transformers' probabilistic net).
        Not a registered submodule: the net's parameters are in the state dict once, under ``net``."""
        return _RawHead(self.net) if self.net_probabilistic else self.net

    # ------------------------------------------------------------------------------------------------
    # the distribution of the next step
    # ------------------------------------------------------------------------------------------------

    def _split(self, out: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(mean (..., d), log-variance (..., d) floored, or None)`` in float32 (float64 for float64)."""
        out = out.to(torch.promote_types(out.dtype, torch.float32))
        if not self.probabilistic:
            return out, None
        if self.net_probabilistic:  # x-transformers' layout and floor (F.gaussian_nll_loss's eps)
            mean, log_var = split_mean_log_var(out)
            return mean, capped_log_var(log_var).clamp(min=math.log(XT_NLL_EPS))
        mean, raw = out.split(self.dim_in, dim=-1)
        floor = torch.tensor(math.log(self.min_variance), dtype=raw.dtype, device=raw.device)
        return mean, torch.logaddexp(raw, floor)  # log(exp(raw) + min_variance), stable both ways

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
        rollout_steps: int = 1,
        **conditions,
    ) -> Tensor:
        """Next-step loss of ``x (b, n, d)``.

        Args:
            x: the sequences. Values at padded positions (``mask`` False) may hold anything, NaN and
                inf included: they are selected away before any arithmetic, as inputs and as targets.
            mask: ``(b, n)`` padding mask (True = real), any layout (left padding counts positions of
                real steps only). A target counts when it and the position predicting it are real.
            context, context_mask: the cross-attention condition ``(b, j, c_ctx)`` / ``(b, j)``.
            prepend_embeds, prepend_mask: a prefix ``(b, m, dim)`` / ``(b, m)``; only ``x`` is scored.
            condition, condition_mask: the adaptive-norm condition ``(b, K)`` / ``(b,)``.
            reduction: ``"mean"`` over counted targets (0.0 with zero gradient when none counts),
                ``"sum"``, or ``"none"``: ``(b, n - 1)`` per target (the mean over features), exactly
                0 where a target does not count.
            generator: the random source of condition dropping (training mode), of the rollout's cut points
                and of a probabilistic rollout's samples.
            rollout_steps: x-transformers' multi-step loss (``k >= 2``): for each sample with more than ``k``
                real steps, a cut ``c`` drawn uniformly from ``[1, L - k]`` (``L`` its real steps); from the
                first ``c`` real steps the model predicts ``k`` steps, each fed back as the next input (a
                probabilistic model feeds back a sample, without gradient through the draw), scored against
                the real steps ``c .. c + k - 1``. The history stays in view at every step (x-transformers
                2.31.10 feeds back only the last prediction). Samples too short for ``k`` steps are left out;
                ``reduction="none"`` gives ``(b, k)``, exactly 0 for them.

        In training mode each condition given is dropped per sample (``cond_drop_prob``,
        ``cond_drop_all_prob``). Returns the loss in float32 (float64 for float64 models).
        """
        conditions = condition_kwargs("ContinuousAutoregressiveWrapper.forward", conditions)
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim_in:
            raise ValueError(f"x must have shape (b, n, dim_in={self.dim_in}), got {getattr(x, 'shape', type(x))}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}")
        b, n, _ = x.shape
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
        if n < 1:
            raise ValueError("x must hold at least one position (got n = 0)")
        rollout_steps = _check_count(rollout_steps, "rollout_steps", 1)
        conds = _conditions_of(self.net, b, x.device, {**locals(), **conditions})
        if self.training and (self.cond_drop_prob > 0 or self.cond_drop_all_prob > 0):
            conds, _ = drop_conditions(conds, self.cond_drop_probs, all_prob=self.cond_drop_all_prob, generator=generator)
        inp, target = x[:, :-1], x[:, 1:]
        inp_mask = None if mask is None else mask[:, :-1]
        counted = torch.ones(b, n - 1, dtype=torch.bool, device=x.device) if mask is None else mask[:, 1:] & mask[:, :-1]
        if rollout_steps > 1:
            return rollout_loss(self, x, mask, conds, rollout_steps, reduction, generator)
        out = self._model(inp, mask=inp_mask, **conds.kwargs())  # (b, n - 1, dim_out)
        acc = torch.promote_types(out.dtype, torch.float32)
        if self.loss_fn is not None and mask is None:  # x-transformers: no mask, loss_fn's result averaged as it is
            loss = _custom_loss(self, out, target, counted)
            if loss.dim() < 2:
                if reduction != "mean":
                    raise ValueError(f"reduction={reduction!r} needs loss_fn to return unreduced losses (b, n - 1, ...)")
                return loss.mean().to(acc)
            per = _custom_per_target(self, loss, counted)
        else:
            per = self._per_target(out, target, counted)  # (b, n - 1); padded targets selected away first
        return self._reduce(per, counted, reduction, acc, masked=mask is not None)

    def _reduce(self, per: Tensor, counted: Tensor, reduction: str, acc, masked: bool = True) -> Tensor:
        if reduction == "none":
            return per
        if reduction == "mean" and self.equal_loss_weight_batch and masked:  # x-transformers: with a mask only
            per_sample = per.sum(1) * self.dim_in / counted.sum(1).clamp(min=1).to(acc)  # (b,)
            return per_sample.sum() / max(per.shape[0], 1)
        total = per.sum()
        if reduction == "sum":
            return total
        return total / counted.sum().clamp(min=1).to(acc)

    def _per_target(self, out: Tensor, target: Tensor, counted: Tensor) -> Tensor:
        """``(b, t)`` the loss of each target (the mean over features), exactly 0 where not ``counted``."""
        if self.loss_fn is not None:
            return _custom_per_target(self, _custom_loss(self, out, target, counted), counted)
        sel = counted[..., None]
        acc = torch.promote_types(out.dtype, torch.float32)
        zero = torch.zeros((), dtype=acc, device=out.device)
        target = torch.where(sel, target.to(acc), zero)
        mean, log_var = self._split(torch.where(sel, out.to(acc), zero))
        if log_var is not None:
            per = 0.5 * (log_var + (target - mean).square() * torch.exp(-log_var))
        elif self.loss == "l1":
            per = (mean - target).abs()
        else:
            per = (mean - target).square()
        return torch.where(counted, per.mean(dim=-1), zero)

    def _draw(self, mean: Tensor, log_var: Tensor | None, temperature: float, generator) -> Tensor:
        """A sample of the next step (the mean for a deterministic model or temperature 0)."""
        if log_var is None or temperature <= 0:
            return mean
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        if self.net_probabilistic:  # x-transformers: std = sqrt(max(var, 1e-5)) * temperature
            std = torch.exp(0.5 * log_var.clamp(min=math.log(XT_SAMPLE_EPS)))
            return mean + std * temperature * noise
        std = torch.exp(0.5 * log_var.clamp(max=math.log(torch.finfo(log_var.dtype).max) / 2))  # finite
        return mean + std * math.sqrt(temperature) * noise

    # ------------------------------------------------------------------------------------------------
    # generation
    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, start: Tensor, seq_len: int, *, mask: Tensor | None = None, context: Tensor | None = None,
        context_mask: Tensor | None = None, prepend_embeds: Tensor | None = None, prepend_mask: Tensor | None = None,
        condition: Tensor | None = None, condition_mask: Tensor | None = None,
        cond_scale: float | Mapping[str, float] | Callable[[int], float | Mapping[str, float]] = 1.0,
        guidance_rescale: float = 0.0, guidance_interval: tuple[int, int] | None = None,
        negative_context: Tensor | None = None, negative_context_mask: Tensor | None = None,
        negative_prepend_embeds: Tensor | None = None, negative_prepend_mask: Tensor | None = None,
        negative_condition: Tensor | None = None, cache_kv: bool = True, temperature: float = 1.0,
        generator: torch.Generator | None = None, **conditions,
    ) -> Tensor:
        """Generate ``seq_len`` new steps after ``start``, optionally with classifier-free guidance.

        Args:
            start: ``(b, n0, d)`` the first steps (left-padded when their lengths differ), or ``(n0, d)`` for one
                sequence.
            seq_len: how many steps to generate (>= 0).
            mask: ``(b, n0)`` padding of ``start`` (True = real; every sample needs a real step). Padded steps may
                hold anything (NaN included).
            context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask: the conditions, as in
                ``forward``.
            cond_scale: a number (joint guidance ``uncond + s * (joint - uncond)``; 1.0 is plain conditional
                generation and runs one branch, 0.0 unconditional), a mapping
                ``{"joint": s, "context": s_c, "prepend": s_p, "condition": s_a}`` (compositional guidance), or a
                callable ``step -> number | mapping``. Every branch runs in one batched forward sharing one KV cache.
            guidance_rescale: phi in ``[0, 1]``: pull the guided vector's standard deviation (over its ``d`` features;
                needs ``d >= 2``) toward the joint branch's.
            guidance_interval: ``(start, stop)``: guide only steps ``start <= t < stop``; the others take the joint
                (fully conditional) branch.
            negative_context, negative_context_mask, negative_prepend_embeds, negative_prepend_mask,
                negative_condition: the unconditional branch's conditions in place of the dropped ones (batch ``b`` or
                1).
            cache_kv: decode with the KV cache (one new step per forward); the values equal those of the uncached path
                to float tolerance.
            temperature: a probabilistic model samples ``N(mean, var * temperature)`` (the guided mean, the joint
                branch's variance); 0 gives the mean. A deterministic model returns its (guided) prediction whatever
                the temperature. Guidance and sampling are computed in float32 (float64 for float64 models); a value
                beyond the range of ``start``'s dtype (a huge scale in float16) saturates at its largest finite value
                instead of becoming inf.
            generator: the random source of probabilistic sampling (one ``(b, d)`` normal draw per step).

        Returns:
            ``(b, seq_len, d)`` the new steps, in ``start``'s dtype; for an unbatched ``start (n0, d)``
            (x-transformers' call), ``(seq_len, d)``.
        """
        conditions = condition_kwargs("ContinuousAutoregressiveWrapper.generate", conditions, negatives=True)
        if isinstance(start, Tensor) and start.dim() == 2 and start.shape[-1] == self.dim_in:  # one unbatched start
            kwargs = {k: v for k, v in locals().items() if k not in ("self", "start", "seq_len", "mask", "__class__", "conditions")}
            kwargs.update(conditions)
            if mask is not None:
                validate_mask(mask, "mask", shape=(start.shape[0],), device=start.device)
            return self.generate(start[None], seq_len, mask=None if mask is None else mask[None], **kwargs)[0]
        seq_len, temperature, guidance_rescale = _check_generate_args(self.dim_in, start, seq_len, mask, temperature,
                                                                      guidance_rescale)
        b, n0, _ = start.shape
        conds, negatives, schedule = _guidance(self, {**locals(), **conditions}, b, n0, seq_len, start.device)
        out = start.new_zeros(b, seq_len, self.dim_in)
        if seq_len == 0 or b == 0:  # nothing to generate: empty in, empty out
            return out
        # a value beyond what the model takes back saturates instead of becoming inf (or NaN a step later)
        big = min(torch.finfo(start.dtype).max / 4, VALUE_LIMIT)

        def pick(guided: tuple[Tensor, Tensor | None], t: int) -> tuple[Tensor, bool]:
            mean, log_var = guided
            mean = self._draw(mean, log_var, temperature, generator)
            value = mean.clamp(-big, big).to(start.dtype)
            out[:, t] = value
            return value, False

        was_training = self.training
        self.eval()
        try:
            engine = GuidedForward(self._model, b, conds, negatives, schedule,
                                   _combine_values(self._split, schedule, guidance_rescale), cache_kv=cache_kv,
                                   steps=seq_len, need_joint=self.probabilistic or guidance_rescale > 0, static=True)
            autoregress(engine, start, mask, seq_len, pick)
        finally:
            self.train(was_training)
        return out


def _check_generate_args(dim_in: int, start, seq_len, mask, temperature, guidance_rescale) -> tuple[int, float, float]:
    """``generate``'s checks of its start, length, mask and sampling options (S9)."""
    if not isinstance(start, Tensor) or start.dim() != 3 or start.shape[-1] != dim_in:
        raise ValueError(f"start must have shape (b, n0, dim_in={dim_in}), got {getattr(start, 'shape', type(start))}")
    if not start.is_floating_point():
        raise TypeError(f"start must be a floating-point tensor, got dtype {start.dtype}")
    b, n0, _ = start.shape
    if n0 == 0:
        raise ValueError("start must hold at least one step per sample (got n0 = 0 positions)")
    seq_len = _check_count(seq_len, "seq_len", 0)
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n0), device=start.device)
        empty = ~mask.any(dim=1)
        if bool(empty.any()):
            raise ValueError(f"every start needs at least one real step; mask rows {empty.nonzero().flatten().tolist()} are all False")
    temperature = _check_temperature(temperature)
    guidance_rescale = _check_guidance_rescale(guidance_rescale)
    if guidance_rescale > 0 and dim_in < 2:
        raise ValueError(f"guidance_rescale needs dim_in >= 2 (a standard deviation over the features), "
                         f"got dim_in={dim_in}")
    return seq_len, temperature, guidance_rescale


def _guidance(wrapper, kw: Mapping, b: int, n0: int, seq_len: int,
              device) -> tuple[Conditions, Conditions, GuidanceSchedule]:
    """``generate``'s conditions, negatives and guidance schedule from its keywords ``kw``, checked (and the length
    against a learned absolute position embedding)."""
    net = wrapper.net
    conds, negatives = _conditions_of(net, b, device, kw), _negatives(net, b, device, kw)
    conds = conds.with_empty_for(negatives, b)
    if net.pos_emb is not None and n0 + seq_len - 1 > wrapper.max_seq_len:  # a prefix takes no absolute position
        raise ValueError(
            f"a start of {n0} steps plus seq_len={seq_len} new steps needs "
            f"{n0 + seq_len - 1} positions, more than the model's max_seq_len={wrapper.max_seq_len}")
    schedule = GuidanceSchedule.build(kw["cond_scale"], conds.kinds(), kw["guidance_interval"], kw["guidance_rescale"],
                                      has_uncond=bool(conds.kinds()), steps=seq_len)
    return conds, negatives, schedule


def _combine_values(split, schedule: GuidanceSchedule, guidance_rescale: float):
    """The decode engine's combine function for continuous values: the guided mean and the joint branch's
    log-variance (``split``: the wrapper's ``_split`` of a head's output)."""

    def combine(outs: dict[str, Tensor], t: int) -> tuple[Tensor, Tensor | None]:
        """The guided mean and the joint branch's log-variance."""
        parts = {name: split(o) for name, o in outs.items()}
        log_var = parts[next(iter(parts))][1]  # the joint branch comes first
        if len(parts) == 1:  # one branch (joint, or uncond at scale 0): its prediction, unguided
            return next(iter(parts.values()))[0], log_var
        means = {name: m for name, (m, _) in parts.items()}
        uncond = means.pop("uncond")
        return compose_values(uncond, means, schedule.at(t), guidance_rescale=guidance_rescale,
                              reference=means.get("joint")), log_var

    return combine

# x-transformers' names that its module of this path imports from another (the same objects as there)
from ..core.xt_helpers import align_right, always  # noqa: E402, F401
from ..nn.attention import Attention  # noqa: E402, F401
from ..nn.modules import AbsolutePositionalEmbedding  # noqa: E402, F401
from ..nn.xt_modules import LayerNorm, ScaledSinusoidalEmbedding  # noqa: E402, F401
from ..stack.layers import AttentionLayers  # noqa: E402, F401
