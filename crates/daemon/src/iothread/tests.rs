//! Unit tests of the queue slot and the executor over mock guest memory and
//! a split virtqueue laid out by `virtio_queue::mock::MockSplitQueue`: every
//! request type and every error path, looped over the backends, asserting the
//! used index, each used length and each status byte, and the data.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::bindings::virtio_ring::{
    VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryMmap, GuestRegionMmap};

use super::executor::{Executor, SlotId};
use super::queue::{Popped, QueueSlot};
use super::queues::{Queues, CALL_EVERY, POP_BUDGET};
use super::{
    BlockDevice, GuestMem, GuestMemHandle, InflightTracking, QueueAttach, QueueKey, QueueLog,
};
use crate::block::{Disk, FileEngine};
use crate::clock::monotonic_ns;
use crate::dirty_log::{DirtyLog, LOG_PAGE};
use crate::qos::{SharedThrottle, ThrottleConfig, ThrottleLimits};
use crate::seccomp::SeccompMode;
use crate::stats::{IoThreadStats, QueueCounters};
use crate::virtio::{req_type, status, BlkGeometry};

const QUEUE_SIZE: u16 = 64;
const MEM_SIZE: u64 = 0x40_0000;
const HDR: u64 = 0x10_0000;
const RANGE: u64 = 0x18_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x30_0000;
/// Disk size: 1 MiB, 2048 sectors.
const DISK: u64 = 1 << 20;

/// The backends every test body runs over.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Null,
    Uring,
    Threads,
}
const ALL: [Kind; 3] = [Kind::Null, Kind::Uring, Kind::Threads];
const FILES: [Kind; 2] = [Kind::Uring, Kind::Threads];

/// A descriptor: guest address, length, device-writable.
type D = (u64, u32, bool);

/// What a disk's byte `i` holds initially (file backends).
fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

#[derive(Default, Clone, Copy)]
struct Opts {
    read_only: bool,
    /// Pretend O_DIRECT with 512-byte alignment: unaligned guest buffers go
    /// through a bounce buffer.
    bounce: bool,
    latency_ns: u64,
    /// The executor's bounce-buffer cap (default 64 MiB).
    bounce_max: Option<u64>,
    /// VIRTIO_RING_F_EVENT_IDX negotiated.
    event_idx: bool,
    /// I/O limits of the export (docs/qos.md).
    throttle: Option<ThrottleLimits>,
}

/// A request pushed on the ring.
struct Req {
    head: u16,
    status: u64,
}

/// One queue slot served by an executor, over mock guest memory.
struct Rig {
    kind: Kind,
    mem: GuestMem,
    /// The map the queue reads, as the connection holds it (to replace).
    handle: GuestMemHandle,
    queues: Queues,
    exec: Executor,
    id: SlotId,
    device: Arc<BlockDevice>,
    stats: Arc<IoThreadStats>,
    counters: Arc<QueueCounters>,
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    reqs: u64,
    path: Option<PathBuf>,
    _dir: Option<tempfile::TempDir>,
}

impl Rig {
    fn new(kind: Kind) -> Rig {
        Rig::with(kind, Opts::default())
    }

    fn with(kind: Kind, o: Opts) -> Rig {
        Rig::tracked(kind, o, None)
    }

    /// A rig whose queue is tracked in an inflight region.
    fn tracked(kind: Kind, o: Opts, inflight: Option<InflightTracking>) -> Rig {
        let mem = GuestMem::from(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap(),
        );
        let vq = MockSplitQueue::new(&mem, QUEUE_SIZE);
        let mut queue: Queue = vq.create_queue().unwrap();
        // MockSplitQueue lays out the used ring 0x44 bytes after the avail
        // ring, whatever the queue size: with 64 entries the used ring's
        // header would overlap avail entries 32 and up. Own, roomy places.
        let (desc, avail, used) = (vq.desc_table_addr().0, 0x8000u64, 0x9000u64);
        queue.set_avail_ring_address(Some(avail as u32), Some(0));
        queue.set_used_ring_address(Some(used as u32), Some(0));
        queue.set_event_idx(o.event_idx);
        let (mut disk, dir, path) = match kind {
            Kind::Null => (
                Disk::null(DISK, o.read_only, o.latency_ns, true),
                None,
                None,
            ),
            Kind::Uring | Kind::Threads => {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("disk.raw");
                let data: Vec<u8> = (0..DISK).map(pattern).collect();
                std::fs::write(&path, data).unwrap();
                let engine = if kind == Kind::Uring {
                    FileEngine::IoUring
                } else {
                    FileEngine::Threads
                };
                let disk = Disk::open(&path, engine, false, o.read_only, None).unwrap();
                (disk, Some(dir), Some(path))
            }
        };
        // Only a file can be opened with O_DIRECT: a null disk has nothing
        // to bounce for.
        if let (true, Disk::File(f)) = (o.bounce, &mut disk) {
            f.direct_align = Some(512);
        }
        let geometry = BlkGeometry {
            capacity_sectors: DISK / 512,
            blk_size: 512,
            physical_block_exp: 0,
            size_max: 64 * 1024,
            seg_max: 8,
            num_queues: 1,
            max_discard_sectors: 1024,
            max_write_zeroes_sectors: 1024,
            write_zeroes_may_unmap: true,
            read_only: o.read_only,
        };
        let device = Arc::new(BlockDevice::new(
            "t".into(),
            disk,
            geometry.limits(),
            "vqblk-serial",
        ));
        device.set_throttle(o.throttle.map(|l| Arc::new(SharedThrottle::new(l))));
        let stats = Arc::new(IoThreadStats::new("test".into()));
        let counters = stats.queue("t", 0);
        let handle = GuestMemoryAtomic::new(mem.clone());
        let attach = QueueAttach {
            key: QueueKey {
                export: 0,
                queue: 0,
            },
            queue,
            kick: File::open("/dev/null").unwrap(),
            call: Some(File::options().write(true).open("/dev/null").unwrap()),
            mem: handle.clone(),
            device: device.clone(),
            inflight,
            log: None,
        };
        let mut queues = Queues::new(stats.clone());
        let mut exec = Executor::new(
            "test".into(),
            o.bounce_max.unwrap_or(64 << 20),
            SeccompMode::Off,
        );
        // As `IoThread::attach` does.
        exec.reserve(usize::from(attach.queue.size()));
        let id = queues.insert(QueueSlot::new(attach, counters.clone()));
        Rig {
            kind,
            mem,
            handle,
            queues,
            exec,
            id,
            device,
            stats,
            counters,
            desc,
            avail,
            used,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
            reqs: 0,
            path,
            _dir: dir,
        }
    }

    /// Puts a descriptor chain on the ring; returns its head index.
    fn chain(&mut self, descs: &[D]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let idx = (head + i as u16) % QUEUE_SIZE;
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            let next = (idx + 1) % QUEUE_SIZE;
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let at = self.desc + 16 * idx as u64;
            self.mem.write_obj(addr, GuestAddress(at)).unwrap();
            self.mem.write_obj(len, GuestAddress(at + 8)).unwrap();
            self.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
            self.mem.write_obj(next, GuestAddress(at + 14)).unwrap();
        }
        self.next_desc = (head + descs.len() as u16) % QUEUE_SIZE;
        let slot = self.avail + 4 + 2 * (self.avail_idx % QUEUE_SIZE) as u64;
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
        head
    }

    /// `n` 4 KiB reads made available at once (as a driver at QD`n`): read
    /// `i` at sector `8 i` into its own page from `DATA` on.
    fn push_reads(&mut self, n: u64) -> Vec<Req> {
        (0..n)
            .map(|i| self.push(req_type::IN, i * 8, &[(DATA + i * 0x1000, 4096, true)]))
            .collect()
    }

    /// Delivers what the backend finished, waiting for it, until nothing is
    /// in flight (or 5 s), each round at the time `now` gives.
    fn deliver_all(&mut self, mut now: impl FnMut() -> u64) {
        for _ in 0..5000 {
            self.queues.deliver(&mut self.exec, now());
            if self.queues.inflight() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A request of type `rtype` at `sector` with the given data descriptors
    /// between its header and its status byte.
    fn push(&mut self, rtype: u32, sector: u64, data: &[D]) -> Req {
        let k = self.reqs;
        self.reqs += 1;
        let (hdr, st) = (HDR + 16 * k, STATUS + k);
        self.header(hdr, rtype, sector);
        let mut descs = vec![(hdr, 16, false)];
        descs.extend_from_slice(data);
        descs.push((st, 1, true));
        Req {
            head: self.chain(&descs),
            status: st,
        }
    }

    fn header(&self, at: u64, rtype: u32, sector: u64) {
        self.mem.write_obj(rtype, GuestAddress(at)).unwrap();
        self.mem.write_obj(0u32, GuestAddress(at + 4)).unwrap();
        self.mem.write_obj(sector, GuestAddress(at + 8)).unwrap();
        // Not a status value: shows whether the device wrote the status.
        self.mem
            .write_obj(0xffu8, GuestAddress(STATUS + self.reqs - 1))
            .unwrap();
    }

    /// A discard / write-zeroes request over `num` sectors from `sector`.
    fn push_range(&mut self, rtype: u32, sector: u64, num: u32, flags: u32) -> Req {
        let at = RANGE + 16 * self.reqs;
        self.mem.write_obj(sector, GuestAddress(at)).unwrap();
        self.mem.write_obj(num, GuestAddress(at + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        self.push(rtype, 0, &[(at, 16, false)])
    }

    /// Pops and executes everything available, waits for the backend, and
    /// returns the used-ring entries (id, len) added meanwhile.
    fn run(&mut self) -> Vec<(u32, u32)> {
        while self
            .queues
            .process(self.id, &mut self.exec, true, monotonic_ns())
            == Popped::More
        {}
        self.deliver_all(monotonic_ns);
        assert_eq!(
            self.queues.inflight(),
            0,
            "{:?}: requests still in flight",
            self.kind
        );
        assert_eq!(self.exec.inflight(), 0);
        self.queues.notify(&mut Vec::new());
        let idx: u16 = self.mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let at = self.used + 4 + 8 * (self.used_seen % QUEUE_SIZE) as u64;
            let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// Runs exactly one request and checks its used entry and status byte.
    /// Pops every available request as a pass does, but never reaps: what
    /// a backend finishes stays in flight (and its resources held) until
    /// `run`, where a pass would hand it back after the next pop.
    fn pop_without_reaping(&mut self) {
        let mem = self.queues.get(self.id).unwrap().memory();
        let q = self.queues.get_mut(self.id).unwrap();
        let now = monotonic_ns();
        while q.process(self.id, &mut self.exec, true, now, &mem, POP_BUDGET) == Popped::HandBack {}
    }

    fn run_one(&mut self, r: &Req, used_len: u32, st: u8) {
        let used = self.run();
        assert_eq!(used, vec![(r.head as u32, used_len)], "{:?}", self.kind);
        assert_eq!(self.status(r), st, "{:?}", self.kind);
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    fn status(&self, r: &Req) -> u8 {
        self.mem.read_obj(GuestAddress(r.status)).unwrap()
    }

    fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn fill(&self, addr: u64, data: &[u8]) {
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
    }

    /// What the disk holds at `offset` (None: the null backend holds nothing).
    fn disk(&self, offset: u64, len: usize) -> Option<Vec<u8>> {
        let data = std::fs::read(self.path.as_ref()?).unwrap();
        Some(data[offset as usize..offset as usize + len].to_vec())
    }

    /// Takes the queue out of the rig, as a source IOThread hands it over
    /// (`QueueSlot::into_attach`), with a real eventfd as its kick fd so that
    /// an IOThread can watch it; returns the attach and a handle to kick with.
    fn take_attach(&mut self) -> (QueueAttach, File) {
        let slot = self.queues.remove(self.id).expect("the rig's queue");
        let mut a = slot.into_attach();
        // SAFETY: eventfd takes two integers and returns a new fd or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) };
        assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a new descriptor owned by nobody else.
        a.kick = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let kick = a.kick.try_clone().unwrap();
        (a, kick)
    }

    /// What a read of `offset` must return.
    fn expected(&self, offset: u64, len: usize) -> Vec<u8> {
        self.disk(offset, len).unwrap_or_else(|| vec![0; len])
    }
}

#[test]
fn read_returns_the_disk_contents() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.fill(DATA, &[0xee; 4096]);
        let q = r.push(req_type::IN, 8, &[(DATA, 4096, true)]);
        r.run_one(&q, 4096 + 1, status::OK);
        assert_eq!(r.read(DATA, 4096), r.expected(8 * 512, 4096), "{kind:?}");
        assert_eq!(r.used_idx(), 1);
        assert_eq!(r.counters.reads.get(), 1);
        assert_eq!(r.counters.bytes_read.get(), 4096);
    }
}

#[test]
fn read_scatters_over_several_descriptors() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let data = [
            (DATA, 512, true),
            (DATA + 0x1000, 1024, true),
            (DATA + 0x3000, 512, true),
        ];
        let q = r.push(req_type::IN, 3, &data);
        r.run_one(&q, 2048 + 1, status::OK);
        let want = r.expected(3 * 512, 2048);
        assert_eq!(r.read(DATA, 512), want[..512], "{kind:?}");
        assert_eq!(r.read(DATA + 0x1000, 1024), want[512..1536]);
        assert_eq!(r.read(DATA + 0x3000, 512), want[1536..]);
    }
}

#[test]
fn write_lands_on_the_disk_and_reads_back() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.fill(DATA, &[0x5a; 1024]);
        let w = r.push(req_type::OUT, 100, &[(DATA, 1024, false)]);
        // A write reports no data bytes: used length is the status byte only.
        r.run_one(&w, 1, status::OK);
        if let Some(d) = r.disk(100 * 512, 1024) {
            assert_eq!(d, vec![0x5a; 1024], "{kind:?}");
        }
        let rd = r.push(req_type::IN, 100, &[(DATA + 0x10000, 1024, true)]);
        r.run_one(&rd, 1025, status::OK);
        let want = if kind == Kind::Null { 0 } else { 0x5a };
        assert_eq!(r.read(DATA + 0x10000, 1024), vec![want; 1024]);
        assert_eq!(r.counters.writes.get(), 1);
        assert_eq!(r.counters.bytes_written.get(), 1024);
    }
}

