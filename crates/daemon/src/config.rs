//! The serve model: a pool of IOThreads and the exports that run on it.
//!
//! The TOML file (`vqblk serve --config`) and the command-line flags (the
//! one-export shorthand) both build a [`ServeConfig`]; [`ServeConfig::validate`]
//! checks it and names the offending field in every error.

use std::path::PathBuf;

use serde::Deserialize;

use crate::mapping::{Assignment, VirtqueueMap};
use crate::qos::{ThrottleConfig, ThrottleLimits};

mod iothreads;
mod qos;
pub use iothreads::{IoThreadConfig, IoThreadsConfig, PollConfig, DEFAULT_POLL_MODE};
use qos::export_limits;
pub use qos::{
    check_shared_qos, is_group_name, ThrottleGroupConfig, ThrottleGroupPlan, MAX_RESERVED_IOPS,
    MAX_WEIGHT,
};

/// Largest number of virtqueues per export (the virtio-blk `num_queues` is a u16,
/// but one IOThread pass handles a bounded set; QEMU caps at 1024 queues).
pub const MAX_QUEUES: u16 = 256;
/// Largest virtqueue size we accept (split rings, like QEMU's VIRTQUEUE_MAX_SIZE).
pub const MAX_QUEUE_SIZE: u16 = 1024;
/// Largest IOThread pool.
pub const MAX_IOTHREADS: usize = 256;

/// A configuration error: the field (a dotted path such as `export[1].queues`)
/// and what is wrong with its value.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    /// Dotted path of the offending field.
    pub field: String,
    /// What is wrong and what would be valid.
    pub message: String,
}

impl ConfigError {
    /// Builds an error for `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Which engine executes an export's requests (QEMU's `aio=` / `driver=null-co`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// One io_uring per IOThread; readv/writev straight from guest memory.
    #[value(name = "io_uring")]
    #[serde(rename = "io_uring", alias = "io-uring")]
    IoUring,
    /// A small pool of blocking worker threads (QEMU `aio=threads`).
    Threads,
    /// Completes every request at once; reads return zeroes. Measures overhead.
    Null,
    /// An RBD image on a Ceph cluster (`image = "rbd:POOL/IMAGE"`), through
    /// librbd's asynchronous API (librbd1 loaded at run time).
    Rbd,
}

/// Host page-cache use, named like QEMU's `cache=` option.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// O_DIRECT: bypass the host page cache (the default, as QEMU recommends).
    None,
    /// Use the host page cache; guest flushes become fdatasync.
    Writeback,
}

/// Largest null-backend `latency-ns` (1 s).
pub const MAX_NULL_LATENCY_NS: u64 = 1_000_000_000;

/// One `[[export]]` table: a disk served on one vhost-user socket.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ExportConfig {
    /// Name used in logs and statistics (default: `export<N>`).
    #[serde(default)]
    pub name: Option<String>,
    /// Raw image file or block device (not needed with the null backend), or
    /// with the rbd backend an RBD image: `rbd:POOL/[NAMESPACE/]IMAGE[@SNAP]`.
    #[serde(default)]
    pub image: Option<PathBuf>,
    /// Path of the vhost-user Unix socket to listen on.
    pub socket: PathBuf,
    /// Permission bits of the socket file (octal string, default "0600").
    #[serde(default)]
    pub socket_mode: Option<String>,
    /// Number of virtqueues (virtio-blk `num_queues`).
    #[serde(default = "one_u16")]
    pub queues: u16,
    /// Largest virtqueue size the frontend may choose.
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    /// IOThreads the queues are spread over round-robin (default: all).
    #[serde(default)]
    pub iothreads: Option<Vec<usize>>,
    /// Explicit mapping, like QEMU's `iothread-vq-mapping`.
    #[serde(default)]
    pub iothread_vq_mapping: Option<Vec<Assignment>>,
    /// Request engine.
    #[serde(default = "default_backend")]
    pub backend: BackendKind,
    /// Host page-cache mode.
    #[serde(default = "default_cache")]
    pub cache: CacheMode,
    /// Export read-only (virtio-blk RO feature).
    #[serde(default)]
    pub read_only: bool,
    /// Serial number returned by GET_ID (at most 20 bytes).
    #[serde(default)]
    pub serial: Option<String>,
    /// Size of a null export, in bytes or with a K/M/G/T suffix.
    #[serde(default)]
    pub size: Option<String>,
    /// Create the image with this size if it does not exist.
    #[serde(default)]
    pub create: Option<String>,
    /// Null backend: complete each request this many ns after submission (as
    /// QEMU's null-co `latency-ns`; default 0 = at once).
    #[serde(default)]
    pub latency_ns: Option<u64>,
    /// Null backend: reads write zeroes into the guest's buffers (default
    /// true); false leaves them untouched, as QEMU's null-co
    /// `read-zeroes=off` and SPDK's null bdev.
    #[serde(default)]
    pub read_zeroes: Option<bool>,
    /// rbd backend: the ceph.conf to read (default: librados's search, `$CEPH_CONF` first).
    #[serde(default)]
    pub ceph_conf: Option<PathBuf>,
    /// rbd backend: the cephx user, without `client.` (default `admin`); its
    /// keyring comes from the configuration, as for the `rbd` CLI.
    #[serde(default)]
    pub ceph_id: Option<String>,
    /// rbd backend: seconds before a request to an unreachable cluster fails
    /// (`rados_osd_op_timeout`; also the monitor and connect timeouts; default 30).
    #[serde(default)]
    pub ceph_op_timeout: Option<u64>,
    /// I/O limits of this export (`[export.throttle]`, QEMU's
    /// `throttling.*` keys; docs/qos.md).
    #[serde(default)]
    pub throttle: Option<ThrottleConfig>,
    /// The `[[throttle-group]]` whose limits this export shares with the
    /// group's other members.
    #[serde(default)]
    pub throttle_group: Option<String>,
    /// Operations per second this export gets whenever it asks for them, as
    /// long as the reservations of the exports sharing its backing device fit
    /// what the device does (0 or unset: none).
    #[serde(default)]
    pub reservation_iops: Option<u64>,
    /// This export's share of what the device does beyond the reservations,
    /// relative to the other exports on it (default 1).
    #[serde(default)]
    pub weight: Option<u32>,
}

