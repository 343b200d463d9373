"""Fuzzing ``load_training_state`` with corrupted training-state folders.

A real small training state (a safeformer decoder with AdamW after one step, a LambdaLR scheduler, the
torch, Python and NumPy generator states) is saved once. Each example copies it, corrupts one file in
one way and loads it into objects built afresh (stepped once on other data, gradients set, or not
stepped at all). The outcome must be one of:

- a ``ValueError`` whose message names the corrupted file, with the model, the gradients, the optimizer,
  the scheduler and the three random generators exactly as before the call;
- a load equal to the original (weights, optimizer and scheduler states, generators, step, extra), after
  which a training step works and keeps the weights finite.

Any other exception type fails the test. Two kinds of corruption:

- raw bytes, the folder's ``sha256`` record left as it is: truncation at a random offset, byte flips
  and appended bytes, in each of the four files (headers favoured);
- structural, the ``sha256`` record recomputed afterwards (a hostile but consistent writer), so that only
  the structural checks can catch them: JSON fields deleted, replaced by values of another type or out
  of range (scheduler, optimizer param groups and scalars, Python and NumPy generator states, step,
  format, extra), keys added; tensors removed, added, reshaped, retyped, made non-finite or negative
  (second moments) in the three safetensors files, the torch generator blob included. The values drawn
  are all invalid ones: a plausible other value (a different learning rate, a different finite weight)
  is caught by the sha256 record, which the raw-bytes test covers.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch as safetensors
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_training_state import OPT, RNG, STATE, WEIGHTS, assert_same, resign, snapshot, tiny, train_step

from safeformer.checkpoints.training_state import load_training_state, save_training_state

EXTRA = {"note": "x", "losses": [1.5, 2.25]}
# a few dozen examples per kind of corruption by default (HYPOTHESIS_PROFILE=thorough: ten times more)
EXAMPLES = 2 * settings.default.max_examples


class Saved(tuple):
    """(folder, snapshot); its repr stays short in Hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<the pristine training state in {self[0]}>"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The pristine folder and a snapshot of the objects it was saved from (RNG states as saved)."""
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    net, opt, sched = tiny()
    original = snapshot(net, opt, sched)
    original.pop("grads")
    path = save_training_state(tmp_path_factory.mktemp("fuzz") / "state", net, opt, sched, step=1, extra=EXTRA)
    return Saved((path, original))


def check_outcome(path: Path, file: str, original: dict, stepped: bool, *, events: bool = True) -> str:
    """Load ``path`` into fresh objects: a ValueError naming ``file`` that changed nothing, or the original."""
    net, opt, sched = tiny(seed=9, stepped=stepped)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    before = snapshot(net, opt, sched)
    try:
        info = load_training_state(path, net, opt, sched)
    except ValueError as err:
        assert file in str(err), f"the error does not name {file}: {err}"
        assert_same(snapshot(net, opt, sched), before, f"a refused load ({err}) changed")
        if events:  # pytest --hypothesis-show-statistics shows how often each outcome happened
            sha = "sha256 recorded" in str(err) or "sha256 it records" in str(err)
            event("refused by the sha256 record" if sha else "refused by a structural check")
        return "refused"
    assert info == {"step": 1, "extra": EXTRA}, info
    after = snapshot(net, opt, sched)
    after.pop("grads")
    assert_same(after, original, f"a load of a corrupted {file} differs from the original")
    train_step(net, opt, sched)
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters()), "a step after the load is not finite"
    if events:
        event("loaded, equal to the original")
    return "loaded"


def copied(src: Path, tmp: str) -> Path:
    path = Path(tmp) / "state"
    shutil.copytree(src, path)
    return path


# ----------------------------------------------------------------------------------------------------
# Raw bytes (the sha256 record untouched)
# ----------------------------------------------------------------------------------------------------


