"""Contract cases for x-transformers' attention-level options (Attention keywords).

Each case subclasses a case of ``models.py`` (imported from there at the end of that module) and joins its
``CASES``; a case that runs on the padded path only sets ``padded_only = True``.
"""

from __future__ import annotations

import torch
from torch import nn

import safeformer as sf

from .models import HEADS, CrossAttenderCase, DecoderCase, EncoderCase


def _perturb_positions(model: nn.Module, seed: int = 13) -> nn.Module:
    """CoPE's position embeddings start at zero; give them values, so that every contract test exercises them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, sf.Attention) and m.cope is not None:
                m.cope.pos_emb.copy_(0.5 * torch.randn(m.cope.pos_emb.shape, generator=g))
    return model


class DecoderScoringCase(DecoderCase):
    """``Decoder`` with cross-attention and x-transformers' scoring options together: l2-distance logits, cog
    attention (signed weights), multi-latent queries and keys/values in every attention (one key head from the input,
    the only head that rotary positions rotate), and in
    self-attention CoPE (contextual positions: masked keys count 0) and the relative projection bias (at the real
    tokens' positions), with projection biases. A padded key must count in no position, add no distance and reach
    no weight; a dropped context stays an exact no-op; the KV cache decodes as the full forward. The explicit
    float32 attention runs (no kernel), on the padded path only."""

    name = "Decoder-scoring"
    padded_only = True
    explicit_attention = True

    def config(self):
        return dict(super().config(), attn_l2_distance=True, attn_cog_signed=True, attn_use_latent_q=True, attn_dim_latent_q=12,
                    attn_use_latent_kv=True, attn_dim_latent_kv=10, attn_latent_rope_subheads=1, kv_heads=HEADS,
                    attn_use_cope=True, attn_cope_max_pos=3,
                    attn_use_rel_proj_pos_bias=True, attn_rel_proj_max_dist=3, attn_bias=True)

    def make(self, backend="auto"):
        return _perturb_positions(super().make(backend))


class CrossAttenderInvertedCase(CrossAttenderCase):
    """``CrossAttender`` with x-transformers' ``cross_attn_inverted_attention=(True, False)`` and
    ``cross_attn_sigmoid`` and LASER values (``attn_laser``): the first block's weights are normalised over the queries
    (padded queries take none), then L1 over each query's keys; a dropped context gives exact zeros (not
    ``log(0)``). No KV cache (refused), padded path only."""

    name = "CrossAttender-inverted"
    padded_only = True
    explicit_attention = True
    decodes = False

    def config(self):
        return dict(super().config(), cross_attn_inverted_attention=(True, False), cross_attn_sigmoid=True,
                    attn_laser=True, attn_laser_softclamp_value=4.0)


class EncoderL2Case(EncoderCase):
    """``Encoder`` with x-transformers' ``attn_l2_distance`` alone (and ALiBi, projection biases): the fused kernels
    run ``[2q, 1] . [k, -|k|^2]``, so a masked key's ``|k|^2`` must be selected away before it (NaN there reaches no
    gradient), and the kernel is not trusted at dead rows. Padded path only."""

    name = "Encoder-l2"
    padded_only = True

    def config(self):
        return dict(super().config(), attn_l2_distance=True, attn_bias=True)


class DecoderOutputProjectionCase(DecoderCase):
    """``Decoder`` with x-transformers' output-projection options: ``attn_on_attn`` (a GLU-gated ``to_out``, with
    biases: a dead row must still come out 0) and ``attn_value_dim_head`` (values 6 wide, queries and keys 8). Decodes
    with the dynamic KV cache (the static step refuses the value width); padded path only."""

    name = "Decoder-output-projection"
    padded_only = True

    def config(self):
        return dict(super().config(), attn_on_attn=True, attn_value_dim_head=6, attn_bias=True)


class EncoderSigmoidTalkingHeadsCase(EncoderCase):
    """``Encoder`` with the scoring part's options through the stack: sigmoid weights and talking heads after them
    (``attn_post_talking_heads``), and ``attn_attend_sdp_kwargs`` restricting the fused kernels (unused here: the
    explicit path runs)."""

    name = "Encoder-sigmoid-talking-heads"
    padded_only = True
    explicit_attention = True

    def config(self):
        return dict(super().config(), attn_sigmoid=True, attn_post_talking_heads=True,
                    attn_attend_sdp_kwargs=dict(enable_flash=False))


CASES: list = [DecoderScoringCase(), CrossAttenderInvertedCase(), EncoderL2Case(), DecoderOutputProjectionCase(),
               EncoderSigmoidTalkingHeadsCase()]
