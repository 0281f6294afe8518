//! The device interface the allocator drives, and its two implementations: the CUDA driver
//! (`cuda`) and a simulated device (`sim`, only with the `sim` feature) for tests, replay and
//! machines without a GPU.

/// Writes `Driver` methods that pass the call unchanged to `self.inner`, for adaptors
/// (`traced`, `layers`) that change a few calls and forward the rest: each forwarded
/// method is named, so that a new trait method without a default fails to compile in every
/// adaptor until it says what to do with it.
macro_rules! forward_to_inner {
    ($($method:ident),* $(,)?) => { $( forward_to_inner!(@ $method); )* };
    (@ name) => { fn name(&self) -> &'static str { self.inner.name() } };
    (@ device_count) => { fn device_count(&self) -> usize { self.inner.device_count() } };
    (@ total_memory) => {
        fn total_memory(&self, device: usize) -> $crate::driver::DriverResult<u64> {
            self.inner.total_memory(device)
        }
    };
    (@ allocate) => {
        fn allocate(&self, device: usize, size: u64) -> $crate::driver::DriverResult<$crate::driver::DevicePtr> {
            self.inner.allocate(device, size)
        }
    };
    (@ release) => {
        fn release(&self, device: usize, ptr: $crate::driver::DevicePtr, size: u64) -> $crate::driver::DriverResult<()> {
            self.inner.release(device, ptr, size)
        }
    };
    (@ record_event) => {
        fn record_event(&self, device: usize, stream: $crate::driver::StreamId) -> $crate::driver::DriverResult<$crate::driver::EventId> {
            self.inner.record_event(device, stream)
        }
    };
    (@ event_done) => {
        fn event_done(&self, device: usize, event: $crate::driver::EventId) -> $crate::driver::DriverResult<bool> {
            self.inner.event_done(device, event)
        }
    };
    (@ wait_event) => {
        fn wait_event(&self, device: usize, event: $crate::driver::EventId) -> $crate::driver::DriverResult<()> {
            self.inner.wait_event(device, event)
        }
    };
    (@ destroy_event) => {
        fn destroy_event(&self, device: usize, event: $crate::driver::EventId) {
            self.inner.destroy_event(device, event)
        }
    };
    (@ synchronize) => {
        fn synchronize(&self, device: usize) -> $crate::driver::DriverResult<()> {
            self.inner.synchronize(device)
        }
    };
    (@ min_free_fence_interval) => {
        fn min_free_fence_interval(&self) -> std::time::Duration {
            self.inner.min_free_fence_interval()
        }
    };
    (@ times_page_moves) => { fn times_page_moves(&self) -> bool { self.inner.times_page_moves() } };
    (@ releases_outgrown_segments) => {
        fn releases_outgrown_segments(&self) -> bool {
            self.inner.releases_outgrown_segments()
        }
    };
    (@ synchronize_stream) => {
        fn synchronize_stream(&self, device: usize, stream: $crate::driver::StreamId) -> $crate::driver::DriverResult<()> {
            self.inner.synchronize_stream(device, stream)
        }
    };
    (@ vmm_granularity) => {
        fn vmm_granularity(&self, device: usize) -> Option<u64> {
            self.inner.vmm_granularity(device)
        }
    };
    (@ reserve_address) => {
        fn reserve_address(&self, device: usize, size: u64) -> $crate::driver::DriverResult<$crate::driver::DevicePtr> {
            self.inner.reserve_address(device, size)
        }
    };
    (@ free_address) => {
        fn free_address(&self, device: usize, ptr: $crate::driver::DevicePtr, size: u64) -> $crate::driver::DriverResult<()> {
            self.inner.free_address(device, ptr, size)
        }
    };
    (@ create_physical) => {
        fn create_physical(&self, device: usize, size: u64) -> $crate::driver::DriverResult<$crate::driver::PhysHandle> {
            self.inner.create_physical(device, size)
        }
    };
    (@ release_physical) => {
        fn release_physical(&self, device: usize, handle: $crate::driver::PhysHandle, size: u64) -> $crate::driver::DriverResult<()> {
            self.inner.release_physical(device, handle, size)
        }
    };
    (@ map) => {
        fn map(&self, device: usize, va: $crate::driver::DevicePtr, size: u64, handle: $crate::driver::PhysHandle) -> $crate::driver::DriverResult<()> {
            self.inner.map(device, va, size, handle)
        }
    };
    (@ set_access) => {
        fn set_access(&self, device: usize, va: $crate::driver::DevicePtr, size: u64) -> $crate::driver::DriverResult<()> {
            self.inner.set_access(device, va, size)
        }
    };
    (@ unmap) => {
        fn unmap(&self, device: usize, va: $crate::driver::DevicePtr, size: u64) -> $crate::driver::DriverResult<()> {
            self.inner.unmap(device, va, size)
        }
    };
    (@ host_memory) => {
        fn host_memory(&self, kind: $crate::driver::HostKind) -> $crate::driver::DriverResult<u64> {
            self.inner.host_memory(kind)
        }
    };
    (@ host_allocate) => {
        fn host_allocate(&self, kind: $crate::driver::HostKind, size: u64) -> $crate::driver::DriverResult<$crate::driver::DevicePtr> {
            self.inner.host_allocate(kind, size)
        }
    };
    (@ host_release) => {
        fn host_release(&self, kind: $crate::driver::HostKind, ptr: $crate::driver::DevicePtr, size: u64) -> $crate::driver::DriverResult<()> {
            self.inner.host_release(kind, ptr, size)
        }
    };
    (@ prefetch) => {
        fn prefetch(
            &self,
            ptr: $crate::driver::DevicePtr,
            size: u64,
            to: $crate::driver::Location,
            stream_device: usize,
            stream: $crate::driver::StreamId,
        ) -> $crate::driver::DriverResult<()> {
            self.inner.prefetch(ptr, size, to, stream_device, stream)
        }
    };
    (@ advise) => {
        fn advise(
            &self,
            ptr: $crate::driver::DevicePtr,
            size: u64,
            advice: $crate::driver::Advice,
            location: $crate::driver::Location,
        ) -> $crate::driver::DriverResult<()> {
            self.inner.advise(ptr, size, advice, location)
        }
    };
}
pub(crate) use forward_to_inner;

pub(crate) mod cuda;
pub(crate) mod host;
pub(crate) mod layers;
// The allocator's unit tests run on the simulated device in every build; without the `sim`
// feature they are its only users, and use only part of it.
#[cfg(any(test, feature = "sim"))]
#[cfg_attr(not(feature = "sim"), allow(dead_code))]
pub(crate) mod sim;
pub(crate) mod traced;

/// What `CCALLOC_BACKEND=sim` gets from a build without the simulated device.
#[cfg(not(feature = "sim"))]
pub const NO_SIM_BUILD: &str = "CCALLOC_BACKEND=sim: this ccalloc was built without the \
     simulated device; rebuild it with `cargo build --release --features sim`, or use the \
     Python package (`pip install ./python`), whose library includes it";

/// How to go on without a usable GPU: the simulated device where this build has it, else
/// how to get a build that has it.
#[cfg(feature = "sim")]
pub(crate) const NO_GPU_ADVICE: &str =
    "to run without a GPU, set CCALLOC_BACKEND=sim (the simulated device)";
#[cfg(not(feature = "sim"))]
pub const NO_GPU_ADVICE: &str = "to run without a GPU, rebuild ccalloc with `--features sim` \
     (the Python package's library has it) and set CCALLOC_BACKEND=sim";

use std::fmt;

/// Locks a driver's own table for `call`. Poisoned, the call fails with the poisoned-lock
/// message (the one policy, `crate::sync`); the `Driver` interface reports it as a failed
/// driver call, its only kind of error for a call that could not be made.
pub(crate) fn lock<'a, T>(
    mutex: &'a std::sync::Mutex<T>,
    call: &'static str,
    what: &str,
) -> DriverResult<std::sync::MutexGuard<'a, T>> {
    mutex.lock().map_err(|_| DriverError::Failed {
        call,
        detail: crate::sync::poisoned(what).message,
    })
}

