//! The process-wide allocator: one driver, one lazily created `DeviceAllocator` per device,
//! and the global instance the C API uses (init / shutdown).

use crate::alloc::blocks::BlockState;
use crate::alloc::DeviceAllocator;
use crate::config::Config;
use crate::driver::cuda::CudaDriver;
use crate::driver::host::{HostDriver, ALLOCATION_STREAM};
#[cfg(feature = "sim")]
use crate::driver::sim::SimDriver;
use crate::driver::{Advice, DevicePtr, Driver, HostKind, Location, StreamId};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::lock;
use once_cell::sync::OnceCell;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub struct Runtime {
    driver: Arc<dyn Driver>,
    /// The same driver when it is the simulated one, for the test controls.
    #[cfg(feature = "sim")]
    sim: Option<Arc<SimDriver>>,
    /// Created on first use: retaining a CUDA context costs memory on devices never used.
    devices: Vec<OnceCell<DeviceAllocator>>,
    /// The pinned host and managed memory caches, created on first use.
    pinned: OnceCell<HostAllocator>,
    managed: OnceCell<HostAllocator>,
    config: Mutex<Config>,
    /// Set by `shutdown`: no device is started afterwards (a call racing a shutdown must
    /// not bring up a fresh allocator in a runtime nobody will release). The one record of
    /// whether this runtime is shut down; the global lifecycle below only says which
    /// runtime, if any, is published.
    shut_down: AtomicBool,
    /// Used as the global runtime by a thread that could not publish it in its hazard slot
    /// (a call from a thread-local destructor): never freed.
    pinned_forever: AtomicBool,
}

/// A cache of pinned host or managed memory: the caching allocator core over a
/// `HostDriver`, and the live blocks' requested ranges (prefetch and advice must stay
/// inside one).
pub struct HostAllocator {
    driver: Arc<HostDriver>,
    allocator: DeviceAllocator,
    live: Mutex<BTreeMap<DevicePtr, u64>>,
}

impl HostAllocator {
    pub fn kind(&self) -> HostKind {
        self.driver.kind()
    }

    /// The allocator core behind it (statistics, empty_cache, peaks).
    pub fn allocator(&self) -> &DeviceAllocator {
        &self.allocator
    }

    fn live(&self) -> Result<MutexGuard<'_, BTreeMap<DevicePtr, u64>>> {
        lock(&self.live, kind_table(self.kind()))
    }

    /// The live block holding all of `[ptr, ptr+size)`, as (start, requested size).
    fn live_block_holding(&self, ptr: DevicePtr, size: u64) -> Result<Option<(DevicePtr, u64)>> {
        let live = self.live()?;
        Ok(live.range(..=ptr).next_back().and_then(|(&start, &len)| {
            (ptr.checked_add(size)? <= start + len).then_some((start, len))
        }))
    }

    /// The live block whose memory holds `ptr`, as (start, requested size): `ptr` may lie
    /// past the requested size, in what the block's rounding added. Used on error paths
    /// only (it walks the segments).
    fn live_block_around(&self, ptr: DevicePtr) -> Option<(DevicePtr, u64)> {
        let (start, len) = {
            let live = self.live().ok()?;
            let (&start, &len) = live.range(..=ptr).next_back()?;
            (start, len)
        };
        let segments = self.allocator.segments().ok()?;
        segments
            .iter()
            .flat_map(|s| &s.blocks)
            .any(|&(addr, size, state)| {
                addr == start && state == BlockState::Allocated && ptr - addr < size
            })
            .then_some((start, len))
    }

    /// Errors of the allocator core name its one device, "device 0": said as what it is.
    fn relabel(&self, mut error: Error) -> Error {
        let label = kind_label(self.kind());
        error.message = error
            .message
            .replace("on device 0", &format!("in {label}"))
            .replace("device 0", label);
        error
    }
}

fn kind_label(kind: HostKind) -> &'static str {
    match kind {
        HostKind::Pinned => "pinned host memory",
        HostKind::Managed => "managed memory",
    }
}

/// What the poisoned-lock error of a cache's live-block table names.
fn kind_table(kind: HostKind) -> &'static str {
    match kind {
        HostKind::Pinned => "the table of live pinned host blocks",
        HostKind::Managed => "the table of live managed blocks",
    }
}

fn kind_block(kind: HostKind) -> (&'static str, &'static str) {
    match kind {
        HostKind::Pinned => ("a pinned host block", "ccalloc_host_free"),
        HostKind::Managed => ("a managed block", "ccalloc_managed_free"),
    }
}

