"""x-transformers' spellings (one explicit alias table each for the stacks and the wrappers) and clear
errors for unknown keywords, with suggestions.

Shape legend: b batch, n positions, v vocabulary.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf
from safeformer.stack.layers import LAYER_ALIASES
from safeformer.stack.wrappers import WRAPPER_ALIASES


@pytest.mark.parametrize(("alias", "value", "name", "want"), [
    ("attn_dim_head", 16, "dim_head", 16),
    ("attn_kv_heads", 2, "kv_heads", 2),
    ("attn_one_kv_head", True, "kv_heads", 1),
    ("cross_attn_dim_context", 24, "dim_context", 24),
])
def test_layer_alias_sets_the_canonical_option(alias, value, name, want):
    extra = {"cross_attend": True} if name == "dim_context" else {}
    dec = sf.Decoder(dim=32, depth=1, heads=4, **extra, **{alias: value})
    assert dec.get_config()[name] == want
    assert alias not in dec.get_config(), "configs store safeformer's names only"


def test_every_alias_in_the_tables_is_tested_or_accepted():
    from safeformer.core.xt_defaults import XT_DEFAULT_ONLY
    from safeformer.stack.layers import ATTENTION_FIELDS, FF_KWARGS

    tested = {"attn_dim_head", "attn_kv_heads", "attn_one_kv_head", "cross_attn_dim_context", "attn_flash"}
    # tests/test_xt_keywords.py: the ff_* keywords handed to each module (parity on the same weights); every
    # attention field as attn_<field> (tests/test_attention_routing.py),
    # the default-only ones (refused by name at another value) and the two accepted with any value
    tested |= {f"ff_{k}" for k in FF_KWARGS} | {f"attn_{k}" for k in ATTENTION_FIELDS} | set(XT_DEFAULT_ONLY)
    tested |= {"attn_onnxable", "verbose", "attn_inverted_attention"}  # the last: tests/test_inverted_self_attention.py
    assert set(LAYER_ALIASES) == tested, f"untested aliases: {sorted(set(LAYER_ALIASES) - tested)}"
    neutral = {"emb_frac_gradient": (1.0, 0.5)}
    for key in WRAPPER_ALIASES:  # each is accepted at its neutral value and refused otherwise (the continuous
        # wrapper's: TransformerWrapper has them itself)
        ok, other = neutral.get(key, (False, True))
        make = lambda **kw: sf.ContinuousTransformerWrapper(dim_in=4, attn_layers=sf.Encoder(dim=8, depth=1), **kw)  # noqa: E731
        assert isinstance(make(**{key: ok}), torch.nn.Module)
        with pytest.raises(TypeError, match=key):
            make(**{key: other})


def test_attn_flash_is_accepted_and_the_kernel_choice_stays_automatic():
    dec = sf.Decoder(dim=32, depth=1, heads=4, attn_flash=True)
    assert dec.get_config()["backend"] == "auto"


@pytest.mark.parametrize(("typo", "suggested"), [
    ("attn_dim_heads", "attn_dim_head"), ("rotary_emb", "rotary_pos_emb"), ("crossattend", "cross_attend"),
    ("kv_head", "kv_heads"),
])
def test_unknown_keyword_names_it_and_suggests(typo, suggested):
    with pytest.raises(TypeError, match="unexpected keyword argument") as info:
        sf.Decoder(dim=32, depth=1, **{typo: 1})
    assert repr(typo) in str(info.value) and repr(suggested) in str(info.value), str(info.value)


def test_unknown_wrapper_keyword_suggests():
    with pytest.raises(TypeError, match="'emb_dropout'"):
        sf.TransformerWrapper(num_tokens=5, max_seq_len=4, attn_layers=sf.Encoder(dim=8, depth=1), emb_dropouts=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'attn_lazer'.*'attn_laser'"):
        sf.Encoder(dim=8, depth=1, attn_lazer=True)


def test_one_option_under_two_spellings_is_an_error():
    with pytest.raises(TypeError, match="given twice"):
        sf.Decoder(dim=32, depth=1, heads=4, dim_head=8, attn_dim_head=16)


def test_aliased_model_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=11, max_seq_len=8, attn_layers=sf.Decoder(
        dim=32, depth=1, heads=4, attn_dim_head=8, attn_kv_heads=2, attn_flash=True))
    net.save_pretrained(tmp_path / "m")
    back = sf.TransformerWrapper.from_pretrained(tmp_path / "m")
    x = torch.randint(0, 11, (2, 5))
    assert torch.equal(back(x), net(x))


def test_x_transformers_readme_decoder_runs_with_the_import_changed():
    """x-transformers' README: ``Decoder(dim=512, depth=6, heads=8, attn_dim_head=64, attn_kv_heads=2,
    attn_flash=True)`` inside a ``TransformerWrapper(num_tokens=20000, max_seq_len=1024)``; only the
    import differs."""
    from safeformer import Decoder, TransformerWrapper

    model = TransformerWrapper(num_tokens=20000, max_seq_len=1024, attn_layers=Decoder(
        dim=512, depth=6, heads=8, attn_dim_head=64, attn_kv_heads=2, attn_flash=True))
    x = torch.randint(0, 256, (1, 64))
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (1, 64, 20000) and bool(torch.isfinite(logits).all())


# ----------------------------------------------------------------------------------------------------
# generation as x-transformers users call it
# ----------------------------------------------------------------------------------------------------


def _ar():
    torch.manual_seed(0)
    return sf.AutoregressiveWrapper(sf.TransformerWrapper(num_tokens=13, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=2, dim_head=8, rotary_pos_emb=True)).double())


def test_generate_takes_a_list_of_prompts_of_different_lengths():
    """A list of 1-D prompts is left-padded by generate itself: the same tokens as the padded batch with
    its mask, and as each prompt alone (positions count real tokens only)."""
    model = _ar()
    prompts = [torch.tensor([3, 4, 5, 6]), torch.tensor([7]), torch.tensor([8, 9])]
    got = model.generate(prompts, 5, temperature=0.0)
    tokens, mask = sf.left_pad(prompts)
    assert torch.equal(mask.sum(1), torch.tensor([4, 1, 2]))
    assert torch.equal(got, model.generate(tokens, 5, mask=mask, temperature=0.0))
    for k, p in enumerate(prompts):
        assert torch.equal(got[k], model.generate(p[None], 5, temperature=0.0)[0]), f"prompt {k} alone"
    with pytest.raises(ValueError, match="mask"):
        model.generate(prompts, 2, mask=mask)
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        model.generate([torch.tensor([1]), torch.tensor([], dtype=torch.long)], 2)
    with pytest.raises(TypeError, match="prompts\\[0\\]"):
        model.generate([torch.tensor([1.0])], 2)


def test_top_a_keeps_tokens_above_the_power_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = sf.top_a(logits, min_p_pow=2.0, min_p_ratio=0.5)  # limit 0.5 * 0.5**2 = 0.125
    assert torch.isfinite(kept[0, :3]).all() and kept[0, 3] == float("-inf")
    assert torch.equal(sf.top_a(logits, min_p_ratio=0.0), logits)
    one = sf.top_a(torch.tensor([[0.0, -1e9]]), min_p_pow=1.0, min_p_ratio=1.0)
    assert one[0, 0] == 0.0 and one[0, 1] == float("-inf"), "the best token is always kept"
    model = _ar()
    toks = model.generate([torch.tensor([1, 2])], 4, filter_logits_fn="top_a", filter_kwargs={"min_p_ratio": 0.1})
    assert toks.shape == (1, 4)
