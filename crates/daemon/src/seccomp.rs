//! seccomp filters per thread kind, as Cloud Hypervisor and Firecracker install them.
//!
//! A thread installs its own filter once its setup is done (io_uring, epoll, eventfds,
//! worker threads), so the filter allows only what the thread does while serving:
//!
//! | kind | thread | may, beyond the common set |
//! |---|---|---|
//! | [`ThreadKind::Control`] | `vqblk-ctl<E>`: one export's vhost-user messages | accept, send and receive on unix sockets (with fds), map and check guest memory (`fstat`, `fcntl` for memfd seals), eventfds, create the inflight region (`memfd_create`, `ftruncate`) |
//! | [`ThreadKind::Rpc`] | `vqblk-rpc`: the JSON-RPC control socket | the control set, plus what `export-add` / `export-del` take: open an image (`openat`, block-size ioctls), bind its socket (`socket`, `connect`, `bind`, `listen`, `chmod`, `mkdir`, `unlink`), start its thread (`clone3`...), `fdatasync` |
//! | [`ThreadKind::IoThread`] | `vqblk-iot<N>` | epoll, io_uring, eventfds and timerfds, synchronous file I/O fallbacks; `fcntl` only as F_GETFD (std asks it when a debug build closes an fd) |
//! | [`ThreadKind::Worker`] | `vqblk-iot<N>-w<K>` (backend `threads`) | positional vectored I/O, `fallocate`, `fdatasync` |
//! | [`ThreadKind::Metrics`] | `vqblk-metrics` and the HTTP server's threads it starts | accept and answer TCP connections on the listening socket it was given, start threads |
//! | [`ThreadKind::Tune`] | `vqblk-tune` (`--iothreads auto`) | nothing: it reads counters and thread CPU clocks, and moves queues by sending IOThreads a command and waking them (an eventfd `write`) |
//! | [`ThreadKind::Shares`] | `vqblk-shares` (reservations and weights) | `fstat` of the open disks (their backing device); it reads counters and sets caps as the tuner moves queues |
//!
//! The common set is what any Rust thread needs to run and log: memory management,
//! futexes, signals' own bookkeeping, clocks, `write` to stderr, `close`, exit; it
//! includes what the fault handler of `crate::fault` does (`mmap`, `write` to an
//! eventfd, `rt_sigreturn`, `sigaltstack`), and `rt_sigaction` for SIGBUS and SIGSEGV
//! only (a fault outside frontend memory restores their default action). Apart
//! from the control socket's thread (which adds exports at an operator's request),
//! nothing opens a path or creates a socket once a filter is on, and no thread
//! executes a program or changes credentials. The lists come from tracing the test suite (`strace -f -ff`, per
//! thread name) and reading the code paths; `--seccomp log` lets an operator find a
//! missing entry without a crash (the kernel logs the call, see `dmesg` / the audit log).
//!
//! With `--seccomp on` (the default) a forbidden call raises `SIGSYS`; the handler
//! prints the thread kind and the system call (name and number) on stderr, where the
//! log goes, and ends the process
//! (`_exit(159)`): a thread that does something it never does on its own is taken to be
//! subverted, and continuing would be worse than stopping.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Once;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use serde::{Deserialize, Serialize};
use syscalls::Sysno;
use vmm_sys_util::signal;

/// Whether and how seccomp filters are installed (`--seccomp`, `seccomp =` in TOML).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SeccompMode {
    /// Install the filters; a forbidden system call ends the process with a message.
    #[default]
    On,
    /// Install the filters in log mode: forbidden calls are allowed and logged by the kernel.
    Log,
    /// No filters.
    Off,
}

/// The kinds of thread that get a filter of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    /// A per-export control thread: accepts the frontend and handles its messages.
    Control,
    /// The JSON-RPC control socket's thread (`vqblk-rpc`): serves operators'
    /// requests, opens and removes exports at run time.
    Rpc,
    /// An IOThread's event loop.
    IoThread,
    /// A blocking worker of the `threads` backend.
    Worker,
    /// The Prometheus metrics thread (`--metrics`) and tiny_http's accept and
    /// connection threads, which it starts under its filter.
    Metrics,
    /// The IOThread pool's controller (`vqblk-tune`, `--iothreads auto`).
    Tune,
    /// The share allocator (`vqblk-shares`: reservations and weights).
    Shares,
}

impl ThreadKind {
    /// Every kind of filtered thread.
    pub const ALL: [ThreadKind; 7] = [
        ThreadKind::Control,
        ThreadKind::Rpc,
        ThreadKind::IoThread,
        ThreadKind::Worker,
        ThreadKind::Metrics,
        ThreadKind::Tune,
        ThreadKind::Shares,
    ];
}

