//! A test-only vhost-user frontend that speaks the protocol with raw messages,
//! so that tests can send what no well-behaved frontend would: wrong sizes,
//! out-of-range vring indexes, memory tables that lie about their files,
//! rings in impossible states.
//!
//! Guest memory is one memfd that this process maps too; the frontend lays
//! out a split virtqueue in it itself (virtio 1.2, 2.7). Every wait is
//! bounded ([`TIMEOUT`]): a daemon that never answers fails the test, it
//! never hangs it.
#![allow(dead_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Longest wait for a reply or a completion.
pub const TIMEOUT: Duration = Duration::from_secs(3);

/// vhost-user request codes (vhost-user spec, "Front-end message types").
pub mod req {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const GET_CONFIG: u32 = 24;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
}

const VERSION: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;

const F_INDIRECT_DESC: u64 = 1 << 28;
const F_EVENT_IDX: u64 = 1 << 29;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;
const PF_MQ: u64 = 1 << 0;
const PF_REPLY_ACK: u64 = 1 << 3;
const PF_CONFIG: u64 = 1 << 9;
const PF_MEM_SLOTS: u64 = 1 << 15;
/// VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD.
pub const PF_INFLIGHT_SHMFD: u64 = 1 << 12;

/// Descriptor flags (virtio 1.2, 2.7.5).
pub const DESC_NEXT: u16 = 1;
pub const DESC_WRITE: u16 = 2;
pub const DESC_INDIRECT: u16 = 4;

/// virtio-blk request types and status values.
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;

/// Guest memory layout (guest physical addresses).
pub const MEM_SIZE: u64 = 1 << 20;
pub const DESC: u64 = 0x0000;
pub const AVAIL: u64 = 0x1000;
pub const USED: u64 = 0x2000;
/// Room for hand-made indirect tables.
pub const INDIRECT: u64 = 0x3000;
/// Request headers (16 bytes each) and status bytes.
pub const HDR: u64 = 0x8000;
pub const STATUS: u64 = 0x9000;
/// Data buffers, 4 KiB aligned (O_DIRECT).
pub const DATA: u64 = 0x10000;
/// Queue size the frontend sets up by default.
pub const QSIZE: u16 = 16;

/// What came back for one message.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// A REPLY_ACK: 0 is success.
    Ack(u64),
    /// A reply with a payload (GET_* messages).
    Data(Vec<u8>),
    /// The daemon closed the connection.
    Closed,
    /// Nothing within [`TIMEOUT`].
    Timeout,
}

impl Reply {
    /// True for a REPLY_ACK saying success.
    pub fn ok(&self) -> bool {
        *self == Reply::Ack(0)
    }
    /// True if the daemon refused: a failing ack or a closed connection.
    pub fn refused(&self) -> bool {
        matches!(self, Reply::Ack(n) if *n != 0) || *self == Reply::Closed
    }
}

/// One memfd of guest memory, mapped in this process too.
pub struct GuestMemory {
    pub file: File,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; access goes through volatile reads/writes.
unsafe impl Send for GuestMemory {}

impl GuestMemory {
    /// A fresh memfd of `len` bytes (sealable, not sealed).
    pub fn new(len: u64) -> GuestMemory {
        GuestMemory::with_flags(len, libc::MFD_ALLOW_SEALING)
    }

