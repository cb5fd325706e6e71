//! I/O limits with QEMU's names and semantics: the keys ([`ThrottleConfig`]),
//! their validation ([`ThrottleLimits`]) and the leaky buckets that admit or
//! hold back a request ([`ThrottleState`], and [`super::SharedThrottle`] for
//! queues on several IOThreads).
//!
//! # The algorithm (QEMU's `util/throttle.c`, docs/throttle.txt)
//!
//! Each limit is a leaky bucket. Its level rises by the cost of every request
//! admitted (bytes for a `bps-*` bucket; one operation for an `iops-*` bucket,
//! or `bytes / iops-size` operations for a request larger than `iops-size`)
//! and leaks at the average rate (`iops-total`, `bps-read`, ...). A request may
//! go while the level is at most the bucket's size: `max * max-length` when a
//! burst rate (`-max`) is set, otherwise a tenth of a second at the average rate
//! (QEMU's allowance for short bursts, so that not every other request waits).
//! It is then accounted in full, so a level may pass the size by one request.
//! When `max-length` is above one second a second bucket, of size `max / 10`
//! leaking at `max`, keeps the burst itself at the `max` rate. A request waits
//! until every bucket of its direction (the total ones and the read or the
//! write ones) would let it go.
//!
//! # Credit time instead of levels
//!
//! A bucket is kept as one number, the time at which it would be empty (the
//! "theoretical arrival time" of the generic cell-rate algorithm): its level at
//! `now` is `max(0, empty_at - now) * avg`. Leaking is then free (time passes),
//! accounting a cost `c` is `empty_at = max(empty_at, now) + c / avg`, and the
//! admission test `level <= size` is `empty_at - now <= size / avg`. This is
//! QEMU's bucket exactly, written so that one bucket is one `u64` that an atomic
//! read-modify-write can update ([`super::group`]). Times are kept in
//! sixteenths of a nanosecond ([`TICKS_PER_NS`]) so that the cost of a small
//! request at a high byte rate (512 bytes at 10 GB/s: 51.2 ns) is not rounded
//! away; a cost is rounded to the nearest tick, which bounds the drift of the
//! long-run rate to 1/32 ns per request.
//!
//! Nothing here reads a clock: the caller passes `now` in ns (a monotonic clock)
//! and, on [`Admission::WaitUntil`], arms a timer and asks again for the same
//! request, the head of its queue, so that requests of one queue keep their order.

use std::cell::Cell;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Largest rate or burst a limit accepts (QEMU's `THROTTLE_VALUE_MAX`, 10^15).
pub const THROTTLE_VALUE_MAX: u64 = 1_000_000_000_000_000;
/// Largest `-max-length` (QEMU stores it in an unsigned int).
pub const MAX_LENGTH_MAX: u64 = u32::MAX as u64;
/// Resolution of credit time: ticks per nanosecond.
pub const TICKS_PER_NS: u64 = 16;
const TICKS_PER_SEC: f64 = 1e9 * TICKS_PER_NS as f64;
/// The burst allowance without `-max`, and the size of the burst-rate bucket,
/// in seconds at the bucket's rate (QEMU: a tenth of the rate).
const SHORT_BURST_SEC: f64 = 0.1;

/// Direction of a request, which decides the buckets it is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A read: the total and the read buckets.
    Read,
    /// A write (also discard and write-zeroes, as QEMU's throttle node counts
    /// them): the total and the write buckets.
    Write,
}

/// What a throttle answers for the head request of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The request may go; it has been accounted.
    Go,
    /// Nothing was accounted; ask again at this time (ns, the caller's clock).
    WaitUntil(u64),
}

/// The six limits, in QEMU's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketKind {
    /// `bps-total`: bytes per second, reads and writes.
    BpsTotal,
    /// `bps-read`: bytes per second read.
    BpsRead,
    /// `bps-write`: bytes per second written.
    BpsWrite,
    /// `iops-total`: operations per second, reads and writes.
    IopsTotal,
    /// `iops-read`: read operations per second.
    IopsRead,
    /// `iops-write`: write operations per second.
    IopsWrite,
}

