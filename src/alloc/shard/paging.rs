//! The driver I/O of paged segments: creating their address ranges, mapping and unmapping
//! chunks, and releasing them, as `paging`'s page table, plan and budget decide.

use super::super::paging::budget::slack_bytes;
use super::super::paging::plan::{runs_of, take_until, Plan, Victim};
use super::super::paging::table::{pages_of, Spare};
use super::super::sizing::PoolKind;
use super::super::state::State;
use super::super::{driver_error, Shard};
use crate::driver::{DevicePtr, EventId, PhysHandle, StreamId};
use crate::error::Result;
use std::ops::Range;
use std::time::Instant;

/// Host cost of the driver calls a move makes or saves, in µs, per call on an H100 (2 MiB
/// pages, chunks of up to 16 pages; `benches/gpu/vmm_cost.cu`, docs/paging.md): map and
/// grant access, release, create.
const GRANT_US: usize = 38;
const RELEASE_US: usize = 12;
const CREATE_US: usize = 14;

/// Whether releasing `count` moved chunks of `pages` pages in all and making those pages
/// anew in chunks of `fresh` pages costs fewer µs than mapping the chunks again.
fn replacing_is_cheaper(count: usize, pages: usize, fresh: usize) -> bool {
    let anew = count * RELEASE_US + pages.div_ceil(fresh.max(1)) * (CREATE_US + GRANT_US);
    count > 0 && anew < count * GRANT_US
}

/// What `Shard::reclaim` does about chunks whose frees the device may not be past yet.
#[derive(Clone, Copy, Debug)]
pub(in crate::alloc) enum Pending {
    /// Waits for them as needed, recording fences on this stream (the asking malloc's,
    /// so alive).
    WaitOn(StreamId),
    /// There are none: the caller has synchronized the device.
    Synced,
}

impl Shard {
    /// The page size when requests of this kind use paged segments.
    pub(in crate::alloc) fn paging(&self, st: &State, private: bool) -> Option<u64> {
        if private || !st.config().expandable_segments {
            return None;
        }
        self.driver.vmm_granularity(self.device)
    }

    /// Creates a paged segment of (stream, pool): address space the size of the device,
    /// cached as one free block with nothing mapped. Its base; `None` when no address space
    /// is left.
    pub(in crate::alloc) fn add_paged_segment(
        &self,
        st: &mut State,
        stream: StreamId,
        pool: PoolKind,
        page: u64,
    ) -> Result<Option<DevicePtr>> {
        let size = self.total_memory.div_ceil(page) * page;
        let base = match self.driver.reserve_address(self.device, size) {
            Ok(base) => base,
            Err(e) => {
                tracing::warn!(
                    device = self.device,
                    "address reservation failed ({e}); using plain segments"
                );
                return Ok(None);
            }
        };
        st.add_paged_segment(base, size, page, stream, pool);
        Ok(Some(base))
    }

    /// Gives back the address range of the paged segment at `base` if nothing is mapped in
    /// it and its one block is free: a segment added for a request that then failed holds
    /// no memory, and kept, it would show as a segment (and stay reserved address space)
    /// because of an OOM. Should the driver refuse, the segment stays (empty, cached) for
    /// the next empty_cache.
    pub(in crate::alloc) fn drop_if_empty(&self, st: &mut State, base: DevicePtr) {
        if let Some(size) = st.empty_paged_size(base) {
            let _ = self.release_empty_paged(st, base, size);
        }
    }

    /// Gives back the address range of the empty paged segment `[base, base+size)` and
    /// forgets the segment. The range goes first: should the driver refuse, the segment
    /// stays (empty, cached) and the next empty_cache tries again.
    fn release_empty_paged(&self, st: &mut State, base: DevicePtr, size: u64) -> Result<()> {
        self.driver
            .free_address(self.device, base, size)
            .map_err(|e| driver_error(self.device, e))?;
        st.remove_paged_segment(base);
        Ok(())
    }

