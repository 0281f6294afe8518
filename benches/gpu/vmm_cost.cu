// What the CUDA virtual memory calls cost on this GPU, per call, and whether one cuMemUnmap may
// cover several separately mapped pages (ccalloc moves pages one granule at a time).
//   nvcc -O2 -o /tmp/vmm_cost benches/gpu/vmm_cost.cu -lcuda && /tmp/vmm_cost
#include "vmm_common.h"
#include <chrono>
#include <cstdio>
#include <vector>


int main() {
    Vmm v;
    if (vmm_open(v)) return 1;
    const auto& [dev, prop, page, access] = v;
    const int n = 512;
    CUdeviceptr va; CHECK(cuMemAddressReserve(&va, n * page, 0, 0, 0));
    std::vector<CUmemGenericAllocationHandle> h(n);
    double t0 = now_us();
    for (int i = 0; i < n; i++) CHECK(cuMemCreate(&h[i], page, &prop, 0));
    double t_create = (now_us() - t0) / n;
    t0 = now_us();
    for (int i = 0; i < n; i++) CHECK(cuMemMap(va + i * page, page, 0, h[i], 0));
    double t_map = (now_us() - t0) / n;
    t0 = now_us();
    for (int i = 0; i < n; i++) CHECK(cuMemSetAccess(va + i * page, page, &access, 1));
    double t_access1 = (now_us() - t0) / n;
    t0 = now_us();
    for (int i = 0; i < n; i++) CHECK(cuMemUnmap(va + i * page, page));
    double t_unmap = (now_us() - t0) / n;
    // Runs of 16 pages: map each page, one set_access and one unmap per run.
    const int run = 16;
    for (int i = 0; i < n; i++) CHECK(cuMemMap(va + i * page, page, 0, h[i], 0));
    t0 = now_us();
    for (int i = 0; i < n; i += run) CHECK(cuMemSetAccess(va + i * page, run * page, &access, 1));
    double t_access16 = (now_us() - t0) / (n / run);
    t0 = now_us();
    CUresult multi = CUDA_SUCCESS;
    for (int i = 0; i < n && multi == CUDA_SUCCESS; i += run) multi = cuMemUnmap(va + i * page, run * page);
    double t_unmap16 = (now_us() - t0) / (n / run);
    const char* multi_s; cuGetErrorString(multi, &multi_s);
    if (multi != CUDA_SUCCESS) for (int i = 0; i < n; i++) cuMemUnmap(va + i * page, page);
    t0 = now_us();
    for (int i = 0; i < n; i++) CHECK(cuMemRelease(h[i]));
    double t_release = (now_us() - t0) / n;
    CHECK(cuMemAddressFree(va, n * page));
    // One handle of k pages, mapped and granted in one call each: is the cost per call or per page?
    for (int k = 1; k <= 64; k *= 4) {
        const int reps = 8;
        size_t bytes = (size_t)k * page;
        CUdeviceptr kva; CHECK(cuMemAddressReserve(&kva, bytes, 0, 0, 0));
        double c = 0, m = 0, a = 0, u = 0, r = 0;
        for (int rep = 0; rep < reps; rep++) {
            CUmemGenericAllocationHandle kh;
            double s = now_us(); CHECK(cuMemCreate(&kh, bytes, &prop, 0)); c += now_us() - s;
            s = now_us(); CHECK(cuMemMap(kva, bytes, 0, kh, 0)); m += now_us() - s;
            s = now_us(); CHECK(cuMemSetAccess(kva, bytes, &access, 1)); a += now_us() - s;
            s = now_us(); CHECK(cuMemUnmap(kva, bytes)); u += now_us() - s;
            s = now_us(); CHECK(cuMemRelease(kh)); r += now_us() - s;
        }
        CHECK(cuMemAddressFree(kva, bytes));
        printf("VMM_HANDLE {\"pages\": %d, \"create_us\": %.2f, \"map_us\": %.2f, \"set_access_us\": %.2f, "
               "\"unmap_us\": %.2f, \"release_us\": %.2f}\n", k, c / reps, m / reps, a / reps, u / reps, r / reps);
    }
    // Fences: an event recorded on a stream at a free, queried later.
    CUstream stream; CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    std::vector<CUevent> ev(n);
    for (int i = 0; i < n; i++) CHECK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
    t0 = now_us();
    for (int i = 0; i < n; i++) CHECK(cuEventRecord(ev[i], stream));
    double t_record = (now_us() - t0) / n;
    t0 = now_us();
    for (int i = 0; i < n; i++) cuEventQuery(ev[i]);
    double t_query = (now_us() - t0) / n;
    CHECK(cuStreamSynchronize(stream));
    for (int i = 0; i < n; i++) CHECK(cuEventDestroy(ev[i]));
    CHECK(cuStreamDestroy(stream));
    printf("VMM_COST {\"page\": %zu, \"create_us\": %.2f, \"map_us\": %.2f, \"set_access_1page_us\": %.2f, "
           "\"unmap_us\": %.2f, \"set_access_16pages_us\": %.2f, \"unmap_16pages_one_call_us\": %.2f, "
           "\"unmap_16pages_one_call\": \"%s\", \"release_us\": %.2f, \"event_record_us\": %.2f, "
           "\"event_query_us\": %.2f}\n",
           page, t_create, t_map, t_access1, t_unmap, t_access16, t_unmap16, multi_s, t_release, t_record, t_query);
    // Does access granted on a range survive an unmap and a remap of another handle there?
    {
        CUdeviceptr rva; CHECK(cuMemAddressReserve(&rva, page, 0, 0, 0));
        CUmemGenericAllocationHandle h1, h2;
        CHECK(cuMemCreate(&h1, page, &prop, 0)); CHECK(cuMemCreate(&h2, page, &prop, 0));
        CHECK(cuMemMap(rva, page, 0, h1, 0)); CHECK(cuMemSetAccess(rva, page, &access, 1));
        CHECK(cuMemsetD8(rva, 1, page)); CHECK(cuCtxSynchronize());
        CHECK(cuMemUnmap(rva, page)); CHECK(cuMemMap(rva, page, 0, h2, 0));
        CUresult w = cuMemsetD8(rva, 2, page);
        CUresult ws = cuCtxSynchronize();
        const char* w_s; cuGetErrorString(w, &w_s);
        const char* ws_s; cuGetErrorString(ws, &ws_s);
        printf("VMM_REMAP_ACCESS {\"memset_after_remap\": \"%s\", \"sync\": \"%s\"}\n", w_s, ws_s);
        if (ws != CUDA_SUCCESS) return 0;  // the context is gone after a fault
        cuMemUnmap(rva, page); cuMemRelease(h1); cuMemRelease(h2); cuMemAddressFree(rva, page);
    }
    return 0;
}
