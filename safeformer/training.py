"""Training state on disk: model, optimizer, scheduler, RNG and step, as safetensors and JSON (no pickle).

``save_training_state(directory, model, optimizer, scheduler, step=...)`` writes a folder that
``load_training_state`` reads back into freshly built objects, so that an interrupted run continues
bit for bit (on the CPU) as if it had never stopped.

Layout of a training-state folder (written to a temporary folder, then swapped in: a crash while saving
never leaves a half-written state behind):

    config.json, model.safetensors   the model (``save_pretrained``) when it is a safeformer model;
                                     otherwise model.safetensors alone
    optimizer.safetensors            every tensor of ``optimizer.state_dict()["state"]``, as "<param>.<key>"
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

from .checkpoint import WEIGHTS_NAME, Configurable

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


def save_training_state(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    step: int,
    extra: dict | None = None,
) -> Path:
    """Write everything a run needs to continue exactly: model, optimizer, scheduler, RNG, step.

    Args:
        directory: the folder to (re)write; replaced atomically.
        model: the model (its weights; its config too when it is a safeformer model).
        optimizer: any ``torch.optim`` optimizer (its state tensors go to safetensors).
        scheduler: anything with ``state_dict()`` / ``load_state_dict()`` whose state is JSON
            (every ``torch.optim.lr_scheduler`` scheduler: learning-rate lambdas are code, not state).
        step: the number of optimizer steps done.
        extra: any JSON-able record of the caller's (history, config, ...).

    Returns:
        the folder's path.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    st = _st()
    path = Path(directory)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if isinstance(model, Configurable):
        model.save_pretrained(tmp)
    else:
        st.save_model(model, str(tmp / WEIGHTS_NAME))
    record: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "step": step,
                              "extra": _jsonable(extra or {}, "extra")}
    if optimizer is not None:
        state = optimizer.state_dict()
        tensors, scalars = {}, {}
        for idx, entry in state["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars[f"{idx}.{key}"] = _jsonable(value, f"optimizer state {idx}.{key}")
        st.save_file(tensors, str(tmp / "optimizer.safetensors"))
        record["optimizer"] = {"param_groups": _jsonable(state["param_groups"], "optimizer param_groups"),
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
        model: a model built like the saved one (its weights are replaced, strictly).
        optimizer, scheduler: built like the saved ones (over ``model``'s parameters), or ``None``.
        map_location: where the optimizer's tensors go.
        restore_rng: also restore torch's (and CUDA's), Python's and NumPy's random generators.

    Returns:
        ``{"step": int, "extra": dict}``.

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file is not a training state, or does not
        match the objects (names the file and what differs).
    """
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
        missing, unexpected = st.load_model(model, str(path / WEIGHTS_NAME), strict=False, device=str(map_location))
    except Exception as err:
        raise ValueError(f"weights in {path / WEIGHTS_NAME} do not fit the model: {err}") from err
    if missing or unexpected:
        raise ValueError(f"weights in {path / WEIGHTS_NAME} do not fit the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    if optimizer is not None:
        if "optimizer" not in record or not (path / "optimizer.safetensors").is_file():
            raise ValueError(f"{path} holds no optimizer state, but an optimizer was given")
        opt = record["optimizer"]
        if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list) or not isinstance(opt.get("scalars"), dict):
            raise ValueError(f"{state_file}: field 'optimizer' is malformed")
        state: dict[int, dict] = {}
        n_params = sum(len(g["params"]) for g in optimizer.param_groups)
        for key, value in list(st.load_file(str(path / "optimizer.safetensors"), device=str(map_location)).items()) + \
                list(opt["scalars"].items()):
            idx, _, name = key.partition(".")
            if not idx.isdigit() or int(idx) >= n_params or not name:
                raise ValueError(f"{path}: optimizer state entry {key!r} does not fit an optimizer of {n_params} parameters")
            state.setdefault(int(idx), {})[name] = _unjson_float(value) if not isinstance(value, torch.Tensor) else value
        try:
            optimizer.load_state_dict({"state": state, "param_groups": _unjson_float(opt["param_groups"])})
        except (ValueError, KeyError, TypeError) as err:
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
