// GPU test of ccalloc's pinned host and managed memory on the real CUDA driver.
//
// Build and run (from the repository root, libccalloc.so built elsewhere and copied to gpu/):
//   nvcc -std=c++17 -O2 -arch=sm_90 -I include tests/gpu/test_host.cu -o test_host -L gpu
//        -lccalloc -Xlinker -rpath -Xlinker $PWD/gpu          (one command line)
//   ./test_host [--no-oversub] [--free-gib N] [--factor F]
//
// Checks:
//   pinned   an async host-to-device copy from a pinned block, held behind a gate kernel on
//            its stream; the block is recorded on that stream and freed: the next allocation
//            of the same size must be another block (the host scribbles on it at once), and the
//            copied data must be intact; after the copy, the block is reused. Statistics,
//            empty_cache, and the error paths (wrong kind, double free, size 0).
//   managed  managed blocks written by the host, advised, prefetched to the device, changed
//            by a kernel, prefetched back, and checked on the host; prefetch and advice on
//            ranges that are not live managed memory are refused.
//   oversub  managed allocations totalling F (default 1.5) times the device memory left free
//            (a device "ballast" allocation first leaves only N GiB free, default 16, so the
//            host needs about F*N GiB), computed over chunk by chunk, without prefetch and
//            with prefetch (each chunk moved to the device before its kernel and back after);
//            both must give the right values; the times are printed (NOTE lines).
//
// Output: "PASS  ..." / "FAIL  ... [test_host.cu:LINE]", notes starting with "NOTE", and a
// last line "N passed, M failed". Exit status 1 when any check failed.

#include <cuda_runtime.h>

#include "ccalloc.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int g_passed = 0, g_failed = 0;

static bool check_at(bool ok, int line, const char *what) {
    printf("%s  %s", ok ? "PASS" : "FAIL", what);
    if (!ok) printf("  [test_host.cu:%d]", line);
    printf("\n");
    fflush(stdout);
    (ok ? g_passed : g_failed)++;
    return ok;
}
#define CHECK(cond, what) check_at((cond), __LINE__, (what))

static bool status_is(ccalloc_status got, ccalloc_status want, int line, const char *what) {
    char text[512];
    snprintf(text, sizeof text, "%s: %s%s%s", what, ccalloc_status_name(got),
             got == want ? "" : " (expected ", got == want ? "" : ccalloc_status_name(want));
    if (got != want) strncat(text, ")", sizeof text - strlen(text) - 1);
    bool ok = check_at(got == want, line, text);
    if (!ok && got != CCALLOC_OK) printf("      last error: %s\n", ccalloc_last_error());
    return ok;
}
#define EXPECT_STATUS(call, want) status_is((call), (want), __LINE__, #call)
#define EXPECT_OK(call) EXPECT_STATUS((call), CCALLOC_OK)

static bool message_has(const char *needle) {
    return strstr(ccalloc_last_error(), needle) != nullptr;
}

static bool cuda_ok(cudaError_t e, int line) {
    if (e != cudaSuccess) {
        printf("FAIL  CUDA error %s  [test_host.cu:%d]\n", cudaGetErrorString(e), line);
        g_failed++;
        return false;
    }
    return true;
}
#define CUDA(call) cuda_ok((call), __LINE__)

static const size_t MIB = 1 << 20;

// Spins until *gate is non-zero (a mapped pinned word the host sets), at most ~20 s.
__global__ void wait_for_gate(volatile int *gate) {
    long long start = clock64();
    while (*gate == 0) {
        if (clock64() - start > 40000000000LL) break;
    }
}

__global__ void add_one(uint32_t *p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] += 1;
}

static void fill_pattern(uint32_t *p, size_t words, uint32_t seed) {
    for (size_t i = 0; i < words; i++) p[i] = seed * 2654435761u + (uint32_t)i;
}

static size_t count_mismatches(const uint32_t *p, size_t words, uint32_t seed) {
    size_t bad = 0;
    for (size_t i = 0; i < words; i++) bad += p[i] != seed * 2654435761u + (uint32_t)i;
    return bad;
}

