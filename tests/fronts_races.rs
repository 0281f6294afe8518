//! Thread fronts and statistics reads: a read (or a reset of the totals) while another thread's
//! front evicts, is drained or is folded must see consistent figures (totals never going
//! backwards, never negative, current never overcounted).
#![cfg(feature = "sim")]
use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const S0: StreamId = StreamId(0);
const WATCH: Duration = Duration::from_secs(2);

fn allocator() -> DeviceAllocator {
    let sim = Arc::new(SimDriver::new(1, 1 << 30));
    DeviceAllocator::new(0, sim, Config::default()).unwrap()
}

/// Allocates 8 sizes (all of which this thread's front serves), then frees them.
fn eight_sizes(a: &DeviceAllocator) {
    let ps: Vec<u64> = (1..=8u64).map(|k| a.malloc(512 * k, S0).unwrap()).collect();
    for p in ps {
        a.free(p).unwrap();
    }
}

/// Runs `step` until `stop` is set.
fn until(stop: &AtomicBool, mut step: impl FnMut()) {
    while !stop.load(Ordering::Relaxed) {
        step();
    }
}

/// Reads the allocation totals for `WATCH` while other threads work, then sets `stop`; the
/// first reading whose totals went backwards, or whose live count leaves `0..=max_current`,
/// fails the test.
fn totals_never_go_backwards(a: &DeviceAllocator, max_current: Option<i64>, stop: &AtomicBool) {
    let deadline = Instant::now() + WATCH;
    let (mut last_alloc, mut last_freed) = (0i64, 0i64);
    let mut bad = None;
    while Instant::now() < deadline && bad.is_none() {
        let c = a.stats().unwrap().allocation.all();
        let current_wrong = max_current.is_some_and(|max| c.current > max || c.current < 0);
        if c.freed < last_freed || c.allocated < last_alloc || current_wrong {
            bad = Some(format!(
                "before: allocated {last_alloc} freed {last_freed}; now: allocated {} freed {} current {}",
                c.allocated, c.freed, c.current
            ));
        }
        (last_alloc, last_freed) = (c.allocated, c.freed);
    }
    stop.store(true, Ordering::Relaxed);
    assert!(bad.is_none(), "{}", bad.unwrap());
}

/// One thread loops over 8 sizes its front serves, plus a ninth that makes the front evict
/// its oldest held block into the shard. Totals read meanwhile must never go backwards, and
/// the live count never exceeds what the thread ever has live at once (1).
#[test]
fn stats_totals_never_go_backwards_while_a_front_evicts() {
    let a = allocator();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut round = 0u64;
            until(&stop, || {
                for k in 1..=8u64 {
                    let p = a.malloc(512 * k, S0).unwrap();
                    a.free(p).unwrap();
                }
                let p = a.malloc(512 * (9 + round % 3), S0).unwrap();
                a.free(p).unwrap();
                round += 1;
            });
        });
        totals_never_go_backwards(&a, Some(1), &stop);
    });
}

/// The same with a thread that drains (segments()) the owner's held blocks.
#[test]
fn stats_totals_never_go_backwards_while_fronts_are_drained() {
    let a = allocator();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            until(&stop, || eight_sizes(&a));
        });
        s.spawn(|| {
            until(&stop, || {
                a.segments().unwrap();
                std::thread::yield_now();
            });
        });
        totals_never_go_backwards(&a, Some(8), &stop);
    });
}

/// Threads that exit: their fronts are folded into the shard by a drain while stats are
/// read; the totals must never drop.
#[test]
fn stats_totals_never_go_backwards_while_orphans_are_folded() {
    let a = allocator();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            until(&stop, || {
                std::thread::scope(|s2| {
                    s2.spawn(|| {
                        for _ in 0..3 {
                            let p = a.malloc(4096, S0).unwrap();
                            a.free(p).unwrap();
                        }
                    });
                });
                a.segments().unwrap();
            });
        });
        totals_never_go_backwards(&a, None, &stop);
    });
}

/// reset_accumulated_stats resets the fronts, then the shard: a drain in between leaves a
/// negative `freed` total.
#[test]
fn reset_accumulated_never_leaves_negative_totals() {
    let a = allocator();
    let stop = AtomicBool::new(false);
    let mut bad = None;
    std::thread::scope(|s| {
        s.spawn(|| {
            until(&stop, || eight_sizes(&a));
        });
        s.spawn(|| {
            until(&stop, || {
                a.segments().unwrap();
            });
        });
        let deadline = Instant::now() + WATCH;
        while Instant::now() < deadline && bad.is_none() {
            a.reset_accumulated_stats().unwrap();
            let c = a.stats().unwrap().allocation.all();
            if c.freed < 0 || c.allocated < 0 || c.freed > c.allocated + 8 {
                bad = Some(format!(
                    "after a reset: allocated {} freed {}",
                    c.allocated, c.freed
                ));
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(bad.is_none(), "{}", bad.unwrap());
}
