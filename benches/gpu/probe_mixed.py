# Churn mixed (the hot-path harness's pattern) through ccalloc's C API on the CUDA backend,
# then ccalloc's paging statistics: where the time of the burst goes. Run from the repository
# root on the GPU machine: CCALLOC_LIBRARY=gpu/libccalloc.so python3 benches/gpu/probe_mixed.py
# (STEPS, CCALLOC_CONF as usual). Python adds ~8 us per step.
import math, os, random, sys, time
sys.path.insert(0, "python")
import ccalloc
ccalloc.init()
rng = random.Random(2)
lo, hi = math.log(256), math.log(256 << 20)
size = lambda: int(math.exp(rng.uniform(lo, hi)))
live = [ccalloc.malloc(size()) for _ in range(500)]
p0 = ccalloc.paging_stats()
steps = int(os.environ.get("STEPS", "50000"))
t0 = time.perf_counter()
for _ in range(steps):
    i = rng.randrange(500)
    ccalloc.free(live[i])
    live[i] = ccalloc.malloc(size())
dt = time.perf_counter() - t0
p = ccalloc.paging_stats()
d = {k: p[k] - p0[k] for k in p if isinstance(p[k], int)}
print(f"conf={os.environ.get('CCALLOC_CONF','')!r} steps={steps} {dt/steps*1e9:.0f} ns/step; "
      f"growth {d['growth_ns']/1e9/dt*100:.1f}% moving {d['moving_ns']/1e9/dt*100:.1f}% of the time; "
      f"growths {d['growths']} moving {d['moving_growths']} mapped {d['chunks_mapped']} unmapped {d['chunks_unmapped']} "
      f"waits {d['host_waits']}; past the slack {d['growths_past_slack']}; reserved {ccalloc.memory_reserved()/2**30:.2f} GiB")
for q in live: ccalloc.free(q)