    /// Maps every page `[addr, addr+len)` touches. Physical memory comes from new chunks
    /// while reserved stays within live + slack, else from chunks under free blocks. Returns
    /// false when the device (or the memory limit) cannot supply the pages.
    /// `rest` is the part of the block being handed out that stays free: its chunks are the
    /// first to move (they are in no free list yet).
    pub(in crate::alloc) fn map_pages(
        &self,
        st: &mut State,
        stream: StreamId,
        addr: DevicePtr,
        len: u64,
        rest: Range<DevicePtr>,
    ) -> Result<bool> {
        let (base, seg) = st.paged_segment(addr);
        let page = seg.page;
        if seg.all_mapped(addr, len) {
            return Ok(true);
        }
        // Parked (and held) blocks' pages become reclaimable (and the OOM path sees them
        // merged).
        self.merge_set_aside(st);
        let seg = st.paged_at(base);
        let missing: Vec<usize> = seg
            .touched(addr, len)
            .filter(|&i| !seg.is_mapped(i))
            .collect();
        if missing.is_empty() {
            return Ok(true);
        }
        // Every page mapped here counts as reserved; parked chunks already do.
        let (high, elsewhere) = self.weighed_high_water(st, len)?;
        let slack = slack_bytes(high, st.config().page_slack, page, self.shards_made());
        let started = Instant::now();
        st.moves_mut().start_growth();
        // While moves have spent their allowance, growth maps new memory rather than move
        // pages within the slack: reserved rises by this growth alone (`MoveClock`).
        let may_move = self.may_move(st, started);
        // Probed whether moves may or not: a job refused them early may be the warm-up the
        // credit is for.
        let growth = Growth {
            started,
            busy_probe: self.busy_probe(st, stream),
        };
        // The bound is on memory that moves can act on. Free memory in plain segments (a
        // CUDA graph pool's, kept for its replays) stays reserved whatever pages move:
        // counted against the bound, it would hold the paged memory under its own live
        // high-water mark once it exceeds the slack, and every later growth would move
        // pages, each cycle undoing the last.
        let soft = if may_move {
            high + slack + st.plain_free_bytes()
        } else {
            st.stats_mut().paging.growths_past_slack += 1;
            st.moves_mut().note_refused();
            u64::MAX
        };
        let mut budget = soft.min(self.hard_limit(st)).saturating_sub(elsewhere);
        let mut plan = Plan::new(&missing, (slack / page) as usize);
        let mut spares = self.unpark_all(st, page);
        let gathered = self.gather(
            st,
            stream,
            &mut plan,
            &mut spares,
            page,
            &mut budget,
            slack,
            rest,
        );
        // Later growth may need the chunks freed until now: a fence lets it know when the
        // device is past them, instead of waiting.
        self.record_fence(st, stream);
        let in_hand: Vec<Spare> = plan.placed.iter().map(|&(_, s)| s).collect();
        if let Err(e) = gathered {
            // Memory in hand stays ccalloc's (and reserved): parked for the next request.
            for spare in in_hand.into_iter().chain(spares) {
                self.park(st, spare, page);
            }
            self.account_growth(st, growth);
            return Err(e);
        }
        let refused = plan.unfilled() > 0;
        if refused {
            // Give back what was gathered, leaving reserved no higher than before.
            spares.extend(in_hand);
        }
        // Spares that fit nowhere: kept for later growth while the budget allows.
        let mut released = Ok(());
        for spare in spares {
            let room = st.reserved() + (plan.placed_pages() + spare.pages) as u64 * page;
            if !refused && room <= budget {
                self.park(st, spare, page);
            } else {
                released = released.and(self.release_chunk(st, spare, page));
            }
        }
        if refused || released.is_err() {
            // A growth too, if a failed one: its time (and waits) was spent all the same.
            self.account_growth(st, growth);
            released?;
            return Ok(false);
        }
        plan.placed.sort_by_key(|&(first, _)| first);
        let mut done = 0;
        let mapped = self.map_plan(st, base, &plan.placed, &missing, &mut done);
        self.account_growth(st, growth);
        if let Err(e) = mapped {
            // Undo this request's mappings so nothing it touched stays reserved. (A chunk
            // that will not unmap stays mapped under the free block: reserved, reclaimable.
            // One that will not release is parked.)
            for &(first, _) in &plan.placed[..done] {
                if let Ok(spare) = self.unmap_chunk(st, base, first) {
                    let _ = self.release_chunk(st, spare, page);
                }
            }
            let unmapped = plan.placed[done..].iter().map(|&(_, s)| s);
            let _ = self.release_chunks(st, unmapped, page);
            return Err(e);
        }
        // Where refused moves leave reserved memory above the bound (a debug log, for finding
        // which growths set a peak); a growth that could move reads nothing for it.
        if !may_move {
            let reserved = st.device_reserved().unwrap_or(0);
            if reserved > high + slack {
                tracing::debug!(
                    device = self.device,
                    "growth refused its moves: {} reserved against a live high-water mark of {} and a slack of {}",
                    crate::human_bytes(reserved),
                    crate::human_bytes(high),
                    crate::human_bytes(slack),
                );
            }
        }
        Ok(true)
    }

