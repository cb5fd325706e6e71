//! `vqblk sweep`: runs the matrix at every IOThread count and appends each measured
//! run to a JSON Lines file.
//!
//! For each column (native, baseline, each IOThread count) one server is started
//! (`vqblk serve`, or qemu-storage-daemon for `--baseline qemu-storage-daemon`) with
//! as many virtqueues as the largest job count, and every cell runs against it with
//! `vqblk bench`: `warmups` discarded runs, then `repeats` measured ones. Both
//! processes are the running executable itself, so the sweep measures exactly what
//! users run. Native runs `vqblk bench` on the image or device directly.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use vqblk_daemon::size::{parse_size, size_label};

use crate::matrix::{fio_duration, parse_duration, Cell, Matrix, Op, Setup};
use crate::results::{
    Header, Host, Record, Results, Run, RunError, Server, Skip, Storage, Writer, FORMAT,
};

/// What serves the baseline column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BaselineKind {
    /// `vqblk serve --iothreads 1 --poll off`: the classic single-threaded model.
    Vqblk,
    /// The real qemu-storage-daemon: one export, one IOThread, io_uring.
    QemuStorageDaemon,
}

/// Options of `vqblk sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// Raw image file to measure, opened with O_DIRECT (cache none). Write cells
    /// overwrite data inside the file (never beyond its size).
    #[arg(long, value_name = "PATH", conflicts_with_all = ["device", "backend"])]
    pub image: Option<PathBuf>,
    /// With --image: create the image with this size if it does not exist, filled with
    /// data (not sparse: reading holes would never reach the device).
    #[arg(long, value_name = "SIZE", requires = "image")]
    pub create: Option<String>,
    /// Block device to measure (O_DIRECT). Write cells destroy its data: --force required.
    #[arg(long, value_name = "PATH", conflicts_with = "backend")]
    pub device: Option<PathBuf>,
    /// `null`: no storage at all, measures the software path only (no native column).
    #[arg(long, value_parser = ["null"])]
    pub backend: Option<String>,
    /// Size of the null device.
    #[arg(long, default_value = "1G")]
    pub size: String,
    /// `seeds` (the seeds' full matrix), `quick` (minutes on 2 cores) or a TOML file
    /// with keys ops, sizes, jobs, iodepth, iothreads, runtime, ramp-time.
    #[arg(long, default_value = "quick")]
    pub matrix: String,
    /// Measured time per run (default: the matrix's; seeds 30s, quick 1s).
    #[arg(long)]
    pub runtime: Option<String>,
    /// fio ramp_time of every run: I/O not counted (default: the matrix's).
    #[arg(long = "ramp-time")]
    pub ramp_time: Option<String>,
    /// Measured runs per cell and column, averaged.
    #[arg(long, default_value_t = 2)]
    pub repeats: u32,
    /// Discarded warm-up runs per cell and column before the measured ones.
    #[arg(long, default_value_t = 1)]
    pub warmups: u32,
    /// JSON Lines results file, appended to after every measured run. An existing
    /// file resumes the sweep: runs already in it are not measured again.
    #[arg(long, value_name = "FILE")]
    pub results: PathBuf,
    /// What the baseline column runs.
    #[arg(long, value_enum, default_value = "vqblk")]
    pub baseline: BaselineKind,
    /// `--poll` of the IOThread columns (default: the daemon's default).
    #[arg(long)]
    pub poll: Option<String>,
    /// Largest IOThread count measured; larger ones are skipped with a note.
    /// Default: twice the CPUs available.
    #[arg(long)]
    pub max_iothreads: Option<u32>,
    /// Do not measure the native column.
    #[arg(long)]
    pub no_native: bool,
    /// Allow write cells on a block device.
    #[arg(long)]
    pub force: bool,
    /// Print the plan (columns, skips, commands, run count) and exit.
    #[arg(long)]
    pub dry_run: bool,
}

/// The storage under test.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// vqblk's null backend / qemu's null-co.
    Null {
        /// Capacity.
        bytes: u64,
    },
    /// A raw image file.
    Image {
        /// Path.
        path: PathBuf,
        /// Capacity.
        bytes: u64,
    },
    /// A block device.
    Device {
        /// Path.
        path: PathBuf,
        /// Capacity.
        bytes: u64,
    },
}

impl Target {
    /// As recorded in the header.
    pub fn storage(&self) -> Storage {
        match self {
            Target::Null { bytes } => Storage {
                kind: "null".into(),
                path: None,
                bytes: *bytes,
            },
            Target::Image { path, bytes } => Storage {
                kind: "image".into(),
                path: Some(path.clone()),
                bytes: *bytes,
            },
            Target::Device { path, bytes } => Storage {
                kind: "device".into(),
                path: Some(path.clone()),
                bytes: *bytes,
            },
        }
    }
}

