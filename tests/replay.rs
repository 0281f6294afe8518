//! The replay tool's inputs: PyTorch snapshot pickles (several pickle protocols) and the CSV
//! traces, replayed through ccalloc on the simulated device.

use ccalloc::{replay, trace, ReplayOptions};
use std::path::Path;

const MIB: u64 = 1 << 20;

fn data(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn pytorch_snapshot_pickles_replay() {
    for protocol in [2, 4, 5] {
        let traces = trace::load(&data(&format!("snapshot_p{protocol}.pickle"))).unwrap();
        // Device 1's trace is empty, so only device 0 is replayed (named after its device).
        assert_eq!(traces.len(), 1, "protocol {protocol}");
        let t = &traces[0];
        assert_eq!(t.name, format!("snapshot_p{protocol}:cuda0"));
        assert_eq!(t.events.len(), 14, "the 'snapshot' action is skipped");
        let r = replay(t, &ReplayOptions::default(), |_, _| {}).unwrap();
        // The block from before recording (3 MiB) is freed first; then 5 + 4 MiB + 1000 B.
        assert_eq!(r.peak_live_bytes, 9 * MIB + 1000);
        assert_eq!(r.allocs, 4);
        assert_eq!(r.events, 9, "4 allocs, 4 frees, and the early block's free");
        assert_eq!(r.unmatched_frees, 0);
        assert_eq!(r.pytorch_peak_reserved_bytes, Some(22 * MIB));
        assert!(r.peak_reserved_bytes >= r.peak_live_bytes);
        assert!(r.oom.is_none());
    }
}

#[test]
fn csv_sample_replays_within_its_targets() {
    let traces = trace::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/mlp_sidestream.trace.csv.gz"),
    )
    .unwrap();
    let r = replay(&traces[0], &ReplayOptions::default(), |_, _| {}).unwrap();
    assert_eq!(r.allocs, 4719);
    assert!(r.ratio <= 1.05, "peak reserved / peak live = {}", r.ratio);
    // The driver-time estimate prices each counted call at the H100's cost.
    let expected_us = r.maps as f64 * 47.0
        + r.unmaps as f64 * 25.0
        + (r.physical_creates + r.physical_releases) as f64 * 23.0
        + (r.device_allocs + r.device_frees) as f64 * 32.0;
    assert!(r.maps > 0 && (r.est_driver_ms - expected_us / 1000.0).abs() < 1e-9);
    let plain = ReplayOptions {
        conf: "expandable_segments:False".into(),
        ..ReplayOptions::default()
    };
    let p = replay(&traces[0], &plain, |_, _| {}).unwrap();
    // Plain segments behave like PyTorch's native allocator on the same trace.
    let torch = p.pytorch_ratio.unwrap();
    assert!(
        (p.ratio - torch).abs() < 0.01,
        "plain {} vs PyTorch {}",
        p.ratio,
        torch
    );
}

/// `--breakdown` accounts for every reserved byte at the peak: live, free chunks, pinned
/// pages, page rounding, parked chunks and plain segments add up to it, paged or not.
#[test]
fn the_peak_breakdown_accounts_for_every_reserved_byte() {
    let traces = trace::load(&sample()).unwrap();
    for conf in ["", "expandable_segments:False", "page_slack:0"] {
        let options = ReplayOptions {
            conf: conf.into(),
            breakdown: true,
            ..ReplayOptions::default()
        };
        let r = replay(&traces[0], &options, |_, _| {}).unwrap();
        let b = r.at_peak.expect("a breakdown was asked for");
        assert_eq!(b.reserved_bytes, r.peak_reserved_bytes, "{conf:?}");
        assert_eq!(b.accounted_bytes(), b.reserved_bytes, "{conf:?}: {b:?}");
        let paged = conf != "expandable_segments:False";
        assert_eq!(b.plain_bytes == 0, paged, "{conf:?}: {b:?}");
    }
    let without = replay(&traces[0], &ReplayOptions::default(), |_, _| {}).unwrap();
    assert!(without.at_peak.is_none());
}

#[test]
fn capacity_reports_where_a_trace_runs_out() {
    let traces = trace::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/mlp_sidestream.trace.csv.gz"),
    )
    .unwrap();
    let small = ReplayOptions {
        capacity: 1 << 30,
        ..ReplayOptions::default()
    };
    let r = replay(&traces[0], &small, |_, _| {}).unwrap();
    let oom = r.oom.expect("2 GiB of live data cannot fit in 1 GiB");
    assert!(oom.live_bytes + oom.requested_bytes > 1 << 30);
    assert!(oom.message.contains("out of memory"), "{}", oom.message);
}