fn one_u16() -> u16 {
    1
}
fn default_queue_size() -> u16 {
    256
}
fn default_backend() -> BackendKind {
    BackendKind::IoUring
}
fn default_cache() -> CacheMode {
    CacheMode::None
}

impl ExportConfig {
    /// An export with every optional field at its default.
    pub fn new(socket: PathBuf) -> Self {
        ExportConfig {
            name: None,
            image: None,
            socket,
            socket_mode: None,
            queues: 1,
            queue_size: default_queue_size(),
            iothreads: None,
            iothread_vq_mapping: None,
            backend: BackendKind::IoUring,
            cache: CacheMode::None,
            read_only: false,
            serial: None,
            size: None,
            create: None,
            latency_ns: None,
            read_zeroes: None,
            ceph_conf: None,
            ceph_id: None,
            ceph_op_timeout: None,
            throttle: None,
            throttle_group: None,
            reservation_iops: None,
            weight: None,
        }
    }
}

/// The whole serve model.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeConfig {
    /// The IOThread pool.
    #[serde(default)]
    pub iothreads: IoThreadsConfig,
    /// The exports (`[[export]]`).
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportConfig>,
    /// seccomp filters per thread kind (`seccomp = "on" | "log" | "off"`; default on).
    #[serde(default)]
    pub seccomp: crate::seccomp::SeccompMode,
    /// Frontend memory that cannot be sealed against shrinking
    /// (`memory-sealing = "required" | "preferred"`; default preferred,
    /// docs/security.md).
    #[serde(default)]
    pub memory_sealing: crate::fault::MemorySealing,
    /// The JSON-RPC control socket (`[control]`; none unless configured).
    #[serde(default)]
    pub control: Option<ControlConfig>,
    /// The Prometheus metrics endpoint (`[metrics]`); none by default.
    #[serde(default)]
    pub metrics: Option<MetricsConfig>,
    /// Seconds a shutdown (SIGTERM, SIGINT) may take in total before the
    /// process exits without finishing it (`shutdown-timeout`); none by
    /// default: every step (drain, flush, close) is waited for.
    #[serde(default)]
    pub shutdown_timeout: Option<u64>,
    /// Named sets of limits that exports join (`[[throttle-group]]`).
    #[serde(default, rename = "throttle-group")]
    pub throttle_groups: Vec<ThrottleGroupConfig>,
}

/// The `[control]` table: where the JSON-RPC control socket listens.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ControlConfig {
    /// Path of the control socket.
    pub socket: PathBuf,
    /// Permission bits of the socket file (octal string, default "0600": the
    /// control socket can remove exports, so only its owner may use it).
    #[serde(default)]
    pub mode: Option<String>,
}

impl ControlConfig {
    /// The socket's permission bits, or an error naming `control.mode`.
    pub fn mode_bits(&self) -> Result<u32, ConfigError> {
        match &self.mode {
            None => Ok(0o600),
            Some(m) => parse_mode(m).ok_or_else(|| {
                ConfigError::new(
                    "control.mode",
                    format!("{m:?} is not an octal mode such as 0600"),
                )
            }),
        }
    }
}

/// An octal permission string ("0600", "0o660") as bits, if valid.
fn parse_mode(m: &str) -> Option<u32> {
    u32::from_str_radix(m.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
}

/// `[metrics]`: where `GET /metrics` is served (`--metrics`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct MetricsConfig {
    /// `ADDR:PORT`, or a bare `PORT` (or `:PORT`) for the loopback address
    /// 127.0.0.1; e.g. `"127.0.0.1:9100"`, `"[::1]:9100"`, `"9100"`.
    pub listen: String,
}

impl MetricsConfig {
    /// The socket address to listen on.
    pub fn addr(&self) -> Result<std::net::SocketAddr, ConfigError> {
        parse_listen(&self.listen).map_err(|m| ConfigError::new("metrics.listen", m))
    }
}

