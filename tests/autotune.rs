//! `--iothreads auto` end to end: a libblkio client loads every queue of an
//! export; the controller spreads the queues over more than one
//! IOThread; with the load gone it gathers them on one again; `tune` off
//! leaves them where they are. `query-iothreads` and `query-tune`
//! show the active set and the last moves with their reasons.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use blkio::ReqFlags;
use common::*;
use serde_json::json;
use vqblk_daemon::config::{BackendKind, CacheMode, ControlConfig, ExportConfig, ServeConfig};
use vqblk_daemon::control::client::ControlClient;
use vqblk_daemon::daemon::Daemon;

const QUEUES: usize = 4;
const QD: usize = 8;
/// Large buffered reads: the copy is the IOThread's work (io_uring reads
/// from the page cache inline), so the IOThread, not the client, saturates.
const BS: usize = 64 << 10;

/// Starts a daemon serving `e` with `--iothreads auto` (over `cpuset`, if
/// given) and a control socket in `dir`, whose path it returns.
fn start_tuned(dir: &Path, e: ExportConfig, cpuset: Option<&str>) -> (Daemon, PathBuf) {
    let ctl = dir.join("ctl.sock");
    let mut cfg = ServeConfig {
        exports: vec![e],
        control: Some(ControlConfig {
            socket: ctl.clone(),
            mode: None,
        }),
        ..Default::default()
    };
    cfg.iothreads.auto = true;
    cfg.iothreads.cpuset = cpuset.map(Into::into);
    (Daemon::start(&cfg).expect("daemon starts"), ctl)
}

/// The result of a control socket method without parameters.
fn query(ctl: &Path, method: &str) -> serde_json::Value {
    let mut c = ControlClient::connect(ctl).unwrap();
    c.call(method, json!({})).unwrap()
}

/// The IOThreads that own a queue of the export now, as the control socket
/// says.
fn active(ctl: &Path) -> Vec<u64> {
    let threads = query(ctl, "query-iothreads");
    threads
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["active"] == json!(true))
        .map(|t| t["id"].as_u64().unwrap())
        .collect()
}

/// Polls `cond` every 500 ms for at most `limit`.
fn within(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    false
}

#[test]
fn queues_spread_under_load_gather_when_idle_and_tune_off_freezes_them() {
    let dir = scratch("autotune");
    let _ = vqblk_daemon::cli::init_logging("info");
    let mut e = export(&dir, BackendKind::IoUring, QUEUES as u16, 64 << 20);
    e.cache = CacheMode::Writeback;
    e.name = Some("disk".into());
    let (daemon, ctl) = start_tuned(&dir, e, Some("0-1"));
    // On the IOThread whose CPU takes the disk's interrupts, else on 0.
    let home = active(&ctl);
    assert_eq!(
        home.len(),
        1,
        "every queue starts on one IOThread: {home:?}"
    );

    let mut c = Client::connect(&daemon.sockets()[0], QUEUES).unwrap();
    let mem = c.region.addr;
    let stop = AtomicBool::new(false);
    let run = |c: &mut Client, stop: &AtomicBool, phase: &dyn Fn() -> bool| {
        stop.store(false, Ordering::Relaxed);
        std::thread::scope(|s| {
            for (qi, q) in c.queues.iter_mut().enumerate() {
                s.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        for k in 0..QD {
                            let buf = (mem + (qi * QD + k) * BS) as *mut u8;
                            let off = ((qi * QD + k) * BS) as u64;
                            q.read(off, buf, BS, k, ReqFlags::empty());
                        }
                        let got = Client::wait(q, QD);
                        assert!(got.iter().all(|&(_, r)| r == 0), "{got:?}");
                    }
                });
            }
            let ok = phase();
            stop.store(true, Ordering::Relaxed);
            ok
        })
    };

    // Loaded: the first IOThread saturates and hands queues to the other.
    let spread = run(&mut c, &stop, &|| {
        within(Duration::from_secs(40), || active(&ctl).len() > 1)
    });
    assert!(spread, "the queues stayed on {:?} under load", active(&ctl));
    // The thread that took queues says why, as the control socket's
    // last-moves do.
    let threads = query(&ctl, "query-iothreads");
    let woken = threads
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] != json!(home[0]) && t["active"] == json!(true))
        .expect("a second IOThread is active");
    let m = &woken["last-move"];
    assert!(
        m["to"] == woken["id"] || m["from"] == woken["id"],
        "{woken}"
    );
    assert!(
        m["reason"] == json!("activate") || m["reason"] == json!("balance"),
        "{woken}"
    );
    assert!(m["seconds-ago"].as_u64().unwrap() < 60, "{woken}");

    // Idle: one thread carries nothing just as well.
    assert!(
        within(Duration::from_secs(60), || active(&ctl).len() == 1),
        "the queues stayed on {:?} without load",
        active(&ctl)
    );
    let mut ctlc = ControlClient::connect(&ctl).unwrap();
    let t = ctlc.call("query-tune", json!({})).unwrap();
    assert_eq!(t["auto"], json!(true), "{t}");
    let moves = &t["moves"];
    assert!(
        moves["activate"].as_u64().unwrap() + moves["balance"].as_u64().unwrap() > 0,
        "{t}"
    );
    assert!(moves["park"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t["last-moves"][0]["reason"], json!("park"), "{t}");

    // Tuning off: the same load moves nothing.
    ctlc.call("tune", json!({ "export": "disk", "enable": false }))
        .unwrap();
    let e = ctlc
        .call("tune", json!({ "export": "nope", "enable": false }))
        .unwrap_err();
    assert!(e.to_string().contains("export"), "{e}");
    let before = active(&ctl);
    let moved = run(&mut c, &stop, &|| {
        within(Duration::from_secs(15), || active(&ctl) != before)
    });
    assert!(!moved, "queues moved with tuning off: {:?}", active(&ctl));
    drop(c);
    daemon.shutdown();
}