/// Everything a sweep will do, decided before anything runs.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The `vqblk` executable used for serve and bench.
    pub exe: PathBuf,
    /// Storage.
    pub target: Target,
    /// Matrix (runtime and ramp already overridden by the flags).
    pub matrix: Matrix,
    /// Warm-up runs.
    pub warmups: u32,
    /// Measured runs.
    pub repeats: u32,
    /// Baseline server.
    pub baseline: BaselineKind,
    /// `--poll` for IOThread columns.
    pub poll: Option<String>,
    /// Columns to measure, in order.
    pub setups: Vec<Setup>,
    /// Columns not measured, with the reason.
    pub skipped: Vec<(Setup, String)>,
    /// The rule for skipping IOThread counts, in words.
    pub skip_rule: String,
    /// Where sockets and server logs go.
    pub work_dir: PathBuf,
}

/// The IOThread counts worth running on `nproc` CPUs: at most `max` (default
/// 2 x nproc: beyond that every IOThread time-shares a CPU with at least two others
/// plus the load generator, and the sweep would measure the scheduler), and at most
/// `queues` (an IOThread without a virtqueue does nothing). Returns (kept, skipped).
pub fn iothread_columns(
    counts: &[u32],
    nproc: u32,
    max: Option<u32>,
    queues: u32,
) -> (Vec<u32>, Vec<(u32, String)>) {
    let limit = max.unwrap_or(2 * nproc.max(1));
    let mut keep = Vec::new();
    let mut skip = Vec::new();
    for &k in counts {
        if k > limit {
            let why = match max {
                Some(m) => format!("skipped: {k} IOThreads > --max-iothreads {m}"),
                None => format!("skipped: {k} IOThreads > 2 x {nproc} CPUs on this host (only time-sharing would be measured)"),
            };
            skip.push((k, why));
        } else if k > queues {
            skip.push((k, format!("skipped: {k} IOThreads > {queues} virtqueues (the extra threads would own no queue)")));
        } else {
            keep.push(k);
        }
    }
    (keep, skip)
}

impl Plan {
    /// Validates the flags and decides the columns.
    pub fn new(args: &SweepArgs, exe: PathBuf, nproc: u32) -> anyhow::Result<Plan> {
        let mut matrix = Matrix::load(&args.matrix)?;
        if let Some(r) = &args.runtime {
            matrix.runtime_s = parse_duration(r).context("--runtime")?;
        }
        if let Some(r) = &args.ramp_time {
            matrix.ramp_s = parse_duration(r).context("--ramp-time")?;
        }
        if matrix.runtime_s <= 0.0 {
            bail!("--runtime: must be > 0");
        }
        if args.repeats == 0 {
            bail!("--repeats: must be at least 1");
        }
        let target = match (&args.image, &args.device, &args.backend) {
            (Some(p), None, None) => {
                if !p.exists() {
                    let Some(sz) = &args.create else {
                        bail!(
                            "--image {}: does not exist (add --create SIZE to make one)",
                            p.display()
                        );
                    };
                    let bytes = parse_size(sz).context("--create")?;
                    create_image(p, bytes).with_context(|| format!("--create: {}", p.display()))?;
                }
                let meta =
                    std::fs::metadata(p).with_context(|| format!("--image {}", p.display()))?;
                if !meta.is_file() {
                    bail!(
                        "--image {}: not a regular file (use --device for a block device)",
                        p.display()
                    );
                }
                Target::Image {
                    path: p.canonicalize()?,
                    bytes: meta.len(),
                }
            }
            (None, Some(p), None) => {
                let mut f = File::open(p).with_context(|| format!("--device {}", p.display()))?;
                let bytes = f.seek(SeekFrom::End(0))?;
                if matrix.ops.iter().any(|o| o.writes()) && !args.force {
                    bail!(
                        "--device {}: the matrix has write cells, which overwrite the device's data; \
                         add --force if that is intended",
                        p.display()
                    );
                }
                Target::Device {
                    path: p.clone(),
                    bytes,
                }
            }
            (None, None, Some(_)) => Target::Null {
                bytes: parse_size(&args.size).context("--size")?,
            },
            _ => bail!("give the storage: --image PATH, --device PATH or --backend null"),
        };
        let bytes = match &target {
            Target::Null { bytes } | Target::Image { bytes, .. } | Target::Device { bytes, .. } => {
                *bytes
            }
        };
        let largest = matrix.sizes.iter().max().copied().unwrap_or(4096);
        if bytes < largest * u64::from(matrix.queues()) {
            bail!(
                "storage of {bytes} bytes is too small for {} jobs of {}",
                matrix.queues(),
                size_label(largest)
            );
        }
        let mut setups = Vec::new();
        let mut skipped = Vec::new();
        match (&target, args.no_native) {
            (Target::Null { .. }, _) => skipped.push((
                Setup::Native,
                "n/a: the null backend has no native equivalent (nothing to run fio on without virtualization)".to_string(),
            )),
            (_, true) => skipped.push((Setup::Native, "skipped: --no-native".to_string())),
            _ => setups.push(Setup::Native),
        }
        if matrix.baseline {
            setups.push(Setup::Baseline);
        }
        let (keep, skip) = iothread_columns(
            &matrix.iothreads,
            nproc,
            args.max_iothreads,
            matrix.queues(),
        );
        setups.extend(keep.into_iter().map(Setup::IoThreads));
        skipped.extend(skip.into_iter().map(|(k, why)| (Setup::IoThreads(k), why)));
        let skip_rule = match args.max_iothreads {
            Some(m) => format!("IOThread counts above --max-iothreads {m} or above the virtqueue count are skipped"),
            None => format!(
                "IOThread counts above 2 x nproc ({}) or above the virtqueue count ({}) are skipped",
                2 * nproc,
                matrix.queues()
            ),
        };
        let work_dir = std::env::temp_dir().join(format!("vqblk-sweep-{}", std::process::id()));
        Ok(Plan {
            exe,
            target,
            matrix,
            warmups: args.warmups,
            repeats: args.repeats,
            baseline: args.baseline,
            poll: args.poll.clone(),
            setups,
            skipped,
            skip_rule,
            work_dir,
        })
    }

