//! I/O limits and throttle groups enforced on the data path, measured from a
//! real client (libblkio) against null exports: one test per kind of limit,
//! a group of three exports, and limits changed live on the control socket.
//! The tolerances are generous (CI is a noisy 2-core VM): each rate is
//! measured over at least 2 s after a warm-up that takes the bucket's initial
//! allowance; the precise figures come from `scripts/bench.py qos`.

mod common;

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

use blkio::{Blkioq, Completion, ReqFlags};
use common::control_socket::*;
use common::*;
use serde_json::{json, Value};
use vqblk_daemon::config::ThrottleGroupConfig;
use vqblk_daemon::config::{BackendKind, ExportConfig};
use vqblk_daemon::control::client::ClientError;
use vqblk_daemon::qos::ThrottleConfig;

const SIZE: u64 = 64 << 20;
/// Requests each queue keeps in flight.
const QD: usize = 8;
const WARMUP: Duration = Duration::from_millis(700);
const MEASURE: Duration = Duration::from_millis(2000);
/// The warm-up of [`flood_all`]: long enough for the share allocator (100 ms
/// ticks) to measure the device and set the caps.
const FLOOD_WARMUP: Duration = Duration::from_millis(1500);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Read,
    Write,
}

/// What one queue did while measured.
#[derive(Debug, Default, Clone, Copy)]
struct Measured {
    /// Requests completed during the warm-up.
    warmup_ops: u64,
    /// Requests completed after it.
    ops: u64,
    /// Seconds measured after the warm-up.
    secs: f64,
}

impl Measured {
    fn iops(&self) -> f64 {
        self.ops as f64 / self.secs
    }
}

/// Keeps [`QD`] requests of `bs` bytes in flight on `q` for `warmup +
/// measure`, counting completions after the warm-up; every request must
/// succeed (held back is slow, never an error).
fn drive(
    q: &mut Blkioq,
    buf: usize,
    op: Op,
    bs: usize,
    warmup: Duration,
    measure: Duration,
) -> Measured {
    let mut c: Vec<MaybeUninit<Completion>> = (0..QD).map(|_| MaybeUninit::uninit()).collect();
    let mut next = 0u64;
    let mut submit = |q: &mut Blkioq| {
        let off = (next * bs as u64) % (SIZE - bs as u64);
        next += 1;
        match op {
            Op::Read => q.read(off, buf as *mut u8, bs, 0, ReqFlags::empty()),
            Op::Write => q.write(off, buf as *const u8, bs, 0, ReqFlags::empty()),
        }
    };
    for _ in 0..QD {
        submit(q);
    }
    let start = Instant::now();
    let end = start + warmup + measure;
    let mut m = Measured::default();
    let mut in_flight = QD;
    let mut measured_from = None;
    while in_flight > 0 {
        let mut t = Duration::from_secs(20);
        let got = q.do_io(&mut c, 1, Some(&mut t), None).expect("do_io");
        assert!(got > 0, "no completion in 20 s");
        let now = Instant::now();
        for x in &c[..got] {
            // SAFETY: do_io initialised the first `got` entries.
            let x = unsafe { x.assume_init_ref() };
            assert_eq!(x.ret, 0, "a throttled request failed");
            in_flight -= 1;
            if now < start + warmup {
                m.warmup_ops += 1;
            } else if now < end {
                measured_from.get_or_insert(now);
                m.ops += 1;
            }
            if now < end {
                submit(q);
                in_flight += 1;
            }
        }
    }
    m.secs = measure.as_secs_f64();
    m
}

/// `value` is within `tol` (a fraction) of `want`.
fn near(what: &str, value: f64, want: f64, tol: f64) {
    assert!(
        (value - want).abs() <= tol * want,
        "{what}: {value:.1} measured, {want} wanted (within {:.0}%)",
        tol * 100.0
    );
}

fn null_export(dir: &Path, name: &str, queues: u16) -> ExportConfig {
    let mut e = export(dir, BackendKind::Null, queues, SIZE);
    e.socket = dir.join(format!("{name}.sock"));
    e.name = Some(name.into());
    e
}

