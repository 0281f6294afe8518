"""init / shutdown / info calls, and configuration from the environment (fresh processes)."""

import re

import ccalloc
from conftest import run_python


def test_info_calls():
    ccalloc.init()
    ccalloc.init()  # idempotent
    assert ccalloc.is_initialized()
    assert ccalloc.backend() == "sim"
    assert ccalloc.device_count() == 2
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", ccalloc.version())
    assert ccalloc.version() == ccalloc.__version__, "Python package and library versions differ"


def test_lifecycle_in_a_fresh_process():
    result = run_python(
        """
        import ccalloc
        assert not ccalloc.is_initialized()
        print("version without init:", ccalloc.version())
        assert not ccalloc.is_initialized()
        ccalloc.shutdown()  # not running: nothing to do

        # Any call starts ccalloc on demand.
        assert ccalloc.memory_allocated() == 0
        assert ccalloc.is_initialized()

        p = ccalloc.malloc(4096)
        try:
            ccalloc.shutdown()
        except ccalloc.BusyError as e:
            print("busy:", e.message)
        assert ccalloc.is_initialized()
        ccalloc.free(p)
        ccalloc.shutdown()
        assert not ccalloc.is_initialized()
        ccalloc.shutdown()  # already shut down: nothing to do

        # No implicit restart after an explicit shutdown.
        try:
            ccalloc.memory_stats()
        except ccalloc.ShutDownError as e:
            print("shut down:", e)

        ccalloc.init()
        assert ccalloc.is_initialized()
        assert ccalloc.memory_stats()["allocation.all.allocated"] == 0  # a fresh allocator
        p = ccalloc.malloc(4096)
        ccalloc.free(p)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "version without init: " + ccalloc.version() in out
    assert "busy: device 0 still has 1 live allocations; free them before shutdown" in out
    assert "shut down: ccalloc has been shut down [CCALLOC_SHUT_DOWN]" in out
    assert out.rstrip().endswith("ok")


def test_bad_ccalloc_conf_is_reported_by_init():
    result = run_python(
        """
        import ccalloc
        for call in (ccalloc.init, ccalloc.memory_stats):
            try:
                call()
            except ccalloc.ConfigError as e:
                assert isinstance(e, ValueError)
                print(call.__name__, "->", e.message)
        """,
        env={"CCALLOC_CONF": "no_such_key:1"},
    )
    assert result.returncode == 0, result.stderr
    assert 'init -> CCALLOC_CONF: unknown config key "no_such_key"' in result.stdout
    assert 'memory_stats -> CCALLOC_CONF: unknown config key "no_such_key"' in result.stdout


def test_ccalloc_conf_is_applied():
    result = run_python(
        "import ccalloc; print(ccalloc.memory_stats()['max_split_size'])",
        env={"CCALLOC_CONF": "max_split_size_mb:64"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(64 << 20)


def test_bad_backend_and_sim_settings():
    result = run_python(
        """
        import os, ccalloc
        for backend, capacity in (("bogus", "4GiB"), ("sim", "lots")):
            os.environ["CCALLOC_BACKEND"] = backend
            os.environ["CCALLOC_SIM_CAPACITY"] = capacity
            try:
                ccalloc.init()
            except ccalloc.ConfigError as e:
                print(e.message)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == [
        'CCALLOC_BACKEND="bogus": expected cuda or sim',
        'CCALLOC_SIM_CAPACITY="lots" is not a size such as 80GiB',
    ]


def test_cuda_backend_without_a_driver_is_a_clear_error():
    result = run_python(
        """
        import ccalloc
        try:
            ccalloc.init()
        except ccalloc.DriverUnavailableError as e:
            print("unavailable:", e.message)
        else:
            print("initialised:", ccalloc.backend())
        """,
        env={"CCALLOC_BACKEND": "cuda"},
    )
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("initialised:"):
        assert result.stdout.strip() == "initialised: cuda"  # a machine with a GPU
    else:
        # One short line: what is missing and the two ways on (not the dozens of file names
        # the loader tried).
        message = result.stdout.strip()
        assert message == (
            "unavailable: the CUDA driver library (libcuda.so.1) was not found: install the "
            "NVIDIA driver; to run without a GPU, set CCALLOC_BACKEND=sim (the simulated device)"
        )

