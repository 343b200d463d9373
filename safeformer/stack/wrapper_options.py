"""``TransformerWrapper``'s construction, by option family, and the checks of its options.

Shape legend: c model width, e embedding width (``emb_dim``), v vocabulary size, k mixture components,
L feed-forward blocks.

``TransformerWrapper.__init__`` checks every option (``check_options``), then builds its parts in this order,
each builder taking the keywords it reads and setting the wrapper's attributes (the order is the order in
which modules are registered and random numbers drawn, so state-dict keys and initial weights stay as they were):

- ``build_embeddings``: the stack, the token embedding, the absolute positions, ``project_emb`` and the further
  embeddings;
- ``build_fixed_rows``: memory and class tokens (interspersed or not), the Transformer-XL memories' settings,
  average pooling and the embedding dropout;
- ``build_heads``: the output head (tied, custom, several heads, mixture of softmaxes, sigsoftmax), the z-loss
  weight and the continuous next-embedding head;
- ``build_recurrence``: recycling, deep embeddings, attention pooling and the looped stack.

The keyword reference is ``wrappers.py``'s module docstring.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..nn.modules import LayerNorm, TokenEmbedding
from .layers import AttentionLayers
from .xt_extras import AttentionPool

# the ``TransformerWrapper`` these phases serve (typed as a module: the class imports this file)
WrapperModule = nn.Module



def _flag(v, name: str) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")


def _positive_int(v, name: str, none_ok: bool = False) -> None:
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if none_ok else ''}, got {v!r}")


def check_emb_frac_gradient(v) -> float:
    """x-transformers' ``emb_frac_gradient`` checked: the fraction in ``(0, 1]`` of the gradient that reaches the
    embeddings (GLM-130B and CogView used 0.1); 1 leaves it whole. x-transformers ignores a value above 1 and
    asserts on one at or below 0; safeformer refuses both (S9)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0.0 < v <= 1.0:
        raise ValueError(f"emb_frac_gradient must be a number in (0, 1] (the fraction of the gradient reaching the "
                         f"embeddings; 1 = all of it), got {v!r}")
    return float(v)


