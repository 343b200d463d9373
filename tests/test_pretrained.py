"""Tests for safeformer/pretrained.py: save_pretrained / from_pretrained, configs, and their errors.

A checkpoint is ``config.json`` + ``model.safetensors``; loading must never unpickle anything, must
rebuild the same architecture from the config alone, and must give bit-for-bit the same outputs.

Shape legend: b batch, n positions, j context positions, c model width, v vocabulary.
"""

from __future__ import annotations

import functools
import json
import pickle
import struct
import time

import helpers as hp
import pytest
import torch
from helpers import CTX_DIM, DIM, DIM_HEAD, HEADS, MAX_SEQ, VOCAB
from torch import nn

import safeformer as sf
from safeformer.checkpoints.pretrained import CONFIG_NAME, WEIGHTS_NAME


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
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
    "AttentionLayers": (lambda: sf.AttentionLayers(**BASE, causal=True, norm_eps=1e-12, kv_heads=1),
                        lambda m: m(torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(0)), mask=MASK)),
    "AutoregressiveWrapper": (lambda: sf.AutoregressiveWrapper(
                                  sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ, attn_layers=sf.Decoder(
                                      **BASE, cross_attend=True, dim_context=CTX_DIM, alibi_pos_bias=True)),
                                  null_context="learned", ignore_index=-1),
                              lambda m: m(torch.arange(8).reshape(2, 4) % VOCAB, context=_ctx(), context_mask=SRC_MASK)),
}


def saved(tmp_path, name: str):
    make, run = MODELS[name]
    model = hp.seeded_module(make).eval()
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
        hp.assert_bitwise(run(loaded), run(model), f"{name}: outputs after save/load")
    generic = sf.load_pretrained(path)  # without naming the class
    assert type(generic) is type(model)


def test_tied_weights_stay_tied_and_are_stored_once(tmp_path):
    model, _, path = saved(tmp_path, "XTransformer")
    loaded = sf.XTransformer.from_pretrained(path)
    assert loaded.decoder.net.token_emb is loaded.encoder.token_emb
    tw, _, tw_path = saved(tmp_path, "TransformerWrapper-tied")
    assert sf.TransformerWrapper.from_pretrained(tw_path).to_logits is None
    header = _header(path / WEIGHTS_NAME)
    emb_keys = [k for k in header if k.endswith("token_emb.emb.weight")]
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
    assert config["format"] == "safeformer" and config["version"] == 3 and config["class"] == "Decoder"
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
        hp.assert_bitwise(run(loaded), run(model), "outputs")


def test_config_roundtrip_rebuilds_the_architecture():
    model = hp.seeded_module(MODELS["TransformerWrapper"][0])
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
    with pytest.raises(ValueError, match="shape mismatch for attn_layers.layers.0.0.0.gamma"):
        sf.TransformerWrapper.from_pretrained(path)
    _edit_config(path, lambda c: c["attn_layers"]["config"].update(dim=DIM, bogus_option=1))
    with pytest.raises(ValueError, match="config.attn_layers.config.bogus_option is not a parameter of Decoder"):
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


# ----------------------------------------------------------------------------------------------------
# Hostile checkpoints: every tampered file is a ValueError naming the file and the field or tensor,
# found before anything real is built.
# ----------------------------------------------------------------------------------------------------


def _edit_file(path, edit):
    """Rewrite config.json after ``edit(whole_config)`` changed it in place."""
    config = json.loads((path / CONFIG_NAME).read_text())
    edit(config)
    (path / CONFIG_NAME).write_text(json.dumps(config))


def _load_error(path, file_name, *needles, loader=None) -> ValueError:
    """Load ``path``; assert a ValueError whose message names ``path/file_name`` and every needle."""
    with pytest.raises(ValueError) as info:
        (loader or sf.load_pretrained)(path)
    msg = str(info.value)
    assert str(path / file_name) in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return info.value


