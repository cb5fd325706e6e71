//! `vqblk serve` command line: flags are the one-export shorthand of the TOML
//! model; both end in a [`ServeConfig`].

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use log::{error, info};

use crate::config::{BackendKind, CacheMode, ExportConfig, IoThreadConfig, ServeConfig};
use crate::daemon::{handover, Daemon};
use crate::mapping::VirtqueueMap;
use crate::metrics::MetricsServer;

mod command;
pub use command::{IoThreadPin, ServeCommand};

/// Directory of the built-in default export (`vqblk serve` with no export flags).
pub const DEFAULT_DIR: &str = "vqblk-default";
/// Size of the built-in default image.
pub const DEFAULT_SIZE: &str = "1G";

/// Options of `vqblk serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML configuration file (`[iothreads]` and `[[export]]` tables).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["image", "socket", "backend", "ceph_conf", "ceph_id", "ceph_op_timeout", "map", "poll", "poll_max_ns", "poll_grow", "poll_shrink", "poll_weight", "throttle"])]
    pub config: Option<PathBuf>,
    /// Raw image file or block device to export.
    #[arg(long, value_name = "PATH")]
    pub image: Option<PathBuf>,
    /// vhost-user socket path to listen on.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Export name (logs, statistics, default serial).
    #[arg(long)]
    pub name: Option<String>,
    /// Number of virtqueues.
    #[arg(long, default_value_t = 1)]
    pub queues: u16,
    /// Largest virtqueue size.
    #[arg(long, default_value_t = 256)]
    pub queue_size: u16,
    /// Number of IOThreads in the pool, or `auto`: one per host CPU (not
    /// pinned: the TOML's `[iothreads] cpuset` pins one to each of its
    /// CPUs), the active ones and the queue placement tuned online
    /// (docs/autotune.md).
    #[arg(long, default_value = "1", value_name = "N|auto")]
    pub iothreads: IoThreadsArg,
    /// With `--iothreads auto`: most cores the active IOThreads may take.
    #[arg(long, value_name = "CORES")]
    pub cpu_budget: Option<f64>,
    /// Pin an IOThread: ID=CPUSET (repeatable), like libvirt `<iothreadpin>`.
    #[arg(long = "iothread-pin", value_name = "ID=CPUSET")]
    pub iothread_pin: Vec<String>,
    /// Polling algorithm of every IOThread: off, classic (QEMU), weighted
    /// (QEMU poll-weight), busy (spin, like SPDK) or adaptive (default).
    #[arg(long, value_enum)]
    pub poll: Option<crate::poll::PollMode>,
    /// Longest polling window in ns (QEMU poll-max-ns; 0 = never poll).
    #[arg(long)]
    pub poll_max_ns: Option<u64>,
    /// Polling window growth factor (QEMU poll-grow; 0 = x2).
    #[arg(long)]
    pub poll_grow: Option<u64>,
    /// Polling window shrink divisor (QEMU poll-shrink; 0 = reset).
    #[arg(long)]
    pub poll_shrink: Option<u64>,
    /// Weighted polling EWMA weight (QEMU poll-weight; 0 = classic).
    #[arg(long)]
    pub poll_weight: Option<u32>,
    /// Explicit virtqueue mapping, IOTHREAD:VQ,VQ;... (QEMU iothread-vq-mapping).
    #[arg(long, value_name = "SPEC")]
    pub map: Option<String>,
    /// Request engine.
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Host page cache: none (O_DIRECT) or writeback.
    #[arg(long, value_enum, default_value = "none")]
    pub cache: CacheMode,
    /// Export read-only.
    #[arg(long)]
    pub read_only: bool,
    /// Serial number (GET_ID, at most 20 bytes).
    #[arg(long)]
    pub serial: Option<String>,
    /// Size of a null export (e.g. 1G).
    #[arg(long)]
    pub size: Option<String>,
    /// Null backend: complete each request this many ns after submission, like
    /// QEMU's null-co latency-ns (a stand-in for a device's latency).
    #[arg(long, value_name = "NS")]
    pub latency_ns: Option<u64>,
    /// Null backend: whether reads write zeroes into the guest's buffers
    /// (`on`, the default) or leave them as they are (`off`: no data is
    /// transferred at all, like QEMU's null-co read-zeroes=off and SPDK's
    /// null bdev; for measuring the request path alone).
    #[arg(long, value_name = "on|off", value_parser = clap::builder::BoolishValueParser::new())]
    pub read_zeroes: Option<bool>,
    /// Create the image with this size if it does not exist (sparse).
    #[arg(long, value_name = "SIZE")]
    pub create: Option<String>,
    /// rbd backend: ceph.conf to read (default: librados's search, $CEPH_CONF first).
    #[arg(long, value_name = "PATH")]
    pub ceph_conf: Option<PathBuf>,
    /// rbd backend: cephx user without "client." (default admin); the keyring
    /// comes from the configuration.
    #[arg(long, value_name = "NAME")]
    pub ceph_id: Option<String>,
    /// rbd backend: seconds before a request to an unreachable cluster fails
    /// (rados_osd_op_timeout; default 30).
    #[arg(long, value_name = "SECONDS")]
    pub ceph_op_timeout: Option<u64>,
    /// I/O limits of the export with QEMU's throttling keys, KEY=VALUE,...
    /// (e.g. iops-total=1000,iops-total-max=2000; a `throttling.` prefix, as in
    /// QEMU's -drive, is accepted). docs/qos.md lists the keys.
    #[arg(long, value_name = "LIMITS")]
    pub throttle: Option<String>,
    /// Socket file mode, octal.
    #[arg(long, value_name = "MODE")]
    pub socket_mode: Option<String>,
    /// Log level: error, warn, info, debug, trace.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Replace a running `vqblk serve` on the same sockets (binary upgrade): the
    /// running daemon hands over each export's socket and live connection (the
    /// frontend sees no disconnect) and is then sent SIGTERM. An export it
    /// cannot hand over (another version, or no daemon answering) is waited
    /// for until its socket is released (the old daemon, sent SIGTERM, drains
    /// its requests and removes it; a killed one leaves a dead socket), then
    /// bound: QEMU's `reconnect-ms` reattaches those guests (docs/qemu.md,
    /// "Upgrade").
    #[arg(long)]
    pub takeover: bool,
    /// Write the statistics as JSON to this file on exit and on SIGUSR1.
    #[arg(long, value_name = "FILE")]
    pub stats_file: Option<PathBuf>,
    /// seccomp filters per thread kind: on (a forbidden system call stops the
    /// daemon with a message), log (the kernel logs it) or off. Default on;
    /// overrides `seccomp` of --config.
    #[arg(long, value_enum, value_name = "MODE")]
    pub seccomp: Option<crate::seccomp::SeccompMode>,
    /// Frontend memory (guest memory, inflight region, dirty log) that cannot
    /// be sealed against shrinking: required refuses it and disconnects the
    /// frontend; preferred (the default) accepts it, and a frontend that
    /// truncates it ends only its own connection (docs/security.md).
    /// Overrides `memory-sealing` of --config.
    #[arg(long, value_enum, value_name = "POLICY")]
    pub memory_sealing: Option<crate::fault::MemorySealing>,
    /// Listen for JSON-RPC control requests (`vqblk ctl`, `vqblk top`) on this
    /// unix socket (mode 0600). Overrides `[control] socket` of --config.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Most bounce-buffer memory per IOThread (e.g. 64M, the default); a request
    /// beyond it waits. Overrides `iothreads.bounce-buffer-max` of --config.
    #[arg(long, value_name = "SIZE")]
    pub bounce_buffer_max: Option<String>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics; a bare PORT means
    /// 127.0.0.1 (port 0: any free port, printed at start). Overrides
    /// `[metrics] listen` of --config.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics: Option<String>,
    /// Give a shutdown (SIGTERM, SIGINT) this many seconds in total, then exit
    /// with status 1 without finishing it (a drain, flush or close waiting on
    /// an unreachable Ceph cluster, say). Default: wait for every step. A
    /// SIGINT during the shutdown (Ctrl-C again) exits at once. Overrides
    /// `shutdown-timeout` of --config.
    #[arg(long, value_name = "SECONDS")]
    pub shutdown_timeout: Option<u64>,
}

