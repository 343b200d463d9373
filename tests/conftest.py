"""pytest configuration for the safeformer suite.

Hypothesis examples are seeded per commit (``_commit_seed``): new examples on every commit, the same
ones in CI and locally for one commit.

Hypothesis profiles: ``safeformer`` (30 examples a test, used locally and in CI) and ``thorough`` (300);
pick one with ``HYPOTHESIS_PROFILE=thorough pytest``. Examples have no deadline: the first call of a
kernel can be slow, and tensors make per-example time uneven.
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

settings.register_profile(
    "safeformer",
    max_examples=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("safeformer"),
    max_examples=300,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "safeformer"))


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


def pytest_report_header(config):
    return f"hypothesis seed: {HYPOTHESIS_SEED} (from the commit; reproduce with SAFEFORMER_HYPOTHESIS_SEED={HYPOTHESIS_SEED})"


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
