//! The null engine: every operation completes at once; reads return zeroes.

use std::io;
use std::os::fd::RawFd;

use super::{Completion, Engine, IoKind, IoOp};

/// Completes operations synchronously, in the submitting IOThread.
#[derive(Default)]
pub struct NullEngine {
    done: Vec<Completion>,
}

impl Engine for NullEngine {
    unsafe fn submit(&mut self, _fd: RawFd, op: &IoOp, token: u64) -> io::Result<()> {
        if op.kind == IoKind::Read {
            for i in 0..op.iovcnt as usize {
                // SAFETY: the caller guarantees `op.iov` holds `iovcnt` valid
                // iovecs describing writable buffers.
                unsafe {
                    let v = &*op.iov.add(i);
                    std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len);
                }
            }
        }
        let result = match op.kind {
            IoKind::Read | IoKind::Write => op.len.min(i32::MAX as u64) as i32,
            _ => 0,
        };
        self.done.push(Completion { token, result });
        Ok(())
    }

    fn commit(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.done);
    }

    fn has_completions(&mut self) -> bool {
        !self.done.is_empty()
    }

    fn notify_fd(&self) -> Option<RawFd> {
        None
    }
}
