//! Adversarial checks of gifts (`DeviceAllocator::pool_spare_headroom`): a lift the
//! unassigned headroom does not cover asks the other shards, one locked at a time and
//! without the peak book, for spare headroom below their ceilings. Every test knows the
//! device's true peaks exactly: one thread's sequence, workers taking turns, threads meeting
//! at barriers, or calls held at a latch in the driver.
#![cfg(feature = "sim")]

mod common;

use ccalloc::{Config, DeviceAllocator, DevicePtr, Driver, DriverError, DriverResult, EventId};
use ccalloc::{ErrorKind, SimDriver, StreamId};
use common::within;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// Where a thread's next `allocate` waits (its shard locked) until opened.
#[derive(Default)]
struct Latch {
    entered: AtomicBool,
    open: (Mutex<bool>, Condvar),
}

impl Latch {
    fn open(&self) {
        *self.open.0.lock().unwrap() = true;
        self.open.1.notify_all();
    }
}

thread_local! {
    static LATCH: std::cell::RefCell<Option<Arc<Latch>>> = const { std::cell::RefCell::new(None) };
}

/// The sim (plain segments); a thread's `allocate` after it armed a latch waits there, then
/// is refused (not out of memory: no retry, and no count changes, so it lifts nothing).
struct LatchDriver(Arc<SimDriver>);

/// Methods passed on to the sim as they are.
macro_rules! to_sim {
    ($($f:ident($($x:ident: $t:ty),*) -> $r:ty;)*) => {
        $(fn $f(&self, $($x: $t),*) -> $r { self.0.$f($($x),*) })*
    };
}

impl Driver for LatchDriver {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn allocate(&self, d: usize, size: u64) -> DriverResult<DevicePtr> {
        let Some(latch) = LATCH.with(|l| l.borrow_mut().take()) else {
            return self.0.allocate(d, size);
        };
        latch.entered.store(true, SeqCst);
        let mut open = latch.open.0.lock().unwrap();
        while !*open {
            open = latch.open.1.wait(open).unwrap();
        }
        let detail = "refused at the test's latch".into();
        Err(DriverError::Failed {
            call: "allocate",
            detail,
        })
    }
    to_sim! {
        device_count() -> usize;
        total_memory(d: usize) -> DriverResult<u64>;
        release(d: usize, p: DevicePtr, size: u64) -> DriverResult<()>;
        record_event(d: usize, s: StreamId) -> DriverResult<EventId>;
        event_done(d: usize, e: EventId) -> DriverResult<bool>;
        wait_event(d: usize, e: EventId) -> DriverResult<()>;
        destroy_event(d: usize, e: EventId) -> ();
        synchronize(d: usize) -> DriverResult<()>;
        synchronize_stream(d: usize, s: StreamId) -> DriverResult<()>;
    }
}

/// A new shard for `stream`, made by an allocation held at a latch (its lock held) on a
/// thread of its own; returns once it is held there.
fn hold_new_shard(
    a: &Arc<DeviceAllocator>,
    stream: StreamId,
) -> (Arc<Latch>, std::thread::JoinHandle<()>) {
    let (a, latch) = (a.clone(), Arc::new(Latch::default()));
    let armed = latch.clone();
    let h = std::thread::spawn(move || {
        LATCH.with(|l| *l.borrow_mut() = Some(armed));
        assert!(a.malloc(512, stream).is_err());
    });
    while !latch.entered.load(SeqCst) {
        std::thread::yield_now();
    }
    (latch, h)
}