impl BucketKind {
    /// Every kind, in QEMU's order (the order of validation).
    pub const ALL: [BucketKind; 6] = [
        BucketKind::BpsTotal,
        BucketKind::BpsRead,
        BucketKind::BpsWrite,
        BucketKind::IopsTotal,
        BucketKind::IopsRead,
        BucketKind::IopsWrite,
    ];

    /// The key of the average rate; `-max` and `-max-length` follow it.
    pub fn key(self) -> &'static str {
        match self {
            BucketKind::BpsTotal => "bps-total",
            BucketKind::BpsRead => "bps-read",
            BucketKind::BpsWrite => "bps-write",
            BucketKind::IopsTotal => "iops-total",
            BucketKind::IopsRead => "iops-read",
            BucketKind::IopsWrite => "iops-write",
        }
    }

    /// Whether the bucket counts bytes (otherwise operations).
    pub fn counts_bytes(self) -> bool {
        matches!(
            self,
            BucketKind::BpsTotal | BucketKind::BpsRead | BucketKind::BpsWrite
        )
    }

    /// Whether a request in direction `dir` is checked against this bucket.
    pub fn applies_to(self, dir: Direction) -> bool {
        match self {
            BucketKind::BpsTotal | BucketKind::IopsTotal => true,
            BucketKind::BpsRead | BucketKind::IopsRead => dir == Direction::Read,
            BucketKind::BpsWrite | BucketKind::IopsWrite => dir == Direction::Write,
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The total kind of the same unit, for a read or write kind.
    fn total(self) -> Option<BucketKind> {
        match self {
            BucketKind::BpsRead | BucketKind::BpsWrite => Some(BucketKind::BpsTotal),
            BucketKind::IopsRead | BucketKind::IopsWrite => Some(BucketKind::IopsTotal),
            _ => None,
        }
    }
}

/// The most requests a queue held back by its limits waits to release
/// together ([`batch_until`]). Each wake-up of a held queue's IOThread costs
/// about as much as serving several requests; shared by 16 it is a small
/// part of each one's cost (a driver at depth 16 whose requests complete
/// together wakes its server as rarely), and a larger batch saves little
/// more while the delay it adds grows with it.
pub const BATCH_REQUESTS: usize = 16;

/// The most a held queue's head waits, beyond when the limits would let it
/// go alone, for requests behind it to go with it ([`batch_until`]): 15 ms.
///
/// - The limits keep their rate: every request is charged in full, and a
///   batch never waits for a bucket past the time it admits as many as it
///   ever does at once (`Plan::check_batch`: it is not empty then), so
///   none of its leak goes unused while requests wait. Releases lag the
///   one-by-one release by at most this bound, so a window of one second
///   sees at most `rate * 15 ms` fewer or more requests than one-by-one
///   release would show it: 1.5% of a second at the limit, against the 3% a
///   limit is measured with. Where the rate falls within a second (a burst
///   ending) those requests are a larger part of what the second holds: up
///   to 5% of the second in which a 1000 IOPS burst falls to 200, the
///   margin QEMU's seconds are compared with.
/// - It is the time 16 requests take at 1000 IOPS: at that rate and above,
///   a queue with [`BATCH_REQUESTS`] waiting wakes once for all of them.
///   Slower limits batch fewer (two at 100 IOPS, none below 67 IOPS), where
///   the wake-ups a second are few anyway.
/// - The delay falls only on requests that already wait for the limit, of
///   a queue with others outstanding (a queue at depth one never waits for
///   it), and a driver that keeps its depth at a limit sees the same mean
///   latency, its depth over the rate, however the releases are grouped
///   (Little's law).
pub const BATCH_DELAY_NS: u64 = 15_000_000;

/// When a queue whose head the limits hold back until `alone` (ns) asks
/// again, given when they would admit the batch it waits to send together
/// (`together`, from `Plan::check_batch` for `min(waiting,
/// BATCH_REQUESTS)` requests like its head; None: now): the batch's time,
/// but never more than [`BATCH_DELAY_NS`] after `alone` (nor before it).
pub fn batch_until(alone: u64, together: Option<u64>) -> u64 {
    together.map_or(alone, |t| {
        t.clamp(alone, alone.saturating_add(BATCH_DELAY_NS))
    })
}

/// The limits as written in `[export.throttle]` or `[[throttle-group]]`, under
/// QEMU's names (`throttling.iops-total`, `limits.iops-total` of a
/// `throttle-group` object). A value of 0 means "no limit", as in QEMU (and as
/// libvirt writes an unset `<iotune>` element).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ThrottleConfig {
    /// `bps-total`: average rate, bytes per second (bytes read and written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_total: Option<u64>,
    /// `bps-total-max`: burst rate, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_total_max: Option<u64>,
    /// `bps-total-max-length`: seconds the burst rate may last (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_total_max_length: Option<u64>,
    /// `bps-read`: average rate, bytes per second (bytes read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_read: Option<u64>,
    /// `bps-read-max`: burst rate, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_read_max: Option<u64>,
    /// `bps-read-max-length`: seconds the burst rate may last (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_read_max_length: Option<u64>,
    /// `bps-write`: average rate, bytes per second (bytes written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_write: Option<u64>,
    /// `bps-write-max`: burst rate, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_write_max: Option<u64>,
    /// `bps-write-max-length`: seconds the burst rate may last (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bps_write_max_length: Option<u64>,
    /// `iops-total`: average rate, operations per second (read and write operations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_total: Option<u64>,
    /// `iops-total-max`: burst rate, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_total_max: Option<u64>,
    /// `iops-total-max-length`: seconds the burst rate may last (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_total_max_length: Option<u64>,
    /// `iops-read`: average rate, operations per second (read operations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_read: Option<u64>,
    /// `iops-read-max`: burst rate, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_read_max: Option<u64>,
    /// `iops-read-max-length`: seconds the burst rate may last (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_read_max_length: Option<u64>,
    /// `iops-write`: average rate, operations per second (write operations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_write: Option<u64>,
    /// `iops-write-max`: burst rate, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_write_max: Option<u64>,
    /// `iops-write-max-length`: seconds the burst rate may last (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_write_max_length: Option<u64>,
    /// A request larger than this many bytes counts as `bytes / iops-size`
    /// operations in the `iops-*` buckets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_size: Option<u64>,
}

