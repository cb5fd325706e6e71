//! CPU time accounting: the client's through getrusage(2), the server's from
//! `/proc/PID/task/*/stat` (utime + stime of every thread, in clock ticks).

use std::time::Duration;

/// User and system CPU time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTimes {
    /// User time.
    pub user: Duration,
    /// System time.
    pub sys: Duration,
    /// Voluntary + involuntary context switches (getrusage only).
    pub ctx: u64,
    /// Voluntary context switches (getrusage only): how often the thread went
    /// to sleep, e.g. waiting for a completion. For a thread this is the
    /// kernel's `nvcsw`, the `voluntary_ctxt_switches` of
    /// `/proc/self/task/TID/status`.
    pub sleeps: u64,
}

impl CpuTimes {
    /// User + system.
    pub fn total(&self) -> Duration {
        self.user + self.sys
    }

    /// `self - earlier`, saturating.
    pub fn since(&self, earlier: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user.saturating_sub(earlier.user),
            sys: self.sys.saturating_sub(earlier.sys),
            ctx: self.ctx.saturating_sub(earlier.ctx),
            sleeps: self.sleeps.saturating_sub(earlier.sleeps),
        }
    }
}

impl std::ops::Add for CpuTimes {
    type Output = CpuTimes;

    fn add(self, b: CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user + b.user,
            sys: self.sys + b.sys,
            ctx: self.ctx + b.ctx,
            sleeps: self.sleeps + b.sleeps,
        }
    }
}

fn tv(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
}

fn rusage(who: libc::c_int) -> CpuTimes {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage.
    let r = unsafe { libc::getrusage(who, &mut ru) };
    if r != 0 {
        return CpuTimes::default();
    }
    CpuTimes {
        user: tv(ru.ru_utime),
        sys: tv(ru.ru_stime),
        ctx: (ru.ru_nvcsw + ru.ru_nivcsw).max(0) as u64,
        sleeps: ru.ru_nvcsw.max(0) as u64,
    }
}

/// CPU time of the calling thread (what fio reports per job with `thread`).
pub fn thread_times() -> CpuTimes {
    rusage(libc::RUSAGE_THREAD)
}

/// CPU time of the whole process.
pub fn process_times() -> CpuTimes {
    rusage(libc::RUSAGE_SELF)
}

/// The fields of a `/proc/.../stat` line from field 3 (state) on. The command
/// name (field 2) may contain spaces and parentheses, so fields are counted
/// after its last `)`: field `n` is index `n - 3`.
fn stat_fields_from_3(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(stat[stat.rfind(')')? + 1..].split_whitespace())
}

/// Parses utime and stime (fields 14 and 15, in ticks) from a `/proc/.../stat` line.
pub fn parse_stat_ticks(stat: &str) -> Option<(u64, u64)> {
    let mut f = stat_fields_from_3(stat)?;
    let utime = f.nth(14 - 3)?.parse().ok()?;
    let stime = f.next()?.parse().ok()?;
    Some((utime, stime))
}

/// The CPU a thread last ran on (field 39, `processor`) of a
/// `/proc/PID/task/TID/stat` line.
fn parse_stat_processor(stat: &str) -> Option<u32> {
    stat_fields_from_3(stat)?.nth(39 - 3)?.parse().ok()
}

/// Sum of utime + stime over every thread of process `pid`, or an error naming what
/// could not be read.
pub fn server_times(pid: u32) -> Result<CpuTimes, String> {
    let dir = format!("/proc/{pid}/task");
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("server-pid {pid}: {dir}: {e}"))?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    let (mut u, mut s) = (0u64, 0u64);
    for e in entries.flatten() {
        // A thread may exit between readdir and read: skip it.
        let Ok(text) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        if let Some((tu, ts)) = parse_stat_ticks(&text) {
            u += tu;
            s += ts;
        }
    }
    let ticks = |t: u64| Duration::from_nanos(t.saturating_mul(1_000_000_000 / hz));
    Ok(CpuTimes {
        user: ticks(u),
        sys: ticks(s),
        ctx: 0,
        sleeps: 0,
    })
}

/// CPU time of one server thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadCpu {
    /// Kernel thread id.
    pub tid: u32,
    /// Thread name (`comm`), e.g. `vqblk-iot0` or qemu-storage-daemon's `IO iot0`.
    pub name: String,
    /// User + system time.
    pub cpu: Duration,
    /// Time it was runnable but waited for a CPU (the scheduler's run delay,
    /// `/proc/PID/task/TID/schedstat`; zero where the kernel has no
    /// schedstats). A thread that served slowly while using little CPU
    /// either slept or waited here.
    pub wait: Duration,
    /// The CPU it last ran on when read (`processor` in its `stat`): where an
    /// unpinned thread was placed, e.g. on the CPU that takes a disk's
    /// interrupts.
    pub last_cpu: Option<u32>,
}

