//! Counters and gauges. Each is written by exactly one IOThread (the owner of
//! the queue or of the thread) with relaxed atomics, and read by anyone for
//! snapshots; no lock is taken on the data path.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

/// A monotonically increasing counter with a single writer.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        // Single writer: a load + store is enough and avoids a locked RMW.
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }
    /// Current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that is set, not added to (a measurement or a setting), with a
/// single writer; exported as a Prometheus gauge.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Replaces the value.
    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    /// Current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Why a request failed, as counted: a small fixed set, so that it can be a
/// Prometheus label. The request engine maps each of its errors to one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The device model refused the request (a malformed chain or header, an
    /// out-of-range sector, a write on a read-only export, ...).
    Malformed,
    /// An unknown request type or flags (virtio status UNSUPP).
    Unsupported,
    /// A buffer outside guest memory.
    GuestMemory,
    /// No bounce buffer (allocation failed, or beyond `bounce-buffer-max`, or
    /// the copy failed).
    BounceBuffer,
    /// The backend refused the submission.
    Submit,
    /// The operation failed on the image (after the backend's own recovery).
    Io,
}

impl ErrorKind {
    /// Every kind, in the order of [`QueueCounters::errors_by_kind`].
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::Malformed,
        ErrorKind::Unsupported,
        ErrorKind::GuestMemory,
        ErrorKind::BounceBuffer,
        ErrorKind::Submit,
        ErrorKind::Io,
    ];

    /// The label value (`kind="..."`) and the key in snapshots.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::Malformed => "malformed",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::GuestMemory => "guest_memory",
            ErrorKind::BounceBuffer => "bounce_buffer",
            ErrorKind::Submit => "submit",
            ErrorKind::Io => "io",
        }
    }
}

/// Upper bounds of the request latency histogram's buckets, ns: 1, 2, 5 per
/// decade from 1 us to 10 s (storage latencies, from a null backend's to a
/// stalled disk's); a last bucket (+Inf) takes the rest.
pub const LATENCY_BOUNDS_NS: [u64; 22] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    50_000_000,
    100_000_000,
    200_000_000,
    500_000_000,
    1_000_000_000,
    2_000_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Buckets of [`LatencyHistogram`]: one per bound, and +Inf.
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_NS.len() + 1;

/// A request latency histogram with one writer (the IOThread owning the
/// queue): fixed buckets, relaxed atomics, no lock and no allocation per
/// request. Readers sum histograms at scrape time.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Requests per bucket (not cumulative); the last one is +Inf.
    buckets: [Counter; LATENCY_BUCKETS],
    /// Sum of the observed latencies, ns.
    sum_ns: Counter,
}

impl LatencyHistogram {
    /// The bucket of a latency of `ns`: the first whose upper bound is at
    /// least `ns` (Prometheus `le`), or the last (+Inf).
    #[inline]
    pub fn bucket(ns: u64) -> usize {
        // A scan from the bottom, not a binary search: a device's latencies
        // cluster, so the scan's branches are predicted and the count's
        // address waits on no chain of compares and selects (the search's
        // took about a twentieth of a null request's time at QD16).
        LATENCY_BOUNDS_NS
            .iter()
            .position(|&b| ns <= b)
            .unwrap_or(LATENCY_BOUNDS_NS.len())
    }

    /// Counts one request that took `ns`.
    #[inline]
    pub fn observe(&self, ns: u64) {
        self.buckets[Self::bucket(ns)].add(1);
        self.sum_ns.add(ns);
    }

    /// The current counts.
    pub fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            buckets: self.buckets.iter().map(Counter::get).collect(),
            sum_ns: self.sum_ns.get(),
        }
    }
}

/// A latency histogram at one moment.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct LatencySnapshot {
    /// Requests per bucket, not cumulative: one entry per bound of
    /// [`LATENCY_BOUNDS_NS`], then +Inf (empty: nothing counted).
    pub buckets: Vec<u64>,
    /// Sum of the latencies, ns.
    pub sum_ns: u64,
}

impl LatencySnapshot {
    /// Requests counted.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &LatencySnapshot) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.sum_ns += other.sum_ns;
    }
}

