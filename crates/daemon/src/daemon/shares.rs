//! The share allocator's thread, `vqblk-shares`: reservations and weights
//! (`reservation-iops`, `weight`) enforced as per-export IOPS caps
//! (`qos::shares`, whose header argues the design).
//!
//! It runs only once some export has a reservation or a weight. Every
//! [`TICK_NS`] it reads the per-queue counters of the exports on devices with
//! shares (requests completed, held back, and the sum of their latencies:
//! by Little's law, that sum over the interval is the mean number of
//! requests in flight, exact where sampling "in flight now" would miss a
//! fast device's short visits), groups them by backing device, runs one
//! [`ShareAllocator`] per device and writes the caps (`ShareCap::set`, an
//! atomic store the IOThreads read without a lock). An export counts as
//! busy when it had at least [`BUSY_IN_FLIGHT`] requests in flight on
//! average or was held back. Exports added or removed live join and leave
//! at the next tick.
//!
//! **Backing device**: for an image file, the filesystem it lives on
//! (`st_dev`); for a block device, the device itself (`st_rdev`;
//! partitions of one disk count as separate devices). A null export and an
//! RBD image are each their own device (the cluster behind an RBD image is
//! not something one daemon can measure), so a weight or reservation on one
//! of them has no neighbour to restrain.
//!
//! Every export on a device where some export has a reservation or a weight
//! takes part (an export without either has weight 1), since its neighbours'
//! floors can only be kept by capping it. It gets a share cap (its queues
//! learn it through `Command::SetThrottle`, as a live change of limits) that
//! stays, uncapped, if the device no longer has shares.
//!
//! Lock order: `exports` (the control plane's), taken for each tick's reading
//! and writes; the data path takes none.

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info};

use super::{DaemonState, ExportLimits, ExportRunner};
use crate::block::Disk;
use crate::clock::monotonic_ns;
use crate::iothread::Command;
use crate::metrics::{ShareBoard, ShareReading};
use crate::qos::shares::{Interval, Share, ShareAllocator, ShareInput, TICK_NS};
use crate::seccomp::{SeccompMode, ThreadKind};
use crate::stats::DaemonSnapshot;

/// Mean requests in flight over an interval from which an export counts as
/// busy (asking for more than it got). A closed loop keeps its requests in
/// the daemon most of the time unless the device is faster than the client.
pub(crate) const BUSY_IN_FLIGHT: f64 = 0.5;

/// The share allocator's thread, once started, and what it publishes.
#[derive(Default)]
pub(crate) struct Shares {
    thread: Mutex<Option<(mpsc::Sender<()>, JoinHandle<()>)>>,
    /// The caps and estimates of the last tick (`/metrics`, `query-exports`).
    pub(crate) board: Arc<ShareBoard>,
}

impl Shares {
    /// Starts the thread over `state` unless it runs.
    pub(crate) fn start(
        &self,
        state: Weak<DaemonState>,
        seccomp: SeccompMode,
    ) -> std::io::Result<()> {
        let mut thread = self.thread.lock().unwrap();
        if thread.is_some() {
            return Ok(());
        }
        let (tx, rx) = mpsc::channel();
        let board = self.board.clone();
        let j = std::thread::Builder::new()
            .name("vqblk-shares".into())
            .spawn(move || {
                if let Err(e) = crate::seccomp::apply(ThreadKind::Shares, seccomp) {
                    error!("{e}: the share allocator runs without a filter");
                }
                run(&state, &rx, &board);
            })?;
        info!("shares: allocator started (reservations and weights)");
        *thread = Some((tx, j));
        Ok(())
    }

    /// Stops and joins the thread, if it runs.
    pub(crate) fn stop(&self) {
        if let Some((tx, j)) = self.thread.lock().unwrap().take() {
            drop(tx);
            let _ = j.join();
        }
    }
}

/// Whether `runner`'s settings ask for a share of its device.
fn has_share(e: &ExportRunner) -> bool {
    e.config.reservation_iops.is_some_and(|r| r > 0) || e.config.weight.is_some()
}

/// The backing device of an open disk (see the module's doc); None for
/// exports that are each their own device.
fn device_of(disk: &Disk) -> Option<String> {
    let Disk::File(f) = disk else {
        return None;
    };
    let m = f.file.metadata().ok()?;
    let (kind, dev) = if m.file_type().is_block_device() {
        ("blk", m.rdev())
    } else {
        ("fs", m.dev())
    };
    Some(format!(
        "{kind}-{}:{}",
        libc::major(dev as libc::dev_t),
        libc::minor(dev as libc::dev_t)
    ))
}

/// One export's counters at the start of the interval.
#[derive(Default, Clone, Copy)]
struct Tally {
    /// Its id for the allocator.
    id: u64,
    /// Requests completed, held back (by the limits or the cap), and the sum
    /// of their latencies (ns).
    totals: Totals,
    /// Requests held back by the share cap.
    held: u64,
}

/// An export's counters over its queues on every IOThread.
#[derive(Default, Clone, Copy)]
struct Totals {
    requests: u64,
    throttled: u64,
    latency_ns: u64,
}

