"""safeformer: a transformer library in which no mask makes a model produce NaN or inf."""

from . import testing
from .attend import attend
from .attention import Attention, RelativeProjPositionalBias, log_prob_from_hard_attend
from .belief_state import BeliefStateWrapper
from .conditions import Conditions, compose_guidance, drop_conditions
from .continuous import ContinuousAutoregressiveWrapper
from .continuous_autoencoder import ContinuousTransformerAutoencoder
from .debug import DeadRowReport, MaskReport, NonFiniteReport, NonFiniteTensor, find_nonfinite, mask_report, plot_mask
from .dpo import DPO
from .encoder_decoder import XTransformer
from .entropy_tokenizer import EntropyBasedTokenizer
from .free_transformer import FreeTransformer
from .generation import (
    FILTERS,
    AutoregressiveWrapper,
    generate_tokens,
    guided_logits,
    left_pad,
    min_p,
    sample_logits,
    top_a,
    top_k,
    top_p,
)
from .gpt_vae import GPTVAE
from .interop import from_x_transformers
from .layers import (
    AttentionLayers,
    AttnIntermediate,
    CrossAttender,
    Decoder,
    Encoder,
    KVCache,
    LayerIntermediates,
    PrefixDecoder,
    TransformerBlock,
    layer_schedule,
)
from .losses import masked_mean, safe_cross_entropy
from .masks import (
    alive_keys,
    alive_rows,
    as_attention_mask,
    causal_mask,
    check_finite,
    combine_masks,
    dead_rows,
    padding_mask,
    validate_mask,
)
from .modules import (
    AbsolutePositionalEmbedding,
    AdaptiveRMSNorm,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    apply_rotary,
    positions_from_mask,
)
from .multi_input import MultiInputTransformerWrapper
from .neo_mlp import NeoMLP
from .next_latent import MSECosineSimLoss, NextLatentWrapper, ResidualDynamics, RolloutGRU
from .nonautoregressive import NonAutoregressiveWrapper
from .pretrained import Configurable, load_pretrained, save_pretrained
from .relative_position import RelativePositionBias
from .universal_pretrain import UniversalPretrainWrapper
from .wrappers import ContinuousTransformerWrapper, Mems, TransformerWrapper
from .xl_autoregressive_wrapper import (
    EpisodicMemories,
    LowRankLinear,
    TTTMetaLearningTargetKLLoss,
    TTTModuleWrapper,
    TTTNextLatentPredictionLoss,
    XLAutoregressiveWrapper,
)
from .xt_attend import Attend
from .xt_extras import AttentionPool, LinearNoBias, ViTransformerWrapper, eval_decorator
from .xval import XValAutoregressiveWrapper, XValTransformerWrapper

__all__ = [
    "XLAutoregressiveWrapper",
    "TTTModuleWrapper",
    "TTTMetaLearningTargetKLLoss",
    "TTTNextLatentPredictionLoss",
    "LowRankLinear",
    "EpisodicMemories",
    "Mems",
    "LinearNoBias",
    "BeliefStateWrapper",
    "NextLatentWrapper",
    "ResidualDynamics",
    "RolloutGRU",
    "MSECosineSimLoss",
    "ContinuousTransformerAutoencoder",
    "GPTVAE",
    "FreeTransformer",
    "DPO",
    "EntropyBasedTokenizer",
    "MultiInputTransformerWrapper",
    "NeoMLP",
    "XValAutoregressiveWrapper",
    "XValTransformerWrapper",
    "eval_decorator",
    "ViTransformerWrapper",
    "TransformerBlock",
    "layer_schedule",
    "PrefixDecoder",
    "AttentionPool",
    "AdaptiveRMSNorm",
    "AttnIntermediate",
    "LayerIntermediates",
    "AbsolutePositionalEmbedding",
    "Attention",
    "RelativeProjPositionalBias",
    "RelativePositionBias",
    "log_prob_from_hard_attend",
    "AttentionLayers",
    "AutoregressiveWrapper",
    "Configurable",
    "ContinuousAutoregressiveWrapper",
    "ContinuousTransformerWrapper",
    "Conditions",
    "CrossAttender",
    "DeadRowReport",
    "Decoder",
    "Encoder",
    "FILTERS",
    "FeedForward",
    "KVCache",
    "MaskReport",
    "NonAutoregressiveWrapper",
    "UniversalPretrainWrapper",
    "NonFiniteReport",
    "NonFiniteTensor",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerWrapper",
    "XTransformer",
    "alibi_bias",
    "alibi_slopes",
    "alive_keys",
    "alive_rows",
    "apply_rotary",
    "as_attention_mask",
    "attend",
    "Attend",
    "causal_mask",
    "check_finite",
    "combine_masks",
    "compose_guidance",
    "dead_rows",
    "drop_conditions",
    "find_nonfinite",
    "from_x_transformers",
    "generate_tokens",
    "guided_logits",
    "load_pretrained",
    "mask_report",
    "masked_mean",
    "left_pad",
    "min_p",
    "padding_mask",
    "plot_mask",
    "positions_from_mask",
    "safe_cross_entropy",
    "sample_logits",
    "save_pretrained",
    "top_a",
    "top_k",
    "top_p",
    "validate_mask",
]

__version__ = "0.1.0"
