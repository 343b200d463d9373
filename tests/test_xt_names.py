"""x-transformers' public names in safeformer, with x-transformers' constructors, calls and returns.

Each name is compared with x-transformers' own module on the same weights (float64, so the only
differences are the norms' epsilon), and checked for the safety contract where it takes masks: NaN
planted at masked positions reaches nothing, rows with no key are exact zeros. The door registry
(``tests/doors.py``) runs the S1-S9 probes on each of them too.
"""

from __future__ import annotations

import importlib

import helpers as hp
import pytest
import torch
from helpers import perturb_params

import safeformer as sf

NAN = float("nan")
xt = pytest.importorskip("x_transformers")
xx = importlib.import_module("x_transformers.x_transformers")

F64 = torch.float64


def _perturb(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter moved off its init (ones-initialised tables and zero-initialised projections included)."""
    return perturb_params(module, seed, relative=True)


# ---------------------------------------------------------------------------------------------------
# every name importable from safeformer and from the alias modules
# ---------------------------------------------------------------------------------------------------

NAMES = ["AdaptiveRMSNorm", "RMSNorm", "FeedForward", "AttentionLayers", "RotaryEmbedding", "LayerIntermediates",
         "TransformerBlock", "PrefixDecoder", "ViTransformerWrapper", "AttentionPool", "eval_decorator", "top_k",
         "top_p", "min_p", "Attention", "Encoder", "Decoder", "CrossAttender", "TransformerWrapper", "XTransformer",
         "AutoregressiveWrapper", "NonAutoregressiveWrapper", "ContinuousTransformerWrapper",
         "ContinuousAutoregressiveWrapper"]

MODULES = {  # x-transformers' module -> the names users import from it
    "x_transformers": ["XTransformer", "Encoder", "Decoder", "PrefixDecoder", "CrossAttender", "AttentionPool",
                       "Attention", "FeedForward", "RMSNorm", "AdaptiveRMSNorm", "TransformerWrapper",
                       "ViTransformerWrapper", "TransformerBlock", "AttentionLayers", "RotaryEmbedding",
                       "LayerIntermediates"],
    "autoregressive_wrapper": ["AutoregressiveWrapper", "eval_decorator", "top_k", "top_p", "min_p", "top_a"],
    "nonautoregressive_wrapper": ["NonAutoregressiveWrapper"],
    "continuous": ["ContinuousTransformerWrapper", "ContinuousAutoregressiveWrapper"],
}


@pytest.mark.parametrize("name", NAMES)
def test_name_is_importable_from_safeformer(name):
    assert name in sf.__all__ and getattr(sf, name) is not None
    assert hasattr(importlib.import_module("x_transformers"), name) or hasattr(xx, name) or \
        hasattr(importlib.import_module("x_transformers.autoregressive_wrapper"), name)


@pytest.mark.parametrize("module", list(MODULES))
def test_alias_modules_give_the_same_objects(module):
    """``from safeformer.<module> import X`` is ``from safeformer import X`` for x-transformers' module names."""
    ours = importlib.import_module(f"safeformer.{module}")
    theirs = importlib.import_module(f"x_transformers.{module}")
    for name in MODULES[module]:
        assert hasattr(theirs, name), f"x_transformers.{module} has no {name}"
        assert getattr(ours, name) is getattr(sf, name), f"safeformer.{module}.{name}"


# ---------------------------------------------------------------------------------------------------
# norms, feed-forward, rotary
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm_matches_x_transformers(unit_offset):
    theirs, ours = xx.RMSNorm(16, unit_offset=unit_offset).double(), sf.RMSNorm(16, unit_offset=unit_offset).double()
    with torch.no_grad():
        theirs.g.normal_()
        ours.g.copy_(theirs.g)
    x = torch.randn(3, 5, 16, dtype=F64)
    hp.assert_close(ours(x), theirs(x), "RMSNorm", torch.float32)  # eps 1e-6 against F.normalize's 1e-12
    with pytest.raises(TypeError, match="unit_offset"):
        sf.RMSNorm(16, 1e-5)  # the old positional eps: refused, never read as unit_offset


@pytest.mark.parametrize("per_position", [False, True])
def test_adaptive_rmsnorm_matches_x_transformers(per_position):
    theirs = _perturb(xx.AdaptiveRMSNorm(16, dim_condition=8).double())
    ours = sf.AdaptiveRMSNorm(16, dim_condition=8).double()
    ours.to_gamma.weight.data.copy_(theirs.to_gamma.weight)
    x = torch.randn(3, 5, 16, dtype=F64)
    cond = torch.randn(3, 5, 8, dtype=F64) if per_position else torch.randn(3, 8, dtype=F64)
    hp.assert_close(ours(x, condition=cond), theirs(x, condition=cond), "AdaptiveRMSNorm", torch.float32)
    x[1, 2:] = 0.0  # a padded (zero) row stays exactly 0
    assert bool(ours(x, condition=cond)[1, 2:].eq(0).all())
    with pytest.raises(ValueError, match="condition"):
        ours(x, condition=torch.randn(2, 8, dtype=F64))


@pytest.mark.parametrize("kwargs", [dict(), dict(dim_out=8), dict(no_bias=True), dict(relu_squared=True),
                                    dict(glu=True), dict(glu=True, swish=True), dict(mult=2, dim_out=4, no_bias=True)],
                         ids=["plain", "dim_out", "no_bias", "relu2", "geglu", "swiglu", "mixed"])
def test_feedforward_matches_x_transformers(kwargs):
    theirs = _perturb(xx.FeedForward(16, **kwargs).double())
    ours = sf.FeedForward(16, **kwargs).double()
    lin = [m for m in theirs.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for mine, other in zip((ours.proj_in, ours.proj_out), lin):
            mine.weight.copy_(other.weight)
            if mine.bias is not None:
                mine.bias.copy_(other.bias)
    x = torch.randn(3, 5, 16, dtype=F64)
    hp.assert_close(ours(x), theirs(x), f"FeedForward {kwargs}", F64)


def test_feedforward_zero_init_output_is_an_exact_no_op():
    ff = sf.FeedForward(16, zero_init_output=True)
    assert bool(ff(torch.randn(2, 3, 16)).eq(0).all())


@pytest.mark.parametrize("kwargs", [dict(), dict(interpolation_factor=2.0), dict(base_rescale_factor=3.0), dict(base=500)])
def test_rotary_embedding_matches_x_transformers(kwargs):
    theirs, ours = xx.RotaryEmbedding(8, **kwargs), sf.RotaryEmbedding(8, **kwargs)
    f_theirs, s_theirs = theirs.forward_from_seq_len(9)
    f_ours, s_ours = ours.forward_from_seq_len(9)
    assert s_ours == s_theirs == 1.0 and f_ours.shape == f_theirs.shape == (1, 9, 8)
    hp.assert_close(f_ours, f_theirs, "forward_from_seq_len", torch.float32)
    pos = torch.randint(0, 4096, (2, 9))
    hp.assert_close(ours(pos)[0], theirs(pos)[0], "forward((b, n))", torch.float32)
    t = torch.randn(2, 3, 5, 16, dtype=F64)
    hp.assert_close(sf.apply_rotary(t, f_ours), xx.apply_rotary_pos_emb(t, f_theirs), "apply", torch.float32)


def test_rotary_embedding_refuses_what_it_does_not_do():
    with pytest.raises(ValueError, match="offset"):
        sf.RotaryEmbedding(8)(torch.arange(4), offset=2)
    with pytest.raises(ValueError, match="positions"):
        sf.RotaryEmbedding(8)(torch.randn(4))
    with pytest.raises(ValueError, match="theta or base"):
        sf.RotaryEmbedding(8, base=100, theta=100)


# ---------------------------------------------------------------------------------------------------
# stacks: PrefixDecoder, TransformerBlock
# ---------------------------------------------------------------------------------------------------

def _xt_stack_pair(xt_cls, sf_cls, **opts):
    """An x-transformers stack and safeformer's on the same weights (converted through an Encoder)."""
    torch.manual_seed(0)
    cfg = dict(dim=16, depth=2, heads=2, attn_dim_head=8, **opts)
    theirs = _perturb(xt_cls(**cfg)).eval()
    enc = xt.Encoder(**cfg)
    enc.load_state_dict(theirs.state_dict())
    conv = sf.from_x_transformers(xt.TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=enc, use_abs_pos_emb=False))
    ours = sf_cls(**conv.attn_layers.get_config())
    ours.load_state_dict(conv.attn_layers.state_dict())
    return theirs.double(), ours.double().eval()


@pytest.mark.parametrize("prefix", [None, 3, "per-sample"])
def test_prefix_decoder_matches_x_transformers(prefix):
    theirs, ours = _xt_stack_pair(xt.PrefixDecoder, sf.PrefixDecoder, rotary_pos_emb=True)
    x = torch.randn(3, 6, 16, dtype=F64)
    plen = torch.tensor([0, 2, 6]) if prefix == "per-sample" else prefix
    hp.assert_close(ours(x, prefix_attn_len=plen), theirs(x, prefix_attn_len=plen), f"PrefixDecoder {prefix}", torch.float32)


def test_prefix_decoder_is_safe_with_padding_and_decodes_with_a_cache():
    torch.manual_seed(0)
    dec = _perturb(sf.PrefixDecoder(dim=16, depth=2, heads=2, dim_head=8)).double().eval()
    x = torch.randn(2, 6, 16, dtype=F64)
    mask = torch.tensor([[True] * 4 + [False] * 2, [False] * 6])  # sample 1: all padding
    clean = dec(x, mask=mask, prefix_attn_len=2)
    dirty = x.clone()
    dirty[~mask] = NAN
    out = dec(dirty.requires_grad_(), mask=mask, prefix_attn_len=2)
    hp.assert_bitwise(out, clean, "NaN at padded positions changes nothing")
    assert bool(out[~mask].eq(0).all())
    out.sum().backward()
    assert bool(torch.isfinite(dirty.grad).all())
    # a cache continues causally after the prefix call
    full = dec(x[:1], prefix_attn_len=3)
    head, cache = dec(x[:1, :4], prefix_attn_len=3, return_cache=True)
    step = dec(x[:1, 4:], cache=cache)
    hp.assert_close(torch.cat((head, step), 1), full, "cached = uncached", F64)
    with pytest.raises(ValueError, match="prefix_attn_len"):
        dec(x, prefix_attn_len=torch.tensor([1, 9]))


def test_transformer_block_matches_x_transformers():
    """``TransformerBlock(dim)``: one layer, no final norm (x-transformers' defaults)."""
    torch.manual_seed(0)
    theirs = _perturb(xt.TransformerBlock(16, heads=2, attn_dim_head=8)).double().eval()
    ours = sf.TransformerBlock(16, heads=2, attn_dim_head=8).double()
    assert isinstance(ours.final_norm, torch.nn.Identity) and len(ours.layers) == 2
    enc = xt.Encoder(dim=16, depth=1, heads=2, attn_dim_head=8)
    state = {k: v for k, v in theirs.state_dict().items()}
    enc.load_state_dict(state, strict=False)  # the Encoder's final norm stays at its init (unused below)
    conv = sf.from_x_transformers(xt.TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=enc, use_abs_pos_emb=False))
    ours.load_state_dict({k: v for k, v in conv.attn_layers.state_dict().items() if not k.startswith("final_norm")})
    x = torch.randn(2, 5, 16, dtype=F64)
    hp.assert_close(ours(x), theirs(x), "TransformerBlock", torch.float32)
    again = sf.TransformerBlock.from_config(ours.get_config())
    assert isinstance(again.final_norm, torch.nn.Identity)


