"""Contract cases for x-transformers' options of the shared modules (norms, feed-forwards, positions).

Each case subclasses a case of ``models.py`` (imported from there at the end of that module) and joins its
``CASES``; a case that runs on the padded path only sets ``padded_only = True``.
"""

from __future__ import annotations

CASES: list = []
