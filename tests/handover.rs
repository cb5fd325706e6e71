//! Upgrade without reconnect: `vqblk serve --takeover` started beside a
//! running daemon takes its live vhost-user connection over (socket, memory,
//! kick, call and inflight fds, ring state), driven by the raw test frontend
//! acting as QEMU: the frontend never sees the connection close and never
//! sets anything up again; its requests before and after complete with the
//! right data, the ring's indexes go on, and the message loop answers as the
//! negotiation left it (MQ, REPLY_ACK). A successor of another version is
//! refused: the running daemon keeps the connection.

mod common;
use common::serve_process::ServeProcess;
#[path = "common/frontend.rs"]
mod frontend;

use std::fs::File;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use frontend::*;

/// Image size.
const IMAGE: u64 = 16 << 20;

/// A `vqblk serve` process on a file image with one queue.
fn start(dir: &Path, sock: &Path, image: &Path, run: u32, extra: &[&str]) -> ServeProcess {
    let image = [
        "--image".as_ref(),
        image.as_os_str(),
        "--backend".as_ref(),
        "threads".as_ref(),
    ];
    start_on(dir, sock, &image, run, extra)
}

/// A `vqblk serve` process on `disk` (its backend flags) with one queue.
fn start_on(
    dir: &Path,
    sock: &Path,
    disk: &[&std::ffi::OsStr],
    run: u32,
    extra: &[&str],
) -> ServeProcess {
    let mut args: Vec<&std::ffi::OsStr> = disk.to_vec();
    for a in ["--queues", "1", "--iothreads", "1", "--poll", "off"] {
        args.push(a.as_ref());
    }
    for a in ["--log-level", "debug", "--socket"] {
        args.push(a.as_ref());
    }
    args.push(sock.as_os_str());
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    ServeProcess::spawn(dir, run, args)
}

/// Request `i` uses descriptors 3i..3i+2 and its own header, data and status.
fn head(i: u16) -> u16 {
    3 * i
}

/// Lays out request `i`: a 4 KiB write of `fill` or a read, at `sector`.
fn lay_out(f: &Frontend, i: u16, kind: u32, sector: u64, fill: u8) {
    let (hdr, status, data) = (
        HDR + 16 * i as u64,
        STATUS + i as u64,
        DATA + 4096 * i as u64,
    );
    let mut h = kind.to_le_bytes().to_vec();
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&sector.to_le_bytes());
    f.mem.write(hdr, &h);
    f.mem.write(status, &[0xff]);
    f.mem.write(data, &[fill; 4096]);
    let flags = if kind == T_IN { DESC_WRITE } else { 0 };
    let h0 = head(i);
    f.set_desc(h0, hdr, 16, DESC_NEXT, h0 + 1);
    f.set_desc(h0 + 1, data, 4096, flags | DESC_NEXT, h0 + 2);
    f.set_desc(h0 + 2, status, 1, DESC_WRITE, 0);
}

/// Runs request `i` and checks it completed alone and OK.
fn run(f: &mut Frontend, i: u16, kind: u32, sector: u64, fill: u8, log: impl Fn() -> String) {
    lay_out(f, i, kind, sector, fill);
    f.push(head(i));
    let used = f.wait_used(1);
    assert_eq!(
        used.as_deref().map(|u| u[0].0),
        Some(head(i) as u32),
        "request {i}:\n{}",
        log()
    );
    assert_eq!(
        f.mem.read(STATUS + i as u64, 1)[0],
        S_OK,
        "request {i} status"
    );
}

fn data_of(f: &Frontend, i: u16) -> Vec<u8> {
    f.mem.read(DATA + 4096 * i as u64, 4096)
}