/// Each queue of `c` driven by its own thread with `ops[i]`; what each did.
fn drive_all(c: &mut Client, ops: &[Op], bs: usize) -> Vec<Measured> {
    let addr = c.region.addr;
    std::thread::scope(|s| {
        let handles: Vec<_> = c
            .queues
            .iter_mut()
            .zip(ops)
            .enumerate()
            .map(|(i, (q, &op))| {
                s.spawn(move || drive(q, addr + i * (1 << 20), op, bs, WARMUP, MEASURE))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `iops-total` caps reads and writes together, over queues on both
/// IOThreads.
#[test]
fn iops_total_caps_reads_and_writes_together() {
    let dir = scratch("qos-iops-total");
    let mut e = null_export(&dir, "d", 2);
    e.throttle = Some(ThrottleConfig {
        iops_total: Some(200),
        ..Default::default()
    });
    let (daemon, _) = start_with_control(&dir, vec![e], vec![]);
    let mut c = Client::connect(&daemon.sockets()[0], 2).unwrap();
    let m = drive_all(&mut c, &[Op::Read, Op::Write], 4096);
    near(
        "reads + writes IOPS",
        m[0].iops() + m[1].iops(),
        200.0,
        0.15,
    );
    assert!(
        m[0].ops > 0 && m[1].ops > 0,
        "both directions served: {m:?}"
    );
    drop(c);
    let stats = daemon.shutdown();
    let throttled: u64 = stats
        .iothreads
        .iter()
        .flat_map(|t| &t.queues)
        .map(|q| q.throttled)
        .sum();
    assert!(throttled > 100, "requests were held back: {throttled}");
}

/// `bps-total` caps bytes: 64 KiB requests under 4 MiB/s.
#[test]
fn bps_total_caps_bytes() {
    let dir = scratch("qos-bps-total");
    let mut e = null_export(&dir, "d", 1);
    let bps = 4u64 << 20;
    e.throttle = Some(ThrottleConfig {
        bps_total: Some(bps),
        ..Default::default()
    });
    let (daemon, _) = start_with_control(&dir, vec![e], vec![]);
    let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
    let bs = 64 << 10;
    let m = drive_all(&mut c, &[Op::Read], bs);
    near(
        "bytes per second",
        m[0].iops() * bs as f64,
        bps as f64,
        0.15,
    );
}

/// `iops-read` holds reads back and leaves writes alone.
#[test]
fn iops_read_limits_reads_not_writes() {
    let dir = scratch("qos-iops-read");
    let mut e = null_export(&dir, "d", 2);
    e.throttle = Some(ThrottleConfig {
        iops_read: Some(100),
        ..Default::default()
    });
    let (daemon, _) = start_with_control(&dir, vec![e], vec![]);
    let mut c = Client::connect(&daemon.sockets()[0], 2).unwrap();
    let m = drive_all(&mut c, &[Op::Read, Op::Write], 4096);
    near("read IOPS", m[0].iops(), 100.0, 0.15);
    assert!(
        m[1].iops() > 500.0,
        "writes are not limited: {:.0} IOPS",
        m[1].iops()
    );
}

/// `iops-total-max` with `-max-length`: a burst at the start, then the
/// average rate.
#[test]
fn a_burst_then_the_average_rate() {
    let dir = scratch("qos-burst");
    let mut e = null_export(&dir, "d", 1);
    e.throttle = Some(ThrottleConfig {
        iops_total: Some(100),
        iops_total_max: Some(300),
        iops_total_max_length: Some(2),
        ..Default::default()
    });
    let (daemon, _) = start_with_control(&dir, vec![e], vec![]);
    let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
    let addr = c.region.addr;
    // The bucket holds 300 * 2 operations and fills at 300/s while it
    // leaks 100/s: about 3 s of burst at 300 IOPS, then 100 IOPS.
    let burst = drive(
        &mut c.queues[0],
        addr,
        Op::Read,
        4096,
        Duration::ZERO,
        Duration::from_secs(2),
    );
    near("burst IOPS", burst.iops(), 300.0, 0.15);
    let after = drive(
        &mut c.queues[0],
        addr,
        Op::Read,
        4096,
        Duration::from_millis(1500),
        MEASURE,
    );
    near("IOPS after the burst", after.iops(), 100.0, 0.15);
}

/// Three exports in one group share its limit: their sum stays under it,
/// whatever each does.
#[test]
fn a_group_of_three_exports_shares_its_limit() {
    let dir = scratch("qos-group");
    let exports: Vec<ExportConfig> = ["a", "b", "c"]
        .iter()
        .map(|n| {
            let mut e = null_export(&dir, n, 1);
            e.throttle_group = Some("tenant".into());
            e
        })
        .collect();
    let group = ThrottleGroupConfig {
        name: "tenant".into(),
        limits: ThrottleConfig {
            iops_total: Some(300),
            ..Default::default()
        },
    };
    let (daemon, control) = start_with_control(&dir, exports, vec![group]);
    let groups = call(&control, "query-throttle-groups", json!({})).unwrap();
    assert_eq!(groups[0]["name"], "tenant");
    assert_eq!(groups[0]["limits"]["iops-total"], 300);
    assert_eq!(groups[0]["members"], json!(["a", "b", "c"]));
    let mut clients: Vec<Client> = daemon
        .sockets()
        .iter()
        .map(|s| Client::connect(s, 1).unwrap())
        .collect();
    let m: Vec<Measured> = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter_mut()
            .map(|c| {
                let addr = c.region.addr;
                s.spawn(move || drive(&mut c.queues[0], addr, Op::Read, 4096, WARMUP, MEASURE))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let sum: f64 = m.iter().map(Measured::iops).sum();
    near("the group's IOPS", sum, 300.0, 0.15);
    // Queues that wait for the same credit take turns: none is starved.
    let total: u64 = m.iter().map(|x| x.ops).sum();
    for (i, x) in m.iter().enumerate() {
        assert!(
            x.ops as f64 > 0.2 * total as f64,
            "member {i} gets a share: {m:?}"
        );
    }
}

/// `block_set_io_throttle` changes an export's rate while a client runs,
/// `throttle-group-set` a group's; errors name the key.
#[test]
fn limits_change_live_on_the_control_socket() {
    let dir = scratch("qos-live");
    let mut e = null_export(&dir, "d", 1);
    e.throttle = Some(ThrottleConfig {
        iops_total: Some(100),
        ..Default::default()
    });
    let (daemon, control) = start_with_control(&dir, vec![e], vec![]);
    let mut c = Client::connect(&daemon.sockets()[0], 1).unwrap();
    let addr = c.region.addr;
    let run =
        |c: &mut Client| drive(&mut c.queues[0], addr, Op::Read, 4096, WARMUP, MEASURE).iops();
    near("IOPS at 100", run(&mut c), 100.0, 0.15);
    call(
        &control,
        "block_set_io_throttle",
        json!({"export": "d", "iops-total": 400}),
    )
    .unwrap();
    let exports = call(&control, "query-exports", json!({})).unwrap();
    assert_eq!(exports[0]["throttle"]["iops-total"], 400);
    assert!(exports[0]["queues"][0]["throttled"].as_u64().unwrap() > 0);
    near("IOPS at 400", run(&mut c), 400.0, 0.15);
    // A group made live, joined live, changed live.
    call(
        &control,
        "throttle-group-set",
        json!({"name": "g", "iops-total": 150}),
    )
    .unwrap();
    call(
        &control,
        "block_set_io_throttle",
        json!({"export": "d", "group": "g"}),
    )
    .unwrap();
    near("IOPS in the group", run(&mut c), 150.0, 0.15);
    call(
        &control,
        "throttle-group-set",
        json!({"name": "g", "iops-total": 250}),
    )
    .unwrap();
    near("IOPS in the changed group", run(&mut c), 250.0, 0.15);
    let exports = call(&control, "query-exports", json!({})).unwrap();
    assert_eq!(exports[0]["throttle-group"], "g");
    assert_eq!(exports[0]["throttle"], Value::Null);
    // All limits off: unthrottled.
    call(&control, "block_set_io_throttle", json!({"export": "d"})).unwrap();
    let free = run(&mut c);
    assert!(free > 1000.0, "unthrottled: {free:.0} IOPS");
    for (params, key) in [
        (
            json!({"export": "d", "iops-total-max": 10}),
            "iops-total-max",
        ),
        (
            json!({"export": "d", "iops-total": 10, "iops-read": 5}),
            "iops-read",
        ),
        (json!({"export": "d", "iops-totl": 10}), "iops-totl"),
        (json!({"export": "nope", "iops-total": 10}), "export"),
        (json!({"export": "d", "group": "none"}), "group"),
    ] {
        match call(&control, "block_set_io_throttle", params.clone()) {
            Err(ClientError::Rpc { code, message }) => {
                assert_eq!(code, -32602, "{params}: {message}");
                assert!(
                    message.starts_with(key),
                    "{params}: {message:?} names {key}"
                );
            }
            other => panic!("{params}: expected an error, got {other:?}"),
        }
    }
    match call(
        &control,
        "throttle-group-set",
        json!({"name": "1bad", "iops-total": 5}),
    ) {
        Err(ClientError::Rpc { code, message }) => {
            assert_eq!(code, -32602);
            assert!(message.starts_with("name"), "{message}");
        }
        other => panic!("a bad group name is refused, got {other:?}"),
    }
    drop(c);
    drop(daemon);
}

/// An export with an image in `dir`: exports made by this share the
/// directory's filesystem, one backing device for the share allocator.
fn file_export(dir: &Path, name: &str, queues: u16) -> ExportConfig {
    let mut e = export(dir, BackendKind::IoUring, queues, SIZE);
    e.socket = dir.join(format!("{name}.sock"));
    e.image = Some(dir.join(format!("{name}.raw")));
    e.name = Some(name.into());
    e
}

/// Every queue of every client flooding reads at once, after a warm-up long
/// enough for the share allocator to measure the device and set the caps
/// (it ticks every 100 ms): each client's IOPS.
fn flood_all(clients: &mut [Client]) -> Vec<f64> {
    let warmup = FLOOD_WARMUP;
    std::thread::scope(|s| {
        let handles: Vec<Vec<_>> = clients
            .iter_mut()
            .map(|c| {
                let addr = c.region.addr;
                c.queues
                    .iter_mut()
                    .enumerate()
                    .map(|(i, q)| {
                        s.spawn(move || {
                            // A 4 KiB buffer of its own in the 4 MiB region.
                            drive(q, addr + i * (64 << 10), Op::Read, 4096, warmup, MEASURE)
                        })
                    })
                    .collect()
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.into_iter().map(|h| h.join().unwrap().iops()).sum())
            .collect()
    })
}

/// [`flood_all`], and `query-exports` in the middle of the measured part:
/// the caps are read while the clients flood, since once they stop the
/// allocator rightly gives an idle export its headroom back.
fn flood_all_and_query(clients: &mut [Client], control: &Path) -> (Vec<f64>, Value) {
    std::thread::scope(|s| {
        let query = s.spawn(|| {
            std::thread::sleep(FLOOD_WARMUP + MEASURE / 2);
            call(control, "query-exports", json!({})).unwrap()
        });
        let m = flood_all(clients);
        (m, query.join().unwrap())
    })
}

/// Weights split a shared device: two exports on one filesystem, flooding
/// with the same queues and depth, weights 3 and 1. Unenforced, they split
/// the device about evenly; enforced, the heavy export gets its weighted
/// share, about 3/4 of what both do (at least 2/3 here: the device is this
/// loaded machine's CPU and disk), unless it cannot use that much: the split
/// is work-conserving, so an export whose own client does less than its
/// share alone (its queues at their depth behind a fast device) gets all it
/// can do (at least 85% of what it did alone) and the other the rest.
/// The weights are set live (`share-set`), which starts the allocator;
/// `query-exports` shows the weights and the caps.
#[test]
fn weights_split_a_shared_device() {
    let dir = scratch("qos-weights");
    let exports: Vec<ExportConfig> = ["heavy", "light"]
        .into_iter()
        .map(|n| file_export(&dir, n, 2))
        .collect();
    let (daemon, control) = start_with_control(&dir, exports, vec![]);
    // A reservation above the export's live limit could never be given.
    ok(
        &control,
        "block_set_io_throttle",
        json!({"export": "light", "iops-total": 1000}),
    );
    let (_, message) = rpc_err(
        &control,
        "share-set",
        json!({"export": "light", "reservation-iops": 2000}),
    );
    assert!(
        message.starts_with("reservation-iops") && message.contains("limit of 1000"),
        "{message}"
    );
    ok(
        &control,
        "block_set_io_throttle",
        json!({"export": "light"}),
    );
    for (export, weight) in [("heavy", 3), ("light", 1)] {
        ok(
            &control,
            "share-set",
            json!({"export": export, "weight": weight}),
        );
    }
    for (params, key) in [
        (json!({"export": "heavy", "weight": 0}), "weight"),
        (json!({"export": "heavy", "weight": 10001}), "weight"),
        (
            json!({"export": "heavy", "reservation-iops": 20_000_000}),
            "reservation-iops",
        ),
        (json!({"export": "nope", "weight": 2}), "export"),
        (json!({"export": "heavy", "wieght": 2}), "wieght"),
    ] {
        let (code, message) = rpc_err(&control, "share-set", params.clone());
        assert_eq!(code, -32602, "{params}: {message}");
        assert!(
            message.starts_with(key),
            "{params}: {message:?} names {key}"
        );
    }
    let mut clients: Vec<Client> = daemon
        .sockets()
        .iter()
        .map(|s| Client::connect(s, 2).unwrap())
        .collect();
    let alone = flood_all(&mut clients[..1])[0];
    let (m, exports) = flood_all_and_query(&mut clients, &control);
    let both = m[0] + m[1];
    let want = (2.0 / 3.0 * both).min(0.85 * alone);
    assert!(
        m[0] >= want,
        "weights 3:1 split {m:?} as {:.2}:1; the heavy export alone did {alone:.0}, \
         so it should get at least {want:.0}; shares while both flooded: {}, {}",
        m[0] / m[1],
        exports[0]["share"],
        exports[1]["share"]
    );
    assert_eq!(exports[0]["weight"], 3);
    assert_eq!(exports[1]["weight"], 1);
    let share = &exports[0]["share"];
    assert_eq!(share["device"], exports[1]["share"]["device"], "one device");
    assert!(share["device"].as_str().unwrap().starts_with("fs-"));
    assert!(share["cap-iops"].as_f64().unwrap() > 0.0, "{share}");
    assert!(share["device-capacity-iops"].as_f64().unwrap() > 0.0);
    drop(clients);
    drop(daemon);
}

/// A reservation holds while a neighbour floods: two exports on one
/// filesystem, the neighbour with six queues against the reserved export's
/// one. First without shares, what the one-queue export does alone; then
/// with a reservation of 40% of that. The allocator caps the neighbour so
/// that the reservation fits the device's estimated capacity, and the
/// reserved export gets most of its reservation (at least 70%: generous,
/// the device is this loaded machine's CPU and disk, whose capacity moves
/// while it is measured).
#[test]
fn a_reservation_holds_while_a_neighbour_floods() {
    let run = |reservation: Option<u64>| {
        let dir = scratch(&format!("qos-reserve-{}", reservation.is_some()));
        let mut reserved = file_export(&dir, "reserved", 1);
        reserved.reservation_iops = reservation;
        let flood = file_export(&dir, "flood", 6);
        let (daemon, control) = start_with_control(&dir, vec![reserved, flood], vec![]);
        let mut clients: Vec<Client> = daemon
            .sockets()
            .iter()
            .zip([1, 6])
            .map(|(s, q)| Client::connect(s, q).unwrap())
            .collect();
        let alone = flood_all(&mut clients[..1])[0];
        let (both, exports) = flood_all_and_query(&mut clients, &control);
        drop(clients);
        drop(daemon);
        (alone, both, exports)
    };
    let (alone, beside, _) = run(None);
    let reservation = (0.4 * alone) as u64;
    let (_, m, exports) = run(Some(reservation));
    let why = format!(
        "reserved {reservation} IOPS, got {:.0} while the neighbour did {:.0} \
         (without the reservation: {alone:.0} alone, {beside:?} beside the flood); {exports}",
        m[0], m[1]
    );
    assert!(m[0] >= 0.7 * reservation as f64, "{why}");
    assert_eq!(exports[0]["reservation-iops"], reservation, "{why}");
    let (r, f) = (&exports[0]["share"], &exports[1]["share"]);
    let capacity = r["device-capacity-iops"].as_f64().expect(&why);
    assert!(
        r["cap-iops"].as_f64().expect(&why) >= reservation as f64,
        "{why}"
    );
    let flood_cap = f["cap-iops"].as_f64().expect(&why);
    assert!(
        flood_cap <= 1.01 * (capacity - reservation as f64).max(10.0),
        "{why}"
    );
}
