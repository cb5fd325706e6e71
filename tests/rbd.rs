//! The rbd backend against a real (throw-away, single-node) Ceph cluster and a
//! real vhost-user-blk client (libblkio): the file backend's integration body
//! on an RBD image, the image's bytes checked afterwards with the `rbd` CLI,
//! and the start errors of `vqblk serve` (wrong pool or image, no librbd).
//!
//! The cluster is started once for this test binary by scripts/ceph/start.sh
//! (its own CEPH_DIR and MON_PORT, so it cannot collide with a developer's
//! cluster) and stopped by a guard, also when a step fails. Every step runs in
//! the one `#[test]` below, in order, so the guard's lifetime is the test's.
//! A cluster that does not start fails the test: it is never skipped.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::ceph::{show, Cluster};
use common::*;

/// Monitor port of the test cluster (msgr2; msgr1 is the next one). Not
/// Ceph's default 3300, so a developer's cluster is left alone.
const MON_PORT: u16 = 3460;
/// Size of the image the steps use.
const SIZE: u64 = 64 << 20;
const BS: usize = 4096;
const IMAGE: &str = "rbd/vqblk";

/// The image's expected content: every write of the steps is mirrored here.
struct Model(Vec<u8>);

impl Model {
    fn set(&mut self, off: u64, data: &[u8]) {
        self.0[off as usize..off as usize + data.len()].copy_from_slice(data);
    }
    fn zero(&mut self, off: u64, len: u64) {
        self.0[off as usize..(off + len) as usize].fill(0);
    }
}

#[test]
fn rbd_backend_on_a_real_cluster() {
    let cluster = Cluster::start(MON_PORT);
    cluster.rbd(&["create", "--size", "64M", IMAGE]);
    let mut model = Model(vec![0; SIZE as usize]);
    concurrent_patterns(&cluster, &mut model);
    flush_discard_write_zeroes(&cluster, &mut model);
    disconnect_and_reconnect(&cluster, &mut model);
    // What the steps wrote is what the cluster holds, byte for byte.
    let got = cluster.export_bytes(IMAGE);
    assert_eq!(got.len(), SIZE as usize);
    let diff = got.iter().zip(&model.0).position(|(a, b)| a != b);
    assert_eq!(diff, None, "rbd export differs from what was written");
    snapshot_is_read_only(&cluster, &model);
    start_errors(&cluster);
    bench_native_librbd(&cluster);
    sweep_plan_on_rbd(&cluster);
    // Last: they leave the OSD unable to answer for a while.
    unreachable_cluster_fails_requests(&cluster);
    shutdown_with_a_silent_cluster(&cluster);
}

/// Several queues on two IOThreads write distinct patterns concurrently (many
/// requests in flight each), then everything is read back through other queues.
fn concurrent_patterns(cluster: &Cluster, model: &mut Model) {
    let daemon = start(cluster.export(IMAGE, 4), 2);
    let mut c = Client::connect(&daemon.sockets()[0], 4).unwrap();
    assert_eq!(c.capacity, SIZE);
    let blocks = 64;
    let per = blocks * BS;
    for w in 0..4 {
        for b in 0..blocks {
            for i in 0..BS {
                c.buf()[w * per + b * BS + i] = pattern(w, b, i);
            }
        }
    }
    model.set(0, &c.buf()[..4 * per]);
    let addr = c.region.addr;
    std::thread::scope(|s| {
        for (w, q) in c.queues.iter_mut().enumerate() {
            s.spawn(move || {
                for b in 0..blocks {
                    let off = ((w * blocks + b) * BS) as u64;
                    let p = (addr + w * per + b * BS) as *const u8;
                    q.write(off, p, BS, b, blkio::ReqFlags::empty());
                }
                for (_, ret) in Client::wait(q, blocks) {
                    assert_eq!(ret, 0, "write failed");
                }
            });
        }
    });
    assert_eq!(c.flush(0), 0);
    let rb = 4 * per;
    for w in 0..4 {
        assert_eq!(c.read((w + 1) % 4, (w * per) as u64, rb, per), 0);
        let got = c.buf()[rb..rb + per].to_vec();
        assert!(
            got == model.0[w * per..(w + 1) * per],
            "writer {w}'s blocks read back wrong"
        );
    }
    drop(c);
    let stats = daemon.shutdown();
    let queues = stats.iothreads.iter().flat_map(|t| &t.queues);
    let written: u64 = queues.clone().map(|q| q.bytes_written).sum();
    let read: u64 = queues.clone().map(|q| q.bytes_read).sum();
    let errors: u64 = queues.map(|q| q.errors).sum();
    assert_eq!((written, read, errors), (rb as u64, rb as u64, 0));
}

