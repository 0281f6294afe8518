//! Damaged or hostile replay inputs: each gets a clear error or a correct report, never a
//! panic, an abort, or a silently shortened trace. (Each of these failed before its fix.)

use ccalloc::replay::{replay, trace, ReplayOptions};
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

const GIB: u64 = 1 << 30;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ccalloc-replay-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn gzip(text: &str) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(text.as_bytes()).unwrap();
    e.finish().unwrap()
}

/// A gzip file of two members (`cat a.gz b.gz`, pigz/bgzip output) is one valid stream to
/// gzip/zcat: every member is read.
#[test]
fn multi_member_gzip_is_read_whole() {
    let head = "action,addr,size,stream\nalloc,1,4096,0\n";
    let tail = "alloc,2,4096,0\nfree_completed,1,4096,0\nfree_completed,2,4096,0\n";
    let mut bytes = gzip(head);
    bytes.extend(gzip(tail));
    let path = tmp("multi.csv.gz");
    std::fs::write(&path, bytes).unwrap();
    let t = trace::load(&path).unwrap();
    assert_eq!(
        t[0].events.len(),
        4,
        "events after the first gzip member were dropped"
    );
}

/// A double free in the trace (alloc X, free X, free X) is an unmatched free, not a block
/// live when recording began (which would inflate peak live and reserved, and report a
/// false OOM under --capacity).
#[test]
fn double_free_is_not_a_block_live_at_start() {
    let g10 = 10 * GIB;
    let text = format!(
        "action,addr,size,stream\nalloc,100,{g10},0\nfree_completed,100,{g10},0\n\
         alloc,200,{g10},0\nfree_completed,200,{g10},0\nfree_completed,200,{g10},0\n"
    );
    let path = tmp("double_free.csv");
    std::fs::write(&path, text).unwrap();
    let t = trace::load(&path).unwrap();
    let r = replay(&t[0], &ReplayOptions::default(), |_, _| {}).unwrap();
    assert_eq!(
        r.peak_live_bytes, g10,
        "the trace never has more than 10 GiB live"
    );
    let small = ReplayOptions {
        capacity: 15 * GIB,
        ..ReplayOptions::default()
    };
    let r = replay(&t[0], &small, |_, _| {}).unwrap();
    assert!(r.oom.is_none(), "false OOM: {:?}", r.oom);
}

/// A block live when recording began that does not fit --capacity is the OOM point, not a
/// failed replay.
#[test]
fn block_live_at_start_past_capacity_is_an_oom_point() {
    let text = format!(
        "action,addr,size,stream\nfree_completed,300,{},0\n",
        10 * GIB
    );
    let path = tmp("live_at_start.csv");
    std::fs::write(&path, text).unwrap();
    let t = trace::load(&path).unwrap();
    let options = ReplayOptions {
        capacity: 5 * GIB,
        ..ReplayOptions::default()
    };
    let r = replay(&t[0], &options, |_, _| {});
    let oom = r.expect("reported, not failed").oom.expect("an OOM point");
    assert_eq!(oom.requested_bytes, 10 * GIB);
    assert!(
        oom.message.contains("live when recording began"),
        "{}",
        oom.message
    );
}

/// PyTorch's segment sizes are summed saturating: huge values neither panic (debug builds)
/// nor wrap.
#[test]
fn huge_segment_sizes_do_not_panic() {
    let text = "action,addr,size,stream\nsegment_alloc,1,6000000000000000000,0\n\
                segment_alloc,2,6000000000000000000,0\n";
    let path = tmp("segments.csv");
    std::fs::write(&path, text).unwrap();
    let t = trace::load(&path).unwrap();
    let r = replay(&t[0], &ReplayOptions::default(), |_, _| {}).unwrap();
    assert_eq!(
        r.pytorch_peak_reserved_bytes,
        Some(12_000_000_000_000_000_000)
    );
}

/// A negative size is a bad row (addresses and streams may be written signed; sizes may
/// not), and so is an action PyTorch does not write (a damaged trace is not skipped quietly).
#[test]
fn negative_sizes_and_unknown_actions_are_bad_rows() {
    let path = tmp("negative.csv");
    std::fs::write(&path, "action,addr,size,stream\nalloc,1,-1,0\n").unwrap();
    let err = trace::load(&path).unwrap_err();
    assert!(err.message.contains("not a size"), "{}", err.message);
    std::fs::write(&path, "action,addr,size,stream\nalloc,-8,512,-1\n").unwrap();
    assert_eq!(trace::load(&path).unwrap()[0].events[0].addr, u64::MAX - 7);
    std::fs::write(&path, "action,addr,size,stream\naloc,1,512,0\n").unwrap();
    let err = trace::load(&path).unwrap_err();
    assert!(
        err.message.contains("unknown action \"aloc\""),
        "{}",
        err.message
    );
    std::fs::write(
        &path,
        "action,addr,size,stream\nsnapshot,0,0,0\noom,0,0,0\n",
    )
    .unwrap();
    assert!(trace::load(&path).unwrap()[0].events.is_empty());
}

/// A 100 KB pickle of nested lists is refused with a clear error (it overflowed the stack in
/// the decoder: SIGABRT).
#[test]
fn deeply_nested_pickle_is_an_error_not_a_crash() {
    let n = 50_000;
    let mut body = b"\x80\x02".to_vec();
    body.extend(std::iter::repeat_n(b']', n));
    body.extend(std::iter::repeat_n(b'a', n - 1));
    body.push(b'.');
    let path = tmp("nested.pickle");
    std::fs::write(&path, body).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ccalloc"))
        .arg("replay")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "status {:?}, stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
