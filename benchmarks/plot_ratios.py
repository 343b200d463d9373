"""One figure with every benchmark's ratios: ``benchmarks/results/summary.png``.

Each benchmark script ends its results file (``results/<name>.md``) with a machine-readable line
``<!-- ratios: {...} -->`` holding its ratios and targets; this script reads those lines and draws one
panel per results file (bars: the measured ratios; dashed marks: the targets; green where a target is
met). Run it after the benchmarks:

    python benchmarks/attend_overhead.py && python benchmarks/train_step.py && \\
    python benchmarks/generation_speed.py && python benchmarks/memory.py && \\
    python benchmarks/compile_speed.py && python benchmarks/plot_ratios.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import RESULTS_DIR, plot_ratios, read_ratios

ORDER = ["attend_overhead", "train_step", "generation_speed", "memory", "compile_speed"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder holding the .md results files")
    p.add_argument("--tag", default="", help="suffix of the files to read, e.g. '_cuda'")
    p.add_argument("--out", type=Path, default=None, help="the PNG to write (default <results>/summary<tag>.png)")
    args = p.parse_args()
    panels = {}
    for name in ORDER:
        md = args.results / f"{name}{args.tag}.md"
        if not md.exists():
            print(f"skipped {md.name}: not found")
            continue
        payload = read_ratios(md)
        if payload is None:
            print(f"skipped {md.name}: no ratios line")
            continue
        panels[payload.get("title") or name] = payload
    if not panels:
        raise SystemExit(f"no results with ratios under {args.results}; run the benchmarks first")
    out = args.out or args.results / f"summary{args.tag}.png"
    plot_ratios(panels, out)
    print(f"written {out} ({len(panels)} panels)")


if __name__ == "__main__":
    main()
