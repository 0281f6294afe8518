//! Large blocks (over 1 MiB, `front::FRONT_MAX_BLOCK`) waiting in thread fronts while the
//! device has several shards: a thread's visit to another shard returns the large blocks it
//! holds in other shards' fronts first (`DeviceAllocator::return_large_held_elsewhere`).
//! What must hold: statistics (peaks across shards included) stay exact, double frees of a
//! held block are refused wherever they come from, another thread may free or record a
//! block a front handed out, exiting threads' held blocks are freed once, device-wide calls
//! see held blocks as free, memory stays bounded, and threads churning concurrently neither
//! deadlock nor leak.
#![cfg(feature = "sim")]

mod common;

use ccalloc::{BlockState, Config, DeviceAllocator, Driver, ErrorKind, SimDriver, StreamId};
use common::figures::{rounded, PoolFigures};
use common::worker::Worker;
use common::{within, xorshift, Call, FaultDriver};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(1);
const S1: StreamId = StreamId(2);
const S2: StreamId = StreamId(3);
/// The stream the waiting blocks are recorded on: paused, so its events never complete.
const PAUSED: StreamId = StreamId(9);

fn allocator(capacity: u64, conf: &str) -> (Arc<FaultDriver>, Arc<DeviceAllocator>) {
    allocator_on(SimDriver::new(1, capacity), conf)
}

fn allocator_on(sim: SimDriver, conf: &str) -> (Arc<FaultDriver>, Arc<DeviceAllocator>) {
    let driver = FaultDriver::new(Arc::new(sim), &[]);
    let mut config = Config::default();
    if !conf.is_empty() {
        config.apply(conf).unwrap();
    }
    let a = DeviceAllocator::new(0, driver.clone(), config).unwrap();
    (driver, Arc::new(a))
}

fn sharded(capacity: u64) -> (Arc<FaultDriver>, Arc<DeviceAllocator>) {
    allocator(capacity, "per_stream_shards:True")
}

/// Runs `f` and asserts that no shard served an allocation meanwhile.
fn in_fronts<R>(driver: &FaultDriver, what: &str, f: impl FnOnce() -> R) -> R {
    let before = driver.count(Call::EventDone);
    let r = f();
    assert_eq!(
        driver.count(Call::EventDone),
        before,
        "{what}: a shard served it"
    );
    r
}

/// Sizes whose blocks are exactly their rounded size: small ones (up to 1 MiB), and large
/// ones in whole multiples of 2 MiB, so that no remainder of at most 1 MiB is left unsplit.
const SIZES: [u64; 8] = [
    4096,
    65536,
    MIB,
    2 * MIB,
    2 * MIB,
    4 * MIB,
    32 * MIB,
    32 * MIB,
];

fn canary(p: u64, size: u64, tag: u8) {
    // SAFETY: sim device memory is host memory, and the block spans at least `size` bytes.
    unsafe { std::ptr::write_bytes(p as *mut u8, tag, size.min(256) as usize) };
}

fn canary_intact(p: u64, size: u64, tag: u8) -> bool {
    // SAFETY: as in `canary`; the block is still live.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, size.min(256) as usize) };
    bytes.iter().all(|&b| b == tag)
}

/// What the caller holds live, with a canary in each block, and the statistics that follow.
#[derive(Default)]
struct Model {
    figures: PoolFigures,
    live: BTreeMap<u64, (u64, StreamId, u8)>,
    allocations: i64,
    tags: u8,
}

impl Model {
    fn alloc(&mut self, p: u64, size: u64, stream: StreamId) {
        let end = p + rounded(size);
        if let Some((&q, &(s, ..))) = self.live.range(..end).next_back() {
            assert!(q + rounded(s) <= p, "{p:#x} overlaps live {q:#x}");
        }
        self.tags = self.tags.wrapping_add(1).max(1);
        canary(p, size, self.tags);
        self.live.insert(p, (size, stream, self.tags));
        self.figures.change(size, rounded(size), 1, &[0, 1, 2]);
        self.allocations += 1;
    }

    fn malloc(&mut self, a: &DeviceAllocator, size: u64, stream: StreamId) -> u64 {
        let p = a.malloc(size, stream).unwrap();
        self.alloc(p, size, stream);
        p
    }

    /// Takes `p` out of the model (before the allocator frees it).
    fn forget(&mut self, p: u64) -> (u64, StreamId) {
        let (size, stream, tag) = self.live.remove(&p).expect("a live block");
        assert!(canary_intact(p, size, tag), "{p:#x} was overwritten");
        self.figures.change(size, rounded(size), -1, &[0, 1, 2]);
        (size, stream)
    }

    fn free(&mut self, a: &DeviceAllocator, p: u64) {
        self.forget(p);
        a.free(p).unwrap();
    }

    /// Makes `stream`'s shard hold a freed block waiting for `PAUSED` (so that each
    /// allocation the shard serves asks the driver about its event: `in_fronts`). Its block
    /// leaves the count and allocated bytes at its free, its requested and active bytes only
    /// once its event completes.
    fn visible(&mut self, driver: &FaultDriver, a: &DeviceAllocator, stream: StreamId) {
        driver.sim.set_stream_paused(0, PAUSED, true);
        let p = self.malloc(a, 2 * MIB, stream);
        a.record_stream(p, PAUSED).unwrap();
        self.forget(p);
        a.free(p).unwrap();
        self.figures.requested_unknown = true;
    }