/// A filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// seccompiler refused the rules (a bug here) or the kernel refused the filter.
    #[error("seccomp filter for {kind:?} threads: {source}")]
    Filter {
        /// The thread kind whose filter failed.
        kind: ThreadKind,
        /// What went wrong.
        source: seccompiler::Error,
    },
    /// The architecture has no system call table here.
    #[error("seccomp: unsupported architecture {0}")]
    Arch(&'static str),
}

/// What every thread needs: memory, futexes, signals' bookkeeping, clocks, logging, exit.
const COMMON: &[libc::c_long] = &[
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_futex,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_yield,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_getrandom,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// A control thread: the vhost-user conversation with one frontend (and
/// `ioctl(FIONREAD)` only, see [`program`]), and an upgrade's handover of it
/// to a successor (`daemon::handover`: `accept4` on the handover socket,
/// `getsockopt(SO_PEERCRED)`, `sendmsg` with `SCM_RIGHTS`), which needs no
/// call beyond the conversation's.
const CONTROL: &[libc::c_long] = &[
    libc::SYS_accept4,
    libc::SYS_getsockopt,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_read,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_fcntl,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_lseek,
    libc::SYS_eventfd2,
    libc::SYS_shutdown,
    // GET_INFLIGHT_FD: the inflight region is a memfd sized with ftruncate.
    libc::SYS_memfd_create,
    libc::SYS_ftruncate,
];

/// The JSON-RPC thread, beyond [`CONTROL`] (it serves clients on a unix
/// socket the same way): `export-add` opens an image (`openat`, the block
/// device size ioctls, see [`program`]), binds the export's socket (`socket`,
/// `connect` to detect a live one, `bind`, `listen`, `fchmodat`, `mkdirat`,
/// `unlinkat` of a stale one) and starts its control thread (`clone3` and
/// what a new thread does to itself, `seccomp` for its own narrower filter);
/// `export-del` fdatasyncs the image and unlinks the socket; answers read
/// `/proc/self/task/TID/stat` for CPU time (`openat`); client sockets get a
/// send timeout (`setsockopt`); the added export's handover socket is bound
/// once the daemon knows its own uid (`geteuid`, asked once per process).
const RPC: &[libc::c_long] = &[
    libc::SYS_openat,
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_setsockopt,
    libc::SYS_fchmodat,
    libc::SYS_mkdirat,
    libc::SYS_unlinkat,
    libc::SYS_clone3,
    libc::SYS_clone,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
    libc::SYS_seccomp,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    libc::SYS_geteuid,
    // glibc's chmod, mkdir and unlink use the old calls where they exist.
    #[cfg(target_arch = "x86_64")]
    libc::SYS_chmod,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_mkdir,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_unlink,
];

/// An IOThread: its event loop, io_uring, eventfds and timers. Backends are
/// created on first use (io_uring_setup, a worker pool's threads: clone3 and
/// what a new thread does to itself); a worker inherits this filter and adds
/// its own.
const IOTHREAD: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_epoll_create1,
    libc::SYS_io_uring_setup,
    libc::SYS_clone3,
    libc::SYS_clone,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
    // A worker adds its own, narrower filter (filters only ever narrow).
    libc::SYS_seccomp,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_epoll_ctl,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_fallocate,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    libc::SYS_getrusage,
];

/// A worker of the `threads` backend: blocking file I/O.
const WORKER: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_fallocate,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
];

/// The metrics HTTP server: accept on the socket bound before the filter
/// (`getsockname` for its address), read requests and send responses on the
/// accepted connections (`fcntl` F_DUPFD_CLOEXEC: tiny_http keeps a read and a
/// write handle; `getpeername`, `shutdown`), and start its threads (`clone3` and
/// what a new thread does to itself). IOThread CPU time is read with
/// `clock_gettime` on their thread CPU clocks (common set), not from /proc:
/// no file is opened.
const METRICS: &[libc::c_long] = &[
    libc::SYS_accept4,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_recvfrom,
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_sendto,
    libc::SYS_fcntl,
    libc::SYS_shutdown,
    libc::SYS_clone3,
    libc::SYS_clone,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
];

/// The IOThread pool's controller: the common set is all it needs. Its
/// samples are atomic counters and `clock_gettime` on the IOThreads' CPU
/// clocks; a queue move is a command on an IOThread's channel (futex), an
/// eventfd `write` that wakes it, and a wait for its reply (futex with a
/// timeout). It opens nothing: the disks' interrupt CPUs are looked up by
/// the thread that starts or adds an export.
const TUNE: &[libc::c_long] = &[];

