//! Reports: fio's human-readable summary and fio's JSON layout, plus a `vqblk` object
//! with what fio does not measure (server CPU, per-I/O CPU cost, target details).

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

use crate::report::{JobReport, Report};
use crate::stats::{DirStats, LatJson, LatStat, FIO_PERCENTILES};
use crate::units::{human_bw, human_bytes, human_count};

/// The `"fio version"` we report.
pub const VERSION: &str = concat!("vqblk-bench-", env!("CARGO_PKG_VERSION"));

/// Per-direction derived figures.
struct Rates {
    bw_bytes: f64,
    iops: f64,
    runtime_ms: u64,
}

fn rates(d: &DirStats, runtime: Duration) -> Rates {
    let s = runtime.as_secs_f64();
    if d.total_ios == 0 || s <= 0.0 {
        return Rates {
            bw_bytes: 0.0,
            iops: 0.0,
            runtime_ms: if d.total_ios == 0 {
                0
            } else {
                runtime.as_millis() as u64
            },
        };
    }
    Rates {
        bw_bytes: d.io_bytes as f64 / s,
        iops: d.total_ios as f64 / s,
        runtime_ms: (runtime.as_nanos() as u64).div_ceil(1_000_000),
    }
}

/// One direction in fio's JSON layout.
#[derive(Debug, Clone, Serialize)]
pub struct DirJson {
    /// Bytes transferred.
    pub io_bytes: u64,
    /// KiB transferred.
    pub io_kbytes: u64,
    /// Bandwidth, bytes/s.
    pub bw_bytes: u64,
    /// Bandwidth, KiB/s.
    pub bw: u64,
    /// Requests per second.
    pub iops: f64,
    /// Measured time, ms.
    pub runtime: u64,
    /// Requests completed.
    pub total_ios: u64,
    /// Always 0 (fio's short transfers).
    pub short_ios: u64,
    /// Always 0 (fio's dropped requests).
    pub drop_ios: u64,
    /// Submission latency.
    pub slat_ns: LatJson,
    /// Completion latency.
    pub clat_ns: LatJson,
    /// Total latency.
    pub lat_ns: LatJson,
}

fn dir_json(d: &DirStats, runtime: Duration) -> DirJson {
    let r = rates(d, runtime);
    DirJson {
        io_bytes: d.io_bytes,
        io_kbytes: d.io_bytes / 1024,
        bw_bytes: r.bw_bytes.round() as u64,
        bw: (r.bw_bytes / 1024.0).round() as u64,
        iops: r.iops,
        runtime: r.runtime_ms,
        total_ios: d.total_ios,
        short_ios: 0,
        drop_ios: 0,
        slat_ns: d.slat.to_json(),
        clat_ns: d.clat.to_json(),
        lat_ns: d.lat.to_json(),
    }
}

/// One job in fio's JSON layout.
#[derive(Debug, Clone, Serialize)]
pub struct JobJson {
    /// Job name.
    pub jobname: String,
    /// Group id.
    pub groupid: u32,
    /// Threads folded into this entry.
    pub job_threads: u32,
    /// 1 when a request failed.
    pub error: i32,
    /// The first error, if any.
    pub error_text: Option<String>,
    /// Always 0.
    pub eta: u64,
    /// Measured seconds.
    pub elapsed: u64,
    /// The job's options as fio echoes them.
    #[serde(rename = "job options")]
    pub job_options: Value,
    /// Reads.
    pub read: DirJson,
    /// Writes.
    pub write: DirJson,
    /// Always empty (no trims).
    pub trim: DirJson,
    /// Measured ms.
    pub job_runtime: u64,
    /// User CPU, percent of the runtime.
    pub usr_cpu: f64,
    /// System CPU, percent of the runtime.
    pub sys_cpu: f64,
    /// Context switches.
    pub ctx: u64,
    /// Always 0.
    pub majf: u64,
    /// Always 0.
    pub minf: u64,
}

/// The whole report in fio's JSON layout.
#[derive(Debug, Clone, Serialize)]
pub struct FioJson {
    /// Producer name and version.
    #[serde(rename = "fio version")]
    pub fio_version: &'static str,
    /// Start, seconds since the epoch.
    pub timestamp: u64,
    /// Start, milliseconds since the epoch.
    pub timestamp_ms: u64,
    /// Start, as text.
    pub time: String,
    /// Always empty: options live with each job.
    #[serde(rename = "global options")]
    pub global_options: Value,
    /// Jobs (clones, or groups).
    pub jobs: Vec<JobJson>,
    /// What fio does not report: targets, client and server CPU, verify results.
    pub vqblk: Value,
}

