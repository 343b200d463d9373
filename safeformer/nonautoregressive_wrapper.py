"""x-transformers' ``x_transformers.nonautoregressive_wrapper`` module names (the same objects as in
``safeformer``; nothing is defined here): the wrapper, the ``Losses`` namedtuple its forward returns, the token critic ``SelfCritic`` and the masking helper
``get_mask_subset_prob``."""

from .core.xt_helpers import (  # noqa: F401  (x-transformers' helpers of this module)
    coin_flip,
    cosine_schedule,
    default,
    exists,
    linear_schedule,
    sample_prob,
)
from .core.xt_helpers import gumbel_noise_uniform as gumbel_noise  # noqa: F401
from .core.xt_helpers import gumbel_sample_dim as gumbel_sample  # noqa: F401
from .core.xt_helpers import log_add_eps as log  # noqa: F401
from .decoding.nonautoregressive import Losses, NonAutoregressiveWrapper, SelfCritic
from .decoding.nonautoregressive import mask_subset as get_mask_subset_prob  # noqa: F401

__all__ = ["Losses", "NonAutoregressiveWrapper", "SelfCritic"]

# x-transformers' names that its module of this path imports from another (the same objects as there)
from .stack.wrappers import TransformerWrapper  # noqa: E402, F401