/// The share allocator, beyond the common set: what the tuner does (atomic
/// counters; a cap change is a command on an IOThread's channel and an
/// eventfd `write`), and `fstat` of each open disk, to group exports by the
/// device behind them (`File::metadata`: `statx` with `AT_EMPTY_PATH`, or
/// `fstat` / `newfstatat` where the C library takes that way). It opens
/// nothing.
const SHARES: &[libc::c_long] = &[libc::SYS_statx, libc::SYS_fstat, libc::SYS_newfstatat];

fn target_arch() -> Result<TargetArch, SeccompError> {
    match std::env::consts::ARCH {
        "x86_64" => Ok(TargetArch::x86_64),
        "aarch64" => Ok(TargetArch::aarch64),
        "riscv64" => Ok(TargetArch::riscv64),
        other => Err(SeccompError::Arch(other)),
    }
}

/// The system calls a thread of `kind` may make.
pub fn allowed(kind: ThreadKind) -> Vec<libc::c_long> {
    let own = match kind {
        ThreadKind::Control => CONTROL,
        ThreadKind::Rpc => RPC,
        ThreadKind::IoThread => IOTHREAD,
        ThreadKind::Worker => WORKER,
        ThreadKind::Metrics => METRICS,
        ThreadKind::Tune => TUNE,
        ThreadKind::Shares => SHARES,
    };
    // The RPC thread serves its clients as a control thread serves a frontend.
    let base: &[libc::c_long] = if kind == ThreadKind::Rpc {
        CONTROL
    } else {
        &[]
    };
    let mut all: Vec<libc::c_long> = COMMON.iter().chain(base).chain(own).copied().collect();
    all.sort_unstable();
    all.dedup();
    all
}

/// Calls a filtered thread may not make but that glibc makes on its own, in
/// whichever thread gets there first, and does without when they fail: they
/// fail with EACCES instead of stopping the process.
///
/// `openat`: glibc's malloc reads `/proc/sys/vm/overcommit_memory` the first
/// time any thread shrinks a heap of its arena (on a `free`, or when the
/// thread exits and its cache goes back), once per process. An IOThread that
/// got there first stopped the daemon with SIGSYS (tests/polling.rs, seen
/// once an IOThread reserved its in-flight tables at attach). When the open
/// fails glibc releases the memory with madvise instead of a new mapping.
pub const REFUSED_QUIETLY: [libc::c_long; 1] = [libc::SYS_openat];

/// The filters of `kind`, in the order to install them: the quiet refusals
/// of [`REFUSED_QUIETLY`] the kind does not allow (EACCES; everything else
/// passes), then the kind's own filter, taking `mismatch` for any call not
/// in [`allowed`]. The kernel applies the strictest answer of all filters,
/// so a quietly refused call is let through by the second and refused by
/// the first. The first one also lets the second be installed (`prctl`,
/// `seccomp`).
pub fn programs(
    kind: ThreadKind,
    mismatch: SeccompAction,
) -> Result<Vec<BpfProgram>, SeccompError> {
    let own = allowed(kind);
    let quiet: BTreeMap<i64, Vec<SeccompRule>> = REFUSED_QUIETLY
        .iter()
        .filter(|nr| !own.contains(nr))
        .map(|&nr| (nr, vec![]))
        .collect();
    let mut out = Vec::new();
    if !quiet.is_empty() {
        let refusal = SeccompAction::Errno(libc::EACCES as u32);
        out.push(compile(kind, quiet, SeccompAction::Allow, refusal)?);
    }
    out.push(program(kind, mismatch)?);
    Ok(out)
}

