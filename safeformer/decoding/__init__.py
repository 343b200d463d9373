"""Decoding and training wrappers: AutoregressiveWrapper, guided decoding, the static decode step, the continuous, XL
and non-autoregressive wrappers, XTransformer. Imports stack and below.

Imports run one way: core, checkpoints, nn, stack, decoding, interop, research, then the top-level modules
(``tests/test_layout.py`` checks it)."""
