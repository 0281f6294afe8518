//! Driver faults, enumerated: a scenario of mallocs, frees, record_stream and empty_cache
//! over two streams, run once to count its driver calls of each kind, then again with
//! exactly the n-th call of one kind failing, for every kind and every n (and the calls
//! that only a failure leads to, after each such failure). After each fault: only the
//! operation that hit it may fail, the statistics agree with the blocks, and once
//! everything is freed and the cache emptied the device holds nothing of ccalloc's.
#![cfg(feature = "sim")]

mod common;

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, DevicePtr, ErrorKind, StreamId};
use common::{Call, FaultDriver, CALLS};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(7);

#[derive(Clone, Copy, Debug)]
enum Op {
    Malloc(u64, StreamId),
    /// Frees the i-th malloc's block (if it succeeded and is live).
    Free(usize),
    RecordStream(usize, StreamId),
    EmptyCache,
}

fn scenario() -> Vec<Op> {
    use Op::*;
    vec![
        Malloc(1000, S0),
        Malloc(3 * MIB, S0),
        Malloc(30 * MIB, S1),
        RecordStream(1, S1),
        Free(0),
        Free(1),
        Malloc(3 * MIB, S1),
        Malloc(512, S1),
        Malloc(2 * MIB + 512, S0),
        Free(2),
        Malloc(40 * MIB, S0),
        RecordStream(6, S0),
        Free(6),
        EmptyCache,
        Malloc(24 * MIB, S1),
        Free(3),
        Malloc(100 * MIB, S0),
        RecordStream(8, S1),
        Free(4),
        Free(8),
        Malloc(6 * MIB, S1),
        Free(5),
        Malloc(64 * MIB, S1),
        Free(7),
        EmptyCache,
        Malloc(10 * MIB, S0),
        Free(9),
        Free(10),
    ]
}

struct Run {
    driver: Arc<FaultDriver>,
    a: DeviceAllocator,
    /// Per malloc: its block while live.
    live: Vec<Option<DevicePtr>>,
}

fn new_run(paged: bool, faults: &[(Call, u64)]) -> Run {
    // Events complete two records late: frees recorded on other streams wait, and paged
    // growth polls and waits on fences.
    let sim = Arc::new(SimDriver::new(1, 256 * MIB).with_event_lag(2));
    let driver = FaultDriver::new(sim, faults);
    let mut config = Config::default();
    config
        .apply(&format!(
            "expandable_segments:{},thread_cache:False,page_slack:0",
            if paged { "True" } else { "False" }
        ))
        .unwrap();
    let a = DeviceAllocator::new(0, driver.clone(), config).unwrap();
    Run {
        driver,
        a,
        live: Vec::new(),
    }
}

/// Runs the scenario; returns the operations that failed (index, error kind).
fn play(run: &mut Run) -> Vec<(usize, ErrorKind, String)> {
    let mut failed = Vec::new();
    for (i, op) in scenario().into_iter().enumerate() {
        let result = match op {
            Op::Malloc(size, stream) => match run.a.malloc(size, stream) {
                Ok(p) => {
                    run.live.push(Some(p));
                    Ok(())
                }
                Err(e) => {
                    run.live.push(None);
                    Err(e)
                }
            },
            Op::Free(k) => match run.live.get(k).copied().flatten() {
                Some(p) => {
                    let r = run.a.free(p);
                    // A free that failed may have taken the block back all the same (it
                    // is then refused as a double free), or left it live (freed now).
                    match &r {
                        Ok(()) => run.live[k] = None,
                        Err(_) => match run.a.free(p) {
                            Ok(()) => run.live[k] = None,
                            Err(e) if e.kind == ErrorKind::DoubleFree => run.live[k] = None,
                            // Another fault: left for `finish`.
                            Err(_) => {}
                        },
                    }
                    r
                }
                None => Ok(()),
            },
            Op::RecordStream(k, stream) => match run.live.get(k).copied().flatten() {
                Some(p) => run.a.record_stream(p, stream),
                None => Ok(()),
            },
            Op::EmptyCache => run.a.empty_cache(),
        };
        if let Err(e) = result {
            failed.push((i, e.kind, e.message));
        }
        check_stats(run, &format!("after op {i} {op:?}"));
    }
    failed
}

