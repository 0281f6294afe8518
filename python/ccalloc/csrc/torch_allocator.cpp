// ccalloc as PyTorch's CUDA allocator: a complete c10::cuda::CUDACachingAllocator::CUDAAllocator
// (as PyTorch's own cudaMallocAsync backend is) that translates every call to ccalloc's C API.
// All allocation logic stays in libccalloc.so; this file only translates types and errors,
// and keeps what only PyTorch has: the stack-trace contexts of recorded history, OOM
// observers and trace trackers.
//
// Built by ccalloc.torch at the first enable() against the installed torch
// (torch.utils.cpp_extension), linked to libccalloc.so by path. libccalloc.so itself never
// depends on torch.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ccalloc.h"

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using c10::MempoolId_t;

// Numbers in error messages are formatted here, never by an ostream. Messages go through
// c10::str, and on the H100 host an integer inserted there from this file crashed the process
// (a null dereference under std::ostream::_M_insert<unsigned long>) instead of raising;
// strings alone format safely (the OOM message is one). check_torch.py's error_raises.
std::string number(unsigned long long value) {
  return std::to_string(value);
}

std::string address(const void* ptr) {
  char text[2 + 2 * sizeof(void*) + 1];
  std::snprintf(text, sizeof text, "%p", ptr);
  return text;
}

std::string last_error() {
  const char* m = ccalloc_last_error();
  return m ? std::string(m) : std::string();
}

// Raises a PyTorch error for a failed ccalloc call.
void check(ccalloc_status status, const char* call) {
  if (status != CCALLOC_OK) {
    TORCH_CHECK(false, "ccalloc: ", call, " failed (", ccalloc_status_name(status), "): ", last_error());
  }
}

void copy_stat(c10::CachingAllocator::Stat& to, const ccalloc_stat& from) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

void copy_array(c10::CachingAllocator::StatArray& to, const ccalloc_stat_array& from) {
  using c10::CachingAllocator::StatType;
  copy_stat(to[static_cast<size_t>(StatType::AGGREGATE)], from.all);
  copy_stat(to[static_cast<size_t>(StatType::SMALL_POOL)], from.small_pool);
  copy_stat(to[static_cast<size_t>(StatType::LARGE_POOL)], from.large_pool);
}

ccalloc_pool_id pool_of(MempoolId_t id) {
  return ccalloc_pool_id{id.first, id.second};
}

class CcallocAllocator;
CcallocAllocator* g_instance = nullptr;

// Every DataPtr carries this one deleter, which raw_deleter() returns too: CUDA graph trees
// recognise the allocator's storages by comparing the two.
void raw_delete_fn(void* ptr);

// What getCheckpointState saves of a private pool: its blocks, in address order per
// segment, with whether each was handed out.
struct PoolCheckpoint final : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  MempoolId_t pool{0, 0};
  struct Block {
    uint64_t address;
    uint64_t size;
    bool allocated;
  };
  std::vector<Block> blocks;
};

