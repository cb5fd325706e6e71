//! The io_uring engine: one ring per IOThread, readv/writev straight from guest
//! memory, completion signalled through an eventfd the IOThread waits on.
//!
//! The ring is set up with `IORING_SETUP_COOP_TASKRUN` and
//! `IORING_SETUP_TASKRUN_FLAG` where the kernel has them (5.19 on). A
//! device's completion interrupt hands the request back to the submitting
//! thread as task work; by default the kernel interrupts that thread with an
//! IPI to run it, which on a VM is a VM exit on each side whenever the
//! interrupt lands on another CPU than the IOThread. Cooperatively, a thread
//! that sleeps is still woken, and one that polls sees `IORING_SQ_TASKRUN`
//! in the ring and enters the kernel itself ([`UringEngine::has_completions`]).
//!
//! A request goes to the kernel at once, one `io_uring_enter` each, while
//! the kernel has fewer than [`SUBMIT_AT_ONCE_BELOW`] of the ring's
//! requests; beyond that, submissions are batched into one `io_uring_enter`
//! per pass (see [`submit_at_once`]).

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{opcode, types, IoUring};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{fallocate_mode, Completion, Engine, IoKind, IoOp};

/// While the kernel holds fewer of a ring's requests than this, a new one is
/// submitted at once instead of at the end of the pass.
///
/// A request that waits for the end of the pass waits for every pop after
/// it, and the device gets the pass's requests in one burst instead of as
/// they come. On this project's development VM (a virtio disk; each
/// submission a VM exit) the device serves requests that come one at a time
/// faster than bursts: natively, fio-style at QD16, 93-97K IOPS submitting
/// every request or 4 at a time, 86K in batches of 8, 74K in batches of 16.
/// Through an IOThread, 4k reads of a file at QD16, 4 A/B rounds of
/// `scripts/bench.py serve`: submitting every request at once did 1.17x
/// the IOPS of submitting only while fewer than 4 were in the kernel with a
/// polling client (p50 223 -> 158 us, the same CPU per request) and 1.04x
/// with a blocking one (p50 246 -> 185 us, 1.11x the CPU per request), and
/// under `--poll off` 1.08x (p50 244 -> 199 us) at 1.20x the CPU per
/// request: a system call per request is the price. Four queues at QD16
/// on one IOThread (64 in the kernel) did not lose. 64 is the deepest load
/// measured: beyond it, one enter per pass saves system calls while the
/// device is busy anyway.
pub const SUBMIT_AT_ONCE_BELOW: usize = 64;

/// Whether a new request goes to the kernel at once, `in_kernel` requests of
/// the ring being there already (submitted, completion not reaped).
pub fn submit_at_once(in_kernel: usize) -> bool {
    in_kernel < SUBMIT_AT_ONCE_BELOW
}

/// An io_uring owned by one IOThread.
pub struct UringEngine {
    ring: IoUring,
    efd: EventFd,
    /// Pushed to the submission queue, not yet submitted.
    queued: usize,
    /// Submitted to the kernel, completion not yet reaped.
    in_kernel: usize,
}

impl UringEngine {
    /// Creates a ring with `entries` submission slots, with cooperative task
    /// work where the kernel has it (see the module's documentation).
    pub fn new(entries: u32) -> io::Result<Self> {
        let ring = match IoUring::builder()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(entries)
        {
            Ok(ring) => ring,
            // Before 5.19: the kernel interrupts the thread to run task work.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
            Err(e) => return Err(e),
        };
        let efd = EventFd::new(EFD_NONBLOCK)?;
        ring.submitter().register_eventfd(efd.as_raw_fd())?;
        Ok(UringEngine {
            ring,
            efd,
            queued: 0,
            in_kernel: 0,
        })
    }
}

