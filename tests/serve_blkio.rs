//! `vqblk serve` driven by a real vhost-user-blk frontend: libblkio.
//! Every test body runs over every backend where it applies.

mod common;

use common::*;
use vqblk_daemon::config::BackendKind;
use vqblk_daemon::mapping::VirtqueueMap;

const BACKENDS: [BackendKind; 3] = [
    BackendKind::IoUring,
    BackendKind::Threads,
    BackendKind::Null,
];
const FILE_BACKENDS: [BackendKind; 2] = [BackendKind::IoUring, BackendKind::Threads];
const SIZE: u64 = 64 << 20;
const BS: usize = 4096;

/// Several queues on several IOThreads write distinct patterns concurrently
/// (each queue keeps many requests in flight), then everything is read back.
#[test]
fn concurrent_patterns_on_every_backend() {
    for backend in BACKENDS {
        let dir = scratch(&format!("patterns-{backend:?}"));
        let daemon = start(export(&dir, backend, 4, SIZE), 2);
        let mut c = Client::connect(&daemon.sockets()[0], 4).unwrap();
        assert_eq!(c.capacity, SIZE);
        let blocks_per_writer = 64;
        // Region layout: writer w uses [w*256K, (w+1)*256K).
        let per = blocks_per_writer * BS;
        for w in 0..4 {
            for b in 0..blocks_per_writer {
                let base = w * per + b * BS;
                for i in 0..BS {
                    c.buf()[base + i] = pattern(w, b, i);
                }
            }
        }
        let addr = c.region.addr;
        std::thread::scope(|s| {
            for (w, q) in c.queues.iter_mut().enumerate() {
                s.spawn(move || {
                    for b in 0..blocks_per_writer {
                        let off = ((w * blocks_per_writer + b) * BS) as u64;
                        let p = (addr + w * per + b * BS) as *const u8;
                        q.write(off, p, BS, b, blkio::ReqFlags::empty());
                    }
                    for (_, ret) in Client::wait(q, blocks_per_writer) {
                        assert_eq!(ret, 0, "write failed");
                    }
                });
            }
        });
        assert_eq!(c.flush(0), 0);
        // Read everything back through a different queue than the writer's.
        let rb = 4 * per;
        for w in 0..4 {
            assert_eq!(c.read((w + 1) % 4, (w * per) as u64, rb, per), 0);
            let got = &c.buf()[rb..rb + per].to_vec();
            for b in 0..blocks_per_writer {
                for i in (0..BS).step_by(509) {
                    let want = if backend == BackendKind::Null {
                        0
                    } else {
                        pattern(w, b, i)
                    };
                    assert_eq!(
                        got[b * BS + i],
                        want,
                        "{backend:?} writer {w} block {b} byte {i}"
                    );
                }
            }
        }
        drop(c);
        let stats = daemon.shutdown();
        let total: u64 = stats.iothreads.iter().map(|t| t.requests).sum();
        let queues = stats.iothreads.iter().flat_map(|t| &t.queues);
        let written: u64 = queues.clone().map(|q| q.bytes_written).sum();
        let read: u64 = queues.map(|q| q.bytes_read).sum();
        assert_eq!(
            written,
            (4 * per) as u64,
            "{backend:?}: bytes_written counter"
        );
        assert_eq!(read, (4 * per) as u64, "{backend:?}: bytes_read counter");
        assert!(
            total >= 4 * blocks_per_writer as u64 + 5,
            "{backend:?}: {total} requests counted"
        );
        if backend != BackendKind::Null {
            let img = std::fs::read(dir.join("disk.raw")).unwrap();
            assert_eq!(
                img[per + 3 * BS + 5],
                pattern(1, 3, 5),
                "{backend:?}: data reached the image"
            );
        }
    }
}