def _header_end(file: str, raw: bytes) -> int:
    """Where a safetensors file's JSON header ends (the whole file for the JSON record)."""
    if file == STATE or len(raw) < 8:
        return len(raw)
    return min(len(raw), 8 + int.from_bytes(raw[:8], "little"))


@settings(max_examples=2 * EXAMPLES)
@given(file=st.sampled_from([STATE, WEIGHTS, OPT, RNG]), kind=st.sampled_from(["flip", "truncate", "flip", "append"]),
       in_header=st.booleans(), stepped=st.booleans(), data=st.data())
def test_raw_byte_corruption_is_refused_or_harmless(saved, file, kind, in_header, stepped, data):
    src, original = saved
    with tempfile.TemporaryDirectory() as tmp:
        path = copied(src, tmp)
        raw = bytearray((path / file).read_bytes())
        end = _header_end(file, raw) if in_header else len(raw)
        if kind == "truncate":
            raw = raw[:data.draw(st.integers(0, end - 1), label="keep")]
        elif kind == "flip":
            for _ in range(data.draw(st.integers(1, 3), label="flips")):
                raw[data.draw(st.integers(0, end - 1), label="offset")] ^= data.draw(st.integers(1, 255), label="xor")
        else:
            raw += data.draw(st.binary(min_size=1, max_size=16), label="appended")
        (path / file).write_bytes(bytes(raw))
        check_outcome(path, file, original, stepped)


# ----------------------------------------------------------------------------------------------------
# JSON fields (the sha256 record recomputed)
# ----------------------------------------------------------------------------------------------------

REGIONS = ["format", "version", "step", "extra", "optimizer", "scheduler", "python_random", "numpy_random"]
_WORDS = (0, 1, 311, 623)  # a few words of a Mersenne Twister state stand for all of them


def _nodes(value, path: tuple) -> list[tuple]:
    """Every node under ``path`` (lists of generator words: a few of them)."""
    out = [path]
    if path == ("extra",):
        return out  # the caller's own data: any value of it is legitimate
    if isinstance(value, dict):
        for k, v in value.items():
            out += _nodes(v, path + (k,))
    elif isinstance(value, list):
        indices = range(len(value))
        if len(value) >= 624:  # generator words: a few, and the position after them (Python's)
            indices = [*_WORDS, *([624] if len(value) == 625 else [])]
        for i in indices:
            out += _nodes(value[i], path + (i,))
    return out


def _hostile(value, path: tuple) -> list:
    """Replacements for ``value`` at ``path`` that no valid state holds there (another type, out of range)."""
    if path in (("python_random", 2), ("numpy_random", 4)):  # any finite number is a valid cached gaussian
        return [True, "x", [], {}]
    if isinstance(value, bool):
        return [not value, None, int(value), str(value).lower(), [value]]
    if value is None:
        return [True, False, 0, 1.5, "null", [], {}]
    if isinstance(value, int):  # every integer of the record must be >= 0 (and the version 1)
        return [-1 - value, value + 0.5, str(value), None, True, [value], 2**64]
    if isinstance(value, float):  # every float of the record must be >= 0 (the gaussians aside)
        return [-abs(value) - 1.0, "nan", "inf", "-inf", str(value), None, False, [value]]
    if isinstance(value, str):
        return [value + "x", "", None, 0, [value]]
    if isinstance(value, list):
        return [value[:-1], value + value[-1:], None, "x", {}, 5]
    return [None, [], "x", 5]  # a mapping


def _get(record, path: tuple):
    for key in path:
        record = record[key]
    return record


