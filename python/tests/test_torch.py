"""ccalloc.torch without PyTorch: lazy import, the ImportError, and enable()'s wiring checked
against a stand-in ``torch`` module that calls the hooks the way PyTorch does."""

import ctypes
import os
import importlib.util
import sys
import types

import pytest

import ccalloc
import ccalloc.torch as ccalloc_torch
from ccalloc import _lib
from conftest import run_python

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def test_import_ccalloc_does_not_import_torch():
    result = run_python(
        """
        import sys
        import ccalloc
        ccalloc.memory_stats()
        ccalloc.memory_summary()
        assert "ccalloc.torch" not in sys.modules, "ccalloc imported ccalloc.torch"
        assert "torch" not in sys.modules, "ccalloc imported torch"
        import ccalloc.torch
        assert "torch" not in sys.modules, "importing ccalloc.torch imported torch"
        assert not ccalloc.torch.is_enabled()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(HAVE_TORCH, reason="PyTorch is installed")
def test_enable_without_torch_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(ccalloc_torch, "_allocator", None)
    monkeypatch.setattr(ccalloc_torch, "_mode", None)
    with pytest.raises(ImportError, match=r"ccalloc.torch.enable\(\) needs PyTorch, which is not installed"):
        ccalloc_torch.enable()
    assert not ccalloc_torch.is_enabled()


# --------------------------------------------------------------------------------------------
# A stand-in torch
# --------------------------------------------------------------------------------------------


class FakeRawAllocator:
    """torch._C._CUDAPluggableAllocator: hook setters taking a C function address (int)."""

    def __init__(self):
        self.hooks = {}

    def set_init_fn(self, address):
        self.hooks["init"] = address

    def set_reset_fn(self, address):
        self.hooks["reset"] = address

    def set_memory_fraction_fn(self, address):
        self.hooks["memory_fraction"] = address

    def set_record_stream_fn(self, address):
        self.hooks["record_stream"] = address

    def set_begin_allocate_to_pool(self, address):
        self.hooks["begin_allocate_to_pool"] = address

    def set_end_allocate_to_pool_fn(self, address):
        self.hooks["end_allocate_to_pool"] = address

    def set_release_pool(self, address):
        self.hooks["release_pool"] = address


class FakePluggableAllocator:
    """torch.cuda.memory.CUDAPluggableAllocator: loads the .so and takes the two addresses."""

    instances = []

    def __init__(self, path, alloc_fn_name, free_fn_name):
        lib = ctypes.CDLL(path)
        self.path = path
        self.alloc_fn = ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value
        self.free_fn = ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value
        self._allocator = FakeRawAllocator()
        FakePluggableAllocator.instances.append(self)


def make_fake_torch(cuda_initialized=False, has_cuda=True):
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0-fake"
    torch._C = types.SimpleNamespace()
    if has_cuda:
        torch._C._cuda_customAllocator = object()
    changed = []
    torch.cuda = types.SimpleNamespace(
        is_initialized=lambda: cuda_initialized,
        current_device=lambda: 0,
        memory=types.SimpleNamespace(
            CUDAPluggableAllocator=FakePluggableAllocator,
            change_current_allocator=changed.append,
        ),
    )
    torch.changed = changed
    return torch


@pytest.fixture
def fake_torch(monkeypatch):
    monkeypatch.setattr(ccalloc_torch, "_allocator", None)
    monkeypatch.setattr(ccalloc_torch, "_mode", None)
    # The fake torch cannot build the C++ backend: the pluggable path is what is tested.
    monkeypatch.setenv("CCALLOC_TORCH_MODE", "pluggable")
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def address(name):
    return ctypes.cast(getattr(_lib.load(), name), ctypes.c_void_p).value


def test_enable_wires_every_hook(fake_torch):
    assert ccalloc_torch.enable() == "pluggable"
    assert ccalloc_torch.mode() == "pluggable"
    allocator = ccalloc_torch._allocator
    assert isinstance(allocator, FakePluggableAllocator)
    assert fake_torch.changed == [allocator]
    assert ccalloc_torch.is_enabled()
    assert allocator.path == ccalloc.library_path()
    assert allocator.alloc_fn == address("ccalloc_torch_alloc")
    assert allocator.free_fn == address("ccalloc_torch_free")
    assert allocator._allocator.hooks == {
        "init": address("ccalloc_torch_init"),
        "reset": address("ccalloc_torch_empty_cache"),
        "memory_fraction": address("ccalloc_torch_set_memory_fraction"),
        "record_stream": address("ccalloc_torch_record_stream"),
        "begin_allocate_to_pool": address("ccalloc_torch_begin_allocate_to_pool"),
        "end_allocate_to_pool": address("ccalloc_torch_end_allocate_to_pool"),
        "release_pool": address("ccalloc_torch_release_pool"),
    }
    # Idempotent.
    assert ccalloc_torch.enable() == "pluggable"
    assert ccalloc_torch._allocator is allocator
    assert fake_torch.changed == [allocator]


def test_hooks_behave_as_pytorch_calls_them(fake_torch, fresh_stats):
    ccalloc_torch.enable()
    allocator = ccalloc_torch._allocator
    hooks = allocator._allocator.hooks
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(allocator.alloc_fn)
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(allocator.free_fn)
    init = ctypes.CFUNCTYPE(None, ctypes.c_int)(hooks["init"])
    reset = ctypes.CFUNCTYPE(None)(hooks["reset"])
    fraction = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(hooks["memory_fraction"])
    record = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hooks["record_stream"])

    init(2)
    p = malloc(1 << 20, 1, 1)
    assert p and ccalloc.memory_allocated(1) == 1 << 20
    assert malloc(0, 1, 1) is None  # size 0: NULL, as PyTorch expects
    record(p, 2)  # finds the device holding p (1) by itself
    ccalloc.sim_pause_stream(2, device=1)
    free(p, 1 << 20, 1, 1)
    assert ccalloc.memory_allocated(1) == 0
    assert ccalloc.memory_stats(1)["active_bytes.all.current"] == 1 << 20  # waits for stream 2
    ccalloc.sim_pause_stream(2, False, device=1)

    fraction(0.5, 1)
    assert ccalloc.get_per_process_memory_fraction(1) == 0.5
    assert ccalloc.get_per_process_memory_fraction(0) == 1.0

    assert ccalloc.memory_reserved(1) > 0
    reset()  # torch.cuda.empty_cache()
    assert ccalloc.memory_reserved(1) == 0


def test_enable_after_cuda_init_is_refused(monkeypatch):
    monkeypatch.setattr(ccalloc_torch, "_allocator", None)
    monkeypatch.setattr(ccalloc_torch, "_mode", None)
    torch = make_fake_torch(cuda_initialized=True)
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(RuntimeError, match=r"must run before PyTorch initialises CUDA"):
        ccalloc_torch.enable()
    assert torch.changed == [] and not ccalloc_torch.is_enabled()


def test_enable_after_cuda_init_is_fine_once_enabled(fake_torch, monkeypatch):
    mode = ccalloc_torch.enable()
    monkeypatch.setattr(fake_torch.cuda, "is_initialized", lambda: True)
    assert ccalloc_torch.enable() == mode


def test_auto_mode_falls_back_to_pluggable_with_a_warning(fake_torch, monkeypatch):
    # The fake torch has no torch.utils.cpp_extension: the backend cannot be built.
    monkeypatch.setenv("CCALLOC_TORCH_MODE", "auto")
    with pytest.warns(RuntimeWarning, match="PyTorch backend could not be built"):
        assert ccalloc_torch.enable() == "pluggable"
    assert isinstance(ccalloc_torch._allocator, FakePluggableAllocator)


def test_backend_mode_fails_when_the_backend_cannot_be_built(fake_torch, monkeypatch):
    monkeypatch.setenv("CCALLOC_TORCH_MODE", "backend")
    with pytest.raises(ImportError):
        ccalloc_torch.enable()
    assert ccalloc_torch.mode() is None and fake_torch.changed == []


def test_unknown_mode_is_refused(fake_torch, monkeypatch):
    monkeypatch.setenv("CCALLOC_TORCH_MODE", "fast")
    with pytest.raises(ValueError, match="CCALLOC_TORCH_MODE='fast'"):
        ccalloc_torch.enable()
    assert ccalloc_torch.mode() is None


def test_backend_sources_ship_with_the_package():
    assert os.path.isfile(os.path.join(ccalloc_torch._source_dir(), "torch_allocator.cpp"))
    assert os.path.isfile(os.path.join(ccalloc_torch._header_dir(), "ccalloc.h"))


def test_enable_with_cpu_only_torch(monkeypatch):
    monkeypatch.setattr(ccalloc_torch, "_allocator", None)
    monkeypatch.setattr(ccalloc_torch, "_mode", None)
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch(has_cuda=False))
    with pytest.raises(RuntimeError, match="this PyTorch build has no CUDA support"):
        ccalloc_torch.enable()


def test_hook_setter_lookup():
    class Underscored:
        def _set_init_fn(self, address):
            self.address = address

    raw = Underscored()
    ccalloc_torch._hook_setter(raw, "set_init_fn")(42)
    assert raw.address == 42
    with pytest.raises(RuntimeError, match=r"has no set_reset_fn\(\) hook"):
        ccalloc_torch._hook_setter(raw, "set_reset_fn")


def test_graph_pool_hooks_are_wired_to_the_exports():
    raw = FakeRawAllocator()
    lib = _lib.load()
    assert ccalloc_torch._wire_graph_pool_hooks(raw, lib) is True
    for key, function in (
        ("begin_allocate_to_pool", "ccalloc_torch_begin_allocate_to_pool"),
        ("end_allocate_to_pool", "ccalloc_torch_end_allocate_to_pool"),
        ("release_pool", "ccalloc_torch_release_pool"),
    ):
        assert raw.hooks[key] == ctypes.cast(getattr(lib, function), ctypes.c_void_p).value


def test_graph_pool_hooks_missing_warns():
    class Old:
        pass

    with pytest.warns(RuntimeWarning, match="CUDA-graph pool hooks"):
        assert ccalloc_torch._wire_graph_pool_hooks(Old(), _lib.load()) is False
