// The one piece of C++ in ccalloc: PyTorch's CUDA-graph pool hooks hand over a
// std::function<bool(cudaStream_t)> by value, which only C++ can copy, call and destroy.
// Rust keeps an opaque pointer to a heap copy and calls back through these three functions.
#include <functional>
#include <stdexcept>
#include <string>

struct CUstream_st;
using StreamFilter = std::function<bool(CUstream_st*)>;

extern "C" {

// Copies the caller's filter (PyTorch passes it by value: a pointer to its temporary).
void* ccalloc_shim_filter_clone(const void* filter) {
  return new StreamFilter(*static_cast<const StreamFilter*>(filter));
}

bool ccalloc_shim_filter_call(void* filter, CUstream_st* stream) {
  try {
    return (*static_cast<StreamFilter*>(filter))(stream);
  } catch (...) {
    return false;  // No exception may unwind into Rust.
  }
}

void ccalloc_shim_filter_drop(void* filter) { delete static_cast<StreamFilter*>(filter); }

// PyTorch's pluggable allocator does not check for NULL: a failed allocation must throw, as
// its own allocator does, or a tensor without memory would be created. PyTorch turns this
// into a Python RuntimeError carrying the message.
[[noreturn]] void ccalloc_shim_throw(const char* message) { throw std::runtime_error(std::string(message)); }

}  // extern "C"
