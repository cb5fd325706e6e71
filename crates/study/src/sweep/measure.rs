//! What one `vqblk bench` run measured, read from its fio-compatible JSON.

use anyhow::{bail, Context};

use crate::matrix::Op;

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
    Ok(Measured {
        iops: d["iops"].as_f64().context("bench output: no iops")?,
        bw_bytes: d["bw_bytes"]
            .as_f64()
            .context("bench output: no bw_bytes")?,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        server_cpu_s: v["vqblk"]["server_cpu_s"].as_f64(),
        elapsed_s,
    })
}
