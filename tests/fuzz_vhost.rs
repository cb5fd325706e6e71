//! Fuzzing the vhost-user connection handler: arbitrary message sequences
//! (request codes, flags, sizes that lie, payloads, and fds: none, eventfds,
//! memfds of random sizes, sealable or not) sent over a real socket to an
//! in-process daemon with two exports on one IOThread; each case is one
//! connection to export `a`.
//!
//! Invariants:
//! - no panic in any daemon thread;
//! - no hang: once the frontend stops writing, the daemon ends the session
//!   (closes the socket) within [`SESSION_TIMEOUT`];
//! - at the end of the run (not per case): export `b`, on the same IOThread,
//!   still serves a frontend connected before the run, and a fresh
//!   connection on `a` does I/O correctly.
//!
//! No known defect is stepped around: a far SET_VRING_BASE or a used ring
//! over the avail idx stops that ring as broken, and the IOThread goes on.

mod common;
#[path = "common/frontend.rs"]
mod frontend;
mod fuzz;

use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use vqblk_daemon::config::ServeConfig;
use vqblk_daemon::daemon::Daemon;

use fuzz::Outcome;

/// Longest a session may take to end once the frontend stopped writing
/// (an incomplete message is given up after 2 s by the daemon).
const SESSION_TIMEOUT: Duration = Duration::from_secs(5);

/// Frontend "user addresses" the fuzzer uses: a few bases, so that ring
/// addresses can fall inside regions.
const BASES: [u64; 4] = [0x7f00_0000_0000, 0x7f00_0100_0000, 0x7f00_0200_0000, 0];

#[derive(Arbitrary, Debug, Clone, Copy)]
enum UAddr {
    At { base: u8, offset: u16 },
    Raw(u64),
}

