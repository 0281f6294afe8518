"""Make ccalloc PyTorch's CUDA memory allocator.

Usage, at the very start of the program (before anything initialises CUDA in PyTorch)::

    import ccalloc.torch
    ccalloc.torch.enable()

    import torch
    x = torch.empty(1 << 20, device="cuda")      # allocated by ccalloc
    print(ccalloc.memory_summary())              # ccalloc's statistics

Once enabled, ``torch.cuda.empty_cache()``, ``torch.cuda.set_per_process_memory_fraction()``,
``Tensor.record_stream()`` and CUDA graph capture (private pools) reach ccalloc through
PyTorch's pluggable-allocator hooks.
PyTorch's own ``torch.cuda.memory_stats()`` family does not support pluggable allocators:
use :func:`ccalloc.memory_stats` and friends instead.

This is the only module of the package that imports ``torch``, and it does so inside
:func:`enable`: importing ``ccalloc.torch`` works without PyTorch installed.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional

from . import _lib

__all__ = ["enable", "is_enabled"]

_lock = threading.Lock()
_allocator: Optional[Any] = None  # the torch.cuda.memory.CUDAPluggableAllocator in use

ALLOC_FN = "ccalloc_torch_alloc"
FREE_FN = "ccalloc_torch_free"

# PyTorch hook (method of CUDAPluggableAllocator._allocator) -> ccalloc C function.
# The bound methods take the C function's address as an int (torch/csrc/cuda/Module.cpp,
# registerCudaPluggableAllocator): set_init_fn void(int), set_reset_fn void(),
# set_memory_fraction_fn void(double, int), set_record_stream_fn void(void*, cudaStream_t).
HOOKS = (
    ("set_init_fn", "ccalloc_torch_init"),
    ("set_reset_fn", "ccalloc_torch_empty_cache"),
    ("set_memory_fraction_fn", "ccalloc_torch_set_memory_fraction"),
    ("set_record_stream_fn", "ccalloc_torch_record_stream"),
)


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "ccalloc.torch.enable() needs PyTorch, which is not installed (`pip install torch`). "
            "The rest of ccalloc (statistics, malloc/free) works without it."
        ) from e
    return torch


def _address(lib: ctypes.CDLL, name: str) -> int:
    address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if not address:
        raise RuntimeError(f"ccalloc: {name} has no address in {_lib.library_path()}")
    return address


def _hook_setter(raw: Any, name: str):
    """``raw.<name>``; the underscore spelling is accepted too, should a PyTorch use it."""
    for candidate in (name, "_" + name):
        setter = getattr(raw, candidate, None)
        if callable(setter):
            return setter
    raise RuntimeError(
        f"ccalloc: this PyTorch's pluggable allocator has no {name}() hook "
        f"({type(raw).__name__}); ccalloc needs PyTorch 2.1 or later."
    )


# CUDA-graph private pools: while a graph is captured, PyTorch routes its allocations to a
# private pool (torch/csrc/cuda/Module.cpp). The begin hook's C++ type is
# void(int, MempoolId_t, std::function<bool(cudaStream_t)>); the library's C++ shim copies
# and calls that std::function.
GRAPH_POOL_HOOKS = (
    ("set_begin_allocate_to_pool", "ccalloc_torch_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "ccalloc_torch_end_allocate_to_pool"),
    ("set_release_pool", "ccalloc_torch_release_pool"),
)


def _wire_graph_pool_hooks(raw: Any, lib: ctypes.CDLL) -> bool:
    """Wires the graph-pool hooks; False (with a warning) where this PyTorch lacks them, in
    which case CUDA graph capture with ccalloc is not safe."""
    setters = [(getattr(raw, hook, None) or getattr(raw, "_" + hook, None), fn) for hook, fn in GRAPH_POOL_HOOKS]
    if not all(callable(setter) for setter, _ in setters):
        import warnings

        warnings.warn(
            "ccalloc: this PyTorch's pluggable allocator lacks the CUDA-graph pool hooks; "
            "do not capture CUDA graphs with ccalloc enabled.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    for setter, function in setters:
        setter(_address(lib, function))
    return True


def enable() -> Any:
    """Makes ccalloc PyTorch's CUDA caching allocator; returns the ``CUDAPluggableAllocator``.

    Idempotent: later calls return the same allocator. Must run before PyTorch initialises
    CUDA; raises ``RuntimeError`` when CUDA is already initialised and ccalloc is not the
    current allocator, ``ImportError`` when PyTorch is not installed, and
    :class:`ccalloc.LibraryNotFoundError` when libccalloc cannot be found.
    """
    global _allocator
    with _lock:
        if _allocator is not None:
            return _allocator
        torch = _import_torch()
        if not hasattr(torch._C, "_cuda_customAllocator"):
            raise RuntimeError(
                "ccalloc.torch.enable(): this PyTorch build has no CUDA support "
                f"(torch {torch.__version__})."
            )
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "ccalloc.torch.enable() must run before PyTorch initialises CUDA: CUDA is "
                "already initialised here with another allocator, and PyTorch cannot swap an "
                "allocator that has been used. Call ccalloc.torch.enable() at the start of the "
                "program, before creating CUDA tensors or calling torch.cuda functions that "
                "initialise CUDA."
            )
        lib = _lib.load()
        path = _lib.library_path()
        allocator = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_FN, FREE_FN)
        raw = allocator._allocator
        for hook, function in HOOKS:
            _hook_setter(raw, hook)(_address(lib, function))
        _wire_graph_pool_hooks(raw, lib)
        torch.cuda.memory.change_current_allocator(allocator)
        _allocator = allocator
        return allocator


def is_enabled() -> bool:
    """Whether :func:`enable` has made ccalloc PyTorch's CUDA allocator in this process."""
    return _allocator is not None
