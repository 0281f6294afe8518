#!/usr/bin/env bash
# The corpus table (issue 17): every workload under native, expandable and ccalloc, in paired
# interleaved rounds, steady state; then the table. Run on the GPU machine from anywhere:
#
#   bash benches/gpu/corpus/corpus.sh                 run WORKLOADS, write $OUT, print the table
#   bash benches/gpu/corpus/corpus.sh dry-run         the planned runs, their order, the time
#   bash benches/gpu/corpus/corpus.sh summarize [F..] the table of JSONL files (default
#                                                     $OUT/corpus-*.jsonl: several calls merged)
#   bash benches/gpu/corpus/corpus.sh replay_table [F..]
#                                                     `ccalloc replay --json` of $OUT/traces/*,
#                                                     then the table with a replay column
#   bash benches/gpu/corpus/corpus.sh list            the workloads, families, footprints
#
# Settings (environment):
#   WORKLOADS    names (default: all: the corpus's 31 (workloads.py) and the 4 shared ones)
#   ALLOCATORS   default "native expandable ccalloc"; ccalloc@CONF runs ccalloc with CCALLOC_CONF
#   ROUNDS       default 3. Round r runs each workload's allocators back to back, the list
#                rotated by r-1 (A B C, B C A, C A B), so no allocator always runs first.
#   REPS         timed loops per process after one warm-up loop (default 2)
#   PIN_CPUS     a taskset CPU list (e.g. 2): every run's process is bound to those CPUs, so
#                that which core (and whose caches) a launch-bound loop lands on does not
#                move its time from process to process; unset: not bound
#   RUN_TIMEOUT  seconds per process (default 150); a run that times out or crashes gives a
#                record with its error, and the table goes on
#   OUT          results (default /tmp/corpus): corpus-SESSION.jsonl (one record a run),
#                logs/ (one log a run), corpus.md (the table), traces/, replay.json
#   TRACE=1      after the rounds, one more native run of each corpus workload in WORKLOADS with
#                run.py --trace: $OUT/traces/NAME.trace.csv.gz (the shared traces' format);
#                ROUNDS=0 TRACE=1 records the traces alone
#   BUDGET_S     the dry-run's budget per call (default 540, less 30 s of ccalloc set-up):
#                above it, it suggests a split (from measured seconds once $OUT has records)
#   CCALLOC_LIBRARY (default <repo>/gpu/libccalloc.so), CCALLOC_BIN (replay_table; default
#   <repo>/gpu/ccalloc), PYTHON (default python3). The python package is the checkout's
#   python/ (run.py puts it first on sys.path); the shared harness is found as
#   benches/gpu/find_bench.sh finds it ($CCALLOC_BENCH, $CCALLOC_SHARED/bench, $CCALLOC_SHARED,
#   <repo>/../shared/bench, <repo>/gpu/shared_bench), then <repo>/shared/bench.
#
# Before the first round a ccalloc process is started once untimed: ccalloc.torch compiles its
# PyTorch adapter on first use (~20 s, cached under ~/.cache/ccalloc), which must not fall into
# a timed run or its timeout.

