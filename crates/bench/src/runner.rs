//! Runs a [`Plan`]: opens the targets, checks the jobs against them, runs one thread per
//! job clone (each with its own engine) and collects a [`Report`].

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::cpu::{self, CpuTimes};
use crate::engine::blkio::{BlkioDevice, DESCRIPTORS_PER_REQUEST};
use crate::engine::uring::NativeDevice;
use crate::engine::{Done, Engine, EngineError};
use crate::job::{Dir, DirPicker, OffsetGen, Prng, Region};
use crate::options::{JobSpec, OutputFormat, Target, VerifyMode, WaitMode};
use crate::stats::DirStats;
use crate::verify::{check_block, fill_block, Mismatch};

/// Mismatches kept per job thread for the report (all are counted).
const MAX_MISMATCHES_KEPT: usize = 64;

/// Everything a run needs: the jobs plus run-wide settings.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Job descriptions (each cloned `numjobs` times).
    pub jobs: Vec<JobSpec>,
    /// Output format.
    pub output_format: OutputFormat,
    /// Process whose CPU time is reported as the server's.
    pub server_pid: Option<u32>,
    /// With verify: created after the write pass; the read pass starts once it is removed.
    pub verify_pause_file: Option<PathBuf>,
    /// How long to wait for the vhost-user handshake.
    pub connect_timeout: Duration,
    /// Print a progress line on stdout once a second (only when stdout is a terminal).
    pub progress: bool,
}

/// Errors of a run that are the user's to fix (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The engine layer failed to set up.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A job does not fit the device it targets.
    #[error("{0}")]
    Config(String),
    /// The hook between the verify passes failed.
    #[error("between verify passes: {0}")]
    Hook(String),
}

/// Description of one opened target, for the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TargetInfo {
    /// As given (`unix:/x.sock`).
    pub target: String,
    /// `libblkio virtio-blk-vhost-user` or `io_uring`.
    pub engine: String,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Offsets and lengths must be multiples of this.
    pub request_alignment: u64,
    /// Virtqueue size (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<u32>,
    /// Queues used (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_queues: Option<u32>,
    /// Queues the device offers (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_queues: Option<u32>,
    /// Completion wait mode (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_mode: Option<WaitMode>,
    /// O_DIRECT (native only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direct: Option<bool>,
}

/// Results of one job clone or one reporting group.
#[derive(Debug, Clone)]
pub struct JobReport {
    /// Job name.
    pub name: String,
    /// fio's group id (always 0: jobs run concurrently).
    pub groupid: u32,
    /// Threads folded into this report.
    pub threads: u32,
    /// The job description (of the first job in a group).
    pub spec: JobSpec,
    /// Read counters.
    pub read: DirStats,
    /// Write counters.
    pub write: DirStats,
    /// Measured time with reads in flight.
    pub read_runtime: Duration,
    /// Measured time with writes in flight.
    pub write_runtime: Duration,
    /// Measured time of the job.
    pub runtime: Duration,
    /// CPU time of the job threads while measured.
    pub cpu: CpuTimes,
    /// First I/O error, if any.
    pub error: Option<String>,
    /// Number of failed requests.
    pub io_errors: u64,
}

/// Verification results over all jobs.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct VerifySummary {
    /// Blocks read back and checked.
    pub blocks_checked: u64,
    /// Blocks that did not match.
    pub errors: u64,
    /// The first mismatches, by job thread.
    pub mismatches: Vec<Mismatch>,
    /// Seed written into every header of this run.
    pub seed: u64,
}

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Start of the run, seconds since the epoch.
    pub timestamp: u64,
    /// Start of the run, milliseconds since the epoch.
    pub timestamp_ms: u64,
    /// Per clone, or one per group with group reporting.
    pub jobs: Vec<JobReport>,
    /// Wall time of the passes.
    pub elapsed: Duration,
    /// Whole-process CPU time over the passes.
    pub client_cpu: CpuTimes,
    /// The server's CPU time over the passes, or why it could not be read.
    pub server_cpu: Option<Result<CpuTimes, String>>,
    /// `--server-pid`.
    pub server_pid: Option<u32>,
    /// The server's CPU time per thread over the passes (with `--server-pid`).
    pub server_threads: Vec<cpu::ThreadCpu>,
    /// Verification results, when verify was asked for.
    pub verify: Option<VerifySummary>,
    /// Targets used.
    pub targets: Vec<TargetInfo>,
    /// Whether jobs were folded into one group.
    pub group_reporting: bool,
}

