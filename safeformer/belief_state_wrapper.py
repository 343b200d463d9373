"""x-transformers' module name ``belief_state_wrapper``: ``from safeformer.belief_state_wrapper import
BeliefStateWrapper`` works as ``from x_transformers.belief_state_wrapper import ...`` does."""

from .belief_state import BeliefStateWrapper, belief_state_from_x_transformers, flip, reverse_real
from .xt_helpers import default, exists  # noqa: F401  (x-transformers' helpers of this module)

__all__ = ["BeliefStateWrapper", "belief_state_from_x_transformers", "flip", "reverse_real"]

# x-transformers' names that its module of this path imports from another (the same objects as there)
from .autoregressive_wrapper import eval_decorator, min_p  # noqa: E402, F401
from .x_transformers import Decoder, TransformerWrapper  # noqa: E402, F401