impl UringEngine {
    /// Queues `op` on the file `fd`; the completion carries `token`.
    ///
    /// # Safety
    /// As [`Engines::submit`](super::Engines::submit).
    pub unsafe fn submit(&mut self, fd: RawFd, op: &IoOp, token: u64) -> io::Result<()> {
        let fd = types::Fd(fd);
        let entry = match op.kind {
            IoKind::Read => opcode::Readv::new(fd, op.iov, op.iovcnt)
                .offset(op.offset)
                .build(),
            IoKind::Write => opcode::Writev::new(fd, op.iov, op.iovcnt)
                .offset(op.offset)
                .rw_flags(if op.dsync { libc::RWF_DSYNC } else { 0 })
                .build(),
            IoKind::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            IoKind::Discard | IoKind::WriteZeroes => opcode::Fallocate::new(fd, op.len)
                .offset(op.offset)
                .mode(fallocate_mode(op))
                .build(),
        }
        .user_data(token);
        loop {
            // SAFETY: the caller guarantees the iovecs and buffers the entry
            // points to stay valid until its completion is reaped.
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                self.queued += 1;
                // Pushed, the operation is the ring's: this commit or a
                // later one hands it to the kernel, and its completion comes
                // from `reap`. A commit that fails here is not its failure:
                // reported as one, the request would be answered and its
                // buffers given back to the guest while the entry, which a
                // later commit submits, still points to them. The next
                // commit tries again (`Executor::complete` logs its error).
                if submit_at_once(self.in_kernel) {
                    let _ = self.commit();
                }
                return Ok(());
            }
            // Submission queue full: hand what is there to the kernel first
            // (nothing of this operation is on the ring yet).
            self.commit()?;
        }
    }
}

impl Engine for UringEngine {
    fn commit(&mut self) -> io::Result<()> {
        while self.queued > 0 {
            match self.ring.submit() {
                Ok(n) => {
                    self.queued = self.queued.saturating_sub(n);
                    self.in_kernel += n;
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // The completion queue is full: the caller reaps and retries later.
                Err(e)
                    if e.raw_os_error() == Some(libc::EBUSY)
                        || e.raw_os_error() == Some(libc::EAGAIN) =>
                {
                    return Ok(())
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        for cqe in self.ring.completion() {
            self.in_kernel = self.in_kernel.saturating_sub(1);
            out.push(Completion {
                token: cqe.user_data(),
                result: cqe.result(),
            });
        }
    }

    fn has_completions(&mut self) -> bool {
        if !self.ring.completion().is_empty() {
            return true;
        }
        if self.ring.submission().taskrun() {
            // Completions wait as task work for this thread to enter the
            // kernel: entering runs them (an enter with nothing to submit
            // carries GETEVENTS while the flag is up).
            let _ = if self.queued > 0 {
                self.commit()
            } else {
                self.ring.submit().map(drop)
            };
        }
        !self.ring.completion().is_empty()
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.efd.as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_policy_submits_at_once_only_while_few_are_in_the_kernel() {
        assert!(submit_at_once(0));
        assert!(submit_at_once(SUBMIT_AT_ONCE_BELOW - 1));
        assert!(!submit_at_once(SUBMIT_AT_ONCE_BELOW));
        assert!(!submit_at_once(1000));
    }

    /// The first requests go to the kernel as they come; once
    /// `SUBMIT_AT_ONCE_BELOW` are there, the next wait for `commit` (the end
    /// of the pass); reaping brings the count back down.
    #[test]
    fn an_idle_ring_submits_at_once_and_a_busy_one_batches() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![7u8; 512 * (SUBMIT_AT_ONCE_BELOW + 2)])
            .unwrap();
        let mut e = UringEngine::new(2 * SUBMIT_AT_ONCE_BELOW as u32).unwrap();
        let mut bufs = vec![[0u8; 512]; SUBMIT_AT_ONCE_BELOW + 2];
        let iovs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        let read = |i: usize| IoOp {
            kind: IoKind::Read,
            iov: &iovs[i],
            iovcnt: 1,
            offset: 512 * i as u64,
            len: 512,
            dsync: false,
            punch: false,
        };
        for i in 0..SUBMIT_AT_ONCE_BELOW {
            // SAFETY: the buffers and iovecs outlive the reap below.
            unsafe { e.submit(f.as_raw_fd(), &read(i), i as u64).unwrap() };
            assert_eq!(e.queued, 0, "request {i} waited with {i} in the kernel");
            assert_eq!(e.in_kernel, i + 1);
        }
        for i in SUBMIT_AT_ONCE_BELOW..SUBMIT_AT_ONCE_BELOW + 2 {
            // SAFETY: as above.
            unsafe { e.submit(f.as_raw_fd(), &read(i), i as u64).unwrap() };
        }
        assert_eq!(e.queued, 2, "requests beyond the threshold wait for commit");
        e.commit().unwrap();
        assert_eq!((e.queued, e.in_kernel), (0, SUBMIT_AT_ONCE_BELOW + 2));
        let mut out = Vec::new();
        while out.len() < SUBMIT_AT_ONCE_BELOW + 2 {
            e.ring.submit_and_wait(1).unwrap();
            e.reap(&mut out);
        }
        assert_eq!(e.in_kernel, 0);
        assert!(out.iter().all(|c| c.result == 512), "{out:?}");
        assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 7)));
    }

