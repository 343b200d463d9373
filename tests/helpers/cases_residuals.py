"""Contract cases for x-transformers' key/value residuals and extra keys/values given to the stack.

Each case subclasses a case of ``models.py`` (imported from there at the end of that module) and joins its
``CASES``; a case that runs on the padded path only sets ``padded_only = True``.
"""

from __future__ import annotations

CASES: list = []
