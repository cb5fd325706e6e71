//! Inflight I/O tracking (vhost-user INFLIGHT_SHMFD) across a daemon that is
//! killed with SIGKILL and started again on the same socket, driven by the raw
//! test frontend acting as QEMU does: it negotiates the feature, gets the
//! region with GET_INFLIGHT_FD and hands it back with SET_INFLIGHT_FD (the same
//! memfd) on every connection, and after losing the backend it sets the ring's
//! base to the used index it finds in guest memory (what QEMU sends when
//! GET_VRING_BASE could not be answered).
//!
//! The requests in flight at the kill are writes on a null export with a 1 s
//! latency; the requests completed before it are GET_ID requests, answered at
//! once, made available *between* the writes, so the used ring holds
//! completions out of avail order: exactly the case the used index alone cannot
//! recover (docs/qemu.md). Against a daemon that does not offer the feature the
//! frontend proceeds as QEMU would without it, and the test fails: the first
//! write is never completed and a GET_ID is executed twice.

mod common;
use common::serve_process::ServeProcess;
#[path = "common/frontend.rs"]
mod frontend;

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use frontend::*;

/// VIRTIO_BLK_T_GET_ID.
const T_GET_ID: u32 = 8;
/// Null backend latency: the writes stay in flight this long.
const LATENCY_NS: u64 = 1_000_000_000;

/// A `vqblk serve` process on a null export with one queue.
fn start(dir: &Path, sock: &Path, run: u32) -> ServeProcess {
    start_with(dir, sock, run, &[])
}

fn start_with(dir: &Path, sock: &Path, run: u32, extra: &[&str]) -> ServeProcess {
    let latency = LATENCY_NS.to_string();
    let mut args = vec![
        "--backend",
        "null",
        "--size",
        "16M",
        "--queues",
        "1",
        "--iothreads",
        "1",
        "--poll",
        "off",
        "--log-level",
        "debug",
        "--latency-ns",
        &latency,
        "--socket",
    ]
    .into_iter()
    .map(std::ffi::OsStr::new)
    .collect::<Vec<_>>();
    args.push(sock.as_os_str());
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    ServeProcess::spawn(dir, run, args)
}

/// Request `i` lives on heads 3i (header), 3i+1 (data), 3i+2 (status); its
/// head is 3i.
fn head(i: u16) -> u16 {
    3 * i
}
fn hdr(i: u16) -> u64 {
    HDR + 16 * i as u64
}
fn status(i: u16) -> u64 {
    STATUS + i as u64
}
fn data(i: u16) -> u64 {
    DATA + 4096 * i as u64
}

/// Lays out request `i` of type `kind` at `sector` (writes: 4 KiB out;
/// GET_ID: 20 bytes in) with a 0xff status sentinel.
fn lay_out(f: &Frontend, i: u16, kind: u32, sector: u64) {
    let mut h = kind.to_le_bytes().to_vec();
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&sector.to_le_bytes());
    f.mem.write(hdr(i), &h);
    f.mem.write(status(i), &[0xff]);
    let (len, flags) = match kind {
        T_OUT => (4096, 0),
        _ => (20, DESC_WRITE),
    };
    f.mem.write(data(i), &vec![0u8; len as usize]);
    let h0 = head(i);
    f.set_desc(h0, hdr(i), 16, DESC_NEXT, h0 + 1);
    f.set_desc(h0 + 1, data(i), len, flags | DESC_NEXT, h0 + 2);
    f.set_desc(h0 + 2, status(i), 1, DESC_WRITE, 0);
}

/// The region the frontend keeps across backend restarts (QEMU's copy).
struct Kept {
    desc: InflightDesc,
    file: File,
}

/// Connection setup as QEMU does it: features, the inflight region when the
/// daemon offers it (asked for on the first connection, handed back on the
/// next), memory, and the ring with `base`.
fn setup(f: &mut Frontend, kept: &mut Option<Kept>, base: u16) -> bool {
    let pf = f.negotiate_with(PF_INFLIGHT_SHMFD);
    let offered = pf & PF_INFLIGHT_SHMFD != 0;
    if offered {
        if kept.is_none() {
            let (desc, file) = f
                .get_inflight_fd(1, f.qsize)
                .expect("GET_INFLIGHT_FD reply");
            assert_eq!((desc.num_queues, desc.queue_size), (1, f.qsize));
            assert!(desc.mmap_size >= 16 + 16 * f.qsize as u64);
            assert_eq!(file.metadata().unwrap().len(), desc.mmap_size);
            *kept = Some(Kept { desc, file });
        }
        let k = kept.as_ref().unwrap();
        let r = f.set_inflight_fd(&k.desc, &k.file);
        assert!(r.ok(), "SET_INFLIGHT_FD: {r:?}");
    }
    assert!(f.set_mem_table(&[f.whole_region()]).ok(), "SET_MEM_TABLE");
    let r = f.setup_ring_base(0, base);
    assert!(r.ok(), "ring setup: {r:?}");
    offered
}

