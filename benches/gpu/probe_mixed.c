/* Churn mixed as the hot-path harness runs it (500 live blocks, log-uniform 256 B-256 MiB,
 * each step frees a random one and allocates a new size) straight through ccalloc's
 * PyTorch entry points on the CUDA backend, then ccalloc's paging statistics for the timed
 * steps: how much of a step is growth, and how much of that moved pages. No Python, no
 * PyTorch. Build and run on the GPU machine from the repository root:
 *   cc -O2 -Iinclude -o /tmp/probe_mixed benches/gpu/probe_mixed.c -Lgpu -lccalloc -lm
 *   LD_LIBRARY_PATH=gpu /tmp/probe_mixed [STEPS] [LIVE] [MAX_BYTES]
 * (settings from CCALLOC_CONF; PROBE_HARNESS_ORDER=1 first runs what hotpath.py runs before
 * churn mixed: 200,000 same-size pairs of 4 KiB, 1 MiB, 32 MiB and 512 MiB, then small churn). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "ccalloc.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_random(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* A size between e^lo_ln and e^hi_ln, uniform in its logarithm (as the harness's logu). */
static size_t log_uniform(double lo_ln, double hi_ln) {
    return (size_t)exp(lo_ln + (next_random() >> 11) * 0x1.0p-53 * (hi_ln - lo_ln));
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
    long steps = argc > 1 ? atol(argv[1]) : 50000;
    long live = argc > 2 ? atol(argv[2]) : 500;
    double hi = argc > 3 ? atof(argv[3]) : (double)(256 << 20);
    double lo_ln = log(256.0), hi_ln = log(hi);
    void **ptrs = calloc(live > 2000 ? live : 2000, sizeof(void *));
    if (!ptrs || ccalloc_init() != CCALLOC_OK) {
        fprintf(stderr, "probe_mixed: init failed: %s\n", ccalloc_last_error());
        return 1;
    }
    if (getenv("PROBE_HARNESS_ORDER")) {
        /* What hotpath.py runs before churn mixed: same-size pairs, then small churn. */
        size_t sizes[] = {4096, 1 << 20, 32 << 20, (size_t)512 << 20};
        for (int s = 0; s < 4; s++) {
            double t = now_ns();
            for (int k = 0; k < 200000; k++) {
                void *q = ccalloc_torch_alloc(sizes[s], 0, NULL);
                ccalloc_torch_free(q, sizes[s], 0, NULL);
            }
            printf("pair %zu: %.1f ns\n", sizes[s], (now_ns() - t) / 200000);
        }
        double s_ln = log(256.0), h_ln = log(1 << 20);
        for (int i = 0; i < 2000; i++)
            ptrs[i] = ccalloc_torch_alloc(log_uniform(s_ln, h_ln), 0, NULL);
        double t = now_ns();
        for (int k = 0; k < 200000; k++) {
            long i = (long)(next_random() % 2000);
            ccalloc_torch_free(ptrs[i], 0, 0, NULL);
            ptrs[i] = ccalloc_torch_alloc(log_uniform(s_ln, h_ln), 0, NULL);
        }
        printf("churn small: %.1f ns\n", (now_ns() - t) / 200000);
        for (int i = 0; i < 2000; i++) ccalloc_torch_free(ptrs[i], 0, 0, NULL);
    }
    for (long i = 0; i < live; i++) ptrs[i] = ccalloc_torch_alloc(log_uniform(lo_ln, hi_ln), 0, NULL);
    ccalloc_paging_stats p0, p1;
    ccalloc_get_paging_stats(0, &p0);
    double t0 = now_ns();
    for (long k = 0; k < steps; k++) {
        long i = (long)(next_random() % (uint64_t)live);
        ccalloc_torch_free(ptrs[i], 0, 0, NULL);
        ptrs[i] = ccalloc_torch_alloc(log_uniform(lo_ln, hi_ln), 0, NULL);
        if (!ptrs[i]) {
            fprintf(stderr, "probe_mixed: step %ld failed: %s\n", k, ccalloc_last_error());
            return 1;
        }
    }
    double dt = now_ns() - t0;
    ccalloc_get_paging_stats(0, &p1);
    const char *conf = getenv("CCALLOC_CONF");
    printf("PROBE conf='%s' steps=%ld %.0f ns/step; growth %.1f%% (%.0f ns/step), moving %.1f%%; "
           "growths %llu moving %llu mapped %llu unmapped %llu waits %llu; slack %.3f\n",
           conf ? conf : "", steps, dt / steps, 100.0 * (p1.growth_ns - p0.growth_ns) / dt,
           (double)(p1.growth_ns - p0.growth_ns) / steps, 100.0 * (p1.moving_ns - p0.moving_ns) / dt,
           (unsigned long long)(p1.growths - p0.growths),
           (unsigned long long)(p1.moving_growths - p0.moving_growths),
           (unsigned long long)(p1.chunks_mapped - p0.chunks_mapped),
           (unsigned long long)(p1.chunks_unmapped - p0.chunks_unmapped),
           (unsigned long long)(p1.host_waits - p0.host_waits), p1.page_slack);
    for (long i = 0; i < live; i++) ccalloc_torch_free(ptrs[i], 0, 0, NULL);
    return 0;
}