/// Per-virtqueue counters, owned by the IOThread serving the queue.
#[derive(Debug, Default)]
pub struct QueueCounters {
    /// Requests completed (any status).
    pub requests: Counter,
    /// Reads completed.
    pub reads: Counter,
    /// Writes completed.
    pub writes: Counter,
    /// Flushes completed.
    pub flushes: Counter,
    /// Discard, write-zeroes and GET_ID requests completed.
    pub other: Counter,
    /// Requests completed with a status other than OK.
    pub errors: Counter,
    /// Bytes read by the guest.
    pub bytes_read: Counter,
    /// Bytes written by the guest.
    pub bytes_written: Counter,
    /// Requests popped from the ring (in flight: popped minus `requests`).
    pub popped: Counter,
    /// Requests held back by the export's I/O limits (docs/qos.md): popped,
    /// then kept until the throttle admitted them.
    pub throttled: Counter,
    /// Time requests spent held back by the I/O limits, ns (summed over the
    /// requests held).
    pub throttled_ns: Counter,
    /// Requests completed with an error, by [`ErrorKind`] (in the order of
    /// [`ErrorKind::ALL`]).
    pub errors_by_kind: [Counter; ErrorKind::ALL.len()],
    /// Time from pop to completion of every request completed.
    pub latency: LatencyHistogram,
}

impl QueueCounters {
    /// Counts a failed request of `kind` (the total `errors` is counted apart).
    #[inline]
    pub fn error(&self, kind: ErrorKind) {
        self.errors_by_kind[kind as usize].add(1);
    }
}

/// Counters of one IOThread.
#[derive(Debug, Default)]
pub struct IoThreadStats {
    /// Thread name (`vqblk-iot0`, ...).
    pub name: String,
    /// Kernel thread id, for CPU accounting.
    pub tid: AtomicU64,
    /// Requests completed by this thread.
    pub requests: Counter,
    /// Wake-ups caused by a guest kick.
    pub kick_wakeups: Counter,
    /// Wake-ups caused by backend completions.
    pub completion_wakeups: Counter,
    /// epoll returns that brought stale edges only (a kick or completion that
    /// polling already served); they do not end a sleep or a nap.
    pub stale_edges: Counter,
    /// Event-loop iterations.
    pub passes: Counter,
    /// Passes that found at least one queue with work (a kick, or polling).
    pub passes_ready: Counter,
    /// Passes that found two or more queues with work at once: how often
    /// the thread's queues wait on each other (the tuner's probe asks).
    pub passes_ready_together: Counter,
    /// Guest notifications (call fd writes) sent.
    pub notifications: Counter,
    /// Notification checks after which no call was sent: the guest did not ask
    /// for one (EVENT_IDX `used_event`, or VRING_AVAIL_F_NO_INTERRUPT).
    pub notifications_suppressed: Counter,
    /// Requests popped from the avail rings.
    pub popped: Counter,
    /// Used ring entries published (`add_used` calls, each stores the used index).
    pub used_publishes: Counter,
    /// Completion batches: delivery rounds that published at least one used entry.
    pub used_batches: Counter,
    /// Kick edges seen by epoll (stale ones included).
    pub kicks: Counter,
    /// Malformed or failed requests.
    pub errors: Counter,
    /// Rings found in an impossible state (stopped until the frontend sets them up again).
    pub broken_rings: Counter,
    /// Passes in which a queue used up its pop budget (more was left for the next pass).
    pub budget_exhausted: Counter,
    /// Current polling window in ns.
    pub poll_window_ns: Gauge,
    /// Passes that busy-polled.
    pub poll_attempts: Counter,
    /// Passes whose work was found by polling (no sleep).
    pub poll_hits: Counter,
    /// Hybrid-polling naps (timed sleeps before spinning).
    pub naps: Counter,
    /// How late a timed nap may end, ns, as measured by this thread.
    pub nap_late_ns: Gauge,
    /// Thread CPU time of one timed nap, ns, as measured.
    pub nap_cpu_ns: Gauge,
    /// Trials of sleeping until each event that gave a verdict (adaptive
    /// polling, rule 6).
    pub poll_trials: Counter,
    /// Of those, the ones in which sleeping was as fast (the thread then
    /// sleeps until the next trial).
    pub poll_trials_slept: Counter,
    /// Time spent busy-polling, ns.
    pub poll_ns: Counter,
    /// Time spent blocked in epoll_wait, ns.
    pub sleep_ns: Counter,
    queues: Mutex<Vec<(String, u16, Arc<QueueCounters>)>>,
}

