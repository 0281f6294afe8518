"""Error classes and messages of failing calls."""

import pickle
import threading

import pytest

import ccalloc
from ccalloc import _lib
from conftest import GiB, MiB


def test_double_free(alloc):
    p = alloc(4096)
    ccalloc.free(p)
    with pytest.raises(ccalloc.DoubleFreeError) as info:
        ccalloc.free(p)
    e = info.value
    assert e.status is ccalloc.Status.DOUBLE_FREE
    assert e.message == f"{p:#x} on device 0 is not live: it was already freed"
    assert str(e) == e.message + " [CCALLOC_DOUBLE_FREE]"
    assert isinstance(e, ccalloc.CcallocError) and isinstance(e, ValueError) and isinstance(e, RuntimeError)


def test_unknown_pointer():
    with pytest.raises(ccalloc.UnknownPointerError) as info:
        ccalloc.free(0xDEAD0000)
    assert info.value.message == "0xdead0000 was not allocated by ccalloc on device 0"
    assert info.value.status is ccalloc.Status.UNKNOWN_POINTER


def test_pointer_inside_a_block(alloc):
    p = alloc(1 * MiB)
    with pytest.raises(ccalloc.UnknownPointerError, match="points inside a ccalloc block on device 0, not at its start"):
        ccalloc.free(p + 512)
    assert ccalloc.memory_allocated() == 1 * MiB  # nothing changed


def test_wrong_device(alloc):
    p = alloc(4096, device=0)
    q = alloc(4096, device=1)
    with pytest.raises(ccalloc.WrongDeviceError) as info:
        ccalloc.free(p, device=1)
    assert info.value.message == f"{p:#x} belongs to device 0, not device 1"
    ccalloc.free(q, device=1)


def test_out_of_memory_beyond_capacity(alloc, fresh_stats):
    with pytest.raises(ccalloc.OutOfMemoryError) as info:
        alloc(5 * GiB)
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, ccalloc.CcallocError)
    assert e.status is ccalloc.Status.OUT_OF_MEMORY
    assert "Tried to allocate 5.00 GiB" in e.message and "The device has 4.00 GiB in all" in e.message
    assert "reserved" in e.message and "largest free block" in e.message
    assert ccalloc.memory_stats()["num_ooms"] == 1


def test_out_of_memory_after_freeing_cache(alloc, fresh_stats):
    a = alloc(3 * GiB)
    b = alloc(512 * MiB)
    ccalloc.free(b)  # cached: freed to make room before giving up
    with pytest.raises(ccalloc.OutOfMemoryError) as info:
        alloc(1536 * MiB)  # 3 GiB live + 1.5 GiB > 4 GiB, even without the cache
    message = info.value.message
    assert message.startswith("CUDA out of memory on device 0. Tried to allocate 1.50 GiB")
    assert "The device has 4.00 GiB in all." in message
    assert "ccalloc holds 3.00 GiB reserved: 3.00 GiB live in allocations" in message
    stats = ccalloc.memory_stats()
    assert stats["num_ooms"] == 1
    assert stats["num_alloc_retries"] == 1
    assert stats["num_sync_all_streams"] >= 1
    assert ccalloc.memory_reserved() == 3 * GiB  # the cached 512 MiB went back
    ccalloc.free(a)
    # With the memory back, the same request succeeds.
    ccalloc.free(alloc(1536 * MiB))


def test_oom_is_caught_as_memory_error(alloc):
    try:
        alloc(8 * GiB)
    except MemoryError as e:
        assert type(e) is ccalloc.OutOfMemoryError
    else:
        pytest.fail("no MemoryError")


def test_invalid_size_and_arguments():
    with pytest.raises(ccalloc.InvalidSizeError, match="size 0: nothing to allocate"):
        ccalloc.malloc(0)
    with pytest.raises(ValueError, match="size must be >= 0"):
        ccalloc.malloc(-1)
    with pytest.raises(OverflowError):
        ccalloc.malloc(1 << 64)
    with pytest.raises(TypeError):
        ccalloc.malloc(1.5)
    with pytest.raises(TypeError):
        ccalloc.malloc(True)
    with pytest.raises(ccalloc.InvalidDeviceError):
        ccalloc.malloc(512, device=3)
    with pytest.raises(ValueError):
        ccalloc.free(-1)
    with pytest.raises(TypeError):
        ccalloc.free("0x1000")


def test_free_null_is_a_no_op():
    ccalloc.free(0)
    ccalloc.free(None)


def test_record_stream_null_is_invalid_argument():
    with pytest.raises(ccalloc.InvalidArgumentError, match="ptr is NULL") as info:
        ccalloc.record_stream(0, stream=5)
    assert isinstance(info.value, ValueError)


def test_errors_pickle():
    error = _lib.error_for(ccalloc.Status.OUT_OF_MEMORY, "no room")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ccalloc.OutOfMemoryError
    assert copy.status is ccalloc.Status.OUT_OF_MEMORY and copy.message == "no room"


def test_unknown_status_gives_base_class():
    error = _lib.error_for(99, "future status")
    assert type(error) is ccalloc.CcallocError
    assert error.status == 99
    assert str(error) == "future status [status 99]"


def test_messages_are_per_thread(alloc):
    """ccalloc_last_error() is thread-local: concurrent failures keep their own messages."""
    ptrs = [alloc(10 * MiB) for _ in range(8)]
    for p in ptrs:
        ccalloc.free(p)
    results = {}

    def worker(i, p):
        for _ in range(200):
            try:
                ccalloc.free(p)
            except (ccalloc.DoubleFreeError, ccalloc.UnknownPointerError) as e:
                # Double free, or "inside a block" once the freed block merged with a neighbour.
                results.setdefault(i, set()).add(e.message)

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(ptrs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(ptrs):
        assert len(results[i]) == 1, results[i]
        assert next(iter(results[i])).startswith(f"{p:#x} "), (hex(p), results[i])
