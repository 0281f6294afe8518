"""Pinned host memory and managed memory from ccalloc's caches, without PyTorch.

Pinned (page-locked) host memory makes host-device copies asynchronous; ccalloc caches it
as it caches device memory (512-byte rounding, split and merge), where PyTorch's pinned
cache rounds every request to a power of two. Managed (unified) memory is usable from the
host and every device and moves on demand, or ahead of use with :func:`prefetch`.

Raw addresses::

    ptr = ccalloc.host_malloc(64 << 20)
    ...  # an async copy from ptr on `stream`
    ccalloc.host_record_stream(ptr, stream)   # reuse waits for the copy
    ccalloc.host_free(ptr)

Buffers (:class:`HostBuffer`), usable from NumPy (``numpy.asarray(buf)``) and, for managed
memory, from CuPy or Numba (``__cuda_array_interface__``); freed by ``close()`` or when
the last reference goes::

    buf = ccalloc.pinned_empty((256, 1024), "float32")
    batch = numpy.asarray(buf)        # a view of the pinned memory, keeping buf alive
"""

from __future__ import annotations

import ctypes
import enum
import operator
import struct
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import _call, _device_index, _lib, _pointer, _size, _stream_handle

__all__ = [
    "Advice",
    "HostBuffer",
    "host_malloc",
    "host_free",
    "host_record_stream",
    "host_empty_cache",
    "host_memory_stats",
    "host_reset_peak_memory_stats",
    "managed_malloc",
    "managed_free",
    "managed_record_stream",
    "managed_empty_cache",
    "managed_memory_stats",
    "prefetch",
    "advise",
    "pinned_empty",
    "managed_empty",
    "sim_prefetches",
]


class Advice(enum.IntEnum):
    """``enum ccalloc_advice`` (``cuMemAdvise``'s values)."""

    SET_READ_MOSTLY = 1
    UNSET_READ_MOSTLY = 2
    SET_PREFERRED_LOCATION = 3
    UNSET_PREFERRED_LOCATION = 4
    SET_ACCESSED_BY = 5
    UNSET_ACCESSED_BY = 6


def _location(device: Any) -> int:
    """-1 (the host) for ``-1`` / ``"cpu"``; otherwise a device index."""
    if device == -1 or device == "cpu":
        return -1
    return _device_index(device)


def _address(ptr_or_buffer: Any) -> Tuple[int, Optional[int]]:
    """(address, size or None) of a raw address or a :class:`HostBuffer`."""
    if isinstance(ptr_or_buffer, HostBuffer):
        return ptr_or_buffer.ptr, ptr_or_buffer.nbytes
    return _pointer(ptr_or_buffer), None


# --------------------------------------------------------------------------------------------
# Raw addresses
# --------------------------------------------------------------------------------------------


def host_malloc(size: int) -> int:
    """Allocates ``size`` bytes of pinned host memory; returns the address.

    Free it with :func:`host_free`. Size 0 raises :class:`ccalloc.InvalidSizeError`.
    """
    out = ctypes.c_void_p()
    _call("ccalloc_host_malloc", _size(size), ctypes.byref(out))
    return int(out.value or 0)


def host_free(ptr: int) -> None:
    """Frees a block from :func:`host_malloc` (``0`` / ``None``: nothing to do).

    Reused only after the work on every stream recorded with :func:`host_record_stream`
    has completed. A device block raises :class:`ccalloc.UnknownPointerError` saying so.
    """
    _call("ccalloc_host_free", _pointer(ptr))


def host_record_stream(ptr: Any, stream: Any, device: Any = None) -> None:
    """Records that work queued until now on ``stream`` (of ``device``) uses pinned ``ptr``
    (an address or a :class:`HostBuffer`): once freed, it is reused only after that work."""
    _call(
        "ccalloc_host_record_stream",
        _address(ptr)[0],
        _device_index(device),
        _stream_handle(stream),
    )


def host_empty_cache() -> None:
    """Returns every unused cached pinned segment to the driver."""
    _call("ccalloc_host_empty_cache")


