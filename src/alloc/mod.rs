//! The caching allocator for one device, in safe Rust over the `Driver` trait.
//!
//! Behaviour follows PyTorch's CUDACachingAllocator: size-binned small/large pools, best fit
//! per (stream, size), block split/merge, `max_split_size`, cross-stream use via events,
//! and an OOM path that frees cache before failing. The cached hand-out (`take_cached`) is kept
//! apart from the slow path (`grow`, event polling, releases) so a faster front end can be put
//! before it without touching the bookkeeping.
#![forbid(unsafe_code)]

pub mod blocks;
pub mod sizing;
pub mod stats;

use crate::config::Config;
use crate::driver::{DevicePtr, Driver, DriverError, EventId, StreamId};
use crate::error::{human_bytes, Error, ErrorKind, Result};
use blocks::{Block, BlockArena, BlockId, BlockState, FreeList};
use sizing::PoolKind;
use stats::DeviceStats;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// A block freed while other streams may still use it; reusable once every event completes.
struct AwaitingEvents {
    block: BlockId,
    events: Vec<EventId>,
}

/// A device allocation and the first block of its chain.
#[derive(Clone, Copy)]
struct Segment {
    size: u64,
    first: BlockId,
}

/// One segment as seen from outside (tests, snapshots, the replay tool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentView {
    pub addr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    /// (address, size, state) of each block in address order.
    pub blocks: Vec<(DevicePtr, u64, BlockState)>,
}

struct State {
    config: Config,
    /// Reserved bytes may not exceed this (from `per_process_memory_fraction`).
    limit: u64,
    blocks: BlockArena,
    free_lists: [FreeList; 2],
    /// Blocks handed out, by address.
    live: HashMap<DevicePtr, BlockId>,
    segments: BTreeMap<DevicePtr, Segment>,
    awaiting: Vec<AwaitingEvents>,
    stats: DeviceStats,
    shut_down: bool,
}

pub struct DeviceAllocator {
    device: usize,
    total_memory: u64,
    driver: Arc<dyn Driver>,
    state: Mutex<State>,
}

fn driver_error(device: usize, e: DriverError) -> Error {
    match e {
        DriverError::Unavailable(why) => Error::new(ErrorKind::DriverUnavailable, why),
        other => Error::new(ErrorKind::Driver, format!("device {device}: {other}")),
    }
}

impl DeviceAllocator {
    pub fn new(device: usize, driver: Arc<dyn Driver>, config: Config) -> Result<Self> {
        let total_memory = driver
            .total_memory(device)
            .map_err(|e| driver_error(device, e))?;
        let limit = limit_for(&config, total_memory);
        Ok(Self {
            device,
            total_memory,
            driver,
            state: Mutex::new(State {
                config,
                limit,
                blocks: BlockArena::default(),
                free_lists: [FreeList::default(), FreeList::default()],
                live: HashMap::new(),
                segments: BTreeMap::new(),
                awaiting: Vec::new(),
                stats: DeviceStats::default(),
                shut_down: false,
            }),
        })
    }

    pub fn device(&self) -> usize {
        self.device
    }

    pub fn total_memory(&self) -> u64 {
        self.total_memory
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        // A panic while holding the lock leaves bookkeeping we can no longer trust.
        let state = self.state.lock().map_err(|_| {
            Error::new(
                ErrorKind::Internal,
                format!(
                    "device {}: allocator state poisoned by an earlier panic",
                    self.device
                ),
            )
        })?;
        if state.shut_down {
            return Err(Error::new(
                ErrorKind::ShutDown,
                format!("device {}: the allocator has been shut down", self.device),
            ));
        }
        Ok(state)
    }

