//! A hostile vhost-user frontend against a `vqblk serve` process.
//!
//! Every test starts a daemon with two exports, `a` (attacked) and `b`
//! (the victim), both served by the same single IOThread, connects a
//! well-behaved frontend to `b`, attacks `a` with one hostile case, and then
//! checks three things ([`Rig::check`]):
//! 1. the daemon process is still alive;
//! 2. `b` still serves I/O (same IOThread as the attacked rings);
//! 3. a fresh connection on `a` does I/O correctly.
//!
//! Every wait is bounded (see `frontend::TIMEOUT`), so a daemon that freezes
//! fails a test instead of hanging the suite. docs/security.md lists the
//! cases and the behaviour they check.

mod common;
#[path = "common/frontend.rs"]
mod frontend;

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use frontend::*;

/// A daemon with two exports on one IOThread, and a connected victim on `b`.
struct Rig {
    child: Child,
    dir: PathBuf,
    sock_a: PathBuf,
    victim: Frontend,
    checks: u8,
}

impl Rig {
    fn new(name: &str) -> Rig {
        Rig::with_keys(name, "")
    }

    /// A rig whose configuration starts with the top-level `keys`.
    fn with_keys(name: &str, keys: &str) -> Rig {
        let dir = common::scratch(&format!("hostile-{name}"));
        let (sock_a, sock_b) = (dir.join("a.sock"), dir.join("b.sock"));
        let cfg = dir.join("serve.toml");
        let mut text = format!("{keys}[iothreads]\ncount = 1\npoll = \"off\"\n");
        for (n, s) in [("a", &sock_a), ("b", &sock_b)] {
            text += &format!(
                "[[export]]\nname = \"{n}\"\nimage = \"{}\"\ncreate = \"16M\"\nsocket = \"{}\"\n",
                dir.join(format!("{n}.raw")).display(),
                s.display()
            );
        }
        std::fs::write(&cfg, text).unwrap();
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_vqblk"))
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !(sock_a.exists() && sock_b.exists()) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "daemon never listened"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut victim = Frontend::ready(&sock_b);
        victim.check_io(0, 3, "victim before the attack");
        Rig {
            child,
            dir,
            sock_a,
            victim,
            checks: 0,
        }
    }

    /// The daemon's log so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    /// The three checks after an attack; consumes the attacker's connection.
    fn check(&mut self, attacker: Frontend, case: &str) {
        drop(attacker);
        self.alive(case);
        self.checks += 1;
        let seed = 5 + 2 * self.checks;
        self.victim.check_io(
            8 + self.checks as u64 * 8,
            seed,
            &format!("{case}: export b"),
        );
        self.alive(case);
        let mut fresh = Frontend::ready(&self.sock_a);
        fresh.check_io(64, seed, &format!("{case}: fresh connection on a"));
        drop(fresh);
        self.alive(case);
    }