fn cpu_pct(t: Duration, runtime: Duration) -> f64 {
    let r = runtime.as_secs_f64();
    if r <= 0.0 {
        0.0
    } else {
        t.as_secs_f64() / r * 100.0
    }
}

fn job_options(j: &JobReport) -> Value {
    let s = &j.spec;
    let mut o = serde_json::Map::new();
    let mut put = |k: &str, v: String| {
        o.insert(k.to_string(), Value::String(v));
    };
    put("name", s.name.clone());
    put("target", s.target.to_string());
    put("rw", s.rw.as_str().to_string());
    if matches!(
        s.rw,
        crate::options::RwMode::RandRw | crate::options::RwMode::ReadWrite
    ) {
        put("rwmixread", s.rwmixread.to_string());
    }
    put("bs", s.bs.to_string());
    put("iodepth", s.iodepth.to_string());
    if s.iodepth_batch_submit != 1 {
        put("iodepth_batch_submit", s.iodepth_batch_submit.to_string());
    }
    put("numjobs", s.numjobs.to_string());
    if let Some(sz) = s.size {
        put("size", sz.to_string());
    }
    if s.offset > 0 {
        put("offset", s.offset.to_string());
    }
    if let Some(r) = s.runtime {
        put("runtime", format!("{}ms", r.as_millis()));
    }
    if !s.ramp_time.is_zero() {
        put("ramp_time", format!("{}ms", s.ramp_time.as_millis()));
    }
    if s.time_based {
        put("time_based", "1".into());
    }
    if s.target.is_vhost_user() {
        put("ioengine", "libblkio".into());
        put("libblkio_wait_mode", s.wait_mode.as_str().into());
    } else if matches!(s.target, crate::options::Target::Rbd(_)) {
        put("ioengine", "rbd".into());
    } else {
        put("ioengine", "io_uring".into());
        put("direct", u8::from(s.direct).to_string());
    }
    if s.verify != crate::options::VerifyMode::None {
        put("verify", "crc32c".into());
    }
    Value::Object(o)
}

/// `n / ios`, null without requests.
fn per_io(n: u64, ios: u64) -> Value {
    if ios == 0 {
        Value::Null
    } else {
        json!(n as f64 / ios as f64)
    }
}

fn per_io_us(t: Duration, ios: u64) -> Value {
    if ios == 0 {
        Value::Null
    } else {
        json!(t.as_secs_f64() * 1e6 / ios as f64)
    }
}

/// One job (clone or group) in fio's JSON layout.
fn job_json(j: &JobReport) -> JobJson {
    JobJson {
        jobname: j.name.clone(),
        groupid: j.groupid,
        job_threads: j.threads,
        error: i32::from(j.io_errors > 0),
        error_text: j.error.clone(),
        eta: 0,
        elapsed: j.runtime.as_secs(),
        job_options: job_options(j),
        read: dir_json(&j.read, j.read_runtime),
        write: dir_json(&j.write, j.write_runtime),
        trim: dir_json(&DirStats::new(), Duration::ZERO),
        job_runtime: j.runtime.as_millis() as u64,
        usr_cpu: cpu_pct(j.cpu.user, j.runtime),
        sys_cpu: cpu_pct(j.cpu.sys, j.runtime),
        ctx: j.cpu.ctx,
        majf: 0,
        minf: 0,
    }
}