impl IoThreadStats {
    /// New zeroed statistics for thread `name`.
    pub fn new(name: String) -> Self {
        IoThreadStats {
            name,
            ..Default::default()
        }
    }

    /// The counters of `export`'s queue `queue` as served by this thread
    /// (created on first use; kept across reconnections).
    pub fn queue(&self, export: &str, queue: u16) -> Arc<QueueCounters> {
        let mut q = self.queues.lock().unwrap();
        if let Some((_, _, c)) = q.iter().find(|(e, i, _)| e == export && *i == queue) {
            return c.clone();
        }
        let c = Arc::new(QueueCounters::default());
        q.push((export.to_string(), queue, c.clone()));
        c
    }

    /// A consistent-enough copy for reports.
    pub fn snapshot(&self) -> IoThreadSnapshot {
        let tid = self.tid.load(Ordering::Relaxed);
        let mut queues: Vec<QueueSnapshot> = self
            .queues
            .lock()
            .unwrap()
            .iter()
            .map(|(e, i, c)| {
                // Completed first, popped second: both only grow and a request
                // is popped before it completes, so in flight is never negative.
                let requests = c.requests.get();
                let popped = c.popped.get();
                QueueSnapshot {
                    export: e.clone(),
                    queue: *i,
                    requests,
                    reads: c.reads.get(),
                    writes: c.writes.get(),
                    flushes: c.flushes.get(),
                    other: c.other.get(),
                    errors: c.errors.get(),
                    bytes_read: c.bytes_read.get(),
                    bytes_written: c.bytes_written.get(),
                    popped,
                    in_flight: popped.saturating_sub(requests),
                    throttled: c.throttled.get(),
                    throttled_ns: c.throttled_ns.get(),
                    errors_by_kind: ErrorKind::ALL
                        .iter()
                        .map(|&k| (k.label().to_string(), c.errors_by_kind[k as usize].get()))
                        .collect(),
                    latency: c.latency.snapshot(),
                }
            })
            .collect();
        queues.sort_by(|a, b| (&a.export, a.queue).cmp(&(&b.export, b.queue)));
        IoThreadSnapshot {
            name: self.name.clone(),
            tid,
            cpu_seconds: thread_cpu_seconds(tid),
            requests: self.requests.get(),
            kick_wakeups: self.kick_wakeups.get(),
            completion_wakeups: self.completion_wakeups.get(),
            stale_edges: self.stale_edges.get(),
            passes: self.passes.get(),
            passes_ready: self.passes_ready.get(),
            passes_ready_together: self.passes_ready_together.get(),
            notifications: self.notifications.get(),
            notifications_suppressed: self.notifications_suppressed.get(),
            popped: self.popped.get(),
            used_publishes: self.used_publishes.get(),
            used_batches: self.used_batches.get(),
            kicks: self.kicks.get(),
            errors: self.errors.get(),
            broken_rings: self.broken_rings.get(),
            budget_exhausted: self.budget_exhausted.get(),
            poll_window_ns: self.poll_window_ns.get(),
            poll_attempts: self.poll_attempts.get(),
            poll_hits: self.poll_hits.get(),
            naps: self.naps.get(),
            nap_late_ns: self.nap_late_ns.get(),
            nap_cpu_ns: self.nap_cpu_ns.get(),
            poll_trials: self.poll_trials.get(),
            poll_trials_slept: self.poll_trials_slept.get(),
            poll_seconds: self.poll_ns.get() as f64 / 1e9,
            sleep_seconds: self.sleep_ns.get() as f64 / 1e9,
            queues,
        }
    }
}

