//! A `vqblk serve`'s own counters over a run (`--server-stats`): the daemon is asked
//! (SIGUSR1) to rewrite its `--stats-file` when the measured part of the run starts
//! (after `ramp_time`, as the CPU times) and when it ends, and the difference per
//! IOThread goes into the JSON report as `vqblk.server_iothreads`.
//! The file is read with the daemon's own types ([`vqblk_daemon::stats`]).

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use vqblk_daemon::stats::{DaemonSnapshot, IoThreadSnapshot};

/// What one IOThread did between two snapshots: an entry of
/// `vqblk.server_iothreads`. Counters are differences; `poll_window_ns` is the
/// window at the end.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IoThreadDelta {
    /// Thread name (`vqblk-iotN`).
    pub name: String,
    /// CPU seconds the thread used.
    pub cpu_seconds: f64,
    /// Requests completed.
    pub requests: u64,
    /// Failed or malformed requests.
    pub errors: u64,
    /// Wake-ups by guest kick.
    pub kick_wakeups: u64,
    /// Wake-ups by backend completion.
    pub completion_wakeups: u64,
    /// Guest notifications sent.
    pub notifications: u64,
    /// Notification checks that sent no call (the guest did not ask for one).
    pub notifications_suppressed: u64,
    /// Requests popped from the avail rings.
    pub popped: u64,
    /// Used ring entries published.
    pub used_publishes: u64,
    /// Delivery rounds that published at least one used entry.
    pub used_batches: u64,
    /// Kick edges seen (stale ones included).
    pub kicks: u64,
    /// Event-loop iterations.
    pub passes: u64,
    /// Passes that busy-polled.
    pub poll_attempts: u64,
    /// Passes whose work was found by polling.
    pub poll_hits: u64,
    /// Hybrid-polling naps.
    pub naps: u64,
    /// Trials of sleeping until each event that gave a verdict (adaptive).
    pub poll_trials: u64,
    /// Of those, the ones sleeping won.
    pub poll_trials_slept: u64,
    /// Seconds spent busy-polling.
    pub poll_seconds: f64,
    /// Seconds spent blocked waiting for events.
    pub sleep_seconds: f64,
    /// The polling window at the second snapshot, ns.
    pub poll_window_ns: u64,
    /// How late a timed nap ends, as the thread measured it at the second
    /// snapshot, ns (the price of a sleep its adaptive polling weighs).
    pub nap_late_ns: u64,
}

impl IoThreadDelta {
    /// `after - before` for every counter, never below zero (`before` None: from zero).
    pub fn between(before: Option<&IoThreadSnapshot>, after: &IoThreadSnapshot) -> Self {
        let n = |f: fn(&IoThreadSnapshot) -> u64| f(after).saturating_sub(before.map_or(0, f));
        let x = |f: fn(&IoThreadSnapshot) -> f64| (f(after) - before.map_or(0.0, f)).max(0.0);
        Self {
            name: after.name.clone(),
            cpu_seconds: x(|t| t.cpu_seconds),
            requests: n(|t| t.requests),
            errors: n(|t| t.errors),
            kick_wakeups: n(|t| t.kick_wakeups),
            completion_wakeups: n(|t| t.completion_wakeups),
            notifications: n(|t| t.notifications),
            notifications_suppressed: n(|t| t.notifications_suppressed),
            popped: n(|t| t.popped),
            used_publishes: n(|t| t.used_publishes),
            used_batches: n(|t| t.used_batches),
            kicks: n(|t| t.kicks),
            passes: n(|t| t.passes),
            poll_attempts: n(|t| t.poll_attempts),
            poll_hits: n(|t| t.poll_hits),
            naps: n(|t| t.naps),
            poll_trials: n(|t| t.poll_trials),
            poll_trials_slept: n(|t| t.poll_trials_slept),
            poll_seconds: x(|t| t.poll_seconds),
            sleep_seconds: x(|t| t.sleep_seconds),
            poll_window_ns: after.poll_window_ns,
            nap_late_ns: after.nap_late_ns,
        }
    }
}

impl IoThreadDelta {
    /// Adds `other`, the same thread's counters over a later part of the
    /// run (the passes of a verify run); the window and the nap lateness
    /// are `other`'s, the later ones.
    pub fn absorb(&mut self, other: &IoThreadDelta) {
        self.cpu_seconds += other.cpu_seconds;
        self.requests += other.requests;
        self.errors += other.errors;
        self.kick_wakeups += other.kick_wakeups;
        self.completion_wakeups += other.completion_wakeups;
        self.notifications += other.notifications;
        self.notifications_suppressed += other.notifications_suppressed;
        self.popped += other.popped;
        self.used_publishes += other.used_publishes;
        self.used_batches += other.used_batches;
        self.kicks += other.kicks;
        self.passes += other.passes;
        self.poll_attempts += other.poll_attempts;
        self.poll_hits += other.poll_hits;
        self.naps += other.naps;
        self.poll_trials += other.poll_trials;
        self.poll_trials_slept += other.poll_trials_slept;
        self.poll_seconds += other.poll_seconds;
        self.sleep_seconds += other.sleep_seconds;
        self.poll_window_ns = other.poll_window_ns;
        self.nap_late_ns = other.nap_late_ns;
    }
}

/// Per-IOThread counters accumulated between two snapshots, for the threads of `b`
/// (matched to `a` by name).
pub fn iothread_delta(a: &DaemonSnapshot, b: &DaemonSnapshot) -> Vec<IoThreadDelta> {
    b.iothreads
        .iter()
        .map(|t| IoThreadDelta::between(a.iothreads.iter().find(|o| o.name == t.name), t))
        .collect()
}

