// Whether one physical handle may be mapped at several address ranges at once, in the
// patterns that moving memory within a stream without a host wait needs (map it at its new
// place while the old mapping stays until the device is past it; docs/paging.md, What was
// tried, session 30): up to 128 ranges of one reservation, two reservations, a handle
// mapped, moved and taken back, adjacent ranges, handles of 1-256 pages, GPUDirect RDMA
// capable handles, the sequence a live failure showed, a second mapping made while a
// kernel writes through the first, and what an unmap costs with the device busy.
//   nvcc -O2 -o /tmp/vmm_alias benches/gpu/vmm_alias.cu -lcuda && /tmp/vmm_alias
#include "vmm_common.h"
#include <cuda_runtime.h>
#include <cstdio>

__global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}

__global__ void write_for(unsigned* p, size_t n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles)
        for (size_t i = threadIdx.x; i < n; i += blockDim.x) p[i] += 1;
}

static const char* err(CUresult r) {
    const char* s = "?";
    cuGetErrorString(r, &s);
    return r == CUDA_SUCCESS ? "ok" : s;
}

/* The sequence of a failure seen live (unet, session 30): a 3-page handle mapped at E, then
 * at D (E kept), E unmapped; another 3-page handle at C, then unmapped; the first then mapped
 * at C (D kept); then 8 more mappings of it. Offsets within a 1 GiB-aligned reservation as
 * they were live. Returns 1 if a setup call failed. */
static int live_failure_sequence(const Vmm& v, const CUmemAllocationProp& p, const char* label) {
    CUdeviceptr g;
    CHECK(cuMemAddressReserve(&g, 1ull << 31, 1ull << 30, 0, 0));
    const size_t len = 3 * v.page;
    CUdeviceptr E = g + 0x1ae00000, D = g + 0x1a800000, C = g + 0x19c00000;
    CUmemGenericAllocationHandle hh, h2;
    CHECK(cuMemCreate(&hh, len, &p, 0));
    CHECK(cuMemCreate(&h2, len, &p, 0));
    printf("%s, the live failure's sequence: E %s", label, err(cuMemMap(E, len, 0, hh, 0)));
    printf(" (access %s)", err(cuMemSetAccess(E, len, &v.access, 1)));
    printf(", D %s", err(cuMemMap(D, len, 0, hh, 0)));
    printf(" (access %s)", err(cuMemSetAccess(D, len, &v.access, 1)));
    printf(", unmap E %s", err(cuMemUnmap(E, len)));
    printf(", other at C %s", err(cuMemMap(C, len, 0, h2, 0)));
    printf(" (access %s)", err(cuMemSetAccess(C, len, &v.access, 1)));
    printf(", unmap other %s", err(cuMemUnmap(C, len)));
    CUresult mc = cuMemMap(C, len, 0, hh, 0);
    printf(", first at C %s", err(mc));
    int more = 0;
    for (int k = 0; k < 8; k++) {
        CUresult r = cuMemMap(g + 0x40000000 + k * 0x1000000, len, 0, hh, 0);
        if (r != CUDA_SUCCESS) { printf(", mapping %d more: %s", k + 1, err(r)); break; }
        more++;
    }
    printf(", %d more mappings\n", more);
    for (int k = 0; k < more; k++) cuMemUnmap(g + 0x40000000 + k * 0x1000000, len);
    if (mc == CUDA_SUCCESS) cuMemUnmap(C, len);
    cuMemUnmap(D, len);
    cuMemRelease(hh);
    cuMemRelease(h2);
    cuMemAddressFree(g, 1ull << 31);
    return 0;
}

