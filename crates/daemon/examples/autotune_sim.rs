//! Prints the online IOThread tuning policy against the best static mapping
//! on the scenarios of `vqblk_daemon::autotune::sim`: hosts of 4 to 64
//! cores, VMs whose workloads change phase every minute.
//!
//! `cargo run --release -p vqblk-daemon --example autotune_sim`
//!
//! The unit test `the_policy_reaches_nine_tenths_of_the_best_static_mapping`
//! holds the policy to its goal on the same scenarios; docs/autotune.md
//! quotes this table.

use vqblk_daemon::autotune::sim::{compare, scenarios, Search};

fn main() {
    println!(
        "{:<24} {:>6} {:>7} {:>10} {:>10} {:>6} {:>8} {:>8} {:>6} {:>6} {:>6}  search",
        "scenario",
        "queues",
        "threads",
        "auto IOPS",
        "best IOPS",
        "ratio",
        "auto CPU",
        "best CPU",
        "ratio",
        "moves",
        "/q/10s"
    );
    for s in scenarios() {
        let c = compare(&s);
        println!(
            "{:<24} {:>6} {:>7} {:>10.0} {:>10.0} {:>6.3} {:>8.2} {:>8.2} {:>6.3} {:>6} {:>6.3}  {}",
            c.name,
            c.queues,
            c.best_threads,
            c.auto.iops(c.seconds),
            c.best.iops(c.seconds),
            c.iops_ratio(),
            c.auto.cores(c.seconds),
            c.best.cores(c.seconds),
            c.cpu_ratio(),
            c.auto.moves,
            c.auto.moves as f64 / c.queues as f64 / (c.seconds as f64 / 10.0),
            match c.search {
                Search::Exhaustive => "exhaustive",
                Search::LocalSearch => "LPT + local search",
            }
        );
    }
}