    fn socket(&self) -> PathBuf {
        self.work_dir.join("disk.sock")
    }

    /// The server command line of a column (None for native).
    pub fn server_argv(&self, setup: Setup) -> Option<Vec<String>> {
        let queues = self.matrix.queues().to_string();
        let sock = self.socket().display().to_string();
        let qsd = setup == Setup::Baseline && self.baseline == BaselineKind::QemuStorageDaemon;
        if qsd {
            let blockdev = match &self.target {
                Target::Null { bytes } => {
                    format!("driver=null-co,node-name=d,size={bytes},read-zeroes=on")
                }
                Target::Image { path, .. } => format!(
                    "driver=file,node-name=d,filename={},cache.direct=on,aio=io_uring",
                    path.display()
                ),
                Target::Device { path, .. } => format!(
                    "driver=host_device,node-name=d,filename={},cache.direct=on,aio=io_uring",
                    path.display()
                ),
            };
            return Some(vec![
                "qemu-storage-daemon".into(),
                "--blockdev".into(),
                blockdev,
                "--object".into(),
                "iothread,id=iot0".into(),
                "--export".into(),
                format!(
                    "type=vhost-user-blk,id=e,node-name=d,addr.type=unix,addr.path={sock},writable=on,num-queues={queues},iothread=iot0"
                ),
            ]);
        }
        let (threads, poll) = match setup {
            Setup::Native => return None,
            Setup::Baseline => (1, Some("off".to_string())),
            Setup::IoThreads(k) => (k, self.poll.clone()),
        };
        let mut v: Vec<String> = vec![self.exe.display().to_string(), "serve".into()];
        match &self.target {
            Target::Null { bytes } => v.extend([
                "--backend".into(),
                "null".into(),
                "--size".into(),
                bytes.to_string(),
            ]),
            Target::Image { path, .. } | Target::Device { path, .. } => v.extend([
                "--image".into(),
                path.display().to_string(),
                "--cache".into(),
                "none".into(),
            ]),
        }
        v.extend([
            "--socket".into(),
            sock,
            "--queues".into(),
            queues,
            "--iothreads".into(),
            threads.to_string(),
        ]);
        if let Some(p) = poll {
            v.extend(["--poll".into(), p]);
        }
        v.extend(["--log-level".into(), "warn".into()]);
        Some(v)
    }

