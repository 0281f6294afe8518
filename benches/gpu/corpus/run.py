#!/usr/bin/env python3
"""One corpus run: one workload under one allocator, in this process; prints ``CORPUS {json}``.

usage:
  run.py NAME ALLOCATOR [--reps N] [--round R] [--trace DIR]
  run.py --list              the workloads: name, source, family, expected footprint and seconds

NAME: a workload of workloads.py (this folder) or one of the four shared ones
(shared/bench/workloads.py: gpt2_train_varlen resnet50_train bert_infer_varlen mlp_sidestream).
ALLOCATOR: native | expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) | ccalloc |
ccalloc@CONF (ccalloc with CCALLOC_CONF=CONF, e.g. ccalloc@page_slack:0; with
record_peak_breakdown:True the record has "peak_breakdown", ccalloc.memory_breakdown(at_peak=True)).

What is timed: the steady state. Our workloads build their model and return a loop
(workloads.py); the loop runs once to warm up, then --reps times (default 2), each between two
device synchronisations: "loop_seconds". The shared workloads rebuild their model on every call,
so they are compiled from the shared file's source with a marker before their first loop
(benches/gpu/workloads_steady.py) and their clock starts at the marker.

Memory: peak reserved, allocated and requested bytes of the whole process (model, warm-up and
timed loops): torch.cuda.memory_stats() for native and expandable, ccalloc.memory_stats() (same
keys) for ccalloc. The record's "error" says what failed (an exception, an OOM): the record is
still printed, with the peaks reached so far, and the exit status is 1.

--trace DIR (native only; timings of such a run are not comparable and are marked "traced"):
records the allocator's history from before the model is built to the end with
torch.cuda.memory._record_memory_history and writes DIR/NAME.trace.csv.gz, ``action,addr,size,
stream`` per event: the shared traces' format, which `ccalloc replay` reads.

Environment: CCALLOC_LIBRARY (default <repo>/gpu/libccalloc.so), CCALLOC_CONF (for plain
"ccalloc"; overridden by ccalloc@CONF), CORPUS_ROUND / CORPUS_SESSION (copied into the record:
corpus.sh's round and call), CORPUS_DEVICE=cpu (the smoke mode: tiny sizes on the CPU, native
allocator only, no figures worth reading).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
import traceback

STARTED = time.perf_counter()  # the process's clock, imports of torch and the rest included
HERE = os.path.dirname(os.path.abspath(__file__))
GPU_BENCH = os.path.dirname(HERE)  # benches/gpu: workloads_steady.py, run_workload_ccalloc.py
REPO = os.path.dirname(os.path.dirname(GPU_BENCH))
SHARED = ("gpt2_train_varlen", "resnet50_train", "bert_infer_varlen", "mlp_sidestream")
# Expected seconds of one process for the shared workloads (they rebuild the model per call).
SHARED_EST_S = {"gpt2_train_varlen": 22, "resnet50_train": 14, "bert_infer_varlen": 16, "mlp_sidestream": 10}
SHARED_FAMILY = {
    "gpt2_train_varlen": ("shared: GPT-2 training, variable length", "~12 GiB"),
    "resnet50_train": ("shared: ResNet-50 training", "~5 GiB"),
    "bert_infer_varlen": ("shared: BERT inference, variable batch and length", "~0.3 GiB"),
    "mlp_sidestream": ("shared: MLP training, side-stream copies", "~2 GiB"),
}
KEYS = ("reserved_bytes.all.peak", "allocated_bytes.all.peak", "requested_bytes.all.peak")
COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def set_allocator(allocator: str, cpu: bool):
    """Chooses the allocator before torch touches CUDA; returns the module whose memory_stats()
    answers (torch.cuda or ccalloc), or None on the CPU."""
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if cpu:
        if allocator != "native":
            sys.exit("run.py: CORPUS_DEVICE=cpu runs the native allocator only")
        return None
    if allocator == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif allocator == "ccalloc" or allocator.startswith("ccalloc@"):
        if allocator.startswith("ccalloc@"):
            os.environ["CCALLOC_CONF"] = allocator[len("ccalloc@"):]
        os.environ.setdefault("CCALLOC_LIBRARY", os.path.join(REPO, "gpu", "libccalloc.so"))
        os.environ["CCALLOC_BACKEND"] = "cuda"
        sys.path.insert(0, os.path.join(REPO, "python"))  # the checkout's package is the one measured
        import ccalloc
        import ccalloc.torch

        ccalloc.torch.enable()
        return ccalloc
    elif allocator != "native":
        sys.exit(f"run.py: unknown allocator {allocator!r} (native | expandable | ccalloc | ccalloc@CONF)")
    import torch

    return torch.cuda


def corpus_registry() -> list:
    """(name, family, footprint, est_s) of workloads.py's workloads, read from its source (the
    @workload decorators' literal arguments): listing and planning need no torch."""
    import ast

    path = os.path.join(HERE, "workloads.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", "") == "workload":
                family, footprint, est = (ast.literal_eval(a) for a in deco.args)
                out.append((node.name, family, footprint, est))
    return out


