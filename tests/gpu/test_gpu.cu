// GPU test of libccalloc on the real CUDA driver (CCALLOC_BACKEND unset = cuda).
//
// Build and run (scripts/gpu_check.sh does this):
//   nvcc -std=c++17 -O2 -arch=sm_90 -I include tests/gpu/test_gpu.cu -o test_gpu -L gpu -lccalloc
//        -Xlinker -rpath -Xlinker $PWD/gpu -lpthread      (one command line)
//   ./test_gpu [--quick] [--no-driver-oom] [--no-held-kernel] [--sanitizer]
//
// --quick          smaller blocks and fewer iterations
// --no-driver-oom  skip the check that makes cuMemAlloc itself fail (a sanitizer may report
//                  that deliberate failure as an API error)
// --no-held-kernel skip the record_stream test that holds a side-stream kernel until the host
//                  opens a gate: under compute-sanitizer the host blocks while a kernel runs, so
//                  the kernel only ends by its timeout (the churn test still covers
//                  record_stream, without timing)
// --sanitizer      all three, for runs under compute-sanitizer
//
// Every ccalloc block is written by a kernel with a per-block pattern and verified by another
// kernel that counts mismatches on the device. The test checks that blocks never overlap, that
// a block freed while another stream still uses it (ccalloc_record_stream) is not handed out
// again before that stream's work completes, the statistics, empty_cache, and the OOM paths.
//
// Segments: paged (the default; the H100 supports the driver's virtual memory API, assumed
// here, with 2 MiB pages) or plain with CCALLOC_CONF=expandable_segments:False; the exact
// statistics are predicted for either (scripts/gpu_check.sh runs both). CCALLOC_CONF may hold
// nothing else.
//
// Output: one line per check ("PASS  ..." / "FAIL  ... [test_gpu.cu:LINE]"), section headers
// starting with "==", notes starting with "NOTE", and a last line "N passed, M failed". Exit
// status 1 when any check failed.
//
// nvcc includes cuda_runtime.h before anything else; it is also included explicitly here, so
// this file checks that ccalloc.h compiles after it (the cudaStream_t typedefs agree).

#include <cuda_runtime.h>

#include "ccalloc.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

static_assert(std::is_same<cudaStream_t, CUstream_st *>::value,
              "ccalloc.h's cudaStream_t is the CUDA runtime's");
static_assert(sizeof(ccalloc_stats) == 9 * 96 + 2 * 32 + 6 * 8, "ccalloc_stats layout");
static_assert(sizeof(ccalloc_status) == 4, "ccalloc_status is 32-bit");

// ------------------------------------------------------------------------------------------
// Reporting

static int g_passed = 0;
static int g_failed = 0;
static std::mutex g_report_lock;

#if defined(__GNUC__)
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define PRINTF_LIKE(f, a)
#endif

static bool check_at(bool ok, int line, const char *fmt, ...) PRINTF_LIKE(3, 4);
static bool check_at(bool ok, int line, const char *fmt, ...) {
    std::lock_guard<std::mutex> lock(g_report_lock);
    fputs(ok ? "PASS  " : "FAIL  ", stdout);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    if (!ok) printf("  [test_gpu.cu:%d]", line);
    putchar('\n');
    fflush(stdout);
    (ok ? g_passed : g_failed)++;
    return ok;
}

#define CHECK(cond, ...) check_at((cond), __LINE__, __VA_ARGS__)

static void section(const char *name) {
    printf("== %s\n", name);
    fflush(stdout);
}

static void note(const char *fmt, ...) PRINTF_LIKE(1, 2);
static void note(const char *fmt, ...) {
    std::lock_guard<std::mutex> lock(g_report_lock);
    fputs("NOTE  ", stdout);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

static char g_msg[2048];

static const char *name_of(uint32_t status) { return ccalloc_status_name(status); }

static bool expect_status_at(ccalloc_status got, uint32_t want, int line, const char *what) {
    uint32_t g = (uint32_t)got;
    const char *msg = ccalloc_last_error();
    if (g != 0) {
        snprintf(g_msg, sizeof g_msg, "%s", msg ? msg : "(null)");
    } else {
        g_msg[0] = '\0';
    }
    if (want == 0) {
        return check_at(g == 0, line, "%s -> %s%s%s", what, name_of(g), g ? ": " : "", g ? g_msg : "");
    }
    bool has_msg = msg != nullptr && msg[0] != '\0';
    return check_at(g == want && has_msg, line, "%s -> %s (want %s) msg: \"%s\"", what, name_of(g),
                    name_of(want), g_msg);
}

#define EXPECT_STATUS(call, want) expect_status_at((call), (want), __LINE__, #call)
#define EXPECT_MSG_HAS(needle) CHECK(strstr(g_msg, (needle)) != nullptr, "message mentions \"%s\"", (needle))

#define CHECK_EQ_I64(what, got, want)                                                          \
    do {                                                                                       \
        int64_t got_ = (int64_t)(got), want_ = (int64_t)(want);                                \
        CHECK(got_ == want_, "%s == %" PRId64 "%s%" PRId64 ")", (what), want_,                 \
              got_ == want_ ? " (got " : " (GOT ", got_);                                      \
    } while (0)

static bool cuda_ok_at(cudaError_t e, int line, const char *what) {
    if (e == cudaSuccess) return true;
    check_at(false, line, "%s -> %s: %s", what, cudaGetErrorName(e), cudaGetErrorString(e));
    return false;
}

// A CUDA runtime call that must succeed: silent when it does, a failed check when not.
#define CUDA_OK(call) cuda_ok_at((call), __LINE__, #call)

// ------------------------------------------------------------------------------------------
// Sizes

static const uint64_t KIB = 1ull << 10;
static const uint64_t MIB = 1ull << 20;
static const uint64_t GIB = 1ull << 30;

static bool g_quick = false;
static bool g_driver_oom = true;
static bool g_held_kernel = true;
static bool g_paged = true;                  // paged segments (expandable_segments), else plain
static const uint64_t PAGE = 2ull << 20;     // the H100's VMM granularity

static uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }
static uint64_t rounded_size(uint64_t n) { return n < 512 ? 512 : round_up(n, 512); }
static bool is_small(uint64_t rounded) { return rounded <= MIB; }
static uint64_t segment_for(uint64_t rounded) {
    if (rounded <= MIB) return 2 * MIB;
    if (rounded < 10 * MIB) return 20 * MIB;
    return round_up(rounded, 2 * MIB);
}
static uint64_t block_from_fresh_segment(uint64_t rounded) {
    uint64_t seg = segment_for(rounded), rest = seg - rounded;
    bool split = is_small(rounded) ? rest >= 512 : rest > MIB;
    return split ? rounded : seg;
}

