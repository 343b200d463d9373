"""Checkpoints: configurations, save/load (safetensors) with their migrations, training state. Imports core only.

Imports run one way: core, checkpoints, nn, stack, decoding, interop, research, then the top-level modules
(``tests/test_layout.py`` checks it)."""
