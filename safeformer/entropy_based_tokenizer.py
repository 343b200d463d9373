"""x-transformers' ``x_transformers.entropy_based_tokenizer`` module name (the same object as in
``safeformer``; nothing is defined here)."""

from .entropy_tokenizer import EntropyBasedTokenizer

__all__ = ["EntropyBasedTokenizer"]
