#!/usr/bin/env bash
# GPU checks of a prebuilt libccalloc, run from the repository root on a machine with an NVIDIA
# GPU, nvcc and compute-sanitizer (no Rust needed):
#
#   gpu/libccalloc.so    the library, built elsewhere (`cargo build --release`), CUDA backend
#   include/ccalloc.h    its header
#   gpu/ccalloc          optional: the replay command (`cargo build --release --features replay`),
#                        which the PyTorch snapshot check runs on PyTorch's own snapshot
#   gpu/soak             optional: examples/soak.rs (`cargo build --release --features sim
#                        --example soak`)
#
#   bash scripts/gpu_check.sh                 # every step
#   bash scripts/gpu_check.sh gpu_test sim_c  # only these steps (names as in the table)
#
# Steps: environment, build_gpu_test, gpu_test (paged segments, the default), gpu_test_plain
# (CCALLOC_CONF=expandable_segments:False), gpu_test_shards (per_stream_shards:True),
# sanitizer (memcheck), racecheck, soak (examples/soak.rs under memcheck), header_c (ccalloc.h with
# cuda_runtime.h from C and C++, and a runtime-API smoke run), sim_c and sim_c_plain
# (tests/c/test_api.c on the sim backend against the same library), torch_checks and
# python_gpu (PyTorch), bench_pinned, bench_locks, bench_workloads, bench_hotpath,
# bench_torch_empty, bench_steady, bench_long_run and vmm_cost (benchmarks).
#
# Logs go to $LOG_DIR (default ${OUT:-/tmp}/gpu_check): one <NN>_<step>.log per step and
# summary.txt, the table printed at the end; with LOG_LAYOUT=combined, all_steps.log (every
# step's log, in order) and summary.txt only (where few files may come back). Build outputs
# go to $BUILD_DIR (default /tmp/ccalloc_gpu_build). Other settings: GPU_ARCH (default sm_90), NVCC, CC, CXX,
# CUDA_HOME (default: from nvcc's location), SANITIZER (default compute-sanitizer), and time
# limits in seconds GPU_TEST_TIMEOUT (900), SANITIZER_TIMEOUT (1800), SIM_TEST_TIMEOUT (300).
#
# Each step is a function step_<name> registered with `add_step <name> "<description>"`. It
# runs in a subshell with its output in its log; it returns 0 (PASS), 1 (FAIL) or 2 (SKIP: a
# tool or an earlier step it needs is missing), and may write one line of key numbers with
# `info "..."`. A failing step does not stop the others; the script exits 1 if any step failed.
# To add a step (PyTorch tests, benchmarks), write its function and add_step it at the end of
# the list below; `needs <step>...` at its start skips it when a step it builds on did not pass.

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

LIB_DIR="$ROOT/gpu"
LIB="$LIB_DIR/libccalloc.so"
LOG_DIR="${LOG_DIR:-${OUT:-/tmp}/gpu_check}"
BUILD_DIR="${BUILD_DIR:-/tmp/ccalloc_gpu_build}"
GPU_ARCH="${GPU_ARCH:-sm_90}"
NVCC="${NVCC:-nvcc}"
CC="${CC:-gcc}"
CXX="${CXX:-g++}"
SANITIZER="${SANITIZER:-compute-sanitizer}"
GPU_TEST_TIMEOUT="${GPU_TEST_TIMEOUT:-900}"
SANITIZER_TIMEOUT="${SANITIZER_TIMEOUT:-1800}"
SIM_TEST_TIMEOUT="${SIM_TEST_TIMEOUT:-300}"
if [ -z "${CUDA_HOME:-}" ]; then
    if command -v "$NVCC" >/dev/null 2>&1; then
        CUDA_HOME="$(cd "$(dirname "$(command -v "$NVCC")")/.." && pwd)"
    else
        CUDA_HOME=/usr/local/cuda
    fi
fi
LOG_LAYOUT="${LOG_LAYOUT:-files}"
STEP_LOG_DIR="$LOG_DIR"
[ "$LOG_LAYOUT" = combined ] && STEP_LOG_DIR="$BUILD_DIR/logs"
mkdir -p "$LOG_DIR" "$BUILD_DIR" "$STEP_LOG_DIR"
# logs of an earlier run
rm -f "$LOG_DIR"/[0-9][0-9]_*.log "$STEP_LOG_DIR"/[0-9][0-9]_*.log "$LOG_DIR/summary.txt" "$LOG_DIR/all_steps.log"

