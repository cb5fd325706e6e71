//! Parsing a virtio-blk descriptor chain into a [`Request`] (virtio spec 1.2,
//! 5.2.6), and every validation that decides the status of a malformed one.
//!
//! The layout is not assumed (VIRTIO_F_ANY_LAYOUT is implied by VERSION_1): the
//! 16-byte header is the first 16 device-readable bytes, the status is the last
//! device-writable byte, and what lies between is data, whatever the descriptor
//! boundaries, exactly as QEMU's virtio-blk splits its iovecs.

use smallvec::SmallVec;
use virtio_queue::desc::split::Descriptor;
use vm_memory::GuestAddress;

use super::{req_type, SECTOR_SIZE};
use crate::fastpath::{HeadChain, SmallAccess};

/// A guest-physical buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical address.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// The guest buffers of a request, in order. Inline up to 4 (a 4 KiB read is
/// one data segment and a status byte): parsing a request allocates nothing,
/// an allocation being a cost of its own on every request.
pub type Segments = SmallVec<[Segment; 4]>;

/// What the request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operation {
    /// Read `data` from `sector`.
    Read {
        /// First sector.
        sector: u64,
        /// Guest buffers to fill.
        data: Segments,
    },
    /// Write `data` at `sector`.
    Write {
        /// First sector.
        sector: u64,
        /// Guest buffers to write.
        data: Segments,
    },
    /// Make previous writes durable.
    Flush,
    /// Copy the serial into `data`.
    GetId {
        /// Guest buffers for the serial.
        data: Segments,
    },
    /// Discard a range.
    Discard {
        /// First sector.
        sector: u64,
        /// Number of sectors.
        num_sectors: u32,
    },
    /// Write zeroes over a range.
    WriteZeroes {
        /// First sector.
        sector: u64,
        /// Number of sectors.
        num_sectors: u32,
        /// The driver allows deallocating the range.
        unmap: bool,
    },
}

/// The kind of a request, for counters and for what its used length reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReqKind {
    /// VIRTIO_BLK_T_IN.
    Read,
    /// VIRTIO_BLK_T_OUT.
    Write,
    /// VIRTIO_BLK_T_FLUSH.
    Flush,
    /// VIRTIO_BLK_T_GET_ID.
    GetId,
    /// VIRTIO_BLK_T_DISCARD.
    Discard,
    /// VIRTIO_BLK_T_WRITE_ZEROES.
    WriteZeroes,
}

impl ReqKind {
    /// Whether the device writes data into guest buffers (the bytes written
    /// count in the used length, virtio spec 1.2, 2.7.8).
    pub fn writes_guest(self) -> bool {
        matches!(self, ReqKind::Read | ReqKind::GetId)
    }
}

impl Operation {
    /// The kind of operation.
    pub fn kind(&self) -> ReqKind {
        match self {
            Operation::Read { .. } => ReqKind::Read,
            Operation::Write { .. } => ReqKind::Write,
            Operation::Flush => ReqKind::Flush,
            Operation::GetId { .. } => ReqKind::GetId,
            Operation::Discard { .. } => ReqKind::Discard,
            Operation::WriteZeroes { .. } => ReqKind::WriteZeroes,
        }
    }

    /// Bytes moved between guest memory and the disk.
    pub fn data_len(&self) -> u64 {
        match self {
            Operation::Read { data, .. } | Operation::Write { data, .. } => {
                data.iter().map(|s| s.len as u64).sum()
            }
            _ => 0,
        }
    }
}

/// A well-formed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Head descriptor index, for the used ring.
    pub head: u16,
    /// The operation.
    pub op: Operation,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a request was refused. `iothread::ExecuteError::status` maps each to
