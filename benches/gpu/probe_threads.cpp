/* The harness's mt_churn (each of T threads churns 1000 live blocks of log-uniform
 * 256 B-1 MiB on a stream of its own: free a random one, allocate a new size) straight
 * through ccalloc's PyTorch entry points, without PyTorch, on whichever backend
 * CCALLOC_BACKEND names: run it on the CUDA driver and on the sim in one process layout to
 * tell the allocator's own scaling from the driver's. Prints wall ns per step over all
 * threads for each thread count, as the harness does. Build and run on the GPU machine:
 *   g++ -O2 -pthread -Iinclude -I$CUDA_HOME/include -o /tmp/probe_threads \
 *       benches/gpu/probe_threads.cpp -Lgpu -lccalloc -L$CUDA_HOME/lib64 -lcudart
 *   LD_LIBRARY_PATH=gpu /tmp/probe_threads [STEPS_PER_THREAD] [THREADS...]
 * (settings from CCALLOC_CONF; with CCALLOC_BACKEND=sim no CUDA stream is made).
 * PROBE_PRE_MIXED=1 first runs, on the main thread, what hotpath.py runs before its thread
 * columns: small churn (2000 live, 256 B-1 MiB) and mixed churn (500 live, 256 B-256 MiB),
 * 50,000 steps each, all freed after; the thread runs then start with that cache held.
 * PROBE_PAIRS=SIZE instead times 200,000 alloc+free pairs of SIZE bytes on the main thread,
 * first alone, then after a helper thread has allocated on a stream of its own (a batch
 * prefetcher: with the default settings, a second shard).
 * PROBE_PAIR_WINDOWS=N with PROBE_PAIRS instead times N windows of 100,000 pairs, each
 * followed by a control loop without the allocator: whether a slow process is slow from
 * its start (the process's own) or in some windows, with the control (the host's).
 * PROBE_ONE_STREAM=1 has every thread churn on one stream (PyTorch's forward and autograd
 * threads share the current stream): two threads should do at least one thread's work.
 * PROBE_PHASES=N (implies one stream) has the threads take turns instead, N steps each:
 * PyTorch's forward and autograd threads, of which one waits while the other runs.
 * PROBE_CPUS=a,b,... pins thread t of each run to CPU number t modulo the list's length, and
 * PROBE_MAIN_CPU=c the main thread (which spins while the run is timed, as the harness's does):
 * whether threads sharing a core's hyperthreads, or the main thread's spin, set the figures.
 * After each run: the timed steps' growths (moving ones) and growth ms, summed over the
 * threads, from the paging statistics; the device's lock acquisitions per step, and per
 * 1,000 steps those that waited for another thread (contended) and those by another thread
 * than the last (handoffs), from the lock statistics; the process's minor page faults and
 * voluntary context switches meanwhile; and the shards made so far.
 * PROBE_SEGMENTS=N also times each thread's steps in N equal segments and prints, per run,
 * each segment's ns per step (the threads' mean) and the threads' own ns per step (fastest
 * and slowest): whether a run's time is its first steps' (new shards growing), a straggler's,
 * or every thread's every step. */
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <cuda_runtime_api.h>
#include "ccalloc.h"

/* Weak, so that the probe also links against a library older than the lock statistics (an
 * A/B's base), whose counts then read as 0. */
#pragma weak ccalloc_get_lock_stats

static void read_lock_stats(ccalloc_lock_stats* out) {
    *out = ccalloc_lock_stats{};
    if (&ccalloc_get_lock_stats) ccalloc_get_lock_stats(0, out);
}

struct Plan {
    std::vector<size_t> init, sizes;
    std::vector<uint32_t> index;
};

static Plan plan(long live, long steps, uint64_t seed) {
    uint64_t s = 0x9E3779B97F4A7C15ull ^ (seed * 0x2545F4914F6CDD1Dull);
    auto next = [&] { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; };
    const double lo = std::log(256.0), hi = std::log(double(1 << 20));
    auto size = [&] { return size_t(std::exp(lo + (next() >> 11) * 0x1.0p-53 * (hi - lo))); };
    Plan p;
    for (long i = 0; i < live; ++i) p.init.push_back(size());
    for (long k = 0; k < steps; ++k) {
        p.index.push_back(uint32_t(next() % live));
        p.sizes.push_back(size());
    }
    return p;
}