# --------------------------------------------------------------------------------------------
# Step machinery

STEP_NAMES=()
STEP_DESCS=()
declare -A STEP_STATUS=()
declare -A STEP_INFO=()
declare -A STEP_SECONDS=()
CURRENT_INFO_FILE=""

add_step() { STEP_NAMES+=("$1"); STEP_DESCS+=("$2"); }

# One line of key numbers for the summary table (call inside a step).
info() { printf '%s' "$*" >"$CURRENT_INFO_FILE"; }

# Skips the calling step (return 2) unless every named step passed.
needs() {
    local dep
    for dep in "$@"; do
        if [ "${STEP_STATUS[$dep]:-}" != PASS ]; then
            echo "skipped: needs step '$dep', which is ${STEP_STATUS[$dep]:-not run}"
            info "needs $dep (${STEP_STATUS[$dep]:-not run})"
            return 2
        fi
    done
    return 0
}

# Fails unless the library and header are where this script expects them.
need_library() {
    if [ ! -f "$LIB" ]; then
        echo "missing $LIB: build it elsewhere (cargo build --release) and copy it there"
        info "no gpu/libccalloc.so"
        return 1
    fi
    if [ ! -f "$ROOT/include/ccalloc.h" ]; then
        echo "missing include/ccalloc.h"
        info "no include/ccalloc.h"
        return 1
    fi
}

need_tool() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "skipped: $1 not found on PATH"
        info "$1 not found"
        return 2
    fi
}

# "N passed, M failed" from a test log, as "N M" (empty if absent).
test_counts() {
    sed -n 's/^\([0-9][0-9]*\) passed, \([0-9][0-9]*\) failed$/\1 \2/p' "$1" | tail -n 1
}

# Runs a test program's log check: a summary line with 0 failed and exit status 0.
judge_test() { # judge_test <exit status> <log> <label>
    local rc=$1 log=$2 label=$3 counts passed failed
    counts="$(test_counts "$log")"
    if [ -z "$counts" ]; then
        info "$label: no summary line (exit $rc)"
        return 1
    fi
    read -r passed failed <<<"$counts"
    info "$label: $passed passed, $failed failed, exit $rc"
    [ "$rc" -eq 0 ] && [ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
}

run_steps() {
    local selected=("$@") i name desc log rc start n=0
    for i in "${!STEP_NAMES[@]}"; do
        name="${STEP_NAMES[$i]}"
        desc="${STEP_DESCS[$i]}"
        if [ ${#selected[@]} -gt 0 ] && ! printf '%s\n' "${selected[@]}" | grep -qx "$name"; then
            continue
        fi
        n=$((n + 1))
        log="$STEP_LOG_DIR/$(printf '%02d' "$n")_$name.log"
        CURRENT_INFO_FILE="$BUILD_DIR/.info_$name"
        : >"$CURRENT_INFO_FILE"
        echo "---- [$n] $name: $desc (log: $log)"
        start=$SECONDS
        (
            set -o pipefail
            echo "# step $name: $desc"
            echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC') in $ROOT"
            "step_$name"
        ) >"$log" 2>&1
        rc=$?
        STEP_SECONDS[$name]=$((SECONDS - start))
        case $rc in
            0) STEP_STATUS[$name]=PASS ;;
            2) STEP_STATUS[$name]=SKIP ;;
            *) STEP_STATUS[$name]=FAIL ;;
        esac
        STEP_INFO[$name]="$(cat "$CURRENT_INFO_FILE" 2>/dev/null)"
        echo "     ${STEP_STATUS[$name]} (${STEP_SECONDS[$name]} s) ${STEP_INFO[$name]}"
        if [ "${STEP_STATUS[$name]}" = FAIL ]; then
            echo "     last lines of $log:"
            grep -E '^FAIL|rror' "$log" | head -n 15 | sed 's/^/       /'
            tail -n 5 "$log" | sed 's/^/     | /'
        fi
    done
}

