//! Prints the simulations of `vqblk_daemon::qos::sim`: the mClock scheduler
//! (a reserved, a flooding and a capped client on a device whose capacity
//! changes, each phase's service per client next to what the model
//! promises), then the share allocator the daemon runs (`qos::shares`) on a
//! device whose capacity and clients change.
//!
//! `cargo run --release -p vqblk-daemon --example qos_sim`
//!
//! The unit tests `reference_scenario_meets_its_goals` and
//! `share_scenario_meets_its_goals` hold both to the same tables; docs/qos.md
//! quotes them.

use vqblk_daemon::qos::sim::{reference_scenario, share_scenario, simulate, simulate_shares, Load};

fn main() {
    mclock();
    println!();
    shares();
}

/// The share allocator's table: per phase and client, its load, the mean
/// and the worst tick after the first second, and its cap at the end.
fn shares() {
    let (clients, phases) = share_scenario();
    println!(
        "{:>8} {:>9} {:<9} {:>7} {:>6} {:<12} {:>8} {:>8} {:>8}",
        "device", "estimate", "client", "reserve", "weight", "load", "mean", "worst", "cap"
    );
    for (p, r) in simulate_shares(&clients, &phases, 10).iter().enumerate() {
        for (c, s) in clients.iter().zip(&r.served) {
            let load = match c.load[p.min(c.load.len() - 1)] {
                Load::Idle => "idle".to_string(),
                Load::Flood { qd } => format!("flood qd{qd}"),
                Load::Bound { qd, iops } => format!("qd{qd} <={iops:.0}"),
                Load::Rate { iops } => format!("asks {iops:.0}"),
            };
            let opt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
            println!(
                "{:>8} {:>9} {:<9} {:>7.0} {:>6} {:<12} {:>8.0} {:>8.0} {:>8}",
                r.capacity.iops,
                opt(r.estimate),
                c.name,
                c.share.reservation,
                c.share.weight,
                load,
                s.done,
                s.worst,
                opt(s.cap)
            );
        }
    }
}

/// The mClock scheduler's table.
fn mclock() {
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
