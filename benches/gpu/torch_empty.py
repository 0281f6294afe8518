"""`torch.empty` + `del` loop per size, through PyTorch: native vs ccalloc, and how much of
the time is PyTorch's own (its CUDAPluggableAllocator wrapper takes a mutex and updates a
pointer map around every call, and tensor creation costs what it costs). Each allocator runs
in its own process; "null" is a near-zero-cost pluggable allocator (benches/gpu/null_alloc.c),
so its time is what PyTorch adds around any pluggable allocator.

    python3 benches/gpu/torch_empty.py            # all three, prints a table
    python3 benches/gpu/torch_empty.py run KIND   # one process (native, ccalloc or null)

The last row runs the 4 KiB loop again once 16 tensors, each allocated where a temporary
of its size was just freed, stay live (`kept_loop`).

Environment: CCALLOC_LIBRARY (default <repo>/gpu/libccalloc.so), NULL_ALLOC_SO (built from
null_alloc.c with gcc when missing), ITERS (default 20000), REPEATS (default 7; the median
repeat is reported).
"""
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [512, 4096, 1 << 20, 64 << 20]
KINDS = ["native", "ccalloc", "null"]
ITERS = int(os.environ.get("ITERS", "20000"))
REPEATS = int(os.environ.get("REPEATS", "7"))
# Tensors kept live before the last row (`kept_loop`), and that row's key.
LIVE_KEPT = 16
KEPT = "4096_kept"


def null_library():
    path = os.environ.get("NULL_ALLOC_SO", "/tmp/ccalloc_null_alloc.so")
    if not os.path.exists(path):
        cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        subprocess.run(
            ["gcc", "-O2", "-shared", "-fPIC", os.path.join(ROOT, "benches/gpu/null_alloc.c"),
             f"-I{cuda}/include", f"-L{cuda}/lib64", "-lcudart", "-o", path],
            check=True,
        )
    return path


def run(kind):
    import torch

    if kind == "ccalloc":
        sys.path.insert(0, os.path.join(ROOT, "python"))
        os.environ.setdefault("CCALLOC_LIBRARY", os.path.join(ROOT, "gpu/libccalloc.so"))
        import ccalloc.torch

        ccalloc.torch.enable()
    elif kind == "null":
        allocator = torch.cuda.memory.CUDAPluggableAllocator(null_library(), "null_alloc", "null_free")
        torch.cuda.memory.change_current_allocator(allocator)
    elif kind != "native":
        raise SystemExit(f"unknown kind {kind}")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    empty, u8 = torch.empty, torch.uint8
    result = {"kind": kind, "iters": ITERS, "ns": {}}
    for size in SIZES:
        for _ in range(ITERS // 10):  # warm the cache and the interpreter
            x = empty(size, dtype=u8, device="cuda")
            del x
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter_ns()
            for _ in range(ITERS):
                x = empty(size, dtype=u8, device="cuda")
                del x
            times.append((time.perf_counter_ns() - t0) / ITERS)
        result["ns"][str(size)] = statistics.median(times)
    result["ns"][KEPT] = kept_loop(empty, u8)
    torch.cuda.synchronize()
    print("TORCH_EMPTY " + json.dumps(result), flush=True)


def kept_loop(empty, u8):
    """The 4 KiB loop again, once this thread has kept LIVE_KEPT tensors each allocated
    where a temporary of its size was just freed (a job's optimizer state, made at the
    first step at the sizes of the gradients just freed): such blocks must not stop
    ccalloc's thread front from serving the loop."""
    kept = []
    for i in range(LIVE_KEPT):
        size = 8192 * (i + 2)
        x = empty(size, dtype=u8, device="cuda")
        del x
        kept.append(empty(size, dtype=u8, device="cuda"))
    for _ in range(ITERS // 10):
        x = empty(4096, dtype=u8, device="cuda")
        del x
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter_ns()
        for _ in range(ITERS):
            x = empty(4096, dtype=u8, device="cuda")
            del x
        times.append((time.perf_counter_ns() - t0) / ITERS)
    del kept
    return statistics.median(times)


def label(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else (f"{size >> 10} KiB" if size >= 1024 else f"{size} B")


def main():
    results = {}
    for kind in KINDS:
        out = subprocess.run([sys.executable, __file__, "run", kind], capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("TORCH_EMPTY ")), None)
        if line is None:
            print(f"{kind}: failed (exit {out.returncode})\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
            continue
        results[kind] = json.loads(line[len("TORCH_EMPTY "):])["ns"]
    print(f"torch.empty + del from Python, ns per pair (median of {REPEATS} x {ITERS}):\n")
    print("| size | native | ccalloc | null allocator (PyTorch's share) | ccalloc/native | ccalloc's own (ccalloc − null) |")
    print("|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    rows = [(str(size), label(size)) for size in SIZES]
    rows.append((KEPT, f"4 KiB, {LIVE_KEPT} kept live"))
    for k, name in rows:
        n, c, z = (results.get(kind, {}).get(k) for kind in KINDS)
        if None in (n, c, z):
            print(f"| {name} | {n} | {c} | {z} | — | — |")
            continue
        worst = max(worst, c / n)
        print(f"| {name} | {n:,.0f} | {c:,.0f} | {z:,.0f} | {c / n:.3f} | {c - z:,.0f} |")
    print(f"\nworst ccalloc/native: {worst:.3f}")
    return 0 if len(results) == len(KINDS) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(main())
