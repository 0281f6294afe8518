//! The bookkeeping of blocks with no lock, thread-local or driver call: blocks and their
//! arena, the free lists with their size index, the size classes, and the reuse heuristic.

pub mod blocks;
pub mod free_lists;
pub mod reuse;
pub mod size_index;
pub mod sizing;
