"""The package a user installs: what the wheel ships and requires, and the README's tour run from it.

The metadata checks run in every tier; building the wheel, installing it into a fresh venv (torch from the
CPU-build constraints) and running the tour from a folder outside the repository runs in the full tier.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib
from test_readme import README, ROOT, STAND_INS, python_blocks

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _tour_imports() -> set[str]:
    """The top-level packages the README's Python blocks import."""
    names = set()
    for code in python_blocks(README):
        names |= set(re.findall(r"^\s*(?:from|import)\s+(\w+)", code, flags=re.M))
    return names


def test_core_dependencies_cover_the_tour():
    """Everything the tour imports or calls without an extra is a core dependency: safetensors (checkpoints)
    and numpy (which safetensors' torch loader imports) included."""
    deps = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    assert {"torch", "einops", "safetensors", "numpy"} <= deps, deps
    stdlib = set(sys.stdlib_module_names)
    for name in _tour_imports() - stdlib - {"safeformer"}:
        assert name.replace("_", "-") in deps or name == "x_transformers", f"the tour imports {name}, not a dependency"


def test_license_typed_marker_and_urls():
    assert (ROOT / "LICENSE").is_file() and "MIT License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "safeformer" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["safeformer"]
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Source", "Issues"} <= set(urls) and all(u.startswith("https://") for u in urls.values())
    assert PYPROJECT["project"]["authors"]
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "build/" in ignored and "dist/" in ignored, "pip wheel . leaves build/ and dist/"


def _copy_tracked(dest: Path) -> None:
    """The checkout's files that git does not ignore (what a clone of it holds), so that building leaves
    nothing in the repository."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.mark.full
def test_wheel_installs_into_a_fresh_venv_and_runs_the_tour(tmp_path):
    src, dist, env, run = tmp_path / "src", tmp_path / "dist", tmp_path / "venv", tmp_path / "elsewhere"
    for d in (src, dist, run):
        d.mkdir()
    _copy_tracked(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, timeout=600)
    (wheel,) = dist.glob("safeformer-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "safeformer/py.typed" in names
    assert any(re.search(r"\.dist-info/(licenses/)?LICENSE$", n) for n in names), "the wheel ships no LICENSE"
    requires = re.findall(r"^Requires-Dist: ([\w-]+)(?!.*extra ==)", meta, flags=re.M)
    assert {"torch", "einops", "safetensors", "numpy"} <= set(requires), requires

    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheel)],
                   check=True, timeout=1200)
    blocks = [code for code in python_blocks(README) if "xt_model" not in code]  # the converter needs x-transformers
    (run / "tour.py").write_text(STAND_INS + "\n" + "\n".join(blocks) + "\nprint('tour ok')\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run([str(py), "tour.py"], cwd=run, capture_output=True, text=True, timeout=900, env=clean)
    assert out.returncode == 0 and "tour ok" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    where = subprocess.run([str(py), "-c", "import safeformer; print(safeformer.__file__)"], cwd=run,
                           capture_output=True, text=True, env=clean).stdout
    assert str(env) in where, f"the tour imported safeformer from {where!r}, not the installed wheel"