impl ThrottleConfig {
    /// The three keys of `kind`, to read or set.
    fn slots(&mut self, kind: BucketKind) -> [&mut Option<u64>; 3] {
        match kind {
            BucketKind::BpsTotal => [
                &mut self.bps_total,
                &mut self.bps_total_max,
                &mut self.bps_total_max_length,
            ],
            BucketKind::BpsRead => [
                &mut self.bps_read,
                &mut self.bps_read_max,
                &mut self.bps_read_max_length,
            ],
            BucketKind::BpsWrite => [
                &mut self.bps_write,
                &mut self.bps_write_max,
                &mut self.bps_write_max_length,
            ],
            BucketKind::IopsTotal => [
                &mut self.iops_total,
                &mut self.iops_total_max,
                &mut self.iops_total_max_length,
            ],
            BucketKind::IopsRead => [
                &mut self.iops_read,
                &mut self.iops_read_max,
                &mut self.iops_read_max_length,
            ],
            BucketKind::IopsWrite => [
                &mut self.iops_write,
                &mut self.iops_write_max,
                &mut self.iops_write_max_length,
            ],
        }
    }

    /// Checks the keys with QEMU's rules (`throttle_is_valid`, in its order) and
    /// resolves them; an error names the key as the user wrote it.
    pub fn validate(&self) -> Result<ThrottleLimits, LimitError> {
        let mut buckets = [BucketLimit::default(); 6];
        let mut keys = self.clone();
        for kind in BucketKind::ALL {
            let [avg, max, len] = keys.slots(kind);
            buckets[kind.index()] = BucketLimit {
                avg: avg.unwrap_or(0),
                max: max.unwrap_or(0),
                max_length: len.unwrap_or(1),
            };
        }
        let b = |k: BucketKind| buckets[k.index()];
        // A total limit and a read or write limit of the same unit exclude each other.
        for kind in [
            BucketKind::BpsRead,
            BucketKind::BpsWrite,
            BucketKind::IopsRead,
            BucketKind::IopsWrite,
        ] {
            let total = kind.total().expect("a read or write kind");
            for (suffix, mine, theirs) in [
                ("", b(kind).avg, b(total).avg),
                ("-max", b(kind).max, b(total).max),
            ] {
                if mine != 0 && theirs != 0 {
                    return Err(LimitError::new(
                        format!("{}{suffix}", kind.key()),
                        format!(
                            "cannot be combined with {}{suffix}: a total limit excludes the \
                             read and write limits of the same unit",
                            total.key()
                        ),
                    ));
                }
            }
        }
        let iops_size = self.iops_size.unwrap_or(0);
        if iops_size != 0
            && [
                BucketKind::IopsTotal,
                BucketKind::IopsRead,
                BucketKind::IopsWrite,
            ]
            .iter()
            .all(|&k| b(k).avg == 0)
        {
            return Err(LimitError::new(
                "iops-size",
                "needs an iops limit (iops-total, iops-read or iops-write)",
            ));
        }
        for kind in BucketKind::ALL {
            let BucketLimit {
                avg,
                max,
                max_length: len,
            } = b(kind);
            let key = kind.key();
            for (suffix, v) in [("", avg), ("-max", max)] {
                if v > THROTTLE_VALUE_MAX {
                    return Err(LimitError::new(
                        format!("{key}{suffix}"),
                        format!("{v} is out of range (0..={THROTTLE_VALUE_MAX}; 0 = no limit)"),
                    ));
                }
            }
            let len_key = format!("{key}-max-length");
            if len == 0 || len > MAX_LENGTH_MAX {
                return Err(LimitError::new(
                    len_key,
                    format!("{len} is out of range (1..={MAX_LENGTH_MAX} seconds)"),
                ));
            }
            if len > 1 && max == 0 {
                return Err(LimitError::new(
                    len_key,
                    format!("needs {key}-max (the burst rate it lasts for)"),
                ));
            }
            if max != 0 && len > THROTTLE_VALUE_MAX / max {
                return Err(LimitError::new(
                    len_key,
                    format!(
                        "{len} s at {key}-max = {max} is a burst of more than \
                         {THROTTLE_VALUE_MAX}"
                    ),
                ));
            }
            if max != 0 && avg == 0 {
                return Err(LimitError::new(
                    format!("{key}-max"),
                    format!("needs {key} (the average rate the burst returns to)"),
                ));
            }
            if max != 0 && max < avg {
                return Err(LimitError::new(
                    format!("{key}-max"),
                    format!("{max} is below {key} = {avg} (a burst rate is at least the average)"),
                ));
            }
        }
        Ok(ThrottleLimits { buckets, iops_size })
    }
}

