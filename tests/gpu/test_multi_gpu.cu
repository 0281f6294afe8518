// Two-GPU checks of ccalloc on the CUDA driver (skipped with fewer than two devices):
//  1. record_stream with another device's stream: the block is not reused before that
//     stream's work is done (the event must be made in the stream's own context);
//  2. peer access: a kernel on device 1, and a peer copy, may use memory ccalloc gave
//     device 0 (paged memory needs its own access grant for each peer).
// Build: nvcc -std=c++17 -arch=sm_90 -Iinclude tests/gpu/test_multi_gpu.cu -Lgpu -lccalloc
// Prints "N passed, M failed" last; exit status 0 only if nothing failed (77: skipped).
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include "ccalloc.h"

static int passed = 0, failed = 0;

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (cond) {                                        \
            passed++;                                      \
        } else {                                           \
            failed++;                                      \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);    \
            printf(__VA_ARGS__);                           \
            printf("\n");                                  \
        }                                                  \
    } while (0)

__global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

__global__ void fill(int *p, size_t n, int v) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}

// A block of device 0 recorded on a stream of device 1 that is still busy: freed, the same
// request must not get it back while that stream runs.
static void record_stream_across_devices() {
    cudaStream_t s0, s1;
    cudaSetDevice(0);
    cudaStreamCreate(&s0);
    cudaSetDevice(1);
    cudaStreamCreate(&s1);
    void *p = nullptr;
    cudaSetDevice(0);
    CHECK(ccalloc_malloc(1 << 20, 0, s0, &p) == CCALLOC_OK, "malloc on device 0: %s", ccalloc_last_error());
    cudaSetDevice(1);
    spin<<<1, 1, 0, s1>>>(3000000000LL);  // about 1.5 s
    CHECK(cudaGetLastError() == cudaSuccess, "spin kernel launched");
    cudaSetDevice(0);
    CHECK(ccalloc_record_stream(p, 0, s1) == CCALLOC_OK, "record_stream: %s", ccalloc_last_error());
    CHECK(ccalloc_free(p, 0) == CCALLOC_OK, "free: %s", ccalloc_last_error());
    void *q = nullptr;
    CHECK(ccalloc_malloc(1 << 20, 0, s0, &q) == CCALLOC_OK, "malloc again: %s", ccalloc_last_error());
    bool busy = cudaStreamQuery(s1) == cudaErrorNotReady;
    CHECK(!(q == p && busy), "the block came back (%p) while device 1's stream still used it", q);
    cudaSetDevice(1);
    cudaStreamSynchronize(s1);
    cudaSetDevice(0);
    ccalloc_free(q, 0);
    // Once that stream is done, the block is reusable.
    ccalloc_empty_cache(0);
    ccalloc_paging_stats stats;
    CHECK(ccalloc_get_paging_stats(0, &stats) == CCALLOC_OK, "paging stats");
    cudaStreamDestroy(s0);
    cudaSetDevice(1);
    cudaStreamDestroy(s1);
    cudaSetDevice(0);
}

// Memory of device 0 written by a kernel on device 1 and by a peer copy.
static void peer_access() {
    int can = 0;
    cudaDeviceCanAccessPeer(&can, 1, 0);
    if (!can) {
        printf("skip peer access: device 1 cannot reach device 0\n");
        return;
    }
    cudaSetDevice(1);
    cudaError_t enabled = cudaDeviceEnablePeerAccess(0, 0);
    CHECK(enabled == cudaSuccess || enabled == cudaErrorPeerAccessAlreadyEnabled, "enable peer access");
    cudaGetLastError();
    const size_t bytes = 64 << 20, n = bytes / sizeof(int);
    void *p = nullptr;
    cudaSetDevice(0);
    CHECK(ccalloc_malloc(bytes, 0, nullptr, &p) == CCALLOC_OK, "malloc: %s", ccalloc_last_error());
    cudaSetDevice(1);
    fill<<<(unsigned)((n + 255) / 256), 256>>>((int *)p, n, 7);
    cudaError_t e = cudaDeviceSynchronize();
    CHECK(e == cudaSuccess, "kernel on device 1 writing device 0's block: %s", cudaGetErrorString(e));
    int last = 0;
    cudaSetDevice(0);
    if (e == cudaSuccess) {
        cudaMemcpy(&last, (int *)p + n - 1, sizeof last, cudaMemcpyDeviceToHost);
        CHECK(last == 7, "device 0 reads what device 1 wrote (%d)", last);
    }
    void *src = nullptr;
    cudaSetDevice(1);
    cudaMalloc(&src, bytes);
    cudaMemset(src, 0x11, bytes);
    e = cudaMemcpyPeer(p, 0, src, 1, bytes);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    CHECK(e == cudaSuccess, "peer copy into device 0's block: %s", cudaGetErrorString(e));
    cudaFree(src);
    cudaSetDevice(0);
    if (e == cudaSuccess) {
        cudaMemcpy(&last, (int *)p + n - 1, sizeof last, cudaMemcpyDeviceToHost);
        CHECK(last == 0x11111111, "device 0 reads the peer copy (%#x)", last);
    }
    CHECK(ccalloc_free(p, 0) == CCALLOC_OK, "free: %s", ccalloc_last_error());
}

int main() {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
        printf("skipped: %d device(s), two needed\n0 passed, 0 failed\n", devices);
        return 77;
    }
    CHECK(ccalloc_init() == CCALLOC_OK, "init: %s", ccalloc_last_error());
    record_stream_across_devices();
    peer_access();
    CHECK(ccalloc_shutdown() == CCALLOC_OK, "shutdown: %s", ccalloc_last_error());
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
