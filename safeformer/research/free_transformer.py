"""x-transformers' ``FreeTransformer`` (F. Fleuret, "The Free Transformer", arXiv 2510.17558): a decoder whose
upper half is conditioned on latent bits that an encoder reads off the whole sequence during training.

Shape legend: b batch, n positions, m positions of a separate sequence for the latents, c model width,
K latent bits, C = 2 ** K codes, V vocabulary.

``from safeformer.free_transformer import FreeTransformer`` works as ``from x_transformers.free_transformer
import FreeTransformer`` does: the same keywords, forward and ``generate``. Where safeformer differs:

- ``pad_id`` marks padding everywhere (x-transformers only drops it from the encoder's keys and the loss):
  padded positions are neither keys nor queries in any stack, their ids are never looked up, their
  latents reach nothing, and they count in no loss (the KL term is the mean over real positions).
  Positions count real tokens, so a padded sample equals the sample alone.
- ``generate`` decodes with safeformer's KV cache (prompts left-padded with ``pad_id`` are accepted).

``from_x_transformers`` converts an x-transformers ``FreeTransformer`` (``free_transformer_from_x_transformers``):
equal losses, logits and samples on unpadded input, given the same random draws (``tests/test_interop_free_up.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoints.pretrained import Configurable
from ..core.losses import safe_cross_entropy
from ..core.masks import validate_mask
from ..core.xt_helpers import default, exists, log  # noqa: F401  (x-transformers' helpers of this module)
from ..decoding.generation import top_p
from ..interop.convert import register_converter
from ..nn.modules import positions_from_mask
from ..stack.layers import Decoder, Encoder

__all__ = ["FreeTransformer", "BinaryMapper", "binary_entropy", "NAT", "free_transformer_from_x_transformers"]

NAT = math.log(2)  # one bit, in nats


def binary_entropy(logits: Tensor) -> Tensor:
    """The entropy (nats) of independent bits with ``sigmoid(logits)`` as their probabilities, summed over the
    last dim: ``(..., K) -> (...)``."""
    prob = logits.sigmoid()
    return -(prob * F.logsigmoid(logits) + (1.0 - prob) * F.logsigmoid(-logits)).sum(dim=-1)


class BinaryMapper(nn.Module):
    """Bit logits ``(..., K)`` -> a sampled one-hot code ``(..., 2 ** K)`` (x-transformers' ``BinaryMapper``).

    Each bit is drawn with probability ``sigmoid(logits / temperature)``; bit ``k`` weighs ``2 ** k``. With
    ``straight_through`` (default: in training) the one-hot carries the gradient of the codes' probabilities
    ``G = prod_k p_k or (1 - p_k)``. The auxiliary loss is ``relu(K log 2 - H(bits) - kl_loss_threshold)``,
    averaged (over the rows ``mask`` keeps, when given: a fully masked input gives 0).

    Args:
        bits: K.
        kl_loss_threshold: nats of information per row that cost nothing (default one bit).
    """

    def __init__(self, bits: int = 1, kl_loss_threshold: float = NAT):
        super().__init__()
        if isinstance(bits, bool) or not isinstance(bits, int) or not 0 < bits <= 24:
            raise ValueError(f"bits must be an integer in [1, 24] (2 ** bits codes), got {bits!r}")
        self.bits = bits
        self.num_codes = 2**bits
        power_two = 2 ** torch.arange(bits)
        codes = (torch.arange(self.num_codes)[:, None].bitwise_and(power_two) != 0)  # (C, K)
        self.register_buffer("power_two", power_two, persistent=False)
        self.register_buffer("codes", codes, persistent=False)
        self.kl_loss_threshold = float(kl_loss_threshold)
        self.register_buffer("zero", torch.tensor(0.0), persistent=False)

    def forward(self, logits: Tensor, temperature: float = 1.0, straight_through: bool | None = None,
                calc_aux_loss: bool | None = None, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(one_hot (..., C), aux_kl_loss ())``; ``mask (...)``: rows that count (the others' logits are read
        as 0 and add nothing to the loss)."""
        straight_through = self.training if straight_through is None else straight_through
        calc_aux_loss = self.training if calc_aux_loss is None else calc_aux_loss
        if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.shape[-1] != self.bits:
            raise ValueError(f"logits must be a float tensor with a last dim of {self.bits} bits, got "
                             f"{getattr(logits, 'shape', type(logits))}")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"temperature must be positive, got {temperature!r}")
        if mask is not None:
            validate_mask(mask, "mask", shape=tuple(logits.shape[:-1]), device=logits.device)
            logits = torch.where(mask[..., None], logits, 0.0)
        prob = (logits / temperature).sigmoid()
        sampled = (torch.rand_like(logits) <= prob).long()
        indices = (self.power_two * sampled).sum(dim=-1)
        one_hot = F.one_hot(indices, self.num_codes).to(logits.dtype)
        aux = self.zero
        if calc_aux_loss:
            excess = F.relu(self.bits * NAT - binary_entropy(logits) - self.kl_loss_threshold)
            if mask is None:
                aux = excess.mean()
            else:
                aux = torch.where(mask, excess, 0.0).sum() / mask.sum().clamp(min=1)
        if straight_through:  # the soft code probabilities carry the gradient
            codes = self.codes.to(logits.dtype)
            soft = (F.logsigmoid(logits) @ codes.t() + F.logsigmoid(-logits) @ (1.0 - codes).t()).exp()
            one_hot = one_hot + soft - soft.detach()
        return one_hot, aux


