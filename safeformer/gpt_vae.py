"""``safeformer.gpt_vae``: x-transformers' import path ``x_transformers.gpt_vae``, a re-export of
``safeformer.research.gpt_vae`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .research.gpt_vae import (  # noqa: F401
    GPTVAE,
    AutoregressiveWrapper,
    Decoder,
    Encoder,
    TransformerWrapper,
    default,
    exists,
    gpt_vae_from_x_transformers,
)
