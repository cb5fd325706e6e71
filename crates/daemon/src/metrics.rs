//! Prometheus metrics over HTTP (`--metrics ADDR:PORT`, `[metrics] listen`):
//! `GET /metrics` answers the counters of every IOThread and queue in the
//! Prometheus text exposition format (version 0.0.4); any other path is 404.
//!
//! Nothing is counted here: the IOThreads keep their counters (single writer,
//! relaxed atomics, see [`crate::stats`]) and a scrape reads a snapshot of each,
//! so the data path does not know whether anyone scrapes. docs/metrics.md lists
//! every metric.
//!
//! Crates: `prometheus` (tikv's rust-prometheus, without its protobuf feature)
//! builds and encodes the metric families, rather than the `prometheus-client`
//! crate, which writes only the OpenMetrics text format, whose counter
//! families are named without `_total` (`# TYPE vqblk_requests counter`, then
//! `vqblk_requests_total` samples): `promtool check metrics` (Prometheus 2.x, the
//! linter operators run) reads the classic text format and rejects every counter
//! of it. `tiny_http` serves HTTP: small (four dependencies, no async runtime),
//! blocking, and maintained; the metrics thread installs its seccomp filter
//! before tiny_http starts its accept and connection threads, which inherit it.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use log::{error, info, warn};
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};

use crate::seccomp::{SeccompMode, ThreadKind};
use crate::stats::{IoThreadSnapshot, IoThreadStats, LatencySnapshot, LATENCY_BOUNDS_NS};