    /// Allocates at least `size` bytes for use on `stream`.
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr> {
        if size == 0 {
            return Err(Error::new(
                ErrorKind::InvalidSize,
                "size 0: nothing to allocate (ccalloc_torch_alloc returns NULL for it, as PyTorch expects)",
            ));
        }
        let mut st = self.lock()?;
        if size > self.total_memory {
            st.stats.num_ooms += 1;
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!(
                    "out of memory on device {}: tried to allocate {} but the device has {} in all",
                    self.device,
                    human_bytes(size),
                    human_bytes(self.total_memory)
                ),
            ));
        }
        if !st.awaiting.is_empty() {
            self.poll_events(&mut st)?;
        }
        let rounded = sizing::round_size(size, &st.config);
        let pool = PoolKind::for_size(rounded);
        let id = match st.take_cached(pool, stream, rounded) {
            Some(id) => id,
            None => self.grow(&mut st, pool, stream, size, rounded)?,
        };
        Ok(st.hand_out(id, rounded, size))
    }

    /// Slow path: a new segment, freeing cache first where needed (PyTorch's retry order).
    fn grow(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
        rounded: u64,
    ) -> Result<BlockId> {
        let segment_size = sizing::segment_size(rounded);
        if st.config.garbage_collection_threshold > 0.0 {
            self.collect_garbage(st)?;
        }
        if let Some(id) = self.new_segment(st, pool, stream, segment_size)? {
            return Ok(id);
        }
        if self.release_oversize_cached(st, stream, rounded)? {
            if let Some(id) = self.new_segment(st, pool, stream, segment_size)? {
                return Ok(id);
            }
        }
        self.release_all_cached(st)?;
        st.stats.num_alloc_retries += 1;
        if let Some(id) = self.new_segment(st, pool, stream, segment_size)? {
            return Ok(id);
        }
        st.stats.num_ooms += 1;
        Err(Error::new(
            ErrorKind::OutOfMemory,
            self.oom_message(st, size, segment_size),
        ))
    }

    fn oom_message(&self, st: &State, size: u64, segment_size: u64) -> String {
        let reserved = st.stats.reserved_bytes.all().current as u64;
        let allocated = st.stats.allocated_bytes.all().current as u64;
        let (cached, largest) = st.cached_free();
        let limit = if st.limit < self.total_memory {
            format!(
                " Limit {} from per_process_memory_fraction.",
                human_bytes(st.limit)
            )
        } else {
            String::new()
        };
        format!(
            "CUDA out of memory on device {}. Tried to allocate {} (a {} segment). The device has {} in all.{} \
             ccalloc holds {} reserved: {} live in allocations, {} cached free, largest free block {}. \
             If reserved is much larger than live, fragmentation is the cause: try CCALLOC_CONF=max_split_size_mb:<MB>.",
            self.device,
            human_bytes(size),
            human_bytes(segment_size),
            human_bytes(self.total_memory),
            limit,
            human_bytes(reserved),
            human_bytes(allocated),
            human_bytes(cached),
            human_bytes(largest),
        )
    }

    /// Asks the driver for a segment; `None` when the device or the limit says no.
    fn new_segment(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>> {
        let reserved = st.stats.reserved_bytes.all().current as u64;
        if reserved.saturating_add(size) > st.limit {
            return Ok(None);
        }
        let addr = match self.driver.allocate(self.device, size) {
            Ok(addr) => addr,
            Err(DriverError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(driver_error(self.device, e)),
        };
        let id = st.blocks.insert(Block {
            addr,
            size,
            requested: 0,
            stream,
            pool,
            prev: None,
            next: None,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            cached_at: 0,
        });
        st.segments.insert(addr, Segment { size, first: id });
        let s = &mut st.stats;
        s.segment.increase(pool, 1);
        s.reserved_bytes.increase(pool, size);
        s.num_device_alloc += 1;
        if size >= st.config.max_split_size {
            s.oversize_segments.increase(1);
        }
        tracing::debug!(device = self.device, addr, size, "segment allocated");
        Ok(Some(id))
    }

    /// Returns a whole-segment free block to the driver.
    fn release_segment(&self, st: &mut State, id: BlockId) -> Result<()> {
        let block = st.blocks.get(id);
        debug_assert!(!block.is_split() && block.state == BlockState::Free);
        let (addr, size, pool) = (block.addr, block.size, block.pool);
        st.free_lists[pool as usize].remove(block);
        st.stats.num_device_free += 1;
        self.driver
            .release(self.device, addr, size)
            .map_err(|e| driver_error(self.device, e))?;
        st.blocks.remove(id);
        st.segments.remove(&addr);
        let s = &mut st.stats;
        s.segment.decrease(pool, 1);
        s.reserved_bytes.decrease(pool, size);
        if size >= st.config.max_split_size {
            s.oversize_segments.decrease(1);
        }
        tracing::debug!(device = self.device, addr, size, "segment released");
        Ok(())
    }

    /// Releases cached oversize segments on `stream` until `rounded` bytes could fit.
    fn release_oversize_cached(
        &self,
        st: &mut State,
        stream: StreamId,
        rounded: u64,
    ) -> Result<bool> {
        let max_split = st.config.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let wanted = rounded.max(max_split);
        let large = &st.free_lists[PoolKind::Large as usize];
        if let Some((_, id)) = large.best_fit(stream, wanted) {
            if !st.blocks.get(id).is_split() {
                self.sync_before_release(st)?;
                self.release_segment(st, id)?;
                return Ok(true);
            }
        }
        let candidates = large.largest_first(stream, max_split);
        let mut released = 0;
        for id in candidates {
            if released >= wanted {
                break;
            }
            if st.blocks.get(id).is_split() {
                continue;
            }
            if released == 0 {
                self.sync_before_release(st)?;
            }
            released += st.blocks.get(id).size;
            self.release_segment(st, id)?;
        }
        Ok(released >= wanted)
    }

    /// Waits for every pending cross-stream event, then returns every unused segment.
    fn release_all_cached(&self, st: &mut State) -> Result<()> {
        self.sync_before_release(st)?;
        for pool in [PoolKind::Large, PoolKind::Small] {
            let whole: Vec<BlockId> = st.free_lists[pool as usize]
                .ids()
                .filter(|&id| !st.blocks.get(id).is_split())
                .collect();
            for id in whole {
                self.release_segment(st, id)?;
            }
        }
        Ok(())
    }

    /// Cached blocks may still be read by kernels queued before they were freed (frees are
    /// stream-ordered), so the device finishes its work before segments go back.
    fn sync_before_release(&self, st: &mut State) -> Result<()> {
        st.stats.num_sync_all_streams += 1;
        for pending in std::mem::take(&mut st.awaiting) {
            for &event in &pending.events {
                let waited = self.driver.wait_event(self.device, event);
                self.driver.destroy_event(self.device, event);
                waited.map_err(|e| driver_error(self.device, e))?;
            }
            st.cache(pending.block);
        }
        self.driver
            .synchronize(self.device)
            .map_err(|e| driver_error(self.device, e))
    }

    /// Caches blocks whose cross-stream events have all completed.
    fn poll_events(&self, st: &mut State) -> Result<()> {
        let mut i = 0;
        while i < st.awaiting.len() {
            let mut done = true;
            for &event in &st.awaiting[i].events {
                if !self
                    .driver
                    .event_done(self.device, event)
                    .map_err(|e| driver_error(self.device, e))?
                {
                    done = false;
                    break;
                }
            }
            if done {
                let pending = st.awaiting.swap_remove(i);
                for event in pending.events {
                    self.driver.destroy_event(self.device, event);
                }
                st.cache(pending.block);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Above `garbage_collection_threshold` × limit (the fraction's, else the device's; PyTorch
    /// collects only under a fraction), releases the oldest cached whole
    /// segments of the large pool (at least average age) until back under it.
    fn collect_garbage(&self, st: &mut State) -> Result<()> {
        let limit = st.limit.min(self.total_memory);
        let threshold = (st.config.garbage_collection_threshold * limit as f64) as u64;
        let reserved = st.stats.reserved_bytes.all().current as u64;
        if reserved <= threshold {
            return Ok(());
        }
        let target = reserved - threshold;
        let large = &st.free_lists[PoolKind::Large as usize];
        let now = large.lookups;
        let mut candidates: Vec<(u64, BlockId)> = large
            .ids()
            .filter(|&id| !st.blocks.get(id).is_split())
            .map(|id| (now - st.blocks.get(id).cached_at, id))
            .collect();
        let mut reclaimed = 0;
        let mut synced = false;
        while reclaimed < target && !candidates.is_empty() {
            let average =
                candidates.iter().map(|c| c.0 as f64).sum::<f64>() / candidates.len() as f64;
            let (old, young): (Vec<_>, Vec<_>) =
                candidates.into_iter().partition(|c| c.0 as f64 >= average);
            if old.is_empty() {
                break;
            }
            if !synced {
                self.sync_before_release(st)?;
                synced = true;
            }
            for (_, id) in old {
                reclaimed += st.blocks.get(id).size;
                self.release_segment(st, id)?;
            }
            candidates = young;
        }
        Ok(())
    }

    /// Frees a block handed out by `malloc`. Unknown pointers and double frees are refused
    /// with nothing changed.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        let mut st = self.lock()?;
        let Some(id) = st.live.remove(&ptr) else {
            return Err(st.diagnose_not_live(self.device, ptr));
        };
        let max_split = st.config.max_split_size;
        let block = st.blocks.get_mut(id);
        let (pool, size) = (block.pool, block.size);
        let uses = std::mem::take(&mut block.stream_uses);
        let s = &mut st.stats;
        s.allocation.decrease(pool, 1);
        s.allocated_bytes.decrease(pool, size);
        if size >= max_split {
            s.oversize_allocations.decrease(1);
        }
        if uses.is_empty() {
            st.cache(id);
            return Ok(());
        }
        st.blocks.get_mut(id).state = BlockState::AwaitingEvents;
        let mut events = Vec::with_capacity(uses.len());
        for stream in uses {
            match self.driver.record_event(self.device, stream) {
                Ok(event) => events.push(event),
                Err(e) => {
                    // Without an event we cannot know when that stream is done: wait for it all.
                    tracing::warn!(
                        device = self.device,
                        "record_event failed ({e}); synchronizing"
                    );
                    for &event in &events {
                        self.driver.destroy_event(self.device, event);
                    }
                    events.clear();
                    self.driver
                        .synchronize(self.device)
                        .map_err(|e| driver_error(self.device, e))?;
                    break;
                }
            }
        }
        if events.is_empty() {
            st.cache(id);
        } else {
            st.awaiting.push(AwaitingEvents { block: id, events });
        }
        Ok(())
    }

    /// Marks a live block as used on `stream` too: on free it is reused only after the work
    /// queued there has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        let mut st = self.lock()?;
        let Some(&id) = st.live.get(&ptr) else {
            return Err(st.diagnose_not_live(self.device, ptr));
        };
        let block = st.blocks.get_mut(id);
        if block.stream != stream && !block.stream_uses.contains(&stream) {
            block.stream_uses.push(stream);
        }
        Ok(())
    }

    /// Whether `ptr` lies in memory this device's allocator holds (live, cached or pending).
    pub fn holds(&self, ptr: DevicePtr) -> bool {
        let Ok(st) = self.lock() else { return false };
        st.segment_of(ptr).is_some()
    }

    /// Returns every unused segment to the driver.
    pub fn empty_cache(&self) -> Result<()> {
        let mut st = self.lock()?;
        self.release_all_cached(&mut st)
    }

    pub fn set_config(&self, config: Config) -> Result<()> {
        let mut st = self.lock()?;
        st.limit = limit_for(&config, self.total_memory);
        st.config = config;
        Ok(())
    }

    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("memory fraction {fraction} is outside [0, 1]"),
            ));
        }
        let mut st = self.lock()?;
        st.config.per_process_memory_fraction = Some(fraction);
        st.limit = limit_for(&st.config, self.total_memory);
        Ok(())
    }

    pub fn memory_fraction(&self) -> Result<f64> {
        Ok(self
            .lock()?
            .config
            .per_process_memory_fraction
            .unwrap_or(1.0))
    }

    pub fn stats(&self) -> Result<DeviceStats> {
        Ok(self.lock()?.stats)
    }

    pub fn max_split_size(&self) -> Result<u64> {
        Ok(self.lock()?.config.max_split_size)
    }

    pub fn reset_peak_stats(&self) -> Result<()> {
        self.lock()?.stats.reset_peak();
        Ok(())
    }

    pub fn reset_accumulated_stats(&self) -> Result<()> {
        self.lock()?.stats.reset_accumulated();
        Ok(())
    }

    /// Every segment with its blocks, in address order.
    pub fn segments(&self) -> Result<Vec<SegmentView>> {
        let st = self.lock()?;
        Ok(st
            .segments
            .iter()
            .map(|(&addr, seg)| {
                let first = st.blocks.get(seg.first);
                let mut blocks = Vec::new();
                let mut cursor = Some(seg.first);
                while let Some(id) = cursor {
                    let b = st.blocks.get(id);
                    blocks.push((b.addr, b.size, b.state));
                    cursor = b.next;
                }
                SegmentView {
                    addr,
                    size: seg.size,
                    stream: first.stream,
                    pool: first.pool,
                    blocks,
                }
            })
            .collect())
    }

    /// Releases everything; refused while blocks are still live.
    pub fn shutdown(&self) -> Result<()> {
        let mut st = self.lock()?;
        if !st.live.is_empty() {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "device {}: {} allocations ({}) are still live; free them before shutdown",
                    self.device,
                    st.live.len(),
                    human_bytes(st.stats.allocated_bytes.all().current as u64)
                ),
            ));
        }
        self.release_all_cached(&mut st)?;
        st.shut_down = true;
        Ok(())
    }
}

