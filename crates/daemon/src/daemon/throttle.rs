//! The I/O limits of the running exports: which `SharedThrottle` each
//! export's requests draw on (its own limits, its throttle group's, or none),
//! and changing them live (`block_set_io_throttle`, `throttle-group-set`).
//! A change replaces the device's throttle (what a queue attaching later
//! takes) and then tells every IOThread (`Command::SetThrottle`): the queues
//! already served switch at once, and a request they hold back is looked at
//! again under the new limits.
//!
//! Lock order: `exports`, then `groups`; IOThreads take neither.

use std::sync::Arc;

use super::{DaemonState, ExportRunner};
use crate::config::{is_group_name, ConfigError, MAX_RESERVED_IOPS, MAX_WEIGHT};
use crate::iothread::Command;
use crate::qos::{SharedThrottle, ThrottleLimits};

/// A throttle group as the daemon keeps it.
pub(crate) struct LiveGroup {
    /// Its name (`throttle-group = "NAME"`).
    pub(crate) name: String,
    /// Its limits now.
    pub(crate) limits: ThrottleLimits,
    /// The buckets its members' queues share (None: no limit set).
    pub(crate) throttle: Option<Arc<SharedThrottle>>,
}

impl LiveGroup {
    /// A group with fresh buckets for `limits`.
    pub(crate) fn new(name: String, limits: ThrottleLimits) -> LiveGroup {
        LiveGroup {
            throttle: limits
                .is_enabled()
                .then(|| Arc::new(SharedThrottle::new(limits))),
            name,
            limits,
        }
    }
}

/// The limits an export's requests draw on.
#[derive(Debug, Clone, PartialEq)]
pub enum ExportLimits {
    /// None.
    Unlimited,
    /// Its own (`[export.throttle]`, `block_set_io_throttle`), in buckets of
    /// its own.
    Own(ThrottleLimits),
    /// Those of the named throttle group, shared with its other members.
    Group(String),
}

/// Why a live change of limits was refused; `field` names the parameter.
pub(crate) type ThrottleError = ConfigError;

impl DaemonState {
    /// The buckets of group `name` (None: no such group, or no limit set).
    fn group_throttle(groups: &[LiveGroup], name: &str) -> Option<Arc<SharedThrottle>> {
        groups
            .iter()
            .find(|l| l.name == name)
            .and_then(|l| l.throttle.clone())
    }

    /// Gives `runner`'s device `throttle` and tells the IOThreads.
    fn apply(&self, runner: &ExportRunner, throttle: Option<Arc<SharedThrottle>>) {
        runner.device.set_throttle(throttle.clone());
        for t in self.iothreads.iter() {
            t.send(Command::SetThrottle {
                device: runner.device.clone(),
                throttle: throttle.clone(),
            });
        }
    }

    /// The throttle a new export starts with: its own limits' buckets, or
    /// its group's (`exports` locked by the caller, so that a group changed
    /// meanwhile is seen).
    pub(crate) fn initial_throttle(&self, limits: &ExportLimits) -> Option<Arc<SharedThrottle>> {
        match limits {
            ExportLimits::Unlimited => None,
            ExportLimits::Own(l) => Some(Arc::new(SharedThrottle::new(*l))),
            ExportLimits::Group(g) => Self::group_throttle(&self.groups.lock().unwrap(), g),
        }
    }

    /// Sets the limits of export `name` (`block_set_io_throttle`): its own
    /// `limits` (none enabled: unthrottled), or those of `group`, which must
    /// exist. Its own limits start with fresh buckets.
    pub(crate) fn set_export_limits(
        &self,
        name: &str,
        limits: ThrottleLimits,
        group: Option<&str>,
    ) -> Result<(), ThrottleError> {
        let mut exports = self.exports.lock().unwrap();
        let runner = exports
            .iter_mut()
            .find(|e| e.name == name)
            .ok_or_else(|| ConfigError::new("export", format!("no export named {name:?}")))?;
        let (new, throttle) = match group {
            Some(g) => {
                let groups = self.groups.lock().unwrap();
                if !groups.iter().any(|l| l.name == g) {
                    return Err(ConfigError::new(
                        "group",
                        format!("no throttle group named {g:?} (throttle-group-set creates one)"),
                    ));
                }
                (
                    ExportLimits::Group(g.to_string()),
                    Self::group_throttle(&groups, g),
                )
            }
            None if limits.is_enabled() => (
                ExportLimits::Own(limits),
                Some(Arc::new(SharedThrottle::new(limits))),
            ),
            None => (ExportLimits::Unlimited, None),
        };
        runner.limits = new;
        self.apply(runner, throttle);
        Ok(())
    }