/// The metrics HTTP server: one thread (`vqblk-metrics`) answering scrapes, plus
/// tiny_http's accept and connection threads, all under the `Metrics` seccomp
/// filter.
pub struct MetricsServer {
    server: Option<Arc<tiny_http::Server>>,
    thread: Option<JoinHandle<()>>,
    stopping: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl MetricsServer {
    /// Binds `addr` (errors come back here, before anything runs) and serves
    /// the counters of `iothreads`, the share allocator's and, when the pool
    /// is tuned online, the tuner's readings until [`MetricsServer::stop`].
    pub fn start(
        addr: SocketAddr,
        iothreads: Vec<Arc<IoThreadStats>>,
        shares: Arc<ShareBoard>,
        tune: Option<Arc<TuneBoard>>,
        seccomp: SeccompMode,
    ) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        if !addr.ip().is_loopback() {
            warn!(
                "metrics: listening on {addr}, not a loopback address: \
                 anyone who can reach it can read the daemon's counters"
            );
        }
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("vqblk-metrics".into())
            .spawn(move || {
                if let Err(e) = crate::seccomp::apply(ThreadKind::Metrics, seccomp) {
                    error!("{e}: the metrics thread runs without a filter");
                }
                // Started after the filter: its threads inherit it.
                let server = match tiny_http::Server::from_listener(listener, None) {
                    Ok(s) => Arc::new(s),
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = tx.send(Ok(server.clone()));
                serve(&server, &iothreads, &shares, tune.as_deref(), &stop);
            })?;
        let server = rx
            .recv()
            .map_err(|_| io::Error::other("the metrics thread ended before serving"))?
            .map_err(io::Error::other)?;
        info!("metrics: serving http://{addr}/metrics");
        Ok(MetricsServer {
            server: Some(server),
            thread: Some(thread),
            stopping,
            addr,
        })
    }

    /// The address it listens on (the port chosen by the kernel for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and joins the metrics thread.
    pub fn stop(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        self.stopping.store(true, Ordering::Release);
        if let Some(s) = &self.server {
            s.unblock();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The last reference is dropped here, in the caller's (unfiltered)
        // thread: tiny_http's drop connects to its own socket to wake its
        // accept thread, which the metrics filter does not allow.
        self.server = None;
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.shut();
    }
}

/// Answers requests until unblocked.
fn serve(
    server: &tiny_http::Server,
    iothreads: &[Arc<IoThreadStats>],
    shares: &ShareBoard,
    tune: Option<&TuneBoard>,
    stopping: &AtomicBool,
) {
    loop {
        let req = match server.recv() {
            Ok(r) => r,
            Err(e) => {
                if !stopping.load(Ordering::Acquire) {
                    error!("metrics: {e}; no longer serving");
                }
                return;
            }
        };
        let path = req.url().split('?').next().unwrap_or("");
        let response = match (req.method(), path) {
            (tiny_http::Method::Get, "/metrics") => {
                let snaps: Vec<IoThreadSnapshot> = iothreads.iter().map(|t| t.snapshot()).collect();
                let mut body = render(&snaps);
                body.push_str(&render_shares(&shares.reading()));
                if let Some(t) = tune {
                    body.push_str(&render_tune(&t.reading()));
                }
                tiny_http::Response::from_string(body)
                    .with_header(header("Content-Type", prometheus::TEXT_FORMAT))
            }
            (tiny_http::Method::Get, _) => {
                tiny_http::Response::from_string("not found: the metrics are at /metrics\n")
                    .with_status_code(404)
            }
            _ => tiny_http::Response::from_string("only GET\n")
                .with_status_code(405)
                .with_header(header("Allow", "GET")),
        };
        if let Err(e) = req.respond(response) {
            log::debug!("metrics: answering a scrape: {e}");
        }
    }
}

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("a valid static header")
}

/// The metric families of one scrape, in a fixed order.
struct Families(Vec<MetricFamily>);

impl Families {
    /// Adds a family (with its samples; an empty one is left out, the encoder
    /// refuses it).
    fn add(&mut self, name: &str, help: &str, kind: MetricType, metrics: Vec<Metric>) {
        if metrics.is_empty() {
            return;
        }
        let mut f = MetricFamily::default();
        f.set_name(name.into());
        f.set_help(help.into());
        f.set_field_type(kind);
        f.set_metric(metrics);
        self.0.push(f);
    }
}

fn labels(pairs: &[(&str, &str)]) -> Vec<LabelPair> {
    pairs
        .iter()
        .map(|(n, v)| {
            let mut l = LabelPair::default();
            l.set_name(n.to_string());
            l.set_value(v.to_string());
            l
        })
        .collect()
}

fn counter(pairs: &[(&str, &str)], v: f64) -> Metric {
    let mut c = Counter::default();
    c.set_value(v);
    let mut m = Metric::from_label(labels(pairs));
    m.set_counter(c);
    m
}

fn gauge(pairs: &[(&str, &str)], v: f64) -> Metric {
    let mut g = Gauge::default();
    g.set_value(v);
    let mut m = Metric::from_label(labels(pairs));
    m.set_gauge(g);
    m
}

fn histogram(pairs: &[(&str, &str)], h: &LatencySnapshot) -> Metric {
    let mut buckets = Vec::with_capacity(LATENCY_BOUNDS_NS.len());
    let mut cumulative = 0;
    for (i, &bound) in LATENCY_BOUNDS_NS.iter().enumerate() {
        cumulative += h.buckets.get(i).copied().unwrap_or(0);
        let mut b = Bucket::default();
        b.set_upper_bound(bound as f64 / 1e9);
        b.set_cumulative_count(cumulative);
        buckets.push(b);
    }
    let mut p = Histogram::default();
    p.set_bucket(buckets);
    p.set_sample_count(h.count());
    p.set_sample_sum(h.sum_ns as f64 / 1e9);
    let mut m = Metric::from_label(labels(pairs));
    m.set_histogram(p);
    m
}

/// The exposition text for the snapshots of every IOThread (index = the
/// `iothread` label). A pure function: tested without a server.
pub fn render(iothreads: &[IoThreadSnapshot]) -> String {
    use MetricType::{COUNTER, GAUGE, HISTOGRAM};
    let mut f = Families(Vec::new());
    // Per export, queue and IOThread (a queue moved between IOThreads has
    // a series on each).
    let ids: Vec<String> = (0..iothreads.len()).map(|i| i.to_string()).collect();
    let queues = || {
        iothreads.iter().zip(&ids).flat_map(|(t, id)| {
            t.queues.iter().map(move |q| {
                let queue = q.queue.to_string();
                (q, id.as_str(), queue)
            })
        })
    };
    let by_queue = |get: &dyn Fn(&crate::stats::QueueSnapshot) -> f64, gauge_kind: bool| {
        queues()
            .map(|(q, id, queue)| {
                let l = [
                    ("export", q.export.as_str()),
                    ("queue", &queue),
                    ("iothread", id),
                ];
                if gauge_kind {
                    gauge(&l, get(q))
                } else {
                    counter(&l, get(q))
                }
            })
            .collect::<Vec<_>>()
    };
    let mut by_type = Vec::new();
    for (q, id, queue) in queues() {
        let invalid = q
            .requests
            .saturating_sub(q.reads + q.writes + q.flushes + q.other);
        for (ty, v) in [
            ("read", q.reads),
            ("write", q.writes),
            ("flush", q.flushes),
            ("other", q.other),
            ("invalid", invalid),
        ] {
            let l = [
                ("export", q.export.as_str()),
                ("queue", &queue),
                ("iothread", id),
                ("type", ty),
            ];
            by_type.push(counter(&l, v as f64));
        }
    }
    f.add(
        "vqblk_requests_total",
        "Requests completed (any status), by type: read, write, flush, other \
         (discard, write-zeroes, GET_ID) and invalid (refused before its type mattered).",
        COUNTER,
        by_type,
    );
    f.add(
        "vqblk_read_bytes_total",
        "Bytes read by the guest.",
        COUNTER,
        by_queue(&|q| q.bytes_read as f64, false),
    );
    f.add(
        "vqblk_written_bytes_total",
        "Bytes written by the guest.",
        COUNTER,
        by_queue(&|q| q.bytes_written as f64, false),
    );
    let mut errors = Vec::new();
    for (q, id, queue) in queues() {
        for (kind, v) in &q.errors_by_kind {
            let l = [
                ("export", q.export.as_str()),
                ("queue", &queue),
                ("iothread", id),
                ("kind", kind.as_str()),
            ];
            errors.push(counter(&l, *v as f64));
        }
    }
    f.add(
        "vqblk_request_errors_total",
        "Requests completed with an error status, by kind: malformed, unsupported, \
         guest_memory, bounce_buffer, submit, io.",
        COUNTER,
        errors,
    );
    f.add(
        "vqblk_queue_throttled_requests_total",
        "Requests held back by the export's I/O limits (or its throttle group's) \
         before they ran (docs/qos.md).",
        COUNTER,
        by_queue(&|q| q.throttled as f64, false),
    );
    f.add(
        "vqblk_queue_throttled_seconds_total",
        "Time requests spent held back by the I/O limits, summed over the requests.",
        COUNTER,
        by_queue(&|q| q.throttled_ns as f64 / 1e9, false),
    );
    f.add(
        "vqblk_requests_in_flight",
        "Requests popped from the ring and not completed yet.",
        GAUGE,
        by_queue(&|q| q.in_flight as f64, true),
    );
    // Per export: the latency histogram, summed over queues and IOThreads.
    let mut per_export: Vec<(&str, LatencySnapshot)> = Vec::new();
    for (q, _, _) in queues() {
        match per_export.iter_mut().find(|(e, _)| *e == q.export) {
            Some((_, h)) => h.merge(&q.latency),
            None => per_export.push((&q.export, q.latency.clone())),
        }
    }
    per_export.sort_by(|a, b| a.0.cmp(b.0));
    f.add(
        "vqblk_request_duration_seconds",
        "Time from a request's pop off the ring to its completion.",
        HISTOGRAM,
        per_export
            .iter()
            .map(|(e, h)| histogram(&[("export", e)], h))
            .collect(),
    );
    // Per IOThread.
    type Get = fn(&IoThreadSnapshot) -> f64;
    let per_thread: [(&str, &str, MetricType, Get); 23] = [
        (
            "vqblk_iothread_cpu_seconds_total",
            "CPU time (user and system) of the IOThread.",
            COUNTER,
            |t| t.cpu_seconds,
        ),
        (
            "vqblk_iothread_requests_total",
            "Requests completed by the IOThread.",
            COUNTER,
            |t| t.requests as f64,
        ),
        (
            "vqblk_iothread_passes_total",
            "Event-loop passes.",
            COUNTER,
            |t| t.passes as f64,
        ),
        (
            "vqblk_iothread_passes_ready_total",
            "Event-loop passes that found a queue with work.",
            COUNTER,
            |t| t.passes_ready as f64,
        ),
        (
            "vqblk_iothread_passes_ready_together_total",
            "Event-loop passes that found two or more queues with work at once.",
            COUNTER,
            |t| t.passes_ready_together as f64,
        ),
        (
            "vqblk_iothread_poll_attempts_total",
            "Passes that busy-polled.",
            COUNTER,
            |t| t.poll_attempts as f64,
        ),
        (
            "vqblk_iothread_poll_hits_total",
            "Passes whose work was found by polling (no sleep).",
            COUNTER,
            |t| t.poll_hits as f64,
        ),
        (
            "vqblk_iothread_poll_window_seconds",
            "Current polling window.",
            GAUGE,
            |t| t.poll_window_ns as f64 / 1e9,
        ),
        (
            "vqblk_iothread_poll_seconds_total",
            "Time spent busy-polling.",
            COUNTER,
            |t| t.poll_seconds,
        ),
        (
            "vqblk_iothread_sleep_seconds_total",
            "Time spent blocked waiting for events.",
            COUNTER,
            |t| t.sleep_seconds,
        ),
        (
            "vqblk_iothread_naps_total",
            "Hybrid-polling naps (timed sleeps before spinning).",
            COUNTER,
            |t| t.naps as f64,
        ),
        (
            "vqblk_iothread_poll_trials_total",
            "Trials of sleeping until each event against adaptive polling that gave a verdict.",
            COUNTER,
            |t| t.poll_trials as f64,
        ),
        (
            "vqblk_iothread_poll_trials_slept_total",
            "Trials in which sleeping until each event was as fast, within the IOPS budget (the thread then sleeps until the next trial).",
            COUNTER,
            |t| t.poll_trials_slept as f64,
        ),
        (
            "vqblk_iothread_nap_late_seconds",
            "How late a timed nap may end, as measured by the IOThread (adaptive polling; 0 otherwise).",
            GAUGE,
            |t| t.nap_late_ns as f64 / 1e9,
        ),
        (
            "vqblk_iothread_nap_cpu_seconds",
            "Thread CPU time one timed nap costs, as measured (adaptive polling; 0 otherwise).",
            GAUGE,
            |t| t.nap_cpu_ns as f64 / 1e9,
        ),
        (
            "vqblk_iothread_stale_edges_total",
            "Wake-ups that brought only events polling had already served.",
            COUNTER,
            |t| t.stale_edges as f64,
        ),
        (
            "vqblk_iothread_kicks_total",
            "Guest kick edges seen (stale ones included).",
            COUNTER,
            |t| t.kicks as f64,
        ),
        (
            "vqblk_iothread_notifications_total",
            "Guest notifications (call eventfd writes) sent.",
            COUNTER,
            |t| t.notifications as f64,
        ),
        (
            "vqblk_iothread_notifications_suppressed_total",
            "Notification checks after which no call was sent: the guest did not ask for one.",
            COUNTER,
            |t| t.notifications_suppressed as f64,
        ),
        (
            "vqblk_iothread_used_publishes_total",
            "Used ring entries published (each stores the used index).",
            COUNTER,
            |t| t.used_publishes as f64,
        ),
        (
            "vqblk_iothread_used_batches_total",
            "Completion rounds that published at least one used entry.",
            COUNTER,
            |t| t.used_batches as f64,
        ),
        (
            "vqblk_iothread_budget_exhausted_total",
            "Passes in which a queue used up its pop budget.",
            COUNTER,
            |t| t.budget_exhausted as f64,
        ),
        (
            "vqblk_iothread_broken_rings_total",
            "Rings found in an impossible state and stopped.",
            COUNTER,
            |t| t.broken_rings as f64,
        ),
    ];
    for (name, help, kind, get) in per_thread {
        let metrics = iothreads
            .iter()
            .zip(&ids)
            .map(|(t, id)| {
                let l = [("iothread", id.as_str())];
                if kind == GAUGE {
                    gauge(&l, get(t))
                } else {
                    counter(&l, get(t))
                }
            })
            .collect();
        f.add(name, help, kind, metrics);
    }
    let mut wakeups = Vec::new();
    for (t, id) in iothreads.iter().zip(&ids) {
        for (cause, v) in [
            ("kick", t.kick_wakeups),
            ("completion", t.completion_wakeups),
        ] {
            wakeups.push(counter(&[("iothread", id), ("cause", cause)], v as f64));
        }
    }
    f.add(
        "vqblk_iothread_wakeups_total",
        "Wake-ups with work, by cause: a guest kick or a backend completion.",
        COUNTER,
        wakeups,
    );
    let mut out = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&f.0, &mut out) {
        error!("metrics: encoding failed: {e}");
    }
    String::from_utf8(out).unwrap_or_default()
}