/// A device address as the driver hands it out.
pub type DevicePtr = u64;

/// An opaque stream handle: a `cudaStream_t` on CUDA, any caller-chosen value on sim.
/// 0 is the legacy default stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

/// An event recorded on a stream; the driver owns its lifetime until `destroy_event`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverError {
    /// The device has no memory left for this request.
    OutOfMemory,
    /// The driver library or a symbol it needs is missing, or it failed to initialise.
    Unavailable(String),
    /// A call failed; `call` names it, `detail` says how.
    Failed { call: &'static str, detail: String },
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverError::OutOfMemory => f.write_str("the device is out of memory"),
            DriverError::Unavailable(why) => write!(f, "driver unavailable: {why}"),
            DriverError::Failed { call, detail } => write!(f, "{call} failed: {detail}"),
        }
    }
}

pub type DriverResult<T> = Result<T, DriverError>;

/// A piece of physical device memory (virtual memory management), mapped with `map`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

fn vmm_unsupported(call: &'static str) -> DriverError {
    DriverError::Failed {
        call,
        detail: "this driver has no virtual memory management".into(),
    }
}

/// Memory that lives on the host side rather than in one device's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostKind {
    /// Page-locked host memory, mapped for every device (`cuMemHostAlloc`).
    Pinned,
    /// Unified memory that migrates between the host and devices (`cuMemAllocManaged`).
    Managed,
}

