//! Figures of merit, as the seeds define them (REFERENCE.md section 5). Pure
//! functions over measured throughputs: no files, no processes.
//!
//! Per cell (one workload), over the setups measured (native, baseline, IOThread
//! counts), each the mean of its repeats:
//! - **best**: the highest throughput of a virtualized setup, baseline included;
//! - **improvement** of best over the baseline, in percent (0 when the baseline is best);
//! - **fewest IOThreads** reaching `threshold` (90%) of best; 0 = the baseline does;
//! - **ratio** of best to native (the seeds' "pod"), when native was measured;
//! - **noisy**: a setup whose repeats disagree by more than `noise` (relative
//!   range, (max - min) / mean).
//!
//! Per block size, "Total" rows average each figure over the cells that have it,
//! as the seeds' pivot tables do (their "2048 Total" is the mean of the four ops).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::matrix::{Cell, Setup};

/// Relative tolerance when comparing throughputs against a threshold, so that a value
/// exactly at 90% of best (up to float rounding) counts as reaching it.
const EPS: f64 = 1e-9;

/// Knobs of the figures of merit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Fraction of best that counts as "good enough" (the seeds: 0.9).
    pub threshold: f64,
    /// Relative range of repeats above which a setup is flagged noisy (0.10).
    pub noise: f64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            threshold: 0.9,
            noise: 0.10,
        }
    }
}

/// The repeats of one setup in one cell.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Measure {
    /// Mean of the repeats: the figure used everywhere else.
    pub mean: f64,
    /// Lowest repeat.
    pub min: f64,
    /// Highest repeat.
    pub max: f64,
    /// Number of repeats.
    pub n: usize,
}

impl Measure {
    /// None for no repeats (or non-finite values only).
    pub fn of(xs: &[f64]) -> Option<Measure> {
        let xs: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
        if xs.is_empty() {
            return None;
        }
        let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(Measure {
            mean: xs.iter().sum::<f64>() / xs.len() as f64,
            min,
            max,
            n: xs.len(),
        })
    }

    /// Relative range of the repeats, (max - min) / mean; 0 for one repeat.
    pub fn spread(&self) -> f64 {
        if self.n < 2 || self.mean <= 0.0 {
            0.0
        } else {
            (self.max - self.min) / self.mean
        }
    }
}

/// Figures of merit of one cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellMerit {
    /// Non-virtualized run (the seeds' "pod"), if measured.
    pub native: Option<Measure>,
    /// Baseline (the seeds' "0 IOThreads"), if measured.
    pub baseline: Option<Measure>,
    /// Each IOThread count measured.
    pub iothreads: BTreeMap<u32, Measure>,
    /// `--iothreads auto`, if measured (not one of the counts `best` is
    /// taken over: it is compared with them).
    pub auto: Option<Measure>,
    /// Best throughput over the baseline and the IOThread counts.
    pub best: Option<f64>,
    /// Improvement of best over the baseline, percent (>= 0).
    pub improvement_pct: Option<f64>,
    /// Fewest IOThreads reaching `threshold` of best (0 = baseline).
    pub min_iothreads: Option<u32>,
    /// Best / native.
    pub ratio_to_native: Option<f64>,
    /// Setups whose repeats disagree by more than `noise`.
    pub noisy: Vec<Setup>,
}

impl CellMerit {
    /// The mean of one setup.
    pub fn mean(&self, s: Setup) -> Option<f64> {
        self.measure(s).map(|m| m.mean)
    }

    /// The measure of one setup.
    pub fn measure(&self, s: Setup) -> Option<&Measure> {
        match s {
            Setup::Native => self.native.as_ref(),
            Setup::Baseline => self.baseline.as_ref(),
            Setup::IoThreads(k) => self.iothreads.get(&k),
            Setup::Auto => self.auto.as_ref(),
        }
    }

    /// `auto`'s throughput / the best fixed count's (baseline included).
    pub fn auto_vs_best(&self) -> Option<f64> {
        let best = self.best.filter(|&b| b > 0.0)?;
        Some(self.auto.as_ref()?.mean / best)
    }

