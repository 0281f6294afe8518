"""The steady-state bench's loop clock and summary (benches/gpu/workloads_steady.py): no GPU needed."""

import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH_DIR = os.path.join(HERE, "..", "..", "benches", "gpu")


def load_steady():
    sys.path.insert(0, BENCH_DIR)  # it imports run_workload_ccalloc from its own folder
    try:
        spec = importlib.util.spec_from_file_location("workloads_steady", os.path.join(BENCH_DIR, "workloads_steady.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(BENCH_DIR)


SOURCE = '''
import something_not_installed
def infer():
    events.append("build")
    with ctx():
        for i in range(2):
            events.append(f"step{i}")
def train():
    events.append("build")
    for _ in range(1):
        events.append("step")
    for _ in range(1):
        events.append("second loop")
def no_loop():
    events.append("build")
def with_helper():
    def helper(xs):
        for x in xs:
            events.append(x)
    class Holder:
        for _ in range(1):
            pass
    events.append("build")
    for i in range(2):
        helper([i])
def maybe_loop(n):
    if n:
        for i in range(n):
            events.append(i)
    else:
        events.append("no loop")
'''


class Ctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_loop_mark_goes_before_the_first_loop_even_inside_with():
    steady = load_steady()
    events = []
    ns = {"events": events, "ctx": Ctx, steady.LOOP_MARK: lambda: events.append("mark")}
    steady.compile_workload(SOURCE, "w.py", "infer", ns)()
    assert events == ["build", "mark", "step0", "step1"]
    events.clear()
    steady.compile_workload(SOURCE, "w.py", "train", ns)()
    assert events == ["build", "mark", "step", "second loop"]


def test_loops_of_nested_helpers_are_not_marked():
    steady = load_steady()
    events = []
    ns = {"events": events, steady.LOOP_MARK: lambda: events.append("mark")}
    steady.compile_workload(SOURCE, "w.py", "with_helper", ns)()
    assert events == ["build", "mark", 0, 1]


def test_workload_without_loop_is_refused(capsys):
    steady = load_steady()
    try:
        steady.compile_workload(SOURCE, "w.py", "no_loop", {})
    except SystemExit as e:
        assert "no loop" in str(e)
    else:
        raise AssertionError("a workload without a loop must be refused")


def test_conf_variants():
    steady = load_steady()
    assert steady.ccalloc_conf("ccalloc@page_slack:0.1,page_move_budget:0") == "page_slack:0.1,page_move_budget:0"
    assert steady.ccalloc_conf("ccalloc_budget0") == "page_move_budget:0"
    assert steady.ccalloc_conf("native") is None
    assert steady.known_allocator("ccalloc@x:1") and not steady.known_allocator("rmm")


def summarize_records(steady, tmp_path, capsys, records, row_prefix):
    """What summarize prints for these STEADY records, and the cells of the row starting so."""
    path = tmp_path / "steady.jsonl"
    path.write_text("".join("STEADY " + json.dumps(r) + "\n" for r in records))
    steady.summarize(str(path))
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith(row_prefix))
    return out, row, [c.strip() for c in row.split("|")]


def test_summary_never_mixes_clocks_and_pairs_records_without_rounds(tmp_path, capsys):
    steady = load_steady()
    records = []
    for i, (alloc, t) in enumerate((("native", 1.0), ("ccalloc", 1.05), ("native", 2.0), ("ccalloc", 2.02))):
        r = {"workload": "mlp_sidestream", "allocator": alloc, "seconds": [t],
             "max_memory_reserved": 1, "max_memory_allocated": 1}
        if i == 0:
            r["loop_seconds"] = [0.1]  # a newer record beside older ones
        records.append(r)
    out, row, cells = summarize_records(steady, tmp_path, capsys, records, "| mlp_sidestream | ccalloc |")
    # Whole-run clock for all four; the k-th process of each allocator pairs: 1.05 and 1.01.
    assert cells[4] == "2" and cells[5] == "1.050, 1.010", row
    assert "Whole-run clock for mlp_sidestream" in out


def test_summary_pairs_rounds_on_the_loop_clock(tmp_path, capsys):
    steady = load_steady()
    # Round 2 is 30% slower for both: the paired ratio cancels it, pooling does not.
    records = [
        {"workload": "bert_infer_varlen", "allocator": alloc, "round": rnd,
         "seconds": [t * slow + 0.5], "loop_seconds": [t * slow],
         "max_memory_reserved": 110, "max_memory_allocated": 100}
        for rnd, slow in ((1, 1.0), (2, 1.3))
        for alloc, t in (("native", 1.0), ("ccalloc", 1.01))
    ]
    out, row, cells = summarize_records(steady, tmp_path, capsys, records, "| bert_infer_varlen | ccalloc |")
    assert cells[3] == "1.010" and cells[4] == "2"
    assert "1.100 (1.100)" in out  # the memory ratio
    assert "within 2% of native on every workload (paired): YES" in out


def test_every_shared_workload_has_a_loop_to_time():
    import pytest

    path = os.path.join(HERE, "..", "..", "..", "shared", "bench", "workloads.py")
    if not os.path.exists(path):
        pytest.skip("../shared/bench/workloads.py is not beside the repository")
    steady = load_steady()
    with open(path) as f:
        source = f.read()
    for name in steady.WORKLOADS:
        ns = {}
        assert callable(steady.compile_workload(source, path, name, ns))


def test_a_loop_in_a_branch_not_taken_leaves_no_mark():
    # run() refuses such a run (its loop clock would have no start).
    steady = load_steady()
    events = []
    ns = {"events": events, steady.LOOP_MARK: lambda: events.append("mark")}
    steady.compile_workload(SOURCE, "w.py", "maybe_loop", ns)(0)
    assert events == ["no loop"]
    steady.compile_workload(SOURCE, "w.py", "maybe_loop", ns)(1)
    assert events == ["no loop", "mark", 0]
