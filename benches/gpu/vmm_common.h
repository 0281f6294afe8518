// Shared by vmm_cost.cu and vmm_busy.cu: the driver error check, a host clock, and device 0's
// pinned memory properties, page size and read/write access.
#pragma once
#include <cuda.h>
#include <chrono>
#include <cstdio>

// Returns 1 from the calling function when a driver call fails, naming it.
#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s_; cuGetErrorString(r_, &s_); \
    printf("%s failed: %s\n", #x, s_); return 1; } } while (0)

static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Vmm {
    CUdevice dev = 0;
    CUmemAllocationProp prop = {};
    size_t page = 0;
    CUmemAccessDesc access = {};
};

// Starts the driver on device 0 with its primary context current and fills `v`; 0 on success.
static int vmm_open(Vmm& v) {
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&v.dev, 0));
    CUcontext ctx;
    CHECK(cuDevicePrimaryCtxRetain(&ctx, v.dev));
    CHECK(cuCtxSetCurrent(ctx));
    v.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    v.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    v.prop.location.id = v.dev;
    CHECK(cuMemGetAllocationGranularity(&v.page, &v.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    v.access.location = v.prop.location;
    v.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return 0;
}