#[test]
fn write_gathers_header_and_data_from_one_descriptor() {
    // VIRTIO_F_ANY_LAYOUT: header and data in the same buffer.
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.header(DATA, req_type::OUT, 4);
        r.fill(DATA + 16, &[7; 512]);
        r.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let head = r.chain(&[(DATA, 16 + 512, false), (STATUS, 1, true)]);
        let q = Req {
            head,
            status: STATUS,
        };
        r.run_one(&q, 1, status::OK);
        if let Some(d) = r.disk(4 * 512, 512) {
            assert_eq!(d, vec![7; 512], "{kind:?}");
        }
    }
}

#[test]
fn writethrough_writes_complete_and_land() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.device.set_writethrough(true);
        r.fill(DATA, &[0x11; 512]);
        let w = r.push(req_type::OUT, 0, &[(DATA, 512, false)]);
        r.run_one(&w, 1, status::OK);
        if let Some(d) = r.disk(0, 512) {
            assert_eq!(d, vec![0x11; 512], "{kind:?}");
        }
    }
}

#[test]
fn flush_succeeds_with_status_only() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let q = r.push(req_type::FLUSH, 0, &[]);
        r.run_one(&q, 1, status::OK);
        assert_eq!(r.counters.flushes.get(), 1, "{kind:?}");
    }
}

#[test]
fn flush_of_a_read_only_export_succeeds() {
    for kind in ALL {
        let mut r = Rig::with(
            kind,
            Opts {
                read_only: true,
                ..Opts::default()
            },
        );
        let q = r.push(req_type::FLUSH, 0, &[]);
        r.run_one(&q, 1, status::OK);
    }
}

#[test]
fn get_id_is_answered_by_the_device_model() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.fill(DATA, &[0xcc; 32]);
        let q = r.push(req_type::GET_ID, 0, &[(DATA, 32, true)]);
        // Answered without the backend: finished in the pass that pops it,
        // nothing to reap.
        r.queues.process(r.id, &mut r.exec, true, monotonic_ns());
        r.queues.deliver(&mut r.exec, monotonic_ns());
        assert_eq!(r.exec.inflight(), 0);
        assert_eq!(r.run(), vec![(q.head as u32, 20 + 1)]);
        assert_eq!(r.used_idx(), 1);
        assert_eq!(r.status(&q), status::OK);
        let mut want = b"vqblk-serial".to_vec();
        want.resize(20, 0);
        assert_eq!(r.read(DATA, 20), want, "{kind:?}");
        // Past the 20 bytes, the guest buffer is untouched.
        assert_eq!(r.read(DATA + 20, 12), vec![0xcc; 12]);
        assert_eq!(r.counters.other.get(), 1);
    }
}

#[test]
fn get_id_into_a_short_buffer_writes_what_fits() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let q = r.push(req_type::GET_ID, 0, &[(DATA, 8, true)]);
        r.run_one(&q, 8 + 1, status::OK);
        assert_eq!(r.read(DATA, 8), b"vqblk-se");
    }
}

#[test]
fn discard_deallocates_and_reads_back_zeroes() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let q = r.push_range(req_type::DISCARD, 8, 8, 0);
        r.run_one(&q, 1, status::OK);
        if let Some(d) = r.disk(8 * 512, 4096) {
            assert_eq!(d, vec![0; 4096], "{kind:?}");
            // Only the range.
            assert_eq!(
                r.disk(16 * 512, 512).unwrap(),
                (16 * 512..17 * 512).map(pattern).collect::<Vec<_>>()
            );
        }
        assert_eq!(r.counters.other.get(), 1);
    }
}

#[test]
fn write_zeroes_zeroes_the_range() {
    for unmap in [0, 1] {
        for kind in ALL {
            let mut r = Rig::new(kind);
            let q = r.push_range(req_type::WRITE_ZEROES, 1, 3, unmap);
            r.run_one(&q, 1, status::OK);
            if let Some(d) = r.disk(0, 5 * 512) {
                assert_eq!(d[..512], (0..512).map(pattern).collect::<Vec<_>>()[..]);
                assert_eq!(d[512..2048], vec![0; 1536][..], "{kind:?} unmap={unmap}");
                assert_eq!(d[2048..], (2048..2560).map(pattern).collect::<Vec<_>>()[..]);
            }
        }
    }
}

#[test]
fn discard_with_unmap_or_reserved_flags_is_unsupp() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let a = r.push_range(req_type::DISCARD, 0, 8, 1);
        let b = r.push_range(req_type::WRITE_ZEROES, 0, 8, 2);
        assert_eq!(
            r.run(),
            vec![(a.head as u32, 1), (b.head as u32, 1)],
            "{kind:?}"
        );
        assert_eq!(
            (r.status(&a), r.status(&b)),
            (status::UNSUPP, status::UNSUPP)
        );
        // Nothing was zeroed.
        if let Some(d) = r.disk(0, 4096) {
            assert_eq!(d, (0..4096).map(pattern).collect::<Vec<_>>());
        }
    }
}

#[test]
fn discard_of_zero_sectors_or_two_ranges_is_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let a = r.push_range(req_type::DISCARD, 0, 0, 0);
        let b = r.push(req_type::DISCARD, 0, &[(RANGE + 0x1000, 32, false)]);
        let used = r.run();
        assert_eq!(
            used,
            vec![(a.head as u32, 1), (b.head as u32, 1)],
            "{kind:?}"
        );
        assert_eq!((r.status(&a), r.status(&b)), (status::IOERR, status::IOERR));
    }
}

#[test]
fn unknown_request_type_is_unsupp() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let q = r.push(99, 0, &[]);
        r.run_one(&q, 1, status::UNSUPP);
        assert_eq!(r.counters.errors.get(), 1);
        assert_eq!(r.stats.errors.get(), 1);
    }
}

#[test]
fn chain_without_a_writable_byte_is_used_with_length_zero() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.header(HDR, req_type::IN, 0);
        let head = r.chain(&[(HDR, 16, false)]);
        let used = r.run();
        // Returned to the guest (so it is not leaked), nothing written.
        assert_eq!(used, vec![(head as u32, 0)], "{kind:?}");
        assert_eq!(r.counters.errors.get(), 1);
    }
}

#[test]
fn status_descriptor_wrapping_the_address_space_is_never_written() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.header(HDR, req_type::IN, 0);
        r.fill(0xfff, &[0xab]);
        let status = (u64::MAX - 0xfff, 0x2000, true);
        let head = r.chain(&[(HDR, 16, false), (DATA, 512, true), status]);
        assert_eq!(r.run(), vec![(head as u32, 0)], "{kind:?}");
        // The wrapped "last byte" (0xfff) is left alone.
        assert_eq!(r.read(0xfff, 1), vec![0xab]);
    }
}

#[test]
fn readable_descriptor_after_the_status_is_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.header(HDR, req_type::IN, 0);
        let head = r.chain(&[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, false)]);
        // The status goes to the last writable byte there is.
        assert_eq!(r.run(), vec![(head as u32, 1)], "{kind:?}");
        assert_eq!(r.read(DATA + 511, 1), vec![status::IOERR]);
    }
}

#[test]
fn short_header_is_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.header(HDR, req_type::IN, 0);
        r.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let head = r.chain(&[(HDR, 8, false), (STATUS, 1, true)]);
        let q = Req {
            head,
            status: STATUS,
        };
        r.run_one(&q, 1, status::IOERR);
    }
}

