"""``safeformer.xval``: x-transformers' import path ``x_transformers.xval``, a re-export of
``safeformer.research.xval`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .research.xval import (  # noqa: F401
    AbsolutePositionalEmbedding,
    AttentionLayers,
    GenerateReturn,
    LossBreakdown,
    ScaledSinusoidalEmbedding,
    TokenEmbedding,
    XValAutoregressiveWrapper,
    XValTransformerWrapper,
    always,
    default,
    exists,
    top_k,
    top_p,
    xval_from_x_transformers,
)
