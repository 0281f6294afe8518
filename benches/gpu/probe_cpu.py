"""A corpus workload's loop time beside the host's own speed, in one process: is a slow run
the allocator's calls or the process's CPU? Run on the GPU machine from the repository root:

    python3 benches/gpu/probe_cpu.py WORKLOAD native|expandable|ccalloc

(`CCALLOC_CONF` for ccalloc's settings). Prints a pure-Python control loop's milliseconds
(before the build, after the warm-up loop, after the timed loops), three timed loops as
(wall, process CPU) seconds, the process's threads and peak reserved / peak requested.
The control loop moves 2x on some hosts from process to process and within one: compare
loop times only where the control loops agree.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus"))
name, alloc = sys.argv[1], sys.argv[2]
if alloc == "ccalloc":
    import ccalloc.torch

    ccalloc.torch.enable()
elif alloc == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch  # noqa: E402
import workloads  # noqa: E402


def control_ms():
    t = time.perf_counter()
    x = 0
    for i in range(2_000_000):
        x += i
    return round((time.perf_counter() - t) * 1e3, 1)


def threads():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads")).split()[1])


c = workloads.Ctx()
before = control_ms()
loop = getattr(workloads, name)(c)
loop()
warm = control_ms()
loops = []
for _ in range(3):
    wall, cpu = time.perf_counter(), time.process_time()
    loop()
    loops.append((round(time.perf_counter() - wall, 4), round(time.process_time() - cpu, 4)))
after = control_ms()
torch.cuda.synchronize()
st = torch.cuda.memory_stats()
print(f"{name} {alloc} conf={os.environ.get('CCALLOC_CONF', '')} control_ms {before} {warm} {after} "
      f"loops(wall,cpu) {loops} threads {threads()} "
      f"res/req {st['reserved_bytes.all.peak'] / st['requested_bytes.all.peak']:.3f}", flush=True)
