//! A thread that runs jobs one at a time while its caller waits: tests whose threads take
//! turns, so that every run makes the same calls in the same order.

use std::sync::mpsc::{channel, Sender};

/// A long-lived thread that runs what it is given, one job at a time, while the caller
/// waits: threads take turns, so a run is deterministic.
pub struct Worker {
    jobs: Option<Sender<Box<dyn FnOnce() + Send>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    pub fn new() -> Self {
        let (tx, rx) = channel::<Box<dyn FnOnce() + Send>>();
        let thread = std::thread::spawn(move || {
            for job in rx {
                job();
            }
        });
        Self {
            jobs: Some(tx),
            thread: Some(thread),
        }
    }

    pub fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = channel();
        let job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.jobs.as_ref().unwrap().send(job).unwrap();
        rx.recv().expect("the worker's job panicked")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