/// The `vqblk` object: what fio does not report.
fn vqblk_json(r: &Report) -> Value {
    let ios = r.total_ios();
    let mut vq = json!({
        "version": VERSION,
        "targets": r.targets,
        "elapsed_s": r.elapsed.as_secs_f64(),
        "total_ios": ios,
        "client_cpu_s": r.client_cpu.total().as_secs_f64(),
        "client_usr_s": r.client_cpu.user.as_secs_f64(),
        "client_sys_s": r.client_cpu.sys.as_secs_f64(),
        "client_cpu_per_io_us": per_io_us(r.client_cpu.total(), ios),
        // Voluntary context switches of the job threads (each measured from
        // its start to its end) per request: how often the client slept.
        "client_sleeps_per_io": per_io(r.jobs.iter().map(|j| j.cpu.sleeps).sum(), ios),
        "jobs": r.jobs.iter().map(|j| {
            let ios = j.read.total_ios + j.write.total_ios;
            json!({
                "jobname": j.name,
                "client_sleeps": j.cpu.sleeps,
                "client_sleeps_per_io": per_io(j.cpu.sleeps, ios),
            })
        }).collect::<Vec<_>>(),
    });
    if let Some(pid) = r.server_pid {
        vq["server_pid"] = json!(pid);
        server_json(r, ios, &mut vq);
    }
    if let Some(v) = &r.verify {
        vq["verify"] = serde_json::to_value(v).unwrap_or(Value::Null);
    }
    vq
}

/// The server's CPU time, in all and per thread, into the `vqblk` object.
fn server_json(r: &Report, ios: u64, vq: &mut Value) {
    // Per server thread (for vqblk: each IOThread `vqblk-iotN`), threads
    // that used CPU during the measured passes: CPU time, time spent
    // runnable waiting for a CPU, and the CPU it last ran on.
    vq["server_threads"] = Value::Array(
        r.server_threads
            .iter()
            .filter(|t| !t.cpu.is_zero())
            .map(|t| {
                json!({
                    "tid": t.tid,
                    "name": t.name,
                    "cpu_s": t.cpu.as_secs_f64(),
                    "wait_s": t.wait.as_secs_f64(),
                    "last_cpu": t.last_cpu,
                    "cpu_per_io_us": per_io_us(t.cpu, ios),
                })
            })
            .collect(),
    );
    match &r.server_cpu {
        Some(Ok(t)) => {
            vq["server_cpu_s"] = json!(t.total().as_secs_f64());
            vq["server_usr_s"] = json!(t.user.as_secs_f64());
            vq["server_sys_s"] = json!(t.sys.as_secs_f64());
            vq["server_cpu_per_io_us"] = per_io_us(t.total(), ios);
        }
        Some(Err(e)) => {
            vq["server_cpu_s"] = Value::Null;
            vq["server_cpu_per_io_us"] = Value::Null;
            vq["server_cpu_error"] = json!(e);
        }
        None => {}
    }
}

/// The whole report in fio's JSON layout.
pub fn to_json(r: &Report) -> FioJson {
    FioJson {
        fio_version: VERSION,
        timestamp: r.timestamp,
        timestamp_ms: r.timestamp_ms,
        time: ctime(r.timestamp),
        global_options: json!({}),
        jobs: r.jobs.iter().map(job_json).collect(),
        vqblk: vqblk_json(r),
    }
}

/// Local time as fio prints it (`Sat Nov 21 23:32:18 2026`), like ctime(3).
fn ctime(secs: u64) -> String {
    ctime_in(secs, &jiff::tz::TimeZone::system())
}

/// [`ctime`] in a given time zone; the seconds themselves if out of range.
fn ctime_in(secs: u64, tz: &jiff::tz::TimeZone) -> String {
    match i64::try_from(secs).map(jiff::Timestamp::from_second) {
        Ok(Ok(t)) => t
            .to_zoned(tz.clone())
            .strftime("%a %b %e %H:%M:%S %Y")
            .to_string(),
        _ => secs.to_string(),
    }
}

/// Renders the JSON report as fio does (pretty-printed).
pub fn render_json(r: &Report) -> String {
    let mut s = serde_json::to_string_pretty(&to_json(r))
        .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    s.push('\n');
    s
}

/// A unit for a latency block, chosen from its mean as fio does.
fn lat_unit(l: &LatStat) -> (&'static str, f64) {
    let m = l.mean();
    if m < 10_000.0 {
        ("nsec", 1.0)
    } else if m < 10_000_000.0 {
        ("usec", 1e3)
    } else {
        ("msec", 1e6)
    }
}

fn lat_line(out: &mut String, label: &str, l: &LatStat) {
    if l.count() == 0 {
        return;
    }
    let (u, div) = lat_unit(l);
    let _ = writeln!(
        out,
        "    {label:>4} ({u}): min={}, max={}, avg={:.2}, stdev={:.2}",
        (l.min() as f64 / div).round() as u64,
        (l.max() as f64 / div).round() as u64,
        l.mean() / div,
        l.stddev() / div
    );
}