/// Asks the `vqblk serve` with `pid` (SIGUSR1) to rewrite its stats file `path`,
/// waits up to 2 s for it to change, and reads it. None, with a warning, if that does
/// not work: the counters are extra.
pub fn snapshot(path: &Path, pid: u32) -> Option<DaemonSnapshot> {
    let mtime = || std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let before = mtime();
    // SAFETY: kill(2) with a pid and a signal number; no memory is involved.
    if unsafe { libc::kill(pid as i32, libc::SIGUSR1) } != 0 {
        eprintln!(
            "vqblk bench: --server-stats: cannot signal {pid}: {}",
            std::io::Error::last_os_error()
        );
        return None;
    }
    let t0 = Instant::now();
    while mtime() == before && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    match std::fs::read_to_string(path).map(|t| serde_json::from_str(&t)) {
        Ok(Ok(s)) => Some(s),
        _ => {
            eprintln!(
                "vqblk bench: --server-stats: cannot read {}",
                path.display()
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thread(name: &str, k: u64) -> IoThreadSnapshot {
        IoThreadSnapshot {
            name: name.into(),
            tid: 7,
            cpu_seconds: k as f64 * 0.5,
            requests: 100 * k,
            kick_wakeups: k,
            completion_wakeups: 2 * k,
            stale_edges: k,
            passes: 10 * k,
            passes_ready: 8 * k,
            passes_ready_together: 2 * k,
            notifications: 3 * k,
            notifications_suppressed: 6 * k,
            popped: 100 * k,
            used_publishes: 100 * k,
            used_batches: 9 * k,
            kicks: 2 * k,
            errors: 0,
            broken_rings: 0,
            budget_exhausted: 0,
            poll_window_ns: 1000 * k,
            poll_attempts: 4 * k,
            poll_hits: k,
            naps: 5 * k,
            nap_late_ns: 0,
            nap_cpu_ns: 0,
            poll_trials: k,
            poll_trials_slept: k,
            poll_seconds: k as f64 * 0.25,
            sleep_seconds: k as f64,
            queues: Vec::new(),
        }
    }

    #[test]
    fn absorbing_adds_the_counters_and_keeps_the_later_window() {
        let mut a = IoThreadDelta::between(None, &thread("vqblk-iot0", 1));
        let b = IoThreadDelta::between(None, &thread("vqblk-iot0", 2));
        a.absorb(&b);
        assert_eq!(
            (a.requests, a.passes, a.naps, a.poll_trials),
            (300, 30, 15, 3)
        );
        assert_eq!((a.cpu_seconds, a.sleep_seconds), (1.5, 3.0));
        assert_eq!(a.poll_window_ns, 2000);
    }

    #[test]
    fn deltas_subtract_by_name_and_keep_the_last_window() {
        let a = DaemonSnapshot {
            iothreads: vec![thread("vqblk-iot0", 1), thread("vqblk-iot1", 5)],
        };
        let b = DaemonSnapshot {
            iothreads: vec![
                thread("vqblk-iot1", 2),
                thread("vqblk-iot0", 3),
                thread("new", 1),
            ],
        };
        let d = iothread_delta(&a, &b);
        assert_eq!(d.len(), 3);
        // Counters that went down (a restarted server) give zero, not a wrap.
        assert_eq!(
            (d[0].name.as_str(), d[0].requests, d[0].cpu_seconds),
            ("vqblk-iot1", 0, 0.0)
        );
        assert_eq!((d[1].requests, d[1].passes, d[1].naps), (200, 20, 10));
        assert_eq!((d[1].poll_seconds, d[1].sleep_seconds), (0.5, 2.0));
        assert_eq!(d[1].poll_window_ns, 3000);
        assert_eq!((d[1].popped, d[1].used_batches, d[1].kicks), (200, 18, 4));
        assert_eq!(d[1].notifications_suppressed, 12);
        assert_eq!(d[2], IoThreadDelta::between(None, &thread("new", 1)));
        assert_eq!(d[2].requests, 100);
    }

    #[test]
    fn json_keeps_the_fields_scripts_read() {
        let v = serde_json::to_value(IoThreadDelta::between(None, &thread("t", 1))).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "completion_wakeups",
                "cpu_seconds",
                "errors",
                "kick_wakeups",
                "kicks",
                "name",
                "nap_late_ns",
                "naps",
                "notifications",
                "notifications_suppressed",
                "passes",
                "poll_attempts",
                "poll_hits",
                "poll_seconds",
                "poll_trials",
                "poll_trials_slept",
                "poll_window_ns",
                "popped",
                "requests",
                "sleep_seconds",
                "used_batches",
                "used_publishes",
            ]
        );
        assert!(v["requests"].is_u64() && v["cpu_seconds"].is_f64());
    }

    #[test]
    fn the_daemons_stats_file_parses() {
        let file = serde_json::to_string(&DaemonSnapshot {
            iothreads: vec![thread("vqblk-iot0", 1)],
        })
        .unwrap();
        let s: DaemonSnapshot = serde_json::from_str(&file).unwrap();
        assert_eq!(s.iothreads[0].requests, 100);
        // A file from a daemon that predates the pipeline counters still parses.
        let mut old: serde_json::Value = serde_json::from_str(&file).unwrap();
        let t = old["iothreads"][0].as_object_mut().unwrap();
        for k in [
            "popped",
            "used_publishes",
            "used_batches",
            "notifications_suppressed",
            "kicks",
        ] {
            t.remove(k);
        }
        let s: DaemonSnapshot = serde_json::from_value(old).unwrap();
        assert_eq!((s.iothreads[0].popped, s.iothreads[0].kicks), (0, 0));
    }
}