/// Parses a listen address: `ADDR:PORT` (IPv6 in brackets), or a port alone
/// (`9100`, `:9100`), which means the loopback address 127.0.0.1.
pub fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::{Ipv4Addr, SocketAddr};
    let t = s.trim();
    let port_only = t.strip_prefix(':').unwrap_or(t);
    if let Ok(port) = port_only.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    t.parse().map_err(|_| {
        format!("{s:?} is not ADDR:PORT or PORT (e.g. 127.0.0.1:9100, [::1]:9100, 9100)")
    })
}

/// An export after validation: everything resolved to concrete values.
#[derive(Debug, Clone)]
pub struct ExportPlan {
    /// Name used in logs and statistics.
    pub name: String,
    /// The validated export settings.
    pub config: ExportConfig,
    /// Owner IOThread of every queue.
    pub map: VirtqueueMap,
    /// Size of a null export or of an image to create, in bytes.
    pub size: Option<u64>,
    /// Whether to create the image if missing.
    pub create: Option<u64>,
    /// Socket permission bits.
    pub socket_mode: u32,
    /// The export's own limits (`[export.throttle]`), if any is set.
    pub throttle: Option<ThrottleLimits>,
}

impl ServeConfig {
    /// Parses a TOML configuration file's text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let field = e
                .span()
                .map(|s| format!("line {}", text[..s.start].lines().count().max(1)))
                .unwrap_or_else(|| "config".into());
            ConfigError::new(field, e.message().to_string())
        })
    }

    /// Checks every field and resolves the mapping of every export.
    pub fn validate(&self) -> Result<Vec<ExportPlan>, ConfigError> {
        if let Some(m) = &self.metrics {
            m.addr()?;
        }
        if self.shutdown_timeout == Some(0) {
            return Err(ConfigError::new(
                "shutdown-timeout",
                "0 would give up at once; leave it out to wait for every step",
            ));
        }
        let pool = self.iothreads.pool_size()?;
        if pool == 0 || pool > MAX_IOTHREADS {
            return Err(ConfigError::new(
                "iothreads.count",
                format!("{pool} is out of range (1..={MAX_IOTHREADS})"),
            ));
        }
        for (i, t) in self.iothreads.threads.iter().enumerate() {
            let f = format!("iothreads.thread[{i}]");
            if t.id >= pool {
                return Err(ConfigError::new(
                    format!("{f}.id"),
                    format!("IOThread {} does not exist (count is {pool})", t.id),
                ));
            }
            if let Some(c) = &t.cpuset {
                parse_cpuset(c).map_err(|m| ConfigError::new(format!("{f}.cpuset"), m))?;
            }
            if let Err(e) = t
                .poll_config()
                .or(&self.iothreads.poll)
                .resolve()
                .1
                .validate()
            {
                return Err(ConfigError::new(format!("{f}.poll-weight"), e.to_string()));
            }
            if self.iothreads.threads[..i].iter().any(|o| o.id == t.id) {
                return Err(ConfigError::new(
                    format!("{f}.id"),
                    format!("IOThread {} is configured twice", t.id),
                ));
            }
        }
        if let Err(e) = self.iothreads.poll.resolve().1.validate() {
            return Err(ConfigError::new("iothreads.poll-weight", e.to_string()));
        }
        self.iothreads.bounce_buffer_max()?;
        if let Some(c) = &self.control {
            c.mode_bits()?;
            if self.exports.iter().any(|e| e.socket == c.socket) {
                return Err(ConfigError::new(
                    "control.socket",
                    format!("{} is also an export's socket", c.socket.display()),
                ));
            }
        }
        // With a control socket, exports may all come later (export-add).
        if self.exports.is_empty() && self.control.is_none() {
            return Err(ConfigError::new(
                "export",
                "no export configured (add an [[export]] table, or a [control] socket to add them at run time)",
            ));
        }
        let groups = self.throttle_group_plans()?;
        let mut plans = Vec::new();
        for (i, e) in self.exports.iter().enumerate() {
            let plan = validate_export(i, e, pool)?;
            if plans
                .iter()
                .any(|p: &ExportPlan| p.config.socket == e.socket)
            {
                return Err(ConfigError::new(
                    format!("export[{i}].socket"),
                    format!("{} is used by another export", e.socket.display()),
                ));
            }
            if plans.iter().any(|p: &ExportPlan| p.name == plan.name) {
                return Err(ConfigError::new(
                    format!("export[{i}].name"),
                    format!("{:?} is used by another export", plan.name),
                ));
            }
            plans.push(plan);
        }
        let names: Vec<String> = plans.iter().map(|p| p.name.clone()).collect();
        check_shared_qos(&self.exports, &names, &groups, 0)?;
        Ok(plans)
    }
}

