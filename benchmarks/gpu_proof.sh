#!/usr/bin/env bash
# The GPU proof of safeformer in one command: the test suite with its CUDA parametrization, and the
# benchmarks on CUDA. Run from the repository root:
#
#     bash benchmarks/gpu_proof.sh [--part PART[,PART...]] [--quick]
#                                  [--bench NAME,NAME] [--jobs N] [--budget SECONDS]
#
# PART is suite, suite-cuda, suite-rest, bench, masked or all; several may be named, comma-separated
# (`--part masked,suite-cuda,bench`). When the masked matrix and the CUDA suite run in one call, the matrix
# runs in the background beside the suite (neither is timed), and the benchmarks run after both, alone.
# What it does, and what comes back, is in docs/testing.md ("Running the GPU proof"). In short:
#   every part   $OUT/env.txt: nvidia-smi, torch, CUDA, cuDNN, the device, the dtypes and attend backends
#                the suite parametrizes over, and a smoke test of attend on every (dtype, backend);
#   suite        the whole pytest suite, CUDA-parametrized tests first (-k "cuda or real_kernel"), then
#                the rest, each under its own time limit: $OUT/suite.txt (output and a coverage table
#                per dtype and backend), $OUT/junit.xml (both runs);
#   bench        the benchmarks on CUDA (attend_overhead in bfloat16 at sequence 1k-8k), each under its
#                own time limit, continuing past a failure: $OUT/bench_status.txt, $OUT/bench.txt (their
#                output), $OUT/results.md (every table) and $OUT/results.tar.gz (the .md and .png files);
#   masked       benchmarks/masked_rows.py, the masked-row backend matrix (every SDPA backend, attend
#                backend and x-transformers' Attend x dtype x masking case: non-finite values, dead rows,
#                the kernel chosen, host syncs): $OUT/masked_rows.md (with the bench part in the same
#                CUDA call, masked_rows_cuda.md inside results.md and results.tar.gz instead: 8 files);
#   always       $OUT/proof.txt, the summary (also printed last).
# $OUT stays under 8 files, the device tool's limit. Without CUDA the CUDA parts are skipped with a
# message and the CPU-safe checks run instead (environment, smoke test, `pytest --collect-only`, every
# benchmark's --help, masked_rows.py --quick on the CPU); the exit status is 0 when they pass, so CI can run it.
#
# Nothing is installed from the network. x-transformers (for the comparisons) comes from wheels under
# $GPU_PROOF_WHEELS, shared/wheels/ or benchmarks/wheels/ (pip install --no-deps --no-index --target),
# when there are any; without it the tests that need it skip and the benchmarks that need it say so.
#
# Environment: OUT (default: a new temporary folder), PYTHON (default python3), GPU_PROOF_BUDGET (seconds
# for the whole script, default 560: one 10-minute call), GPU_PROOF_NO_CUDA=1 (hide the GPU: the CPU dry
# run), GPU_PROOF_REHEARSE=1 (run the CUDA parts' code on the CPU, to rehearse the script itself),
# GPU_PROOF_SUITE_CUDA_S (the CUDA suite's time limit beside other parts; default 330 s).
# Exit status: 0 everything that ran passed and nothing ran out of time; 1 a failure or a time-out;
# 2 bad arguments.

set -uo pipefail

usage() { sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

PART=all
QUICK=0
BENCH_ONLY=""
JOBS=1
BUDGET=${GPU_PROOF_BUDGET:-560}
while [ $# -gt 0 ]; do
    case "$1" in
        --part) PART=${2:-}; shift 2 || { usage; exit 2; } ;;
        --part=*) PART=${1#--part=}; shift ;;
        --quick) QUICK=1; shift ;;
        --bench) BENCH_ONLY=${2:-}; shift 2 || { usage; exit 2; } ;;
        --bench=*) BENCH_ONLY=${1#--bench=}; shift ;;
        --jobs) JOBS=${2:-}; shift 2 || { usage; exit 2; } ;;
        --jobs=*) JOBS=${1#--jobs=}; shift ;;
        --budget) BUDGET=${2:-}; shift 2 || { usage; exit 2; } ;;
        --budget=*) BUDGET=${1#--budget=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_proof.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
for p in ${PART//,/ }; do
    case "$p" in suite|suite-cuda|suite-rest|bench|masked|all) ;; *) echo "gpu_proof.sh: --part must be suite, suite-cuda, suite-rest, bench, masked or all, or several of them comma-separated (got '$PART')" >&2; exit 2 ;; esac