#[test]
fn data_in_the_wrong_direction_is_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let a = r.push(req_type::IN, 0, &[(DATA, 512, false)]);
        let b = r.push(req_type::OUT, 0, &[(DATA, 512, true)]);
        let c = r.push(req_type::GET_ID, 0, &[(DATA, 20, false)]);
        let used = r.run();
        let want: Vec<_> = [&a, &b, &c].iter().map(|q| (q.head as u32, 1)).collect();
        assert_eq!(used, want, "{kind:?}");
        for q in [&a, &b, &c] {
            assert_eq!(r.status(q), status::IOERR);
        }
    }
}

#[test]
fn length_not_a_multiple_of_512_is_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.fill(DATA, &[0xee; 1000]);
        let q = r.push(req_type::IN, 0, &[(DATA, 1000, true)]);
        r.run_one(&q, 1, status::IOERR);
        // Nothing was read into the buffer.
        assert_eq!(r.read(DATA, 1000), vec![0xee; 1000], "{kind:?}");
    }
}

#[test]
fn too_many_or_too_large_segments_are_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let many: Vec<D> = (0..9).map(|i| (DATA + i * 0x1000, 512, true)).collect();
        let a = r.push(req_type::IN, 0, &many);
        let b = r.push(req_type::IN, 0, &[(DATA, 128 * 1024, true)]);
        assert_eq!(
            r.run(),
            vec![(a.head as u32, 1), (b.head as u32, 1)],
            "{kind:?}"
        );
        assert_eq!((r.status(&a), r.status(&b)), (status::IOERR, status::IOERR));
    }
}

#[test]
fn out_of_range_sectors_are_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let last = DISK / 512 - 1;
        let a = r.push(req_type::IN, last, &[(DATA, 1024, true)]);
        let b = r.push(req_type::OUT, u64::MAX, &[(DATA, 512, false)]);
        let c = r.push_range(req_type::WRITE_ZEROES, last, 2, 0);
        let d = r.push(req_type::IN, last, &[(DATA, 512, true)]);
        let used = r.run();
        assert_eq!(
            used,
            vec![
                (a.head as u32, 1),
                (b.head as u32, 1),
                (c.head as u32, 1),
                (d.head as u32, 513)
            ],
            "{kind:?}"
        );
        for q in [&a, &b, &c] {
            assert_eq!(r.status(q), status::IOERR);
        }
        // The last sector itself is in range.
        assert_eq!(r.status(&d), status::OK);
    }
}

#[test]
fn writes_to_a_read_only_export_are_ioerr_and_leave_the_disk_alone() {
    for kind in ALL {
        let mut r = Rig::with(
            kind,
            Opts {
                read_only: true,
                ..Opts::default()
            },
        );
        r.fill(DATA, &[0x77; 512]);
        let a = r.push(req_type::OUT, 0, &[(DATA, 512, false)]);
        let b = r.push_range(req_type::DISCARD, 0, 8, 0);
        let c = r.push_range(req_type::WRITE_ZEROES, 0, 8, 0);
        let d = r.push(req_type::IN, 0, &[(DATA + 0x1000, 512, true)]);
        let used = r.run();
        assert_eq!(
            used,
            vec![
                (a.head as u32, 1),
                (b.head as u32, 1),
                (c.head as u32, 1),
                (d.head as u32, 513)
            ],
            "{kind:?}"
        );
        for q in [&a, &b, &c] {
            assert_eq!(r.status(q), status::IOERR);
        }
        assert_eq!(r.status(&d), status::OK);
        if let Some(data) = r.disk(0, 4096) {
            assert_eq!(data, (0..4096).map(pattern).collect::<Vec<_>>());
        }
    }
}

#[test]
fn data_buffer_outside_guest_memory_is_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let a = r.push(req_type::IN, 0, &[(MEM_SIZE - 256, 512, true)]);
        let b = r.push(req_type::OUT, 0, &[(MEM_SIZE + 0x1000, 512, false)]);
        assert_eq!(
            r.run(),
            vec![(a.head as u32, 1), (b.head as u32, 1)],
            "{kind:?}"
        );
        assert_eq!((r.status(&a), r.status(&b)), (status::IOERR, status::IOERR));
        assert_eq!(r.exec.inflight(), 0);
    }
}

#[test]
fn get_id_outside_guest_memory_is_ioerr() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let q = r.push(req_type::GET_ID, 0, &[(MEM_SIZE + 0x1000, 20, true)]);
        r.run_one(&q, 1, status::IOERR);
    }
}

#[test]
fn unaligned_reads_go_through_a_bounce_buffer() {
    for kind in ALL {
        let mut r = Rig::with(
            kind,
            Opts {
                bounce: true,
                ..Opts::default()
            },
        );
        r.fill(DATA, &[0xee; 4096]);
        // Misaligned start, and a 512-byte segment split 100 + 412.
        let q = r.push(
            req_type::IN,
            2,
            &[
                (DATA + 1, 512, true),
                (DATA + 0x1000, 100, true),
                (DATA + 0x2000 + 3, 412, true),
            ],
        );
        r.run_one(&q, 1024 + 1, status::OK);
        let want = r.expected(2 * 512, 1024);
        assert_eq!(r.read(DATA + 1, 512), want[..512], "{kind:?}");
        assert_eq!(r.read(DATA + 0x1000, 100), want[512..612]);
        assert_eq!(r.read(DATA + 0x2000 + 3, 412), want[612..]);
        // Bytes around the buffers are untouched.
        assert_eq!(r.read(DATA, 1), vec![0xee]);
        assert_eq!(r.read(DATA + 513, 1), vec![0xee]);
    }
}

#[test]
fn unaligned_writes_go_through_a_bounce_buffer() {
    for kind in ALL {
        let mut r = Rig::with(
            kind,
            Opts {
                bounce: true,
                ..Opts::default()
            },
        );
        r.fill(DATA + 7, &[0x42; 300]);
        r.fill(DATA + 0x1000 + 5, &[0x43; 212]);
        let w = r.push(
            req_type::OUT,
            10,
            &[(DATA + 7, 300, false), (DATA + 0x1000 + 5, 212, false)],
        );
        r.run_one(&w, 1, status::OK);
        if let Some(d) = r.disk(10 * 512, 512) {
            assert_eq!(d[..300], [0x42; 300][..], "{kind:?}");
            assert_eq!(d[300..], [0x43; 212][..]);
        }
    }
}

#[test]
fn aligned_buffers_with_direct_io_are_used_in_place() {
    for kind in ALL {
        let mut r = Rig::with(
            kind,
            Opts {
                bounce: true,
                ..Opts::default()
            },
        );
        let q = r.push(req_type::IN, 0, &[(DATA, 4096, true)]);
        r.run_one(&q, 4097, status::OK);
        assert_eq!(r.read(DATA, 4096), r.expected(0, 4096), "{kind:?}");
    }
}

#[test]
fn read_past_the_end_of_a_shrunk_image_is_ioerr() {
    for kind in FILES {
        let mut r = Rig::new(kind);
        // The image shrank under the daemon: its size is still 1 MiB.
        File::options()
            .write(true)
            .open(r.path.as_ref().unwrap())
            .unwrap()
            .set_len(4096)
            .unwrap();
        let ok = r.push(req_type::IN, 0, &[(DATA, 4096, true)]);
        let past = r.push(req_type::IN, 16, &[(DATA + 0x1000, 4096, true)]);
        // Partly there: the short transfer is continued, then hits the end.
        let partly = r.push(req_type::IN, 4, &[(DATA + 0x2000, 4096, true)]);
        let used = r.run();
        assert_eq!(
            used.iter().map(|u| u.0).collect::<Vec<_>>().len(),
            3,
            "{kind:?}"
        );
        let len_of = |q: &Req| used.iter().find(|u| u.0 == q.head as u32).unwrap().1;
        assert_eq!((len_of(&ok), r.status(&ok)), (4097, status::OK));
        assert_eq!((len_of(&past), r.status(&past)), (1, status::IOERR));
        assert_eq!((len_of(&partly), r.status(&partly)), (1, status::IOERR));
        assert_eq!(r.counters.errors.get(), 2);
        assert_eq!(r.counters.bytes_read.get(), 4096);
    }
}

