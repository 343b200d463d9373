"""The attention's keywords as frozen option families (``nn/options.py``, ``nn/attention_config.py``): one field per
keyword, types checked once at the door, the signature and the stack's spellings read from the fields, and a
module built from a config equal to one built from keywords."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing

import pytest
import torch

from safeformer import Attention, Decoder, Encoder
from safeformer.nn.attention_config import FAMILIES, FIELDS, SELF_ONLY, AttentionConfig
from safeformer.nn.options import Options, OptionTypeError
from safeformer.stack.layers import ATTENTION_FIELDS, LAYER_ALIASES


def test_every_keyword_is_one_field_of_one_family():
    seen: dict[str, str] = {}
    for name, kind in FAMILIES.items():
        assert issubclass(kind, Options) and dataclasses.is_dataclass(kind)
        assert kind.__dataclass_params__.frozen, name
        for field in kind.names():
            assert field not in seen, f"{field} is in {seen.get(field)} and {name}"
            seen[field] = name
    params = inspect.signature(Attention.__init__).parameters
    keyword_only = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
    assert keyword_only == list(FIELDS) == list(seen)  # the signature is read from the fields, in family order
    assert list(params)[:7] == ["self", "dim", "dim_head", "dim_context", "heads", "causal", "flash"]
    assert Attention.SELF_ONLY == SELF_ONLY
    # the stack's x-transformers spellings come from the same fields
    for name in ATTENTION_FIELDS:
        assert f"attn_{name}" in LAYER_ALIASES
    assert set(ATTENTION_FIELDS) < set(FIELDS)


def test_self_only_fields_are_those_that_read_the_sequence_itself():
    assert SELF_ONLY == {
        "orthog_projected_values", "orthog_projected_values_per_head", "data_dependent_alibi",
        "data_dependent_alibi_kwargs", "data_dependent_alibi_per_row", "data_dependent_alibi_per_row_dim_head",
        "hybrid_module", "hybrid_fold_axial_dim", "hybrid_mask_kwarg", "hybrid_learned_mix", "use_cope",
        "cope_max_pos", "cope_soft_onehot_pos", "cope_talking_heads", "use_rel_proj_pos_bias",
        "rel_proj_num_distance_basis", "rel_proj_max_dist", "rotate_num_heads", "selective"}


def _wrong_value(hint):
    """A value of none of the types ``hint`` allows (an int passes for a float), or ``None`` if it takes any."""
    allowed = set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
    if object in allowed or typing.Any in allowed:
        return None

    def fits(value, t) -> bool:
        return (t is float and type(value) is int) or (isinstance(t, type) and isinstance(value, t))

    return next((v for v in ("not a number", 2.5, 3) if not any(fits(v, t) for t in allowed)), None)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_a_keyword_of_the_wrong_type_is_refused_by_name(name):
    hint = next(kind.hints()[name] for kind in FAMILIES.values() if name in kind.names())
    bad = _wrong_value(hint)
    if bad is None:
        pytest.skip(f"{name} takes any value ({hint})")
    with pytest.raises(OptionTypeError, match=name) as info:
        AttentionConfig.from_keywords(16, heads=2, dim_head=8, **{name: bad})
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_a_misspelt_keyword_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match="did you mean 'qk_norm'"):
        Attention(16, heads=2, qk_nrom=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'attn_lazer'.*attn_laser"):
        Decoder(dim=16, depth=1, heads=2, attn_lazer=True)


def test_the_config_is_frozen_and_replace_routes_to_the_family():
    cfg = AttentionConfig.from_keywords(16, heads=2, dim_head=8, qk_norm=True, num_mem_kv=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.norms.qk_norm = False
    other = cfg.replace(num_mem_kv=3, causal=True, sigmoid=True)
    assert (other.keys.num_mem_kv, other.causal, other.scoring.sigmoid, other.norms.qk_norm) == (3, True, True, True)
    assert (cfg.keys.num_mem_kv, cfg.causal, cfg.scoring.sigmoid) == (2, False, False)
    with pytest.raises(TypeError, match="num_mem_kvv"):
        cfg.replace(num_mem_kvv=1)
    with pytest.raises(OptionTypeError, match="sigmoid"):
        cfg.replace(sigmoid="yes")
    assert cfg.keywords()["qk_norm"] is True and cfg.keywords()["dim"] == 16


@pytest.mark.parametrize("options", [
    dict(qk_norm=True, num_mem_kv=2, gate_values=True),
    dict(kv_heads=1, learned_sink=True, sigmoid=True, value_rmsnorm=True),
    dict(use_latent_q=True, dim_latent_q=8, output_gate=True, output_gate_headwise=True, causal=True),
])
def test_from_config_builds_the_same_module_as_the_keywords(options):
    torch.manual_seed(0)
    a = Attention(16, heads=2, dim_head=8, **options)
    torch.manual_seed(0)
    b = Attention.from_config(a.config)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    x[1, 3:] = float("nan")  # padding: whatever it holds stays out
    ya, yb = a(x, mask=mask), b(x, mask=mask)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    assert torch.isfinite(ya).all()
    assert a.config == AttentionConfig.from_keywords(16, heads=2, dim_head=8, **options)
    with pytest.raises(TypeError, match="AttentionConfig"):
        Attention.from_config(dict(dim=16))


def test_the_stack_builds_each_kind_from_one_checked_config():
    stack = Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, cross_attend=True, attn_qk_norm=True,
                    attn_use_cope=True, cross_attn_num_mem_kv=3, attn_dropout=0.1)
    kinds = [blk.kind for blk in stack.layers]
    selfs = [blk[1] for blk, k in zip(stack.layers, kinds) if k == "self"]
    crosses = [blk[1] for blk, k in zip(stack.layers, kinds) if k == "cross"]
    for attn in selfs:
        cfg = attn.config
        assert (cfg.norms.qk_norm, cfg.logits.use_cope, cfg.keys.num_mem_kv, cfg.causal) == (True, True, 0, True)
        assert cfg.core.dropout == pytest.approx(0.1) and cfg.dim_context is None
    for attn in crosses:
        cfg = attn.config
        # self-only options stay out of cross-attention; the per-kind keyword wins there
        assert (cfg.norms.qk_norm, cfg.logits.use_cope, cfg.keys.num_mem_kv, cfg.causal) == (True, False, 3, False)
        assert cfg.dim_context == 16
    with pytest.raises(OptionTypeError, match="qk_norm"):
        Encoder(dim=16, depth=1, heads=2, attn_qk_norm="yes")


def test_the_feed_forward_family_gives_its_signature_and_the_stack_spellings():
    from safeformer import FeedForward
    from safeformer.nn.modules import FeedForwardOptions
    from safeformer.stack.layers import FF_KWARGS

    params = inspect.signature(FeedForward.__init__).parameters
    assert [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY] == list(FeedForwardOptions.names())
    assert list(params)[:5] == ["self", "dim", "dim_out", "mult", "glu"]
    assert set(FF_KWARGS) - {"dim_out"} <= set(FeedForwardOptions.names())
    ff = FeedForward(16, glu=True, swish=True, no_bias=True)
    assert ff.options.swish and ff.options.no_bias and ff.options == FeedForwardOptions(swish=True, no_bias=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ff.options.swish = False
    with pytest.raises(TypeError, match="unexpected keyword argument 'swsh'; did you mean 'swish'"):
        FeedForward(16, swsh=True)
    with pytest.raises(OptionTypeError, match="sublayer_dropout must be a number"):
        FeedForward(16, sublayer_dropout="high")


@pytest.mark.parametrize("keywords, name", [
    (dict(ff_dropout="x"), "ff_dropout"), (dict(ff_no_bias=3), "ff_no_bias"),
    (dict(attn_qk_norm="yes"), "attn_qk_norm"), (dict(attn_kwargs={"sigmoid": 1}), "attn_sigmoid"),
    (dict(cross_attend=True, cross_attn_num_mem_kv=1.5), "cross_attn_num_mem_kv"),
])
def test_a_stack_names_a_mistyped_keyword_as_it_spells_it(keywords, name):
    with pytest.raises(OptionTypeError, match=f"^{name} must be") as info:
        Decoder(dim=16, depth=1, heads=2, **keywords)
    assert info.value.name == name
