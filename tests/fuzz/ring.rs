//! Structured pieces of a split virtqueue for the ring harnesses: guest
//! addresses biased towards the interesting places (inside a region, at its
//! edges, in the holes, near 2^64), descriptors, indirect tables and request
//! payloads, all decoded from random bytes with `arbitrary`; and an
//! independent walk of a descriptor chain that collects every descriptor the
//! device could treat as part of it.

use arbitrary::Arbitrary;

use super::guarded::{Guarded, Snapshot};

/// Descriptor flags (virtio 1.2, 2.7.5).
pub const NEXT: u16 = 1;
/// Device-writable.
pub const WRITE: u16 = 2;
/// Points at an indirect table.
pub const INDIRECT: u16 = 4;

/// Queue size from a selector: 16 for 0 (the input ran out), else 2^(n % 9).
pub fn queue_size(n: u8) -> u16 {
    [16, 1, 2, 4, 8, 32, 64, 128, 256][n as usize % 9]
}

/// A guest address.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Addr {
    /// Inside region `region % n`, at `offset % size`.
    In {
        /// Region selector.
        region: u8,
        /// Offset selector.
        offset: u32,
    },
    /// `back` bytes before the end of a region (straddling it if the length
    /// is larger), or `back` bytes before its start (in the hole).
    Edge {
        /// Region selector.
        region: u8,
        /// Distance from the edge.
        back: u8,
        /// The start edge instead of the end.
        start: bool,
    },
    /// Just below 2^64.
    Top(u16),
    /// Anything.
    Raw(u64),
}

impl Addr {
    /// The guest address in `mem`'s layout.
    pub fn at(self, mem: &Guarded) -> u64 {
        let n = mem.regions.len();
        match self {
            Addr::In { region, offset } => {
                let (gpa, size) = mem.regions[region as usize % n];
                gpa + (offset as u64 % size as u64)
            }
            Addr::Edge {
                region,
                back,
                start,
            } => {
                let (gpa, size) = mem.regions[region as usize % n];
                if start {
                    gpa.wrapping_sub(back as u64)
                } else {
                    (gpa + size as u64).wrapping_sub(back as u64)
                }
            }
            Addr::Top(d) => u64::MAX - d as u64,
            Addr::Raw(a) => a,
        }
    }
}

/// A descriptor or data length.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Len {
    /// A few bytes (a header is 16, a status 1).
    Small(u8),
    /// Whole sectors.
    Sectors(u8),
    /// Sectors plus or minus a little.
    Ragged(u8, i8),
    /// Anything.
    Raw(u32),
}

impl Len {
    /// The length in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Len::Small(n) => n as u32 % 40,
            Len::Sectors(n) => 512 * (n as u32 % 20),
            Len::Ragged(n, d) => (512 * (n as u32 % 9)).wrapping_add(d as i32 as u32),
            Len::Raw(n) => n,
        }
    }
}

/// One descriptor.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Desc {
    /// Buffer address.
    pub addr: Addr,
    /// Buffer length.
    pub len: Len,
    /// Flags: the low three bits select NEXT / WRITE / INDIRECT, and with
    /// `raw_flags` the value is used as is.
    pub flags: u16,
    /// Use `flags` unmasked (reserved bits set).
    pub raw_flags: bool,
    /// Next index (taken modulo twice the queue size unless `raw_next`).
    pub next: u16,
    /// Use `next` as is.
    pub raw_next: bool,
}

impl Desc {
    /// The 16 bytes of the descriptor in a table of `size` entries.
    pub fn bytes(&self, mem: &Guarded, size: u16) -> [u8; 16] {
        let flags = if self.raw_flags {
            self.flags
        } else {
            self.flags & (NEXT | WRITE | INDIRECT)
        };
        let next = if self.raw_next {
            self.next
        } else {
            self.next % (2 * size)
        };
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.addr.at(mem).to_le_bytes());
        b[8..12].copy_from_slice(&self.len.bytes().to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        b
    }
}