done
[ -n "${PART//,/}" ] || { echo "gpu_proof.sh: --part is empty" >&2; exit 2; }
case "$JOBS" in ''|*[!0-9]*) echo "gpu_proof.sh: --jobs takes a number" >&2; exit 2 ;; esac
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_proof.sh: --budget takes seconds" >&2; exit 2 ;; esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_proof.XXXXXX")}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_proof_work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export MPLBACKEND=Agg
if [ "${GPU_PROOF_NO_CUDA:-0}" = 1 ]; then export CUDA_VISIBLE_DEVICES=""; fi

PROOF=$OUT/proof.txt
: >"$PROOF"
FAILED=0      # a check failed
INCOMPLETE=0  # something ran out of time or was skipped for lack of it
note() { echo "$*" | tee -a "$PROOF"; }
fail() { FAILED=1; note "FAIL: $*"; }
elapsed() { echo $((SECONDS - START)); }
# the time limit of a step: its own, or what is left of the budget (less a margin); 0 = no time left
limit_for() {
    local want=$1 left=$((BUDGET - (SECONDS - START) - 20))
    if [ "$left" -lt 30 ]; then echo 0; elif [ "$want" -gt "$left" ]; then echo "$left"; else echo "$want"; fi
}
# run "$@" under a time limit of $1 seconds; SIGINT first, so pytest still writes its report
limited() {
    local secs=$1; shift
    if command -v timeout >/dev/null 2>&1; then timeout -s INT -k 30 "$secs" "$@"; else "$@"; fi
}
status_word() { case "$1" in 0) echo ok ;; 124|137) echo "TIMED OUT" ;; *) echo "FAILED (exit $1)" ;; esac; }

note "safeformer GPU proof: --part $PART$([ "$QUICK" = 1 ] && echo ' --quick'), $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET} s, OUT=$OUT"
command -v timeout >/dev/null 2>&1 || note "note: no 'timeout' command here: steps run without time limits"

# ---------------------------------------------------------------------------------------------------
# x-transformers from local wheels (nothing from the network)
# ---------------------------------------------------------------------------------------------------
shopt -s nullglob
WHEELS=()
for d in ${GPU_PROOF_WHEELS:-} shared/wheels benchmarks/wheels; do
    [ -d "$d" ] || continue
    for w in "$d"/*.whl; do  # one copy of each wheel: pip refuses the same requirement twice
        case " ${WHEELS[*]##*/} " in *" ${w##*/} "*) ;; *) WHEELS+=("$w") ;; esac
    done
done
shopt -u nullglob
if [ ${#WHEELS[@]} -gt 0 ]; then
    if "$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --disable-pip-version-check \
            --target "$WORK/site" "${WHEELS[@]}" >"$WORK/pip.txt" 2>&1; then
        export PYTHONPATH="$WORK/site:$PYTHONPATH"
        note "wheels: installed ${#WHEELS[@]} ($(for w in "${WHEELS[@]}"; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ' | sed 's/ $//')) into a private folder on PYTHONPATH"
    else
        note "wheels: pip could not install ${WHEELS[*]}: $(tail -n 3 "$WORK/pip.txt" | tr '\n' ' ')"
    fi
fi
if XT_VERSION=$("$PY" -c 'import os, x_transformers as x, importlib.metadata as m; print(m.version("x-transformers"), "from", os.path.dirname(os.path.dirname(x.__file__)))' 2>/dev/null); then
    HAVE_XT=1
    note "x-transformers: $XT_VERSION"
else
    HAVE_XT=0
    note "x-transformers: not installed (no wheel under shared/wheels/ or benchmarks/wheels/): the tests that need it skip, and so do the benchmarks that compare with it"
fi

# ---------------------------------------------------------------------------------------------------
# environment and a smoke test of attend on every (dtype, backend) the suite parametrizes over
# ---------------------------------------------------------------------------------------------------
{
    echo "== run"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm), $(nproc 2>/dev/null || echo '?') cores"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no git metadata in this copy)')"
    echo "x-transformers: ${XT_VERSION:-not installed}"
    echo
    echo "== nvidia-smi"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi 2>&1
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
    else
        echo "nvidia-smi: not found"
    fi
    echo
} >"$OUT/env.txt" 2>&1
"$PY" - "${GPU_PROOF_REHEARSE:-0}" >>"$OUT/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md
import os
import platform
import sys
import traceback

import torch

sys.path.insert(0, "tests")
print("== python / torch")
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}; CUDA build {torch.version.cuda}; cuDNN "
      f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'not available'}")
