//! Prints the mClock scheduler's simulation (`vqblk_daemon::qos::sim`): a
//! reserved, a flooding and a capped client on a device whose capacity
//! changes, each phase's service per client next to what the model promises.
//!
//! `cargo run --release -p vqblk-daemon --example qos_sim`
//!
//! The unit test `reference_scenario_meets_its_goals` holds the scheduler to
//! the same table; docs/qos.md quotes it.

use vqblk_daemon::qos::sim::{reference_scenario, simulate};

fn main() {
    let (clients, phases) = reference_scenario();
    println!(
        "{:>8} {:>5} {:<9} {:>7} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8}",
        "device",
        "fits",
        "client",
        "reserve",
        "weight",
        "limit",
        "by res",
        "by wt",
        "total",
        "model"
    );
    for r in simulate(&clients, &phases) {
        for (c, s) in clients.iter().zip(&r.served) {
            let p = c.params;
            let limit = if p.limit > 0.0 {
                format!("{:.0}", p.limit)
            } else {
                "-".into()
            };
            println!(
                "{:>8} {:>5} {:<9} {:>7.0} {:>6} {:>6} {:>8.0} {:>8.0} {:>8.0} {:>8.0}",
                r.capacity.iops,
                if r.fits { "yes" } else { "no" },
                c.name,
                p.reservation,
                p.weight,
                limit,
                s.by_reservation,
                s.by_weight,
                s.total(),
                s.expected
            );
        }
    }
}
