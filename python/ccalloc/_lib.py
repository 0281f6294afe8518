"""ctypes binding of ``libccalloc.so`` (the C API in ``include/ccalloc.h``).

Nothing here runs at import time: the library is looked up and loaded on the first call of
:func:`load`, so ``import ccalloc`` works where the library is missing and the error
(:class:`LibraryNotFoundError`) comes with the first call that needs it.

Search order (the first hit wins):

1. ``$CCALLOC_LIBRARY``: an explicit path. When set it is the only candidate: a wrong value
   is reported, never silently replaced by another copy.
2. ``libccalloc.so`` inside this package: ``pip install ./python`` (and the wheel it makes)
   builds it with cargo and bundles it. An editable install (``pip install -e``) puts a
   copy in ``python/ccalloc/`` too, refreshed only by installing again.
3. In a source checkout only (``<repo>/Cargo.toml`` exists, relative to this file:
   ``python/ccalloc/../..``): ``<repo>/target/release/libccalloc.so`` and then
   ``<repo>/target/debug/libccalloc.so``, what ``cargo build`` makes; so
   ``PYTHONPATH=<repo>/python`` works without installing.
"""

from __future__ import annotations

import ctypes
import enum
import operator
import os
import sys
import threading
from ctypes import (
    POINTER,
    c_bool,
    c_char_p,
    c_double,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import Dict, List, Optional, Tuple

__all__ = [
    "ENV_LIBRARY",
    "LIBRARY_NAME",
    "FUNCTIONS",
    "CcallocError",
    "LibraryNotFoundError",
    "ccalloc_stat",
    "ccalloc_stat_array",
    "ccalloc_stats",
    "ccalloc_pool_id",
    "ccalloc_trace_entry",
    "ccalloc_segment_info",
    "ccalloc_block_info",
    "ccalloc_stream_filter",
    "ccalloc_release_fn",
    "candidate_paths",
    "load",
    "library_path",
    "last_error",
    "status_name",
    "error_for",
]

ENV_LIBRARY = "CCALLOC_LIBRARY"

if sys.platform == "darwin":
    LIBRARY_NAME = "libccalloc.dylib"
elif sys.platform == "win32":
    LIBRARY_NAME = "ccalloc.dll"
else:
    LIBRARY_NAME = "libccalloc.so"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_DIR = os.path.dirname(os.path.dirname(_PACKAGE_DIR))


# --------------------------------------------------------------------------------------------
# Status codes and exceptions
# --------------------------------------------------------------------------------------------


class _StatusBase(enum.IntEnum):
    """The base of :class:`Status`, whose members are read from the loaded library."""

    @property
    def c_name(self) -> str:
        """The name in ``ccalloc.h``, e.g. ``"CCALLOC_OUT_OF_MEMORY"``."""
        return "CCALLOC_" + self.name


# ``CCALLOC_OK``: 0 by the C API's contract (``ccalloc.h``), so checking a status needs no table.
_OK = 0

# What ``ccalloc_status_name`` answers past the last status.
_UNKNOWN_STATUS = "CCALLOC_UNKNOWN_STATUS"

# More statuses than any library has: a library that never answers ``_UNKNOWN_STATUS`` is
# refused instead of read forever.
_MAX_STATUSES = 1024


def _read_statuses(lib, path: str) -> type:
    """``enum ccalloc_status`` as ``lib`` names it: ``ccalloc_status_name(0)``, ``(1)``, ...
    until ``CCALLOC_UNKNOWN_STATUS`` (the library's values run 0, 1, 2, ... without gaps)."""
    members: List[Tuple[str, int]] = []
    while True:
        value = len(members)
        name = _decode(lib.ccalloc_status_name(value))
        if name == _UNKNOWN_STATUS:
            break
        taken = any(m[0] == name[len("CCALLOC_") :] for m in members)
        if not name.startswith("CCALLOC_") or taken or value >= _MAX_STATUSES:
            raise LibraryNotFoundError(
                f"ccalloc: {path}: ccalloc_status_name({value}) = {name!r} is not a new "
                f"status name; it was built from another ccalloc version than this package."
            )
        members.append((name[len("CCALLOC_") :], value))
    if not members or members[0] != ("OK", _OK):
        raise LibraryNotFoundError(f"ccalloc: {path}: status 0 is not CCALLOC_OK")
    status = _StatusBase("Status", members, module=__name__, qualname="Status")
    status.__doc__ = (
        "``enum ccalloc_status`` (the value of every C call; ``OK`` is 0), read from the "
        "loaded library's ``ccalloc_status_name``."
    )
    return status


def __getattr__(name: str):
    # ``Status`` exists once the library is loaded (``load`` sets it as a module attribute):
    # its members are the library's own. Asking for it first loads the library.
    if name == "Status":
        load()
        return globals()["Status"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _status_type() -> type:
    """:class:`Status` (loading the library if needed)."""
    load()
    return globals()["Status"]


class LibraryNotFoundError(OSError):
    """``libccalloc.so`` could not be found or loaded (or lacks a symbol this package needs)."""


# The exception class of each status that has one, by C name (``class ...(status=NAME)``).
_ERROR_CLASSES: Dict[str, type] = {}


class CcallocError(RuntimeError):
    """A ccalloc call failed.

    ``status`` is the :class:`Status` (an ``int`` when the library returned a code it has no
    name for), ``message`` the text of ``ccalloc_last_error()``.
    Subclasses exist for each status; several also derive from the matching built-in
    (``MemoryError``, ``ValueError``) so generic handlers catch them. A status without a
    subclass here (one newer than this package) raises ``CcallocError`` itself.
    """

    status: "Status | int" = -1

    def __init_subclass__(cls, status: Optional[str] = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if status is not None:
            _ERROR_CLASSES[status] = cls

    def __init__(self, status: "Status | int", message: str = ""):
        try:
            status = _status_type()(status)
        except (ValueError, LibraryNotFoundError):
            pass
        self.status = status
        self.message = message
        name = status.c_name if isinstance(status, _StatusBase) else f"status {status}"
        super().__init__(f"{message} [{name}]" if message else name)

    def __reduce__(self):
        return (type(self), (int(self.status), self.message))


class InvalidArgumentError(CcallocError, ValueError, status="CCALLOC_INVALID_ARGUMENT"):
    """``CCALLOC_INVALID_ARGUMENT``: a NULL pointer, NaN or otherwise unusable argument."""


class NotInitializedError(CcallocError, status="CCALLOC_NOT_INITIALIZED"):
    """``CCALLOC_NOT_INITIALIZED`` (the Python API calls ``init()`` itself, so rarely seen)."""


class ShutDownError(CcallocError, status="CCALLOC_SHUT_DOWN"):
    """``CCALLOC_SHUT_DOWN``: ``shutdown()`` was called; call ``init()`` to start again."""


class OutOfMemoryError(CcallocError, MemoryError, status="CCALLOC_OUT_OF_MEMORY"):
    """``CCALLOC_OUT_OF_MEMORY``: the device or the memory limit cannot hold the request."""


class UnknownPointerError(CcallocError, ValueError, status="CCALLOC_UNKNOWN_POINTER"):
    """``CCALLOC_UNKNOWN_POINTER``: not allocated by ccalloc, or points inside a block."""


class DoubleFreeError(CcallocError, ValueError, status="CCALLOC_DOUBLE_FREE"):
    """``CCALLOC_DOUBLE_FREE``: the block was already freed."""


class WrongDeviceError(CcallocError, ValueError, status="CCALLOC_WRONG_DEVICE"):
    """``CCALLOC_WRONG_DEVICE``: the pointer belongs to another device."""


class InvalidDeviceError(CcallocError, ValueError, status="CCALLOC_INVALID_DEVICE"):
    """``CCALLOC_INVALID_DEVICE``: no such device."""


class InvalidSizeError(CcallocError, ValueError, status="CCALLOC_INVALID_SIZE"):
    """``CCALLOC_INVALID_SIZE``: size 0."""


class ConfigError(CcallocError, ValueError, status="CCALLOC_CONFIG_ERROR"):
    """``CCALLOC_CONFIG_ERROR``: unknown config key, bad value, or bad ``CCALLOC_*`` variable."""


class DriverUnavailableError(CcallocError, status="CCALLOC_DRIVER_UNAVAILABLE"):
    """``CCALLOC_DRIVER_UNAVAILABLE``: no usable CUDA driver (try ``CCALLOC_BACKEND=sim``)."""


class DriverError(CcallocError, status="CCALLOC_DRIVER_ERROR"):
    """``CCALLOC_DRIVER_ERROR``: a CUDA driver call failed."""


class BusyError(CcallocError, status="CCALLOC_BUSY"):
    """``CCALLOC_BUSY``: shutdown refused while allocations are live."""


class InternalError(CcallocError, status="CCALLOC_INTERNAL_ERROR"):
    """``CCALLOC_INTERNAL_ERROR``: a bug in ccalloc (a panic caught at the C boundary)."""


# The exception class of each status, by C name (a status missing here raises CcallocError).
ERROR_CLASSES = dict(_ERROR_CLASSES)


def error_for(status: int, message: str) -> CcallocError:
    """The exception for a failed call's ``status`` and message: the class of its status, or
    :class:`CcallocError` for a status this package has no class for."""
    try:
        name = _status_type()(status).c_name
    except ValueError:
        name = None
    return _ERROR_CLASSES.get(name, CcallocError)(status, message)


# --------------------------------------------------------------------------------------------
# Structures (field by field as in ccalloc.h)
# --------------------------------------------------------------------------------------------


class ccalloc_stat(ctypes.Structure):
    """``ccalloc_stat``: one counter, as in ``torch.cuda.memory_stats()``."""

    _fields_ = [
        ("current", c_int64),
        ("peak", c_int64),
        ("allocated", c_int64),
        ("freed", c_int64),
    ]


class ccalloc_stat_array(ctypes.Structure):
    """``ccalloc_stat_array``: a counter for all blocks and per pool."""

    _fields_ = [
        ("all", ccalloc_stat),
        ("small_pool", ccalloc_stat),
        ("large_pool", ccalloc_stat),
    ]


class ccalloc_stats(ctypes.Structure):
    """``ccalloc_stats``: per-device statistics with PyTorch's names and meanings."""

    _fields_ = [
        ("allocation", ccalloc_stat_array),
        ("segment", ccalloc_stat_array),
        ("active", ccalloc_stat_array),
        ("inactive_split", ccalloc_stat_array),
        ("allocated_bytes", ccalloc_stat_array),
        ("reserved_bytes", ccalloc_stat_array),
        ("active_bytes", ccalloc_stat_array),
        ("inactive_split_bytes", ccalloc_stat_array),
        ("requested_bytes", ccalloc_stat_array),
        ("oversize_allocations", ccalloc_stat),
        ("oversize_segments", ccalloc_stat),
        ("num_alloc_retries", c_uint64),
        ("num_ooms", c_uint64),
        ("num_sync_all_streams", c_uint64),
        ("num_device_alloc", c_uint64),
        ("num_device_free", c_uint64),
        ("max_split_size", c_int64),
    ]


class ccalloc_paging_stats(ctypes.Structure):
    """``ccalloc_paging_stats``: what keeping reserved ≈ live has cost on a device."""

    _fields_ = [
        ("growths", c_uint64),
        ("moving_growths", c_uint64),
        ("chunks_mapped", c_uint64),
        ("chunks_unmapped", c_uint64),
        ("host_waits", c_uint64),
        ("growth_ns", c_uint64),
        ("moving_ns", c_uint64),
        ("wait_ns", c_uint64),
        ("page_slack", c_double),
        ("chunks_borrowed", c_uint64),
        ("growths_past_slack", c_uint64),
    ]


class ccalloc_lock_stats(ctypes.Structure):
    """``ccalloc_lock_stats``: how callers met a device's locks."""

    _fields_ = [
        ("acquisitions", c_uint64),
        ("contended", c_uint64),
        ("blocked", c_uint64),
        ("wait_ns", c_uint64),
        ("handoffs", c_uint64),
    ]


class ccalloc_memory_breakdown(ctypes.Structure):
    """``ccalloc_memory_breakdown``: what a device's reserved memory is made of."""

    _fields_ = [
        ("reserved_bytes", c_uint64),
        ("live_bytes", c_uint64),
        ("free_chunk_bytes", c_uint64),
        ("pinned_bytes", c_uint64),
        ("pinning_chunks", c_uint64),
        ("rounding_bytes", c_uint64),
        ("parked_bytes", c_uint64),
        ("plain_bytes", c_uint64),
    ]


class ccalloc_pool_id(ctypes.Structure):
    """``ccalloc_pool_id``: names a private pool (PyTorch's ``MempoolId_t`` layout)."""

    _fields_ = [
        ("first", c_uint64),
        ("second", c_uint64),
    ]


class ccalloc_trace_entry(ctypes.Structure):
    """``ccalloc_trace_entry``: one event of the allocation history."""

    _fields_ = [
        ("seq", c_uint64),
        ("action", c_uint32),
        ("device", c_int32),
        ("addr", c_uint64),
        ("size", c_uint64),
        ("stream", c_void_p),
        ("time_us", c_int64),
        ("context", c_uint64),
    ]


class ccalloc_segment_info(ctypes.Structure):
    """``ccalloc_segment_info``: one segment of a snapshot."""

    _fields_ = [
        ("device", c_int32),
        ("address", c_uint64),
        ("total_size", c_uint64),
        ("allocated_size", c_uint64),
        ("active_size", c_uint64),
        ("requested_size", c_uint64),
        ("stream", c_void_p),
        ("is_large", c_bool),
        ("is_expandable", c_bool),
        ("pool", ccalloc_pool_id),
        ("block_count", c_size_t),
    ]


class ccalloc_block_info(ctypes.Structure):
    """``ccalloc_block_info``: one block of a snapshot's segment."""

    _fields_ = [
        ("address", c_uint64),
        ("size", c_uint64),
        ("requested_size", c_uint64),
        ("state", c_uint32),
    ]


def _nullable_function_pointer(restype, *argtypes):
    """A C function pointer type that also takes ``None`` as an argument (NULL), as the
    header allows for optional callbacks: a plain ``CFUNCTYPE`` refuses ``None``."""
    base = ctypes.CFUNCTYPE(restype, *argtypes)

    class Nullable(base):
        _flags_ = base._flags_
        _restype_ = base._restype_
        _argtypes_ = base._argtypes_

        @classmethod
        def from_param(cls, obj):
            if obj is None:
                return None
            return type(base).from_param(cls, obj)

    return Nullable


# ``bool (*)(void *ctx, cudaStream_t stream)``: whether an allocation on ``stream`` goes to
# the private pool (NULL: every stream). A Python callback must stay referenced until
# ``release(ctx)`` is called.
ccalloc_stream_filter = _nullable_function_pointer(c_bool, c_void_p, c_void_p)

# ``void (*)(void *ctx)``: releases the caller's ``ctx`` when ccalloc no longer needs it
# (NULL: nothing to release).
ccalloc_release_fn = _nullable_function_pointer(None, c_void_p)

# ``void (*)(void *ctx, const ccalloc_trace_entry *entry)``: sees each segment event.
ccalloc_trace_observer = _nullable_function_pointer(None, c_void_p, POINTER(ccalloc_trace_entry))

# ``void (*)(void *ctx, void *ptr, bool allocated)``: one block of a pool restore.
ccalloc_restore_fn = _nullable_function_pointer(None, c_void_p, c_void_p, c_bool)


# --------------------------------------------------------------------------------------------
# Function table: every function declared in ccalloc.h and ccalloc_sim.h, (argtypes, restype)
# --------------------------------------------------------------------------------------------

_status = c_uint32  # ccalloc_status is uint32_t in C (before C23) and repr(u32) in Rust
_stream = c_void_p  # cudaStream_t

FUNCTIONS: Dict[str, Tuple[List[type], Optional[type]]] = {
    "ccalloc_init": ([], _status),
    "ccalloc_shutdown": ([], _status),
    "ccalloc_version": ([], c_char_p),
    "ccalloc_last_error": ([], c_char_p),
    "ccalloc_status_name": ([c_uint32], c_char_p),
    "ccalloc_backend": ([POINTER(c_char_p)], _status),
    "ccalloc_device_count": ([POINTER(c_int32)], _status),
    "ccalloc_is_initialized": ([], c_bool),
    "ccalloc_device_total_memory": ([c_int32, POINTER(c_uint64)], _status),
    "ccalloc_shard_count": ([c_int32, POINTER(c_uint32)], _status),
    "ccalloc_reset_config": ([], _status),
    "ccalloc_malloc": ([c_size_t, c_int32, _stream, POINTER(c_void_p)], _status),
    "ccalloc_free": ([c_void_p, c_int32], _status),
    "ccalloc_record_stream": ([c_void_p, c_int32, _stream], _status),
    "ccalloc_empty_cache": ([c_int32], _status),
    "ccalloc_set_memory_fraction": ([c_double, c_int32], _status),
    "ccalloc_get_memory_fraction": ([c_int32, POINTER(c_double)], _status),
    "ccalloc_set_config": ([c_char_p], _status),
    "ccalloc_get_stats": ([c_int32, POINTER(ccalloc_stats)], _status),
    "ccalloc_get_paging_stats": ([c_int32, POINTER(ccalloc_paging_stats)], _status),
    "ccalloc_get_lock_stats": ([c_int32, POINTER(ccalloc_lock_stats)], _status),
    "ccalloc_get_memory_breakdown": ([c_int32, c_bool, POINTER(ccalloc_memory_breakdown)], _status),
    "ccalloc_reset_peak_stats": ([c_int32], _status),
    "ccalloc_reset_accumulated_stats": ([c_int32], _status),
    "ccalloc_sim_pause_stream": ([c_int32, _stream, c_bool], _status),
    "ccalloc_sim_device_bytes": ([c_int32, POINTER(c_uint64)], _status),
    # Pinned host and managed memory.
    "ccalloc_host_malloc": ([c_size_t, POINTER(c_void_p)], _status),
    "ccalloc_host_free": ([c_void_p], _status),
    "ccalloc_host_record_stream": ([c_void_p, c_int32, _stream], _status),
    "ccalloc_host_empty_cache": ([], _status),
    "ccalloc_host_get_stats": ([POINTER(ccalloc_stats)], _status),
    "ccalloc_host_reset_peak_stats": ([], _status),
    "ccalloc_managed_malloc": ([c_size_t, POINTER(c_void_p)], _status),
    "ccalloc_managed_free": ([c_void_p], _status),
    "ccalloc_managed_record_stream": ([c_void_p, c_int32, _stream], _status),
    "ccalloc_managed_empty_cache": ([], _status),
    "ccalloc_managed_get_stats": ([POINTER(ccalloc_stats)], _status),
    "ccalloc_managed_reset_peak_stats": ([], _status),
    "ccalloc_prefetch": ([c_void_p, c_size_t, c_int32, _stream], _status),
    "ccalloc_advise": ([c_void_p, c_size_t, c_uint32, c_int32], _status),
    "ccalloc_sim_prefetches": ([c_int32, POINTER(c_uint64), POINTER(c_uint64)], _status),
    # Private pools (CUDA graphs).
    "ccalloc_begin_allocate_to_pool": (
        [c_int32, ccalloc_pool_id, ccalloc_stream_filter, c_void_p, ccalloc_release_fn],
        _status,
    ),
    "ccalloc_end_allocate_to_pool": ([c_int32, ccalloc_pool_id], _status),
    "ccalloc_release_pool": ([c_int32, ccalloc_pool_id], _status),
    "ccalloc_create_or_incref_pool": ([c_int32, ccalloc_pool_id], _status),
    "ccalloc_pool_use_count": ([c_int32, ccalloc_pool_id, POINTER(c_uint32)], _status),
    # Looking into memory: the largest cached block, history, snapshots.
    "ccalloc_cache_info": ([c_int32, POINTER(c_uint64)], _status),
    "ccalloc_record_history": ([c_bool, c_size_t, c_bool], _status),
    "ccalloc_is_recording_history": ([], c_bool),
    "ccalloc_set_trace_context": ([c_uint64], None),
    "ccalloc_history_oldest_seq": ([POINTER(c_uint64)], _status),
    "ccalloc_snapshot_take": ([c_int32, c_bool, POINTER(c_void_p)], _status),
    "ccalloc_snapshot_free": ([c_void_p], None),
    "ccalloc_snapshot_counts": ([c_void_p, POINTER(c_size_t), POINTER(c_size_t)], _status),
    "ccalloc_snapshot_segment": ([c_void_p, c_size_t, POINTER(ccalloc_segment_info)], _status),
    "ccalloc_snapshot_block": (
        [c_void_p, c_size_t, c_size_t, POINTER(ccalloc_block_info)],
        _status,
    ),
    "ccalloc_snapshot_trace_entry": ([c_void_p, c_size_t, POINTER(ccalloc_trace_entry)], _status),
    "ccalloc_dump_snapshot": ([c_char_p], _status),
    "ccalloc_add_segment_observer": ([ccalloc_trace_observer, c_void_p], _status),
    "ccalloc_restore_pool": (
        [c_int32, ccalloc_pool_id, POINTER(ccalloc_block_info), c_size_t, ccalloc_restore_fn, c_void_p],
        _status,
    ),
    # PyTorch CUDAPluggableAllocator entry points (their addresses are handed to PyTorch).
    "ccalloc_torch_alloc": ([c_size_t, c_int, _stream], c_void_p),
    "ccalloc_torch_free": ([c_void_p, c_size_t, c_int, _stream], None),
    "ccalloc_torch_init": ([c_int], None),
    "ccalloc_torch_empty_cache": ([], None),
    "ccalloc_torch_set_memory_fraction": ([c_double, c_int], None),
    "ccalloc_torch_record_stream": ([c_void_p, _stream], None),
    "ccalloc_torch_begin_allocate_to_pool": ([c_int, ccalloc_pool_id, c_void_p], None),
    "ccalloc_torch_end_allocate_to_pool": ([c_int, ccalloc_pool_id], None),
    "ccalloc_torch_release_pool": ([c_int, ccalloc_pool_id], None),
}

# The C++ shim's internal helpers; cbindgen.toml keeps them out of the header.
HEADER_INTERNAL: Tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def candidate_paths() -> List[Tuple[str, str]]:
    """``(where, path)`` pairs in search order (only ``$CCALLOC_LIBRARY`` when it is set)."""
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        return [(f"${ENV_LIBRARY}", explicit)]
    candidates = [("package", os.path.join(_PACKAGE_DIR, LIBRARY_NAME))]
    if _in_checkout():
        candidates += [
            ("target/release", os.path.join(_REPO_DIR, "target", "release", LIBRARY_NAME)),
            ("target/debug", os.path.join(_REPO_DIR, "target", "debug", LIBRARY_NAME)),
        ]
    return candidates


def _in_checkout() -> bool:
    """Whether this package is ``python/ccalloc`` of a source checkout (not an install)."""
    return os.path.isfile(os.path.join(_REPO_DIR, "Cargo.toml"))


def _find() -> str:
    candidates = candidate_paths()
    for _, path in candidates:
        if os.path.isfile(path):
            return os.path.realpath(path)
    if os.environ.get(ENV_LIBRARY):
        raise LibraryNotFoundError(
            f"ccalloc: {ENV_LIBRARY}={candidates[0][1]!r} does not name an existing file. "
            f"Point it at a built {LIBRARY_NAME} (e.g. <repo>/target/release/{LIBRARY_NAME}) "
            f"or unset it to search the default places."
        )
    looked = "\n".join(f"  - {path} ({where})" for where, path in candidates)
    if _in_checkout():
        advice = (
            f"Build it with `cargo build --release` in {_REPO_DIR}, or install the package "
            f"with `pip install {os.path.join(_REPO_DIR, 'python')}` (which builds and "
            f"bundles it), or set {ENV_LIBRARY} to its path."
        )
    else:
        advice = (
            f"This installation of ccalloc lacks its library: reinstall it with "
            f"`pip install <ccalloc checkout>/python` (which builds it with cargo), or set "
            f"{ENV_LIBRARY} to the path of a libccalloc built by `cargo build --release`."
        )
    raise LibraryNotFoundError(
        f"ccalloc: {LIBRARY_NAME} not found. Looked in ${ENV_LIBRARY} (unset) and:\n{looked}\n"
        + advice
    )


def _bind(lib: ctypes.CDLL, path: str) -> None:
    for name, (argtypes, restype) in FUNCTIONS.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name.startswith("ccalloc_sim_"):
                # A library built without the simulated device (no `sim` feature): it works
                # on CUDA, and only the sim_* controls are missing.
                continue
            raise LibraryNotFoundError(
                f"ccalloc: {path} has no symbol {name}: it was built from another ccalloc "
                f"version than this Python package. Rebuild it (`cargo build --release`)."
            ) from None
        fn.argtypes = argtypes
        fn.restype = restype


def load() -> ctypes.CDLL:
    """The loaded library (found, loaded and bound on first call; later calls are cheap).

    Raises :class:`LibraryNotFoundError` when it cannot be found or loaded. A failure is not
    remembered: a later call searches again (e.g. after ``CCALLOC_LIBRARY`` was set).
    """
    global _lib, _lib_path
    lib = _lib
    if lib is not None:
        return lib
    with _lock:
        if _lib is not None:
            return _lib
        path = _find()
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryNotFoundError(f"ccalloc: found {path} but could not load it: {e}") from e
        _bind(lib, path)
        if "Status" not in globals():
            globals()["Status"] = _read_statuses(lib, path)
        _lib_path = path
        _lib = lib
        return lib


def library_path() -> str:
    """The absolute path of the library in use (loading it if needed).

    ``ccalloc.torch`` hands this path to ``CUDAPluggableAllocator``, whose ``dlopen`` then
    returns this same, already loaded library (one allocator state per process).
    """
    load()
    assert _lib_path is not None
    return _lib_path


def _decode(raw: Optional[bytes]) -> str:
    return raw.decode("utf-8", errors="replace") if raw else ""


def last_error() -> str:
    """``ccalloc_last_error()``: this thread's last failure message ("" if none)."""
    return _decode(load().ccalloc_last_error())


def status_name(status: int) -> str:
    """``ccalloc_status_name()``, e.g. ``"CCALLOC_OUT_OF_MEMORY"``."""
    status = operator.index(status)
    if not 0 <= status < 1 << 32:
        raise ValueError(f"status {status} is not a ccalloc_status (an unsigned 32-bit value)")
    return _decode(load().ccalloc_status_name(status))


def check(status: int) -> None:
    """Raises the matching :class:`CcallocError` unless ``status`` is ``OK``.

    Must run on the thread that made the failing call (the message is thread-local); ctypes
    calls run on the calling thread, so calling this right after the call is enough.
    """
    if status != _OK:
        raise error_for(status, last_error())
