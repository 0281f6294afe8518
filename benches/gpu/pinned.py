"""Pinned host memory for a data loader: PyTorch's pin_memory against ccalloc's pinned cache.

A loader's pattern (as in shared/traces/mlp_sidestream): batches of varying sizes are staged
in pinned host memory, PREFETCH of them ahead of use, each copied host-to-device on a side
stream while the main stream computes on the previous one. Per kind, in a process of its own:

    pageable  no pinned memory: the copies are synchronous (the overlap reference)
    torch     torch.empty(..., pin_memory=True): PyTorch's CachingHostAllocator (each request
              rounded up to a power of two); peaks from torch.cuda.host_memory_stats()
    ccalloc   ccalloc.torch.pinned_tensor: ccalloc's pinned cache (512-byte rounding, split
              and merge), marked with record_pinned; peaks from ccalloc.host_memory_stats()

Printed: peak pinned bytes (reserved) / peak requested bytes, the number of pinned driver
allocations, and the time per step (CUDA events on the main stream, median of the steps
after warm-up) with the copy overlapping the compute.

    python3 benches/gpu/pinned.py              # all kinds, a table
    python3 benches/gpu/pinned.py run KIND     # one process

Environment: CCALLOC_LIBRARY (default <repo>/gpu/libccalloc.so), STEPS (default 200),
PREFETCH (default 4), MIN_MB / MAX_MB (batch sizes, default 40 and 72), MATMUL (the
compute's square matrix size, default 8192).
"""
import json
import os
import random
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ["pageable", "torch", "ccalloc"]
STEPS = int(os.environ.get("STEPS", "200"))
PREFETCH = int(os.environ.get("PREFETCH", "4"))
MIN_MB = float(os.environ.get("MIN_MB", "40"))
MAX_MB = float(os.environ.get("MAX_MB", "72"))
MATMUL = int(os.environ.get("MATMUL", "8192"))
WARMUP = 10


def batch_sizes():
    """Token batches padded to varying lengths: multiples of 4 KiB in [MIN_MB, MAX_MB]."""
    rng = random.Random(1234)
    low, high = int(MIN_MB * 256), int(MAX_MB * 256)  # in 4 KiB pages
    return [rng.randint(low, high) * 4096 for _ in range(STEPS + PREFETCH)]


def torch_host_peak(torch):
    stats = torch.cuda.host_memory_stats()
    for key in ("reserved_bytes.peak", "segment_bytes.peak", "allocated_bytes.peak"):
        if key in stats:
            allocs = stats.get("num_host_alloc", stats.get("segment.allocated", -1))
            return int(stats[key]), int(allocs), key
    raise SystemExit(f"unknown torch.cuda.host_memory_stats() keys: {sorted(stats)}")


def run(kind):
    import torch

    torch.cuda.init()
    if kind == "ccalloc":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        os.environ.setdefault("CCALLOC_LIBRARY", os.path.join(ROOT, "gpu/libccalloc.so"))
        import ccalloc
        import ccalloc.torch as cct

        def stage(size):
            return cct.pinned_tensor(size, torch.uint8)

        def mark(host, stream):
            cct.record_pinned(host, stream)

    elif kind == "torch":

        def stage(size):
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)

        def mark(host, stream):
            pass  # PyTorch records an event for its own pinned blocks at the copy

    elif kind == "pageable":

        def stage(size):
            return torch.empty(size, dtype=torch.uint8)

        def mark(host, stream):
            pass

    else:
        raise SystemExit(f"unknown kind {kind}")

    sizes = batch_sizes()
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    a = torch.randn(MATMUL, MATMUL, device="cuda", dtype=torch.float16)
    queue, live, peak_requested = [], 0, 0
    step_ms = []
    checksum = 0
    for i, size in enumerate(sizes):
        host = stage(size)
        host[:: 1 << 16] = i % 251  # the loader writes the batch (a stride, to keep it cheap)
        queue.append((host, size))
        live += size
        peak_requested = max(peak_requested, live)
        if len(queue) <= PREFETCH:
            continue
        host, size = queue.pop(0)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        with torch.cuda.stream(side):
            dev = host.to("cuda", non_blocking=True)
            mark(host, side)
        a = a @ a  # the model's step, overlapping the copy
        a = a / a.abs().max().clamp(min=1)
        main.wait_stream(side)
        dev.record_stream(main)
        checksum += int(dev[0].item()) if i % 50 == 0 else 0
        stop.record(main)
        del host, dev
        live -= size
        step_ms.append((start, stop))
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in step_ms[WARMUP:]]
    if kind == "ccalloc":
        stats = ccalloc.host_memory_stats()
        peak, allocs, key = stats["allocated_bytes.peak"], stats["num_host_alloc"], "allocated_bytes.peak"
    elif kind == "torch":
        peak, allocs, key = torch_host_peak(torch)
    else:
        peak, allocs, key = 0, 0, "-"
    result = {
        "kind": kind,
        "peak_pinned": peak,
        "peak_requested": peak_requested,
        "pinned_allocs": allocs,
        "stat": key,
        "step_ms": statistics.median(times),
        "checksum": checksum,
    }
    print("PINNED " + json.dumps(result), flush=True)


def main():
    rows = []
    for kind in KINDS:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "run", kind],
            capture_output=True, text=True,
        )
        line = next((l for l in out.stdout.splitlines() if l.startswith("PINNED ")), None)
        if out.returncode != 0 or line is None:
            print(f"{kind}: failed (exit {out.returncode})\n{out.stdout}\n{out.stderr}", file=sys.stderr)
            continue
        rows.append(json.loads(line[len("PINNED "):]))
    print(f"loader: {STEPS} steps, batches {MIN_MB:g}-{MAX_MB:g} MiB, {PREFETCH} staged ahead, "
          f"matmul {MATMUL}")
    print(f"{'kind':<10} {'peak pinned':>12} {'peak req.':>10} {'ratio':>6} {'allocs':>7} {'ms/step':>8}")
    for r in rows:
        ratio = r["peak_pinned"] / r["peak_requested"] if r["peak_pinned"] else float("nan")
        print(f"{r['kind']:<10} {r['peak_pinned'] / 2**20:>9.0f} MiB {r['peak_requested'] / 2**20:>6.0f} MiB "
              f"{ratio:>6.3f} {r['pinned_allocs']:>7} {r['step_ms']:>8.2f}")
    sums = {r["checksum"] for r in rows}
    if len(sums) > 1:
        print(f"WARNING: the kinds copied different data (checksums {sorted(sums)})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        main()
