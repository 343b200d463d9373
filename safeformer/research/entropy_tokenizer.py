"""``EntropyBasedTokenizer``: cut sequences into variable-length tokens where a small decoder's next-token
entropy passes a threshold (the byte-latent transformer's patching; x-transformers'
``x_transformers.entropy_based_tokenizer``), with padding that never matters.

Padding (``lens``, or a ``mask`` of any layout) never creates or moves a boundary: ids at padded positions
are replaced by 0 before the decoder sees them, the decoder gets the mask, the logits at padded positions
are selected away before the softmax (their entropy is never computed from them: it is exactly 0), and the
boundaries are found over each sample's real positions in order, so a left-padded, right-padded or
unpadded sample gives the same tokens. A zero-length sample has no token (a row of zeros in the token
lengths, an empty tuple of segments); an all-padding batch never calls the decoder.

Shape legend: b batch, n positions, v vocabulary, T tokens (the most of any sample).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.masks import check_lengths, validate_mask
from ..interop.convert import register_converter

__all__ = ["EntropyBasedTokenizer", "calc_entropy_from_logits", "get_accumulated_threshold_mask"]


def calc_entropy_from_logits(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last dim: ``(..., v) -> (...)``.

    Computed in float32 (float64 for float64 logits) from ``log_softmax``; a token at ``-inf`` (banned)
    adds exactly 0. ``mask (...)`` bool, True = real position: logits where it is False are never read
    (NaN or inf there reach neither the result nor a gradient) and their entropy is exactly 0.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"logits must be a floating-point tensor (..., v), got {getattr(logits, 'dtype', type(logits).__name__)}")
    if mask is not None:
        validate_mask(mask, "mask", shape=tuple(logits.shape[:-1]), device=logits.device)
    work = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if mask is not None:
        work = torch.where(mask[..., None], work, 0.0)
    logp = F.log_softmax(work, dim=-1)
    p = logp.exp()
    logp = torch.where(p > 0, logp, 0.0)  # a banned token (p = 0, log p = -inf) adds exactly 0, gradient too
    entropy = (-(p * logp).sum(-1)).clamp(min=0.0)
    return entropy if mask is None else torch.where(mask, entropy, 0.0)


def get_accumulated_threshold_mask(entropies: Tensor, threshold: float, ignore_entropy_below: float = 0.0) -> Tensor:
    """Boundaries where the entropy accumulated since the last boundary reaches ``threshold``.

    ``entropies (b, n)`` (non-negative): a token starting at position ``i`` ends at the first position
    ``k - 1 >= i`` with ``cum[k] >= cum[i] + threshold`` (``cum`` the cumulative sum from 0); entropies below
    ``ignore_entropy_below`` count as 0. Returns ``(b, n)`` bool, True where a token ends (the last
    position only if the threshold is reached there). The path is followed by pointer doubling:
    ``log2(n)`` vectorised steps.
    """
    b, n = entropies.shape
    device = entropies.device
    if ignore_entropy_below > 0.0:
        entropies = torch.where(entropies < ignore_entropy_below, 0.0, entropies)
    cum = F.pad(entropies.cumsum(-1), (1, 0), value=0.0)  # (b, n + 1): node k = before position k
    nodes = torch.arange(n + 1, device=device)
    nxt = torch.searchsorted(cum.contiguous(), (cum + threshold).contiguous())  # (b, n + 1), in [0, n + 1]
    nxt = torch.maximum(nxt, nodes + 1)  # every token holds at least one position
    nxt = torch.cat((nxt, nxt.new_full((b, 1), n + 1)), 1)  # node n + 1: past the end, absorbing
    reached = torch.zeros(b, n + 2, dtype=torch.bool, device=device)
    reached[:, 0] = True
    for _ in range((n + 1).bit_length()):  # after step t: every node of the path within 2**t jumps of node 0
        moved = torch.zeros_like(reached).scatter_(1, torch.where(reached, nxt, 0), reached)
        reached = reached | moved
        nxt = nxt.gather(1, nxt)
    return reached[:, 1:-1]


def _compact(mask: Tensor) -> tuple[Tensor, Tensor]:
    """``order (b, n)``: each sample's real positions first, in order; ``lengths (b,)``."""
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
    return order, mask.sum(1)


