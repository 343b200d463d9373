"""The stack's attention keywords are read from ``Attention``'s signature (x-transformers' prefix routing):
``attn_<field>`` reaches every attention block as ``<field>``, ``cross_attn_<field>`` the cross-attention blocks
only, and nothing is listed by hand (``safeformer.stack.layers.ATTENTION_FIELDS``).

Shape legend: b batch, n positions, j context length, c width.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import safeformer as sf
from safeformer.nn.attention import Attention
from safeformer.stack.layers import ATTENTION_FIELDS, LAYER_ALIASES

DIM, HEADS, DIM_HEAD = 16, 2, 8

# a non-default value per field that builds on its own (fields that need a partner, or a module, are left out here
# and covered by the option families' own tests)
NON_DEFAULT = {
    "qk_norm": True, "bias": True, "num_mem_kv": 2, "learned_sink": True, "head_learned_sink": True,
    "softclamp_logits": True, "logit_softclamp_value": 20.0, "gate_values": True, "gate_value_heads": True,
    "zero_init_output": True, "output_gate": True, "swiglu_values": True, "qk_norm_dim_scale": True,
    "value_rmsnorm": True, "l2_distance": True, "cog_signed": True, "sigmoid": True, "gumbel_softmax": True,
    "laser": True, "use_latent_q": True, "dim_latent_q": 12, "use_cope": True, "use_rel_proj_pos_bias": True,
    "sparse_topk": 2, "hard": False, "add_zero_kv": True, "pre_talking_heads": True, "post_talking_heads": True,
    "head_scale": True, "sublayer_dropout": 0.1, "output_proj_depth": 2, "qk_norm_groups": 1,
    "qk_norm_scale": 5.0, "kv_head_order": "interleaved", "orthog_projected_values": True,
    "data_dependent_alibi": True,
}


def _shapes(module: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def _attentions(stack) -> list[tuple[bool, Attention]]:
    """(is self-attention, its Attention) per attention block, in order."""
    return [(blk.kind == "self", blk.mixer) for blk in stack.layers if blk.kind in ("self", "cross")]


def test_every_attention_keyword_only_parameter_is_a_field_or_set_by_the_stack():
    params = inspect.signature(Attention.__init__).parameters
    keyword_only = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    from safeformer.stack.layers import _STACK_SETS

    assert keyword_only == set(ATTENTION_FIELDS) | _STACK_SETS
    assert Attention.SELF_ONLY <= keyword_only


def test_every_field_is_accepted_at_its_default_under_the_attn_prefix():
    for name, p in ATTENTION_FIELDS.items():
        stack = sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, **{f"attn_{name}": p.default})
        assert isinstance(stack, sf.Decoder), name
        assert f"attn_{name}" in LAYER_ALIASES


# fields that need another field to build
PARTNERS = {"dim_latent_q": {"use_latent_q": True}, "use_latent_q": {"dim_latent_q": 12},
            "qk_norm_dim_scale": {"qk_norm": True}, "swiglu_values": {"gate_values": True}}


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_attn_field_reaches_every_block_as_attention_would_build_it(name):
    """``Decoder(attn_<field>=v, cross_attend=True)``: each self-attention block is ``Attention(<field>=v)``: the same
    parameters and buffers, and on the block's weights the same output on a padded batch; each cross-attention block
    too, unless the field is self-only (then it is the plain ``Attention``)."""
    value = NON_DEFAULT[name]
    extra = PARTNERS.get(name, {})
    stack = sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                       **{f"attn_{name}": value}, **{f"attn_{k}": v for k, v in extra.items()}).eval()
    blocks = _attentions(stack)
    assert len(blocks) == 4
    torch.manual_seed(0)
    x, ctx = torch.randn(2, 5, DIM), torch.randn(2, 3, DIM)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    for self_attn, attn in blocks:
        if self_attn:
            want = Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, causal=True, **{name: value}, **extra)
        elif name in Attention.SELF_ONLY:
            want = Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, dim_context=DIM)
        else:
            want = Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, dim_context=DIM, **{name: value}, **extra)
        assert _shapes(attn) == _shapes(want), (name, self_attn)
        want.load_state_dict(attn.state_dict(), strict=True)
        want.eval()
        call = dict(mask=mask) if self_attn else dict(context=ctx)
        torch.manual_seed(1)  # the same draws for the random options (gumbel softmax)
        got = attn(x, **call)
        torch.manual_seed(1)
        ref = want(x, **call)
        torch.testing.assert_close(got[mask], ref[mask], rtol=0, atol=0, msg=f"{name}, self={self_attn}")


def test_cross_attn_prefix_reaches_the_cross_attention_blocks_only():
    stack = sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True, cross_attn_num_mem_kv=3)
    for self_attn, attn in _attentions(stack):
        assert ("mem_k" in dict(attn.named_parameters())) != self_attn
        if not self_attn:
            assert attn.mem_k.shape[-2] == 3


def test_a_field_given_twice_is_refused_by_name():
    with pytest.raises(TypeError, match="'laser' is given twice"):
        sf.Decoder(dim=DIM, depth=1, attn_laser=True, attn_kwargs={"laser": True})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"attn_lazer": True}, "unexpected keyword argument 'attn_lazer'; did you mean 'attn_laser'"),
    ({"attn_kwargs": {"lazer": True}}, "attn_kwargs got an unexpected keyword 'lazer'; did you mean 'laser'"),
    ({"attn_kwargs": {"heads": 3}}, "attn_kwargs got an unexpected keyword 'heads'"),
])
def test_misspelt_fields_are_type_errors_with_a_suggestion(kwargs, match):
    with pytest.raises(TypeError, match=match):
        sf.Decoder(dim=DIM, depth=1, **kwargs)


@pytest.mark.parametrize("spelling", ["attn_prefix", "attn_kwargs"])
def test_the_config_holds_the_fields_given_in_x_transformers_spelling_and_rebuilds_the_model(spelling):
    options = {"gate_values": True, "num_mem_kv": 2}
    given = {f"attn_{k}": v for k, v in options.items()} if spelling == "attn_prefix" else {"attn_kwargs": options}
    stack = sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True, cross_attn_num_mem_kv=1,
                       **given)
    config = stack.get_config()
    assert {k: v for k, v in config.items() if k.startswith("attn_")} == {
        "attn_gate_values": True, "attn_num_mem_kv": 2, "attn_kwargs": None, "attn_dropout": 0.0,
        # the stack's own keywords spelt with the prefix (not attention fields)
        "attn_aggregated_residuals": False, "attn_aggregated_residual_kwargs": None}
    assert config["cross_attn_kwargs"] == {"num_mem_kv": 1}
    rebuilt = sf.Decoder.from_config(config)
    assert _shapes(rebuilt) == _shapes(stack) and rebuilt.get_config() == config


def test_a_config_with_fields_under_the_attn_prefix_loads_and_is_type_checked():
    """Earlier configs stored every attention field as ``attn_<field>``: they still build, each value checked
    against ``Attention``'s annotation before anything is built."""
    config = sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD).get_config()
    flat = {**config, **{f"attn_{k}": p.default for k, p in ATTENTION_FIELDS.items()
                         if not isinstance(p.default, torch.nn.Module)}, "attn_laser": True}
    rebuilt = sf.Decoder.from_config(flat)
    assert rebuilt.layers[0].mixer.laser_value is not None
    with pytest.raises(ValueError, match=r"attn_laser.*must be a bool"):
        sf.Decoder.from_config({**config, "attn_laser": "yes"})
    with pytest.raises(ValueError, match=r"attn_num_mem_kv.*must be an int"):
        sf.Decoder.from_config({**config, "attn_num_mem_kv": 1.5})


def test_routed_options_give_the_same_numbers_as_before_on_padded_inputs():
    """The routing changes where keywords are read, not what a block computes: a stack with several fields equals
    the same blocks called one by one (self-attention with a padding mask, then cross-attention, then the FF)."""
    torch.manual_seed(0)
    stack = sf.Encoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True, attn_gate_values=True,
                       attn_num_mem_kv=2, attn_qk_norm=True, pre_norm_has_final_norm=False)
    x, ctx = torch.randn(2, 5, DIM), torch.randn(2, 3, DIM)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    out = stack(x, mask=mask, context=ctx)
    h = x
    for blk in stack.layers:
        normed = blk[0][0](h)
        if blk.kind == "self":
            h = h + blk.mixer(normed, mask=mask)
        elif blk.kind == "cross":
            h = h + blk.mixer(normed, context=ctx)
        else:
            h = h + blk.mixer(normed)
    torch.testing.assert_close(out[mask], h[mask], rtol=1e-5, atol=1e-5)
