//! The control socket's methods. Parameters are named (a JSON object, keys in
//! kebab-case like the TOML file's); an unknown or bad one is refused with
//! [`code::INVALID_PARAMS`] and a message that starts with its name.
//!
//! | method | parameters | result |
//! |---|---|---|
//! | `query-iothreads` | none | per IOThread: id, thread id, CPUs, polling, counters, `active` (owns a queue); when tuned online, its `last-move` |
//! | `query-exports` | none | per export: socket, image, backend, connection, limits, reservation, weight and share cap, queues with their IOThread and counters |
//! | `iothread-set` | `id`, any of `poll`, `poll-max-ns`, `poll-grow`, `poll-shrink`, `poll-weight` | the thread's new polling settings |
//! | `export-add` | the keys of a TOML `[[export]]` (`name` required) | `{ "name": ... }` |
//! | `export-del` | `name`, `force` (default false) | `{}` |
//! | `stats-reset` | none | `{}`: query-* count from now on |
//! | `queue-move` | `export`, `queue`, `iothread` | `{}` |
//! | `block_set_io_throttle` | `export`, the limit keys of `[export.throttle]` (all 0 or absent: none), or `group` | `{}` |
//! | `throttle-group-set` | `name`, the limit keys | `{}`: the group is created or changed, its members follow |
//! | `query-throttle-groups` | none | per group: name, limits, members |
//! | `share-set` | `export`, `reservation-iops`, `weight` (absent: none) | `{}`: the share allocator uses them from its next tick |
//! | `tune` | `export`, `enable` | `{}`: the online tuner moves the export's queues, or leaves them |
//! | `query-tune` | none | `auto`; when tuned: the budget, the exports tuned, moves by reason, failed moves, the last moves |

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::{code, ControlTarget, RpcError};
use crate::config::{BackendKind, ExportConfig};
use crate::poll::{PollMode, PollParams};
use crate::qos::{ThrottleConfig, ThrottleLimits};
use crate::stats::{DaemonSnapshot, IoThreadSnapshot};

/// The methods the control socket knows.
pub const METHODS: &[&str] = &[
    "query-iothreads",
    "query-exports",
    "iothread-set",
    "export-add",
    "export-del",
    "stats-reset",
    "queue-move",
    "block_set_io_throttle",
    "throttle-group-set",
    "query-throttle-groups",
    "share-set",
    "tune",
    "query-tune",
];

/// The named parameters of one request, taken one by one; whatever is left
/// at the end is an unknown parameter.
pub struct Params(Map<String, Value>);

impl Params {
    /// Wraps a request's `params` object.
    pub fn new(map: Map<String, Value>) -> Self {
        Params(map)
    }

    /// An optional unsigned integer no larger than `max`.
    pub fn u64(&mut self, name: &str, max: u64) -> Result<Option<u64>, RpcError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= max => Ok(Some(n)),
                Some(n) => Err(RpcError::param(
                    name,
                    format!("{n} is out of range (0..={max})"),
                )),
                None => Err(RpcError::param(
                    name,
                    format!("{v} is not an unsigned integer"),
                )),
            },
        }
    }

    /// A required unsigned integer no larger than `max`.
    pub fn req_u64(&mut self, name: &str, max: u64) -> Result<u64, RpcError> {
        self.u64(name, max)?
            .ok_or_else(|| RpcError::param(name, "missing (an unsigned integer)"))
    }

    /// An optional string.
    pub fn str(&mut self, name: &str) -> Result<Option<String>, RpcError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(RpcError::param(name, format!("{v} is not a string"))),
        }
    }

    /// A required string.
    pub fn req_str(&mut self, name: &str) -> Result<String, RpcError> {
        self.str(name)?
            .ok_or_else(|| RpcError::param(name, "missing (a string)"))
    }

    /// An optional boolean, false when absent.
    pub fn flag(&mut self, name: &str) -> Result<bool, RpcError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(v) => Err(RpcError::param(name, format!("{v} is not true or false"))),
        }
    }

    /// Refuses any parameter not taken.
    pub fn finish(self, method: &str) -> Result<(), RpcError> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(k) => Err(RpcError::param(k, format!("unknown parameter of {method}"))),
        }
    }
}

/// The control socket's view of the daemon, and the `stats-reset` baseline.
pub(crate) struct Methods {
    state: Arc<dyn ControlTarget>,
    /// Counters at the last `stats-reset`: query-* report what happened since.
    baseline: Option<DaemonSnapshot>,
}