#[test]
fn write_to_a_file_opened_read_only_fails_in_the_backend() {
    // The export says writable but the file refuses writes: the backend's
    // error (EBADF) becomes IOERR.
    for kind in FILES {
        let mut r = Rig::new(kind);
        let path = r.path.clone().unwrap();
        let Disk::File(f) = &r.device.disk else {
            panic!("{kind:?} is not a file disk")
        };
        let ro = Disk::open(&path, f.engine, false, true, None).unwrap();
        let dev = BlockDevice::new("t".into(), ro, r.device.limits, "s");
        r.queues.get_mut(r.id).unwrap().device = Arc::new(dev);
        r.fill(DATA, &[1; 512]);
        let w = r.push(req_type::OUT, 0, &[(DATA, 512, false)]);
        r.run_one(&w, 1, status::IOERR);
        assert_eq!(
            r.disk(0, 512).unwrap(),
            (0..512).map(pattern).collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_batch_completes_every_request_in_one_pass() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let reqs = r.push_reads(8);
        let used = r.run();
        assert_eq!(used.len(), 8, "{kind:?}");
        for q in &reqs {
            assert!(used.contains(&(q.head as u32, 4097)));
            assert_eq!(r.status(q), status::OK);
        }
        assert_eq!(r.used_idx(), 8);
        // Null requests are finished when popped: handed back after each
        // pop, a call every CALL_EVERY pops (no EVENT_IDX here: each asked
        // call is sent). The thread pool, and io_uring (whose first requests
        // go to the kernel at once: `uring::SUBMIT_AT_ONCE_BELOW`), may have
        // finished some by any pop: a call every CALL_EVERY pops handed
        // back, then the end of the pass.
        let calls = r.stats.notifications.get();
        match kind {
            Kind::Null => assert_eq!(calls, (8 / CALL_EVERY) as u64),
            Kind::Uring | Kind::Threads => assert!(
                (1..=1 + 8 / CALL_EVERY as u64).contains(&calls),
                "{kind:?}: {calls}"
            ),
        }
        assert_eq!(r.stats.requests.get(), 8);
        for (i, _) in reqs.iter().enumerate() {
            let i = i as u64;
            assert_eq!(
                r.read(DATA + i * 0x1000, 4096),
                r.expected(i * 8 * 512, 4096)
            );
        }
    }
}

#[test]
fn a_pass_publishes_each_finished_request_before_the_next_pop() {
    // 16 requests made available at once, as a driver at QD16 does: the null
    // backend has each done when it is popped, and one pass publishes each
    // before it pops the next (15 publishes: the last one has no next, and
    // the end of the pass publishes it), with a call every CALL_EVERY pops
    // (no EVENT_IDX here: each asked call is sent), the driver's used ring
    // filling while the pass goes on. io_uring's first requests go to
    // the kernel at once (`uring::SUBMIT_AT_ONCE_BELOW`): on the test's file
    // they may be done by a later pop, and what a hand-back finds done is
    // published during the pass.
    for kind in [Kind::Null, Kind::Uring] {
        let mut r = Rig::new(kind);
        r.push_reads(16);
        assert_eq!(
            r.queues.process(r.id, &mut r.exec, true, monotonic_ns()),
            Popped::Drained
        );
        assert_eq!(r.stats.popped.get(), 16, "{kind:?}");
        let early = r.used_idx();
        let calls = r.stats.notifications.get();
        match kind {
            Kind::Null => {
                assert_eq!(early, 15, "published during the pass");
                assert_eq!(r.stats.used_batches.get(), 15, "one publish per pop");
                assert_eq!(calls, 15 / CALL_EVERY as u64);
            }
            // Each call published something.
            _ => assert!(calls <= u64::from(early), "{kind:?}: {calls} calls"),
        }
        assert_eq!(r.run().len(), 16);
    }
}

#[test]
fn a_lone_request_is_handed_back_by_the_end_of_the_pass() {
    // At QD1 nothing follows the request popped. A hand-back would publish
    // it, pop again only to find nothing, and the call would wait for that
    // round: the pop loop stops instead, and the end of the pass publishes
    // and calls.
    let mut r = Rig::new(Kind::Null);
    let reqs = r.push_reads(1);
    assert_eq!(
        r.queues.process(r.id, &mut r.exec, true, monotonic_ns()),
        Popped::Drained
    );
    assert_eq!(r.stats.popped.get(), 1);
    assert_eq!(r.used_idx(), 0, "not handed back inside the pass");
    assert_eq!(r.stats.used_batches.get(), 0);
    assert_eq!(r.run(), vec![(reqs[0].head as u32, 4097)]);
    assert_eq!(r.status(&reqs[0]), status::OK);
}

#[test]
fn good_and_bad_requests_interleaved_each_get_their_own_status() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let a = r.push(req_type::IN, 0, &[(DATA, 512, true)]);
        let b = r.push(99, 0, &[]);
        let c = r.push(req_type::IN, DISK / 512, &[(DATA + 0x1000, 512, true)]);
        let d = r.push(req_type::FLUSH, 0, &[]);
        let e = r.push(req_type::GET_ID, 0, &[(DATA + 0x2000, 20, true)]);
        let used = r.run();
        assert_eq!(used.len(), 5, "{kind:?}");
        let want = [
            (&a, 513, status::OK),
            (&b, 1, status::UNSUPP),
            (&c, 1, status::IOERR),
            (&d, 1, status::OK),
            (&e, 21, status::OK),
        ];
        for (q, len, st) in want {
            assert!(used.contains(&(q.head as u32, len)), "{kind:?} {used:?}");
            assert_eq!(r.status(q), st);
        }
        assert_eq!(r.counters.requests.get(), 5);
        assert_eq!(r.counters.errors.get(), 2);
        assert_eq!(r.counters.reads.get(), 1);
        assert_eq!(r.counters.flushes.get(), 1);
    }
}

#[test]
fn in_flight_slots_are_reused_across_passes() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        for round in 0..4u64 {
            let qs: Vec<Req> = (0..4)
                .map(|i| {
                    r.push(
                        req_type::IN,
                        round * 4 + i,
                        &[(DATA + i * 0x1000, 512, true)],
                    )
                })
                .collect();
            let used = r.run();
            assert_eq!(used.len(), 4, "{kind:?} round {round}");
            for q in &qs {
                assert_eq!(r.status(q), status::OK);
            }
        }
        assert_eq!(r.used_idx(), 16);
        assert_eq!(r.exec.inflight(), 0);
    }
}

/// A request's latency runs from its pop to the publish of its used entry.
/// Both are stamped with the pass's clock while requests only go to the null
/// backend (no clock read per request), and with the clock read again once
/// another backend was handed one: an io_uring pass that pops, submits and
/// finishes requests within itself must not time them at 0.
#[test]
fn requests_finished_within_their_pass_are_timed_past_its_clock() {
    for kind in [Kind::Null, Kind::Uring] {
        let mut r = Rig::new(kind);
        r.push_reads(16);
        // One pass: every stamp it makes on its own clock is `now`.
        let now = monotonic_ns();
        r.queues.process(r.id, &mut r.exec, true, now);
        r.deliver_all(|| now);
        assert_eq!(r.queues.inflight(), 0, "{kind:?}");
        let latency = r.counters.latency.snapshot();
        assert_eq!(latency.buckets.iter().sum::<u64>(), 16, "{kind:?}");
        match kind {
            Kind::Null => assert_eq!(latency.sum_ns, 0, "null: the pass's clock only"),
            _ => assert!(
                latency.sum_ns > 0,
                "{kind:?}: requests popped and finished in one pass timed at 0"
            ),
        }
    }
}

#[test]
fn null_latency_delays_completion() {
    let mut r = Rig::with(
        Kind::Null,
        Opts {
            latency_ns: 20_000_000,
            ..Opts::default()
        },
    );
    let q = r.push(req_type::IN, 0, &[(DATA, 512, true)]);
    let t = Instant::now();
    r.queues.process(r.id, &mut r.exec, true, monotonic_ns());
    r.queues.deliver(&mut r.exec, monotonic_ns());
    if t.elapsed() < Duration::from_millis(15) {
        assert_eq!(r.used_idx(), 0);
        assert_eq!(r.exec.inflight(), 1);
    }
    let mut fds = Vec::new();
    r.exec.take_new_notify_fds(&mut fds);
    assert_eq!(fds.len(), 1, "the null engine's timer is watched");
    r.run_one(&q, 513, status::OK);
    assert!(t.elapsed() >= Duration::from_millis(20));
}

/// With a null latency a read waits on its engine while a flush finishes
/// when it is submitted: the flush's completion, handed back right away,
/// must not make the executor forget the read (it commits and reaps only
/// while an operation is on an engine).
#[test]
fn a_request_finished_at_once_does_not_strand_one_still_on_its_engine() {
    let mut r = Rig::with(
        Kind::Null,
        Opts {
            latency_ns: 20_000_000,
            ..Opts::default()
        },
    );
    let read = r.push(req_type::IN, 0, &[(DATA, 512, true)]);
    let flush = r.push(req_type::FLUSH, 0, &[]);
    let used = r.run();
    assert_eq!(
        used,
        vec![(flush.head as u32, 1), (read.head as u32, 513)],
        "the flush first, then the read when due"
    );
    assert_eq!(r.status(&read), status::OK);
    assert_eq!(r.status(&flush), status::OK);
}

#[test]
fn backends_report_their_completion_fd_once() {
    for kind in FILES {
        let mut r = Rig::new(kind);
        let mut fds = Vec::new();
        r.exec.take_new_notify_fds(&mut fds);
        assert!(fds.is_empty(), "created on first use");
        let q = r.push(req_type::FLUSH, 0, &[]);
        r.run_one(&q, 1, status::OK);
        r.exec.take_new_notify_fds(&mut fds);
        assert_eq!(fds.len(), 1, "{kind:?}");
        let q = r.push(req_type::FLUSH, 0, &[]);
        r.run_one(&q, 1, status::OK);
        r.exec.take_new_notify_fds(&mut fds);
        assert_eq!(fds.len(), 1);
    }
}

#[test]
fn polling_keeps_kicks_off_and_sleeping_turns_them_on() {
    let mut r = Rig::new(Kind::Null);
    let flags = |r: &Rig| -> u16 { r.mem.read_obj(GuestAddress(r.used)).unwrap() };
    let q = r.push(req_type::FLUSH, 0, &[]);
    assert!(r.queues.get(r.id).unwrap().has_avail(&r.mem));
    // Polling: popped with notifications left off.
    r.queues.process(r.id, &mut r.exec, false, monotonic_ns());
    assert_eq!(
        flags(&r) & VRING_USED_F_NO_NOTIFY as u16,
        VRING_USED_F_NO_NOTIFY as u16
    );
    assert!(!r.queues.get(r.id).unwrap().has_avail(&r.mem));
    r.queues.deliver(&mut r.exec, monotonic_ns());
    assert_eq!(r.status(&q), status::OK);
    // About to sleep: re-armed, and nothing arrived meanwhile.
    assert!(!r.queues.get_mut(r.id).unwrap().arm_or_break());
    assert_eq!(flags(&r) & VRING_USED_F_NO_NOTIFY as u16, 0);
    // A request that arrives while kicks are off is found when re-arming.
    r.queues.process(r.id, &mut r.exec, false, monotonic_ns());
    let q2 = r.push(req_type::FLUSH, 0, &[]);
    assert!(r.queues.get_mut(r.id).unwrap().arm_or_break());
    assert_eq!(r.run(), vec![(q.head as u32, 1), (q2.head as u32, 1)]);
    assert_eq!(r.status(&q2), status::OK);
}

#[test]
fn no_notification_without_finished_requests() {
    let mut r = Rig::new(Kind::Null);
    assert_eq!(r.run(), vec![]);
    assert_eq!(r.stats.notifications.get(), 0);
    let q = r.push(req_type::FLUSH, 0, &[]);
    r.run_one(&q, 1, status::OK);
    assert_eq!(r.stats.notifications.get(), 1);
    r.queues.notify(&mut Vec::new());
    assert_eq!(
        r.stats.notifications.get(),
        1,
        "one per pass that finished something"
    );
}

#[test]
fn no_call_while_the_driver_sets_no_interrupt() {
    // Without EVENT_IDX a driver that reaps without waiting (libblkio,
    // Linux between interrupts) sets VRING_AVAIL_F_NO_INTERRUPT: the device
    // should not call. Once it clears the flag (about to wait) it is called.
    let mut r = Rig::new(Kind::Null);
    let flags = GuestAddress(r.avail);
    r.mem.write_obj(1u16.to_le(), flags).unwrap();
    let q = r.push(req_type::FLUSH, 0, &[]);
    r.run_one(&q, 1, status::OK);
    assert_eq!(r.stats.notifications.get(), 0);
    assert_eq!(r.stats.notifications_suppressed.get(), 1);
    r.mem.write_obj(0u16, flags).unwrap();
    let q = r.push(req_type::FLUSH, 0, &[]);
    r.run_one(&q, 1, status::OK);
    assert_eq!(r.stats.notifications.get(), 1);
}

