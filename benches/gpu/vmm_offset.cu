// Whether part of a physical handle can be mapped on its own (cuMemMap with an offset), also
// while the whole handle stays mapped elsewhere, and what it costs. A chunk that one live
// block keeps mapped holds free pages nothing else can use (docs/paging.md, "pinned pages");
// if those pages can be mapped a second time where growth needs memory, growth could reuse
// them instead of creating more, as long as the allocator never places a block on them at
// their first address.
//   nvcc -O2 -o /tmp/vmm_offset benches/gpu/vmm_offset.cu -lcuda && /tmp/vmm_offset
#include "vmm_common.h"
#include <cuda_runtime.h>
#include <algorithm>
#include <vector>

__global__ void fill_pages(unsigned* p, size_t words_per_page, unsigned first, size_t n) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = first + (unsigned)(i / words_per_page);
}

__global__ void fill(unsigned* p, unsigned v, size_t n) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}

// Counts the words of `p[0..n)` that are not `first + i / words_per_page`.
__global__ void check_pages(const unsigned* p, size_t words_per_page, unsigned first, size_t n,
                            unsigned long long* bad) {
    unsigned long long b = 0;
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        b += p[i] != first + (unsigned)(i / words_per_page);
    if (b) atomicAdd(bad, b);
}

static unsigned long long g_bad_host;

// Bad words in `pages` pages of `page` bytes at `va`, expected to hold page numbers from
// `first`.
static unsigned long long bad_words(CUdeviceptr va, size_t page, size_t pages, unsigned first,
                                    unsigned long long* bad) {
    cudaMemset(bad, 0, sizeof(*bad));
    check_pages<<<256, 256>>>((const unsigned*)va, page / 4, first, pages * page / 4, bad);
    cudaDeviceSynchronize();
    cudaMemcpy(&g_bad_host, bad, sizeof(g_bad_host), cudaMemcpyDeviceToHost);
    return cudaGetLastError() == cudaSuccess ? g_bad_host : ~0ull;
}

static size_t free_bytes() {
    size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    return f;
}

int main() {
    Vmm v;
    if (vmm_open(v)) return 1;
    const auto& [dev, prop, page, access] = v;
    const size_t pages = 16;
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, 256 * page, 0, 0, 0));
    unsigned long long* bad;
    cudaMalloc(&bad, sizeof(*bad));
    int failed = 0;
    auto report = [&](const char* what, bool ok) {
        printf("%-72s %s\n", what, ok ? "yes" : "NO");
        failed += !ok;
    };

    // A chunk of 16 pages mapped whole at va0, each page holding its number. (The kernels
    // run once first: loading them takes device memory too.)
    fill<<<1, 1>>>((unsigned*)bad, 0, 2);
    bad_words((CUdeviceptr)bad, 8, 1, 0, bad);
    size_t before = free_bytes();
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, pages * page, &prop, 0));
    CUdeviceptr va0 = va, va1 = va + 64 * page, va2 = va + 128 * page;
    CHECK(cuMemMap(va0, pages * page, 0, h, 0));
    CHECK(cuMemSetAccess(va0, pages * page, &access, 1));
    fill_pages<<<256, 256>>>((unsigned*)va0, page / 4, 0, pages * page / 4);
    cudaDeviceSynchronize();
    size_t after_create = free_bytes();

    // Pages 5..12 of it mapped again at va1, with an offset.
    double t0 = now_us();
    CUresult r = cuMemMap(va1, 8 * page, 5 * page, h, 0);
    double t_map = now_us() - t0;
    printf("cuMemMap of pages 5..12 of a 16-page handle, the handle mapped whole elsewhere: %s (%.1f us)\n",
           r == CUDA_SUCCESS ? "accepted" : "refused", t_map);
    if (r != CUDA_SUCCESS) {
        const char* e;
        cuGetErrorString(r, &e);
        printf("  %s\nvmm_offset: offset maps NOT supported\n", e);
        return 1;
    }
    t0 = now_us();
    CHECK(cuMemSetAccess(va1, 8 * page, &access, 1));
    double t_access = now_us() - t0;
    printf("  its access grant: %.1f us\n", t_access);
    report("the second address reads the handle's pages 5..12", bad_words(va1, page, 8, 5, bad) == 0);
    report("no physical memory was added by the second mapping",
           free_bytes() == after_create && before - after_create >= pages * page);

    // Writes through the second address show at the first, and the pages around them keep
    // what they held.
    fill<<<256, 256>>>((unsigned*)va1, 1000u, 8 * page / 4);
    cudaDeviceSynchronize();
    // A flat fill is a "page number" fill whose pages are all one page long.
    report("writes through it are read through the first address (pages 5..12)",
           bad_words(va0 + 5 * page, 8 * page, 1, 1000, bad) == 0);
    report("pages 0..4 and 13..15 at the first address are untouched",
           bad_words(va0, page, 5, 0, bad) == 0 && bad_words(va0 + 13 * page, page, 3, 13, bad) == 0);

    // The first mapping goes, then the handle is released: the second mapping still works,
    // and the memory is given back only when it goes too.
    CHECK(cuMemUnmap(va0, pages * page));
    report("after the whole handle's mapping is unmapped, the part still reads",
           bad_words(va1, 8 * page, 1, 1000, bad) == 0);
    CHECK(cuMemRelease(h));
    report("released while a part stays mapped: the memory is still held", free_bytes() == after_create);
    CHECK(cuMemUnmap(va1, 8 * page));
    report("the last mapping unmapped: the memory is given back", free_bytes() == before);

    // Cost: map+grant+unmap of a 4-page part of a mapped 32-page handle, against the same
    // for a 4-page handle of its own; medians of 20, idle device.
    {
        auto median = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
        CUmemGenericAllocationHandle big, own;
        CHECK(cuMemCreate(&big, 32 * page, &prop, 0));
        CHECK(cuMemCreate(&own, 4 * page, &prop, 0));
        CHECK(cuMemMap(va0, 32 * page, 0, big, 0));
        CHECK(cuMemSetAccess(va0, 32 * page, &access, 1));
        std::vector<double> m[2], a[2], u[2];
        for (int i = 0; i < 20; i++) {
            for (int k = 0; k < 2; k++) {
                double t = now_us();
                if (k == 0) CHECK(cuMemMap(va2, 4 * page, 20 * page, big, 0));
                else CHECK(cuMemMap(va2, 4 * page, 0, own, 0));
                double t1 = now_us();
                CHECK(cuMemSetAccess(va2, 4 * page, &access, 1));
                double t2 = now_us();
                CHECK(cuMemUnmap(va2, 4 * page));
                double t3 = now_us();
                m[k].push_back(t1 - t); a[k].push_back(t2 - t1); u[k].push_back(t3 - t2);
            }
        }
        printf("\n%-34s %8s %8s %8s\n", "4 pages, median of 20, us", "map", "access", "unmap");
        printf("%-34s %8.1f %8.1f %8.1f\n", "part of a mapped 32-page handle", median(m[0]), median(a[0]), median(u[0]));
        printf("%-34s %8.1f %8.1f %8.1f\n", "a 4-page handle of its own", median(m[1]), median(a[1]), median(u[1]));
        CHECK(cuMemUnmap(va0, 32 * page));
        CHECK(cuMemRelease(big));
        CHECK(cuMemRelease(own));
    }
    CHECK(cuMemAddressFree(va, 256 * page));
    printf("%s\n", failed == 0 ? "vmm_offset: ok" : "vmm_offset: FAILED");
    return failed == 0 ? 0 : 1;
}
