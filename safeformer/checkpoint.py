"""Checkpoints: ``save_pretrained`` / ``from_pretrained`` with safetensors weights and a JSON config.

No pickle is ever written or loaded. A model records the arguments it was built with (its config);
``from_pretrained`` rebuilds it from that config alone and loads the weights strictly.

Layout of a checkpoint folder:
    config.json        {"format": "safeformer", "version": 1, "class": <name>, "dtype": "float32", "config": {...}}
    model.safetensors  the state dict (shared/tied tensors stored once)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["Configurable", "save_pretrained", "load_pretrained", "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_FORMAT_VERSION = 1
_REGISTRY: dict[str, type] = {}


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("checkpoints need the 'safetensors' package: pip install safetensors") from err
    return st


class Configurable:
    """Mixin for modules that can be saved and rebuilt from their constructor arguments.

    A subclass calls ``self._set_config(**arguments)`` in ``__init__`` with every argument that
    defines it; nested configurable modules (``attn_layers=Decoder(...)``) are stored by class name.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    def _set_config(self, **config: Any) -> None:
        self._sf_config = config

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, JSON-ready (nested modules as ``{"class": ..., "config": ...}``)."""
        return {k: _encode(v) for k, v in self._sf_config.items()}

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        """Build a fresh (randomly initialised) module from ``get_config()``'s output."""
        return cls(**{k: _decode(v) for k, v in config.items()})

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed)."""
        return save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, map_location: str | torch.device = "cpu"):
        """Rebuild the model saved in ``directory`` and load its weights (strictly, without pickle)."""
        return load_pretrained(directory, expected_class=cls, map_location=map_location)


def _encode(v: Any) -> Any:
    if isinstance(v, Configurable):
        return {"class": type(v).__name__, "config": v.get_config()}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"class", "config"}:
        cls = _REGISTRY.get(v["class"])
        if cls is None:
            raise ValueError(f"checkpoint config names an unknown class {v['class']!r}")
        return cls.from_config(v["config"])
    if isinstance(v, dict) and set(v) == {"dtype"}:
        return getattr(torch, v["dtype"])
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> Path:
    if not isinstance(model, Configurable):
        raise TypeError(f"{type(model).__name__} is not a safeformer model with a config")
    st = _safetensors()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config = {"format": "safeformer", "version": _FORMAT_VERSION, "class": type(model).__name__,
              "dtype": str(dtype).removeprefix("torch."), "config": model.get_config()}
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    st.save_model(model, str(path / WEIGHTS_NAME))
    return path


def load_pretrained(directory: str | os.PathLike, *, expected_class: type | None = None, map_location="cpu"):
    """Rebuild a model from a ``save_pretrained`` folder; clear errors for missing or broken files."""
    st = _safetensors()
    path = Path(directory)
    cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file {f} is missing (expected {CONFIG_NAME} and {WEIGHTS_NAME} in {path})")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_file} is not valid JSON (truncated or corrupted?): {err}") from err
    if not isinstance(config, dict) or config.get("format") != "safeformer" or "class" not in config:
        raise ValueError(f"{cfg_file} is not a safeformer checkpoint config")
    if config.get("version") != _FORMAT_VERSION:
        raise ValueError(f"{cfg_file} has checkpoint format version {config.get('version')}, expected {_FORMAT_VERSION}")
    cls = _REGISTRY.get(config["class"])
    if cls is None:
        raise ValueError(f"{cfg_file} names an unknown class {config['class']!r}")
    if expected_class is not None and not issubclass(cls, expected_class):
        raise ValueError(f"{path} holds a {config['class']}, not a {expected_class.__name__}")
    model = cls.from_config(config["config"])
    dtype = getattr(torch, str(config.get("dtype", "float32")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{cfg_file} names an unknown dtype {config.get('dtype')!r}")
    model.to(dtype)
    try:
        missing, unexpected = st.load_model(model, str(w_file), strict=False, device=str(map_location))
    except RuntimeError as err:
        if "size mismatch" in str(err):
            raise ValueError(f"weights in {w_file} do not match the {config['class']} built from {cfg_file}: {err}") from err
        raise ValueError(f"could not read weights from {w_file} (truncated or corrupted?): {err}") from err
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"could not read weights from {w_file} (truncated or corrupted?): {err}") from err
    if missing or unexpected:
        raise ValueError(
            f"weights in {w_file} do not match the {config['class']} built from {cfg_file}: "
            f"missing {sorted(missing)[:10]}, unexpected {sorted(unexpected)[:10]}"
        )
    return model
