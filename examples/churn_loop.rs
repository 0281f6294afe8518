//! Steady small-block churn on the sim device, as the GPU harness's `churn` (2000 live blocks
//! of 256 B-1 MiB, log-uniform; each step frees a random one and allocates a new size), for
//! profilers: `cargo build --release --features sim --example churn_loop && perf record
//! target/release/examples/churn_loop [MAX_BYTES] [LIVE] [THREADS]` (settings from CCALLOC_CONF).
//! With THREADS > 1, each thread churns its own LIVE blocks on its own stream, as the
//! harness's `mt_churn`, and the figure is wall time per step over all threads. STEPS
//! (default 5,000,000 over all threads) sets the run's length; `CCALLOC_SIM_COSTS=h100`
//! makes each driver call take as long as on an H100 (`CallCosts::h100`), as the GPU
//! harness's churn mixed sees it: `churn_loop 268435456 500 1 50000`.
use ccalloc::{CallCosts, SimDriver};
use ccalloc::{Config, DeviceAllocator, PagingCounters, StreamId};
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// Returns how long the steps took (the fill and the final frees are not timed, as in the
/// harness), and the paging counters when they started.
fn churn(
    a: &DeviceAllocator,
    stream: StreamId,
    hi: f64,
    live: usize,
    steps: usize,
    seed: u64,
    barrier: &Barrier,
) -> (std::time::Duration, PagingCounters) {
    let mut seed = 0x9E3779B97F4A7C15u64 ^ seed;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (lo_ln, hi_ln) = (256f64.ln(), hi.ln());
    let size =
        |r: u64| (lo_ln + (r >> 11) as f64 / (1u64 << 53) as f64 * (hi_ln - lo_ln)).exp() as u64;
    let mut ptrs: Vec<u64> = (0..live)
        .map(|_| a.malloc(size(next()), stream).unwrap())
        .collect();
    barrier.wait();
    let before = a.stats().unwrap().paging;
    let start = Instant::now();
    for _ in 0..steps {
        let i = (next() % live as u64) as usize;
        a.free(ptrs[i]).unwrap();
        ptrs[i] = a.malloc(size(next()), stream).unwrap();
    }
    let took = start.elapsed();
    for p in ptrs {
        a.free(p).unwrap();
    }
    (took, before)
}

fn main() {
    let mut args = std::env::args().skip(1).map(|s| s.parse::<f64>().ok());
    let hi = args.next().flatten().unwrap_or((1u64 << 20) as f64);
    let live = args.next().flatten().unwrap_or(2000.0) as usize;
    let threads = args.next().flatten().unwrap_or(1.0) as usize;
    let steps = args.next().flatten().unwrap_or(5e6) as usize / threads;
    let mut sim = SimDriver::new(1, 80 << 30);
    if std::env::var("CCALLOC_SIM_COSTS").is_ok_and(|v| v == "h100") {
        sim = sim.with_call_costs(CallCosts::h100());
    }
    let sim = Arc::new(sim);
    let a = Arc::new(DeviceAllocator::new(0, sim, Config::from_env().unwrap()).unwrap());
    // Every thread fills its blocks, then all start the timed steps together.
    let barrier = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                churn(&a, StreamId(t as u64), hi, live, steps, t as u64, &barrier)
            })
        })
        .collect();
    let runs: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let slowest = runs.iter().map(|r| r.0).max().unwrap_or_default();
    // Counted from the first thread's start: with one thread, exactly the timed steps.
    let (after, before) = (a.stats().unwrap().paging, runs[0].1);
    let paging = after.since(&before);
    let stats = a.stats().unwrap();
    println!(
        "{:.1} ns per step ({threads} threads); peak reserved / peak active {:.3}; page slack {:.3}; {} growths past it; growth {:.1} ms ({} growths, {} moving, {:.1} ms), {} chunks mapped, {} unmapped, {} waits",
        slowest.as_nanos() as f64 / (steps * threads) as f64,
        stats.reserved_bytes.all().peak as f64 / stats.active_bytes.all().peak as f64,
        a.page_slack().unwrap(),
        paging.growths_past_slack,
        paging.growth_ns as f64 / 1e6,
        paging.growths,
        paging.moving_growths,
        paging.moving_ns as f64 / 1e6,
        paging.chunks_mapped,
        paging.chunks_unmapped,
        paging.host_waits,
    );
}