print(f"torch.cuda.is_available(): {torch.cuda.is_available()}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {torch.cuda.get_device_name(0)}, compute capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB; {torch.cuda.device_count()} device(s)")
    b = torch.backends.cuda
    print(f"SDPA enabled: flash {b.flash_sdp_enabled()}, efficient {b.mem_efficient_sdp_enabled()}, "
          f"cudnn {b.cudnn_sdp_enabled()}, math {b.math_sdp_enabled()}")
for name in ("einops", "hypothesis", "pytest", "pytest-xdist", "safetensors", "tqdm", "matplotlib", "triton",
             "x-transformers", "einx", "loguru"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
import safeformer as sf  # noqa: E402

print(f"safeformer from {os.path.dirname(sf.__file__)}")
from helpers.contract import DEVICES, backends_for, dtypes_for  # noqa: E402

print("\n== what the suite parametrizes over (tests/helpers/contract.py)")
for dev in DEVICES:
    print(f"{dev}: dtypes {[str(d).removeprefix('torch.') for d in dtypes_for(dev)]}, attend backends {backends_for(dev)}")
try:
    import conftest  # the hypothesis seed the suite draws its examples from

    print(f"hypothesis seed: {conftest.HYPOTHESIS_SEED}")
except Exception as err:  # noqa: BLE001
    print(f"hypothesis seed: unknown ({err})")

print("\n== smoke test: attend with a padding mask and a fully padded sample, forward and backward")
dev = "cuda" if torch.cuda.is_available() else "cpu"
b, h, n, d = (2, 4, 128, 64) if dev == "cuda" else (2, 2, 8, 16)
g = torch.Generator().manual_seed(0)
mask = torch.ones(b, n, dtype=torch.bool)
mask[0, n // 2:] = False
mask[1] = False  # sample 1: every row dead
mask = mask.to(dev)
bad = 0
for dtype in dtypes_for(dev):
    q, k, v, up = (torch.randn(b, h, n, d, generator=g).to(dev, dtype) for _ in range(4))
    ref = sf.attend(q.float(), k.float(), v.float(), mask=mask, backend="reference")
    for backend in backends_for(dev):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        try:
            out = sf.attend(*leaves, mask=mask, backend=backend)
        except ValueError as err:  # a fused kernel may refuse inputs (S9): said, not a failure
            print(f"{dev} {str(dtype).removeprefix('torch.'):8} {backend:9}: refused ({err})")
            continue
        except Exception as err:  # noqa: BLE001  # any other exception breaks S9
            bad += 1
            print(f"{dev} {str(dtype).removeprefix('torch.'):8} {backend:9}: FAIL ({type(err).__name__}: {err})")
            continue
        try:
            out.backward(up)
            finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(t.grad).all()) for t in leaves)
            dead = not bool(out[1].any()) and not any(bool(t.grad[1].any()) for t in leaves)
            diff = (out.float() - ref).abs().max().item()
            ok = finite and dead and diff < (1e-3 if dtype == torch.float32 else 5e-2)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            ok, finite, dead, diff = False, False, False, float("nan")
        bad += not ok
        print(f"{dev} {str(dtype).removeprefix('torch.'):8} {backend:9}: {'ok' if ok else 'FAIL'} "
              f"(finite {finite}, dead rows exactly 0 {dead}, max |out - reference| {diff:.1e})")