fn dir_block(out: &mut String, label: &str, d: &DirStats, runtime: Duration) {
    if d.total_ios == 0 {
        return;
    }
    let r = rates(d, runtime);
    let _ = writeln!(
        out,
        "  {label}: IOPS={}, BW={} ({:.1}MB/s)({}/{}msec)",
        human_count(r.iops),
        human_bw(r.bw_bytes),
        r.bw_bytes / 1e6,
        human_bytes(d.io_bytes),
        r.runtime_ms
    );
    lat_line(out, "slat", &d.slat);
    lat_line(out, "clat", &d.clat);
    lat_line(out, "lat", &d.lat);
    if let Some(p) = d.clat.percentiles(&FIO_PERCENTILES) {
        let (u, div) = lat_unit(&d.clat);
        let _ = writeln!(out, "    clat percentiles ({u}):");
        for row in p.chunks(4) {
            let cells: Vec<String> = row
                .iter()
                .map(|(pc, v)| format!("{:>5.2}th=[{:>6}]", pc, (*v as f64 / div).round() as u64))
                .collect();
            let _ = writeln!(out, "     | {},", cells.join(", "));
        }
        let _ = writeln!(out, "     |");
    }
}

/// fio's normal (human) output.
pub fn render_normal(r: &Report) -> String {
    let mut out = String::new();
    for j in &r.jobs {
        job_header(&mut out, j);
    }
    for j in &r.jobs {
        job_block(&mut out, j);
    }
    let _ = writeln!(out, "Run status group 0 (all jobs):");
    group_status(
        &mut out,
        "READ",
        r.jobs.iter().map(|j| (&j.read, j.read_runtime)),
    );
    group_status(
        &mut out,
        "WRITE",
        r.jobs.iter().map(|j| (&j.write, j.write_runtime)),
    );
    let _ = writeln!(out);
    vqblk_lines(&mut out, r);
    out
}

/// fio's first line for a job: what it does.
fn job_header(out: &mut String, j: &JobReport) {
    let s = &j.spec;
    let _ = writeln!(
        out,
        "{}: (g=0): rw={}, bs={}B, target={}, iodepth={}{}",
        j.name,
        s.rw.as_str(),
        s.bs,
        s.target,
        s.iodepth,
        if s.target.is_vhost_user() {
            format!(", ioengine=libblkio, wait_mode={}", s.wait_mode.as_str())
        } else if matches!(s.target, crate::options::Target::Rbd(_)) {
            ", ioengine=rbd".to_string()
        } else {
            format!(", ioengine=io_uring, direct={}", u8::from(s.direct))
        }
    );
}

/// fio's block of results for a job: error, each direction, CPU.
fn job_block(out: &mut String, j: &JobReport) {
    let _ = writeln!(
        out,
        "{}: (groupid={}, jobs={}): err={:>2}: pid={}",
        j.name,
        j.groupid,
        j.threads,
        i32::from(j.io_errors > 0),
        std::process::id()
    );
    if let Some(e) = &j.error {
        let _ = writeln!(out, "  error: {e} ({} failed requests)", j.io_errors);
    }
    dir_block(out, "read", &j.read, j.read_runtime);
    dir_block(out, "write", &j.write, j.write_runtime);
    let _ = writeln!(
        out,
        "  cpu          : usr={:.2}%, sys={:.2}%, ctx={}, majf=0, minf=0",
        cpu_pct(j.cpu.user, j.runtime),
        cpu_pct(j.cpu.sys, j.runtime),
        j.cpu.ctx
    );
    let _ = writeln!(out);
}

/// fio's group status line for one direction (nothing if no job moved data that way):
/// the jobs' bandwidths added up, the shortest and longest run.
fn group_status<'a>(
    out: &mut String,
    label: &str,
    dirs: impl Iterator<Item = (&'a DirStats, Duration)>,
) {
    let mut io = 0u64;
    let mut run_min = u64::MAX;
    let mut run_max = 0u64;
    let mut bw_sum = 0.0;
    for (d, rt) in dirs.filter(|(d, _)| d.total_ios > 0) {
        let r = rates(d, rt);
        io += d.io_bytes;
        run_min = run_min.min(r.runtime_ms);
        run_max = run_max.max(r.runtime_ms);
        bw_sum += r.bw_bytes;
    }
    if io == 0 {
        return;
    }
    let _ = writeln!(
        out,
        "{label:>7}: bw={} ({:.1}MB/s), io={} ({:.1}MB), run={}-{}msec",
        human_bw(bw_sum),
        bw_sum / 1e6,
        human_bytes(io),
        io as f64 / 1e6,
        run_min,
        run_max
    );
}

