//! Tests of the limits: validation with QEMU's rules, the buckets against a
//! level-based model of QEMU's algorithm, and the shared form under threads.

use std::sync::atomic::{AtomicU64, Ordering};

use super::throttle::TICKS_PER_NS;
use super::*;

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000_000_000;

fn limits(toml_text: &str) -> Result<ThrottleLimits, LimitError> {
    let c: ThrottleConfig = toml::from_str(toml_text).expect("parses");
    c.validate()
}

fn refused(toml_text: &str) -> LimitError {
    limits(toml_text).expect_err(toml_text)
}

#[test]
fn qemu_rules_refuse_and_name_the_key() {
    for (text, key, words) in [
        (
            "iops-total = 100\niops-read = 10",
            "iops-read",
            "iops-total",
        ),
        ("bps-total = 100\nbps-write = 10", "bps-write", "bps-total"),
        (
            "bps-total = 100\nbps-total-max = 200\nbps-write-max = 300",
            "bps-write-max",
            "bps-total-max",
        ),
        ("iops-size = 4096\nbps-total = 1000", "iops-size", "iops"),
        (
            "iops-total = 1000000000000001",
            "iops-total",
            "out of range",
        ),
        (
            "bps-read = 1\nbps-read-max = 1000000000000001",
            "bps-read-max",
            "out of range",
        ),
        (
            "iops-write = 1\niops-write-max = 2\niops-write-max-length = 0",
            "iops-write-max-length",
            "out of range",
        ),
        (
            "iops-write = 1\niops-write-max = 2\niops-write-max-length = 4294967296",
            "iops-write-max-length",
            "out of range",
        ),
        (
            "iops-total = 100\niops-total-max-length = 5",
            "iops-total-max-length",
            "needs iops-total-max",
        ),
        (
            "bps-total = 1\nbps-total-max = 1000000000000000\nbps-total-max-length = 2",
            "bps-total-max-length",
            "burst",
        ),
        ("iops-read-max = 100", "iops-read-max", "needs iops-read"),
        (
            "bps-read = 100\nbps-read-max = 99",
            "bps-read-max",
            "below bps-read",
        ),
    ] {
        let e = refused(text);
        assert_eq!(e.key, key, "{text}: {e}");
        assert!(e.message.contains(words), "{text}: {e}");
    }
}

#[test]
fn qemu_accepts_what_it_accepts() {
    // 0 is "no limit", so a total of 0 does not conflict with a read limit.
    let l = limits("iops-total = 0\niops-read = 100").unwrap();
    assert_eq!(l.bucket(BucketKind::IopsRead).avg, 100);
    assert!(!limits("").unwrap().is_enabled());
    assert!(!limits("iops-total = 0").unwrap().is_enabled());
    // max-length 1 is the default, so it needs no max (QEMU checks > 1).
    assert!(limits("iops-total = 100\niops-total-max-length = 1").is_ok());
    // Read and write limits together, of both units.
    let l = limits(
        "bps-read = 1000\nbps-write = 2000\niops-read = 10\niops-write = 20\n\
         iops-read-max = 100\niops-read-max-length = 60\niops-size = 4096",
    )
    .unwrap();
    assert_eq!(
        l.bucket(BucketKind::IopsRead),
        BucketLimit {
            avg: 10,
            max: 100,
            max_length: 60
        }
    );
    assert_eq!(l.iops_size(), 4096);
    // The largest values QEMU takes.
    assert!(limits("bps-total = 1000000000000000\nbps-total-max = 1000000000000000").is_ok());
    assert!(
        limits("iops-total = 1\niops-total-max = 1000000000000000\niops-total-max-length = 1")
            .is_ok()
    );
    // The keys round-trip.
    let text = "bps-total = 1000\niops-write = 5\niops-write-max = 50\n\
                iops-write-max-length = 3\niops-size = 512";
    let l = limits(text).unwrap();
    assert_eq!(l.to_config().validate().unwrap(), l);
    assert_eq!(
        l.to_string(),
        "bps-total=1000,iops-write=5,iops-write-max=50,iops-write-max-length=3,iops-size=512"
    );
    assert!(toml::from_str::<ThrottleConfig>("iops-totl = 1")
        .unwrap_err()
        .to_string()
        .contains("iops-totl"));
}

