"""x-transformers' ``x_transformers.autoregressive_wrapper`` module names (the same objects as in
``safeformer``; nothing is defined here)."""

from .core.xt_helpers import (  # noqa: F401  (x-transformers' helpers of this module)
    align_right,
    cast_tuple,
    default,
    exists,
    gumbel_noise,
    gumbel_sample,
    identity,
    join,
    log,
    pad_at_dim,
)
from .decoding.generation import AutoregressiveWrapper, min_p, top_a, top_k, top_p
from .stack.xt_extras import eval_decorator

__all__ = ["AutoregressiveWrapper", "eval_decorator", "min_p", "top_a", "top_k", "top_p"]
