"""x-transformers' smaller public modules under their names: ``AttentionPool``, ``ViTransformerWrapper`` and
``eval_decorator``.

Shape legend: b batch, n pooled queries, j context length, c model width, c_ctx context width, C image
channels, H W image height and width, p patch size, N patches, k classes.

Masks follow safeformer's one convention (bool, True = real); see ``masks.py``.
"""

from __future__ import annotations

import functools

import torch
from einops import rearrange
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.masks import validate_mask
from ..nn.attention import Attention
from ..nn.modules import LayerNorm
from .layers import AttentionLayers, CrossAttender

__all__ = ["AttentionPool", "LinearNoBias", "ViTransformerWrapper", "eval_decorator"]


def LinearNoBias(dim_in: int, dim_out: int, **kwargs) -> nn.Linear:  # noqa: N802 (x-transformers' name)
    """x-transformers' ``LinearNoBias``: an ``nn.Linear`` without a bias."""
    return nn.Linear(dim_in, dim_out, bias=False, **kwargs)


def eval_decorator(fn):
    """Run the method ``fn`` with its module in eval mode, restoring the training mode afterwards (also when
    ``fn`` raises), as x-transformers' ``eval_decorator`` (which does not restore on an exception)."""

    @functools.wraps(fn)
    def inner(self, *args, **kwargs):
        was_training = self.training
        self.eval()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.train(was_training)

    return inner


class AttentionPool(nn.Module):
    """Pools a context into ``num_pooled_tokens`` vectors by attending to it from learned queries
    (x-transformers' ``AttentionPool``).

    Args:
        dim: width c of the queries and the output.
        num_pooled_tokens: learned queries; 0 means the queries are passed to ``forward``.
        dim_context: width of the context (default ``dim``).
        add_residual: add the queries to the pooled output (one attention only).
        depth: with ``depth > 1`` (or ``use_transformer_blocks=True``) a ``CrossAttender`` of that depth pools.
        heads, dim_head: the attention's heads and head width.
        use_transformer_blocks: pool with a ``CrossAttender`` (default: ``depth > 1``).
        squeeze_output: return ``(b, c)`` instead of ``(b, 1, c)`` (one pooled token only).
        attn_kwargs: more ``Attention`` options (single-attention pooling only).

    ``forward(context (b, j, c_ctx), mask=None (b, j), queries=None (b, n, c))`` -> ``(b, n, c)``. A masked
    context position reaches nothing; a sample whose context is entirely masked (or empty) pools to exactly
    0 with a single attention (its queries alone with ``add_residual``), and to its queries' stack output with
    transformer blocks: never NaN.
    """

    def __init__(self, dim: int, num_pooled_tokens: int = 1, dim_context: int | None = None, add_residual: bool = False,
                 depth: int = 1, heads: int = 8, dim_head: int = 64, use_transformer_blocks: bool | None = None,
                 squeeze_output: bool | None = None, attn_kwargs: dict | None = None):
        super().__init__()
        attn_kwargs = dict(attn_kwargs or {})
        dim_context = dim if dim_context is None else dim_context
        squeeze_output = bool(squeeze_output)
        if isinstance(num_pooled_tokens, bool) or not isinstance(num_pooled_tokens, int) or num_pooled_tokens < 0:
            raise ValueError(f"num_pooled_tokens must be a non-negative integer, got {num_pooled_tokens!r}")
        if squeeze_output and num_pooled_tokens != 1:
            raise ValueError("squeeze_output needs exactly one pooled token (num_pooled_tokens=1)")
        use_transformer_blocks = depth > 1 if use_transformer_blocks is None else use_transformer_blocks
        if not use_transformer_blocks and depth != 1:
            raise ValueError(f"depth={depth} needs use_transformer_blocks=True (a single attention has depth 1)")
        self.queries = nn.Parameter(torch.randn(num_pooled_tokens, dim) * 1e-2) if num_pooled_tokens > 0 else None
        if use_transformer_blocks:
            if add_residual:
                raise ValueError("add_residual with transformer blocks: the blocks are residual already")
            if attn_kwargs:
                raise ValueError("attn_kwargs apply to single-attention pooling; with transformer blocks build a "
                                 "CrossAttender with the options you need and pool with it")
            self.pooler = CrossAttender(dim=dim, dim_context=dim_context, depth=depth, heads=heads, dim_head=dim_head)
        else:
            self.pooler = Attention(dim, dim_context=dim_context, heads=heads, dim_head=dim_head, **attn_kwargs)
        self.dim, self.dim_context = dim, dim_context
        self.add_residual = add_residual
        self.squeeze_output = squeeze_output

    def forward(self, context: Tensor, mask: Tensor | None = None, queries: Tensor | None = None) -> Tensor:
        if not isinstance(context, Tensor) or context.dim() != 3 or context.shape[-1] != self.dim_context:
            raise ValueError(f"context must have shape (b, j, dim_context={self.dim_context}), got "
                             f"{getattr(context, 'shape', type(context))}")
        b = context.shape[0]
        if queries is None:
            if self.queries is None:
                raise ValueError("queries must be passed when num_pooled_tokens=0")
            queries = self.queries.to(context.dtype)[None].expand(b, -1, -1)
        elif not isinstance(queries, Tensor) or queries.dim() != 3 or queries.shape[0] != b or queries.shape[-1] != self.dim:
            raise ValueError(f"queries must have shape (b={b}, n, dim={self.dim}), got {getattr(queries, 'shape', type(queries))}")
        if mask is not None:  # checked here, so an error names the argument as the user spelled it
            validate_mask(mask, "mask", shape=(b, context.shape[1]), device=context.device)
        if isinstance(self.pooler, Attention):
            if mask is None:
                pooled = self.pooler(queries, context)
            else:
                pooled = self.pooler(queries, context, context_mask=mask)
        else:
            pooled = self.pooler(queries, context=context, context_mask=mask)
        if self.add_residual:
            pooled = pooled + queries
        return pooled[:, 0] if self.squeeze_output else pooled


