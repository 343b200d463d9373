"""More of ``safeformer.interop.from_x_transformers``: the wrappers (``AutoregressiveWrapper``,
``XTransformer``), ALiBi, qk-norm, memory tokens and memory key/values, learned sinks, logit
softclamp, tied embeddings that stay tied, and ``return_only_embed``.

Every x-transformers model gets random weights (every parameter moved off its init, so norm gains,
sinks and memory matter), is converted, and must give the same outputs at every real position
(padding on the right: x-transformers numbers positions 0..n-1 whatever the mask) to 1e-5 relative
in float32, and the same parameter count (where safeformer adds parameters, such as the zero biases of
its LayerNorms, the test says how many). The wrappers must give the same loss and the same greedy
generations.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

xt = pytest.importorskip("x_transformers")

from x_transformers.autoregressive_wrapper import AutoregressiveWrapper as XTAutoregressiveWrapper  # noqa: E402

from safeformer import AutoregressiveWrapper, TransformerWrapper, XTransformer  # noqa: E402
from safeformer.interop import from_x_transformers  # noqa: E402
from safeformer.nn.modules import LayerNorm, alibi_slopes  # noqa: E402

logging.getLogger("x_transformers").setLevel(logging.ERROR)
try:  # x-transformers logs through loguru; silence its rotary-dim warning
    from loguru import logger as _loguru

    _loguru.disable("x_transformers")
except ImportError:  # pragma: no cover
    pass

V, N, B, DIM = 37, 9, 3, 32
LENGTHS = [N, 6, 2]  # right padding; no sample fully padded
RTOL = 1e-5  # float32, relative to the largest output


def perturb(model: nn.Module, seed: int = 1) -> nn.Module:
    """Every parameter moved off its init (zeros and ones included), in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen) * (p.detach().abs().mean() + 0.1))
    return model.eval()


def xt_net(layers: str = "Decoder", *, wrapper: dict | None = None, heads: int = 4, dim_head: int = 8,
           seed: int = 0, **layer_kwargs) -> nn.Module:
    torch.manual_seed(seed)
    model = xt.TransformerWrapper(
        num_tokens=V, max_seq_len=16,
        attn_layers=getattr(xt, layers)(dim=DIM, depth=2, heads=heads, attn_dim_head=dim_head, **layer_kwargs),
        **(wrapper or {}),
    )
    return perturb(model, seed + 1)


def right_padded(lengths=LENGTHS, n: int = N, vocab: int = V, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (len(lengths), n), generator=gen)
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return x, mask


def context_kwargs(width: int = DIM, seed: int = 5) -> dict:
    gen = torch.Generator().manual_seed(seed)
    context = torch.randn(B, 5, width, generator=gen)
    context_mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 1])[:, None]  # every sample keeps a key
    return dict(context=context, context_mask=context_mask)


def assert_rel_close(want: torch.Tensor, got: torch.Tensor, mask: torch.Tensor | None = None, rtol: float = RTOL) -> None:
    w, g = (want, got) if mask is None else (want[mask], got[mask])
    assert torch.isfinite(w).all() and torch.isfinite(g).all()
    scale = w.abs().max().item()
    assert scale > 0.1, "outputs too small for the comparison to say anything"
    err = (w - g).abs().max().item()
    assert err <= rtol * scale, f"max |x-transformers - safeformer| = {err:.3g} > {rtol} * {scale:.3g}"


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared parameters counted once


def compare_logits(model: nn.Module, sf: nn.Module, cross: bool = False) -> None:
    x, mask = right_padded()
    kw = context_kwargs() if cross else {}
    with torch.no_grad():
        want, got = model(x, mask=mask, **kw), sf(x, mask=mask, **kw)
    assert got.shape == want.shape
    assert_rel_close(want, got, mask)


# ----------------------------------------------------------------------------------------------------
# (a) AutoregressiveWrapper
# ----------------------------------------------------------------------------------------------------


AR_NETS = {
    "rotary_gqa": dict(rotary_pos_emb=True, rotary_emb_dim=8, attn_kv_heads=2),
    "rotary_gqa_cross": dict(rotary_pos_emb=True, rotary_emb_dim=8, attn_kv_heads=2, cross_attend=True),
    # x-transformers decodes memory tokens without a KV cache; safeformer caches them from the first call
    "alibi_memory_qk_norm": dict(alibi_pos_bias=True, attn_qk_norm=True, attn_num_mem_kv=1,
                                 wrapper=dict(use_abs_pos_emb=False, num_memory_tokens=2)),
}