static uint64_t xorshift(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

// ------------------------------------------------------------------------------------------
// Kernels

__host__ __device__ inline uint8_t pattern_byte(uint32_t seed, uint64_t i) {
    uint32_t x = seed * 0x9E3779B1u ^ (uint32_t)i * 0x85EBCA77u ^ (uint32_t)(i >> 32) * 0xC2B2AE3Du;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    return (uint8_t)(x ^ (x >> 8) ^ (x >> 24));
}

__global__ void fill_kernel(uint8_t *p, size_t n, uint32_t seed) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        p[i] = pattern_byte(seed, i);
    }
}

__global__ void verify_kernel(const uint8_t *p, size_t n, uint32_t seed, unsigned long long *mismatches) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned long long bad = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        bad += p[i] != pattern_byte(seed, i);
    }
    if (bad) atomicAdd(mismatches, bad);
}

__device__ inline unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Host-mapped state of gate_kernel.
struct GateState {
    int open;       // host -> device: may finish
    int timed_out;  // device -> host: gave up waiting
    int running;    // device -> host: 1 while spinning
    int pad;
    unsigned long long iterations;
    unsigned long long elapsed_ns;
};

// Holds its stream until the host opens the gate and at least min_ns have passed (by the
// global timer), or gives up after max_iters polls (a bound that needs no clock).
__global__ void gate_kernel(volatile GateState *g, unsigned long long min_ns, unsigned long long max_iters) {
    g->running = 1;
    __threadfence_system();
    unsigned long long start = global_ns(), now = start, it = 0;
    for (;; it++) {
        now = global_ns();
        bool min_passed = now < start || now - start >= min_ns;
        if (min_passed && g->open != 0) break;
        if (it >= max_iters) {
            g->timed_out = 1;
            break;
        }
        __nanosleep(1000);
    }
    g->iterations = it;
    g->elapsed_ns = now - start;
    g->running = 0;
    __threadfence_system();
}

static unsigned grid_for(size_t n) { return (unsigned)std::min<size_t>((n + 255) / 256, 2048); }

static void launch_fill(void *p, size_t n, uint32_t seed, cudaStream_t s) {
    fill_kernel<<<grid_for(n), 256, 0, s>>>((uint8_t *)p, n, seed);
}

// Counter slots in device memory (plain cudaMalloc: kept out of ccalloc's statistics).
enum { SLOT_BLOCKS = 0, SLOT_CONTROL_NEG, SLOT_CHURN, SLOT_SIDE, SLOT_MAIN, SLOT_CTL_SIDE, SLOT_SMOKE,
       SLOT_THREADS = 16, NUM_SLOTS = 64 };
static unsigned long long *d_counters = nullptr;

static void launch_verify(const void *p, size_t n, uint32_t seed, int slot, cudaStream_t s) {
    verify_kernel<<<grid_for(n), 256, 0, s>>>((const uint8_t *)p, n, seed, d_counters + slot);
}

static unsigned long long read_counter(int slot) {
    unsigned long long v = ~0ull;
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(&v, d_counters + slot, sizeof v, cudaMemcpyDeviceToHost));
    return v;
}

static void reset_counter(int slot) {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemset(d_counters + slot, 0, sizeof(unsigned long long)));
}

static volatile GateState *h_gate = nullptr;
static GateState *d_gate = nullptr;

// ------------------------------------------------------------------------------------------
// ccalloc helpers

struct Block {
    void *p;
    uint64_t size;
    uint32_t seed;
    cudaStream_t stream;
};

static ccalloc_stats get_stats(int device) {
    ccalloc_stats s;
    memset(&s, 0, sizeof s);
    ccalloc_status st = ccalloc_get_stats(device, &s);
    if ((uint32_t)st != 0) CHECK(false, "ccalloc_get_stats(%d) -> %s: %s", device, name_of(st), ccalloc_last_error());
    return s;
}

static void *cc_malloc(uint64_t size, cudaStream_t s) {
    void *p = nullptr;
    ccalloc_status st = ccalloc_malloc((size_t)size, 0, s, &p);
    if ((uint32_t)st != 0 || p == nullptr) {
        CHECK(false, "ccalloc_malloc(%" PRIu64 ") -> %s: %s", size, name_of(st), ccalloc_last_error());
        return nullptr;
    }
    if ((uintptr_t)p % 512 != 0) CHECK(false, "ccalloc_malloc(%" PRIu64 ") returned misaligned %p", size, p);
    return p;
}

static bool cc_free(void *p) {
    ccalloc_status st = ccalloc_free(p, 0);
    if ((uint32_t)st != 0) {
        CHECK(false, "ccalloc_free(%p) -> %s: %s", p, name_of(st), ccalloc_last_error());
        return false;
    }
    return true;
}

static bool ranges_overlap(const void *a, uint64_t an, const void *b, uint64_t bn) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + bn && y < x + an;
}

// Number of overlapping pairs among blocks (sorted sweep).
static int count_overlaps(std::vector<Block> blocks) {
    std::sort(blocks.begin(), blocks.end(),
              [](const Block &a, const Block &b) { return (uintptr_t)a.p < (uintptr_t)b.p; });
    int n = 0;
    for (size_t i = 1; i < blocks.size(); i++) {
        if ((uintptr_t)blocks[i - 1].p + blocks[i - 1].size > (uintptr_t)blocks[i].p) n++;
    }
    return n;
}

// Copies the first and last (up to) 256 bytes back and compares them with the pattern.
static bool host_spot_check(const Block &b) {
    uint8_t buf[256];
    size_t n = (size_t)std::min<uint64_t>(b.size, sizeof buf);
    const uint64_t offsets[2] = {0, b.size - n};
    for (uint64_t off : offsets) {
        if (!CUDA_OK(cudaMemcpy(buf, (const uint8_t *)b.p + off, n, cudaMemcpyDeviceToHost))) return false;
        for (size_t i = 0; i < n; i++) {
            if (buf[i] != pattern_byte(b.seed, off + i)) return false;
        }
    }
    return true;
}

// ------------------------------------------------------------------------------------------
// Sections

static int g_device_count = 0;
static cudaStream_t s_main, s_side, s_other;

