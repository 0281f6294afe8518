#!/usr/bin/env python3
"""Steady-state timing of the shared workloads (shared/bench/workloads.py), one allocator per process.

usage:
  workloads_steady.py run NAME ALLOCATOR [RUNS]    prints STEADY {json}
  workloads_steady.py summarize FILE.jsonl         a Markdown table of what `run` printed

ALLOCATOR: native | native_expandable | ccalloc | ccalloc_slack25 (CCALLOC_CONF=page_slack:0.25) |
ccalloc_budget0 (CCALLOC_CONF=page_move_budget:0: reserved ≈ live whatever page moves cost) |
ccalloc_prev (another build, $CCALLOC_PREV_LIBRARY, default <repo>/gpu/prev/libccalloc.so: an A/B of
two builds in one run).

workloads.py times one cold run: imports (transformers, torchvision), cuBLAS/cuDNN start-up and
the allocator's first growth fall inside its clock, and those vary by ±15% from run to run,
more than the 2% being looked for. Here the same workload functions (taken from workloads.py's
source, unchanged) run once untimed, then RUNS more times, each between two
torch.cuda.synchronize() calls: what remains is the steady state a training or serving job
spends its hours in. The model is rebuilt on every run, as workloads.py does.

workloads.py is looked up by run_workload_ccalloc.find_bench ($CCALLOC_BENCH, $CCALLOC_SHARED/bench,
$CCALLOC_SHARED, <repo>/../shared/bench, <repo>/gpu/shared_bench); the library is $CCALLOC_LIBRARY (default
<repo>/gpu/libccalloc.so).
"""

from __future__ import annotations

import ast
import json
import os
import statistics
import sys
import time

from run_workload_ccalloc import REPO, find_bench  # this folder: the same lookup of workloads.py
WORKLOADS = ("gpt2_train_varlen", "resnet50_train", "bert_infer_varlen", "mlp_sidestream")
ALLOCATORS = ("native", "native_expandable", "ccalloc", "ccalloc_slack25", "ccalloc_budget0", "ccalloc_prev")
# ccalloc settings per allocator name: ccalloc_slack25 trades memory for fewer page moves,
# ccalloc_budget0 never trades.
CCALLOC_CONF = {
    "ccalloc": "",
    "ccalloc_slack25": "page_slack:0.25",
    "ccalloc_budget0": "page_move_budget:0",
    "ccalloc_prev": "",
}
# Counters worth seeing beside the times (both PyTorch's and ccalloc's memory_stats have them).
COUNTERS = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries")