@pytest.mark.parametrize("name", list(AR_NETS))
def test_autoregressive_wrapper_loss_and_greedy_generation(name):
    cfg = dict(AR_NETS[name])
    cross = cfg.get("cross_attend", False)
    net = xt_net(use_rmsnorm=True, wrapper=cfg.pop("wrapper", None), **cfg)
    ar = XTAutoregressiveWrapper(net, ignore_index=-1, pad_value=2).eval()
    sf = from_x_transformers(ar)
    assert isinstance(sf, AutoregressiveWrapper) and not sf.training
    assert (sf.ignore_index, sf.pad_value) == (-1, 2)
    assert n_params(sf) == n_params(ar)  # x-transformers' parameters, no more (the state dicts load strictly)

    kw = context_kwargs() if cross else {}
    x, mask = right_padded()
    x = x.masked_fill(~mask, -1)  # x-transformers' way: padding is ignore_index
    with torch.no_grad():
        want, got = ar(x, **kw), sf(x, **kw)
    assert want > 0.5
    assert abs(want.item() - got.item()) <= RTOL * want.item()

    prompts = right_padded(lengths=[3] * B, n=3, seed=7)[0]
    want_tokens = ar.generate(prompts, 6, temperature=0.0, **kw)
    got_tokens = sf.generate(prompts, 6, temperature=0.0, **kw)
    assert got_tokens.shape == (B, 6)
    assert torch.equal(want_tokens, got_tokens)


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda: XTAutoregressiveWrapper(xt_net(), mask_prob=0.15), "mask_prob"),
        (lambda: XTAutoregressiveWrapper(xt_net("Encoder")), "non-causal"),
        (lambda: XTAutoregressiveWrapper(xt_net(attn_gumbel_softmax=True)), "attn_gumbel_softmax (sampled) (at net"),
    ],
    ids=["mask_prob", "encoder", "net_option"],
)
def test_autoregressive_wrapper_refusals(make, expected):
    with pytest.raises(ValueError, match="cannot represent") as info:
        from_x_transformers(make())
    assert expected in str(info.value)


# ----------------------------------------------------------------------------------------------------
# (b) XTransformer
# ----------------------------------------------------------------------------------------------------

XT_SMALL = dict(dim=DIM, enc_num_tokens=V, enc_depth=2, enc_heads=4, enc_max_seq_len=16, enc_attn_dim_head=8,
                dec_depth=2, dec_heads=4, dec_max_seq_len=16, dec_attn_dim_head=8)


def build_xtransformer(*, enc_part: dict | None = None, dec_part: dict | None = None, **kwargs) -> nn.Module:
    """A random x-transformers XTransformer. ``enc_part`` / ``dec_part``: ``model.encoder`` /
    ``model.decoder.net`` replaced by a TransformerWrapper with these wrapper options (and ``layers=``
    layer options), for what x-transformers' XTransformer does not pass on (``l2norm_embed``,
    ``tie_embedding``, a decoder's ``num_memory_tokens``) but a model assembled from parts has."""
    torch.manual_seed(0)
    cfg = {**XT_SMALL, "dec_num_tokens": V, "ignore_index": -1, "pad_value": 0, **kwargs}
    model = xt.XTransformer(**cfg)
    for part, side in ((enc_part, "enc"), (dec_part, "dec")):
        if part is None:
            continue
        part = dict(part)
        layers = {"dim": DIM, "depth": 2, "heads": 4, "attn_dim_head": 8, **part.pop("layers", {})}
        if side == "enc":
            model.encoder = xt.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=xt.Encoder(**layers),
                                                  **{"return_only_embed": True, **part})
        else:
            model.decoder.net = xt.TransformerWrapper(num_tokens=cfg["dec_num_tokens"], max_seq_len=16,
                                                      attn_layers=xt.Decoder(cross_attend=True, **layers), **part)
    return perturb(model)


def compare_xtransformer(model: nn.Module, sf: nn.Module, dec_vocab: int = V) -> None:
    """Same loss (right-padded source and targets) and the same greedy generations."""
    src, src_mask = right_padded()
    tgt, tgt_mask = right_padded(lengths=[7, 4, 3], n=7, vocab=dec_vocab, seed=3)
    tgt = tgt.masked_fill(~tgt_mask, -1)
    with torch.no_grad():
        want, got = model(src, tgt, mask=src_mask), sf(src, tgt, mask=src_mask)
    assert want > 0.5
    assert abs(want.item() - got.item()) <= RTOL * want.item()

    start = torch.full((B, 1), 1)
    want_tokens = model.generate(src, start, 5, mask=src_mask, temperature=0.0)
    got_tokens = sf.generate(src, start, 5, mask=src_mask, temperature=0.0)
    assert got_tokens.shape == (B, 5)
    assert torch.equal(want_tokens, got_tokens)