static bool test_init() {
    section("ccalloc_init on the CUDA driver");
    if (!EXPECT_STATUS(ccalloc_init(), CCALLOC_OK)) return false;
    EXPECT_STATUS(ccalloc_init(), CCALLOC_OK);
    const char *name = nullptr;
    EXPECT_STATUS(ccalloc_backend(&name), CCALLOC_OK);
    CHECK(name && !strcmp(name, "cuda"), "backend is \"cuda\" (got %s)", name ? name : "(null)");
    int32_t count = -1;
    EXPECT_STATUS(ccalloc_device_count(&count), CCALLOC_OK);
    CHECK_EQ_I64("ccalloc device count == cudaGetDeviceCount", count, g_device_count);
    ccalloc_stats s = get_stats(0), zero;
    memset(&zero, 0, sizeof zero);
    zero.max_split_size = -1;
    CHECK(memcmp(&s, &zero, sizeof s) == 0, "fresh device 0: all stats 0, max_split_size -1");
    void *sentinel = (void *)(uintptr_t)0x5eed, *p = sentinel;
    EXPECT_STATUS(ccalloc_malloc(64, g_device_count, s_main, &p), CCALLOC_INVALID_DEVICE);
    CHECK(p == sentinel, "malloc on a missing device: out_ptr untouched");
    EXPECT_STATUS(ccalloc_malloc(0, 0, s_main, &p), CCALLOC_INVALID_SIZE);
    int local = 0;
    EXPECT_STATUS(ccalloc_free(&local, 0), CCALLOC_UNKNOWN_POINTER);
    return true;
}

// The same predicted sequence as tests/c/test_api.c, on the real driver, with kernels.
static void test_exact_stats() {
    section(g_paged ? "sizes, pools and exact statistics (device 0, fresh, paged segments)"
                    : "sizes, pools and exact statistics (device 0, fresh, plain segments)");
    const uint64_t sizes[] = {1, 1000, MIB, MIB + 1, 9 * MIB, 10 * MIB, 11 * MIB + 1, 100 * MIB + 3};
    const bool from_cache[] = {false, true, true, false, true, false, false, false};
    const int n = (int)(sizeof sizes / sizeof sizes[0]);
    int64_t alloc_b[2] = {0, 0}, req_b[2] = {0, 0}, res_b[2] = {0, 0}, segs[2] = {0, 0}, cnt[2] = {0, 0};
    uint64_t carved[2] = {0, 0};  // paged: bytes carved from each pool's address range
    std::vector<Block> blocks;
    reset_counter(SLOT_BLOCKS);
    for (int i = 0; i < n; i++) {
        uint64_t r = rounded_size(sizes[i]);
        int pool = is_small(r) ? 0 : 1;
        void *p = cc_malloc(sizes[i], s_main);
        if (!p) return;
        blocks.push_back(Block{p, sizes[i], (uint32_t)(7000 + i), s_main});
        launch_fill(p, sizes[i], 7000 + i, s_main);
        uint64_t block = r;
        if (g_paged) {  // one range per pool, carved in order, pages mapped where blocks lie
            if (carved[pool] == 0) segs[pool]++;
            carved[pool] += r;
            res_b[pool] = (int64_t)round_up(carved[pool], PAGE);
        } else if (!from_cache[i]) {
            block = block_from_fresh_segment(r);
            res_b[pool] += (int64_t)segment_for(r);
            segs[pool]++;
        }
        cnt[pool]++;
        alloc_b[pool] += (int64_t)block;
        req_b[pool] += (int64_t)sizes[i];
    }
    for (const Block &b : blocks) launch_verify(b.p, b.size, b.seed, SLOT_BLOCKS, s_main);
    CHECK(CUDA_OK(cudaGetLastError()), "fill/verify kernels launched");
    CHECK_EQ_I64("mismatches in the 8 blocks", read_counter(SLOT_BLOCKS), 0);
    CHECK_EQ_I64("overlapping blocks", count_overlaps(blocks), 0);
    ccalloc_stats s = get_stats(0);
    CHECK_EQ_I64("allocation.small_pool.current", s.allocation.small_pool.current, cnt[0]);
    CHECK_EQ_I64("allocation.large_pool.current", s.allocation.large_pool.current, cnt[1]);
    CHECK_EQ_I64("allocated_bytes.small_pool.current", s.allocated_bytes.small_pool.current, alloc_b[0]);
    CHECK_EQ_I64("allocated_bytes.large_pool.current", s.allocated_bytes.large_pool.current, alloc_b[1]);
    CHECK_EQ_I64("requested_bytes.all.current", s.requested_bytes.all.current, req_b[0] + req_b[1]);
    CHECK_EQ_I64("reserved_bytes.small_pool.current", s.reserved_bytes.small_pool.current, res_b[0]);
    CHECK_EQ_I64("reserved_bytes.large_pool.current", s.reserved_bytes.large_pool.current, res_b[1]);
    CHECK_EQ_I64("segment.all.current", s.segment.all.current, segs[0] + segs[1]);
    if (!g_paged) CHECK_EQ_I64("num_device_alloc", s.num_device_alloc, segs[0] + segs[1]);
    CHECK((char *)blocks[1].p == (char *)blocks[0].p + 512 && (char *)blocks[2].p == (char *)blocks[1].p + 1024,
          "small blocks carved in order from one segment");
    cudaPointerAttributes attr;
    memset(&attr, 0, sizeof attr);
    if (CUDA_OK(cudaPointerGetAttributes(&attr, blocks[7].p))) {
        CHECK(attr.type == cudaMemoryTypeDevice && attr.device == 0,
              "cudaPointerGetAttributes: device memory on device 0 (type %d, device %d)", (int)attr.type,
              attr.device);
    }
    for (const Block &b : blocks) cc_free(b.p);
    s = get_stats(0);
    CHECK_EQ_I64("allocation.all.current after freeing", s.allocation.all.current, 0);
    CHECK_EQ_I64("allocated_bytes.all.peak", s.allocated_bytes.all.peak, alloc_b[0] + alloc_b[1]);
    EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);
    s = get_stats(0);
    CHECK_EQ_I64("reserved_bytes.all.current after empty_cache", s.reserved_bytes.all.current, 0);
    if (!g_paged) CHECK_EQ_I64("num_device_free after empty_cache", s.num_device_free, segs[0] + segs[1]);
    EXPECT_STATUS(ccalloc_reset_peak_stats(-1), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_reset_accumulated_stats(-1), CCALLOC_OK);
}

