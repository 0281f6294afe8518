//! ccalloc: a caching CUDA memory allocator with a C ABI.
//!
//! Layers, bottom up: `driver` (the CUDA driver, or a simulated device with the `sim`
//! feature), `alloc` (the caching allocator for one device, safe Rust), `runtime` (the
//! process-wide set of devices), and `ffi` (the only place with `extern "C"`); `sync` holds
//! the device lock.
//!
//! Every module is private: the Rust API is what this file re-exports, and the C API is the
//! `#[no_mangle]` functions of `ffi`, exported from the cdylib, declared in
//! include/ccalloc.h (and include/ccalloc_sim.h), and reachable from Rust through [`capi`].

mod alloc;
mod config;
mod driver;
mod error;
mod ffi;
mod history;
mod logging;
#[cfg(feature = "replay")]
mod replay;
mod runtime;
mod snapshot;
mod sync;

pub use alloc::blocks::BlockState;
pub use alloc::stats::{DeviceStats, LockCounters, PagingCounters, Stat, StatArray};
pub use alloc::{DeviceAllocator, MadeBlock, MemoryBreakdown, Restored, SavedBlock, SegmentView};
pub use config::Config;
pub use driver::{
    Advice, DevicePtr, Driver, DriverError, DriverResult, EventId, HostKind, Location, PhysHandle,
    StreamId,
};
pub use error::{human_bytes, parse_bytes, Error, ErrorKind, Result};
pub use runtime::{HostAllocator, Runtime};

/// The simulated device: tests, replay, and machines without a GPU.
#[cfg(feature = "sim")]
pub use driver::sim::{CallCosts, SimCounters, SimDriver, SimHostCounters};

/// Trace replay on the simulated device: `trace` reads PyTorch's snapshots and CSV traces,
/// `replay` runs one through a fresh allocator, `plot` draws the reports' timelines, and
/// `expandable_peak_reserved` models PyTorch's expandable segments on a trace.
#[cfg(feature = "replay")]
pub use replay::{
    driver_ms_note, expandable_peak_reserved, plot, replay, trace, OomPoint, ReplayOptions,
    ReplayReport,
};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The C API for Rust callers (tests, examples, programs that drive ccalloc as C does): the
/// same functions the cdylib exports and the headers declare, and their types.
pub mod capi {
    pub use crate::ffi::host::*;
    pub use crate::ffi::memory::*;
    #[cfg(feature = "sim")]
    pub use crate::ffi::sim::*;
    pub use crate::ffi::types::*;
    pub use crate::ffi::*;
}

/// What the crate's own integration tests reach below the API: the global runtime behind
/// the C API, the sizing rule, the settings' keys and the lock primitives the loom model
/// checks. Not part of the API; it may change with any release.
#[doc(hidden)]
pub mod testing {
    pub use crate::alloc::sizing::round_size;
    pub use crate::config::KEYS;
    pub use crate::runtime::global;
    pub use crate::sync::{SpinCell, SpinThenBlock};
}
