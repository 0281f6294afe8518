//! Paged segments: ccalloc's answer to "reserved but unallocated" memory.
//!
//! With the driver's virtual memory management, each (stream, pool) gets one address range
//! as large as the device, carved into blocks like any segment, but backed by physical memory
//! only where blocks need it, one granule (page) at a time. Pages of free blocks stay mapped
//! (so steady-state reuse costs no driver call) until growth would push reserved memory past
//! the high-water mark of live memory plus a small slack; then pages under free blocks are
//! unmapped and reused where they are needed, or given back. Reserved memory therefore
//! tracks live memory, while a training loop that repeats its sizes never maps or unmaps
//! after its first iterations.
//!
//! A page moves only once the device is done with the work queued before its last free:
//! frees and growth record events ("fences") on their streams, and a move waits on the
//! oldest fence covering the page, usually one that has completed already. Placement
//! (`State::take_cached`) prefers places whose pages are mapped, since each move costs tens
//! of microseconds of driver calls (see `benches/gpu/vmm_cost.cu`).

use super::blocks::{Block, BlockState};
use super::sizing::PoolKind;
use super::state::{Fence, Segment, State};
use super::{driver_error, DeviceAllocator};
use crate::driver::{DevicePtr, PhysHandle, StreamId};
use crate::error::Result;
use std::collections::BTreeSet;
use std::ops::Range;

/// Growth may keep `page_slack` (config) times the live high-water mark as cached pages
/// before reclaiming, but never fewer than this many pages.
const MIN_SLACK_PAGES: u64 = 4;
/// Fences kept pending per stream; beyond this none are recorded until some complete.
const MAX_FENCES_PER_STREAM: usize = 64;
/// Every this many frees of paged blocks in a segment, the free records a fence: an event
/// record costs about a µs (0.8 µs on an H100, `benches/gpu/vmm_cost.cu`), and a GPU
/// running behind the host needs no finer marks. (A count, not a clock, so that replays
/// come out the same every time.)
const FREES_PER_FENCE: u32 = 16;

/// The page table of one paged segment.
pub struct PagedSegment {
    pub base: DevicePtr,
    pub size: u64,
    pub page: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub pages: Vec<Option<PhysHandle>>,
    /// Per page, the `State::free_seq` of the last free of a block on it (0: none since
    /// mapping): its last use on the device came before that free.
    pub last_free: Vec<u64>,
    /// Frees since the last one that asked for a fence.
    pub frees_since_fence: u32,
    /// The mapped pages' indices, to find mapped runs without walking the whole table
    /// (kept by `set_page` and `take_page` alone).
    pub mapped_set: BTreeSet<usize>,
}

impl PagedSegment {
    /// Pages that `[addr, addr+len)` touches.
    fn touched(&self, addr: DevicePtr, len: u64) -> Range<usize> {
        let start = (addr - self.base) / self.page;
        let end = (addr + len - self.base).div_ceil(self.page);
        start as usize..end as usize
    }

    /// Pages lying wholly inside `[addr, addr+len)`.
    fn inside(&self, addr: DevicePtr, len: u64) -> Range<usize> {
        let start = (addr - self.base).div_ceil(self.page);
        let end = (addr + len - self.base) / self.page;
        start as usize..(end as usize).max(start as usize)
    }

    /// Bytes of `[addr, addr+len)` that lie on mapped pages.
    pub fn mapped_bytes_in(&self, addr: DevicePtr, len: u64) -> u64 {
        self.touched(addr, len)
            .filter(|&i| self.pages[i].is_some())
            .map(|i| {
                let (start, end) = (self.va(i), self.va(i) + self.page);
                end.min(addr + len) - start.max(addr)
            })
            .sum()
    }

    /// How many pages `[addr, addr+len)` touches that are not mapped.
    pub fn unmapped_pages(&self, addr: DevicePtr, len: u64) -> usize {
        let touched = self.touched(addr, len);
        if touched.len() <= 64 {
            // The hand-out fast path: a look at the table beats a walk of the set.
            return touched.filter(|&i| self.pages[i].is_none()).count();
        }
        touched.len() - self.mapped_set.range(touched).count()
    }

