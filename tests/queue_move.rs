//! `queue-move` under load: a libblkio client keeps every queue busy writing
//! and verifying its own patterns while the daemon moves the queues between
//! IOThreads hundreds of times. No request may be lost (the client would
//! wait for it), completed twice (the per-queue counters would exceed the
//! client's count), or see another's data (verification); afterwards a
//! moved queue is served, and counted, by its new IOThread.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blkio::{Blkioq, ReqFlags};
use common::*;
use vqblk_daemon::config::BackendKind;
use vqblk_daemon::daemon::Daemon;
use vqblk_daemon::stats::DaemonSnapshot;

const EXPORT: &str = "disk";
const QUEUES: usize = 4;
const IOTHREADS: usize = 3;
const SIZE: u64 = 16 << 20;
const BS: usize = 4096;
/// Requests each queue keeps in flight.
const QD: usize = 8;
/// Blocks of its own that each queue cycles over.
const BLOCKS: usize = 64;
/// Client memory per queue: QD write buffers, then QD read buffers.
const PER_QUEUE_MEM: usize = 2 * QD * BS;

/// The bytes queue `q` writes to a block in batch `batch`, request `k`:
/// distinct for every write of the run.
fn fill(buf: &mut [u8], q: usize, batch: u64, k: usize) {
    let seed = ((q as u64) << 56) ^ (batch << 8) ^ k as u64;
    for (j, word) in buf.chunks_exact_mut(8).enumerate() {
        let v = seed ^ (j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        word.copy_from_slice(&v.to_le_bytes());
    }
}

fn start_daemon(dir: &std::path::Path) -> Daemon {
    let mut e = export(dir, BackendKind::IoUring, QUEUES as u16, SIZE);
    e.name = Some(EXPORT.into());
    start(e, IOTHREADS)
}

/// Requests completed per queue of the export, summed over IOThreads.
fn per_queue(s: &DaemonSnapshot) -> [u64; QUEUES] {
    let mut out = [0; QUEUES];
    for q in s.iothreads.iter().flat_map(|t| &t.queues) {
        if q.export == EXPORT {
            out[q.queue as usize] += q.requests;
        }
    }
    out
}

/// Requests completed on queue `q` by each IOThread.
fn by_thread(s: &DaemonSnapshot, q: u16) -> Vec<u64> {
    s.iothreads
        .iter()
        .map(|t| {
            t.queues
                .iter()
                .filter(|x| x.export == EXPORT && x.queue == q)
                .map(|x| x.requests)
                .sum()
        })
        .collect()
}

/// What one queue's client thread saw.
#[derive(Default)]
struct Tally {
    /// Requests completed (writes and reads).
    done: AtomicU64,
    /// Blocks read back with other bytes than written.
    bad: AtomicU64,
}

/// One queue's load: batches of QD writes to distinct blocks of its own,
/// then QD reads of them, each verified; until `stop`. Every completion's
/// user_data must come back exactly once per batch. `on_complete` sees the
/// time of every completion.
fn load(
    q: &mut Blkioq,
    qi: usize,
    mem: usize,
    stop: &AtomicBool,
    tally: &Tally,
    first_error: &Mutex<Option<String>>,
    mut on_complete: impl FnMut(Instant, usize),
) {
    let base = mem + qi * PER_QUEUE_MEM;
    let wbuf = |k: usize| (base + k * BS) as *mut u8;
    let rbuf = |k: usize| (base + (QD + k) * BS) as *mut u8;
    let offset = |batch: u64, k: usize| {
        let block = (batch as usize * QD + k) % BLOCKS;
        ((qi * BLOCKS + block) * BS) as u64
    };
    let mut batch = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for k in 0..QD {
            // SAFETY: buffer k of this queue: BS bytes inside the client's
            // region, used by this thread only, not in flight now.
            let buf = unsafe { std::slice::from_raw_parts_mut(wbuf(k), BS) };
            fill(buf, qi, batch, k);
            q.write(offset(batch, k), wbuf(k), BS, k, ReqFlags::empty());
        }
        let got = Client::wait(q, QD);
        let now = Instant::now();
        assert_eq!(
            got,
            (0..QD).map(|k| (k, 0)).collect::<Vec<_>>(),
            "queue {qi} writes"
        );
        for _ in 0..QD {
            on_complete(now, qi);
        }
        for k in 0..QD {
            q.read(offset(batch, k), rbuf(k), BS, k, ReqFlags::empty());
        }
        let got = Client::wait(q, QD);
        let now = Instant::now();
        assert_eq!(
            got,
            (0..QD).map(|k| (k, 0)).collect::<Vec<_>>(),
            "queue {qi} reads"
        );
        let mut want = vec![0u8; BS];
        for k in 0..QD {
            on_complete(now, qi);
            fill(&mut want, qi, batch, k);
            // SAFETY: read buffer k of this queue, completed above.
            let got = unsafe { std::slice::from_raw_parts(rbuf(k), BS) };
            if got != want.as_slice() {
                tally.bad.fetch_add(1, Ordering::Relaxed);
                first_error.lock().unwrap().get_or_insert_with(|| {
                    format!("queue {qi} batch {batch} block {k}: read back other bytes")
                });
            }
        }
        tally.done.fetch_add(2 * QD as u64, Ordering::Relaxed);
        batch += 1;
    }
}