    /// Whether `auto`'s gap to the best fixed count is within the noise of
    /// the repeats: its highest repeat reaches the lowest of the best
    /// count's (their ranges overlap), so the order of the two may be the
    /// host's doing. None without both.
    pub fn auto_within_noise(&self) -> Option<bool> {
        let auto = self.auto.as_ref()?;
        let best = self.measure(self.best_setup()?)?;
        Some(auto.max >= best.min)
    }

    /// The column of [`Self::best_count`]: the baseline for 0.
    pub fn best_setup(&self) -> Option<Setup> {
        self.best_count().map(|k| match k {
            0 => Setup::Baseline,
            k => Setup::IoThreads(k),
        })
    }

    /// The fixed count (0 = baseline) with the best throughput.
    pub fn best_count(&self) -> Option<u32> {
        let best = self.best?;
        self.counts()
            .into_iter()
            .find(|&(_, v)| v >= best)
            .map(|(k, _)| k)
    }

    /// Virtualized setups in IOThread order: (0 = baseline, mean), (1, mean), ...
    pub fn counts(&self) -> Vec<(u32, f64)> {
        self.baseline
            .iter()
            .map(|m| (0, m.mean))
            .chain(self.iothreads.iter().map(|(&k, m)| (k, m.mean)))
            .collect()
    }

    /// Whether any setup of the cell is noisy.
    pub fn is_noisy(&self) -> bool {
        !self.noisy.is_empty()
    }
}

/// Fewest IOThreads (0 = baseline) whose throughput reaches `frac` of `best`.
/// `counts` need not be sorted. None if empty.
pub fn fewest_reaching(counts: &[(u32, f64)], best: f64, frac: f64) -> Option<u32> {
    let goal = frac * best * (1.0 - EPS);
    counts
        .iter()
        .filter(|(_, v)| *v >= goal)
        .map(|(k, _)| *k)
        .min()
}

/// The figures of merit of one cell from its samples (MB/s of every repeat, per setup).
pub fn cell_merit(samples: &BTreeMap<Setup, Vec<f64>>, opts: Options) -> CellMerit {
    let mut m = CellMerit {
        native: None,
        baseline: None,
        iothreads: BTreeMap::new(),
        auto: None,
        best: None,
        improvement_pct: None,
        min_iothreads: None,
        ratio_to_native: None,
        noisy: Vec::new(),
    };
    for (&setup, xs) in samples {
        let Some(meas) = Measure::of(xs) else {
            continue;
        };
        if meas.spread() > opts.noise {
            m.noisy.push(setup);
        }
        match setup {
            Setup::Native => m.native = Some(meas),
            Setup::Baseline => m.baseline = Some(meas),
            Setup::IoThreads(k) => {
                m.iothreads.insert(k, meas);
            }
            Setup::Auto => m.auto = Some(meas),
        }
    }
    let counts = m.counts();
    m.best = counts.iter().map(|&(_, v)| v).reduce(f64::max);
    if let Some(best) = m.best {
        m.min_iothreads = fewest_reaching(&counts, best, opts.threshold);
        m.improvement_pct = m
            .baseline
            .filter(|b| b.mean > 0.0)
            .map(|b| (best / b.mean - 1.0) * 100.0);
        m.ratio_to_native = m.native.filter(|n| n.mean > 0.0).map(|n| best / n.mean);
    }
    m
}

/// Figures of merit for every cell.
pub fn all_merits(
    throughput: &BTreeMap<Cell, BTreeMap<Setup, Vec<f64>>>,
    opts: Options,
) -> BTreeMap<Cell, CellMerit> {
    throughput
        .iter()
        .map(|(c, s)| (*c, cell_merit(s, opts)))
        .collect()
}