/// True when the daemon's end of the connection is closed (EOF queued).
fn closed(f: &Frontend) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: recv into a live one-byte buffer; MSG_PEEK leaves it queued.
    let r = unsafe {
        libc::recv(
            std::os::fd::AsRawFd::as_raw_fd(&f.sock),
            b.as_mut_ptr() as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    r == 0
}

/// The frontend's setup, as QEMU does it, with the inflight region.
fn setup(f: &mut Frontend) {
    let pf = f.negotiate_with(PF_INFLIGHT_SHMFD);
    assert!(pf & PF_INFLIGHT_SHMFD != 0, "INFLIGHT_SHMFD offered");
    let (desc, file) = f.get_inflight_fd(1, f.qsize).expect("GET_INFLIGHT_FD");
    assert!(f.set_inflight_fd(&desc, &file).ok());
    assert!(f.set_mem_table(&[f.whole_region()]).ok(), "SET_MEM_TABLE");
    let r = f.setup_ring_base(0, 0);
    assert!(r.ok(), "ring setup: {r:?}");
}

fn queue_num(f: &mut Frontend) -> Reply {
    f.call_get(req::GET_QUEUE_NUM, &[])
}

fn image(dir: &Path) -> PathBuf {
    let path = dir.join("disk.img");
    File::create(&path).unwrap().set_len(IMAGE).unwrap();
    path
}

#[test]
fn an_upgrade_hands_the_live_connection_over() {
    let dir = common::scratch("handover");
    let sock = dir.join("disk.sock");
    let img = image(&dir);
    let mut old = start(&dir, &sock, &img, 1, &[]);
    let mut f = Frontend::connect_when_listening(&sock);
    setup(&mut f);
    run(&mut f, 0, T_OUT, 0, 0xa1, || old.log());

    let t = Instant::now();
    let mut new = start(&dir, &sock, &img, 2, &["--takeover"]);
    // A message sent while the handover may be under way is answered, by
    // the old daemon before it stops reading or by the new one after.
    let r = queue_num(&mut f);
    assert_eq!(r, Reply::Data(1u64.to_le_bytes().to_vec()), "{}", new.log());
    // The old daemon hands over, is sent SIGTERM by the new one and exits.
    let st = old.exited_within(Duration::from_secs(20));
    assert!(
        st.is_some_and(|s| s.success()),
        "old daemon: {st:?}\n{}\nnew:\n{}",
        old.log(),
        new.log()
    );
    eprintln!(
        "handover: old daemon gone {:?} after the new one started",
        t.elapsed()
    );
    assert!(old.log().contains("handed over"), "{}", old.log());
    assert!(
        new.logged("connection taken over, rings resumed"),
        "{}",
        new.log()
    );

    // The frontend saw no disconnect and sets nothing up again.
    assert!(!closed(&f), "the connection was closed");
    assert_eq!(f.mem.read_u16(USED + 2), 1);
    run(&mut f, 1, T_IN, 0, 0, || new.log());
    assert_eq!(data_of(&f, 1), [0xa1; 4096], "written before, read after");
    run(&mut f, 2, T_OUT, 8, 0xb2, || new.log());
    run(&mut f, 3, T_IN, 8, 0, || new.log());
    assert_eq!(data_of(&f, 3), [0xb2; 4096], "written and read after");
    assert_eq!(f.mem.read_u16(USED + 2), 4, "the used index went on");
    // The negotiated protocol features live on: GET_QUEUE_NUM needs MQ, and
    // REPLY_ACK answers a new call fd.
    assert_eq!(queue_num(&mut f), Reply::Data(1u64.to_le_bytes().to_vec()));
    let call = std::os::fd::AsRawFd::as_raw_fd(&f.call);
    assert!(f
        .call_ack(req::SET_VRING_CALL, &u64_payload(0), &[call])
        .ok());
    run(&mut f, 4, T_IN, 0, 0, || new.log());
    assert_eq!(data_of(&f, 4), [0xa1; 4096]);
    assert!(!new.log().contains("frontend connected"), "{}", new.log());
    assert!(new.child.try_wait().unwrap().is_none(), "{}", new.log());
    assert!(
        sock.exists(),
        "the old daemon removed the handed-over socket"
    );
}

#[test]
fn an_idle_export_is_handed_over_and_accepts_frontends() {
    let dir = common::scratch("handover-idle");
    let sock = dir.join("disk.sock");
    let img = image(&dir);
    let mut old = start(&dir, &sock, &img, 1, &[]);
    drop(Frontend::connect_when_listening(&sock));
    let new = start(&dir, &sock, &img, 2, &["--takeover"]);
    let st = old.exited_within(Duration::from_secs(20));
    assert!(st.is_some_and(|s| s.success()), "{}", old.log());
    let mut f = Frontend::connect_when_listening(&sock);
    setup(&mut f);
    run(&mut f, 0, T_OUT, 0, 0xc3, || new.log());
    run(&mut f, 1, T_IN, 0, 0, || new.log());
    assert_eq!(data_of(&f, 1), [0xc3; 4096]);
    assert!(!new.log().contains("takeover: waiting"), "{}", new.log());
}

/// A request in flight when the successor knocks completes in the old
/// process (the drain), once: the new one has nothing to execute again.
#[test]
fn a_request_in_flight_at_the_handover_completes_once() {
    let dir = common::scratch("handover-inflight");
    let sock = dir.join("null.sock");
    // A null export whose requests take 300 ms.
    let null = [
        "--backend",
        "null",
        "--size",
        "16M",
        "--latency-ns",
        "300000000",
    ]
    .map(std::ffi::OsStr::new);
    let mut old = start_on(&dir, &sock, &null, 1, &[]);
    let mut f = Frontend::connect_when_listening(&sock);
    setup(&mut f);
    lay_out(&f, 0, T_OUT, 0, 0xe5);
    f.push(head(0));
    let new = start_on(&dir, &sock, &null, 2, &["--takeover"]);
    let st = old.exited_within(Duration::from_secs(20));
    assert!(st.is_some_and(|s| s.success()), "{}", old.log());
    // Completed by the old daemon's drain, before it handed over.
    assert_eq!(f.mem.read_u16(USED + 2), 1, "{}", old.log());
    assert_eq!(f.wait_used(1).map(|u| u[0].0), Some(head(0) as u32));
    assert_eq!(f.mem.read(STATUS, 1)[0], S_OK);
    run(&mut f, 1, T_OUT, 8, 0xe6, || new.log());
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(f.mem.read_u16(USED + 2), 2, "request 0 completed twice?");
    assert!(!new.log().contains("to execute again"), "{}", new.log());
    assert!(!closed(&f));
}

/// Writes a length-prefixed JSON message of the handover protocol.
fn send_frame(s: &mut UnixStream, json: &str) {
    s.write_all(&(json.len() as u32).to_le_bytes()).unwrap();
    s.write_all(json.as_bytes()).unwrap();
}

fn read_frame(s: &mut UnixStream) -> String {
    let mut n = [0u8; 4];
    s.read_exact(&mut n).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(n) as usize];
    s.read_exact(&mut body).unwrap();
    String::from_utf8(body).unwrap()
}