impl Methods {
    pub(crate) fn new(state: Arc<dyn ControlTarget>) -> Self {
        Methods {
            state,
            baseline: None,
        }
    }

    /// Runs `method` with `params`.
    pub(crate) fn call(
        &mut self,
        method: &str,
        params: Map<String, Value>,
    ) -> Result<Value, RpcError> {
        let mut p = Params::new(params);
        match method {
            "query-iothreads" => {
                p.finish(method)?;
                Ok(self.query_iothreads())
            }
            "query-exports" => {
                p.finish(method)?;
                Ok(self.query_exports())
            }
            "iothread-set" => self.iothread_set(p),
            "export-add" => self.export_add(p),
            "export-del" => {
                let name = p.req_str("name")?;
                let force = p.flag("force")?;
                p.finish(method)?;
                self.state.del_export(&name, force)?;
                Ok(json!({}))
            }
            "stats-reset" => {
                p.finish(method)?;
                self.baseline = Some(self.state.stats());
                Ok(json!({}))
            }
            "queue-move" => self.queue_move(p),
            "block_set_io_throttle" => {
                let export = p.req_str("export")?;
                let group = p.str("group")?;
                let limits = throttle_limits(p)?;
                if group.is_some() && limits.is_enabled() {
                    return Err(RpcError::param(
                        "group",
                        "cannot be combined with limits: the export takes the group's \
                         (throttle-group-set changes them)",
                    ));
                }
                self.state
                    .set_io_throttle(&export, limits, group.as_deref())?;
                Ok(json!({}))
            }
            "throttle-group-set" => {
                let name = p.req_str("name")?;
                let limits = throttle_limits(p)?;
                self.state.set_throttle_group(&name, limits)?;
                Ok(json!({}))
            }
            "query-throttle-groups" => {
                p.finish(method)?;
                let groups: Vec<Value> = self
                    .state
                    .throttle_groups()
                    .iter()
                    .map(|g| {
                        json!({
                            "name": g.name,
                            "limits": limits_json(&g.limits),
                            "members": g.members,
                        })
                    })
                    .collect();
                Ok(Value::Array(groups))
            }
            "share-set" => {
                let export = p.req_str("export")?;
                let reservation = p.u64("reservation-iops", u64::MAX)?;
                let weight = p.u64("weight", u32::MAX as u64)?.map(|w| w as u32);
                p.finish(method)?;
                self.state.set_share(&export, reservation, weight)?;
                Ok(json!({}))
            }
            "tune" => {
                let export = p.req_str("export")?;
                let on = match p.0.remove("enable") {
                    Some(Value::Bool(b)) => b,
                    None | Some(Value::Null) => {
                        return Err(RpcError::param("enable", "missing (true or false)"))
                    }
                    Some(v) => {
                        return Err(RpcError::param(
                            "enable",
                            format!("{v} is not true or false"),
                        ))
                    }
                };
                p.finish(method)?;
                self.state.set_tune(&export, on)?;
                Ok(json!({}))
            }
            "query-tune" => {
                p.finish(method)?;
                Ok(match self.state.tune() {
                    None => json!({ "auto": false }),
                    Some(t) => json!({
                        "auto": true,
                        "max-active": t.max_active,
                        "exports": t.on,
                        "moves": t.moves.iter().map(|(r, n)| (r.to_string(), json!(n)))
                            .collect::<Map<String, Value>>(),
                        "failed-moves": t.failed,
                        "last-moves": t.recent.iter().map(move_json).collect::<Vec<_>>(),
                    }),
                })
            }
            _ => Err(RpcError::new(
                code::METHOD_NOT_FOUND,
                format!("unknown method {method:?} (known: {})", METHODS.join(", ")),
            )),
        }
    }

    /// Counters since the last `stats-reset`.
    fn stats(&self) -> DaemonSnapshot {
        since(&self.state.stats(), self.baseline.as_ref())
    }

