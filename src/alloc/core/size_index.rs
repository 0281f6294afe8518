//! The free blocks of one stream in one pool, ordered by (size, address) for best fit.

// As a B-tree would order them, but without one on the hot path: blocks under 2 MiB (every
// block of steady small-block churn) sit in exact 512-byte size classes, found through a
// two-level bitmap of the non-empty classes, each class its lowest (size, address) held
// inline (its best fit: most classes hold one block, so a fit, insert or remove reads only
// the class table, not a buffer of its own) and the rest in a short vector sorted from the
// largest down, so that the next best fit is taken from the end without a shift; larger blocks (few: big cached blocks, a paged segment's unused remainder) stay
// in a B-tree, as do blocks of a class that already holds `CLASS_CAP` (thousands of free
// blocks of one size would make a vector's shifts slow). Queries merge the two in order.
// Best fit, the next fits in order, and insert/remove of a small block then cost a few word
// scans and a short vector shift instead of B-tree descents and node shifts, which dominate
// small-block churn otherwise.

use crate::driver::DevicePtr;
use std::collections::BTreeMap;

use super::blocks::BlockId;

/// Size classes are this wide; the allocator rounds sizes to multiples of it.
const CLASS_BYTES: u64 = 512;
/// Blocks smaller than `EXACT_CLASSES * CLASS_BYTES` (2 MiB) are kept in size classes.
const EXACT_CLASSES: usize = 4096;
const WORDS: usize = EXACT_CLASSES / 64;
/// Blocks kept in one class's vector; more of that class go to the B-tree. Small-block churn
/// leaves a hundred or more free blocks in the smallest classes: a spill costs them B-tree
/// searches on every insert, fit and remove, far more than a vector shift of 6 KiB at most.
const CLASS_CAP: usize = 256;

/// (size, address, id), ordered by (size, address).
type Entry = (u64, DevicePtr, BlockId);

/// One size class's blocks; empty unless its bit in `SizeIndex::words` is set.
#[derive(Default)]
struct Class {
    /// The lowest (size, address): the class's best fit.
    head: Entry,
    /// The others, sorted by (size, address), descending.
    rest: Vec<Entry>,
}

impl Class {
    /// Blocks held, the head included (the class being non-empty).
    fn len(&self) -> usize {
        self.rest.len() + 1
    }

    /// The `pos`-th lowest entry (0: the head), the class being non-empty.
    #[inline]
    fn nth_lowest(&self, pos: usize) -> Option<&Entry> {
        match pos {
            0 => Some(&self.head),
            _ => self.rest.len().checked_sub(pos).map(|i| &self.rest[i]),
        }
    }

    /// The highest entry, the class being non-empty.
    fn highest(&self) -> Entry {
        self.rest.first().copied().unwrap_or(self.head)
    }

    /// Every entry, highest first, the class being non-empty.
    fn descending(&self) -> impl Iterator<Item = &Entry> {
        self.rest.iter().chain(std::iter::once(&self.head))
    }
}

pub struct SizeIndex {
    /// Per class, up to `CLASS_CAP` of its blocks; grown to the highest class used.
    classes: Vec<Class>,
    /// Bit c: class c is non-empty. Inline, as `spilled`: every fit, insert and remove reads
    /// them, and a stream's index is made once.
    words: [u64; WORDS],
    /// Bit w: `words[w]` is non-zero.
    summary: u64,
    /// Blocks of 2 MiB or more, and those that found their class full.
    big: BTreeMap<(u64, DevicePtr), BlockId>,
    /// Bit c: some blocks of class c are in `big` (so a duplicate check must look there).
    spilled: [u64; WORDS],
    /// Bit w: `spilled[w]` is non-zero.
    spilled_summary: u64,
    /// `big`'s first key: a best fit below it never opens the B-tree.
    big_first: Option<(u64, DevicePtr)>,
}

