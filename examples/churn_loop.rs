//! Steady small-block churn on the sim device, as the GPU harness's `churn` (2000 live blocks
//! of 256 B-1 MiB, log-uniform; each step frees a random one and allocates a new size), for
//! profilers: `cargo build --release --features sim --example churn_loop && perf record
//! target/release/examples/churn_loop [MAX_BYTES] [LIVE] [THREADS]` (settings from CCALLOC_CONF).
//! With THREADS > 1, each thread churns its own LIVE blocks on its own stream, as the
//! harness's `mt_churn`, and the figure is wall time per step over all threads. STEPS
//! (default 5,000,000 over all threads) sets the run's length; `CCALLOC_SIM_COSTS=h100`
//! makes each driver call take as long as on an H100 (`CallCosts::h100`), as the GPU
//! harness's churn mixed sees it: `churn_loop 268435456 500 1 50000`.
//! `CHURN_PROFILE=FILE` samples the program counter every 200 µs of CPU time (all threads,
//! `SIGPROF`) and writes one offset into the executable per line, for hosts without `perf`:
//! `sort FILE | uniq -c | sort -rn | head -50` then `addr2line -f -C -e churn_loop OFFSET`.
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

/// A sampling profiler on `SIGPROF`: the handler stores the interrupted program counter.
mod sampler {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    const CAPACITY: usize = 1 << 20;
    static SAMPLES: [AtomicU64; CAPACITY] = [const { AtomicU64::new(0) }; CAPACITY];
    static TAKEN: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn on_prof(_: libc::c_int, _: *mut libc::siginfo_t, context: *mut libc::c_void) {
        // SAFETY: the kernel passes a ucontext_t to an SA_SIGINFO handler.
        let pc = unsafe {
            (*(context as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RIP as usize]
        };
        let i = TAKEN.fetch_add(1, Ordering::Relaxed);
        if i < CAPACITY {
            SAMPLES[i].store(pc as u64, Ordering::Relaxed);
        }
    }

    pub fn start() {
        // SAFETY: installs a handler that only stores into statics, then arms the timer.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_prof as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigaction(libc::SIGPROF, &action, std::ptr::null_mut());
            let every = libc::timeval {
                tv_sec: 0,
                tv_usec: 200,
            };
            let timer = libc::itimerval {
                it_interval: every,
                it_value: every,
            };
            libc::setitimer(libc::ITIMER_PROF, &timer, std::ptr::null_mut());
        }
    }

    /// Stops sampling and writes the samples as offsets into the executable's mapping.
    pub fn finish(path: &str) {
        // SAFETY: disarms the timer.
        unsafe {
            let off = libc::itimerval {
                it_interval: libc::timeval {
                    tv_sec: 0,
                    tv_usec: 0,
                },
                it_value: libc::timeval {
                    tv_sec: 0,
                    tv_usec: 0,
                },
            };
            libc::setitimer(libc::ITIMER_PROF, &off, std::ptr::null_mut());
        }
        let exe = std::fs::read_link("/proc/self/exe").unwrap_or_default();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let base = maps
            .lines()
            .find(|l| l.ends_with(&*exe.to_string_lossy()))
            .and_then(|l| u64::from_str_radix(l.split('-').next()?, 16).ok())
            .unwrap_or(0);
        let n = TAKEN.load(Ordering::Relaxed).min(CAPACITY);
        let lines: String = SAMPLES[..n]
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .map(|pc| {
                if pc >= base {
                    format!("{:#x}\n", pc - base)
                } else {
                    "outside\n".into()
                }
            })
            .collect();
        std::fs::write(path, lines).expect("profile written");
    }
}

fn main() {
    let profile = std::env::var("CHURN_PROFILE").ok();
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
    let a = Arc::new(DeviceAllocator::new(0, sim.clone(), Config::from_env().unwrap()).unwrap());
    // Every thread fills its blocks, then all start the timed steps together.
    let barrier = Arc::new(Barrier::new(threads));
    if profile.is_some() {
        sampler::start();
    }
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                churn(&a, StreamId(t as u64), hi, live, steps, t as u64, &barrier)
            })
        })
        .collect();
    let runs: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    if let Some(path) = &profile {
        sampler::finish(path);
    }
    let slowest = runs.iter().map(|r| r.0).max().unwrap_or_default();
    // Counted from the first thread's start: with one thread, exactly the timed steps.
    let (after, before) = (a.stats().unwrap().paging, runs[0].1);
    let paging = after.since(&before);
    let stats = a.stats().unwrap();
    let events = sim.events_recorded();
    // SAFETY: getrusage writes the process's usage into the struct given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    println!(
        "{:.1} ns per step ({threads} threads); peak reserved / peak active {:.3}; page slack {:.3}; {} growths past it; growth {:.1} ms ({} growths, {} moving, {:.1} ms), {} chunks mapped, {} unmapped, {} waits, {:.2} events recorded per 1,000 steps; {} voluntary context switches",
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
        events as f64 * 1000.0 / (steps * threads) as f64,
        usage.ru_nvcsw,
    );
}
