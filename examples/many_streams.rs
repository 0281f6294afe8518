//! One 1-byte allocation on each of N streams (paged segments unless
//! `CCALLOC_CONF=expandable_segments:False`): the time, the host's peak memory
//! and the driver's work per stream.
//! `cargo run --release --features sim --example many_streams -- 2000`
use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let streams: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(500);
    let sim = Arc::new(SimDriver::new(1, 80 << 30));
    let a = DeviceAllocator::new(0, sim.clone(), Config::from_env().unwrap()).unwrap();
    let start = Instant::now();
    let ptrs: Vec<_> = (0..streams)
        .map(|s| a.malloc(1, StreamId(s + 1)).unwrap())
        .collect();
    let took = start.elapsed();
    let stats = a.stats().unwrap();
    let c = sim.counters(0);
    println!(
        "{streams} streams: {:.3} s, reserved {} MiB, maps {}, unmaps {}, reclaim steps {}",
        took.as_secs_f64(),
        stats.reserved_bytes.all().current >> 20,
        c.maps,
        c.unmaps,
        stats.paging.reclaim_steps
    );
    for p in ptrs {
        a.free(p).unwrap();
    }
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        for line in status.lines().filter(|l| l.starts_with("VmHWM")) {
            println!("{line}");
        }
    }
}