def listing() -> int:
    """One line a workload: name, source, expected seconds of one process, family, footprint."""
    for name, family, footprint, est in corpus_registry():
        print(f"{name}\tcorpus\t{est:g}\t{family}\t{footprint}")
    for name in SHARED:
        family, footprint = SHARED_FAMILY[name]
        print(f"{name}\tshared\t{SHARED_EST_S[name]:g}\t{family}\t{footprint}")
    return 0


def write_trace(torch, path: str) -> dict:
    """The recorded history as the shared traces' CSV; returns a summary for the record."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][0] if snap["device_traces"] else []
    with gzip.open(path, "wt") as f:
        f.write("action,addr,size,stream\n")
        for e in events:
            f.write(f"{e['action']},{e['addr']},{e['size']},{e['stream']}\n")
    return {"trace": path, "trace_events": len(events)}


# The paging counters that accrue, differenced over the timed loops ("loop_paging"): how much
# of the steady state's time went to growing (driver calls, moves, waits on fences) and how
# many growths moved or were refused their moves there. What is left of a time difference
# against native is not the paging policy.
LOOP_PAGING_KEYS = ("growths", "moving_growths", "growths_past_slack", "growth_ns", "moving_ns", "wait_ns",
                    "host_waits")


def paging_now(stats):
    """ccalloc's paging counters now, or None for an allocator without them."""
    if stats is None or not hasattr(stats, "paging_stats"):
        return None
    p = stats.paging_stats()
    # (A build older than the package reads 0 for counters it does not have.)
    return {k: p.get(k, 0) for k in LOOP_PAGING_KEYS}