/// `--iothreads`: a count, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoThreadsArg {
    /// A fixed pool of this many IOThreads.
    Count(usize),
    /// Tuned online.
    Auto,
}

impl std::str::FromStr for IoThreadsArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(IoThreadsArg::Auto),
            n => n
                .parse()
                .map(IoThreadsArg::Count)
                .map_err(|_| format!("{n:?} is neither a number nor \"auto\"")),
        }
    }
}

impl ServeArgs {
    /// Builds the serve model these flags describe. Returns it and whether it is
    /// the built-in default.
    pub fn to_config(&self) -> Result<(ServeConfig, bool), String> {
        if let Some(path) = &self.config {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--config {}: {e}", path.display()))?;
            let mut cfg =
                ServeConfig::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))?;
            self.apply_process_flags(&mut cfg);
            return Ok((cfg, false));
        }
        let default = self.image.is_none() && self.backend != Some(BackendKind::Null);
        let mut e = ExportConfig::new(self.socket.clone().unwrap_or_default());
        let (mut queues, mut iothreads, mut create) =
            (self.queues, self.iothreads, self.create.clone());
        if default {
            // The built-in default: a sparse image under a clearly named path.
            let dir = PathBuf::from(DEFAULT_DIR);
            e.image = Some(dir.join("disk.raw"));
            if self.socket.is_none() {
                e.socket = dir.join("disk.sock");
            }
            if queues == 1 {
                queues = 4;
            }
            if iothreads == IoThreadsArg::Count(1) {
                iothreads = IoThreadsArg::Count(2);
            }
            create = create.or(Some(DEFAULT_SIZE.into()));
            std::fs::create_dir_all(&dir).map_err(|err| format!("{DEFAULT_DIR}: {err}"))?;
        } else {
            if self.socket.is_none() {
                return Err("--socket: missing (the vhost-user socket path to listen on)".into());
            }
            e.image = self.image.clone();
        }
        e.name = self.name.clone();
        e.queues = queues;
        e.queue_size = self.queue_size;
        // An rbd: image selects the rbd backend unless another is named.
        let rbd_image = e
            .image
            .as_deref()
            .is_some_and(crate::block::rbd::is_rbd_image);
        e.backend = self.backend.unwrap_or(if rbd_image {
            BackendKind::Rbd
        } else {
            BackendKind::IoUring
        });
        e.ceph_conf = self.ceph_conf.clone();
        e.ceph_id = self.ceph_id.clone();
        e.ceph_op_timeout = self.ceph_op_timeout;
        e.cache = self.cache;
        e.read_only = self.read_only;
        e.serial = self.serial.clone();
        e.size = self.size.clone();
        e.latency_ns = self.latency_ns;
        e.read_zeroes = self.read_zeroes;
        e.create = create;
        e.socket_mode = self.socket_mode.clone();
        if let Some(limits) = &self.throttle {
            e.throttle = Some(parse_throttle(limits).map_err(|m| format!("--throttle: {m}"))?);
        }
        if let Some(spec) = &self.map {
            e.iothread_vq_mapping =
                Some(VirtqueueMap::parse_spec(spec).map_err(|m| format!("--map: {m}"))?);
        }
        let mut cfg = ServeConfig {
            exports: vec![e],
            ..Default::default()
        };
        match iothreads {
            IoThreadsArg::Count(n) => cfg.iothreads.count = n,
            IoThreadsArg::Auto => cfg.iothreads.auto = true,
        }
        cfg.iothreads.cpu_budget = self.cpu_budget;
        cfg.iothreads.poll = crate::config::PollConfig {
            poll: self.poll,
            poll_max_ns: self.poll_max_ns,
            poll_grow: self.poll_grow,
            poll_shrink: self.poll_shrink,
            poll_weight: self.poll_weight,
        };
        for pin in &self.iothread_pin {
            let (id, cpuset) = pin
                .split_once('=')
                .ok_or_else(|| format!("--iothread-pin: {pin:?} is not ID=CPUSET (e.g. 0=2-3)"))?;
            let id = id
                .trim()
                .parse()
                .map_err(|_| format!("--iothread-pin: {id:?} is not an IOThread index"))?;
            cfg.iothreads.threads.push(IoThreadConfig {
                id,
                cpuset: Some(cpuset.to_string()),
                ..Default::default()
            });
        }
        self.apply_process_flags(&mut cfg);
        Ok((cfg, default))
    }

    /// Flags that also apply on top of a --config file.
    fn apply_process_flags(&self, cfg: &mut ServeConfig) {
        if let Some(m) = self.seccomp {
            cfg.seccomp = m;
        }
        if let Some(p) = self.memory_sealing {
            cfg.memory_sealing = p;
        }
        if let Some(b) = &self.bounce_buffer_max {
            cfg.iothreads.bounce_buffer_max = Some(b.clone());
        }
        if let Some(socket) = &self.control {
            let mode = cfg.control.take().and_then(|c| c.mode);
            cfg.control = Some(crate::config::ControlConfig {
                socket: socket.clone(),
                mode,
            });
        }
        if let Some(m) = &self.metrics {
            cfg.metrics = Some(crate::config::MetricsConfig { listen: m.clone() });
        }
        if let Some(t) = self.shutdown_timeout {
            cfg.shutdown_timeout = Some(t);
        }
    }
}