fn limit_for(config: &Config, total_memory: u64) -> u64 {
    match config.per_process_memory_fraction {
        Some(f) => (f * total_memory as f64) as u64,
        None => u64::MAX,
    }
}

impl State {
    /// Fast path: the best cached fit, obeying the oversize rules.
    fn take_cached(&mut self, pool: PoolKind, stream: StreamId, rounded: u64) -> Option<BlockId> {
        let max_split = self.config.max_split_size;
        let list = &mut self.free_lists[pool as usize];
        list.lookups += 1;
        let (found, id) = list.best_fit(stream, rounded)?;
        // Oversize blocks serve only oversize requests, and only ones close to their size.
        if rounded < max_split && found >= max_split {
            return None;
        }
        if rounded >= max_split
            && found >= rounded.saturating_add(self.config.max_non_split_rounding)
        {
            return None;
        }
        list.remove(self.blocks.get(id));
        Some(id)
    }

    /// Splits off what `rounded` does not need, marks the block live, and counts it.
    fn hand_out(&mut self, id: BlockId, rounded: u64, requested: u64) -> DevicePtr {
        let block = self.blocks.get(id);
        let pool = block.pool;
        let already_split = block.is_split();
        if sizing::should_split(pool, block.size, rounded, &self.config) {
            let rest = Block {
                addr: block.addr + rounded,
                size: block.size - rounded,
                requested: 0,
                stream: block.stream,
                pool,
                prev: Some(id),
                next: block.next,
                state: BlockState::Free,
                stream_uses: Vec::new(),
                cached_at: self.free_lists[pool as usize].lookups,
            };
            let rest_size = rest.size;
            let rest_id = self.blocks.insert(rest);
            if let Some(next) = self.blocks.get(rest_id).next {
                self.blocks.get_mut(next).prev = Some(rest_id);
            }
            let block = self.blocks.get_mut(id);
            block.next = Some(rest_id);
            block.size = rounded;
            self.free_lists[pool as usize].insert(self.blocks.get(rest_id), rest_id);
            if already_split {
                // The inactive piece shrinks by what was handed out.
                self.stats.inactive_split_bytes.decrease(pool, rounded);
            } else {
                self.stats.inactive_split.increase(pool, 1);
                self.stats.inactive_split_bytes.increase(pool, rest_size);
            }
        } else if already_split {
            self.stats.inactive_split.decrease(pool, 1);
            self.stats.inactive_split_bytes.decrease(pool, block.size);
        }
        let block = self.blocks.get_mut(id);
        block.state = BlockState::Allocated;
        block.requested = requested;
        let (addr, size) = (block.addr, block.size);
        self.live.insert(addr, id);
        let s = &mut self.stats;
        s.allocation.increase(pool, 1);
        s.allocated_bytes.increase(pool, size);
        s.active.increase(pool, 1);
        s.active_bytes.increase(pool, size);
        s.requested_bytes.increase(pool, requested);
        if size >= self.config.max_split_size {
            s.oversize_allocations.increase(1);
        }
        addr
    }

