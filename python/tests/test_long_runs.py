"""Long runs through the Python package: what may degrade only after a job has run a while.

Each test runs in a fresh interpreter (``run_python``) where it needs the process's memory
to itself, and checks figures against a model of what the caller holds.
"""

import ccalloc
import ccalloc.memory
import pytest

from conftest import run_python

MiB = 1 << 20


def _run(code):
    result = run_python(code)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


RSS = """
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
"""


def test_stopping_the_history_gives_back_what_recording_held():
    """Recording with ``max_entries=300_000`` until the ring is full, then
    ``_record_memory_history(None)`` (which stops and clears it): the resident set goes back
    to within a quarter of what recording added (the ring alone is over 16 MiB)."""
    out = _run(
        RSS
        + """
import ctypes
import ccalloc, ccalloc.memory
from ccalloc import _lib
ccalloc.init()
ptrs = [ccalloc.malloc(4096) for _ in range(8)]
for p in ptrs:
    ccalloc.free(p)
malloc, free = ccalloc.malloc, ccalloc.free
base = rss()
ccalloc.memory._record_memory_history(max_entries=300_000)
for _ in range(160_000):
    free(malloc(4096))
full = rss()
oldest = ctypes.c_uint64()
_lib.check(_lib.load().ccalloc_history_oldest_seq(ctypes.byref(oldest)))
assert oldest.value > 0, "the ring is full: its oldest entries were dropped"
ccalloc.memory._record_memory_history(None)
after = rss()
assert not ccalloc.memory.is_recording()
print(base, full, after)
assert full - base > 16 << 20, (base, full, after)
assert after - base < (full - base) / 4, (
    f"resident before recording {base}, with the ring full {full}, after stopping and "
    f"clearing {after}: the ring's memory stays held")
assert ccalloc.memory._snapshot()["device_traces"][0] == []
"""
    )
    assert out


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


def test_init_shutdown_cycles_with_pinned_memory_and_snapshots_stay_flat():
    """600 cycles of init, pinned and managed buffers (recorded, prefetched), device blocks,
    a snapshot with the history on, and shutdown: the resident set after the first 100
    cycles grows by less than 1 MiB, and each cycle's statistics start from zero."""
    out = _run(
        RSS
        + """
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
for _ in range(100):
    cycle()
base = rss()
for _ in range(500):
    cycle()
grew = rss() - base
print(grew)
assert grew < 1 << 20, f"resident set grew by {grew} bytes over 500 cycles"
"""
    )
    assert out
