#!/usr/bin/env bash
# C++-level alloc/free hot-path timings (shared/bench/hotpath.py + hotpath.cpp) for PyTorch
# native, PyTorch's cudaMallocAsync backend, raw cudaMallocAsync and ccalloc (through its
# CUDAPluggableAllocator functions, dlopen'd by the harness), each kind in its own process,
# REPEATS times (summarize.py keeps the best figure per metric). Run on the GPU machine:
#
#   bash benches/gpu/hotpath.sh
#
# Settings (environment):
#   CCALLOC_LIBRARY       the library (default <repo>/gpu/libccalloc.so)
#   CCALLOC_SHARED        the shared folder holding bench/hotpath.py (default <repo>/../shared;
#                         falls back to <repo>/gpu/shared_bench); CCALLOC_BENCH names the
#                         bench folder itself
#   OUT                   $OUT/hotpath.jsonl, $OUT/hotpath.md, logs in $OUT/hotpath_logs/
#                         (default OUT=/tmp)
#   KINDS                 default "native native_async cudamallocasync ccalloc
#                         ccalloc@thread_shards:False floor"; also native_expandable,
#                         cudamalloc (slow), ccalloc@CONF: ccalloc
#                         with CCALLOC_CONF=CONF (e.g. ccalloc@per_stream_shards:True),
#                         lib@FOLDER: ccalloc from FOLDER/libccalloc.so (another build, timed
#                         in the same call: KINDS="floor lib@gpu/base ccalloc"),
#                         lib@FOLDER@CONF: that build with CCALLOC_CONF=CONF, and
#                         floor: the harness's own cost per step (floor_alloc.c, built with
#                         cc; an allocator's share is its figure minus the floor's)
#   REPEATS               runs per kind, default 3
#   PIN_CPUS              a taskset CPU list (e.g. 2-9): every run's process is bound to those
#                         CPUs (give mt8 eight), so that which core a one-thread column lands
#                         on does not move its figure from process to process; unset: not bound
#   TORCH_EXTENSIONS_DIR  where the harness is built (default /tmp/ccalloc_torch_extensions);
#                         the first run compiles it (~1 min, needs ninja), later runs reuse it
#   RUN_TIMEOUT           seconds per run (default 600: the first one compiles)
#   PYTHON                default python3

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-python3}"
export CCALLOC_LIBRARY="${CCALLOC_LIBRARY:-$ROOT/gpu/libccalloc.so}"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ccalloc_torch_extensions}"
unset PYTORCH_CUDA_ALLOC_CONF CCALLOC_BACKEND CCALLOC_CONF

. "$ROOT/benches/gpu/find_bench.sh"
BENCH="$(find_bench hotpath.py hotpath.cpp)" || { echo "hotpath.sh: hotpath.py/hotpath.cpp not found (set CCALLOC_SHARED or CCALLOC_BENCH)" >&2; exit 2; }

OUT_DIR="${OUT:-/tmp}"
JSONL="$OUT_DIR/hotpath.jsonl"
LOG_DIR="$OUT_DIR/hotpath_logs"
REPEATS="${REPEATS:-3}"
KINDS="${KINDS:-native native_async cudamallocasync ccalloc ccalloc@thread_shards:False floor}"
RUN_TIMEOUT="${RUN_TIMEOUT:-600}"
SUMMARIZE="$ROOT/benches/gpu/summarize.py"

mkdir -p "$LOG_DIR" "$TORCH_EXTENSIONS_DIR"
: >"$JSONL"
if [ ! -f "$CCALLOC_LIBRARY" ]; then
    echo "hotpath.sh: warning: $CCALLOC_LIBRARY does not exist (ccalloc runs will fail)" >&2
fi
echo "bench: $BENCH"
echo "library: $CCALLOC_LIBRARY"
echo "extensions: $TORCH_EXTENSIONS_DIR"
echo "results: $JSONL  logs: $LOG_DIR"
echo "pinned to CPUs: ${PIN_CPUS:-not pinned}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'

start_all=$SECONDS
for rep in $(seq 1 "$REPEATS"); do
    for k in $KINDS; do
        log="$LOG_DIR/${k//[^A-Za-z0-9._-]/_}.rep$rep.log"
        case "$k" in
            ccalloc) cmd=("$PYTHON" "$BENCH/hotpath.py" so "$CCALLOC_LIBRARY" ccalloc_torch_alloc ccalloc_torch_free) ;;
            floor)
                floor_so="$OUT_DIR/floor_alloc.so"
                [ -f "$floor_so" ] || cc -O2 -shared -fPIC -o "$floor_so" "$ROOT/benches/gpu/floor_alloc.c"
                cmd=("$PYTHON" "$BENCH/hotpath.py" so "$floor_so" floor_alloc floor_free) ;;
            lib@*@*) lib_dir="${k#lib@}"; lib_dir="${lib_dir%%@*}"
                cmd=(env CCALLOC_CONF="${k#lib@*@}" "$PYTHON" "$BENCH/hotpath.py" so "$(cd "$lib_dir" && pwd)/libccalloc.so" ccalloc_torch_alloc ccalloc_torch_free) ;;
            lib@*) cmd=("$PYTHON" "$BENCH/hotpath.py" so "$(cd "${k#lib@}" && pwd)/libccalloc.so" ccalloc_torch_alloc ccalloc_torch_free) ;;
            ccalloc@*) cmd=(env CCALLOC_CONF="${k#ccalloc@}" "$PYTHON" "$BENCH/hotpath.py" so "$CCALLOC_LIBRARY" ccalloc_torch_alloc ccalloc_torch_free) ;;
            *) cmd=("$PYTHON" "$BENCH/hotpath.py" "$k") ;;
        esac
        pin=()
        [ -n "${PIN_CPUS:-}" ] && pin=(taskset -c "$PIN_CPUS")
        t0=$SECONDS
        timeout "$RUN_TIMEOUT" "${pin[@]}" "${cmd[@]}" >"$log" 2>&1
        rc=$?
        "$PYTHON" "$SUMMARIZE" collect --kind hotpath --label "$k" --rep "$rep" --rc "$rc" \
            --prefix RESULT --log "$log" >>"$JSONL"
        line="$(grep -m1 '^RESULT ' "$log" | cut -c1-160)"
        printf '[%4ds] rep %s %-16s rc=%s %3ds  %s\n' "$((SECONDS - start_all))" "$rep" "$k" "$rc" \
            "$((SECONDS - t0))" "${line:-"(no result; see $log)"}"
    done
done
echo "all runs: $((SECONDS - start_all))s"
echo
"$PYTHON" "$SUMMARIZE" hotpath "$JSONL" | tee "$OUT_DIR/hotpath.md"