print(f"smoke test: {'FAILED' if bad else 'passed'}")
sys.exit(1 if bad else 0)
EOF
rc=$?
[ "$rc" = 0 ] && note "smoke test (import, attend on every dtype and backend): passed" || fail "smoke test (see env.txt), exit $rc"

CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
BENCH_DEVICE=cuda
if [ "${GPU_PROOF_REHEARSE:-0}" = 1 ] && [ "$CUDA" != 1 ]; then
    CUDA=1
    BENCH_DEVICE=cpu
    note "REHEARSAL (GPU_PROOF_REHEARSE=1): the CUDA parts run on the CPU; their numbers mean nothing"
fi
if [ "$CUDA" = 1 ]; then
    note "device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' 2>/dev/null)"
else
    note "CUDA not available (torch.cuda.is_available() is False): the CUDA parts are skipped; running the CPU-safe checks"
fi

WANT_SUITE_CUDA=0; WANT_SUITE_REST=0; WANT_BENCH=0; WANT_MASKED=0
for p in ${PART//,/ }; do
    case "$p" in
        suite) WANT_SUITE_CUDA=1; WANT_SUITE_REST=1 ;;
        suite-cuda) WANT_SUITE_CUDA=1 ;;
        suite-rest) WANT_SUITE_REST=1 ;;
        bench) WANT_BENCH=1 ;;
        masked) WANT_MASKED=1 ;;
        all) WANT_SUITE_CUDA=1; WANT_SUITE_REST=1; WANT_BENCH=1; WANT_MASKED=1 ;;
    esac
done

# ---------------------------------------------------------------------------------------------------
# masked rows: the masked-row backend matrix (benchmarks/masked_rows.py); on the CPU with --quick.
# Beside the CUDA suite it runs in the background (a correctness matrix: nothing in it is timed).
# ---------------------------------------------------------------------------------------------------
MASKED_PID=""
start_masked() {
    MASKED_OUT=$OUT/masked_rows.md
    MASKED_OPTS=(--device cpu --quick)
    local want=120
    if [ "$CUDA" = 1 ]; then
        MASKED_OPTS=(--device "$BENCH_DEVICE")
        want=240
        { [ "$QUICK" = 1 ] || [ "$BENCH_DEVICE" = cpu ]; } && MASKED_OPTS+=(--quick) && want=120
        if [ "$WANT_BENCH" = 1 ]; then  # the bench part's results.md and results.tar.gz carry it (8 files)
            mkdir -p "$WORK/results"
            MASKED_OUT=$WORK/results/masked_rows_$([ "$BENCH_DEVICE" = cpu ] && echo rehearsal || echo cuda).md
        fi
    fi
    MASKED_SECS=$(limit_for "$want")
    if [ "$MASKED_SECS" = 0 ]; then
        INCOMPLETE=1; note "masked rows: skipped, no time left in this call's budget (run --part masked in another call)"
        return 1
    fi
    MASKED_T0=$SECONDS
    limited "$MASKED_SECS" "$PY" benchmarks/masked_rows.py "${MASKED_OPTS[@]}" --out "$MASKED_OUT" >"$WORK/masked.txt" 2>&1 &
    MASKED_PID=$!
}
finish_masked() {
    [ -n "$MASKED_PID" ] || return 0
    wait "$MASKED_PID"
    local rc=$?
    MASKED_PID=""
    local summary
    summary=$(grep '^summary: ' "$WORK/masked.txt" | tail -n 1)
    summary=${summary#summary: }
    summary=${summary%; table in *}
    local where
    where=$(basename "$MASKED_OUT")
    [ "$MASKED_OUT" = "$OUT/masked_rows.md" ] || where="$where, in results.md and results.tar.gz"
    case "$rc" in
        0) note "masked rows (${MASKED_OPTS[*]} -> $where): ok in $((SECONDS - MASKED_T0)) s; $summary" ;;
        124|137) INCOMPLETE=1; fail "masked rows: TIMED OUT after ${MASKED_SECS} s" ;;
        *) fail "masked rows: exit $rc in $((SECONDS - MASKED_T0)) s; ${summary:-no summary: its output ends}"
           [ -n "$summary" ] || tail -n 15 "$WORK/masked.txt" | tee -a "$PROOF" ;;
    esac
}
if [ "$WANT_MASKED" = 1 ]; then
    start_masked
    # alone, or on the CPU (where the suite is only collected), it finishes before the next part starts
    { [ "$CUDA" = 1 ] && [ "$WANT_SUITE_CUDA" = 1 ]; } || finish_masked