    /// A fresh memfd of `len` bytes created with `flags` (without
    /// `MFD_ALLOW_SEALING` it can never be sealed).
    pub fn with_flags(len: u64, flags: libc::c_uint) -> GuestMemory {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"vqblk-test-guest".as_ptr(), flags) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: fd is a fresh descriptor we own.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).unwrap();
        // SAFETY: mapping a file we own, length matches its size.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap");
        GuestMemory {
            file,
            ptr: ptr as *mut u8,
            len: len as usize,
        }
    }

    /// Address of the mapping in this process (the "user address" of vhost-user).
    pub fn user_addr(&self) -> u64 {
        self.ptr as u64
    }

    fn at(&self, gpa: u64, n: usize) -> *mut u8 {
        assert!(
            gpa as usize + n <= self.len,
            "test wrote outside its memory"
        );
        // SAFETY: in bounds, checked above.
        unsafe { self.ptr.add(gpa as usize) }
    }

    pub fn write(&self, gpa: u64, data: &[u8]) {
        let p = self.at(gpa, data.len());
        for (i, b) in data.iter().enumerate() {
            // SAFETY: in bounds of the mapping; volatile because the daemon shares it.
            unsafe { p.add(i).write_volatile(*b) };
        }
    }

    pub fn read(&self, gpa: u64, n: usize) -> Vec<u8> {
        let p = self.at(gpa, n);
        // SAFETY: in bounds of the mapping; volatile because the daemon shares it.
        (0..n)
            .map(|i| unsafe { p.add(i).read_volatile() })
            .collect()
    }

    pub fn write_u16(&self, gpa: u64, v: u16) {
        self.write(gpa, &v.to_le_bytes());
    }

    pub fn read_u16(&self, gpa: u64) -> u16 {
        u16::from_le_bytes(self.read(gpa, 2).try_into().unwrap())
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A raw vhost-user connection plus one guest memory and one split ring.
pub struct Frontend {
    pub sock: UnixStream,
    pub mem: GuestMemory,
    pub kick: EventFd,
    pub call: EventFd,
    pub qsize: u16,
    /// Next avail index this frontend will publish.
    pub avail_idx: u16,
    /// Used index seen last.
    pub used_seen: u16,
    /// Acked virtio features.
    pub features: u64,
}

/// Little-endian payload builders.
pub fn u64_payload(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

pub fn state(index: u32, num: u32) -> Vec<u8> {
    let mut p = index.to_le_bytes().to_vec();
    p.extend_from_slice(&num.to_le_bytes());
    p
}

pub fn vring_addr(index: u32, desc: u64, used: u64, avail: u64) -> Vec<u8> {
    let mut p = index.to_le_bytes().to_vec();
    p.extend_from_slice(&0u32.to_le_bytes());
    for v in [desc, used, avail, 0u64] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    p
}

/// The payload of GET_INFLIGHT_FD / SET_INFLIGHT_FD (vhost-user spec,
/// "Inflight description").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InflightDesc {
    pub mmap_size: u64,
    pub mmap_offset: u64,
    pub num_queues: u16,
    pub queue_size: u16,
}

impl InflightDesc {
    /// 24 bytes: two u64, two u16, padding to 8.
    pub fn bytes(&self) -> Vec<u8> {
        let mut p = self.mmap_size.to_le_bytes().to_vec();
        p.extend_from_slice(&self.mmap_offset.to_le_bytes());
        p.extend_from_slice(&self.num_queues.to_le_bytes());
        p.extend_from_slice(&self.queue_size.to_le_bytes());
        p.extend_from_slice(&[0u8; 4]);
        p
    }
}

/// One region of SET_MEM_TABLE / ADD_MEM_REG.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub gpa: u64,
    pub size: u64,
    pub user_addr: u64,
    pub mmap_offset: u64,
}

impl Region {
    fn bytes(&self) -> Vec<u8> {
        [self.gpa, self.size, self.user_addr, self.mmap_offset]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }
}

pub fn mem_table(regions: &[Region]) -> Vec<u8> {
    let mut p = (regions.len() as u32).to_le_bytes().to_vec();
    p.extend_from_slice(&0u32.to_le_bytes());
    for r in regions {
        p.extend_from_slice(&r.bytes());
    }
    p
}

pub fn single_region(r: &Region) -> Vec<u8> {
    let mut p = 0u64.to_le_bytes().to_vec();
    p.extend_from_slice(&r.bytes());
    p
}

pub fn header(request: u32, flags: u32, size: u32) -> Vec<u8> {
    let mut h = request.to_le_bytes().to_vec();
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h
}

impl Frontend {
    /// Connects to `path` (retrying while the daemon is busy with a previous
    /// frontend is the caller's business: the connect itself succeeds at once).
    pub fn connect(path: &Path) -> Frontend {
        let sock = UnixStream::connect(path).expect("connect");
        sock.set_read_timeout(Some(TIMEOUT)).unwrap();
        sock.set_write_timeout(Some(TIMEOUT)).unwrap();
        Frontend {
            sock,
            mem: GuestMemory::new(MEM_SIZE),
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            call: EventFd::new(EFD_NONBLOCK).unwrap(),
            qsize: QSIZE,
            avail_idx: 0,
            used_seen: 0,
            features: 0,
        }
    }

