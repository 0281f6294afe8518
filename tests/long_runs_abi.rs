//! Long runs at the C boundary, driven the way PyTorch drives it: `ccalloc_torch_alloc` /
//! `ccalloc_torch_free` with PyTorch's stream and device arguments, `Tensor.record_stream`,
//! the graph-pool hooks, `empty_cache`, memory fractions, statistics, snapshots, the
//! per-thread last error, and threads that come and go. Each test keeps a model of what the
//! caller holds, checks the statistics against it, and watches the process heap through a
//! counting global allocator once in steady state. Every test runs alone (`serial`): the
//! runtime, the history and the heap are the process's.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::*;
use ccalloc::capi::*;
use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

mod common;

use common::heap::{serial, HeapGrowth};
use common::worker::Worker;

#[global_allocator]
static GLOBAL: common::heap::Counting = common::heap::Counting;

const MIB: u64 = 1 << 20;

fn ok(status: ccalloc_status, what: &str) {
    assert_eq!(status, CCALLOC_OK, "{what}: {}", last_error());
}

fn last_error() -> String {
    // SAFETY: this thread's NUL-terminated last error.
    unsafe { CStr::from_ptr(ccalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Every test starts from no runtime and no recording, whatever an earlier one left.
fn sim_env() {
    let _ = ccalloc_record_history(false, 0, true);
    if ccalloc_is_initialized() {
        let _ = ccalloc_shutdown();
    }
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
    std::env::set_var("CCALLOC_SIM_DEVICES", "2");
    std::env::remove_var("CCALLOC_CONF");
}

/// Each test's start: alone (the heap and the runtime are the process's), on a fresh sim
/// runtime.
fn start_alone() -> std::sync::MutexGuard<'static, ()> {
    let one = serial();
    sim_env();
    ok(ccalloc_init(), "init");
    one
}

fn stats(device: i32) -> ccalloc_stats {
    let mut s = std::mem::MaybeUninit::<ccalloc_stats>::zeroed();
    ok(
        ccalloc_get_stats(device, s.as_mut_ptr()),
        "ccalloc_get_stats",
    );
    // SAFETY: written by the call above (and zeroed before).
    unsafe { s.assume_init() }
}

fn rounded(size: u64) -> u64 {
    size.max(1).div_ceil(512) * 512
}

fn s(v: usize) -> cudaStream_t {
    v as cudaStream_t
}

/// A deterministic generator (an LCG).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the caller holds on device 0: address → requested size; current and peak of
/// (count, allocated bytes, requested bytes) over all pools.
#[derive(Default)]
struct Model {
    live: BTreeMap<u64, u64>,
    current: [i64; 3],
    peak: [i64; 3],
    allocations: i64,
    /// Live blocks also used on another stream (`record_stream`).
    shared: std::collections::BTreeSet<u64>,
    /// Requested bytes of such blocks freed since the last synchronizing call: the
    /// allocator counts them until it sees their streams' work done.
    pending_requested: i64,
    /// Whether a large block may be served whole from a larger cached one (up to 1 MiB
    /// unsplit, as PyTorch does outside paged segments): allocated bytes then lie between
    /// the rounded sizes and 1 MiB more per live large block, peak unchecked.
    loose_bytes: bool,
}

impl Model {
    fn alloc(&mut self, p: u64, size: u64) {
        assert!(p != 0, "NULL for {size} bytes");
        assert!(
            self.live.insert(p, size).is_none(),
            "{p:#x} handed out twice"
        );
        if let Some((&q, &z)) = self.live.range(..p).next_back() {
            assert!(q + rounded(z) <= p, "{p:#x} overlaps {q:#x}");
        }
        if let Some((&q, _)) = self.live.range(p + 1..).next() {
            assert!(p + rounded(size) <= q, "{p:#x} overlaps {q:#x}");
        }
        self.change(size, 1);
        self.allocations += 1;
    }
    fn free(&mut self, p: u64) -> u64 {
        let size = self.live.remove(&p).expect("freeing a live block");
        self.change(size, -1);
        if self.shared.remove(&p) {
            self.pending_requested += size as i64;
        }
        size
    }
    fn change(&mut self, size: u64, sign: i64) {
        for (i, v) in [1, rounded(size) as i64, size as i64]
            .into_iter()
            .enumerate()
        {
            self.current[i] += sign * v;
            self.peak[i] = self.peak[i].max(self.current[i]);
        }
    }
    fn reset_peaks(&mut self) {
        self.peak = self.current;
    }
    /// After a call that waits for every stream (empty_cache): nothing is pending.
    fn synced(&mut self) {
        self.pending_requested = 0;
        self.peak[2] = self.peak[2].max(self.current[2]);
    }
    /// Count, allocated and requested bytes (current, peak) and allocations ever made;
    /// requested bytes exactly only when no shared block's free may still be pending (else
    /// between the model and the model plus the pending ones, peak unchecked).
    fn check(&self, s: &ccalloc_stats, what: &str) {
        let got = [
            s.allocation.all,
            s.allocated_bytes.all,
            s.requested_bytes.all,
        ];
        let r = got[2].current;
        assert!(
            r >= self.current[2] && r <= self.current[2] + self.pending_requested,
            "{what}: requested_bytes {r} outside [{}, {}]",
            self.current[2],
            self.current[2] + self.pending_requested
        );
        let exact = if self.pending_requested == 0 { 3 } else { 2 };
        if self.loose_bytes {
            let large = self.live.values().filter(|&&z| z > MIB).count() as i64;
            let a = got[1].current;
            assert!(
                a >= self.current[1] && a <= self.current[1] + large * MIB as i64,
                "{what}: allocated_bytes {a} outside [{}, +{large} MiB]",
                self.current[1]
            );
        }
        for (i, name) in ["allocation", "allocated_bytes", "requested_bytes"][..exact]
            .iter()
            .enumerate()
            .filter(|(i, _)| !(self.loose_bytes && *i == 1))
        {
            assert_eq!(
                (got[i].current, got[i].peak),
                (self.current[i], self.peak[i]),
                "{what}: {name} (current, peak) differs from the model"
            );
        }
        assert_eq!(
            s.allocation.all.allocated, self.allocations,
            "{what}: allocations ever made"
        );
    }
}

fn torch_alloc(size: u64, device: i32, stream: usize) -> u64 {
    ccalloc_torch_alloc(size as usize, device, s(stream)) as u64
}

fn torch_free(p: u64, size: u64, device: i32, stream: usize) {
    ccalloc_torch_free(p as *mut c_void, size as usize, device, s(stream));
}

/// The status `ccalloc_torch_free` left: the hook returns nothing, so a marker error is set
/// first and the last error read after.
fn torch_free_failed(p: u64, size: u64, device: i32, stream: usize) -> Option<String> {
    ccalloc_set_memory_fraction(f64::NAN, 0); // marker: "fraction is NaN"
    let marker = last_error();
    torch_free(p, size, device, stream);
    let after = last_error();
    (after != marker).then_some(after)
}

const MAIN: usize = 0x1000;
const SIDE: usize = 0x2000;

// ------------------------------------------------------------------------------------------
// 1. Forward on one thread, backward on another, through the torch hooks
// ------------------------------------------------------------------------------------------

/// A training loop as PyTorch runs it with autograd's backward on its own thread: the
/// forward thread allocates activations on the main stream (`ccalloc_torch_alloc`, size 0
/// giving NULL), some also used on a side stream (`ccalloc_torch_record_stream`); the
/// backward thread allocates gradients and frees the activations
/// (`ccalloc_torch_free(ptr, size, device, alloc stream)`), so blocks cross threads. Mixed
/// in: double frees, frees naming the wrong device, record_stream on freed blocks: each
/// must fail and leave everything as it was. Checked after every phase of every step:
/// allocation count, allocated and requested bytes (current and peak, peaks reset every
/// 40 steps) equal the model; the last error stays under 1 KiB. After 100 warm-up steps,
/// 600 more leave the heap within 16 KiB.
#[test]
fn forward_and_backward_threads_through_the_torch_hooks_keep_exact_stats() {
    let _one = serial();
    sim_env();
    ccalloc_torch_init(2);
    assert!(ccalloc_is_initialized());
    let fwd = Worker::new();
    let bwd = Worker::new();
    let model = Arc::new(std::sync::Mutex::new(Model::default()));
    // The weights: made once, on the main thread.
    let weights: Vec<u64> = (0..4)
        .map(|i| {
            let size = (i + 1) * 300_000;
            let p = torch_alloc(size, 0, MAIN);
            model.lock().unwrap().alloc(p, size);
            p
        })
        .collect();
    let mut growth = HeapGrowth::default();
    for step in 0..700u64 {
        // Forward: activations.
        let m = model.clone();
        let acts: Vec<(u64, u64)> = fwd.run(move || {
            let mut rng = Lcg(step);
            let mut m = m.lock().unwrap();
            let mut acts = Vec::new();
            for i in 0..12 {
                let size = match rng.below(4) {
                    0 => 512 * (1 + rng.below(8)),
                    1 => 4096 * (1 + rng.below(64)),
                    2 => MIB + 512 * rng.below(4096),
                    _ => 0,
                };
                let p = torch_alloc(size, 0, MAIN);
                if size == 0 {
                    assert_eq!(p, 0, "size 0 gives NULL");
                    continue;
                }
                m.alloc(p, size);
                if i % 3 == 0 {
                    ccalloc_torch_record_stream(p as *mut c_void, s(SIDE));
                    m.shared.insert(p);
                }
                acts.push((p, size));
            }
            acts
        });
        model
            .lock()
            .unwrap()
            .check(&stats(0), &format!("step {step} forward"));
        // Backward: gradients, then activations freed (reverse order), with mistakes.
        let m = model.clone();
        let dead: Vec<(u64, u64)> = bwd.run(move || {
            let mut m = m.lock().unwrap();
            let mut grads = Vec::new();
            for (p, size) in acts.iter().rev() {
                let g = torch_alloc(*size, 0, MAIN);
                m.alloc(g, *size);
                grads.push((g, *size));
                m.free(*p);
                torch_free(*p, *size, 0, MAIN);
            }
            // Mistakes: nothing may change.
            if let Some(&(p, size)) = acts.first() {
                let e = torch_free_failed(p, size, 0, MAIN).expect("a double free fails");
                assert!(e.len() < 1024, "message of {} bytes: {e:.200}", e.len());
                let e = torch_free_failed(p + 256, size, 0, MAIN)
                    .expect("a pointer inside a freed block fails");
                assert!(e.len() < 1024, "message of {} bytes", e.len());
            }
            if let Some(&(g, size)) = grads.first() {
                torch_free_failed(g, size, 1, MAIN).expect("a free naming device 1 fails");
            }
            grads
        });
        model
            .lock()
            .unwrap()
            .check(&stats(0), &format!("step {step} backward"));
        // Optimizer step on the main thread: gradients freed, on a stream other than their
        // allocation's for some (PyTorch passes the tensor's stream; a wrong one must still
        // free the block).
        {
            let mut m = model.lock().unwrap();
            for (i, (g, size)) in dead.into_iter().enumerate() {
                m.free(g);
                let stream = if i % 5 == 0 { SIDE } else { MAIN };
                torch_free(g, size, 0, stream);
                if i == 0 {
                    ccalloc_torch_record_stream(g as *mut c_void, s(SIDE));
                    assert!(
                        !last_error().is_empty(),
                        "record_stream on a freed block fails"
                    );
                }
            }
            m.check(&stats(0), &format!("step {step} optimizer"));
            assert!(last_error().len() < 1024);
            if step % 40 == 39 {
                ccalloc_torch_empty_cache();
                m.synced();
                m.check(&stats(0), &format!("step {step} after empty_cache"));
                ok(ccalloc_reset_peak_stats(0), "reset_peak_stats");
                m.reset_peaks();
                m.check(&stats(0), &format!("step {step} after reset_peak_stats"));
            }
        }
        if step == 100 {
            growth.start();
        }
        if step > 100 && step % 100 == 0 {
            growth.mark();
        }
    }
    let (grew, marks) = (growth.grew(), &growth.marks);
    assert!(grew < 16 << 10, "the heap grew by {grew} bytes: {marks:?}");
    let mut m = model.lock().unwrap();
    for p in weights {
        let size = m.free(p);
        torch_free(p, size, 0, MAIN);
    }
    m.check(&stats(0), "the end");
    drop((fwd, bwd));
    ccalloc_torch_empty_cache();
    ok(ccalloc_shutdown(), "shutdown");
}

// ------------------------------------------------------------------------------------------
// 2. CUDA-graph captures through the pool entry points
// ------------------------------------------------------------------------------------------

const CAPTURE: usize = 0x3000;

static BEGUN: AtomicU64 = AtomicU64::new(0);
static RELEASED: AtomicU64 = AtomicU64::new(0);

/// PyTorch's capture filter: the capturing stream only (`ctx` names it).
unsafe extern "C" fn capture_filter(ctx: *mut c_void, stream: cudaStream_t) -> bool {
    std::ptr::eq(stream as *const c_void, ctx as *const c_void)
}

unsafe extern "C" fn release_filter(_ctx: *mut c_void) {
    RELEASED.fetch_add(1, SeqCst);
}

fn begin(pool: ccalloc_pool_id) {
    BEGUN.fetch_add(1, SeqCst);
    ok(
        ccalloc_begin_allocate_to_pool(
            0,
            pool,
            Some(capture_filter),
            CAPTURE as *mut c_void,
            Some(release_filter),
        ),
        "begin_allocate_to_pool",
    );
}

fn use_count(pool: ccalloc_pool_id) -> u32 {
    let mut n = u32::MAX;
    ok(ccalloc_pool_use_count(0, pool, &mut n), "pool_use_count");
    n
}

/// Segments of device 0 by pool: (general, private) counts.
fn segments_by_pool() -> (usize, usize) {
    let mut snap = std::ptr::null_mut();
    ok(ccalloc_snapshot_take(0, false, &mut snap), "snapshot_take");
    let (mut n, mut t) = (0usize, 0usize);
    ok(
        unsafe { ccalloc_snapshot_counts(snap, &mut n, &mut t) },
        "counts",
    );
    let mut private = 0;
    for i in 0..n {
        let mut seg = std::mem::MaybeUninit::<ccalloc_segment_info>::zeroed();
        ok(
            unsafe { ccalloc_snapshot_segment(snap, i, seg.as_mut_ptr()) },
            "segment",
        );
        let seg = unsafe { seg.assume_init() };
        if (seg.pool.first, seg.pool.second) != (0, 0) {
            private += 1;
        }
    }
    unsafe { ccalloc_snapshot_free(snap) };
    (n - private, private)
}

/// 400 graph captures as `torch.cuda.graph` makes them: a window on the capturing stream
/// (`ccalloc_begin_allocate_to_pool` with PyTorch's stream filter), allocations and frees
/// inside it while another thread allocates on the main stream, the window closed, the
/// graph's outputs freed before or after the graph releases its pool; every 4th capture
/// shares the previous graph's pool (`pool=` argument: two holds). Mixed in: closing a
/// window that is not open and releasing an unknown pool fail and change nothing.
/// Checked: the statistics equal the model after every capture; each pool's hold count
/// is 0 once released; every filter handed over is released exactly once, by the end of
/// its window; every 20 captures, `empty_cache` leaves no private segment and nothing
/// reserved beyond the weights' segments; after 100 warm-up captures the heap stays within
/// 16 KiB.
#[test]
fn graph_captures_through_the_pool_entry_points_give_everything_back() {
    let _one = start_alone();
    let other = Worker::new();
    let mut m = Model {
        loose_bytes: true,
        ..Model::default()
    };
    let weight = torch_alloc(3 * MIB, 0, MAIN);
    m.alloc(weight, 3 * MIB);
    ccalloc_torch_empty_cache();
    let reserved_weights = stats(0).reserved_bytes.all.current;
    let (begun0, released0) = (BEGUN.load(SeqCst), RELEASED.load(SeqCst));
    let mut rng = Lcg(7);
    let mut growth = HeapGrowth::default();
    // A pool shared by the next capture: (pool, its outputs).
    let mut held: Option<(ccalloc_pool_id, Vec<(u64, u64)>)> = None;
    for k in 0..400u64 {
        let share = k % 4 == 1 && held.is_some();
        let pool = match (&held, share) {
            (Some((p, _)), true) => *p,
            _ => ccalloc_pool_id {
                first: k + 1,
                second: 0,
            },
        };
        begin(pool);
        let mut outputs = Vec::new();
        let mut temps = Vec::new();
        for i in 0..6 {
            let size = match rng.below(3) {
                0 => 512 * (1 + rng.below(64)),
                1 => 4096 * (1 + rng.below(200)),
                _ => MIB + 4096 * rng.below(512),
            };
            let p = torch_alloc(size, 0, CAPTURE);
            m.alloc(p, size);
            if i % 2 == 0 {
                temps.push((p, size));
            } else {
                outputs.push((p, size));
            }
        }
        // Another thread's work on the main stream during the capture: not routed.
        let (a, b) = other.run(|| {
            let a = torch_alloc(200_000, 0, MAIN);
            let b = torch_alloc(2 * MIB + 512, 0, MAIN);
            (a, b)
        });
        m.alloc(a, 200_000);
        m.alloc(b, 2 * MIB + 512);
        for (p, size) in temps {
            m.free(p);
            torch_free(p, size, 0, CAPTURE);
        }
        other.run(move || {
            torch_free(a, 200_000, 0, MAIN);
            torch_free(b, 2 * MIB + 512, 0, MAIN);
        });
        m.free(a);
        m.free(b);
        ccalloc_torch_end_allocate_to_pool(0, pool);
        m.check(&stats(0), &format!("capture {k}"));
        // Mistakes.
        let before = format!("{:?}", stats(0));
        assert_ne!(
            ccalloc_end_allocate_to_pool(0, pool),
            CCALLOC_OK,
            "no window is open"
        );
        let unknown = ccalloc_pool_id {
            first: 1 << 40,
            second: k,
        };
        assert_ne!(ccalloc_release_pool(0, unknown), CCALLOC_OK, "unknown pool");
        assert_eq!(
            before,
            format!("{:?}", stats(0)),
            "capture {k}: a mistake changed the stats"
        );
        // Graph teardown: the shared pool's first graph goes now too.
        let release = |pool: ccalloc_pool_id, outs: Vec<(u64, u64)>, m: &mut Model, early: bool| {
            if early {
                ccalloc_torch_release_pool(0, pool);
            }
            for (p, size) in outs {
                m.free(p);
                torch_free(p, size, 0, CAPTURE);
            }
            if !early {
                ccalloc_torch_release_pool(0, pool);
            }
        };
        match held.take() {
            Some((p, outs)) if share => {
                assert_eq!(use_count(pool), 2, "capture {k}: two graphs hold the pool");
                release(p, outs, &mut m, k % 8 == 1);
                release(pool, outputs, &mut m, false);
                assert_eq!(use_count(pool), 0, "capture {k}: shared pool released");
            }
            prev => {
                if let Some((p, outs)) = prev {
                    release(p, outs, &mut m, true);
                    assert_eq!(use_count(p), 0);
                }
                if k % 4 == 0 {
                    held = Some((pool, outputs));
                } else {
                    release(pool, outputs, &mut m, k % 3 == 0);
                    assert_eq!(use_count(pool), 0, "capture {k}: released");
                }
            }
        }
        m.check(&stats(0), &format!("capture {k} after teardown"));
        let open_windows = 0;
        assert_eq!(
            BEGUN.load(SeqCst) - begun0,
            RELEASED.load(SeqCst) - released0 + open_windows,
            "capture {k}: every closed window's filter is released once"
        );
        if k % 20 == 19 && held.is_none() {
            ccalloc_torch_empty_cache();
            let (_, private) = segments_by_pool();
            assert_eq!(
                private, 0,
                "capture {k}: private segments after empty_cache"
            );
            assert_eq!(
                stats(0).reserved_bytes.all.current,
                reserved_weights,
                "capture {k}: reserved after empty_cache with only the weight live"
            );
            // Measured at the same point of the cycle: nothing private, the cache empty.
            if k == 99 {
                growth.start();
            }
            if k > 99 {
                growth.mark();
            }
        }
    }
    if let Some((p, outs)) = held.take() {
        for (q, size) in outs {
            m.free(q);
            torch_free(q, size, 0, CAPTURE);
        }
        ccalloc_torch_release_pool(0, p);
    }
    let (grew, marks) = (growth.grew(), &growth.marks);
    assert!(grew < 16 << 10, "the heap grew by {grew} bytes: {marks:?}");
    m.free(weight);
    torch_free(weight, 3 * MIB, 0, MAIN);
    m.check(&stats(0), "the end");
    drop(other);
    ccalloc_torch_empty_cache();
    assert_eq!(stats(0).reserved_bytes.all.current, 0);
    ok(ccalloc_shutdown(), "shutdown");
}

// ------------------------------------------------------------------------------------------
// 3. Failed calls change nothing; messages stay short
// ------------------------------------------------------------------------------------------

/// Every kind of failing call a PyTorch job can make, 1,500 rounds over live, freed and
/// foreign pointers: each must fail with its status, leave both devices' statistics as
/// they were (compared whole), and leave a last error of under 1 KiB that names this
/// failure (not an earlier one). After 300 warm-up rounds the heap stays within 8 KiB.
#[test]
fn failed_calls_change_nothing_and_their_messages_stay_short() {
    let _one = start_alone();
    let mut live = Vec::new();
    for i in 0..8u64 {
        let mut p = std::ptr::null_mut();
        ok(
            ccalloc_malloc((i as usize + 1) * 70_000, 0, s(MAIN), &mut p),
            "malloc",
        );
        live.push(p);
    }
    let mut freed = std::ptr::null_mut();
    ok(ccalloc_malloc(4096, 0, s(MAIN), &mut freed), "malloc");
    ok(ccalloc_free(freed, 0), "free");
    let mut d1 = std::ptr::null_mut();
    ok(
        ccalloc_malloc(8192, 1, s(MAIN), &mut d1),
        "malloc on device 1",
    );
    let mut host = std::ptr::null_mut();
    ok(ccalloc_host_malloc(4096, &mut host), "host_malloc");
    let mut snap = std::ptr::null_mut();
    ok(ccalloc_snapshot_take(-1, false, &mut snap), "snapshot");
    let bad_conf = c"max_split_size_mb:banana";
    let mut growth = HeapGrowth::default();
    let mut longest = 0;
    for round in 0..1500usize {
        let before = (format!("{:?}", stats(0)), format!("{:?}", stats(1)));
        let p = live[round % live.len()];
        let mut out = std::ptr::null_mut();
        let mut seg = std::mem::MaybeUninit::<ccalloc_segment_info>::zeroed();
        let calls: Vec<(ccalloc_status, &str, ccalloc_status)> = vec![
            (ccalloc_free(freed, 0), "double free", CCALLOC_DOUBLE_FREE),
            (
                ccalloc_free(0xdead_0000 as *mut c_void, 0),
                "unknown",
                CCALLOC_UNKNOWN_POINTER,
            ),
            (ccalloc_free(p, 1), "wrong device", CCALLOC_WRONG_DEVICE),
            (
                ccalloc_free(d1, 0),
                "device 1's block on 0",
                CCALLOC_WRONG_DEVICE,
            ),
            (ccalloc_free(p, 9), "no device 9", CCALLOC_INVALID_DEVICE),
            (
                ccalloc_free(host, 0),
                "a host block",
                CCALLOC_UNKNOWN_POINTER,
            ),
            (
                ccalloc_host_free(p),
                "a device block to host_free",
                CCALLOC_UNKNOWN_POINTER,
            ),
            (
                ccalloc_malloc(0, 0, s(MAIN), &mut out),
                "size 0",
                CCALLOC_INVALID_SIZE,
            ),
            (
                ccalloc_malloc(64, 5, s(MAIN), &mut out),
                "device 5",
                CCALLOC_INVALID_DEVICE,
            ),
            (
                ccalloc_record_stream(freed, 0, s(SIDE)),
                "record freed",
                CCALLOC_DOUBLE_FREE,
            ),
            (
                ccalloc_record_stream(p, 1, s(SIDE)),
                "record wrong dev",
                CCALLOC_WRONG_DEVICE,
            ),
            (
                ccalloc_set_memory_fraction(f64::NAN, 0),
                "NaN",
                CCALLOC_INVALID_ARGUMENT,
            ),
            (
                ccalloc_set_memory_fraction(1.5, 0),
                "1.5",
                CCALLOC_INVALID_ARGUMENT,
            ),
            (
                ccalloc_end_allocate_to_pool(
                    0,
                    ccalloc_pool_id {
                        first: 9,
                        second: round as u64,
                    },
                ),
                "end unknown",
                CCALLOC_INVALID_ARGUMENT,
            ),
            (
                ccalloc_release_pool(
                    0,
                    ccalloc_pool_id {
                        first: 9,
                        second: round as u64,
                    },
                ),
                "release unknown",
                CCALLOC_INVALID_ARGUMENT,
            ),
            (
                unsafe { ccalloc_set_config(bad_conf.as_ptr()) },
                "bad conf",
                CCALLOC_CONFIG_ERROR,
            ),
            (
                unsafe { ccalloc_snapshot_segment(snap, 1 << 20, seg.as_mut_ptr()) },
                "segment index",
                CCALLOC_INVALID_ARGUMENT,
            ),
            (
                ccalloc_get_stats(7, std::ptr::null_mut()),
                "NULL out",
                CCALLOC_INVALID_ARGUMENT,
            ),
            (
                ccalloc_empty_cache(3),
                "empty device 3",
                CCALLOC_INVALID_DEVICE,
            ),
        ];
        // Each call was made in order; only the last one's message is kept.
        for (got, what, want) in &calls {
            assert_eq!(got, want, "round {round}: {what}");
        }
        let e = last_error();
        longest = longest.max(e.len());
        assert!(
            e.len() < 1024,
            "round {round}: a message of {} bytes",
            e.len()
        );
        assert!(
            e.contains("device 3") || e.contains('3'),
            "round {round}: the last failure's message: {e}"
        );
        // The torch hooks' failures, one at a time, each its own message.
        ccalloc_torch_free(freed, 4096, 0, s(MAIN));
        let e1 = last_error();
        ccalloc_torch_record_stream(0xbad_0000 as *mut c_void, s(SIDE));
        let e2 = last_error();
        assert_ne!(
            e1, e2,
            "round {round}: record_stream's failure has its own message"
        );
        ccalloc_torch_set_memory_fraction(-0.5, 0);
        let e3 = last_error();
        assert_ne!(
            e2, e3,
            "round {round}: set_memory_fraction's failure has its own message"
        );
        ccalloc_torch_end_allocate_to_pool(
            0,
            ccalloc_pool_id {
                first: 3,
                second: 3,
            },
        );
        ccalloc_torch_release_pool(
            1,
            ccalloc_pool_id {
                first: 3,
                second: 3,
            },
        );
        for e in [&e1, &e2, &e3] {
            assert!(
                e.len() < 1024,
                "round {round}: a message of {} bytes",
                e.len()
            );
        }
        let after = (format!("{:?}", stats(0)), format!("{:?}", stats(1)));
        assert_eq!(
            before, after,
            "round {round}: failed calls changed the statistics"
        );
        let mut frac = 0.0;
        ok(
            ccalloc_get_memory_fraction(0, &mut frac),
            "get_memory_fraction",
        );
        assert_eq!(
            frac, 1.0,
            "round {round}: failed fraction calls changed the fraction"
        );
        if round == 300 {
            growth.start();
        }
        if round > 300 && round % 200 == 0 {
            growth.mark();
        }
    }
    let (grew, marks) = (growth.grew(), &growth.marks);
    assert!(
        grew < 8 << 10,
        "the heap grew by {grew} bytes (longest message {longest}): {marks:?}"
    );
    unsafe { ccalloc_snapshot_free(snap) };
    for p in live {
        ok(ccalloc_free(p, 0), "free");
    }
    ok(ccalloc_free(d1, 1), "free d1");
    ok(ccalloc_host_free(host), "host_free");
    ok(ccalloc_empty_cache(-1), "empty_cache");
    ok(ccalloc_host_empty_cache(), "host_empty_cache");
    ok(ccalloc_shutdown(), "shutdown");
}

// ------------------------------------------------------------------------------------------
// 4. Threads that come and go
// ------------------------------------------------------------------------------------------

/// A data-loader / autograd pattern with short-lived threads: each of 400 threads frees
/// the blocks the previous thread allocated (so its front may adopt them), allocates its
/// own through `ccalloc_torch_alloc`, records one on a side stream, makes a failing call
/// (its last error), reads statistics, and exits. Checked after each join: the statistics
/// equal the model (blocks a thread's front held come back at its exit), reserved bytes
/// stop growing (the same working set, however many threads), and after 100 warm-up
/// threads the heap stays within 24 KiB (what a thread leaves must go with it).
#[test]
fn threads_that_come_and_go_leave_nothing_behind() {
    let _one = start_alone();
    let mut m = Model::default();
    let mut handed: Vec<(u64, u64)> = Vec::new();
    let mut growth = HeapGrowth::default();
    let mut reserved_marks = Vec::new();
    for t in 0..400u64 {
        let prev = std::mem::take(&mut handed);
        for &(p, _) in &prev {
            m.free(p);
        }
        let mine: Vec<(u64, u64)> = std::thread::spawn(move || {
            for (p, size) in prev {
                torch_free(p, size, 0, MAIN);
            }
            // Allocated and freed with nothing else live (below every peak): these stay in
            // this thread's front until it exits.
            for _ in 0..3 {
                let q = torch_alloc(8192, 0, MAIN);
                torch_free(q, 8192, 0, MAIN);
            }
            let mut mine = Vec::new();
            for i in 0..5 {
                let size = [700, 4096, 100_000, 1 << 20, 3 << 20][i] + 512 * (t % 3);
                let p = torch_alloc(size, 0, MAIN);
                mine.push((p, size));
            }
            ccalloc_torch_record_stream(mine[1].0 as *mut c_void, s(SIDE));
            assert_ne!(ccalloc_free(0x1234_0000 as *mut c_void, 0), CCALLOC_OK);
            let _ = stats(0);
            mine
        })
        .join()
        .unwrap();
        for &(p, size) in &mine {
            m.alloc(p, size);
            if (p, size) == mine[1] {
                m.shared.insert(p);
            }
        }
        handed = mine;
        m.allocations += 3; // the thread's temporaries
        m.check(&stats(0), &format!("after thread {t}"));
        if t % 50 == 49 {
            ccalloc_torch_empty_cache();
            m.synced();
            m.check(&stats(0), &format!("thread {t}, empty_cache"));
            reserved_marks.push(stats(0).reserved_bytes.all.current);
        }
        if t == 100 {
            growth.start();
        }
        if t > 100 && t % 50 == 0 {
            growth.mark();
        }
    }
    let (grew, marks) = (growth.grew(), &growth.marks);
    assert!(
        grew < 24 << 10,
        "the heap grew by {grew} bytes over 300 threads: {marks:?}"
    );
    let r = &reserved_marks;
    assert!(
        r[r.len() - 1] <= r[1],
        "reserved bytes after empty_cache grow with the threads: {r:?}"
    );
    for (p, size) in handed {
        m.free(p);
        torch_free(p, size, 0, MAIN);
    }
    m.check(&stats(0), "the end");
    ccalloc_torch_empty_cache();
    assert_eq!(
        stats(0).reserved_bytes.all.current,
        0,
        "reserved at the end"
    );
    ok(ccalloc_shutdown(), "shutdown");
}

// ------------------------------------------------------------------------------------------
// 5. Memory fractions, OOMs and empty_cache
// ------------------------------------------------------------------------------------------

/// 240 rounds of a job that changes its memory fraction (`ccalloc_torch_set_memory_fraction`
/// over 0.05 .. 1.0 of 4 GiB) and fills it with 96 MiB blocks until out of memory, with the
/// history recording (a ring of 2,000). Checked each round: reserved never passes the
/// fraction, the OOM is counted (`num_ooms`) once per failure, the OOM message is under
/// 2 KiB, the fraction reads back, and after freeing and `ccalloc_torch_empty_cache`
/// nothing is reserved and the statistics equal the model. After 60 warm-up rounds the
/// heap stays within 16 KiB.
#[test]
fn memory_fractions_and_ooms_over_a_long_run_stay_exact() {
    let _one = start_alone();
    ok(ccalloc_record_history(true, 2_000, true), "record_history");
    let total = 4u64 << 30;
    let fractions = [0.05, 0.25, 0.1, 1.0, 0.5, 0.07];
    let mut m = Model::default();
    let mut ooms = stats(0).num_ooms;
    let mut growth = HeapGrowth::default();
    for round in 0..240usize {
        let f = fractions[round % fractions.len()];
        let big = f == 1.0;
        ccalloc_torch_set_memory_fraction(f, 0);
        let mut got = 0.0;
        ok(
            ccalloc_get_memory_fraction(0, &mut got),
            "get_memory_fraction",
        );
        assert_eq!(got, f, "round {round}");
        let size = 96 * MIB as usize + 512 * (round % 5);
        let mut blocks = Vec::new();
        let limit_blocks = if big { 8 } else { usize::MAX };
        loop {
            if blocks.len() == limit_blocks {
                break;
            }
            let mut p = std::ptr::null_mut();
            let st = ccalloc_malloc(size, 0, s(MAIN), &mut p);
            if st != CCALLOC_OK {
                assert_eq!(st, CCALLOC_OUT_OF_MEMORY, "round {round}: {}", last_error());
                ooms += 1;
                let e = last_error();
                assert!(
                    e.len() < 2048,
                    "round {round}: OOM message of {} bytes",
                    e.len()
                );
                break;
            }
            m.alloc(p as u64, size as u64);
            blocks.push(p);
        }
        let s0 = stats(0);
        assert!(
            s0.reserved_bytes.all.current as f64 <= f * total as f64,
            "round {round}: reserved {} past the fraction {f}",
            s0.reserved_bytes.all.current
        );
        assert_eq!(s0.num_ooms, ooms, "round {round}: OOMs counted");
        if !big {
            assert!(
                blocks.len() as f64 >= (f * total as f64 / size as f64).floor() - 1.0,
                "round {round}: only {} blocks of {size} under a fraction of {f}",
                blocks.len()
            );
        }
        m.check(&s0, &format!("round {round} full"));
        for p in blocks {
            m.free(p as u64);
            ok(ccalloc_free(p, 0), "free");
        }
        ccalloc_torch_empty_cache();
        let s1 = stats(0);
        m.check(&s1, &format!("round {round} emptied"));
        assert_eq!(
            s1.reserved_bytes.all.current, 0,
            "round {round}: reserved after empty_cache"
        );
        if round % 12 == 11 {
            ok(ccalloc_reset_peak_stats(-1), "reset_peak_stats");
            m.reset_peaks();
        }
        if round == 60 {
            growth.start();
        }
        if round > 60 && round % 30 == 0 {
            growth.mark();
        }
    }
    let (grew, marks) = (growth.grew(), &growth.marks);
    assert!(grew < 16 << 10, "the heap grew by {grew} bytes: {marks:?}");
    ok(ccalloc_record_history(false, 0, true), "stop recording");
    ccalloc_torch_set_memory_fraction(1.0, 0);
    ok(ccalloc_shutdown(), "shutdown");
}

// ------------------------------------------------------------------------------------------
// 6. The history of frees that wait for another stream
// ------------------------------------------------------------------------------------------

/// Recording on, 600 steps whose blocks are also used on a side stream that is paused
/// (`Tensor.record_stream` on a comm stream still running): each free waits, and completes
/// later by one of three ways, in turn: the side stream resumes and a later allocation sees
/// its work done; `torch.cuda.empty_cache()` waits for it; the block is freed on another
/// thread. Checked over the whole recorded trace (taken every 50 steps, then cleared):
/// every `free_requested` has exactly one `free_completed` of the same address and size
/// after it and before that address is handed out again; every alloc's size is its request.
/// The history's own tables follow the blocks: measured right after each clear, from step
/// 100 on, the heap stays within 16 KiB.
#[test]
fn frees_that_wait_for_another_stream_complete_once_in_the_history() {
    let _one = start_alone();
    let helper = Worker::new();
    ok(
        ccalloc_record_history(true, 1 << 20, true),
        "record_history",
    );
    let mut growth = HeapGrowth::default();
    let mut pending: Vec<(u64, u64)> = Vec::new();
    for step in 0..600u64 {
        ok(ccalloc_sim_pause_stream(0, s(SIDE), true), "pause");
        let sizes = [2048u64, 50_000 + 512 * (step % 7), 2 * MIB + 4096];
        let blocks: Vec<(u64, u64)> = sizes
            .iter()
            .map(|&z| (torch_alloc(z, 0, MAIN), z))
            .collect();
        for &(p, _) in &blocks {
            ccalloc_torch_record_stream(p as *mut c_void, s(SIDE));
        }
        match step % 3 {
            0 => {
                for &(p, z) in &blocks {
                    torch_free(p, z, 0, MAIN);
                }
                ok(ccalloc_sim_pause_stream(0, s(SIDE), false), "resume");
                // A later allocation polls the side stream's events.
                let q = torch_alloc(4096, 0, MAIN);
                torch_free(q, 4096, 0, MAIN);
            }
            1 => {
                for &(p, z) in &blocks {
                    torch_free(p, z, 0, MAIN);
                }
                ok(ccalloc_sim_pause_stream(0, s(SIDE), false), "resume");
                ccalloc_torch_empty_cache();
            }
            _ => {
                let moved = blocks.clone();
                helper.run(move || {
                    for (p, z) in moved {
                        torch_free(p, z, 0, MAIN);
                    }
                });
                ok(ccalloc_sim_pause_stream(0, s(SIDE), false), "resume");
                pending.extend(blocks.iter().copied());
            }
        }
        if step % 50 == 49 {
            // Everything outstanding completes here.
            ccalloc_torch_empty_cache();
            check_trace(step);
            ok(ccalloc_record_history(true, 1 << 20, true), "clear");
            pending.clear();
            if step == 99 {
                growth.start();
            }
            if step > 99 {
                growth.mark();
            }
        }
    }
    let (grew, marks) = (growth.grew(), &growth.marks);
    assert!(grew < 16 << 10, "the heap grew by {grew} bytes: {marks:?}");
    ok(ccalloc_record_history(false, 0, true), "stop");
    drop(helper);
    ccalloc_torch_empty_cache();
    assert_eq!(stats(0).allocation.all.current, 0);
    ok(ccalloc_shutdown(), "shutdown");
}

/// The recorded trace's frees pair up (see the test above).
fn check_trace(step: u64) {
    check_trace_from(step, false)
}

/// `strict`: the trace was recorded from the start, so every free names a block it saw
/// allocated.
fn check_trace_from(step: u64, strict: bool) {
    let mut snap = std::ptr::null_mut();
    ok(ccalloc_snapshot_take(-1, true, &mut snap), "snapshot_take");
    let (mut n, mut t) = (0usize, 0usize);
    ok(
        unsafe { ccalloc_snapshot_counts(snap, &mut n, &mut t) },
        "counts",
    );
    // Address → (size, state): 0 allocated, 1 free requested.
    let mut blocks: BTreeMap<u64, (u64, u8)> = BTreeMap::new();
    let mut requested = 0;
    for i in 0..t {
        let mut e = std::mem::MaybeUninit::<ccalloc_trace_entry>::zeroed();
        ok(
            unsafe { ccalloc_snapshot_trace_entry(snap, i, e.as_mut_ptr()) },
            "entry",
        );
        let e = unsafe { e.assume_init() };
        let at = format!(
            "step {step}, entry {i} ({} {:#x} {})",
            e.action, e.addr, e.size
        );
        match e.action {
            0 => {
                assert_eq!(
                    blocks.insert(e.addr, (e.size, 0)),
                    None,
                    "{at}: handed out while still not completed"
                );
            }
            1 => {
                let b = blocks.get_mut(&e.addr);
                assert!(
                    !strict || b.is_some(),
                    "{at}: a free of a block the history never saw handed out"
                );
                // A block allocated before the last clear is not in the map.
                if let Some(b) = b {
                    assert_eq!(b.1, 0, "{at}: free requested twice");
                    assert_eq!(b.0, e.size, "{at}: size of the free");
                    b.1 = 1;
                    requested += 1;
                }
            }
            2 => {
                if let Some(&(size, state)) = blocks.get(&e.addr) {
                    assert_eq!(state, 1, "{at}: completed before requested");
                    assert_eq!(size, e.size, "{at}: size of the completion");
                    blocks.remove(&e.addr);
                }
            }
            _ => {}
        }
    }
    let open: Vec<_> = blocks.iter().filter(|(_, b)| b.1 == 1).collect();
    assert!(
        open.is_empty(),
        "step {step}: {} of {requested} requested frees never completed: {:x?}",
        open.len(),
        open.iter().take(5).collect::<Vec<_>>()
    );
    unsafe { ccalloc_snapshot_free(snap) };
}

// ------------------------------------------------------------------------------------------
// 7. Pool restores (graph trees' checkpoints) while recording
// ------------------------------------------------------------------------------------------

unsafe extern "C" fn note_restore(ctx: *mut c_void, ptr: *mut c_void, allocated: bool) {
    let v = &mut *(ctx as *mut Vec<(u64, bool)>);
    v.push((ptr as u64, allocated));
}

/// A graph tree's checkpoints (`setCheckpointPoolState`) with the history recording, 40
/// times: a pool's blocks made in a capture, its layout saved, some blocks freed and others
/// made, then the layout restored (`ccalloc_restore_pool`) and the restored blocks freed by
/// the caller. Checked: the recorded trace pairs up as in test 6: every block the restore
/// frees has its `free_requested`/`free_completed`, every block it makes again its `alloc`,
/// so that no address is handed out twice in the history and every caller's free names the
/// size allocated; the allocation count equals the model.
#[test]
fn pool_restores_keep_the_history_consistent() {
    let _one = start_alone();
    ok(
        ccalloc_record_history(true, 1 << 20, true),
        "record_history",
    );
    let mut failure = None;
    for round in 0..40u64 {
        let pool = ccalloc_pool_id {
            first: 500 + round,
            second: 0,
        };
        begin(pool);
        let sizes = [4096u64, 8192, 100_000, 3000];
        let blocks: Vec<(u64, u64)> = sizes
            .iter()
            .map(|&z| (torch_alloc(z, 0, CAPTURE), z))
            .collect();
        ccalloc_torch_end_allocate_to_pool(0, pool);
        // The saved layout: the pool's blocks, from a snapshot.
        let mut snap = std::ptr::null_mut();
        ok(ccalloc_snapshot_take(0, false, &mut snap), "snapshot");
        let (mut n, mut t) = (0usize, 0usize);
        ok(
            unsafe { ccalloc_snapshot_counts(snap, &mut n, &mut t) },
            "counts",
        );
        let mut layout = Vec::new();
        for i in 0..n {
            let mut seg = std::mem::MaybeUninit::<ccalloc_segment_info>::zeroed();
            ok(
                unsafe { ccalloc_snapshot_segment(snap, i, seg.as_mut_ptr()) },
                "segment",
            );
            let seg = unsafe { seg.assume_init() };
            if (seg.pool.first, seg.pool.second) != (pool.first, pool.second) {
                continue;
            }
            for b in 0..seg.block_count {
                let mut bi = std::mem::MaybeUninit::<ccalloc_block_info>::zeroed();
                ok(
                    unsafe { ccalloc_snapshot_block(snap, i, b, bi.as_mut_ptr()) },
                    "block",
                );
                layout.push(unsafe { bi.assume_init() });
            }
        }
        unsafe { ccalloc_snapshot_free(snap) };
        // Live now: blocks 0 and 1 freed, the others kept (replays would run here).
        torch_free(blocks[0].0, blocks[0].1, 0, CAPTURE);
        torch_free(blocks[1].0, blocks[1].1, 0, CAPTURE);
        let mut reported: Vec<(u64, bool)> = Vec::new();
        ok(
            unsafe {
                ccalloc_restore_pool(
                    0,
                    pool,
                    layout.as_ptr(),
                    layout.len(),
                    Some(note_restore),
                    &mut reported as *mut _ as *mut c_void,
                )
            },
            "restore_pool",
        );
        let made: Vec<u64> = reported.iter().filter(|r| r.1).map(|r| r.0).collect();
        assert_eq!(
            made.len(),
            4,
            "round {round}: the four saved blocks are made again"
        );
        assert_eq!(
            stats(0).allocation.all.current,
            4,
            "round {round}: live blocks"
        );
        for (p, z) in blocks.iter().copied() {
            assert!(made.contains(&p), "round {round}: {p:#x} made again");
            torch_free(p, z, 0, CAPTURE);
        }
        ccalloc_torch_release_pool(0, pool);
        // Checked after cleaning up, so that a failure leaves the next test a clean start.
        if failure.is_none() {
            failure = std::panic::catch_unwind(|| check_trace_from(round, true)).err();
        }
    }
    ok(ccalloc_record_history(false, 0, true), "stop");
    ccalloc_torch_empty_cache();
    ok(ccalloc_shutdown(), "shutdown");
    if let Some(f) = failure {
        std::panic::resume_unwind(f);
    }
}

/// `Tensor.record_stream` on a tensor of device 1 (`ccalloc_torch_record_stream` finds the
/// device that holds the pointer) while device 0 holds cached memory too: 200 rounds, each
/// must succeed and make the block's free wait for the side stream (paused): `active`
/// stays 1 on device 1 after the free until the stream resumes and empty_cache runs.
#[test]
fn record_stream_finds_the_device_of_the_block() {
    let _one = start_alone();
    for round in 0..200u64 {
        let size = 4096 * (1 + round % 50);
        let a = torch_alloc(size, 0, MAIN);
        torch_free(a, size, 0, MAIN);
        let p = torch_alloc(size, 1, MAIN);
        ok(ccalloc_sim_pause_stream(1, s(SIDE), true), "pause");
        ccalloc_set_memory_fraction(f64::NAN, 0);
        let marker = last_error();
        ccalloc_torch_record_stream(p as *mut c_void, s(SIDE));
        assert_eq!(
            last_error(),
            marker,
            "round {round}: record_stream on device 1's {p:#x} failed"
        );
        torch_free(p, size, 1, MAIN);
        assert_eq!(
            stats(1).active.all.current,
            1,
            "round {round}: the free waits for SIDE"
        );
        ok(ccalloc_sim_pause_stream(1, s(SIDE), false), "resume");
        ccalloc_torch_empty_cache();
        assert_eq!(stats(1).active.all.current, 0, "round {round}");
    }
    ok(ccalloc_shutdown(), "shutdown");
}
