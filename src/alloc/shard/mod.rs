//! The shard's driver I/O: paged segments' memory and fences.

mod fences;
mod paging;
