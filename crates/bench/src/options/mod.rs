//! fio's option vocabulary: time suffixes, job files, and the job description
//! ([`JobSpec`]) that both the command line and a job file reduce to.
//!
//! Both sources go through the same path: a list of `key[=value]` pairs in the order they
//! were given, applied one by one by [`JobSpec::from_options`]. That is what makes a job
//! file and the equivalent flags describe identical workloads.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use vqblk_daemon::size::parse_size;

mod job_file;
pub use job_file::{jobs_from_sections, parse_job_file, Section};

/// Default job name when the command line gives none (fio requires `--name`; we do not).
pub const DEFAULT_JOB_NAME: &str = "bench";

/// Default seed of the offset generator (fio also defaults to a fixed seed so that runs
/// are repeatable).
pub const DEFAULT_RANDSEED: u64 = 0x5eed_f10b_10c4_2024;

/// A configuration error: names the option, the value, and what would be valid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OptionError {
    /// The option is not one `vqblk bench` understands.
    #[error("unsupported option '{key}'")]
    Unsupported {
        /// The option as written.
        key: String,
    },
    /// The option needs a value and none was given.
    #[error("option '{key}' needs a value")]
    MissingValue {
        /// The option as written.
        key: String,
    },
    /// The value does not parse or is out of range.
    #[error("invalid value '{value}' for option '{key}': {expected}")]
    InvalidValue {
        /// The option as written.
        key: String,
        /// The value as written.
        value: String,
        /// What would have been valid.
        expected: String,
    },
    /// Options that cannot be combined.
    #[error("{0}")]
    Conflict(String),
    /// A job file line that is neither a section, an option, nor a comment.
    #[error("job file line {line}: cannot parse '{text}'")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// The line as written.
        text: String,
    },
}

fn invalid(key: &str, value: &str, expected: &str) -> OptionError {
    OptionError::InvalidValue {
        key: key.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

/// Parses a duration with fio's time suffixes (`us`, `ms`, `s`, `m`, `h`, `d`); a bare
/// number is in seconds, as for fio's `runtime` and `ramp_time`.
pub fn parse_time(s: &str) -> Option<Duration> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return None;
    }
    let n: u64 = t[..digits_end].parse().ok()?;
    let d = match t[digits_end..].to_ascii_lowercase().as_str() {
        "us" | "usec" => Duration::from_micros(n),
        "ms" | "msec" => Duration::from_millis(n),
        "" | "s" | "sec" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.checked_mul(60)?),
        "h" => Duration::from_secs(n.checked_mul(3600)?),
        "d" => Duration::from_secs(n.checked_mul(86400)?),
        _ => return None,
    };
    Some(d)
}

/// Parses fio's booleans: a bare option means true; `1/0`, `true/false`, `yes/no`, `on/off`.
pub fn parse_bool(key: &str, value: Option<&str>) -> Result<bool, OptionError> {
    match value.map(|v| v.trim().to_ascii_lowercase()) {
        None => Ok(true),
        Some(v) => match v.as_str() {
            "" | "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(invalid(
                key,
                &v,
                "a boolean (1/0, true/false, yes/no, on/off)",
            )),
        },
    }
}

/// I/O pattern (fio's `rw`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RwMode {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Random mixed reads and writes (`rwmixread` percent reads).
    RandRw,
    /// Sequential mixed reads and writes (fio's `readwrite`/`rw`).
    ReadWrite,
}

impl RwMode {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "read" => Self::Read,
            "write" => Self::Write,
            "randread" => Self::RandRead,
            "randwrite" => Self::RandWrite,
            "randrw" => Self::RandRw,
            "readwrite" | "rw" => Self::ReadWrite,
            _ => return None,
        })
    }

    /// Whether offsets are random (a permutation of the job's blocks) rather than sequential.
    pub fn is_random(self) -> bool {
        matches!(self, Self::RandRead | Self::RandWrite | Self::RandRw)
    }

    /// Percentage of reads for this mode given fio's `rwmixread`.
    pub fn read_percent(self, rwmixread: u32) -> u32 {
        match self {
            Self::Read | Self::RandRead => 100,
            Self::Write | Self::RandWrite => 0,
            Self::RandRw | Self::ReadWrite => rwmixread,
        }
    }

    /// fio's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::RandRead => "randread",
            Self::RandWrite => "randwrite",
            Self::RandRw => "randrw",
            Self::ReadWrite => "readwrite",
        }
    }
}