impl Runtime {
    pub fn new(driver: Arc<dyn Driver>, config: Config) -> Self {
        let devices = (0..driver.device_count())
            .map(|_| OnceCell::new())
            .collect();
        Self {
            driver: Arc::new(crate::driver::traced::Traced::new(driver)),
            #[cfg(feature = "sim")]
            sim: None,
            devices,
            config: Mutex::new(config),
            shut_down: AtomicBool::new(false),
            pinned_forever: AtomicBool::new(false),
            pinned: OnceCell::new(),
            managed: OnceCell::new(),
        }
    }

    #[cfg(feature = "sim")]
    pub fn with_sim(sim: Arc<SimDriver>, config: Config) -> Self {
        let mut runtime = Self::new(sim.clone(), config);
        runtime.sim = Some(sim);
        runtime
    }

    /// Backend from `CCALLOC_BACKEND` (`cuda`, the default, or `sim`), config from `CCALLOC_CONF`.
    pub fn from_env() -> Result<Self> {
        let config = Config::from_env()?;
        let backend = std::env::var("CCALLOC_BACKEND").unwrap_or_else(|_| "cuda".into());
        match backend.trim() {
            #[cfg(feature = "sim")]
            "sim" => {
                let sim = SimDriver::from_env().map_err(|m| Error::new(ErrorKind::Config, m))?;
                Ok(Self::with_sim(Arc::new(sim), config))
            }
            #[cfg(not(feature = "sim"))]
            "sim" => Err(Error::new(ErrorKind::Config, crate::driver::NO_SIM_BUILD)),
            "cuda" | "" => {
                let driver = CudaDriver::new().map_err(crate::alloc::driver_error_of)?;
                Ok(Self::new(Arc::new(driver), config))
            }
            other => Err(Error::new(
                ErrorKind::Config,
                format!("CCALLOC_BACKEND={other:?}: expected cuda or sim"),
            )),
        }
    }

    pub fn backend(&self) -> &'static str {
        self.driver.name()
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    #[cfg(feature = "sim")]
    pub fn sim(&self) -> Option<&SimDriver> {
        self.sim.as_deref()
    }

    /// The allocator of `device`, created on first use.
    #[inline]
    pub fn device(&self, device: i64) -> Result<&DeviceAllocator> {
        let started = usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .and_then(OnceCell::get);
        match started {
            Some(started) => Ok(started),
            None => self.start_device(device),
        }
    }

    /// `device` when its allocator is not started yet, or the index is wrong.
    #[cold]
    #[inline(never)]
    fn start_device(&self, device: i64) -> Result<&DeviceAllocator> {
        let device = self.check_device_index(device)?;
        self.start(&self.devices[device], |config| {
            DeviceAllocator::new(device, self.driver.clone(), config.clone())
        })
    }

