//! Steady small-block churn on the sim device, as the GPU harness's `churn` (2000 live blocks
//! of 256 B-1 MiB, log-uniform; each step frees a random one and allocates a new size), for
//! profilers: `cargo build --release --example churn_loop && perf record
//! target/release/examples/churn_loop [MAX_BYTES] [LIVE] [THREADS]` (settings from CCALLOC_CONF).
//! With THREADS > 1, each thread churns its own LIVE blocks on its own stream, as the
//! harness's `mt_churn`, and the figure is wall time per step over all threads.
use ccalloc::driver::sim::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use std::sync::{Arc, Barrier};
use std::time::Instant;

fn churn(a: &DeviceAllocator, stream: StreamId, hi: f64, live: usize, steps: usize, seed: u64) {
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
    for _ in 0..steps {
        let i = (next() % live as u64) as usize;
        a.free(ptrs[i]).unwrap();
        ptrs[i] = a.malloc(size(next()), stream).unwrap();
    }
    for p in ptrs {
        a.free(p).unwrap();
    }
}

fn main() {
    let mut args = std::env::args().skip(1).map(|s| s.parse::<f64>().ok());
    let hi = args.next().flatten().unwrap_or((1u64 << 20) as f64);
    let live = args.next().flatten().unwrap_or(2000.0) as usize;
    let threads = args.next().flatten().unwrap_or(1.0) as usize;
    let steps: usize = 5_000_000 / threads;
    let sim = Arc::new(SimDriver::new(1, 80 << 30));
    let a = Arc::new(DeviceAllocator::new(0, sim, Config::from_env().unwrap()).unwrap());
    let barrier = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                churn(&a, StreamId(t as u64), hi, live, steps, t as u64);
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for w in workers {
        w.join().unwrap();
    }
    println!(
        "{:.1} ns per step ({threads} threads)",
        start.elapsed().as_nanos() as f64 / (steps * threads) as f64
    );
}