/// Stream 1's shard (L) holds 16 MiB at the reset (2 MiB of a pool, 14 MiB more) and frees
/// the 14 MiB; a restore then carves the pool's 20 MiB segment, so L counts 20 MiB for a
/// moment and 2 MiB after: the device's true peak is 20 MiB. The restore is held, its walk
/// at stream 3's shard and (with `in_settlement`) its book settlement at stream 4's, made
/// after the walk began, while stream 2's thread lifts 2 MiB from its cached segment and,
/// the unassigned headroom empty, asks L for a gift.
fn restore_held_while_another_shard_lifts(in_settlement: bool) {
    const POOL: (u64, u64) = (0, 7);
    let (s1, s2, s3, s4) = (StreamId(1), StreamId(2), StreamId(3), StreamId(4));
    let mut config = Config::default();
    config
        .apply("per_stream_shards:True,thread_cache:False")
        .unwrap();
    let driver = Arc::new(LatchDriver(Arc::new(SimDriver::new(1, 1 << 30))));
    let a = Arc::new(DeviceAllocator::new(0, driver, config).unwrap());
    a.begin_allocate_to_pool(POOL, Box::new(|_| true)).unwrap();
    let x = a.malloc(2 * MIB, s1).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let saved = common::pool_layout(&a, POOL);
    let e = a.malloc(14 * MIB, s1).unwrap();
    a.free(a.malloc(2 * MIB, s2).unwrap()).unwrap();
    a.reset_peak_stats().unwrap();
    assert_eq!(
        a.stats().unwrap().allocated_bytes.all().peak,
        16 * MIB as i64
    );
    a.free(e).unwrap();
    let pause = || std::thread::sleep(Duration::from_millis(300));
    let (walk, g1) = hold_new_shard(&a, s3);
    let restorer = {
        let a = a.clone();
        std::thread::spawn(move || a.restore_pool(POOL, &saved).unwrap())
    };
    pause(); // the restore has carved stream 1's shard, and waits for stream 3's
    let book = in_settlement.then(|| {
        let held = hold_new_shard(&a, s4);
        walk.open();
        pause(); // the settlement has gathered L's lift, and waits for stream 4's shard
        held
    });
    let lifter = {
        let a = a.clone();
        std::thread::spawn(move || a.malloc(2 * MIB, s2).unwrap())
    };
    pause();
    walk.open();
    if let Some((book, g2)) = book {
        book.open();
        g2.join().unwrap();
    }
    g1.join().unwrap();
    let done = restorer.join().unwrap();
    let p = lifter.join().unwrap();
    let s = a.stats().unwrap().allocated_bytes.all();
    assert_eq!(s.current as u64, 4 * MIB);
    // The lifter's 2 MiB overlaps the restore's call: it may count at the carve's moment.
    let mib = s.peak as f64 / MIB as f64;
    assert!(
        mib == 20.0 || mib == 22.0,
        "allocated peak {mib} MiB: the carve held 20"
    );
    // (`x` was freed by the restore, and made again as its one block.)
    assert_eq!(done.allocated[0].ptr, x);
    a.free(x).unwrap();
    a.free(p).unwrap();
}

/// A giver whose own lift is not settled (the restore's, its walk held) keeps it: the
/// lifter finds no gift there and settles through the book, whose balance counts L's lift.
#[test]
fn a_shard_with_an_unsettled_lift_gives_none_of_it() {
    within(|| restore_held_while_another_shard_lifts(false));
}

/// A lift the book is settling keeps its high until the book has backed it: `settle`'s
/// `gather` raises the lifted shard's assignment to its new ceiling first, and the count
/// may have fallen since (a restore's carve here). A gift taken from that gap would let
/// the book pay L's 4 MiB lift with L's own fallen high, no balance would run, and the
/// peak would read 16 MiB against the carve's 20 (as at a200db3; `BookHighs` since).
#[test]
fn a_gift_from_a_lift_the_book_is_settling_keeps_the_lift() {
    within(|| restore_held_while_another_shard_lifts(true));
}

/// The caller's live blocks and the device's true high-water marks since the last reset
/// (every moment is known: one thread, or threads taking turns).
#[derive(Default)]
struct Seq {
    live: Vec<(u64, u64)>,
    bytes: u64,
    peaks: (u64, usize),
}

impl Seq {
    fn add(&mut self, p: u64, size: u64) -> u64 {
        self.live.push((p, size));
        self.bytes += size;
        self.peaks = (
            self.peaks.0.max(self.bytes),
            self.peaks.1.max(self.live.len()),
        );
        p
    }
    /// Takes the block at `i` out (the caller frees it).
    fn take(&mut self, i: usize) -> u64 {
        let (p, size) = self.live.swap_remove(i);
        self.bytes -= size;
        p
    }
    fn free_all(&mut self, a: &DeviceAllocator) {
        while !self.live.is_empty() {
            a.free(self.take(0)).unwrap();
        }
    }
    fn reset(&mut self, a: &DeviceAllocator) {
        a.reset_peak_stats().unwrap();
        self.peaks = (self.bytes, self.live.len());
    }
    fn check(&self, a: &DeviceAllocator, what: &str) {
        let now = (self.bytes, self.live.len());
        expect_peaks(a, now, self.peaks, what);
    }
}

