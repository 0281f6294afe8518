// Whether the CUDA virtual memory calls wait for a busy device, and whether one physical
// handle may be mapped at two addresses at once with kernels seeing the same bytes through
// both. A page move (unmap a chunk under a free block, map it where growth needs it) waits
// for the kernels queued before that block's free; if the calls themselves waited for the
// whole device, mapping the chunk at its new address first and unmapping the old one later
// would save nothing.
//   nvcc -O2 -o /tmp/vmm_busy benches/gpu/vmm_busy.cu -lcuda && /tmp/vmm_busy
#include "vmm_common.h"
#include <cuda_runtime.h>
#include <chrono>
#include <algorithm>
#include <cstdio>
#include <vector>


__global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}

__global__ void fill(unsigned* p, unsigned v, size_t n) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}

__global__ void sum(const unsigned* p, size_t n, unsigned long long* out) {
    unsigned long long s = 0;
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += p[i];
    atomicAdd(out, s);
}

int main() {
    Vmm v;
    if (vmm_open(v)) return 1;
    const auto& [dev, prop, page, access] = v;
    int clock_khz = 0; cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    const size_t chunk = 8 * page;
    CUdeviceptr va; CHECK(cuMemAddressReserve(&va, 64 * chunk, 0, 0, 0));
    cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaEvent_t done; cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    const double spin_ms = 50;
    long long cycles = (long long)(spin_ms * clock_khz);
    printf("page %zu KiB, chunk %zu MiB; host us per call, with a %.0f ms kernel running and idle\n",
           page >> 10, chunk >> 20, spin_ms);
    printf("%-28s %10s %10s %16s\n", "call", "busy", "idle", "kernel still on");
    const char* names[7] = {"cuMemCreate", "cuMemMap (a at va0)", "cuMemSetAccess (va0)",
                            "cuMemUnmap (b, idle)", "cuMemMap (a again at va1)",
                            "cuMemSetAccess (va1)", "cuMemRelease (b)"};
    double took[2][7]; bool running[7]; int bad = 0;
    CUmemGenericAllocationHandle a = 0, b, c;
    for (int idle = 0; idle < 2; idle++) {
        CHECK(cuMemCreate(&b, chunk, &prop, 0));
        CHECK(cuMemMap(va + 4 * chunk, chunk, 0, b, 0));
        CHECK(cuMemSetAccess(va + 4 * chunk, chunk, &access, 1));
        CUmemGenericAllocationHandle h = 0;
        for (int k = 0; k < 7; k++) {
            if (!idle) {
                spin<<<1, 1, 0, s>>>(cycles);
                cudaEventRecord(done, s);
            }
            double t0 = now_us();
            CUresult r = CUDA_SUCCESS;
            switch (k) {
                case 0: r = cuMemCreate(&h, chunk, &prop, 0); break;
                case 1: r = cuMemMap(va, chunk, 0, h, 0); break;
                case 2: r = cuMemSetAccess(va, chunk, &access, 1); break;
                case 3: r = cuMemUnmap(va + 4 * chunk, chunk); break;
                case 4: r = cuMemMap(va + chunk, chunk, 0, h, 0); break;
                case 5: r = cuMemSetAccess(va + chunk, chunk, &access, 1); break;
                case 6: r = cuMemRelease(b); break;
            }
            took[idle][k] = now_us() - t0;
            if (!idle) running[k] = cudaEventQuery(done) == cudaErrorNotReady;
            if (r != CUDA_SUCCESS) { const char* e; cuGetErrorString(r, &e); printf("%s: %s\n", names[k], e); bad++; }
            cudaEventSynchronize(done);
        }
        if (idle) { a = h; break; }
        CHECK(cuMemUnmap(va, chunk)); CHECK(cuMemUnmap(va + chunk, chunk)); CHECK(cuMemRelease(h));
    }
    for (int k = 0; k < 7; k++)
        printf("%-28s %10.1f %10.1f %16s\n", names[k], took[0][k], took[1][k], running[k] ? "yes" : "NO");
    CHECK(cuMemCreate(&c, chunk, &prop, 0));

    // Repeated: one chunk's map, set-access and unmap, 20 times in each state: right after a
    // launch (the kernel just queued), with a kernel running for a while, and idle; medians.
    {
        auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
        printf("\n%-26s %10s %10s %10s\n", "median of 20, us", "map", "access", "unmap");
        const char* states[3] = {"just after a launch", "kernel running 5 ms", "idle"};
        for (int state = 0; state < 3; state++) {
            std::vector<double> tm, ta, tu;
            CUmemGenericAllocationHandle h; CHECK(cuMemCreate(&h, chunk, &prop, 0));
            for (int i = 0; i < 20; i++) {
                if (state < 2) { spin<<<1, 1, 0, s>>>(cycles); cudaEventRecord(done, s); }
                if (state == 1) { double w = now_us(); while (now_us() - w < 5000) {} }
                double t0 = now_us(); CHECK(cuMemMap(va + 8 * chunk, chunk, 0, h, 0));
                double t1 = now_us(); CHECK(cuMemSetAccess(va + 8 * chunk, chunk, &access, 1));
                double t2 = now_us(); CHECK(cuMemUnmap(va + 8 * chunk, chunk));
                double t3 = now_us();
                tm.push_back(t1 - t0); ta.push_back(t2 - t1); tu.push_back(t3 - t2);
                cudaEventSynchronize(done);
            }
            CHECK(cuMemRelease(h));
            printf("%-26s %10.1f %10.1f %10.1f\n", states[state], median(tm), median(ta), median(tu));
        }
    }

    // Several chunks side by side: one set-access and one unmap call over the run, against
    // one call per chunk, with the device busy and idle. Is the busy device's extra cost
    // per call or per mapping?
    printf("\n%-10s %-6s %14s %14s %14s %14s\n", "chunks", "device", "access/call", "access/chunk",
           "unmap/call", "unmap/chunk");
    for (int k : {1, 4, 16}) {
        CUmemGenericAllocationHandle hs[16];
        CUdeviceptr base = va + 16 * chunk;
        for (int idle = 0; idle < 2; idle++) {
            double t[4];
            for (int per_chunk = 0; per_chunk < 2; per_chunk++) {
                for (int i = 0; i < k; i++) {
                    CHECK(cuMemCreate(&hs[i], page, &prop, 0));
                    CHECK(cuMemMap(base + i * page, page, 0, hs[i], 0));
                }
                if (!idle) { spin<<<1, 1, 0, s>>>(cycles); cudaEventRecord(done, s); }
                double t0 = now_us();
                if (per_chunk) for (int i = 0; i < k; i++) CHECK(cuMemSetAccess(base + i * page, page, &access, 1));
                else CHECK(cuMemSetAccess(base, k * page, &access, 1));
                t[per_chunk * 2] = now_us() - t0;
                t0 = now_us();
                if (per_chunk) for (int i = 0; i < k; i++) CHECK(cuMemUnmap(base + i * page, page));
                else CHECK(cuMemUnmap(base, k * page));
                t[per_chunk * 2 + 1] = now_us() - t0;
                cudaEventSynchronize(done);
                for (int i = 0; i < k; i++) CHECK(cuMemRelease(hs[i]));
            }
            printf("%-10d %-6s %14.1f %14.1f %14.1f %14.1f\n", k, idle ? "idle" : "busy", t[0], t[2], t[1], t[3]);
        }
    }
    printf("(access/call, unmap/call: one call over the k chunks; /chunk: k calls, total us)\n\n");

    // Aliasing: a kernel writes through va0, another reads through va1.
    size_t n = chunk / sizeof(unsigned);
    unsigned long long* out; cudaMalloc(&out, sizeof(*out));
    cudaMemsetAsync(out, 0, sizeof(*out), s);
    fill<<<256, 256, 0, s>>>((unsigned*)va, 3u, n);
    sum<<<256, 256, 0, s>>>((const unsigned*)(va + chunk), n, out);
    unsigned long long got = 0;
    cudaStreamSynchronize(s);
    cudaMemcpy(&got, out, sizeof(got), cudaMemcpyDeviceToHost);
    cudaError_t alias_err = cudaGetLastError();
    bool alias_ok = got == 3ull * n && alias_err == cudaSuccess;
    printf("one handle at two addresses: a write through one is read through the other: %s"
           " (sum %llu, want %llu; %s)\n",
           alias_ok ? "yes" : "NO", got, 3ull * n, cudaGetErrorString(alias_err));

    // Pointer queries (libraries such as cuDNN ask them of the tensors they are given) on
    // an address whose handle is mapped at a second address too.
    {
        cudaPointerAttributes attr;
        cudaError_t q0 = cudaPointerGetAttributes(&attr, (void*)va);
        cudaError_t q1 = cudaPointerGetAttributes(&attr, (void*)(va + chunk + 4096));
        CUdeviceptr start = 0; size_t len = 0;
        CUresult r = cuMemGetAddressRange(&start, &len, va + chunk + 4096);
        unsigned mapped = 0;
        CUresult m = cuPointerGetAttribute(&mapped, CU_POINTER_ATTRIBUTE_MAPPED, va + chunk);
        printf("pointer queries on an aliased handle: %s %s, range %d (%zu MiB), mapped %d (%u)\n",
               cudaGetErrorString(q0), cudaGetErrorString(q1), (int)r, len >> 20, (int)m, mapped);
    }

    // The move without a wait: a kernel keeps writing through va0 (the old address) while
    // the chunk is mapped at va2 and used there on the same stream; va0 is unmapped once
    // that kernel is done.
    spin<<<1, 1, 0, s>>>(cycles);
    fill<<<256, 256, 0, s>>>((unsigned*)va, 5u, n);
    cudaEventRecord(done, s);
    double t0 = now_us();
    CHECK(cuMemMap(va + 2 * chunk, chunk, 0, a, 0));
    CHECK(cuMemSetAccess(va + 2 * chunk, chunk, &access, 1));
    double mapped = now_us() - t0;
    bool still = cudaEventQuery(done) == cudaErrorNotReady;
    cudaMemsetAsync(out, 0, sizeof(*out), s);
    fill<<<256, 256, 0, s>>>((unsigned*)(va + 2 * chunk), 7u, n);
    sum<<<256, 256, 0, s>>>((const unsigned*)(va + 2 * chunk), n, out);
    cudaEventSynchronize(done);
    CHECK(cuMemUnmap(va, chunk));
    CHECK(cuMemUnmap(va + chunk, chunk));
    cudaStreamSynchronize(s);
    cudaMemcpy(&got, out, sizeof(got), cudaMemcpyDeviceToHost);
    bool move_ok = got == 7ull * n && cudaGetLastError() == cudaSuccess;
    printf("move without a wait: mapped at the new address in %.1f us with the old user running (%s); "
           "the new user on the same stream read its own writes: %s\n",
           mapped, still ? "yes" : "NO", move_ok ? "yes" : "NO");
    CHECK(cuMemUnmap(va + 2 * chunk, chunk));
    CHECK(cuMemRelease(a));
    CHECK(cuMemRelease(c));
    CHECK(cuMemAddressFree(va, 64 * chunk));
    printf("%s\n", bad == 0 && alias_ok && move_ok ? "vmm_busy: ok" : "vmm_busy: FAILED");
    return bad == 0 && alias_ok && move_ok ? 0 : 1;
}