/* One thread's churn of `live` blocks up to `hi` bytes on `s`, all freed at the end. */
static void churn_here(cudaStream_t s, long live, long steps, double hi_bytes, uint64_t seed) {
    uint64_t r = 0x9E3779B97F4A7C15ull ^ seed;
    auto next = [&] { r ^= r << 13; r ^= r >> 7; r ^= r << 17; return r; };
    const double lo = std::log(256.0), hi = std::log(hi_bytes);
    auto size = [&] { return size_t(std::exp(lo + (next() >> 11) * 0x1.0p-53 * (hi - lo))); };
    std::vector<void*> p(live);
    std::vector<size_t> sz(live);
    for (long i = 0; i < live; ++i) p[i] = ccalloc_torch_alloc(sz[i] = size(), 0, s);
    for (long k = 0; k < steps; ++k) {
        long i = long(next() % live);
        ccalloc_torch_free(p[i], sz[i], 0, s);
        p[i] = ccalloc_torch_alloc(sz[i] = size(), 0, s);
    }
    for (long i = 0; i < live; ++i) ccalloc_torch_free(p[i], sz[i], 0, s);
}

/* CPUs named in PROBE_CPUS, in order (empty: threads are not pinned). */
static std::vector<int> worker_cpus;

/* Pins the calling thread to `cpu`; false if the system refused. */
static bool pin_to(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

/* Paging statistics when the timed steps started and ended. */
static ccalloc_paging_stats timed_from, timed_to;
static ccalloc_lock_stats locks_from, locks_to;
/* The process's minor page faults and voluntary context switches in the timed steps. */
static long timed_faults, timed_switches;
/* PROBE_SEGMENTS: segments per thread (0: off), and each run's clock readings per thread
 * (segments + 1 each, from the start signal). */
static int segments = 0;
static std::vector<std::vector<std::chrono::steady_clock::time_point>> marks;

static void usage_now(long* faults, long* switches) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    *faults = u.ru_minflt;
    *switches = u.ru_nvcsw;
}

/* PROBE_ONE_STREAM: every thread churns on the same stream (PyTorch's forward and autograd
 * threads), not each on its own. */
static bool one_stream = false;
/* PROBE_PHASES: steps a thread runs before the next one's turn (0: all at once), and the
 * turns taken so far. */
static long phase_steps = 0;
static std::atomic<long> turn{0};

