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
    /// Seconds the server's threads were runnable but waited for a CPU, by
    /// thread name (those that waited at all).
    pub server_threads_wait: BTreeMap<String, f64>,
    /// The CPU each server thread last ran on at the end of the run, by
    /// thread name (of several threads of one name, the busiest).
    pub server_threads_cpu: BTreeMap<String, u32>,
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
    // vqblk's own counters per IOThread over the run (`--server-stats`).
    let iothreads = v["vqblk"]["server_iothreads"].as_array();
    let iothread_counters = iothreads.map(|threads| {
        let mut c = IoThreadCounters::default();
        for t in threads {
            let n = |k: &str| t[k].as_u64().unwrap_or(0);
            c.passes += n("passes");
            c.completion_wakeups += n("completion_wakeups");
            c.kick_wakeups += n("kick_wakeups");
            c.naps += n("naps");
            c.poll_hits += n("poll_hits");
            c.poll_trials += n("poll_trials");
            c.poll_trials_slept += n("poll_trials_slept");
            if n("requests") > 0 {
                c.nap_late_ns = c.nap_late_ns.max(n("nap_late_ns"));
            }
        }
        c
    });
    let mut server_threads = BTreeMap::new();
    let mut server_threads_wait = BTreeMap::new();
    let mut busiest: BTreeMap<String, (f64, u32)> = BTreeMap::new();
    for t in v["vqblk"]["server_threads"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(name) = t["name"].as_str() else {
            continue;
        };
        if let Some(cpu) = t["cpu_s"].as_f64() {
            *server_threads.entry(name.to_string()).or_insert(0.0) += cpu;
        }
        if let Some(wait) = t["wait_s"].as_f64().filter(|&w| w > 0.0) {
            *server_threads_wait.entry(name.to_string()).or_insert(0.0) += wait;
        }
        if let Some(last) = t["last_cpu"].as_u64().and_then(|c| u32::try_from(c).ok()) {
            let cpu = t["cpu_s"].as_f64().unwrap_or(0.0);
            let e = busiest.entry(name.to_string()).or_insert((cpu, last));
            if cpu > e.0 {
                *e = (cpu, last);
            }
        }
    }
    let server_threads_cpu = busiest.into_iter().map(|(n, (_, c))| (n, c)).collect();
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
        server_threads_wait,
        server_threads_cpu,
        tune: None,
        iothread_counters,
    })
}

/// The `auto` column's controller at one moment: what `query-tune` and
/// `query-iothreads` answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TuneState {
    /// Moves so far, by reason.
    pub moves: BTreeMap<String, u64>,
    /// Failed moves so far.
    pub failed_moves: u64,
    /// IOThreads active now.
    pub active_iothreads: u32,
}

impl TuneState {
    /// Reads the two answers; None if `tune` says the daemon does not tune.
    pub fn parse(tune: &serde_json::Value, iothreads: &serde_json::Value) -> Option<TuneState> {
        if tune["auto"] != serde_json::Value::Bool(true) {
            return None;
        }
        let moves = tune["moves"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(reason, n)| Some((reason.clone(), n.as_u64()?)))
            .collect();
        let active = iothreads
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| t["active"] == serde_json::Value::Bool(true))
            .count();
        Some(TuneState {
            moves,
            failed_moves: tune["failed-moves"].as_u64().unwrap_or(0),
            active_iothreads: u32::try_from(active).unwrap_or(u32::MAX),
        })
    }

    /// What happened between `self` and `after`: the moves made in between
    /// (reasons with none left out) and the IOThreads active at the end.
    pub fn until(&self, after: &TuneState) -> TuneDuring {
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
        TuneDuring {
            moves,
            failed_moves: after.failed_moves.saturating_sub(self.failed_moves),
            active_iothreads: after.active_iothreads,
        }
    }
}
