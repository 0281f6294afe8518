//! The free blocks of one stream in one pool, ordered by (size, address) for best fit, as a
//! B-tree would order them but without one on the hot path: blocks under 2 MiB (every block
//! of steady small-block churn) sit in exact 512-byte size classes, found through a two-level
//! bitmap of the non-empty classes, each class a short vector sorted by (size, address);
//! larger blocks (few: big cached blocks, a paged segment's unused remainder) stay in a
//! B-tree. Best fit, the next fits in order, and insert/remove of a small block then cost a
//! few word scans and a short vector shift instead of B-tree descents and node shifts (which
//! took 46% of small churn).

use crate::driver::DevicePtr;
use std::collections::BTreeMap;

use super::blocks::BlockId;

/// Size classes are this wide; the allocator rounds sizes to multiples of it.
const CLASS_BYTES: u64 = 512;
/// Blocks smaller than `EXACT_CLASSES * CLASS_BYTES` (2 MiB) are kept in size classes.
const EXACT_CLASSES: usize = 4096;
const WORDS: usize = EXACT_CLASSES / 64;

/// (size, address, id), ordered by (size, address).
type Entry = (u64, DevicePtr, BlockId);

#[derive(Default)]
pub struct SizeIndex {
    /// Per class, its blocks sorted by (size, address); grown to the highest class used.
    classes: Vec<Vec<Entry>>,
    /// Bit c: class c is non-empty.
    words: Vec<u64>,
    /// Bit w: `words[w]` is non-zero.
    summary: u64,
    big: BTreeMap<(u64, DevicePtr), BlockId>,
}

fn class_of(size: u64) -> Option<usize> {
    let class = size / CLASS_BYTES;
    (class < EXACT_CLASSES as u64).then_some(class as usize)
}

impl SizeIndex {
    pub fn is_empty(&self) -> bool {
        self.summary == 0 && self.big.is_empty()
    }

    /// Adds a block; false (and nothing changed) if one of this size and address is listed.
    pub fn insert(&mut self, size: u64, addr: DevicePtr, id: BlockId) -> bool {
        let Some(class) = class_of(size) else {
            return match self.big.entry((size, addr)) {
                std::collections::btree_map::Entry::Occupied(_) => false,
                std::collections::btree_map::Entry::Vacant(slot) => {
                    slot.insert(id);
                    true
                }
            };
        };
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
            self.words.resize(WORDS, 0);
        }
        let blocks = &mut self.classes[class];
        let at = blocks.partition_point(|e| (e.0, e.1) < (size, addr));
        if blocks.get(at).is_some_and(|e| (e.0, e.1) == (size, addr)) {
            return false;
        }
        blocks.insert(at, (size, addr, id));
        self.words[class / 64] |= 1 << (class % 64);
        self.summary |= 1 << (class / 64);
        true
    }

    pub fn remove(&mut self, size: u64, addr: DevicePtr) -> Option<BlockId> {
        let Some(class) = class_of(size) else {
            return self.big.remove(&(size, addr));
        };
        let blocks = self.classes.get_mut(class)?;
        let at = blocks
            .binary_search_by(|e| (e.0, e.1).cmp(&(size, addr)))
            .ok()?;
        let (_, _, id) = blocks.remove(at);
        if blocks.is_empty() {
            let word = &mut self.words[class / 64];
            *word &= !(1 << (class % 64));
            if *word == 0 {
                self.summary &= !(1 << (class / 64));
            }
        }
        Some(id)
    }

    /// The first non-empty class at or above `from`.
    fn next_class(&self, from: usize) -> Option<usize> {
        if from >= EXACT_CLASSES || self.summary == 0 {
            return None;
        }
        let w = from / 64;
        let here = self.words[w] & (u64::MAX << (from % 64));
        if here != 0 {
            return Some(w * 64 + here.trailing_zeros() as usize);
        }
        let above = self.summary & u64::MAX.checked_shl(w as u32 + 1).unwrap_or(0);
        if above == 0 {
            return None;
        }
        let w = above.trailing_zeros() as usize;
        Some(w * 64 + self.words[w].trailing_zeros() as usize)
    }

    /// The last non-empty class at or below `upto`.
    fn prev_class(&self, upto: usize) -> Option<usize> {
        if self.summary == 0 {
            return None;
        }
        let upto = upto.min(EXACT_CLASSES - 1);
        let w = upto / 64;
        let here = self.words[w] & (u64::MAX >> (63 - upto % 64));
        if here != 0 {
            return Some(w * 64 + 63 - here.leading_zeros() as usize);
        }
        let below = self.summary & ((1u64 << w) - 1);
        if below == 0 {
            return None;
        }
        let w = 63 - below.leading_zeros() as usize;
        Some(w * 64 + 63 - self.words[w].leading_zeros() as usize)
    }

    /// Blocks of at least `size` bytes, smallest first (then lowest address): (size, id).
    pub fn fits(&self, size: u64) -> Fits<'_> {
        let class = class_of(size);
        Fits {
            index: self,
            size,
            class: class.and_then(|c| self.next_class(c)),
            pos: 0,
            big: None,
        }
    }

    /// The largest block (highest address among equals), if it holds at least `size` bytes.
    pub fn largest_fit(&self, size: u64) -> Option<BlockId> {
        let (found, id) = match self.big.last_key_value() {
            Some((&(found, _), &id)) => (found, id),
            None => {
                let class = self.prev_class(EXACT_CLASSES - 1)?;
                let &(found, _, id) = self.classes[class].last()?;
                (found, id)
            }
        };
        (found >= size).then_some(id)
    }

    /// Blocks of at least `min_size` bytes, largest first.
    pub fn largest_first(&self, min_size: u64) -> Vec<BlockId> {
        let mut out: Vec<BlockId> = self
            .big
            .range((min_size, 0)..)
            .rev()
            .map(|(_, &id)| id)
            .collect();
        let lowest = class_of(min_size).unwrap_or(EXACT_CLASSES);
        let mut class = self.prev_class(EXACT_CLASSES - 1);
        while let Some(c) = class.filter(|&c| c >= lowest) {
            out.extend(
                self.classes[c]
                    .iter()
                    .rev()
                    .filter(|e| e.0 >= min_size)
                    .map(|e| e.2),
            );
            class = c.checked_sub(1).and_then(|c| self.prev_class(c));
        }
        out
    }

    /// Every block, smallest first (then lowest address).
    pub fn ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.fits(0).map(|(_, id)| id)
    }
}

