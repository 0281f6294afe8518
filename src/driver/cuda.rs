//! The real device: CUDA's driver API through cudarc's `sys` layer, loaded at run time.
//!
//! cudarc panics when libcuda or one of its symbols is missing, so `CudaDriver::new` first
//! opens the library itself and checks every symbol used here; only then does it call cudarc.
//! Allocations go to each device's *primary context*, the one the CUDA runtime and PyTorch use.

use super::{
    lock, Advice, DevicePtr, Driver, DriverError, DriverResult, EventId, HostKind, Location,
    PhysHandle, StreamId,
};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Every driver entry point this backend calls, by the names cudarc loads.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuStreamSynchronize",
    "cuDeviceGetAttribute",
    "cuThreadExchangeStreamCaptureMode",
    "cuStreamGetCtx",
    "cuDeviceCanAccessPeer",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemAllocManaged",
];

/// The CUDA 12.2+ forms of the managed-memory calls, taking a `CUmemLocation` (the host is
/// a location of its own); CUDA 13 keeps only these in its headers. Used where present.
const LOCATION_SYMBOLS: &[&str] = &["cuMemPrefetchAsync_v2", "cuMemAdvise_v2"];
/// Their older forms, taking a device (`CU_DEVICE_CPU` for the host).
const DEVICE_SYMBOLS: &[&str] = &["cuMemPrefetchAsync", "cuMemAdvise"];

/// The host, as the older managed-memory calls name it.
const CU_DEVICE_CPU: sys::CUdevice = -1;

/// Which optional driver entry points are present.
struct Symbols {
    vmm: bool,
    location: bool,
    device: bool,
}

/// Virtual memory management entry points; without them the allocator uses plain segments.
const VMM_SYMBOLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
];

/// Opens libcuda the way cudarc will, and checks the symbols we need are there. Returns
/// which optional ones are present too.
fn check_library() -> Result<Symbols, String> {
    for name in ["cuda", "nvcuda"]
        .iter()
        .flat_map(|l| cudarc::get_lib_name_candidates(l))
    {
        // SAFETY: loading the system CUDA driver library runs its initialisers, as cudarc would.
        let Ok(lib) = (unsafe { libloading::Library::new(&name) }) else {
            continue;
        };
        for symbol in REQUIRED_SYMBOLS {
            // SAFETY: only the symbol's presence is checked; it is not called here.
            let found = unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) };
            if found.is_err() {
                return Err(format!(
                    "{name} lacks {symbol}: the NVIDIA driver is too old"
                ));
            }
        }
        // SAFETY: as above, presence only.
        let present = |symbols: &[&str]| {
            symbols.iter().all(|symbol| unsafe {
                lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()).is_ok()
            })
        };
        let symbols = Symbols {
            vmm: present(VMM_SYMBOLS),
            location: present(LOCATION_SYMBOLS),
            device: present(DEVICE_SYMBOLS),
        };
        // Keep it loaded: cudarc opens the same file and gets this handle's copy.
        std::mem::forget(lib);
        return Ok(symbols);
    }
    // cudarc tries dozens of file names; the one a driver install provides is enough to name.
    let library = if cfg!(windows) {
        "nvcuda.dll"
    } else {
        "libcuda.so.1"
    };
    Err(format!(
        "the CUDA driver library ({library}) was not found: install the NVIDIA driver; {}",
        super::NO_GPU_ADVICE
    ))
}

fn error_text(code: sys::CUresult) -> String {
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string or leaves it null.
    unsafe { sys::cuGetErrorString(code, &mut text) };
    if text.is_null() {
        format!("{code:?}")
    } else {
        // SAFETY: non-null results point at NUL-terminated static strings.
        let s = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{s} ({code:?})")
    }
}

/// `CCALLOC_LOG_DRIVER=1` prints every failing driver call to stderr (errors that PyTorch's
/// hooks cannot report, or that a capture turns into a later, vaguer error).
static LOG_FAILURES: once_cell::sync::Lazy<bool> =
    once_cell::sync::Lazy::new(|| std::env::var_os("CCALLOC_LOG_DRIVER").is_some_and(|v| v != "0"));