print_summary() {
    local name failed=0 line
    for name in "${STEP_NAMES[@]}"; do
        [ "${STEP_STATUS[$name]:-}" = FAIL ] && failed=$((failed + 1))
    done
    {
        echo
        echo "GPU check summary ($(date -u '+%Y-%m-%d %H:%M:%S UTC'), logs in $LOG_DIR)"
        printf '%-16s %-6s %6s  %s\n' STEP STATUS SECONDS "KEY NUMBERS"
        printf '%-16s %-6s %6s  %s\n' ---- ------ ------- -----------
        for name in "${STEP_NAMES[@]}"; do
            [ -n "${STEP_STATUS[$name]:-}" ] || continue
            printf '%-16s %-6s %6s  %s\n' "$name" "${STEP_STATUS[$name]}" "${STEP_SECONDS[$name]}" \
                "${STEP_INFO[$name]}"
        done
        if [ $failed -eq 0 ]; then line="all steps passed or were skipped"; else line="$failed step(s) FAILED"; fi
        echo "$line"
    } | tee "$LOG_DIR/summary.txt"
    [ $failed -eq 0 ]
}

# --------------------------------------------------------------------------------------------
# Steps

step_environment() {
    echo "repo: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    echo "library: $LIB"
    ls -l "$LIB" 2>&1
    echo "CUDA_HOME=$CUDA_HOME GPU_ARCH=$GPU_ARCH"
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$NVCC" --version 2>&1
    "$SANITIZER" --version 2>&1 | head -n 3
    "$CC" --version 2>&1 | head -n 1
    local gpu
    gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    info "${gpu:-no nvidia-smi}; nvcc $("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
    need_library
}

step_build_gpu_test() {
    need_library || return 1
    need_tool "$NVCC" || return 2
    local cmd=("$NVCC" -std=c++17 -O2 -lineinfo "-arch=$GPU_ARCH" -Xcompiler -Wall -I "$ROOT/include"
        "$ROOT/tests/gpu/test_gpu.cu" -o "$BUILD_DIR/test_gpu" -L "$LIB_DIR" -lccalloc
        -Xlinker -rpath -Xlinker "$LIB_DIR" -lpthread)
    echo "${cmd[*]}"
    rm -f "$BUILD_DIR/test_gpu"
    "${cmd[@]}" || { info "nvcc failed"; return 1; }
    info "built test_gpu for $GPU_ARCH"
}

# run_gpu_test <log name> <CCALLOC_CONF> [test_gpu arguments]
run_gpu_test() {
    local log="$BUILD_DIR/$1.out" conf=$2 rc
    shift 2
    (unset CCALLOC_BACKEND; export CCALLOC_CONF="$conf"
     timeout "$GPU_TEST_TIMEOUT" "$BUILD_DIR/test_gpu" "$@") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    judge_test "$rc" "$log" "test_gpu${conf:+ ($conf)}"
}

step_gpu_test() {
    needs build_gpu_test || return 2
    run_gpu_test gpu_test ""
}

step_gpu_test_plain() {
    needs build_gpu_test || return 2
    run_gpu_test gpu_test_plain "expandable_segments:False"
}

step_gpu_test_shards() {
    needs build_gpu_test || return 2
    run_gpu_test gpu_test_shards "per_stream_shards:True"
}

# Two GPUs: record_stream with another device's stream, and peer access to paged memory.
step_multi_gpu() {
    need_library || return 1
    need_tool "$NVCC" || return 2
    local log="$BUILD_DIR/multi_gpu.out" rc
    "$NVCC" -std=c++17 -O2 "-arch=$GPU_ARCH" -I "$ROOT/include" "$ROOT/tests/gpu/test_multi_gpu.cu" \
        -o "$BUILD_DIR/test_multi_gpu" -L "$LIB_DIR" -lccalloc -Xlinker -rpath -Xlinker "$LIB_DIR" \
        || { info "nvcc failed"; return 1; }
    (unset CCALLOC_BACKEND CCALLOC_CONF; timeout "$GPU_TEST_TIMEOUT" "$BUILD_DIR/test_multi_gpu") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 77 ]; then
        info "fewer than two GPUs"
        return 2
    fi
    judge_test "$rc" "$log" "test_multi_gpu"
}

