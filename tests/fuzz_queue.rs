//! Fuzzing the queue path: a real IOThread (the engine's event loop, queue
//! slot and executor, null backend) is handed rings in random states through
//! the public `Command::Attach` / `Command::Detach` interface, exactly as the
//! vhost-user control plane hands them over (SET_VRING_* then GET_VRING_BASE).
//!
//! Each case: guest memory of several regions with unmapped holes between
//! them (and PROT_NONE guard pages around each host mapping) filled with
//! random bytes; a descriptor table, avail and used ring at random places;
//! random avail idx and next_avail (SET_VRING_BASE), random avail entries and
//! head indexes, driver-like chains and raw descriptors, indirect tables; the
//! ring attached (one pass) and detached.
//!
//! Invariants:
//! - no panic in any thread;
//! - the pass ends: the detach is answered within [`PASS_TIMEOUT`] (a ring
//!   that makes the IOThread spin without progress fails this);
//! - every byte the daemon changed lies in a device-writable descriptor of a
//!   chain it popped, or in the used ring (snapshots before and after);
//! - every popped head is completed exactly once (used entries against the
//!   avail entries between next_avail before and after), with a used length
//!   no larger than the chain's device-writable bytes.
//!
//! A ring in an impossible state (an avail idx more than the queue size
//! ahead, a ring the crate finds not ready, a head index >= queue size) is
//! stopped by the engine as a broken ring: the pass ends, and a head >= size
//! is the last chain popped and gets no used entry.

mod fuzz;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::mpsc::{sync_channel, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use arbitrary::Arbitrary;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vqblk_daemon::block::Disk;
use vqblk_daemon::iothread::{
    BlockDevice, Command, GuestMem, IoThreadHandle, IoThreadSetup, QueueAttach, QueueKey,
};
use vqblk_daemon::virtio::request::Limits;

use fuzz::guarded::{le_u16, Guarded, Snapshot};
use fuzz::ring::{
    in_writable, queue_size, walk, walk_volatile, Blob, Desc, Field, Shape, Table, WRITE,
};
use fuzz::Outcome;

/// Longest a pass over one ring may take (a null backend pass takes
/// microseconds; this only bounds a frozen IOThread).
const PASS_TIMEOUT: Duration = Duration::from_millis(500);

/// Memory layouts: holes between regions, adjacent regions (contiguous
/// guest addresses, separate host mappings), a region just below 2^64.
const LAYOUTS: [&[(u64, usize)]; 2] = [
    &[
        (0x0, 0x8000),
        (0x1_0000, 0x4000),
        (0x4_0000, 0x1000),
        (0x1_0000_0000, 0x4000),
    ],
    &[
        (0x1000, 0x3000),
        (0x4000, 0x4000),
        (0x2_0000, 0x2000),
        (u64::MAX - 0x4fff, 0x4000),
    ],
];

/// Where a ring part goes: inside a region (aligned), or anywhere.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum RingAt {
    In { region: u8, offset: u16 },
    Raw(u64),
}

impl RingAt {
    fn at(self, g: &Guarded, need: u64, align: u64) -> u64 {
        match self {
            // Raw addresses are mostly refused (not in memory): 1 in 8.
            RingAt::Raw(a) if a % 8 != 0 => RingAt::In {
                region: (a >> 8) as u8,
                offset: (a >> 16) as u16,
            }
            .at(g, need, align),
            RingAt::In { region, offset } => {
                let (gpa, size) = g.regions[region as usize % g.regions.len()];
                let room = (size as u64).saturating_sub(need).max(1);
                (gpa + offset as u64 % room) & !(align - 1)
            }
            RingAt::Raw(a) => a & !(align - 1),
        }
    }
}

/// One chain to put on the ring.
#[derive(Arbitrary, Debug, Clone)]
struct Chain {
    head: u16,
    shape: Shape,
}

#[derive(Arbitrary, Debug, Clone)]
struct QueueCase {
    size_sel: u8,
    layout: u8,
    /// avail idx - next_avail: `behind % (size + 1)`, or raw with `raw_next`.
    behind: u16,
    raw_next: Option<u16>,
    avail_idx: u16,
    chains: Vec<Chain>,
    desc_at: RingAt,
    avail_at: RingAt,
    used_at: RingAt,
    event_idx: bool,
    read_only: bool,
    used_idx: u16,
    /// avail ring slots overwritten with these heads (raw).
    heads: Vec<(u8, u16)>,
    fill: u64,
    patches: Vec<(u8, Desc)>,
    tables: Vec<Table>,
    blobs: Vec<Blob>,
    /// Bytes written at the start of the used ring (flags, idx) and avail flags.
    avail_flags: u16,
    avail_used_event: u16,
}

