"""Contract cases for x-transformers' options of the shared modules (norms, feed-forwards, positions).

Each case subclasses a case of ``models.py`` (imported from there at the end of that module) and joins its
``CASES``; a case that runs on the padded path only sets ``padded_only = True``.
"""

from __future__ import annotations

CASES: list = []

import torch  # noqa: E402
from torch import nn  # noqa: E402

from .models import DIM, DIM_HEAD, HEADS, DecoderCase, EncoderCase, _no_dead  # noqa: E402


class DecoderHybridCase(DecoderCase):
    """``Decoder`` with x-transformers' ``attn_hybrid_module`` (a GRU beside every self-attention) and
    biases: the GRU must read each sample's real tokens only (left padding included, its state carried in the
    KV cache), so padded positions reach no real one and NaN planted there reaches nothing. Padded path only."""

    name = "Decoder-hybrid"
    has_context = False
    padded_only = True

    def config(self):
        return dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True, attn_bias=True,
                    attn_hybrid_module=nn.GRU(DIM, HEADS * DIM_HEAD, batch_first=True))


class EncoderHybridCase(EncoderCase):
    """``Encoder`` with a bidirectional GRU folded in two (``attn_hybrid_fold_axial_dim=2``): each direction
    starts and stops at the sample's own real ends. Padded path only."""

    name = "Encoder-hybrid"
    padded_only = True

    def config(self):
        return dict(super().config(), attn_hybrid_fold_axial_dim=2,
                    attn_hybrid_module=nn.GRU(DIM, HEADS * DIM_HEAD // 2, batch_first=True, bidirectional=True))


CASES += [DecoderHybridCase(), EncoderHybridCase()]


class DecoderPolarAlibiCase(DecoderCase):
    """``Decoder`` with PoPE (``polar_pos_emb``, keys of ``2 d`` features in the cache) and ALiBi on one head of two
    with a custom slope (``alibi_num_heads``, ``rel_pos_kwargs``), ``Derf`` norms and a custom feed-forward
    activation: positions count real tokens (left padding shifts nothing), cached decoding continues them. Padded
    path only."""

    name = "Decoder-polar-alibi"
    has_context = False
    padded_only = True

    def make(self, backend="auto"):
        model = super().make(backend)
        with torch.no_grad():  # q/k projections large enough that softplus is in its linear regime: logits then
            for blk in model.layers:  # grow as the square of the q/k scale (what the half-precision test assumes)
                if blk.kind == "self":
                    blk.mixer.to_q.weight.mul_(6.0)
                    blk.mixer.to_k.weight.mul_(6.0)
        return model

    def config(self):
        return dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, polar_pos_emb=True, polar_bias_uniform_init=True,
                    alibi_pos_bias=True, alibi_num_heads=1, rel_pos_kwargs=dict(slopes=[0.3]), use_derf=True,
                    ff_custom_activation=nn.Tanh())


class DecoderXposCase(DecoderCase):
    """``Decoder`` with rotary xpos (queries and keys scaled in opposite directions around the middle of each
    sample's positions) and situ-GLU: no KV cache (refused), padded path only."""

    name = "Decoder-xpos"
    has_context = False
    decodes = False
    padded_only = True

    def config(self):
        return dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True, rotary_xpos=True,
                    rotary_xpos_scale_base=8, ff_glu=True, ff_glu_softclamp=True)


CASES += [DecoderPolarAlibiCase(), DecoderXposCase()]


class DecoderT5RelPosCase(DecoderCase):
    """``Decoder`` with T5's relative position bias (``rel_pos_bias``, biases moved off zero) instead of ALiBi:
    the bias is read from the real tokens' positions, so left padding shifts nothing, cached decoding continues
    the positions, and the unpadded rerun packs the same biases per sample."""

    name = "Decoder-t5-relpos"

    def make(self, backend="auto"):
        model = super().make(backend)
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            w = model.rel_pos.relative_attention_bias.weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.1)
        return model

    def config(self):
        return dict(super().config(), alibi_pos_bias=False, rel_pos_bias=True, rel_pos_num_buckets=8,
                    rel_pos_max_distance=16)


CASES += [DecoderT5RelPosCase()]


