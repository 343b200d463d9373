"""Autoregressive training and generation, with classifier-free guidance (CFG).

Shape legend: b batch, n prompt (sequence) positions, t generated positions (``seq_len``), j context
length, c_ctx context width, v vocabulary size.
Masks follow the one convention (bool, True = real position / may attend; see ``masks.py``).

CFG in one paragraph: a conditional decoder is trained with its condition dropped for a random part of
the batch (``cond_drop_prob``), so the same weights model ``p(x | c)`` and ``p(x)``. At sampling time
both are run and the logits are pushed away from the unconditional ones:
``uncond + s * (cond - uncond)``. The "unconditional" branch is the empty context (an all-False
``context_mask``, which safeformer makes an exact no-op for cross-attention), a learned null token, or
a user's ``negative_context``. Both branches run as one batched forward pass of ``2b`` samples sharing
one KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.cache import LayerIntermediates
from ..core.conditions import (
    Conditions,
    GuidanceSchedule,
    check_condition_args,
    check_drop_kinds,
    compose_guidance,
    condition_kwargs,
    drop_conditions,
    drop_probabilities,
    guided_logits,
)
from ..core.losses import next_token_loss
from ..core.masks import check_lengths, checked_once, validate_mask
from ..stack.wrappers import TransformerWrapper
from .decode import GuidedForward, autoregress
from .looped import looped_call, looped_loss
from .prompts import batch_prompts, left_pad

__all__ = [
    "AutoregressiveWrapper",
    "generate_tokens",
    "beam_search_tokens",
    "guided_logits",
    "sample_logits",
    "top_k",
    "top_p",
    "min_p",
    "top_a",
    "left_pad",
    "FILTERS",
]

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------
# Logit filters and sampling
# ----------------------------------------------------------------------------------------------------


def top_k(logits: Tensor, frac_num_tokens: float = 0.1, k: int | None = None) -> Tensor:
    """Keep the ``k`` largest logits of each row; the rest become ``-inf`` (x-transformers' ``top_k``, its
    signature and argument order).

    Args:
        logits: ``(..., v)`` scores.
        frac_num_tokens: the share of the vocabulary kept when ``k`` is not given, in ``(0, 1]``
            (x-transformers' default 0.1): ``ceil(frac_num_tokens * v)`` tokens. An int (or bool) here is a
            ``TypeError``: a count is ``k=``.
        k: how many to keep (at least 1; more than ``v`` keeps all). Exactly ``k`` are kept even
            when values tie.

    Returns:
        ``(..., v)`` filtered logits.
    """
    if isinstance(frac_num_tokens, (bool, int)):
        raise TypeError(f"top_k: frac_num_tokens is a fraction in (0, 1] (x-transformers' order); pass k=... for a "
                        f"count, got frac_num_tokens={frac_num_tokens!r}")
    if k is None:
        if not (isinstance(frac_num_tokens, float) and 0.0 < frac_num_tokens <= 1.0):
            raise ValueError(f"top_k needs frac_num_tokens in (0, 1], got frac_num_tokens={frac_num_tokens!r}")
        k = max(1, math.ceil(frac_num_tokens * logits.shape[-1]))
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k needs an integer k >= 1, got k={k!r}")
    k = min(k, logits.shape[-1])
    idx = logits.topk(k, dim=-1).indices
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)
    return logits.masked_fill(~keep, _NEG_INF)


def top_p(logits: Tensor, p: float | None = None, *, thres: float | None = None) -> Tensor:
    """Nucleus filter: keep the most probable tokens until their probability mass reaches ``p``.

    A token is kept when the mass of the tokens ranked above it is below ``p``; the most probable
    token is always kept.

    Args:
        logits: ``(..., v)`` scores.
        p: the mass to keep, in ``(0, 1]`` (1 keeps every token); default 0.9.
        thres: x-transformers' name for ``p`` (give one of the two).

    Returns:
        ``(..., v)`` filtered logits.
    """
    if thres is not None:
        if p is not None:
            raise ValueError("top_p takes p or thres (x-transformers' name for it), not both")
        p = thres
    p = 0.9 if p is None else p
    if isinstance(p, bool) or not (isinstance(p, (int, float)) and 0.0 < p <= 1.0):
        raise ValueError(f"top_p needs p in (0, 1], got p={p!r}")
    if p >= 1.0:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.float().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(-1, idx, remove_sorted)
    return logits.masked_fill(remove, _NEG_INF)


def min_p(logits: Tensor, min_p: float = 0.1) -> Tensor:
    """Keep the tokens whose probability is at least ``min_p`` times the most probable token's.

    Args:
        logits: ``(..., v)`` scores.
        min_p: the relative threshold, in ``[0, 1]`` (0 keeps all, 1 keeps only the top tokens).

    Returns:
        ``(..., v)`` filtered logits.
    """
    if isinstance(min_p, bool) or not (isinstance(min_p, (int, float)) and 0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p needs min_p in [0, 1], got min_p={min_p!r}")
    probs = logits.float().softmax(dim=-1)
    limit = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < limit, _NEG_INF)


def top_a(logits: Tensor, min_p_pow: float = 2.0, min_p_ratio: float = 0.02) -> Tensor:
    """Keep the tokens whose probability is at least ``min_p_ratio * p_max ** min_p_pow`` (x-transformers'
    ``top_a``); the most probable token is always kept.

    Args:
        logits: ``(..., v)`` scores.
        min_p_pow: the power of the largest probability, > 0.
        min_p_ratio: the ratio, in ``[0, 1]``.

    Returns:
        ``(..., v)`` filtered logits.
    """
    if isinstance(min_p_pow, bool) or not (isinstance(min_p_pow, (int, float)) and min_p_pow > 0 and math.isfinite(min_p_pow)):
        raise ValueError(f"top_a needs min_p_pow > 0, got {min_p_pow!r}")
    if isinstance(min_p_ratio, bool) or not (isinstance(min_p_ratio, (int, float)) and 0.0 <= min_p_ratio <= 1.0):
        raise ValueError(f"top_a needs min_p_ratio in [0, 1], got {min_p_ratio!r}")
    # float32 at least, float64 kept: float64 logits beyond float32's range would turn to inf (NaN probabilities,
    # nothing filtered)
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    limit = torch.minimum(top.pow(min_p_pow) * min_p_ratio, top)  # never above the best token
    return logits.masked_fill(probs < limit, _NEG_INF)


FILTERS: dict[str, Callable[..., Tensor]] = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "top_a": top_a}


def _resolve_filter(filter_logits_fn) -> Callable[..., Tensor] | None:
    if filter_logits_fn is None or callable(filter_logits_fn):
        return filter_logits_fn
    if isinstance(filter_logits_fn, str) and filter_logits_fn in FILTERS:
        return FILTERS[filter_logits_fn]
    raise ValueError(
        f"filter_logits_fn must be a callable or one of {sorted(FILTERS)}, got {filter_logits_fn!r}"
    )


def sample_logits(
    logits: Tensor,
    temperature: float = 1.0,
    filter_logits_fn: Callable[..., Tensor] | str | None = None,
    filter_kwargs: dict[str, Any] | None = None,
) -> Tensor:
    """Draw one token per row of ``logits (b, v)``.

    The logits are divided by ``temperature``, then filtered (``top_k`` / ``top_p`` / ``min_p`` / ``top_a``
    or any callable ``fn(logits, **filter_kwargs)``), then sampled from their softmax.

    Args:
        logits: ``(b, v)`` scores, ``v >= 1``; ``-inf`` bans a token, NaN and ``+inf`` are errors.
        temperature: ``0.0`` is greedy (argmax). The built-in filters keep each row's largest logit, so under
            greedy they change nothing and are skipped; a callable filter is applied before the argmax.
        filter_logits_fn: a callable, or the name of one of ``FILTERS``.
        filter_kwargs: keyword arguments for the filter (``{"k": 10}``, ``{"p": 0.9}``, ...).

    Returns:
        ``(b,)`` token ids (long).

    Raises:
        TypeError, ValueError: ``logits`` is not a ``(b, v)`` float tensor; a bad temperature, filter or
            ``filter_kwargs``; a row with nothing to draw (every logit ``-inf`` after the filter) or holding
            NaN / ``+inf``.
    """
    fn = check_sampling(temperature, filter_logits_fn, filter_kwargs)
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor (b, v), got {getattr(logits, 'dtype', type(logits).__name__)}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must have shape (b, v) with v >= 1, got {tuple(logits.shape)}")
    nothing = torch.zeros((), dtype=torch.bool, device=logits.device)
    out = draw(logits, temperature, fn, filter_kwargs, nothing)
    if bool(nothing):
        raise ValueError(NOTHING_TO_DRAW)
    return out


NOTHING_TO_DRAW = ("logits: a row had no token to draw (every logit -inf after the filter), or held NaN or +inf: "
                   "a filter (or a logit bias) must leave each row at least one finite logit")

_KEEP_MAX = frozenset(FILTERS.values())  # filters that keep every row's largest logit: greedy needs none of them


def check_sampling(temperature, filter_logits_fn, filter_kwargs) -> Callable[..., Tensor] | None:
    """The checks of ``sample_logits``' arguments besides the logits; returns the filter function. A built-in
    filter's keywords are tried on a small row, so a bad one is reported before any step, greedy or not."""
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and temperature >= 0.0
                                             and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    fn = _resolve_filter(filter_logits_fn)
    if filter_kwargs is not None and fn is None:
        raise ValueError("filter_kwargs was given without filter_logits_fn; name the filter it is for")
    if filter_kwargs is not None and not isinstance(filter_kwargs, dict):
        raise TypeError(f"filter_kwargs must be a dict, got {type(filter_kwargs).__name__}")
    if fn in _KEEP_MAX:
        fn(torch.zeros(1, 4), **(filter_kwargs or {}))
    return fn


def draw(logits: Tensor, temperature: float, fn, filter_kwargs, nothing: Tensor | None = None) -> Tensor:
    """``sample_logits`` on checked arguments (``fn`` resolved), for the decode loops: no host read.

    ``nothing``: a 0-d bool flag, set (on the device) where a row has nothing to draw: every logit ``-inf``
    after the filter, or NaN / ``+inf`` there. Such a row draws from a uniform row instead of failing inside
    ``torch.multinomial``; the caller raises ``NOTHING_TO_DRAW`` when it reads the flag. Under greedy the
    flag is only computed when given."""
    if temperature == 0.0:
        if fn is not None and fn not in _KEEP_MAX:  # a callable filter may remove the argmax: apply it
            logits = fn(logits, **(filter_kwargs or {}))
        if nothing is not None:
            nothing.logical_or_(~torch.isfinite(logits.amax(dim=-1)).all())
        return logits.argmax(dim=-1)
    # subtract the row's max before dividing: a tiny temperature then sends the others to -inf instead of
    # overflowing to +inf (and a temperature below float32's range does not give 0/0 at the max)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        diff = logits - logits.amax(dim=-1, keepdim=True)
        logits = torch.where(diff == 0, 0.0, diff / temperature)
    if fn is not None:
        logits = fn(logits, **(filter_kwargs or {}))
    if nothing is not None:
        ok = torch.isfinite(logits.amax(dim=-1, keepdim=True))  # (b, 1): a finite largest logit
        nothing.logical_or_(~ok.all())
        logits = torch.where(ok, logits, 0.0)  # a failed row draws uniformly (the caller raises)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1).squeeze(-1)


# ----------------------------------------------------------------------------------------------------
# Guidance
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------


def guided_logits_combine(schedule: GuidanceSchedule, guidance_rescale: float = 0.0,
                          space: str = "logits", errors: Tensor | None = None,
                          compile: bool = False) -> Callable[[dict[str, Tensor], int], Tensor]:
    """The decode engine's combine function for logits: ``compose_guidance`` at step ``t``'s scales
    (the joint branch alone, unguided, is returned as it is). ``errors``: see ``compose_guidance``.
    ``compile``: ``compose_guidance`` compiled (``fullgraph=True``; one graph per distinct set of scales)."""
    compose = compose_guidance
    if compile:
        from .static import compile_options

        compose = torch.compile(compose_guidance, fullgraph=True, dynamic=False,
                                **compile_options(errors.device if errors is not None else "cpu"))

    def combine(outs: dict[str, Tensor], t: int) -> Tensor:
        if len(outs) == 1:
            return next(iter(outs.values()))
        uncond = outs.pop("uncond")
        return compose(uncond, outs, schedule.at(t), guidance_rescale=guidance_rescale,
                       reference=outs.get("joint"), space=space, errors=errors)

    return combine


def _check_context_arg(t: Tensor | None, name: str, b: int, device, width: int | None = None) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[0] != b:
        raise ValueError(f"{name} must have shape (b={b}, j, c_ctx), got {getattr(t, 'shape', type(t))}")
    if width is not None and t.shape[-1] != width:
        raise ValueError(f"{name} must have feature size dim_context={width}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of the prompts)")


def check_pad_value(pad_value) -> int:
    """``pad_value`` only fills outputs (after a sample's EOS, at padded positions): it is never embedded,
    so any integer will do, ``-1`` included (x-transformers' habit); not a bool."""
    if isinstance(pad_value, bool) or not isinstance(pad_value, int):
        raise TypeError(f"pad_value must be an int (it only fills outputs; -1 is fine), got {pad_value!r}")
    return pad_value


@dataclass(frozen=True)
class DecodeOptions:
    """A generation's sampling, guidance and cache options as the doors take them (``from_kwargs`` reads them from a
    door's keywords; an option the door lacks keeps its default); ``_prepare`` and ``_check_decode_flags`` check
    them."""

    temperature: float = 1.0
    filter_logits_fn: Callable[..., Tensor] | str | None = None
    filter_kwargs: dict[str, Any] | None = None
    eos_token: int | None = None
    cache_kv: bool = True
    cond_scale: float | Mapping[str, float] | Callable[[int], float | Mapping[str, float]] = 1.0
    guidance_rescale: float = 0.0
    guidance_interval: tuple[int, int] | None = None
    guidance_space: str = "logits"
    restrict_to_max_seq_len: bool = True
    static_cache: bool = True
    compile: bool = False
    eos_check_every: int = 16

    @classmethod
    def from_kwargs(cls, kwargs: Mapping) -> DecodeOptions:
        """The options among ``kwargs`` (a door's ``locals()``)."""
        return cls(**{f.name: kwargs[f.name] for f in fields(cls) if f.name in kwargs})


def _check_prompts(net, prompts, seq_len, mask, pad_value) -> None:
    """The checks of the net, the prompts, their mask, ``seq_len`` and ``pad_value``."""
    if not isinstance(net, TransformerWrapper):
        raise TypeError(f"net must be a TransformerWrapper, got {type(net).__name__}")
    if getattr(net, "num_output_heads", 1) > 1:
        raise ValueError("net has num_output_heads > 1 (a tuple of logits): generation samples from one head")
    if not isinstance(prompts, Tensor) or prompts.dim() != 2:
        raise ValueError(f"prompts must be token ids of shape (b, n), got {getattr(prompts, 'shape', type(prompts))}")
    if prompts.dtype.is_floating_point or prompts.dtype == torch.bool or prompts.is_complex():
        raise TypeError(f"prompts must hold integer token ids, got dtype {prompts.dtype}")
    b, n = prompts.shape
    check_pad_value(pad_value)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an integer >= 0, got {seq_len!r}")
    if n == 0:
        raise ValueError("prompts must hold at least one token per sample (got n = 0 positions)")
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n), device=prompts.device)
        empty = ~mask.any(dim=1)
        if bool(empty.any()):
            raise ValueError(
                f"every prompt needs at least one real token; mask rows {empty.nonzero().flatten().tolist()} are all False"
            )


