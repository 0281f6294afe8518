#!/usr/bin/env python3
"""Runs one of the shared workloads (shared/bench/workloads.py) with ccalloc as PyTorch's allocator.

usage: run_workload_ccalloc.py NAME [OUTDIR]

NAME: gpt2_train_varlen | resnet50_train | bert_infer_varlen | mlp_sidestream.

workloads.py's own ``so:`` mode swaps in a CUDAPluggableAllocator but cannot read ccalloc's
statistics. Here ``ccalloc.torch.enable()`` runs first (before CUDA is initialised), then
workloads.py is executed in this process with runpy as ``workloads.py NAME native OUTDIR``:
its ``native`` mode leaves the allocator alone, so the workload runs on ccalloc. Its closing
``torch.cuda.memory_stats()`` (which PyTorch does not support for pluggable allocators) is
answered by ``ccalloc.memory_stats()``, which has the same keys. workloads.py's own result
line is printed as ``WORKLOADS_RESULT {...}`` (its "allocator" says "native"); this script
then prints ``CCALLOC {json}``: that result with "allocator": "ccalloc" and ccalloc's
max_memory_reserved, max_memory_allocated, num_alloc_retries, num_ooms and more.
ccalloc's memory summary goes to stderr.

Where workloads.py is looked up: $CCALLOC_BENCH (a folder holding it), else
$CCALLOC_SHARED/bench, else <repo>/../shared/bench, else <repo>/gpu/shared_bench.
The library: $CCALLOC_LIBRARY, default <repo>/gpu/libccalloc.so; <repo>/python is added to
sys.path when ccalloc is not importable.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKLOADS = ("gpt2_train_varlen", "resnet50_train", "bert_infer_varlen", "mlp_sidestream")


def find_bench() -> str:
    candidates = []
    if os.environ.get("CCALLOC_BENCH"):
        candidates.append(os.environ["CCALLOC_BENCH"])
    if os.environ.get("CCALLOC_SHARED"):
        shared = os.environ["CCALLOC_SHARED"]
        candidates += [os.path.join(shared, "bench"), shared]
    candidates += [os.path.join(REPO, "..", "shared", "bench"), os.path.join(REPO, "gpu", "shared_bench")]
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "workloads.py")):
            return os.path.abspath(folder)
    sys.exit(f"run_workload_ccalloc.py: workloads.py not found in any of {candidates}; "
             f"set CCALLOC_SHARED (the shared folder) or CCALLOC_BENCH (the bench folder)")


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in WORKLOADS:
        sys.exit(f"usage: {sys.argv[0]} NAME [OUTDIR]   (NAME: {' | '.join(WORKLOADS)})")
    name = sys.argv[1]
    outdir = sys.argv[2] if len(sys.argv) > 2 else tempfile.gettempdir()
    script = os.path.join(find_bench(), "workloads.py")

    # PyTorch's own allocator settings would not apply to ccalloc; keep the run clean.
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if not os.environ.get("CCALLOC_LIBRARY"):
        default = os.path.join(REPO, "gpu", "libccalloc.so")
        if os.path.exists(default):
            os.environ["CCALLOC_LIBRARY"] = default
    try:
        import ccalloc
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "python"))
        import ccalloc
    import ccalloc.torch

    ccalloc.torch.enable()  # before workloads.py initialises CUDA
    import torch

    def memory_stats(device=None):
        return ccalloc.memory_stats(device)

    torch.cuda.memory_stats = memory_stats
    torch.cuda.memory.memory_stats = memory_stats

    def renamed_print(*args, **kwargs):
        # workloads.py's "RESULT {...}" would claim allocator "native": rename it.
        if args and isinstance(args[0], str) and args[0].startswith("RESULT "):
            args = ("WORKLOADS_RESULT " + args[0][len("RESULT "):],) + args[1:]
        print(*args, **kwargs)

    sys.argv = [script, name, "native", outdir]
    module = runpy.run_path(script, init_globals={"print": renamed_print}, run_name="__main__")
    result = dict(module["r"])
    stats = ccalloc.memory_stats()
    result["allocator"] = "ccalloc"
    result.update(
        ccalloc_max_memory_reserved=ccalloc.max_memory_reserved(),
        ccalloc_max_memory_allocated=ccalloc.max_memory_allocated(),
        ccalloc_memory_reserved_end=ccalloc.memory_reserved(),
        ccalloc_requested_peak=stats["requested_bytes.all.peak"],
        num_alloc_retries=stats["num_alloc_retries"],
        num_ooms=stats["num_ooms"],
        num_device_alloc=stats["num_device_alloc"],
        num_device_free=stats["num_device_free"],
        num_sync_all_streams=stats["num_sync_all_streams"],
        ccalloc_version=ccalloc.version(),
        ccalloc_library=ccalloc.library_path(),
        ccalloc_conf=os.environ.get("CCALLOC_CONF", ""),
        # What keeping reserved near live cost (growths, moves, waits, the slack reached).
        ccalloc_paging=ccalloc.paging_stats(),
    )
    print("CCALLOC " + json.dumps(result), flush=True)
    print(ccalloc.memory_summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