    /// Counts one growth (`PagingCounters`) that started at `started` (gathering, waiting,
    /// mapping), failed ones included. On a GPU its time also feeds the move clock
    /// (`MoveClock::account`): a workload whose page moves cost more than `page_move_budget`
    /// gets a larger cache instead, while one that moves little keeps reserved ≈ live.
    fn account_growth(&self, st: &mut State, growth: Growth) {
        let Growth {
            started,
            busy_probe,
        } = growth;
        let now = Instant::now();
        let took = now - started;
        // The device still had work from before the growth began: it never ran dry, so the
        // moves delayed nothing (see `MoveClock`). A failed query counts as dry.
        let busy = busy_probe.is_some_and(|event| {
            let done = self.driver.event_done(self.device, event).unwrap_or(true);
            self.driver.destroy_event(self.device, event);
            !done
        });
        let moved = st.moves().moved();
        let paging = &mut st.stats_mut().paging;
        paging.growths += 1;
        paging.growth_ns += took.as_nanos() as u64;
        if moved {
            paging.moving_growths += 1;
            paging.moving_ns += took.as_nanos() as u64;
        }
        // The sim's clock says nothing about a GPU's: replays stay the same every time.
        if !self.times_page_moves {
            return;
        }
        let budget = st.config().page_move_budget;
        if let Some(cost) = st.moves_mut().account(started, now, budget, busy) {
            tracing::info!(
                device = self.device,
                "page moves have taken {:.1}% of the time (the last: {:.1} ms): growth maps new memory until moving fits the budget again",
                budget * 100.0,
                cost.as_secs_f64() * 1e3,
            );
        }
    }

    /// An event recorded on `stream` as a growth begins, when page moves are timed against
    /// a budget: should it still be pending when the growth ends, the device was busy with
    /// earlier work all along (`account_growth`). None while a capture is open (a record
    /// would join the graph) or when the record fails.
    fn busy_probe(&self, st: &State, stream: StreamId) -> Option<EventId> {
        if !self.times_page_moves || st.config().page_move_budget == 0.0 || st.capturing() {
            return None;
        }
        self.driver.record_event(self.device, stream).ok()
    }

    /// Whether a growth starting at `now` may move pages: never with `page_moves:False`;
    /// always on the sim without GPU costs (replays do not time moves); else while moves
    /// are within their allowance.
    fn may_move(&self, st: &mut State, now: Instant) -> bool {
        let budget = st.config().page_move_budget;
        st.config().page_moves && (!self.times_page_moves || st.moves_mut().may_move(now, budget))
    }

