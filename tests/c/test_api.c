/* C API test of libccalloc on the simulated backend.
 *
 * Build (the Rust test tests/c_api.rs does this for `cargo test`):
 *   cc -std=c11 -Wall -Wextra -Werror -Iinclude tests/c/test_api.c \
 *      -Ltarget/debug -lccalloc -lpthread -Wl,-rpath,$PWD/target/debug -o test_api
 * Run:
 *   CCALLOC_BACKEND=sim CCALLOC_SIM_CAPACITY=1GiB CCALLOC_SIM_DEVICES=2 ./test_api
 * (unset variables get exactly those defaults; another backend is refused).
 *
 * Sim memory is real host memory, so every block gets canary bytes written into it, and the
 * test checks that live blocks never overlap and are never overwritten. Expected statistics
 * are computed here from the sizing rules (PyTorch's): blocks round up to 512 B; requests of
 * at most 1 MiB are small-pool blocks, larger ones large-pool blocks. The segments behind them
 * depend on the mode:
 *   plain segments (CCALLOC_CONF=expandable_segments:False, or CCALLOC_SIM_VMM=0): small
 *     blocks come from 2 MiB segments, large ones from 20 MiB segments below 10 MiB and from
 *     a segment of their own rounded up to 2 MiB from 10 MiB on;
 *   paged segments (the default): one address range per (stream, pool), carved in order, with
 *     2 MiB pages mapped where blocks lie; reserved memory is the pages mapped.
 * CCALLOC_CONF may hold only expandable_segments:True/False here; tests/c_api.rs runs both.
 *
 * Output: one line per check ("PASS  ..." or "FAIL  ... [test_api.c:LINE]"), section headers
 * starting with "==", and a last line "N passed, M failed". Exit status 1 when any check failed.
 *
 * This file is also compiled as C++ (g++ -x c++) to prove the headers are C++-clean, so it
 * avoids C-only constructs (implicit void* conversions, designated initializers, VLAs). */

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "ccalloc_sim.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* Reporting                                                                                   */

static int g_passed;
static int g_failed;
static pthread_mutex_t g_report_lock = PTHREAD_MUTEX_INITIALIZER;

#if defined(__GNUC__)
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define PRINTF_LIKE(f, a)
#endif

static bool check_at(bool ok, int line, const char *fmt, ...) PRINTF_LIKE(3, 4);

static bool check_at(bool ok, int line, const char *fmt, ...) {
    va_list ap;
    pthread_mutex_lock(&g_report_lock);
    fputs(ok ? "PASS  " : "FAIL  ", stdout);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    if (!ok) {
        printf("  [test_api.c:%d]", line);
    }
    putchar('\n');
    if (ok) {
        g_passed++;
    } else {
        g_failed++;
    }
    fflush(stdout);
    pthread_mutex_unlock(&g_report_lock);
    return ok;
}

#define CHECK(cond, ...) check_at((cond), __LINE__, __VA_ARGS__)

static void section(const char *name) {
    printf("== %s\n", name);
    fflush(stdout);
}

/* The message of the last failed call, copied (ccalloc's pointer is valid only until the
 * thread's next failing call). */
static char g_msg[2048];

static const char *name_of(uint32_t status) { return ccalloc_status_name(status); }

/* Checks a call's status; for a failure also that it left a message. Keeps the message. */
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
    bool has_msg = msg != NULL && msg[0] != '\0';
    return check_at(g == want && has_msg, line, "%s -> %s (want %s%s) msg: \"%s\"", what, name_of(g),
                    name_of(want), has_msg ? "" : ", and a message", g_msg);
}

#define EXPECT_STATUS(call, want) expect_status_at((call), (want), __LINE__, #call)

/* Whether the last kept message contains `needle` (as a check). */
#define EXPECT_MSG_HAS(needle) \
    CHECK(strstr(g_msg, (needle)) != NULL, "message mentions \"%s\"", (needle))

#define CHECK_EQ_I64(what, got, want)                                                             \
    do {                                                                                          \
        int64_t got_ = (int64_t)(got), want_ = (int64_t)(want);                                   \
        CHECK(got_ == want_, "%s == %" PRId64 "%s%" PRId64 ")", (what), want_,                    \
              got_ == want_ ? " (got " : " (GOT ", got_);                                         \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* Sizes and expectations                                                                      */

#define KIB ((uint64_t)1 << 10)
#define MIB ((uint64_t)1 << 20)
#define GIB ((uint64_t)1 << 30)

static uint64_t g_capacity = 1 * GIB; /* per simulated device */
static int g_devices = 2;
static bool g_paged = true; /* paged segments (expandable_segments), else plain segments */
#define PAGE ((uint64_t)2 << 20) /* the sim's page (VMM granularity) */

static uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

/* Block size for a request (default config, no roundup_power2_divisions). */
static uint64_t rounded_size(uint64_t n) { return n < 512 ? 512 : round_up(n, 512); }

static bool is_small(uint64_t rounded) { return rounded <= MIB; }

/* Segment size asked of the device when no cached block fits. */
static uint64_t segment_for(uint64_t rounded) {
    if (rounded <= MIB) return 2 * MIB;
    if (rounded < 10 * MIB) return 20 * MIB;
    return round_up(rounded, 2 * MIB);
}

/* Size of the block handed out from a fresh segment (unlimited max_split_size): a small block
 * is split when at least 512 B remain, a large one when more than 1 MiB remains. */
static uint64_t block_from_fresh_segment(uint64_t rounded) {
    uint64_t seg = segment_for(rounded);
    uint64_t rest = seg - rounded;
    bool split = is_small(rounded) ? rest >= 512 : rest > MIB;
    return split ? rounded : seg;
}

static cudaStream_t stream_id(uintptr_t v) { return (cudaStream_t)v; }

/* ------------------------------------------------------------------------------------------ */
/* Canaries and live-block tracking                                                            */

static uint8_t canary_byte(uint32_t tag, uint64_t offset) {
    uint32_t x = tag * 2654435761u ^ (uint32_t)offset * 40503u ^ (uint32_t)(offset >> 12);
    return (uint8_t)(x ^ (x >> 8) ^ (x >> 16) ^ 0x5a);
}

/* Writes or checks the canary: every byte up to 4 KiB, else the first and last 256 bytes and
 * 8 bytes every 4 KiB in between up to 256 KiB, every 64 KiB or size/1024 beyond (so that a
 * block of tens of GiB touches only a few MiB of host memory). */
static bool canary_visit(uint8_t *p, uint64_t size, uint32_t tag, bool write) {
    bool ok = true;
    uint64_t off, stride = size <= 256 * KIB ? 4096 : round_up(size / 1024 > 64 * KIB ? size / 1024 : 64 * KIB, 4096);
#define VISIT(o)                                        \
    do {                                                \
        uint64_t o_ = (o);                              \
        uint8_t want_ = canary_byte(tag, o_);           \
        if (write) {                                    \
            p[o_] = want_;                              \
        } else if (p[o_] != want_) {                    \
            ok = false;                                 \
        }                                               \
    } while (0)
    if (size <= 4096) {
        for (off = 0; off < size; off++) VISIT(off);
        return ok;
    }
    for (off = 0; off < 256; off++) VISIT(off);
    for (off = stride; off + 8 <= size - 256; off += stride) {
        uint64_t k;
        for (k = 0; k < 8; k++) VISIT(off + k);
    }
    for (off = size - 256; off < size; off++) VISIT(off);
#undef VISIT
    return ok;
}

static void canary_write(void *p, uint64_t size, uint32_t tag) {
    canary_visit((uint8_t *)p, size, tag, true);
}

static bool canary_ok(const void *p, uint64_t size, uint32_t tag) {
    return canary_visit((uint8_t *)(uintptr_t)p, size, tag, false);
}

typedef struct {
    void *p;
    uint64_t size; /* requested bytes (what the caller may touch) */
    int device;
    uint32_t tag;
} tracked;

#define MAX_TRACKED 256
static tracked g_live[MAX_TRACKED];
static int g_nlive;
static uint32_t g_next_tag = 1;

static int cmp_tracked(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const tracked *)a)->p, y = (uintptr_t)((const tracked *)b)->p;
    return x < y ? -1 : x > y;
}

/* One check: every tracked block still holds its canary and no two overlap. */
static bool check_live_blocks(const char *when) {
    static tracked sorted[MAX_TRACKED];
    int i, corrupt = 0, overlaps = 0;
    for (i = 0; i < g_nlive; i++) {
        if (!canary_ok(g_live[i].p, g_live[i].size, g_live[i].tag)) corrupt++;
    }
    memcpy(sorted, g_live, sizeof(tracked) * (size_t)g_nlive);
    qsort(sorted, (size_t)g_nlive, sizeof(tracked), cmp_tracked);
    for (i = 1; i < g_nlive; i++) {
        if ((uintptr_t)sorted[i - 1].p + sorted[i - 1].size > (uintptr_t)sorted[i].p) overlaps++;
    }
    return CHECK(corrupt == 0 && overlaps == 0, "%d live blocks intact and disjoint %s (%d corrupt, %d overlapping)",
                 g_nlive, when, corrupt, overlaps);
}

static int find_tracked(const void *p) {
    int i;
    for (i = 0; i < g_nlive; i++) {
        if (g_live[i].p == p) return i;
    }
    return -1;
}

/* Allocates through the C API, checks status and alignment, writes a canary, tracks it. */
static void *track_malloc(uint64_t size, int device, cudaStream_t stream) {
    void *p = NULL;
    ccalloc_status st = ccalloc_malloc((size_t)size, device, stream, &p);
    char what[160];
    snprintf(what, sizeof what, "malloc(%" PRIu64 ", dev %d, stream %p)", size, device, (void *)stream);
    if (!expect_status_at(st, CCALLOC_OK, __LINE__, what) || p == NULL) {
        CHECK(p != NULL, "%s returned a pointer", what);
        return NULL;
    }
    CHECK(((uintptr_t)p % 512) == 0, "%s is 512-byte aligned (%p)", what, p);
    if (g_nlive >= MAX_TRACKED) {
        CHECK(false, "test bug: too many tracked blocks");
        return p;
    }
    g_live[g_nlive].p = p;
    g_live[g_nlive].size = size;
    g_live[g_nlive].device = device;
    g_live[g_nlive].tag = g_next_tag++;
    canary_write(p, size, g_live[g_nlive].tag);
    g_nlive++;
    return p;
}

/* Verifies the block's canary, frees it through the C API, stops tracking it. */
static void track_free(void *p) {
    int i = find_tracked(p);
    char what[96];
    if (i < 0) {
        CHECK(false, "test bug: freeing untracked %p", p);
        return;
    }
    snprintf(what, sizeof what, "free(%p, dev %d)", p, g_live[i].device);
    CHECK(canary_ok(p, g_live[i].size, g_live[i].tag), "canary of %p intact before free", p);
    expect_status_at(ccalloc_free(p, g_live[i].device), CCALLOC_OK, __LINE__, what);
    g_live[i] = g_live[--g_nlive];
}

