//! The io_uring engine: one ring per IOThread, readv/writev straight from guest
//! memory, completion signalled through an eventfd the IOThread waits on.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{opcode, types, IoUring};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{fallocate_mode, Completion, Engine, IoKind, IoOp};

/// An io_uring owned by one IOThread.
pub struct UringEngine {
    ring: IoUring,
    efd: EventFd,
    queued: usize,
}

impl UringEngine {
    /// Creates a ring with `entries` submission slots.
    pub fn new(entries: u32) -> io::Result<Self> {
        let ring = IoUring::new(entries)?;
        let efd = EventFd::new(EFD_NONBLOCK)?;
        ring.submitter().register_eventfd(efd.as_raw_fd())?;
        Ok(UringEngine {
            ring,
            efd,
            queued: 0,
        })
    }
}

impl Engine for UringEngine {
    unsafe fn submit(&mut self, fd: RawFd, op: &IoOp, token: u64) -> io::Result<()> {
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
                return Ok(());
            }
            // Submission queue full: hand what we have to the kernel first.
            self.commit()?;
        }
    }

    fn commit(&mut self) -> io::Result<()> {
        while self.queued > 0 {
            match self.ring.submit() {
                Ok(n) => self.queued = self.queued.saturating_sub(n),
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
            out.push(Completion {
                token: cqe.user_data(),
                result: cqe.result(),
            });
        }
    }

    fn has_completions(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.efd.as_raw_fd())
    }
}