class CcallocAllocator final : public cca::CUDAAllocator {
 public:
  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* ptr = size == 0 ? nullptr : malloc_or_throw(size, device, stream);
    return {ptr, ptr, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &raw_delete_fn;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void* raw_alloc(size_t size) override {
    if (size == 0) {
      return nullptr;
    }
    c10::DeviceIndex device = c10::cuda::current_device();
    return malloc_or_throw(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    if (size == 0) {
      return nullptr;
    }
    return malloc_or_throw(size, c10::cuda::current_device(), stream);
  }

  void raw_delete(void* ptr) override {
    if (ptr == nullptr) {
      return;
    }
    // With one device, that one; else the current device first, almost always the
    // block's, then the others (a wrong-device answer frees nothing).
    int device = device_count() == 1 ? 0 : c10::cuda::current_device();
    if (free_on(ptr, device) == CCALLOC_OK) {
      return;
    }
    for (int d = 0; d < device_count(); ++d) {
      if (d != device && free_on(ptr, d) == CCALLOC_OK) {
        return;
      }
    }
    // A deleter cannot throw: PyTorch calls it from destructors.
    TORCH_WARN("ccalloc: freeing ", address(ptr), ": ", last_error());
  }

  void init(int device_count) override {
    check(ccalloc_init(), "init");
    device_count_.store(device_count);
    initialized_.store(true);
  }

  bool initialized() override {
    return initialized_.load();
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    double fraction = 1.0;
    check(ccalloc_get_memory_fraction(device, &fraction), "get_memory_fraction");
    return fraction;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(ccalloc_set_memory_fraction(fraction, device), "set_memory_fraction");
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }

  void emptyCache(MempoolId_t mempool_id) override {
    // A pool's cache alone cannot be emptied: every unused segment is released, which
    // includes that pool's.
    (void)mempool_id;
    check(ccalloc_empty_cache(-1), "empty_cache");
  }

  void enable(bool value) override {
    enabled_ = value;
  }

  bool isEnabled() const override {
    return enabled_;
  }

  // As the native allocator: the larger of the biggest cached block and what the device
  // could still give (within the memory fraction). cuDNN sizes its benchmark workspace by it.
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    uint64_t largest = 0;
    check(ccalloc_cache_info(device, &largest), "cache_info");
    DeviceMemory memory = device_memory(device);
    size_t available = memory.free;
    ccalloc_stats stats{};
    if (memory.limit < memory.total && ccalloc_get_stats(device, &stats) == CCALLOC_OK) {
      size_t reserved = static_cast<size_t>(stats.reserved_bytes.all.current);
      available = std::min(available, memory.limit > reserved ? memory.limit - reserved : size_t{0});
    }
    *largest_block = std::max(static_cast<size_t>(largest), available);
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    (void)ptr;
    (void)size;
    TORCH_CHECK(
        false,
        "ccalloc: sharing CUDA tensors between processes (CUDA IPC) is not supported: its "
        "memory is mapped with the driver's virtual memory API, which cudaIpcGetMemHandle "
        "cannot export. Move the tensor to the CPU, or share it with NCCL.");
  }

  using cca::CUDAAllocator::recordStream;

  void recordStream(const c10::DataPtr& data_ptr, c10::cuda::CUDAStream stream) override {
    if (!data_ptr.get() || data_ptr.get_deleter() != &raw_delete_fn) {
      return;
    }
    int device = data_ptr.device().index();
    check(ccalloc_record_stream(data_ptr.get(), device, stream.stream()), "record_stream");
  }

  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    ccalloc_stats s{};
    check(ccalloc_get_stats(device, &s), "get_stats");
    cda::DeviceStats out;
    copy_array(out.allocation, s.allocation);
    copy_array(out.segment, s.segment);
    copy_array(out.active, s.active);
    copy_array(out.inactive_split, s.inactive_split);
    copy_array(out.allocated_bytes, s.allocated_bytes);
    copy_array(out.reserved_bytes, s.reserved_bytes);
    copy_array(out.active_bytes, s.active_bytes);
    copy_array(out.inactive_split_bytes, s.inactive_split_bytes);
    copy_array(out.requested_bytes, s.requested_bytes);
    copy_stat(out.oversize_allocations, s.oversize_allocations);
    copy_stat(out.oversize_segments, s.oversize_segments);
    out.num_alloc_retries = static_cast<int64_t>(s.num_alloc_retries);
    out.num_ooms = static_cast<int64_t>(s.num_ooms);
    out.num_sync_all_streams = static_cast<int64_t>(s.num_sync_all_streams);
    out.num_device_alloc = static_cast<int64_t>(s.num_device_alloc);
    out.num_device_free = static_cast<int64_t>(s.num_device_free);
    out.max_split_size = s.max_split_size;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(ccalloc_reset_accumulated_stats(device), "reset_accumulated_stats");
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check(ccalloc_reset_peak_stats(device), "reset_peak_stats");
  }

  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    ccalloc_snapshot* snap = nullptr;
    check(ccalloc_snapshot_take(-1, include_traces, &snap), "snapshot_take");
    std::unique_ptr<ccalloc_snapshot, void (*)(ccalloc_snapshot*)> owned(snap, ccalloc_snapshot_free);
    size_t segment_count = 0, trace_count = 0;
    check(ccalloc_snapshot_counts(snap, &segment_count, &trace_count), "snapshot_counts");

