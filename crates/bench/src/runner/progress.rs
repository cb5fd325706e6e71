//! fio's status line while a pass runs
//! (`Jobs: 2 [40.0%][r=196MiB/s,w=0B/s][r=50.1k,w=0 IOPS][eta 00m:03s]`), drawn by
//! `indicatif` on stdout once a second and cleared when the pass ends.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

use super::setup::JobClone;
use super::worker::{Counter, Pass};
use super::Plan;
use crate::units::{human_bw, human_count};

/// The status line of one pass.
pub(super) struct Progress {
    bar: ProgressBar,
    /// The bar counts milliseconds of a timed pass, else bytes of the regions.
    timed: bool,
    /// Totals at the last update: read bytes, write bytes, read I/Os, write I/Os.
    last: [u64; 4],
    last_at: Instant,
}

/// The planned time of a timed workload pass (the longest job, ramp included); None
/// when the pass ends with its regions rather than with the clock.
fn planned_time(plan: &Plan, pass: Pass) -> Option<Duration> {
    if pass != Pass::Workload {
        return None;
    }
    plan.jobs
        .iter()
        .map(|j| j.runtime.map(|r| r + j.ramp_time))
        .collect::<Option<Vec<_>>>()
        .and_then(|v| v.into_iter().max())
}

/// fio's ETA: `02m:05s`, or `--m:--s` when unknown.
fn fio_eta(secs: Option<u64>) -> String {
    secs.map_or_else(
        || "--m:--s".to_string(),
        |e| format!("{:02}m:{:02}s", e / 60, e % 60),
    )
}

/// Rates over the last interval: `r=…,w=…][r=…,w=… IOPS`.
fn rates_text(now: [u64; 4], last: [u64; 4], interval: Duration) -> String {
    let secs = interval.as_secs_f64().max(1e-3);
    let rate = |i: usize| now[i].saturating_sub(last[i]) as f64 / secs;
    format!(
        "r={},w={}][r={},w={} IOPS",
        human_bw(rate(0)),
        human_bw(rate(1)),
        human_count(rate(2)),
        human_count(rate(3)),
    )
}

impl Progress {
    /// The status line for a pass of `clones`, drawn on stdout.
    pub(super) fn new(plan: &Plan, clones: &[JobClone], pass: Pass) -> Self {
        let planned = planned_time(plan, pass);
        let timed = planned.is_some();
        let len = match planned {
            Some(p) => p.as_millis() as u64,
            None => clones.iter().map(|c| c.region.len).sum::<u64>().max(1),
        };
        let style =
            ProgressStyle::with_template("Jobs: {prefix} [{fio_percent}][{msg}][eta {fio_eta}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .with_key(
                    "fio_percent",
                    |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                        let _ = write!(w, "{:.1}%", s.fraction() * 100.0);
                    },
                )
                .with_key(
                    "fio_eta",
                    move |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                        // A timed pass knows its end; otherwise indicatif estimates from the rate.
                        let left = match (timed, s.len()) {
                            (true, Some(len)) => Some(len.saturating_sub(s.pos()) / 1000),
                            _ if s.pos() > 0 => Some(s.eta().as_secs()),
                            _ => None,
                        };
                        let _ = w.write_str(&fio_eta(left));
                    },
                );
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stdout())
            .with_style(style)
            .with_prefix(clones.len().to_string());
        Self {
            bar,
            timed,
            last: [0; 4],
            last_at: Instant::now(),
        }
    }

    /// Redraws the line if a second has passed since the last update. `elapsed` is the
    /// time since the pass started.
    pub(super) fn update(&mut self, counters: &[Counter], elapsed: Duration) {
        let interval = self.last_at.elapsed();
        if interval < Duration::from_secs(1) {
            return;
        }
        self.last_at = Instant::now();
        let mut now = [0u64; 4];
        for c in counters {
            for (t, v) in now.iter_mut().zip(c.load()) {
                *t += v;
            }
        }
        self.bar.set_message(rates_text(now, self.last, interval));
        self.bar.set_position(if self.timed {
            elapsed.as_millis() as u64
        } else {
            now[0] + now[1]
        });
        self.last = now;
    }

    /// Clears the line.
    pub(super) fn finish(self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_reads_like_fio() {
        assert_eq!(fio_eta(Some(125)), "02m:05s");
        assert_eq!(fio_eta(Some(0)), "00m:00s");
        assert_eq!(fio_eta(None), "--m:--s");
    }

    #[test]
    fn rates_are_per_second_over_the_interval() {
        let t = rates_text(
            [4 << 20, 0, 2048, 0],
            [2 << 20, 0, 1024, 0],
            Duration::from_secs(2),
        );
        assert_eq!(t, "r=1024KiB/s,w=0B/s][r=512,w=0 IOPS");
    }

    #[test]
    fn only_a_timed_workload_pass_has_a_planned_time() {
        let spec = |rt: &str| {
            crate::options::JobSpec::from_options(
                "p",
                &[
                    ("target".into(), Some("file:/x".into())),
                    ("runtime".into(), Some(rt.into())),
                    ("ramp_time".into(), Some("1s".into())),
                ],
            )
            .unwrap()
        };
        let plan = Plan {
            jobs: vec![spec("2s"), spec("3s")],
            output_format: crate::options::OutputFormat::Normal,
            server_pid: None,
            server_stats: None,
            verify_pause_file: None,
            connect_timeout: Duration::from_secs(1),
            progress: true,
        };
        assert_eq!(
            planned_time(&plan, Pass::Workload),
            Some(Duration::from_secs(4))
        );
        assert_eq!(planned_time(&plan, Pass::VerifyRead), None);
        let mut untimed = plan.clone();
        untimed.jobs[1].runtime = None;
        assert_eq!(planned_time(&untimed, Pass::Workload), None);
    }
}
