//! The GPU hot-path harness (`shared/bench/hotpath.cpp` as `hotpath.py` runs it) on the sim
//! device, through the PyTorch entry points, in the same order: pairs of 4 KiB, 1 MiB,
//! 32 MiB and 512 MiB, small churn, mixed churn, then 1, 4 and 8 threads churning on their
//! own streams. Each phase finds what the earlier ones left, as on the GPU. Prints ns per
//! pair or step. `CCALLOC_BACKEND=sim CCALLOC_SIM_COSTS=h100 cargo run --release --features
//! sim --example harness_sim` (settings from CCALLOC_CONF; the sim's driver calls cost what an H100's do).
use ccalloc::capi::cudaStream_t;
use ccalloc::capi::{ccalloc_torch_alloc, ccalloc_torch_free};
use std::ffi::c_void;
use std::time::Instant;

type Stream = cudaStream_t;

/// xorshift, and a log-uniform size in [lo, hi).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn size(&mut self, lo: f64, hi: f64) -> usize {
        let unit = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (lo.ln() + unit * (hi.ln() - lo.ln())).exp() as usize
    }
}

fn alloc(size: usize, stream: Stream) -> *mut c_void {
    ccalloc_torch_alloc(size, 0, stream)
}

fn pair(size: usize, iters: u64) -> f64 {
    let stream = std::ptr::null_mut();
    for _ in 0..100 {
        ccalloc_torch_free(alloc(size, stream), size, 0, stream);
    }
    let start = Instant::now();
    for _ in 0..iters {
        let p = alloc(std::hint::black_box(size), stream);
        ccalloc_torch_free(p, size, 0, stream);
    }
    start.elapsed().as_nanos() as f64 / iters as f64
}

fn churn(live: usize, steps: usize, lo: f64, hi: f64, seed: u64, stream: Stream) -> f64 {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ seed);
    let mut blocks: Vec<(*mut c_void, usize)> = (0..live)
        .map(|_| {
            let n = rng.size(lo, hi);
            (alloc(n, stream), n)
        })
        .collect();
    let start = Instant::now();
    for _ in 0..steps {
        let i = (rng.next() % live as u64) as usize;
        ccalloc_torch_free(blocks[i].0, blocks[i].1, 0, stream);
        let n = rng.size(lo, hi);
        blocks[i] = (alloc(n, stream), n);
    }
    let took = start.elapsed().as_nanos() as f64 / steps as f64;
    for (p, n) in blocks {
        ccalloc_torch_free(p, n, 0, stream);
    }
    took
}

/// `threads` threads, each churning small blocks on its own stream; wall ns per step over
/// all of them (each thread's timed steps; the slowest sets the wall).
fn mt_churn(threads: usize, live: usize, steps: usize) -> f64 {
    let slowest = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let stream = (0x1000 * (t + 1)) as Stream;
                    let per_step =
                        churn(live, steps, 256.0, (1 << 20) as f64, t as u64 + 1, stream);
                    per_step * steps as f64
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap())
            .fold(0.0, f64::max)
    });
    slowest / (threads * steps) as f64
}

fn main() {
    for size in [4096usize, 1 << 20, 32 << 20, 512 << 20] {
        println!("pair {size}: {:.1} ns", pair(size, 200_000));
    }
    let null = std::ptr::null_mut();
    println!(
        "churn small: {:.1} ns",
        churn(2000, 200_000, 256.0, (1 << 20) as f64, 1, null)
    );
    println!(
        "churn mixed: {:.1} ns",
        churn(500, 50_000, 256.0, (256 << 20) as f64, 2, null)
    );
    for threads in [1, 4, 8] {
        println!("mt{threads}: {:.1} ns", mt_churn(threads, 1000, 50_000));
    }
}