    /// `cell`'s allocator, made by `make` on first use. Made under the settings lock, which
    /// `shutdown` and `set_config` hold throughout: one they did not see cannot appear while
    /// they run, and none is made after a shutdown.
    fn start<'a, T>(
        &self,
        cell: &'a OnceCell<T>,
        make: impl FnOnce(&Config) -> Result<T>,
    ) -> Result<&'a T> {
        if let Some(started) = cell.get() {
            return Ok(started);
        }
        let config = self.settings()?;
        cell.get_or_try_init(|| {
            if self.shut_down.load(Ordering::Acquire) {
                return Err(shut_down_error());
            }
            make(&config)
        })
    }

    /// Devices whose allocator exists already.
    pub fn started_devices(&self) -> impl Iterator<Item = &DeviceAllocator> {
        self.devices.iter().filter_map(OnceCell::get)
    }

    #[inline]
    pub fn malloc(&self, size: u64, device: i64, stream: StreamId) -> Result<DevicePtr> {
        self.device(device)?.malloc(size, stream)
    }

    /// Frees `ptr` on `device`; a pointer that belongs to another device is named as such.
    pub fn free(&self, ptr: DevicePtr, device: i64) -> Result<()> {
        let allocator = self.device(device)?;
        allocator
            .free(ptr)
            .map_err(|e| self.blame_other_device(e, ptr, device))
    }

    /// `free` for a block allocated on `stream`: its stream's shard is asked first.
    #[inline]
    pub fn free_on(&self, ptr: DevicePtr, device: i64, stream: StreamId) -> Result<()> {
        let allocator = self.device(device)?;
        allocator
            .free_on(ptr, stream)
            .map_err(|e| self.blame_other_device(e, ptr, device))
    }

    pub fn record_stream(&self, ptr: DevicePtr, device: i64, stream: StreamId) -> Result<()> {
        let allocator = self.device(device)?;
        allocator
            .record_stream(ptr, stream)
            .map_err(|e| self.blame_other_device(e, ptr, device))
    }

    /// The device whose allocator holds `ptr`, if any.
    pub fn device_holding(&self, ptr: DevicePtr) -> Option<usize> {
        self.started_devices()
            .find(|d| d.holds(ptr))
            .map(|d| d.device())
    }

    fn blame_other_device(&self, error: Error, ptr: DevicePtr, device: i64) -> Error {
        if error.kind != ErrorKind::UnknownPointer {
            return error;
        }
        if let Some(host) = self.host_side_holding(ptr) {
            let (what, free) = kind_block(host.kind());
            return Error::new(
                ErrorKind::UnknownPointer,
                format!("{ptr:#x} is {what}, not a block of device {device}: free it with {free}"),
            );
        }
        match self
            .started_devices()
            .find(|d| d.device() as i64 != device && d.holds(ptr))
        {
            Some(owner) => Error::new(
                ErrorKind::WrongDevice,
                format!(
                    "{ptr:#x} belongs to device {}, not device {device}",
                    owner.device()
                ),
            ),
            None => error,
        }
    }

    /// The pinned host (`HostKind::Pinned`) or managed memory cache, created on first use.
    pub fn host_side(&self, kind: HostKind) -> Result<&HostAllocator> {
        let cell = match kind {
            HostKind::Pinned => &self.pinned,
            HostKind::Managed => &self.managed,
        };
        self.start(cell, |config| {
            let driver = Arc::new(HostDriver::new(self.driver.clone(), kind));
            let allocator = DeviceAllocator::new(0, driver.clone(), config.clone())?;
            Ok(HostAllocator {
                driver,
                allocator,
                live: Mutex::new(BTreeMap::new()),
            })
        })
    }

    /// The started host-side caches.
    pub fn started_host_sides(&self) -> impl Iterator<Item = &HostAllocator> {
        [&self.pinned, &self.managed]
            .into_iter()
            .filter_map(OnceCell::get)
    }

    fn host_side_holding(&self, ptr: DevicePtr) -> Option<&HostAllocator> {
        self.started_host_sides().find(|h| h.allocator.holds(ptr))
    }

    /// Allocates `size` bytes of pinned host or managed memory.
    pub fn host_malloc(&self, kind: HostKind, size: u64) -> Result<DevicePtr> {
        if size == 0 {
            return Err(Error::new(
                ErrorKind::InvalidSize,
                format!("{} of 0 bytes: size must be positive", kind_label(kind)),
            ));
        }
        let host = self.host_side(kind)?;
        let ptr = host
            .allocator
            .malloc(size, ALLOCATION_STREAM)
            .map_err(|e| host.relabel(e))?;
        host.live()?.insert(ptr, size);
        Ok(ptr)
    }

    /// Frees a block from `host_malloc`; a device block, or one of the other kind, is named
    /// as such.
    pub fn host_free(&self, kind: HostKind, ptr: DevicePtr) -> Result<()> {
        let host = self.host_side(kind)?;
        // Out of the live table before the allocator frees it: once freed, another thread may
        // be handed the same address and insert it again.
        let size = host.live()?.remove(&ptr);
        match host.allocator.free(ptr) {
            Ok(()) => Ok(()),
            Err(e) => {
                if let Some(size) = size {
                    host.live()?.insert(ptr, size);
                }
                Err(match e.kind {
                    ErrorKind::UnknownPointer => self.not_host_block(kind, ptr),
                    _ => host.relabel(e),
                })
            }
        }
    }

    /// Why `ptr` is not a block of the `kind` cache: it is another kind's, or a device's.
    fn not_host_block(&self, kind: HostKind, ptr: DevicePtr) -> Error {
        let (_, free) = kind_block(kind);
        let other = self
            .started_host_sides()
            .find(|h| h.kind() != kind && h.allocator.holds(ptr));
        let message = if let Some(other) = other {
            let (what, right) = kind_block(other.kind());
            format!(
                "{ptr:#x} is {what}, not {}: free it with {right}",
                kind_label(kind)
            )
        } else if let Some(device) = self.device_holding(ptr) {
            format!(
                "{ptr:#x} is a block of device {device}, not {}: free it with ccalloc_free",
                kind_label(kind)
            )
        } else {
            format!(
                "{ptr:#x} was not allocated by {}",
                free.replace("free", "malloc")
            )
        };
        Error::new(ErrorKind::UnknownPointer, message)
    }

    /// Marks a live host-side block as used by work on `stream` of `device`: once freed, it
    /// is reused only after that work has completed.
    pub fn host_record_stream(
        &self,
        kind: HostKind,
        ptr: DevicePtr,
        device: i64,
        stream: StreamId,
    ) -> Result<()> {
        let device = self.check_device_index(device)?;
        let host = self.host_side(kind)?;
        let tag = host.driver.tag(device, stream)?;
        match host.allocator.record_stream(ptr, tag) {
            Ok(()) => Ok(()),
            Err(e) if e.kind == ErrorKind::UnknownPointer => Err(self.not_host_block(kind, ptr)),
            Err(e) => Err(host.relabel(e)),
        }
    }

    /// `device` as an index of `devices`, or the error that names the devices there are.
    fn check_device_index(&self, device: i64) -> Result<usize> {
        usize::try_from(device)
            .ok()
            .filter(|&d| d < self.devices.len())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidDevice,
                    format!(
                        "device {device} does not exist ({} backend has {} devices)",
                        self.backend(),
                        self.devices.len()
                    ),
                )
            })
    }

    /// `[ptr, ptr+size)` must lie inside one live managed block; `doing` names the call.
    fn check_managed_range(
        &self,
        ptr: DevicePtr,
        size: u64,
        doing: &str,
    ) -> Result<&HostAllocator> {
        if size == 0 {
            return Err(Error::new(
                ErrorKind::InvalidSize,
                format!("{doing} 0 bytes at {ptr:#x}: size must be positive"),
            ));
        }
        let managed = self.host_side(HostKind::Managed)?;
        if managed.live_block_holding(ptr, size)?.is_some() {
            return Ok(managed);
        }
        // A range starting in a live block (its requested bytes or its rounding) runs past
        // that block's end; only memory in no live block is freed memory.
        let (kind, message) = if let Some((start, len)) = managed.live_block_around(ptr) {
            (
                ErrorKind::InvalidArgument,
                format!(
                    "{doing} {ptr:#x}+{size}, past the end of the managed block {start:#x} \
                     of {len} bytes"
                ),
            )
        } else if managed.allocator.holds(ptr) {
            (
                ErrorKind::DoubleFree,
                format!("{doing} freed memory: {ptr:#x} is not in a live managed block"),
            )
        } else {
            let what = if let Some(host) = self.host_side_holding(ptr) {
                kind_block(host.kind()).0.to_string()
            } else if let Some(device) = self.device_holding(ptr) {
                format!("a block of device {device}")
            } else {
                "not ccalloc's".to_string()
            };
            (
                ErrorKind::UnknownPointer,
                format!("{doing} a range that is not managed: {ptr:#x} is {what}"),
            )
        };
        Err(Error::new(kind, message))
    }

    fn location_of(&self, device: i64) -> Result<Location> {
        if device == -1 {
            return Ok(Location::Host);
        }
        Ok(Location::Device(self.check_device_index(device)?))
    }

    /// Queues on `stream` a move of managed `[ptr, ptr+size)` to `device` (-1: the host).
    /// The stream is that device's (device 0's for the host); the block is then reused only
    /// after the move.
    pub fn prefetch(&self, ptr: DevicePtr, size: u64, device: i64, stream: StreamId) -> Result<()> {
        let to = self.location_of(device)?;
        let managed = self.check_managed_range(ptr, size, "prefetching")?;
        let stream_device = match to {
            Location::Host => 0,
            Location::Device(d) => d,
        };
        self.driver
            .prefetch(ptr, size, to, stream_device, stream)
            .map_err(crate::alloc::driver_error_of)?;
        let (start, _) = managed
            .live_block_holding(ptr, size)?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "managed block vanished"))?;
        managed
            .allocator
            .record_stream(start, managed.driver.tag(stream_device, stream)?)
    }

    /// Advice on how managed `[ptr, ptr+size)` is used, about `device` (-1: the host).
    pub fn advise(&self, ptr: DevicePtr, size: u64, advice: Advice, device: i64) -> Result<()> {
        let location = self.location_of(device)?;
        self.check_managed_range(ptr, size, "advice on")?;
        self.driver
            .advise(ptr, size, advice, location)
            .map_err(crate::alloc::driver_error_of)
    }

    /// Applies `key:value,...` to the settings of every device, present and future.
    pub fn set_config(&self, text: &str) -> Result<()> {
        let mut config = self.settings()?;
        let mut next = config.clone();
        next.apply(text)?;
        // Every device must accept it before any changes (per_stream_shards is fixed once a
        // device allocates): each device's settings are held from its check to its change,
        // so that none allocates for the first time in between.
        let devices: Vec<&DeviceAllocator> = self.started_devices().collect();
        let mut held = devices
            .iter()
            .map(|d| d.lock_settings())
            .collect::<Result<Vec<_>>>()?;
        for (device, held) in devices.iter().zip(&held) {
            device.check_config_locked(held, text)?;
        }
        for (device, held) in devices.iter().zip(&mut held) {
            device.apply_config_locked(held, text)?;
        }
        *config = next;
        Ok(())
    }

    /// Defaults plus `CCALLOC_CONF`, on every device.
    pub fn reset_config(&self) -> Result<()> {
        let fresh = Config::from_env()?;
        let mut config = self.settings()?;
        for device in self.started_devices() {
            device.set_config(fresh.clone())?;
        }
        *config = fresh;
        Ok(())
    }

    pub fn config(&self) -> Result<Config> {
        Ok(self.settings()?.clone())
    }

    /// The settings lock, which also orders device starts against `shutdown`.
    fn settings(&self) -> Result<MutexGuard<'_, Config>> {
        lock(&self.config, "the runtime's settings")
    }

    /// Releases everything; refused (nothing changed) while any device has live blocks.
    pub fn shutdown(&self) -> Result<()> {
        // No device starts meanwhile (`device` starts them under this lock): one started
        // after the list below is taken would be missed, left running with its memory.
        let _settings = self.settings()?;
        // All or nothing: if a device refuses (an allocation raced in, or the driver
        // failed), the ones already shut down are reopened.
        let started: Vec<&DeviceAllocator> = self.started_devices().collect();
        // Refused before anything is released, while any device has live blocks.
        for device in &started {
            let live = device.stats()?.allocation.all().current;
            if live > 0 {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "device {} still has {live} live allocations; free them before shutdown",
                        device.device()
                    ),
                ));
            }
        }
        for host in self.started_host_sides() {
            let live = host.allocator.stats()?.allocation.all().current;
            if live > 0 {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "{} still has {live} live allocations; free them before shutdown",
                        kind_label(host.kind())
                    ),
                ));
            }
        }
        let started: Vec<&DeviceAllocator> = started
            .into_iter()
            .chain(self.started_host_sides().map(|h| &h.allocator))
            .collect();
        for (i, device) in started.iter().enumerate() {
            if let Err(e) = device.shutdown() {
                started[..i].iter().for_each(|d| d.reopen());
                return Err(e);
            }
        }
        self.shut_down.store(true, Ordering::Release);
        Ok(())
    }
}

