//! Paged segments: ccalloc's answer to "reserved but unallocated" memory.
//!
//! With the driver's virtual memory management, each (stream, pool) gets one address range
//! as large as the device, carved into blocks like any segment, but backed by physical memory
//! only where blocks need it, in chunks of `CHUNK_PAGES` granules (pages) or more for large
//! blocks (`chunk_pages_for`), one physical allocation each. Chunks under free blocks stay mapped (so steady-state reuse
//! costs no driver call) until growth would push reserved memory past the high-water mark of
//! live memory plus a small slack; then chunks lying wholly under free blocks are unmapped
//! and mapped again where they are needed, or given back. Reserved memory therefore tracks
//! live memory, while a training loop that repeats its sizes never maps or unmaps after its
//! first iterations.
//!
//! A page moves only once the device is done with the work queued before its last free:
//! frees and growth record events ("fences") on their streams, and a move waits on the
//! oldest fence covering the page, usually one that has completed already. Placement
//! (`State::take_cached`) prefers places whose pages are mapped, since each move costs tens
//! of microseconds of driver calls (see `benches/gpu/vmm_cost.cu`).

use super::core::blocks::{Block, BlockState};
use super::sizing::PoolKind;
use super::state::{Fence, Segment, State};
use super::{driver_error, Shard};
use crate::driver::{DevicePtr, PhysHandle, StreamId};
use crate::error::Result;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::{Duration, Instant};

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
/// The window over which the share of time spent moving pages is measured: long enough that
/// one burst of growth (a new batch shape: tens of moves of a few ms in all) does not look
/// like a trend. (At 250 ms, bursts pushed bert's slack to 0.5 where 0.2 keeps moves near
/// 0.5% of the time.)
const MOVE_WINDOW: Duration = Duration::from_secs(1);
/// A window closes early when moves took at least this long in it (`account_growth`) ...
const EARLY_MOVES: Duration = Duration::from_millis(5);
/// ... and it has lasted this long. Two such windows over budget in a row raise the slack
/// (`next_extra_slack`): a job that does little but move pages adapts within about 25 ms.
const EARLY_WINDOW: Duration = Duration::from_millis(12);
/// Windows in a row with moves under a quarter of the budget before the extra slack halves.
/// Halving lets later growth release spares and move pages again, so it waits for a phase
/// change (several seconds quiet), not for the quiet the extra slack itself bought.
const QUIET_WINDOWS_BEFORE_DECAY: u32 = 5;
/// The extra slack's growth per window over budget: small steps, so that it stops near the
/// least slack that keeps moves within the budget (moves fall steeply with slack: on bert,
/// 3.4% of the time at slack 0.12, 0.7% at 0.2) ...
const EXTRA_SLACK_STEP: f64 = 1.5;
/// ... and larger ones where moves take more than this many times the budget.
const SEVERE_OVERRUN: f64 = 8.0;
const SEVERE_EXTRA_SLACK_STEP: f64 = 3.0;
/// Extra slack that `page_move_budget` may add: reserved stays within twice peak live.
const MAX_EXTRA_SLACK: f64 = 1.0;
/// The first step of extra slack when `page_slack` is smaller.
const MIN_EXTRA_SLACK: f64 = 1.0 / 32.0;
/// Growth maps physical memory in chunks of this many pages (more for long runs, see
/// `chunk_pages_for`), one handle each: the driver's cost is per mapping, not per byte (on
/// an H100, granting access to one 2 MiB handle takes 45 µs, to one 8 MiB handle 45 µs and
/// to one 128 MiB handle 66 µs; `benches/gpu/vmm_cost.cu`). A chunk is unmapped only whole,
/// so larger chunks keep more memory behind live blocks. On the sample traces (replayed with
/// GPU lags of 0 to 32 events), 4 pages cut maps 2.8-fold and left every ratio within 0.02
/// of one page's; 8 pages everywhere cut them 5-fold, but bert's ratio then ranged from
/// 1.040 to 1.069.
pub const CHUNK_PAGES: usize = 4;
/// The largest chunk (128 MiB with 2 MiB pages).
pub const MAX_CHUNK_PAGES: usize = 64;