    /// The `vqblk bench` command line of one cell in one column.
    pub fn bench_argv(&self, cell: &Cell, setup: Setup, server_pid: Option<u32>) -> Vec<String> {
        let target = match (setup, &self.target) {
            (Setup::Native, Target::Image { path, .. }) => format!("file:{}", path.display()),
            (Setup::Native, Target::Device { path, .. }) => format!("dev:{}", path.display()),
            _ => format!("unix:{}", self.socket().display()),
        };
        let mut v: Vec<String> = vec![
            self.exe.display().to_string(),
            "bench".into(),
            "--target".into(),
            target,
            "--name".into(),
            "sweep".into(),
            "--rw".into(),
            cell.op.name().into(),
            "--bs".into(),
            cell.bs.to_string(),
            "--numjobs".into(),
            cell.jobs.to_string(),
            "--iodepth".into(),
            cell.iodepth.to_string(),
            "--runtime".into(),
            fio_duration(self.matrix.runtime_s),
        ];
        if self.matrix.ramp_s > 0.0 {
            v.extend(["--ramp_time".into(), fio_duration(self.matrix.ramp_s)]);
        }
        v.extend([
            "--time_based".into(),
            "--group_reporting".into(),
            "--output-format".into(),
            "json".into(),
        ]);
        if let Some(pid) = server_pid {
            v.extend(["--server-pid".into(), pid.to_string()]);
        }
        v
    }

    /// Command templates for the header.
    pub fn command_templates(&self) -> BTreeMap<String, String> {
        let cell = Cell {
            bs: 4096,
            op: Op::Randread,
            jobs: 1,
            iodepth: 1,
        };
        let mut m = BTreeMap::new();
        let k = self
            .setups
            .iter()
            .find_map(|s| s.count().filter(|&k| k > 0))
            .unwrap_or(1);
        if let Some(a) = self.server_argv(Setup::IoThreads(k)) {
            m.insert(
                "serve".into(),
                shell_join(&a).replace(&format!("--iothreads {k}"), "--iothreads K"),
            );
        }
        if let Some(a) = self.server_argv(Setup::Baseline) {
            m.insert("baseline".into(), shell_join(&a));
        }
        let pattern = |a: Vec<String>| {
            shell_join(&a)
                .replace("--rw randread", "--rw OP")
                .replace("--bs 4096", "--bs BS")
                .replace("--numjobs 1", "--numjobs JOBS")
                .replace("--iodepth 1 ", "--iodepth DEPTH ")
                .replace("--server-pid 0", "--server-pid SERVER_PID")
        };
        m.insert(
            "bench".into(),
            pattern(self.bench_argv(&cell, Setup::Baseline, Some(0))),
        );
        if self.setups.contains(&Setup::Native) {
            m.insert(
                "native".into(),
                pattern(self.bench_argv(&cell, Setup::Native, None)),
            );
        }
        m
    }

    /// Seconds one run is expected to take (runtime, ramp, and process start-up).
    pub fn run_estimate_s(&self) -> f64 {
        self.matrix.runtime_s + self.matrix.ramp_s + 0.05
    }
}

/// Quotes a command line for a shell when needed.
pub fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Creates an image of `bytes` filled with non-zero data, so that reads reach the
/// device (a sparse file's holes are answered by the filesystem without I/O).
fn create_image(path: &Path, bytes: u64) -> anyhow::Result<()> {
    let mut f = File::create_new(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(())
}

/// Facts about this host for the header.
pub fn host_info() -> Host {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let cpuinfo = read("/proc/cpuinfo");
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    Host {
        nproc: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        cpu_model,
        kernel: read("/proc/sys/kernel/osrelease"),
        hostname: read("/proc/sys/kernel/hostname"),
    }
}

/// UTC now as RFC 3339 (seconds).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs)
}

/// Unix seconds -> `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian, Hinnant's algorithm).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

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

/// A running server.
struct ServerProc {
    child: Child,
    log: PathBuf,
}

