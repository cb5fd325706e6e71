//! The one size grammar of vqblk's flags, TOML keys and fio job files: fio's.
//!
//! A whole number with an optional suffix `k`, `m`, `g`, `t`, `p`, each optionally
//! followed by `b` or `ib`, in any case (`4k`, `512MiB`, `1G`, `2tb`); every suffix is a
//! power of 1024, as with fio's default `kb_base=1024`. A bare number (or a number with
//! `b`) is bytes.

use std::fmt;

/// Why a string is not a size; its message quotes the string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeError {
    input: String,
    reason: &'static str,
}

impl fmt::Display for SizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} {} (e.g. 512, 4k, 1m, 1G)", self.input, self.reason)
    }
}

impl std::error::Error for SizeError {}

/// Parses a size in fio's grammar (see the module documentation) into bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError {
        input: s.to_string(),
        reason,
    };
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(err("is not a size"));
    }
    let n: u64 = t[..digits_end].parse().map_err(|_| err("is too large"))?;
    let shift = match t[digits_end..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return Err(err("has an unknown suffix (use k, m, g, t or p)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| err("is too large"))
}

/// Bytes as the shortest exact label: `1g`, `4k`, `512`.
pub fn size_label(bytes: u64) -> String {
    for (unit, shift) in [("p", 50), ("t", 40), ("g", 30), ("m", 20), ("k", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_suffixes_are_powers_of_1024() {
        for (s, v) in [
            ("4096", 4096),
            ("512b", 512),
            ("4k", 4096),
            ("4K", 4096),
            ("4kb", 4096),
            ("4KiB", 4096),
            ("512MiB", 512 << 20),
            ("1G", 1 << 30),
            ("1gb", 1 << 30),
            ("2t", 2 << 40),
            ("1p", 1 << 50),
            (" 8m ", 8 << 20),
        ] {
            assert_eq!(parse_size(s), Ok(v), "{s}");
        }
    }

    #[test]
    fn bad_sizes_say_why() {
        for (s, why) in [
            ("", "is not a size"),
            ("k", "is not a size"),
            ("-1", "is not a size"),
            ("1X", "unknown suffix"),
            ("1.5G", "unknown suffix"),
            ("16384p", "too large"),
            ("99999999999999999999", "too large"),
        ] {
            let e = parse_size(s).unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
            assert!(e.contains(&format!("{s:?}")), "{s}: {e}");
        }
    }

    #[test]
    fn labels_round_trip() {
        for b in [512u64, 4096, 6144, 1 << 20, 3 << 30, 1 << 40, 4097] {
            assert_eq!(parse_size(&size_label(b)), Ok(b));
        }
        assert_eq!(size_label(4096), "4k");
        assert_eq!(size_label(1 << 30), "1g");
    }
}
