"""Next-latent prediction: x-transformers' ``NextLatentWrapper`` on a safeformer ``TransformerWrapper``.

Shape legend: b batch, n sequence positions, r rollout steps, d model width, v vocabulary size.
Masks follow the one convention (bool, True = real position; see ``masks.py``).

The loss: next-token cross-entropy, plus a latent dynamics model that rolls the hidden state at position
``t`` forward with the embeddings of the next tokens (``r`` steps) and is trained to reach the hidden
states at ``t + 1 .. t + r`` (a regression loss and a KL divergence between the output head's
distributions on both, the head frozen for the KL), each rollout step weighted by ``rollout_weights`` and,
by default, by ``exp(-decay * the losses of the steps before it)``; optionally SIGReg on the hidden states.

Padding: positions holding ``ignore_index`` (and positions where ``mask`` is False) are padding. The
model sees them as padding (masked: their ids are never looked up, their hidden states are exact zeros),
a target counts when it and the position predicting it are real, and rollout step ``k`` from position
``t`` counts when positions ``t .. t + k + 1`` are all real. Every term is a mean over what counts,
selected before any arithmetic: a batch with nothing counted is a loss of exactly 0 with zero gradients.

Differences from x-transformers (equal on right-padded batches, ``tests/test_next_latent.py``):
x-transformers feeds the padding to the model as ``pad_value`` tokens (real positions for the model), so a
target after a hole counts there; its SIGReg indexes all ``n`` hidden states with the ``n - 1`` targets' mask (an
error); here SIGReg runs on the hidden states that predict a counted target (so a batch with nothing
counted is 0 there too).
"""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.losses import safe_cross_entropy
from ..core.masks import checked_once, validate_mask
from ..interop.convert import register_converter
from ..nn.modules import l2norm
from ..stack.wrappers import TransformerWrapper

__all__ = ["NextLatentWrapper", "ResidualDynamics", "RolloutGRU", "MSECosineSimLoss", "MLP", "Losses",
           "dynamic_rollout_loss_weights", "next_latent_from_x_transformers"]

Losses = namedtuple("Losses", ["ce", "next_latent", "kl", "sigreg"])


def dynamic_rollout_loss_weights(step_losses: Tensor, decay: float = 1.0) -> Tensor:
    """``exp(-decay * sum of the losses of the earlier steps)`` for ``step_losses (r, b, n)``."""
    return (-decay * (step_losses.cumsum(0) - step_losses)).exp()


def MLP(dim_in: int, dim_out: int, dim_hidden: int, depth: int = 3) -> nn.Sequential:
    """Linear layers with GELU between them (x-transformers' ``MLP``)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        last = i == depth - 1
        layers.append(nn.Linear(dim_in if i == 0 else dim_hidden, dim_out if last else dim_hidden))
        if not last:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


class ResidualDynamics(nn.Module):
    """``latent <- latent + net(cat(latent, next_token_embed))`` per rollout step."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, rollout_next_token_embeds: Tensor, curr_latent: Tensor) -> Tensor:
        """``(r, b, n, d)`` next-token embeddings, ``(b, n, d)`` latents -> ``(r, b, n, d)``."""
        outs = []
        for emb in rollout_next_token_embeds:
            curr_latent = curr_latent + self.net(torch.cat((curr_latent, emb), -1))
            outs.append(curr_latent)
        return torch.stack(outs)


class RolloutGRU(nn.Module):
    """A GRU over the rollout steps, started from the latent."""

    def __init__(self, dim: int):
        super().__init__()
        self.gru = nn.GRU(input_size=dim, hidden_size=dim, batch_first=False)

    def forward(self, rollout_next_token_embeds: Tensor, curr_latent: Tensor) -> Tensor:
        r, b, n, d = rollout_next_token_embeds.shape
        out, _ = self.gru(rollout_next_token_embeds.reshape(r, b * n, d), curr_latent.reshape(1, b * n, d))
        return out.reshape(r, b, n, -1)


class MSECosineSimLoss(nn.Module):
    """``lerp(mse, 1 - cosine similarity, weight)`` per feature."""

    def __init__(self, weight: float = 0.9):
        super().__init__()
        self.weight = weight

    def forward(self, pred: Tensor, target: Tensor) -> Tensor:
        mse = F.mse_loss(pred, target, reduction="none")
        cos = (1.0 - F.cosine_similarity(pred, target, dim=-1))[..., None]
        return mse.lerp(cos, self.weight)