/// The running runtime behind the C API (null while there is none).
///
/// A runtime is freed once it is shut down and no thread can still be using it. Each thread
/// publishes the runtime it is using in its hazard slot (`protect`) before it uses it; a
/// retired runtime is freed only when no slot names it (`reclaim`). A slot keeps naming the
/// runtime until the thread's next call replaces it (or the thread exits), so the fast path
/// of a call that uses the same runtime as the last one is a plain load and compare.
/// It changes only under `LIFECYCLE`: ccalloc is running exactly while it is non-null.
static GLOBAL: AtomicPtr<Runtime> = AtomicPtr::new(std::ptr::null_mut());
static LIFECYCLE: Mutex<Lifecycle> = Mutex::new(Lifecycle {
    started: false,
    retired: Vec::new(),
});

struct Lifecycle {
    /// Whether a runtime was ever published: with `GLOBAL` null, it tells a shut down
    /// ccalloc (`ShutDown`) from one never started (`NotInitialized`).
    started: bool,
    /// Shut down runtimes that a thread may still be using (freed by `reclaim`).
    retired: Vec<Retired>,
}

fn lifecycle() -> Result<MutexGuard<'static, Lifecycle>> {
    lock(&LIFECYCLE, "ccalloc's init/shutdown state")
}

/// What every call gets once the runtime it would use is shut down.
fn shut_down_error() -> Error {
    Error::new(ErrorKind::ShutDown, "ccalloc has been shut down")
}