/// An invalid limit: the key as written (`iops-total-max`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct LimitError {
    /// The offending key, kebab-case as in the TOML.
    pub key: String,
    /// What is wrong and what would be valid.
    pub message: String,
}

impl LimitError {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        LimitError {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// One validated bucket: average rate, burst rate and burst length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLimit {
    /// Units (bytes or operations) per second; 0 = no limit.
    pub avg: u64,
    /// Burst rate, units per second; 0 = no burst beyond a tenth of a second.
    pub max: u64,
    /// Seconds the burst rate may last (at least 1).
    pub max_length: u64,
}

impl Default for BucketLimit {
    fn default() -> Self {
        BucketLimit {
            avg: 0,
            max: 0,
            max_length: 1,
        }
    }
}

/// Validated limits ([`ThrottleConfig::validate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThrottleLimits {
    buckets: [BucketLimit; 6],
    iops_size: u64,
}

impl ThrottleLimits {
    /// Whether any limit is set: with none, the data path skips the throttle.
    pub fn is_enabled(&self) -> bool {
        self.buckets.iter().any(|b| b.avg != 0)
    }

    /// The bucket of `kind`.
    pub fn bucket(&self, kind: BucketKind) -> BucketLimit {
        self.buckets[kind.index()]
    }

    /// `iops-size` in bytes (0 = every request is one operation).
    pub fn iops_size(&self) -> u64 {
        self.iops_size
    }