#[test]
fn bad_inputs_are_reported_not_panicked() {
    let dir = std::env::temp_dir().join(format!("ccalloc-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, body) in [
        ("wrong_header.csv", &b"a,b,c\n1,2,3\n"[..]),
        (
            "bad_number.csv",
            &b"action,addr,size,stream\nalloc,12,lots,0\n"[..],
        ),
        ("not_a_snapshot.pickle", &b"\x80\x04K\x07."[..]),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        let err = trace::load(&path).unwrap_err();
        assert!(err.message.contains(name), "{}", err.message);
    }
    assert!(trace::load(&dir.join("missing.csv")).is_err());
}

/// Absurd sizes and streams in a trace: the replay reports the allocation that does not fit
/// and exits 3, and the expandable-segments model drops it as PyTorch would fail it.
#[test]
fn absurd_sizes_are_reported_not_panicked() {
    let dir = std::env::temp_dir().join(format!("ccalloc-absurd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("absurd.csv");
    std::fs::write(
        &path,
        "action,addr,size,stream\nalloc,4096,1000,18446744073709551615\n\
         alloc,8192,18446744073709551615,0\nalloc,12288,18446744073709551000,0\n",
    )
    .unwrap();
    let t = &trace::load(&path).unwrap()[0];
    assert_eq!(ccalloc::expandable_peak_reserved(t, 1 << 40, 3), 2 * MIB);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ccalloc"))
        .arg("replay")
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    assert!(stdout.contains("OUT OF MEMORY at event 1"), "{stdout}");
}

fn sample() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/mlp_sidestream.trace.csv.gz")
}

/// A replay that runs out of --capacity exits non-zero (3), after printing its report.
#[test]
fn running_out_of_capacity_exits_non_zero_with_the_report() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ccalloc"))
        .args(["replay", "--capacity", "1GiB"])
        .arg(sample())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    assert!(stdout.contains("mlp_sidestream"), "{stdout}");
    assert!(stdout.contains("OUT OF MEMORY at event"), "{stdout}");
}

/// The table fits in 100 columns and keeps the figures that matter.
#[test]
fn the_table_fits_100_columns() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ccalloc"))
        .args(["replay", "--conf", "expandable_segments:False"])
        .arg(sample())
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    for line in stdout.lines() {
        assert!(line.chars().count() <= 100, "{} wide: {line}", line.len());
    }
    let head: Vec<&str> = stdout.lines().next().unwrap().split_whitespace().collect();
    for column in [
        "events",
        "live",
        "rsv",
        "ratio",
        "native",
        "expand.",
        "maps/unmaps",
        "ms*",
    ] {
        assert!(head.contains(&column), "{column} missing from {head:?}");
    }
    let row: Vec<&str> = stdout.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(row[..2], ["mlp_sidestream", "9425"]);
    // Plain segments reproduce native PyTorch; expandable segments (modelled) reserve less.
    let (ours, native, expandable) = (row[6], row[7], row[8]);
    assert_eq!((native, expandable), ("1.144", "1.115"), "{row:?}");
    assert!(
        (ours.parse::<f64>().unwrap() - 1.144).abs() < 0.01,
        "{row:?}"
    );
    assert!(
        stdout.contains("segments allocated/freed: 50/0"),
        "{stdout}"
    );
}

/// The timeline's x axis has ticks labelled with event indices; its y axis stays labelled.
#[test]
fn the_timeline_has_labelled_axes() {
    let traces = trace::load(&sample()).unwrap();
    let r = replay(&traces[0], &ReplayOptions::default(), |_, _| {}).unwrap();
    let svg = ccalloc::plot::svg(&[r]);
    let ticks: Vec<&str> = svg
        .split(r#"<g class="xtick">"#)
        .skip(1)
        .map(|t| {
            let label = &t[t.find("middle\">").unwrap() + 8..];
            &label[..label.find('<').unwrap()]
        })
        .collect();
    // The trace's 14190 events (the timeline indexes every event read): ticks every 2000.
    assert_eq!(
        ticks,
        ["0", "2000", "4000", "6000", "8000", "10000", "12000", "14000"]
    );
    assert!(svg.contains("trace event (index)"));
    assert_eq!(svg.matches(" GiB</text>").count(), 5, "y-axis labels");
}

/// A scratch directory of this test process.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ccalloc-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// `ccalloc ARGS…` with its address space limited to 512 MiB: a replay that held memory in
/// proportion to what its input decodes to, not to its size, fails to allocate.
fn ccalloc_in_512mib(args: &[&std::ffi::OsStr]) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ccalloc"));
    command.args(args);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 512 << 20,
                rlim_max: 512 << 20,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.output().unwrap()
}