class FreeTransformer(Configurable, nn.Module):
    """A decoder conditioned on latent bits (x-transformers' ``FreeTransformer``).

    ``decoder_head`` (causal, optional) embeds the tokens; an ``encoder`` (cross-attention only, non-causal)
    reads them with a learned query per position (``per_token_latents``) or one per sample, giving bit logits;
    a one-hot latent code is sampled (``BinaryMapper``) and projected to ``dim``; ``decoder_tail`` (causal)
    adds it to the keys'/values' input of its first self-attention (``self_attn_kv_residuals``).

    Args (x-transformers' names):
        num_tokens, dim, max_seq_len: vocabulary, width, and the longest sequence (recorded: positions are
            rotary, as in x-transformers).
        dec_head_depth: layers of the decoder head (0: none); ``dec_tail_depth``: of the tail (at least 1);
            ``enc_depth``: of the encoder.
        attn_dim_head, heads: every stack's head dim and heads.
        latent_bits: K (``2 ** K`` codes); ``per_token_latents``: a latent per position (else one per sample).
        kl_loss_threshold, binary_mapper_kwargs: the ``BinaryMapper``'s.
        enc_kwargs, dec_kwargs, **kwargs: more options of the encoder, of both decoders, of all three.
        kl_loss_weight: weight of the KL term in the total loss.
        latent_dropout_prob: dropout on the one-hot latents (training).
        pad_id: the padding id: positions holding it are padding everywhere (see the module docstring).
        dim_latent: accepted as ``None`` or ``dim`` only (x-transformers ignores it).
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        dim: int,
        dec_head_depth: int,
        dec_tail_depth: int,
        max_seq_len: int,
        enc_depth: int = 1,
        dim_latent: int | None = None,
        attn_dim_head: int = 64,
        heads: int = 8,
        latent_bits: int = 16,
        per_token_latents: bool = True,
        kl_loss_threshold: float = NAT,
        binary_mapper_kwargs: dict | None = None,
        enc_kwargs: dict | None = None,
        dec_kwargs: dict | None = None,
        kl_loss_weight: float = 1.0,
        latent_dropout_prob: float = 0.0,
        pad_id: int = -1,
        **aliases,
    ):
        kwargs = aliases  # x-transformers' **kwargs: options of all three stacks (a config stores them per stack)
        super().__init__()
        self._set_config_from(FreeTransformer.__init__, locals())
        if kwargs:  # options of all three stacks: saved as the encoder's and the decoders' own
            self._sf_config.update(enc_kwargs={**kwargs, **(enc_kwargs or {})}, dec_kwargs={**kwargs, **(dec_kwargs or {})})
        for name, v, low in (("num_tokens", num_tokens, 1), ("dim", dim, 1), ("dec_head_depth", dec_head_depth, 0),
                             ("dec_tail_depth", dec_tail_depth, 1), ("enc_depth", enc_depth, 1),
                             ("max_seq_len", max_seq_len, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if dim_latent not in (None, dim):
            raise ValueError(f"dim_latent is unused by x-transformers' FreeTransformer (the latent is projected to dim); "
                             f"pass None or dim={dim}, got {dim_latent!r}")
        if isinstance(pad_id, bool) or not isinstance(pad_id, int):
            raise TypeError(f"pad_id must be an integer, got {pad_id!r}")
        if not 0.0 <= latent_dropout_prob < 1.0:
            raise ValueError(f"latent_dropout_prob must be in [0, 1), got {latent_dropout_prob!r}")
        self.num_tokens, self.dim, self.max_seq_len = num_tokens, dim, max_seq_len
        self.pad_id = pad_id
        self.kl_loss_weight = float(kl_loss_weight)
        self.per_token_latents = bool(per_token_latents)
        common = dict(dim=dim, dim_head=attn_dim_head, heads=heads, rotary_pos_emb=True, use_rmsnorm=True)
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.token_unembed = nn.Linear(dim, num_tokens, bias=False)
        self.query_token_for_latents = nn.Parameter(torch.randn(dim) * 1e-2)
        self.encoder = Encoder(**common, depth=enc_depth, only_cross=True, cross_attend=True,
                               pre_norm_has_final_norm=True, **kwargs, **(enc_kwargs or {}))
        self.to_latent_bit_logits = nn.Linear(dim, latent_bits, bias=False)
        self.binary_mapper = BinaryMapper(latent_bits, kl_loss_threshold, **(binary_mapper_kwargs or {}))
        self.from_latent_to_condition = nn.Linear(self.binary_mapper.num_codes, dim, bias=False)
        self.latent_dropout = nn.Dropout(latent_dropout_prob)
        self.decoder_head = Decoder(**common, depth=dec_head_depth, pre_norm_has_final_norm=False, **kwargs,
                                    **(dec_kwargs or {})) if dec_head_depth > 0 else None
        self.decoder_tail = Decoder(**common, depth=dec_tail_depth, pre_norm_has_final_norm=True, **kwargs,
                                    **(dec_kwargs or {}))

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _ids(self, seq, name: str) -> Tensor:
        if not isinstance(seq, Tensor) or seq.dim() != 2 or seq.dtype in (torch.bool,) or seq.is_floating_point() \
                or seq.is_complex():
            raise TypeError(f"{name} must be a (b, n) tensor of token ids, got {getattr(seq, 'dtype', type(seq))} "
                            f"{tuple(getattr(seq, 'shape', ()))}")
        if seq.device != self.device:
            raise ValueError(f"{name} is on {seq.device}, expected {self.device}")
        mask = seq != self.pad_id
        if not torch.compiler.is_compiling() and bool(((seq < 0) | (seq >= self.num_tokens))[mask].any()):
            raise ValueError(f"{name} holds ids outside [0, num_tokens={self.num_tokens}) at real positions "
                             f"(padding is pad_id={self.pad_id})")
        return mask

    def _embed(self, ids: Tensor, mask: Tensor | None) -> Tensor:
        """``(b, n, c)`` embeddings; padded ids are never looked up, their rows are 0."""
        if mask is None:
            return self.token_emb(ids)
        emb = self.token_emb(torch.where(mask, ids, 0))
        return torch.where(mask[..., None], emb, 0.0)

    def encode_to_latents(self, decoder_head_embeds: Tensor, mask: Tensor | None = None, return_kl_loss: bool = False,
                          per_token_latents: bool | None = None):
        """The one-hot latents ``(b, n, C)`` (per token) or ``(b, 1, C)`` of ``decoder_head_embeds (b, n, c)``
        (``mask (b, n)``: its padding), and the KL term with ``return_kl_loss``."""
        per = self.per_token_latents if per_token_latents is None else per_token_latents
        if not isinstance(decoder_head_embeds, Tensor) or decoder_head_embeds.dim() != 3:
            raise ValueError(f"decoder_head_embeds must be (b, n, dim), got {getattr(decoder_head_embeds, 'shape', None)}")
        b, n = decoder_head_embeds.shape[:2]
        device = decoder_head_embeds.device
        if mask is not None:
            validate_mask(mask, "mask", shape=(b, n), device=device)
        query = self.query_token_for_latents.to(decoder_head_embeds.dtype).expand(b, n if per else 1, -1)
        kwargs = {}
        if per:  # query t sits at token t's position (rotary), padded queries are padding too
            pos = positions_from_mask(mask, n, device).expand(b, n)
            kwargs = dict(pos=pos, context_pos=pos, mask=mask)
        pooled = self.encoder(query, context=decoder_head_embeds, context_mask=mask, **kwargs)
        bit_logits = self.to_latent_bit_logits(pooled)
        one_hot, kl_loss = self.binary_mapper(bit_logits, calc_aux_loss=return_kl_loss, mask=mask if per else None)
        return (one_hot, kl_loss) if return_kl_loss else one_hot

    def forward(self, seq: Tensor, seq_for_latents: Tensor | None = None, return_all_losses: bool = False):
        """The training loss of ``seq (b, n)`` (next-token cross-entropy plus ``kl_loss_weight`` times the KL
        term); ``seq_for_latents (b, m)``: a separate sequence the (one per sample) latent is read from.

        Returns:
            the loss, or ``(loss, (ar_loss, kl_loss))`` with ``return_all_losses``.
        """
        full_mask = self._ids(seq, "seq")
        if seq.shape[1] < 2:
            raise ValueError(f"seq must hold at least 2 positions (inputs and next-token labels), got {seq.shape[1]}")
        inp, labels = seq[:, :-1], seq[:, 1:]
        # the inputs are the real tokens with a real next token (as x-transformers drops the last token): the
        # last token of a right-padded sample is no input, so a padded sample equals the sample alone
        mask = full_mask[:, :-1] & full_mask[:, 1:]
        tokens = self._embed(inp, mask)
        if self.decoder_head is not None:
            tokens = self.decoder_head(tokens, mask=mask)
        if seq_for_latents is not None:
            lat_mask = self._ids(seq_for_latents, "seq_for_latents")
            if seq_for_latents.shape[0] != seq.shape[0]:
                raise ValueError(f"seq_for_latents holds {seq_for_latents.shape[0]} samples, seq {seq.shape[0]}")
            for_latents = self._embed(seq_for_latents, lat_mask)
            if self.decoder_head is not None:
                for_latents = self.decoder_head(for_latents, mask=lat_mask)
            per = False
        else:
            for_latents, lat_mask, per = tokens, mask, None
        latents, kl_loss = self.encode_to_latents(for_latents, mask=lat_mask, per_token_latents=per, return_kl_loss=True)
        latents = self.latent_dropout(latents)
        condition = self.from_latent_to_condition(latents)  # (b, n|1, c)
        tokens = self.decoder_tail(tokens, mask=mask, self_attn_kv_residuals=condition)
        logits = self.token_unembed(tokens)
        ar_loss = safe_cross_entropy(logits, torch.where(mask, labels, -100), ignore_index=-100)
        loss = ar_loss + kl_loss * self.kl_loss_weight
        return (loss, (ar_loss, kl_loss)) if return_all_losses else loss

    @torch.no_grad()
    def generate(self, prompts: Tensor, seq_len: int, latents=None, filter_logits_fn: Callable | None = top_p,
                 logit_filter_kwargs: dict | None = None, use_kv_cache: bool = True) -> Tensor:
        """Sample until the sequences hold ``seq_len`` positions (the prompt included), conditioned on ``latents``.

        Args:
            prompts: ``(n,)`` or ``(b, n)`` token ids, left-padded with ``pad_id`` (the last position real).
            seq_len: the length of the returned sequences.
            latents: a code index (an int, a 0-d or ``(b,)`` integer tensor) or a one-hot / soft code ``(C,)``,
                ``(b, C)`` or ``(b, 1, C)``; ``None``: the tail runs without a latent (as in x-transformers).
            filter_logits_fn, logit_filter_kwargs: the logits' filter (default ``top_p`` with ``thres=0.9``) and
                its keywords; then a Gumbel-max sample.
            use_kv_cache: decode one position per step with the KV cache (else re-run the whole sequence).

        Returns:
            ``(b, seq_len)`` (or ``(seq_len,)`` for a 1-d prompt) token ids.
        """
        single = isinstance(prompts, Tensor) and prompts.dim() == 1
        prompts = prompts[None] if single else prompts
        mask = self._ids(prompts, "prompts")
        b, n = prompts.shape
        if n == 0 or not bool(mask[:, -1].all()):
            raise ValueError("prompts must end with a real token in every row (left-pad them with pad_id)")
        kwargs = dict(thres=0.9) if logit_filter_kwargs is None else dict(logit_filter_kwargs)
        condition = None if latents is None else self._latent_condition(latents, b)
        generated, new, new_mask = prompts, prompts, mask
        head_cache = tail_cache = None
        for _ in range(max(0, seq_len - n)):
            if not use_kv_cache:
                new, new_mask, head_cache, tail_cache = generated, mask, None, None
            h = self._embed(new, new_mask)
            if self.decoder_head is not None:
                h, head_cache = self.decoder_head(h, mask=new_mask, cache=head_cache, return_cache=True)
            h, tail_cache = self.decoder_tail(h, mask=new_mask, cache=tail_cache, return_cache=True,
                                              self_attn_kv_residuals=condition)
            logits = self.token_unembed(h[:, -1]).float()
            if filter_logits_fn is not None:
                logits = filter_logits_fn(logits, **kwargs)
            u = torch.rand_like(logits).clamp(1e-20, 1.0)
            sampled = (logits - torch.log((-torch.log(u)).clamp(min=1e-20))).argmax(dim=-1)  # Gumbel-max
            generated = torch.cat((generated, sampled[:, None]), dim=1)
            mask = torch.cat((mask, mask.new_ones(b, 1)), dim=1)
            new, new_mask = sampled[:, None], None
        return generated[0] if single else generated

    def _latent_condition(self, latents, b: int) -> Tensor:
        """``(b, 1, c)``: the projected code of ``latents`` (see ``generate``)."""
        if not isinstance(latents, Tensor):
            latents = torch.tensor(latents, device=self.device)
        latents = latents.to(self.device)
        codes = self.binary_mapper.num_codes
        if not (latents.is_floating_point() or latents.is_complex() or latents.dtype == torch.bool):
            if latents.dim() > 1 or bool(((latents < 0) | (latents >= codes)).any()):
                raise ValueError(f"latents as code indices must be an int or (b,) tensor in [0, {codes}), got "
                                 f"{tuple(latents.shape)}")
            latents = F.one_hot(latents.long(), codes).to(self.token_unembed.weight.dtype)
        if not latents.is_floating_point() or latents.shape[-1] != codes or latents.dim() > 3:
            raise ValueError(f"latents must be code indices or codes of width {codes}, got {latents.dtype} "
                             f"{tuple(latents.shape)}")
        if latents.dim() == 1:
            latents = latents.expand(b, 1, -1)
        elif latents.dim() == 2:
            latents = latents[:, None]
        if latents.shape[0] not in (1, b) or latents.shape[1] != 1:
            raise ValueError(f"latents must be (C,), (b, C) or (b, 1, C) with b={b}, got {tuple(latents.shape)}")
        return self.from_latent_to_condition(latents.to(self.token_unembed.weight.dtype)).expand(b, 1, -1)


# ----------------------------------------------------------------------------------------------------
# conversion from x-transformers
# ----------------------------------------------------------------------------------------------------

# the stack options FreeTransformer sets itself (from its own arguments): never carried in enc_kwargs / dec_kwargs
_SET_BY_FREE = frozenset({"dim", "depth", "heads", "dim_head", "rotary_pos_emb", "use_rmsnorm", "pre_norm_has_final_norm",
                          "causal", "cross_attend", "only_cross"})


def _stack_from_xt(stack, name: str, drop_training_only: bool):
    """A bare x-transformers stack as safeformer's (through ``from_x_transformers`` on a stand-in wrapper)."""
    from ..interop.convert import _xt, from_x_transformers

    xt, _ = _xt()
    if not isinstance(stack, xt.AttentionLayers):
        raise ValueError(f"{name}: expected an x_transformers AttentionLayers, got {type(stack).__name__}")
    stand_in = xt.TransformerWrapper(num_tokens=1, max_seq_len=0, use_abs_pos_emb=False, attn_layers=stack)
    stand_in.train(stack.training)
    try:
        return from_x_transformers(stand_in, drop_training_only=drop_training_only).attn_layers
    except ValueError as err:
        raise ValueError(f"FreeTransformer.{name}: {err}") from err