    /// Leaves a freed 32 MiB block in the front for `stream`'s shard: allocated and freed
    /// once in the shard, then again as a pair the front serves (`in_fronts`). Returns it.
    fn hold_large(&mut self, driver: &FaultDriver, a: &DeviceAllocator, stream: StreamId) -> u64 {
        let p = self.malloc(a, 32 * MIB, stream);
        self.free(a, p);
        let q = in_fronts(driver, "the pair", || a.malloc(32 * MIB, stream).unwrap());
        assert_eq!(q, p);
        self.alloc(q, 32 * MIB, stream);
        self.free(a, q);
        q
    }

    /// `reset_accumulated_stats`: the totals count from the figures now.
    fn reset_totals(&mut self, a: &DeviceAllocator) {
        a.reset_accumulated_stats().unwrap();
        self.figures.reset_totals(&a.stats().unwrap());
        self.allocations = 0;
    }

    fn reset_peaks(&mut self, a: &DeviceAllocator) {
        a.reset_peak_stats().unwrap();
        self.figures.reset_peaks();
    }

    /// Every figure a front moves, current and peak, per pool (requested bytes and active
    /// ones only while no freed block waits for another stream's events); the totals;
    /// allocated within reserved, and reserved what the sim holds.
    fn check(&self, a: &DeviceAllocator, driver: &FaultDriver, what: &str) {
        let s = a.stats().unwrap();
        self.figures.check(&s, what);
        assert_eq!(s.allocation.all().allocated, self.allocations, "{what}");
        if !self.figures.requested_unknown {
            self.check_active(&s, what);
        }
        let (allocated, reserved) = (
            s.allocated_bytes.all().current,
            s.reserved_bytes.all().current,
        );
        assert!(allocated <= reserved, "{what}: {allocated} > {reserved}");
        assert_eq!(
            reserved as u64,
            driver.sim.counters(0).bytes_in_use,
            "{what}: reserved against the sim"
        );
    }

    fn check_active(&self, s: &ccalloc::DeviceStats, what: &str) {
        assert_eq!(
            s.active.all().current,
            self.live.len() as i64,
            "{what}: active"
        );
        assert_eq!(
            s.active_bytes.all().current,
            s.allocated_bytes.all().current,
            "{what}: active bytes"
        );
    }

    /// A snapshot lists exactly the live blocks as allocated (held ones are free to it).
    fn check_segments(&self, a: &DeviceAllocator, what: &str) {
        let listed: BTreeMap<u64, u64> = a
            .segments()
            .unwrap()
            .into_iter()
            .flat_map(|s| s.blocks)
            .filter(|b| b.2 == BlockState::Allocated)
            .map(|b| (b.0, b.1))
            .collect();
        let live: BTreeMap<u64, u64> = self
            .live
            .iter()
            .map(|(&p, &(size, ..))| (p, rounded(size)))
            .collect();
        assert_eq!(listed, live, "{what}: the snapshot's allocated blocks");
    }
}

/// One thread on three streams with a shard each: large and small blocks, same-size pairs
/// (which the fronts serve), frees through `free` and `free_on` (the block's stream or
/// another), resets of peaks and totals, snapshots and `empty_cache`. After every call the
/// statistics equal the model, peaks included (the device's peaks over three shards while
/// large blocks wait in their fronts), and a snapshot lists exactly the live blocks.
#[test]
fn one_thread_on_three_shards_with_large_blocks_in_fronts_keeps_exact_statistics() {
    for seed in [1u64, 7, 1234] {
        let (driver, a) = sharded(2 << 30);
        let mut m = Model::default();
        let mut rng = xorshift(seed * 0x9E37_79B9 + 1);
        let streams = [S0, S1, S2];
        for step in 0..1500 {
            let what = format!("seed {seed}, step {step}");
            let r = rng() % 100;
            let stream = streams[(rng() % 3) as usize];
            let size = SIZES[(rng() % SIZES.len() as u64) as usize];
            match r {
                0..=34 if m.live.len() < 12 => {
                    m.malloc(&a, size, stream);
                }
                0..=69 if !m.live.is_empty() => {
                    let i = (rng() as usize) % m.live.len();
                    let p = *m.live.keys().nth(i).unwrap();
                    let (_, own) = m.forget(p);
                    match rng() % 3 {
                        0 => a.free(p).unwrap(),
                        1 => a.free_on(p, own).unwrap(),
                        _ => a.free_on(p, stream).unwrap(),
                    }
                }
                70..=89 => {
                    // A same-size pair, twice: the second from the front.
                    for _ in 0..2 {
                        let p = m.malloc(&a, size, stream);
                        m.free(&a, p);
                    }
                }
                90..=92 => m.reset_peaks(&a),
                93..=95 => m.check_segments(&a, &what),
                96..=97 => a.empty_cache().unwrap(),
                98 => m.reset_totals(&a),
                _ => {}
            }
            m.check(&a, &driver, &what);
        }
        for p in m.live.keys().copied().collect::<Vec<_>>() {
            m.free(&a, p);
        }
        m.check(&a, &driver, "all freed");
        a.empty_cache().unwrap();
        assert_eq!(driver.sim.counters(0).bytes_in_use, 0, "seed {seed}");
        a.shutdown().unwrap();
    }
}