/// The `vqblk:` lines: targets, client and server CPU per I/O, verify results.
fn vqblk_lines(out: &mut String, r: &Report) {
    let ios = r.total_ios();
    for t in &r.targets {
        let _ = write!(
            out,
            "vqblk: {} via {} ({} bytes",
            t.target, t.engine, t.capacity
        );
        if let (Some(q), Some(n), Some(m)) = (t.queue_size, t.num_queues, t.max_queues) {
            let _ = write!(out, ", {n}/{m} queues of {q}");
        }
        let _ = writeln!(out, ")");
    }
    let per_io = |t: Duration| {
        if ios == 0 {
            "-".to_string()
        } else {
            format!("{:.2}", t.as_secs_f64() * 1e6 / ios as f64)
        }
    };
    let _ = writeln!(
        out,
        "vqblk: client cpu {:.3}s (usr {:.3}s, sys {:.3}s), {} us/io over {} I/Os",
        r.client_cpu.total().as_secs_f64(),
        r.client_cpu.user.as_secs_f64(),
        r.client_cpu.sys.as_secs_f64(),
        per_io(r.client_cpu.total()),
        ios
    );
    match (r.server_pid, &r.server_cpu) {
        (Some(pid), Some(Ok(t))) => {
            let _ = writeln!(
                out,
                "vqblk: server cpu {:.3}s (usr {:.3}s, sys {:.3}s), {} us/io [pid {pid}]",
                t.total().as_secs_f64(),
                t.user.as_secs_f64(),
                t.sys.as_secs_f64(),
                per_io(t.total())
            );
        }
        (Some(_), Some(Err(e))) => {
            let _ = writeln!(out, "vqblk: server cpu unavailable: {e}");
        }
        _ => {}
    }
    if let Some(v) = &r.verify {
        let _ = writeln!(
            out,
            "vqblk: verify crc32c: {} blocks checked, {} bad",
            v.blocks_checked, v.errors
        );
        for m in &v.mismatches {
            let _ = writeln!(out, "{m}");
        }
    }
}

/// Serialisable echo of a plan's jobs (for `--parse-only`).
#[derive(Serialize)]
pub struct PlanEcho<'a> {
    /// The jobs as parsed.
    pub jobs: &'a [crate::options::JobSpec],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_reads_like_ctime() {
        let utc = jiff::tz::TimeZone::UTC;
        assert_eq!(ctime_in(1_795_460_062, &utc), "Mon Nov 23 18:54:22 2026");
        assert_eq!(ctime_in(0, &utc), "Thu Jan  1 00:00:00 1970");
        let plus2 = jiff::tz::TimeZone::fixed(jiff::tz::offset(2));
        assert_eq!(ctime_in(0, &plus2), "Thu Jan  1 02:00:00 1970");
        assert_eq!(ctime_in(u64::MAX, &utc), u64::MAX.to_string());
    }

    fn dir(ios: u64) -> DirStats {
        let mut d = DirStats::new();
        for _ in 0..ios {
            d.record(1 << 20, 1000, 2000);
        }
        d
    }

    #[test]
    fn group_status_adds_bandwidth_and_spans_runtimes() {
        let (a, b) = (dir(10), dir(30));
        let mut out = String::new();
        let runs = [(&a, Duration::from_secs(1)), (&b, Duration::from_secs(2))];
        group_status(&mut out, "READ", runs.into_iter());
        // 10 MiB/s + 15 MiB/s, 40 MiB, 1000-2000 ms.
        assert_eq!(
            out,
            "   READ: bw=25MiB/s (26.2MB/s), io=40MiB (41.9MB), run=1000-2000msec\n"
        );
        let none = DirStats::new();
        let mut out = String::new();
        group_status(&mut out, "WRITE", [(&none, Duration::ZERO)].into_iter());
        assert!(out.is_empty());
    }
}