/// A pool given a cpuset pins one IOThread to each of its CPUs, as
/// libvirt's iothreadpin; without one it shares every CPU of the host with
/// the rest of it and pins none (a pinned thread would wait for a CPU that
/// other work took while another CPU idled).
#[test]
fn only_a_given_cpuset_pins_the_pool() {
    for cpuset in [None, Some("0")] {
        let dir = scratch(&format!("autotune-pin-{}", cpuset.is_some()));
        let e = export(&dir, BackendKind::Null, 1, 1 << 20);
        let (daemon, ctl) = start_tuned(&dir, e, cpuset);
        let threads = query(&ctl, "query-iothreads");
        let cpus: Vec<_> = threads
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["cpus"].clone())
            .collect();
        match cpuset {
            Some(_) => assert_eq!(cpus, vec![json!([0])], "{threads}"),
            None => {
                assert!(!cpus.is_empty(), "{threads}");
                assert!(cpus.iter().all(|c| c.is_null()), "{threads}");
            }
        }
        daemon.shutdown();
    }
}

/// An export added at run time goes through the same placement, from the
/// control thread and under its seccomp filter: the sysfs and
/// /proc/interrupts reads that find its disk's interrupt CPU neither stop
/// the daemon nor spread its queues.
#[test]
fn an_export_added_at_run_time_starts_on_one_iothread() {
    let dir = scratch("autotune-add");
    let mut first = export(&dir, BackendKind::Null, 1, 1 << 20);
    first.name = Some("first".into());
    let (daemon, ctl) = start_tuned(&dir, first, Some("0-1"));
    let image = dir.join("second.raw");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let mut c = ControlClient::connect(&ctl).unwrap();
    c.call(
        "export-add",
        json!({
            "name": "second",
            "image": image,
            "socket": dir.join("second.sock"),
            "queues": 4,
        }),
    )
    .unwrap();
    let exports = query(&ctl, "query-exports");
    let second = exports
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == json!("second"))
        .unwrap_or_else(|| panic!("{exports}"))
        .clone();
    let owners: std::collections::HashSet<String> = second["queues"]
        .as_array()
        .unwrap_or_else(|| panic!("{second}"))
        .iter()
        .map(|m| m["iothread"].to_string())
        .collect();
    assert_eq!(owners.len(), 1, "{second}");
    daemon.shutdown();
}