def _stats(function: str) -> Dict[str, int]:
    """ccalloc's figures (the device statistics' names and meanings), flattened."""
    raw = _lib.ccalloc_stats()
    _call(function, ctypes.byref(raw))
    flat: Dict[str, int] = {}
    names = ("allocation", "segment", "active", "allocated_bytes", "reserved_bytes", "active_bytes",
             "requested_bytes")
    for name in names:
        stat = getattr(raw, name).all
        for metric in ("current", "peak", "allocated", "freed"):
            flat[f"{name}.{metric}"] = int(getattr(stat, metric))
    flat["num_device_alloc"] = int(raw.num_device_alloc)
    flat["num_device_free"] = int(raw.num_device_free)
    return flat


# torch.cuda.host_memory_stats()'s name -> ccalloc's figure with that meaning. PyTorch counts
# the pinned blocks it owns (active or cached) as "allocations" / "allocated_bytes", and
# blocks checked out to callers until their streams' work is done as "active_requests" /
# "active_bytes": ccalloc's segments / reserved bytes, and active blocks / bytes.
_TORCH_HOST_NAMES = {
    "allocations": "segment",
    "allocated_bytes": "reserved_bytes",
    "active_requests": "active",
    "active_bytes": "active_bytes",
}


def host_memory_stats() -> Dict[str, int]:
    """Statistics of the pinned cache under ``torch.cuda.host_memory_stats()``'s names and
    meanings: ``allocations.*`` and ``allocated_bytes.*`` (pinned segments the cache owns,
    in use or cached), ``active_requests.*`` and ``active_bytes.*`` (blocks handed out, until
    the work of the streams they were recorded on is done), each with ``current`` / ``peak``
    / ``allocated`` / ``freed``, and ``num_host_alloc`` / ``num_host_free`` (calls of
    ``cuMemHostAlloc`` / ``cuMemFreeHost``). ``requested_bytes.*`` (bytes asked for) is
    ccalloc's own addition.
    """
    raw = _stats("ccalloc_host_get_stats")
    stats: Dict[str, int] = {}
    for torch_name, ours in _TORCH_HOST_NAMES.items():
        for metric in ("current", "peak", "allocated", "freed"):
            stats[f"{torch_name}.{metric}"] = raw[f"{ours}.{metric}"]
    for metric in ("current", "peak", "allocated", "freed"):
        stats[f"requested_bytes.{metric}"] = raw[f"requested_bytes.{metric}"]
    stats["num_host_alloc"] = raw["num_device_alloc"]
    stats["num_host_free"] = raw["num_device_free"]
    return stats


def host_reset_peak_memory_stats() -> None:
    """Sets every peak of the pinned cache's statistics to its current value."""
    _call("ccalloc_host_reset_peak_stats")


def managed_malloc(size: int) -> int:
    """Allocates ``size`` bytes of managed memory; returns the address (host and devices)."""
    out = ctypes.c_void_p()
    _call("ccalloc_managed_malloc", _size(size), ctypes.byref(out))
    return int(out.value or 0)


def managed_free(ptr: int) -> None:
    """Frees a block from :func:`managed_malloc` (``0`` / ``None``: nothing to do)."""
    _call("ccalloc_managed_free", _pointer(ptr))


def managed_record_stream(ptr: Any, stream: Any, device: Any = None) -> None:
    """:func:`host_record_stream` for managed memory (a kernel on ``stream`` uses it)."""
    _call(
        "ccalloc_managed_record_stream",
        _address(ptr)[0],
        _device_index(device),
        _stream_handle(stream),
    )


def managed_empty_cache() -> None:
    """Returns every unused cached managed segment to the driver."""
    _call("ccalloc_managed_empty_cache")


def managed_memory_stats() -> Dict[str, int]:
    """Statistics of the managed cache (``allocation.*``, ``segment.*``, ``*_bytes.*``,
    ``num_device_alloc`` / ``num_device_free``)."""
    return _stats("ccalloc_managed_get_stats")


def prefetch(
    ptr_or_buffer: Any, device: Any = None, stream: Any = 0, size: Optional[int] = None
) -> None:
    """Queues on ``stream`` a move of managed memory to ``device`` (``-1`` or ``"cpu"``: the
    host). A :class:`HostBuffer` moves whole; for an address, ``size`` is required. The
    range must lie in one live managed block (:class:`ccalloc.UnknownPointerError`
    otherwise, :class:`ccalloc.DoubleFreeError` for freed memory)."""
    ptr, whole = _address(ptr_or_buffer)
    if size is None:
        if whole is None:
            raise TypeError("prefetch of a raw address needs size=")
        size = whole
    _call("ccalloc_prefetch", ptr, _size(size), _location(device), _stream_handle(stream))