/// The device's current bytes and blocks are `now`, their peaks `peaks`.
fn expect_peaks(a: &DeviceAllocator, now: (u64, usize), peaks: (u64, usize), what: &str) {
    let s = a.stats().unwrap();
    let (bytes, blocks) = (
        (now.0 as i64, peaks.0 as i64),
        (now.1 as i64, peaks.1 as i64),
    );
    for st in [s.allocated_bytes, s.active_bytes, s.requested_bytes].map(|x| x.all()) {
        assert_eq!((st.current, st.peak), bytes, "{what}: bytes");
    }
    let st = s.allocation.all();
    assert_eq!((st.current, st.peak), blocks, "{what}: blocks");
}

/// One random step: allocate (now and then a large block), free (at random: `free` or
/// `free_on`, perhaps another shard's block), read, reset or empty the cache.
fn random_step(
    a: &DeviceAllocator,
    m: &mut Seq,
    next: &mut impl FnMut() -> u64,
    stream: StreamId,
    what: &str,
) {
    match next() % 100 {
        0..=52 => {
            let blocks = if next().is_multiple_of(20) {
                2048 + next() % 80000
            } else {
                1 + next() % 256
            };
            match a.malloc(512 * blocks, stream) {
                Ok(p) => _ = m.add(p, 512 * blocks),
                Err(e) => assert_eq!(e.kind, ErrorKind::OutOfMemory, "{what}: {e:?}"),
            }
        }
        53..=96 if !m.live.is_empty() => {
            let p = m.take((next() % m.live.len() as u64) as usize);
            match next() % 2 {
                0 => a.free(p).unwrap(),
                _ => a.free_on(p, stream).unwrap(),
            }
        }
        97 => m.check(a, what),
        98 => m.reset(a),
        _ => a.empty_cache().unwrap(),
    }
}

/// One thread on 8 or 40 streams (past 32, streams share shards: a lifter may be among
/// its givers) at random, with reads (balances), resets and `empty_cache` between, and on
/// a small device OOMs (the second try empties the other shards' caches): every read is
/// exact, fronts on or off.
#[test]
fn one_thread_on_many_streams_exact_at_every_read() {
    for (seed, conf, streams, capacity) in [
        (1, "", 8, 1 << 34),
        (2, "thread_cache:False", 40, 1 << 34),
        (3, "max_split_size_mb:24", 8, 1 << 34),
        (4, "expandable_segments:True,thread_cache:False", 8, 1 << 34),
        (5, "expandable_segments:True", 40, 1 << 34),
        (6, "", 8, 160 * MIB),
        (7, "thread_cache:False", 8, 160 * MIB),
    ] {
        let conf = format!("per_stream_shards:True,{conf}");
        let (a, mut m) = (
            common::sim_allocator(capacity, conf.trim_end_matches(',')).1,
            Seq::default(),
        );
        let mut next = common::xorshift(0x5EED + seed);
        for step in 0..6000 {
            let (stream, what) = (StreamId(1 + next() % streams), format!("{seed}: {step}"));
            random_step(&a, &mut m, &mut next, stream, &what);
        }
        m.check(&a, "end");
        m.free_all(&a);
        m.check(&a, "freed");
    }
}

/// Thread shards (the default): 6 threads take turns (so every moment is known), each on
/// its own stream and shard, freeing any thread's blocks (its shard falls: spare that
/// another thread's lift asks for).
#[test]
fn threads_taking_turns_on_their_own_shards_exact_at_every_read() {
    for (conf, seed) in [
        ("thread_shards_on_contention:False", 5),
        ("thread_shards_on_contention:False,thread_cache:False", 6),
    ] {
        let a = common::sim_allocator(1 << 34, conf).1;
        let workers: Vec<_> = (0..6).map(|_| common::worker::Worker::new()).collect();
        let (m, mut next) = (
            Arc::new(Mutex::new(Seq::default())),
            common::xorshift(0x7A + seed),
        );
        for step in 0..3000 {
            let (t, r) = ((next() % 6) as usize, next());
            let (a, m) = (a.clone(), m.clone());
            workers[t].run(move || {
                let mut next = common::xorshift(r | 1);
                let what = format!("seed {seed} step {step}");
                random_step(
                    &a,
                    &mut m.lock().unwrap(),
                    &mut next,
                    StreamId(50 + t as u64),
                    &what,
                );
            });
        }
        assert_eq!(a.shards_made(), 6);
        let mut m = m.lock().unwrap();
        m.check(&a, "end");
        m.free_all(&a);
        m.check(&a, "freed");
    }
}

