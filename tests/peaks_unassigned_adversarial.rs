//! Adversarial checks of the peak book's unassigned headroom (`Unassigned`, taken by lifts
//! under only their own shard's lock): threads churning at once, meeting at barriers with a
//! level they hold together, so that the device's true peak since the last reset is known
//! exactly; resets racing the churn, statistics readers racing it, frees of other threads'
//! blocks, `empty_cache`, fronts on and off. And one lift whose count falls before it
//! settles, with a balance coming between.
#![cfg(feature = "sim")]

mod common;

use ccalloc::{Config, DeviceAllocator, SimDriver, StreamId};
use common::live::CappedChurn;
use common::{sim_allocator, within, xorshift, Gate, GatedDriver};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A round's level: each thread holds exactly this at the round's barrier. Not monotonic,
/// so that a reset that is lost (or a stale peak) shows.
fn level(cap: u64, round: u64) -> u64 {
    cap + (1 + (round * 7 + 3) % 11) * 64 * 1024
}

#[derive(Clone, Copy)]
struct Churn {
    threads: u64,
    rounds: u64,
    steps: u64,
    conf: &'static str,
    /// A thread reading `stats()` all the while.
    reader: bool,
    /// Rounds in whose churn thread 0 resets the peaks (at a random step).
    reset_every: u64,
    /// Thread 0 empties the cache now and then while churning.
    empty: bool,
    /// Each thread frees the next thread's top-up (a cross-shard free).
    cross_free: bool,
    seed: u64,
}