/// Where managed memory is moved to or advised about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    Host,
    Device(usize),
}

/// Advice on how a managed range is used (`cuMemAdvise`), with CUDA's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Advice {
    SetReadMostly = 1,
    UnsetReadMostly = 2,
    SetPreferredLocation = 3,
    UnsetPreferredLocation = 4,
    SetAccessedBy = 5,
    UnsetAccessedBy = 6,
}

impl Advice {
    pub fn from_raw(raw: u32) -> Option<Self> {
        use Advice::*;
        [
            SetReadMostly,
            UnsetReadMostly,
            SetPreferredLocation,
            UnsetPreferredLocation,
            SetAccessedBy,
            UnsetAccessedBy,
        ]
        .into_iter()
        .find(|a| *a as u32 == raw)
    }
}

fn host_unsupported(call: &'static str) -> DriverError {
    DriverError::Failed {
        call,
        detail: "this driver has no pinned host or managed memory".into(),
    }
}

/// What the caching allocator needs from a device. Implementations are thread-safe; every
/// call names the device so one driver serves them all.
pub trait Driver: Send + Sync {
    /// "cuda" or "sim".
    fn name(&self) -> &'static str;
    fn device_count(&self) -> usize;
    /// Bytes of memory the device has in all.
    fn total_memory(&self, device: usize) -> DriverResult<u64>;
    /// A fresh device allocation of `size` bytes (the allocator's segment).
    fn allocate(&self, device: usize, size: u64) -> DriverResult<DevicePtr>;
    /// Returns a segment obtained from `allocate`. The caller has made sure no stream still uses it.
    fn release(&self, device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()>;
    /// Records an event on `stream`: it completes once the work queued there so far is done.
    fn record_event(&self, device: usize, stream: StreamId) -> DriverResult<EventId>;
    /// Whether the event has completed (never blocks).
    fn event_done(&self, device: usize, event: EventId) -> DriverResult<bool>;
    /// Blocks until the event has completed.
    fn wait_event(&self, device: usize, event: EventId) -> DriverResult<()>;
    /// Gives the event back (it may be pooled for the next `record_event`).
    fn destroy_event(&self, device: usize, event: EventId);
    /// Blocks until all work on the device has completed.
    fn synchronize(&self, device: usize) -> DriverResult<()>;

    /// The least time between two fences recorded at frees (paged segments). Recording and
    /// retiring an event costs about a µs on a GPU; a simulated device keeps the default,
    /// zero, so that replays do not depend on the host's speed.
    fn min_free_fence_interval(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// Whether the time page moves take is worth measuring (`page_move_budget`): on a GPU
    /// it is tens of µs per mapping; a simulated device keeps the default, false, so that
    /// replays do not depend on the host's speed.
    fn times_page_moves(&self) -> bool {
        false
    }

    /// Whether a cached free segment smaller than a new one is released as the new one is
    /// made. Device segments are kept (a later smaller request reuses them); separate pinned
    /// host allocations never merge, and a loader's growing batch sizes would otherwise pile
    /// up one outgrown segment per size seen.
    fn releases_outgrown_segments(&self) -> bool {
        false
    }

    /// Blocks until the work queued on `stream` has completed.
    fn synchronize_stream(&self, device: usize, stream: StreamId) -> DriverResult<()>;

    // Virtual memory management: address ranges whose pages are backed by physical memory
    // in whole granules, each allocation mapped and unmapped whole. Drivers without it
    // return `None` here.

    /// The mapping granularity, or `None` when the device lacks virtual memory management.
    fn vmm_granularity(&self, device: usize) -> Option<u64> {
        let _ = device;
        None
    }

    /// Reserves `size` bytes of address space (nothing mapped).
    fn reserve_address(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        let _ = (device, size);
        Err(vmm_unsupported("reserve_address"))
    }

    /// Returns an address range from `reserve_address`; nothing may be mapped in it.
    fn free_address(&self, device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        let _ = (device, ptr, size);
        Err(vmm_unsupported("free_address"))
    }

    /// Allocates `size` bytes of physical memory, a whole number of granules.
    fn create_physical(&self, device: usize, size: u64) -> DriverResult<PhysHandle> {
        let _ = (device, size);
        Err(vmm_unsupported("create_physical"))
    }

    /// Frees physical memory that is no longer mapped anywhere.
    fn release_physical(&self, device: usize, handle: PhysHandle, size: u64) -> DriverResult<()> {
        let _ = (device, handle, size);
        Err(vmm_unsupported("release_physical"))
    }

    /// Maps all of `handle` (`size` bytes) at `va`, granule-aligned inside a reserved range;
    /// usable after `set_access`.
    fn map(&self, device: usize, va: DevicePtr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let _ = (device, va, size, handle);
        Err(vmm_unsupported("map"))
    }

    /// Grants the device read/write access to `[va, va+size)`, which may span several
    /// mappings (on an H100 the cost is per mapping all the same).
    fn set_access(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        let _ = (device, va, size);
        Err(vmm_unsupported("set_access"))
    }

    /// Unmaps `[va, va+size)`, which covers whole mappings only. No queued work may still
    /// use it.
    fn unmap(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        let _ = (device, va, size);
        Err(vmm_unsupported("unmap"))
    }

    // Host-side memory: pinned host memory and managed memory, which `host::HostDriver`
    // turns into a device of its own for a `DeviceAllocator`.

    /// The most bytes of `kind` memory that may be allocated in all.
    fn host_memory(&self, kind: HostKind) -> DriverResult<u64> {
        let _ = kind;
        Err(host_unsupported("host_memory"))
    }

    /// A fresh allocation of `size` bytes of `kind` memory.
    fn host_allocate(&self, kind: HostKind, size: u64) -> DriverResult<DevicePtr> {
        let _ = (kind, size);
        Err(host_unsupported("host_allocate"))
    }

    /// Returns an allocation from `host_allocate`; no queued work may still use it.
    fn host_release(&self, kind: HostKind, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        let _ = (kind, ptr, size);
        Err(host_unsupported("host_release"))
    }

    /// Queues on `stream` (of device `stream_device`) a move of managed `[ptr, ptr+size)` to `to`.
    fn prefetch(
        &self,
        ptr: DevicePtr,
        size: u64,
        to: Location,
        stream_device: usize,
        stream: StreamId,
    ) -> DriverResult<()> {
        let _ = (ptr, size, to, stream_device, stream);
        Err(host_unsupported("prefetch"))
    }

    /// Advises how managed `[ptr, ptr+size)` is used; `location` is the advice's device or
    /// the host.
    fn advise(
        &self,
        ptr: DevicePtr,
        size: u64,
        advice: Advice,
        location: Location,
    ) -> DriverResult<()> {
        let _ = (ptr, size, advice, location);
        Err(host_unsupported("advise"))
    }
}
