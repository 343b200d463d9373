"""x-transformers' ``ContinuousTransformerAutoencoder`` (the "RL token" autoencoder), on safeformer's
``ContinuousTransformerWrapper`` stacks.

Shape legend: b batch, n sequence positions, c input features (``dim_input``), d model width, l latent
width. Masks follow the one convention (bool, True = real position; see ``masks.py``).

The model: an ``Encoder`` reads the sequence; its output is mean-pooled over the *real* positions and
passed through a bottleneck (deterministic, or variational with a KL term) to one latent per sample;
the latent becomes one prefix row of a causal ``Decoder`` that reconstructs the sequence (L1 or L2).

Safety (docs/safety.md):
- Padding comes from ``lens`` (right padding, x-transformers' name) or ``mask`` (any padding, left
  included). Values at padded positions (NaN and inf too) are selected away before any use: they reach
  no latent, output, loss or gradient, and their gradient is exactly 0.
- A fully padded sample pools to exactly 0 (never 0 / 0); its latent is finite, and it counts in no loss:
  neither the reconstruction loss nor the KL term. A batch that is all padding gives a loss of exactly 0
  with zero (present) gradients.
- The KL term is computed in float32 (float64 for float64 models) with ``log_var`` clamped to
  ``[-LOG_VAR_LIMIT, LOG_VAR_LIMIT]``, so it is finite for any weights.
- A dropped latent (``latents_dropout_prob`` in training) is a masked prefix row: exactly no prefix.
- Losses are computed and returned in float32 (float64 for float64 models), whatever the model's dtype.

Differences from x-transformers (on purpose): x-transformers' dropped latent only shifts the absolute
positions of the sequence by one (the latent row stays visible); its decoder sees padding as real
tokens (the causal mask hides it from real positions under right padding, so outputs agree); its KL
mean counts fully padded samples. In eval mode with right padding and no fully padded sample, the two
give equal latents, reconstructions and losses on the same weights
(``continuous_autoencoder_from_x_transformers``; ``tests/test_continuous_autoencoder.py``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.losses import masked_mean
from ..core.masks import checked_once, validate_mask
from ..core.xt_helpers import default, exists  # noqa: F401  (x-transformers' helpers of this module)
from ..interop.convert import register_converter
from ..stack.layers import Decoder, Encoder
from ..stack.wrappers import ContinuousTransformerWrapper

__all__ = [
    "ContinuousTransformerAutoencoder",
    "DeterministicLatentBottleneck",
    "VariationalLatentBottleneck",
    "continuous_autoencoder_from_x_transformers",
]

LOG_VAR_LIMIT = 30.0  # |log variance| beyond this is clamped: exp(30) stays finite in float32


class VariationalLatentBottleneck(nn.Module):
    """x-transformers' variational bottleneck: ``(b, d) -> (latents (b, l), kl (b,) or scalar)``.

    ``latents = mean + exp(log_var / 2) * noise``; ``noise`` is drawn from ``randn`` unless given. The
    KL divergence to a standard normal is summed over the latent features, in float32 (float64 for
    float64 inputs), with ``log_var`` clamped to ``[-LOG_VAR_LIMIT, LOG_VAR_LIMIT]``.
    """

    def __init__(self, dim: int, dim_latent: int, kl_div_floor: float = 0.0):
        super().__init__()
        self.kl_div_floor = kl_div_floor  # accepted as in x-transformers (which does not use it either)
        self.dim_latent = dim_latent
        self.to_mean_log_var = nn.Sequential(nn.Linear(dim, dim_latent * 2))

    def forward(self, x: Tensor, return_unreduced_loss: bool = False, *, noise: Tensor | None = None):
        mean, log_var = self.to_mean_log_var(x).chunk(2, dim=-1)  # (b, l) each
        log_var = log_var.clamp(-LOG_VAR_LIMIT, LOG_VAR_LIMIT)
        if noise is None:
            noise = torch.randn_like(mean)
        elif noise.shape != mean.shape:
            raise ValueError(f"noise must have shape {tuple(mean.shape)}, got {tuple(noise.shape)}")
        latents = mean + (0.5 * log_var).exp() * noise
        acc = torch.promote_types(mean.dtype, torch.float32)
        m, lv = mean.to(acc), log_var.to(acc)
        kl = (0.5 * (lv.exp() + m.square() - lv - 1.0)).sum(-1)  # (b,)
        return latents, (kl if return_unreduced_loss else kl.mean())


class DeterministicLatentBottleneck(nn.Module):
    """x-transformers' deterministic bottleneck: a projection and an optional activation, no loss."""

    def __init__(self, dim: int, dim_latent: int, activation: nn.Module | None = None):
        super().__init__()
        self.proj = nn.Linear(dim, dim_latent)
        self.activation = nn.Identity() if activation is None else activation

    def forward(self, x: Tensor, return_unreduced_loss: bool = False):
        return self.activation(self.proj(x)), None