/// Compiles the kind's own filter (see [`programs`]).
fn program(kind: ThreadKind, mismatch: SeccompAction) -> Result<BpfProgram, SeccompError> {
    // The quiet refusals pass here: the filter installed before this one
    // answers them.
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = allowed(kind)
        .into_iter()
        .chain(REFUSED_QUIETLY)
        .map(|nr| (nr, vec![]))
        .collect();
    // ioctl only as FIONREAD (how many bytes of a message have arrived) and,
    // for the RPC thread's export-add, the size queries of a block device.
    let ioctls: Vec<libc::c_ulong> = match kind {
        ThreadKind::Control => vec![libc::FIONREAD],
        ThreadKind::Rpc => vec![
            libc::FIONREAD,
            crate::blkdev::ioctl::BLKGETSIZE64(),
            crate::blkdev::ioctl::BLKSSZGET(),
        ],
        _ => vec![],
    };
    // A call allowed only when its second argument (the ioctl request, the
    // fcntl command) is one of `values`.
    let second_arg_in = |values: &[u64]| -> Result<Vec<SeccompRule>, SeccompError> {
        values
            .iter()
            .map(|&v| {
                SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, v)
                    .and_then(|c| SeccompRule::new(vec![c]))
                    .map_err(backend(kind))
            })
            .collect()
    };
    if !ioctls.is_empty() {
        rules.insert(libc::SYS_ioctl, second_arg_in(&ioctls)?);
    }
    // sigaction for SIGBUS and SIGSEGV only, in every kind: a fault outside
    // frontend memory restores their default action before it ends the
    // process (`crate::fault`, and Rust's stack-overflow handler it defers
    // to); without this the restore itself would be the forbidden call and
    // the fault would be reported as a seccomp violation.
    let fault_signals = [libc::SIGBUS as u64, libc::SIGSEGV as u64]
        .iter()
        .map(|&sig| {
            SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, sig)
                .and_then(|c| SeccompRule::new(vec![c]))
                .map_err(backend(kind))
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_rt_sigaction, fault_signals);
    // fcntl, where a kind has no use for it, only as F_GETFD: Rust's std asks
    // it of every fd an `OwnedFd` closes in debug builds (a double-close
    // check), and an IOThread closes a detached queue's kick and call fds. It
    // reads the close-on-exec flag and nothing else.
    if let std::collections::btree_map::Entry::Vacant(e) = rules.entry(libc::SYS_fcntl) {
        e.insert(second_arg_in(&[libc::F_GETFD as u64])?);
    }
    compile(kind, rules, mismatch, SeccompAction::Allow)
}

/// Compiles a filter of `kind` that answers the calls in `rules` (whose
/// arguments match) with `matched` and every other call with `mismatch`.
fn compile(
    kind: ThreadKind,
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    SeccompFilter::new(rules, mismatch, matched, target_arch()?)
        .map_err(backend(kind))?
        .try_into()
        .map_err(backend(kind))
}

/// seccompiler's backend error, as a filter error of `kind`.
fn backend(kind: ThreadKind) -> impl Fn(seccompiler::BackendError) -> SeccompError {
    move |e| SeccompError::Filter {
        kind,
        source: seccompiler::Error::Backend(e),
    }
}

/// Installs the filter of `kind` on the calling thread (and the threads it starts later).
///
/// Every daemon thread that may touch frontend memory calls this at setup,
/// whatever the mode, so it is also where such a thread gets its alternate
/// signal stack for the fault handler ([`crate::fault::ensure_alt_stack`]).
pub fn apply(kind: ThreadKind, mode: SeccompMode) -> Result<(), SeccompError> {
    if let Err(e) = crate::fault::ensure_alt_stack() {
        log::warn!("no alternate signal stack for a {kind:?} thread: {e}");
    }
    let mismatch = match mode {
        SeccompMode::Off => return Ok(()),
        SeccompMode::Log => SeccompAction::Log,
        SeccompMode::On => {
            install_sigsys_handler();
            SeccompAction::Trap
        }
    };
    let progs = programs(kind, mismatch)?;
    install_panic_hook();
    KIND.with(|k| k.set(Some(kind)));
    block_handled_signals();
    install(kind, &progs)?;
    log::debug!("seccomp: {kind:?} filter installed ({mode:?})");
    Ok(())
}

/// Installs `progs` (the filters of `kind`, from [`programs`]) on the calling
/// thread, in order.
fn install(kind: ThreadKind, progs: &[BpfProgram]) -> Result<(), SeccompError> {
    for prog in progs {
        seccompiler::apply_filter(prog).map_err(|source| SeccompError::Filter { kind, source })?;
    }
    Ok(())
}

/// Checks that the filters of `mode` can be installed on this host, in a
/// short-lived thread (the caller's thread stays unfiltered).
pub fn probe(mode: SeccompMode) -> Result<(), SeccompError> {
    if mode == SeccompMode::Off {
        return Ok(());
    }
    fix_malloc_arena_limit();
    for kind in ThreadKind::ALL {
        programs(kind, SeccompAction::Log)?;
    }
    std::thread::spawn(move || {
        let kind = ThreadKind::IoThread;
        install(kind, &programs(kind, SeccompAction::Log)?)
    })
    .join()
    .unwrap_or(Err(SeccompError::Arch("probe thread panicked")))
}

/// glibc's malloc gives each new thread an arena; when their number first
/// passes 8 it sizes its arena limit from the number of online CPUs, which it
/// reads from `/sys/devices/system/cpu/online`. If a filtered thread is the one
/// that crosses the line (the metrics server's threads make it likely), its
/// `openat` is refused ([`REFUSED_QUIETLY`]) and glibc would size the limit
/// without the file. Setting the
/// limit up front, to the value glibc would compute (8 per online CPU), keeps
/// malloc's behaviour and takes the file read out of filtered threads. An
/// operator's own `MALLOC_ARENA_MAX` or tunable wins.
fn fix_malloc_arena_limit() {
    #[cfg(target_env = "gnu")]
    {
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        if std::env::var_os("MALLOC_ARENA_MAX").is_some() || tunables.contains("arena_max") {
            return;
        }
        // SAFETY: sysconf and mallopt have no memory-safety preconditions;
        // mallopt(M_ARENA_MAX) only sets a limit malloc reads under its lock.
        unsafe {
            let cpus = libc::sysconf(libc::_SC_NPROCESSORS_ONLN).clamp(1, 1 << 20) as libc::c_int;
            libc::mallopt(libc::M_ARENA_MAX, 8 * cpus);
        }
    }
}