    /// Returns a no-longer-used block to its pool, merging free neighbours.
    fn cache(&mut self, id: BlockId) {
        let block = self.blocks.get(id);
        let (pool, original_size, requested) = (block.pool, block.size, block.requested);
        let (mut net_blocks, mut net_bytes) = (0i64, 0i64);
        for neighbour in [block.prev, block.next].into_iter().flatten() {
            if self.blocks.get(neighbour).state != BlockState::Free {
                continue;
            }
            let absorbed = self.absorb(id, neighbour);
            net_blocks -= 1;
            net_bytes -= absorbed as i64;
        }
        let list = &mut self.free_lists[pool as usize];
        let block = self.blocks.get_mut(id);
        block.state = BlockState::Free;
        block.requested = 0;
        block.cached_at = list.lookups;
        list.insert(block, id);
        if block.is_split() {
            net_blocks += 1;
            net_bytes += block.size as i64;
        }
        let s = &mut self.stats;
        s.inactive_split.adjust(pool, net_blocks);
        s.inactive_split_bytes.adjust(pool, net_bytes);
        s.active.decrease(pool, 1);
        s.active_bytes.decrease(pool, original_size);
        s.requested_bytes.decrease(pool, requested);
    }

    /// Merges the free `neighbour` into `id`; returns the bytes taken over.
    fn absorb(&mut self, id: BlockId, neighbour: BlockId) -> u64 {
        let other = self.blocks.get(neighbour).clone();
        self.free_lists[other.pool as usize].remove(&other);
        self.blocks.remove(neighbour);
        let block = self.blocks.get_mut(id);
        if other.addr < block.addr {
            block.addr = other.addr;
            block.prev = other.prev;
            if let Some(p) = other.prev {
                self.blocks.get_mut(p).next = Some(id);
            }
        } else {
            block.next = other.next;
            if let Some(n) = other.next {
                self.blocks.get_mut(n).prev = Some(id);
            }
        }
        let block = self.blocks.get_mut(id);
        block.size += other.size;
        if block.prev.is_none() {
            let addr = block.addr;
            if let Some(seg) = self.segments.get_mut(&addr) {
                seg.first = id;
            }
        }
        other.size
    }