/// Flush succeeds; discard and write-zeroes (with and without unmap) read back as zeroes.
#[test]
fn flush_discard_write_zeroes() {
    for backend in FILE_BACKENDS {
        let dir = scratch(&format!("zeroes-{backend:?}"));
        let daemon = start(export(&dir, backend, 1, SIZE), 1);
        let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
        c.buf()[..3 * 65536].fill(0xee);
        for (i, off) in [0u64, 1 << 20, 2 << 20].iter().enumerate() {
            assert_eq!(c.write(0, *off, 0, 65536), 0);
            let _ = i;
        }
        assert_eq!(c.flush(0), 0);
        assert_eq!(c.discard(0, 0, 65536), 0);
        assert_eq!(c.write_zeroes(0, 1 << 20, 65536, true), 0);
        assert_eq!(c.write_zeroes(0, 2 << 20, 32768, false), 0);
        for (off, zero_len) in [(0u64, 65536usize), (1 << 20, 65536), (2 << 20, 32768)] {
            assert_eq!(c.read(0, off, 65536, 65536), 0);
            let got = c.buf()[65536..131072].to_vec();
            assert!(
                got[..zero_len].iter().all(|&b| b == 0),
                "{backend:?} at {off}: not zero"
            );
            assert!(
                got[zero_len..].iter().all(|&b| b == 0xee),
                "{backend:?} at {off}: tail clobbered"
            );
        }
    }
}

/// A read-only export refuses writes, discards and write-zeroes while reads
/// work. (The server-side refusal of each request type is unit-tested in
/// virtio::request, since libblkio does not send writes to a read-only device.)
#[test]
fn read_only_export() {
    for backend in BACKENDS {
        let dir = scratch(&format!("ro-{backend:?}"));
        if backend != BackendKind::Null {
            std::fs::write(dir.join("disk.raw"), vec![0x5a; SIZE as usize]).unwrap();
        }
        let mut e = export(&dir, backend, 2, SIZE);
        e.read_only = true;
        e.create = None;
        let daemon = start(e, 2);
        // libblkio refuses a read-write open of a device that offers VIRTIO_BLK_F_RO.
        let e = Client::connect(&daemon.sockets()[0], 2)
            .err()
            .expect("read-write open refused");
        assert_eq!(
            e.errno(),
            blkio::Errno::ROFS,
            "{backend:?}: {}",
            e.message()
        );
        let mut c = Client::connect_with(&daemon.sockets()[0], 2, true).unwrap();
        c.buf()[..4096].fill(1);
        assert!(
            c.write(0, 0, 0, 4096) < 0,
            "{backend:?}: write on a read-only export succeeded"
        );
        assert!(c.discard(1, 0, 4096) < 0);
        assert!(c.write_zeroes(1, 0, 4096, false) < 0);
        assert_eq!(c.read(1, 0, 8192, 4096), 0);
        let want = if backend == BackendKind::Null {
            0
        } else {
            0x5a
        };
        assert!(c.buf()[8192..12288].iter().all(|&b| b == want));
        drop(c);
        drop(daemon);
        if backend != BackendKind::Null {
            let img = std::fs::read(dir.join("disk.raw")).unwrap();
            assert!(img.iter().all(|&b| b == 0x5a), "image modified");
        }
    }
}

/// Out-of-range and malformed requests fail; the next request succeeds.
#[test]
fn bad_requests_fail_and_the_queue_keeps_working() {
    for backend in BACKENDS {
        let dir = scratch(&format!("bad-{backend:?}"));
        let daemon = start(export(&dir, backend, 1, SIZE), 1);
        let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
        assert!(c.read(0, SIZE, 0, 4096) < 0, "read past the end");
        assert!(
            c.read(0, SIZE - 512, 0, 4096) < 0,
            "read straddling the end"
        );
        assert!(
            c.write(0, SIZE - 512, 0, 1024) < 0,
            "write straddling the end"
        );
        // libblkio checks only the start offset's alignment: the length is ours to refuse.
        assert!(c.read(0, 0, 0, 1000) < 0, "length not a multiple of 512");
        assert!(c.discard(0, SIZE, 512) < 0, "discard past the end");
        assert_eq!(
            c.read(0, SIZE - 4096, 0, 4096),
            0,
            "{backend:?}: queue still works"
        );
        drop(c);
        let stats = daemon.shutdown();
        let errors: u64 = stats
            .iothreads
            .iter()
            .flat_map(|t| &t.queues)
            .map(|q| q.errors)
            .sum();
        assert_eq!(errors, 5, "{backend:?}");
    }
}