    /// [`Frontend::connect`] once a daemon listens on `path` (bounded wait).
    pub fn connect_when_listening(path: &Path) -> Frontend {
        let t = Instant::now();
        while UnixStream::connect(path).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "daemon never listened"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Frontend::connect(path)
    }

    /// Sends one message, asking for a REPLY_ACK, with `fds` attached.
    pub fn send(&self, request: u32, payload: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        self.send_flags(request, VERSION | NEED_REPLY, payload, fds)
    }

    pub fn send_flags(
        &self,
        request: u32,
        flags: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> std::io::Result<()> {
        let mut msg = header(request, flags, payload.len() as u32);
        msg.extend_from_slice(payload);
        self.raw_write_fds(&msg, fds)
    }

    /// Writes raw bytes with `fds` attached, in one sendmsg.
    pub fn raw_write_fds(&self, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        let n = self
            .sock
            .send_with_fds(&[bytes], fds)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        assert_eq!(n, bytes.len(), "short sendmsg");
        Ok(())
    }

    /// Reads one reply; `Closed` on EOF or reset, `Timeout` after [`TIMEOUT`].
    pub fn recv(&mut self) -> Reply {
        let mut h = [0u8; 12];
        if let Err(e) = self.sock.read_exact(&mut h) {
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Reply::Timeout,
                _ => Reply::Closed,
            };
        }
        let flags = u32::from_le_bytes(h[4..8].try_into().unwrap());
        assert!(flags & REPLY != 0, "daemon sent a non-reply");
        let size = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
        let mut p = vec![0u8; size];
        if self.sock.read_exact(&mut p).is_err() {
            return Reply::Closed;
        }
        Reply::Data(p)
    }

    /// Sends a message that gets a REPLY_ACK and returns the outcome.
    pub fn call_ack(&mut self, request: u32, payload: &[u8], fds: &[RawFd]) -> Reply {
        if self.send(request, payload, fds).is_err() {
            return Reply::Closed;
        }
        match self.recv() {
            Reply::Data(p) if p.len() == 8 => Reply::Ack(u64::from_le_bytes(p.try_into().unwrap())),
            other => other,
        }
    }

    /// Sends a GET_* message (its reply is data, not an ack).
    pub fn call_get(&mut self, request: u32, payload: &[u8]) -> Reply {
        if self.send_flags(request, VERSION, payload, &[]).is_err() {
            return Reply::Closed;
        }
        self.recv()
    }

    fn get_u64(&mut self, request: u32) -> u64 {
        match self.call_get(request, &[]) {
            Reply::Data(p) if p.len() == 8 => u64::from_le_bytes(p.try_into().unwrap()),
            r => panic!("request {request}: {r:?}"),
        }
    }

    /// Feature negotiation (with REPLY_ACK, so every later message is answered).
    pub fn negotiate(&mut self) {
        self.negotiate_with(0);
    }

    /// [`Frontend::negotiate`], also acking the protocol features of `extra`
    /// the daemon offers; returns the protocol features acked.
    pub fn negotiate_with(&mut self, extra: u64) -> u64 {
        let offered = self.get_u64(req::GET_FEATURES);
        assert!(offered & F_PROTOCOL_FEATURES != 0);
        self.features = offered & !F_EVENT_IDX;
        // The first SET_FEATURES precedes the REPLY_ACK negotiation: no ack yet.
        self.send_flags(req::SET_FEATURES, VERSION, &u64_payload(self.features), &[])
            .unwrap();
        let pf = self.get_u64(req::GET_PROTOCOL_FEATURES);
        let want = pf & (PF_MQ | PF_REPLY_ACK | PF_CONFIG | PF_MEM_SLOTS | extra);
        assert!(want & PF_REPLY_ACK != 0);
        self.send_flags(req::SET_PROTOCOL_FEATURES, VERSION, &u64_payload(want), &[])
            .unwrap();
        // From here on every message asks for an ack.
        assert!(self.call_ack(req::SET_OWNER, &[], &[]).ok(), "SET_OWNER");
        want
    }