/// Threads churn on their own streams below `CAP` each, then top up to the round's level and
/// meet at a barrier: the device then holds `threads x level`, more than any moment of churn
/// (at most `threads x CAP`). The true peak since the last reset is therefore the highest
/// level met at a barrier since it, times the threads; thread 0 checks it at every barrier
/// (after a reset in the churn, the reset moment's sum is below every level).
fn churn(c: Churn) {
    const CAP: u64 = 2 * MIB;
    let conf = format!("per_stream_shards:True,{}", c.conf);
    let (_sim, a) = sim_allocator(16 << 30, conf.trim_end_matches(','));
    let n = c.threads;
    let barrier = Arc::new(Barrier::new(n as usize));
    let tops: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let bound = (0..c.rounds).map(|r| level(CAP, r)).max().unwrap() * n;
    let reader = c.reader.then(|| {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(SeqCst) {
                let s = a.stats().unwrap();
                for (name, st) in [
                    ("allocated", s.allocated_bytes.all()),
                    ("requested", s.requested_bytes.all()),
                ] {
                    assert!(
                        st.current <= st.peak && st.peak <= bound as i64,
                        "read {reads}: {name} current {} peak {} (never above {bound})",
                        st.current,
                        st.peak
                    );
                }
                reads += 1;
                std::thread::yield_now();
            }
            reads
        })
    });
    let workers: Vec<_> = (0..n)
        .map(|t| {
            let (a, barrier, tops) = (a.clone(), barrier.clone(), tops.clone());
            std::thread::spawn(move || {
                let stream = StreamId(100 + t);
                let mut next = xorshift(c.seed.wrapping_mul(0x9E37) + t + 1);
                let mut churn = CappedChurn::new(stream, CAP, 30);
                // Highest level since the last reset.
                let mut high = 0u64;
                for round in 0..c.rounds {
                    let reset_at = (t == 0 && c.reset_every > 0 && round % c.reset_every == 0)
                        .then(|| next() % c.steps);
                    if reset_at.is_some() {
                        high = 0;
                    }
                    for step in 0..c.steps {
                        if reset_at == Some(step) {
                            a.reset_peak_stats().unwrap();
                        }
                        if t == 0 && c.empty && step % 97 == 13 {
                            a.empty_cache().unwrap();
                        }
                        churn.step(&a, 128, &mut next);
                    }
                    let lv = level(CAP, round);
                    high = high.max(lv);
                    let top = a.malloc(lv - churn.bytes, stream).unwrap();
                    tops[t as usize].store(top, SeqCst);
                    // All hold the level: the device's peak moment.
                    barrier.wait();
                    let mine = if c.cross_free { (t + 1) % n } else { t };
                    a.free(tops[mine as usize].load(SeqCst)).unwrap();
                    barrier.wait();
                    // Read once the moment has passed (a read at it would sum the counts
                    // then, and find the peak whatever the lifts left).
                    if t == 0 {
                        let s = a.stats().unwrap();
                        let want = (n * high) as i64;
                        assert!(s.allocated_bytes.all().current < (n * CAP) as i64 + 1);
                        assert_eq!(
                            s.allocated_bytes.all().peak,
                            want,
                            "round {round}: allocated peak (level {lv}, highest since reset {high})"
                        );
                        assert_eq!(
                            s.requested_bytes.all().peak,
                            want,
                            "round {round}: requested peak"
                        );
                    }
                    barrier.wait();
                }
                churn.free_all(&a);
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, SeqCst);
    if let Some(r) = reader {
        r.join().unwrap();
    }
    assert_eq!(a.shards_made(), n as usize);
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current, 0);
}

macro_rules! churn_test {
    ($name:ident, $threads:expr, $conf:expr, $reader:expr, $reset:expr, $empty:expr, $cross:expr) => {
        #[test]
        fn $name() {
            within(|| {
                for seed in 1..=2 {
                    churn(Churn {
                        threads: $threads,
                        rounds: 14,
                        steps: 300,
                        conf: $conf,
                        reader: $reader,
                        reset_every: $reset,
                        empty: $empty,
                        cross_free: $cross,
                        seed,
                    });
                }
            });
        }
    };
}

churn_test!(
    two_threads_with_fronts_and_resets,
    2,
    "",
    false,
    3,
    false,
    false
);
churn_test!(
    two_threads_no_fronts_cross_frees,
    2,
    "thread_cache:False",
    false,
    4,
    false,
    true
);
churn_test!(
    four_threads_with_a_reader_and_resets,
    4,
    "",
    true,
    2,
    false,
    true
);
churn_test!(
    five_threads_no_fronts_reader_resets_empty,
    5,
    "thread_cache:False",
    true,
    3,
    true,
    true
);
churn_test!(
    eight_threads_fronts_cross_frees_empty,
    8,
    "",
    false,
    5,
    true,
    true
);
churn_test!(
    sixteen_threads_with_reader_and_resets,
    16,
    "",
    true,
    4,
    false,
    true
);
churn_test!(
    sixteen_threads_no_fronts_no_resets,
    16,
    "thread_cache:False",
    false,
    0,
    false,
    false
);

/// Resets from a thread of its own, racing every thread's churn and settling; the level at
/// each barrier is still above anything the churn holds, so the peak read once the levels are
/// freed again (after the round's resets, finished before the barrier) is exact.
#[test]
fn resets_racing_lifts_from_a_thread_of_their_own() {
    within(|| {
        const CAP: u64 = 2 * MIB;
        const N: u64 = 4;
        let (_sim, a) = sim_allocator(16 << 30, "per_stream_shards:True");
        // N churners and the resetter.
        let barrier = Arc::new(Barrier::new(N as usize + 1));
        let resetting = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..N)
            .map(|t| {
                let (a, barrier) = (a.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let stream = StreamId(200 + t);
                    let mut next = xorshift(0xABCD + t);
                    let mut churn = CappedChurn::new(stream, CAP, 30);
                    for round in 0..16 {
                        barrier.wait(); // churn begins
                        for _ in 0..400 {
                            churn.step(&a, 128, &mut next);
                        }
                        barrier.wait(); // churn over, resets over
                        let top = a.malloc(level(CAP, round) - churn.bytes, stream).unwrap();
                        barrier.wait(); // all hold the level
                        a.free(top).unwrap();
                        barrier.wait(); // freed
                        barrier.wait(); // checked
                    }
                    churn.free_all(&a);
                })
            })
            .collect();
        let resetter = {
            let (a, barrier, resetting) = (a.clone(), barrier.clone(), resetting.clone());
            std::thread::spawn(move || {
                let mut high = 0u64;
                for round in 0..16u64 {
                    barrier.wait();
                    let reset = round % 2 == 0;
                    if reset {
                        high = 0;
                        resetting.store(true, SeqCst);
                        for _ in 0..20 {
                            a.reset_peak_stats().unwrap();
                            std::thread::yield_now();
                        }
                    }
                    barrier.wait();
                    barrier.wait(); // all hold the level
                    barrier.wait(); // freed: the moment has passed
                    high = high.max(level(CAP, round));
                    let s = a.stats().unwrap();
                    assert_eq!(
                        s.allocated_bytes.all().peak,
                        (N * high) as i64,
                        "round {round} (reset in its churn: {reset})"
                    );
                    assert_eq!(s.requested_bytes.all().peak, (N * high) as i64);
                    barrier.wait();
                }
            })
        };
        for w in workers {
            w.join().unwrap();
        }
        resetter.join().unwrap();
        assert!(resetting.load(SeqCst));
    });
}