/// Pages per new chunk when growth maps a run of `run` missing pages: a quarter of the run,
/// within `CHUNK_PAGES..=MAX_CHUNK_PAGES`. Each chunk costs a create, a map and an access
/// grant whatever its size, so a large block is backed by a few large chunks; a chunk never
/// exceeds a quarter of the block it was made for, so one pinned by a small live block later
/// holds little beyond it. (Sample traces, GPU lags 0-32: maps fall 3.2-fold on gpt2 and
/// 1.8-fold on resnet, every ratio within 0.005 of 4-page chunks'.)
pub(super) fn chunk_pages_for(run: usize) -> usize {
    (run / 4).clamp(CHUNK_PAGES, MAX_CHUNK_PAGES)
}

/// One physical allocation mapped at pages `first..first+pages` of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub handle: PhysHandle,
    pub first: usize,
    pub pages: usize,
    /// The `State::free_seq` of the last free of a block on the chunk's pages (0: none
    /// since it was mapped): its last use on the device came before that free.
    pub last_free: u64,
}

/// Physical memory in hand, not mapped anywhere: `pages` pages under one handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spare {
    pub handle: PhysHandle,
    pub pages: usize,
}

/// The page table of one paged segment.
pub struct PagedSegment {
    pub base: DevicePtr,
    pub size: u64,
    pub page: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    /// The mapped chunks, by first page. A segment spans the whole device while few of its
    /// pages are mapped: everything kept per segment is proportional to its mapped chunks
    /// (the bitmap aside, one bit a page), so that many streams, each with its own
    /// segments, cost memory and time in proportion to what they map.
    pub chunks: BTreeMap<usize, Chunk>,
    /// Frees since the last one that asked for a fence.
    pub frees_since_fence: u32,
    /// The mapped pages, twice (both kept by `set_chunk` and `take_chunk` alone): a bitmap
    /// counts them a word at a time (a hand-out checks every page it covers), a set walks
    /// the few mapped pages of a free block that may span most of the segment.
    pub mapped: PageBits,
    pub mapped_set: BTreeSet<usize>,
}

/// A bitmap over a segment's pages.
#[derive(Clone, Debug, Default)]
pub struct PageBits {
    words: Vec<u64>,
}

impl PageBits {
    pub fn new(pages: usize) -> Self {
        Self {
            words: vec![0; pages.div_ceil(64)],
        }
    }

    /// A walk over the words: only the release path asks.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn set(&mut self, i: usize) {
        self.words[i / 64] |= 1u64 << (i % 64);
    }

    pub fn get(&self, i: usize) -> bool {
        self.words[i / 64] & (1u64 << (i % 64)) != 0
    }

    pub fn clear(&mut self, i: usize) {
        self.words[i / 64] &= !(1u64 << (i % 64));
    }

    /// The words overlapping `range`, each masked to the bits inside it, with its index.
    fn masked(&self, range: Range<usize>) -> impl Iterator<Item = (usize, u64)> + '_ {
        let words = if range.is_empty() {
            0..0
        } else {
            range.start / 64..(range.end - 1) / 64 + 1
        };
        words.map(move |w| {
            // The word overlaps the range: 0 <= low < 64 and 0 < high <= 64.
            let low = range.start.saturating_sub(w * 64);
            let high = (range.end - w * 64).min(64);
            let mask = (u64::MAX >> (64 - high)) & (u64::MAX << low);
            (w, self.words[w] & mask)
        })
    }

    /// Set bits inside `range`.
    pub fn count(&self, range: Range<usize>) -> usize {
        self.masked(range)
            .map(|(_, b)| b.count_ones() as usize)
            .sum()
    }
}

impl PagedSegment {
    /// A segment of `size` bytes at `base` with nothing mapped.
    pub fn new(base: DevicePtr, size: u64, page: u64, stream: StreamId, pool: PoolKind) -> Self {
        let count = (size / page) as usize;
        Self {
            base,
            size,
            page,
            stream,
            pool,
            chunks: BTreeMap::new(),
            frees_since_fence: 0,
            mapped: PageBits::new(count),
            mapped_set: BTreeSet::new(),
        }
    }

    /// The chunk mapped at page `i`.
    pub fn chunk_at(&self, i: usize) -> Option<&Chunk> {
        let (_, chunk) = self.chunks.range(..=i).next_back()?;
        (i < chunk.first + chunk.pages).then_some(chunk)
    }

