//! One job thread: keeps `iodepth` requests in flight on its engine for one pass and
//! measures them. Knows nothing about other threads except the start [`Gate`] and the
//! [`Counter`] it publishes for the progress line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::cpu::{self, CpuTimes};
use crate::engine::{Done, Engine};
use crate::job::{Dir, DirPicker, OffsetGen, Prng, Region};
use crate::options::JobSpec;
use crate::stats::DirStats;
use crate::verify::{check_block, fill_block, Mismatch};

/// Mismatches kept per job thread for the report (all are counted).
const MAX_MISMATCHES_KEPT: usize = 64;

/// Which pass a job thread is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// The workload as the job describes it.
    Workload,
    /// verify: write every block of the region once, with a checked header.
    VerifyWrite,
    /// verify: read every block back in order and check it.
    VerifyRead,
}

/// Per-thread counters read by the progress line (single writer, plain stores).
#[repr(align(64))]
#[derive(Default)]
pub(super) struct Counter {
    pub(super) read_bytes: AtomicU64,
    pub(super) write_bytes: AtomicU64,
    pub(super) read_ios: AtomicU64,
    pub(super) write_ios: AtomicU64,
}

impl Counter {
    /// (read bytes, write bytes, read I/Os, write I/Os) as last published.
    pub(super) fn load(&self) -> [u64; 4] {
        [
            self.read_bytes.load(Ordering::Relaxed),
            self.write_bytes.load(Ordering::Relaxed),
            self.read_ios.load(Ordering::Relaxed),
            self.write_ios.load(Ordering::Relaxed),
        ]
    }

    fn publish(&self, read: &DirStats, write: &DirStats) {
        self.read_bytes.store(read.io_bytes, Ordering::Relaxed);
        self.write_bytes.store(write.io_bytes, Ordering::Relaxed);
        self.read_ios.store(read.total_ios, Ordering::Relaxed);
        self.write_ios.store(write.total_ios, Ordering::Relaxed);
    }
}

/// Start line of a pass: job threads wait until the main thread opens it, all at once,
/// or calls the pass off (a thread could not be spawned).
#[derive(Default)]
pub(super) struct Gate {
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

    /// Lets every waiting thread go: to run (`go`) or to return at once.
    pub(super) fn open(&self, go: bool) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(go);
        self.cv.notify_all();
    }
}

/// What one job thread measured in one pass (or, absorbed, in all passes).
#[derive(Debug, Default)]
pub(super) struct CloneOutcome {
    pub(super) read: DirStats,
    pub(super) write: DirStats,
    pub(super) read_runtime: Duration,
    pub(super) write_runtime: Duration,
    pub(super) runtime: Duration,
    pub(super) cpu: CpuTimes,
    pub(super) error: Option<String>,
    pub(super) io_errors: u64,
    pub(super) checked: u64,
    pub(super) mismatch_count: u64,
    pub(super) mismatches: Vec<Mismatch>,
}

impl CloneOutcome {
    /// Adds the figures of a later pass of the same thread.
    pub(super) fn absorb(&mut self, o: CloneOutcome) {
        self.read.merge(&o.read);
        self.write.merge(&o.write);
        self.read_runtime += o.read_runtime;
        self.write_runtime += o.write_runtime;
        self.runtime += o.runtime;
        self.cpu = self.cpu + o.cpu;
        if self.error.is_none() {
            self.error = o.error;
        }
        self.io_errors += o.io_errors;
        self.checked += o.checked;
        self.mismatch_count += o.mismatch_count;
        self.mismatches.extend(o.mismatches);
    }

    /// A thread that panicked: one failed request, so the run exits 1.
    pub(super) fn panicked() -> Self {
        CloneOutcome {
            error: Some("job thread panicked".into()),
            io_errors: 1,
            ..Default::default()
        }
    }
}

/// What one job thread is to do in one pass.
pub(super) struct Work<'a> {
    pub(super) spec: &'a JobSpec,
    pub(super) region: Region,
    pub(super) pass: Pass,
    pub(super) seed: u64,
    pub(super) verify_seed: u64,
    pub(super) counter: &'a Counter,
    pub(super) gate: &'a Gate,
}

/// How a pass drives a job: offsets, mix and timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PassParams {
    random: bool,
    read_pct: u32,
    time_based: bool,
    runtime: Option<Duration>,
    ramp: Duration,
}

