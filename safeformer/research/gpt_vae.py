"""x-transformers' ``GPTVAE`` (a conditional VAE around a GPT, the CVAE + DETR design of ACT), on
safeformer's ``TransformerWrapper`` and ``AutoregressiveWrapper``.

Shape legend: b batch, n sequence positions, d model width, l latent width, v vocabulary size.
Masks follow the one convention (bool, True = real position; see ``masks.py``).

The model: an ``Encoder`` mean-pools ``seq_for_latents`` (default: ``seq``) over its real positions
(``token != pad_id``); a linear layer gives the mean and log variance of a latent; a sample of it
(reparameterised) becomes one prefix row of a causal decoder trained with the next-token loss. The KL
term ``relu(KL_i - vae_kl_div_floor)`` is summed over latent features and averaged over samples.

Safety (docs/safety.md):
- Padding is ``token == pad_id`` (x-transformers' rule), or an explicit ``mask`` / ``mask_for_latents``.
  Ids at padded positions are never looked up (any value is fine there, ``-1`` included) and never
  counted as targets.
- A sample of ``seq_for_latents`` with no real position pools to exactly 0 (never 0 / 0): its latent is
  finite, and its KL term counts nowhere. The KL is computed in float32 (float64 for float64 models) with
  ``log_var`` clamped to ``[-LOG_VAR_LIMIT, LOG_VAR_LIMIT]``: finite for any weights.
- A batch with no counted target and no real latent position gives a loss of exactly 0 with zero
  (present) gradients.
- A dropped latent (``latents_dropout_prob`` in training) is a masked prefix row: exactly no prefix, the
  null condition that guidance (``generate(..., cond_scale=s)``) contrasts the latent with.

Differences from x-transformers (on purpose): its dropped latent also shifts the absolute positions of
the sequence by one; its decoder reads padding as token ``pad_value`` (hidden from real positions by the
causal mask under right padding); its KL mean counts samples without a real position. In eval mode with
right padding the two give equal losses and greedy generations on the same weights
(``gpt_vae_from_x_transformers``; ``tests/test_gpt_vae.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.cache import check_weight_dtype
from ..core.masks import check_token_ids, checked_once, validate_mask
from ..core.xt_helpers import default, exists  # noqa: F401  (x-transformers' helpers of this module)
from ..decoding.generation import AutoregressiveWrapper
from ..interop.convert import register_converter
from ..stack.layers import Decoder, Encoder
from ..stack.wrappers import TransformerWrapper

__all__ = ["GPTVAE", "gpt_vae_from_x_transformers"]

LOG_VAR_LIMIT = 30.0  # |log variance| beyond this is clamped: exp(30) stays finite in float32


_check_ids = check_token_ids


class GPTVAE(nn.Module):
    """x-transformers' ``GPTVAE``, with its constructor keywords.

    Args:
        num_tokens, dim, depth, enc_depth, max_seq_len: vocabulary, width, decoder and encoder depths,
            longest sequence.
        dim_latent: latent width (default ``dim``).
        attn_dim_head, heads: attention shape of both stacks.
        enc_kwargs, dec_kwargs: further keywords of the ``Encoder`` / the ``Decoder``.
        vae_kl_loss_weight: weight of the KL term in the total loss.
        vae_kl_div_floor: free bits: each latent feature's KL below this does not count.
        latents_dropout_prob: in training, the probability that a sample's latent is dropped.
        pad_id: the padding token (``-1``: none of the vocabulary); targets equal to it do not count.
        encoder: a module ``encoder(seq, mask=mask) -> (b, dim)`` used instead of the built-in one.
        kwargs: further keywords for both stacks.
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        dim: int,
        depth: int,
        enc_depth: int,
        max_seq_len: int,
        dim_latent: int | None = None,
        attn_dim_head: int = 64,
        heads: int = 8,
        enc_kwargs: dict | None = None,
        dec_kwargs: dict | None = None,
        vae_kl_loss_weight: float = 1.0,
        vae_kl_div_floor: float = 0.0,
        latents_dropout_prob: float = 0.5,
        pad_id: int = -1,
        encoder: nn.Module | None = None,
        **kwargs,
    ):
        super().__init__()
        for name, v in (("num_tokens", num_tokens), ("dim", dim), ("depth", depth), ("enc_depth", enc_depth),
                        ("max_seq_len", max_seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name, v, lo in (("vae_kl_loss_weight", vae_kl_loss_weight, 0.0), ("vae_kl_div_floor", vae_kl_div_floor, 0.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v < float("inf")):
                raise ValueError(f"{name} must be a finite number >= {lo}, got {v!r}")
        if isinstance(latents_dropout_prob, bool) or not isinstance(latents_dropout_prob, (int, float)) \
                or not 0.0 <= latents_dropout_prob <= 1.0:
            raise ValueError(f"latents_dropout_prob must be a number in [0, 1], got {latents_dropout_prob!r}")
        if isinstance(pad_id, bool) or not isinstance(pad_id, int):
            raise TypeError(f"pad_id must be an int, got {pad_id!r}")
        dim_latent = dim if dim_latent is None else dim_latent
        if encoder is None:
            encoder = TransformerWrapper(
                num_tokens=num_tokens, max_seq_len=max_seq_len + 1, return_only_embed=True, average_pool_embed=True,
                attn_layers=Encoder(dim=dim, depth=enc_depth, dim_head=attn_dim_head, heads=heads, **kwargs,
                                    **(enc_kwargs or {})))
        elif not isinstance(encoder, nn.Module):
            raise TypeError(f"encoder must be an nn.Module, got {type(encoder).__name__}")
        self.encoder = encoder
        self.dim_latent = dim_latent
        self.to_latent_mean_log_variance = nn.Sequential(nn.Linear(dim, dim_latent * 2))
        self.from_latent_to_prepend_token = nn.Sequential(nn.Linear(dim_latent, dim))
        self.decoder = TransformerWrapper(
            num_tokens=num_tokens, max_seq_len=max_seq_len,
            attn_layers=Decoder(dim=dim, depth=depth, dim_head=attn_dim_head, heads=heads, **kwargs, **(dec_kwargs or {})))
        pad_value = pad_id if 0 <= pad_id < num_tokens else 0
        self.ar_wrapped_decoder = AutoregressiveWrapper(self.decoder, ignore_index=pad_id, pad_value=pad_value)
        self.pad_id = pad_id
        self.vae_kl_div_floor = float(vae_kl_div_floor)
        self.vae_kl_loss_weight = float(vae_kl_loss_weight)
        self.latents_dropout = nn.Dropout(latents_dropout_prob)

    @property
    def device(self):
        return next(self.parameters()).device

    def _real(self, seq: Tensor, mask: Tensor | None, name: str) -> Tensor:
        if mask is not None:
            validate_mask(mask, name, shape=tuple(seq.shape), device=seq.device)
            return mask
        return seq != self.pad_id

    def _latents(self, seq: Tensor, mask: Tensor, noise: Tensor | None):
        """Latents ``(b, l)``, mean and clamped log variance ``(b, l)`` from the real positions of ``seq``."""
        pooled = self.encoder(seq, mask=mask)  # (b, d): a fully padded sample pools to exactly 0
        mean, log_var = self.to_latent_mean_log_variance(pooled).chunk(2, dim=-1)
        log_var = log_var.clamp(-LOG_VAR_LIMIT, LOG_VAR_LIMIT)
        if noise is None:
            noise = torch.randn_like(mean)
        elif not isinstance(noise, Tensor) or noise.shape != mean.shape:
            raise ValueError(f"noise must have shape {tuple(mean.shape)}, got {getattr(noise, 'shape', type(noise))}")
        return mean + (0.5 * log_var).exp() * noise.to(mean.dtype), mean, log_var

    @checked_once
    def encode_to_latents(self, seq: Tensor, return_mean_log_var: bool = False, *, mask: Tensor | None = None,
                          noise: Tensor | None = None):
        """Latents ``(b, l)`` of ``seq (b, n)`` from its real positions (``seq != pad_id``, or ``mask``);
        ``noise`` (b, l) replaces the standard normal draw. With ``return_mean_log_var`` also
        ``(mean, log_var)`` (``log_var`` clamped)."""
        _check_ids(seq, "seq")
        latents, mean, log_var = self._latents(seq, self._real(seq, mask, "mask"), noise)
        return (latents, (mean, log_var)) if return_mean_log_var else latents

    def _prefix(self, latents, b: int) -> Tensor:
        if not isinstance(latents, Tensor):
            latents = torch.tensor(latents, device=self.device, dtype=self.from_latent_to_prepend_token[0].weight.dtype)
        if latents.dim() == 1:  # one latent for every sample
            latents = latents[None].expand(b, -1)
        if latents.dim() != 2 or latents.shape[-1] != self.dim_latent or latents.shape[0] not in (1, b):
            raise ValueError(f"latents must have shape (dim_latent={self.dim_latent},) or ({b}, {self.dim_latent}), "
                             f"got {tuple(latents.shape)}")
        if not latents.is_floating_point():
            raise TypeError(f"latents must be floating point, got dtype {latents.dtype}")
        check_weight_dtype(latents, self.from_latent_to_prepend_token, "latents")
        return self.from_latent_to_prepend_token(latents.expand(b, -1))[:, None]  # (b, 1, d)

    @torch.no_grad()
    @checked_once
    def generate(self, prompts: Tensor, seq_len: int, latents=None, seq_for_latents: Tensor | None = None, *,
                 mask_for_latents: Tensor | None = None, **generate_kwargs) -> Tensor:
        """Generate ``seq_len`` tokens after ``prompts`` ``(b, n)`` (or one ``(n,)`` prompt), conditioned on
        ``latents`` (``(l,)`` for every sample, or ``(b, l)``, in the model's dtype) or on the latents of
        ``seq_for_latents`` (its real positions ``mask_for_latents``, which needs ``seq_for_latents``).

        ``generate_kwargs`` are ``AutoregressiveWrapper.generate``'s (``temperature``, ``mask``,
        ``cond_scale``: guidance against no latent at all, the dropped prefix, ...).
        """
        if isinstance(prompts, Tensor) and prompts.dim() == 1:
            prompts = prompts[None]
        _check_ids(prompts, "prompts")
        b = prompts.shape[0]
        if seq_for_latents is not None:
            if latents is not None:
                raise ValueError("pass latents or seq_for_latents, not both")
            _check_ids(seq_for_latents, "seq_for_latents")
            latents = self._latents(seq_for_latents, self._real(seq_for_latents, mask_for_latents, "mask_for_latents"), None)[0]
        elif mask_for_latents is not None:
            raise ValueError("mask_for_latents was given without seq_for_latents (it marks the real positions of "
                             "seq_for_latents); pass seq_for_latents too, or latents")
        if latents is not None:
            generate_kwargs["prepend_embeds"] = self._prefix(latents, b)
        return self.ar_wrapped_decoder.generate(prompts, seq_len, **generate_kwargs)

    @checked_once
    def forward(self, seq: Tensor, seq_for_latents: Tensor | None = None, return_all_losses: bool = False, *,
                mask: Tensor | None = None, mask_for_latents: Tensor | None = None, noise: Tensor | None = None):
        """The loss: next-token cross-entropy of ``seq (b, n)`` given its latent, plus the weighted KL
        term; with ``return_all_losses`` also ``(ar_loss, vae_kl_loss)``."""
        _check_ids(seq, "seq")
        real = self._real(seq, mask, "mask")
        if seq_for_latents is None:
            if mask_for_latents is not None:
                raise ValueError("mask_for_latents was given without seq_for_latents")
            seq_for_latents, real_lat = seq, real
        else:
            _check_ids(seq_for_latents, "seq_for_latents")
            if seq_for_latents.shape[0] != seq.shape[0]:
                raise ValueError(f"seq_for_latents must have batch {seq.shape[0]}, got {tuple(seq_for_latents.shape)}")
            real_lat = self._real(seq_for_latents, mask_for_latents, "mask_for_latents")
        b = seq.shape[0]
        latents, mean, log_var = self._latents(seq_for_latents, real_lat, noise)
        kept = self.latents_dropout(torch.ones((b,), device=seq.device)).bool()  # (b,): x-transformers' draw
        prefix = self._prefix(latents, b)
        ar_loss = self.ar_wrapped_decoder(seq, mask=real, prepend_embeds=prefix, prepend_mask=kept[:, None])
        acc = torch.promote_types(mean.dtype, torch.float32)
        m, lv = mean.to(acc), log_var.to(acc)
        kl = F.relu(0.5 * (lv.exp() + m.square() - lv - 1.0) - self.vae_kl_div_floor).sum(-1)  # (b,)
        has_real = real_lat.any(1)
        kl = torch.where(has_real, kl, torch.zeros((), dtype=acc, device=kl.device))
        kl = kl.sum() / has_real.sum().clamp(min=1).to(acc)
        ar_loss = ar_loss.to(torch.promote_types(ar_loss.dtype, acc))
        total = ar_loss + kl * self.vae_kl_loss_weight  # float32 (float64 for float64 models)
        if not return_all_losses:
            return total
        return total, (ar_loss, kl)


def gpt_vae_from_x_transformers(model) -> GPTVAE:
    """Convert an x-transformers ``GPTVAE`` with its weights (same ``pad_id``, KL weight and floor, latent
    dropout); its encoder and decoder go through ``from_x_transformers`` (options it does not support
    are its ``ValueError``)."""
    from ..interop.convert import from_x_transformers

    for attr in ("encoder", "decoder", "to_latent_mean_log_variance", "from_latent_to_prepend_token", "pad_id"):
        if not hasattr(model, attr):
            raise TypeError(f"expected an x_transformers GPTVAE, got {type(model).__name__} (no {attr!r})")
    enc = from_x_transformers(model.encoder)
    dec = from_x_transformers(model.decoder)
    lin = model.to_latent_mean_log_variance[0]
    out = GPTVAE(num_tokens=dec.num_tokens, dim=lin.in_features, depth=1, enc_depth=1, max_seq_len=dec.max_seq_len,
                 dim_latent=lin.out_features // 2, heads=1, attn_dim_head=lin.in_features,
                 vae_kl_loss_weight=model.vae_kl_loss_weight, vae_kl_div_floor=model.vae_kl_div_floor,
                 latents_dropout_prob=model.latents_dropout.p, pad_id=model.pad_id, encoder=enc)
    out.decoder = dec
    out.ar_wrapped_decoder = AutoregressiveWrapper(dec, ignore_index=out.ar_wrapped_decoder.ignore_index,
                                                   pad_value=out.ar_wrapped_decoder.pad_value)
    out.to_latent_mean_log_variance.load_state_dict(model.to_latent_mean_log_variance.state_dict())
    out.from_latent_to_prepend_token.load_state_dict(model.from_latent_to_prepend_token.state_dict())
    p = next(model.parameters())
    return out.to(device=p.device, dtype=p.dtype).train(model.training)


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.gpt_vae", "GPTVAE", gpt_vae_from_x_transformers)
