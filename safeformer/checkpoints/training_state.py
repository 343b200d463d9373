"""Training state on disk: model, optimizer, scheduler, RNG and step, as safetensors and JSON (no pickle).

``save_training_state(directory, model, optimizer, scheduler, step=...)`` writes a folder that
``load_training_state`` reads back into freshly built objects, so that an interrupted run continues
bit for bit (on the CPU) as if it had never stopped.

The model may be plain, wrapped in DDP (pass the inner module) or sharded with FSDP2 (``fully_shard``):
the state is gathered full (unsharded) through ``torch.distributed.checkpoint.state_dict``, written by
rank 0, and loaded back into the same or another layout (a run saved under FSDP resumes under DDP or in
one process, and the other way round). Under ``torch.distributed`` every rank must call both functions.

Layout of a training-state folder (written to a temporary folder, then swapped in: a crash while saving
never leaves a half-written state behind):

    config.json, model.safetensors   the model's full weights (and its config when it is a safeformer model)
    <name>/config.json, ...          ``pretrained={name: submodule}``: sub-models as ``from_pretrained`` folders
    optimizer.safetensors            every tensor of the optimizer's state, as "<parameter name>::<key>"
    rng.safetensors                  torch's CPU generator state (and each CUDA device's, as "cuda.<i>")
    training_state.json              {"format": "safeformer-training", "version": 1, "step", "extra",
                                      "optimizer": {"param_groups", "scalars"}, "scheduler",
                                      "python_random", "numpy_random", "sha256"}

``sha256`` maps each safetensors file to its SHA-256, and ``training_state.json`` to the SHA-256 of its own
record (without that entry; keys sorted, compact separators). Folders written before it existed load
without the integrity check.

A training-state folder is hostile input. ``load_training_state`` checks everything it will load before
it changes anything (the model, the optimizer, the scheduler and the random generators are untouched
when any check fails), and every problem is a ``ValueError`` naming the file and the field or tensor:

1. ``training_state.json``: size, UTF-8, JSON without NaN/Infinity or out-of-range floats, the format and
   version, ``step`` (an integer in [0, 2**63)), ``extra`` (a mapping), the ``sha256`` record.
2. ``model.safetensors``: readable (not truncated), exactly the model's state-dict names, each with the
   model's shape and dtype; parameters finite; tensors the model ties together equal.
3. The optimizer: the param groups against the optimizer's (count, parameter names, keys; booleans,
   strings and ``None`` equal to the optimizer's, a missing one taking its value; numbers finite and
   keeping the sign of its values), then through the optimizer's own constructor and one zero-gradient
   step of a probe with tiny stand-in parameters, which also yields the state layout it keeps (fields,
   shapes, dtypes) for every ``torch.optim`` optimizer. Every state entry must name a parameter the
   optimizer holds; a parameter has no state or exactly that layout; tensors are finite (second moments
   and the like >= 0), scalars finite numbers. Other optimizers: state tensors need the shape and dtype of
   the optimizer's current state, or else of the parameter.
4. The scheduler: its state against the freshly built scheduler's ``state_dict()`` (same keys and
   structure; booleans, strings and ``None`` equal, a missing one taking its value; integers integers;
   numbers finite and keeping the sign of its values).
5. The random generators (with ``restore_rng``): torch's CPU state (a uint8 blob of the right size that
   torch accepts), CUDA states, Python's and NumPy's Mersenne Twister states (sizes, ranges, positions).
6. The SHA-256 of ``training_state.json``'s record and of every safetensors file read (byte flips that
   leave a well-formed but different file).

Only then are the objects loaded.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .pretrained import CONFIG_NAME, WEIGHTS_NAME, Configurable, _unshared, _write_pretrained, atomic_folder

__all__ = ["save_training_state", "load_training_state", "STATE_NAME"]

STATE_NAME = "training_state.json"
_OPTIMIZER_NAME = "optimizer.safetensors"
_RNG_NAME = "rng.safetensors"
_DIGESTS = "sha256"
_FORMAT = "safeformer-training"
_VERSION = 1
_MAX_JSON = 64 * 2**20
_INT64 = 2**63 - 1
_MT_N = 624  # words of a Mersenne Twister state
# torch.optim state fields that hold running magnitudes (>= 0): a negative one makes the next step NaN
_NONNEGATIVE_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum", "exp_inf",
                                "variance", "row_var", "col_var", "step_size"})
_PROBE_DIMS = (2, 3, 5, 7, 11, 13)  # distinct sizes: each dimension of a probe's state maps back to one
_STATE_FILES = frozenset({CONFIG_NAME, WEIGHTS_NAME, _OPTIMIZER_NAME, _RNG_NAME, STATE_NAME})


def _st():
    import safetensors.torch as st

    return st


def _jsonable(value: Any, where: str) -> Any:
    """``value`` as JSON (tuples become lists); a tensor or an object is a clear error."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{where} holds a {type(value).__name__}, which a training state cannot store as JSON")


