// Calls ccalloc's PyTorch hooks through the exact C++ function types PyTorch's
// CUDAPluggableAllocator uses, on the sim backend: proves the MempoolId_t / std::function
// calling convention of the graph-pool hooks, and the pool semantics behind them.
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>

#include "ccalloc.h"

using MempoolId_t = std::pair<unsigned long long, unsigned long long>;
using BeginFn = void (*)(int, MempoolId_t, std::function<bool(cudaStream_t)>);
using PoolFn = void (*)(int, MempoolId_t);

static int passed = 0, failed = 0;
#define CHECK(cond, what)                                  \
  do {                                                     \
    if (cond) {                                            \
      ++passed;                                            \
      std::printf("ok   %s\n", what);                      \
    } else {                                               \
      ++failed;                                            \
      std::printf("FAIL %s (line %d)\n", what, __LINE__); \
    }                                                      \
  } while (0)

template <typename T>
static T as_hook(void* symbol) {
  // PyTorch receives the address as an integer and casts it to the hook's type.
  return reinterpret_cast<T>(reinterpret_cast<uintptr_t>(symbol));
}

int main() {
  std::function<void(int, MempoolId_t, std::function<bool(cudaStream_t)>)> begin =
      as_hook<BeginFn>(reinterpret_cast<void*>(&ccalloc_torch_begin_allocate_to_pool));
  std::function<void(int, MempoolId_t)> end =
      as_hook<PoolFn>(reinterpret_cast<void*>(&ccalloc_torch_end_allocate_to_pool));
  std::function<void(int, MempoolId_t)> release =
      as_hook<PoolFn>(reinterpret_cast<void*>(&ccalloc_torch_release_pool));

  ccalloc_torch_init(1);
  auto capture = reinterpret_cast<cudaStream_t>(0x1234);
  auto other = reinterpret_cast<cudaStream_t>(0x5678);

  void* general = ccalloc_torch_alloc(4096, 0, capture);
  ccalloc_torch_free(general, 4096, 0, capture);

  auto witness = std::make_shared<int>(0);
  int filter_calls = 0;
  begin(0, MempoolId_t{7, 9}, [witness, &filter_calls, capture](cudaStream_t s) {
    ++filter_calls;
    return s == capture;
  });
  CHECK(witness.use_count() == 2, "ccalloc keeps its own copy of the filter");

  void* a = ccalloc_torch_alloc(4096, 0, capture);
  void* b = ccalloc_torch_alloc(4096, 0, other);
  CHECK(filter_calls >= 2, "the filter is called per allocation");
  CHECK(a != nullptr && a != general, "capture allocations come from the private pool");
  ccalloc_torch_free(a, 4096, 0, capture);
  void* a2 = ccalloc_torch_alloc(4096, 0, capture);
  CHECK(a2 == a, "pool blocks are reused inside the pool");
  end(0, MempoolId_t{7, 9});
  CHECK(witness.use_count() == 1, "the filter copy is destroyed when the window closes");

  void* g2 = ccalloc_torch_alloc(4096, 0, capture);
  CHECK(g2 == general, "after the window, the general cache serves");

  release(0, MempoolId_t{7, 8});
  CHECK(std::strstr(ccalloc_last_error(), "(7, 8)") != nullptr, "pool ids arrive intact (bad id named)");
  release(0, MempoolId_t{7, 9});

  ccalloc_torch_free(a2, 4096, 0, capture);
  ccalloc_torch_free(b, 4096, 0, other);
  ccalloc_torch_free(g2, 4096, 0, capture);
  ccalloc_torch_empty_cache();
  ccalloc_stats stats;
  CHECK(ccalloc_get_stats(0, &stats) == CCALLOC_OK, "stats readable");
  CHECK(stats.reserved_bytes.all.current == 0, "everything returned after release + empty_cache");
  CHECK(stats.segment.all.peak == 3, "one general, one pool, one side-stream segment");

  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