static void test_many_blocks() {
    section("many blocks of assorted sizes, written and verified by kernels");
    std::vector<uint64_t> sizes = {1, 7, 511, 512, 513, 4095, 4096, 65537, MIB - 1, MIB, MIB + 1,
                                   3 * MIB + 5, 9 * MIB + 7, 10 * MIB, 11 * MIB + 1, 20 * MIB, 64 * MIB + 3};
    if (!g_quick) {
        sizes.push_back(100 * MIB + 513);
        sizes.push_back(300 * MIB + 1);
        sizes.push_back(700 * MIB);
    }
    uint64_t rng = 12345;
    int random_count = g_quick ? 40 : 300;
    for (int i = 0; i < random_count; i++) {
        uint64_t k = xorshift(&rng) % 100;
        sizes.push_back(k < 50   ? 1 + xorshift(&rng) % (64 * KIB)
                        : k < 90 ? 1 + xorshift(&rng) % (4 * MIB)
                                 : 1 + xorshift(&rng) % (24 * MIB));
    }
    std::vector<Block> blocks;
    uint64_t requested = 0;
    reset_counter(SLOT_BLOCKS);
    for (size_t i = 0; i < sizes.size(); i++) {
        cudaStream_t s = i % 3 == 2 ? s_other : s_main;
        void *p = cc_malloc(sizes[i], s);
        if (!p) break;
        blocks.push_back(Block{p, sizes[i], (uint32_t)(100 + i), s});
        launch_fill(p, sizes[i], 100 + (uint32_t)i, s);
        requested += sizes[i];
    }
    for (const Block &b : blocks) launch_verify(b.p, b.size, b.seed, SLOT_BLOCKS, b.stream);
    CUDA_OK(cudaGetLastError());
    uint64_t total = 0;
    for (const Block &b : blocks) total += b.size;
    CHECK_EQ_I64("mismatches over all blocks", read_counter(SLOT_BLOCKS), 0);
    printf("      (%zu blocks, %.1f MiB requested)\n", blocks.size(), (double)total / MIB);
    CHECK_EQ_I64("overlapping blocks", count_overlaps(blocks), 0);
    int spot_bad = 0;
    for (size_t i = 0; i < blocks.size(); i += 7) spot_bad += !host_spot_check(blocks[i]);
    CHECK(spot_bad == 0, "host copies of block heads and tails match the pattern (%d bad)", spot_bad);
    // negative control: the verifier does see a wrong pattern
    reset_counter(SLOT_CONTROL_NEG);
    const Block &big = *std::max_element(blocks.begin(), blocks.end(),
                                         [](const Block &a, const Block &b) { return a.size < b.size; });
    launch_verify(big.p, big.size, big.seed + 1, SLOT_CONTROL_NEG, big.stream);
    unsigned long long wrong = read_counter(SLOT_CONTROL_NEG);
    CHECK(wrong > big.size / 2, "control: verifying with the wrong seed finds mismatches (%llu of %" PRIu64 ")",
          wrong, big.size);

    ccalloc_stats s = get_stats(0);
    CHECK_EQ_I64("allocation.all.current", s.allocation.all.current, (int64_t)blocks.size());
    CHECK_EQ_I64("requested_bytes.all.current", s.requested_bytes.all.current, (int64_t)requested);
    CHECK(s.allocated_bytes.all.current >= (int64_t)requested, "allocated_bytes >= requested");
    CHECK(s.reserved_bytes.all.current >= s.allocated_bytes.all.current, "reserved_bytes >= allocated_bytes");
    CHECK(s.reserved_bytes.all.current % (int64_t)(2 * MIB) == 0, "reserved_bytes is a multiple of 2 MiB");
    if (!g_paged) {  // paged: the driver calls are page maps
        CHECK_EQ_I64("segment.all.current == num_device_alloc - num_device_free", s.segment.all.current,
                     (int64_t)(s.num_device_alloc - s.num_device_free));
    }

    // realloc churn over the same set: free every other block and allocate new sizes
    reset_counter(SLOT_BLOCKS);
    for (size_t i = 0; i < blocks.size(); i += 2) {
        launch_verify(blocks[i].p, blocks[i].size, blocks[i].seed, SLOT_BLOCKS, blocks[i].stream);
        cc_free(blocks[i].p);
        uint64_t size = 1 + xorshift(&rng) % (blocks[i].size * 2 + 1);
        void *p = cc_malloc(size, blocks[i].stream);
        if (!p) {
            blocks[i].p = nullptr;
            continue;
        }
        blocks[i] = Block{p, size, (uint32_t)(50000 + i), blocks[i].stream};
        launch_fill(p, size, blocks[i].seed, blocks[i].stream);
    }
    blocks.erase(std::remove_if(blocks.begin(), blocks.end(), [](const Block &b) { return b.p == nullptr; }),
                 blocks.end());
    for (const Block &b : blocks) launch_verify(b.p, b.size, b.seed, SLOT_BLOCKS, b.stream);
    CHECK_EQ_I64("mismatches after realloc churn", read_counter(SLOT_BLOCKS), 0);
    CHECK_EQ_I64("overlapping blocks after realloc churn", count_overlaps(blocks), 0);
    for (const Block &b : blocks) cc_free(b.p);
    s = get_stats(0);
    CHECK_EQ_I64("allocation.all.current after freeing all", s.allocation.all.current, 0);
    CHECK_EQ_I64("requested_bytes.all.current after freeing all", s.requested_bytes.all.current, 0);
}

// Random alloc/free on two streams; some blocks are read on the other stream (event + record).
static void test_churn() {
    section("churn on two streams with cross-stream use");
    const int slots = 64, iterations = g_quick ? 800 : 6000;
    std::vector<Block> live(slots, Block{nullptr, 0, 0, nullptr});
    cudaStream_t streams[2] = {s_main, s_other};
    cudaEvent_t ev;
    if (!CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming))) return;
    uint64_t rng = 777;
    int overlaps = 0, records = 0, allocs = 0, record_failures = 0;
    char first_failure[512] = "";
    reset_counter(SLOT_CHURN);
    for (int it = 0; it < iterations; it++) {
        int i = (int)(xorshift(&rng) % slots);
        Block &b = live[i];
        if (b.p == nullptr) {
            uint64_t k = xorshift(&rng) % 100;
            uint64_t size = k < 70 ? 1 + xorshift(&rng) % (64 * KIB)
                            : k < 95 ? 1 + xorshift(&rng) % (4 * MIB)
                                     : 1 + xorshift(&rng) % (48 * MIB);
            cudaStream_t s = streams[xorshift(&rng) % 2];
            void *p = cc_malloc(size, s);
            if (!p) continue;
            for (const Block &o : live) overlaps += o.p && ranges_overlap(o.p, o.size, p, size);
            b = Block{p, size, (uint32_t)(0x10000 + it), s};
            launch_fill(p, size, b.seed, s);
            allocs++;
        } else {
            if (xorshift(&rng) % 5 == 0) {
                cudaStream_t other = b.stream == s_main ? s_other : s_main;
                CUDA_OK(cudaEventRecord(ev, b.stream));
                CUDA_OK(cudaStreamWaitEvent(other, ev, 0));
                launch_verify(b.p, b.size, b.seed, SLOT_CHURN, other);
                ccalloc_status st = ccalloc_record_stream(b.p, 0, other);
                if ((uint32_t)st != 0 && record_failures++ == 0) {
                    snprintf(first_failure, sizeof first_failure, "%s: %s", name_of(st), ccalloc_last_error());
                }
                records++;
            } else {
                launch_verify(b.p, b.size, b.seed, SLOT_CHURN, b.stream);
            }
            cc_free(b.p);
            b.p = nullptr;
        }
        if (it % 1500 == 1499) EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);  // with kernels in flight
    }
    for (Block &b : live) {
        if (b.p) {
            launch_verify(b.p, b.size, b.seed, SLOT_CHURN, b.stream);
            cc_free(b.p);
            b.p = nullptr;
        }
    }
    CUDA_OK(cudaGetLastError());
    CHECK_EQ_I64("churn: mismatches", read_counter(SLOT_CHURN), 0);
    CHECK(overlaps == 0, "churn: %d allocations, %d cross-stream uses, %d overlaps with live blocks", allocs,
          records, overlaps);
    CHECK(record_failures == 0, "churn: every ccalloc_record_stream succeeded (%d failed%s%s)", record_failures,
          record_failures ? "; first: " : "", first_failure);
    ccalloc_stats s = get_stats(0);
    CHECK_EQ_I64("churn: allocation.all.current at the end", s.allocation.all.current, 0);
    CHECK(s.active.all.current >= 0, "churn: active.all.current %" PRId64 " (blocks awaiting events)",
          s.active.all.current);
    CUDA_OK(cudaEventDestroy(ev));
}