def main() -> int:
    if "--list" in sys.argv[1:]:
        return listing()
    p = argparse.ArgumentParser(usage=__doc__)
    p.add_argument("name")
    p.add_argument("allocator")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--round", type=int, default=int(os.environ.get("CORPUS_ROUND", "0")))
    p.add_argument("--trace", metavar="DIR")
    args = p.parse_args()
    cpu = os.environ.get("CORPUS_DEVICE", "cuda") == "cpu"
    if args.trace and (args.allocator != "native" or cpu):
        sys.exit("run.py: --trace records PyTorch's native allocator on the GPU only")
    shared = args.name in SHARED
    if not shared and args.name not in [name for name, *_ in corpus_registry()]:
        sys.exit(f"run.py: no workload {args.name!r}; see run.py --list")
    if cpu and shared:
        sys.exit("run.py: the shared workloads need a GPU")

    record = {"workload": args.name, "allocator": args.allocator, "round": args.round,
              "session": os.environ.get("CORPUS_SESSION", ""), "reps": args.reps, "loop_seconds": []}
    record["source"] = "shared" if shared else "corpus"
    try:
        stats = set_allocator(args.allocator, cpu)
        import torch

        if not cpu:
            torch.zeros(1, device="cuda")
            record["device"] = torch.cuda.get_device_name()
    except Exception as e:  # the allocator or CUDA did not start: a record that says so
        record["error"] = f"setup: {type(e).__name__}: {str(e).strip()[:300]}"
        traceback.print_exc()
        print("CORPUS " + json.dumps(record), flush=True)
        return 1
    import random

    record["torch"] = torch.__version__
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10**8)

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    loop_start = [None]
    # The paging counters where each timed loop's clock started, and their growth over the
    # timed loops so far: a shared workload's clock starts at its marker, after its set-up.
    paging_at_start = [None]
    loop_paging = None
    try:
        t0 = time.perf_counter()
        if shared:
            sys.path.insert(0, GPU_BENCH)
            from workloads_steady import LOOP_MARK, load_workload

            def loop_started():
                torch.cuda.synchronize()
                loop_start[0] = time.perf_counter()
                paging_at_start[0] = paging_now(stats)

            run_once = load_workload(args.name, {"torch": torch, "random": random, LOOP_MARK: loop_started})
        else:
            sys.path.insert(0, HERE)
            import workloads as corpus

            ctx = corpus.Ctx("cpu" if cpu else "cuda", tiny=cpu)
            torch.manual_seed(0)
            random.seed(0)
            run_once = corpus.WORKLOADS[args.name].fn(ctx)
            sync()
            record["build_seconds"] = round(time.perf_counter() - t0, 3)
            record["info"] = ctx.info
        for i in range(args.reps + 1):  # call 0 warms up
            sync()
            loop_start[0] = None
            paging_at_start[0] = paging_now(stats)
            start = time.perf_counter()
            run_once()
            sync()
            end = time.perf_counter()
            if shared and loop_start[0] is None:
                raise RuntimeError(f"{args.name}'s marked loop did not run")
            seconds = round(end - (loop_start[0] if shared else start), 4)
            if i == 0:
                record["warmup_seconds"] = seconds
            else:
                end_paging = paging_now(stats)
                if end_paging is not None:
                    loop_paging = {k: (loop_paging or {}).get(k, 0) + end_paging[k] - paging_at_start[0][k]
                                   for k in LOOP_PAGING_KEYS}
                record["loop_seconds"].append(seconds)
    except Exception as e:  # the record still goes out, with the error and the peaks so far
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        record["error"] = ("OOM: " if oom else f"{type(e).__name__}: ") + str(e).strip().splitlines()[0][:300] \
            if str(e).strip() else type(e).__name__
        traceback.print_exc()
    if stats is not None:
        s = stats.memory_stats()
        record.update({k: int(s[k]) for k in KEYS + COUNTERS if k in s})
        if hasattr(stats, "paging_stats"):
            record["paging"] = stats.paging_stats()
            if hasattr(stats, "lock_stats"):
                # Over the whole process: how its threads met the device's locks, and in how
                # many shards.
                record["locks"] = stats.lock_stats()
                record["shards"] = stats.shard_count()
            record["ccalloc_conf"] = os.environ.get("CCALLOC_CONF", "")
            if "record_peak_breakdown" in record["ccalloc_conf"]:
                # What reserved memory was made of right after the allocation that set its peak.
                record["peak_breakdown"] = stats.memory_breakdown(at_peak=True)
            if loop_paging is not None and record["loop_seconds"] and "error" not in record:
                record["loop_paging"] = loop_paging
    if args.trace:
        record["traced"] = True
        record.update(write_trace(torch, os.path.join(args.trace, f"{args.name}.trace.csv.gz")))
    record["process_seconds"] = round(time.perf_counter() - STARTED, 2)
    print("CORPUS " + json.dumps(record), flush=True)
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