pub use crate::logging::init_logging;

/// Parses `--throttle`: `KEY=VALUE` pairs separated by commas, with QEMU's
/// keys (optionally `throttling.KEY`, as QEMU's `-drive` writes them). Unknown
/// keys are refused; the rules between keys are checked with the rest of the
/// export.
pub fn parse_throttle(spec: &str) -> Result<crate::qos::ThrottleConfig, String> {
    let mut map = serde_json::Map::new();
    for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| format!("{pair:?} is not KEY=VALUE (e.g. iops-total=1000)"))?;
        let key = key.trim();
        let key = key.strip_prefix("throttling.").unwrap_or(key);
        let value: u64 = value
            .trim()
            .parse()
            .map_err(|_| format!("{key}: {value:?} is not a whole number"))?;
        if map.insert(key.to_string(), value.into()).is_some() {
            return Err(format!("{key} is given twice"));
        }
    }
    serde_json::from_value(serde_json::Value::Object(map)).map_err(|e| e.to_string())
}

fn qemu_command_line(socket: &Path, queues: u16) -> String {
    format!(
        "qemu-system-x86_64 -M q35,memory-backend=mem -m 1G \\\n  \
         -object memory-backend-memfd,id=mem,size=1G,share=on \\\n  \
         -chardev socket,id=c0,path={},reconnect-ms=1000 \\\n  \
         -device vhost-user-blk-pci,chardev=c0,num-queues={queues} ...",
        socket.display()
    )
}

