//! What the virtio-blk device does with a well-formed request: the block
//! operation it becomes (sectors to bytes, request kind to I/O kind), or an
//! answer the device model gives itself (GET_ID; a flush of a read-only export).

use vm_memory::{Bytes, GuestMemory};

use super::request::{Operation, Segments};
use super::{ID_BYTES, SECTOR_SIZE};
use crate::block::IoKind;

/// A block operation for a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockIo {
    /// What to do.
    pub kind: IoKind,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// Guest buffers (Read/Write only).
    pub data: Segments,
    /// Write zeroes by punching a hole (the driver allowed unmapping).
    pub punch: bool,
}

/// What the device does for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Run a block operation.
    Io(BlockIo),
    /// Answered by the device model: this many bytes of data were written to
    /// the guest's buffers.
    Answered(u32),
}

/// The device's action for `op` on an export with the given GET_ID `serial`.
/// GET_ID is answered here (the serial written into the guest's buffers, at
/// most 20 bytes, virtio spec 1.2, 5.2.6); a flush of a read-only export has
/// nothing to make durable.
#[inline]
pub fn action<M: GuestMemory + ?Sized>(
    op: Operation,
    mem: &M,
    serial: &[u8; ID_BYTES],
    read_only: bool,
) -> Result<Action, vm_memory::GuestMemoryError> {
    let io = |kind, sector: u64, len, data| {
        Action::Io(BlockIo {
            kind,
            offset: sector * SECTOR_SIZE,
            len,
            data,
            punch: false,
        })
    };
    let data_len = op.data_len();
    Ok(match op {
        Operation::GetId { data } => {
            let mut written = 0usize;
            for s in &data {
                let n = (s.len as usize).min(ID_BYTES - written);
                if n == 0 {
                    break;
                }
                mem.write_slice(&serial[written..written + n], s.addr)?;
                written += n;
            }
            Action::Answered(written as u32)
        }
        Operation::Flush if read_only => Action::Answered(0),
        Operation::Flush => io(IoKind::Flush, 0, 0, Segments::new()),
        Operation::Read { sector, data } => io(IoKind::Read, sector, data_len, data),
        Operation::Write { sector, data } => io(IoKind::Write, sector, data_len, data),
        Operation::Discard {
            sector,
            num_sectors,
        } => io(
            IoKind::Discard,
            sector,
            num_sectors as u64 * SECTOR_SIZE,
            Segments::new(),
        ),
        Operation::WriteZeroes {
            sector,
            num_sectors,
            unmap,
        } => Action::Io(BlockIo {
            kind: IoKind::WriteZeroes,
            offset: sector * SECTOR_SIZE,
            len: num_sectors as u64 * SECTOR_SIZE,
            data: Segments::new(),
            // Punching a hole is the cheapest way to zero when unmapping is allowed.
            punch: unmap,
        }),
    })
}

/// The GET_ID answer for `serial`: its first 20 bytes, NUL-padded.
pub fn serial_bytes(serial: &str) -> [u8; ID_BYTES] {
    let mut out = [0u8; ID_BYTES];
    let n = serial.len().min(ID_BYTES);
    out[..n].copy_from_slice(&serial.as_bytes()[..n]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::request::Segment;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    fn seg(addr: u64, len: u32) -> Segment {
        Segment {
            addr: GuestAddress(addr),
            len,
        }
    }

    #[test]
    fn sectors_become_bytes() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        let s = serial_bytes("x");
        let read = Operation::Read {
            sector: 3,
            data: smallvec::smallvec![seg(0, 512), seg(512, 1024)],
        };
        assert_eq!(
            action(read, &m, &s, false).unwrap(),
            Action::Io(BlockIo {
                kind: IoKind::Read,
                offset: 1536,
                len: 1536,
                data: smallvec::smallvec![seg(0, 512), seg(512, 1024)],
                punch: false
            })
        );
        let wz = Operation::WriteZeroes {
            sector: 1,
            num_sectors: 2,
            unmap: true,
        };
        match action(wz, &m, &s, false).unwrap() {
            Action::Io(io) => assert_eq!(
                (io.kind, io.offset, io.len, io.punch),
                (IoKind::WriteZeroes, 512, 1024, true)
            ),
            a => panic!("{a:?}"),
        }
        assert_eq!(
            action(Operation::Flush, &m, &s, true).unwrap(),
            Action::Answered(0)
        );
        assert!(matches!(
            action(Operation::Flush, &m, &s, false).unwrap(),
            Action::Io(BlockIo {
                kind: IoKind::Flush,
                ..
            })
        ));
    }

    #[test]
    fn get_id_writes_at_most_20_bytes_across_segments() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        let s = serial_bytes("abcdefghijklmnopqrstuvwxyz");
        assert_eq!(&s, b"abcdefghijklmnopqrst");
        let op = Operation::GetId {
            data: smallvec::smallvec![seg(0x100, 8), seg(0x200, 64)],
        };
        assert_eq!(action(op, &m, &s, false).unwrap(), Action::Answered(20));
        let mut a = [0u8; 8];
        m.read_slice(&mut a, GuestAddress(0x100)).unwrap();
        assert_eq!(&a, b"abcdefgh");
        let mut b = [0u8; 13];
        m.read_slice(&mut b, GuestAddress(0x200)).unwrap();
        assert_eq!(&b, b"ijklmnopqrst\0");
        let outside = Operation::GetId {
            data: smallvec::smallvec![seg(0x2000, 20)],
        };
        assert!(action(outside, &m, &s, false).is_err());
        assert_eq!(&serial_bytes("ab")[..3], b"ab\0");
    }
}
