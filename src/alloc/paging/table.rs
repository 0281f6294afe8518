//! The page table of one paged segment: which pages are mapped, by which physical chunk, and
//! when each chunk's pages were last freed.

use crate::alloc::sizing::PoolKind;
use crate::driver::{DevicePtr, PhysHandle, StreamId};
use std::collections::BTreeSet;
use std::ops::Range;

/// Every this many frees of paged blocks in a segment, the free records a fence: an event
/// record costs about a microsecond, and a GPU running behind the host needs no finer marks.
/// A count, not a clock, so that a replay comes out the same every time.
const FREES_PER_FENCE: u32 = 16;
/// Growth maps physical memory in chunks, one handle each: the driver's cost is per call
/// (create, map, access grant; `benches/gpu/vmm_cost.cu`), not per byte, and a chunk is
/// unmapped only whole, so a chunk that one live block still touches keeps all its pages.
/// The smallest chunk is one page: a small block pins no more than its own pages.
pub const CHUNK_PAGES: usize = 1;
/// The largest chunk (128 MiB with 2 MiB pages).
pub const MAX_CHUNK_PAGES: usize = 64;
/// A run of missing pages is mapped in chunks of about this share of it ...
const CHUNKS_PER_RUN: usize = 16;
/// ... or, once page moves cost more than their budget, of this share, and of at least
/// this many pages ...
const COARSE_CHUNKS_PER_RUN: usize = 4;
const COARSE_CHUNK_PAGES: usize = 4;
/// ... and neither smaller nor larger than this share of the page slack, unless that is
/// under `COARSE_CHUNK_PAGES` or would cut the run into more than `MAX_CHUNKS_PER_RUN`
/// chunks.
const CHUNKS_PER_SLACK: usize = 16;
const MAX_CHUNKS_PER_RUN: usize = 256;

/// Pages per new chunk when growth maps a run of `run` missing pages, with `slack_pages` the
/// pages the policy may keep mapped beyond the live high-water mark: a sixteenth of the
/// run, within `CHUNK_PAGES..=MAX_CHUNK_PAGES`. A block is so backed by about 16 chunks
/// where the slack allows (see the cap below), and when blocks smaller than it later live
/// on its pages, each pins at most a sixteenth of it beyond its own pages. Swept on the 18
/// replayed traces (docs/paging.md): quarters pinned up to 0.08 of peak live more than
/// sixteenths (generation, variable-batch inference), and sixteenths were nowhere worse;
/// thirty-seconds gained little more for twice the calls.
///
/// With `coarse` (moves have lately spent their budget), a quarter of the run and at least
/// 4 pages: each later move of the chunk then costs fewer calls, for more pinned memory.
/// The cap below still holds, so what `coarse` changes is small runs: a chunk of fewer
/// than 4 pages (a run under 64 pages in a job whose slack is under 64 pages) becomes 4
/// pages; larger chunks stay as they are, and the budget acts on them only by refusing
/// moves (`growths_past_slack`), which keeps pinned chunks within a sixteenth of the slack.
///
/// Either way a chunk is a sixteenth of the slack, neither smaller nor larger, unless that is
/// under 4 pages or under a 256th of the run (so a growth of up to 16,384 pages, 32 GiB,
/// makes at most 256 chunks, about 17 ms of calls).
///
/// Not smaller: a sixteenth of a small run in a large job is one page, and each such chunk
/// costs a whole map and access grant every time a move takes it (the driver charges per
/// mapping, not per byte). On the 18 replayed traces this floor cut the priced driver time
/// by 29% at lags 0, 2 and 16, for peaks within 0.006 (docs/paging.md).
///
/// Not larger: a chunk that one live block still touches keeps all its pages, and the
/// slack is all the memory the target allows beyond live. The policy spends the slack on
/// cached chunks wherever growth finds it cheaper than moving, so at a job's peak the
/// pinned pages come on top of what the slack already holds: a sixteenth of a large run
/// (up to 64 pages) let long-context training pin 372 MiB in 16 chunks against a slack of
/// 281 MiB, and an eighth of the slack still 244-342 MiB in 28-37 chunks (1.030-1.040x live
/// on an H200; `ccalloc.memory_breakdown(at_peak=True)`). With a sixteenth, each pinned
/// chunk holds at most that share of the margin: 1.020-1.021x, MoE training 1.029 against
/// 1.036, and no workload of the A/B worse (docs/benchmarks.md, session 29). The price is
/// calls: 6-10% more priced driver time over the 24 replayed traces.
///
/// The 4-page floor keeps a small job's chunks (slack under 64 pages, about 4 GiB live) as
/// they were: below 4 pages each chunk moved costs a map and grant for less memory, and
/// capped at one page, varlen BERT inference (slack about 11 pages) doubled its maps,
/// overran its move budget and reserved 1.21-1.25x live on an H200. The run's share
/// matters only for a slack far under the default (at 3% a sixteenth of the slack is at
/// least a 534th of any run): with `page_slack:0`, 40 GiB inference made its 20 GiB blocks
/// of 4-page chunks, 30,000 maps and unmaps in its replay, 5,400 with it.
pub fn chunk_pages_for(run: usize, slack_pages: usize, coarse: bool) -> usize {
    let share = if coarse {
        (run / COARSE_CHUNKS_PER_RUN).max(COARSE_CHUNK_PAGES)
    } else {
        run / CHUNKS_PER_RUN
    };
    let slack_share = slack_pages / CHUNKS_PER_SLACK;
    share
        .max(slack_share)
        .min(
            slack_share
                .max(COARSE_CHUNK_PAGES)
                .max(run.div_ceil(MAX_CHUNKS_PER_RUN)),
        )
        .clamp(CHUNK_PAGES, MAX_CHUNK_PAGES)
}