    fn query_iothreads(&self) -> Value {
        let stats = self.stats();
        let exports = self.state.exports();
        let tune = self.state.tune();
        let threads: Vec<Value> = stats
            .iothreads
            .iter()
            .zip(self.state.iothreads())
            .enumerate()
            .map(|(id, (s, info))| {
                let (mode, params) = info.poll;
                let owned: Vec<Value> = exports
                    .iter()
                    .flat_map(|e| {
                        e.map
                            .queues_of(id)
                            .into_iter()
                            .map(|q| json!({ "export": e.name, "queue": q }))
                    })
                    .collect();
                let bytes = |f: fn(&crate::stats::QueueSnapshot) -> u64| {
                    s.queues.iter().map(f).sum::<u64>()
                };
                let mut v = json!({
                    "id": id,
                    "name": s.name,
                    "active": !owned.is_empty(),
                    "thread-id": s.tid,
                    "cpus": info.cpus,
                    "poll": poll_json(mode, params),
                    "poll-window-ns": s.poll_window_ns,
                    "requests": s.requests,
                    "bytes-read": bytes(|q| q.bytes_read),
                    "bytes-written": bytes(|q| q.bytes_written),
                    "errors": s.errors,
                    "cpu-seconds": s.cpu_seconds,
                    "poll-seconds": s.poll_seconds,
                    "sleep-seconds": s.sleep_seconds,
                    "passes": s.passes,
                    "passes-ready": s.passes_ready,
                    "passes-ready-together": s.passes_ready_together,
                    "poll-attempts": s.poll_attempts,
                    "poll-hits": s.poll_hits,
                    "naps": s.naps,
                    "poll-trials": s.poll_trials,
                    "poll-trials-slept": s.poll_trials_slept,
                    "kick-wakeups": s.kick_wakeups,
                    "completion-wakeups": s.completion_wakeups,
                    "kicks": s.kicks,
                    "used-publishes": s.used_publishes,
                    "notifications": s.notifications,
                    "notifications-suppressed": s.notifications_suppressed,
                    "nap-late-ns": s.nap_late_ns,
                    "nap-cpu-ns": s.nap_cpu_ns,
                    "queues": owned,
                });
                if let Some(t) = &tune {
                    // Under the online tuner: the last move that woke,
                    // relieved or parked this thread, and why.
                    v["last-move"] = t
                        .recent
                        .iter()
                        .find(|m| m.from == id || m.to == id)
                        .map_or(Value::Null, move_json);
                }
                v
            })
            .collect();
        Value::Array(threads)
    }

    fn query_exports(&self) -> Value {
        let stats = self.stats();
        let list: Vec<Value> = self
            .state
            .exports()
            .iter()
            .map(|e| {
                let map = &e.map;
                let queues: Vec<Value> = (0..map.num_queues())
                    .map(|q| {
                        // A queue's counters live with each IOThread that served it.
                        let mut sum = [0u64; 10];
                        for t in &stats.iothreads {
                            for s in t
                                .queues
                                .iter()
                                .filter(|s| s.export == e.name && s.queue == q)
                            {
                                let v = [
                                    s.requests,
                                    s.reads,
                                    s.writes,
                                    s.flushes,
                                    s.other,
                                    s.errors,
                                    s.bytes_read,
                                    s.bytes_written,
                                    s.throttled,
                                    s.throttled_ns,
                                ];
                                for (a, b) in sum.iter_mut().zip(v) {
                                    *a += b;
                                }
                            }
                        }
                        json!({
                            "queue": q,
                            "iothread": map.thread_of(q),
                            "requests": sum[0],
                            "reads": sum[1],
                            "writes": sum[2],
                            "flushes": sum[3],
                            "other": sum[4],
                            "errors": sum[5],
                            "bytes-read": sum[6],
                            "bytes-written": sum[7],
                            "throttled": sum[8],
                            "throttled-ns": sum[9],
                        })
                    })
                    .collect();
                let c = &e.config;
                json!({
                    "name": e.name,
                    "socket": e.socket,
                    "image": c.image,
                    "backend": backend_name(c.backend),
                    "cache": format!("{:?}", c.cache).to_lowercase(),
                    "read-only": c.read_only,
                    "size-bytes": e.size_bytes,
                    "num-queues": map.num_queues(),
                    "queue-size": c.queue_size,
                    "connected": e.connected,
                    "throttle": e.limits.as_ref().map(limits_json),
                    "throttle-group": e.throttle_group,
                    "reservation-iops": c.reservation_iops,
                    "weight": c.weight,
                    "share": e.share.as_ref().map(|s| json!({
                        "device": s.device,
                        "cap-iops": s.cap_iops.map(f64::round),
                        "device-capacity-iops": s.device_capacity_iops.map(f64::round),
                    })),
                    "queues": queues,
                })
            })
            .collect();
        Value::Array(list)
    }