/// An indirect descriptor table somewhere in guest memory.
#[derive(Arbitrary, Debug, Clone)]
pub struct Table {
    /// Where it goes (aligned down to 16 unless odd).
    pub at: Addr,
    /// Leave it unaligned.
    pub odd: bool,
    /// Its entries.
    pub entries: Vec<Desc>,
}

/// A virtio-blk request type.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum RType {
    /// VIRTIO_BLK_T_IN.
    In,
    /// VIRTIO_BLK_T_OUT.
    Out,
    /// VIRTIO_BLK_T_FLUSH.
    Flush,
    /// VIRTIO_BLK_T_GET_ID.
    GetId,
    /// VIRTIO_BLK_T_DISCARD.
    Discard,
    /// VIRTIO_BLK_T_WRITE_ZEROES.
    WriteZeroes,
    /// Anything.
    Raw(u32),
}

impl RType {
    fn code(self) -> u32 {
        match self {
            RType::In => 0,
            RType::Out => 1,
            RType::Flush => 4,
            RType::GetId => 8,
            RType::Discard => 11,
            RType::WriteZeroes => 13,
            RType::Raw(c) => c,
        }
    }
}

/// A sector number.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Sector {
    /// Near the start.
    Low(u8),
    /// Near a 2048-sector (1 MiB) capacity.
    NearEnd(i8),
    /// Anything.
    Raw(u64),
}

impl Sector {
    /// The sector number.
    pub fn get(self) -> u64 {
        match self {
            Sector::Low(s) => s as u64,
            Sector::NearEnd(d) => (2048i64 + d as i64) as u64,
            Sector::Raw(s) => s,
        }
    }
}

/// Bytes a guest driver put somewhere: request headers, discard ranges, noise.
#[derive(Arbitrary, Debug, Clone)]
pub enum Blob {
    /// A 16-byte request header.
    Header {
        /// Where.
        at: Addr,
        /// Request type.
        rtype: RType,
        /// Reserved field (ioprio).
        reserved: u32,
        /// Sector.
        sector: Sector,
    },
    /// A 16-byte discard / write-zeroes range.
    Range {
        /// Where.
        at: Addr,
        /// First sector.
        sector: Sector,
        /// Sector count.
        num: u32,
        /// Flags (bit 0: unmap).
        flags: u32,
    },
    /// Anything.
    Bytes {
        /// Where.
        at: Addr,
        /// The bytes.
        data: Vec<u8>,
    },
}

impl Blob {
    /// Writes the blob into `mem` (nothing if it does not fit).
    pub fn write(&self, mem: &Guarded) {
        match self {
            Blob::Header {
                at,
                rtype,
                reserved,
                sector,
            } => {
                let mut b = rtype.code().to_le_bytes().to_vec();
                b.extend_from_slice(&reserved.to_le_bytes());
                b.extend_from_slice(&sector.get().to_le_bytes());
                mem.put(at.at(mem), &b);
            }
            Blob::Range {
                at,
                sector,
                num,
                flags,
            } => {
                let mut b = sector.get().to_le_bytes().to_vec();
                b.extend_from_slice(&num.to_le_bytes());
                b.extend_from_slice(&flags.to_le_bytes());
                mem.put(at.at(mem), &b);
            }
            Blob::Bytes { at, data } => mem.put(at.at(mem), data),
        }
    }
}

impl Table {
    /// Writes the table; returns its address.
    pub fn write(&self, mem: &Guarded, size: u16) -> u64 {
        let mut at = self.at.at(mem);
        if !self.odd {
            at &= !15;
        }
        for (i, d) in self.entries.iter().take(64).enumerate() {
            mem.put(at.wrapping_add(16 * i as u64), &d.bytes(mem, size));
        }
        at
    }
}

/// A descriptor as read back from memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawDesc {
    /// Address.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Flags.
    pub flags: u16,
    /// Next.
    pub next: u16,
}

