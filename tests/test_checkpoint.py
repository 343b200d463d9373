"""Tests for safeformer/checkpoint.py: save_pretrained / from_pretrained, configs, and their errors.

A checkpoint is ``config.json`` + ``model.safetensors``; loading must never unpickle anything, must
rebuild the same architecture from the config alone, and must give bit-for-bit the same outputs.

Shape legend: b batch, n positions, j context positions, c model width, v vocabulary.
"""

from __future__ import annotations

import json
import pickle
import struct

import model_helpers as mh
import pytest
import torch
from model_helpers import CTX_DIM, DIM, DIM_HEAD, HEADS, MAX_SEQ, VOCAB
from torch import nn

import safeformer as sf
from safeformer.checkpoint import CONFIG_NAME, WEIGHTS_NAME


@pytest.fixture(autouse=True)
def _one_thread():
    with mh.single_thread():
        yield


BASE = dict(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD)
SRC_MASK = torch.tensor([[True, True, False], [False, False, False]])
MASK = torch.tensor([[False, True, True, True], [True, True, True, False]])


def _ctx():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, CTX_DIM, generator=g)


MODELS = {
    "Encoder": (lambda: sf.Encoder(**BASE, alibi_pos_bias=True, use_rmsnorm=True),
                lambda m: m(torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(0)), mask=MASK)),
    "Decoder": (lambda: sf.Decoder(**BASE, cross_attend=True, dim_context=CTX_DIM, rotary_pos_emb=True, kv_heads=1, attn_qk_norm=True),
                lambda m: m(torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(0)), mask=MASK, context=_ctx(), context_mask=SRC_MASK)),
    "CrossAttender": (lambda: sf.CrossAttender(**BASE, dim_context=CTX_DIM, ff_glu=True),
                      lambda m: m(torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(0)), context=_ctx(), context_mask=SRC_MASK)),
    "TransformerWrapper": (lambda: sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ, attn_layers=sf.Decoder(**BASE, cross_attend=True, dim_context=CTX_DIM)),
                           lambda m: m(torch.arange(8).reshape(2, 4) % VOCAB, mask=MASK, context=_ctx(), context_mask=SRC_MASK)),
    "TransformerWrapper-tied": (lambda: sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ, tie_embedding=True, attn_layers=sf.Encoder(**BASE, ff_glu=True, ff_swish=True)),
                                lambda m: m(torch.arange(8).reshape(2, 4) % VOCAB, mask=MASK)),
    "ContinuousTransformerWrapper": (lambda: sf.ContinuousTransformerWrapper(max_seq_len=MAX_SEQ, dim_in=5, dim_out=3, attn_layers=sf.Encoder(**BASE, attn_bias=True)),
                                     lambda m: m(torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0)), mask=MASK)),
    "XTransformer": (lambda: sf.XTransformer(dim=DIM, enc_num_tokens=VOCAB, enc_max_seq_len=MAX_SEQ, dec_num_tokens=VOCAB, dec_max_seq_len=MAX_SEQ,
                                             enc_depth=1, dec_depth=1, enc_heads=HEADS, dec_heads=HEADS, dim_head=DIM_HEAD, tie_token_emb=True),
                     lambda m: m(torch.arange(6).reshape(2, 3), torch.arange(8).reshape(2, 4) % VOCAB, mask=SRC_MASK)),
}


def saved(tmp_path, name: str):
    make, run = MODELS[name]
    model = mh.seeded_module(make).eval()
    path = model.save_pretrained(tmp_path / name)
    return model, run, path