#[test]
fn the_call_fd_is_written_on_notification() {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut r = Rig::new(Kind::Null);
    let efd = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
    // SAFETY: dup returns a fresh descriptor (checked) that only the File owns.
    let call = unsafe {
        let fd = libc::dup(efd.as_raw_fd());
        assert!(fd >= 0);
        File::from_raw_fd(fd)
    };
    r.queues.get_mut(r.id).unwrap().call = Some(call);
    let q = r.push(req_type::FLUSH, 0, &[]);
    r.run_one(&q, 1, status::OK);
    assert_eq!(efd.read().unwrap(), 1);
}

/// Makes the chain at `head` available `n` more times (the descriptor table
/// holds too few chains to fill the ring with distinct ones).
fn repeat_head(r: &mut Rig, head: u16, n: usize) {
    for _ in 0..n {
        let slot = r.avail + 4 + 2 * (r.avail_idx % QUEUE_SIZE) as u64;
        r.mem.write_obj(head, GuestAddress(slot)).unwrap();
        let next = r.avail_idx.wrapping_add(1);
        set_avail_idx(r, next);
    }
}

/// Sets the ring's avail index directly, as a hostile driver may.
fn set_avail_idx(r: &mut Rig, idx: u16) {
    r.avail_idx = idx;
    r.mem.write_obj(idx, GuestAddress(r.avail + 2)).unwrap();
}

#[test]
fn a_full_ring_is_popped_a_budget_at_a_time() {
    let mut r = Rig::new(Kind::Null);
    let n = QUEUE_SIZE as usize / 2 + POP_BUDGET / 2; // more than one budget, fits the ring
    let first = r.push(req_type::IN, 0, &[(DATA, 512, true)]);
    repeat_head(&mut r, first.head, n - 1);
    assert_eq!(
        r.queues.process(r.id, &mut r.exec, true, monotonic_ns()),
        Popped::More
    );
    assert_eq!(r.stats.popped.get(), POP_BUDGET as u64, "one budget popped");
    assert_eq!(r.stats.budget_exhausted.get(), 1);
    assert_eq!(
        r.queues.process(r.id, &mut r.exec, true, monotonic_ns()),
        Popped::Drained
    );
    assert_eq!(r.stats.popped.get(), n as u64);
    let used = r.run();
    assert_eq!(used.len(), n);
    assert!(used.iter().all(|&(_, len)| len == 513), "{used:?}");
}

#[test]
fn a_flooding_queue_leaves_room_for_another_each_pass() {
    // Two rigs stand for two queues of one thread: a pass processes each
    // ready queue once, so the quiet queue's request waits for at most one
    // budget of the flood's, never for the whole flood.
    let mut flood = Rig::new(Kind::Null);
    let mut quiet = Rig::new(Kind::Null);
    let first = flood.push(req_type::IN, 0, &[(DATA, 512, true)]);
    repeat_head(&mut flood, first.head, QUEUE_SIZE as usize - 2);
    let q = quiet.push(req_type::IN, 0, &[(DATA, 512, true)]);
    let mut passes = 0;
    loop {
        passes += 1;
        let f = flood
            .queues
            .process(flood.id, &mut flood.exec, true, monotonic_ns());
        quiet
            .queues
            .process(quiet.id, &mut quiet.exec, true, monotonic_ns());
        assert!(flood.stats.popped.get() <= (POP_BUDGET * passes) as u64);
        if quiet.stats.popped.get() == 1 {
            break;
        }
        assert_eq!(f, Popped::More);
    }
    assert_eq!(passes, 1, "the quiet queue was served in the first pass");
    assert_eq!(flood.stats.popped.get(), POP_BUDGET as u64);
    quiet.run_one(&q, 513, status::OK);
}

#[test]
fn an_avail_index_beyond_the_queue_size_breaks_the_ring_once() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        set_avail_idx(&mut r, QUEUE_SIZE + 1);
        assert_eq!(
            r.queues.process(r.id, &mut r.exec, true, monotonic_ns()),
            Popped::Drained
        );
        assert_eq!(r.stats.broken_rings.get(), 1, "{kind:?}");
        assert!(r.queues.get(r.id).unwrap().broken());
        // Nothing popped, nothing completed, and it stays stopped: a later
        // pass does not touch it (no busy loop, no second count).
        assert_eq!(r.queues.inflight(), 0);
        assert_eq!(
            r.queues.process(r.id, &mut r.exec, true, monotonic_ns()),
            Popped::Drained
        );
        assert_eq!(r.stats.broken_rings.get(), 1);
        assert_eq!(r.used_idx(), 0);
    }
}

#[test]
fn a_head_beyond_the_queue_size_breaks_the_ring() {
    let mut r = Rig::new(Kind::Null);
    let good = r.push(req_type::IN, 0, &[(DATA, 512, true)]);
    // The next avail entry names head 100 on a 64-entry ring.
    let slot = r.avail + 4 + 2 * (r.avail_idx % QUEUE_SIZE) as u64;
    r.mem.write_obj(100u16, GuestAddress(slot)).unwrap();
    let next = r.avail_idx + 1;
    set_avail_idx(&mut r, next);
    r.queues.process(r.id, &mut r.exec, true, monotonic_ns());
    assert_eq!(r.stats.broken_rings.get(), 1);
    // The request before it is still completed.
    r.queues.deliver(&mut r.exec, monotonic_ns());
    assert_eq!(r.used_idx(), 1);
    assert_eq!(r.status(&good), status::OK);
}

#[test]
fn bounce_buffers_stay_under_the_cap_and_requests_wait_for_them() {
    for kind in FILES {
        let o = Opts {
            bounce: true,
            bounce_max: Some(4096),
            ..Default::default()
        };
        let mut r = Rig::with(kind, o);
        // Two reads into unaligned guest buffers: each needs a 4 KiB bounce
        // buffer, the cap holds one.
        let a = r.push(req_type::IN, 0, &[(DATA + 1, 4096, true)]);
        let b = r.push(req_type::IN, 8, &[(DATA + 0x2001, 4096, true)]);
        // Both popped before the first is reaped (a pass would hand it
        // back, and free its buffer, as soon as the backend is done).
        r.pop_without_reaping();
        assert_eq!(r.exec.bounce_bytes(), 4096, "{kind:?}");
        assert_eq!(r.exec.waiting(), 1, "{kind:?}: the second waits");
        let used = r.run();
        assert_eq!(used.len(), 2, "{kind:?}");
        assert_eq!((r.status(&a), r.status(&b)), (status::OK, status::OK));
        assert_eq!(r.read(DATA + 1, 4096), r.expected(0, 4096), "{kind:?}");
        assert_eq!(r.read(DATA + 0x2001, 4096), r.expected(8 * 512, 4096));
        assert_eq!((r.exec.bounce_bytes(), r.exec.waiting()), (0, 0));
    }
}

#[test]
fn a_request_larger_than_the_bounce_cap_is_ioerr() {
    let o = Opts {
        bounce: true,
        bounce_max: Some(4096),
        ..Default::default()
    };
    let mut r = Rig::with(Kind::Uring, o);
    let q = r.push(req_type::IN, 0, &[(DATA + 1, 8192, true)]);
    r.run_one(&q, 1, status::IOERR);
    assert_eq!(r.exec.bounce_bytes(), 0);
}

#[test]
fn the_thread_counts_pops_publishes_and_suppressed_calls() {
    let mut r = Rig::with(
        Kind::Null,
        Opts {
            event_idx: true,
            ..Opts::default()
        },
    );
    // used_event (after the avail ring's entries) asks for a call once used
    // index 1 is passed: the first completion is signalled.
    let used_event = GuestAddress(r.avail + 4 + 2 * u64::from(QUEUE_SIZE));
    r.mem.write_obj(0u16, used_event).unwrap();
    let q = r.push(req_type::FLUSH, 0, &[]);
    r.run_one(&q, 1, status::OK);
    assert_eq!(r.stats.notifications.get(), 1);
    assert_eq!(r.stats.notifications_suppressed.get(), 0);
    // The driver now wants a call only after used index 100: three more
    // completions in one batch publish three entries and send no call.
    r.mem.write_obj(100u16, used_event).unwrap();
    for _ in 0..3 {
        r.push(req_type::FLUSH, 0, &[]);
    }
    assert_eq!(r.run().len(), 3);
    assert_eq!(r.stats.notifications.get(), 1);
    assert_eq!(r.stats.notifications_suppressed.get(), 1);
    assert_eq!(r.stats.popped.get(), 4);
    assert_eq!(r.stats.used_publishes.get(), 4);
    assert_eq!(r.stats.requests.get(), 4);
    // Null backend: each request is published as soon as it is popped
    // (CALL_EVERY), in a delivery round of its own.
    assert_eq!(r.stats.used_batches.get(), 4);
    let s = r.stats.snapshot();
    assert_eq!(
        (
            s.popped,
            s.used_publishes,
            s.used_batches,
            s.notifications_suppressed
        ),
        (4, 4, 4, 1)
    );
}

/// Writes the kick eventfd, as a driver does after making requests available.
fn kick(fd: &File) {
    use std::io::Write;
    (&*fd).write_all(&1u64.to_ne_bytes()).unwrap();
}

/// Polls `cond` every millisecond for at most 10 s.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("timed out waiting until {what}");
}