fn check(call: &'static str, code: sys::CUresult) -> DriverResult<()> {
    let result = match code {
        sys::CUresult::CUDA_SUCCESS => return Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(DriverError::OutOfMemory),
        other => Err(DriverError::Failed {
            call,
            detail: error_text(other),
        }),
    };
    if *LOG_FAILURES {
        // Not eprintln!: a closed stderr must not turn a driver error into a panic.
        let _ = writeln!(std::io::stderr(), "ccalloc: {call} failed: {code:?}");
    }
    result
}

/// A driver handle that is safe to share: the driver API is thread-safe.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Handle<T>(T);
// SAFETY: CUDA driver handles may be used from any thread.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Handle<T> {}

struct CudaDevice {
    device: sys::CUdevice,
    ordinal: i32,
    /// Mapping granularity when the device supports virtual memory management.
    vmm_granularity: Option<u64>,
    context: OnceLock<Result<Handle<sys::CUcontext>, DriverError>>,
    /// Events are reused: creating one costs a driver call.
    spare_events: SpareEvents,
    /// Devices that can reach this one's memory (peer access): virtual-memory mappings are
    /// granted to them too, since such memory ignores `cudaDeviceEnablePeerAccess`.
    peers: Vec<i32>,
    /// Physical memory may be made GPUDirect RDMA capable (network cards reading and writing
    /// it, as NCCL over InfiniBand registers buffers): it is, as PyTorch's expandable
    /// segments make it.
    rdma_capable: bool,
}

/// Spare events of a device, in buckets: each thread takes and gives back events in a
/// bucket of its own (threads beyond the buckets share them). Fences are recorded and
/// retired on every shard's hot path, so that one shared pool made each shard's thread
/// take a lock other threads were writing (four times per fence with the foreign table).
struct SpareEvents {
    buckets: [SpareBucket; SPARE_BUCKETS],
}

/// A bucket on lines of its own (128 bytes: adjacent-line prefetch pairs lines).
#[repr(align(128))]
#[derive(Default)]
struct SpareBucket(Mutex<Vec<Handle<sys::CUevent>>>);

const SPARE_BUCKETS: usize = 16;
/// Events a bucket keeps; more are destroyed. A thread that only retires events another
/// thread records would otherwise pool them without bound.
const SPARES_PER_BUCKET: usize = 64;

impl SpareEvents {
    fn new() -> Self {
        Self {
            buckets: std::array::from_fn(|_| SpareBucket::default()),
        }
    }

    /// The calling thread's bucket.
    fn bucket(&self) -> &Mutex<Vec<Handle<sys::CUevent>>> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static BUCKET: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SPARE_BUCKETS;
        }
        // A thread-local destructor that records a fence shares bucket 0.
        let i = BUCKET.try_with(|b| *b).unwrap_or(0);
        &self.buckets[i].0
    }

    /// A spare event, if the bucket has one.
    fn take(&self) -> DriverResult<Option<sys::CUevent>> {
        Ok(lock(self.bucket(), "cuEventCreate", SPARE_EVENTS)?
            .pop()
            .map(|e| e.0))
    }

    /// Pools `event` for a later `record_event`; returns it when the bucket is full (the
    /// caller destroys it). With the bucket's lock poisoned it is left alone (leaked):
    /// `destroy_event` has no way to report.
    fn give_back(&self, event: sys::CUevent) -> Option<sys::CUevent> {
        let mut spare = self.bucket().lock().ok()?;
        if spare.len() >= SPARES_PER_BUCKET {
            return Some(event);
        }
        spare.push(Handle(event));
        None
    }
}

/// Events recorded on another context's stream, with that context. Most processes make
/// none: `count` lets every event query and destroy skip the table's lock until one is.
#[derive(Default)]
struct ForeignEvents {
    /// Entries ever inserted; raised under the table's lock after the insert.
    count: AtomicUsize,
    table: Mutex<std::collections::HashMap<u64, Handle<sys::CUcontext>>>,
}

