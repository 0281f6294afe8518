#!/usr/bin/env python3
"""Collects and summarises the GPU benchmark results of benches/gpu/*.sh (standard library only).

    summarize.py collect --kind workloads|hotpath --label L --rep N --rc RC --prefix P --log FILE [--workload W]
        Prints one JSON line for a run's log: its `P {json}` result line (P: RESULT, or CCALLOC
        for run_workload_ccalloc.py) with "label", "rep" and "rc" added, or an error record.
    summarize.py workloads [FILE]   (default $OUT/workloads.jsonl or /tmp/workloads.jsonl)
        Markdown: time and peak memory per workload and allocator (min seconds over repeats,
        max memory over repeats), ccalloc/native ratios, and whether ccalloc's time is within
        2% of native on every workload.
    summarize.py hotpath [FILE]     (default $OUT/hotpath.jsonl or /tmp/hotpath.jsonl)
        Markdown: ns per alloc+free pair / churn step per allocator (best over repeats) in the
        layout of shared/README.md's hot-path table, with ccalloc/native ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

MiB = 1 << 20

# ---------------------------------------------------------------------------------------------
# collect


def collect(opts) -> int:
    record = None
    tail = []
    try:
        with open(opts.log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        lines = [f"(cannot read log: {e})"]
    prefix = opts.prefix + " "
    for line in lines:
        if line.startswith(prefix):
            try:
                record = json.loads(line[len(prefix):])
            except ValueError:
                record = None
    if record is None:
        tail = [l for l in lines if l.strip()][-8:]
        record = {"error": f"no '{opts.prefix}' line (exit status {opts.rc})", "tail": tail}
    if opts.workload:
        record.setdefault("workload", opts.workload)
    record["label"] = opts.label
    record["rep"] = opts.rep
    record["rc"] = opts.rc
    record["log"] = opts.log
    print(json.dumps(record))
    return 0


# ---------------------------------------------------------------------------------------------
# helpers


def read_jsonl(path):
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith(("RESULT ", "CCALLOC ")):  # raw result lines are accepted too
                line = line.split(" ", 1)[1]
            try:
                records.append(json.loads(line))
            except ValueError:
                print(f"warning: {path}:{n}: not JSON, skipped", file=sys.stderr)
    return records


def default_path(name):
    return os.path.join(os.environ.get("OUT") or "/tmp", name)


def label_of(record):
    if record.get("label"):
        return record["label"]
    alloc = record.get("allocator") or record.get("kind") or "?"
    if alloc.startswith("so:"):
        return "ccalloc_so"
    if alloc == "so":
        return "ccalloc"
    return alloc


def fmt_num(v, digits=0):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if digits == 0:
        return f"{v:,.0f}"
    return f"{v:,.{digits}f}"


def fmt_ratio(a, b, digits=3):
    if a is None or b is None or not b:
        return "—"
    return f"{a / b:.{digits}f}"


def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# workloads

WORKLOAD_ORDER = ("gpt2_train_varlen", "resnet50_train", "bert_infer_varlen", "mlp_sidestream")


def reserved_peak(record):
    """The allocator's own peak reserved bytes: PyTorch's reserved_bytes.all.peak, or ccalloc's
    max_memory_reserved() (run_workload_ccalloc.py)."""
    if "ccalloc_max_memory_reserved" in record:
        return record["ccalloc_max_memory_reserved"]
    return record.get("reserved_bytes.all.peak")


def print_failed(failed, describe):
    """Lists failed runs: `describe(record)`, then the log's path and its last lines."""
    if not failed:
        return
    print(f"Failed runs ({len(failed)}):")
    for r in failed:
        tail = " / ".join(r.get("tail", [])[-3:])
        print(f"- {describe(r)} (log {r.get('log', '?')}) {tail[:300]}")
    print()