/// A client that disconnects (even with requests in flight) leaves the
/// daemon serving the next client on the same socket; data persists.
#[test]
fn disconnect_and_reconnect() {
    for backend in FILE_BACKENDS {
        let dir = scratch(&format!("reconnect-{backend:?}"));
        let daemon = start(export(&dir, backend, 2, SIZE), 2);
        let sock = daemon.sockets()[0].clone();
        {
            let mut c = Client::connect(&sock, 2).unwrap();
            c.buf()[..4096].fill(0x42);
            assert_eq!(c.write(1, 8192, 0, 4096), 0);
            // Leave requests in flight and vanish.
            let p = c.region.addr as *mut u8;
            for i in 0..32 {
                c.queues[0].read((i * 4096) as u64, p, 4096, i, blkio::ReqFlags::empty());
            }
            let mut none = [std::mem::MaybeUninit::<blkio::Completion>::uninit()];
            let _ = c.queues[0].do_io(&mut none, 0, None, None);
        }
        for round in 0..3 {
            let mut c =
                Client::connect(&sock, 2).unwrap_or_else(|e| panic!("reconnect {round}: {e}"));
            assert_eq!(c.read(round % 2, 8192, 4096, 4096), 0);
            assert!(
                c.buf()[4096..8192].iter().all(|&b| b == 0x42),
                "{backend:?} round {round}"
            );
        }
    }
}

/// Each IOThread served exactly the queues mapped to it (explicit mapping).
#[test]
fn iothreads_serve_only_their_queues() {
    for (spec, threads) in [("0:0,2;1:1,3", 2), ("1:0;0:1,2,3", 2)] {
        let dir = scratch("mapping");
        let mut e = export(&dir, BackendKind::Null, 4, SIZE);
        e.iothread_vq_mapping = Some(VirtqueueMap::parse_spec(spec).unwrap());
        let daemon = start(e, threads);
        let mut c = Client::connect(&daemon.sockets()[0], 4).unwrap();
        for q in 0..4 {
            for _ in 0..=q {
                assert_eq!(c.read(q, 0, 0, 4096), 0);
            }
        }
        drop(c);
        let stats = daemon.shutdown();
        let map =
            VirtqueueMap::explicit(4, &VirtqueueMap::parse_spec(spec).unwrap(), threads).unwrap();
        for (t, ts) in stats.iothreads.iter().enumerate() {
            let served: Vec<u16> = ts
                .queues
                .iter()
                .filter(|q| q.requests > 0)
                .map(|q| q.queue)
                .collect();
            assert_eq!(
                served,
                map.queues_of(t),
                "{spec}: IOThread {t} served {served:?}"
            );
            for q in &ts.queues {
                assert_eq!(
                    q.requests,
                    q.queue as u64 + 1,
                    "{spec}: queue {} count",
                    q.queue
                );
            }
            assert_eq!(ts.name, format!("vqblk-iot{t}"));
        }
    }
}

/// A socket path held by a regular file, an unreachable image and bad
/// geometry are refused with a message naming the problem.
#[test]
fn start_errors_are_clear() {
    let dir = scratch("errors");
    std::fs::write(dir.join("disk.sock"), b"not a socket").unwrap();
    let mut e = export(&dir, BackendKind::Null, 1, SIZE);
    let mut cfg = vqblk_daemon::config::ServeConfig {
        exports: vec![e.clone()],
        ..Default::default()
    };
    let msg = vqblk_daemon::daemon::Daemon::start(&cfg)
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("exists and is not a socket"), "{msg}");
    e = export(&dir, BackendKind::IoUring, 1, SIZE);
    e.create = None;
    e.socket = dir.join("other.sock");
    cfg.exports = vec![e];
    let msg = vqblk_daemon::daemon::Daemon::start(&cfg)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("does not exist") && msg.contains("--create"),
        "{msg}"
    );
}