/// A CSV trace of `lines` identical allocations, gzip'd (they compress to almost nothing).
fn csv_of(lines: usize) -> Vec<u8> {
    let mut text = b"action,addr,size,stream\n".to_vec();
    for _ in 0..lines {
        text.extend(b"alloc,1,512,0\n");
    }
    gzip(&text)
}

/// A file of more events than `--max-events` is refused (exit 1) naming the limit and the
/// option; as many as it allows replay; a limit of 0 is a bad option (exit 2).
#[test]
fn a_csv_of_more_events_than_max_events_is_refused() {
    let many = scratch("many_events.csv.gz");
    std::fs::write(&many, csv_of(200_000)).unwrap();
    let out = ccalloc_in_512mib(&[
        "replay".as_ref(),
        "--max-events".as_ref(),
        "1000".as_ref(),
        many.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    // The header is line 1: the 1001st event is on line 1002, where reading stops.
    assert!(
        stderr.contains("line 1002: more than 1000 events, the most read from one file"),
        "{stderr}"
    );
    assert!(stderr.contains("--max-events N"), "{stderr}");

    let enough = scratch("enough_events.csv.gz");
    std::fs::write(&enough, csv_of(1000)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ccalloc"))
        .args(["replay", "--max-events", "1000"])
        .arg(&enough)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("enough_events"), "{stdout}");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ccalloc"))
        .args(["replay", "--max-events", "0"])
        .arg(&enough)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a bad option");
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_ccalloc"))
        .args(["replay", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--max-events <N>"), "{help}");
}

/// A PyTorch snapshot whose devices' traces reference one memoized entry
/// `references[device]` times (BINGET and APPEND, 3 bytes each): each reference decodes to
/// an entry of its own.
fn memo_bomb(references: &[usize]) -> Vec<u8> {
    let text = |s: &str| {
        let mut b = vec![b'X'];
        b.extend((s.len() as u32).to_le_bytes());
        b.extend(s.as_bytes());
        b
    };
    // PROTO 2, the snapshot dict, MARK, "device_traces", its list.
    let mut p = b"\x80\x02}(".to_vec();
    p.extend(text("device_traces"));
    p.push(b']');
    // {'action': 'alloc', 'addr': 1, 'size': 512, 'stream': 0}, memo 1, popped.
    p.extend(b"}(");
    p.extend(text("action"));
    p.extend(text("alloc"));
    p.extend(text("addr"));
    p.extend(b"K\x01");
    p.extend(text("size"));
    p.extend(b"M\x00\x02");
    p.extend(text("stream"));
    p.extend(b"K\x00");
    p.extend(b"uq\x010");
    for &n in references {
        p.push(b']');
        for _ in 0..n {
            p.extend(b"h\x01a");
        }
        p.push(b'a');
    }
    p.extend(b"u.");
    p
}

/// One memoized entry referenced far more times than `--max-events` (4 M references, 12 MB
/// of pickle, 12 KB gzip'd) is refused before it is decoded, within 512 MiB of address
/// space, where decoding it failed to allocate before the limit (about 140 bytes a
/// reference). Entries and each device's list are counted over every device, memo
/// references in full; as many as the limit allows replay.
#[test]
fn a_memoized_entry_referenced_past_max_events_is_refused_before_decoding() {
    let bomb = scratch("memo_bomb.pickle.gz");
    std::fs::write(&bomb, gzip(&memo_bomb(&[4_000_000]))).unwrap();
    let out = ccalloc_in_512mib(&[
        "replay".as_ref(),
        "--max-events".as_ref(),
        "1000".as_ref(),
        bomb.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("device_traces hold 4000001 lists and entries, memo references counted in full: more than 1000 events"),
        "{stderr}"
    );
    assert!(stderr.contains("--max-events N"), "{stderr}");
    std::fs::remove_file(&bomb).unwrap();

    let split = scratch("memo_split.pickle.gz");
    std::fs::write(&split, gzip(&memo_bomb(&[400, 400, 400]))).unwrap();
    let out = ccalloc_in_512mib(&[
        "replay".as_ref(),
        "--max-events".as_ref(),
        "1000".as_ref(),
        split.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("device_traces hold 1203 lists and entries"),
        "{stderr}"
    );

    let fits = scratch("memo_fits.pickle.gz");
    std::fs::write(&fits, gzip(&memo_bomb(&[499, 499]))).unwrap();
    let out = ccalloc_in_512mib(&[
        "replay".as_ref(),
        "--max-events".as_ref(),
        "1000".as_ref(),
        fits.as_os_str(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("memo_fits:cuda1"), "{stdout}");
}