/// CPU time (user + system) of a thread of this process, read from its
/// thread CPU clock (`clock_gettime`, ns resolution). No file is opened, so
/// the metrics thread can read it under its seccomp filter. 0 if the thread is
/// gone.
pub fn thread_cpu_seconds(tid: u64) -> f64 {
    if tid == 0 || tid > i32::MAX as u64 {
        return 0.0;
    }
    // The kernel's MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED): the clock of
    // thread `tid`, which any thread of the same process may read.
    let clock = ((!(tid as u32)) << 3) as libc::clockid_t | 6;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; an unknown clock id only
    // makes the call fail with EINVAL.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Counters of one queue at one moment.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct QueueSnapshot {
    /// Export name.
    pub export: String,
    /// Virtqueue index.
    pub queue: u16,
    /// Requests completed.
    pub requests: u64,
    /// Reads completed.
    pub reads: u64,
    /// Writes completed.
    pub writes: u64,
    /// Flushes completed.
    pub flushes: u64,
    /// Other requests completed.
    pub other: u64,
    /// Requests completed with an error status.
    pub errors: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Requests popped from the ring.
    #[serde(default)]
    pub popped: u64,
    /// Requests popped and not completed yet.
    #[serde(default)]
    pub in_flight: u64,
    /// Requests held back by the I/O limits.
    #[serde(default)]
    pub throttled: u64,
    /// Time requests spent held back by the I/O limits, ns.
    #[serde(default)]
    pub throttled_ns: u64,
    /// Requests completed with an error, by kind ([`ErrorKind::label`]).
    #[serde(default)]
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Latency from pop to completion.
    #[serde(default)]
    pub latency: LatencySnapshot,
}

/// Counters of one IOThread at one moment.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct IoThreadSnapshot {
    /// Thread name.
    pub name: String,
    /// Kernel thread id.
    pub tid: u64,
    /// CPU seconds used by the thread so far.
    pub cpu_seconds: f64,
    /// Requests completed.
    pub requests: u64,
    /// Wake-ups by guest kick.
    pub kick_wakeups: u64,
    /// Wake-ups by backend completion.
    pub completion_wakeups: u64,
    /// epoll returns that brought stale edges only.
    #[serde(default)]
    pub stale_edges: u64,
    /// Event-loop iterations.
    pub passes: u64,
    /// Passes that found at least one queue with work.
    #[serde(default)]
    pub passes_ready: u64,
    /// Passes that found two or more queues with work at once.
    #[serde(default)]
    pub passes_ready_together: u64,
    /// Guest notifications sent.
    pub notifications: u64,
    /// Notification checks that sent no call (the guest did not ask for one).
    #[serde(default)]
    pub notifications_suppressed: u64,
    /// Requests popped from the avail rings.
    #[serde(default)]
    pub popped: u64,
    /// Used ring entries published (`add_used` calls).
    #[serde(default)]
    pub used_publishes: u64,
    /// Delivery rounds that published at least one used entry.
    #[serde(default)]
    pub used_batches: u64,
    /// Kick edges seen (stale ones included).
    #[serde(default)]
    pub kicks: u64,
    /// Failed or malformed requests.
    pub errors: u64,
    /// Rings found in an impossible state and stopped.
    #[serde(default)]
    pub broken_rings: u64,
    /// Passes in which a queue used up its pop budget.
    #[serde(default)]
    pub budget_exhausted: u64,
    /// Current polling window, ns.
    pub poll_window_ns: u64,
    /// Passes that busy-polled.
    pub poll_attempts: u64,
    /// Passes whose work was found by polling.
    pub poll_hits: u64,
    /// Hybrid-polling naps.
    pub naps: u64,
    /// How late a timed nap may end, ns (adaptive mode's measurement; 0 otherwise).
    #[serde(default)]
    pub nap_late_ns: u64,
    /// Thread CPU time of one timed nap, ns (adaptive mode's measurement; 0 otherwise).
    #[serde(default)]
    pub nap_cpu_ns: u64,
    /// Trials of sleeping until each event that gave a verdict (adaptive mode).
    #[serde(default)]
    pub poll_trials: u64,
    /// Of those, the ones sleeping won.
    #[serde(default)]
    pub poll_trials_slept: u64,
    /// Seconds spent busy-polling.
    pub poll_seconds: f64,
    /// Seconds spent blocked waiting for events.
    pub sleep_seconds: f64,
    /// Per-queue counters for the queues this thread served.
    pub queues: Vec<QueueSnapshot>,
}

