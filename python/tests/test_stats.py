"""The PyTorch-compatible statistics API and device arguments."""

import collections
import types

import pytest

import ccalloc
from conftest import MiB, run_python

ARRAYS = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
]
POOLS = ["all", "small_pool", "large_pool"]
METRICS = ["current", "peak", "allocated", "freed"]
COUNTERS = ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"]

EXPECTED_KEYS = sorted(
    [f"{a}.{p}.{m}" for a in ARRAYS for p in POOLS for m in METRICS]
    + [f"{s}.{m}" for s in ("oversize_allocations", "oversize_segments") for m in METRICS]
    + COUNTERS
    + ["max_split_size"]
)


def test_memory_stats_has_pytorch_keys_sorted():
    stats = ccalloc.memory_stats()
    assert isinstance(stats, collections.OrderedDict)
    assert list(stats) == EXPECTED_KEYS
    assert len(stats) == 9 * 3 * 4 + 2 * 4 + 5 + 1
    assert all(type(v) is int for v in stats.values())
    assert stats["max_split_size"] == -1  # unlimited, as PyTorch reports it


def test_nested_dict_matches_flat():
    nested = ccalloc.memory_stats_as_nested_dict()
    flat = ccalloc.memory_stats()
    assert nested["allocated_bytes"]["large_pool"]["peak"] == flat["allocated_bytes.large_pool.peak"]
    assert nested["oversize_segments"]["freed"] == flat["oversize_segments.freed"]
    assert nested["num_ooms"] == flat["num_ooms"]
    assert set(nested) == set(ARRAYS) | {"oversize_allocations", "oversize_segments"} | set(COUNTERS) | {
        "max_split_size"
    }


def test_allocation_updates_every_view(alloc, fresh_stats):
    # Segment sizes and counts depend on the allocator's policy (e.g. expandable segments);
    # what callers asked for and were given does not.
    small = alloc(1000)  # small pool, rounded to 1024
    large = alloc(30 * MiB)  # large pool
    s = ccalloc.memory_stats()
    assert s["allocation.all.current"] == 2
    assert s["allocation.small_pool.current"] == 1
    assert s["allocation.large_pool.current"] == 1
    assert s["allocated_bytes.small_pool.current"] == 1024
    assert s["allocated_bytes.large_pool.current"] == 30 * MiB
    assert s["requested_bytes.all.current"] == 1000 + 30 * MiB
    assert s["active_bytes.all.current"] == 1024 + 30 * MiB
    assert s["active.all.current"] == 2
    for pool in ("small_pool", "large_pool"):
        assert s[f"segment.{pool}.current"] >= 1
        assert s[f"reserved_bytes.{pool}.current"] >= s[f"allocated_bytes.{pool}.current"]
    assert s["segment.all.current"] == s["segment.small_pool.current"] + s["segment.large_pool.current"]
    assert s["num_device_alloc"] >= 2
    assert ccalloc.memory_allocated() == 1024 + 30 * MiB
    assert ccalloc.memory_allocated(0) == ccalloc.memory_allocated("cuda:0")
    reserved = ccalloc.memory_reserved()
    assert reserved == s["reserved_bytes.all.current"] >= 30 * MiB + 1024
    assert ccalloc.sim_device_bytes() == reserved
    assert ccalloc.memory_allocated(1) == 0

    ccalloc.free(large)
    ccalloc.free(small)
    assert ccalloc.memory_allocated() == 0
    assert ccalloc.max_memory_allocated() == 1024 + 30 * MiB
    assert ccalloc.memory_reserved() == reserved  # cached
    assert ccalloc.max_memory_reserved() == reserved
    s = ccalloc.memory_stats()
    assert s["allocated_bytes.all.freed"] == 1024 + 30 * MiB
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] == 2
    assert s["requested_bytes.all.freed"] == 1000 + 30 * MiB

    ccalloc.empty_cache()
    assert ccalloc.memory_reserved() == 0
    assert ccalloc.sim_device_bytes() == 0
    s = ccalloc.memory_stats()
    assert s["segment.all.current"] == 0
    assert s["num_device_free"] >= 2


def test_cache_is_reused(alloc, fresh_stats):
    p = alloc(8 * MiB)
    device_allocs = ccalloc.memory_stats()["num_device_alloc"]
    ccalloc.free(p)
    q = alloc(8 * MiB)
    assert q == p
    assert ccalloc.memory_stats()["num_device_alloc"] == device_allocs  # no new device memory


def test_reset_peak_memory_stats(alloc, fresh_stats):
    p = alloc(40 * MiB)
    ccalloc.free(p)
    assert ccalloc.max_memory_allocated() == 40 * MiB
    ccalloc.reset_peak_memory_stats()
    assert ccalloc.max_memory_allocated() == 0
    assert ccalloc.max_memory_reserved() == ccalloc.memory_reserved() == 40 * MiB
    stats = ccalloc.memory_stats()
    for key, value in stats.items():
        if key.endswith(".peak"):
            assert value == stats[key[: -len("peak")] + "current"], key