pub(crate) fn validate_export(
    i: usize,
    e: &ExportConfig,
    pool: usize,
) -> Result<ExportPlan, ConfigError> {
    let f = |name: &str| format!("export[{i}].{name}");
    if e.queues == 0 || e.queues > MAX_QUEUES {
        return Err(ConfigError::new(
            f("queues"),
            format!("{} is out of range (1..={MAX_QUEUES})", e.queues),
        ));
    }
    if !(2..=MAX_QUEUE_SIZE).contains(&e.queue_size) || !e.queue_size.is_power_of_two() {
        return Err(ConfigError::new(
            f("queue-size"),
            format!(
                "{} is not a power of two in 2..={MAX_QUEUE_SIZE}",
                e.queue_size
            ),
        ));
    }
    let map = match (&e.iothread_vq_mapping, &e.iothreads) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::new(
                f("iothread-vq-mapping"),
                "cannot be combined with iothreads (use one form, as QEMU requires)",
            ))
        }
        (Some(a), None) => VirtqueueMap::explicit(e.queues, a, pool)
            .map_err(|m| ConfigError::new(f("iothread-vq-mapping"), m.to_string()))?,
        (None, Some(t)) => VirtqueueMap::round_robin(e.queues, t, pool)
            .map_err(|m| ConfigError::new(f("iothreads"), m.to_string()))?,
        (None, None) => {
            let all: Vec<usize> = (0..pool).collect();
            VirtqueueMap::round_robin(e.queues, &all, pool).expect("pool is not empty")
        }
    };
    let size = e
        .size
        .as_deref()
        .map(|s| parse_size(s).map_err(|m| ConfigError::new(f("size"), m.to_string())))
        .transpose()?;
    let create = e
        .create
        .as_deref()
        .map(|s| parse_size(s).map_err(|m| ConfigError::new(f("create"), m.to_string())))
        .transpose()?;
    for (name, v) in [("size", size), ("create", create)] {
        if let Some(v) = v {
            if v == 0 || v % 512 != 0 {
                return Err(ConfigError::new(
                    f(name),
                    format!("{v} is not a positive multiple of 512 bytes"),
                ));
            }
        }
    }
    match e.backend {
        BackendKind::Null => {
            if e.image.is_some() {
                return Err(ConfigError::new(
                    f("image"),
                    "the null backend has no image (give a size instead)",
                ));
            }
            if size.is_none() {
                return Err(ConfigError::new(
                    f("size"),
                    "the null backend needs a size (e.g. 1G)",
                ));
            }
            if e.latency_ns.is_some_and(|l| l > MAX_NULL_LATENCY_NS) {
                return Err(ConfigError::new(
                    f("latency-ns"),
                    format!("at most {MAX_NULL_LATENCY_NS} (1 s)"),
                ));
            }
        }
        BackendKind::Rbd => {
            let Some(image) = &e.image else {
                return Err(ConfigError::new(
                    f("image"),
                    "missing (an RBD image: rbd:POOL/IMAGE)",
                ));
            };
            crate::block::rbd::RbdSpec::parse(&image.to_string_lossy())
                .map_err(|m| ConfigError::new(f("image"), m))?;
            for (name, given) in [
                ("size", e.size.is_some()),
                ("create", e.create.is_some()),
                ("latency-ns", e.latency_ns.is_some()),
                ("read-zeroes", e.read_zeroes.is_some()),
            ] {
                if given {
                    return Err(ConfigError::new(
                        f(name),
                        "not for the rbd backend (the image's size is its own; create it with `rbd create`)",
                    ));
                }
            }
            if e.ceph_op_timeout == Some(0) {
                return Err(ConfigError::new(
                    f("ceph-op-timeout"),
                    "0 would wait for ever on an unreachable cluster (give seconds, e.g. 30)",
                ));
            }
        }
        _ => {
            if e.image.is_none() {
                return Err(ConfigError::new(
                    f("image"),
                    "missing (a raw image file or block device)",
                ));
            }
            if e.latency_ns.is_some() {
                return Err(ConfigError::new(
                    f("latency-ns"),
                    "only the null backend takes a latency (a real device has its own)",
                ));
            }
            if e.read_zeroes.is_some() {
                return Err(ConfigError::new(
                    f("read-zeroes"),
                    "only the null backend takes read-zeroes (a real device reads its data)",
                ));
            }
            if size.is_some() {
                return Err(ConfigError::new(
                    f("size"),
                    "only the null backend takes a size (use create to make a new image)",
                ));
            }
        }
    }
    if e.backend != BackendKind::Rbd {
        for (name, given) in [
            ("ceph-conf", e.ceph_conf.is_some()),
            ("ceph-id", e.ceph_id.is_some()),
            ("ceph-op-timeout", e.ceph_op_timeout.is_some()),
        ] {
            if given {
                return Err(ConfigError::new(f(name), "only for the rbd backend"));
            }
        }
        if e.image
            .as_deref()
            .is_some_and(crate::block::rbd::is_rbd_image)
        {
            return Err(ConfigError::new(
                f("backend"),
                "an rbd: image needs backend = \"rbd\"",
            ));
        }
    }
    if let Some(s) = &e.serial {
        if s.len() > 20 {
            return Err(ConfigError::new(
                f("serial"),
                format!("{s:?} is longer than 20 bytes (virtio-blk GET_ID)"),
            ));
        }
    }
    let throttle = export_limits(e, &f)?;
    let socket_mode = match &e.socket_mode {
        None => 0o600,
        Some(m) => parse_mode(m).ok_or_else(|| {
            ConfigError::new(
                f("socket-mode"),
                format!("{m:?} is not an octal mode such as 0600"),
            )
        })?,
    };
    Ok(ExportPlan {
        name: e.name.clone().unwrap_or_else(|| format!("export{i}")),
        config: e.clone(),
        map,
        size,
        create,
        socket_mode,
        throttle,
    })
}