/// Three threads taking turns, each on a stream (and shard) of its own, with large same-size
/// pairs in their fronts and blocks freed by other threads (into their own fronts for the
/// block's shard, or straight to the shard). The statistics equal the model after every
/// call.
#[test]
fn threads_taking_turns_with_large_blocks_in_several_shards_fronts_keep_exact_peaks() {
    for (conf, seed) in [
        ("per_stream_shards:True", 3u64),
        ("thread_shards_on_contention:False", 11),
    ] {
        let (driver, a) = allocator(2 << 30, conf);
        let workers: Vec<Worker> = (0..3).map(|_| Worker::new()).collect();
        let streams = [S0, S1, S2];
        let mut m = Model::default();
        let mut rng = xorshift(seed);
        // Each thread allocates first on its own stream: a shard each.
        for (w, &s) in workers.iter().zip(&streams) {
            let a2 = a.clone();
            let p = w.run(move || a2.malloc(4096, s).unwrap());
            m.alloc(p, 4096, s);
        }
        assert_eq!(a.shards_made(), 3, "{conf}");
        for step in 0..1200 {
            let what = format!("{conf:?}, step {step}");
            let t = (rng() % 3) as usize;
            let (w, stream) = (&workers[t], streams[t]);
            let size = SIZES[(rng() % SIZES.len() as u64) as usize];
            let a2 = a.clone();
            match rng() % 10 {
                0..=3 if m.live.len() < 12 => {
                    let p = w.run(move || a2.malloc(size, stream).unwrap());
                    m.alloc(p, size, stream);
                }
                0..=6 if !m.live.is_empty() => {
                    // Any live block, freed by this thread (often not the one that had it).
                    let i = (rng() as usize) % m.live.len();
                    let p = *m.live.keys().nth(i).unwrap();
                    let (_, own) = m.forget(p);
                    let on = rng().is_multiple_of(2);
                    w.run(move || match on {
                        true => a2.free_on(p, own).unwrap(),
                        false => a2.free(p).unwrap(),
                    });
                }
                7..=8 => {
                    for _ in 0..2 {
                        let a3 = a2.clone();
                        let p = w.run(move || a3.malloc(size, stream).unwrap());
                        m.alloc(p, size, stream);
                        m.forget(p);
                        let a3 = a2.clone();
                        w.run(move || a3.free(p).unwrap());
                    }
                }
                _ => match rng() % 4 {
                    0 => m.reset_peaks(&a),
                    1 => m.check_segments(&a, &what),
                    2 => m.reset_totals(&a),
                    _ => a.empty_cache().unwrap(),
                },
            }
            m.check(&a, &driver, &what);
        }
        for p in m.live.keys().copied().collect::<Vec<_>>() {
            m.free(&a, p);
        }
        m.check(&a, &driver, "all freed");
        drop(workers);
        a.empty_cache().unwrap();
        m.check(&a, &driver, "the threads gone, the cache emptied");
        assert_eq!(driver.sim.counters(0).bytes_in_use, 0, "{conf}");
        a.shutdown().unwrap();
    }
}

/// A large block held in one shard's front does not count in the device's peak when
/// another thread's shard takes the device to a new high, and the holder's pairs stay in
/// its front beside it.
#[test]
fn a_large_block_held_in_one_shards_front_is_not_in_the_devices_peak() {
    let (driver, a) = sharded(1 << 30);
    let mut m = Model::default();
    m.visible(&driver, &a, S0);
    m.hold_large(&driver, &a, S0);
    m.check(&a, &driver, "held in S0's front");
    let other = Worker::new();
    let a2 = a.clone();
    let ps = other.run(move || {
        [
            a2.malloc(32 * MIB, S1).unwrap(),
            a2.malloc(MIB, S1).unwrap(),
        ]
    });
    m.alloc(ps[0], 32 * MIB, S1);
    m.alloc(ps[1], MIB, S1);
    // 33 MiB live at once: the held 32 MiB is not.
    m.check(&a, &driver, "another shard's new high");
    assert_eq!(
        a.stats().unwrap().allocated_bytes.all().peak as u64,
        33 * MIB
    );
    // The other thread goes on through its shard while this one holds its block: more
    // highs, each settled without the held block.
    for k in 2..6 {
        let a2 = a.clone();
        let p = other.run(move || a2.malloc(k * MIB, S1).unwrap());
        m.alloc(p, k * MIB, S1);
        m.check(&a, &driver, "the other shard rising");
    }
    for p in m.live.keys().copied().collect::<Vec<_>>() {
        m.forget(p);
        let a2 = a.clone();
        other.run(move || a2.free(p).unwrap());
    }
    m.check(&a, &driver, "the other thread's blocks freed");
    // The other shard's growth may have drained this one's fronts (lending), and waited
    // for the device: a new waiting block makes this shard's visits seen again. The shard
    // serves the pair then, and from then on the front does, beside the other shard.
    m.visible(&driver, &a, S0);
    let p = m.malloc(&a, 32 * MIB, S0);
    m.free(&a, p);
    for _ in 0..3 {
        let r = in_fronts(&driver, "the pair beside another shard", || {
            a.malloc(32 * MIB, S0).unwrap()
        });
        assert_eq!(r, p);
        m.alloc(r, 32 * MIB, S0);
        m.free(&a, r);
    }
    assert_eq!(a.shards_made(), 2);
    m.check(&a, &driver, "the pair again");
}

