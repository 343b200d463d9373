"""xVal (x-transformers' ``XValTransformerWrapper`` and ``XValAutoregressiveWrapper``): numbers as one
``[NUM]`` token whose embedding is scaled by the number, a token head and a number head.

Shape legend: b batch, n positions, v vocabulary (``logits_dim``), j context length.
Masks follow the one convention (bool, True = real position; see ``masks.py``).

Built on safeformer's ``ContinuousTransformerWrapper`` (positions, memory tokens, prefix, conditions,
KV cache) and decode engine (``GuidedForward``: classifier-free guidance of the token logits and of the
number, every branch in one batched forward). What is safe:

- ``x_num`` is read only where ``x`` is the numerical token at a real position: NaN or inf anywhere else
  (x-transformers' convention puts NaN at the non-number positions) reaches no output, loss or gradient;
  ids at padded positions are never looked up.
- the loss counts target ``t`` when it is not ``ignore_index`` and positions ``t`` and ``t - 1`` are real;
  the number's squared error counts at counted targets holding the numerical token. A batch with no
  counted target is a loss of exactly 0 with zero gradients.
- ``generate`` returns ``non_number_value`` (0.0 by default; x-transformers returns NaN) where the
  sampled token is not a number, so its outputs are finite.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.conditions import (
    Conditions,
    GuidanceSchedule,
    check_drop_kinds,
    compose_guidance,
    compose_values,
    condition_kwargs,
    drop_conditions,
    drop_probabilities,
)
from ..core.losses import safe_cross_entropy
from ..core.masks import checked_once, validate_mask
from ..core.xt_helpers import default_lazy as default  # noqa: F401  (x-transformers' helper of this module)
from ..core.xt_helpers import exists  # noqa: F401
from ..decoding.decode import GuidedForward, autoregress
from ..decoding.generation import NOTHING_TO_DRAW, check_sampling, draw, top_k
from ..interop.convert import register_converter
from ..stack.layers import AttentionLayers
from ..stack.wrappers import ContinuousTransformerWrapper, _check_tokens

__all__ = [
    "XValTransformerWrapper",
    "XValAutoregressiveWrapper",
    "LossBreakdown",
    "GenerateReturn",
    "xval_from_x_transformers",
]

LossBreakdown = namedtuple("LossBreakdown", ["cross_entropy_loss", "numerical_mse_loss"])
GenerateReturn = namedtuple("GenerateReturn", ["sampled_token_ids", "sampled_numbers", "is_number_mask"])

_VALUE_LIMIT = 1e30  # a guided number is clamped here before it is fed back


def _check_int(v, name: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


class XValTransformerWrapper(Configurable, nn.Module):
    """x-transformers' ``XValTransformerWrapper``: token ids and numbers in, ``(logits, numbers)`` out.

    Args (x-transformers' names):
        num_tokens: vocabulary size (the numerical token included).
        max_seq_len: longest sequence (the absolute position embedding).
        numerical_token_id: the id of the ``[NUM]`` token, in ``[0, num_tokens)``.
        attn_layers: a safeformer ``AttentionLayers`` (``Decoder`` for ``XValAutoregressiveWrapper``).
        emb_dim: must be ``None`` or the model width (as x-transformers, which has no projection).
        logits_dim: width of the token head (default ``num_tokens``).
        tie_embedding: logits ``h @ token_emb.T * dim ** -0.5`` (x-transformers' scale) instead of a head.
        num_memory_tokens, emb_dropout, use_abs_pos_emb: as in ``TransformerWrapper``.
        max_mem_len, scaled_sinu_pos_emb: accepted at their neutral values (0, False) only.
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        max_seq_len: int,
        numerical_token_id: int,
        attn_layers: AttentionLayers,
        emb_dim: int | None = None,
        logits_dim: int | None = None,
        tie_embedding: bool = False,
        max_mem_len: int = 0,
        num_memory_tokens: int | None = None,
        emb_dropout: float = 0.0,
        use_abs_pos_emb: bool = True,
        scaled_sinu_pos_emb: bool = False,
    ):
        super().__init__()
        if not isinstance(attn_layers, AttentionLayers):
            raise TypeError(f"attn_layers must be a safeformer AttentionLayers (Encoder / Decoder), got {type(attn_layers).__name__}")
        _check_int(num_tokens, "num_tokens", 1)
        if isinstance(numerical_token_id, bool) or not isinstance(numerical_token_id, int) or not 0 <= numerical_token_id < num_tokens:
            raise ValueError(f"numerical_token_id must be an id in [0, num_tokens={num_tokens}), got {numerical_token_id!r}")
        dim = attn_layers.dim
        if emb_dim not in (None, dim):
            raise ValueError(f"emb_dim must be None or the model width {dim} (x-transformers has no projection), got {emb_dim!r}")
        if logits_dim is not None:
            _check_int(logits_dim, "logits_dim", 1)
        if tie_embedding and logits_dim not in (None, num_tokens):
            raise ValueError("tie_embedding=True needs logits_dim == num_tokens")
        if max_mem_len != 0:
            raise ValueError("max_mem_len (XL memories) is not supported; leave it at 0")
        if scaled_sinu_pos_emb:
            raise ValueError("scaled_sinu_pos_emb is not supported; use the learned absolute embedding or rotary")
        self._set_config_from(XValTransformerWrapper.__init__, locals())
        self.num_tokens = num_tokens
        self.numerical_token_id = numerical_token_id
        self.max_seq_len = max_seq_len
        self.emb_dim = dim
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.net = ContinuousTransformerWrapper(max_seq_len=max_seq_len, attn_layers=attn_layers, emb_dropout=emb_dropout,
                                                use_abs_pos_emb=use_abs_pos_emb, num_memory_tokens=num_memory_tokens)
        self.tie_embedding = tie_embedding
        self.to_logits = None if tie_embedding else nn.Linear(dim, num_tokens if logits_dim is None else logits_dim)
        self.to_numerical_output = nn.Linear(dim, 1)

    @property
    def attn_layers(self) -> AttentionLayers:
        return self.net.attn_layers

    @property
    def pos_emb(self):
        return self.net.pos_emb

    def embed(self, x: Tensor, x_num: Tensor, mask: Tensor | None) -> Tensor:
        """``(b, n, dim)``: token embeddings, the numerical token's scaled by ``x_num``; padded rows 0."""
        _check_inputs(x, x_num, mask)
        if mask is not None:
            x = torch.where(mask, x, torch.zeros_like(x))
        if x.numel() and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active() \
                and bool(((x < 0) | (x >= self.num_tokens)).any()):  # (under vmap the embedding's own check)
            bad = tuple(((x < 0) | (x >= self.num_tokens)).nonzero()[0].tolist())
            raise ValueError(f"x holds token id {int(x[bad])} at real position {bad}, outside the vocabulary "
                             f"[0, num_tokens={self.num_tokens}); padded positions (mask False) may hold anything")
        is_number = x == self.numerical_token_id
        if mask is not None:
            is_number = is_number & mask
        emb = self.token_emb(x)
        scale = torch.where(is_number, x_num, torch.ones((), dtype=x_num.dtype, device=x_num.device))  # NaN elsewhere selected away
        return emb * scale[..., None].to(emb.dtype)

    def heads(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """``(logits (b, n, v), numbers (b, n))`` from hidden states."""
        if self.tie_embedding:
            logits = (h @ self.token_emb.weight.t()) * (h.shape[-1] ** -0.5)
        else:
            logits = self.to_logits(h)
        return logits, self.to_numerical_output(h)[..., 0]

    @checked_once
    def forward(
        self,
        x: Tensor,
        x_num: Tensor,
        return_embeddings: bool = False,
        return_intermediates: bool = False,
        return_mems: bool = False,
        mask: Tensor | None = None,
        return_attn: bool = False,
        mems=None,
        pos: Tensor | None = None,
        prepend_embeds: Tensor | None = None,
        *,
        cache=None,
        return_cache: bool = False,
        **kwargs,
    ):
        """Run the model.

        Args:
            x: ``(b, n)`` token ids (padded positions may hold anything).
            x_num: ``(b, n)`` numbers, read where ``x`` is ``numerical_token_id`` at a real position only.
            mask: ``(b, n)`` padding mask (True = real).
            pos, prepend_embeds (+ ``prepend_mask``), ``context`` / ``context_mask``, ``condition`` /
                ``condition_mask``: as in ``ContinuousTransformerWrapper``.
            cache, return_cache: safeformer's ``KVCache`` (``x`` then holds the new positions only).
            return_embeddings, return_intermediates, return_attn: as in x-transformers.
            mems, return_mems: XL memories are not supported (a ``ValueError``).

        Returns:
            ``(logits (b, n, v), numbers (b, n))`` (hidden states with ``return_embeddings``), then the
            cache with ``return_cache``, then the intermediates / attention maps when asked for.
        """
        if mems is not None or return_mems:
            raise ValueError("mems / return_mems (XL recurrence) are not supported; use cache= / return_cache=True")
        emb = self.embed(x, x_num, mask)
        res = self.net(emb, mask=mask, pos=pos, prepend_embeds=prepend_embeds, cache=cache, return_cache=return_cache,
                       return_intermediates=return_intermediates, return_attn=return_attn, **kwargs)
        res = res if isinstance(res, tuple) else (res,)
        h, extra = res[0], res[1:]
        out = h if return_embeddings else self.heads(h)
        return (out, *extra) if extra else out


def _xval_kwargs_ok(kwargs: Mapping) -> None:
    bad = [k for k in kwargs if k in ("mems", "return_mems")]
    if bad:
        raise ValueError(f"{bad} (XL recurrence) are not supported")


class XValAutoregressiveWrapper(Configurable, nn.Module):
    """x-transformers' ``XValAutoregressiveWrapper``: next-token cross-entropy plus the number's squared
    error, and generation; with safeformer's condition dropping and classifier-free guidance.

    Args:
        net: an ``XValTransformerWrapper`` whose layers are a ``Decoder``.
        ignore_index: target value that does not count.
        pad_value: token fed in place of ignored tokens.
        numerical_loss_weight: weight of the squared error.
        cond_drop_prob, cond_drop_all_prob: as in ``AutoregressiveWrapper`` (drop the conditions per sample
            in training, so that guidance has an unconditional model).
    """

    def __init__(self, net: XValTransformerWrapper, ignore_index: int = -100, pad_value: int = 0,
                 numerical_loss_weight: float = 1.0, *, cond_drop_prob: float | dict[str, float] = 0.0,
                 cond_drop_all_prob: float = 0.0):
        super().__init__()
        if not isinstance(net, XValTransformerWrapper):
            raise TypeError(f"net must be an XValTransformerWrapper, got {type(net).__name__}")
        if not net.attn_layers.causal:
            raise ValueError("net must be causal (attn_layers=Decoder(...)) for next-token training and generation")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        if isinstance(pad_value, bool) or not isinstance(pad_value, int) or not 0 <= pad_value < net.num_tokens:
            raise ValueError(f"pad_value must be a token id in [0, num_tokens={net.num_tokens}), got {pad_value!r}")
        if isinstance(numerical_loss_weight, bool) or not isinstance(numerical_loss_weight, (int, float)) \
                or not math.isfinite(numerical_loss_weight) or numerical_loss_weight < 0:
            raise ValueError(f"numerical_loss_weight must be a finite number >= 0, got {numerical_loss_weight!r}")
        check_drop_kinds(net.attn_layers, cond_drop_prob)
        self._set_config_from(XValAutoregressiveWrapper.__init__, locals())
        if isinstance(cond_drop_all_prob, bool) or not (isinstance(cond_drop_all_prob, (int, float)) and 0.0 <= cond_drop_all_prob <= 1.0):
            raise ValueError(f"cond_drop_all_prob must be in [0, 1], got {cond_drop_all_prob!r}")
        self.net = net
        self.max_seq_len = net.max_seq_len
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.numerical_loss_weight = float(numerical_loss_weight)
        self.cond_drop_probs = drop_probabilities(cond_drop_prob)
        self.cond_drop_prob = max(self.cond_drop_probs.values())
        self.cond_drop_all_prob = float(cond_drop_all_prob)

    @checked_once
    def forward(
        self,
        x: Tensor,
        x_num: Tensor,
        return_loss_breakdown: bool = False,
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
    ):
        """The loss of ``x (b, n)`` with numbers ``x_num (b, n)``.

        Returns:
            the mean over counted targets of ``cross_entropy + numerical_loss_weight * squared_error``
            (``(b, n - 1)`` per target, 0 where not counted, with ``reduction="none"``); with
            ``return_loss_breakdown``, also ``LossBreakdown(cross_entropy_loss (b, n - 1),
            numerical_mse_loss (b, n - 1))``, 0 where not counted.
        """
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        conditions = condition_kwargs("XValAutoregressiveWrapper.forward", conditions)
        _xval_kwargs_ok(conditions)
        _check_inputs(x, x_num, mask)
        b = x.shape[0]
        conds = Conditions.from_kwargs({**locals(), **conditions}).check(self.net, b, x.device)
        if self.training and (self.cond_drop_prob > 0 or self.cond_drop_all_prob > 0):
            conds, _ = drop_conditions(conds, self.cond_drop_probs, all_prob=self.cond_drop_all_prob, generator=generator)
        real = x != self.ignore_index
        if mask is not None:
            real = real & mask
        inp = torch.where(real[:, :-1], x[:, :-1], torch.full_like(x[:, :-1], self.pad_value))
        counted = real[:, 1:] & real[:, :-1]  # (b, n - 1)
        target = torch.where(counted, x[:, 1:], torch.full_like(x[:, 1:], -100))
        inp_mask = real[:, :-1]
        logits, num_pred = self.net(inp, x_num[:, :-1], mask=inp_mask, **conds.kwargs())
        ce = safe_cross_entropy(logits, target, ignore_index=-100, reduction="none")  # (b, n - 1), 0 where not counted
        is_num = counted & (x[:, 1:] == self.net.numerical_token_id)
        zero = torch.zeros((), dtype=num_pred.dtype, device=num_pred.device)
        num_target = torch.where(is_num, x_num[:, 1:].to(num_pred.dtype), zero)
        mse = torch.where(is_num, (torch.where(is_num, num_pred, zero) - num_target) ** 2, zero)
        per_target = ce + self.numerical_loss_weight * mse.to(ce.dtype)
        if reduction == "none":
            loss = per_target
        else:
            loss = per_target.sum() / counted.sum().clamp(min=1).to(per_target.dtype)
        return (loss, LossBreakdown(ce, mse)) if return_loss_breakdown else loss

    @torch.no_grad()
    def generate(
        self,
        start_tokens: Tensor,
        start_numbers: Tensor,
        seq_len: int,
        filter_logits_fn: Callable | str | None = top_k,
        filter_kwargs: dict | None = None,
        temperature: float = 1.0,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        prepend_embeds: Tensor | None = None,
        prepend_mask: Tensor | None = None,
        condition: Tensor | None = None,
        condition_mask: Tensor | None = None,
        cond_scale: float | Mapping[str, float] | Callable = 1.0,
        negative_context: Tensor | None = None,
        negative_context_mask: Tensor | None = None,
        negative_prepend_embeds: Tensor | None = None,
        negative_prepend_mask: Tensor | None = None,
        negative_condition: Tensor | None = None,
        cache_kv: bool = True,
        non_number_value: float = 0.0,
        **conditions,
    ) -> GenerateReturn:
        """Sample ``seq_len`` tokens (and a number for each) after ``start_tokens`` / ``start_numbers``.

        Args:
            start_tokens, start_numbers: ``(b, n0)`` the prompts (left-padded when their lengths differ).
            seq_len: new positions (>= 0).
            filter_logits_fn, filter_kwargs, temperature: as in ``sample_logits`` (0 is greedy); by
                default ``top_k`` (x-transformers' default: ``ceil(0.1 * v)`` tokens kept); ``None``: no filter.
            mask: ``(b, n0)`` padding of the prompts (every prompt needs a real token).
            conditions and ``cond_scale``: as in ``AutoregressiveWrapper.generate``: guidance of the token
                logits (``compose_guidance``) and of the number (``compose_values``), every branch in one
                batched forward. Past ``max_seq_len`` each step sees the last ``max_seq_len`` real positions
                (x-transformers' window).
            cache_kv: decode with the KV cache.
            non_number_value: the number returned where the sampled token is not the numerical token
                (x-transformers returns NaN there; pass ``float('nan')`` for that).

        Returns:
            ``GenerateReturn(sampled_token_ids (b, seq_len), sampled_numbers (b, seq_len),
            is_number_mask (b, seq_len))``.
        """
        conditions = condition_kwargs("XValAutoregressiveWrapper.generate", conditions, negatives=True)
        _xval_kwargs_ok(conditions)
        filter_fn = _check_generate_args(start_tokens, start_numbers, seq_len, temperature, filter_logits_fn,
                                         filter_kwargs, mask)
        b, n0 = start_tokens.shape
        device = start_tokens.device
        conds, negatives = self._generate_conditions(dict(
            context=context, context_mask=context_mask, prepend_embeds=prepend_embeds, prepend_mask=prepend_mask,
            condition=condition, condition_mask=condition_mask, negative_context=negative_context,
            negative_context_mask=negative_context_mask, negative_prepend_embeds=negative_prepend_embeds,
            negative_prepend_mask=negative_prepend_mask, negative_condition=negative_condition, **conditions), b, device)
        schedule = GuidanceSchedule.build(cond_scale, conds.kinds(), has_uncond=bool(conds.kinds()), steps=seq_len)
        tokens = torch.full((b, seq_len), self.pad_value, dtype=torch.long, device=device)
        dtype = torch.promote_types(start_numbers.dtype, torch.float32)
        numbers = torch.zeros(b, seq_len, dtype=dtype, device=device)
        if seq_len == 0 or b == 0:
            is_number = tokens == self.net.numerical_token_id
            return GenerateReturn(tokens, numbers.masked_fill(~is_number, non_number_value), is_number)
        # one float sequence (b, n, 2): [token id, number]; padded slots zeroed so they convert cleanly
        seq = torch.stack((start_tokens.to(dtype), start_numbers.to(dtype)), -1)
        if mask is not None:
            seq = torch.where(mask[..., None], seq, torch.zeros((), dtype=dtype, device=device))
        nothing = torch.zeros((), dtype=torch.bool, device=device)  # a row with no token to draw: raised at the end
        steps = _XValSteps(schedule, temperature, filter_fn, filter_kwargs, nothing, tokens, numbers, dtype)
        self._decode(seq, mask, conds, negatives, steps, cache_kv)
        if bool(nothing):
            raise ValueError(NOTHING_TO_DRAW)
        is_number = tokens == self.net.numerical_token_id
        numbers = torch.where(is_number, numbers, torch.full((), non_number_value, dtype=dtype, device=device))
        return GenerateReturn(tokens, numbers, is_number)

    def _generate_conditions(self, kw: dict, b: int, device) -> tuple[Conditions, Conditions]:
        """``generate``'s conditions and negatives, checked (a kind only the negatives have: an empty one)."""
        conds = Conditions.from_kwargs(kw).check(self.net, b, device)
        negatives = Conditions.from_kwargs(kw, prefix="negative_").expand_batch(b).check(self.net, b, device, prefix="negative_")
        return conds.with_empty_for(negatives, b), negatives

    def _decode(self, seq: Tensor, mask: Tensor | None, conds: Conditions, negatives: Conditions,
                steps: _XValSteps, cache_kv: bool) -> None:
        """Run the decode engine in eval mode (the training flag restored after), filling ``steps``' outputs."""
        n0, seq_len = seq.shape[1], steps.tokens.shape[1]
        engine_net = _EngineNet(self.net)
        window = self.max_seq_len if self.net.pos_emb is not None and n0 + seq_len - 1 > self.max_seq_len else None
        b = seq.shape[0]
        was_training = self.training
        self.eval()
        try:
            engine = GuidedForward(engine_net, b, conds, negatives, steps.schedule, steps.combine, cache_kv=cache_kv,
                                   steps=seq_len, window=window)
            autoregress(engine, seq, mask, seq_len, steps.pick)
        finally:
            self.train(was_training)


def _check_generate_args(start_tokens, start_numbers, seq_len, temperature, filter_logits_fn, filter_kwargs,
                         mask) -> Callable | None:
    """``generate``'s prompts, length, sampling arguments and prompt mask; returns the filter function."""
    if not isinstance(start_tokens, Tensor) or start_tokens.dim() != 2:
        raise ValueError(f"start_tokens must be token ids of shape (b, n0), got {getattr(start_tokens, 'shape', type(start_tokens))}")
    if not isinstance(start_numbers, Tensor) or start_numbers.shape != start_tokens.shape:
        raise ValueError(f"start_numbers must have the shape of start_tokens {tuple(start_tokens.shape)}, "
                         f"got {getattr(start_numbers, 'shape', type(start_numbers))}")
    if not start_numbers.is_floating_point():
        raise TypeError(f"start_numbers must be a floating-point tensor, got dtype {start_numbers.dtype}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an integer >= 0, got {seq_len!r}")
    filter_fn = check_sampling(temperature, filter_logits_fn, filter_kwargs)
    b, n0 = start_tokens.shape
    if n0 == 0:
        raise ValueError("start_tokens needs at least one position")
    if mask is not None:
        validate_mask(mask, "mask", shape=(b, n0), device=start_tokens.device)
        if not bool(mask.any(1).all()):
            raise ValueError("mask: every prompt needs at least one real token (a row of mask is all False)")
    return filter_fn


@dataclass(frozen=True)
class _XValSteps:
    """One ``generate`` call's decode steps: how the branches combine, how a token and its number are drawn,
    and where they are written (``tokens``, ``numbers`` and the ``nothing`` flag, filled in place)."""

    schedule: GuidanceSchedule
    temperature: float
    filter_fn: Callable | None
    filter_kwargs: dict | None
    nothing: Tensor
    tokens: Tensor
    numbers: Tensor
    dtype: torch.dtype

    def combine(self, outs: dict[str, Tensor], t: int) -> tuple[Tensor, Tensor]:
        """The guided ``(logits, number)`` of step ``t`` from the branches' outputs."""
        if len(outs) == 1:
            o = next(iter(outs.values()))
            return o[:, :-1], o[:, -1]
        uncond = outs.pop("uncond")
        scales = self.schedule.at(t)
        logits = compose_guidance(uncond[:, :-1], {k: o[:, :-1] for k, o in outs.items()}, scales)
        num = compose_values(uncond[:, -1:], {k: o[:, -1:] for k, o in outs.items()}, scales)[:, 0]
        return logits, num

    def pick(self, guided: tuple[Tensor, Tensor], t: int) -> tuple[Tensor, bool]:
        """Draw step ``t``'s token, keep it and its number; the ``[token id, number]`` row fed back."""
        logits, num = guided
        token = draw(logits, self.temperature, self.filter_fn, self.filter_kwargs, self.nothing)  # (b,)
        num = num.to(self.dtype).clamp(-_VALUE_LIMIT, _VALUE_LIMIT)
        self.tokens[:, t] = token
        self.numbers[:, t] = num
        return torch.stack((token.to(self.dtype), num), -1), False

class _EngineNet(nn.Module):
    """The decode engine's net protocol over an ``XValTransformerWrapper``: a float sequence ``(b, n, 2)``
    of ``[token id, number]`` in, ``(b, n, v + 1)`` (logits, then the number) out."""

    def __init__(self, net: XValTransformerWrapper):
        super().__init__()
        self.inner = net

    @property
    def attn_layers(self):
        return self.inner.attn_layers

    def forward(self, seq: Tensor, mask: Tensor | None = None, cache=None, return_cache: bool = False, **kwargs):
        res = self.inner(seq[..., 0].long(), seq[..., 1], mask=mask, cache=cache, return_cache=return_cache, **kwargs)
        (logits, num), extra = (res[0], res[1:]) if return_cache else (res, ())
        out = torch.cat((logits.to(num.dtype) if logits.dtype != num.dtype else logits, num[..., None]), -1)
        return (out, *extra) if extra else out


# ----------------------------------------------------------------------------------------------------
# conversion from x-transformers
# ----------------------------------------------------------------------------------------------------


def xval_from_x_transformers(model):
    """Convert an x-transformers ``XValTransformerWrapper`` (or ``XValAutoregressiveWrapper``, keeping
    ``ignore_index`` and ``numerical_loss_weight``) with its weights. The layers go through
    ``from_x_transformers`` (its supported options; anything else is its ``ValueError``)."""
    from ..interop.convert import _xt, from_x_transformers

    xt, _ = _xt()
    from x_transformers import xval as xt_xval

    if isinstance(model, xt_xval.XValAutoregressiveWrapper):
        net = xval_from_x_transformers(model.net)
        return XValAutoregressiveWrapper(net, ignore_index=model.ignore_index,
                                         numerical_loss_weight=float(model.numerical_loss_weight))
    if not isinstance(model, xt_xval.XValTransformerWrapper):
        raise TypeError(f"expected an x_transformers XValTransformerWrapper or XValAutoregressiveWrapper, got {type(model).__name__}")
    if model.max_mem_len:
        raise ValueError("max_mem_len (XL memories) is not supported")
    if isinstance(model.pos_emb, xt.ScaledSinusoidalEmbedding):
        raise ValueError("scaled_sinu_pos_emb is not supported")
    use_abs = isinstance(model.pos_emb, xt.AbsolutePositionalEmbedding)
    num_mem = model.memory_tokens.shape[0] if model.has_memory_tokens else 0
    num_tokens = model.token_emb.emb.num_embeddings
    tied = not isinstance(model.to_logits, nn.Linear)
    # a stand-in x-transformers TransformerWrapper around the same layers, converted by from_x_transformers
    stand_in = xt.TransformerWrapper(num_tokens=num_tokens, max_seq_len=model.max_seq_len, attn_layers=model.attn_layers,
                                     use_abs_pos_emb=use_abs, num_memory_tokens=num_mem)
    with torch.no_grad():
        stand_in.token_emb.emb.weight.copy_(model.token_emb.emb.weight)
        if use_abs:
            stand_in.pos_emb.load_state_dict(model.pos_emb.state_dict())
        if num_mem:
            stand_in.memory_tokens.copy_(model.memory_tokens)
    converted = from_x_transformers(stand_in.eval())
    out = XValTransformerWrapper(
        num_tokens=num_tokens, max_seq_len=model.max_seq_len, numerical_token_id=model.numerical_token_id,
        attn_layers=converted.attn_layers, logits_dim=None if tied else model.to_logits.out_features,
        tie_embedding=tied, num_memory_tokens=num_mem or None, emb_dropout=model.emb_dropout.p,
        use_abs_pos_emb=use_abs and converted.pos_emb is not None,
    )
    with torch.no_grad():
        out.token_emb.weight.copy_(converted.token_emb.weight)
        if out.net.pos_emb is not None:
            out.net.pos_emb.load_state_dict(converted.pos_emb.state_dict())
        if num_mem:
            out.net.memory_tokens.copy_(converted.memory_tokens)
        if not tied:
            out.to_logits.load_state_dict(model.to_logits.state_dict())
        out.to_numerical_output.load_state_dict(model.to_numerical_output[0].state_dict())
    return out.to(model.token_emb.emb.weight.dtype).train(model.training)


def _check_inputs(x, x_num, mask) -> None:
    """The token ids ``x (b, n)``, the numbers ``x_num (b, n)`` and the padding ``mask`` (S9)."""
    _check_tokens(x, "x")
    if not isinstance(x_num, Tensor) or x_num.shape != x.shape:
        raise ValueError(f"x_num must have the shape of x {tuple(x.shape)}, got {getattr(x_num, 'shape', type(x_num))}")
    if not x_num.is_floating_point():
        raise TypeError(f"x_num must be a floating-point tensor, got dtype {x_num.dtype}")
    if mask is not None:
        validate_mask(mask, "mask", shape=tuple(x.shape), device=x.device)

# x-transformers' names that its module of this path imports from another (the same objects as there)
from ..core.xt_helpers import always  # noqa: E402, F401
from ..decoding.generation import top_p  # noqa: E402, F401
from ..nn.modules import AbsolutePositionalEmbedding  # noqa: E402, F401
from ..nn.xt_modules import ScaledSinusoidalEmbedding, TokenEmbedding  # noqa: E402, F401

# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.xval", "XValTransformerWrapper", xval_from_x_transformers)
register_converter("x_transformers.xval", "XValAutoregressiveWrapper", xval_from_x_transformers)
