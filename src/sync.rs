//! The device lock: a std `Mutex` that spins a while before it sleeps.
//!
//! The allocator's critical sections are short (a few hundred ns) except for the slow path's
//! driver calls. A plain `Mutex` puts a waiter to sleep after a brief spin, and every hand-off
//! then costs a futex wake and a reschedule: several µs, far more than the section it waited
//! for (8 threads ran 3.6× slower per step than one on the H100). Here a waiter retries with
//! exponential backoff for up to `SPIN_BUDGET` before it blocks, so hand-offs between busy
//! threads stay in user space, and a waiter behind a long driver call still goes to sleep.
//!
//! No unsafe code: the lock is std's, spun on with `try_lock`, so poisoning (a panic while
//! the lock was held) is reported exactly as std reports it. Under `--cfg loom` the protocol
//! (try, then block) runs on loom's mutex for the model in `tests/loom_lock.rs`; the spin's
//! timing (backoff, deadline) is compiled out there, as loom has no clock.

#[cfg(loom)]
use loom::sync::{Mutex, MutexGuard};
#[cfg(loom)]
use std::sync::TryLockError;
#[cfg(not(loom))]
use std::sync::{Mutex, MutexGuard, TryLockError};

/// How long a waiter spins before it blocks. About the cost of two sleeps and wake-ups: a
/// waiter that would have slept through a short section gets it sooner, and one behind a
/// driver call (tens of µs and up) wastes at most this much CPU.
#[cfg(not(loom))]
const SPIN_BUDGET: std::time::Duration = std::time::Duration::from_micros(20);
/// Backoff between tries grows to this many pause instructions: enough to keep a few
/// spinners from bouncing the lock's cache line, short next to a critical section.
#[cfg(not(loom))]
const MAX_BACKOFF: u32 = 64;
/// Spinning tries before the first look at the clock (the clock costs ~20 ns).
#[cfg(not(loom))]
const TRIES_BEFORE_CLOCK: u32 = 8;

pub struct SpinThenBlock<T> {
    inner: Mutex<T>,
}

/// The guard `lock` returns (std's, or loom's under `--cfg loom`).
pub type Guard<'a, T> = MutexGuard<'a, T>;

/// What `lock` returns when a panic poisoned the lock: the guard, as `std` gives it.
pub type Poisoned<'a, T> = std::sync::PoisonError<MutexGuard<'a, T>>;

impl<T> SpinThenBlock<T> {
    pub fn new(value: T) -> Self {
        Self {
            inner: Mutex::new(value),
        }
    }

    /// Locks, spinning first. Errs (with the guard) when a panic poisoned the lock.
    #[inline]
    pub fn lock(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        match self.inner.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::Poisoned(poisoned)) => Err(poisoned),
            Err(TryLockError::WouldBlock) => self.lock_contended(),
        }
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        let mut tries = 0u32;
        #[cfg(not(loom))]
        let mut deadline = None;
        loop {
            match self.inner.try_lock() {
                Ok(guard) => return Ok(guard),
                Err(TryLockError::Poisoned(poisoned)) => return Err(poisoned),
                Err(TryLockError::WouldBlock) => {}
            }
            tries += 1;
            #[cfg(loom)]
            {
                // The model explores the spin once, then the blocking path.
                if tries > 1 {
                    return self.inner.lock();
                }
                loom::thread::yield_now();
            }
            #[cfg(not(loom))]
            {
                if tries >= TRIES_BEFORE_CLOCK {
                    let now = std::time::Instant::now();
                    let until = *deadline.get_or_insert(now + SPIN_BUDGET);
                    if now >= until {
                        return self.inner.lock();
                    }
                }
                for _ in 0..(1u32 << tries.min(MAX_BACKOFF.trailing_zeros())) {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Locks without spinning (for callers that do not mind waiting: shutdown, reopen).
    pub fn lock_blocking(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        self.inner.lock()
    }
}