static void track_free_all(void) {
    while (g_nlive > 0) track_free(g_live[g_nlive - 1].p);
}

static ccalloc_stats get_stats(int device) {
    ccalloc_stats s;
    memset(&s, 0, sizeof s);
    ccalloc_status st = ccalloc_get_stats(device, &s);
    if ((uint32_t)st != 0) {
        CHECK(false, "ccalloc_get_stats(%d) -> %s: %s", device, name_of(st), ccalloc_last_error());
    }
    return s;
}

static uint64_t sim_bytes(int device) {
    uint64_t b = UINT64_MAX;
    ccalloc_status st = ccalloc_sim_device_bytes(device, &b);
    if ((uint32_t)st != 0) {
        CHECK(false, "ccalloc_sim_device_bytes(%d) -> %s: %s", device, name_of(st), ccalloc_last_error());
    }
    return b;
}

static bool stats_equal(const ccalloc_stats *a, const ccalloc_stats *b) {
    return memcmp(a, b, sizeof *a) == 0;
}

/* Snapshot of everything a failed call must leave alone. */
typedef struct {
    ccalloc_stats stats[2];
    uint64_t sim[2];
} snapshot;

static snapshot take_snapshot(void) {
    snapshot s;
    int d;
    for (d = 0; d < 2; d++) {
        s.stats[d] = get_stats(d);
        s.sim[d] = sim_bytes(d);
    }
    return s;
}

/* After a refused call: stats and device bytes as in `before`, live blocks intact. */
static void check_unchanged(const snapshot *before, const char *after) {
    snapshot now = take_snapshot();
    int d;
    bool same = true;
    for (d = 0; d < 2; d++) {
        same = same && stats_equal(&now.stats[d], &before->stats[d]) && now.sim[d] == before->sim[d];
    }
    CHECK(same, "stats and device bytes unchanged after %s", after);
    check_live_blocks(after);
}

/* ------------------------------------------------------------------------------------------ */
/* Environment                                                                                 */

/* "1GiB", "512MiB", "1073741824", "2G", ... (the forms CCALLOC_SIM_CAPACITY accepts). */
static bool parse_bytes(const char *text, uint64_t *out) {
    char *end = NULL;
    double v = strtod(text, &end);
    uint64_t scale = 1;
    char unit[8];
    size_t n = 0;
    if (end == text || v <= 0) return false;
    while (*end == ' ') end++;
    while (*end && n + 1 < sizeof unit) {
        char c = *end++;
        unit[n++] = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    }
    unit[n] = '\0';
    if (n == 0 || !strcmp(unit, "b")) scale = 1;
    else if (!strcmp(unit, "k") || !strcmp(unit, "kb") || !strcmp(unit, "kib")) scale = KIB;
    else if (!strcmp(unit, "m") || !strcmp(unit, "mb") || !strcmp(unit, "mib")) scale = MIB;
    else if (!strcmp(unit, "g") || !strcmp(unit, "gb") || !strcmp(unit, "gib")) scale = GIB;
    else if (!strcmp(unit, "t") || !strcmp(unit, "tb") || !strcmp(unit, "tib")) scale = GIB * 1024;
    else return false;
    *out = (uint64_t)(v * (double)scale);
    return true;
}

static void setup_env(void) {
    const char *backend = getenv("CCALLOC_BACKEND");
    const char *cap = getenv("CCALLOC_SIM_CAPACITY");
    const char *devs = getenv("CCALLOC_SIM_DEVICES");
    if (backend == NULL) setenv("CCALLOC_BACKEND", "sim", 1);
    else if (strcmp(backend, "sim") != 0) {
        printf("this test needs CCALLOC_BACKEND=sim (got %s)\n", backend);
        exit(2);
    }
    if (cap == NULL) setenv("CCALLOC_SIM_CAPACITY", "1GiB", 1);
    else if (!parse_bytes(cap, &g_capacity) || g_capacity < 512 * MIB || g_capacity % (2 * MIB) != 0) {
        printf("CCALLOC_SIM_CAPACITY=%s: this test needs a multiple of 2 MiB, at least 512MiB\n", cap);
        exit(2);
    }
    if (devs == NULL) setenv("CCALLOC_SIM_DEVICES", "2", 1);
    else {
        g_devices = atoi(devs);
        if (g_devices < 2) {
            printf("CCALLOC_SIM_DEVICES=%s: this test needs at least 2 devices\n", devs);
            exit(2);
        }
    }
    {
        const char *conf = getenv("CCALLOC_CONF"), *vmm = getenv("CCALLOC_SIM_VMM");
        if (conf != NULL && !strcmp(conf, "expandable_segments:False")) {
            g_paged = false;
        } else if (conf != NULL && conf[0] != '\0' && strcmp(conf, "expandable_segments:True") != 0) {
            printf("CCALLOC_CONF=%s: this test allows only expandable_segments:True or :False\n", conf);
            exit(2);
        }
        if (vmm != NULL && (!strcmp(vmm, "0") || !strcmp(vmm, "false") || !strcmp(vmm, "off"))) {
            g_paged = false;
        }
    }
    printf("sim backend: %d devices of %" PRIu64 " MiB, %s segments\n", g_devices, g_capacity / MIB,
           g_paged ? "paged" : "plain");
}

/* ------------------------------------------------------------------------------------------ */
/* Sections                                                                                    */

static const cudaStream_t S_A = (cudaStream_t)(uintptr_t)0x11;
static const cudaStream_t S_B = (cudaStream_t)(uintptr_t)0x12;

static void test_static_functions(void) {
    static const char *const names[] = {
        "CCALLOC_OK", "CCALLOC_INVALID_ARGUMENT", "CCALLOC_NOT_INITIALIZED", "CCALLOC_SHUT_DOWN",
        "CCALLOC_OUT_OF_MEMORY", "CCALLOC_UNKNOWN_POINTER", "CCALLOC_DOUBLE_FREE",
        "CCALLOC_WRONG_DEVICE", "CCALLOC_INVALID_DEVICE", "CCALLOC_INVALID_SIZE",
        "CCALLOC_CONFIG_ERROR", "CCALLOC_DRIVER_UNAVAILABLE", "CCALLOC_DRIVER_ERROR",
        "CCALLOC_BUSY", "CCALLOC_INTERNAL_ERROR",
    };
    static const uint32_t codes[] = {
        CCALLOC_OK, CCALLOC_INVALID_ARGUMENT, CCALLOC_NOT_INITIALIZED, CCALLOC_SHUT_DOWN,
        CCALLOC_OUT_OF_MEMORY, CCALLOC_UNKNOWN_POINTER, CCALLOC_DOUBLE_FREE,
        CCALLOC_WRONG_DEVICE, CCALLOC_INVALID_DEVICE, CCALLOC_INVALID_SIZE,
        CCALLOC_CONFIG_ERROR, CCALLOC_DRIVER_UNAVAILABLE, CCALLOC_DRIVER_ERROR,
        CCALLOC_BUSY, CCALLOC_INTERNAL_ERROR,
    };
    unsigned i, n;
    int bad = 0;
    const char *v = ccalloc_version();
    section("static functions");
    CHECK(v != NULL && v[0] >= '0' && v[0] <= '9' && strchr(v, '.') != NULL,
          "ccalloc_version() looks like a version: \"%s\"", v ? v : "(null)");
    CHECK(ccalloc_last_error() != NULL && ccalloc_last_error()[0] == '\0',
          "ccalloc_last_error() is \"\" before any failure");
    for (i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        CHECK(codes[i] == i, "%s == %u", names[i], i);
        if (strcmp(ccalloc_status_name(codes[i]), names[i]) != 0) {
            bad++;
            printf("      status_name(%u) = %s, want %s\n", i, ccalloc_status_name(codes[i]), names[i]);
        }
    }
    CHECK(bad == 0, "ccalloc_status_name names the %u codes above",
          (unsigned)(sizeof codes / sizeof codes[0]));
    /* The library names 0, 1, ... up to its first CCALLOC_UNKNOWN_STATUS: the codes above and
     * any added since (python/tests/test_loader.py compares the whole enum with the header). */
    for (n = 0; n < 4096 && strcmp(ccalloc_status_name(n), "CCALLOC_UNKNOWN_STATUS") != 0; n++) {
    }
    CHECK(n >= sizeof codes / sizeof codes[0] && n < 4096 &&
              !strcmp(ccalloc_status_name(0xFFFFFFFFu), "CCALLOC_UNKNOWN_STATUS"),
          "ccalloc_status_name(%u / 0xFFFFFFFF) = CCALLOC_UNKNOWN_STATUS", n);
    CHECK(sizeof(ccalloc_stat) == 32 && sizeof(ccalloc_stat_array) == 96,
          "ccalloc_stat is 32 bytes, ccalloc_stat_array 96");
    CHECK(sizeof(ccalloc_stats) == 9 * 96 + 2 * 32 + 6 * 8, "sizeof(ccalloc_stats) == %u (got %u)",
          (unsigned)(9 * 96 + 2 * 32 + 6 * 8), (unsigned)sizeof(ccalloc_stats));
    CHECK(sizeof(ccalloc_status) == 4, "ccalloc_status is 4 bytes");
}