def _unjson_float(value: Any) -> Any:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, list):
        return [_unjson_float(v) for v in value]
    if isinstance(value, dict):
        return {k: _unjson_float(v) for k, v in value.items()}
    return value


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _record_digest(record: dict) -> str:
    """SHA-256 of the record as parsed JSON, without its own entry in ``sha256`` (keys sorted, compact)."""
    body = dict(record)
    if isinstance(body.get(_DIGESTS), dict):
        body[_DIGESTS] = {k: v for k, v in body[_DIGESTS].items() if k != STATE_NAME}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _not_state_files(path: Path) -> list[str]:
    """The entries of an existing folder that ``save_training_state`` did not write (it would delete them):
    none in a training-state folder (it is replaced whole, ``pretrained`` sub-folders included), else
    anything but the files a training state holds."""
    if (path / STATE_NAME).is_file():
        return []
    return sorted(e.name for e in path.iterdir() if e.name not in _STATE_FILES or not e.is_file())


def save_training_state(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    step: int,
    extra: dict | None = None,
    pretrained: dict[str, nn.Module] | None = None,
) -> Path:
    """Write everything a run needs to continue exactly: model, optimizer, scheduler, RNG, step.

    Args:
        directory: the folder to (re)write, replaced whole and atomically (``pretrained.atomic_folder``:
            a reader sees the old state or the new one; when anything fails while writing, the old one is
            left as it was and no temporary folder remains). An existing folder must be a training state
            (or hold nothing but its files): one holding anything else is refused, never emptied.
        model: the model (plain, or the module inside DDP, or sharded with FSDP2's ``fully_shard``).
        optimizer: any ``torch.optim`` optimizer over ``model``'s parameters.
        scheduler: anything with ``state_dict()`` / ``load_state_dict()`` whose state is JSON
            (every ``torch.optim.lr_scheduler`` scheduler: learning-rate lambdas are code, not state).
        step: the number of optimizer steps done.
        extra: any JSON-able record of the caller's (history, config, ...).
        pretrained: ``{folder name: submodule of model}`` (``model`` itself included): also written as
            ``from_pretrained`` folders (safeformer models), e.g. the decoder of a larger job.

    Returns:
        the folder's path. Under ``torch.distributed`` every rank must call it; rank 0 writes.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _INT64:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    opts = _full_options(cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)  # full, on rank 0 (a collective when sharded)
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    path = Path(directory)
    if _dist_rank() != 0:
        _barrier()
        return path
    subs = _pretrained_parts(model, weights, pretrained)
    st = _st()
    with atomic_folder(path, _not_state_files) as tmp:
        _write_weights(st, tmp, model, weights, subs)
        record: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "step": step,
                                  "extra": _jsonable(extra or {}, "extra")}
        if optim is not None:
            record["optimizer"] = _write_optimizer(st, tmp, optim)
        if scheduler is not None:
            record["scheduler"] = _jsonable(scheduler.state_dict(), "scheduler state")
        _write_rng(st, tmp, record)
        _seal_record(tmp, record)
    _barrier()
    return path


def _pretrained_parts(model: nn.Module, weights: dict[str, torch.Tensor],
                      pretrained: dict[str, nn.Module] | None) -> dict[str, tuple[nn.Module, dict]]:
    """``{folder: (submodule, its full state dict)}`` for ``save_training_state``'s ``pretrained``, checked."""
    names = {id(m): n for n, m in model.named_modules()}
    subs = {}
    for folder, sub in (pretrained or {}).items():
        prefix = names.get(id(sub))
        if prefix is None or not isinstance(sub, Configurable) or not isinstance(folder, str) or not folder \
                or "/" in folder or "\\" in folder or folder.startswith(".") or folder in _STATE_FILES:
            raise ValueError(f"pretrained[{folder!r}] must be a safeformer submodule of model, in a plain folder name")
        # the model itself has the empty name: all of its weights
        subs[folder] = (sub, {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")}
                        if prefix else weights)
    return subs


def _write_weights(st, tmp: Path, model: nn.Module, weights: dict[str, torch.Tensor],
                   subs: dict[str, tuple[nn.Module, dict]]) -> None:
    """The model's weights (with its config when it is a safeformer model) and the ``pretrained`` folders."""
    if isinstance(model, Configurable):
        _write_pretrained(model, tmp, state_dict=weights)
    else:
        st.save_file(_unshared(weights), str(tmp / WEIGHTS_NAME))
    for folder, (sub, sub_sd) in subs.items():
        _write_pretrained(sub, tmp / folder, state_dict=sub_sd)


def _write_optimizer(st, tmp: Path, optim: dict) -> dict:
    """The optimizer's state tensors to ``optimizer.safetensors``; returns the record's ``optimizer`` entry."""
    tensors, scalars = {}, {}
    for name, entry in optim["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{name}::{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{name}::{key}"] = _jsonable(value, f"optimizer state {name}::{key}")
    st.save_file(tensors, str(tmp / _OPTIMIZER_NAME))
    return {"param_groups": _jsonable(optim["param_groups"], "optimizer param_groups"), "scalars": scalars}


def _write_rng(st, tmp: Path, record: dict) -> None:
    """torch's (and CUDA's) generator states to ``rng.safetensors``; Python's and NumPy's into ``record``."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda.{i}"] = s
    st.save_file(rng, str(tmp / _RNG_NAME))
    record["python_random"] = _jsonable(random.getstate(), "python random state")
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        record["numpy_random"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # pragma: no cover - numpy is optional
        pass


def _seal_record(tmp: Path, record: dict) -> None:
    """The files' SHA-256 and the record's own into ``record``, then ``training_state.json`` written."""
    record[_DIGESTS] = {name: _sha256(tmp / name) for name in (WEIGHTS_NAME, _OPTIMIZER_NAME, _RNG_NAME)
                        if (tmp / name).is_file()}
    record[_DIGESTS][STATE_NAME] = _record_digest(json.loads(json.dumps(record)))  # the record as read back
    (tmp / STATE_NAME).write_text(json.dumps(record))


# ----------------------------------------------------------------------------------------------------
# Loading: every check first (nothing is changed), then the objects are loaded
# ----------------------------------------------------------------------------------------------------


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of the float range")
    return value


def _read_record(state_file: Path) -> dict:
    size = state_file.stat().st_size
    if size > _MAX_JSON:
        raise ValueError(f"{state_file} is larger than {_MAX_JSON} bytes: not a training state")
    try:
        record = json.loads(state_file.read_bytes().decode("utf-8"), parse_constant=_reject_constant,
                            parse_float=_finite_float)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{state_file} is not valid JSON (truncated or corrupted?): {err}") from err
    version = record.get("version") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("format") != _FORMAT or type(version) is not int \
            or version != _VERSION:
        raise ValueError(f"{state_file} is not a safeformer training state (format/version)")
    return record


def _read_tensors(file: Path, device: str) -> dict[str, torch.Tensor]:
    try:
        return _st().load_file(str(file), device=device)
    except Exception as err:  # safetensors raises its own error types for truncated or corrupted files
        raise ValueError(f"{file} could not be read as safetensors (truncated or corrupted?): "
                         f"{type(err).__name__}: {err}") from err


def _check_digests(record: dict, state_file: Path, needed: tuple[str, ...]) -> dict[str, str] | None:
    """The ``sha256`` record (``None`` for a folder written before it existed), checked for its form."""
    if _DIGESTS not in record:
        return None
    digests = record[_DIGESTS]
    allowed = (WEIGHTS_NAME, _OPTIMIZER_NAME, _RNG_NAME, STATE_NAME)
    if not isinstance(digests, dict) or not all(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)
                                                for v in digests.values()):
        raise ValueError(f"{state_file}: field 'sha256' must map file names to 64 lowercase hex digits")
    unexpected = sorted(set(digests) - set(allowed))
    missing = sorted(set(needed) - set(digests))
    if unexpected or missing:
        raise ValueError(f"{state_file}: field 'sha256' does not fit the folder: missing {missing}, "
                         f"unexpected {unexpected}")
    return digests


def _is_flag(value: Any) -> bool:
    return value is None or isinstance(value, (bool, str))


def _like(saved: Any, ref: Any, where: str, file: Path, *, exact_ints: bool = True) -> Any:
    """``saved`` (parsed JSON) checked against ``ref`` (what the object built now holds), in ``ref``'s types.

    Booleans, strings and ``None`` must equal ``ref``'s (they are configuration); numbers must be numbers
    (integers where ``ref`` is one and ``exact_ints``), finite (or ``ref``'s own non-finite value), in the
    int64 range and >= 0 where ``ref`` is; lists have ``ref``'s length, mappings ``ref``'s keys (a missing
    flag takes ``ref``'s value).
    """

    def bad(problem: str) -> ValueError:
        return ValueError(f"{file}: {where} {problem}")

    if isinstance(ref, torch.Tensor):
        if ref.numel() != 1:
            raise bad("holds a tensor in the object built now, which a training state cannot store")
        value = _like(saved, ref.item(), where, file, exact_ints=exact_ints)
        try:
            out = torch.tensor(value, dtype=ref.dtype, device=ref.device).reshape(ref.shape)
        except (RuntimeError, OverflowError) as err:
            raise bad(f"does not fit {ref.dtype}: {err}") from err
        overflowed = (out.is_floating_point() or out.is_complex()) and not bool(torch.isfinite(out).all())
        if overflowed and math.isfinite(value):
            raise bad(f"is out of the range of {ref.dtype}: {_show(saved)}")
        return out
    if ref is None or isinstance(ref, (bool, str)):
        if type(saved) is not type(ref) or saved != ref:
            raise bad(f"must be {_show(ref)} (as in the object built now), got {_show(saved)}")
        return saved
    if isinstance(ref, (int, float)):
        if isinstance(ref, float) and isinstance(saved, str) and saved in ("nan", "inf", "-inf"):
            saved = float(saved)
        if isinstance(saved, bool) or not isinstance(saved, (int, float)):
            raise bad(f"must be a number, got {_show(saved)}")
        if isinstance(ref, int) and exact_ints and not isinstance(saved, int):
            raise bad(f"must be an integer, got {_show(saved)}")
        if isinstance(saved, int):
            if abs(saved) > _INT64:
                raise bad(f"is out of the int64 range: {_show(saved)}")
            if isinstance(ref, float):
                saved = float(saved)
        if not math.isfinite(saved):
            if not (isinstance(ref, float) and saved == ref):  # NaN is never allowed
                raise bad(f"must be finite, got {saved!r}")
        elif math.isfinite(ref) and ref >= 0 and saved < 0:
            raise bad(f"must be >= 0 (like {_show(ref)} in the object built now), got {_show(saved)}")
        return saved
    if isinstance(ref, (list, tuple)):
        if not isinstance(saved, list):
            raise bad(f"must be a list, got {_show(saved)}")
        if not ref:
            return type(ref)(saved) if isinstance(ref, tuple) else list(saved)
        if len(saved) != len(ref):
            raise bad(f"must hold {len(ref)} items (as in the object built now), got {len(saved)}")
        items = [_like(s, r, f"{where}[{i}]", file, exact_ints=exact_ints) for i, (s, r) in enumerate(zip(saved, ref))]
        return tuple(items) if isinstance(ref, tuple) else items
    if isinstance(ref, dict):
        if not isinstance(saved, dict):
            raise bad(f"must be a mapping, got {_show(saved)}")
        keys = {str(k): k for k in ref}
        # a missing flag (e.g. a key a newer torch added) takes the value of the object built now, which a
        # saved one must equal anyway; anything else must be there
        missing = sorted(k for k in set(keys) - set(saved) if not _is_flag(ref[keys[k]]))
        unexpected = sorted(set(saved) - set(keys))
        if missing or unexpected:
            raise bad(f"does not fit the object built now: missing {missing[:5]}, unexpected {unexpected[:5]}")
        out = {keys[k]: _like(saved[k], ref[keys[k]], f"{where}.{k}", file, exact_ints=exact_ints)
               if k in saved else ref[keys[k]] for k in keys}
        if type(ref) is not dict:
            try:
                out = type(ref)(out)  # e.g. MultiStepLR's milestones, a Counter with integer keys
            except Exception:
                pass
        return out
    raise bad(f"holds a {type(ref).__name__} in the object built now, which a training state cannot store")


def _check_weights(model: nn.Module, weights: dict[str, torch.Tensor], w_file: Path) -> None:
    reference = model.state_dict()
    expected = set(reference)
    if set(weights) != expected:
        raise ValueError(f"weights in {w_file} do not fit the model: missing "
                         f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]}")
    problems = []
    for name, ref in reference.items():
        t = weights[name]
        if tuple(t.shape) != tuple(ref.shape):
            problems.append(f"{name!r} has shape {tuple(t.shape)}, the model has {tuple(ref.shape)}")
        elif t.dtype != ref.dtype:
            problems.append(f"{name!r} has dtype {t.dtype}, the model has {ref.dtype}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"weights in {w_file} do not fit the model: {'; '.join(problems[:5])}{more}")
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        t = weights.get(name)
        if t is not None and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{w_file}: parameter {name!r} holds NaN or inf")
        tied.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        tied.setdefault(id(b), []).append(name)
    for names in tied.values():
        names = [n for n in names if n in weights]
        for other in names[1:]:
            if not torch.equal(weights[names[0]], weights[other]):
                raise ValueError(f"{w_file}: {names[0]!r} and {other!r} are one tensor in the model, but the file "
                                 "holds different values for them")


def _probe_shape(param: torch.Tensor) -> tuple[int, ...]:
    return _PROBE_DIMS[:param.dim()] if param.dim() <= len(_PROBE_DIMS) else tuple(param.shape)


def _expected_shape(state_shape: tuple[int, ...], probe_shape: tuple[int, ...],
                    shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a state tensor needs for a parameter of ``shape``, from the probe's (shape ``probe_shape``)."""
    if probe_shape == shape:
        return state_shape
    return tuple(shape[probe_shape.index(d)] if d in probe_shape else d for d in state_shape)


def _probe_layouts(optimizer: torch.optim.Optimizer, hypers: list[dict],
                   state_file: Path) -> dict[int, tuple[dict, tuple]]:
    """Per parameter (by id): the state a ``torch.optim`` optimizer keeps for it, and the probe's shape.

    A probe of the optimizer's class is built with each saved param group's hyperparameters (its
    constructor checks their ranges) over tiny stand-in parameters of the same rank, dtype and device,
    and takes one step with zero gradients; its state gives the fields, and the shapes and dtypes
    relative to the parameter, of the real state.
    """
    cls = type(optimizer)
    ctor = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    layouts: dict[int, tuple[dict, tuple]] = {}
    for i, (hyper, group) in enumerate(zip(hypers, optimizer.param_groups)):
        kinds: dict[tuple, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.is_floating_point() or p.is_complex():
                key = (_probe_shape(p), p.dtype, p.device)
                kinds.setdefault(key, []).append(p)
        probes = {key: nn.Parameter(torch.zeros(key[0], dtype=key[1], device=key[2])) for key in kinds}
        kwargs = {k: v for k, v in hyper.items() if k in ctor}
        probe_group = {k: v for k, v in hyper.items() if k not in ctor}
        probe_group["params"] = list(probes.values())
        try:
            probe = cls([probe_group], **kwargs)
            for q in probes.values():
                q.grad = torch.zeros_like(q).to_sparse() if cls is torch.optim.SparseAdam else torch.zeros_like(q)
            probe.step()
        except Exception as err:
            raise ValueError(f"{state_file}: optimizer.param_groups[{i}] does not work with {cls.__name__}: "
                             f"{type(err).__name__}: {err}") from err
        for key, params in kinds.items():
            layout = dict(probe.state.get(probes[key], {}))
            for p in params:
                layouts[id(p)] = (layout, key[0])
    return layouts


class _OptimizerPlan:
    def __init__(self, groups: list[dict], state: dict[torch.Tensor, dict[str, Any]], names: dict[int, str]):
        self.groups, self.state, self.names = groups, state, names


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, record: dict, path: Path,
                     device: str) -> _OptimizerPlan:
    state_file, o_file = path / STATE_NAME, path / _OPTIMIZER_NAME
    if "optimizer" not in record:
        raise ValueError(f"{state_file}: field 'optimizer' is missing: {path} holds no optimizer state, but an "
                         "optimizer was given")
    if not o_file.is_file():
        raise FileNotFoundError(f"training state file {o_file} is missing, but {state_file} has an optimizer state")
    opt = record["optimizer"]
    if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list) \
            or not isinstance(opt.get("scalars"), dict):
        raise ValueError(f"{state_file}: field 'optimizer' is malformed")
    by_name = dict(model.named_parameters())
    name_of = {id(p): n for n, p in by_name.items()}
    held: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer holds a parameter that is not one of model.named_parameters()")
            held[id(p)] = p

    # param groups: the optimizer's count, parameters and keys; values like the optimizer's
    saved_groups = opt["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{state_file}: optimizer.param_groups holds {len(saved_groups)} groups, the optimizer "
                         f"has {len(optimizer.param_groups)}")
    hypers = []
    for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        where = f"optimizer.param_groups[{i}]"
        if not isinstance(saved, dict):
            raise ValueError(f"{state_file}: {where} must be a mapping, got {_show(saved)}")
        names = saved.get("params")
        want = [name_of[id(p)] for p in group["params"]]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or sorted(names) != sorted(want) \
                or len(set(names)) != len(names):
            raise ValueError(f"{state_file}: {where}.params must name the group's {len(want)} parameters "
                             f"{_show(want)}, got {_show(names)}")
        keys, live = set(saved) - {"params"}, set(group) - {"params"}
        # a missing flag (a key a newer torch added) takes the optimizer's value: a saved one must equal it
        # anyway; initial_lr is set by a scheduler built on the optimizer: optional where it has none yet
        missing = sorted(k for k in live - keys if not _is_flag(group[k]))
        unexpected = sorted(keys - live - {"initial_lr"})
        if missing or unexpected:
            raise ValueError(f"{state_file}: {where} does not fit the optimizer's: missing {missing}, "
                             f"unexpected {unexpected}")
        hyper = {k: group[k] for k in live - keys}
        hyper.update({k: _like(saved[k], group.get(k, 0.0), f"{where}.{k}", state_file, exact_ints=False)
                      for k in keys})
        hypers.append(dict(sorted(hyper.items())))

    # state entries: each names a parameter the optimizer holds
    tensors = _read_tensors(o_file, device)
    entries: dict[int, dict[str, tuple[Any, Path]]] = {}
    for source, items in ((o_file, tensors.items()), (state_file, opt["scalars"].items())):
        for key, value in items:
            name, sep, field = key.rpartition("::")
            p = by_name.get(name) if sep and field else None
            if p is None or id(p) not in held:
                what = "optimizer state entry" if source == o_file else "optimizer.scalars entry"
                raise ValueError(f"{source}: {what} {key!r} names no parameter the optimizer holds")
            fields = entries.setdefault(id(p), {})
            if field in fields:
                raise ValueError(f"{source}: optimizer state entry {key!r} is both a tensor in {o_file.name} and "
                                 f"a scalar in {state_file.name}")
            fields[field] = (value, source)

    is_torch = type(optimizer).__module__.startswith("torch.optim")
    layouts = _probe_layouts(optimizer, hypers, state_file) if is_torch else {}
    state: dict[torch.Tensor, dict[str, Any]] = {}
    for pid, fields in entries.items():
        p, name = held[pid], name_of[pid]
        if is_torch:
            state[p] = _check_param_state(name, p, fields, layouts.get(pid), type(optimizer).__name__, o_file,
                                          state_file)
        else:
            state[p] = _check_param_state_loosely(name, p, fields, optimizer.state.get(p), o_file, state_file)
    return _OptimizerPlan(hypers, state, {pid: name_of[pid] for pid in held})


def _check_state_tensor(t: torch.Tensor, name: str, field: str, shape: tuple, dtype: torch.dtype, p: torch.Tensor,
                        o_file: Path, nonnegative: bool) -> None:
    if tuple(t.shape) != shape:
        keeps = "the parameter has" if shape == tuple(p.shape) else f"the optimizer keeps {shape} for a parameter of"
        raise ValueError(f"{o_file}: state of {name!r} {field} has shape {tuple(t.shape)}, {keeps} {tuple(p.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{o_file}: state of {name!r} {field} has dtype {t.dtype}, the optimizer keeps {dtype}")
    if t.is_floating_point() or t.is_complex():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{o_file}: state of {name!r} {field} holds NaN or inf")
        real = torch.view_as_real(t) if t.is_complex() else t
        if nonnegative and t.numel() and bool((real < 0).any()):
            raise ValueError(f"{o_file}: state of {name!r} {field} holds negative values (it must be >= 0)")


def _check_param_state(name: str, p: torch.Tensor, fields: dict[str, tuple[Any, Path]], layout: tuple | None,
                       cls: str, o_file: Path, state_file: Path) -> dict[str, Any]:
    """One parameter's saved state against the layout the optimizer keeps (from the probe)."""
    ref, probe_shape = layout if layout is not None else ({}, ())
    missing, unexpected = sorted(set(ref) - set(fields)), sorted(set(fields) - set(ref))
    if missing or unexpected:
        files = {fields[f][1].name for f in unexpected} | {
            (o_file if isinstance(ref[f], torch.Tensor) and ref[f].dim() > 0 else state_file).name for f in missing}
        raise ValueError(f"{' and '.join(str(o_file.parent / f) for f in sorted(files))}: the optimizer state of "
                         f"{name!r} has fields {sorted(fields)}, {cls} keeps {sorted(ref)} (missing {missing}, "
                         f"unexpected {unexpected})")
    out = {}
    for field, (value, source) in fields.items():
        r = ref[field]
        if isinstance(r, torch.Tensor) and r.dim() > 0:
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{source}: optimizer.scalars entry '{name}::{field}' must be a tensor in "
                                 f"{o_file.name}")
            shape = _expected_shape(tuple(r.shape), probe_shape, tuple(p.shape))
            dtype = p.dtype if r.dtype == p.dtype else r.dtype
            _check_state_tensor(value, name, field, shape, dtype, p, o_file, field in _NONNEGATIVE_STATE)
            out[field] = value
        else:
            if isinstance(value, torch.Tensor):
                raise ValueError(f"{source}: optimizer state entry '{name}::{field}' must be a scalar in "
                                 f"{state_file.name}, not a tensor")
            out[field] = _like(value, r, f"optimizer.scalars entry '{name}::{field}'", state_file)
    return out


def _check_param_state_loosely(name: str, p: torch.Tensor, fields: dict[str, tuple[Any, Path]], live: dict | None,
                               o_file: Path, state_file: Path) -> dict[str, Any]:
    """An optimizer outside ``torch.optim``: its live state if it has stepped, else the parameter's shape."""
    out = {}
    for field, (value, source) in fields.items():
        ref = (live or {}).get(field)
        if isinstance(value, torch.Tensor):
            if isinstance(ref, torch.Tensor) and ref.dim() > 0:
                shape, dtype = tuple(ref.shape), ref.dtype
            else:
                floating = value.is_floating_point() or value.is_complex()
                shape, dtype = tuple(p.shape), (p.dtype if floating else value.dtype)
            _check_state_tensor(value, name, field, shape, dtype, p, o_file, False)
            out[field] = value
        elif ref is not None:
            out[field] = _like(value, ref, f"optimizer.scalars entry '{name}::{field}'", source)
        else:
            value = _unjson_float(value)
            if field == "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"{source}: optimizer.scalars entry '{name}::step' must be a finite number >= 0")
                value = torch.tensor(float(value))
            out[field] = value
    return out


def _check_mt_words(words: Any, n: int, where: str, file: Path) -> None:
    if not isinstance(words, list) or len(words) != n:
        raise ValueError(f"{file}: {where} must be a list of {n} integers, got {_show(words)}")
    if not all(type(w) is int and 0 <= w < 2**32 for w in words):
        raise ValueError(f"{file}: {where} must hold integers in [0, 2**32)")
    if not any(words):
        raise ValueError(f"{file}: {where} is all zeros (a generator that only yields zeros)")


def _check_rng(rng: dict[str, torch.Tensor], record: dict, r_file: Path, state_file: Path) -> list[Callable[[], None]]:
    """Every random generator's saved state, checked; returns the functions that restore them."""
    apply: list[Callable[[], None]] = []
    for key, t in rng.items():
        if key != "cpu" and not re.fullmatch(r"cuda\.(0|[1-9][0-9]{0,3})", key):
            raise ValueError(f"{r_file}: unexpected entry {key!r} (expected 'cpu' and 'cuda.<i>')")
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise ValueError(f"{r_file}: {key!r} must be a 1-d uint8 generator state, got {t.dtype} of shape "
                             f"{tuple(t.shape)}")
    if "cpu" not in rng:
        raise ValueError(f"{r_file} holds no CPU generator state")
    cpu, size = rng["cpu"], torch.get_rng_state().numel()
    if cpu.numel() != size:
        raise ValueError(f"{r_file}: 'cpu' holds {cpu.numel()} bytes, torch's CPU generator state has {size}")
    try:
        torch.Generator().set_state(cpu)
    except Exception as err:
        raise ValueError(f"{r_file}: 'cpu' is not a valid CPU generator state: {err}") from err
    apply.append(lambda: torch.set_rng_state(cpu))
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        states = [rng[f"cuda.{i}"] for i in range(count) if f"cuda.{i}" in rng]
        if len(states) == count:
            for i, s in enumerate(states):
                try:
                    torch.Generator(device=f"cuda:{i}").set_state(s)
                except Exception as err:
                    raise ValueError(f"{r_file}: 'cuda.{i}' is not a valid CUDA generator state: {err}") from err
            apply.append(lambda: torch.cuda.set_rng_state_all(states))

    if "python_random" not in record:
        raise ValueError(f"{state_file}: field 'python_random' is missing (pass restore_rng=False to skip the RNG)")
    py = record["python_random"]
    where = "field 'python_random'"
    if not isinstance(py, list) or len(py) != 3 or type(py[0]) is not int or py[0] != 3:
        raise ValueError(f"{state_file}: {where} must be [3, [625 integers], null or a number], got {_show(py)}")
    if not isinstance(py[1], list) or len(py[1]) != _MT_N + 1:
        raise ValueError(f"{state_file}: {where}[1] must be a list of {_MT_N + 1} integers, got {_show(py[1])}")
    _check_mt_words(py[1][:_MT_N], _MT_N, f"{where}[1] (the first {_MT_N})", state_file)
    if type(py[1][_MT_N]) is not int or not 0 <= py[1][_MT_N] <= _MT_N:
        raise ValueError(f"{state_file}: {where}[1][{_MT_N}] (the position) must be an integer in [0, {_MT_N}], "
                         f"got {_show(py[1][_MT_N])}")
    if py[2] is not None and (isinstance(py[2], bool) or not isinstance(py[2], (int, float))):
        raise ValueError(f"{state_file}: {where}[2] must be null or a number, got {_show(py[2])}")
    py_state = (3, tuple(py[1]), None if py[2] is None else float(py[2]))
    try:
        random.Random().setstate(py_state)
    except Exception as err:
        raise ValueError(f"{state_file}: {where} is not a valid state: {err}") from err
    apply.append(lambda: random.setstate(py_state))

    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return apply
    if "numpy_random" not in record:
        raise ValueError(f"{state_file}: field 'numpy_random' is missing (pass restore_rng=False to skip the RNG)")
    npr = record["numpy_random"]
    where = "field 'numpy_random'"
    if not isinstance(npr, list) or len(npr) != 5 or npr[0] != "MT19937":
        raise ValueError(f"{state_file}: {where} must be ['MT19937', [{_MT_N} integers], position, has_gauss, gauss], "
                         f"got {_show(npr)}")
    _check_mt_words(npr[1], _MT_N, f"{where}[1]", state_file)
    pos, has_gauss, gauss = npr[2:]
    if type(pos) is not int or not 0 <= pos <= _MT_N:
        raise ValueError(f"{state_file}: {where}[2] (the position) must be an integer in [0, {_MT_N}], "
                         f"got {_show(pos)}")
    if type(has_gauss) is not int or has_gauss not in (0, 1):
        raise ValueError(f"{state_file}: {where}[3] (has_gauss) must be 0 or 1, got {_show(has_gauss)}")
    if isinstance(gauss, bool) or not isinstance(gauss, (int, float)):
        raise ValueError(f"{state_file}: {where}[4] (the cached gaussian) must be a number, got {_show(gauss)}")
    np_state = ("MT19937", np.array(npr[1], dtype=np.uint32), pos, has_gauss, float(gauss))
    try:
        np.random.RandomState().set_state(np_state)
    except Exception as err:
        raise ValueError(f"{state_file}: {where} is not a valid state: {err}") from err
    apply.append(lambda: np.random.set_state(np_state))
    return apply


def _has_dtensor(model: nn.Module) -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, plan: _OptimizerPlan) -> None:
    """Load a checked state: exactly the saved one (a parameter without saved state has none)."""
    tensors = any(isinstance(v, torch.Tensor) and v.dim() > 0 for s in plan.state.values() for v in s.values())
    if not (tensors and _has_dtensor(model)):
        # plain (or DDP's replicated) parameters: the optimizer's own loader, by position
        index, groups = {}, []
        for hyper, group in zip(plan.groups, optimizer.param_groups):
            ids = []
            for p in group["params"]:
                index[id(p)] = len(index)
                ids.append(index[id(p)])
            groups.append({**hyper, "params": ids})
        optimizer.load_state_dict({"state": {index[id(p)]: dict(s) for p, s in plan.state.items()},
                                   "param_groups": groups})
        return
    # sharded (FSDP2) parameters: the full state is distributed by torch.distributed.checkpoint. It first
    # initialises an empty optimizer state with one zero-gradient step, which it skips (and then fails)
    # when any gradient is set: the gradients are set aside meanwhile, and given back.
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    groups = [{**hyper, "params": [plan.names[id(p)] for p in group["params"]]}
              for hyper, group in zip(plan.groups, optimizer.param_groups)]
    state = {plan.names[id(p)]: dict(s) for p, s in plan.state.items()}
    try:
        for p in params:
            p.grad = None
        # strict=False: a parameter that never had a gradient (a learned null condition in a run that
        # dropped nothing) has no state yet, in the saved run as in this one
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                                 options=_full_options(strict=False))
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    for p in params:
        if p not in plan.state:
            optimizer.state.pop(p, None)  # as saved: no state (the initialising step made some)
    for group, hyper in zip(optimizer.param_groups, plan.groups):
        group.update(hyper)  # the checked values in the optimizer's types (the flattening made tuples lists)


