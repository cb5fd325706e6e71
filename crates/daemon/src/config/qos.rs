//! The quality-of-service keys of the serve model (docs/qos.md): an export's
//! `[export.throttle]`, `reservation-iops` and `weight` checked alone, the
//! `[[throttle-group]]` tables, and what the exports sharing a group or a
//! backing device must satisfy together. The limits themselves are validated
//! by [`crate::qos`] with QEMU's rules; here each error gets its field name.

use serde::Deserialize;

use super::{ConfigError, ExportConfig, ServeConfig};
use crate::qos::{ThrottleConfig, ThrottleLimits};

/// A `[[throttle-group]]` table: a name and the limits its members share
/// (QEMU's `throttle-group` object, libvirt's `<iotune><group_name>`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ThrottleGroupConfig {
    /// The name exports give in `throttle-group = "NAME"`.
    pub name: String,
    /// The limits, with the keys of `[export.throttle]`.
    #[serde(flatten)]
    pub limits: ThrottleConfig,
}

/// Largest weight of an export.
pub const MAX_WEIGHT: u32 = 10_000;
/// Largest sum of the reservations of the exports on one backing device: more
/// than any single device completes today, so a larger sum is a typo.
pub const MAX_RESERVED_IOPS: u64 = 10_000_000;

/// An export's own limits, weight and reservation, checked alone; its group
/// and the other exports on its device are checked by [`check_shared_qos`].
/// Returns the limits if any is set.
pub(super) fn export_limits(
    e: &ExportConfig,
    f: &dyn Fn(&str) -> String,
) -> Result<Option<ThrottleLimits>, ConfigError> {
    let limits = e
        .throttle
        .as_ref()
        .map(|t| {
            t.validate()
                .map_err(|l| ConfigError::new(f(&format!("throttle.{}", l.key)), l.message))
        })
        .transpose()?;
    if let (Some(_), Some(g)) = (&e.throttle, &e.throttle_group) {
        return Err(ConfigError::new(
            f("throttle"),
            format!(
                "cannot be combined with throttle-group = {g:?}: an export belongs to one \
                 throttle group, as a QEMU throttle node does (its own limits are a group of \
                 one); set the limits in that [[throttle-group]]"
            ),
        ));
    }
    if let Some(w) = e.weight {
        if w == 0 || w > MAX_WEIGHT {
            return Err(ConfigError::new(
                f("weight"),
                format!("{w} is out of range (1..={MAX_WEIGHT})"),
            ));
        }
    }
    let reserved = e.reservation_iops.unwrap_or(0);
    if reserved > MAX_RESERVED_IOPS {
        return Err(ConfigError::new(
            f("reservation-iops"),
            format!("{reserved} is more than a device does (at most {MAX_RESERVED_IOPS})"),
        ));
    }
    if let Some(cap) = limits.as_ref().and_then(iops_cap) {
        if reserved > cap {
            return Err(ConfigError::new(
                f("reservation-iops"),
                format!(
                    "{reserved} is above the export's own limit of {cap} IOPS \
                     (throttle.iops-total, or iops-read + iops-write): it could never be given"
                ),
            ));
        }
    }
    Ok(limits.filter(ThrottleLimits::is_enabled))
}

/// The most operations per second `limits` let through in the long run, if
/// they cap both reads and writes.
fn iops_cap(limits: &ThrottleLimits) -> Option<u64> {
    limits.iops_cap()
}

/// A validated `[[throttle-group]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ThrottleGroupPlan {
    /// Its name.
    pub name: String,
    /// Its limits (possibly none: a group may be given limits live).
    pub limits: ThrottleLimits,
}

/// Whether `name` is a well-formed group name: a letter, then letters, digits,
/// `-`, `.` or `_` (QEMU's rule for object ids).
pub fn is_group_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
}

impl ServeConfig {
    /// Checks the `[[throttle-group]]` tables.
    pub fn throttle_group_plans(&self) -> Result<Vec<ThrottleGroupPlan>, ConfigError> {
        let mut plans: Vec<ThrottleGroupPlan> = Vec::new();
        for (j, g) in self.throttle_groups.iter().enumerate() {
            let f = |name: &str| format!("throttle-group[{j}].{name}");
            if !is_group_name(&g.name) {
                return Err(ConfigError::new(
                    f("name"),
                    format!(
                        "{:?} is not a name: a letter, then letters, digits, '-', '.' or '_'",
                        g.name
                    ),
                ));
            }
            if plans.iter().any(|p| p.name == g.name) {
                return Err(ConfigError::new(
                    f("name"),
                    format!("{:?} is the name of another group", g.name),
                ));
            }
            let limits = g
                .limits
                .validate()
                .map_err(|l| ConfigError::new(f(&l.key), l.message))?;
            plans.push(ThrottleGroupPlan {
                name: g.name.clone(),
                limits,
            });
        }
        Ok(plans)
    }
}

/// Checks what involves several exports: each export's `throttle-group`
/// exists, and the reservations of the exports that share a backing device
/// (the same image) or a throttle group fit. A device's capacity is not known
/// here, so a sum is refused only when it is nonsense: above
/// [`MAX_RESERVED_IOPS`], or above the group's own IOPS limit. `names` are
/// the exports' names, for the messages; `first` is the index of `exports[0]`
/// in the error paths.
pub fn check_shared_qos(
    exports: &[ExportConfig],
    names: &[String],
    groups: &[ThrottleGroupPlan],
    first: usize,
) -> Result<(), ConfigError> {
    let mut per_device: Vec<(&std::path::Path, u64)> = Vec::new();
    let mut per_group: Vec<(&str, u64)> = Vec::new();
    for (k, e) in exports.iter().enumerate() {
        let f = |name: &str| format!("export[{}].{name}", first + k);
        let reserved = e.reservation_iops.unwrap_or(0);
        if let Some(g) = &e.throttle_group {
            let Some(group) = groups.iter().find(|p| &p.name == g) else {
                return Err(ConfigError::new(
                    f("throttle-group"),
                    format!(
                        "export {:?} joins {g:?}, which is not a [[throttle-group]]",
                        names[k]
                    ),
                ));
            };
            let sum = match per_group.iter_mut().find(|(n, _)| n == g) {
                Some((_, sum)) => {
                    *sum += reserved;
                    *sum
                }
                None => {
                    per_group.push((g, reserved));
                    reserved
                }
            };
            if let Some(cap) = iops_cap(&group.limits) {
                if sum > cap {
                    return Err(ConfigError::new(
                        f("reservation-iops"),
                        format!(
                            "the members of throttle group {g:?} reserve {sum} IOPS in all, \
                             above the group's limit of {cap} IOPS"
                        ),
                    ));
                }
            }
        }
        let Some(image) = e.image.as_deref().filter(|_| reserved != 0) else {
            continue;
        };
        let sum = match per_device.iter_mut().find(|(p, _)| *p == image) {
            Some((_, sum)) => {
                *sum += reserved;
                *sum
            }
            None => {
                per_device.push((image, reserved));
                reserved
            }
        };
        if sum > MAX_RESERVED_IOPS {
            return Err(ConfigError::new(
                f("reservation-iops"),
                format!(
                    "the exports of {} reserve {sum} IOPS in all, more than a device does \
                     (at most {MAX_RESERVED_IOPS})",
                    image.display()
                ),
            ));
        }
    }
    Ok(())
}