/// `queue-move` at the engine level: a queue with requests in flight moves
/// back and forth between two running IOThreads. Each handover answers only
/// once every request popped before it is on the used ring; every request
/// completes exactly once with its status; the thread that owns the queue
/// counts its requests and the one that gave it away stops counting.
#[test]
fn a_queue_with_requests_in_flight_moves_between_iothreads() {
    use super::{Command, HandedOver, IoThreadHandle, IoThreadSetup};
    use std::sync::mpsc::sync_channel;

    const PER_ROUND: u16 = 8;
    const ROUNDS: u16 = 4;
    for kind in ALL {
        // Null: 100 ms latency keeps every request in flight at the handover.
        let latency_ns = if kind == Kind::Null { 100_000_000 } else { 0 };
        let mut r = Rig::with(
            kind,
            Opts {
                latency_ns,
                ..Opts::default()
            },
        );
        let (attach, kick_fd) = r.take_attach();
        let key = attach.key;
        let threads = [
            IoThreadHandle::spawn(0, IoThreadSetup::default()).unwrap(),
            IoThreadHandle::spawn(1, IoThreadSetup::default()).unwrap(),
        ];
        let served = |t: usize| threads[t].stats.queue("t", 0).requests.get();
        threads[0].send(Command::Attach(Box::new(attach)));
        let mut reqs = Vec::new();
        let mut counted = [0u64; 2];
        for round in 0..ROUNDS {
            let (from, to) = ((round % 2) as usize, ((round + 1) % 2) as usize);
            for _ in 0..PER_ROUND {
                let k = reqs.len() as u64;
                reqs.push(r.push(req_type::IN, k, &[(DATA + 512 * k, 512, true)]));
            }
            kick(&kick_fd);
            let popped = u64::from(PER_ROUND) * (u64::from(round) / 2 + 1);
            wait_until("the owner popped the round", || {
                threads[from].stats.popped.get() >= popped
            });
            let (tx, rx) = sync_channel(1);
            threads[from].send(Command::Handover {
                key,
                to: threads[to].mailbox(),
                reply: tx,
            });
            let done: HandedOver = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("the handover answers")
                .expect("the queue was served there");
            // Drained: every request popped before the handover is used.
            let total = PER_ROUND * (round + 1);
            assert_eq!(r.used_idx(), total, "{kind:?} round {round}");
            if kind == Kind::Null {
                assert_eq!(done.drained, PER_ROUND as usize, "{kind:?} round {round}");
            }
            counted[from] += u64::from(PER_ROUND);
            assert_eq!(served(from), counted[from], "{kind:?} round {round}");
            assert_eq!(served(to), counted[to], "{kind:?} round {round}");
        }
        // The queue is on thread 0 again: it serves, thread 1 does not.
        for _ in 0..PER_ROUND {
            let k = reqs.len() as u64;
            reqs.push(r.push(req_type::IN, k, &[(DATA + 512 * k, 512, true)]));
        }
        kick(&kick_fd);
        let total = PER_ROUND * (ROUNDS + 1);
        wait_until("the last round is used", || r.used_idx() == total);
        assert_eq!(served(0), counted[0] + u64::from(PER_ROUND), "{kind:?}");
        assert_eq!(served(1), counted[1], "{kind:?}");
        // Every head exactly once, every status OK, every read's data.
        let mut heads: Vec<u32> = (0..total)
            .map(|i| {
                let at = r.used + 4 + 8 * u64::from(i % QUEUE_SIZE);
                r.mem.read_obj(GuestAddress(at)).unwrap()
            })
            .collect();
        heads.sort_unstable();
        // A ring of 64 reuses descriptor indexes: count each head's uses.
        let mut want: Vec<u32> = reqs.iter().map(|q| u32::from(q.head)).collect();
        want.sort_unstable();
        // The used ring keeps only the last 64 entries.
        if total <= QUEUE_SIZE {
            assert_eq!(heads, want, "{kind:?}");
        }
        for (k, q) in reqs.iter().enumerate() {
            assert_eq!(r.status(q), status::OK, "{kind:?} request {k}");
            let k = k as u64;
            assert_eq!(
                r.read(DATA + 512 * k, 512),
                r.expected(k * 512, 512),
                "{kind:?}"
            );
        }
        drop(threads);
    }
}

/// A handover of a queue the thread does not serve (a ring not started)
/// moves nothing and says so.
#[test]
fn a_handover_of_a_queue_not_served_moves_nothing() {
    use super::{Command, IoThreadHandle, IoThreadSetup};
    use std::sync::mpsc::sync_channel;

    let threads = [
        IoThreadHandle::spawn(0, IoThreadSetup::default()).unwrap(),
        IoThreadHandle::spawn(1, IoThreadSetup::default()).unwrap(),
    ];
    let (tx, rx) = sync_channel(1);
    threads[0].send(Command::Handover {
        key: QueueKey {
            export: 3,
            queue: 1,
        },
        to: threads[1].mailbox(),
        reply: tx,
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(None));
}

/// The inflight record of queue 0 as the frontend's copy of the region shows
/// it: (inflight flag, counter) of descriptor `head`, and the header's
/// `used_idx` (layout: crate::inflight's module documentation).
fn region_desc(file: &File, head: u16) -> (u8, u64) {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 16];
    file.read_exact_at(&mut b, 16 + 16 * head as u64).unwrap();
    (b[0], u64::from_ne_bytes(b[8..].try_into().unwrap()))
}

fn region_used_idx(file: &File) -> u16 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 2];
    file.read_exact_at(&mut b, 14).unwrap();
    u16::from_ne_bytes(b)
}

/// The IOThread's queue layer keeps the inflight record (vhost-user "Inflight
/// I/O tracking"): a popped head is marked in flight with its pop order before
/// it runs, a completed one is cleared once its used entry is published. Then
/// a crash is simulated: one request still running, and the last completion
/// published in the used ring but not yet cleared from the region. Recovery by
/// the inflight module resubmits exactly the running one and not the one the
/// guest has seen completed.
#[test]
fn inflight_record_follows_the_queue_and_survives_a_crash() {
    use crate::inflight::{InflightLayout, InflightRegion};
    use std::os::unix::fs::FileExt;
    let layout = InflightLayout::new(1, QUEUE_SIZE).unwrap();
    let (region, file) = InflightRegion::create(layout).unwrap();
    let (record, recovery) = region.attach_queue(0, 0).unwrap();
    assert!(recovery.fresh && recovery.resubmit.is_empty());
    let o = Opts {
        latency_ns: 30_000_000,
        ..Opts::default()
    };
    let tracking = InflightTracking {
        record,
        resubmit: recovery.resubmit,
    };
    let mut r = Rig::tracked(Kind::Null, o, Some(tracking));
    let reqs: Vec<Req> = (0..3)
        .map(|i| r.push(req_type::OUT, 8 * i, &[(DATA, 512, false)]))
        .collect();
    // Popped (not yet completed): marked, counters in pop order.
    r.queues.process(r.id, &mut r.exec, true, monotonic_ns());
    assert_eq!(
        r.used_idx(),
        0,
        "the null backend's latency keeps them running"
    );
    for (k, q) in reqs.iter().enumerate() {
        assert_eq!(
            region_desc(&file, q.head),
            (1, k as u64 + 1),
            "head {}",
            q.head
        );
    }
    // Completed: cleared, the region's used_idx follows the ring's.
    let used = r.run();
    assert_eq!(used.len(), 3);
    for q in &reqs {
        assert_eq!(region_desc(&file, q.head).0, 0, "head {} completed", q.head);
        assert_eq!(r.status(q), status::OK);
    }
    assert_eq!(region_used_idx(&file), 3);

    // One more request, popped and running when the process dies...
    let running = r.push(req_type::OUT, 64, &[(DATA, 512, false)]);
    r.queues.process(r.id, &mut r.exec, true, monotonic_ns());
    assert_eq!(region_desc(&file, running.head), (1, 4));
    // ...and the crash window of the third completion: the used ring shows it
    // (idx 3), the region still has it in flight with used_idx 2 (its
    // last_batch_head names it, as staging left it).
    let last = reqs[2].head;
    file.write_all_at(&[1], 16 + 16 * last as u64).unwrap();
    file.write_all_at(&2u16.to_ne_bytes(), 14).unwrap();
    let ring_used = r.used_idx();
    assert_eq!(ring_used, 3);
    drop(r);

    // The restarted daemon attaches the same region to the ring.
    let (_record, recovery) = region.attach_queue(0, ring_used).unwrap();
    assert!(!recovery.fresh);
    assert_eq!(
        recovery.resubmit,
        vec![running.head],
        "only the request the guest has not seen completed runs again"
    );
    assert_eq!(
        recovery.next_avail_idx, 4,
        "the 4 popped heads are not popped again"
    );
    assert_eq!(
        region_desc(&file, last).0,
        0,
        "the published head is cleared"
    );
    assert_eq!(region_used_idx(&file), 3);
}

impl Rig {
    /// Switches dirty logging on with a fresh log over the whole mock memory
    /// (the used ring logged at its own address when `used`), as the
    /// SetLog command does.
    fn log_on(&mut self, used: bool) -> Arc<DirtyLog> {
        let log = Arc::new(DirtyLog::anonymous((MEM_SIZE / LOG_PAGE / 8) as usize));
        let key = self.queues.get(self.id).unwrap().key;
        let ql = QueueLog {
            log: log.clone(),
            used: used.then_some(self.used),
        };
        self.queues.set_log(key, Some(ql));
        log
    }

    fn log_off(&mut self) {
        let key = self.queues.get(self.id).unwrap().key;
        self.queues.set_log(key, None);
    }
}

/// The log pages of guest addresses `[addr, addr + len)`.
fn pages(addr: u64, len: u64) -> Vec<u64> {
    (addr / LOG_PAGE..=(addr + len - 1) / LOG_PAGE).collect()
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn a_read_marks_its_data_status_and_used_ring_pages_while_logging() {
    // Zero copy (the backend writes guest memory itself) and through a bounce
    // buffer (the daemon copies into guest memory at completion).
    for bounce in [false, true] {
        for kind in ALL {
            let mut r = Rig::with(
                kind,
                Opts {
                    bounce,
                    ..Opts::default()
                },
            );
            let log = r.log_on(true);
            // Unaligned for the bounce case, and spanning three pages.
            let at = DATA + 0x801;
            let q = r.push(req_type::IN, 8, &[(at, 8192, true)]);
            r.run_one(&q, 8192 + 1, status::OK);
            assert_eq!(r.read(at, 8192), r.expected(8 * 512, 8192), "{kind:?}");
            let mut want = pages(at, 8192);
            want.extend(pages(q.status, 1));
            want.extend(pages(r.used, 6 + 8 * QUEUE_SIZE as u64));
            assert_eq!(log.marked(), sorted(want), "{kind:?} bounce {bounce}");
        }
    }
}

#[test]
fn get_id_marks_its_buffer_and_a_write_only_status_and_used_ring() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let log = r.log_on(true);
        let id = r.push(req_type::GET_ID, 0, &[(DATA + 0x3000, 20, true)]);
        r.run_one(&id, 20 + 1, status::OK);
        let mut want = pages(DATA + 0x3000, 20);
        want.extend(pages(id.status, 1));
        want.extend(pages(r.used, 6 + 8 * QUEUE_SIZE as u64));
        assert_eq!(log.marked(), sorted(want.clone()), "{kind:?}");
        // A write reads guest memory only: its data pages stay clean.
        let w = r.push(req_type::OUT, 0, &[(DATA + 0x10000, 4096, false)]);
        r.run_one(&w, 1, status::OK);
        want.extend(pages(w.status, 1));
        assert_eq!(log.marked(), sorted(want), "{kind:?}");
    }
}

#[test]
fn nothing_is_marked_once_logging_is_off_or_the_used_ring_unless_asked() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let log = r.log_on(true);
        r.log_off();
        let q = r.push(req_type::IN, 0, &[(DATA, 4096, true)]);
        r.run_one(&q, 4096 + 1, status::OK);
        assert!(log.marked().is_empty(), "{kind:?}: {:?}", log.marked());
        // Without VHOST_VRING_F_LOG the used ring is not logged.
        let log = r.log_on(false);
        let q = r.push(req_type::IN, 0, &[(DATA, 4096, true)]);
        r.run_one(&q, 4096 + 1, status::OK);
        let mut want = pages(DATA, 4096);
        want.extend(pages(q.status, 1));
        assert_eq!(log.marked(), sorted(want), "{kind:?}");
    }
}