step_sanitizer() {
    needs build_gpu_test || return 2
    need_tool "$SANITIZER" || return 2
    local log="$BUILD_DIR/sanitizer.out" rc errors counts
    # --sanitizer = --quick (memcheck slows kernels a lot), --no-driver-oom (that check makes
    # cuMemAlloc fail on purpose) and --no-held-kernel (under memcheck the host blocks while a
    # kernel runs, so a kernel held until the host opens a gate only ends by its timeout).
    (unset CCALLOC_BACKEND CCALLOC_CONF
     timeout "$SANITIZER_TIMEOUT" "$SANITIZER" --tool memcheck --leak-check full \
         "$BUILD_DIR/test_gpu" --sanitizer) 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    errors="$(sed -n 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' "$log" | tail -n 1)"
    counts="$(test_counts "$log")"
    if [ -n "$counts" ]; then counts="${counts% *} passed, ${counts#* } failed"; fi
    info "memcheck: ${errors:-?} errors; test_gpu --sanitizer: ${counts:-no summary line}, exit $rc"
    [ -n "$errors" ] && [ "$errors" -eq 0 ] && [ "$rc" -eq 0 ] && [[ "$counts" == *" passed, 0 failed" ]]
}

step_racecheck() {
    needs build_gpu_test || return 2
    need_tool "$SANITIZER" || return 2
    local log="$BUILD_DIR/racecheck.out" rc hazards counts
    (unset CCALLOC_BACKEND CCALLOC_CONF
     timeout "$SANITIZER_TIMEOUT" "$SANITIZER" --tool racecheck \
         "$BUILD_DIR/test_gpu" --sanitizer) 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    hazards="$(sed -n 's/.*RACECHECK SUMMARY: \([0-9][0-9]*\) hazard.*/\1/p' "$log" | tail -n 1)"
    counts="$(test_counts "$log")"
    if [ -n "$counts" ]; then counts="${counts% *} passed, ${counts#* } failed"; fi
    info "racecheck: ${hazards:-?} hazards; test_gpu --sanitizer: ${counts:-no summary line}, exit $rc"
    [ -n "$hazards" ] && [ "$hazards" -eq 0 ] && [ "$rc" -eq 0 ] && [[ "$counts" == *" passed, 0 failed" ]]
}

# gpu/soak: examples/soak.rs built elsewhere (cargo build --release --features sim --example soak), run
# SOAK_MINUTES (default 5) under compute-sanitizer memcheck on the CUDA backend.
step_soak() {
    need_library || return 1
    need_tool "$SANITIZER" || return 2
    if [ ! -x "$LIB_DIR/soak" ]; then
        echo "missing $LIB_DIR/soak: cargo build --release --features sim --example soak, copy it there"
        info "no gpu/soak"
        return 2
    fi
    local log="$BUILD_DIR/soak.out" rc errors line
    (unset CCALLOC_BACKEND CCALLOC_CONF; export LD_LIBRARY_PATH="$LIB_DIR:${LD_LIBRARY_PATH:-}"
     timeout $(( ${SOAK_MINUTES:-5} * 60 + 300 )) "$SANITIZER" --tool memcheck --leak-check full \
         "$LIB_DIR/soak" "${SOAK_MINUTES:-5}" "${SOAK_THREADS:-4}") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    errors="$(sed -n 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' "$log" | tail -n 1)"
    line="$(grep -E '^soak: ' "$log" | tail -n 1)"
    info "memcheck: ${errors:-?} errors; ${line:-no soak line}; exit $rc"
    [ -n "$errors" ] && [ "$errors" -eq 0 ] && [ "$rc" -eq 0 ] && [[ "$line" == *"failures: 0"* ]]
}

# tests/gpu/test_host.cu: pinned host and managed memory (copies, prefetch, advice, an
# oversubscribed job against plain cudaMallocManaged).
step_host_test() {
    need_library || return 1
    need_tool "$NVCC" || return 2
    local log="$BUILD_DIR/host_test.out" rc
    "$NVCC" -std=c++17 -O2 "-arch=$GPU_ARCH" -I "$ROOT/include" "$ROOT/tests/gpu/test_host.cu" \
        -o "$BUILD_DIR/test_host" -L "$LIB_DIR" -lccalloc -Xlinker -rpath -Xlinker "$LIB_DIR" \
        || { info "nvcc failed"; return 1; }
    (unset CCALLOC_BACKEND CCALLOC_CONF
     timeout "$GPU_TEST_TIMEOUT" "$BUILD_DIR/test_host") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    judge_test "$rc" "$log" "test_host"
    local notes
    notes="$(grep -E '^NOTE  [0-9]+ GiB' "$log" | sed 's/^NOTE  //' | tr '\n' ';')"
    info "$(cat "$CURRENT_INFO_FILE"); $notes"
    [ "$rc" -eq 0 ]
}

