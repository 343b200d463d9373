"""``safeformer.dpo``: x-transformers' import path ``x_transformers.dpo``, a re-export of
``safeformer.research.dpo`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .research.dpo import DPO, TransformerWrapper, dpo_from_x_transformers, dpo_xt_masks, exists, maybe_and_mask  # noqa: F401