static void test_before_init(void) {
    void *p = (void *)(uintptr_t)0xdead;
    int32_t count = -7;
    const char *name = "untouched";
    double f = -3.0;
    uint64_t bytes = 77;
    ccalloc_stats s;
    int x = 0;
    section("before ccalloc_init");
    memset(&s, 0xab, sizeof s);
    EXPECT_STATUS(ccalloc_malloc(64, 0, S_A, &p), CCALLOC_NOT_INITIALIZED);
    EXPECT_MSG_HAS("ccalloc_init");
    CHECK(p == (void *)(uintptr_t)0xdead, "malloc's out_ptr untouched");
    EXPECT_STATUS(ccalloc_free(&x, 0), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_free(NULL, 0), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_record_stream(&x, 0, S_A), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_device_count(&count), CCALLOC_NOT_INITIALIZED);
    CHECK(count == -7, "device_count's out param untouched");
    EXPECT_STATUS(ccalloc_backend(&name), CCALLOC_NOT_INITIALIZED);
    CHECK(!strcmp(name, "untouched"), "backend's out param untouched");
    EXPECT_STATUS(ccalloc_get_stats(0, &s), CCALLOC_NOT_INITIALIZED);
    {
        ccalloc_paging_stats ps, pattern;
        memset(&ps, 0xab, sizeof ps);
        memset(&pattern, 0xab, sizeof pattern);
        EXPECT_STATUS(ccalloc_get_paging_stats(0, &ps), CCALLOC_NOT_INITIALIZED);
        CHECK(!memcmp(&ps, &pattern, sizeof ps), "get_paging_stats' out param untouched");
    }
    {
        ccalloc_lock_stats ls, pattern;
        memset(&ls, 0xab, sizeof ls);
        memset(&pattern, 0xab, sizeof pattern);
        EXPECT_STATUS(ccalloc_get_lock_stats(0, &ls), CCALLOC_NOT_INITIALIZED);
        CHECK(!memcmp(&ls, &pattern, sizeof ls), "get_lock_stats' out param untouched");
    }
    {
        ccalloc_memory_breakdown b, pattern;
        memset(&b, 0xab, sizeof b);
        memset(&pattern, 0xab, sizeof pattern);
        EXPECT_STATUS(ccalloc_get_memory_breakdown(0, false, &b), CCALLOC_NOT_INITIALIZED);
        CHECK(!memcmp(&b, &pattern, sizeof b), "get_memory_breakdown's out param untouched");
    }
    {
        ccalloc_stats pattern;
        memset(&pattern, 0xab, sizeof pattern);
        CHECK(stats_equal(&s, &pattern), "get_stats' out param untouched");
    }
    EXPECT_STATUS(ccalloc_empty_cache(-1), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_set_memory_fraction(0.5, 0), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_get_memory_fraction(0, &f), CCALLOC_NOT_INITIALIZED);
    CHECK(f == -3.0, "get_memory_fraction's out param untouched");
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:256"), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_reset_peak_stats(-1), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_reset_accumulated_stats(-1), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_sim_pause_stream(0, S_A, true), CCALLOC_NOT_INITIALIZED);
    EXPECT_STATUS(ccalloc_sim_device_bytes(0, &bytes), CCALLOC_NOT_INITIALIZED);
    CHECK(bytes == 77, "sim_device_bytes' out param untouched");
    EXPECT_STATUS(ccalloc_device_total_memory(0, &bytes), CCALLOC_NOT_INITIALIZED);
    CHECK(bytes == 77, "device_total_memory's out param untouched");
    {
        uint32_t shards = 77;
        EXPECT_STATUS(ccalloc_shard_count(0, &shards), CCALLOC_NOT_INITIALIZED);
        CHECK(shards == 77, "shard_count's out param untouched");
    }
    EXPECT_STATUS(ccalloc_reset_config(), CCALLOC_NOT_INITIALIZED);
    CHECK(!ccalloc_is_initialized(), "ccalloc_is_initialized() is false before init");
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_NOT_INITIALIZED);
}

static void test_init(void) {
    const char *name = NULL;
    int32_t count = -1;
    section("ccalloc_init");
    EXPECT_STATUS(ccalloc_init(), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_init(), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_backend(&name), CCALLOC_OK);
    CHECK(name != NULL && !strcmp(name, "sim"), "backend is \"sim\" (got %s)", name ? name : "(null)");
    EXPECT_STATUS(ccalloc_device_count(&count), CCALLOC_OK);
    CHECK_EQ_I64("device count", count, g_devices);
    CHECK(ccalloc_is_initialized(), "ccalloc_is_initialized() is true after init");
    {
        uint64_t total = 0;
        EXPECT_STATUS(ccalloc_device_total_memory(1, &total), CCALLOC_OK);
        CHECK_EQ_I64("device 1 total memory == CCALLOC_SIM_CAPACITY", total, g_capacity);
        total = 3;
        EXPECT_STATUS(ccalloc_device_total_memory(g_devices, &total), CCALLOC_INVALID_DEVICE);
        CHECK(total == 3, "device_total_memory on a missing device: out param untouched");
        EXPECT_STATUS(ccalloc_device_total_memory(0, NULL), CCALLOC_INVALID_ARGUMENT);
    }
    {
        uint32_t shards = 5;
        EXPECT_STATUS(ccalloc_shard_count(g_devices, &shards), CCALLOC_INVALID_DEVICE);
        CHECK(shards == 5, "shard_count on a missing device: out param untouched");
        EXPECT_STATUS(ccalloc_shard_count(0, NULL), CCALLOC_INVALID_ARGUMENT);
        EXPECT_STATUS(ccalloc_shard_count(1, &shards), CCALLOC_OK);
        CHECK(shards <= 1, "one thread's device has at most one shard (got %u)", (unsigned)shards);
    }
    {
        ccalloc_stats s = get_stats(0), zero;
        memset(&zero, 0, sizeof zero);
        zero.max_split_size = -1;
        CHECK(stats_equal(&s, &zero), "fresh device 0: every stat is 0 and max_split_size is -1 (unlimited)");
        CHECK_EQ_I64("sim device 0 bytes before any allocation", sim_bytes(0), 0);
    }
    EXPECT_STATUS(ccalloc_init(), CCALLOC_OK);
}