/// Asks as soon as allowed from `start` until `end`, with requests from
/// `next`; returns the requests admitted and the bytes.
fn drive(
    t: &mut ThrottleState,
    start: u64,
    end: u64,
    mut next: impl FnMut() -> (Direction, u64),
) -> (u64, u64) {
    let (mut n, mut bytes, mut now) = (0, 0, start);
    let mut req = next();
    while now < end {
        match t.admit(req.0, req.1, now) {
            Admission::Go => {
                n += 1;
                bytes += req.1;
                req = next();
            }
            Admission::WaitUntil(at) => {
                assert!(at > now, "a wait is in the future");
                now = at;
            }
        }
    }
    (n, bytes)
}

#[test]
fn without_max_a_tenth_of_a_second_goes_at_once() {
    let mut t = ThrottleState::new(limits("iops-total = 100").unwrap());
    // Level 0..=10 admits (size avg/10 = 10), and the 11th request fills past it.
    for _ in 0..11 {
        assert_eq!(t.admit(Direction::Read, 4096, 0), Admission::Go);
    }
    // Level 11, size 10: one op over, 10 ms at 100/s.
    assert_eq!(
        t.admit(Direction::Write, 4096, 0),
        Admission::WaitUntil(10 * MS)
    );
    assert_eq!(t.admit(Direction::Write, 4096, 10 * MS), Admission::Go);
    // Then one every 10 ms: at k * 10 ms the level is back to 10 after k + 11
    // requests. The last before 10 s is k = 999.
    let (n, _) = drive(&mut t, 10 * MS, 10 * SEC, || (Direction::Read, 512));
    assert_eq!(n + 12, 999 + 11);
}

#[test]
fn a_burst_runs_at_max_for_max_length_then_falls_to_avg() {
    let mut t = ThrottleState::new(
        limits("iops-total = 100\niops-total-max = 1000\niops-total-max-length = 2").unwrap(),
    );
    // First second: the burst bucket (max/10 = 100 ops, leaking at 1000/s)
    // paces the burst at max: 101 at once, then 1000/s.
    let (first, _) = drive(&mut t, 0, SEC, || (Direction::Read, 4096));
    assert!((1100..=1101).contains(&first), "{first}");
    // The main bucket (2000 ops, leaking at 100/s) fills at 900/s: about 2.2 s
    // of burst, then 100/s. Total over 10 s: 100/s * 10 s + 2000 (+1).
    let (rest, _) = drive(&mut t, SEC, 10 * SEC, || (Direction::Read, 4096));
    assert!((3000..=3001).contains(&(first + rest)), "{}", first + rest);
}

#[test]
fn iops_size_counts_large_requests_as_several() {
    let mut t = ThrottleState::new(limits("iops-total = 100\niops-size = 4096").unwrap());
    // 64 KiB = 16 ops: level 0 -> 16 -> 32 (the first goes at level 0 <= 10).
    assert_eq!(t.admit(Direction::Read, 65536, 0), Admission::Go);
    // Level 16 > 10: 6 ops over = 60 ms.
    assert_eq!(
        t.admit(Direction::Read, 512, 0),
        Admission::WaitUntil(60 * MS)
    );
    // Small requests count one each, not a fraction: at k * 10 ms the level
    // allows k + 11 ops in all, 16 of them the first request's.
    let (n, _) = drive(&mut t, 60 * MS, 10 * SEC, || (Direction::Read, 512));
    assert_eq!(n, 999 + 11 - 16);
}

