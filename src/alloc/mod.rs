//! The caching allocator for one device, in safe Rust over the `Driver` trait: `device`
//! routes calls to shards and thread fronts (`front`); a `shard` locks its `State`, which
//! owns the lock-free bookkeeping (`core`), paged segments' tables (`paging`) and `stats`.

// Behaviour follows PyTorch's CUDACachingAllocator: size-binned small/large pools, best fit
// per (stream, size), block split/merge, `max_split_size`, cross-stream use via events,
// private pools for CUDA graphs, and an OOM path that frees cache before failing.
#![forbid(unsafe_code)]

pub(crate) mod core;
mod device;
mod front;
mod paging;
mod shard;
pub mod sizing;
mod state;
pub mod stats;

pub use self::core::blocks;
use crate::config::Config;
use crate::driver::{DevicePtr, DriverError, StreamId};
use crate::error::{Error, ErrorKind};
use blocks::{BlockState, PoolId};
pub use device::breakdown::MemoryBreakdown;
pub use device::DeviceAllocator;
pub use shard::restore::{MadeBlock, Restored, SavedBlock};
use shard::Shard;
use sizing::PoolKind;

/// One segment as seen from outside (tests, snapshots, the replay tool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentView {
    pub addr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub private_pool: Option<PoolId>,
    /// (address, size, state) of each block in address order.
    pub blocks: Vec<(DevicePtr, u64, BlockState)>,
    /// The size each block's caller asked for (0 for blocks not handed out), by position.
    pub requested: Vec<u64>,
    /// For a paged segment, its mapped address ranges in order (only they hold memory);
    /// `None` for a plain segment, which is mapped whole.
    pub mapped: Option<Vec<(DevicePtr, u64)>>,
    /// For a paged segment, each mapped chunk (one physical allocation, unmapped only whole)
    /// as (address, bytes), in order; `None` for a plain segment.
    pub chunks: Option<Vec<(DevicePtr, u64)>>,
}

fn driver_error(device: usize, e: DriverError) -> Error {
    let mut error = driver_error_of(e);
    if error.kind == ErrorKind::Driver {
        error.message = format!("device {device}: {}", error.message);
    }
    error
}

/// `ptr` on `device` was freed already: a second free (or a `record_stream` after the
/// free) is refused.
fn already_freed(device: usize, ptr: DevicePtr) -> Error {
    Error::new(
        ErrorKind::DoubleFree,
        format!("{ptr:#x} on device {device} is not live: it was already freed"),
    )
}

/// A driver error that concerns no single device (loading the driver, counting devices).
pub fn driver_error_of(e: DriverError) -> Error {
    match e {
        DriverError::Unavailable(why) => Error::new(ErrorKind::DriverUnavailable, why),
        other => Error::new(ErrorKind::Driver, other.to_string()),
    }
}

fn limit_for(config: &Config, total_memory: u64) -> u64 {
    match config.per_process_memory_fraction {
        Some(f) => (f * total_memory as f64) as u64,
        None => u64::MAX,
    }
}

#[cfg(test)]
mod tests;