/// Statistics agree with the blocks: allocated == the live blocks, every array's all ==
/// small + large, reserved == what the device holds for ccalloc.
fn check_stats(run: &Run, when: &str) {
    let s = run.a.stats().unwrap();
    let arrays = [
        ("allocation", s.allocation),
        ("segment", s.segment),
        ("active", s.active),
        ("inactive_split", s.inactive_split),
        ("allocated_bytes", s.allocated_bytes),
        ("reserved_bytes", s.reserved_bytes),
        ("active_bytes", s.active_bytes),
        ("inactive_split_bytes", s.inactive_split_bytes),
        ("requested_bytes", s.requested_bytes),
    ];
    for (name, a) in arrays {
        assert_eq!(
            a.0[0].current,
            a.0[1].current + a.0[2].current,
            "{when}: {name} all != small + large"
        );
        assert!(a.0[0].current >= 0, "{when}: {name} negative");
    }
    let segments = run.a.segments().unwrap();
    let (mut live_blocks, mut live_bytes) = (0i64, 0i64);
    for seg in &segments {
        for &(_, size, state) in &seg.blocks {
            if format!("{state:?}") == "Allocated" {
                live_blocks += 1;
                live_bytes += size as i64;
            }
        }
    }
    let live = run.live.iter().flatten().count() as i64;
    assert_eq!(
        live_blocks, live,
        "{when}: allocated blocks != live pointers"
    );
    assert_eq!(s.allocation.all().current, live, "{when}: allocation count");
    assert_eq!(
        s.allocated_bytes.all().current,
        live_bytes,
        "{when}: allocated bytes"
    );
    let held = run.driver.sim.counters(0).bytes_in_use as i64;
    assert_eq!(
        s.reserved_bytes.all().current,
        held,
        "{when}: reserved != held by the device"
    );
}

/// Frees everything left, empties the cache: nothing may stay held.
fn finish(run: &mut Run, what: &str) {
    for p in run.live.iter_mut() {
        if let Some(ptr) = p.take() {
            run.a
                .free(ptr)
                .unwrap_or_else(|e| panic!("{what}: free after: {e}"));
        }
    }
    run.a
        .empty_cache()
        .unwrap_or_else(|e| panic!("{what}: empty_cache after: {e}"));
    check_stats(run, &format!("{what}: at the end"));
    let c = run.driver.sim.counters(0);
    assert_eq!(c.bytes_in_use, 0, "{what}: device memory held: {c:?}");
    assert_eq!(c.live_allocations, 0, "{what}: segments held: {c:?}");
    assert_eq!(
        c.physical_creates, c.physical_releases,
        "{what}: physical memory held: {c:?}"
    );
    assert_eq!(c.live_reservations, 0, "{what}: address ranges held: {c:?}");
    let s = run.a.stats().unwrap();
    assert_eq!(s.reserved_bytes.all().current, 0, "{what}");
    assert_eq!(s.segment.all().current, 0, "{what}");
}

/// Calls of each kind (as in `CALLS`) the scenario made.
type Counts = [u64; 14];

fn run_with(paged: bool, faults: &[(Call, u64)]) -> Counts {
    let what = format!("paged {paged}, faults {faults:?}");
    let mut run = new_run(paged, faults);
    let failed = play(&mut run);
    let counts = CALLS.map(|kind| run.driver.count(kind));
    assert_eq!(
        run.driver.hits().len(),
        faults.len(),
        "{what}: faults not all reached"
    );
    // Only the operation that hit a fault may fail: one per fault at most.
    assert!(failed.len() <= faults.len(), "{what}: failed {failed:?}");
    for (_, kind, message) in &failed {
        assert!(
            matches!(kind, ErrorKind::Driver | ErrorKind::OutOfMemory),
            "{what}: {kind:?} {message}"
        );
    }
    finish(&mut run, &what);
    counts
}

fn enumerate(paged: bool) -> usize {
    let base = run_with(paged, &[]);
    let mut runs = 0;
    for kind in CALLS {
        for n in 1..=base[kind as usize] {
            let counts = run_with(paged, &[(kind, n)]);
            runs += 1;
            // Calls only a failure leads to (the synchronize of a failed event record):
            // each of those fails in turn too.
            for follow in CALLS {
                let f = follow as usize;
                if base[f] == 0 && counts[f] > 0 {
                    for m in 1..=counts[f] {
                        run_with(paged, &[(kind, n), (follow, m)]);
                        runs += 1;
                    }
                }
            }
        }
    }
    runs
}

#[test]
fn every_driver_call_of_the_paged_scenario_may_fail() {
    let runs = enumerate(true);
    assert!(runs > 20, "{runs} runs");
}

#[test]
fn every_driver_call_of_the_plain_scenario_may_fail() {
    let runs = enumerate(false);
    assert!(runs > 10, "{runs} runs");
}