fn desc_at(mem: &Guarded, s: &Snapshot, at: u64) -> Option<RawDesc> {
    let b = mem.read(s, at, 16)?;
    Some(RawDesc {
        addr: u64::from_le_bytes(b[..8].try_into().unwrap()),
        len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
        flags: u16::from_le_bytes([b[12], b[13]]),
        next: u16::from_le_bytes([b[14], b[15]]),
    })
}

/// Every descriptor a device could take as part of the chain at `head` of
/// the table at `table` (`size` entries), as memory was in `s`: a superset
/// of what the virtio-queue crate walks (every entry of an indirect table is
/// included, reachable or not; the indirect descriptor itself is no buffer).
pub fn walk(mem: &Guarded, s: &Snapshot, table: u64, size: u16, head: u16) -> Vec<RawDesc> {
    let mut out = Vec::new();
    if head >= size {
        return out;
    }
    let mut idx = head;
    for _ in 0..=size {
        let Some(d) = desc_at(mem, s, table + 16 * idx as u64) else {
            break;
        };
        if d.flags & INDIRECT != 0 {
            let n = (d.len / 16).min(65536) as u64;
            for i in 0..n {
                match d.addr.checked_add(16 * i).and_then(|a| desc_at(mem, s, a)) {
                    Some(e) => out.push(e),
                    None => break,
                }
            }
            // The table replaces the rest of the chain (virtio 1.2, 2.7.5.3).
            break;
        }
        out.push(d);
        if d.flags & NEXT == 0 || d.next >= size {
            break;
        }
        idx = d.next;
    }
    out
}

/// Bytes the device itself writes during a pass (a field of the used ring),
/// with every value they may have held meanwhile: a descriptor the driver
/// placed over them (the spec forbids it, the harness does not) may have been
/// read by the device with any of these values in it, not only the ones the
/// snapshots before and after the pass show.
#[derive(Debug, Clone)]
pub struct Field {
    /// Guest address of the field.
    pub at: u64,
    /// Its possible contents (each as long as the field).
    pub values: Vec<Vec<u8>>,
}

/// What [`walk_volatile`] found besides the descriptors.
#[derive(Debug, Default, Clone, Copy)]
pub struct Volatile {
    /// A descriptor read overlapped a field.
    pub hit: bool,
    /// A descriptor had more variants than are enumerated: the walk may miss
    /// some (the caller cannot trust a negative answer).
    pub truncated: bool,
}

/// Variants of one descriptor: every combination of the fields' values it
/// overlaps, on top of each snapshot's bytes (at most `MAX_VARIANTS`).
fn desc_variants(
    mem: &Guarded,
    snaps: &[&Snapshot],
    at: u64,
    fields: &[Field],
    seen: &mut Volatile,
) -> Vec<RawDesc> {
    const MAX_VARIANTS: usize = 1 << 12;
    let end = at.saturating_add(16);
    let over: Vec<&Field> = fields
        .iter()
        .filter(|f| f.at < end && f.at.saturating_add(f.values[0].len() as u64) > at)
        .collect();
    let mut out: Vec<[u8; 16]> = Vec::new();
    for s in snaps {
        if let Some(b) = mem.read(s, at, 16) {
            out.push(b.try_into().unwrap());
        }
    }
    for f in &over {
        let mut next = Vec::new();
        'all: for base in &out {
            for v in &f.values {
                let mut b = *base;
                for (k, byte) in v.iter().enumerate() {
                    let a = f.at + k as u64;
                    if a >= at && a < end {
                        b[(a - at) as usize] = *byte;
                    }
                }
                next.push(b);
                if next.len() >= MAX_VARIANTS {
                    seen.truncated = true;
                    break 'all;
                }
            }
        }
        next.sort_unstable();
        next.dedup();
        out = next;
    }
    let descs = out
        .iter()
        .map(|b| RawDesc {
            addr: u64::from_le_bytes(b[..8].try_into().unwrap()),
            len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            flags: u16::from_le_bytes([b[12], b[13]]),
            next: u16::from_le_bytes([b[14], b[15]]),
        })
        .collect();
    seen.hit |= !over.is_empty();
    descs
}

