"""Checkpoints of format 1 (saved before the module tree became x-transformers') load with today's code and give
the outputs they gave when saved; their state dicts load into a model built today; re-saving writes format 2.

The fixtures cover each meaning format 1 had that today's default differs from: LayerNorm biases and no unit
offset, the RMS qk-norm, grouped-query heads interleaved, ALiBi without the absolute embedding, a tied embedding
without a logit scale, the routing's parameters, an ``XTransformer`` (its decoder now ``decoder.net``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import safeformer as sf
from safeformer.checkpoints.pretrained import load_pretrained, migrate_state_dict

ROOT = Path(__file__).parent / "data" / "legacy_v1"
NAMES = sorted(p.name for p in ROOT.iterdir() if p.is_dir())


def _run(model, io):
    kw = {k: io[k] for k in ("mask", "context", "context_mask", "condition") if k in io}
    with torch.no_grad():
        if isinstance(model, sf.XTransformer):  # the loss of the source as its own target
            return model.eval()(io["x"], io["x"], **kw).reshape(-1)
        return model.eval()(io["x"], **kw)


def test_every_fixture_is_format_1():
    assert len(NAMES) == 9
    for name in NAMES:
        assert json.loads((ROOT / name / "config.json").read_text())["version"] == 1


@pytest.mark.parametrize("name", NAMES)
def test_format_1_loads_with_its_outputs(name):
    io = load_file(str(ROOT / name / "io.safetensors"))
    model = load_pretrained(ROOT / name)
    torch.testing.assert_close(_run(model, io), io["out"], rtol=0, atol=1e-5)
    # the keys are today's: x-transformers' names
    keys = set(model.state_dict())
    assert any(k.endswith("token_emb.emb.weight") for k in keys) and not any(re.search(r"layers\.\d+\.0\.(weight|bias)$", k) for k in keys)


@pytest.mark.parametrize("name", NAMES)
def test_format_1_resaved_is_the_current_format(name, tmp_path):
    io = load_file(str(ROOT / name / "io.safetensors"))
    sf.save_pretrained(load_pretrained(ROOT / name), tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["version"] == 3
    torch.testing.assert_close(_run(load_pretrained(tmp_path / "m"), io), io["out"], rtol=0, atol=1e-5)


def test_old_state_dict_into_a_model_built_today():
    """A raw state dict of earlier safeformer (no config): LayerNorm ``weight`` / ``bias`` become ``gamma`` and a grown
    shift; the model built today with ``norm_add_unit_offset=False`` reproduces the outputs."""
    io = load_file(str(ROOT / "plain" / "io.safetensors"))
    old = load_file(str(ROOT / "plain" / "model.safetensors"))
    assert "token_emb.weight" in old and "attn_layers.layers.0.0.bias" in old
    net = sf.TransformerWrapper(num_tokens=13, max_seq_len=6, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=2, attn_dim_head=8, norm_add_unit_offset=False))
    net.load_state_dict(old, strict=True)
    torch.testing.assert_close(_run(net, io), io["out"], rtol=0, atol=1e-5)
    # with x-transformers' default unit offset the gains are stored minus 1: the outputs are the same
    net2 = sf.TransformerWrapper(num_tokens=13, max_seq_len=6, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=2, attn_dim_head=8))
    net2.load_state_dict(migrate_state_dict(net2, old), strict=True)
    torch.testing.assert_close(_run(net2, io), io["out"], rtol=0, atol=1e-5)


FORMAT2 = Path(__file__).parent / "data" / "format2"
FORMAT2_NAMES = sorted(p.name for p in FORMAT2.iterdir() if p.is_dir())


def test_format_2_fixtures_list_every_attention_field():
    assert len(FORMAT2_NAMES) == 3
    for name in FORMAT2_NAMES:
        config = json.loads((FORMAT2 / name / "config.json").read_text())
        assert config["version"] == 2 and "attn_laser" in config["config"]["attn_layers"]["config"]


@pytest.mark.parametrize("name", FORMAT2_NAMES)
def test_format_2_with_every_attention_field_loads_with_its_outputs(name, tmp_path):
    """Saved when the stack's signature named each attention option: the config's ``attn_<field>`` entries are
    read (and type-checked) as the attention family's fields; the outputs are those of the saving code, and a
    re-saved config keeps only the fields given."""
    io = load_file(str(FORMAT2 / name / "io.safetensors"))
    model = load_pretrained(FORMAT2 / name)
    torch.testing.assert_close(_run(model, io), io["out"], rtol=0, atol=1e-5)
    sf.save_pretrained(model, tmp_path / "m")
    stack = json.loads((tmp_path / "m" / "config.json").read_text())["config"]["attn_layers"]["config"]
    assert "attn_cope_max_pos" not in stack  # a default: not stored
    torch.testing.assert_close(_run(load_pretrained(tmp_path / "m"), io), io["out"], rtol=0, atol=1e-5)
