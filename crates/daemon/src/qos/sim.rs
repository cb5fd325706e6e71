//! Simulation of [`MClock`] on a device whose capacity changes over time.
//!
//! The device serves one request every `1 / iops` seconds of the current
//! [`Capacity`] phase; at each slot the scheduler picks a request (or none, when
//! every backlogged client is at its limit: the slot is lost, a limit is not
//! work-conserving). Every client is kept backlogged, the hardest case for a
//! floor: a flooding client always has requests waiting. Each phase is
//! measured after its first tenth (the transition) and compared with the
//! allocation the model promises ([`expected`]).
//!
//! `cargo run --release -p vqblk-daemon --example qos_sim` prints the table of
//! [`reference_scenario`]; the unit tests hold the scheduler to it.

use super::mclock::{ClientParams, Dispatch, MClock, Phase};

/// A client of the simulated device.
#[derive(Debug, Clone)]
pub struct SimClient {
    /// Its name in the table.
    pub name: &'static str,
    /// Reservation, weight, limit.
    pub params: ClientParams,
}

/// A stretch of time at one device capacity.
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    /// Length of the phase, seconds.
    pub secs: u64,
    /// Requests per second the device completes.
    pub iops: u64,
}

/// One client's service in one phase (per second, over the measured part).
#[derive(Debug, Clone, Copy, Default)]
pub struct Served {
    /// Requests served by reservation, per second.
    pub by_reservation: f64,
    /// Requests served by weight, per second.
    pub by_weight: f64,
    /// What [`expected`] promises, per second.
    pub expected: f64,
}

impl Served {
    /// Requests served per second.
    pub fn total(&self) -> f64 {
        self.by_reservation + self.by_weight
    }
}

/// The outcome of one phase.
#[derive(Debug, Clone)]
pub struct PhaseResult {
    /// The phase.
    pub capacity: Capacity,
    /// Whether the reservations fit the capacity.
    pub fits: bool,
    /// Per client, in the order given.
    pub served: Vec<Served>,
}

/// Runs `clients` through `phases` (requests of cost 1).
pub fn simulate(clients: &[SimClient], phases: &[Capacity]) -> Vec<PhaseResult> {
    let mut s = MClock::new();
    for c in clients {
        s.add_client(c.params);
    }
    let mut now = 0u64;
    let mut results = Vec::new();
    for &phase in phases {
        let step = 1_000_000_000 / phase.iops;
        let slots = phase.iops * phase.secs;
        let warmup = slots / 10;
        let mut counts = vec![(0u64, 0u64); clients.len()];
        for k in 0..slots {
            for c in 0..clients.len() {
                while s.backlog(c) < 8 {
                    s.enqueue(c, 1.0, now);
                }
            }
            if let Dispatch::Serve { client, phase, .. } = s.dequeue(now) {
                if k >= warmup {
                    match phase {
                        Phase::Reservation => counts[client].0 += 1,
                        Phase::Weight => counts[client].1 += 1,
                    }
                }
            }
            now += step;
        }
        let measured = (slots - warmup) as f64 / phase.iops as f64;
        let (promised, fits) = expected(clients, phase.iops as f64);
        results.push(PhaseResult {
            capacity: phase,
            fits,
            served: counts
                .iter()
                .zip(promised)
                .map(|(&(r, w), expected)| Served {
                    by_reservation: r as f64 / measured,
                    by_weight: w as f64 / measured,
                    expected,
                })
                .collect(),
        });
    }
    results
}

/// What each backlogged client gets from a device of `iops`, and whether the
/// reservations fit. When they fit: its reservation, plus its weight's share
/// of the rest, the share of a client that reaches its limit going to the
/// others (water-filling). When they do not: the capacity in proportion to the
/// reservations, since every reservation tag is then due and the smallest
/// goes first.
pub fn expected(clients: &[SimClient], iops: f64) -> (Vec<f64>, bool) {
    let reserved: f64 = clients.iter().map(|c| c.params.reservation).sum();
    if reserved > iops {
        let got = clients
            .iter()
            .map(|c| iops * c.params.reservation / reserved)
            .collect();
        return (got, false);
    }
    let mut got: Vec<f64> = clients.iter().map(|c| c.params.reservation).collect();
    let mut open: Vec<usize> = (0..clients.len()).collect();
    let mut rest = iops - reserved;
    loop {
        let weights: f64 = open.iter().map(|&i| clients[i].params.weight as f64).sum();
        let capped: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| {
                let p = clients[i].params;
                p.limit > 0.0 && got[i] + rest * p.weight as f64 / weights > p.limit
            })
            .collect();
        if capped.is_empty() {
            for &i in &open {
                got[i] += rest * clients[i].params.weight as f64 / weights;
            }
            return (got, true);
        }
        for i in capped {
            rest -= clients[i].params.limit - got[i];
            got[i] = clients[i].params.limit;
            open.retain(|&j| j != i);
        }
    }
}

/// The reference scenario: a reserved client (3000 IOPS, weight 1), a
/// flooding one (weight 3) and a capped one (weight 1, limit 1500), on a device
/// doing 10K, then 4K, then 20K, then 2K (reservations no longer fit), then
/// 10K IOPS again.
pub fn reference_scenario() -> (Vec<SimClient>, Vec<Capacity>) {
    let clients = vec![
        SimClient {
            name: "reserved",
            params: ClientParams {
                reservation: 3000.0,
                weight: 1,
                limit: 0.0,
            },
        },
        SimClient {
            name: "flood",
            params: ClientParams {
                reservation: 0.0,
                weight: 3,
                limit: 0.0,
            },
        },
        SimClient {
            name: "capped",
            params: ClientParams {
                reservation: 0.0,
                weight: 1,
                limit: 1500.0,
            },
        },
    ];
    let phases = [10_000, 4_000, 20_000, 2_000, 10_000]
        .map(|iops| Capacity { secs: 3, iops })
        .to_vec();
    (clients, phases)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The goals: the floor whenever the reservations fit, the rest split by
    /// weight within 10%, no client above its limit, each within 5% of the
    /// model.
    #[test]
    fn reference_scenario_meets_its_goals() {
        let (clients, phases) = reference_scenario();
        let results = simulate(&clients, &phases);
        for r in &results {
            let at = format!("at {} IOPS: {:?}", r.capacity.iops, r.served);
            let [reserved, flood, capped] = [r.served[0], r.served[1], r.served[2]];
            if r.fits {
                assert!(reserved.total() >= 0.99 * 3000.0, "floor {at}");
                let ratio = flood.by_weight / reserved.by_weight;
                assert!((ratio - 3.0).abs() <= 0.3, "3:1 split {ratio:.2} {at}");
            }
            assert!(capped.total() <= 1500.0 * 1.001, "limit {at}");
            for s in &r.served {
                assert!(
                    (s.total() - s.expected).abs() <= 0.05 * s.expected.max(100.0),
                    "model {at}"
                );
            }
            // The device is never left idle while someone may go.
            let total: f64 = r.served.iter().map(Served::total).sum();
            assert!(total >= 0.99 * r.capacity.iops as f64, "idle slots {at}");
        }
        assert!(results.iter().any(|r| !r.fits), "a shortage is simulated");
    }

    #[test]
    fn water_filling() {
        let (clients, _) = reference_scenario();
        let (got, fits) = expected(&clients, 20_000.0);
        assert!(fits);
        assert_eq!(got, vec![6875.0, 11625.0, 1500.0]);
        let (got, fits) = expected(&clients, 1_500.0);
        assert!(!fits);
        assert_eq!(got, vec![1500.0, 0.0, 0.0]);
    }
}
