"""The belief state transformer (Hu et al., arXiv 2410.23506): x-transformers' ``BeliefStateWrapper`` on
safeformer decoders.

Shape legend: b batch, n sequence positions, P forward/backward pairs, d model width, v vocabulary size.
Masks follow the one convention (bool, True = real position; see ``masks.py``).

The objective: a forward decoder reads the prefix ``seq[:fi + 1]``, a backward decoder reads the suffix
``seq[bi:]`` reversed after a learned suffix token, and a text head on both states predicts the next token
``seq[fi + 1]`` and the previous token ``seq[bi - 1]``, for every pair with ``bi - fi >= 2``.

Padding: a sample of ``L`` real tokens (``lens``, or any padding ``mask``: its real tokens are taken in
order, so left padding is the same sample) is reversed within its real tokens only, and the backward state
``bi`` knows exactly the real tokens ``bi .. L - 1`` (``bi = L``: the suffix token alone, an empty
suffix). A pair counts when ``bi <= L``; its two labels are then real. Padding never becomes a position
of the reversed sequence, never reaches the text head (its inputs are selected to 0 for pairs that do not
count) and a sample with fewer than 2 real tokens contributes nothing: a loss of exactly 0 with zero
gradients when no sample counts.

Sampling (``generate_with_suffix_cond``): the prompts may be padded (``mask``) and the goal suffix too
(``suffix_mask``); conditions reach both decoders as in training; ``cond_scale`` guides jointly on the
suffix and the conditions (``guided_logits``: the unconditional branch has the empty suffix, which the
pairs with ``bi = L`` train, and every condition dropped; both branches in one batched forward sharing one
KV cache); ``cache_kv`` equals the uncached result.

Differences from x-transformers (both agree with no padding, ``tests/test_belief_state.py``):
x-transformers flips the ``n + 1`` backward outputs over ``lens`` positions, so with ``lens`` its backward
state ``bi`` knows the tokens from ``bi + 1`` on and the pair with ``bi = L`` reads a state that has seen
its own label; forward labels of pairs whose backward state is padding count there, and
``loss_weight_by_fb_indices`` is ignored unless ``backward_ar_loss_weight != 1``. Here it always applies.
``cond_on_distance`` (as in x-transformers) only skips the distance loss on the steps it is drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from random import random

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.conditions import Conditions, condition_kwargs, guided_logits, null_of, stack_conditions
from ..core.losses import safe_cross_entropy
from ..core.masks import check_lengths, check_token_ids, checked_once, validate_mask
from ..decoding.generation import FILTERS, min_p
from ..interop.convert import register_converter
from ..stack.wrappers import TransformerWrapper
from ..stack.xt_extras import eval_decorator

__all__ = ["BeliefStateWrapper", "belief_state_from_x_transformers", "flip", "reverse_real"]


_check_ids = check_token_ids


def _compact(x: Tensor, real: Tensor) -> Tensor:
    """``x (b, n, ...)`` with each sample's real positions first, in order (right padding)."""
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
    if x.dim() == 3:
        order = order[..., None].expand_as(x)
    return x.gather(1, order)


def reverse_real(x: Tensor, real: Tensor | None) -> Tensor:
    """Each sample's real positions of ``x (b, n)`` or ``(b, n, d)`` reversed in place; padded positions
    stay where they are, holding what they held (so left padding stays left padding)."""
    if real is None:
        return x.flip(1)
    b, n = real.shape
    j = torch.arange(n, device=real.device).expand(b, n)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real positions first
    length = real.sum(1, keepdim=True)
    # the k-th real position takes the (L - 1 - k)-th real position's value
    rank = real.long().cumsum(1) - 1
    src = order.gather(1, (length - 1 - rank).clamp(min=0))
    src = torch.where(real, src, j)
    if x.dim() == 3:
        src = src[..., None].expand_as(x)
    return x.gather(1, src)


def flip(x: Tensor, dim: int = 1, lens: Tensor | None = None) -> Tensor:
    """x-transformers' ``flip``: reverse the first ``lens[i]`` positions of each sample (all of them when
    ``lens`` is None); the positions past ``lens`` stay where they are."""
    if lens is None:
        return x.flip(dim)
    if dim != 1:
        raise ValueError(f"flip with lens works along dim 1, got dim={dim}")
    lens = check_lengths(lens, "lens", x.shape[0], max_len=x.shape[1], device=x.device)
    return reverse_real(x, torch.arange(x.shape[1], device=x.device)[None] < lens[:, None])


def _check_number(v, name: str, *, low: float = 0.0, low_open: bool = False, high: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if (v <= low if low_open else v < low) or (high is not None and v > high):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}{'' if high is None else f' and <= {high}'}, got {v!r}")
    return float(v)