# x-transformers XTransformers whose encoder and decoder differ (enc_<option> / dec_<option>), and the
# options safeformer's XTransformer must then take per side (enc_options / dec_options)
XT_PER_SIDE = {
    "mixed": (dict(enc_rotary_pos_emb=True, dec_attn_num_mem_kv=2, enc_use_rmsnorm=True, dec_ff_glu=True,
                   enc_attn_qk_norm=True, dec_attn_kv_heads=1),
              dict(enc=dict(use_rmsnorm=True, norm_eps=1e-12, attn_qk_norm=True, rotary_emb_dim=4,
                            use_abs_pos_emb=False),
                   dec=dict(kv_heads=1, ff_glu=True, use_rmsnorm=False, rotary_pos_emb=False, attn_num_mem_kv=2))),
    "shapes_alibi_qk_scale": (dict(dec_attn_dim_head=16, enc_attn_kv_heads=2, enc_ff_mult=2, dec_ff_swish=True,
                                   dec_use_rmsnorm=True, dec_attn_qk_norm=True, dec_attn_qk_norm_scale=4,
                                   dec_alibi_pos_bias=True, dec_use_abs_pos_emb=False),
                              dict(enc=dict(kv_heads=2, ff_mult=2.0),
                                   dec=dict(dim_head=16, kv_heads=None, ff_swish=True, use_rmsnorm=True,
                                            alibi_pos_bias=True, attn_qk_norm=True, use_abs_pos_emb=False))),
    "memory_sink_softclamp": (dict(enc_num_memory_tokens=3, enc_attn_head_learned_sink=True, enc_ff_no_bias=True,
                                   dec_attn_softclamp_logits=True, dec_attn_logit_softclamp_value=3.0,
                                   dec_rotary_pos_emb=True, dec_rotary_emb_dim=8, enc_emb_dropout=0.1),
                              dict(enc=dict(num_memory_tokens=3, attn_head_learned_sink=True, emb_dropout=0.1),
                                   dec=dict(rotary_pos_emb=True, rotary_emb_dim=8, attn_softclamp_logits=True,
                                            attn_logit_softclamp_value=3.0))),
    # parts x-transformers' XTransformer cannot build itself (it passes these options on to the layers)
    "parts_l2norm_tied_memory": (dict(enc_part=dict(l2norm_embed=True),
                                      dec_part=dict(tie_embedding=True, num_memory_tokens=2, l2norm_embed=True)),
                                 dict(enc=dict(l2norm_embed=True),
                                      dec=dict(tie_embedding=True, num_memory_tokens=2, l2norm_embed=True))),
}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tie_token_emb=True),
        dict(dec_num_tokens=29, pad_value=3),
        dict(enc_heads=2, dec_heads=2, enc_attn_dim_head=64, dec_attn_dim_head=64, enc_rotary_pos_emb=True,
             dec_rotary_pos_emb=True, dec_ff_glu=True, enc_ff_glu=True),
        dict(enc_use_rmsnorm=True, dec_use_rmsnorm=True),  # RMS norms convert with norm_eps 1e-12 on each side
        *(kw for kw, _ in XT_PER_SIDE.values()),
    ],
    ids=["tied_token_emb", "untied_pad3", "rotary_glu", "rmsnorm", *XT_PER_SIDE],
)
def test_xtransformer_loss_and_greedy_generation(kwargs):
    model = build_xtransformer(**kwargs)
    sf = from_x_transformers(model)
    assert isinstance(sf, XTransformer) and not sf.training
    tied = kwargs.get("tie_token_emb", False)
    assert (sf.decoder.net.token_emb is sf.encoder.token_emb) == tied
    # safeformer's LayerNorms are x-transformers' (no bias)
    assert all(m.bias is None for m in sf.modules() if isinstance(m, LayerNorm))
    assert n_params(sf) == n_params(model)  # x-transformers' parameters, no more
    compare_xtransformer(model, sf, dec_vocab=kwargs.get("dec_num_tokens", V))