def _check_options(net, o: DecodeOptions) -> None:
    """The checks of the sampling and guidance options (the guidance scales are ``GuidanceSchedule.build``'s)."""
    check_sampling(o.temperature, o.filter_logits_fn, o.filter_kwargs)
    eos_token, guidance_rescale = o.eos_token, o.guidance_rescale
    if eos_token is not None and (isinstance(eos_token, bool) or not isinstance(eos_token, int)):
        raise TypeError(f"eos_token must be an int or None, got {eos_token!r}")
    if eos_token is not None and not 0 <= eos_token < net.num_tokens:  # it could never be drawn: no sample would stop
        raise ValueError(f"eos_token must be a token id in [0, num_tokens={net.num_tokens}), got {eos_token}")
    if isinstance(guidance_rescale, bool) or not (isinstance(guidance_rescale, (int, float)) and 0.0 <= guidance_rescale <= 1.0):
        raise ValueError(f"guidance_rescale must be in [0, 1], got {guidance_rescale!r}")
    if o.guidance_space not in ("logits", "logprobs"):
        raise ValueError(f"guidance_space must be 'logits' or 'logprobs', got {o.guidance_space!r}")
    if not isinstance(o.restrict_to_max_seq_len, bool):
        raise TypeError(f"restrict_to_max_seq_len must be True or False, got {o.restrict_to_max_seq_len!r}")