static double run(int threads, long steps, bool sim) {
    const long live = 1000;
    const int made = one_stream ? 1 : threads;
    std::vector<cudaStream_t> streams(threads);
    for (int t = 0; t < made; ++t) {
        if (sim) streams[t] = (cudaStream_t)(uintptr_t)(0x1000 * (t + 1));
        else if (cudaStreamCreateWithFlags(&streams[t], cudaStreamNonBlocking) != cudaSuccess) return -1;
    }
    for (int t = made; t < threads; ++t) streams[t] = streams[0];
    std::vector<Plan> plans;
    for (int t = 0; t < threads; ++t) plans.push_back(plan(live, steps, t + 1));
    std::atomic<int> ready{0}, bad{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> pool;
    marks.assign(threads, std::vector<std::chrono::steady_clock::time_point>(segments + 1));
    const long per_segment = segments ? (steps + segments - 1) / segments : steps + 1;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] {
        if (!worker_cpus.empty() && !pin_to(worker_cpus[t % worker_cpus.size()])) bad++;
        if (!sim) cudaSetDevice(0);
        cudaStream_t s = streams[t];
        const Plan& pl = plans[t];
        std::vector<void*> p(live);
        std::vector<size_t> sz = pl.init;
        for (long i = 0; i < live; ++i) p[i] = ccalloc_torch_alloc(sz[i], 0, s);
        ready++;
        while (!go.load()) {}
        if (segments) marks[t][0] = std::chrono::steady_clock::now();
        for (long k = 0; k < steps; ++k) {
            if (segments && k && k % per_segment == 0) marks[t][k / per_segment] = std::chrono::steady_clock::now();
            if (phase_steps && k % phase_steps == 0)
                while (turn.load(std::memory_order_acquire) % threads != t) sched_yield();
            uint32_t i = pl.index[k];
            ccalloc_torch_free(p[i], sz[i], 0, s);
            sz[i] = pl.sizes[k];
            p[i] = ccalloc_torch_alloc(sz[i], 0, s);
            if (!p[i]) bad++;
            if (phase_steps && ((k + 1) % phase_steps == 0 || k + 1 == steps))
                turn.fetch_add(1, std::memory_order_release);
        }
        if (segments) marks[t][segments] = std::chrono::steady_clock::now();
        ready--;
        for (long i = 0; i < live; ++i) ccalloc_torch_free(p[i], sz[i], 0, s);
    });
    while (ready.load() < threads) {}
    turn = 0;
    ccalloc_get_paging_stats(0, &timed_from);
    read_lock_stats(&locks_from);
    long faults0, switches0;
    usage_now(&faults0, &switches0);
    auto t0 = std::chrono::steady_clock::now();
    go = true;
    while (ready.load() > 0) {}
    ccalloc_get_paging_stats(0, &timed_to);
    read_lock_stats(&locks_to);
    usage_now(&timed_faults, &timed_switches);
    timed_faults -= faults0;
    timed_switches -= switches0;
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count()
        / double(threads * steps);
    for (auto& th : pool) th.join();
    if (!sim) {
        cudaDeviceSynchronize();
        for (int t = 0; t < made; ++t) cudaStreamDestroy(streams[t]);
    }
    return bad.load() ? -1 : ns;
}

/* ns per alloc+free pair of `size` bytes on `s`, over `iters` pairs after 100 untimed. */
static double pairs(cudaStream_t s, size_t size, long iters) {
    for (int i = 0; i < 100; ++i) ccalloc_torch_free(ccalloc_torch_alloc(size, 0, s), size, 0, s);
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iters; ++i) ccalloc_torch_free(ccalloc_torch_alloc(size, 0, s), size, 0, s);
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters;
}

/* A control for PROBE_PAIR_WINDOWS: `iters` steps of random reads and writes, with a
 * data-dependent branch, in a 32 KiB table (L1-resident, no allocator): ns each. */
static double control_loop(long iters) {
    static uint64_t table[4096];
    uint64_t x = 88172645463325252ULL;
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iters; ++i) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        size_t idx = x & 4095;
        uint64_t v = table[idx];
        if (v & 1) table[idx] = v + x;
        else table[(idx + 1) & 4095] ^= x;
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters;
}

/* PROBE_SEGMENTS' figures for the run just made with `threads` threads. */
static void print_segments(int threads, long steps) {
    using ns_d = std::chrono::duration<double, std::nano>;
    const long per_segment = (steps + segments - 1) / segments;
    printf("\n  t%d segments (ns per step, threads' mean):", threads);
    for (int g = 0; g < segments; ++g) {
        long n = std::min(steps, (g + 1) * per_segment) - g * per_segment;
        double sum = 0;
        for (int t = 0; t < threads; ++t) sum += ns_d(marks[t][g + 1] - marks[t][g]).count() / n;
        printf(" %.0f", sum / threads);
    }
    double fastest = 1e300, slowest = 0;
    for (int t = 0; t < threads; ++t) {
        double own = ns_d(marks[t][segments] - marks[t][0]).count() / steps;
        fastest = std::min(fastest, own);
        slowest = std::max(slowest, own);
    }
    printf("; threads' own %.0f-%.0f\n ", fastest, slowest);
}

