"""Stacks (AttentionLayers and its presets) and wrappers (TransformerWrapper, ContinuousTransformerWrapper), the
unpadded path. Imports nn and below.

Imports run one way: core, checkpoints, nn, stack, decoding, interop, research, then the top-level modules
(``tests/test_layout.py`` checks it)."""
