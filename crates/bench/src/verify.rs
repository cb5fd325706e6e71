//! Block contents for `verify=crc32c`.
//!
//! Every block written by the write pass starts with a header
//!
//! ```text
//! 0..4    magic "VQBV"
//! 4..8    crc32c of bytes 8..bs (little endian)
//! 8..16   offset of the block on the device (little endian)
//! 16..24  seed of the run (little endian)
//! 24..bs  pseudo-random payload derived from (seed, offset)
//! ```
//!
//! so the read pass can tell a corrupted block (crc), a misplaced one (offset) and a
//! stale one from an earlier run (seed) apart, and regenerate what was expected.

use serde::Serialize;

use crate::job::Prng;

/// Header magic.
pub const MAGIC: [u8; 4] = *b"VQBV";
/// Header length in bytes.
pub const HEADER_LEN: usize = 24;

/// Fills `buf` (one block) with the contents the write pass puts at `offset`.
pub fn fill_block(buf: &mut [u8], offset: u64, seed: u64) {
    let mut prng = Prng::new(seed ^ offset.rotate_left(17));
    let mut chunks = buf[HEADER_LEN..].chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&prng.next_u64().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = prng.next_u64().to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&last[..n]);
    buf[0..4].copy_from_slice(&MAGIC);
    buf[8..16].copy_from_slice(&offset.to_le_bytes());
    buf[16..24].copy_from_slice(&seed.to_le_bytes());
    let crc = crc32c::crc32c(&buf[8..]);
    buf[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// One block that did not read back as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// Device offset of the block.
    pub offset: u64,
    /// crc32c of the bytes written there (regenerated).
    pub expected_crc: u32,
    /// crc32c computed over the bytes read back.
    pub found_crc: u32,
    /// crc32c stored in the header that was read back.
    pub header_crc: u32,
    /// Offset stored in the header that was read back.
    pub header_offset: u64,
    /// Whether the header's seed is this run's.
    pub seed_matches: bool,
    /// First byte (from the start of the block) that differs from what was written.
    pub first_bad_byte: Option<usize>,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "verify: bad block at offset {}: expected crc32c {:#010x}, found {:#010x}",
            self.offset, self.expected_crc, self.found_crc
        )?;
        if let Some(b) = self.first_bad_byte {
            write!(f, " (first bad byte at block offset {b})")?;
        }
        if self.header_offset != self.offset {
            write!(
                f,
                "; header names offset {} (misplaced or never written)",
                self.header_offset
            )?;
        }
        if !self.seed_matches {
            write!(f, "; header seed is not this run's (stale data)")?;
        }
        Ok(())
    }
}

/// Checks one block read back from `offset`. `scratch` (same length) is overwritten
/// with the expected contents when a mismatch needs describing.
pub fn check_block(buf: &[u8], offset: u64, seed: u64, scratch: &mut [u8]) -> Option<Mismatch> {
    let header_crc = u32::from_le_bytes(buf[4..8].try_into().unwrap_or_default());
    let header_offset = u64::from_le_bytes(buf[8..16].try_into().unwrap_or_default());
    let header_seed = u64::from_le_bytes(buf[16..24].try_into().unwrap_or_default());
    let found_crc = crc32c::crc32c(&buf[8..]);
    if buf[0..4] == MAGIC
        && header_offset == offset
        && header_seed == seed
        && header_crc == found_crc
    {
        return None;
    }
    fill_block(scratch, offset, seed);
    let expected_crc = u32::from_le_bytes(scratch[4..8].try_into().unwrap_or_default());
    // Identical bytes can only mean the header check above was wrong; trust the bytes.
    let first_bad_byte = Some(buf.iter().zip(scratch.iter()).position(|(a, b)| a != b)?);
    Some(Mismatch {
        offset,
        expected_crc,
        found_crc,
        header_crc,
        header_offset,
        seed_matches: header_seed == seed,
        first_bad_byte,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_detection() {
        let mut b = vec![0u8; 4096];
        let mut scratch = vec![0u8; 4096];
        fill_block(&mut b, 8192, 99);
        assert_eq!(check_block(&b, 8192, 99, &mut scratch), None);

        let mut c = b.clone();
        c[1000] ^= 1;
        let m = check_block(&c, 8192, 99, &mut scratch).unwrap();
        assert_eq!(m.offset, 8192);
        assert_eq!(m.first_bad_byte, Some(1000));
        assert_ne!(m.expected_crc, m.found_crc);
        assert!(m.to_string().contains("offset 8192"));

        // Right data at the wrong place.
        let m = check_block(&b, 4096, 99, &mut scratch).unwrap();
        assert_eq!(m.header_offset, 8192);
        // Stale data from another run.
        let m = check_block(&b, 8192, 100, &mut scratch).unwrap();
        assert!(!m.seed_matches);
        // Zeroes (never written).
        let z = vec![0u8; 4096];
        assert!(check_block(&z, 0, 1, &mut scratch).is_some());
    }

    #[test]
    fn odd_block_sizes() {
        let mut b = vec![0u8; 1536];
        let mut s = vec![0u8; 1536];
        fill_block(&mut b, 512, 5);
        assert_eq!(check_block(&b, 512, 5, &mut s), None);
    }
}
