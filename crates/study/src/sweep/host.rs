//! Facts and chores of the machine the sweep runs on: host facts for the header,
//! the data-filled image, time stamps and durations.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use jiff::Timestamp;

use crate::results::Host;

/// Facts about this host for the header.
pub fn host_info() -> Host {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let cpuinfo = read("/proc/cpuinfo");
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    Host {
        nproc: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        cpu_model,
        kernel: read("/proc/sys/kernel/osrelease"),
        hostname: read("/proc/sys/kernel/hostname"),
    }
}

/// Creates an image of `bytes` filled with non-zero data, so that reads reach the
/// device (a sparse file's holes are answered by the filesystem without I/O).
pub(super) fn create_image(path: &Path, bytes: u64) -> anyhow::Result<()> {
    let mut f = File::create_new(path)?;
    let mut buf = vec![0u8; 1 << 20];
    // xorshift64: cheap data that no filesystem or device compresses or skips.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(())
}

/// UTC now as RFC 3339, to the second.
pub fn utc_now() -> String {
    rfc3339(Timestamp::now().as_second())
}

/// Unix seconds as RFC 3339 in UTC: `YYYY-MM-DDTHH:MM:SSZ`. Seconds outside the
/// years -9999..=9999 are written as a plain number.
pub fn rfc3339(secs: i64) -> String {
    Timestamp::from_second(secs).map_or_else(|_| secs.to_string(), |t| t.to_string())
}

/// `1h02m03s`, `4m05s`, `7s`: the compact form of the sweep's progress lines.
pub fn hms(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}