def _perturb_ff_gains(model: nn.Module) -> nn.Module:
    """Move the feed-forwards' learned gains (GLU ``mult_bias``, SoLU and post-activation norms) and ScaleNorm
    gains off their init of ones, so the contract tests exercise them."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mult_bias", "solu_norm", "post_act_norm", "head_scale_params")) or name.endswith(".g"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


class DecoderXtFeedForwardCase(DecoderCase):
    """``Decoder`` with x-transformers' feed-forward and norm keywords: SoLU with a post-activation LayerNorm,
    no biases (``ff_no_bias``) and ScaleNorm for every norm. The SoLU softmax runs over hidden features, never
    positions: padded rows must stay out of every real output and gradient. With x-transformers' per-head gains
    (``attn_head_scale``) on every attention."""

    name = "Decoder-xt-feedforward"

    def config(self):
        return dict(super().config(), ff_glu=False, ff_solu=True, ff_post_act_ln=True, ff_no_bias=True,
                    use_scalenorm=True, attn_head_scale=True)

    def make(self, backend="auto"):
        return _perturb_ff_gains(super().make(backend))


class EncoderXtGluCase(EncoderCase):
    """``Encoder`` with a gated ReLU-squared feed-forward with a learned gain (``ff_glu_mult_bias``), no biases,
    x-transformers' parameter-free ``SimpleRMSNorm`` and sparse top-2 attention (``attn_sparse_topk``: rows with
    fewer live keys keep them all; masked keys never enter the top)."""

    name = "Encoder-xt-glu"
    padded_only = True  # sparse top-k attention runs the explicit float32 path
    explicit_attention = True  # no kernel call: the kernel-substitution clauses (S6, S7's scaling) do not apply

    def config(self):
        return dict(super().config(), ff_glu=True, ff_relu_squared=True, ff_glu_mult_bias=True, ff_no_bias=True,
                    use_rmsnorm=False, use_simple_rmsnorm=True, attn_sparse_topk=2)

    def make(self, backend="auto"):
        return _perturb_ff_gains(super().make(backend))


CASES += [DecoderXtFeedForwardCase(), EncoderXtGluCase()]


class DecoderXtHardCase(DecoderCase):
    """``Decoder`` with x-transformers' hard attention (``attn_hard``: the one-hot of the largest live logit
    forward, the softmax's gradient backward) and talking heads before and after the softmax (moved off their
    identity init) in self- and cross-attention, and rotary positions on the last head only (``rotate_num_heads``):
    a masked key must never be the largest nor be mixed into a live weight, a dropped context stays an exact no-op.
    The explicit float32 path, padded path only."""

    name = "Decoder-xt-hard"
    padded_only = True
    explicit_attention = True

    def config(self):
        return dict(super().config(), attn_hard=True, attn_pre_talking_heads=True, attn_post_talking_heads=True,
                    kv_heads=HEADS, rotate_num_heads=1)

    def make(self, backend="auto"):
        model = super().make(backend)
        g = torch.Generator().manual_seed(13)
        with torch.no_grad():  # the talking heads off their identity init, so the contract tests exercise them
            for name, p in model.named_parameters():
                if "talking_heads" in name:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        return model


CASES += [DecoderXtHardCase()]


class DecoderDynamicPosBiasCase(DecoderCase):
    """``Decoder`` with x-transformers' dynamic position bias (``dynamic_pos_bias``, log distances, a norm in the
    MLP) instead of rotary positions: distances count real tokens, so left padding shifts no bias; the KV cache
    decodes as the full forward (on the dynamic path). With x-transformers' zero key/value (``attn_add_zero_kv``) in
    every attention: a query with no other key (a dropped context) outputs exactly 0."""

    name = "Decoder-dynamic-pos-bias"
    padded_only = True  # the zero key is an extra key: the padded path

    def dead(self, sc):  # every query sees the zero key: no row is dead to a kernel
        return {"main.self": _no_dead(sc, sc.n), "main.cross": _no_dead(sc, sc.n)}

    def config(self):
        return dict(super().config(), rotary_pos_emb=False, dynamic_pos_bias=True, dynamic_pos_bias_log_distance=True,
                    dynamic_pos_bias_norm=True, attn_add_zero_kv=True)


CASES += [DecoderDynamicPosBiasCase()]
