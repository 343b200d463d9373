"""x-transformers' module name ``next_latent_wrapper``: ``from safeformer.next_latent_wrapper import
NextLatentWrapper`` works as ``from x_transformers.next_latent_wrapper import ...`` does."""

from .core.xt_helpers import default, exists  # noqa: F401  (x-transformers' helpers of this module)
from .core.xt_helpers import l2norm_dim as l2norm  # noqa: F401
from .research.next_latent import (
    MLP,
    Losses,
    MSECosineSimLoss,
    NextLatentWrapper,
    ResidualDynamics,
    RolloutGRU,
    dynamic_rollout_loss_weights,
    next_latent_from_x_transformers,
)

__all__ = ["MLP", "Losses", "MSECosineSimLoss", "NextLatentWrapper", "ResidualDynamics", "RolloutGRU",
           "dynamic_rollout_loss_weights", "next_latent_from_x_transformers"]