// Waits until `s` has finished its queued work, up to `limit_ms`; true if it did.
static bool wait_stream_idle(cudaStream_t s, int limit_ms) {
    auto start = std::chrono::steady_clock::now();
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return true;
        if (e != cudaErrorNotReady) {
            CUDA_OK(e);
            return false;
        }
        if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(limit_ms)) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

static const unsigned long long kGateMinNs = 200ull * 1000 * 1000;  // 200 ms
static const unsigned long long kGateMaxPolls = 20ull * 1000 * 1000;  // >= 20 s at ~1 us a poll

static void close_gate() {
    h_gate->open = 0;
    h_gate->timed_out = 0;
    h_gate->running = 0;
    h_gate->iterations = 0;
    h_gate->elapsed_ns = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

static void open_gate() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    h_gate->open = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

static void launch_gate(cudaStream_t s) {
    close_gate();
    gate_kernel<<<1, 1, 0, s>>>(d_gate, kGateMinNs, kGateMaxPolls);
}

static void note_gate(const char *which) {
    note("%s gate kernel: %llu polls, %.1f ms by the global timer%s", which, (unsigned long long)h_gate->iterations,
         (double)h_gate->elapsed_ns / 1e6, h_gate->timed_out ? ", TIMED OUT" : "");
}

// A block used on a side stream that is still busy is freed; same-size requests on the
// allocation stream must not get it until the side stream's work (a held kernel) is done.
static void test_record_stream() {
    section("record_stream: freed while a side stream still runs a kernel on it");
    const uint64_t size = g_quick ? 16 * MIB : 64 * MIB;  // >= 10 MiB: its own segment
    const uint32_t seed_a = 0xA11CE, seed_b = 0xB0B;
    cudaEvent_t ev;
    if (!CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming))) return;
    CUDA_OK(cudaDeviceSynchronize());
    // Start from an empty cache, then cache exactly the blocks used below (4 of `size`, one of
    // size/2): no cuMemAlloc happens while the side kernel is held. (cuMemAlloc may wait for
    // running kernels; under compute-sanitizer it does, which would stall until the timeout.)
    EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);
    {
        std::vector<void *> warm;
        for (int i = 0; i < 4; i++) warm.push_back(cc_malloc(size, s_main));
        warm.push_back(cc_malloc(size / 2, s_main));
        for (void *w : warm) {
            if (w) cc_free(w);
        }
    }
    reset_counter(SLOT_SIDE);
    reset_counter(SLOT_MAIN);
    ccalloc_stats s0 = get_stats(0);

    void *p = cc_malloc(size, s_main);
    if (!p) return;
    launch_fill(p, size, seed_a, s_main);
    CUDA_OK(cudaEventRecord(ev, s_main));
    CUDA_OK(cudaStreamWaitEvent(s_side, ev, 0));
    launch_gate(s_side);
    launch_verify(p, size, seed_a, SLOT_SIDE, s_side);   // nobody wrote p meanwhile
    launch_fill(p, size, seed_b, s_side);                // the side stream still owns p
    launch_verify(p, size, seed_b, SLOT_SIDE, s_side);
    CUDA_OK(cudaGetLastError());
    EXPECT_STATUS(ccalloc_record_stream(p, 0, s_side), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_free(p, 0), CCALLOC_OK);

    ccalloc_stats s = get_stats(0);
    CHECK_EQ_I64("allocation.current after the free", s.allocation.all.current, s0.allocation.all.current);
    CHECK_EQ_I64("active.current still counts the block awaiting the side stream", s.active.all.current,
                 s0.active.all.current + 1);
    EXPECT_STATUS(ccalloc_free(p, 0), CCALLOC_DOUBLE_FREE);

    // Same size (and half size) at once on the allocation stream; fill them there.
    std::vector<Block> fresh;
    for (int i = 0; i < 3; i++) {
        void *q = cc_malloc(size, s_main);
        if (q) fresh.push_back(Block{q, size, (uint32_t)(0xC0DE + i), s_main});
    }
    void *h = cc_malloc(size / 2, s_main);
    if (h) fresh.push_back(Block{h, size / 2, 0xC0DE + 9, s_main});
    int overlapping = 0;
    for (const Block &b : fresh) {
        overlapping += ranges_overlap(b.p, b.size, p, size);
        launch_fill(b.p, b.size, b.seed, s_main);
    }
    CHECK(overlapping == 0 && fresh.size() == 4,
          "4 new blocks on the allocation stream while the side kernel runs: none overlaps the freed block "
          "(%d do)", overlapping);
    bool concurrent = wait_stream_idle(s_main, 10000);
    note("before opening the gate: gate kernel running=%d timed_out=%d, allocation stream idle=%d", h_gate->running,
         h_gate->timed_out, (int)concurrent);
    CHECK(h_gate->timed_out == 0 && cudaStreamQuery(s_side) == cudaErrorNotReady,
          "the side stream was still busy when the allocation stream wrote its new blocks");
    if (!concurrent) note("the allocation stream did not finish while the side kernel was held (kernels serialized, "
                          "e.g. under compute-sanitizer): the device-side overwrite check is weaker");
    s = get_stats(0);
    CHECK_EQ_I64("active.current while the side stream runs (4 live + 1 awaiting)", s.active.all.current,
                 s0.active.all.current + 5);
    CHECK_EQ_I64("num_device_alloc: all of them came from the cache", s.num_device_alloc, s0.num_device_alloc);
    open_gate();
    CUDA_OK(cudaStreamSynchronize(s_side));
    CUDA_OK(cudaStreamSynchronize(s_main));
    note_gate("side");
    CHECK(h_gate->timed_out == 0, "the held side kernel was released by the host, not by its timeout");
    CHECK_EQ_I64("side stream: mismatches in the freed block (it was never overwritten)", read_counter(SLOT_SIDE), 0);
    for (const Block &b : fresh) launch_verify(b.p, b.size, b.seed, SLOT_MAIN, s_main);
    CHECK_EQ_I64("allocation stream: mismatches in the new blocks", read_counter(SLOT_MAIN), 0);

    // The side stream is done: the block is reusable now.
    void *again = cc_malloc(size, s_main);
    CHECK(again == p, "after the side stream finished, the block is reused (%p, freed %p)", again, p);
    s = get_stats(0);
    CHECK_EQ_I64("active.current == allocation.current again", s.active.all.current, s.allocation.all.current);
    if (again) cc_free(again);
    for (const Block &b : fresh) cc_free(b.p);

    // Control: without record_stream the block IS reused at once, and the side stream sees it.
    section("control: the same without record_stream");
    const uint64_t csize = 32 * MIB;
    reset_counter(SLOT_CTL_SIDE);
    void *c = cc_malloc(csize, s_main);
    if (c) {
        launch_fill(c, csize, seed_a, s_main);
        CUDA_OK(cudaEventRecord(ev, s_main));
        CUDA_OK(cudaStreamWaitEvent(s_side, ev, 0));
        launch_gate(s_side);
        launch_verify(c, csize, seed_a, SLOT_CTL_SIDE, s_side);
        cc_free(c);  // no record_stream: a bug in the caller
        void *q = cc_malloc(csize, s_main);
        CHECK(q == c, "without record_stream the block is handed out again at once (%p == %p)", q, c);
        if (q) launch_fill(q, csize, seed_b, s_main);
        bool conc = wait_stream_idle(s_main, 10000);
        open_gate();
        CUDA_OK(cudaStreamSynchronize(s_side));
        note_gate("control");
        unsigned long long seen = read_counter(SLOT_CTL_SIDE);
        if (conc) {
            CHECK(seen > csize / 2,
                  "control: the side stream saw the block overwritten (%llu mismatches): the check above can fail",
                  seen);
        } else {
            note("control skipped: kernels were serialized (%llu mismatches seen)", seen);
        }
        if (q) cc_free(q);
    }
    CUDA_OK(cudaEventDestroy(ev));
    CUDA_OK(cudaDeviceSynchronize());
}