    /// The limits back as keys (unset where QEMU's default applies), for
    /// queries and for `query-exports`.
    pub fn to_config(&self) -> ThrottleConfig {
        let mut c = ThrottleConfig::default();
        let nz = |v: u64| (v != 0).then_some(v);
        for kind in BucketKind::ALL {
            let b = self.bucket(kind);
            let keys = (
                nz(b.avg),
                nz(b.max),
                (b.max_length != 1).then_some(b.max_length),
            );
            let [avg, max, len] = c.slots(kind);
            (*avg, *max, *len) = keys;
        }
        c.iops_size = nz(self.iops_size);
        c
    }

    /// The most operations per second these limits let through in the long
    /// run, if they cap both reads and writes.
    pub fn iops_cap(&self) -> Option<u64> {
        use BucketKind::{IopsRead, IopsTotal, IopsWrite};
        let avg = |k| self.bucket(k).avg;
        match (avg(IopsTotal), avg(IopsRead), avg(IopsWrite)) {
            (0, 0, _) | (0, _, 0) => None,
            (0, r, w) => Some(r + w),
            (t, _, _) => Some(t),
        }
    }

    /// The most a bucket of `kind` lets through in `secs` seconds from empty,
    /// not counting the one request that may pass the bucket's size: the
    /// average rate for `secs` plus the bucket's size. 0 when unlimited.
    pub fn allowance(&self, kind: BucketKind, secs: f64) -> f64 {
        let b = self.bucket(kind);
        if b.avg == 0 {
            return 0.0;
        }
        b.avg as f64 * secs + bucket_size(b)
    }
}

/// A bucket's size in units: what may accumulate before requests wait.
fn bucket_size(b: BucketLimit) -> f64 {
    if b.max == 0 {
        b.avg as f64 * SHORT_BURST_SEC
    } else {
        b.max as f64 * b.max_length as f64
    }
}

impl fmt::Display for ThrottleLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for kind in BucketKind::ALL {
            let b = self.bucket(kind);
            if b.avg == 0 {
                continue;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{}={}", kind.key(), b.avg)?;
            if b.max != 0 {
                write!(f, ",{}-max={}", kind.key(), b.max)?;
            }
            if b.max_length != 1 {
                write!(f, ",{}-max-length={}", kind.key(), b.max_length)?;
            }
        }
        if self.iops_size != 0 {
            write!(f, ",iops-size={}", self.iops_size)?;
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

/// One active bucket, precomputed for the request path.
#[derive(Debug, Clone, Copy)]
struct BucketPlan {
    /// Index of its credit cell (0..6; its burst cell is 6 + this).
    cell: usize,
    counts_bytes: bool,
    /// Ticks of credit one unit costs at the average rate.
    ticks_per_unit: f64,
    /// How far ahead of now the bucket may be and still admit: its size at
    /// the average rate, in ticks.
    tolerance: u64,
    /// Ticks one unit costs at the burst rate, when `max-length > 1`.
    burst_ticks_per_unit: Option<f64>,
}

const BURST_TOLERANCE: u64 = (SHORT_BURST_SEC * TICKS_PER_SEC) as u64;

/// The buckets a request of each direction is checked against.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    read: Vec<BucketPlan>,
    write: Vec<BucketPlan>,
    iops_size: u64,
}

impl Plan {
    pub(crate) fn new(limits: &ThrottleLimits) -> Self {
        let for_dir = |dir| {
            BucketKind::ALL
                .iter()
                .filter(|k| k.applies_to(dir))
                .filter_map(|&kind| {
                    let b = limits.bucket(kind);
                    (b.avg != 0).then(|| BucketPlan {
                        cell: kind.index(),
                        counts_bytes: kind.counts_bytes(),
                        ticks_per_unit: TICKS_PER_SEC / b.avg as f64,
                        tolerance: (bucket_size(b) / b.avg as f64 * TICKS_PER_SEC) as u64,
                        burst_ticks_per_unit: (b.max_length > 1)
                            .then(|| TICKS_PER_SEC / b.max as f64),
                    })
                })
                .collect()
        };
        Plan {
            read: for_dir(Direction::Read),
            write: for_dir(Direction::Write),
            iops_size: limits.iops_size,
        }
    }

