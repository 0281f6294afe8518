"""ccalloc: a caching CUDA memory allocator (Python bindings of ``libccalloc.so``).

Works without PyTorch: the statistics API mirrors ``torch.cuda``'s (same names, keys and
summary layout), and :func:`malloc` / :func:`free` / :func:`record_stream` serve other
frameworks (e.g. CuPy). ``ccalloc.torch.enable()`` makes ccalloc PyTorch's CUDA allocator;
``torch`` is imported only there.

Initialisation
    Every function that needs a running allocator calls :func:`init` itself when ccalloc is
    not initialised yet (``CCALLOC_NOT_INITIALIZED``), so an explicit ``init()`` is optional.
    ``init()`` reads ``CCALLOC_BACKEND`` (``cuda``, the default, or ``sim``) and
    ``CCALLOC_CONF`` at that moment. After :func:`shutdown` nothing restarts implicitly:
    calls raise :class:`ShutDownError` until ``init()`` is called again.

Devices
    ``device`` arguments take an ``int``, ``None`` (the current device: 0 without PyTorch,
    ``torch.cuda.current_device()`` when torch is imported and CUDA initialised), a
    ``torch.device`` or a string such as ``"cuda"`` / ``"cuda:1"``.

Errors
    A failing call raises :class:`CcallocError` (a ``RuntimeError``) or a subclass per
    status, with ``.status`` (:class:`Status`, read from the library) and ``.message``
    (``ccalloc_last_error()``); e.g. :class:`OutOfMemoryError` is also a ``MemoryError``. A missing library raises
    :class:`LibraryNotFoundError` (an ``OSError``) on first use; ``import ccalloc`` itself
    always works.
"""

from __future__ import annotations

import collections
import ctypes
import math
import operator
import sys
from typing import Any, Dict

from . import _lib
from ._lib import (
    BusyError,
    CcallocError,
    ConfigError,
    DoubleFreeError,
    DriverError,
    DriverUnavailableError,
    InternalError,
    InvalidArgumentError,
    InvalidDeviceError,
    InvalidSizeError,
    LibraryNotFoundError,
    NotInitializedError,
    OutOfMemoryError,
    ShutDownError,
    UnknownPointerError,
    WrongDeviceError,
)

__version__ = "0.1.0"

__all__ = [
    "device_total_memory",
    "shard_count",
    "reset_config",
    # lifecycle and info
    "init",
    "shutdown",
    "is_initialized",
    "version",
    "backend",
    "device_count",
    "library_path",
    # PyTorch-compatible statistics and settings
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "empty_cache",
    "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
    "set_config",
    "memory_summary",
    "cache_info",
    # beyond PyTorch
    "paging_stats",
    "lock_stats",
    "memory_breakdown",
    # low level
    "malloc",
    "free",
    "record_stream",
    "sim_pause_stream",
    "sim_device_bytes",
    # errors (and Status, left out of * so that importing needs no library)
    "CcallocError",
    "LibraryNotFoundError",
    "InvalidArgumentError",
    "NotInitializedError",
    "ShutDownError",
    "OutOfMemoryError",
    "UnknownPointerError",
    "DoubleFreeError",
    "WrongDeviceError",
    "InvalidDeviceError",
    "InvalidSizeError",
    "ConfigError",
    "DriverUnavailableError",
    "DriverError",
    "BusyError",
    "InternalError",
]


# --------------------------------------------------------------------------------------------
# Plumbing
# --------------------------------------------------------------------------------------------


def __getattr__(name: str) -> Any:
    # ``Status`` is read from the library (``_lib.Status``): asking for it loads the library.
    if name == "Status":
        return _lib.Status
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _call(name: str, *args: Any) -> None:
    """Calls C function ``name``; starts ccalloc once if it was not initialised; raises on error."""
    lib = _lib.load()
    fn = getattr(lib, name)
    status = fn(*args)
    if status == _lib.Status.NOT_INITIALIZED:
        init()
        status = fn(*args)
    _lib.check(status)


