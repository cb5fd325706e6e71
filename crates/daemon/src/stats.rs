//! Counters. Each counter is written by exactly one IOThread (the owner of the
//! queue or of the thread) with relaxed atomics, and read by anyone for
//! snapshots; no lock is taken on the data path.

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
    /// Overwrites the value (for gauges).
    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    /// Current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
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
    /// Current polling window in ns (gauge).
    pub poll_window_ns: Counter,
    /// Passes that busy-polled.
    pub poll_attempts: Counter,
    /// Passes whose work was found by polling (no sleep).
    pub poll_hits: Counter,
    /// Hybrid-polling naps (timed sleeps before spinning).
    pub naps: Counter,
    /// How late a timed nap may end, ns, as measured by this thread (gauge).
    pub nap_late_ns: Counter,
    /// Thread CPU time of one timed nap, ns, as measured (gauge).
    pub nap_cpu_ns: Counter,
    /// Sampled passes (one in [`HANDBACK_SAMPLE_EVERY`] that published used
    /// entries) timed for the hand-back figures below.
    pub handback_samples: Counter,
    /// Over the sampled passes: ns from the pass starting to pop (the first
    /// request's execution: a null request completes there) to its used
    /// entries being published.
    pub pop_to_publish_ns: Counter,
    /// Sampled passes that sent a call.
    pub call_samples: Counter,
    /// Over the sampled passes that sent a call: ns from the publish to the
    /// call eventfd write returning.
    pub publish_to_call_ns: Counter,
    /// Time spent busy-polling, ns.
    pub poll_ns: Counter,
    /// Time spent blocked in epoll_wait, ns.
    pub sleep_ns: Counter,
    queues: Mutex<Vec<(String, u16, Arc<QueueCounters>)>>,
}

/// One pass in this many (of those that publish used entries) is timed for
/// the hand-back counters: two clock reads per sample keep it off the fast
/// path.
pub const HANDBACK_SAMPLE_EVERY: u64 = 64;

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
            .map(|(e, i, c)| QueueSnapshot {
                export: e.clone(),
                queue: *i,
                requests: c.requests.get(),
                reads: c.reads.get(),
                writes: c.writes.get(),
                flushes: c.flushes.get(),
                other: c.other.get(),
                errors: c.errors.get(),
                bytes_read: c.bytes_read.get(),
                bytes_written: c.bytes_written.get(),
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
            handback_samples: self.handback_samples.get(),
            pop_to_publish_ns: self.pop_to_publish_ns.get(),
            call_samples: self.call_samples.get(),
            publish_to_call_ns: self.publish_to_call_ns.get(),
            poll_seconds: self.poll_ns.get() as f64 / 1e9,
            sleep_seconds: self.sleep_ns.get() as f64 / 1e9,
            queues,
        }
    }
}

/// CPU time (user + system) of a thread of this process, from
/// `/proc/self/task/TID/stat`.
pub fn thread_cpu_seconds(tid: u64) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = s.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
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
    /// Passes timed for the hand-back figures (one in [`HANDBACK_SAMPLE_EVERY`]
    /// of those that published).
    #[serde(default)]
    pub handback_samples: u64,
    /// Sum over the sampled passes of ns from popping to publishing.
    #[serde(default)]
    pub pop_to_publish_ns: u64,
    /// Sampled passes that sent a call.
    #[serde(default)]
    pub call_samples: u64,
    /// Sum over those of ns from publishing to the call write returning.
    #[serde(default)]
    pub publish_to_call_ns: u64,
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
