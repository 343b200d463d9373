"""safeformer: a transformer library in which no mask makes a model produce NaN or inf."""

# x-transformers' module path ``safeformer.attend`` loads first, so that the function below keeps the name (a later
# ``import safeformer.attend`` finds the module loaded and leaves the package's attribute alone)
from . import attend as _attend_path  # noqa: F401
from . import testing
from .checkpoints.pretrained import Configurable, load_pretrained, save_pretrained
from .core.attend import attend
from .core.conditions import Conditions, compose_guidance, drop_conditions
from .core.losses import masked_mean, safe_cross_entropy
from .core.masks import (
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
from .debug import DeadRowReport, MaskReport, NonFiniteReport, NonFiniteTensor, find_nonfinite, mask_report, plot_mask
from .decoding.continuous import ContinuousAutoregressiveWrapper
from .decoding.encoder_decoder import XTransformer
from .decoding.generation import (
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
from .decoding.nonautoregressive import NonAutoregressiveWrapper
from .decoding.xl import (
    EpisodicMemories,
    LowRankLinear,
    TTTMetaLearningTargetKLLoss,
    TTTModuleWrapper,
    TTTNextLatentPredictionLoss,
    XLAutoregressiveWrapper,
)
from .interop import from_x_transformers
from .nn.attention import Attention, RelativeProjPositionalBias, log_prob_from_hard_attend
from .nn.modules import (
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
from .nn.relative_position import RelativePositionBias
from .nn.xt_attend import Attend
from .research.belief_state import BeliefStateWrapper
from .research.continuous_autoencoder import ContinuousTransformerAutoencoder
from .research.dpo import DPO
from .research.entropy_tokenizer import EntropyBasedTokenizer
from .research.free_transformer import FreeTransformer
from .research.gpt_vae import GPTVAE
from .research.multi_input import MultiInputTransformerWrapper
from .research.neo_mlp import NeoMLP
from .research.next_latent import MSECosineSimLoss, NextLatentWrapper, ResidualDynamics, RolloutGRU
from .research.universal_pretrain import UniversalPretrainWrapper
from .research.xval import XValAutoregressiveWrapper, XValTransformerWrapper
from .stack.layers import (
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
from .stack.wrappers import ContinuousTransformerWrapper, Mems, TransformerWrapper
from .stack.xt_extras import AttentionPool, LinearNoBias, ViTransformerWrapper, eval_decorator

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