def _current_device() -> int:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return int(torch.cuda.current_device())
        except Exception:  # a half-imported or CPU-only torch: fall back to device 0
            pass
    return 0


def _checked_index(index: int) -> int:
    if not -(1 << 31) <= index < 1 << 31:
        raise ValueError(f"device index {index} is out of range")
    return index


def _size(size: Any) -> int:
    """`size` as a C size_t: an int (not a bool) in [0, 2**64)."""
    if isinstance(size, bool):
        raise TypeError("size must be an int, not bool")
    size = operator.index(size)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if size >= 1 << 64:
        raise OverflowError(f"size {size} does not fit in size_t")
    return size


def _device_index(device: Any) -> int:
    """An ``int`` device index from ``int`` / ``None`` / ``torch.device`` / ``"cuda:N"``."""
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise TypeError(f"device must be an int, a str or a torch.device, not bool ({device!r})")
    if isinstance(device, int):
        return _checked_index(device)
    if isinstance(device, str):
        text = device.strip()
        kind, sep, index = text.partition(":")
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device such as 'cuda' or 'cuda:1', got {device!r}")
        if not sep:
            return _current_device()
        try:
            return _checked_index(int(index))
        except ValueError:
            raise ValueError(f"invalid device string {device!r}") from None
    kind = getattr(device, "type", None)
    if isinstance(kind, str) and hasattr(device, "index"):  # torch.device, duck-typed
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return _current_device() if device.index is None else _checked_index(int(device.index))
    try:
        return _checked_index(operator.index(device))  # numpy integers and the like
    except TypeError:
        raise TypeError(
            f"device must be an int, None, a str such as 'cuda:1' or a torch.device, "
            f"not {type(device).__name__}"
        ) from None


def _stream_handle(stream: Any) -> int:
    """A raw ``cudaStream_t`` value from an int, a ``torch.cuda.Stream`` or a CuPy stream."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise TypeError("stream must be an int (a cudaStream_t) or a stream object, not bool")
    if isinstance(stream, int):
        handle = stream
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        handle = int(stream.cuda_stream)
    elif hasattr(stream, "ptr"):  # cupy.cuda.Stream
        handle = int(stream.ptr)
    else:
        try:
            handle = operator.index(stream)
        except TypeError:
            raise TypeError(
                f"stream must be an int (a cudaStream_t), a torch.cuda.Stream or a CuPy "
                f"stream, not {type(stream).__name__}"
            ) from None
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"stream handle {handle} is not a pointer value")
    return handle


def _pointer(ptr: Any) -> int:
    if ptr is None:
        return 0
    if isinstance(ptr, bool):
        raise TypeError("ptr must be an int (a device address), not bool")
    value = operator.index(ptr)
    if not 0 <= value < 1 << 64:
        raise ValueError(f"{value} is not a pointer value")
    return value


def _raw_stats(device: Any = None) -> _lib.ccalloc_stats:
    out = _lib.ccalloc_stats()
    _call("ccalloc_get_stats", _device_index(device), ctypes.byref(out))
    return out


# --------------------------------------------------------------------------------------------
# Lifecycle and information
# --------------------------------------------------------------------------------------------


def init() -> None:
    """Starts ccalloc (backend from ``CCALLOC_BACKEND``, settings from ``CCALLOC_CONF``).

    A no-op when it is running. Also works after :func:`shutdown`. Other functions call it
    themselves when needed, so calling it is optional (useful to surface configuration or
    driver errors early).
    """
    _lib.check(_lib.load().ccalloc_init())


def shutdown() -> None:
    """Returns all cached memory to the driver and stops ccalloc.

    Raises :class:`BusyError` (nothing changed) while allocations are live. Does nothing
    when ccalloc is not running. After it, calls raise :class:`ShutDownError` until
    :func:`init` is called again.
    """
    status = _lib.load().ccalloc_shutdown()
    if status in (_lib.Status.NOT_INITIALIZED, _lib.Status.SHUT_DOWN):
        return
    _lib.check(status)


def is_initialized() -> bool:
    """Whether ccalloc is running (does not start it)."""
    return bool(_lib.load().ccalloc_is_initialized())


def version() -> str:
    """The library's version, e.g. ``"0.1.0"`` (does not start ccalloc)."""
    return _lib._decode(_lib.load().ccalloc_version())


