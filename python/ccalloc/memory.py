"""Memory history and snapshots without PyTorch, in PyTorch's format.

The same calls as ``torch.cuda.memory``: record the history, then take or dump a snapshot
that PyTorch's viewer reads (``python -m torch.cuda._memory_viz trace_plot snap.pickle -o
t.html``, or https://pytorch.org/memory_viz) and that ``ccalloc replay`` replays::

    import ccalloc.memory
    ccalloc.memory._record_memory_history(max_entries=100_000)
    ...  # allocate and free through ccalloc
    ccalloc.memory._dump_snapshot("snap.pickle")

Without PyTorch there are no stack frames: each event's ``frames`` is empty. With
``ccalloc.torch.enable()``, use ``torch.cuda.memory``'s own calls instead: they reach ccalloc
and carry PyTorch's frames.
"""

from __future__ import annotations

import ctypes
import operator
import os
import pickle
from typing import Any, Dict, List, Optional, Union

from . import _call, _device_index, _lib

__all__ = ["_record_memory_history", "_snapshot", "_dump_snapshot", "is_recording"]

ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
BLOCK_STATES = ("inactive", "active_allocated", "active_pending_free")


def _record_memory_history(
    enabled: Optional[str] = "all",
    context: Optional[str] = None,
    stacks: str = "all",
    max_entries: int = 1_000_000,
    clear_history: bool = False,
) -> None:
    """Starts recording allocation history (``enabled=None`` stops and clears it).

    Same arguments as ``torch.cuda.memory._record_memory_history``; ``context`` and
    ``stacks`` are accepted for compatibility (there are no frames without PyTorch).
    """
    del context, stacks
    if enabled not in (None, "state", "all"):
        raise ValueError(f"enabled={enabled!r}: expected None, 'state' or 'all'")
    on = enabled is not None
    entries = operator.index(max_entries)  # an int: "10" or 1.5 is a TypeError
    if entries < 0:
        raise ValueError(f"max_entries must be >= 0, got {entries}")
    _lib.load()
    # PyTorch's callers pass sys.maxsize for "no limit": anything past size_t means that too.
    _call("ccalloc_record_history", on, min(entries, (1 << 64) - 1), not on or clear_history)


def is_recording() -> bool:
    """Whether the allocation history is being recorded."""
    return bool(_lib.load().ccalloc_is_recording_history())


def _snapshot(device: Optional[int] = None) -> Dict[str, Any]:
    """The snapshot as a dict in ``torch.cuda.memory._snapshot()``'s format."""
    lib = _lib.load()
    handle = ctypes.c_void_p()
    device_index = -1 if device is None else _device_index(device)
    _call("ccalloc_snapshot_take", device_index, True, ctypes.byref(handle))
    try:
        n_segments, n_trace = ctypes.c_size_t(), ctypes.c_size_t()
        _lib.check(lib.ccalloc_snapshot_counts(handle, ctypes.byref(n_segments), ctypes.byref(n_trace)))
        segments: List[Dict[str, Any]] = []
        for i in range(n_segments.value):
            s = _lib.ccalloc_segment_info()
            _lib.check(lib.ccalloc_snapshot_segment(handle, i, ctypes.byref(s)))
            blocks = []
            for j in range(s.block_count):
                b = _lib.ccalloc_block_info()
                _lib.check(lib.ccalloc_snapshot_block(handle, i, j, ctypes.byref(b)))
                blocks.append(
                    {
                        "address": b.address,
                        "size": b.size,
                        "requested_size": b.requested_size,
                        "state": BLOCK_STATES[b.state],
                        "frames": [],
                    }
                )
            segments.append(
                {
                    "device": s.device,
                    "address": s.address,
                    "total_size": s.total_size,
                    "allocated_size": s.allocated_size,
                    "active_size": s.active_size,
                    "requested_size": s.requested_size,
                    "stream": s.stream or 0,
                    "segment_type": "large" if s.is_large else "small",
                    "segment_pool_id": (s.pool.first, s.pool.second),
                    "is_expandable": bool(s.is_expandable),
                    "frames": [],
                    "blocks": blocks,
                }
            )
        count = ctypes.c_int32()
        _call("ccalloc_device_count", ctypes.byref(count))
        traces: List[List[Dict[str, Any]]] = [[] for _ in range(max(count.value, 1))]
        for i in range(n_trace.value):
            e = _lib.ccalloc_trace_entry()
            _lib.check(lib.ccalloc_snapshot_trace_entry(handle, i, ctypes.byref(e)))
            if 0 <= e.device < len(traces):
                traces[e.device].append(
                    {
                        "action": ACTIONS[e.action] if e.action < len(ACTIONS) else "oom",
                        "addr": e.addr,
                        "size": e.size,
                        "stream": e.stream or 0,
                        "time_us": e.time_us,
                        "frames": [],
                    }
                )
    finally:
        lib.ccalloc_snapshot_free(handle)
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {},
        "external_annotations": [],
    }


def _dump_snapshot(filename: Union[str, "os.PathLike[str]"] = "dump_snapshot.pickle") -> None:
    """Writes the snapshot to ``filename`` as a pickle (the C library writes it, as
    ``ccalloc_dump_snapshot`` does for C and C++ hosts)."""
    path = os.fsencode(filename)
    if b"\0" in path:
        raise ValueError(f"filename {filename!r} contains a NUL byte")
    _lib.load()
    _call("ccalloc_dump_snapshot", path)


def _load(filename: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    with open(filename, "rb") as f:
        return pickle.load(f)