/// How a blkio job waits for completions (fio's `libblkio_wait_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WaitMode {
    /// `blkioq_do_io()` with `min_completions` = 1: libblkio blocks in the kernel.
    Block,
    /// Completion fd enabled; wait on the eventfd, then reap with `min_completions` = 0.
    Eventfd,
    /// Busy-poll `blkioq_do_io()` with `min_completions` = 0.
    Loop,
}

impl WaitMode {
    /// fio's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Block => "block",
            Self::Eventfd => "eventfd",
            Self::Loop => "loop",
        }
    }
}

/// Data verification (fio's `verify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifyMode {
    /// No verification.
    None,
    /// A header per block (offset, seed, crc32c of the block), written then read back.
    Crc32c,
}

/// What the load is driven against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", content = "path", rename_all = "lowercase")]
pub enum Target {
    /// A vhost-user-blk Unix socket, driven through libblkio's virtio-blk-vhost-user driver.
    Unix(PathBuf),
    /// A regular file, driven natively through io_uring.
    File(PathBuf),
    /// A block device, driven natively through io_uring.
    Dev(PathBuf),
    /// An RBD image (`POOL/[NAMESPACE/]IMAGE`), driven natively through librbd
    /// (the configuration from `$CEPH_CONF`), as fio's rbd engine does.
    Rbd(PathBuf),
}

impl Target {
    /// Parses `unix:/path.sock`, `file:/path`, `dev:/dev/x` or `rbd:POOL/IMAGE`.
    pub fn parse(key: &str, s: &str) -> Result<Self, OptionError> {
        let (kind, path) = s.split_once(':').ok_or_else(|| {
            invalid(
                key,
                s,
                "unix:/path.sock, file:/path, dev:/dev/name or rbd:POOL/IMAGE",
            )
        })?;
        if path.is_empty() {
            return Err(invalid(key, s, "a non-empty path after the ':'"));
        }
        let path = PathBuf::from(path);
        match kind {
            "unix" => Ok(Self::Unix(path)),
            "file" => Ok(Self::File(path)),
            "dev" => Ok(Self::Dev(path)),
            "rbd" => Ok(Self::Rbd(path)),
            _ => Err(invalid(
                key,
                s,
                "unix:/path.sock, file:/path, dev:/dev/name or rbd:POOL/IMAGE",
            )),
        }
    }

    /// The path of the socket, file or device.
    pub fn path(&self) -> &Path {
        match self {
            Self::Unix(p) | Self::File(p) | Self::Dev(p) | Self::Rbd(p) => p,
        }
    }

    /// Whether the target is driven through libblkio (vhost-user-blk).
    pub fn is_vhost_user(&self) -> bool {
        matches!(self, Self::Unix(_))
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, p) = match self {
            Self::Unix(p) => ("unix", p),
            Self::File(p) => ("file", p),
            Self::Dev(p) => ("dev", p),
            Self::Rbd(p) => ("rbd", p),
        };
        write!(f, "{kind}:{}", p.display())
    }
}

/// One job description, after `[global]` inheritance and aliases. `numjobs` clones run
/// the same description, each on its own thread (and, for vhost-user, its own queue).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobSpec {
    /// Job name (section name or `name=`).
    pub name: String,
    /// What to drive.
    pub target: Target,
    /// I/O pattern.
    pub rw: RwMode,
    /// Percentage of reads for mixed patterns.
    pub rwmixread: u32,
    /// Block size in bytes.
    pub bs: u64,
    /// Number of clones of this job.
    pub numjobs: u32,
    /// Requests in flight per clone.
    pub iodepth: u32,
    /// Requests queued before each submission (fio's `iodepth_batch_submit`,
    /// alias `iodepth_batch`): 1, fio's default, submits each request as soon
    /// as it is queued; 0 means `iodepth`.
    pub iodepth_batch_submit: u32,
    /// Measured run time limit (after `ramp_time`).
    pub runtime: Option<Duration>,
    /// Warm-up time whose I/O is not counted.
    pub ramp_time: Duration,
    /// Keep going until `runtime` even after `size` bytes are done.
    pub time_based: bool,
    /// Region size per clone in bytes; `None` = device size minus `offset`.
    pub size: Option<u64>,
    /// Start of the region.
    pub offset: u64,
    /// Added to `offset` for each successive clone (fio's `offset_increment`).
    pub offset_increment: u64,
    /// Data verification.
    pub verify: VerifyMode,
    /// O_DIRECT for native targets (fio's `direct`); ignored for vhost-user.
    pub direct: bool,
    /// Completion wait mode for vhost-user targets.
    pub wait_mode: WaitMode,
    /// Virtqueue size for vhost-user targets; `None` = automatic.
    pub queue_size: Option<u32>,
    /// Seed of the offset and read/write mix generators.
    pub randseed: u64,
    /// Report all jobs as one group.
    pub group_reporting: bool,
}