def _rewrite_weights(path, edit):
    """Rewrite model.safetensors with ``edit(tensors)`` applied to its (name -> tensor) dict."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / WEIGHTS_NAME))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS_NAME))


@pytest.fixture
def wrapper_ckpt(tmp_path):
    """A saved one-layer TransformerWrapper(Decoder) checkpoint folder."""
    return saved(tmp_path, "TransformerWrapper")[2]


@pytest.mark.parametrize("field, value, needle", [
    ("config.attn_layers.config.dim", "16", "must be an int, got str '16'"),
    ("config.num_tokens", "19", "must be an int, got str '19'"),
    ("config.attn_layers.config.ff_mult", "4.0", "must be a number, got str '4.0'"),
    ("config.emb_dropout", None, "must be a number, got NoneType None"),
])
def test_hostile_string_where_a_number_belongs(wrapper_ckpt, field, value, needle):
    keys = field.split(".")[1:]

    def edit(config):
        target = config["config"]
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    _edit_file(wrapper_ckpt, edit)
    _load_error(wrapper_ckpt, CONFIG_NAME, f"{field} {needle}")


def test_hostile_nan_or_infinity_where_a_float_belongs(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].update(ff_mult=1e400))  # json: Infinity
    _load_error(wrapper_ckpt, CONFIG_NAME, "not valid JSON", "Infinity")
    text = (wrapper_ckpt / CONFIG_NAME).read_text().replace("Infinity", "1e400")  # parses as inf
    (wrapper_ckpt / CONFIG_NAME).write_text(text)
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.config.ff_mult must be a finite number")


def test_hostile_list_instead_of_mapping_at_the_top_level(wrapper_ckpt):
    good = (wrapper_ckpt / CONFIG_NAME).read_text()
    (wrapper_ckpt / CONFIG_NAME).write_text(f"[{good}]")
    _load_error(wrapper_ckpt, CONFIG_NAME, "top level must be a mapping, got list")
    (wrapper_ckpt / CONFIG_NAME).write_text(good)
    _edit_file(wrapper_ckpt, lambda c: c.update(config=list(c["config"].items())))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config must be a mapping of TransformerWrapper's arguments, got list")


def test_hostile_list_instead_of_mapping_in_a_nested_config(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"].update(config=[["dim", DIM], ["depth", 1]]))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.config must be a mapping of Decoder's arguments, got list")
    _edit_file(wrapper_ckpt, lambda c: c["config"].update(attn_layers=["Decoder", {"dim": DIM}]))
    _load_error(wrapper_ckpt, CONFIG_NAME, 'config.attn_layers must be {"class": ..., "config": {...}}')


def test_hostile_nested_class_of_the_wrong_kind(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"].update({"class": "TransformerWrapper"}))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.class names 'TransformerWrapper', which is not a AttentionLayers")
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"].update({"class": "_Wrapper"}))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.class names '_Wrapper', which is not a AttentionLayers")
    _edit_file(wrapper_ckpt, lambda c: c.update({"class": "_Wrapper"}))
    _load_error(wrapper_ckpt, CONFIG_NAME, "names class '_Wrapper', which cannot be built from a config")


def test_hostile_unknown_field(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].update(bogus_option=1))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.config.bogus_option is not a parameter of Decoder")
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].pop("bogus_option"))
    _edit_file(wrapper_ckpt, lambda c: c["config"].update(__class__="x"))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.__class__ is not a parameter of TransformerWrapper")
    _edit_file(wrapper_ckpt, lambda c: c["config"].pop("__class__"))
    _edit_file(wrapper_ckpt, lambda c: c.update(extra=1))
    _load_error(wrapper_ckpt, CONFIG_NAME, "unknown top-level field 'extra'")


def test_hostile_missing_required_field(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].pop("depth"))
    # depth may be left out with custom_layers (x-transformers' layer pattern): the stack itself names it
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.config could not build a Decoder: ValueError: depth must "
                "be given")


@pytest.mark.parametrize("field", ["depth", "heads", "cross_attend"])
def test_hostile_wrong_scalar_kind(wrapper_ckpt, field):
    """bool where an int belongs (JSON true is not 1), and an int where a bool belongs."""
    value, needle = (1, "must be a bool (true/false), got int 1") if field == "cross_attend" else (True, "must be an int, got bool True")
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].update({field: value}))
    _load_error(wrapper_ckpt, CONFIG_NAME, f"config.attn_layers.config.{field} {needle}")


def test_hostile_float_depth(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].update(depth=1e9))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.config.depth must be an int, got float 1000000000.0")


def _forbid_layer_construction(monkeypatch) -> list:
    """From now on, fail loudly if any AttentionLayers constructor runs; return the list of attempts."""
    calls = []

    @functools.wraps(sf.AttentionLayers.__init__)
    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("depth"))
        raise AssertionError("an AttentionLayers was constructed")

    monkeypatch.setattr(sf.AttentionLayers, "__init__", spy)
    return calls


@pytest.mark.parametrize("model, field", [("TransformerWrapper", "attn_layers.config.depth"),
                                          ("XTransformer", "enc_depth"), ("XTransformer", "dec_depth")])
def test_hostile_huge_int_depth_beside_a_one_layer_file_fails_fast(tmp_path, monkeypatch, model, field):
    _, _, path = saved(tmp_path, model)
    no_layer_construction = _forbid_layer_construction(monkeypatch)
    keys = field.split(".")

    def edit(config):
        target = config["config"]
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = 10**9

    _edit_file(path, edit)
    start = time.perf_counter()
    _load_error(path, CONFIG_NAME, f"config.{field} = 1000000000 layers", str(path / WEIGHTS_NAME))
    assert time.perf_counter() - start < 0.5
    assert no_layer_construction == []  # refused before any constructor ran


def test_hostile_huge_heads_fails_before_construction(tmp_path, monkeypatch):
    _, _, path = saved(tmp_path, "Encoder")  # ALiBi: the slopes are a Python list of `heads` floats
    no_layer_construction = _forbid_layer_construction(monkeypatch)
    _edit_file(path, lambda c: c["config"].update(heads=10**9))
    _load_error(path, CONFIG_NAME, "config.heads = 1000000000 heads", str(path / WEIGHTS_NAME))
    assert no_layer_construction == []


def test_hostile_huge_num_tokens_fails_without_allocating(wrapper_ckpt, monkeypatch):
    devices = []
    original = sf.TransformerWrapper.__init__

    @functools.wraps(original)
    def spy(self, *args, **kwargs):
        devices.append(torch.empty(0).device.type)  # the device construction would allocate on
        original(self, *args, **kwargs)

    monkeypatch.setattr(sf.TransformerWrapper, "__init__", spy)
    _edit_file(wrapper_ckpt, lambda c: c["config"].update(num_tokens=10**12))
    start = time.perf_counter()
    _load_error(wrapper_ckpt, WEIGHTS_NAME, "shape mismatch for token_emb.emb.weight", f"[{10**12}, {DIM}]",
                str(wrapper_ckpt / CONFIG_NAME))
    assert time.perf_counter() - start < 1.0
    assert devices == ["meta"]  # built once, on the meta device only
    _edit_file(wrapper_ckpt, lambda c: c["config"].update(num_tokens=10**30))
    _load_error(wrapper_ckpt, CONFIG_NAME, "config.num_tokens is out of the int64 range")


@pytest.mark.parametrize("dtype", ["int64", "bool", "float99", "Tensor", 32, None])
def test_hostile_wrong_dtype_name(wrapper_ckpt, dtype):
    _edit_file(wrapper_ckpt, lambda c: c.update(dtype=dtype))
    _load_error(wrapper_ckpt, CONFIG_NAME, "dtype names an unknown or non-floating dtype", repr(dtype))


def test_hostile_header_and_config_tensor_names_differ(wrapper_ckpt):
    _rewrite_weights(wrapper_ckpt, lambda t: t.__setitem__("token_emb.renamed", t.pop("token_emb.emb.weight")))
    _load_error(wrapper_ckpt, WEIGHTS_NAME, "missing ['token_emb.emb.weight']", "unexpected ['token_emb.renamed']")


def test_hostile_shape_mismatch(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"].update(num_tokens=VOCAB + 1))
    _load_error(wrapper_ckpt, WEIGHTS_NAME, "shape mismatch for token_emb.emb.weight",
                f"the file has [{VOCAB}, {DIM}], the config gives [{VOCAB + 1}, {DIM}]")


def test_hostile_integer_tensor_where_a_float_belongs(wrapper_ckpt):
    _rewrite_weights(wrapper_ckpt, lambda t: t.update({"token_emb.emb.weight": t["token_emb.emb.weight"].long()}))
    _load_error(wrapper_ckpt, WEIGHTS_NAME, "dtype mismatch for token_emb.emb.weight: the file has I64")


def test_hostile_tied_tensor_stored_twice(tmp_path):
    _, _, path = saved(tmp_path, "XTransformer")
    _rewrite_weights(path, lambda t: t.update({"encoder.token_emb.emb.weight": t["decoder.net.token_emb.emb.weight"].clone()}))
    _load_error(path, WEIGHTS_NAME, "unexpected ['decoder.net.token_emb.emb.weight (the same tensor as encoder.token_emb.emb.weight)']")


@pytest.mark.parametrize("header", [
    struct.pack("<Q", 10**12),  # a header length no file can hold
    struct.pack("<Q", 2) + b"[]",
    struct.pack("<Q", 64) + json.dumps({"a": {"dtype": "F32", "shape": [10**6], "data_offsets": [0, 4]}}).encode().ljust(64),
    struct.pack("<Q", 64) + json.dumps({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}).encode().ljust(64),
    struct.pack("<Q", 64) + json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode().ljust(64) + bytes(8),
])
def test_hostile_safetensors_header(wrapper_ckpt, header):
    (wrapper_ckpt / WEIGHTS_NAME).write_bytes(header + bytes(4))
    _load_error(wrapper_ckpt, WEIGHTS_NAME, "could not read weights from")


def test_hostile_constructor_errors_become_value_errors_with_the_cause(wrapper_ckpt):
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].update(causal=False))
    err = _load_error(wrapper_ckpt, CONFIG_NAME, "config.attn_layers.config could not build a Decoder", "causal")
    assert isinstance(err.__cause__, TypeError)
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].update(causal=None))  # still unknown to Decoder
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].pop("causal"))
    _edit_file(wrapper_ckpt, lambda c: c["config"]["attn_layers"]["config"].update(dim=0))
    err = _load_error(wrapper_ckpt, CONFIG_NAME, "could not build a Decoder", "dim and depth must be positive")
    assert isinstance(err.__cause__, ValueError) and "positive" in str(err.__cause__)


def test_from_config_checks_the_config_too():
    config = MODELS["TransformerWrapper"][0]().get_config()
    config["attn_layers"]["config"]["depth"] = "1"
    with pytest.raises(ValueError, match=r"config\.attn_layers\.config\.depth must be an int, got str '1'"):
        sf.TransformerWrapper.from_config(config)
    config["attn_layers"] = sf.Decoder(**BASE)  # a live object is not a config
    with pytest.raises(ValueError, match=r"config\.attn_layers must be \{"):
        sf.TransformerWrapper.from_config(config)