def test_reset_accumulated_memory_stats(alloc, fresh_stats):
    p = alloc(4096)
    ccalloc.free(p)
    ccalloc.empty_cache()
    before = ccalloc.memory_stats()
    assert before["allocation.all.allocated"] == 1 and before["num_device_free"] == 1
    ccalloc.reset_accumulated_memory_stats()
    after = ccalloc.memory_stats()
    for key, value in after.items():
        if key.endswith((".allocated", ".freed")) or key.startswith("num_"):
            assert value == 0, key
    assert after["allocated_bytes.all.peak"] == before["allocated_bytes.all.peak"]


def test_devices_are_separate(alloc, fresh_stats):
    p = alloc(3 * MiB, device=1)
    assert ccalloc.memory_allocated(1) == 3 * MiB
    assert ccalloc.memory_allocated("cuda:1") == 3 * MiB
    assert ccalloc.memory_allocated(0) == 0
    ccalloc.reset_peak_memory_stats(0)
    assert ccalloc.max_memory_allocated(1) == 3 * MiB
    ccalloc.free(p, device=1)
    ccalloc.empty_cache(0)  # only device 0: device 1 keeps its cache
    assert ccalloc.memory_reserved(1) > 0
    ccalloc.empty_cache(1)
    assert ccalloc.memory_reserved(1) == 0
    assert ccalloc.sim_device_bytes(1) == 0


def test_oversize_stats_follow_max_split_size(alloc, fresh_stats):
    ccalloc.set_config("max_split_size_mb:256")
    assert ccalloc.memory_stats()["max_split_size"] == 256 * MiB
    p = alloc(300 * MiB)
    small = alloc(100 * MiB)
    s = ccalloc.memory_stats()
    assert s["oversize_allocations.current"] == 1
    assert s["oversize_allocations.allocated"] == 1
    ccalloc.free(p)
    ccalloc.free(small)
    ccalloc.empty_cache()
    s = ccalloc.memory_stats()
    assert s["oversize_allocations.current"] == 0
    assert s["oversize_allocations.freed"] == 1
    assert s["oversize_segments.current"] == 0  # whatever the segments were, none is left


class FakeTorchDevice:
    """Stands in for torch.device (duck-typed: .type and .index)."""

    def __init__(self, type, index=None):
        self.type = type
        self.index = index


@pytest.mark.parametrize(
    "device, index",
    [
        (None, 0),
        (0, 0),
        (1, 1),
        ("cuda", 0),
        ("cuda:1", 1),
        (" cuda:0 ", 0),
        (FakeTorchDevice("cuda", 1), 1),
        (FakeTorchDevice("cuda"), 0),
        (types.SimpleNamespace(type="cuda", index=0), 0),
    ],
)
def test_device_arguments(device, index):
    assert ccalloc._device_index(device) == index
    ccalloc.memory_stats(device)


@pytest.mark.parametrize(
    "device, error",
    [
        ("cpu", ValueError),
        ("cuda:x", ValueError),
        ("cuda:", ValueError),
        (FakeTorchDevice("cpu", 0), ValueError),
        (1 << 40, ValueError),
        (True, TypeError),
        (1.0, TypeError),
        ([0], TypeError),
    ],
)
def test_bad_device_arguments(device, error):
    with pytest.raises(error):
        ccalloc.memory_stats(device)


@pytest.mark.parametrize("device", [2, -1, "cuda:7"])
def test_missing_device_is_a_ccalloc_error(device):
    with pytest.raises(ccalloc.InvalidDeviceError, match=r"does not exist \(sim backend has 2 devices\)") as info:
        ccalloc.memory_stats(device)
    assert info.value.status is ccalloc.Status.INVALID_DEVICE


def test_device_none_follows_torch_when_initialised(monkeypatch):
    fake_cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 1)
    monkeypatch.setitem(__import__("sys").modules, "torch", types.SimpleNamespace(cuda=fake_cuda))
    assert ccalloc._device_index(None) == 1
    assert ccalloc._device_index("cuda") == 1
    fake_cuda.is_initialized = lambda: False
    assert ccalloc._device_index(None) == 0


def test_paging_stats_count_growth_until_reset(alloc, fresh_stats):
    fields = {"growths", "moving_growths", "chunks_mapped", "chunks_unmapped", "host_waits",
              "growth_ns", "moving_ns", "wait_ns", "page_slack", "chunks_borrowed",
              "growths_past_slack"}
    start = ccalloc.paging_stats()
    assert set(start) == fields
    assert all(start[k] == 0 for k in fields - {"page_slack"})
    alloc(30 * MiB)
    grown = ccalloc.paging_stats()
    assert grown["growths"] == 1
    assert grown["chunks_mapped"] >= 4  # 15 pages, in chunks of a sixteenth of the run (one page)
    assert grown["growth_ns"] > 0 and grown["moving_ns"] <= grown["growth_ns"]
    assert grown["wait_ns"] <= grown["growth_ns"]
    assert grown["page_slack"] == pytest.approx(0.03)
    ccalloc.reset_accumulated_memory_stats()
    after = ccalloc.paging_stats()
    assert all(after[k] == 0 for k in fields - {"page_slack"})
    assert after["page_slack"] == grown["page_slack"]


