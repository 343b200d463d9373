"""The parts a layer is built from: norms, embeddings, feed-forward, attention and its option families, blocks.
Imports core and checkpoints.

Imports run one way: core, checkpoints, nn, stack, decoding, interop, research, then the top-level modules
(``tests/test_layout.py`` checks it)."""