@settings(max_examples=2 * EXAMPLES)
@given(region=st.sampled_from(REGIONS), stepped=st.booleans(), data=st.data())
def test_json_field_corruption_is_refused(saved, region, stepped, data):
    src, original = saved
    with tempfile.TemporaryDirectory() as tmp:
        path = copied(src, tmp)
        record = json.loads((path / STATE).read_text())
        node = data.draw(st.sampled_from(_nodes(record[region], (region,))), label="node")
        parent, key = _get(record, node[:-1]), node[-1]
        value = parent[key]
        ops = ["delete", "replace"] + (["add key"] if isinstance(value, dict) and node != ("extra",) else [])
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = data.draw(st.sampled_from(_hostile(value, node)), label="value")
        else:
            value["zzz"] = data.draw(st.sampled_from([1, None, "x", [1.5]]), label="added")
        (path / STATE).write_text(json.dumps(record))
        resign(path)
        check_outcome(path, STATE, original, stepped)


# ----------------------------------------------------------------------------------------------------
# Tensors in the safetensors files (the sha256 record recomputed)
# ----------------------------------------------------------------------------------------------------

_OPS = [(f, op) for f in (WEIGHTS, OPT, RNG) for op in ("remove", "add", "reshape", "retype")] + [
    (WEIGHTS, "nonfinite"), (OPT, "nonfinite"), (OPT, "negative")]
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
           torch.bool]


def _reshaped(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "flatten":
        return t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1)
    if how == "unsqueeze":
        return t.unsqueeze(0)
    if how == "shorter":
        return t[:-1] if t.dim() and t.shape[0] > 1 else torch.cat([t.reshape(-1), t.reshape(-1)])
    if how == "longer":
        return torch.cat([t, t[:1]]) if t.dim() else t.reshape(1)
    return t.reshape(-1)[0]  # a 0-d tensor


@settings(max_examples=2 * EXAMPLES)
@given(choice=st.sampled_from(_OPS), stepped=st.booleans(), data=st.data())
def test_tensor_corruption_is_refused(saved, choice, stepped, data):
    src, original = saved
    file, op = choice
    with tempfile.TemporaryDirectory() as tmp:
        path = copied(src, tmp)
        tensors = safetensors.load_file(str(path / file))
        names = sorted(tensors)
        if op == "negative":
            names = [n for n in names if n.endswith("::exp_avg_sq")]
        name = data.draw(st.sampled_from(names), label="name")
        t = tensors[name]
        if op == "remove":
            del tensors[name]
        elif op == "add":
            new = data.draw(st.sampled_from(
                [name + "x", "zzz", name.rpartition("::")[0] + "::foo", name.rpartition("::")[0] + "::max_exp_avg_sq",
                 "gpu", "cuda.x"]), label="added")
            if new not in tensors:
                same_shape = data.draw(st.booleans(), label="same shape")
                tensors[new] = t.clone() if same_shape else torch.zeros(3, dtype=t.dtype)
        elif op == "reshape":
            how = data.draw(st.sampled_from(["flatten", "unsqueeze", "shorter", "longer", "scalar"]), label="how")
            tensors[name] = _reshaped(t, how)
        elif op == "retype":
            dtype = data.draw(st.sampled_from([d for d in _DTYPES if d != t.dtype]), label="dtype")
            tensors[name] = t.to(dtype)
        else:
            flat = t.clone().reshape(-1)
            i = data.draw(st.integers(0, flat.numel() - 1), label="index")
            bad = [float("nan"), float("inf"), -float("inf")] if op == "nonfinite" else [-1e-3, -1.0]
            flat[i] = data.draw(st.sampled_from(bad), label="value")
            tensors[name] = flat.reshape(t.shape)
        safetensors.save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(path / file))
        resign(path)
        check_outcome(path, file, original, stepped)


def test_the_fuzzers_can_tell_a_correct_load(saved):
    """The oracle itself: the pristine folder, or one with a harmless change, loads equal to the original."""
    src, original = saved
    with tempfile.TemporaryDirectory() as tmp:
        path = copied(src, tmp)
        assert check_outcome(path, STATE, original, stepped=True, events=False) == "loaded"
        record = json.loads((path / STATE).read_text())
        (path / STATE).write_text(json.dumps(record, indent=2) + "\n")  # other whitespace: the same record
        assert check_outcome(path, STATE, original, stepped=False, events=False) == "loaded"
