"""Option families: the keywords of one part of a module as one frozen, typed value.

A family is a frozen dataclass (a subclass of ``Options``) declared beside the part that reads it: its fields are
the part's keywords, in x-transformers' spelling, with their types and defaults. Creating one checks every field
against its annotation, once, at the door (a ``TypeError`` naming the keyword); the part's builder then checks
values and combinations and builds its parameters from it. A module's keywords, its signature, the stack's
``attn_<name>`` / ``cross_attn_<name>`` spellings and a saved config's types are all read from the fields.

A field's ``metadata``: ``self_only`` (a stack keeps it out of its cross-attention blocks: the option reads the
sequence's own positions or values).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache

from torch import nn

__all__ = ["OptionTypeError", "Options", "self_only"]


class OptionTypeError(TypeError, ValueError):
    """A keyword given a value of the wrong type. A ``TypeError``, and a ``ValueError`` too: the parts' own checks
    refused some of these values as ``ValueError`` before the families checked types, and code that catches either
    keeps working. ``name``: the keyword."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name

    def spelt(self, prefix: str) -> OptionTypeError:
        """The same error naming the keyword as a stack spells it (``attn_``, ``cross_attn_``, ``ff_``)."""
        text = str(self)
        return OptionTypeError(prefix + self.name, prefix + text if text.startswith(self.name) else text)


def self_only(default):
    """A field a stack keeps out of its cross-attention blocks."""
    return dataclasses.field(default=default, metadata={"self_only": True})


@dataclasses.dataclass(frozen=True)
class Options:
    """Base of an option family (see the module docstring)."""

    def __post_init__(self) -> None:
        for name, hint in type(self).hints().items():
            check_type(name, getattr(self, name), hint)

    @classmethod
    @cache
    def hints(cls) -> dict[str, object]:
        """Each field's type (its annotation, evaluated)."""
        every = typing.get_type_hints(cls)
        return {f.name: every[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        """The fields as keyword-only parameters, with their defaults and types (a module's signature)."""
        hints = cls.hints()
        return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                  annotation=hints[f.name]) for f in dataclasses.fields(cls)]

    @classmethod
    def self_only(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("self_only"))

    @classmethod
    def of(cls, owner: str, given: dict, valid=()):
        """The family of ``given``'s keywords, each of which must be a field: else a ``TypeError`` naming it, as
        ``owner``'s (with the closest of the fields and ``valid`` suggested)."""
        for key in given:
            if key not in cls.names():
                raise unknown_keyword(owner, key, [*cls.names(), *valid])
        return cls(**given)

    @classmethod
    def take(cls, given: dict):
        """The family from ``given``'s keywords that are its fields (removed from ``given``)."""
        return cls(**{n: given.pop(n) for n in cls.names() if n in given})

    def changed(self) -> dict[str, object]:
        """The fields not at their default value."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not _same(getattr(self, f.name), f.default)}


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # a value whose comparison is not a bool (a module, a tensor): only itself is the same
        return False


def _describe(hint) -> str:
    if hint is type(None):
        return "None"
    if _is_union(hint):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    return {bool: "True or False", int: "an integer", float: "a number", str: "a string", dict: "a dict",
            tuple: "a tuple", nn.Module: "an nn.Module"}.get(hint, getattr(hint, "__name__", str(hint)))


def _is_union(hint) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _fits(value, hint) -> bool:
    if hint is typing.Any or hint is object:
        return True
    if _is_union(hint):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is dict:
        return isinstance(value, Mapping)
    origin = typing.get_origin(hint)
    if hint is Callable or origin is Callable or origin is typing.Callable:
        return callable(value)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return isinstance(value, origin) if isinstance(origin, type) else True


def check_type(name: str, value, hint) -> None:
    """``value`` of keyword ``name`` against its type ``hint``.

    Raises:
        OptionTypeError: naming the keyword, the type it takes and the value given.
    """
    if not _fits(value, hint):
        raise OptionTypeError(name, f"{name} must be {_describe(hint)}, got {value!r}")


def unknown_keyword(owner: str, key: str, valid) -> TypeError:
    """The ``TypeError`` for a keyword ``owner`` does not take, with the closest valid ones suggested."""
    close = difflib.get_close_matches(key, sorted(valid), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}{hint}")