/// Flush succeeds; discard and write-zeroes (with and without unmap) read back
/// as zeroes, and the bytes around them are left alone.
fn flush_discard_write_zeroes(cluster: &Cluster, model: &mut Model) {
    let daemon = start(cluster.export(IMAGE, 1), 1);
    let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
    c.buf()[..65536].fill(0xee);
    let base = 8u64 << 20;
    for off in [base, base + (1 << 20), base + (2 << 20)] {
        assert_eq!(c.write(0, off, 0, 65536), 0);
        model.set(off, &[0xee; 65536]);
    }
    assert_eq!(c.flush(0), 0);
    // librbd discards whole 64 KiB units (rbd_discard_granularity_bytes): an
    // aligned unit reads back as zeroes.
    assert_eq!(c.discard(0, base, 65536), 0);
    assert_eq!(c.write_zeroes(0, base + (1 << 20), 65536, true), 0);
    assert_eq!(c.write_zeroes(0, base + (2 << 20), 32768, false), 0);
    for (off, zero_len) in [
        (base, 65536usize),
        (base + (1 << 20), 65536),
        (base + (2 << 20), 32768),
    ] {
        model.zero(off, zero_len as u64);
        assert_eq!(c.read(0, off, 65536, 65536), 0);
        let got = c.buf()[65536..131072].to_vec();
        assert!(
            got[..zero_len].iter().all(|&b| b == 0),
            "at {off}: not zero"
        );
        assert!(
            got[zero_len..].iter().all(|&b| b == 0xee),
            "at {off}: tail clobbered"
        );
    }
    drop(c);
    let stats = daemon.shutdown();
    let errors: u64 = stats
        .iothreads
        .iter()
        .flat_map(|t| &t.queues)
        .map(|q| q.errors)
        .sum();
    assert_eq!(errors, 0);
}

/// A client that vanishes with requests in flight leaves the daemon serving
/// the next one on the same socket; data persists.
fn disconnect_and_reconnect(cluster: &Cluster, model: &mut Model) {
    let daemon = start(cluster.export(IMAGE, 2), 2);
    let sock = daemon.sockets()[0].clone();
    let off = 16u64 << 20;
    {
        let mut c = Client::connect(&sock, 2).unwrap();
        c.buf()[..4096].fill(0x42);
        assert_eq!(c.write(1, off, 0, 4096), 0);
        model.set(off, &[0x42; 4096]);
        let p = c.region.addr as *mut u8;
        for i in 0..32 {
            c.queues[0].read((i * 4096) as u64, p, 4096, i, blkio::ReqFlags::empty());
        }
        let mut none = [std::mem::MaybeUninit::<blkio::Completion>::uninit()];
        let _ = c.queues[0].do_io(&mut none, 0, None, None);
    }
    for round in 0..3 {
        let mut c = Client::connect(&sock, 2).unwrap_or_else(|e| panic!("reconnect {round}: {e}"));
        assert_eq!(c.read(round % 2, off, 4096, 4096), 0);
        assert!(
            c.buf()[4096..8192].iter().all(|&b| b == 0x42),
            "round {round}"
        );
    }
    drop(daemon);
}

/// A snapshot is exported read-only (without --read-only): a read-write open
/// is refused, reads give the snapshot's bytes although the head changed.
fn snapshot_is_read_only(cluster: &Cluster, model: &Model) {
    let snap = format!("{IMAGE}@s1");
    cluster.rbd(&["snap", "create", &snap]);
    // Change the head after the snapshot.
    let daemon = start(cluster.export(IMAGE, 1), 1);
    let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
    c.buf()[..4096].fill(0x77);
    assert_eq!(c.write(0, 0, 0, 4096), 0);
    drop(c);
    drop(daemon);

    let daemon = start(cluster.export(&snap, 2), 1);
    let e = Client::connect(&daemon.sockets()[0], 2)
        .err()
        .expect("read-write open of a snapshot refused");
    assert_eq!(e.errno(), blkio::Errno::ROFS, "{}", e.message());
    let mut c = Client::connect_with(&daemon.sockets()[0], 2, true).unwrap();
    assert_eq!(c.read(1, 0, 0, 8192), 0);
    assert!(c.buf()[..8192] == model.0[..8192], "snapshot content");
    drop(c);
    drop(daemon);
    let head = cluster.export_bytes(IMAGE);
    assert!(head[..4096].iter().all(|&b| b == 0x77));
    assert!(cluster.export_bytes(&snap) == model.0, "snapshot unchanged");
}

