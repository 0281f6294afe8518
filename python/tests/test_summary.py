"""memory_summary(): torch.cuda.memory_summary's layout and number formatting."""

import pytest

import ccalloc
from ccalloc import _format_count, _format_size
from conftest import GiB, MiB

ROW_TITLES = [
    "Allocated memory",
    "Active memory",
    "Requested memory",
    "GPU reserved memory",
    "Non-releasable memory",
    "Allocations",
    "Active allocs",
    "GPU reserved segments",
    "Non-releasable allocs",
]


def rows(summary):
    """{row label: [cells]} for the table rows (label | 4 cells)."""
    table = {}
    current = None
    for line in summary.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) != 5 or parts[0] == "Metric":
            continue
        label = parts[0]
        if label.startswith("from "):
            label = f"{current} / {label}"
        else:
            current = label
        table[label] = parts[1:]
    return table


def test_layout(fresh_stats):
    summary = ccalloc.memory_summary()
    lines = summary.split("\n")
    assert lines[-1] == ""  # ends with a newline
    lines = lines[:-1]
    assert all(len(line) == 77 and line[0] == "|" and line[-1] == "|" for line in lines)
    assert lines[0] == "|" + "=" * 75 + "|"
    assert lines[1] == "|                  ccalloc CUDA memory summary, device ID 0                 |"
    assert lines[2] == "|" + "-" * 75 + "|"
    assert lines[3] == "|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |"
    assert lines[5] == "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"
    assert lines[-1] == "|" + "=" * 75 + "|"
    # 6 header lines, 9 stats x (rule + 3 rows), 2 x (rule + row), closing rule.
    assert len(lines) == 6 + 9 * 4 + 2 * 2 + 1
    titles = [label for label in rows(summary) if " / " not in label]
    assert titles == ROW_TITLES + ["Oversize allocations", "Oversize GPU segments"]
    assert summary.count("from large pool") == 9
    assert summary.count("from small pool") == 9


def test_abbreviated():
    summary = ccalloc.memory_summary(abbreviated=True)
    assert "from large pool" not in summary and "from small pool" not in summary
    assert len(summary.splitlines()) == 6 + 9 * 2 + 2 * 2 + 1
    for title in ROW_TITLES:
        assert f"| {title:<21} |" in summary


def test_values(alloc, fresh_stats):
    alloc(3 * MiB, device=1)
    alloc(1000, device=1)
    summary = ccalloc.memory_summary("cuda:1")
    assert "ccalloc CUDA memory summary, device ID 1 " in summary
    table = rows(summary)
    # 3 MiB + 1024 B: shown in KiB (all-pools value >= 768 KiB), small pool in the same unit.
    assert table["Allocated memory"] == ["3073 KiB", "3073 KiB", "3073 KiB", "0 B"]
    assert table["Allocated memory / from large pool"] == ["3072 KiB", "3072 KiB", "3072 KiB", "0 B"]
    assert table["Allocated memory / from small pool"] == ["1 KiB", "1 KiB", "1 KiB", "0 B"]
    assert table["Requested memory / from small pool"][0] == "0 KiB"  # 1000 B floors to 0 KiB
    assert table["Allocations"] == ["2", "2", "2", "0"]
    assert table["Oversize allocations"] == ["0", "0", "0", "0"]
    # Reserved memory and segments depend on the segment policy: check them against the stats.
    stats = ccalloc.memory_stats(1)
    reserved = stats["reserved_bytes.all.current"]
    assert table["GPU reserved memory"][0] == _format_size(reserved, reserved).strip()
    segments = stats["segment.all.current"]
    assert table["GPU reserved segments"][0] == _format_count(segments, segments).strip()


def test_oom_count_shown(alloc, fresh_stats):
    with pytest.raises(ccalloc.OutOfMemoryError):
        alloc(5 * GiB)
    summary = ccalloc.memory_summary()
    assert "|            CUDA OOMs: 1            |" in summary


@pytest.mark.parametrize(
    "size, reference, text",
    [
        (0, 0, "     0 B  "),
        (1023, 1023, "  1023 B  "),
        (786431, 786431, "786431 B  "),
        (786432, 786432, "   768 KiB"),
        (3 * MiB, 3 * MiB, "  3072 KiB"),
        (768 * MiB, 768 * MiB, "   768 MiB"),
        (GiB, GiB, "  1024 MiB"),
        (80 * GiB, 80 * GiB, " 81920 MiB"),
        (768 * GiB, 768 * GiB, "   768 GiB"),
        (1 << 50, 1 << 50, "  1024 TiB"),
        (768 << 50, 768 << 50, "   768 PiB"),
        (1 << 62, 1 << 62, "  4096 PiB"),
        (512, GiB, "     0 MiB"),  # the unit follows the reference (the "all" value)
    ],
)
def test_format_size(size, reference, text):
    assert _format_size(size, reference) == text


@pytest.mark.parametrize(
    "count, reference, text",
    [
        (0, 0, "      0   "),
        (749999, 749999, " 749999   "),
        (750000, 750000, "    750 K "),
        (750 * 10**6, 750 * 10**6, "    750 M "),
        (10**12, 10**12, "1000000 M "),
        (5, 10**6, "      0 K "),
    ],
)
def test_format_count(count, reference, text):
    assert _format_count(count, reference) == text
