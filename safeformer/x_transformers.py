"""x-transformers' ``x_transformers.x_transformers`` module names, so ``from safeformer.x_transformers import X``
works as ``from safeformer import X`` does (the same objects; nothing is defined here). x-transformers' small
parts (norms, positional biases, residual gates, ``apply_rotary_pos_emb``) come from ``safeformer.xt_modules``.

x-transformers' small helper functions (``exists``, ``default``, ``l2norm``, ``softclamp``, ...) come from
``safeformer.xt_helpers`` (not in ``__all__``). Names of that module that safeformer does not provide
(``default_device``, and the options' internal modules such as ``HyperConnection``) are left
out on purpose, each with its reason in ``safeformer.xt_helpers.NOT_PROVIDED``: an ``ImportError`` names them.
See docs/moving_from_x_transformers.md.
"""

from .core.cache import LayerIntermediates
from .core.xt_helpers import (  # noqa: F401  (x-transformers' helpers of this module; not in __all__)
    always,
    at_most_one_of,
    divisible_by,
    equals,
    exists,
    first,
    group_by_key_prefix,
    group_dict_by_key,
    groupby_prefix_and_trim,
    identity,
    is_empty,
    l2norm,
    log,
    max_neg_value,
    maybe,
    not_equals,
    or_reduce,
    pick_and_pop,
    rotate_half,
    softclamp,
    string_begins_with,
)
from .core.xt_helpers import cast_tuple_depth as cast_tuple  # noqa: F401
from .core.xt_helpers import default_first as default  # noqa: F401
from .decoding.encoder_decoder import XTransformer
from .nn.attention import Attention, RelativeProjPositionalBias
from .nn.modules import (
    AbsolutePositionalEmbedding,
    AdaptiveRMSNorm,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from .nn.relative_position import RelativePositionBias
from .nn.xt_modules import (
    GLU,
    AlibiPositionalBias,
    DynamicPositionBias,
    DynamicTanh,
    GRUGating,
    LayerNorm,
    LayerScale,
    ReluSquared,
    Residual,
    Scale,
    ScaledSinusoidalEmbedding,
    ScaleNorm,
    SimpleRMSNorm,
    TokenEmbedding,
    apply_rotary_pos_emb,
)
from .stack.layers import (
    AttentionLayers,
    CrossAttender,
    Decoder,
    Encoder,
    PrefixDecoder,
    TransformerBlock,
    layer_schedule,
)
from .stack.wrappers import TransformerWrapper
from .stack.xt_extras import AttentionPool, LinearNoBias, ViTransformerWrapper

__all__ = [
    "AbsolutePositionalEmbedding",
    "AdaptiveRMSNorm",
    "Attention",
    "RelativeProjPositionalBias",
    "RelativePositionBias",
    "AttentionLayers",
    "AttentionPool",
    "CrossAttender",
    "LinearNoBias",
    "Decoder",
    "Encoder",
    "FeedForward",
    "LayerIntermediates",
    "PrefixDecoder",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "TransformerWrapper",
    "ViTransformerWrapper",
    "XTransformer",
    "apply_rotary",
    "layer_schedule",
    # x-transformers' small parts (safeformer/xt_modules.py)
    "AlibiPositionalBias",
    "DynamicPositionBias",
    "DynamicTanh",
    "GLU",
    "GRUGating",
    "LayerNorm",
    "LayerScale",
    "ReluSquared",
    "Residual",
    "Scale",
    "ScaleNorm",
    "ScaledSinusoidalEmbedding",
    "SimpleRMSNorm",
    "TokenEmbedding",
    "apply_rotary_pos_emb",
]

# x-transformers' names that its module of this path imports from another (the same objects as there)
from .decoding.generation import AutoregressiveWrapper  # noqa: E402, F401
from .nn.attention_scoring import log_prob_from_hard_attend  # noqa: E402, F401
from .nn.block import AttentionResidual  # noqa: E402, F401
from .nn.xt_attend import Attend  # noqa: E402, F401