/// What the share allocator (reservations and weights, docs/qos.md)
/// decided last, as its thread publishes it every tick.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShareReading {
    /// Per export on a device with reservations or weights: its name, the
    /// backing device's label and its cap (None: uncapped).
    pub exports: Vec<(String, String, Option<f64>)>,
    /// Per backing device: its label and the capacity estimate (None: not
    /// seen saturated yet).
    pub devices: Vec<(String, Option<f64>)>,
}

/// Where a controller thread (the share allocator, the online tuner)
/// publishes what it decided last, for scrapes and queries: a mutex the data
/// path never takes.
#[derive(Debug, Default)]
pub struct Board<T>(std::sync::Mutex<T>);

impl<T: Clone> Board<T> {
    /// Replaces the reading.
    pub fn publish(&self, reading: T) {
        *self.0.lock().unwrap() = reading;
    }

    /// The last reading.
    pub fn reading(&self) -> T {
        self.0.lock().unwrap().clone()
    }
}

/// The share allocator's board.
pub type ShareBoard = Board<ShareReading>;

/// The exposition text of the share allocator's reading (nothing without
/// reservations or weights). A pure function: tested without a server.
pub fn render_shares(r: &ShareReading) -> String {
    let mut f = Families(Vec::new());
    f.add(
        "vqblk_export_share_cap_iops",
        "The IOPS cap the share allocator gives the export (reservations and weights).",
        MetricType::GAUGE,
        r.exports
            .iter()
            .filter_map(|(e, d, cap)| cap.map(|c| gauge(&[("export", e), ("device", d)], c)))
            .collect(),
    );
    f.add(
        "vqblk_device_capacity_estimate_iops",
        "The share allocator's estimate of what the backing device completes, IOPS.",
        MetricType::GAUGE,
        r.devices
            .iter()
            .filter_map(|(d, c)| c.map(|c| gauge(&[("device", d)], c)))
            .collect(),
    );
    let mut out = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&f.0, &mut out) {
        error!("metrics: encoding failed: {e}");
    }
    String::from_utf8(out).unwrap_or_default()
}