def test_paging_stats_bad_device():
    with pytest.raises(ccalloc.InvalidDeviceError):
        ccalloc.paging_stats(7)


def test_lock_stats_count_acquisitions_and_handoffs_until_reset(alloc, fresh_stats):
    fields = {"acquisitions", "contended", "blocked", "wait_ns", "handoffs"}
    ccalloc.reset_accumulated_memory_stats()
    start = ccalloc.lock_stats()
    assert start == dict.fromkeys(fields, 0)  # the read takes no lock
    alloc(30 * MiB)
    after = ccalloc.lock_stats()
    assert after["acquisitions"] >= 1
    # One thread alone never hands the lock over, nor waits for it.
    assert after["handoffs"] == after["contended"] == after["blocked"] == after["wait_ns"] == 0
    ccalloc.reset_accumulated_memory_stats()
    assert ccalloc.lock_stats() == start


def test_lock_stats_see_another_thread_take_the_lock_in_turn():
    out = run_python(
        """
        import threading
        import ccalloc
        MiB = 1 << 20
        ccalloc.free(ccalloc.malloc(3 * MiB))
        ccalloc.reset_accumulated_memory_stats()
        def other():
            ccalloc.free(ccalloc.malloc(3 * MiB))
        t = threading.Thread(target=other)
        t.start()
        t.join()
        s = ccalloc.lock_stats()
        print(s["handoffs"], s["acquisitions"])
        """
    )
    assert out.returncode == 0, out.stderr
    handoffs, acquisitions = map(int, out.stdout.split())
    # After the reset (main's, which zeroed the counts), the other thread's malloc and free;
    # the read takes no lock.
    assert handoffs == 1
    assert acquisitions >= 2


def test_lock_stats_bad_device():
    with pytest.raises(ccalloc.InvalidDeviceError):
        ccalloc.lock_stats(7)


def test_chunks_borrowed_between_streams_read_through_the_struct():
    # With a shard per stream, stream 2's growth takes the pages stream 1 freed. Read
    # through ctypes, the new last field and the ones before it must be the C struct's.
    out = run_python(
        """
        import ccalloc
        MiB = 1 << 20
        p = ccalloc.malloc(64 * MiB, stream=1)
        ccalloc.free(p)
        q = ccalloc.malloc(64 * MiB, stream=2)
        s = ccalloc.paging_stats()
        print(s["growths"], s["chunks_mapped"], s["chunks_unmapped"], s["chunks_borrowed"],
              s["page_slack"], ccalloc.memory_reserved() // MiB)
        ccalloc.free(q)
        """,
        env={"CCALLOC_CONF": "per_stream_shards:True"},
    )
    assert out.returncode == 0, out.stderr
    growths, mapped, unmapped, borrowed, slack, reserved = out.stdout.split()
    assert int(growths) == 2
    assert 0 < int(borrowed) <= int(unmapped) <= int(mapped)
    assert float(slack) == pytest.approx(0.03)
    assert int(reserved) <= 64 + 8, "stream 2 reused stream 1's pages"


BREAKDOWN_PARTS = ("live_bytes", "free_chunk_bytes", "pinned_bytes", "rounding_bytes", "parked_bytes",
                   "plain_bytes")


def test_memory_breakdown_now_and_at_the_peak(alloc, fresh_stats):
    with pytest.raises(ccalloc.ConfigError, match="record_peak_breakdown"):
        ccalloc.memory_breakdown(at_peak=True)
    ccalloc.set_config("record_peak_breakdown:True")
    kept = [alloc(n * 300 * 1024) for n in range(1, 30)]
    spike = ccalloc.malloc(500 * MiB)
    live_at_spike = ccalloc.memory_allocated()
    ccalloc.free(spike)
    peak = ccalloc.memory_breakdown(at_peak=True)
    now = ccalloc.memory_breakdown()
    for b in (peak, now):
        assert set(b) == set(BREAKDOWN_PARTS) | {"reserved_bytes", "pinning_chunks"}
        assert sum(b[k] for k in BREAKDOWN_PARTS) == b["reserved_bytes"], b
        assert b["plain_bytes"] == 0, "paged segments by default"
    assert peak["reserved_bytes"] == ccalloc.max_memory_reserved()
    assert peak["live_bytes"] == live_at_spike
    assert now["reserved_bytes"] == ccalloc.memory_reserved()
    assert now["live_bytes"] == ccalloc.memory_allocated() < live_at_spike
    assert len(kept) == 29


def test_memory_breakdown_bad_device():
    with pytest.raises(ccalloc.InvalidDeviceError):
        ccalloc.memory_breakdown(7)