class ViTransformerWrapper(Configurable, nn.Module):
    """A vision transformer over image patches (x-transformers' ``ViTransformerWrapper``).

    Args:
        image_size: side of the (square) images it is built for; smaller images of whole patches work too.
        patch_size: side of a patch p; ``image_size`` must be a multiple of it.
        attn_layers: the stack (usually an ``Encoder``).
        channels: image channels C.
        num_classes: width of the classification head; ``None``: no head (the pooled embedding is returned).
        post_emb_norm: a LayerNorm after the patch and position embeddings.
        num_register_tokens: learned register tokens appended to the patches (cut from the output).
        emb_dropout: dropout on the embeddings.

    ``forward(img (b, C, H, W))`` -> logits ``(b, k)`` (the mean over patches through the head);
    ``return_embeddings=True`` -> ``(b, N, c)``; ``return_logits_and_embeddings=True`` -> both. Norms in
    float32 (S7).
    """

    def __init__(self, *, image_size: int, patch_size: int, attn_layers: AttentionLayers, channels: int = 3,
                 num_classes: int | None = None, post_emb_norm: bool = False, num_register_tokens: int = 0,
                 emb_dropout: float = 0.0):
        super().__init__()
        self._set_config_from(ViTransformerWrapper.__init__, locals())
        if not isinstance(attn_layers, AttentionLayers):
            raise TypeError(f"attn_layers must be an AttentionLayers (an Encoder), got {type(attn_layers).__name__}")
        if patch_size <= 0 or image_size <= 0 or image_size % patch_size != 0:
            raise ValueError(f"image_size={image_size} must be a positive multiple of patch_size={patch_size}")
        if num_register_tokens < 0:
            raise ValueError(f"num_register_tokens must be non-negative, got {num_register_tokens}")
        dim = attn_layers.dim
        num_patches = (image_size // patch_size) ** 2
        patch_dim = channels * patch_size**2
        self.patch_size, self.channels, self.num_patches = patch_size, channels, num_patches
        self.pos_embedding = nn.Parameter(torch.randn(1, num_patches, dim))
        self.register_tokens = nn.Parameter(torch.randn(num_register_tokens, dim)) if num_register_tokens > 0 else None
        self.patch_to_embedding = nn.Sequential(LayerNorm(patch_dim), nn.Linear(patch_dim, dim), LayerNorm(dim))
        self.post_emb_norm = LayerNorm(dim) if post_emb_norm else nn.Identity()
        self.dropout = nn.Dropout(emb_dropout)
        self.attn_layers = attn_layers
        self.mlp_head = nn.Linear(dim, num_classes) if num_classes is not None else nn.Identity()

    def forward(self, img: Tensor, return_embeddings: bool = False, return_logits_and_embeddings: bool = False):
        if return_embeddings and return_logits_and_embeddings:
            raise ValueError("pass return_embeddings or return_logits_and_embeddings, not both")
        p = self.patch_size
        if not isinstance(img, Tensor) or img.dim() != 4 or not img.is_floating_point():
            raise ValueError(f"img must be a float tensor (b, channels, height, width), got {getattr(img, 'shape', type(img))}")
        b, c, h, w = img.shape
        if c != self.channels or h % p or w % p or (h // p) * (w // p) > self.num_patches:
            raise ValueError(f"img must have {self.channels} channels and sides that are multiples of patch_size={p}, "
                             f"with at most {self.num_patches} patches; got {tuple(img.shape)}")
        x = rearrange(img, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=p, p2=p)
        x = self.patch_to_embedding(x)
        n = x.shape[1]
        x = x + self.pos_embedding[:, :n].to(x.dtype)
        x = self.dropout(self.post_emb_norm(x))
        if self.register_tokens is not None:
            x = torch.cat((x, self.register_tokens.to(x.dtype)[None].expand(b, -1, -1)), dim=1)
        embed = self.attn_layers(x)[:, :n]  # (b, N, c): the registers cut
        if return_embeddings:
            return embed
        pooled = embed.to(torch.promote_types(embed.dtype, torch.float32)).mean(dim=-2).to(embed.dtype)
        logits = self.mlp_head(pooled)
        return (logits, embed) if return_logits_and_embeddings else logits