    cca::SnapshotInfo result;
    std::lock_guard<std::mutex> lock(history_mutex_);
    bool all_pools = mempool_id.first == 0 && mempool_id.second == 0;
    for (size_t i = 0; i < segment_count; ++i) {
      ccalloc_segment_info s{};
      check(ccalloc_snapshot_segment(snap, i, &s), "snapshot_segment");
      if (!all_pools && (s.pool.first != mempool_id.first || s.pool.second != mempool_id.second)) {
        continue;
      }
      cda::SegmentInfo seg;
      seg.device = static_cast<c10::DeviceIndex>(s.device);
      seg.address = static_cast<size_t>(s.address);
      seg.total_size = static_cast<size_t>(s.total_size);
      seg.requested_size = static_cast<size_t>(s.requested_size);
      seg.allocated_size = static_cast<size_t>(s.allocated_size);
      seg.active_size = static_cast<size_t>(s.active_size);
      seg.stream = s.stream;
      seg.is_large = s.is_large;
      seg.is_expandable = s.is_expandable;
      seg.owner_private_pool_id = {s.pool.first, s.pool.second};
      seg.registration_counter = static_cast<int32_t>(i);
      for (size_t b = 0; b < s.block_count; ++b) {
        ccalloc_block_info blk{};
        check(ccalloc_snapshot_block(snap, i, b, &blk), "snapshot_block");
        cda::BlockInfo info;
        info.size = static_cast<size_t>(blk.size);
        info.requested_size = static_cast<size_t>(blk.requested_size);
        info.allocated = blk.state == 1;
        info.active = blk.state != 0;
        if (info.allocated) {
          auto it = block_contexts_.find(blk.address);
          if (it != block_contexts_.end()) {
            info.context_when_allocated = it->second;
          }
        }
        seg.blocks.push_back(std::move(info));
      }
      result.segments.push_back(std::move(seg));
    }

