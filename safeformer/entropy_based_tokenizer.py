"""x-transformers' ``x_transformers.entropy_based_tokenizer`` module name (the same object as in
``safeformer``; nothing is defined here)."""

from .core.xt_helpers import default, exists, log  # noqa: F401  (x-transformers' helpers of this module)
from .research.entropy_tokenizer import EntropyBasedTokenizer

__all__ = ["EntropyBasedTokenizer"]