def load_training_state(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    map_location: str | torch.device = "cpu",
    restore_rng: bool = True,
) -> dict:
    """Load what ``save_training_state`` wrote into freshly built objects; clear errors for anything else.

    Everything is checked before anything is changed (see the module docstring): when any check fails
    the model, optimizer, scheduler and random generators are as they were.

    Args:
        directory: the folder.
        model: a model built like the saved one (plain, DDP's inner module, or sharded with FSDP2:
            the full saved state is loaded into whatever layout it has now).
        optimizer, scheduler: built like the saved ones (over ``model``'s parameters), or ``None``.
            Gradients already set on the parameters are left as they are.
        map_location: where the tensors are read to.
        restore_rng: also restore torch's (and CUDA's), Python's and NumPy's random generators (each
            rank gets rank 0's state; reseed per rank afterwards if the ranks must differ).

    Returns:
        ``{"step": int, "extra": dict}``.

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file is not a training state, is truncated or
        corrupted, or does not match the objects (names the file and what differs).
    """
    path = Path(directory)
    state_file, w_file, r_file = path / STATE_NAME, path / WEIGHTS_NAME, path / _RNG_NAME
    for f in (state_file, w_file, r_file):
        if not f.is_file():
            raise FileNotFoundError(f"training state file {f} is missing (is {path} a save_training_state folder?)")
    try:
        device = str(torch.device(map_location))
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"map_location {map_location!r} is not a device: {err}") from err

    # 1. the record
    record = _read_record(state_file)
    step, extra, digests = _check_record_fields(record, state_file)
    # 2.-5. every part that will be loaded
    checked = _check_parts(model, optimizer, scheduler, record, path, device, restore_rng)
    # 6. integrity: the record, then each file read
    _check_integrity(digests, record, state_file, checked.reads)
    # every check passed: load
    _load_checked(path, model, optimizer, scheduler, checked)
    return {"step": step, "extra": _unjson_float(extra)}