fi

# ---------------------------------------------------------------------------------------------------
# suite
# ---------------------------------------------------------------------------------------------------
PYTEST=("$PY" -m pytest -p no:cacheprovider -o junit_family=xunit2 --tb=short -rfE)
if [ "$JOBS" -gt 1 ]; then
    if "$PY" -c 'import xdist' 2>/dev/null; then PYTEST+=(-n "$JOBS"); else note "pytest-xdist not installed: --jobs $JOBS ignored"; fi
fi
# the tests that run on the GPU: CUDA-parametrized ids and the real varlen Flash kernel's tests
CUDA_K="cuda or real_kernel"
SUITE_SUMMARY=()

run_suite() {  # label, default limit, pytest arguments...
    local label=$1 want=$2; shift 2
    local secs; secs=$(limit_for "$want")
    if [ "$secs" = 0 ]; then
        INCOMPLETE=1; note "suite $label: skipped, no time left in this call's budget (run --part suite-$label in another call)"
        SUITE_SUMMARY+=("$label=")
        return
    fi
    echo "== pytest $label (limit ${secs} s): ${PYTEST[*]} --junitxml=... $(printf '%q ' "$@")" | tee -a "$OUT/suite.txt"
    local t0=$SECONDS
    limited "$secs" "${PYTEST[@]}" --junitxml="$WORK/junit_$label.xml" "$@" 2>&1 | tee -a "$OUT/suite.txt"
    local rc=${PIPESTATUS[0]}
    echo | tee -a "$OUT/suite.txt"
    SUITE_SUMMARY+=("$label=$WORK/junit_$label.xml")
    case "$rc" in
        0) note "suite $label: passed in $((SECONDS - t0)) s" ;;
        124|137) INCOMPLETE=1; FAILED=1; note "suite $label: TIMED OUT after ${secs} s (partial report in junit.xml)" ;;
        5) note "suite $label: no tests selected" ;;
        *) fail "suite $label: pytest exit $rc in $((SECONDS - t0)) s (failures in suite.txt)" ;;
    esac
}