    /// Where in the free block `[start, end)` a block of `len` bytes needs the fewest new
    /// pages: (pages missing, address). Some best place starts at the block's start or end,
    /// or at the start of a run of mapped pages (sliding a window onto a run start never
    /// loses a mapped page), so only those are tried, the first `MAX_RUNS` runs at most.
    pub fn best_place(&self, start: DevicePtr, end: DevicePtr, len: u64) -> (usize, DevicePtr) {
        const MAX_RUNS: usize = 64;
        let mut best = (self.unmapped_pages(start, len), start);
        if best.0 == 0 || end - start == len {
            return best;
        }
        let consider = |best: &mut (usize, DevicePtr), at: DevicePtr| {
            let missing = self.unmapped_pages(at, len);
            if missing < best.0 {
                *best = (missing, at);
            }
        };
        consider(&mut best, end - len);
        let mut runs = 0;
        let mut previous: Option<usize> = None;
        for &i in self.mapped_set.range(self.touched(start, end - start)) {
            let run_start = previous != Some(i.wrapping_sub(1));
            previous = Some(i);
            let at = self.va(i);
            if !run_start || at <= start {
                continue;
            }
            if at + len > end || runs == MAX_RUNS || best.0 == 0 {
                break;
            }
            runs += 1;
            consider(&mut best, at);
        }
        best
    }

    /// A block `[addr, addr+len)` was freed at `seq`. Returns whether this free should record
    /// a fence: the first, then every `FREES_PER_FENCE`-th.
    pub fn note_free(&mut self, addr: DevicePtr, len: u64, seq: u64) -> bool {
        for i in self.touched(addr, len) {
            self.last_free[i] = seq;
        }
        let due = self.frees_since_fence.is_multiple_of(FREES_PER_FENCE);
        self.frees_since_fence = self.frees_since_fence.wrapping_add(1);
        due
    }

    /// Page `i` is now mapped to `handle`.
    pub fn set_page(&mut self, i: usize, handle: PhysHandle) {
        self.pages[i] = Some(handle);
        self.mapped_set.insert(i);
    }

    /// Page `i` is no longer mapped: its handle.
    pub fn take_page(&mut self, i: usize) -> PhysHandle {
        self.mapped_set.remove(&i);
        self.pages[i].take().expect("the page is mapped")
    }

    fn va(&self, page: usize) -> DevicePtr {
        self.base + page as u64 * self.page
    }
}

/// A mapped page wholly under a free block: a candidate to unmap.
struct Victim {
    segment: DevicePtr,
    page: usize,
    /// The segment's stream, and the last free on the page (see `PagedSegment::last_free`).
    stream: StreamId,
    last_free: u64,
}

impl DeviceAllocator {
    /// The page size when requests of this kind use paged segments.
    pub(super) fn paging(&self, st: &State, private: bool) -> Option<u64> {
        if private || !st.config.expandable_segments {
            return None;
        }
        self.driver.vmm_granularity(self.device)
    }

    /// Creates the paged segment of (stream, pool): address space the size of the device,
    /// cached as one free block with nothing mapped. False when no address space is left.
    pub(super) fn add_paged_segment(
        &self,
        st: &mut State,
        stream: StreamId,
        pool: PoolKind,
        page: u64,
    ) -> Result<bool> {
        let size = self.total_memory.div_ceil(page) * page;
        let base = match self.driver.reserve_address(self.device, size) {
            Ok(base) => base,
            Err(e) => {
                tracing::warn!(
                    device = self.device,
                    "address reservation failed ({e}); using plain segments"
                );
                return Ok(false);
            }
        };
        let cached_at = st.caches.list(None, pool).lookups;
        let id = st.blocks.insert(Block {
            addr: base,
            size,
            requested: 0,
            stream,
            pool,
            owner: None,
            paged: true,
            counted_oversize: false,
            prev: None,
            next: None,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            cached_at,
        });
        st.caches.list(None, pool).insert(st.blocks.get(id), id);
        st.segments.insert(
            base,
            Segment {
                size,
                first: id,
                oversize: false,
            },
        );
        let count = (size / page) as usize;
        let (pages, last_free) = (vec![None; count], vec![0; count]);
        st.paged.insert(
            base,
            PagedSegment {
                base,
                size,
                page,
                stream,
                pool,
                pages,
                last_free,
                frees_since_fence: 0,
                mapped_set: BTreeSet::new(),
            },
        );
        st.paged_for.insert((stream, pool));
        st.stats.segment.increase(pool, 1);
        Ok(true)
    }