def advise(
    ptr_or_buffer: Any,
    advice: Union[Advice, int, str],
    device: Any = None,
    size: Optional[int] = None,
) -> None:
    """Advises how managed memory is used (``cuMemAdvise``). ``advice`` is an
    :class:`Advice` or its name (``"set_read_mostly"``, ...); ``device`` is the one the
    advice names (``-1`` / ``"cpu"``: the host)."""
    if isinstance(advice, str):
        try:
            advice = Advice[advice.upper()]
        except KeyError:
            names = ", ".join(a.name.lower() for a in Advice)
            raise ValueError(f"unknown advice {advice!r}: expected one of {names}") from None
    else:
        try:
            advice = Advice(operator.index(advice))
        except ValueError:
            raise ValueError(f"unknown advice {advice!r}: expected 1-6 or an Advice") from None
    ptr, whole = _address(ptr_or_buffer)
    if size is None:
        if whole is None:
            raise TypeError("advise on a raw address needs size=")
        size = whole
    _call("ccalloc_advise", ptr, _size(size), int(advice), _location(device))


def sim_prefetches(device: Any = None) -> Tuple[int, int]:
    """Sim backend only: (prefetches to ``device`` (-1: the host), bytes they moved)."""
    count, moved = ctypes.c_uint64(), ctypes.c_uint64()
    _call("ccalloc_sim_prefetches", _location(device), ctypes.byref(count), ctypes.byref(moved))
    return count.value, moved.value


# --------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------

# NumPy typestr of the usual dtype names, for use without NumPy.
_TYPESTRS = {
    "bool": "|b1",
    "int8": "|i1",
    "uint8": "|u1",
    "int16": "<i2",
    "uint16": "<u2",
    "int32": "<i4",
    "uint32": "<u4",
    "int64": "<i8",
    "uint64": "<u8",
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "complex64": "<c8",
    "complex128": "<c16",
}


def _typestr(dtype: Any) -> Tuple[str, int]:
    """(typestr, itemsize) of a dtype name, a NumPy dtype or a typestr such as ``"<f4"``."""
    typestr = getattr(dtype, "str", None)  # numpy.dtype, or a NumPy scalar type's dtype
    if typestr is None and hasattr(dtype, "dtype"):
        typestr = getattr(dtype.dtype, "str", None)
    if typestr is None:
        name = getattr(dtype, "__name__", dtype)
        if not isinstance(name, str):
            raise TypeError(
                f"dtype must be a name such as 'float32' or a NumPy dtype, not {dtype!r}"
            )
        typestr = _TYPESTRS.get(name, name)
    # NumPy's array-interface kinds (b bool, i/u int, f float, c complex, V raw bytes...),
    # with a positive item size.
    if (
        len(typestr) < 3
        or typestr[0] not in "<>|="
        or typestr[1] not in "biufcmMOSUV"
        or not typestr[2:].isdigit()
        or int(typestr[2:]) == 0
    ):
        raise ValueError(f"unknown dtype {dtype!r}")
    if struct.pack("=H", 1) != struct.pack("<H", 1) and typestr[0] == "<":
        raise ValueError("big-endian hosts are not supported")
    return typestr, int(typestr[2:])


