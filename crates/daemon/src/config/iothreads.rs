//! The `[iothreads]` table of the serve model: the pool's size, each
//! IOThread's CPUs and polling settings (QEMU's iothread object, libvirt's
//! `<iothreadpin>` and `<poll>`), and the bounce-buffer cap.

use serde::Deserialize;

use super::ConfigError;
use crate::poll::{PollMode, PollParams};
use crate::size::parse_size;

/// One IOThread of the pool.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct IoThreadConfig {
    /// Index of the IOThread in the pool.
    pub id: usize,
    /// Host CPUs to pin the thread to, in cpuset syntax ("2", "4-5", "1,3"),
    /// like libvirt's `<iothreadpin cpuset=...>`.
    #[serde(default)]
    pub cpuset: Option<String>,
    /// Polling settings of this thread (unset ones come from `[iothreads]`).
    #[serde(flatten)]
    pub poll: PollConfig,
}

/// The `[iothreads]` table.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct IoThreadsConfig {
    /// Number of IOThreads in the pool.
    #[serde(default = "one")]
    pub count: usize,
    /// Per-thread settings (`[[iothreads.thread]]`).
    #[serde(default, rename = "thread")]
    pub threads: Vec<IoThreadConfig>,
    /// Polling defaults for every IOThread (each `[[iothreads.thread]]` may override).
    #[serde(flatten)]
    pub poll: PollConfig,
    /// Most memory each IOThread may hold in bounce buffers (for guest buffers
    /// O_DIRECT cannot take), e.g. `"64M"`; a request that would exceed it
    /// waits for buffers to be freed (or fails with IOERR if it alone is larger).
    #[serde(default)]
    pub bounce_buffer_max: Option<String>,
}

/// Polling settings, as in QEMU's iothread object and libvirt's `<poll>`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct PollConfig {
    /// Polling algorithm: off, classic, weighted, busy or adaptive.
    #[serde(default)]
    pub poll: Option<PollMode>,
    /// Longest polling window, ns (QEMU `poll-max-ns`, default 32768; 0 = never poll).
    #[serde(default)]
    pub poll_max_ns: Option<u64>,
    /// Window growth factor (QEMU `poll-grow`; 0 = x2).
    #[serde(default)]
    pub poll_grow: Option<u64>,
    /// Window shrink divisor (QEMU `poll-shrink`; 0 = reset to 0).
    #[serde(default)]
    pub poll_shrink: Option<u64>,
    /// EWMA weight of the weighted algorithm (QEMU `poll-weight`; 0 = classic).
    #[serde(default)]
    pub poll_weight: Option<u32>,
}

impl PollConfig {
    /// `self` with unset fields taken from `defaults`.
    pub fn or(&self, defaults: &PollConfig) -> PollConfig {
        PollConfig {
            poll: self.poll.or(defaults.poll),
            poll_max_ns: self.poll_max_ns.or(defaults.poll_max_ns),
            poll_grow: self.poll_grow.or(defaults.poll_grow),
            poll_shrink: self.poll_shrink.or(defaults.poll_shrink),
            poll_weight: self.poll_weight.or(defaults.poll_weight),
        }
    }

    /// The mode and knobs: unset knobs take QEMU's defaults; an unset mode is
    /// ours (`adaptive`), unless `poll-weight` was given, which selects QEMU's
    /// algorithm as QEMU does (0 = classic, otherwise weighted).
    pub fn resolve(&self) -> (PollMode, PollParams) {
        let d = PollParams::default();
        let params = PollParams {
            poll_max_ns: self.poll_max_ns.unwrap_or(d.poll_max_ns),
            poll_grow: self.poll_grow.unwrap_or(d.poll_grow),
            poll_shrink: self.poll_shrink.unwrap_or(d.poll_shrink),
            poll_weight: self.poll_weight.unwrap_or(d.poll_weight),
        };
        let mode = match (self.poll, self.poll_weight) {
            (Some(m), _) => m,
            (None, Some(_)) => params.qemu_mode(),
            (None, None) => DEFAULT_POLL_MODE,
        };
        (mode, params)
    }
}

/// The polling mode of an IOThread when the configuration does not say.
pub const DEFAULT_POLL_MODE: PollMode = PollMode::Adaptive;

fn one() -> usize {
    1
}

impl Default for IoThreadsConfig {
    fn default() -> Self {
        IoThreadsConfig {
            count: 1,
            threads: Vec::new(),
            poll: PollConfig::default(),
            bounce_buffer_max: None,
        }
    }
}

pub use crate::iothread::DEFAULT_BOUNCE_BUFFER_MAX;

impl IoThreadsConfig {
    /// `bounce-buffer-max` in bytes (default [`DEFAULT_BOUNCE_BUFFER_MAX`]).
    pub fn bounce_buffer_max(&self) -> Result<u64, ConfigError> {
        let Some(s) = &self.bounce_buffer_max else {
            return Ok(DEFAULT_BOUNCE_BUFFER_MAX);
        };
        let f = "iothreads.bounce-buffer-max";
        let n = parse_size(s).map_err(|m| ConfigError::new(f, m.to_string()))?;
        if n < 1 << 20 {
            return Err(ConfigError::new(
                f,
                format!("{s:?} is below the smallest useful cap, 1M (one largest request)"),
            ));
        }
        Ok(n)
    }

    /// The polling mode and knobs of IOThread `id`.
    pub fn poll_for(&self, id: usize) -> (PollMode, PollParams) {
        match self.threads.iter().find(|t| t.id == id) {
            Some(t) => t.poll_config().or(&self.poll).resolve(),
            None => self.poll.resolve(),
        }
    }
}

impl IoThreadConfig {
    pub(super) fn poll_config(&self) -> PollConfig {
        self.poll.clone()
    }
}