impl PassParams {
    /// The workload pass follows the job; the verify passes go once over the region
    /// (the write pass in the job's order, the read pass sequentially), untimed.
    fn new(spec: &JobSpec, pass: Pass) -> Self {
        let (random, read_pct, time_based, runtime, ramp) = match pass {
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
        Self {
            random,
            read_pct,
            time_based,
            runtime,
            ramp,
        }
    }
}

/// One request in flight.
#[derive(Debug, Clone, Copy)]
struct SlotState {
    offset: u64,
    dir: Dir,
    issued: Instant,
    submitted: Instant,
    counted: bool,
}

/// When the pass measures and when it ends.
struct Clock {
    ramp_end: Instant,
    measuring: bool,
    measure_start: Instant,
    end: Option<Instant>,
    last_completion: Instant,
    cpu0: CpuTimes,
}

impl Clock {
    fn start(p: &PassParams) -> Self {
        let start = Instant::now();
        let measuring = p.ramp.is_zero();
        Self {
            ramp_end: start + p.ramp,
            measuring,
            measure_start: start,
            end: if measuring {
                p.runtime.map(|r| start + r)
            } else {
                None
            },
            last_completion: start,
            cpu0: cpu::thread_times(),
        }
    }

    /// Ends the ramp at `now`: measuring starts, and the run time counts from here.
    fn end_ramp(&mut self, now: Instant, runtime: Option<Duration>) {
        self.measuring = true;
        self.measure_start = now;
        self.last_completion = now;
        self.cpu0 = cpu::thread_times();
        self.end = runtime.map(|r| now + r);
    }
}

fn errno_text(result: i32) -> String {
    std::io::Error::from_raw_os_error(-result).to_string()
}

/// The loop of one job thread: keep `iodepth` requests in flight until the pass or the
/// run time is over, then drain.
pub(super) fn run_clone(engine: &mut dyn Engine, w: &Work) -> CloneOutcome {
    let mut worker = Worker::new(engine, w);
    if !w.gate.wait() {
        return worker.out;
    }
    let mut clock = Clock::start(&worker.params);
    loop {
        if worker.issuing && worker.inflight < worker.depth && !worker.issue(clock.measuring) {
            break;
        }
        if worker.inflight == 0 {
            break;
        }
        let Some(now) = worker.reap() else { break };
        if worker.complete_all(now) {
            clock.last_completion = now;
        }
        w.counter.publish(&worker.out.read, &worker.out.write);
        if !clock.measuring && now >= clock.ramp_end {
            clock.end_ramp(now, worker.params.runtime);
            if !worker.params.time_based {
                // The ramp wrapped freely; the measured pass starts from the top.
                worker.gen.reset();
            }
        }
        if clock.end.is_some_and(|e| now >= e) {
            worker.issuing = false;
        }
    }
    worker.finish(&clock)
}

/// The state of one job thread's loop.
struct Worker<'a, 'w> {
    engine: &'a mut dyn Engine,
    w: &'a Work<'w>,
    params: PassParams,
    bs: usize,
    depth: usize,
    gen: OffsetGen,
    picker: DirPicker,
    /// Verify read pass: room to rebuild the expected block.
    scratch: Vec<u8>,
    slots: Vec<SlotState>,
    free: Vec<usize>,
    /// Slots queued since the last commit.
    newly: Vec<usize>,
    done: Vec<Done>,
    issuing: bool,
    inflight: usize,
    out: CloneOutcome,
}

impl<'a, 'w> Worker<'a, 'w> {
    fn new(engine: &'a mut dyn Engine, w: &'a Work<'w>) -> Self {
        let params = PassParams::new(w.spec, w.pass);
        let bs = w.spec.bs as usize;
        let depth = w.spec.iodepth as usize;
        if w.pass == Pass::Workload && params.read_pct < 100 {
            // Like fio: write buffers hold random data, filled once.
            let mut p = Prng::new(w.seed);
            for s in 0..depth {
                for c in engine.buffer(s).chunks_exact_mut(8) {
                    c.copy_from_slice(&p.next_u64().to_le_bytes());
                }
            }
        }
        let t0 = Instant::now();
        let idle = SlotState {
            offset: 0,
            dir: Dir::Read,
            issued: t0,
            submitted: t0,
            counted: false,
        };
        Self {
            engine,
            w,
            params,
            bs,
            depth,
            gen: OffsetGen::new(w.region, params.random, w.seed),
            picker: DirPicker::new(params.read_pct, w.seed),
            scratch: if w.pass == Pass::VerifyRead {
                vec![0u8; bs]
            } else {
                Vec::new()
            },
            slots: vec![idle; depth],
            free: (0..depth).rev().collect(),
            newly: Vec::with_capacity(depth),
            done: Vec::with_capacity(depth),
            issuing: true,
            inflight: 0,
            out: CloneOutcome::default(),
        }
    }

    /// The next offset; past the end of the region the generator starts over while
    /// the pass is time based or still ramping. None when the pass has issued all.
    fn next_offset(&mut self, measuring: bool) -> Option<u64> {
        match self.gen.next_offset() {
            Some(o) => Some(o),
            None if self.params.time_based || !measuring => {
                self.gen.reset();
                self.gen.next_offset()
            }
            None => None,
        }
    }

