"""``safeformer.multi_input``: x-transformers' import path ``x_transformers.multi_input``, a re-export of
``safeformer.research.multi_input`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .research.multi_input import (  # noqa: F401
    AbsolutePositionalEmbedding,
    AttentionLayers,
    Decoder,
    LayerIntermediates,
    LayerNorm,
    MultiInputTransformerWrapper,
    ScaledSinusoidalEmbedding,
    always,
    default,
    exists,
    is_empty,
    multi_input_from_x_transformers,
)