/// the status byte the spec requires.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// No device-writable byte for the status (cannot even report the error).
    #[error("no device-writable status byte")]
    NoStatus,
    /// A device-readable descriptor follows a device-writable one.
    #[error("device-readable descriptor after a device-writable one")]
    BadOrder,
    /// Fewer than 16 device-readable bytes: no header.
    #[error("request header missing or short ({0} readable bytes)")]
    ShortHeader(usize),
    /// Header or payload could not be read from guest memory.
    #[error("guest memory read failed at {0:#x}")]
    Memory(u64),
    /// Data buffers in the wrong direction for the request type.
    #[error("data direction wrong for request type {0}")]
    Direction(u32),
    /// Data length not a multiple of 512 (or zero).
    #[error("data length {0} is not a positive multiple of 512")]
    BadLength(u64),
    /// Access beyond the end of the disk.
    #[error("sectors {sector}+{sectors} beyond capacity {capacity}")]
    OutOfRange {
        /// First sector.
        sector: u64,
        /// Number of sectors.
        sectors: u64,
        /// Capacity in sectors.
        capacity: u64,
    },
    /// A descriptor whose buffer runs past the end of the address space.
    #[error("descriptor at {0:#x} wraps past the end of the address space")]
    AddressWrap(u64),
    /// More segments than `seg_max`.
    #[error("{0} data segments exceed seg_max {1}")]
    TooManySegments(usize, u32),
    /// A segment larger than `size_max`.
    #[error("segment of {0} bytes exceeds size_max {1}")]
    SegmentTooLarge(u32, u32),
    /// Write, discard or write-zeroes on a read-only export.
    #[error("write to a read-only export")]
    ReadOnly,
    /// Discard / write-zeroes payload malformed (range count or sector count).
    #[error("malformed discard/write-zeroes payload: {0}")]
    BadRange(&'static str),
    /// Discard with "unmap", or reserved flag bits set (the flags given).
    #[error("discard/write-zeroes flags {0:#x}: unmap or reserved bits set")]
    BadFlags(u32),
    /// Unknown request type.
    #[error("unsupported request type {0}")]
    Unsupported(u32),
}

/// A refused request: enough to complete it with an error status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Head descriptor index.
    pub head: u16,
    /// Where the status byte goes, if the chain has one.
    pub status: Option<GuestAddress>,
    /// Why it was refused.
    pub error: RequestError,
}

/// Device limits the parser enforces.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Most data segments.
    pub seg_max: u32,
    /// Largest data segment.
    pub size_max: u32,
    /// Largest discard.
    pub max_discard_sectors: u32,
    /// Largest write-zeroes.
    pub max_write_zeroes_sectors: u32,
    /// Refuse writes.
    pub read_only: bool,
}

const HEADER_LEN: usize = 16;
const RANGE_LEN: usize = 16;
const WRITE_ZEROES_FLAG_UNMAP: u32 = 1;

/// Copies up to `out.len()` bytes from the start of `segs` into `out`.
fn gather<M: SmallAccess + ?Sized>(
    mem: &M,
    segs: &[Segment],
    out: &mut [u8],
) -> Result<(), RequestError> {
    let mut done = 0;
    for s in segs {
        if done == out.len() {
            break;
        }
        let n = (s.len as usize).min(out.len() - done);
        mem.read_small(&mut out[done..done + n], s.addr)
            .map_err(|_| RequestError::Memory(s.addr.0))?;
        done += n;
    }
    Ok(())
}

/// Drops the first `n` bytes of a segment list.
fn skip_front(segs: &[Segment], mut n: u64) -> Segments {
    let mut out = Segments::new();
    for s in segs {
        if n >= s.len as u64 {
            n -= s.len as u64;
            continue;
        }
        out.push(Segment {
            addr: GuestAddress(s.addr.0 + n),
            len: s.len - n as u32,
        });
        n = 0;
    }
    out
}

/// Parses the chain of `head` in the descriptor table at `desc_table` of a
/// queue of `queue_size` entries: the IOThreads' parser, for a head just
/// popped from the avail ring as for one resubmitted after a restart. The
/// chain is walked by the fast path's [`HeadChain`].
pub fn parse_head<M: SmallAccess + ?Sized>(
    mem: &M,
    desc_table: GuestAddress,
    queue_size: u16,
    head: u16,
    limits: &Limits,
) -> Result<Request, Rejected> {
    let chain = HeadChain::new(mem, desc_table, queue_size, head);
    parse_descriptors(head, chain, mem, limits)
}

