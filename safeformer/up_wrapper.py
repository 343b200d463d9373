"""x-transformers' ``x_transformers.up_wrapper`` module names (the same objects as in
``safeformer.universal_pretrain``; nothing is defined here)."""

from .universal_pretrain import SyntheticDataGenerator, UniversalPretrainWrapper, random_sequences

__all__ = ["SyntheticDataGenerator", "UniversalPretrainWrapper", "random_sequences"]
