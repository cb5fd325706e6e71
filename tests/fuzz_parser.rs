//! Fuzzing the virtio-blk request parser (`virtio::request`) over arbitrary
//! descriptor chains in guest memory with holes and guard pages: random
//! descriptor tables (addresses, lengths, flags, next indexes), indirect
//! tables, request headers and payloads, device limits and the read-only
//! flag.
//!
//! Invariants:
//! - no panic (in the parser or in the crate's chain walk);
//! - on `Ok`, the request is consistent with its chain: the status byte is
//!   the last byte of the last device-writable descriptor; every data
//!   segment lies inside one descriptor of the right direction (device-
//!   writable for what the device writes: reads and GET_ID), without
//!   wrapping past 2^64 and never over the status byte or the header; the
//!   limits (seg_max, size_max, capacity, discard/write-zeroes maximums,
//!   read-only) hold;
//! - on `Rejected`, a status address, if any, is the last byte of a
//!   device-writable descriptor of the chain (and none means `NoStatus`);
//! - the production parser, `parse_head` over the IOThreads' `GuestMem`
//!   (their path: the fast path's chain walk and one-region accessors), gives
//!   the same result as the oracle, [`oracle`]: the parser over the chain
//!   virtio_queue pops, over vm-memory's own accessors.
//!
//! Whether a buffer lies in guest memory is not the parser's business (the
//! executor checks every segment before use and fails the request with
//! IOERR); `fuzz_queue` checks that nothing outside the chain's writable
//! descriptors is ever written.
//!
//! `cargo test --release --test fuzz_parser` runs a bounded count;
//! `VQBLK_FUZZ_SECONDS=1800` a long run (see tests/fuzz/mod.rs, scripts/fuzz.sh).

mod fuzz;

use arbitrary::Arbitrary;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vqblk_daemon::fastpath::GuestMem;
use vqblk_daemon::virtio::request::{
    parse_descriptors, parse_head, Limits, Operation, Rejected, Request, RequestError, Segment,
};

use fuzz::guarded::Guarded;
use fuzz::ring::{queue_size, Blob, Desc, Shape, Table};
use fuzz::Outcome;

/// The ring (descriptor table, avail, used) sits at guest address 0.
const LAYOUT: [(u64, usize); 4] = [
    (0, 0x4000),
    (0x1_0000, 0x4000),
    (0x3_0000, 0x1000),
    // Just below 2^64: buffers that run off the end of the address space.
    (u64::MAX - 0x4fff, 0x4000),
];

/// Device limits, small enough to be hit.
#[derive(Arbitrary, Debug, Clone, Copy)]
struct LimitsCase {
    capacity_sectors: u16,
    huge_capacity: bool,
    seg_max: u8,
    size_max: u32,
    max_discard_sectors: u16,
    max_write_zeroes_sectors: u16,
    read_only: bool,
}

impl LimitsCase {
    /// The limits; a zero (the input ran out) picks a typical value.
    fn limits(&self) -> Limits {
        let or = |v: u32, d: u32| if v == 0 { d } else { v };
        Limits {
            capacity_sectors: if self.huge_capacity {
                u64::MAX
            } else {
                or(self.capacity_sectors as u32, 2048) as u64
            },
            // 255: none allowed.
            seg_max: if self.seg_max == 255 {
                0
            } else {
                or(self.seg_max as u32, 8)
            },
            size_max: or(self.size_max, 65536),
            max_discard_sectors: or(self.max_discard_sectors as u32, 1024),
            max_write_zeroes_sectors: or(self.max_write_zeroes_sectors as u32, 1024),
            read_only: self.read_only,
        }
    }
}

/// One parser case. The fields that matter most come first: when the
/// random input runs out, the rest decode as zeroes.
#[derive(Arbitrary, Debug, Clone)]
struct ParserCase {
    /// Queue size selector (see [`queue_size`]).
    size_log: u8,
    /// Head index: modulo the size, or (see `head_mode`) twice the size, or as is.
    head: u16,
    /// 0..=239: head modulo the size; ..=249: modulo twice the size; else raw.
    head_mode: u8,
    limits: LimitsCase,
    /// The chain at the head.
    shape: Shape,
    /// Seed of the background contents of guest memory.
    fill: u64,
    /// Main table entries overwritten afterwards: (index, descriptor).
    patches: Vec<(u8, Desc)>,
    /// Main table entries from index 0 (background, before the chain).
    descs: Vec<Desc>,
    /// Indirect tables.
    tables: Vec<Table>,
    /// Headers, ranges and noise.
    blobs: Vec<Blob>,
}

