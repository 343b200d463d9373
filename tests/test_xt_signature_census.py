"""The signature census: every named constructor and ``forward`` parameter of every public class of every
x-transformers module that safeformer provides is a named parameter of safeformer's class of the same name, or
is listed below with where it is accepted (a class's ``**kwargs`` at x-transformers' default, tested elsewhere).
A parameter x-transformers adds shows up here as a failure until it is provided or listed."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

xt = pytest.importorskip("x_transformers")

# (module path, class, method) -> the x-transformers parameters taken through **kwargs, and where that is tested
THROUGH_KWARGS = {
    ("x_transformers", "Attention", "__init__"): (
        {"onnxable"},
        "xt_defaults.ATTENTION_DEFAULT_ONLY / ATTENTION_ANY_VALUE "
        "(tests/test_xt_keywords.py::test_attention_takes_x_transformers_keywords_at_their_defaults)"),
    ("x_transformers", "TransformerBlock", "__init__"): (
        {"dim", "depth", "pre_norm_has_final_norm"},
        "AttentionLayers' own keywords (tests/test_xt_names.py::test_transformer_block_matches_x_transformers)"),
    ("x_transformers.continuous", "AttentionLayers", "__init__"): (
        {"verbose"}, "LAYER_ALIASES, any value (tests/test_xt_keywords.py)"),
}


def _named(fn) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _takes_kwargs(fn) -> bool:
    try:
        return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def census() -> dict[tuple[str, str, str], set[str]]:
    """``(module, class, method) -> x-transformers' named parameters safeformer's class does not name``."""
    seen, out = set(), {}
    for path in ["x_transformers"] + [f"x_transformers.{m.name}" for m in pkgutil.iter_modules(xt.__path__)]:
        theirs = importlib.import_module(path)
        try:
            ours = importlib.import_module("safeformer" + path[len("x_transformers"):])
        except ModuleNotFoundError:
            continue
        for name, cls in vars(theirs).items():
            if name.startswith("_") or not inspect.isclass(cls) or cls in seen \
                    or not str(cls.__module__).startswith("x_transformers") or not hasattr(ours, name):
                continue
            seen.add(cls)
            for method in ("__init__", "forward"):
                if method not in vars(cls) and not hasattr(cls, method):
                    continue
                mine = getattr(getattr(ours, name), method, None)
                missing = set(_named(getattr(cls, method))) - set(_named(mine))
                if missing:
                    out[(path, name, method)] = missing
    return out


def test_every_named_parameter_is_provided_or_listed():
    unlisted = {}
    for key, missing in census().items():
        listed = THROUGH_KWARGS.get(key, (set(), ""))[0]
        if missing - listed:
            unlisted[key] = sorted(missing - listed)
    assert not unlisted, f"x-transformers parameters safeformer's classes do not name: {unlisted}"


def test_listed_parameters_go_through_kwargs_and_are_still_missing():
    found = census()
    for (path, name, method), (params, where) in THROUGH_KWARGS.items():
        assert where, (path, name, method)
        ours = getattr(importlib.import_module("safeformer" + path[len("x_transformers"):]), name)
        assert _takes_kwargs(getattr(ours, method)), f"{name}.{method} takes no **kwargs for {sorted(params)}"
        assert params <= found.get((path, name, method), set()), f"stale entry: {(path, name, method)}"


def test_census_covers_the_classes_users_build():
    found_classes = set()
    for path in ["x_transformers"] + [f"x_transformers.{m.name}" for m in pkgutil.iter_modules(xt.__path__)]:
        try:
            ours = importlib.import_module("safeformer" + path[len("x_transformers"):])
        except ModuleNotFoundError:
            continue
        found_classes |= {n for n, v in vars(importlib.import_module(path)).items()
                          if inspect.isclass(v) and hasattr(ours, n)}
    for name in ("TransformerWrapper", "Decoder", "Encoder", "Attention", "FeedForward", "AutoregressiveWrapper",
                 "ContinuousTransformerWrapper", "XTransformer", "NonAutoregressiveWrapper", "Attend",
                 "LayerIntermediates"):
        assert name in found_classes, name
