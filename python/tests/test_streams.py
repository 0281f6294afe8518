"""record_stream() with paused sim streams, stream arguments, and the private-pool binding."""

import ctypes
import types

import pytest

import ccalloc
from ccalloc import _lib
from conftest import MiB, run_python

S1, S2 = 1, 2  # on the sim backend any value is a stream


def active_bytes(device=0):
    return ccalloc.memory_stats(device)["active_bytes.all.current"]


def test_block_waits_for_a_paused_recorded_stream(alloc, fresh_stats):
    p = alloc(4 * MiB, stream=S1)
    ccalloc.record_stream(p, S2)
    ccalloc.sim_pause_stream(S2)
    ccalloc.free(p)
    # Freed for the caller, but still active: S2's work queued before the free is pending.
    assert ccalloc.memory_allocated() == 0
    assert active_bytes() == 4 * MiB
    q = alloc(4 * MiB, stream=S1)
    assert q != p  # not handed out again while S2 may still use it
    assert active_bytes() == 8 * MiB
    ccalloc.free(q)

    ccalloc.sim_pause_stream(S2, False)
    assert active_bytes() == 4 * MiB  # events are polled on the next allocation
    r = alloc(512, stream=S1)
    assert active_bytes() == 512
    ccalloc.free(r)
    assert active_bytes() == 0


def test_block_without_other_streams_is_reused_at_once(alloc, fresh_stats):
    ccalloc.sim_pause_stream(S2)  # irrelevant: p is never used on S2
    p = alloc(4 * MiB, stream=S1)
    ccalloc.free(p)
    assert active_bytes() == 0
    assert alloc(4 * MiB, stream=S1) == p


def test_recording_the_own_stream_changes_nothing(alloc, fresh_stats):
    ccalloc.sim_pause_stream(S1)
    p = alloc(4 * MiB, stream=S1)
    ccalloc.record_stream(p, S1)
    ccalloc.free(p)
    assert active_bytes() == 0


def test_empty_cache_waits_for_paused_streams(alloc, fresh_stats):
    p = alloc(4 * MiB, stream=S1)
    ccalloc.record_stream(p, S2)
    ccalloc.sim_pause_stream(S2)
    ccalloc.free(p)
    assert active_bytes() == 4 * MiB
    ccalloc.empty_cache(0)  # synchronizes: the pending block becomes free and is released
    assert active_bytes() == 0
    assert ccalloc.memory_reserved() == 0
    assert ccalloc.memory_stats()["num_sync_all_streams"] >= 1


def test_record_stream_errors(alloc):
    p = alloc(4096)
    ccalloc.free(p)
    with pytest.raises(ccalloc.DoubleFreeError):
        ccalloc.record_stream(p, S2)
    with pytest.raises(ccalloc.UnknownPointerError):
        ccalloc.record_stream(0xDEAD0000, S2)
    q = alloc(4096, device=1)
    with pytest.raises(ccalloc.WrongDeviceError):
        ccalloc.record_stream(q, S2, device=0)
    ccalloc.record_stream(q, S2, device="cuda:1")


def test_sim_helpers_validate_devices():
    with pytest.raises(ccalloc.InvalidDeviceError):
        ccalloc.sim_pause_stream(S1, device=9)
    with pytest.raises(ccalloc.InvalidDeviceError):
        ccalloc.sim_device_bytes(9)


@pytest.mark.parametrize(
    "stream, handle",
    [
        (None, 0),
        (0, 0),
        (7, 7),
        ((1 << 64) - 1, (1 << 64) - 1),
        (types.SimpleNamespace(cuda_stream=0x1234), 0x1234),  # torch.cuda.Stream
        (types.SimpleNamespace(ptr=0x5678), 0x5678),  # cupy.cuda.Stream
    ],
)
def test_stream_arguments(stream, handle, alloc):
    assert ccalloc._stream_handle(stream) == handle
    p = alloc(4096, stream=stream)
    ccalloc.record_stream(p, stream)


@pytest.mark.parametrize("stream, error", [("s1", TypeError), (True, TypeError), (-1, ValueError), (1 << 64, ValueError)])
def test_bad_stream_arguments(stream, error):
    with pytest.raises(error):
        ccalloc.malloc(4096, stream=stream)


# --------------------------------------------------------------------------------------------
# Private pools, through the raw binding (argtypes with a struct by value and callbacks)
# --------------------------------------------------------------------------------------------


def test_private_pool_binding(alloc, fresh_stats):
    lib = _lib.load()
    pool = _lib.ccalloc_pool_id(7, 1)
    seen = []
    released = []

    @_lib.ccalloc_stream_filter
    def only_s2(ctx, stream):
        seen.append((ctx, stream))
        return stream == S2

    @_lib.ccalloc_release_fn
    def release(ctx):
        released.append(ctx)

    _lib.check(lib.ccalloc_begin_allocate_to_pool(0, pool, only_s2, 0xC0FFEE, release))
    outside = alloc(4096, stream=S1)  # refused by the filter: ordinary pool
    inside = alloc(4096, stream=S2)  # the private pool: a segment of its own
    assert (0xC0FFEE, S2) in seen
    assert ccalloc.memory_stats()["segment.all.current"] == 2
    _lib.check(lib.ccalloc_end_allocate_to_pool(0, pool))
    assert released == [0xC0FFEE]  # the window closed: ctx handed back

    ccalloc.free(inside)
    again = alloc(4096, stream=S2)  # window closed: not from the private pool's cache
    assert again != inside
    ccalloc.free(again)
    ccalloc.free(outside)
    assert ccalloc.memory_stats()["segment.all.current"] == 3  # S1's, the private one, S2's
    _lib.check(lib.ccalloc_release_pool(0, pool))
    assert ccalloc.memory_stats()["segment.all.current"] == 2  # the private segment went back
    ccalloc.empty_cache()


