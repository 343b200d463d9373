"""Wrappers: ``TransformerWrapper`` (tokens in, logits out), ``ContinuousTransformerWrapper`` (vectors
in and out) and ``XTransformer`` (encoder-decoder).

Shape legend: b batch, n positions, j context length, c model width, v vocabulary size.
Masks: bool, True = real position / may attend (``masks.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .checkpoint import Configurable
from .layers import AttentionLayers, Decoder, Encoder, KVCache
from .masks import check_finite as _check_finite
from .masks import masked_mean, safe_cross_entropy, validate_mask
from .modules import AbsolutePositionalEmbedding, positions_from_mask

__all__ = ["TransformerWrapper", "ContinuousTransformerWrapper", "XTransformer"]


def _check_layers(attn_layers) -> None:
    if not isinstance(attn_layers, AttentionLayers):
        raise TypeError(
            f"attn_layers must be an Encoder, Decoder, CrossAttender or AttentionLayers, got {type(attn_layers).__name__}"
        )


def _check_tokens(x, name: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be token ids of shape (b, n), got {getattr(x, 'shape', type(x))}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype}")


class _Wrapper(Configurable, nn.Module):
    """Shared plumbing: positions, the optional absolute embedding, the finite-input check."""

    attn_layers: AttentionLayers

    def _init_positions(self, dim: int, max_seq_len: int, use_abs_pos_emb: bool) -> None:
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        use_abs = use_abs_pos_emb and not self.attn_layers.has_relative_positions
        self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len) if use_abs else None

    def _positions(self, mask: Tensor | None, b: int, n: int, device, cache: KVCache | None) -> Tensor:
        past = 0 if cache is None else cache.length
        if self.pos_emb is not None and past + n > self.max_seq_len:
            raise ValueError(
                f"sequence of {past + n} positions ({past} cached + {n} new) is longer than max_seq_len={self.max_seq_len}"
            )
        return positions_from_mask(mask, n, device, offset=None if cache is None else cache.count)

    def _check_context(self, context, context_mask, check: bool) -> None:
        if context is not None:
            if not isinstance(context, Tensor) or context.dim() != 3:
                raise ValueError(f"context must have shape (b, j, dim_context), got {getattr(context, 'shape', type(context))}")
            if not context.is_floating_point():
                raise TypeError(f"context must be a floating-point tensor, got dtype {context.dtype}")
        if context is not None and context_mask is not None:
            validate_mask(context_mask, "context_mask", shape=tuple(context.shape[:2]), device=context.device)
        if check and context is not None:
            _check_finite(context, context_mask, "context")

    def _run(self, x, mask, positions, context, context_mask, attn_mask, cache, return_cache):
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        x = self.emb_dropout(x)
        return self.attn_layers(
            x, mask=mask, context=context, context_mask=context_mask, attn_mask=attn_mask,
            positions=positions, cache=cache, return_cache=return_cache,
        )


class TransformerWrapper(_Wrapper):
    """Token ids in, logits out.

    Args:
        num_tokens: vocabulary size v.
        max_seq_len: longest sequence (for the absolute position embedding).
        attn_layers: an ``Encoder``, ``Decoder``, ``CrossAttender`` or ``AttentionLayers``.
        emb_dropout: dropout on the embeddings.
        use_abs_pos_emb: learned absolute positions (skipped when the layers use rotary or ALiBi).
        tie_embedding: the output projection shares the token embedding's weights.
        return_only_embed: no output projection: the model returns hidden states (an encoder).
        logits_dim: output size (default ``num_tokens``).
        check_finite: by default, check that real positions of float inputs (``context``) are finite
            and raise ``ValueError`` naming the argument otherwise (S9); costs a device sync.

    Example:
        >>> model = TransformerWrapper(num_tokens=256, max_seq_len=128,
        ...     attn_layers=Decoder(dim=64, depth=2, heads=4, cross_attend=True))
        >>> logits = model(tokens, mask=mask, context=ctx, context_mask=ctx_mask)  # (b, n, 256)
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        max_seq_len: int,
        attn_layers: AttentionLayers,
        emb_dropout: float = 0.0,
        use_abs_pos_emb: bool = True,
        tie_embedding: bool = False,
        logits_dim: int | None = None,
        return_only_embed: bool = False,
        check_finite: bool = False,
    ):
        super().__init__()
        _check_layers(attn_layers)
        self._set_config(
            num_tokens=num_tokens, max_seq_len=max_seq_len, attn_layers=attn_layers, emb_dropout=emb_dropout,
            use_abs_pos_emb=use_abs_pos_emb, tie_embedding=tie_embedding, logits_dim=logits_dim,
            return_only_embed=return_only_embed, check_finite=check_finite,
        )
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        if tie_embedding and logits_dim not in (None, num_tokens):
            raise ValueError("tie_embedding=True needs logits_dim == num_tokens")
        dim = attn_layers.dim
        self.num_tokens = num_tokens
        self.attn_layers = attn_layers
        self.token_emb = nn.Embedding(num_tokens, dim)
        self._init_positions(dim, max_seq_len, use_abs_pos_emb)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.tie_embedding = tie_embedding
        self.return_only_embed = return_only_embed
        has_head = not (tie_embedding or return_only_embed)
        self.to_logits = nn.Linear(dim, logits_dim or num_tokens, bias=False) if has_head else None
        self.check_finite = check_finite

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        return_embeddings: bool = False,
        return_pooled: bool = False,
        cache: KVCache | None = None,
        return_cache: bool = False,
        check_finite: bool | None = None,
    ):
        """Run the model.

        Args:
            x: ``(b, n)`` token ids. Ids at padded positions are never looked up (any value is fine).
            mask: ``(b, n)`` bool padding mask, True = real token.
            context: ``(b, j, c_ctx)`` for cross-attention (``j`` may be 0), or ``None``.
            context_mask: ``(b, j)`` bool; an all-False row drops that sample's condition exactly.
            attn_mask: extra self-attention mask ``(b, n, n)`` / ``(n, n)`` (True = may attend).
            return_embeddings: return hidden states ``(b, n, c)`` instead of logits.
            return_pooled: return the mean of hidden states over real positions, ``(b, c)``; a fully
                padded sample gives 0, not NaN (S8).
            cache: a ``KVCache`` from an earlier call; ``x`` holds only the new tokens.
            return_cache: also return the updated ``KVCache``.
            check_finite: override the model's ``check_finite`` for this call.

        Returns:
            logits ``(b, n, v)`` (or embeddings / pooled), and the cache if ``return_cache``.
        """
        _check_tokens(x, "x")
        b, n = x.shape
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
            x = torch.where(mask, x, torch.zeros_like(x))
        self._check_context(context, context_mask, self.check_finite if check_finite is None else check_finite)
        positions = self._positions(mask, b, n, x.device, cache)
        h = self._run(self.token_emb(x), mask, positions, context, context_mask, attn_mask, cache, return_cache)
        h, new_cache = h if return_cache else (h, None)
        if return_pooled:
            out = masked_mean(h, mask, dim=1)  # (b, c)
        elif return_embeddings or self.return_only_embed:
            out = h
        else:
            out = h @ self.token_emb.weight.t() if self.tie_embedding else self.to_logits(h)  # (b, n, v)
        return (out, new_cache) if return_cache else out


