"""Make ccalloc PyTorch's CUDA memory allocator.

Usage, at the very start of the program (before anything initialises CUDA in PyTorch)::

    import ccalloc.torch
    ccalloc.torch.enable()

    import torch
    x = torch.empty(1 << 20, device="cuda")      # allocated by ccalloc
    print(torch.cuda.memory_summary())           # ccalloc's figures, through PyTorch's API

Two modes (:func:`mode` says which is active):

``"backend"`` (the default where it can be built)
    A small C++ adapter (``csrc/torch_allocator.cpp``) subclasses PyTorch's
    ``CUDAAllocator`` and forwards every call to ccalloc, as PyTorch's own cudaMallocAsync
    backend does. It is compiled against the installed torch at the first ``enable()``
    (``torch.utils.cpp_extension``, about 20 s on an H100 host, then cached). Everything of
    ``torch.cuda.memory`` works: ``memory_stats()``, ``max_memory_allocated()``,
    ``memory_summary()``, ``_record_memory_history()`` / ``_snapshot()``, cuDNN benchmarking,
    ``torch.OutOfMemoryError``, CUDA graphs and ``MemPool``.
``"pluggable"`` (the fallback: no compiler, or ``CCALLOC_TORCH_MODE=pluggable``)
    ``torch.cuda.memory.CUDAPluggableAllocator``: allocation, ``empty_cache``, the memory
    fraction, ``record_stream`` and graph pools work; PyTorch's statistics calls raise
    there, so use :func:`ccalloc.memory_stats` and friends.

``CCALLOC_TORCH_MODE`` chooses: ``auto`` (default: backend, else pluggable with a warning),
``backend`` (fail if it cannot be built) or ``pluggable``. ``CCALLOC_TORCH_BUILD_DIR``
sets where the adapter is built (default ``~/.cache/ccalloc``).

This is the only module of the package that imports ``torch``, and it does so inside
:func:`enable`: importing ``ccalloc.torch`` works without PyTorch installed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import warnings
from typing import Any, Optional

from . import _lib

__all__ = ["enable", "is_enabled", "mode", "pinned_tensor", "record_pinned"]

_lock = threading.Lock()
_allocator: Optional[Any] = None  # the adapter module, or the CUDAPluggableAllocator in use
_mode: Optional[str] = None  # "backend" or "pluggable" once enabled

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


def _source_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _header_dir() -> str:
    """The folder holding ``ccalloc.h``: bundled in the package, or the checkout's include/."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "include"), os.path.join(here, "..", "..", "include")):
        if os.path.isfile(os.path.join(candidate, "ccalloc.h")):
            return os.path.abspath(candidate)
    raise RuntimeError("ccalloc: ccalloc.h not found beside the package; reinstall ccalloc")


def _build_adapter(torch: Any, library: str) -> Any:
    """Compiles (or loads from the cache) the C++ backend and returns its module."""
    from torch.utils import cpp_extension

    source = os.path.join(_source_dir(), "torch_allocator.cpp")
    header = os.path.join(_header_dir(), "ccalloc.h")
    digest = hashlib.sha256()
    for path in (source, header):
        with open(path, "rb") as f:
            digest.update(f.read())
    # JIT extensions build without optimisation unless asked: the adapter sits on every
    # allocation and free.
    cflags = ["-O2"]
    digest.update(" ".join(cflags).encode())
    digest.update(torch.__version__.encode())
    digest.update(os.path.realpath(library).encode())
    name = "ccalloc_torch_" + digest.hexdigest()[:16]
    root = os.environ.get("CCALLOC_TORCH_BUILD_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "ccalloc"
    )
    build_dir = os.path.join(root, name)
    os.makedirs(build_dir, exist_ok=True)
    # Linked by full path, so the adapter uses the very library ctypes loaded (one
    # allocator state for both).
    return cpp_extension.load(
        name=name,
        sources=[source],
        extra_include_paths=[_header_dir()],
        extra_cflags=cflags,
        extra_ldflags=[os.path.realpath(library)],
        build_directory=build_dir,
        with_cuda=True,
        verbose=os.environ.get("CCALLOC_TORCH_VERBOSE") == "1",
    )


