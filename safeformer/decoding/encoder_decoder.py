"""``XTransformer``: an encoder-decoder whose decoder cross-attends to the encoder's output, with its
next-token loss, classifier-free-guidance training and guided generation.

Shape legend: b batch, j source positions, n target positions, c model width.
Masks: bool, True = real position (``masks.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.losses import next_token_loss
from ..core.masks import checked_once
from ..stack.layers import LAYER_ALIASES, MODULE_KWARGS, AttentionLayers, Decoder, Encoder, merge_module_kwargs
from ..stack.wrappers import TransformerWrapper, _check_tokens
from .generation import AutoregressiveWrapper, check_pad_value, generate_tokens

__all__ = ["XTransformer"]


# TransformerWrapper options a side of an XTransformer may set (the rest are layer options)
_WRAPPER_SIDE = ("emb_dropout", "use_abs_pos_emb", "num_memory_tokens", "l2norm_embed", "tie_embedding",
                 "tie_embedding_scale", "post_emb_norm", "scaled_sinu_pos_emb", "emb_frac_gradient")
_FIXED_SIDE = ("num_tokens", "max_seq_len", "attn_layers", "return_only_embed", "logits_dim", "causal",
               "cross_attend", "only_cross", "dim")


def _split_side_options(options: dict, prefix: str) -> tuple[dict, dict]:
    """One side's options split into layer options and wrapper options; unknown names are a TypeError."""
    import inspect

    layer_names = set(inspect.signature(AttentionLayers.__init__).parameters) | set(LAYER_ALIASES)
    layers, wrapper = {}, {}
    for name, value in options.items():
        if name in _FIXED_SIDE:
            raise TypeError(f"XTransformer: {prefix}{name} is set by XTransformer itself (see its arguments)")
        if name in _WRAPPER_SIDE:
            wrapper[name] = value
        elif name in layer_names and name not in ("self", "aliases"):
            layers[name] = value
        else:
            import difflib

            close = difflib.get_close_matches(name, sorted(layer_names | set(_WRAPPER_SIDE)), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise TypeError(f"XTransformer.__init__() got an unexpected keyword argument {prefix + name!r}{hint}")
    return layers, wrapper


def _route_options(enc_options, dec_options, aliases: dict, cross_attn_tokens_dropout) -> tuple[dict, dict]:
    """Each side's options: ``enc_options`` / ``dec_options`` with x-transformers' ``enc_<option>`` / ``dec_<option>``
    keywords (``aliases``) and ``cross_attn_tokens_dropout`` (the decoder's) added."""
    enc_options, dec_options = dict(enc_options or {}), dict(dec_options or {})
    for key, value in aliases.items():  # x-transformers' enc_<option> / dec_<option>
        side = enc_options if key.startswith("enc_") else dec_options if key.startswith("dec_") else None
        if side is None:
            raise TypeError(f"XTransformer.__init__() got an unexpected keyword argument {key!r} (per-side "
                            f"options are spelled enc_<option> / dec_<option>)")
        side[key[4:]] = value
    if cross_attn_tokens_dropout:  # x-transformers': the decoder drops encoder tokens it cross-attends to
        if "cross_attn_tokens_dropout" in dec_options:
            raise TypeError("XTransformer: cross_attn_tokens_dropout is given twice, as cross_attn_tokens_dropout "
                            "and as dec_cross_attn_tokens_dropout")
        dec_options["cross_attn_tokens_dropout"] = cross_attn_tokens_dropout
    return enc_options, dec_options


def _side_layer_options(shared: dict, own: dict, extra: dict) -> dict:
    """One side's layer options: the shared ones, the side's ``own``, then its ``extra`` options, each overriding the
    shared one of the same name (x-transformers' aliases translated, a module's keywords merged)."""
    out = {**shared, **own}
    for name, value in extra.items():  # a side's option overrides the shared one (aliases translated)
        target = LAYER_ALIASES.get(name, name)
        if target is None:
            continue
        updates = target(value) if callable(target) else {target: value}
        if "_unsupported" in updates:
            raise TypeError(f"XTransformer: x-transformers' option {updates['_unsupported']} is not supported")
        for key in MODULE_KWARGS:  # one keyword of each module: merged
            if key in updates:
                updates[key] = merge_module_kwargs("XTransformer", out.get(key), updates[key], key, name)
        out.update(updates)
    return out


class XTransformer(Configurable, nn.Module):
    """Encoder-decoder: ``model(src, tgt, mask=src_mask)`` returns the next-token loss on ``tgt``.

    Args:
        dim: model width of encoder and decoder.
        cross_attn_tokens_dropout: x-transformers' keyword: in training, the decoder's cross-attention reads a
            random ``1 - p`` share of each sample's encoder tokens (the decoder stack's ``cross_attn_tokens_dropout``;
            padded tokens are never read).
        enc_num_tokens, enc_max_seq_len, enc_depth, enc_heads: the encoder.
        dec_num_tokens, dec_max_seq_len, dec_depth, dec_heads: the decoder (cross-attends to the
            encoder's output).
        dim_head, kv_heads, rotary_pos_emb, ff_glu, use_rmsnorm, attn_dropout, ff_dropout: shared
            layer options (see ``AttentionLayers``).
        tie_token_emb: the decoder shares the encoder's token embedding (needs equal vocabularies).
        ignore_index: target value that does not count in the loss.
        pad_value: token used in place of ignored targets when they are fed back as inputs (and
            written after a sample's ``eos_token`` in ``generate``).
        cond_drop_prob: during training, each sample's encoder output is dropped (its source mask
            becomes all False: the empty context) with this probability, for classifier-free guidance.
        enc_options, dec_options: more options of one side, by name: any ``AttentionLayers`` option
            (or its x-transformers spelling, ``LAYER_ALIASES``) or ``TransformerWrapper`` option
            (``emb_dropout``, ``use_abs_pos_emb``, ``num_memory_tokens``, ``l2norm_embed``, ...).
            x-transformers' spelling ``enc_<option>=`` / ``dec_<option>=`` is accepted too
            (``enc_attn_flash=True``, ``dec_rotary_pos_emb=True``, ``enc_num_memory_tokens=4``) and lands
            here; an unknown option raises a ``TypeError`` naming it. A side option overrides the
            shared one of the same name.
    """

    def __init__(
        self,
        *,
        dim: int,
        enc_num_tokens: int,
        enc_max_seq_len: int,
        dec_num_tokens: int,
        dec_max_seq_len: int,
        enc_depth: int = 6,
        dec_depth: int = 6,
        enc_heads: int = 8,
        dec_heads: int = 8,
        dim_head: int = 64,
        kv_heads: int | None = None,
        rotary_pos_emb: bool = False,
        ff_glu: bool = False,
        use_rmsnorm: bool = False,
        attn_dropout: float = 0.0,
        ff_dropout: float = 0.0,
        tie_token_emb: bool = False,
        ignore_index: int = -100,
        pad_value: int = 0,
        cond_drop_prob: float = 0.0,
        enc_options: dict[str, Any] | None = None,
        dec_options: dict[str, Any] | None = None,
        cross_attn_tokens_dropout: float = 0.0,
        **aliases,
    ):
        enc_options, dec_options = _route_options(enc_options, dec_options, aliases, cross_attn_tokens_dropout)
        enc_layer, enc_wrap = _split_side_options(enc_options, "enc_")
        dec_layer, dec_wrap = _split_side_options(dec_options, "dec_")
        super().__init__()
        if isinstance(cond_drop_prob, bool) or not (isinstance(cond_drop_prob, (int, float)) and 0.0 <= cond_drop_prob <= 1.0):
            raise ValueError(f"cond_drop_prob must be in [0, 1], got {cond_drop_prob!r}")
        check_pad_value(pad_value)
        self._set_config(
            dim=dim, enc_num_tokens=enc_num_tokens, enc_max_seq_len=enc_max_seq_len, dec_num_tokens=dec_num_tokens,
            dec_max_seq_len=dec_max_seq_len, enc_depth=enc_depth, dec_depth=dec_depth, enc_heads=enc_heads,
            dec_heads=dec_heads, dim_head=dim_head, kv_heads=kv_heads, rotary_pos_emb=rotary_pos_emb, ff_glu=ff_glu,
            use_rmsnorm=use_rmsnorm, attn_dropout=attn_dropout, ff_dropout=ff_dropout, tie_token_emb=tie_token_emb,
            ignore_index=ignore_index, pad_value=pad_value, cond_drop_prob=cond_drop_prob,
            enc_options=enc_options or None, dec_options=dec_options or None,
        )
        shared = dict(dim=dim, dim_head=dim_head, kv_heads=kv_heads, rotary_pos_emb=rotary_pos_emb, ff_glu=ff_glu,
                      use_rmsnorm=use_rmsnorm, attn_dropout=attn_dropout, ff_dropout=ff_dropout)
        enc_layers = _side_layer_options(shared, dict(depth=enc_depth, heads=enc_heads), enc_layer)
        self.encoder = TransformerWrapper(num_tokens=enc_num_tokens, max_seq_len=enc_max_seq_len,
                                          attn_layers=Encoder(**enc_layers), return_only_embed=True, **enc_wrap)
        dec_layers = _side_layer_options(shared, dict(depth=dec_depth, heads=dec_heads, cross_attend=True), dec_layer)
        net = TransformerWrapper(num_tokens=dec_num_tokens, max_seq_len=dec_max_seq_len,
                                 attn_layers=Decoder(**dec_layers), **dec_wrap)
        if tie_token_emb:
            if enc_num_tokens != dec_num_tokens:
                raise ValueError("tie_token_emb=True needs enc_num_tokens == dec_num_tokens")
            net.token_emb = self.encoder.token_emb
        # x-transformers' tree: the decoder is an AutoregressiveWrapper around the net (keys decoder.net.*)
        self.decoder = AutoregressiveWrapper(net, ignore_index=ignore_index, pad_value=pad_value)
        self._register_load_state_dict_pre_hook(_legacy_decoder_keys)
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self.cond_drop_prob = float(cond_drop_prob)

    def encode(self, src: Tensor, mask: Tensor | None = None, *, src_prepend_embeds: Tensor | None = None,
               src_prepend_mask: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """Encoder hidden states ``(b, j, c)`` of ``src (b, j)`` (``(b, m + j, c)`` after a prefix of
        embeddings ``src_prepend_embeds (b, m, c)``, x-transformers' name, e.g. image features); ``attn_mask``:
        the encoder's self-attention mask, as in ``forward``."""
        return self._source(src, mask, src_prepend_embeds, src_prepend_mask, attn_mask)[0]

    def _source(self, src, mask, src_prepend_embeds, src_prepend_mask,
                attn_mask=None) -> tuple[Tensor, Tensor | None]:
        """The encoding and its mask (the prefix's rows first)."""
        enc = self.encoder(src, mask=mask, attn_mask=attn_mask, return_embeddings=True,
                           prepend_embeds=src_prepend_embeds, prepend_mask=src_prepend_mask)
        if src_prepend_embeds is not None and (mask is not None or src_prepend_mask is not None):
            b, m = src_prepend_embeds.shape[:2]
            ones = lambda k: torch.ones(b, k, dtype=torch.bool, device=enc.device)  # noqa: E731
            mask = torch.cat((ones(m) if src_prepend_mask is None else src_prepend_mask,
                              ones(src.shape[1]) if mask is None else mask), dim=1)
        return enc, mask

    @checked_once
    def forward(self, src: Tensor, tgt: Tensor, mask: Tensor | None = None, attn_mask: Tensor | None = None,
                src_prepend_embeds: Tensor | None = None, *, tgt_mask: Tensor | None = None,
                src_prepend_mask: Tensor | None = None) -> Tensor:
        """Next-token cross-entropy of ``tgt (b, n)`` given ``src (b, j)``.

        Args:
            src: source token ids.
            tgt: target token ids; positions equal to ``ignore_index`` (or False in ``tgt_mask``) do not
                count. A batch with no counted target gives a loss of exactly 0 with zero gradient (S8).
            mask: ``(b, j)`` source padding mask (True = real). An all-False row or ``j == 0`` is an
                empty source: the decoder runs unconditioned for that sample. In training mode each
                sample's source is dropped this way with probability ``cond_drop_prob``.
            attn_mask: x-transformers' keyword: the encoder's self-attention mask (True = query i may attend to
                key j), ``(j, j)``, ``(b, j, j)`` or ``(b|1, heads|1, j, j)`` (the encoder ``TransformerWrapper``'s
                ``attn_mask``; a 3-d mask is per sample there, where x-transformers reads ``(heads, j, j)``),
                combined with ``mask``. A real source position left with no key to attend to
                gets exactly 0 from its attention (not NaN, not a mean over padding). Not with
                ``src_prepend_embeds`` (it covers the source tokens only).
            tgt_mask: ``(b, n)`` target padding mask (True = real).
            src_prepend_embeds: ``(b, m, dim)`` embeddings placed before the source tokens in the encoder
                (x-transformers' name; PaLI-style image features); ``src_prepend_mask (b, m)`` marks
                padded prefix rows.
        """
        _check_tokens(src, "src")
        enc, mask = self._source(src, mask, src_prepend_embeds, src_prepend_mask, attn_mask)
        context_mask = mask
        if self.training and self.cond_drop_prob > 0:
            b, j = enc.shape[:2]
            keep = torch.rand(b, device=enc.device) >= self.cond_drop_prob  # (b,)
            context_mask = keep[:, None].expand(b, j) if mask is None else mask & keep[:, None]
        return next_token_loss(self.decoder.net, tgt, tgt_mask, self.ignore_index, self.pad_value,
                                name="tgt", mask_name="tgt_mask", context=enc, context_mask=context_mask)

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        start_tokens: Tensor,
        seq_len: int,
        *,
        mask: Tensor | None = None,
        start_mask: Tensor | None = None,
        cond_scale: float = 1.0,
        negative_src: Tensor | None = None,
        negative_mask: Tensor | None = None,
        src_prepend_embeds: Tensor | None = None,
        src_prepend_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        **options,
    ) -> Tensor:
        """Generate ``seq_len`` target tokens after ``start_tokens (b, n)`` given ``src (b, j)``.

        Args:
            src: source token ids.
            start_tokens: the decoder's prompt (e.g. a start token, ``(b, 1)``).
            seq_len: how many tokens to generate.
            mask: ``(b, j)`` source padding mask (True = real).
            start_mask: ``(b, n)`` padding mask of ``start_tokens`` (left padding).
            cond_scale: classifier-free guidance scale; 1.0 runs the conditional branch only.
                The unconditional branch sees the empty source (all-False mask), or ``negative_src``.
            negative_src, negative_mask: source token ids ``(b, j')`` or ``(1, j')`` (and mask) whose
                encoding is the unconditional branch's context.
            src_prepend_embeds, src_prepend_mask: a prefix of the source, as in ``forward``.
            attn_mask: the encoder's self-attention mask on ``src``, as in ``forward`` (x-transformers' keyword;
                ``negative_src`` is encoded without it).
            **options: as in ``AutoregressiveWrapper.generate``: ``temperature``, ``filter_logits_fn``,
                ``filter_kwargs``, ``eos_token``, ``cache_kv``, ``guidance_rescale``.

        Returns:
            ``(b, seq_len)`` new target token ids.
        """
        if negative_mask is not None and negative_src is None:
            raise ValueError("negative_mask was given without negative_src")
        was_training = self.training
        self.eval()
        try:
            enc, mask = self._source(src, mask, src_prepend_embeds, src_prepend_mask, attn_mask)
            uncond, uncond_mask = None, None
            if negative_src is not None and cond_scale != 1.0:
                uncond, uncond_mask = self.encode(negative_src, negative_mask), negative_mask
                if uncond.shape[0] == 1 and enc.shape[0] != 1:  # one negative source for the whole batch
                    uncond = uncond.expand(enc.shape[0], -1, -1)
                    uncond_mask = None if uncond_mask is None else uncond_mask.expand(enc.shape[0], -1)
            return generate_tokens(
                self.decoder.net, start_tokens, seq_len, mask=start_mask, context=enc, context_mask=mask,
                negative_context=uncond, negative_context_mask=uncond_mask, cond_scale=cond_scale,
                pad_value=self.pad_value, **options,
            )
        finally:
            self.train(was_training)


def _legacy_decoder_keys(state_dict, prefix, *_args) -> None:
    """Earlier safeformer's ``XTransformer.decoder`` was the ``TransformerWrapper`` itself: its keys move under
    ``decoder.net`` (x-transformers' ``AutoregressiveWrapper``)."""
    for key in [k for k in state_dict if k.startswith(prefix + "decoder.") and not k.startswith(prefix + "decoder.net.")]:
        state_dict[prefix + "decoder.net." + key[len(prefix + "decoder."):]] = state_dict.pop(key)
