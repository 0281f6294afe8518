//! The shard: one lock over one `State`, and every operation that needs the lock, the
//! bookkeeping, paging and the driver together. The slow paths live in the submodules:
//! giving memory back (`release`), private pools (`pools`), restoring a pool's layout
//! (`restore`), paged segments' driver I/O (`paging`), fences (`fences`) and the thread
//! fronts' drain and adoption (`fronts`).

mod fences;
mod fronts;
mod lending;
mod paging;
pub mod pools;
mod release;
pub mod restore;

use super::blocks::{BlockId, PoolId};
use super::device::{Lifecycle, Shards};
use super::paging::budget::Allowance;
use super::sizing::{self, PoolKind};
use super::state::{Elsewhere, State, TakenBack};
use super::stats::{self, DeviceStats, LockCounters};
use super::{driver_error, front, limit_for, SegmentView};
use crate::config::Config;
use crate::driver::{DevicePtr, Driver, DriverError, StreamId};
use crate::error::{human_bytes, Error, ErrorKind, Result};
use crate::sync::{poisoned, Guard, SpinThenBlock};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Paged segments a (stream, pool) may have. Each spans the device's size in addresses, so
/// a request finds no free range only when live blocks are scattered across it; a few more
/// ranges are cheap (a page table each), and past them requests fall back to plain
/// segments.
const MAX_PAGED_SEGMENTS: usize = 4;

/// What `Shard::free` did.
#[derive(Debug)]
pub(in crate::alloc) enum Freed {
    /// `ptr` is not a live block of this shard.
    NotLive,
    Done,
    /// Taken by the caller's front for this shard (still handed out, to the shard).
    Adopted,
}

impl Freed {
    pub(in crate::alloc) fn freed(&self) -> bool {
        !matches!(self, Freed::NotLive)
    }
}

/// When a block is freed (`Shard::free_block`), for the fence of its pages: a fence may be
/// recorded only on a stream known to be alive, and covers only frees stamped before it.
#[derive(Clone, Copy, Debug)]
pub(in crate::alloc) enum FreedAt {
    /// At the caller's free: its stream is alive.
    CallersFree,
    /// Later (a block that left a front, or a restore's): its stream may be gone by now,
    /// unless it is `alive`, the stream of the visit under way. Otherwise a later fence
    /// there, or a device synchronize, covers it (`wait_for_free`). `frees`: the frees it
    /// stands for (a front may have served several since the shard last stamped its
    /// pages), each counted in the fences' cadence.
    Later { alive: Option<StreamId>, frees: u32 },
    /// Later, but its pages were stamped, and a due fence recorded, at the caller's free
    /// (a front's adoption, `Shard::adopt`), and it was not handed out since: nothing left
    /// to stamp or record.
    Stamped,
}

/// One stream's allocator (see `device`): everything `DeviceAllocator` does, for the streams
/// routed to it, under its own lock.
pub(crate) struct Shard {
    pub(in crate::alloc) device: usize,
    total_memory: u64,
    driver: Arc<dyn Driver>,
    pub(in crate::alloc) state: SpinThenBlock<State>,
    /// This shard's thread fronts (`front`): a layer over the shard that hands out and
    /// takes back blocks it counts as live; the shard drains them (`drain_fronts`).
    pub(in crate::alloc) fronts: Arc<front::Fronts>,
    /// The device's shutdown record, read each time the shard is locked.
    lifecycle: Arc<Lifecycle>,
    /// `Driver::min_free_fence_interval`, `Driver::times_page_moves` and
    /// `Driver::releases_outgrown_segments`, read once.
    free_fence_interval: std::time::Duration,
    times_page_moves: bool,
    releases_outgrown: bool,
    /// The device's shards, this one among them (see `lending`).
    siblings: Weak<Shards>,
    /// Bytes live in this shard as of its last allocation or free, for other shards'
    /// growths (`lending`) to read without taking this shard's lock.
    live: AtomicU64,
}

/// What a device's shards share with it and with each other.
pub(in crate::alloc) struct DeviceWide {
    pub device_reserved: Arc<stats::DeviceReserved>,
    /// The time page moves may still take, on all the device's streams together.
    pub moves: Arc<Mutex<Allowance>>,
    pub lifecycle: Arc<Lifecycle>,
    pub siblings: Weak<Shards>,
}