def library_path() -> str:
    """The path of the ``libccalloc.so`` in use."""
    return _lib.library_path()


def backend() -> str:
    """The backend in use: ``"cuda"`` or ``"sim"``."""
    name = ctypes.c_char_p()
    _call("ccalloc_backend", ctypes.byref(name))
    return _lib._decode(name.value)


def device_total_memory(device: Any = None) -> int:
    """Bytes of memory ``device`` has in all (as ``torch.cuda.mem_get_info()[1]``)."""
    out = ctypes.c_uint64()
    _call("ccalloc_device_total_memory", _device_index(device), ctypes.byref(out))
    return out.value


def shard_count(device: Any = None) -> int:
    """How many shards (allocators with a lock and cache of their own) ``device`` has made: 1
    once it has allocated, more where threads each on a stream of their own contended for
    its lock (``thread_shards``, ``thread_shards_on_contention``) or with
    ``per_stream_shards``; 0 before its first allocation."""
    out = ctypes.c_uint32()
    _call("ccalloc_shard_count", _device_index(device), ctypes.byref(out))
    return out.value


def reset_config() -> None:
    """Puts every setting back to its default, then applies ``CCALLOC_CONF`` again."""
    _call("ccalloc_reset_config")


def device_count() -> int:
    """The number of devices the backend has."""
    count = ctypes.c_int32()
    _call("ccalloc_device_count", ctypes.byref(count))
    return count.value


# --------------------------------------------------------------------------------------------
# PyTorch-compatible statistics
# --------------------------------------------------------------------------------------------

_STAT_ARRAYS = tuple(name for name, kind in _lib.ccalloc_stats._fields_ if kind is _lib.ccalloc_stat_array)
_POOLS = tuple(name for name, _ in _lib.ccalloc_stat_array._fields_)  # all, small_pool, large_pool
_METRICS = tuple(name for name, _ in _lib.ccalloc_stat._fields_)  # current, peak, allocated, freed
_SINGLE_STATS = ("oversize_allocations", "oversize_segments")
_COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)


def _stat_dict(stat: _lib.ccalloc_stat) -> Dict[str, int]:
    return {metric: int(getattr(stat, metric)) for metric in _METRICS}


def memory_stats_as_nested_dict(device: Any = None) -> Dict[str, Any]:
    """:func:`memory_stats` as a nested dictionary, like ``torch.cuda.memory_stats_as_nested_dict``."""
    raw = _raw_stats(device)
    nested: Dict[str, Any] = {}
    for name in _STAT_ARRAYS:
        array = getattr(raw, name)
        nested[name] = {pool: _stat_dict(getattr(array, pool)) for pool in _POOLS}
    for name in _SINGLE_STATS:
        nested[name] = _stat_dict(getattr(raw, name))
    for name in _COUNTERS:
        nested[name] = int(getattr(raw, name))
    nested["max_split_size"] = int(raw.max_split_size)
    return nested


def memory_stats(device: Any = None) -> "collections.OrderedDict[str, int]":
    """Allocator statistics of ``device`` with ``torch.cuda.memory_stats()``'s flat keys.

    ``"<stat>.<all|small_pool|large_pool>.<current|peak|allocated|freed>"`` for allocation,
    segment, active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
    inactive_split_bytes and requested_bytes; ``oversize_allocations.*``,
    ``oversize_segments.*``; the counters num_alloc_retries, num_ooms, num_sync_all_streams,
    num_device_alloc, num_device_free; and ``max_split_size`` (-1 when unlimited).
    Keys are sorted, as PyTorch returns them.
    """
    flat = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat.append((prefix, value))

    walk("", memory_stats_as_nested_dict(device))
    flat.sort()
    return collections.OrderedDict(flat)


