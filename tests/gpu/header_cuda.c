/* ccalloc.h together with the CUDA runtime's headers, from plain C (and C++ with g++).
 *
 * scripts/gpu_check.sh compiles this with gcc -std=c11 and with g++ -x c++, CUDA's headers
 * first (default) and ccalloc.h first (-DCCALLOC_FIRST): both headers declare cudaStream_t,
 * and any disagreement is a compile error. The default C build is linked with libcudart and
 * run: a ccalloc block used through the CUDA runtime on a real stream.
 *
 * Output: one line per check and a last line "N passed, M failed"; exit status 1 on failure. */

#ifdef CCALLOC_FIRST
#include "ccalloc.h"
#include <cuda_runtime.h>
#else
#include <cuda_runtime.h>
#include "ccalloc.h"
#endif

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Compiles only if ccalloc.h's cudaStream_t is the runtime's `struct CUstream_st *`. */
static cudaStream_t same_stream_type(struct CUstream_st *s) { return s; }
static CUstream_st *same_struct(cudaStream_t s) { return s; }

static int passed, failed;

static bool check(bool ok, const char *what) {
    printf("%s  %s\n", ok ? "PASS" : "FAIL", what);
    if (ok) {
        passed++;
    } else {
        failed++;
    }
    return ok;
}

static bool status_ok(ccalloc_status st, const char *what) {
    char line[512];
    snprintf(line, sizeof line, "%s -> %s%s%s", what, ccalloc_status_name((uint32_t)st),
             (uint32_t)st ? ": " : "", (uint32_t)st ? ccalloc_last_error() : "");
    return check((uint32_t)st == CCALLOC_OK, line);
}

static bool cuda_ok(cudaError_t e, const char *what) {
    char line[512];
    snprintf(line, sizeof line, "%s -> %s", what, cudaGetErrorName(e));
    return check(e == cudaSuccess, line);
}

int main(void) {
    const size_t n = ((size_t)1 << 20) + 3;
    cudaStream_t s = NULL, s2 = NULL;
    void *p = NULL;
    unsigned char *host = (unsigned char *)malloc(n);
    const char *backend = NULL;
    size_t i, bad = 0;

    if (getenv("CCALLOC_BACKEND") != NULL) {
        printf("this test runs on the CUDA driver: unset CCALLOC_BACKEND\n");
        return 2;
    }
    if (!host || !cuda_ok(cudaSetDevice(0), "cudaSetDevice(0)") ||
        !cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags") ||
        !cuda_ok(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (2)")) {
        goto done;
    }
    s = same_stream_type(same_struct(s));
    if (!status_ok(ccalloc_init(), "ccalloc_init()")) goto done;
    if (status_ok(ccalloc_backend(&backend), "ccalloc_backend")) {
        check(backend != NULL && strcmp(backend, "cuda") == 0, "backend is cuda");
    }
    if (!status_ok(ccalloc_malloc(n, 0, s, &p), "ccalloc_malloc(1 MiB + 3, device 0, runtime stream)")) goto done;
    cuda_ok(cudaMemsetAsync(p, 0x5a, n, s), "cudaMemsetAsync on the ccalloc block");
    cuda_ok(cudaMemcpyAsync(host, p, n, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync back");
    cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    for (i = 0; i < n; i++) bad += host[i] != 0x5a;
    check(bad == 0, "the block holds what cudaMemsetAsync wrote");
    status_ok(ccalloc_record_stream(p, 0, s2), "ccalloc_record_stream on a second runtime stream");
    status_ok(ccalloc_free(p, 0), "ccalloc_free");
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    status_ok(ccalloc_empty_cache(-1), "ccalloc_empty_cache(-1)");
    status_ok(ccalloc_shutdown(), "ccalloc_shutdown");
done:
    if (s) cudaStreamDestroy(s);
    if (s2) cudaStreamDestroy(s2);
    free(host);
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 && passed > 0 ? 0 : 1;
}
