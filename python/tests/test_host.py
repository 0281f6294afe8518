"""Pinned host and managed memory through the Python API, on the sim backend."""

import gc

import pytest

import ccalloc
from conftest import MiB


@pytest.fixture(autouse=True)
def host_caches_clean():
    yield
    # Emptying waits for recorded streams: a freed block still awaiting one counts as active.
    ccalloc.host_empty_cache()
    ccalloc.managed_empty_cache()
    leaks = (ccalloc.host_memory_stats()["active_requests.current"],
             ccalloc.managed_memory_stats()["allocation.current"])
    assert leaks == (0, 0), f"test left host-side blocks behind: {leaks}"
    assert ccalloc.host_memory_stats()["allocated_bytes.current"] == 0


def test_pinned_blocks_are_cached_and_counted():
    ccalloc.host_empty_cache()
    ccalloc.host_reset_peak_memory_stats()
    before = ccalloc.host_memory_stats()
    a = ccalloc.host_malloc(3 * MiB)
    ccalloc.host_free(a)
    b = ccalloc.host_malloc(3 * MiB)
    assert b == a
    stats = ccalloc.host_memory_stats()
    assert stats["num_host_alloc"] - before["num_host_alloc"] == 1
    assert stats["active_requests.current"] == 1  # PyTorch's names: blocks handed out
    assert stats["active_bytes.current"] >= 3 * MiB
    assert stats["allocations.current"] == 1  # ... and pinned segments owned
    assert stats["requested_bytes.current"] == 3 * MiB
    assert stats["allocated_bytes.current"] >= 3 * MiB
    ccalloc.host_free(b)
    cached = ccalloc.host_memory_stats()
    assert cached["active_requests.current"] == 0 and cached["allocations.current"] == 1
    ccalloc.host_empty_cache()
    assert ccalloc.host_memory_stats()["num_host_free"] - before["num_host_free"] == 1


def test_record_stream_delays_reuse_until_the_stream_is_done():
    s = 0x77
    ccalloc.sim_pause_stream(s, True, device=1)
    try:
        a = ccalloc.host_malloc(4 * MiB)
        ccalloc.host_record_stream(a, s, device=1)
        ccalloc.host_free(a)
        b = ccalloc.host_malloc(4 * MiB)
        assert b != a
        ccalloc.host_free(b)
    finally:
        ccalloc.sim_pause_stream(s, False, device=1)
    c = ccalloc.host_malloc(4 * MiB)
    assert c in (a, b)
    ccalloc.host_free(c)


def test_wrong_kind_and_double_free_are_named(alloc):
    device = alloc(MiB)
    with pytest.raises(ccalloc.UnknownPointerError, match="free it with ccalloc_free"):
        ccalloc.host_free(device)
    pinned = ccalloc.host_malloc(MiB)
    with pytest.raises(ccalloc.UnknownPointerError, match="is a pinned host block"):
        ccalloc.free(pinned, device=0)
    ccalloc.host_free(pinned)
    with pytest.raises(ccalloc.DoubleFreeError):
        ccalloc.host_free(pinned)
    with pytest.raises(ccalloc.InvalidSizeError):
        ccalloc.host_malloc(0)
    ccalloc.host_free(None)


def test_prefetch_and_advice_are_counted_and_checked():
    buf = ccalloc.managed_empty((4 * MiB,), "uint8")
    try:
        before = ccalloc.sim_prefetches(0)
        ccalloc.prefetch(buf, device=0, stream=5)
        ccalloc.prefetch(buf, device=0, stream=5)
        count, moved = ccalloc.sim_prefetches(0)
        assert (count - before[0], moved - before[1]) == (2, 4 * MiB)
        ccalloc.prefetch(buf.ptr, "cpu", 5, size=MiB)
        ccalloc.advise(buf, "set_read_mostly", device=0)
        ccalloc.advise(buf.ptr, ccalloc.Advice.SET_PREFERRED_LOCATION, -1, size=MiB)
        with pytest.raises(ccalloc.InvalidArgumentError, match="past the end"):
            ccalloc.prefetch(buf.ptr + MiB, 0, 5, size=4 * MiB)
        pinned = ccalloc.host_malloc(MiB)
        with pytest.raises(ccalloc.UnknownPointerError, match="not managed"):
            ccalloc.prefetch(pinned, 0, 5, size=MiB)
        ccalloc.host_free(pinned)
        with pytest.raises(TypeError):
            ccalloc.prefetch(buf.ptr, 0)
    finally:
        buf.close()
    freed = ccalloc.managed_malloc(MiB)
    ccalloc.managed_free(freed)
    with pytest.raises(ccalloc.DoubleFreeError, match="advice on freed memory"):
        ccalloc.advise(freed, "set_accessed_by", 0, size=MiB)


def test_buffers_expose_array_interfaces_and_free_themselves():
    buf = ccalloc.pinned_empty((2, 3), "float32")
    face = buf.__array_interface__
    assert face["shape"] == (2, 3) and face["typestr"] == "<f4"
    assert face["data"] == (buf.ptr, False) and buf.nbytes == 24
    view = buf.memoryview()
    view[:4] = b"\x01\x02\x03\x04"
    assert bytes(buf.memoryview()[:4]) == b"\x01\x02\x03\x04"
    with pytest.raises(AttributeError):
        buf.__cuda_array_interface__
    assert ccalloc.host_memory_stats()["active_requests.current"] == 1
    del view, buf
    gc.collect()
    assert ccalloc.host_memory_stats()["active_requests.current"] == 0

    with ccalloc.managed_empty(10, "int64") as m:
        assert m.__cuda_array_interface__["shape"] == (10,)
        assert m.__cuda_array_interface__["typestr"] == "<i8"
        m.record_stream(3)
    assert m.closed
    with pytest.raises(ValueError):
        m.__array_interface__
    m.close()  # once only
    with pytest.raises(ValueError):
        ccalloc.pinned_empty((2,), "nonsense")
    for typestr in ("<x4", "<f0", "|b0"):  # no such kind; a zero-sized item
        with pytest.raises(ValueError):
            ccalloc.pinned_empty((2,), typestr)


