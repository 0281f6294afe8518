//! The simulated device's test controls (`ccalloc_sim_*`), only in builds with the `sim`
//! feature. cbindgen writes them to include/ccalloc_sim.h, apart from the production header.

use super::boundary::{guard, require_out, write_out};
use super::stream_of;
use super::types::{ccalloc_status, cudaStream_t};
use crate::driver::sim::SimDriver;
use crate::error::{Error, ErrorKind};
use crate::runtime::{self, Runtime};

/// Sim backend only: a paused stream's recorded events stay incomplete until resumed.
#[no_mangle]
pub extern "C" fn ccalloc_sim_pause_stream(
    device: i32,
    stream: cudaStream_t,
    paused: bool,
) -> ccalloc_status {
    guard(|| {
        let rt = runtime::global()?;
        rt.device(device as i64)?;
        sim_of(rt)?.set_stream_paused(device as usize, stream_of(stream), paused);
        Ok(())
    })
}

/// Sim backend only: bytes the simulated device has handed to ccalloc and not taken back.
#[no_mangle]
pub extern "C" fn ccalloc_sim_device_bytes(device: i32, out_bytes: *mut u64) -> ccalloc_status {
    guard(|| {
        require_out(out_bytes, "out_bytes")?;
        let rt = runtime::global()?;
        rt.device(device as i64)?;
        let bytes = sim_of(rt)?.counters(device as usize).bytes_in_use;
        write_out(out_bytes, "out_bytes", bytes)
    })
}

/// Sim backend only: prefetches queued to `device` (-1: the host) and the bytes they moved
/// (pages already there move nothing; managed memory starts on the host).
#[no_mangle]
pub extern "C" fn ccalloc_sim_prefetches(
    device: i32,
    out_count: *mut u64,
    out_bytes: *mut u64,
) -> ccalloc_status {
    guard(|| {
        require_out(out_count, "out_count")?;
        require_out(out_bytes, "out_bytes")?;
        let c = sim_of(runtime::global()?)?.host_counters();
        let key = i64::from(device);
        let count = c.prefetches.get(&key).copied().unwrap_or(0);
        let bytes = c.migrated_bytes.get(&key).copied().unwrap_or(0);
        write_out(out_count, "out_count", count)?;
        write_out(out_bytes, "out_bytes", bytes)
    })
}

/// The runtime's simulated device; a runtime on another backend refuses the call.
fn sim_of(rt: &Runtime) -> Result<&SimDriver, Error> {
    rt.sim().ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidArgument,
            "this call needs the sim backend (CCALLOC_BACKEND=sim)",
        )
    })
}
