"""x-transformers' ``x_transformers.nonautoregressive_wrapper`` module names (the same objects as in
``safeformer``; nothing is defined here): the wrapper and the ``Losses`` namedtuple its forward returns."""

from .nonautoregressive import Losses, NonAutoregressiveWrapper

__all__ = ["Losses", "NonAutoregressiveWrapper"]