def test_private_pool_with_null_filter_and_release(alloc, fresh_stats):
    """The header allows NULL for the filter (every stream) and the release callback."""
    lib = _lib.load()
    pool = _lib.ccalloc_pool_id(7, 9)
    _lib.check(lib.ccalloc_begin_allocate_to_pool(0, pool, None, None, None))
    p = alloc(4096, stream=S1)
    q = alloc(4096, stream=S2)
    _lib.check(lib.ccalloc_end_allocate_to_pool(0, pool))
    ccalloc.free(p)
    ccalloc.free(q)
    again = alloc(4096, stream=S1)  # window closed: the private pool's blocks are not reused
    assert again != p
    ccalloc.free(again)
    _lib.check(lib.ccalloc_release_pool(0, pool))
    ccalloc.empty_cache()
    assert ccalloc.memory_reserved() == 0
    with pytest.raises(ctypes.ArgumentError):
        lib.ccalloc_begin_allocate_to_pool(0, pool, 5, None, None)  # not a function pointer


def test_private_pool_errors():
    lib = _lib.load()
    status = lib.ccalloc_end_allocate_to_pool(0, _lib.ccalloc_pool_id(99, 99))
    assert status == ccalloc.Status.INVALID_ARGUMENT
    assert _lib.last_error() == "end_allocate_to_pool: no open window for pool (99, 99)"
    status = lib.ccalloc_release_pool(0, _lib.ccalloc_pool_id(99, 99))
    assert status == ccalloc.Status.INVALID_ARGUMENT
    assert "release_pool: unknown pool" in _lib.last_error()


def test_torch_pool_hooks_with_null_filter(alloc, fresh_stats):
    """The PyTorch hook entry points (void, errors logged) with a NULL std::function."""
    lib = _lib.load()
    pool = _lib.ccalloc_pool_id(3, 4)
    lib.ccalloc_torch_begin_allocate_to_pool(0, pool, None)  # NULL filter: every stream
    p = alloc(4096, stream=S1)
    q = alloc(4096, stream=S2)
    lib.ccalloc_torch_end_allocate_to_pool(0, pool)
    ccalloc.free(p)
    ccalloc.free(q)
    lib.ccalloc_torch_release_pool(0, pool)
    ccalloc.empty_cache()
    assert ccalloc.memory_reserved() == 0
    assert ctypes.sizeof(_lib.ccalloc_pool_id) == 16


def test_threads_on_their_own_streams_keep_statistics_consistent():
    # Each thread starts on a stream of its own, so by default each gets a shard; ctypes
    # releases the GIL during the calls, so they overlap. Reads from the main thread must
    # be one moment's, and every block must come back. The reader yields the GIL after each
    # read: a loop that never does starves the workers of it between their calls (the run
    # took 1-22 s instead of 0.3 on the sim, and over 120 s on a 16-core GPU host, with
    # the workers waiting in take_gil, whichever library).
    out = run_python(
        """
        import threading
        import time
        import ccalloc
        MiB = 1 << 20
        errors = []

        def work(t):
            try:
                seed, live = 7919 * (t + 1), []
                for _ in range(2000):
                    seed = (seed * 1103515245 + 12345) % (1 << 31)
                    live.append(ccalloc.malloc(4096 + seed % (2 * MiB), stream=0x7000 + t))
                    if len(live) > 16:
                        ccalloc.free(live.pop(0))
                for p in live:
                    ccalloc.free(p)
            except Exception as e:
                errors.append(repr(e))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        reads = bad = 0
        while any(th.is_alive() for th in threads):
            s = ccalloc.memory_stats()
            reads += 1
            bad += s["allocated_bytes.all.current"] > s["reserved_bytes.all.current"]
            time.sleep(0)
        for th in threads:
            th.join()
        s = ccalloc.memory_stats()
        print(reads, bad, len(errors), s["allocated_bytes.all.current"],
              s["allocation.all.current"], s["allocation.all.peak"], s["allocation.all.allocated"])
        print(errors[:1])
        """
    )
    assert out.returncode == 0, out.stderr
    reads, bad, errors, allocated, current, peak, total = map(int, out.stdout.split("\n")[0].split())
    assert errors == 0, out.stdout
    assert reads > 0 and bad == 0
    assert allocated == 0 and current == 0
    assert total == 4 * 2000
    assert 17 <= peak <= 4 * 17, "at most 17 blocks live per thread"


def test_shard_count_shows_threads_on_their_own_streams():
    code = """
        import threading
        import ccalloc
        counts = [ccalloc.shard_count()]
        p = ccalloc.malloc(4096, stream=0)
        q = ccalloc.malloc(4096, stream=5)  # the same thread's second stream
        counts.append(ccalloc.shard_count())
        box = []
        t = threading.Thread(target=lambda: box.append(ccalloc.malloc(4096, stream=0x7100)))
        t.start()
        t.join()
        counts.append(ccalloc.shard_count())
        for r in [p, q] + box:
            ccalloc.free(r)
        print(*counts)
    """
    # Shards made at once: the other thread's stream gets its own.
    out = run_python(code, env={"CCALLOC_CONF": "thread_shards_on_contention:False"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "2"]
    # The default waits for contention, and one thread after another never contends.
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "1"]
    out = run_python(code, env={"CCALLOC_CONF": "thread_shards:False"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "1"]
