"""Long runs through the Python package: what may degrade only after a job has run a while.

Each test checks figures against a model of what the caller holds; one runs in a fresh
interpreter (``run_python``), since it shuts the library down. What the allocator keeps on
the heap over long runs is checked exactly in Rust (tests/long_runs*.rs), not through the
resident set, which depends on the C library's allocator.
"""

import ccalloc

from conftest import run_python

MiB = 1 << 20


def _run(code):
    result = run_python(code)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout



def test_pinned_loader_statistics_stay_exact_over_a_long_run():
    """A loader over 3,000 batches of ``pinned_empty`` buffers of a cycle of shapes, four in
    flight, recorded on a copy stream that is paused every other batch: after every batch
    ``host_memory_stats`` agrees with the model (active requests are the buffers live or
    awaiting their stream; allocations equal num_host_alloc - num_host_free; totals count
    every buffer); once everything is closed and the cache emptied, nothing is held."""
    copy = 0x5151
    ccalloc.host_empty_cache()
    start = ccalloc.host_memory_stats()
    assert start["active_requests.current"] == 0
    shapes = [(700, 1024), (3 * 1024, 1025), (12, MiB), (96, 1024), (9 * 1024 + 4, 1024)]
    in_flight = []
    made = 0
    try:
        for batch in range(3000):
            ccalloc.sim_pause_stream(copy, batch % 2 == 1)
            shape = shapes[batch % len(shapes)]
            buf = ccalloc.pinned_empty(shape, "uint8")
            buf.record_stream(copy)
            made += 1
            in_flight.append(buf)
            if len(in_flight) > 4:
                in_flight.pop(0).close()
            s = ccalloc.host_memory_stats()
            assert s["allocations.current"] == s["num_host_alloc"] - s["num_host_free"], batch
            assert s["active_requests.allocated"] - start["active_requests.allocated"] == made
            # Live buffers are active; closed ones stay active until their events are seen.
            assert s["active_requests.current"] >= len(in_flight), batch
            assert s["active_requests.current"] <= len(in_flight) + 2, (batch, s)
            live_bytes = sum(b.nbytes for b in in_flight)
            assert s["requested_bytes.current"] >= live_bytes, batch
            assert s["active_bytes.current"] >= live_bytes, batch
            assert s["allocated_bytes.current"] >= s["active_bytes.current"], batch
            assert s["allocated_bytes.peak"] >= s["allocated_bytes.current"], batch
    finally:
        for buf in in_flight:
            buf.close()
        ccalloc.sim_pause_stream(copy, False)
    ccalloc.host_empty_cache()
    s = ccalloc.host_memory_stats()
    assert s["active_requests.current"] == 0
    assert s["active_bytes.current"] == 0
    assert s["requested_bytes.current"] == 0
    assert s["allocations.current"] == 0
    assert s["allocated_bytes.current"] == 0
    assert s["num_host_alloc"] - s["num_host_free"] == 0
    assert s["active_requests.freed"] - start["active_requests.freed"] == made


def test_init_shutdown_cycles_with_pinned_memory_and_snapshots_start_clean():
    """300 cycles of init, pinned and managed buffers (recorded, prefetched), device blocks,
    a snapshot with the history on, and shutdown: each cycle's statistics start from zero.
    (What the cycles hold on the heap is checked exactly in Rust: tests/long_runs_host.rs.)"""
    out = _run(
        """
import ccalloc, ccalloc.memory
def cycle():
    ccalloc.init()
    s = ccalloc.host_memory_stats()
    assert s["active_requests.allocated"] == 0 and s["num_host_alloc"] == 0, s
    ccalloc.memory._record_memory_history(max_entries=1000)
    bufs = [ccalloc.pinned_empty((64, 1024), "uint8") for _ in range(3)]
    bufs[0].record_stream(0x33)
    m = ccalloc.managed_empty((1 << 20,), "uint8")
    ccalloc.prefetch(m, 0, stream=0x33)
    p = ccalloc.malloc(3 << 20)
    ccalloc.record_stream(p, 0x33)
    snap = ccalloc.memory._snapshot()
    assert snap["segments"]
    ccalloc.free(p)
    for b in bufs:
        b.close()
    m.close()
    ccalloc.memory._record_memory_history(None)
    ccalloc.shutdown()
for _ in range(300):
    cycle()
print("cycles done")
"""
    )
    assert out