/* A fixed sequence on a fresh device 0 whose every statistic is predicted. */
static void test_sizes_and_stats(void) {
    /* size, and whether a cached remainder serves it (else a fresh segment), for plain
     * segments; paged segments carve every block from one range per pool, in order */
    static const struct {
        uint64_t size;
        bool from_cache;
    } steps[] = {
        {1, false},                /* small: 512 B block, new 2 MiB segment */
        {1000, true},              /* 1024 B from the same segment */
        {MIB, true},               /* exactly 1 MiB is still small: same segment */
        {MIB + 1, false},          /* large: new 20 MiB segment, split */
        {9 * MIB, true},           /* fits the 20 MiB segment's remainder */
        {10 * MIB, false},         /* >= 10 MiB: own segment of exactly 10 MiB, not split */
        {11 * MIB + 1, false},     /* own 12 MiB segment; 1 MiB - 512 left: not split */
        {100 * MIB + 3, false},    /* own 102 MiB segment; 2 MiB - 512 left: split */
    };
    enum { N = sizeof steps / sizeof steps[0] };
    void *ptrs[N];
    int64_t alloc_n[2] = {0, 0}, alloc_b[2] = {0, 0}, req_b[2] = {0, 0}, res_b[2] = {0, 0}, segs[2] = {0, 0};
    int64_t split_n[2] = {0, 0}, split_b[2] = {0, 0};
    uint64_t small_seg_left = 0, large_seg_left = 0; /* remainder of the last split segment */
    uint64_t carved[2] = {0, 0};                     /* paged: bytes carved from each range */
    int i;
    ccalloc_stats s;
    section(g_paged ? "sizes, pools and statistics (device 0, paged segments)"
                    : "sizes, pools and statistics (device 0, plain segments)");
    for (i = 0; i < N; i++) {
        uint64_t r = rounded_size(steps[i].size);
        int pool = is_small(r) ? 0 : 1;
        uint64_t block;
        uint64_t *left = pool == 0 ? &small_seg_left : &large_seg_left;
        ptrs[i] = track_malloc(steps[i].size, 0, S_A);
        if (g_paged) {
            block = r; /* a range as large as the device: always split */
            if (carved[pool] == 0) segs[pool]++;
            carved[pool] += r;
            res_b[pool] = (int64_t)round_up(carved[pool], PAGE);
        } else if (steps[i].from_cache) {
            block = r; /* the remainder is larger, so it is split again */
            *left -= r;
            split_b[pool] -= (int64_t)r;
            if (*left == 0) {
                split_n[pool]--;
            }
        } else {
            uint64_t seg = segment_for(r);
            block = block_from_fresh_segment(r);
            res_b[pool] += (int64_t)seg;
            segs[pool]++;
            if (block < seg) {
                split_n[pool]++;
                split_b[pool] += (int64_t)(seg - block);
                if (pool == 1 && seg == 20 * MIB) *left = seg - block;
                if (pool == 0) *left = seg - block;
            }
        }
        alloc_n[pool]++;
        alloc_b[pool] += (int64_t)block;
        req_b[pool] += (int64_t)steps[i].size;
    }
    check_live_blocks("after the sized allocations");
    s = get_stats(0);
    CHECK_EQ_I64("allocation.all.current", s.allocation.all.current, alloc_n[0] + alloc_n[1]);
    CHECK_EQ_I64("allocation.small_pool.current", s.allocation.small_pool.current, alloc_n[0]);
    CHECK_EQ_I64("allocation.large_pool.current", s.allocation.large_pool.current, alloc_n[1]);
    CHECK_EQ_I64("allocation.all.peak", s.allocation.all.peak, alloc_n[0] + alloc_n[1]);
    CHECK_EQ_I64("allocated_bytes.small_pool.current", s.allocated_bytes.small_pool.current, alloc_b[0]);
    CHECK_EQ_I64("allocated_bytes.large_pool.current", s.allocated_bytes.large_pool.current, alloc_b[1]);
    CHECK_EQ_I64("allocated_bytes.all.current", s.allocated_bytes.all.current, alloc_b[0] + alloc_b[1]);
    CHECK_EQ_I64("allocated_bytes.all.peak", s.allocated_bytes.all.peak, alloc_b[0] + alloc_b[1]);
    CHECK_EQ_I64("allocated_bytes.all.allocated", s.allocated_bytes.all.allocated, alloc_b[0] + alloc_b[1]);
    CHECK_EQ_I64("allocated_bytes.all.freed", s.allocated_bytes.all.freed, 0);
    CHECK_EQ_I64("requested_bytes.small_pool.current", s.requested_bytes.small_pool.current, req_b[0]);
    CHECK_EQ_I64("requested_bytes.large_pool.current", s.requested_bytes.large_pool.current, req_b[1]);
    CHECK_EQ_I64("requested_bytes.all.peak", s.requested_bytes.all.peak, req_b[0] + req_b[1]);
    CHECK_EQ_I64("reserved_bytes.small_pool.current", s.reserved_bytes.small_pool.current, res_b[0]);
    CHECK_EQ_I64("reserved_bytes.large_pool.current", s.reserved_bytes.large_pool.current, res_b[1]);
    CHECK_EQ_I64("reserved_bytes.all.current", s.reserved_bytes.all.current, res_b[0] + res_b[1]);
    CHECK_EQ_I64("reserved_bytes.all.peak", s.reserved_bytes.all.peak, res_b[0] + res_b[1]);
    CHECK_EQ_I64("segment.small_pool.current", s.segment.small_pool.current, segs[0]);
    CHECK_EQ_I64("segment.large_pool.current", s.segment.large_pool.current, segs[1]);
    if (!g_paged) { /* paged: the driver calls are page maps, an implementation detail */
        CHECK_EQ_I64("num_device_alloc", s.num_device_alloc, segs[0] + segs[1]);
    }
    CHECK_EQ_I64("num_device_free", s.num_device_free, 0);
    CHECK_EQ_I64("active.all.current (== allocation)", s.active.all.current, alloc_n[0] + alloc_n[1]);
    CHECK_EQ_I64("active_bytes.all.current (== allocated_bytes)", s.active_bytes.all.current, alloc_b[0] + alloc_b[1]);
    if (!g_paged) { /* paged: what counts as an inactive split of a range is not specified */
        CHECK_EQ_I64("inactive_split.small_pool.current", s.inactive_split.small_pool.current, split_n[0]);
        CHECK_EQ_I64("inactive_split.large_pool.current", s.inactive_split.large_pool.current, split_n[1]);
        CHECK_EQ_I64("inactive_split_bytes.small_pool.current", s.inactive_split_bytes.small_pool.current,
                     split_b[0]);
        CHECK_EQ_I64("inactive_split_bytes.large_pool.current", s.inactive_split_bytes.large_pool.current,
                     split_b[1]);
    }
    CHECK_EQ_I64("oversize_allocations.current (no max_split_size)", s.oversize_allocations.current, 0);
    CHECK_EQ_I64("num_ooms", s.num_ooms, 0);
    CHECK_EQ_I64("max_split_size (unlimited)", s.max_split_size, -1);
    CHECK_EQ_I64("sim device 0 bytes == reserved", sim_bytes(0), res_b[0] + res_b[1]);
    CHECK_EQ_I64("sim device 1 bytes (untouched device)", sim_bytes(1), 0);
    CHECK((char *)ptrs[1] == (char *)ptrs[0] + 512 && (char *)ptrs[2] == (char *)ptrs[1] + 1024,
          "small blocks are carved in order from one segment (%p, %p, %p)", ptrs[0], ptrs[1], ptrs[2]);
    CHECK((char *)ptrs[4] == (char *)ptrs[3] + rounded_size(MIB + 1),
          "the 9 MiB block follows the 1 MiB+512 block in its 20 MiB segment");

    /* Same-stream reuse: a freed block comes straight back for the same size and stream. */
    {
        void *old = ptrs[4];
        uint64_t before_dev = (uint64_t)get_stats(0).num_device_alloc;
        track_free(old);
        s = get_stats(0);
        CHECK_EQ_I64("allocated_bytes.large_pool after freeing 9 MiB", s.allocated_bytes.large_pool.current,
                     alloc_b[1] - (int64_t)(9 * MIB));
        CHECK_EQ_I64("allocated_bytes.large_pool.peak unchanged by the free", s.allocated_bytes.large_pool.peak,
                     alloc_b[1]);
        ptrs[4] = track_malloc(9 * MIB, 0, S_A);
        CHECK(ptrs[4] == old, "a block freed on stream A is reused at once for the same size on A (%p, was %p)",
              ptrs[4], old);
        CHECK_EQ_I64("num_device_alloc after the reuse", get_stats(0).num_device_alloc, before_dev);
    }
    /* Other streams do not take each other's cached blocks. */
    {
        void *old = ptrs[3], *q;
        uint64_t before_dev = (uint64_t)get_stats(0).num_device_alloc;
        track_free(old);
        /* plain: a 20 MiB segment of its own; paged: a range of its own, one page mapped */
        int64_t cost = g_paged ? (int64_t)round_up(rounded_size(MIB + 1), PAGE) : (int64_t)(20 * MIB);
        q = track_malloc(MIB + 1, 0, S_B);
        CHECK(q != old, "a block cached for stream A is not handed to stream B (%p vs %p)", q, old);
        CHECK(get_stats(0).num_device_alloc > before_dev, "stream B's request went to the device");
        CHECK_EQ_I64("reserved_bytes.large_pool after stream B's segment", get_stats(0).reserved_bytes.large_pool.current,
                     res_b[1] + cost);
        res_b[1] += cost;
        segs[1]++;
        check_live_blocks("after stream reuse checks");
    }
    track_free_all();
    s = get_stats(0);
    CHECK_EQ_I64("allocation.all.current after freeing all", s.allocation.all.current, 0);
    CHECK_EQ_I64("allocated_bytes.all.current after freeing all", s.allocated_bytes.all.current, 0);
    CHECK_EQ_I64("requested_bytes.all.current after freeing all", s.requested_bytes.all.current, 0);
    CHECK_EQ_I64("active.all.current after freeing all", s.active.all.current, 0);
    CHECK_EQ_I64("inactive_split.all.current after freeing all (merged back)", s.inactive_split.all.current, 0);
    CHECK_EQ_I64("allocation.all.allocated", s.allocation.all.allocated, N + 2);
    CHECK_EQ_I64("allocation.all.freed", s.allocation.all.freed, N + 2);
    CHECK_EQ_I64("allocated_bytes.all.peak kept", s.allocated_bytes.all.peak, alloc_b[0] + alloc_b[1]);
    CHECK_EQ_I64("reserved_bytes.all.current: freed blocks stay cached", s.reserved_bytes.all.current,
                 res_b[0] + res_b[1]);
    CHECK_EQ_I64("segment.all.current stays", s.segment.all.current, segs[0] + segs[1]);

    section("lock stats (device 0)");
    {
        ccalloc_lock_stats ls;
        EXPECT_STATUS(ccalloc_get_lock_stats(0, &ls), CCALLOC_OK);
        CHECK(ls.acquisitions >= 2, "the allocations above took the lock (%llu)",
              (unsigned long long)ls.acquisitions);
        CHECK(ls.contended <= ls.acquisitions && ls.blocked <= ls.contended,
              "contended and blocked are parts of the acquisitions");
        CHECK(ls.handoffs < ls.acquisitions, "handoffs are acquisitions too");
    }

    section("paging stats (device 0)");
    {
        ccalloc_paging_stats ps;
        EXPECT_STATUS(ccalloc_get_paging_stats(0, &ps), CCALLOC_OK);
        if (g_paged) {
            CHECK(ps.growths >= 1 && ps.chunks_mapped >= ps.growths && ps.growth_ns > 0,
                  "paged growth is counted (growths %llu, chunks mapped %llu, %llu ns)",
                  (unsigned long long)ps.growths, (unsigned long long)ps.chunks_mapped,
                  (unsigned long long)ps.growth_ns);
            CHECK(ps.moving_growths <= ps.growths && ps.moving_ns <= ps.growth_ns,
                  "moving growth is a part of growth");
            CHECK(ps.wait_ns <= ps.growth_ns, "host waits are a part of growth");
            CHECK(ps.chunks_borrowed <= ps.chunks_mapped, "borrowed chunks are mapped chunks");
            CHECK(ps.page_slack > 0.0 && ps.page_slack <= 2.0, "page_slack %g", ps.page_slack);
        } else {
            CHECK(ps.growths == 0 && ps.chunks_mapped == 0 && ps.chunks_unmapped == 0,
                  "plain segments never map pages");
        }
    }

    section("memory breakdown (device 0)");
    {
        ccalloc_memory_breakdown b, pattern;
        memset(&b, 0xab, sizeof b);
        memset(&pattern, 0xab, sizeof pattern);
        EXPECT_STATUS(ccalloc_get_memory_breakdown(0, false, NULL), CCALLOC_INVALID_ARGUMENT);
        EXPECT_STATUS(ccalloc_get_memory_breakdown(0, true, &b), CCALLOC_CONFIG_ERROR);
        CHECK(!memcmp(&b, &pattern, sizeof b), "out param untouched when not recording");
        CHECK(strstr(ccalloc_last_error(), "record_peak_breakdown") != NULL,
              "the error names the setting: %s", ccalloc_last_error());
        EXPECT_STATUS(ccalloc_get_memory_breakdown(99, false, &b), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_get_memory_breakdown(0, false, &b), CCALLOC_OK);
        CHECK_EQ_I64("breakdown: reserved is reserved_bytes.all.current", (int64_t)b.reserved_bytes,
                     res_b[0] + res_b[1]);
        CHECK_EQ_I64("breakdown: nothing is live", (int64_t)b.live_bytes, 0);
        CHECK_EQ_I64("breakdown: the parts add up to reserved",
                     (int64_t)(b.live_bytes + b.free_chunk_bytes + b.pinned_bytes + b.rounding_bytes +
                               b.parked_bytes + b.plain_bytes),
                     (int64_t)b.reserved_bytes);
        CHECK((b.plain_bytes == 0) == g_paged, "plain bytes only with plain segments (%llu)",
              (unsigned long long)b.plain_bytes);
    }

    section("reset_peak_stats / reset_accumulated_stats / empty_cache (device 0)");
    EXPECT_STATUS(ccalloc_reset_peak_stats(0), CCALLOC_OK);
    s = get_stats(0);
    CHECK_EQ_I64("allocated_bytes.all.peak after reset_peak", s.allocated_bytes.all.peak, 0);
    CHECK_EQ_I64("allocation.large_pool.peak after reset_peak", s.allocation.large_pool.peak, 0);
    CHECK_EQ_I64("requested_bytes.all.peak after reset_peak", s.requested_bytes.all.peak, 0);
    CHECK_EQ_I64("reserved_bytes.all.peak after reset_peak (== current)", s.reserved_bytes.all.peak,
                 res_b[0] + res_b[1]);
    CHECK_EQ_I64("allocation.all.allocated kept by reset_peak", s.allocation.all.allocated, N + 2);
    EXPECT_STATUS(ccalloc_reset_accumulated_stats(0), CCALLOC_OK);
    s = get_stats(0);
    CHECK_EQ_I64("allocation.all.allocated after reset_accumulated", s.allocation.all.allocated, 0);
    CHECK_EQ_I64("allocation.all.freed after reset_accumulated", s.allocation.all.freed, 0);
    CHECK_EQ_I64("reserved_bytes.all.allocated after reset_accumulated", s.reserved_bytes.all.allocated, 0);
    CHECK_EQ_I64("num_device_alloc after reset_accumulated", s.num_device_alloc, 0);
    {
        ccalloc_paging_stats ps;
        EXPECT_STATUS(ccalloc_get_paging_stats(0, &ps), CCALLOC_OK);
        CHECK(ps.growths == 0 && ps.chunks_mapped == 0 && ps.growth_ns == 0 && ps.host_waits == 0,
              "reset_accumulated zeroes the paging counters");
    }
    CHECK_EQ_I64("reserved_bytes.all.current kept by reset_accumulated", s.reserved_bytes.all.current,
                 res_b[0] + res_b[1]);
    EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);
    s = get_stats(0);
    CHECK_EQ_I64("reserved_bytes.all.current after empty_cache", s.reserved_bytes.all.current, 0);
    CHECK_EQ_I64("segment.all.current after empty_cache", s.segment.all.current, 0);
    if (!g_paged) {
        CHECK_EQ_I64("num_device_free after empty_cache", s.num_device_free, segs[0] + segs[1]);
    }
    CHECK_EQ_I64("reserved_bytes.all.freed after empty_cache", s.reserved_bytes.all.freed, res_b[0] + res_b[1]);
    CHECK_EQ_I64("sim device 0 bytes after empty_cache", sim_bytes(0), 0);
    if (g_paged) {
        ccalloc_paging_stats ps;
        EXPECT_STATUS(ccalloc_get_paging_stats(0, &ps), CCALLOC_OK);
        CHECK(ps.chunks_unmapped >= 1, "empty_cache unmapped the chunks (%llu)",
              (unsigned long long)ps.chunks_unmapped);
    }
    EXPECT_STATUS(ccalloc_reset_peak_stats(-1), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_reset_accumulated_stats(-1), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_empty_cache(-1), CCALLOC_OK);

    section("memory breakdown at the peak (device 0)");
    {
        ccalloc_memory_breakdown b;
        EXPECT_STATUS(ccalloc_set_config("record_peak_breakdown:True"), CCALLOC_OK);
        void *p = NULL;
        EXPECT_STATUS(ccalloc_malloc(3 << 20, 0, S_A, &p), CCALLOC_OK);
        EXPECT_STATUS(ccalloc_free(p, 0), CCALLOC_OK);
        EXPECT_STATUS(ccalloc_get_memory_breakdown(0, true, &b), CCALLOC_OK);
        CHECK_EQ_I64("breakdown at peak: the block was live", (int64_t)b.live_bytes, 3 << 20);
        EXPECT_STATUS(ccalloc_set_config("record_peak_breakdown:False"), CCALLOC_OK);
        EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);
    }
}

