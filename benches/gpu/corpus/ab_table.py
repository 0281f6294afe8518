#!/usr/bin/env python3
"""The table of an ab.sh call: two builds of libccalloc on the same workloads, paired rounds.

usage: ab_table.py A B FILE.jsonl...   (A, B: the "lib" values of the records, A the base)

Per workload: each build's peak reserved / peak requested in every run (in round order), the
growths refused their moves and the chunks mapped (medians over runs), the time its timed
loops spent growing and, of that, waiting for the device (ms, medians over runs; run.py's
"loop_paging"), and B's loop time against A's: in every round the ratio of the two
processes' median loop seconds, then the median of those ratios with their min-max spread. A failed run has no figures; its error is
listed under the table.
"""

from __future__ import annotations

import json
import statistics
import sys


def load(paths):
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def ok(r) -> bool:
    return not r.get("error") and bool(r.get("loop_seconds")) and bool(r.get("requested_bytes.all.peak"))


def ratio(r) -> float:
    return r["reserved_bytes.all.peak"] / r["requested_bytes.all.peak"]


def median_of(runs, key, counters="paging"):
    values = [(r.get(counters) or {}).get(key) for r in runs if ok(r)]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def count(value) -> str:
    return "-" if value is None else f"{value:g}"


def growth_ms(runs) -> str:
    """The timed loops' growth and wait time, "growth (waits)" in ms."""
    growth, waits = (median_of(runs, k, "loop_paging") for k in ("growth_ns", "wait_ns"))
    if growth is None:
        return "-"
    return f"{growth / 1e6:.0f} ({(waits or 0) / 1e6:.0f})"


def table(a: str, b: str, records) -> list:
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    lines = [
        f"| workload | {a} res/req | {b} res/req | {b} / {a} time | refused growths, {a} / {b} | chunks mapped, {a} / {b} "
        f"| loop growth ms (waits), {a} / {b} |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    errors = []
    for w in workloads:
        runs = {lib: sorted((r for r in records if r["workload"] == w and r.get("lib") == lib),
                            key=lambda r: r["round"]) for lib in (a, b)}
        for lib, rs in runs.items():
            errors += [f"{w} {lib} round {r['round']}: {r['error']}" for r in rs if r.get("error")]
        cells = [", ".join(f"{ratio(r):.3f}" if ok(r) else "ERR" for r in runs[lib]) or "-" for lib in (a, b)]
        base = {r["round"]: statistics.median(r["loop_seconds"]) for r in runs[a] if ok(r)}
        ratios = [statistics.median(r["loop_seconds"]) / base[r["round"]]
                  for r in runs[b] if ok(r) and r["round"] in base]
        time = (f"{statistics.median(ratios):.3f} [{min(ratios):.3f}–{max(ratios):.3f}]"
                if ratios else "-")
        refused = " / ".join(count(median_of(runs[lib], "growths_past_slack")) for lib in (a, b))
        mapped = " / ".join(count(median_of(runs[lib], "chunks_mapped")) for lib in (a, b))
        growth = " / ".join(growth_ms(runs[lib]) for lib in (a, b))
        lines.append(f"| {w} | {cells[0]} | {cells[1]} | {time} | {refused} | {mapped} | {growth} |")
    lines.append("")
    lines.append(f"{len(records)} runs. Time: per round, {b}'s median loop seconds over {a}'s; "
                 "median over rounds [min–max].")
    lines += [f"error: {e}" for e in errors]
    return lines


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    a, b, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    print("\n".join(table(a, b, load(paths))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
