"""Checkpoints: ``save_pretrained`` / ``from_pretrained`` with safetensors weights and a JSON config.

No pickle is ever written or loaded. A model records the arguments it was built with (its config);
``from_pretrained`` rebuilds it from that config alone and loads the weights strictly.

Layout of a checkpoint folder:
    config.json        {"format": "safeformer", "version": 1, "class": <name>, "dtype": "float32", "config": {...}}
    model.safetensors  the state dict (shared/tied tensors stored once)

The folder is written whole into a temporary sibling and renamed into place (``atomic_folder``, which
``save_training_state`` uses too): a failed or interrupted save leaves the old checkpoint as it was, or
no folder at all, never config.json without its weights.

A checkpoint is hostile input: ``load_pretrained`` checks it in this order and builds nothing real
until every check has passed.

1. ``config.json``: size, JSON (no NaN/Infinity), the top-level fields, the class, the dtype.
2. The config tree against the constructors' signatures and type annotations: every field is a
   parameter of its class, ints are JSON ints (not bools, not ``1e9``), floats are finite, nested
   modules are ``{"class", "config"}`` of a registered subclass of the annotated class.
3. The safetensors header, parsed by hand with size limits (names, dtypes, shapes, offsets).
4. Cheap guards on the config against the header: a ``depth`` field may not exceed the number of
   tensors in the file (a layer has at least one) and a ``heads`` field the largest tensor dimension.
5. The model built on the meta device (allocates nothing); its state-dict names, shapes and dtype
   kinds are compared with the header.
6. Only then the real model is built and the weights are loaded strictly.

Every problem is a ``ValueError`` (``FileNotFoundError`` for a missing file) whose message names the
file and the field (a dotted path such as ``config.attn_layers.config.depth``) or the tensor.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import secrets
import shutil
import struct
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Configurable", "save_pretrained", "load_pretrained", "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)  # 1: before the module tree became x-transformers' (migrated on load); 2: before
# a single head of width dim lost its output projection (x-transformers' project_out rule)
_REGISTRY: dict[str, type] = {}

_MAX_CONFIG_BYTES = 16 * 2**20  # a real config is a few kB
_MAX_HEADER_BYTES = 32 * 2**20  # safetensors itself allows 100 MB; ~100 bytes per tensor is typical
_INT_LIMIT = 2**63 - 1  # ints beyond int64 cannot be a size, an index or a seed
_TOP_LEVEL_REQUIRED = ("format", "version", "class", "config")
_TOP_LEVEL_OPTIONAL = ("dtype",)

# safetensors dtype name -> (bytes per element, is floating point)
_ST_DTYPES: dict[str, tuple[int, bool]] = {
    "BOOL": (1, False), "U8": (1, False), "I8": (1, False), "U16": (2, False), "I16": (2, False),
    "U32": (4, False), "I32": (4, False), "U64": (8, False), "I64": (8, False),
    "F8_E4M3": (1, True), "F8_E5M2": (1, True), "F16": (2, True), "BF16": (2, True), "F32": (4, True),
    "F64": (8, True),
}
_ST_INT_TORCH = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
                 "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64"}


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("checkpoints need the 'safetensors' package: pip install safetensors") from err
    return st


class Configurable:
    """Mixin for modules that can be saved and rebuilt from their constructor arguments.

    A subclass calls ``self._set_config_from(Cls.__init__, locals())`` in ``__init__``: every argument of
    its signature is captured once (never listed a second time); ``_set_config(**arguments)`` where the
    stored values differ from the arguments. Nested configurable modules (``attn_layers=Decoder(...)``)
    are stored by class name.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    def _set_config(self, **config: Any) -> None:
        self._sf_config = config

    def _set_config_from(self, init: Callable, local_vars: dict[str, Any]) -> None:
        """The config captured once from ``init``'s own parameters, read from its ``locals()`` (so an
        argument is written in the signature only, never listed a second time)."""
        params = inspect.signature(init).parameters.values()
        self._set_config(**{p.name: local_vars[p.name] for p in params
                            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)})

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, JSON-ready (nested modules as ``{"class": ..., "config": ...}``)."""
        return {k: _encode(v) for k, v in self._sf_config.items()}

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        """Build a fresh (randomly initialised) module from ``get_config()``'s output.

        The config is checked against the constructors' signatures and annotations first (as in
        ``load_pretrained``); any problem, or any error a constructor raises, is a ``ValueError``.
        """
        source = f"{cls.__name__}.from_config"
        try:
            spec = _check_config(cls, config, "config", source)
        except RecursionError as err:
            raise ValueError(f"{source}: config is nested too deeply") from err
        return _build(spec, source)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed)."""
        return save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, map_location: str | torch.device = "cpu"):
        """Rebuild the model saved in ``directory`` and load its weights (strictly, without pickle).

        The checkpoint is validated before anything is built; see ``load_pretrained``.
        """
        return load_pretrained(directory, expected_class=cls, map_location=map_location)


