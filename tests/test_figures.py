"""The figures the docs quote come from committed results files, and match them.

`benchmarks/results/train_digits.json` is the `metrics.json` of the measured default run of `train.py`
(copied there by hand after the run; a change that moves the results re-measures it in the same commit).
Every decimal figure in the README's section on the main job and in docs/training.md's measured run must
be one the file gives (formatted as the docs write it); the guidance tables, the validation losses, the
condition counts and the run's time are checked row by row. A figure that is not in the file goes.
"""

from __future__ import annotations

import json
import re

import pytest
from test_readme import README, ROOT

RESULTS = ROOT / "benchmarks" / "results" / "train_digits.json"
TRAINING = ROOT / "docs" / "training.md"
CHANCE = {"0.100", "0.333"}  # chance levels the README states beside the table (10 classes, 3 bins)
DECIMAL = r"(?<![\d.])\d\.\d{2,3}(?![\d.]?\d)"  # 0.983, 2.47; not a version such as 2.13.0


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads(RESULTS.read_text())


def section(text: str, start: str, stop: str) -> str:
    i = text.index(start)
    return text[i:text.index(stop, i + len(start))]


def flat(text: str) -> str:
    """``text`` with every run of whitespace one space (a figure may wrap across a line)."""
    return " ".join(text.split())


def by_setting(m: dict) -> dict[str, dict]:
    return {r["setting"]: r for r in m["guidance"]}


def ink(r: dict) -> str:
    return " / ".join(f"{v:.0f}" for v in r["mean_ink"])


def word_figures(m: dict) -> tuple[float, float, str, float]:
    """The plain conditional model's class accuracy by word: canonical, synonyms, the worst word and its."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("train_for_figures", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules["train_for_figures"] = train
    spec.loader.exec_module(train)
    per_word = by_setting(m)["1"]["per_word"]
    first = {words[0] for words in train.WORDS.values()}
    canonical = [a for w, a in per_word.items() if w in first]
    others = [a for w, a in per_word.items() if w not in first]
    worst = min(per_word, key=per_word.get)
    return sum(canonical) / len(canonical), sum(others) / len(others), worst, per_word[worst]


def allowed_decimals(m: dict) -> set[str]:
    """Every decimal figure the results file gives, written as the docs write it."""
    out = set(CHANCE)
    for r in m["guidance"]:
        out |= {f"{r['class_accuracy']:.3f}", f"{r['thickness_accuracy']:.3f}", f"{r['spread']:.2f}"}
        out |= {f"{v:.2f}" for v in r["per_thickness"] if v is not None}
    out |= {f"{m[k]:.3f}" for k in ("val_loss", "val_loss_text_only", "val_loss_thickness_only", "val_loss_uncond",
                                    "final_train_loss")}
    out |= {f"{m['real_spread']:.2f}", f"{100 * m['classifier_val_accuracy']:.1f}"}
    canonical, synonyms, _, worst = word_figures(m)
    out |= {f"{canonical:.3f}", f"{synonyms:.3f}", f"{worst:.2f}"}
    return out


def wall(m: dict) -> str:
    s = round(m["wall_seconds"])
    return f"{s // 60} min {s % 60} s"


def test_results_file_is_a_default_run(metrics):
    """The file is the default configuration's run, finished (not a shortened or resumed one)."""
    assert metrics["steps"] == metrics["config"]["steps"] == 800 and metrics["world_size"] == 1
    assert metrics["config"]["seed"] == 0 and metrics["config"]["dim"] == 128 and not metrics["config"]["resume"]
    assert "resumes" not in metrics["history"] and metrics["skipped_steps"] == []


def test_readme_main_job_figures_match(metrics):
    text = section(README.read_text(), "## The main job", "Two one-task examples")
    m = metrics
    assert f"**{wall(m)} wall**" in text, f"the run's time: {wall(m)}"
    assert f"about {round(m['tokens_per_second'], -2):,.0f} training tokens/s" in text
    assert (f"{m['val_loss']:.3f} with word and thickness, {m['val_loss_text_only']:.3f} word only, "
            f"{m['val_loss_thickness_only']:.3f} thickness only, {m['val_loss_uncond']:.3f} neither") in text
    for setting, r in by_setting(m).items():
        row = f"| {r['class_accuracy']:.3f} | {r['thickness_accuracy']:.3f} | {ink(r)} | {r['spread']:.2f} |"
        assert row in text, f"the README's row for {setting}: {row}"
    real = " / ".join(f"{v:.0f}" for v in m["real_mean_ink"])
    assert f"mean ink {real} per bin" in text
    canonical, synonyms, worst, acc = word_figures(m)
    assert f"canonical words give {canonical:.3f} class accuracy and synonyms {synonyms:.3f} (worst: \"{worst}\", {acc:.2f})" in text
    stale = set(re.findall(DECIMAL, text)) - allowed_decimals(m)
    assert not stale, f"figures in the README's main-job section that the results file does not give: {sorted(stale)}"


