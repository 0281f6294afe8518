//! A same-size alloc+free loop on the sim device, for profilers:
//! `cargo build --release --features sim --example pair_loop &&
//! perf record target/release/examples/pair_loop`.
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
    let a = DeviceAllocator::new(0, sim, Config::from_env().unwrap()).unwrap();
    let start = Instant::now();
    for _ in 0..iters {
        let p = a.malloc(std::hint::black_box(size), StreamId(0)).unwrap();
        a.free(p).unwrap();
    }
    println!(
        "{:.1} ns per pair",
        start.elapsed().as_nanos() as f64 / iters as f64
    );
}