/// Runs `vqblk serve` on `image` and expects it to refuse to start with
/// exit code 2 and one line on stderr; returns that line.
fn serve_refused(cluster: &Cluster, image: &str, env: &[(&str, &str)]) -> String {
    let dir = scratch("rbd-refused");
    let mut cmd = Command::new("timeout");
    cmd.args([
        "-k",
        "5",
        "60",
        env!("CARGO_BIN_EXE_vqblk"),
        "serve",
        "--image",
    ])
    .arg(image)
    .arg("--ceph-conf")
    .arg(&cluster.conf)
    .args(["--ceph-op-timeout", "10", "--socket"])
    .arg(dir.join("s.sock"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{image}: {}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{image}: one line: {err}"
    );
    err
}

fn start_errors(cluster: &Cluster) {
    let e = serve_refused(cluster, "rbd:nopool/img", &[]);
    assert!(
        e.contains("pool \"nopool\"") && e.contains("does not exist"),
        "{e}"
    );
    let e = serve_refused(cluster, "rbd:rbd/noimage", &[]);
    assert!(
        e.contains("rbd:rbd/noimage") && e.contains("does not exist"),
        "{e}"
    );
    let e = serve_refused(cluster, "rbd:rbd/img@nosnap", &[]);
    assert!(
        e.contains("rbd:rbd/img@nosnap") && e.contains("does not exist"),
        "{e}"
    );
    let e = serve_refused(
        cluster,
        "rbd:rbd/img",
        &[("VQBLK_LIBRBD_PATH", "/nonexistent/librbd.so.1")],
    );
    assert!(
        e.contains("librbd1") && e.contains("/nonexistent/librbd.so.1"),
        "{e}"
    );
    let e = serve_refused(cluster, "rbd:rbd", &[]);
    assert!(e.contains("--image") && e.contains("rbd:POOL/IMAGE"), "{e}");
}

/// An OSD that stops answering makes requests fail with an I/O error after
/// `ceph-op-timeout` (counted as errors), instead of hanging the queue.
fn unreachable_cluster_fails_requests(cluster: &Cluster) {
    let mut e = cluster.export(IMAGE, 1);
    e.ceph_op_timeout = Some(2);
    let daemon = start(e, 1);
    let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
    assert_eq!(c.read(0, 0, 0, 4096), 0);
    let signal = |sig: &str| osd_signal(cluster, sig);
    signal("-STOP");
    let t = std::time::Instant::now();
    // Client::wait gives up (and fails) after 20 s: the timeout is 2 s.
    let r = c.read(0, 1 << 20, 0, 4096);
    let waited = t.elapsed();
    signal("-CONT");
    assert!(r < 0, "a read from a silent OSD succeeded: {r}");
    assert!(
        waited.as_secs() >= 1,
        "failed before the timeout: {waited:?}"
    );
    assert_eq!(c.read(0, 0, 0, 4096), 0, "works again once the OSD answers");
    drop(c);
    let stats = daemon.shutdown();
    let errors: u64 = stats
        .iothreads
        .iter()
        .flat_map(|t| &t.queues)
        .map(|q| q.errors)
        .sum();
    assert_eq!(errors, 1);
}

/// Sends `sig` (`-STOP`, `-CONT`) to the cluster's OSD.
fn osd_signal(cluster: &Cluster, sig: &str) {
    let pid = std::fs::read_to_string(cluster.dir.join("run/osd.0.pid")).unwrap();
    let ok = Command::new("kill")
        .args([sig, pid.trim()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A SIGTERM while a request waits on a silent OSD: the drain would wait
/// `ceph-op-timeout` (20 s here) and the flush and close as long again.
/// `--shutdown-timeout 2` ends the process after 2 s (status 1, one line
/// saying so); without it, a SIGINT does at once (a repeated SIGTERM does
/// not).
fn shutdown_with_a_silent_cluster(cluster: &Cluster) {
    for timeout in [Some("2"), None] {
        let dir = scratch("rbd-shutdown");
        let sock = dir.join("s.sock");
        let log = dir.join("serve.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vqblk"));
        cmd.args(["serve", "--image", &format!("rbd:{IMAGE}"), "--ceph-conf"])
            .arg(&cluster.conf)
            .args(["--ceph-op-timeout", "20", "--socket"])
            .arg(&sock)
            .stderr(std::fs::File::create(&log).unwrap())
            .stdout(std::process::Stdio::null());
        if let Some(t) = timeout {
            cmd.args(["--shutdown-timeout", t]);
        }
        let mut child = cmd.spawn().unwrap();
        let listening = (0..300).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            sock.exists()
        });
        assert!(
            listening,
            "no socket: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        let mut c = Client::connect(&sock, 1).unwrap();
        assert_eq!(c.read(0, 0, 0, 4096), 0);
        osd_signal(cluster, "-STOP");
        // In flight (not waited for) when the signal comes.
        let p = c.region.addr as *mut u8;
        c.queues[0].read(1 << 20, p, 4096, 0, blkio::ReqFlags::empty());
        let submitted = c.queues[0].do_io(&mut [], 0, None, None).unwrap();
        assert_eq!(submitted, 0, "no completion asked for");
        std::thread::sleep(Duration::from_millis(300));
        let pid = child.id() as i32;
        let kill = |sig| {
            // SAFETY: kill takes no pointer; the pid is our child's.
            assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        };
        kill(libc::SIGTERM);
        let t = Instant::now();
        if timeout.is_none() {
            std::thread::sleep(Duration::from_millis(500));
            kill(libc::SIGTERM);
            std::thread::sleep(Duration::from_millis(500));
            assert!(
                child.try_wait().unwrap().is_none(),
                "a second SIGTERM ended it"
            );
            kill(libc::SIGINT);
        }
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > Duration::from_secs(15) {
                let _ = child.kill();
                break child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let waited = t.elapsed();
        osd_signal(cluster, "-CONT");
        drop(c);
        let err = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            status.code(),
            Some(1),
            "{timeout:?} after {waited:?}: {err}"
        );
        let (why, at_least) = match timeout {
            Some(_) => ("after shutdown-timeout 2s", 2.0),
            None => ("SIGINT during shutdown", 1.0),
        };
        assert!(err.contains(why), "{timeout:?}: {err}");
        assert!(err.contains("shutdown: draining"), "{err}");
        assert!(
            (at_least..at_least + 3.0).contains(&waited.as_secs_f64()),
            "{timeout:?}: exited after {waited:?}"
        );
    }
}

/// `vqblk bench`'s native librbd engine writes with checksums and reads back.
fn bench_native_librbd(cluster: &Cluster) {
    cluster.rbd(&["create", "--size", "16M", "rbd/bench"]);
    let o = Command::new("timeout")
        .args(["-k", "5", "120", env!("CARGO_BIN_EXE_vqblk"), "bench"])
        .args(["--target", "rbd:rbd/bench", "--rw=randwrite", "--bs=4k"])
        .args(["--iodepth=8", "--size=1m", "--verify=crc32c"])
        .env("CEPH_CONF", &cluster.conf)
        .output()
        .unwrap();
    assert!(o.status.success(), "bench on rbd: {}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("ioengine=rbd") && out.contains("err= 0"),
        "{out}"
    );
    assert!(out.contains("via librbd"), "{out}");
}

/// `vqblk sweep --image rbd:...` plans the rbd backend, qsd's rbd driver and
/// native librbd, with the image's size from the cluster.
fn sweep_plan_on_rbd(cluster: &Cluster) {
    use clap::Parser;
    use vqblk_study::matrix::{Cell, Op, Setup};
    use vqblk_study::sweep::plan::Plan;
    use vqblk_study::sweep::SweepArgs;
    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        a: SweepArgs,
    }
    // The sweep, its daemons and qsd find the cluster through $CEPH_CONF.
    std::env::set_var("CEPH_CONF", &cluster.conf);
    let argv = [
        "sweep",
        "--results",
        "/dev/null",
        "--image",
        "rbd:rbd/bench",
    ];
    let args = P::try_parse_from(argv).unwrap().a;
    let args_qsd = P::try_parse_from(argv.iter().chain(&["--baseline", "qemu-storage-daemon"]))
        .unwrap()
        .a;
    let p = Plan::new(&args, "/x/vqblk".into(), 2).unwrap();
    assert_eq!(p.target.bytes(), 16 << 20);
    let cell = Cell {
        bs: 4096,
        op: Op::Read,
        jobs: 1,
        iodepth: 1,
    };
    assert_eq!(p.bench_argv(&cell, Setup::Native, None)[3], "rbd:rbd/bench");
    let serve: Vec<String> = p
        .server_argv(Setup::IoThreads(1))
        .unwrap()
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let serve = serve.join(" ");
    assert!(
        serve.contains("--backend rbd") && serve.contains("--image rbd:rbd/bench"),
        "{serve}"
    );
    let q = Plan::new(&args_qsd, "/x/vqblk".into(), 2).unwrap();
    let qsd: Vec<String> = q
        .server_argv(Setup::Baseline)
        .unwrap()
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    assert!(
        qsd[2].starts_with("driver=rbd,node-name=d,pool=rbd,image=bench"),
        "{qsd:?}"
    );
    let e = Plan::new(
        &P::try_parse_from(["sweep", "--results", "/dev/null", "--image", "rbd:rbd/none"])
            .unwrap()
            .a,
        "/x/vqblk".into(),
        2,
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("does not exist"), "{e:#}");
}
