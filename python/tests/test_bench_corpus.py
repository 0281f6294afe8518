"""The corpus bench's planning and table (benches/gpu/corpus): no GPU and no torch needed."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "benches", "gpu", "corpus")
GIB = 1 << 30


def run(*args, env=None):
    full = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    return subprocess.run(list(args), capture_output=True, text=True, env=full, check=False)


def record(workload, allocator, rnd, seconds, reserved, session="s", error=None):
    r = {"workload": workload, "allocator": allocator, "round": rnd, "session": session, "reps": 2,
         "loop_seconds": [seconds, seconds], "requested_bytes.all.peak": 10 * GIB,
         "reserved_bytes.all.peak": int(reserved * 10 * GIB), "allocated_bytes.all.peak": 10 * GIB}
    if error:
        r.update(loop_seconds=[], error=error)
        for k in ("requested_bytes.all.peak", "reserved_bytes.all.peak", "allocated_bytes.all.peak"):
            del r[k]
    return r


def test_list_reads_the_registry_without_torch():
    out = run(sys.executable, os.path.join(CORPUS, "run.py"), "--list")
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    corpus = [r for r in rows if r[1] == "corpus"]
    assert len(corpus) >= 12
    assert {r[0] for r in rows if r[1] == "shared"} == {
        "gpt2_train_varlen", "resnet50_train", "bert_infer_varlen", "mlp_sidestream"}
    assert all(float(r[2]) > 0 for r in rows)


def test_rounds_rotate_the_allocators():
    out = run("bash", os.path.join(CORPUS, "corpus.sh"), "dry-run",
              env={"WORKLOADS": "moe_train", "ROUNDS": "4", "OUT": "/nonexistent-corpus-out"})
    assert out.returncode == 0, out.stderr
    orders = [line.split(": ", 1)[1] for line in out.stdout.splitlines() if line.startswith("round ")]
    assert orders == ["native expandable ccalloc", "expandable ccalloc native",
                      "ccalloc native expandable", "native expandable ccalloc"]
    assert sum(1 for line in out.stdout.splitlines() if "run.py moe_train" in line) == 12


def test_unknown_workload_is_refused():
    out = run("bash", os.path.join(CORPUS, "corpus.sh"), "dry-run", env={"WORKLOADS": "no_such_workload"})
    assert out.returncode == 2
    assert "no_such_workload" in out.stderr


def test_table_pairs_rounds_and_keeps_failed_runs(tmp_path):
    # Round 1 ran slow for every allocator, round 2 fast: paired ratios cancel that drift.
    a = [record("moe_train", "native", 1, 2.0, 1.40), record("moe_train", "ccalloc", 1, 2.2, 1.02),
         record("moe_train", "expandable", 1, 2.0, 1.08),
         record("moe_train", "native", 2, 1.0, 1.40), record("moe_train", "ccalloc", 2, 0.9, 1.01),
         record("moe_train", "expandable", 2, 1.0, 1.07)]
    # A second call (another session) with the same round numbers, and one OOM.
    b = [record("cuda_graph_infer", "native", 1, 1.0, 1.2, session="t"),
         record("cuda_graph_infer", "ccalloc", 1, 1.0, 1.05, session="t"),
         record("cuda_graph_infer", "expandable", 1, 0, 0, session="t", error="OOM: CUDA out of memory")]
    fa, fb = tmp_path / "corpus-a.jsonl", tmp_path / "corpus-b.jsonl"
    fa.write_text("\n".join(json.dumps(r) for r in a) + "\n")
    fb.write_text("\n".join("CORPUS " + json.dumps(r) for r in b) + "\n")
    out = run(sys.executable, os.path.join(CORPUS, "table.py"), str(fa), str(fb))
    assert out.returncode == 0, out.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in out.stdout.splitlines() if line.startswith("| ")}
    moe = rows["moe_train"].split(" | ")
    # ratios 1.1 and 0.9: median 1.000, spread 0.900-1.100; memory is the worst run's
    assert moe[2:5] == ["1.400", "1.080", "1.020"]
    assert moe[5] == "1.000 [0.900–1.100]"
    assert "ok" in moe[-1]
    graph = rows["cuda_graph_infer"].split(" | ")
    assert graph[3] == "ERR"
    assert "mem>1.03" in graph[-1]
    assert "cuda_graph_infer / expandable / round 1: OOM" in out.stdout
    assert "met on 1 of 2 workloads" in out.stdout


def growth_cell(tmp_path, rows, workload):
    """The table's "ccalloc growth in loops" cell for `workload` (None: no such column)."""
    f = tmp_path / "corpus.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = run(sys.executable, os.path.join(CORPUS, "table.py"), str(f))
    assert out.returncode == 0, out.stderr
    head = next(x for x in out.stdout.splitlines() if x.startswith("| workload"))
    line = next(x for x in out.stdout.splitlines() if x.startswith(f"| {workload}"))
    return dict(zip(head.split(" | "), line.split(" | "))).get("ccalloc growth in loops")