if [ $((WANT_SUITE_CUDA + WANT_SUITE_REST)) -gt 0 ]; then
    : >"$OUT/suite.txt"
    if [ "$CUDA" = 1 ]; then
        if [ "$QUICK" = 1 ]; then
            # a smoke of the CUDA tests: S1, S2, S5 on every (dtype, backend), and the real varlen kernel
            [ "$WANT_SUITE_CUDA" = 1 ] && run_suite cuda 240 tests/test_attend.py tests/test_varlen.py \
                -k "($CUDA_K) and (s1_finite or s2_dead_rows or s5_backends_agree or real_kernel_matches)"
            [ "$WANT_SUITE_REST" = 1 ] && note "suite rest: skipped under --quick"
        else
            # both in one call: the CUDA tests get at most 330 s, the rest what is left; alone, all of it
            [ "$WANT_SUITE_CUDA" = 1 ] && run_suite cuda "${GPU_PROOF_SUITE_CUDA_S:-$([ $((WANT_SUITE_REST + WANT_BENCH)) -gt 0 ] && echo 330 || echo 100000)}" -k "$CUDA_K"
            [ "$WANT_SUITE_REST" = 1 ] && run_suite rest 100000 -k "not ($CUDA_K)"
        fi
        CHECK_COVERAGE=0
        [ "$WANT_SUITE_CUDA" = 1 ] && [ "$BENCH_DEVICE" = cuda ] && CHECK_COVERAGE=1
        "$PY" - "$OUT/junit.xml" "$OUT/suite.txt" "$CHECK_COVERAGE" "${SUITE_SUMMARY[@]}" <<'EOF' 2>&1 | tee -a "$PROOF"
"""Merge the runs' JUnit files into $OUT/junit.xml and count the CUDA tests per dtype and attend backend:
the table goes to suite.txt; the totals and the coverage verdict are printed. Exit 3 when a (dtype, backend)
has no passing CUDA test and the CUDA tests ran on a GPU (check = 1)."""
import collections
import re
import sys
import xml.etree.ElementTree as ET

out, report, check, *runs = sys.argv[1:]
root = ET.Element("testsuites")
totals, short, table = {}, [], []
per = collections.defaultdict(collections.Counter)
varlen = collections.Counter()  # the tests of PyTorch's real varlen Flash kernel
skips = collections.Counter()
BACKENDS = ("auto", "reference", "math", "flash", "efficient", "cudnn")
# attend refuses these on CUDA (ValueError, S9): flash and cuDNN take float16 and bfloat16 only
REFUSED = {("float32", "flash"), ("float32", "cudnn")}
PAT = re.compile(r"(?<![\w])cuda-(?:(float32|bfloat16|float16)-)?(" + "|".join(BACKENDS) + r")(?![\w])")
for spec in runs:
    label, _, path = spec.partition("=")
    if not path:
        short.append(f"suite {label}: not run")
        continue
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError) as err:
        short.append(f"suite {label}: no JUnit report ({err})")
        continue
    r = tree.getroot()
    count = totals.setdefault(label, collections.Counter())
    for suite in [r] if r.tag == "testsuite" else list(r):
        suite.set("name", f"safeformer-{label}")
        root.append(suite)
        for case in suite.iter("testcase"):
            status = next((s for s in ("failure", "error", "skipped") if case.find(s) is not None), "passed")
            count[status] += 1
            if status == "skipped":
                skips[(case.find("skipped").get("message") or "")[:110]] += 1
            if "real_kernel" in case.get("name", ""):
                varlen[status] += 1
            m = PAT.search(case.get("name", ""))
            if m:
                per[(m[1] or "(any)", m[2])][status] += 1
ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)
for label, c in totals.items():
    short.append(f"suite {label} (junit): {c['passed']} passed, {c['failure']} failed, {c['error']} errors, "
                 f"{c['skipped']} skipped")
table.append("== CUDA coverage: tests per dtype and attend backend (passed / failed+errors / skipped); "
             "attend refuses float32 on flash and cudnn (ValueError)")
table.append(f"{'dtype':10} " + " ".join(f"{b:>14}" for b in BACKENDS))
missing = []
for dt in ("float32", "bfloat16", "float16", "(any)"):
    cells = []
    for be in BACKENDS:
        c = per.get((dt, be), collections.Counter())
        cells.append(f"{c['passed']}/{c['failure'] + c['error']}/{c['skipped']}")
        if dt != "(any)" and not c["passed"] and (dt, be) not in REFUSED:
            missing.append(f"{dt}-{be}")
    table.append(f"{dt:10} " + " ".join(f"{x:>14}" for x in cells))
if "cuda" not in totals:  # the CUDA tests did not run in this call: nothing to say about their coverage
    missing, table = [], []
