//! The process-wide allocator: one driver, one lazily created `DeviceAllocator` per device,
//! and the global instance the C API uses (init / shutdown).

use crate::alloc::DeviceAllocator;
use crate::config::Config;
use crate::driver::cuda::CudaDriver;
use crate::driver::sim::SimDriver;
use crate::driver::{DevicePtr, Driver, StreamId};
use crate::error::{Error, ErrorKind, Result};
use once_cell::sync::OnceCell;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

pub struct Runtime {
    driver: Arc<dyn Driver>,
    /// The same driver when it is the simulated one, for the test controls.
    sim: Option<Arc<SimDriver>>,
    /// Created on first use: retaining a CUDA context costs memory on devices never used.
    devices: Vec<OnceCell<DeviceAllocator>>,
    config: Mutex<Config>,
    /// Set by `shutdown`: no device is started afterwards (a call racing a shutdown must
    /// not bring up a fresh allocator in a runtime nobody will release).
    shut_down: std::sync::atomic::AtomicBool,
}

impl Runtime {
    pub fn new(driver: Arc<dyn Driver>, config: Config) -> Self {
        let devices = (0..driver.device_count())
            .map(|_| OnceCell::new())
            .collect();
        Self {
            driver: Arc::new(crate::driver::traced::Traced::new(driver)),
            sim: None,
            devices,
            config: Mutex::new(config),
            shut_down: std::sync::atomic::AtomicBool::new(false),
        }
    }

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
            "sim" => {
                let sim = SimDriver::from_env().map_err(|m| Error::new(ErrorKind::Config, m))?;
                Ok(Self::with_sim(Arc::new(sim), config))
            }
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

    pub fn sim(&self) -> Option<&SimDriver> {
        self.sim.as_deref()
    }

    /// The allocator of `device`, created on first use.
    pub fn device(&self, device: i64) -> Result<&DeviceAllocator> {
        let cell = usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidDevice,
                    format!(
                        "device {device} does not exist ({} backend has {} devices)",
                        self.backend(),
                        self.devices.len()
                    ),
                )
            })?;
        if let Some(started) = cell.get() {
            return Ok(started);
        }
        // Started under the settings lock, which `shutdown` and `set_config` hold throughout:
        // a device they did not see cannot appear while they run.
        let config = self.config.lock().unwrap();
        cell.get_or_try_init(|| {
            if self.shut_down.load(Ordering::Acquire) {
                return Err(Error::new(
                    ErrorKind::ShutDown,
                    "ccalloc has been shut down",
                ));
            }
            DeviceAllocator::new(device as usize, self.driver.clone(), config.clone())
        })
    }

    /// Devices whose allocator exists already.
    pub fn started_devices(&self) -> impl Iterator<Item = &DeviceAllocator> {
        self.devices.iter().filter_map(OnceCell::get)
    }

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

    /// Applies `key:value,...` to the settings of every device, present and future.
    pub fn set_config(&self, text: &str) -> Result<()> {
        let mut config = self.config.lock().unwrap();
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
        let mut config = self.config.lock().unwrap();
        for device in self.started_devices() {
            device.set_config(fresh.clone())?;
        }
        *config = fresh;
        Ok(())
    }

    pub fn config(&self) -> Config {
        self.config.lock().unwrap().clone()
    }

    /// Releases everything; refused (nothing changed) while any device has live blocks.
    pub fn shutdown(&self) -> Result<()> {
        // No device starts meanwhile (`device` starts them under this lock): one started
        // after the list below is taken would be missed, left running with its memory.
        let _settings = self.config.lock().unwrap();
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

/// The runtime behind the C API. Each one is leaked on purpose: a thread still inside a call
/// while another shuts down keeps a valid reference, and finds the allocator shut down.
static GLOBAL: AtomicPtr<Runtime> = AtomicPtr::new(std::ptr::null_mut());
static LIFECYCLE: Mutex<Phase> = Mutex::new(Phase::Uninitialized);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Uninitialized,
    Running,
    ShutDown,
}

/// The running global runtime, or why there is none.
pub fn global() -> Result<&'static Runtime> {
    let ptr = GLOBAL.load(Ordering::Acquire);
    if ptr.is_null() {
        let phase = *LIFECYCLE.lock().unwrap_or_else(|e| e.into_inner());
        return Err(match phase {
            Phase::ShutDown => Error::new(ErrorKind::ShutDown, "ccalloc has been shut down"),
            _ => Error::new(
                ErrorKind::NotInitialized,
                "ccalloc is not initialized: call ccalloc_init() first",
            ),
        });
    }
    // SAFETY: non-null values come from `Box::leak` in `init_global` and are never freed.
    Ok(unsafe { &*ptr })
}

/// Starts the global runtime from the environment; a no-op when it is running.
pub fn init_global() -> Result<&'static Runtime> {
    let mut phase = LIFECYCLE.lock().unwrap_or_else(|e| e.into_inner());
    if *phase == Phase::Running {
        return global();
    }
    crate::logging::init_from_env();
    let runtime: &'static Runtime = Box::leak(Box::new(Runtime::from_env()?));
    GLOBAL.store(runtime as *const Runtime as *mut Runtime, Ordering::Release);
    *phase = Phase::Running;
    tracing::info!(
        backend = runtime.backend(),
        devices = runtime.device_count(),
        "ccalloc initialized"
    );
    Ok(runtime)
}

/// Shuts the global runtime down; later calls fail with `ShutDown` until `init_global`.
pub fn shutdown_global() -> Result<()> {
    let mut phase = LIFECYCLE.lock().unwrap_or_else(|e| e.into_inner());
    match *phase {
        Phase::Uninitialized => Err(Error::new(
            ErrorKind::NotInitialized,
            "ccalloc is not initialized: nothing to shut down",
        )),
        Phase::ShutDown => Err(Error::new(
            ErrorKind::ShutDown,
            "ccalloc is already shut down",
        )),
        Phase::Running => {
            global()?.shutdown()?;
            GLOBAL.store(std::ptr::null_mut(), Ordering::Release);
            *phase = Phase::ShutDown;
            Ok(())
        }
    }
}
