//! The `threads` engine: a small pool of blocking workers per IOThread, like
//! QEMU's `aio=threads`. Completions come back through a list and an eventfd.

use crate::seccomp::{SeccompMode, ThreadKind};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{execute_sync, Completion, Engine, IoOp};

struct Job {
    fd: RawFd,
    op: IoOp,
    token: u64,
}

// SAFETY: the raw iovec pointer in `op` refers to memory the submitting
// IOThread keeps alive and unmoved until it reaps this job's completion
// (the `Engine::submit` contract); the worker only reads it during the job.
unsafe impl Send for Job {}

struct Done {
    list: Mutex<Vec<Completion>>,
    /// Length of `list`, changed under its lock: the IOThread's busy-poll reads
    /// it without taking the lock.
    ready: AtomicUsize,
    efd: EventFd,
}

/// A blocking worker pool owned by one IOThread.
pub struct PoolEngine {
    tx: Option<Sender<Job>>,
    done: Arc<Done>,
    workers: Vec<JoinHandle<()>>,
}

impl PoolEngine {
    /// Starts `n` workers named `{name}-w{i}`, each under the worker seccomp
    /// filter of `seccomp`.
    pub fn new(name: &str, n: usize, seccomp: SeccompMode) -> io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let done = Arc::new(Done {
            list: Mutex::new(Vec::new()),
            ready: AtomicUsize::new(0),
            efd: EventFd::new(EFD_NONBLOCK)?,
        });
        let mut workers = Vec::new();
        for i in 0..n {
            let (rx, done) = (rx.clone(), done.clone());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("{name}-w{i}"))
                    .spawn(move || {
                        if let Err(e) = crate::seccomp::apply(ThreadKind::Worker, seccomp) {
                            log::error!("{e}: the worker runs without its own filter");
                        }
                        worker(rx, done)
                    })?,
            );
        }
        Ok(PoolEngine {
            tx: Some(tx),
            done,
            workers,
        })
    }
}

fn worker(rx: Arc<Mutex<Receiver<Job>>>, done: Arc<Done>) {
    loop {
        let job = match rx.lock().unwrap().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        // SAFETY: see `unsafe impl Send for Job`.
        let result = unsafe { execute_sync(job.fd, &job.op) };
        {
            let mut list = done.list.lock().unwrap();
            list.push(Completion {
                token: job.token,
                result,
            });
            done.ready.store(list.len(), Ordering::Release);
        }
        let _ = done.efd.write(1);
    }
}

impl PoolEngine {
    /// Queues `op` on the file `fd`; the completion carries `token`.
    ///
    /// # Safety
    /// As [`Engines::submit`](super::Engines::submit).
    pub unsafe fn submit(&mut self, fd: RawFd, op: &IoOp, token: u64) -> io::Result<()> {
        self.tx
            .as_ref()
            .expect("pool is running")
            .send(Job { fd, op: *op, token })
            .map_err(|_| io::Error::other("worker pool stopped"))
    }
}

impl Engine for PoolEngine {
    fn commit(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        if self.done.ready.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut list = self.done.list.lock().unwrap();
        out.append(&mut list);
        self.done.ready.store(0, Ordering::Release);
    }

    fn has_completions(&mut self) -> bool {
        // No lock: this is called on every busy-poll spin.
        self.done.ready.load(Ordering::Acquire) > 0
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.done.efd.as_raw_fd())
    }
}

impl Drop for PoolEngine {
    fn drop(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn completions_are_seen_without_the_lock_and_reaped_once() {
        let mut pool = PoolEngine::new("t", 2, SeccompMode::Off).unwrap();
        assert!(!pool.has_completions());
        let f = tempfile::tempfile().unwrap();
        let flush = IoOp::flush();
        for token in [1, 2] {
            // SAFETY: a flush has no buffers; `f` outlives the jobs.
            unsafe { pool.submit(f.as_raw_fd(), &flush, token).unwrap() };
        }
        let mut out = Vec::new();
        for _ in 0..5000 {
            if pool.has_completions() {
                pool.reap(&mut out);
            }
            if out.len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        out.sort_by_key(|c| c.token);
        assert_eq!(
            out,
            vec![
                Completion {
                    token: 1,
                    result: 0
                },
                Completion {
                    token: 2,
                    result: 0
                }
            ]
        );
        assert!(!pool.has_completions());
        pool.reap(&mut out);
        assert_eq!(out.len(), 2);
    }
}