/// Options that only make sense for the whole run (command line only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// fio's human-readable summary.
    Normal,
    /// fio's JSON layout.
    Json,
}

impl OutputFormat {
    /// Parses `normal` or `json`.
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        match s {
            "normal" => Ok(Self::Normal),
            "json" => Ok(Self::Json),
            _ => Err(invalid("output-format", s, "normal or json")),
        }
    }
}

/// A raw option as written: key and optional value, in the order given.
pub type RawOption = (String, Option<String>);

/// Canonical key: lower case, `-` and `_` equivalent, aliases resolved.
fn canonical_key(key: &str) -> String {
    let k = key.trim().to_ascii_lowercase().replace('-', "_");
    match k.as_str() {
        "readwrite" => "rw".to_string(),
        "blocksize" => "bs".to_string(),
        "libblkio_queue_size" => "queue_size".to_string(),
        _ => k,
    }
}

/// Intermediate state while applying options: fio can name the target through
/// `ioengine` + `libblkio_path` or `filename` as well as our `target`.
#[derive(Default)]
struct TargetParts {
    target: Option<Target>,
    ioengine: Option<String>,
    libblkio_path: Option<PathBuf>,
    filename: Option<PathBuf>,
}

impl TargetParts {
    fn resolve(self) -> Result<Target, OptionError> {
        if let Some(t) = self.target {
            return Ok(t);
        }
        match self.ioengine.as_deref() {
            Some("libblkio") => {
                let p = self.libblkio_path.ok_or_else(|| {
                    OptionError::Conflict(
                        "ioengine=libblkio needs libblkio_path=/path/to/vhost-user-blk.sock"
                            .to_string(),
                    )
                })?;
                Ok(Target::Unix(p))
            }
            Some("io_uring") | None => {
                if let Some(p) = self.filename {
                    let is_blk = std::fs::metadata(&p)
                        .map(|m| {
                            use std::os::unix::fs::FileTypeExt;
                            m.file_type().is_block_device()
                        })
                        .unwrap_or(false);
                    Ok(if is_blk {
                        Target::Dev(p)
                    } else {
                        Target::File(p)
                    })
                } else if let Some(p) = self.libblkio_path {
                    Ok(Target::Unix(p))
                } else {
                    Err(OptionError::Conflict(
                        "no target: give --target unix:/path.sock|file:/path|dev:/dev/name \
                         (or fio's filename= / ioengine=libblkio + libblkio_path=)"
                            .to_string(),
                    ))
                }
            }
            Some(other) => Err(invalid("ioengine", other, "libblkio or io_uring")),
        }
    }
}

fn need<'a>(key: &str, value: Option<&'a str>) -> Result<&'a str, OptionError> {
    match value.map(str::trim) {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(OptionError::MissingValue {
            key: key.to_string(),
        }),
    }
}

fn parse_u32(key: &str, v: &str, min: u32, max: u32) -> Result<u32, OptionError> {
    match v.trim().parse::<u32>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(invalid(key, v, &format!("an integer from {min} to {max}"))),
    }
}

/// A size in the grammar shared with the daemon's flags and TOML
/// ([`vqblk_daemon::size::parse_size`]: fio's suffixes, powers of 1024); the error
/// names the option.
fn parse_size_opt(key: &str, v: &str) -> Result<u64, OptionError> {
    parse_size(v).map_err(|_| invalid(key, v, "a size such as 4096, 4k, 64m or 1g"))
}

fn parse_time_opt(key: &str, v: &str) -> Result<Duration, OptionError> {
    parse_time(v).ok_or_else(|| invalid(key, v, "a time such as 10, 10s, 500ms or 2m"))
}

/// A job while its options are applied: every option lands in `spec` except the ways
/// of naming the target, gathered in `parts` and resolved once all are known (until
/// then `spec.target` is a placeholder).
struct Draft {
    spec: JobSpec,
    parts: TargetParts,
}

