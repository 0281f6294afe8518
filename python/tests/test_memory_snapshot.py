"""ccalloc.memory: history and snapshots in PyTorch's format, without PyTorch (sim backend)."""

import os
import pickle
import subprocess

import ccalloc
import ccalloc.memory as memory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


BLOCK_ACTIONS = ("alloc", "free_requested", "free_completed")


def actions(snapshot, device=0):
    return [(e["action"], e["addr"], e["size"]) for e in snapshot["device_traces"][device]]


def block_actions(snapshot, ptr):
    return [e[0] for e in actions(snapshot) if e[1] == ptr and e[0] in BLOCK_ACTIONS]


def test_history_records_allocs_and_frees_in_order(alloc):
    memory._record_memory_history(max_entries=1000, clear_history=True)
    try:
        assert memory.is_recording()
        a = alloc(1000)
        b = alloc(3 << 20)
        ccalloc.free(a)
        snap = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    events = [e for e in actions(snap) if e[0] in ("alloc", "free_requested", "free_completed")]
    assert events == [
        ("alloc", a, 1000),
        ("alloc", b, 3 << 20),
        ("free_requested", a, 1000),
        ("free_completed", a, 1000),
    ]
    assert any(e[0] in ("segment_alloc", "segment_map") for e in actions(snap))
    assert not memory.is_recording()


def test_a_shared_block_completes_its_free_after_the_other_stream(alloc):
    memory._record_memory_history(max_entries=1000, clear_history=True)
    try:
        p = alloc(4096, stream=1)
        ccalloc.record_stream(p, 2)
        ccalloc.sim_pause_stream(2)
        ccalloc.free(p)
        pending = block_actions(memory._snapshot(), p)
        assert pending == ["alloc", "free_requested"]
        blocks = [b for s in memory._snapshot()["segments"] for b in s["blocks"]]
        assert any(b["address"] == p and b["state"] == "active_pending_free" for b in blocks)
        ccalloc.sim_pause_stream(2, False)
        alloc(4096, stream=1)  # the allocator looks at pending frees again
        done = block_actions(memory._snapshot(), p)
        assert done[:3] == ["alloc", "free_requested", "free_completed"]
    finally:
        memory._record_memory_history(enabled=None)


def test_snapshot_segments_add_up_to_reserved(alloc):
    ptrs = [alloc(size) for size in (512, 4096, 1 << 20, 5 << 20, 64 << 20)]
    snap = memory._snapshot()
    segments = [s for s in snap["segments"] if s["device"] == 0]
    assert sum(s["total_size"] for s in segments) == ccalloc.memory_reserved(0)
    assert sum(s["allocated_size"] for s in segments) == ccalloc.memory_allocated(0)
    live = {b["address"]: b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"}
    assert set(live) == set(ptrs)
    assert live[ptrs[0]]["requested_size"] == 512
    for s in segments:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        assert s["blocks"][0]["address"] == s["address"]


def test_dump_snapshot_writes_a_pickle_that_replay_reads(alloc, tmp_path):
    memory._record_memory_history(max_entries=1000, clear_history=True)
    try:
        p = alloc(1 << 20)
        q = alloc(300)
        ccalloc.free(p)
        path = tmp_path / "snap.pickle"
        memory._dump_snapshot(str(path))
    finally:
        memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}
    assert ("alloc", q, 300) in actions(snap)
    assert ("free_completed", p, 1 << 20) in actions(snap)
    tool = os.path.join(os.path.dirname(ccalloc.library_path()), "ccalloc")
    if os.path.isfile(tool):
        out = subprocess.run([tool, "replay", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "snap" in out.stdout


def test_history_is_bounded(alloc):
    memory._record_memory_history(max_entries=5, clear_history=True)
    try:
        for _ in range(10):
            ccalloc.free(alloc(512))
        assert len(memory._snapshot()["device_traces"][0]) == 5
    finally:
        memory._record_memory_history(enabled=None)


def test_cache_info_is_the_largest_cached_block(alloc):
    ccalloc.empty_cache()
    p = alloc(8 << 20)
    ccalloc.free(p)
    largest = ccalloc.cache_info()
    assert largest >= 8 << 20
    assert largest <= ccalloc.memory_reserved(0)


def test_bad_arguments_are_clear_errors():
    import pytest

    with pytest.raises(ValueError):
        memory._record_memory_history(enabled="sometimes")
    with pytest.raises(ccalloc.InvalidDeviceError):
        memory._snapshot(device=99)
    with pytest.raises(ccalloc.CcallocError, match="cannot write the snapshot"):
        memory._dump_snapshot("/nonexistent-dir/x.pickle")


def test_bad_arguments_are_refused_not_misread(tmp_path):
    """Arguments that were silently cut or wrapped (found by an adversarial test): a device
    index past 32 bits read as device 0, max_entries=2**64 as 0, a NUL in a filename
    truncating the path."""
    import pytest

    for device in (2**40, 2**31, True, 1.5, "cpu"):
        with pytest.raises((ValueError, TypeError, ccalloc.CcallocError)):
            memory._snapshot(device)
    assert memory._snapshot("cuda:0")["device_traces"] is not None
    for bad, error in ((-1, ValueError), ("10", TypeError), (1.5, TypeError)):
        with pytest.raises(error):
            memory._record_memory_history(max_entries=bad)
    memory._record_memory_history(max_entries=2**64 + 3)  # no limit, as sys.maxsize
    try:
        assert memory.is_recording()
    finally:
        memory._record_memory_history(enabled=None)
    with pytest.raises(ValueError):
        memory._dump_snapshot(str(tmp_path / "x\0y"))
    assert not (tmp_path / "x").exists()
