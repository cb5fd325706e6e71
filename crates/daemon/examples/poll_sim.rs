//! Prints the polling modes side by side on the reference traces of
//! `vqblk_daemon::poll::sim`: hits, sleeps, polling CPU, CPU wasted on windows that
//! expired in vain, and the IOPS lost against busy polling (queue depth 1).
//!
//! `cargo run --release -p vqblk-daemon --example poll_sim`
//!
//! The unit test `simulation_comparison` holds the adaptive mode to its goals on
//! the same traces; docs/polling.md quotes this table.

use vqblk_daemon::poll::sim::{compare, traces};

fn main() {
    println!(
        "{:<27} {:<9} {:>6} {:>6} {:>8} {:>9} {:>8}",
        "trace (events)", "mode", "hits%", "sleeps", "CPU ms", "waste ms", "IOPS -%"
    );
    for trace in traces() {
        let comparison = compare(&trace.intervals);
        for (mode, r) in comparison.rows() {
            println!(
                "{:<27} {:<9} {:>6.1} {:>6} {:>8.1} {:>9.1} {:>8.2}",
                trace.name,
                mode,
                r.hit_pct(trace.intervals.len()),
                r.sleeps,
                r.poll_cpu_ns as f64 / 1e6,
                r.wasted_cpu_ns as f64 / 1e6,
                r.iops_loss_pct(&trace.intervals)
            );
        }
    }
}
