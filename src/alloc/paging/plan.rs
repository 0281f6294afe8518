//! Where growth's memory comes from and goes: the runs of missing pages a request fills
//! (`Plan`), and the chunks under free blocks that may be unmapped for it (`Victim`s).

use super::table::{chunk_pages_for, segment_at, PagedSegments, Spare};
use crate::alloc::core::blocks::BlockArena;
use crate::alloc::core::free_lists::Caches;
use crate::alloc::sizing::PoolKind;
use crate::driver::{DevicePtr, StreamId};
use std::ops::Range;

/// The (stream, pool)s whose free lists the next reclaim search looks at (see
/// `reclaim_candidates`): a set that remembers the key marked last, since nearly every free
/// marks its own (stream, pool) again, which then costs a compare instead of a hash.
#[derive(Default)]
pub struct DirtyKeys {
    keys: rustc_hash::FxHashSet<(StreamId, PoolKind)>,
    /// In `keys` whenever it is `Some`.
    last: Option<(StreamId, PoolKind)>,
}

impl DirtyKeys {
    #[inline]
    pub fn insert(&mut self, key: (StreamId, PoolKind)) {
        if self.last == Some(key) {
            return;
        }
        self.keys.insert(key);
        self.last = Some(key);
    }

    /// Whether `key` was marked.
    pub fn remove(&mut self, key: &(StreamId, PoolKind)) -> bool {
        if self.last == Some(*key) {
            self.last = None;
        }
        self.keys.remove(key)
    }

    /// The marked keys, in no order.
    pub fn iter(&self) -> impl Iterator<Item = &(StreamId, PoolKind)> + '_ {
        self.keys.iter()
    }
}

/// A chunk wholly under a free block: a candidate to unmap.
pub struct Victim {
    pub segment: DevicePtr,
    pub first: usize,
    pub pages: usize,
    /// The segment's stream, and the last free on the chunk's pages (see
    /// `Chunk::last_free`).
    pub stream: StreamId,
    pub last_free: u64,
}

/// Where growth maps memory: the runs of missing pages, filled chunk by chunk.
pub struct Plan {
    /// Unfilled runs of pages, `start..end`.
    pub gaps: Vec<Range<usize>>,
    /// Memory placed so far: (first page, memory).
    pub placed: Vec<(usize, Spare)>,
    /// The page slack of the growth, in pages: new chunks are sized against it too
    /// (`chunk_pages_for`).
    slack_pages: usize,
}

/// The runs of consecutive pages in `missing` (ascending page indices).
pub fn runs_of(missing: &[usize]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for &i in missing {
        match runs.last_mut() {
            Some(run) if run.end == i => run.end += 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

impl Plan {
    /// A plan to fill the pages `missing`, for a growth allowed `slack_pages` beyond the
    /// live high-water mark.
    pub fn new(missing: &[usize], slack_pages: usize) -> Self {
        Self {
            gaps: runs_of(missing),
            placed: Vec::new(),
            slack_pages,
        }
    }

    /// Pages per new chunk for a run of `run` pages (`chunk_pages_for`).
    pub fn chunk_pages(&self, run: usize, coarse: bool) -> usize {
        chunk_pages_for(run, self.slack_pages, coarse)
    }

    pub fn unfilled(&self) -> usize {
        self.gaps.iter().map(|g| g.len()).sum()
    }

    pub fn place(&mut self, gap: usize, spare: Spare) {
        let at = self.gaps[gap].start;
        self.gaps[gap].start += spare.pages;
        self.placed.push((at, spare));
    }

    /// Places what fits of `spares`, largest first, each at the start of the first gap
    /// with room; what fits nowhere stays in `spares`.
    pub fn fill(&mut self, spares: &mut Vec<Spare>) {
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

    /// Pages of the longest unfilled run: the largest chunk that fits somewhere.
    pub fn largest_gap(&self) -> usize {
        self.gaps.iter().map(|g| g.len()).max().unwrap_or(0)
    }

    pub fn placed_pages(&self) -> usize {
        self.placed.iter().map(|(_, s)| s.pages).sum()
    }
}

/// Chunks wholly under free paged blocks, in preference order: `also` (the rest of the
/// block being carved) first, then the largest free blocks, highest pages first. Only the
/// free lists of (stream, pool)s in `dirty` are searched: the others held no
/// such chunk when last searched, and none has been freed or merged into them since (see
/// `State::mark_reclaim_dirty`), so the search costs what has changed, not what every
/// stream holds. Returns the candidates, the (stream, pool)s found without any (to be
/// marked clean), and the work done (blocks and chunks visited).
pub fn reclaim_candidates(
    blocks: &BlockArena,
    caches: &Caches,
    segments: &PagedSegments,
    dirty: &DirtyKeys,
    also: Range<DevicePtr>,
) -> (Vec<Victim>, Vec<(StreamId, PoolKind)>, u64) {
    let mut ranges: Vec<(DevicePtr, u64)> = Vec::new();
    if !also.is_empty() {
        ranges.push((also.start, also.end - also.start));
    }
    let mut dirty: Vec<(StreamId, PoolKind)> = dirty.iter().copied().collect();
    dirty.sort_unstable();
    let mut steps = 0u64;
    let mut clean = Vec::new();
    for pool in [PoolKind::Large, PoolKind::Small] {
        let list = caches.general(pool);
        let start = ranges.len();
        for &(stream, _) in dirty.iter().filter(|(_, p)| *p == pool) {
            ranges.extend(
                list.ids_of(stream)
                    .map(|id| blocks.get(id))
                    .filter(|b| b.paged())
                    .map(|b| (b.addr(), b.size())),
            );
        }
        steps += (ranges.len() - start) as u64;
        ranges[start..].sort_by_key(|&(_, size)| std::cmp::Reverse(size));
    }
    let mut candidates = Vec::new();
    let mut found: rustc_hash::FxHashSet<(StreamId, PoolKind)> = Default::default();
    for (addr, size) in ranges {
        let (base, seg) = segment_at(segments, addr);
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
                    last_free: seg.last_free(chunk),
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
pub fn take_until(into: &mut Vec<Victim>, taken: &mut usize, from: Vec<Victim>, limit: usize) {
    for v in from {
        if *taken >= limit {
            break;
        }
        *taken += v.pages;
        into.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marks and removals in random order: the keys are always a plain set's.
    #[test]
    fn dirty_keys_hold_what_a_set_holds() {
        let mut keys = DirtyKeys::default();
        let mut set = std::collections::BTreeSet::new();
        let mut seed = 7u64;
        for step in 0..5000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let pool = [PoolKind::Small, PoolKind::Large][(seed >> 8) as usize % 2];
            let key = (StreamId((seed >> 16) % 3), pool);
            if seed.is_multiple_of(3) {
                assert_eq!(keys.remove(&key), set.remove(&key), "step {step}");
            } else {
                keys.insert(key);
                set.insert(key);
            }
            let mut held: Vec<_> = keys.iter().copied().collect();
            held.sort_unstable();
            assert_eq!(held, set.iter().copied().collect::<Vec<_>>(), "step {step}");
        }
    }
}