def test_dim_condition_without_adaptive_norm_is_tolerated_as_in_x_transformers():
    """x-transformers accepts ``dim_condition`` with nothing adaptive (it is unused): so does safeformer, and a
    condition passed to such a stack is still refused (nothing would read it)."""
    dec = sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, dim_condition=4)
    assert dec.dim_condition is None
    with pytest.raises(ValueError, match="adaptive"):
        dec(torch.randn(1, 3, 16), condition=torch.randn(1, 4))


# ---------------------------------------------------------------------------------------------------
# AttentionPool, ViTransformerWrapper, eval_decorator
# ---------------------------------------------------------------------------------------------------

def test_attention_pool_matches_x_transformers_and_is_safe():
    torch.manual_seed(0)
    theirs = _perturb(xx.AttentionPool(16, num_pooled_tokens=2, dim_context=12, heads=2, dim_head=8,
                                        add_residual=True)).double()
    ours = sf.AttentionPool(16, num_pooled_tokens=2, dim_context=12, heads=2, dim_head=8, add_residual=True).double()
    ours.load_state_dict(theirs.state_dict())
    ctx = torch.randn(3, 5, 12, dtype=F64)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    want = theirs(ctx[:2], mask=mask[:2])
    got = ours(ctx, mask=mask)
    hp.assert_close(got[:2], want, "AttentionPool", torch.float32)
    hp.assert_bitwise(got[2], ours.queries.to(F64), "an empty context pools to the queries alone (residual)")
    dirty = ctx.clone()
    dirty[~mask] = NAN
    dirty.requires_grad_()
    out = ours(dirty, mask=mask)
    hp.assert_bitwise(out, got, "NaN at masked context positions changes nothing")
    out.sum().backward()
    assert bool(dirty.grad[~mask].eq(0).all()) and bool(torch.isfinite(dirty.grad).all())