/// Even threads rise together to a level and free it all; then odd threads rise to theirs
/// (mostly no higher: their lifts are covered by the even threads' spare, unassigned or
/// given) and free it; every third round all rise together. Barriers split the phases and
/// each thread's count only rises or only falls within one, so the device's peak is at a
/// phase's edge: thread 0 checks it after each. Every other round it resets the peaks
/// within the even threads' rise (below the phase's end) and empties the cache within
/// their fall. A reader may balance the peaks all the while.
fn seesaw(threads: usize, conf: &'static str, reader: bool, seed: u64) {
    let n = threads as u64;
    let a = common::sim_allocator(1 << 34, conf).1;
    let barrier = Arc::new(Barrier::new(threads));
    let blocks: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| Default::default()).collect());
    let level = |r: u64, k: u64| (1 + (r * k + 3) % 11) * 128 * 1024;
    let stop = Arc::new(AtomicBool::new(false));
    let reader = reader.then(|| {
        let (a, stop, bound) = (a.clone(), stop.clone(), (n * 11 * 128 * 1024) as i64);
        std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                let st = a.stats().unwrap().allocated_bytes.all();
                assert!(st.current <= st.peak && st.peak <= bound, "{st:?}");
            }
        })
    });
    let workers: Vec<_> = (0..n)
        .map(|t| {
            let (a, barrier, blocks) = (a.clone(), barrier.clone(), blocks.clone());
            std::thread::spawn(move || {
                let mut next = common::xorshift(seed * 7919 + t + 1);
                let (mut mine, mut high) = (Vec::new(), (0u64, 0usize));
                for r in 0..12 {
                    let (even, ha, hb) = (n.div_ceil(2), level(r, 7), level(r, 5));
                    let hb = if r % 4 == 0 { hb } else { hb.min(ha) };
                    let bs = 512 * (1 + (r * 13 + seed) % 64);
                    let mut phases = vec![(0, ha, even), (0, 0, 0), (1, hb, n - even), (1, 0, 0)];
                    if r % 3 == 2 {
                        phases.extend([(2, level(r, 3), n), (2, 0, 0)]);
                    }
                    for (i, &(who, target, holders)) in phases.iter().enumerate() {
                        let active = who == 2 || t % 2 == who;
                        let (odd_round, reset_at) = (t == 0 && r % 2 == 1, next() % 16);
                        let mut held = 0;
                        while active && held < target {
                            let size = bs.min(target - held);
                            mine.push(a.malloc(size, StreamId(100 + t)).unwrap());
                            held += size;
                            if odd_round && i == 0 && mine.len() as u64 == reset_at {
                                a.reset_peak_stats().unwrap();
                                high = (0, 0);
                            }
                        }
                        let falls = if active && target == 0 { mine.len() } else { 0 };
                        for (k, p) in mine.drain(..falls).enumerate() {
                            a.free(p).unwrap();
                            if odd_round && k == 3 {
                                a.empty_cache().unwrap();
                            }
                        }
                        blocks[t as usize].store(mine.len(), SeqCst);
                        barrier.wait();
                        if t == 0 {
                            let live = blocks.iter().map(|b| b.load(SeqCst)).sum::<usize>();
                            high = (high.0.max(holders * target), high.1.max(live));
                            let what = format!("seed {seed} round {r} phase {i}");
                            expect_peaks(&a, (holders * target, live), high, &what);
                        }
                        barrier.wait();
                    }
                }
            })
        })
        .collect();
    workers.into_iter().for_each(|w| w.join().unwrap());
    stop.store(true, SeqCst);
    if let Some(r) = reader {
        r.join().unwrap();
    }
    assert_eq!(a.stats().unwrap().allocated_bytes.all().current, 0);
}

#[test]
fn seesaw_stream_shards() {
    within(|| {
        for (threads, conf, reader) in [
            (2, "per_stream_shards:True,thread_cache:False", false),
            (4, "per_stream_shards:True", true),
            (8, "per_stream_shards:True,thread_cache:False", true),
            (16, "per_stream_shards:True", false),
        ] {
            (1..=2).for_each(|seed| seesaw(threads, conf, reader, seed));
        }
    });
}

#[test]
fn seesaw_thread_shards() {
    within(|| (1..=2).for_each(|seed| seesaw(8, "thread_shards_on_contention:False", true, seed)));
}