impl Report {
    /// Measured requests over all jobs.
    pub fn total_ios(&self) -> u64 {
        self.jobs
            .iter()
            .map(|j| j.read.total_ios + j.write.total_ios)
            .sum()
    }

    /// 0 when clean, 1 on verify mismatches or I/O errors (fio returns 1 for both).
    pub fn exit_code(&self) -> i32 {
        let verify_bad = self.verify.as_ref().is_some_and(|v| v.errors > 0);
        let io_bad = self.jobs.iter().any(|j| j.io_errors > 0);
        i32::from(verify_bad || io_bad)
    }
}

/// Which pass a job thread is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Workload,
    VerifyWrite,
    VerifyRead,
}

/// One job clone after planning.
#[derive(Debug, Clone)]
struct Clone_ {
    job: usize,
    index: u32,
    region: Region,
}

/// Per-thread counters read by the progress line (single writer, plain stores).
#[repr(align(64))]
#[derive(Default)]
struct Counter {
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    read_ios: AtomicU64,
    write_ios: AtomicU64,
}

/// Start line of a pass: job threads wait until the main thread opens it, all at once,
/// or calls the pass off (a thread could not be spawned).
#[derive(Default)]
struct Gate {
    state: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Gate {
    /// Blocks until the gate opens; returns whether to run.
    fn wait(&self) -> bool {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(go) = *g {
                return go;
            }
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn open(&self, go: bool) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(go);
        self.cv.notify_all();
    }
}

/// What one job thread measured in one pass.
#[derive(Debug, Default)]
struct CloneOutcome {
    read: DirStats,
    write: DirStats,
    read_runtime: Duration,
    write_runtime: Duration,
    runtime: Duration,
    cpu: CpuTimes,
    error: Option<String>,
    io_errors: u64,
    checked: u64,
    mismatch_count: u64,
    mismatches: Vec<Mismatch>,
}

impl CloneOutcome {
    fn absorb(&mut self, o: CloneOutcome) {
        self.read.merge(&o.read);
        self.write.merge(&o.write);
        self.read_runtime += o.read_runtime;
        self.write_runtime += o.write_runtime;
        self.runtime += o.runtime;
        self.cpu.user += o.cpu.user;
        self.cpu.sys += o.cpu.sys;
        self.cpu.ctx += o.cpu.ctx;
        if self.error.is_none() {
            self.error = o.error;
        }
        self.io_errors += o.io_errors;
        self.checked += o.checked;
        self.mismatch_count += o.mismatch_count;
        self.mismatches.extend(o.mismatches);
    }
}

struct Work<'a> {
    spec: &'a JobSpec,
    region: Region,
    pass: Pass,
    seed: u64,
    verify_seed: u64,
    counter: &'a Counter,
    gate: &'a Gate,
}

#[derive(Debug, Clone, Copy)]
struct SlotState {
    offset: u64,
    dir: Dir,
    issued: Instant,
    submitted: Instant,
    counted: bool,
}

fn errno_text(result: i32) -> String {
    std::io::Error::from_raw_os_error(-result).to_string()
}