    result.device_traces.resize(std::max(device_count(), 1));
    if (include_traces) {
      for (size_t i = 0; i < trace_count; ++i) {
        ccalloc_trace_entry e{};
        check(ccalloc_snapshot_trace_entry(snap, i, &e), "snapshot_trace_entry");
        if (e.device < 0 || static_cast<size_t>(e.device) >= result.device_traces.size()) {
          continue;
        }
        std::shared_ptr<c10::GatheredContext> context;
        auto it = trace_contexts_.find(e.context);
        if (e.context != 0 && it != trace_contexts_.end()) {
          context = it->second;
        }
        cda::TraceEntry entry(
            action_of(e.action),
            static_cast<c10::DeviceIndex>(e.device),
            static_cast<size_t>(e.addr),
            static_cast<size_t>(e.size),
            e.stream,
            MempoolId_t{0, 0},
            0,
            std::move(context));
        entry.time_.t_ = static_cast<time_t>(e.time_us);
        result.device_traces[e.device].push_back(std::move(entry));
      }
    }
    result.config_metadata.garbage_collection_threshold = 0.0;
    result.config_metadata.max_split_size = 0;
    result.config_metadata.expandable_segments = true;
    result.config_metadata.last_allocator_settings = "ccalloc";
    return result;
  }

  void beginAllocateToPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    using Filter = std::function<bool(cudaStream_t)>;
    auto* ctx = new Filter(std::move(filter));
    // ccalloc owns ctx from here: it calls the release function once, also on failure.
    check(
        ccalloc_begin_allocate_to_pool(
            device,
            pool_of(mempool_id),
            [](void* c, cudaStream_t s) { return (*static_cast<Filter*>(c))(s); },
            ctx,
            [](void* c) { delete static_cast<Filter*>(c); }),
        "begin_allocate_to_pool");
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check(ccalloc_end_allocate_to_pool(device, pool_of(mempool_id)), "end_allocate_to_pool");
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check(ccalloc_release_pool(device, pool_of(mempool_id)), "release_pool");
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    uint32_t count = 0;
    check(ccalloc_pool_use_count(device, pool_of(mempool_id), &count), "pool_use_count");
    return static_cast<int>(count);
  }

  void createOrIncrefPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(
        !allocator || allocator.get() == this,
        "ccalloc: a MemPool with an allocator of its own is not supported while ccalloc is "
        "PyTorch's allocator; create the MemPool without an allocator argument.");
    check(ccalloc_create_or_incref_pool(device, pool_of(mempool_id)), "create_or_incref_pool");
  }

  // MemPool(use_on_oom=True) asks that OOMs draw on the pool; ccalloc keeps a pool's memory
  // for it alone, so only the default (off, which ~MemPool always sets) is accepted as is.
  void setUseOnOOM(c10::DeviceIndex, MempoolId_t, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "ccalloc: MemPool(use_on_oom=True) is not supported");
  }

  void setNoSplit(c10::DeviceIndex, MempoolId_t) override {
    TORCH_CHECK(false, "ccalloc: MemPool(no_split=True) is not supported");
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    cca::SnapshotInfo snap = snapshot(mempool_id, false);
    size_t live = 0;
    for (const auto& seg : snap.segments) {
      if (seg.device != device) {
        continue;
      }
      size_t addr = seg.address;
      for (const auto& b : seg.blocks) {
        if (b.allocated) {
          if (!expected_live_allocations.count(reinterpret_cast<void*>(addr))) {
            return false;
          }
          ++live;
        }
        addr += b.size;
      }
    }
    return live == expected_live_allocations.size();
  }

  cca::ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false, "ccalloc: CUDA IPC handles are not supported (see getBaseAllocation).");
  }

  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false, "ccalloc: CUDA IPC handles are not supported (see getBaseAllocation).");
  }

  bool isHistoryEnabled() override {
    return ccalloc_is_recording_history();
  }

  void recordHistory(
      bool enabled,
      cda::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      cda::RecordContext when,
      bool clear_history,
      const std::vector<std::string>& skip_actions) override {
    (void)skip_actions;
    std::lock_guard<std::mutex> lock(history_mutex_);
    size_t max_entries = std::max<size_t>(alloc_trace_max_entries, 1);
    check(ccalloc_record_history(enabled, max_entries, clear_history || !enabled), "record_history");
    context_recorder_ = enabled ? context_recorder : nullptr;
    when_ = enabled ? when : cda::RecordContext::NEVER;
    contexts_on_.store(context_recorder_ != nullptr && when_ != cda::RecordContext::NEVER);
    max_entries_ = max_entries;
    if (clear_history || !enabled) {
      trace_contexts_.clear();
      context_order_.clear();
    }
    if (!enabled) {
      block_contexts_.clear();
    }
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(cda::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    trace_trackers_.push_back(std::move(tracker));
    if (!observing_segments_) {
      check(ccalloc_add_segment_observer(&CcallocAllocator::on_segment_event, this), "add_segment_observer");
      observing_segments_ = true;
    }
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }

  cudaError_t memcpyAsync(
      void* dst,
      int dst_device,
      const void* src,
      int src_device,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    // Mapped (paged) memory needs the peer copy across devices unless peer access is on.
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

  // CUDA graph trees save a pool's state after every recording.
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId_t id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->pool = id;
    cca::SnapshotInfo snap = snapshot(id, false);
    for (const auto& seg : snap.segments) {
      if (seg.device != device) {
        continue;
      }
      uint64_t addr = seg.address;
      for (const auto& b : seg.blocks) {
        state->blocks.push_back({addr, b.size, b.allocated});
        addr += b.size;
      }
    }
    return state;
  }

  // Restores a saved pool state (graph trees, when a recorded path diverges after a
  // partial replay): ccalloc frees the pool's live blocks and re-makes the saved ones at
  // their addresses.
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<cca::AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<PoolCheckpoint>(pps);
    TORCH_CHECK(state, "ccalloc: setCheckpointPoolState got a state ccalloc did not save");
    std::vector<ccalloc_block_info> blocks;
    blocks.reserve(state->blocks.size());
    for (const auto& b : state->blocks) {
      blocks.push_back(ccalloc_block_info{b.address, b.size, 0, b.allocated ? 1u : 0u});
    }
    struct Report {
      std::vector<void*> freed;
      std::vector<void*> made;
    } report;
    check(
        ccalloc_restore_pool(
            device,
            pool_of(state->pool),
            blocks.data(),
            blocks.size(),
            [](void* ctx, void* ptr, bool allocated) {
              auto* r = static_cast<Report*>(ctx);
              (allocated ? r->made : r->freed).push_back(ptr);
            },
            &report),
        "restore_pool");
    {
      std::lock_guard<std::mutex> lock(history_mutex_);
      for (void* p : report.freed) {
        block_contexts_.erase(reinterpret_cast<uint64_t>(p));
      }
    }
    cca::CheckpointDelta delta;
    delta.ptrs_freed = std::move(report.freed);
    for (void* p : report.made) {
      delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  std::string name() override {
    return "ccalloc";
  }

 private:
  int device_count() {
    int count = device_count_.load(std::memory_order_relaxed);
    if (count <= 0) {
      int32_t found = 0;
      if (ccalloc_device_count(&found) == CCALLOC_OK) {
        count = found;
        device_count_.store(count, std::memory_order_relaxed);
      }
    }
    return count;
  }

  // Segment events from ccalloc, under its device lock: handed to PyTorch's trace trackers
  // (NCCL registers segments with them).
  static void on_segment_event(void* ctx, const ccalloc_trace_entry* e) {
    auto* self = static_cast<CcallocAllocator*>(ctx);
    std::vector<cda::AllocatorTraceTracker> trackers;
    {
      std::lock_guard<std::mutex> lock(self->observers_mutex_);
      trackers = self->trace_trackers_;
    }
    cda::TraceEntry entry(
        action_of(e->action),
        static_cast<c10::DeviceIndex>(e->device),
        static_cast<size_t>(e->addr),
        static_cast<size_t>(e->size),
        e->stream,
        MempoolId_t{0, 0},
        0);
    for (auto& tracker : trackers) {
      tracker(entry);
    }
  }

  static cda::TraceEntry::Action action_of(uint32_t action) {
    using A = cda::TraceEntry::Action;
    switch (action) {
      case 0: return A::ALLOC;
      case 1: return A::FREE_REQUESTED;
      case 2: return A::FREE_COMPLETED;
      case 3: return A::SEGMENT_ALLOC;
      case 4: return A::SEGMENT_FREE;
      case 5: return A::SEGMENT_MAP;
      case 6: return A::SEGMENT_UNMAP;
      case 7: return A::SNAPSHOT;
      default: return A::OOM;
    }
  }

  // Gathers the caller's context (stack frames) for the event ccalloc records next, as
  // PyTorch's `when` asks: STATE keeps it for live blocks, ALLOC for allocations in the
  // history too, ALL for frees as well. Returns it (null when none is wanted).
  std::shared_ptr<c10::GatheredContext> tag_next_event(bool is_alloc) {
    cda::CreateContextFn recorder;
    cda::RecordContext when;
    {
      std::lock_guard<std::mutex> lock(history_mutex_);
      recorder = context_recorder_;
      when = when_;
    }
    bool wanted = is_alloc ? when >= cda::RecordContext::STATE : when == cda::RecordContext::ALL;
    if (!recorder || !wanted) {
      ccalloc_set_trace_context(0);
      return nullptr;
    }
    // Outside the lock: gathering frames takes the GIL.
    std::shared_ptr<c10::GatheredContext> context = recorder();
    std::lock_guard<std::mutex> lock(history_mutex_);
    uint64_t id = next_context_++;
    if (is_alloc ? when >= cda::RecordContext::ALLOC : true) {
      trace_contexts_[id] = context;
      context_order_.push_back(id);
      // Each context tags one history event and history drops its oldest first: the last
      // max_entries contexts cover every event still kept.
      while (context_order_.size() > max_entries_) {
        trace_contexts_.erase(context_order_.front());
        context_order_.pop_front();
      }
    }
    ccalloc_set_trace_context(id);
    return context;
  }

  void* malloc_or_throw(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    // The fast path: one relaxed load when PyTorch records no history.
    std::shared_ptr<c10::GatheredContext> context;
    if (contexts_on_.load(std::memory_order_relaxed)) {
      context = tag_next_event(true);
    }
    void* ptr = nullptr;
    ccalloc_status status = ccalloc_malloc(size, device, stream, &ptr);
    if (status == CCALLOC_OK) {
      if (context) {
        std::lock_guard<std::mutex> lock(history_mutex_);
        block_contexts_[reinterpret_cast<uint64_t>(ptr)] = std::move(context);
      }
      return ptr;
    }
    std::string message = last_error();
    if (status == CCALLOC_OUT_OF_MEMORY) {
      notify_oom(device, size);
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    }
    TORCH_CHECK(false, "ccalloc: allocating ", number(size), " bytes on device ",
                number(static_cast<unsigned>(device)), " failed (", ccalloc_status_name(status),
                "): ", message);
  }

  ccalloc_status free_on(void* ptr, int device) {
    if (!contexts_on_.load(std::memory_order_relaxed)) {
      return ccalloc_free(ptr, device);
    }
    tag_next_event(false);
    ccalloc_status status = ccalloc_free(ptr, device);
    if (status == CCALLOC_OK) {
      std::lock_guard<std::mutex> lock(history_mutex_);
      block_contexts_.erase(reinterpret_cast<uint64_t>(ptr));
    }
    return status;
  }

  // As the native allocator calls them: (device, size asked, the memory limit (the
  // fraction's, else the device's), device free bytes).
  void notify_oom(c10::DeviceIndex device, size_t size) {
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(observers_mutex_);
      observers = oom_observers_;
    }
    if (observers.empty()) {
      return;
    }
    DeviceMemory memory = device_memory(device);
    for (auto& observer : observers) {
      observer(device, size, memory.limit, memory.free);
    }
  }

  // The device's free and total bytes, and what ccalloc may reserve there: the memory
  // fraction's limit, else the whole device.
  struct DeviceMemory {
    size_t free = 0;
    size_t total = 0;
    size_t limit = 0;
  };

  static DeviceMemory device_memory(c10::DeviceIndex device) {
    DeviceMemory memory;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&memory.free, &memory.total) != cudaSuccess) {
        (void)cudaGetLastError();
        memory.free = 0;
      }
    }
    memory.limit = memory.total;
    double fraction = 1.0;
    if (ccalloc_get_memory_fraction(device, &fraction) == CCALLOC_OK && fraction < 1.0) {
      memory.limit = static_cast<size_t>(fraction * static_cast<double>(memory.total));
    }
    return memory;
  }

  std::atomic<bool> initialized_{false};
  std::atomic<int> device_count_{0};
  bool enabled_ = true;

  std::mutex observers_mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cda::AllocatorTraceTracker> trace_trackers_;
  bool observing_segments_ = false;

  std::mutex history_mutex_;
  cda::CreateContextFn context_recorder_ = nullptr;
  cda::RecordContext when_ = cda::RecordContext::NEVER;
  size_t max_entries_ = 1;
  uint64_t next_context_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<c10::GatheredContext>> trace_contexts_;
  std::deque<uint64_t> context_order_;
  std::unordered_map<uint64_t, std::shared_ptr<c10::GatheredContext>> block_contexts_;
  // Whether PyTorch records history with contexts (recordHistory): the hot path's one check.
  std::atomic<bool> contexts_on_{false};
};