def summarize_workloads(opts) -> int:
    path = opts.file or default_path("workloads.jsonl")
    records = read_jsonl(path)
    ok = [r for r in records if "error" not in r and r.get("seconds") is not None]
    failed = [r for r in records if r not in ok]
    by = defaultdict(list)
    for r in ok:
        by[(r.get("workload"), label_of(r))].append(r)
    workloads = [w for w in WORKLOAD_ORDER if any(k[0] == w for k in by)]
    workloads += sorted({k[0] for k in by} - set(workloads) - {None})
    labels = {k[1] for k in by}
    has_so = "ccalloc_so" in labels

    def agg(w, label):
        runs = by.get((w, label), [])
        if not runs:
            return None
        secs = [r["seconds"] for r in runs]
        res = [reserved_peak(r) for r in runs if reserved_peak(r) is not None]
        req = [r.get("requested_bytes.all.peak") for r in runs if r.get("requested_bytes.all.peak") is not None]
        nvml = [r.get("nvml_peak_used_mib") for r in runs if r.get("nvml_peak_used_mib") is not None]
        return {
            "s": min(secs),
            "s_all": secs,
            "reserved": max(res) if res else None,
            "requested": max(req) if req else None,
            "nvml": max(nvml) if nvml else None,
            "n": len(runs),
            "retries": max((r.get("num_alloc_retries", 0) or 0) for r in runs),
            "ooms": max((r.get("num_ooms", 0) or 0) for r in runs),
        }

    header = ["workload", "native s", "expandable s", "ccalloc s", "ccalloc/native time",
              "peak reserved MiB native", "expandable", "ccalloc",
              "NVML peak MiB native", "expandable", "ccalloc",
              "ccalloc reserved / native reserved", "ccalloc reserved / expandable reserved"]
    if has_so:
        header.append("ccalloc (so: mode) s")
    rows = []
    verdicts = []
    for w in workloads:
        n, e, c = agg(w, "native"), agg(w, "native_expandable"), agg(w, "ccalloc")
        g = lambda a, k: None if a is None else a[k]  # noqa: E731
        mib = lambda v: None if v is None else v / MiB  # noqa: E731
        row = [w, fmt_num(g(n, "s"), 3), fmt_num(g(e, "s"), 3), fmt_num(g(c, "s"), 3),
               fmt_ratio(g(c, "s"), g(n, "s")),
               fmt_num(mib(g(n, "reserved"))), fmt_num(mib(g(e, "reserved"))), fmt_num(mib(g(c, "reserved"))),
               fmt_num(g(n, "nvml"), 1), fmt_num(g(e, "nvml"), 1), fmt_num(g(c, "nvml"), 1),
               fmt_ratio(g(c, "reserved"), g(n, "reserved")), fmt_ratio(g(c, "reserved"), g(e, "reserved"))]
        if has_so:
            row.append(fmt_num(g(agg(w, "ccalloc_so"), "s"), 3))
        rows.append(row)
        if n is None or c is None:
            verdicts.append((w, None))
        else:
            verdicts.append((w, c["s"] / n["s"]))

    print(f"Workloads ({path}): seconds = min over repeats; memory = max over repeats. "
          "Peak reserved: PyTorch's reserved_bytes.all.peak for native/expandable, ccalloc's "
          "max_memory_reserved() for ccalloc. NVML peak: device memory used above the level before "
          "CUDA init (CUDA context included), sampled every 2 ms.")
    print()
    print(table(header, rows))
    print()

    # Fragmentation: peak reserved / peak requested, as in shared/README.md.
    frag_rows = []
    for w in workloads:
        row = [w]
        for label in ("native", "native_expandable", "ccalloc"):
            a = agg(w, label)
            row.append(fmt_ratio(a and a["reserved"], a and a["requested"]))
        c = agg(w, "ccalloc")
        row.append("—" if c is None else f"{c['retries']} / {c['ooms']}")
        frag_rows.append(row)
    print("Fragmentation (peak reserved / peak requested bytes; 1.000 is the floor):")
    print()
    print(table(["workload", "native", "expandable", "ccalloc", "ccalloc retries / OOMs"], frag_rows))
    print()

    runs_line = []
    for w in workloads:
        for label in sorted(labels):
            a = agg(w, label)
            if a:
                runs_line.append(f"{w}/{label}: " + ", ".join(f"{s:.3f}" for s in a["s_all"]))
    print("All timings (s): " + "; ".join(runs_line))
    print()
    print_failed(failed, lambda r: f"{r.get('workload', '?')} {label_of(r)} rep {r.get('rep', '?')}: "
                                   f"{r.get('error', 'no seconds')}")

    missing = [w for w, v in verdicts if v is None]
    expected_missing = [w for w in WORKLOAD_ORDER if w not in workloads]
    if missing or not verdicts:
        print(f"ccalloc time within 2% of native on every workload: UNKNOWN (no native/ccalloc pair for "
              f"{', '.join(missing) or 'any workload'})")
        return 1
    worst_w, worst = max(verdicts, key=lambda t: t[1])
    within = all(v <= 1.02 for _, v in verdicts)
    extra = f" (only {len(verdicts)} of 4 workloads ran: missing {', '.join(expected_missing)})" if expected_missing else ""
    print(f"ccalloc time within 2% of native on every workload: {'YES' if within else 'NO'} "
          f"(worst {worst_w}: ccalloc/native = {worst:.3f}, {100 * (worst - 1):+.1f}%){extra}")
    return 0


# ---------------------------------------------------------------------------------------------
# hotpath

HOTPATH_NAMES = {
    "native": "PyTorch native",
    "native_expandable": "PyTorch expandable_segments",
    "native_async": "PyTorch cudaMallocAsync backend",
    "cudamallocasync": "cudaMallocAsync (raw, pool kept)",
    "cudamalloc": "cudaMalloc/cudaFree",
    "ccalloc": "ccalloc",
    "floor": "harness floor (zero-cost allocator)",
}
HOTPATH_ORDER = ("native", "native_expandable", "native_async", "cudamallocasync", "cudamalloc", "ccalloc",
                 "floor")
HOTPATH_MAIN = (
    ("pair 4 KiB", "pair_4096"),
    ("pair 32 MiB", "pair_33554432"),
    ("churn small", "churn_small_ns"),
    ("churn mixed", "churn_mixed_ns"),
    ("mt1", "mt1_ns"),
    ("mt4", "mt4_ns"),
    ("mt8", "mt8_ns"),
)
HOTPATH_EXTRA = (
    ("pair 1 MiB", "pair_1048576"),
    ("pair 512 MiB", "pair_536870912"),
)