def _shape(shape: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    if isinstance(shape, bool):
        raise TypeError("shape must be an int or a sequence of ints")
    try:
        dims = (operator.index(shape),)
    except TypeError:
        dims = tuple(operator.index(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    return dims


class HostBuffer:
    """A block of pinned host (``kind="pinned"``) or managed (``kind="managed"``) memory.

    ``numpy.asarray(buf)`` views it (``__array_interface__``; the array keeps the buffer
    alive); managed memory is also ``__cuda_array_interface__`` (CuPy, Numba). ``close()``
    frees it (arrays viewing it must not be used afterwards; while a view from
    ``memoryview()`` is alive it refuses, as ``mmap.close()`` does); so does the last
    reference going away.
    ``record_stream(stream)`` marks it used by work queued on ``stream``. A buffer owns its
    block: it cannot be copied or pickled (copy its contents instead).
    """

    def __init__(
        self, shape: Union[int, Sequence[int]], dtype: Any = "uint8", kind: str = "pinned"
    ):
        if kind not in ("pinned", "managed"):
            raise ValueError(f"kind must be 'pinned' or 'managed', not {kind!r}")
        self.shape = _shape(shape)
        self.typestr, self.itemsize = _typestr(dtype)
        self.kind = kind
        count = 1
        for d in self.shape:
            count *= d
        self.nbytes = count * self.itemsize
        self.ptr = 0
        self._views: list = []
        # Empty arrays still get a (smallest) block: every buffer has an address.
        size = max(self.nbytes, 1)
        self.ptr = host_malloc(size) if kind == "pinned" else managed_malloc(size)

    @property
    def closed(self) -> bool:
        return self.ptr == 0

    def _check_open(self) -> None:
        if self.ptr == 0:
            raise ValueError("the buffer is closed")

    def close(self) -> None:
        """Frees the memory (once; later calls do nothing). Raises ``BufferError``, freeing
        nothing, while a view ``memoryview()`` made (or one taken from it) is alive: a view
        cannot be revoked, and one used after the free would write into freed memory.
        ``view.release()`` (or dropping it) ends a view."""
        alive = sum(1 for ref in getattr(self, "_views", ()) if ref() is not None)
        if alive:
            raise BufferError(
                f"cannot close a HostBuffer while {alive} of its memoryviews (or views taken "
                "from them) are alive: release them (view.release()) or drop them first"
            )
        self._views = []
        ptr, self.ptr = self.ptr, 0
        if ptr:
            (host_free if self.kind == "pinned" else managed_free)(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, or ccalloc already shut down
            pass

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def record_stream(self, stream: Any, device: Any = None) -> None:
        """Work queued until now on ``stream`` (of ``device``) uses this buffer."""
        self._check_open()
        record = host_record_stream if self.kind == "pinned" else managed_record_stream
        record(self.ptr, stream, device)

    def memoryview(self) -> memoryview:
        """The bytes, as a writable ``memoryview``. It keeps the buffer alive, so dropping
        every other reference does not free the memory under it, and ``close()`` refuses
        while it (or a view taken from it) is alive."""
        self._check_open()
        raw = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        # from_address holds no reference to the memory's owner: the array holds the buffer,
        # and the view (cast included) holds the array, so the block is freed only once
        # neither the buffer nor any view is referenced (as ccalloc.torch.pinned_tensor does).
        raw._ccalloc_owner = self  # type: ignore[attr-defined]
        # Every view of this memory, and any taken from them, holds `raw`: while it lives,
        # close() refuses (weakly held here, or the buffer would keep itself alive).
        self._views = [r for r in self._views if r() is not None] + [weakref.ref(raw)]
        return memoryview(raw).cast("B")

    def __copy__(self) -> "HostBuffer":
        raise TypeError(
            "a HostBuffer owns its memory block and cannot be copied (two owners would free "
            "it twice); copy its contents into a new buffer instead"
        )

    def __deepcopy__(self, memo: Any) -> "HostBuffer":
        return self.__copy__()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a HostBuffer cannot be pickled: its memory block belongs to this process; "
            "pickle its contents (bytes(buf.memoryview())) instead"
        )

    def _interface(self, version: int) -> Dict[str, Any]:
        self._check_open()
        return {
            "shape": self.shape,
            "typestr": self.typestr,
            "data": (self.ptr, False),
            "strides": None,
            "version": version,
        }

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        return self._interface(3)

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if self.kind != "managed":
            raise AttributeError(
                "pinned host memory has no __cuda_array_interface__: copy it to the device "
                "(or use managed memory)"
            )
        interface = self._interface(3)
        # No stream to synchronize with: managed memory is coherent.
        interface["stream"] = None
        return interface

    def __repr__(self) -> str:
        state = "closed" if self.closed else hex(self.ptr)
        return f"HostBuffer({self.kind}, shape={self.shape}, typestr={self.typestr!r}, {state})"


def pinned_empty(shape: Union[int, Sequence[int]], dtype: Any = "float32") -> HostBuffer:
    """An uninitialised pinned buffer of ``shape`` and ``dtype``, e.g. a data loader's batch
    staging area: ``numpy.asarray(pinned_empty((64, 3, 224, 224), "uint8"))``."""
    return HostBuffer(shape, dtype, "pinned")


def managed_empty(shape: Union[int, Sequence[int]], dtype: Any = "float32") -> HostBuffer:
    """An uninitialised managed buffer of ``shape`` and ``dtype``."""
    return HostBuffer(shape, dtype, "managed")
