#!/usr/bin/env bash
# Shows that a change left the allocator's behaviour as it was: replays every trace under
# several settings with the `ccalloc` command built at BASE (default: the last commit before
# the redesign) and at the working tree, and compares every figure, the sampled live/reserved
# timeline and the final statistics (`--json --stats`). Only the replay's own speed
# (ns_per_event) may differ. Exit 0 when all are identical.
#
#   scripts/same_behaviour.sh [BASE_REV] [TRACE...]
#
# BASE is built in a temporary worktree under target/same_behaviour/ (its own target dir,
# kept between runs so a second run only rebuilds what changed).
set -euo pipefail
cd "$(dirname "$0")/.."
# Resolved here: inside the base worktree, a name such as HEAD would mean its own checkout.
base=$(git rev-parse --verify "${1:-a96effc}^{commit}")
shift || true
traces=("$@")
if [ ${#traces[@]} -eq 0 ]; then
  traces=(../shared/traces/*.trace.csv.gz tests/data/*.pickle)
  for t in benches/traces/*.trace.csv.gz; do
    [ -e "$t" ] && traces+=("$t")
  done
fi
confs=(
  ""
  "expandable_segments:False"
  "expandable_segments:False,max_split_size_mb:256,garbage_collection_threshold:0.8"
  "per_stream_shards:True"
  "page_slack:0"
  "thread_cache:False"
)

work=target/same_behaviour
mkdir -p "$work"
if [ ! -d "$work/base/.git" ] && [ ! -f "$work/base/.git" ]; then
  rm -rf "$work/base"
  git worktree add --detach "$work/base" "$base" >/dev/null
else
  git -C "$work/base" checkout --quiet --detach "$base"
fi
echo "building BASE ($base) and the working tree" >&2
(cd "$work/base" && cargo build --quiet --release --features replay --bin ccalloc \
  --target-dir "$PWD/../target")
cargo build --quiet --release --features replay --bin ccalloc
base_bin=$work/target/release/ccalloc
head_bin=target/release/ccalloc

fail=0
n=0
for conf in "${confs[@]}"; do
  for bin in base head; do
    exe=$base_bin
    [ $bin = head ] && exe=$head_bin
    # Exit 3 (a trace ran out of memory) is a result like any other.
    "$exe" replay --json --stats --conf "$conf" "${traces[@]}" >"$work/$bin.json" || [ $? -eq 3 ]
  done
  if ! python3 - "$work/base.json" "$work/head.json" "$conf" <<'PY'; then
import json, sys
base, head = (json.load(open(p)) for p in sys.argv[1:3])
conf = sys.argv[3] or "(defaults)"
for r in base + head:
    r.pop("ns_per_event", None)
bad = 0
for b, h in zip(base, head):
    if b != h:
        bad += 1
        keys = [k for k in b if b.get(k) != h.get(k)]
        print(f"DIFFERENT {conf} {b['trace']}: {', '.join(keys)}")
        for k in keys:
            if k == "final_stats":
                bs, hs = dict(b[k]), dict(h[k])
                for s in sorted(set(bs) | set(hs)):
                    if bs.get(s) != hs.get(s):
                        print(f"    {s}: {bs.get(s)} -> {hs.get(s)}")
            elif k != "timeline":
                print(f"    {k}: {b[k]} -> {h.get(k)}")
if len(base) != len(head):
    print(f"DIFFERENT {conf}: {len(base)} traces against {len(head)}")
    bad += 1
sys.exit(1 if bad else 0)
PY
    fail=1
  fi
  n=$((n + $(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))))' "$work/head.json")))
done
if [ $fail -eq 0 ]; then
  echo "identical: $n replays (${#traces[@]} trace files x ${#confs[@]} settings): figures, timelines, final statistics"
else
  echo "behaviour changed (see above)"
  exit 1
fi