/// A shut down runtime, from `Box::into_raw`.
struct Retired(*mut Runtime);

// SAFETY: a `Runtime` is Send and Sync; the pointer is owned here until freed.
unsafe impl Send for Retired {}

/// One thread's hazard slot: the runtime it may be using (null: none).
struct HazardSlot {
    runtime: AtomicPtr<Runtime>,
    /// Taken by a live thread; a free slot is reused by the next thread to register.
    taken: AtomicBool,
}

/// Every slot ever made (one per thread alive at once; never freed, so that `reclaim` may
/// read a slot while its thread exits).
static SLOTS: Mutex<Vec<&'static HazardSlot>> = Mutex::new(Vec::new());

/// The calling thread's slot, given back when the thread exits.
struct ThreadHazard(&'static HazardSlot);

impl ThreadHazard {
    fn register() -> Result<Self> {
        let mut slots = lock(&SLOTS, "the threads' hazard slots")?;
        let free = slots.iter().find(|s| {
            s.taken
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        let slot = match free {
            Some(slot) => *slot,
            None => {
                let slot: &'static HazardSlot = Box::leak(Box::new(HazardSlot {
                    runtime: AtomicPtr::new(std::ptr::null_mut()),
                    taken: AtomicBool::new(true),
                }));
                slots.push(slot);
                slot
            }
        };
        Ok(Self(slot))
    }
}