/// A "Total" row entry: each figure averaged over the cells that have it.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct TotalMerit {
    /// Mean throughput per setup over the cells measuring it.
    pub throughput: BTreeMap<String, f64>,
    /// Mean best.
    pub best: Option<f64>,
    /// Mean improvement, percent.
    pub improvement_pct: Option<f64>,
    /// Mean of the fewest IOThreads reaching the threshold (the seeds round it).
    pub min_iothreads: Option<f64>,
    /// Mean ratio to native.
    pub ratio_to_native: Option<f64>,
    /// Cells averaged.
    pub cells: usize,
    /// Whether any of them is noisy.
    pub noisy: bool,
}

fn mean_of(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = xs.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Averages cells into a "Total" entry (the seeds' per-size Total rows).
pub fn total(cells: &[&CellMerit]) -> TotalMerit {
    let mut per_setup: BTreeMap<Setup, Vec<f64>> = BTreeMap::new();
    for c in cells {
        for s in c
            .native
            .iter()
            .map(|_| Setup::Native)
            .chain(c.baseline.iter().map(|_| Setup::Baseline))
            .chain(c.auto.iter().map(|_| Setup::Auto))
        {
            per_setup
                .entry(s)
                .or_default()
                .push(c.mean(s).unwrap_or_default());
        }
        for (&k, m) in &c.iothreads {
            per_setup
                .entry(Setup::IoThreads(k))
                .or_default()
                .push(m.mean);
        }
    }
    TotalMerit {
        throughput: per_setup
            .into_iter()
            .filter_map(|(s, v)| mean_of(v.into_iter()).map(|m| (s.label(), m)))
            .collect(),
        best: mean_of(cells.iter().filter_map(|c| c.best)),
        improvement_pct: mean_of(cells.iter().filter_map(|c| c.improvement_pct)),
        min_iothreads: mean_of(cells.iter().filter_map(|c| c.min_iothreads.map(f64::from))),
        ratio_to_native: mean_of(cells.iter().filter_map(|c| c.ratio_to_native)),
        cells: cells.len(),
        noisy: cells.iter().any(|c| c.is_noisy()),
    }
}

/// How one IOThread count does over the cells that matter.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// IOThread count (0 = baseline).
    pub count: u32,
    /// Lowest fraction of its best that any cell reaches with this count.
    pub worst: f64,
    /// The cell reaching only `worst`.
    pub worst_cell: Cell,
    /// Mean fraction of best over the cells.
    pub mean: f64,
    /// Cells that measured this count.
    pub covered: usize,
}

/// The recommendation: one IOThread count for a set of cells.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// The count chosen (0 = the baseline suffices); None without data.
    pub count: Option<u32>,
    /// Whether every cell reaches the threshold with it (else: the count that gets
    /// the worst cell closest).
    pub meets_threshold: bool,
    /// Every count considered, ascending.
    pub candidates: Vec<Candidate>,
    /// Cells considered.
    pub cells: usize,
}