static void test_pinned(cudaStream_t s) {
    printf("== pinned host memory\n");
    const size_t size = 64 * MIB, words = size / 4;
    ccalloc_stats before{};
    EXPECT_OK(ccalloc_host_get_stats(&before));

    int *gate = nullptr;
    if (!CUDA(cudaHostAlloc((void **)&gate, sizeof(int), cudaHostAllocMapped))) return;
    *gate = 0;
    int *gate_dev = nullptr;
    CUDA(cudaHostGetDevicePointer((void **)&gate_dev, gate, 0));
    void *dev = nullptr;
    if (!CUDA(cudaMalloc(&dev, size))) return;

    void *p = nullptr;
    if (!EXPECT_OK(ccalloc_host_malloc(size, &p))) return;
    fill_pattern((uint32_t *)p, words, 7);
    wait_for_gate<<<1, 1, 0, s>>>(gate_dev);
    CUDA(cudaMemcpyAsync(dev, p, size, cudaMemcpyHostToDevice, s));
    EXPECT_OK(ccalloc_host_record_stream(p, 0, s));
    EXPECT_OK(ccalloc_host_free(p));
    void *q = nullptr;
    EXPECT_OK(ccalloc_host_malloc(size, &q));
    CHECK(q != p, "a block freed while its copy waits on the stream is not handed out");
    // A loader fills its next batch at once: were q the same block, the copy would read this.
    if (q) memset(q, 0xee, size);
    *gate = 1;
    CUDA(cudaStreamSynchronize(s));
    std::vector<uint32_t> back(words);
    CUDA(cudaMemcpy(back.data(), dev, size, cudaMemcpyDeviceToHost));
    CHECK(count_mismatches(back.data(), words, 7) == 0, "the async copy read intact data");
    EXPECT_OK(ccalloc_host_free(q));
    void *r = nullptr;
    EXPECT_OK(ccalloc_host_malloc(size, &r));
    CHECK(r == p || r == q, "after the copy the cached block is reused");

    ccalloc_stats st{};
    EXPECT_OK(ccalloc_host_get_stats(&st));
    CHECK(st.allocation.all.current == before.allocation.all.current + 1, "one live pinned block");
    CHECK(st.requested_bytes.all.current - before.requested_bytes.all.current == (int64_t)size,
          "requested bytes");
    CHECK(st.num_device_alloc - before.num_device_alloc <= 2, "at most two cuMemHostAlloc calls");

    // Errors.
    void *d = nullptr;
    EXPECT_OK(ccalloc_malloc(MIB, 0, s, &d));
    EXPECT_STATUS(ccalloc_host_free(d), CCALLOC_UNKNOWN_POINTER);
    CHECK(message_has("ccalloc_free"), "freeing a device block as pinned names ccalloc_free");
    EXPECT_STATUS(ccalloc_free(r, 0), CCALLOC_UNKNOWN_POINTER);
    CHECK(message_has("pinned host block"), "freeing a pinned block as a device one says so");
    EXPECT_OK(ccalloc_free(d, 0));
    EXPECT_OK(ccalloc_host_free(r));
    EXPECT_STATUS(ccalloc_host_free(r), CCALLOC_DOUBLE_FREE);
    void *z = nullptr;
    EXPECT_STATUS(ccalloc_host_malloc(0, &z), CCALLOC_INVALID_SIZE);

    EXPECT_OK(ccalloc_host_empty_cache());
    EXPECT_OK(ccalloc_host_get_stats(&st));
    CHECK(st.reserved_bytes.all.current == 0, "empty_cache returns every pinned segment");
    cudaFree(dev);
    cudaFreeHost(gate);
}

