"""Masks, the safe attention function and its kernels, caches, losses and conditions: no nn.Module parts; imports
nothing else of safeformer.

Imports run one way: core, checkpoints, nn, stack, decoding, interop, research, then the top-level modules
(``tests/test_layout.py`` checks it)."""
