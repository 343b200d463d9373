"""``safeformer.neo_mlp``: x-transformers' import path ``x_transformers.neo_mlp``, a re-export of
``safeformer.research.neo_mlp`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .research.neo_mlp import Encoder, NeoMLP, RandomFourierEmbed, default, exists, neo_mlp_from_x_transformers  # noqa: F401