def _enable_pluggable(torch: Any, lib: ctypes.CDLL) -> Any:
    path = _lib.library_path()
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_FN, FREE_FN)
    raw = allocator._allocator
    for hook, function in HOOKS:
        _hook_setter(raw, hook)(_address(lib, function))
    _wire_graph_pool_hooks(raw, lib)
    torch.cuda.memory.change_current_allocator(allocator)
    return allocator


def enable() -> str:
    """Makes ccalloc PyTorch's CUDA caching allocator; returns the mode (:func:`mode`).

    Idempotent. Must run before PyTorch allocates CUDA memory; raises ``RuntimeError`` when
    CUDA is already initialised and ccalloc is not the current allocator, ``ImportError``
    when PyTorch is not installed, and :class:`ccalloc.LibraryNotFoundError` when
    libccalloc cannot be found.
    """
    global _allocator, _mode
    with _lock:
        if _mode is not None:
            return _mode
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
        wanted = os.environ.get("CCALLOC_TORCH_MODE", "auto").strip().lower() or "auto"
        if wanted not in ("auto", "backend", "pluggable"):
            raise ValueError(
                f"CCALLOC_TORCH_MODE={wanted!r}: expected auto, backend or pluggable"
            )
        if wanted != "pluggable":
            try:
                module = _build_adapter(torch, _lib.library_path())
                module.install()
            except Exception as e:  # no compiler, headers or a failed build
                if wanted == "backend":
                    raise
                warnings.warn(
                    "ccalloc: the PyTorch backend could not be built "
                    f"({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}); "
                    "using the pluggable allocator, where torch.cuda.memory_stats() and "
                    "friends raise (use ccalloc.memory_stats()). Set "
                    "CCALLOC_TORCH_VERBOSE=1 to see the build.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                _allocator, _mode = module, "backend"
                return _mode
        _allocator, _mode = _enable_pluggable(torch, lib), "pluggable"
        return _mode


def is_enabled() -> bool:
    """Whether :func:`enable` has made ccalloc PyTorch's CUDA allocator in this process."""
    return _mode is not None


def mode() -> Optional[str]:
    """``"backend"`` (ccalloc is a full PyTorch allocator backend), ``"pluggable"``
    (through ``CUDAPluggableAllocator``), or ``None`` before :func:`enable`."""
    return _mode


def pinned_tensor(shape: Any, dtype: Any = None) -> Any:
    """A CPU tensor of ``shape`` and ``dtype`` (default ``torch.float32``) in pinned host
    memory from ccalloc's pinned cache: a ``pin_memory()`` for data loaders that wastes
    less (512-byte rounding with split and merge, where PyTorch's pinned cache rounds each
    request to a power of two). Copies from it with ``non_blocking=True`` are asynchronous.

    The block is freed when the tensor's storage goes. As PyTorch does for its own pinned
    memory, mark the streams that copy from it with :func:`record_pinned` so that the block
    is not reused before the copies have finished.
    """
    torch = _import_torch()
    from .host import HostBuffer

    dtype = torch.float32 if dtype is None else dtype
    dims = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
    count = 1
    for d in dims:
        count *= d
    if count == 0:
        return torch.empty(dims, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = HostBuffer((count * itemsize,), "uint8", "pinned")
    raw = (ctypes.c_char * buffer.nbytes).from_address(buffer.ptr)
    # The tensor's storage holds `raw` (torch.frombuffer keeps its buffer object), and `raw`
    # holds the block's owner: the block is freed once neither is referenced.
    raw._ccalloc_owner = buffer  # type: ignore[attr-defined]
    return torch.frombuffer(raw, dtype=dtype, count=count).view(dims)


def record_pinned(tensor: Any, stream: Any = None) -> None:
    """Marks the pinned block behind ``tensor`` (from :func:`pinned_tensor`, or a view of
    one) as used by the work queued until now on ``stream`` (default: the current CUDA
    stream): once the tensor is gone, the block is reused only after that work."""
    torch = _import_torch()
    from . import _stream_handle
    from .host import host_record_stream

    if stream is None:
        stream = torch.cuda.current_stream()
    device = getattr(getattr(stream, "device", None), "index", None)
    # The block starts where the storage does (a view's data_ptr may be inside it).
    block = tensor.untyped_storage().data_ptr()
    host_record_stream(block, _stream_handle(stream), device or 0)