/// Like [`walk`] over every snapshot of `snaps` at once, with the bytes of
/// `fields` taking any of their values: every descriptor the device could
/// have taken as part of the chain at `head` while it was itself rewriting
/// those fields. A superset (each table entry in any variant, any variant's
/// next followed). Also says whether any descriptor read overlapped a field
/// (if not, [`walk`] over each snapshot gives the same chains, more tightly).
pub fn walk_volatile(
    mem: &Guarded,
    snaps: &[&Snapshot],
    table: u64,
    size: u16,
    head: u16,
    fields: &[Field],
) -> (Vec<RawDesc>, Volatile) {
    let mut out = Vec::new();
    let mut seen = Volatile::default();
    if head >= size {
        return (out, seen);
    }
    let mut visited = vec![false; size as usize];
    let mut todo = vec![head];
    visited[head as usize] = true;
    while let Some(idx) = todo.pop() {
        let ds = desc_variants(mem, snaps, table + 16 * idx as u64, fields, &mut seen);
        for d in ds {
            if d.flags & INDIRECT != 0 {
                let n = (d.len / 16).min(65536) as u64;
                for i in 0..n {
                    let Some(a) = d.addr.checked_add(16 * i) else {
                        break;
                    };
                    let es = desc_variants(mem, snaps, a, fields, &mut seen);
                    if es.is_empty() {
                        break;
                    }
                    out.extend(es);
                }
                continue;
            }
            out.push(d);
            if d.flags & NEXT != 0 && d.next < size && !visited[d.next as usize] {
                visited[d.next as usize] = true;
                todo.push(d.next);
            }
        }
    }
    (out, seen)
}

/// Whether `[addr, addr + len)` lies inside a device-writable descriptor of
/// `descs` (without wrapping past 2^64).
pub fn in_writable(descs: &[RawDesc], addr: u64, len: u64) -> bool {
    // Inclusive last bytes: a buffer may end exactly at 2^64.
    let Some(last) = addr.checked_add(len.max(1) - 1) else {
        return false;
    };
    descs.iter().any(|d| {
        d.flags & WRITE != 0
            && d.len > 0
            && addr >= d.addr
            // A descriptor that wraps past 2^64 (refused as a whole by
            // nothing yet, see PARSER_DATA_WRAP) covers up to 2^64 - 1.
            && last <= d.addr.saturating_add(d.len as u64 - 1)
    })
}

/// One element of a chain laid out the way a driver would (with mistakes).
#[derive(Arbitrary, Debug, Clone)]
pub enum Part {
    /// The request header (16 bytes unless `len` says otherwise).
    Header {
        /// Request type.
        rtype: RType,
        /// Sector.
        sector: Sector,
        /// Descriptor length instead of 16.
        len: Option<Len>,
    },
    /// A data buffer.
    Data {
        /// Length.
        len: Len,
        /// Device-writable.
        write: bool,
    },
    /// A discard / write-zeroes range (16 bytes, device-readable).
    Range {
        /// First sector.
        sector: Sector,
        /// Sector count.
        num: u16,
        /// Flags.
        flags: u8,
    },
    /// The status byte (1 byte unless `len` says otherwise, device-writable).
    Status {
        /// Descriptor length instead of 1.
        len: Option<Len>,
    },
    /// Any descriptor (its NEXT flag and next index are set by the chain).
    Raw(Desc),
}

/// A part with an optional address override (else the next free address).
#[derive(Arbitrary, Debug, Clone)]
pub struct Placed {
    /// The element.
    pub part: Part,
    /// Where its buffer goes instead of the next free address.
    pub at: Option<Addr>,
    /// Flip the direction.
    pub flip: bool,
}

