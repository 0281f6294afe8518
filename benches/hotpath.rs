//! Hot-path benchmarks on the simulated device, the same patterns as the GPU harness
//! (shared/bench/hotpath.cpp): same-size alloc+free pairs, steady churn (small and mixed
//! sizes), several threads each on its own stream, two sharing one, and two taking turns
//! on one (PyTorch's forward and backward: `handoff`).
//! Run: `cargo bench --features sim --bench hotpath`.

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn allocator(conf: &str) -> Arc<DeviceAllocator> {
    let sim = Arc::new(SimDriver::new(1, 80 << 30));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    Arc::new(DeviceAllocator::new(0, sim, config).unwrap())
}

/// Log-uniform sizes, like the harness.
struct Sizes(u64);
impl Sizes {
    fn next(&mut self, lo: f64, hi: f64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let u = (self.0 >> 11) as f64 / (1u64 << 53) as f64;
        (lo.ln() + u * (hi.ln() - lo.ln())).exp().max(1.0) as u64
    }
}

/// An allocator per stream (`per_stream_shards`), with thread fronts.
const SHARDS: (&str, &str) = ("shards", "per_stream_shards:True");
/// One allocator for every stream and thread (`thread_shards:False`; the default gives a
/// thread that starts on a stream of its own a shard).
const ONE_SHARD: (&str, &str) = ("one_shard", "thread_shards:False");

/// The default (paged segments, thread fronts), without the fronts, and plain segments.
fn modes() -> [(&'static str, &'static str); 3] {
    [
        ("paged", ""),
        ("paged_no_front", "thread_cache:False"),
        ("plain", "expandable_segments:False"),
    ]
}

fn pair_same(c: &mut Criterion) {
    let mut group = c.benchmark_group("pair_same");
    group.throughput(Throughput::Elements(1));
    let shards_4k = std::iter::once((SHARDS, 4u64 << 10));
    let all_sizes = modes()
        .into_iter()
        .flat_map(|mode| [4u64 << 10, 1 << 20, 32 << 20, 512 << 20].map(|size| (mode, size)));
    for ((mode, conf), size) in all_sizes.chain(shards_4k) {
        let a = allocator(conf);
        let s = StreamId(0);
        group.bench_with_input(BenchmarkId::new(mode, size), &size, |b, &size| {
            b.iter(|| {
                let p = a.malloc(black_box(size), s).unwrap();
                a.free(p).unwrap();
            })
        });
    }
    // `paged_front_out`: the thread's front first hands out as many blocks as it has slots,
    // which then stay live (a job's weights or optimizer state allocated where temporaries
    // of their sizes were just freed); the pair loop must still be served by the front.
    let a = allocator("");
    let s = StreamId(0);
    let _kept: Vec<u64> = (0..16u64)
        .map(|i| {
            let size = 8192 * (i + 2);
            a.free(a.malloc(size, s).unwrap()).unwrap();
            a.malloc(size, s).unwrap()
        })
        .collect();
    group.bench_function(BenchmarkId::new("paged_front_out", 4096), |b| {
        b.iter(|| {
            let p = a.malloc(black_box(4096), s).unwrap();
            a.free(p).unwrap();
        })
    });
    group.finish();
}

/// The most steps a churn plan draws; longer runs replay it from the start. A sample of
/// criterion's default measurement takes well under this many steps, so no pattern repeats:
/// a plan that repeats turns the random walk into a periodic workload whose live high-water
/// mark stops rising, and mixed churn then moves pages every cycle (with a 65,536-step plan,
/// 810-850 ns a step against 525).
const PLAN_STEPS: usize = 1 << 20;

/// A churn drawn before the clock starts, as the GPU harness draws it (so that neither
/// times its random number generator): the initial sizes of `live` blocks, then per step
/// which block to replace and its new size.
struct ChurnPlan {
    initial: Vec<u64>,
    steps: Vec<(usize, u64)>,
}

