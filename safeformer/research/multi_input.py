"""``MultiInputTransformerWrapper``: several token inputs summed into one embedding, one logit head per
input (x-transformers' ``x_transformers.multi_input``), on safeformer's wrapper machinery.

``x`` is a dict ``{name: (b, n) token ids}``, one entry per vocabulary of ``num_tokens``; the embeddings
are summed (plus the absolute position, plus ``sum_embeds``), run through the stack, and each name gets
its logits ``(b, n, num_tokens[name])``. Everything else (masks, prefix, memory tokens, context,
adaptive condition, the KV cache under both protocols) is ``TransformerWrapper``'s: ids at padded
positions are never looked up, padded rows of ``sum_embeds`` are selected away, and hidden states and
logits at padded positions are exactly 0.

Shape legend: b batch, n positions, m prefix rows, c model width, v a vocabulary's size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.cache import resolve_cache
from ..core.conditions import Conditions, condition_kwargs
from ..core.masks import check_finite as _check_finite
from ..core.masks import checked_once, validate_mask
from ..core.xt_helpers import default_lazy as default  # noqa: F401  (x-transformers' helper of this module)
from ..core.xt_helpers import exists  # noqa: F401
from ..interop.convert import register_converter
from ..stack.layers import AttentionLayers, _last
from ..stack.wrappers import TransformerWrapper, _check_layers, _start_mask, _token_ids, _Wrapper

__all__ = ["MultiInputTransformerWrapper", "multi_input_from_x_transformers"]


def _check_vocabularies(num_tokens) -> dict[str, int]:
    if not isinstance(num_tokens, dict) or not num_tokens:
        raise ValueError(f"num_tokens must be a non-empty dict {{input name: vocabulary size}}, got {num_tokens!r}")
    for name, v in num_tokens.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"num_tokens keys must be non-empty strings (the input names), got {name!r}")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"num_tokens[{name!r}] must be a positive integer vocabulary size, got {v!r}")
    return dict(num_tokens)


def _check_no_xl(return_mems, mems, mem_masks, return_attn_z_loss) -> None:
    """XL memories and the attention z-loss: not supported (a ``ValueError`` naming the argument)."""
    for name, value in (("return_mems", return_mems), ("mems", mems), ("mem_masks", mem_masks),
                        ("return_attn_z_loss", return_attn_z_loss)):
        if value is not None and value is not False:
            raise ValueError(f"{name}: XL memories and the attention z-loss are not supported by safeformer")


def _check_sum_embeds(sum_embeds, b: int, n: int, dim: int, device) -> None:
    """``sum_embeds``: a floating-point ``(b, n, dim)`` tensor on ``device``."""
    if not isinstance(sum_embeds, Tensor) or tuple(sum_embeds.shape) != (b, n, dim):
        raise ValueError(f"sum_embeds must have shape (b, n, dim) = ({b}, {n}, {dim}), got "
                         f"{getattr(sum_embeds, 'shape', type(sum_embeds).__name__)}")
    if not sum_embeds.is_floating_point():
        raise TypeError(f"sum_embeds must be a floating-point tensor, got dtype {sum_embeds.dtype}")
    if sum_embeds.device != device:
        raise ValueError(f"sum_embeds is on {sum_embeds.device}, expected {device}")


class MultiInputTransformerWrapper(_Wrapper):
    """Several token inputs in (summed embeddings), one logit head per input out.

    Args (x-transformers' names):
        num_tokens: ``{input name: vocabulary size}``; each input has its own embedding
            (``embeds[f"{name}_embed"]``) and its own head (``to_logits[name]``).
        max_seq_len: longest sequence (for the absolute position embedding); 0 means none.
        attn_layers: an ``Encoder``, ``Decoder``, ``CrossAttender`` or ``AttentionLayers``.
        emb_dim: must be ``None`` or the stack's width (an embedding projection is not supported).
        emb_dropout, use_abs_pos_emb, num_memory_tokens, return_only_embed: as in ``TransformerWrapper``.
        max_mem_len, shift_mem_down, post_emb_norm, scaled_sinu_pos_emb, emb_frac_gradient,
        memory_tokens_interspersed_every: accepted at their neutral value only (XL memories and the
            others are not supported: a ``ValueError`` naming the option).
        attn_z_loss_weight: accepted (unused, as in x-transformers' constructor).
        check_finite: check ``sum_embeds`` and the conditions for NaN/inf at real positions on every call.
    """

    def __init__(
        self,
        *,
        num_tokens: dict[str, int],
        max_seq_len: int,
        attn_layers: AttentionLayers,
        emb_dim: int | None = None,
        max_mem_len: int = 0,
        shift_mem_down: int = 0,
        emb_dropout: float = 0.0,
        post_emb_norm: bool = False,
        num_memory_tokens: int | None = None,
        memory_tokens_interspersed_every: int | None = None,
        return_only_embed: bool = False,
        use_abs_pos_emb: bool = True,
        scaled_sinu_pos_emb: bool = False,
        emb_frac_gradient: float = 1.0,
        attn_z_loss_weight: float = 1e-4,
        check_finite: bool = False,
    ):
        super().__init__()
        _check_layers(attn_layers)
        self._set_config_from(MultiInputTransformerWrapper.__init__, locals())
        num_tokens = _check_vocabularies(num_tokens)
        dim = attn_layers.dim
        unsupported = [
            f"{name}={value!r}" for name, value, neutral in (
                ("emb_dim", emb_dim, emb_dim in (None, dim)), ("max_mem_len", max_mem_len, max_mem_len == 0),
                ("shift_mem_down", shift_mem_down, shift_mem_down == 0), ("post_emb_norm", post_emb_norm, not post_emb_norm),
                ("memory_tokens_interspersed_every", memory_tokens_interspersed_every, memory_tokens_interspersed_every is None),
                ("scaled_sinu_pos_emb", scaled_sinu_pos_emb, not scaled_sinu_pos_emb),
                ("emb_frac_gradient", emb_frac_gradient, emb_frac_gradient == 1.0),
            ) if not neutral
        ]
        if unsupported:
            raise ValueError(f"MultiInputTransformerWrapper: x-transformers' option(s) {', '.join(unsupported)} are not "
                             f"supported by safeformer (emb_dim must be None or dim={dim})")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0:
            raise ValueError(f"max_seq_len must be a non-negative integer, got {max_seq_len!r}")
        self.attn_layers = attn_layers
        self.num_tokens = num_tokens
        self.emb_dim = dim
        self.embeds = nn.ModuleDict({f"{name}_embed": nn.Embedding(v, dim) for name, v in num_tokens.items()})
        self._init_positions(dim, max_seq_len or None, use_abs_pos_emb)  # 0: no absolute positions (x-transformers)
        if max_seq_len == 0:
            self.max_seq_len = 0
        self._init_fixed_tokens(dim, num_memory_tokens)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.return_only_embed = return_only_embed
        self.to_logits = None if return_only_embed else nn.ModuleDict(
            {name: nn.Linear(dim, v, bias=False) for name, v in num_tokens.items()})
        self.check_finite = check_finite

    def _inputs(self, x, mask: Tensor | None) -> tuple[dict[str, Tensor], int, int, torch.device]:
        """The dict of ids, checked: every name of ``num_tokens`` once, one shape ``(b, n)``, integer ids in
        their vocabulary at real positions (padded positions may hold anything)."""
        if not isinstance(x, dict) or not x:
            raise TypeError(f"x must be a non-empty dict {{input name: (b, n) token ids}} with the names "
                            f"{sorted(self.num_tokens)}, got {type(x).__name__}")
        unknown = sorted(set(map(str, x)) - set(self.num_tokens))
        missing = sorted(set(self.num_tokens) - set(x))
        if unknown or missing:
            raise ValueError(f"x must hold exactly the inputs {sorted(self.num_tokens)}; "
                             f"unknown: {unknown}, missing: {missing}")
        ids = {name: _token_ids(x[name], f"x[{name!r}]") for name in self.num_tokens}
        first = next(iter(ids.values()))
        b, n = first.shape
        for name, t in ids.items():
            if t.shape != first.shape or t.device != first.device:
                raise ValueError(f"x[{name!r}] has shape {tuple(t.shape)} on {t.device}; every input must have the "
                                 f"shape {tuple(first.shape)} on {first.device} of the first")
        return ids, b, n, first.device

    def _check_ids(self, ids: dict[str, Tensor], mask: Tensor | None) -> dict[str, Tensor]:
        out = {}
        for name, t in ids.items():
            if mask is not None:
                t = torch.where(mask, t, torch.zeros_like(t))  # padded ids are never looked up
            vocab = self.num_tokens[name]
            if not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active() and t.numel() \
                    and bool(((t < 0) | (t >= vocab)).any()):
                bad = ((t < 0) | (t >= vocab)).nonzero()[0].tolist()  # reached only on error
                raise ValueError(f"x[{name!r}] holds token id {int(t[tuple(bad)])} at real position {tuple(bad)}, outside "
                                 f"the vocabulary [0, num_tokens[{name!r}]={vocab}); padded positions (mask False) may "
                                 f"hold anything")
            out[name] = t
        return out

    @checked_once
    def forward(
        self,
        x: dict[str, Tensor],
        return_embeddings: bool = False,
        return_logits_and_embeddings: bool = False,
        return_intermediates: bool = False,
        mask: Tensor | None = None,
        return_mems: bool = False,
        return_attn: bool = False,
        mems=None,
        mem_masks=None,
        pos: Tensor | None = None,
        prepend_embeds: Tensor | None = None,
        prepend_mask: Tensor | None = None,
        sum_embeds: Tensor | None = None,
        return_attn_z_loss: bool = False,
        attn_z_loss_weight: float = 1e-4,
        seq_start_pos: Tensor | None = None,
        cache=None,
        *,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        condition: Tensor | None = None,
        condition_mask: Tensor | None = None,
        return_cache: bool = False,
        return_hiddens: bool = False,
        excise_prepend_embeds: bool = False,
        check_finite: bool | None = None,
        cache_age: int = 1,
        **conditions,
    ):
        """Run the model on ``x = {name: (b, n) ids}``.

        Args (x-transformers' names and order; the rest as in ``TransformerWrapper.forward``):
            mask: ``(b, n)`` bool, True = real position, shared by every input.
            sum_embeds: ``(b, n, dim)`` added to the summed embeddings; padded rows are selected away.
            return_embeddings: hidden states ``(b, n, dim)`` instead of the dict of logits.
            return_logits_and_embeddings: ``(logits dict, hidden states)``.
            return_intermediates / return_hiddens, return_attn: as in ``TransformerWrapper``.
            cache: a ``KVCache`` (``x`` holds the new positions) or the ``LayerIntermediates`` of an earlier
                ``return_intermediates=True`` call (``x`` holds the whole sequence so far or the new positions).
            return_mems, mems, mem_masks, return_attn_z_loss: XL memories and the attention z-loss are not
                supported (``ValueError``).

        Returns:
            ``{name: (b, n, num_tokens[name])}`` (or the embeddings), then the cache if ``return_cache``, then the
            intermediates (or the attention maps with ``return_attn``). Logits and hidden states at padded
            positions are exactly 0.
        """
        conditions = condition_kwargs("MultiInputTransformerWrapper.forward", conditions)
        _check_no_xl(return_mems, mems, mem_masks, return_attn_z_loss)
        ids, n, mask = self._checked_inputs(x, mask, seq_start_pos, sum_embeds)
        cache, keep = resolve_cache(cache, n, cache_age, lead_slots=True)
        if keep is not None:  # x-transformers' protocol: the last cache_age positions are new
            ids = {k: v[:, -keep:] for k, v in ids.items()}
            mask, pos, sum_embeds, n = _last(mask, keep), _last(pos, keep), _last(sum_embeds, keep), keep
        ids = self._check_ids(ids, mask)
        check = self.check_finite if check_finite is None else check_finite
        if check and sum_embeds is not None:
            _check_finite(sum_embeds, mask, "sum_embeds")
        conds = self._check_conditions(Conditions.from_kwargs(dict(  # named, not read from locals() (torch.compile)
            context=context, context_mask=context_mask, prepend_embeds=prepend_embeds, prepend_mask=prepend_mask,
            condition=condition, condition_mask=condition_mask, **conditions)), check)
        emb = self._embed(ids, sum_embeds, mask)
        want_inter = return_intermediates or return_hiddens or return_attn
        h, new_cache, _, m, _, inter, _ = self._run(emb, mask, conds, attn_mask, cache, return_cache,
                                                    pos=pos, return_hiddens=want_inter)
        if excise_prepend_embeds and m:
            h = h[:, m:]
        return self._outputs(h, new_cache, inter, return_embeddings=return_embeddings,
                             return_logits_and_embeddings=return_logits_and_embeddings, return_cache=return_cache,
                             return_inter=return_intermediates or return_hiddens, return_attn=return_attn)

    def _checked_inputs(self, x, mask: Tensor | None, seq_start_pos: Tensor | None,
                        sum_embeds: Tensor | None) -> tuple[dict[str, Tensor], int, Tensor | None]:
        """The ids, their length ``n`` and the padding mask (with ``seq_start_pos``), ``sum_embeds`` checked."""
        ids, b, n, device = self._inputs(x, mask)
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=device)
        if seq_start_pos is not None:
            mask = _start_mask(seq_start_pos, mask, b, n, device)
        if sum_embeds is not None:
            _check_sum_embeds(sum_embeds, b, n, self.attn_layers.dim, device)
        return ids, n, mask

    def _embed(self, ids: dict[str, Tensor], sum_embeds: Tensor | None, mask: Tensor | None) -> Tensor:
        """``(b, n, c)``: the inputs' embeddings summed, plus ``sum_embeds`` at real positions."""
        emb = None
        for name, t in ids.items():
            e = self.embeds[f"{name}_embed"](t)
            emb = e if emb is None else emb + e
        if sum_embeds is not None:
            s = sum_embeds.to(emb.dtype)
            emb = emb + (s if mask is None else torch.where(mask[..., None], s, 0.0))
        return emb

    def _outputs(self, h: Tensor, new_cache, inter, *, return_embeddings: bool, return_logits_and_embeddings: bool,
                 return_cache: bool, return_inter: bool, return_attn: bool):
        """``forward``'s return value: the logits (or hidden states), then the cache and intermediates asked for."""
        embeddings_only = return_embeddings or self.to_logits is None
        logits = None if embeddings_only else {name: head(h) for name, head in self.to_logits.items()}
        if return_logits_and_embeddings and logits is not None:
            out = (logits, h)
        else:
            out = h if embeddings_only else logits
        extra = ((new_cache,) if return_cache else ()) + (
            (inter,) if return_inter else (inter.attn_maps,) if return_attn else ())
        return (out, *extra) if extra else out


def multi_input_from_x_transformers(model: nn.Module, *, drop_training_only: bool = False) -> MultiInputTransformerWrapper:
    """Convert an ``x_transformers.multi_input.MultiInputTransformerWrapper`` with its weights.

    The attention stack goes through ``safeformer.from_x_transformers`` (the same options are supported,
    the same ``ValueError`` lists the others); the embeddings, the absolute positions, the memory tokens and
    the heads are copied. Outputs equal the original's at real positions with right padding (or none).

    Raises:
        TypeError: ``model`` is not an x-transformers ``MultiInputTransformerWrapper``.
        ValueError: options safeformer cannot represent (``emb_dim != dim``, ``post_emb_norm``, ...).
    """
    import x_transformers as xt
    from x_transformers.multi_input import MultiInputTransformerWrapper as XTMulti

    from ..interop.convert import from_x_transformers

    if not isinstance(model, XTMulti):
        raise TypeError(f"model must be an x_transformers MultiInputTransformerWrapper, got {type(model).__name__}")
    layers = model.attn_layers
    dim = layers.dim
    problems = []
    if type(model.project_emb).__name__ != "Identity":
        problems.append(f"emb_dim={model.emb_dim} != dim={dim} (an embedding projection)")
    if type(model.post_emb_norm).__name__ != "Identity":
        problems.append("post_emb_norm")
    if model.max_mem_len or model.shift_mem_down:
        problems.append("max_mem_len / shift_mem_down (XL memories)")
    if getattr(model, "memory_tokens_interspersed_every", None) is not None:
        problems.append(f"memory_tokens_interspersed_every={model.memory_tokens_interspersed_every}")
    has_abs = isinstance(model.pos_emb, xt.x_transformers.AbsolutePositionalEmbedding)
    if not has_abs and type(model.pos_emb).__name__ != "always":
        problems.append(f"a {type(model.pos_emb).__name__} position embedding (scaled_sinu_pos_emb)")
    emb_frac = model.emb_frac_gradient
    if emb_frac != 1.0 and not drop_training_only:
        problems.append(f"emb_frac_gradient={emb_frac} (training only: drop_training_only=True drops it)")
    if problems:
        raise ValueError("MultiInputTransformerWrapper options safeformer cannot represent: " + "; ".join(problems))
    num_memory_tokens = int(model.num_memory_tokens or 0)
    max_seq_len = int(model.max_seq_len)
    # a stand-in x-transformers TransformerWrapper around the same stack: from_x_transformers converts it
    stand_in = xt.TransformerWrapper(num_tokens=1, max_seq_len=max(max_seq_len, 1), attn_layers=layers,
                                     return_only_embed=True, use_abs_pos_emb=has_abs, emb_dropout=model.emb_dropout.p,
                                     num_memory_tokens=num_memory_tokens or None)
    ref = next(iter(model.embeds.values())).weight
    stand_in = stand_in.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        if has_abs:
            stand_in.pos_emb.emb.weight.copy_(model.pos_emb.emb.weight)
        if num_memory_tokens:
            stand_in.memory_tokens.copy_(model.memory_tokens)
    converted: TransformerWrapper = from_x_transformers(stand_in, drop_training_only=drop_training_only)
    num_tokens = {key.removesuffix("_embed"): e.num_embeddings for key, e in model.embeds.items()}
    sf = MultiInputTransformerWrapper(
        num_tokens=num_tokens, max_seq_len=max_seq_len if has_abs else 0, attn_layers=converted.attn_layers,
        emb_dropout=model.emb_dropout.p, num_memory_tokens=num_memory_tokens or None,
        return_only_embed=model.to_logits is None, use_abs_pos_emb=has_abs,
    ).to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        for key, e in model.embeds.items():
            sf.embeds[key].weight.copy_(e.weight)
        if has_abs:
            sf.pos_emb.emb.weight.copy_(converted.pos_emb.emb.weight)
        if num_memory_tokens:
            sf.memory_tokens.copy_(converted.memory_tokens)
        if model.to_logits is not None:
            for name, head in model.to_logits.items():
                if head.bias is not None:
                    raise ValueError(f"to_logits[{name!r}] has a bias, which safeformer's heads do not have")
                sf.to_logits[name].weight.copy_(head.weight)
    sf.train(model.training)
    return sf

# x-transformers' names that its module of this path imports from another (the same objects as there)
from ..core.cache import LayerIntermediates  # noqa: E402, F401
from ..core.xt_helpers import always, is_empty  # noqa: E402, F401
from ..nn.modules import AbsolutePositionalEmbedding  # noqa: E402, F401
from ..nn.xt_modules import LayerNorm, ScaledSinusoidalEmbedding  # noqa: E402, F401
from ..stack.layers import Decoder  # noqa: E402, F401

# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.multi_input", "MultiInputTransformerWrapper", multi_input_from_x_transformers, takes_drop=True)
