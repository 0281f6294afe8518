/* The hot-path harness's floor: a pluggable "allocator" that costs nothing. It hands out
 * fake addresses from a per-thread counter and forgets frees; the harness never touches the
 * memory it times, so `hotpath.sh`'s `floor` kind measures what the harness itself spends
 * per step (its random numbers, logs and exps, the loop, the indirect calls). An
 * allocator's own share of a figure is that figure minus the floor's. Never use it for
 * anything that reads or writes the memory. */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

static __thread uintptr_t next_addr;
static uintptr_t thread_base = 1;

void *floor_alloc(ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    if (next_addr == 0) {
        /* 1 TiB of fake address space per thread; thread starts are not timed. */
        next_addr = __atomic_fetch_add(&thread_base, 1, __ATOMIC_RELAXED) << 40;
    }
    uintptr_t p = next_addr;
    next_addr += ((size_t)size + 511) & ~(size_t)511;
    return (void *)p;
}

void floor_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)ptr;
    (void)size;
    (void)device;
    (void)stream;
}