/// `SizeIndex::fits`: the size classes from the request's up, then the large blocks.
pub struct Fits<'a> {
    index: &'a SizeIndex,
    size: u64,
    /// The class being read (`None`: past the classes, reading `big`).
    class: Option<usize>,
    pos: usize,
    big: Option<std::collections::btree_map::Range<'a, (u64, DevicePtr), BlockId>>,
}

impl Iterator for Fits<'_> {
    type Item = (u64, BlockId);

    fn next(&mut self) -> Option<Self::Item> {
        while let Some(class) = self.class {
            let blocks = &self.index.classes[class];
            while let Some(&(size, _, id)) = blocks.get(self.pos) {
                self.pos += 1;
                if size >= self.size {
                    return Some((size, id));
                }
            }
            self.class = self.index.next_class(class + 1);
            self.pos = 0;
        }
        let size = self.size;
        let index = self.index;
        self.big
            .get_or_insert_with(|| index.big.range((size, 0)..))
            .next()
            .map(|(&(size, _), &id)| (size, id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a B-tree of (size, address), the order the index stands in for: random inserts
    /// and removes of sizes on both sides of the class limit (odd sizes too), each query
    /// compared after every change.
    #[test]
    fn orders_like_a_btree_of_size_and_address() {
        let mut seed = 0x2545F4914F6CDD1Du64;
        let mut rand = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..40 {
            let mut index = SizeIndex::default();
            let mut reference: BTreeMap<(u64, DevicePtr), BlockId> = BTreeMap::new();
            let span = [4 << 10, 64 << 10, 2 << 20, 8 << 20][round % 4];
            for step in 0..600u32 {
                let remove = !reference.is_empty() && rand(3) == 0;
                if remove {
                    let nth = rand(reference.len() as u64) as usize;
                    let (&(size, addr), &id) = reference.iter().nth(nth).unwrap();
                    reference.remove(&(size, addr));
                    assert_eq!(index.remove(size, addr), Some(id));
                    assert_eq!(index.remove(size, addr), None, "removed twice");
                } else {
                    let size = if rand(4) == 0 {
                        1 + rand(span)
                    } else {
                        (1 + rand(span / 512)) * 512
                    };
                    let addr = rand(64) << 21;
                    let fresh = !reference.contains_key(&(size, addr));
                    assert_eq!(index.insert(size, addr, step), fresh);
                    if fresh {
                        reference.insert((size, addr), step);
                    }
                }
                let probe = rand(span + span / 4);
                let want: Vec<(u64, BlockId)> = reference
                    .range((probe, 0)..)
                    .take(40)
                    .map(|(&(s, _), &id)| (s, id))
                    .collect();
                assert_eq!(index.fits(probe).take(40).collect::<Vec<_>>(), want);
                let largest = reference
                    .last_key_value()
                    .filter(|(&(s, _), _)| s >= probe)
                    .map(|(_, &id)| id);
                assert_eq!(index.largest_fit(probe), largest);
                let want: Vec<BlockId> = reference
                    .range((probe, 0)..)
                    .rev()
                    .map(|(_, &id)| id)
                    .collect();
                assert_eq!(index.largest_first(probe), want);
                assert_eq!(
                    index.ids().collect::<Vec<_>>(),
                    reference.values().copied().collect::<Vec<_>>()
                );
                assert_eq!(index.is_empty(), reference.is_empty());
            }
        }
    }

    #[test]
    fn class_scans_cross_words_and_ends() {
        let mut index = SizeIndex::default();
        let top = (EXACT_CLASSES as u64 - 1) * CLASS_BYTES;
        for (i, size) in [512, 64 * 512, 65 * 512, top].into_iter().enumerate() {
            assert!(index.insert(size, 0, i as BlockId));
        }
        let all: Vec<_> = index.fits(1).collect();
        assert_eq!(all, vec![(512, 0), (64 * 512, 1), (65 * 512, 2), (top, 3)]);
        assert_eq!(index.fits(top + 1).next(), None);
        assert_eq!(index.largest_fit(top), Some(3));
        assert_eq!(index.largest_first(600), vec![3, 2, 1]);
        assert!(index.insert(2 << 20, 0, 9));
        assert_eq!(index.fits(top + 1).next(), Some((2 << 20, 9)));
        assert_eq!(index.largest_fit(0), Some(9));
    }
}
