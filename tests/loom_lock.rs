//! Model check of the device lock (`ccalloc::testing::SpinThenBlock`) with loom, which runs
//! every interleaving of the threads below. What it checks is the protocol (try the lock,
//! then fall back to blocking): mutual exclusion and no lost wake-up across both paths. The
//! spin's timing is not modelled (see `src/sync.rs`). Only under `--cfg loom`:
//! `RUSTFLAGS="--cfg loom" cargo test --release --test loom_lock` (scripts/test.sh runs it).
#![cfg(loom)]

use ccalloc::testing::SpinThenBlock;
use loom::sync::Arc;
use loom::thread;

/// A read-modify-write split by a yield: any interleaving that let two threads in at once
/// would lose an increment.
fn increment(lock: &SpinThenBlock<u32>) {
    let mut guard = lock.lock().expect("not poisoned");
    let seen = *guard;
    thread::yield_now();
    *guard = seen + 1;
}

/// Covers both paths of `lock`: in some interleavings a waiter gets the lock on its spin,
/// in others it falls back to blocking (a model whose fallback panicked fails here).
#[test]
fn two_threads_and_the_main_one_never_hold_it_at_once() {
    loom::model(|| {
        let lock = Arc::new(SpinThenBlock::new(0));
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let lock = lock.clone();
                thread::spawn(move || increment(&lock))
            })
            .collect();
        increment(&lock);
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(*lock.lock().unwrap(), 3);
    });
}

/// The front caches' cell (`ccalloc::testing::SpinCell`): its owner and another thread (as a
/// drain from a slow path) update its value; loom's `UnsafeCell` fails the model if two
/// accesses are not ordered by the flag's acquire/release, whatever the interleaving, and a
/// lost update fails the count. (Two threads, as in use: with two waiters yielding to each
/// other loom's search of the spin does not end.)
#[test]
fn spin_cell_lets_one_thread_in_at_a_time() {
    use ccalloc::testing::SpinCell;
    loom::model(|| {
        let cell = Arc::new(SpinCell::new(0u32));
        let other = {
            let cell = cell.clone();
            thread::spawn(move || {
                cell.with(|v| *v += 1);
                cell.with(|v| *v += 10);
            })
        };
        cell.with(|v| *v += 100);
        other.join().unwrap();
        assert_eq!(cell.with(|v| *v), 111);
    });
}
