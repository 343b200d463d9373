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
                                      "python_random", "numpy_random"}
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .pretrained import WEIGHTS_NAME, Configurable, _unshared, save_pretrained

__all__ = ["save_training_state", "load_training_state", "STATE_NAME"]

STATE_NAME = "training_state.json"
_FORMAT = "safeformer-training"
_VERSION = 1
_MAX_JSON = 64 * 2**20


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
        directory: the folder to (re)write; replaced atomically.
        model: the model (plain, or the module inside DDP, or sharded with FSDP2's ``fully_shard``).
        optimizer: any ``torch.optim`` optimizer over ``model``'s parameters.
        scheduler: anything with ``state_dict()`` / ``load_state_dict()`` whose state is JSON
            (every ``torch.optim.lr_scheduler`` scheduler: learning-rate lambdas are code, not state).
        step: the number of optimizer steps done.
        extra: any JSON-able record of the caller's (history, config, ...).
        pretrained: ``{folder name: submodule of model}``: also written as ``from_pretrained`` folders
            (safeformer models), e.g. the decoder of a larger job.

    Returns:
        the folder's path. Under ``torch.distributed`` every rank must call it; rank 0 writes.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    opts = _full_options(cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)  # full, on rank 0 (a collective when sharded)
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    path = Path(directory)
    if _dist_rank() != 0:
        _barrier()
        return path
    st = _st()
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if isinstance(model, Configurable):
        save_pretrained(model, tmp, state_dict=weights)
    else:
        st.save_file(_unshared(weights), str(tmp / WEIGHTS_NAME))
    names = {id(m): n for n, m in model.named_modules()}
    for folder, sub in (pretrained or {}).items():
        prefix = names.get(id(sub))
        if prefix is None or not isinstance(sub, Configurable) or not folder or "/" in folder or folder.startswith("."):
            raise ValueError(f"pretrained[{folder!r}] must be a safeformer submodule of model, in a plain folder name")
        sub_sd = {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")}
        save_pretrained(sub, tmp / folder, state_dict=sub_sd)
    record: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "step": step,
                              "extra": _jsonable(extra or {}, "extra")}
    if optim is not None:
        tensors, scalars = {}, {}
        for name, entry in optim["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors[f"{name}::{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars[f"{name}::{key}"] = _jsonable(value, f"optimizer state {name}::{key}")
        st.save_file(tensors, str(tmp / "optimizer.safetensors"))
        record["optimizer"] = {"param_groups": _jsonable(optim["param_groups"], "optimizer param_groups"),
                               "scalars": scalars}
    if scheduler is not None:
        record["scheduler"] = _jsonable(scheduler.state_dict(), "scheduler state")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda.{i}"] = s
    st.save_file(rng, str(tmp / "rng.safetensors"))
    record["python_random"] = _jsonable(random.getstate(), "python random state")
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        record["numpy_random"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    (tmp / STATE_NAME).write_text(json.dumps(record))
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


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

    Args:
        directory: the folder.
        model: a model built like the saved one (plain, DDP's inner module, or sharded with FSDP2:
            the full saved state is loaded into whatever layout it has now).
        optimizer, scheduler: built like the saved ones (over ``model``'s parameters), or ``None``.
        map_location: where the tensors are read to.
        restore_rng: also restore torch's (and CUDA's), Python's and NumPy's random generators (each
            rank gets rank 0's state; reseed per rank afterwards if the ranks must differ).

    Returns:
        ``{"step": int, "extra": dict}``.

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file is not a training state, or does not
        match the objects (names the file and what differs).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    st = _st()
    path = Path(directory)
    state_file = path / STATE_NAME
    for f in (state_file, path / WEIGHTS_NAME, path / "rng.safetensors"):
        if not f.is_file():
            raise FileNotFoundError(f"training state file {f} is missing (is {path} a save_training_state folder?)")
    if state_file.stat().st_size > _MAX_JSON:
        raise ValueError(f"{state_file} is larger than {_MAX_JSON} bytes: not a training state")
    try:
        record = json.loads(state_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{state_file} is not valid JSON: {err}") from err
    if not isinstance(record, dict) or record.get("format") != _FORMAT or record.get("version") != _VERSION:
        raise ValueError(f"{state_file} is not a safeformer training state (format/version)")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{state_file}: field 'step' must be an integer >= 0, got {step!r}")
    try:
        weights = st.load_file(str(path / WEIGHTS_NAME), device=str(map_location))
    except Exception as err:
        raise ValueError(f"could not read {path / WEIGHTS_NAME}: {err}") from err
    expected = set(model.state_dict())
    if set(weights) != expected:
        raise ValueError(f"weights in {path / WEIGHTS_NAME} do not fit the model: missing "
                         f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]}")
    try:
        set_model_state_dict(model, weights, options=_full_options())
    except Exception as err:
        raise ValueError(f"weights in {path / WEIGHTS_NAME} do not fit the model: {err}") from err
    if optimizer is not None:
        if "optimizer" not in record or not (path / "optimizer.safetensors").is_file():
            raise ValueError(f"{path} holds no optimizer state, but an optimizer was given")
        opt = record["optimizer"]
        if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list) or not isinstance(opt.get("scalars"), dict):
            raise ValueError(f"{state_file}: field 'optimizer' is malformed")
        names = {n for n, _ in model.named_parameters()}
        state: dict[str, dict] = {}
        entries = list(st.load_file(str(path / "optimizer.safetensors"), device=str(map_location)).items())
        for key, value in entries + list(opt["scalars"].items()):
            name, sep, field = key.rpartition("::")
            if not sep or name not in names or not field:
                raise ValueError(f"{path}: optimizer state entry {key!r} names no parameter of the model")
            if not isinstance(value, torch.Tensor):
                value = _unjson_float(value)
                if field == "step" and isinstance(value, (int, float)):
                    value = torch.tensor(float(value))
            state.setdefault(name, {})[field] = value
        try:
            # strict=False: a parameter that never had a gradient (a learned null condition in a run that
            # dropped nothing) has no state yet, in the saved run as in this one
            set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": _unjson_float(opt["param_groups"])},
                                     options=_full_options(strict=False))
        except Exception as err:
            raise ValueError(f"{path}: the optimizer state does not fit this optimizer: {err}") from err
    if scheduler is not None:
        if "scheduler" not in record:
            raise ValueError(f"{path} holds no scheduler state, but a scheduler was given")
        scheduler.load_state_dict(_unjson_float(record["scheduler"]))
    if restore_rng:
        rng = st.load_file(str(path / "rng.safetensors"))
        if "cpu" not in rng or rng["cpu"].dtype != torch.uint8:
            raise ValueError(f"{path / 'rng.safetensors'} holds no CPU generator state")
        torch.set_rng_state(rng["cpu"])
        if torch.cuda.is_available():
            states = [rng[f"cuda.{i}"] for i in range(torch.cuda.device_count()) if f"cuda.{i}" in rng]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
        if "python_random" in record:
            py = record["python_random"]
            random.setstate((py[0], tuple(py[1]), py[2]))
        if "numpy_random" in record:
            import numpy as np

            kind, keys, pos, has_gauss, gauss = record["numpy_random"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    extra = record.get("extra", {})
    return {"step": step, "extra": _unjson_float(extra) if isinstance(extra, dict) else {}}
