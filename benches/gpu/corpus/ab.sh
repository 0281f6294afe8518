#!/usr/bin/env bash
# Two builds of libccalloc on corpus workloads, in paired rounds: each round runs every
# workload under A and B back to back, A first in odd rounds and B first in even ones, so that
# neither always runs first. Then a table: per workload, each build's reserved / requested
# per run, and B's loop time against A's (median over rounds of the per-round ratio).
# Run on the GPU machine from the repository root:
#
#   A=gpu/base B=gpu/trial WORKLOADS="moe_train unet_diffusion_train" bash benches/gpu/corpus/ab.sh
#
# Settings (environment):
#   A, B         folders holding libccalloc.so (built here in release mode and carried over)
#   WORKLOADS    names as run.py --list gives them (required)
#   ROUNDS       default 2;  REPS  timed loops per process after a warm-up loop, default 3
#   PIN_CPUS     a taskset CPU list every process is bound to (default 2-3; empty: unbound)
#   RUN_TIMEOUT  seconds per process (default 150)
#   CONF         CCALLOC_CONF for both builds' runs (default none), e.g. record_peak_breakdown:True
#                to have each record's "peak_breakdown"
#   OUT          $OUT/ab.jsonl (one record a run, run.py's with the build's folder as "lib")
#                and $OUT/ab.md (the table); $OUT/last_run.log, the last process's output;
#                default /tmp/ab
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
cd "$ROOT" || exit 2
# shellcheck source-path=SCRIPTDIR source=../find_bench.sh
. "$ROOT/benches/gpu/find_bench.sh"
PYTHON="${PYTHON:-python3}"
: "${A:?A=folder of the first libccalloc.so}" "${B:?B=folder of the second libccalloc.so}"
: "${WORKLOADS:?WORKLOADS=names of corpus workloads}"
ROUNDS="${ROUNDS:-2}"
REPS="${REPS:-3}"
PIN_CPUS="${PIN_CPUS-2-3}"
RUN_TIMEOUT="${RUN_TIMEOUT:-150}"
OUT_DIR="${OUT:-/tmp/ab}"
mkdir -p "$OUT_DIR"
for lib in "$A" "$B"; do
    [ -f "$lib/libccalloc.so" ] || { echo "ab.sh: no $lib/libccalloc.so" >&2; exit 2; }
done
export CCALLOC_BENCH="${CCALLOC_BENCH:-$(find_bench workloads.py || echo "$ROOT/shared/bench")}"
export PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF CCALLOC_CONF
PIN=()
[ -n "$PIN_CPUS" ] && PIN=(taskset -c "$PIN_CPUS")
JSONL="$OUT_DIR/ab.jsonl"
LOG="$OUT_DIR/last_run.log"
: >"$JSONL"

# ccalloc.torch compiles its PyTorch adapter on first use (~20 s, cached per library path:
# its cache key holds the path): once per build, untimed. Built for A alone, B's first run
# paid the compilation (session 28: 41-44 s against 19-24 s a process).
for lib in "$A" "$B"; do
    CCALLOC_LIBRARY="$(cd "$lib" && pwd)/libccalloc.so" timeout 300 "$PYTHON" "$HERE/prebuild.py" >"$LOG" 2>&1 ||
        echo "[prep] adapter build for $lib failed: $(tail -n 1 "$LOG")"
done

# One process of workload $1 on the build in folder $2, round $3: its record, with the
# build's folder as "lib", appended to $JSONL; a process that printed no readable record (a
# crash, a timeout, a refusal) gets one whose error says why.
run_one() {
    local w=$1 lib=$2 round=$3 rc
    CCALLOC_LIBRARY="$(cd "$lib" && pwd)/libccalloc.so" CORPUS_ROUND="$round" \
        timeout -k 10 "$RUN_TIMEOUT" ${PIN[@]+"${PIN[@]}"} \
        "$PYTHON" "$HERE/run.py" "$w" "ccalloc${CONF:+@$CONF}" --reps "$REPS" >"$LOG" 2>&1
    rc=$?
    "$PYTHON" - "$lib" "$round" "$w" "$rc" "$RUN_TIMEOUT" "$LOG" >>"$JSONL" <<'PY'
import json, sys
lib, rnd, workload, rc, limit, log = sys.argv[1:7]
with open(log, errors="replace") as f:
    lines = [l.rstrip("\n") for l in f]
records = [l[len("CORPUS "):] for l in lines if l.startswith("CORPUS ")]
record = None
if records:
    try:
        record = json.loads(records[-1])
    except ValueError as e:
        why = f"unreadable record ({e})"
elif rc in ("124", "137"):
    why = f"timed out after {limit} s (rc={rc})"
else:
    last = [l.strip() for l in lines if l.strip()] or ["no output"]
    why = f"no record (rc={rc}): {last[-1][:200]}"
if record is None:
    record = {"workload": workload, "allocator": "ccalloc", "loop_seconds": [], "error": why}
record.update(lib=lib, round=int(rnd))
print(json.dumps(record))
PY
}

started=$SECONDS
for round in $(seq 1 "$ROUNDS"); do
    for w in $WORKLOADS; do
        order=("$A" "$B")
        [ $((round % 2)) = 0 ] && order=("$B" "$A")
        for lib in "${order[@]}"; do
            run_one "$w" "$lib" "$round"
            echo "[$((SECONDS - started))s] r$round $w $lib $(tail -n 1 "$JSONL" | grep -o '"error": "[^"]\{0,120\}')"
        done
    done
done
"$PYTHON" "$HERE/ab_table.py" "$A" "$B" "$JSONL" | tee "$OUT_DIR/ab.md"
