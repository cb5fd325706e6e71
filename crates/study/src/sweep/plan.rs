//! The plan of a sweep: the storage, the matrix, the columns to measure and the
//! command line of every server and bench run, all decided before anything runs.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use vqblk_daemon::cli::ServeCommand;
use vqblk_daemon::config::{BackendKind, CacheMode};
use vqblk_daemon::poll::PollMode;
use vqblk_daemon::size::{parse_size, size_label};

use super::host::create_image;
use super::{BaselineKind, SweepArgs};
use crate::matrix::{
    fio_duration, parse_duration, Cell, Matrix, Op, Setup, AUTO_RAMP_S, AUTO_WARMUP_RAMP_S,
};
use crate::results::Storage;

/// The storage under test.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// vqblk's null backend / qemu's null-co.
    Null {
        /// Capacity.
        bytes: u64,
        /// Completion delay of every request (`--latency-ns`; None: none).
        latency_ns: Option<u64>,
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
    /// An RBD image on a Ceph cluster (`$CEPH_CONF` says which).
    Rbd {
        /// `POOL/[NAMESPACE/]IMAGE`.
        spec: String,
        /// Capacity.
        bytes: u64,
    },
}

impl Target {
    /// As recorded in the header.
    pub fn storage(&self) -> Storage {
        let (kind, path) = match self {
            Target::Null { .. } => ("null", None),
            Target::Image { path, .. } => ("image", Some(path.clone())),
            Target::Device { path, .. } => ("device", Some(path.clone())),
            Target::Rbd { spec, .. } => ("rbd", Some(PathBuf::from(format!("rbd:{spec}")))),
        };
        Storage {
            kind: kind.into(),
            path,
            bytes: self.bytes(),
            latency_ns: match self {
                Target::Null { latency_ns, .. } => *latency_ns,
                _ => None,
            },
        }
    }