/// One thread doing large same-size pairs round-robin over more streams (a shard each) than
/// it keeps fronts for at once (8): fronts it gives up still hold a large block, which waits
/// for its shard's next drain. Statistics stay exact, memory bounded, nothing is freed
/// twice, and `empty_cache` gives everything back.
#[test]
fn a_thread_with_large_blocks_in_more_shards_than_it_keeps_fronts_for() {
    let (driver, a) = sharded(2 << 30);
    let mut m = Model::default();
    let streams: Vec<StreamId> = (0..10).map(|i| StreamId(40 + i)).collect();
    let mut max_reserved = 0;
    for round in 0..30 {
        for (i, &s) in streams.iter().enumerate() {
            let size = if i % 2 == 0 { 32 * MIB } else { 4 * MIB };
            for _ in 0..2 {
                let p = m.malloc(&a, size, s);
                m.free(&a, p);
            }
            let s = a.stats().unwrap();
            max_reserved = max_reserved.max(s.reserved_bytes.all().current as u64);
        }
        m.check(&a, &driver, &format!("round {round}"));
        if round % 10 == 9 {
            m.check_segments(&a, &format!("round {round}"));
        }
    }
    assert_eq!(a.shards_made(), streams.len());
    // Five 32 MiB and five 4 MiB blocks at most held or parked at once, and the slack.
    assert!(
        max_reserved <= 256 * MIB,
        "reserved up to {} MiB",
        max_reserved / MIB
    );
    a.empty_cache().unwrap();
    m.check(&a, &driver, "emptied");
    assert_eq!(driver.sim.counters(0).bytes_in_use, 0);
    a.shutdown().unwrap();
}

/// A double free of a large block held in a front is refused, whoever frees it and however,
/// in the first shard and in a later one; the refusals change no statistic, and the block
/// is then handed out once.
#[test]
fn a_double_free_of_a_large_block_held_in_a_front_is_refused_everywhere() {
    let (driver, a) = sharded(1 << 30);
    let mut m = Model::default();
    for s in [S0, S1] {
        m.visible(&driver, &a, s);
    }
    let other = Worker::new();
    for (s, elsewhere) in [(S0, S1), (S1, S0)] {
        let p = m.hold_large(&driver, &a, s);
        let before = a.stats().unwrap();
        let refused = |kind: ErrorKind, how: &str| {
            assert_eq!(kind, ErrorKind::DoubleFree, "{s:?}: {how}");
            let now = a.stats().unwrap();
            assert_eq!(
                (now.allocation, now.allocated_bytes, now.requested_bytes),
                (
                    before.allocation,
                    before.allocated_bytes,
                    before.requested_bytes
                ),
                "{s:?}: {how} changed the statistics"
            );
        };
        refused(a.free(p).unwrap_err().kind, "free");
        refused(a.free_on(p, s).unwrap_err().kind, "free_on its stream");
        refused(a.free_on(p, elsewhere).unwrap_err().kind, "free_on another");
        refused(
            a.record_stream(p, elsewhere).unwrap_err().kind,
            "record_stream",
        );
        let a2 = a.clone();
        let kinds = other.run(move || {
            [
                a2.free(p).unwrap_err().kind,
                a2.free_on(p, s).unwrap_err().kind,
                a2.free_on(p, elsewhere).unwrap_err().kind,
                a2.record_stream(p, s).unwrap_err().kind,
            ]
        });
        for (kind, how) in kinds.into_iter().zip([
            "free by another thread",
            "free_on by another thread",
            "free_on another stream by another thread",
            "record_stream by another thread",
        ]) {
            refused(kind, how);
        }
        // Still this thread's to reuse, once. (A double free by its own thread reaches the
        // shard, past the fronts, which only look among blocks out: that visit returned the
        // held block, and the shard serves it at the same place.)
        let r = a.malloc(32 * MIB, s).unwrap();
        assert_eq!(r, p);
        m.alloc(r, 32 * MIB, s);
        let x = m.malloc(&a, 32 * MIB, s);
        assert_ne!(x, r);
        m.free(&a, r);
        m.free(&a, x);
        // A visit to the other shard returns the held block to its own: a double free is
        // refused there too.
        let y = m.malloc(&a, 4096, elsewhere);
        for p in [r, x] {
            let kind = a.free(p).unwrap_err().kind;
            assert_eq!(kind, ErrorKind::DoubleFree, "{s:?}: after the return");
            let a2 = a.clone();
            let kind = other.run(move || a2.free_on(p, s).unwrap_err().kind);
            assert_eq!(kind, ErrorKind::DoubleFree, "{s:?}: after the return");
        }
        m.free(&a, y);
        m.check(&a, &driver, "after the double frees");
    }
    m.check_segments(&a, "the end");
}

