"""Contract cases for x-transformers' options of the layer stack (residual streams, skips, extra keys/values).

Each case subclasses a case of ``models.py`` (imported from there at the end of that module) and joins its
``CASES``; a case that runs on the padded path only sets ``padded_only = True``.
"""

from __future__ import annotations

import torch
from torch import nn

import safeformer as sf

from .models import DecoderCase, EncoderCase


def _perturb_routing(model: nn.Module, seed: int = 5) -> nn.Module:
    """The routing's zero-initialised weights (hyper-connections' dynamic parts, gates, U-Net skips) given
    values, so every contract test exercises them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, sf.nn.block.ResidualRouting):
                for p in m.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


class DecoderHyperCase(DecoderCase):
    """``Decoder`` with cross-attention and x-transformers' hyper-connections (``num_residual_streams=3``) whose
    self-attention reads queries, keys and values from three mixtures of the streams
    (``qkv_receive_diff_residuals``): the streams are mixed per token, so padding stays out; decodes with the
    KV cache. Padded path only."""

    name = "Decoder-hyper-connections"
    padded_only = True

    def config(self):
        return dict(super().config(), num_residual_streams=3, qkv_receive_diff_residuals=True)

    def make(self, backend="auto"):
        return _perturb_routing(super().make(backend))


class EncoderLimeSkipsCase(EncoderCase):
    """``Encoder`` with LIMe (``integrate_layers``: every block's input mixes the inputs of all blocks before it),
    U-Net skips, a gated input reinjection and pre-and-post norms. Padded path only."""

    name = "Encoder-lime-unet"
    padded_only = True

    def config(self):
        return dict(super().config(), depth=4, integrate_layers=True, unet_skips=True, reinject_input=True,
                    learned_reinject_input_gate=True, pre_and_post_norm=True)

    def make(self, backend="auto"):
        return _perturb_routing(super().make(backend))


class EncoderMVSplitCase(EncoderCase):
    """``Encoder`` with x-transformers' ``mv_split_residual`` (learned): every residual update reads the mean
    of the branch output and of the stream over the sample's real positions, so padded positions must add
    nothing to the means and NaN planted there must reach nothing. No KV cache, padded path only."""

    name = "Encoder-mv-split"
    padded_only = True

    def config(self):
        return dict(super().config(), mv_split_residual=True, residual_fn_kwargs=dict(learned=True))

    def make(self, backend="auto"):
        return _perturb_routing(super().make(backend))


class EncoderOrthogResidualCase(EncoderCase):
    """``Encoder`` with x-transformers' ``orthog_residual``: each branch output's part orthogonal to the stream,
    over the sample's real positions and features; padding must add nothing to the dot product or the norm.
    No KV cache, padded path only."""

    name = "Encoder-orthog-residual"
    padded_only = True

    def config(self):
        return dict(super().config(), orthog_residual=True)


def _perturb_gains(model: nn.Module, seed: int = 6) -> nn.Module:
    """Layerscale gains, post-norms and GRU gates given values away from their inits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            # LayerScale wraps its branch (x-transformers' tree): its own gain only
            params = [m.gamma] if isinstance(m, sf.nn.xt_modules.LayerScale) else \
                list(m.parameters()) if isinstance(m, nn.GRUCell) else []
            for p in params:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


class DecoderLayoutCase(DecoderCase):
    """``Decoder`` with x-transformers' block pattern options: ``custom_layers`` (two self-attentions in a row,
    cross-attention between), ``macaron`` (half-step feed-forwards), ``sandwich_norm``, ``use_layerscale`` and a
    float ``depth_scale_residual``. Every option acts per block, so it runs unpadded, decodes with the KV cache and
    on the static step."""

    name = "Decoder-layout"

    def config(self):
        return dict(super().config(), custom_layers=("a", "a", "c", "f", "a", "c", "f"), macaron=True,
                    sandwich_norm=True, use_layerscale=True, layerscale_init_value=0.5, depth_scale_residual=0.8)

    def make(self, backend="auto"):
        return _perturb_gains(super().make(backend))


class DecoderResidualGateCase(DecoderCase):
    """``Decoder`` in post-norm (``pre_norm=False``) with x-transformers' ``gate_residual`` (a GRU cell per block
    updates the stream), a learned ``scale_residual`` and ``softclamp_output``: per token, so padding stays out;
    decodes with the KV cache. Padded path only."""

    name = "Decoder-post-norm-gru"
    padded_only = True

    def config(self):
        return dict(super().config(), pre_norm=False, gate_residual=True, scale_residual=True, softclamp_output=True,
                    softclamp_output_value=5.0)

    def make(self, backend="auto"):
        return _perturb_routing(_perturb_gains(super().make(backend)))


class DecoderShiftRepeatCase(DecoderCase):
    """``Decoder`` with ``shift_tokens`` (a real position must never read a padded one's features: they are
    selected to 0 first, left padding included), a constructor ``layers_execute_order`` running the first layer
    twice and ``scale_residual_constant``. No KV cache, padded path only."""

    name = "Decoder-shift-repeat"
    padded_only = True
    decodes = False

    def config(self):
        return dict(super().config(), shift_tokens=2, layers_execute_order=(0, 1, 2, 0, 1, 2, 3, 4, 5),
                    scale_residual_constant=0.9)


class EncoderTiedShiftCase(EncoderCase):
    """``Encoder`` with ``weight_tie_layers`` (one layer run ``depth`` times) and two-sided ``shift_tokens``
    (``-k..k``: a real position next to padding reads 0 from it). Padded path only."""

    name = "Encoder-tied-shift"
    padded_only = True

    def config(self):
        return dict(super().config(), depth=3, weight_tie_layers=True, shift_tokens=1)


class DecoderResidualAttnCase(DecoderCase):
    """``Decoder`` with x-transformers' ``residual_attn`` and ``cross_residual_attn``: every attention adds the
    logits of the one before (masked keys hold ``-inf`` there, dead rows 0: both must carry nothing, NaN planted
    at masked keys included); decodes with the KV cache (the logits span the cached keys too). Padded path only."""

    name = "Decoder-residual-attn"
    padded_only = True
    explicit_attention = True

    def config(self):
        return dict(super().config(), depth=3, residual_attn=True, cross_residual_attn=True)


def _perturb_modules(model: nn.Module, kinds: tuple, seed: int = 7) -> nn.Module:
    """The parameters of the modules of ``kinds`` (zero-initialised gates, unit gains) moved off their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, kinds):
                for p in m.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


class DecoderAggregatedResidualCase(DecoderCase):
    """``Decoder`` with x-transformers' ``attn_aggregated_residuals``: each block's input attends, per token, over the
    inputs of every block before it (``AttentionResidual``); padding stays out, the KV cache decodes as the full
    forward. Padded path only."""

    name = "Decoder-aggregated-residuals"
    padded_only = True

    def config(self):
        return dict(super().config(), attn_aggregated_residuals=True,
                    attn_aggregated_residual_kwargs=dict(lora_rank=4))

    def make(self, backend="auto"):
        return _perturb_modules(super().make(backend), (sf.nn.block.AttentionResidual,))


class EncoderGatedMultiResidualCase(EncoderCase):
    """``Encoder`` with x-transformers' ``gated_multi_residual`` over two residual streams (``GatedMultiResidual``: a
    low-rank read gate per feature and stream, a write gate per stream), its gates moved off their init. Padded
    path only."""

    name = "Encoder-gated-multi-residual"
    padded_only = True

    def config(self):
        return dict(super().config(), gated_multi_residual=True, num_residual_streams=2,
                    residual_fn_kwargs=dict(read_gate_rank=4))

    def make(self, backend="auto"):
        return _perturb_modules(super().make(backend), (sf.nn.block.GatedMultiResidual,))


CASES: list = [DecoderHyperCase(), EncoderLimeSkipsCase(), EncoderMVSplitCase(), EncoderOrthogResidualCase(),
               DecoderLayoutCase(), DecoderResidualGateCase(), DecoderShiftRepeatCase(), EncoderTiedShiftCase(),
               DecoderResidualAttnCase(), DecoderAggregatedResidualCase(), EncoderGatedMultiResidualCase()]