/// Lays out `parts` as a chain: buffers from `cursor` on (8-byte aligned),
/// headers and ranges written into them; returns the descriptors, entry `i`
/// chained to `next_of(i + 1)`.
pub fn lay_out(
    mem: &Guarded,
    parts: &[Placed],
    cursor: u64,
    next_of: impl Fn(usize) -> u16,
) -> Vec<[u8; 16]> {
    let mut cur = cursor & !7;
    let mut out = Vec::new();
    let n = parts.len();
    for (i, p) in parts.iter().enumerate() {
        let (len, mut write, payload): (u32, bool, Vec<u8>) = match &p.part {
            Part::Header { rtype, sector, len } => {
                let mut b = rtype.code().to_le_bytes().to_vec();
                b.extend_from_slice(&0u32.to_le_bytes());
                b.extend_from_slice(&sector.get().to_le_bytes());
                (len.map_or(16, Len::bytes), false, b)
            }
            Part::Data { len, write } => (len.bytes(), *write, Vec::new()),
            Part::Range { sector, num, flags } => {
                let mut b = sector.get().to_le_bytes().to_vec();
                b.extend_from_slice(&(*num as u32).to_le_bytes());
                b.extend_from_slice(&(*flags as u32).to_le_bytes());
                (16, false, b)
            }
            Part::Status { len } => (len.map_or(1, Len::bytes), true, Vec::new()),
            Part::Raw(d) => {
                let b = d.bytes(mem, 1);
                let flags = u16::from_le_bytes([b[12], b[13]]);
                (d.len.bytes(), flags & WRITE != 0, Vec::new())
            }
        };
        if p.flip {
            write = !write;
        }
        let addr = match (p.at, &p.part) {
            (Some(a), _) => a.at(mem),
            (None, Part::Raw(d)) => d.addr.at(mem),
            (None, _) => {
                let a = cur;
                cur = cur.wrapping_add((len as u64 + 7) & !7);
                a
            }
        };
        mem.put(addr, &payload);
        let mut flags = if write { WRITE } else { 0 };
        let mut next = 0;
        if i + 1 < n {
            flags |= NEXT;
            next = next_of(i + 1);
        }
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        out.push(b);
    }
    out
}

/// How a request's chain is laid out.
#[derive(Arbitrary, Debug, Clone)]
pub enum Shape {
    /// Descriptors in the main table from the head on.
    Direct {
        /// The chain.
        parts: Body,
        /// Where buffers start.
        cursor: Addr,
    },
    /// One indirect descriptor at the head, pointing at a table.
    Indirect {
        /// The chain in the table.
        parts: Body,
        /// Where buffers start.
        cursor: Addr,
        /// Where the table goes (16-byte aligned).
        table: Addr,
        /// Flags of the head descriptor besides INDIRECT (NEXT, WRITE).
        head_flags: u8,
        /// Length of the head descriptor instead of 16 per entry.
        len: Option<Len>,
    },
    /// Only what the raw table entries say.
    Raw,
}

impl Shape {
    /// Writes the chain at `head` of the table at `desc_table` (`size`
    /// entries).
    pub fn write(&self, mem: &Guarded, desc_table: u64, size: u16, head: u16) {
        match self {
            Shape::Raw => {}
            Shape::Direct { parts, cursor } => {
                let idx = |i: usize| ((head as usize + i) % size as usize) as u16;
                let descs = lay_out(mem, &parts.parts(), cursor.at(mem), idx);
                for (i, d) in descs.iter().enumerate().take(size as usize) {
                    mem.put(desc_table + 16 * idx(i) as u64, d);
                }
            }
            Shape::Indirect {
                parts,
                cursor,
                table,
                head_flags,
                len,
            } => {
                let t = table.at(mem) & !15;
                let descs = lay_out(mem, &parts.parts(), cursor.at(mem), |i| i as u16);
                for (i, d) in descs.iter().enumerate() {
                    mem.put(t.wrapping_add(16 * i as u64), d);
                }
                let l = len.map_or(16 * descs.len() as u32, Len::bytes);
                let flags = INDIRECT | (*head_flags as u16 & (NEXT | WRITE));
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&t.to_le_bytes());
                b[8..12].copy_from_slice(&l.to_le_bytes());
                b[12..14].copy_from_slice(&flags.to_le_bytes());
                b[14..16].copy_from_slice(&((head + 1) % size).to_le_bytes());
                mem.put(desc_table + 16 * head as u64, &b);
            }
        }
    }
}

