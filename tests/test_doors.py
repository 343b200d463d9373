"""The contract (docs/safety.md, S1-S9) over the registry of public doors (``doors.py``).

The registry must list every public name of ``safeformer.__all__``; each clause is one test function
parametrized over the doors it applies to, so a failure names the clause and the door. Seeds are drawn
by hypothesis without derandomization: each run tries new inputs (a failure prints its seed).

Shape legend: as in doors.py.
"""

from __future__ import annotations

import doors
import helpers as hp
import pytest
import torch
from doors import DOORS, NOT_DOORS, PLANT_VALUES, PROBE_DOORS, PUBLIC, Door, Probe
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import safeformer as sf

IDS = [d.name for d in PROBE_DOORS]
SEEDS = st.integers(0, 2**31 - 1)



# ----------------------------------------------------------------------------------------------------
# the registry itself
# ----------------------------------------------------------------------------------------------------


def test_registry_lists_every_public_name():
    """A public name that is neither a registered door nor declared 'not a door' fails: a new public
    callable cannot ship without contract tests."""
    public = set(PUBLIC)
    missing = public - set(DOORS) - set(NOT_DOORS)
    assert not missing, f"public names missing from the door registry (tests/doors.py): {sorted(missing)}"
    stale = (set(DOORS) | set(NOT_DOORS)) - public
    assert not stale, f"registry entries that are not public names: {sorted(stale)}"
    both = set(DOORS) & set(NOT_DOORS)
    assert not both, f"names both door and not-door: {sorted(both)}"


def test_every_public_name_is_importable_from_all():
    for module in (sf, sf.testing):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ names {name!r}, which it does not define"


def test_the_users_api_holds_no_test_hooks_or_planning_internals():
    """``safeformer.__all__`` is the user's API: test hooks and plans live in ``safeformer.testing``."""
    assert not set(sf.__all__) & set(sf.testing.__all__)
    assert "drop_condition" not in sf.__all__, "one spelling: drop_conditions is the public one"


def test_every_door_is_tested_somewhere():
    """Each door has a probe (run by this file), model-level contract cases, or a named suite."""
    case_names = {c.name for c in hp.CASES} | {"guidance"}
    for door in DOORS.values():
        assert door.probe or door.cases or door.note, f"door {door.name} has no test"
        unknown = set(door.cases) - case_names
        assert not unknown, f"door {door.name} names contract cases that do not exist: {sorted(unknown)}"


# ----------------------------------------------------------------------------------------------------
# the clauses over every probe
# ----------------------------------------------------------------------------------------------------


def _grads(probe: Probe, seed: int) -> dict[str, Tensor]:
    """Gradients of ``sum(out * u)`` (``u`` random, 0 outside ``compare``) for every leaf; a leaf that
    receives no gradient is a failure, not a zero."""
    if probe.out is None or not probe.leaves or not probe.out.requires_grad:
        return {}
    u = torch.randn(probe.out.shape, generator=torch.Generator().manual_seed(seed)).to(probe.out.dtype)
    if probe.compare is not None:
        u = u * probe.compare
    names = list(probe.leaves)
    got = torch.autograd.grad((probe.out * u).sum(), [probe.leaves[k] for k in names], allow_unused=True)
    missing = [k for k, g in zip(names, got) if g is None]
    assert not missing, f"no gradient reached {missing} (a missing gradient is not a zero gradient)"
    return dict(zip(names, got))


def _finite_where(t: Tensor, where: Tensor | None, what: str) -> None:
    t = t.detach() if where is None else t.detach()[where]
    hp.assert_finite(t, what)


@pytest.mark.parametrize("door", PROBE_DOORS, ids=IDS)
@hp.examples(6)
@given(seed=SEEDS)
def test_s1_finite(door: Door, seed: int):
    """NaN planted at every masked position, dead rows on purpose: outputs and gradients are finite."""
    probe = door.probe(seed, doors.NAN)
    if probe.out is not None:
        _finite_where(probe.out, probe.compare, f"{door.name}: output")
    for k, g in _grads(probe, seed).items():
        keep = None if probe.masked_grad_zero else ~probe.masked[k]
        _finite_where(g, keep, f"{door.name}: grad of {k}")


@pytest.mark.parametrize("door", [d for d in PROBE_DOORS if d.has_dead], ids=lambda d: d.name)
@hp.examples(4)
@given(seed=SEEDS)
def test_s2_dead_outputs_exactly_zero(door: Door, seed: int):
    """Outputs the contract calls dead (no key, no valid position, no counted target) are exactly 0,
    and send exactly 0 gradient into masked inputs."""
    probe = door.probe(seed, doors.NAN)
    assert probe.dead is not None and bool(probe.dead.any()), f"{door.name}: the probe drew no dead output"
    hp.assert_zero(probe.out.detach()[probe.dead], f"{door.name}: dead outputs")
    for k, g in _grads(probe, seed).items():
        if probe.masked_grad_zero and k in probe.masked:
            hp.assert_zero(g[probe.masked[k]], f"{door.name}: grad of {k} at masked positions")


@pytest.mark.parametrize("value", PLANT_VALUES, ids=["nan", "inf", "-inf", "1e4"])
@pytest.mark.parametrize("door", PROBE_DOORS, ids=IDS)
@hp.examples(4)
@given(seed=SEEDS)
def test_s3_masked_contents_never_matter(door: Door, value: float, seed: int):
    """Garbage planted at masked positions changes no output and no gradient (bit for bit), and the
    gradient there is exactly 0."""
    clean, dirty = door.probe(seed, 0.0), door.probe(seed, value)
    if clean.out is None:
        return  # the probe checked its own equality (tokens, reports) inside
    where = clean.compare
    a, b = dirty.out.detach(), clean.out.detach()
    hp.assert_bitwise(a if where is None else a[where], b if where is None else b[where], f"{door.name}: output")
    g_clean, g_dirty = _grads(clean, seed), _grads(dirty, seed)
    for k, g in g_dirty.items():
        masked = dirty.masked.get(k)
        if masked is None:
            hp.assert_bitwise(g, g_clean[k], f"{door.name}: grad of {k}")
            continue
        hp.assert_bitwise(g[~masked], g_clean[k][~masked], f"{door.name}: grad of {k} at real positions")
        if dirty.masked_grad_zero:
            hp.assert_zero(g[masked], f"{door.name}: grad of {k} at masked positions ({value} planted)")


@pytest.mark.parametrize("door", PROBE_DOORS, ids=IDS)
def test_s9_bad_input_is_a_clear_error(door: Door):
    """Each wrong input raises the documented exception, naming the argument."""
    hp.assert_clear_errors(door.probe(0, 0.0).bad_calls, f"{door.name}, ")