#[test]
fn reads_and_writes_have_their_own_buckets() {
    let mut t = ThrottleState::new(limits("iops-read = 10\nbps-write = 1000000").unwrap());
    let mut w = 0;
    for _ in 0..100 {
        if t.admit(Direction::Write, 1, 0) == Admission::Go {
            w += 1;
        }
    }
    assert_eq!(w, 100, "writes of 1 byte are far below 1 MB/s");
    for _ in 0..2 {
        assert_eq!(t.admit(Direction::Read, 1 << 20, 0), Admission::Go);
    }
    assert!(matches!(
        t.admit(Direction::Read, 1, 0),
        Admission::WaitUntil(_)
    ));
    // A 1 MiB write fills the write bucket (size 100 KB) for about a second.
    assert_eq!(t.admit(Direction::Write, 1 << 20, 0), Admission::Go);
    let Admission::WaitUntil(at) = t.admit(Direction::Write, 1, 0) else {
        panic!("the write bucket is full");
    };
    assert_eq!(at, (100 + (1 << 20) - 100_000) * 1000);
}

#[test]
fn bandwidth_over_ten_seconds() {
    let mut t = ThrottleState::new(limits("bps-total = 10000000").unwrap());
    let mut k = 0u64;
    let (_, bytes) = drive(&mut t, 0, 10 * SEC, || {
        k += 1;
        let dir = if k.is_multiple_of(3) {
            Direction::Write
        } else {
            Direction::Read
        };
        (dir, 512 << (k % 8))
    });
    // 10 MB/s for 10 s, plus the 1 MB bucket, plus at most one request.
    let limit = 10_000_000 * 10 + 1_000_000;
    assert!(
        bytes <= limit + (512 << 7) && bytes >= limit - (512 << 7),
        "{bytes}"
    );
}

#[test]
fn idle_time_is_not_banked() {
    let mut t = ThrottleState::new(limits("iops-write = 1000").unwrap());
    let (n, _) = drive(&mut t, 0, SEC, || (Direction::Write, 4096));
    assert_eq!(n, 999 + 101);
    // An hour idle, then a flood: only the bucket's size goes at once.
    let start = 3600 * SEC;
    let mut at_once = 0;
    while t.admit(Direction::Write, 4096, start) == Admission::Go {
        at_once += 1;
    }
    assert_eq!(at_once, 101);
}

/// QEMU's algorithm as levels (units in the bucket) that leak, written from
/// docs/throttle.txt: the reference the credit-time form must agree with.
struct LevelModel {
    limits: ThrottleLimits,
    level: [f64; 6],
    burst_level: [f64; 6],
    last: u64,
}

impl LevelModel {
    fn new(limits: ThrottleLimits) -> Self {
        LevelModel {
            limits,
            level: [0.0; 6],
            burst_level: [0.0; 6],
            last: 0,
        }
    }

    /// `Go`, or the wait in ns (not truncated).
    fn admit(&mut self, dir: Direction, bytes: u64, now: u64) -> Result<(), f64> {
        let dt = now.saturating_sub(self.last) as f64 / 1e9;
        self.last = self.last.max(now);
        let mut wait: f64 = 0.0;
        for (i, kind) in BucketKind::ALL.iter().enumerate() {
            let b = self.limits.bucket(*kind);
            self.level[i] = (self.level[i] - b.avg as f64 * dt).max(0.0);
            self.burst_level[i] = (self.burst_level[i] - b.max as f64 * dt).max(0.0);
            if b.avg == 0 || !kind.applies_to(dir) {
                continue;
            }
            let size = if b.max == 0 {
                b.avg as f64 / 10.0
            } else {
                (b.max * b.max_length) as f64
            };
            wait = wait.max((self.level[i] - size) / b.avg as f64 * 1e9);
            if b.max_length > 1 {
                let extra = self.burst_level[i] - b.max as f64 / 10.0;
                wait = wait.max(extra / b.max as f64 * 1e9);
            }
        }
        if wait >= 1.0 {
            return Err(wait);
        }
        let size = self.limits.iops_size();
        let ops = if size != 0 && bytes > size {
            bytes as f64 / size as f64
        } else {
            1.0
        };
        for (i, kind) in BucketKind::ALL.iter().enumerate() {
            if kind.applies_to(dir) {
                let units = if kind.counts_bytes() {
                    bytes as f64
                } else {
                    ops
                };
                self.level[i] += units;
                self.burst_level[i] += units;
            }
        }
        Ok(())
    }
}

/// A small deterministic generator (no dependency for tests).
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

