"""Tests for ``safeformer.interop.from_x_transformers`` against the installed x-transformers release.

Every x-transformers model gets random weights (every parameter moved away from its init, so norm
gains and biases matter), is converted, and must give the same logits at every real position:
to 1e-5 in float32, and to 1e-10 in float64 where neither library computes in
float32 internally (which shows the conversion is exact, not merely close). Padding is on the right (x-transformers numbers positions 0..n-1 whatever
the mask) and no row is dead in these comparisons (x-transformers' dead rows are its own business).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

xt = pytest.importorskip("x_transformers")

from safeformer import TransformerWrapper  # noqa: E402
from safeformer.interop import from_x_transformers  # noqa: E402
from safeformer.nn.modules import RMSNorm  # noqa: E402

logging.getLogger("x_transformers").setLevel(logging.ERROR)
try:  # x-transformers logs through loguru; silence its rotary-dim warning
    from loguru import logger as _loguru

    _loguru.disable("x_transformers")
except ImportError:  # pragma: no cover
    pass

V, N, B, DIM = 37, 9, 3, 32

CONFIGS = {
    "decoder": dict(layers="Decoder"),
    "encoder": dict(layers="Encoder"),
    "decoder_cross": dict(layers="Decoder", cross_attend=True),
    "decoder_cross_dim_context": dict(layers="Decoder", cross_attend=True, cross_attn_dim_context=24),
    "encoder_cross_rmsnorm": dict(layers="Encoder", cross_attend=True, use_rmsnorm=True),
    "cross_attender": dict(layers="CrossAttender"),
    "rmsnorm_rotary": dict(layers="Decoder", use_rmsnorm=True, rotary_pos_emb=True),
    "rotary_full_dim": dict(layers="Decoder", rotary_pos_emb=True, rotary_emb_dim=8),
    "simple_rmsnorm": dict(layers="Encoder", use_simple_rmsnorm=True),
    "scalenorm": dict(layers="Decoder", use_scalenorm=True),
    "no_unit_offset": dict(layers="Decoder", norm_add_unit_offset=False, use_rmsnorm=True),
    "glu_gqa": dict(layers="Decoder", ff_glu=True, attn_kv_heads=2, cross_attend=True),
    "swiglu_mqa_mult_bias_no_bias": dict(
        layers="Decoder", ff_glu=True, ff_swish=True, attn_one_kv_head=True, ff_glu_mult_bias=True, ff_no_bias=True
    ),
    "silu_ff_mult3": dict(layers="Encoder", ff_swish=True, ff_mult=3),
    "flash_cross_gqa": dict(layers="Decoder", attn_flash=True, cross_attend=True, attn_kv_heads=2, rotary_pos_emb=True),
    "one_head": dict(layers="Encoder", heads=1, attn_dim_head=DIM),
    "tied": dict(layers="Decoder", wrapper=dict(tie_embedding=True)),
    "logits_dim_no_abs": dict(layers="Encoder", wrapper=dict(logits_dim=5, use_abs_pos_emb=False)),
    "rotary_rescaled_interpolated": dict(layers="Decoder", rotary_pos_emb=True, rotary_base_rescale_factor=2.0,
                                         rotary_interpolation_factor=2.0),
    "gated_gqa_cross": dict(layers="Decoder", attn_kv_heads=2, cross_attend=True, attn_gate_values=True,
                            attn_output_gate=True, attn_output_gate_headwise=True),
    "gated_low_rank_swiglu": dict(layers="Encoder", attn_gate_values=True, attn_gate_values_rank=4,
                                  attn_swiglu_values=True, attn_output_gate=True, attn_output_gate_rank=4,
                                  attn_low_rank_silu_gates=False),
}


def build_xt(cfg: dict, seed: int = 0) -> nn.Module:
    """An x-transformers TransformerWrapper with every parameter moved off its init."""
    cfg = dict(cfg)
    layers_cls = getattr(xt, cfg.pop("layers"))
    wrapper = cfg.pop("wrapper", {})
    heads = cfg.pop("heads", 4)
    dim_head = cfg.pop("attn_dim_head", 8)
    torch.manual_seed(seed)
    model = xt.TransformerWrapper(
        num_tokens=V, max_seq_len=16, attn_layers=layers_cls(dim=DIM, depth=2, heads=heads, attn_dim_head=dim_head, **cfg),
        **wrapper,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen) * (p.detach().abs().mean() + 0.1))
    return model.eval()


def inputs(cfg: dict, dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tokens, a right-padding mask (no fully padded sample) and, for cross-attention, a context."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, N), generator=gen)
    lengths = [N, 6, 2]
    mask = torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]
    kwargs = {}
    if cfg.get("cross_attend") or cfg["layers"] == "CrossAttender":
        width = cfg.get("cross_attn_dim_context", DIM)
        context = torch.randn(B, 5, width, generator=gen, dtype=torch.float64).to(dtype)
        context_mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 1])[:, None]  # every sample keeps >= 1 key
        kwargs = dict(context=context, context_mask=context_mask)
    return x, mask, kwargs


def assert_match(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, atol: float) -> None:
    ra, rb = a[mask], b[mask]
    assert torch.isfinite(ra).all() and torch.isfinite(rb).all(), "non-finite logits at real positions"
    err = (ra - rb).abs().max().item()
    assert err <= atol, f"max |x-transformers - safeformer| at real positions = {err:.3g} > {atol}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_float32(name):
    cfg = CONFIGS[name]
    model = build_xt(cfg)
    sf = from_x_transformers(model)
    assert isinstance(sf, TransformerWrapper)
    x, mask, kw = inputs(cfg)
    with torch.no_grad():
        want, got = model(x, mask=mask, **kw), sf(x, mask=mask, **kw)
    assert got.shape == want.shape
    assert_match(want, got, mask, atol=1e-5)
    # the logits must not be trivially small: the comparison would then say nothing
    assert want[mask].abs().max() > 0.1


# float64 with x-transformers' flash path (its other path takes the softmax in float32), on configs
# without RMS norms or rotary positions (safeformer computes those in float32, also for float64 input).
@pytest.mark.parametrize("name", ["decoder_cross_dim_context", "glu_gqa", "swiglu_mqa_mult_bias_no_bias", "one_head", "tied"])
def test_logits_match_float64_exactly(name):
    cfg = {**CONFIGS[name], "attn_flash": True}
    model = build_xt(cfg).double()
    sf = from_x_transformers(model)
    assert next(sf.parameters()).dtype == torch.float64
    x, mask, kw = inputs(cfg, dtype=torch.float64)
    with torch.no_grad():
        want, got = model(x, mask=mask, **kw), sf(x, mask=mask, **kw)
    assert_match(want, got, mask, atol=1e-10)


def test_gqa_heads_keep_x_transformers_order():
    """x-transformers pairs query head n with kv head n % h_kv, and so does safeformer (``kv_head_order="tiled"``):
    the weights carry over unpermuted. Earlier safeformer's interleaved pairing (``n // g``) on the same weights
    gives other logits."""
    cfg = dict(layers="Decoder", attn_kv_heads=2)
    model = build_xt(cfg)
    sf = from_x_transformers(model)
    x, mask, kw = inputs(cfg)
    assert torch.equal(sf.attn_layers.layers[0][1].to_q.weight, model.attn_layers.layers[0][1].to_q.weight)
    with torch.no_grad():
        want = model(x, mask=mask)
        assert_match(want, sf(x, mask=mask), mask, atol=1e-5)
        other = type(sf)(**{**sf._sf_config, "attn_layers": type(sf.attn_layers)(**{
            **sf.attn_layers._sf_config, "attn_kwargs": {"kv_head_order": "interleaved"}})})
        other.load_state_dict(sf.state_dict())
        err = (other(x, mask=mask) - want)[mask].abs().max().item()
    assert err > 1e-3


def test_training_gradients_match():
    """One backward pass: the converted model's gradient of the token embedding equals x-transformers'."""
    cfg = dict(layers="Decoder", cross_attend=True, ff_glu=True)
    model = build_xt(cfg)
    sf = from_x_transformers(model)
    x, mask, kw = inputs(cfg)
    w = torch.randn(B, N, V, generator=torch.Generator().manual_seed(3)) * mask[..., None]
    (model(x, mask=mask, **kw) * w).sum().backward()
    (sf(x, mask=mask, **kw) * w).sum().backward()
    g_xt, g_sf = model.token_emb.emb.weight.grad, sf.token_emb.weight.grad
    assert torch.isfinite(g_sf).all()
    assert (g_xt - g_sf).abs().max().item() <= 1e-5 * max(1.0, g_xt.abs().max().item())
    assert g_xt.abs().max() > 0


def test_keeps_training_mode_and_rms_eps():
    model = build_xt(dict(layers="Decoder", use_rmsnorm=True)).train()
    sf = from_x_transformers(model)
    assert sf.training
    norms = [m for m in sf.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 5 and all(n.eps == 1e-12 for n in norms)
    assert not from_x_transformers(model.eval()).training


def test_converted_model_is_safe_where_the_context_is_empty():
    """The point of converting: an all-False context mask, and NaN in padded context, are harmless."""
    cfg = dict(layers="Decoder", cross_attend=True)
    sf = from_x_transformers(build_xt(cfg))
    x, mask, kw = inputs(cfg)
    context, context_mask = kw["context"].clone(), kw["context_mask"].clone()
    context_mask[1] = False  # sample 1: condition dropped
    context[~context_mask] = float("nan")
    context.requires_grad_(True)
    out = sf(x, mask=mask, context=context, context_mask=context_mask)
    with torch.no_grad():
        alone = sf(x[1:2], mask=mask[1:2])  # sample 1 with no context at all
    assert torch.equal(out[1][mask[1]], alone[0][mask[1]])
    (out * mask[..., None]).sum().backward()
    assert torch.isfinite(context.grad).all() and (context.grad[~context_mask] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in sf.parameters() if p.grad is not None)


# what from_x_transformers still refuses (the options it converts have parity tests: test_interop_options.py,
# test_xt_keywords.py, test_qk_rmsnorm.py)
UNSUPPORTED = [
    (dict(attn_gate_value_heads=True), "attn_gate_value_heads"),
    (dict(add_value_residual=True, attn_kv_heads=1), "learned_value_residual_mix with grouped"),
    (dict(num_residual_streams=2), "num_residual_streams"),
    (dict(layer_dropout=0.1), "layer_dropout"),
]


@pytest.mark.parametrize("kwargs,expected", UNSUPPORTED, ids=[e for _, e in UNSUPPORTED])
def test_unsupported_options_raise_naming_them(kwargs, expected):
    kwargs = dict(kwargs)
    wrapper = kwargs.pop("wrapper", {})
    depth = kwargs.pop("depth", 2)
    model = xt.TransformerWrapper(
        num_tokens=V, max_seq_len=16, attn_layers=xt.Decoder(dim=16, depth=depth, heads=2, **kwargs), **wrapper
    )
    with pytest.raises(ValueError, match="cannot represent") as info:
        from_x_transformers(model)
    assert expected in str(info.value)


def test_all_unsupported_options_listed_at_once():
    model = xt.TransformerWrapper(
        num_tokens=V, max_seq_len=16, attn_layers=xt.Decoder(dim=16, depth=1, heads=2, num_residual_streams=2,
                                                             attn_gumbel_softmax=True),
    )
    with pytest.raises(ValueError) as info:
        from_x_transformers(model)
    text = str(info.value)
    assert all(opt in text for opt in ("num_residual_streams", "attn_gumbel_softmax"))


def test_drop_training_only_converts_and_matches_in_eval():
    cfg = dict(layers="Decoder", layer_dropout=0.1, cross_attend=True, cross_attn_tokens_dropout=0.2)
    model = build_xt(cfg)
    with pytest.raises(ValueError, match="drop_training_only"):
        from_x_transformers(model)
    sf = from_x_transformers(model, drop_training_only=True)
    x, mask, kw = inputs(cfg)
    with torch.no_grad():
        assert_match(model(x, mask=mask, **kw), sf(x, mask=mask, **kw), mask, atol=1e-5)


def test_rejects_other_models():
    with pytest.raises(TypeError, match="x_transformers.TransformerWrapper"):
        from_x_transformers(nn.Linear(2, 2))
