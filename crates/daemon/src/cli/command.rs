//! The `vqblk serve` command line built from typed values: what a program that
//! starts the daemon (the study's sweep, tests, scripts) uses instead of writing
//! flags by hand. Every flag of [`ServeArgs`](super::ServeArgs) has a field here,
//! and the unit tests parse what [`ServeCommand::args`] produces with the real clap
//! parser, so the two cannot drift apart.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::ValueEnum;

use crate::config::{BackendKind, CacheMode};
use crate::mapping::Assignment;
use crate::poll::PollMode;

/// One IOThread pinned to a CPU set (`--iothread-pin ID=CPUSET`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoThreadPin {
    /// Index of the IOThread in the pool.
    pub iothread: usize,
    /// CPU list in `taskset` syntax, e.g. `0-1,4`.
    pub cpuset: String,
}

/// The arguments of one `vqblk serve` process. A `None` (or `false`, or empty)
/// field leaves its flag out, so the daemon's default applies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServeCommand {
    /// `--config FILE`: a TOML configuration (conflicts with the export flags).
    pub config: Option<PathBuf>,
    /// `--image PATH`: raw image file or block device to export.
    pub image: Option<PathBuf>,
    /// `--socket PATH`: the vhost-user socket to listen on.
    pub socket: Option<PathBuf>,
    /// `--name NAME`: the export's name.
    pub name: Option<String>,
    /// `--queues N`: number of virtqueues.
    pub queues: Option<u16>,
    /// `--queue-size N`: largest virtqueue size.
    pub queue_size: Option<u16>,
    /// `--iothreads N`: IOThreads in the pool.
    pub iothreads: Option<usize>,
    /// `--iothreads auto` (instead of a count): the pool tuned online.
    pub iothreads_auto: bool,
    /// `--cpu-budget CORES`: with `--iothreads auto`, most cores active.
    pub cpu_budget: Option<f64>,
    /// `--iothread-pin ID=CPUSET`, once per pinned IOThread.
    pub iothread_pins: Vec<IoThreadPin>,
    /// `--poll MODE`: the polling algorithm.
    pub poll: Option<PollMode>,
    /// `--poll-max-ns NS`: longest polling window.
    pub poll_max_ns: Option<u64>,
    /// `--poll-grow N`: polling window growth factor.
    pub poll_grow: Option<u64>,
    /// `--poll-shrink N`: polling window shrink divisor.
    pub poll_shrink: Option<u64>,
    /// `--poll-weight N`: weighted polling EWMA weight.
    pub poll_weight: Option<u32>,
    /// `--map SPEC`: explicit virtqueue-to-IOThread mapping.
    pub map: Option<Vec<Assignment>>,
    /// `--backend KIND`: the request engine.
    pub backend: Option<BackendKind>,
    /// `--cache MODE`: host page-cache use.
    pub cache: Option<CacheMode>,
    /// `--read-only`.
    pub read_only: bool,
    /// `--serial TEXT`: the GET_ID serial number.
    pub serial: Option<String>,
    /// `--size BYTES`: capacity of a null export.
    pub size: Option<u64>,
    /// `--latency-ns NS`: the null backend's completion delay.
    pub latency_ns: Option<u64>,
    /// `--read-zeroes on|off`: whether the null backend's reads write zeroes.
    pub read_zeroes: Option<bool>,
    /// `--create BYTES`: create a sparse image of this size if it is missing.
    pub create: Option<u64>,
    /// `--socket-mode MODE`: permission bits of the socket file (written in octal).
    pub socket_mode: Option<u32>,
    /// `--log-level LEVEL`.
    pub log_level: Option<log::LevelFilter>,
    /// `--stats-file FILE`: statistics JSON written on exit and on SIGUSR1.
    pub stats_file: Option<PathBuf>,
    /// `--seccomp MODE`: seccomp filters on, log or off.
    pub seccomp: Option<crate::seccomp::SeccompMode>,
    /// `--memory-sealing POLICY`: refuse (required) or accept (preferred)
    /// frontend memory that cannot be sealed against shrinking.
    pub memory_sealing: Option<crate::fault::MemorySealing>,
    /// `--bounce-buffer-max BYTES`: bounce-buffer memory per IOThread.
    pub bounce_buffer_max: Option<u64>,
    /// `--takeover`: wait for a running daemon to release the sockets.
    pub takeover: bool,
    /// `--control PATH`: the JSON-RPC control socket.
    pub control: Option<PathBuf>,
    /// `--metrics ADDR:PORT`: serve Prometheus metrics there (a bare port: loopback).
    pub metrics: Option<String>,
    /// `--ceph-conf PATH`: the rbd backend's ceph.conf.
    pub ceph_conf: Option<PathBuf>,
    /// `--ceph-id NAME`: the rbd backend's cephx user.
    pub ceph_id: Option<String>,
    /// `--ceph-op-timeout SECONDS`: the rbd backend's request timeout.
    pub ceph_op_timeout: Option<u64>,
    /// `--shutdown-timeout SECONDS`: how long a shutdown may take in total.
    pub shutdown_timeout: Option<u64>,
    /// `--throttle LIMITS`: the export's I/O limits, QEMU's keys as
    /// `KEY=VALUE,...`.
    pub throttle: Option<String>,
}