def _window(net, n: int, m: int, seq_len: int, restrict_to_max_seq_len: bool) -> int | None:
    """The sliding window (``restrict_to_max_seq_len``) a prompt of ``n`` tokens after a prefix of ``m`` rows needs
    for ``seq_len`` new tokens, or ``None``; a learned absolute position embedding cannot go that far: an error."""
    needed = m + n + seq_len - 1  # positions the last step's forward sees
    # a prefix takes no absolute position (x-transformers' convention): only the tokens count against the embedding
    if net.pos_emb is not None and n + seq_len - 1 > net.max_seq_len:
        raise ValueError(
            f"a prompt of {n} positions plus seq_len={seq_len} new tokens needs "
            f"{n + seq_len - 1} positions, more than the model's max_seq_len={net.max_seq_len}: its learned absolute position "
            f"embedding has no position past max_seq_len - 1, so not even a sliding window (restrict_to_max_seq_len) "
            f"can go on. Generate fewer tokens, or use relative positions (Decoder(..., rotary_pos_emb=True) or "
            f"alibi_pos_bias=True), which can slide past max_seq_len"
        )
    # max_seq_len 0 or None (no absolute positions; x-transformers' 0): no bound, no window
    return net.max_seq_len if restrict_to_max_seq_len and net.max_seq_len and needed > net.max_seq_len else None


def _prepare(net, prompts, seq_len, mask, conds: Conditions, negatives: Conditions, null_context, o: DecodeOptions,
             pad_value):
    """Every check of a generation's arguments. Returns ``(conds, negatives, schedule, nulls, window)``."""
    _check_prompts(net, prompts, seq_len, mask, pad_value)
    _check_options(net, o)
    b, n = prompts.shape
    device = prompts.device
    layers = net.attn_layers
    conds.check(net, b, device)
    negatives = negatives.expand_batch(b).check(net, b, device, prefix="negative_")
    if null_context is not None:
        check_condition_args(Conditions(context=null_context), b, device, layers, prefix="null_")
    m = 0 if conds.prepend_embeds is None else conds.prepend_embeds.shape[1]
    window = _window(net, n, m, seq_len, o.restrict_to_max_seq_len)
    conds = conds.with_empty_for(negatives, b)  # a negative condition alone: the conditional branch sees it empty
    schedule = GuidanceSchedule.build(o.cond_scale, conds.kinds(), o.guidance_interval, o.guidance_rescale,
                                      has_uncond=bool(conds.kinds()), steps=seq_len)
    nulls = {} if null_context is None else {"context": (null_context, None)}
    return conds, negatives, schedule, nulls, window


@torch.no_grad()
def generate_tokens(
    net: TransformerWrapper, prompts: Tensor, seq_len: int, *, mask: Tensor | None = None,
    context: Tensor | None = None, context_mask: Tensor | None = None,
    negative_context: Tensor | None = None, negative_context_mask: Tensor | None = None,
    temperature: float = 1.0, filter_logits_fn: Callable[..., Tensor] | str | None = None,
    filter_kwargs: dict[str, Any] | None = None, eos_token: int | None = None, cache_kv: bool = True,
    cond_scale: float | Mapping[str, float] | Callable[[int], float | Mapping[str, float]] = 1.0,
    guidance_rescale: float = 0.0, pad_value: int = 0, prepend_embeds: Tensor | None = None,
    prepend_mask: Tensor | None = None, condition: Tensor | None = None, condition_mask: Tensor | None = None,
    negative_prepend_embeds: Tensor | None = None, negative_prepend_mask: Tensor | None = None,
    negative_condition: Tensor | None = None, null_context: Tensor | None = None,
    guidance_interval: tuple[int, int] | None = None, guidance_space: str = "logits",
    restrict_to_max_seq_len: bool = True, static_cache: bool = True, compile: bool = False,
    eos_check_every: int = 16, _two_pass: bool = False, **conditions,
) -> Tensor:
    """Sample ``seq_len`` tokens from a causal ``TransformerWrapper`` (the engine of every ``generate``).

    Args:
        net: a ``TransformerWrapper`` around a ``Decoder``.
        prompts: ``(b, n)`` token ids.
        seq_len: how many tokens to generate.
        mask: ``(b, n)`` prompt padding mask (True = real). Prompts of different lengths are usually left-padded; any
            padding works since positions count real tokens only. Every prompt needs at least one real token.
        context, context_mask: the condition ``(b, j, c_ctx)`` / ``(b, j)`` for cross-attention.
        negative_context, negative_context_mask: the unconditional branch's context (a negative prompt, a learned null
            token); ``None``: the conditional context with an all-False mask (the empty context).
        temperature: softmax temperature; ``0.0`` is greedy.
        filter_logits_fn, filter_kwargs: a logit filter (``top_k``, ``top_p``, ``min_p``, their names, or any callable
            ``fn(logits, **filter_kwargs)``), applied after the temperature.
        eos_token: each sample stops after producing it; its later positions hold ``pad_value``.
        cache_kv: decode with the KV cache (one new token per step); the tokens equal those of the uncached path
            (recomputing the whole sequence each step).
        cond_scale: the guidance scales. A number s: ``uncond + s * (joint - uncond)`` (``1.0`` runs the conditional
            branch only). A mapping ``{"joint": s, "context": s_c, "prepend": s_p, "condition": s_a}`` (any subset of
            the conditions given): compositional guidance ``uncond + sum_k s_k * (cond_k - uncond)``, where ``cond_k``
            keeps only condition k and ``joint`` keeps all. A callable ``step -> number | mapping``: a per-step
            schedule. Every branch runs in one batched forward sharing one KV cache.
        guidance_rescale: phi of ``guided_logits`` (toward the joint branch's standard deviation).
        pad_value: token written after a sample's ``eos_token``.
        prepend_embeds, prepend_mask: a prefix ``(b, m, dim)`` / ``(b, m)`` (prefix conditioning).
        condition, condition_mask: the adaptive-norm condition ``(b, K)`` / ``(b,)``.
        negative_prepend_embeds, negative_prepend_mask, negative_condition: negative conditions for the unconditional
            branch (like ``negative_context``); by default it sees every condition dropped.
        null_context: ``(b, m, c_ctx)`` what a dropped context is in the per-condition branches (a learned null
            token); default: the empty context.
        guidance_interval: ``(start, stop)``: guide only steps ``start <= t < stop``; the others sample the joint
            (fully conditional) branch.
        guidance_space: ``"logits"`` or ``"logprobs"`` (each branch log-softmaxed before combining).
        restrict_to_max_seq_len: a sliding window (x-transformers' option of the same name) for nets with relative
            positions (rotary, ALiBi, or none): once a sample's sequence (real prefix rows, real prompt tokens and
            generated tokens) is longer than ``net.max_seq_len``, each next token is predicted from its last
            ``max_seq_len`` real positions only, exactly as if they were the whole input (the window counts real
            tokens, not padded slots, so a left-padded batch equals each prompt alone; a prefix's rows are the oldest
            positions and leave the window first). The KV cache serves every step up to ``max_seq_len``; past it, each
            step re-encodes the window (a trimmed cache would differ from the second layer on, whose cached keys saw
            tokens that have left the window), so the cached and uncached paths give the same tokens. ``False``: every
            token sees the whole sequence, however long. The cross-attention context and the adaptive condition are
            never cut.
        static_cache: after the prompt, decode on a preallocated cache written in place, one fixed-shape step per
            token that reads nothing back to the host (``static.py``); the same tokens as the dynamic cache. Used
            where it applies (``cache_kv``, no sliding window reached, no attention option that runs the explicit
            path); ``False``: the dynamic cache.
        compile: compile the static step (``torch.compile(fullgraph=True)``, fixed shapes: one graph per generation
            length); on a GPU the way to CUDA graphs. Compilation takes seconds, so it pays only over long or repeated
            generations; on the CPU measure it first (``benchmarks/generation_speed.py``).
        eos_check_every: with ``eos_token``, look whether every sample has finished (a read of a device value by the
            host) every this many steps; between checks no step waits for the device.

    Returns:
        ``(b, seq_len)`` the new tokens (long).

    Raises:
        ValueError: a bad shape, mask, value or option (named); a net with a learned absolute position embedding asked
            for more than ``max_seq_len`` positions (either setting of ``restrict_to_max_seq_len``).
        TypeError: a tensor of the wrong dtype, a non-bool ``restrict_to_max_seq_len``.
    """
    kw = {**locals(), **condition_kwargs("generate_tokens", conditions, negatives=True)}
    return _generate(net, prompts, seq_len, Conditions.from_kwargs(kw), Conditions.from_kwargs(kw, "negative_"),
                     null_context, DecodeOptions.from_kwargs(kw), mask=mask, pad_value=pad_value, two_pass=_two_pass)