    /// Fills the queue up to `iodepth`, submitting every `iodepth_batch_submit`
    /// requests (fio's default, 1, submits each as soon as it is queued: a
    /// server sees the first request while the rest are still being queued).
    /// False when a submission failed (every request in flight is then counted
    /// as failed and the loop ends).
    fn issue(&mut self, measuring: bool) -> bool {
        let batch = self.w.spec.submit_batch() as usize;
        let t = Instant::now();
        while self.inflight < self.depth {
            let Some(off) = self.next_offset(measuring) else {
                self.issuing = false;
                break;
            };
            let dir = self.picker.next_dir();
            let Some(slot) = self.free.pop() else { break };
            if self.w.pass == Pass::VerifyWrite {
                fill_block(self.engine.buffer(slot), off, self.w.verify_seed);
            }
            if let Err(e) = self.engine.queue(slot, dir, off) {
                self.free.push(slot);
                self.out.error.get_or_insert(e.to_string());
                self.issuing = false;
                break;
            }
            self.slots[slot] = SlotState {
                offset: off,
                dir,
                issued: t,
                submitted: t,
                counted: measuring,
            };
            self.newly.push(slot);
            self.inflight += 1;
            if self.newly.len() >= batch && !self.submit() {
                return false;
            }
        }
        self.submit()
    }

    /// Submits the requests queued since the last submission, if any.
    fn submit(&mut self) -> bool {
        if self.newly.is_empty() {
            return true;
        }
        if let Err(e) = self.engine.commit() {
            self.out.error.get_or_insert(e.to_string());
            self.out.io_errors += self.inflight as u64;
            return false;
        }
        let ts = Instant::now();
        for &s in &self.newly {
            self.slots[s].submitted = ts;
        }
        self.newly.clear();
        true
    }

    /// Waits for at least one completion. None when the engine failed (every request
    /// in flight is then counted as failed and the loop ends).
    fn reap(&mut self) -> Option<Instant> {
        self.done.clear();
        if let Err(e) = self.engine.reap(1, &mut self.done) {
            self.out.error.get_or_insert(e.to_string());
            self.out.io_errors += self.inflight as u64;
            return None;
        }
        Some(Instant::now())
    }

    /// Accounts every reaped request; true if a measured one completed.
    fn complete_all(&mut self, now: Instant) -> bool {
        let mut measured = false;
        for i in 0..self.done.len() {
            let d = self.done[i];
            measured |= self.complete(d, now);
        }
        measured
    }

    /// Accounts one completion: error, verify check, latencies. True if it was measured.
    fn complete(&mut self, d: Done, now: Instant) -> bool {
        let st = self.slots[d.slot];
        self.inflight -= 1;
        self.free.push(d.slot);
        if d.result != 0 {
            self.out.io_errors += 1;
            let bs = self.bs;
            self.out.error.get_or_insert_with(|| {
                format!(
                    "{} of {bs} bytes at offset {} failed: {}",
                    if st.dir == Dir::Read { "read" } else { "write" },
                    st.offset,
                    errno_text(d.result)
                )
            });
            self.issuing = false;
            return false;
        }
        if self.w.pass == Pass::VerifyRead {
            self.verify(d.slot, st.offset);
        }
        if !st.counted {
            return false;
        }
        let slat = st.submitted.duration_since(st.issued).as_nanos() as u64;
        let clat = now.duration_since(st.submitted).as_nanos() as u64;
        match st.dir {
            Dir::Read => self.out.read.record(self.bs as u64, slat, clat),
            Dir::Write => self.out.write.record(self.bs as u64, slat, clat),
        }
        true
    }

    /// Checks the block just read into `slot` against what the write pass wrote.
    fn verify(&mut self, slot: usize, offset: u64) {
        self.out.checked += 1;
        let buf = self.engine.buffer(slot);
        if let Some(m) = check_block(buf, offset, self.w.verify_seed, &mut self.scratch) {
            self.out.mismatch_count += 1;
            if self.out.mismatches.len() < MAX_MISMATCHES_KEPT {
                self.out.mismatches.push(m);
            }
        }
    }

    /// The outcome, with the thread's CPU time and the measured time.
    fn finish(mut self, clock: &Clock) -> CloneOutcome {
        let out = &mut self.out;
        out.cpu = cpu::thread_times().since(&clock.cpu0);
        out.runtime = clock
            .last_completion
            .saturating_duration_since(clock.measure_start);
        if out.read.total_ios > 0 {
            out.read_runtime = out.runtime;
        }
        if out.write.total_ios > 0 {
            out.write_runtime = out.runtime;
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineError;

    fn spec(opts: &[(&str, &str)]) -> JobSpec {
        let mut o: Vec<_> = vec![("target".to_string(), Some("file:/x".to_string()))];
        o.extend(
            opts.iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string()))),
        );
        JobSpec::from_options("t", &o).unwrap()
    }