    /// Total cached free bytes and the largest cached block.
    fn cached_free(&self) -> (u64, u64) {
        self.free_lists
            .iter()
            .flat_map(|l| l.ids())
            .map(|id| self.blocks.get(id).size)
            .fold((0, 0), |(sum, max), s| (sum + s, max.max(s)))
    }

    fn segment_of(&self, ptr: DevicePtr) -> Option<(DevicePtr, Segment)> {
        let (&addr, &seg) = self.segments.range(..=ptr).next_back()?;
        (ptr < addr + seg.size).then_some((addr, seg))
    }

    /// Why `ptr` cannot be freed here: a double free, an interior pointer, or unknown.
    fn diagnose_not_live(&self, device: usize, ptr: DevicePtr) -> Error {
        let Some((_, seg)) = self.segment_of(ptr) else {
            return Error::new(
                ErrorKind::UnknownPointer,
                format!("{ptr:#x} was not allocated by ccalloc on device {device}"),
            );
        };
        let mut cursor = Some(seg.first);
        while let Some(id) = cursor {
            let b = self.blocks.get(id);
            if b.addr == ptr {
                return match b.state {
                    BlockState::Free | BlockState::AwaitingEvents => Error::new(
                        ErrorKind::DoubleFree,
                        format!("{ptr:#x} on device {device} is not live: it was already freed"),
                    ),
                    BlockState::Allocated => unreachable!("live blocks are in the live map"),
                };
            }
            if ptr < b.end() {
                break;
            }
            cursor = b.next;
        }
        Error::new(
            ErrorKind::UnknownPointer,
            format!("{ptr:#x} points inside a ccalloc block on device {device}, not at its start"),
        )
    }
}

#[cfg(test)]
mod tests;