/// A ring laid out in memory, before the IOThread sees it.
struct Ring {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    next_avail: u16,
    next_used: u16,
}

fn read_u16(g: &Guarded, addr: u64) -> Option<u16> {
    use vm_memory::Bytes;
    g.mem.read_obj::<u16>(GuestAddress(addr)).ok()
}

/// The daemon side: one IOThread, replaced if a case freezes or kills it.
struct Engine {
    iot: IoThreadHandle,
    kick: EventFd,
    layouts: Vec<Guarded>,
    threads: usize,
}

impl Engine {
    fn new() -> Engine {
        Engine {
            iot: IoThreadHandle::spawn(0, IoThreadSetup::default()).unwrap(),
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            layouts: LAYOUTS.iter().map(|l| Guarded::new(l)).collect(),
            threads: 1,
        }
    }

    /// A frozen or dead IOThread is left behind (it cannot be joined) and a
    /// new one takes over.
    fn replace_iothread(&mut self) {
        self.threads += 1;
        let old = std::mem::replace(
            &mut self.iot,
            IoThreadHandle::spawn(self.threads, IoThreadSetup::default()).unwrap(),
        );
        std::mem::forget(old);
    }
}

fn dup_file(fd: &impl AsRawFd) -> File {
    // SAFETY: dup of a live descriptor; the new one (checked) is owned by the File alone.
    unsafe {
        let n = libc::dup(fd.as_raw_fd());
        assert!(n >= 0, "dup");
        File::from_raw_fd(n)
    }
}