elif missing:
    short.append(f"CUDA coverage: no passing test for {', '.join(missing)}")
else:
    short.append("CUDA coverage: every dtype (float32, bfloat16, float16) x backend (auto, reference, math, flash, "
                 "efficient, cudnn) has passing tests, except float32 on flash and cudnn, which attend refuses")
if varlen:
    short.append(f"varlen Flash kernel tests: {varlen['passed']} passed, {varlen['failure'] + varlen['error']} failed, "
                 f"{varlen['skipped']} skipped")
if skips:
    table.append("\n== skip reasons (count)")
    table += [f"{n:5}  {msg}" for msg, n in skips.most_common(12)]
with open(report, "a") as f:
    f.write("\n".join(["== summary of the runs", *short, "", *table]) + "\n")
print("\n".join(short))
sys.exit(3 if check == "1" and missing else 0)
EOF
        rc=${PIPESTATUS[0]}
        [ "$rc" = 0 ] || fail "suite: a CUDA (dtype, backend) has no passing test, or the reports could not be read (exit $rc)"
    else
        {
            echo "CUDA not available: the CUDA suite is skipped (run this script on a GPU machine)."
            echo "== pytest --collect-only (this machine's parametrization)"
        } | tee -a "$OUT/suite.txt"
        t0=$SECONDS
        limited "$(limit_for 300)" "$PY" -m pytest -p no:cacheprovider --collect-only -q >"$WORK/collect.txt" 2>&1
        rc=$?
        cat "$WORK/collect.txt" >>"$OUT/suite.txt"
        n=$(awk -F': ' '/^tests\/.*: [0-9]+$/ {s += $2} END {print s + 0}' "$WORK/collect.txt")
        if [ "$rc" = 0 ] && [ "$n" -gt 0 ]; then
            note "suite: skipped (CUDA not available); pytest --collect-only: $n tests collected in $((SECONDS - t0)) s"
        else
            fail "suite: pytest --collect-only exit $rc, $n tests (see suite.txt)"
        fi
    fi
fi

finish_masked  # the benchmarks run alone on the GPU

# ---------------------------------------------------------------------------------------------------
# benchmarks
# ---------------------------------------------------------------------------------------------------
# name, time limit (s) of a full run, whether it needs x-transformers, its options on CUDA (each takes only
# options its argparse has; only attend_overhead has --dtype: the others run float32)
BENCHES=(
    "host_syncs|120|0|"
    "attend_overhead|120|0|--dtype bfloat16 --lengths 1024 2048 4096 8192"
    "generation_speed|200|1|--dims 512 --rounds 3"
    "unpadded|120|1|"
    "train_step|120|1|"
    "memory|100|1|--seq 8192"
    "compile_speed|150|0|--seq 1024"
)
QUICK_OPTS_attend_overhead="--dtype bfloat16"