impl Drop for ThreadHazard {
    fn drop(&mut self) {
        // Forgotten by this thread before it is given back: another thread may take it next.
        let _ = CALLS.try_with(|c| c.slot.set(None));
        self.0.runtime.store(std::ptr::null_mut(), Ordering::SeqCst);
        self.0.taken.store(false, Ordering::Release);
    }
}

thread_local! {
    /// Owns the calling thread's slot (registered on its first call), and gives it back when
    /// the thread exits; `CALLS.slot` names the same slot meanwhile.
    static HAZARD: Result<ThreadHazard> = ThreadHazard::register();
}

/// What every C API call of a thread reads: in one const-initialised thread-local without a
/// destructor, so that reading it is a single thread-local access with no lazy-init check,
/// and it stays readable while the thread's other thread-locals are destroyed.
struct ThreadCalls {
    /// How many C API calls this thread is inside (more than one: a call made from a
    /// callback, such as a pool's stream filter, inside another call).
    depth: Cell<u32>,
    /// The slot `HAZARD` owns, once registered; `None` before that and once it is given
    /// back (`ThreadHazard::drop`).
    slot: Cell<Option<&'static HazardSlot>>,
    /// Whether this thread is running a segment observer (`ObserverScope`), which runs with
    /// ccalloc's locks held: a call from it is refused (`guard`), since it would wait for
    /// a lock its own thread holds.
    in_observer: Cell<bool>,
}

thread_local! {
    static CALLS: ThreadCalls = const {
        ThreadCalls {
            depth: Cell::new(0),
            slot: Cell::new(None),
            in_observer: Cell::new(false),
        }
    };
}

/// Marks the calling thread as running segment observers until dropped.
pub(crate) struct ObserverScope(bool);

impl ObserverScope {
    pub(crate) fn enter() -> Self {
        Self(CALLS.with(|c| c.in_observer.replace(true)))
    }
}

impl Drop for ObserverScope {
    fn drop(&mut self) {
        let _ = CALLS.try_with(|c| c.in_observer.set(self.0));
    }
}

/// This thread's hazard slot, registered on first use; `None` once the thread's storage is
/// gone (a call from a thread-local destructor).
fn own_slot() -> Option<Result<&'static HazardSlot>> {
    if let Some(slot) = CALLS.with(|c| c.slot.get()) {
        return Some(Ok(slot));
    }
    HAZARD
        .try_with(|h| {
            let slot = h.as_ref().map_err(Error::clone)?.0;
            CALLS.with(|c| c.slot.set(Some(slot)));
            Ok(slot)
        })
        .ok()
}

/// Set in a child process by the `pthread_atfork` handler: the parent's allocator state
/// (and, on CUDA, its context) is not valid there, and locks may be held by parent threads
/// that do not exist in the child.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_in_child() {
    FORKED.store(true, Ordering::SeqCst);
}

/// The error of every call made in a child process forked after ccalloc was initialized.
pub(crate) const FORKED_MESSAGE: &str =
    "ccalloc cannot be used in a child process after fork(): the \
     parent's allocator (and its CUDA context) is not valid here, as CUDA itself is unusable \
     after fork. Start child processes that allocate with exec/spawn (Python: \
     multiprocessing's \"spawn\" start method)";

/// Fails at once, taking no lock, in a child process forked after ccalloc was initialized.
pub(crate) fn check_not_forked() -> Result<()> {
    if is_forked_child() {
        return Err(Error::new(ErrorKind::DriverUnavailable, FORKED_MESSAGE));
    }
    Ok(())
}

/// Whether this process is a child forked after ccalloc was initialized.
pub(crate) fn is_forked_child() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Counts the calling thread into a C API call until dropped (`ffi::boundary::guard`).
pub(crate) struct CallScope(());

impl CallScope {
    /// `None` (nothing counted) inside a segment observer (`ObserverScope`), where a call
    /// must be refused: read with the depth, in the one thread-local access a call makes.
    #[inline]
    pub(crate) fn enter() -> Option<Self> {
        CALLS.with(|c| {
            if c.in_observer.get() {
                return None;
            }
            c.depth.set(c.depth.get() + 1);
            Some(Self(()))
        })
    }
}

impl Drop for CallScope {
    #[inline]
    fn drop(&mut self) {
        CALLS.with(|c| c.depth.set(c.depth.get().saturating_sub(1)));
    }
}

fn nested_call() -> bool {
    CALLS.with(|c| c.depth.get() > 1)
}