def test_growth_within_the_loops_is_a_share_of_their_time(tmp_path):
    # Two ccalloc runs of 2 s of loops: 20 ms and 60 ms growing in them (1% and 3%, median
    # 2%); the longer one's counts are shown. Without loop_paging there is no such column.
    rows = [record("moe_train", "native", 1, 1.0, 1.4), record("moe_train", "native", 2, 1.0, 1.4)]
    for rnd, ns, growths in ((1, 20_000_000, 3), (2, 60_000_000, 9)):
        r = record("moe_train", "ccalloc", rnd, 1.0, 1.02)
        r["loop_paging"] = {"growths": growths, "moving_growths": growths - 1, "growths_past_slack": 0,
                            "growth_ns": ns, "moving_ns": ns // 2, "wait_ns": ns // 4}
        rows.append(r)
    assert growth_cell(tmp_path, rows, "moe_train") == "2.0% (0.5% waits; 9 growths, 8 moved)"
    for r in rows:
        r.pop("loop_paging", None)
    assert growth_cell(tmp_path, rows, "moe_train") is None


def test_growth_cell_names_the_shards_and_their_contention(tmp_path):
    # Two runs with 5 shards: 50 of 100,000 and 150 of 100,000 acquisitions contended
    # (median 0.10%). A run of one shard adds nothing.
    rows = [record("bert_serve_threads", "native", 1, 1.0, 1.5)]
    for rnd, contended in ((1, 50), (2, 150)):
        r = record("bert_serve_threads", "ccalloc", rnd, 1.0, 1.16)
        r["loop_paging"] = {"growths": 4, "moving_growths": 3, "growths_past_slack": 0,
                            "growth_ns": 20_000_000, "moving_ns": 0, "wait_ns": 0}
        r["shards"] = 5
        r["locks"] = {"acquisitions": 100_000, "contended": contended, "blocked": 0, "wait_ns": 0, "handoffs": 0}
        rows.append(r)
    assert growth_cell(tmp_path, rows, "bert_serve_threads") == \
        "1.0% (0.0% waits; 4 growths, 3 moved); 5 shards, 0.10% of locks contended"
    for r in rows[1:]:
        r["shards"] = 1
    assert growth_cell(tmp_path, rows, "bert_serve_threads") == "1.0% (0.0% waits; 4 growths, 3 moved)"


def test_sharded_ccalloc_is_measured_against_the_others_requested_peak(tmp_path):
    # With per_stream_shards its own requested peak is the sum of the shards' peaks (here
    # 1.5x the true one): dividing by it would make 10.3 GiB reserved read as 0.69.
    sharded = record("multistream_pipeline", "ccalloc@per_stream_shards:True", 1, 1.0, 1.03)
    sharded["requested_bytes.all.peak"] = 15 * GIB
    rows = [record("multistream_pipeline", "native", 1, 1.0, 1.5), sharded]
    f = tmp_path / "corpus.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = run(sys.executable, os.path.join(CORPUS, "table.py"), str(f))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("| multistream_pipeline"))
    assert line.split(" | ")[2:4] == ["1.500", "1.030"], line
    assert "sum of its shards' peaks" in out.stdout


def test_plan_splits_over_calls():
    names = ["gpt2_train_varlen", "moe_train", "resnet50_train", "bert_infer_varlen"]
    out = run(sys.executable, os.path.join(CORPUS, "table.py"), "plan", "300", "3", "2",
              "native expandable ccalloc", *names)
    assert out.returncode == 0, out.stderr
    calls = [line.split('"')[1].split() for line in out.stdout.splitlines() if "WORKLOADS=" in line]
    assert sorted(w for c in calls for w in c) == sorted(names)
    seconds = [float(line.split("~")[1].split()[0]) for line in out.stdout.splitlines() if "WORKLOADS=" in line]
    assert all(s <= 300 for s in seconds) and len(calls) >= 2


def test_ab_table_pairs_the_builds_round_by_round(tmp_path):
    def run_of(lib, rnd, seconds, reserved, loop=None, **paging):
        r = record("moe_train", "ccalloc", rnd, seconds, reserved)
        r.update(lib=lib, paging=dict(paging))
        if loop:
            r["loop_paging"] = {"growth_ns": loop[0] * 1e6, "wait_ns": loop[1] * 1e6}
        return r

    records = [
        run_of("base", 1, 1.0, 1.04, (100, 60), growths_past_slack=7, chunks_mapped=800),
        run_of("trial", 1, 1.1, 1.02, (40, 0), growths_past_slack=0, chunks_mapped=400),
        run_of("trial", 2, 0.9, 1.03, (50, 2), growths_past_slack=0, chunks_mapped=420),
        run_of("base", 2, 1.0, 1.05, growths_past_slack=5, chunks_mapped=820),
        record("moe_train", "ccalloc", 3, 1.0, 1.0, error="no record (crash or timeout)"),
    ]
    records[-1]["lib"] = "trial"
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = run(sys.executable, os.path.join(CORPUS, "ab_table.py"), "base", "trial", str(path))
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| moe_train"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "1.040, 1.050"
    assert cells[2] == "1.020, 1.030, ERR"
    # Per round: 1.1 / 1.0 and 0.9 / 1.0; the failed third round has no pair.
    assert cells[3] == "1.000 [0.900–1.100]"
    assert cells[4] == "6 / 0"
    assert cells[5] == "810 / 410"
    # Medians of the runs that recorded their loops' growth (base's second did not).
    assert cells[6] == "100 (60) / 45 (1)"
    assert "error: moe_train trial round 3: no record (crash or timeout)" in out.stdout


def test_ab_script_keeps_every_run_even_without_a_readable_record(tmp_path):
    # ab.sh in a copy of the tree whose run.py is a stub: build A's runs print a record,
    # build B's a cut-off one in round 1 and nothing (a crash) in round 2.
    corpus = tmp_path / "benches" / "gpu" / "corpus"
    corpus.mkdir(parents=True)
    for name in ("ab.sh", "ab_table.py"):
        (corpus / name).write_text(open(os.path.join(CORPUS, name)).read())
    (tmp_path / "benches" / "gpu" / "find_bench.sh").write_text(
        open(os.path.join(CORPUS, "..", "find_bench.sh")).read())
    (tmp_path / "python").mkdir()
    (corpus / "run.py").write_text(
        "import json, os, sys\n"
        "lib = os.path.basename(os.path.dirname(os.environ['CCALLOC_LIBRARY']))\n"
        "rnd = os.environ['CORPUS_ROUND']\n"
        "if lib == 'a':\n"
        "    print('CORPUS ' + json.dumps({'workload': sys.argv[1], 'allocator': 'ccalloc',\n"
        "        'loop_seconds': [1.0], 'requested_bytes.all.peak': 100,\n"
        "        'reserved_bytes.all.peak': 103}))\n"
        "elif rnd == '1':\n"
        "    print('CORPUS {\"workload\": \"cut')\n"
        "else:\n"
        "    print('Segmentation fault', file=sys.stderr); sys.exit(139)\n")
    for lib in ("a", "b"):
        (tmp_path / lib).mkdir()
        (tmp_path / lib / "libccalloc.so").write_text("")
    env = {"A": str(tmp_path / "a"), "B": str(tmp_path / "b"), "ROUNDS": "2", "PIN_CPUS": "",
           "WORKLOADS": "moe_train", "OUT": str(tmp_path / "out"), "CCALLOC_BENCH": str(tmp_path)}
    out = run("bash", str(corpus / "ab.sh"), env=env)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "ab.jsonl").read_text().splitlines()]
    assert [(r["lib"].split("/")[-1], r["round"]) for r in records] == [
        ("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert records[1]["error"].startswith("unreadable record")
    assert records[2]["error"] == "no record (rc=139): Segmentation fault"
    assert "| moe_train | 1.030, 1.030 | ERR, ERR |" in out.stdout