if [ "$WANT_BENCH" = 1 ]; then
    : >"$OUT/bench.txt"
    : >"$OUT/bench_status.txt"
    if [ "$CUDA" = 1 ]; then
        RESULTS=$WORK/results
        mkdir -p "$RESULTS"
        TAG=_cuda
        [ "$QUICK" = 1 ] && TAG=_cuda_quick
        [ "$BENCH_DEVICE" = cpu ] && TAG=_rehearsal
        for spec in "${BENCHES[@]}"; do
            IFS='|' read -r name want needs_xt opts <<<"$spec"
            if [ -n "$BENCH_ONLY" ] && [[ ",$BENCH_ONLY," != *",$name,"* ]]; then continue; fi
            if [ "$needs_xt" = 1 ] && [ "$HAVE_XT" = 0 ]; then
                echo "$name: skipped (compares with x-transformers, which is not installed: carry its wheel)" | tee -a "$OUT/bench_status.txt"
                continue
            fi
            if [ "$QUICK" = 1 ]; then
                want=90
                var="QUICK_OPTS_$name"
                opts="--quick ${!var:-}"
            fi
            secs=$(limit_for "$want")
            if [ "$secs" = 0 ]; then
                INCOMPLETE=1
                echo "$name: skipped, no time left in this call's budget (run --part bench --bench $name in another call)" | tee -a "$OUT/bench_status.txt"
                continue
            fi
            # shellcheck disable=SC2086  # opts is a list of options
            cmd=("$PY" "benchmarks/$name.py" --device "$BENCH_DEVICE" --tag "$TAG" --out-dir "$RESULTS" $opts)
            echo "== ${cmd[*]} (limit ${secs} s)" >>"$OUT/bench.txt"
            t0=$SECONDS
            limited "$secs" "${cmd[@]}" >>"$OUT/bench.txt" 2>&1
            rc=$?
            echo "[exit $rc after $((SECONDS - t0)) s]" >>"$OUT/bench.txt"
            echo "$name: $(status_word "$rc") in $((SECONDS - t0)) s (limit ${secs} s): ${cmd[*]:1}" | tee -a "$OUT/bench_status.txt"
            case "$rc" in 0) ;; 124|137) INCOMPLETE=1; FAILED=1 ;; *) FAILED=1 ;; esac
        done
        cat "$OUT/bench_status.txt" >>"$PROOF"
        shopt -s nullglob
        mds=("$RESULTS"/*.md)
        shopt -u nullglob
        if [ ${#mds[@]} -gt 0 ]; then
            "$PY" benchmarks/plot_ratios.py --results "$RESULTS" --tag "$TAG" >>"$OUT/bench.txt" 2>&1
            for md in "${mds[@]}"; do printf '<!-- file: benchmarks/results/%s -->\n\n' "$(basename "$md")"; cat "$md"; echo; done >"$OUT/results.md"
            tar -czf "$OUT/results.tar.gz" -C "$RESULTS" .
            note "results: $(cd "$RESULTS" && ls | tr '\n' ' ')-> results.tar.gz, tables in results.md"
        else
            note "results: none written"
        fi
    else
        echo "CUDA not available: the benchmarks are skipped; checking that each script parses its options (--help)" | tee -a "$OUT/bench_status.txt"
        "$PY" - "$OUT/bench_status.txt" >>"$OUT/bench.txt" 2>&1 <<'EOF'
"""Each benchmark's --help in one process (one import of torch): its argparse builds and prints."""
import contextlib
import io
import pathlib
import runpy
import sys

status = open(sys.argv[1], "a")
bad = 0
sys.path.insert(0, "benchmarks")
for path in sorted(pathlib.Path("benchmarks").glob("*.py")):
    if path.name == "common.py":
        continue
    buf = io.StringIO()
    sys.argv = [str(path), "--help"]
    code = "no exit"
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    except Exception as e:  # noqa: BLE001
        code = f"{type(e).__name__}: {e}"
    ok = code == 0 and "usage:" in buf.getvalue()
    bad += not ok
    print(f"== {path} --help\n{buf.getvalue()}")
    print(f"{path.stem}: --help {'ok' if ok else 'FAILED (' + str(code) + ')'}", file=status)
sys.exit(1 if bad else 0)
EOF
        rc=$?
        cat "$OUT/bench_status.txt" >>"$PROOF"
        [ "$rc" = 0 ] && note "bench: skipped (CUDA not available); every benchmark's --help: ok" || fail "bench: a benchmark's --help failed (see bench_status.txt)"
    fi
fi

# ---------------------------------------------------------------------------------------------------
if [ "$FAILED" = 0 ] && [ "$INCOMPLETE" = 0 ]; then verdict="PASS"; else verdict="NOT PASSED"; fi
[ "$INCOMPLETE" = 1 ] && verdict="$verdict (incomplete: ran out of time; see above)"
note "overall: $verdict after $(elapsed) s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
echo
echo "======== proof.txt"
cat "$PROOF"
[ "$FAILED" = 0 ] && [ "$INCOMPLETE" = 0 ]