impl ServerProc {
    fn start(argv: &[String], socket: &Path, log: &Path) -> anyhow::Result<ServerProc> {
        let _ = std::fs::remove_file(socket);
        let out = File::create(log)?;
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {}", argv[0]))?;
        let mut s = ServerProc {
            child,
            log: log.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = s.child.try_wait()? {
                bail!(
                    "{} exited ({st}) before listening:\n{}",
                    argv[0],
                    s.log_tail()
                );
            }
            if socket.exists() {
                return Ok(s);
            }
            if Instant::now() > deadline {
                s.stop();
                bail!(
                    "{} did not create {} within 20 s:\n{}",
                    argv[0],
                    socket.display(),
                    s.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGTERM (clean exit: drain, sync), SIGKILL after 15 s.
    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st);
        }
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs a command with a time limit; returns stdout, or an error with stderr.
fn run_with_timeout(argv: &[String], limit: Duration) -> anyhow::Result<String> {
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", argv[0]))?;
    let mut so = child.stdout.take().expect("piped");
    let mut se = child.stderr.take().expect("piped");
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = t_out.join().unwrap_or_default();
    let err = t_err.join().unwrap_or_default();
    match status {
        None => bail!("timed out after {} s: {}", limit.as_secs(), err.trim()),
        Some(st) if !st.success() => bail!("{st}: {}", err.trim()),
        Some(_) => Ok(out),
    }
}

/// The progress line: a bar with ETA on a terminal, one line per cell otherwise.
struct Progress {
    total: usize,
    done: usize,
    started: Instant,
    estimate_s: f64,
    tty: bool,
}

impl Progress {
    fn eta(&self) -> Duration {
        let left = (self.total - self.done) as f64;
        let per = if self.done > 0 {
            self.started.elapsed().as_secs_f64() / self.done as f64
        } else {
            self.estimate_s
        };
        Duration::from_secs_f64(left * per)
    }

    fn tick(&mut self, what: &str) {
        self.done += 1;
        if self.tty {
            let width = 30;
            let filled = (self.done * width).checked_div(self.total).unwrap_or(width);
            eprint!(
                "\r\x1b[K[{}{}] {}/{} runs  ETA {}  {what}",
                "#".repeat(filled),
                "-".repeat(width - filled),
                self.done,
                self.total,
                hms(self.eta())
            );
            let _ = std::io::stderr().flush();
        }
    }

    fn line(&self, msg: &str) {
        if self.tty {
            eprint!("\r\x1b[K");
        }
        eprintln!("{msg}");
    }
}

/// `1h02m03s`, `4m05s`, `7s`.
pub fn hms(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}

/// A cell still to measure in one column, with the run indexes missing.
type Pending = (Cell, Vec<u32>);

/// `vqblk sweep`.
pub fn run(args: SweepArgs) -> anyhow::Result<i32> {
    let exe = std::env::current_exe().context("cannot locate the vqblk executable")?;
    let host = host_info();
    let plan = Plan::new(&args, exe, host.nproc)?;
    let cells = plan.matrix.cells();

    let existing = if args.results.exists() {
        Results::read(&args.results)?
    } else {
        Results::default()
    };
    let storage = plan.target.storage();
    if let Some(h) = existing.header() {
        if h.storage != storage {
            bail!(
                "--results {}: holds a sweep of {}, not {}; use another results file",
                args.results.display(),
                h.storage.describe(),
                storage.describe()
            );
        }
        if (h.runtime_s - plan.matrix.runtime_s).abs() > 1e-9
            || (h.ramp_s - plan.matrix.ramp_s).abs() > 1e-9
        {
            bail!(
                "--results {}: its runs lasted {} s (ramp {} s), not {} s (ramp {} s); use another results file",
                args.results.display(),
                h.runtime_s,
                h.ramp_s,
                plan.matrix.runtime_s,
                plan.matrix.ramp_s
            );
        }
    }
    let done = existing.done();
    // Per column: the cells still to measure, with the run indexes missing.
    let mut todo: Vec<(Setup, Vec<Pending>)> = Vec::new();
    for &s in &plan.setups {
        let mut v = Vec::new();
        for c in &cells {
            let have = done.get(&(*c, s));
            let missing: Vec<u32> = (1..=plan.repeats)
                .filter(|i| !have.is_some_and(|h| h.contains(i)))
                .collect();
            if !missing.is_empty() {
                v.push((*c, missing));
            }
        }
        if !v.is_empty() {
            todo.push((s, v));
        }
    }
    let total_runs: usize = todo
        .iter()
        .flat_map(|(_, v)| v.iter().map(|(_, m)| m.len() + plan.warmups as usize))
        .sum();
    let already = existing.runs.len();

    let tty = std::io::stderr().is_terminal();
    let est = Duration::from_secs_f64(total_runs as f64 * plan.run_estimate_s());
    eprintln!(
        "vqblk sweep: {} cells x columns [{}]; {} runs to do ({} warm-up per cell, {} measured){}; about {}",
        cells.len(),
        plan.setups.iter().map(|s| s.label()).collect::<Vec<_>>().join(", "),
        total_runs,
        plan.warmups,
        plan.repeats,
        if already > 0 { format!(", {already} runs already in the results file") } else { String::new() },
        hms(est)
    );
    for (s, why) in &plan.skipped {
        eprintln!("vqblk sweep: {s}: {why}");
    }
    if args.dry_run {
        for (k, v) in plan.command_templates() {
            println!("{k}: {v}");
        }
        return Ok(0);
    }

    std::fs::create_dir_all(&plan.work_dir)?;
    let mut w = Writer::open(&args.results)?;
    let version = Command::new(&plan.exe)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    w.write(&Record::Header(Box::new(Header {
        format: FORMAT,
        vqblk_version: version,
        started: utc_now(),
        argv: std::env::args().collect(),
        host,
        storage,
        baseline: match plan.baseline {
            BaselineKind::Vqblk => "vqblk serve --iothreads 1 --poll off".into(),
            BaselineKind::QemuStorageDaemon => "qemu-storage-daemon".into(),
        },
        matrix: plan.matrix.clone(),
        queues: plan.matrix.queues(),
        runtime_s: plan.matrix.runtime_s,
        ramp_s: plan.matrix.ramp_s,
        warmups: plan.warmups,
        repeats: plan.repeats,
        skip_rule: plan.skip_rule.clone(),
        commands: plan.command_templates(),
    })))?;
    for (s, why) in &plan.skipped {
        if !existing
            .skips
            .iter()
            .any(|o| o.setup == s.label() && &o.reason == why)
        {
            w.write(&Record::Skip(Skip {
                setup: s.label(),
                iothreads: s.count(),
                reason: why.clone(),
            }))?;
        }
    }

    let mut progress = Progress {
        total: total_runs,
        done: 0,
        started: Instant::now(),
        estimate_s: plan.run_estimate_s(),
        tty,
    };
    let t0 = Instant::now();
    let limit = Duration::from_secs_f64(plan.matrix.runtime_s + plan.matrix.ramp_s + 90.0);
    let mut failures = 0usize;
    let mut retried = 0usize;
    for (setup, cells) in &todo {
        let start_server = |w: &mut Writer| -> anyhow::Result<Option<ServerProc>> {
            let Some(argv) = plan.server_argv(*setup) else {
                return Ok(None);
            };
            let log = plan
                .work_dir
                .join(format!("{}.log", setup.label().replace('=', "-")));
            let s = ServerProc::start(&argv, &plan.socket(), &log)?;
            w.write(&Record::Server(Server {
                setup: setup.label(),
                iothreads: setup.count().unwrap_or(0),
                argv,
                pid: s.pid(),
            }))?;
            Ok(Some(s))
        };
        let mut server = match start_server(&mut w) {
            Ok(s) => s,
            Err(e) => {
                progress.line(&format!("vqblk sweep: {setup}: {e:#}; column skipped"));
                w.write(&Record::Skip(Skip {
                    setup: setup.label(),
                    iothreads: setup.count(),
                    reason: format!("server failed to start: {e:#}"),
                }))?;
                failures += 1;
                for (_, missing) in cells {
                    for _ in 0..(missing.len() + plan.warmups as usize) {
                        progress.tick("");
                    }
                }
                continue;
            }
        };
        for (cell, missing) in cells {
            let what = format!("{setup} {cell}");
            let mut sum = 0.0;
            let mut n = 0;
            let runs: Vec<Option<u32>> = (0..plan.warmups)
                .map(|_| None)
                .chain(missing.iter().map(|&i| Some(i)))
                .collect();
            for idx in runs {
                // A failed run is recorded and retried once: a transient failure (the
                // host is shared) costs a retry, a persistent one a missing value.
                let mut attempt = 0;
                let outcome = loop {
                    attempt += 1;
                    // A server that died is restarted.
                    if let Some(s) = server.as_mut() {
                        if !s.alive() {
                            progress.line(&format!(
                                "vqblk sweep: {setup}: server died:\n{}\nrestarting",
                                s.log_tail()
                            ));
                            drop(server.take());
                            server = start_server(&mut w)?;
                        }
                    }
                    let argv = plan.bench_argv(cell, *setup, server.as_ref().map(ServerProc::pid));
                    match run_with_timeout(&argv, limit)
                        .and_then(|out| parse_bench_json(&out, cell.op))
                    {
                        Ok(m) => break Some((m, argv)),
                        Err(e) => {
                            let mut msg = format!("{e:#}");
                            if let Some(s) = &server {
                                let tail = s.log_tail();
                                let last: Vec<&str> = tail.lines().rev().take(5).collect();
                                if !last.is_empty() {
                                    let last: Vec<&str> = last.into_iter().rev().collect();
                                    msg = format!("{msg} [server log: {}]", last.join(" | "));
                                }
                            }
                            let retry = attempt < 2;
                            progress.line(&format!(
                                "vqblk sweep: {what}: run failed (attempt {attempt}{}): {msg}",
                                if retry { ", retrying" } else { ", giving up" }
                            ));
                            w.write(&Record::Error(RunError {
                                cell: *cell,
                                setup: setup.label(),
                                iothreads: setup.count(),
                                message: format!("attempt {attempt}: {msg}"),
                            }))?;
                            if !retry {
                                break None;
                            }
                            retried += 1;
                        }
                    }
                };
                progress.tick(&what);
                match (outcome, idx) {
                    (Some(_), None) => {}
                    (Some((m, argv)), Some(i)) => {
                        let mb_s = m.bw_bytes / 1e6;
                        sum += mb_s;
                        n += 1;
                        let pct = m
                            .server_cpu_s
                            .filter(|_| m.elapsed_s > 0.0)
                            .map(|c| c / m.elapsed_s * 100.0);
                        w.write(&Record::Run(Box::new(Run {
                            cell: *cell,
                            setup: setup.label(),
                            iothreads: setup.count(),
                            run: i,
                            iops: m.iops,
                            bw_bytes: m.bw_bytes,
                            mb_s,
                            p50_us: m.p50_us,
                            p99_us: m.p99_us,
                            server_cpu_s: m.server_cpu_s,
                            server_cpu_pct: pct,
                            elapsed_s: m.elapsed_s,
                            time: utc_now(),
                            argv,
                        })))?;
                    }
                    (None, _) => failures += 1,
                }
            }
            if !tty && n > 0 {
                progress.line(&format!(
                    "vqblk sweep: {what}: {:.1} MB/s ({n} runs) [{}/{} runs, ETA {}]",
                    sum / n as f64,
                    progress.done,
                    progress.total,
                    hms(progress.eta())
                ));
            }
        }
        if let Some(mut s) = server.take() {
            match s.stop() {
                Some(st) if st.success() => {}
                st => progress.line(&format!(
                    "vqblk sweep: {setup}: server exit {st:?}:\n{}",
                    s.log_tail()
                )),
            }
        }
    }
    if tty {
        eprintln!();
    }
    if failures + retried == 0 {
        let _ = std::fs::remove_dir_all(&plan.work_dir);
    } else {
        eprintln!(
            "vqblk sweep: server logs kept in {}",
            plan.work_dir.display()
        );
    }
    eprintln!(
        "vqblk sweep: done in {}: {} runs, {retried} retried, {failures} failed for good; results in {}",
        hms(t0.elapsed()),
        progress.done,
        args.results.display()
    );
    Ok(if failures > 0 { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        a: SweepArgs,
    }

    fn args(extra: &[&str]) -> SweepArgs {
        let mut v = vec!["sweep", "--results", "/dev/null"];
        v.extend_from_slice(extra);
        P::try_parse_from(v).unwrap().a
    }

    #[test]
    fn skip_rule() {
        let (keep, skip) = iothread_columns(&[1, 2, 3, 4, 6, 8, 12, 16], 2, None, 16);
        assert_eq!(keep, vec![1, 2, 3, 4]);
        assert_eq!(skip.len(), 4);
        assert!(skip[0].1.contains("2 x 2 CPUs"));
        let (keep, skip) = iothread_columns(&[1, 2, 8], 64, None, 4);
        assert_eq!(keep, vec![1, 2]);
        assert!(skip[0].1.contains("virtqueues"));
        let (keep, _) = iothread_columns(&[1, 2, 8], 2, Some(8), 16);
        assert_eq!(keep, vec![1, 2, 8]);
    }

    #[test]
    fn null_plan_has_no_native_and_the_baseline_is_poll_off() {
        let p = Plan::new(&args(&["--backend", "null"]), "/x/vqblk".into(), 2).unwrap();
        assert_eq!(
            p.setups,
            vec![
                Setup::Baseline,
                Setup::IoThreads(1),
                Setup::IoThreads(2),
                Setup::IoThreads(4)
            ]
        );
        assert_eq!(p.skipped[0].0, Setup::Native);
        assert!(p.skipped[0].1.starts_with("n/a"));
        let b = shell_join(&p.server_argv(Setup::Baseline).unwrap());
        assert!(
            b.starts_with("/x/vqblk serve --backend null --size 1073741824 --socket "),
            "{b}"
        );
        assert!(b.contains("--queues 4 --iothreads 1 --poll off"), "{b}");
        let s = shell_join(&p.server_argv(Setup::IoThreads(2)).unwrap());
        assert!(s.contains("--iothreads 2") && !s.contains("--poll"), "{s}");
        let cell = Cell {
            bs: 4096,
            op: Op::Randwrite,
            jobs: 4,
            iodepth: 16,
        };
        let bench = shell_join(&p.bench_argv(&cell, Setup::IoThreads(2), Some(42)));
        assert!(bench.contains("--rw randwrite --bs 4096 --numjobs 4 --iodepth 16 --runtime 1000ms --ramp_time 250ms --time_based --group_reporting --output-format json --server-pid 42"), "{bench}");
        let t = p.command_templates();
        assert!(t["serve"].contains("--iothreads K"), "{}", t["serve"]);
        assert!(
            t["bench"].contains("--rw OP --bs BS --numjobs JOBS --iodepth DEPTH"),
            "{}",
            t["bench"]
        );
        assert!(!t.contains_key("native"));
    }

    #[test]
    fn qsd_baseline_command() {
        let p = Plan::new(
            &args(&["--backend", "null", "--baseline", "qemu-storage-daemon"]),
            "/x/vqblk".into(),
            2,
        )
        .unwrap();
        let q = p.server_argv(Setup::Baseline).unwrap();
        assert_eq!(q[0], "qemu-storage-daemon");
        assert_eq!(
            q[2],
            "driver=null-co,node-name=d,size=1073741824,read-zeroes=on"
        );
        assert!(q[6].ends_with("writable=on,num-queues=4,iothread=iot0"));
    }

    #[test]
    fn image_plan_runs_native_on_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("d.raw");
        let e = Plan::new(
            &args(&["--image", img.to_str().unwrap()]),
            "/x/vqblk".into(),
            2,
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("--create"));
        let p = Plan::new(
            &args(&["--image", img.to_str().unwrap(), "--create", "8m"]),
            "/x/vqblk".into(),
            2,
        )
        .unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 8 << 20);
        let data = std::fs::read(&img).unwrap();
        assert!(
            data.iter().filter(|&&b| b == 0).count() < data.len() / 10,
            "filled, not sparse"
        );
        assert_eq!(p.setups[0], Setup::Native);
        let cell = Cell {
            bs: 4096,
            op: Op::Read,
            jobs: 1,
            iodepth: 1,
        };
        let n = p.bench_argv(&cell, Setup::Native, None);
        assert_eq!(
            n[3],
            format!("file:{}", img.canonicalize().unwrap().display())
        );
        let s = shell_join(&p.server_argv(Setup::IoThreads(1)).unwrap());
        assert!(s.contains("--cache none"), "{s}");
        let e = Plan::new(
            &args(&[
                "--image",
                img.to_str().unwrap(),
                "--size",
                "1G",
                "--matrix",
                "seeds",
            ]),
            "/x/vqblk".into(),
            2,
        );
        assert!(format!("{:#}", e.unwrap_err()).contains("too small"));
    }

    #[test]
    fn flags_are_validated() {
        let e = |a: &[&str]| format!("{:#}", Plan::new(&args(a), "/x".into(), 2).unwrap_err());
        assert!(e(&[]).contains("--image PATH, --device PATH or --backend null"));
        assert!(e(&["--backend", "null", "--repeats", "0"]).contains("--repeats"));
        assert!(e(&["--backend", "null", "--runtime", "abc"]).contains("--runtime"));
        assert!(e(&["--backend", "null", "--matrix", "/nonexistent.toml"]).contains("--matrix"));
    }

    #[test]
    fn bench_json_is_read() {
        let text = r#"{"jobs":[{"error":0,"read":{"iops":1000.0,"bw_bytes":4096000,"runtime":1000,
            "clat_ns":{"percentile":{"50.000000":12000,"99.000000":50000}}},"write":{"iops":0,"bw_bytes":0}}],
            "vqblk":{"elapsed_s":1.0,"server_cpu_s":0.5}}"#;
        let m = parse_bench_json(text, Op::Randread).unwrap();
        assert_eq!(
            (m.iops, m.bw_bytes, m.p50_us, m.p99_us, m.server_cpu_s),
            (1000.0, 4096000.0, Some(12.0), Some(50.0), Some(0.5))
        );
        assert_eq!(parse_bench_json(text, Op::Write).unwrap().bw_bytes, 0.0);
        assert!(parse_bench_json("{\"jobs\":[]}", Op::Read).is_err());
        assert!(
            parse_bench_json(r#"{"jobs":[{"error":1,"error_text":"EIO"}]}"#, Op::Read)
                .unwrap_err()
                .to_string()
                .contains("EIO")
        );
    }

    #[test]
    fn time_formats() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_304_876), "2026-11-21T23:47:56Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(hms(Duration::from_secs(7)), "7s");
        assert_eq!(hms(Duration::from_secs(245)), "4m05s");
        assert_eq!(hms(Duration::from_secs(3723)), "1h02m03s");
    }
}