static void test_managed(cudaStream_t s) {
    printf("== managed memory\n");
    const size_t size = 256 * MIB, words = size / 4;
    void *m = nullptr;
    if (!EXPECT_OK(ccalloc_managed_malloc(size, &m))) return;
    fill_pattern((uint32_t *)m, words, 3);
    EXPECT_OK(ccalloc_advise(m, size, CCALLOC_ADVISE_SET_PREFERRED_LOCATION, 0));
    EXPECT_OK(ccalloc_advise(m, size, CCALLOC_ADVISE_SET_ACCESSED_BY, -1));
    EXPECT_OK(ccalloc_prefetch(m, size, 0, s));
    add_one<<<1024, 256, 0, s>>>((uint32_t *)m, words);
    CUDA(cudaGetLastError());
    EXPECT_OK(ccalloc_managed_record_stream(m, 0, s));
    EXPECT_OK(ccalloc_prefetch(m, size, -1, s));
    CUDA(cudaStreamSynchronize(s));
    size_t bad = 0;
    const uint32_t *w = (const uint32_t *)m;
    for (size_t i = 0; i < words; i++) bad += w[i] != 3u * 2654435761u + (uint32_t)i + 1;
    CHECK(bad == 0, "the kernel's changes are seen on the host after the prefetch back");
    EXPECT_OK(ccalloc_advise(m, size, CCALLOC_ADVISE_UNSET_PREFERRED_LOCATION, 0));
    EXPECT_OK(ccalloc_advise(m, MIB, CCALLOC_ADVISE_SET_READ_MOSTLY, 0));

    EXPECT_STATUS(ccalloc_prefetch((char *)m + MIB, size, 0, s), CCALLOC_INVALID_ARGUMENT);
    void *p = nullptr;
    EXPECT_OK(ccalloc_host_malloc(MIB, &p));
    EXPECT_STATUS(ccalloc_prefetch(p, MIB, 0, s), CCALLOC_UNKNOWN_POINTER);
    CHECK(message_has("not managed"), "prefetching pinned memory: not managed");
    EXPECT_OK(ccalloc_host_free(p));
    EXPECT_STATUS(ccalloc_advise(m, size, 99, 0), CCALLOC_INVALID_ARGUMENT);
    EXPECT_OK(ccalloc_managed_free(m));
    EXPECT_STATUS(ccalloc_advise(m, MIB, CCALLOC_ADVISE_SET_READ_MOSTLY, 0), CCALLOC_DOUBLE_FREE);
    CHECK(message_has("advice on freed memory"), "advice on freed memory is named");
    EXPECT_STATUS(ccalloc_host_free(nullptr), CCALLOC_OK);
    EXPECT_OK(ccalloc_managed_empty_cache());
}

enum class Prefetch { None, Ccalloc, Cuda };

// Plain CUDA's prefetch, for the cudaMallocManaged comparison (CUDA 13 takes a location).
static void cuda_prefetch(void *p, size_t bytes, int device, cudaStream_t s) {
#if CUDART_VERSION >= 13000
    cudaMemLocation loc{};
    loc.type = device >= 0 ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost;
    loc.id = device >= 0 ? device : 0;
    cudaMemPrefetchAsync(p, bytes, loc, 0, s);
#else
    cudaMemPrefetchAsync(p, bytes, device >= 0 ? device : cudaCpuDeviceId, s);
#endif
}

static double run_chunks(std::vector<uint32_t *> &chunks, size_t chunk_words, Prefetch prefetch,
                         cudaStream_t s) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    cudaEventRecord(start, s);
    for (uint32_t *c : chunks) {
        if (prefetch == Prefetch::Ccalloc) ccalloc_prefetch(c, chunk_words * 4, 0, s);
        if (prefetch == Prefetch::Cuda) cuda_prefetch(c, chunk_words * 4, 0, s);
        add_one<<<2048, 256, 0, s>>>(c, chunk_words);
        if (prefetch == Prefetch::Ccalloc) ccalloc_prefetch(c, chunk_words * 4, -1, s);
        if (prefetch == Prefetch::Cuda) cuda_prefetch(c, chunk_words * 4, -1, s);
    }
    cudaEventRecord(stop, s);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms;
}