static std::mutex g_streams_lock;
static std::vector<cudaStream_t> g_streams_to_destroy;

// Host threads, each with its own stream, allocating, filling, verifying and freeing.
static void test_threads() {
    section("4 host threads, own streams");
    const int threads = 4, iterations = g_quick ? 150 : 1500, max_live = 16;
    std::mutex registry_lock;
    std::vector<Block> registry;  // live blocks of all threads
    std::atomic<int> failures(0), overlaps(0);
    std::atomic<long long> allocs(0);
    std::string first_failure;
    std::mutex failure_lock;
    for (int t = 0; t < threads; t++) reset_counter(SLOT_THREADS + t);
    auto fail = [&](const char *what, ccalloc_status st) {
        if (failures++ == 0) {
            std::lock_guard<std::mutex> lock(failure_lock);
            first_failure = std::string(what) + " -> " + name_of(st) + ": " + ccalloc_last_error();
        }
    };
    auto worker = [&](int t) {
        cudaStream_t s;
        if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
            fail("cudaStreamCreateWithFlags", CCALLOC_OK);
            return;
        }
        uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(t + 1);
        std::vector<Block> live;
        for (int it = 0; it < iterations; it++) {
            if (live.size() < (size_t)max_live && (live.empty() || xorshift(&rng) % 100 < 55)) {
                uint64_t k = xorshift(&rng) % 100;
                uint64_t size = k < 70 ? 1 + xorshift(&rng) % (64 * KIB)
                                : k < 97 ? 1 + xorshift(&rng) % (2 * MIB)
                                         : 1 + xorshift(&rng) % (24 * MIB);
                void *p = nullptr;
                ccalloc_status st = ccalloc_malloc((size_t)size, 0, s, &p);
                if ((uint32_t)st != 0 || !p) {
                    fail("malloc", st);
                    continue;
                }
                Block b{p, size, (uint32_t)((t << 24) | it), s};
                {
                    std::lock_guard<std::mutex> lock(registry_lock);
                    for (const Block &o : registry) overlaps += ranges_overlap(o.p, o.size, p, size);
                    registry.push_back(b);
                }
                launch_fill(p, size, b.seed, s);
                live.push_back(b);
                allocs++;
            } else {
                size_t i = (size_t)(xorshift(&rng) % live.size());
                Block b = live[i];
                live[i] = live.back();
                live.pop_back();
                launch_verify(b.p, b.size, b.seed, SLOT_THREADS + t, s);
                {
                    std::lock_guard<std::mutex> lock(registry_lock);
                    for (size_t j = 0; j < registry.size(); j++) {
                        if (registry[j].p == b.p) {
                            registry[j] = registry.back();
                            registry.pop_back();
                            break;
                        }
                    }
                }
                ccalloc_status st = ccalloc_free(b.p, 0);
                if ((uint32_t)st != 0) fail("free", st);
            }
        }
        for (const Block &b : live) {
            launch_verify(b.p, b.size, b.seed, SLOT_THREADS + t, s);
            {
                std::lock_guard<std::mutex> lock(registry_lock);
                for (size_t j = 0; j < registry.size(); j++) {
                    if (registry[j].p == b.p) {
                        registry[j] = registry.back();
                        registry.pop_back();
                        break;
                    }
                }
            }
            ccalloc_status st = ccalloc_free(b.p, 0);
            if ((uint32_t)st != 0) fail("free", st);
        }
        if (cudaStreamSynchronize(s) != cudaSuccess || cudaGetLastError() != cudaSuccess) fail("kernels", CCALLOC_OK);
        // Destroyed at the very end: test_destroyed_stream covers a stream destroyed while
        // ccalloc still caches memory freed on it, and may crash.
        std::lock_guard<std::mutex> lock(g_streams_lock);
        g_streams_to_destroy.push_back(s);
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; t++) pool.emplace_back(worker, t);
    for (std::thread &th : pool) th.join();
    CHECK(failures == 0, "threads: %lld allocations, %d failures%s%s", (long long)allocs, (int)failures,
          failures ? "; first: " : "", first_failure.c_str());
    CHECK(overlaps == 0, "threads: %d allocations overlapped a live block", (int)overlaps);
    unsigned long long mismatches = 0;
    for (int t = 0; t < threads; t++) mismatches += read_counter(SLOT_THREADS + t);
    CHECK_EQ_I64("threads: mismatches", mismatches, 0);
    CHECK_EQ_I64("threads: registry empty", registry.size(), 0);
    ccalloc_stats s = get_stats(0);
    CHECK_EQ_I64("threads: allocation.all.current at the end", s.allocation.all.current, 0);
}

