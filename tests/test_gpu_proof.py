"""``benchmarks/gpu_proof.sh``, the one-command GPU proof, dry-run on the CPU (what CI can run).

With the GPU hidden (``GPU_PROOF_NO_CUDA=1``, so the dry run is the same on a GPU machine) the script
skips every CUDA part with a message, runs the CPU-safe checks (environment report, a smoke test of
``attend``, ``pytest --collect-only``, every benchmark's ``--help``, ``masked_rows.py --quick``), writes its
files under ``$OUT`` (at most 8, the device tool's limit) and exits 0. How a GPU session runs it: docs/testing.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_proof.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the script needs bash")


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_PROOF_")}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, GPU_PROOF_NO_CUDA="1", TMPDIR=str(tmp_path))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.full
def test_dry_run_on_the_cpu_skips_the_gpu_parts_and_passes(tmp_path):
    r = run_script(tmp_path, "--part", "all", "--quick")
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.txt", "bench_status.txt", "env.txt", "masked_rows.md", "proof.txt", "suite.txt"], files
    assert len(files) <= 8  # what the device tool brings back

    assert "CUDA not available" in r.stdout and "the CUDA parts are skipped" in r.stdout
    assert "the CUDA suite is skipped" in (out / "suite.txt").read_text()
    assert "the benchmarks are skipped" in (out / "bench_status.txt").read_text()

    env = (out / "env.txt").read_text()
    for section in ("== nvidia-smi", "== python / torch", "cuDNN", "== what the suite parametrizes over"):
        assert section in env, section
    assert re.search(r"^torch \d+\.\d+", env, re.M)
    assert "cpu: dtypes" in env and "smoke test: passed" in env

    proof = (out / "proof.txt").read_text()
    collected = re.search(r"pytest --collect-only: (\d+) tests collected", proof)
    assert collected and int(collected[1]) > 1000, proof

    status = (out / "bench_status.txt").read_text()
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")
    for name in scripts:
        assert f"{name}: --help ok" in status, (name, status)
    assert "usage: attend_overhead.py" in (out / "bench.txt").read_text()
    assert "masked rows (--device cpu --quick -> masked_rows.md): ok" in proof  # the masked-row matrix, --quick
    assert "| sf.attend[auto] | bfloat16 | yes |" in (out / "masked_rows.md").read_text()
    assert proof.rstrip().splitlines()[-1].startswith("overall: PASS")


def test_bad_arguments_exit_2(tmp_path):
    r = run_script(tmp_path, "--part", "everything")
    assert r.returncode == 2 and "--part must be" in r.stderr
    r = run_script(tmp_path, "--jobs", "many")
    assert r.returncode == 2 and "--jobs takes a number" in r.stderr