# run_python_bench <script> <log>: runs benches/gpu/<script> on the library with the package
# importable, its output in <log> and on stdout; returns the script's status.
run_python_bench() {
    (CCALLOC_LIBRARY="$LIB" PYTHONPATH="$ROOT/python" timeout 600 python3 "benches/gpu/$1") 2>&1 | tee "$2"
    return "${PIPESTATUS[0]}"
}

step_bench_pinned() {
    need_library || return 1
    need_tool python3 || return 2
    local log="$BUILD_DIR/bench_pinned.out" rc
    run_python_bench pinned.py "$log"
    rc=$?
    info "$(grep -E '^(torch|ccalloc) ' "$log" | awk '{printf "%s ratio %s, %s ms/step; ", $1, $6, $8}')"
    return "$rc"
}

step_bench_locks() {
    need_library || return 1
    need_tool python3 || return 2
    if ! python3 -c "import torch" >/dev/null 2>&1; then
        echo "skipped: torch is not importable"
        info "no torch"
        return 2
    fi
    local log="$BUILD_DIR/bench_locks.out" rc
    run_python_bench lock_use.py "$log"
    rc=$?
    info "$(grep -E '^\| (resnet50|gpt2|two_threads)' "$log" | awk -F'|' '{printf "%s: %s locks, %s contended, %s handoffs a step;", $2, $5, $6, $9}')"
    return "$rc"
}

step_header_c() {
    need_library || return 1
    need_tool "$CC" || return 2
    local inc="$CUDA_HOME/include" ok=0 total=0 variant log="$BUILD_DIR/header_cuda.out" rc
    local variants=("$CC -std=c11 -pedantic" "$CC -std=c11 -pedantic -DCCALLOC_FIRST"
        "$CXX -x c++ -std=c++17 -pedantic" "$CXX -x c++ -std=c++17 -pedantic -DCCALLOC_FIRST")
    for variant in "${variants[@]}"; do
        total=$((total + 1))
        echo "+ $variant -Wall -Wextra -Werror -isystem $inc -I include -c tests/gpu/header_cuda.c"
        # shellcheck disable=SC2086
        if $variant -Wall -Wextra -Werror -isystem "$inc" -I "$ROOT/include" \
            -c "$ROOT/tests/gpu/header_cuda.c" -o "$BUILD_DIR/header_cuda_$total.o"; then
            ok=$((ok + 1))
        else
            echo "FAIL: $variant"
        fi
    done
    local cudalib="$CUDA_HOME/lib64"
    [ -d "$cudalib" ] || cudalib="$CUDA_HOME/lib"
    echo "+ link and run the C build (CUDA headers first)"
    if ! "$CC" -std=c11 -Wall -Wextra -Werror -isystem "$inc" -I "$ROOT/include" "$ROOT/tests/gpu/header_cuda.c" \
        -o "$BUILD_DIR/header_cuda" -L "$cudalib" -lcudart -L "$LIB_DIR" -lccalloc \
        -Wl,-rpath,"$LIB_DIR" -Wl,-rpath,"$cudalib"; then
        info "compiled $ok/$total variants; link failed"
        return 1
    fi
    (unset CCALLOC_BACKEND CCALLOC_CONF; timeout 120 "$BUILD_DIR/header_cuda") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    judge_test "$rc" "$log" "compiled $ok/$total (C, C++; either order); run"
    local judged=$?
    [ "$ok" -eq "$total" ] && [ $judged -eq 0 ]
}

# run_sim_c <log name> <CCALLOC_CONF>: builds tests/c/test_api.c and runs it on the sim backend.
run_sim_c() {
    local log="$BUILD_DIR/$1.out" conf=$2 rc
    echo "+ $CC -std=c11 -Wall -Wextra -Werror -pedantic -O2 tests/c/test_api.c -lccalloc"
    "$CC" -std=c11 -Wall -Wextra -Werror -pedantic -O2 -g -I "$ROOT/include" "$ROOT/tests/c/test_api.c" \
        -o "$BUILD_DIR/test_api" -L "$LIB_DIR" -lccalloc -lpthread -Wl,-rpath,"$LIB_DIR" ||
        { info "compile failed"; return 1; }
    (export CCALLOC_BACKEND=sim CCALLOC_SIM_CAPACITY=1GiB CCALLOC_SIM_DEVICES=2 CCALLOC_CONF="$conf"
     timeout "$SIM_TEST_TIMEOUT" "$BUILD_DIR/test_api") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    judge_test "$rc" "$log" "test_api (sim${conf:+, $conf})"
}

