"""The README's Python examples run as written (with small stand-in inputs), so the docs cannot rot.

The helpers here (`python_blocks`, `run_blocks`, `_inputs`) are shared with `tests/test_docs.py`, which
runs the pages under `docs/` the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# a fenced block that opens with ```python at the start of a line and closes with ``` at the start of a line;
# a block that is not meant to run is fenced as ```text (or any other language) instead
PYTHON_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return PYTHON_FENCE.findall(path.read_text())


def _blocks() -> list[str]:
    return python_blocks(README)


# the stand-in inputs the blocks use, as code: run here, and by the wheel check in a fresh venv (plain torch)
STAND_INS = """
import torch
g = torch.Generator().manual_seed(0)
b, n, j = 3, 12, 5
tokens = torch.randint(3, 256, (b, n), generator=g)
mask = torch.ones(b, n, dtype=torch.bool)
mask[0, :4] = False  # left padding
ctx = torch.randn(b, j, 64, generator=g)
ctx_mask = torch.ones(b, j, dtype=torch.bool)
ctx_mask[1] = False  # a dropped condition
ctx_mask[2, 3:] = False
src = torch.randint(0, 256, (b, 7), generator=g)
src_mask = torch.ones(b, 7, dtype=torch.bool)
src_mask[1] = False
attn_mask = mask[:, None, :] & torch.ones(n, n, dtype=torch.bool).tril()[None]
tgt, prompts, prompt_mask, prompt, next_token = tokens, tokens[:, :6], mask[:, :6], tokens[:, :6], tokens[:, 6]
"""


def _inputs() -> dict:
    from x_transformers import Decoder as XDecoder
    from x_transformers import TransformerWrapper as XWrapper

    ns: dict = {}
    exec(STAND_INS, ns)
    ns["xt_model"] = XWrapper(num_tokens=64, max_seq_len=32, attn_layers=XDecoder(dim=32, depth=1, heads=2))
    return ns


def run_blocks(path: Path) -> dict:
    """Exec every Python block of one page, in order, in one namespace seeded with `_inputs()`."""
    ns = _inputs()
    torch.manual_seed(0)
    name = path.relative_to(ROOT)
    for i, code in enumerate(python_blocks(path)):
        try:
            exec(compile(code, f"{name} python block {i}", "exec"), ns)
        except Exception as err:  # pragma: no cover - the message is the point
            pytest.fail(f"{name} python block {i} failed: {type(err).__name__}: {err}\n{code}")
    return ns


def test_readme_has_examples():
    assert len(_blocks()) >= 5


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_blocks(README)
    # the blocks' own results, checked where they are values
    assert ns["out"][1].eq(0).all() and torch.isfinite(ns["out"]).all()
    assert torch.isfinite(ns["loss"]) and ns["new"].shape == (3, 64)