    /// The chunks overlapping pages `range`, in page order.
    fn chunks_over(&self, range: Range<usize>) -> impl DoubleEndedIterator<Item = &Chunk> + '_ {
        let range = if range.is_empty() { 0..0 } else { range };
        let straddling = self
            .chunk_at(range.start)
            .filter(|c| c.first < range.start && !range.is_empty());
        straddling
            .into_iter()
            .chain(self.chunks.range(range).map(|(_, c)| c))
    }

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

    /// The mapped address ranges, in order, adjacent pages joined.
    pub fn mapped_runs(&self) -> Vec<(DevicePtr, u64)> {
        let mut runs: Vec<(DevicePtr, u64)> = Vec::new();
        for &i in &self.mapped_set {
            let va = self.va(i);
            match runs.last_mut() {
                Some((start, len)) if *start + *len == va => *len += self.page,
                _ => runs.push((va, self.page)),
            }
        }
        runs
    }

    /// Bytes of `[addr, addr+len)` that lie on mapped pages.
    pub fn mapped_bytes_in(&self, addr: DevicePtr, len: u64) -> u64 {
        self.touched(addr, len)
            .filter(|&i| self.mapped.get(i))
            .map(|i| {
                let (start, end) = (self.va(i), self.va(i) + self.page);
                end.min(addr + len) - start.max(addr)
            })
            .sum()
    }

    /// How many pages `[addr, addr+len)` touches that are not mapped.
    pub fn unmapped_pages(&self, addr: DevicePtr, len: u64) -> usize {
        let touched = self.touched(addr, len);
        touched.len() - self.mapped.count(touched)
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
        let touched = self.touched(addr, len);
        let firsts: Vec<usize> = self.chunks_over(touched).map(|c| c.first).collect();
        for first in firsts {
            self.chunks.get_mut(&first).expect("listed").last_free = seq;
        }
        let due = self.frees_since_fence.is_multiple_of(FREES_PER_FENCE);
        self.frees_since_fence = self.frees_since_fence.wrapping_add(1);
        due
    }

    /// `spare` is now mapped at pages `first..`.
    pub fn set_chunk(&mut self, first: usize, spare: Spare) {
        let chunk = Chunk {
            handle: spare.handle,
            first,
            pages: spare.pages,
            last_free: 0,
        };
        self.chunks.insert(first, chunk);
        for i in first..first + spare.pages {
            self.mapped.set(i);
            self.mapped_set.insert(i);
        }
    }

    /// The chunk starting at page `first` is no longer mapped: its memory.
    pub fn take_chunk(&mut self, first: usize) -> Spare {
        let chunk = self.chunks.remove(&first).expect("chunks are taken whole");
        for i in first..first + chunk.pages {
            self.mapped.clear(i);
            self.mapped_set.remove(&i);
        }
        Spare {
            handle: chunk.handle,
            pages: chunk.pages,
        }
    }

    fn va(&self, page: usize) -> DevicePtr {
        self.base + page as u64 * self.page
    }
}

/// A chunk wholly under a free block: a candidate to unmap.
struct Victim {
    segment: DevicePtr,
    first: usize,
    pages: usize,
    /// The segment's stream, and the last free on the chunk's pages (see
    /// `Chunk::last_free`).
    stream: StreamId,
    last_free: u64,
}

/// Where growth maps memory: the runs of missing pages, filled chunk by chunk.
struct Plan {
    /// Unfilled runs of pages, `start..end`.
    gaps: Vec<Range<usize>>,
    /// Memory placed so far: (first page, memory).
    placed: Vec<(usize, Spare)>,
}

impl Plan {
    fn new(missing: &[usize]) -> Self {
        let mut gaps: Vec<Range<usize>> = Vec::new();
        for &i in missing {
            match gaps.last_mut() {
                Some(run) if run.end == i => run.end += 1,
                _ => gaps.push(i..i + 1),
            }
        }
        Self {
            gaps,
            placed: Vec::new(),
        }
    }

    fn unfilled(&self) -> usize {
        self.gaps.iter().map(|g| g.len()).sum()
    }

    fn place(&mut self, gap: usize, spare: Spare) {
        let at = self.gaps[gap].start;
        self.gaps[gap].start += spare.pages;
        self.placed.push((at, spare));
    }

    /// Places what fits of `spares`, largest first, each at the start of the first gap
    /// with room; what fits nowhere stays in `spares`.
    fn fill(&mut self, spares: &mut Vec<Spare>) {
        spares.sort_by_key(|s| std::cmp::Reverse(s.pages));
        spares.retain(
            |&spare| match self.gaps.iter().position(|g| g.len() >= spare.pages) {
                Some(gap) => {
                    self.place(gap, spare);
                    false
                }
                None => true,
            },
        );
    }