static void test_oversubscription(cudaStream_t s, double free_gib, double factor) {
    printf("== managed oversubscription\n");
    size_t free_bytes = 0, total = 0;
    CUDA(cudaMemGetInfo(&free_bytes, &total));
    size_t leave = (size_t)(free_gib * (1 << 30));
    void *ballast = nullptr;
    if (free_bytes > leave + 512 * MIB) {
        if (!CUDA(cudaMalloc(&ballast, free_bytes - leave))) return;
        CUDA(cudaMemGetInfo(&free_bytes, &total));
    }
    const size_t chunk = 1ull << 30, chunk_words = chunk / 4;
    size_t n = (size_t)(factor * (double)free_bytes / (double)chunk) + 1;
    printf("NOTE  device free %.1f GiB, %zu managed chunks of 1 GiB (%.2fx)\n",
           free_bytes / 1073741824.0, n, (double)(n * chunk) / (double)free_bytes);
    std::vector<uint32_t *> chunks;
    for (size_t i = 0; i < n; i++) {
        void *c = nullptr;
        if (!EXPECT_OK(ccalloc_managed_malloc(chunk, &c))) break;
        uint32_t *w = (uint32_t *)c;
        for (size_t j = 0; j < chunk_words; j += 1024) w[j] = (uint32_t)i;
        chunks.push_back(w);
    }
    if (chunks.size() == n) {
        double plain = run_chunks(chunks, chunk_words, Prefetch::None, s);
        double prefetched = run_chunks(chunks, chunk_words, Prefetch::Ccalloc, s);
        for (uint32_t *c : chunks)
            EXPECT_OK(ccalloc_advise(c, chunk, CCALLOC_ADVISE_SET_ACCESSED_BY, 0));
        double advised = run_chunks(chunks, chunk_words, Prefetch::Ccalloc, s);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < chunk_words; j += 1024) bad += chunks[i][j] != (uint32_t)i + 3;
        CHECK(bad == 0, "every chunk was computed over three times");
        printf("NOTE  %zu GiB ccalloc managed: on-demand %.0f ms, prefetched %.0f ms, prefetched "
               "and accessed-by advice %.0f ms\n", n, plain, prefetched, advised);
    }
    for (uint32_t *c : chunks) EXPECT_OK(ccalloc_managed_free(c));
    EXPECT_OK(ccalloc_managed_empty_cache());
    // The same job on plain cudaMallocManaged, in the same run.
    std::vector<uint32_t *> raw;
    for (size_t i = 0; i < n; i++) {
        void *c = nullptr;
        if (!CUDA(cudaMallocManaged(&c, chunk, cudaMemAttachGlobal))) break;
        uint32_t *w = (uint32_t *)c;
        for (size_t j = 0; j < chunk_words; j += 1024) w[j] = (uint32_t)i;
        raw.push_back(w);
    }
    if (raw.size() == n) {
        double plain = run_chunks(raw, chunk_words, Prefetch::None, s);
        double prefetched = run_chunks(raw, chunk_words, Prefetch::Cuda, s);
        printf("NOTE  %zu GiB cudaMallocManaged: on-demand %.0f ms, prefetched %.0f ms\n", n, plain,
               prefetched);
    }
    for (uint32_t *c : raw) cudaFree(c);
    if (ballast) cudaFree(ballast);
}

int main(int argc, char **argv) {
    bool oversub = true;
    double free_gib = 16, factor = 1.5;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--no-oversub") oversub = false;
        else if (a == "--free-gib" && i + 1 < argc) free_gib = atof(argv[++i]);
        else if (a == "--factor" && i + 1 < argc) factor = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--no-oversub] [--free-gib N] [--factor F]\n", argv[0]);
            return 2;
        }
    }
    if (!EXPECT_OK(ccalloc_init())) return 1;
    cudaStream_t s;
    if (!CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking))) return 1;
    test_pinned(s);
    test_managed(s);
    if (oversub) test_oversubscription(s, free_gib, factor);
    cudaStreamDestroy(s);
    EXPECT_OK(ccalloc_shutdown());
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
