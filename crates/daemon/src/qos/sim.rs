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
//!
//! [`simulate_shares`] runs the share allocator ([`super::shares`]) the same
//! way, over a fluid model of a device that serves its clients in proportion
//! to their queue depths, and [`share_scenario`] is its table.

use super::mclock::{ClientParams, Dispatch, MClock, Phase};
use super::shares::{water_fill, Interval, Share, ShareAllocator, ShareInput, TICK_NS};

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

/// How a client of [`simulate_shares`] loads the device in a phase.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// No I/O.
    Idle,
    /// A closed loop at queue depth `qd`, as fast as the device lets it: it
    /// always has requests in flight, and the device serves the clients it
    /// is shared by in proportion to their queue depths.
    Flood {
        /// Requests it keeps in flight.
        qd: u32,
    },
    /// A closed loop that cannot go faster than `iops` by itself (a queue
    /// depth 1 guest behind the device's latency): always in flight.
    Bound {
        /// Requests it keeps in flight.
        qd: u32,
        /// The most it can do.
        iops: f64,
    },
    /// An open loop asking `iops`: busy only when it gets less.
    Rate {
        /// What it asks.
        iops: f64,
    },
}

/// A client of [`simulate_shares`]: its share settings and its load in each
/// phase.
#[derive(Debug, Clone)]
pub struct ShareClient {
    /// Its name in the table.
    pub name: &'static str,
    /// Reservation, weight, static limit.
    pub share: Share,
    /// Its load in each phase (the last one repeats).
    pub load: Vec<Load>,
}

/// One client's rate in one phase of [`simulate_shares`].
#[derive(Debug, Clone, Copy)]
pub struct ShareServed {
    /// Operations per second it got (mean over the measured ticks).
    pub done: f64,
    /// Its cap at the end of the phase (None: uncapped).
    pub cap: Option<f64>,
    /// The least it got in one measured tick.
    pub worst: f64,
}

/// The outcome of one phase of [`simulate_shares`].
#[derive(Debug, Clone)]
pub struct SharePhase {
    /// The device's capacity.
    pub capacity: Capacity,
    /// The allocator's estimate at the end of the phase.
    pub estimate: Option<f64>,
    /// Per client, in the order given.
    pub served: Vec<ShareServed>,
}

/// Runs [`ShareAllocator`] over a fluid model of a device: each tick of
/// [`TICK_NS`] the device's capacity is divided among the active clients in
/// proportion to their queue depths (water-filling: a client held by its cap
/// or by itself leaves the rest to the others), the allocator sees what each
/// did and writes the caps for the next tick. Each phase is measured after
/// its first `settle` ticks; [`Capacity::secs`] is the phase's length.
pub fn simulate_shares(
    clients: &[ShareClient],
    phases: &[Capacity],
    settle: usize,
) -> Vec<SharePhase> {
    let mut alloc = ShareAllocator::new();
    let mut caps: Vec<Option<f64>> = vec![None; clients.len()];
    let ticks_per_sec = (1_000_000_000 / TICK_NS) as usize;
    let mut out = Vec::new();
    for (p, &phase) in phases.iter().enumerate() {
        let loads: Vec<Load> = clients
            .iter()
            .map(|c| c.load[p.min(c.load.len() - 1)])
            .collect();
        let ticks = phase.secs as usize * ticks_per_sec;
        let mut sum = vec![0.0; clients.len()];
        let mut worst = vec![f64::INFINITY; clients.len()];
        for t in 0..ticks {
            let done = fluid(phase.iops as f64, &loads, &caps);
            let inputs: Vec<ShareInput> = clients
                .iter()
                .enumerate()
                .map(|(k, c)| {
                    let held =
                        caps[k].is_some_and(|cap| done[k] >= 0.999 * cap) && loads[k] != Load::Idle;
                    let busy = match loads[k] {
                        Load::Idle => false,
                        Load::Flood { .. } | Load::Bound { .. } => true,
                        Load::Rate { iops } => done[k] < 0.99 * iops,
                    };
                    ShareInput {
                        id: k as u64,
                        share: c.share,
                        seen: Interval {
                            done: done[k],
                            busy: busy || held,
                            held,
                        },
                    }
                })
                .collect();
            caps = alloc.tick(&inputs);
            if t >= settle.min(ticks - 1) {
                for k in 0..clients.len() {
                    sum[k] += done[k];
                    worst[k] = worst[k].min(done[k]);
                }
            }
        }
        let measured = (ticks - settle.min(ticks - 1)) as f64;
        out.push(SharePhase {
            capacity: phase,
            estimate: alloc.capacity(),
            served: (0..clients.len())
                .map(|k| ShareServed {
                    done: sum[k] / measured,
                    cap: caps[k],
                    worst: worst[k],
                })
                .collect(),
        });
    }
    out
}

/// The device of [`simulate_shares`] for one tick: what each client
/// completes, per second.
fn fluid(capacity: f64, loads: &[Load], caps: &[Option<f64>]) -> Vec<f64> {
    let bound: Vec<f64> = loads
        .iter()
        .zip(caps)
        .map(|(l, cap)| {
            let own = match *l {
                Load::Idle => 0.0,
                Load::Flood { .. } => f64::INFINITY,
                Load::Bound { iops, .. } | Load::Rate { iops } => iops,
            };
            own.min(cap.unwrap_or(f64::INFINITY))
        })
        .collect();
    let depth = |l: &Load| match *l {
        Load::Idle => 0.0,
        Load::Flood { qd } | Load::Bound { qd, .. } => qd as f64,
        // An open loop's requests rarely wait: it takes what it asks first.
        Load::Rate { .. } => 1e9,
    };
    let mut got = vec![0.0; loads.len()];
    let weight: Vec<f64> = loads.iter().map(depth).collect();
    water_fill(capacity, &weight, &bound, &mut got);
    got
}

/// The share scenario: on a device doing 10K IOPS, then 4K, then 10K again,
/// a reserved client (3000 IOPS at queue depth 16), a flooding one (queue
/// depth 64, weight 3) and one that is idle, then floods with weight 1, then
/// asks 500 IOPS; then a queue depth 1 client that cannot pass 800 IOPS
/// replaces the reserved one.
pub fn share_scenario() -> (Vec<ShareClient>, Vec<Capacity>) {
    let flood = |qd| Load::Flood { qd };
    let clients = vec![
        ShareClient {
            name: "reserved",
            share: Share {
                reservation: 3000.0,
                ..Share::default()
            },
            load: vec![flood(16), flood(16), flood(16), flood(16), Load::Idle],
        },
        ShareClient {
            name: "flood",
            share: Share {
                weight: 3,
                ..Share::default()
            },
            load: vec![flood(64)],
        },
        ShareClient {
            name: "other",
            share: Share::default(),
            load: vec![
                Load::Idle,
                flood(64),
                flood(64),
                Load::Rate { iops: 500.0 },
                Load::Bound { qd: 1, iops: 800.0 },
            ],
        },
    ];
    let phases = [10_000, 10_000, 4_000, 10_000, 10_000]
        .map(|iops| Capacity { secs: 5, iops })
        .to_vec();
    (clients, phases)
}
