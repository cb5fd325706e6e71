//! Workload generation: which offset comes next and whether it is a read or a write.
//!
//! Pure and deterministic for a given seed, so it is tested without devices or threads.

use serde::Serialize;

/// Direction of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dir {
    /// Read from the device.
    Read,
    /// Write to the device.
    Write,
}

/// SplitMix64: small, fast, good enough for offsets and the read/write mix.
#[derive(Debug, Clone)]
pub struct Prng(u64);

impl Prng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The region one job clone works on: `[start, start + len)`, `len` a multiple of `bs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Region {
    /// First byte.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// Block size in bytes.
    pub bs: u64,
}

impl Region {
    /// Number of blocks in the region.
    pub fn blocks(&self) -> u64 {
        self.len / self.bs
    }
}

/// Yields the block offsets of one pass over a region: sequential, or a pseudo-random
/// permutation in which every block appears exactly once per pass (fio's random map),
/// computed in O(1) memory by cycle-walking a bijection on the next power of two.
#[derive(Debug, Clone)]
pub struct OffsetGen {
    region: Region,
    random: bool,
    emitted: u64,
    counter: u64,
    bits: u32,
    key: u64,
}

impl OffsetGen {
    /// A generator over `region`; `random` selects the permutation, keyed by `seed`.
    pub fn new(region: Region, random: bool, seed: u64) -> Self {
        let n = region.blocks().max(1);
        let bits = 64 - (n - 1).leading_zeros();
        let mask = if bits == 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let mut p = Prng::new(seed);
        Self {
            region,
            random,
            emitted: 0,
            counter: p.next_u64() & mask,
            bits,
            key: p.next_u64(),
        }
    }

    fn mask(&self) -> u64 {
        if self.bits == 64 {
            u64::MAX
        } else {
            (1u64 << self.bits) - 1
        }
    }

    /// A bijection on `[0, 2^bits)`: every step (add, xor-shift right, multiply by an odd
    /// constant, all modulo 2^bits) is invertible.
    fn permute(&self, x: u64) -> u64 {
        if self.bits == 0 {
            return 0;
        }
        let mask = self.mask();
        let s = (self.bits / 2).max(1);
        let mut x = x.wrapping_add(self.key) & mask;
        x ^= x >> s;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd) & mask;
        x ^= x >> s;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53) & mask;
        x ^= x >> s;
        x
    }

    /// The next offset of this pass, or `None` when the pass is complete.
    pub fn next_offset(&mut self) -> Option<u64> {
        let n = self.region.blocks();
        if self.emitted >= n {
            return None;
        }
        let block = if self.random {
            let mask = self.mask();
            loop {
                let b = self.permute(self.counter);
                self.counter = self.counter.wrapping_add(1) & mask;
                if b < n {
                    break b;
                }
            }
        } else {
            self.emitted
        };
        self.emitted += 1;
        Some(self.region.start + block * self.region.bs)
    }

    /// Starts a new pass. A random pass continues the cycle, so it is again a permutation
    /// (any window of 2^bits consecutive counters visits every block once).
    pub fn reset(&mut self) {
        self.emitted = 0;
    }
}

/// Picks the direction of each request for a given read percentage.
#[derive(Debug, Clone)]
pub struct DirPicker {
    read_percent: u32,
    prng: Prng,
}

impl DirPicker {
    /// `read_percent` in 0..=100.
    pub fn new(read_percent: u32, seed: u64) -> Self {
        Self {
            read_percent,
            prng: Prng::new(seed ^ 0xd1b5_4a32_d192_ed03),
        }
    }

    /// Direction of the next request.
    pub fn next_dir(&mut self) -> Dir {
        match self.read_percent {
            100 => Dir::Read,
            0 => Dir::Write,
            p => {
                if (self.prng.next_u64() % 100) < u64::from(p) {
                    Dir::Read
                } else {
                    Dir::Write
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn region(blocks: u64) -> Region {
        Region {
            start: 1 << 20,
            len: blocks * 4096,
            bs: 4096,
        }
    }

    #[test]
    fn sequential_pass() {
        let mut g = OffsetGen::new(region(3), false, 1);
        assert_eq!(g.next_offset(), Some(1 << 20));
        assert_eq!(g.next_offset(), Some((1 << 20) + 4096));
        assert_eq!(g.next_offset(), Some((1 << 20) + 8192));
        assert_eq!(g.next_offset(), None);
        g.reset();
        assert_eq!(g.next_offset(), Some(1 << 20));
    }

    #[test]
    fn random_pass_is_a_permutation() {
        for blocks in [1u64, 2, 3, 7, 100, 1000, 4097] {
            let mut g = OffsetGen::new(region(blocks), true, 42);
            for pass in 0..3 {
                let mut seen = HashSet::new();
                while let Some(o) = g.next_offset() {
                    assert!(o >= 1 << 20 && o < (1 << 20) + blocks * 4096);
                    assert_eq!(o % 4096, 0);
                    assert!(seen.insert(o), "duplicate in pass {pass}");
                }
                assert_eq!(seen.len() as u64, blocks);
                g.reset();
            }
        }
    }

    #[test]
    fn random_pass_after_partial_reset_is_a_permutation() {
        let mut g = OffsetGen::new(region(1000), true, 7);
        for _ in 0..123 {
            g.next_offset();
        }
        g.reset();
        let seen: HashSet<u64> = std::iter::from_fn(|| g.next_offset()).collect();
        assert_eq!(seen.len(), 1000);
    }

    #[test]
    fn random_is_not_sequential() {
        let mut g = OffsetGen::new(region(1000), true, 7);
        let v: Vec<u64> = std::iter::from_fn(|| g.next_offset()).collect();
        let ascending = v.windows(2).filter(|w| w[1] == w[0] + 4096).count();
        assert!(ascending < 50, "{ascending} sequential steps");
    }

    #[test]
    fn mix_ratio() {
        let mut p = DirPicker::new(70, 3);
        let reads = (0..10000).filter(|_| p.next_dir() == Dir::Read).count();
        assert!((6700..7300).contains(&reads), "{reads}");
        let mut p = DirPicker::new(0, 3);
        assert!((0..100).all(|_| p.next_dir() == Dir::Write));
    }
}
