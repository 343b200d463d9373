"""NeoMLP (x-transformers' ``NeoMLP``): an MLP whose input, hidden and output units are tokens of one
self-attention ``Encoder`` (message passing on the fully connected graph).

Shape legend: b batch, i input features (``dim_in``), h hidden nodes (``dim_hidden``), o outputs
(``dim_out``), d model width (``dim_model``).

safeformer's addition: ``mask (b, i)`` marks which input features are present (True = real). A missing
feature's node is padding for attention (selected away, so NaN or inf there reaches no output and no
gradient) and its embedding output is exactly 0; a sample with every feature missing still runs on its
hidden and output nodes. Without a mask NeoMLP is x-transformers' (``neo_mlp_from_x_transformers``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.cache import check_weight_dtype
from ..core.masks import checked_once, validate_mask
from ..core.xt_helpers import default, exists  # noqa: F401  (x-transformers' helpers of this module)
from ..interop.convert import register_converter
from ..stack.layers import Encoder

__all__ = ["NeoMLP", "RandomFourierEmbed", "neo_mlp_from_x_transformers"]


class RandomFourierEmbed(nn.Module):
    """``cos(2 pi (t w + b))`` with a frozen random ``Linear(1, dim)``: ``(...)`` -> ``(..., dim)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(1, dim)
        self.proj.requires_grad_(False)

    def forward(self, times: Tensor) -> Tensor:
        return torch.cos(2 * math.pi * self.proj(times[..., None]))


class NeoMLP(Configurable, nn.Module):
    """x-transformers' ``NeoMLP(dim_in=, dim_hidden=, dim_out=, dim_model=, depth=, encoder_kwargs=)``.

    ``encoder_kwargs`` go to safeformer's ``Encoder`` (x-transformers' spellings accepted, e.g.
    ``attn_dim_head``; an unknown option is a ``TypeError`` naming it).
    """

    def __init__(self, *, dim_in: int, dim_hidden: int, dim_out: int, dim_model: int, depth: int,
                 encoder_kwargs: dict | None = None):
        super().__init__()
        for name, v in (("dim_in", dim_in), ("dim_hidden", dim_hidden), ("dim_out", dim_out), ("dim_model", dim_model),
                        ("depth", depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "dim_hidden" else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        encoder_kwargs = dict(attn_dim_head=16, heads=4) if encoder_kwargs is None else dict(encoder_kwargs)
        if not isinstance(encoder_kwargs, dict):
            raise TypeError(f"encoder_kwargs must be a dict, got {type(encoder_kwargs).__name__}")
        self._set_config_from(NeoMLP.__init__, locals())
        self.dim_in, self.dim_hidden, self.dim_out = dim_in, dim_hidden, dim_out
        self.input_embed = nn.Parameter(torch.randn(dim_in, dim_model) * 0.02)
        self.hidden_embed = nn.Parameter(torch.randn(dim_hidden, dim_model) * 0.02)
        self.output_embed = nn.Parameter(torch.randn(dim_out, dim_model) * 0.02)
        self.random_fourier = nn.Sequential(RandomFourierEmbed(dim_model), nn.Linear(dim_model, dim_model))
        self.transformer = Encoder(dim=dim_model, depth=depth, **encoder_kwargs)
        self.to_output_weights = nn.Parameter(torch.randn(dim_out, dim_model))
        self.to_output_bias = nn.Parameter(torch.zeros(dim_out))

    @checked_once
    def forward(self, x: Tensor, return_embeds: bool = False, *, mask: Tensor | None = None):
        """``x (b, dim_in)`` (or ``(dim_in,)``) -> ``(b, dim_out)`` (or ``(dim_out,)``).

        Args:
            x: the input features; where ``mask`` is False they may hold anything.
            return_embeds: also return ``(input (b, i, d), hidden (b, h, d), output (b, o, d))`` embeddings
                (exactly 0 at missing inputs).
            mask: ``(b, dim_in)`` (or ``(dim_in,)``) bool, True = the feature is present.
        """
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        check_weight_dtype(x, self.random_fourier, "x")
        no_batch = x.dim() == 1
        if no_batch:
            x = x[None]
            mask = None if mask is None else mask[None] if isinstance(mask, Tensor) and mask.dim() == 1 else mask
        if x.dim() != 2 or x.shape[-1] != self.dim_in:
            raise ValueError(f"x must have shape (b, dim_in={self.dim_in}) or (dim_in,), got {tuple(x.shape)}")
        b = x.shape[0]
        full_mask = None
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, self.dim_in), device=x.device)
            x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
            ones = torch.ones(b, self.dim_hidden + self.dim_out, dtype=torch.bool, device=x.device)
            full_mask = torch.cat((mask, ones), 1)
        input_embed = self.random_fourier(x) + self.input_embed  # (b, i, d)
        rest = [t[None].expand(b, -1, -1).to(input_embed.dtype) for t in (self.hidden_embed, self.output_embed)]
        embed = torch.cat((input_embed, *rest), 1)  # (b, i + h + o, d)
        embed = self.transformer(embed, mask=full_mask)
        i, h = self.dim_in, self.dim_hidden
        input_embed, hidden_embed, output_embed = embed[:, :i], embed[:, i:i + h], embed[:, i + h:]
        output = (output_embed * self.to_output_weights.to(output_embed.dtype)).sum(-1) + self.to_output_bias
        if no_batch:
            output = output[0]
        if not return_embeds:
            return output
        return output, (input_embed, hidden_embed, output_embed)


def neo_mlp_from_x_transformers(model) -> NeoMLP:
    """Convert an x-transformers ``NeoMLP`` with its weights (its ``Encoder`` through
    ``from_x_transformers``; options it does not support are its ``ValueError``)."""
    from ..interop.convert import _xt, from_x_transformers

    xt, _ = _xt()
    for attr in ("input_embed", "hidden_embed", "output_embed", "random_fourier", "transformer", "to_output_weights"):
        if not hasattr(model, attr):
            raise TypeError(f"expected an x_transformers NeoMLP, got {type(model).__name__} (no {attr!r})")
    dim_in, dim_model = model.input_embed.shape
    stand_in = xt.TransformerWrapper(num_tokens=1, max_seq_len=1, attn_layers=model.transformer, use_abs_pos_emb=False)
    converted = from_x_transformers(stand_in.eval())
    out = NeoMLP(dim_in=dim_in, dim_hidden=model.hidden_embed.shape[0], dim_out=model.output_embed.shape[0],
                 dim_model=dim_model, depth=1, encoder_kwargs=dict(heads=1, dim_head=dim_model))
    out.transformer = converted.attn_layers
    own = {k: v for k, v in model.state_dict().items() if not k.startswith("transformer.")}
    out.load_state_dict({**own, **{f"transformer.{k}": v for k, v in out.transformer.state_dict().items()}}, strict=True)
    return out.to(model.input_embed.dtype).train(model.training)


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.neo_mlp", "NeoMLP", neo_mlp_from_x_transformers)