impl ChurnPlan {
    /// `live` blocks of up to `hi` bytes and `steps` steps (at most `PLAN_STEPS`).
    fn new(live: usize, hi: f64, seed: u64, steps: usize) -> Self {
        let mut sizes = Sizes(seed);
        let initial = (0..live).map(|_| sizes.next(256.0, hi)).collect();
        let steps = (0..steps.clamp(1, PLAN_STEPS))
            .map(|k| {
                let i = (sizes.next(1.0, 1e9) as usize + k) % live;
                (i, sizes.next(256.0, hi))
            })
            .collect();
        Self { initial, steps }
    }
}

/// Keeps the plan's blocks live; each step frees one and allocates its new size.
fn churn_steps(a: &DeviceAllocator, stream: StreamId, plan: &ChurnPlan, steps: u64) -> Duration {
    let mut ptrs: Vec<u64> = plan
        .initial
        .iter()
        .map(|&size| a.malloc(size, stream).unwrap())
        .collect();
    let start = Instant::now();
    for k in 0..steps as usize {
        let (i, size) = plan.steps[k % plan.steps.len()];
        a.free(ptrs[i]).unwrap();
        ptrs[i] = a.malloc(size, stream).unwrap();
    }
    let took = start.elapsed();
    for p in ptrs {
        a.free(p).unwrap();
    }
    took
}

fn churn(c: &mut Criterion) {
    let mut group = c.benchmark_group("churn");
    group.throughput(Throughput::Elements(1));
    for (mode, conf) in modes() {
        // `mixed_cycle`: mixed churn as a periodic workload (a training loop's shape), the
        // same 65,536 steps over and over: its live high-water mark stops rising, so paged
        // segments move pages in every cycle (paging.md, Limitations).
        for (name, live, hi, steps) in [
            ("small", 2000usize, (1u64 << 20) as f64, PLAN_STEPS),
            ("mixed", 500, (256u64 << 20) as f64, PLAN_STEPS),
            ("mixed_cycle", 500, (256u64 << 20) as f64, 1 << 16),
        ] {
            let a = allocator(conf);
            let plan = ChurnPlan::new(live, hi, 1, steps);
            group.bench_function(BenchmarkId::new(mode, name), |b| {
                b.iter_custom(|iters| churn_steps(&a, StreamId(0), &plan, iters))
            });
        }
    }
    group.finish();
}

/// Same-size 4 KiB alloc+free pairs on `stream`.
fn pair_steps(a: &DeviceAllocator, stream: StreamId, steps: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..steps {
        let p = a.malloc(black_box(4 << 10), stream).unwrap();
        a.free(p).unwrap();
    }
    start.elapsed()
}

/// Wall time per step over all threads, each churning small blocks on its own stream, and
/// two threads sharing one stream (PyTorch's forward on the Python thread and backward on
/// the autograd thread); also with an allocator per stream (`per_stream_shards`) and with
/// one for all (`thread_shards:False`; by default each thread here gets one). `pair_2`:
/// two threads, each on its own stream, alloc+free 4 KiB pairs (the thread fronts' case).
fn threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("threads");
    group.throughput(Throughput::Elements(1));
    for (mode, conf) in modes().into_iter().chain([SHARDS, ONE_SHARD]) {
        for (label, n, one_stream, pairs) in [
            ("1", 1usize, false, false),
            ("4", 4, false, false),
            ("8", 8, false, false),
            ("2_one_stream", 2, true, false),
            ("pair_2", 2, false, true),
        ] {
            let a = allocator(conf);
            group.bench_function(BenchmarkId::new(mode, label), |b| {
                b.iter_custom(|iters| {
                    let per_thread = (iters / n as u64).max(1);
                    let barrier = Arc::new(Barrier::new(n + 1));
                    let handles: Vec<_> = (0..n)
                        .map(|t| {
                            let (a, barrier) = (a.clone(), barrier.clone());
                            std::thread::spawn(move || {
                                let stream = StreamId(100 + if one_stream { 0 } else { t as u64 });
                                let steps = per_thread as usize;
                                let plan =
                                    ChurnPlan::new(500, (1u64 << 20) as f64, t as u64 + 1, steps);
                                barrier.wait();
                                if pairs {
                                    return pair_steps(&a, stream, per_thread);
                                }
                                churn_steps(&a, stream, &plan, per_thread)
                            })
                        })
                        .collect();
                    barrier.wait();
                    let start = Instant::now();
                    for h in handles {
                        h.join().unwrap();
                    }
                    start.elapsed()
                })
            });
        }
    }
    group.finish();
}