impl ForeignEvents {
    /// Whether `event` may be in the table. An event's id reaches its users after
    /// `record_event` returned, so an entry for it is counted by then.
    fn may_hold(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }
}

/// What the poisoned-lock errors of the event tables name.
const SPARE_EVENTS: &str = "the device's pool of spare events";
const FOREIGN_EVENTS: &str = "the table of events recorded in other contexts";

pub(crate) struct CudaDriver {
    devices: Vec<CudaDevice>,
    /// Events recorded on another context's stream (a block of one device recorded on
    /// another device's stream), with that context: CUDA requires an event and the stream it
    /// is recorded on to share a context. Not pooled: destroyed when done.
    foreign_events: ForeignEvents,
    /// Whether the `CUmemLocation` forms of prefetch and advice are present, and the older ones.
    location_calls: bool,
    device_calls: bool,
}

/// Makes a device's primary context current for the duration of a call. A thread with no
/// context keeps ours afterwards (as the CUDA runtime would); one with another gets it back.
/// The thread's stream-capture mode is relaxed meanwhile, as PyTorch does around cudaMalloc:
/// in the default (global) mode, allocating while a stream captures a CUDA graph would fail
/// and invalidate the capture.
struct ContextGuard {
    restore: Option<sys::CUcontext>,
    capture_mode: sys::CUstreamCaptureMode,
}

impl ContextGuard {
    fn enter(context: sys::CUcontext) -> DriverResult<Self> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes the calling thread's current context into `current`.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        let restore = if current == context {
            None
        } else {
            // SAFETY: `context` is a retained primary context.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context) })?;
            (!current.is_null()).then_some(current)
        };
        let mut capture_mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: swaps this thread's capture mode; the old one is restored on drop.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut capture_mode)
        })?;
        Ok(Self {
            restore,
            capture_mode,
        })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        // SAFETY: puts back the mode this thread had before `enter`.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut self.capture_mode) };
        if let Some(previous) = self.restore {
            // SAFETY: `previous` was current on this thread a moment ago.
            unsafe { sys::cuCtxSetCurrent(previous) };
        }
    }
}