/// Parses the descriptors of the chain of `head`, however the chain was
/// walked; `mem` is the memory they point into. [`parse_head`] hands it
/// [`HeadChain`]'s walk; the tests also hand it the chain virtio-queue pops,
/// over vm-memory's own accessors: the oracle the fast path's walk and
/// accesses are compared with.
pub fn parse_descriptors<M: SmallAccess + ?Sized>(
    head: u16,
    descriptors: impl Iterator<Item = Descriptor>,
    mem: &M,
    limits: &Limits,
) -> Result<Request, Rejected> {
    let mut readable = Segments::new();
    let mut writable = Segments::new();
    // The last writable segment so far, held back from `writable`: the
    // chain's last one holds the status byte. The lengths are summed on the
    // way (each list access checks whether the list is inline).
    let mut last_writable: Option<Segment> = None;
    let (mut readable_len, mut in_len) = (0u64, 0u64);
    let mut bad_order = false;
    let mut wraps = None;
    for desc in descriptors {
        if desc.len() == 0 {
            continue;
        }
        // A buffer running to or past the end of the 64-bit address space
        // is no buffer: refused here, so every segment of a Request is a
        // range [addr, addr + len) that u64 can express.
        if desc.addr().0.checked_add(desc.len() as u64).is_none() {
            wraps.get_or_insert(desc.addr().0);
        }
        let seg = Segment {
            addr: desc.addr(),
            len: desc.len(),
        };
        if desc.is_write_only() {
            if let Some(before) = last_writable.replace(seg) {
                in_len += before.len as u64;
                writable.push(before);
            }
        } else {
            if last_writable.is_some() {
                bad_order = true;
            }
            readable_len += seg.len as u64;
            readable.push(seg);
        }
    }
    // The last writable byte; a descriptor whose end wraps past 2^64 has none
    // (its wrapped address would be some unrelated low guest address).
    let status = last_writable
        .and_then(|s| s.addr.0.checked_add(s.len as u64 - 1))
        .map(GuestAddress);
    let reject = |error| Rejected {
        head,
        status,
        error,
    };
    let Some(status_addr) = status else {
        return Err(reject(RequestError::NoStatus));
    };
    if bad_order {
        return Err(reject(RequestError::BadOrder));
    }
    if let Some(addr) = wraps {
        return Err(reject(RequestError::AddressWrap(addr)));
    }
    // The status byte is the last writable byte; the rest is data.
    if let Some(last) = last_writable.filter(|s| s.len > 1) {
        in_len += last.len as u64 - 1;
        writable.push(Segment {
            addr: last.addr,
            len: last.len - 1,
        });
    }
    if readable_len < HEADER_LEN as u64 {
        return Err(reject(RequestError::ShortHeader(readable_len as usize)));
    }
    // type (le32), reserved (le32), sector (le64). In the first segment (as
    // every driver lays it out) it is read as one object: two loads, not a
    // byte copy.
    let (rtype, sector) = match readable.first() {
        Some(s) if s.len as usize >= HEADER_LEN => {
            let [ty, sector] = mem
                .read_obj_small::<[u64; 2]>(s.addr)
                .map_err(|_| reject(RequestError::Memory(s.addr.0)))?;
            (u64::from_le(ty) as u32, u64::from_le(sector))
        }
        _ => {
            let mut hdr = [0u8; HEADER_LEN];
            gather(mem, &readable, &mut hdr).map_err(reject)?;
            (
                u32::from_le_bytes(hdr[0..4].try_into().unwrap()),
                u64::from_le_bytes(hdr[8..16].try_into().unwrap()),
            )
        }
    };
    // Only requests that carry data after the header need that list: a read
    // (the common request) does not pay for building it (an allocation).
    let out_data = || skip_front(&readable, HEADER_LEN as u64);
    let out_len = readable_len - HEADER_LEN as u64;

    let check_rw = |data: &[Segment], len: u64| -> Result<(), RequestError> {
        if len == 0 || !len.is_multiple_of(SECTOR_SIZE) {
            return Err(RequestError::BadLength(len));
        }
        if data.len() > limits.seg_max as usize {
            return Err(RequestError::TooManySegments(data.len(), limits.seg_max));
        }
        if let Some(s) = data.iter().find(|s| s.len > limits.size_max) {
            return Err(RequestError::SegmentTooLarge(s.len, limits.size_max));
        }
        check_range(sector, len / SECTOR_SIZE, limits)
    };

    let op = match rtype {
        req_type::IN => {
            if out_len != 0 {
                return Err(reject(RequestError::Direction(rtype)));
            }
            check_rw(&writable, in_len).map_err(reject)?;
            Operation::Read {
                sector,
                data: writable,
            }
        }
        req_type::OUT => {
            if in_len != 0 {
                return Err(reject(RequestError::Direction(rtype)));
            }
            if limits.read_only {
                return Err(reject(RequestError::ReadOnly));
            }
            let out_data = out_data();
            check_rw(&out_data, out_len).map_err(reject)?;
            Operation::Write {
                sector,
                data: out_data,
            }
        }
        req_type::FLUSH => Operation::Flush,
        req_type::GET_ID => {
            if in_len == 0 || out_len != 0 {
                return Err(reject(RequestError::Direction(rtype)));
            }
            Operation::GetId { data: writable }
        }
        req_type::DISCARD | req_type::WRITE_ZEROES => {
            if in_len != 0 {
                return Err(reject(RequestError::Direction(rtype)));
            }
            if limits.read_only {
                return Err(reject(RequestError::ReadOnly));
            }
            // We advertise max_discard_seg = max_write_zeroes_seg = 1.
            if out_len != RANGE_LEN as u64 {
                return Err(reject(RequestError::BadRange(
                    "exactly one 16-byte range expected",
                )));
            }
            let mut r = [0u8; RANGE_LEN];
            gather(mem, &out_data(), &mut r).map_err(reject)?;
            let sector = u64::from_le_bytes(r[0..8].try_into().unwrap());
            let num_sectors = u32::from_le_bytes(r[8..12].try_into().unwrap());
            let flags = u32::from_le_bytes(r[12..16].try_into().unwrap());
            let (max, allowed) = if rtype == req_type::DISCARD {
                (limits.max_discard_sectors, 0)
            } else {
                (limits.max_write_zeroes_sectors, WRITE_ZEROES_FLAG_UNMAP)
            };
            if flags & !allowed != 0 {
                return Err(reject(RequestError::BadFlags(flags)));
            }
            if num_sectors == 0 || num_sectors > max {
                return Err(reject(RequestError::BadRange(
                    "sector count is zero or above the maximum",
                )));
            }
            check_range(sector, num_sectors as u64, limits).map_err(reject)?;
            if rtype == req_type::DISCARD {
                Operation::Discard {
                    sector,
                    num_sectors,
                }
            } else {
                Operation::WriteZeroes {
                    sector,
                    num_sectors,
                    unmap: flags & WRITE_ZEROES_FLAG_UNMAP != 0,
                }
            }
        }
        other => return Err(reject(RequestError::Unsupported(other))),
    };
    Ok(Request {
        head,
        op,
        status: status_addr,
    })
}

