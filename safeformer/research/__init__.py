"""Research wrappers (x-transformers' belief-state, xval, DPO, GPT-VAE, ...), each converting its x-transformers
twin. Imports interop and below.

Imports run one way: core, checkpoints, nn, stack, decoding, interop, research, then the top-level modules
(``tests/test_layout.py`` checks it)."""