fn run_case(e: &mut Engine, c: &QueueCase) -> Outcome {
    let g = e.layouts[c.layout as usize % e.layouts.len()].clone();
    let size = queue_size(c.size_sel);
    let s = size as u64;
    g.fill(&mut fastrand::Rng::with_seed(c.fill));
    let mut r = Ring {
        size,
        desc: c.desc_at.at(&g, 16 * s, 16),
        avail: c.avail_at.at(&g, 6 + 2 * s, 2),
        used: c.used_at.at(&g, 6 + 8 * s, 4),
        next_avail: 0,
        next_used: 0,
    };
    for t in &c.tables {
        t.write(&g, size);
    }
    for b in &c.blobs {
        b.write(&g);
    }
    // The chains, then the avail ring: entries from next_avail on name them.
    let heads: Vec<u16> = c.chains.iter().map(|ch| ch.head % size).collect();
    for (ch, &h) in c.chains.iter().zip(&heads) {
        ch.shape.write(&g, r.desc, size, h);
    }
    for (i, d) in &c.patches {
        g.put(r.desc + 16 * (*i as u64 % s), &d.bytes(&g, size));
    }
    r.next_avail = match c.raw_next {
        Some(n) => n,
        None => c.avail_idx.wrapping_sub(c.behind % (size + 1)),
    };
    g.put(r.avail, &c.avail_flags.to_le_bytes());
    g.put(r.avail + 2, &c.avail_idx.to_le_bytes());
    g.put(r.avail + 4 + 2 * s, &c.avail_used_event.to_le_bytes());
    let n = c.avail_idx.wrapping_sub(r.next_avail).min(size);
    for k in 0..n {
        if heads.is_empty() {
            break;
        }
        let slot = r.next_avail.wrapping_add(k) % size;
        g.put(
            r.avail + 4 + 2 * slot as u64,
            &heads[k as usize % heads.len()].to_le_bytes(),
        );
    }
    for (slot, h) in &c.heads {
        g.put(r.avail + 4 + 2 * (*slot as u64 % s), &h.to_le_bytes());
    }
    g.put(r.used + 2, &c.used_idx.to_le_bytes());

    // The ring as the control plane starts it (vhost_user::Connection::maybe_start).
    let mut q = Queue::new(256).unwrap();
    q.set_size(size);
    q.set_desc_table_address(Some(r.desc as u32), Some((r.desc >> 32) as u32));
    q.set_avail_ring_address(Some(r.avail as u32), Some((r.avail >> 32) as u32));
    q.set_used_ring_address(Some(r.used as u32), Some((r.used >> 32) as u32));
    q.set_event_idx(c.event_idx);
    q.set_next_avail(r.next_avail);
    let Some(used_idx) = read_u16(&g, r.used + 2) else {
        fuzz::note("refused:used");
        return Outcome::Pass;
    };
    r.next_used = used_idx;
    q.set_next_used(used_idx);
    q.set_ready(true);
    if !q.is_valid(&g.mem) {
        fuzz::note("refused:invalid");
        return Outcome::Pass;
    }

    let pre = g.snapshot();
    let key = QueueKey {
        export: 0,
        queue: 0,
    };
    let limits = Limits {
        capacity_sectors: 2048,
        seg_max: 8,
        size_max: 64 * 1024,
        max_discard_sectors: 1024,
        max_write_zeroes_sectors: 1024,
        read_only: c.read_only,
    };
    let device = Arc::new(BlockDevice::new(
        "fuzz".into(),
        Disk::null(1 << 20, c.read_only, 0, true),
        limits,
        "fuzz-serial",
    ));
    e.iot.send(Command::Attach(Box::new(QueueAttach {
        key,
        queue: q,
        kick: dup_file(&e.kick),
        call: Some(dup_file(&e.kick)),
        mem: GuestMemoryAtomic::new(GuestMem::from(g.mem.clone())),
        device,
        inflight: None,
        log: None,
    })));
    let (tx, rx) = sync_channel(1);
    e.iot.send(Command::Detach { key, reply: tx });
    let next_after = match rx.recv_timeout(PASS_TIMEOUT) {
        Ok(n) => n,
        Err(RecvTimeoutError::Disconnected) => {
            e.replace_iothread();
            return Outcome::Finding("the IOThread died during the pass".into());
        }
        Err(RecvTimeoutError::Timeout) => {
            let rescued = rescue(&g, &r, used_idx, &rx);
            if !rescued {
                e.replace_iothread();
            }
            let what = format!(
                "the IOThread did not finish the pass within {PASS_TIMEOUT:?} \
                 (size {size}, next_avail {}, avail idx now {:?}{})",
                r.next_avail,
                read_u16(&g, r.avail + 2),
                if rescued {
                    ": it spun on avail idx != next_avail"
                } else {
                    ""
                }
            );
            return Outcome::Finding(what);
        }
    };
    let post = g.snapshot();
    check(&g, &r, &pre, &post, next_after)
}

/// A pass that does not end: if it is the spin of a thread that takes an
/// impossible avail idx for "nothing to pop" (pop fails, the re-arm check
/// sees avail idx != next_avail), putting an avail idx equal to next_avail
/// ends it. Tries the plausible next_avail values.
fn rescue(g: &Guarded, r: &Ring, used_before: u16, rx: &std::sync::mpsc::Receiver<u16>) -> bool {
    let done = read_u16(g, r.used + 2)
        .unwrap_or(used_before)
        .wrapping_sub(used_before);
    for k in 0..=(done as u32 + 2 * r.size as u32 + 2) {
        let cand = r.next_avail.wrapping_add(k as u16);
        g.put(r.avail + 2, &cand.to_le_bytes());
        if rx.recv_timeout(Duration::from_millis(1)).is_ok() {
            return true;
        }
    }
    false
}

