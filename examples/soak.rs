//! A soak test through the C API: `soak [MINUTES] [THREADS]` (defaults 1 and 4) runs mixed
//! traffic for MINUTES: THREADS workers malloc and free blocks of mixed sizes (1 B to 64 MiB,
//! log-uniform) on several streams and record them on others, while a controller thread
//! empties the cache, drops the memory fraction to cause OOM storms, cycles
//! shutdown/init (the workers drain first) and forks children that must be refused with the
//! fork error. At the end every block is freed, the statistics' invariants are checked, the
//! cache is emptied (nothing may stay reserved) and ccalloc is shut down. It prints one line:
//!
//!     soak: 1.0 min, backend sim, 4 threads: operations N, OOMs N,
//!     forks N, cycles N, failures: 0
//!
//! and exits non-zero on any failure (the first ones are printed on stderr). Only the C API
//! is used: run it on the sim
//! (`CCALLOC_BACKEND=sim cargo run --release --features sim --example soak 1`) or on a GPU
//! (`CCALLOC_BACKEND=cuda`, e.g. under compute-sanitizer). On CUDA the streams are the valid
//! special handles (NULL, the legacy stream 0x1, the per-thread stream 0x2)
//! and no host writes touch device memory; on the sim, blocks get a canary checked at free.
use ccalloc::capi::ccalloc_status::{self, *};
use ccalloc::capi::*;
use ccalloc::capi::{ccalloc_stat_array, ccalloc_stats, cudaStream_t};
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// Blocks a worker keeps live at most.
const LIVE: usize = 48;

#[derive(Default)]
struct Tally {
    ops: AtomicU64,
    ooms: AtomicU64,
    forks: AtomicU64,
    cycles: AtomicU64,
    failures: AtomicU64,
    messages: Mutex<Vec<String>>,
}

impl Tally {
    fn fail(&self, what: String) {
        self.failures.fetch_add(1, SeqCst);
        let mut messages = self.messages.lock().unwrap();
        if messages.len() < 20 {
            messages.push(what);
        }
    }

    /// Counts a call; a status other than OK (or OOM where `oom_ok`) is a failure.
    fn check(&self, what: &str, status: ccalloc_status, oom_ok: bool) -> bool {
        self.ops.fetch_add(1, SeqCst);
        match status {
            CCALLOC_OK => true,
            CCALLOC_OUT_OF_MEMORY if oom_ok => {
                self.ooms.fetch_add(1, SeqCst);
                false
            }
            other => {
                self.fail(format!("{what}: {other:?}: {}", last_error()));
                false
            }
        }
    }
}