def test_attention_pool_with_transformer_blocks_and_squeeze():
    pool = sf.AttentionPool(16, depth=2, heads=2, dim_head=8, squeeze_output=True)
    assert isinstance(pool.pooler, sf.CrossAttender)
    out = pool(torch.randn(2, 4, 16), mask=torch.tensor([[True] * 4, [False] * 4]))
    assert out.shape == (2, 16) and bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="queries"):
        sf.AttentionPool(16, num_pooled_tokens=0)(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="add_residual"):
        sf.AttentionPool(16, depth=2, add_residual=True)


@pytest.mark.parametrize("registers", [0, 2])
def test_vit_wrapper_matches_x_transformers(registers):
    torch.manual_seed(0)
    enc = xt.Encoder(dim=16, depth=1, heads=2, attn_dim_head=8)
    theirs = _perturb(xt.ViTransformerWrapper(image_size=8, patch_size=4, attn_layers=enc, num_classes=5,
                                              num_register_tokens=registers, post_emb_norm=True)).double().eval()
    conv = sf.from_x_transformers(xt.TransformerWrapper(num_tokens=8, max_seq_len=8, attn_layers=theirs.attn_layers,
                                                        use_abs_pos_emb=False))
    ours = sf.ViTransformerWrapper(image_size=8, patch_size=4, attn_layers=conv.attn_layers, num_classes=5,
                                   num_register_tokens=registers, post_emb_norm=True).double().eval()
    # x-transformers' LayerNorm has a gain (gamma) and no bias: ours keeps its bias at 0
    state = {k.replace(".gamma", ".weight"): v for k, v in theirs.state_dict().items() if not k.startswith("attn_layers.")}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("attn_layers.") or k.endswith(".bias") for k in missing)
    img = torch.randn(2, 3, 8, 8, dtype=F64)
    logits, embed = ours(img, return_logits_and_embeddings=True)
    want_logits, want_embed = theirs(img, return_logits_and_embeddings=True)
    hp.assert_close(embed, want_embed, "ViT embeddings", torch.float32)
    hp.assert_close(logits, want_logits, "ViT logits", torch.float32)
    with pytest.raises(ValueError, match="patch_size"):
        ours(torch.randn(1, 3, 6, 6, dtype=F64))


def test_eval_decorator_restores_the_mode_even_on_error():
    class M(torch.nn.Module):
        @sf.eval_decorator
        def run(self, fail=False):
            assert not self.training
            if fail:
                raise RuntimeError("boom")
            return 1

    m = M().train()
    assert m.run() == 1 and m.training
    with pytest.raises(RuntimeError):
        m.run(fail=True)
    assert m.training