def _check_int(v, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


class ContinuousTransformerAutoencoder(nn.Module):
    """x-transformers' ``ContinuousTransformerAutoencoder``, with its constructor keywords.

    Args:
        dim, enc_depth, dec_depth, max_seq_len: model width, encoder and decoder depths, longest sequence.
        dim_input: feature size of the sequence (default ``dim``).
        dim_latent: latent size (default ``dim``).
        bottleneck: a module ``(pooled (b, d), return_unreduced_loss) -> (latents (b, l), aux | None)``
            used instead of the built-in ones (its aux loss should be per sample when unreduced).
        bottleneck_type: ``"deterministic"`` or ``"variational"``.
        deterministic_bottleneck_kwargs, variational_bottleneck_kwargs: their keywords.
        loss_type: ``"l1"`` or ``"l2"`` reconstruction loss.
        attn_dim_head, heads: attention shape of both stacks.
        enc_kwargs, dec_kwargs: further keywords for the ``Encoder`` / the ``Decoder``.
        latents_dropout_prob: in training, the probability that a sample's latent is dropped (the
            decoder then sees no prefix).
        kwargs: further keywords for both stacks.
    """

    def __init__(
        self,
        *,
        dim: int,
        enc_depth: int,
        dec_depth: int,
        max_seq_len: int,
        dim_input: int | None = None,
        dim_latent: int | None = None,
        bottleneck: nn.Module | None = None,
        bottleneck_type: Literal["deterministic", "variational"] = "deterministic",
        deterministic_bottleneck_kwargs: dict | None = None,
        variational_bottleneck_kwargs: dict | None = None,
        loss_type: Literal["l1", "l2"] = "l2",
        attn_dim_head: int = 64,
        heads: int = 8,
        enc_kwargs: dict | None = None,
        dec_kwargs: dict | None = None,
        latents_dropout_prob: float = 0.5,
        **kwargs,
    ):
        super().__init__()
        _check_int(dim, "dim")
        _check_int(enc_depth, "enc_depth")
        _check_int(dec_depth, "dec_depth")
        _check_int(max_seq_len, "max_seq_len")
        if loss_type not in ("l1", "l2"):
            raise ValueError(f"loss_type must be 'l1' or 'l2', got {loss_type!r}")
        if isinstance(latents_dropout_prob, bool) or not isinstance(latents_dropout_prob, (int, float)) \
                or not 0.0 <= latents_dropout_prob <= 1.0:
            raise ValueError(f"latents_dropout_prob must be a number in [0, 1], got {latents_dropout_prob!r}")
        dim_input = dim if dim_input is None else _check_int(dim_input, "dim_input")
        dim_latent = dim if dim_latent is None else _check_int(dim_latent, "dim_latent")
        self.dim_input, self.dim_latent = dim_input, dim_latent
        same = dim_input == dim  # x-transformers' use_identity_if_same_dim
        self.encoder = ContinuousTransformerWrapper(
            dim_in=None if same else dim_input, max_seq_len=max_seq_len,
            attn_layers=Encoder(dim=dim, depth=enc_depth, dim_head=attn_dim_head, heads=heads, **kwargs, **(enc_kwargs or {})))
        if bottleneck is not None:
            if not isinstance(bottleneck, nn.Module):
                raise TypeError(f"bottleneck must be an nn.Module, got {type(bottleneck).__name__}")
            self.bottleneck = bottleneck
        elif bottleneck_type == "deterministic":
            self.bottleneck = DeterministicLatentBottleneck(dim, dim_latent, **(deterministic_bottleneck_kwargs or {}))
        elif bottleneck_type == "variational":
            self.bottleneck = VariationalLatentBottleneck(dim, dim_latent, **(variational_bottleneck_kwargs or {}))
        else:
            raise ValueError(f"bottleneck_type must be 'deterministic' or 'variational', got {bottleneck_type!r}")
        self.from_latent_to_prepend_token = nn.Sequential(nn.Linear(dim_latent, dim))
        self.decoder = ContinuousTransformerWrapper(
            dim_in=None if same else dim_input, dim_out=None if same else dim_input, max_seq_len=max_seq_len,
            attn_layers=Decoder(dim=dim, depth=dec_depth, dim_head=attn_dim_head, heads=heads, **kwargs, **(dec_kwargs or {})))
        self.latents_dropout = nn.Dropout(latents_dropout_prob)
        self.loss_type = loss_type

    @property
    def device(self):
        return next(self.parameters()).device

    # ------------------------------------------------------------------------------------------------

    def _mask(self, seq: Tensor, lens: Tensor | None, mask: Tensor | None) -> Tensor:
        """Check ``seq`` and return its ``(b, n)`` padding mask (all True when none is given)."""
        if not isinstance(seq, Tensor) or seq.dim() != 3 or seq.shape[-1] != self.dim_input:
            raise ValueError(f"seq must have shape (b, n, dim_input={self.dim_input}), got {getattr(seq, 'shape', type(seq))}")
        if not seq.is_floating_point():
            raise TypeError(f"seq must be a floating-point tensor, got dtype {seq.dtype}")
        b, n, _ = seq.shape
        if lens is not None and mask is not None:
            raise ValueError("pass lens or mask, not both")
        if lens is not None:
            if not isinstance(lens, Tensor) or lens.shape != (b,):
                raise ValueError(f"lens must be a tensor of shape ({b},), got {getattr(lens, 'shape', type(lens))}")
            if lens.dtype.is_floating_point or lens.dtype == torch.bool or lens.is_complex():
                raise TypeError(f"lens must hold integer lengths, got dtype {lens.dtype}")
            if b and (bool((lens < 0).any()) or bool((lens > n).any())):
                raise ValueError(f"lens must be integers in [0, {n}], got {lens.tolist()}")
            return torch.arange(n, device=seq.device)[None] < lens.to(seq.device)[:, None]
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=seq.device)
            return mask
        return torch.ones(b, n, dtype=torch.bool, device=seq.device)

    def _encode(self, seq: Tensor, mask: Tensor, return_unreduced_loss: bool):
        seq = torch.where(mask[..., None], seq, torch.zeros((), dtype=seq.dtype, device=seq.device))
        encoded = self.encoder(seq, mask=mask, return_embeddings=True)  # (b, n, d), padded rows exact 0
        pooled = masked_mean(encoded, mask, dim=1)  # (b, d): a fully padded sample pools to exactly 0
        latents, aux = self.bottleneck(pooled, return_unreduced_loss=True)
        if aux is not None and aux.dim() == 1 and aux.shape[0] == seq.shape[0]:
            has_real = mask.any(1)  # (b,): a fully padded sample's aux term counts nowhere
            aux = torch.where(has_real, aux, torch.zeros((), dtype=aux.dtype, device=aux.device))
            if not return_unreduced_loss:
                aux = aux.sum() / has_real.sum().clamp(min=1).to(aux.dtype)
        return seq, latents, aux

    @checked_once
    def encode(self, seq: Tensor, lens: Tensor | None = None, return_aux_loss: bool = False,
               return_unreduced_loss: bool = False, *, mask: Tensor | None = None):
        """Latents ``(b, l)`` of ``seq (b, n, c)`` from its real positions (``lens (b,)`` right-padded
        lengths, or ``mask (b, n)``); with ``return_aux_loss`` also the bottleneck's loss (``None`` for the
        deterministic one; per sample with ``return_unreduced_loss``, 0 for a fully padded sample)."""
        real = self._mask(seq, lens, mask)
        _, latents, aux = self._encode(seq, real, return_unreduced_loss)
        return (latents, aux) if return_aux_loss else latents

    @checked_once
    def forward(self, seq: Tensor, lens: Tensor | None = None, return_all_losses: bool = False,
                return_unreduced_loss: bool = False, *, mask: Tensor | None = None):
        """The autoencoding loss of ``seq (b, n, c)``.

        Returns the scalar loss (reconstruction, a mean over every real element, plus the bottleneck's
        loss, a mean over samples with a real position), or ``(b,)`` per-sample losses with
        ``return_unreduced_loss``; with ``return_all_losses`` also ``(recon_loss, aux_loss)``.
        """
        real = self._mask(seq, lens, mask)
        b = seq.shape[0]
        seq, latents, aux = self._encode(seq, real, return_unreduced_loss)
        # latent dropout (x-transformers' draw): a dropped latent is a masked prefix row, i.e. no prefix
        kept = self.latents_dropout(torch.ones((b,), device=seq.device)).bool()  # (b,)
        prefix = self.from_latent_to_prepend_token(latents)[:, None]  # (b, 1, d)
        recon = self.decoder(seq, mask=real, prepend_embeds=prefix, prepend_mask=kept[:, None],
                             excise_prepend_embeds=True)  # (b, n, c)
        acc = torch.promote_types(recon.dtype, torch.float32)  # losses in float32 (float64 for float64)
        if self.loss_type == "l1":
            err = F.l1_loss(recon.to(acc), seq.to(acc), reduction="none")
        else:
            err = F.mse_loss(recon.to(acc), seq.to(acc), reduction="none")
        elem = real[..., None].expand_as(err)
        if return_unreduced_loss:
            recon_loss = masked_mean(err.flatten(1), elem.flatten(1), dim=1)  # (b,)
        else:
            recon_loss = masked_mean(err.flatten()[None], elem.flatten()[None], dim=1)[0]
        total = recon_loss if aux is None else recon_loss + aux
        if not return_all_losses:
            return total
        return total, (recon_loss, aux)