/// Another thread frees, or records on another stream, a large block that this thread's
/// front (in a later shard) handed out: this thread's free of it is then a double free, it
/// is not handed out twice, and a block the other thread's front adopted, taken back by
/// this thread's allocations there, is not freed twice when the other thread's stale count
/// says it still holds one (`holding_large_elsewhere`).
#[test]
fn another_thread_frees_or_records_a_large_block_a_front_handed_out() {
    let (driver, a) = sharded(1 << 30);
    let mut m = Model::default();
    m.visible(&driver, &a, S0);
    m.visible(&driver, &a, S1);
    let other = Worker::new();
    let p = m.malloc(&a, 32 * MIB, S1);
    m.free(&a, p);
    let q = in_fronts(&driver, "the hand-out", || a.malloc(32 * MIB, S1).unwrap());
    assert_eq!(q, p);
    m.alloc(q, 32 * MIB, S1);
    // Recorded on a paused stream by the other thread, then freed by it: it waits.
    let busy = StreamId(20);
    driver.sim.set_stream_paused(0, busy, true);
    let a2 = a.clone();
    other.run(move || {
        a2.record_stream(q, busy).unwrap();
        a2.free(q).unwrap();
    });
    m.forget(q);
    assert_eq!(a.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
    let r = m.malloc(&a, 32 * MIB, S1);
    assert_ne!(r, q, "a block waiting for another stream was handed out");
    m.check(&a, &driver, "a block waiting for another stream");
    driver.sim.set_stream_paused(0, busy, false);
    m.free(&a, r);
    // Handed out by this thread's front, freed by the other thread, which allocates from
    // this shard too: its front for this shard adopts it (and serves it).
    let s = m.malloc(&a, 32 * MIB, S1);
    m.free(&a, s);
    let t = in_fronts(&driver, "the hand-out", || a.malloc(32 * MIB, S1).unwrap());
    m.alloc(t, 32 * MIB, S1);
    m.visible(&driver, &a, S1);
    let (a2, d2) = (a.clone(), driver.clone());
    let (w0, again) = other.run(move || {
        let w0 = a2.malloc(8192, S1).unwrap();
        a2.free(w0).unwrap();
        a2.free(t).unwrap();
        let again = in_fronts(&d2, "the other thread's pair", || {
            a2.malloc(32 * MIB, S1).unwrap()
        });
        a2.free(again).unwrap();
        (w0, again)
    });
    assert_eq!(again, t);
    m.alloc(w0, 8192, S1);
    m.forget(w0);
    m.forget(t);
    m.alloc(t, 32 * MIB, S1);
    m.forget(t);
    assert_eq!(a.free(t).unwrap_err().kind, ErrorKind::DoubleFree);
    m.check(&a, &driver, "held by the other thread's front");
    // This thread's next large requests in that shard take other threads' held blocks
    // back.
    let u = m.malloc(&a, 32 * MIB, S1);
    let u2 = m.malloc(&a, 32 * MIB, S1);
    m.check(&a, &driver, "taken back");
    // The other thread still believes it holds a large block there: its visit to another
    // shard (and one to that shard) must return nothing twice.
    let a2 = a.clone();
    let (v, w) = other.run(move || {
        let v = a2.malloc(4096, S0).unwrap();
        a2.free(v).unwrap();
        let w = a2.malloc(8192, S1).unwrap();
        a2.free(w).unwrap();
        (v, w)
    });
    m.alloc(v, 4096, S0);
    m.forget(v);
    m.alloc(w, 8192, S1);
    m.forget(w);
    m.check(&a, &driver, "after the other thread's visits");
    let x = m.malloc(&a, 32 * MIB, S1);
    assert!(x != u && x != u2);
    for p in [u, u2, x] {
        m.free(&a, p);
    }
    m.check(&a, &driver, "the end");
    m.check_segments(&a, "the end");
}

/// A thread on a later shard exits holding large blocks in its front there (held ones, and
/// one out, live, that it hands to another thread): the live one is freed by the other
/// thread once, the held ones are freed once, at that shard's next drain, and the
/// statistics stay exact throughout.
#[test]
fn a_thread_exiting_with_large_blocks_in_a_later_shards_front_frees_them_once() {
    for drain_by in [
        "empty_cache",
        "stats",
        "segments",
        "reset_peak_stats",
        "growth",
    ] {
        let (driver, a) = sharded(1 << 30);
        let mut m = Model::default();
        let first = m.malloc(&a, 4096, S0);
        m.free(&a, first);
        let a2 = a.clone();
        let (x, y) = std::thread::spawn(move || {
            let x = a2.malloc(32 * MIB, S1).unwrap();
            let y = a2.malloc(4 * MIB, S1).unwrap();
            a2.free(x).unwrap();
            a2.free(y).unwrap();
            // Out again, from the front; the other stays held.
            let again = a2.malloc(32 * MIB, S1).unwrap();
            assert_eq!(again, x);
            (x, y)
        })
        .join()
        .unwrap();
        m.alloc(x, 32 * MIB, S1);
        m.alloc(y, 4 * MIB, S1);
        m.forget(x);
        m.forget(y);
        m.alloc(x, 32 * MIB, S1);
        m.check(&a, &driver, &format!("{drain_by}: the thread gone"));
        assert_eq!(a.free(y).unwrap_err().kind, ErrorKind::DoubleFree);
        match drain_by {
            "empty_cache" => a.empty_cache().unwrap(),
            "stats" => drop(a.stats().unwrap()),
            "segments" => m.check_segments(&a, drain_by),
            "reset_peak_stats" => m.reset_peaks(&a),
            _ => {
                let g = m.malloc(&a, 256 * MIB, S1);
                m.free(&a, g);
            }
        }
        m.check(&a, &driver, drain_by);
        assert_eq!(a.free(y).unwrap_err().kind, ErrorKind::DoubleFree);
        // The live block, freed by this thread: its front for that shard adopts it.
        m.free(&a, x);
        assert_eq!(a.free(x).unwrap_err().kind, ErrorKind::DoubleFree);
        m.check(&a, &driver, &format!("{drain_by}: all freed"));
        // Both are handed out again, each once.
        let b = [
            m.malloc(&a, 32 * MIB, S1),
            m.malloc(&a, 4 * MIB, S1),
            m.malloc(&a, 32 * MIB, S1),
        ];
        assert_ne!(b[0], b[2]);
        for p in b {
            m.free(&a, p);
        }
        m.check(&a, &driver, &format!("{drain_by}: again"));
        a.empty_cache().unwrap();
        assert_eq!(driver.sim.counters(0).bytes_in_use, 0, "{drain_by}");
        a.shutdown().unwrap();
    }
}

/// While another thread (alive, idle) holds large blocks in its front for a later shard,
/// `stats`, `segments`, `reset_peak_stats`, `empty_cache` and `shutdown` see them as free;
/// after shutdown that thread's front hands nothing out.
#[test]
fn device_wide_calls_while_another_threads_front_holds_large_blocks() {
    let (driver, a) = sharded(1 << 30);
    let holder = Worker::new();
    let mut m = Model::default();
    m.visible(&driver, &a, S0);
    let fill = |m: &mut Model| {
        let a2 = a.clone();
        let ps = holder.run(move || {
            let ps = [
                a2.malloc(32 * MIB, S1).unwrap(),
                a2.malloc(6 * MIB, S1).unwrap(),
            ];
            for p in ps {
                a2.free(p).unwrap();
            }
            // Served from the front, and held again.
            let again = [
                a2.malloc(32 * MIB, S1).unwrap(),
                a2.malloc(6 * MIB, S1).unwrap(),
            ];
            assert_eq!(again, ps);
            for p in again {
                a2.free(p).unwrap();
            }
            ps
        });
        for _ in 0..2 {
            m.alloc(ps[0], 32 * MIB, S1);
            m.alloc(ps[1], 6 * MIB, S1);
            m.forget(ps[0]);
            m.forget(ps[1]);
        }
    };
    let mine = m.malloc(&a, 2 * MIB, S0);
    fill(&mut m);
    m.check(&a, &driver, "held");
    m.check_segments(&a, "held");
    fill(&mut m);
    m.reset_peaks(&a);
    m.check(&a, &driver, "peaks reset");
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().peak as u64, 2 * MIB);
    fill(&mut m);
    a.empty_cache().unwrap();
    m.check(&a, &driver, "emptied");
    m.free(&a, mine);
    fill(&mut m);
    // Nothing live: the held blocks do not keep the device from shutting down.
    a.empty_cache().unwrap();
    fill(&mut m);
    a.shutdown().unwrap();
    assert_eq!(driver.sim.counters(0).bytes_in_use, 0);
    let a2 = a.clone();
    let kinds = holder.run(move || {
        [
            a2.malloc(32 * MIB, S1).map_err(|e| e.kind),
            a2.malloc(6 * MIB, S1).map_err(|e| e.kind),
            a2.malloc(4096, S0).map_err(|e| e.kind),
        ]
    });
    for k in kinds {
        assert!(k.is_err(), "a block handed out after shutdown: {k:?}");
    }
    a.reopen();
    let p = m.malloc(&a, 32 * MIB, S1);
    m.free(&a, p);
    m.check(&a, &driver, "reopened");
}

