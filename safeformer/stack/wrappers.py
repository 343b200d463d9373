"""Wrappers: ``TransformerWrapper`` (tokens in, logits out) and ``ContinuousTransformerWrapper``
(vectors in and out). The encoder-decoder ``XTransformer`` builds on generation: ``encoder_decoder.py``.

Shape legend: b batch, n positions, j context length, c model width, v vocabulary size.
Masks: bool, True = real position / may attend (``masks.py``).

``TransformerWrapper``'s keywords (x-transformers' names; ``wrapper_options.py`` builds the model by option
family and ``wrapper_forward.py`` runs ``forward`` in phases):

Args:
    num_tokens: vocabulary size v.
    max_seq_len: longest sequence (for the absolute position embedding).
    attn_layers: an ``Encoder``, ``Decoder``, ``CrossAttender`` or ``AttentionLayers``.
    emb_dropout: dropout on the embeddings.
    post_emb_norm: x-transformers' ``LayerNorm(emb_dim)`` (``post_emb_norm.gamma``) of the tokens' summed embeddings
        (token, absolute position, further and summed embeddings), before the prefix rows join.
    emb_frac_gradient: x-transformers' option (CogView, GLM-130B: 0.1): the fraction in ``(0, 1]`` of the gradient
        that flows back into the embeddings (after ``post_emb_norm``, prefix rows included; memory and class tokens
        not): the forward is unchanged (exactly), the gradient there is multiplied by it. x-transformers ignores a
        value above 1; safeformer refuses it, like one at or below 0.
    use_abs_pos_emb: learned absolute positions (skipped when the stack's ``disable_abs_pos_emb`` is set: by
        default with rotary, PoPE or T5's relative bias, as in x-transformers; ALiBi keeps them).
    tie_embedding: the output projection shares the token embedding's weights.
    return_only_embed: no output projection: the model returns hidden states (an encoder).
    logits_dim: output size (default ``num_tokens``).
    tie_embedding_scale: with ``tie_embedding``, logits are ``h @ E.T * tie_embedding_scale``
        (default ``dim ** -0.5``, as x-transformers'; checkpoints of earlier safeformer, whose default was 1, load
        with 1).
    num_memory_tokens: learned memory (register) tokens placed before the sequence on the call that
        starts it: every position may attend to them; they take no absolute position and are cut
        from the output (``LayerIntermediates.memory_tokens`` holds theirs).
    l2norm_embed: L2-normalise the token (and absolute position) embeddings, initialised with std
        1e-5 (x-transformers' ``l2norm_embed``).
    average_pool_embed: the output is the masked mean over real positions, projected by the head:
        ``(b, logits_dim)`` (a fully padded sample pools to 0, never NaN).
    use_cls_token: learned class token(s) before the sequence (after the memory tokens); the output
        is theirs: ``(b, logits_dim)`` for one, ``(b, num_cls_tokens, logits_dim)`` for several.
    num_cls_tokens: how many class tokens.
    check_finite: by default, check that real positions of float inputs (``context``) are finite
        and raise ``ValueError`` naming the argument otherwise (S9); costs a device sync.
    attn_pool: x-transformers' attention pooling: ``num_pooled_tokens`` learned queries of width
        ``dim_pooled_tokens`` (default ``dim``) attend over the real positions of the last hidden states
        (``AttentionPool`` with the stack's heads and head width; ``attn_pool_depth > 1``: a ``CrossAttender``
        of that depth). An encoder returns the pooled tokens ``(b, num_pooled_tokens, dim_pooled_tokens)``
        instead of the logits (these go on the intermediates as ``logits``); a decoder returns its logits and
        pools only when the intermediates are asked for. Either way the intermediates carry
        ``attn_pooled_tokens``. Padded positions are never pooled; a sample with no real position pools to 0
        (depth 1) or to its queries' stack output (depth > 1). Not with ``use_cls_token``,
        ``average_pool_embed`` or a KV cache.
    num_pooled_tokens, attn_pool_depth, dim_pooled_tokens: see ``attn_pool``.
    ff_deep_embed: x-transformers' deep embeddings: a learned ``(num_tokens, L, dim)`` table (ones at init,
        ``L`` the feed-forward blocks); each feed-forward block's output at a position is multiplied by that
        token's row for the block. Runs the padded path; the static decode step is not used.
    looped: x-transformers' looped LM (recurrent depth): the stack runs ``max_looped_steps`` times (``forward``'s
        ``looped_steps`` / ``max_looped_steps`` override it), each run reading the previous run's output (the
        embeddings enter once); an ``exit_gate`` (``nn.Linear(dim, 1)``) scores each position after each run
        (the intermediates' ``exit_logits``), which ``AutoregressiveWrapper`` trains and which
        ``looped_inference`` reads to stop early. Needs ``attn_layers`` built with ``pre_and_post_norm=True``
        (x-transformers' rule); not with ``recycling``. Padded positions stay padding in every run. Runs the
        padded path; generation decodes on the static step with the call's loop settings
        (``build_static_cache(loop=)``).
    max_looped_steps: the runs of a looped stack (training and by default).
    embed_num_tokens: x-transformers' further embeddings ``{name: vocabulary size}`` (e.g. a BERT-style type
        embedding): ``embeds[f"{name}_embed"]``, each added per position from ``forward(embed_ids={name: ids})``.
    emb_dim: the width of the token (and absolute position) embeddings, when not the model width: they are summed
        at ``emb_dim`` and projected by ``project_emb`` (``nn.Linear(emb_dim, dim)``, with a bias); memory and class
        rows join after it. Not with ``tie_embedding``, ``recycling`` or ``prepend_embeds``; the static decode step
        is not used.
    num_output_heads: x-transformers' several output heads: ``to_logits`` is an ``nn.ModuleList`` of that many
        ``nn.Linear(dim, logits_dim)`` and the logits are a tuple, one per head (padded rows 0 in each). Not with
        ``tie_embedding``, ``to_logits``, ``mixture_of_softmax`` or ``return_only_embed``; not trained or sampled by
        ``AutoregressiveWrapper`` (one head).
    sigsoftmax_logits: the logits are ``z + log(sigmoid(z))`` (computed as ``logsigmoid``: finite for every finite
        ``z``), so their softmax is the sigsoftmax (x-transformers' option); padded rows stay 0. The static decode
        step is not used.
    attn_z_loss_weight: the default weight of ``forward(return_attn_z_loss=True)``'s z-loss (x-transformers takes
        this keyword but uses its forward's default 1e-4 only).
    memory_tokens_interspersed_every: with ``num_memory_tokens``, a ``Decoder`` only: the memory tokens are placed
        before every segment of this many real tokens instead of once before the sequence (x-transformers' option);
        segments count each sample's real tokens, so padding never moves them (x-transformers counts slots). No KV
        cache (generation re-encodes each step), no ``prepend_embeds``, ``pos``, ``attn_mask``, ``ff_deep_embed``,
        ``looped`` or ``use_cls_token``; the intermediates' ``memory_tokens`` is ``(b * S, M, c)`` for ``S`` blocks.
    max_mem_len: Transformer-XL: the most memory positions ``forward(return_mems=True)`` keeps per self-attention
        block (x-transformers' option; 0 keeps none). See ``forward(mems=...)``.
    shift_mem_down: x-transformers' option: the memories passed in are rotated by this many blocks first (the first
        ``shift_mem_down`` blocks' memories go to the last blocks).

``TransformerWrapper.forward``'s keywords:

Args:
    x: ``(b, n)`` token ids. Ids at padded positions are never looked up (any value is fine).
    mask: ``(b, n)`` bool padding mask, True = real token.
    context: ``(b, j, c_ctx)`` for cross-attention (``j`` may be 0), or ``None``.
    context_mask: ``(b, j)`` bool; an all-False row drops that sample's condition exactly.
    attn_mask: extra self-attention mask ``(b, n, n)`` / ``(n, n)`` (True = may attend).
    return_embeddings: return hidden states ``(b, n, c)`` instead of logits.
    return_pooled: return the mean of hidden states over real positions, ``(b, c)``; a fully
        padded sample gives 0, not NaN (S8).
    cache: a ``KVCache`` from an earlier call; ``x`` holds only the new tokens. Or (x-transformers'
        protocol) the ``LayerIntermediates`` of an earlier ``return_intermediates=True`` call: ``x`` (and
        ``mask``, ``pos``) then holds the whole sequence so far or only the new tokens, the last
        ``cache_age`` (default 1) being new; only those are computed and returned.
    return_cache: also return the updated ``KVCache``.
    check_finite: override the model's ``check_finite`` for this call.
    prepend_embeds: ``(b, m, dim)`` a prefix of embeddings placed before the tokens (prefix
        conditioning, as in x-transformers). Only on a call without a cache.
    prepend_mask: ``(b, m)`` bool, True = real prefix row. Masked rows are padding: selected
        away, not counted in positions, so an all-False row is exactly no prefix and a padded
        prefix equals the shorter prefix alone.
    excise_prepend_embeds: return outputs for the tokens only, ``(b, n, ...)``; by default
        the prefix positions come first, ``(b, m + n, ...)`` (padded prefix rows are 0).
    condition, condition_mask: the adaptive-norm condition ``(b, K)`` and which samples keep
        it ``(b,)`` (see ``AttentionLayers.forward``).
    pos: ``(n,)`` or ``(b, n)`` integer positions of the tokens, for the absolute embedding and
        for rotary / ALiBi (x-transformers' ``pos``); by default real tokens are counted.
    seq_start_pos: ``(b,)`` where each sample starts (x-transformers' ``seq_start_pos``): the
        positions before it are left padding (combined with ``mask``), whatever they hold.
    return_intermediates: also return a ``LayerIntermediates`` (hidden states entering each
        layer, attention weights of every attention block, memory tokens' outputs). Runs the
        explicit attention path (float32 weights, ``(b, h, i, j)`` memory).
    return_attn: also return the list of attention weights ``(b, h, i, j)`` (float32; padded
        queries, dead rows and masked keys exactly 0).
    return_hiddens: the same as ``return_intermediates``.
    token_emb_kwargs, to_logits_kwargs: keywords for a custom ``token_emb`` / ``to_logits`` module.
    return_next_embed_pred: with ``add_continuous_pred_head``, return ``(out, (next_embed_pred,
        initial_embeds))``: the head's prediction of the next position's embedding ``(b, n, c)`` and
        the embeddings entering the stack (x-transformers' ``init_embed``; padded rows 0).
    recycle_steps: with ``recycling``, how many times the stack runs (default: a random number in
        ``[1, train_max_recycle_steps]`` in training; needed in eval mode).
    input_not_include_cache: with a ``LayerIntermediates`` cache, ``x`` holds only the new positions
        (all of them new; x-transformers' option); default the model's ``input_not_include_cache``.
    causal: override the stack's causality for this call (x-transformers' ``forward(causal=...)``, e.g.
        ``causal=False`` on a ``Decoder``); runs the padded path, not with a KV cache, and the intermediates
        of such a call carry no cache.
    self_attn_additional_kv, additional_kv_mask, detach_additional_kv, route_additional_kv_to_top:
        x-transformers' extra keys/values for the self-attention blocks (a list of ``(k, v)`` per block, or
        another model's ``LayerIntermediates``) and their padding mask ``(b, a)``; see
        ``AttentionLayers.forward``. Padded path only; not with ``recycling``; the cache does not keep
        them (pass them on every call).
    looped_steps: a ``looped`` model's runs of the stack for this call, fixed (no early exit).
    max_looped_steps: the most runs (default the model's ``max_looped_steps``); ``looped_steps`` wins.
    looped_pred_all_logits: put each run's logits on the intermediates (``all_pred_logits``); default: in
        training mode.
    looped_inference: x-transformers' looped inference: a prompt (no cache, several tokens) runs every step and
        its cache keeps each run's keys/values (a later position's run ``i`` reads the prompt's run ``i``); one
        new position (with a cache, or alone) stops once its cumulative exit probability reaches
        ``looped_exit_prob_threshold``, per sample (x-transformers: batch size 1 only). The intermediates'
        ``exit_indices (b, t)`` say where each call stopped.
    looped_exit_prob_threshold: see ``looped_inference``.
    return_logits_and_embeddings: return ``(logits, embeddings)``: the logits and what ``return_embeddings``
        returns (x-transformers' option).
    return_embeddings_and_intermediates: return ``(embeddings, intermediates)``.
    return_logit_entropies: put the entropy of each position's softmax on the intermediates
        (``logit_entropies (b, n)``, float32; padded positions 0) and return the intermediates.
    sum_embeds: ``(b, n, emb_dim)`` added to the token embeddings (x-transformers' self-conditioning input);
        padded positions are selected away (any value there, NaN included, reaches nothing).
    embed_ids: ``{name: (b, n) ids}`` for the further embeddings of ``embed_num_tokens`` (every name, each
        added); ids at padded positions are never looked up.
    return_attn_z_loss: put x-transformers' z-loss of the attention logits on the intermediates
        (``attn_z_loss``) and return them: ``weight * mean over real query rows of sum over heads of
        (sum over attention blocks of logsumexp over the keys)^2``. Masked keys are left out of each
        logsumexp, and rows with no key (padded queries, dead rows) add 0. Runs the explicit attention path.
    attn_z_loss_weight: its weight (default the model's ``attn_z_loss_weight``, 1e-4).
    mems: Transformer-XL memories (x-transformers' keyword): one ``(b, m, c)`` tensor per self-attention block,
        as ``return_mems=True`` returned them for the previous segment; each self-attention also attends to its
        block's memory (keys at positions ``-m .. -1``; the tokens' absolute positions start at 0 again).
        ``mem_masks``: their padding (``(b, m)`` bool per block, or one for all; True = real); a ``Mems`` list
        from ``return_mems`` carries its own (the previous segment's padding), so padded positions never
        become memory a real query sees. ``shift_mem_down`` (constructor) rotates the list first.
    return_mems: also return the new memories, a ``Mems`` list (one ``(b, <= max_mem_len, c)`` per self-attention
        block: the old memory then the stream entering the block, the last ``max_mem_len`` positions; its
        ``masks`` attribute holds their padding, or ``None``): ``(out, mems)``, or on the intermediates
        (``mems``, ``mem_masks``) with ``return_intermediates``. ``detach_mems`` (default True): no gradient
        flows back through them. Memories run the padded path, and not with a KV cache, prepend_embeds,
        memory / class tokens, recycling or a looped model.
    transform_token_embeds: a callable ``(b, n, emb_dim) -> (b, n, emb_dim)`` applied to the token embeddings
        (before the absolute positions and further embeddings are added); padded rows of its result are 0.
    transform_block_inputs: x-transformers' hook per depth: a callable ``(depth, x) -> x`` or a dict ``{depth:
        x -> x}``. Depth 1 is the token embeddings (as ``transform_token_embeds``, which wins when both are
        given); depths 2, 3, ... the stream entering each later layer of the stack (``AttentionLayers.forward``;
        memory, class and prefix rows included, as there). The hook sees padded positions as exact zeros and
        what it writes there reaches nothing. Padded path.
    rotary_pos_emb, in_attn_cond: handed to the stack (``AttentionLayers.forward``'s, x-transformers' ``**kwargs``
        of the wrapper): given rotary angles for every self-attention (covering the memory, class and prefix rows
        too), an in-attention condition. Padded path.
    return_gumbel_log_probs: x-transformers' stack keyword: each attention intermediate gets ``log_probs (b, h, i)``,
        the log probability of the key each query picked (meant for ``attn_gumbel_softmax``; padded queries and
        dead rows 0). As in x-transformers the return form does not change: they are read from the intermediates
        (``return_intermediates=True``). A non-bool is a ``TypeError``.
    self_attn_kv_mask, context_pos, attn_bias, layers_execute_order, repeat_blocks, self_attn_kv_residuals,
        cross_attn_kv_residuals, flash_pack_seq_kwargs: further ``AttentionLayers.forward`` keywords that
        x-transformers' wrapper hands on through ``**kwargs``, handed on as given (see ``safeformer.stack.layers``;
        shapes count the memory, class and prefix rows the stack runs on). ``polar_pos_emb`` and
        ``flash_pack_seq_context_kwargs`` are accepted at ``None`` (the stack refuses another value by name). Padded
        path.
    _loop_out: (internal, for ``AutoregressiveWrapper``'s looped loss) a dict a looped model fills with the
        runs' ``exit_logits``, ``all_pred_logits`` and ``exit_indices`` without building the intermediates
        (which run the explicit attention path).

Returns:
    logits ``(b, n, v)`` (or embeddings / pooled; ``(b, v)`` with ``average_pool_embed`` or one
    class token; ``(b, num_pooled_tokens, dim_pooled_tokens)`` for an encoder with ``attn_pool``, whose
    logits then go on the intermediates as ``logits``), then the cache if ``return_cache``, then the
    intermediates if ``return_intermediates`` / ``return_hiddens``, or the attention weights if
    ``return_attn``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.cache import attach_cached_kv
from ..core.conditions import Conditions, condition_kwargs
from ..core.masks import checked_once, validate_mask
from ..core.static_cache import StaticKVCache
from ..nn.modules import (
    AbsolutePositionalEmbedding,
    LayerNorm,
    ScaledSinusoidalPositions,
    grow_linear_biases,
    l2norm,
    positions_from_mask,
)
from .decode_step import check_step_call, wrapper_step
from .layers import AttentionLayers, KVCache, translate_aliases
from .wrapper_forward import (  # noqa: F401  (re-exported: other modules and tests import them from here)
    ContinuousMems,
    Mems,
    WrapperCall,
    _check_tokens,
    _conditions,
    _start_mask,
    _token_ids,
    attn_z_loss,
    continuous_mask,
    continuous_mems,
    continuous_new_rows,
    continuous_output,
    continuous_returns,
    embed_call,
    finish_call,
    head_call,
    intersperse_layout,
    logit_entropies,
    read_stack_keywords,
    resolve_call,
    run_call,
    stack_keywords,
)
from .wrapper_options import (
    _flag,
    build_embeddings,
    build_fixed_rows,
    build_heads,
    build_recurrence,
    check_continuous_options,
    check_options,
)
from .wrapper_run import embed_rows, finish_run, place_rows, stack_runner

__all__ = ["TransformerWrapper", "ContinuousTransformerWrapper"]

# x-transformers' TransformerWrapper options whose parameters keep x-transformers' state-dict keys here
XT_OPTION_PARAMETERS = ("to_mixture.0.weight", "combine_mixture.weight", "recycled_proj.weight",
                        "to_next_embed_pred.0.weight", "to_next_embed_pred.2.weight")


def xt_wrapper_option_kwargs(model) -> dict:
    """The safeformer ``TransformerWrapper`` keywords for an x-transformers ``TransformerWrapper``'s
    ``mixture_of_softmax``, ``recycling``, ``add_continuous_pred_head``, ``squeeze_out_last_dim`` and
    ``input_not_include_cache`` (for ``from_x_transformers``; ``copy_xt_wrapper_option_weights`` copies
    their parameters)."""
    kw: dict = {}
    if getattr(model, "to_mixture", None) is not None:
        kw.update(mixture_of_softmax=True, mixture_of_softmax_k=model.combine_mixture.out_features)
    if getattr(model, "recycling", False):
        kw.update(recycling=True, train_max_recycle_steps=model.train_max_recycle_steps)
    for name in ("add_continuous_pred_head", "squeeze_out_last_dim", "input_not_include_cache"):
        if getattr(model, name, False):
            kw[name] = True
    return kw


def xt_continuous_wrapper_kwargs(model) -> dict:
    """The safeformer ``ContinuousTransformerWrapper`` keywords (all but ``attn_layers``) of an x-transformers
    ``ContinuousTransformerWrapper``: ``dim_in`` / ``dim_out`` from its projections (``project_in`` /
    ``project_out`` as given when they are not ``nn.Linear`` or ``nn.Identity``), ``probabilistic``,
    ``max_seq_len`` (``None`` when it has no absolute position embedding), memory tokens, pooling, ``post_emb_norm``
    and ``max_mem_len``.
    ``copy_xt_continuous_projections`` then copies the projections (x-transformers' have no bias: safeformer's
    are zeroed). For ``from_x_transformers``, which converts the stack."""
    pin, pout = model.project_in, model.project_out
    kw: dict = dict(probabilistic=bool(getattr(model, "probabilistic", False)),
                    average_pool_embed=bool(getattr(model, "average_pool_embed", False)))
    has_abs = type(model.pos_emb).__name__ == "AbsolutePositionalEmbedding"
    kw["max_seq_len"] = model.max_seq_len if has_abs else None
    kw["use_abs_pos_emb"] = has_abs
    mem = getattr(model, "memory_tokens", None)
    kw["num_memory_tokens"] = int(mem.shape[0]) if mem is not None else None
    kw["post_emb_norm"] = not isinstance(getattr(model, "post_emb_norm", None), (nn.Identity, type(None)))
    kw["max_mem_len"] = int(getattr(model, "max_mem_len", 0) or 0)
    if isinstance(pin, nn.Linear):
        kw["dim_in"] = pin.in_features
    elif not isinstance(pin, nn.Identity):
        kw["project_in"] = pin
    if isinstance(pout, nn.Linear):
        kw["dim_out"] = pout.out_features // (2 if kw["probabilistic"] else 1)
    elif not isinstance(pout, nn.Identity):
        kw["project_out"] = pout
    return kw


@torch.no_grad()
def copy_xt_continuous_projections(sf_model: nn.Module, xt_model: nn.Module) -> None:
    """Copy an x-transformers ``ContinuousTransformerWrapper``'s ``nn.Linear`` projections (and absolute
    position embedding and memory tokens) into ``sf_model`` built from ``xt_continuous_wrapper_kwargs``; the
    (probabilistic) output layout is the same interleaved one in both libraries."""
    for name in ("project_in", "project_out"):
        theirs, ours = getattr(xt_model, name), getattr(sf_model, name)
        if isinstance(theirs, nn.Linear) and isinstance(ours, nn.Linear) and ours is not theirs:
            ours.weight.copy_(theirs.weight)
            if ours.bias is not None:
                ours.bias.copy_(theirs.bias if theirs.bias is not None else torch.zeros_like(ours.bias))
    if sf_model.pos_emb is not None and type(xt_model.pos_emb).__name__ == "AbsolutePositionalEmbedding":
        sf_model.pos_emb.emb.weight.copy_(xt_model.pos_emb.emb.weight)
    if getattr(sf_model, "memory_tokens", None) is not None:
        sf_model.memory_tokens.copy_(xt_model.memory_tokens)
    if getattr(sf_model, "post_emb_norm", None) is not None:  # x-transformers' LayerNorm: the same gamma
        sf_model.post_emb_norm.gamma.copy_(xt_model.post_emb_norm.gamma)


@torch.no_grad()
def copy_xt_wrapper_option_weights(sf_model: nn.Module, xt_model: nn.Module) -> None:
    """Copy the parameters of those options (same keys in both libraries) from ``xt_model`` into ``sf_model``."""
    theirs, ours = xt_model.state_dict(), dict(sf_model.named_parameters())
    for key in XT_OPTION_PARAMETERS:
        if key in theirs and key in ours:
            ours[key].copy_(theirs[key].to(ours[key].dtype))


# x-transformers' spelling -> safeformer's name for the wrappers (see layers.LAYER_ALIASES); None: accepted
# and ignored. Names the same in both libraries need no entry.
WRAPPER_ALIASES: dict[str, object] = {
    # a TransformerWrapper keyword (x-transformers' ContinuousTransformerWrapper has none): refused there unless 1
    "emb_frac_gradient": lambda v: {} if v == 1.0 and not isinstance(v, bool) else {
        "_unsupported": f"emb_frac_gradient={v!r} (a TransformerWrapper option; x-transformers' "
                        f"ContinuousTransformerWrapper has no such keyword)"},
}


def _check_layers(attn_layers) -> None:
    if not isinstance(attn_layers, AttentionLayers):
        raise TypeError(
            f"attn_layers must be an Encoder, Decoder, CrossAttender or AttentionLayers, got {type(attn_layers).__name__}"
        )


class _Wrapper(Configurable, nn.Module):
    """Shared plumbing: positions, the optional absolute embedding, the finite-input check."""

    attn_layers: AttentionLayers
    dropout_fixed_rows = True  # emb_dropout on the memory and class rows too (x-transformers' continuous wrapper)

    def get_config(self) -> dict:
        """As ``Configurable.get_config``; a model built with a custom module (x-transformers' ``token_emb``,
        ``to_logits``, ``project_in``, ``project_out``) has no JSON config: a clear error instead."""
        custom = [k for k in ("token_emb", "to_logits", "project_in", "project_out")
                  if isinstance(self._sf_config.get(k), nn.Module)]
        if custom:
            raise ValueError(f"{type(self).__name__} built with a custom {', '.join(custom)} module has no JSON config "
                             "(save_pretrained / get_config): save its state_dict and rebuild it with the same modules")
        return super().get_config()

    def _init_positions(self, dim: int, max_seq_len: int | None, use_abs_pos_emb: bool, l2norm_embed: bool = False,
                        scaled_sinu_pos_emb: bool = False) -> None:
        """The absolute position embedding ``pos_emb`` (``None`` without one): none with ``max_seq_len`` 0 or
        ``None`` (x-transformers: 0), ``use_abs_pos_emb=False``, relative positions in the stack or the stack's
        ``disable_abs_pos_emb=True``; x-transformers' scaled sinusoids with ``scaled_sinu_pos_emb``, else learned."""
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0):
            raise ValueError(f"max_seq_len must be a non-negative integer (0: no absolute position embedding), "
                             f"got {max_seq_len!r}")
        if not isinstance(scaled_sinu_pos_emb, bool):
            raise TypeError(f"scaled_sinu_pos_emb must be True or False, got {scaled_sinu_pos_emb!r}")
        self.max_seq_len = max_seq_len
        stack = self.attn_layers
        disabled = getattr(stack, "disable_abs_pos_emb", None)
        use_abs = bool(use_abs_pos_emb and not disabled and max_seq_len)
        if scaled_sinu_pos_emb and use_abs:
            self.pos_emb = ScaledSinusoidalPositions(dim)
        else:
            self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len, l2norm_embed=l2norm_embed) if use_abs else None

    def _init_fixed_tokens(self, dim: int, num_memory_tokens, use_cls_token: bool = False, num_cls_tokens: int = 1) -> None:
        """Learned rows placed before the sequence on the call that starts it: memory tokens, then
        class tokens (x-transformers' order). They are always real, take no absolute position, and
        are cut from the outputs."""
        num_memory_tokens = 0 if num_memory_tokens is None else num_memory_tokens
        for name, value in (("num_memory_tokens", num_memory_tokens), ("num_cls_tokens", num_cls_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        self.num_memory_tokens = num_memory_tokens
        self.memory_tokens = nn.Parameter(torch.randn(num_memory_tokens, dim)) if num_memory_tokens else None
        self.num_cls_tokens = num_cls_tokens if use_cls_token else 0
        if use_cls_token and num_cls_tokens < 1:
            raise ValueError(f"use_cls_token=True needs num_cls_tokens >= 1, got {num_cls_tokens}")
        self.cls_token = nn.Parameter(torch.randn(num_cls_tokens, dim) * 0.02) if use_cls_token else None

    @property
    def can_cache_kv(self) -> bool:
        """x-transformers' flag: whether incremental decoding may pass a cache (safeformer's KV cache keeps
        memory, class and prefix rows; recycling, which reruns the stack, cannot, nor attention that sums over
        the whole sequence: ``Attention.cache_refusal``, e.g. ``attn_orthog_projected_values``, ``attn_selective``; nor a hybrid module
        whose state the cache cannot carry, nor ``rotary_xpos``). Generation then recomputes the sequence each step."""
        if getattr(self, "recycling", False) or not getattr(self.attn_layers, "can_cache_kv", True) \
                or getattr(self, "memory_tokens_interspersed_every", None) is not None:
            return False
        return not any(getattr(blk.mixer, "cache_refusal", None) is not None
                       or not getattr(getattr(blk.mixer, "hybrid", None), "can_cache", True)
                       for blk in self.attn_layers.layers if blk.kind != "ff")

    def attn_qk_clip_(self, intermediates, tau: float = 100.0) -> None:
        """MuonClip's qk-clip of every attention block from a ``return_intermediates=True`` call's intermediates
        (x-transformers' name): see ``AttentionLayers.attn_qk_clip_``."""
        self.attn_layers.attn_qk_clip_(intermediates, tau=tau)

    def muon_parameters(self) -> list:
        """The stack's matrices for Muon (x-transformers' name): see ``AttentionLayers.muon_parameters``."""
        return self.attn_layers.muon_parameters()

    @property
    def can_cache_kv_outside_max_seq_len(self) -> bool:
        """x-transformers' flag: no absolute position embedding bounds the length."""
        return self.pos_emb is None

    @property
    def num_fixed_tokens(self) -> int:
        return getattr(self, "num_memory_tokens", 0) + getattr(self, "num_cls_tokens", 0)

    def _positions(self, mask: Tensor | None, b: int, n: int, device, cache: KVCache | None, lead_slots: int = 0) -> Tensor:
        """Positions of the ``n`` new rows (real rows counted, continuing from the cache). ``lead_slots``:
        rows of this call before the tokens (memory, class and prefix rows), which take no absolute
        position; the tokens' absolute positions must stay below ``max_seq_len``."""
        past = 0 if cache is None else cache.length - cache.lead_slots
        tokens = n - lead_slots
        if self.pos_emb is not None and past + tokens > self.max_seq_len:
            raise ValueError(
                f"sequence of {past + tokens} token positions ({past} cached + {tokens} new) is longer than "
                f"max_seq_len={self.max_seq_len}"
            )
        return positions_from_mask(mask, n, device, offset=None if cache is None else cache.count)

    def _check_pos(self, pos, b: int, n: int, device) -> Tensor:
        """x-transformers' ``pos``: ``(n,)`` or ``(b, n)`` integer positions of the tokens."""
        if not isinstance(pos, Tensor) or pos.dtype == torch.bool or pos.is_floating_point() or pos.is_complex():
            raise TypeError(f"pos must be a tensor of integer positions, got {getattr(pos, 'dtype', type(pos))}")
        if not (pos.dim() == 1 and pos.shape[0] == n) and not (pos.dim() == 2 and tuple(pos.shape) in ((b, n), (1, n))):
            raise ValueError(f"pos must have shape (n,) = ({n},) or (b, n) = ({b}, {n}), got {tuple(pos.shape)}")
        if pos.device != device:
            raise ValueError(f"pos is on {pos.device}, expected {device}")
        if pos.numel() and bool((pos < 0).any()):
            raise ValueError("pos holds negative positions")
        if self.pos_emb is not None and pos.numel() and bool((pos >= self.max_seq_len).any()):
            raise ValueError(f"pos holds position {int(pos.max())}, outside the absolute embedding's "
                             f"[0, max_seq_len={self.max_seq_len})")
        return pos if pos.dim() == 2 else pos[None]

    def _check_conditions(self, conds: Conditions, check: bool) -> Conditions:
        """The context's rank, dtype and mask here (the stack checks the rest); with ``check``, NaN/inf at
        real positions of every kind of condition."""
        context, context_mask = conds.context, conds.context_mask
        if context is not None:
            if not isinstance(context, Tensor) or context.dim() != 3:
                raise ValueError(f"context must have shape (b, j, dim_context), got {getattr(context, 'shape', type(context))}")
            if not context.is_floating_point():
                raise TypeError(f"context must be a floating-point tensor, got dtype {context.dtype}")
        if context is not None and context_mask is not None:
            validate_mask(context_mask, "context_mask", shape=tuple(context.shape[:2]), device=context.device)
        if check:
            conds.check_finite()
        return conds

    def _run(self, x, mask, conds: Conditions, attn_mask, cache, return_cache, *, pos=None, return_hiddens=False,
             causal=None, ff_deep=None, extra_kv=None, loop=None):
        """Positions, the fixed rows and the prefix, the stack. Returns ``(h (b, m + n, c), new cache or
        None, mask (b, m + n) or None, m, fixed outputs (b, F, c) or None, intermediates or None, the
        unpadded plan or None)``. ``causal``: the stack's causality overridden for this call; ``ff_deep``:
        ``(b, n, L, c)`` the tokens' feed-forward multipliers (``ff_deep_embed``; 1 for the rows before the
        tokens). Either runs the padded path. ``loop``: a looped stack's settings (``TransformerWrapper._loop``),
        which it fills with what the runs produced."""
        if getattr(self, "memory_tokens_interspersed_every", None) is not None:
            return self._run_interspersed(x, mask, conds, attn_mask, cache, return_cache, pos=pos,
                                          return_hiddens=return_hiddens, causal=causal, ff_deep=ff_deep,
                                          extra_kv=extra_kv, loop=loop)
        rows = place_rows(self, x, mask, conds, attn_mask, cache, pos)  # (b, F + m + n, c), in wrapper_run.py
        stack, plan = stack_runner(self, rows, conds, attn_mask, cache, return_cache, return_hiddens=return_hiddens,
                                   causal=causal, ff_deep=ff_deep, extra_kv=extra_kv)
        if loop is None:
            h, new_cache, intermediates = stack(rows.x, cache, return_cache)
        else:
            loop["return_hiddens"] = return_hiddens
            h, new_cache, intermediates = self._loop(stack, rows.x, rows.mask, cache, return_cache, rows.n, loop)
        return finish_run(self, rows, cache, h, new_cache, intermediates, plan)


    def _run_interspersed(self, x, mask, conds: Conditions, attn_mask, cache, return_cache, *, pos, return_hiddens,
                          causal, ff_deep, extra_kv, loop):
        """``_run`` with x-transformers' ``memory_tokens_interspersed_every = E``: the memory tokens are placed before
        every segment of ``E`` real tokens (each sample's own tokens counted, so padding never moves a segment and a
        padded sample has the layout it has alone; a sample's unused trailing slots are padding). The tokens take
        absolute positions 0, 1, ... (no memory row counted); rotary / ALiBi positions count every real row, memory
        rows included (x-transformers' layout). The intermediates (hiddens, attention weights) are in that
        interleaved layout; ``memory_tokens`` is ``(b * S, M, c)`` (S = ceil(n / E) blocks, a sample's unused blocks
        0). No KV cache, prefix, ``pos``, ``attn_mask``, ``ff_deep_embed`` or ``looped`` (refused)."""
        refused = [name for name, given in (("a KV cache", cache is not None or return_cache),
                                            ("prepend_embeds", conds.prepend_embeds is not None), ("pos", pos is not None),
                                            ("attn_mask", attn_mask is not None), ("ff_deep_embed", ff_deep is not None),
                                            ("looped", loop is not None)) if given]
        if refused:
            raise ValueError(f"memory_tokens_interspersed_every cannot be combined with {', '.join(refused)} (the memory "
                             f"rows between segments are laid out for the whole sequence at once)")
        b, n = x.shape[:2]
        positions = self._positions(mask, b, n, x.device, None)  # (b|1, n): the tokens' ranks (length checked)
        if self.pos_emb is not None:
            x = x + self.pos_emb.embed_positions(positions).to(x.dtype)
        x = embed_rows(self, x, 0)  # post_emb_norm, emb_frac_gradient, dropout, project_emb
        c = x.shape[-1]
        M = self.num_memory_tokens
        slot, start, blocks, N, rows = intersperse_layout(mask, b, n, self.memory_tokens_interspersed_every, M, x.device)
        dump = torch.full_like(slot[..., None], N)  # unused memory slots write to a column cut below
        mem_slot = torch.where(start[..., None], slot[..., None] - M + torch.arange(M, device=x.device), dump)  # (b, n, M)
        seq = x.new_zeros(b, N + 1, c).scatter(1, slot[..., None].expand(-1, -1, c), x)
        mem = self.memory_tokens.to(x.dtype)[None, None].expand(b, n, M, c).reshape(b, n * M, c)
        seq = seq.scatter(1, mem_slot.reshape(b, n * M, 1).expand(-1, -1, c), mem)[:, :N]  # (b, N, c)
        stack_mask = None if mask is None else rows
        stack_kw = {} if causal is None else {"causal": causal}
        stack_kw.update(extra_kv or {})
        padded_only = (causal is not None and causal != self.attn_layers.causal) or bool(extra_kv)
        plan = None if padded_only else self.attn_layers.plan_unpadded(
            stack_mask, cache=None, return_cache=False, attn_mask=None, return_hiddens=return_hiddens)
        out = self.attn_layers(seq, mask=stack_mask, positions=positions_from_mask(stack_mask, N, x.device),
                               **conds.stack_kwargs(), return_hiddens=return_hiddens, unpadded_plan=plan, **stack_kw)
        h, inter = (out[0], out[-1]) if return_hiddens else (out, None)
        tokens = h.gather(1, slot[..., None].expand(-1, -1, c))  # (b, n, c): padded rows are exact zeros
        if inter is not None:
            S = -(-n // self.memory_tokens_interspersed_every)
            got = h.gather(1, mem_slot.clamp(max=N - 1).reshape(b, n * M, 1).expand(-1, -1, c)).reshape(b, n, M, c)
            block = torch.where(start, blocks - 1, S)  # (b, n): the block a segment's first token opens, else a dump
            per_block = h.new_zeros(b, S + 1, M, c).scatter(1, block[..., None, None].expand(-1, -1, M, c),
                                                            torch.where(start[..., None, None], got, 0.0))
            inter.memory_tokens = per_block[:, :S].reshape(b * S, M, c)
        return tokens, None, mask, 0, None, inter, None

    def _loop(self, stack, x: Tensor, mask: Tensor | None, cache, return_cache: bool, n: int, loop: dict):
        """x-transformers' looped stack: ``stack(inp, cache, return_cache) -> (h, new cache, intermediates)`` run up
        to ``loop["steps"]`` times on ``x (b, N, c)``, each run on the previous run's output (padded rows are exact
        zeros and stay padding). Every run continues from the same ``cache``, whose first slots, where it holds each
        run's keys/values (``KVCache.looped_prompt_kv``), are those of the same run. Fills ``loop`` with ``hiddens``
        (each run's output) and ``exit_logits`` (the gate's ``(b, N, 1)`` per run that computed it, padded rows 0).

        Outside ``loop["inference"]`` the returned cache keeps every run's keys/values of every position, so
        decoding with it equals the full forward (x-transformers keeps the last run's only). ``loop["inference"]``
        (x-transformers' looped inference): a prompt (no cache, ``n > 1`` tokens) runs every step and keeps each
        run's keys/values; a single new position (``n == 1``) stops early, per sample, once its cumulative exit
        probability reaches ``loop["threshold"]`` (unless ``loop["fixed"]``: a fixed number of runs), keeping the
        output and the cache slot of the run it stopped at (which every run of later positions reads, as in
        x-transformers). The batch stops when every sample has (one read of a device flag per run, as
        x-transformers' break). A hybrid module's state is kept per sample likewise (its exit run's): a sample
        decodes in a batch as alone.

        Returns ``(h, new cache or None, intermediates of the last run or None)``; the cache carries ``exit_indices``
        ``(b, t)``: the last run of each sample, appended to the cache's.
        """
        steps, infer = loop["steps"], loop["inference"]
        b = x.shape[0]
        if infer and cache is not None and n != 1:
            raise ValueError(f"looped_inference with a cache decodes one token at a time, got {n} new positions")
        is_prompt = infer and cache is None and n > 1
        early = infer and not is_prompt and not loop["fixed"]
        prompt_kv = None if cache is None else cache.looped_prompt_kv
        if prompt_kv is not None and len(prompt_kv) < steps:
            raise ValueError(f"the cache holds the prompt's keys/values of {len(prompt_kv)} loop steps; this call runs "
                             f"up to {steps} (generate the prompt with at least as many)")
        want_cache = return_cache or infer or loop["return_hiddens"]
        record = want_cache and (is_prompt or not infer)  # every run's keys/values kept in the new cache
        device = x.device
        active = torch.ones(b, dtype=torch.bool, device=device)  # still running (not exited)
        exit_index = torch.zeros(b, dtype=torch.long, device=device)
        cum_exit = torch.zeros(b, dtype=torch.float32, device=device)
        cum_continue = torch.zeros(b, dtype=torch.float32, device=device)
        h_out = cache_out = last_inter = None
        hiddens, gates, prompt_steps = [], [], []
        for i in range(steps):
            c = cache
            if prompt_kv is not None:  # this run reads the prompt's keys/values of the same run (the paper's cache)
                c = replace(cache, self_kv=[(torch.cat((pk, k[:, :, pk.shape[2]:]), 2), torch.cat((pv, v[:, :, pv.shape[2]:]), 2))
                                            for (pk, pv), (k, v) in zip(prompt_kv[i], cache.self_kv)])
            h, nc, inter = stack(x, c, want_cache)
            decide = early and i < steps - 1
            if not infer or decide:
                gate = self.exit_gate(h)  # (b, N, 1)
                gates.append(gate if mask is None else torch.where(mask[..., None], gate, 0.0))
            hiddens.append(h)
            if record:
                prompt_steps.append(nc.self_kv)
            if early:  # each sample keeps the output and cache slot of the run it exits at
                h_out = h if h_out is None else torch.where(active[:, None, None], h, h_out)
                cache_out = nc if cache_out is None else _merge_cache(active, nc, cache_out)
                exit_index = torch.where(active, i, exit_index)
            else:
                h_out, cache_out = h, nc
                exit_index = torch.full_like(exit_index, i)
            last_inter = inter
            if decide:
                logit = gates[-1][:, -1, 0].float()  # (b,): the new position's gate
                cum_exit = cum_exit + (cum_continue + F.logsigmoid(logit)).exp()
                cum_continue = cum_continue + F.logsigmoid(-logit)
                active = active & (cum_exit < loop["threshold"])
                if not bool(active.any()):
                    break
            x = h
        loop["hiddens"], loop["exit_logits"] = hiddens, gates
        if cache_out is not None:
            prev = None if cache is None else cache.exit_indices
            idx = exit_index[:, None]
            cache_out = replace(cache_out, exit_indices=idx if prev is None else torch.cat((prev, idx), dim=1),
                                looped_prompt_kv=prompt_steps if record else prompt_kv)
        loop["exit_indices"] = exit_index[:, None] if cache_out is None else cache_out.exit_indices
        if last_inter is not None and cache_out is not None:
            last_inter.cache = cache_out
            attach_cached_kv(last_inter)  # the blocks' cached_kv: the returned cache's own (merged) tensors
        return h_out, cache_out if return_cache else None, last_inter


def _merge_cache(keep_new: Tensor, new, old):
    """Per sample (``keep_new (b,)``), the new cache's keys/values and hybrid-module states or the old one's."""
    return replace(new, self_kv=_merge_kv(keep_new, new.self_kv, old.self_kv),
                   hybrid=_merge_hybrid(keep_new, new.hybrid, old.hybrid))


def _merge_hybrid(keep_new: Tensor, new, old):
    """Per sample (``keep_new (b,)``), the new cache's hybrid-module states or the old one's (batch-first tensors;
    a sample keeps the state of the run it exits at, as it would alone)."""
    if old is None or new is None:
        return new
    sel = lambda a, c: torch.where(keep_new.reshape(-1, *([1] * (a.dim() - 1))), a, c)  # noqa: E731
    return [tuple(sel(t, to) for t, to in zip(s, so)) if isinstance(s, tuple) and isinstance(so, tuple) else s
            for s, so in zip(new, old)]


def _merge_kv(keep_new: Tensor, new, old):
    """Per sample (``keep_new (b,)``), the new cache's keys/values or the old one's (same shapes)."""
    if old is None:
        return new
    sel = lambda a, c: torch.where(keep_new.reshape(-1, *([1] * (a.dim() - 1))), a, c)  # noqa: E731
    return [(sel(k, ko), sel(v, vo)) for (k, v), (ko, vo) in zip(new, old)]


class TransformerWrapper(_Wrapper):
    """Token ids in, logits out. The keywords of the constructor and of ``forward`` are documented in this
    module's docstring (``help(safeformer.wrappers)``).

    Example:
        >>> model = TransformerWrapper(num_tokens=256, max_seq_len=128,
        ...     attn_layers=Decoder(dim=64, depth=2, heads=4, cross_attend=True))
        >>> logits = model(tokens, mask=mask, context=ctx, context_mask=ctx_mask)  # (b, n, 256)
    """

    dropout_fixed_rows = False  # x-transformers' TransformerWrapper adds memory and class rows after emb_dropout
    static_step_input = "tokens"  # forward(x (b, 1), cache=StaticKVCache) is a decode step (decode_step.py)

    def __init__(
        self,
        *,
        num_tokens: int,
        max_seq_len: int,
        attn_layers: AttentionLayers,
        emb_dropout: float = 0.0, post_emb_norm: bool = False, emb_frac_gradient: float = 1.0,
        use_abs_pos_emb: bool = True, scaled_sinu_pos_emb: bool = False,
        tie_embedding: bool = False,
        logits_dim: int | None = None,
        return_only_embed: bool = False,
        check_finite: bool = False,
        tie_embedding_scale: float | None = None,
        num_memory_tokens: int | None = None,
        l2norm_embed: bool = False,
        average_pool_embed: bool = False,
        use_cls_token: bool = False, num_cls_tokens: int = 1,
        token_emb: nn.Module | None = None, to_logits: nn.Module | None = None,
        squeeze_out_last_dim: bool = False,
        mixture_of_softmax: bool = False, mixture_of_softmax_k: int = 4,
        add_continuous_pred_head: bool = False,
        recycling: bool = False, train_max_recycle_steps: int = 4,
        input_not_include_cache: bool = False,
        attn_pool: bool = False, num_pooled_tokens: int = 1, attn_pool_depth: int = 1, dim_pooled_tokens: int | None = None,
        ff_deep_embed: bool = False,
        looped: bool = False, max_looped_steps: int = 4,
        embed_num_tokens: dict[str, int] | None = None,
        emb_dim: int | None = None,
        num_output_heads: int = 1,
        sigsoftmax_logits: bool = False,
        attn_z_loss_weight: float = 1e-4,
        memory_tokens_interspersed_every: int | None = None,
        max_mem_len: int = 0, shift_mem_down: int = 0,
        **aliases,
    ):
        if aliases:  # other spellings through the one table (unknown names get suggestions)
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            TransformerWrapper.__init__(self, **translate_aliases(type(self).__name__, given, aliases, WRAPPER_ALIASES))
            return
        super().__init__()
        _check_layers(attn_layers)
        self._set_config_from(TransformerWrapper.__init__, locals())
        emb_dim = check_options(
            attn_layers, num_tokens=num_tokens, logits_dim=logits_dim, tie_embedding=tie_embedding,
            tie_embedding_scale=tie_embedding_scale, average_pool_embed=average_pool_embed, use_cls_token=use_cls_token,
            token_emb=token_emb, to_logits=to_logits, return_only_embed=return_only_embed,
            mixture_of_softmax=mixture_of_softmax, mixture_of_softmax_k=mixture_of_softmax_k, recycling=recycling,
            train_max_recycle_steps=train_max_recycle_steps, squeeze_out_last_dim=squeeze_out_last_dim,
            add_continuous_pred_head=add_continuous_pred_head, input_not_include_cache=input_not_include_cache,
            embed_num_tokens=embed_num_tokens, emb_dim=emb_dim, num_output_heads=num_output_heads,
            sigsoftmax_logits=sigsoftmax_logits, attn_z_loss_weight=attn_z_loss_weight,
            memory_tokens_interspersed_every=memory_tokens_interspersed_every, num_memory_tokens=num_memory_tokens,
            max_mem_len=max_mem_len, shift_mem_down=shift_mem_down)
        dim = attn_layers.dim
        # built by option family, in this order: the order modules register (state-dict keys) and draw their weights
        build_embeddings(self, attn_layers, num_tokens=num_tokens, emb_dim=emb_dim, token_emb=token_emb,
                         l2norm_embed=l2norm_embed, max_seq_len=max_seq_len, use_abs_pos_emb=use_abs_pos_emb,
                         embed_num_tokens=embed_num_tokens, scaled_sinu_pos_emb=scaled_sinu_pos_emb,
                         post_emb_norm=post_emb_norm, emb_frac_gradient=emb_frac_gradient)
        build_fixed_rows(self, dim, memory_tokens_interspersed_every=memory_tokens_interspersed_every,
                         num_memory_tokens=num_memory_tokens, use_cls_token=use_cls_token,
                         num_cls_tokens=num_cls_tokens, max_mem_len=max_mem_len, shift_mem_down=shift_mem_down,
                         average_pool_embed=average_pool_embed, emb_dropout=emb_dropout)
        build_heads(self, dim, num_tokens=num_tokens, logits_dim=logits_dim, tie_embedding=tie_embedding,
                    tie_embedding_scale=tie_embedding_scale, return_only_embed=return_only_embed, to_logits=to_logits,
                    num_output_heads=num_output_heads, sigsoftmax_logits=sigsoftmax_logits,
                    attn_z_loss_weight=attn_z_loss_weight, check_finite=check_finite,
                    squeeze_out_last_dim=squeeze_out_last_dim, mixture_of_softmax=mixture_of_softmax,
                    mixture_of_softmax_k=mixture_of_softmax_k, add_continuous_pred_head=add_continuous_pred_head)
        build_recurrence(self, attn_layers, num_tokens=num_tokens, recycling=recycling,
                         train_max_recycle_steps=train_max_recycle_steps,
                         input_not_include_cache=input_not_include_cache, ff_deep_embed=ff_deep_embed,
                         attn_pool=attn_pool, num_pooled_tokens=num_pooled_tokens, attn_pool_depth=attn_pool_depth,
                         dim_pooled_tokens=dim_pooled_tokens, use_cls_token=use_cls_token,
                         average_pool_embed=average_pool_embed, looped=looped, max_looped_steps=max_looped_steps)

    @checked_once
    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None, context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None, return_embeddings: bool = False, return_pooled: bool = False,
        cache: KVCache | None = None, return_cache: bool = False, check_finite: bool | None = None,
        prepend_embeds: Tensor | None = None, prepend_mask: Tensor | None = None, excise_prepend_embeds: bool = False,
        condition: Tensor | None = None, condition_mask: Tensor | None = None,
        pos: Tensor | None = None, seq_start_pos: Tensor | None = None,
        return_intermediates: bool = False, return_attn: bool = False, return_hiddens: bool = False,
        cache_age: int = 1, token_emb_kwargs: dict | None = None, to_logits_kwargs: dict | None = None,
        return_next_embed_pred: bool = False, recycle_steps: int | None = None,
        input_not_include_cache: bool | None = None, causal: bool | None = None,
        self_attn_additional_kv=None, additional_kv_mask: Tensor | None = None, detach_additional_kv: bool = False,
        route_additional_kv_to_top: bool = True,
        looped_steps: int | None = None, max_looped_steps: int | None = None, looped_pred_all_logits: bool | None = None,
        looped_inference: bool = False, looped_exit_prob_threshold: float = 0.9,
        return_logits_and_embeddings: bool = False, return_embeddings_and_intermediates: bool = False,
        return_logit_entropies: bool = False,
        sum_embeds: Tensor | None = None, embed_ids: dict[str, Tensor] | None = None,
        return_attn_z_loss: bool = False, attn_z_loss_weight: float | None = None,
        _loop_out: dict | None = None,
        mems=None, mem_masks=None, return_mems: bool = False, detach_mems: bool = True,
        transform_token_embeds=None, transform_block_inputs=None, rotary_pos_emb=None, in_attn_cond=None,
        return_gumbel_log_probs: bool = False, self_attn_kv_mask: Tensor | None = None, context_pos: Tensor | None = None,
        attn_bias: Tensor | None = None, layers_execute_order: tuple[int, ...] | None = None, repeat_blocks=None,
        self_attn_kv_residuals: Tensor | None = None, cross_attn_kv_residuals: Tensor | None = None,
        flash_pack_seq_kwargs: dict | None = None, polar_pos_emb=None, flash_pack_seq_context_kwargs=None,
        **conditions,
    ):
        """Run the model on the token ids ``x (b, n)``. The keywords and the return forms (the logits, embeddings or
        pooled tokens, then the cache if ``return_cache``, then the intermediates or the attention weights) are
        documented in this module's docstring (``help(safeformer.wrappers)``: Returns); the phases run in
        ``wrapper_forward.py``.
        """
        if type(cache) is StaticKVCache:  # one decode step over preallocated slots (decode_step.py)
            if not torch.compiler.is_compiling():  # the arguments besides x: their defaults (locals(): eager only)
                check_step_call(TransformerWrapper.forward, locals())
            out = wrapper_step(self, x, cache, tokens=True)
            return (out, cache) if return_cache else out
        call = WrapperCall(
            x=x, mask=mask, context=context, context_mask=context_mask, attn_mask=attn_mask,
            return_embeddings=return_embeddings, return_pooled=return_pooled, cache=cache, return_cache=return_cache,
            check_finite=check_finite, prepend_embeds=prepend_embeds, prepend_mask=prepend_mask,
            excise_prepend_embeds=excise_prepend_embeds, condition=condition, condition_mask=condition_mask, pos=pos,
            seq_start_pos=seq_start_pos, return_intermediates=return_intermediates, return_attn=return_attn,
            return_hiddens=return_hiddens, cache_age=cache_age, token_emb_kwargs=token_emb_kwargs,
            to_logits_kwargs=to_logits_kwargs, return_next_embed_pred=return_next_embed_pred,
            recycle_steps=recycle_steps, input_not_include_cache=input_not_include_cache, causal=causal,
            self_attn_additional_kv=self_attn_additional_kv, additional_kv_mask=additional_kv_mask,
            detach_additional_kv=detach_additional_kv, route_additional_kv_to_top=route_additional_kv_to_top,
            looped_steps=looped_steps, max_looped_steps=max_looped_steps, looped_pred_all_logits=looped_pred_all_logits,
            looped_inference=looped_inference, looped_exit_prob_threshold=looped_exit_prob_threshold,
            return_logits_and_embeddings=return_logits_and_embeddings,
            return_embeddings_and_intermediates=return_embeddings_and_intermediates,
            return_logit_entropies=return_logit_entropies, sum_embeds=sum_embeds, embed_ids=embed_ids,
            return_attn_z_loss=return_attn_z_loss, attn_z_loss_weight=attn_z_loss_weight, loop_out=_loop_out,
            mems=mems, mem_masks=mem_masks, return_mems=return_mems, detach_mems=detach_mems, conditions=conditions,
            transform_token_embeds=transform_token_embeds, transform_block_inputs=transform_block_inputs,
            stack_extra=stack_keywords(  # in stack_keywords' order
                return_gumbel_log_probs, rotary_pos_emb, in_attn_cond, self_attn_kv_mask, context_pos, attn_bias,
                layers_execute_order, repeat_blocks, self_attn_kv_residuals, cross_attn_kv_residuals,
                flash_pack_seq_kwargs, polar_pos_emb, flash_pack_seq_context_kwargs),
        )
        call = resolve_call(self, call)  # every phase returns a new immutable value
        call = embed_call(self, call)
        call = run_call(self, call)
        call = head_call(self, call)
        return finish_call(self, call)

    @property
    def has_head(self) -> bool:
        return self.tie_embedding or self.to_logits is not None

    def _squeeze(self, logits):
        """x-transformers' ``squeeze_out_last_dim``: a last dimension of 1 dropped (per head)."""
        if not self.squeeze_out_last_dim:
            return logits
        one = lambda t: t[..., 0] if t.shape[-1] == 1 else t  # noqa: E731
        return tuple(one(t) for t in logits) if isinstance(logits, tuple) else one(logits)

    def _loop_settings(self, looped_steps, max_looped_steps, pred_all, inference, threshold) -> dict | None:
        """The looped keywords of one call, checked (``None`` for a model that is not looped)."""
        if not self.looped:
            given = [name for name, v, default in (("looped_steps", looped_steps, None),
                                                   ("max_looped_steps", max_looped_steps, None),
                                                   ("looped_pred_all_logits", pred_all, None),
                                                   ("looped_inference", inference, False),
                                                   ("looped_exit_prob_threshold", threshold, 0.9)) if v != default]
            if given:
                raise ValueError(f"{', '.join(given)} given to a model built without looped=True")
            return None
        for name, v in (("looped_steps", looped_steps), ("max_looped_steps", max_looped_steps)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if pred_all is not None:
            _flag(pred_all, "looped_pred_all_logits")
        _flag(inference, "looped_inference")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"looped_exit_prob_threshold must be a probability in [0, 1], got {threshold!r}")
        steps = looped_steps or max_looped_steps or self.train_max_looped_steps
        return dict(steps=steps, fixed=looped_steps is not None, inference=inference, threshold=float(threshold),
                    pred_all=self.training if pred_all is None else pred_all)

    def _loop_outputs(self, loop: dict, fixed: bool, excise: int, full_mask, to_logits_kwargs) -> dict:
        """The looped runs' ``exit_logits``, ``all_pred_logits`` and ``exit_indices`` (the intermediates' fields), for
        the rows the logits come from (memory and class rows cut; the prefix too when it is excised)."""
        cut = self.num_fixed_tokens if fixed else 0
        rows = lambda t: t[:, cut + excise:]  # noqa: E731
        mask = None if full_mask is None else full_mask[:, excise:]
        preds = [self._logits(rows(h), mask, None, to_logits_kwargs) for h in loop["hiddens"]] if loop["pred_all"] else []
        return dict(exit_logits=[rows(g) for g in loop["exit_logits"]], all_pred_logits=preds,
                    exit_indices=loop["exit_indices"])

    def _logits(self, h: Tensor, full_mask: Tensor | None, plan, to_logits_kwargs: dict | None):
        """``(b, n, v)`` logits of the hidden states ``h (b, n, c)`` (a tuple of them, one per head, with
        ``num_output_heads > 1``); padded rows exactly 0."""
        if self.num_output_heads > 1:
            return tuple(self._logits_of(h, full_mask, plan, to_logits_kwargs, head) for head in range(self.num_output_heads))
        return self._logits_of(h, full_mask, plan, to_logits_kwargs)

    def _logits_of(self, h: Tensor, full_mask: Tensor | None, plan, to_logits_kwargs: dict | None, head=None) -> Tensor:
        if head is not None:
            return self._with_padding_zero(self._head_of(h, self.to_logits[head]), full_mask)
        if self.custom_to_logits or self.to_mixture is not None or self.sigsoftmax_logits:
            out = self._head(h, **(to_logits_kwargs or {}))
            if full_mask is not None:  # padded rows: exactly 0 (a custom head may add a bias)
                out = torch.where(full_mask.reshape(*full_mask.shape, *([1] * (out.dim() - 2))), out, 0.0)
            return out
        if plan is not None and plan.n == h.shape[1]:
            # the output head on the stack's real tokens only (padded rows are exact zeros: their logits are 0)
            return plan.unpack(self._head(plan.pack(h)))
        return self._head(h)  # (b, n, v)

    @staticmethod
    def _with_padding_zero(out: Tensor, full_mask: Tensor | None) -> Tensor:
        if full_mask is None:
            return out
        return torch.where(full_mask.reshape(*full_mask.shape, *([1] * (out.dim() - 2))), out, 0.0)

    def _head_of(self, h: Tensor, proj, **kwargs) -> Tensor:
        """One head's logits; x-transformers' ``sigsoftmax_logits``: ``logits + log(sigmoid(logits))`` (computed as
        ``logsigmoid``, finite for every finite logit), so the softmax is the sigsoftmax."""
        logits = proj(h, **kwargs)
        return logits + F.logsigmoid(logits) if self.sigsoftmax_logits else logits

    def _head(self, h: Tensor, **to_logits_kwargs):
        if self.num_output_heads > 1:
            return tuple(self._head_of(h, proj) for proj in self.to_logits)
        if self.tie_embedding:
            logits = h @ self.token_emb.weight.t()
            logits = logits if self.tie_embedding_scale == 1.0 else logits * self.tie_embedding_scale
            return logits + F.logsigmoid(logits) if self.sigsoftmax_logits else logits
        if self.to_mixture is None:
            return self._head_of(h, self.to_logits, **to_logits_kwargs)
        # mixture of softmaxes: log(sum_k pi_k softmax(W h_k)), in float32 at least; a log-probability whose
        # every term is a softmax weight, computed as a logsumexp (never log 0 = -inf from underflow)
        acc = torch.promote_types(h.dtype, torch.float32)
        weights = self.combine_mixture(h).to(acc).log_softmax(dim=-1)  # (..., k)
        parts = self.to_mixture(h).unflatten(-1, (self.mixture_of_softmax_k, h.shape[-1]))  # (..., k, c)
        logp = self._head_of(parts, self.to_logits, **to_logits_kwargs).to(acc).log_softmax(dim=-1)  # (..., k, v)
        return torch.logsumexp(logp + weights[..., None], dim=-2).to(h.dtype)

    def _embed(self, x: Tensor, mask: Tensor | None, token_emb_kwargs: dict | None) -> Tensor:
        """``(b, n, c)`` token embeddings; a custom ``token_emb``'s output is checked and its padded rows zeroed."""
        if not self.custom_token_emb:
            emb = self.token_emb(x)
            return l2norm(emb) if self.l2norm_embed else emb
        emb = self.token_emb(x, **(token_emb_kwargs or {}))
        dim = self.emb_dim
        if not isinstance(emb, Tensor) or tuple(emb.shape) != (*x.shape, dim) or not emb.is_floating_point():
            raise ValueError(f"token_emb must return floating-point embeddings of shape (b, n, emb_dim) = "
                             f"({x.shape[0]}, {x.shape[1]}, {dim}), got {getattr(emb, 'shape', type(emb))}")
        return emb if mask is None else torch.where(mask[..., None], emb, 0.0)

    def _recycle(self, emb, mask, conds, attn_mask, steps, pos, want_inter, causal=None, ff_deep=None,
                 extra_kv=None):
        """x-transformers' recycling: the stack runs ``steps`` times, each run's input the embeddings plus
        ``recycled_proj`` of the previous run's (detached) output; only the last run takes gradients. ``extra_kv``:
        further stack keywords of every run (``transform_block_inputs``)."""
        if steps is None:
            steps = int(torch.randint(1, self.train_max_recycle_steps + 1, ()).item())
        if self.num_fixed_tokens or conds.prepend_embeds is not None:
            raise ValueError("recycling with memory, class tokens or prepend_embeds is not supported")
        # the embedded rows once (positions, post_emb_norm, emb_frac_gradient, dropout, projection: x-transformers'
        # x), then each run on them plus the recycled projection
        rows = place_rows(self, emb, mask, conds, attn_mask, None, pos)
        h = inter = plan = None
        for i in range(steps):
            last = i == steps - 1
            with torch.no_grad() if not last else contextlib.nullcontext():
                stack, plan = stack_runner(self, rows, conds, attn_mask, None, False, return_hiddens=want_inter and last,
                                           causal=causal, ff_deep=ff_deep, extra_kv=extra_kv)
                # padded rows of the stack's output are exact zeros
                inp = rows.x if h is None else rows.x + self.recycled_proj(h.detach())
                h, _, inter = stack(inp, None, False)
        return finish_run(self, rows, None, h, None, inter, plan)


def split_mean_log_var(raw: Tensor) -> tuple[Tensor, Tensor]:
    """x-transformers' probabilistic layout: ``raw (..., 2 d)`` read as ``(d, 2)`` pairs, ``(mean, log-variance)``."""
    pairs = raw.unflatten(-1, (raw.shape[-1] // 2, 2))
    return pairs[..., 0], pairs[..., 1]


def capped_log_var(log_var: Tensor) -> Tensor:
    """The log-variance capped so that its ``exp`` stays finite in its dtype (and its gradient with it)."""
    return log_var.clamp(max=math.log(torch.finfo(log_var.dtype).max) - 0.05)


def gaussian_head(raw: Tensor) -> Tensor:
    """``stack((mean, variance))`` ``(2, ..., d)`` from the head's ``raw (..., 2 d)`` (x-transformers'
    ``probabilistic`` output), the variance finite."""
    mean, log_var = split_mean_log_var(raw)
    return torch.stack((mean, capped_log_var(log_var).exp()))


class ContinuousTransformerWrapper(_Wrapper):
    """Vectors in, vectors out.

    Args:
        dim_in: input feature size (``None``: inputs already have the model width).
        dim_out: output feature size (``None``: return hidden states).
        max_seq_len: longest sequence (for the absolute position embedding); ``None`` (or 0, as in
            x-transformers): no absolute position embedding (positions then come from the stack's rotary
            or ALiBi, or there are none), and no length limit.
        attn_layers: the layer stack.
        emb_dropout, use_abs_pos_emb, check_finite: as in ``TransformerWrapper``; ``check_finite``
            checks ``x`` as well as ``context``.
        num_memory_tokens, average_pool_embed: as in ``TransformerWrapper`` (x-transformers' names);
            with ``average_pool_embed`` the output is ``(b, dim_out)``.
        probabilistic: x-transformers' Gaussian head: ``project_out`` gives ``2 * dim_out`` features, read
            interleaved as ``(mean, log-variance)`` pairs per feature, and the output is
            ``stack((mean, variance))``: ``(2, b, n, dim_out)`` (``(2, b, dim_out)`` pooled). The variance is
            ``exp(log-variance)`` with the log-variance capped just below ``log`` of the dtype's largest finite
            value (never inf). Needs ``dim_out``; ``return_embeddings`` returns the hidden states as usual.
            ``ContinuousAutoregressiveWrapper(net)`` trains such a net with the Gaussian NLL.
        project_in, project_out: x-transformers' custom modules in place of ``nn.Linear(dim_in, dim)`` and
            ``nn.Linear(dim, dim_out)``; they must act on each position alone (the KV cache and the static
            decode step run them one position at a time). ``dim_in`` is read from an ``nn.Linear``
            ``project_in`` and needed otherwise (safeformer checks the input width); ``dim_out`` likewise
            from an ``nn.Linear`` ``project_out``. Padded positions are zeroed before ``project_in`` runs.
        post_emb_norm: x-transformers' ``LayerNorm(dim)`` (``post_emb_norm.gamma``) of the projected inputs plus
            the absolute positions and ``sum_embeds``, before the memory tokens and the prefix rows join.
        max_mem_len: Transformer-XL: the most positions per self-attention block that ``forward(return_mems=True)``
            keeps (x-transformers' option; 0 keeps none). See ``forward``.

    ``forward``'s further keywords ``transform_block_inputs``, ``rotary_pos_emb``, ``in_attn_cond``,
    ``return_gumbel_log_probs``, ``self_attn_kv_mask``, ``context_pos``, ``attn_bias``, ``layers_execute_order``,
    ``repeat_blocks``, ``self_attn_kv_residuals``, ``cross_attn_kv_residuals``, ``flash_pack_seq_kwargs``,
    ``deep_embeds_and_ids``, ``self_attn_additional_kv``, ``additional_kv_mask``, ``detach_additional_kv``,
    ``route_additional_kv_to_top`` (and ``polar_pos_emb`` / ``flash_pack_seq_context_kwargs``, refused unless
    ``None``) are ``AttentionLayers.forward``'s, which x-transformers' continuous wrapper hands on to its stack
    through ``**kwargs``: handed on as given (see ``safeformer.stack.layers``; shapes count the memory and prefix
    rows the stack runs on; ``transform_block_inputs``' depth 1 is not applied, as there). Padded path.
    ``return_gumbel_log_probs`` puts ``log_probs (b, h, i)`` on the attention intermediates (read them with
    ``return_intermediates=True``; a non-bool is a ``TypeError``).
    """

    static_step_input = "values"  # forward(x (b, 1, dim_in), cache=StaticKVCache) is a decode step

    def __init__(
        self,
        *,
        max_seq_len: int | None = None,
        attn_layers: AttentionLayers,
        dim_in: int | None = None,
        dim_out: int | None = None,
        emb_dropout: float = 0.0,
        use_abs_pos_emb: bool = True,
        scaled_sinu_pos_emb: bool = False,
        check_finite: bool = False,
        num_memory_tokens: int | None = None,
        average_pool_embed: bool = False,
        probabilistic: bool = False,
        project_in: nn.Module | None = None,
        project_out: nn.Module | None = None,
        use_identity_if_same_dim: bool = False,
        post_emb_norm: bool = False,
        max_mem_len: int = 0,
        **aliases,
    ):
        if aliases:
            given = {k: v for k, v in locals().items() if k not in ("self", "aliases", "__class__")}
            ContinuousTransformerWrapper.__init__(self, **translate_aliases(type(self).__name__, given, aliases, WRAPPER_ALIASES))
            return
        super().__init__()
        _check_layers(attn_layers)
        dim_in, dim_out = check_continuous_options(dim_in=dim_in, dim_out=dim_out, probabilistic=probabilistic,
                                                   project_in=project_in, project_out=project_out,
                                                   use_identity_if_same_dim=use_identity_if_same_dim,
                                                   post_emb_norm=post_emb_norm, max_mem_len=max_mem_len)
        self._set_config_from(ContinuousTransformerWrapper.__init__, locals())
        dim = attn_layers.dim
        if use_identity_if_same_dim:  # x-transformers': no projection where the widths already agree
            dim_in = None if dim_in == dim and project_in is None else dim_in
            if dim_out == dim and project_out is None and not probabilistic:
                dim_out = None
        self.attn_layers = attn_layers
        self.dim_in = dim if dim_in is None else dim_in
        self.dim_out = dim_out
        self.probabilistic = probabilistic
        if project_in is not None:
            self.project_in = project_in
        else:
            self.project_in = nn.Identity() if dim_in is None else nn.Linear(dim_in, dim, bias=False)  # x-transformers
        if project_out is not None:
            self.project_out = project_out
        else:
            out_features = None if dim_out is None else dim_out * (2 if probabilistic else 1)
            self.project_out = nn.Identity() if dim_out is None else nn.Linear(dim, out_features, bias=False)
        # earlier safeformer's projections had biases: a checkpoint holding them grows them
        self._register_load_state_dict_pre_hook(grow_linear_biases("project_in", "project_out"), with_module=True)
        # x-transformers: no max_seq_len (or 0) means no absolute position embedding
        self._init_positions(dim, max_seq_len, use_abs_pos_emb, scaled_sinu_pos_emb=scaled_sinu_pos_emb)
        self.post_emb_norm = LayerNorm(dim) if post_emb_norm else None  # x-transformers' key: post_emb_norm.gamma
        self.max_mem_len = max_mem_len  # Transformer-XL: the most memory positions forward(return_mems=True) keeps
        self._init_fixed_tokens(dim, num_memory_tokens)
        self.average_pool_embed = average_pool_embed
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.check_finite = check_finite

    @checked_once
    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None, context: Tensor | None = None, context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None, return_embeddings: bool = False, return_pooled: bool = False,
        cache: KVCache | None = None, return_cache: bool = False, check_finite: bool | None = None,
        prepend_embeds: Tensor | None = None, prepend_mask: Tensor | None = None, excise_prepend_embeds: bool = False,
        condition: Tensor | None = None, condition_mask: Tensor | None = None, lens: Tensor | None = None,
        pos: Tensor | None = None, seq_start_pos: Tensor | None = None, sum_embeds: Tensor | None = None,
        return_intermediates: bool = False, return_attn: bool = False, return_hiddens: bool = False,
        cache_age: int = 1, input_not_include_cache: bool = False, causal: bool | None = None,
        mems=None, mem_masks=None, return_mems: bool = False, transform_block_inputs=None, rotary_pos_emb=None,
        in_attn_cond=None, return_gumbel_log_probs: bool = False,
        self_attn_kv_mask: Tensor | None = None, context_pos: Tensor | None = None, attn_bias: Tensor | None = None,
        layers_execute_order: tuple[int, ...] | None = None, repeat_blocks=None,
        self_attn_kv_residuals: Tensor | None = None, cross_attn_kv_residuals: Tensor | None = None,
        flash_pack_seq_kwargs: dict | None = None, polar_pos_emb=None, flash_pack_seq_context_kwargs=None,
        deep_embeds_and_ids=None, self_attn_additional_kv=None, additional_kv_mask: Tensor | None = None,
        detach_additional_kv: bool = False, route_additional_kv_to_top: bool = True,
        **conditions,
    ):
        """Run the model on ``x (b, n, dim_in)``; arguments as in ``TransformerWrapper.forward`` (``causal``
        included);
        ``lens (b,)`` (x-transformers' name) gives right-padded lengths instead of a mask;
        ``seq_start_pos (b,)`` the first real position of left-padded samples (ANDed into the mask);
        ``sum_embeds (b, n, dim)`` is added to the projected inputs (padded rows selected away);
        ``input_not_include_cache``: with a ``LayerIntermediates`` cache every position of ``x`` is new.
        ``mems`` / ``mem_masks``: Transformer-XL memories, as in ``TransformerWrapper.forward`` (one ``(b, m, c)`` per
        self-attention block; a ``ContinuousMems`` brings its masks). ``return_mems``: also return the new memories
        as x-transformers' continuous wrapper does, ``(out, mems)``: a ``ContinuousMems`` tuple of this segment's
        stream entering each self-attention block (the last ``max_mem_len`` positions, detached; unlike
        ``TransformerWrapper``'s, the memories passed in are not kept), its ``masks`` their padding; with
        ``return_intermediates`` the intermediates are returned and carry them (``mems``, ``mem_masks``). Not with
        a cache, ``prepend_embeds``, memory tokens, ``pos`` or ``return_attn``.
        ``transform_block_inputs`` ... ``route_additional_kv_to_top``: the stack's keywords (see the class docstring).

        Values at padded positions of ``x`` (mask False) are selected away before any use: NaN or
        inf there reaches no output and no gradient.
        """
        if type(cache) is StaticKVCache:  # one decode step over preallocated slots (decode_step.py)
            if not torch.compiler.is_compiling():  # the arguments besides x: their defaults (locals(): eager only)
                check_step_call(ContinuousTransformerWrapper.forward, locals())
            out = wrapper_step(self, x, cache, tokens=False)
            return (out, cache) if return_cache else out
        conditions = condition_kwargs("ContinuousTransformerWrapper.forward", conditions)
        # the phases run in wrapper_forward.py: the door, the new rows, the stack, the output
        mask = continuous_mask(self, x, mask, lens, seq_start_pos, sum_embeds)
        mem_kw = continuous_mems(self, mems, mem_masks, return_mems, cache, return_cache, return_attn,
                                 prepend_embeds, pos)
        check = self.check_finite if check_finite is None else check_finite
        x, mask, pos, sum_embeds, cache = continuous_new_rows(x, mask, pos, sum_embeds, cache, cache_age,
                                                              input_not_include_cache, check)
        conds = self._check_conditions(_conditions(context, context_mask, prepend_embeds, prepend_mask, condition,
                                                   condition_mask, conditions), check)
        want_inter = return_intermediates or return_hiddens or return_attn
        inp = self.project_in(x)
        if sum_embeds is not None:  # padded rows (NaN included) selected away before the sum
            inp = inp + (sum_embeds if mask is None else torch.where(mask[..., None], sum_embeds, 0.0)).to(inp.dtype)
        extra = stack_keywords(  # in stack_keywords' order
            return_gumbel_log_probs, rotary_pos_emb, in_attn_cond, self_attn_kv_mask, context_pos, attn_bias,
            layers_execute_order, repeat_blocks, self_attn_kv_residuals, cross_attn_kv_residuals, flash_pack_seq_kwargs,
            polar_pos_emb, flash_pack_seq_context_kwargs, transform_block_inputs, deep_embeds_and_ids,
            self_attn_additional_kv, additional_kv_mask, detach_additional_kv, route_additional_kv_to_top)
        h, new_cache, full_mask, m, _, inter, _ = self._run(
            inp, mask, conds, attn_mask, cache, return_cache, pos=pos, return_hiddens=want_inter or return_mems,
            causal=causal, extra_kv=read_stack_keywords({**extra, **(mem_kw or {})}, want_inter or return_mems))
        out = continuous_output(self, h, full_mask, m, excise_prepend_embeds=excise_prepend_embeds,
                                return_pooled=return_pooled, return_embeddings=return_embeddings)
        if self.probabilistic and not return_embeddings and not return_pooled:
            out = gaussian_head(out)
        return continuous_returns(self, out, new_cache, inter, full_mask, return_cache=return_cache,
                                  give_inter=return_intermediates or return_hiddens, return_attn=return_attn,
                                  return_mems=return_mems)
