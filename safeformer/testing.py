"""Below the user's API: the test hooks and the planning internals, for tests, benchmarks and the curious.

- ``substitute_kernel`` / ``substitute_varlen_kernel``: swap the SDPA (varlen) kernel for a stand-in, e.g.
  one that misbehaves on dead rows on purpose, to prove that safeformer's own code makes it harmless.
- The plans: ``plan_attention`` (``AttentionPlan``) picks the path, kernel and mask form of one ``attend``
  call; ``plan_varlen`` (``VarlenPlan``) whether the unpadded path's self-attention runs the varlen kernel;
  ``prepare_mask`` (``PreparedMask``) combines a stack's mask once for every layer; ``varlen_layout``
  (``VarlenLayout``) turns per-sample counts into segment offsets.

Each name lives in its own module too (``safeformer.attend``, ``safeformer.varlen``); none is in
``safeformer.__all__``, which is the user's API.
"""

from .core import varlen as _varlen
from .core.attend import BACKENDS, AttentionPlan, PreparedMask, plan_attention, prepare_mask, substitute_kernel
from .core.varlen import *  # noqa: F403 (varlen.__all__: its plan, layout, kernel hook and attention)

__all__ = ["BACKENDS", "AttentionPlan", "PreparedMask", "plan_attention", "prepare_mask", "substitute_kernel",
           *_varlen.__all__]