/// This thread's guest memory. One per thread, not one per process: the
/// regression tests and the fuzz loop run in parallel and each rewrites the
/// whole memory for every case (a shared map made them race, seen in CI).
fn mem() -> &'static Guarded {
    thread_local! {
        static MEM: &'static Guarded = Box::leak(Box::new(Guarded::new(&LAYOUT)));
    }
    MEM.with(|m| *m)
}

/// The oracle the production parser is compared with: the parser over the
/// chain virtio_queue pops, whose descriptor reads and accessors are
/// vm-memory's (a plain `GuestMemoryMmap` takes no fast path).
fn oracle(chain: DescriptorChain<&GuestMemoryMmap>, limits: &Limits) -> Result<Request, Rejected> {
    let head = chain.head_index();
    parse_descriptors(head, chain.clone(), chain.memory(), limits)
}

/// A descriptor of the chain as the crate yields it.
#[derive(Debug, Clone, Copy)]
struct D {
    addr: u64,
    len: u32,
    write: bool,
}

/// Whether `seg` lies inside one of `descs` of direction `write`, and
/// outside `[avoid, avoid + avoid_len)`.
fn covered(descs: &[D], seg: &Segment, write: bool) -> bool {
    // Inclusive last bytes: a buffer may end exactly at 2^64.
    let Some(last) = seg.addr.0.checked_add((seg.len as u64).max(1) - 1) else {
        return false;
    };
    descs.iter().any(|d| {
        d.write == write
            && d.len > 0
            && seg.addr.0 >= d.addr
            && d.addr
                .checked_add(d.len as u64 - 1)
                .is_some_and(|dlast| last <= dlast)
    })
}

fn run_case(c: &ParserCase) -> Outcome {
    let g = mem();
    let size = queue_size(c.size_log);
    g.fill(&mut fastrand::Rng::with_seed(c.fill));
    for t in &c.tables {
        t.write(g, size);
    }
    for b in &c.blobs {
        b.write(g);
    }
    let vq = MockSplitQueue::create(&g.mem, GuestAddress(0), size);
    for (i, d) in c.descs.iter().take(size as usize).enumerate() {
        g.put(vq.desc_table_addr().0 + 16 * i as u64, &d.bytes(g, size));
    }
    let head = match c.head_mode {
        0..=239 => c.head % size,
        240..=249 => c.head % (2 * size),
        _ => c.head,
    };
    let table = vq.desc_table_addr().0;
    if fuzz::debug() {
        fuzz::note(match &c.shape {
            Shape::Raw => "shape:raw".to_string(),
            Shape::Direct { parts, .. } => format!("shape:direct{}", parts.parts().len().min(5)),
            Shape::Indirect { parts, .. } => {
                format!("shape:indirect{}", parts.parts().len().min(5))
            }
        });
    }
    if head < size {
        c.shape.write(g, table, size, head);
    }
    for (i, d) in &c.patches {
        g.put(table + 16 * (*i as u64 % size as u64), &d.bytes(g, size));
    }
    let avail = vq.avail_addr();
    g.mem.write_obj(0u16, avail).unwrap();
    g.mem.write_obj(1u16, GuestAddress(avail.0 + 2)).unwrap();
    g.mem.write_obj(head, GuestAddress(avail.0 + 4)).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let Some(chain) = q.pop_descriptor_chain(&g.mem) else {
        return Outcome::Finding("one avail entry but no chain popped".into());
    };
    if chain.head_index() != head {
        return Outcome::Finding(format!("popped head {} for {head}", chain.head_index()));
    }
    let descs: Vec<D> = chain
        .clone()
        .map(|d| D {
            addr: d.addr().0,
            len: d.len(),
            write: d.is_write_only(),
        })
        .collect();
    let limits = c.limits.limits();
    if fuzz::replaying() {
        println!("chain: {descs:x?}");
    }
    // The status byte the spec defines: the last byte of the last
    // device-writable (non-empty) descriptor, if that does not wrap.
    let last_w = descs.iter().rev().find(|d| d.write && d.len > 0);
    let want_status = last_w.and_then(|d| d.addr.checked_add(d.len as u64 - 1));
    let parsed = oracle(chain, &limits);
    if head < size {
        // The IOThreads refuse a head outside the ring before parsing.
        let gm = GuestMem::from(g.mem.clone());
        let walked = parse_head(&gm, GuestAddress(table), size, head, &limits);
        if walked != parsed {
            return Outcome::Finding(format!(
                "parse_head over GuestMem gives {walked:?}, the oracle {parsed:?}"
            ));
        }
    }
    if fuzz::debug() && !matches!(c.shape, Shape::Raw) {
        if let Err(r) = &parsed {
            if r.error == RequestError::NoStatus {
                fuzz::note(format!(
                    "nostatus:{}descs:{}",
                    descs.len().min(5),
                    if head >= size { "oob" } else { "in" }
                ));
            }
        }
    }
    match &parsed {
        Ok(r) => fuzz::note(format!("ok:{:?}", r.op.kind())),
        Err(r) => fuzz::note(format!("{:?}", r.error).split(['(', ' ']).next().unwrap()),
    }
    match parsed {
        Ok(req) => check_ok(&req, &descs, want_status, &limits),
        Err(rej) => {
            if rej.head != head {
                return Outcome::Finding(format!("rejected with head {} for {head}", rej.head));
            }
            match (rej.status, want_status) {
                (None, _) if rej.error != RequestError::NoStatus => Outcome::Finding(format!(
                    "rejected without a status address but not NoStatus: {:?}",
                    rej.error
                )),
                (Some(s), want) if Some(s.0) != want => Outcome::Finding(format!(
                    "status {:#x} of a rejected request is not the last writable byte {want:x?}",
                    s.0
                )),
                _ => Outcome::Pass,
            }
        }
    }
}

