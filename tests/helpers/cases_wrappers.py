"""Contract cases for x-transformers' options of ``TransformerWrapper`` itself (tests/test_xt_wrappers_more.py
holds their named tests).

Each case subclasses a case of ``models.py`` (imported from there at the end of that module) and joins its
``CASES``; a case that runs on the padded path only sets ``padded_only = True``.
"""

from __future__ import annotations

import torch

import safeformer as sf
from safeformer.stack.wrappers import intersperse_layout

from .masks import ctx_dead
from .models import CTX_DIM, DIM, DIM_HEAD, HEADS, MAX_SEQ, VOCAB, TransformerWrapperCase


class DeepEmbedWrapperCase(TransformerWrapperCase):
    """``TransformerWrapper(ff_deep_embed=True)`` over a cross-attending ``Decoder``: every feed-forward block's
    output is scaled per position by its token's row of a learned table (moved off its init of ones, so the
    contract tests exercise it); garbage ids at padded positions must never be looked up. Padded path only;
    decodes on the dynamic path (no static step)."""

    name = "TransformerWrapper-ff-deep-embed"
    padded_only = True

    def make(self, backend="auto"):
        model = sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ, ff_deep_embed=True,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, backend=backend),
        )
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            model.ff_deep_embed.add_(0.5 * torch.randn(model.ff_deep_embed.shape, generator=g))
        return model


class LoopedWrapperCase(TransformerWrapperCase):
    """``TransformerWrapper(looped=True)`` (x-transformers' looped LM) over a cross-attending ``Decoder`` with
    ``pre_and_post_norm``: the stack runs three times, each run on the previous run's output, so padded rows (exact
    zeros after a run) must stay padding in the next run, and NaN planted there must reach nothing in any run.
    Padded path only; decodes on the dynamic path (no static step)."""

    name = "TransformerWrapper-looped"
    padded_only = True

    def make(self, backend="auto"):
        return sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ, looped=True, max_looped_steps=3,
            attn_layers=sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, pre_and_post_norm=True, backend=backend),
        )


class EmbDimWrapperCase(TransformerWrapperCase):
    """``TransformerWrapper(emb_dim=24)`` (embeddings of another width, projected with a bias) with
    ``sigsoftmax_logits`` over a cross-attending ``Decoder``: the projection's bias must not make
    padded rows reach anything, and sigsoftmax must keep padded logits at exactly 0. Decodes on the dynamic path
    (no static step)."""

    name = "TransformerWrapper-emb-dim"

    def make(self, backend="auto"):
        return sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ, emb_dim=24, sigsoftmax_logits=True,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, backend=backend),
        )


class InterspersedMemoryWrapperCase(TransformerWrapperCase):
    """``TransformerWrapper(num_memory_tokens=2, memory_tokens_interspersed_every=2)`` over a cross-attending
    rotary ``Decoder``: two memory rows before every segment of two real tokens, counted per sample, so a padded
    sample keeps its layout alone; padded rows before a sample's first memory row are dead (no key), an all-padding
    sample has no memory row at all. No KV cache (refused): no decoding."""

    name = "TransformerWrapper-interspersed-memory"
    decodes = False
    M, E = 2, 2

    def make(self, backend="auto"):
        return sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ, num_memory_tokens=self.M, memory_tokens_interspersed_every=self.E,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, rotary_pos_emb=True, backend=backend),
        )

    def _rows(self, sc):
        return intersperse_layout(sc.seq_mask, sc.b, sc.n, self.E, self.M, sc.seq_mask.device)[4]  # (b, N)

    def key_len(self, sc, role):
        return sc.j if role.endswith("cross") else self._rows(sc).shape[1]

    def dead(self, sc):
        rows = self._rows(sc)
        return {"main.self": rows.long().cumsum(1) == 0, "main.cross": ctx_dead(sc.ctx_mask, rows.shape[1])}


CASES = [DeepEmbedWrapperCase(), LoopedWrapperCase(), EmbDimWrapperCase(), InterspersedMemoryWrapperCase()]


class ScaledSinusoidWrapperCase(TransformerWrapperCase):
    """``TransformerWrapper(scaled_sinu_pos_emb=True)``: x-transformers' scaled sinusoidal positions (a learned
    scale), counted over real tokens only, so left padding shifts no real position."""

    name = "TransformerWrapper-scaled-sinu"

    def make(self, backend="auto"):
        model = sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ, scaled_sinu_pos_emb=True,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, backend=backend),
        )
        with torch.no_grad():
            model.pos_emb.scale.fill_(0.7)
        return model


CASES += [ScaledSinusoidWrapperCase()]