#[test]
fn a_request_in_flight_when_logging_starts_is_marked_at_completion() {
    // The mark is made when the request finishes, not when it is popped: a
    // log switched on meanwhile (a migration starting) still sees it.
    let mut r = Rig::with(
        Kind::Null,
        Opts {
            latency_ns: 2_000_000,
            ..Opts::default()
        },
    );
    let q = r.push(req_type::IN, 0, &[(DATA, 4096, true)]);
    assert_eq!(
        r.queues.process(r.id, &mut r.exec, true, monotonic_ns()),
        Popped::Drained
    );
    assert_eq!(r.queues.inflight(), 1);
    let log = r.log_on(true);
    r.run_one(&q, 4096 + 1, status::OK);
    let mut want = pages(DATA, 4096);
    want.extend(pages(q.status, 1));
    want.extend(pages(r.used, 6 + 8 * QUEUE_SIZE as u64));
    assert_eq!(log.marked(), sorted(want));
}

/// Requests in flight hold their memory map once between them, past their
/// pass while a backend still has them; the thread keeps the map in use
/// from pass to pass and lets go of it before it sleeps.
#[test]
fn requests_hold_their_memory_map_until_the_thread_sleeps() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        r.push_reads(4);
        r.pop_without_reaping();
        assert_eq!(r.exec.held_maps(), 1, "{kind:?}: one hold for 4 requests");
        r.exec.before_sleep();
        assert_eq!(r.exec.held_maps(), 1, "{kind:?}: still held in flight");
        r.deliver_all(monotonic_ns);
        assert_eq!(r.queues.inflight(), 0, "{kind:?}");
        r.exec.end_pass();
        assert_eq!(r.exec.held_maps(), 1, "{kind:?}: the map in use stays");
        r.exec.before_sleep();
        assert_eq!(r.exec.held_maps(), 0, "{kind:?}: let go before sleeping");
    }
}

/// In steady state a request allocates nothing on the IOThread,
/// from pop to used entry (parsing, submission, completion, publish).
#[test]
fn requests_allocate_nothing_in_steady_state() {
    use super::alloc_count::{allocations_in, first_allocation};
    for kind in [Kind::Null, Kind::Uring] {
        let mut r = Rig::new(kind);
        // The event loop's scratch list of answered queues, kept across passes.
        let mut answered = Vec::new();
        let mut round = |r: &mut Rig, counted: bool| -> u64 {
            answered.clear();
            for i in 0..16u64 {
                let at = DATA + 4096 * i;
                let rtype = if i % 2 == 0 {
                    req_type::IN
                } else {
                    req_type::OUT
                };
                r.push(rtype, 8 * i, &[(at, 4096, rtype == req_type::IN)]);
            }
            let ((), n) = allocations_in(|| {
                while r.queues.process(r.id, &mut r.exec, true, monotonic_ns()) == Popped::More {}
                r.deliver_all(monotonic_ns);
                r.queues.notify(&mut answered);
            });
            assert_eq!(r.queues.inflight(), 0, "{kind:?}");
            if counted {
                // Where, if anything was allocated: a rare one is otherwise
                // a count without a clue.
                assert_eq!(
                    n,
                    0,
                    "{kind:?}: allocated at\n{}",
                    first_allocation().unwrap_or_default()
                );
                n
            } else {
                0
            }
        };
        // Warm-up: the thread's tables and pools grow to the load.
        for _ in 0..3 {
            round(&mut r, false);
        }
        let mut allocs = 0;
        for _ in 0..20 {
            allocs += round(&mut r, true);
        }
        assert_eq!(allocs, 0, "{kind:?}: allocations in 320 requests");
        assert_eq!(r.counters.requests.get(), 16 * 23, "{kind:?}");
    }
}

/// Limits with only `iops-total`.
fn iops_total(iops: u64) -> ThrottleLimits {
    ThrottleConfig {
        iops_total: Some(iops),
        ..ThrottleConfig::default()
    }
    .validate()
    .unwrap()
}

fn throttled(kind: Kind, limits: ThrottleLimits) -> Rig {
    Rig::with(
        kind,
        Opts {
            throttle: Some(limits),
            ..Opts::default()
        },
    )
}

/// One pass over the rig's queue as the event loop makes it, delivering
/// what finished; what the pass returned.
fn pass(r: &mut Rig) -> Popped {
    let p = r.queues.process(r.id, &mut r.exec, true, monotonic_ns());
    for _ in 0..5000 {
        r.queues.deliver(&mut r.exec, monotonic_ns());
        let held = r.queues.get(r.id).unwrap().held_until().is_some();
        if r.queues.inflight() == usize::from(held) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    r.queues.notify(&mut Vec::new());
    p
}

/// The used ring's heads, in publication order.
fn used_heads(r: &Rig) -> Vec<u16> {
    (0..r.used_idx())
        .map(|i| {
            let at = r.used + 4 + 8 * u64::from(i % QUEUE_SIZE);
            r.mem.read_obj::<u32>(GuestAddress(at)).unwrap() as u16
        })
        .collect()
}

/// A kick that finds no work keeps no memory map: a region the frontend
/// adds while the thread sleeps (ADD_MEM_REG, answered once published) is
/// in the map of the pass the next kick starts. A map kept from the stale
/// kick lacked it, and a request into the new region failed as outside
/// guest memory.
#[test]
fn a_kick_without_work_keeps_no_memory_map() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        // A stale edge: the request it announced was taken by polling.
        assert!(!r.queues.get_mut(r.id).unwrap().has_work(), "{kind:?}");
        let added = GuestRegionMmap::from_range(GuestAddress(MEM_SIZE), 0x1_0000, None).unwrap();
        let mem = r.mem.insert_region(Arc::new(added)).unwrap();
        r.handle.lock().unwrap().replace(mem.clone());
        r.mem = mem;
        let req = r.push(req_type::IN, 0, &[(MEM_SIZE, 512, true)]);
        assert!(r.queues.get_mut(r.id).unwrap().has_work(), "{kind:?}");
        pass(&mut r);
        assert_eq!(r.status(&req), status::OK, "{kind:?}");
    }
}

/// A map replaced after a kick was looked at (ADD_MEM_REG while the pass
/// is under way) serves the requests popped after the thread took
/// [`super::Command::NewMemory`]: the frontend, answered only then, may
/// already use the new region.
#[test]
fn a_new_memory_map_serves_the_pass_under_way() {
    for kind in ALL {
        let mut r = Rig::new(kind);
        let first = r.push(req_type::IN, 0, &[(DATA, 512, true)]);
        assert!(r.queues.get_mut(r.id).unwrap().has_work(), "{kind:?}");
        let added = GuestRegionMmap::from_range(GuestAddress(MEM_SIZE), 0x1_0000, None).unwrap();
        let mem = r.mem.insert_region(Arc::new(added)).unwrap();
        r.handle.lock().unwrap().replace(mem.clone());
        r.queues.get_mut(r.id).unwrap().forget_pass_memory();
        r.mem = mem;
        let second = r.push(req_type::IN, 1, &[(MEM_SIZE, 512, true)]);
        pass(&mut r);
        assert_eq!(r.status(&first), status::OK, "{kind:?}");
        assert_eq!(r.status(&second), status::OK, "{kind:?}");
    }
}

/// A thread that polled and then went to sleep holds no memory map: a map
/// the frontend replaced meanwhile (REM_MEM_REG, SET_MEM_TABLE) is let go,
/// and with it any region only the old map had.
#[test]
fn a_thread_asleep_after_polling_holds_no_memory_map() {
    use super::{IoThreadHandle, IoThreadSetup};
    use crate::poll::{PollMode, PollParams};

    let mut r = Rig::new(Kind::Null);
    let (attach, kick_fd) = r.take_attach();
    // Classic polling whose window grows after every wait shorter than a
    // second: after a few requests the thread polls, then sleeps.
    let t = IoThreadHandle::spawn(
        0,
        IoThreadSetup {
            poll_mode: PollMode::Classic,
            poll_params: PollParams {
                poll_max_ns: 1_000_000_000,
                ..PollParams::default()
            },
            ..IoThreadSetup::default()
        },
    )
    .unwrap();
    t.send(super::Command::Attach(Box::new(attach)));
    let mut k = 0u64;
    while t.stats.poll_attempts.get() == 0 {
        assert!(k < 1000, "the thread polls");
        r.push(req_type::IN, k, &[(DATA, 512, true)]);
        kick(&kick_fd);
        k += 1;
        wait_until("the request is served", || u64::from(r.used_idx()) == k);
    }
    // The window is microseconds by now: the slice ends, the thread sleeps.
    std::thread::sleep(Duration::from_millis(100));
    let old = vm_memory::GuestAddressSpace::memory(&r.handle).into_inner();
    r.handle.lock().unwrap().replace(r.mem.clone());
    assert_eq!(
        Arc::strong_count(&old),
        1,
        "the sleeping thread still holds the replaced map"
    );
}

/// A throttled queue holds its head back (popped: in flight, the ring not
/// popped further), says until when, and serves its requests in ring order
/// as the limit lets them through, never earlier.
#[test]
fn a_throttled_queue_holds_its_head_and_keeps_the_order() {
    for kind in ALL {
        // 10 IOPS: a tenth of a second per request once the first went.
        let mut r = throttled(kind, iops_total(10));
        let reqs: Vec<Req> = (0..5u64)
            .map(|k| r.push(req_type::IN, k, &[(DATA + 512 * k, 512, true)]))
            .collect();
        let t0 = crate::clock::clock_ns(libc::CLOCK_MONOTONIC);
        let until = match pass(&mut r) {
            Popped::Held(until) => until,
            p => panic!("{kind:?}: the second request is held back, got {p:?}"),
        };
        assert!(until > t0, "{kind:?}: the deadline is ahead");
        // The bucket holds a tenth of a second's worth: a request or two go.
        // Those that went were submitted together: an asynchronous backend
        // may complete them in either order.
        let mut went = used_heads(&r);
        went.sort_unstable();
        let k = went.len();
        assert!((1..=2).contains(&k), "{kind:?}: {went:?}");
        assert_eq!(went, reqs[..k].iter().map(|q| q.head).collect::<Vec<_>>());
        let q = r.queues.get(r.id).unwrap();
        assert_eq!(q.held_until(), Some(until), "{kind:?}");
        assert_eq!(
            q.next_avail(),
            k as u16 + 1,
            "{kind:?}: nothing popped behind the head"
        );
        assert_eq!(
            r.queues.inflight(),
            1,
            "{kind:?}: the held head is in flight"
        );
        assert!(
            !r.queues.get_mut(r.id).unwrap().has_work(),
            "{kind:?}: a held queue is no work for a kick"
        );
        assert_eq!(r.counters.throttled.get(), 1, "{kind:?}");
        // Before its time, a pass changes nothing.
        assert!(matches!(pass(&mut r), Popped::Held(_)), "{kind:?}");
        assert_eq!(usize::from(r.used_idx()), k, "{kind:?}");
        // Due: served in order.
        let mut passes = 0;
        while r.used_idx() < 5 {
            let wait = r.queues.get(r.id).unwrap().held_until().unwrap_or(0);
            let now = crate::clock::clock_ns(libc::CLOCK_MONOTONIC);
            std::thread::sleep(Duration::from_nanos(wait.saturating_sub(now)));
            pass(&mut r);
            passes += 1;
            assert!(passes < 100, "{kind:?}: the limit lets requests through");
        }
        let elapsed = crate::clock::clock_ns(libc::CLOCK_MONOTONIC) - t0;
        assert!(
            elapsed >= 250_000_000,
            "{kind:?}: 5 requests at 10 IOPS take 0.3 s at least, took {elapsed} ns"
        );
        // After the first burst, one at a time: each went (and completed)
        // before the next was let through.
        assert_eq!(
            used_heads(&r)[k..],
            reqs[k..].iter().map(|q| q.head).collect::<Vec<_>>(),
            "{kind:?}: in ring order"
        );
        for q in &reqs {
            assert_eq!(r.status(q), status::OK, "{kind:?}");
        }
        assert!(r.counters.throttled_ns.get() >= 100_000_000, "{kind:?}");
        assert_eq!(r.queues.get(r.id).unwrap().held_until(), None, "{kind:?}");
    }
}