def _check_decoder(dec, name: str) -> None:
    if not isinstance(dec, TransformerWrapper):
        raise TypeError(f"{name} must be a safeformer TransformerWrapper, got {type(dec).__name__} "
                        "(convert an x-transformers BeliefStateWrapper with belief_state_from_x_transformers)")
    if not dec.attn_layers.causal:
        raise ValueError(f"{name} must be causal (attn_layers=Decoder(...))")


def _check_decoders(forward_decoder, backward_decoder) -> int:
    """Both decoders causal safeformer wrappers of one width and one vocabulary; returns the width."""
    _check_decoder(forward_decoder, "forward_decoder")
    _check_decoder(backward_decoder, "backward_decoder")
    dim = forward_decoder.attn_layers.dim
    if backward_decoder.attn_layers.dim != dim:
        raise ValueError(f"backward_decoder must have the width of forward_decoder ({dim}), "
                         f"got {backward_decoder.attn_layers.dim}")
    if backward_decoder.num_tokens != forward_decoder.num_tokens:
        raise ValueError(f"backward_decoder must have the vocabulary of forward_decoder ({forward_decoder.num_tokens}), "
                         f"got {backward_decoder.num_tokens}")
    return dim


# ----------------------------------------------------------------------------------------------------
# the phases of the loss
# ----------------------------------------------------------------------------------------------------