# ----------------------------------------------------------------------------------------------------
# conversion from x-transformers
# ----------------------------------------------------------------------------------------------------


def _continuous_wrapper_from_xt(model, *, dim_in: int | None, dim_out: int | None) -> ContinuousTransformerWrapper:
    """An x-transformers ``ContinuousTransformerWrapper`` (plain: projections, absolute or no positions)
    as safeformer's, with its weights; its layers go through ``from_x_transformers``."""
    from ..interop.convert import _xt, from_x_transformers

    xt, _ = _xt()
    if getattr(model, "max_mem_len", 0):
        raise ValueError("max_mem_len (XL memories) is not supported")
    if getattr(model, "probabilistic", False) or getattr(model, "average_pool_embed", False):
        raise ValueError("probabilistic and average_pool_embed wrappers are not supported here")
    if getattr(model, "has_memory_tokens", False):
        raise ValueError("num_memory_tokens is not supported here")
    if not isinstance(getattr(model, "post_emb_norm", nn.Identity()), nn.Identity):
        raise ValueError("post_emb_norm is not supported")
    use_abs = isinstance(model.pos_emb, xt.AbsolutePositionalEmbedding)
    if not use_abs and isinstance(model.pos_emb, nn.Module) and any(True for _ in model.pos_emb.parameters()):
        raise ValueError(f"position embedding {type(model.pos_emb).__name__} is not supported")
    stand_in = xt.TransformerWrapper(num_tokens=1, max_seq_len=model.max_seq_len, attn_layers=model.attn_layers,
                                     use_abs_pos_emb=use_abs)
    if use_abs:
        with torch.no_grad():
            stand_in.pos_emb.load_state_dict(model.pos_emb.state_dict())
    converted = from_x_transformers(stand_in.eval())
    out = ContinuousTransformerWrapper(max_seq_len=model.max_seq_len, attn_layers=converted.attn_layers,
                                       dim_in=dim_in, dim_out=dim_out, emb_dropout=model.emb_dropout.p,
                                       use_abs_pos_emb=converted.pos_emb is not None)
    with torch.no_grad():
        if out.pos_emb is not None:
            out.pos_emb.load_state_dict(converted.pos_emb.state_dict())
        for name in ("project_in", "project_out"):
            mine, theirs = getattr(out, name), getattr(model, name)
            if isinstance(mine, nn.Linear) != isinstance(theirs, nn.Linear):
                raise ValueError(f"{name}: expected {type(mine).__name__}, got {type(theirs).__name__}")
            if isinstance(mine, nn.Linear):
                mine.weight.copy_(theirs.weight)
                if mine.bias is not None:  # x-transformers' projection may have no bias: ours is then 0
                    mine.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(mine.bias))
    return out


