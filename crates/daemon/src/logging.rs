//! The daemon's log output, bounded: a hostile frontend or guest that makes some code
//! path log on every request (ours or a dependency's, such as `virtio_queue` or
//! `vhost`) must not fill the disk or starve the IOThread that writes the lines.
//!
//! Every target (module path) may write [`BURST`] lines per second; beyond that lines are
//! counted, not written, and the next line the target may write says how many were
//! suppressed. The limiter is a pure state machine ([`RateLimit`]) fed with times, so it
//! is tested without a clock.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines per target per [`WINDOW`].
pub const BURST: u32 = 20;
/// The window [`BURST`] counts over.
pub const WINDOW: Duration = Duration::from_secs(1);
/// Targets tracked at once; beyond this the oldest windows are forgotten (bounds memory).
const MAX_TARGETS: usize = 256;

/// What to do with one log line.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write it; `suppressed` lines of this target were dropped before it.
    Write {
        /// Lines dropped since the last one written.
        suppressed: u64,
    },
    /// Drop it (and count it).
    Drop,
}

/// Per-target token windows.
#[derive(Debug, Default)]
pub struct RateLimit {
    targets: HashMap<String, Window>,
}

#[derive(Debug)]
struct Window {
    start: Instant,
    written: u32,
    suppressed: u64,
}

impl RateLimit {
    /// Decides about a line of `target` logged at `now`.
    pub fn check(&mut self, target: &str, now: Instant) -> Verdict {
        // Look up by &str first: a String is allocated only for a new target,
        // not for every line of a flood.
        if !self.targets.contains_key(target) {
            if self.targets.len() >= MAX_TARGETS {
                self.targets
                    .retain(|_, w| now.saturating_duration_since(w.start) < WINDOW);
            }
            self.targets.insert(
                target.to_string(),
                Window {
                    start: now,
                    written: 0,
                    suppressed: 0,
                },
            );
        }
        let Some(w) = self.targets.get_mut(target) else {
            return Verdict::Drop;
        };
        if now.saturating_duration_since(w.start) >= WINDOW {
            w.start = now;
            w.written = 0;
        }
        if w.written >= BURST {
            w.suppressed += 1;
            return Verdict::Drop;
        }
        w.written += 1;
        Verdict::Write {
            suppressed: std::mem::take(&mut w.suppressed),
        }
    }
}

struct Limited {
    inner: env_logger::Logger,
    limit: Mutex<RateLimit>,
}

impl log::Log for Limited {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &log::Record) {
        if !self.inner.enabled(record.metadata()) {
            return;
        }
        let verdict = match self.limit.lock() {
            Ok(mut l) => l.check(record.target(), Instant::now()),
            Err(_) => Verdict::Write { suppressed: 0 },
        };
        match verdict {
            Verdict::Drop => {}
            Verdict::Write { suppressed: 0 } => self.inner.log(record),
            Verdict::Write { suppressed } => {
                let note = format!(
                    "{suppressed} earlier lines of {} suppressed (more than {BURST} a second)",
                    record.target()
                );
                self.inner.log(
                    &log::Record::builder()
                        .args(format_args!("{note}"))
                        .level(log::Level::Warn)
                        .target(record.target())
                        .build(),
                );
                self.inner.log(record);
            }
        }
    }

    fn flush(&self) {
        self.inner.flush()
    }
}

/// Sets up logging to stderr at `level` (`error`, `warn`, `info`, `debug`, `trace`),
/// one `key=value` line per record, rate-limited per target. A second call is a no-op.
pub fn init_logging(level: &str) -> Result<(), String> {
    let filter: log::LevelFilter = level.parse().map_err(|_| {
        format!("--log-level: {level:?} is not one of error, warn, info, debug, trace")
    })?;
    let inner = env_logger::Builder::new()
        .filter_level(filter)
        .format(|buf, r| {
            let t = std::thread::current();
            writeln!(
                buf,
                "{} level={} thread={} target={} msg={:?}",
                buf.timestamp_millis(),
                r.level(),
                t.name().unwrap_or("?"),
                r.target(),
                r.args().to_string()
            )
        })
        .build();
    let logger = Limited {
        inner,
        limit: Mutex::new(RateLimit::default()),
    };
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(filter);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_cut_to_the_burst_and_the_drop_count_is_reported() {
        let mut l = RateLimit::default();
        let t0 = Instant::now();
        let mut written = 0;
        for i in 0..10_000u32 {
            let now = t0 + Duration::from_micros(u64::from(i) * 10); // 100 ms in all
            if let Verdict::Write { suppressed } = l.check("virtio_queue::queue", now) {
                assert_eq!(suppressed, 0);
                written += 1;
            }
        }
        assert_eq!(written, BURST);
        // The next window writes again and says how many were dropped.
        let later = t0 + WINDOW + Duration::from_millis(1);
        assert_eq!(
            l.check("virtio_queue::queue", later),
            Verdict::Write {
                suppressed: 10_000 - u64::from(BURST)
            }
        );
        assert_eq!(
            l.check("virtio_queue::queue", later),
            Verdict::Write { suppressed: 0 }
        );
    }

    #[test]
    fn targets_have_their_own_budget() {
        let mut l = RateLimit::default();
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert!(matches!(l.check("a", t0), Verdict::Write { .. }));
        }
        assert_eq!(l.check("a", t0), Verdict::Drop);
        assert!(matches!(l.check("b", t0), Verdict::Write { .. }));
    }

    #[test]
    fn the_number_of_targets_tracked_is_bounded() {
        let mut l = RateLimit::default();
        let t0 = Instant::now();
        for i in 0..MAX_TARGETS {
            l.check(&format!("t{i}"), t0);
        }
        l.check("one-more", t0 + WINDOW * 2);
        assert!(l.targets.len() <= MAX_TARGETS);
    }
}