    /// Fills `plan` with memory: parked chunks that fit, then new chunks while reserved
    /// stays within `budget`; past it, growth is paid for with chunks from under free blocks
    /// (never much more than this request maps: shrinking is left to empty_cache and the OOM
    /// path), this shard's first, then the other shards' idle memory (`lending`; `budget`
    /// then grows by what they gave up). A wait for the device buys a batch of `slack` more,
    /// parked for the next requests. While a CUDA graph is being captured nothing may wait
    /// or move: only parked and new chunks are used. `spares` ends with the memory in hand
    /// that fit nowhere.
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        st: &mut State,
        stream: StreamId,
        plan: &mut Plan,
        spares: &mut Vec<Spare>,
        page: u64,
        budget: &mut u64,
        slack: u64,
        rest: Range<DevicePtr>,
    ) -> Result<()> {
        let capturing = st.capturing();
        plan.fill(spares);
        let in_hand = |plan: &Plan, spares: &[Spare]| plan.placed_pages() + pages_of(spares);
        // Pages past the budget were everything in hand mapped and the rest made new.
        let over_budget = |st: &State, plan: &Plan, spares: &[Spare], budget: u64| {
            let after = st.reserved() + (in_hand(plan, spares) + plan.unfilled()) as u64 * page;
            after.saturating_sub(budget).div_ceil(page) as usize
        };
        // Parked chunks that fit nowhere are the first memory to give up.
        self.release_smallest(st, spares, over_budget(st, plan, spares, *budget), page)?;
        let over = over_budget(st, plan, spares, *budget).min(plan.unfilled()) as u64;
        if over > 0 && !capturing {
            let batch = (slack / page) as usize;
            let mut moved = self.move_pages(st, plan, over as usize, batch, &rest, stream)?;
            let holding = in_hand(plan, spares) + pages_of(&moved);
            // New chunks must be within the limit (lowered at run time, the chunks in hand
            // may exceed it): mapping what is in hand needs no new memory.
            let within_limit =
                st.reserved() + (holding + plan.unfilled()) as u64 * page <= self.hard_limit(st);
            let released = match within_limit {
                true => self.release_chunks_cheaper_made_anew(st, plan, &mut moved, page),
                false => Ok(()),
            };
            // The rest are in hand whatever a release did (one that failed was parked).
            spares.extend(moved);
            plan.fill(spares);
            released?;
            // What fits nowhere goes back to the device before new memory is made.
            let surplus = pages_of(spares).saturating_sub(batch);
            self.release_smallest(st, spares, surplus, page)?;
            let short = over_budget(st, plan, spares, *budget).min(plan.unfilled());
            if short > 0 {
                let borrowed = self.borrow_idle(st, stream, short, plan.largest_gap(), page);
                if !borrowed.is_empty() {
                    // Reserved elsewhere fell by what was lent.
                    *budget += pages_of(&borrowed) as u64 * page;
                    spares.extend(borrowed);
                    plan.fill(spares);
                }
            }
        }
        self.add_new_chunks(st, plan, page)?;
        if plan.unfilled() > 0 && !capturing && st.moves().refused() {
            // Moves were refused to save time, but the device has no new memory: move what
            // the request lacks, as within the allowance (chunks that fit nowhere go back
            // to make room for ones that do), before the OOM path below takes every
            // reclaimable chunk and gives back what it does not need.
            let lacking = plan.unfilled();
            spares.extend(self.move_pages(st, plan, lacking, 0, &rest, stream)?);
            plan.fill(spares);
            if plan.unfilled() > 0 {
                let lacking = plan.unfilled();
                self.release_smallest(st, spares, lacking, page)?;
                self.add_new_chunks(st, plan, page)?;
            }
        }
        if plan.unfilled() > 0 && !capturing {
            // Out of memory: take every reclaimable chunk, then the plain cache too.
            let all = self.reclaim(st, usize::MAX, 0, usize::MAX, rest, Pending::WaitOn(stream))?;
            spares.extend(all);
            plan.fill(spares);
            self.release_chunks(st, spares.drain(..), page)?;
            self.add_new_chunks(st, plan, page)?;
            if plan.unfilled() > 0 {
                self.release_all_cached(st)?;
                st.count_alloc_retry();
                self.add_new_chunks(st, plan, page)?;
            }
        }
        Ok(())
    }

    /// Unmaps `want` pages (and `batch` more, to park) from under free blocks, chunks that
    /// fit `plan`'s largest gap first, for the caller to place.
    fn move_pages(
        &self,
        st: &mut State,
        plan: &Plan,
        want: usize,
        batch: usize,
        rest: &Range<DevicePtr>,
        stream: StreamId,
    ) -> Result<Vec<Spare>> {
        let fit = plan.largest_gap();
        self.reclaim(st, want, batch, fit, rest.clone(), Pending::WaitOn(stream))
    }

    /// Releases the chunks a move took that cost more to map again than to replace: those
    /// smaller than the chunks growth makes for the largest gap (`chunk_pages_for`, which
    /// in a large job may exceed a small gap: `add_new_chunks` then makes gap-sized ones, so
    /// the estimate below counts fewer creates than are made), when
    /// making their pages anew in such chunks (`add_new_chunks`) takes fewer driver µs. The
    /// driver charges per mapping, not per byte (docs/paging.md): mapping k small chunks
    /// again costs k grants; releasing them costs k releases and a create and grant per new
    /// chunk. When the chunks under free blocks are small (a small footprint with varying
    /// shapes), a move then takes a few calls rather than one per page, and so do later
    /// moves of that memory. The unmap of each moved chunk is paid either way. Small chunks
    /// of the move's batch (pages beyond the request's, parked for later growth) go too
    /// (parked instead, bert's replay reserved 1.037× peak live against 1.030, the other
    /// traces within 0.005).
    fn release_chunks_cheaper_made_anew(
        &self,
        st: &mut State,
        plan: &Plan,
        moved: &mut Vec<Spare>,
        page: u64,
    ) -> Result<()> {
        let fresh = plan.chunk_pages(plan.largest_gap(), st.moves_over_budget());
        let smaller = |s: &Spare| s.pages < fresh;
        let (count, pages) = moved
            .iter()
            .filter(|s| smaller(s))
            .fold((0, 0), |(n, p), s| (n + 1, p + s.pages));
        if !replacing_is_cheaper(count, pages, fresh) {
            return Ok(());
        }
        let small: Vec<Spare>;
        (small, *moved) = moved.drain(..).partition(smaller);
        self.release_chunks(st, small, page)
    }

    /// Releases spares, smallest first, until `pages` pages are gone.
    fn release_smallest(
        &self,
        st: &mut State,
        spares: &mut Vec<Spare>,
        pages: usize,
        page: u64,
    ) -> Result<()> {
        spares.sort_by_key(|s| std::cmp::Reverse(s.pages));
        let mut released = 0;
        while released < pages {
            let Some(spare) = spares.pop() else { break };
            released += spare.pages;
            self.release_chunk(st, spare, page)?;
        }
        Ok(())
    }

    /// Maps the planned chunks, then grants access one contiguous run of `missing` at a time.
    /// `done` counts the chunks mapped, for the caller's rollback.
    fn map_plan(
        &self,
        st: &mut State,
        base: DevicePtr,
        placed: &[(usize, Spare)],
        missing: &[usize],
        done: &mut usize,
    ) -> Result<()> {
        let page = st.paged_at(base).page;
        for &(first, spare) in placed {
            let va = st.paged_at(base).va(first);
            self.driver
                .map(self.device, va, spare.pages as u64 * page, spare.handle)
                .map_err(|e| driver_error(self.device, e))?;
            st.chunk_mapped(base, first, spare);
            *done += 1;
        }
        let seg = st.paged_at(base);
        for run in runs_of(missing) {
            self.driver
                .set_access(self.device, seg.va(run.start), run.len() as u64 * page)
                .map_err(|e| driver_error(self.device, e))?;
        }
        Ok(())
    }

    /// Fills the plan's gaps with new chunks (`chunk_pages_for` each gap) while the device and
    /// the limit allow (pages gathered but not yet mapped count against the limit: see
    /// `driver::layers::limit`). A chunk the device refuses is tried again in halves, down to
    /// one page.
    fn add_new_chunks(&self, st: &mut State, plan: &mut Plan, page: u64) -> Result<()> {
        for gap in 0..plan.gaps.len() {
            let mut size = plan.chunk_pages(plan.gaps[gap].len(), st.moves_over_budget());
            while !plan.gaps[gap].is_empty() {
                let pages = size.min(plan.gaps[gap].len());
                match self.new_chunk(st, pages, page)? {
                    Some(handle) => plan.place(gap, Spare { handle, pages }),
                    None if pages > 1 => size = pages / 2,
                    None => return Ok(()),
                }
            }
        }
        Ok(())
    }

    /// Keeps unmapped memory for later growth (it stays reserved).
    pub(super) fn park(&self, st: &mut State, spare: Spare, page: u64) {
        st.keep_spare(spare, page);
    }

    /// Takes every parked chunk (no longer counted until mapped).
    pub(super) fn unpark_all(&self, st: &mut State, page: u64) -> Vec<Spare> {
        st.take_spares(page)
    }

    /// Unmaps the chunk at page `first` of a paged segment; its memory is no longer reserved.
    fn unmap_chunk(&self, st: &mut State, base: DevicePtr, first: usize) -> Result<Spare> {
        let seg = st.paged_at(base);
        let pages = seg.chunk_pages(first) as u64;
        self.driver
            .unmap(self.device, seg.va(first), pages * seg.page)
            .map_err(|e| driver_error(self.device, e))?;
        Ok(st.chunk_unmapped(base, first))
    }

    pub(in crate::alloc) fn hard_limit(&self, st: &State) -> u64 {
        st.limit().min(self.total_memory)
    }

    /// A fresh physical chunk of `pages` pages, counted as reserved by no pool until mapped;
    /// `None` when the device or the limit refuses.
    fn new_chunk(&self, st: &mut State, pages: usize, page: u64) -> Result<Option<PhysHandle>> {
        let bytes = pages as u64 * page;
        // Pages in hand (gathered, not yet mapped) count against the limit already: the
        // limit layer counts physical memory from its creation to its release.
        match self.driver.create_physical(self.device, bytes) {
            Ok(handle) => {
                st.stats_mut().num_device_alloc += 1;
                Ok(Some(handle))
            }
            Err(e) => self.refused(e),
        }
    }

    /// Gives `spare` back to the device. Should the driver refuse, it is parked instead
    /// (still ccalloc's and reserved; the next empty_cache tries again) and the error
    /// returned.
    fn release_chunk(&self, st: &mut State, spare: Spare, page: u64) -> Result<()> {
        match self
            .driver
            .release_physical(self.device, spare.handle, spare.pages as u64 * page)
        {
            Ok(()) => {
                st.stats_mut().num_device_free += 1;
                Ok(())
            }
            Err(e) => {
                self.park(st, spare, page);
                Err(driver_error(self.device, e))
            }
        }
    }

    /// Releases every spare (see `release_chunk`), going on past failures; returns the
    /// first.
    fn release_chunks(
        &self,
        st: &mut State,
        spares: impl IntoIterator<Item = Spare>,
        page: u64,
    ) -> Result<()> {
        let mut result = Ok(());
        for spare in spares {
            result = result.and(self.release_chunk(st, spare, page));
        }
        result
    }

    /// Unmaps chunks lying wholly under free blocks, about `want` pages' worth. Kernels
    /// queued before a block's free may still use its pages, so chunks the device is known
    /// to be done with (see `Fence`) go first; for the rest the host waits on the oldest
    /// fence that covers them, which leaves the device the work queued since. Among equals,
    /// victims come from the largest free blocks, highest addresses first: blocks are carved
    /// from the low end of a free block, so its high pages are the least likely to be needed
    /// again soon. With `batch` > 0, up to that many more pages that need no further wait are
    /// taken. Chunks of at most `fit` pages go first. `pending` says what to do about chunks
    /// the device may not be past yet.
    pub(in crate::alloc) fn reclaim(
        &self,
        st: &mut State,
        want: usize,
        batch: usize,
        fit: usize,
        also: Range<DevicePtr>,
        pending: Pending,
    ) -> Result<Vec<Spare>> {
        let mut candidates = st.reclaim_candidates(also);
        // Chunks that fit where the memory is wanted move; larger ones would be released.
        candidates.sort_by_key(|v| v.pages > fit);
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let limit = want.saturating_add(batch);
        let all_done = match pending {
            Pending::Synced => true,
            // Everything is wanted (the OOM path): one wait for the whole device.
            Pending::WaitOn(_) if want == usize::MAX => {
                self.sync_before_moves(st)?;
                true
            }
            Pending::WaitOn(_) => {
                self.poll_fences(st, None)?;
                false
            }
        };
        let (done, mut not_done): (Vec<Victim>, Vec<Victim>) = candidates
            .into_iter()
            .partition(|v| all_done || st.fences().is_done(v.stream, v.last_free));
        let mut victims = Vec::new();
        let mut taken = 0;
        take_until(&mut victims, &mut taken, done, limit);
        if let (true, Pending::WaitOn(caller)) = (taken < want && !not_done.is_empty(), pending) {
            // The oldest frees first: the device is likeliest to be past them.
            not_done.sort_by_key(|v| v.last_free);
            let mut newest: Vec<(StreamId, u64)> = Vec::new();
            let mut short = want - taken;
            for v in &not_done {
                if short == 0 {
                    break;
                }
                short = short.saturating_sub(v.pages);
                match newest.iter_mut().find(|(s, _)| *s == v.stream) {
                    Some((_, seq)) => *seq = (*seq).max(v.last_free),
                    None => newest.push((v.stream, v.last_free)),
                }
            }
            for (stream, seq) in newest {
                self.wait_for_free(st, stream, seq, caller)?;
            }
            let now_done: Vec<Victim> = not_done
                .into_iter()
                .filter(|v| st.fences().is_done(v.stream, v.last_free))
                .collect();
            take_until(&mut victims, &mut taken, now_done, limit);
        }
        let mut spares = Vec::with_capacity(victims.len());
        for v in victims {
            match self.unmap_chunk(st, v.segment, v.first) {
                Ok(spare) => spares.push(spare),
                Err(e) => {
                    // Keep what was already unmapped (reserved, parked) rather than lose it.
                    let page = st.paged_at(v.segment).page;
                    for spare in spares {
                        self.park(st, spare, page);
                    }
                    return Err(e);
                }
            }
        }
        st.moves_mut().note_moved(!spares.is_empty());
        Ok(spares)
    }

    /// Gives back every page under free blocks and every paged segment left wholly free.
    /// The caller has synchronized the device.
    pub(in crate::alloc) fn release_paged_cache(&self, st: &mut State) -> Result<()> {
        let Some(page) = st.page_size() else {
            return Ok(());
        };
        let idle = self.unpark_all(st, page);
        let released_idle = self.release_chunks(st, idle, page);
        let reclaimed = self.reclaim(st, usize::MAX, 0, usize::MAX, 0..0, Pending::Synced)?;
        released_idle.and(self.release_chunks(st, reclaimed, page))?;
        let mut result = Ok(());
        for (base, size) in st.empty_paged_segments() {
            result = result.and(self.release_empty_paged(st, base, size));
        }
        result
    }
}

/// A growth under way, for `Shard::account_growth`: when it began, and the event that tells
/// whether the device was busy throughout (`Shard::busy_probe`). Accounted (which
/// destroys the event) once, on every way out of `map_pages`: not `Copy`, so that a second
/// use does not compile.
struct Growth {
    started: Instant,
    busy_probe: Option<EventId>,
}