void raw_delete_fn(void* ptr) {
  if (g_instance != nullptr) {
    g_instance->raw_delete(ptr);
  }
}

// Makes ccalloc PyTorch's CUDA allocator, as torch.cuda.memory.change_current_allocator
// does for a pluggable one. Refused once PyTorch's current allocator has allocated: blocks
// it handed out could not be freed by another.
void install() {
  static std::shared_ptr<CcallocAllocator> instance;
  if (instance && cca::get() == instance.get()) {
    return;
  }
  cca::CUDAAllocator* current = cca::get();
  TORCH_CHECK(
      current == nullptr || !current->initialized(),
      "ccalloc: PyTorch's CUDA allocator (", current ? current->name() : std::string("none"),
      ") is already in use; call ccalloc.torch.enable() before anything allocates CUDA memory.");
  if (!instance) {
    instance = std::make_shared<CcallocAllocator>();
    g_instance = instance.get();
  }
  cca::allocator.store(instance.get());
  c10::SetAllocator(c10::DeviceType::CUDA, instance.get());
}

bool installed() {
  return g_instance != nullptr && cca::get() == g_instance;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ccalloc as PyTorch's CUDA caching allocator (a CUDAAllocator backend)";
  m.def("install", &install, "Makes ccalloc PyTorch's CUDA allocator");
  m.def("installed", &installed, "Whether ccalloc is PyTorch's CUDA allocator");
}
