#!/usr/bin/env bash
# The concurrency stress tests (tests/stress.rs, tests/fronts_stress.rs) and the C API fuzz
# target (tests/fuzz_api.rs) under ThreadSanitizer and AddressSanitizer, through the nightly
# toolchain when one is installed (std rebuilt instrumented: -Zbuild-std, which needs the
# rust-src component, added here if missing); under valgrind (memcheck, then helgrind)
# otherwise. Slow (minutes per sanitizer, most of it building std and the dependencies once
# per sanitizer under target/sanitize-*): not part of scripts/test.sh.
#
#   scripts/sanitize.sh               # both sanitizers (or valgrind)
#   SANITIZERS=thread scripts/sanitize.sh
#   CCALLOC_FUZZ_CASES=2000 scripts/sanitize.sh   # a longer fuzz run (default here: 100)
#
# Prints one line per run and a summary; exits non-zero if any run failed or reported.
set -uo pipefail
cd "$(dirname "$0")/.."

# The tests need the simulated device (feature `sim`): without it they compile to nothing.
tests=(--features sim --test stress --test fronts_stress --test fuzz_api)
export CCALLOC_FUZZ_CASES="${CCALLOC_FUZZ_CASES:-100}"
log_dir=target/sanitize-logs
mkdir -p "$log_dir"
failed=0
summary=()

record() { # name status log
  local verdict=ok
  [ "$2" -ne 0 ] && verdict="FAILED (exit $2)" && failed=1
  local reports passed
  reports=$(grep -c -E "^(WARNING: ThreadSanitizer|==[0-9]+==ERROR: AddressSanitizer|==[0-9]+== (Invalid|Conditional|Possible data race))" "$3" || true)
  passed=$(grep -E '^test result' "$3" | awk '{s+=$4} END {print s+0}')
  # A run that tested nothing has checked nothing.
  [ "$passed" -eq 0 ] && verdict="FAILED (no test ran)" && failed=1
  summary+=("$1: $verdict, $reports reports, $passed tests passed; log $3")
}

if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  rustup component list --toolchain nightly --installed | grep -q '^rust-src' ||
    rustup component add rust-src --toolchain nightly
  host=$(rustc +nightly -vV | sed -n 's/^host: //p')
  for san in ${SANITIZERS:-thread address}; do
    log="$log_dir/$san.log"
    start=$(date +%s)
    # Build scripts and proc macros stay uninstrumented (--target separates them).
    RUSTFLAGS="-Zsanitizer=$san -Cdebug-assertions=off" \
      TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1" \
      ASAN_OPTIONS="detect_leaks=0 halt_on_error=0" \
      CARGO_TARGET_DIR="target/sanitize-$san" \
      cargo +nightly test -Zbuild-std --target "$host" --release "${tests[@]}" \
      >"$log" 2>&1
    status=$?
    record "$san sanitizer ($(( $(date +%s) - start )) s)" "$status" "$log"
  done
else
  cargo test --release --no-run "${tests[@]}" >"$log_dir/build.log" 2>&1 || {
    echo "build failed: $log_dir/build.log"; exit 1; }
  bins=$(cargo test --release --no-run --message-format=json "${tests[@]}" 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
  for tool in memcheck helgrind; do
    for bin in $bins; do
      log="$log_dir/$tool-$(basename "$bin").log"
      start=$(date +%s)
      valgrind --tool="$tool" --error-exitcode=1 "$bin" --test-threads=1 >"$log" 2>&1
      status=$?
      record "valgrind $tool $(basename "$bin") ($(( $(date +%s) - start )) s)" "$status" "$log"
    done
  done
fi

printf '%s\n' "${summary[@]}"
[ "$failed" -eq 0 ] && echo "sanitize: all clean" || echo "sanitize: FAILURES (see the logs)"
exit "$failed"
