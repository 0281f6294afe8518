# Sourced by the GPU bench scripts (needs $ROOT, the repository root).
# find_bench FILE...: prints the shared bench folder holding every FILE, the first found of
# $CCALLOC_BENCH, $CCALLOC_SHARED/bench, $CCALLOC_SHARED, $ROOT/../shared/bench,
# $ROOT/gpu/shared_bench; fails when none holds them all.
find_bench() {
    local c f
    for c in ${CCALLOC_BENCH:+"$CCALLOC_BENCH"} \
             ${CCALLOC_SHARED:+"$CCALLOC_SHARED/bench" "$CCALLOC_SHARED"} \
             "$ROOT/../shared/bench" "$ROOT/gpu/shared_bench"; do
        for f in "$@"; do [ -f "$c/$f" ] || continue 2; done
        (cd "$c" && pwd)
        return 0
    done
    return 1
}