def _encode(v: Any) -> Any:
    if isinstance(v, Configurable):
        return {"class": config_class_name(v), "config": v.get_config()}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    return v


# ----------------------------------------------------------------------------------------------------
# Checking a config tree against the constructors (builds nothing)
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Spec:
    """A checked ``{"class", "config"}``: the class and its constructor arguments (nested ones as specs)."""

    cls: type
    kwargs: dict[str, Any]
    where: str  # dotted path of this module's config, e.g. "config.attn_layers.config"


class _Unchecked:
    """Marker for a parameter whose annotation cannot be checked strictly: plain JSON values only."""


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _fail(source: str, where: str, problem: str) -> ValueError:
    return ValueError(f"{source}: {where} {problem}")


def _constructor_fields(cls: type, source: str, where: str) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """The keyword parameters that build ``cls`` and their resolved annotations.

    A constructor that only forwards ``**kwargs`` (``Encoder``) takes its parent's parameters too;
    a class with no constructor of its own among the ``Configurable`` classes cannot be built. A class's
    ``config_fields()`` (a classmethod) adds keywords it takes beyond its signature, with their annotations
    (``AttentionLayers``: every attention field as ``attn_<field>``).
    """
    params: dict[str, inspect.Parameter] = {}
    hints: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        if klass is Configurable or not issubclass(klass, Configurable):
            break
        init = vars(klass)["__init__"]
        try:
            own_hints = typing.get_type_hints(init)
        except Exception:  # unresolvable annotations: those parameters take plain JSON only
            own_hints = {}
        forwards = False
        for i, (name, p) in enumerate(inspect.signature(init).parameters.items()):
            if i == 0 or p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL):
                continue  # self, and what cannot be passed by name
            if p.kind is p.VAR_KEYWORD:
                # ``**aliases`` takes other spellings of the named parameters (configs store the names):
                # any other ``**kwargs`` forwards to the parent class
                forwards = forwards or name != "aliases"
            elif name not in params:
                params[name] = p
                hints[name] = own_hints.get(name, _Unchecked)
        if not forwards:
            # keywords a class takes beyond its signature (a family's fields under a prefix), typed by their owner
            for name, (p, hint) in getattr(cls, "config_fields", dict)().items():
                params.setdefault(name, p)
                hints.setdefault(name, hint)
            return params, hints
    raise _fail(source, where, f"names class {cls.__name__!r}, which cannot be built from a config")


