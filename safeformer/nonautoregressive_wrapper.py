"""x-transformers' ``x_transformers.nonautoregressive_wrapper`` module name (the same object as in
``safeformer``; nothing is defined here)."""

from .nonautoregressive import NonAutoregressiveWrapper

__all__ = ["NonAutoregressiveWrapper"]
