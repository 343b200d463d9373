"""``benchmarks/masked_rows.py``, the masked-row backend matrix, run on the CPU with ``--quick``.

The table it writes has a row for SDPA's math backend and for every CPU backend of safeformer's
``attend`` in float32, bfloat16 and float16, in every case; safeformer's rows are finite forward and
backward with dead rows and their q gradient exactly 0; what the other implementations do is a finding,
not an error (exit 0); and a failure planted in ``safeformer.attend`` makes the script exit 1.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import safeformer

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")
SF_BACKENDS = ("auto", "reference", "math", "flash")  # attend's backends on the CPU


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("masked_rows_script", ROOT / "benchmarks" / "masked_rows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(script, tmp_path_factory):
    """The exit status and the table of one ``--quick`` run on the CPU."""
    out = tmp_path_factory.mktemp("masked_rows") / "masked_rows_cpu.md"
    code = script.main(["--quick", "--device", "cpu", "--out", str(out)])
    return code, out.read_text()


def case_rows(text: str) -> list[dict[str, str]]:
    """The rows of the per-case tables (each under its case's ``## name``): ``{column: cell, "case": name}``."""
    rows, case, columns = [], None, None
    for line in text.splitlines():
        if line.startswith("## "):
            case, columns = line[3:].strip(), None
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if columns is None:
                columns = cells
            elif "dtype" in columns:  # not the summary table
                rows.append({**dict(zip(columns, cells)), "case": case})
    return rows


def test_the_table_has_math_and_safeformer_rows_in_every_dtype_and_case(script, quick):
    code, text = quick
    assert code == 0, text[:3000]  # other implementations' failures are findings, not errors
    assert "torch " in text and "cuDNN" in text and "device: cpu" in text
    cases = [c.name for c in script.build_cases(script.QUICK_LENGTHS)]
    assert {"empty_context", "cfg_drop", "left_pad_causal", "q_gt_k_causal", "all_padding", "f32_additive_mask"} <= set(cases)
    rows = case_rows(text)
    assert {r["case"] for r in rows} == set(cases)
    seen = {(r["case"], r["implementation"], r["dtype"]) for r in rows}
    for case in cases:
        for dtype in DTYPES:
            for impl in ["sdpa[math]", "sdpa[flash]"] + [f"sf.attend[{b}]" for b in SF_BACKENDS]:
                assert (case, impl, dtype) in seen, (case, impl, dtype)
    math = [r for r in rows if r["implementation"] == "sdpa[math]" and r["accepted"] == "yes"]
    assert math and all(r["kernel"] in ("math", "none") for r in math)  # none: no keys, no kernel call


def test_safeformer_rows_are_finite_with_dead_rows_exactly_zero(quick):
    _, text = quick
    rows = [r for r in case_rows(text) if r["implementation"].startswith("sf.attend[")]
    assert len(rows) >= 4 * 3 * 8
    for r in rows:
        where = (r["case"], r["implementation"], r["dtype"])
        assert r["accepted"] == "yes", where
        assert (r["out"], r["grads"], r["dead rows"], r["dq dead"], r["no-grad"]) == (
            "finite", "finite", "exactly 0", "exactly 0", "ok"), (where, r)
        assert not r["err out"].startswith("**") and not r["err grad"].startswith("**"), (where, r)
        if r["implementation"] in ("sf.attend[math]", "sf.attend[flash]") and r["case"] != "zero_length_context":
            assert r["kernel"] == r["implementation"][10:-1], (where, r["kernel"])
    assert "safeformer `attend`: every accepted run finite" in text


@pytest.mark.parametrize("plant", ["nan_at_dead_rows", "dead_rows_not_zero"])
def test_a_failure_planted_in_attend_exits_nonzero(script, tmp_path, monkeypatch, plant):
    real = safeformer.attend

    def broken(*args, **kwargs):
        out = real(*args, **kwargs)
        if plant == "nan_at_dead_rows":
            return torch.where(out == 0, torch.nan, out)
        return out + 1e-3

    monkeypatch.setattr(safeformer, "attend", broken)
    out = tmp_path / "masked_rows.md"
    code = script.main(["--quick", "--device", "cpu", "--cases", "cfg_drop", "--dtypes", "float32", "--out", str(out)])
    assert code == 1
    text = out.read_text()
    assert "safeformer's promise broken" in text
    rows = [r for r in case_rows(text) if r["implementation"] == "sf.attend[reference]"]
    assert rows and rows[0]["dead rows"].startswith("**")
    if plant == "nan_at_dead_rows":
        assert "non-finite" in rows[0]["out"]