set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
cd "$ROOT" || exit 2
# shellcheck source-path=SCRIPTDIR source=../find_bench.sh
. "$ROOT/benches/gpu/find_bench.sh"
PYTHON="${PYTHON:-python3}"
export CCALLOC_LIBRARY="${CCALLOC_LIBRARY:-$ROOT/gpu/libccalloc.so}"
export PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF CCALLOC_CONF
OUT_DIR="${OUT:-/tmp/corpus}"
ALL_WORKLOADS="$("$PYTHON" "$HERE/run.py" --list | cut -f1 | tr '\n' ' ')"
WORKLOADS="${WORKLOADS:-$ALL_WORKLOADS}"
ALLOCATORS="${ALLOCATORS:-native expandable ccalloc}"
ROUNDS="${ROUNDS:-3}"
REPS="${REPS:-2}"
RUN_TIMEOUT="${RUN_TIMEOUT:-150}"
BUDGET_S="${BUDGET_S:-540}"
MODE="${1:-run}"
[ $# -gt 0 ] && shift

# rotated ROUND: ALLOCATORS rotated left by ROUND-1.
rotated() {
    local -a a
    read -r -a a <<<"$ALLOCATORS"
    local n=${#a[@]} k=$((($1 - 1) % ${#a[@]})) i out=()
    for ((i = 0; i < n; i++)); do out+=("${a[$(((i + k) % n))]}"); done
    echo "${out[*]}"
}

is_corpus() { "$PYTHON" "$HERE/run.py" --list | awk -F'\t' -v w="$1" '$1 == w && $2 == "corpus" {f = 1} END {exit !f}'; }

check_workloads() {
    local w
    for w in $WORKLOADS; do
        case " $ALL_WORKLOADS " in *" $w "*) ;; *) echo "corpus.sh: unknown workload $w (see: corpus.sh list)" >&2; exit 2 ;; esac
    done
}

dry_run() {
    check_workloads
    local r w a
    for r in $(seq 1 "$ROUNDS"); do
        echo "round $r: $(rotated "$r")"
        for w in $WORKLOADS; do
            for a in $(rotated "$r"); do echo "  run.py $w $a --reps $REPS"; done
        done
    done
    if [ "${TRACE:-0}" = 1 ]; then
        for w in $WORKLOADS; do is_corpus "$w" && echo "  trace: run.py $w native --reps 1 --trace $OUT_DIR/traces"; done
    fi
    # Earlier calls' records in $OUT, if any, give measured seconds per process.
    local measured=()
    mapfile -t measured < <(compgen -G "$OUT_DIR/corpus-*.jsonl")
    # shellcheck disable=SC2086
    "$PYTHON" "$HERE/table.py" plan "$BUDGET_S" "$ROUNDS" "$REPS" "$ALLOCATORS" $WORKLOADS -- "${measured[@]}"
}

# run_one W A ROUND [EXTRA...]: one process; appends its record (or an error record) to $JSONL.
run_one() {
    local w=$1 a=$2 r=$3
    shift 3
    local log="$LOGS/$w.$a.r$r.log" rc
    local pin=()
    [ -n "${PIN_CPUS:-}" ] && pin=(taskset -c "$PIN_CPUS")
    CORPUS_ROUND=$r CORPUS_SESSION=$SESSION timeout -k 10 "$RUN_TIMEOUT" \
        "${pin[@]}" "$PYTHON" "$HERE/run.py" "$w" "$a" --reps "$REPS" "$@" >"$log" 2>&1
    rc=$?
    if grep -q '^CORPUS ' "$log"; then
        grep '^CORPUS ' "$log" | sed 's/^CORPUS //' >>"$JSONL"
    else
        # No record: killed by the timeout, or the interpreter died (a segfault, a failed import).
        local why="rc=$rc"
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="timed out after ${RUN_TIMEOUT}s (rc=$rc)"
        local traced=""
        case " $* " in *" --trace "*) traced=1 ;; esac
        W="$w" A="$a" R="$r" S="$SESSION" WHY="$why" T="$traced" TAIL="$(tail -n 3 "$log" | cut -c1-300)" "$PYTHON" -c '
import json, os
e = os.environ
r = {"workload": e["W"], "allocator": e["A"], "round": int(e["R"]), "session": e["S"], "loop_seconds": [],
     "error": " / ".join([e["WHY"]] + e["TAIL"].splitlines())}
if e["T"]:
    r["traced"] = True
print(json.dumps(r))' >>"$JSONL"
    fi
    printf '[%4ds] r%s %-26s %-11s rc=%-3s %s\n' "$((SECONDS - START))" "$r" "$w" "$a" "$rc" \
        "$(tail -n 1 "$JSONL" | grep -o '"error": "[^"]\{0,120\}' || tail -n 1 "$JSONL" | grep -o '"loop_seconds": \[[^]]*\]')"
}