/// Used entries seen within `d` beyond those already seen.
fn used_within(f: &mut Frontend, d: Duration) -> Vec<u32> {
    let t = Instant::now();
    let mut ids = Vec::new();
    while t.elapsed() < d {
        if let Some(entries) = f.wait_used(1) {
            ids.extend(entries.iter().map(|e| e.0));
        }
    }
    ids
}

#[test]
fn requests_in_flight_at_a_kill_complete_once_after_restart() {
    let dir = common::scratch("inflight-kill");
    let sock = dir.join("null.sock");
    let mut d1 = start(&dir, &sock, 1);
    let mut f = Frontend::connect_when_listening(&sock);
    let mut kept = None;
    let offered = setup(&mut f, &mut kept, 0);

    // Avail order: write 0 (slow), GET_ID 1 (at once), write 2 (slow), GET_ID 3.
    lay_out(&f, 0, T_OUT, 0);
    lay_out(&f, 1, T_GET_ID, 0);
    lay_out(&f, 2, T_OUT, 8);
    lay_out(&f, 3, T_GET_ID, 0);
    for i in 0..4 {
        f.push(head(i));
    }
    let done = f
        .wait_used(2)
        .expect("the GET_ID requests complete at once");
    let mut ids: Vec<u32> = done.iter().map(|e| e.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, [head(1) as u32, head(3) as u32], "{}", d1.log());
    for i in [1, 3] {
        assert_eq!(f.mem.read(status(i), 1)[0], S_OK);
        // Reset, so a second execution would show.
        f.mem.write(status(i), &[0xff]);
        f.mem.write(data(i), &[0u8; 20]);
    }
    // The writes are still in flight (1 s latency): kill now.
    d1.kill();
    let used = f.mem.read_u16(USED + 2);
    assert_eq!(used, 2);

    let d2 = start(&dir, &sock, 2);
    assert!(
        f.reconnect(&sock, Duration::from_secs(10)),
        "daemon 2 never listened"
    );
    // QEMU could not ask the dead daemon for the ring base: it sends the used index.
    assert_eq!(setup(&mut f, &mut kept, used), offered);

    let ids = used_within(&mut f, Duration::from_millis(2500));
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        [head(0) as u32, head(2) as u32],
        "after the restart exactly the two writes in flight complete, once each \
         (used ids {ids:?}); daemon 2 log:\n{}",
        d2.log()
    );
    for i in [0, 2] {
        assert_eq!(f.mem.read(status(i), 1)[0], S_OK, "write {i} status");
    }
    for i in [1, 3] {
        assert_eq!(
            f.mem.read(status(i), 1)[0],
            0xff,
            "GET_ID {i} completed before the kill was executed again"
        );
    }
    assert!(
        d2.log().contains("2 requests to execute again"),
        "{}",
        d2.log()
    );

    // And the ring goes on: a new request completes normally.
    lay_out(&f, 4, T_OUT, 16);
    f.push(head(4));
    let ids = used_within(&mut f, Duration::from_millis(1500));
    assert_eq!(ids, [head(4) as u32]);
    assert_eq!(f.mem.read(status(4), 1)[0], S_OK);
    assert!(offered, "the daemon does not offer INFLIGHT_SHMFD");
}

#[test]
fn requests_completed_in_order_are_not_redone_after_a_kill() {
    // Everything completed before the kill: the region has nothing in flight,
    // the restarted daemon resubmits nothing and continues at the used index.
    let dir = common::scratch("inflight-idle-kill");
    let sock = dir.join("null.sock");
    let mut d1 = start(&dir, &sock, 1);
    let mut f = Frontend::connect_when_listening(&sock);
    let mut kept = None;
    assert!(setup(&mut f, &mut kept, 0), "INFLIGHT_SHMFD offered");
    for i in 0..3 {
        lay_out(&f, i, T_GET_ID, 0);
        f.push(head(i));
    }
    assert_eq!(f.wait_used(3).map(|v| v.len()), Some(3));
    d1.kill();
    let d2 = start(&dir, &sock, 2);
    assert!(f.reconnect(&sock, Duration::from_secs(10)));
    assert!(setup(&mut f, &mut kept, 3));
    for i in 0..3 {
        f.mem.write(status(i), &[0xff]);
    }
    assert!(used_within(&mut f, Duration::from_millis(300)).is_empty());
    lay_out(&f, 3, T_GET_ID, 0);
    f.push(head(3));
    assert_eq!(
        used_within(&mut f, Duration::from_millis(300)),
        [head(3) as u32]
    );
    for i in 0..3 {
        assert_eq!(f.mem.read(status(i), 1)[0], 0xff, "request {i} redone");
    }
    drop(d2);
}