thread_local! {
    /// The kind of the filter this thread installed (None: none), for the
    /// SIGSYS handler. Const-initialised, no destructor: reading it from a
    /// signal handler allocates nothing.
    static KIND: Cell<Option<ThreadKind>> = const { Cell::new(None) };
}

/// Offset of `si_syscall` in a SIGSYS `siginfo_t` on 64-bit Linux: three `int`s and
/// padding (16 bytes), then `_sigsys { void *_call_addr; int _syscall; ... }`.
const SI_SYSCALL_OFFSET: usize = 24;

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a SIGSYS handler a valid siginfo_t of the SIGSYS layout
    // (installed with SA_SIGINFO), which is at least 128 bytes long; the int at offset 24
    // is `si_syscall` on the 64-bit Linux ABIs this module supports.
    let nr = unsafe {
        (info as *const u8)
            .add(SI_SYSCALL_OFFSET)
            .cast::<i32>()
            .read_unaligned()
    };
    let mut buf = [0u8; 192];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        let n = bytes.len().min(buf.len() - len);
        buf[len..len + n].copy_from_slice(&bytes[..n]);
        len += n;
    };
    put(b"vqblk: seccomp: forbidden system call ");
    // The name comes from a static table (no allocation, no system call).
    let name = usize::try_from(nr).ok().and_then(Sysno::new);
    if let Some(name) = name {
        put(name.name().as_bytes());
        put(b" (");
    }
    let mut digits = [0u8; 12];
    let mut i = digits.len();
    let mut v = nr.unsigned_abs();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    put(&digits[i..]);
    if name.is_some() {
        put(b")");
    }
    // The kind was recorded when the filter went on: asking the kernel for the
    // thread's name (prctl) may itself be forbidden, and a second SIGSYS inside
    // this handler would kill the process without a word.
    put(b" in a thread of kind ");
    put(match KIND.with(Cell::get) {
        Some(ThreadKind::Control) => b"control",
        Some(ThreadKind::Rpc) => b"control-socket",
        Some(ThreadKind::IoThread) => b"IOThread",
        Some(ThreadKind::Worker) => b"worker",
        Some(ThreadKind::Metrics) => b"metrics",
        Some(ThreadKind::Tune) => b"tuning",
        Some(ThreadKind::Shares) => b"shares",
        None => b"daemon",
    });
    put(b"; stopping (--seccomp log lets the kernel log such calls instead)\n");
    // SAFETY: write(2) and _exit(2) are async-signal-safe and both are in every thread's
    // allowed set; the buffer is valid for `len` bytes.
    unsafe {
        libc::write(2, buf.as_ptr().cast(), len);
        libc::_exit(159);
    }
}

/// A panic in a filtered thread must still say what happened: the default
/// hook may capture a backtrace (RUST_BACKTRACE), which opens files the filter
/// forbids, and the SIGSYS would end the process before the message is out.
/// In filtered threads the message is printed without a backtrace.
fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if KIND.with(Cell::get).is_none() {
                return default(info);
            }
            let t = std::thread::current();
            eprintln!(
                "vqblk: thread {} panicked: {info} (no backtrace under seccomp; \
                 run with --seccomp off for one)",
                t.name().unwrap_or("?")
            );
        }));
    });
}

/// The signals the daemon handles (`vqblk serve`'s signal iterator):
/// stop, stop, write the statistics file.
pub const HANDLED_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1];

/// Blocks [`HANDLED_SIGNALS`] in the calling thread (and the threads it
/// starts later), so that the kernel delivers them to an unfiltered thread
/// (the main thread) instead. Their handler (signal-hook's) wakes the main
/// thread with a `sendto`, which no filter allows: delivered to an
/// IOThread, a SIGTERM stopped the daemon with SIGSYS (tests/metrics.rs
/// saw it once; the kernel prefers the main thread, but not always).
fn block_handled_signals() {
    for sig in HANDLED_SIGNALS {
        match signal::block_signal(sig) {
            // Threads a filtered thread starts inherit its mask.
            Ok(()) | Err(signal::Error::SignalAlreadyBlocked(_)) => {}
            Err(e) => log::warn!("seccomp: cannot block signal {sig} in a filtered thread: {e}"),
        }
    }
}

