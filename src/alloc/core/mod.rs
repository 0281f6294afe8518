//! The bookkeeping of blocks with no lock, thread-local or driver call: blocks and their
//! arena, the free lists with their size index, the size classes, and the reuse heuristic.

pub mod blocks;
pub mod free_lists;
pub mod reuse;
pub mod size_index;
pub mod sizing;

/// A seeded xorshift generator for the randomized tests that check a structure against a
/// reference one: `rand(n)` is in `0..n`, the same sequence every run.
#[cfg(test)]
pub(crate) fn test_rng() -> impl FnMut(u64) -> u64 {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    move |n| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}