def test_memoryview_keeps_its_buffer_alive():
    """A view outlives every other reference to its buffer: the block stays allocated (not
    returned to the driver by ``host_empty_cache``, nor handed to the next buffer) until the
    view goes too."""
    size = 4 * MiB
    view = ccalloc.pinned_empty(size, "uint8").memoryview()
    gc.collect()
    ccalloc.host_empty_cache()
    assert ccalloc.host_memory_stats()["active_requests.current"] == 1, "the view holds it"
    view[0] = 1
    view[size - 1] = 2
    other = ccalloc.pinned_empty(size, "uint8")
    other.memoryview()[:] = b"\xff" * size  # a different block: the view's bytes keep
    assert (view[0], view[size - 1]) == (1, 2)
    other.close()
    del view
    gc.collect()
    assert ccalloc.host_memory_stats()["active_requests.current"] == 0


def test_close_refuses_while_a_view_is_alive():
    """A view cannot be revoked, and one used after the free wrote into freed (after
    host_empty_cache, unmapped) memory: close() raises BufferError and frees nothing while
    a view, or one taken from it, lives, as mmap.close() does."""
    buf = ccalloc.pinned_empty(8 * MiB, "uint8")
    view = buf.memoryview()
    view[0] = 7
    taken = memoryview(view)[:16]
    with pytest.raises(BufferError):
        buf.close()
    view.release()
    with pytest.raises(BufferError):
        buf.close()  # `taken` still views the memory
    assert not buf.closed and taken[0] == 7
    taken.release()
    buf.close()
    ccalloc.host_empty_cache()
    assert buf.closed
    assert ccalloc.host_memory_stats()["active_requests.current"] == 0
    with pytest.raises(ValueError):
        view[0] = 1


def test_a_buffer_cannot_be_copied_or_pickled():
    """Two owners of one block would free it twice (a copy's collection freed the block
    under the original, which then freed the next buffer's)."""
    import copy
    import pickle

    buf = ccalloc.pinned_empty(1024, "uint8")
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError):
            duplicate(buf)
    assert ccalloc.host_memory_stats()["active_requests.current"] == 1
    buf.close()
    assert ccalloc.host_memory_stats()["active_requests.current"] == 0


def test_numpy_views_pinned_memory():
    numpy = pytest.importorskip("numpy")
    buf = ccalloc.pinned_empty((4, 4), numpy.float64)
    array = numpy.asarray(buf)
    array[:] = 2.5
    assert array.ctypes.data == buf.ptr
    assert float(numpy.asarray(buf).sum()) == 40.0
    del array
    buf.close()


def test_pinned_tensor_with_torch():
    torch = pytest.importorskip("torch")
    import ccalloc.torch as ct

    t = ct.pinned_tensor((8, 2), torch.float32)
    assert t.data_ptr() != 0 and t.shape == (8, 2) and t.dtype == torch.float32
    t.fill_(1.0)
    assert float(t.sum()) == 16.0
    assert ccalloc.host_memory_stats()["active_requests.current"] == 1
    del t
    gc.collect()
    assert ccalloc.host_memory_stats()["active_requests.current"] == 0


class _FakeTensor:
    """What ``pinned_tensor`` uses of a tensor made by ``torch.frombuffer``: it holds its buffer."""

    def __init__(self, raw, count):
        self.raw, self.count = raw, count

    def view(self, dims):
        return self

    def element_size(self):
        return 4

    def untyped_storage(self):
        import ctypes

        raw = self.raw
        return type("Storage", (), {"data_ptr": lambda _self: ctypes.addressof(raw)})()


def test_pinned_tensor_keeps_its_block_while_the_tensor_lives(monkeypatch):
    """``ccalloc.torch.pinned_tensor``'s ownership chain, with a stand-in for torch."""
    import sys
    import types

    import ccalloc.torch as ct

    fake = types.ModuleType("torch")
    fake.float32 = "float32"
    fake.empty = lambda dims, dtype=None: _FakeTensor(None, 0)
    fake.frombuffer = lambda raw, dtype, count: _FakeTensor(raw, count)
    monkeypatch.setitem(sys.modules, "torch", fake)
    t = ct.pinned_tensor((8, 2))
    assert t.count == 16 and len(t.raw) == 64
    gc.collect()
    assert ccalloc.host_memory_stats()["active_requests.current"] == 1, "the tensor holds it"
    ct.record_pinned(t, 9)
    del t
    gc.collect()
    # Freed, but reusable only once stream 9's work is done: emptying the cache waits for it.
    ccalloc.host_empty_cache()
    assert ccalloc.host_memory_stats()["active_requests.current"] == 0


def test_unknown_advice_is_a_value_error():
    """A misspelled name was a KeyError, and an int past 32 bits was cut to another advice."""
    buf = ccalloc.managed_empty(MiB, "uint8")
    try:
        for bad in ("bogus", 2**32 + 1, -1, 0, 7):
            with pytest.raises(ValueError):
                ccalloc.advise(buf, bad, device=0)
        with pytest.raises(TypeError):
            ccalloc.advise(buf, 1.5, device=0)
    finally:
        buf.close()
