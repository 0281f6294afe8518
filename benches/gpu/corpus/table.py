#!/usr/bin/env python3
"""The corpus table, and the plan of a corpus.sh call.

usage:
  table.py [--replay REPLAY.json] FILE.jsonl...   the table of run.py's records (files merged)
  table.py plan BUDGET_S ROUNDS REPS ALLOCATORS WORKLOAD... [-- FILE.jsonl...]
                                                  the estimated seconds of that call (from earlier
                                                  records' process_seconds where FILEs have them),
                                                  and a split into calls of <= BUDGET_S each

Table, per workload: the peak requested bytes (native's), then peak reserved / peak requested
of each allocator (the worst over its runs), then each other allocator's loop time against
native's: in every round (one corpus.sh session and round number) the ratio of the two
processes' median loop seconds, then the median of those ratios over rounds, with their min-max
spread. Processes of one round run back to back, so a ratio within a round cancels the
machine's drift between rounds. A run that failed (exception, OOM, timeout) has no figures: its
cell says ERR and the error is listed under the table. --replay adds `ccalloc replay --json`'s
ratio (sim reserved / trace's live peak) for each traced workload, and PyTorch's own ratio as
the trace recorded it.

The goal column is issue 17's bar: ccalloc's reserved/requested <= 1.03 and below expandable's,
and its paired time <= native's (median ratio <= 1.000).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30
# Seconds a call spends before its first run when ccalloc is among the allocators: on a fresh
# machine ccalloc.torch compiles its PyTorch adapter (~20 s), then CUDA starts once more.
PREP_S = 30



def sharded(allocator: str) -> bool:
    """Whether an allocator entry (`ccalloc@CONF`) runs with per_stream_shards on."""
    return re.search(r"per_stream_shards:(true|1)", allocator, re.IGNORECASE) is not None

def load(paths):
    records = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("CORPUS "):
                    line = line[len("CORPUS "):]
                if line.startswith("{"):
                    records.append(json.loads(line))
    return records


def workload_order():
    sys.path.insert(0, HERE)
    from run import SHARED, corpus_registry

    return [name for name, *_ in corpus_registry()] + list(SHARED)


def ratio_cell(values):
    if not values:
        return "—"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.3f} (1 round)"
    return f"{med:.3f} [{min(values):.3f}–{max(values):.3f}]"


def loop_growth_cell(runs):
    """ccalloc's time growing (driver calls, moves, fence waits) within its timed loops, as a
    share of their time, and of that the host's waits on fences (the device runs queued work
    meanwhile, so a wait slows the loop only by the device's idle time after it): medians over
    runs, with the growths and moving growths of the run that spent the most. The part of a
    time ratio that the paging policy can explain."""
    runs = [r for r in runs if r.get("loop_paging")]
    if not runs:
        return "—"

    def share(r, key):
        return r["loop_paging"][key] / 1e9 / sum(r["loop_seconds"])

    grow = statistics.median(share(r, "growth_ns") for r in runs)
    wait = statistics.median(share(r, "wait_ns") for r in runs)
    worst = max(runs, key=lambda r: r["loop_paging"]["growth_ns"])["loop_paging"]
    cell = (f"{100 * grow:.1f}% ({100 * wait:.1f}% waits; {worst['growths']} growths, "
            f"{worst['moving_growths']} moved)")
    # With several shards (threads on streams of their own), how many, and how often the
    # process's lock acquisitions found the lock held: pages going round the shards is
    # growth this column counts, and the contention is what the shards are for.
    sharded_runs = [r for r in runs if r.get("shards", 1) > 1 and r.get("locks", {}).get("acquisitions")]
    if sharded_runs:
        shards = max(r["shards"] for r in sharded_runs)
        contended = statistics.median(r["locks"]["contended"] / r["locks"]["acquisitions"] for r in sharded_runs)
        cell += f"; {shards} shards, {100 * contended:.2f}% of locks contended"
    return cell


def table(paths, replay_path=None) -> int:
    records = [r for r in load(paths) if not r.get("traced")]
    if not records:
        print("table.py: no records in " + ", ".join(paths))
        return 1
    allocs = []
    for r in records:
        if r["allocator"] not in allocs:
            allocs.append(r["allocator"])
    base = ["native", "expandable", "ccalloc"]
    allocs = [a for a in base if a in allocs] + [a for a in allocs if a not in base]
    order = workload_order()
    names = sorted({r["workload"] for r in records}, key=lambda w: (order.index(w) if w in order else len(order), w))
    replay = {}
    if replay_path:
        with open(replay_path) as f:
            for rep in json.load(f):
                replay[rep["trace"]] = rep

    by = {}  # (workload, allocator) -> records
    for r in records:
        by.setdefault((r["workload"], r["allocator"]), []).append(r)
    errors = [r for r in records if r.get("error")]

    def ok(r):
        return not r.get("error") and r.get("loop_seconds")

    others = [a for a in allocs if a == "ccalloc"] + [a for a in allocs if a not in ("native", "ccalloc")]
    head = ["workload", "requested"] + [f"{a} res/req" for a in allocs] + [f"{a} / native time" for a in others]
    in_loops = any(r.get("loop_paging") for w in names for r in by.get((w, "ccalloc"), []))
    if in_loops:
        head += ["ccalloc growth in loops"]
    if replay:
        head += ["replay ccalloc (torch)"]
    head += ["goal"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 2) + "---|")
    verdicts = []
    for w in names:
        cells = [w]
        req = [r["requested_bytes.all.peak"] for r in by.get((w, "native"), []) if r.get("requested_bytes.all.peak")]
        if not req:
            req = [r["requested_bytes.all.peak"] for a in allocs if not sharded(a) for r in by.get((w, a), [])
                   if r.get("requested_bytes.all.peak")]
        cells.append(f"{statistics.median(req) / GIB:.2f} GiB" if req else "—")
        mem = {}
        for a in allocs:
            runs = by.get((w, a), [])
            if sharded(a):
                # Its own requested peak is the sum of its shards' peaks (an upper bound):
                # measured against the others' requested peak instead.
                ratios = [r["reserved_bytes.all.peak"] / statistics.median(req) for r in runs
                          if not r.get("error") and req]
            else:
                ratios = [r["reserved_bytes.all.peak"] / r["requested_bytes.all.peak"] for r in runs
                          if not r.get("error") and r.get("requested_bytes.all.peak")]
            if ratios:
                mem[a] = max(ratios)
                failed = sum(1 for r in runs if r.get("error"))
                cells.append(f"{mem[a]:.3f}" + (f" ({failed} ERR)" if failed else ""))
            elif any(r.get("error") for r in runs):
                cells.append("ERR")
            else:
                cells.append("—")  # not run, or no statistics (the CPU smoke mode)
        times = {}
        for a in others:
            native = {(r.get("session", ""), r["round"]): statistics.median(r["loop_seconds"])
                      for r in by.get((w, "native"), []) if ok(r)}
            ratios = [statistics.median(r["loop_seconds"]) / native[(r.get("session", ""), r["round"])]
                      for r in by.get((w, a), []) if ok(r) and (r.get("session", ""), r["round"]) in native]
            times[a] = ratios
            cells.append(ratio_cell(ratios))
        if in_loops:
            cells.append(loop_growth_cell([r for r in by.get((w, "ccalloc"), []) if ok(r)]))
        if replay:
            rep = replay.get(w)
            if rep:
                torch_ratio = rep.get("pytorch_ratio")
                cells.append(f"{rep['ratio']:.3f}" + (f" ({torch_ratio:.3f})" if torch_ratio else "")
                             + (" OOM" if rep.get("oom") else ""))
            else:
                cells.append("—")
        goal = []
        if "ccalloc" not in allocs:
            goal.append("no ccalloc runs")
        elif "ccalloc" in mem:
            if mem["ccalloc"] > 1.03:
                goal.append("mem>1.03")
            if "expandable" in mem and mem["ccalloc"] >= mem["expandable"]:
                goal.append("mem>=exp")
        else:
            goal.append("ccalloc failed")
        if times.get("ccalloc"):
            if statistics.median(times["ccalloc"]) > 1.0:
                goal.append("slower")
        elif "ccalloc" in mem:
            goal.append("no paired time")
        verdicts.append((w, goal))
        cells.append("ok" if not goal else ", ".join(goal))
        print("| " + " | ".join(cells) + " |")
    met = sum(1 for _, g in verdicts if not g)
    print(f"\nIssue 17's goal met on {met} of {len(verdicts)} workloads (ccalloc reserved/requested <= 1.03 "
          "and below expandable's; paired loop time <= native's).")
    sessions = sorted({r.get("session", "") for r in records})
    rounds = sorted({(r.get("session", ""), r["round"]) for r in records})
    if any(sharded(a) for a in allocs):
        print("With per_stream_shards, an allocator's own peaks other than reserved bytes are the sum of "
              "its shards' peaks: its res/req divides by the other allocators' requested peak (the "
              "requested column).")
    print(f"{len(records)} runs, {len(rounds)} rounds over {len(sessions)} call(s); res/req = worst over runs; "
          "time = median over rounds of ccalloc's (or expandable's) median loop seconds / native's "
          "in the same round [min–max over rounds].")
    if in_loops:
        print("ccalloc growth in loops: the share of its timed loops' seconds spent growing (mapping, moving "
              "pages, waiting on fences), median over runs; in brackets the share of it spent waiting on "
              "fences (the device busy meanwhile), and the growths and moving growths of the run that "
              "grew the longest; with several shards, how many, and the median share of the process's "
              "lock acquisitions that found the lock held. A time ratio above 1 by more than this share "
              "is not the paging policy's cost.")
    devices = sorted({r["device"] for r in records if r.get("device")})
    if devices:
        print("Device: " + ", ".join(devices) + "; torch " + ", ".join(sorted({r["torch"] for r in records if r.get("torch")})))
    lora = sorted({r["info"]["lora"] for r in records if r.get("info", {}).get("lora")})
    if lora:
        print("llama_lora_finetune adapters: " + ", ".join(lora))
    if errors:
        print("\nFailed runs:\n")
        for r in errors:
            print(f"- {r['workload']} / {r['allocator']} / round {r['round']}: {r['error']}")
    return 0


def plan(budget: float, rounds: int, reps: int, allocators: list, workloads: list, measured: list) -> int:
    """Estimated seconds per workload (its processes over all rounds and allocators): the median
    process_seconds of earlier records (the JSONL files in `measured`) where there are some,
    else the registry's estimate; then a split into calls of at most `budget` seconds, largest
    first (first fit)."""
    sys.path.insert(0, HERE)
    from run import SHARED_EST_S, corpus_registry

    est = {name: e for name, _, _, e in corpus_registry()}
    corpus = set(est)
    est.update(SHARED_EST_S)
    if any(a.startswith("ccalloc") for a in allocators):
        budget -= PREP_S
    seen = {}
    for r in load(measured):
        if r.get("process_seconds") and not r.get("traced") and r.get("reps") == reps:
            seen.setdefault(r["workload"], []).append(r["process_seconds"])
    per = {}
    for w in workloads:
        if w not in est:
            print(f"unknown workload {w}", file=sys.stderr)
            return 2
        if w in seen:
            one = statistics.median(seen[w])
        else:  # the registry's figure assumes 2 timed loops; each further loop adds about a sixth
            one = est[w] * (1 + (reps - 2) / 6)
        per[w] = one * rounds * len(allocators)
        if os.environ.get("TRACE") == "1" and w in corpus:
            per[w] += one  # TRACE=1: one more (native, traced) process
    if seen:
        print(f"measured process seconds (median of earlier runs) for: {' '.join(w for w in workloads if w in seen)}")
    total = sum(per.values())
    print(f"estimated: {total:.0f} s for {len(workloads)} workloads x {len(allocators)} allocators x {rounds} rounds "
          f"(REPS={reps}{', TRACE=1' if os.environ.get('TRACE') == '1' else ''}); budget per call {budget:.0f} s "
          f"of runs" + (f" (after {PREP_S} s of ccalloc set-up)" if any(a.startswith("ccalloc") for a in allocators) else ""))
    if total <= budget:
        return 0
    calls: list[list[str]] = []
    used: list[float] = []
    for w in sorted(workloads, key=lambda w: -per[w]):
        for i in range(len(calls)):
            if used[i] + per[w] <= budget:
                calls[i].append(w)
                used[i] += per[w]
                break
        else:
            calls.append([w])
            used.append(per[w])
    print(f"over the budget: split into {len(calls)} calls:")
    for c, u in zip(calls, used):
        print(f'  WORKLOADS="{" ".join(c)}"   # ~{u:.0f} s')
    return 0


def main() -> int:
    args = sys.argv[1:]
    if len(args) >= 5 and args[0] == "plan":
        rest = args[5:]
        names, files = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
        return plan(float(args[1]), int(args[2]), int(args[3]), args[4].split(), names, files)
    replay = None
    if len(args) >= 2 and args[0] == "--replay":
        replay, args = args[1], args[2:]
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    return table(args, replay)


if __name__ == "__main__":
    sys.exit(main())
