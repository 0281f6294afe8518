//! Review of the memory C API on the sim: the history's frees, snapshots adding up to the
//! reserved bytes. One test: the runtime and the recorder are process-wide.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::*;
use ccalloc::capi::*;
use ccalloc::capi::{ccalloc_stats, cudaStream_t};
use std::ffi::c_void;

const MIB: usize = 1 << 20;
const FREE_REQUESTED: u32 = 1;
const FREE_COMPLETED: u32 = 2;
const ALLOC: u32 = 0;

fn stream(n: usize) -> cudaStream_t {
    n as cudaStream_t
}

fn malloc(size: usize, s: cudaStream_t) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    assert_eq!(ccalloc_malloc(size, 0, s, &mut p), CCALLOC_OK);
    p
}

struct Snap(*mut ccalloc_snapshot);

impl Snap {
    fn take() -> Self {
        Self::take_with(true)
    }

    fn take_with(include_trace: bool) -> Self {
        let mut s = std::ptr::null_mut();
        assert_eq!(ccalloc_snapshot_take(0, include_trace, &mut s), CCALLOC_OK);
        Snap(s)
    }

    fn counts(&self) -> (usize, usize) {
        let (mut segs, mut trace) = (0, 0);
        assert_eq!(
            unsafe { ccalloc_snapshot_counts(self.0, &mut segs, &mut trace) },
            CCALLOC_OK
        );
        (segs, trace)
    }

    fn trace(&self) -> Vec<ccalloc_trace_entry> {
        (0..self.counts().1)
            .map(|i| {
                let mut e = std::mem::MaybeUninit::<ccalloc_trace_entry>::zeroed();
                assert_eq!(
                    unsafe { ccalloc_snapshot_trace_entry(self.0, i, e.as_mut_ptr()) },
                    CCALLOC_OK
                );
                unsafe { e.assume_init() }
            })
            .collect()
    }

    fn segments(&self) -> Vec<(ccalloc_segment_info, Vec<ccalloc_block_info>)> {
        (0..self.counts().0)
            .map(|i| {
                let mut s = std::mem::MaybeUninit::<ccalloc_segment_info>::zeroed();
                assert_eq!(
                    unsafe { ccalloc_snapshot_segment(self.0, i, s.as_mut_ptr()) },
                    CCALLOC_OK
                );
                let s = unsafe { s.assume_init() };
                let blocks = (0..s.block_count)
                    .map(|j| {
                        let mut b = std::mem::MaybeUninit::<ccalloc_block_info>::zeroed();
                        assert_eq!(
                            unsafe { ccalloc_snapshot_block(self.0, i, j, b.as_mut_ptr()) },
                            CCALLOC_OK
                        );
                        unsafe { b.assume_init() }
                    })
                    .collect();
                (s, blocks)
            })
            .collect()
    }
}

impl Drop for Snap {
    fn drop(&mut self) {
        unsafe { ccalloc_snapshot_free(self.0) };
    }
}

/// The actions recorded for `addr`, oldest first.
fn actions_of(addr: *mut c_void) -> Vec<u32> {
    Snap::take()
        .trace()
        .iter()
        .filter(|e| e.addr == addr as u64 && e.action <= FREE_COMPLETED)
        .map(|e| e.action)
        .collect()
}

fn reserved() -> u64 {
    let mut s = std::mem::MaybeUninit::<ccalloc_stats>::zeroed();
    assert_eq!(ccalloc_get_stats(0, s.as_mut_ptr()), CCALLOC_OK);
    unsafe { s.assume_init() }.reserved_bytes.all.current as u64
}

/// Every segment's blocks tile it, and the segments add up to the reserved bytes.
fn check_snapshot_adds_up(when: &str) {
    let snap = Snap::take();
    let mut total = 0;
    for (seg, blocks) in snap.segments() {
        let mut at = seg.address;
        for b in &blocks {
            assert_eq!(b.address, at, "{when}: blocks of {seg:?} are contiguous");
            assert!(b.size > 0, "{when}");
            at += b.size;
        }
        assert_eq!(
            at,
            seg.address + seg.total_size,
            "{when}: blocks cover {seg:?}"
        );
        total += seg.total_size;
    }
    assert_eq!(
        total,
        reserved(),
        "{when}: segments add up to the reserved bytes"
    );
}

#[test]
fn history_and_snapshots_through_the_c_api() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    assert_eq!(ccalloc_record_history(true, 100_000, true), CCALLOC_OK);
    let (s1, s2) = (stream(0x10), stream(0x20));

    // record_stream on the block's own stream adds no other stream: its free completes at
    // once, and the history says so.
    let p = malloc(MIB, s1);
    assert_eq!(ccalloc_record_stream(p, 0, s1), CCALLOC_OK);
    assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
    assert_eq!(
        actions_of(p),
        [ALLOC, FREE_REQUESTED, FREE_COMPLETED],
        "a block recorded on its own stream only"
    );

    // A block used on a paused stream completes its free once that stream's work is done.
    assert_eq!(ccalloc_sim_pause_stream(0, s2, true), CCALLOC_OK);
    let q = malloc(3 * MIB, s1);
    assert_eq!(ccalloc_record_stream(q, 0, s2), CCALLOC_OK);
    assert_eq!(ccalloc_free(q, 0), CCALLOC_OK);
    assert_eq!(actions_of(q), [ALLOC, FREE_REQUESTED]);
    check_snapshot_adds_up("a block pending its free");
    assert_eq!(ccalloc_sim_pause_stream(0, s2, false), CCALLOC_OK);
    assert_eq!(ccalloc_empty_cache(0), CCALLOC_OK);
    assert_eq!(actions_of(q), [ALLOC, FREE_REQUESTED, FREE_COMPLETED]);

    // Snapshots add up however blocks are spread over segments.
    let mut live = Vec::new();
    for i in 1..40usize {
        live.push(malloc(
            i * 37 * 1024 + (i % 3) * MIB,
            if i % 2 == 0 { s1 } else { s2 },
        ));
        if i % 3 == 0 {
            let p = live.remove(i % live.len());
            assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
        }
        check_snapshot_adds_up(&format!("step {i}"));
    }
    for p in live {
        assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
    }
    check_snapshot_adds_up("all freed");
    assert_eq!(ccalloc_empty_cache(-1), CCALLOC_OK);
    check_snapshot_adds_up("emptied");

    // Without the trace, a snapshot (a pool check's) neither copies the history nor adds to it.
    let before = Snap::take().trace().len();
    let bare = Snap::take_with(false);
    assert_eq!(bare.counts().1, 0, "no trace asked for, none copied");
    assert_eq!(
        Snap::take().trace().len(),
        before + 1,
        "only the traced snapshot after it was recorded"
    );
    assert_eq!(ccalloc_record_history(false, 0, true), CCALLOC_OK);
}