class EntropyBasedTokenizer(nn.Module):
    """Segment sequences where a decoder's next-token entropy is high (x-transformers' names).

    Args:
        decoder: a model mapping ids ``(b, n)`` to logits ``(b, n, v)`` (a safeformer ``TransformerWrapper``
            with a ``Decoder``; it is called with ``mask=`` when the batch is padded).
        entropy_threshold: a position whose entropy is at least this ends a token.
        accumulate_entropy: end a token when the entropy summed since the last boundary reaches the
            threshold instead.
        ignore_entropy_below: with ``accumulate_entropy``, entropies below this count as 0 (at most the
            threshold).
        max_token_size: tokens longer than this are cut every ``max_token_size`` positions.
    """

    def __init__(
        self,
        decoder: nn.Module,
        entropy_threshold: float,
        accumulate_entropy: bool = False,
        ignore_entropy_below: float = 0.0,
        max_token_size: int | None = None,
    ):
        super().__init__()
        if not isinstance(decoder, nn.Module):
            raise TypeError(f"decoder must be an nn.Module mapping ids to logits, got {type(decoder).__name__}")
        for name, value in (("entropy_threshold", entropy_threshold), ("ignore_entropy_below", ignore_entropy_below)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if ignore_entropy_below > entropy_threshold:
            raise ValueError(f"ignore_entropy_below must be lower than or equal to the entropy threshold, got "
                             f"{ignore_entropy_below} > entropy_threshold={entropy_threshold}")
        if max_token_size is not None and (isinstance(max_token_size, bool) or not isinstance(max_token_size, int)
                                           or max_token_size < 1):
            raise ValueError(f"max_token_size must be a positive integer or None, got {max_token_size!r}")
        self.decoder = decoder
        self.entropy_threshold = float(entropy_threshold)
        self.accumulate_entropy = bool(accumulate_entropy)
        self.ignore_entropy_below = float(ignore_entropy_below)
        self.max_token_size = max_token_size

    def _inputs(self, seq, lens, mask, decoder_forward_kwargs):
        if not isinstance(seq, Tensor) or seq.dim() not in (1, 2) or seq.dtype == torch.bool or seq.is_complex():
            raise ValueError(f"seq must be ids of shape (n,) or (b, n), got "
                             f"{getattr(seq, 'shape', type(seq).__name__)} {getattr(seq, 'dtype', '')}")
        if not isinstance(decoder_forward_kwargs, dict):
            raise TypeError(f"decoder_forward_kwargs must be a dict, got {type(decoder_forward_kwargs).__name__}")
        kwargs = dict(decoder_forward_kwargs)
        no_batch = seq.dim() == 1
        seq = seq[None] if no_batch else seq
        b, n = seq.shape
        if "mask" in kwargs:
            if lens is not None or mask is not None:
                raise ValueError("decoder_forward_kwargs holds a mask; pass the padding once (lens= or mask=)")
            mask = kwargs.pop("mask")
        if lens is not None and mask is not None:
            raise ValueError("pass lens or mask, not both")
        if lens is not None:
            if isinstance(lens, Tensor) and lens.dim() == 0:
                lens = lens[None]
            check_lengths(lens, "lens", b, max_len=n, device=seq.device)
            mask = torch.arange(n, device=seq.device)[None] < lens[:, None]
        elif mask is not None:
            if isinstance(mask, Tensor) and no_batch and mask.dim() == 1:
                mask = mask[None]
            validate_mask(mask, "mask", shape=(b, n), device=seq.device)
        return seq, mask, kwargs, no_batch

    def entropies(self, seq: Tensor, lens: Tensor | None = None, mask: Tensor | None = None,
                  decoder_forward_kwargs: dict | None = None) -> tuple[Tensor, Tensor | None]:
        """The decoder's next-token entropy at each position, ``(b, n)`` float32 (float64 for a float64
        decoder), exactly 0 at padded positions; and the padding mask (``None``: no padding). Runs with the
        caller's grad mode and the decoder's own training mode."""
        seq, mask, kwargs, _ = self._inputs(seq, lens, mask, {} if decoder_forward_kwargs is None else decoder_forward_kwargs)
        return self._entropies(seq, mask, kwargs), mask

    def _entropies(self, seq: Tensor, mask: Tensor | None, kwargs: dict) -> Tensor:
        b, n = seq.shape
        if b == 0 or n == 0 or (mask is not None and not bool(mask.any())):  # nothing real: no decoder call
            return torch.zeros(b, n, device=seq.device)
        if mask is not None:
            seq = torch.where(mask, seq, torch.zeros_like(seq))  # padded ids never reach the decoder
            logits = self.decoder(seq, mask=mask, **kwargs)
        else:
            logits = self.decoder(seq, **kwargs)
        if not isinstance(logits, Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (b, n) \
                or not logits.is_floating_point():
            raise ValueError(f"the decoder must return logits (b, n, v) = ({b}, {n}, v), got "
                             f"{getattr(logits, 'shape', type(logits).__name__)}")
        entropies = calc_entropy_from_logits(logits, mask)
        if not bool(torch.isfinite(entropies).all()):
            bad = (~torch.isfinite(entropies)).nonzero()[0].tolist()
            raise ValueError(f"the decoder's logits give a non-finite entropy at real position {tuple(bad)} "
                             f"(NaN or +inf logits there)")
        return entropies

    def boundaries(self, entropies: Tensor, mask: Tensor | None = None) -> Tensor:
        """``(b, n)`` bool: True where a token ends, from ``entropies (b, n)``, in the compacted layout (each
        sample's real positions first, in order; a sample of length ``L`` has its last boundary at ``L - 1``)."""
        b, n = entropies.shape
        if mask is None:
            lengths = torch.full((b,), n, dtype=torch.long, device=entropies.device)
            compact = entropies
        else:
            order, lengths = _compact(mask)
            compact = entropies.gather(1, order)
        arange = torch.arange(n, device=entropies.device)
        real = arange[None] < lengths[:, None]  # (b, n) in the compacted layout
        compact = torch.where(real, compact, 0.0)
        if self.accumulate_entropy:
            over = get_accumulated_threshold_mask(compact, self.entropy_threshold, self.ignore_entropy_below)
        else:
            over = compact >= self.entropy_threshold
        bounds = (over | (arange[None] == lengths[:, None] - 1)) & real
        if self.max_token_size is not None:
            ends = torch.where(bounds, arange[None], -1)
            prev_end = F.pad(ends, (1, -1), value=-1).cummax(1).values  # last end before each position
            offset = arange[None] - prev_end  # 1-based position within its token
            bounds = (bounds | (offset % self.max_token_size == 0)) & real
        return bounds

    @torch.no_grad()
    def forward(
        self,
        seq: Tensor,
        lens: Tensor | None = None,
        return_segmented_seq: bool = False,
        decoder_forward_kwargs: dict | None = None,
        *,
        mask: Tensor | None = None,
    ):
        """Cut ``seq`` (``(b, n)`` or ``(n,)``) into tokens.

        Args:
            seq: ids.
            lens: ``(b,)`` lengths (right padding), integers in ``[0, n]``.
            return_segmented_seq: return the segments instead of their lengths.
            decoder_forward_kwargs: more keywords for the decoder (a ``mask`` there is the padding mask).
            mask: ``(b, n)`` bool, True = real position, any layout (safeformer's; not with ``lens``).

        Returns:
            token lengths ``(b, T)`` long, zero-padded (``(T,)`` for a 1-d ``seq``); or with
            ``return_segmented_seq`` a list (per sample) of tuples of the real ids of each token (one tuple for
            a 1-d ``seq``). The decoder runs in eval mode; its training mode is restored afterwards.
        """
        seq, mask, kwargs, no_batch = self._inputs(seq, lens, mask, {} if decoder_forward_kwargs is None else decoder_forward_kwargs)
        b, n = seq.shape
        was_training = self.decoder.training
        self.decoder.eval()
        try:
            entropies = self._entropies(seq, mask, kwargs)
        finally:
            self.decoder.train(was_training)
        bounds = self.boundaries(entropies, mask)
        arange = torch.arange(n, device=seq.device)
        num_tokens = bounds.sum(1)  # (b,)
        most = int(num_tokens.max()) if b else 0
        ends = torch.where(bounds, arange[None] + 1, n + 1).sort(1).values[:, :most]  # (b, T), 1-based ends first
        starts = torch.cat((ends.new_zeros(b, 1), ends[:, :-1]), 1)[:, :most]  # (b, T)
        token_idx = torch.arange(most, device=seq.device)
        token_lengths = torch.where(token_idx[None] < num_tokens[:, None], ends - starts, 0)
        if not return_segmented_seq:
            return token_lengths[0] if no_batch else token_lengths
        segmented = []
        for i in range(b):
            real = seq[i] if mask is None else seq[i][mask[i]]
            sizes = token_lengths[i, : int(num_tokens[i])].tolist()
            segmented.append(tuple(real.split(sizes)) if sizes else ())
        return segmented[0] if no_batch else segmented


def entropy_tokenizer_from_x_transformers(tokenizer: nn.Module, *, drop_training_only: bool = False) -> EntropyBasedTokenizer:
    """Convert an ``x_transformers.entropy_based_tokenizer.EntropyBasedTokenizer``: its decoder through
    ``safeformer.from_x_transformers`` (an x-transformers ``TransformerWrapper``), its options as they are.

    Raises:
        TypeError: ``tokenizer`` is not an x-transformers ``EntropyBasedTokenizer``.
        ValueError: the decoder uses options safeformer cannot represent.
    """
    from x_transformers.entropy_based_tokenizer import EntropyBasedTokenizer as XTTokenizer

    from ..interop.convert import from_x_transformers

    if not isinstance(tokenizer, XTTokenizer):
        raise TypeError(f"tokenizer must be an x_transformers EntropyBasedTokenizer, got {type(tokenizer).__name__}")
    decoder = from_x_transformers(tokenizer.decoder, drop_training_only=drop_training_only)
    return EntropyBasedTokenizer(decoder, tokenizer.entropy_threshold, accumulate_entropy=tokenizer.accumulate_entropy,
                                 ignore_entropy_below=tokenizer.ignore_entropy_below,
                                 max_token_size=tokenizer.max_token_size)


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.entropy_based_tokenizer", "EntropyBasedTokenizer", entropy_tokenizer_from_x_transformers, takes_drop=True)