fn totals(snap: &DaemonSnapshot, export: &str) -> Totals {
    let mut t = Totals::default();
    for q in snap
        .iothreads
        .iter()
        .flat_map(|i| &i.queues)
        .filter(|q| q.export == export)
    {
        t.requests += q.requests;
        t.throttled += q.throttled;
        t.latency_ns += q.latency.sum_ns;
    }
    t
}

/// The thread's loop: a tick every [`TICK_NS`] until [`Shares::stop`] (or
/// the daemon is gone).
fn run(state: &Weak<DaemonState>, stop: &mpsc::Receiver<()>, board: &ShareBoard) {
    let mut devices: HashMap<String, ShareAllocator> = HashMap::new();
    let mut tallies: HashMap<String, Tally> = HashMap::new();
    let mut keys: HashMap<String, String> = HashMap::new();
    let mut next_id = 0u64;
    let mut last = Instant::now();
    loop {
        match stop.recv_timeout(Duration::from_nanos(TICK_NS)) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let Some(state) = state.upgrade() else {
            return;
        };
        let secs = last.elapsed().as_secs_f64();
        last = Instant::now();
        let snap = state.stats();
        let exports = state.exports.lock().unwrap();
        // The device of each export (once), and which devices have shares.
        keys.retain(|name, _| exports.iter().any(|e| &e.name == name));
        for e in exports.iter() {
            keys.entry(e.name.clone()).or_insert_with(|| {
                device_of(&e.device.disk).unwrap_or_else(|| format!("export-{}", e.name))
            });
        }
        let shared: Vec<&String> = exports
            .iter()
            .filter(|e| has_share(e))
            .map(|e| &keys[&e.name])
            .collect();
        let members: Vec<&ExportRunner> = exports
            .iter()
            .filter(|e| shared.contains(&&keys[&e.name]))
            .collect();
        tallies.retain(|name, _| members.iter().any(|e| &e.name == name));
        // Group by device, in the order the exports were added; an export
        // that just joined is seen from the next tick.
        let mut by_device: Vec<(&String, Vec<(&ExportRunner, ShareInput)>)> = Vec::new();
        for e in &members {
            join(&state, e);
            let now = Tally {
                id: 0,
                totals: totals(&snap, &e.name),
                held: e.device.share().map_or(0, |c| c.held()),
            };
            let Some(t) = tallies.get_mut(&e.name) else {
                next_id += 1;
                tallies.insert(e.name.clone(), Tally { id: next_id, ..now });
                continue;
            };
            let (a, b) = (t.totals, now.totals);
            let in_flight = b.latency_ns.saturating_sub(a.latency_ns) as f64 / (secs * 1e9);
            let held = now.held > t.held;
            let input = ShareInput {
                id: t.id,
                share: Share {
                    reservation: e.config.reservation_iops.unwrap_or(0) as f64,
                    weight: e.config.weight.unwrap_or(1),
                    limit: match &e.limits {
                        ExportLimits::Own(l) => l.iops_cap().unwrap_or(0) as f64,
                        _ => 0.0,
                    },
                },
                seen: Interval {
                    done: b.requests.saturating_sub(a.requests) as f64 / secs,
                    busy: in_flight >= BUSY_IN_FLIGHT || b.throttled > a.throttled,
                    held,
                },
            };
            *t = Tally { id: t.id, ..now };
            let key = &keys[&e.name];
            match by_device.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push((e, input)),
                None => by_device.push((key, vec![(e, input)])),
            }
        }
        devices.retain(|k, _| by_device.iter().any(|(d, _)| *d == k));
        let now = monotonic_ns();
        let mut reading = ShareReading::default();
        for (key, list) in &by_device {
            let alloc = devices.entry((*key).clone()).or_default();
            let inputs: Vec<ShareInput> = list.iter().map(|(_, i)| *i).collect();
            let caps = alloc.tick(&inputs);
            log::debug!(
                "shares: {key}: {inputs:?} -> capacity {:?}, caps {caps:?}",
                alloc.capacity()
            );
            for ((e, _), cap) in list.iter().zip(caps) {
                e.device.share_cap().set(cap, now);
                reading.exports.push((e.name.clone(), (*key).clone(), cap));
            }
            reading.devices.push(((*key).clone(), alloc.capacity()));
        }
        // Exports on devices that no longer have shares go uncapped.
        for e in exports
            .iter()
            .filter(|e| !members.iter().any(|m| m.name == e.name))
        {
            if let Some(c) = e.device.share() {
                c.set(None, now);
            }
        }
        drop(exports);
        board.publish(reading);
    }
}

/// Gives `e` a share cap if it has none yet, and tells the IOThreads serving
/// its queues (under the `exports` lock, like a change of limits).
fn join(state: &DaemonState, e: &ExportRunner) {
    if e.device.share().is_some() {
        return;
    }
    e.device.share_cap();
    let throttle = e.device.throttle();
    for t in state.iothreads.iter() {
        t.send(Command::SetThrottle {
            device: e.device.clone(),
            throttle: throttle.clone(),
        });
    }
}
