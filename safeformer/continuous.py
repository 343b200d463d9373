"""``safeformer.continuous``: x-transformers' import path ``x_transformers.continuous``, a re-export of
``safeformer.decoding.continuous`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .decoding.continuous import (  # noqa: F401
    AbsolutePositionalEmbedding,
    Attention,
    AttentionLayers,
    ContinuousAutoregressiveWrapper,
    ContinuousTransformerWrapper,
    LayerNorm,
    ScaledSinusoidalEmbedding,
    align_right,
    always,
    default,
    exists,
)
