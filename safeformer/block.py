"""One residual branch of a layer stack: norm, mixer (attention or feed-forward), adaptive gate.

Shape legend: b batch, n positions, T packed real tokens, c model width, K condition width.

``Block`` is shared by the padded path (``x (b, n, c)``, ``condition (b, K)``) and the unpadded path
(``x (T, c)``, ``condition (T, K)``: one condition row per real token). The stack adds the branch to the
residual stream itself, after stochastic depth: a block only computes the branch.
"""

from __future__ import annotations

from torch import Tensor, nn

from .modules import AdaptiveNorm

__all__ = ["Block", "apply_norm"]


def apply_norm(norm: nn.Module, x: Tensor, condition: Tensor | None) -> Tensor:
    """``norm(x, condition)`` for an adaptive norm (when a condition is given), else ``norm(x)``."""
    if condition is not None and isinstance(norm, AdaptiveNorm):
        return norm(x, condition)
    return norm(x)


class Block(nn.ModuleList):
    """``[norm, mixer, gate?]``: one residual branch (a ``ModuleList``, so checkpoints keep the names
    ``layers.<i>.0`` (norm), ``.1`` (mixer), ``.2`` (adaptive layerscale)).

    Args:
        kind: ``"self"``, ``"cross"`` or ``"ff"``.
        norm: the pre-norm (plain, or ``AdaptiveNorm`` driven by the condition).
        mixer: ``Attention`` or ``FeedForward``.
        gate: an ``AdaptiveLayerScale`` gating the branch by the condition, or ``None``.
    """

    def __init__(self, kind: str, norm: nn.Module, mixer: nn.Module, gate: nn.Module | None = None):
        super().__init__([norm, mixer] + ([gate] if gate is not None else []))
        if kind not in ("self", "cross", "ff"):
            raise ValueError(f"kind must be 'self', 'cross' or 'ff', got {kind!r}")
        self.kind = kind
        # plain references to the registered parts (no second registration): read once per branch, every step
        object.__setattr__(self, "_parts", (norm, mixer, gate))

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # a slice of the parts is a plain list of them, not a Block
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)

    @property
    def norm(self) -> nn.Module:
        return self._parts[0]

    @property
    def mixer(self) -> nn.Module:
        return self._parts[1]

    @property
    def gate(self) -> nn.Module | None:
        return self._parts[2]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        super().__setitem__(idx, module)
        parts = list(self._parts)
        parts[idx] = module
        object.__setattr__(self, "_parts", tuple(parts))

    def forward(self, x: Tensor, condition: Tensor | None = None, *args, **kwargs) -> tuple[Tensor, tuple]:
        """The branch of ``x``: ``(out, extra)``, ``extra`` being what the mixer returned besides its
        output (an attention's keys/values and weights; nothing for a feed-forward). A module call, so a
        block can be its own FSDP2 unit (``fully_shard(block)``) and hooks on it run."""
        norm, mixer, gate = self._parts
        res = mixer(apply_norm(norm, x, condition), *args, **kwargs)
        out, extra = (res[0], tuple(res[1:])) if isinstance(res, tuple) else (res, ())
        if gate is not None:  # adaptive layerscale: the condition gates the branch
            out = gate(out, condition)
        return out, extra