/// One thread alternating large same-size pairs between two streams, each with a shard:
/// each visit returns the other shard's held block first. No leak, reserved stays bounded,
/// statistics exact, and no page is unmapped while its stream's work may still run.
#[test]
fn one_thread_alternating_large_pairs_on_two_shards_stays_bounded() {
    for together in [false, true] {
        // A GPU two events behind the host: pages whose work has not run cannot be unmapped.
        let sim = SimDriver::new(1, 1 << 30).with_event_lag(2);
        let (driver, a) = allocator_on(sim, "per_stream_shards:True");
        let mut m = Model::default();
        let mut max_reserved = 0;
        for i in 0..400 {
            let p = m.malloc(&a, 32 * MIB, S0);
            driver.sim.note_use(0, p, 32 * MIB, S0);
            let held = together.then(|| m.malloc(&a, 32 * MIB, S1));
            m.free(&a, p);
            if let Some(q) = held {
                driver.sim.note_use(0, q, 32 * MIB, S1);
                m.free(&a, q);
            }
            let q = m.malloc(&a, 32 * MIB, S1);
            driver.sim.note_use(0, q, 32 * MIB, S1);
            m.free(&a, q);
            let s = a.stats().unwrap();
            max_reserved = max_reserved.max(s.reserved_bytes.all().current as u64);
            if i % 50 == 0 {
                m.check(&a, &driver, &format!("{together}: round {i}"));
            }
        }
        m.check(&a, &driver, &format!("{together}: the end"));
        let limit = if together { 96 * MIB } else { 72 * MIB };
        assert!(
            max_reserved <= limit,
            "{together}: reserved up to {} MiB",
            max_reserved / MIB
        );
        assert_eq!(
            driver.count(Call::Unmap),
            driver.sim.counters(0).unmaps,
            "{together}: an unmap was refused (pages still in use)"
        );
        let s = a.stats().unwrap();
        let peak = if together { 64 * MIB } else { 32 * MIB };
        assert_eq!(s.allocated_bytes.all().peak as u64, peak, "{together}");
        a.empty_cache().unwrap();
        assert_eq!(driver.sim.counters(0).bytes_in_use, 0, "{together}");
    }
}

