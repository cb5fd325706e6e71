//! One operation in flight with its recovery state, and the backends' recovery
//! policy: what a completion result means for the operation (done, failed, or
//! to be submitted again). The policy is a pure function of the result; the
//! caller only resubmits when told to.

use std::io;

use super::{IoKind, IoOp};

/// Resubmissions of an operation that failed with EAGAIN or EINTR.
pub const MAX_RETRIES: u8 = 8;

/// Why an operation failed for good.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The system call failed (after retrying transient errors).
    #[error("{kind:?} at offset {offset} failed: {source}")]
    Os {
        /// The operation.
        kind: IoKind,
        /// Its byte offset (where the failing part started).
        offset: u64,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A read or write hit the end of the file before its length (the image
    /// shrank under us).
    #[error("{kind:?} at offset {offset} ended after {done} of {len} bytes")]
    ShortTransfer {
        /// The operation.
        kind: IoKind,
        /// Byte offset of the part that came up short.
        offset: u64,
        /// Bytes of that part that were transferred.
        done: u64,
        /// Length of that part.
        len: u64,
    },
}

/// What to do after a completion.
#[derive(Debug)]
pub enum Next {
    /// Submit the (updated) operation again.
    Resubmit,
    /// Finished: the bytes transferred for the whole operation, or the error.
    Done(Result<u64, IoError>),
}

/// An operation and the state its recovery needs. The iovecs live on the heap
/// (their address does not change when the `Transfer` moves), so [`Transfer::op`]
/// stays valid for as long as the `Transfer` is alive and not mutated.
#[derive(Debug)]
pub struct Transfer {
    op: IoOp,
    iov: Vec<libc::iovec>,
    /// Length of the whole operation, bytes (`op.len` shrinks when a short
    /// transfer is continued).
    len: u64,
    /// Bytes transferred of the current part.
    done: u64,
    /// Resubmissions after a transient error.
    retries: u8,
}

impl Transfer {
    /// A transfer of `kind` over `len` bytes at `offset`, reading or writing the
    /// buffers `iov` describes (Read/Write; empty otherwise).
    pub fn new(kind: IoKind, offset: u64, len: u64, iov: Vec<libc::iovec>) -> Transfer {
        let op = IoOp {
            kind,
            offset,
            len,
            iov: iov.as_ptr(),
            iovcnt: iov.len() as u32,
            dsync: false,
            punch: false,
        };
        Transfer {
            op,
            iov,
            len,
            done: 0,
            retries: 0,
        }
    }

    /// The iovec list, emptied, for the next transfer to reuse (its
    /// allocation stays; this transfer is left with none): the owner must no
    /// longer be in flight.
    pub fn take_iov(&mut self) -> Vec<libc::iovec> {
        let mut iov = std::mem::take(&mut self.iov);
        iov.clear();
        iov
    }

    /// Submit writes with RWF_DSYNC.
    pub fn dsync(mut self, on: bool) -> Self {
        self.op.dsync = on;
        self
    }

    /// Write zeroes by punching a hole.
    pub fn punch(mut self, on: bool) -> Self {
        self.op.punch = on;
        self
    }

    /// The operation to submit (what is left of it).
    pub fn op(&self) -> &IoOp {
        &self.op
    }

    /// The kind of operation.
    pub fn kind(&self) -> IoKind {
        self.op.kind
    }

    /// Length of the whole operation, bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the operation moves no data.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The recovery policy: what completion `result` (bytes or -errno) means.
    /// On [`Next::Resubmit`] the operation has been updated for the next try.
    ///
    /// Once per request on the IOThread's completion path: left to itself,
    /// LLVM inlined it in some builds and called it in others (32
    /// instructions per 4k read at QD16 when called), so it is inlined.
    #[inline(always)]
    pub fn on_completion(&mut self, result: i32) -> Next {
        let kind = self.op.kind;
        if result < 0 {
            let errno = -result;
            return match kind {
                // Transient: the kernel may hand these back under memory or
                // queue pressure. Try again a few times before failing.
                _ if (errno == libc::EAGAIN || errno == libc::EINTR)
                    && self.retries < MAX_RETRIES =>
                {
                    self.retries += 1;
                    Next::Resubmit
                }
                // Discard is advisory: a file system without hole punching ignores it.
                IoKind::Discard if errno == libc::EOPNOTSUPP => Next::Done(Ok(0)),
                // No ZERO_RANGE (tmpfs): punch a hole instead, it reads back as zeroes.
                IoKind::WriteZeroes if errno == libc::EOPNOTSUPP && !self.op.punch => {
                    self.op.punch = true;
                    Next::Resubmit
                }
                _ => Next::Done(Err(IoError::Os {
                    kind,
                    offset: self.op.offset,
                    source: io::Error::from_raw_os_error(errno),
                })),
            };
        }
        if !matches!(kind, IoKind::Read | IoKind::Write) {
            return Next::Done(Ok(0));
        }
        let n = result as u64;
        self.done += n;
        if self.done >= self.op.len {
            return Next::Done(Ok(self.len));
        }
        if n == 0 {
            // End of file: the image shrank under us.
            return Next::Done(Err(IoError::ShortTransfer {
                kind,
                offset: self.op.offset,
                done: self.done,
                len: self.op.len,
            }));
        }
        // Short transfer: continue with the rest.
        advance(&mut self.iov, n as usize);
        self.op.iov = self.iov.as_ptr();
        self.op.iovcnt = self.iov.len() as u32;
        self.op.offset += n;
        self.op.len -= self.done;
        self.done = 0;
        Next::Resubmit
    }
}

/// Drops the first `n` bytes from an iovec list.
fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
    let mut skip = 0;
    for v in iov.iter_mut() {
        if n >= v.iov_len {
            n -= v.iov_len;
            skip += 1;
        } else {
            // SAFETY: n < iov_len, so the new base stays inside the same buffer.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
            v.iov_len -= n;
            break;
        }
    }
    iov.drain(..skip);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(buf: &mut [u8], parts: &[usize]) -> Vec<libc::iovec> {
        let mut off = 0;
        parts
            .iter()
            .map(|&l| {
                let v = libc::iovec {
                    iov_base: buf[off..].as_mut_ptr().cast(),
                    iov_len: l,
                };
                off += l;
                v
            })
            .collect()
    }

    #[test]
    fn advance_drops_prefix() {
        let mut a = [0u8; 16];
        let base = a.as_mut_ptr();
        let mut v = iov(&mut a, &[4, 12]);
        advance(&mut v, 6);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].iov_base as usize, base as usize + 6);
        assert_eq!(v[0].iov_len, 10);
    }

    #[test]
    fn short_transfer_continues_with_the_rest_then_completes_whole() {
        let mut a = [0u8; 4096];
        let base = a.as_mut_ptr() as usize;
        let mut t = Transfer::new(IoKind::Read, 8192, 4096, iov(&mut a, &[1024, 3072]));
        assert!(matches!(t.on_completion(1536), Next::Resubmit));
        assert_eq!(
            (t.op().offset, t.op().len, t.op().iovcnt),
            (8192 + 1536, 2560, 1)
        );
        // SAFETY: iovcnt is 1 and the list is alive.
        let v = unsafe { *t.op().iov };
        assert_eq!((v.iov_base as usize, v.iov_len), (base + 1536, 2560));
        assert!(matches!(t.on_completion(2560), Next::Done(Ok(4096))));
    }

    #[test]
    fn end_of_file_is_a_short_transfer_error() {
        let mut a = [0u8; 1024];
        let mut t = Transfer::new(IoKind::Read, 0, 1024, iov(&mut a, &[1024]));
        assert!(matches!(t.on_completion(512), Next::Resubmit));
        match t.on_completion(0) {
            Next::Done(Err(IoError::ShortTransfer {
                offset: 512,
                done: 0,
                len: 512,
                ..
            })) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn transient_errors_are_retried_a_bounded_number_of_times() {
        let mut t = Transfer::new(IoKind::Flush, 0, 0, Vec::new());
        for _ in 0..MAX_RETRIES {
            assert!(matches!(t.on_completion(-libc::EAGAIN), Next::Resubmit));
        }
        match t.on_completion(-libc::EINTR) {
            Next::Done(Err(IoError::Os { source, .. })) => {
                assert_eq!(source.raw_os_error(), Some(libc::EINTR))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn write_zeroes_falls_back_to_punching_and_discard_is_advisory() {
        let mut z = Transfer::new(IoKind::WriteZeroes, 0, 4096, Vec::new());
        assert!(!z.op().punch);
        assert!(matches!(z.on_completion(-libc::EOPNOTSUPP), Next::Resubmit));
        assert!(z.op().punch);
        // Punching unsupported too: a real error.
        assert!(matches!(
            z.on_completion(-libc::EOPNOTSUPP),
            Next::Done(Err(IoError::Os { .. }))
        ));
        let mut d = Transfer::new(IoKind::Discard, 0, 4096, Vec::new());
        assert!(matches!(
            d.on_completion(-libc::EOPNOTSUPP),
            Next::Done(Ok(0))
        ));
        let mut d = Transfer::new(IoKind::Discard, 0, 4096, Vec::new());
        assert!(matches!(
            d.on_completion(-libc::EIO),
            Next::Done(Err(IoError::Os { .. }))
        ));
    }
}