use crate::size::parse_size;

/// Parses a cpuset such as "0-2,5" into CPU numbers.
pub fn parse_cpuset(s: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in s.split(',').map(str::trim) {
        let bad = || format!("{s:?} is not a cpuset (e.g. \"2\", \"4-5\", \"1,3\")");
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (
                a.trim().parse().map_err(|_| bad())?,
                b.trim().parse().map_err(|_| bad())?,
            ),
            None => {
                let c: usize = part.parse().map_err(|_| bad())?;
                (c, c)
            }
        };
        if a > b || b >= 1024 {
            return Err(bad());
        }
        cpus.extend(a..=b);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poll::PollMode;

    const SAMPLE: &str = r#"
[iothreads]
count = 2
[[iothreads.thread]]
id = 1
cpuset = "1"

[[export]]
name = "db"
image = "/var/lib/db.raw"
socket = "/run/vqblk/db.sock"
queues = 4
iothread-vq-mapping = [ { iothread = 0, vqs = [0, 2] }, { iothread = 1, vqs = [1, 3] } ]
serial = "DB0"

[[export]]
backend = "null"
size = "1G"
socket = "/run/vqblk/null.sock"
queues = 2
"#;

    #[test]
    fn metrics_listen_defaults_to_loopback() {
        let addr = |s: &str| parse_listen(s).map(|a| a.to_string());
        assert_eq!(addr("9100").unwrap(), "127.0.0.1:9100");
        assert_eq!(addr(":9100").unwrap(), "127.0.0.1:9100");
        assert_eq!(addr("0.0.0.0:9100").unwrap(), "0.0.0.0:9100");
        assert_eq!(addr("[::1]:0").unwrap(), "[::1]:0");
        assert!(addr("localhost:9100").is_err());
        assert!(addr("70000").is_err());
        let c =
            ServeConfig::from_toml(&format!("{SAMPLE}\n[metrics]\nlisten = \"9100\"\n")).unwrap();
        assert_eq!(c.metrics.as_ref().unwrap().addr().unwrap().port(), 9100);
        let bad =
            ServeConfig::from_toml(&format!("{SAMPLE}\n[metrics]\nlisten = \"x\"\n")).unwrap();
        assert_eq!(bad.validate().unwrap_err().field, "metrics.listen");
    }

    #[test]
    fn parses_sample() {
        let c = ServeConfig::from_toml(SAMPLE).unwrap();
        let plans = c.validate().unwrap();
        assert_eq!(plans.len(), 2);
        assert_eq!(plans[0].name, "db");
        assert_eq!(plans[0].map.to_string(), "0:0,2;1:1,3");
        assert_eq!(plans[1].name, "export1");
        assert_eq!(plans[1].size, Some(1 << 30));
        assert_eq!(plans[1].socket_mode, 0o600);
        assert_eq!(plans[1].map.to_string(), "0:0;1:1");
    }

    /// `memory-sealing` is a top-level key, next to `seccomp`; preferred
    /// unless it says otherwise, and a value outside the two is refused.
    #[test]
    fn memory_sealing_key() {
        use crate::fault::MemorySealing;
        let c = |head: &str| ServeConfig::from_toml(&format!("{head}\n{SAMPLE}"));
        assert_eq!(c("").unwrap().memory_sealing, MemorySealing::Preferred);
        let required = c("memory-sealing = \"required\"").unwrap();
        assert_eq!(required.memory_sealing, MemorySealing::Required);
        let preferred = c("memory-sealing = \"preferred\"").unwrap();
        assert_eq!(preferred.memory_sealing, MemorySealing::Preferred);
        assert!(c("memory-sealing = \"always\"").is_err());
    }

    /// `shutdown-timeout` is a top-level key (before any table); 0 is named.
    #[test]
    fn shutdown_timeout_key() {
        assert_eq!(
            ServeConfig::from_toml(SAMPLE).unwrap().shutdown_timeout,
            None
        );
        let c = ServeConfig::from_toml(&format!("shutdown-timeout = 50\n{SAMPLE}")).unwrap();
        assert_eq!(c.shutdown_timeout, Some(50));
        assert!(c.validate().is_ok());
        let zero = format!("shutdown-timeout = 0\n{SAMPLE}");
        assert!(
            err_of(&zero).starts_with("shutdown-timeout: 0 would"),
            "{}",
            err_of(&zero)
        );
    }

    /// `[control]`: the socket, mode 0600 unless told, a bad mode named, and
    /// no export needed (they can be added at run time).
    #[test]
    fn control_table() {
        let c = ServeConfig::from_toml("[control]\nsocket = \"/run/vqblk/ctl.sock\"\n").unwrap();
        let control = c.control.as_ref().unwrap();
        assert_eq!(control.socket, PathBuf::from("/run/vqblk/ctl.sock"));
        assert_eq!(control.mode_bits().unwrap(), 0o600);
        assert!(c.validate().unwrap().is_empty());
        let with = format!("{SAMPLE}\n[control]\nsocket = \"/c\"\nmode = \"0660\"\n");
        let c = ServeConfig::from_toml(&with).unwrap();
        assert_eq!(c.control.unwrap().mode_bits().unwrap(), 0o660);
        let bad = format!("{SAMPLE}\n[control]\nsocket = \"/c\"\nmode = \"rw\"\n");
        assert!(
            err_of(&bad).starts_with("control.mode: "),
            "{}",
            err_of(&bad)
        );
        let clash = format!("{SAMPLE}\n[control]\nsocket = \"/run/vqblk/db.sock\"\n");
        assert!(err_of(&clash).starts_with("control.socket: "));
        assert!(err_of("[control]\nsockets = \"/c\"\n").contains("sockets"));
        assert!(err_of("[iothreads]\ncount = 1\n").starts_with("export: "));
    }

    #[test]
    fn rbd_exports_take_the_ceph_keys_and_only_they() {
        let ok = "[[export]]\nsocket = \"/s\"\nbackend = \"rbd\"\nimage = \"rbd:p/ns/i@snap\"\n\
                  ceph-conf = \"/etc/ceph/c.conf\"\nceph-id = \"vqblk\"\nceph-op-timeout = 5\n";
        let c = ServeConfig::from_toml(ok).unwrap();
        c.validate().unwrap();
        assert_eq!(c.exports[0].ceph_id.as_deref(), Some("vqblk"));
        assert_eq!(c.exports[0].ceph_op_timeout, Some(5));
        let rbd = "[[export]]\nsocket = \"/s\"\nbackend = \"rbd\"\n";
        for (extra, want) in [
            ("", "export[0].image: missing"),
            (
                "image = \"rbd:pool\"",
                "export[0].image: \"rbd:pool\" is not an RBD image",
            ),
            (
                "image = \"rbd:p/i\"\ncreate = \"1G\"",
                "export[0].create: not for the rbd",
            ),
            (
                "image = \"rbd:p/i\"\nsize = \"1G\"",
                "export[0].size: not for the rbd",
            ),
            (
                "image = \"rbd:p/i\"\nceph-op-timeout = 0",
                "export[0].ceph-op-timeout: 0",
            ),
        ] {
            let e = err_of(&format!("{rbd}{extra}"));
            assert!(e.starts_with(want), "{extra}: {e}");
        }
        let file = "[[export]]\nsocket = \"/s\"\nimage = \"/i\"\n";
        assert!(err_of(&format!("{file}ceph-id = \"x\"")).starts_with("export[0].ceph-id: only"));
        let e = err_of("[[export]]\nsocket = \"/s\"\nimage = \"rbd:p/i\"\n");
        assert!(e.starts_with("export[0].backend: an rbd: image"), "{e}");
    }

    fn err_of(text: &str) -> String {
        match ServeConfig::from_toml(text) {
            Err(e) => e.to_string(),
            Ok(c) => c.validate().unwrap_err().to_string(),
        }
    }

    #[test]
    fn errors_name_the_field() {
        let base = "[[export]]\nsocket = \"/tmp/s\"\nimage = \"/tmp/i\"\n";
        assert!(
            err_of(&format!("{base}queues = 0")).starts_with("export[0].queues: 0 is out of range")
        );
        assert!(err_of(&format!("{base}queue-size = 100")).starts_with("export[0].queue-size"));
        assert!(err_of(&format!("{base}iothreads = [3]"))
            .starts_with("export[0].iothreads: IOThread 3 does not exist"));
        assert!(err_of(&format!(
            "{base}queues = 2\niothread-vq-mapping = [{{iothread = 0, vqs = [0]}}]"
        ))
        .contains("virtqueue 1 is not assigned"));
        assert!(err_of(&format!(
            "{base}iothreads = [0]\niothread-vq-mapping = [{{iothread = 0, vqs = [0]}}]"
        ))
        .contains("cannot be combined"));
        assert!(err_of(&format!("{base}serial = \"123456789012345678901\""))
            .starts_with("export[0].serial"));
        assert!(
            err_of(&format!("{base}socket-mode = \"999\"")).starts_with("export[0].socket-mode")
        );
        assert!(err_of(&format!("{base}bogus = 1")).contains("unknown field `bogus`"));
        assert!(
            err_of("[iothreads]\ncount = 0\n[[export]]\nsocket = \"/s\"\nimage = \"/i\"")
                .starts_with("iothreads.count")
        );
        assert!(
            err_of("[[export]]\nsocket = \"/s\"\nbackend = \"null\"").starts_with("export[0].size")
        );
        assert!(err_of("[[export]]\nsocket = \"/s\"").starts_with("export[0].image: missing"));
        assert!(err_of(&format!(
            "{base}[[export]]\nsocket = \"/tmp/s\"\nimage = \"/i\""
        ))
        .starts_with("export[1].socket"));
        assert!(err_of("[iothreads]\ncount = 2\n[[iothreads.thread]]\nid = 0\ncpuset = \"x\"\n[[export]]\nsocket = \"/s\"\nimage = \"/i\"")
            .starts_with("iothreads.thread[0].cpuset"));
    }

    #[test]
    fn polling_settings_per_thread_and_defaults() {
        let text = "[iothreads]\ncount = 3\npoll = \"classic\"\npoll-max-ns = 50000\n\
                    [[iothreads.thread]]\nid = 1\npoll = \"busy\"\n\
                    [[iothreads.thread]]\nid = 2\npoll-weight = 2\npoll = \"weighted\"\n\
                    [[export]]\nsocket = \"/s\"\nimage = \"/i\"\n";
        let c = ServeConfig::from_toml(text).unwrap();
        c.validate().unwrap();
        let (m0, p0) = c.iothreads.poll_for(0);
        assert_eq!((m0, p0.poll_max_ns), (PollMode::Classic, 50000));
        assert_eq!(c.iothreads.poll_for(1).0, PollMode::Busy);
        let (m2, p2) = c.iothreads.poll_for(2);
        assert_eq!(
            (m2, p2.poll_weight, p2.poll_max_ns),
            (PollMode::Weighted, 2, 50000)
        );
        // Defaults: our adaptive mode with QEMU's knobs; poll-weight alone picks QEMU's algorithm.
        let d = PollConfig::default().resolve();
        assert_eq!((d.0, d.1.poll_max_ns), (DEFAULT_POLL_MODE, 32768));
        let w0 = PollConfig {
            poll_weight: Some(0),
            ..Default::default()
        }
        .resolve();
        assert_eq!(w0.0, PollMode::Classic);
        let w3 = PollConfig {
            poll_weight: Some(3),
            ..Default::default()
        }
        .resolve();
        assert_eq!(w3.0, PollMode::Weighted);
        assert!(err_of(
            "[iothreads]\npoll-weight = 99\n[[export]]\nsocket = \"/s\"\nimage = \"/i\""
        )
        .starts_with("iothreads.poll-weight"));
        assert!(err_of(
            "[iothreads]\npoll = \"sometimes\"\n[[export]]\nsocket = \"/s\"\nimage = \"/i\""
        )
        .contains("sometimes"));
        assert!(
            err_of("[iothreads]\nbogus = 1\n[[export]]\nsocket = \"/s\"\nimage = \"/i\"")
                .contains("bogus"),
            "unknown keys in [iothreads] are refused"
        );
    }

    /// `[export.throttle]`: QEMU's keys, QEMU's rules, errors naming the field.
    #[test]
    fn export_throttle_keys() {
        use crate::qos::{BucketKind, BucketLimit};
        let base = "[[export]]\nsocket = \"/s\"\nimage = \"/i\"\n";
        let c = ServeConfig::from_toml(&format!(
            "{base}[export.throttle]\niops-total = 1000\niops-total-max = 2000\n\
             iops-total-max-length = 10\nbps-read = 1000000\niops-size = 4096\n"
        ))
        .unwrap();
        let limits = c.validate().unwrap()[0].throttle.unwrap();
        assert_eq!(
            limits.bucket(BucketKind::IopsTotal),
            BucketLimit {
                avg: 1000,
                max: 2000,
                max_length: 10
            }
        );
        assert_eq!(limits.bucket(BucketKind::BpsRead).avg, 1_000_000);
        assert_eq!(limits.iops_size(), 4096);
        // No table, or only zeroes (QEMU's "no limit"): nothing to enforce.
        assert!(ServeConfig::from_toml(base).unwrap().validate().unwrap()[0]
            .throttle
            .is_none());
        let zero = format!("{base}[export.throttle]\niops-total = 0\n");
        assert!(
            ServeConfig::from_toml(&zero).unwrap().validate().unwrap()[0]
                .throttle
                .is_none()
        );
        let second = "[[export]]\nsocket = \"/s2\"\nimage = \"/i2\"\n";
        for (text, want) in [
            (
                format!("{base}[export.throttle]\niops-total = 100\niops-read = 10"),
                "export[0].throttle.iops-read: cannot be combined with iops-total",
            ),
            (
                format!("{base}{second}[export.throttle]\niops-total-max = 10"),
                "export[1].throttle.iops-total-max: needs iops-total",
            ),
            (
                format!("{base}[export.throttle]\nbps-write = 10\nbps-write-max = 5"),
                "export[0].throttle.bps-write-max: 5 is below",
            ),
            (
                format!("{base}[export.throttle]\nbps-total = 10\nbps-total-max-length = 5"),
                "export[0].throttle.bps-total-max-length: needs bps-total-max",
            ),
            (
                format!("{base}[export.throttle]\niops-size = 512"),
                "export[0].throttle.iops-size: needs an iops limit",
            ),
        ] {
            assert!(err_of(&text).starts_with(want), "{text}: {}", err_of(&text));
        }
        let typo = err_of(&format!("{base}[export.throttle]\niops-totl = 1"));
        assert!(typo.contains("unknown field `iops-totl`"), "{typo}");
    }

    /// `[[throttle-group]]` and `throttle-group = "NAME"`.
    #[test]
    fn throttle_groups() {
        let group = "[[throttle-group]]\nname = \"tenant-a\"\niops-total = 1000\n";
        let member = |socket: &str, extra: &str| {
            format!(
                "[[export]]\nsocket = \"{socket}\"\nimage = \"/i\"\n\
                 throttle-group = \"tenant-a\"\n{extra}"
            )
        };
        let text = format!("{group}{}{}", member("/a", ""), member("/b", ""));
        let c = ServeConfig::from_toml(&text).unwrap();
        let plans = c.validate().unwrap();
        assert!(
            plans.iter().all(|p| p.throttle.is_none()),
            "the group's, not their own"
        );
        let groups = c.throttle_group_plans().unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].name, "tenant-a");
        assert_eq!(
            groups[0]
                .limits
                .bucket(crate::qos::BucketKind::IopsTotal)
                .avg,
            1000
        );
        // A group nobody joins yet is fine (exports may join it live).
        assert!(
            ServeConfig::from_toml(&format!("{group}[control]\nsocket = \"/c\"\n"))
                .unwrap()
                .validate()
                .is_ok()
        );
        for (text, want) in [
            (
                member("/a", "").replace("tenant-a", "nope"),
                "export[0].throttle-group: export \"export0\" joins \"nope\", which is not",
            ),
            (
                format!(
                    "{group}{}",
                    member("/a", "[export.throttle]\niops-total = 5\n")
                ),
                "export[0].throttle: cannot be combined with throttle-group = \"tenant-a\"",
            ),
            (
                format!("{group}{group}{}", member("/a", "")),
                "throttle-group[1].name: \"tenant-a\" is the name of another group",
            ),
            (
                format!("{}{}", group.replace("tenant-a", "1x"), member("/a", "")),
                "throttle-group[0].name: \"1x\" is not a name",
            ),
            (
                format!("{group}bps-total = 1\nbps-read = 1\n{}", member("/a", "")),
                "throttle-group[0].bps-read: cannot be combined with bps-total",
            ),
        ] {
            assert!(err_of(&text).starts_with(want), "{text}: {}", err_of(&text));
        }
        let typo = err_of(&format!("{group}bogus = 1\n{}", member("/a", "")));
        assert!(
            typo.contains("bogus"),
            "unknown keys in a group are refused: {typo}"
        );
    }

    /// `weight` and `reservation-iops`: weights from 1, and reservations that
    /// cannot be nonsense (above the export's or its group's own limit, or
    /// more in all on one image than any device does).
    #[test]
    fn weights_and_reservations() {
        let export = |socket: &str, extra: &str| {
            format!("[[export]]\nsocket = \"{socket}\"\nimage = \"/i\"\n{extra}\n")
        };
        let ok = format!(
            "{}{}",
            export("/a", "reservation-iops = 3000\nweight = 1"),
            export("/b", "weight = 3")
        );
        let c = ServeConfig::from_toml(&ok).unwrap();
        c.validate().unwrap();
        assert_eq!(c.exports[0].reservation_iops, Some(3000));
        assert_eq!(c.exports[1].weight, Some(3));
        let group = "[[throttle-group]]\nname = \"g\"\niops-read = 400\niops-write = 600\n";
        for (text, want) in [
            (export("/a", "weight = 0"), "export[0].weight: 0 is out of range"),
            (
                export("/a", "weight = 10001"),
                "export[0].weight: 10001 is out of range",
            ),
            (
                export("/a", "reservation-iops = 20000000"),
                "export[0].reservation-iops: 20000000 is more than a device does",
            ),
            (
                export("/a", "reservation-iops = 5000\n[export.throttle]\niops-total = 1000"),
                "export[0].reservation-iops: 5000 is above the export's own limit of 1000",
            ),
            (
                format!(
                    "{}{}",
                    export("/a", "reservation-iops = 6000000"),
                    export("/b", "reservation-iops = 6000000")
                ),
                "export[1].reservation-iops: the exports of /i reserve 12000000 IOPS in all",
            ),
            (
                format!(
                    "{group}{}{}",
                    export("/a", "throttle-group = \"g\"\nreservation-iops = 600"),
                    export("/b", "throttle-group = \"g\"\nreservation-iops = 600")
                ),
                "export[1].reservation-iops: the members of throttle group \"g\" reserve 1200 IOPS in all, above the group's limit of 1000",
            ),
        ] {
            assert!(err_of(&text).starts_with(want), "{text}: {}", err_of(&text));
        }
        // Reservations on different images do not add up; within a group's limit they fit.
        let fits = format!(
            "{group}{}{}",
            export("/a", "throttle-group = \"g\"\nreservation-iops = 500"),
            export("/b", "throttle-group = \"g\"\nreservation-iops = 500")
                .replace("\"/i\"", "\"/j\"")
        );
        ServeConfig::from_toml(&fits).unwrap().validate().unwrap();
    }

    #[test]
    fn sizes_and_cpusets() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_cpuset("0-2,5").unwrap(), vec![0, 1, 2, 5]);
        assert!(parse_cpuset("3-1").is_err());
    }
}
