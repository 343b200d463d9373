"""Conditions and guidance: the three ways to condition a model, dropping them for classifier-free
guidance (CFG) training, and combining guided branches at sampling time.

Shape legend: b batch, j context length, m prefix length, K adaptive-condition width, c width,
v vocabulary size, r branches.

The three kinds of condition, each droppable per sample with the same guarantee (a dropped condition's
contents never matter, NaN included, because it is *selected* away):

- ``"context"``: cross-attention ``context (b, j, c_ctx)`` with ``context_mask (b, j)``; dropped = an
  all-False mask row (an exact no-op), or a learned null token.
- ``"prepend"``: a prefix ``prepend_embeds (b, m, c)`` with ``prepend_mask (b, m)``; dropped = an
  all-False mask row (exactly no prefix).
- ``"condition"``: an adaptive-norm condition ``condition (b, K)`` with ``condition_mask (b,)``;
  dropped = False, the stack's null condition (learned or zeros) takes its place.

Guidance over several conditions (compositional CFG): with branches ``uncond`` (every condition
dropped), ``joint`` (every condition kept) and one per kind ``k`` (only ``k`` kept),

    guided = uncond + s_joint * (joint - uncond) + sum_k s_k * (cond_k - uncond)

computed in float32 (float64 for float64 inputs). A plain number ``s`` is ``{"joint": s}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from .masks import validate_mask

__all__ = ["KINDS", "CONDITION_KINDS", "CONDITION_KEYWORDS", "condition_kwargs", "check_drop_kinds", "ConditionKind", "Conditions", "adaptive_condition", "guided_logits", "compose_guidance", "compose_values", "drop_conditions", "drop_condition", "GuidanceSchedule",
           "guidance_branches", "drop_probabilities"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class ConditionKind:
    """How one kind of condition is passed, checked, dropped, padded and stacked: one entry per kind.

    Attributes:
        name: the kind's name in ``cond_drop_prob`` / ``cond_scale`` mappings.
        value, mask: the forward keywords of the tensor and its mask (``Conditions``' fields).
        sequence: ``value (b, j, width)`` with ``mask (b, j)`` (a dropped sample: an all-False row, or a
            null sequence); otherwise ``value (b, width)`` with ``mask (b,)`` (a dropped sample: the
            model's null condition is selected in).
        width: ``width(stack) -> int | None``: the feature size a stack (``AttentionLayers``) takes for this
            kind, ``None`` when it cannot take it at all.
        needs: what the model must have to take this kind (for the error when it has not).
        in_stack: the layer stack consumes it (a wrapper passes it on to ``AttentionLayers.forward``);
            otherwise the wrapper itself does (a prefix).
    """

    name: str
    value: str
    mask: str
    sequence: bool
    width: Callable[[Any], int | None]
    needs: str | None = None
    in_stack: bool = True

    def mask_shape(self, t: Tensor) -> tuple[int, ...]:
        return tuple(t.shape[:2] if self.sequence else t.shape[:1])

    def full_mask(self, t: Tensor, mask: Tensor | None) -> Tensor:
        """``mask``, or all True (every row real) when it is ``None``."""
        return mask if mask is not None else torch.ones(self.mask_shape(t), dtype=torch.bool, device=t.device)

    def per_sample(self, d: Tensor) -> Tensor:
        """A per-sample ``(b,)`` bool broadcast against this kind's mask."""
        return d[:, None] if self.sequence else d

    def empty(self, t: Tensor, b: int, prefix: str = "negative_") -> tuple[Tensor, Tensor]:
        """The kind given with nothing in it (for a negative condition passed alone)."""
        if not self.sequence:
            raise ValueError(f"{prefix}{self.value} needs a {self.value} for the conditional branch too")
        return t[:, :0], torch.zeros(b, 0, dtype=torch.bool, device=t.device)


CONDITION_KINDS: dict[str, ConditionKind] = {k.name: k for k in (
    ConditionKind("context", "context", "context_mask", True, lambda s: s.dim_context if s.has_cross else None,
                  "cross-attention (cross_attend=True)"),
    ConditionKind("prepend", "prepend_embeds", "prepend_mask", True, lambda s: s.dim, in_stack=False),
    ConditionKind("condition", "condition", "condition_mask", False, lambda s: s.dim_condition,
                  "adaptive layers (use_adaptive_layernorm=True)"),
)}
KINDS = tuple(CONDITION_KINDS)
CONDITION_KEYWORDS = tuple(name for k in CONDITION_KINDS.values() for name in (k.value, k.mask))


def condition_kwargs(owner: str, kwargs: Mapping, *, negatives: bool = False) -> dict:
    """The condition keywords among a door's ``**conditions`` (kinds beyond the ones its signature
    names); anything else is a ``TypeError`` naming the keyword, as Python's own."""
    allowed = set(CONDITION_KEYWORDS) | ({"negative_" + k for k in CONDITION_KEYWORDS} if negatives else set())
    for key in kwargs:
        if key not in allowed:
            import difflib

            close = difflib.get_close_matches(key, sorted(allowed), n=2, cutoff=0.7)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}{hint}")
    return dict(kwargs)


def check_drop_kinds(layers, cond_drop_prob) -> None:
    """A ``cond_drop_prob`` mapping names only kinds the stack can take."""
    if isinstance(cond_drop_prob, Mapping):
        for kind, p in drop_probabilities(cond_drop_prob).items():
            if p > 0 and CONDITION_KINDS[kind].width(layers) is None:
                raise ValueError(f"cond_drop_prob[{kind!r}] > 0 but the net cannot take that condition")


@dataclass
class Conditions:
    """The conditions of one batch: any of the kinds of ``CONDITION_KINDS`` (``None`` = not used).

    The public entry points take x-transformers' keywords (``context=``, ``context_mask=``,
    ``prepend_embeds=``, ...) and turn them into one ``Conditions`` (and one for the negatives) at the
    door (``from_kwargs``); everything below takes these objects.
    """

    context: Tensor | None = None
    context_mask: Tensor | None = None
    prepend_embeds: Tensor | None = None
    prepend_mask: Tensor | None = None
    condition: Tensor | None = None
    condition_mask: Tensor | None = None

    def kinds(self) -> tuple[str, ...]:
        """The kinds present, in ``KINDS`` order."""
        return tuple(k for k in KINDS if getattr(self, CONDITION_KINDS[k].value) is not None)

    def pair(self, kind: str) -> tuple[Tensor | None, Tensor | None]:
        spec = CONDITION_KINDS[kind]
        return getattr(self, spec.value), getattr(self, spec.mask)

    def with_pair(self, kind: str, value: Tensor | None, mask: Tensor | None) -> Conditions:
        spec = CONDITION_KINDS[kind]
        return replace(self, **{spec.value: value, spec.mask: mask})

    def with_empty_for(self, negatives: Conditions, b: int, prefix: str = "negative_") -> Conditions:
        """A negative condition given alone: the conditional branch sees that kind empty (no context,
        no prefix); an adaptive condition has no empty form, so its negative needs a positive one."""
        out = self
        for kind in negatives.kinds():
            if self.pair(kind)[0] is None:
                out = out.with_pair(kind, *CONDITION_KINDS[kind].empty(negatives.pair(kind)[0], b, prefix))
        return out

    def kwargs(self) -> dict:
        """Keyword arguments for a wrapper's forward (the outputs of the rows the wrapper places before the
        tokens, a prefix, excised)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if any(not spec.in_stack and getattr(self, spec.value) is not None for spec in CONDITION_KINDS.values()):
            out["excise_prepend_embeds"] = True
        return out

    @classmethod
    def from_kwargs(cls, kwargs: Mapping, prefix: str = "") -> Conditions:
        """The conditions among ``kwargs`` (a door's keywords; ``prefix="negative_"`` for the negatives)."""
        out = {}
        for spec in CONDITION_KINDS.values():
            out[spec.value] = kwargs.get(prefix + spec.value)
            out[spec.mask] = kwargs.get(prefix + spec.mask)
        return cls(**out)

    def expand_batch(self, b: int) -> Conditions:
        """A kind given for one sample (batch 1) repeated for a batch of ``b`` (one negative for all), with
        its mask when that is for one sample too."""
        out = self
        for kind in self.kinds():
            t, m = self.pair(kind)
            if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == 1 and b != 1:
                if isinstance(m, Tensor) and m.dim() >= 1 and m.shape[0] == 1:
                    m = m.expand(b, *m.shape[1:])
                out = out.with_pair(kind, t.expand(b, *t.shape[1:]), m)
        return out

    def check(self, net, b: int, device, *, prefix: str = "") -> Conditions:
        """Shapes, dtypes, devices and masks against ``net`` (a wrapper), once at the door (S9); with the
        net's ``check_finite``, NaN/inf at real context positions too. Returns ``self``."""
        check_condition_args(self, b, device, net.attn_layers, prefix=prefix)
        if getattr(net, "check_finite", False):  # before a drop could hide it
            self.check_finite(prefix)
        return self

    def check_finite(self, prefix: str = "") -> None:
        """NaN or inf at a real position of any kind (its mask True, or no mask) is a ``ValueError`` naming
        it; masked positions and dropped samples may hold anything. One host sync per kind."""
        from .masks import check_finite

        b = self.batch_size()
        if b is not None:
            _check_conditions_shape(self, b, prefix)  # ranks, batch and masks first: the names stay right
        for kind in self.kinds():
            spec = CONDITION_KINDS[kind]
            t, m = self.pair(kind)
            if spec.sequence:
                check_finite(t, m, prefix + spec.value)
            else:  # one row per sample: (b, K) with mask (b,)
                check_finite(t[:, None], None if m is None else m[:, None], prefix + spec.value)

    def stack_kwargs(self) -> dict:
        """Keyword arguments for ``AttentionLayers.forward``: every kind the stack consumes (``None`` if absent)."""
        return {name: getattr(self, name) for spec in CONDITION_KINDS.values() if spec.in_stack
                for name in (spec.value, spec.mask)}

    def batch_size(self) -> int | None:
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                return int(t.shape[0])
        return None


def _full_mask(t: Tensor, mask: Tensor | None, kind: str) -> Tensor:
    return CONDITION_KINDS[kind].full_mask(t, mask)


def null_of(conds: Conditions, kind: str, null: tuple[Tensor, Tensor | None] | None = None) -> tuple[Tensor, Tensor]:
    """What ``kind`` becomes when dropped for every sample: ``null`` if given (e.g. a learned null
    token, expanded to the batch), else the same tensor with an all-False mask (an exact no-op)."""
    if null is not None:
        t, m = null
        return t, _full_mask(t, m, kind)
    t, m = conds.pair(kind)
    return t, torch.zeros_like(_full_mask(t, m, kind))


def _pad(t: Tensor, mask: Tensor, length: int) -> tuple[Tensor, Tensor]:
    b, j = mask.shape
    if j == length:
        return t, mask
    t = torch.cat((t, t.new_zeros(b, length - j, t.shape[-1])), dim=1)
    return t, torch.cat((mask, mask.new_zeros(b, length - j)), dim=1)


def stack_conditions(branches: list[Conditions]) -> Conditions:
    """One batch of ``r * b`` samples holding the branches one after the other (lengths padded with
    masked positions); every branch must use the same kinds."""
    kinds = branches[0].kinds()
    out = Conditions()
    for kind in kinds:
        pairs = [(t, _full_mask(t, m, kind)) for t, m in (br.pair(kind) for br in branches)]
        if CONDITION_KINDS[kind].sequence:
            length = max(m.shape[1] for _, m in pairs)
            dtype = pairs[0][0].dtype
            pairs = [_pad(t.to(dtype), m, length) for t, m in pairs]
        out = out.with_pair(kind, torch.cat([t.to(pairs[0][0].dtype) for t, _ in pairs]), torch.cat([m for _, m in pairs]))
    return out


def _check_conditions_shape(conds: Conditions, b: int, prefix: str) -> None:
    """Every kind given holds ``b`` samples, floats of its rank, with a bool mask of its shape (S9)."""
    for kind in conds.kinds():
        spec = CONDITION_KINDS[kind]
        t, m = conds.pair(kind)
        want = (b, None, None) if spec.sequence else (b, None)
        check_condition_tensor(t, prefix + spec.value, want, t.device if isinstance(t, Tensor) else None,
                               shape_text=f"(b={b}, j, width)" if spec.sequence else f"(b={b}, width)")
        if m is not None:
            validate_mask(m, prefix + spec.mask, shape=spec.mask_shape(t), device=t.device)
    for spec in CONDITION_KINDS.values():
        t, m = conds.pair(spec.name)
        if m is not None and t is None:
            raise ValueError(f"{prefix}{spec.mask} was given without {prefix}{spec.value}")


def drop_conditions(
    conds: Conditions,
    probs: float | Mapping[str, float],
    *,
    all_prob: float = 0.0,
    nulls: Mapping[str, tuple[Tensor, Tensor | None]] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Conditions, dict[str, Tensor]]:
    """Drop each kind of condition per sample with its own probability (CFG training).

    Args:
        conds: the batch's conditions.
        probs: one probability for every kind given, or ``{kind: p}`` (absent kinds are never dropped).
        all_prob: in addition, each sample loses every condition at once with this probability (so
            the unconditional model is trained even when the kinds are rarely dropped together).
        nulls: ``{kind: (null (b, ...), mask)}`` to use for a dropped kind instead of the all-False mask
            (a learned null token for the context, already expanded to the batch).

    Returns:
        ``(conditions, {kind: (b,) bool dropped})``. Dropped values are selected away: whatever a
        dropped sample's condition holds (NaN included) reaches no output and no gradient.
    """
    if not isinstance(conds, Conditions):
        raise TypeError(f"conds must be a Conditions, got {type(conds).__name__}")
    probs = drop_probabilities(probs, "probs")
    if isinstance(all_prob, bool) or not (isinstance(all_prob, (int, float)) and 0.0 <= all_prob <= 1.0):
        raise ValueError(f"all_prob must be a probability in [0, 1], got {all_prob!r}")
    if nulls is not None and not isinstance(nulls, Mapping):
        raise TypeError(f"nulls must be a mapping {{kind: (null, mask)}}, got {type(nulls).__name__}")
    b = conds.batch_size()
    if b is None:
        return conds, {}
    _check_conditions_shape(conds, b, "")
    for kind, null in (nulls or {}).items():
        if kind not in CONDITION_KINDS:
            raise ValueError(f"nulls names an unknown condition {kind!r}; the kinds are {list(KINDS)}")
        if not (isinstance(null, (tuple, list)) and len(null) == 2):
            raise TypeError(f"nulls[{kind!r}] must be a pair (null, mask or None), got {type(null).__name__}")
        _check_conditions_shape(Conditions().with_pair(kind, *null), b, f"nulls[{kind!r}]: ")
    device = next(getattr(conds, f.name) for f in fields(conds) if getattr(conds, f.name) is not None).device
    every = torch.rand(b, device=device, generator=generator) < all_prob if all_prob > 0 else None
    dropped: dict[str, Tensor] = {}
    for kind in conds.kinds():
        p = probs.get(kind, 0.0)
        if p <= 0 and every is None:
            continue
        d = torch.rand(b, device=device, generator=generator) < p
        if every is not None:
            d = d | every
        dropped[kind] = d
        t, m = conds.pair(kind)
        m = _full_mask(t, m, kind)
        null = None if nulls is None else nulls.get(kind)
        if null is None:
            conds = conds.with_pair(kind, t, m & CONDITION_KINDS[kind].per_sample(~d))
            continue
        nt, nm = null
        nm = _full_mask(nt, nm, kind)
        if not CONDITION_KINDS[kind].sequence:
            conds = conds.with_pair(kind, torch.where(d[:, None], nt.to(t.dtype), t), torch.where(d, nm, m))
            continue
        length = max(m.shape[1], nm.shape[1])
        (t, m), (nt, nm) = _pad(t, m, length), _pad(nt.to(t.dtype), nm, length)
        conds = conds.with_pair(kind, torch.where(d[:, None, None], nt, t), torch.where(d[:, None], nm, m))
    return conds, dropped


def drop_condition(
    context_mask: Tensor | None,
    p: float = 0.0,
    *,
    context: Tensor | None = None,
    null_context: Tensor | None = None,
    dropped: Tensor | None = None,
) -> tuple[Tensor | None, Tensor]:
    """Drop each sample's condition with probability ``p``: CFG training for any wrapper.

    By default a dropped sample's ``context_mask`` row becomes all False: the empty context, which
    makes its cross-attention an exact no-op (S2). With ``null_context`` the dropped samples see the
    learned null token(s) instead (real positions), and everything else in their context becomes
    masked padding. Values are *selected*, never multiplied away: NaN in a padded context position
    stays out of every output.

    Args:
        context_mask: ``(b, j)`` bool (True = real), or ``None`` (every position real; ``context``
            then gives ``b`` and ``j``).
        p: drop probability in ``[0, 1]``, drawn per sample (ignored when ``dropped`` is given).
        context: ``(b, j, c_ctx)``; required with ``null_context`` (or when ``context_mask`` is None).
        null_context: ``(m, c_ctx)`` learned null token(s) (e.g. an ``nn.Parameter``), or ``None``.
        dropped: ``(b,)`` bool, which samples to drop (instead of drawing them with ``p``).

    Returns:
        ``(context, context_mask)`` to pass to the model. ``context`` is the input itself when
        ``null_context`` is None; with it, ``(b, max(j, m), c_ctx)``.

    Example:
        >>> ctx, ctx_mask = drop_condition(ctx_mask, 0.1, context=ctx)   # in the training step
        >>> out = model(x, context=ctx, context_mask=ctx_mask)
    """
    if isinstance(p, bool) or not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
        raise ValueError(f"p (the condition drop probability) must be in [0, 1], got {p!r}")
    if context_mask is None and context is None:
        raise ValueError("drop_condition needs context_mask or context (to know the batch and context length)")
    if context is not None and (not isinstance(context, Tensor) or context.dim() != 3):
        raise ValueError(f"context must have shape (b, j, c_ctx), got {getattr(context, 'shape', type(context))}")
    ref = context if context is not None else context_mask
    b, j = ref.shape[0], ref.shape[1]
    if context_mask is None:
        context_mask = torch.ones(b, j, dtype=torch.bool, device=ref.device)
    validate_mask(context_mask, "context_mask", shape=(b, j), device=ref.device)
    if dropped is None:
        dropped = torch.rand(b, device=ref.device) < p
    else:
        validate_mask(dropped, "dropped", shape=(b,), device=ref.device)
    if null_context is None:
        return context, context_mask & ~dropped[:, None]
    if context is None:
        raise ValueError("null_context needs the context itself (context=...), to put the null token in its place")
    if null_context.dim() != 2 or null_context.shape[-1] != context.shape[-1]:
        raise ValueError(
            f"null_context must have shape (m, c_ctx={context.shape[-1]}), got {tuple(null_context.shape)}"
        )
    m = null_context.shape[0]
    length = max(j, m)
    ctx, ctx_mask = _pad(context, context_mask, length)
    null_t = null_context.to(context.dtype)[None]
    null = _pad(null_t, torch.ones(null_t.shape[:2], dtype=torch.bool, device=null_t.device), length)
    null_ctx, null_mask = null[0].expand(b, -1, -1), null[1].expand(b, -1)
    context = torch.where(dropped[:, None, None], null_ctx, ctx)
    return context, torch.where(dropped[:, None], null_mask, ctx_mask)


# ----------------------------------------------------------------------------------------------------
# combining the branches
# ----------------------------------------------------------------------------------------------------


def _check_scale(s, name: str) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise ValueError(f"{name} must be a finite number, got {s!r}")
    return float(s)


def compose_guidance(
    uncond: Tensor,
    conds: Mapping[str, Tensor],
    scales: Mapping[str, float],
    *,
    guidance_rescale: float = 0.0,
    reference: Tensor | None = None,
    space: str = "logits",
    errors: Tensor | None = None,
) -> Tensor:
    """``uncond + sum_k scales[k] * (conds[k] - uncond)``: compositional classifier-free guidance.

    A token whose logit is ``-inf`` in any branch taking part stays ``-inf`` (it is impossible under one
    of the models); NaN or ``+inf`` in any branch given is a ``ValueError``, whatever its scale (one rule).
    Computed in float64 and returned in float32 (float64 for float64 inputs). Any finite scale is allowed:
    where ``uncond + s * (cond - uncond)`` would leave the returned dtype's range, the row is scaled down
    to fit (its order, hence the greedy token, kept: the saturated answer), never inf or NaN; a row whose
    branches agree is that row at any scale.

    Args:
        uncond: ``(..., v)`` the branch with every condition dropped.
        conds: ``{name: (..., v)}`` the conditional branches.
        scales: ``{name: s}`` one scale per branch in ``conds`` (missing names count 0; a name at 0 need not
            be in ``conds``).
        guidance_rescale: phi in ``[0, 1]``: pull the result's standard deviation (over the tokens
            that are not banned) toward that of ``reference`` (arXiv 2305.08891).
        reference: the branch whose standard deviation the rescale aims at (the joint branch).
        space: ``"logits"`` or ``"logprobs"`` (each branch is log-softmaxed first).
        errors: a 0-d bool tensor: NaN or ``+inf`` in a branch sets it True instead of raising, so the call
            reads nothing back to the host (a decode loop checks the flag now and then, and raises then).
            The result is then computed with the offending entries treated as banned (``-inf``).
    """
    tensors = _check_guidance_args(uncond, conds, scales, guidance_rescale, space)
    dtype = torch.promote_types(uncond.dtype, torch.float32)
    for t in tensors.values():
        dtype = torch.promote_types(dtype, t.dtype)
    # branches are combined in the order of their names, so neither mapping's order can change the result
    used = {k: _check_scale(scales[k], f"the scale of {k!r}") for k in sorted(scales) if scales[k] != 0}
    checked = dict(tensors) if reference is None or guidance_rescale == 0 else {**tensors, "the reference": reference}
    work = _work_dtype(uncond)
    names = ["uncond", *used]
    vals = _checked_branches(checked, names, work, errors)  # (uncond, used...)
    if space == "logprobs":
        vals = _log_softmax(vals)
    banned = ~(vals < float("inf")) | (vals == _NEG_INF) if errors is not None else vals == _NEG_INF
    banned = banned.any(dim=0)
    clean = torch.where(banned, torch.zeros((), dtype=work, device=uncond.device), vals)  # -inf selected away, not subtracted
    clean = dict(zip(names, clean.unbind(0)))
    ref = None
    if guidance_rescale > 0 and reference is not None:
        r = reference.to(work)
        r = _log_softmax(r) if space == "logprobs" else r
        banned = banned | (r == _NEG_INF) | (~(r < float("inf")) if errors is not None else False)
        ref = torch.where(banned, 0.0, r)
        clean = {k: torch.where(banned, 0.0, t) for k, t in clean.items()}
    guided = _combine(clean, used, guidance_rescale, ref, live=~banned, out_dtype=dtype)
    return guided.masked_fill(banned, _NEG_INF)


def _check_guidance_args(uncond: Tensor, conds, scales, guidance_rescale, space) -> dict[str, Tensor]:
    """``compose_guidance``'s arguments checked; returns ``{"uncond": uncond, **conds}``."""
    if space not in ("logits", "logprobs"):
        raise ValueError(f"guidance space must be 'logits' or 'logprobs', got {space!r}")
    if isinstance(guidance_rescale, bool) or not (isinstance(guidance_rescale, (int, float)) and 0.0 <= guidance_rescale <= 1.0):
        raise ValueError(f"guidance_rescale must be in [0, 1], got {guidance_rescale!r}")
    if not isinstance(conds, Mapping) or not isinstance(scales, Mapping):
        raise TypeError(f"conds and scales must be mappings by branch name, got {type(conds).__name__} and "
                        f"{type(scales).__name__}")
    unknown = {k for k, s in scales.items() if k not in conds and s != 0}  # a branch at scale 0 need not be run
    if unknown:
        raise ValueError(f"scales name branches that were not computed: {sorted(unknown)}")
    if "uncond" in conds:
        raise ValueError("conds names a branch 'uncond': that is the unconditional branch, passed as uncond")
    tensors = {"uncond": uncond, **conds}
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} logits must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
        if t.shape != uncond.shape:
            raise ValueError(f"{name} logits have shape {tuple(t.shape)}, expected {tuple(uncond.shape)} (those of uncond)")
    return tensors


def _checked_branches(checked: dict[str, Tensor], names: list[str], work: torch.dtype, errors: Tensor | None) -> Tensor:
    """The branches ``names`` stacked in ``work`` ``(len(names), ..., v)``, after every branch in ``checked`` (whatever
    its scale) is checked for NaN and ``+inf`` in one pass over one stacked tensor: a ``ValueError``, or with ``errors``
    the flag set (no host read; those entries are computed as banned)."""
    given = list(checked.values())
    same = all(t.dtype == given[0].dtype for t in given)
    stacked = torch.stack(given if same else [t.to(work) for t in given])  # (branches given, ..., v)
    bad = (torch.isnan(stacked) | (stacked == float("inf"))).flatten(1).any(dim=1)  # (branches given,)
    if errors is not None:  # no host read: flag it; NaN/+inf entries are computed as banned below
        errors.logical_or_(bad.any())
    elif bool(bad.any()):  # one host sync per call
        name = list(checked)[int(bad.long().argmax())]
        raise ValueError(f"{name} logits hold NaN or +inf: only -inf (a banned token) is allowed besides finite values")
    index = [list(checked).index(k) for k in names]  # each used branch's row of ``stacked``, by name
    return (stacked if index == list(range(len(given))) else stacked[index]).to(work)


def _work_dtype(t: Tensor) -> torch.dtype:
    """Guidance arithmetic runs in float64 (float32 where the device has none)."""
    return torch.float32 if t.device.type == "mps" else torch.float64


def _combine(vals: Mapping[str, Tensor], used: Mapping[str, float], guidance_rescale: float,
             reference: Tensor | None, live: Tensor | None = None, *, out_dtype: torch.dtype,
             limit: float | None = None) -> Tensor:
    """``vals["uncond"] + sum_k used[k] * (vals[k] - vals["uncond"])`` (a single branch at scale 1 is that
    branch exactly), then the rescale toward ``reference``'s standard deviation over the last dim (over
    ``live`` entries only), shared by logits and continuous values. ``vals`` are finite (float64).

    Saturation: a row whose result would leave ``out_dtype``'s range (a huge scale) is computed as
    ``S * r`` with ``S = max |s_k|`` and ``r = u / S + sum_k (s_k / S) d_k`` (finite), and scaled down to
    fit (``limit``, default a quarter of ``out_dtype``'s largest value): its order and direction are kept.
    Returned in ``out_dtype``.
    """
    limit = torch.finfo(out_dtype).max / 4 if limit is None else limit  # headroom for a softmax's shift, the rescale
    live = torch.ones(vals["uncond"].shape, dtype=torch.bool, device=vals["uncond"].device) if live is None else live
    if len(used) == 1 and next(iter(used.values())) == 1.0:
        guided = vals[next(iter(used))]
    else:
        u = vals["uncond"]
        guided = u
        for k, s in used.items():
            guided = guided + s * (vals[k] - u)
        big = max([abs(s) for s in used.values()] or [1.0])
        if big > 1.0:  # a huge scale: keep the rows that would overflow finite and in order
            r = u / big
            for k, s in used.items():
                r = r + (s / big) * (vals[k] - u)
            peak = torch.where(live, r.abs(), 0.0).amax(dim=-1, keepdim=True)  # (..., 1)
            over = (peak * big > limit) | ~torch.isfinite(guided).all(dim=-1, keepdim=True)
            guided = torch.where(over, r * (limit / torch.where(over, peak, 1.0)), guided)
    if guidance_rescale > 0.0:
        ref = guided if reference is None else reference
        live = torch.ones(guided.shape, dtype=torch.bool, device=guided.device) if live is None else live
        std_ref, std_guided = _masked_std(ref, live), _masked_std(guided, live)
        flat = std_guided == 0
        ratio = torch.where(flat, 1.0, std_ref / torch.where(flat, 1.0, std_guided))
        guided = guidance_rescale * (guided * ratio) + (1.0 - guidance_rescale) * guided
    peak = torch.where(live, guided.abs(), 0.0).amax(dim=-1, keepdim=True)
    guided = torch.where(peak > limit, guided * (limit / torch.where(peak > limit, peak, 1.0)), guided)
    return guided.to(out_dtype)


# the largest magnitude guidance gives a continuous value: generated values are fed back into the model,
# whose float32 norms square them (2**60 squared is far inside float32's range)
VALUE_LIMIT = 2.0**60


def compose_values(uncond: Tensor, conds: Mapping[str, Tensor], scales: Mapping[str, float], *,
                   guidance_rescale: float = 0.0, reference: Tensor | None = None) -> Tensor:
    """``compose_guidance`` for continuous values ``(..., d)``: the same combination, rescale and saturation
    (computed in float64, returned in float32, float64 for float64 inputs), without banned entries; a
    branch at scale 0 is not read. Any finite scale gives finite values: a row past ``VALUE_LIMIT``
    saturates (scaled down to it, direction kept), so that values fed back into the model stay inside
    what its arithmetic takes."""
    dtype = torch.promote_types(uncond.dtype, torch.float32)
    work = _work_dtype(uncond)
    used = {k: float(scales[k]) for k in sorted(scales) if scales[k] != 0}
    vals = {k: t.to(work) for k, t in {"uncond": uncond, **conds}.items() if k == "uncond" or k in used}
    return _combine(vals, used, guidance_rescale, None if reference is None else reference.to(work), out_dtype=dtype,
                    limit=VALUE_LIMIT)


def _log_softmax(t: Tensor) -> Tensor:
    all_banned = (t == _NEG_INF).all(dim=-1, keepdim=True)
    return torch.where(all_banned, t, torch.where(all_banned, 0.0, t).log_softmax(dim=-1))


def _masked_std(x: Tensor, keep: Tensor) -> Tensor:
    """Sample standard deviation over the last dim counting only ``keep`` (0 with fewer than two)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = keep.sum(-1, keepdim=True).to(x.dtype)
    xs = torch.where(keep, x, zero)
    mean = xs.sum(-1, keepdim=True) / n.clamp(min=1)
    var = torch.where(keep, (xs - mean) ** 2, zero).sum(-1, keepdim=True) / (n - 1).clamp(min=1)
    return var.sqrt()


def guided_logits(cond: Tensor, uncond: Tensor, cond_scale: float, guidance_rescale: float = 0.0) -> Tensor:
    """Classifier-free guidance on logits: ``uncond + cond_scale * (cond - uncond)``.

    With ``guidance_rescale`` phi > 0 the guided logits are pulled back toward the standard deviation
    of the conditional ones (the "rescaled CFG" of arXiv 2305.08891, the std taken over the
    vocabulary dimension): ``rescaled = guided * std(cond) / std(guided)``, and the result is
    ``phi * rescaled + (1 - phi) * guided``. A row whose guided logits are all equal (std 0) is left
    as guided.

    A token whose logit is ``-inf`` in either branch (banned by a filter or a logits processor) stays
    ``-inf``: it is impossible under one of the two models, and the formula would otherwise give
    ``-inf - -inf = NaN``. The standard deviations of the rescale are taken over the other tokens.
    NaN or ``+inf`` logits are a ``ValueError``. Everything is computed in float32 (float64 for float64
    inputs), and the result stays in that dtype: a half-precision result would overflow for large scales.

    Args:
        cond: ``(..., v)`` conditional logits.
        uncond: ``(..., v)`` unconditional logits.
        cond_scale: guidance scale s (1: ``cond``, 0: ``uncond``, > 1: stronger guidance).
        guidance_rescale: phi in ``[0, 1]``.

    Returns:
        ``(..., v)`` guided logits in float32 (float64 for float64 inputs).
    """
    if not isinstance(cond, Tensor) or not isinstance(uncond, Tensor):
        raise TypeError(f"cond and uncond must be tensors, got {type(cond).__name__} and {type(uncond).__name__}")
    if cond.shape != uncond.shape:
        raise ValueError(f"cond and uncond must have the same shape, got {tuple(cond.shape)} and {tuple(uncond.shape)}")
    if not cond.is_floating_point() or not uncond.is_floating_point():
        raise TypeError(f"cond and uncond must be floating-point logits, got {cond.dtype} and {uncond.dtype}")
    s = _check_scale(cond_scale, "cond_scale")
    out = compose_guidance(uncond, {"joint": cond}, {"joint": s if s != 0 else 0.0},
                           guidance_rescale=guidance_rescale, reference=cond)
    if s == 0.0:  # scales of 0 drop the branch; its -inf tokens still count as banned
        out = out.masked_fill(cond == _NEG_INF, _NEG_INF)
    return out


# ----------------------------------------------------------------------------------------------------
# scales per branch and per step
# ----------------------------------------------------------------------------------------------------


@dataclass
class GuidanceSchedule:
    """The guidance scales of every sampling step, and the branches they need.

    Built from ``cond_scale``: a number (the joint scale), a mapping ``{"joint" | kind: scale}``, or a
    callable ``step -> number | mapping``; ``interval=(start, stop)`` guides only steps
    ``start <= t < stop`` (the others sample the joint, fully conditional branch).
    """

    branches: tuple[str, ...]  # conditional branches to compute, beside "uncond" (empty: no guidance)
    at: Callable[[int], dict[str, float]]

    @staticmethod
    def build(cond_scale, kinds: tuple[str, ...], interval: tuple[int, int] | None = None,
              guidance_rescale: float = 0.0, has_uncond: bool = True, steps: int = 1) -> GuidanceSchedule:
        allowed = ("joint", *kinds)

        def parse(value) -> dict[str, float]:
            if isinstance(value, Mapping):
                bad = [k for k in value if k not in allowed]
                if bad:
                    raise ValueError(f"cond_scale names {bad}; allowed: {list(allowed)} (the conditions given)")
                return {k: _check_scale(v, f"cond_scale[{k!r}]") for k, v in value.items()}
            return {"joint": _check_scale(value, "cond_scale")}

        if interval is not None:
            ok = (isinstance(interval, (tuple, list)) and len(interval) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in interval) and 0 <= interval[0] <= interval[1])
            if not ok:
                raise ValueError(f"guidance_interval must be (start, stop) step indices with 0 <= start <= stop, got {interval!r}")
        fn = cond_scale if callable(cond_scale) else None
        table = [parse(fn(t)) for t in range(max(steps, 1))] if fn else [parse(cond_scale)]  # a schedule: every step
        first = table[0]
        plain = first == {"joint": 1.0} and fn is None and interval is None
        if plain or not has_uncond:
            return GuidanceSchedule((), lambda t: {"joint": 1.0})
        used = set().union(*table)
        names = tuple(k for k in allowed if k in used)
        if (guidance_rescale > 0 or interval is not None) and "joint" not in names:
            names = ("joint", *names)

        def at(t: int) -> dict[str, float]:
            if interval is not None and not (interval[0] <= t < interval[1]):
                return {"joint": 1.0}
            return table[t] if fn and t < len(table) else (parse(fn(t)) if fn else first)

        return GuidanceSchedule(names, at)


def check_condition_tensor(t, name: str, want: tuple, device, *, dtype: torch.dtype | None = None,
                           shape_text: str | None = None, where: str = "") -> None:
    """``t`` is a floating-point tensor of shape ``want`` (``None``: any size) on ``device`` (and of
    ``dtype`` outside autocast, when given): else a clear error naming ``name`` (S9)."""
    if not isinstance(t, Tensor) or t.dim() != len(want) or any(w is not None and w != s for w, s in zip(want, t.shape)):
        shape = shape_text or "(" + ", ".join("*" if w is None else str(w) for w in want) + ")"
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {shape}, got {got}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}{where}")
    if dtype is not None and t.dtype != dtype and not torch.is_autocast_enabled(t.device.type):
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")


def check_condition_args(conds: Conditions, b: int, device, layers, prefix: str = "") -> None:
    """Shapes, dtypes and devices of every condition given, against the stack ``layers`` (S9); ``prefix``
    names negative ones."""
    for kind in conds.kinds():
        spec = CONDITION_KINDS[kind]
        t, m = conds.pair(kind)
        name, mname = prefix + spec.value, prefix + spec.mask
        width = spec.width(layers)
        if width is None:
            raise ValueError(f"{name} was given but the model has no {spec.needs}")
        want = (b, None, width) if spec.sequence else (b, width)
        check_condition_tensor(t, name, want, device, where=" (the device of the prompts)")
        if m is not None:
            validate_mask(m, mname, shape=spec.mask_shape(t), device=device)
    for spec in CONDITION_KINDS.values():
        t, m = conds.pair(spec.name)
        if m is not None and t is None:
            raise ValueError(f"{prefix}{spec.mask} was given without {prefix}{spec.value}")


def drop_probabilities(cond_drop_prob, name: str = "cond_drop_prob") -> dict[str, float]:
    """``{kind: p}`` from one number (every kind) or a mapping ``{"context" | "prepend" | "condition": p}``."""
    def check(p, what):
        if isinstance(p, bool) or not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
            raise ValueError(f"{what} must be a probability in [0, 1], got {p!r}")
        return float(p)

    if isinstance(cond_drop_prob, Mapping):
        bad = [k for k in cond_drop_prob if k not in KINDS]
        if bad:
            raise ValueError(f"{name} names unknown conditions {bad}; the kinds are {list(KINDS)}")
        return {k: check(cond_drop_prob.get(k, 0.0), f"{name}[{k!r}]") for k in KINDS}
    if not isinstance(cond_drop_prob, (int, float)) or isinstance(cond_drop_prob, bool):
        raise TypeError(f"{name} must be a number or a mapping {{kind: p}}, got {type(cond_drop_prob).__name__}")
    p = check(cond_drop_prob, name)
    return {k: p for k in KINDS}


def guidance_branches(conds: Conditions, negatives: Conditions, schedule: GuidanceSchedule, steps: int, *,
                      need_joint: bool = False, nulls: Mapping[str, tuple[Tensor, Tensor | None]] | None = None,
                      ) -> tuple[tuple[str, ...], list[Conditions]]:
    """The branches guidance needs, in order (``joint`` first when run, then ``uncond``, then one per
    guided kind), and each branch's conditions.

    ``joint`` keeps every condition, ``uncond`` drops them all (or uses the negatives), ``<kind>`` keeps
    only that kind. A dropped kind is its tensor with an all-False mask (an exact no-op), the stack's null
    condition for the adaptive kind, or ``nulls[kind]`` (a learned null token). A branch whose scale is 0
    at every step is not run (the joint one still is when ``need_joint``: the rescale's reference, a
    probabilistic model's variance), so ``cond_scale=0`` runs the unconditional branch alone.
    """
    if not schedule.branches:
        return ("joint",), [conds]
    table = [schedule.at(t) for t in range(max(steps, 1))]
    used = {k for scales in table for k, s in scales.items() if s != 0}
    others = tuple(k for k in schedule.branches if k != "joint" and k in used)
    joint = ("joint",) if ("joint" in used or need_joint) else ()
    names = joint + ("uncond",) + others
    branches = []
    for name in names:
        br = conds
        for kind in conds.kinds():
            if name in ("joint", kind):
                continue
            neg_t, neg_m = negatives.pair(kind)
            if name == "uncond" and neg_t is not None:
                br = br.with_pair(kind, neg_t, _full_mask(neg_t, neg_m, kind))
            else:
                br = br.with_pair(kind, *null_of(conds, kind, (nulls or {}).get(kind)))
        branches.append(br)
    return names, branches
def adaptive_condition(stack, condition, condition_mask, cache, b: int, x: Tensor) -> Tensor | None:
    """The ``(b, K)`` condition of the adaptive layers: the user's, with the null condition selected in
    for dropped samples (``condition_mask`` False) or for all (``condition=None``)."""
    if not stack.adaptive:
        if condition is not None or condition_mask is not None:
            raise ValueError("condition was given but this stack has no adaptive layers; build it with "
                             "use_adaptive_layernorm=True (or use_adaptive_rmsnorm / use_adaptive_layerscale)")
        return None
    if condition_mask is not None and condition is None:
        raise ValueError("condition_mask was given without a condition; pass condition=... as well")
    if cache is not None and cache.condition is not None:
        if condition is not None and not (condition is cache.condition_input and condition_mask is cache.condition_mask):
            raise ValueError("condition was passed with a cache built with another: the cache answers for the "
                             "condition of the call that built it (pass the very same tensors, or none)")
        return cache.condition
    null = stack.null_condition.to(x.dtype)[None].expand(b, -1)  # (b, K)
    if condition is None:
        return null
    check_condition_tensor(condition, "condition", (b, stack.dim_condition), x.device, dtype=x.dtype,
                           shape_text=f"(b={b}, dim_condition={stack.dim_condition})")
    if condition_mask is None:
        return condition
    validate_mask(condition_mask, "condition_mask", shape=(b,), device=x.device)
    return torch.where(condition_mask[:, None], condition, null)  # a dropped row is selected away