    /// Maps every page `[addr, addr+len)` touches. Physical memory comes from new pages
    /// while reserved stays within live + slack, else from pages under free blocks. Returns
    /// false when the device (or the memory limit) cannot supply the pages.
    /// `rest` is the part of the block being handed out that stays free: its pages are the
    /// first to move (they are in no free list yet).
    pub(super) fn map_pages(
        &self,
        st: &mut State,
        stream: StreamId,
        addr: DevicePtr,
        len: u64,
        rest: Range<DevicePtr>,
    ) -> Result<bool> {
        let (base, seg) = st.paged_segment(addr);
        let page = seg.page;
        let missing: Vec<usize> = seg
            .touched(addr, len)
            .filter(|&i| seg.pages[i].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(true);
        }
        let need = missing.len() as u64;
        // Every page mapped here counts as reserved; parked pages already do.
        let live_after = st.stats.active_bytes.all().current as u64 + len;
        st.live_high_water = st.live_high_water.max(live_after);
        let high = st.live_high_water;
        let slack = ((high as f64 * st.config.page_slack) as u64).max(MIN_SLACK_PAGES * page);
        let budget = (high + slack).min(self.hard_limit(st));
        let mut handles = self.unpark(st, need as usize, page);
        let gathered = self.gather_pages(st, stream, &mut handles, need, page, budget, slack, rest);
        // Later growth may need the pages freed until now: a fence lets it know when the
        // device is past them, instead of waiting.
        self.record_fence(st, stream);
        if let Err(e) = gathered {
            // Pages in hand stay ccalloc's (and reserved): parked for the next request.
            for handle in handles {
                self.park(st, handle, page);
            }
            return Err(e);
        }
        // Refused: give back what was gathered, leaving reserved no higher than before.
        let refused = handles.len() < need as usize;
        let surplus = if refused {
            handles.len()
        } else {
            handles.len() - need as usize
        };
        for handle in handles.drain(handles.len() - surplus..) {
            self.release_page(st, handle, page)?;
        }
        if refused {
            return Ok(false);
        }
        let mut done = 0;
        let mapped = self.map_run(st, base, &missing, &handles, &mut done);
        if let Err(e) = mapped {
            // Undo this request's mappings so nothing it touched stays reserved.
            for &i in &missing[..done] {
                self.unmap_page(st, base, i)?;
            }
            for &h in &handles {
                let _ = self.release_page(st, h, page);
            }
            return Err(e);
        }
        Ok(true)
    }

    /// Tops `handles` up to `need` pages. Growth past the budget is paid for with pages from
    /// under free blocks (never more than this request maps: shrinking is left to
    /// empty_cache and the OOM path); a wait for the device buys a batch of `slack` pages,
    /// parked for the next requests. While a CUDA graph is being captured nothing may wait or
    /// move: only parked and new pages are used.
    #[allow(clippy::too_many_arguments)]
    fn gather_pages(
        &self,
        st: &mut State,
        stream: StreamId,
        handles: &mut Vec<PhysHandle>,
        need: u64,
        page: u64,
        budget: u64,
        slack: u64,
        rest: Range<DevicePtr>,
    ) -> Result<()> {
        let capturing = st.caches.capturing();
        let reserved_after = st.reserved() + need * page;
        let over = reserved_after
            .saturating_sub(budget)
            .div_ceil(page)
            .min(need - handles.len() as u64);
        if over > 0 && !capturing {
            let batch = (slack / page) as usize;
            let mut taken = self.reclaim(st, over as usize, batch, rest.clone(), Some(stream))?;
            let extra = taken.len().saturating_sub(over as usize);
            for handle in taken.drain(taken.len() - extra..) {
                self.park(st, handle, page);
            }
            handles.extend(taken);
        }
        self.add_new_pages(st, handles, need as usize, page)?;
        if handles.len() < need as usize && !capturing {
            // Out of memory: take every reclaimable page, then the plain cache too.
            let all = self.reclaim(st, usize::MAX, 0, rest, Some(stream))?;
            handles.extend(all);
            if handles.len() < need as usize {
                self.release_all_cached(st)?;
                st.stats.num_alloc_retries += 1;
                self.add_new_pages(st, handles, need as usize, page)?;
            }
        }
        Ok(())
    }