/// The loop of one job thread: keep `iodepth` requests in flight until the pass or the
/// run time is over, then drain.
fn run_clone(engine: &mut dyn Engine, w: &Work) -> CloneOutcome {
    let spec = w.spec;
    let bs = spec.bs as usize;
    let depth = spec.iodepth as usize;
    let mut out = CloneOutcome::default();

    let (random, read_pct, time_based, runtime, ramp) = match w.pass {
        Pass::Workload => (
            spec.rw.is_random(),
            spec.rw.read_percent(spec.rwmixread),
            spec.time_based,
            spec.runtime,
            spec.ramp_time,
        ),
        Pass::VerifyWrite => (spec.rw.is_random(), 0, false, None, Duration::ZERO),
        Pass::VerifyRead => (false, 100, false, None, Duration::ZERO),
    };
    let mut gen = OffsetGen::new(w.region, random, w.seed);
    let mut picker = DirPicker::new(read_pct, w.seed);
    if w.pass == Pass::Workload && read_pct < 100 {
        // Like fio: write buffers hold random data, filled once.
        let mut p = Prng::new(w.seed);
        for s in 0..depth {
            for c in engine.buffer(s).chunks_exact_mut(8) {
                c.copy_from_slice(&p.next_u64().to_le_bytes());
            }
        }
    }
    let mut scratch = if w.pass == Pass::VerifyRead {
        vec![0u8; bs]
    } else {
        Vec::new()
    };

    let t0 = Instant::now();
    let mut slots = vec![
        SlotState {
            offset: 0,
            dir: Dir::Read,
            issued: t0,
            submitted: t0,
            counted: false,
        };
        depth
    ];
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut newly: Vec<usize> = Vec::with_capacity(depth);
    let mut done: Vec<Done> = Vec::with_capacity(depth);

    if !w.gate.wait() {
        return out;
    }
    let start = Instant::now();
    let ramp_end = start + ramp;
    let mut measuring = ramp.is_zero();
    let mut measure_start = start;
    let mut cpu0 = cpu::thread_times();
    let mut end = if measuring {
        runtime.map(|r| start + r)
    } else {
        None
    };
    let mut last_completion = start;
    let mut issuing = true;
    let mut inflight = 0usize;

    loop {
        if issuing && inflight < depth {
            let t = Instant::now();
            while inflight < depth {
                let off = match gen.next_offset() {
                    Some(o) => o,
                    None if time_based || !measuring => {
                        gen.reset();
                        match gen.next_offset() {
                            Some(o) => o,
                            None => {
                                issuing = false;
                                break;
                            }
                        }
                    }
                    None => {
                        issuing = false;
                        break;
                    }
                };
                let dir = picker.next_dir();
                let Some(slot) = free.pop() else { break };
                if w.pass == Pass::VerifyWrite {
                    fill_block(engine.buffer(slot), off, w.verify_seed);
                }
                if let Err(e) = engine.queue(slot, dir, off) {
                    free.push(slot);
                    out.error.get_or_insert(e.to_string());
                    issuing = false;
                    break;
                }
                slots[slot] = SlotState {
                    offset: off,
                    dir,
                    issued: t,
                    submitted: t,
                    counted: measuring,
                };
                newly.push(slot);
                inflight += 1;
            }
            if !newly.is_empty() {
                if let Err(e) = engine.commit() {
                    out.error.get_or_insert(e.to_string());
                    out.io_errors += inflight as u64;
                    break;
                }
                let ts = Instant::now();
                for &s in &newly {
                    slots[s].submitted = ts;
                }
                newly.clear();
            }
        }
        if inflight == 0 {
            break;
        }
        done.clear();
        if let Err(e) = engine.reap(1, &mut done) {
            out.error.get_or_insert(e.to_string());
            out.io_errors += inflight as u64;
            break;
        }
        let now = Instant::now();
        for d in &done {
            let st = slots[d.slot];
            inflight -= 1;
            free.push(d.slot);
            if d.result != 0 {
                out.io_errors += 1;
                out.error.get_or_insert_with(|| {
                    format!(
                        "{} of {bs} bytes at offset {} failed: {}",
                        if st.dir == Dir::Read { "read" } else { "write" },
                        st.offset,
                        errno_text(d.result)
                    )
                });
                issuing = false;
                continue;
            }
            if w.pass == Pass::VerifyRead {
                out.checked += 1;
                if let Some(m) = check_block(
                    engine.buffer(d.slot),
                    st.offset,
                    w.verify_seed,
                    &mut scratch,
                ) {
                    out.mismatch_count += 1;
                    if out.mismatches.len() < MAX_MISMATCHES_KEPT {
                        out.mismatches.push(m);
                    }
                }
            }
            if st.counted {
                let slat = st.submitted.duration_since(st.issued).as_nanos() as u64;
                let clat = now.duration_since(st.submitted).as_nanos() as u64;
                match st.dir {
                    Dir::Read => out.read.record(bs as u64, slat, clat),
                    Dir::Write => out.write.record(bs as u64, slat, clat),
                }
                last_completion = now;
            }
        }
        w.counter
            .read_bytes
            .store(out.read.io_bytes, Ordering::Relaxed);
        w.counter
            .write_bytes
            .store(out.write.io_bytes, Ordering::Relaxed);
        w.counter
            .read_ios
            .store(out.read.total_ios, Ordering::Relaxed);
        w.counter
            .write_ios
            .store(out.write.total_ios, Ordering::Relaxed);

        if !measuring && now >= ramp_end {
            measuring = true;
            measure_start = now;
            last_completion = now;
            cpu0 = cpu::thread_times();
            end = runtime.map(|r| now + r);
            if !time_based {
                // The ramp wrapped freely; the measured pass starts from the top.
                gen.reset();
            }
        }
        if end.is_some_and(|e| now >= e) {
            issuing = false;
        }
    }

    out.cpu = cpu::thread_times().since(&cpu0);
    out.runtime = last_completion.saturating_duration_since(measure_start);
    if out.read.total_ios > 0 {
        out.read_runtime = out.runtime;
    }
    if out.write.total_ios > 0 {
        out.write_runtime = out.runtime;
    }
    out
}

