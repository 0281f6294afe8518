#!/usr/bin/env bash
# The four shared real workloads (shared/bench/workloads.py) under PyTorch native, PyTorch
# expandable_segments and ccalloc, each run in its own process, REPEATS times (min seconds
# kept by summarize.py). Run on the GPU machine from anywhere:
#
#   bash benches/gpu/workloads.sh
#
# Settings (environment):
#   CCALLOC_LIBRARY  the library (default <repo>/gpu/libccalloc.so)
#   CCALLOC_SHARED   the shared folder holding bench/workloads.py (default <repo>/../shared;
#                    falls back to <repo>/gpu/shared_bench); CCALLOC_BENCH names the bench
#                    folder itself
#   OUT              results go to $OUT/workloads.jsonl, $OUT/workloads.md, logs in
#                    $OUT/workloads_logs/ (default OUT=/tmp)
#   REPEATS          runs per (allocator, workload), default 2
#   WORKLOADS        default "gpt2_train_varlen resnet50_train bert_infer_varlen mlp_sidestream"
#   ALLOCATORS       default "native native_expandable ccalloc"; add ccalloc_so for ccalloc
#                    through workloads.py's own so: mode (no ccalloc stats; a cross-check)
#   RUN_TIMEOUT      seconds per run (default 300)
#   PYTHON           default python3
#
# ccalloc rows run benches/gpu/run_workload_ccalloc.py (ccalloc.torch.enable(), then
# workloads.py in-process in its "native" mode, then ccalloc's own statistics).
# Order: repeat-major, allocators interleaved per workload, so drift hits all alike.

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-python3}"
export CCALLOC_LIBRARY="${CCALLOC_LIBRARY:-$ROOT/gpu/libccalloc.so}"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CCALLOC_BACKEND=cuda
unset PYTORCH_CUDA_ALLOC_CONF

. "$ROOT/benches/gpu/find_bench.sh"
BENCH="$(find_bench workloads.py)" || { echo "workloads.sh: workloads.py not found (set CCALLOC_SHARED or CCALLOC_BENCH)" >&2; exit 2; }
export CCALLOC_BENCH="$BENCH"  # run_workload_ccalloc.py uses the same copy

OUT_DIR="${OUT:-/tmp}"
JSONL="$OUT_DIR/workloads.jsonl"
LOG_DIR="$OUT_DIR/workloads_logs"
REPEATS="${REPEATS:-2}"
WORKLOADS="${WORKLOADS:-gpt2_train_varlen resnet50_train bert_infer_varlen mlp_sidestream}"
ALLOCATORS="${ALLOCATORS:-native native_expandable ccalloc}"
RUN_TIMEOUT="${RUN_TIMEOUT:-300}"
SUMMARIZE="$ROOT/benches/gpu/summarize.py"

mkdir -p "$LOG_DIR"
: >"$JSONL"
if [ ! -f "$CCALLOC_LIBRARY" ]; then
    echo "workloads.sh: warning: $CCALLOC_LIBRARY does not exist (ccalloc runs will fail)" >&2
fi
echo "bench: $BENCH"
echo "library: $CCALLOC_LIBRARY"
echo "results: $JSONL  logs: $LOG_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'

start_all=$SECONDS
for rep in $(seq 1 "$REPEATS"); do
    for w in $WORKLOADS; do
        for a in $ALLOCATORS; do
            log="$LOG_DIR/$w.$a.rep$rep.log"
            prefix=RESULT
            case "$a" in
                native|native_expandable|native_async)
                    cmd=("$PYTHON" "$BENCH/workloads.py" "$w" "$a" "$LOG_DIR") ;;
                ccalloc)
                    cmd=("$PYTHON" "$ROOT/benches/gpu/run_workload_ccalloc.py" "$w" "$LOG_DIR"); prefix=CCALLOC ;;
                ccalloc_so)
                    cmd=("$PYTHON" "$BENCH/workloads.py" "$w" "so:$CCALLOC_LIBRARY:ccalloc_torch_alloc:ccalloc_torch_free" "$LOG_DIR") ;;
                *)
                    echo "unknown allocator '$a'" >&2; continue ;;
            esac
            t0=$SECONDS
            timeout "$RUN_TIMEOUT" "${cmd[@]}" >"$log" 2>&1
            rc=$?
            "$PYTHON" "$SUMMARIZE" collect --kind workloads --label "$a" --rep "$rep" --rc "$rc" \
                --prefix "$prefix" --log "$log" --workload "$w" >>"$JSONL"
            line="$(grep -m1 "^$prefix " "$log" | cut -c1-160)"
            printf '[%4ds] rep %s %-18s %-18s rc=%s %3ds  %s\n' "$((SECONDS - start_all))" "$rep" "$w" "$a" "$rc" \
                "$((SECONDS - t0))" "${line:-"(no result; see $log)"}"
        done
    done
done
echo "all runs: $((SECONDS - start_all))s"
echo
"$PYTHON" "$SUMMARIZE" workloads "$JSONL" | tee "$OUT_DIR/workloads.md"