/// Chooses the fewest IOThreads (0 = baseline) with which **every** cell reaches
/// `threshold` of its own best. Per-cell minima are not simply maxed, because
/// throughput is not monotonic in the count (a cell fine at 2 can fall off at 4 on
/// an oversubscribed host). Counts not measured for every cell are listed but not
/// chosen. If no count satisfies every cell, the one with the best worst cell wins
/// (ties: fewer threads).
pub fn decide(cells: &[(Cell, &CellMerit)], threshold: f64) -> Decision {
    let mut counts: Vec<u32> = cells
        .iter()
        .flat_map(|(_, m)| m.counts().into_iter().map(|(k, _)| k))
        .collect();
    counts.sort();
    counts.dedup();
    let mut candidates = Vec::new();
    for &k in &counts {
        let mut worst: Option<(f64, Cell)> = None;
        let mut sum = 0.0;
        let mut covered = 0;
        for (cell, m) in cells {
            let (Some(best), Some(v)) = (
                m.best,
                m.counts()
                    .into_iter()
                    .find(|&(c, _)| c == k)
                    .map(|(_, v)| v),
            ) else {
                continue;
            };
            let frac = if best > 0.0 { v / best } else { 1.0 };
            covered += 1;
            sum += frac;
            if worst.is_none_or(|(w, _)| frac < w) {
                worst = Some((frac, *cell));
            }
        }
        if let Some((w, c)) = worst {
            candidates.push(Candidate {
                count: k,
                worst: w,
                worst_cell: c,
                mean: sum / covered as f64,
                covered,
            });
        }
    }
    let n = cells.iter().filter(|(_, m)| m.best.is_some()).count();
    let full: Vec<&Candidate> = candidates.iter().filter(|c| c.covered == n).collect();
    let meeting = full.iter().find(|c| c.worst >= threshold * (1.0 - EPS));
    let (count, meets) = match meeting {
        Some(c) => (Some(c.count), true),
        None => {
            // max_by keeps the last maximum; iterate descending so ties pick fewer threads.
            let best = full.iter().rev().max_by(|a, b| a.worst.total_cmp(&b.worst));
            (best.map(|c| c.count), false)
        }
    };
    Decision {
        count,
        meets_threshold: meets,
        candidates,
        cells: n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::Op;

    fn samples(native: &[f64], base: &[f64], iot: &[(u32, &[f64])]) -> BTreeMap<Setup, Vec<f64>> {
        let mut m = BTreeMap::new();
        if !native.is_empty() {
            m.insert(Setup::Native, native.to_vec());
        }
        if !base.is_empty() {
            m.insert(Setup::Baseline, base.to_vec());
        }
        for (k, v) in iot {
            m.insert(Setup::IoThreads(*k), v.to_vec());
        }
        m
    }

    fn cell(op: Op, jobs: u32) -> Cell {
        Cell {
            bs: 4096,
            op,
            jobs,
            iodepth: 1,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn auto_within_the_noise_of_the_best_count() {
        let with_auto = |auto: &[f64]| {
            let mut m = samples(&[], &[100.0, 100.0], &[(2, &[190.0, 210.0])]);
            m.insert(Setup::Auto, auto.to_vec());
            cell_merit(&m, Options::default())
        };
        // 0.86x of the best's mean, but its best repeat reaches the best
        // count's worst: the ranges overlap.
        assert_eq!(with_auto(&[155.0, 190.0]).auto_within_noise(), Some(true));
        assert_eq!(with_auto(&[150.0, 160.0]).auto_within_noise(), Some(false));
        let none = cell_merit(
            &samples(&[], &[100.0], &[(2, &[200.0])]),
            Options::default(),
        );
        assert_eq!(none.auto_within_noise(), None);
    }

    #[test]
    fn typical_cell() {
        // Baseline 100, 1 -> 150, 2 -> 190, 4 -> 200: best 200, +100%, 90% = 180 -> 2.
        let m = cell_merit(
            &samples(
                &[400.0],
                &[100.0, 100.0],
                &[
                    (1, &[150.0, 150.0]),
                    (2, &[185.0, 195.0]),
                    (4, &[200.0, 200.0]),
                ],
            ),
            Options::default(),
        );
        assert_eq!(m.best, Some(200.0));
        assert!(close(m.improvement_pct.unwrap(), 100.0));
        assert_eq!(m.min_iothreads, Some(2));
        assert!(close(m.ratio_to_native.unwrap(), 0.5));
        assert!(m.noisy.is_empty(), "a 5% spread is under the 10% default");
        assert_eq!(m.mean(Setup::IoThreads(2)), Some(190.0));
    }

    #[test]
    fn baseline_best_gives_zero_threads_and_zero_improvement() {
        let m = cell_merit(
            &samples(&[], &[300.0], &[(1, &[250.0]), (2, &[200.0])]),
            Options::default(),
        );
        assert_eq!(m.best, Some(300.0));
        assert_eq!(m.min_iothreads, Some(0));
        assert!(close(m.improvement_pct.unwrap(), 0.0));
    }

    #[test]
    fn ties_pick_the_fewest_threads() {
        let m = cell_merit(
            &samples(&[], &[50.0], &[(1, &[100.0]), (2, &[100.0]), (4, &[100.0])]),
            Options::default(),
        );
        assert_eq!(m.best, Some(100.0));
        assert_eq!(m.min_iothreads, Some(1));
        // Exactly 90% of best reaches the threshold.
        let m = cell_merit(&samples(&[], &[90.0], &[(1, &[100.0])]), Options::default());
        assert_eq!(m.min_iothreads, Some(0));
        assert_eq!(
            fewest_reaching(&[(4, 10.0), (2, 10.0)], 10.0, 0.9),
            Some(2),
            "unsorted input"
        );
    }

    #[test]
    fn noisy_repeats_are_flagged_per_setup() {
        let m = cell_merit(
            &samples(&[100.0, 130.0], &[100.0, 100.0], &[(2, &[100.0, 115.0])]),
            Options::default(),
        );
        assert_eq!(m.noisy, vec![Setup::Native, Setup::IoThreads(2)]);
        assert!(m.is_noisy());
        let lax = cell_merit(
            &samples(&[], &[100.0], &[(2, &[100.0, 115.0])]),
            Options {
                noise: 0.2,
                ..Options::default()
            },
        );
        assert!(!lax.is_noisy());
        assert!(close(Measure::of(&[90.0, 110.0]).unwrap().spread(), 0.2));
        assert_eq!(Measure::of(&[5.0]).unwrap().spread(), 0.0);
    }

    #[test]
    fn native_missing_gives_no_ratio() {
        let m = cell_merit(
            &samples(&[], &[100.0], &[(1, &[120.0])]),
            Options::default(),
        );
        assert_eq!(m.ratio_to_native, None);
        assert_eq!(m.native, None);
        assert!(close(m.improvement_pct.unwrap(), 20.0));
    }

    #[test]
    fn single_iothread_count_without_baseline() {
        let m = cell_merit(
            &samples(&[200.0], &[], &[(2, &[100.0])]),
            Options::default(),
        );
        assert_eq!(m.best, Some(100.0));
        assert_eq!(m.min_iothreads, Some(2));
        assert_eq!(m.improvement_pct, None, "no baseline, no improvement");
        assert!(close(m.ratio_to_native.unwrap(), 0.5));
    }

    #[test]
    fn missing_and_degenerate_cells() {
        // Only native: no virtualized best, nothing else.
        let m = cell_merit(&samples(&[100.0], &[], &[]), Options::default());
        assert_eq!(
            (m.best, m.min_iothreads, m.ratio_to_native),
            (None, None, None)
        );
        // Empty and non-finite repeats are ignored.
        let mut s = samples(&[], &[], &[(1, &[f64::NAN])]);
        s.insert(Setup::IoThreads(2), vec![]);
        let m = cell_merit(&s, Options::default());
        assert!(m.iothreads.is_empty() && m.best.is_none());
        // A zero baseline has no finite improvement.
        let m = cell_merit(&samples(&[], &[0.0], &[(1, &[10.0])]), Options::default());
        assert_eq!(m.improvement_pct, None);
        assert_eq!(m.min_iothreads, Some(1));
        // All zero: the baseline "reaches" 90% of nothing.
        let m = cell_merit(&samples(&[], &[0.0], &[(1, &[0.0])]), Options::default());
        assert_eq!(m.min_iothreads, Some(0));
    }

    #[test]
    fn totals_average_like_the_seeds() {
        // The seeds' 2048 Total, jobs 1 iodepth 1: 18%, 81%, 67%, 103% -> 67%.
        let mk = |imp: f64, k: u32| CellMerit {
            native: None,
            baseline: Some(Measure::of(&[100.0]).unwrap()),
            iothreads: BTreeMap::from([(k.max(1), Measure::of(&[100.0 + imp]).unwrap())]),
            auto: None,
            best: Some(100.0 + imp),
            improvement_pct: Some(imp),
            min_iothreads: Some(k),
            ratio_to_native: None,
            noisy: vec![],
        };
        let cells = [mk(18.0, 12), mk(81.0, 12), mk(67.0, 8), mk(103.0, 6)];
        let t = total(&cells.iter().collect::<Vec<_>>());
        assert!(close(t.improvement_pct.unwrap(), 67.25));
        assert!(close(t.min_iothreads.unwrap(), 9.5), "the seeds print 10");
        assert_eq!(t.ratio_to_native, None);
        assert_eq!(t.cells, 4);
        assert!(close(t.throughput["baseline"], 100.0));
        // A missing op is simply not averaged in.
        let t3 = total(&cells[..3].iter().collect::<Vec<_>>());
        assert!(close(
            t3.improvement_pct.unwrap(),
            (18.0 + 81.0 + 67.0) / 3.0
        ));
        assert_eq!(total(&[]).improvement_pct, None);
    }

    #[test]
    fn decision_takes_the_fewest_count_good_for_every_cell() {
        let a = cell_merit(
            &samples(
                &[],
                &[100.0],
                &[(1, &[180.0]), (2, &[200.0]), (4, &[195.0])],
            ),
            Options::default(),
        );
        let b = cell_merit(
            &samples(
                &[],
                &[100.0],
                &[(1, &[100.0]), (2, &[150.0]), (4, &[200.0])],
            ),
            Options::default(),
        );
        let d = decide(
            &[(cell(Op::Randread, 1), &a), (cell(Op::Randwrite, 1), &b)],
            0.9,
        );
        assert_eq!(d.count, Some(4));
        assert!(d.meets_threshold);
        assert_eq!(d.candidates.len(), 4);
        assert_eq!(d.candidates[0].count, 0);
        assert!(close(d.candidates[2].worst, 0.75));
        assert_eq!(d.candidates[2].worst_cell.op, Op::Randwrite);
        // One cell alone: its own minimum.
        let d = decide(&[(cell(Op::Randread, 1), &a)], 0.9);
        assert_eq!(d.count, Some(1));
    }

    #[test]
    fn decision_is_not_fooled_by_non_monotonic_cells() {
        // a peaks at 2 and collapses at 4; b needs 4: no count satisfies both.
        let a = cell_merit(
            &samples(&[], &[100.0], &[(2, &[200.0]), (4, &[120.0])]),
            Options::default(),
        );
        let b = cell_merit(
            &samples(&[], &[100.0], &[(2, &[150.0]), (4, &[200.0])]),
            Options::default(),
        );
        let d = decide(&[(cell(Op::Read, 1), &a), (cell(Op::Write, 1), &b)], 0.9);
        assert!(!d.meets_threshold);
        assert_eq!(d.count, Some(2), "worst cell at 75% beats 60%");
    }

    #[test]
    fn decision_baseline_suffices_and_partial_counts_are_not_chosen() {
        let a = cell_merit(
            &samples(&[], &[100.0], &[(1, &[95.0]), (8, &[300.0])]),
            Options::default(),
        );
        let b = cell_merit(&samples(&[], &[100.0], &[(1, &[99.0])]), Options::default());
        let d = decide(&[(cell(Op::Read, 1), &a), (cell(Op::Write, 1), &b)], 0.9);
        // 8 is only measured for a: it cannot be chosen; 0 and 1 fail a (300 best),
        // and 0 gets a's worst case closest (33% vs 32%).
        assert!(d.candidates.iter().any(|c| c.count == 8 && c.covered == 1));
        assert!(!d.meets_threshold);
        assert_eq!(d.count, Some(0));
        let c = cell_merit(
            &samples(&[], &[100.0], &[(1, &[95.0]), (2, &[101.0])]),
            Options::default(),
        );
        let d = decide(&[(cell(Op::Read, 1), &c)], 0.9);
        assert_eq!((d.count, d.meets_threshold), (Some(0), true));
        assert_eq!(decide(&[], 0.9).count, None);
    }
}