/// An opened target.
enum Device {
    Blkio(BlkioDevice),
    Native(NativeDevice),
}

impl Device {
    fn capacity(&self) -> u64 {
        match self {
            Device::Blkio(d) => d.capacity,
            Device::Native(d) => d.capacity,
        }
    }

    fn request_alignment(&self) -> u64 {
        match self {
            Device::Blkio(d) => d.request_alignment,
            Device::Native(d) => d.request_alignment,
        }
    }
}

/// Key of a device: native targets opened with and without O_DIRECT are distinct.
fn device_key(spec: &JobSpec) -> (Target, bool) {
    (
        spec.target.clone(),
        spec.target.is_vhost_user() || spec.direct,
    )
}

/// Queue size used for vhost-user when the job gives none: libblkio's default (256),
/// raised so that `iodepth` requests fit (three descriptors each).
pub fn auto_queue_size(max_iodepth: u32) -> u32 {
    max_iodepth
        .saturating_mul(DESCRIPTORS_PER_REQUEST)
        .min(32768)
        .next_power_of_two()
        .max(256)
}

/// Runs `plan`. `between_verify_passes` is called after the verify write pass and before
/// the read pass (after the pause file, if any, is removed); tests corrupt data there.
pub fn execute(
    plan: &Plan,
    between_verify_passes: &mut dyn FnMut() -> anyhow::Result<()>,
) -> Result<Report, RunError> {
    if plan.jobs.is_empty() {
        return Err(RunError::Config("no job to run".into()));
    }
    let verify = plan.jobs.iter().any(|j| j.verify == VerifyMode::Crc32c);
    if verify && plan.jobs.iter().any(|j| j.verify == VerifyMode::None) {
        return Err(RunError::Config(
            "verify=crc32c jobs cannot run together with jobs without verify".into(),
        ));
    }

    // Open every distinct target once.
    let mut keys: Vec<(Target, bool)> = Vec::new();
    for j in &plan.jobs {
        let k = device_key(j);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut devices: Vec<Device> = Vec::with_capacity(keys.len());
    for (target, direct) in &keys {
        let dev = match target {
            Target::Unix(p) => Device::Blkio(BlkioDevice::connect(p, plan.connect_timeout)?),
            Target::File(p) | Target::Dev(p) => {
                // A missing file is laid out up to the end of the furthest region.
                let create_len = plan
                    .jobs
                    .iter()
                    .filter(|j| &j.target == target)
                    .filter_map(|j| {
                        let size = j.size?;
                        let last = u64::from(j.numjobs - 1) * j.offset_increment;
                        Some(j.offset + last + size)
                    })
                    .max();
                Device::Native(NativeDevice::open(
                    p,
                    matches!(target, Target::Dev(_)),
                    *direct,
                    create_len,
                )?)
            }
        };
        devices.push(dev);
    }

    // Regions per clone, checked against the device.
    let mut clones: Vec<(Clone_, usize)> = Vec::new();
    for (ji, j) in plan.jobs.iter().enumerate() {
        let di = keys.iter().position(|k| *k == device_key(j)).unwrap_or(0);
        let dev = &devices[di];
        let cap = dev.capacity();
        let align = dev.request_alignment();
        if j.bs % align != 0 {
            return Err(RunError::Config(format!(
                "job '{}': bs {} is not a multiple of {}'s block size {align}",
                j.name, j.bs, j.target
            )));
        }
        for k in 0..j.numjobs {
            let start = j.offset + u64::from(k) * j.offset_increment;
            if start % align != 0 {
                return Err(RunError::Config(format!(
                    "job '{}': offset {start} is not a multiple of {}'s block size {align}",
                    j.name, j.target
                )));
            }
            if start >= cap {
                return Err(RunError::Config(format!(
                    "job '{}' (clone {k}): offset {start} is at or past the end of {} \
                     ({cap} bytes)",
                    j.name, j.target
                )));
            }
            let len = match j.size {
                Some(s) => {
                    if start + s > cap {
                        return Err(RunError::Config(format!(
                            "job '{}' (clone {k}): size {s} at offset {start} ends past the end \
                             of {} ({cap} bytes); reduce size or offset",
                            j.name, j.target
                        )));
                    }
                    s
                }
                None => cap - start,
            };
            let len = len / j.bs * j.bs;
            if len == 0 {
                return Err(RunError::Config(format!(
                    "job '{}' (clone {k}): the region at offset {start} holds no block of {} bytes",
                    j.name, j.bs
                )));
            }
            clones.push((
                Clone_ {
                    job: ji,
                    index: k,
                    region: Region {
                        start,
                        len,
                        bs: j.bs,
                    },
                },
                di,
            ));
        }
    }

    // Engines, in clone order.
    let mut engines: Vec<Option<Box<dyn Engine>>> = (0..clones.len()).map(|_| None).collect();
    let mut targets = Vec::new();
    for (di, dev) in devices.into_iter().enumerate() {
        let mine: Vec<usize> = (0..clones.len()).filter(|&c| clones[c].1 == di).collect();
        let target = keys[di].0.to_string();
        match dev {
            Device::Blkio(d) => {
                let jobs_here: Vec<&JobSpec> =
                    mine.iter().map(|&c| &plan.jobs[clones[c].0.job]).collect();
                let nq = mine.len() as u32;
                if nq > d.max_queues {
                    return Err(RunError::Config(format!(
                        "{target}: {nq} job threads need {nq} queues but the device offers {} \
                         (num-queues of the export); lower numjobs",
                        d.max_queues
                    )));
                }
                let explicit = jobs_here.iter().filter_map(|j| j.queue_size).max();
                let max_depth = jobs_here.iter().map(|j| j.iodepth).max().unwrap_or(1);
                let qs = explicit.unwrap_or_else(|| auto_queue_size(max_depth));
                let fits = qs / DESCRIPTORS_PER_REQUEST;
                if let Some(j) = jobs_here.iter().find(|j| j.iodepth > fits) {
                    return Err(RunError::Config(format!(
                        "job '{}': iodepth {} is larger than what a queue of {qs} entries holds \
                         ({fits} requests: libblkio uses {DESCRIPTORS_PER_REQUEST} descriptors \
                         per request); raise queue_size to {} or lower iodepth",
                        j.name,
                        j.iodepth,
                        auto_queue_size(j.iodepth)
                    )));
                }
                let wait_mode = jobs_here[0].wait_mode;
                if jobs_here.iter().any(|j| j.wait_mode != wait_mode) {
                    return Err(RunError::Config(format!(
                        "{target}: all jobs on one socket must use the same libblkio_wait_mode"
                    )));
                }
                let capacity = d.capacity;
                let request_alignment = d.request_alignment;
                let max_queues = d.max_queues;
                let queues: Vec<(u32, u64)> = jobs_here.iter().map(|j| (j.iodepth, j.bs)).collect();
                let es = d.start(&queues, qs, wait_mode)?;
                for (&c, e) in mine.iter().zip(es) {
                    engines[c] = Some(Box::new(e));
                }
                targets.push(TargetInfo {
                    target,
                    engine: format!("libblkio {}", crate::engine::blkio::DRIVER),
                    capacity,
                    request_alignment,
                    queue_size: Some(qs),
                    num_queues: Some(nq),
                    max_queues: Some(max_queues),
                    wait_mode: Some(wait_mode),
                    direct: None,
                });
            }
            Device::Native(d) => {
                for &c in &mine {
                    let j = &plan.jobs[clones[c].0.job];
                    engines[c] = Some(Box::new(d.engine(j.iodepth, j.bs)?));
                }
                targets.push(TargetInfo {
                    target,
                    engine: "io_uring".into(),
                    capacity: d.capacity,
                    request_alignment: d.request_alignment,
                    queue_size: None,
                    num_queues: None,
                    max_queues: None,
                    wait_mode: None,
                    direct: Some(d.direct),
                });
            }
        }
    }
    let mut engines: Vec<Box<dyn Engine>> = engines
        .into_iter()
        .map(|e| e.ok_or_else(|| RunError::Config("internal: a job has no engine".into())))
        .collect::<Result<_, _>>()?;

    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let verify_seed = Prng::new(now.as_nanos() as u64 ^ u64::from(std::process::id())).next_u64();
    let passes: &[Pass] = if verify {
        &[Pass::VerifyWrite, Pass::VerifyRead]
    } else {
        &[Pass::Workload]
    };

    let mut outcomes: Vec<CloneOutcome> =
        (0..clones.len()).map(|_| CloneOutcome::default()).collect();
    let mut client_cpu = CpuTimes::default();
    let mut server_cpu: Option<Result<CpuTimes, String>> =
        plan.server_pid.map(|_| Ok(CpuTimes::default()));
    let mut server_threads: Vec<cpu::ThreadCpu> = Vec::new();
    let mut elapsed = Duration::ZERO;
    let progress = plan.progress && std::io::stdout().is_terminal();

    for (pi, &pass) in passes.iter().enumerate() {
        if pi > 0 {
            pause_between_passes(plan)?;
            between_verify_passes().map_err(|e| RunError::Hook(format!("{e:#}")))?;
        }
        let counters: Vec<Counter> = (0..clones.len()).map(|_| Counter::default()).collect();
        let gate = Gate::default();
        let finished = AtomicUsize::new(0);
        let ramp = if pass == Pass::Workload {
            plan.jobs
                .iter()
                .map(|j| j.ramp_time)
                .max()
                .unwrap_or_default()
        } else {
            Duration::ZERO
        };
        let main = std::thread::current();

        let pass_out: Vec<CloneOutcome> = std::thread::scope(|s| -> Result<_, RunError> {
            let mut handles = Vec::new();
            let mut spawn_error = None;
            for (ci, (engine, (cl, _))) in engines.iter_mut().zip(&clones).enumerate() {
                let spec = &plan.jobs[cl.job];
                let work = Work {
                    spec,
                    region: cl.region,
                    pass,
                    seed: spec.randseed ^ (ci as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                    verify_seed,
                    counter: &counters[ci],
                    gate: &gate,
                };
                let finished = &finished;
                let main = main.clone();
                let name = format!("{}.{}", spec.name, cl.index);
                let h = std::thread::Builder::new()
                    .name(name.chars().take(15).collect())
                    .spawn_scoped(s, move || {
                        let o = run_clone(engine.as_mut(), &work);
                        finished.fetch_add(1, Ordering::Release);
                        main.unpark();
                        o
                    });
                match h {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        spawn_error = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = spawn_error {
                gate.open(false);
                for h in handles {
                    let _ = h.join();
                }
                return Err(RunError::Config(format!("cannot spawn a job thread: {e}")));
            }
            gate.open(true);
            let t0 = Instant::now();
            let mut sampled = false;
            let mut client0 = cpu::process_times();
            let mut server0 = plan.server_pid.map(cpu::server_times);
            let mut threads0 = plan
                .server_pid
                .map(cpu::server_thread_times)
                .unwrap_or_default();
            if ramp.is_zero() {
                sampled = true;
            }
            let mut last_print = t0;
            let mut last_totals = [0u64; 4];
            let total = clones.len();
            while finished.load(Ordering::Acquire) < total {
                let el = t0.elapsed();
                let wake = if !sampled {
                    ramp.saturating_sub(el)
                } else {
                    Duration::from_millis(1000)
                };
                std::thread::park_timeout(wake.max(Duration::from_millis(1)));
                if !sampled && t0.elapsed() >= ramp {
                    sampled = true;
                    client0 = cpu::process_times();
                    server0 = plan.server_pid.map(cpu::server_times);
                    threads0 = plan
                        .server_pid
                        .map(cpu::server_thread_times)
                        .unwrap_or_default();
                }
                if progress && last_print.elapsed() >= Duration::from_millis(1000) {
                    let interval = last_print.elapsed();
                    last_print = Instant::now();
                    last_totals = print_progress(
                        plan,
                        &clones,
                        &counters,
                        (t0.elapsed(), interval),
                        last_totals,
                        pass,
                    );
                }
            }
            let wall = t0.elapsed().saturating_sub(ramp);
            let client1 = cpu::process_times();
            let server1 = plan.server_pid.map(cpu::server_times);
            let threads1 = plan
                .server_pid
                .map(cpu::server_thread_times)
                .unwrap_or_default();
            for d in cpu::thread_delta(&threads0, &threads1) {
                match server_threads.iter_mut().find(|t| t.tid == d.tid) {
                    Some(t) => t.cpu += d.cpu,
                    None => server_threads.push(d),
                }
            }
            elapsed += wall;
            client_cpu = add_cpu(client_cpu, client1.since(&client0));
            if let (Some(acc), Some(a), Some(b)) = (server_cpu.as_mut(), server0, server1) {
                match (a, b) {
                    (Ok(a), Ok(b)) => {
                        if let Ok(acc) = acc {
                            *acc = add_cpu(*acc, b.since(&a));
                        }
                    }
                    (Err(e), _) | (_, Err(e)) => *acc = Err(e),
                }
            }
            Ok(handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| CloneOutcome {
                        error: Some("job thread panicked".into()),
                        io_errors: 1,
                        ..Default::default()
                    })
                })
                .collect())
        })?;
        if progress {
            // Clear the progress line.
            let mut o = std::io::stdout();
            let _ = write!(o, "\r{:80}\r", "");
            let _ = o.flush();
        }
        for (acc, o) in outcomes.iter_mut().zip(pass_out) {
            acc.absorb(o);
        }
    }

    let group = plan.jobs.iter().any(|j| j.group_reporting);
    let mut jobs: Vec<JobReport> = Vec::new();
    let mut vsum = VerifySummary {
        seed: verify_seed,
        ..Default::default()
    };
    for ((cl, _), o) in clones.iter().zip(outcomes) {
        vsum.blocks_checked += o.checked;
        vsum.errors += o.mismatch_count;
        vsum.mismatches.extend(o.mismatches.iter().cloned());
        let spec = &plan.jobs[cl.job];
        let jr = JobReport {
            name: spec.name.clone(),
            groupid: 0,
            threads: 1,
            spec: spec.clone(),
            read: o.read,
            write: o.write,
            read_runtime: o.read_runtime,
            write_runtime: o.write_runtime,
            runtime: o.runtime,
            cpu: o.cpu,
            error: o.error,
            io_errors: o.io_errors,
        };
        if group {
            if let Some(g) = jobs.first_mut() {
                g.threads += 1;
                g.read.merge(&jr.read);
                g.write.merge(&jr.write);
                g.read_runtime = g.read_runtime.max(jr.read_runtime);
                g.write_runtime = g.write_runtime.max(jr.write_runtime);
                g.runtime = g.runtime.max(jr.runtime);
                g.cpu = add_cpu(g.cpu, jr.cpu);
                g.io_errors += jr.io_errors;
                if g.error.is_none() {
                    g.error = jr.error;
                }
                continue;
            }
        }
        jobs.push(jr);
    }
    vsum.mismatches.sort_by_key(|m| m.offset);

    Ok(Report {
        timestamp: now.as_secs(),
        timestamp_ms: now.as_millis() as u64,
        jobs,
        elapsed,
        client_cpu,
        server_cpu,
        server_pid: plan.server_pid,
        server_threads,
        verify: verify.then_some(vsum),
        targets,
        group_reporting: group,
    })
}

fn add_cpu(a: CpuTimes, b: CpuTimes) -> CpuTimes {
    CpuTimes {
        user: a.user + b.user,
        sys: a.sys + b.sys,
        ctx: a.ctx + b.ctx,
    }
}

/// With `verify_pause_file`: create it, then wait until someone removes it.
fn pause_between_passes(plan: &Plan) -> Result<(), RunError> {
    let Some(p) = &plan.verify_pause_file else {
        return Ok(());
    };
    std::fs::write(
        p,
        b"write pass done; remove this file to start the verify pass\n",
    )
    .map_err(|e| RunError::Hook(format!("create {}: {e}", p.display())))?;
    eprintln!(
        "vqblk bench: write pass done; waiting for {} to be removed",
        p.display()
    );
    let limit = Instant::now() + Duration::from_secs(3600);
    while p.exists() {
        if Instant::now() > limit {
            return Err(RunError::Hook(format!(
                "{} still there after an hour",
                p.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Prints fio's one-line status (rates over the last interval) and returns the totals
/// (read bytes, write bytes, read I/Os, write I/Os) for the next call.
fn print_progress(
    plan: &Plan,
    clones: &[(Clone_, usize)],
    counters: &[Counter],
    (el, interval): (Duration, Duration),
    last: [u64; 4],
    pass: Pass,
) -> [u64; 4] {
    let mut now = [0u64; 4];
    for c in counters {
        now[0] += c.read_bytes.load(Ordering::Relaxed);
        now[1] += c.write_bytes.load(Ordering::Relaxed);
        now[2] += c.read_ios.load(Ordering::Relaxed);
        now[3] += c.write_ios.load(Ordering::Relaxed);
    }
    let secs = interval.as_secs_f64().max(1e-3);
    let rate = |i: usize| now[i].saturating_sub(last[i]) as f64 / secs;
    let planned: Option<Duration> = plan
        .jobs
        .iter()
        .map(|j| j.runtime.map(|r| r + j.ramp_time))
        .collect::<Option<Vec<_>>>()
        .and_then(|v| v.into_iter().max());
    let (pct, eta) = match (pass, planned) {
        (Pass::Workload, Some(p)) => {
            let pct = (el.as_secs_f64() / p.as_secs_f64() * 100.0).min(100.0);
            (pct, Some(p.saturating_sub(el).as_secs()))
        }
        _ => {
            let total: u64 = clones.iter().map(|(c, _)| c.region.len).sum();
            let pct = ((now[0] + now[1]) as f64 / total.max(1) as f64 * 100.0).min(100.0);
            (pct, None)
        }
    };
    let eta = eta.map_or_else(
        || "--m:--s".to_string(),
        |e| format!("{:02}m:{:02}s", e / 60, e % 60),
    );
    let mut o = std::io::stdout();
    let _ = write!(
        o,
        "\rJobs: {} [{pct:.1}%][r={},w={}][r={},w={} IOPS][eta {eta}]   ",
        clones.len(),
        crate::output::human_bw(rate(0)),
        crate::output::human_bw(rate(1)),
        crate::output::human_count(rate(2)),
        crate::output::human_count(rate(3)),
    );
    let _ = o.flush();
    now
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_size_fits_depth() {
        assert_eq!(auto_queue_size(1), 256);
        assert_eq!(auto_queue_size(85), 256);
        assert_eq!(auto_queue_size(86), 512);
        assert_eq!(auto_queue_size(1024), 4096);
        assert_eq!(auto_queue_size(u32::MAX), 32768);
    }

    #[test]
    fn keys_separate_direct() {
        let mut a =
            JobSpec::from_options("a", &[("target".into(), Some("file:/x".into()))]).unwrap();
        let b = a.clone();
        a.direct = false;
        assert_ne!(device_key(&a), device_key(&b));
    }
}
