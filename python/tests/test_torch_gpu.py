"""ccalloc.torch.enable() with a real PyTorch and a GPU (skipped elsewhere).

Each check runs in a fresh interpreter on the cuda backend: enable() must come before
PyTorch initialises CUDA, and the allocator is process-global.
"""

import importlib.util
import textwrap

import pytest

from conftest import run_python

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")

CUDA_ENV = {"CCALLOC_BACKEND": "cuda"}
PRELUDE = """
import sys
import torch
if not torch.cuda.is_available():
    print("NO_CUDA")
    sys.exit(0)
import ccalloc, ccalloc.torch
"""


def run_gpu(body):
    result = run_python(PRELUDE + textwrap.dedent(body), env=CUDA_ENV)
    if result.stdout.strip() == "NO_CUDA":
        pytest.skip("PyTorch sees no CUDA device")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_tensors_are_allocated_by_ccalloc():
    out = run_gpu(
        """
        allocator = ccalloc.torch.enable()
        assert ccalloc.torch.enable() is allocator and ccalloc.torch.is_enabled()
        x = torch.empty(1 << 20, device="cuda")  # 4 MiB
        assert ccalloc.backend() == "cuda"
        assert ccalloc.memory_allocated() == 4 << 20, ccalloc.memory_allocated()
        y = (x.fill_(1.0) * 2).sum().item()
        assert y == 2.0 * (1 << 20)
        del x
        torch.cuda.synchronize()
        assert ccalloc.memory_allocated() == 0
        assert ccalloc.memory_reserved() > 0
        torch.cuda.empty_cache()  # the reset hook
        assert ccalloc.memory_reserved() == 0
        print(ccalloc.memory_summary(abbreviated=True))
        print("ok")
        """
    )
    assert "ccalloc CUDA memory summary, device ID 0" in out
    assert out.rstrip().endswith("ok")


def test_record_stream_and_memory_fraction_hooks():
    out = run_gpu(
        """
        ccalloc.torch.enable()
        side = torch.cuda.Stream()
        x = torch.ones(1 << 20, device="cuda")
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # keep the side stream busy
            x.mul_(3)
        x.record_stream(side)  # the record_stream hook
        del x
        # Freed, but still active until the side stream's work completes.
        active = ccalloc.memory_stats()["active_bytes.all.current"]
        side.synchronize()
        torch.cuda.synchronize()
        print("active while busy:", active)

        torch.cuda.set_per_process_memory_fraction(0.25)  # the memory-fraction hook
        assert ccalloc.get_per_process_memory_fraction() == 0.25
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            t = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
            # PyTorch does not check a pluggable allocator's NULL: the tensor has no data.
            print("oom: tensor with data_ptr", t.data_ptr())
        except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
            print("oom: raised", type(e).__name__)
        print("num_ooms:", ccalloc.memory_stats()["num_ooms"])
        print("ok")
        """
    )
    assert "active while busy: 4194304" in out
    assert "oom: raised" in out or "oom: tensor with data_ptr 0" in out
    assert "num_ooms: 1" in out
    assert out.rstrip().endswith("ok")


def test_enable_after_cuda_init_is_refused():
    out = run_gpu(
        """
        torch.zeros(1, device="cuda")
        try:
            ccalloc.torch.enable()
        except RuntimeError as e:
            print("refused:", e)
        """
    )
    assert "refused: ccalloc.torch.enable() must run before PyTorch initialises CUDA" in out


def test_memory_breakdown_on_the_gpu():
    # On CUDA pages are the driver's granularity (2 MiB): the breakdown's parts must still add
    # up to reserved, and the peak's must hold a spike freed before anyone looked.
    out = run_gpu(
        """
        ccalloc.torch.enable()
        ccalloc.set_config("record_peak_breakdown:True")
        parts = ("live_bytes", "free_chunk_bytes", "pinned_bytes", "rounding_bytes", "parked_bytes",
                 "plain_bytes")
        kept = [torch.empty(n * 77 * 1024, dtype=torch.uint8, device="cuda") for n in range(1, 40)]
        spike = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
        live_at_spike = ccalloc.memory_allocated()
        del spike
        torch.cuda.synchronize()
        peak = ccalloc.memory_breakdown(at_peak=True)
        now = ccalloc.memory_breakdown()
        for b in (peak, now):
            assert sum(b[k] for k in parts) == b["reserved_bytes"], b
        assert peak["reserved_bytes"] == ccalloc.max_memory_reserved(), peak
        assert peak["live_bytes"] == live_at_spike, (peak, live_at_spike)
        assert now["live_bytes"] == ccalloc.memory_allocated() < live_at_spike, now
        print(peak, now)
        print("ok")
        """
    )
    assert out.rstrip().endswith("ok")
