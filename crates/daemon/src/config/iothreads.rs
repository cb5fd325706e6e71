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
#[derive(Debug, Clone, PartialEq)]
pub struct IoThreadsConfig {
    /// Number of IOThreads in the pool (with `auto`: unused, the pool has
    /// one IOThread per CPU of `cpuset`).
    pub count: usize,
    /// `count = "auto"` (`--iothreads auto`): one IOThread per CPU of
    /// `cpuset`, and the active set and queue placement tuned online
    /// (docs/autotune.md).
    pub auto: bool,
    /// With `auto`: the host CPUs the pool may use (cpuset syntax), one
    /// IOThread pinned to each; default: every CPU of the host, shared with
    /// the rest of it, and the IOThreads are not pinned.
    pub cpuset: Option<String>,
    /// With `auto`: most cores the active IOThreads may take (default: the
    /// cpuset's size).
    pub cpu_budget: Option<f64>,
    /// Per-thread settings (`[[iothreads.thread]]`).
    pub threads: Vec<IoThreadConfig>,
    /// Polling defaults for every IOThread (each `[[iothreads.thread]]` may override).
    pub poll: PollConfig,
    /// Most memory each IOThread may hold in bounce buffers (for guest buffers
    /// O_DIRECT cannot take), e.g. `"64M"`; a request that would exceed it
    /// waits for buffers to be freed (or fails with IOERR if it alone is larger).
    pub bounce_buffer_max: Option<String>,
}

/// The `[iothreads]` table as written: `count` is a number or `"auto"`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct IoThreadsToml {
    #[serde(default)]
    count: Option<CountToml>,
    #[serde(default)]
    cpuset: Option<String>,
    #[serde(default)]
    cpu_budget: Option<f64>,
    #[serde(default, rename = "thread")]
    threads: Vec<IoThreadConfig>,
    #[serde(flatten)]
    poll: PollConfig,
    #[serde(default)]
    bounce_buffer_max: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum CountToml {
    Fixed(usize),
    Word(String),
}

impl<'de> Deserialize<'de> for IoThreadsConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let t = IoThreadsToml::deserialize(d)?;
        let (count, auto) = match t.count {
            None => (1, false),
            Some(CountToml::Fixed(n)) => (n, false),
            Some(CountToml::Word(w)) if w == "auto" => (1, true),
            Some(CountToml::Word(w)) => {
                return Err(serde::de::Error::custom(format!(
                    "iothreads.count: {w:?} is neither a number nor \"auto\""
                )))
            }
        };
        Ok(IoThreadsConfig {
            count,
            auto,
            cpuset: t.cpuset,
            cpu_budget: t.cpu_budget,
            threads: t.threads,
            poll: t.poll,
            bounce_buffer_max: t.bounce_buffer_max,
        })
    }
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

impl Default for IoThreadsConfig {
    fn default() -> Self {
        IoThreadsConfig {
            count: 1,
            auto: false,
            cpuset: None,
            cpu_budget: None,
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

    /// With `auto`: the CPUs of `cpuset` (default: every CPU of the host),
    /// one IOThread each; otherwise none.
    pub fn auto_cpus(&self) -> Result<Option<Vec<usize>>, ConfigError> {
        if !self.auto {
            for (field, set) in [
                ("iothreads.cpuset", self.cpuset.is_some()),
                ("iothreads.cpu-budget", self.cpu_budget.is_some()),
            ] {
                if set {
                    return Err(ConfigError::new(field, "only with count = \"auto\""));
                }
            }
            return Ok(None);
        }
        if let Some(i) = self.threads.iter().position(|t| t.cpuset.is_some()) {
            return Err(ConfigError::new(
                format!("iothreads.thread[{i}].cpuset"),
                "not with count = \"auto\": it places its IOThreads itself (one pinned \
                 to each CPU of iothreads.cpuset, if given)",
            ));
        }
        let cpus = match &self.cpuset {
            Some(c) => {
                super::parse_cpuset(c).map_err(|m| ConfigError::new("iothreads.cpuset", m))?
            }
            None => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
        };
        if cpus.is_empty() {
            return Err(ConfigError::new("iothreads.cpuset", "names no CPU"));
        }
        if let Some(b) = self.cpu_budget {
            if !(b.is_finite() && b >= 1.0) {
                return Err(ConfigError::new(
                    "iothreads.cpu-budget",
                    format!("{b} is not a number of cores of at least 1"),
                ));
            }
        }
        Ok(Some(cpus))
    }

    /// Number of IOThreads the pool starts: `count`, or with `auto` one per
    /// CPU of `cpuset`.
    pub fn pool_size(&self) -> Result<usize, ConfigError> {
        Ok(self.auto_cpus()?.map_or(self.count, |c| c.len()))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<IoThreadsConfig, String> {
        toml::from_str::<IoThreadsConfig>(toml_text).map_err(|e| e.to_string())
    }

    #[test]
    fn count_auto_takes_a_cpuset_and_a_budget() {
        let c = parse("count = \"auto\"\ncpuset = \"2-5\"\ncpu-budget = 2.5").unwrap();
        assert!(c.auto);
        assert_eq!(c.auto_cpus().unwrap(), Some(vec![2, 3, 4, 5]));
        assert_eq!(c.pool_size().unwrap(), 4);
        assert_eq!(c.cpu_budget, Some(2.5));
        let fixed = parse("count = 3").unwrap();
        assert!(!fixed.auto);
        assert_eq!(fixed.pool_size().unwrap(), 3);
        // Auto without a cpuset takes every CPU of the host.
        assert!(parse("count = \"auto\"").unwrap().pool_size().unwrap() >= 1);
    }

    #[test]
    fn bad_auto_settings_name_the_field() {
        let e = parse("count = \"many\"").unwrap_err();
        assert!(e.contains("iothreads.count"), "{e}");
        let field = |t: &str| parse(t).unwrap().auto_cpus().unwrap_err().field;
        assert_eq!(field("count = 2\ncpuset = \"0\""), "iothreads.cpuset");
        assert_eq!(field("count = 2\ncpu-budget = 1.0"), "iothreads.cpu-budget");
        assert_eq!(
            field("count = \"auto\"\ncpuset = \"x\""),
            "iothreads.cpuset"
        );
        assert_eq!(
            field("count = \"auto\"\ncpuset = \"0-3\"\ncpu-budget = 0.5"),
            "iothreads.cpu-budget"
        );
        assert_eq!(
            field("count = \"auto\"\n[[thread]]\nid = 0\ncpuset = \"1\""),
            "iothreads.thread[0].cpuset"
        );
    }
}