def _real_tokens(seq: Tensor, lens: Tensor | None, mask: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(seq, real, length)``: each sample's real tokens first (right padding, padded ids 0), the real
    positions ``(b, n)`` (``None``: every position is real) and the real lengths ``(b,)``."""
    b, n = seq.shape
    device = seq.device
    if lens is not None and mask is not None:
        raise ValueError("pass lens or mask, not both")
    if lens is not None:
        lens = check_lengths(lens, "lens", b, max_len=n, device=device)
        real = torch.arange(n, device=device)[None] < lens[:, None]
    elif mask is not None:
        validate_mask(mask, "mask", shape=(b, n), device=device)
        real = mask
    else:
        return seq, None, torch.full((b,), n, device=device, dtype=torch.long)
    seq = torch.where(real, seq, torch.zeros_like(seq))
    seq = _compact(seq, real)  # each sample's real tokens first (the same sample, right-padded)
    length = real.sum(1)  # (b,)
    return seq, torch.arange(n, device=device)[None] < length[:, None], length


def _fb_pairs(n: int, device, subsample: bool, frac: float, generator: torch.Generator | None) -> Tensor:
    """``(P, 2)`` the (forward, backward) index pairs with ``bi - fi >= 2``; a random share ``frac`` of them
    when ``subsample``."""
    ar = torch.arange(n, device=device)
    fb_pairs = torch.cartesian_prod(ar, ar + 1)
    fb_pairs = fb_pairs[(fb_pairs[:, 1] - fb_pairs[:, 0]) >= 2]
    if subsample:
        num = fb_pairs.shape[0]
        keep = max(int(num * frac), 1)
        fb_pairs = fb_pairs[torch.randperm(num, device=device, generator=generator)[:keep]]
    return fb_pairs


def _pair_weights(loss_weight_by_fb_indices, fb_pairs: Tensor, backward_weight: float, dtype, device) -> Tensor:
    """``(1, 2P)``: each label's weight (the direction's, times ``loss_weight_by_fb_indices``' when given)."""
    P = fb_pairs.shape[0]
    # the weights from the Python float (the float32 buffer would round 0.4 in a float64 model)
    w = torch.tensor([1.0, backward_weight], dtype=dtype, device=device)[:, None].expand(2, P)
    if loss_weight_by_fb_indices is not None:
        lw = loss_weight_by_fb_indices(fb_pairs)
        if not isinstance(lw, Tensor) or tuple(lw.shape) not in ((P,), (P, 2)):
            raise ValueError(f"loss_weight_by_fb_indices must return weights of shape (P,) = ({P},) or (P, 2) = "
                             f"({P}, 2), got {getattr(lw, 'shape', type(lw))}")
        lw = lw.to(device=device, dtype=dtype)
        w = w * (lw[None] if lw.dim() == 1 else lw.t())
    return w.reshape(1, 2 * P)


def _reduce_loss(ce: Tensor, dist: Tensor | None, counted: Tensor, counts: Tensor, w: Tensor,
                 distance_weight: float, reduction: str) -> Tensor:
    """The weighted losses ``ce (b, 2P)`` (plus the distance losses ``dist (b, P)``) over what counts:
    the batch mean, or each sample's (``reduction="none"``)."""
    zero = ce.new_zeros(())
    if reduction == "none":
        cnt = counted.sum(1).clamp(min=1).to(ce.dtype)  # (b,)
        d_term = zero if dist is None else torch.where(counts, dist, 0.0).sum(1) / counts.sum(1).clamp(min=1).to(ce.dtype)
        per = (ce + (d_term * distance_weight)[..., None] if dist is not None else ce) * w
        return torch.where(counted, per, 0.0).sum(1) / cnt
    cnt = counted.sum().clamp(min=1).to(ce.dtype)
    d_term = zero if dist is None else torch.where(counts, dist, 0.0).sum() / counts.sum().clamp(min=1).to(ce.dtype)
    per = (ce + d_term * distance_weight) * w
    return torch.where(counted, per, 0.0).sum() / cnt


# ----------------------------------------------------------------------------------------------------
# the phases of sampling
# ----------------------------------------------------------------------------------------------------


def _check_sampling_args(filter_logits_fn, filter_kwargs: dict | None, seq_len, temperature,
                         cond_scale) -> tuple[Callable, dict, float]:
    """The filter (a name resolved; x-transformers' default keywords for ``min_p``), ``seq_len``,
    ``temperature`` and ``cond_scale``; returns ``(filter function, its keywords, temperature)``."""
    if filter_kwargs is None:  # x-transformers' default belongs to its default filter
        filter_kwargs = dict(min_p=0.1) if filter_logits_fn in (min_p, "min_p") else {}
    if isinstance(filter_logits_fn, str):
        if filter_logits_fn not in FILTERS:
            raise ValueError(f"filter_logits_fn must be one of {sorted(FILTERS)} or a callable, got {filter_logits_fn!r}")
        filter_logits_fn = FILTERS[filter_logits_fn]
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative integer, got {seq_len!r}")
    temperature = _check_number(temperature, "temperature")
    if isinstance(cond_scale, bool) or not isinstance(cond_scale, (int, float)) or cond_scale != cond_scale \
            or abs(cond_scale) == float("inf"):
        raise ValueError(f"cond_scale must be a finite number, got {cond_scale!r}")
    return filter_logits_fn, filter_kwargs, temperature


def _check_prompts(prompts, mask: Tensor | None) -> tuple[bool, Tensor, Tensor | None]:
    """``(one, prompts (b, n), mask)``: a 1-d prompt (``one``) made a batch of one, every prompt with a real token."""
    if not isinstance(prompts, Tensor) or prompts.dim() not in (1, 2):
        raise ValueError(f"prompts must be token ids of shape (b, n) or (n,), got {getattr(prompts, 'shape', type(prompts))}")
    one = prompts.dim() == 1
    prompts = _check_ids(prompts[None] if one else prompts, "prompts")
    if mask is not None:
        mask = mask[None] if one and isinstance(mask, Tensor) and mask.dim() == 1 else mask
        validate_mask(mask, "mask", shape=tuple(prompts.shape), device=prompts.device)
    b, n = prompts.shape
    if n == 0 or (mask is not None and b and not bool(mask.any(1).all())):
        raise ValueError("every prompt needs at least one real token (mask has an all-False row or prompts is empty)")
    return one, prompts, mask


def _check_suffix(suffix, suffix_mask, b: int, device, decode_backwards: bool) -> tuple[Tensor | None, Tensor | None]:
    """The goal ``suffix (b, s)`` (a 1-d one repeated for every prompt; padded ids 0) and its mask."""
    if suffix is None:
        if suffix_mask is not None:
            raise ValueError("suffix_mask was given without suffix")
        return None, None
    if decode_backwards:
        raise ValueError("suffix is the goal of forward decoding; decode_backwards takes none")
    if isinstance(suffix, Tensor) and suffix.dim() == 1:
        suffix = suffix[None].expand(b, -1)
        if isinstance(suffix_mask, Tensor) and suffix_mask.dim() == 1:
            suffix_mask = suffix_mask[None].expand(b, -1)
    suffix = _check_ids(suffix, "suffix")
    if suffix.shape[0] != b:
        raise ValueError(f"suffix must have the batch of prompts ({b}), got {tuple(suffix.shape)}")
    if suffix_mask is not None:
        validate_mask(suffix_mask, "suffix_mask", shape=tuple(suffix.shape), device=device)
        suffix = torch.where(suffix_mask, suffix, torch.zeros_like(suffix))
    return suffix, suffix_mask


def _branches(conds: Conditions, suffix: Tensor | None, suffix_mask: Tensor | None,
              guided: bool) -> list[tuple[Conditions, Tensor | None, Tensor | None]]:
    """``(conditions, suffix, suffix_mask)`` per branch: the conditional one, then (guided) the
    unconditional one (every condition dropped, the empty suffix)."""
    branches = [(conds, suffix, suffix_mask)]
    if guided:
        null = conds
        for kind in conds.kinds():
            null = null.with_pair(kind, *null_of(conds, kind))
        branches.append((null, None, None))
    return branches


@dataclass(frozen=True)
class _SamplingPlan:
    """What every step of ``generate_with_suffix_cond`` needs: the decoder sampled from, the branches'
    stacked conditions and how a token is drawn."""

    main: nn.Module
    decode_backwards: bool
    cache_kv: bool
    guided: bool
    cond_scale: float
    guidance_rescale: float
    temperature: float
    filter_fn: Callable
    filter_kwargs: dict
    generator: torch.Generator | None
    stacked: Conditions
    r: int
    dtype: torch.dtype

    def draw(self, logits: Tensor) -> Tensor:
        """``(b, 1)``: the token drawn from ``logits (b, v)`` (the argmax at temperature 0)."""
        if self.temperature == 0.0:
            return logits.argmax(-1, keepdim=True)
        filtered = self.filter_fn(logits, **self.filter_kwargs)
        probs = F.softmax(filtered / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)


class BeliefStateWrapper(nn.Module):
    """x-transformers' ``BeliefStateWrapper`` (figure 13 of arXiv 2410.23506).

    Args:
        forward_decoder: a causal ``TransformerWrapper`` reading prefixes.
        backward_decoder: a causal ``TransformerWrapper`` reading reversed suffixes after the suffix token
            (default: ``forward_decoder`` itself).
        train_frac_forward_backward_pairs: the share of pairs drawn per step, in ``(0, 1]``.
        text_head: ``(..., 2 * d) -> (..., 2 * v)`` (forward logits, then backward logits); default an MLP.
        backward_ar_loss_weight: weight of the backward (previous-token) losses.
        pred_distance, pred_distance_loss_weight, max_pred_distance: also predict ``bi - fi`` (clamped to
            ``max_pred_distance - 1``; default ``max_seq_len``).
        cond_on_distance, cond_on_distance_prob: as x-transformers (the distance loss is skipped with that
            probability when ``cond_on_distance``).
    """

    def __init__(
        self,
        forward_decoder: TransformerWrapper,
        backward_decoder: TransformerWrapper | None = None,
        train_frac_forward_backward_pairs: float = 1.0,
        text_head: nn.Module | None = None,
        backward_ar_loss_weight: float = 1.0,
        pred_distance: bool = False,
        pred_distance_loss_weight: float = 1.0,
        cond_on_distance: bool = False,
        cond_on_distance_prob: float = 0.5,
        max_pred_distance: int | None = None,
    ):
        super().__init__()
        backward_decoder = forward_decoder if backward_decoder is None else backward_decoder
        dim = _check_decoders(forward_decoder, backward_decoder)
        frac = _check_number(train_frac_forward_backward_pairs, "train_frac_forward_backward_pairs", low_open=True, high=1.0)
        self.backward_ar_loss_weight = _check_number(backward_ar_loss_weight, "backward_ar_loss_weight")
        self.pred_distance_loss_weight = _check_number(pred_distance_loss_weight, "pred_distance_loss_weight")
        if not (isinstance(cond_on_distance_prob, (int, float)) and 0.0 < cond_on_distance_prob < 1.0):
            raise ValueError(f"cond_on_distance_prob must be in (0, 1), got {cond_on_distance_prob!r}")
        max_seq_len = forward_decoder.max_seq_len
        max_pred_distance = max_seq_len if max_pred_distance is None else max_pred_distance
        if isinstance(max_pred_distance, bool) or not isinstance(max_pred_distance, int) or max_pred_distance < 1:
            raise ValueError(f"max_pred_distance must be a positive integer, got {max_pred_distance!r}")
        num_tokens = forward_decoder.num_tokens
        self.num_tokens = num_tokens
        self.dim = dim
        self.suffix_token = nn.Parameter(torch.zeros(dim))
        nn.init.normal_(self.suffix_token, std=0.02)
        if text_head is None:
            text_head = nn.Sequential(nn.Linear(dim * 2, dim), nn.LeakyReLU(), nn.Linear(dim, num_tokens * 2))
        self.text_head = text_head
        self.max_pred_distance = max_pred_distance
        self.to_distance_logits = nn.Sequential(
            nn.Linear(dim * 2, dim), nn.LeakyReLU(), nn.Linear(dim, max_pred_distance)) if pred_distance else None
        self.cond_on_distance = bool(cond_on_distance)
        self.cond_on_distance_prob = float(cond_on_distance_prob)
        if cond_on_distance:  # kept for x-transformers' weights; it takes part in no loss (see the module doc)
            self.to_distance_cond = nn.Sequential(_AddUnitDim(), nn.Linear(1, dim), nn.LeakyReLU(), nn.Linear(dim, dim * 2))
        self.forward_decoder = forward_decoder
        self.backward_decoder = backward_decoder
        self.train_frac_fb_pairs = frac
        self.needs_subsample_fb_pairs = frac < 1.0
        self.needs_loss_weight = self.backward_ar_loss_weight != 1.0
        self.register_buffer("loss_weights", torch.tensor([1.0, self.backward_ar_loss_weight]))
        self.max_seq_len = max_seq_len

    # ------------------------------------------------------------------------------------------------
    # training
    # ------------------------------------------------------------------------------------------------

    def _prefix(self, conds: Conditions, b: int, dtype) -> tuple[Tensor, Tensor | None, int]:
        """The backward decoder's prefix: the user's prefix rows (if any), then the suffix token."""
        suffix = self.suffix_token.to(dtype)[None, None].expand(b, 1, -1)
        if conds.prepend_embeds is None:
            return suffix, None, 0
        pre, pre_mask = conds.prepend_embeds, conds.prepend_mask
        if not isinstance(pre, Tensor) or pre.dim() != 3 or pre.shape[0] != b or pre.shape[2] != self.dim:
            raise ValueError(f"prepend_embeds must have shape (b={b}, m, dim={self.dim}), got {getattr(pre, 'shape', type(pre))}")
        m = pre.shape[1]
        out = torch.cat((pre, suffix.to(pre.dtype)), 1)
        mask = None
        if pre_mask is not None:
            mask = torch.cat((pre_mask, torch.ones(b, 1, dtype=torch.bool, device=pre_mask.device)), 1)
        return out, mask, m

    @checked_once
    def forward(
        self,
        seq: Tensor,
        lens: Tensor | None = None,
        loss_weight_by_fb_indices=None,
        *,
        mask: Tensor | None = None,
        reduction: str = "mean",
        generator: torch.Generator | None = None,
        **conditions,
    ) -> Tensor:
        """The belief-state loss of ``seq (b, n)``.

        Args:
            seq: token ids; ids at padded positions are never looked up.
            lens: ``(b,)`` real lengths (right padding), x-transformers' argument.
            loss_weight_by_fb_indices: ``fn(fb_pairs (P, 2)) -> (P,) or (P, 2)`` weights per pair (and
                per direction).
            mask: ``(b, n)`` bool padding mask instead of ``lens`` (any padding; left padding included).
            reduction: ``"mean"`` (over every counted label of the batch) or ``"none"`` (``(b,)``: each
                sample's loss as if alone; exactly 0 for a sample with fewer than 2 real tokens).
            generator: for the pair subsampling (``train_frac_forward_backward_pairs < 1``).
            conditions: ``context``, ``context_mask``, ``condition``, ``prepend_embeds``, ... passed to
                both decoders (the backward decoder's prefix ends with the suffix token).
        """
        conditions = condition_kwargs("BeliefStateWrapper.forward", conditions)
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        seq, real, length = _real_tokens(_check_ids(seq, "seq"), lens, mask)
        conds = Conditions.from_kwargs(conditions)
        net_kw = {k: v for k, v in conditions.items() if k not in ("prepend_embeds", "prepend_mask")}
        if conds.prepend_embeds is not None:
            net_kw["prepend_embeds"], net_kw["prepend_mask"] = conds.prepend_embeds, conds.prepend_mask
            net_kw["excise_prepend_embeds"] = True

        fwd = self.forward_decoder(seq, mask=real, return_embeddings=True, **net_kw)  # (b, n, d)
        bstate = self._backward_states(seq, real, length, conds, net_kw, fwd.dtype)  # (b, n + 1, d)
        fb_pairs = _fb_pairs(seq.shape[1], seq.device, self.needs_subsample_fb_pairs, self.train_frac_fb_pairs,
                             generator)
        counts = fb_pairs[:, 1][None] <= length[:, None]  # (b, P): the backward state exists, so both labels are real
        ce, counted, fb = self._text_losses(fwd, bstate, seq, fb_pairs, counts)
        dist = self._distance_losses(fb, fb_pairs, counts)
        w = _pair_weights(loss_weight_by_fb_indices, fb_pairs, self.backward_ar_loss_weight, ce.dtype, seq.device)
        return _reduce_loss(ce, dist, counted, counts, w, self.pred_distance_loss_weight, reduction)

    def _backward_states(self, seq: Tensor, real: Tensor | None, length: Tensor, conds: Conditions, net_kw: dict,
                         dtype) -> Tensor:
        """``(b, n + 1, d)``: backward state ``q`` knows the real tokens ``q .. L - 1`` (0 where ``q > L``)."""
        b, n = seq.shape
        bwd_seq = reverse_real(seq, real)
        prefix, prefix_mask, m = self._prefix(conds, b, dtype)
        bwd_kw = {k: v for k, v in net_kw.items() if k not in ("prepend_embeds", "prepend_mask", "excise_prepend_embeds")}
        be = self.backward_decoder(bwd_seq, mask=real, prepend_embeds=prefix, prepend_mask=prefix_mask,
                                   return_embeddings=True, **bwd_kw)[:, m:]  # (b, 1 + n, d)
        # backward state q (0..n) knows the real tokens q .. L - 1: the output after L - q reversed tokens
        q = torch.arange(n + 1, device=seq.device)[None]
        has_state = q <= length[:, None]  # (b, n + 1)
        gi = (length[:, None] - q).clamp(min=0)
        bstate = be.gather(1, gi[..., None].expand(b, n + 1, be.shape[-1]))
        return torch.where(has_state[..., None], bstate, torch.zeros_like(bstate))

    def _text_losses(self, fwd: Tensor, bstate: Tensor, seq: Tensor, fb_pairs: Tensor,
                     counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(ce (b, 2P), counted (b, 2P), fb (b, P, 2d))``: the next-token then the previous-token losses of
        every pair, where they count, and the text head's input."""
        b = seq.shape[0]
        fi, bi = fb_pairs.unbind(-1)
        P = fb_pairs.shape[0]
        fb = torch.cat((fwd[:, fi], bstate[:, bi]), -1)  # (b, P, 2d)
        fb = torch.where(counts[..., None], fb, torch.zeros_like(fb))
        logits = self.text_head(fb)  # (b, P, 2v)
        v = logits.shape[-1] // 2
        logits = logits.reshape(b, P, 2, v).transpose(1, 2).reshape(b, 2 * P, v)
        labels = torch.cat((seq[:, fi + 1], seq[:, bi - 1]), 1)  # (b, 2P)
        counted = counts.repeat(1, 2)  # (b, 2P)
        labels = torch.where(counted, labels, torch.full_like(labels, -1))
        return safe_cross_entropy(logits, labels, ignore_index=-1, reduction="none"), counted, fb  # (b, 2P)

    def _distance_losses(self, fb: Tensor, fb_pairs: Tensor, counts: Tensor) -> Tensor | None:
        """``(b, P)`` the distance losses, or ``None`` (no distance head, or skipped on this step)."""
        draw = self.cond_on_distance and random() < self.cond_on_distance_prob
        if self.to_distance_logits is None or draw:
            return None
        fi, bi = fb_pairs.unbind(-1)
        d_logits = self.to_distance_logits(fb)  # (b, P, max_pred_distance)
        d_labels = (bi - fi).clamp(max=self.max_pred_distance - 1)[None].expand(*counts.shape)
        d_labels = torch.where(counts, d_labels, torch.full_like(d_labels, -1))
        return safe_cross_entropy(d_logits, d_labels, ignore_index=-1, reduction="none")  # (b, P)

    # ------------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------------

    def _suffix_embed(self, suffix: Tensor | None, suffix_mask: Tensor | None, b: int, device, dtype,
                      conds: Conditions | None = None) -> Tensor:
        """``(b, 1, d)``: the backward decoder's state after the suffix token and the reversed suffix, with the
        conditions it sees in training (a prefix condition before the suffix token)."""
        conds = Conditions() if conds is None else conds
        prefix, prefix_mask, m = self._prefix(conds, b, dtype)
        kw = {k: v for k, v in conds.kwargs().items() if k not in ("prepend_embeds", "prepend_mask", "excise_prepend_embeds")}
        if suffix is None:
            suffix = torch.zeros(b, 0, dtype=torch.long, device=device)
        be = self.backward_decoder(reverse_real(suffix, suffix_mask), mask=suffix_mask, prepend_embeds=prefix,
                                   prepend_mask=prefix_mask, return_embeddings=True, **kw)[:, m:]  # (b, 1 + s, d)
        real = torch.ones(b, 1 + suffix.shape[1], dtype=torch.bool, device=device)
        if suffix_mask is not None:
            real[:, 1:] = suffix_mask
        last = (real.long() * torch.arange(real.shape[1], device=device)).amax(1)  # the last real row
        return be.gather(1, last[:, None, None].expand(b, 1, be.shape[-1]))

    @torch.no_grad()
    @eval_decorator
    def generate_with_suffix_cond(
        self,
        prompts: Tensor,
        seq_len: int,
        temperature: float = 1.25,
        cache_kv: bool = False,
        suffix: Tensor | None = None,
        filter_logits_fn=min_p,
        filter_kwargs: dict | None = None,
        decode_backwards: bool = False,
        *,
        mask: Tensor | None = None,
        suffix_mask: Tensor | None = None,
        cond_scale: float = 1.0,
        guidance_rescale: float = 0.0,
        generator: torch.Generator | None = None,
        **conditions,
    ) -> Tensor:
        """Sample ``seq_len`` tokens after ``prompts`` (``(b, n)`` or ``(n,)``), toward the goal ``suffix``
        (``(b, s)`` or ``(s,)``; ``suffix_mask`` pads it), or before them with ``decode_backwards``.

        ``mask`` pads the prompts (every sample needs one real token). ``cond_scale`` guides on the suffix
        and every condition jointly: the unconditional branch has the empty suffix (the suffix token alone)
        and every condition dropped. Returns ``(b, seq_len)`` (``(seq_len,)`` for a 1-d prompt); with
        ``decode_backwards`` the tokens come in the order sampled (right to left).
        """
        conditions = condition_kwargs("BeliefStateWrapper.generate_with_suffix_cond", conditions)
        filter_fn, filter_kwargs, temperature = _check_sampling_args(filter_logits_fn, filter_kwargs, seq_len,
                                                                     temperature, cond_scale)
        one, prompts, mask = _check_prompts(prompts, mask)
        b, n = prompts.shape
        conds = Conditions.from_kwargs(conditions)
        if conds.prepend_embeds is not None and decode_backwards:
            raise ValueError("prepend_embeds cannot be combined with decode_backwards (the backward decoder's prefix is "
                             "the suffix token)")
        suffix, suffix_mask = _check_suffix(suffix, suffix_mask, b, prompts.device, decode_backwards)
        guided = cond_scale != 1.0
        if guided and suffix is None and not conds.kinds():
            raise ValueError("cond_scale guides on the suffix and the conditions: pass a suffix or a condition")
        if b == 0:
            out = prompts.new_empty((0, seq_len))
            return out[0] if one else out
        out = prompts if mask is None else torch.where(mask, prompts, torch.zeros_like(prompts))
        if decode_backwards:
            out = reverse_real(out, mask)
        branches = _branches(conds, suffix, suffix_mask, guided)
        other_all = self._other_states(branches, decode_backwards, b, prompts.device, generator)  # (r * b, 1, d)
        r = len(branches)
        plan = _SamplingPlan(
            main=self.backward_decoder if decode_backwards else self.forward_decoder, decode_backwards=decode_backwards,
            cache_kv=cache_kv, guided=guided, cond_scale=cond_scale, guidance_rescale=guidance_rescale,
            temperature=temperature, filter_fn=filter_fn, filter_kwargs=filter_kwargs, generator=generator,
            stacked=stack_conditions([c for c, _, _ in branches]) if r > 1 else conds, r=r, dtype=self.suffix_token.dtype)
        out = self._sample(plan, out, mask, other_all, seq_len)[:, n:]
        return out[0] if one else out

    def _other_states(self, branches: list, decode_backwards: bool, b: int, device,
                      generator: torch.Generator | None) -> Tensor:
        """``(r * b, 1, d)``: each branch's state of the other decoder, under its conditions: the goal suffix's,
        or with ``decode_backwards`` x-transformers' prefix state (a random token, one draw shared)."""
        dtype = self.suffix_token.dtype
        other = []
        if decode_backwards:
            tok = torch.randint(0, self.num_tokens, (b, 1), device=device, generator=generator)
        for br_conds, br_suffix, br_suffix_mask in branches:
            if decode_backwards:
                other.append(self.forward_decoder(tok, return_embeddings=True, **br_conds.kwargs()))  # (b, 1, d)
            else:
                other.append(self._suffix_embed(br_suffix, br_suffix_mask, b, device, dtype, br_conds))
        return torch.cat(other, 0)

    def _sample(self, plan: _SamplingPlan, out: Tensor, mask: Tensor | None, other_all: Tensor,
                seq_len: int) -> Tensor:
        """``out (b, n)`` with ``seq_len`` sampled tokens appended; every branch (the branches one after the
        other) in one batched forward, sharing one KV cache."""
        b, r = out.shape[0], plan.r
        out_all = out.repeat(r, 1)
        mask_all = None if mask is None else mask.repeat(r, 1)
        cache = None
        for _ in range(seq_len):
            last, cache = self._last_state(plan, out_all, mask_all, cache)
            pair = torch.cat((other_all, last) if plan.decode_backwards else (last, other_all), -1)
            fwd_logits, bwd_logits = self.text_head(pair).chunk(2, dim=-1)
            all_logits = (bwd_logits if plan.decode_backwards else fwd_logits)[:, -1]  # (r * b, v)
            logits = all_logits if not plan.guided else guided_logits(all_logits[:b], all_logits[b:], plan.cond_scale,
                                                                      plan.guidance_rescale)
            sample = plan.draw(logits)
            out = torch.cat((out, sample), -1)
            out_all = torch.cat((out_all, sample.repeat(r, 1)), -1)
            if mask_all is not None:
                mask_all = torch.cat((mask_all, torch.ones(r * b, 1, dtype=torch.bool, device=out.device)), -1)
        return out

    def _last_state(self, plan: _SamplingPlan, out_all: Tensor, mask_all: Tensor | None, cache):
        """``((r * b, 1, d), cache)``: the sampled decoder's state at each sequence's last real position."""
        if cache is not None:
            h, cache = plan.main(out_all[:, -1:], cache=cache, return_cache=True, return_embeddings=True)
            return h[:, -1:], cache
        kw = plan.stacked.kwargs()
        if plan.decode_backwards:
            kw["prepend_embeds"] = self.suffix_token.to(plan.dtype)[None, None].expand(out_all.shape[0], 1, -1)
            kw["excise_prepend_embeds"] = True
        res = plan.main(out_all, mask=mask_all, return_embeddings=True, return_cache=plan.cache_kv, **kw)
        h, cache = res if plan.cache_kv else (res, None)
        last = h[:, -1:]
        if mask_all is not None:  # the last real position (a padded prompt may end in padding)
            idx = (mask_all.long() * torch.arange(mask_all.shape[1], device=out_all.device)).amax(1)
            last = h.gather(1, idx[:, None, None].expand(out_all.shape[0], 1, h.shape[-1]))
        return last, cache


class _AddUnitDim(nn.Module):
    """``(...) -> (..., 1)`` (x-transformers' ``Rearrange('... -> ... 1')``)."""

    def forward(self, x: Tensor) -> Tensor:
        return x[..., None]


def belief_state_from_x_transformers(xt_wrapper, *, drop_training_only: bool = False) -> BeliefStateWrapper:
    """Convert an x-transformers ``BeliefStateWrapper`` with its weights: the decoders through
    ``from_x_transformers`` (one decoder when both are the same object; ``drop_training_only`` passed on),
    the suffix token, the text head and the distance heads; in the wrapper's training mode."""
    import copy

    from ..interop.convert import from_x_transformers

    for attr in ("forward_decoder", "backward_decoder", "suffix_token", "text_head", "loss_weights"):
        if not hasattr(xt_wrapper, attr):
            raise TypeError(f"expected an x_transformers BeliefStateWrapper, got {type(xt_wrapper).__name__} (no {attr!r})")
    fwd = from_x_transformers(xt_wrapper.forward_decoder, drop_training_only=drop_training_only)
    same = xt_wrapper.backward_decoder is xt_wrapper.forward_decoder
    bwd = fwd if same else from_x_transformers(xt_wrapper.backward_decoder, drop_training_only=drop_training_only)
    to_dist = getattr(xt_wrapper, "to_distance_logits", None)
    out = BeliefStateWrapper(
        fwd, None if same else bwd,
        train_frac_forward_backward_pairs=xt_wrapper.train_frac_fb_pairs,
        text_head=copy.deepcopy(xt_wrapper.text_head),
        backward_ar_loss_weight=float(xt_wrapper.loss_weights[1]),
        pred_distance=to_dist is not None,
        pred_distance_loss_weight=xt_wrapper.pred_distance_loss_weight,
        cond_on_distance=xt_wrapper.cond_on_distance,
        cond_on_distance_prob=xt_wrapper.cond_on_distance_prob,
        max_pred_distance=xt_wrapper.max_pred_distance,
    )
    with torch.no_grad():
        out.suffix_token.copy_(xt_wrapper.suffix_token)
        if to_dist is not None:
            out.to_distance_logits.load_state_dict(to_dist.state_dict())
        if xt_wrapper.cond_on_distance:
            src = [m for m in xt_wrapper.to_distance_cond if isinstance(m, nn.Linear)]
            dst = [m for m in out.to_distance_cond if isinstance(m, nn.Linear)]
            for s, d in zip(src, dst):
                d.load_state_dict(s.state_dict())
    return out.to(device=xt_wrapper.suffix_token.device, dtype=xt_wrapper.suffix_token.dtype).train(xt_wrapper.training)


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.belief_state_wrapper", "BeliefStateWrapper", belief_state_from_x_transformers, takes_drop=True)