    /// Maps `handles` at the `missing` pages, then grants access one contiguous run at a time.
    /// `done` counts the pages mapped, for the caller's rollback.
    fn map_run(
        &self,
        st: &mut State,
        base: DevicePtr,
        missing: &[usize],
        handles: &[PhysHandle],
        done: &mut usize,
    ) -> Result<()> {
        let seg = st.paged.get_mut(&base).expect("segment exists");
        let page = seg.page;
        for (&i, &handle) in missing.iter().zip(handles) {
            self.driver
                .map(self.device, seg.va(i), page, handle)
                .map_err(|e| driver_error(self.device, e))?;
            seg.set_page(i, handle);
            st.stats.reserved_bytes.increase(seg.pool, page);
            *done += 1;
        }
        let mut run_start = 0;
        for k in 1..=missing.len() {
            if k == missing.len() || missing[k] != missing[k - 1] + 1 {
                let (first, pages) = (missing[run_start], (k - run_start) as u64);
                self.driver
                    .set_access(self.device, seg.va(first), pages * page)
                    .map_err(|e| driver_error(self.device, e))?;
                run_start = k;
            }
        }
        Ok(())
    }

    /// Tops `handles` up to `need` with fresh pages while the device and limit allow.
    fn add_new_pages(
        &self,
        st: &mut State,
        handles: &mut Vec<PhysHandle>,
        need: usize,
        page: u64,
    ) -> Result<()> {
        while handles.len() < need {
            // Pages in hand are not mapped yet, but count against the limit all the same.
            let in_hand = handles.len() as u64 * page;
            match self.new_page(st, page, in_hand)? {
                Some(h) => handles.push(h),
                None => break,
            }
        }
        Ok(())
    }

    /// Keeps an unmapped page for later growth (it stays reserved).
    fn park(&self, st: &mut State, handle: PhysHandle, page: u64) {
        st.idle_pages.push(handle);
        st.stats.reserved_bytes.increase(PoolKind::Large, page);
    }

    /// Takes up to `want` parked pages (no longer counted until mapped).
    fn unpark(&self, st: &mut State, want: usize, page: u64) -> Vec<PhysHandle> {
        let n = want.min(st.idle_pages.len());
        let at = st.idle_pages.len() - n;
        let handles: Vec<PhysHandle> = st.idle_pages.drain(at..).collect();
        st.stats
            .reserved_bytes
            .decrease(PoolKind::Large, n as u64 * page);
        handles
    }

    /// Unmaps one page of a paged segment and returns its handle (no longer reserved).
    fn unmap_page(&self, st: &mut State, base: DevicePtr, i: usize) -> Result<PhysHandle> {
        let seg = st.paged.get_mut(&base).expect("segment exists");
        self.driver
            .unmap(self.device, seg.va(i), seg.page)
            .map_err(|e| driver_error(self.device, e))?;
        let handle = seg.take_page(i);
        let (pool, page) = (seg.pool, seg.page);
        st.stats.reserved_bytes.decrease(pool, page);
        Ok(handle)
    }

    pub(super) fn hard_limit(&self, st: &State) -> u64 {
        st.limit.min(self.total_memory)
    }

    /// A fresh physical page, counted as reserved by no pool until mapped; `None` when the
    /// device or the limit refuses.
    fn new_page(&self, st: &mut State, page: u64, in_hand: u64) -> Result<Option<PhysHandle>> {
        if st.reserved() + in_hand + page > self.hard_limit(st) {
            return Ok(None);
        }
        match self.driver.create_physical(self.device, page) {
            Ok(handle) => {
                st.stats.num_device_alloc += 1;
                Ok(Some(handle))
            }
            Err(crate::driver::DriverError::OutOfMemory) => Ok(None),
            Err(e) => Err(driver_error(self.device, e)),
        }
    }

    fn release_page(&self, st: &mut State, handle: PhysHandle, page: u64) -> Result<()> {
        st.stats.num_device_free += 1;
        self.driver
            .release_physical(self.device, handle, page)
            .map_err(|e| driver_error(self.device, e))
    }

