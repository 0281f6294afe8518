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
#   OUT          $OUT/ab.jsonl (one record a run, run.py's with the build's folder as "lib")
#                and $OUT/ab.md (the table); default /tmp/ab
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
: >"$JSONL"
started=$SECONDS
for round in $(seq 1 "$ROUNDS"); do
    for w in $WORKLOADS; do
        order=("$A" "$B")
        [ $((round % 2)) = 0 ] && order=("$B" "$A")
        for lib in "${order[@]}"; do
            line="$(CCALLOC_LIBRARY="$(cd "$lib" && pwd)/libccalloc.so" CORPUS_ROUND="$round" \
                timeout "$RUN_TIMEOUT" "${PIN[@]}" "$PYTHON" "$HERE/run.py" "$w" ccalloc --reps "$REPS" \
                2>"$OUT_DIR/last_stderr.txt" | grep '^CORPUS ' | tail -1)"
            # A process that printed no record (a crash, a timeout, a refusal) gets one with
            # its last line of stderr as the error.
            "$PYTHON" - "$lib" "$round" "$w" "${line#CORPUS }" "$OUT_DIR/last_stderr.txt" >>"$JSONL" <<'PY'
import json, sys
lib, rnd, workload, line, stderr = sys.argv[1:6]
if line:
    record = json.loads(line)
else:
    with open(stderr, errors="replace") as f:
        last = ([l.strip() for l in f if l.strip()] or ["no output"])[-1]
    record = {"workload": workload, "allocator": "ccalloc", "loop_seconds": [],
              "error": f"no record (crash or timeout): {last[:200]}"}
record.update(lib=lib, round=int(rnd))
print(json.dumps(record))
PY
            echo "[$((SECONDS - started))s] r$round $w $lib"
        done
    done
done
"$PYTHON" "$HERE/ab_table.py" "$A" "$B" "$JSONL" | tee "$OUT_DIR/ab.md"
