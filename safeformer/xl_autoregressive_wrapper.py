"""``safeformer.xl_autoregressive_wrapper``: x-transformers' import path ``x_transformers.xl_autoregressive_wrapper``, a re-export of
``safeformer.decoding.xl`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .decoding.xl import (  # noqa: F401
    EpisodicMemories,
    EpisodicMemoryWrapper,
    LowRankLinear,
    TTTMetaLearningTargetKLLoss,
    TTTModuleWrapper,
    TTTNextLatentPredictionLoss,
    XLAutoregressiveWrapper,
    cast_tuple,
    default,
    divisible_by,
    eval_decorator,
    exists,
    first,
    is_empty,
    newtonschulz5,
    top_k,
    top_p,
    transpose,
)