def _masked_mean(t: Tensor, keep: Tensor) -> Tensor:
    """Mean of ``t`` over the positions ``keep`` (broadcast to ``t``), selected; 0 over nothing."""
    keep = keep.expand_as(t)
    return torch.where(keep, t, 0.0).sum() / keep.sum().clamp(min=1).to(t.dtype)


def _check_wrapper_args(net, dim, num_rollouts, ignore_index, pad_value, **loss_weights) -> None:
    """``NextLatentWrapper``'s net, width, rollout count, loss weights (finite, >= 0) and integer ids."""
    if not isinstance(net, TransformerWrapper):
        raise TypeError(f"net must be a safeformer TransformerWrapper, got {type(net).__name__} "
                        "(convert an x-transformers NextLatentWrapper with next_latent_from_x_transformers)")
    if not net.attn_layers.causal:
        raise ValueError("net must be causal (attn_layers=Decoder(...)) for next-token prediction")
    if dim != net.attn_layers.dim:
        raise ValueError(f"dim must be the net's width {net.attn_layers.dim}, got {dim!r}")
    if isinstance(num_rollouts, bool) or not isinstance(num_rollouts, int) or num_rollouts < 1:
        raise ValueError(f"num_rollouts must be an integer > 0, got {num_rollouts!r}")
    for name, value in loss_weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < float("inf")):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    for name, value in (("ignore_index", ignore_index), ("pad_value", pad_value)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")


def _loss_module(loss_type: str | nn.Module) -> nn.Module:
    """The regression loss module named by ``loss_type`` (or ``loss_type`` itself)."""
    if isinstance(loss_type, nn.Module):
        return loss_type
    if loss_type == "smooth_l1":
        return nn.SmoothL1Loss(reduction="none")
    if loss_type == "mse":
        return nn.MSELoss(reduction="none")
    if loss_type == "mse_and_cosine_sim":
        return MSECosineSimLoss()
    raise ValueError(f"loss_type must be 'smooth_l1', 'mse', 'mse_and_cosine_sim' or a module, got {loss_type!r}")


def _rollout_weights(rollout_weights, num_rollouts: int) -> tuple[Tensor, tuple[float, ...]]:
    """The rollout weights, checked and normalised: as a float32 tensor and as Python floats (float64)."""
    if rollout_weights is None:
        rollout_weights = (1.0,) * num_rollouts
    if len(rollout_weights) != num_rollouts:
        raise ValueError(f"rollout_weights must have num_rollouts={num_rollouts} weights, got {len(rollout_weights)}")
    w = torch.tensor([float(x) for x in rollout_weights])
    if not bool(torch.isfinite(w).all() & (w >= 0).all()) or float(w.sum()) <= 0:
        raise ValueError(f"rollout_weights must be finite, >= 0 and not all 0, got {tuple(rollout_weights)!r}")
    total_w = sum(float(x) for x in rollout_weights)  # the weights used, normalised in float64
    return w / w.sum(), tuple(float(x) / total_w for x in rollout_weights)


def _dynamics_model(dynamics_type: str, dynamics_network: nn.Module | None, dim: int, dynamics_hidden_dim: int | None,
                    dynamics_num_layers: int) -> nn.Module:
    """The latent dynamics model of ``dynamics_type``."""
    if dynamics_type == "residual":
        if dynamics_network is None:
            hidden = dim if dynamics_hidden_dim is None else dynamics_hidden_dim
            dynamics_network = nn.Sequential(nn.LayerNorm(dim * 2), MLP(dim * 2, dim, hidden, depth=dynamics_num_layers))
            nn.init.zeros_(dynamics_network[-1][-1].weight)
            nn.init.zeros_(dynamics_network[-1][-1].bias)
        return ResidualDynamics(dynamics_network)
    if dynamics_type == "gru":
        return RolloutGRU(dim)
    if dynamics_type == "custom":
        if dynamics_network is None:
            raise ValueError("dynamics_type='custom' needs dynamics_network (the whole dynamics model)")
        return dynamics_network
    raise ValueError(f"dynamics_type must be 'residual', 'gru' or 'custom', got {dynamics_type!r}")


class NextLatentWrapper(nn.Module):
    """x-transformers' ``NextLatentWrapper(net, dim=, num_rollouts=, loss_type=, dynamics_type=, ...)``.

    Args:
        net: a causal ``TransformerWrapper`` (``attn_layers=Decoder(...)``).
        dim: the model width (must be ``net``'s).
        num_rollouts: rollout steps r (>= 1).
        loss_type: ``"smooth_l1"``, ``"mse"``, ``"mse_and_cosine_sim"`` or a module ``(pred, target) -> loss``.
        dynamics_type: ``"residual"`` (``dynamics_network`` or a LayerNorm + MLP, its last layer at 0),
            ``"gru"`` or ``"custom"`` (``dynamics_network`` is the whole dynamics model).
        next_latent_loss_weight, kl_loss_weight, sigreg_loss_weight: the terms' weights (>= 0).
        ignore_index: the id marking padding in ``x``; pad_value: kept for x-transformers (padding is masked).
        rollout_weights: one weight per rollout step (normalised to sum 1).
        dynamic_rollout_loss_weight, dynamic_loss_decay: weight step k by ``exp(-decay * loss of steps < k)``.
    """

    @staticmethod
    def sigreg_loss(x: Tensor, num_slices: int = 1024, domain=(-5, 5), num_knots: int = 17, *,
                    generator: torch.Generator | None = None) -> Tensor:
        """SIGReg of ``x (..., d)``: the distance of the empirical characteristic function of random 1-d
        projections from a standard normal's; 0 for no rows."""
        d = x.shape[-1]
        work = torch.promote_types(x.dtype, torch.float32)  # statistics in float32 (float64 for float64)
        x = x.to(work)
        projs = l2norm(torch.randn((num_slices, d), device=x.device, generator=generator).to(work))
        t = torch.linspace(*domain, num_knots, device=x.device, dtype=work)
        exp_f = (-0.5 * t.square()).exp()
        xt = (x.reshape(-1, d) @ projs.t())[..., None] * t  # (N, m, k)
        rows = xt.shape[0]
        # the empirical characteristic function exp(i x t) averaged over the rows, as cosines and sines
        re, im = xt.cos().sum(0) / max(rows, 1), xt.sin().sum(0) / max(rows, 1)
        err = ((re - exp_f).square() + im.square()) * exp_f
        out = torch.trapezoid(err, t, dim=-1).mean()
        return out if rows else out * 0.0

    def __init__(
        self,
        net: TransformerWrapper,
        *,
        dim: int,
        num_rollouts: int = 1,
        loss_type: str | nn.Module = "smooth_l1",
        dynamics_type: str = "residual",
        dynamics_network: nn.Module | None = None,
        dynamics_hidden_dim: int | None = None,
        dynamics_num_layers: int = 3,
        next_latent_loss_weight: float = 1.0,
        kl_loss_weight: float = 1.0,
        ignore_index: int = -100,
        pad_value: int = 0,
        rollout_weights: tuple[float, ...] | None = None,
        sigreg_loss_weight: float = 0.0,
        sigreg_loss_kwargs: dict | None = None,
        dynamic_rollout_loss_weight: bool = True,
        dynamic_loss_decay: float = 1.0,
    ):
        super().__init__()
        _check_wrapper_args(net, dim, num_rollouts, ignore_index, pad_value, next_latent_loss_weight=next_latent_loss_weight,
                            kl_loss_weight=kl_loss_weight, sigreg_loss_weight=sigreg_loss_weight,
                            dynamic_loss_decay=dynamic_loss_decay)
        self.net = net
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.num_rollouts = num_rollouts
        self.loss_type = loss_type
        self.loss_fn = _loss_module(loss_type)
        self.next_latent_loss_weight = float(next_latent_loss_weight)
        self.kl_loss_weight = float(kl_loss_weight)
        self.sigreg_loss_weight = float(sigreg_loss_weight)
        self.sigreg_loss_kwargs = dict(num_slices=1024, domain=(-5, 5), num_knots=17) if sigreg_loss_kwargs is None \
            else dict(sigreg_loss_kwargs)
        self.has_next_latent_loss = next_latent_loss_weight > 0
        self.has_kl_loss = kl_loss_weight > 0
        self.has_sigreg = sigreg_loss_weight > 0
        self.dynamic_rollout_loss_weight = bool(dynamic_rollout_loss_weight)
        self.dynamic_loss_decay = float(dynamic_loss_decay)
        w, self._rollout_weights = _rollout_weights(rollout_weights, num_rollouts)
        self.register_buffer("rollout_loss_weights", w, persistent=False)
        self.dynamics_model = _dynamics_model(dynamics_type, dynamics_network, dim, dynamics_hidden_dim,
                                              dynamics_num_layers)
        self.dynamics_type = dynamics_type

    @property
    def token_emb(self) -> nn.Module:
        return self.net.token_emb

    def _frozen_head(self, h: Tensor) -> Tensor:
        """The net's output head with its weights detached (x-transformers' frozen copy)."""
        net = self.net
        if net.tie_embedding:
            logits = h @ net.token_emb.weight.detach().t()
            return logits if net.tie_embedding_scale == 1.0 else logits * net.tie_embedding_scale
        head = net.to_logits
        return F.linear(h, head.weight.detach(), None if head.bias is None else head.bias.detach())

    @checked_once
    def forward(self, x: Tensor, return_loss_breakdown: bool = False, *, mask: Tensor | None = None,
                generator: torch.Generator | None = None, **kwargs):
        """The loss on ``x (b, n)`` token ids (``ignore_index`` marks padding; ``mask`` pads too).

        Args:
            return_loss_breakdown: also return ``Losses(ce, next_latent, kl, sigreg)``.
            mask: ``(b, n)`` bool padding mask (combined with ``x != ignore_index``).
            generator: for SIGReg's random projections.
            kwargs: passed to the net (``context``, ``context_mask``, ``prepend_embeds``, ``condition``...).
        """
        real = self._real_positions(x, mask)
        inp = torch.where(real, x, torch.zeros_like(x))
        if "prepend_embeds" in kwargs:
            kwargs = {**kwargs, "excise_prepend_embeds": True}
        hidden = self.net(inp, mask=real, return_embeddings=True, **kwargs)  # (b, n, d)

        counted = real[:, 1:] & real[:, :-1]  # (b, n - 1)
        logits = self.net._head(hidden[:, :-1])
        target = torch.where(counted, x[:, 1:], torch.full_like(x[:, 1:], -100))
        ce = safe_cross_entropy(logits, target, ignore_index=-100)

        targets, next_embeds, masks = self._rollout_targets(inp, real, counted, hidden)
        dyn = self.dynamics_model(next_embeds.detach(), hidden[:, :-1])  # (r, b, n - 1, d)
        zero = hidden.new_zeros(())
        next_latent, kl = self._rollout_losses(dyn, targets, masks, hidden, zero)
        sigreg = zero
        if self.has_sigreg:
            sigreg = self.sigreg_loss(hidden[:, :-1][counted], generator=generator, **self.sigreg_loss_kwargs)
        total = ce + self.next_latent_loss_weight * next_latent + self.kl_loss_weight * kl + self.sigreg_loss_weight * sigreg
        if not return_loss_breakdown:
            return total
        return total, Losses(ce, next_latent, kl, sigreg)

    def _real_positions(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """``(b, n)`` bool: the real positions of ``x`` (not ``ignore_index``, and ``mask``), after the checks."""
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise ValueError(f"x must be token ids of shape (b, n), got {getattr(x, 'shape', type(x))}")
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"x must hold integer token ids, got dtype {x.dtype}")
        b, n = x.shape
        R = self.num_rollouts
        if n <= R + 1:
            raise ValueError(f"x needs more than num_rollouts + 1 = {R + 1} positions, got {n}")
        real = x != self.ignore_index
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=x.device)
            real = real & mask
        return real

    def _rollout_targets(self, inp: Tensor, real: Tensor, counted: Tensor,
                         hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per rollout step: the hidden states to reach ``(r, b, n - 1, d)``, the next-token embeddings fed
        ``(r, b, n - 1, d)`` and where the step counts ``(r, b, n - 1)``."""
        R, n = self.num_rollouts, inp.shape[1]
        emb = self.net.token_emb(inp)
        if self.net.l2norm_embed:
            emb = l2norm(emb)
        emb = torch.where(real[..., None], emb, torch.zeros_like(emb))
        pad = R - 1
        hid_p = F.pad(hidden, (0, 0, 0, pad))
        emb_p = F.pad(emb, (0, 0, 0, pad))
        real_p = F.pad(real, (0, pad), value=False)
        targets = torch.stack([hid_p[:, 1 + k: n + k] for k in range(R)])  # (r, b, n - 1, d)
        next_embeds = torch.stack([emb_p[:, 1 + k: n + k] for k in range(R)])
        run = counted
        masks = []
        for k in range(R):  # step k from t counts when t .. t + k + 1 are all real
            if k:
                run = run & real_p[:, 1 + k: n + k]
            masks.append(run)
        return targets, next_embeds, torch.stack(masks)

    def _rollout_losses(self, dyn: Tensor, targets: Tensor, masks: Tensor, hidden: Tensor,
                        zero: Tensor) -> tuple[Tensor, Tensor]:
        """The next-latent regression and the KL terms of the rollout (``zero`` when switched off)."""
        R = self.num_rollouts
        weights = torch.tensor(self._rollout_weights, dtype=hidden.dtype, device=hidden.device)
        unreduced = self.loss_fn(dyn, targets.detach())
        unreduced = torch.where(masks[..., None], unreduced, torch.zeros_like(unreduced))
        dyn_w = 1.0
        if self.dynamic_rollout_loss_weight:
            dyn_w = dynamic_rollout_loss_weights(unreduced.detach().mean(-1), self.dynamic_loss_decay)  # (r, b, n - 1)
        next_latent = zero
        if self.has_next_latent_loss:
            wl = unreduced * weights[:, None, None, None]
            if self.dynamic_rollout_loss_weight:
                wl = wl * dyn_w[..., None]
            next_latent = sum(_masked_mean(wl[k], masks[k][..., None]) for k in range(R))
        kl = zero
        if self.has_kl_loss:
            work = torch.promote_types(hidden.dtype, torch.float32)
            with torch.no_grad():
                tgt = F.log_softmax(self._frozen_head(targets.detach()).to(work), -1)
            pred = F.log_softmax(self._frozen_head(dyn).to(work), -1)
            step_kl = torch.where(masks[..., None], tgt.exp() * (tgt - pred), 0.0).sum(-1).to(hidden.dtype)
            step_kl = step_kl * weights[:, None, None]
            if self.dynamic_rollout_loss_weight:
                step_kl = step_kl * dyn_w
            kl = sum(_masked_mean(step_kl[k], masks[k]) for k in range(R))
        return next_latent, kl


def next_latent_from_x_transformers(xt_wrapper, *, drop_training_only: bool = False) -> NextLatentWrapper:
    """Convert an x-transformers ``NextLatentWrapper`` with its weights: the net through
    ``from_x_transformers`` (``drop_training_only`` passed on), the dynamics model (x-transformers'
    ``ResidualDynamics`` / ``RolloutGRU`` rebuilt, any other module copied) and the loss; in the wrapper's
    training mode."""
    import copy

    from ..interop.convert import from_x_transformers

    for attr in ("net", "dynamics_model", "loss_fn", "rollout_loss_weights"):
        if not hasattr(xt_wrapper, attr):
            raise TypeError(f"expected an x_transformers NextLatentWrapper, got {type(xt_wrapper).__name__} (no {attr!r})")
    net = from_x_transformers(xt_wrapper.net, drop_training_only=drop_training_only)
    dm = xt_wrapper.dynamics_model
    kind = type(dm).__name__
    dyn_kw: dict = {}
    if kind == "ResidualDynamics":
        dyn_kw = dict(dynamics_type="residual", dynamics_network=copy.deepcopy(dm.net))
    elif kind == "RolloutGRU":
        dyn_kw = dict(dynamics_type="gru")
    else:
        dyn_kw = dict(dynamics_type="custom", dynamics_network=copy.deepcopy(dm))
    loss = xt_wrapper.loss_type
    if isinstance(loss, nn.Module):
        loss = copy.deepcopy(loss)
    elif loss == "mse_and_cosine_sim":
        loss = MSECosineSimLoss(xt_wrapper.loss_fn.weight)
    out = NextLatentWrapper(
        net, dim=net.attn_layers.dim, num_rollouts=xt_wrapper.num_rollouts, loss_type=loss,
        next_latent_loss_weight=xt_wrapper.next_latent_loss_weight, kl_loss_weight=xt_wrapper.kl_loss_weight,
        ignore_index=xt_wrapper.ignore_index, pad_value=xt_wrapper.pad_value,
        rollout_weights=tuple(float(w) for w in xt_wrapper.rollout_loss_weights),
        sigreg_loss_weight=xt_wrapper.sigreg_loss_weight, sigreg_loss_kwargs=xt_wrapper.sigreg_loss_kwargs,
        dynamic_rollout_loss_weight=xt_wrapper.dynamic_rollout_loss_weight,
        dynamic_loss_decay=xt_wrapper.dynamic_loss_decay, **dyn_kw)
    if kind == "RolloutGRU":
        out.dynamics_model.gru.load_state_dict(dm.gru.state_dict())
    ref = next(xt_wrapper.net.parameters())
    return out.to(device=ref.device, dtype=ref.dtype).train(xt_wrapper.training)


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.next_latent_wrapper", "NextLatentWrapper", next_latent_from_x_transformers, takes_drop=True)