impl Default for SizeIndex {
    fn default() -> Self {
        SizeIndex {
            classes: Vec::new(),
            words: [0; WORDS],
            summary: 0,
            big: BTreeMap::new(),
            spilled: [0; WORDS],
            spilled_summary: 0,
            big_first: None,
        }
    }
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
            return self.insert_big(size, addr, id);
        };
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Class::default);
        }
        let spilled = self.is_spilled(class);
        let key = (size, addr);
        if self.words[class / 64] & (1 << (class % 64)) == 0 {
            if spilled && self.big.contains_key(&key) {
                return false;
            }
            self.classes[class].head = (size, addr, id);
            self.words[class / 64] |= 1 << (class % 64);
            self.summary |= 1 << (class / 64);
            return true;
        }
        let blocks = &mut self.classes[class];
        let head = (blocks.head.0, blocks.head.1);
        // Where in `rest` it goes (unless it becomes the head), and whether it is listed.
        let (at, listed) = if key < head {
            (blocks.rest.len(), false)
        } else if key == head {
            (0, true)
        } else {
            let at = blocks.rest.partition_point(|e| (e.0, e.1) > key);
            let listed = blocks.rest.get(at).is_some_and(|e| (e.0, e.1) == key);
            (at, listed)
        };
        if listed {
            return false;
        }
        if blocks.len() >= CLASS_CAP {
            self.spilled[class / 64] |= 1 << (class % 64);
            self.spilled_summary |= 1 << (class / 64);
            return self.insert_big(size, addr, id);
        }
        if spilled && self.big.contains_key(&key) {
            return false;
        }
        let blocks = &mut self.classes[class];
        if key < head {
            let old = std::mem::replace(&mut blocks.head, (size, addr, id));
            blocks.rest.push(old);
        } else {
            blocks.rest.insert(at, (size, addr, id));
        }
        true
    }

    fn insert_big(&mut self, size: u64, addr: DevicePtr, id: BlockId) -> bool {
        match self.big.entry((size, addr)) {
            std::collections::btree_map::Entry::Occupied(_) => false,
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(id);
                if self.big_first.is_none_or(|first| (size, addr) < first) {
                    self.big_first = Some((size, addr));
                }
                true
            }
        }
    }

    fn remove_big(&mut self, size: u64, addr: DevicePtr) -> Option<BlockId> {
        let id = self.big.remove(&(size, addr))?;
        if self.big_first == Some((size, addr)) {
            self.big_first = self.big.first_key_value().map(|(&key, _)| key);
        }
        Some(id)
    }

    /// Whether some class from `lo`'s to `hi`'s (sizes under 2 MiB, `lo <= hi`) has blocks in
    /// `big`. When none has, every block in `big` of at least `lo` bytes is larger than any
    /// of those classes' (a block under 2 MiB is in `big` only as its class's spill).
    fn spilled_between(&self, lo: u64, hi: u64) -> bool {
        if self.spilled_summary == 0 {
            return false;
        }
        let (lo, hi) = ((lo / CLASS_BYTES) as usize, (hi / CLASS_BYTES) as usize);
        let (first, last) = (lo / 64, hi / 64);
        let from_lo = self.spilled[first] & (u64::MAX << (lo % 64));
        let upto_hi = self.spilled[last] & (u64::MAX >> (63 - hi % 64));
        if first == last {
            return from_lo & upto_hi != 0;
        }
        let between = self.spilled_summary & (u64::MAX << (first + 1)) & ((1 << last) - 1);
        from_lo != 0 || upto_hi != 0 || between != 0
    }

    fn is_spilled(&self, class: usize) -> bool {
        self.spilled[class / 64] & (1 << (class % 64)) != 0
    }

    /// Removes a block of `class` from `big`; the class stops counting as spilled once none
    /// of its blocks is left there.
    fn remove_spilled(&mut self, class: usize, size: u64, addr: DevicePtr) -> Option<BlockId> {
        if !self.is_spilled(class) {
            return None;
        }
        let id = self.remove_big(size, addr)?;
        let lo = class as u64 * CLASS_BYTES;
        if self
            .big
            .range((lo, 0)..(lo + CLASS_BYTES, 0))
            .next()
            .is_none()
        {
            let word = &mut self.spilled[class / 64];
            *word &= !(1 << (class % 64));
            if *word == 0 {
                self.spilled_summary &= !(1 << (class / 64));
            }
        }
        Some(id)
    }

    pub fn remove(&mut self, size: u64, addr: DevicePtr) -> Option<BlockId> {
        let Some(class) = class_of(size) else {
            return self.remove_big(size, addr);
        };
        let listed = self.words[class / 64] & (1 << (class % 64)) != 0;
        if !listed {
            return self.remove_spilled(class, size, addr);
        }
        let blocks = &mut self.classes[class];
        if (blocks.head.0, blocks.head.1) == (size, addr) {
            // The best fit, usually: taken without a search or a shift.
            let id = blocks.head.2;
            self.pop_head(class);
            return Some(id);
        }
        match blocks
            .rest
            .binary_search_by(|e| (size, addr).cmp(&(e.0, e.1)))
        {
            Ok(at) => Some(blocks.rest.remove(at).2),
            Err(_) => self.remove_spilled(class, size, addr),
        }
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
        Fits {
            index: self,
            size,
            class: class_of(size).and_then(|c| self.next_class(c)),
            pos: 0,
            big: None,
        }
    }

    /// The smallest block of at least `size` bytes (lowest address among equals): as
    /// `fits(size).next()`, without the iterator's state (every alloc asks this).
    pub fn best_fit(&self, size: u64) -> Option<(u64, BlockId)> {
        self.locate_best_fit(size).map(|(e, _)| (e.0, e.2))
    }

    /// The best fit for `size`, removed if `keep(size, id)` says so: `Ok` with it removed,
    /// else `Err` with it still listed (`None`: nothing fits). Every alloc takes its best
    /// fit: found as a class's head, it comes off without a second search.
    #[inline]
    pub fn take_best_fit(
        &mut self,
        size: u64,
        keep: impl FnOnce(u64, BlockId) -> bool,
    ) -> Result<(u64, BlockId), Option<(u64, BlockId)>> {
        let Some((entry, head_of)) = self.locate_best_fit(size) else {
            return Err(None);
        };
        let fit = (entry.0, entry.2);
        if !keep(fit.0, fit.1) {
            return Err(Some(fit));
        }
        match head_of {
            Some(class) => self.pop_head(class),
            None => {
                let removed = self.remove(entry.0, entry.1);
                debug_assert_eq!(removed, Some(entry.2));
            }
        }
        Ok(fit)
    }

    /// The best fit for `size`, with the class it heads (`None`: it is in `big`, or not its
    /// class's head).
    #[inline]
    fn locate_best_fit(&self, size: u64) -> Option<(Entry, Option<usize>)> {
        let mut class = class_of(size).and_then(|c| self.next_class(c));
        let mut head = None;
        'classes: while let Some(c) = class {
            let blocks = &self.classes[c];
            let mut pos = 0;
            while let Some(&entry) = blocks.nth_lowest(pos) {
                if entry.0 >= size {
                    head = Some((entry, (pos == 0).then_some(c)));
                    break 'classes;
                }
                pos += 1;
            }
            class = self.next_class(c + 1);
        }
        if let Some((c, _)) = head {
            if self.big_first.is_none_or(|first| (c.0, c.1) < first)
                || !self.spilled_between(size, c.0)
            {
                return head;
            }
        }
        let big = self
            .big
            .range((size, 0)..)
            .next()
            .map(|(&(s, a), &id)| ((s, a, id), None));
        match (head, big) {
            (Some(c), Some(b)) => Some(if (b.0 .0, b.0 .1) < (c.0 .0, c.0 .1) {
                b
            } else {
                c
            }),
            (c, b) => c.or(b),
        }
    }

    /// Removes the head of non-empty `class`: the next lowest takes its place.
    #[inline]
    fn pop_head(&mut self, class: usize) {
        let blocks = &mut self.classes[class];
        match blocks.rest.pop() {
            Some(next) => blocks.head = next,
            None => {
                let word = &mut self.words[class / 64];
                *word &= !(1 << (class % 64));
                if *word == 0 {
                    self.summary &= !(1 << (class / 64));
                }
            }
        }
    }

    /// The largest block (highest address among equals), if it holds at least `size` bytes.
    pub fn largest_fit(&self, size: u64) -> Option<BlockId> {
        let big = self.big.last_key_value().map(|(&(s, a), &id)| (s, a, id));
        let class = self
            .prev_class(EXACT_CLASSES - 1)
            .map(|c| self.classes[c].highest());
        let (found, _, id) = big.into_iter().chain(class).max_by_key(|e| (e.0, e.1))?;
        (found >= size).then_some(id)
    }

    /// Blocks of at least `min_size` bytes, largest first.
    pub fn largest_first(&self, min_size: u64) -> Vec<BlockId> {
        let mut all: Vec<Entry> = self
            .big
            .range((min_size, 0)..)
            .map(|(&(s, a), &id)| (s, a, id))
            .collect();
        let lowest = class_of(min_size).unwrap_or(EXACT_CLASSES);
        let mut class = self.prev_class(EXACT_CLASSES - 1);
        while let Some(c) = class.filter(|&c| c >= lowest) {
            all.extend(self.classes[c].descending().filter(|e| e.0 >= min_size));
            class = c.checked_sub(1).and_then(|c| self.prev_class(c));
        }
        all.sort_unstable_by_key(|e| std::cmp::Reverse((e.0, e.1)));
        all.into_iter().map(|e| e.2).collect()
    }

    /// Every block, smallest first (then lowest address).
    pub fn ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.fits(0).map(|(_, id)| id)
    }
}