impl CudaDriver {
    pub(crate) fn new() -> DriverResult<Self> {
        let symbols = check_library().map_err(DriverError::Unavailable)?;
        let vmm_symbols = symbols.vmm;
        // SAFETY: the library and its symbols were checked above.
        check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| {
            DriverError::Unavailable(format!("cuInit failed: {e}; {}", super::NO_GPU_ADVICE))
        })?;
        let mut count = 0;
        // SAFETY: writes the device count.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        let mut devices = Vec::new();
        for ordinal in 0..count {
            let mut device = 0;
            // SAFETY: `ordinal` is below the count the driver reported.
            check("cuDeviceGet", unsafe {
                sys::cuDeviceGet(&mut device, ordinal)
            })?;
            let vmm_granularity = if vmm_symbols {
                vmm_granularity_of(device, ordinal)
            } else {
                None
            };
            let rdma_capable = vmm_granularity.is_some()
                && device_attribute(
                    device,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                ) == Some(1);
            devices.push(CudaDevice {
                device,
                ordinal,
                vmm_granularity,
                context: OnceLock::new(),
                spare_events: SpareEvents::new(),
                peers: Vec::new(),
                rdma_capable,
            });
        }
        for owner in 0..devices.len() {
            let peers = (0..devices.len())
                .filter(|&peer| peer != owner)
                .filter(|&peer| {
                    let mut can = 0;
                    // SAFETY: writes whether `peer` can access `owner`'s memory.
                    let asked = check("cuDeviceCanAccessPeer", unsafe {
                        sys::cuDeviceCanAccessPeer(
                            &mut can,
                            devices[peer].device,
                            devices[owner].device,
                        )
                    });
                    asked.is_ok() && can == 1
                })
                .map(|peer| devices[peer].ordinal)
                .collect();
            devices[owner].peers = peers;
        }
        Ok(Self {
            devices,
            foreign_events: ForeignEvents::default(),
            location_calls: symbols.location,
            device_calls: symbols.device,
        })
    }

    /// The context of `stream` when it is not `device`'s primary context (another device's
    /// stream, or a stream of a context the caller made); `None` for the default streams
    /// (0, `cudaStreamLegacy`, `cudaStreamPerThread`: the current context's, which a call
    /// here makes `device`'s).
    fn foreign_context(
        &self,
        device: usize,
        stream: StreamId,
    ) -> DriverResult<Option<sys::CUcontext>> {
        if stream.0 <= 2 {
            return Ok(None);
        }
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `stream` is a live stream handle of the caller's.
        check("cuStreamGetCtx", unsafe {
            sys::cuStreamGetCtx(stream.0 as sys::CUstream, &mut context)
        })?;
        let own = match self.dev(device)?.context.get() {
            Some(Ok(own)) => own.0,
            _ => std::ptr::null_mut(),
        };
        Ok((context != own).then_some(context))
    }

    /// Enters the context of `event` when it was recorded on another context's stream.
    fn enter_event_context(&self, event: EventId) -> DriverResult<Option<ContextGuard>> {
        if !self.foreign_events.may_hold() {
            return Ok(None);
        }
        let context = lock(&self.foreign_events.table, "cuEventQuery", FOREIGN_EVENTS)?
            .get(&event.0)
            .copied();
        context.map(|c| ContextGuard::enter(c.0)).transpose()
    }

    /// Pools one of `d`'s events (`d` is device `device`) for the next `record_event`, or
    /// destroys it when the pool is full.
    fn give_back_event(&self, device: usize, d: &CudaDevice, event: sys::CUevent) {
        if let Some(extra) = d.spare_events.give_back(event) {
            if let Ok(_ctx) = self.enter(device) {
                // SAFETY: made by `record_event`, and retired: nothing waits on it now.
                unsafe { sys::cuEventDestroy_v2(extra) };
            }
        }
    }

    fn dev(&self, device: usize) -> DriverResult<&CudaDevice> {
        self.devices.get(device).ok_or_else(|| DriverError::Failed {
            call: "device lookup",
            detail: format!(
                "no CUDA device {device} (this machine has {})",
                self.devices.len()
            ),
        })
    }

    /// Fails when the driver has neither form of the managed-memory calls.
    fn check_managed_calls(&self, call: &'static str) -> DriverResult<()> {
        if self.location_calls || self.device_calls {
            return Ok(());
        }
        Err(DriverError::Failed {
            call,
            detail: "the CUDA driver library lacks it: the NVIDIA driver is too old".into(),
        })
    }

    /// Enters `device`'s primary context, retaining it on first use.
    fn enter(&self, device: usize) -> DriverResult<ContextGuard> {
        let d = self.dev(device)?;
        let context = d
            .context
            .get_or_init(|| {
                let mut context = std::ptr::null_mut();
                // SAFETY: retains (creating if needed) the primary context shared with the runtime.
                check("cuDevicePrimaryCtxRetain", unsafe {
                    sys::cuDevicePrimaryCtxRetain(&mut context, d.device)
                })?;
                Ok(Handle(context))
            })
            .clone()?;
        ContextGuard::enter(context.0)
    }
}

fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is a valid (default) value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

/// A `CUmemLocation` for the `_v2` managed-memory calls.
fn mem_location(location: Location, ordinal: i32) -> sys::CUmemLocation {
    // SAFETY: a plain C struct for which all-zero is a valid value.
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    match location {
        Location::Host => loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
        Location::Device(_) => {
            loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            loc.id = ordinal;
        }
    }
    loc
}

fn advice_of(advice: Advice) -> sys::CUmem_advise {
    use sys::CUmem_advise::*;
    match advice {
        Advice::SetReadMostly => CU_MEM_ADVISE_SET_READ_MOSTLY,
        Advice::UnsetReadMostly => CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        Advice::SetPreferredLocation => CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
        Advice::UnsetPreferredLocation => CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
        Advice::SetAccessedBy => CU_MEM_ADVISE_SET_ACCESSED_BY,
        Advice::UnsetAccessedBy => CU_MEM_ADVISE_UNSET_ACCESSED_BY,
    }
}