    fn placed_pages(&self) -> usize {
        self.placed.iter().map(|(_, s)| s.pages).sum()
    }
}

fn pages_of(spares: &[Spare]) -> usize {
    spares.iter().map(|s| s.pages).sum()
}

impl Shard {
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
        let cached_at = st.caches.list(None, pool).lookups();
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
            front: 0,
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
        st.paged
            .insert(base, PagedSegment::new(base, size, page, stream, pool));
        st.paged_for.insert((stream, pool));
        st.stats.segment.increase(pool, 1);
        Ok(true)
    }

    /// Maps every page `[addr, addr+len)` touches. Physical memory comes from new chunks
    /// while reserved stays within live + slack, else from chunks under free blocks. Returns
    /// false when the device (or the memory limit) cannot supply the pages.
    /// `rest` is the part of the block being handed out that stays free: its chunks are the
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
        if seg.unmapped_pages(addr, len) == 0 {
            return Ok(true);
        }
        // Parked (and held) blocks' pages become reclaimable (and the OOM path sees them
        // merged).
        self.merge_set_aside(st);
        let seg = &st.paged[&base];
        let missing: Vec<usize> = seg
            .touched(addr, len)
            .filter(|&i| !seg.mapped.get(i))
            .collect();
        if missing.is_empty() {
            return Ok(true);
        }
        // Every page mapped here counts as reserved; parked chunks already do.
        let live_after = st.stats.active_bytes.all().current as u64 + len;
        st.live_high_water = st.live_high_water.max(live_after);
        let high = st.live_high_water;
        let share = st.page_slack();
        let slack = ((high as f64 * share) as u64).max(MIN_SLACK_PAGES * page);
        let started = Instant::now();
        st.moves.reclaimed = false;
        let budget = (high + slack).min(self.hard_limit(st));
        let mut plan = Plan::new(&missing);
        let mut spares = self.unpark_all(st, page);
        let gathered = self.gather(
            st,
            stream,
            &mut plan,
            &mut spares,
            page,
            budget,
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
            self.account_growth(st, started);
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
        if refused {
            // A growth too, if a failed one: its time (and waits) was spent all the same.
            self.account_growth(st, started);
        }
        released?;
        if refused {
            return Ok(false);
        }
        plan.placed.sort_by_key(|&(first, _)| first);
        let mut done = 0;
        let mapped = self.map_plan(st, base, &plan.placed, &missing, &mut done);
        self.account_growth(st, started);
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
        Ok(true)
    }

    /// Counts one growth (`PagingCounters`) that started at `started` (gathering, waiting,
    /// mapping), failed ones included. On a GPU, adds its time to the move clock if it moved
    /// chunks, and every `MOVE_WINDOW` adjusts the extra slack to the share of time moves
    /// took (`next_extra_slack`): a workload whose page moves cost more than
    /// `page_move_budget` (random sizes of hundreds of MiB, shapes that change every step)
    /// gets a larger cache instead, while one that moves little keeps reserved ≈ live.
    fn account_growth(&self, st: &mut State, started: Instant) {
        let now = Instant::now();
        let took = now - started;
        let paging = &mut st.stats.paging;
        paging.growths += 1;
        paging.growth_ns += took.as_nanos() as u64;
        if st.moves.reclaimed {
            paging.moving_growths += 1;
            paging.moving_ns += took.as_nanos() as u64;
        }
        // The sim's clock says nothing about a GPU's: replays stay the same every time.
        if !self.times_page_moves {
            return;
        }
        let budget = st.config.page_move_budget;
        let base = st.config.page_slack.max(MIN_EXTRA_SLACK);
        let clock = &mut st.moves;
        // Growth that only mapped new memory is not a move (more slack would not spare
        // it), but it still closes windows, so that extra slack decays once moves stop.
        if clock.reclaimed {
            clock.moving += took;
        }
        let window = now - *clock.window_start.get_or_insert(started);
        let early = closes_early(window, clock.moving, budget);
        if window < MOVE_WINDOW && !early {
            return;
        }
        let share = clock.moving.as_secs_f64() / window.as_secs_f64();
        let before = clock.extra_slack;
        // Windows close only at growth: a long quiet gap counts for the windows it spans.
        let spans = (window.as_secs_f64() / MOVE_WINDOW.as_secs_f64()) as u32;
        (clock.extra_slack, clock.quiet_windows) = next_extra_slack(
            before,
            clock.quiet_windows,
            spans,
            share,
            budget,
            base,
            clock.over_budget,
        );
        clock.over_budget = share > budget;
        let changed = clock.extra_slack != before;
        clock.window_start = Some(now);
        clock.moving = Duration::ZERO;
        if changed {
            tracing::info!(
                device = self.device,
                "page moves took {:.1}% of the last {:.0} ms (budget {:.1}%): page slack now {:.3} of peak live",
                share * 100.0,
                window.as_secs_f64() * 1e3,
                budget * 100.0,
                st.page_slack()
            );
        }
    }

    /// Fills `plan` with memory: parked chunks that fit, then new chunks while reserved
    /// stays within `budget`; past it, growth is paid for with chunks from under free blocks
    /// (never much more than this request maps: shrinking is left to empty_cache and the OOM
    /// path). A wait for the device buys a batch of `slack` more, parked for the next
    /// requests. While a CUDA graph is being captured nothing may wait or move: only parked
    /// and new chunks are used. `spares` ends with the memory in hand that fit nowhere.
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        st: &mut State,
        stream: StreamId,
        plan: &mut Plan,
        spares: &mut Vec<Spare>,
        page: u64,
        budget: u64,
        slack: u64,
        rest: Range<DevicePtr>,
    ) -> Result<()> {
        let capturing = st.caches.capturing();
        plan.fill(spares);
        let in_hand = |plan: &Plan, spares: &[Spare]| plan.placed_pages() + pages_of(spares);
        // Pages past the budget were everything in hand mapped and the rest made new.
        let over_budget = |st: &State, plan: &Plan, spares: &[Spare]| {
            let after = st.reserved() + (in_hand(plan, spares) + plan.unfilled()) as u64 * page;
            after.saturating_sub(budget).div_ceil(page) as usize
        };
        // Parked chunks that fit nowhere are the first memory to give up.
        self.release_smallest(st, spares, over_budget(st, plan, spares), page)?;
        let over = over_budget(st, plan, spares).min(plan.unfilled()) as u64;
        if over > 0 && !capturing {
            let batch = (slack / page) as usize;
            let fit = plan.gaps.iter().map(|g| g.len()).max().unwrap_or(0);
            let taken = self.reclaim(st, over as usize, batch, fit, rest.clone(), Some(stream))?;
            spares.extend(taken);
            plan.fill(spares);
            // What fits nowhere goes back to the device before new memory is made.
            let surplus = pages_of(spares).saturating_sub(batch);
            self.release_smallest(st, spares, surplus, page)?;
        }
        self.add_new_chunks(st, plan, page)?;
        if plan.unfilled() > 0 && !capturing {
            // Out of memory: take every reclaimable chunk, then the plain cache too.
            let all = self.reclaim(st, usize::MAX, 0, usize::MAX, rest, Some(stream))?;
            spares.extend(all);
            plan.fill(spares);
            self.release_chunks(st, spares.drain(..), page)?;
            self.add_new_chunks(st, plan, page)?;
            if plan.unfilled() > 0 {
                self.release_all_cached(st)?;
                if !st.oom_final.is_some_and(|e| e.second_try) {
                    st.stats.num_alloc_retries += 1;
                }
                self.add_new_chunks(st, plan, page)?;
            }
        }
        Ok(())
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
        let (page, pool) = {
            let seg = st.paged_segment_mut(base);
            (seg.page, seg.pool)
        };
        for &(first, spare) in placed {
            let seg = st.paged.get_mut(&base).expect("segment exists");
            self.driver
                .map(
                    self.device,
                    seg.va(first),
                    spare.pages as u64 * page,
                    spare.handle,
                )
                .map_err(|e| driver_error(self.device, e))?;
            seg.set_chunk(first, spare);
            st.add_reserved(pool, spare.pages as u64 * page);
            st.stats.paging.chunks_mapped += 1;
            *done += 1;
        }
        let seg = st.paged.get_mut(&base).expect("segment exists");
        for run in Plan::new(missing).gaps {
            self.driver
                .set_access(self.device, seg.va(run.start), run.len() as u64 * page)
                .map_err(|e| driver_error(self.device, e))?;
        }
        Ok(())
    }

    /// Fills the plan's gaps with new chunks (`chunk_pages_for` each gap) while the device and
    /// the limit allow (pages gathered but not yet mapped stay committed against the limit:
    /// see `DeviceReserved`). A chunk the device refuses is tried again in halves, down to
    /// one page.
    fn add_new_chunks(&self, st: &mut State, plan: &mut Plan, page: u64) -> Result<()> {
        for gap in 0..plan.gaps.len() {
            let mut size = chunk_pages_for(plan.gaps[gap].len());
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
    fn park(&self, st: &mut State, spare: Spare, page: u64) {
        st.idle_chunks.push(spare);
        st.add_reserved(PoolKind::Large, spare.pages as u64 * page);
    }

    /// Takes every parked chunk (no longer counted until mapped).
    fn unpark_all(&self, st: &mut State, page: u64) -> Vec<Spare> {
        let spares = std::mem::take(&mut st.idle_chunks);
        st.sub_reserved(PoolKind::Large, pages_of(&spares) as u64 * page);
        spares
    }

    /// Unmaps the chunk at page `first` of a paged segment; its memory is no longer reserved.
    fn unmap_chunk(&self, st: &mut State, base: DevicePtr, first: usize) -> Result<Spare> {
        let seg = st.paged.get_mut(&base).expect("segment exists");
        let pages = seg.chunks[&first].pages as u64;
        self.driver
            .unmap(self.device, seg.va(first), pages * seg.page)
            .map_err(|e| driver_error(self.device, e))?;
        let spare = seg.take_chunk(first);
        let (pool, page) = (seg.pool, seg.page);
        st.sub_reserved(pool, pages * page);
        st.stats.paging.chunks_unmapped += 1;
        Ok(spare)
    }

    pub(super) fn hard_limit(&self, st: &State) -> u64 {
        st.limit.min(self.total_memory)
    }

    /// A fresh physical chunk of `pages` pages, counted as reserved by no pool until mapped;
    /// `None` when the device or the limit refuses.
    fn new_chunk(&self, st: &mut State, pages: usize, page: u64) -> Result<Option<PhysHandle>> {
        let bytes = pages as u64 * page;
        // Pages in hand (gathered, not yet mapped) are committed already.
        if !st.commit(bytes, self.hard_limit(st)) {
            return Ok(None);
        }
        match self.driver.create_physical(self.device, bytes) {
            Ok(handle) => {
                st.stats.num_device_alloc += 1;
                Ok(Some(handle))
            }
            Err(e) => self.refused(st, bytes, e),
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
                st.stats.num_device_free += 1;
                st.uncommit(spare.pages as u64 * page);
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
    /// taken. Chunks of at most `fit` pages go first. `caller`: the stream of the malloc asking (alive, so a fence may be recorded on
    /// it); `None` when the caller has synchronized the device.
    pub(super) fn reclaim(
        &self,
        st: &mut State,
        want: usize,
        batch: usize,
        fit: usize,
        also: Range<DevicePtr>,
        caller: Option<StreamId>,
    ) -> Result<Vec<Spare>> {
        let (mut candidates, clean, steps) = reclaim_candidates(st, also);
        st.stats.paging.reclaim_steps += steps;
        for key in clean {
            st.reclaim_dirty.remove(&key);
        }
        // Chunks that fit where the memory is wanted move; larger ones would be released.
        candidates.sort_by_key(|v| v.pages > fit);
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let limit = want.saturating_add(batch);
        let all_done = match caller {
            None => true,
            // Everything is wanted (the OOM path): one wait for the whole device.
            Some(_) if want == usize::MAX => {
                self.sync_before_moves(st)?;
                true
            }
            Some(_) => {
                self.poll_fences(st, None)?;
                false
            }
        };
        let (done, mut pending): (Vec<Victim>, Vec<Victim>) = candidates
            .into_iter()
            .partition(|v| all_done || st.free_is_done(v.stream, v.last_free));
        let mut victims = Vec::new();
        let mut taken = 0;
        take_until(&mut victims, &mut taken, done, limit);
        if let (true, Some(caller)) = (taken < want && !pending.is_empty(), caller) {
            // The oldest frees first: the device is likeliest to be past them.
            pending.sort_by_key(|v| v.last_free);
            let mut newest: Vec<(StreamId, u64)> = Vec::new();
            let mut short = want - taken;
            for v in &pending {
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
            let now_done: Vec<Victim> = pending
                .into_iter()
                .filter(|v| st.free_is_done(v.stream, v.last_free))
                .collect();
            take_until(&mut victims, &mut taken, now_done, limit);
        }
        let mut spares = Vec::with_capacity(victims.len());
        for v in victims {
            match self.unmap_chunk(st, v.segment, v.first) {
                Ok(spare) => spares.push(spare),
                Err(e) => {
                    // Keep what was already unmapped (reserved, parked) rather than lose it.
                    let page = st.paged[&v.segment].page;
                    for spare in spares {
                        self.park(st, spare, page);
                    }
                    return Err(e);
                }
            }
        }
        st.moves.reclaimed |= !spares.is_empty();
        Ok(spares)
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
        // Retire the stream's completed fences once half the queue is pending: otherwise
        // they are noticed only when pages move, and a long run without moves would fill
        // the queue and stop fencing. Not at every record: a query costs about as much as
        // the record itself (~1 µs on an H100). (A failed query only leaves them queued.)
        let mut pending = st.fences.iter().filter(|f| f.stream == stream).count();
        if pending >= MAX_FENCES_PER_STREAM / 2 {
            let _ = self.poll_fences(st, Some(stream));
            pending = st.fences.iter().filter(|f| f.stream == stream).count();
        }
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
                    return self.sync_before_moves(st);
                }
            },
            None => return self.sync_before_moves(st),
        };
        st.stats.paging.host_waits += 1;
        self.driver
            .wait_event(self.device, st.fences[i].event)
            .map_err(|e| driver_error(self.device, e))?;
        // It and the stream's older fences are done now.
        self.poll_fences(st, Some(stream))
    }

    /// A device synchronize so that pages may move (a host wait, for the paging stats).
    fn sync_before_moves(&self, st: &mut State) -> Result<()> {
        st.stats.paging.host_waits += 1;
        self.sync_device(st)
    }

    /// Gives back every page under free blocks and every paged segment left wholly free.
    /// The caller has synchronized the device.
    pub(super) fn release_paged_cache(&self, st: &mut State) -> Result<()> {
        if st.paged.is_empty() {
            return Ok(());
        }
        let page = st.paged.values().next().expect("non-empty").page;
        let idle = self.unpark_all(st, page);
        let released_idle = self.release_chunks(st, idle, page);
        let reclaimed = self.reclaim(st, usize::MAX, 0, usize::MAX, 0..0, None)?;
        released_idle.and(self.release_chunks(st, reclaimed, page))?;
        let empty: Vec<DevicePtr> = st
            .paged
            .iter()
            .filter(|(base, seg)| {
                let first = st.segments[base].first;
                let b = st.blocks.get(first);
                seg.mapped.is_empty() && b.state == BlockState::Free && b.next.is_none()
            })
            .map(|(&base, _)| base)
            .collect();
        let mut result = Ok(());
        for base in empty {
            // The range goes first: should the driver refuse, the segment stays (empty,
            // cached) and the next empty_cache tries again.
            let size = st.paged[&base].size;
            if let Err(e) = self.driver.free_address(self.device, base, size) {
                result = result.and(Err(driver_error(self.device, e)));
                continue;
            }
            let seg = st.paged.remove(&base).expect("listed");
            let segment = st
                .segments
                .remove(&base)
                .expect("paged segments are segments");
            st.forget_used(base, base + seg.size);
            let block = st.blocks.remove(segment.first);
            st.caches.list(None, seg.pool).remove(&block);
            st.paged_for.remove(&(seg.stream, seg.pool));
            st.stats.segment.decrease(seg.pool, 1);
        }
        result
    }
}

/// Chunks wholly under free paged blocks, in preference order: `also` (the rest of the
/// block being carved) first, then the largest free blocks, highest pages first. Only the
/// free lists of (stream, pool)s in `State::reclaim_dirty` are searched: the others held no
/// such chunk when last searched, and none has been freed or merged into them since (see
/// `State::mark_reclaim_dirty`), so the search costs what has changed, not what every
/// stream holds. Returns the candidates, the (stream, pool)s found without any (to be
/// marked clean), and the work done (blocks and chunks visited).
fn reclaim_candidates(
    st: &State,
    also: Range<DevicePtr>,
) -> (Vec<Victim>, Vec<(StreamId, PoolKind)>, u64) {
    let mut ranges: Vec<(DevicePtr, u64)> = Vec::new();
    if !also.is_empty() {
        ranges.push((also.start, also.end - also.start));
    }
    let mut dirty: Vec<(StreamId, PoolKind)> = st.reclaim_dirty.iter().copied().collect();
    dirty.sort_unstable();
    let mut steps = 0u64;
    let mut clean = Vec::new();
    for pool in [PoolKind::Large, PoolKind::Small] {
        let list = st.caches.general(pool);
        let start = ranges.len();
        for &(stream, _) in dirty.iter().filter(|(_, p)| *p == pool) {
            ranges.extend(
                list.ids_of(stream)
                    .map(|id| st.blocks.get(id))
                    .filter(|b| b.paged)
                    .map(|b| (b.addr, b.size)),
            );
        }
        steps += (ranges.len() - start) as u64;
        ranges[start..].sort_by_key(|&(_, size)| std::cmp::Reverse(size));
    }
    let mut candidates = Vec::new();
    let mut found: rustc_hash::FxHashSet<(StreamId, PoolKind)> = Default::default();
    for (addr, size) in ranges {
        let (base, seg) = st.paged_segment(addr);
        let inside = seg.inside(addr, size);
        for chunk in seg.chunks_over(inside.clone()).rev() {
            steps += 1;
            if chunk.first >= inside.start && chunk.first + chunk.pages <= inside.end {
                found.insert((seg.stream, seg.pool));
                candidates.push(Victim {
                    segment: base,
                    first: chunk.first,
                    pages: chunk.pages,
                    stream: seg.stream,
                    last_free: chunk.last_free,
                });
            }
        }
    }
    for key in dirty {
        if !found.contains(&key) {
            clean.push(key);
        }
    }
    (candidates, clean, steps)
}

/// Moves victims from `from` into `into`, in order, until `limit` pages are taken.
fn take_until(into: &mut Vec<Victim>, taken: &mut usize, from: Vec<Victim>, limit: usize) {
    for v in from {
        if *taken >= limit {
            break;
        }
        *taken += v.pages;
        into.push(v);
    }
}

/// Whether a move window (`account_growth`) that has lasted `window`, of which page moves
/// took `moving`, closes before `MOVE_WINDOW`: once moves have plainly overrun the budget,
/// for at least `EARLY_MOVES` and more than `SEVERE_OVERRUN` times the budget's share of at
/// least `EARLY_WINDOW`. A job that does little but move pages (random sizes up to hundreds
/// of MiB) then adapts within tens of ms instead of a second; a new batch shape's burst
/// closes one such window at most, which alone raises nothing.
pub(super) fn closes_early(window: Duration, moving: Duration, budget: f64) -> bool {
    window >= EARLY_WINDOW
        && moving >= EARLY_MOVES
        && moving.as_secs_f64() > window.as_secs_f64() * SEVERE_OVERRUN * budget
}

/// The extra slack after a window (`spans` times `MOVE_WINDOW` long) in which page moves
/// took `share` of the time, and the count of quiet windows in a row: over `budget` in this
/// window and the one before (`over_before`) it grows by `EXTRA_SLACK_STEP`, or
/// `SEVERE_EXTRA_SLACK_STEP` past `SEVERE_OVERRUN` times the budget (starting from `base`,
/// up to `MAX_EXTRA_SLACK`), so that a job adapts within a few windows; after
/// `QUIET_WINDOWS_BEFORE_DECAY` windows' worth of time under a quarter of the budget it
/// halves (to 0 below `base / 2`). One window over budget alone is a burst, not a trend: on
/// a slow host, bert's bursts of growth (a new batch shape) closed windows over budget now
/// and then, and each raised the slack for good (peak reserved / requested 1.24-1.30,
/// moves 0.2% of its time, against 1.08 on a faster host). A budget of 0 (perhaps set at
/// run time) drops it.
pub(super) fn next_extra_slack(
    extra: f64,
    quiet_windows: u32,
    spans: u32,
    share: f64,
    budget: f64,
    base: f64,
    over_before: bool,
) -> (f64, u32) {
    if budget == 0.0 {
        return (0.0, 0);
    }
    if share > budget {
        if !over_before {
            return (extra, 0);
        }
        let step = if share > SEVERE_OVERRUN * budget {
            SEVERE_EXTRA_SLACK_STEP
        } else {
            EXTRA_SLACK_STEP
        };
        return ((extra.max(base) * step).min(MAX_EXTRA_SLACK), 0);
    }
    if share >= budget / 4.0 || extra == 0.0 {
        return (extra, 0);
    }
    // A window closed early (`spans` 0) does not count towards the quiet spell.
    let quiet = quiet_windows.saturating_add(spans);
    if quiet < QUIET_WINDOWS_BEFORE_DECAY {
        return (extra, quiet);
    }
    let halved = extra / 2.0;
    (if halved < base / 2.0 { 0.0 } else { halved }, 0)
}