impl Shard {
    pub(in crate::alloc) fn new(
        device: usize,
        total_memory: u64,
        driver: Arc<dyn Driver>,
        config: Config,
        shared: DeviceWide,
        fronts: front::Fronts,
    ) -> Self {
        let DeviceWide {
            device_reserved,
            moves,
            lifecycle,
            siblings,
        } = shared;
        let limit = limit_for(&config, total_memory);
        let free_fence_interval = driver.min_free_fence_interval();
        let times_page_moves = driver.times_page_moves();
        let releases_outgrown = driver.releases_outgrown_segments();
        Self {
            device,
            total_memory,
            driver,
            state: SpinThenBlock::new(State::new(config, limit, device_reserved, moves)),
            fronts: Arc::new(fronts),
            lifecycle,
            free_fence_interval,
            times_page_moves,
            releases_outgrown,
            siblings,
            live: AtomicU64::new(0),
        }
    }

    /// Publishes this shard's live bytes (`live`).
    pub(in crate::alloc) fn publish_live(&self, st: &State) {
        let live = st.stats().active_bytes.all().current.max(0) as u64;
        self.live.store(live, Ordering::Relaxed);
    }

    /// The live bytes last published (`publish_live`), for tests.
    #[cfg(test)]
    pub(in crate::alloc) fn published_live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// Locks the shard: every visit's first step, so only the check that the lock is sound
    /// and the device open is inlined; building either error is left to `lock_refused`.
    #[inline]
    pub(in crate::alloc) fn lock(&self) -> Result<Guard<'_, State>> {
        match self.state.lock() {
            Ok(state) if !self.lifecycle.is_shut_down() => Ok(state),
            locked => Err(self.lock_refused(locked)),
        }
    }

    /// `lock`, if the lock comes free within a short spin (`SpinThenBlock::lock_soon`);
    /// `Ok(None)` if it does not.
    pub(in crate::alloc) fn lock_soon(&self) -> Result<Option<Guard<'_, State>>> {
        match self.state.lock_soon() {
            Ok(Some(state)) if !self.lifecycle.is_shut_down() => Ok(Some(state)),
            Ok(Some(state)) => Err(self.lock_refused(Ok(state))),
            Ok(None) => Ok(None),
            Err(poisoned) => Err(self.lock_refused(Err(poisoned))),
        }
    }

    /// Why `lock` failed: a panic while holding the lock left bookkeeping that can no longer
    /// be trusted (`Err`), or the device was shut down (`Ok`, the guard, released here).
    #[cold]
    #[inline(never)]
    fn lock_refused(
        &self,
        locked: std::result::Result<Guard<'_, State>, crate::sync::Poisoned<'_, State>>,
    ) -> Error {
        match locked {
            Err(_) => poisoned(&format!("device {}'s allocator state", self.device)),
            Ok(_) => Lifecycle::shut_down_error(self.device),
        }
    }

    /// Allocates at least `size` bytes for use on `stream`. With `oom_final` `None`, an OOM
    /// is not counted: the caller will empty the other shards' caches and try again; else
    /// it is, and its message adds what the other shards hold.
    pub(in crate::alloc) fn malloc(
        &self,
        size: u64,
        stream: StreamId,
        oom_final: Option<Elsewhere>,
    ) -> Result<DevicePtr> {
        if size == 0 {
            return Err(Error::new(
                ErrorKind::InvalidSize,
                "size 0: nothing to allocate (ccalloc_torch_alloc returns NULL for it, as PyTorch expects)",
            ));
        }
        let mut st = self.lock()?;
        // Published below, with the allocation.
        self.return_large_held(&mut st, |_| Some(stream));
        st.set_oom_final(oom_final);
        if size > self.total_memory {
            // Larger than the device: fail at once, without flushing the cache for nothing.
            return Err(self.out_of_memory(&mut st, size, size));
        }
        let capturing = st.capturing();
        // Querying events is not allowed while a graph is being captured.
        if !capturing && st.has_awaiting() {
            self.poll_events(&mut st)?;
        }
        let owner = if capturing {
            st.caches().route(stream)
        } else {
            None
        };
        let rounded = sizing::round_size(size, st.config());
        // Blocks in thread fronts count as allocated here: a hand-out that lifts a figure
        // past its peak takes them back first, so that the new peak is the true one.
        let peaks = (st.front_blocks() > 0).then(|| st.stats().front_peaks());
        // The memory limit gates reserving new memory, never handing out cached memory (as
        // PyTorch checks it only when it must reserve): past it, only the cache may serve.
        let cache_only = size > st.limit();
        let ptr = self.malloc_locked(&mut st, size, stream, owner, rounded, cache_only)?;
        self.publish_live(&st);
        if let Some(before) = peaks {
            if st.stats().front_peaks_passed(&before) {
                self.drain_fronts(&mut st);
                st.stats_mut().settle_front_peaks(&before);
            }
        }
        Ok(ptr)
    }

    /// `malloc` once the shard is locked and the request checked and rounded.
    pub(in crate::alloc) fn malloc_locked(
        &self,
        st: &mut State,
        size: u64,
        stream: StreamId,
        owner: Option<PoolId>,
        rounded: u64,
        cache_only: bool,
    ) -> Result<DevicePtr> {
        if owner.is_none() && st.config().expandable_segments {
            if let Some(ptr) = st.take_parked(stream, rounded, size) {
                return Ok(ptr);
            }
        }
        let pool = PoolKind::for_size(rounded);
        let mut found = st.take_cached(owner, pool, stream, rounded);
        let lacks_pages =
            |st: &State, (id, ready): (BlockId, bool)| !ready && st.needs_pages(id, rounded);
        if (st.parked_count() > 0
            || st.front_small_blocks() > 0
            || (rounded > front::FRONT_MAX_BLOCK && st.front_large_blocks() > 0))
            && found.is_none_or(|f| lacks_pages(st, f))
        {
            // Parked blocks (and those held in thread fronts) may hold the mapped pages this
            // request would map anew, or the free space it fits in once they merge: they
            // merge back first, and the request looks again. Large blocks count only for a
            // large request: the visiting thread's own went back as its visit began, so
            // they are other threads' (PyTorch's autograd thread frees what the main thread
            // allocates next), and a small request does not pay to drain them.
            if let Some((id, _)) = found {
                st.return_untouched(id);
            }
            self.merge_set_aside(st);
            found = st.take_cached(owner, pool, stream, rounded);
        }
        if cache_only && found.is_none_or(|f| lacks_pages(st, f)) {
            // More than the limit, and the cache cannot serve it whole: new memory would
            // pass the limit. Fails at once, without flushing the cache or mapping pages up
            // to the limit for nothing. (A block lacking pages is paged: returned as taken.)
            if let Some((id, _)) = found {
                st.return_untouched(id);
            }
            return Err(self.out_of_memory(st, size, size));
        }
        // No free block fits: with paging, that means no free address range does. Address
        // space is not memory: another paged segment gives the request a range, and its
        // pages come from the same reserve (moved from under free blocks past the slack),
        // where a plain segment would reserve the whole request anew and keep it cached.
        // A segment added here that serves nothing (the request failed, or does not fit even
        // a whole segment) goes back at once (`drop_if_empty`).
        let mut added = None;
        if found.is_none() && st.paged_segments_of(stream, pool) < MAX_PAGED_SEGMENTS {
            if let Some(page) = self.paging(st, owner.is_some()) {
                added = self.add_paged_segment(st, stream, pool, page)?;
                if let Some(base) = added {
                    found = st.take_cached(owner, pool, stream, rounded);
                    if found.is_none() {
                        self.drop_if_empty(st, base);
                    }
                }
            }
        }
        let (id, pages_ready) = match found {
            Some(found) => found,
            None => (self.grow(st, owner, pool, stream, size, rounded)?, false),
        };
        if !pages_ready && st.block(id).paged() {
            if let Err(e) = self.back_with_pages(st, id, size, rounded) {
                if let Some(base) = added {
                    self.drop_if_empty(st, base);
                }
                return Err(e);
            }
        }
        Ok(st.hand_out(id, rounded, size))
    }

    /// Maps the pages a paged block needs before it is handed out; on failure the block goes
    /// back to the cache and the caller gets the OOM error.
    pub(in crate::alloc) fn back_with_pages(
        &self,
        st: &mut State,
        id: BlockId,
        size: u64,
        rounded: u64,
    ) -> Result<()> {
        // Not free while its pages are found: no merge or reclaim may touch it meanwhile.
        let (addr, end, stream) = st.hold_for_mapping(id);
        let mapped = self.map_pages(st, stream, addr, rounded, addr + rounded..end);
        if matches!(mapped, Ok(true)) {
            return Ok(());
        }
        st.return_untouched(id);
        mapped?;
        Err(self.out_of_memory(st, size, rounded))
    }

    /// Slow path: a new segment, freeing cache first where needed (PyTorch's retry order).
    /// During a capture nothing is released: that would synchronize a capturing stream.
    pub(in crate::alloc) fn grow(
        &self,
        st: &mut State,
        owner: Option<PoolId>,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        rounded: u64,
    ) -> Result<BlockId> {
        let segment_size = sizing::segment_size(rounded);
        let capturing = st.capturing();
        // Parked blocks (and fronts' held ones) merge with their neighbours before any
        // memory is made.
        self.merge_set_aside(st);
        if !capturing && st.config().garbage_collection_threshold > 0.0 {
            self.collect_garbage(st)?;
        }
        if !capturing && self.releases_outgrown {
            self.release_outgrown(st, owner, pool, segment_size)?;
        }
        if let Some(id) = self.new_segment(st, owner, pool, stream, segment_size)? {
            return Ok(id);
        }
        if !capturing {
            if self.release_oversize_cached(st, pool, stream, rounded)? {
                if let Some(id) = self.new_segment(st, owner, pool, stream, segment_size)? {
                    return Ok(id);
                }
            }
            self.release_all_cached(st)?;
            st.count_alloc_retry();
            if let Some(id) = self.new_segment(st, owner, pool, stream, segment_size)? {
                return Ok(id);
            }
        }
        Err(self.out_of_memory(st, size, segment_size))
    }

    /// Counts an OOM and describes it: what was asked, reserved, live, cached, largest free.
    pub(in crate::alloc) fn out_of_memory(&self, st: &mut State, size: u64, needed: u64) -> Error {
        st.count_oom();
        // Parked (and held) blocks are cached free memory too: the message counts them merged.
        self.merge_set_aside(st);
        match self.oom_message(st, size, needed) {
            Ok(message) => Error::new(ErrorKind::OutOfMemory, message),
            Err(e) => e,
        }
    }

    pub(in crate::alloc) fn oom_message(
        &self,
        st: &State,
        size: u64,
        segment_size: u64,
    ) -> Result<String> {
        let elsewhere = st.oom_final().unwrap_or_default();
        let allocated = st.stats().allocated_bytes.all().current as u64 + elsewhere.live;
        let (cached, largest) = st.cached_free();
        let (cached, largest) = (
            cached + elsewhere.cached,
            largest.max(elsewhere.largest_free),
        );
        let limit = if st.limit() < self.total_memory {
            format!(
                " Limit {} from per_process_memory_fraction.",
                human_bytes(st.limit())
            )
        } else {
            String::new()
        };
        let elsewhere_reserved = st.reserved_elsewhere()?;
        let held = if elsewhere_reserved > 0 {
            let emptied = if elsewhere.second_try {
                ", whose caches were emptied first"
            } else {
                ""
            };
            format!(
                "{} reserved ({} of it for other streams{emptied}):",
                human_bytes(st.device_reserved()?),
                human_bytes(elsewhere_reserved)
            )
        } else {
            format!("{} reserved:", human_bytes(st.reserved()))
        };
        Ok(format!(
            "CUDA out of memory on device {}. Tried to allocate {} (needing {} more from the device). The device has {} in all.{} \
             ccalloc holds {} {} live in allocations, {} cached free, largest free block {}. \
             If reserved is much larger than live, fragmentation is the cause: try CCALLOC_CONF=max_split_size_mb:<MB>.",
            self.device,
            human_bytes(size),
            human_bytes(segment_size),
            human_bytes(self.total_memory),
            limit,
            held,
            human_bytes(allocated),
            human_bytes(cached),
            human_bytes(largest),
        ))
    }

    /// Asks the driver for a segment; `None` when the device or the limit says no.
    pub(in crate::alloc) fn new_segment(
        &self,
        st: &mut State,
        owner: Option<PoolId>,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>> {
        let addr = match self.driver.allocate(self.device, size) {
            Ok(addr) => addr,
            Err(e) => return self.refused(e),
        };
        Ok(Some(st.add_segment(addr, size, stream, pool, owner)))
    }

    /// The driver (or the memory limit below it) refused memory: out of memory is `None`
    /// (the caller tries otherwise), any other error an error.
    pub(in crate::alloc) fn refused<T>(&self, e: DriverError) -> Result<Option<T>> {
        match e {
            DriverError::OutOfMemory => Ok(None),
            e => Err(driver_error(self.device, e)),
        }
    }

    /// Frees a block handed out by `malloc`. A block that may wait in the calling thread's
    /// front for this shard goes there (still handed out, to this shard) instead of the
    /// cache; one over `front::FRONT_MAX_BLOCK` only with `large_may_wait` (the caller's
    /// rule: `DeviceAllocator::free_trying`). `NotLive` (nothing changed) when `ptr` is not
    /// a live block of this shard.
    pub(in crate::alloc) fn free(&self, ptr: DevicePtr, large_may_wait: bool) -> Result<Freed> {
        let mut st = self.lock()?;
        let mut found = st.live_block(ptr);
        // The caller frees a block of this stream now: it is alive.
        let alive = |st: &State| found.map(|id| st.block(id).stream());
        if self.return_large_held(&mut st, alive) {
            self.publish_live(&st);
            // `ptr` may have been one of them (a double free).
            found = st.live_block(ptr);
        }
        let Some(id) = found else {
            return Ok(Freed::NotLive);
        };
        let block = st.block(id);
        let (held, large) = (block.front() != 0, block.size() > front::FRONT_MAX_BLOCK);
        // Leaving its front changes nothing `fits_front` reads.
        let fits = self.fits_front(&st, block) && (large_may_wait || !large);
        if held {
            self.detach_from_front(&mut st, id, ptr)?;
        }
        let adopted = front::with_adopter(&self.fronts, large, fits, |adopter| {
            let census = adopter.and_then(|cell| self.adopt(&mut st, id, cell));
            (census.is_some(), census)
        });
        if adopted {
            // The adoption may have made room by freeing a block the front held.
            self.publish_live(&st);
            return Ok(Freed::Adopted);
        }
        self.free_block(&mut st, id, FreedAt::CallersFree)?;
        self.publish_live(&st);
        Ok(Freed::Done)
    }

    /// Frees a live block `id` that no front holds, at `at` (what is known of its stream and
    /// pages for their fence).
    pub(in crate::alloc) fn free_block(
        &self,
        st: &mut State,
        id: BlockId,
        at: FreedAt,
    ) -> Result<()> {
        let TakenBack {
            uses,
            stream,
            parkable,
        } = st.take_back(id);
        if !uses.is_empty() {
            // The history's free completes when these streams' work does (`reusable`).
            crate::history::free_delayed(self.device as i32, st.block(id).addr());
        }
        if uses.is_empty() {
            let (frees, alive) = match at {
                FreedAt::CallersFree => (1, true),
                FreedAt::Later { alive, frees } => (frees, alive == Some(stream)),
                FreedAt::Stamped => (0, false),
            };
            let fence_due = match st.park(id, parkable, frees) {
                Some(due) => due,
                None => st.cache_freed(id, frees),
            };
            if fence_due && alive && self.free_fence_allowed(st, stream) {
                // Later growth may want these pages: a fence tells it when they are free.
                self.record_fence(st, stream);
            }
        } else if st.capturing() {
            st.defer(id, uses);
        } else {
            self.await_streams(st, id, uses)?;
        }
        Ok(())
    }

    /// Blocks set aside for reuse, parked here and held in fronts, go back to the free lists,
    /// merged with their neighbours: before growth, reclaiming pages, releasing the cache or
    /// reporting an OOM, which must see all free memory.
    pub(in crate::alloc) fn merge_set_aside(&self, st: &mut State) {
        self.drain_fronts(st);
        st.flush_parked();
    }

    /// Why `ptr` is not live, when it lies in this shard's memory (a double free, or a pointer
    /// into a block); `None` when this shard never held it.
    pub(in crate::alloc) fn explain_not_live(&self, ptr: DevicePtr) -> Result<Option<Error>> {
        let st = self.lock()?;
        Ok(st
            .segment_of(ptr)
            .map(|_| st.diagnose_not_live(self.device, ptr)))
    }

    /// Whether a fence due at a free on `stream` may be recorded now: at most one per
    /// `free_fence_interval` and stream (the clock is read only when one is due).
    pub(in crate::alloc) fn free_fence_allowed(&self, st: &mut State, stream: StreamId) -> bool {
        st.fences_mut()
            .allow_free_fence(stream, self.free_fence_interval)
    }

    /// Marks a live block as used on `stream` too: on free it is reused only after the work
    /// queued there has completed.
    /// `false` (nothing changed) when `ptr` is not a live block of this shard.
    pub(in crate::alloc) fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<bool> {
        let mut st = self.lock()?;
        let Some(id) = st.live_block(ptr) else {
            return Ok(false);
        };
        // A block used on another stream is freed through the shard, which waits for it.
        self.detach_from_front(&mut st, id, ptr)?;
        st.record_use(id, stream);
        Ok(true)
    }

    /// What this shard holds, for another shard's OOM message.
    pub(in crate::alloc) fn holdings(&self) -> Result<Elsewhere> {
        let mut st = self.lock()?;
        // Parked (and held) blocks are cached free memory too, as in this shard's own OOM
        // message (`out_of_memory`).
        self.merge_set_aside(&mut st);
        let (cached, largest_free) = st.cached_free();
        Ok(Elsewhere {
            live: st.stats().allocated_bytes.all().current as u64,
            cached,
            largest_free,
            second_try: false,
        })
    }

    /// Whether `pool` is known here (a window was opened for it while this shard existed).
    pub(in crate::alloc) fn knows_pool(&self, pool: PoolId) -> Result<bool> {
        Ok(self.lock()?.caches().knows_pool(pool))
    }

    /// Whether this shard holds memory (a segment) of `stream`.
    pub(in crate::alloc) fn serves_stream(&self, stream: StreamId) -> Result<bool> {
        Ok(self.lock()?.serves_stream(stream))
    }

    /// Whether `ptr` lies in memory this device's allocator holds (live, cached or pending).
    /// `false` when the shard cannot be locked (shut down, or poisoned: no way to report
    /// here, and the caller's next call that needs the shard reports it).
    pub fn holds(&self, ptr: DevicePtr) -> bool {
        let Ok(st) = self.lock() else { return false };
        st.segment_of(ptr).is_some()
    }

    /// Returns every unused segment to the driver.
    /// While a CUDA graph is being captured nothing is released (waiting for the device
    /// would invalidate the capture); the cache is emptied by the next call after it.
    pub fn empty_cache(&self) -> Result<()> {
        let mut st = self.lock()?;
        if st.capturing() {
            tracing::debug!(
                device = self.device,
                "empty_cache during a capture: deferred"
            );
            return Ok(());
        }
        self.release_all_cached(&mut st)
    }

    pub fn set_config(&self, config: Config) -> Result<()> {
        let mut st = self.lock()?;
        // Held blocks were sized under the old settings.
        self.drain_fronts(&mut st);
        let limit = limit_for(&config, self.total_memory);
        st.set_config(config, limit);
        Ok(())
    }

    /// This shard's statistics plus the fronts' counts, with its lock held (`st`): drains,
    /// evictions and folds (which move counts between the two) take that lock too.
    pub(in crate::alloc) fn stats_with_fronts_locked(&self, st: &State) -> Result<DeviceStats> {
        let mut stats = *st.stats();
        self.fronts.add_counts_to(&mut stats)?;
        Ok(stats)
    }

    pub fn reset_peak_stats(&self) -> Result<()> {
        let mut st = self.lock()?;
        self.reset_peaks_locked(&mut st);
        Ok(())
    }

    /// `reset_peak_stats` with the lock held (`st`).
    pub(in crate::alloc) fn reset_peaks_locked(&self, st: &mut State) {
        // Held blocks count as allocated here: the new peaks must not include them.
        self.drain_fronts(st);
        st.stats_mut().reset_peak();
    }

    pub fn reset_accumulated_stats(&self) -> Result<()> {
        let mut st = self.lock()?;
        self.fronts.reset_accumulated()?;
        st.stats_mut().reset_accumulated();
        self.state.reset_use(&st);
        Ok(())
    }

    /// How callers have met this shard's lock, read without it.
    pub fn lock_counters(&self) -> LockCounters {
        self.state.use_counts()
    }

    /// The largest cached free block's device memory: what a request could get without the
    /// driver.
    pub fn largest_free_block(&self) -> Result<u64> {
        let mut st = self.lock()?;
        // Blocks held in fronts or parked are cached too: counted merged, as they are then.
        self.merge_set_aside(&mut st);
        Ok(st.cached_free().1)
    }

    /// Every segment with its blocks, in address order (parked blocks as they are).
    pub fn segments(&self) -> Result<Vec<SegmentView>> {
        let mut st = self.lock()?;
        // Blocks held in fronts are free: shown merged into the cache, as they are then.
        self.drain_fronts(&mut st);
        Ok(st.segment_views())
    }
}