/// The name clap gives a `ValueEnum` value on the command line.
fn value_name<E: ValueEnum>(v: &E) -> OsString {
    v.to_possible_value()
        .expect("no value of the daemon's enums is skipped")
        .get_name()
        .into()
}

/// `--map`'s syntax: `IOTHREAD:VQ,VQ;IOTHREAD:VQ,...`.
fn map_spec(map: &[Assignment]) -> String {
    map.iter()
        .map(|a| {
            let vqs: Vec<String> = a.vqs.iter().map(u16::to_string).collect();
            format!("{}:{}", a.iothread, vqs.join(","))
        })
        .collect::<Vec<_>>()
        .join(";")
}

impl ServeCommand {
    /// The flags that follow `vqblk serve`, in a fixed order.
    pub fn args(&self) -> Vec<OsString> {
        let mut v = Vec::new();
        let mut flag = |name: &str, value: OsString| {
            v.push(OsString::from(name));
            v.push(value);
        };
        let path = |p: &PathBuf| p.as_os_str().to_os_string();
        let text = |t: &dyn ToString| OsString::from(t.to_string());
        if let Some(p) = &self.config {
            flag("--config", path(p));
        }
        if let Some(b) = &self.backend {
            flag("--backend", value_name(b));
        }
        if let Some(n) = self.size {
            flag("--size", text(&n));
        }
        if let Some(n) = self.latency_ns {
            flag("--latency-ns", text(&n));
        }
        if let Some(z) = self.read_zeroes {
            flag("--read-zeroes", (if z { "on" } else { "off" }).into());
        }
        if let Some(p) = &self.image {
            flag("--image", path(p));
        }
        if let Some(n) = self.create {
            flag("--create", text(&n));
        }
        if let Some(p) = &self.ceph_conf {
            flag("--ceph-conf", path(p));
        }
        if let Some(n) = &self.ceph_id {
            flag("--ceph-id", n.into());
        }
        if let Some(n) = self.ceph_op_timeout {
            flag("--ceph-op-timeout", text(&n));
        }
        if let Some(n) = self.shutdown_timeout {
            flag("--shutdown-timeout", text(&n));
        }
        if let Some(c) = &self.cache {
            flag("--cache", value_name(c));
        }
        if let Some(p) = &self.socket {
            flag("--socket", path(p));
        }
        if let Some(m) = self.socket_mode {
            flag("--socket-mode", format!("0{m:o}").into());
        }
        if let Some(n) = &self.name {
            flag("--name", n.into());
        }
        if let Some(s) = &self.serial {
            flag("--serial", s.into());
        }
        if let Some(n) = self.queues {
            flag("--queues", text(&n));
        }
        if let Some(n) = self.queue_size {
            flag("--queue-size", text(&n));
        }
        if let Some(n) = self.iothreads {
            flag("--iothreads", text(&n));
        }
        if self.iothreads_auto {
            flag("--iothreads", "auto".into());
        }
        if let Some(b) = self.cpu_budget {
            flag("--cpu-budget", text(&b));
        }
        for pin in &self.iothread_pins {
            let spec = format!("{}={}", pin.iothread, pin.cpuset);
            flag("--iothread-pin", spec.into());
        }
        if let Some(m) = &self.map {
            flag("--map", map_spec(m).into());
        }
        self.poll_args(&mut flag);
        if let Some(l) = self.log_level {
            flag("--log-level", l.as_str().to_ascii_lowercase().into());
        }
        if let Some(p) = &self.stats_file {
            flag("--stats-file", path(p));
        }
        if let Some(m) = &self.seccomp {
            flag("--seccomp", value_name(m));
        }
        if let Some(p) = &self.memory_sealing {
            flag("--memory-sealing", value_name(p));
        }
        if let Some(b) = self.bounce_buffer_max {
            flag("--bounce-buffer-max", b.to_string().into());
        }
        if let Some(p) = &self.control {
            flag("--control", path(p));
        }
        if let Some(m) = &self.metrics {
            flag("--metrics", m.into());
        }
        if let Some(t) = &self.throttle {
            flag("--throttle", t.into());
        }
        if self.read_only {
            v.push("--read-only".into());
        }
        if self.takeover {
            v.push("--takeover".into());
        }
        v
    }

    fn poll_args(&self, flag: &mut impl FnMut(&str, OsString)) {
        if let Some(m) = &self.poll {
            flag("--poll", value_name(m));
        }
        let knobs = [
            ("--poll-max-ns", self.poll_max_ns),
            ("--poll-grow", self.poll_grow),
            ("--poll-shrink", self.poll_shrink),
            ("--poll-weight", self.poll_weight.map(u64::from)),
        ];
        for (name, value) in knobs {
            if let Some(n) = value {
                flag(name, n.to_string().into());
            }
        }
    }

    /// The whole command line: `exe serve FLAGS...`.
    pub fn argv(&self, exe: &Path) -> Vec<OsString> {
        let mut v = vec![exe.as_os_str().to_os_string(), OsString::from("serve")];
        v.extend(self.args());
        v
    }

    /// A [`Command`] that runs `exe serve FLAGS...`.
    pub fn command(&self, exe: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new(exe);
        c.arg("serve").args(self.args());
        c
    }
}

#[cfg(test)]
mod tests;