/// One physical allocation mapped at pages `first..first+pages` of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub handle: PhysHandle,
    pub first: usize,
    pub pages: usize,
    /// The `State::free_seq` of the last free of a block on the chunk's pages (0: none
    /// since it was mapped), not counting frees still in `PagedSegment::unstamped`: read it
    /// through `PagedSegment::last_free`.
    last_free: u64,
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
    /// (the bitmaps aside, one bit a page each), so that many streams, each with its own
    /// segments, cost memory and time in proportion to what they map.
    chunks: rustc_hash::FxHashMap<usize, Chunk>,
    /// The chunks' first pages, twice (both kept by `set_chunk` and `take_chunk` alone): a
    /// set walks them in order, and a bitmap finds a freed block's chunks without a tree
    /// descent (every paged free stamps them, `note_free`).
    firsts: BTreeSet<usize>,
    starts: PageBits,
    /// Frees since the last one that asked for a fence.
    frees_since_fence: u32,
    /// The newest free, not yet stamped on its chunks' `last_free`: the pages it touched,
    /// and its `free_seq`. A free stamps every chunk it touches, and a large block spans up
    /// to 16; a block freed again and again at the same place (the same-size loop) only
    /// updates the seq here. Stamped when a free of other pages comes, and before the
    /// chunks change (`set_chunk`, `take_chunk`), so that it applies to the chunks of its
    /// free; read through `last_free`.
    unstamped: Option<(Range<usize>, u64)>,
    /// The mapped pages, twice (both kept by `set_chunk` and `take_chunk` alone): a bitmap
    /// counts them a word at a time (a hand-out checks every page it covers), a set walks
    /// the few mapped pages of a free block that may span most of the segment.
    mapped: PageBits,
    mapped_set: BTreeSet<usize>,
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

    /// The words overlapping `range`, each with the mask of its bits inside it.
    fn masks(range: Range<usize>) -> impl Iterator<Item = (usize, u64)> {
        let words = if range.is_empty() {
            0..0
        } else {
            range.start / 64..(range.end - 1) / 64 + 1
        };
        words.map(move |w| {
            // The word overlaps the range: 0 <= low < 64 and 0 < high <= 64.
            let low = range.start.saturating_sub(w * 64);
            let high = (range.end - w * 64).min(64);
            (w, (u64::MAX >> (64 - high)) & (u64::MAX << low))
        })
    }

    /// The words overlapping `range`, each masked to the bits inside it, with its index.
    fn masked(&self, range: Range<usize>) -> impl Iterator<Item = (usize, u64)> + '_ {
        Self::masks(range).map(|(w, mask)| (w, self.words[w] & mask))
    }

    /// The set bits inside `range`, in order.
    fn ones(&self, range: Range<usize>) -> impl Iterator<Item = usize> + '_ {
        self.masked(range).flat_map(|(w, mut bits)| {
            std::iter::from_fn(move || {
                let bit = (bits != 0).then(|| bits.trailing_zeros() as usize)?;
                bits &= bits - 1;
                Some(w * 64 + bit)
            })
        })
    }

    /// The last set bit at or below `i`.
    fn last_at_or_below(&self, i: usize) -> Option<usize> {
        let mut w = i / 64;
        let mut word = self.words[w] & (u64::MAX >> (63 - i % 64));
        while word == 0 {
            w = w.checked_sub(1)?;
            word = self.words[w];
        }
        Some(w * 64 + 63 - word.leading_zeros() as usize)
    }

    /// Whether every bit inside `range` is set: each masked word against its mask, where
    /// `count` would add up population counts (a library loop without the CPU's popcnt,
    /// which the baseline x86-64 target does not assume).
    pub fn all(&self, range: Range<usize>) -> bool {
        Self::masks(range).all(|(w, mask)| self.words[w] & mask == mask)
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
            chunks: Default::default(),
            firsts: BTreeSet::new(),
            starts: PageBits::new(count),
            frees_since_fence: 0,
            unstamped: None,
            mapped: PageBits::new(count),
            mapped_set: BTreeSet::new(),
        }
    }

    /// Whether page `i` is mapped.
    pub fn is_mapped(&self, i: usize) -> bool {
        self.mapped.get(i)
    }

    /// Whether no page is mapped (a walk over the bitmap: only the release path asks).
    pub fn nothing_mapped(&self) -> bool {
        self.mapped.is_empty()
    }

    /// Pages of the chunk mapped from page `first`.
    pub fn chunk_pages(&self, first: usize) -> usize {
        self.chunks[&first].pages
    }

    /// The chunk mapped at page `i`.
    pub fn chunk_at(&self, i: usize) -> Option<&Chunk> {
        let chunk = &self.chunks[self.firsts.range(..=i).next_back()?];
        (i < chunk.first + chunk.pages).then_some(chunk)
    }

    /// The chunks overlapping pages `range`, in page order.
    pub fn chunks_over(&self, range: Range<usize>) -> impl DoubleEndedIterator<Item = &Chunk> + '_ {
        let range = if range.is_empty() { 0..0 } else { range };
        let straddling = self
            .chunk_at(range.start)
            .filter(|c| c.first < range.start && !range.is_empty());
        straddling
            .into_iter()
            .chain(self.firsts.range(range).map(|first| &self.chunks[first]))
    }

    /// Whole pages in `bytes` (a shift for the power-of-two page sizes drivers use: every
    /// paged free and fit converts addresses to pages).
    #[inline]
    fn pages_floor(&self, bytes: u64) -> u64 {
        if self.page.is_power_of_two() {
            bytes >> self.page.trailing_zeros()
        } else {
            bytes / self.page
        }
    }

    /// Pages that `bytes` reach into.
    #[inline]
    fn pages_ceil(&self, bytes: u64) -> u64 {
        if self.page.is_power_of_two() {
            (bytes + self.page - 1) >> self.page.trailing_zeros()
        } else {
            bytes.div_ceil(self.page)
        }
    }

    /// Pages that `[addr, addr+len)` touches.
    pub fn touched(&self, addr: DevicePtr, len: u64) -> Range<usize> {
        let start = self.pages_floor(addr - self.base);
        let end = self.pages_ceil(addr + len - self.base);
        start as usize..end as usize
    }

    /// Pages lying wholly inside `[addr, addr+len)`.
    pub fn inside(&self, addr: DevicePtr, len: u64) -> Range<usize> {
        let start = self.pages_ceil(addr - self.base);
        let end = self.pages_floor(addr + len - self.base);
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

    /// Every mapped chunk as (address, bytes), in address order.
    pub fn chunk_ranges(&self) -> Vec<(DevicePtr, u64)> {
        self.firsts
            .iter()
            .map(|first| (self.va(*first), self.chunks[first].pages as u64 * self.page))
            .collect()
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

    /// Whether every page `[addr, addr+len)` touches is mapped (`unmapped_pages` is 0).
    pub fn all_mapped(&self, addr: DevicePtr, len: u64) -> bool {
        self.mapped.all(self.touched(addr, len))
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
        // Most requests land on mapped pages: that needs no count.
        if self.all_mapped(start, len) {
            return (0, start);
        }
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

    /// A block `[addr, addr+len)` was freed `frees` times (usually 1; more for a block a
    /// thread front served meanwhile), the last at `seq`. Returns whether one of these frees
    /// should record a fence: the first, then every `FREES_PER_FENCE`-th.
    pub fn note_free(&mut self, addr: DevicePtr, len: u64, seq: u64, frees: u32) -> bool {
        let touched = self.touched(addr, len);
        match &mut self.unstamped {
            // Seqs only grow: the newer free of the same pages stamps the same chunks later.
            Some((pages, last)) if *pages == touched => *last = seq,
            _ => {
                self.stamp_free();
                self.unstamped = Some((touched, seq));
            }
        }
        let into = self.frees_since_fence % FREES_PER_FENCE;
        let due = into == 0 || into as u64 + frees as u64 > FREES_PER_FENCE as u64;
        self.frees_since_fence = self.frees_since_fence.wrapping_add(frees);
        due
    }

    /// Stamps the unstamped free, if any, on the chunks it touches.
    fn stamp_free(&mut self) {
        if let Some((touched, seq)) = self.unstamped.take() {
            // A mapped page lies in the chunk starting last at or before it; the other
            // chunks the block touches start inside it.
            let holding_start = if self.mapped.get(touched.start) {
                self.starts.last_at_or_below(touched.start)
            } else {
                None
            };
            let inside = self.starts.ones(touched.start + 1..touched.end);
            for first in holding_start.into_iter().chain(inside) {
                self.chunks.get_mut(&first).expect("listed").last_free = seq;
            }
        }
    }

    /// The `free_seq` of the last free of a block on `chunk`'s pages (0: none since it was
    /// mapped): the device's last use of them came before that free.
    pub fn last_free(&self, chunk: &Chunk) -> u64 {
        let end = chunk.first + chunk.pages;
        match &self.unstamped {
            // As `stamp_free` picks them: the chunk holding the first page touched, or one
            // starting inside the pages touched.
            Some((touched, seq))
                if (chunk.first <= touched.start && touched.start < end)
                    || (touched.start < chunk.first && chunk.first < touched.end) =>
            {
                *seq
            }
            _ => chunk.last_free,
        }
    }

    /// `spare` is now mapped at pages `first..`.
    pub fn set_chunk(&mut self, first: usize, spare: Spare) {
        self.stamp_free();
        let chunk = Chunk {
            handle: spare.handle,
            first,
            pages: spare.pages,
            last_free: 0,
        };
        self.chunks.insert(first, chunk);
        self.firsts.insert(first);
        self.starts.set(first);
        for i in first..first + spare.pages {
            self.mapped.set(i);
            self.mapped_set.insert(i);
        }
    }

    /// The chunk starting at page `first` is no longer mapped: its memory.
    pub fn take_chunk(&mut self, first: usize) -> Spare {
        self.stamp_free();
        let chunk = self.chunks.remove(&first).expect("chunks are taken whole");
        self.firsts.remove(&first);
        self.starts.clear(first);
        for i in first..first + chunk.pages {
            self.mapped.clear(i);
            self.mapped_set.remove(&i);
        }
        Spare {
            handle: chunk.handle,
            pages: chunk.pages,
        }
    }

    pub fn va(&self, page: usize) -> DevicePtr {
        self.base + page as u64 * self.page
    }
}

/// Pages in `spares`.
pub fn pages_of(spares: &[Spare]) -> usize {
    spares.iter().map(|s| s.pages).sum()
}

/// A shard's paged segments, sorted by base address. There are few (one per stream and
/// pool in use) and every paged free and fit looks one up by an address inside it: a
/// binary search over a short vector costs less than a B-tree's range descent.
#[derive(Default)]
pub struct PagedSegments {
    sorted: Vec<PagedSegment>,
}

impl PagedSegments {
    /// The index of the last segment starting at or below `addr`.
    fn last_at_or_below(&self, addr: DevicePtr) -> Option<usize> {
        self.sorted
            .partition_point(|s| s.base <= addr)
            .checked_sub(1)
    }

    fn index_of(&self, base: DevicePtr) -> Option<usize> {
        self.sorted.binary_search_by_key(&base, |s| s.base).ok()
    }

    /// The segment holding `addr` (which must lie in one).
    pub fn holding_mut(&mut self, addr: DevicePtr) -> &mut PagedSegment {
        let i = self
            .last_at_or_below(addr)
            .expect("a paged block has a segment");
        &mut self.sorted[i]
    }

    /// The segment starting at `base`.
    pub fn get(&self, base: DevicePtr) -> Option<&PagedSegment> {
        self.index_of(base).map(|i| &self.sorted[i])
    }

    pub fn get_mut(&mut self, base: DevicePtr) -> Option<&mut PagedSegment> {
        self.index_of(base).map(|i| &mut self.sorted[i])
    }

    /// Adds a segment; its base must be new (address ranges are the driver's, disjoint).
    pub fn insert(&mut self, seg: PagedSegment) {
        let at = self.sorted.partition_point(|s| s.base < seg.base);
        debug_assert!(self.sorted.get(at).is_none_or(|s| s.base != seg.base));
        self.sorted.insert(at, seg);
    }

    pub fn remove(&mut self, base: DevicePtr) -> Option<PagedSegment> {
        self.index_of(base).map(|i| self.sorted.remove(i))
    }

    /// Every segment, by base address.
    pub fn iter(&self) -> impl Iterator<Item = &PagedSegment> + '_ {
        self.sorted.iter()
    }
}

/// The paged segment holding `addr` (which must lie in one), with its base address.
pub fn segment_at(segments: &PagedSegments, addr: DevicePtr) -> (DevicePtr, &PagedSegment) {
    let i = segments
        .last_at_or_below(addr)
        .expect("a paged block has a segment");
    let seg = &segments.sorted[i];
    (seg.base, seg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Page ranges come out as by division, for power-of-two page sizes (shifted) and others.
    #[test]
    fn page_ranges_match_division() {
        for page in [1u64 << 21, 3 << 19, 4096] {
            let base = 7 * page;
            let seg = PagedSegment::new(base, 256 * page, page, StreamId(0), PoolKind::Large);
            for off in (0..40 * page).step_by(page as usize / 4 + 512) {
                for len in [512, page - 512, page, page + 1, 5 * page + 3] {
                    let (a, b) = (off, off + len);
                    assert_eq!(
                        seg.touched(base + off, len),
                        (a / page) as usize..b.div_ceil(page) as usize
                    );
                    let inside = seg.inside(base + off, len);
                    let (lo, hi) = (a.div_ceil(page) as usize, (b / page) as usize);
                    assert_eq!(inside, lo..hi.max(lo));
                }
            }
        }
    }

    /// A free stamps exactly the chunks its pages touch (`chunks_over`), whatever the chunk
    /// sizes and gaps between them.
    #[test]
    fn note_free_stamps_the_chunks_the_block_touches() {
        const PAGE: u64 = 1 << 21;
        let mut seg = PagedSegment::new(0, 64 * PAGE, PAGE, StreamId(0), PoolKind::Large);
        let mut first = 1;
        for (i, pages) in [4, 1, 8, 4, 2, 4].into_iter().enumerate() {
            seg.set_chunk(
                first,
                Spare {
                    handle: PhysHandle(i as u64),
                    pages,
                },
            );
            first += pages + i % 2;
        }
        let mut seq = 0;
        for start in (0..30 * PAGE).step_by(PAGE as usize / 2) {
            for len in [512, PAGE / 2, PAGE, 3 * PAGE + 512, 9 * PAGE] {
                seq += 1;
                let want: Vec<usize> = seg
                    .chunks_over(seg.touched(start, len))
                    .map(|c| c.first)
                    .collect();
                seg.note_free(start, len, seq, 1);
                let stamped: Vec<usize> = seg
                    .firsts
                    .iter()
                    .filter(|&first| seg.last_free(&seg.chunks[first]) == seq)
                    .copied()
                    .collect();
                assert_eq!(stamped, want, "[{start:#x}, +{len:#x})");
            }
        }
    }

    #[test]
    fn frees_noted_together_are_due_a_fence_as_one_by_one() {
        let (base, page) = (1u64 << 30, 2u64 << 20);
        let mut seg = PagedSegment::new(base, 16 * page, page, StreamId(0), PoolKind::Large);
        let mut one_by_one = Vec::new();
        for seq in 1..=40u64 {
            one_by_one.push(seg.note_free(base, page, seq, 1));
        }
        for together in [1u32, 3, 15, 16, 17, 40] {
            let mut seg = PagedSegment::new(base, 16 * page, page, StreamId(0), PoolKind::Large);
            let mut seq = 0u64;
            while seq < 40 {
                let frees = together.min(40 - seq as u32);
                let due = seg.note_free(base, page, seq + frees as u64, frees);
                let expected = one_by_one[seq as usize..(seq + frees as u64) as usize]
                    .iter()
                    .any(|&d| d);
                assert_eq!(due, expected, "{together} at a time, from free {seq}");
                seq += frees as u64;
            }
        }
    }
}
