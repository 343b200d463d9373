"""Checkpoint writers are atomic: ``save_pretrained``, ``save_training_state`` and train.py's checkpoints.

Each writer fills a temporary folder beside the target and renames it into place (an existing target is
renamed aside first and removed after), so a reader sees the old checkpoint or the new one, never a mix.
A failure anywhere while writing removes the temporary folder: a new target does not appear, an existing
one is left byte for byte as it was, and no temporary folder is left behind. A folder holding files the
writer did not write is never replaced.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import safeformer as sf
from safeformer.checkpoints.pretrained import CONFIG_NAME, WEIGHTS_NAME
from safeformer.checkpoints.training_state import STATE_NAME, load_training_state, save_training_state

ROOT = Path(__file__).resolve().parents[1]


def _model(seed: int = 0, depth: int = 1) -> sf.TransformerWrapper:
    torch.manual_seed(seed)
    return sf.TransformerWrapper(num_tokens=11, max_seq_len=8,
                                 attn_layers=sf.Decoder(dim=16, depth=depth, heads=2, dim_head=8))


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` by relative path: a file's bytes, ``None`` for a folder."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _listing(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Boom(OSError):
    """The stand-in for a failure of the disk or of a library while a checkpoint is being written."""


def _failing_weights_writer(monkeypatch, exc: type[BaseException] = Boom):
    """``safetensors.torch.save_model`` writes part of the file after config.json, then fails."""
    seen = []

    def save_model(model, filename, *args, **kwargs):
        seen.append((Path(filename).parent / CONFIG_NAME).is_file())
        Path(filename).write_bytes(b"\x00" * 17)  # a truncated weights file
        raise exc("the disk filled up while writing the weights")

    monkeypatch.setattr(st, "save_model", save_model)
    return seen


# ----------------------------------------------------------------------------------------------------
# save_pretrained
# ----------------------------------------------------------------------------------------------------


def test_failed_save_pretrained_leaves_no_new_folder(tmp_path, monkeypatch):
    model, target = _model(), tmp_path / "ckpt"
    seen = _failing_weights_writer(monkeypatch)
    with pytest.raises(Boom, match="disk filled up"):
        model.save_pretrained(target)
    assert seen == [True], "the weights writer was not reached after config.json"
    assert not target.exists(), "a failed save left a half-written checkpoint folder"
    assert _listing(tmp_path) == [], f"temporary folders left behind: {_listing(tmp_path)}"


def test_failed_save_pretrained_keeps_the_existing_checkpoint_byte_for_byte(tmp_path, monkeypatch):
    old, target = _model(0), tmp_path / "ckpt"
    old.save_pretrained(target)
    before = _snapshot(target)
    _failing_weights_writer(monkeypatch)
    with pytest.raises(Boom):
        _model(1).save_pretrained(target)
    assert _snapshot(target) == before, "a failed save changed the existing checkpoint"
    assert _listing(tmp_path) == ["ckpt"], f"temporary folders left behind: {_listing(tmp_path)}"
    monkeypatch.undo()
    assert _same_weights(sf.TransformerWrapper.from_pretrained(target), old)


def test_interrupted_save_pretrained_cleans_up_too(tmp_path, monkeypatch):
    # KeyboardInterrupt is no Exception: the clean-up must not depend on catching only Exceptions
    old, target = _model(0), tmp_path / "ckpt"
    old.save_pretrained(target)
    before = _snapshot(target)
    _failing_weights_writer(monkeypatch, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        _model(1).save_pretrained(target)
    assert _snapshot(target) == before
    assert _listing(tmp_path) == ["ckpt"]


def test_bad_state_dict_fails_before_anything_is_in_place(tmp_path):
    # no monkeypatching: a state_dict entry that is not a tensor fails after config.json is written
    model, target = _model(), tmp_path / "ckpt"
    with pytest.raises(AttributeError):
        sf.save_pretrained(model, target, state_dict={"token_emb.emb.weight": "not a tensor"})
    assert not target.exists() and _listing(tmp_path) == []


@pytest.mark.parametrize("existing", [False, True])
def test_save_pretrained_without_safetensors_changes_nothing(tmp_path, monkeypatch, existing):
    import safeformer.checkpoints.pretrained as pretrained

    target = tmp_path / "ckpt"
    if existing:
        _model(0).save_pretrained(target)
    before = _snapshot(target) if existing else None

    def missing():
        raise ImportError("checkpoints need the 'safetensors' package: pip install safetensors")

    monkeypatch.setattr(pretrained, "_safetensors", missing)
    with pytest.raises(ImportError, match="safetensors"):
        _model(1).save_pretrained(target)
    assert (_snapshot(target) if existing else target.exists()) == (before if existing else False)
    assert _listing(tmp_path) == (["ckpt"] if existing else [])


def test_target_holds_the_old_checkpoint_while_the_new_one_is_written(tmp_path, monkeypatch):
    # what a concurrent reader would see at the moment the weights are written: the old folder, whole
    old, target = _model(0), tmp_path / "ckpt"
    old.save_pretrained(target)
    before = _snapshot(target)
    real, during = st.save_model, []

    def save_model(model, filename, *args, **kwargs):
        during.append(_snapshot(target))
        return real(model, filename, *args, **kwargs)

    monkeypatch.setattr(st, "save_model", save_model)
    new = _model(1, depth=2)  # another config.json too
    new.save_pretrained(target)
    assert during == [before], "the target was changed in place while the new checkpoint was written"
    assert _same_weights(sf.TransformerWrapper.from_pretrained(target), new)
    assert _listing(tmp_path) == ["ckpt"]


def test_failed_swap_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    old, target = _model(0), tmp_path / "ckpt"
    old.save_pretrained(target)
    before = _snapshot(target)
    real, calls = os.rename, []

    def rename(src, dst, *args, **kwargs):
        calls.append((Path(src).name, Path(dst).name))
        if Path(dst) == target and len(calls) == 2:  # the new folder into place (the old one is aside)
            raise Boom("rename failed")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Boom, match="rename failed"):
        _model(1).save_pretrained(target)
    monkeypatch.undo()
    assert calls and calls[0][0] == "ckpt", f"the old checkpoint was not renamed aside first: {calls}"
    assert _snapshot(target) == before
    assert _listing(tmp_path) == ["ckpt"]


def test_save_pretrained_replaces_and_round_trips(tmp_path):
    target = tmp_path / "ckpt"
    _model(0).save_pretrained(target)
    new = _model(1)
    assert new.save_pretrained(target) == target
    assert _listing(target) == [CONFIG_NAME, WEIGHTS_NAME]
    assert _listing(tmp_path) == ["ckpt"]
    loaded = sf.TransformerWrapper.from_pretrained(target).eval()
    assert _same_weights(loaded, new)
    x = torch.arange(6).reshape(1, 6) % 11
    assert torch.equal(loaded(x), new.eval()(x))


def test_save_pretrained_refuses_to_replace_a_folder_with_other_files(tmp_path):
    # replacing the whole folder would delete them: the save is refused and nothing changes
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    before = _snapshot(target)
    with pytest.raises(ValueError, match=r"notes\.txt"):
        _model().save_pretrained(target)
    assert _snapshot(target) == before and _listing(tmp_path) == ["ckpt"]


# ----------------------------------------------------------------------------------------------------
# save_training_state
# ----------------------------------------------------------------------------------------------------


def _training(seed: int = 0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(6).reshape(1, 6) % 11).sum().backward()
    opt.step()
    return model, opt


def _failing_rng_writer(monkeypatch):
    """``safetensors.torch.save_file`` fails on the RNG file, after the weights and the optimizer."""
    real = st.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if Path(filename).name == "rng.safetensors":
            raise Boom("the disk filled up while writing the RNG state")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(st, "save_file", save_file)


def test_failed_training_state_leaves_no_new_folder(tmp_path, monkeypatch):
    model, opt = _training()
    _failing_rng_writer(monkeypatch)
    with pytest.raises(Boom):
        save_training_state(tmp_path / "state", model, opt, step=1)
    assert not (tmp_path / "state").exists()
    assert _listing(tmp_path) == [], f"temporary folders left behind: {_listing(tmp_path)}"


def test_failed_training_state_keeps_the_existing_one_byte_for_byte(tmp_path, monkeypatch):
    model, opt = _training()
    target = save_training_state(tmp_path / "state", model, opt, step=1, pretrained={"net": model})
    before = _snapshot(target)
    _failing_rng_writer(monkeypatch)
    with pytest.raises(Boom):
        save_training_state(target, model, opt, step=2, pretrained={"net": model})
    assert _snapshot(target) == before
    assert _listing(tmp_path) == ["state"], f"temporary folders left behind: {_listing(tmp_path)}"
    monkeypatch.undo()
    model2, opt2 = _training(5)
    assert load_training_state(target, model2, opt2)["step"] == 1


def test_training_state_refuses_to_replace_a_folder_with_other_files(tmp_path):
    model, opt = _training()
    target = tmp_path / "runs"
    target.mkdir()
    (target / "metrics.json").write_text("{}")
    with pytest.raises(ValueError, match=r"metrics\.json"):
        save_training_state(target, model, opt, step=1)
    assert _listing(target) == ["metrics.json"] and _listing(tmp_path) == ["runs"]


def test_training_state_replaces_and_round_trips(tmp_path):
    model, opt = _training()
    target = save_training_state(tmp_path / "state", model, opt, step=1)
    model, opt = _training(1)
    assert save_training_state(target, model, opt, step=2, pretrained={"net": model}) == target
    assert _listing(tmp_path) == ["state"]
    assert STATE_NAME in _listing(target) and _listing(target / "net") == [CONFIG_NAME, WEIGHTS_NAME]
    model2, opt2 = _training(5)
    assert load_training_state(target, model2, opt2)["step"] == 2
    assert _same_weights(model2, model)
    assert _same_weights(sf.TransformerWrapper.from_pretrained(target / "net"), model)


# ----------------------------------------------------------------------------------------------------
# train.py's checkpoints
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_script_atomic", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_script_atomic"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_failed_train_checkpoint_keeps_the_previous_one(train, tmp_path):
    threads = torch.get_num_threads()
    try:
        torch.manual_seed(0)
        job = train.build_model(train.Config(dim=16, depth=1, heads=2, dim_head=8, text_dim=16, text_depth=1))
        opt = torch.optim.AdamW(job.parameters(), lr=1e-3)
        ckpt = tmp_path / "checkpoint"
        train.save_checkpoint(ckpt, job, opt, dict(step=4, history={"train": [1.0]}))
        before = _snapshot(ckpt)
        assert {"decoder", "text_encoder", STATE_NAME} <= set(_listing(ckpt))
        # a record that is no JSON fails after every weight file was written
        with pytest.raises(TypeError, match="extra"):
            train.save_checkpoint(ckpt, job, opt, dict(step=8, history={"train": torch.ones(3)}))
        assert _snapshot(ckpt) == before
        assert _listing(tmp_path) == ["checkpoint"], f"temporary folders left behind: {_listing(tmp_path)}"
        assert train.load_checkpoint(ckpt, job, opt, torch.device("cpu"))["step"] == 4
    finally:
        torch.set_num_threads(threads)
