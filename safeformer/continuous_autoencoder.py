"""``safeformer.continuous_autoencoder``: x-transformers' import path ``x_transformers.continuous_autoencoder``, a re-export of
``safeformer.research.continuous_autoencoder`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .research.continuous_autoencoder import (  # noqa: F401
    ContinuousTransformerAutoencoder,
    ContinuousTransformerWrapper,
    Decoder,
    DeterministicLatentBottleneck,
    Encoder,
    VariationalLatentBottleneck,
    continuous_autoencoder_from_x_transformers,
    default,
    exists,
)