    /// Once its entry is on the submission queue an operation is queued,
    /// even if the commit right after it fails. Here `io_uring_enter` fails
    /// because the ring's descriptor is made /dev/null's (its mappings
    /// stay).
    #[test]
    fn an_entry_on_the_ring_is_queued_whatever_the_commit_says() {
        let mut e = UringEngine::new(8).unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup2 of a descriptor this test owns onto the ring's, which
        // `e` owns and closes when dropped.
        assert!(unsafe { libc::dup2(null.as_raw_fd(), e.ring.as_raw_fd()) } >= 0);
        let flush = IoOp::flush();
        // SAFETY: a flush has no buffers.
        let submitted = unsafe { e.submit(null.as_raw_fd(), &flush, 1) };
        assert!(submitted.is_ok(), "{submitted:?}");
        assert_eq!((e.queued, e.in_kernel), (1, 0));
        assert!(e.commit().is_err(), "the ring cannot reach the kernel");
        assert_eq!(e.queued, 1, "still queued for the next commit");
    }

    /// A thread that polls the ring and makes no other system call still gets
    /// completions that the kernel left as task work: `has_completions` sees
    /// `IORING_SQ_TASKRUN` and enters the kernel to run them. Without that,
    /// an O_DIRECT read's completion waits for the next timer tick. The
    /// reads run from each CPU in turn: the one that takes the disk's
    /// interrupts runs the task work on the interrupt's way out.
    #[test]
    fn a_polling_thread_runs_the_completions_left_as_task_work() {
        // O_DIRECT needs a disk-backed file system (not tmpfs): the crate's own.
        let mut f = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        f.write_all(&[7u8; 1 << 16]).unwrap();
        f.sync_all().unwrap();
        // SAFETY: F_GETFL and F_SETFL on a file descriptor this test owns.
        let direct = unsafe {
            let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl | libc::O_DIRECT) == 0
        };
        if !direct {
            eprintln!("skipped: no O_DIRECT on {}", env!("CARGO_MANIFEST_DIR"));
            return;
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
        for cpu in 0..cpus {
            let f = &f;
            let flagged = std::thread::scope(|s| {
                s.spawn(move || {
                    crate::iothread::pin_to(&[cpu]);
                    poll_reads(f.as_raw_fd())
                })
                .join()
                .unwrap()
            });
            eprintln!("CPU {cpu}: {flagged} of 64 completions came as task work");
        }
    }

    /// 64 O_DIRECT reads of `fd`, one at a time, each waited for by polling
    /// the ring alone; returns how many came as task work.
    fn poll_reads(fd: RawFd) -> usize {
        let mut e = UringEngine::new(8).unwrap();
        let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
        // SAFETY: a non-zero size.
        let buf = unsafe { std::alloc::alloc(layout) };
        let iov = libc::iovec {
            iov_base: buf.cast(),
            iov_len: 4096,
        };
        let mut flagged = 0;
        for i in 0..64u64 {
            let op = IoOp {
                kind: IoKind::Read,
                iov: &iov,
                iovcnt: 1,
                offset: 4096 * (i % 16),
                len: 4096,
                dsync: false,
                punch: false,
            };
            // SAFETY: the buffer and iovec outlive the reap below.
            unsafe { e.submit(fd, &op, i).unwrap() };
            // Spin without a system call until the kernel has something for us.
            while e.ring.completion().is_empty() && !e.ring.submission().taskrun() {
                std::hint::spin_loop();
            }
            if e.ring.completion().is_empty() {
                flagged += 1;
                // The kernel raises the flag just before it queues the task
                // work: an enter in between runs nothing, and the next one
                // finds it (the event loop polls again likewise).
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
                while !e.has_completions() {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "read {i}: IORING_SQ_TASKRUN was up and the completion did not come"
                    );
                }
            }
            let mut out = Vec::new();
            while out.is_empty() {
                e.has_completions();
                e.reap(&mut out);
            }
            assert_eq!(out[0].result, 4096);
        }
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(buf, layout) };
        flagged
    }
}
