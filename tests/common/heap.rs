//! The process heap, counted: a test file that watches it declares
//! `#[global_allocator] static GLOBAL: common::heap::Counting = common::heap::Counting;`
//! and runs each such test alone (`serial`), since the heap is the process's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

/// Bytes the process holds on the heap now (with `Counting` as the global allocator).
pub static HEAP: AtomicI64 = AtomicI64::new(0);

/// Bytes the process holds on the heap now.
pub fn heap() -> i64 {
    HEAP.load(Relaxed)
}

/// The system allocator, counting what is held in `HEAP`.
pub struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HEAP.fetch_add(layout.size() as i64, Relaxed);
        // SAFETY: forwarded as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HEAP.fetch_sub(layout.size() as i64, Relaxed);
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HEAP.fetch_add(new_size as i64 - layout.size() as i64, Relaxed);
        // SAFETY: forwarded as given.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The tests of a file that reads the heap run one at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The heap's growth over a long run: `start` takes the baseline once warm, each `mark`
/// notes what the heap holds beyond it, and `grew` is the last mark.
#[derive(Default)]
pub struct HeapGrowth {
    base: i64,
    pub marks: Vec<i64>,
}

impl HeapGrowth {
    pub fn start(&mut self) {
        self.base = heap();
    }

    pub fn mark(&mut self) {
        self.marks.push(heap() - self.base);
    }

    pub fn grew(&self) -> i64 {
        *self.marks.last().expect("marked at least once")
    }
}
