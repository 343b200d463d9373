"""The shared helpers of the test suite, one namespace (``import helpers as hp``), grouped by topic:

- ``numerics``: comparisons NaN can never pass (``assert_close``, ``assert_bitwise``, ``assert_zero``,
  ``assert_finite``) and the dtype-tied tolerance tables;
- ``references``: float64 references in the plainest code (``ref_attend``, ``ref_attention``,
  ``ref_stack``, ``ref_wrapper``, norms, rotary, ALiBi, guidance, cross-entropy);
- ``kernels``: SDPA stand-ins that record (``RecordingKernel``) or misbehave on purpose (``NaNKernel``);
- ``masks``: masks with dead rows on purpose, hypothesis strategies, garbage to plant;
- ``models``: model builders and one small case per public module (``CASES``);
- ``contract``: devices, dtypes and backends to check on, hypothesis settings, the checks the safety
  clauses (docs/safety.md, S1-S9) share.

``tests/`` is on ``sys.path`` (conftest.py), so tests ``import helpers``; ``tests/doors.py`` is the
registry of public doors.
"""

from .contract import *  # noqa: F403
from .kernels import *  # noqa: F403
from .masks import *  # noqa: F403
from .models import *  # noqa: F403
from .numerics import *  # noqa: F403
from .references import *  # noqa: F403