    /// Checks the buckets of `dir` at `now` and, if every one admits, charges
    /// the request to each: one read of each cell, then one read-modify-write
    /// of each (see the bound in [`super::group`]).
    pub(crate) fn admit<C: CreditCell>(
        &self,
        cells: &[C; CELLS],
        dir: Direction,
        bytes: u64,
        now_ns: u64,
    ) -> Admission {
        match self.check(cells, dir, now_ns) {
            Some(t) => Admission::WaitUntil(t),
            None => {
                self.charge(cells, dir, bytes, now_ns);
                Admission::Go
            }
        }
    }

    /// The buckets of `dir` `at` now: None if every one admits a request,
    /// otherwise when to ask again (ns). Reads only.
    #[inline]
    pub(crate) fn check<C: CreditCell>(
        &self,
        cells: &[C; CELLS],
        dir: Direction,
        now_ns: u64,
    ) -> Option<u64> {
        let now = now_ns.saturating_mul(TICKS_PER_NS);
        let mut over = 0u64;
        for b in self.buckets(dir) {
            let ahead = cells[b.cell].empty_at().saturating_sub(now);
            over = over.max(ahead.saturating_sub(b.tolerance));
            if b.burst_ticks_per_unit.is_some() {
                let ahead = cells[BURST + b.cell].empty_at().saturating_sub(now);
                over = over.max(ahead.saturating_sub(BURST_TOLERANCE));
            }
        }
        wait_until(now, over)
    }

    /// When the buckets of `dir` admit `n` requests of `bytes` in a row at
    /// `now_ns` (None: now), or, for a bucket too small for `n` of them,
    /// as many as it ever admits at once: it is not empty then, so none of
    /// its leak has gone unused. Reads only; [`batch_until`] bounds what a
    /// held queue makes of it.
    pub(crate) fn check_batch<C: CreditCell>(
        &self,
        cells: &[C; CELLS],
        dir: Direction,
        bytes: u64,
        n: usize,
        now_ns: u64,
    ) -> Option<u64> {
        let now = now_ns.saturating_mul(TICKS_PER_NS);
        let (size, ops) = self.units(bytes);
        let over = |cell: &C, per_unit: f64, tolerance: u64| {
            batch_over(cell.empty_at(), now, to_ticks(per_unit), tolerance, n)
        };
        let mut worst = 0u64;
        for b in self.buckets(dir) {
            let units = if b.counts_bytes { size } else { ops };
            worst = worst.max(over(&cells[b.cell], units * b.ticks_per_unit, b.tolerance));
            if let Some(t) = b.burst_ticks_per_unit {
                worst = worst.max(over(&cells[BURST + b.cell], units * t, BURST_TOLERANCE));
            }
        }
        wait_until(now, worst)
    }

    /// A request of `bytes` in units: bytes, and operations (`iops-size`).
    #[inline]
    fn units(&self, bytes: u64) -> (f64, f64) {
        // Through i64: one conversion instruction where u64 -> f64 takes a
        // dozen on x86-64; a request's size is far below 2^63.
        let size = bytes as i64 as f64;
        let ops = if self.iops_size != 0 && bytes > self.iops_size {
            size / self.iops_size as f64
        } else {
            1.0
        };
        (size, ops)
    }