impl Draft {
    /// fio's defaults.
    fn new(name: &str) -> Self {
        Self {
            spec: JobSpec {
                name: name.to_string(),
                target: Target::File(PathBuf::new()),
                rw: RwMode::Read,
                rwmixread: 50,
                bs: 4096,
                numjobs: 1,
                iodepth: 1,
                iodepth_batch_submit: 1,
                runtime: None,
                ramp_time: Duration::ZERO,
                time_based: false,
                size: None,
                offset: 0,
                offset_increment: 0,
                verify: VerifyMode::None,
                direct: true,
                wait_mode: WaitMode::Block,
                queue_size: None,
                randseed: DEFAULT_RANDSEED,
                group_reporting: false,
            },
            parts: TargetParts::default(),
        }
    }

    /// The job's name and target (ours or fio's spelling). False if `key` is not one.
    fn target_option(
        &mut self,
        key: &str,
        raw: &str,
        v: Option<&str>,
    ) -> Result<bool, OptionError> {
        let p = &mut self.parts;
        match key {
            "name" => self.spec.name = need(raw, v)?.to_string(),
            "target" => p.target = Some(Target::parse(raw, need(raw, v)?)?),
            "filename" => p.filename = Some(PathBuf::from(need(raw, v)?)),
            "libblkio_path" => p.libblkio_path = Some(PathBuf::from(need(raw, v)?)),
            "ioengine" => p.ioengine = Some(need(raw, v)?.to_string()),
            "libblkio_driver" => {
                let d = need(raw, v)?;
                if d != "virtio-blk-vhost-user" {
                    return Err(invalid(raw, d, "virtio-blk-vhost-user"));
                }
            }
            // We always run jobs as threads, which is what fio's `thread` asks for.
            "thread" => {
                if !parse_bool(raw, v)? {
                    let v = v.unwrap_or("");
                    return Err(invalid(raw, v, "1 (jobs always run as threads)"));
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The I/O pattern, block size and parallelism. False if `key` is not one.
    fn workload_option(
        &mut self,
        key: &str,
        raw: &str,
        v: Option<&str>,
    ) -> Result<bool, OptionError> {
        let s = &mut self.spec;
        match key {
            "rw" => {
                let t = need(raw, v)?;
                s.rw = RwMode::parse(t).ok_or_else(|| {
                    invalid(
                        raw,
                        t,
                        "read, write, randread, randwrite, randrw or readwrite",
                    )
                })?;
            }
            "rwmixread" => s.rwmixread = parse_u32(raw, need(raw, v)?, 0, 100)?,
            "rwmixwrite" => s.rwmixread = 100 - parse_u32(raw, need(raw, v)?, 0, 100)?,
            "bs" => {
                let t = need(raw, v)?;
                let n = parse_size_opt(raw, t)?;
                if n == 0 || n % 512 != 0 {
                    return Err(invalid(raw, t, "a non-zero multiple of 512 bytes"));
                }
                if n > 64 << 20 {
                    return Err(invalid(raw, t, "at most 64m"));
                }
                s.bs = n;
            }
            "numjobs" => s.numjobs = parse_u32(raw, need(raw, v)?, 1, 1024)?,
            "iodepth" => s.iodepth = parse_u32(raw, need(raw, v)?, 1, 65536)?,
            "iodepth_batch_submit" | "iodepth_batch" => {
                s.iodepth_batch_submit = parse_u32(raw, need(raw, v)?, 0, 65536)?
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// How long and over which part of the target. False if `key` is not one.
    fn extent_option(
        &mut self,
        key: &str,
        raw: &str,
        v: Option<&str>,
    ) -> Result<bool, OptionError> {
        let s = &mut self.spec;
        match key {
            "runtime" => {
                let d = parse_time_opt(raw, need(raw, v)?)?;
                s.runtime = if d.is_zero() { None } else { Some(d) };
            }
            "ramp_time" => s.ramp_time = parse_time_opt(raw, need(raw, v)?)?,
            "time_based" => s.time_based = parse_bool(raw, v)?,
            "size" => {
                let t = need(raw, v)?;
                let n = parse_size_opt(raw, t)?;
                if n == 0 {
                    return Err(invalid(raw, t, "a non-zero size"));
                }
                s.size = Some(n);
            }
            "offset" => s.offset = parse_size_opt(raw, need(raw, v)?)?,
            "offset_increment" => s.offset_increment = parse_size_opt(raw, need(raw, v)?)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Verification, engine settings, seed and reporting. False if `key` is not one.
    fn engine_option(
        &mut self,
        key: &str,
        raw: &str,
        v: Option<&str>,
    ) -> Result<bool, OptionError> {
        let s = &mut self.spec;
        match key {
            "verify" => {
                let t = need(raw, v)?;
                s.verify = match t {
                    "crc32c" | "crc32c-intel" => VerifyMode::Crc32c,
                    "0" | "none" => VerifyMode::None,
                    _ => return Err(invalid(raw, t, "crc32c (or 0 for none)")),
                };
            }
            "direct" => s.direct = parse_bool(raw, v)?,
            "libblkio_wait_mode" => {
                let t = need(raw, v)?;
                s.wait_mode = match t {
                    "block" => WaitMode::Block,
                    "eventfd" => WaitMode::Eventfd,
                    "loop" => WaitMode::Loop,
                    _ => return Err(invalid(raw, t, "block, eventfd or loop")),
                };
            }
            "queue_size" => {
                let t = need(raw, v)?;
                let n = parse_u32(raw, t, 1, 32768)?;
                if !n.is_power_of_two() {
                    return Err(invalid(raw, t, "a power of two from 1 to 32768"));
                }
                s.queue_size = Some(n);
            }
            "randseed" => {
                let t = need(raw, v)?;
                s.randseed = t
                    .parse()
                    .map_err(|_| invalid(raw, t, "an unsigned 64-bit integer"))?;
            }
            "group_reporting" => s.group_reporting = parse_bool(raw, v)?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

impl JobSpec {
    /// Requests to queue before each submission: `iodepth_batch_submit`, with
    /// 0 meaning `iodepth`, never more than `iodepth`.
    pub fn submit_batch(&self) -> u32 {
        match self.iodepth_batch_submit {
            0 => self.iodepth,
            n => n.min(self.iodepth),
        }
    }

    /// Builds a job from options applied in order (later ones override earlier ones).
    /// `default_name` is used when no `name=` option is present.
    pub fn from_options(default_name: &str, opts: &[RawOption]) -> Result<Self, OptionError> {
        let mut d = Draft::new(default_name);
        for (raw_key, value) in opts {
            let key = canonical_key(raw_key);
            let v = value.as_deref();
            let known = d.target_option(&key, raw_key, v)?
                || d.workload_option(&key, raw_key, v)?
                || d.extent_option(&key, raw_key, v)?
                || d.engine_option(&key, raw_key, v)?;
            if !known {
                return Err(OptionError::Unsupported {
                    key: raw_key.clone(),
                });
            }
        }
        let spec = JobSpec {
            target: d.parts.resolve()?,
            ..d.spec
        };
        spec.check()?;
        Ok(spec)
    }

    /// Cross-option checks that need no device.
    fn check(&self) -> Result<(), OptionError> {
        if !self.offset.is_multiple_of(512) {
            return Err(invalid(
                "offset",
                &self.offset.to_string(),
                "a multiple of 512",
            ));
        }
        if !self.offset_increment.is_multiple_of(512) {
            return Err(invalid(
                "offset_increment",
                &self.offset_increment.to_string(),
                "a multiple of 512",
            ));
        }
        if let Some(size) = self.size {
            if size < self.bs {
                return Err(OptionError::Conflict(format!(
                    "job '{}': size {size} is smaller than bs {}",
                    self.name, self.bs
                )));
            }
        }
        if self.time_based && self.runtime.is_none() {
            return Err(OptionError::Conflict(format!(
                "job '{}': time_based needs a runtime",
                self.name
            )));
        }
        if self.verify == VerifyMode::Crc32c {
            if !matches!(self.rw, RwMode::Write | RwMode::RandWrite) {
                return Err(OptionError::Conflict(format!(
                    "job '{}': verify=crc32c writes then reads back, so it needs rw=write or \
                     rw=randwrite (got rw={})",
                    self.name,
                    self.rw.as_str()
                )));
            }
            if self.time_based || !self.ramp_time.is_zero() {
                return Err(OptionError::Conflict(format!(
                    "job '{}': verify=crc32c does one write pass and one read pass; \
                     time_based and ramp_time do not apply",
                    self.name
                )));
            }
            if self.numjobs > 1 {
                let size = self.size.unwrap_or(0);
                if size == 0 || self.offset_increment < size {
                    return Err(OptionError::Conflict(format!(
                        "job '{}': verify with numjobs={} needs disjoint regions: give size \
                         and offset_increment >= size",
                        self.name, self.numjobs
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
