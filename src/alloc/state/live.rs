//! The blocks handed out, by address: every alloc and free looks one up here.
//!
//! An open-addressing table (linear probing, deletion by backward shift, at most a quarter
//! full: short runs) of 8-byte slots: a block id and a tag, the address's bits above the
//! 512-byte grid. A lookup confirms a tag match on the block itself, which the caller reads
//! next anyway, so a free touches one slot and one block rather than a map's control group,
//! its bucket (address and id) and then the block; a removal finds its slot by id alone.

use crate::alloc::core::blocks::{BlockArena, BlockId};
use crate::driver::DevicePtr;

/// An empty slot's id (`BlockArena::insert` never hands it out).
const EMPTY: BlockId = BlockId::MAX;

#[derive(Clone, Copy)]
struct Slot {
    tag: u32,
    id: BlockId,
}

const VACANT: Slot = Slot { tag: 0, id: EMPTY };

/// Addresses of blocks lie on the 512-byte grid (`MIN_BLOCK_SIZE`): the tag is the grid
/// index's low 32 bits, distinct for blocks within 2 TiB of each other (others compare
/// equal on the tag and are told apart by their address).
#[inline]
fn tag_of(addr: DevicePtr) -> u32 {
    (addr >> 9) as u32
}

pub(super) struct LiveMap {
    /// A power of two long, at most a quarter full.
    slots: Vec<Slot>,
    len: usize,
    /// 64 - log2(slots.len()): a tag's home slot is its Fibonacci hash's top bits.
    shift: u32,
}

impl Default for LiveMap {
    fn default() -> Self {
        Self::with_slots(16)
    }
}

impl LiveMap {
    fn with_slots(n: usize) -> Self {
        debug_assert!(n.is_power_of_two());
        Self {
            slots: vec![VACANT; n],
            len: 0,
            shift: 64 - n.trailing_zeros(),
        }
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((tag as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    /// The live block at `addr`.
    #[inline]
    pub(super) fn get(&self, addr: DevicePtr, blocks: &BlockArena) -> Option<BlockId> {
        let tag = tag_of(addr);
        let mask = self.mask();
        let mut i = self.home(tag);
        loop {
            let slot = self.slots[i];
            if slot.id == EMPTY {
                return None;
            }
            if slot.tag == tag && blocks.get(slot.id).addr() == addr {
                return Some(slot.id);
            }
            i = (i + 1) & mask;
        }
    }

    /// Block `id`, at `addr`, is handed out (it is not listed yet).
    #[inline]
    pub(super) fn insert(&mut self, addr: DevicePtr, id: BlockId) {
        debug_assert_ne!(id, EMPTY);
        if (self.len + 1) * 4 > self.slots.len() {
            self.grow();
        }
        self.place(Slot {
            tag: tag_of(addr),
            id,
        });
        self.len += 1;
    }

    #[inline]
    fn place(&mut self, slot: Slot) {
        let mask = self.mask();
        let mut i = self.home(slot.tag);
        while self.slots[i].id != EMPTY {
            debug_assert_ne!(self.slots[i].id, slot.id, "block listed twice");
            i = (i + 1) & mask;
        }
        self.slots[i] = slot;
    }

    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let old = std::mem::replace(self, Self::with_slots(self.slots.len() * 2));
        for slot in old.slots.into_iter().filter(|s| s.id != EMPTY) {
            self.place(slot);
        }
        self.len = old.len;
    }

    /// Block `id`, at `addr`, is no longer handed out; false if it was not listed.
    #[inline]
    pub(super) fn remove(&mut self, addr: DevicePtr, id: BlockId) -> bool {
        let mask = self.mask();
        let mut hole = self.home(tag_of(addr));
        loop {
            match self.slots[hole].id {
                EMPTY => return false,
                found if found == id => break,
                _ => hole = (hole + 1) & mask,
            }
        }
        // Backward shift: each later slot of the run moves into the hole unless its home
        // lies cyclically after the hole (it would then be found before its home).
        let mut j = (hole + 1) & mask;
        loop {
            let slot = self.slots[j];
            if slot.id == EMPTY {
                break;
            }
            let home = self.home(slot.tag);
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.slots[hole] = slot;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = VACANT;
        self.len -= 1;
        true
    }

    /// Every live block id, in no particular order.
    pub(super) fn ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.slots.iter().filter(|s| s.id != EMPTY).map(|s| s.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::core::blocks::Block;
    use crate::alloc::sizing::PoolKind;
    use crate::driver::StreamId;
    use std::collections::HashMap;

    /// Against a hash map, through growth and many removals: addresses that share a tag
    /// (2 TiB apart) and crowd the same runs of slots are told apart, and every lookup of a
    /// removed or never-listed address misses.
    #[test]
    fn finds_what_a_hash_map_finds() {
        let mut rand = crate::alloc::core::test_rng();
        let mut blocks = BlockArena::default();
        let mut map = LiveMap::default();
        let mut reference: HashMap<DevicePtr, BlockId> = HashMap::new();
        let mut addrs = Vec::new();
        for step in 0..20_000u64 {
            let add = reference.is_empty() || rand(3) != 0 || step > 15_000 && rand(2) == 0;
            if add && step < 15_000 {
                // Few distinct grid indexes, some 2 TiB apart: tags collide often.
                let addr = (rand(4) << 41) + rand(3000) * 512;
                if reference.contains_key(&addr) {
                    continue;
                }
                let id = blocks.insert(Block::whole_segment(
                    addr,
                    512,
                    StreamId(0),
                    PoolKind::Small,
                    None,
                    false,
                    0,
                ));
                map.insert(addr, id);
                reference.insert(addr, id);
                addrs.push(addr);
            } else if let Some(&addr) = addrs.get(rand(addrs.len() as u64) as usize) {
                if let Some(id) = reference.remove(&addr) {
                    assert!(map.remove(addr, id));
                    assert!(!map.remove(addr, id));
                    blocks.remove(id);
                }
            }
            let probe = (rand(4) << 41) + rand(3000) * 512;
            assert_eq!(map.get(probe, &blocks), reference.get(&probe).copied());
            assert_eq!(map.len(), reference.len());
        }
        for (&addr, &id) in &reference {
            assert_eq!(map.get(addr, &blocks), Some(id));
        }
        let mut ids: Vec<_> = map.ids().collect();
        ids.sort_unstable();
        let mut want: Vec<_> = reference.values().copied().collect();
        want.sort_unstable();
        assert_eq!(ids, want);
    }
}