/// Rounds of `round` one-sector reads at consecutive sectors, each followed by
/// a pass, until the limits hold one back: when it is due, when that pass
/// began, and the reads made.
fn read_until_held(r: &mut Rig, round: usize) -> (u64, u64, u64) {
    let mut sector = 0u64;
    loop {
        for _ in 0..round {
            r.push(
                req_type::IN,
                sector,
                &[(DATA + 512 * (sector % 64), 512, true)],
            );
            sector += 1;
        }
        let asked = crate::clock::clock_ns(libc::CLOCK_MONOTONIC);
        if let Popped::Held(until) = pass(r) {
            return (until, asked, sector);
        }
        assert!(sector < 400, "the limit holds one back");
    }
}

/// A held head with requests waiting behind it is told to come back when
/// the limit lets a batch of them through, not one: at 1000 IOPS, 15 ms after
/// it could have gone alone for 16 requests (a millisecond for each behind
/// it), and the pass at that time releases them all, with one call.
#[test]
fn a_held_queue_waits_for_a_batch_and_releases_it_in_one_pass() {
    for kind in ALL {
        let mut r = throttled(kind, iops_total(1000));
        // Rounds of 20 (the descriptor table holds 21 requests) until the
        // bucket, 100 requests deep, holds one back.
        let (until, asked, _) = read_until_held(&mut r, 20);
        // The head and those behind it (the bucket leaked meanwhile, more
        // with a slower backend: some of the last round went).
        let q = r.queues.get(r.id).unwrap();
        let waiting = usize::from(r.avail_idx.wrapping_sub(q.next_avail())) + 1;
        assert!(waiting >= 4, "{kind:?}: {waiting} waiting");
        let batch = waiting.min(16);
        // A request a millisecond: `batch - 1` ms after the head could go.
        assert!(
            until + 1000 >= asked + (batch as u64 - 1) * 1_000_000,
            "{kind:?}: due {} ns after it was held, not when {batch} may go",
            until as i64 - asked as i64
        );
        let before = r.used_idx();
        let calls = r.stats.notifications.get();
        let now = crate::clock::clock_ns(libc::CLOCK_MONOTONIC);
        std::thread::sleep(Duration::from_nanos(until.saturating_sub(now)));
        pass(&mut r);
        let went = r.used_idx().wrapping_sub(before);
        assert!(
            usize::from(went) >= batch,
            "{kind:?}: {went} went in the pass at the time {batch} may go"
        );
        // No hand-back with a call every CALL_EVERY pops: one call, at the
        // end of the pass.
        assert_eq!(r.stats.notifications.get() - calls, 1, "{kind:?}");
    }
}

/// A queue remembers its depth at its last release: a driver that sends its
/// requests again one at a time after a batch has its first one held for a
/// batch of that depth, not released alone and then the rest.
#[test]
fn a_held_queue_waits_for_its_depth_at_the_last_release() {
    // 200 IOPS: 5 ms a request, so a batch of at most four (15 ms); the
    // bucket holds 20.
    let mut r = throttled(Kind::Null, iops_total(200));
    let now = || crate::clock::clock_ns(libc::CLOCK_MONOTONIC);
    let (until, _, sector) = read_until_held(&mut r, 12);
    let depth = usize::from(
        r.avail_idx
            .wrapping_sub(r.queues.get(r.id).unwrap().next_avail()),
    ) + 1;
    assert!((2..=4).contains(&depth), "{depth} waiting");
    std::thread::sleep(Duration::from_nanos(until.saturating_sub(now())));
    assert_eq!(pass(&mut r), Popped::Drained, "the batch of {depth} went");
    assert_eq!(u64::from(r.used_idx()), sector);
    // The driver sends one again: held (the bucket is full) until the
    // limit lets `depth` through, as many as it had outstanding.
    r.push(req_type::IN, 0, &[(DATA, 512, true)]);
    let asked = now();
    let Popped::Held(until) = pass(&mut r) else {
        panic!("held back");
    };
    assert!(
        until + 1000 >= asked + (depth as u64 - 1) * 5_000_000,
        "due {} ns after it was held, not when {depth} may go",
        until as i64 - asked as i64
    );
}

/// Under a write limit, reads, flushes and GET_ID are never held back;
/// discard and write-zeroes are writes.
#[test]
fn a_write_limit_holds_discards_and_not_reads_flushes_or_get_id() {
    let iops_write = ThrottleConfig {
        iops_write: Some(1),
        ..ThrottleConfig::default()
    }
    .validate()
    .unwrap();
    let mut r = throttled(Kind::Null, iops_write);
    for k in 0..4u64 {
        r.push(req_type::IN, k, &[(DATA + 512 * k, 512, true)]);
        r.push(req_type::FLUSH, 0, &[]);
        r.push(req_type::GET_ID, 0, &[(DATA + 4096, 20, true)]);
    }
    assert_eq!(pass(&mut r), Popped::Drained);
    assert_eq!(r.used_idx(), 12);
    assert_eq!(r.counters.throttled.get(), 0);
    let zeroes: Vec<Req> = (0..4)
        .map(|k| r.push_range(req_type::WRITE_ZEROES, 8 * k, 8, 0))
        .collect();
    assert!(matches!(pass(&mut r), Popped::Held(_)));
    assert!(r.used_idx() < 16);
    assert_eq!(r.status(&zeroes[3]), 0xff, "held back, not failed");
    assert_eq!(r.counters.throttled.get(), 1);
}

/// Releasing a queue (a Detach, a Handover, a stop) submits its held head at
/// once, whatever the limit says.
#[test]
fn release_submits_the_held_request_at_once() {
    for kind in ALL {
        let mut r = throttled(kind, iops_total(1));
        let a = r.push(req_type::IN, 0, &[(DATA, 512, true)]);
        let b = r.push(req_type::OUT, 1, &[(DATA + 512, 512, false)]);
        assert!(matches!(pass(&mut r), Popped::Held(_)), "{kind:?}");
        let q = r.queues.get_mut(r.id).unwrap();
        q.submit_held(r.id, &mut r.exec);
        assert_eq!(q.held_until(), None, "{kind:?}");
        r.run();
        assert_eq!(used_heads(&r), vec![a.head, b.head], "{kind:?}");
        assert_eq!(r.status(&b), status::OK, "{kind:?}");
    }
}

/// New limits apply to a held head at once: cleared, it goes in the next
/// pass.
#[test]
fn lifting_the_limit_lets_the_held_head_go() {
    let mut r = throttled(Kind::Null, iops_total(1));
    let reqs: Vec<Req> = (0..4u64)
        .map(|k| r.push(req_type::IN, k, &[(DATA + 512 * k, 512, true)]))
        .collect();
    assert!(matches!(pass(&mut r), Popped::Held(_)));
    let q = r.queues.get_mut(r.id).unwrap();
    q.set_throttle(None);
    assert_eq!(q.held_until(), Some(0), "due at once");
    assert_eq!(pass(&mut r), Popped::Drained);
    assert_eq!(
        used_heads(&r),
        reqs.iter().map(|q| q.head).collect::<Vec<_>>()
    );
}

/// An IOThread whose only queue waits for its limit sleeps on its timer
/// (even in busy-polling mode: a held queue is no work to poll for), serves
/// the held request when it is due, and a Detach does not wait for it.
#[test]
fn an_iothread_sleeps_while_its_queue_is_held_and_a_detach_does_not_wait() {
    use super::{Command, IoThreadHandle, IoThreadSetup};
    use crate::poll::PollMode;
    use std::sync::mpsc::sync_channel;

    // 4 IOPS: the first request goes, then one every 250 ms.
    let mut r = throttled(Kind::Null, iops_total(4));
    let (attach, kick_fd) = r.take_attach();
    let key = attach.key;
    let t = IoThreadHandle::spawn(
        0,
        IoThreadSetup {
            poll_mode: PollMode::Busy,
            ..IoThreadSetup::default()
        },
    )
    .unwrap();
    t.send(Command::Attach(Box::new(attach)));
    let counters = t.stats.queue("t", 0);
    for k in 0..4u64 {
        r.push(req_type::IN, k, &[(DATA + 512 * k, 512, true)]);
    }
    kick(&kick_fd);
    wait_until("the second request is held", || {
        counters.throttled.get() >= 1
    });
    let tid = t.stats.tid.load(std::sync::atomic::Ordering::Relaxed);
    let cpu0 = crate::stats::thread_cpu_seconds(tid);
    let wall = Instant::now();
    // The timer brings the held request back: the third is held in turn.
    wait_until("the second request is served", || r.used_idx() >= 2);
    std::thread::sleep(Duration::from_millis(100));
    let cpu = crate::stats::thread_cpu_seconds(tid) - cpu0;
    let wall = wall.elapsed().as_secs_f64();
    assert!(
        cpu < 0.25 * wall,
        "a held queue costs no polling: {cpu} s of CPU in {wall} s"
    );
    let (tx, rx) = sync_channel(1);
    let asked = Instant::now();
    t.send(Command::Detach { key, reply: tx });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the detach answers");
    assert!(
        asked.elapsed() < Duration::from_millis(200),
        "the drain did not wait for the limit: {:?}",
        asked.elapsed()
    );
    assert_eq!(r.used_idx(), 3, "the held request was served by the drain");
    assert!(counters.throttled.get() >= 2);
}