static void test_empty_cache() {
    section("empty_cache returns memory to the driver");
    const uint64_t size = g_quick ? 256 * MIB : GIB;
    void *p = cc_malloc(size, s_main);
    if (p) {
        launch_fill(p, size, 99, s_main);
        cc_free(p);
    }
    CUDA_OK(cudaDeviceSynchronize());
    ccalloc_stats s = get_stats(0);
    int64_t reserved = s.reserved_bytes.all.current;
    CHECK(reserved >= (int64_t)size, "reserved (%" PRId64 ") holds the freed %" PRIu64 " bytes", reserved, size);
    CHECK_EQ_I64("nothing allocated", s.allocation.all.current, 0);
    size_t free0 = 0, free1 = 0, total = 0;
    CUDA_OK(cudaMemGetInfo(&free0, &total));
    EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);
    CUDA_OK(cudaMemGetInfo(&free1, &total));
    s = get_stats(0);
    CHECK_EQ_I64("reserved_bytes.all.current after empty_cache", s.reserved_bytes.all.current, 0);
    CHECK_EQ_I64("segment.all.current after empty_cache", s.segment.all.current, 0);
    CHECK((double)free1 - (double)free0 >= 0.9 * (double)reserved,
          "cudaMemGetInfo: free memory grew by %.1f MiB (reserved was %.1f MiB)",
          ((double)free1 - (double)free0) / MIB, (double)reserved / MIB);
    EXPECT_STATUS(ccalloc_empty_cache(-1), CCALLOC_OK);
}

static void test_oom() {
    section("out of memory");
    size_t free_mem = 0, total_mem = 0;
    CUDA_OK(cudaMemGetInfo(&free_mem, &total_mem));
    void *sentinel = (void *)(uintptr_t)0xabcdef, *p = sentinel;
    ccalloc_stats s0 = get_stats(0), s;

    // more than the device has at all
    EXPECT_STATUS(ccalloc_malloc(2 * (size_t)total_mem, 0, s_main, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "2 x device memory: out_ptr untouched");
    EXPECT_MSG_HAS("out of memory");
    EXPECT_STATUS(ccalloc_malloc(SIZE_MAX, 0, s_main, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "SIZE_MAX: out_ptr untouched");

    // a small memory fraction
    const double fraction = 0.01;
    const uint64_t limit = (uint64_t)(fraction * (double)total_mem);
    EXPECT_STATUS(ccalloc_set_memory_fraction(fraction, 0), CCALLOC_OK);
    double f = -1;
    EXPECT_STATUS(ccalloc_get_memory_fraction(0, &f), CCALLOC_OK);
    CHECK(f == fraction, "fraction reads back %g (got %g)", fraction, f);
    s0 = get_stats(0);
    EXPECT_STATUS(ccalloc_malloc((size_t)(limit + 64 * MIB), 0, s_main, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "over the fraction: out_ptr untouched");
    EXPECT_MSG_HAS("per_process_memory_fraction");
    EXPECT_MSG_HAS("reserved");
    EXPECT_MSG_HAS("live");
    EXPECT_MSG_HAS("largest");
    s = get_stats(0);
    CHECK_EQ_I64("num_ooms + 1", s.num_ooms, s0.num_ooms + 1);
    CHECK_EQ_I64("reserved unchanged by the refused request", s.reserved_bytes.all.current,
                 s0.reserved_bytes.all.current);
    void *a = cc_malloc(limit / 2, s_main);
    CHECK(a != nullptr, "half the limit (%" PRIu64 " MiB) still fits", limit / 2 / MIB);
    p = sentinel;
    EXPECT_STATUS(ccalloc_malloc((size_t)(limit / 2 + 32 * MIB), 0, s_main, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "the second half plus a bit: out_ptr untouched");
    s = get_stats(0);
    CHECK(s.reserved_bytes.all.current <= (int64_t)limit, "reserved (%" PRId64 ") stays within the limit (%" PRIu64 ")",
          s.reserved_bytes.all.current, limit);
    EXPECT_STATUS(ccalloc_set_memory_fraction(1.0, 0), CCALLOC_OK);
    void *b = cc_malloc(limit / 2 + 32 * MIB, s_main);
    CHECK(b != nullptr, "with the fraction back at 1.0 the request succeeds");
    if (a) cc_free(a);
    if (b) cc_free(b);
    EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);

    // the driver itself refusing (cuMemAlloc fails)
    if (!g_driver_oom) {
        note("driver-level OOM skipped (--no-driver-oom)");
        return;
    }
    CUDA_OK(cudaMemGetInfo(&free_mem, &total_mem));
    // more than is free, less than the device has: passes ccalloc's own checks, cuMemAlloc fails
    uint64_t too_much = (uint64_t)free_mem + ((uint64_t)total_mem - (uint64_t)free_mem) / 2 + 2 * MIB;
    s0 = get_stats(0);
    p = sentinel;
    EXPECT_STATUS(ccalloc_malloc((size_t)too_much, 0, s_main, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "driver OOM: out_ptr untouched");
    EXPECT_MSG_HAS("reserved");
    EXPECT_MSG_HAS("live");
    EXPECT_MSG_HAS("largest");
    s = get_stats(0);
    CHECK_EQ_I64("driver OOM: num_ooms + 1", s.num_ooms, s0.num_ooms + 1);
    CHECK_EQ_I64("driver OOM: reserved unchanged by the refused request", s.reserved_bytes.all.current,
                 s0.reserved_bytes.all.current);
    CHECK(CUDA_OK(cudaGetLastError()) && CUDA_OK(cudaDeviceSynchronize()), "no sticky CUDA error after the driver OOM");
    reset_counter(SLOT_SMOKE);
    void *q = cc_malloc(MIB, s_main);
    if (q) {
        launch_fill(q, MIB, 5, s_main);
        launch_verify(q, MIB, 5, SLOT_SMOKE, s_main);
        CHECK_EQ_I64("a block allocated after the driver OOM works", read_counter(SLOT_SMOKE), 0);
        cc_free(q);
    }
}

static void test_shutdown() {
    section("shutdown and restart");
    void *p = cc_malloc(4096, s_main);
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_BUSY);
    EXPECT_MSG_HAS("live");
    if (p) cc_free(p);
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_OK);
    void *sentinel = (void *)(uintptr_t)0x77, *q = sentinel;
    EXPECT_STATUS(ccalloc_malloc(64, 0, s_main, &q), CCALLOC_SHUT_DOWN);
    CHECK(q == sentinel, "malloc after shutdown: out_ptr untouched");
    ccalloc_stats s;
    EXPECT_STATUS(ccalloc_get_stats(0, &s), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_init(), CCALLOC_OK);
    s = get_stats(0);
    CHECK_EQ_I64("restarted: reserved", s.reserved_bytes.all.current, 0);
    reset_counter(SLOT_SMOKE);
    q = cc_malloc(3 * MIB, s_main);
    if (q) {
        launch_fill(q, 3 * MIB, 11, s_main);
        launch_verify(q, 3 * MIB, 11, SLOT_SMOKE, s_main);
        CHECK_EQ_I64("restarted: kernels on a new block", read_counter(SLOT_SMOKE), 0);
        cc_free(q);
    }
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_OK);
}

// An application stream is destroyed once everything allocated on it is freed (its cached
// blocks stay with ccalloc); later allocations and empty_cache must not touch that stream.
// Runs last: a library that synchronizes the dead stream may crash here (that is the bug).
static void test_destroyed_stream() {
    section("a stream destroyed after its blocks were freed");
    note("a crash in this section means ccalloc used a stream the application had destroyed");
    if (!EXPECT_STATUS(ccalloc_init(), CCALLOC_OK)) return;
    cudaStream_t x;
    if (!CUDA_OK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking))) return;
    const uint64_t size = 64 * MIB;
    reset_counter(SLOT_SMOKE);
    void *p = cc_malloc(size, x);
    if (p) {
        launch_fill(p, size, 1234, x);
        launch_verify(p, size, 1234, SLOT_SMOKE, x);
        CUDA_OK(cudaStreamSynchronize(x));
        cc_free(p);
    }
    CUDA_OK(cudaStreamDestroy(x));
    // Grow on another stream past what is live (paged segments then take pages from under
    // free blocks, the dead stream's included), then empty the cache.
    std::vector<void *> big;
    for (int i = 0; i < 4; i++) {
        void *q = cc_malloc(size, s_main);
        if (q) {
            launch_fill(q, size, 77 + i, s_main);
            launch_verify(q, size, 77 + i, SLOT_SMOKE, s_main);
            big.push_back(q);
        }
    }
    CHECK(big.size() == 4, "4 x 64 MiB on another stream after the stream was destroyed");
    CHECK_EQ_I64("mismatches", read_counter(SLOT_SMOKE), 0);
    for (void *q : big) cc_free(q);
    EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);
    CHECK_EQ_I64("reserved after empty_cache", get_stats(0).reserved_bytes.all.current, 0);
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_OK);
}