fn last_error() -> String {
    // SAFETY: this thread's NUL-terminated last error.
    unsafe { CStr::from_ptr(ccalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Log-uniform from 1 B to 64 MiB.
    fn size(&mut self) -> usize {
        let bits = (self.next() % 2700) as f64 / 100.0;
        (2f64.powf(bits) as usize).max(1)
    }
}

/// What the run shares between threads.
struct Shared {
    sim: bool,
    streams: Vec<cudaStream_t>,
    stop: AtomicBool,
    /// Set by the controller: workers free everything and wait at `parked`.
    drain: AtomicBool,
    parked: Barrier,
    resumed: Barrier,
    tally: Tally,
}

// SAFETY: the stream handles are plain values passed to ccalloc, never dereferenced here.
unsafe impl Sync for Shared {}

struct Block {
    ptr: usize,
    size: usize,
    tag: u8,
}

fn canary_len(size: usize) -> usize {
    size.min(64)
}

fn worker(shared: &Shared, seed: u64) {
    let t = &shared.tally;
    let mut rng = Rng(seed | 1);
    let mut live: Vec<Block> = Vec::new();
    let free = |b: Block, t: &Tally| {
        if shared.sim {
            // SAFETY: a live sim block of at least `canary_len` bytes, host-backed.
            let bytes =
                unsafe { std::slice::from_raw_parts(b.ptr as *const u8, canary_len(b.size)) };
            if bytes.iter().any(|&x| x != b.tag) {
                t.fail(format!("block {:#x} was overwritten", b.ptr));
            }
        }
        t.check("free", ccalloc_free(b.ptr as *mut c_void, 0), false);
    };
    while !shared.stop.load(SeqCst) {
        if shared.drain.load(SeqCst) {
            for b in live.drain(..) {
                free(b, t);
            }
            shared.parked.wait();
            shared.resumed.wait();
            continue;
        }
        match rng.below(10) {
            0..=4 if live.len() < LIVE => {
                let size = rng.size();
                let stream = shared.streams[rng.below(shared.streams.len())];
                let mut p = std::ptr::null_mut();
                if t.check("malloc", ccalloc_malloc(size, 0, stream, &mut p), true) {
                    let tag = rng.next() as u8;
                    if shared.sim {
                        // SAFETY: a fresh sim block of `size` bytes, host-backed.
                        unsafe { std::ptr::write_bytes(p as *mut u8, tag, canary_len(size)) };
                    }
                    live.push(Block {
                        ptr: p as usize,
                        size,
                        tag,
                    });
                }
            }
            5 if !live.is_empty() => {
                let b = &live[rng.below(live.len())];
                let stream = shared.streams[rng.below(shared.streams.len())];
                let status = ccalloc_record_stream(b.ptr as *mut c_void, 0, stream);
                t.check("record_stream", status, false);
            }
            _ if !live.is_empty() => {
                let i = rng.below(live.len());
                free(live.swap_remove(i), t);
            }
            _ => {}
        }
    }
    for b in live.drain(..) {
        free(b, t);
    }
}

/// Forks a child that must be refused with the fork error; true if it was.
fn fork_child() -> bool {
    // SAFETY: the child makes one ccalloc call and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut p = std::ptr::null_mut();
        let status = ccalloc_malloc(MIB, 0, std::ptr::null_mut(), &mut p);
        let code = match status {
            CCALLOC_DRIVER_UNAVAILABLE if last_error().contains("fork") => 0,
            CCALLOC_OK => 1,
            _ => 2,
        };
        // SAFETY: leaves the child without running the parent's exit handlers.
        unsafe {
            libc::alarm(0);
            libc::_exit(code)
        }
    }
    if pid < 0 {
        return false;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        }
        if r < 0 || Instant::now() > deadline {
            // SAFETY: our own child, hung.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn controller(shared: &Shared, deadline: Instant, total: u64) {
    let t = &shared.tally;
    let mut rng = Rng(0x5eed);
    // An OOM storm's limit: 256 MiB of the device.
    let low = ((256 * MIB) as f64 / total as f64).min(1.0);
    let mut tick = 0u64;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        tick += 1;
        match tick % 25 {
            3 | 13 => {
                t.check("empty_cache", ccalloc_empty_cache(-1), false);
            }
            5 => {
                t.check(
                    "set_memory_fraction",
                    ccalloc_set_memory_fraction(low, 0),
                    false,
                );
            }
            9 => {
                t.check(
                    "set_memory_fraction",
                    ccalloc_set_memory_fraction(1.0, 0),
                    false,
                );
            }
            17 => {
                t.forks.fetch_add(1, SeqCst);
                if !fork_child() {
                    t.fail("a forked child was not refused with the fork error".into());
                }
            }
            21 => {
                // A shutdown/init cycle: the workers free everything first.
                shared.drain.store(true, SeqCst);
                shared.parked.wait();
                shared.drain.store(false, SeqCst);
                if t.check("shutdown", ccalloc_shutdown(), false) {
                    t.check("init", ccalloc_init(), false);
                    t.cycles.fetch_add(1, SeqCst);
                }
                shared.resumed.wait();
            }
            _ if rng.below(4) == 0 => {
                let mut stats = std::mem::MaybeUninit::<ccalloc_stats>::uninit();
                t.check("get_stats", ccalloc_get_stats(0, stats.as_mut_ptr()), false);
            }
            _ => {}
        }
    }
    t.check(
        "set_memory_fraction",
        ccalloc_set_memory_fraction(1.0, 0),
        false,
    );
}

fn check_array(t: &Tally, name: &str, a: &ccalloc_stat_array) {
    for (what, all, small, large) in [
        (
            "current",
            a.all.current,
            a.small_pool.current,
            a.large_pool.current,
        ),
        (
            "allocated",
            a.all.allocated,
            a.small_pool.allocated,
            a.large_pool.allocated,
        ),
        ("freed", a.all.freed, a.small_pool.freed, a.large_pool.freed),
    ] {
        if all != small + large {
            t.fail(format!(
                "{name}.{what}: all {all} != small {small} + large {large}"
            ));
        }
    }
    if a.all.current < 0 || a.all.peak < a.all.current {
        t.fail(format!(
            "{name}: current {} peak {}",
            a.all.current, a.all.peak
        ));
    }
}

/// Every block is free: the statistics must say so, and once the cache is emptied nothing
/// may stay reserved.
fn final_checks(shared: &Shared) {
    let t = &shared.tally;
    let mut out = std::mem::MaybeUninit::<ccalloc_stats>::uninit();
    if !t.check("get_stats", ccalloc_get_stats(0, out.as_mut_ptr()), false) {
        return;
    }
    // SAFETY: written by the successful call.
    let s = unsafe { out.assume_init() };
    for (name, a) in s.arrays() {
        check_array(t, name, a);
    }
    if s.allocation.all.current != 0 || s.allocated_bytes.all.current != 0 {
        t.fail(format!(
            "all freed, yet {} allocations ({} bytes) counted",
            s.allocation.all.current, s.allocated_bytes.all.current
        ));
    }
    if s.allocated_bytes.all.allocated - s.allocated_bytes.all.freed != 0 {
        t.fail("allocated bytes' totals do not balance".into());
    }
    t.check("empty_cache", ccalloc_empty_cache(-1), false);
    let mut out = std::mem::MaybeUninit::<ccalloc_stats>::uninit();
    if t.check("get_stats", ccalloc_get_stats(0, out.as_mut_ptr()), false) {
        // SAFETY: written by the successful call.
        let s = unsafe { out.assume_init() };
        if s.reserved_bytes.all.current != 0 {
            t.fail(format!(
                "{} bytes reserved after emptying the cache",
                s.reserved_bytes.all.current
            ));
        }
    }
    if shared.sim {
        let mut bytes = 0;
        t.check(
            "sim_device_bytes",
            ccalloc_sim_device_bytes(0, &mut bytes),
            false,
        );
        if bytes != 0 {
            t.fail(format!("the sim device still hands out {bytes} bytes"));
        }
    }
    t.check("shutdown", ccalloc_shutdown(), false);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let minutes: f64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1.0);
    let threads: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(4).max(1);
    if ccalloc_init() != CCALLOC_OK {
        eprintln!("soak: ccalloc_init failed: {}", last_error());
        std::process::exit(2);
    }
    let mut name = std::ptr::null();
    assert_eq!(ccalloc_backend(&mut name), CCALLOC_OK);
    // SAFETY: a static NUL-terminated string.
    let backend = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let sim = backend == "sim";
    let mut total = 0;
    assert_eq!(ccalloc_device_total_memory(0, &mut total), CCALLOC_OK);
    // Valid on CUDA: NULL, the legacy stream and the per-thread stream; more on the sim.
    let mut streams: Vec<cudaStream_t> = vec![std::ptr::null_mut(), 1 as _, 2 as _];
    if sim {
        streams.extend((1..6).map(|s| (s * 0x1000) as cudaStream_t));
    }
    let shared = Shared {
        sim,
        streams,
        stop: AtomicBool::new(false),
        drain: AtomicBool::new(false),
        parked: Barrier::new(threads + 1),
        resumed: Barrier::new(threads + 1),
        tally: Tally::default(),
    };
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(minutes * 60.0);
    let seeds = AtomicUsize::new(1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            let seed = seeds.fetch_add(1, SeqCst) as u64 * 0x9E37_79B9_7F4A_7C15;
            let shared = &shared;
            s.spawn(move || worker(shared, seed));
        }
        controller(&shared, deadline, total);
        shared.stop.store(true, SeqCst);
    });
    final_checks(&shared);
    let t = &shared.tally;
    let failures = t.failures.load(SeqCst);
    for m in t.messages.lock().unwrap().iter() {
        eprintln!("soak: failure: {m}");
    }
    println!(
        "soak: {:.1} min, backend {backend}, {threads} threads: operations {}, OOMs {}, \
         forks {}, cycles {}, failures: {failures}",
        started.elapsed().as_secs_f64() / 60.0,
        t.ops.load(SeqCst),
        t.ooms.load(SeqCst),
        t.forks.load(SeqCst),
        t.cycles.load(SeqCst),
    );
    std::process::exit(if failures == 0 { 0 } else { 1 });
}