fn install_sigsys_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid starting value; the handler only makes
        // async-signal-safe calls (write, _exit) on stack buffers.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigsys as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
                log::warn!(
                    "seccomp: cannot install the SIGSYS handler: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Runs `f` in a fresh thread under `kind`'s filter, with forbidden calls failing
    /// with EPERM instead of stopping the test process.
    fn under_filter<T: Send + 'static>(
        kind: ThreadKind,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        std::thread::spawn(move || {
            install(
                kind,
                &programs(kind, SeccompAction::Errno(libc::EPERM as u32)).unwrap(),
            )
            .unwrap();
            f()
        })
        .join()
        .unwrap()
    }

    /// Every kind but the control socket's thread, the one that may open
    /// images and create sockets.
    fn all_but_rpc() -> impl Iterator<Item = ThreadKind> {
        ThreadKind::ALL
            .into_iter()
            .filter(|&k| k != ThreadKind::Rpc)
    }

    fn socket_errno() -> i32 {
        // SAFETY: socket(2) with constant arguments; the fd, if any, is closed at once.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        if fd >= 0 {
            // SAFETY: fd was just returned by socket(2) and is owned here.
            unsafe { libc::close(fd) };
            return 0;
        }
        std::io::Error::last_os_error().raw_os_error().unwrap()
    }

    /// Set for the child process of `a_forbidden_call_is_named_before_the_process_ends`.
    const CHILD: &str = "VQBLK_SECCOMP_TEST_CHILD";

    /// Makes a forbidden call under the IOThread filter with the production
    /// action (SIGSYS): the process ends. Run only as the child below.
    #[test]
    #[ignore = "run in a child process by a_forbidden_call_is_named_before_the_process_ends"]
    fn forbidden_call_in_a_child() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        std::thread::spawn(|| {
            apply(ThreadKind::IoThread, SeccompMode::On).unwrap();
            socket_errno()
        })
        .join()
        .unwrap();
        unreachable!("the forbidden call returned");
    }

    /// Runs the ignored unit test `test` (its full path) alone in a child
    /// process of this test binary with `env` set, for tests of what ends a
    /// process (a filter's SIGSYS, a fatal fault); its output.
    pub(crate) fn run_in_child(test: &str, env: &str) -> std::process::Output {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(env, "1")
            .output()
            .unwrap()
    }

    #[test]
    fn a_forbidden_call_is_named_before_the_process_ends() {
        let out = run_in_child("seccomp::tests::forbidden_call_in_a_child", CHILD);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(159), "{err}");
        assert!(
            err.contains(
                "vqblk: seccomp: forbidden system call socket (41) in a thread of kind IOThread; stopping"
            ),
            "{err}"
        );
    }

    #[test]
    fn no_thread_kind_may_open_files_sockets_or_exec() {
        for kind in all_but_rpc() {
            let a = allowed(kind);
            for nr in [
                libc::SYS_socket,
                libc::SYS_connect,
                libc::SYS_open,
                libc::SYS_openat,
                libc::SYS_execve,
                libc::SYS_execveat,
                libc::SYS_ptrace,
                libc::SYS_setuid,
                libc::SYS_mount,
                libc::SYS_fork,
                libc::SYS_unlink,
                libc::SYS_ioctl,
            ] {
                assert!(!a.contains(&nr), "{kind:?} allows {nr}");
            }
        }
    }

    /// The control socket's thread may manage exports (open images, bind
    /// sockets) but never execute, trace, change credentials or mount.
    #[test]
    fn the_rpc_thread_may_not_exec_or_change_credentials() {
        let a = allowed(ThreadKind::Rpc);
        for nr in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_setuid,
            libc::SYS_mount,
            libc::SYS_fork,
            libc::SYS_io_uring_setup,
        ] {
            assert!(!a.contains(&nr), "Rpc allows {nr}");
        }
        assert!(allowed(ThreadKind::Control).iter().all(|nr| a.contains(nr)));
    }

    #[test]
    fn a_forbidden_call_is_refused_and_allowed_ones_still_work() {
        for kind in all_but_rpc() {
            let (sock, file, write_ok) = under_filter(kind, || {
                let sock = socket_errno();
                let file = std::fs::File::open("/proc/self/status")
                    .err()
                    .and_then(|e| e.raw_os_error());
                // SAFETY: writes zero bytes to stderr; only the return value is looked at.
                let w = unsafe { libc::write(2, b"".as_ptr().cast(), 0) };
                (sock, file, w == 0)
            });
            assert_eq!(sock, libc::EPERM, "{kind:?}: socket");
            // Refused quietly (`REFUSED_QUIETLY`), not by the mismatch action.
            assert_eq!(file, Some(libc::EACCES), "{kind:?}: open");
            assert!(write_ok, "{kind:?}: write");
        }
        // Without a filter the same calls succeed: the test can tell the difference.
        assert_eq!(socket_errno(), 0);
    }

    #[test]
    fn the_iothread_filter_keeps_its_event_loop_calls() {
        let ok = under_filter(ThreadKind::IoThread, || {
            let efd = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
            efd.write(1).unwrap();
            let ep = vmm_sys_util::epoll::Epoll::new().is_ok();
            let ring = io_uring::IoUring::new(8).is_ok();
            (efd.read().unwrap(), ep, ring)
        });
        assert_eq!(ok, (1, true, true));
    }

    /// Rust's std, in debug builds, asks F_GETFD of every fd an `OwnedFd`
    /// closes: an IOThread dropping a detached queue's eventfds must not be
    /// stopped by its filter for that. Other fcntl commands stay refused.
    #[test]
    fn iothreads_and_workers_may_fcntl_getfd_only() {
        for kind in [ThreadKind::IoThread, ThreadKind::Worker] {
            let efd = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
            let (getfd, setfl) = under_filter(kind, move || {
                let fd = std::os::fd::AsRawFd::as_raw_fd(&efd);
                // SAFETY: fcntl on an fd owned by `efd`, which outlives both calls.
                let getfd = unsafe { libc::fcntl(fd, libc::F_GETFD) };
                // SAFETY: as above; refused by the filter before it runs.
                let r = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) };
                let e = std::io::Error::last_os_error().raw_os_error();
                drop(efd);
                (getfd, (r, e))
            });
            assert!(getfd >= 0, "{kind:?}: F_GETFD refused");
            assert_eq!(setfl, (-1, Some(libc::EPERM)), "{kind:?}: F_SETFL");
        }
    }

    /// glibc's malloc opens /proc/sys/vm/overcommit_memory in whichever
    /// thread first shrinks a heap: a filtered thread's open fails (EACCES)
    /// instead of stopping the process, and nothing is opened.
    #[test]
    fn filtered_threads_are_refused_open_quietly() {
        for kind in [
            ThreadKind::Control,
            ThreadKind::IoThread,
            ThreadKind::Worker,
            ThreadKind::Metrics,
        ] {
            let (r, e) = under_filter(kind, || {
                // SAFETY: open(2) of a constant NUL-terminated path; an fd,
                // if any, is closed at once.
                let fd = unsafe {
                    libc::open(
                        c"/proc/sys/vm/overcommit_memory".as_ptr(),
                        libc::O_RDONLY | libc::O_CLOEXEC,
                    )
                };
                let e = std::io::Error::last_os_error().raw_os_error();
                if fd >= 0 {
                    // SAFETY: fd was just opened here.
                    unsafe { libc::close(fd) };
                }
                (fd, e)
            });
            assert_eq!((r, e), (-1, Some(libc::EACCES)), "{kind:?}");
        }
        // The RPC thread opens images: not refused.
        let r = under_filter(ThreadKind::Rpc, || {
            std::fs::File::open("/proc/sys/vm/overcommit_memory").is_ok()
        });
        assert!(r, "the RPC thread may open files");
    }

    /// The same under the real action (SIGSYS for anything else): the open
    /// fails and the thread goes on. Without the quiet refusal the SIGSYS
    /// handler ends the test process (exit 159).
    #[test]
    fn an_iothread_survives_glibcs_open() {
        let r = std::thread::spawn(|| {
            apply(ThreadKind::IoThread, SeccompMode::On).unwrap();
            std::fs::File::open("/proc/sys/vm/overcommit_memory")
                .map_err(|e| e.raw_os_error())
                .map(drop)
        })
        .join()
        .unwrap();
        assert_eq!(r, Err(Some(libc::EACCES)));
    }

    /// A filtered thread blocks the signals the daemon handles: their
    /// handler's `sendto` would stop the process from there.
    #[test]
    fn filtered_threads_leave_the_handled_signals_to_the_main_thread() {
        let blocked = |apply_filter: bool| {
            std::thread::spawn(move || {
                if apply_filter {
                    apply(ThreadKind::IoThread, SeccompMode::On).unwrap();
                }
                let set = signal::get_blocked_signals().unwrap();
                HANDLED_SIGNALS.map(|sig| set.contains(&sig))
            })
            .join()
            .unwrap()
        };
        assert_eq!(blocked(true), [true; 3]);
        // The test can tell: an unfiltered thread blocks none of them.
        assert_eq!(blocked(false), [false; 3]);
    }

    #[test]
    fn the_control_thread_may_ioctl_fionread_only() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (fionread, tcgets) = under_filter(ThreadKind::Control, move || {
            let _b = b;
            let fd = std::os::fd::AsRawFd::as_raw_fd(&a);
            let mut n: libc::c_int = 0;
            // SAFETY: FIONREAD writes one int through the pointer, which points to `n`.
            let r1 = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
            let mut t = [0u8; 64];
            // SAFETY: TCGETS writes a termios (60 bytes) into the 64-byte buffer;
            // here it is refused before it runs.
            let r2 = unsafe { libc::ioctl(fd, libc::TCGETS, t.as_mut_ptr()) };
            let e2 = std::io::Error::last_os_error().raw_os_error();
            (r1, (r2, e2))
        });
        assert_eq!(fionread, 0);
        assert_eq!(tcgets, (-1, Some(libc::EPERM)));
    }

    /// What the memory fault handler does is allowed in every kind, and
    /// sigaction only for SIGBUS and SIGSEGV (`crate::fault`).
    #[test]
    fn every_kind_allows_what_the_fault_handler_does() {
        for kind in ThreadKind::ALL {
            let a = allowed(kind);
            for nr in [
                libc::SYS_mmap,
                libc::SYS_write,
                libc::SYS_rt_sigreturn,
                libc::SYS_sigaltstack,
                libc::SYS_tgkill,
            ] {
                assert!(a.contains(&nr), "{kind:?} refuses {nr}");
            }
            let query = |sig| {
                // SAFETY: sigaction with a null new action only reads the
                // current one into `old`.
                let r = unsafe {
                    let mut old: libc::sigaction = std::mem::zeroed();
                    libc::sigaction(sig, std::ptr::null(), &mut old)
                };
                (r, std::io::Error::last_os_error().raw_os_error())
            };
            let (bus, segv, usr2) = under_filter(kind, move || {
                (
                    query(libc::SIGBUS),
                    query(libc::SIGSEGV),
                    query(libc::SIGUSR2),
                )
            });
            assert_eq!((bus.0, segv.0), (0, 0), "{kind:?}");
            assert_eq!(
                usr2,
                (-1, Some(libc::EPERM)),
                "{kind:?}: sigaction(SIGUSR2)"
            );
        }
    }

    /// The controller of `--iothreads auto` reads counters and clocks and
    /// wakes IOThreads: nothing beyond what every thread may do, so neither
    /// what the control socket's thread may (open images, bind sockets,
    /// start threads) nor file or socket I/O.
    #[test]
    fn the_tuning_thread_may_do_only_what_every_thread_does() {
        let mut common = COMMON.to_vec();
        common.sort_unstable();
        assert_eq!(allowed(ThreadKind::Tune), common);
        for nr in [libc::SYS_read, libc::SYS_recvmsg, libc::SYS_fcntl] {
            assert!(!allowed(ThreadKind::Tune).contains(&nr), "{nr}");
        }
    }

    /// The share allocator stats the disks it already holds open and does
    /// what the tuner does: no reads, no sockets' or memfds' calls, nothing
    /// of the control threads' conversation with a frontend.
    #[test]
    fn the_share_allocator_may_only_stat_beyond_the_common_set() {
        let a = allowed(ThreadKind::Shares);
        let mut extra: Vec<_> = a.iter().filter(|nr| !COMMON.contains(nr)).collect();
        extra.sort_unstable();
        let mut want = vec![&libc::SYS_statx, &libc::SYS_fstat, &libc::SYS_newfstatat];
        want.sort_unstable();
        assert_eq!(extra, want);
        for nr in [
            libc::SYS_read,
            libc::SYS_recvmsg,
            libc::SYS_accept4,
            libc::SYS_memfd_create,
            libc::SYS_ftruncate,
        ] {
            assert!(!a.contains(&nr), "{nr}");
        }
        // The call it makes works under its filter.
        let f = std::fs::File::open("/proc/self/status").unwrap();
        let len = under_filter(ThreadKind::Shares, move || f.metadata().is_ok());
        assert!(len);
    }

    #[test]
    fn only_iothreads_may_start_threads() {
        for kind in [
            ThreadKind::Control,
            ThreadKind::Worker,
            ThreadKind::Tune,
            ThreadKind::Shares,
        ] {
            assert!(!allowed(kind).contains(&libc::SYS_clone3), "{kind:?}");
            assert!(!allowed(kind).contains(&libc::SYS_clone), "{kind:?}");
        }
    }

    #[test]
    fn off_installs_nothing() {
        let errno = std::thread::spawn(|| {
            apply(ThreadKind::Worker, SeccompMode::Off).unwrap();
            socket_errno()
        })
        .join()
        .unwrap();
        assert_eq!(errno, 0);
    }
}