/// `--takeover`: waits until no process listens on `path` any more: the file is
/// gone, or it is a socket nobody accepts on (a daemon killed with SIGKILL).
/// The file is checked every 20 ms; a connection attempt (which a live daemon
/// would accept and see closed at once) is made only every second.
fn wait_released(path: &std::path::Path) {
    let mut told = false;
    let mut probe = std::time::Instant::now();
    loop {
        if std::fs::symlink_metadata(path).is_err() {
            return;
        }
        if probe.elapsed() >= std::time::Duration::from_secs(1) || !told {
            probe = std::time::Instant::now();
            if std::os::unix::net::UnixStream::connect(path).is_err() {
                return;
            }
        }
        if !told {
            log::info!(
                "takeover: waiting for the daemon on {} to release it (send it SIGTERM)",
                path.display()
            );
            told = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `--takeover`: asks the running daemon to hand each export over
/// (`daemon::handover`), sends the daemons that did SIGTERM, and waits for
/// the sockets of the others to be released (and for the control socket, if
/// a predecessor is stopping). Returns what was handed over, by export, and
/// the predecessors' pids.
fn take_over(cfg: &ServeConfig) -> (Vec<Option<handover::Arrival>>, Vec<i32>) {
    let arrivals: Vec<_> = cfg
        .exports
        .iter()
        .map(|e| {
            handover::receive(&e.socket, e.queues, e.queue_size).unwrap_or_else(|err| {
                error!("takeover: {}: no handover: {err}", e.socket.display());
                None
            })
        })
        .collect();
    let mut predecessors: Vec<i32> = arrivals.iter().flatten().map(|a| a.predecessor).collect();
    predecessors.sort_unstable();
    predecessors.dedup();
    for &pid in &predecessors {
        info!("takeover: stopping process {pid}, whose exports were handed over");
        // SAFETY: kill(2) takes no pointer.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    for (e, a) in cfg.exports.iter().zip(&arrivals) {
        if a.is_none() {
            wait_released(&e.socket);
        }
    }
    if let Some(c) = cfg.control.as_ref().filter(|_| !predecessors.is_empty()) {
        wait_released(&c.socket);
    }
    (arrivals, predecessors)
}

/// `vqblk serve`: runs until SIGINT/SIGTERM; returns the exit code.
pub fn run_serve(args: ServeArgs) -> i32 {
    if let Err(e) = init_logging(&args.log_level) {
        eprintln!("vqblk serve: {e}");
        return 2;
    }
    let (cfg, default) = match args.to_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vqblk serve: {e}");
            return 2;
        }
    };
    if let Err(e) = cfg.validate() {
        // Name the flag the user typed, or the field of the file.
        let field = if args.config.is_some() {
            e.field.clone()
        } else {
            flag_name(&e.field)
        };
        eprintln!("vqblk serve: {field}: {}", e.message);
        return 2;
    }
    let signals = match signal_hook::iterator::Signals::new(crate::seccomp::HANDLED_SIGNALS) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vqblk serve: cannot install signal handlers: {e}");
            return 1;
        }
    };
    let (arrivals, predecessors) = if args.takeover {
        take_over(&cfg)
    } else {
        (Vec::new(), Vec::new())
    };
    let daemon = match Daemon::start_adopting(&cfg, arrivals) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("vqblk serve: {e}");
            return 2;
        }
    };
    let metrics = match &cfg.metrics {
        None => None,
        Some(m) => {
            let addr = m.addr().expect("validated");
            // A predecessor that handed its exports over may still hold the
            // address for the moment it takes to stop.
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut started = MetricsServer::start(
                addr,
                daemon.iothread_stats(),
                daemon.share_board(),
                daemon.tune_board(),
                cfg.seccomp,
            );
            while started.is_err() && !predecessors.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                started = MetricsServer::start(
                    addr,
                    daemon.iothread_stats(),
                    daemon.share_board(),
                    daemon.tune_board(),
                    cfg.seccomp,
                );
            }
            match started {
                Ok(s) => Some(s),
                Err(e) => {
                    eprintln!("vqblk serve: --metrics {addr}: {e}");
                    return 2;
                }
            }
        }
    };
    if default {
        let e = &cfg.exports[0];
        println!(
            "vqblk: serving the built-in default export: image {} ({} sparse, created if missing), \
             {} queues over {} IOThreads, on socket {}",
            e.image.as_ref().unwrap().display(),
            DEFAULT_SIZE,
            e.queues,
            cfg.iothreads.count,
            e.socket.display()
        );
    }
    for (e, sock) in cfg.exports.iter().zip(daemon.sockets()) {
        let sock = std::path::absolute(&sock).unwrap_or(sock);
        println!(
            "vqblk: attach with:\n{}",
            qemu_command_line(&sock, e.queues)
        );
    }
    if let Some(m) = &metrics {
        println!("vqblk: metrics at http://{}/metrics", m.local_addr());
    }
    let _ = std::io::stdout().flush();
    // Every socket listens: tell systemd (Type=notify), if it asked.
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        error!("sd_notify READY=1: {e}");
    }
    let mut signals = signals;
    for sig in signals.forever() {
        if sig == libc::SIGUSR1 {
            write_stats(&args.stats_file, &daemon.stats());
            continue;
        }
        info!("signal {sig}: shutting down");
        break;
    }
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Stopping]) {
        error!("sd_notify STOPPING=1: {e}");
    }
    spawn_shutdown_watchdog(signals, cfg.shutdown_timeout.map(Duration::from_secs));
    if let Some(m) = metrics {
        m.stop();
    }
    let stats = daemon.shutdown();
    match serde_json::to_string(&stats) {
        Ok(j) => info!("statistics {j}"),
        Err(e) => error!("statistics: {e}"),
    }
    write_stats(&args.stats_file, &stats);
    0
}

