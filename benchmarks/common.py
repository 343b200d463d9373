"""Shared helpers for the side-by-side benchmarks: machine info, interleaved timing, ratio tables, plots.

How every benchmark here measures (DESIGN.md, "Benchmarks"):
- the contenders run in the same process, interleaved in rounds; the order rotates every round so no
  contender always runs first (or always right after a given other one);
- one sample = the time of ``inner`` back-to-back calls divided by ``inner`` (``inner`` is chosen so a
  sample lasts long enough for ``time.perf_counter`` to be precise);
- the headline number is the median over rounds of (contender time / baseline time *in the same
  round*): runs close in time share the machine's load, so the per-round ratio cancels most of the noise
  of a shared machine. The ratio of the medians and the 25%-75% range of per-round ratios sit beside it;
- absolute times are reported on a GPU only; on a shared CPU only ratios mean something;
- on a CPU the run uses ``--threads`` threads (default 1: on a busy 2-core machine extra threads mostly
  measure the other processes' load).

Each script writes ``results/<name>.md`` (the table, ending in the ratios, plus a machine-readable
``<!-- ratios: {...} -->`` line that ``plot_ratios.py`` reads) and ``results/<name>.png`` (the ratios).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

__all__ = [
    "RESULTS_DIR",
    "base_parser",
    "setup",
    "machine",
    "sync",
    "Timing",
    "interleaved",
    "pick_inner",
    "ratio_cells",
    "markdown_table",
    "write_results",
    "plot_ratios",
    "read_ratios",
]


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argparse parser with the options every benchmark shares.

    Args:
        description: the script's one-line description.

    Returns:
        a parser with ``--quick``, ``--rounds``, ``--threads``, ``--device``, ``--out-dir``.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a < 30 s smoke run (smaller sizes, fewer rounds)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: per script)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 on CPU, torch's default on GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR,
                   help="where the .md table and the .png plot go (default benchmarks/results; with --quick, "
                        "a temporary folder)")
    p.add_argument("--tag", default="", help="suffix for the result files, e.g. '_cuda'")
    return p


def setup(args: argparse.Namespace) -> torch.device:
    """Apply ``--threads`` and seed; returns the device.

    Args:
        args: parsed arguments from ``base_parser``.

    Returns:
        the ``torch.device`` to run on.
    """
    device = torch.device(args.device)
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(0)
    if args.tag == "" and device.type == "cuda":
        args.tag = "_cuda"
    return device


def machine(device: torch.device) -> str:
    """One line describing where the numbers come from: device, cores, threads, torch, Python."""
    if device.type == "cuda":
        where = f"GPU {torch.cuda.get_device_name(device)}"
    else:
        where = f"CPU {platform.processor() or platform.machine()}"
    try:
        load = "load average {:.1f}, {:.1f}, {:.1f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    return (f"{where}; {os.cpu_count()} cores ({load} at start); torch {torch.__version__} using "
            f"{torch.get_num_threads()} thread(s); Python {platform.python_version()}")


def sync(device: torch.device) -> None:
    """Wait for queued GPU work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Per-round seconds per call of each contender, and how they compare with a baseline.

    Attributes:
        times: contender name -> list of seconds per call, one per round (same order of rounds).
        baseline: the name the ratios divide by.
    """

    times: dict[str, list[float]]
    baseline: str
    extra: dict[str, object] = field(default_factory=dict)

    def per_round(self, name: str, over: str | None = None) -> list[float]:
        """Per-round ratios ``name / over`` (default ``over``: the baseline), sorted."""
        base = self.times[over or self.baseline]
        return sorted(t / b for t, b in zip(self.times[name], base))

    def ratio(self, name: str, over: str | None = None) -> float:
        """Median over rounds of the per-round ratio ``name / over``."""
        return statistics.median(self.per_round(name, over))

    def ratio_of_medians(self, name: str, over: str | None = None) -> float:
        """``median(name) / median(over)``."""
        return self.median(name) / self.median(over or self.baseline)

    def quartiles(self, name: str, over: str | None = None) -> tuple[float, float]:
        """25% and 75% points of the per-round ratios."""
        r = self.per_round(name, over)
        return r[len(r) // 4], r[min(len(r) - 1, (3 * len(r)) // 4)]

    def median(self, name: str) -> float:
        """Median seconds per call."""
        return statistics.median(self.times[name])


def interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    rounds: int,
    device: torch.device,
    inner: int | dict[str, int] = 1,
    warmup: int = 2,
    baseline: str | None = None,
) -> Timing:
    """Time each contender in interleaved rounds, rotating the order every round.

    Args:
        contenders: name -> a callable doing one unit of work (one call, one step, one generation).
        rounds: how many rounds; every contender is timed once per round.
        device: for the GPU sync around each sample.
        inner: calls per sample (one int for all, or per contender); the sample is divided by it.
        warmup: untimed calls of each contender before the first round.
        baseline: the name ratios divide by (default: the first contender).

    Returns:
        a ``Timing``.
    """
    names = list(contenders)
    inners = {n: (inner[n] if isinstance(inner, dict) else inner) for n in names}
    for _ in range(warmup):
        for n in names:
            contenders[n]()
    sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection inside one contender's sample is noise
    try:
        for r in range(rounds):
            k = r % len(names)
            order = names[k:] + names[:k]
            if (r // len(names)) % 2 == 1:  # alternate direction too: a before b and b before a
                order = order[::-1]
            for n in order:
                fn = contenders[n]
                sync(device)
                t0 = time.perf_counter()
                for _ in range(inners[n]):
                    fn()
                sync(device)
                times[n].append((time.perf_counter() - t0) / inners[n])
            if r % 10 == 9:
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(times, baseline or names[0])


def pick_inner(fn: Callable[[], object], device: torch.device, target_s: float = 0.05, cap: int = 200) -> int:
    """How many calls of ``fn`` make a sample of about ``target_s`` seconds (at least 1, at most ``cap``)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    dt = max(time.perf_counter() - t0, 1e-6)
    return max(1, min(cap, round(target_s / dt)))