/// The scenarios between them make every kind of call the test enumerates.
#[test]
fn the_scenarios_make_every_kind_of_call() {
    let (paged, plain) = (run_with(true, &[]), run_with(false, &[]));
    // Made only when an event cannot be recorded.
    let failing_record = run_with(false, &[(Call::RecordEvent, 1)]);
    for kind in CALLS {
        let k = kind as usize;
        let extra = if kind == Call::SynchronizeStream {
            failing_record[k]
        } else {
            0
        };
        assert!(paged[k] + plain[k] + extra > 0, "{kind:?} never called");
    }
}

/// A move that releases small chunks and makes their pages anew
/// (`release_chunks_cheaper_made_anew`), while another thread's front holds large blocks
/// among the holes the move takes pages from, with any one of the move's driver calls
/// failing: only the request fails, the statistics stay exact, and everything goes back.
#[test]
fn a_move_that_makes_pages_anew_may_fail_at_any_call_while_fronts_hold_large_blocks() {
    const BLOCKS: usize = 140;
    // Returns the calls of each kind made before the request and by the end, the faults
    // injected, and whether the request failed.
    let play = |faults: &[(Call, u64)]| {
        let sim = Arc::new(SimDriver::new(1, 1 << 30));
        let driver = FaultDriver::new(sim.clone(), faults);
        let a = DeviceAllocator::new(0, driver.clone(), Config::default()).unwrap();
        let counts = || CALLS.map(|c| driver.count(c)).to_vec();
        let blocks: Vec<u64> = (0..BLOCKS)
            .map(|_| a.malloc(2 * MIB, S0).unwrap())
            .collect();
        let before = counts();
        let what = format!("{faults:?}");
        let failed = std::thread::scope(|s| {
            // The holder frees every other block (its front holds the last two), and stays
            // alive while the request is served.
            let (ready_tx, ready) = std::sync::mpsc::channel();
            let (done, done_rx) = std::sync::mpsc::channel::<()>();
            let a = &a;
            let holes = &blocks;
            s.spawn(move || {
                for &p in holes.iter().step_by(2) {
                    a.free(p).unwrap();
                }
                ready_tx.send(()).unwrap();
                let _ = done_rx.recv();
            });
            ready.recv().unwrap();
            let got = a.malloc(128 * MIB, S0);
            let st = a.stats().unwrap();
            let live = (BLOCKS / 2) as i64 + got.is_ok() as i64;
            assert_eq!(st.allocation.all().current, live, "{what}");
            let bytes =
                (BLOCKS as i64 / 2) * 2 * MIB as i64 + got.is_ok() as i64 * 128 * MIB as i64;
            assert_eq!(st.allocated_bytes.all().current, bytes, "{what}");
            assert_eq!(
                st.allocated_bytes.all().peak,
                (BLOCKS as i64 * 2 * MIB as i64).max(bytes),
                "{what}"
            );
            if faults.is_empty() {
                got.as_ref().unwrap();
            }
            drop(done);
            match got {
                Ok(p) => a.free(p).map(|_| false).unwrap(),
                Err(_) => true,
            }
        });
        for &p in blocks.iter().skip(1).step_by(2) {
            a.free(p).unwrap();
        }
        // The fault may hit this release itself: the next one gives back the rest.
        if a.empty_cache().is_err() {
            a.empty_cache().unwrap();
        }
        let st = a.stats().unwrap();
        assert_eq!(st.allocation.all().current, 0, "{what}");
        assert_eq!(st.allocated_bytes.all().current, 0, "{what}");
        assert_eq!(sim.counters(0).bytes_in_use, 0, "{what}: memory given back");
        (before, counts(), driver.hits(), failed)
    };
    let (before, after, _, _) = play(&[]);
    let c = |kind: Call| CALLS.iter().position(|&k| k == kind).unwrap();
    assert!(
        after[c(Call::ReleasePhysical)] > before[c(Call::ReleasePhysical)],
        "the move released chunks to make them anew"
    );
    let (mut faults, mut failed) = (0, 0);
    for kind in [
        Call::CreatePhysical,
        Call::ReleasePhysical,
        Call::Map,
        Call::SetAccess,
        Call::Unmap,
    ] {
        for n in before[c(kind)] + 1..=after[c(kind)] {
            let (_, _, hits, request_failed) = play(&[(kind, n)]);
            faults += hits.len();
            failed += request_failed as usize;
        }
    }
    assert!(
        faults > failed && failed > 0,
        "{faults} faults, {failed} requests failed"
    );
}