    fn iothread_set(&mut self, mut p: Params) -> Result<Value, RpcError> {
        let iothreads = self.state.iothreads();
        let id = p.req_u64("id", iothreads.len() as u64 - 1)? as usize;
        let mode = match p.str("poll")? {
            None => None,
            Some(m) => Some(
                serde_json::from_value::<PollMode>(Value::String(m.clone())).map_err(|_| {
                    RpcError::param(
                        "poll",
                        format!("{m:?} is not off, classic, weighted, busy or adaptive"),
                    )
                })?,
            ),
        };
        let max_ns = p.u64("poll-max-ns", i64::MAX as u64)?;
        let grow = p.u64("poll-grow", u64::MAX)?;
        let shrink = p.u64("poll-shrink", u64::MAX)?;
        let weight = p.u64("poll-weight", u32::MAX as u64)?;
        p.finish("iothread-set")?;
        let (old_mode, old) = iothreads[id].poll;
        let params = PollParams {
            poll_max_ns: max_ns.unwrap_or(old.poll_max_ns),
            poll_grow: grow.unwrap_or(old.poll_grow),
            poll_shrink: shrink.unwrap_or(old.poll_shrink),
            poll_weight: weight.map_or(old.poll_weight, |w| w as u32),
        };
        params
            .validate()
            .map_err(|e| RpcError::param("poll-weight", e))?;
        // As in the configuration: poll-weight alone picks between QEMU's
        // two algorithms (0 = classic), when one of them runs.
        let mode = match (mode, weight) {
            (Some(m), _) => m,
            (None, Some(_)) if matches!(old_mode, PollMode::Classic | PollMode::Weighted) => {
                params.qemu_mode()
            }
            (None, _) => old_mode,
        };
        self.state.set_poll(id, mode, params);
        Ok(poll_json(mode, params))
    }

    fn export_add(&mut self, p: Params) -> Result<Value, RpcError> {
        let config = export_config(p.0)?;
        if config.name.is_none() {
            return Err(RpcError::param(
                "name",
                "missing (export-add needs a name to address the export by)",
            ));
        }
        let name = self.state.add_export(&config)?;
        Ok(json!({ "name": name }))
    }

    fn queue_move(&mut self, mut p: Params) -> Result<Value, RpcError> {
        let export = p.req_str("export")?;
        let queue = p.req_u64("queue", u16::MAX as u64)? as u16;
        let iothread = p.req_u64("iothread", u64::MAX)? as usize;
        p.finish("queue-move")?;
        let num_queues = self
            .state
            .exports()
            .iter()
            .find(|e| e.name == export)
            .ok_or_else(|| RpcError::param("export", format!("no export named {export:?}")))?
            .map
            .num_queues();
        if queue >= num_queues {
            let m = format!("export {export:?} has queues 0..{num_queues}, not {queue}");
            return Err(RpcError::param("queue", m));
        }
        let pool = self.state.iothreads().len();
        if iothread >= pool {
            let m = format!("IOThread {iothread} does not exist (the pool has 0..{pool})");
            return Err(RpcError::param("iothread", m));
        }
        let m = self.state.move_queue(&export, queue, iothread)?;
        Ok(json!({
            "from": m.from,
            "to": m.to,
            "handed-over": m.handed_over,
            "drained": m.drained,
            "stall-us": m.stall.as_micros() as u64,
        }))
    }
}

/// `export-add`'s parameters as an export's settings; a bad key is named.
fn export_config(map: Map<String, Value>) -> Result<ExportConfig, RpcError> {
    serde_json::from_value(Value::Object(map.clone())).map_err(|e| {
        // serde names unknown and missing fields, not mistyped ones: try
        // each key alone (with a stand-in socket) to find the culprit.
        let culprit = map.iter().find_map(|(k, v)| {
            let mut probe = Map::new();
            probe.insert("socket".into(), json!("/"));
            probe.insert(k.clone(), v.clone());
            serde_json::from_value::<ExportConfig>(Value::Object(probe))
                .is_err()
                .then(|| k.clone())
        });
        let text = e.to_string();
        let named = text.split('`').nth(1).map(str::to_string);
        RpcError::param(culprit.or(named).as_deref().unwrap_or("params"), text)
    })
}

/// The limit keys left in `p` (those of `[export.throttle]`), validated by
/// QEMU's rules; an error names the key.
fn throttle_limits(p: Params) -> Result<ThrottleLimits, RpcError> {
    let config: ThrottleConfig =
        serde_json::from_value(Value::Object(p.0.clone())).map_err(|e| {
            // An unknown key is named by serde; a mistyped one is found alone.
            let culprit = p.0.iter().find_map(|(k, v)| {
                let mut probe = Map::new();
                probe.insert(k.clone(), v.clone());
                serde_json::from_value::<ThrottleConfig>(Value::Object(probe))
                    .is_err()
                    .then(|| k.clone())
            });
            RpcError::param(culprit.as_deref().unwrap_or("params"), e.to_string())
        })?;
    config
        .validate()
        .map_err(|l| RpcError::param(&l.key, l.message))
}

