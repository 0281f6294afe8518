//! A same-size alloc+free loop on the sim device, for profilers:
//! `cargo build --release --features sim --example pair_loop &&
//! perf record target/release/examples/pair_loop [SIZE]`. With `PAIR_HELPER=1`, a helper
//! thread first allocates on a stream of its own, as a batch prefetcher does: with the
//! default settings the device then has a second shard beside the loop's.
use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let size: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let iters: u64 = 20_000_000;
    let sim = Arc::new(SimDriver::new(1, 80 << 30));
    let a = Arc::new(DeviceAllocator::new(0, sim, Config::from_env().unwrap()).unwrap());
    let p = a.malloc(size, StreamId(0)).unwrap();
    a.free(p).unwrap();
    if std::env::var("PAIR_HELPER").is_ok_and(|v| v == "1") {
        let a = a.clone();
        std::thread::spawn(move || {
            let p = a.malloc(4096, StreamId(1)).unwrap();
            a.free(p).unwrap();
        })
        .join()
        .unwrap();
    }
    let start = Instant::now();
    for _ in 0..iters {
        let p = a.malloc(std::hint::black_box(size), StreamId(0)).unwrap();
        a.free(p).unwrap();
    }
    println!(
        "{:.1} ns per pair ({} shards)",
        start.elapsed().as_nanos() as f64 / iters as f64,
        a.shards_made()
    );
}