def test_training_page_figures_match(metrics):
    m = metrics
    page = TRAINING.read_text()
    text = section(page, "### The measured default run", "![samples per guidance setting]")
    assert f"**{wall(m)} wall**" in text
    assert f"about {round(m['tokens_per_second'], -2):,.0f} training tokens" in text
    for setting, r in by_setting(m).items():
        row = f"| {r['class_accuracy']:.3f} | {r['thickness_accuracy']:.3f} | {ink(r)} | {r['spread']:.2f} |"
        assert row in text, f"docs/training.md's row for {setting}: {row}"
    assert f"Final training loss {m['final_train_loss']:.3f}" in text
    stale = set(re.findall(DECIMAL, text)) - allowed_decimals(m)
    assert not stale, f"figures in docs/training.md's measured run that the results file does not give: {sorted(stale)}"
    # the counts and the printed lines quoted earlier on the page
    c = m["condition_counts"]
    page = flat(page)
    assert flat(f"of {c['samples']:,} training samples, {c['empty_text']:,} had an empty word, {c['text_absent']:,} saw no "
            f"text at all") in page
    assert f"{c['thickness_dropped']:,} had the thickness dropped" in page and f"{c['both_absent']:,} had neither" in page
    every = m["config"]["log_every"]
    first_log = sum(m["history"]["train"][:every]) / every
    assert flat(f"step   {every} | loss {first_log:.4f}") in page
    step, *losses = next(v for v in m["history"]["val"] if v[0] == m["config"]["eval_every"])
    assert flat(f"step   {step} | validation loss {losses[0]:.4f} word + thickness, {losses[1]:.4f} word only, "
            f"{losses[2]:.4f} thickness only, {losses[3]:.4f} neither") in page
    assert flat(f"training samples seen: {c['samples']:,}; empty word {c['empty_text']:,}, no text at the decoder (empty or "
            f"dropped) {c['text_absent']:,}, thickness dropped {c['thickness_dropped']:,}, both absent "
            f"{c['both_absent']:,}") in page


def test_readme_decoding_table_matches_the_generation_results():
    """The README's decoding-speed table is the width-256 rows of benchmarks/results/generation_speed.md."""
    rows = {}
    for line in (ROOT / "benchmarks" / "results" / "generation_speed.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 4 and cells[2] == "256":
            rows[(cells[0], cells[1])] = (cells[3], cells[4])  # (eager / xt, compiled / xt)
    table = section(README.read_text(), "| dim 256 |", "\n\n")
    eager = [c.strip() for c in table.splitlines()[2].strip("|").split("|")][1:]
    compiled = [c.strip() for c in table.splitlines()[3].strip("|").split("|")][1:]
    want = [rows[("plain", "1")], rows[("CFG 2 branches", "1")], rows[("CFG 2 branches", "16")]]
    assert eager == [w[0] for w in want] and compiled == [w[1] for w in want], (eager, compiled, want)


RATIO = re.compile(r"(?<![\w.])\d+\.\d+x(?![\w])")  # 2.49x, 0.950x; not 8x8 or a version
TARGET = re.compile(r"(?:<=|>=|<|>|\btarget|\bgoal)\W{0,3}$", re.IGNORECASE)  # "<= 1.10x", "target 2.5x"
PERFORMANCE = ROOT / "docs" / "performance.md"


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` for every line outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def stale_ratios(text: str, measured: set[str]) -> list[str]:
    """The measured-looking ratio figures of ``text`` (not targets) that no results file gives."""
    return [f"line {n}: {m.group()}" for n, line in prose_lines(text) for m in RATIO.finditer(line)
            if not TARGET.search(line[:m.start()]) and m.group() not in measured]


@pytest.mark.parametrize("page", [PERFORMANCE, README], ids=["docs/performance.md", "README.md"])
def test_ratio_figures_come_from_results_files(page):
    """Every ratio the page quotes as measured (``2.28x``) is written, as such, in a benchmarks/results file."""
    measured = set()
    for f in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
        measured |= set(RATIO.findall(f.read_text()))
    stale = stale_ratios(page.read_text(), measured)
    assert not stale, f"ratios in {page.relative_to(ROOT)} that no benchmarks/results/*.md gives: {stale}"


def test_stale_ratios_sees_targets_and_code():
    measured = {"1.039x"}
    text = "a | 1.039x | <= 1.10x |\nthe 2.5x target; target: 3.0x; goal 2.2x, > 1.5x\n```\n9.99x\n```\nwas 1.305x\n"
    assert stale_ratios(text, measured) == ["line 2: 2.5x", "line 6: 1.305x"]


def test_example_figures_match_their_results_files():
    """The examples' figures in the README and the docs are their committed runs' ``metrics.json``."""
    results = ROOT / "benchmarks" / "results"
    readme = flat(README.read_text())
    training = flat(TRAINING.read_text())
    for task in ("reverse", "copy"):
        m = json.loads((results / f"copy_reverse_{task}.json").read_text())
        assert m["task"] == task and m["steps"] == 1200, f"copy_reverse_{task}.json is not a default run"
        assert f"exact match {m['exact_match']:.3f} on both tasks, empty sources {m['exact_match_empty']:.3f}" in training
        assert f"exact match {m['exact_match']:.3f} in both" in readme
    char = json.loads((results / "char_lm.json").read_text())
    bits = char["val_bits_per_byte"]
    assert f"{bits:.2f} bits per byte after {char['steps']} steps" in readme
    assert f"{bits:.3f} at step {char['steps']}" in training
    mg = json.loads((results / "maskgit_digits.json").read_text())
    examples = (ROOT / "docs" / "examples.md").read_text()
    for scale in ("0.0", "1.0", "3.0"):
        row = f"| {scale[:-2]} | {mg['accuracy'][scale]:.3f} |"
        assert row in examples and f"| {mg['spread'][scale]:.2f} |" in examples, f"docs/examples.md's MaskGIT row {scale}"