/// A lift whose count falls within its call (a restore carves its pool's whole segment, then
/// frees the blocks saved as free) must reach the device's peak even when, before it
/// settles, another thread's statistics read balances the peaks from the shards' counts at
/// that moment. The read holds the book while it waits for stream 3's shard (held in a
/// driver call), so the restore's settling waits behind it with its lift pending; the read
/// then sees stream 1's fallen count. (Stream 1's shard comes first in slot order: the
/// restore carves there, then waits for stream 3's shard, then for the book.) One shard says 30 MiB (`shard_peaks_exact`'s
/// `a_restore_carving_its_segment_counts_in_the_device_peak_as_with_one_shard`).
#[test]
fn a_lift_that_fell_before_settling_survives_a_balance_by_a_reader() {
    within(|| {
        const POOL: (u64, u64) = (0, 7);
        let (s1, s2, s3) = (StreamId(1), StreamId(2), StreamId(3));
        let sim = Arc::new(SimDriver::new(1, 1 << 30));
        let gated = GatedDriver::new(sim.clone(), Gate::Allocate);
        let mut config = Config::default();
        config
            .apply("per_stream_shards:True,thread_cache:False")
            .unwrap();
        let a = Arc::new(DeviceAllocator::new(0, gated.clone(), config).unwrap());
        a.begin_allocate_to_pool(POOL, Box::new(|_| true)).unwrap();
        let x = a.malloc(2 * MIB, s1).unwrap();
        let y = a.malloc(2 * MIB, s1).unwrap();
        a.end_allocate_to_pool(POOL).unwrap();
        a.free(y).unwrap();
        let saved = common::pool_layout(&a, POOL);
        let z = a.malloc(10 * MIB, s2).unwrap(); // 12 MiB live
                                                 // Stream 3's shard, the last slot (the restore looks at every shard in slot order,
                                                 // and waits for this one after carving stream 1's), with no small segment: its next
                                                 // small block grows one.
        let p = a.malloc(2 * MIB, s3).unwrap();
        a.free(p).unwrap();
        assert_eq!(a.shards_made(), 3);
        a.reset_peak_stats().unwrap(); // peak 12 MiB, no headroom anywhere
        gated.arm();
        let grower = {
            let a = a.clone();
            std::thread::spawn(move || a.malloc(512, s3).unwrap())
        };
        gated.wait_until_held();
        let reader = {
            let a = a.clone();
            std::thread::spawn(move || a.stats().unwrap())
        };
        std::thread::sleep(Duration::from_millis(150));
        let restorer = {
            let a = a.clone();
            std::thread::spawn(move || a.restore_pool(POOL, &saved).unwrap())
        };
        std::thread::sleep(Duration::from_millis(150));
        gated.open();
        let small = grower.join().unwrap();
        let _ = reader.join().unwrap();
        let done = restorer.join().unwrap();
        assert_eq!(done.allocated.len(), 1);
        let s = a.stats().unwrap();
        assert_eq!(s.allocated_bytes.all().current as u64, 12 * MIB + 512);
        // The grower's call overlaps the restore: its 512 bytes may count at the carve's
        // moment (a settling that sums stream 1's high with stream 3's count says so) or not.
        let peak = s.allocated_bytes.all().peak as u64;
        assert!(
            peak == 30 * MIB || peak == 30 * MIB + 512,
            "the carve (20 MiB on stream 1, 10 MiB on stream 2) is the device's peak; \
             got {} MiB + {} B",
            peak >> 20,
            peak & (MIB - 1)
        );
        a.free(small).unwrap();
        a.free(z).unwrap();
        a.free(done.allocated[0].ptr).unwrap();
        let _ = x;
    });
}