step_sim_c() {
    need_library || return 1
    need_tool "$CC" || return 2
    run_sim_c test_api ""
}

step_sim_c_plain() {
    need_library || return 1
    need_tool "$CC" || return 2
    run_sim_c test_api_plain "expandable_segments:False"
}

# PyTorch (python3 there has it): the checks of tests/torch_gpu and the package's GPU tests.
step_torch_checks() {
    need_library || return 1
    need_tool python3 || return 2
    local log="$BUILD_DIR/torch_checks.out"
    (CCALLOC_LIBRARY="$LIB" PYTHONPATH="$ROOT/python" PYTHONUNBUFFERED=1 \
        timeout "${TORCH_TIMEOUT:-600}" python3 tests/torch_gpu/check_torch.py) 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    info "$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -1)"
    return $([ "$rc" -eq 0 ] && echo 0 || echo 1)
}

step_python_gpu() {
    need_library || return 1
    python3 -c 'import pytest' 2>/dev/null || { echo "pytest is not installed"; return 2; }
    local log="$BUILD_DIR/python_gpu.out"
    (CCALLOC_LIBRARY="$LIB" PYTHONPATH="$ROOT/python" timeout 600 \
        python3 -m pytest -q -p no:cacheprovider python/tests) 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    info "$(grep -E '[0-9]+ passed' "$log" | tail -1)"
    return $([ "$rc" -eq 0 ] && echo 0 || echo 1)
}

# Benchmarks against PyTorch's allocators (each writes a markdown table into the log).
step_bench_workloads() {
    need_library || return 1
    local log="$BUILD_DIR/bench_workloads.out"
    (OUT="$LOG_DIR" bash benches/gpu/workloads.sh) 2>&1 | tee "$log"
    return ${PIPESTATUS[0]}
}

step_bench_hotpath() {
    need_library || return 1
    local log="$BUILD_DIR/bench_hotpath.out"
    (OUT="$LOG_DIR" bash benches/gpu/hotpath.sh) 2>&1 | tee "$log"
    return ${PIPESTATUS[0]}
}

step_bench_steady() {
    need_library || return 1
    local log="$BUILD_DIR/bench_steady.out"
    (OUT="$LOG_DIR" bash benches/gpu/steady.sh) 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    info "$(grep -E 'within 2% of native' "$log" | tail -1)"
    return "$rc"
}

step_bench_torch_empty() {
    need_library || return 1
    need_tool python3 || return 2
    local log="$BUILD_DIR/bench_torch_empty.out"
    (CCALLOC_LIBRARY="$LIB" CUDA_HOME="$CUDA_HOME" NULL_ALLOC_SO="$BUILD_DIR/null_alloc.so" \
        timeout 600 python3 benches/gpu/torch_empty.py) 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    info "$(grep -E '^worst ccalloc/native' "$log" | tail -1)"
    return "$rc"
}

# A job past the move allowance's 30 s warm-up credit (the corpus's runs end before it):
# unet for LONG_LOOPS timed loops under native and ccalloc; reserved / requested, and the
# last half's loop time against native's.
step_bench_long_run() {
    need_library || return 1
    need_tool python3 || return 2
    local log="$BUILD_DIR/bench_long_run.out" out="$BUILD_DIR/long_run"
    rm -rf "$out"
    (WORKLOADS=unet_diffusion_train ALLOCATORS="native ccalloc" ROUNDS=1 REPS="${LONG_LOOPS:-80}" \
        RUN_TIMEOUT=400 OUT="$out" bash benches/gpu/corpus/corpus.sh) 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    python3 - "$out" <<'PY' 2>&1 | tee -a "$log"
import glob, json, sys
runs = {}
for f in glob.glob(sys.argv[1] + "/corpus-*.jsonl"):
    for line in open(f):
        r = json.loads(line)
        runs[r["allocator"]] = r
if set(runs) != {"native", "ccalloc"} or any(not r.get("loop_seconds") for r in runs.values()):
    sys.exit("long run: a run failed")
loops = {a: r["loop_seconds"] for a, r in runs.items()}
half = len(loops["native"]) // 2
late = sum(loops["ccalloc"][half:]) / sum(loops["native"][half:])
ratio = {a: r["reserved_bytes.all.peak"] / r["requested_bytes.all.peak"] for a, r in runs.items()}
print(f"unet, {len(loops['native'])} loops: reserved/requested ccalloc {ratio['ccalloc']:.3f} "
      f"(native {ratio['native']:.3f}); last {len(loops['native']) - half} loops' time / native's {late:.3f}")
PY
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    info "$(grep -E '^unet, [0-9]+ loops' "$log" | tail -1)"
    return "$rc"
}

