"""Interop: converting x-transformers models (``from_x_transformers``, in ``convert``; the checks, the plan and
the build of a net in ``checks``, ``plan`` and ``build``)."""

from .convert import from_x_transformers, register_converter

__all__ = ["from_x_transformers", "register_converter"]
