//! Latency statistics with fio's log-linear histogram and percentile rules.
//!
//! fio (`stat.h`, `FIO_IO_U_PLAT_BITS = 6`) keeps 64 linear buckets per power of two;
//! values below 128 ns are exact. A percentile is the midpoint of the first bucket at
//! which the cumulative count reaches `p/100 * N`. We do the same, so figures compare.

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

/// fio's default `percentile_list`.
pub const FIO_PERCENTILES: [f64; 17] = [
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95,
    99.99,
];

const PLAT_BITS: u32 = 6;
const PLAT_VAL: u64 = 1 << PLAT_BITS;
/// Buckets needed to cover every u64 value.
const PLAT_NR: usize = ((64 - PLAT_BITS + 1) as usize) * (PLAT_VAL as usize);

/// Bucket index of a value (fio's `plat_val_to_idx`).
pub fn plat_val_to_idx(val: u64) -> usize {
    if val < 2 * PLAT_VAL {
        return val as usize;
    }
    let msb = 63 - val.leading_zeros();
    let error_bits = msb - PLAT_BITS;
    let base = (error_bits as usize + 1) << PLAT_BITS;
    let offset = ((val >> error_bits) & (PLAT_VAL - 1)) as usize;
    base + offset
}

/// Representative value of a bucket: its midpoint (fio's `plat_idx_to_val`).
pub fn plat_idx_to_val(idx: usize) -> u64 {
    if idx < (2 * PLAT_VAL) as usize {
        return idx as u64;
    }
    let error_bits = (idx >> PLAT_BITS) as u32 - 1;
    let base = 1u64 << (error_bits + PLAT_BITS);
    let k = (idx as u64) & (PLAT_VAL - 1);
    let width = 1u64 << error_bits;
    base.saturating_add(k.saturating_mul(width))
        .saturating_add(width / 2)
}

/// Latency samples of one kind (submission, completion or total) in nanoseconds:
/// min/max/mean/stddev (Welford) and, optionally, the histogram for percentiles.
#[derive(Debug, Clone)]
pub struct LatStat {
    min: u64,
    max: u64,
    n: u64,
    mean: f64,
    m2: f64,
    hist: Option<Box<[u64]>>,
}

impl LatStat {
    /// Empty statistics; `with_histogram` keeps percentiles.
    pub fn new(with_histogram: bool) -> Self {
        Self {
            min: u64::MAX,
            max: 0,
            n: 0,
            mean: 0.0,
            m2: 0.0,
            hist: with_histogram.then(|| vec![0u64; PLAT_NR].into_boxed_slice()),
        }
    }

    /// Adds one sample.
    #[inline]
    pub fn add(&mut self, ns: u64) {
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
        self.n += 1;
        let x = ns as f64;
        let delta = x - self.mean;
        self.mean += delta / self.n as f64;
        self.m2 += delta * (x - self.mean);
        if let Some(h) = self.hist.as_mut() {
            h[plat_val_to_idx(ns)] += 1;
        }
    }

    /// Folds `other` into `self` (group reporting).
    pub fn merge(&mut self, other: &LatStat) {
        if other.n == 0 {
            return;
        }
        if self.n == 0 {
            let hist = self.hist.take();
            *self = other.clone();
            if hist.is_none() {
                self.hist = None;
            }
            return;
        }
        let n = self.n + other.n;
        let delta = other.mean - self.mean;
        let mean = self.mean + delta * other.n as f64 / n as f64;
        self.m2 += other.m2 + delta * delta * (self.n as f64) * (other.n as f64) / n as f64;
        self.mean = mean;
        self.n = n;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        if let (Some(a), Some(b)) = (self.hist.as_mut(), other.hist.as_ref()) {
            for (x, y) in a.iter_mut().zip(b.iter()) {
                *x += y;
            }
        }
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// Smallest sample (0 when empty, as fio prints).
    pub fn min(&self) -> u64 {
        if self.n == 0 {
            0
        } else {
            self.min
        }
    }

    /// Largest sample.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Mean in nanoseconds.
    pub fn mean(&self) -> f64 {
        self.mean
    }

    /// Sample standard deviation (n - 1), as fio.
    pub fn stddev(&self) -> f64 {
        if self.n < 2 {
            0.0
        } else {
            (self.m2 / (self.n - 1) as f64).sqrt()
        }
    }

    /// Values at the given percentiles, or `None` without a histogram or samples.
    pub fn percentiles(&self, list: &[f64]) -> Option<Vec<(f64, u64)>> {
        let h = self.hist.as_ref()?;
        if self.n == 0 {
            return Some(list.iter().map(|&p| (p, 0)).collect());
        }
        let mut out = Vec::with_capacity(list.len());
        let mut j = 0;
        let mut sum = 0u64;
        for (i, &c) in h.iter().enumerate() {
            sum += c;
            while j < list.len() && sum as f64 >= list[j] / 100.0 * self.n as f64 {
                out.push((list[j], plat_idx_to_val(i)));
                j += 1;
            }
            if j == list.len() {
                break;
            }
        }
        // Rounding can leave the last percentiles unreached: they are the maximum.
        while j < list.len() {
            out.push((list[j], self.max));
            j += 1;
        }
        Some(out)
    }

    /// fio's JSON object: `{min,max,mean,stddev,N[,percentile]}`.
    pub fn to_json(&self) -> LatJson {
        LatJson {
            min: self.min(),
            max: self.max(),
            mean: self.mean(),
            stddev: self.stddev(),
            n: self.count(),
            percentile: self.percentiles(&FIO_PERCENTILES).map(Percentiles),
        }
    }
}

/// Percentiles serialized as fio does: keys `"%f"` of the percentile, in list order.
#[derive(Debug, Clone)]
pub struct Percentiles(pub Vec<(f64, u64)>);

impl Serialize for Percentiles {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (p, v) in &self.0 {
            m.serialize_entry(&format!("{p:.6}"), v)?;
        }
        m.end()
    }
}