fn check_ok(req: &Request, descs: &[D], want_status: Option<u64>, limits: &Limits) -> Outcome {
    let bad = |s: String| Outcome::Finding(format!("{s}: {req:?}"));
    // PARSER_DATA_WRAP (found by this harness): a data segment whose end
    // wraps past 2^64 must be refused by the parser.
    let data: &[Segment] = match &req.op {
        Operation::Read { data, .. }
        | Operation::Write { data, .. }
        | Operation::GetId { data } => data,
        _ => &[],
    };
    if data
        .iter()
        .any(|s| s.addr.0.checked_add(s.len as u64).is_none())
    {
        return bad("a data segment wraps past 2^64".into());
    }
    if Some(req.status.0) != want_status {
        return bad(format!(
            "status not the last writable byte {want_status:x?}"
        ));
    }
    let status = Segment {
        addr: req.status,
        len: 1,
    };
    if !covered(descs, &status, true) {
        return bad("status outside the writable descriptors".into());
    }
    // What the device writes: the data segments plus the status byte are
    // exactly the device-writable bytes of the chain (a guest may alias
    // descriptors, so this is counted, not compared address by address).
    let writable: u64 = descs.iter().filter(|d| d.write).map(|d| d.len as u64).sum();
    let partition = |data: &[Segment]| -> Result<(), String> {
        let n: u64 = data.iter().map(|s| s.len as u64).sum();
        if n + 1 != writable {
            return Err(format!(
                "{n} data bytes + status for {writable} writable bytes"
            ));
        }
        Ok(())
    };
    let check_data = |data: &[Segment], write: bool| -> Result<u64, String> {
        if data.len() > limits.seg_max as usize {
            return Err(format!("{} segments above seg_max", data.len()));
        }
        let mut total = 0u64;
        for s in data {
            if s.len > limits.size_max {
                return Err(format!("segment {s:?} above size_max"));
            }
            if !covered(descs, s, write) {
                return Err(format!(
                    "segment {s:?} outside the descriptors (write={write})"
                ));
            }
            total += s.len as u64;
        }
        Ok(total)
    };
    let in_range = |sector: u64, n: u64| {
        sector
            .checked_add(n)
            .is_some_and(|e| e <= limits.capacity_sectors)
    };
    let r = match &req.op {
        Operation::Read { sector, data } => {
            partition(data).and(check_data(data, true)).and_then(|n| {
                if n == 0 || n % 512 != 0 || !in_range(*sector, n / 512) {
                    Err(format!("read of {n} bytes at {sector} accepted"))
                } else {
                    Ok(())
                }
            })
        }
        Operation::Write { sector, data } => check_data(data, false).and_then(|n| {
            if limits.read_only {
                Err("write accepted on a read-only export".into())
            } else if n == 0 || n % 512 != 0 || !in_range(*sector, n / 512) {
                Err(format!("write of {n} bytes at {sector} accepted"))
            } else {
                // The data follows the 16 header bytes: the readable bytes
                // add up to header + data.
                let readable: u64 = descs
                    .iter()
                    .filter(|d| !d.write)
                    .map(|d| d.len as u64)
                    .sum();
                if readable != n + 16 {
                    Err(format!("{readable} readable bytes for {n} data bytes"))
                } else {
                    Ok(())
                }
            }
        }),
        // GET_ID writes at most 20 bytes: seg_max and size_max do not apply.
        Operation::GetId { data } => partition(data).and(
            data.iter()
                .find(|s| !covered(descs, s, true))
                .map_or(Ok(()), |s| {
                    Err(format!("segment {s:?} outside the writable descriptors"))
                }),
        ),
        // Flush, discard and write-zeroes write only the status byte.
        Operation::Flush => Ok(()),
        Operation::Discard {
            sector,
            num_sectors,
        } => {
            if limits.read_only
                || *num_sectors == 0
                || *num_sectors > limits.max_discard_sectors
                || !in_range(*sector, *num_sectors as u64)
            {
                Err("discard accepted out of bounds".into())
            } else {
                Ok(())
            }
        }
        Operation::WriteZeroes {
            sector,
            num_sectors,
            ..
        } => {
            if limits.read_only
                || *num_sectors == 0
                || *num_sectors > limits.max_write_zeroes_sectors
                || !in_range(*sector, *num_sectors as u64)
            {
                Err("write-zeroes accepted out of bounds".into())
            } else {
                Ok(())
            }
        }
    };
    match r {
        Ok(()) => Outcome::Pass,
        Err(e) => bad(e),
    }
}