@pytest.mark.parametrize("name", list(MODELS))
def test_save_load_gives_identical_outputs(tmp_path, name):
    model, run, path = saved(tmp_path, name)
    assert sorted(p.name for p in path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    loaded = type(model).from_pretrained(path).eval()
    assert type(loaded) is type(model)
    assert loaded.get_config() == model.get_config()
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with torch.no_grad():
        mh.assert_bitwise(run(loaded), run(model), f"{name}: outputs after save/load")
    generic = sf.load_pretrained(path)  # without naming the class
    assert type(generic) is type(model)


def test_tied_weights_stay_tied_and_are_stored_once(tmp_path):
    model, _, path = saved(tmp_path, "XTransformer")
    loaded = sf.XTransformer.from_pretrained(path)
    assert loaded.decoder.token_emb is loaded.encoder.token_emb
    tw, _, tw_path = saved(tmp_path, "TransformerWrapper-tied")
    assert sf.TransformerWrapper.from_pretrained(tw_path).to_logits is None
    header = _header(path / WEIGHTS_NAME)
    emb_keys = [k for k in header if k.endswith("token_emb.weight")]
    assert len(emb_keys) == 1, emb_keys  # the shared embedding is written once


def _header(file) -> dict:
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__", None)
    return header


def test_files_are_json_and_safetensors_never_pickle(tmp_path, monkeypatch):
    model, run, path = saved(tmp_path, "Decoder")
    config = json.loads((path / CONFIG_NAME).read_text())
    assert config["format"] == "safeformer" and config["version"] == 1 and config["class"] == "Decoder"
    assert config["config"]["cross_attend"] is True and config["config"]["dim_context"] == CTX_DIM
    assert "causal" not in config["config"]  # set by the class itself
    raw = (path / WEIGHTS_NAME).read_bytes()
    assert raw[:1] != b"\x80"  # not a pickle stream (protocol 2+ starts with 0x80) and not a zip (torch.save)
    assert not raw.startswith(b"PK")
    header = _header(path / WEIGHTS_NAME)
    assert set(header) == set(model.state_dict())
    assert all(v["dtype"] == "F32" for v in header.values())

    def forbidden(*a, **k):
        raise AssertionError("pickle was used while loading a checkpoint")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    loaded = sf.Decoder.from_pretrained(path).eval()
    with torch.no_grad():
        mh.assert_bitwise(run(loaded), run(model), "outputs")


def test_config_roundtrip_rebuilds_the_architecture():
    model = mh.seeded_module(MODELS["TransformerWrapper"][0])
    config = model.get_config()
    json.dumps(config)  # JSON-ready
    assert config["attn_layers"]["class"] == "Decoder"
    torch.manual_seed(123)  # another init than the model's
    fresh = sf.TransformerWrapper.from_config(json.loads(json.dumps(config)))
    assert fresh.get_config() == config
    assert {k: v.shape for k, v in fresh.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert not torch.equal(fresh.token_emb.weight, model.token_emb.weight)  # a fresh init, not a copy


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        sf.load_pretrained(tmp_path / "nowhere")
    _, _, path = saved(tmp_path, "Encoder")
    (path / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        sf.Encoder.from_pretrained(path)


@pytest.mark.parametrize("keep", [0.5, 0.9, 8, 3])
def test_truncated_weights_are_a_clear_error(tmp_path, keep):
    _, _, path = saved(tmp_path, "TransformerWrapper")
    raw = (path / WEIGHTS_NAME).read_bytes()
    n = int(len(raw) * keep) if isinstance(keep, float) else keep
    (path / WEIGHTS_NAME).write_bytes(raw[:n])
    with pytest.raises(ValueError, match=r"could not read weights from .*model\.safetensors"):
        sf.TransformerWrapper.from_pretrained(path)


def test_broken_config_is_a_clear_error(tmp_path):
    _, _, path = saved(tmp_path, "Encoder")
    text = (path / CONFIG_NAME).read_text()
    (path / CONFIG_NAME).write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="not valid JSON"):
        sf.Encoder.from_pretrained(path)
    for bad, match in [
        ({"format": "other", "class": "Encoder", "version": 1, "config": {}}, "not a safeformer checkpoint"),
        ({"format": "safeformer", "class": "Encoder", "version": 99, "config": {}}, "version 99"),
        ({"format": "safeformer", "class": "Nonexistent", "version": 1, "config": {}}, "unknown class 'Nonexistent'"),
    ]:
        (path / CONFIG_NAME).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            sf.load_pretrained(path)


def _edit_config(path, edit):
    config = json.loads((path / CONFIG_NAME).read_text())
    edit(config["config"])
    (path / CONFIG_NAME).write_text(json.dumps(config))


def test_mismatched_config_is_a_clear_error(tmp_path):
    _, _, path = saved(tmp_path, "TransformerWrapper")
    _edit_config(path, lambda c: c["attn_layers"]["config"].update(depth=2))
    with pytest.raises(ValueError, match=r"do not match .*missing \['attn_layers.layers.3"):
        sf.TransformerWrapper.from_pretrained(path)
    _edit_config(path, lambda c: c["attn_layers"]["config"].update(depth=1, dim=32))
    with pytest.raises(ValueError, match="size mismatch"):
        sf.TransformerWrapper.from_pretrained(path)
    _edit_config(path, lambda c: c["attn_layers"]["config"].update(dim=DIM, bogus_option=1))
    with pytest.raises(TypeError, match="bogus_option"):
        sf.TransformerWrapper.from_pretrained(path)
    _edit_config(path, lambda c: c["attn_layers"].update({"class": "NoSuchLayers"}))
    with pytest.raises(ValueError, match="unknown class 'NoSuchLayers'"):
        sf.TransformerWrapper.from_pretrained(path)


def test_loading_as_the_wrong_class_is_an_error(tmp_path):
    _, _, path = saved(tmp_path, "Decoder")
    with pytest.raises(ValueError, match="holds a Decoder, not a Encoder"):
        sf.Encoder.from_pretrained(path)
    assert type(sf.AttentionLayers.from_pretrained(path)) is sf.Decoder  # a subclass is accepted


def test_only_configurable_modules_can_be_saved(tmp_path):
    with pytest.raises(TypeError, match="Linear is not a safeformer model"):
        sf.save_pretrained(nn.Linear(2, 2), tmp_path / "linear")
    assert not (tmp_path / "linear").exists()
