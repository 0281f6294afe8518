//! The same-size loop through the PyTorch entry points (`ccalloc_torch_alloc`/`free`), as
//! the GPU harness calls them, on the sim device: what the C boundary adds to `pair_loop`.
//! `CCALLOC_BACKEND=sim cargo run --release --features sim --example ffi_pair_loop [SIZE] [ITERS]`.
use ccalloc::capi::{ccalloc_torch_alloc, ccalloc_torch_free};
use std::time::Instant;

fn main() {
    let size: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let iters: u64 = match std::env::args().nth(2) {
        None => 20_000_000,
        Some(text) => text
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| panic!("ITERS {text:?} is not a count of at least 1")),
    };
    let stream = std::ptr::null_mut();
    let start = Instant::now();
    for _ in 0..iters {
        let p = ccalloc_torch_alloc(std::hint::black_box(size), 0, stream);
        ccalloc_torch_free(p, size, 0, stream);
    }
    println!(
        "{:.1} ns per pair",
        start.elapsed().as_nanos() as f64 / iters as f64
    );
}