def _build_attn_pool(attn_layers: AttentionLayers, attn_pool, num_pooled_tokens, depth, dim_pooled_tokens,
                     use_cls_token: bool, average_pool_embed: bool) -> AttentionPool | None:
    """x-transformers' ``attn_pool``: an ``AttentionPool`` over the stack's output with the stack's heads and head
    width, or ``None``."""
    _flag(attn_pool, "attn_pool")
    if not attn_pool:
        return None
    if use_cls_token or average_pool_embed:
        raise ValueError("attn_pool pools the positions itself: not with use_cls_token or average_pool_embed")
    for name, v in (("num_pooled_tokens", num_pooled_tokens), ("attn_pool_depth", depth)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if dim_pooled_tokens is not None and (isinstance(dim_pooled_tokens, bool) or not isinstance(dim_pooled_tokens, int)
                                          or dim_pooled_tokens < 1):
        raise ValueError(f"dim_pooled_tokens must be a positive integer or None (= dim), got {dim_pooled_tokens!r}")
    attn = next(blk.mixer for blk in attn_layers.layers if blk.kind != "ff")
    dim = attn_layers.dim
    return AttentionPool(dim if dim_pooled_tokens is None else dim_pooled_tokens, num_pooled_tokens=num_pooled_tokens,
                         dim_context=dim, depth=depth, heads=attn.heads, dim_head=attn.dim_head)


def _check_embedding_options(attn_layers: AttentionLayers, embed_num_tokens, emb_dim, num_output_heads, sigsoftmax,
                             z_weight, mem_every, num_memory_tokens, *, tie_embedding, recycling, to_logits,
                             mixture_of_softmax, return_only_embed, use_cls_token) -> int:
    """The embedding and head options of x-transformers' wrapper, checked (S9). Returns the embedding width."""
    dim = attn_layers.dim
    _positive_int(emb_dim, "emb_dim", none_ok=True)
    emb_dim = dim if emb_dim is None else emb_dim
    if emb_dim != dim and (tie_embedding or recycling):
        raise ValueError(f"emb_dim={emb_dim} != dim={dim} (projected embeddings) cannot be combined with "
                         f"{'tie_embedding' if tie_embedding else 'recycling'} (they need embeddings of the model width)")
    if embed_num_tokens is not None:
        if not isinstance(embed_num_tokens, dict) or not all(isinstance(k, str) and k for k in embed_num_tokens):
            raise TypeError(f"embed_num_tokens must be a dict {{name: vocabulary size}}, got {embed_num_tokens!r}")
        for name, count in embed_num_tokens.items():
            _positive_int(count, f"embed_num_tokens[{name!r}]")
    _positive_int(num_output_heads, "num_output_heads")
    if num_output_heads > 1 and (tie_embedding or to_logits is not None or mixture_of_softmax or return_only_embed):
        raise ValueError("num_output_heads > 1 builds its own heads: not with tie_embedding, to_logits, "
                         "mixture_of_softmax or return_only_embed")
    _flag(sigsoftmax, "sigsoftmax_logits")
    if isinstance(z_weight, bool) or not isinstance(z_weight, (int, float)) or not math.isfinite(z_weight) or z_weight < 0:
        raise ValueError(f"attn_z_loss_weight must be a finite number >= 0, got {z_weight!r}")
    _positive_int(mem_every, "memory_tokens_interspersed_every", none_ok=True)
    if mem_every is not None:
        if not attn_layers.causal:
            raise ValueError("memory_tokens_interspersed_every is for a Decoder (x-transformers' rule): memory tokens "
                             "between segments summarise the tokens before them")
        if not num_memory_tokens:
            raise ValueError("memory_tokens_interspersed_every needs num_memory_tokens >= 1")
        if use_cls_token:
            raise ValueError("memory_tokens_interspersed_every cannot be combined with use_cls_token")
    return emb_dim


def _check_looped(attn_layers: AttentionLayers, looped, max_looped_steps, recycling) -> None:
    _flag(looped, "looped")
    if isinstance(max_looped_steps, bool) or not isinstance(max_looped_steps, int) or max_looped_steps < 1:
        raise ValueError(f"max_looped_steps must be a positive integer, got {max_looped_steps!r}")
    if not looped:
        return
    if recycling:
        raise ValueError("choose one of looped and recycling, not both (x-transformers' rule)")
    routing = getattr(attn_layers, "routing", None)
    if routing is None or not getattr(routing, "post_norm", False):
        raise ValueError("looped=True needs attn_layers built with pre_and_post_norm=True (x-transformers' rule: the "
                         "stream is normalised after every block, so repeated runs stay in range)")


def _check_xt_head_options(token_emb, to_logits, tie_embedding, return_only_embed, mixture_of_softmax, mos_k,
                           recycling, recycle_steps, use_cls_token, average_pool_embed, squeeze_out_last_dim,
                           add_continuous_pred_head, input_not_include_cache) -> None:
    """The x-transformers wrapper options' types and the combinations safeformer refuses (S9)."""
    for name, mod in (("token_emb", token_emb), ("to_logits", to_logits)):
        if mod is not None and not isinstance(mod, nn.Module):
            raise TypeError(f"{name} must be an nn.Module, got {type(mod).__name__}")
    for v, name in ((squeeze_out_last_dim, "squeeze_out_last_dim"), (mixture_of_softmax, "mixture_of_softmax"),
                    (add_continuous_pred_head, "add_continuous_pred_head"), (recycling, "recycling"),
                    (input_not_include_cache, "input_not_include_cache")):
        _flag(v, name)
    if token_emb is not None and tie_embedding:
        raise ValueError("tie_embedding=True ties the output to the built-in nn.Embedding: not with a custom token_emb")
    if to_logits is not None and (tie_embedding or return_only_embed):
        raise ValueError("to_logits (a custom output head) cannot be combined with tie_embedding or return_only_embed")
    if mixture_of_softmax:
        if isinstance(mos_k, bool) or not isinstance(mos_k, int) or mos_k < 1:
            raise ValueError(f"mixture_of_softmax_k must be a positive integer, got {mos_k!r}")
        if return_only_embed:
            raise ValueError("mixture_of_softmax needs an output head (not return_only_embed)")
        if use_cls_token or average_pool_embed:
            raise ValueError("mixture_of_softmax mixes per-position softmaxes: not with use_cls_token or average_pool_embed")
    if recycling and (isinstance(recycle_steps, bool) or not isinstance(recycle_steps, int) or recycle_steps < 1):
        raise ValueError(f"train_max_recycle_steps must be a positive integer, got {recycle_steps!r}")



def check_options(attn_layers: AttentionLayers, *, num_tokens, logits_dim, tie_embedding, tie_embedding_scale,
                  average_pool_embed, use_cls_token, token_emb, to_logits, return_only_embed, mixture_of_softmax,
                  mixture_of_softmax_k, recycling, train_max_recycle_steps, squeeze_out_last_dim,
                  add_continuous_pred_head, input_not_include_cache, embed_num_tokens, emb_dim, num_output_heads,
                  sigsoftmax_logits, attn_z_loss_weight, memory_tokens_interspersed_every, num_memory_tokens,
                  max_mem_len, shift_mem_down) -> int:
    """The options checked before anything is built (S9), in a fixed order (the first problem found is the one
    raised). Returns the embedding width e (``emb_dim``, default the model width)."""
    if tie_embedding_scale is not None and not tie_embedding:
        raise ValueError("tie_embedding_scale was given without tie_embedding=True")
    if tie_embedding_scale is not None and (isinstance(tie_embedding_scale, bool) or not isinstance(
            tie_embedding_scale, (int, float)) or not math.isfinite(tie_embedding_scale)):
        raise ValueError(f"tie_embedding_scale must be a finite number, got {tie_embedding_scale!r}")
    if average_pool_embed and use_cls_token:
        raise ValueError("choose one of average_pool_embed and use_cls_token, not both")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    if logits_dim is not None and (isinstance(logits_dim, bool) or not isinstance(logits_dim, int) or logits_dim <= 0):
        raise ValueError(f"logits_dim must be a positive integer or None (= num_tokens), got {logits_dim!r}")
    if tie_embedding and logits_dim not in (None, num_tokens):
        raise ValueError("tie_embedding=True needs logits_dim == num_tokens")
    _check_xt_head_options(token_emb, to_logits, tie_embedding, return_only_embed, mixture_of_softmax,
                           mixture_of_softmax_k, recycling, train_max_recycle_steps, use_cls_token,
                           average_pool_embed, squeeze_out_last_dim, add_continuous_pred_head,
                           input_not_include_cache)
    emb_dim = _check_embedding_options(attn_layers, embed_num_tokens, emb_dim, num_output_heads, sigsoftmax_logits,
                                       attn_z_loss_weight, memory_tokens_interspersed_every, num_memory_tokens,
                                       tie_embedding=tie_embedding, recycling=recycling, to_logits=to_logits,
                                       mixture_of_softmax=mixture_of_softmax, return_only_embed=return_only_embed,
                                       use_cls_token=use_cls_token)
    for name, v in (("max_mem_len", max_mem_len), ("shift_mem_down", shift_mem_down)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return emb_dim


def check_continuous_options(*, dim_in, dim_out, probabilistic, project_in, project_out, use_identity_if_same_dim,
                             post_emb_norm, max_mem_len) -> tuple:
    """``ContinuousTransformerWrapper``'s options checked (S9). Returns ``(dim_in, dim_out)``, read from ``nn.Linear``
    projections when not given."""
    _flag(probabilistic, "probabilistic")
    if probabilistic and dim_out is None:
        raise ValueError("probabilistic=True needs dim_out (the head gives a mean and a variance per output feature)")
    for name, mod in (("project_in", project_in), ("project_out", project_out)):
        if mod is not None and not isinstance(mod, nn.Module):
            raise TypeError(f"{name} must be an nn.Module, got {type(mod).__name__}")
    if project_in is not None and dim_in is None:
        if not isinstance(project_in, nn.Linear):
            raise ValueError("project_in that is not an nn.Linear needs dim_in: the width of the inputs it reads "
                             "(checked on every call)")
        dim_in = project_in.in_features
    if project_out is not None and dim_out is None and isinstance(project_out, nn.Linear):
        dim_out = project_out.out_features // (2 if probabilistic else 1)
    if probabilistic and isinstance(project_out, nn.Linear) and project_out.out_features != 2 * dim_out:
        raise ValueError(f"probabilistic=True: project_out must give 2 * dim_out = {2 * dim_out} features "
                         f"(a mean and a log-variance per feature), got {project_out.out_features}")
    for v, name in ((use_identity_if_same_dim, "use_identity_if_same_dim"), (post_emb_norm, "post_emb_norm")):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be True or False, got {v!r}")
    if isinstance(max_mem_len, bool) or not isinstance(max_mem_len, int) or max_mem_len < 0:
        raise ValueError(f"max_mem_len must be a non-negative integer, got {max_mem_len!r}")
    return dim_in, dim_out


def build_embeddings(net: WrapperModule, attn_layers: AttentionLayers, *, num_tokens: int, emb_dim: int,
                     token_emb, l2norm_embed, max_seq_len, use_abs_pos_emb, embed_num_tokens,
                     scaled_sinu_pos_emb: bool = False, post_emb_norm: bool = False,
                     emb_frac_gradient: float = 1.0) -> None:
    """The stack, the token embedding ``token_emb`` (``nn.Embedding(v, e)`` or the custom module), the absolute
    positions ``pos_emb``, x-transformers' ``post_emb_norm`` (a ``LayerNorm(e)`` of the summed embeddings, or
    ``None``), x-transformers' ``emb_frac_gradient`` (the fraction of the gradient reaching the embeddings),
    ``project_emb`` (``nn.Linear(e, c)`` when e != c, else ``None``) and the further
    embeddings ``embeds`` (``{f"{name}_embed": nn.Embedding(count, e)}`` or ``None``), set on ``net`` with the
    stack ``attn_layers``."""
    dim = attn_layers.dim
    net.num_tokens = num_tokens
    net.attn_layers = attn_layers
    net.emb_dim = emb_dim
    net.custom_token_emb = token_emb is not None
    net.token_emb = TokenEmbedding(emb_dim, num_tokens) if token_emb is None else token_emb
    net.l2norm_embed = l2norm_embed
    if not net.custom_token_emb:  # x-transformers' initialisation (TokenEmbedding.init_)
        if l2norm_embed:
            nn.init.normal_(net.token_emb.weight, std=1e-5)
        else:
            nn.init.kaiming_normal_(net.token_emb.weight)  # std sqrt(2 / emb_dim), not nn.Embedding's 1
    net._init_positions(emb_dim, max_seq_len, use_abs_pos_emb, l2norm_embed, scaled_sinu_pos_emb)
    if not isinstance(post_emb_norm, bool):
        raise TypeError(f"post_emb_norm must be True or False, got {post_emb_norm!r}")
    net.post_emb_norm = LayerNorm(emb_dim) if post_emb_norm else None
    net.emb_frac_gradient = check_emb_frac_gradient(emb_frac_gradient)
    # x-transformers' emb_dim: embeddings of another width, projected to the model width (prefix rows included)
    net.project_emb = nn.Linear(emb_dim, dim) if emb_dim != dim else None
    # x-transformers' embed_num_tokens: further embeddings (a BERT-style type embedding) added per position
    net.embeds = nn.ModuleDict({f"{name}_embed": nn.Embedding(count, emb_dim)
                                for name, count in (embed_num_tokens or {}).items()}) if embed_num_tokens else None


def build_fixed_rows(net: WrapperModule, dim: int, *, memory_tokens_interspersed_every, num_memory_tokens,
                     use_cls_token, num_cls_tokens, max_mem_len, shift_mem_down, average_pool_embed,
                     emb_dropout) -> None:
    """The memory and class tokens (``(M, c)`` / ``(C, c)`` parameters, or ``None``), their interspersed layout,
    the Transformer-XL settings ``max_mem_len`` and ``shift_mem_down``, ``average_pool_embed`` and the embedding
    dropout ``emb_dropout``, set on ``net``."""
    net.max_mem_len = max_mem_len  # Transformer-XL: the most memory positions forward(return_mems=True) keeps
    net.shift_mem_down = shift_mem_down  # the first shift_mem_down memories go to the top blocks (x-transformers)
    net.memory_tokens_interspersed_every = memory_tokens_interspersed_every
    net._init_fixed_tokens(dim, num_memory_tokens, use_cls_token, num_cls_tokens)
    net.average_pool_embed = average_pool_embed
    net.emb_dropout = nn.Dropout(emb_dropout)


def build_heads(net: WrapperModule, dim: int, *, num_tokens, logits_dim, tie_embedding, tie_embedding_scale,
                return_only_embed, to_logits, num_output_heads, sigsoftmax_logits, attn_z_loss_weight, check_finite,
                squeeze_out_last_dim, mixture_of_softmax, mixture_of_softmax_k, add_continuous_pred_head) -> None:
    """The output head ``to_logits`` (``nn.Linear(c, v)``, a custom module, an ``nn.ModuleList`` of
    ``num_output_heads`` of them, or ``None`` when tied or absent), the mixture of softmaxes (``to_mixture``:
    ``Sequential(Linear(c, k c))``, ``combine_mixture``: ``Linear(c, k)``) and the continuous next-embedding head
    ``to_next_embed_pred``, set on ``net`` with their settings (and the z-loss weight ``attn_z_loss_weight``)."""
    net.num_output_heads = num_output_heads
    net.sigsoftmax_logits = sigsoftmax_logits
    net.attn_z_loss_weight = float(attn_z_loss_weight)
    net.tie_embedding = tie_embedding
    net.tie_embedding_scale = dim**-0.5 if tie_embedding_scale is None else float(tie_embedding_scale)  # x-transformers
    net.return_only_embed = return_only_embed
    has_head = not (tie_embedding or return_only_embed)
    net.custom_to_logits = to_logits is not None
    if to_logits is not None:
        net.to_logits = to_logits
    else:
        width = num_tokens if logits_dim is None else logits_dim
        if not has_head:
            net.to_logits = None
        elif num_output_heads > 1:  # x-transformers' num_output_heads: a tuple of logits, one per head
            net.to_logits = nn.ModuleList([nn.Linear(dim, width, bias=False) for _ in range(num_output_heads)])
        else:
            net.to_logits = nn.Linear(dim, width, bias=False)
    net.check_finite = check_finite
    net.squeeze_out_last_dim = squeeze_out_last_dim
    # mixture of softmaxes (x-transformers' mixture_of_softmax): k heads' softmaxes mixed per position; the
    # output is then log-probabilities
    net.output_is_log_prob = mixture_of_softmax
    # (a Sequential, as in x-transformers: the same state-dict keys, to_mixture.0.weight)
    net.to_mixture = nn.Sequential(nn.Linear(dim, dim * mixture_of_softmax_k, bias=False)) if mixture_of_softmax else None
    net.combine_mixture = nn.Linear(dim, mixture_of_softmax_k, bias=False) if mixture_of_softmax else None
    net.mixture_of_softmax_k = mixture_of_softmax_k
    net.add_continuous_pred_head = add_continuous_pred_head
    net.to_next_embed_pred = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.SiLU(), nn.Linear(dim, dim, bias=False)) \
        if add_continuous_pred_head else None


def build_recurrence(net: WrapperModule, attn_layers: AttentionLayers, *, num_tokens, recycling,
                     train_max_recycle_steps, input_not_include_cache, ff_deep_embed, attn_pool, num_pooled_tokens,
                     attn_pool_depth, dim_pooled_tokens, use_cls_token, average_pool_embed, looped,
                     max_looped_steps) -> None:
    """Recycling (``recycled_proj``: ``Linear(c, c)`` or ``None``), the custom token embedding's own ``init_``, the
    deep embeddings ``ff_deep_embed`` (a ``(v, L, c)`` parameter of ones, or ``None``), attention pooling
    (``attn_pool``) and the looped stack's ``exit_gate`` (``Linear(c, 1)`` or ``None``), set on ``net``, in
    x-transformers' order of construction."""
    dim = attn_layers.dim
    net.recycling = recycling
    net.recycled_proj = nn.Linear(dim, dim, bias=False) if recycling else None
    net.train_max_recycle_steps = train_max_recycle_steps
    net.input_not_include_cache = input_not_include_cache
    if net.custom_token_emb and hasattr(net.token_emb, "init_"):  # x-transformers calls it on construction
        net.token_emb.init_()
    _flag(ff_deep_embed, "ff_deep_embed")
    # x-transformers' ff_deep_embed: per token, per feed-forward block, a learned multiplier of the block's output
    num_ff = attn_layers.layer_kinds.count("ff")
    net.ff_deep_embed = nn.Parameter(torch.ones(num_tokens, num_ff, dim)) if ff_deep_embed else None
    net.attn_pool = _build_attn_pool(attn_layers, attn_pool, num_pooled_tokens, attn_pool_depth,
                                     dim_pooled_tokens, use_cls_token, average_pool_embed)
    # x-transformers' looped LM: the whole stack runs several times, each run on the previous run's output,
    # with an exit gate per position (trained by AutoregressiveWrapper) deciding when to stop at inference
    _check_looped(attn_layers, looped, max_looped_steps, recycling)
    net.looped = looped
    net.exit_gate = nn.Linear(dim, 1, bias=False) if looped else None
    net.train_max_looped_steps = max_looped_steps