    #[test]
    fn verify_passes_ignore_the_jobs_timing() {
        let s = spec(&[("rw", "randwrite"), ("verify", "crc32c")]);
        let w = PassParams::new(&s, Pass::VerifyWrite);
        assert!(w.random && w.read_pct == 0 && !w.time_based && w.runtime.is_none());
        let r = PassParams::new(&s, Pass::VerifyRead);
        assert!(!r.random && r.read_pct == 100 && !r.time_based && r.ramp.is_zero());
    }

    #[test]
    fn workload_pass_follows_the_job() {
        let s = spec(&[
            ("rw", "randrw"),
            ("rwmixread", "70"),
            ("time_based", "1"),
            ("runtime", "2s"),
            ("ramp_time", "1s"),
        ]);
        let p = PassParams::new(&s, Pass::Workload);
        assert_eq!(
            p,
            PassParams {
                random: true,
                read_pct: 70,
                time_based: true,
                runtime: Some(Duration::from_secs(2)),
                ramp: Duration::from_secs(1),
            }
        );
    }

    #[test]
    fn outcomes_add_up_and_keep_the_first_error() {
        let mut a = CloneOutcome {
            io_errors: 1,
            error: Some("first".into()),
            checked: 2,
            ..Default::default()
        };
        a.read.record(4096, 10, 20);
        let mut b = CloneOutcome::panicked();
        b.read.record(4096, 10, 20);
        b.runtime = Duration::from_millis(5);
        a.absorb(b);
        assert_eq!(a.error.as_deref(), Some("first"));
        assert_eq!((a.io_errors, a.checked, a.read.total_ios), (2, 2, 2));
        assert_eq!(a.runtime, Duration::from_millis(5));
    }

    /// An engine that completes everything at once and records how many
    /// requests each submission carried.
    struct Recorder {
        buf: Vec<u8>,
        queued: Vec<usize>,
        submissions: Vec<usize>,
        in_device: Vec<usize>,
    }

    impl Engine for Recorder {
        fn buffer(&mut self, _slot: usize) -> &mut [u8] {
            &mut self.buf
        }
        fn queue(&mut self, slot: usize, _dir: Dir, _offset: u64) -> Result<(), EngineError> {
            self.queued.push(slot);
            Ok(())
        }
        fn commit(&mut self) -> Result<(), EngineError> {
            self.submissions.push(self.queued.len());
            self.in_device.append(&mut self.queued);
            Ok(())
        }
        fn reap(&mut self, _min: usize, out: &mut Vec<Done>) -> Result<(), EngineError> {
            out.extend(
                self.in_device
                    .drain(..)
                    .map(|slot| Done { slot, result: 0 }),
            );
            Ok(())
        }
    }

    /// The submissions of one untimed pass over 64 blocks.
    fn submissions(opts: &[(&str, &str)]) -> Vec<usize> {
        let s = spec(opts);
        let mut e = Recorder {
            buf: vec![0; 4096],
            queued: Vec::new(),
            submissions: Vec::new(),
            in_device: Vec::new(),
        };
        let (counter, gate) = (Counter::default(), Gate::default());
        gate.open(true);
        let w = Work {
            spec: &s,
            region: Region {
                start: 0,
                len: 64 * 4096,
                bs: 4096,
            },
            pass: Pass::Workload,
            seed: 1,
            verify_seed: 1,
            counter: &counter,
            gate: &gate,
        };
        let out = run_clone(&mut e, &w);
        assert_eq!((out.read.total_ios, out.io_errors), (64, 0));
        e.submissions
    }

    #[test]
    fn each_request_is_submitted_as_soon_as_it_is_queued_by_default() {
        // fio's iodepth_batch_submit=1: a server sees the first request of a
        // refill while the client still queues the others.
        let one = submissions(&[("iodepth", "16")]);
        assert_eq!(one, vec![1; 64]);
        let whole = submissions(&[("iodepth", "16"), ("iodepth_batch_submit", "0")]);
        assert_eq!(whole, vec![16; 4]);
        let four = submissions(&[("iodepth", "16"), ("iodepth_batch", "4")]);
        assert_eq!(four, vec![4; 16]);
        // Never more than iodepth at once.
        let capped = submissions(&[("iodepth", "8"), ("iodepth_batch_submit", "32")]);
        assert_eq!(capped, vec![8; 8]);
    }

    #[test]
    fn counter_publishes_what_load_reads() {
        let c = Counter::default();
        let mut r = DirStats::new();
        r.record(512, 1, 1);
        c.publish(&r, &DirStats::new());
        assert_eq!(c.load(), [512, 0, 1, 0]);
    }
}
