"""CCALLOC_LOG: ccalloc's own log on stderr or in a file, silent by default."""

from conftest import run_python

WORK = """
import ccalloc
p = ccalloc.malloc(3 << 20)
ccalloc.free(p)
ccalloc.empty_cache()
ccalloc.set_config("max_split_size_mb:200")
try:
    ccalloc.malloc(1 << 60)
except ccalloc.OutOfMemoryError:
    pass
"""


def test_silent_by_default():
    out = run_python(WORK, drop=("CCALLOC_LOG", "CCALLOC_LOG_FILE"))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


def test_debug_logs_segments_settings_and_ooms_to_stderr():
    out = run_python(WORK, env={"CCALLOC_LOG": "debug"}, drop=("CCALLOC_LOG_FILE",))
    assert out.returncode == 0, out.stderr
    for needle in ("ccalloc initialized", "segment_map", "segment_unmap", "settings changed: max_split_size_mb:200", "out of memory"):
        assert needle in out.stderr, (needle, out.stderr)


def test_log_file(tmp_path):
    path = tmp_path / "ccalloc.log"
    out = run_python(WORK, env={"CCALLOC_LOG": "info", "CCALLOC_LOG_FILE": str(path)})
    assert out.returncode == 0, out.stderr
    text = path.read_text()
    assert "ccalloc initialized" in text and "segment_map" not in text  # info: no debug events
    assert "segment_map" not in out.stderr


def test_a_bad_filter_is_reported_and_logging_stays_off():
    out = run_python(WORK, env={"CCALLOC_LOG": "debug[[["}, drop=("CCALLOC_LOG_FILE",))
    assert out.returncode == 0, out.stderr
    assert "CCALLOC_LOG" in out.stderr and "logging stays off" in out.stderr