/// A large block served again by a front after its adoption carries work queued after the
/// adoption's fence; returned to its shard by its thread's visit to another shard (stream
/// unknown there), its pages must not be lent to that shard's growth before that work ran.
#[test]
fn a_large_block_returned_on_a_visit_elsewhere_is_not_lent_while_its_work_runs() {
    let (driver, a) = sharded(1 << 30);
    let sim = driver.sim.clone();
    // A GPU behind the host: S0 runs nothing until synchronized or waited on.
    sim.set_stream_paused(0, S0, true);
    let kernel = |p: u64| {
        let e = sim.record_event(0, S0).unwrap();
        sim.destroy_event(0, e);
        sim.note_use(0, p, 32 * MIB, S0);
    };
    let mut m = Model::default();
    m.visible(&driver, &a, S0);
    // The second shard, made now (its making drains the first shard's fronts).
    let z = a.malloc(4096, S1).unwrap();
    a.free(z).unwrap();
    // Allocated last in S0's shard: this thread's large frees there wait in its front.
    let p = a.malloc(32 * MIB, S0).unwrap();
    kernel(p);
    a.free(p).unwrap();
    let q = in_fronts(&driver, "the pair", || a.malloc(32 * MIB, S0).unwrap());
    assert_eq!(q, p);
    kernel(q);
    a.free(q).unwrap();
    // A visit to the second shard: the held block goes back to S0's shard first, and this
    // growth may borrow its pages, once S0's work on them has run.
    let waits = |c: ccalloc::SimCounters| c.synchronize_calls + c.event_waits;
    let (borrowed, waited) = (
        a.stats().unwrap().paging.chunks_borrowed,
        waits(sim.counters(0)),
    );
    let r = a.malloc(32 * MIB, S1).unwrap();
    assert_eq!(
        driver.count(Call::Unmap),
        sim.counters(0).unmaps,
        "an unmap was refused: pages lent while S0 may still use them"
    );
    let s = a.stats().unwrap();
    assert!(s.paging.chunks_borrowed > borrowed, "{:?}", s.paging);
    assert!(
        waits(sim.counters(0)) > waited,
        "lent without waiting for S0"
    );
    a.free(r).unwrap();
    sim.set_stream_paused(0, S0, false);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

/// Threads each on a stream of their own (a shard each) churn large same-size pairs, other
/// large and small blocks, hand some to the next thread to free, and record some on its
/// stream, while another thread reads statistics, takes snapshots, resets peaks and empties
/// the cache. No panic, no deadlock, consistent readings, and once everything is freed,
/// nothing allocated and nothing reserved after `empty_cache`.
#[test]
fn threads_churning_large_blocks_in_their_fronts_beside_device_wide_calls() {
    for conf in [
        "thread_shards_on_contention:False",
        "per_stream_shards:True",
    ] {
        const THREADS: usize = 3;
        let (driver, a) = allocator(2 << 30, conf);
        let conf_name = conf.to_string();
        let a2 = a.clone();
        within(move || {
            let a = a2;
            let stop = Arc::new(AtomicBool::new(false));
            let watcher = {
                let (a, stop) = (a.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut round = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let s = a.stats().unwrap();
                        let (b, r) = (s.allocated_bytes.all(), s.reserved_bytes.all());
                        assert!(b.current >= 0 && b.current <= r.current, "{s:?}");
                        assert!(b.peak >= b.current && s.allocation.all().current >= 0);
                        round += 1;
                        match round % 16 {
                            3 => a.empty_cache().unwrap(),
                            7 => drop(a.segments().unwrap()),
                            11 => a.reset_peak_stats().unwrap(),
                            _ => {}
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                })
            };
            let channels: Vec<_> = (0..THREADS)
                .map(|_| std::sync::mpsc::channel::<(u64, u64, u8)>())
                .collect();
            let (senders, receivers): (Vec<_>, Vec<_>) = channels.into_iter().unzip();
            let workers: Vec<_> = receivers
                .into_iter()
                .enumerate()
                .map(|(t, inbox)| {
                    let a = a.clone();
                    let next = senders[(t + 1) % THREADS].clone();
                    let next_stream = StreamId(100 + ((t + 1) % THREADS) as u64);
                    std::thread::spawn(move || {
                        let stream = StreamId(100 + t as u64);
                        let mut rng = xorshift(t as u64 * 77 + 5);
                        let mut live: Vec<(u64, u64, u8)> = Vec::new();
                        for step in 0..1500u64 {
                            // Blocks the previous thread handed over: freed here.
                            while let Ok((p, size, tag)) = inbox.try_recv() {
                                assert!(canary_intact(p, size, tag), "{p:#x} overwritten");
                                a.free(p).unwrap();
                            }
                            let tag = (step % 250) as u8 + 1;
                            match rng() % 8 {
                                0..=2 => {
                                    // A large same-size pair, then its repeat (the front's).
                                    let size = [2 * MIB, 32 * MIB][(rng() % 2) as usize];
                                    for _ in 0..2 {
                                        let p = a.malloc(size, stream).unwrap();
                                        canary(p, size, tag);
                                        assert!(canary_intact(p, size, tag));
                                        a.free(p).unwrap();
                                    }
                                }
                                3..=4 if live.len() < 6 => {
                                    let size = SIZES[(rng() % SIZES.len() as u64) as usize];
                                    let p = a.malloc(size, stream).unwrap();
                                    canary(p, size, tag);
                                    live.push((p, size, tag));
                                }
                                _ if !live.is_empty() => {
                                    let i = (rng() as usize) % live.len();
                                    let (p, size, tag) = live.swap_remove(i);
                                    assert!(canary_intact(p, size, tag), "{p:#x} overwritten");
                                    match rng() % 4 {
                                        0 => {
                                            let _ = next.send((p, size, tag));
                                        }
                                        1 => {
                                            a.record_stream(p, next_stream).unwrap();
                                            a.free(p).unwrap();
                                        }
                                        2 => a.free_on(p, stream).unwrap(),
                                        _ => a.free(p).unwrap(),
                                    }
                                }
                                _ => {}
                            }
                        }
                        for (p, size, tag) in live {
                            assert!(canary_intact(p, size, tag));
                            a.free(p).unwrap();
                        }
                        inbox
                    })
                })
                .collect();
            drop(senders);
            let inboxes: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
            // Blocks handed over after their receiver finished: freed here.
            for inbox in inboxes {
                while let Ok((p, size, tag)) = inbox.try_recv() {
                    assert!(canary_intact(p, size, tag));
                    a.free(p).unwrap();
                }
            }
            stop.store(true, Ordering::Relaxed);
            watcher.join().unwrap();
        });
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 0, "{conf_name}: {s:?}");
        assert_eq!(s.allocated_bytes.all().current, 0, "{conf_name}");
        assert_eq!(
            s.allocation.all().allocated,
            s.allocation.all().freed,
            "{conf_name}"
        );
        assert!(a.shards_made() >= THREADS, "{conf_name}");
        a.empty_cache().unwrap();
        let s = a.stats().unwrap();
        assert_eq!(s.requested_bytes.all().current, 0, "{conf_name}");
        assert_eq!(s.active.all().current, 0, "{conf_name}");
        assert_eq!(s.reserved_bytes.all().current, 0, "{conf_name}: {s:?}");
        assert_eq!(driver.sim.counters(0).bytes_in_use, 0, "{conf_name}");
        a.shutdown().unwrap();
    }
}