    /// GET_INFLIGHT_FD for `num_queues` queues of `queue_size`: the reply's
    /// description (mmap_size, mmap_offset, num_queues, queue_size) and file,
    /// or None if the daemon closed the connection or sent no file.
    pub fn get_inflight_fd(
        &mut self,
        num_queues: u16,
        queue_size: u16,
    ) -> Option<(InflightDesc, File)> {
        let ask = InflightDesc {
            mmap_size: 0,
            mmap_offset: 0,
            num_queues,
            queue_size,
        };
        self.send_flags(req::GET_INFLIGHT_FD, VERSION, &ask.bytes(), &[])
            .ok()?;
        let mut buf = [0u8; 12 + 24];
        let (n, file) = self.sock.recv_with_fd(&mut buf).ok()?;
        if n != buf.len() {
            return None;
        }
        let u64_at = |o: usize| u64::from_le_bytes(buf[o..o + 8].try_into().unwrap());
        let u16_at = |o: usize| u16::from_le_bytes(buf[o..o + 2].try_into().unwrap());
        let desc = InflightDesc {
            mmap_size: u64_at(12),
            mmap_offset: u64_at(20),
            num_queues: u16_at(28),
            queue_size: u16_at(30),
        };
        Some((desc, file?))
    }

    /// SET_INFLIGHT_FD with `desc` and `file`.
    pub fn set_inflight_fd(&mut self, desc: &InflightDesc, file: &File) -> Reply {
        self.call_ack(req::SET_INFLIGHT_FD, &desc.bytes(), &[file.as_raw_fd()])
    }

