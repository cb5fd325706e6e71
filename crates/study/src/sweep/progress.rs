//! The sweep's progress: an indicatif bar on a terminal, one line per cell otherwise.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::host::hms;

/// Counts the runs done and shows them. The bar holds the counts (its length is
/// the runs planned, its position the runs done), drawn or not.
pub(super) struct Progress {
    started: Instant,
    /// Seconds per run before the first one finished.
    estimate_s: f64,
    /// The bar; hidden when stderr is not a terminal.
    bar: ProgressBar,
}

impl Progress {
    /// A bar on stderr if `tty`, otherwise nothing drawn.
    pub(super) fn new(total: usize, estimate_s: f64, tty: bool) -> Self {
        let target = if tty {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total as u64), target);
        let style = ProgressStyle::with_template("[{bar:30}] {pos}/{len} runs  ETA {eta}  {msg}")
            .expect("a valid template")
            .progress_chars("#-");
        bar.set_style(style);
        Progress {
            started: Instant::now(),
            estimate_s,
            bar,
        }
    }

    /// Whether a bar is drawn (then per-cell lines are not printed).
    pub(super) fn is_bar(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Runs done (measured, warm-up or given up).
    pub(super) fn done(&self) -> usize {
        self.bar.position() as usize
    }

    /// Runs planned.
    fn total(&self) -> usize {
        self.bar.length().unwrap_or(0) as usize
    }

    /// Time left, from the mean run time so far (the estimate before the first).
    pub(super) fn eta(&self) -> Duration {
        let done = self.done();
        let left = (self.total() - done) as f64;
        let per = if done > 0 {
            self.started.elapsed().as_secs_f64() / done as f64
        } else {
            self.estimate_s
        };
        Duration::from_secs_f64(left * per)
    }

    /// One more run done; `what` names the cell.
    pub(super) fn tick(&mut self, what: &str) {
        self.bar.set_message(what.to_string());
        self.bar.inc(1);
    }

    /// Prints a message line above the bar.
    pub(super) fn line(&self, msg: &str) {
        self.bar.suspend(|| eprintln!("{msg}"));
    }

    /// The per-cell summary line, printed only when no bar is drawn.
    pub(super) fn cell_done(&self, what: &str, mean_mb_s: f64, runs: usize) {
        if !self.is_bar() {
            self.line(&format!(
                "vqblk sweep: {what}: {mean_mb_s:.1} MB/s ({runs} runs) [{}/{} runs, ETA {}]",
                self.done(),
                self.total(),
                hms(self.eta())
            ));
        }
    }

    /// Removes the bar.
    pub(super) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
