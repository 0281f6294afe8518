/* A near-zero-cost pluggable allocator for PyTorch, used only to measure what PyTorch's own
 * CUDAPluggableAllocator wrapper and tensor creation cost (benches/gpu/torch_empty.py): it
 * keeps every block it ever got from cudaMalloc and hands a free one of the same size back,
 * found by a short linear scan. Not thread-safe, no streams: a single-threaded loop only. */
#include <cuda_runtime.h>
#include <stddef.h>
#include <sys/types.h>

#define SLOTS 256

static struct slot {
    ssize_t size;
    void *ptr;
    int in_use;
} slots[SLOTS];
static int used;

void *null_alloc(ssize_t size, int device, cudaStream_t stream) {
    (void)device;
    (void)stream;
    for (int i = 0; i < used; i++) {
        if (!slots[i].in_use && slots[i].size == size) {
            slots[i].in_use = 1;
            return slots[i].ptr;
        }
    }
    if (used == SLOTS) return NULL;
    void *p = NULL;
    if (cudaMalloc(&p, size > 0 ? (size_t)size : 1) != cudaSuccess) return NULL;
    slots[used] = (struct slot){size, p, 1};
    used++;
    return p;
}

void null_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
    (void)size;
    (void)device;
    (void)stream;
    for (int i = 0; i < used; i++) {
        if (slots[i].ptr == ptr) {
            slots[i].in_use = 0;
            return;
        }
    }
}
