"""The README's Python examples run as written (with small stand-in inputs), so the docs cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _inputs() -> dict:
    from x_transformers import Decoder as XDecoder
    from x_transformers import TransformerWrapper as XWrapper

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
    xt_model = XWrapper(num_tokens=64, max_seq_len=32, attn_layers=XDecoder(dim=32, depth=1, heads=2))
    attn_mask = mask[:, None, :] & torch.ones(n, n, dtype=torch.bool).tril()[None]
    return dict(
        torch=torch, tokens=tokens, mask=mask, ctx=ctx, ctx_mask=ctx_mask, src=src, tgt=tokens,
        src_mask=src_mask, prompts=tokens[:, :6], prompt_mask=mask[:, :6], prompt=tokens[:, :6],
        next_token=tokens[:, 6], xt_model=xt_model, attn_mask=attn_mask,
    )


def test_readme_has_examples():
    assert len(_blocks()) >= 5


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = _inputs()
    for i, code in enumerate(_blocks()):
        try:
            exec(compile(code, f"README.md python block {i}", "exec"), ns)
        except Exception as err:  # pragma: no cover - the message is the point
            pytest.fail(f"README python block {i} failed: {type(err).__name__}: {err}\n{code}")
    # the blocks' own results, checked where they are values
    assert ns["out"][1].eq(0).all() and torch.isfinite(ns["out"]).all()
    assert torch.isfinite(ns["loss"]) and ns["new"].shape == (3, 64)