/// The handover socket of the export on `sock` (abstract, named after it).
fn handover_address(sock: &Path) -> SocketAddr {
    let name = format!("vqblk-handover:{}", sock.display());
    assert!(
        name.len() <= 100,
        "the scratch path is short enough: {name}"
    );
    SocketAddr::from_abstract_name(name.as_bytes()).unwrap()
}

#[test]
fn a_successor_of_another_version_is_refused_and_the_connection_stays() {
    let dir = common::scratch("handover-refused");
    let sock = dir.join("disk.sock");
    let img = image(&dir);
    let old = start(&dir, &sock, &img, 1, &[]);
    let mut f = Frontend::connect_when_listening(&sock);
    setup(&mut f);
    run(&mut f, 0, T_OUT, 0, 0xd4, || old.log());
    let mut s = UnixStream::connect_addr(&handover_address(&sock)).expect("handover socket");
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    send_frame(
        &mut s,
        r#"{"magic":"vqblk-handover","format":1,"version":"0.0.0-test","queues":1,"max_queue_size":256}"#,
    );
    let verdict = read_frame(&mut s);
    assert!(
        verdict.contains("refuse") && verdict.contains("version mismatch"),
        "{verdict}"
    );
    drop(s);
    // The daemon kept the connection and serves it.
    assert!(!closed(&f));
    run(&mut f, 1, T_IN, 0, 0, || old.log());
    assert_eq!(data_of(&f, 1), [0xd4; 4096]);
    assert_eq!(queue_num(&mut f), Reply::Data(1u64.to_le_bytes().to_vec()));
    assert!(old.log().contains("refused"), "{}", old.log());
}

/// Ten upgrades in a row under a stream of requests (the frontend writes a
/// block and reads it back, one request at a time): every request completes
/// with the right data, the used index counts every one, the connection is
/// never closed, and each new daemon took it over. Prints, per upgrade, the
/// longest time between two completions around it (the frontend's pause)
/// and their median.
#[test]
fn ten_upgrades_under_requests_lose_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    const UPGRADES: u32 = 10;
    let dir = common::scratch("handover-ten");
    let sock = dir.join("disk.sock");
    let img = image(&dir);
    let first = start(&dir, &sock, &img, 0, &[]);
    let mut f = Frontend::connect_when_listening(&sock);
    setup(&mut f);
    let done = Arc::new(AtomicBool::new(false));
    // (start, old daemon gone) of each upgrade.
    let windows = Arc::new(Mutex::new(Vec::new()));
    let upgrader = {
        let (dir, sock, img) = (dir.clone(), sock.clone(), img.clone());
        let (done, windows) = (done.clone(), windows.clone());
        std::thread::spawn(move || {
            let mut d = first;
            for k in 1..=UPGRADES {
                std::thread::sleep(Duration::from_millis(150));
                let t = Instant::now();
                let new = start(&dir, &sock, &img, k, &["--takeover"]);
                let st = d.exited_within(Duration::from_secs(20));
                assert!(
                    st.is_some_and(|s| s.success()),
                    "daemon {}: {}",
                    k - 1,
                    d.log()
                );
                windows.lock().unwrap().push((t, Instant::now()));
                // Logged once the rings run, maybe after the old one exited.
                assert!(
                    new.logged("connection taken over"),
                    "daemon {k}: {}",
                    new.log()
                );
                d = new;
            }
            std::thread::sleep(Duration::from_millis(150));
            done.store(true, Ordering::Release);
            d
        })
    };
    let mut completions = Vec::new();
    let mut i: u64 = 0;
    while !done.load(Ordering::Acquire) {
        let slot = (i % 4) as u16;
        let sector = (i % 64) * 8;
        let fill = (i % 251) as u8 + 1;
        run(&mut f, slot, T_OUT, sector, fill, || format!("write {i}"));
        completions.push(Instant::now());
        run(&mut f, slot, T_IN, sector, 0, || format!("read {i}"));
        completions.push(Instant::now());
        assert_eq!(data_of(&f, slot), [fill; 4096], "block of write {i}");
        i += 1;
    }
    let last = upgrader.join().unwrap();
    assert!(!closed(&f));
    assert_eq!(f.mem.read_u16(USED + 2), (2 * i) as u16, "{}", last.log());
    let mut pauses: Vec<Duration> = windows
        .lock()
        .unwrap()
        .iter()
        .map(|&(start, end)| {
            // The gaps between completions that overlap the upgrade.
            completions
                .windows(2)
                .filter(|w| w[1] >= start && w[0] <= end)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or_default()
        })
        .collect();
    eprintln!("handover: {i} writes and reads; pause per upgrade {pauses:?}");
    pauses.sort();
    eprintln!(
        "handover: median pause {:?}, longest {:?} (raw frontend, QD1)",
        pauses[pauses.len() / 2],
        pauses[pauses.len() - 1]
    );
}