def _check_config(cls: type, config: Any, where: str, source: str) -> _Spec:
    """Check ``config`` (the arguments of ``cls``) without building anything; return the spec."""
    if not isinstance(config, dict):
        raise _fail(source, where, f"must be a mapping of {cls.__name__}'s arguments, got {_show(config)}")
    params, hints = _constructor_fields(cls, source, where)
    for key in config:
        if not isinstance(key, str) or key not in params:
            raise _fail(source, f"{where}.{key}", f"is not a parameter of {cls.__name__}")
    for name, p in params.items():
        if p.default is p.empty and name not in config:
            raise _fail(source, f"{where}.{name}", f"is missing (a required argument of {cls.__name__})")
    kwargs = {key: _check_value(value, hints[key], f"{where}.{key}", source) for key, value in config.items()}
    return _Spec(cls, kwargs, where)


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _check_value(value: Any, hint: Any, where: str, source: str) -> Any:
    """Check one argument against its annotation; return what to pass (nested modules as specs)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if not isinstance(value, (list, tuple)):  # a scalar: only the scalar options can match (their precise error)
            options = [a for a in options if typing.get_origin(a) not in (list, tuple)] or options
        if len(options) == 1:  # X | None: the precise error of X
            return _check_value(value, options[0], where, source)
        for option in options:
            try:
                return _check_value(value, option, where, source)
            except ValueError:
                continue
        raise _fail(source, where, f"must be {' or '.join(_type_name(a) for a in args)}, got {_show(value)}")
    if origin is typing.Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise _fail(source, where, f"must be one of {list(args)}, got {_show(value)}")
    if origin in (list, tuple) or (isinstance(origin, type) and origin.__module__ == "collections.abc"
                                   and origin.__name__ in ("Sequence", "MutableSequence")):
        return _check_sequence(value, origin, args, where, source)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _fail(source, where, f"must be a mapping with string keys, got {_show(value)}")
        item = args[1] if len(args) == 2 else _Unchecked
        return {k: _check_value(v, item, f"{where}.{k}", source) for k, v in value.items()}
    if hint is bool:
        if type(value) is not bool:
            raise _fail(source, where, f"must be a bool (true/false), got {_show(value)}")
        return value
    if hint is int:
        if type(value) is not int:
            raise _fail(source, where, f"must be an int, got {_show(value)}")
        if abs(value) > _INT_LIMIT:
            raise _fail(source, where, f"is out of the int64 range: {_show(value)}")
        return value
    if hint is float:
        if type(value) not in (int, float):
            raise _fail(source, where, f"must be a number, got {_show(value)}")
        if (type(value) is int and abs(value) > _INT_LIMIT) or not math.isfinite(value):
            raise _fail(source, where, f"must be a finite number, got {_show(value)}")
        return value
    if hint is str:
        if type(value) is not str:
            raise _fail(source, where, f"must be a string, got {_show(value)}")
        return value
    if hint is type(None):
        if value is not None:
            raise _fail(source, where, f"must be null, got {_show(value)}")
        return None
    if hint is torch.dtype:
        return _check_dtype_ref(value, where, source)
    if isinstance(hint, type) and issubclass(hint, (nn.Module, Configurable)):
        return _check_module(value, hint, where, source)
    return _check_plain_json(value, where, source)


def _check_sequence(value: Any, origin: Any, args: tuple, where: str, source: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise _fail(source, where, f"must be a list, got {_show(value)}")
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _fail(source, where, f"must be a list of {len(args)} items, got {len(value)}")
        items = list(args)
    else:
        items = [args[0] if args else _Unchecked] * len(value)
    checked = [_check_value(v, h, f"{where}.{i}", source) for i, (v, h) in enumerate(zip(value, items))]
    return tuple(checked) if origin is tuple else checked


def _check_dtype_ref(value: Any, where: str, source: str) -> torch.dtype:
    if not (isinstance(value, dict) and set(value) == {"dtype"} and type(value["dtype"]) is str):
        raise _fail(source, where, f'must be {{"dtype": <name>}}, got {_show(value)}')
    dtype = getattr(torch, value["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise _fail(source, where, f"names an unknown torch dtype {value['dtype']!r}")
    return dtype


def _check_module(value: Any, base: type, where: str, source: str) -> _Spec:
    if not (isinstance(value, dict) and set(value) == {"class", "config"}):
        raise _fail(source, where, f'must be {{"class": ..., "config": {{...}}}} (a {base.__name__}), got {_show(value)}')
    name = value["class"]
    if type(name) is not str:
        raise _fail(source, f"{where}.class", f"must be a class name, got {_show(name)}")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise _fail(source, f"{where}.class", f"names an unknown class {name!r}")
    if not issubclass(cls, base):
        raise _fail(source, f"{where}.class", f"names {name!r}, which is not a {base.__name__}")
    return _check_config(cls, value["config"], f"{where}.config", source)


def _check_plain_json(value: Any, where: str, source: str) -> Any:
    """Accept JSON data only (null, bool, int, finite float, str, lists, string-keyed mappings)."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise _fail(source, where, f"must be a finite number, got {_show(value)}")
        return value
    if isinstance(value, (list, tuple)):
        return [_check_plain_json(v, f"{where}.{i}", source) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _check_plain_json(v, f"{where}.{k}", source) for k, v in value.items()}
    raise _fail(source, where, f"must be plain JSON data, got {_show(value)}")