int main(int argc, char** argv) {
    long steps = argc > 1 ? atol(argv[1]) : 50000;
    const char* backend = getenv("CCALLOC_BACKEND");
    bool sim = backend && !strcmp(backend, "sim");
    if (ccalloc_init() != CCALLOC_OK) {
        fprintf(stderr, "probe_threads: init failed: %s\n", ccalloc_last_error());
        return 1;
    }
    if (const char* cpus = getenv("PROBE_CPUS")) {
        for (const char* c = cpus; *c;) {
            char* end;
            worker_cpus.push_back(int(strtol(c, &end, 10)));
            c = *end == ',' ? end + 1 : end + strlen(end);
        }
    }
    if (const char* main_cpu = getenv("PROBE_MAIN_CPU")) {
        if (!pin_to(atoi(main_cpu))) {
            fprintf(stderr, "probe_threads: could not pin the main thread to CPU %s\n", main_cpu);
            return 1;
        }
    }
    if (const char* pair_size = getenv("PROBE_PAIRS")) {
        size_t size = strtoull(pair_size, nullptr, 10);
        cudaStream_t main_stream = (cudaStream_t)(uintptr_t)0x100, helper_stream = (cudaStream_t)(uintptr_t)0x200;
        if (!sim) {
            cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking);
            cudaStreamCreateWithFlags(&helper_stream, cudaStreamNonBlocking);
        }
        if (const char* w = getenv("PROBE_PAIR_WINDOWS")) {
            printf("backend %s, pairs of %zu bytes, ns each in windows of 100,000 (control loop):", sim ? "sim" : "cuda", size);
            for (long i = 0, n = atol(w); i < n; ++i) {
                double pair = pairs(main_stream, size, 100000);
                printf(" %.0f (%.1f)", pair, control_loop(1000000));
            }
            printf("\n");
            return 0;
        }
        double alone = pairs(main_stream, size, 200000);
        std::thread([&] {
            if (!sim) cudaSetDevice(0);
            ccalloc_torch_free(ccalloc_torch_alloc(4096, 0, helper_stream), 4096, 0, helper_stream);
        }).join();
        double beside = pairs(main_stream, size, 200000);
        uint32_t shards = 0;
        ccalloc_shard_count(0, &shards);
        printf("backend %s, pairs of %zu bytes: %.1f ns alone, %.1f ns beside a helper thread's stream (%u shards)\n",
               sim ? "sim" : "cuda", size, alone, beside, shards);
        return 0;
    }
    if (getenv("PROBE_PRE_MIXED")) {
        cudaStream_t s = 0;
        if (!sim) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        else s = (cudaStream_t)(uintptr_t)0x100;
        churn_here(s, 2000, 50000, double(1 << 20), 1);
        churn_here(s, 500, 50000, double(256 << 20), 2);
    }
    std::vector<int> counts;
    for (int i = 2; i < argc; ++i) counts.push_back(atoi(argv[i]));
    if (counts.empty()) counts = {1, 4, 8};
    if (const char* n = getenv("PROBE_PHASES")) phase_steps = atol(n) > 0 ? atol(n) : 0;
    one_stream = getenv("PROBE_ONE_STREAM") != nullptr || phase_steps;
    printf("backend %s, %ld steps per thread, %s", sim ? "sim" : "cuda", steps,
           one_stream ? "one stream" : "a stream each");
    if (phase_steps) printf(", taking turns of %ld steps", phase_steps);
    printf(":");
    if (const char* n = getenv("PROBE_SEGMENTS")) segments = atoi(n) > 0 && atoi(n) <= 100 ? atoi(n) : 0;
    for (int t : counts) {
        double ns = run(t, steps, sim);
        if (segments) print_segments(t, steps);
        const ccalloc_paging_stats &a = timed_from, &b = timed_to;
        uint32_t shards = 0;
        ccalloc_shard_count(0, &shards);
        const ccalloc_lock_stats &la = locks_from, &lb = locks_to;
        const double all_steps = double(t) * double(steps);
        printf(" t%d %.0f (%llu growths, %llu moving, %.1f ms; locks %.2f a step, per 1,000 steps"
               " %.1f contended, %.1f handoffs; %ld faults, %ld switches; %u shards)",
               t, ns, (unsigned long long)(b.growths - a.growths),
               (unsigned long long)(b.moving_growths - a.moving_growths),
               (b.growth_ns - a.growth_ns) / 1e6, (lb.acquisitions - la.acquisitions) / all_steps,
               1e3 * (lb.contended - la.contended) / all_steps, 1e3 * (lb.handoffs - la.handoffs) / all_steps,
               timed_faults, timed_switches, shards);
    }
    printf(" ns per step\n");
    return 0;
}