/// Guest memory the device itself rewrites during a pass, with every value it
/// may have held meanwhile: the used ring's fields (virtio 1.2, 2.7.8): flags
/// (0, or NO_NOTIFY), the used idx (each step from its value before to its
/// value after), each entry (its value before or after), and with EVENT_IDX
/// avail_event (each next_avail the pass went through); and each byte of the
/// descriptor table a request's data changed (its value before or after).
fn device_fields(
    g: &Guarded,
    r: &Ring,
    pre: &Snapshot,
    post: &Snapshot,
    next_after: u16,
    used_after: u16,
) -> Vec<Field> {
    /// At most this many values of a counter (a request's data over the
    /// used idx can make the range anything).
    const MAX_STEPS: u16 = 1024;
    let both = |at: u64, len: usize| -> Vec<Vec<u8>> {
        [pre, post]
            .iter()
            .filter_map(|s| g.read(s, at, len).map(<[u8]>::to_vec))
            .collect()
    };
    let steps = |from: u16, to: u16| -> Vec<Vec<u8>> {
        let n = to.wrapping_sub(from).min(MAX_STEPS);
        (0..=n)
            .map(|k| from.wrapping_add(k).to_le_bytes().to_vec())
            .collect()
    };
    let mut fields = Vec::new();
    let mut push = |at: u64, mut values: Vec<Vec<u8>>, extra: Vec<Vec<u8>>| {
        values.extend(extra);
        if !values.is_empty() {
            fields.push(Field { at, values });
        }
    };
    push(r.used, both(r.used, 2), vec![vec![0, 0], vec![1, 0]]);
    push(
        r.used + 2,
        both(r.used + 2, 2),
        steps(r.next_used, used_after),
    );
    for k in 0..r.size as u64 {
        let at = r.used + 4 + 8 * k;
        push(at, both(at, 8), Vec::new());
    }
    let event = r.used + 4 + 8 * r.size as u64;
    push(event, both(event, 2), steps(r.next_avail, next_after));
    // Bytes of the descriptor table a request's buffer rewrote during the
    // pass: a later chain may have been read with any mix of their values
    // before and after (a data write lands on a descriptor, the device pops
    // it changed, a later write changes it again).
    let table = r.desc..r.desc + 16 * r.size as u64;
    for a in g.changed(pre, post) {
        if table.contains(&a) && !(r.used..event + 2).contains(&a) {
            push(a, both(a, 1), Vec::new());
        }
    }
    fields
}