    /// Gives export `name` a new reservation and weight (`share-set`; None:
    /// none), checked as the configuration checks them alone, against the
    /// limits it has now: a weight from 1 to [`MAX_WEIGHT`], a reservation
    /// no larger than [`MAX_RESERVED_IOPS`] nor than its own or its group's
    /// IOPS limit. The share allocator reads them at its next tick, and is
    /// started if it did not run.
    pub(crate) fn set_export_share(
        &self,
        name: &str,
        reservation_iops: Option<u64>,
        weight: Option<u32>,
    ) -> Result<(), ThrottleError> {
        if let Some(w) = weight.filter(|&w| w == 0 || w > MAX_WEIGHT) {
            let m = format!("{w} is out of range (1..={MAX_WEIGHT})");
            return Err(ConfigError::new("weight", m));
        }
        let reserved = reservation_iops.unwrap_or(0);
        if reserved > MAX_RESERVED_IOPS {
            let m = format!("{reserved} is more than a device does (at most {MAX_RESERVED_IOPS})");
            return Err(ConfigError::new("reservation-iops", m));
        }
        let mut exports = self.exports.lock().unwrap();
        let runner = exports
            .iter_mut()
            .find(|e| e.name == name)
            .ok_or_else(|| ConfigError::new("export", format!("no export named {name:?}")))?;
        let cap = match &runner.limits {
            ExportLimits::Unlimited => None,
            ExportLimits::Own(l) => l.iops_cap(),
            ExportLimits::Group(g) => self
                .groups
                .lock()
                .unwrap()
                .iter()
                .find(|l| &l.name == g)
                .and_then(|l| l.limits.iops_cap()),
        };
        if let Some(cap) = cap.filter(|&c| reserved > c) {
            let m = format!(
                "{reserved} is above the export's IOPS limit of {cap}: it could never be given"
            );
            return Err(ConfigError::new("reservation-iops", m));
        }
        runner.config.reservation_iops = reservation_iops.filter(|&r| r > 0);
        runner.config.weight = weight;
        let shares = runner.config.reservation_iops.is_some() || weight.is_some();
        drop(exports);
        if shares {
            self.start_shares().map_err(|e| {
                ConfigError::new("export", format!("cannot start the share allocator: {e}"))
            })?;
        }
        Ok(())
    }

    /// Creates throttle group `name` or gives it new `limits`
    /// (`throttle-group-set`): its members switch to fresh buckets at once.
    pub(crate) fn set_group_limits(
        &self,
        name: &str,
        limits: ThrottleLimits,
    ) -> Result<(), ThrottleError> {
        if !is_group_name(name) {
            return Err(ConfigError::new(
                "name",
                format!("{name:?} is not a name: a letter, then letters, digits, '-', '.' or '_'"),
            ));
        }
        let exports = self.exports.lock().unwrap();
        let mut groups = self.groups.lock().unwrap();
        let group = LiveGroup::new(name.to_string(), limits);
        let throttle = group.throttle.clone();
        match groups.iter_mut().find(|g| g.name == name) {
            Some(g) => *g = group,
            None => groups.push(group),
        }
        drop(groups);
        for e in exports
            .iter()
            .filter(|e| e.limits == ExportLimits::Group(name.to_string()))
        {
            self.apply(e, throttle.clone());
        }
        Ok(())
    }

    /// Every throttle group: its name, its limits and its members.
    pub(crate) fn groups_view(&self) -> Vec<(String, ThrottleLimits, Vec<String>)> {
        let exports = self.exports.lock().unwrap();
        let groups = self.groups.lock().unwrap();
        groups
            .iter()
            .map(|g| {
                let members = exports
                    .iter()
                    .filter(|e| e.limits == ExportLimits::Group(g.name.clone()))
                    .map(|e| e.name.clone())
                    .collect();
                (g.name.clone(), g.limits, members)
            })
            .collect()
    }

    /// Whether group `name` exists.
    pub(crate) fn has_group(&self, name: &str) -> bool {
        self.groups.lock().unwrap().iter().any(|g| g.name == name)
    }
}