/// While the daemon shuts down: a SIGINT, or `timeout` passing, ends the
/// process at once with status 1. Requests still in flight
/// then were never completed to the guest: the frontend resubmits them (from
/// its inflight region, or the guest's driver times out and retries), as
/// after a crash; nothing acknowledged is lost with `cache none`.
fn spawn_shutdown_watchdog(mut signals: signal_hook::iterator::Signals, timeout: Option<Duration>) {
    let deadline = timeout.map(|t| (t, Instant::now() + t));
    let spawned = std::thread::Builder::new()
        .name("vqblk-shutdown".into())
        .spawn(move || loop {
            for sig in signals.pending() {
                // A second Ctrl-C is someone at a terminal who will not wait.
                // SIGTERM again (a supervisor repeating itself) does not cut
                // a clean drain short.
                if sig == libc::SIGINT {
                    exit_now(format_args!(
                        "SIGINT during shutdown: exiting without finishing it"
                    ));
                }
                if sig == libc::SIGTERM {
                    info!(
                        "SIGTERM during shutdown: still shutting down (a SIGINT ends it at once)"
                    );
                }
            }
            if let Some((t, at)) = deadline {
                if Instant::now() >= at {
                    exit_now(format_args!(
                        "shutdown not finished after shutdown-timeout {}s (the last \
                         'shutdown:' line says where it waits): exiting without finishing it",
                        t.as_secs()
                    ));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        });
    if let Err(e) = spawned {
        error!("shutdown watchdog: {e}: shutdown-timeout and a second signal are not honoured");
    }
}

/// Logs `why` and ends the process with status 1, running no exit handler:
/// other threads may be inside librbd or a blocking system call.
fn exit_now(why: std::fmt::Arguments) -> ! {
    error!("{why}");
    log::logger().flush();
    // SAFETY: _exit takes no pointer and never returns; skipping atexit
    // handlers is the point (a library's could wait on a thread that hangs).
    unsafe { libc::_exit(1) }
}

fn write_stats(path: &Option<PathBuf>, stats: &crate::stats::DaemonSnapshot) {
    if let Some(p) = path {
        let json = serde_json::to_string_pretty(stats).unwrap_or_default();
        let tmp = p.with_extension("tmp");
        if let Err(e) = std::fs::write(&tmp, json).and_then(|_| std::fs::rename(&tmp, p)) {
            error!("--stats-file {}: {e}", p.display());
        }
    }
}

/// The command-line flag behind a field of the serve model.
pub fn flag_name(field: &str) -> String {
    let f = field.strip_prefix("export[0].").unwrap_or(field);
    match f {
        f if f.starts_with("iothreads.poll") => format!("--{}", &f["iothreads.".len()..]),
        "iothreads.count" | "iothreads" => "--iothreads".into(),
        "iothreads.cpu-budget" => "--cpu-budget".into(),
        "iothreads.bounce-buffer-max" => "--bounce-buffer-max".into(),
        "control.socket" => "--control".into(),
        "metrics.listen" => "--metrics".into(),
        "iothread-vq-mapping" => "--map".into(),
        f if f.starts_with("throttle.") => format!("--throttle {}", &f["throttle.".len()..]),
        f if f.starts_with("iothreads.thread") => "--iothread-pin".into(),
        f if !f.contains('.') && !f.contains('[') => format!("--{f}"),
        f => f.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poll::PollMode;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: ServeArgs,
    }

    fn config_err(args: &[&str]) -> String {
        let t = T::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).unwrap();
        let (cfg, _) = t.a.to_config().unwrap();
        let e = cfg.validate().unwrap_err();
        format!("{}: {}", flag_name(&e.field), e.message)
    }

    #[test]
    fn an_rbd_image_selects_the_rbd_backend_and_takes_the_ceph_flags() {
        let args = [
            "serve",
            "--image",
            "rbd:p/i",
            "--socket",
            "/s",
            "--ceph-conf",
            "/c.conf",
            "--ceph-id",
            "u",
            "--ceph-op-timeout",
            "9",
        ];
        let (cfg, default) = T::try_parse_from(args).unwrap().a.to_config().unwrap();
        assert!(!default);
        let e = &cfg.exports[0];
        assert_eq!(e.backend, BackendKind::Rbd);
        assert_eq!(e.ceph_conf.as_deref(), Some(Path::new("/c.conf")));
        assert_eq!(
            (e.ceph_id.as_deref(), e.ceph_op_timeout),
            (Some("u"), Some(9))
        );
        cfg.validate().unwrap();
        let e = config_err(&["--image", "/i", "--socket", "/s", "--ceph-id", "u"]);
        assert!(e.starts_with("--ceph-id: only for the rbd backend"), "{e}");
        let e = config_err(&["--image", "rbd:p", "--socket", "/s"]);
        assert!(
            e.starts_with("--image: \"rbd:p\" is not an RBD image"),
            "{e}"
        );
    }

    #[test]
    fn flag_errors_name_the_flag() {
        let base = ["--image", "/i", "--socket", "/s"];
        let with = |extra: &[&str]| config_err(&[&base[..], extra].concat());
        assert!(with(&["--queues", "0"]).starts_with("--queues: 0 is out of range"));
        assert!(with(&["--iothreads", "0"]).starts_with("--iothreads:"));
        assert!(with(&["--queues", "2", "--map", "0:0"])
            .starts_with("--map: virtqueue 1 is not assigned"));
        assert!(with(&["--queue-size", "3"]).starts_with("--queue-size:"));
        assert!(with(&["--size", "1G"]).starts_with("--size:"));
        assert!(with(&["--latency-ns", "1000"]).starts_with("--latency-ns: only the null"));
        assert!(with(&["--read-zeroes", "off"]).starts_with("--read-zeroes: only the null"));
        let null = ["--backend", "null", "--size", "1G", "--socket", "/s"];
        assert!(
            config_err(&[&null[..], &["--latency-ns", "2000000000"]].concat())
                .starts_with("--latency-ns: at most")
        );
        assert!(with(&["--serial", "123456789012345678901"]).starts_with("--serial:"));
        assert!(
            config_err(&[&null[..], &["--shutdown-timeout", "0"]].concat())
                .starts_with("--shutdown-timeout: 0 would give up at once")
        );
    }

    #[test]
    fn flags_build_one_export() {
        let (cfg, default) = config_of(&[
            "--queues",
            "8",
            "--iothreads",
            "4",
            "--iothread-pin",
            "1=0-1",
        ]);
        assert!(!default);
        let plans = cfg.validate().unwrap();
        assert_eq!(plans[0].map.to_string(), "0:0,4;1:1,5;2:2,6;3:3,7");
        assert_eq!(cfg.iothreads.threads[0].cpuset.as_deref(), Some("0-1"));
        let poll_of = |extra: &[&str]| config_of(extra).0.iothreads.poll_for(0);
        assert_eq!(poll_of(&["--poll", "off"]).0, PollMode::Off);
        assert_eq!(poll_of(&["--poll-weight", "0"]).0, PollMode::Classic);
        let (m, p) = poll_of(&["--poll", "weighted", "--poll-weight", "2"]);
        assert_eq!((m, p.poll_weight), (PollMode::Weighted, 2));
    }

    #[test]
    fn throttle_flag_takes_qemu_keys() {
        let (cfg, _) = config_of(&["--throttle", "iops-total=1000,throttling.bps-total=5000000"]);
        let plans = cfg.validate().unwrap();
        let limits = plans[0].throttle.unwrap();
        assert_eq!(limits.to_string(), "bps-total=5000000,iops-total=1000");
        let base = ["--image", "/i", "--socket", "/s", "--throttle"];
        let e = config_err(&[&base[..], &["iops-total=10,iops-write=5"]].concat());
        assert!(
            e.starts_with("--throttle iops-write: cannot be combined with iops-total"),
            "{e}"
        );
        for (spec, want) in [
            ("iops-total", "\"iops-total\" is not KEY=VALUE"),
            (
                "iops-total=ten",
                "iops-total: \"ten\" is not a whole number",
            ),
            ("iops-total=1,iops-total=2", "iops-total is given twice"),
            ("iops-totl=1", "unknown field `iops-totl`"),
        ] {
            let e = parse_throttle(spec).unwrap_err();
            assert!(e.contains(want), "{spec}: {e}");
        }
        assert_eq!(parse_throttle("").unwrap(), Default::default());
    }

    /// The serve model of `--image /i --socket /s` plus `extra` flags.
    fn config_of(extra: &[&str]) -> (ServeConfig, bool) {
        let args = ["serve", "--image", "/i", "--socket", "/s"]
            .iter()
            .chain(extra);
        T::try_parse_from(args).unwrap().a.to_config().unwrap()
    }
}
