//! Paged segments' logic, without driver calls: the page table of each segment (`table`),
//! growth's plan and the chunks it may unmap (`plan`), fences (`fences`), and the slack
//! controller (`budget`). `shard::paging` does the driver I/O they decide.

// With the driver's virtual memory management, each (stream, pool) gets one address range
// as large as the device, carved into blocks like any segment but backed by physical memory
// only where blocks need it, in chunks (`table::chunk_pages_for`). Chunks under free blocks
// stay mapped, so steady-state reuse costs no driver call, until growth would push reserved
// memory past the live high-water mark plus a slack (`budget`); then chunks lying wholly
// under free blocks are unmapped and mapped again where needed, or given back. A chunk
// moves only once the device is done with the work queued before its last free (`fences`),
// and placement (`State::take_cached`) prefers places whose pages are mapped, since each
// move costs tens of microseconds of driver calls (`benches/gpu/vmm_cost.cu`).

pub mod budget;
pub mod fences;
pub mod plan;
pub mod table;
