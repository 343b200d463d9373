"""pytest configuration for the safeformer suite: two tiers, one command.

The **quick tier** (``python -m pytest``, the default) runs every clause against every door with a few
hypothesis examples (the ``dev`` profile, plus every fixed ``@example`` scenario). The **full tier**
(``CI=true``, as CI sets it, or ``SAFEFORMER_TIER=full``) runs everything: the ``ci`` profile's examples,
and the tests marked ``full`` (compile, multi-process, the x-transformers README, the option cases beyond
the core set of each door). docs/testing.md says what each tier runs.

Hypothesis examples are seeded per commit (``_commit_seed``): new examples on every commit, the same
ones in CI and locally for one commit. ``HYPOTHESIS_PROFILE=thorough`` draws ten times the ``ci``
profile's examples. Examples have no deadline: the first call of a kernel can be slow, and tensors make
per-example time uneven.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # tests import the shared helpers package as `import helpers`

# The suite runs thousands of tiny attention calls: one intra-op thread is the fastest by far for them, and
# on a shared or loaded CPU a second OpenMP thread can make each kernel call hundreds of times slower.
torch.set_num_threads(int(os.environ.get("SAFEFORMER_TEST_THREADS", "1")))


def _tier() -> str:
    """``"full"`` under CI (``CI=true``) or ``SAFEFORMER_TIER=full``, else ``"quick"``."""
    tier = os.environ.get("SAFEFORMER_TIER", "").strip().lower()
    if tier:
        if tier not in ("quick", "full"):
            raise pytest.UsageError(f"SAFEFORMER_TIER must be 'quick' or 'full', got {tier!r}")
        return tier
    return "full" if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes") else "quick"


TIER = _tier()
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("dev", max_examples=3, **_COMMON)
settings.register_profile("ci", max_examples=30, **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if TIER == "full" else "dev"))

# files that run in the full tier only: compilation, and x-transformers' README run with the import changed
FULL_TIER_FILES = {"test_compile.py", "test_xt_readme.py"}


def _commit_seed() -> int:
    """The examples' seed: ``SAFEFORMER_HYPOTHESIS_SEED``, else one derived from the checked-out commit.

    Every commit draws new examples (nothing is derandomized into the same few forever), and a given
    commit draws the same ones everywhere, so a failure in CI reproduces locally on that commit
    (``pytest --hypothesis-seed=N`` overrides both).
    """
    if "SAFEFORMER_HYPOTHESIS_SEED" in os.environ:
        return int(os.environ["SAFEFORMER_HYPOTHESIS_SEED"])
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(__file__)).stdout.strip()
        return int(head[:12], 16)
    except (OSError, ValueError, subprocess.SubprocessError):  # no git: a new seed per day
        import datetime

        return int(datetime.date.today().strftime("%Y%m%d"))


HYPOTHESIS_SEED = _commit_seed()


def pytest_configure(config):
    from hypothesis import core

    if config.getoption("hypothesis_seed", default=None) is None:
        core.global_force_seed = HYPOTHESIS_SEED


def _full_only(item) -> bool:
    """Whether ``item`` belongs to the full tier alone: marked ``full`` or ``slow``, in a full-tier file, or
    parametrized by a contract case outside the core set (one case per door; see helpers.models)."""
    if item.get_closest_marker("full") or item.get_closest_marker("slow"):
        return True
    if os.path.basename(str(item.fspath)) in FULL_TIER_FILES:
        return True
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    return case is not None and hasattr(case, "name") and not getattr(case, "core", True)


def pytest_collection_modifyitems(config, items):
    if TIER == "full":
        return
    skip = pytest.mark.skip(reason="full tier only: run with CI=true or SAFEFORMER_TIER=full")
    for item in items:
        if _full_only(item):
            item.add_marker(skip)


def pytest_report_header(config):
    profile = settings._current_profile
    return (f"safeformer tier: {TIER} (hypothesis profile {profile!r}); hypothesis seed: {HYPOTHESIS_SEED} "
            f"(from the commit; reproduce with SAFEFORMER_HYPOTHESIS_SEED={HYPOTHESIS_SEED})")


@pytest.fixture(autouse=True)
def _quiet_and_seeded():
    """Each test starts from the same global RNG state, and SDPA's 'kernel not used' notes stay quiet."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*kernel not used because.*")
        warnings.filterwarnings("ignore", message=".*Memory efficient kernel not used.*")
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning)
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (comparisons against x-transformers: same reduction order run to run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