def _stack_options(layers, dim: int) -> dict:
    """The converted stack's options that are not at their defaults, less those FreeTransformer sets itself."""
    from ..stack.layers import _defaults

    defaults = _defaults(type(layers))
    cfg = {k: v for k, v in layers._sf_config.items() if k not in _SET_BY_FREE}
    if cfg.get("dim_context") == dim:
        cfg["dim_context"] = None
    return {k: v for k, v in cfg.items() if k not in defaults or defaults[k] != v}


def free_transformer_from_x_transformers(model, *, drop_training_only: bool = False, max_seq_len: int = 0) -> FreeTransformer:
    """Convert an x-transformers ``FreeTransformer`` with its weights.

    Its three stacks go through ``from_x_transformers`` (their options, ``norm_eps=1e-12`` of x-transformers' RMS
    norms included, land in ``enc_kwargs`` / ``dec_kwargs``, so the result saves and rebuilds as it is; what a stack
    uses that safeformer cannot represent is that ``ValueError``); the embedding, the un-embedding, the latent query,
    the bit and condition projections are copied by name; ``latent_bits``, ``kl_loss_threshold``, ``kl_loss_weight``,
    ``latent_dropout_prob``, ``per_token_latents`` and ``pad_id`` are kept. Equal losses (given the same random bits)
    and generations on unpadded input; padding follows safeformer's rules (see the module docstring).
    ``max_seq_len`` is not stored by x-transformers: it is recorded as given (default 0, unused by the model).
    """
    from ..interop.convert import _xt

    xt, _ = _xt()
    for attr in ("token_emb", "token_unembed", "query_token_for_latents", "encoder", "to_latent_bit_logits",
                 "binary_mapper", "from_latent_to_condition", "latent_dropout", "decoder_head", "decoder_tail",
                 "pad_id", "kl_loss_weight", "per_token_latents"):
        if not hasattr(model, attr):
            raise TypeError(f"expected an x_transformers FreeTransformer, got {type(model).__name__} (no {attr!r})")
    emb = model.token_emb
    if type(emb) is not nn.Embedding or emb.padding_idx is not None or emb.max_norm is not None:
        raise ValueError(f"FreeTransformer.token_emb: expected a plain nn.Embedding, got {emb!r}")
    dim, num_tokens = emb.embedding_dim, emb.num_embeddings
    bits = model.to_latent_bit_logits.out_features
    mapper = model.binary_mapper
    if type(mapper).__name__ != "BinaryMapper" or getattr(mapper, "bits", None) != bits:
        raise ValueError(f"FreeTransformer.binary_mapper: expected x-transformers' BinaryMapper of {bits} bits, got "
                         f"{type(mapper).__name__}")
    if type(model.latent_dropout) is not nn.Dropout:
        raise ValueError(f"FreeTransformer.latent_dropout: expected nn.Dropout, got {type(model.latent_dropout).__name__}")
    for name in ("token_unembed", "to_latent_bit_logits", "from_latent_to_condition"):
        lin = getattr(model, name)
        if type(lin) is not nn.Linear or lin.bias is not None:
            raise ValueError(f"FreeTransformer.{name}: expected an nn.Linear without bias, got {lin!r}")
    enc = _stack_from_xt(model.encoder, "encoder", drop_training_only)
    tail = _stack_from_xt(model.decoder_tail, "decoder_tail", drop_training_only)
    head = None if model.decoder_head is None else _stack_from_xt(model.decoder_head, "decoder_head", drop_training_only)
    if not (enc.only_cross and not enc.causal) or not tail.causal or (head is not None and not head.causal):
        raise ValueError("FreeTransformer: expected a cross-attention-only encoder and causal decoders")
    for name, stack, final in (("encoder", enc, True), ("decoder_tail", tail, True), ("decoder_head", head, False)):
        if stack is not None and bool(stack._sf_config.get("pre_norm_has_final_norm", True)) != final:
            raise ValueError(f"FreeTransformer.{name}: expected pre_norm_has_final_norm={final}")
    heads, dim_head = tail._sf_config["heads"], tail._sf_config["dim_head"]
    for name, stack in (("encoder", enc), ("decoder_head", head)):
        if stack is not None and (stack._sf_config["heads"], stack._sf_config["dim_head"]) != (heads, dim_head):
            raise ValueError(f"FreeTransformer.{name}: its heads / dim_head differ from decoder_tail's")
    enc_kwargs = _stack_options(enc, dim)
    dec_kwargs = _stack_options(tail, dim)
    if head is not None and _stack_options(head, dim) != dec_kwargs:
        diff = sorted(k for k in set(dec_kwargs) | set(_stack_options(head, dim))
                      if dec_kwargs.get(k) != _stack_options(head, dim).get(k))
        raise ValueError(f"FreeTransformer: decoder_head and decoder_tail differ in {diff} (safeformer's FreeTransformer "
                         f"gives both decoders the same dec_kwargs)")
    out = FreeTransformer(
        num_tokens=num_tokens, dim=dim, dec_head_depth=0 if head is None else head._sf_config["depth"],
        dec_tail_depth=tail._sf_config["depth"], max_seq_len=max_seq_len, enc_depth=enc._sf_config["depth"],
        attn_dim_head=dim_head, heads=heads, latent_bits=bits, per_token_latents=bool(model.per_token_latents),
        kl_loss_threshold=float(mapper.kl_loss_threshold), enc_kwargs=enc_kwargs, dec_kwargs=dec_kwargs,
        kl_loss_weight=float(model.kl_loss_weight), latent_dropout_prob=float(model.latent_dropout.p),
        pad_id=int(model.pad_id)).to(device=emb.weight.device, dtype=emb.weight.dtype)  # before the weights: exact copies
    for name, mine, theirs in (("encoder", out.encoder, enc), ("decoder_tail", out.decoder_tail, tail),
                               ("decoder_head", out.decoder_head, head)):
        if theirs is None:
            continue
        want, got = theirs._sf_config, mine._sf_config
        for key in sorted(set(want) & set(got) - {"dim_context"}):
            if want[key] != got[key]:
                raise ValueError(f"FreeTransformer.{name}: {key}={want[key]!r} does not carry over (got {got[key]!r})")
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("encoder.", "decoder_head.", "decoder_tail."))}
    for name, stack in (("encoder", enc), ("decoder_tail", tail), ("decoder_head", head)):
        if stack is not None:
            state.update({f"{name}.{k}": v for k, v in stack.state_dict().items()})
    try:
        out.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"FreeTransformer: the weights do not map onto safeformer's ({err})") from err
    return out.train(model.training)

# x-transformers' names that its module of this path imports from another (the same objects as there)
from ..core.xt_helpers import gumbel_sample  # noqa: E402, F401
from ..decoding.generation import top_k  # noqa: E402, F401
from ..stack.wrappers import TransformerWrapper  # noqa: E402, F401

# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.free_transformer", "FreeTransformer", free_transformer_from_x_transformers, takes_drop=True)
