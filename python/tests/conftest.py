"""Test setup: the sim backend (no GPU, no torch), this checkout's package and library.

The library holds one allocator per process, so tests must be order-independent: every test
frees what it allocates (the ``alloc`` fixture does it even when a test fails), and the
autouse ``clean_state`` fixture restores settings, empties the cache and checks that nothing
was left allocated. Tests that need a fresh process (lifecycle, environment, loader) run
Python in a subprocess through ``run_python``.
"""

import os
import subprocess
import sys
import textwrap

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(TESTS_DIR)
REPO_DIR = os.path.dirname(PYTHON_DIR)
HEADER = os.path.join(REPO_DIR, "include", "ccalloc.h")
SIM_HEADER = os.path.join(REPO_DIR, "include", "ccalloc_sim.h")

# Before anything loads or starts the library: ccalloc_init() reads these.
SIM_ENV = {
    "CCALLOC_BACKEND": "sim",
    "CCALLOC_SIM_CAPACITY": "4GiB",
    "CCALLOC_SIM_DEVICES": "2",
}
os.environ.update(SIM_ENV)
os.environ.pop("CCALLOC_CONF", None)

# Test this checkout's package, not an installed copy.
sys.path.insert(0, PYTHON_DIR)

import ccalloc  # noqa: E402
from ccalloc import _lib  # noqa: E402

CAPACITY = 4 << 30
MiB = 1 << 20
GiB = 1 << 30

def pytest_sessionstart(session):
    try:
        _lib.load()
    except _lib.LibraryNotFoundError as e:
        pytest.exit(f"{e}\n(run `cargo build` in {REPO_DIR} before the Python tests)", returncode=4)


def run_python(code, env=None, drop=()):
    """Runs ``code`` in a fresh interpreter that imports this checkout's ccalloc."""
    child_env = dict(os.environ)
    for name in drop:
        child_env.pop(name, None)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = PYTHON_DIR + os.pathsep + child_env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _restore():
    ccalloc.init()
    ccalloc.reset_config()
    for device in range(ccalloc.device_count()):
        for stream in (0, 1, 2, 3):
            ccalloc.sim_pause_stream(stream, False, device=device)
    ccalloc.empty_cache()


@pytest.fixture(autouse=True)
def clean_state():
    _restore()
    yield
    _restore()
    leaks = {d: ccalloc.memory_allocated(d) for d in range(ccalloc.device_count())}
    assert all(v == 0 for v in leaks.values()), f"test left allocations behind: {leaks}"
    assert all(ccalloc.memory_reserved(d) == 0 for d in leaks), "empty_cache left memory reserved"


class Allocations:
    """``malloc`` that remembers its blocks; whatever the test did not free is freed after it."""

    def __init__(self):
        self.pointers = []

    def __call__(self, size, device=0, stream=0):
        ptr = ccalloc.malloc(size, device=device, stream=stream)
        self.pointers.append((ptr, device))
        return ptr

    def release_all(self):
        for ptr, device in reversed(self.pointers):
            try:
                ccalloc.free(ptr, device=device)
            except (ccalloc.DoubleFreeError, ccalloc.UnknownPointerError):
                pass  # the test freed it itself (and maybe emptied the cache)
        self.pointers.clear()


@pytest.fixture
def alloc():
    allocations = Allocations()
    yield allocations
    allocations.release_all()


@pytest.fixture
def fresh_stats():
    """Zeroed totals and peaks on both devices (nothing is live at test start)."""
    ccalloc.empty_cache()
    ccalloc.reset_accumulated_memory_stats(-1)
    ccalloc.reset_peak_memory_stats(-1)
