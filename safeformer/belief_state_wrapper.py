"""x-transformers' module name ``belief_state_wrapper``: ``from safeformer.belief_state_wrapper import
BeliefStateWrapper`` works as ``from x_transformers.belief_state_wrapper import ...`` does."""

from .belief_state import BeliefStateWrapper, belief_state_from_x_transformers, flip, reverse_real
from .xt_helpers import default, exists  # noqa: F401  (x-transformers' helpers of this module)

__all__ = ["BeliefStateWrapper", "belief_state_from_x_transformers", "flip", "reverse_real"]

# x-transformers' names that its module of this path imports from another (the same objects as there)
from .generation import min_p  # noqa: E402, F401
from .layers import Decoder  # noqa: E402, F401
from .wrappers import TransformerWrapper  # noqa: E402, F401
from .xt_extras import eval_decorator  # noqa: E402, F401