/// The invariants on memory and the used ring after a pass.
fn check(g: &Guarded, r: &Ring, pre: &Snapshot, post: &Snapshot, next_after: u16) -> Outcome {
    let size = r.size;
    let popped = next_after.wrapping_sub(r.next_avail);
    let used_after = g
        .read(post, r.used + 2, 2)
        .map(le_u16)
        .unwrap_or(r.next_used);
    let added = used_after.wrapping_sub(r.next_used);
    let slot_of = |s: &Snapshot, i: u16| {
        g.read(s, r.avail + 4 + 2 * (i % size) as u64, 2)
            .map(le_u16)
            .unwrap_or(u16::MAX)
    };
    // The heads popped, as the avail ring said before and after the pass
    // (a request's data may have rewritten it meanwhile).
    let heads: Vec<(u16, u16)> = (0..popped.min(4 * size))
        .map(|k| {
            let i = r.next_avail.wrapping_add(k);
            (slot_of(pre, i), slot_of(post, i))
        })
        .collect();
    let fields = device_fields(g, r, pre, post, next_after, used_after);
    let mut truncated = false;
    let chains: Vec<Vec<_>> = heads
        .iter()
        .map(|&(a, b)| {
            let mut v = walk(g, pre, r.desc, size, a);
            v.extend(walk(g, post, r.desc, size, b));
            v.extend(walk(g, pre, r.desc, size, b));
            v.extend(walk(g, post, r.desc, size, a));
            // Descriptors over the used ring: the device's own writes there
            // may have changed them between the snapshots.
            for h in [a, b] {
                let (w, seen) = walk_volatile(g, &[pre, post], r.desc, size, h, &fields);
                if seen.hit {
                    fuzz::note("aliased-desc");
                    v.extend(w);
                }
                truncated |= seen.truncated;
            }
            v
        })
        .collect();
    // A slot whose bytes changed during the pass (the used ring or a
    // request's buffer over the avail ring) may have named any head when it
    // was popped: such a head matches any used id, and every chain of the
    // table counts for the write check.
    // The device's own writes to the used ring (flags when it turns kicks
    // off, idx, entries) rewrite an avail slot the used ring overlaps, then
    // put it back: such a slot is uncertain too.
    let used_end = r.used + 6 + 8 * size as u64;
    let uncertain: Vec<bool> = heads
        .iter()
        .enumerate()
        .map(|(k, &(a, b))| {
            let slot = r.avail + 4 + 2 * (r.next_avail.wrapping_add(k as u16) % size) as u64;
            a != b || (slot + 2 > r.used && slot < used_end)
        })
        .collect();
    let any_chain: Vec<_> = if uncertain.iter().any(|&u| u) {
        fuzz::note("aliased-avail");
        (0..size)
            .flat_map(|h| {
                let mut v = walk(g, pre, r.desc, size, h);
                v.extend(walk(g, post, r.desc, size, h));
                let (w, seen) = walk_volatile(g, &[pre, post], r.desc, size, h, &fields);
                if seen.hit {
                    v.extend(w);
                }
                truncated |= seen.truncated;
                v
            })
            .collect()
    } else {
        Vec::new()
    };
    fuzz::note(format!("popped:{}", popped.min(9)));
    if fuzz::replaying() {
        println!(
            "ring: desc {:#x} avail {:#x} used {:#x} size {size}",
            r.desc, r.avail, r.used
        );
        for (h, c) in heads.iter().zip(&chains) {
            println!("head {h:?}: {c:x?}");
        }
        let ch = g.changed(pre, post);
        println!("changed ({}): {:x?}", ch.len(), &ch[..ch.len().min(40)]);
    }
    if added != popped {
        // (An uncertain slot may have named a head >= size when popped.)
        let beyond = heads
            .iter()
            .zip(&uncertain)
            .any(|(&(a, b), &u)| a >= size || b >= size || u);
        // A head >= size stops the ring (broken ring): it is the last chain
        // popped, and the only one without a used entry.
        let last_beyond = heads
            .last()
            .zip(uncertain.last())
            .is_some_and(|(&(a, b), &u)| a >= size || b >= size || u);
        if added + 1 == popped && last_beyond {
            fuzz::note("broken-ring:head-beyond");
            return Outcome::Pass;
        }
        return Outcome::Finding(format!(
            "{popped} chains popped, {added} used entries added (next_avail {} -> {next_after}, \
             used idx {} -> {used_after}, size {size}, heads {heads:?}){}",
            r.next_avail,
            r.next_used,
            if beyond {
                ": a head >= queue size got no used entry"
            } else {
                ""
            }
        ));
    }
    // Every used entry is a popped head, each popped head used at most once.
    // (More than `size` completions in one pass, possible when requests'
    // data move the avail idx, overwrite each other's used entries: then
    // only the counts and the writes are checked.)
    let entries = if added > size {
        fuzz::note("popped>size");
        0
    } else {
        added
    };
    // Per head: used entries naming it, against the popped slots that may
    // have named it (before or after the pass, or rewritten during it).
    let mut used_per_head: std::collections::BTreeMap<u32, (u32, u32)> = Default::default();
    for k in 0..entries {
        let at = r.used + 4 + 8 * (r.next_used.wrapping_add(k) % size) as u64;
        let Some(b) = g.read(post, at, 8) else {
            continue;
        };
        let id = u32::from_le_bytes(b[..4].try_into().unwrap());
        let len = u32::from_le_bytes(b[4..].try_into().unwrap());
        if fuzz::replaying() {
            println!("used {k} at {at:#x}: id {id} len {len}");
        }
        // A later request's status or data may have landed on this entry (a
        // buffer over the used ring): what it says is not the device's.
        if (0..8).any(|b| {
            chains.iter().any(|c| in_writable(c, at + b, 1)) || in_writable(&any_chain, at + b, 1)
        }) {
            fuzz::note("aliased-used");
            continue;
        }
        let e = used_per_head.entry(id).or_default();
        e.0 += 1;
        e.1 = e.1.max(len);
    }
    for (&id, &(n, len)) in &used_per_head {
        let slots: Vec<usize> = (0..heads.len())
            .filter(|&j| {
                heads[j].0 as u32 == id
                    || heads[j].1 as u32 == id
                    || (uncertain[j] && id < size as u32)
            })
            .collect();
        if n as usize > slots.len() {
            return Outcome::Finding(format!(
                "head {id} has {n} used entries but was popped {} times (heads {heads:?})",
                slots.len()
            ));
        }
        let writable = slots
            .iter()
            .map(|&j| {
                let c = if uncertain[j] { &any_chain } else { &chains[j] };
                c.iter()
                    .filter(|d| d.flags & WRITE != 0)
                    .map(|d| d.len as u64)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        if len as u64 > writable {
            return Outcome::Finding(format!(
                "used length {len} of head {id} exceeds its {writable} writable bytes"
            ));
        }
    }
    // Every changed byte: the used ring, or a writable buffer of a popped chain.
    for a in g.changed(pre, post) {
        if a >= r.used && a < used_end {
            continue;
        }
        if chains.iter().any(|c| in_writable(c, a, 1)) || in_writable(&any_chain, a, 1) {
            continue;
        }
        if truncated {
            // Too many states of the descriptors to enumerate: not judged.
            fuzz::note("aliased-desc:unchecked");
            break;
        }
        return Outcome::Finding(format!(
            "byte {a:#x} changed outside the used ring and every writable descriptor \
             of the {popped} popped chains (desc {:#x}, avail {:#x}, used {:#x}, size {size})",
            r.desc, r.avail, r.used
        ));
    }
    Outcome::Pass
}

/// The bounded CI run (a few seconds); `VQBLK_FUZZ_SECONDS` makes it a long run.
#[test]
fn fuzz_queue() {
    let mut e = Engine::new();
    fuzz::run::<QueueCase, _>("queue", 10_000, |c| run_case(&mut e, c));
}

// ---- regression inputs ---------------------------------------------------

/// A ring in region 0 of layout 0 with nothing on it: avail idx = next_avail
/// = used idx = 0, queue size 16.
fn quiet_ring() -> QueueCase {
    QueueCase {
        size_sel: 0,
        layout: 0,
        behind: 0,
        raw_next: None,
        avail_idx: 0,
        chains: vec![],
        desc_at: RingAt::In {
            region: 0,
            offset: 0,
        },
        avail_at: RingAt::In {
            region: 0,
            offset: 0x1000,
        },
        used_at: RingAt::In {
            region: 0,
            offset: 0x2000,
        },
        event_idx: false,
        read_only: false,
        used_idx: 0,
        heads: vec![],
        fill: 7,
        patches: vec![],
        tables: vec![],
        blobs: vec![],
        avail_flags: 0,
        avail_used_event: 0,
    }
}

/// A flush request at head 3 (header, status), driver-like.
fn flush_at(head: u16) -> Chain {
    use fuzz::ring::{Body, Part, Placed, RType, Sector};
    let p = |part| Placed {
        part,
        at: None,
        flip: false,
    };
    Chain {
        head,
        shape: Shape::Direct {
            parts: Body::Parts(vec![
                p(Part::Header {
                    rtype: RType::Flush,
                    sector: Sector::Low(0),
                    len: None,
                }),
                p(Part::Status { len: None }),
            ]),
            cursor: fuzz::ring::Addr::In {
                region: 1,
                offset: 0,
            },
        },
    }
}

/// Two good requests pass every check (the harness itself works).
#[test]
fn regression_two_flushes_complete() {
    let mut e = Engine::new();
    let mut c = quiet_ring();
    c.avail_idx = 2;
    c.behind = 2;
    c.chains = vec![flush_at(3), flush_at(9)];
    fuzz::check_case(&c, run_case(&mut e, &c));
}

/// SET_VRING_BASE 1000 on a 16-entry ring whose avail idx is 0: the ring is
/// stopped, the IOThread does not spin on it.
#[test]
fn regression_next_avail_far_beyond_avail_idx() {
    let mut e = Engine::new();
    let mut c = quiet_ring();
    c.raw_next = Some(1000);
    fuzz::check_case(&c, run_case(&mut e, &c));
}

/// An avail entry naming head 40 on a 16-entry ring.
#[test]
fn regression_head_beyond_queue_size() {
    let mut e = Engine::new();
    let mut c = quiet_ring();
    c.avail_idx = 2;
    c.behind = 2;
    c.chains = vec![flush_at(3)];
    c.heads = vec![(1, 40)];
    fuzz::check_case(&c, run_case(&mut e, &c));
}

/// Findings of long runs kept as inputs (tests/fuzz/corpus/queue/), each
/// analysed in docs/security.md ("Fuzzing"): they must pass.
#[test]
fn regression_corpus() {
    let mut e = Engine::new();
    let cases = fuzz::corpus("queue");
    assert!(!cases.is_empty(), "tests/fuzz/corpus/queue/ is empty");
    for (name, bytes) in cases {
        let c: QueueCase = fuzz::decode(&bytes).expect(&name);
        let outcome = run_case(&mut e, &c);
        assert_eq!(outcome, Outcome::Pass, "{name}");
    }
}
