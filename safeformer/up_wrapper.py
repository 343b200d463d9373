"""x-transformers' ``x_transformers.up_wrapper`` module names (the same objects as in
``safeformer.universal_pretrain``; nothing is defined here)."""

from .core.xt_helpers import default, divisible_by, exists  # noqa: F401  (x-transformers' helpers of this module)
from .research.universal_pretrain import SyntheticDataGenerator, UniversalPretrainWrapper, random_sequences

__all__ = ["SyntheticDataGenerator", "UniversalPretrainWrapper", "random_sequences"]

# x-transformers' names that its module of this path imports from another (the same objects as there)
from .decoding.generation import AutoregressiveWrapper  # noqa: E402, F401
from .stack.wrappers import TransformerWrapper  # noqa: E402, F401