    /// Unmaps up to `want` mapped pages lying wholly under free blocks. Kernels queued before
    /// a block's free may still use its pages, so pages the device is known to be done with
    /// (see `Fence`) go first; for the rest the host waits on the oldest fence that covers
    /// them, which leaves the device the work queued since. Among equals, victims come from
    /// the largest free blocks, highest addresses first: blocks are carved from the low end
    /// of a free block, so its high pages are the least likely to be needed again soon.
    /// With `batch` > 0, up to that many more pages that need no further wait are taken.
    /// `caller`: the stream of the malloc asking (alive, so a fence may be recorded on it);
    /// `None` when the caller has synchronized the device.
    pub(super) fn reclaim(
        &self,
        st: &mut State,
        want: usize,
        batch: usize,
        also: Range<DevicePtr>,
        caller: Option<StreamId>,
    ) -> Result<Vec<PhysHandle>> {
        let candidates = reclaim_candidates(st, also);
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let limit = want.saturating_add(batch);
        let all_done = match caller {
            None => true,
            // Everything is wanted (the OOM path): one wait for the whole device.
            Some(_) if want == usize::MAX => {
                self.sync_device(st)?;
                true
            }
            Some(_) => {
                self.poll_fences(st, None)?;
                false
            }
        };
        let (mut victims, mut pending): (Vec<Victim>, Vec<Victim>) = candidates
            .into_iter()
            .partition(|v| all_done || st.free_is_done(v.stream, v.last_free));
        victims.truncate(limit);
        if let (true, Some(caller)) = (victims.len() < want && !pending.is_empty(), caller) {
            // The oldest frees first: the device is likeliest to be past them.
            pending.sort_by_key(|v| v.last_free);
            let short = (want - victims.len()).min(pending.len());
            let mut newest: Vec<(StreamId, u64)> = Vec::new();
            for v in &pending[..short] {
                match newest.iter_mut().find(|(s, _)| *s == v.stream) {
                    Some((_, seq)) => *seq = (*seq).max(v.last_free),
                    None => newest.push((v.stream, v.last_free)),
                }
            }
            for (stream, seq) in newest {
                self.wait_for_free(st, stream, seq, caller)?;
            }
            let room = limit - victims.len();
            victims.extend(
                pending
                    .into_iter()
                    .filter(|v| st.free_is_done(v.stream, v.last_free))
                    .take(room),
            );
        }
        let mut handles = Vec::with_capacity(victims.len());
        for v in victims {
            match self.unmap_page(st, v.segment, v.page) {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    // Keep what was already unmapped (reserved, parked) rather than lose it.
                    let page = st.paged[&v.segment].page;
                    for handle in handles {
                        self.park(st, handle, page);
                    }
                    return Err(e);
                }
            }
        }
        Ok(handles)
    }

    /// Records a fence on `stream` (alive: the caller allocates on it, or has just freed a
    /// block of it, as PyTorch does) unless one already covers every
    /// free so far, too many are pending, or a graph is being captured.
    pub(super) fn record_fence(&self, st: &mut State, stream: StreamId) {
        if st.caches.capturing() || st.free_is_done(stream, st.free_seq) {
            return;
        }
        if st
            .fences
            .iter()
            .any(|f| f.stream == stream && f.seq >= st.free_seq)
        {
            return;
        }
        // Retire the stream's completed fences: otherwise they are noticed only when pages
        // move, and a long run without moves would fill the queue and stop fencing. (A
        // failed query only leaves them queued.)
        let _ = self.poll_fences(st, Some(stream));
        let pending = st.fences.iter().filter(|f| f.stream == stream).count();
        if pending >= MAX_FENCES_PER_STREAM || st.free_is_done(stream, st.free_seq) {
            return;
        }
        match self.driver.record_event(self.device, stream) {
            Ok(event) => st.fences.push_back(Fence {
                stream,
                seq: st.free_seq,
                event,
            }),
            // Only an optimisation: without fences, growth waits instead.
            Err(e) => tracing::debug!(device = self.device, "fence not recorded: {e}"),
        }
    }

    /// Notes the fences that have completed, of `only` that stream or of all (a stream's
    /// complete in order, so each is queried only up to its first pending one).
    fn poll_fences(&self, st: &mut State, only: Option<StreamId>) -> Result<()> {
        let mut blocked: Vec<StreamId> = Vec::new();
        let mut i = 0;
        while i < st.fences.len() {
            let stream = st.fences[i].stream;
            if only.is_some_and(|s| s != stream) {
                i += 1;
                continue;
            }
            let done = !blocked.contains(&stream)
                && self
                    .driver
                    .event_done(self.device, st.fences[i].event)
                    .map_err(|e| driver_error(self.device, e))?;
            if done {
                let fence = st.fences.remove(i).expect("in range");
                self.retire_fence(st, fence);
            } else {
                blocked.push(stream);
                i += 1;
            }
        }
        Ok(())
    }

    /// After a device synchronize (`sync_device`): every fence has completed.
    pub(super) fn retire_all_fences(&self, st: &mut State) {
        while let Some(fence) = st.fences.pop_front() {
            self.retire_fence(st, fence);
        }
    }

    fn retire_fence(&self, st: &mut State, fence: Fence) {
        let done = st.done_seq.entry(fence.stream).or_insert(0);
        *done = (*done).max(fence.seq);
        self.driver.destroy_event(self.device, fence.event);
    }

    /// Blocks until the device has done `stream`'s work queued before free `seq`: on the
    /// oldest fence covering it; else, on the caller's own stream, on a fence recorded now;
    /// else on the whole device (another stream may have been destroyed since its frees).
    fn wait_for_free(
        &self,
        st: &mut State,
        stream: StreamId,
        seq: u64,
        caller: StreamId,
    ) -> Result<()> {
        if st.free_is_done(stream, seq) {
            return Ok(());
        }
        let covering = st
            .fences
            .iter()
            .position(|f| f.stream == stream && f.seq >= seq);
        let i = match covering {
            Some(i) => i,
            None if stream == caller => match self.driver.record_event(self.device, stream) {
                Ok(event) => {
                    st.fences.push_back(Fence {
                        stream,
                        seq: st.free_seq,
                        event,
                    });
                    st.fences.len() - 1
                }
                Err(e) => {
                    tracing::warn!(
                        device = self.device,
                        "record_event failed ({e}); synchronizing"
                    );
                    return self.sync_device(st);
                }
            },
            None => return self.sync_device(st),
        };
        self.driver
            .wait_event(self.device, st.fences[i].event)
            .map_err(|e| driver_error(self.device, e))?;
        // It and the stream's older fences are done now.
        self.poll_fences(st, Some(stream))
    }

    /// Gives back every page under free blocks and every paged segment left wholly free.
    /// The caller has synchronized the device.
    pub(super) fn release_paged_cache(&self, st: &mut State) -> Result<()> {
        if st.paged.is_empty() {
            return Ok(());
        }
        let page = st.paged.values().next().expect("non-empty").page;
        let parked = st.idle_pages.len();
        for handle in self.unpark(st, parked, page) {
            self.release_page(st, handle, page)?;
        }
        for handle in self.reclaim(st, usize::MAX, 0, 0..0, None)? {
            self.release_page(st, handle, page)?;
        }
        let empty: Vec<DevicePtr> = st
            .paged
            .iter()
            .filter(|(base, seg)| {
                let first = st.segments[base].first;
                let b = st.blocks.get(first);
                seg.mapped_set.is_empty() && b.state == BlockState::Free && b.next.is_none()
            })
            .map(|(&base, _)| base)
            .collect();
        for base in empty {
            let seg = st.paged.remove(&base).expect("listed");
            let segment = st
                .segments
                .remove(&base)
                .expect("paged segments are segments");
            let block = st.blocks.remove(segment.first);
            st.caches.list(None, seg.pool).remove(&block);
            st.paged_for.remove(&(seg.stream, seg.pool));
            st.stats.segment.decrease(seg.pool, 1);
            self.driver
                .free_address(self.device, base, seg.size)
                .map_err(|e| driver_error(self.device, e))?;
        }
        Ok(())
    }
}

/// Mapped pages wholly under free paged blocks, in preference order: `also` (the rest of
/// the block being carved) first, then the largest free blocks, highest pages first.
fn reclaim_candidates(st: &State, also: Range<DevicePtr>) -> Vec<Victim> {
    let mut ranges: Vec<(DevicePtr, u64)> = Vec::new();
    if !also.is_empty() {
        ranges.push((also.start, also.end - also.start));
    }
    for pool in [PoolKind::Large, PoolKind::Small] {
        let list = &st.caches.general[pool as usize];
        let mut free: Vec<_> = list
            .ids()
            .map(|id| st.blocks.get(id))
            .filter(|b| b.paged)
            .map(|b| (b.addr, b.size))
            .collect();
        free.sort_by_key(|&(_, size)| std::cmp::Reverse(size));
        ranges.extend(free);
    }
    let mut candidates = Vec::new();
    for (addr, size) in ranges {
        let (base, seg) = st.paged_segment(addr);
        for i in seg.inside(addr, size).rev() {
            if seg.pages[i].is_some() {
                candidates.push(Victim {
                    segment: base,
                    page: i,
                    stream: seg.stream,
                    last_free: seg.last_free[i],
                });
            }
        }
    }
    candidates
}
