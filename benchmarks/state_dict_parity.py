"""State-dict parity with x-transformers: does an x-transformers checkpoint load strictly into the same
safeformer model, and the other way round?

For each configuration the same constructor call builds an x-transformers model and a safeformer model.
Columns: whether ``load_state_dict(strict=True)`` succeeds each way; how many keys only one side has;
whether the shapes of the shared keys agree; and, as the baseline for what the weights mean, the largest
difference of the outputs on a right-padded batch after ``from_x_transformers`` (the converter, which maps
the keys by hand). The yardstick for making safeformer's module tree x-transformers' own.

    python benchmarks/state_dict_parity.py            # prints the table, writes benchmarks/results/state_dict_parity.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import safeformer as sf

try:
    import x_transformers as xt
except ImportError:  # pragma: no cover - the bench extra installs it
    sys.exit("this benchmark needs x-transformers: pip install -e '.[bench]'")

V, N, DIM = 20, 8, 32


def stack(lib, kind="Decoder", **kw):
    return getattr(lib, kind)(dim=DIM, depth=2, heads=2, attn_dim_head=16, **kw)


def wrapper(lib, kind="Decoder", wrap_kw=None, **kw):
    return lib.TransformerWrapper(num_tokens=V, max_seq_len=N, attn_layers=stack(lib, kind, **kw), **(wrap_kw or {}))


# name -> builder(lib); every builder makes the same call in both libraries
CONFIGS: dict[str, Callable] = {
    "Decoder": lambda lib: wrapper(lib),
    "rotary": lambda lib: wrapper(lib, rotary_pos_emb=True),
    "cross-attention": lambda lib: wrapper(lib, cross_attend=True),
    "RMSNorm + kv heads": lambda lib: wrapper(lib, use_rmsnorm=True, attn_kv_heads=1),
    "GLU + qk-norm": lambda lib: wrapper(lib, ff_glu=True, attn_qk_norm=True),
    "ALiBi + memory kv": lambda lib: wrapper(lib, alibi_pos_bias=True, attn_num_mem_kv=2),
    "adaptive norm": lambda lib: wrapper(lib, use_adaptive_layernorm=True, dim_condition=4),
    "T5 bias": lambda lib: wrapper(lib, rel_pos_bias=True),
    "sandwich norm": lambda lib: wrapper(lib, sandwich_norm=True),
    "post-norm": lambda lib: wrapper(lib, pre_norm=False),
    "residual attention": lambda lib: wrapper(lib, residual_attn=True),
    "gated residual": lambda lib: wrapper(lib, gate_residual=True),
    "scaled residual": lambda lib: wrapper(lib, scale_residual=True),
    "token shift": lambda lib: wrapper(lib, shift_tokens=1),
    "gated values": lambda lib: wrapper(lib, attn_gate_values=True),
    "macaron": lambda lib: wrapper(lib, macaron=True),
    "value residual": lambda lib: wrapper(lib, add_value_residual=True),
    "layerscale": lambda lib: wrapper(lib, use_layerscale=True),
    "custom layers": lambda lib: wrapper(lib, custom_layers=("a", "a", "f")),
    "memory tokens": lambda lib: wrapper(lib, wrap_kw=dict(num_memory_tokens=2)),
    "l2norm embed": lambda lib: wrapper(lib, wrap_kw=dict(l2norm_embed=True)),
    "tied embedding": lambda lib: wrapper(lib, wrap_kw=dict(tie_embedding=True)),
    "narrower embedding": lambda lib: wrapper(lib, wrap_kw=dict(emb_dim=16)),
    "ContinuousTransformerWrapper": lambda lib: lib.ContinuousTransformerWrapper(
        dim_in=5, dim_out=5, max_seq_len=N, attn_layers=stack(lib)),
    "XTransformer": lambda lib: lib.XTransformer(
        dim=DIM, enc_num_tokens=V, enc_depth=1, enc_heads=2, enc_max_seq_len=N, dec_num_tokens=V, dec_depth=1,
        dec_heads=2, dec_max_seq_len=N),
    "Encoder": lambda lib: stack(lib, "Encoder"),
    "Attention": lambda lib: lib.Attention(dim=DIM, heads=2, dim_head=16),
}


def inputs(name: str):
    """A right-padded batch for the model of ``name``: (args, kwargs)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(N)[None] < torch.tensor([N, 5])[:, None]  # (2, N), sample 1 right-padded
    kw = {"mask": mask}
    if name in ("Encoder", "Attention", "ContinuousTransformerWrapper"):
        x = torch.randn(2, N, 5 if name == "ContinuousTransformerWrapper" else DIM, generator=g)
    else:
        x = torch.randint(0, V, (2, N), generator=g)
    if name == "cross-attention":
        kw["context"] = torch.randn(2, 3, DIM, generator=g)
    if name == "adaptive norm":
        kw["condition"] = torch.randn(2, 4, generator=g)
    if name == "XTransformer":
        return (x, x), {"mask": mask}
    return (x,), kw


def strict(dst: torch.nn.Module, state: dict) -> str:
    try:
        dst.load_state_dict(state, strict=True)
        return "yes"
    except RuntimeError:
        return "no"


def row(name: str, build: Callable) -> dict:
    torch.manual_seed(0)
    theirs = build(xt).eval()
    torch.manual_seed(0)
    ours = build(sf).eval()
    a, b = theirs.state_dict(), ours.state_dict()
    shared = set(a) & set(b)
    out = dict(config=name, xt_to_sf=strict(build(sf), a), sf_to_xt=strict(build(xt), b),
               only_xt=len(set(a) - set(b)), only_sf=len(set(b) - set(a)),
               shapes="same" if all(a[k].shape == b[k].shape for k in shared) else "differ")
    out["loaded_max_diff"] = "-"
    if out["xt_to_sf"] == "yes":
        loaded = build(sf).eval()
        loaded.load_state_dict(a, strict=True)
        out["loaded_max_diff"] = _diff(name, theirs, loaded)
    try:
        converted = sf.from_x_transformers(theirs).eval()
        out["converted_max_diff"] = _diff(name, theirs, converted)
    except Exception as err:  # noqa: BLE001 - the table says what happened
        out["converted_max_diff"] = f"{type(err).__name__}"
    return out


def _diff(name: str, theirs, ours) -> str:
    """The largest difference of the two models' outputs on the right-padded batch, at real positions."""
    args, kw = inputs(name)
    with torch.no_grad():
        want, got = theirs(*args, **kw), ours(*args, **kw)
    if name == "XTransformer":  # a loss
        diff = (want - got).abs().item()
    else:
        keep = kw["mask"][..., None] if want.dim() == 3 else kw["mask"]
        diff = ((want - got).abs() * keep).max().item()
    return f"{diff:.1e}"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "state_dict_parity.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row(name, build) for name, build in CONFIGS.items()]
    cols = ["config", "xt_to_sf", "sf_to_xt", "only_xt", "only_sf", "shapes", "loaded_max_diff", "converted_max_diff"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    both = sum(r["xt_to_sf"] == "yes" and r["sf_to_xt"] == "yes" for r in rows)
    from importlib.metadata import version

    header = (f"# State-dict parity with x-transformers {version('x-transformers')}\n\n"
              f"torch {torch.__version__}. Written by `benchmarks/state_dict_parity.py`. Strict load both ways: "
              f"{both} of {len(rows)} configurations.\n\n")
    text = header + "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return rows


if __name__ == "__main__":
    main()
