"""pytest configuration for the safeformer suite.

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

sys.path.insert(0, os.path.dirname(__file__))  # tests import the shared helpers as `import contract`

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