@dataclass(frozen=True)
class _CheckedParts:
    """Everything ``load_training_state`` will load, checked: nothing of it is loaded yet."""

    weights: dict[str, torch.Tensor]
    plan: _OptimizerPlan | None
    sched_state: Any | None
    restore: list[Callable[[], None]]
    reads: list[Path]  # the safetensors files read (their SHA-256 is checked)


def _check_record_fields(record: dict, state_file: Path) -> tuple[int, dict, dict[str, str] | None]:
    """The record's ``step``, ``extra`` and ``sha256`` record, checked."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _INT64:
        raise ValueError(f"{state_file}: field 'step' must be an integer >= 0, got {_show(step)}")
    extra = record.get("extra")
    if not isinstance(extra, dict):
        raise ValueError(f"{state_file}: field 'extra' must be a mapping, got {_show(extra)}")
    needed = (STATE_NAME, WEIGHTS_NAME, _RNG_NAME) + ((_OPTIMIZER_NAME,) if "optimizer" in record else ())
    return step, extra, _check_digests(record, state_file, needed)


def _check_parts(model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None, record: dict,
                 path: Path, device: str, restore_rng: bool) -> _CheckedParts:
    """The weights, the optimizer, the scheduler and (with ``restore_rng``) the random generators, checked."""
    state_file, w_file, o_file, r_file = (path / STATE_NAME, path / WEIGHTS_NAME, path / _OPTIMIZER_NAME,
                                          path / _RNG_NAME)
    weights = _read_tensors(w_file, device)
    _check_weights(model, weights, w_file)
    reads = [w_file]
    plan = None
    if optimizer is not None:
        plan = _check_optimizer(model, optimizer, record, path, device)
        reads.append(o_file)
    sched_state = None
    if scheduler is not None:
        if "scheduler" not in record:
            raise ValueError(f"{state_file}: field 'scheduler' is missing: {path} holds no scheduler state, but a "
                             "scheduler was given")
        sched_state = _like(record["scheduler"], scheduler.state_dict(), "scheduler", state_file)
    restore: list[Callable[[], None]] = []
    if restore_rng:
        restore = _check_rng(_read_tensors(r_file, "cpu"), record, r_file, state_file)
        reads.append(r_file)
    return _CheckedParts(weights, plan, sched_state, restore, reads)


def _check_integrity(digests: dict[str, str] | None, record: dict, state_file: Path, reads: list[Path]) -> None:
    """The SHA-256 of the record, then of each file read (nothing to check in a folder without them)."""
    if digests is None:
        return
    if digests[STATE_NAME] != _record_digest(record):
        raise ValueError(f"{state_file} does not match the sha256 it records for itself: the file was corrupted "
                         "or edited")
    for f in reads:
        if _sha256(f) != digests[f.name]:
            raise ValueError(f"{f} does not match the sha256 recorded for it in {state_file}: the file was "
                             "corrupted or replaced")


def _load_checked(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None,
                  checked: _CheckedParts) -> None:
    """Load the checked parts into the objects (every check has passed)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    try:
        if checked.plan is not None:
            _load_optimizer(model, optimizer, checked.plan)
        if checked.sched_state is not None:
            scheduler.load_state_dict(checked.sched_state)
        set_model_state_dict(model, checked.weights, options=_full_options())
        for fn in checked.restore:
            fn()
    except Exception as err:  # pragma: no cover - every check passed; this would be a bug
        raise ValueError(f"{path}: loading failed after every check passed ({type(err).__name__}: {err}); "
                         "the objects may be partly loaded") from err