def memory_allocated(device: Any = None) -> int:
    """Bytes currently handed out (``allocated_bytes.all.current``)."""
    return int(_raw_stats(device).allocated_bytes.all.current)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` since start or :func:`reset_peak_memory_stats`."""
    return int(_raw_stats(device).allocated_bytes.all.peak)


def memory_reserved(device: Any = None) -> int:
    """Bytes held from the driver, cached included (``reserved_bytes.all.current``)."""
    return int(_raw_stats(device).reserved_bytes.all.current)


def max_memory_reserved(device: Any = None) -> int:
    """Peak of :func:`memory_reserved` since start or :func:`reset_peak_memory_stats`."""
    return int(_raw_stats(device).reserved_bytes.all.peak)


def paging_stats(device: Any = None) -> Dict[str, Any]:
    """What keeping reserved ≈ live has cost on ``device`` (paged segments; PyTorch has no
    such figures): ``growths`` (requests that had to map pages), ``moving_growths`` (those
    that moved pages from under free blocks), ``chunks_mapped``, ``chunks_unmapped``,
    ``host_waits`` (the host waited for the device), ``growth_ns`` and ``moving_ns`` (wall
    time in growth, and in growth that moved pages), ``wait_ns`` (of that, the host's waits
    for the device), ``page_slack`` (the share of peak live bytes growth may keep beyond
    it while moves are within ``page_move_budget``), ``chunks_borrowed`` (chunks taken from
    other streams' idle memory with ``per_stream_shards``), and ``growths_past_slack``
    (growths refused page moves because moves had taken their share of the time, or, in a
    job that keeps its device busy, had taken it and not yet earned it back in full: each
    mapped new memory instead). Counts and times restart at :func:`reset_accumulated_memory_stats`.
    """
    out = _lib.ccalloc_paging_stats()
    _call("ccalloc_get_paging_stats", _device_index(device), ctypes.byref(out))
    return {name: getattr(out, name) for name, _ in out._fields_}


def lock_stats(device: Any = None) -> Dict[str, int]:
    """How callers have met ``device``'s locks (PyTorch has no such figures):
    ``acquisitions`` (allocations and frees past the thread caches, statistics reads; not
    this one, which takes no lock), ``contended`` (of those, the ones that found another thread holding
    the lock), ``blocked`` (of these, the ones that slept after spinning), ``wait_ns``
    (their waits), and ``handoffs`` (acquisitions by another thread than the one before:
    the allocator's bookkeeping moved between threads). Threads that allocate at the same
    time on one stream contend; PyTorch's forward and autograd threads take turns, which
    shows as handoffs without contention. Counts restart at
    :func:`reset_accumulated_memory_stats`.
    """
    out = _lib.ccalloc_lock_stats()
    _call("ccalloc_get_lock_stats", _device_index(device), ctypes.byref(out))
    return {name: getattr(out, name) for name, _ in out._fields_}


def memory_breakdown(device: Any = None, at_peak: bool = False) -> Dict[str, int]:
    """What ``device``'s reserved memory is made of: ``reserved_bytes``, ``live_bytes``
    (blocks handed out, or freed with other streams' work on them pending), and the excess
    by cause: ``free_chunk_bytes`` (mapped chunks with no live byte, which growth may move),
    ``pinned_bytes`` (free whole pages kept because their chunk holds live bytes;
    ``pinning_chunks`` such chunks), ``rounding_bytes`` (the free part of pages holding live
    bytes), ``parked_bytes`` (reserved, not mapped) and ``plain_bytes`` (the free part of
    plain segments). The byte counts from ``live_bytes`` on add up to ``reserved_bytes``.

    Now, or with ``at_peak`` right after the allocation that took reserved to its highest
    since ``record_peak_breakdown:True`` was set (``CCALLOC_CONF`` or :func:`set_config`) or
    :func:`reset_peak_memory_stats` ran (the memory at that moment if none has raised it
    since); without that setting ``at_peak`` raises :class:`ConfigError`. Either walks
    every block.
    """
    out = _lib.ccalloc_memory_breakdown()
    _call("ccalloc_get_memory_breakdown", _device_index(device), bool(at_peak), ctypes.byref(out))
    return {name: getattr(out, name) for name, _ in out._fields_}


def reset_peak_memory_stats(device: Any = None) -> None:
    """Sets every peak statistic of ``device`` to its current value (``-1``: all devices)."""
    _call("ccalloc_reset_peak_stats", _device_index(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zeroes the allocated/freed totals and event counters of ``device`` (``-1``: all)."""
    _call("ccalloc_reset_accumulated_stats", _device_index(device))


def empty_cache(device: Any = None) -> None:
    """Returns unused cached memory to the driver.

    Like ``torch.cuda.empty_cache()``, the default (``None``) empties every device's cache;
    pass a device to empty only that one.
    """
    _call("ccalloc_empty_cache", -1 if device is None else _device_index(device))


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limits what ``device`` may reserve to ``fraction`` of its memory (PyTorch's checks).

    Raises ``TypeError`` unless ``fraction`` is a ``float`` and ``ValueError`` outside 0~1,
    with ``torch.cuda.set_per_process_memory_fraction``'s messages.
    """
    index = _device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    # PyTorch's check, plus NaN (which PyTorch lets through and ccalloc refuses anyway).
    if fraction < 0 or fraction > 1 or math.isnan(fraction):
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _call("ccalloc_set_memory_fraction", fraction, index)


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The memory fraction of ``device`` (1.0 when unlimited)."""
    out = ctypes.c_double()
    _call("ccalloc_get_memory_fraction", _device_index(device), ctypes.byref(out))
    return out.value


def set_config(conf: str) -> None:
    """Applies settings with PyTorch's key names to every device, e.g.
    ``"max_split_size_mb:256,garbage_collection_threshold:0.8"``.

    Raises :class:`ConfigError` (a ``ValueError``) for an unknown key or bad value, in which
    case nothing changes.
    """
    if not isinstance(conf, str):
        raise TypeError(f"conf must be a str, not {type(conf).__name__}")
    if "\0" in conf:
        raise ValueError("conf must not contain NUL characters")
    _call("ccalloc_set_config", conf.encode("utf-8"))


# --------------------------------------------------------------------------------------------
# memory_summary (the layout of torch.cuda.memory_summary)
# --------------------------------------------------------------------------------------------

_WIDTH = 75


def _format_size(size: int, reference: float) -> str:
    """PyTorch's size cell: the unit steps up while ``reference`` is at least 768 of it."""
    unit = "B  "
    for next_unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if reference < 768 * 1024:
            break
        unit = next_unit
        size //= 1024
        reference /= 1024
    return f"{size:6d} {unit}"


def _format_count(count: int, reference: float) -> str:
    """PyTorch's count cell: K / M while ``reference`` is at least 750 thousand of it."""
    unit = " "
    for next_unit in ("K", "M"):
        if reference < 750 * 1000:
            break
        unit = next_unit
        count //= 1000
        reference /= 1000
    return f"{count:7d} {unit} "


_SUMMARY_ROWS = (
    ("allocated_bytes", "Allocated memory", _format_size),
    ("active_bytes", "Active memory", _format_size),
    ("requested_bytes", "Requested memory", _format_size),
    ("reserved_bytes", "GPU reserved memory", _format_size),
    ("inactive_split_bytes", "Non-releasable memory", _format_size),
    ("allocation", "Allocations", _format_count),
    ("active", "Active allocs", _format_count),
    ("segment", "GPU reserved segments", _format_count),
    ("inactive_split", "Non-releasable allocs", _format_count),
)

_SUMMARY_SINGLE_ROWS = (
    ("oversize_allocations", "Oversize allocations", _format_count),
    ("oversize_segments", "Oversize GPU segments", _format_count),
)


def cache_info(device: Any = None) -> int:
    """The largest cached free block on ``device``, in bytes: the biggest request ccalloc can
    serve without asking the driver (PyTorch's ``cacheInfo``, which cuDNN benchmarking reads)."""
    out = ctypes.c_uint64()
    _call("ccalloc_cache_info", _device_index(device), ctypes.byref(out))
    return out.value


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A printable table of ``device``'s statistics, laid out like ``torch.cuda.memory_summary``.

    75 columns inside ``|`` borders; rows per statistic with "from large pool" / "from small
    pool" breakdowns unless ``abbreviated``; columns Cur Usage, Peak Usage, Tot Alloc,
    Tot Freed. Units follow the row's "all" value, as in PyTorch.
    """
    index = _device_index(device)
    stats = memory_stats(index)

    def cells(prefix: str, formatter, reference_prefix: str) -> str:
        values = [stats[f"{prefix}.{metric}"] for metric in _METRICS]
        references = [stats[f"{reference_prefix}.{metric}"] for metric in _METRICS]
        return " | ".join(formatter(v, r) for v, r in zip(values, references))

    lines = [
        "=" * _WIDTH,
        f" {'':16} ccalloc CUDA memory summary, device ID {index:<17d} ",
        "-" * _WIDTH,
        f"  {'':9} CUDA OOMs: {stats['num_ooms']:<12d} | "
        f"{'':6} cudaMalloc retries: {stats['num_alloc_retries']:<8d}  ",
        "=" * _WIDTH,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    for key, title, formatter in _SUMMARY_ROWS:
        lines.append("-" * _WIDTH)
        rows = [("all", title)]
        if not abbreviated:
            rows += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        for pool, label in rows:
            lines.append(f" {label:<21} | {cells(f'{key}.{pool}', formatter, f'{key}.all')} ")
    for key, title, formatter in _SUMMARY_SINGLE_ROWS:
        lines.append("-" * _WIDTH)
        lines.append(f" {title:<21} | {cells(key, formatter, key)} ")
    lines.append("=" * _WIDTH)
    return "|" + "|\n|".join(lines) + "|\n"


# --------------------------------------------------------------------------------------------
# Low level: raw device memory for non-PyTorch users, and sim backend controls
# --------------------------------------------------------------------------------------------


def malloc(size: int, device: Any = None, stream: Any = 0) -> int:
    """Allocates ``size`` bytes on ``device`` for use on ``stream``; returns the address.

    ``stream`` is a ``cudaStream_t`` value (an ``int``, 0 = the legacy default stream), a
    ``torch.cuda.Stream`` or a CuPy stream. Free the block with :func:`free`.
    """
    size = _size(size)
    index = _device_index(device)
    out = ctypes.c_void_p()
    _call("ccalloc_malloc", size, index, _stream_handle(stream), ctypes.byref(out))
    return int(out.value or 0)


def free(ptr: int, device: Any = None) -> None:
    """Frees a block from :func:`malloc` (``0`` / ``None``: nothing to do).

    Raises :class:`DoubleFreeError`, :class:`UnknownPointerError` or
    :class:`WrongDeviceError` (nothing changed) for a pointer that is not a live block of
    ``device``.
    """
    _call("ccalloc_free", _pointer(ptr), _device_index(device))


def record_stream(ptr: int, stream: Any, device: Any = None) -> None:
    """Records that the live block ``ptr`` is used on ``stream`` too.

    After :func:`free` the block is reused on other streams only once the work queued on
    ``stream`` up to the free has completed (``Tensor.record_stream``'s meaning).
    """
    _call("ccalloc_record_stream", _pointer(ptr), _device_index(device), _stream_handle(stream))


def sim_pause_stream(stream: Any, paused: bool = True, device: Any = None) -> None:
    """Sim backend only: while ``stream`` is paused, its recorded events stay incomplete.

    Raises :class:`InvalidArgumentError` on the cuda backend.
    """
    _call("ccalloc_sim_pause_stream", _device_index(device), _stream_handle(stream), bool(paused))


def sim_device_bytes(device: Any = None) -> int:
    """Sim backend only: bytes the simulated device has handed to ccalloc and not taken back."""
    out = ctypes.c_uint64()
    _call("ccalloc_sim_device_bytes", _device_index(device), ctypes.byref(out))
    return out.value


# Pinned host and managed memory: defined in ``ccalloc.host`` (which uses the plumbing above).
from . import host as _host  # noqa: E402
from .host import *  # noqa: E402,F401,F403

__all__ += _host.__all__