/// The credit-time buckets decide as QEMU's levels do, request by request,
/// including at the very times they said to come back; the shared form
/// decides as the single-owner one.
#[test]
fn credit_time_agrees_with_qemu_levels() {
    for (seed, text) in [
        (1, "iops-total = 1000"),
        (2, "bps-read = 1000000\niops-write = 500\niops-write-max = 2000\niops-write-max-length = 3"),
        (3, "bps-total = 4000000\nbps-total-max = 8000000\nbps-total-max-length = 2\niops-total = 250\niops-size = 4096"),
        (4, "iops-read = 100\niops-read-max = 400\nbps-write = 2000000\nbps-write-max = 4000000\nbps-write-max-length = 10"),
    ] {
        let l = limits(text).unwrap();
        let mut single = ThrottleState::new(l);
        let shared = SharedThrottle::new(l);
        let mut model = LevelModel::new(l);
        let mut rng = Lcg(seed);
        let mut now = 0u64;
        let (mut go, mut waits) = (0, 0);
        let mut req = (Direction::Read, 4096);
        for _ in 0..20_000 {
            let a = single.admit(req.0, req.1, now);
            assert_eq!(a, shared.admit(req.0, req.1, now), "{text} at {now}");
            let m = model.admit(req.0, req.1, now);
            match (a, m) {
                (Admission::Go, Ok(())) => {}
                (Admission::WaitUntil(at), Err(w)) => {
                    assert!(
                        ((at - now) as f64 - w).abs() <= 2.0,
                        "{text} at {now}: {at} vs {w}"
                    );
                }
                _ => panic!("{text} at {now}: {a:?} vs {m:?}"),
            }
            match a {
                Admission::Go => {
                    go += 1;
                    let dir = if rng.next().is_multiple_of(2) {
                        Direction::Read
                    } else {
                        Direction::Write
                    };
                    req = (dir, 512 << (rng.next() % 8));
                    // Mostly at once, sometimes after a pause.
                    if rng.next().is_multiple_of(32) {
                        now += rng.next() % (20 * MS);
                    }
                }
                Admission::WaitUntil(at) => {
                    waits += 1;
                    now = at;
                }
            }
        }
        assert!(go > 1000 && waits > 1000, "{text}: {go} go, {waits} waits");
    }
}