def _iter_int_fields(spec: _Spec) -> Iterator[tuple[str, str, int]]:
    """``(field name, dotted path, value)`` of every int argument in the tree, nested modules included."""

    def walk(value: Any, name: str, where: str) -> Iterator[tuple[str, str, int]]:
        if isinstance(value, _Spec):
            for key, v in value.kwargs.items():
                yield from walk(v, key, f"{value.where}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from walk(v, name, f"{where}.{i}")
        elif type(value) is int:
            yield name, where, value

    yield from walk(spec, "", spec.where)


def _build(spec: _Spec, source: str) -> nn.Module:
    """Construct a checked spec; a constructor's error becomes a ``ValueError`` naming the source."""

    def materialize(value: Any) -> Any:
        if isinstance(value, _Spec):
            return _build(value, source)
        if isinstance(value, (list, tuple)):
            return type(value)(materialize(v) for v in value)
        return value

    kwargs = {k: materialize(v) for k, v in spec.kwargs.items()}
    try:
        return spec.cls(**kwargs)
    except Exception as err:
        raise _fail(source, spec.where, f"could not build a {spec.cls.__name__}: {type(err).__name__}: {err}") from err


# ----------------------------------------------------------------------------------------------------
# Reading and checking the safetensors header (reads the header only, never the data)
# ----------------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _read_header(w_file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor name: (safetensors dtype, shape)}`` from the header of ``w_file``, fully validated.

    Checks what safetensors checks (known dtypes, sizes that match the shapes, contiguous offsets
    that cover the data exactly), with a size limit on the header so that it cannot exhaust memory.
    """

    def bad(problem: str) -> ValueError:
        return ValueError(f"could not read weights from {w_file} (truncated or corrupted?): {problem}")

    size = w_file.stat().st_size
    with open(w_file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"the file has {len(head)} bytes, fewer than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES:
            raise bad(f"the header claims {n} bytes, more than the limit of {_MAX_HEADER_BYTES}")
        if 8 + n > size:
            raise bad(f"the header claims {n} bytes but the file has only {size - 8} after the length")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise bad(f"the header is not valid JSON: {err}") from err
    if not isinstance(header, dict):
        raise bad(f"the header must be a mapping, got {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("__metadata__ must map strings to strings")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans = []
    for name, info in header.items():
        if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= set(info)):
            raise bad(f"tensor {name!r} needs dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise bad(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and 0 <= d <= _INT_LIMIT for d in shape)):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has invalid data_offsets {offsets!r}")
        if offsets[1] - offsets[0] != math.prod(shape) * _ST_DTYPES[dtype][0]:
            raise bad(f"tensor {name!r}: data_offsets {offsets} do not match shape {shape} of {dtype}")
        tensors[name] = (dtype, tuple(shape))
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin}, expected {end} (gap or overlap)")
        end = stop
    if end != size - 8 - n:
        raise bad(f"the tensors cover {end} bytes of data but the file holds {size - 8 - n}")
    return tensors


def _guard_sizes(spec: _Spec, header: dict[str, tuple[str, tuple[int, ...]]], cfg_file: Path, w_file: Path) -> None:
    """Refuse layer and head counts the weights file cannot hold, before any constructor loops over them."""
    n_tensors = len(header)
    largest = max((d for _, shape in header.values() for d in shape), default=0)
    for name, where, value in _iter_int_fields(spec):
        if name.endswith("depth") and value > n_tensors:
            raise ValueError(
                f"{cfg_file}: {where} = {value} layers, but {w_file} holds only {n_tensors} tensors "
                "(each layer has at least one)"
            )
        if name.endswith("heads") and value > largest:
            raise ValueError(
                f"{cfg_file}: {where} = {value} heads, but no tensor in {w_file} has a dimension that large "
                f"(largest: {largest})"
            )


def _compare_with_header(model: nn.Module, header: dict[str, tuple[str, tuple[int, ...]]], what: str) -> None:
    """Names, shapes and dtype kinds of ``model``'s state dict against the file's header.

    Tied tensors (one tensor under several names) must be stored under exactly one of their names.
    """
    groups: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    missing, unexpected = [], sorted(set(header) - set(state))
    for names in groups.values():
        present = [n for n in names if n in header]
        if not present:
            missing.append(names[0])
        unexpected += [f"{n} (the same tensor as {present[0]})" for n in present[1:]]  # stored once only
    if missing or unexpected:
        raise ValueError(f"{what}: missing {_few(sorted(missing))}, unexpected {_few(sorted(unexpected))}")
    problems = []
    for name, tensor in state.items():
        if name not in header:
            continue
        st_dtype, shape = header[name]
        if tuple(tensor.shape) != shape:
            problems.append(f"shape mismatch for {name}: the file has {list(shape)}, the config gives {list(tensor.shape)}")
        elif tensor.is_floating_point() != _ST_DTYPES[st_dtype][1] or (
            not tensor.is_floating_point() and getattr(torch, _ST_INT_TORCH[st_dtype], None) != tensor.dtype
        ):
            problems.append(f"dtype mismatch for {name}: the file has {st_dtype}, the model needs {tensor.dtype}")
    if problems:
        raise ValueError(f"{what}: {'; '.join(problems[:5])}" + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))


def _few(names: list[str], k: int = 10) -> str:
    return f"{names[:k]}" + (f" (and {len(names) - k} more)" if len(names) > k else "")


# ----------------------------------------------------------------------------------------------------
# Saving and loading
# ----------------------------------------------------------------------------------------------------


def config_class_name(model) -> str:
    """The name a config records: the model's own class, not a wrapper class a library made on the fly
    (FSDP2's ``fully_shard`` turns a ``TransformerWrapper`` into an ``FSDPTransformerWrapper``)."""
    for cls in type(model).__mro__:
        if issubclass(cls, Configurable) and not cls.__module__.startswith("torch."):
            return cls.__name__
    return type(model).__name__


def save_pretrained(model: nn.Module, directory: str | os.PathLike, *, state_dict: dict | None = None) -> Path:
    """Write ``model``'s ``config.json`` and ``model.safetensors`` into ``directory``; return the folder.

    The folder is written whole and atomically (see ``atomic_folder``): the files go into a temporary
    folder beside it, which is then renamed into place. A reader sees the old checkpoint or the new one,
    never a mix; when anything fails (or the process is interrupted) while writing, an existing checkpoint
    is left exactly as it was and a new one does not appear.

    Args:
        model: a ``Configurable`` safeformer model.
        directory: the folder (created if needed; its parents too). An existing folder is replaced, so
            it may hold only ``config.json`` and ``model.safetensors``: one holding anything else is
            refused (``ValueError`` naming the entries), never emptied.
        state_dict: the weights to write instead of ``model``'s own (e.g. a full state gathered from a
            sharded model); plain tensors, keyed as ``model.state_dict()``.

    Raises ``TypeError`` (writing nothing) if ``model`` is not a ``Configurable`` safeformer model.
    """
    if not isinstance(model, Configurable):
        raise TypeError(f"{type(model).__name__} is not a safeformer model with a config")
    text = _config_text(model)
    with atomic_folder(directory, _not_pretrained_files) as tmp:
        _write_pretrained(model, tmp, text, state_dict)
    return Path(directory)


def _config_text(model: nn.Module) -> str:
    """``config.json``'s text for ``model`` (a ``ValueError`` for an option that has no JSON config)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config = {"format": "safeformer", "version": _FORMAT_VERSION, "class": config_class_name(model),
              "dtype": str(dtype).removeprefix("torch."), "config": model.get_config()}
    try:
        return json.dumps(config, indent=2, sort_keys=True)
    except TypeError as err:  # a user's module or function as an option (attn_hybrid_module, ff_custom_activation)
        raise ValueError(f"this model has an option with no JSON config ({err}; e.g. attn_hybrid_module, "
                         f"attn_custom_attn_fn or ff_custom_activation): save its state_dict and rebuild the model "
                         f"in code") from err


def _write_pretrained(model: nn.Module, path: Path, text: str | None = None, state_dict: dict | None = None) -> None:
    """Write the checkpoint files into ``path`` (created if needed) in place: only for a folder that is
    itself still temporary (``save_pretrained`` and ``save_training_state`` write inside ``atomic_folder``)."""
    st = _safetensors()
    text = _config_text(model) if text is None else text
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(text)
    if state_dict is None:
        st.save_model(model, str(path / WEIGHTS_NAME))
    else:
        st.save_file(_unshared(state_dict), str(path / WEIGHTS_NAME))


def _not_pretrained_files(path: Path) -> list[str]:
    """The entries of an existing folder that ``save_pretrained`` did not write (it would delete them)."""
    return sorted(e.name for e in path.iterdir() if e.name not in (CONFIG_NAME, WEIGHTS_NAME) or not e.is_file())


@contextlib.contextmanager
def atomic_folder(directory: str | os.PathLike, foreign: Callable[[Path], list[str]]) -> Iterator[Path]:
    """Write a folder whole: yield a new empty temporary folder beside ``directory`` to fill; when the
    block ends without an error, swap it into place.

    The temporary folder is a hidden sibling (``.<name>.tmp-<random>``, same parent, so the renames stay
    on one file system). A new ``directory`` is the temporary folder renamed; an existing one is renamed
    aside (``.<name>.old-<random>``), the new folder renamed into place, then the old one removed (a
    failed second rename puts the old one back). So a reader sees the old folder or the new one, never a
    mix (between the two renames the path is briefly absent). Every file is flushed to disk before the
    swap. On any error, ``KeyboardInterrupt`` included, the temporary folder is removed and an existing
    ``directory`` is left as it was. A process killed outright (no clean-up runs) leaves its temporary
    folder, or, killed between the two renames, the old folder as ``.<name>.old-<random>``, beside the path.

    ``foreign(path)`` lists the entries of an existing ``directory`` that its writer did not write:
    when there are any, nothing is written and it is a ``ValueError`` naming them (replacing the folder
    would delete them). A ``directory`` that exists and is not a folder is a ``FileExistsError``.
    A symbolic link is followed: the folder it points to is replaced.
    """
    target = Path(directory).resolve()
    if not target.name:
        raise ValueError(f"directory {str(directory)!r} names no folder that can be replaced")
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"directory {directory} exists and is not a folder")
        others = foreign(target)
        if others:
            shown = ", ".join(repr(n) for n in others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise ValueError(f"directory {directory} holds {shown}, which this writer did not write: the folder is "
                             "replaced whole when saving, so it would be deleted; save into a new or empty folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_sibling(target, "tmp", create=True)
    try:
        yield tmp
        _flush_tree(tmp)
        if not target.exists():
            os.rename(tmp, target)
        else:
            shutil.copymode(target, tmp)  # the folder keeps its permissions
            old = _fresh_sibling(target, "old", create=False)
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        _flush_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fresh_sibling(target: Path, tag: str, *, create: bool) -> Path:
    """An unused hidden name beside ``target`` (created as a folder, with the usual permissions, if asked)."""
    for _ in range(100):
        candidate = target.with_name(f".{target.name}.{tag}-{secrets.token_hex(6)}")
        if create:
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            return candidate
        if not os.path.lexists(candidate):
            return candidate
    raise FileExistsError(f"no unused temporary name beside {target}")  # pragma: no cover - 2**48 names


def _flush_tree(path: Path) -> None:
    """fsync every file under ``path`` (so that a crash after the rename cannot leave empty files)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _flush_dir(Path(root))


def _flush_dir(path: Path) -> None:
    """fsync a folder's entries where the platform allows it (not on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def _unshared(state_dict: dict) -> dict:
    """Plain contiguous CPU tensors, each with its own storage (safetensors refuses shared ones)."""
    out, seen = {}, set()
    for k, v in state_dict.items():
        t = v.detach().cpu().contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        out[k] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _read_config(cfg_file: Path) -> dict[str, Any]:
    """Parse ``config.json`` and check its top level (not yet the ``config`` tree)."""
    size = cfg_file.stat().st_size
    if size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{cfg_file} is {size} bytes, more than the limit of {_MAX_CONFIG_BYTES} for a config")
    try:
        config = json.loads(cfg_file.read_bytes().decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{cfg_file} is not valid JSON (truncated or corrupted?): {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_file} is not a safeformer checkpoint config: the top level must be a mapping, "
                         f"got {_show(config)}")
    if config.get("format") != "safeformer":
        raise ValueError(f"{cfg_file} is not a safeformer checkpoint config: format is {_show(config.get('format'))}")
    for key in _TOP_LEVEL_REQUIRED:
        if key not in config:
            raise ValueError(f"{cfg_file}: the top-level field {key!r} is missing")
    for key in config:
        if key not in _TOP_LEVEL_REQUIRED + _TOP_LEVEL_OPTIONAL:
            raise ValueError(f"{cfg_file}: unknown top-level field {key!r}")
    if type(config["version"]) is not int or config["version"] not in _READABLE_VERSIONS:
        raise ValueError(f"{cfg_file} has checkpoint format version {config['version']!r}, expected one of "
                         f"{list(_READABLE_VERSIONS)}")
    if config["version"] == 1:  # the top level's class and config, then every nested module's
        _migrate_config_v1({"class": config["class"], "config": config["config"]})
    if config["version"] <= 2:
        _migrate_config_v2({"class": config["class"], "config": config["config"]})
    if type(config["class"]) is not str:
        raise ValueError(f"{cfg_file}: class must be a class name, got {_show(config['class'])}")
    return config


def _walk_configs(tree: Any, visit: Callable[[dict, set], None]) -> None:
    """``visit(config, parameter names)`` for every registered class's config in ``tree`` (a config and the modules'
    configs nested in it, outermost first)."""
    if isinstance(tree, list):
        for v in tree:
            _walk_configs(v, visit)
        return
    if not isinstance(tree, dict):
        return
    cls = _REGISTRY.get(tree.get("class")) if isinstance(tree.get("class"), str) else None
    cfg = tree.get("config")
    if cls is not None and isinstance(cfg, dict):
        visit(cfg, {n for k in cls.__mro__ if "__init__" in vars(k) for n in inspect.signature(k.__init__).parameters})
    for v in tree.values():
        _walk_configs(v, visit)


def _migrate_config_v1(tree: Any) -> None:
    """Format 1's configs, read with format 2's meanings (see ``_migrate_stack_v1``; a tied embedding's logits had
    no scale, ``tie_embedding_scale=1``; an ``Attention``'s grouped-query heads were interleaved and its qk-norm an
    RMS norm with gains, ``qk_norm_dim_scale=True``). The keys of format 1's weights move to format 2's names by
    the modules' load hooks."""

    def visit(cfg: dict, params: set) -> None:
        if "tie_embedding_scale" in params and cfg.get("tie_embedding") is True and cfg.get("tie_embedding_scale") is None:
            cfg["tie_embedding_scale"] = 1.0
        if "norm_add_unit_offset" in params:  # a stack
            _migrate_stack_v1(cfg)
        elif "kv_head_order" in params:  # an Attention
            cfg.setdefault("kv_head_order", "interleaved")
            if cfg.get("qk_norm") is True:
                cfg["qk_norm_dim_scale"] = True
        if "enc_options" in params:  # an XTransformer: each side's options are a stack's (and its wrapper's)
            for side in ("enc_options", "dec_options"):
                cfg[side] = dict(cfg.get(side) or {})
                _migrate_stack_v1(cfg[side], rotary=cfg.get("rotary_pos_emb") is True)

    _walk_configs(tree, visit)


def _migrate_config_v2(tree: Any) -> None:
    """Formats 1 and 2, read with format 3's meanings: every attention had an output projection, so an ``Attention``
    config gets ``project_out=True`` and a stack's (or an ``XTransformer`` side's) ``attn_project_out=True``
    (format 3 follows x-transformers: one head of width ``dim`` has none)."""

    def visit(cfg: dict, params: set) -> None:
        if "norm_add_unit_offset" in params:  # a stack
            cfg.setdefault("attn_project_out", True)
        elif "kv_head_order" in params:  # an Attention
            cfg.setdefault("project_out", True)
        if "enc_options" in params:
            for side in ("enc_options", "dec_options"):
                cfg[side] = dict(cfg.get(side) or {})
                cfg[side].setdefault("attn_project_out", True)

    _walk_configs(tree, visit)


def _migrate_stack_v1(options: dict, rotary: bool = False) -> None:
    """A format-1 stack's options (or an ``XTransformer`` side's; ``rotary``: the model-wide rotary flag): norms
    without the unit offset, grouped-query heads interleaved (``attn_kwargs={"kv_head_order": "interleaved"}``), the
    RMS qk-norm with gains as ``attn_qk_norm_dim_scale``, and any relative position scheme (ALiBi too) leaving out
    the absolute embedding (``disable_abs_pos_emb``)."""
    options.setdefault("norm_add_unit_offset", False)
    kwargs = options.get("attn_kwargs")
    options["attn_kwargs"] = {"kv_head_order": "interleaved", **(kwargs if isinstance(kwargs, dict) else {})}
    if options.get("attn_qk_norm") is True:
        options["attn_qk_norm_dim_scale"] = True
    if options.get("disable_abs_pos_emb") is None:
        options["disable_abs_pos_emb"] = rotary or any(options.get(k) is True for k in (
            "rotary_pos_emb", "alibi_pos_bias", "rotary_xpos", "polar_pos_emb", "rel_pos_bias"))


def migrate_state_dict(model: nn.Module, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` with the keys of earlier safeformer moved to ``model``'s, as ``load_state_dict`` reads them: each
    module's load hooks run on a copy, outermost first (a norm that must grow a shift grows it on ``model``)."""
    state = dict(state_dict)

    def walk(module: nn.Module, prefix: str) -> None:
        for hook in module._load_state_dict_pre_hooks.values():
            hook(state, prefix, {}, True, [], [], [])
        for name, child in module._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(model, "")
    return state


def _migrated_header(shadow: nn.Module, header: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
    """The header's names, shapes and dtype kinds after ``migrate_state_dict`` (meta tensors: nothing is read)."""

    def meta(st_dtype: str, shape) -> Tensor:
        dtype = torch.float32 if _ST_DTYPES[st_dtype][1] else getattr(torch, _ST_INT_TORCH[st_dtype])
        return torch.empty(shape, dtype=dtype, device="meta")

    metas = {k: meta(dt, shape) for k, (dt, shape) in header.items()}
    kinds = {id(t): header[k][0] for k, t in metas.items()}
    return {k: (kinds.get(id(t), "F32" if t.is_floating_point() else "I64"), tuple(t.shape))
            for k, t in migrate_state_dict(shadow, metas).items()}


def _config_dtype(config: dict[str, Any], cfg_file: Path) -> torch.dtype:
    name = config.get("dtype", "float32")
    dtype = getattr(torch, name, None) if type(name) is str else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{cfg_file}: dtype names an unknown or non-floating dtype {_show(name)}")
    return dtype


def load_pretrained(directory: str | os.PathLike, *, expected_class: type | None = None, map_location="cpu"):
    """Rebuild a model from a ``save_pretrained`` folder, treating the folder as hostile input.

    Args:
        directory: the folder holding ``config.json`` and ``model.safetensors``.
        expected_class: if given, the saved class must be it or a subclass.
        map_location: the device the weights are loaded onto.

    The config is checked against the constructors, then against the weights file's header, then a
    model built on the meta device is compared with the header; only then is the real model built
    and loaded (see the module docstring). Raises ``FileNotFoundError`` for a missing file and
    ``ValueError`` naming the file and the field or tensor for anything else.
    """
    st = _safetensors()
    path = Path(directory)
    cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file {f} is missing (expected {CONFIG_NAME} and {WEIGHTS_NAME} in {path})")
    config = _read_config(cfg_file)
    name = config["class"]
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"{cfg_file}: class names an unknown class {name!r}")
    if expected_class is not None and not issubclass(cls, expected_class):
        raise ValueError(f"{path} holds a {name}, not a {expected_class.__name__} ({cfg_file}: class)")
    dtype = _config_dtype(config, cfg_file)
    try:
        spec = _check_config(cls, config["config"], "config", str(cfg_file))
    except RecursionError as err:
        raise ValueError(f"{cfg_file}: config is nested too deeply") from err

    header = _read_header(w_file)
    _guard_sizes(spec, header, cfg_file, w_file)
    with torch.device("meta"):
        shadow = _build(spec, str(cfg_file))  # allocates nothing
    header = _migrated_header(shadow, header)  # format 1's names moved, grown shifts grown, as loading does
    _compare_with_header(shadow, header, f"weights in {w_file} do not match the {name} built from {cfg_file}")
    del shadow

    model = _build(spec, str(cfg_file))  # a normal build: non-persistent buffers get their real values
    model.to(dtype)
    try:
        missing, unexpected = st.load_model(model, str(w_file), strict=False, device=str(map_location))
    except RuntimeError as err:
        if "size mismatch" in str(err):
            raise ValueError(f"weights in {w_file} do not match the {name} built from {cfg_file}: {err}") from err
        raise ValueError(f"could not read weights from {w_file} (truncated or corrupted?): {err}") from err
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"could not read weights from {w_file} (truncated or corrupted?): {err}") from err
    if missing or unexpected:
        raise ValueError(
            f"weights in {w_file} do not match the {name} built from {cfg_file}: "
            f"missing {sorted(missing)[:10]}, unexpected {sorted(unexpected)[:10]}"
        )
    return model