/// `SizeIndex::fits`: the size classes from the request's up, merged with the B-tree's
/// blocks in (size, address) order.
pub struct Fits<'a> {
    index: &'a SizeIndex,
    size: u64,
    /// The class being read (`None`: past the classes).
    class: Option<usize>,
    pos: usize,
    /// The B-tree's blocks from `size` on, opened only once a class entry is not certainly
    /// smaller than all of them (most best fits never descend the tree).
    big: Option<
        std::iter::Peekable<std::collections::btree_map::Range<'a, (u64, DevicePtr), BlockId>>,
    >,
}

impl Fits<'_> {
    /// The next class entry of at least `size` bytes, not consumed.
    fn class_head(&mut self) -> Option<Entry> {
        while let Some(class) = self.class {
            let blocks = &self.index.classes[class];
            // `pos` counts from the class's lowest (size, address).
            while let Some(&entry) = blocks.nth_lowest(self.pos) {
                if entry.0 >= self.size {
                    return Some(entry);
                }
                self.pos += 1;
            }
            self.class = self.index.next_class(class + 1);
            self.pos = 0;
        }
        None
    }
}

impl Iterator for Fits<'_> {
    type Item = (u64, BlockId);

    fn next(&mut self) -> Option<Self::Item> {
        let head = self.class_head();
        if self.big.is_none() {
            let below = |c: &Entry| self.index.big_first.is_some_and(|key| key <= (c.0, c.1));
            if let Some(c) = head.filter(|c| !below(c)) {
                self.pos += 1;
                return Some((c.0, c.2));
            }
            self.big = Some(self.index.big.range((self.size, 0)..).peekable());
        }
        let big = self.big.as_mut().expect("opened above");
        let b = big.peek().map(|(&(s, a), &id)| (s, a, id));
        match (head, b) {
            (Some(c), Some(b)) if (b.0, b.1) < (c.0, c.1) => {
                big.next();
                Some((b.0, b.2))
            }
            (Some(c), _) => {
                self.pos += 1;
                Some((c.0, c.2))
            }
            (None, Some(b)) => {
                big.next();
                Some((b.0, b.2))
            }
            (None, None) => None,
        }
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
        let mut rand = super::super::test_rng();
        for round in 0..40 {
            let mut index = SizeIndex::default();
            let mut reference: BTreeMap<(u64, DevicePtr), BlockId> = BTreeMap::new();
            let span = [4 << 10, 64 << 10, 2 << 20, 8 << 20][round % 4];
            // Enough inserts of few sizes to fill their classes.
            let steps = if round % 5 == 4 {
                CLASS_CAP as u32 * 20
            } else {
                600
            };
            for step in 0..steps {
                let remove = !reference.is_empty() && rand(4) == 0;
                if remove {
                    let nth = rand(reference.len() as u64) as usize;
                    let (&(size, addr), &id) = reference.iter().nth(nth).unwrap();
                    reference.remove(&(size, addr));
                    assert_eq!(index.remove(size, addr), Some(id));
                    assert_eq!(index.remove(size, addr), None, "removed twice");
                } else {
                    let (size, addr) = if round % 5 == 4 {
                        // Few sizes, many blocks each: classes overflow into the B-tree.
                        let sizes = [512, 1024, 1536, (2 << 20) - 1, 2 << 20, 1 << 56];
                        (sizes[rand(6) as usize], rand(4096) << 21)
                    } else if rand(4) == 0 {
                        (rand(span), rand(64) << 21)
                    } else {
                        ((1 + rand(span / 512)) * 512, rand(64) << 21)
                    };
                    let fresh = !reference.contains_key(&(size, addr));
                    assert_eq!(index.insert(size, addr, step), fresh);
                    if fresh {
                        reference.insert((size, addr), step);
                    }
                }
                let probe = [rand(span + span / 4), rand(4 << 20), 0, 512][rand(4) as usize];
                let want: Vec<(u64, BlockId)> = reference
                    .range((probe, 0)..)
                    .take(40)
                    .map(|(&(s, _), &id)| (s, id))
                    .collect();
                assert_eq!(index.fits(probe).take(40).collect::<Vec<_>>(), want);
                assert_eq!(index.best_fit(probe), want.first().copied());
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
                assert_eq!(
                    index.big_first,
                    index.big.first_key_value().map(|(&k, _)| k)
                );
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

    /// `spilled_between` reads whole words through the summary: it agrees with asking each
    /// class, for ranges within a word, across one boundary and across several.
    #[test]
    fn spilled_between_asks_every_class_in_range() {
        let mut rand = super::super::test_rng();
        for _ in 0..200 {
            let mut index = SizeIndex::default();
            for _ in 0..rand(24) {
                let class = rand(EXACT_CLASSES as u64) as usize;
                index.spilled[class / 64] |= 1 << (class % 64);
                index.spilled_summary |= 1 << (class / 64);
            }
            for _ in 0..50 {
                let lo = rand(2 << 20);
                let span = [1024, 64 << 10, 2 << 20][rand(3) as usize];
                let hi = lo + rand(span.min((2 << 20) - lo));
                let classes = (lo / CLASS_BYTES) as usize..=(hi / CLASS_BYTES) as usize;
                let want = classes.into_iter().any(|c| index.is_spilled(c));
                assert_eq!(index.spilled_between(lo, hi), want, "{lo}..={hi}");
            }
        }
    }

    #[test]
    fn a_full_class_spills_into_the_btree_in_order() {
        let mut index = SizeIndex::default();
        // Every other address first, then the ones between: spilled blocks interleave.
        let half = CLASS_CAP as u64 / 2 + 50;
        let addrs: Vec<u64> = (0..half)
            .map(|i| i * 2)
            .chain((0..half).map(|i| i * 2 + 1))
            .collect();
        for (i, &addr) in addrs.iter().enumerate() {
            assert!(index.insert(512, addr << 21, i as BlockId));
        }
        assert_eq!(index.classes[1].len(), CLASS_CAP);
        assert_eq!(index.classes[1].head.1, 0, "the lowest address is the head");
        assert_eq!(index.big.len(), addrs.len() - CLASS_CAP);
        assert!(
            !index.insert(512, 150 << 21, 999),
            "a spilled block is found as listed"
        );
        assert!(index.is_spilled(1) && !index.is_spilled(2));
        let order: Vec<u64> = index.fits(1).map(|(_, id)| addrs[id as usize]).collect();
        assert_eq!(order, (0..2 * half).collect::<Vec<u64>>());
        for &addr in &addrs {
            assert!(index.remove(512, addr << 21).is_some());
        }
        assert!(index.is_empty());
        assert!(
            !index.is_spilled(1),
            "no block of the class is left in the B-tree"
        );
    }
}