prebuild_ccalloc() {
    case " $ALLOCATORS " in *" ccalloc"*) ;; *) return 0 ;; esac
    [ -f "$CCALLOC_LIBRARY" ] || echo "corpus.sh: warning: $CCALLOC_LIBRARY not found; ccalloc runs will fail" >&2
    echo "[prep] ccalloc.torch adapter (built once, untimed)"
    timeout 300 "$PYTHON" "$HERE/prebuild.py" 2>&1 | tail -n 3
}

run_corpus() {
    check_workloads
    mkdir -p "$OUT_DIR"
    LOGS="$OUT_DIR/logs"
    mkdir -p "$LOGS"
    SESSION="$(date -u +%Y%m%dT%H%M%S)-$$"
    JSONL="$OUT_DIR/corpus-$SESSION.jsonl"
    : >"$JSONL"
    START=$SECONDS
    # find_bench's places, then the checkout's own shared/ (where a device call carries it).
    if bench="$(find_bench workloads.py)" || { [ -f "$ROOT/shared/bench/workloads.py" ] && bench="$ROOT/shared/bench"; }; then
        export CCALLOC_BENCH="$bench"
    else
        echo "corpus.sh: the shared harness (workloads.py) was not found; shared workloads will fail" >&2
    fi
    echo "session $SESSION: $ROUNDS rounds of [$ALLOCATORS] x [$WORKLOADS], REPS=$REPS -> $JSONL"
    prebuild_ccalloc
    local r w a
    for r in $(seq 1 "$ROUNDS"); do
        for w in $WORKLOADS; do
            for a in $(rotated "$r"); do run_one "$w" "$a" "$r"; done
        done
    done
    if [ "${TRACE:-0}" = 1 ]; then
        mkdir -p "$OUT_DIR/traces"
        for w in $WORKLOADS; do
            is_corpus "$w" && REPS=1 run_one "$w" native 0 --trace "$OUT_DIR/traces"
        done
    fi
    echo "done in $((SECONDS - START)) s"
    "$PYTHON" "$HERE/table.py" "$OUT_DIR"/corpus-*.jsonl | tee "$OUT_DIR/corpus.md"
}

jsonl_files() {
    if [ $# -gt 0 ]; then
        printf '%s\n' "$@"
    else
        compgen -G "$OUT_DIR/corpus-*.jsonl" || { echo "corpus.sh: no $OUT_DIR/corpus-*.jsonl" >&2; return 1; }
    fi
}

case "$MODE" in
run) run_corpus ;;
dry-run | --dry-run) dry_run ;;
list | --list) "$PYTHON" "$HERE/run.py" --list | column -t -s $'\t' ;;
summarize)
    mapfile -t files < <(jsonl_files "$@") || exit 1
    [ ${#files[@]} -gt 0 ] || exit 1
    mkdir -p "$OUT_DIR"
    "$PYTHON" "$HERE/table.py" "${files[@]}" | tee "$OUT_DIR/corpus.md"
    ;;
replay_table)
    mapfile -t files < <(jsonl_files "$@") || exit 1
    [ ${#files[@]} -gt 0 ] || exit 1
    BIN="${CCALLOC_BIN:-$ROOT/gpu/ccalloc}"
    traces=("$OUT_DIR"/traces/*.trace.csv.gz)
    [ -e "${traces[0]}" ] || { echo "corpus.sh: no traces in $OUT_DIR/traces (run with TRACE=1)" >&2; exit 1; }
    # Exit status 3: a trace ran out of the simulated capacity; the report is still complete.
    "$BIN" replay --json "${traces[@]}" >"$OUT_DIR/replay.json"
    rc=$?
    [ $rc = 0 ] || [ $rc = 3 ] || { echo "corpus.sh: $BIN replay failed (rc=$rc)" >&2; exit 1; }
    "$PYTHON" "$HERE/table.py" --replay "$OUT_DIR/replay.json" "${files[@]}" | tee "$OUT_DIR/corpus.md"
    ;;
*) echo "usage: corpus.sh [run | dry-run | summarize [FILE...] | replay_table [FILE...] | list]" >&2; exit 2 ;;
esac
