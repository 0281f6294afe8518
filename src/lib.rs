//! ccalloc: a caching CUDA memory allocator with a C ABI.
//!
//! Layers, bottom up: `driver` (the CUDA driver or a simulated device), `alloc` (the caching
//! allocator for one device, safe Rust), `runtime` (the process-wide set of devices),
//! and `ffi` (the only place with `extern "C"`); `sync` holds the device lock.

pub mod alloc;
pub mod config;
pub mod driver;
pub mod error;
pub mod ffi;
pub mod history;
pub mod logging;
#[cfg(feature = "replay")]
pub mod replay;
pub mod runtime;
pub mod snapshot;
pub mod sync;

pub use alloc::stats::{DeviceStats, PagingCounters, Stat, StatArray};
pub use alloc::DeviceAllocator;
pub use config::Config;
pub use driver::{DevicePtr, Driver, StreamId};
pub use error::{Error, ErrorKind, Result};
pub use runtime::Runtime;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