/// What the online tuner of the IOThread pool (`--iothreads auto`,
/// docs/autotune.md) has done, as its thread publishes it every tick.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TuneReading {
    /// Queue moves carried out, by reason (every reason, zero included).
    pub moves: Vec<(&'static str, u64)>,
    /// Queue moves that failed.
    pub failed: u64,
    /// Per IOThread (index = the `iothread` label): it owns a queue
    /// (active) rather than sleeping without one (parked).
    pub active: Vec<bool>,
}

/// The online tuner's board.
pub type TuneBoard = Board<TuneReading>;

/// The exposition text of the online tuner's reading. A pure function:
/// tested without a server.
pub fn render_tune(r: &TuneReading) -> String {
    let mut f = Families(Vec::new());
    f.add(
        "vqblk_autotune_moves_total",
        "Queue moves the online tuner carried out, by reason: balance, activate \
         (wake a parked IOThread), park, budget (docs/autotune.md).",
        MetricType::COUNTER,
        r.moves
            .iter()
            .map(|(reason, n)| counter(&[("reason", reason)], *n as f64))
            .collect(),
    );
    f.add(
        "vqblk_autotune_failed_moves_total",
        "Queue moves the online tuner decided that failed.",
        MetricType::COUNTER,
        vec![counter(&[], r.failed as f64)],
    );
    f.add(
        "vqblk_iothread_active",
        "1 if the IOThread owns a queue, 0 if the online tuner parked it (no queue, no CPU).",
        MetricType::GAUGE,
        r.active
            .iter()
            .enumerate()
            .map(|(i, &a)| gauge(&[("iothread", &i.to_string())], if a { 1.0 } else { 0.0 }))
            .collect(),
    );
    let mut out = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&f.0, &mut out) {
        error!("metrics: encoding failed: {e}");
    }
    String::from_utf8(out).unwrap_or_default()
}

#[cfg(test)]
mod tests;
