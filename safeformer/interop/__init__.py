"""Interop: converting x-transformers models (``from_x_transformers``, in ``convert``)."""

from .convert import from_x_transformers, register_converter

__all__ = ["from_x_transformers", "register_converter"]