/// The running runtime when this thread's hazard slot names it already (the last call used
/// it): a slot keeps the runtime it names allocated, so no other runtime can have been
/// published at its address since, and `GLOBAL` naming it means it is the running one. One
/// thread-local read and two loads; `None` sends the caller to `protect`.
#[inline]
fn named_by_own_slot() -> Option<&'static Runtime> {
    if is_forked_child() {
        return None;
    }
    let ptr = GLOBAL.load(Ordering::SeqCst);
    let slot = CALLS.with(|c| c.slot.get())?;
    if ptr.is_null() || slot.runtime.load(Ordering::Relaxed) != ptr {
        return None;
    }
    // SAFETY: non-null values come from `Box::into_raw` in `init_global`; this one stays
    // allocated while the hazard slot names it.
    Some(unsafe { &*ptr })
}

/// The running runtime, published in this thread's hazard slot so that it is not freed
/// while in use; `None` when there is none.
fn protect() -> Result<Option<&'static Runtime>> {
    loop {
        let ptr = GLOBAL.load(Ordering::SeqCst);
        if ptr.is_null() {
            return Ok(None);
        }
        // Without a slot (a call from a thread-local destructor) the runtime is pinned
        // instead, under the lock that reclaiming takes.
        let Some(slot) = own_slot() else {
            return pin_running();
        };
        let slot = slot?;
        let mine = slot.runtime.load(Ordering::Relaxed);
        if mine == ptr {
            // See `named_by_own_slot`.
            // SAFETY: as there.
            return Ok(Some(unsafe { &*ptr }));
        }
        if !mine.is_null() && nested_call() {
            // The outer call still uses the runtime this slot names.
            return Err(Error::new(
                ErrorKind::ShutDown,
                "ccalloc was shut down and started again during this call",
            ));
        }
        slot.runtime.store(ptr, Ordering::SeqCst);
        // Published while still running: a shutdown retires it only after this point, and
        // `reclaim` then sees the slot.
        if GLOBAL.load(Ordering::SeqCst) == ptr {
            // SAFETY: non-null values come from `Box::into_raw` in `init_global`; this one
            // stays allocated while the hazard slot names it.
            return Ok(Some(unsafe { &*ptr }));
        }
    }
}

/// The running runtime, never to be freed: for a thread without its hazard slot.
fn pin_running() -> Result<Option<&'static Runtime>> {
    let _lifecycle = lifecycle()?;
    let ptr = GLOBAL.load(Ordering::SeqCst);
    // SAFETY: under the lifecycle lock the running runtime is not retired or freed.
    let Some(runtime) = (unsafe { ptr.as_ref() }) else {
        return Ok(None);
    };
    runtime.pinned_forever.store(true, Ordering::SeqCst);
    Ok(Some(runtime))
}

/// Frees the retired runtimes that no thread's hazard slot names (under the lifecycle
/// lock); returns them, to be dropped once the lock is released (dropping one may run a
/// caller's release callback, which may call back into ccalloc).
fn reclaim(lifecycle: &mut Lifecycle) -> Vec<Runtime> {
    if lifecycle.retired.is_empty() {
        return Vec::new();
    }
    // With the slots' lock poisoned no thread's use can be ruled out: nothing is freed (the
    // runtimes stay retired), and the next call that needs a slot reports the poisoning.
    let Ok(slots) = lock(&SLOTS, "the threads' hazard slots") else {
        return Vec::new();
    };
    let named: Vec<*mut Runtime> = slots
        .iter()
        .map(|s| s.runtime.load(Ordering::SeqCst))
        .collect();
    drop(slots);
    let mut freed = Vec::new();
    lifecycle.retired.retain(|r| {
        // SAFETY: retired runtimes stay allocated until freed here.
        let pinned = unsafe { &*r.0 }.pinned_forever.load(Ordering::SeqCst);
        if pinned || named.contains(&r.0) {
            return true;
        }
        // SAFETY: from `Box::into_raw`, no longer reachable through `GLOBAL` nor named by
        // any thread: nobody can use it any more.
        freed.push(*unsafe { Box::from_raw(r.0) });
        false
    });
    freed
}

/// Clears the calling thread's hazard slot, unless it is inside an outer call.
fn release_own_hazard() {
    if !nested_call() {
        if let Some(slot) = CALLS.with(|c| c.slot.get()) {
            slot.runtime.store(std::ptr::null_mut(), Ordering::SeqCst);
        }
    }
}

/// The running global runtime, or why there is none. A call racing a shutdown and init
/// gets one or the other: the runtime, or `ShutDown` (`NotInitialized` only before the
/// first successful init).
#[inline]
pub fn global() -> Result<&'static Runtime> {
    match named_by_own_slot() {
        Some(runtime) => Ok(runtime),
        None => global_slow(),
    }
}