    /// Capacity in bytes.
    pub fn bytes(&self) -> u64 {
        match self {
            Target::Null { bytes, .. }
            | Target::Image { bytes, .. }
            | Target::Device { bytes, .. }
            | Target::Rbd { bytes, .. } => *bytes,
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
    pub poll: Option<PollMode>,
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

/// The matrix named by `--matrix`, with `--runtime` and `--ramp-time` applied.
fn matrix_of(args: &SweepArgs) -> anyhow::Result<Matrix> {
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
    Ok(matrix)
}

/// `--image rbd:POOL/IMAGE`: an existing RBD image, its size asked of the
/// cluster (`$CEPH_CONF`) through the daemon's librbd loader.
fn rbd_target(image: &str, create: Option<&str>) -> anyhow::Result<Target> {
    use vqblk_daemon::block::rbd::{ClientConfig, RbdImage, RbdSpec, DEFAULT_OP_TIMEOUT_S};
    if create.is_some() {
        bail!("--create: not for RBD images (make one with `rbd create --size SIZE POOL/IMAGE`)");
    }
    let spec = RbdSpec::parse(image).map_err(|m| anyhow::anyhow!("--image: {m}"))?;
    let client = ClientConfig {
        conf: None,
        id: None,
        op_timeout_s: DEFAULT_OP_TIMEOUT_S,
        rbd_cache: false,
    };
    let img = RbdImage::open(&spec, &client, true).map_err(|e| anyhow::anyhow!("--image: {e}"))?;
    if spec.snap.is_some() {
        bail!("--image {spec}: a snapshot is read-only; the sweep needs the image itself");
    }
    let rest = spec.to_string();
    Ok(Target::Rbd {
        spec: rest.trim_start_matches("rbd:").to_string(),
        bytes: img.size,
    })
}

/// `--image PATH` (created with `--create SIZE` if missing).
fn image_target(path: &Path, create: Option<&str>) -> anyhow::Result<Target> {
    if vqblk_daemon::block::rbd::is_rbd_image(path) {
        return rbd_target(&path.to_string_lossy(), create);
    }
    if !path.exists() {
        let Some(sz) = create else {
            bail!(
                "--image {}: does not exist (add --create SIZE to make one)",
                path.display()
            );
        };
        let bytes = parse_size(sz).context("--create")?;
        create_image(path, bytes).with_context(|| format!("--create: {}", path.display()))?;
    }
    let meta = std::fs::metadata(path).with_context(|| format!("--image {}", path.display()))?;
    if !meta.is_file() {
        bail!(
            "--image {}: not a regular file (use --device for a block device)",
            path.display()
        );
    }
    Ok(Target::Image {
        path: path.canonicalize()?,
        bytes: meta.len(),
    })
}

/// qemu-storage-daemon's `--blockdev` for an RBD image: its own rbd driver,
/// librbd's cache off (cache.direct=on, like vqblk's cache=none), the
/// configuration of `$CEPH_CONF` when set.
pub(crate) fn qsd_rbd_blockdev(spec: &str) -> String {
    let (pool, rest) = spec.split_once('/').unwrap_or((spec, ""));
    let (ns, image) = match rest.split_once('/') {
        Some((ns, image)) => (Some(ns), image),
        None => (None, rest),
    };
    let mut s = format!("driver=rbd,node-name=d,pool={pool},image={image},cache.direct=on");
    if let Some(ns) = ns {
        s += &format!(",namespace={ns}");
    }
    if let Some(conf) = std::env::var_os("CEPH_CONF") {
        s += &format!(",conf={}", conf.to_string_lossy());
    }
    s
}

/// `--device PATH`: write cells need `--force`.
fn device_target(path: &Path, matrix: &Matrix, force: bool) -> anyhow::Result<Target> {
    let mut f = File::open(path).with_context(|| format!("--device {}", path.display()))?;
    let bytes = f.seek(SeekFrom::End(0))?;
    if matrix.ops.iter().any(|o| o.writes()) && !force {
        bail!(
            "--device {}: the matrix has write cells, which overwrite the device's data; \
             add --force if that is intended",
            path.display()
        );
    }
    Ok(Target::Device {
        path: path.to_path_buf(),
        bytes,
    })
}

/// The storage the flags name, checked to be large enough for the matrix.
fn target_of(args: &SweepArgs, matrix: &Matrix) -> anyhow::Result<Target> {
    let target = match (&args.image, &args.device, &args.backend) {
        (Some(p), None, None) => image_target(p, args.create.as_deref())?,
        (None, Some(p), None) => device_target(p, matrix, args.force)?,
        (None, None, Some(_)) => Target::Null {
            bytes: parse_size(&args.size).context("--size")?,
            latency_ns: args.latency_ns.filter(|&n| n > 0),
        },
        _ => bail!("give the storage: --image PATH, --device PATH or --backend null"),
    };
    let largest = matrix.sizes.iter().max().copied().unwrap_or(4096);
    if target.bytes() < largest * u64::from(matrix.queues()) {
        bail!(
            "storage of {} bytes is too small for {} jobs of {}",
            target.bytes(),
            matrix.queues(),
            size_label(largest)
        );
    }
    Ok(target)
}

/// The columns to measure and the ones skipped, with the reason.
fn columns(
    args: &SweepArgs,
    target: &Target,
    matrix: &Matrix,
    nproc: u32,
) -> (Vec<Setup>, Vec<(Setup, String)>) {
    let mut setups = Vec::new();
    let mut skipped = Vec::new();
    match (target, args.no_native) {
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
    if matrix.auto {
        setups.push(Setup::Auto);
    }
    (setups, skipped)
}

/// The skip rule of [`iothread_columns`] in words, for the header.
fn skip_rule(max_iothreads: Option<u32>, nproc: u32, queues: u32) -> String {
    match max_iothreads {
        Some(m) => format!(
            "IOThread counts above --max-iothreads {m} or above the virtqueue count are skipped"
        ),
        None => format!(
            "IOThread counts above 2 x nproc ({}) or above the virtqueue count ({queues}) are skipped",
            2 * nproc
        ),
    }
}

impl Plan {
    /// Validates the flags and decides the columns; `exe` is the `vqblk` that serves
    /// and benches.
    pub fn new(args: &SweepArgs, exe: PathBuf, nproc: u32) -> anyhow::Result<Plan> {
        let matrix = matrix_of(args)?;
        if args.repeats == 0 {
            bail!("--repeats: must be at least 1");
        }
        let target = target_of(args, &matrix)?;
        let (setups, skipped) = columns(args, &target, &matrix, nproc);
        let skip_rule = skip_rule(args.max_iothreads, nproc, matrix.queues());
        let work_dir = std::env::temp_dir().join(format!("vqblk-sweep-{}", std::process::id()));
        Ok(Plan {
            exe,
            target,
            matrix,
            warmups: args.warmups,
            repeats: args.repeats,
            baseline: args.baseline,
            poll: args.poll,
            setups,
            skipped,
            skip_rule,
            work_dir,
        })
    }

    /// The file name stem of a column's socket and server log: its label, which
    /// names it in the results, without the `=` a shell would trip on.
    pub fn file_stem(setup: Setup) -> String {
        setup.label().replace('=', "-")
    }

    /// The vhost-user socket the server of a column listens on: one per column,
    /// since every column's server runs for the whole sweep.
    pub fn socket(&self, setup: Setup) -> PathBuf {
        self.work_dir
            .join(format!("{}.sock", Self::file_stem(setup)))
    }

    /// The control socket of the `auto` column's server, through which the sweep
    /// records what its controller did in each run.
    pub fn control_socket(&self) -> PathBuf {
        self.work_dir
            .join(format!("{}.ctl", Self::file_stem(Setup::Auto)))
    }

    /// The `--stats-file` of a column's vqblk server: the bench reads its
    /// IOThreads' counters before and after each run (`--server-stats`).
    pub fn stats_file(&self, setup: Setup) -> PathBuf {
        self.work_dir
            .join(format!("{}.stats.json", Self::file_stem(setup)))
    }

    /// The `vqblk serve` of a column (None for native and a qemu-storage-daemon
    /// baseline).
    pub fn serve_command(&self, setup: Setup) -> Option<ServeCommand> {
        let (threads, poll) = match setup {
            Setup::Native => return None,
            Setup::Baseline if self.baseline == BaselineKind::QemuStorageDaemon => return None,
            Setup::Baseline => (Some(1), Some(PollMode::Off)),
            Setup::IoThreads(k) => (Some(k as usize), self.poll),
            Setup::Auto => (None, self.poll),
        };
        let mut cmd = ServeCommand {
            socket: Some(self.socket(setup)),
            queues: Some(self.matrix.queues() as u16),
            iothreads: threads,
            iothreads_auto: setup == Setup::Auto,
            control: (setup == Setup::Auto).then(|| self.control_socket()),
            stats_file: Some(self.stats_file(setup)),
            poll,
            // `auto`'s controller logs each decision at info: what its
            // runs' figures alone cannot tell (moves during a warm-up).
            log_level: Some(if setup == Setup::Auto {
                log::LevelFilter::Info
            } else {
                log::LevelFilter::Warn
            }),
            ..Default::default()
        };
        match &self.target {
            Target::Null { bytes, latency_ns } => {
                cmd.backend = Some(BackendKind::Null);
                cmd.size = Some(*bytes);
                cmd.latency_ns = *latency_ns;
            }
            Target::Image { path, .. } | Target::Device { path, .. } => {
                cmd.image = Some(path.clone());
                cmd.cache = Some(CacheMode::None);
            }
            Target::Rbd { spec, .. } => {
                cmd.backend = Some(BackendKind::Rbd);
                cmd.image = Some(PathBuf::from(format!("rbd:{spec}")));
                cmd.cache = Some(CacheMode::None);
            }
        }
        Some(cmd)
    }

    /// The qemu-storage-daemon command line of the baseline: one export, one
    /// IOThread, io_uring, O_DIRECT.
    fn qsd_argv(&self) -> Vec<OsString> {
        let blockdev = match &self.target {
            Target::Null { bytes, latency_ns } => {
                let latency = latency_ns.map_or(String::new(), |ns| format!(",latency-ns={ns}"));
                format!("driver=null-co,node-name=d,size={bytes},read-zeroes=on{latency}")
            }
            Target::Image { path, .. } => format!(
                "driver=file,node-name=d,filename={},cache.direct=on,aio=io_uring",
                path.display()
            ),
            Target::Device { path, .. } => format!(
                "driver=host_device,node-name=d,filename={},cache.direct=on,aio=io_uring",
                path.display()
            ),
            Target::Rbd { spec, .. } => qsd_rbd_blockdev(spec),
        };
        let export = format!(
            "type=vhost-user-blk,id=e,node-name=d,addr.type=unix,addr.path={},writable=on,num-queues={},iothread=iot0",
            self.socket(Setup::Baseline).display(),
            self.matrix.queues()
        );
        [
            "qemu-storage-daemon",
            "--blockdev",
            &blockdev,
            "--object",
            "iothread,id=iot0",
            "--export",
            &export,
        ]
        .map(OsString::from)
        .to_vec()
    }

    /// The server command line of a column (None for native).
    pub fn server_argv(&self, setup: Setup) -> Option<Vec<OsString>> {
        match setup {
            Setup::Native => None,
            Setup::Baseline if self.baseline == BaselineKind::QemuStorageDaemon => {
                Some(self.qsd_argv())
            }
            _ => self.serve_command(setup).map(|c| c.argv(&self.exe)),
        }
    }

    /// The `vqblk bench` command line of one measured run of a cell in one
    /// column.
    pub fn bench_argv(&self, cell: &Cell, setup: Setup, server_pid: Option<u32>) -> Vec<String> {
        self.run_argv(cell, setup, server_pid, self.ramp_s(setup, false))
    }

    /// The `vqblk bench` command line of a warm-up run (discarded) of a cell
    /// in one column: as a measured run's, with `auto`'s longer warm-up ramp
    /// ([`AUTO_WARMUP_RAMP_S`]).
    pub fn warmup_argv(&self, cell: &Cell, setup: Setup, server_pid: Option<u32>) -> Vec<String> {
        self.run_argv(cell, setup, server_pid, self.ramp_s(setup, true))
    }

    /// The ramp of a run in column `setup`, seconds: the matrix's; `auto`'s
    /// runs at least [`AUTO_RAMP_S`], its warm-ups at least
    /// [`AUTO_WARMUP_RAMP_S`].
    fn ramp_s(&self, setup: Setup, warmup: bool) -> f64 {
        match setup {
            Setup::Auto if warmup => self.matrix.ramp_s.max(AUTO_WARMUP_RAMP_S),
            Setup::Auto => self.matrix.ramp_s.max(AUTO_RAMP_S),
            _ => self.matrix.ramp_s,
        }
    }

    fn run_argv(
        &self,
        cell: &Cell,
        setup: Setup,
        server_pid: Option<u32>,
        ramp: f64,
    ) -> Vec<String> {
        let target = match (setup, &self.target) {
            (Setup::Native, Target::Image { path, .. }) => format!("file:{}", path.display()),
            (Setup::Native, Target::Device { path, .. }) => format!("dev:{}", path.display()),
            (Setup::Native, Target::Rbd { spec, .. }) => format!("rbd:{spec}"),
            _ => format!("unix:{}", self.socket(setup).display()),
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
        if ramp > 0.0 {
            v.extend(["--ramp_time".into(), fio_duration(ramp)]);
        }
        v.extend(
            [
                "--time_based",
                "--group_reporting",
                "--output-format",
                "json",
            ]
            .map(String::from),
        );
        if let Some(pid) = server_pid {
            v.extend(["--server-pid".into(), pid.to_string()]);
            if self.serve_command(setup).is_some() {
                let stats = self.stats_file(setup).display().to_string();
                v.extend(["--server-stats".into(), stats]);
            }
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
                shell_join(&a)
                    .replace(&format!("--iothreads {k}"), "--iothreads K")
                    .replace(&format!("iothreads-{k}.sock"), "iothreads-K.sock"),
            );
        }
        if let Some(a) = self.server_argv(Setup::Baseline) {
            m.insert("baseline".into(), shell_join(&a));
        }
        if self.setups.contains(&Setup::Auto) {
            if let Some(a) = self.server_argv(Setup::Auto) {
                m.insert(
                    "auto".into(),
                    format!(
                        "{} (runs ramp at least {AUTO_RAMP_S} s, warm-ups {AUTO_WARMUP_RAMP_S} s)",
                        shell_join(&a)
                    ),
                );
            }
        }
        let pattern = |a: Vec<String>| {
            shell_join(&a)
                .replace("--rw randread", "--rw OP")
                .replace("--bs 4096", "--bs BS")
                .replace("--numjobs 1", "--numjobs JOBS")
                .replace("--iodepth 1 ", "--iodepth DEPTH ")
                .replace("--server-pid 0", "--server-pid SERVER_PID")
                .replace("baseline.sock", "COLUMN.sock")
                .replace("baseline.stats.json", "COLUMN.stats.json")
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

    /// Seconds one run in column `setup` is expected to take: its runtime,
    /// its ramp (`auto`'s are longer, see [`Plan::warmup_argv`]) and process
    /// start-up.
    pub fn run_estimate_s(&self, setup: Setup, warmup: bool) -> f64 {
        self.matrix.runtime_s + self.ramp_s(setup, warmup) + 0.05
    }
}

/// Quotes a command line for a shell when needed.
pub fn shell_join<S: AsRef<OsStr>>(argv: &[S]) -> String {
    argv.iter()
        .map(|a| {
            let a = a.as_ref().to_string_lossy();
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c))
            {
                a.into_owned()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