def load_workload(name: str, namespace: dict):
    """The workload's function, compiled from workloads.py's own source (nothing else of it runs)."""
    path = os.path.join(find_bench(), "workloads.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if not defs:
        sys.exit(f"workloads_steady.py: {path} has no function {name}")
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


def run(name: str, allocator: str, runs: int) -> int:
    if allocator == "native_expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    stats = None
    if allocator in CCALLOC_CONF:
        os.environ["CCALLOC_CONF"] = CCALLOC_CONF[allocator]
        os.environ.setdefault("CCALLOC_LIBRARY", os.path.join(REPO, "gpu", "libccalloc.so"))
        if allocator == "ccalloc_prev":
            os.environ["CCALLOC_LIBRARY"] = os.environ.get(
                "CCALLOC_PREV_LIBRARY", os.path.join(REPO, "gpu", "prev", "libccalloc.so"))
        os.environ["CCALLOC_BACKEND"] = "cuda"
        sys.path.insert(0, os.path.join(REPO, "python"))
        import ccalloc
        import ccalloc.torch

        ccalloc.torch.enable()
        stats = ccalloc
    import random

    import torch

    if stats is None:
        stats = torch.cuda
    workload = load_workload(name, {"torch": torch, "random": random})
    torch.zeros(1, device="cuda")
    seconds = []
    paging = getattr(stats, "paging_stats", None)  # ccalloc only
    for i in range(runs + 1):
        if i == 1 and paging:
            warm = paging()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        workload()
        torch.cuda.synchronize()
        if i > 0:  # run 0 warms up
            seconds.append(round(time.perf_counter() - t0, 4))
    result = {
        "workload": name,
        "allocator": allocator,
        "round": int(os.environ.get("STEADY_ROUND", "0")),
        "seconds": seconds,
        "max_memory_reserved": stats.max_memory_reserved(),
        "max_memory_allocated": stats.max_memory_allocated(),
    }
    counters = stats.memory_stats()
    result.update({k: counters[k] for k in COUNTERS if k in counters})
    if paging and runs > 0:
        # What reserved ≈ live cost during the timed runs: time in growth (and in growth
        # that moved pages) as a share of the timed seconds, host waits, the slack reached.
        now = paging()
        timed = sum(seconds)
        result["paging"] = {
            "growths": now["growths"] - warm["growths"],
            "moving_growths": now["moving_growths"] - warm["moving_growths"],
            "host_waits": now["host_waits"] - warm["host_waits"],
            "growth_share": round((now["growth_ns"] - warm["growth_ns"]) / 1e9 / timed, 5),
            "moving_share": round((now["moving_ns"] - warm["moving_ns"]) / 1e9 / timed, 5),
            "page_slack": round(now["page_slack"], 4),
        }
    print("STEADY " + json.dumps(result), flush=True)
    return 0


def summarize(path: str) -> int:
    rows: dict[tuple[str, str], list[float]] = {}
    reserved: dict[tuple[str, str], int] = {}
    paging_rows: list = []
    # (workload, allocator, round) -> that process's median: rounds pair processes run
    # back to back, so their ratio cancels the machine's slow drift between rounds.
    by_round: dict[tuple[str, str, int], float] = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("STEADY "):
                continue
            r = json.loads(line[len("STEADY "):])
            key = (r["workload"], r["allocator"])
            rows.setdefault(key, []).extend(r["seconds"])
            if r["seconds"]:
                by_round[(*key, r.get("round", 0))] = statistics.median(r["seconds"])
            reserved[key] = max(reserved.get(key, 0), r["max_memory_reserved"])
            if "paging" in r:
                paging_rows.append((key, r["paging"]))
    names = [w for w in WORKLOADS if any(k[0] == w for k in rows)]
    allocs = [a for a in ALLOCATORS if any(k[1] == a for k in rows)]
    print("Steady state (benches/gpu/workloads_steady.py): each process runs the workload once to warm "
          "up, then times the next runs; median (min) seconds over all timed runs of all processes.\n")
    head = "| workload | " + " | ".join(f"{a} s" for a in allocs)
    if "ccalloc" in allocs and "native" in allocs:
        head += " | ccalloc/native (median) | ccalloc/native (min) | runs per allocator"
    print(head + " |")
    print("|---" * (head.count("|") - 0) + "|")
    verdicts = []
    for w in names:
        cells = []
        for a in allocs:
            t = rows.get((w, a), [])
            cells.append(f"{statistics.median(t):.3f} ({min(t):.3f})" if t else "—")
        line = f"| {w} | " + " | ".join(cells)
        if "ccalloc" in allocs and "native" in allocs and rows.get((w, "ccalloc")) and rows.get((w, "native")):
            c, n = rows[(w, "ccalloc")], rows[(w, "native")]
            med = statistics.median(c) / statistics.median(n)
            low = min(c) / min(n)
            verdicts.append((w, med))
            line += f" | {med:.3f} | {low:.3f} | {len(c)}"
        print(line + " |")
    paired = {}
    for (w, a, rnd), t in by_round.items():
        if a == "ccalloc" and (w, "native", rnd) in by_round:
            paired.setdefault(w, []).append(t / by_round[(w, "native", rnd)])
    if paired:
        print("\nPaired by round (each round runs every allocator's process back to back, the order "
              "reversed every other round): ccalloc/native of each round's medians.\n")
        print("| workload | median of the rounds' ratios | rounds | each round |")
        print("|---|---:|---:|---|")
        for w in names:
            if w in paired:
                r = paired[w]
                print(f"| {w} | {statistics.median(r):.3f} | {len(r)} | {', '.join(f'{x:.3f}' for x in r)} |")
    if paging_rows:
        print("\nccalloc's own time in paged-segment growth during the timed runs (share of their "
              "seconds; moving = growth that moved pages; per process):\n")
        print("| workload | allocator | growth share | moving share | growths (moving) | host waits | page slack |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for (w, a), p in paging_rows:
            print(f"| {w} | {a} | {p['growth_share']:.2%} | {p['moving_share']:.2%} | "
                  f"{p['growths']} ({p['moving_growths']}) | {p['host_waits']} | {p['page_slack']:.3f} |")
    print("\nAll timed runs (s): " + "; ".join(f"{w}/{a}: {', '.join(f'{x:.3f}' for x in t)}"
                                            for (w, a), t in sorted(rows.items())))
    if verdicts:
        worst = max(verdicts, key=lambda v: v[1])
        ok = all(m <= 1.02 for _, m in verdicts)
        print(f"\nccalloc median time within 2% of native on every workload: {'YES' if ok else 'NO'} "
              f"(worst {worst[0]}: {worst[1]:.3f})")
    return 0


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "run":
        name, allocator = sys.argv[2], sys.argv[3]
        if name not in WORKLOADS or allocator not in ALLOCATORS:
            sys.exit(__doc__)
        return run(name, allocator, int(sys.argv[4]) if len(sys.argv) > 4 else 3)
    if len(sys.argv) == 3 and sys.argv[1] == "summarize":
        return summarize(sys.argv[2])
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
