//! Numbers as fio prints them for people: three significant digits and a unit
//! (`196MiB/s`, `50.1k`). Used by the report and by the progress line.

/// Bytes per second as fio prints them: `196MiB/s`.
pub fn human_bw(bytes_per_s: f64) -> String {
    format!("{}/s", binary(bytes_per_s))
}

/// A decimal count with fio's `k`/`M` suffixes: `50.1k`.
pub fn human_count(n: f64) -> String {
    let units = ["", "k", "M", "G"];
    let mut v = n;
    let mut i = 0;
    while v >= 1000.0 * 9.995 / 10.0 && i + 1 < units.len() && v >= 1000.0 {
        v /= 1000.0;
        i += 1;
    }
    format!("{}{}", three_digits(v), units[i])
}

fn three_digits(v: f64) -> String {
    if v >= 100.0 || v == v.trunc() && v < 1000.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A byte count with binary suffixes, as fio prints transferred sizes: `1024MiB`.
pub fn human_bytes(b: u64) -> String {
    binary(b as f64)
}

/// Bytes with the largest binary unit that keeps four digits or fewer: `196MiB`.
fn binary(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut i = 0;
    while v >= 1024.0 * 9.995 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{}{}", three_digits(v), units[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human_count(50123.0), "50.1k");
        assert_eq!(human_count(999.0), "999");
        assert_eq!(human_count(1_234_567.0), "1.23M");
        assert_eq!(human_bw(205_520_896.0), "196MiB/s");
        assert_eq!(human_bw(4096.0), "4096B/s");
        assert_eq!(human_bytes(1 << 30), "1024MiB");
        assert_eq!(human_bytes(512), "512B");
    }
}