/// `took` for `done` blocks, scaled to `iters` (criterion's count).
fn per_iteration(took: Duration, done: u64, iters: u64) -> Duration {
    took.mul_f64(iters as f64 / done.max(1) as f64)
}

/// The sizes of one "step" of `handoff`: a training step's activations, small and large.
fn step_sizes() -> Vec<u64> {
    let mut sizes = Sizes(7);
    (0..64)
        .map(|_| sizes.next(512.0, (8u64 << 20) as f64))
        .collect()
}

/// One `handoff` run on two threads: `a` (none: the hand-off alone, the floor) allocates a
/// step's blocks on one thread, the other frees them in reverse while the first waits.
fn handoff_steps(a: Option<Arc<DeviceAllocator>>, sizes: &[u64], iters: u64) -> Duration {
    let steps = (iters / sizes.len() as u64).max(1);
    let stream = StreamId(0);
    let (to_freer, from_maker) = std::sync::mpsc::channel::<Vec<u64>>();
    let (to_maker, from_freer) = std::sync::mpsc::channel::<()>();
    let freer = {
        let a = a.clone();
        std::thread::spawn(move || {
            while let Ok(blocks) = from_maker.recv() {
                for p in blocks.into_iter().rev() {
                    if let Some(a) = &a {
                        a.free(p).unwrap();
                    }
                    black_box(p);
                }
                if to_maker.send(()).is_err() {
                    break;
                }
            }
        })
    };
    let start = Instant::now();
    for _ in 0..steps {
        let blocks: Vec<u64> = sizes
            .iter()
            .map(|&s| match &a {
                Some(a) => a.malloc(s, stream).unwrap(),
                None => black_box(s),
            })
            .collect();
        to_freer.send(blocks).unwrap();
        from_freer.recv().unwrap();
    }
    let took = start.elapsed();
    drop(to_freer);
    freer.join().unwrap();
    per_iteration(took, steps * sizes.len() as u64, iters)
}

/// PyTorch's forward and backward on one stream: one thread allocates a step's blocks, then
/// another frees them (autograd's thread, while the first waits), and so on; `floor` is the
/// hand-off alone, to subtract. `1`: one thread makes the same calls in the same order. Per
/// block (one malloc and one free).
fn handoff(c: &mut Criterion) {
    let mut group = c.benchmark_group("handoff");
    group.throughput(Throughput::Elements(1));
    let sizes = step_sizes();
    group.bench_function(BenchmarkId::new("floor", "2_threads"), |b| {
        b.iter_custom(|iters| handoff_steps(None, &sizes, iters))
    });
    for (mode, conf) in modes() {
        let a = allocator(conf);
        group.bench_function(BenchmarkId::new(mode, "1"), |b| {
            b.iter_custom(|iters| {
                let steps = (iters / sizes.len() as u64).max(1);
                let start = Instant::now();
                for _ in 0..steps {
                    let blocks: Vec<u64> = sizes
                        .iter()
                        .map(|&s| a.malloc(s, StreamId(0)).unwrap())
                        .collect();
                    for p in blocks.into_iter().rev() {
                        a.free(p).unwrap();
                    }
                }
                per_iteration(start.elapsed(), steps * sizes.len() as u64, iters)
            })
        });
        group.bench_function(BenchmarkId::new(mode, "2_threads"), |b| {
            b.iter_custom(|iters| handoff_steps(Some(a.clone()), &sizes, iters))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2)).sample_size(20);
    targets = pair_same, churn, threads, handoff
}
criterion_main!(benches);