#[test]
fn a_region_that_does_not_fit_is_refused_not_mapped() {
    let dir = common::scratch("inflight-refused");
    let sock = dir.join("null.sock");
    let d = start(&dir, &sock, 1);
    let mut f = Frontend::connect_when_listening(&sock);
    assert!(f.negotiate_with(PF_INFLIGHT_SHMFD) & PF_INFLIGHT_SHMFD != 0);
    let (desc, file) = f.get_inflight_fd(1, QSIZE).expect("GET_INFLIGHT_FD");
    // Larger than the file: mapping it would fault when touched.
    let long = InflightDesc {
        mmap_size: 1088,
        queue_size: 64,
        ..desc
    };
    assert!(
        f.set_inflight_fd(&long, &file).refused(),
        "oversized region"
    );
    let short = InflightDesc {
        mmap_size: desc.mmap_size - 64,
        ..desc
    };
    assert!(
        f.set_inflight_fd(&short, &file).refused(),
        "short description"
    );
    let offset = InflightDesc {
        mmap_offset: 4096,
        ..desc
    };
    assert!(
        f.set_inflight_fd(&offset, &file).refused(),
        "offset past the end"
    );
    // More queues than the export has.
    assert!(
        f.get_inflight_fd(9, QSIZE).is_none(),
        "9 queues on a 1-queue export"
    );
    drop(f);
    // The daemon lives on and serves a well-behaved frontend with the region.
    let mut f = Frontend::connect_when_listening(&sock);
    let mut kept = None;
    assert!(setup(&mut f, &mut kept, 0));
    lay_out(&f, 0, T_GET_ID, 0);
    f.push(head(0));
    assert_eq!(
        used_within(&mut f, Duration::from_millis(300)),
        [0],
        "{}",
        d.log()
    );
}

/// Takes the handover socket of the export on `sock` before its daemon
/// starts (which then serves without one), and answers a successor's hello
/// as a daemon of another version would: refused. The successor falls back
/// to waiting for the socket (tests/handover.rs has the handover itself).
fn refuse_handovers(sock: &Path) -> std::thread::JoinHandle<String> {
    use std::io::{Read, Write};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    let name = format!("vqblk-handover:{}", sock.display());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = UnixListener::bind_addr(&addr).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut n = [0u8; 4];
        s.read_exact(&mut n).unwrap();
        let mut hello = vec![0u8; u32::from_le_bytes(n) as usize];
        s.read_exact(&mut hello).unwrap();
        let refuse = br#"{"refuse":"version mismatch (test)"}"#;
        s.write_all(&(refuse.len() as u32).to_le_bytes()).unwrap();
        s.write_all(refuse).unwrap();
        String::from_utf8(hello).unwrap()
    })
}

/// The upgrade procedure of docs/qemu.md when the running daemon cannot hand
/// its connections over: the new daemon starts with `--takeover` while the old
/// one serves, is refused, waits, and binds once the old one, sent SIGTERM,
/// has drained its requests and removed the socket; the frontend reconnects
/// and carries on with the same inflight region.
#[test]
fn takeover_replaces_a_running_daemon() {
    let dir = common::scratch("inflight-takeover");
    let sock = dir.join("null.sock");
    let refusal = refuse_handovers(&sock);
    let mut old = start(&dir, &sock, 1);
    let mut f = Frontend::connect_when_listening(&sock);
    let mut kept = None;
    assert!(setup(&mut f, &mut kept, 0));
    lay_out(&f, 0, T_OUT, 0);
    f.push(head(0));
    let mut new = start_with(&dir, &sock, 2, &["--takeover"]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(new.child.try_wait().unwrap().is_none(), "{}", new.log());
    assert!(new.log().contains("takeover: waiting"), "{}", new.log());
    let hello = refusal.join().unwrap();
    assert!(hello.contains("\"magic\":\"vqblk-handover\""), "{hello}");
    assert!(new.log().contains("refused to hand"), "{}", new.log());
    // The old daemon drains (the write completes after its 1 s) and exits.
    let t = Instant::now();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(old.child.id() as i32, libc::SIGTERM) };
    let st = old.child.wait().unwrap();
    assert!(st.success(), "old daemon: {st}");
    assert_eq!(
        f.wait_used(1).map(|u| u[0].0),
        Some(0),
        "drained by the old daemon"
    );
    assert_eq!(f.mem.read(status(0), 1)[0], S_OK);
    let used = f.mem.read_u16(USED + 2);
    assert!(
        f.reconnect(&sock, Duration::from_secs(10)),
        "new daemon never listened"
    );
    assert!(setup(&mut f, &mut kept, used));
    lay_out(&f, 1, T_GET_ID, 0);
    f.push(head(1));
    assert_eq!(
        used_within(&mut f, Duration::from_millis(300)),
        [head(1) as u32]
    );
    eprintln!("takeover: old stopped and new serving in {:?}", t.elapsed());
    assert!(
        !new.log().contains("requests to execute again"),
        "{}",
        new.log()
    );
}
