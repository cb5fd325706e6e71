//! What one `vqblk bench` run measured, read from its fio-compatible JSON.

use std::collections::BTreeMap;

use anyhow::{bail, Context};

use crate::matrix::Op;
use crate::results::{IoThreadCounters, TuneDuring};

/// What one `vqblk bench` run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// IOPS.
    pub iops: f64,
    /// Bytes per second.
    pub bw_bytes: f64,
    /// p50 completion latency, us.
    pub p50_us: Option<f64>,
    /// p99 completion latency, us.
    pub p99_us: Option<f64>,
    /// Server CPU seconds.
    pub server_cpu_s: Option<f64>,
    /// Measured seconds.
    pub elapsed_s: f64,
    /// Server CPU seconds by thread name (summed over threads of one name).
    pub server_threads: BTreeMap<String, f64>,
    /// The `auto` column: what its controller did during the run.
    pub tune: Option<TuneDuring>,
    /// vqblk's columns: what its IOThreads counted during the run.
    pub iothread_counters: Option<IoThreadCounters>,
}

impl Measured {
    /// Server CPU as a percentage of one CPU over the measured time.
    pub fn server_cpu_pct(&self) -> Option<f64> {
        self.server_cpu_s
            .filter(|_| self.elapsed_s > 0.0)
            .map(|c| c / self.elapsed_s * 100.0)
    }
}

/// Reads the figures of one operation from `vqblk bench --output-format json`.
pub fn parse_bench_json(text: &str, op: Op) -> anyhow::Result<Measured> {
    let v: serde_json::Value = serde_json::from_str(text).context("bench output is not JSON")?;
    let job = &v["jobs"][0];
    if job.is_null() {
        bail!("bench output has no jobs[0]");
    }
    if job["error"].as_i64().unwrap_or(0) != 0 {
        bail!(
            "bench job failed: {}",
            job["error_text"].as_str().unwrap_or("unknown error")
        );
    }
    let d = &job[if op.writes() { "write" } else { "read" }];
    let pct = |k: &str| d["clat_ns"]["percentile"][k].as_f64().map(|ns| ns / 1000.0);
    let elapsed_s = v["vqblk"]["elapsed_s"]
        .as_f64()
        .or_else(|| d["runtime"].as_f64().map(|ms| ms / 1000.0))
        .unwrap_or(0.0);
    let mut server_threads = BTreeMap::new();
    for t in v["vqblk"]["server_threads"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let (Some(name), Some(cpu)) = (t["name"].as_str(), t["cpu_s"].as_f64()) {
            *server_threads.entry(name.to_string()).or_insert(0.0) += cpu;
        }
    }
    Ok(Measured {
        iops: d["iops"].as_f64().context("bench output: no iops")?,
        bw_bytes: d["bw_bytes"]
            .as_f64()
            .context("bench output: no bw_bytes")?,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        server_cpu_s: v["vqblk"]["server_cpu_s"].as_f64(),
        elapsed_s,
        server_threads,
        tune: None,
        iothread_counters: None,
    })
}

/// A vqblk server at one moment: what `query-iothreads` (and, for the `auto`
/// column, `query-tune`) answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerState {
    /// Counters summed over the IOThreads (`nap_late_ns`: the largest of an
    /// active one).
    pub counters: IoThreadCounters,
    /// IOThreads active now.
    pub active_iothreads: u32,
    /// Moves so far, by reason (`auto` only).
    pub moves: BTreeMap<String, u64>,
    /// Failed moves so far (`auto` only).
    pub failed_moves: u64,
    /// Whether the daemon tunes its pool (`query-tune`'s `auto`).
    pub tuned: bool,
}

impl ServerState {
    /// Reads the answers to `query-iothreads` and, if asked, `query-tune`.
    pub fn parse(iothreads: &serde_json::Value, tune: Option<&serde_json::Value>) -> ServerState {
        let mut st = ServerState::default();
        for t in iothreads.as_array().into_iter().flatten() {
            let n = |k: &str| t[k].as_u64().unwrap_or(0);
            let c = &mut st.counters;
            c.passes += n("passes");
            c.completion_wakeups += n("completion-wakeups");
            c.kick_wakeups += n("kick-wakeups");
            c.naps += n("naps");
            c.poll_hits += n("poll-hits");
            if t["active"] == serde_json::Value::Bool(true) {
                st.active_iothreads += 1;
                c.nap_late_ns = c.nap_late_ns.max(n("nap-late-ns"));
            }
        }
        if let Some(tune) = tune.filter(|t| t["auto"] == serde_json::Value::Bool(true)) {
            st.tuned = true;
            st.moves = tune["moves"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(reason, n)| Some((reason.clone(), n.as_u64()?)))
                .collect();
            st.failed_moves = tune["failed-moves"].as_u64().unwrap_or(0);
        }
        st
    }

    /// The counters between `self` and `after` (the nap lateness: `after`'s).
    pub fn counters_until(&self, after: &ServerState) -> IoThreadCounters {
        let (a, b) = (&self.counters, &after.counters);
        IoThreadCounters {
            passes: b.passes.saturating_sub(a.passes),
            completion_wakeups: b.completion_wakeups.saturating_sub(a.completion_wakeups),
            kick_wakeups: b.kick_wakeups.saturating_sub(a.kick_wakeups),
            naps: b.naps.saturating_sub(a.naps),
            poll_hits: b.poll_hits.saturating_sub(a.poll_hits),
            nap_late_ns: b.nap_late_ns,
        }
    }

    /// What the controller did between `self` and `after`: the moves made in
    /// between (reasons with none left out) and the IOThreads active at the
    /// end; None if the daemon does not tune.
    pub fn tune_until(&self, after: &ServerState) -> Option<TuneDuring> {
        if !after.tuned {
            return None;
        }
        let moves = after
            .moves
            .iter()
            .map(|(r, &n)| {
                (
                    r.clone(),
                    n.saturating_sub(self.moves.get(r).copied().unwrap_or(0)),
                )
            })
            .filter(|&(_, n)| n > 0)
            .collect();
        Some(TuneDuring {
            moves,
            failed_moves: after.failed_moves.saturating_sub(self.failed_moves),
            active_iothreads: after.active_iothreads,
        })
    }
}