    /// A new connection to `path` for the same guest (memory, eventfds, ring
    /// state), as QEMU reconnects to a restarted backend; retries while
    /// nothing listens, for at most `wait`.
    pub fn reconnect(&mut self, path: &Path, wait: Duration) -> bool {
        let t = Instant::now();
        loop {
            if let Ok(sock) = UnixStream::connect(path) {
                sock.set_read_timeout(Some(TIMEOUT)).unwrap();
                sock.set_write_timeout(Some(TIMEOUT)).unwrap();
                self.sock = sock;
                return true;
            }
            if t.elapsed() > wait {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The region describing the whole of this frontend's memory.
    pub fn whole_region(&self) -> Region {
        Region {
            gpa: 0,
            size: MEM_SIZE,
            user_addr: self.mem.user_addr(),
            mmap_offset: 0,
        }
    }

    /// SET_MEM_TABLE with `regions`, every one backed by this frontend's memfd.
    pub fn set_mem_table(&mut self, regions: &[Region]) -> Reply {
        let fd = self.mem.file.as_raw_fd();
        let fds: Vec<RawFd> = regions.iter().map(|_| fd).collect();
        self.call_ack(req::SET_MEM_TABLE, &mem_table(regions), &fds)
    }

    /// Sets up vring 0 (size, base, addresses, call, kick, enable).
    pub fn setup_ring(&mut self, index: u32) -> Reply {
        self.setup_ring_base(index, 0)
    }

    /// [`Frontend::setup_ring`] with SET_VRING_BASE `base`.
    pub fn setup_ring_base(&mut self, index: u32, base: u16) -> Reply {
        for (r, p) in [
            (req::SET_VRING_NUM, state(index, self.qsize as u32)),
            (req::SET_VRING_BASE, state(index, base as u32)),
            (req::SET_VRING_ADDR, self.ring_addr(index)),
        ] {
            let a = self.call_ack(r, &p, &[]);
            if !a.ok() {
                return a;
            }
        }
        let call = self.call.as_raw_fd();
        let a = self.call_ack(req::SET_VRING_CALL, &u64_payload(index as u64), &[call]);
        if !a.ok() {
            return a;
        }
        let kick = self.kick.as_raw_fd();
        let a = self.call_ack(req::SET_VRING_KICK, &u64_payload(index as u64), &[kick]);
        if !a.ok() {
            return a;
        }
        self.call_ack(req::SET_VRING_ENABLE, &state(index, 1), &[])
    }

    /// SET_VRING_ADDR payload for this frontend's layout (user addresses).
    pub fn ring_addr(&self, index: u32) -> Vec<u8> {
        let u = self.mem.user_addr();
        vring_addr(index, u + DESC, u + USED, u + AVAIL)
    }

    /// Negotiation, the whole memory, vring 0 started.
    pub fn ready(path: &Path) -> Frontend {
        let mut f = Frontend::connect(path);
        f.negotiate();
        assert!(f.set_mem_table(&[f.whole_region()]).ok(), "SET_MEM_TABLE");
        let r = f.setup_ring(0);
        assert!(r.ok(), "ring setup: {r:?}");
        f
    }

    /// Writes descriptor `i`.
    pub fn set_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        self.set_desc_at(DESC, i, addr, len, flags, next);
    }

    /// Writes entry `i` of a descriptor table at `table`.
    pub fn set_desc_at(&self, table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = addr.to_le_bytes().to_vec();
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        self.mem.write(table + 16 * i as u64, &d);
    }

    /// Publishes `head` in the avail ring and kicks.
    pub fn push(&mut self, head: u16) {
        let slot = self.avail_idx % self.qsize;
        self.mem.write_u16(AVAIL + 4 + 2 * slot as u64, head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mem.write_u16(AVAIL + 2, self.avail_idx);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.kick.write(1).unwrap();
    }

    /// Waits (bounded) until the used index moves past what was seen; returns
    /// the new used entries as (id, len), or None on timeout.
    pub fn wait_used(&mut self, n: u16) -> Option<Vec<(u32, u32)>> {
        let t = Instant::now();
        loop {
            let idx = self.mem.read_u16(USED + 2);
            if idx.wrapping_sub(self.used_seen) >= n {
                let mut out = Vec::new();
                while self.used_seen != idx {
                    let e = USED + 4 + 8 * (self.used_seen % self.qsize) as u64;
                    let b = self.mem.read(e, 8);
                    out.push((
                        u32::from_le_bytes(b[..4].try_into().unwrap()),
                        u32::from_le_bytes(b[4..].try_into().unwrap()),
                    ));
                    self.used_seen = self.used_seen.wrapping_add(1);
                }
                return Some(out);
            }
            if t.elapsed() > TIMEOUT {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Writes a request header at `HDR` and a status sentinel at `STATUS`.
    pub fn prepare_request(&self, kind: u32, sector: u64) {
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&sector.to_le_bytes());
        self.mem.write(HDR, &h);
        self.mem.write(STATUS, &[0xff]);
    }

    /// One well-formed request (header, one data buffer at `DATA`, status)
    /// on descriptors 0..3; returns the status byte, None on timeout.
    pub fn request(&mut self, kind: u32, sector: u64, len: u32) -> Option<u8> {
        self.prepare_request(kind, sector);
        let data_flags = if kind == T_IN { DESC_WRITE } else { 0 };
        self.set_desc(0, HDR, 16, DESC_NEXT, 1);
        self.set_desc(1, DATA, len, data_flags | DESC_NEXT, 2);
        self.set_desc(2, STATUS, 1, DESC_WRITE, 0);
        self.push(0);
        let used = self.wait_used(1)?;
        assert_eq!(used.len(), 1, "one request, one used entry");
        assert_eq!(used[0].0, 0, "used id is the head");
        Some(self.mem.read(STATUS, 1)[0])
    }

    /// Writes `pattern` to `sector` and reads it back; panics with `what` on
    /// any failure (wrong status, timeout, wrong data).
    pub fn check_io(&mut self, sector: u64, seed: u8, what: &str) {
        let data: Vec<u8> = (0..4096u32)
            .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
            .collect();
        self.mem.write(DATA, &data);
        let s = self.request(T_OUT, sector, 4096);
        assert_eq!(s, Some(S_OK), "{what}: write");
        self.mem.write(DATA, &[0u8; 4096]);
        let s = self.request(T_IN, sector, 4096);
        assert_eq!(s, Some(S_OK), "{what}: read");
        assert!(
            self.mem.read(DATA, 4096) == data,
            "{what}: data read back differs"
        );
    }

    /// Writes raw bytes to the socket (for truncated or split messages).
    pub fn raw_write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.sock.write_all(bytes)
    }
}