/// Near the device's capacity, a large block held in a front for one shard (this thread's,
/// or an idle thread's) does not make another shard's allocation fail: this thread's visit
/// returns its own first, and the OOM retry empties the other shards' caches, fronts
/// included.
#[test]
fn a_large_block_held_in_a_front_does_not_make_another_shard_run_out() {
    for holder_is_self in [true, false] {
        let (driver, a) = sharded(64 * MIB);
        let mut m = Model::default();
        let holder = Worker::new();
        let first = m.malloc(&a, 4096, S1);
        m.free(&a, first);
        // A 32 MiB block on S0, freed, then a pair: held in the front for S0's shard.
        let three = |a: &DeviceAllocator| {
            let x = a.malloc(32 * MIB, S0).unwrap();
            a.free(x).unwrap();
            for _ in 0..2 {
                let p = a.malloc(32 * MIB, S0).unwrap();
                assert_eq!(p, x);
                a.free(p).unwrap();
            }
            x
        };
        let x = if holder_is_self {
            three(&a)
        } else {
            let a2 = a.clone();
            holder.run(move || three(&a2))
        };
        for _ in 0..3 {
            m.alloc(x, 32 * MIB, S0);
            m.forget(x);
        }
        let big = m.malloc(&a, 48 * MIB, S1);
        let s = a.stats().unwrap();
        assert_eq!(s.num_ooms, 0, "{holder_is_self}");
        m.check(
            &a,
            &driver,
            &format!("{holder_is_self}: the large allocation"),
        );
        m.free(&a, big);
        a.empty_cache().unwrap();
        assert_eq!(driver.sim.counters(0).bytes_in_use, 0, "{holder_is_self}");
    }
}
