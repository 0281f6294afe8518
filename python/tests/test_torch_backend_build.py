"""The C++ PyTorch backend compiles against the installed torch (skipped where torch or a
C++ compiler is missing, e.g. in CI; the GPU check runs it with CUDA)."""

import importlib.util
import shutil

import pytest

import ccalloc
import ccalloc.torch as ccalloc_torch

HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_the_backend_builds_against_the_installed_torch(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available() and not torch.version.cuda:
        pytest.skip("a CPU-only torch has no CUDA allocator to subclass")
    monkeypatch.setenv("CCALLOC_TORCH_BUILD_DIR", str(tmp_path))
    module = ccalloc_torch._build_adapter(torch, ccalloc.library_path())
    assert callable(module.install) and callable(module.installed)
    assert module.installed() is False  # built, not installed: PyTorch's allocator is untouched