    /// Charges a request of `bytes` to the buckets of `dir` (after
    /// [`Plan::check`] admitted it).
    #[inline]
    pub(crate) fn charge<C: CreditCell>(
        &self,
        cells: &[C; CELLS],
        dir: Direction,
        bytes: u64,
        now_ns: u64,
    ) {
        let now = now_ns.saturating_mul(TICKS_PER_NS);
        let (size, ops) = self.units(bytes);
        for b in self.buckets(dir) {
            let units = if b.counts_bytes { size } else { ops };
            cells[b.cell].charge(now, to_ticks(units * b.ticks_per_unit));
            if let Some(t) = b.burst_ticks_per_unit {
                cells[BURST + b.cell].charge(now, to_ticks(units * t));
            }
        }
    }

    fn buckets(&self, dir: Direction) -> &[BucketPlan] {
        match dir {
            Direction::Read => &self.read,
            Direction::Write => &self.write,
        }
    }
}

/// A cost in ticks, rounded to the nearest (costs are never negative; `as`
/// saturates a cost beyond `u64`). Adding a half and truncating avoids
/// `f64::round`, a library call on x86-64 without SSE4.1.
fn to_ticks(cost: f64) -> u64 {
    (cost + 0.5) as u64
}

/// Credit cells of a throttle: six buckets and their six burst-rate buckets.
pub(crate) const CELLS: usize = 12;
const BURST: usize = 6;

/// Where a bucket's "empty at" time lives: a `Cell` for one owner, an atomic
/// for a group shared by IOThreads. One algorithm serves both.
/// When to ask again (ns) for a cell `over` ticks too full at `now` (ticks);
/// None: it admits. A wait under a nanosecond is none (QEMU truncates waits
/// to whole ns).
#[inline]
/// How far (ticks) a bucket empty at `empty_at`, with `tolerance` and a
/// cost of `cost` a request, is from admitting `n` requests in a row at
/// `now`: room for the `n - 1` behind the first, as each is charged, or for
/// as many as fit in the tolerance. 0: it admits them now.
pub(crate) fn batch_over(empty_at: u64, now: u64, cost: u64, tolerance: u64, n: usize) -> u64 {
    let behind = n.saturating_sub(1) as u64;
    let room = match tolerance.checked_div(cost) {
        Some(fit) => behind.min(fit) * cost,
        None => 0,
    };
    (empty_at.saturating_sub(now) + room).saturating_sub(tolerance)
}

pub(crate) fn wait_until(now: u64, over: u64) -> Option<u64> {
    (over >= TICKS_PER_NS).then(|| (now + over).div_ceil(TICKS_PER_NS))
}

pub(crate) trait CreditCell {
    /// The time (ticks) at which the bucket is empty.
    fn empty_at(&self) -> u64;
    /// Adds `cost` ticks of credit from `max(empty_at, now)`.
    fn charge(&self, now: u64, cost: u64);
}

impl CreditCell for Cell<u64> {
    fn empty_at(&self) -> u64 {
        self.get()
    }
    fn charge(&self, now: u64, cost: u64) {
        self.set(self.get().max(now).saturating_add(cost));
    }
}

/// The leaky buckets of one owner (an export whose queues all live on one
/// IOThread, and the reference the shared form is tested against).
#[derive(Debug)]
pub struct ThrottleState {
    limits: ThrottleLimits,
    plan: Plan,
    cells: [Cell<u64>; CELLS],
}

impl ThrottleState {
    /// Empty buckets for `limits` (QEMU zeroes the levels on every new config).
    pub fn new(limits: ThrottleLimits) -> Self {
        ThrottleState {
            plan: Plan::new(&limits),
            limits,
            cells: Default::default(),
        }
    }

    /// The limits enforced.
    pub fn limits(&self) -> &ThrottleLimits {
        &self.limits
    }

    /// Admits (and accounts) a request of `bytes` in direction `dir` at
    /// `now_ns`, or says when to ask again. Ask for the head of a queue only.
    pub fn admit(&mut self, dir: Direction, bytes: u64, now_ns: u64) -> Admission {
        self.plan.admit(&self.cells, dir, bytes, now_ns)
    }
}
