//! The bookkeeping of blocks with no lock, thread-local or driver call: blocks and their
//! arena, the free lists with their size index, and the size classes.

pub mod blocks;
pub mod free_lists;
pub mod size_index;
pub mod sizing;