def continuous_autoencoder_from_x_transformers(model) -> ContinuousTransformerAutoencoder:
    """Convert an x-transformers ``ContinuousTransformerAutoencoder`` with its weights (same bottleneck
    kind, loss type and latent dropout); its stacks go through ``from_x_transformers`` (options it does
    not support are its ``ValueError``)."""
    for attr in ("encoder", "decoder", "bottleneck", "from_latent_to_prepend_token", "latents_dropout", "loss_type"):
        if not hasattr(model, attr):
            raise TypeError(f"expected an x_transformers ContinuousTransformerAutoencoder, got {type(model).__name__} (no {attr!r})")
    enc, dec = model.encoder, model.decoder
    dim = enc.attn_layers.dim
    dim_input = enc.project_in.in_features if isinstance(enc.project_in, nn.Linear) else dim
    bn = model.bottleneck
    if type(bn).__name__ == "VariationalLatentBottleneck":
        kind, dim_latent = "variational", bn.to_mean_log_var[0].out_features // 2
        my_bn = None
    elif type(bn).__name__ == "DeterministicLatentBottleneck":
        kind, dim_latent = "deterministic", bn.proj.out_features
        my_bn = None
    else:  # a user's module: kept as it is
        kind, dim_latent, my_bn = "deterministic", model.from_latent_to_prepend_token[0].in_features, bn
    out = ContinuousTransformerAutoencoder(
        dim=dim, enc_depth=1, dec_depth=1, max_seq_len=enc.max_seq_len, dim_input=dim_input, dim_latent=dim_latent,
        bottleneck=my_bn, bottleneck_type=kind, loss_type=model.loss_type, heads=1, attn_dim_head=dim,
        latents_dropout_prob=model.latents_dropout.p)
    same = dim_input == dim
    out.encoder = _continuous_wrapper_from_xt(enc, dim_in=None if same else dim_input, dim_out=None)
    out.decoder = _continuous_wrapper_from_xt(dec, dim_in=None if same else dim_input, dim_out=None if same else dim_input)
    if kind == "deterministic" and my_bn is None:
        out.bottleneck.activation = bn.activation
    if my_bn is None:
        out.bottleneck.load_state_dict(bn.state_dict())
    out.from_latent_to_prepend_token.load_state_dict(
        {k: v for k, v in model.from_latent_to_prepend_token.state_dict().items()})
    p = next(model.parameters())
    return out.to(device=p.device, dtype=p.dtype).train(model.training)


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.continuous_autoencoder", "ContinuousTransformerAutoencoder", continuous_autoencoder_from_x_transformers)
