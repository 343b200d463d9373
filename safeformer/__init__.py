"""safeformer: a transformer library in which no mask makes a model produce NaN or inf."""

from .attend import BACKENDS, AttentionPlan, attend, plan_attention, substitute_kernel
from .masks import (
    alive_keys,
    alive_rows,
    as_attention_mask,
    causal_mask,
    check_finite,
    combine_masks,
    dead_rows,
    masked_mean,
    padding_mask,
    safe_cross_entropy,
    validate_mask,
)

__version__ = "0.1.0"