def _check_decode_flags(o: DecodeOptions) -> None:
    """The checks of the static cache, compile and EOS-check options."""
    for name, flag in (("static_cache", o.static_cache), ("compile", o.compile)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if isinstance(o.eos_check_every, bool) or not isinstance(o.eos_check_every, int) or o.eos_check_every < 1:
        raise ValueError(f"eos_check_every must be a positive integer, got {o.eos_check_every!r}")


@torch.no_grad()
def _generate(net, prompts, seq_len, conds: Conditions, negatives: Conditions, null_context, o: DecodeOptions, *,
              mask, pad_value, two_pass=False, call=None) -> Tensor:
    """``generate_tokens`` on conditions already gathered into ``Conditions`` (checked here, once)."""
    conds, negatives, schedule, nulls, window = _prepare(net, prompts, seq_len, mask, conds, negatives, null_context,
                                                         o, pad_value)
    _check_decode_flags(o)
    temperature, filter_kwargs, eos_token = o.temperature, o.filter_kwargs, o.eos_token
    eos_check_every = o.eos_check_every
    filter_fn = _resolve_filter(o.filter_logits_fn)
    b, device = prompts.shape[0], prompts.device

    out = torch.full((b, seq_len), pad_value, dtype=torch.long, device=device)
    if seq_len == 0 or b == 0:  # nothing to generate: empty in, empty out
        return out
    was_training = net.training
    net.eval()
    try:
        errors = torch.zeros((), dtype=torch.bool, device=device)  # NaN/+inf logits, read at the checks only
        engine = GuidedForward(net if call is None else call, b, conds, negatives, schedule,
                               guided_logits_combine(schedule, o.guidance_rescale, o.guidance_space, errors,
                                                     compile=o.compile),
                               need_joint=o.guidance_rescale > 0, nulls=nulls, cache_kv=o.cache_kv, steps=seq_len,
                               window=window, two_pass=two_pass, static=o.static_cache or o.compile, compile=o.compile)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        # a row left with no token to draw (a callable filter, or sampling from -inf / NaN logits): flagged on the
        # device, read at the checks; greedy decoding with the model's logits alone cannot come to that
        nothing = None
        if temperature > 0 or (filter_fn is not None and filter_fn not in _KEEP_MAX):
            nothing = torch.zeros((), dtype=torch.bool, device=device)

        def pick(logits: Tensor, t: int) -> tuple[Tensor, bool]:
            """The sampled token is fed back (a finished sample's output shows ``pad_value`` instead, which
            may be no token id at all, e.g. -1: it is never embedded)."""
            nonlocal done
            sampled = draw(logits, temperature, filter_fn, filter_kwargs, nothing)
            tok = torch.where(done, pad_value, sampled)
            out[:, t] = tok
            # the host reads the device's flags every eos_check_every steps only: no step waits for another
            check = (t + 1) % eos_check_every == 0
            if check:
                raise_on_flags()
            if eos_token is None:
                return sampled, False
            done = done | (tok == eos_token)
            return sampled, check and bool(done.all())

        def raise_on_flags():
            engine.check_tokens()  # a fed id outside the vocabulary first: every output after it is void
            if bool(errors):
                raise ValueError("the model's logits held NaN or +inf during guided generation: only -inf (a banned "
                                 "token) is allowed besides finite values")
            if nothing is not None and bool(nothing):
                raise ValueError(NOTHING_TO_DRAW)

        # a returned KV cache (generate(return_intermediates=True)) must be made of ordinary tensors
        autoregress(engine, prompts, mask, seq_len, pick, inference=call is None or not call.keep_cache)
        raise_on_flags()
    finally:
        net.train(was_training)
    return out


def _gumbel_like(t: Tensor) -> Tensor:
    """Gumbel(0, 1) noise, finite: the uniform draw is kept inside (0, 1)."""
    tiny = torch.finfo(t.dtype).tiny
    u = torch.rand_like(t).clamp(min=tiny, max=1.0 - torch.finfo(t.dtype).eps)
    return -torch.log(-torch.log(u))


def _beam_candidates(logits: Tensor, kc: int, done: Tensor, pad_value: int, stochastic: bool, temperature: float,
                     filter_fn, filter_kwargs) -> tuple[Tensor, Tensor]:
    """Each beam's ``kc`` candidate tokens and their log-probabilities (float32): ``((B, kc), (B, kc))``.

    A finished beam has one candidate, ``pad_value`` with log-probability 0 (its score is kept); the
    others are ``-inf``. With ``stochastic`` the candidates are drawn without replacement (Gumbel top-k
    over the filtered, tempered logits); a token the filter removed scores ``-inf``.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = logits.log_softmax(dim=-1)  # (B, v)
    if stochastic and temperature > 0:  # as sample_logits: the temperature, then the filter
        diff = logits - logits.amax(dim=-1, keepdim=True)  # the max is 0: a tiny temperature cannot overflow
        z = torch.where(diff == 0, 0.0, diff / temperature)
        if filter_fn is not None:
            z = filter_fn(z, **(filter_kwargs or {}))
        cand = (z + _gumbel_like(z)).topk(kc, dim=-1).indices
        delta = torch.where(z.gather(-1, cand) == _NEG_INF, _NEG_INF, logp.gather(-1, cand))
    else:
        delta, cand = logp.topk(kc, dim=-1)
    first = torch.zeros_like(delta).index_fill_(1, torch.zeros(1, dtype=torch.long, device=delta.device), 1.0).bool()
    cand = torch.where(done[:, None], pad_value, cand)
    delta = torch.where(done[:, None], torch.where(first, 0.0, _NEG_INF), delta)
    return cand, delta


@torch.no_grad()
def beam_search_tokens(
    net: TransformerWrapper, prompts: Tensor, seq_len: int, *, beams: int = 4, mask: Tensor | None = None,
    context: Tensor | None = None, context_mask: Tensor | None = None,
    prepend_embeds: Tensor | None = None, prepend_mask: Tensor | None = None,
    condition: Tensor | None = None, condition_mask: Tensor | None = None,
    eos_token: int | None = None, temperature: float = 1.0, stochastic: bool = False,
    filter_logits_fn: Callable[..., Tensor] | str | None = None, filter_kwargs: dict[str, Any] | None = None,
    cache_kv: bool = True, restrict_to_max_seq_len: bool = True, pad_value: int = 0,
    cond_scale: float | Mapping[str, float] | Callable[[int], float | Mapping[str, float]] = 1.0,
    guidance_rescale: float = 0.0, guidance_interval: tuple[int, int] | None = None, guidance_space: str = "logits",
    negative_context: Tensor | None = None, negative_context_mask: Tensor | None = None,
    negative_prepend_embeds: Tensor | None = None, negative_prepend_mask: Tensor | None = None,
    negative_condition: Tensor | None = None, null_context: Tensor | None = None, **conditions,
) -> tuple[Tensor, Tensor]:
    """Beam search: the ``beams`` continuations of ``seq_len`` tokens with the largest summed log-probability.

    Each step, every live beam proposes its ``beams`` best next tokens; of the ``beams * beams``
    candidates of a sample, the ``beams`` with the largest score (the sum of the next-token
    log-probabilities, in float32; guided log-probabilities with ``cond_scale != 1``) survive. A beam
    that produced ``eos_token`` is finished: it keeps its score and competes with the live ones (no
    length penalty), and its later tokens are ``pad_value``. The KV cache is built once for the
    prompts, repeated per beam and reordered with ``KVCache.index_select`` each step.

    Args:
        net: a ``TransformerWrapper`` around a ``Decoder``.
        prompts: ``(b, n)`` token ids.
        seq_len: how many tokens to generate.
        beams: beams per sample, ``>= 1`` (1 is greedy decoding). More beams than distinct sequences
            (``beams > v ** seq_len``) leave beams with score ``-inf``: they are not sequences of the
            model and sort last.
        mask: ``(b, n)`` prompt padding mask (True = real); any padding (positions count real tokens).
        context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask: the
            conditions, as in ``generate_tokens``.
        eos_token: a beam that produces it is finished.
        temperature, filter_logits_fn, filter_kwargs: with ``stochastic`` only: the candidates of
            each beam are drawn by Gumbel top-k from the filtered logits divided by the temperature
            (``temperature=0``: the deterministic candidates). The scores stay the model's
            log-probabilities.
        stochastic: stochastic beam search (x-transformers' ``stochastic=True``).
        cache_kv: decode with the KV cache; the result equals the uncached recompute.
        restrict_to_max_seq_len: the sliding window of ``generate_tokens``.
        pad_value: token written after a beam's ``eos_token``.
        cond_scale, guidance_rescale, guidance_interval, guidance_space, negative_*, null_context:
            classifier-free guidance, as in ``generate_tokens``: beams are scored with the
            log-softmax of the guided logits.

    Returns:
        ``(tokens (b, beams, seq_len), scores (b, beams))``, best beam first; ``scores`` is float32
        (float64 for a float64 model, whatever the model's dtype otherwise), ``-inf`` only for beams
        that hold no sequence (see ``beams``), never NaN.

    Raises:
        ValueError / TypeError: as ``generate_tokens``; ``beams`` not a positive integer;
            ``filter_logits_fn``, ``filter_kwargs`` or a temperature other than 0 and 1 without
            ``stochastic`` (they would be ignored).
    """
    kw = {**locals(), **condition_kwargs("beam_search_tokens", conditions, negatives=True)}
    return _beam_search(net, prompts, seq_len, Conditions.from_kwargs(kw), Conditions.from_kwargs(kw, "negative_"),
                        null_context, DecodeOptions.from_kwargs(kw), beams=beams, mask=mask, stochastic=stochastic,
                        pad_value=pad_value)


def _beam_search(*args, **kwargs) -> tuple[Tensor, Tensor]:
    """``_search`` in ``torch.inference_mode`` (no autograd bookkeeping per op), its tokens and scores copied out as
    ordinary tensors."""
    tokens, scores = _search(*args, **kwargs)
    return tokens.clone(), scores.clone()


def _check_beam_args(beams, stochastic, o: DecodeOptions) -> None:
    """The checks of beam search's own options: ``beams``, ``stochastic``, and sampling options only with it."""
    if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
        raise ValueError(f"beams must be an integer >= 1, got {beams!r}")
    if not isinstance(stochastic, bool):
        raise TypeError(f"stochastic must be True or False, got {stochastic!r}")
    if not stochastic and (o.filter_logits_fn is not None or o.filter_kwargs is not None):
        raise ValueError("filter_logits_fn / filter_kwargs shape the candidates of stochastic beam search only; "
                         "pass stochastic=True, or leave them out (deterministic beam search has no filter)")
    temperature = o.temperature
    if not stochastic and isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
            and temperature not in (0.0, 1.0):
        raise ValueError(f"temperature={temperature!r} only applies with stochastic=True (deterministic beam search "
                         "ranks by the model's log-probabilities)")


@torch.inference_mode()
def _search(net, prompts, seq_len, conds: Conditions, negatives: Conditions, null_context, o: DecodeOptions, *,
            beams, mask, stochastic, pad_value) -> tuple[Tensor, Tensor]:
    """``beam_search_tokens`` on conditions already gathered into ``Conditions`` (checked here, once)."""
    _check_beam_args(beams, stochastic, o)
    conds, negatives, schedule, nulls, window = _prepare(net, prompts, seq_len, mask, conds, negatives, null_context,
                                                         o, pad_value)
    b, device = prompts.shape[0], prompts.device
    k = beams
    out = torch.full((b * k, seq_len), pad_value, dtype=torch.long, device=device)
    scores = torch.zeros(b, k, dtype=torch.float32, device=device)
    scores[:, 1:] = _NEG_INF  # one live beam per sample at the start: no duplicates
    if seq_len == 0 or b == 0:  # nothing to search: empty in, empty out
        return out.view(b, k, seq_len), scores
    was_training = net.training
    net.eval()
    try:
        step = GuidedForward(net, b, conds, negatives, schedule,
                             guided_logits_combine(schedule, o.guidance_rescale, o.guidance_space),
                             need_joint=o.guidance_rescale > 0, nulls=nulls, cache_kv=o.cache_kv, steps=seq_len,
                             window=window, static=True)
        out, scores = _beam_loop(step, prompts, mask, out, scores, o, stochastic=stochastic, pad_value=pad_value)
    finally:
        net.train(was_training)
    return out.view(b, k, seq_len), scores


def _beam_loop(step: GuidedForward, prompts: Tensor, mask: Tensor | None, out: Tensor, scores: Tensor,
               o: DecodeOptions, *, stochastic: bool, pad_value: int) -> tuple[Tensor, Tensor]:
    """The search itself on the engine ``step``: ``out (b * k, t)`` and ``scores (b, k)`` after the last step."""
    (b, k), seq_len, device = scores.shape, out.shape[1], prompts.device
    filter_fn = _resolve_filter(o.filter_logits_fn)
    logits = step(prompts, mask, None, 0)  # (b, v)
    kc = min(k, logits.shape[-1])  # candidates per beam
    rep = torch.arange(b, device=device).repeat_interleave(k)  # (b * k,): each sample's beams side by side
    step.select(rep)
    logits, seq = logits.index_select(0, rep), prompts.index_select(0, rep)
    seq_mask = None if mask is None else mask.index_select(0, rep)
    done = torch.zeros(b * k, dtype=torch.bool, device=device)
    tok = torch.full((b * k,), pad_value, dtype=torch.long, device=device)
    base = (torch.arange(b, device=device) * k)[:, None]  # (b, 1)
    for t in range(seq_len):
        if t > 0:
            logits = step(seq, seq_mask, tok[:, None], t)  # (b * k, v)
        cand, delta = _beam_candidates(logits, kc, done, pad_value, stochastic, o.temperature, filter_fn,
                                       o.filter_kwargs)
        total = (scores.view(b * k, 1) + delta).view(b, k * kc)  # -inf + finite is -inf, never NaN
        scores, idx = total.topk(k, dim=-1)  # (b, k), best first
        parent = (base + idx // kc).view(-1)  # (b * k,)
        tok = cand.view(b, k * kc).gather(1, idx).view(-1)
        out = out.index_select(0, parent)
        out[:, t] = tok
        done = done.index_select(0, parent) | ~torch.isfinite(scores.view(-1))
        if o.eos_token is not None:
            done = done | (tok == o.eos_token)
        if t == seq_len - 1 or bool(done.all()):
            break
        step.select(parent)
        tok = torch.where(done, 0, tok)  # a finished beam's pad_value (maybe -1) is never fed back
        if step.needs_sequence:
            seq = torch.cat((seq.index_select(0, parent), tok[:, None]), dim=1)
            if seq_mask is not None:
                seq_mask = torch.cat((seq_mask.index_select(0, parent),
                                      torch.ones_like(tok[:, None], dtype=torch.bool)), 1)
    step.check_tokens()  # a fed id outside the vocabulary (logits_dim > num_tokens): the dynamic cache's error
    return out, scores


# ----------------------------------------------------------------------------------------------------
# The wrapper
# ----------------------------------------------------------------------------------------------------


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode within, its training mode restored after (also on an error)."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _door_inputs(wrapper, prompts, mask, prompt_lens, kw: Mapping):
    """A wrapper's decoding door's inputs: ``(prompts (b, n), mask, conditions, negatives, null context)`` from its
    keywords ``kw`` (``batch_prompts``, then ``AutoregressiveWrapper._negatives``)."""
    prompts, mask = batch_prompts(prompts, mask, prompt_lens, wrapper.pad_value)
    negatives, null = wrapper._negatives(prompts, Conditions.from_kwargs(kw, "negative_"))
    return prompts, mask, Conditions.from_kwargs(kw), negatives, null


def _check_wrapper_args(net, *, ignore_index, pad_value, cond_drop_prob, cond_drop_all_prob, null_context, mask_prob,
                        next_embed_loss_weight, looped_loss_threshold_exit, looped_loss_slope, looped_exit_loss_weight,
                        add_attn_z_loss) -> dict[str, float]:
    """``AutoregressiveWrapper``'s checks of its arguments, in order; returns the drop probability of each kind."""
    for name, v in (("looped_loss_threshold_exit", looped_loss_threshold_exit), ("looped_loss_slope", looped_loss_slope),
                    ("looped_exit_loss_weight", looped_exit_loss_weight)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if not isinstance(net, TransformerWrapper):
        raise TypeError(f"net must be a TransformerWrapper, got {type(net).__name__}")
    if isinstance(mask_prob, bool) or not (isinstance(mask_prob, (int, float)) and 0.0 <= mask_prob < 1.0):
        raise ValueError(f"mask_prob must be in [0, 1), got {mask_prob!r}")
    if isinstance(next_embed_loss_weight, bool) or not (isinstance(next_embed_loss_weight, (int, float))
                                                         and math.isfinite(next_embed_loss_weight)
                                                         and next_embed_loss_weight >= 0):
        raise ValueError(f"next_embed_loss_weight must be a finite number >= 0, got {next_embed_loss_weight!r}")
    if not net.attn_layers.causal:
        raise ValueError("net must be causal (attn_layers=Decoder(...)) for next-token training and generation")
    probs = drop_probabilities(cond_drop_prob)
    if isinstance(cond_drop_all_prob, bool) or not (isinstance(cond_drop_all_prob, (int, float)) and 0.0 <= cond_drop_all_prob <= 1.0):
        raise ValueError(f"cond_drop_all_prob must be in [0, 1], got {cond_drop_all_prob!r}")
    if null_context not in ("empty", "learned"):
        raise ValueError(f"null_context must be 'empty' or 'learned', got {null_context!r}")
    check_pad_value(pad_value)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    layers = net.attn_layers
    check_drop_kinds(layers, cond_drop_prob)
    if null_context == "learned" and not layers.has_cross:
        raise ValueError("null_context='learned' needs a net with cross-attention (Decoder(..., cross_attend=True))")
    if not isinstance(add_attn_z_loss, bool):
        raise TypeError(f"add_attn_z_loss must be True or False, got {add_attn_z_loss!r}")
    if getattr(net, "num_output_heads", 1) > 1:
        raise ValueError("net has num_output_heads > 1 (a tuple of logits): next-token training and generation "
                         "need one head")
    return probs


class AutoregressiveWrapper(Configurable, nn.Module):
    """Next-token loss, CFG training and (guided) generation around a causal ``TransformerWrapper``.

    It takes every kind of condition (see ``conditions.py``): a cross-attention ``context``, a prefix
    ``prepend_embeds`` and an adaptive-norm ``condition``, each droppable per sample for CFG training
    and guided at sampling, jointly or one scale per condition.

    Args:
        net: a ``TransformerWrapper`` whose layers are a ``Decoder`` (``cross_attend=True`` for a
            context, ``use_adaptive_layernorm=True`` for a condition).
        ignore_index: target value that does not count in the loss.
        pad_value: token fed in place of ignored tokens, and written after a sample's ``eos_token``.
        cond_drop_prob: during training, the probability of dropping each sample's condition: one
            number for every kind given (each kind drawn independently), or ``{"context": p_c,
            "prepend": p_p, "condition": p_a}``.
        cond_drop_all_prob: in addition, the probability that a sample loses every condition at once
            (trains the unconditional model even when the kinds are rarely dropped together).
        null_context: what a dropped context becomes, and what the unconditional branch of guided
            sampling sees: ``"empty"`` (the context with an all-False mask, an exact no-op) or
            ``"learned"`` (one learned null token of width ``dim_context``). A dropped prefix is an
            all-False ``prepend_mask`` row; a dropped adaptive condition is the stack's null condition.
        mask_prob: a forgetful causal mask in ``forward`` (x-transformers' option): this share of each
            sample's input positions (never the first) is hidden as keys from every query, drawn anew
            each call. A query left without a key (possible with left padding) is a dead row: exactly 0.
        next_embed_loss_weight: with a net built with ``add_continuous_pred_head=True``, the weight of its
            continuous next-embedding loss in ``forward`` (x-transformers' option and default, 0.1).
        looped_loss_threshold_exit, looped_loss_slope, looped_exit_loss_weight: with a ``looped`` net, x-transformers'
            loss: each loop step's cross-entropy weighted by the probability (from the exit gate, detached) of
            exiting at that step, plus the exit gate's binary cross-entropy toward ``sigmoid(slope * (loss change of
            the next step + threshold))`` (exit once another step gains less than ``threshold``), times
            ``looped_exit_loss_weight``. Counted targets only; none counted gives 0.
        add_attn_z_loss: add the net's ``attn_z_loss`` (``TransformerWrapper.forward(return_attn_z_loss=True)``, weight
            the net's ``attn_z_loss_weight``) to the loss (x-transformers' option); runs the explicit attention path.

    Example:
        >>> model = AutoregressiveWrapper(TransformerWrapper(num_tokens=256, max_seq_len=128,
        ...     attn_layers=Decoder(dim=64, depth=2, heads=4, cross_attend=True)), cond_drop_prob=0.1)
        >>> loss = model(tokens, context=ctx, context_mask=ctx_mask); loss.backward()
        >>> new = model.generate(prompt, 32, context=ctx, context_mask=ctx_mask, cond_scale=3.0)

    Checkpoints: ``model.save_pretrained(path)`` stores the wrapper with its net (and null token);
    ``AutoregressiveWrapper.from_pretrained(path)`` rebuilds both.
    """

    def __init__(
        self,
        net: TransformerWrapper,
        *,
        ignore_index: int = -100,
        pad_value: int = 0,
        cond_drop_prob: float | dict[str, float] = 0.0,
        cond_drop_all_prob: float = 0.0,
        null_context: str = "empty",
        mask_prob: float = 0.0,
        next_embed_loss_weight: float = 0.1,
        looped_loss_threshold_exit: float = 0.05,
        looped_loss_slope: float = 50.0,
        looped_exit_loss_weight: float = 1.0,
        add_attn_z_loss: bool = False,
    ):
        super().__init__()
        probs = _check_wrapper_args(
            net, ignore_index=ignore_index, pad_value=pad_value, cond_drop_prob=cond_drop_prob,
            cond_drop_all_prob=cond_drop_all_prob, null_context=null_context, mask_prob=mask_prob,
            next_embed_loss_weight=next_embed_loss_weight, looped_loss_threshold_exit=looped_loss_threshold_exit,
            looped_loss_slope=looped_loss_slope, looped_exit_loss_weight=looped_exit_loss_weight,
            add_attn_z_loss=add_attn_z_loss)
        self._set_config_from(AutoregressiveWrapper.__init__, locals())
        self.net = net
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.cond_drop_probs = probs
        self.cond_drop_prob = max(probs.values())
        self.cond_drop_all_prob = float(cond_drop_all_prob)
        self.null_context = null_context
        self.mask_prob = float(mask_prob)
        self.next_embed_loss_weight = float(next_embed_loss_weight)
        self.looped_loss_threshold_exit = float(looped_loss_threshold_exit)
        self.looped_loss_slope = float(looped_loss_slope)
        self.looped_exit_loss_weight = float(looped_exit_loss_weight)
        self.add_attn_z_loss = add_attn_z_loss
        self.max_seq_len = net.max_seq_len
        if null_context == "learned":
            self.null_token = nn.Parameter(torch.randn(1, net.attn_layers.dim_context) * 0.02)  # (1, c_ctx)
        else:
            self.null_token = None

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
        return_outputs: bool = False,
        lens: Tensor | None = None,
        **conditions,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, LayerIntermediates]]:
        """Next-token cross-entropy of ``x (b, n)``.

        Args:
            x: token ids; positions equal to ``ignore_index`` (or False in ``mask``) do not count.
                A batch with no counted target gives exactly 0 with zero gradient (S8).
            mask: ``(b, n)`` padding mask (True = real).
            lens: ``(b,)`` right-padded lengths instead of ``mask`` (x-transformers' keyword): the tokens at and
                past a sample's length are padding.
            context, context_mask: the cross-attention condition (``context=None``: none for the batch).
            prepend_embeds, prepend_mask: a prefix ``(b, m, dim)`` / ``(b, m)``; the loss counts the
                tokens of ``x`` only.
            condition, condition_mask: the adaptive-norm condition ``(b, K)`` / ``(b,)``.
            In training mode each condition given is dropped per sample (``cond_drop_prob``,
            ``cond_drop_all_prob``).
            return_outputs: also return ``(logits (b, n - 1, v), LayerIntermediates)`` (x-transformers'
                ``return_outputs``; the intermediates hold the attention weights, computed by the explicit
                float32 path).

        Returns:
            the scalar mean loss over counted targets; ``(loss, (logits, intermediates))`` with
            ``return_outputs``.
        """
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs must be True or False, got {return_outputs!r}")
        conditions = condition_kwargs("AutoregressiveWrapper.forward", conditions)
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise ValueError(f"x must be token ids of shape (b, n), got {getattr(x, 'shape', type(x))}")
        if lens is not None:
            if mask is not None:
                raise ValueError("pass mask or lens, not both")
            check_lengths(lens, "lens", x.shape[0], max_len=x.shape[1], device=x.device)
            mask = torch.arange(x.shape[1], device=x.device)[None] < lens[:, None]
        given = dict(context=context, context_mask=context_mask, prepend_embeds=prepend_embeds,
                     prepend_mask=prepend_mask, condition=condition, condition_mask=condition_mask)
        # checked before a drop could hide it; no locals(): torch.compile cannot trace it (torch 2.11)
        conds = Conditions.from_kwargs({**given, **conditions}).check(self.net, x.shape[0], x.device)
        if self.training and (self.cond_drop_prob > 0 or self.cond_drop_all_prob > 0):
            nulls = {}
            if self.null_token is not None and context is not None:
                nulls["context"] = (self.null_token[None].expand(x.shape[0], -1, -1), None)
            conds, _ = drop_conditions(conds, self.cond_drop_probs, all_prob=self.cond_drop_all_prob, nulls=nulls)
        kwargs = conds.kwargs()
        if self.add_attn_z_loss:
            kwargs["return_attn_z_loss"] = True
        if getattr(self.net, "looped", False):
            res = looped_loss(self, x, mask, return_outputs or self.add_attn_z_loss, kwargs)
            loss, outs = res if isinstance(res, tuple) else (res, None)
        else:  # the intermediates (the explicit attention path) only when asked for, or for the z-loss
            res = next_token_loss(self.net, x, mask, self.ignore_index, self.pad_value, mask_prob=self.mask_prob,
                                  return_outputs=return_outputs or self.add_attn_z_loss,
                                  next_embed_weight=self.next_embed_loss_weight, **kwargs)
            loss, outs = res if isinstance(res, tuple) else (res, None)
        if self.add_attn_z_loss:
            loss = loss + outs[1].attn_z_loss
        return (loss, outs) if return_outputs else loss

    def _negatives(self, prompts: Tensor, negatives: Conditions) -> tuple[Conditions, Tensor | None]:
        """The unconditional branch's conditions (the negative ones, else the learned null token for the
        context) and the null context of the per-condition branches."""
        if self.null_token is None:
            return negatives, None
        null = self.null_token[None].expand(prompts.shape[0], -1, -1)  # (b, 1, c_ctx)
        if negatives.context is None and negatives.context_mask is None:  # (a stray mask is refused later)
            negatives = negatives.with_pair("context", null, None)
        return negatives, null

    def next_token_logits(self, prompts: Tensor, **kwargs) -> Tensor:
        """The (guided) logits ``(b, v)`` ``generate`` samples its first token from (same code path).

        Keyword arguments as in ``generate`` (its sampling options excepted).
        """
        found: dict[str, Tensor] = {}

        def capture(logits: Tensor) -> Tensor:
            found["logits"] = logits
            return logits

        self.generate(prompts, 1, temperature=1.0, filter_logits_fn=capture, **kwargs)
        return found["logits"]

    def generate(
        self, prompts: Tensor | list[Tensor], seq_len: int, *, mask: Tensor | None = None,
        prompt_lens: Tensor | None = None, context: Tensor | None = None, context_mask: Tensor | None = None,
        prepend_embeds: Tensor | None = None, prepend_mask: Tensor | None = None, condition: Tensor | None = None,
        condition_mask: Tensor | None = None, temperature: float = 1.0,
        filter_logits_fn: Callable[..., Tensor] | str | None = None, filter_kwargs: dict[str, Any] | None = None,
        eos_token: int | None = None, cache_kv: bool = True, restrict_to_max_seq_len: bool = True,
        cond_scale: float | Mapping[str, float] | Callable[[int], float | Mapping[str, float]] = 1.0,
        guidance_rescale: float = 0.0, guidance_interval: tuple[int, int] | None = None,
        guidance_space: str = "logits", negative_context: Tensor | None = None,
        negative_context_mask: Tensor | None = None, negative_prepend_embeds: Tensor | None = None,
        negative_prepend_mask: Tensor | None = None, negative_condition: Tensor | None = None,
        static_cache: bool = True, compile: bool = False, eos_check_every: int = 16, looped_steps: int | None = None,
        max_looped_steps: int | None = None, looped_exit_prob_threshold: float = 0.9,
        return_intermediates: bool = False, **conditions,
    ) -> Tensor | tuple[Tensor, LayerIntermediates]:
        """Generate ``seq_len`` new tokens after ``prompts``, optionally with classifier-free guidance.

        Args:
            prompts: ``(b, n)`` token ids (padded when lengths differ, with ``mask`` or ``prompt_lens``), or a list
                of ``b`` 1-D token tensors of any lengths (left-padded here; ``mask`` and ``prompt_lens`` must be
                None). A single 1-D tensor is refused: write ``prompt[None]``.
            seq_len: how many tokens to generate.
            mask: ``(b, n)`` prompt padding mask (True = real); every prompt needs a real token.
            prompt_lens: ``(b,)`` lengths of right-padded prompts (x-transformers' argument): the same as
                ``mask = arange(n) < prompt_lens``. Not with ``mask``.
            context, context_mask: the cross-attention condition ``(b, j, c_ctx)`` / ``(b, j)``.
            prepend_embeds, prepend_mask: a prefix ``(b, m, dim)`` / ``(b, m)``.
            condition, condition_mask: the adaptive-norm condition ``(b, K)`` / ``(b,)``.
            temperature: ``0.0`` is greedy.
            filter_logits_fn: ``top_k``, ``top_p``, ``min_p`` (or their names, or any callable
                ``fn(logits, **filter_kwargs)``), applied after the temperature.
            filter_kwargs: e.g. ``{"k": 10}``, ``{"p": 0.9}``, ``{"min_p": 0.05}``.
            eos_token: each sample stops after producing it; the rest of its row is ``pad_value``.
            cache_kv: use the KV cache (same tokens as without it).
            restrict_to_max_seq_len: past ``max_seq_len``, condition each token on the last ``max_seq_len`` real
                positions only (a sliding window, for rotary / ALiBi nets: past ``max_seq_len`` each step
                re-encodes the window). ``False``: on the whole sequence. See ``generate_tokens``.
            cond_scale: a number (joint guidance: 1.0 is plain conditional sampling, the unconditional branch never
                runs; 0.0 unconditional), a mapping ``{"joint": s, "context": s_c, "prepend": s_p, "condition":
                s_a}`` (compositional guidance, one scale per condition), or a callable ``step -> number |
                mapping`` (a schedule). All branches run as one batched forward sharing one KV cache.
            guidance_rescale: phi in ``[0, 1]``, see ``guided_logits``.
            guidance_interval: ``(start, stop)``: guide only steps ``start <= t < stop``.
            guidance_space: ``"logits"`` or ``"logprobs"``.
            negative_context, negative_context_mask: the unconditional branch's context, in place of the empty
                context (or the learned null token); batch ``b`` or 1.
            negative_prepend_embeds, negative_prepend_mask, negative_condition: the unconditional branch's prefix
                and adaptive condition, in place of the dropped ones.
            static_cache: decode on a preallocated cache with one fixed-shape step per token, no read back to the
                host (default, where it applies; same tokens as ``False``, the dynamic cache).
            compile: compile that step (``torch.compile(fullgraph=True)``); see ``generate_tokens``.
            eos_check_every: with ``eos_token``, how often (in steps) the host looks whether all finished.
            looped_steps, max_looped_steps, looped_exit_prob_threshold: a ``looped`` net decodes with
                ``looped_inference`` (x-transformers' way): a fixed number of loop steps per token, or up to
                ``max_looped_steps`` with early exit per sample (see ``TransformerWrapper.forward``); after the
                prompt on the static step with these settings (``build_static_cache``'s ``loop``), the same tokens.
            return_intermediates: also return a ``LayerIntermediates`` with the last KV cache (``cache``; all
                guidance branches' rows) and, for a looped net, ``exit_indices (b, t)`` and
                ``looped_prompt_kv_cache`` (x-transformers' return). Decodes on the dynamic cache.

        Returns:
            ``(b, seq_len)`` new token ids (and the intermediates with ``return_intermediates``).

        Raises:
            ValueError: a bad shape, mask, length or option, named; generation past ``max_seq_len`` with a learned
                absolute position embedding.
            TypeError: a tensor of the wrong dtype.

        Example (two conditions, guided separately):
            >>> model.generate(prompt, 64, context=text, context_mask=text_mask, condition=style,
            ...                cond_scale={"context": 3.0, "condition": 1.5})
        """
        kw = {**locals(), **condition_kwargs("AutoregressiveWrapper.generate", conditions, negatives=True)}
        call = looped_call(self.net, looped_steps, max_looped_steps, looped_exit_prob_threshold, return_intermediates)
        prompts, mask, conds, negatives, null = _door_inputs(self, prompts, mask, prompt_lens, kw)
        with _eval_mode(self):
            out = _generate(self.net, prompts, seq_len, conds, negatives, null, DecodeOptions.from_kwargs(kw),
                            mask=mask, pad_value=self.pad_value, call=call)
            return (out, call.intermediates()) if return_intermediates else out

    def beam_search(
        self, prompts: Tensor | list[Tensor], seq_len: int, beams: int = 4, return_beams_and_scores: bool = False,
        eos_token: int | None = None, temperature: float = 1.0, stochastic: bool = False,
        prompt_lens: Tensor | None = None, filter_logits_fn: Callable[..., Tensor] | str | None = None,
        restrict_to_max_seq_len: bool = True, filter_kwargs: dict[str, Any] | None = None, cache_kv: bool = True, *,
        mask: Tensor | None = None, context: Tensor | None = None, context_mask: Tensor | None = None,
        prepend_embeds: Tensor | None = None, prepend_mask: Tensor | None = None,
        condition: Tensor | None = None, condition_mask: Tensor | None = None,
        cond_scale: float | Mapping[str, float] | Callable[[int], float | Mapping[str, float]] = 1.0,
        guidance_rescale: float = 0.0, guidance_interval: tuple[int, int] | None = None, guidance_space: str = "logits",
        negative_context: Tensor | None = None, negative_context_mask: Tensor | None = None,
        negative_prepend_embeds: Tensor | None = None, negative_prepend_mask: Tensor | None = None,
        negative_condition: Tensor | None = None, **conditions,
) -> Tensor | tuple[Tensor, Tensor]:
        """Beam search (x-transformers' ``beam_search``, same arguments and return values).

        Keeps, per sample, the ``beams`` continuations with the largest summed log-probability
        (float32; see ``beam_search_tokens``). A beam that produced ``eos_token`` is finished: it
        keeps its score, and its later tokens are ``pad_value``.

        Args:
            prompts: as in ``generate``: ``(b, n)`` (with ``mask`` or ``prompt_lens``), or a list of
                1-D prompts of different lengths.
            seq_len: how many tokens to generate.
            beams: beams per sample (1 is greedy decoding).
            return_beams_and_scores: also return every beam and its score.
            eos_token: a beam that produces it is finished.
            temperature, filter_logits_fn, filter_kwargs: shape the candidates of ``stochastic`` beam
                search (Gumbel top-k from the tempered, filtered logits); without ``stochastic`` they
                must keep their defaults (they would be ignored).
            stochastic: stochastic beam search.
            prompt_lens: ``(b,)`` lengths of right-padded prompts (not with ``mask``).
            restrict_to_max_seq_len: the sliding window past ``max_seq_len`` (see ``generate``).
            cache_kv: use the KV cache (same result as without it).
            mask: ``(b, n)`` prompt padding mask (True = real).
            context, context_mask, prepend_embeds, prepend_mask, condition, condition_mask: the
                conditions, as in ``generate``.
            cond_scale, guidance_rescale, guidance_interval, guidance_space, negative_*: guidance as in
                ``generate``; beams are scored with the log-softmax of the guided logits.

        Returns:
            ``(b, seq_len)`` the best beam's tokens; with ``return_beams_and_scores``, ``(tokens
            (beams, b, seq_len), scores (beams, b))``, best beam first (x-transformers' layout). A
            score is ``-inf`` only for a beam that holds no sequence (more beams than possible
            sequences), never NaN.

        Raises:
            ValueError / TypeError: as ``generate``; ``beams`` not a positive integer; sampling
                options without ``stochastic``.
        """
        kw = {**locals(), **condition_kwargs("AutoregressiveWrapper.beam_search", conditions, negatives=True)}
        prompts, mask, conds, negatives, null = _door_inputs(self, prompts, mask, prompt_lens, kw)
        if not isinstance(return_beams_and_scores, bool):
            raise TypeError(f"return_beams_and_scores must be True or False, got {return_beams_and_scores!r}")
        with _eval_mode(self):
            tokens, scores = _beam_search(
                self.net, prompts, seq_len, conds, negatives, null, DecodeOptions.from_kwargs(kw),
                beams=beams, mask=mask, stochastic=stochastic, pad_value=self.pad_value,
            )  # (b, beams, seq_len), (b, beams)
        if not return_beams_and_scores:
            return tokens[:, 0]
        return tokens.transpose(0, 1), scores.transpose(0, 1)  # (beams, b, seq_len), (beams, b)