@pytest.mark.parametrize("name", list(XT_PER_SIDE))
def test_xtransformer_per_side_options_land_in_enc_and_dec_options(name):
    """The converted XTransformer's config says each side's options (what from_pretrained rebuilds):
    its shared layer arguments, overridden by enc_options / dec_options."""
    kwargs, expected = XT_PER_SIDE[name]
    sf = from_x_transformers(build_xtransformer(**kwargs))
    cfg = sf.get_config()
    shared = ("dim_head", "kv_heads", "rotary_pos_emb", "ff_glu", "use_rmsnorm", "attn_dropout", "ff_dropout")
    for side in ("enc", "dec"):
        options = {**{k: cfg[k] for k in shared}, **(cfg[f"{side}_options"] or {})}
        for key, value in expected[side].items():
            assert options.get(key) == value, (side, key, options)


def test_xtransformer_per_side_options_survive_save_and_load(tmp_path):
    kwargs = XT_PER_SIDE["mixed"][0]
    model = build_xtransformer(**kwargs)
    sf = from_x_transformers(model)
    sf.save_pretrained(tmp_path)
    loaded = XTransformer.from_pretrained(tmp_path).eval()
    assert loaded.get_config() == sf.get_config()
    assert loaded.encoder.attn_layers.get_config() == sf.encoder.attn_layers.get_config()
    assert loaded.decoder.net.attn_layers.get_config() == sf.decoder.net.attn_layers.get_config()
    src, src_mask = right_padded()
    tgt = right_padded(lengths=[7, 4, 3], n=7, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(loaded(src, tgt, mask=src_mask), sf(src, tgt, mask=src_mask))
    compare_xtransformer(model, loaded)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(cross_attn_tokens_dropout=0.1), "drop_training_only"),
        (dict(enc_attn_gumbel_softmax=True), "attn_gumbel_softmax (sampled) (at encoder"),
        # what safeformer's XTransformer itself cannot express
        (dict(enc_part=dict(return_only_embed=False)), "an encoder with an output head"),
        (dict(dec_part=dict(logits_dim=5)), "logits_dim=5 != num_tokens=37"),
        (dict(enc_part=dict(use_cls_token=True)), "use_cls_token=True (safeformer's XTransformer takes no "
                                                   "enc_use_cls_token option) (at encoder)"),
        (dict(enc_part=dict(layers=dict(dim=16)), dec_part=dict(layers=dict(cross_attn_dim_context=16))),
         "encoder dim=16 and decoder dim=32"),
    ],
    ids=["tokens_dropout", "encoder_option", "encoder_head", "decoder_logits_dim",
         "encoder_cls_token", "different_dims"],
)
def test_xtransformer_refusals_name_the_option(kwargs, expected):
    with pytest.raises(ValueError, match="cannot represent") as info:
        from_x_transformers(build_xtransformer(**kwargs))
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in str(info.value)


# ----------------------------------------------------------------------------------------------------
# (c) ALiBi
# ----------------------------------------------------------------------------------------------------


def test_alibi_slopes_equal_x_transformers():
    for heads in range(1, 17):
        want = torch.tensor(xt.x_transformers.AlibiPositionalBias._get_slopes(heads), dtype=torch.float64)
        assert torch.allclose(alibi_slopes(heads).double(), want, rtol=1e-6, atol=0), heads


ALIBI = {
    "decoder": dict(),
    "encoder_6_heads": dict(layers="Encoder", heads=6),
    "decoder_flash_mqa": dict(attn_flash=True, attn_one_kv_head=True),
    "decoder_cross": dict(cross_attend=True),
    "decoder_softclamp": dict(attn_softclamp_logits=True, attn_logit_softclamp_value=2.0),  # bias, then clamp
}


@pytest.mark.parametrize("name", list(ALIBI))
def test_alibi_logits_match(name):
    cfg = dict(ALIBI[name])
    model = xt_net(cfg.pop("layers", "Decoder"), wrapper=dict(use_abs_pos_emb=False), use_rmsnorm=True,
                   alibi_pos_bias=True, **cfg)
    sf = from_x_transformers(model)
    assert sf.attn_layers.alibi_slopes is not None and sf.pos_emb is None
    assert n_params(sf) == n_params(model)
    compare_logits(model, sf, cross=cfg.get("cross_attend", False))