/// Several threads admit through one shared throttle on a common clock: the
/// units admitted never pass `avg * t + size + N * c_max` (group.rs), and
/// the throttle keeps the binding limit busy.
#[test]
fn shared_group_never_exceeds_the_bound() {
    const THREADS: u64 = 4;
    const LARGEST: u64 = 64 << 10;
    let l = limits("iops-total = 20000\nbps-total = 40000000").unwrap();
    let group = ThrottleGroup::new("tenant-a", l);
    let clock = AtomicU64::new(0);
    let end = 2 * SEC;
    let admitted: Vec<(u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let (group, clock) = (&group, &clock);
                s.spawn(move || {
                    let mut rng = Lcg(i + 7);
                    let (mut ops, mut bytes) = (0, 0);
                    let mut size = 512 << (rng.next() % 8);
                    loop {
                        let now = clock.fetch_add(200, Ordering::Relaxed);
                        if now >= end {
                            return (ops, bytes);
                        }
                        let dir = if rng.next().is_multiple_of(3) {
                            Direction::Write
                        } else {
                            Direction::Read
                        };
                        if group.throttle.admit(dir, size, now) == Admission::Go {
                            ops += 1;
                            bytes += size;
                            size = 512 << (rng.next() % 8);
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ops: u64 = admitted.iter().map(|a| a.0).sum();
    let bytes: u64 = admitted.iter().map(|a| a.1).sum();
    let secs = clock.load(Ordering::Relaxed).min(end) as f64 / 1e9;
    let ops_bound = l.allowance(BucketKind::IopsTotal, secs) + THREADS as f64;
    let bytes_bound = l.allowance(BucketKind::BpsTotal, secs) + (THREADS * LARGEST) as f64;
    assert!(ops as f64 <= ops_bound, "{ops} ops > {ops_bound}");
    assert!(bytes as f64 <= bytes_bound, "{bytes} bytes > {bytes_bound}");
    // The average request is ~16 KiB: bytes bind (40 MB/s is ~2400 req/s).
    let used = bytes as f64 / (40e6 * secs);
    assert!(used >= 0.97, "only {used:.3} of the byte rate used");
}

#[test]
fn ticks_keep_sub_nanosecond_costs() {
    // 512 bytes at 10 GB/s cost 51.2 ns; rounded to whole ns the rate would
    // be 0.4% high. In sixteenths of a ns the error is 0.2 / 819.2 = 0.025%.
    let mut t = ThrottleState::new(limits("bps-total = 10000000000").unwrap());
    let (n, _) = drive(&mut t, 0, SEC, || (Direction::Read, 512));
    let expected = (10_000_000_000u64 + 1_000_000_000) / 512;
    let error = n.abs_diff(expected) as f64 / expected as f64;
    assert!(error <= 0.0003, "{n} vs {expected}: {error}");
    assert_eq!(TICKS_PER_NS, 16);
}

/// A held queue's wake-up: the batch's time, never before the head's own
/// nor more than the batch delay after it.
#[test]
fn batch_until_waits_for_the_batch_within_the_bound() {
    use super::throttle::{batch_until, BATCH_DELAY_NS};
    let alone = 7 * SEC;
    assert_eq!(batch_until(alone, None), alone, "nothing more to wait for");
    assert_eq!(batch_until(alone, Some(alone - MS)), alone);
    assert_eq!(batch_until(alone, Some(alone + 3 * MS)), alone + 3 * MS);
    assert_eq!(
        batch_until(alone, Some(alone + SEC)),
        alone + BATCH_DELAY_NS,
        "bounded"
    );
    assert_eq!(batch_until(u64::MAX - 1, Some(u64::MAX)), u64::MAX);
}

/// Limits whose buckets were filled at `start` by asking as soon as allowed
/// with requests of `bytes` until one was held back.
fn filled(text: &str, dir: Direction, bytes: u64, start: u64) -> SharedThrottle {
    let t = SharedThrottle::new(limits(text).unwrap());
    while t.admit(dir, bytes, start) == Admission::Go {}
    t
}

/// How many requests of `bytes` go in a row at `now`.
fn in_a_row(t: &SharedThrottle, dir: Direction, bytes: u64, now: u64) -> usize {
    (0..1000)
        .take_while(|_| t.admit(dir, bytes, now) == Admission::Go)
        .count()
}

/// `check_batch(n)` is the first time the buckets let `n` requests go in a
/// row, or as many as they ever let go at once when they hold fewer: with
/// an average rate alone, with a burst rate (its own bucket), in bytes with
/// requests too large for `n` to fit, and with two buckets on a direction.
#[test]
fn check_batch_is_when_n_requests_go_in_a_row() {
    let start = SEC;
    for (text, dir, bytes) in [
        ("iops-total = 1000", Direction::Read, 4096),
        (
            "iops-total = 200\niops-total-max = 1000\niops-total-max-length = 5",
            Direction::Read,
            4096,
        ),
        ("bps-total = 1000000", Direction::Write, 65536),
        (
            "iops-read = 500\nbps-total = 4000000\niops-size = 8192",
            Direction::Read,
            16384,
        ),
    ] {
        // As many as go at once once the buckets have drained.
        let most = in_a_row(
            &filled(text, dir, bytes, start),
            dir,
            bytes,
            start + 100 * SEC,
        );
        assert!(most >= 1, "{text}");
        for n in 1..=16usize {
            let t = filled(text, dir, bytes, start);
            let alone = t.check(dir, start).expect("held back");
            let at = t
                .check_batch(dir, bytes, n, start)
                .expect("held back")
                .max(alone);
            if n == 1 {
                assert_eq!(at, alone, "{text}");
            }
            let want = n.min(most);
            let before = filled(text, dir, bytes, start);
            assert!(
                in_a_row(&before, dir, bytes, at - 1) < want,
                "{text}: {n} not due before {at}"
            );
            assert_eq!(in_a_row(&t, dir, bytes, at), want, "{text}: n = {n}");
        }
    }
}
