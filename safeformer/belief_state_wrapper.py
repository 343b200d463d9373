"""x-transformers' module name ``belief_state_wrapper``: ``from safeformer.belief_state_wrapper import
BeliefStateWrapper`` works as ``from x_transformers.belief_state_wrapper import ...`` does."""

from .core.xt_helpers import default, exists  # noqa: F401  (x-transformers' helpers of this module)
from .research.belief_state import BeliefStateWrapper, belief_state_from_x_transformers, flip, reverse_real

__all__ = ["BeliefStateWrapper", "belief_state_from_x_transformers", "flip", "reverse_real"]

# x-transformers' names that its module of this path imports from another (the same objects as there)
from .decoding.generation import min_p  # noqa: E402, F401
from .stack.layers import Decoder  # noqa: E402, F401
from .stack.wrappers import TransformerWrapper  # noqa: E402, F401
from .stack.xt_extras import eval_decorator  # noqa: E402, F401