def test_alibi_sign_matters():
    """Flipping the slopes' sign moves the logits: the comparison above does see ALiBi."""
    model = xt_net(wrapper=dict(use_abs_pos_emb=False), use_rmsnorm=True, alibi_pos_bias=True)
    sf = from_x_transformers(model)
    x, mask = right_padded()
    sf.attn_layers.alibi_slopes.neg_()
    with torch.no_grad():
        err = (model(x, mask=mask) - sf(x, mask=mask))[mask].abs().max().item()
    assert err > 1e-2


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(rotary_pos_emb=True), "rotary_pos_emb and alibi_pos_bias"),
    ],
    ids=["with_rotary"],
)
def test_alibi_refusals(kwargs, expected):
    with pytest.raises(ValueError, match="cannot represent") as info:
        from_x_transformers(xt_net(alibi_pos_bias=True, **kwargs))
    assert expected in str(info.value)


# ----------------------------------------------------------------------------------------------------
# (d) qk-norm
# ----------------------------------------------------------------------------------------------------

QK_NORM = {
    "decoder_scale_10": dict(),
    "cross_gqa": dict(cross_attend=True, attn_kv_heads=2),
    "flash_scale_4": dict(attn_flash=True, attn_qk_norm_scale=4),
    "encoder_mqa": dict(layers="Encoder", attn_one_kv_head=True),
}


@pytest.mark.parametrize("name", list(QK_NORM))
def test_qk_norm_logits_match(name):
    cfg = dict(QK_NORM[name])
    model = xt_net(cfg.pop("layers", "Decoder"), use_rmsnorm=True, attn_qk_norm=True, **cfg)
    sf = from_x_transformers(model)
    attns = [layer.mixer for kind, layer in zip(sf.attn_layers.layer_kinds, sf.attn_layers.layers) if kind != "ff"]
    d = 8
    scale = cfg.get("attn_qk_norm_scale", 10)
    for a in attns:  # x-transformers' qk-norm: its scale, no parameter
        assert a.qk_norm_scale == scale and a.qk_norm_q_scale is None
        assert a.q_norm.mult == pytest.approx(math.sqrt(scale * math.sqrt(d)))
    assert n_params(sf) == n_params(model)
    compare_logits(model, sf, cross=cfg.get("cross_attend", False))


def test_qk_norm_dim_scale_shared_by_heads_converts():
    """Learned per-head scales convert (into attn_qk_norm_dim_scale's per-head gains: as many parameters as
    x-transformers'), here with scales the same for every head."""
    model = xt_net(use_rmsnorm=True, attn_qk_norm=True, attn_qk_norm_dim_scale=True, attn_kv_heads=2)
    gen = torch.Generator().manual_seed(4)
    n_attn, extra = 0, 0
    with torch.no_grad():
        for _, blk, _ in model.attn_layers.layers:
            if isinstance(blk, xt.x_transformers.Attention):
                n_attn += 1
                extra += blk.qk_norm_q_scale.numel() + blk.qk_norm_k_scale.numel()
                a, b = 1.5 + torch.randn(8, generator=gen), 1.5 + torch.randn(8, generator=gen)  # one per feature
                blk.qk_norm_q_scale.copy_(a.expand_as(blk.qk_norm_q_scale))
                blk.qk_norm_k_scale.copy_(b.expand_as(blk.qk_norm_k_scale))
    sf = from_x_transformers(model)
    assert extra and n_params(sf) == n_params(model)
    compare_logits(model, sf)