def ratio_cells(t: Timing, name: str, over: str | None = None) -> list[str]:
    """Table cells: median per-round ratio, ratio of medians, 25%-75% of per-round ratios."""
    lo, hi = t.quartiles(name, over)
    return [f"{t.ratio(name, over):.3f}x", f"{t.ratio_of_medians(name, over):.3f}x", f"{lo:.3f}x - {hi:.3f}x"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> list[str]:
    """Markdown table lines; ``align`` is one char per column (``l`` or ``r``), default l then r."""
    align = align or ("l" + "r" * (len(header) - 1))
    sep = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return ["| " + " | ".join(map(str, header)) + " |", sep] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def write_results(name: str, args: argparse.Namespace, lines: list[str], ratios: dict[str, float],
                  target: dict[str, float] | None = None, title: str = "") -> Path:
    """Print the table, write ``<out-dir>/<name><tag>.md`` (with a ratios comment) and the PNG.

    Args:
        name: file stem, e.g. ``"attend_overhead"``.
        args: parsed arguments (``out_dir``, ``tag``, ``quick``).
        lines: the markdown lines of the report.
        ratios: label -> ratio (safeformer / peer), plotted and stored for ``plot_ratios.py``.
        target: label -> the target ratio (a dashed mark on the plot), where there is one.
        title: the plot's title.

    Returns:
        the path of the markdown file.
    """
    stem = f"{name}{args.tag}"
    out_dir: Path = args.out_dir
    if args.quick and out_dir == RESULTS_DIR:  # smoke runs do not overwrite the committed results
        out_dir = Path(tempfile.gettempdir()) / "safeformer_bench_quick"
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"ratios": ratios, "target": target or {}, "title": title}
    text = "\n".join(lines) + "\n\n<!-- ratios: " + json.dumps(payload) + " -->\n"
    print("\n".join(lines))
    md = out_dir / f"{stem}.md"
    md.write_text(text)
    png = out_dir / f"{stem}.png"
    plot_ratios({title or name: payload}, png)
    print(f"\nwritten to {md} and {png}")
    return md


def read_ratios(md: Path) -> dict | None:
    """The ``{"ratios", "target", "title"}`` payload a results file ends with, or None."""
    for line in md.read_text().splitlines()[::-1]:
        if line.startswith("<!-- ratios: ") and line.endswith(" -->"):
            return json.loads(line[len("<!-- ratios: ") : -len(" -->")])
    return None


def plot_ratios(panels: dict[str, dict], path: Path) -> None:
    """Horizontal bar chart(s) of ratios, one panel per entry; 1.0 and the targets are marked.

    Args:
        panels: panel title -> ``{"ratios": {label: ratio}, "target": {label: ratio}}``.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    heights = [max(1.2, 0.38 * len(p["ratios"]) + 0.9) for p in panels.values()]
    fig, axes = plt.subplots(n, 1, figsize=(8, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (title, p) in zip(axes[:, 0], panels.items()):
        labels = list(p["ratios"])
        values = [p["ratios"][k] for k in labels]
        target = p.get("target") or {}
        colors = []
        for k, v in zip(labels, values):
            t = target.get(k)
            if t is None:
                colors.append("tab:blue")
            elif t >= 1.0 and k.endswith("(higher is better)"):
                colors.append("tab:green" if v >= t else "tab:red")
            else:
                colors.append("tab:green" if v <= t else "tab:red")
        y = range(len(labels))
        ax.barh(list(y), values, color=colors)
        for yi, k in zip(y, labels):
            if k in target:
                ax.plot([target[k], target[k]], [yi - 0.4, yi + 0.4], "k--", lw=1)
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_yticks(list(y))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        for yi, v in zip(y, values):
            ax.text(v, yi, f" {v:.2f}x", va="center", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, max(values + [1.0] + list(target.values())) * 1.25)
    axes[-1, 0].set_xlabel("ratio (safeformer / peer); dashed: target; green: target met")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