/// fio's latency JSON object.
#[derive(Debug, Clone, Serialize)]
pub struct LatJson {
    /// Minimum, ns.
    pub min: u64,
    /// Maximum, ns.
    pub max: u64,
    /// Mean, ns.
    pub mean: f64,
    /// Sample standard deviation, ns.
    pub stddev: f64,
    /// Number of samples.
    #[serde(rename = "N")]
    pub n: u64,
    /// Percentiles (fio's default list).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub percentile: Option<Percentiles>,
}

/// Counters of one direction (read or write) of one job clone or group.
#[derive(Debug, Clone)]
pub struct DirStats {
    /// Bytes transferred.
    pub io_bytes: u64,
    /// Requests completed.
    pub total_ios: u64,
    /// Submission latency: request prepared to handed to the device.
    pub slat: LatStat,
    /// Completion latency: handed to the device to completion seen.
    pub clat: LatStat,
    /// Total latency: prepared to completion seen.
    pub lat: LatStat,
}

impl Default for DirStats {
    fn default() -> Self {
        Self::new()
    }
}

impl DirStats {
    /// Empty counters (clat and lat keep histograms).
    pub fn new() -> Self {
        Self {
            io_bytes: 0,
            total_ios: 0,
            slat: LatStat::new(false),
            clat: LatStat::new(true),
            lat: LatStat::new(true),
        }
    }

    /// Records one completed request.
    #[inline]
    pub fn record(&mut self, bytes: u64, slat_ns: u64, clat_ns: u64) {
        self.io_bytes += bytes;
        self.total_ios += 1;
        self.slat.add(slat_ns);
        self.clat.add(clat_ns);
        self.lat.add(slat_ns + clat_ns);
    }

    /// Folds `other` into `self`.
    pub fn merge(&mut self, other: &DirStats) {
        self.io_bytes += other.io_bytes;
        self.total_ios += other.total_ios;
        self.slat.merge(&other.slat);
        self.clat.merge(&other.clat);
        self.lat.merge(&other.lat);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_roundtrip_is_within_bucket_error() {
        for v in [
            0u64,
            1,
            127,
            128,
            129,
            1000,
            4096,
            123_456,
            9_999_999,
            1 << 40,
        ] {
            let idx = plat_val_to_idx(v);
            let back = plat_idx_to_val(idx);
            let err = back.abs_diff(v) as f64 / (v.max(1)) as f64;
            assert!(err <= 1.0 / 64.0, "{v} -> {idx} -> {back}");
        }
        assert_eq!(plat_val_to_idx(u64::MAX), PLAT_NR - 1);
        // Indices are monotonic in the value.
        let mut last = 0;
        for v in (0..100_000u64).step_by(7) {
            let i = plat_val_to_idx(v);
            assert!(i >= last);
            last = i;
        }
    }

    #[test]
    fn percentiles_like_fio() {
        let mut s = LatStat::new(true);
        for v in 1..=100u64 {
            s.add(v);
        }
        let p = s.percentiles(&[1.0, 50.0, 99.0, 99.99]).unwrap();
        assert_eq!(p, vec![(1.0, 1), (50.0, 50), (99.0, 99), (99.99, 100)]);
        assert_eq!(s.min(), 1);
        assert_eq!(s.max(), 100);
        assert!((s.mean() - 50.5).abs() < 1e-9);
        assert!((s.stddev() - 29.011_491_975_882_016).abs() < 1e-9);
    }

    #[test]
    fn merge_matches_single_stream() {
        let mut a = LatStat::new(true);
        let mut b = LatStat::new(true);
        let mut all = LatStat::new(true);
        for v in 0..1000u64 {
            let x = v * v % 7919;
            if v % 3 == 0 {
                a.add(x)
            } else {
                b.add(x)
            }
            all.add(x);
        }
        a.merge(&b);
        assert_eq!(a.count(), all.count());
        assert!((a.mean() - all.mean()).abs() < 1e-6);
        assert!((a.stddev() - all.stddev()).abs() < 1e-6);
        assert_eq!(
            a.percentiles(&FIO_PERCENTILES),
            all.percentiles(&FIO_PERCENTILES)
        );
    }

    #[test]
    fn json_keys() {
        let mut s = LatStat::new(true);
        s.add(1000);
        let v = serde_json::to_value(s.to_json()).unwrap();
        assert_eq!(v["N"], 1);
        assert!(v["percentile"]["99.990000"].is_u64());
        assert!(v["percentile"]["1.000000"].is_u64());
        let text = serde_json::to_string(&s.to_json()).unwrap();
        assert!(text.find("\"5.000000\"").unwrap() < text.find("\"10.000000\"").unwrap());
    }
}