/// The run delay (second field, ns) of a `schedstat` line.
fn parse_schedstat_wait(line: &str) -> Option<Duration> {
    line.split_ascii_whitespace()
        .nth(1)?
        .parse()
        .ok()
        .map(Duration::from_nanos)
}

/// utime + stime of every thread of process `pid`, by thread. Threads that exit
/// while this reads are skipped.
pub fn server_thread_times(pid: u32) -> Vec<ThreadCpu> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let (Ok(stat), Ok(comm)) = (
            std::fs::read_to_string(e.path().join("stat")),
            std::fs::read_to_string(e.path().join("comm")),
        ) else {
            continue;
        };
        let wait = std::fs::read_to_string(e.path().join("schedstat"))
            .ok()
            .and_then(|l| parse_schedstat_wait(&l))
            .unwrap_or_default();
        if let Some((u, s)) = parse_stat_ticks(&stat) {
            out.push(ThreadCpu {
                tid,
                name: comm.trim_end().to_string(),
                cpu: Duration::from_nanos((u + s).saturating_mul(1_000_000_000 / hz)),
                wait,
                last_cpu: parse_stat_processor(&stat),
            });
        }
    }
    out.sort_by_key(|t| t.tid);
    out
}

/// Per-thread CPU used and run delay between two snapshots (threads present
/// in `after`).
pub fn thread_delta(before: &[ThreadCpu], after: &[ThreadCpu]) -> Vec<ThreadCpu> {
    after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.tid == a.tid);
            let (cpu, wait) = b.map_or((Duration::ZERO, Duration::ZERO), |b| (b.cpu, b.wait));
            ThreadCpu {
                tid: a.tid,
                name: a.name.clone(),
                cpu: a.cpu.saturating_sub(cpu),
                wait: a.wait.saturating_sub(wait),
                last_cpu: a.last_cpu,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_comm() {
        let line = "1234 (qemu (x) y) S 1 1234 1234 0 -1 4194560 100 0 0 0 57 43 0 0 20 0 4 0";
        assert_eq!(parse_stat_ticks(line), Some((57, 43)));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn the_cpu_a_thread_last_ran_on() {
        // A real line (processor 1), with a comm that holds parentheses.
        let line = "1927 (qemu (x) y) R 1925 1925 24920 0 -1 4194304 100 0 0 0 0 0 0 0 20 0 1 0 \
                    8897099 3133440 396 18446744073709551615 93838017667072 93838017686953 \
                    140737339026832 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 93838017702960 \
                    93838017704576 93838047064064 140737339034336 140737339034356 \
                    140737339034356 140737339035627 0";
        assert_eq!(parse_stat_processor(line), Some(1));
        assert_eq!(parse_stat_processor("1 (x) S 1 2 3"), None);
        // This thread, pinned: the CPU it runs on.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu = cpus - 1;
        // SAFETY: a zeroed cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` is below the host's CPU count, within the set's bits.
        unsafe { libc::CPU_SET(cpu, &mut set) };
        // SAFETY: the set outlives the call, whose size argument is its own.
        let pinned = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) } == 0;
        if pinned {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            let me = server_thread_times(std::process::id())
                .into_iter()
                .find(|t| t.tid == tid as u32)
                .expect("this thread is listed");
            assert_eq!(me.last_cpu, Some(cpu as u32));
        }
    }

    #[test]
    fn schedstat_run_delay() {
        assert_eq!(
            parse_schedstat_wait("5012345 2500000 17\n"),
            Some(Duration::from_micros(2500))
        );
        assert_eq!(parse_schedstat_wait("5012345"), None);
    }

    #[test]
    fn thread_times_name_our_threads() {
        let t = server_thread_times(std::process::id());
        assert!(!t.is_empty());
        let d = thread_delta(&t, &t);
        assert!(d
            .iter()
            .all(|x| x.cpu == Duration::ZERO && x.wait == Duration::ZERO));
        assert!(server_thread_times(u32::MAX).is_empty());
    }

    #[test]
    fn own_process_is_readable() {
        let t = server_times(std::process::id()).unwrap();
        let _ = t.total();
        assert!(server_times(u32::MAX).is_err());
    }
}
