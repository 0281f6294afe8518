#!/usr/bin/env bash
# Steady-state workload timings (benches/gpu/workloads_steady.py), allocators interleaved per
# workload, each run in its own process. Run on the GPU machine:
#
#   bash benches/gpu/steady.sh
#
# Settings (environment): WORKLOADS (default: the four), ALLOCATORS (default
# "native ccalloc native_expandable"; also ccalloc_slack25: ccalloc with page_slack:0.25), PROCESSES per (workload, allocator) (default 1), RUNS
# timed per process after one warm-up run (default 2), OUT (results: $OUT/steady.jsonl,
# $OUT/steady.md, logs in $OUT/steady_logs; default /tmp), RUN_TIMEOUT (s, default 300),
# CCALLOC_LIBRARY (default <repo>/gpu/libccalloc.so), PYTHON, PIN_CPUS (e.g. "2-9": every
# process runs under taskset on those CPUs, so that the scheduler's placement varies less).
# Each round (PROCESSES) runs every allocator's process back to back, in reverse order every
# other round (ABBA), and the summary pairs each round's ccalloc and native medians.

set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-python3}"
export CCALLOC_LIBRARY="${CCALLOC_LIBRARY:-$ROOT/gpu/libccalloc.so}"
export PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF CCALLOC_CONF
OUT_DIR="${OUT:-/tmp}"
WORKLOADS="${WORKLOADS:-gpt2_train_varlen resnet50_train bert_infer_varlen mlp_sidestream}"
ALLOCATORS="${ALLOCATORS:-native ccalloc native_expandable}"
PROCESSES="${PROCESSES:-1}"
RUNS="${RUNS:-2}"
RUN_TIMEOUT="${RUN_TIMEOUT:-300}"
JSONL="$OUT_DIR/steady.jsonl"
LOGS="$OUT_DIR/steady_logs"
mkdir -p "$LOGS"
: >"$JSONL"
start=$SECONDS
PIN=()
[ -n "${PIN_CPUS:-}" ] && PIN=(taskset -c "$PIN_CPUS")
for p in $(seq 1 "$PROCESSES"); do
    order="$ALLOCATORS"
    if [ $((p % 2)) -eq 0 ]; then
        order="$(printf '%s\n' $ALLOCATORS | tac | tr '\n' ' ')"
    fi
    for w in $WORKLOADS; do
        for a in $order; do
            log="$LOGS/$w.$a.p$p.log"
            STEADY_ROUND=$p timeout "$RUN_TIMEOUT" "${PIN[@]}" "$PYTHON" "$ROOT/benches/gpu/workloads_steady.py" run "$w" "$a" "$RUNS" >"$log" 2>&1
            rc=$?
            grep '^STEADY ' "$log" >>"$JSONL"
            printf '[%4ds] %s %-18s %-18s rc=%s %s\n' "$((SECONDS - start))" "$p" "$w" "$a" "$rc" \
                "$(grep -m1 '^STEADY ' "$log" | grep -o '"seconds": \[[^]]*\]' || tail -c 300 "$log")"
        done
    done
done
"$PYTHON" "$ROOT/benches/gpu/workloads_steady.py" summarize "$JSONL" | tee "$OUT_DIR/steady.md"