/// `global` when this thread's slot does not name the running runtime already.
#[cold]
#[inline(never)]
fn global_slow() -> Result<&'static Runtime> {
    check_not_forked()?;
    if let Some(runtime) = protect()? {
        return Ok(runtime);
    }
    let lifecycle = lifecycle()?;
    if !GLOBAL.load(Ordering::SeqCst).is_null() {
        // Started again since the load above.
        return protect()?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "running without a runtime"));
    }
    if lifecycle.started {
        Err(shut_down_error())
    } else {
        Err(Error::new(
            ErrorKind::NotInitialized,
            "ccalloc is not initialized: call ccalloc_init() first",
        ))
    }
}

/// Registers the fork handler, once per process.
fn watch_forks() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

/// Starts the global runtime from the environment; a no-op when it is running.
pub(crate) fn init_global() -> Result<&'static Runtime> {
    check_not_forked()?;
    let mut lifecycle = lifecycle()?;
    if !GLOBAL.load(Ordering::SeqCst).is_null() {
        drop(lifecycle);
        return global();
    }
    crate::logging::init_from_env();
    let freed = reclaim(&mut lifecycle);
    watch_forks();
    let started = Runtime::from_env().map(|r| Box::into_raw(Box::new(r)));
    let runtime = match started {
        Ok(ptr) => {
            GLOBAL.store(ptr, Ordering::SeqCst);
            lifecycle.started = true;
            // Published under the lock: it cannot be retired before this thread uses it.
            protect().and_then(|r| {
                r.ok_or_else(|| Error::new(ErrorKind::Internal, "started runtime missing"))
            })
        }
        Err(e) => Err(e),
    };
    drop(lifecycle);
    drop(freed);
    let runtime = runtime?;
    tracing::info!(
        backend = runtime.backend(),
        devices = runtime.device_count(),
        "ccalloc initialized"
    );
    Ok(runtime)
}

/// Shuts the global runtime down; later calls fail with `ShutDown` until `init_global`.
/// The runtime is freed once no thread is still inside a call that uses it.
pub(crate) fn shutdown_global() -> Result<()> {
    check_not_forked()?;
    let mut lifecycle = lifecycle()?;
    let ptr = GLOBAL.load(Ordering::SeqCst);
    if ptr.is_null() {
        return Err(if lifecycle.started {
            Error::new(ErrorKind::ShutDown, "ccalloc is already shut down")
        } else {
            Error::new(
                ErrorKind::NotInitialized,
                "ccalloc is not initialized: nothing to shut down",
            )
        });
    }
    // SAFETY: the running runtime is not freed while the lifecycle lock is held.
    unsafe { &*ptr }.shutdown()?;
    GLOBAL.store(std::ptr::null_mut(), Ordering::SeqCst);
    lifecycle.retired.push(Retired(ptr));
    release_own_hazard();
    let freed = reclaim(&mut lifecycle);
    drop(lifecycle);
    drop(freed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;

    /// Holds `mutex` on another thread that panics: the lock is poisoned.
    fn poison<T: Send>(mutex: &Mutex<T>) {
        std::thread::scope(|s| {
            let held = s.spawn(|| {
                let _held = mutex.lock();
                panic!("a bug while the lock is held");
            });
            assert!(held.join().is_err());
        });
        assert!(mutex.is_poisoned());
    }

    fn assert_poisoned<T: std::fmt::Debug>(result: Result<T>, what: &str) {
        let error = result.expect_err("a call on a poisoned lock fails");
        assert_eq!(error.kind, ErrorKind::Internal, "{}", error.message);
        assert!(
            error.message.contains(what) && error.message.contains("poisoned"),
            "{}",
            error.message
        );
    }

    #[test]
    fn poisoned_settings_are_an_internal_error_not_a_panic() {
        let rt = Runtime::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
        poison(&rt.config);
        let settings = "the runtime's settings";
        assert_poisoned(rt.device(0).map(|_| ()), settings);
        assert_poisoned(rt.set_config("max_split_size_mb:64"), settings);
        assert_poisoned(rt.config(), settings);
        assert_poisoned(rt.shutdown(), settings);
    }

    #[test]
    fn a_poisoned_host_block_table_is_an_internal_error_not_a_panic() {
        let rt = Runtime::new(Arc::new(SimDriver::new(1, 1 << 30)), Config::default());
        let ptr = rt.host_malloc(HostKind::Pinned, 4096).unwrap();
        poison(&rt.host_side(HostKind::Pinned).unwrap().live);
        let table = "the table of live pinned host blocks";
        assert_poisoned(rt.host_free(HostKind::Pinned, ptr), table);
        assert_poisoned(rt.host_malloc(HostKind::Pinned, 4096), table);
    }
}
