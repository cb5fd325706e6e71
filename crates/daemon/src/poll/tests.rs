//! Unit tests of the polling policy, one file per algorithm under `tests/`; they
//! pin every rule iteration by iteration through the public [`PollPolicy`] API.

use super::sim::Rng;
use super::*;

mod adaptive;
mod classic;
mod nap;
mod policy;
mod sim;
mod trial;

fn params(max: u64, grow: u64, shrink: u64, weight: u32) -> PollParams {
    PollParams {
        poll_max_ns: max,
        poll_grow: grow,
        poll_shrink: shrink,
        poll_weight: weight,
    }
}

fn classic(max: u64, grow: u64, shrink: u64) -> PollPolicy {
    PollPolicy::new(PollMode::Classic, params(max, grow, shrink, 0), 1)
}

fn weighted(weight: u32, shrink: u64) -> PollPolicy {
    PollPolicy::new(PollMode::Weighted, params(32_768, 0, shrink, weight), 1)
}

fn adaptive() -> PollPolicy {
    PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1)
}

/// A policy of each kind that never naps: every mode but adaptive, and
/// adaptive with `poll-max-ns=0`; one source.
fn never_napping() -> Vec<PollPolicy> {
    let no_polling = PollParams {
        poll_max_ns: 0,
        ..PollParams::default()
    };
    [
        PollMode::Classic,
        PollMode::Weighted,
        PollMode::Busy,
        PollMode::Off,
    ]
    .into_iter()
    .map(|mode| PollPolicy::new(mode, PollParams::default(), 1))
    .chain([PollPolicy::new(PollMode::Adaptive, no_polling, 1)])
    .collect()
}