int main() {
    Vmm v;
    if (vmm_open(v)) return 1;
    const auto& [dev, prop, page, access] = v;
    const size_t chunk = 4 * page;
    CUdeviceptr r1, r2;
    CHECK(cuMemAddressReserve(&r1, 512 * chunk, 0, 0, 0));
    CHECK(cuMemAddressReserve(&r2, 256 * chunk, 0, 0, 0));

    // 1. One handle at up to 128 ranges of one reservation: the first refusal.
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, chunk, &prop, 0));
    int mapped = 0;
    for (int k = 0; k < 128; k++) {
        CUresult r = cuMemMap(r1 + 2 * k * chunk, chunk, 0, h, 0);
        CUresult a = r == CUDA_SUCCESS ? cuMemSetAccess(r1 + 2 * k * chunk, chunk, &access, 1) : r;
        if (r != CUDA_SUCCESS || a != CUDA_SUCCESS) {
            printf("same reservation, mapping %d: map %s, access %s\n", k + 1, err(r), err(a));
            break;
        }
        mapped = k + 1;
    }
    printf("one handle mapped at %d ranges of one reservation\n", mapped);
    for (int k = 0; k < mapped; k++) CHECK(cuMemUnmap(r1 + 2 * k * chunk, chunk));

    // 2. Across two reservations.
    CUresult m1 = cuMemMap(r1, chunk, 0, h, 0), m2 = cuMemMap(r2, chunk, 0, h, 0);
    CUresult m3 = cuMemMap(r2 + 2 * chunk, chunk, 0, h, 0);
    printf("two reservations: first %s, second %s, third mapping %s\n", err(m1), err(m2), err(m3));
    if (m1 == CUDA_SUCCESS) cuMemUnmap(r1, chunk);
    if (m2 == CUDA_SUCCESS) cuMemUnmap(r2, chunk);
    if (m3 == CUDA_SUCCESS) cuMemUnmap(r2 + 2 * chunk, chunk);

    // 3. The allocator's sequence: at A; moved to B (A stays); taken back to A (B stays);
    //    moved to C (A and B stay); then the ranges unmapped one by one and mapped again.
    CUdeviceptr A = r1 + 20 * chunk, B = r1 + 40 * chunk, C = r1 + 60 * chunk;
    printf("sequence: A %s", err(cuMemMap(A, chunk, 0, h, 0)));
    printf(", B %s", err(cuMemMap(B, chunk, 0, h, 0)));
    printf(", C %s", err(cuMemMap(C, chunk, 0, h, 0)));
    printf(", unmap A %s", err(cuMemUnmap(A, chunk)));
    printf(", map A %s", err(cuMemMap(A, chunk, 0, h, 0)));
    printf(", unmap B %s, unmap C %s, unmap A %s\n", err(cuMemUnmap(B, chunk)), err(cuMemUnmap(C, chunk)),
           err(cuMemUnmap(A, chunk)));

    // 4a. One handle at two adjacent ranges (its second mapping right after, or right
    //     before, its first).
    {
        CUdeviceptr X = r1 + 300 * chunk;
        CUresult x0 = cuMemMap(X, chunk, 0, h, 0);
        CUresult after = cuMemMap(X + chunk, chunk, 0, h, 0);
        CUresult before = cuMemMap(X - chunk, chunk, 0, h, 0);
        CUresult acc = cuMemSetAccess(X - chunk, 3 * chunk, &access, 1);
        printf("adjacent: first %s, right after %s, right before %s, access over the three %s\n",
               err(x0), err(after), err(before), err(acc));
        for (CUdeviceptr y : {X - chunk, X, X + chunk}) cuMemUnmap(y, chunk);
    }

    // 4b. Handles of 1 to 256 pages, each mapped at two ranges of one large reservation.
    {
        CUdeviceptr big;
        CHECK(cuMemAddressReserve(&big, 2048 * page, 0, 0, 0));
        for (size_t pages : {1, 4, 16, 32, 64, 128, 256}) {
            CUmemGenericAllocationHandle g;
            CUresult c = cuMemCreate(&g, pages * page, &prop, 0);
            if (c != CUDA_SUCCESS) { printf("%zu pages: create %s\n", pages, err(c)); continue; }
            CUresult a1 = cuMemMap(big, pages * page, 0, g, 0);
            CUresult a2 = cuMemMap(big + 1024 * page, pages * page, 0, g, 0);
            CUresult ac = a2 == CUDA_SUCCESS ? cuMemSetAccess(big + 1024 * page, pages * page, &access, 1) : a2;
            printf("%zu pages: first %s, second %s, access %s\n", pages, err(a1), err(a2), err(ac));
            if (a1 == CUDA_SUCCESS) cuMemUnmap(big, pages * page);
            if (a2 == CUDA_SUCCESS) cuMemUnmap(big + 1024 * page, pages * page);
            cuMemRelease(g);
        }
        cuMemAddressFree(big, 2048 * page);
    }

    // 4c. A failure seen live (unet, session 30), with plain handles and with GPUDirect RDMA
    //     capable ones (as ccalloc creates them where the device supports it).
    if (live_failure_sequence(v, prop, "plain")) return 1;
    {
        int rdma = 0;
        cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
        CUmemAllocationProp rp = prop;
        rp.allocFlags.gpuDirectRDMACapable = 1;
        printf("(RDMA with VMM supported: %d) ", rdma);
        if (live_failure_sequence(v, rp, "RDMA-capable")) return 1;
    }

    // 4. Many handles each mapped twice, side by side (a move of a run of chunks).
    const int n = 32;
    CUmemGenericAllocationHandle hs[n];
    int fails = 0;
    for (int i = 0; i < n; i++) {
        CHECK(cuMemCreate(&hs[i], chunk, &prop, 0));
        if (cuMemMap(r1 + 100 * chunk + i * chunk, chunk, 0, hs[i], 0) != CUDA_SUCCESS) fails++;
    }
    CUresult ga = cuMemSetAccess(r1 + 100 * chunk, n * chunk, &access, 1);
    for (int i = 0; i < n; i++)
        if (cuMemMap(r1 + 140 * chunk + i * chunk, chunk, 0, hs[i], 0) != CUDA_SUCCESS) fails++;
    CUresult gb = cuMemSetAccess(r1 + 140 * chunk, n * chunk, &access, 1);
    printf("%d handles mapped twice side by side: %d failed maps, access %s / %s\n", n, fails,
           err(ga), err(gb));

    // 5. An unmap of the first run while a 50 ms kernel runs (it touches neither run): does
    //    the unmap wait for the device?
    int clock_khz = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaEvent_t done;
    cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    spin<<<1, 1, 0, s>>>((long long)(50.0 * clock_khz));
    cudaEventRecord(done, s);
    double t0 = now_us();
    CUresult u = cuMemUnmap(r1 + 100 * chunk, n * chunk);
    double t1 = now_us();
    bool running = cudaEventQuery(done) == cudaErrorNotReady;
    printf("unmap of %d mappings with a 50 ms kernel running: %s, %.0f us, kernel still running: %s\n",
           n, err(u), t1 - t0, running ? "yes" : "NO");
    cudaEventSynchronize(done);
    for (int i = 0; i < n; i++) {
        cuMemUnmap(r1 + 140 * chunk + i * chunk, chunk);
        cuMemRelease(hs[i]);
    }
    // 6. The move itself: a kernel writes through A for 50 ms; meanwhile the same memory is
    //    mapped at B and granted, and a second handle mapped and unmapped next to it.
    CUmemGenericAllocationHandle h3;
    CHECK(cuMemCreate(&h3, chunk, &prop, 0));
    CHECK(cuMemMap(A, chunk, 0, h, 0));
    CHECK(cuMemSetAccess(A, chunk, &access, 1));
    write_for<<<1, 32, 0, s>>>((unsigned*)A, chunk / 4, (long long)(50.0 * clock_khz));
    cudaEventRecord(done, s);
    CUresult mb = cuMemMap(B, chunk, 0, h, 0);
    CUresult ab = mb == CUDA_SUCCESS ? cuMemSetAccess(B, chunk, &access, 1) : mb;
    CUresult mc = cuMemMap(B + chunk, chunk, 0, h3, 0);
    CUresult ac = mc == CUDA_SUCCESS ? cuMemSetAccess(B + chunk, chunk, &access, 1) : mc;
    CUresult uc = mc == CUDA_SUCCESS ? cuMemUnmap(B + chunk, chunk) : mc;
    running = cudaEventQuery(done) == cudaErrorNotReady;
    printf("while a kernel writes through A: map at B %s, access %s; a neighbour mapped %s, "
           "access %s, unmapped %s; kernel still running: %s\n",
           err(mb), err(ab), err(mc), err(ac), err(uc), running ? "yes" : "NO");
    cudaError_t ke = cudaEventSynchronize(done);
    printf("kernel: %s\n", cudaGetErrorString(ke));
    if (mb == CUDA_SUCCESS) cuMemUnmap(B, chunk);
    cuMemUnmap(A, chunk);
    cuMemRelease(h3);
    CHECK(cuMemRelease(h));
    printf("done\n");
    return 0;
}