def summarize_hotpath(opts) -> int:
    path = opts.file or default_path("hotpath.jsonl")
    records = read_jsonl(path)
    ok = [r for r in records if "error" not in r and r.get("choose", "ok") == "ok"]
    failed = [r for r in records if r not in ok]
    by = defaultdict(list)
    for r in ok:
        by[label_of(r)].append(r)
    labels = [l for l in HOTPATH_ORDER if l in by] + sorted(set(by) - set(HOTPATH_ORDER))

    def best(label, key):
        """Lowest valid figure over repeats (negative values are the harness's error codes)."""
        values = [r.get(key) for r in by[label] if isinstance(r.get(key), (int, float))]
        good = [v for v in values if v >= 0]
        if good:
            return min(good)
        return values[0] if values else None

    def cell(v):
        if v is None:
            return "—"
        if v < 0:
            return f"error ({v:g})"
        return f"{v:,.0f}"

    print(f"Hot path ({path}): ns per alloc+free pair; churn = ns per free+alloc step; mtN = wall ns "
          "per step over all N threads. Best of the repeats (lower is better).")
    print()
    rows = []
    for label in labels:
        rows.append([HOTPATH_NAMES.get(label, label) + f" ({len(by[label])} runs)"]
                    + [cell(best(label, key)) for _, key in HOTPATH_MAIN])
    if "ccalloc" in by and "native" in by:
        ratio = ["**ccalloc / native**"]
        for _, key in HOTPATH_MAIN:
            a, b = best("ccalloc", key), best("native", key)
            ratio.append(f"**{a / b:.2f}**" if a is not None and b and a >= 0 and b > 0 else "—")
        rows.append(ratio)
    if "floor" in by:
        # The harness's own share of each figure is the floor's: what is left is the allocator's.
        for label in [l for l in ("native", "ccalloc") if l in by] + [l for l in labels if l.startswith("lib@")]:
            own = [f"{HOTPATH_NAMES.get(label, label)} minus floor"]
            for _, key in HOTPATH_MAIN:
                a, f = best(label, key), best("floor", key)
                own.append(cell(a - f) if a is not None and f is not None and a >= 0 and f >= 0 else "—")
            rows.append(own)
    print(table(["allocator"] + [name for name, _ in HOTPATH_MAIN], rows))
    print()

    rows = []
    for label in labels:
        row = [HOTPATH_NAMES.get(label, label)] + [cell(best(label, key)) for _, key in HOTPATH_EXTRA]
        for kind in ("small", "mixed"):
            runs = [r for r in by[label] if isinstance(r.get(f"churn_{kind}_used"), (int, float))]
            if runs:
                r = min(runs, key=lambda r: r[f"churn_{kind}_used"])
                live, used = r.get(f"churn_{kind}_live") or 0, r[f"churn_{kind}_used"]
                row.append(f"{used / MiB:,.1f} / {live / MiB:,.1f}" + (f" ({used / live:.2f})" if live > 0 else ""))
            else:
                row.append("—")
        rows.append(row)
    print("Other sizes, and device memory used / live bytes at the end of the churn runs (MiB):")
    print()
    print(table(["allocator"] + [name for name, _ in HOTPATH_EXTRA] + ["churn small used / live", "churn mixed used / live"],
                rows))
    print()
    print_failed(failed, lambda r: f"{label_of(r)} rep {r.get('rep', '?')}: "
                                   f"{r.get('error') or 'choose=' + str(r.get('choose'))}")
    if "ccalloc" in by and "native" in by:
        def at_least_as_fast(key):
            a, b = best("ccalloc", key), best("native", key)
            return a is not None and b is not None and a >= 0 and b > 0 and a <= b

        faster = [name for name, key in HOTPATH_MAIN if at_least_as_fast(key)]
        print(f"ccalloc at least as fast as PyTorch native on {len(faster)} of {len(HOTPATH_MAIN)} columns"
              + (f": {', '.join(faster)}" if faster else ""))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="one JSON line from a run's log")
    c.add_argument("--kind", choices=("workloads", "hotpath"), required=True)
    c.add_argument("--label", required=True)
    c.add_argument("--rep", type=int, default=1)
    c.add_argument("--rc", type=int, default=0)
    c.add_argument("--prefix", default="RESULT")
    c.add_argument("--log", required=True)
    c.add_argument("--workload", default="")
    w = sub.add_parser("workloads", help="markdown table of workloads.jsonl")
    w.add_argument("file", nargs="?")
    h = sub.add_parser("hotpath", help="markdown table of hotpath.jsonl")
    h.add_argument("file", nargs="?")
    opts = parser.parse_args()
    if opts.cmd == "collect":
        return collect(opts)
    if opts.cmd == "workloads":
        return summarize_workloads(opts)
    return summarize_hotpath(opts)


if __name__ == "__main__":
    sys.exit(main())