    /// Waits (bounded) until the daemon's log holds `needle`.
    fn wait_log(&self, needle: &str) -> bool {
        let t = Instant::now();
        while t.elapsed() < TIMEOUT {
            if self.log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn alive(&mut self, case: &str) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("{case}: the daemon died ({status}); log:\n{}", self.log());
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A connection on `a` that negotiated features and owns the device.
fn owner(rig: &Rig) -> Frontend {
    let mut f = Frontend::connect(&rig.sock_a);
    f.negotiate();
    f
}

/// Waits for `n` used entries for at most `d` (for the cases where nothing is
/// expected: the ring must not run).
fn no_completion_within(f: &mut Frontend, d: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < d {
        if f.mem.read_u16(USED + 2) != f.used_seen {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

#[test]
fn oversized_message_closes_the_connection() {
    let mut rig = Rig::new("oversized");
    let mut f = owner(&rig);
    // A header announcing more than the protocol's 4 KiB limit.
    let mut m = header(req::SET_FEATURES, 0x1 | 0x8, 0x10000);
    m.extend_from_slice(&[0u8; 64]);
    f.raw_write(&m).unwrap();
    assert_eq!(f.recv(), Reply::Closed);
    rig.check(f, "oversized message");
}

#[test]
fn truncated_message_then_silence_is_bounded() {
    let mut rig = Rig::new("truncated");
    let mut f = owner(&rig);
    // Header says 8 bytes of payload; only 4 come, and the frontend keeps the
    // connection open: the daemon gives up on it, it does not wait forever.
    let mut m = header(req::SET_VRING_NUM, 0x1 | 0x8, 8);
    m.extend_from_slice(&0u32.to_le_bytes());
    f.raw_write(&m).unwrap();
    assert_eq!(f.recv(), Reply::Closed);
    rig.check(f, "truncated message");
}

#[test]
fn truncated_header_then_close() {
    let mut rig = Rig::new("truncated-header");
    let mut f = owner(&rig);
    f.raw_write(&header(req::SET_VRING_NUM, 0x1 | 0x8, 8)[..6])
        .unwrap();
    rig.check(f, "truncated header then close");
}

#[test]
fn wrong_payload_size_is_refused() {
    let mut rig = Rig::new("wrong-size");
    let mut f = owner(&rig);
    // SET_VRING_NUM with a 4-byte payload instead of 8.
    let r = f.call_ack(req::SET_VRING_NUM, &0u32.to_le_bytes(), &[]);
    assert!(r.refused(), "{r:?}");
    rig.check(f, "wrong payload size");
}

#[test]
fn messages_before_set_owner_are_refused() {
    let mut rig = Rig::new("before-owner");
    let mut f = Frontend::connect(&rig.sock_a);
    // Negotiate without SET_OWNER: features are allowed, device setup is not.
    let offered = match f.call_get(req::GET_FEATURES, &[]) {
        Reply::Data(p) => u64::from_le_bytes(p.try_into().unwrap()),
        r => panic!("{r:?}"),
    };
    f.send_flags(
        req::SET_FEATURES,
        1,
        &u64_payload(offered & !(1 << 29)),
        &[],
    )
    .unwrap();
    f.send_flags(req::SET_PROTOCOL_FEATURES, 1, &u64_payload(1 << 3), &[])
        .unwrap();
    let r = f.set_mem_table(&[f.whole_region()]);
    assert!(r.refused(), "SET_MEM_TABLE before SET_OWNER: {r:?}");
    if r != Reply::Closed {
        for (m, p) in [
            (req::SET_VRING_NUM, state(0, 16)),
            (req::SET_VRING_BASE, state(0, 0)),
            (req::SET_VRING_ENABLE, state(0, 1)),
        ] {
            let r = f.call_ack(m, &p, &[]);
            assert!(r.refused(), "request {m} before SET_OWNER: {r:?}");
        }
        // Once it owns the device, the same connection works.
        assert!(f.call_ack(req::SET_OWNER, &[], &[]).ok());
        assert!(f.set_mem_table(&[f.whole_region()]).ok());
        assert!(f.setup_ring(0).ok());
        f.check_io(16, 9, "after SET_OWNER");
    }
    rig.check(f, "messages before SET_OWNER");
}

#[test]
fn vring_index_out_of_range_on_every_ack_message() {
    let mut rig = Rig::new("vring-index");
    let mut f = owner(&rig);
    assert!(f.set_mem_table(&[f.whole_region()]).ok());
    let kick = f.kick.as_raw_fd();
    for index in [1u32, 2, 255, 0x8000_0000, u32::MAX] {
        for (m, p) in [
            (req::SET_VRING_NUM, state(index, 16)),
            (req::SET_VRING_BASE, state(index, 0)),
            (req::SET_VRING_ADDR, f.ring_addr(index)),
            (req::SET_VRING_ENABLE, state(index, 1)),
            (req::SET_VRING_ENABLE, state(index, 0)),
        ] {
            let r = f.call_ack(m, &p, &[]);
            assert!(
                matches!(r, Reply::Ack(n) if n != 0),
                "request {m} on vring {index}: {r:?}"
            );
        }
        // The fd messages carry the index in the low 8 bits.
        if index < 256 {
            for m in [req::SET_VRING_KICK, req::SET_VRING_CALL, req::SET_VRING_ERR] {
                let r = f.call_ack(m, &u64_payload(index as u64), &[kick]);
                assert!(
                    matches!(r, Reply::Ack(n) if n != 0),
                    "request {m} on vring {index}: {r:?}"
                );
            }
        }
    }
    // The connection is intact: ring 0 still sets up and serves.
    assert!(f.setup_ring(0).ok());
    f.check_io(24, 11, "same connection after the refusals");
    rig.check(f, "vring index out of range");
}

#[test]
fn get_vring_base_out_of_range_is_answered() {
    let mut rig = Rig::new("get-vring-base");
    let mut f = owner(&rig);
    let r = f.call_get(req::GET_VRING_BASE, &state(7, 0));
    // The protocol has no error form for this reply: the daemon closes the
    // connection rather than leave the frontend waiting.
    assert_eq!(r, Reply::Closed, "GET_VRING_BASE on vring 7");
    rig.check(f, "GET_VRING_BASE out of range");
}

#[test]
fn region_bigger_than_its_file_is_refused() {
    let mut rig = Rig::new("region-big");
    let mut f = owner(&rig);
    let mut r = f.whole_region();
    r.size = 2 * MEM_SIZE;
    let reply = f.set_mem_table(&[r]);
    assert!(reply.refused(), "{reply:?}");
    assert!(
        rig.log().contains("beyond the end of its file"),
        "{}",
        rig.log()
    );
    rig.check(f, "region bigger than its file");
}

#[test]
fn region_offset_past_eof_is_refused() {
    let mut rig = Rig::new("region-offset");
    let mut f = owner(&rig);
    let mut r = f.whole_region();
    r.size = 0x10000;
    r.mmap_offset = 2 * MEM_SIZE;
    let reply = f.set_mem_table(&[r]);
    assert!(reply.refused(), "{reply:?}");
    // Offset + size overflowing 2^64 is refused too.
    r.mmap_offset = u64::MAX - 0x1000;
    let reply = f.set_mem_table(&[r]);
    assert!(reply.refused(), "{reply:?}");
    rig.check(f, "mmap offset past end of file");
}

#[test]
fn region_not_a_regular_file_is_refused() {
    let mut rig = Rig::new("region-kind");
    let mut f = owner(&rig);
    let r = Region {
        gpa: 0,
        size: 0x10000,
        user_addr: 0x7000_0000,
        mmap_offset: 0,
    };
    // An eventfd where a memory file belongs.
    let fd = f.kick.as_raw_fd();
    let reply = f.call_ack(req::SET_MEM_TABLE, &mem_table(&[r]), &[fd]);
    assert!(reply.refused(), "{reply:?}");
    rig.check(f, "region backed by a non-file");
}

#[test]
fn overlapping_regions_are_refused() {
    let mut rig = Rig::new("overlap");
    let mut f = owner(&rig);
    let u = f.mem.user_addr();
    // Guest-physical overlap.
    let a = Region {
        gpa: 0,
        size: 0x80000,
        user_addr: u,
        mmap_offset: 0,
    };
    let b = Region {
        gpa: 0x40000,
        size: 0x80000,
        user_addr: u + 0x80000,
        mmap_offset: 0x40000,
    };
    let reply = f.set_mem_table(&[a, b]);
    assert!(reply.refused(), "guest-physical overlap: {reply:?}");
    // Frontend-virtual overlap (distinct guest ranges).
    let c = Region {
        gpa: 0x80000,
        size: 0x80000,
        user_addr: u + 0x40000,
        mmap_offset: 0x80000,
    };
    let reply = f.set_mem_table(&[a, c]);
    assert!(reply.refused(), "user-address overlap: {reply:?}");
    rig.check(f, "overlapping regions");
}

#[test]
fn too_many_regions_are_refused() {
    let mut rig = Rig::new("many-regions");
    let mut f = owner(&rig);
    // 33 regions in one SET_MEM_TABLE: beyond the protocol's 32 fds.
    let regions: Vec<Region> = (0..33u64)
        .map(|i| Region {
            gpa: i * 0x1000,
            size: 0x1000,
            user_addr: f.mem.user_addr() + i * 0x1000,
            mmap_offset: i * 0x1000,
        })
        .collect();
    let reply = f.set_mem_table(&regions);
    assert!(reply.refused(), "33 regions: {reply:?}");
    drop(f);
    // ADD_MEM_REG beyond the advertised slot count.
    let mut f = owner(&rig);
    let slots = match f.call_get(req::GET_MAX_MEM_SLOTS, &[]) {
        Reply::Data(p) => u64::from_le_bytes(p.try_into().unwrap()),
        r => panic!("{r:?}"),
    };
    let fd = f.mem.file.as_raw_fd();
    for i in 0..slots {
        let r = Region {
            gpa: i * 0x1000,
            size: 0x1000,
            user_addr: 0x1_0000_0000 + i * 0x1000,
            mmap_offset: 0,
        };
        let reply = f.call_ack(req::ADD_MEM_REG, &single_region(&r), &[fd]);
        assert!(reply.ok(), "slot {i} of {slots}: {reply:?}");
    }
    let r = Region {
        gpa: slots * 0x1000,
        size: 0x1000,
        user_addr: 0x1_0000_0000 + slots * 0x1000,
        mmap_offset: 0,
    };
    let reply = f.call_ack(req::ADD_MEM_REG, &single_region(&r), &[fd]);
    assert!(
        reply.refused(),
        "region {} of {slots} slots: {reply:?}",
        slots + 1
    );
    rig.check(f, "too many regions");
}

#[test]
fn memfd_truncated_after_mapping_cannot_fault_the_daemon() {
    let mut rig = Rig::new("truncate");
    let mut f = Frontend::ready(&rig.sock_a);
    // The daemon sealed the memfd against shrinking when it mapped it.
    let r = f.mem.file.set_len(0x1000);
    assert!(r.is_err(), "the frontend could shrink mapped guest memory");
    f.check_io(32, 13, "after the truncation attempt");
    rig.check(f, "memfd truncated after mapping");
}

/// A connection on `a` whose guest memory is a memfd created without
/// `MFD_ALLOW_SEALING`: the daemon cannot seal it against shrinking.
fn unsealable_owner(rig: &Rig) -> Frontend {
    let mut f = Frontend::connect(&rig.sock_a);
    f.mem = GuestMemory::with_flags(MEM_SIZE, 0);
    f.negotiate();
    f
}

/// Whether the daemon closed `f`'s connection within [`TIMEOUT`] (end of
/// stream, nothing sent before it).
fn closed_by_daemon(f: &mut Frontend) -> bool {
    use std::io::Read;
    let mut b = [0u8; 1];
    matches!(f.sock.read(&mut b), Ok(0))
}

/// The frontend truncates unsealable guest memory after SET_MEM_TABLE and
/// kicks a request whose header lies in the part that is gone: the IOThread
/// faults (SIGBUS) parsing it. The fault handler replaces the mapping, the
/// daemon logs the fault and closes that connection only; the other export
/// and a new connection on the same one serve I/O. Without the handler the
/// daemon dies here (and every export with it).
#[test]
fn unsealable_memory_truncated_after_mapping_ends_only_its_connection() {
    let mut rig = Rig::new("unsealable");
    let mut f = unsealable_owner(&rig);
    assert!(f.set_mem_table(&[f.whole_region()]).ok(), "SET_MEM_TABLE");
    assert!(f.setup_ring(0).ok(), "ring setup");
    f.check_io(32, 17, "before the truncation");
    // Rings, header and status (below DATA) stay; the rest of the file goes.
    f.mem
        .file
        .set_len(DATA)
        .expect("an unsealable memfd can shrink");
    let gone = DATA + 0x4000;
    f.set_desc(0, gone, 16, DESC_NEXT, 1);
    f.set_desc(1, STATUS, 1, DESC_WRITE, 0);
    f.push(0);
    assert!(
        closed_by_daemon(&mut f),
        "the connection stayed open; log:\n{}",
        rig.log()
    );
    rig.alive("unsealable memory truncated");
    assert!(
        rig.wait_log("closing the connection: memory fault: SIGBUS"),
        "no fault in the log:\n{}",
        rig.log()
    );
    rig.check(f, "unsealable memory truncated");
}

/// A write whose data lies in truncated unsealable memory, misaligned for
/// O_DIRECT so that the daemon copies it into a bounce buffer itself: the
/// copy faults, the handler gives it zeros, and the request must fail rather
/// than write those zeros over the sector as if the guest had sent them.
#[test]
fn a_write_from_truncated_memory_does_not_reach_the_disk() {
    let mut rig = Rig::new("unsealable-write");
    let mut f = unsealable_owner(&rig);
    assert!(f.set_mem_table(&[f.whole_region()]).ok(), "SET_MEM_TABLE");
    assert!(f.setup_ring(0).ok(), "ring setup");
    let (sector, seed) = (40, 29);
    f.check_io(sector, seed, "the sector before the attack");
    f.mem
        .file
        .set_len(DATA)
        .expect("an unsealable memfd can shrink");
    f.prepare_request(T_OUT, sector);
    f.set_desc(0, HDR, 16, DESC_NEXT, 1);
    f.set_desc(1, DATA + 0x4001, 4096, DESC_NEXT, 2);
    f.set_desc(2, STATUS, 1, DESC_WRITE, 0);
    f.push(0);
    assert!(
        closed_by_daemon(&mut f),
        "the connection stayed open; log:\n{}",
        rig.log()
    );
    assert!(
        rig.wait_log("closing the connection: memory fault: SIGBUS"),
        "no fault in the log:\n{}",
        rig.log()
    );
    drop(f);
    rig.alive("write from truncated memory");
    let mut fresh = Frontend::ready(&rig.sock_a);
    assert_eq!(fresh.request(T_IN, sector, 4096), Some(S_OK), "read back");
    let before: Vec<u8> = (0..4096u32)
        .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
        .collect();
    assert!(
        fresh.mem.read(DATA, 4096) == before,
        "the sector changed: the zeros of the replaced memory were written"
    );
    rig.check(fresh, "write from truncated memory");
}

/// Under `memory-sealing = "required"` unsealable guest memory is refused
/// (a failing ack), the frontend is disconnected and the log says why;
/// sealable memory is still served.
#[test]
fn required_sealing_refuses_unsealable_memory() {
    let mut rig = Rig::with_keys("sealing-required", "memory-sealing = \"required\"\n");
    let mut f = unsealable_owner(&rig);
    let reply = f.set_mem_table(&[f.whole_region()]);
    assert!(reply.refused(), "unsealable memory accepted: {reply:?}");
    assert!(closed_by_daemon(&mut f), "the frontend stayed connected");
    assert!(
        rig.wait_log("cannot be sealed against shrinking (memory-sealing = required)"),
        "no reason in the log:\n{}",
        rig.log()
    );
    // The rig's own frontends share sealable memfds: served as before.
    rig.check(f, "unsealable memory under memory-sealing = required");
}

/// The policy covers the inflight region too: SET_INFLIGHT_FD with a copy
/// of the region in a memfd that cannot be sealed is refused under
/// `required`, and the frontend disconnected.
#[test]
fn required_sealing_refuses_an_unsealable_inflight_region() {
    let mut rig = Rig::with_keys(
        "sealing-required-inflight",
        "memory-sealing = \"required\"\n",
    );
    let mut f = Frontend::connect(&rig.sock_a);
    f.negotiate_with(PF_INFLIGHT_SHMFD);
    let (desc, _ours) = f.get_inflight_fd(1, QSIZE).expect("GET_INFLIGHT_FD");
    let copy = GuestMemory::with_flags(desc.mmap_size, 0);
    let reply = f.set_inflight_fd(&desc, &copy.file);
    assert!(
        reply.refused(),
        "unsealable inflight region accepted: {reply:?}"
    );
    assert!(closed_by_daemon(&mut f), "the frontend stayed connected");
    assert!(
        rig.wait_log("the inflight region cannot be sealed against shrinking"),
        "no reason in the log:\n{}",
        rig.log()
    );
    rig.check(
        f,
        "unsealable inflight region under memory-sealing = required",
    );
}

#[test]
fn bad_vring_num_leaves_the_ring_unstartable() {
    let mut rig = Rig::new("vring-num");
    for num in [0u32, 3, 512, 1 << 16] {
        let mut f = owner(&rig);
        assert!(f.set_mem_table(&[f.whole_region()]).ok());
        let r = f.call_ack(req::SET_VRING_NUM, &state(0, num), &[]);
        assert!(r.refused(), "SET_VRING_NUM {num}: {r:?}");
        // Everything else a ring needs; the ring must still not run.
        for (m, p) in [
            (req::SET_VRING_BASE, state(0, 0)),
            (req::SET_VRING_ADDR, f.ring_addr(0)),
        ] {
            assert!(f.call_ack(m, &p, &[]).ok());
        }
        let (kick, call) = (f.kick.as_raw_fd(), f.call.as_raw_fd());
        assert!(f
            .call_ack(req::SET_VRING_CALL, &u64_payload(0), &[call])
            .ok());
        let _ = f.call_ack(req::SET_VRING_KICK, &u64_payload(0), &[kick]);
        let _ = f.call_ack(req::SET_VRING_ENABLE, &state(0, 1), &[]);
        f.prepare_request(T_IN, 0);
        f.set_desc(0, HDR, 16, DESC_NEXT, 1);
        f.set_desc(1, DATA, 4096, DESC_WRITE | DESC_NEXT, 2);
        f.set_desc(2, STATUS, 1, DESC_WRITE, 0);
        f.push(0);
        assert!(
            no_completion_within(&mut f, Duration::from_millis(300)),
            "SET_VRING_NUM {num} was refused, yet the ring ran"
        );
        // A valid size, then the ring starts with the next kick fd.
        assert!(f.call_ack(req::SET_VRING_NUM, &state(0, 16), &[]).ok());
        assert!(f
            .call_ack(req::SET_VRING_KICK, &u64_payload(0), &[kick])
            .ok());
        assert!(f.wait_used(1).is_some(), "ring {num}: never started");
        f.check_io(40, 15, "after a valid SET_VRING_NUM");
        drop(f);
    }
    let f = owner(&rig);
    rig.check(f, "bad SET_VRING_NUM");
}

#[test]
fn payload_split_across_writes_is_accepted() {
    let mut rig = Rig::new("split");
    let mut f = owner(&rig);
    assert!(f.set_mem_table(&[f.whole_region()]).ok());
    // Header alone, then the payload.
    f.raw_write(&header(req::SET_VRING_NUM, 0x1 | 0x8, 8))
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    f.raw_write(&state(0, 16)).unwrap();
    assert_eq!(
        f.recv(),
        Reply::Data(u64_payload(0)),
        "header, then payload"
    );
    // Header with half the payload, then the rest.
    let mut m = header(req::SET_VRING_BASE, 0x1 | 0x8, 8);
    m.extend_from_slice(&0u32.to_le_bytes());
    f.raw_write(&m).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    f.raw_write(&0u32.to_le_bytes()).unwrap();
    assert_eq!(
        f.recv(),
        Reply::Data(u64_payload(0)),
        "payload in two writes"
    );
    // A memory table whose fd comes with the header, payload later.
    let t = mem_table(&[f.whole_region()]);
    let mut m = header(req::SET_MEM_TABLE, 0x1 | 0x8, t.len() as u32);
    m.extend_from_slice(&t[..8]);
    f.raw_write_fds(&m, &[f.mem.file.as_raw_fd()]).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    f.raw_write(&t[8..]).unwrap();
    assert_eq!(f.recv(), Reply::Data(u64_payload(0)), "SET_MEM_TABLE split");
    let addr = f.ring_addr(0);
    assert!(f.call_ack(req::SET_VRING_ADDR, &addr, &[]).ok());
    let (kick, call) = (f.kick.as_raw_fd(), f.call.as_raw_fd());
    assert!(f
        .call_ack(req::SET_VRING_CALL, &u64_payload(0), &[call])
        .ok());
    assert!(f
        .call_ack(req::SET_VRING_KICK, &u64_payload(0), &[kick])
        .ok());
    assert!(f.call_ack(req::SET_VRING_ENABLE, &state(0, 1), &[]).ok());
    f.check_io(48, 17, "after split messages");
    rig.check(f, "payload split across writes");
}

/// Publishes a chain made by `build` and expects the daemon to complete it
/// (a used entry) with an IOERR status, or at least to stay healthy.
fn malformed_chain(case: &str, build: impl Fn(&Frontend)) {
    let mut rig = Rig::new(case);
    let mut f = Frontend::ready(&rig.sock_a);
    f.prepare_request(T_IN, 0);
    build(&f);
    f.push(0);
    let used = f.wait_used(1);
    assert!(
        used.is_some(),
        "{case}: no used entry for the malformed chain"
    );
    // The ring keeps serving after the malformed chain.
    f.check_io(56, 19, &format!("{case}: same ring afterwards"));
    rig.check(f, case);
}

#[test]
fn descriptor_loop() {
    malformed_chain("desc-loop", |f| {
        f.set_desc(0, HDR, 16, DESC_NEXT, 1);
        f.set_desc(1, DATA, 512, DESC_WRITE | DESC_NEXT, 2);
        f.set_desc(2, DATA + 512, 512, DESC_WRITE | DESC_NEXT, 1);
    });
}

#[test]
fn nested_indirect_table() {
    malformed_chain("nested-indirect", |f| {
        f.set_desc(0, INDIRECT, 48, DESC_INDIRECT, 0);
        f.set_desc_at(INDIRECT, 0, HDR, 16, DESC_NEXT, 1);
        f.set_desc_at(
            INDIRECT,
            1,
            INDIRECT + 0x100,
            32,
            DESC_INDIRECT | DESC_NEXT,
            2,
        );
        f.set_desc_at(INDIRECT, 2, STATUS, 1, DESC_WRITE, 0);
        f.set_desc_at(INDIRECT + 0x100, 0, DATA, 512, DESC_WRITE | DESC_NEXT, 1);
        f.set_desc_at(INDIRECT + 0x100, 1, STATUS, 1, DESC_WRITE, 0);
    });
}

#[test]
fn misaligned_indirect_table() {
    malformed_chain("misaligned-indirect", |f| {
        // Length not a multiple of 16 (virtio 1.2, 2.7.5.3.1), address odd.
        f.set_desc(0, INDIRECT + 1, 40, DESC_INDIRECT, 0);
        f.set_desc_at(INDIRECT, 0, HDR, 16, DESC_NEXT, 1);
        f.set_desc_at(INDIRECT, 1, STATUS, 1, DESC_WRITE, 0);
    });
}

/// A head index beyond the queue size is an impossible ring state, and must
/// not vanish without a trace: the ring is stopped, counted and logged, like
/// any broken ring; a valid request after it is not served on
/// that ring (the frontend must set the ring up again), and the three checks
/// hold.
#[test]
fn head_index_beyond_queue_size() {
    let mut rig = Rig::new("head-range");
    let mut f = Frontend::ready(&rig.sock_a);
    f.prepare_request(T_IN, 0);
    f.push(100);
    assert!(
        no_completion_within(&mut f, Duration::from_millis(200)),
        "head 100 on a 16-entry ring was completed"
    );
    rig.check(f, "head index beyond queue size");
}

#[test]
fn vring_base_beyond_avail_ring_and_kick() {
    let mut rig = Rig::new("base-beyond");
    let mut f = owner(&rig);
    assert!(f.set_mem_table(&[f.whole_region()]).ok());
    assert!(f.setup_ring(0).ok());
    // Stop the ring, restart it from avail index 1000 on a 16-entry ring.
    assert!(matches!(
        f.call_get(req::GET_VRING_BASE, &state(0, 0)),
        Reply::Data(_)
    ));
    assert!(f.call_ack(req::SET_VRING_BASE, &state(0, 1000), &[]).ok());
    let kick = f.kick.as_raw_fd();
    assert!(f
        .call_ack(req::SET_VRING_KICK, &u64_payload(0), &[kick])
        .ok());
    assert!(f.call_ack(req::SET_VRING_ENABLE, &state(0, 1), &[]).ok());
    f.kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    rig.check(f, "SET_VRING_BASE beyond the avail ring");
}

#[test]
fn avail_index_jump_beyond_queue_size() {
    let mut rig = Rig::new("avail-jump");
    let f = Frontend::ready(&rig.sock_a);
    f.mem.write_u16(AVAIL + 2, 100);
    f.kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    rig.check(f, "avail index jump");
}

#[test]
fn ring_addresses_outside_guest_memory_are_refused() {
    let mut rig = Rig::new("ring-addr");
    let mut f = owner(&rig);
    assert!(f.set_mem_table(&[f.whole_region()]).ok());
    let u = f.mem.user_addr();
    for (d, us, a) in [
        (u + MEM_SIZE, u + USED, u + AVAIL),
        (0x1234, u + USED, u + AVAIL),
    ] {
        let r = f.call_ack(req::SET_VRING_ADDR, &vring_addr(0, d, us, a), &[]);
        assert!(r.refused(), "{r:?}");
    }
    rig.check(f, "ring addresses outside guest memory");
}

/// Ring addresses whose guest-physical address breaks the virtqueue
/// alignment (virtio 1.2, 2.7: descriptor table 16 bytes, avail ring 2, used
/// ring 4). The `vhost` crate refuses a misaligned frontend address, but a
/// memory table whose regions' frontend and guest addresses differ modulo 16
/// turns an aligned frontend address into a misaligned guest address. The
/// `virtio-queue` crate's setters log such an address and keep the old one
/// (0): the ring would have started on guest address 0, where this frontend
/// keeps its descriptor table, and written used entries over it. Each one is
/// refused, the ring does not start, nothing in guest memory changes.
#[test]
fn misaligned_ring_addresses_are_refused() {
    let mut rig = Rig::new("ring-align");
    let mut f = owner(&rig);
    // One region per ring part (descriptor table, avail ring, used ring and
    // the rest), each at its own frontend address, `skew` bytes off its guest
    // address modulo 16.
    let parts = [(DESC, 16u64), (AVAIL, 2), (USED, 4)];
    let gpa = [0, AVAIL, USED];
    let size = [AVAIL, USED - AVAIL, MEM_SIZE - USED];
    for (what, part, skew) in [
        ("descriptor table", 0, 8u64),
        ("avail ring", 1, 1),
        ("used ring", 2, 2),
    ] {
        let regions: Vec<Region> = (0..3)
            .map(|i| Region {
                gpa: gpa[i],
                size: size[i],
                user_addr: 0x10_0000_0000 * (i as u64 + 1) + if i == part { skew } else { 0 },
                mmap_offset: gpa[i],
            })
            .collect();
        assert!(f.set_mem_table(&regions).ok(), "{what}: memory table");
        // Aligned frontend addresses; the skewed part's guest address is not.
        let va: Vec<u64> = (0..3)
            .map(|i| {
                let (ring, align) = parts[i];
                (regions[i].user_addr + ring - gpa[i]).next_multiple_of(align)
            })
            .collect();
        for (r, p) in [
            (req::SET_VRING_NUM, state(0, QSIZE as u32)),
            (req::SET_VRING_BASE, state(0, 0)),
        ] {
            assert!(f.call_ack(r, &p, &[]).ok());
        }
        let r = f.call_ack(
            req::SET_VRING_ADDR,
            &vring_addr(0, va[0], va[2], va[1]),
            &[],
        );
        assert!(r.refused(), "misaligned {what}: {r:?}");
        // The rest of the setup, then a request: the ring must not run.
        let (kick, call) = (f.kick.as_raw_fd(), f.call.as_raw_fd());
        let _ = f.call_ack(req::SET_VRING_CALL, &u64_payload(0), &[call]);
        let _ = f.call_ack(req::SET_VRING_KICK, &u64_payload(0), &[kick]);
        let _ = f.call_ack(req::SET_VRING_ENABLE, &state(0, 1), &[]);
        f.prepare_request(T_IN, 0);
        let table = f.mem.read(0, 0x100);
        f.push(0);
        assert!(
            no_completion_within(&mut f, Duration::from_millis(100)),
            "misaligned {what}: the ring ran"
        );
        assert_eq!(
            f.mem.read(0, 0x100),
            table,
            "misaligned {what}: the daemon wrote at guest address 0"
        );
        let r = f.call_get(req::GET_VRING_BASE, &state(0, 0));
        assert!(matches!(r, Reply::Data(_)), "{what}: GET_VRING_BASE: {r:?}");
        f.mem.write_u16(AVAIL + 2, 0);
        f.avail_idx = 0;
    }
    assert!(rig.log().contains("-byte aligned"), "{}", rig.log());
    // The same connection maps its memory plainly, sets the ring up and serves.
    assert!(f.set_mem_table(&[f.whole_region()]).ok());
    assert!(f.setup_ring(0).ok());
    f.check_io(72, 21, "aligned addresses after the refusals");
    rig.check(f, "misaligned ring addresses");
}

/// The protocol features a fresh connection on `a` is offered.
fn offered_protocol_features(rig: &Rig) -> u64 {
    let mut f = Frontend::connect(&rig.sock_a);
    match f.call_get(req::GET_PROTOCOL_FEATURES, &[]) {
        Reply::Data(p) => u64::from_le_bytes(p.try_into().unwrap()),
        r => panic!("GET_PROTOCOL_FEATURES: {r:?}"),
    }
}

/// INFLIGHT_SHMFD is always offered: a frontend that negotiates it can
/// restore its rings after a daemon crash without losing or repeating a
/// request (a frontend that does not negotiate it is tests/common/frontend.rs).
#[test]
fn inflight_is_offered() {
    let rig = Rig::new("inflight-on");
    assert_ne!(offered_protocol_features(&rig) & PF_INFLIGHT_SHMFD, 0);
}
