"""``safeformer.free_transformer``: x-transformers' import path ``x_transformers.free_transformer``, a re-export of
``safeformer.research.free_transformer`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .research.free_transformer import (  # noqa: F401
    NAT,
    BinaryMapper,
    Decoder,
    Encoder,
    FreeTransformer,
    TransformerWrapper,
    binary_entropy,
    default,
    exists,
    free_transformer_from_x_transformers,
    gumbel_sample,
    log,
    top_k,
    top_p,
)
