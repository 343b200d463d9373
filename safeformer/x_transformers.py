"""x-transformers' ``x_transformers.x_transformers`` module names, so ``from safeformer.x_transformers import X``
works as ``from safeformer import X`` does (the same objects; nothing is defined here). x-transformers' small
parts (norms, positional biases, residual gates, ``apply_rotary_pos_emb``) come from ``safeformer.xt_modules``.

Names of that module that safeformer does not provide (``default_device``, and the
options' internal modules such as ``Attend``, ``LinearNoBias``, ``HyperConnection``) are left out on purpose:
an ``ImportError`` names them. See docs/moving_from_x_transformers.md.
"""

from .attention import Attention, RelativeProjPositionalBias
from .cache import LayerIntermediates
from .encoder_decoder import XTransformer
from .layers import AttentionLayers, CrossAttender, Decoder, Encoder, PrefixDecoder, TransformerBlock, layer_schedule
from .modules import AbsolutePositionalEmbedding, AdaptiveRMSNorm, FeedForward, RMSNorm, RotaryEmbedding, apply_rotary
from .relative_position import RelativePositionBias
from .wrappers import TransformerWrapper
from .xt_extras import AttentionPool, ViTransformerWrapper
from .xt_modules import (
    GLU,
    AlibiPositionalBias,
    DynamicPositionBias,
    DynamicTanh,
    GRUGating,
    LayerNorm,
    LayerScale,
    ReluSquared,
    Residual,
    Scale,
    ScaledSinusoidalEmbedding,
    ScaleNorm,
    SimpleRMSNorm,
    TokenEmbedding,
    apply_rotary_pos_emb,
)

__all__ = [
    "AbsolutePositionalEmbedding",
    "AdaptiveRMSNorm",
    "Attention",
    "RelativeProjPositionalBias",
    "RelativePositionBias",
    "AttentionLayers",
    "AttentionPool",
    "CrossAttender",
    "Decoder",
    "Encoder",
    "FeedForward",
    "LayerIntermediates",
    "PrefixDecoder",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "TransformerWrapper",
    "ViTransformerWrapper",
    "XTransformer",
    "apply_rotary",
    "layer_schedule",
    # x-transformers' small parts (safeformer/xt_modules.py)
    "AlibiPositionalBias",
    "DynamicPositionBias",
    "DynamicTanh",
    "GLU",
    "GRUGating",
    "LayerNorm",
    "LayerScale",
    "ReluSquared",
    "Residual",
    "Scale",
    "ScaleNorm",
    "ScaledSinusoidalEmbedding",
    "SimpleRMSNorm",
    "TokenEmbedding",
    "apply_rotary_pos_emb",
]