/// The bounded CI run (about 2 s); `VQBLK_FUZZ_SECONDS` makes it a long run.
#[test]
fn fuzz_parser() {
    fuzz::run::<ParserCase, _>("parser", 30_000, run_case);
}

// ---- regression inputs ---------------------------------------------------

use fuzz::ring::{Addr, Len, RType, Sector};

fn desc(addr: Addr, len: Len, flags: u16, next: u16) -> Desc {
    Desc {
        addr,
        len,
        flags,
        raw_flags: false,
        next,
        raw_next: false,
    }
}

fn base_case(descs: Vec<Desc>, blobs: Vec<Blob>) -> ParserCase {
    ParserCase {
        fill: 1,
        size_log: 0,
        head: 0,
        head_mode: 0,
        descs,
        shape: Shape::Raw,
        patches: vec![],
        tables: vec![],
        blobs,
        limits: LimitsCase {
            capacity_sectors: 2048,
            huge_capacity: false,
            seg_max: 8,
            size_max: 65536,
            max_discard_sectors: 1024,
            max_write_zeroes_sectors: 1024,
            read_only: false,
        },
    }
}

const R1: Addr = Addr::In {
    region: 1,
    offset: 0,
};

/// A status descriptor whose end wraps past 2^64 must give no status address
/// (it would be a low guest address no descriptor covers).
#[test]
fn regression_status_descriptor_wrapping_2_64() {
    let c = base_case(
        vec![
            desc(R1, Len::Small(16), 1, 1),
            desc(Addr::Top(2), Len::Small(8), 2, 0),
        ],
        vec![Blob::Header {
            at: R1,
            rtype: RType::Flush,
            reserved: 0,
            sector: Sector::Low(0),
        }],
    );
    fuzz::check_case(&c, run_case(&c));
}

/// A read whose data descriptor runs off the end of the address space
/// (PARSER_DATA_WRAP above): refused since the fix.
#[test]
fn regression_data_descriptor_wrapping_2_64() {
    let c = base_case(
        vec![
            desc(R1, Len::Small(16), 1, 1),
            desc(Addr::Top(100), Len::Sectors(1), 3, 2),
            desc(R1, Len::Small(1), 2, 0),
        ],
        vec![Blob::Header {
            at: R1,
            rtype: RType::In,
            reserved: 0,
            sector: Sector::Low(0),
        }],
    );
    fuzz::check_case(&c, run_case(&c));
}
