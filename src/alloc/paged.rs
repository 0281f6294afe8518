//! Paged segments: ccalloc's answer to "reserved but unallocated" memory.
//!
//! With the driver's virtual memory management, each (stream, pool) gets one address range
//! as large as the device, carved into blocks like any segment, but backed by physical memory
//! only where blocks need it, one granule (page) at a time. Pages of free blocks stay mapped
//! (so steady-state reuse costs no driver call) until growth would push reserved memory past
//! what is live plus a small slack; then pages under free blocks are unmapped and reused
//! where they are needed, or given back. Reserved memory therefore tracks live memory, while
//! a training loop that repeats its sizes never maps or unmaps after its first iterations.

use super::blocks::{Block, BlockState};
use super::sizing::PoolKind;
use super::state::{Segment, State};
use super::{driver_error, DeviceAllocator};
use crate::driver::{DevicePtr, PhysHandle, StreamId};
use crate::error::Result;
use std::ops::Range;

/// Growth may keep this share of live bytes as cached pages before reclaiming (1/32 ≈ 3%)…
const SLACK_SHIFT: u32 = 5;
/// …but never fewer than this many pages.
const MIN_SLACK_PAGES: u64 = 4;

/// The page table of one paged segment.
pub struct PagedSegment {
    pub base: DevicePtr,
    pub size: u64,
    pub page: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub pages: Vec<Option<PhysHandle>>,
    pub mapped: usize,
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
        self.touched(addr, len)
            .filter(|&i| self.pages[i].is_none())
            .count()
    }

    fn va(&self, page: usize) -> DevicePtr {
        self.base + page as u64 * self.page
    }
}

/// A mapped page under a free block, chosen to be unmapped.
struct Victim {
    segment: DevicePtr,
    page: usize,
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
        let pages = vec![None; (size / page) as usize];
        st.paged.insert(
            base,
            PagedSegment {
                base,
                size,
                page,
                stream,
                pool,
                pages,
                mapped: 0,
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
        let slack = (live_after >> SLACK_SHIFT).max(MIN_SLACK_PAGES * page);
        let budget = (live_after + slack).min(self.hard_limit(st));
        let mut handles = self.unpark(st, need as usize, page);
        let gathered = self.gather_pages(st, &mut handles, need, page, budget, slack, rest);
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
            let mut taken = self.reclaim(st, over as usize, batch, rest.clone())?;
            let extra = taken.len().saturating_sub(over as usize);
            for handle in taken.drain(taken.len() - extra..) {
                self.park(st, handle, page);
            }
            handles.extend(taken);
        }
        self.add_new_pages(st, handles, need as usize, page)?;
        if handles.len() < need as usize && !capturing {
            // Out of memory: take every reclaimable page, then the plain cache too.
            let all = self.reclaim(st, usize::MAX, 0, rest)?;
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
            seg.pages[i] = Some(handle);
            seg.mapped += 1;
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
        let handle = seg.pages[i].take().expect("the page is mapped");
        seg.mapped -= 1;
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

    /// Unmaps up to `want` mapped pages lying wholly under free blocks, after their streams
    /// have finished the work queued before the frees. Victims come from the largest free
    /// blocks, highest addresses first: blocks are carved from the low end of a free block,
    /// so its high pages are the ones least likely to be needed again soon.
    /// With `batch` > 0, up to that many more pages are taken, since the wait is paid anyway.
    pub(super) fn reclaim(
        &self,
        st: &mut State,
        want: usize,
        batch: usize,
        also: Range<DevicePtr>,
    ) -> Result<Vec<PhysHandle>> {
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
        let mut victims = Vec::new();
        'ranges: for (addr, size) in ranges {
            let (base, seg) = st.paged_segment(addr);
            for i in seg.inside(addr, size).rev() {
                if seg.pages[i].is_some() {
                    victims.push(Victim {
                        segment: base,
                        page: i,
                    });
                    if victims.len() >= want.saturating_add(batch) {
                        break 'ranges;
                    }
                }
            }
        }
        // Kernels queued before the frees may still use these pages, so the device finishes
        // its work first. Not the freeing streams alone: a stream may be destroyed once its
        // blocks are freed, and waiting on it then would crash. The wait is why a batch is
        // taken: the pages beyond `want` are parked for the next growth.
        if !victims.is_empty() {
            self.sync_device()?;
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
        for handle in self.reclaim(st, usize::MAX, 0, 0..0)? {
            self.release_page(st, handle, page)?;
        }
        let empty: Vec<DevicePtr> = st
            .paged
            .iter()
            .filter(|(base, seg)| {
                let first = st.segments[base].first;
                let b = st.blocks.get(first);
                seg.mapped == 0 && b.state == BlockState::Free && b.next.is_none()
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