def test_qk_norm_dim_scale_per_head_converts():
    """Per-head scales that differ between heads convert too (attn_qk_norm_dim_scale keeps them per head)."""
    model = xt_net(use_rmsnorm=True, attn_qk_norm=True, attn_qk_norm_dim_scale=True, attn_kv_heads=2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, blk, _ in model.attn_layers.layers:
            if isinstance(blk, xt.x_transformers.Attention):
                blk.qk_norm_q_scale.add_(torch.randn(blk.qk_norm_q_scale.shape, generator=gen) * 0.3)
                blk.qk_norm_k_scale.add_(torch.randn(blk.qk_norm_k_scale.shape, generator=gen) * 0.3)
    compare_logits(model, from_x_transformers(model))


def test_qk_norm_groups_convert():
    """x-transformers' qk_norm_groups (the L2 norm over groups of a head's features) carries over."""
    model = xt_net(use_rmsnorm=True, attn_qk_norm=True, attn_qk_norm_groups=2)
    sf = from_x_transformers(model)
    assert all(layer.mixer.qk_norm_groups == 2 for layer in sf.attn_layers.layers if layer.kind != "ff")
    compare_logits(model, sf)


# ----------------------------------------------------------------------------------------------------
# (e) memory tokens, memory key/values, learned sinks, logit softclamp
# ----------------------------------------------------------------------------------------------------

MEMORY = {
    "memory_tokens": dict(wrapper=dict(num_memory_tokens=3)),
    "memory_tokens_rotary": dict(wrapper=dict(num_memory_tokens=3), rotary_pos_emb=True, rotary_emb_dim=8),
    "memory_tokens_alibi_encoder": dict(layers="Encoder", wrapper=dict(num_memory_tokens=3, use_abs_pos_emb=False),
                                        alibi_pos_bias=True),
    "mem_kv_cross": dict(attn_num_mem_kv=2, cross_attend=True),
    "mem_kv_qk_norm_gqa_rotary": dict(attn_num_mem_kv=2, attn_qk_norm=True, attn_kv_heads=2, rotary_pos_emb=True,
                                      rotary_emb_dim=8),
    "mem_kv_alibi_memory_tokens": dict(attn_num_mem_kv=2, alibi_pos_bias=True,
                                       wrapper=dict(num_memory_tokens=2, use_abs_pos_emb=False)),
    "sink_gqa": dict(attn_head_learned_sink=True, attn_kv_heads=2),
    "softclamp": dict(attn_softclamp_logits=True, attn_logit_softclamp_value=3.0),
    "sink_softclamp_mem_kv": dict(attn_head_learned_sink=True, attn_softclamp_logits=True,
                                  attn_logit_softclamp_value=3.0, attn_num_mem_kv=2),
}


@pytest.mark.parametrize("name", list(MEMORY))
def test_memory_sink_softclamp_logits_match(name):
    cfg = dict(MEMORY[name])
    model = xt_net(cfg.pop("layers", "Decoder"), wrapper=cfg.pop("wrapper", None), use_rmsnorm=True, **cfg)
    sinks = []
    with torch.no_grad():  # sinks far from 0 (and from each other), so that they matter and their order shows
        for _, blk, _ in model.attn_layers.layers:
            if getattr(getattr(blk, "attend", None), "head_attn_sink", None) is not None:
                blk.attend.head_attn_sink.copy_(torch.tensor([2.5, -1.0, 1.5, 0.5]))
                sinks.append(blk.attend.head_attn_sink)
    sf = from_x_transformers(model)
    assert n_params(sf) == n_params(model)
    if sinks:  # the heads keep x-transformers' order (grouped-query heads tiled in both): the sinks as they are
        assert torch.equal(sf.attn_layers.layers[0][1].attend.head_attn_sink, sinks[0])
    compare_logits(model, sf, cross=cfg.get("cross_attend", False))


# ----------------------------------------------------------------------------------------------------
# (f) tied embeddings stay tied; return_only_embed; a round trip through save / load
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.7], ids=["default_scale", "scale_0.7"])
def test_tied_embedding_stays_tied(scale):
    model = xt_net(use_rmsnorm=True, wrapper=dict(tie_embedding=True, tie_embedding_scale=scale))
    sf = from_x_transformers(model)
    assert sf.tie_embedding and sf.to_logits is None
    assert sf.tie_embedding_scale == pytest.approx(DIM**-0.5 if scale is None else scale)
    assert n_params(sf) == n_params(model)  # no untied copy of the embedding
    compare_logits(model, sf)


def test_return_only_embed_encoder():
    model = xt_net("Encoder", use_rmsnorm=True, wrapper=dict(return_only_embed=True))
    sf = from_x_transformers(model)
    assert sf.to_logits is None and n_params(sf) == n_params(model)
    compare_logits(model, sf)


def test_converted_options_survive_save_and_load(tmp_path):
    model = xt_net(use_rmsnorm=True, alibi_pos_bias=True, attn_qk_norm=True, attn_num_mem_kv=2,
                   attn_head_learned_sink=True, wrapper=dict(use_abs_pos_emb=False, num_memory_tokens=2,
                                                             tie_embedding=True))
    sf = from_x_transformers(model)
    sf.save_pretrained(tmp_path)
    loaded = TransformerWrapper.from_pretrained(tmp_path).eval()
    x, mask = right_padded()
    with torch.no_grad():
        want = model(x, mask=mask)
        assert torch.equal(loaded(x, mask=mask), sf(x, mask=mask))
    assert_rel_close(want, loaded(x, mask=mask).detach(), mask)