/// A request as a driver would lay it out, with at most a couple of
/// mistakes: random bytes reach well-formed requests often this way.
#[derive(Arbitrary, Debug, Clone)]
pub struct Template {
    /// Request type.
    pub rtype: RType,
    /// Sector.
    pub sector: Sector,
    /// Number of data segments (modulo 5).
    pub nseg: u8,
    /// Their lengths in sectors (modulo 9).
    pub lens: [u8; 4],
    /// One segment's length in bytes instead: (segment, length).
    pub odd_len: Option<(u8, Len)>,
    /// Header over two descriptors (8 + 8).
    pub split_header: bool,
    /// Status byte at the end of the last data descriptor.
    pub status_in_data: bool,
    /// Discard / write-zeroes range: sector count and flags.
    pub range: (Sector, u16, u8),
    /// Replace one part.
    pub replace: Option<(u8, Placed)>,
    /// Insert one part.
    pub insert: Option<(u8, Placed)>,
}

/// The parts of a chain.
#[derive(Arbitrary, Debug, Clone)]
pub enum Body {
    /// A driver-like request.
    Template(Template),
    /// Anything.
    Parts(Vec<Placed>),
}

fn placed(part: Part) -> Placed {
    Placed {
        part,
        at: None,
        flip: false,
    }
}

impl Body {
    /// The parts.
    pub fn parts(&self) -> Vec<Placed> {
        let t = match self {
            Body::Parts(p) => return p.clone(),
            Body::Template(t) => t,
        };
        let mut v = Vec::new();
        let header = Part::Header {
            rtype: t.rtype,
            sector: t.sector,
            len: None,
        };
        if t.split_header {
            // The header bytes are written by the first part (16 bytes at
            // its address); the second descriptor points 8 bytes further.
            v.push(placed(Part::Header {
                rtype: t.rtype,
                sector: t.sector,
                len: Some(Len::Small(8)),
            }));
            v.push(placed(Part::Data {
                len: Len::Small(8),
                write: false,
            }));
        } else {
            v.push(placed(header));
        }
        let write = matches!(t.rtype, RType::In | RType::GetId);
        let lens = |i: usize| match t.odd_len {
            Some((j, l)) if j as usize % 4 == i => l,
            _ if matches!(t.rtype, RType::GetId) => Len::Small(t.lens[i]),
            _ => Len::Sectors(t.lens[i] % 9),
        };
        match t.rtype {
            RType::Discard | RType::WriteZeroes => v.push(placed(Part::Range {
                sector: t.range.0,
                num: t.range.1,
                flags: t.range.2,
            })),
            RType::Flush => {}
            _ => {
                for i in 0..(t.nseg % 5) as usize {
                    v.push(placed(Part::Data {
                        len: lens(i),
                        write,
                    }));
                }
            }
        }
        let last_is_writable_data = matches!(
            v.last(),
            Some(Placed {
                part: Part::Data { write: true, .. },
                ..
            })
        );
        if t.status_in_data && last_is_writable_data {
            if let Some(Placed {
                part: Part::Data { len, .. },
                ..
            }) = v.last_mut()
            {
                *len = Len::Raw(len.bytes().wrapping_add(1));
            }
        } else {
            v.push(placed(Part::Status { len: None }));
        }
        if let Some((i, p)) = &t.replace {
            let i = *i as usize % v.len();
            v[i] = p.clone();
        }
        if let Some((i, p)) = &t.insert {
            let i = *i as usize % (v.len() + 1);
            v.insert(i, p.clone());
        }
        v
    }
}