static void test_bad_calls(void) {
    void *a, *b, *c, *d1, *sentinel = (void *)(uintptr_t)0xfeedf00d, *p;
    snapshot snap;
    int local = 0;
    void *host = malloc(4096);
    section("refused calls leave everything unchanged");
    a = track_malloc(4096, 0, S_A);
    b = track_malloc(3000, 0, S_A);
    c = track_malloc(5 * MIB, 0, S_A);
    d1 = track_malloc(700, 1, S_A);
    (void)track_malloc(12 * MIB, 1, S_B);
    snap = take_snapshot();

    p = sentinel;
    EXPECT_STATUS(ccalloc_malloc(0, 0, S_A, &p), CCALLOC_INVALID_SIZE);
    CHECK(p == sentinel, "malloc(0): out_ptr untouched");
    check_unchanged(&snap, "malloc(0)");

    EXPECT_STATUS(ccalloc_malloc(64, 0, S_A, NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_MSG_HAS("out_ptr");
    EXPECT_STATUS(ccalloc_get_stats(0, NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_get_paging_stats(0, NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_get_lock_stats(0, NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_MSG_HAS("out_stats");
    {
        ccalloc_lock_stats ls;
        EXPECT_STATUS(ccalloc_get_lock_stats(g_devices, &ls), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_get_lock_stats(-1, &ls), CCALLOC_INVALID_DEVICE);
    }
    {
        ccalloc_paging_stats ps;
        EXPECT_STATUS(ccalloc_get_paging_stats(g_devices, &ps), CCALLOC_INVALID_DEVICE);
    }
    EXPECT_STATUS(ccalloc_device_count(NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_backend(NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_get_memory_fraction(0, NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_sim_device_bytes(0, NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_set_config(NULL), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_record_stream(NULL, 0, S_B), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_set_memory_fraction(NAN, 0), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_free(NULL, 0), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_free(NULL, 99), CCALLOC_OK);
    check_unchanged(&snap, "NULL arguments");

    EXPECT_STATUS(ccalloc_free(&local, 0), CCALLOC_UNKNOWN_POINTER);
    EXPECT_STATUS(ccalloc_free(host, 0), CCALLOC_UNKNOWN_POINTER);
    EXPECT_STATUS(ccalloc_free((char *)a + 512, 0), CCALLOC_UNKNOWN_POINTER);
    EXPECT_STATUS(ccalloc_free((char *)c + 1, 0), CCALLOC_UNKNOWN_POINTER);
    EXPECT_STATUS(ccalloc_record_stream(&local, 0, S_B), CCALLOC_UNKNOWN_POINTER);
    EXPECT_STATUS(ccalloc_record_stream((char *)a + 4, 0, S_B), CCALLOC_UNKNOWN_POINTER);
    check_unchanged(&snap, "unknown and interior pointers");

    EXPECT_STATUS(ccalloc_free(a, 1), CCALLOC_WRONG_DEVICE);
    EXPECT_MSG_HAS("device 0");
    EXPECT_STATUS(ccalloc_free(d1, 0), CCALLOC_WRONG_DEVICE);
    EXPECT_MSG_HAS("device 1");
    EXPECT_STATUS(ccalloc_record_stream(c, 1, S_B), CCALLOC_WRONG_DEVICE);
    check_unchanged(&snap, "wrong-device calls");

    p = sentinel;
    EXPECT_STATUS(ccalloc_malloc(64, g_devices, S_A, &p), CCALLOC_INVALID_DEVICE);
    CHECK(p == sentinel, "malloc on device g_devices: out_ptr untouched");
    EXPECT_STATUS(ccalloc_malloc(64, -1, S_A, &p), CCALLOC_INVALID_DEVICE);
    EXPECT_STATUS(ccalloc_malloc(64, 1000000, S_A, &p), CCALLOC_INVALID_DEVICE);
    CHECK(p == sentinel, "malloc on invalid devices: out_ptr untouched");
    EXPECT_STATUS(ccalloc_free(a, g_devices), CCALLOC_INVALID_DEVICE);
    EXPECT_STATUS(ccalloc_free(a, -5), CCALLOC_INVALID_DEVICE);
    EXPECT_STATUS(ccalloc_record_stream(a, g_devices + 5, S_B), CCALLOC_INVALID_DEVICE);
    {
        ccalloc_stats s;
        double f = -2.0;
        uint64_t bytes = 5;
        EXPECT_STATUS(ccalloc_get_stats(g_devices, &s), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_get_stats(-1, &s), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_set_memory_fraction(0.5, g_devices), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_get_memory_fraction(-1, &f), CCALLOC_INVALID_DEVICE);
        CHECK(f == -2.0, "get_memory_fraction(-1): out param untouched");
        EXPECT_STATUS(ccalloc_empty_cache(g_devices), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_empty_cache(-2), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_reset_peak_stats(g_devices + 1), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_reset_accumulated_stats(g_devices + 1), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_sim_pause_stream(g_devices, S_A, true), CCALLOC_INVALID_DEVICE);
        EXPECT_STATUS(ccalloc_sim_device_bytes(g_devices, &bytes), CCALLOC_INVALID_DEVICE);
        CHECK(bytes == 5, "sim_device_bytes(g_devices): out param untouched");
    }
    check_unchanged(&snap, "invalid devices");

    /* Impossible sizes: refused as out of memory; only num_ooms moves. */
    p = sentinel;
    EXPECT_STATUS(ccalloc_malloc(SIZE_MAX, 0, S_A, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "malloc(SIZE_MAX): out_ptr untouched");
    EXPECT_MSG_HAS("reserved");
    EXPECT_MSG_HAS("live");
    EXPECT_MSG_HAS("largest");
    snap.stats[0].num_ooms++;
    check_unchanged(&snap, "malloc(SIZE_MAX) (but num_ooms + 1)");
    EXPECT_STATUS(ccalloc_malloc((size_t)(2 * g_capacity), 1, S_A, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "malloc(2 x capacity): out_ptr untouched");
    EXPECT_MSG_HAS("reserved");
    EXPECT_MSG_HAS("live");
    EXPECT_MSG_HAS("largest");
    snap.stats[1].num_ooms++;
    check_unchanged(&snap, "malloc(2 x capacity) (but num_ooms + 1)");

    /* Double frees. b follows a live block, so its address stays a block start once freed. */
    track_free(b);
    snap = take_snapshot();
    EXPECT_STATUS(ccalloc_free(b, 0), CCALLOC_DOUBLE_FREE);
    EXPECT_STATUS(ccalloc_record_stream(b, 0, S_B), CCALLOC_DOUBLE_FREE);
    check_unchanged(&snap, "double free");
    /* Once a freed block merged into its free predecessor, its address lies inside a free
     * block: still refused (DOUBLE_FREE ideally; UNKNOWN_POINTER "points inside" accepted). */
    track_free(a);
    snap = take_snapshot();
    {
        ccalloc_status st = ccalloc_free(b, 0);
        snprintf(g_msg, sizeof g_msg, "%s", ccalloc_last_error());
        CHECK((uint32_t)st == CCALLOC_DOUBLE_FREE || (uint32_t)st == CCALLOC_UNKNOWN_POINTER,
              "double free of a block merged into a freed neighbour is refused -> %s: \"%s\"", name_of(st), g_msg);
    }
    check_unchanged(&snap, "double free after merge");
    /* A pointer whose segment went back to the device is unknown. */
    track_free_all();
    EXPECT_STATUS(ccalloc_empty_cache(-1), CCALLOC_OK);
    snap = take_snapshot();
    EXPECT_STATUS(ccalloc_free(c, 0), CCALLOC_UNKNOWN_POINTER);
    check_unchanged(&snap, "free after the segment was released");
    CHECK_EQ_I64("device 0 reserved after empty_cache", snap.stats[0].reserved_bytes.all.current, 0);
    CHECK_EQ_I64("device 1 reserved after empty_cache", snap.stats[1].reserved_bytes.all.current, 0);
    free(host);
}

/* record_stream: a block used on a paused stream is not reused until that stream resumes. */
static void test_record_stream(void) {
    const cudaStream_t side = (cudaStream_t)(uintptr_t)0x5151;
    const int dev = 1;
    void *p1, *p2, *p3, *p4, *x, *y;
    ccalloc_stats s0, s;
    uint64_t big = 12 * MIB; /* its own 12 MiB segment: reuse is unambiguous */
    section("record_stream with a paused stream (device 1)");
    EXPECT_STATUS(ccalloc_sim_pause_stream(dev, side, true), CCALLOC_OK);
    s0 = get_stats(dev);
    p1 = track_malloc(big, dev, S_A);
    if (p1 == NULL) return;
    EXPECT_STATUS(ccalloc_record_stream(p1, dev, side), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_record_stream(p1, dev, side), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_record_stream(p1, dev, S_A), CCALLOC_OK);
    /* free it "behind the caller's back": keep the canary to prove nobody writes it */
    {
        int i = find_tracked(p1);
        tracked t = g_live[i];
        EXPECT_STATUS(ccalloc_free(p1, dev), CCALLOC_OK);
        g_live[i] = g_live[--g_nlive];
        s = get_stats(dev);
        CHECK_EQ_I64("allocation.current after freeing the recorded block", s.allocation.all.current,
                     s0.allocation.all.current);
        CHECK_EQ_I64("active.current still counts it (awaiting the side stream)", s.active.all.current,
                     s0.active.all.current + 1);
        CHECK_EQ_I64("active_bytes.current still counts it", s.active_bytes.all.current,
                     s0.active_bytes.all.current + (int64_t)big);
        CHECK_EQ_I64("requested_bytes.current still counts it (as PyTorch)", s.requested_bytes.all.current,
                     s0.requested_bytes.all.current + (int64_t)big);
        EXPECT_STATUS(ccalloc_free(p1, dev), CCALLOC_DOUBLE_FREE);
        p2 = track_malloc(big, dev, S_A);
        CHECK(p2 != p1, "same size on the same stream is NOT served by the block awaiting the paused stream");
        CHECK_EQ_I64("reserved_bytes: memory for a second block was needed", get_stats(dev).reserved_bytes.all.current,
                     s0.reserved_bytes.all.current + 2 * (int64_t)big);
        CHECK(canary_ok(t.p, t.size, t.tag), "the freed block's contents were not touched while it awaited");
        check_live_blocks("while the side stream is paused");
        track_free(p2);
        p3 = track_malloc(big, dev, S_A);
        CHECK(p3 == p2, "the block without cross-stream use is reused at once (%p == %p)", p3, p2);
        CHECK(canary_ok(t.p, t.size, t.tag), "the awaiting block is still untouched");
        EXPECT_STATUS(ccalloc_sim_pause_stream(dev, side, false), CCALLOC_OK);
        p4 = track_malloc(big, dev, S_A);
        CHECK(p4 == p1, "after the side stream resumes, the block is reused (%p == %p)", p4, p1);
        s = get_stats(dev);
        CHECK_EQ_I64("reserved_bytes: nothing more was needed", s.reserved_bytes.all.current,
                     s0.reserved_bytes.all.current + 2 * (int64_t)big);
        CHECK_EQ_I64("sim device bytes == reserved", sim_bytes(dev), s.reserved_bytes.all.current);
        CHECK_EQ_I64("active.current == allocation.current again", s.active.all.current, s.allocation.all.current);
    }
    track_free(p3);
    track_free(p4);

    /* Small pool too: a 4 KiB block awaiting a paused stream is not reused. */
    EXPECT_STATUS(ccalloc_sim_pause_stream(dev, side, true), CCALLOC_OK);
    x = track_malloc(4096, dev, S_A);
    if (x == NULL) return;
    EXPECT_STATUS(ccalloc_record_stream(x, dev, side), CCALLOC_OK);
    {
        int i = find_tracked(x);
        tracked t = g_live[i];
        EXPECT_STATUS(ccalloc_free(x, dev), CCALLOC_OK);
        g_live[i] = g_live[--g_nlive];
        y = track_malloc(4096, dev, S_A);
        CHECK(y != x && ((uintptr_t)y + 4096 <= (uintptr_t)x || (uintptr_t)x + 4096 <= (uintptr_t)y),
              "small block awaiting a paused stream is not reused or overlapped (%p vs %p)", y, x);
        CHECK(canary_ok(t.p, t.size, t.tag), "the awaiting small block is untouched");
    }
    track_free(y);
    /* empty_cache waits for pending events (the sim runs the paused stream to the event). */
    s0 = get_stats(dev);
    EXPECT_STATUS(ccalloc_empty_cache(dev), CCALLOC_OK);
    s = get_stats(dev);
    CHECK_EQ_I64("empty_cache with a block awaiting a paused stream: reserved", s.reserved_bytes.all.current, 0);
    CHECK_EQ_I64("... active", s.active.all.current, 0);
    CHECK_EQ_I64("... num_sync_all_streams + 1", s.num_sync_all_streams, s0.num_sync_all_streams + 1);
    CHECK_EQ_I64("... sim device 1 bytes", sim_bytes(dev), 0);
    EXPECT_STATUS(ccalloc_sim_pause_stream(dev, side, false), CCALLOC_OK);
}

/* Running out of device memory (no limit set): the cache is released, then OOM is reported. */
static void test_device_oom(void) {
    const int dev = 1;
    uint64_t half = g_capacity / 2 + 2 * MIB; /* two never fit */
    void *a, *small, *sentinel = (void *)(uintptr_t)0x1234, *p = sentinel;
    ccalloc_stats s0, s;
    section("out of device memory (device 1)");
    a = track_malloc(half, dev, S_A);
    if (a == NULL) return;
    small = track_malloc(4096, dev, S_A);
    track_free(small); /* leaves a cached 2 MiB small segment */
    s0 = get_stats(dev);
    CHECK_EQ_I64("reserved before the OOM", s0.reserved_bytes.all.current, (int64_t)(half + 2 * MIB));
    EXPECT_STATUS(ccalloc_malloc((size_t)half, dev, S_A, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "OOM: out_ptr untouched");
    EXPECT_MSG_HAS("out of memory");
    EXPECT_MSG_HAS("reserved");
    EXPECT_MSG_HAS("live");
    EXPECT_MSG_HAS("largest");
    s = get_stats(dev);
    CHECK_EQ_I64("num_ooms + 1", s.num_ooms, s0.num_ooms + 1);
    CHECK_EQ_I64("num_alloc_retries + 1 (cache released before failing)", s.num_alloc_retries,
                 s0.num_alloc_retries + 1);
    CHECK_EQ_I64("reserved after the OOM: only the live segment", s.reserved_bytes.all.current, (int64_t)half);
    CHECK_EQ_I64("allocation.current unchanged", s.allocation.all.current, s0.allocation.all.current);
    CHECK_EQ_I64("allocated_bytes.current unchanged", s.allocated_bytes.all.current,
                 s0.allocated_bytes.all.current);
    CHECK_EQ_I64("sim device 1 bytes == the live segment", sim_bytes(dev), half);
    check_live_blocks("after the OOM");
    track_free(a);
    p = track_malloc(half, dev, S_A);
    CHECK(p == a, "after freeing, the same request succeeds from the cache");
    track_free(p);
    EXPECT_STATUS(ccalloc_empty_cache(dev), CCALLOC_OK);
}

static void test_memory_fraction(void) {
    const int dev = 0;
    double f = -1.0;
    uint64_t limit = g_capacity / 4;
    uint64_t first = round_up(limit * 3 / 4, 2 * MIB), second = limit / 2;
    void *a, *b, *sentinel = (void *)(uintptr_t)0x4321, *p = sentinel;
    ccalloc_stats s0, s;
    section("memory fraction (device 0)");
    EXPECT_STATUS(ccalloc_get_memory_fraction(dev, &f), CCALLOC_OK);
    CHECK(f == 1.0, "default fraction is 1.0 (got %g)", f);
    EXPECT_STATUS(ccalloc_set_memory_fraction(0.25, dev), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_get_memory_fraction(dev, &f), CCALLOC_OK);
    CHECK(f == 0.25, "fraction reads back 0.25 (got %g)", f);
    EXPECT_STATUS(ccalloc_get_memory_fraction(1, &f), CCALLOC_OK);
    CHECK(f == 1.0, "device 1's fraction unaffected (got %g)", f);
    EXPECT_STATUS(ccalloc_set_memory_fraction(1.5, dev), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_set_memory_fraction(-0.1, dev), CCALLOC_INVALID_ARGUMENT);
    EXPECT_STATUS(ccalloc_get_memory_fraction(dev, &f), CCALLOC_OK);
    CHECK(f == 0.25, "refused fractions change nothing (got %g)", f);

    a = track_malloc(first, dev, S_A);
    CHECK(a != NULL, "an allocation of 3/4 of the limit succeeds");
    s0 = get_stats(dev);
    EXPECT_STATUS(ccalloc_malloc((size_t)second, dev, S_A, &p), CCALLOC_OUT_OF_MEMORY);
    CHECK(p == sentinel, "over the limit: out_ptr untouched");
    EXPECT_MSG_HAS("per_process_memory_fraction");
    EXPECT_MSG_HAS("reserved");
    EXPECT_MSG_HAS("live");
    EXPECT_MSG_HAS("largest");
    s = get_stats(dev);
    CHECK_EQ_I64("num_ooms + 1", s.num_ooms, s0.num_ooms + 1);
    CHECK_EQ_I64("reserved unchanged by the refused request", s.reserved_bytes.all.current,
                 s0.reserved_bytes.all.current);
    CHECK(s.reserved_bytes.all.current <= (int64_t)limit, "reserved (%" PRId64 ") within the limit (%" PRIu64 ")",
          s.reserved_bytes.all.current, limit);
    b = track_malloc(4096, dev, S_A); /* a 2 MiB small segment still fits */
    CHECK(b != NULL, "a small request under the limit still succeeds");
    EXPECT_STATUS(ccalloc_set_memory_fraction(1.0, dev), CCALLOC_OK);
    b = track_malloc(second, dev, S_A);
    CHECK(b != NULL, "with the fraction back at 1.0 the same request succeeds");
    check_live_blocks("after the memory-fraction checks");
    EXPECT_STATUS(ccalloc_set_memory_fraction(0.0, dev), CCALLOC_OK);
    p = sentinel;
    EXPECT_STATUS(ccalloc_malloc(30 * MIB, dev, S_B, &p), CCALLOC_OUT_OF_MEMORY);
    EXPECT_STATUS(ccalloc_set_memory_fraction(1.0, dev), CCALLOC_OK);
    track_free_all();
    EXPECT_STATUS(ccalloc_empty_cache(-1), CCALLOC_OK);
    CHECK_EQ_I64("device 0 reserved after the fraction checks", get_stats(dev).reserved_bytes.all.current, 0);
}

static void test_config(void) {
    ccalloc_stats s;
    double f = -1.0;
    void *p;
    section("ccalloc_set_config");
    EXPECT_STATUS(ccalloc_set_config(""), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:256"), CCALLOC_OK);
    CHECK_EQ_I64("max_split_size on device 0", get_stats(0).max_split_size, (int64_t)(256 * MIB));
    CHECK_EQ_I64("max_split_size on device 1", get_stats(1).max_split_size, (int64_t)(256 * MIB));
    EXPECT_STATUS(ccalloc_set_config("bogus_key:1"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("bogus_key");
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:10"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("max_split_size_mb");
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:ten"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("max_split_size_mb");
    EXPECT_STATUS(ccalloc_set_config("garbage_collection_threshold:1.5"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("garbage_collection_threshold");
    EXPECT_STATUS(ccalloc_set_config("per_process_memory_fraction:2"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("per_process_memory_fraction");
    EXPECT_STATUS(ccalloc_set_config("roundup_power2_divisions:3"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("roundup_power2_divisions");
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("key:value");
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:512,nonsense_key:3"), CCALLOC_CONFIG_ERROR);
    EXPECT_MSG_HAS("nonsense_key");
    s = get_stats(0);
    CHECK_EQ_I64("a refused config changes nothing (max_split_size still 256 MiB)", s.max_split_size,
                 (int64_t)(256 * MIB));

    /* max_split_size in effect: oversize statistics. */
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:20"), CCALLOC_OK);
    p = track_malloc(30 * MIB, 0, S_A);
    s = get_stats(0);
    CHECK_EQ_I64("oversize_allocations.current (30 MiB >= max_split 20 MiB)", s.oversize_allocations.current, 1);
    if (!g_paged) {
        CHECK_EQ_I64("oversize_segments.current", s.oversize_segments.current, 1);
    }
    track_free(p);
    CHECK_EQ_I64("oversize_allocations.current after free", get_stats(0).oversize_allocations.current, 0);
    EXPECT_STATUS(ccalloc_empty_cache(0), CCALLOC_OK);
    CHECK_EQ_I64("oversize_segments.current after empty_cache", get_stats(0).oversize_segments.current, 0);

    /* per_process_memory_fraction through the config applies to every device. */
    EXPECT_STATUS(ccalloc_set_config("per_process_memory_fraction:0.5"), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_get_memory_fraction(0, &f), CCALLOC_OK);
    CHECK(f == 0.5, "config per_process_memory_fraction:0.5 -> device 0 fraction 0.5 (got %g)", f);
    EXPECT_STATUS(ccalloc_get_memory_fraction(1, &f), CCALLOC_OK);
    CHECK(f == 0.5, "config per_process_memory_fraction:0.5 -> device 1 fraction 0.5 (got %g)", f);
    EXPECT_STATUS(ccalloc_set_config("per_process_memory_fraction:1"), CCALLOC_OK);

    /* A fraction set for one device survives an unrelated config change. */
    EXPECT_STATUS(ccalloc_set_memory_fraction(0.25, 1), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_set_config("max_non_split_rounding_mb:20"), CCALLOC_OK);
    f = -1.0;
    EXPECT_STATUS(ccalloc_get_memory_fraction(1, &f), CCALLOC_OK);
    CHECK(f == 0.25, "set_memory_fraction(0.25, 1) survives set_config(\"max_non_split_rounding_mb:20\") (got %g)", f);

    /* reset_config: every setting back to its default (and CCALLOC_CONF again). */
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:64,per_process_memory_fraction:0.5"), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_reset_config(), CCALLOC_OK);
    CHECK_EQ_I64("max_split_size on device 0 after reset_config (unlimited)", get_stats(0).max_split_size, -1);
    CHECK_EQ_I64("max_split_size on device 1 after reset_config (unlimited)", get_stats(1).max_split_size, -1);
    f = -1.0;
    EXPECT_STATUS(ccalloc_get_memory_fraction(0, &f), CCALLOC_OK);
    CHECK(f == 1.0, "device 0 fraction after reset_config is 1.0 (got %g)", f);
    f = -1.0;
    EXPECT_STATUS(ccalloc_get_memory_fraction(1, &f), CCALLOC_OK);
    CHECK(f == 1.0, "device 1 fraction after reset_config is 1.0 (got %g)", f);
}

/* ------------------------------------------------------------------------------------------ */
/* Threads                                                                                     */

#define THREADS 4
#define THREAD_STEPS 20000
#define THREAD_MAX_LIVE 24
#define REGISTRY_CAP (THREADS * THREAD_MAX_LIVE)

typedef struct {
    uintptr_t start, end;
    int owner;
    bool used;
} interval;

static interval g_registry[REGISTRY_CAP];
static pthread_mutex_t g_registry_lock = PTHREAD_MUTEX_INITIALIZER;

/* Adds a freshly allocated range; false if it overlaps a range still live. */
static bool registry_add(void *p, uint64_t size, int owner) {
    uintptr_t s = (uintptr_t)p, e = s + size;
    bool ok = true;
    int i, slot = -1;
    pthread_mutex_lock(&g_registry_lock);
    for (i = 0; i < REGISTRY_CAP; i++) {
        if (!g_registry[i].used) {
            if (slot < 0) slot = i;
        } else if (s < g_registry[i].end && g_registry[i].start < e) {
            ok = false;
        }
    }
    if (slot >= 0) {
        g_registry[slot].start = s;
        g_registry[slot].end = e;
        g_registry[slot].owner = owner;
        g_registry[slot].used = true;
    } else {
        ok = false;
    }
    pthread_mutex_unlock(&g_registry_lock);
    return ok;
}

/* Called before the block is freed, so nobody can be handed it while it is still listed. */
static void registry_remove(void *p) {
    int i;
    pthread_mutex_lock(&g_registry_lock);
    for (i = 0; i < REGISTRY_CAP; i++) {
        if (g_registry[i].used && g_registry[i].start == (uintptr_t)p) {
            g_registry[i].used = false;
            break;
        }
    }
    pthread_mutex_unlock(&g_registry_lock);
}

static int registry_count(void) {
    int i, n = 0;
    pthread_mutex_lock(&g_registry_lock);
    for (i = 0; i < REGISTRY_CAP; i++) n += g_registry[i].used;
    pthread_mutex_unlock(&g_registry_lock);
    return n;
}

typedef struct {
    int id;
    uint64_t allocs, frees, requested, records, pauses;
    int failures;
    bool own_error_ok;
    char first_failure[256];
} worker;

static uint64_t xorshift(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void worker_fail(worker *w, const char *what, ccalloc_status st) {
    if (w->failures++ == 0) {
        snprintf(w->first_failure, sizeof w->first_failure, "%s -> %s: %s", what, name_of(st),
                 ccalloc_last_error());
    }
}

static cudaStream_t worker_stream(int t) { return stream_id(0x100 + (uintptr_t)t); }
static cudaStream_t worker_side_stream(int t) { return stream_id(0x200 + (uintptr_t)t); }

static void *worker_main(void *arg) {
    worker *w = (worker *)arg;
    tracked live[THREAD_MAX_LIVE];
    int n = 0, step, d;
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(w->id + 1);
    bool side_paused = false;
    cudaStream_t mine = worker_stream(w->id), side = worker_side_stream(w->id);
    for (step = 0; step < THREAD_STEPS; step++) {
        uint64_t r = xorshift(&rng) % 100;
        if (n < THREAD_MAX_LIVE && (n == 0 || r < 55)) {
            uint64_t kind = xorshift(&rng) % 100, size;
            int dev = (int)(xorshift(&rng) % 2);
            void *p = NULL;
            ccalloc_status st;
            if (kind < 60) size = 1 + xorshift(&rng) % (64 * KIB);
            else if (kind < 90) size = 64 * KIB + xorshift(&rng) % (4 * MIB);
            else if (kind < 99) size = 4 * MIB + xorshift(&rng) % (8 * MIB);
            else size = 12 * MIB + xorshift(&rng) % (28 * MIB);
            st = ccalloc_malloc((size_t)size, dev, mine, &p);
            if ((uint32_t)st != 0 || p == NULL) {
                worker_fail(w, "malloc", st);
                continue;
            }
            if ((uintptr_t)p % 512 != 0) worker_fail(w, "malloc returned a misaligned pointer", st);
            if (!registry_add(p, size, w->id)) worker_fail(w, "malloc returned memory overlapping a live block", st);
            live[n].p = p;
            live[n].size = size;
            live[n].device = dev;
            live[n].tag = ((uint32_t)w->id << 24) | (uint32_t)step;
            canary_write(p, size, live[n].tag);
            n++;
            w->allocs++;
            w->requested += size;
        } else {
            int i = (int)(xorshift(&rng) % (uint64_t)n);
            tracked t = live[i];
            ccalloc_status st;
            if (!canary_ok(t.p, t.size, t.tag)) worker_fail(w, "a live block was overwritten", CCALLOC_OK);
            if (xorshift(&rng) % 4 == 0) {
                /* used on another thread's stream, or on our own (sometimes paused) side stream */
                cudaStream_t other = xorshift(&rng) % 2 ? worker_stream((w->id + 1 + (int)(xorshift(&rng) % 3)) % THREADS)
                                                        : side;
                st = ccalloc_record_stream(t.p, t.device, other);
                if ((uint32_t)st != 0) worker_fail(w, "record_stream", st);
                w->records++;
            }
            registry_remove(t.p);
            st = ccalloc_free(t.p, t.device);
            if ((uint32_t)st != 0) worker_fail(w, "free", st);
            live[i] = live[--n];
            w->frees++;
        }
        if (step % 97 == 96) {
            side_paused = !side_paused;
            w->pauses += side_paused;
            for (d = 0; d < 2; d++) {
                ccalloc_status st = ccalloc_sim_pause_stream(d, side, side_paused);
                if ((uint32_t)st != 0) worker_fail(w, "sim_pause_stream", st);
            }
        }
        if (w->id == 0 && step % 250 == 249) {
            ccalloc_status st = ccalloc_empty_cache(-1);
            if ((uint32_t)st != 0) worker_fail(w, "empty_cache", st);
        }
        if (w->id == 1 && step % 100 == 0) {
            for (d = 0; d < 2; d++) {
                ccalloc_stats s;
                ccalloc_status st = ccalloc_get_stats(d, &s);
                if ((uint32_t)st != 0) worker_fail(w, "get_stats", st);
                else if (s.allocated_bytes.all.current > s.reserved_bytes.all.current ||
                         s.allocation.all.current > s.active.all.current || s.allocation.all.current < 0)
                    worker_fail(w, "inconsistent stats mid-run", st);
            }
        }
        if (step == THREAD_STEPS / 2) {
            /* This thread's last error is its own. */
            int local = 0;
            ccalloc_status st = ccalloc_free(&local, 0);
            w->own_error_ok = (uint32_t)st == CCALLOC_UNKNOWN_POINTER &&
                              strstr(ccalloc_last_error(), "not allocated by ccalloc") != NULL;
        }
    }
    for (d = 0; d < 2; d++) {
        ccalloc_status st = ccalloc_sim_pause_stream(d, side, false);
        if ((uint32_t)st != 0) worker_fail(w, "sim_pause_stream (resume)", st);
    }
    while (n > 0) {
        tracked t = live[--n];
        ccalloc_status st;
        if (!canary_ok(t.p, t.size, t.tag)) worker_fail(w, "a live block was overwritten", CCALLOC_OK);
        registry_remove(t.p);
        st = ccalloc_free(t.p, t.device);
        if ((uint32_t)st != 0) worker_fail(w, "free", st);
        w->frees++;
    }
    return NULL;
}

static void test_threads(void) {
    pthread_t th[THREADS];
    worker w[THREADS];
    int t, d, created = 0;
    uint64_t allocs = 0, frees = 0, requested = 0;
    int64_t dev_allocs = 0, dev_frees = 0, dev_requested = 0;
    char main_msg[256];
    int local = 0;
    section("4 threads, own streams, random alloc/free with canaries and cross-stream use");
    EXPECT_STATUS(ccalloc_reset_accumulated_stats(-1), CCALLOC_OK);
    EXPECT_STATUS(ccalloc_free(&local, 1), CCALLOC_UNKNOWN_POINTER);
    snprintf(main_msg, sizeof main_msg, "%s", ccalloc_last_error());
    memset(w, 0, sizeof w);
    for (t = 0; t < THREADS; t++) {
        w[t].id = t;
        if (pthread_create(&th[t], NULL, worker_main, &w[t]) != 0) {
            CHECK(false, "pthread_create %d", t);
            break;
        }
        created++;
    }
    for (t = 0; t < created; t++) pthread_join(th[t], NULL);
    for (t = 0; t < created; t++) {
        CHECK(w[t].failures == 0 && w[t].allocs > 0 && w[t].allocs == w[t].frees,
              "thread %d: %" PRIu64 " allocs, %" PRIu64 " frees, %" PRIu64 " record_stream, %" PRIu64
              " pauses, %d failures%s%s",
              t, w[t].allocs, w[t].frees, w[t].records, w[t].pauses, w[t].failures,
              w[t].failures ? "; first: " : "", w[t].first_failure);
        CHECK(w[t].own_error_ok, "thread %d saw its own last error", t);
        allocs += w[t].allocs;
        frees += w[t].frees;
        requested += w[t].requested;
    }
    CHECK(!strcmp(ccalloc_last_error(), main_msg), "the main thread's last error is untouched by the threads");
    CHECK_EQ_I64("registry empty after the threads", registry_count(), 0);
    for (d = 0; d < 2; d++) {
        ccalloc_stats s = get_stats(d);
        char what[96];
        dev_allocs += s.allocation.all.allocated;
        dev_frees += s.allocation.all.freed;
        dev_requested += s.requested_bytes.all.allocated;
        snprintf(what, sizeof what, "device %d allocation.all.current after the threads", d);
        CHECK_EQ_I64(what, s.allocation.all.current, 0);
        snprintf(what, sizeof what, "device %d allocated_bytes.all.current after the threads", d);
        CHECK_EQ_I64(what, s.allocated_bytes.all.current, 0);
        /* requested_bytes, like active, still counts freed blocks awaiting events (as PyTorch) */
        CHECK((s.requested_bytes.all.current == 0) == (s.active.all.current == 0),
              "device %d requested_bytes.all.current (%" PRId64 ") is 0 exactly when active.all.current (%" PRId64
              ") is", d, s.requested_bytes.all.current, s.active.all.current);
        snprintf(what, sizeof what, "device %d num_ooms during the threads", d);
        CHECK_EQ_I64(what, s.num_ooms, 0);
        snprintf(what, sizeof what, "device %d sim bytes == reserved", d);
        CHECK_EQ_I64(what, sim_bytes(d), s.reserved_bytes.all.current);
        CHECK(s.allocated_bytes.all.peak <= s.reserved_bytes.all.peak,
              "device %d peak allocated (%" PRId64 ") <= peak reserved (%" PRId64 ")", d,
              s.allocated_bytes.all.peak, s.reserved_bytes.all.peak);
    }
    CHECK_EQ_I64("allocation.all.allocated (both devices) == allocations made", dev_allocs, allocs);
    CHECK_EQ_I64("allocation.all.freed (both devices) == frees made", dev_frees, frees);
    CHECK_EQ_I64("requested_bytes.all.allocated (both devices) == bytes requested", dev_requested, requested);
    EXPECT_STATUS(ccalloc_empty_cache(-1), CCALLOC_OK);
    for (d = 0; d < 2; d++) {
        ccalloc_stats s = get_stats(d);
        char what[96];
        snprintf(what, sizeof what, "device %d active.all.current after empty_cache", d);
        CHECK_EQ_I64(what, s.active.all.current, 0);
        snprintf(what, sizeof what, "device %d requested_bytes.all.current after empty_cache", d);
        CHECK_EQ_I64(what, s.requested_bytes.all.current, 0);
        snprintf(what, sizeof what, "device %d reserved_bytes.all.current after empty_cache", d);
        CHECK_EQ_I64(what, s.reserved_bytes.all.current, 0);
        snprintf(what, sizeof what, "device %d segment.all.current after empty_cache", d);
        CHECK_EQ_I64(what, s.segment.all.current, 0);
        snprintf(what, sizeof what, "device %d inactive_split_bytes.all.current after empty_cache", d);
        CHECK_EQ_I64(what, s.inactive_split_bytes.all.current, 0);
        snprintf(what, sizeof what, "device %d num_device_alloc == num_device_free", d);
        CHECK_EQ_I64(what, s.num_device_alloc, s.num_device_free);
        snprintf(what, sizeof what, "device %d sim bytes after empty_cache", d);
        CHECK_EQ_I64(what, sim_bytes(d), 0);
    }
}

/* ------------------------------------------------------------------------------------------ */

static void test_torch_hooks(void) {
    const cudaStream_t side = (cudaStream_t)(uintptr_t)0x7070;
    void *p, *q;
    ccalloc_stats s0, s;
    double f = -1;
    int local = 0;
    section("PyTorch pluggable-allocator hooks");
    s0 = get_stats(0);
    p = ccalloc_torch_alloc(0, 0, S_A);
    CHECK(p == NULL, "torch_alloc(0) returns NULL");
    p = ccalloc_torch_alloc(1000, 0, S_A);
    CHECK(p != NULL && (uintptr_t)p % 512 == 0, "torch_alloc(1000) returns an aligned block (%p)", p);
    if (p == NULL) return;
    canary_write(p, 1000, 4242);
    s = get_stats(0);
    CHECK_EQ_I64("allocation + 1 after torch_alloc", s.allocation.all.current, s0.allocation.all.current + 1);
    CHECK_EQ_I64("requested_bytes + 1000 after torch_alloc", s.requested_bytes.all.current,
                 s0.requested_bytes.all.current + 1000);
    /* (A failing ccalloc_torch_alloc throws a C++ exception, by design: not callable from C.) */
    s0 = get_stats(0);
    ccalloc_torch_free(&local, 4, 0, S_A);
    CHECK(strstr(ccalloc_last_error(), "not allocated") != NULL,
          "torch_free of an unknown pointer leaves its message: \"%s\"", ccalloc_last_error());
    ccalloc_torch_free(NULL, 0, 0, S_A);
    s = get_stats(0);
    CHECK(stats_equal(&s, &s0), "torch_free of unknown/NULL pointers changes nothing");

    /* record_stream through the hook (device found from the pointer) */
    EXPECT_STATUS(ccalloc_sim_pause_stream(0, side, true), CCALLOC_OK);
    ccalloc_torch_record_stream(p, side);
    CHECK(canary_ok(p, 1000, 4242), "block intact after torch_record_stream");
    ccalloc_torch_free(p, 1000, 0, S_A);
    s = get_stats(0);
    CHECK_EQ_I64("torch_free: allocation back", s.allocation.all.current, s0.allocation.all.current - 1);
    CHECK_EQ_I64("torch_free of a block recorded on a paused stream: still active", s.active.all.current,
                 s0.active.all.current);
    q = ccalloc_torch_alloc(1000, 0, S_A);
    CHECK(q != NULL && q != p, "the recorded block is not reused while the stream is paused (%p vs %p)", q, p);
    CHECK(canary_ok(p, 1000, 4242), "the awaiting block is untouched");
    EXPECT_STATUS(ccalloc_sim_pause_stream(0, side, false), CCALLOC_OK);
    ccalloc_torch_free(q, 1000, 0, S_A);

    ccalloc_torch_set_memory_fraction(0.5, 1);
    EXPECT_STATUS(ccalloc_get_memory_fraction(1, &f), CCALLOC_OK);
    CHECK(f == 0.5, "torch_set_memory_fraction(0.5, 1) -> 0.5 (got %g)", f);
    ccalloc_torch_set_memory_fraction(1.0, 1);
    ccalloc_torch_init(2);
    {
        const char *name = NULL;
        EXPECT_STATUS(ccalloc_backend(&name), CCALLOC_OK);
    }
    ccalloc_torch_empty_cache();
    CHECK_EQ_I64("reserved on device 0 after torch_empty_cache", get_stats(0).reserved_bytes.all.current, 0);
    CHECK_EQ_I64("reserved on device 1 after torch_empty_cache", get_stats(1).reserved_bytes.all.current, 0);
    CHECK_EQ_I64("sim device 0 bytes after torch_empty_cache", sim_bytes(0), 0);
}

static void test_shutdown(void) {
    void *p, *sentinel = (void *)(uintptr_t)0x7777, *q = sentinel;
    snapshot snap;
    ccalloc_stats s;
    int32_t count = -3;
    const char *name = "untouched";
    section("shutdown");
    p = track_malloc(5000, 1, S_A);
    snap = take_snapshot();
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_BUSY);
    EXPECT_MSG_HAS("live");
    check_unchanged(&snap, "shutdown refused (BUSY)");
    q = track_malloc(100, 0, S_A);
    CHECK(q != NULL, "the allocator still works after a refused shutdown");
    track_free_all();
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_OK);
    q = sentinel;
    EXPECT_STATUS(ccalloc_malloc(64, 0, S_A, &q), CCALLOC_SHUT_DOWN);
    EXPECT_MSG_HAS("shut down");
    CHECK(q == sentinel, "malloc after shutdown: out_ptr untouched");
    EXPECT_STATUS(ccalloc_free(p, 1), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_get_stats(0, &s), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_device_count(&count), CCALLOC_SHUT_DOWN);
    CHECK(count == -3, "device_count after shutdown: out param untouched");
    EXPECT_STATUS(ccalloc_backend(&name), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_set_config("max_split_size_mb:256"), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_empty_cache(-1), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_record_stream(p, 1, S_B), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_set_memory_fraction(0.5, 0), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_reset_peak_stats(-1), CCALLOC_SHUT_DOWN);
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_SHUT_DOWN);
    CHECK(!ccalloc_is_initialized(), "ccalloc_is_initialized() is false after shutdown");

    section("ccalloc_init after shutdown");
    EXPECT_STATUS(ccalloc_init(), CCALLOC_OK);
    CHECK(ccalloc_is_initialized(), "ccalloc_is_initialized() is true again");
    s = get_stats(0);
    CHECK_EQ_I64("fresh runtime: device 0 reserved", s.reserved_bytes.all.current, 0);
    CHECK_EQ_I64("fresh runtime: device 0 num_device_alloc", s.num_device_alloc, 0);
    CHECK_EQ_I64("fresh runtime: max_split_size back to the default", s.max_split_size, -1);
    p = track_malloc(MIB + 1, 0, S_A);
    check_live_blocks("in the restarted runtime");
    track_free_all();
    EXPECT_STATUS(ccalloc_shutdown(), CCALLOC_OK);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    setup_env();
    test_static_functions();
    test_before_init();
    test_init();
    test_sizes_and_stats();
    test_bad_calls();
    test_record_stream();
    test_device_oom();
    test_memory_fraction();
    test_config();
    test_threads();
    test_torch_hooks();
    test_shutdown();
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