/// Everything the daemon counts.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct DaemonSnapshot {
    /// One entry per IOThread.
    pub iothreads: Vec<IoThreadSnapshot>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bound is in its own bucket (`le` is inclusive), one more ns is
    /// in the next, and beyond the last bound is +Inf.
    #[test]
    fn latency_buckets_follow_le() {
        assert_eq!(LatencyHistogram::bucket(0), 0);
        assert_eq!(LatencyHistogram::bucket(1), 0);
        for (i, &b) in LATENCY_BOUNDS_NS.iter().enumerate() {
            assert_eq!(LatencyHistogram::bucket(b), i, "bound {b}");
            assert_eq!(LatencyHistogram::bucket(b + 1), i + 1, "bound {b} + 1");
            if i > 0 {
                assert_eq!(LatencyHistogram::bucket(LATENCY_BOUNDS_NS[i - 1] + 1), i);
            }
        }
        assert_eq!(LatencyHistogram::bucket(u64::MAX), LATENCY_BUCKETS - 1);
        assert!(LATENCY_BOUNDS_NS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn latency_histogram_counts_and_merges() {
        let h = LatencyHistogram::default();
        for ns in [500, 1_500, 1_500, 3_000_000, 20_000_000_000] {
            h.observe(ns);
        }
        let s = h.snapshot();
        assert_eq!(s.buckets.len(), LATENCY_BUCKETS);
        assert_eq!(s.count(), 5);
        assert_eq!(s.sum_ns, 500 + 3_000 + 3_000_000 + 20_000_000_000);
        assert_eq!((s.buckets[0], s.buckets[1]), (1, 2));
        assert_eq!(s.buckets[LatencyHistogram::bucket(3_000_000)], 1);
        assert_eq!(s.buckets[LATENCY_BUCKETS - 1], 1);
        let mut total = LatencySnapshot::default();
        total.merge(&s);
        total.merge(&s);
        assert_eq!(total.count(), 10);
        assert_eq!(total.buckets[1], 4);
        assert_eq!(total.sum_ns, 2 * s.sum_ns);
    }

    /// The CPU clock of another thread of this process counts its CPU time
    /// (as /proc's utime + stime does, at tick resolution).
    #[test]
    fn thread_cpu_seconds_reads_another_threads_clock() {
        fn own_cpu() -> f64 {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `ts` is a valid, writable timespec.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
            ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let spinner = std::thread::spawn(move || {
            // Spin until this thread has used 50 ms of CPU (bounded: a loaded
            // machine gives it less than the wall time).
            let t = std::time::Instant::now();
            while own_cpu() < 0.05 && t.elapsed() < std::time::Duration::from_secs(10) {
                std::hint::spin_loop();
            }
            // SAFETY: gettid has no preconditions.
            tx.send((unsafe { libc::gettid() } as u64, own_cpu()))
                .unwrap();
            done_rx.recv().unwrap();
        });
        let (tid, used) = rx.recv().unwrap();
        let clock = thread_cpu_seconds(tid);
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
        let f: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        // SAFETY: sysconf has no memory-safety preconditions.
        let proc = ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        done_tx.send(()).unwrap();
        spinner.join().unwrap();
        assert!(used >= 0.05, "the spinner used {used} s");
        assert!(
            clock >= used && clock < used + 0.02,
            "clock {clock} vs the thread's own {used}"
        );
        assert!((clock - proc).abs() < 0.05, "clock {clock} vs /proc {proc}");
        assert_eq!(thread_cpu_seconds(0), 0.0);
        assert_eq!(thread_cpu_seconds(u32::MAX as u64), 0.0);
    }

    /// In flight is popped minus completed; errors are kept by kind.
    #[test]
    fn queue_snapshot_in_flight_and_error_kinds() {
        let t = IoThreadStats::new("t".into());
        let q = t.queue("e", 1);
        q.popped.add(5);
        q.requests.add(3);
        q.error(ErrorKind::Io);
        q.error(ErrorKind::Io);
        q.error(ErrorKind::Malformed);
        let s = t.snapshot();
        let qs = &s.queues[0];
        assert_eq!((qs.popped, qs.in_flight), (5, 2));
        assert_eq!(qs.errors_by_kind["io"], 2);
        assert_eq!(qs.errors_by_kind["malformed"], 1);
        assert_eq!(qs.errors_by_kind["submit"], 0);
        assert_eq!(qs.errors_by_kind.len(), ErrorKind::ALL.len());
        // Older stats files (without the new fields) still read back.
        let mut v = serde_json::to_value(qs).unwrap();
        for f in [
            "popped",
            "in_flight",
            "throttled",
            "throttled_ns",
            "errors_by_kind",
            "latency",
        ] {
            v.as_object_mut().unwrap().remove(f);
        }
        let old: QueueSnapshot = serde_json::from_value(v).unwrap();
        assert_eq!(old.requests, 3);
    }
}