/// Hundreds of moves under load: zero verify errors, every completion
/// counted once, and afterwards a moved queue is served by its new owner.
#[test]
fn queues_move_between_iothreads_under_load() {
    const MOVES: usize = 400;
    let dir = scratch("queue-move");
    let daemon = start_daemon(&dir);
    let mut c = Client::connect(&daemon.sockets()[0], QUEUES).unwrap();
    let before = per_queue(&daemon.stats());
    let mem = c.region.addr;
    let stop = AtomicBool::new(false);
    let tallies: Vec<Tally> = (0..QUEUES).map(|_| Tally::default()).collect();
    let first_error = Mutex::new(None);
    // Round robin: queue q starts on IOThread q % 3.
    let mut owner: Vec<usize> = (0..QUEUES).map(|q| q % IOTHREADS).collect();
    let (mut handed_over, mut drained) = (0, 0);
    let mut during = [0u64; QUEUES];
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (qi, q) in c.queues.iter_mut().enumerate() {
            let (stop, tally, first_error) = (&stop, &tallies[qi], &first_error);
            s.spawn(move || load(q, qi, mem, stop, tally, first_error, |_, _| {}));
        }
        // Let every queue get going, then move them round and round: each
        // queue goes to the next IOThread, so every pair of threads hands
        // rings to each other both ways.
        std::thread::sleep(Duration::from_millis(50));
        let start: Vec<u64> = tallies
            .iter()
            .map(|t| t.done.load(Ordering::Relaxed))
            .collect();
        for i in 0..MOVES {
            let q = i % QUEUES;
            let to = (owner[q] + 1) % IOTHREADS;
            let moved = daemon.move_queue(EXPORT, q as u16, to);
            let moved = match moved {
                Ok(m) => m,
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    panic!("move {i} of queue {q} to {to}: {e}");
                }
            };
            assert_eq!((moved.from, moved.to), (owner[q], to), "move {i}");
            handed_over += moved.handed_over as usize;
            drained += moved.drained;
            owner[q] = to;
            // A little I/O between moves of the same queue.
            if q == QUEUES - 1 {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        for (qi, t) in tallies.iter().enumerate() {
            during[qi] = t.done.load(Ordering::Relaxed) - start[qi];
        }
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!(
        "{MOVES} moves in {:?}: {handed_over} running rings handed over, {drained} requests \
         drained, requests per queue during the moves {during:?}",
        t0.elapsed()
    );
    assert_eq!(*first_error.lock().unwrap(), None);
    let bad: u64 = tallies.iter().map(|t| t.bad.load(Ordering::Relaxed)).sum();
    assert_eq!(bad, 0, "blocks read back wrong");
    assert_eq!(handed_over, MOVES, "every ring was running");
    assert!(drained > 0, "no move happened with requests in flight");
    assert!(
        during.iter().all(|&n| n > 0),
        "a queue made no progress: {during:?}"
    );
    // No lost or duplicated completion: the daemon counted, per queue,
    // exactly what the client saw complete.
    let after = per_queue(&daemon.stats());
    for qi in 0..QUEUES {
        assert_eq!(
            after[qi] - before[qi],
            tallies[qi].done.load(Ordering::Relaxed),
            "queue {qi}: daemon and client disagree"
        );
    }
    // Afterwards a moved queue is served by its new IOThread only.
    let to = (owner[0] + 1) % IOTHREADS;
    let m = daemon.move_queue(EXPORT, 0, to).unwrap();
    assert!(m.handed_over);
    let s0 = by_thread(&daemon.stats(), 0);
    for i in 0..50 {
        assert_eq!(c.write(0, (i * BS) as u64, 0, BS), 0);
    }
    let s1 = by_thread(&daemon.stats(), 0);
    let grew: Vec<u64> = s1.iter().zip(&s0).map(|(a, b)| a - b).collect();
    let mut want = vec![0; IOTHREADS];
    want[to] = 50;
    assert_eq!(
        grew, want,
        "requests of queue 0 by IOThread after its move to {to}"
    );
    drop(c);
    daemon.shutdown();
}

/// The guest-visible stall of one move under load: the longest gap between
/// completions on the moved queue around the move, against the longest gap
/// while no queue moves. A measurement, printed (run with --nocapture), not
/// a timed assertion.
#[test]
fn stall_of_one_move_under_load() {
    const SAMPLES: usize = 20;
    let dir = scratch("queue-move-stall");
    let daemon = start_daemon(&dir);
    let mut c = Client::connect(&daemon.sockets()[0], QUEUES).unwrap();
    let mem = c.region.addr;
    let stop = AtomicBool::new(false);
    let tallies: Vec<Tally> = (0..QUEUES).map(|_| Tally::default()).collect();
    let first_error = Mutex::new(None);
    // Completion times of queue 0.
    let times = Mutex::new(Vec::<Instant>::with_capacity(1 << 20));
    let mut windows = Vec::new();
    let mut reported = Vec::new();
    std::thread::scope(|s| {
        for (qi, q) in c.queues.iter_mut().enumerate() {
            let (stop, tally, first_error, times) = (&stop, &tallies[qi], &first_error, &times);
            s.spawn(move || {
                load(q, qi, mem, stop, tally, first_error, |t, qi| {
                    if qi == 0 {
                        times.lock().unwrap().push(t);
                    }
                })
            });
        }
        std::thread::sleep(Duration::from_millis(100));
        let mut owner = 0;
        for _ in 0..SAMPLES {
            let to = (owner + 1) % IOTHREADS;
            let t = Instant::now();
            let m = daemon.move_queue(EXPORT, 0, to).unwrap();
            windows.push((t, Instant::now()));
            reported.push(m);
            owner = to;
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(*first_error.lock().unwrap(), None);
    let times = times.into_inner().unwrap();
    // For each move: the gap between the last completion before it began
    // and the first after it returned spans it; its length is the stall the
    // queue's user saw (at most; a batch's completions share one time).
    let gap_across = |(a, b): (Instant, Instant)| {
        let before = times.iter().rev().find(|&&t| t <= a);
        let after = times.iter().find(|&&t| t >= b);
        match (before, after) {
            (Some(x), Some(y)) => y.duration_since(*x),
            _ => Duration::ZERO,
        }
    };
    let mut stalls: Vec<Duration> = windows.iter().map(|&w| gap_across(w)).collect();
    // Gaps between batches (a batch's completions share one time) that no
    // move overlaps: the queue's ordinary rhythm.
    let moving = |a: Instant, b: Instant| windows.iter().any(|&(x, y)| a <= y && b >= x);
    let mut gaps: Vec<Duration> = times
        .windows(2)
        .filter(|w| w[1] > w[0] && !moving(w[0], w[1]))
        .map(|w| w[1] - w[0])
        .collect();
    stalls.sort();
    gaps.sort();
    let pct = |v: &[Duration], p: usize| v[(v.len() - 1) * p / 100];
    let mut own: Vec<Duration> = reported.iter().map(|m| m.stall).collect();
    own.sort();
    println!(
        "queue-move stall, {SAMPLES} moves of queue 0 under load (4 queues x QD{QD} 4 KiB \
         write+verify, io_uring, {IOTHREADS} IOThreads):\n\
         \x20 completion gap across a move: median {:?}, max {:?}\n\
         \x20 move_queue's own stall figure: median {:?}, max {:?}\n\
         \x20 requests drained per move: {:?}\n\
         \x20 gaps between batches on queue 0 away from moves: median {:?}, p99 {:?}, \
         max {:?} ({} gaps)",
        pct(&stalls, 50),
        pct(&stalls, 100),
        pct(&own, 50),
        pct(&own, 100),
        reported.iter().map(|m| m.drained).collect::<Vec<_>>(),
        pct(&gaps, 50),
        pct(&gaps, 99),
        pct(&gaps, 100),
        gaps.len(),
    );
    drop(c);
    daemon.shutdown();
}

/// Moves race with the frontend's own ring operations: a client connects,
/// runs its load, and disconnects (every ring stopped: the transport's
/// drain) over and over while another thread keeps moving queues. Rings
/// start, stop and move in every order; each connection's I/O verifies, the
/// counters add up, no ring is left served after its frontend left, and a
/// new frontend's queues are served where the mapping says.
#[test]
fn moves_race_with_reconnections() {
    const CONNECTIONS: usize = 8;
    let dir = scratch("queue-move-reconnect");
    let daemon = start_daemon(&dir);
    let before = per_queue(&daemon.stats());
    let done = AtomicBool::new(false);
    let mut client_total = [0u64; QUEUES];
    let mut moves = 0usize;
    std::thread::scope(|s| {
        let mover = s.spawn(|| {
            let mut owner: Vec<usize> = (0..QUEUES).map(|q| q % IOTHREADS).collect();
            let (mut n, mut i) = (0usize, 0usize);
            while !done.load(Ordering::Relaxed) {
                let q = i % QUEUES;
                let to = (owner[q] + 1 + i / QUEUES % 2) % IOTHREADS;
                let m = daemon.move_queue(EXPORT, q as u16, to).expect("move");
                assert_eq!(m.from, owner[q]);
                owner[q] = to;
                n += 1;
                i += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
            n
        });
        for conn in 0..CONNECTIONS {
            let mut c = Client::connect(&daemon.sockets()[0], QUEUES).unwrap();
            let mem = c.region.addr;
            let stop = AtomicBool::new(false);
            let tallies: Vec<Tally> = (0..QUEUES).map(|_| Tally::default()).collect();
            let first_error = Mutex::new(None);
            std::thread::scope(|s| {
                for (qi, q) in c.queues.iter_mut().enumerate() {
                    let (stop, tally, first_error) = (&stop, &tallies[qi], &first_error);
                    s.spawn(move || load(q, qi, mem, stop, tally, first_error, |_, _| {}));
                }
                std::thread::sleep(Duration::from_millis(40));
                stop.store(true, Ordering::Relaxed);
            });
            assert_eq!(*first_error.lock().unwrap(), None, "connection {conn}");
            for (qi, t) in tallies.iter().enumerate() {
                client_total[qi] += t.done.load(Ordering::Relaxed);
            }
            drop(c);
        }
        done.store(true, Ordering::Relaxed);
        moves = mover.join().unwrap();
    });
    let after = daemon.stats();
    eprintln!("{moves} moves across {CONNECTIONS} connections");
    assert!(moves > CONNECTIONS, "the mover ran");
    let counted = per_queue(&after);
    for qi in 0..QUEUES {
        assert_eq!(counted[qi] - before[qi], client_total[qi], "queue {qi}");
    }
    let broken: u64 = after.iothreads.iter().map(|t| t.broken_rings).sum();
    assert_eq!(broken, 0);
    // The frontend is gone: once its session has stopped every ring, no
    // IOThread serves a ring of the export any more, so a move finds none
    // running. A ring a racing move took away from the drain would still be
    // served (and followed by every move).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut running = false;
        for q in 0..QUEUES {
            for t in 0..IOTHREADS {
                running |= daemon.move_queue(EXPORT, q as u16, t).unwrap().handed_over;
            }
        }
        if !running {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a ring is still served after its frontend left"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // One last connection: each queue is served where the mapping says,
    // by one IOThread only.
    let mut c = Client::connect(&daemon.sockets()[0], QUEUES).unwrap();
    for q in 0..QUEUES {
        let to = (q + 1) % IOTHREADS;
        daemon.move_queue(EXPORT, q as u16, to).unwrap();
        let s0 = by_thread(&daemon.stats(), q as u16);
        for i in 0..10 {
            assert_eq!(c.write(q, (i * BS) as u64, 0, BS), 0);
        }
        let s1 = by_thread(&daemon.stats(), q as u16);
        let grew: Vec<u64> = s1.iter().zip(&s0).map(|(a, b)| a - b).collect();
        let mut want = vec![0; IOTHREADS];
        want[to] = 10;
        assert_eq!(grew, want, "queue {q} after its move to {to}");
    }
    drop(c);
    daemon.shutdown();
}