/// The host's physical memory in bytes.
fn physical_ram() -> u64 {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64)
}

/// A new event in the current context, without timing (only its completion is asked).
fn create_event() -> DriverResult<sys::CUevent> {
    let mut event = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: creates an event in the current context.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut event, flags)
    })?;
    Ok(event)
}

/// Records `event` on `stream` (0: the default stream); both belong to the current context.
fn record(event: sys::CUevent, stream: StreamId) -> DriverResult<()> {
    // SAFETY: a live event and the caller's stream handle, of the same context.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream.0 as sys::CUstream)
    })
}

/// One device attribute, if the driver knows it.
fn device_attribute(device: sys::CUdevice, attribute: sys::CUdevice_attribute) -> Option<i32> {
    let mut value = 0;
    // SAFETY: reads one device attribute.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, device)
    })
    .ok()?;
    Some(value)
}

/// The device's minimum mapping granularity, if it supports virtual memory management.
fn vmm_granularity_of(device: sys::CUdevice, ordinal: i32) -> Option<u64> {
    let attribute =
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
    if device_attribute(device, attribute)? == 0 {
        return None;
    }
    let prop = allocation_prop(ordinal);
    let mut granularity = 0usize;
    let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: `prop` describes pinned device memory on this device.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut granularity, &prop, option)
    })
    .ok()?;
    (granularity > 0).then_some(granularity as u64)
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn total_memory(&self, device: usize) -> DriverResult<u64> {
        let d = self.dev(device)?;
        let mut bytes = 0usize;
        // SAFETY: writes the device's memory size.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut bytes, d.device)
        })?;
        Ok(bytes as u64)
    }

    fn allocate(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        let _ctx = self.enter(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: allocates in the current (primary) context.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, size as usize)
        })?;
        Ok(ptr)
    }

    fn release(&self, device: usize, ptr: DevicePtr, _size: u64) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        // SAFETY: `ptr` came from cuMemAlloc on this device and is no longer used.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
    }

    fn record_event(&self, device: usize, stream: StreamId) -> DriverResult<EventId> {
        let _ctx = self.enter(device)?;
        let d = self.dev(device)?;
        if let Some(context) = self.foreign_context(device, stream)? {
            // An event of the stream's own context, made and recorded there.
            let _there = ContextGuard::enter(context)?;
            let event = create_event()?;
            if let Err(e) = record(event, stream) {
                // SAFETY: the event was created above and is used nowhere.
                unsafe { sys::cuEventDestroy_v2(event) };
                return Err(e);
            }
            match lock(&self.foreign_events.table, "cuEventRecord", FOREIGN_EVENTS) {
                Ok(mut foreign) => {
                    foreign.insert(event as u64, Handle(context));
                    self.foreign_events.count.fetch_add(1, Ordering::Release);
                }
                Err(e) => {
                    // SAFETY: the event was created above and is used nowhere.
                    unsafe { sys::cuEventDestroy_v2(event) };
                    return Err(e);
                }
            };
            return Ok(EventId(event as u64));
        }
        let event = match d.spare_events.take()? {
            Some(e) => e,
            None => create_event()?,
        };
        if let Err(e) = record(event, stream) {
            self.give_back_event(device, d, event);
            return Err(e);
        }
        Ok(EventId(event as u64))
    }

    fn event_done(&self, _device: usize, event: EventId) -> DriverResult<bool> {
        let _there = self.enter_event_context(event)?;
        // SAFETY: `event` was created by `record_event` and not yet destroyed.
        match unsafe { sys::cuEventQuery(event.0 as sys::CUevent) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|_| false),
        }
    }

    fn wait_event(&self, _device: usize, event: EventId) -> DriverResult<()> {
        let _there = self.enter_event_context(event)?;
        // SAFETY: as in `event_done`.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event.0 as sys::CUevent)
        })
    }

    fn destroy_event(&self, device: usize, event: EventId) {
        let foreign = if self.foreign_events.may_hold() {
            // Poisoned, whether the event is foreign is unknown: it is left alone (leaked).
            let Ok(mut foreign) = self.foreign_events.table.lock() else {
                return;
            };
            foreign.remove(&event.0)
        } else {
            None
        };
        if let Some(context) = foreign {
            if let Ok(_there) = ContextGuard::enter(context.0) {
                // SAFETY: made by `record_event` in that context; nothing waits on it now.
                unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) };
            }
            return;
        }
        if let Ok(d) = self.dev(device) {
            self.give_back_event(device, d, event.0 as sys::CUevent);
        }
    }

    fn synchronize(&self, device: usize) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        // SAFETY: waits for the current (primary) context's work.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn synchronize_stream(&self, device: usize, stream: StreamId) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        // SAFETY: `stream` is the caller's stream handle on this device.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.0 as sys::CUstream)
        })
    }

    fn vmm_granularity(&self, device: usize) -> Option<u64> {
        self.devices.get(device)?.vmm_granularity
    }

    fn host_memory(&self, kind: HostKind) -> DriverResult<u64> {
        let ram = physical_ram();
        Ok(match kind {
            HostKind::Pinned => ram,
            // Managed memory may oversubscribe the devices: it spills to the host.
            HostKind::Managed => {
                let mut total = ram;
                for device in 0..self.devices.len() {
                    total = total.saturating_add(self.total_memory(device)?);
                }
                total
            }
        })
    }

    fn host_allocate(&self, kind: HostKind, size: u64) -> DriverResult<DevicePtr> {
        // Either kind is usable from every device; device 0's context makes the call.
        let _ctx = self.enter(0)?;
        match kind {
            HostKind::Pinned => {
                let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
                let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
                // SAFETY: allocates page-locked host memory, mapped for every context.
                check("cuMemHostAlloc", unsafe {
                    sys::cuMemHostAlloc(&mut ptr, size as usize, flags)
                })?;
                Ok(ptr as DevicePtr)
            }
            HostKind::Managed => {
                let mut ptr: sys::CUdeviceptr = 0;
                let flags = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32;
                // SAFETY: allocates managed memory, accessible from any stream.
                check("cuMemAllocManaged", unsafe {
                    sys::cuMemAllocManaged(&mut ptr, size as usize, flags)
                })?;
                Ok(ptr)
            }
        }
    }

    fn host_release(&self, kind: HostKind, ptr: DevicePtr, _size: u64) -> DriverResult<()> {
        let _ctx = self.enter(0)?;
        match kind {
            // SAFETY: `ptr` came from cuMemHostAlloc and no queued work uses it.
            HostKind::Pinned => check("cuMemFreeHost", unsafe {
                sys::cuMemFreeHost(ptr as *mut std::ffi::c_void)
            }),
            // SAFETY: `ptr` came from cuMemAllocManaged and no queued work uses it.
            HostKind::Managed => check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) }),
        }
    }

    fn prefetch(
        &self,
        ptr: DevicePtr,
        size: u64,
        to: Location,
        stream_device: usize,
        stream: StreamId,
    ) -> DriverResult<()> {
        let target = match to {
            Location::Host => None,
            Location::Device(d) => Some(self.dev(d)?),
        };
        self.check_managed_calls("cuMemPrefetchAsync")?;
        let _ctx = self.enter(stream_device)?;
        let hstream = stream.0 as sys::CUstream;
        if self.location_calls {
            let location = mem_location(to, target.map_or(0, |d| d.ordinal));
            // SAFETY: a managed range of the caller's, queued on the caller's stream.
            check("cuMemPrefetchAsync_v2", unsafe {
                sys::cuMemPrefetchAsync_v2(ptr, size as usize, location, 0, hstream)
            })
        } else {
            let device = target.map_or(CU_DEVICE_CPU, |d| d.device);
            // SAFETY: as above.
            check("cuMemPrefetchAsync", unsafe {
                sys::cuMemPrefetchAsync(ptr, size as usize, device, hstream)
            })
        }
    }

    fn advise(
        &self,
        ptr: DevicePtr,
        size: u64,
        advice: Advice,
        location: Location,
    ) -> DriverResult<()> {
        let target = match location {
            Location::Host => None,
            Location::Device(d) => Some(self.dev(d)?),
        };
        self.check_managed_calls("cuMemAdvise")?;
        let _ctx = self.enter(0)?;
        if self.location_calls {
            let loc = mem_location(location, target.map_or(0, |d| d.ordinal));
            // SAFETY: advice on a managed range of the caller's.
            check("cuMemAdvise_v2", unsafe {
                sys::cuMemAdvise_v2(ptr, size as usize, advice_of(advice), loc)
            })
        } else {
            let device = target.map_or(CU_DEVICE_CPU, |d| d.device);
            // SAFETY: as above.
            check("cuMemAdvise", unsafe {
                sys::cuMemAdvise(ptr, size as usize, advice_of(advice), device)
            })
        }
    }

    fn reserve_address(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        let _ctx = self.enter(device)?;
        let alignment = self.dev(device)?.vmm_granularity.unwrap_or(0) as usize;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: reserves address space only.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size as usize, alignment, 0, 0)
        })?;
        Ok(ptr)
    }

    fn free_address(&self, device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        // SAFETY: `ptr`/`size` came from reserve_address and nothing is mapped there.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr, size as usize)
        })
    }

    fn min_free_fence_interval(&self) -> std::time::Duration {
        // A fence costs the host an event record and, later, a query: about 2 µs on an H100
        // (`benches/gpu/vmm_cost.cu`), so at most one per ms keeps it near 0.2% of a
        // free-heavy loop. A GPU runs ms behind a host that queues ahead, so a growth
        // that must wait for a free's fence waits little longer for it being coarser, and
        // such waits are rare (a few per run in steady state: `ccalloc_get_paging_stats`).
        std::time::Duration::from_millis(1)
    }

    fn times_page_moves(&self) -> bool {
        true
    }

    fn create_physical(&self, device: usize, size: u64) -> DriverResult<PhysHandle> {
        let _ctx = self.enter(device)?;
        let d = self.dev(device)?;
        let mut prop = allocation_prop(d.ordinal);
        prop.allocFlags.gpuDirectRDMACapable = d.rdma_capable as u8;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: creates pinned device memory of a granularity multiple.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size as usize, &prop, 0)
        })?;
        Ok(PhysHandle(handle))
    }

    fn release_physical(&self, device: usize, handle: PhysHandle, _size: u64) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        // SAFETY: the handle came from create_physical and is mapped nowhere.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) })
    }

    fn map(&self, device: usize, va: DevicePtr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        // SAFETY: `va` is granule-aligned in a reserved range, `handle` a whole allocation of `size`.
        check("cuMemMap", unsafe {
            sys::cuMemMap(va, size as usize, 0, handle.0, 0)
        })
    }

    fn set_access(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        let d = self.dev(device)?;
        // The device itself, and every device that can reach it: mapped memory ignores
        // cudaDeviceEnablePeerAccess, so peer kernels and copies need a grant of their own
        // (PyTorch's expandable segments grant them as peers are enabled).
        let access: Vec<sys::CUmemAccessDesc> = std::iter::once(d.ordinal)
            .chain(d.peers.iter().copied())
            .map(|ordinal| {
                // SAFETY: zero is a valid value for this plain C struct.
                let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                access.location = allocation_prop(ordinal).location;
                access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                access
            })
            .collect();
        // SAFETY: grants read/write access to a fully mapped range.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va, size as usize, access.as_ptr(), access.len())
        })
    }

    fn unmap(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        let _ctx = self.enter(device)?;
        // SAFETY: the caller made sure no queued work uses the range.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(va, size as usize) })
    }
}
