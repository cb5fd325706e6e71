//! Why a request did not complete with status OK.

use std::io;

use crate::block::{Backend, IoError};
use crate::stats::ErrorKind;
use crate::virtio::request::RequestError;
use crate::virtio::status;

/// Why a request failed, from parsing to the backend's completion.
/// [`ExecuteError::status`] is the one place a virtio status byte is chosen.
#[derive(Debug, thiserror::Error)]
pub enum ExecuteError {
    /// The device model refused the request.
    #[error("malformed request: {0}")]
    Request(#[from] RequestError),
    /// A data buffer is not (or no longer) in guest memory.
    #[error("data buffer outside guest memory")]
    GuestMemory,
    /// The GET_ID answer could not be written to guest memory.
    #[error("cannot write the serial to guest memory: {0}")]
    GetId(#[source] vm_memory::GuestMemoryError),
    /// No aligned bounce buffer could be allocated.
    #[error("cannot allocate a bounce buffer of {0} bytes")]
    BounceAlloc(u64),
    /// The request alone needs more bounce-buffer memory than the IOThread's
    /// cap (`bounce-buffer-max`).
    #[error("needs a {len}-byte bounce buffer, more than bounce-buffer-max ({max})")]
    BounceLimit {
        /// The request's length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// Copying between guest memory and a bounce buffer failed.
    #[error("bounce buffer copy failed: {0}")]
    BounceCopy(#[source] vm_memory::GuestMemoryError),
    /// The backend refused the operation.
    #[error("cannot submit to the {backend:?} backend: {source}")]
    Submit {
        /// The backend.
        backend: Backend,
        /// Its error.
        #[source]
        source: io::Error,
    },
    /// The operation failed (after the backend's own recovery).
    #[error(transparent)]
    Io(#[from] IoError),
}

impl ExecuteError {
    /// The status byte for this error (virtio spec 1.2, 5.2.6.1-2).
    pub fn status(&self) -> u8 {
        match self {
            // Unknown types, and "unmap" on DISCARD or reserved flags: the
            // device MUST set UNSUPP.
            ExecuteError::Request(RequestError::Unsupported(_) | RequestError::BadFlags(_)) => {
                status::UNSUPP
            }
            _ => status::IOERR,
        }
    }

    /// The kind it is counted as (`vqblk_request_errors_total{kind}`).
    pub fn kind(&self) -> ErrorKind {
        match self {
            ExecuteError::Request(_) if self.status() == status::UNSUPP => ErrorKind::Unsupported,
            ExecuteError::Request(_) => ErrorKind::Malformed,
            ExecuteError::GuestMemory | ExecuteError::GetId(_) => ErrorKind::GuestMemory,
            ExecuteError::BounceAlloc(_)
            | ExecuteError::BounceLimit { .. }
            | ExecuteError::BounceCopy(_) => ErrorKind::BounceBuffer,
            ExecuteError::Submit { .. } => ErrorKind::Submit,
            ExecuteError::Io(_) => ErrorKind::Io,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::IoKind;

    #[test]
    fn only_unsupported_types_and_flags_are_unsupp() {
        let unsupp = [
            ExecuteError::from(RequestError::Unsupported(99)),
            ExecuteError::from(RequestError::BadFlags(2)),
        ];
        for e in &unsupp {
            assert_eq!(e.status(), status::UNSUPP, "{e}");
        }
        let ioerr = [
            ExecuteError::from(RequestError::NoStatus),
            ExecuteError::from(RequestError::ShortHeader(8)),
            ExecuteError::from(RequestError::ReadOnly),
            ExecuteError::from(RequestError::BadRange("sector count is zero")),
            ExecuteError::GuestMemory,
            ExecuteError::BounceAlloc(1),
            ExecuteError::Submit {
                backend: Backend::IoUring { fd: 0 },
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            },
            ExecuteError::from(IoError::ShortTransfer {
                kind: IoKind::Read,
                offset: 0,
                done: 0,
                len: 512,
            }),
        ];
        for e in &ioerr {
            assert_eq!(e.status(), status::IOERR, "{e}");
        }
        for e in &unsupp {
            assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        }
        let kinds: Vec<ErrorKind> = ioerr.iter().map(ExecuteError::kind).collect();
        use ErrorKind::*;
        assert_eq!(
            kinds,
            [
                Malformed,
                Malformed,
                Malformed,
                Malformed,
                GuestMemory,
                BounceBuffer,
                Submit,
                Io
            ]
        );
    }
}