# What each virtual memory call costs here (paged segments pay them when pages move).
step_vmm_cost() {
    need_tool "$NVCC" || return 2
    local log="$BUILD_DIR/vmm_cost.out"
    "$NVCC" -O2 -o "$BUILD_DIR/vmm_cost" benches/gpu/vmm_cost.cu -lcuda || return 1
    "$BUILD_DIR/vmm_cost" | tee "$log"
    local rc=${PIPESTATUS[0]}
    info "$(grep -o '"map_us.*unmap_us": [0-9.]*' "$log")"
    return "$rc"
}

# The steps, in order. Append new ones here.
add_step environment "machine, GPU, tools, library"
add_step build_gpu_test "nvcc tests/gpu/test_gpu.cu against gpu/libccalloc.so"
add_step gpu_test "tests/gpu/test_gpu.cu on the CUDA driver (default: paged segments)"
add_step gpu_test_plain "the same with plain segments (CCALLOC_CONF=expandable_segments:False)"
add_step gpu_test_shards "the same with an allocator per stream (CCALLOC_CONF=per_stream_shards:True)"
add_step multi_gpu "tests/gpu/test_multi_gpu.cu: record_stream across devices, peer access (needs 2 GPUs)"
add_step sanitizer "test_gpu --sanitizer under compute-sanitizer memcheck"
add_step racecheck "test_gpu --sanitizer under compute-sanitizer racecheck"
add_step soak "gpu/soak (examples/soak.rs) for SOAK_MINUTES (5) under compute-sanitizer memcheck"
add_step host_test "tests/gpu/test_host.cu: pinned host and managed memory, oversubscription"
add_step header_c "ccalloc.h with cuda_runtime.h in C and C++, and a runtime-API smoke run"
add_step sim_c "tests/c/test_api.c on the sim backend against gpu/libccalloc.so (paged)"
add_step sim_c_plain "the same with plain segments (CCALLOC_CONF=expandable_segments:False)"
add_step torch_checks "tests/torch_gpu/check_torch.py: training equality, stats, record_stream, graphs, cudnn, OOM, DDP, threads"
add_step python_gpu "python/tests with PyTorch on the GPU"
add_step bench_pinned "benches/gpu/pinned.py: a loader's pinned memory, ccalloc vs PyTorch"
add_step bench_locks "benches/gpu/lock_use.py: lock acquisitions, contention and handoffs per step of real jobs"
add_step bench_workloads "benches/gpu/workloads.sh: the four workloads, native vs expandable vs ccalloc"
add_step bench_hotpath "benches/gpu/hotpath.sh: alloc/free timing vs native and cudaMallocAsync"
add_step bench_torch_empty "benches/gpu/torch_empty.py: torch.empty + del per size, native vs ccalloc vs a null allocator"
add_step bench_steady "benches/gpu/steady.sh: the four workloads in steady state (warm-up run excluded)"
add_step bench_long_run "unet for LONG_LOOPS (80) loops, past the move allowance's credit: memory and late loop time vs native"
add_step vmm_cost "benches/gpu/vmm_cost.cu: microseconds per cuMemCreate/Map/SetAccess/Unmap"

run_steps "$@"
if [ "$LOG_LAYOUT" = combined ]; then
    for f in "$STEP_LOG_DIR"/[0-9][0-9]_*.log; do
        [ -f "$f" ] && { echo "======== $(basename "$f")"; cat "$f"; echo; }
    done >"$LOG_DIR/all_steps.log"
fi
print_summary