impl UAddr {
    fn get(self) -> u64 {
        match self {
            UAddr::At { base, offset } => BASES[base as usize % 4] + offset as u64,
            UAddr::Raw(a) => a,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct Region {
    /// Guest address: 64 KiB steps, or raw.
    gpa: u16,
    raw_gpa: Option<u64>,
    /// Size in pages, or raw.
    pages: u8,
    raw_size: Option<u64>,
    user: UAddr,
    /// mmap offset in pages, or raw.
    offset: u8,
    raw_offset: Option<u64>,
}

impl Region {
    fn bytes(&self) -> Vec<u8> {
        let gpa = self.raw_gpa.unwrap_or(self.gpa as u64 * 0x1_0000);
        let size = self.raw_size.unwrap_or(self.pages as u64 * 4096);
        let off = self.raw_offset.unwrap_or(self.offset as u64 * 4096);
        [gpa, size, self.user.get(), off]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }
}

#[derive(Arbitrary, Debug, Clone)]
enum Payload {
    Empty,
    U64(u64),
    /// A vring state: index (small mostly) and number.
    State {
        index: u8,
        raw_index: Option<u32>,
        num: u32,
    },
    /// SET_VRING_ADDR.
    Addr {
        index: u8,
        flags: u32,
        desc: UAddr,
        used: UAddr,
        avail: UAddr,
        log: u64,
    },
    /// SET_MEM_TABLE (count as given, or the real one).
    MemTable {
        regions: Vec<Region>,
        count: Option<u32>,
    },
    /// ADD_MEM_REG / REM_MEM_REG.
    Single(Region),
    /// GET_CONFIG / SET_CONFIG.
    Config {
        offset: u16,
        size: u16,
        flags: u32,
        data: Vec<u8>,
    },
    Bytes(Vec<u8>),
}

impl Payload {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Payload::Empty => vec![],
            Payload::U64(v) => v.to_le_bytes().to_vec(),
            Payload::State {
                index,
                raw_index,
                num,
            } => {
                let i = raw_index.unwrap_or(*index as u32 % 4);
                frontend::state(i, *num)
            }
            Payload::Addr {
                index,
                flags,
                desc,
                used,
                avail,
                log,
            } => {
                let mut p = (*index as u32 % 4).to_le_bytes().to_vec();
                p.extend_from_slice(&flags.to_le_bytes());
                for v in [desc.get(), used.get(), avail.get(), *log] {
                    p.extend_from_slice(&v.to_le_bytes());
                }
                p
            }
            Payload::MemTable { regions, count } => {
                let n = count.unwrap_or(regions.len() as u32);
                let mut p = n.to_le_bytes().to_vec();
                p.extend_from_slice(&0u32.to_le_bytes());
                for r in regions.iter().take(10) {
                    p.extend_from_slice(&r.bytes());
                }
                p
            }
            Payload::Single(r) => {
                let mut p = 0u64.to_le_bytes().to_vec();
                p.extend_from_slice(&r.bytes());
                p
            }
            Payload::Config {
                offset,
                size,
                flags,
                data,
            } => {
                let mut p = (*offset as u32 % 64).to_le_bytes().to_vec();
                p.extend_from_slice(&(*size as u32 % 300).to_le_bytes());
                p.extend_from_slice(&flags.to_le_bytes());
                p.extend_from_slice(data);
                p
            }
            Payload::Bytes(b) => b.clone(),
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Fd {
    Event,
    /// A memfd of `pages` pages; sealable or not.
    Memfd {
        pages: u8,
        sealable: bool,
    },
}

#[derive(Arbitrary, Debug, Clone)]
struct Msg {
    /// Request code: 1..=48 (modulo), or raw.
    code: u8,
    raw_code: Option<u32>,
    /// Flags: version 1 with or without NEED_REPLY, or raw.
    need_reply: bool,
    raw_flags: Option<u32>,
    payload: Payload,
    /// The header's size field instead of the payload's length.
    size_lie: Option<u16>,
    fds: Vec<Fd>,
}

#[derive(Arbitrary, Debug, Clone)]
struct VhostCase {
    /// How far a well-behaved prelude goes before the random messages:
    /// 0 nothing, 1 features and SET_OWNER, 2 and a memory table, 3 and
    /// vring 0 started (modulo 4).
    prelude: u8,
    /// Queue size for the prelude's ring (2^(n % 9)).
    qsize: u8,
    msgs: Vec<Msg>,
}

/// The prelude's memory: one sealable 1 MiB memfd at guest address 0, user
/// address BASES[0]; its ring at 0 / 0x1000 / 0x2000.
fn prelude(level: u8, qsize: u8) -> Vec<(Vec<u8>, Vec<std::fs::File>)> {
    let msg = |code: u32, payload: Vec<u8>| {
        let mut b = frontend::header(code, 0x1, payload.len() as u32);
        b.extend_from_slice(&payload);
        b
    };
    let mut out = Vec::new();
    if level >= 1 {
        let features = vqblk_daemon::virtio::features::VERSION_1
            | vqblk_daemon::virtio::features::VHOST_USER_PROTOCOL_FEATURES;
        out.push((msg(1, vec![]), vec![]));
        out.push((msg(2, features.to_le_bytes().to_vec()), vec![]));
        out.push((msg(15, vec![]), vec![]));
        // MQ, CONFIG, CONFIGURE_MEM_SLOTS (no REPLY_ACK: fewer replies).
        let pf: u64 = 1 | (1 << 9) | (1 << 15);
        out.push((msg(16, pf.to_le_bytes().to_vec()), vec![]));
        out.push((msg(3, vec![]), vec![]));
    }
    if level >= 2 {
        let r = frontend::Region {
            gpa: 0,
            size: 1 << 20,
            user_addr: BASES[0],
            mmap_offset: 0,
        };
        let f = memfd(0, true);
        f.set_len(1 << 20).unwrap();
        out.push((msg(5, frontend::mem_table(&[r])), vec![f]));
    }
    if level >= 3 {
        let n = 1u32 << (qsize % 9);
        let call = EventFd::new(EFD_NONBLOCK).unwrap();
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        // SAFETY: dups of live eventfds, each owned by its File alone.
        let (call, kick) = unsafe {
            (
                std::fs::File::from_raw_fd(libc::dup(call.as_raw_fd())),
                std::fs::File::from_raw_fd(libc::dup(kick.as_raw_fd())),
            )
        };
        let b = BASES[0];
        out.push((msg(8, frontend::state(0, n)), vec![]));
        out.push((msg(10, frontend::state(0, 0)), vec![]));
        out.push((
            msg(9, frontend::vring_addr(0, b, b + 0x2000, b + 0x1000)),
            vec![],
        ));
        out.push((msg(13, 0u64.to_le_bytes().to_vec()), vec![call]));
        out.push((msg(12, 0u64.to_le_bytes().to_vec()), vec![kick]));
        out.push((msg(18, frontend::state(0, 1)), vec![]));
    }
    out
}

fn memfd(pages: u8, sealable: bool) -> std::fs::File {
    let flags = if sealable { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: a NUL-terminated name and valid flags.
    let fd = unsafe { libc::memfd_create(c"vqblk-fuzz".as_ptr(), flags) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: a fresh descriptor owned by nothing else.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(pages as u64 * 4096).unwrap();
    f
}

/// Reads and drops whatever the daemon sent so far.
fn drain(sock: &mut UnixStream) {
    let mut buf = [0u8; 8192];
    let _ = sock.set_nonblocking(true);
    while matches!(sock.read(&mut buf), Ok(n) if n > 0) {}
    let _ = sock.set_nonblocking(false);
}

struct Rig {
    daemon: Option<Daemon>,
    sock_a: PathBuf,
    sock_b: PathBuf,
    victim: frontend::Frontend,
}

impl Rig {
    fn new() -> Rig {
        let dir = common::scratch("fuzz-vhost");
        let (sock_a, sock_b) = (dir.join("a.sock"), dir.join("b.sock"));
        let mut text = String::from("[iothreads]\ncount = 1\npoll = \"off\"\n");
        for (n, s) in [("a", &sock_a), ("b", &sock_b)] {
            text += &format!(
                "[[export]]\nname = \"{n}\"\nimage = \"{}\"\ncreate = \"16M\"\nsocket = \"{}\"\n",
                dir.join(format!("{n}.raw")).display(),
                s.display()
            );
        }
        let cfg = ServeConfig::from_toml(&text).expect("config");
        let daemon = Daemon::start(&cfg).expect("daemon starts");
        let mut victim = frontend::Frontend::ready(&sock_b);
        victim.check_io(0, 3, "victim before the run");
        Rig {
            daemon: Some(daemon),
            sock_a,
            sock_b,
            victim,
        }
    }

    fn run_case(&mut self, c: &VhostCase) -> Outcome {
        let Ok(mut sock) = UnixStream::connect(&self.sock_a) else {
            return Outcome::Finding("export a no longer accepts connections".into());
        };
        sock.set_write_timeout(Some(Duration::from_secs(1)))
            .unwrap();
        for (bytes, files) in prelude(c.prelude % 4, c.qsize) {
            let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
            if sock.send_with_fds(&[&bytes[..]], &fds).is_err() {
                return Outcome::Finding(
                    "the daemon closed the connection during the prelude".into(),
                );
            }
            drain(&mut sock);
        }
        let mut sent = 0;
        for m in c.msgs.iter().take(40) {
            let code = m.raw_code.unwrap_or(m.code as u32 % 48 + 1);
            let flags = m.raw_flags.unwrap_or(if m.need_reply { 0x9 } else { 0x1 });
            let mut payload = m.payload.bytes();
            payload.truncate(4096);
            let size = m.size_lie.map_or(payload.len() as u32, |s| s as u32 % 4200);
            let mut bytes = frontend::header(code, flags, size);
            bytes.extend_from_slice(&payload);
            let files: Vec<std::fs::File> = m
                .fds
                .iter()
                .take(10)
                .map(|f| match *f {
                    Fd::Event => {
                        let e = EventFd::new(EFD_NONBLOCK).unwrap();
                        // SAFETY: dup of a live eventfd, owned by the File alone.
                        unsafe { std::fs::File::from_raw_fd(libc::dup(e.as_raw_fd())) }
                    }
                    Fd::Memfd { pages, sealable } => memfd(pages % 64, sealable),
                })
                .collect();
            let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
            if sock.send_with_fds(&[&bytes[..]], &fds).is_err() {
                break; // the daemon closed the connection
            }
            sent += 1;
            drain(&mut sock);
        }
        fuzz::note(format!("prelude{}:sent{}", c.prelude % 4, sent.min(5)));
        // Complete any message whose size lied upwards (zeroes then parse as
        // an invalid header, which ends the session), and stop writing.
        let _ = sock.send_with_fds(&[&[0u8; 4096 + 12][..]], &[]);
        let _ = sock.shutdown(std::net::Shutdown::Write);
        let t = Instant::now();
        let mut buf = [0u8; 8192];
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        loop {
            match sock.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => break,
            }
            if t.elapsed() > SESSION_TIMEOUT {
                return Outcome::Finding(format!(
                    "the session did not end within {SESSION_TIMEOUT:?} of the frontend's last write"
                ));
            }
        }
        Outcome::Pass
    }

    /// The end-of-run checks: the victim export and a fresh connection.
    fn check_survivors(&mut self) {
        self.victim.check_io(8, 5, "export b after the run");
        let mut fresh = frontend::Frontend::ready(&self.sock_a);
        fresh.check_io(64, 7, "fresh connection on a after the run");
        drop(fresh);
        let _ = &self.sock_b;
    }
}

/// The bounded CI run (a few seconds); `VQBLK_FUZZ_SECONDS` makes it a long run.
#[test]
fn fuzz_vhost() {
    let mut rig = Rig::new();
    fuzz::run::<VhostCase, _>("vhost", 5_000, |c| rig.run_case(c));
    rig.check_survivors();
    println!("fuzz vhost: export b and a fresh connection on a still serve");
    drop(rig.daemon.take().map(Daemon::shutdown));
}
