"""``safeformer.attend``: x-transformers' import path ``x_transformers.attend``, a re-export of
``safeformer.core.attend`` (where it is implemented) and of the names x-transformers' module of this path holds.
"""

from __future__ import annotations

from .core.attend import (  # noqa: F401
    BACKENDS,
    AttentionPlan,
    PreparedMask,
    attend,
    plan_attention,
    prepare_mask,
    substitute_kernel,
)
from .core.xt_helpers import at_most_one_of, compact, default, exists, l1norm  # noqa: F401
from .nn.attention_scoring import log_prob_from_hard_attend  # noqa: F401
from .nn.xt_attend import Attend  # noqa: F401
