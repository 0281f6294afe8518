//! Damaged or hostile replay inputs: each gets a clear error or a correct report, never a
//! panic, an abort, or a silently shortened trace. (Each of these failed before its fix.)

use ccalloc::{replay, trace, ReplayOptions};
use std::io::{Read, Write};
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

/// Counts the bytes read through it.
struct Counted<R> {
    inner: R,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

/// Loads `input` with the default limits; returns the error and the bytes read.
fn load_counted(name: &str, input: impl std::io::Read) -> (ccalloc::Error, u64) {
    let read = std::rc::Rc::default();
    let input = Counted {
        inner: input,
        read: std::rc::Rc::clone(&read),
    };
    let err = trace::load_from(std::path::Path::new(name), input, &trace::Limits::default())
        .expect_err("refused");
    (err, read.get())
}

/// Runs `ccalloc ARGS` with its address space limited to 1 GiB (what the bad inputs below
/// once grew far past) and stdout to `stdout`.
fn ccalloc_limited(args: &[&std::ffi::OsStr], stdout: std::process::Stdio) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_ccalloc"));
    command.args(args).stdout(stdout);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.output().unwrap()
}

/// /dev/zero (and a 200 MB run of NUL bytes) is refused at its first line: reading stops
/// within 64 KiB, and the error quotes only the start of the line.
#[test]
fn endless_or_huge_input_is_refused_at_its_first_line() {
    let (err, read) = load_counted("zeros.csv", std::io::repeat(0).take(200 << 20));
    assert!(read <= 64 << 10, "read {read} bytes of zeros");
    assert!(
        err.message.contains("expected the header"),
        "{}",
        err.message
    );
    assert!(
        err.message.len() < 300,
        "{} bytes of message",
        err.message.len()
    );
    // A line past the header as well.
    let head = std::io::Cursor::new(b"action,addr,size,stream\nalloc,1,".to_vec());
    let (err, read) = load_counted("long.csv", head.chain(std::io::repeat(b'7').take(50 << 20)));
    assert!(read <= 64 << 10, "read {read} bytes of one line");
    assert!(
        err.message.contains("line 2: longer than 4096"),
        "{}",
        err.message
    );
    let out = ccalloc_limited(
        &["replay".as_ref(), "/dev/zero".as_ref()],
        std::process::Stdio::null(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {stderr}", out.status);
    assert!(
        stderr.len() < 300 && stderr.contains("expected the header"),
        "{stderr}"
    );
}

/// Gzip members of 1 MiB of zeros each (1 KiB compressed), `members` of them after `head`.
fn gzip_bomb(head: &[u8], members: usize) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    e.write_all(head).unwrap();
    let mut bomb = e.finish().unwrap();
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    e.write_all(&vec![0u8; 1 << 20]).unwrap();
    let member = e.finish().unwrap();
    for _ in 0..members {
        bomb.extend_from_slice(&member);
    }
    bomb
}

/// A gzip bomb decodes only as far as the loader reads: a CSV trace's first line, a pickle
/// up to its size bound (18 MB of gzip reached 24 GB).
#[test]
fn gzip_bombs_are_read_only_as_far_as_needed() {
    let bomb = gzip_bomb(b"", 1000); // 1000 MiB decoded, about 1 MB on disk
    let (err, read) = load_counted("bomb.csv.gz", &bomb[..]);
    assert!(
        err.message.contains("expected the header"),
        "{}",
        err.message
    );
    // The compressed bytes read bound the decoded ones (1 MiB per KiB here).
    assert!(
        read <= 64 << 10,
        "read {read} of {} compressed bytes",
        bomb.len()
    );
    let pickle = gzip_bomb(b"\x80\x02", 1000);
    let read = std::rc::Rc::default();
    let input = Counted {
        inner: &pickle[..],
        read: std::rc::Rc::clone(&read),
    };
    let limits = trace::Limits {
        max_pickle_bytes: 4 << 20,
        ..trace::Limits::default()
    };
    let err = trace::load_from(std::path::Path::new("bomb.pickle.gz"), input, &limits)
        .expect_err("refused");
    assert!(
        err.message.contains("larger than 4.00 MiB"),
        "{}",
        err.message
    );
    assert!(
        read.get() <= 64 << 10,
        "read {} compressed bytes",
        read.get()
    );
    let path = tmp("bomb.csv.gz");
    std::fs::write(&path, &bomb).unwrap();
    let out = ccalloc_limited(
        &["replay".as_ref(), path.as_os_str()],
        std::process::Stdio::null(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {stderr}", out.status);
    assert!(stderr.contains("expected the header"), "{stderr}");
}

/// A small pickle builder (protocol 2).
#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn new() -> Self {
        Pickle(b"\x80\x02".to_vec())
    }
    fn op(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }
    fn text(&mut self, s: &str) -> &mut Self {
        self.0.push(b'X');
        self.0.extend((s.len() as u32).to_le_bytes());
        self.op(s.as_bytes())
    }
    fn int(&mut self, v: i64) -> &mut Self {
        self.op(b"\x8a\x08").op(&v.to_le_bytes())
    }
    fn put(&mut self, id: u32) -> &mut Self {
        self.op(b"r").op(&id.to_le_bytes())
    }
    fn get(&mut self, id: u32) -> &mut Self {
        self.op(b"j").op(&id.to_le_bytes())
    }
    /// {"device_traces": [[entries…]]}, each entry a dict of action/addr/size/stream.
    fn snapshot(entries: &[(&str, i64, i64, i64)]) -> Vec<u8> {
        let mut p = Pickle::new();
        p.op(b"}").text("device_traces").op(b"]]");
        for &(action, addr, size, stream) in entries {
            p.op(b"}(").text("action").text(action);
            p.text("addr").int(addr).text("size").int(size);
            p.text("stream").int(stream).op(b"ua");
        }
        p.op(b"as.");
        p.0
    }
}

fn load_bytes(name: &str, body: &[u8]) -> ccalloc::Result<Vec<trace::Trace>> {
    let path = tmp(name);
    std::fs::write(&path, body).unwrap();
    trace::load(&path)
}

/// The pickle builder writes what the loader reads (the tests below rely on it).
#[test]
fn built_pickles_load() {
    let body = Pickle::snapshot(&[("alloc", -8, 512, -1), ("free_completed", -8, 512, -1)]);
    let t = load_bytes("built.pickle", &body).unwrap();
    assert_eq!(t[0].events.len(), 2);
    assert_eq!(
        (t[0].events[0].addr, t[0].events[0].stream),
        (u64::MAX - 7, u64::MAX)
    );
}

/// A negative size in a pickle is refused as in a CSV trace (it became 16 EiB).
#[test]
fn negative_size_in_a_pickle_is_a_bad_entry() {
    let body = Pickle::snapshot(&[("alloc", 4096, -1, 0)]);
    let err = load_bytes("negative.pickle", &body).unwrap_err();
    assert!(err.message.contains("-1 is not a size"), "{}", err.message);
}

/// A pickle that references one large list many times through its memo is refused before
/// it is decoded (decoding would expand a few MB into GBs), and so is one whose
/// lists each hold the previous one twice (2^40 elements from a few hundred bytes).
#[test]
fn memo_references_count_in_full() {
    let mut p = Pickle::new();
    p.op(b"}(")
        .text("device_traces")
        .op(b"]")
        .text("x")
        .op(b"](");
    for _ in 0..20_000 {
        p.op(b"K\x07");
    }
    p.op(b"e").put(0).op(b"0]("); // the list is memo 0
    for _ in 0..500 {
        p.get(0);
    }
    p.op(b"eu.");
    assert!(p.0.len() < 50_000);
    let err = load_bytes("memo.pickle", &p.0).unwrap_err();
    // The dict, its two keys, the empty list, the list of references, 500 × (list + 20000).
    assert!(
        err.message.contains("decodes to 10000505 elements"),
        "{}",
        err.message
    );
    let mut p = Pickle::new();
    p.op(b"]").put(0);
    for i in 0..40 {
        p.op(b"(").get(i).get(i).op(b"l").put(i + 1).op(b"0");
    }
    p.op(b"0}").text("device_traces").get(40).op(b"s.");
    let err = load_bytes("doubling.pickle", &p.0).unwrap_err();
    assert!(err.message.contains("elements"), "{}", err.message);
}

/// An integer of many digits (LONG) or bytes (LONG4) is refused before it is parsed (the
/// decoder parses digits in quadratic time: 61 s for 8 MB).
#[test]
fn long_integers_are_refused_before_parsing() {
    let mut long = b"\x80\x02L".to_vec();
    long.extend(std::iter::repeat_n(b'9', 100_000));
    long.extend(b"L\n.");
    let err = load_bytes("long.pickle", &long).unwrap_err();
    assert!(err.message.contains("100001 digits"), "{}", err.message);
    assert!(err.message.len() < 300, "{}", err.message);
    let mut long4 = b"\x80\x02\x8b".to_vec();
    long4.extend(100_000u32.to_le_bytes());
    long4.extend(std::iter::repeat_n(1u8, 100_000));
    long4.push(b'.');
    let err = load_bytes("long4.pickle", &long4).unwrap_err();
    assert!(
        err.message.contains("100000 digits or bytes"),
        "{}",
        err.message
    );
    // The longest integers a snapshot writes still load.
    let body = Pickle::snapshot(&[("alloc", i64::MIN, i64::MAX, 0)]);
    assert!(load_bytes("widest.pickle", &body).is_ok());
}

/// A failed write of the report (a full disk) is an error message and exit status 1, not a
/// panic with a backtrace.
#[test]
fn write_errors_are_reported_not_panicked() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/samples/mlp_sidestream.trace.csv.gz"
    );
    for json in [false, true] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let mut args = vec!["replay".as_ref(), trace.as_ref()];
        if json {
            args.push("--json".as_ref());
        }
        let out = ccalloc_limited(&args, full.into());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            !stderr.contains("panicked") && stderr.lines().count() == 1,
            "{stderr}"
        );
    }
}