fn check_range(sector: u64, sectors: u64, limits: &Limits) -> Result<(), RequestError> {
    match sector.checked_add(sectors) {
        Some(end) if end <= limits.capacity_sectors => Ok(()),
        _ => Err(RequestError::OutOfRange {
            sector,
            sectors,
            capacity: limits.capacity_sectors,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{DescriptorChain, Queue, QueueT};
    use vm_memory::Bytes;
    use vm_memory::GuestMemoryMmap;

    /// The oracle: the parser over the chain virtio-queue pops, whose
    /// descriptor reads and accessors are vm-memory's (a plain
    /// `GuestMemoryMmap` takes no fast path). Every test below compares it
    /// with [`parse_head`].
    fn parse(
        chain: DescriptorChain<&GuestMemoryMmap>,
        limits: &Limits,
    ) -> Result<Request, Rejected> {
        let head = chain.head_index();
        parse_descriptors(head, chain.clone(), chain.memory(), limits)
    }

    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x20_0000;
    const STATUS: u64 = 0x30_0000;

    fn limits() -> Limits {
        Limits {
            capacity_sectors: 2048,
            seg_max: 4,
            size_max: 64 * 1024,
            max_discard_sectors: 1024,
            max_write_zeroes_sectors: 1024,
            read_only: false,
        }
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    fn header(mem: &GuestMemoryMmap, rtype: u32, sector: u64) {
        mem.write_obj(rtype.to_le(), GuestAddress(HDR)).unwrap();
        mem.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
        mem.write_obj(sector.to_le(), GuestAddress(HDR + 8))
            .unwrap();
    }

    fn d(addr: u64, len: u32, write: bool) -> RawDescriptor {
        let flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, 0))
    }

    fn parse_descs(
        mem: &GuestMemoryMmap,
        descs: &[RawDescriptor],
        l: &Limits,
    ) -> Result<Request, Rejected> {
        let vq = MockSplitQueue::new(mem, 16);
        let chain = vq.build_desc_chain(descs).unwrap();
        let head = chain.head_index();
        let popped = parse(chain, l);
        // A resubmitted head (walked without popping) parses the same.
        let walked = parse_head(mem, vq.desc_table_addr(), 16, head, l);
        assert_eq!(popped, walked, "parse_head differs from parse");
        popped
    }

    /// Pops the chain at avail position 0 of `vq` and parses it both ways.
    fn parse_both(
        m: &GuestMemoryMmap,
        vq: &MockSplitQueue<GuestMemoryMmap>,
    ) -> Result<Request, Rejected> {
        let head = vq.avail().ring().ref_at(0).unwrap().load();
        let mut q: Queue = vq.create_queue().unwrap();
        let chain = q.pop_descriptor_chain(m).unwrap();
        let popped = parse(chain, &limits());
        let walked = parse_head(m, vq.desc_table_addr(), 16, head, &limits());
        assert_eq!(popped, walked, "parse_head differs from parse");
        popped
    }

    #[test]
    fn parse_head_walks_like_a_popped_chain() {
        let m = mem();
        header(&m, req_type::IN, 4);
        let raw = |addr, len, flags: u32, next| {
            RawDescriptor::from(SplitDescriptor::new(addr, len, flags as u16, next))
        };
        let next = VRING_DESC_F_NEXT;
        let cases: [&[RawDescriptor]; 4] = [
            // A loop: 0 -> 1 -> 0.
            &[
                raw(HDR, 16, next, 1),
                raw(DATA, 512, next | VRING_DESC_F_WRITE, 0),
            ],
            // Next index outside the queue.
            &[
                raw(HDR, 16, next, 1),
                raw(STATUS, 1, next | VRING_DESC_F_WRITE, 40),
            ],
            // Indirect table whose length is not a multiple of 16.
            &[raw(0x38_0000, 40, VRING_DESC_F_INDIRECT, 0)],
            // Indirect descriptor inside an indirect table.
            &[raw(0x38_0000, 16, VRING_DESC_F_INDIRECT, 0)],
        ];
        m.write_obj(
            raw(0x38_0000, 16, VRING_DESC_F_INDIRECT, 0),
            GuestAddress(0x38_0000),
        )
        .unwrap();
        for descs in cases {
            let vq = MockSplitQueue::new(&m, 16);
            for (i, d) in descs.iter().enumerate() {
                vq.desc_table().store(i as u16, *d).unwrap();
            }
            vq.avail().ring().ref_at(0).unwrap().store(u16::to_le(0));
            vq.avail().idx().store(u16::to_le(1));
            assert!(parse_both(&m, &vq).is_err());
        }
        // A head outside the queue: nothing to walk, no status byte.
        let vq = MockSplitQueue::new(&m, 16);
        let r = parse_head(&m, vq.desc_table_addr(), 16, 16, &limits()).unwrap_err();
        assert_eq!(
            (r.head, r.status, r.error),
            (16, None, RequestError::NoStatus)
        );
    }

    #[test]
    fn read_write_flush_getid() {
        let m = mem();
        header(&m, req_type::IN, 8);
        let r = parse_descs(
            &m,
            &[d(HDR, 16, false), d(DATA, 4096, true), d(STATUS, 1, true)],
            &limits(),
        )
        .unwrap();
        assert_eq!(
            r.op,
            Operation::Read {
                sector: 8,
                data: smallvec::smallvec![Segment {
                    addr: GuestAddress(DATA),
                    len: 4096
                }]
            }
        );
        assert_eq!(r.status, GuestAddress(STATUS));
        assert_eq!(r.op.data_len(), 4096);

        header(&m, req_type::OUT, 16);
        let r = parse_descs(
            &m,
            &[
                d(HDR, 16, false),
                d(DATA, 512, false),
                d(DATA + 512, 512, false),
                d(STATUS, 1, true),
            ],
            &limits(),
        )
        .unwrap();
        assert!(matches!(r.op, Operation::Write { sector: 16, ref data } if data.len() == 2));

        header(&m, req_type::FLUSH, 0);
        let r = parse_descs(&m, &[d(HDR, 16, false), d(STATUS, 1, true)], &limits()).unwrap();
        assert_eq!(r.op, Operation::Flush);

        header(&m, req_type::GET_ID, 0);
        let r = parse_descs(
            &m,
            &[d(HDR, 16, false), d(DATA, 20, true), d(STATUS, 1, true)],
            &limits(),
        )
        .unwrap();
        assert!(matches!(r.op, Operation::GetId { .. }));
    }

    #[test]
    fn any_layout_header_and_status_share_descriptors() {
        let m = mem();
        // Header and data in one readable descriptor; data and status in one writable one.
        header(&m, req_type::OUT, 0);
        let r = parse_descs(
            &m,
            &[d(HDR, 16 + 1024, false), d(STATUS, 1, true)],
            &limits(),
        )
        .unwrap();
        assert_eq!(
            r.op,
            Operation::Write {
                sector: 0,
                data: smallvec::smallvec![Segment {
                    addr: GuestAddress(HDR + 16),
                    len: 1024
                }]
            }
        );
        header(&m, req_type::IN, 0);
        let r = parse_descs(
            &m,
            &[d(HDR, 8, false), d(HDR + 8, 8, false), d(DATA, 513, true)],
            &limits(),
        )
        .unwrap();
        assert_eq!(
            r.op,
            Operation::Read {
                sector: 0,
                data: smallvec::smallvec![Segment {
                    addr: GuestAddress(DATA),
                    len: 512
                }]
            }
        );
        assert_eq!(r.status, GuestAddress(DATA + 512));
    }

    fn err(
        m: &GuestMemoryMmap,
        descs: &[RawDescriptor],
        l: &Limits,
    ) -> (RequestError, Option<GuestAddress>) {
        let r = parse_descs(m, descs, l).unwrap_err();
        (r.error, r.status)
    }

    #[test]
    fn malformed_chains() {
        let m = mem();
        let l = limits();
        header(&m, req_type::IN, 0);
        // Chain too short: only the header.
        assert_eq!(err(&m, &[d(HDR, 16, false)], &l).0, RequestError::NoStatus);
        // Status descriptor read-only.
        assert_eq!(
            err(
                &m,
                &[d(HDR, 16, false), d(DATA, 512, true), d(STATUS, 1, false)],
                &l
            )
            .0,
            RequestError::BadOrder
        );
        // Header short.
        let (e, s) = err(&m, &[d(HDR, 8, false), d(STATUS, 1, true)], &l);
        assert_eq!(
            (e.clone(), s),
            (RequestError::ShortHeader(8), Some(GuestAddress(STATUS)))
        );
        // Read with device-readable data: wrong direction.
        assert_eq!(
            err(
                &m,
                &[d(HDR, 16, false), d(DATA, 512, false), d(STATUS, 1, true)],
                &l
            )
            .0,
            RequestError::Direction(0)
        );
        // Read with no data.
        assert_eq!(
            err(&m, &[d(HDR, 16, false), d(STATUS, 1, true)], &l).0,
            RequestError::BadLength(0)
        );
        // Length not a multiple of 512.
        assert_eq!(
            err(
                &m,
                &[d(HDR, 16, false), d(DATA, 1000, true), d(STATUS, 1, true)],
                &l
            )
            .0,
            RequestError::BadLength(1000)
        );
        // Beyond capacity.
        header(&m, req_type::IN, 2047);
        assert!(matches!(
            err(
                &m,
                &[d(HDR, 16, false), d(DATA, 1024, true), d(STATUS, 1, true)],
                &l
            )
            .0,
            RequestError::OutOfRange {
                sector: 2047,
                sectors: 2,
                capacity: 2048
            }
        ));
        header(&m, req_type::IN, u64::MAX);
        assert!(matches!(
            err(
                &m,
                &[d(HDR, 16, false), d(DATA, 512, true), d(STATUS, 1, true)],
                &l
            )
            .0,
            RequestError::OutOfRange { .. }
        ));
        // seg_max and size_max.
        header(&m, req_type::IN, 0);
        let many: Vec<_> = std::iter::once(d(HDR, 16, false))
            .chain((0..5).map(|i| d(DATA + i * 512, 512, true)))
            .chain(std::iter::once(d(STATUS, 1, true)))
            .collect();
        assert_eq!(err(&m, &many, &l).0, RequestError::TooManySegments(5, 4));
        assert_eq!(
            err(
                &m,
                &[
                    d(HDR, 16, false),
                    d(DATA, 128 * 1024, true),
                    d(STATUS, 1, true)
                ],
                &l
            )
            .0,
            RequestError::SegmentTooLarge(128 * 1024, 64 * 1024)
        );
        // Write with device-writable data.
        header(&m, req_type::OUT, 0);
        assert_eq!(
            err(
                &m,
                &[d(HDR, 16, false), d(DATA, 512, true), d(STATUS, 1, true)],
                &l
            )
            .0,
            RequestError::Direction(1)
        );
        // Unknown type.
        header(&m, 99, 0);
        let e = err(&m, &[d(HDR, 16, false), d(STATUS, 1, true)], &l).0;
        assert_eq!(e, RequestError::Unsupported(99));
    }

    /// A status descriptor whose address + length wraps past 2^64 has no
    /// valid last byte: the request cannot be answered, and the wrapped
    /// address (a low guest address) must never be written.
    #[test]
    fn status_descriptor_wrapping_the_address_space_is_rejected() {
        let m = mem();
        header(&m, req_type::IN, 0);
        let r = parse_descs(
            &m,
            &[
                d(HDR, 16, false),
                d(DATA, 512, true),
                d(u64::MAX - 2, 8, true),
            ],
            &limits(),
        );
        let r = r.expect_err("a wrapping status descriptor is refused");
        assert_eq!((r.error, r.status), (RequestError::NoStatus, None));
    }

    #[test]
    fn read_only_refuses_writes_but_not_reads() {
        let m = mem();
        let l = Limits {
            read_only: true,
            ..limits()
        };
        for t in [req_type::OUT, req_type::DISCARD, req_type::WRITE_ZEROES] {
            header(&m, t, 0);
            let data = if t == req_type::OUT { 512 } else { 16 };
            assert_eq!(
                err(
                    &m,
                    &[d(HDR, 16, false), d(DATA, data, false), d(STATUS, 1, true)],
                    &l
                )
                .0,
                RequestError::ReadOnly
            );
        }
        header(&m, req_type::IN, 0);
        assert!(parse_descs(
            &m,
            &[d(HDR, 16, false), d(DATA, 512, true), d(STATUS, 1, true)],
            &l
        )
        .is_ok());
    }

    fn range(m: &GuestMemoryMmap, sector: u64, n: u32, flags: u32) {
        m.write_obj(sector.to_le(), GuestAddress(DATA)).unwrap();
        m.write_obj(n.to_le(), GuestAddress(DATA + 8)).unwrap();
        m.write_obj(flags.to_le(), GuestAddress(DATA + 12)).unwrap();
    }

    #[test]
    fn discard_and_write_zeroes() {
        let m = mem();
        let l = limits();
        let descs = [d(HDR, 16, false), d(DATA, 16, false), d(STATUS, 1, true)];
        header(&m, req_type::DISCARD, 0);
        range(&m, 8, 16, 0);
        assert_eq!(
            parse_descs(&m, &descs, &l).unwrap().op,
            Operation::Discard {
                sector: 8,
                num_sectors: 16
            }
        );
        range(&m, 8, 16, 1);
        let e = err(&m, &descs, &l).0;
        assert_eq!(e, RequestError::BadFlags(1), "unmap flag on discard");
        range(&m, 2040, 16, 0);
        assert!(matches!(
            err(&m, &descs, &l).0,
            RequestError::OutOfRange { .. }
        ));
        range(&m, 0, 0, 0);
        assert!(matches!(err(&m, &descs, &l).0, RequestError::BadRange(_)));
        header(&m, req_type::WRITE_ZEROES, 0);
        range(&m, 0, 8, 1);
        assert_eq!(
            parse_descs(&m, &descs, &l).unwrap().op,
            Operation::WriteZeroes {
                sector: 0,
                num_sectors: 8,
                unmap: true
            }
        );
        range(&m, 0, 8, 2);
        assert_eq!(
            err(&m, &descs, &l).0,
            RequestError::BadFlags(2),
            "reserved flag"
        );
        // Two ranges: we advertise max_*_seg = 1.
        assert!(matches!(
            err(
                &m,
                &[d(HDR, 16, false), d(DATA, 32, false), d(STATUS, 1, true)],
                &l
            )
            .0,
            RequestError::BadRange(_)
        ));
    }

    #[test]
    fn header_outside_guest_memory() {
        let m = mem();
        let e = err(
            &m,
            &[d(0x100_0000, 16, false), d(STATUS, 1, true)],
            &limits(),
        )
        .0;
        assert_eq!(e, RequestError::Memory(0x100_0000));
    }

    #[test]
    fn indirect_descriptors() {
        let m = mem();
        header(&m, req_type::IN, 4);
        let table = GuestAddress(0x38_0000);
        let entries = [
            SplitDescriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1),
            SplitDescriptor::new(
                DATA,
                2048,
                (VRING_DESC_F_WRITE | VRING_DESC_F_NEXT) as u16,
                2,
            ),
            SplitDescriptor::new(STATUS, 1, VRING_DESC_F_WRITE as u16, 0),
        ];
        for (i, e) in entries.iter().enumerate() {
            m.write_obj(
                RawDescriptor::from(*e),
                GuestAddress(table.0 + 16 * i as u64),
            )
            .unwrap();
        }
        let vq = MockSplitQueue::new(&m, 16);
        let head = RawDescriptor::from(SplitDescriptor::new(
            table.0,
            48,
            VRING_DESC_F_INDIRECT as u16,
            0,
        ));
        vq.add_desc_chains(&[head], 0).unwrap();
        let r = parse_both(&m, &vq).unwrap();
        assert_eq!(
            r.op,
            Operation::Read {
                sector: 4,
                data: smallvec::smallvec![Segment {
                    addr: GuestAddress(DATA),
                    len: 2048
                }]
            }
        );
        assert_eq!(r.status, GuestAddress(STATUS));
    }

    /// Found by the parser fuzz harness: a device-writable data descriptor
    /// ending exactly at 2^64 (GET_ID) was accepted, a segment whose end u64
    /// cannot express. Refused now, like any buffer running past the end.
    #[test]
    fn a_data_descriptor_running_to_the_end_of_the_address_space_is_refused() {
        let m = mem();
        header(&m, req_type::GET_ID, 0);
        for (addr, len) in [(u64::MAX, 1), (u64::MAX - 15, 16), (u64::MAX - 7, 512)] {
            let (e, status) = err(
                &m,
                &[d(HDR, 16, false), d(addr, len, true), d(STATUS, 1, true)],
                &limits(),
            );
            assert_eq!(e, RequestError::AddressWrap(addr), "{addr:#x}+{len}");
            assert_eq!(status, Some(GuestAddress(STATUS)));
        }
    }
}