int main(int argc, char **argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) g_quick = true;
        else if (!strcmp(argv[i], "--no-driver-oom")) g_driver_oom = false;
        else if (!strcmp(argv[i], "--no-held-kernel")) g_held_kernel = false;
        else if (!strcmp(argv[i], "--sanitizer")) g_quick = true, g_driver_oom = false, g_held_kernel = false;
        else {
            fprintf(stderr, "usage: %s [--quick] [--no-driver-oom] [--no-held-kernel] [--sanitizer]\n", argv[0]);
            return 2;
        }
    }
    if (getenv("CCALLOC_BACKEND")) {
        note("unsetting CCALLOC_BACKEND=%s: this test runs on the CUDA driver", getenv("CCALLOC_BACKEND"));
        unsetenv("CCALLOC_BACKEND");
    }
    if (const char *conf = getenv("CCALLOC_CONF")) {
        if (!strcmp(conf, "expandable_segments:False")) {
            g_paged = false;
        } else if (!strcmp(conf, "per_stream_shards:True")) {
            // An allocator per stream: every check here holds as well (none reads a peak
            // across streams, the one statistic that differs).
        } else if (conf[0] != '\0' && strcmp(conf, "expandable_segments:True") != 0) {
            fprintf(stderr,
                    "CCALLOC_CONF=%s: this test allows only expandable_segments:True or :False, or "
                    "per_stream_shards:True\n",
                    conf);
            return 2;
        }
    }
    section("CUDA setup");
    bool ready = CUDA_OK(cudaGetDeviceCount(&g_device_count)) && g_device_count > 0;
    CHECK(ready, "a CUDA device is present (%d)", g_device_count);
    if (ready) {
        cudaDeviceProp prop;
        ready = CUDA_OK(cudaSetDevice(0)) && CUDA_OK(cudaFree(nullptr)) && CUDA_OK(cudaGetDeviceProperties(&prop, 0));
        if (ready) {
            int driver = 0, runtime = 0;
            cudaDriverGetVersion(&driver);
            cudaRuntimeGetVersion(&runtime);
            note("%s, %.1f GiB, sm_%d%d, driver %d, runtime %d, %d device(s), %s, %s segments", prop.name,
                 (double)prop.totalGlobalMem / GIB, prop.major, prop.minor, driver, runtime, g_device_count,
                 g_quick ? "quick" : "full", g_paged ? "paged" : "plain");
        }
        ready = ready && CUDA_OK(cudaMalloc((void **)&d_counters, NUM_SLOTS * sizeof(unsigned long long))) &&
                CUDA_OK(cudaMemset(d_counters, 0, NUM_SLOTS * sizeof(unsigned long long)));
        GateState *host_gate = nullptr;
        ready = ready && CUDA_OK(cudaHostAlloc((void **)&host_gate, sizeof(GateState), cudaHostAllocMapped)) &&
                CUDA_OK(cudaHostGetDevicePointer((void **)&d_gate, host_gate, 0));
        h_gate = host_gate;
        ready = ready && CUDA_OK(cudaStreamCreateWithFlags(&s_main, cudaStreamNonBlocking)) &&
                CUDA_OK(cudaStreamCreateWithFlags(&s_side, cudaStreamNonBlocking)) &&
                CUDA_OK(cudaStreamCreateWithFlags(&s_other, cudaStreamNonBlocking));
    }
    if (ready && test_init()) {
        test_exact_stats();
        test_many_blocks();
        test_churn();
        if (g_held_kernel) {
            test_record_stream();
        } else {
            note("record_stream with a held side-stream kernel skipped (--no-held-kernel)");
        }
        test_threads();
        test_empty_cache();
        test_oom();
        test_shutdown();
        test_destroyed_stream();
        CHECK(CUDA_OK(cudaDeviceSynchronize()) && CUDA_OK(cudaGetLastError()), "no CUDA error at the end");
    }
    for (cudaStream_t s : g_streams_to_destroy) cudaStreamDestroy(s);
    if (d_counters) cudaFree(d_counters);
    if (h_gate) cudaFreeHost((void *)h_gate);
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