/// An upgrade during a live migration: the dirty log (its fd, size and the
/// used ring's log address) goes with the connection, and the new daemon
/// marks the pages a request writes, as the old one did.
#[test]
fn an_upgrade_during_a_migration_keeps_logging_dirty_pages() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    // VHOST_USER_PROTOCOL_F_LOG_SHMFD, VHOST_F_LOG_ALL, SET_LOG_BASE.
    const PF_LOG_SHMFD: u64 = 1 << 1;
    const F_LOG_ALL: u64 = 1 << 26;
    const SET_LOG_BASE: u32 = 6;
    let dir = common::scratch("handover-log");
    let sock = dir.join("disk.sock");
    let img = image(&dir);
    let mut old = start(&dir, &sock, &img, 1, &[]);
    let mut f = Frontend::connect_when_listening(&sock);
    assert!(f.negotiate_with(PF_LOG_SHMFD) & PF_LOG_SHMFD != 0);
    assert!(f.features & F_LOG_ALL != 0, "LOG_ALL acked");
    assert!(f.set_mem_table(&[f.whole_region()]).ok());
    assert!(f.setup_ring(0).ok());
    let needed = (MEM_SIZE / 4096 / 8) as usize;
    let log = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("log"))
        .unwrap();
    log.set_len(4096).unwrap();
    let mut p = (needed as u64).to_le_bytes().to_vec();
    p.extend_from_slice(&0u64.to_le_bytes());
    let r = f.call_ack(SET_LOG_BASE, &p, &[log.as_raw_fd()]);
    assert!(matches!(&r, Reply::Data(p) if p.len() == 16), "{r:?}");
    // The used ring is logged at its guest address (VHOST_VRING_F_LOG).
    let u = f.mem.user_addr();
    let mut addr = 0u32.to_le_bytes().to_vec();
    addr.extend_from_slice(&1u32.to_le_bytes());
    for v in [u + DESC, u + USED, u + AVAIL, USED] {
        addr.extend_from_slice(&v.to_le_bytes());
    }
    assert!(f.call_ack(req::SET_VRING_ADDR, &addr, &[]).ok());
    let marked = |log: &File| {
        let mut buf = vec![0u8; needed];
        log.read_exact_at(&mut buf, 0).unwrap();
        (0..needed as u64 * 8)
            .filter(|p| buf[(p / 8) as usize] & (1 << (p % 8)) != 0)
            .collect::<Vec<u64>>()
    };
    let want = vec![USED / 4096, STATUS / 4096, DATA / 4096];
    assert_eq!(f.request(T_IN, 0, 4096), Some(S_OK));
    assert_eq!(marked(&log), want, "the old daemon logs");
    log.write_all_at(&vec![0u8; needed], 0).unwrap();

    let new = start(&dir, &sock, &img, 2, &["--takeover"]);
    let st = old.exited_within(Duration::from_secs(20));
    assert!(st.is_some_and(|s| s.success()), "{}", old.log());
    assert!(new.logged("rings resumed"), "{}", new.log());
    // Starting the ring may write the used ring's flags (logged too).
    log.write_all_at(&vec![0u8; needed], 0).unwrap();
    assert_eq!(f.request(T_IN, 8, 4096), Some(S_OK), "{}", new.log());
    assert_eq!(marked(&log), want, "the new daemon logs:\n{}", new.log());
    assert!(!closed(&f));
}