class ContinuousTransformerWrapper(_Wrapper):
    """Vectors in, vectors out.

    Args:
        dim_in: input feature size (``None``: inputs already have the model width).
        dim_out: output feature size (``None``: return hidden states).
        max_seq_len: longest sequence (for the absolute position embedding).
        attn_layers: the layer stack.
        emb_dropout, use_abs_pos_emb, check_finite: as in ``TransformerWrapper``; ``check_finite``
            checks ``x`` as well as ``context``.
    """

    def __init__(
        self,
        *,
        max_seq_len: int,
        attn_layers: AttentionLayers,
        dim_in: int | None = None,
        dim_out: int | None = None,
        emb_dropout: float = 0.0,
        use_abs_pos_emb: bool = True,
        check_finite: bool = False,
    ):
        super().__init__()
        _check_layers(attn_layers)
        self._set_config(
            max_seq_len=max_seq_len, attn_layers=attn_layers, dim_in=dim_in, dim_out=dim_out,
            emb_dropout=emb_dropout, use_abs_pos_emb=use_abs_pos_emb, check_finite=check_finite,
        )
        dim = attn_layers.dim
        self.attn_layers = attn_layers
        self.dim_in = dim if dim_in is None else dim_in
        self.project_in = nn.Identity() if dim_in is None else nn.Linear(dim_in, dim)
        self.project_out = nn.Identity() if dim_out is None else nn.Linear(dim, dim_out)
        self._init_positions(dim, max_seq_len, use_abs_pos_emb)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.check_finite = check_finite

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        return_embeddings: bool = False,
        return_pooled: bool = False,
        cache: KVCache | None = None,
        return_cache: bool = False,
        check_finite: bool | None = None,
    ):
        """Run the model on ``x (b, n, dim_in)``; arguments as in ``TransformerWrapper.forward``.

        Values at padded positions of ``x`` (mask False) are selected away before any use: NaN or
        inf there reaches no output and no gradient.
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim_in:
            raise ValueError(f"x must have shape (b, n, dim_in={self.dim_in}), got {getattr(x, 'shape', type(x))}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        b, n, _ = x.shape
        check = self.check_finite if check_finite is None else check_finite
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
        if check:
            _check_finite(x, mask, "x")
        if mask is not None:
            x = torch.where(mask[..., None], x, 0.0)
        self._check_context(context, context_mask, check)
        positions = self._positions(mask, b, n, x.device, cache)
        h = self._run(self.project_in(x), mask, positions, context, context_mask, attn_mask, cache, return_cache)
        h, new_cache = h if return_cache else (h, None)
        if return_pooled:
            out = masked_mean(h, mask, dim=1)
        elif return_embeddings:
            out = h
        else:
            out = self.project_out(h)
        return (out, new_cache) if return_cache else out


class XTransformer(Configurable, nn.Module):
    """Encoder-decoder: ``model(src, tgt, mask=src_mask)`` returns the next-token loss on ``tgt``.

    Args:
        dim: model width of encoder and decoder.
        enc_num_tokens, enc_max_seq_len, enc_depth, enc_heads: the encoder.
        dec_num_tokens, dec_max_seq_len, dec_depth, dec_heads: the decoder (cross-attends to the
            encoder's output).
        dim_head, kv_heads, rotary_pos_emb, ff_glu, use_rmsnorm, attn_dropout, ff_dropout: shared
            layer options (see ``AttentionLayers``).
        tie_token_emb: the decoder shares the encoder's token embedding (needs equal vocabularies).
        ignore_index: target value that does not count in the loss.
        pad_value: token used in place of ignored targets when they are fed back as inputs (and
            written after a sample's ``eos_token`` in ``generate``).
        cond_drop_prob: during training, each sample's encoder output is dropped (its source mask
            becomes all False: the empty context) with this probability, for classifier-free guidance.
    """

    def __init__(
        self,
        *,
        dim: int,
        enc_num_tokens: int,
        enc_max_seq_len: int,
        dec_num_tokens: int,
        dec_max_seq_len: int,
        enc_depth: int = 6,
        dec_depth: int = 6,
        enc_heads: int = 8,
        dec_heads: int = 8,
        dim_head: int = 64,
        kv_heads: int | None = None,
        rotary_pos_emb: bool = False,
        ff_glu: bool = False,
        use_rmsnorm: bool = False,
        attn_dropout: float = 0.0,
        ff_dropout: float = 0.0,
        tie_token_emb: bool = False,
        ignore_index: int = -100,
        pad_value: int = 0,
        cond_drop_prob: float = 0.0,
    ):
        super().__init__()
        if not (isinstance(cond_drop_prob, (int, float)) and 0.0 <= cond_drop_prob <= 1.0):
            raise ValueError(f"cond_drop_prob must be in [0, 1], got {cond_drop_prob!r}")
        self._set_config(
            dim=dim, enc_num_tokens=enc_num_tokens, enc_max_seq_len=enc_max_seq_len, dec_num_tokens=dec_num_tokens,
            dec_max_seq_len=dec_max_seq_len, enc_depth=enc_depth, dec_depth=dec_depth, enc_heads=enc_heads,
            dec_heads=dec_heads, dim_head=dim_head, kv_heads=kv_heads, rotary_pos_emb=rotary_pos_emb, ff_glu=ff_glu,
            use_rmsnorm=use_rmsnorm, attn_dropout=attn_dropout, ff_dropout=ff_dropout, tie_token_emb=tie_token_emb,
            ignore_index=ignore_index, pad_value=pad_value, cond_drop_prob=cond_drop_prob,
        )
        shared = dict(dim=dim, dim_head=dim_head, kv_heads=kv_heads, rotary_pos_emb=rotary_pos_emb, ff_glu=ff_glu,
                      use_rmsnorm=use_rmsnorm, attn_dropout=attn_dropout, ff_dropout=ff_dropout)
        self.encoder = TransformerWrapper(
            num_tokens=enc_num_tokens, max_seq_len=enc_max_seq_len,
            attn_layers=Encoder(depth=enc_depth, heads=enc_heads, **shared), return_only_embed=True,
        )
        self.decoder = TransformerWrapper(
            num_tokens=dec_num_tokens, max_seq_len=dec_max_seq_len,
            attn_layers=Decoder(depth=dec_depth, heads=dec_heads, cross_attend=True, **shared),
        )
        if tie_token_emb:
            if enc_num_tokens != dec_num_tokens:
                raise ValueError("tie_token_emb=True needs enc_num_tokens == dec_num_tokens")
            self.decoder.token_emb = self.encoder.token_emb
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.cond_drop_prob = float(cond_drop_prob)

    def encode(self, src: Tensor, mask: Tensor | None = None) -> Tensor:
        """Encoder hidden states ``(b, j, c)`` of ``src (b, j)``."""
        return self.encoder(src, mask=mask, return_embeddings=True)

    def forward(self, src: Tensor, tgt: Tensor, *, mask: Tensor | None = None, tgt_mask: Tensor | None = None) -> Tensor:
        """Next-token cross-entropy of ``tgt (b, n)`` given ``src (b, j)``.

        Args:
            src: source token ids.
            tgt: target token ids; positions equal to ``ignore_index`` (or False in ``tgt_mask``) do not
                count. A batch with no counted target gives a loss of exactly 0 with zero gradient (S8).
            mask: ``(b, j)`` source padding mask (True = real). An all-False row or ``j == 0`` is an
                empty source: the decoder runs unconditioned for that sample. In training mode each
                sample's source is dropped this way with probability ``cond_drop_prob``.
            tgt_mask: ``(b, n)`` target padding mask (True = real).
        """
        _check_tokens(src, "src")
        enc = self.encode(src, mask)
        context_mask = mask
        if self.training and self.cond_drop_prob > 0:
            b, j = enc.shape[:2]
            keep = torch.rand(b, device=enc.device) >= self.cond_drop_prob  # (b,)
            context_mask = keep[:, None].expand(b, j) if mask is None else mask & keep[:, None]
        return _next_token_loss(self.decoder, tgt, tgt_mask, self.ignore_index, self.pad_value,
                                name="tgt", mask_name="tgt_mask", context=enc, context_mask=context_mask)

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        start_tokens: Tensor,
        seq_len: int,
        *,
        mask: Tensor | None = None,
        start_mask: Tensor | None = None,
        cond_scale: float = 1.0,
        negative_src: Tensor | None = None,
        negative_mask: Tensor | None = None,
        **options,
    ) -> Tensor:
        """Generate ``seq_len`` target tokens after ``start_tokens (b, n)`` given ``src (b, j)``.

        Args:
            src: source token ids.
            start_tokens: the decoder's prompt (e.g. a start token, ``(b, 1)``).
            seq_len: how many tokens to generate.
            mask: ``(b, j)`` source padding mask (True = real).
            start_mask: ``(b, n)`` padding mask of ``start_tokens`` (left padding).
            cond_scale: classifier-free guidance scale; 1.0 runs the conditional branch only.
                The unconditional branch sees the empty source (all-False mask), or ``negative_src``.
            negative_src, negative_mask: source token ids ``(b, j')`` or ``(1, j')`` (and mask) whose
                encoding is the unconditional branch's context.
            **options: as in ``AutoregressiveWrapper.generate``: ``temperature``, ``filter_logits_fn``,
                ``filter_kwargs``, ``eos_token``, ``cache_kv``, ``guidance_rescale``.

        Returns:
            ``(b, seq_len)`` new target token ids.
        """
        from .generation import generate_tokens  # generation.py builds on this module: import late

        if negative_mask is not None and negative_src is None:
            raise ValueError("negative_mask was given without negative_src")
        was_training = self.training
        self.eval()
        try:
            enc = self.encode(src, mask)
            uncond, uncond_mask = None, None
            if negative_src is not None and cond_scale != 1.0:
                uncond, uncond_mask = self.encode(negative_src, negative_mask), negative_mask
                if uncond.shape[0] == 1 and enc.shape[0] != 1:  # one negative source for the whole batch
                    uncond = uncond.expand(enc.shape[0], -1, -1)
                    uncond_mask = None if uncond_mask is None else uncond_mask.expand(enc.shape[0], -1)
            return generate_tokens(
                self.decoder, start_tokens, seq_len, mask=start_mask, context=enc, context_mask=mask,
                uncond_context=uncond, uncond_context_mask=uncond_mask, cond_scale=cond_scale,
                pad_value=self.pad_value, **options,
            )
        finally:
            self.train(was_training)


def _next_token_loss(
    net, tokens: Tensor, mask: Tensor | None, ignore_index: int, pad_value: int, *,
    name: str = "x", mask_name: str = "mask", **kwargs,
) -> Tensor:
    """Shifted next-token loss of a ``TransformerWrapper`` on ``tokens (b, n)``.

    A target counts when it and the position that predicts it are both real (not ``ignore_index``,
    not masked), so a left-padded sample scores exactly the targets it would score alone.
    """
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        raise ValueError(f"{name} must be token ids of shape (b, n), got {getattr(tokens, 'shape', type(tokens))}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if mask is not None:
        validate_mask(mask, mask_name, shape=tuple(tokens.shape), device=tokens.device)
    real = tokens != ignore_index
    if mask is not None:
        real = real & mask
    inp, target = tokens[:, :-1], tokens[:, 1:]
    inp = torch.where(real[:, :-1], inp, torch.full_like(inp, pad_value))  # ignored ids are not looked up
    # ignored inputs (ignore_index, or mask False) are padding: masked, so left padding changes nothing
    # (S4). Without a user mask and without ignored tokens no mask is passed, so the decoder keeps the
    # mask-free causal path (is_causal, the flash kernel); telling the two apart reads one bool on the
    # host, in the loss only (never inside attend).
    inp_mask = real[:, :-1]
    if mask is None and not bool((tokens == ignore_index).any()):
        inp_mask = None
    counted = real[:, 1:] & real[:, :-1]
    target = torch.where(counted, target, torch.full_like(target, ignore_index))
    logits = net(inp, mask=inp_mask, **kwargs)
    return safe_cross_entropy(logits, target, ignore_index=ignore_index)