/// Limits as the control socket shows them: the keys set, as in TOML.
pub fn limits_json(l: &ThrottleLimits) -> Value {
    let mut v = serde_json::to_value(l.to_config()).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.retain(|_, v| !v.is_null() && v != &json!(0));
    }
    v
}

fn backend_name(b: BackendKind) -> &'static str {
    match b {
        BackendKind::IoUring => "io_uring",
        BackendKind::Threads => "threads",
        BackendKind::Null => "null",
        BackendKind::Rbd => "rbd",
    }
}

/// A queue move of the online tuner as the control socket shows it.
fn move_json(m: &super::TunerMove) -> Value {
    json!({
        "export": m.export,
        "queue": m.queue,
        "from": m.from,
        "to": m.to,
        "reason": m.reason,
        "load": (m.load * 100.0).round() / 100.0,
        "seconds-ago": m.age.as_secs(),
    })
}

/// A polling setting as the control socket shows it.
pub fn poll_json(mode: PollMode, p: PollParams) -> Value {
    json!({
        "mode": format!("{mode:?}").to_lowercase(),
        "poll-max-ns": p.poll_max_ns,
        "poll-grow": p.poll_grow,
        "poll-shrink": p.poll_shrink,
        "poll-weight": p.poll_weight,
    })
}

/// `now` minus the counters of `base` (gauges are kept as they are). Counters
/// never go backwards, so a missing baseline entry (a queue first served
/// after the reset) counts from zero.
pub fn since(now: &DaemonSnapshot, base: Option<&DaemonSnapshot>) -> DaemonSnapshot {
    let mut out = now.clone();
    let Some(base) = base else {
        return out;
    };
    for (t, b) in out.iothreads.iter_mut().zip(&base.iothreads) {
        thread_since(t, b);
    }
    out
}

fn thread_since(t: &mut IoThreadSnapshot, b: &IoThreadSnapshot) {
    for (v, old) in [
        (&mut t.requests, b.requests),
        (&mut t.kick_wakeups, b.kick_wakeups),
        (&mut t.completion_wakeups, b.completion_wakeups),
        (&mut t.stale_edges, b.stale_edges),
        (&mut t.passes, b.passes),
        (&mut t.passes_ready, b.passes_ready),
        (&mut t.passes_ready_together, b.passes_ready_together),
        (&mut t.notifications, b.notifications),
        (&mut t.notifications_suppressed, b.notifications_suppressed),
        (&mut t.popped, b.popped),
        (&mut t.used_publishes, b.used_publishes),
        (&mut t.used_batches, b.used_batches),
        (&mut t.kicks, b.kicks),
        (&mut t.errors, b.errors),
        (&mut t.broken_rings, b.broken_rings),
        (&mut t.budget_exhausted, b.budget_exhausted),
        (&mut t.poll_attempts, b.poll_attempts),
        (&mut t.poll_hits, b.poll_hits),
        (&mut t.naps, b.naps),
        (&mut t.poll_trials, b.poll_trials),
        (&mut t.poll_trials_slept, b.poll_trials_slept),
    ] {
        *v = v.saturating_sub(old);
    }
    for (v, old) in [
        (&mut t.cpu_seconds, b.cpu_seconds),
        (&mut t.poll_seconds, b.poll_seconds),
        (&mut t.sleep_seconds, b.sleep_seconds),
    ] {
        *v = (*v - old).max(0.0);
    }
    for q in &mut t.queues {
        let Some(o) = b
            .queues
            .iter()
            .find(|o| o.export == q.export && o.queue == q.queue)
        else {
            continue;
        };
        for (v, old) in [
            (&mut q.requests, o.requests),
            (&mut q.reads, o.reads),
            (&mut q.writes, o.writes),
            (&mut q.flushes, o.flushes),
            (&mut q.other, o.other),
            (&mut q.errors, o.errors),
            (&mut q.bytes_read, o.bytes_read),
            (&mut q.bytes_written, o.bytes_written),
            (&mut q.throttled, o.throttled),
            (&mut q.throttled_ns, o.throttled_ns),
        ] {
            *v = v.saturating_sub(old);
        }
    }
}
