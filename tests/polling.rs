//! Polling must never strand a request: while an IOThread polls, guest kicks
//! are suppressed; before it sleeps it re-enables them and looks at the rings
//! once more. A lost wake-up shows here as a request that never completes
//! (the client's 20 s wait fails). Many short bursts with random gaps, across
//! all queues, in every polling mode and on two backends.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use vqblk_daemon::config::{BackendKind, ServeConfig};
use vqblk_daemon::daemon::Daemon;
use vqblk_daemon::poll::PollMode;

/// The tests of this file run one at a time: busy-polling IOThreads of one
/// would take the CPUs another's adaptive thread measures its nap cost on
/// (it then sees naps as too costly and never takes one).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A small deterministic generator (no dependency, reproducible failures).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn stress(mode: PollMode, backend: BackendKind) {
    let dir = scratch(&format!("poll-{mode:?}-{backend:?}"));
    let e = export(&dir, backend, 4, 32 << 20);
    let mut cfg = ServeConfig {
        exports: vec![e],
        ..Default::default()
    };
    cfg.iothreads.count = 2;
    cfg.iothreads.poll.poll = Some(mode);
    let daemon = Daemon::start(&cfg).unwrap();
    let mut c = Client::connect(&daemon.sockets()[0], 4).unwrap();
    let addr = c.region.addr;
    let bursts = 150;
    std::thread::scope(|s| {
        for (w, q) in c.queues.iter_mut().enumerate() {
            s.spawn(move || {
                let mut rng = Lcg(w as u64 * 7919 + 1);
                for b in 0..bursts {
                    let n = 1 + (rng.next() % 8) as usize;
                    for i in 0..n {
                        let off = (rng.next() % 4096) * 4096;
                        let p = (addr + (w * 8 + i) * 4096) as *mut u8;
                        if rng.next().is_multiple_of(2) {
                            q.read(off, p, 4096, i, blkio::ReqFlags::empty());
                        } else {
                            q.write(off, p, 4096, i, blkio::ReqFlags::empty());
                        }
                    }
                    for (_, ret) in Client::wait(q, n) {
                        assert_eq!(ret, 0, "{mode:?} {backend:?} queue {w} burst {b}");
                    }
                    // Gaps from none (back to back) to well past any polling window.
                    match rng.next() % 4 {
                        0 => {}
                        1 => std::thread::sleep(Duration::from_micros(rng.next() % 50)),
                        2 => std::thread::sleep(Duration::from_micros(rng.next() % 400)),
                        _ => std::thread::sleep(Duration::from_millis(1 + rng.next() % 3)),
                    }
                }
            });
        }
    });
    drop(c);
    let stats = daemon.shutdown();
    let served: u64 = stats.iothreads.iter().map(|t| t.requests).sum();
    assert!(
        served >= 4 * bursts as u64,
        "{mode:?} {backend:?}: {served} requests"
    );
    if mode == PollMode::Off {
        assert!(
            stats.iothreads.iter().all(|t| t.poll_attempts == 0),
            "off never polls"
        );
    }
    if mode == PollMode::Busy {
        assert!(
            stats.iothreads.iter().all(|t| t.sleep_seconds < 0.5),
            "busy barely sleeps: {stats:?}"
        );
    }
}

#[test]
fn no_lost_wakeups_in_any_polling_mode() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for mode in [
        PollMode::Off,
        PollMode::Classic,
        PollMode::Weighted,
        PollMode::Busy,
        PollMode::Adaptive,
    ] {
        for backend in [BackendKind::Null, BackendKind::IoUring] {
            stress(mode, backend);
        }
    }
}

/// Adaptive mode naps (sleeps with a timer, kicks armed) before spinning when
/// events come predictably late. A queue detached during a nap (the client went
/// away) must be released at the end of that pass, not after the next event:
/// the control thread waits for it before serving the next connection.
#[test]
fn a_queue_detached_during_a_nap_is_released_at_once() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("poll-nap-detach");
    let e = export(&dir, BackendKind::Null, 1, 32 << 20);
    let mut cfg = ServeConfig {
        exports: vec![e],
        ..Default::default()
    };
    cfg.iothreads.count = 1;
    cfg.iothreads.poll.poll = Some(PollMode::Adaptive);
    // Intervals of ~600 us must be pollable for the thread to nap through them.
    cfg.iothreads.poll.poll_max_ns = Some(1_000_000);
    let daemon = Daemon::start(&cfg).unwrap();
    let sock = daemon.sockets()[0].clone();
    for round in 0..6 {
        let t = Instant::now();
        let mut c = Client::connect(&sock, 1).unwrap();
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "round {round}: connecting took {took:?}: the last client's queue was not released"
        );
        // Reads 600 us apart (spun, for precision): the thread learns to nap
        // through most of each gap.
        for i in 0..100 {
            assert_eq!(c.read(0, (i % 64) * 4096, 0, 4096), 0);
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(600) {
                std::hint::spin_loop();
            }
        }
        // Go away right after a completion: the thread is napping.
        assert_eq!(c.read(0, 0, 0, 4096), 0);
        drop(c);
    }
    let naps = daemon.stats().iothreads[0].naps;
    assert!(
        naps > 100,
        "the thread napped only {naps} times: {:?}",
        daemon.stats().iothreads[0]
    );
    daemon.shutdown();
}

/// The null backend with `latency-ns` completes each request that long after
/// submission, whether the thread sleeps (the timerfd wakes it), polls (the
/// clock says it is due) or naps.
#[test]
fn null_latency_is_honoured_in_every_mode() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for mode in [PollMode::Off, PollMode::Busy, PollMode::Adaptive] {
        let dir = scratch(&format!("poll-latency-{mode:?}"));
        let mut e = export(&dir, BackendKind::Null, 2, 32 << 20);
        e.latency_ns = Some(2_000_000);
        let mut cfg = ServeConfig {
            exports: vec![e],
            ..Default::default()
        };
        cfg.iothreads.count = 1;
        cfg.iothreads.poll.poll = Some(mode);
        let daemon = Daemon::start(&cfg).unwrap();
        let mut c = Client::connect(&daemon.sockets()[0], 2).unwrap();
        for q in 0..2 {
            let t = Instant::now();
            assert_eq!(c.read(q, 0, 0, 4096), 0);
            let took = t.elapsed();
            assert!(
                took >= Duration::from_millis(2) && took < Duration::from_secs(2),
                "{mode:?}: a 2 ms device answered in {took:?}"
            );
        }
        // Sixteen in flight on one queue complete together, ~2 ms later.
        let addr = c.region.addr;
        let t = Instant::now();
        for i in 0..16 {
            let p = (addr + i * 4096) as *mut u8;
            c.queues[0].read(i as u64 * 4096, p, 4096, i, blkio::ReqFlags::empty());
        }
        let done = Client::wait(&mut c.queues[0], 16);
        assert!(done.iter().all(|&(_, ret)| ret == 0));
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(2) && took < Duration::from_millis(500),
            "{mode:?}: 16 requests took {took:?}"
        );
        drop(c);
        daemon.shutdown();
    }
}
