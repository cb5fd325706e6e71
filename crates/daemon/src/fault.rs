//! Faults in memory a frontend handed over end that frontend's connection,
//! never the process.
//!
//! Guest memory, the inflight region and the dirty log are files the
//! frontend passed by fd and the daemon maps shared. If the frontend shrinks
//! such a file after it was mapped (a file that cannot be sealed against
//! shrinking: a memfd without `MFD_ALLOW_SEALING`, a tmpfs or hugetlbfs file),
//! the daemon's next access to a page beyond the new end raises SIGBUS in
//! whichever thread made it (an IOThread parsing a request, a control thread
//! starting a ring). By default that would end the process and every export.
//!
//! So every such mapping is entered in a fixed registry ([`register`]) while
//! it is mapped, and a SIGBUS / SIGSEGV handler ([`install`]) looks the
//! faulting address up there. Found: it maps anonymous memory over the whole
//! mapping (same address and length, `MAP_FIXED`; the faulting access then
//! completes on zeros), marks the owning connection broken ([`FaultOwner`]),
//! wakes that connection's control thread, and returns. The connection is
//! then closed as on a disconnect, and requests on the broken memory fail
//! instead of completing as data. Not found: the previous handler (Rust's
//! stack-overflow reporter) runs, or the default action is restored and the
//! signal raised again, so a real crash ends the process as before.
//!
//! The handler may only make async-signal-safe calls (`mmap`, `write`,
//! `sigaction`, `raise`) and reads the registry without locks or allocation:
//! a static array of atomic slots, each guarded by a sequence count.

use std::cell::RefCell;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// What the daemon does with frontend memory that cannot be sealed against
/// shrinking (`--memory-sealing`, `memory-sealing =` in the TOML).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum MemorySealing {
    /// Refuse it: the message is refused and the frontend disconnected.
    Required,
    /// Seal what can be sealed; a truncation of the rest is caught by the
    /// fault handler and ends that connection only.
    #[default]
    Preferred,
}

/// Which of a connection's mappings a registry entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappingKind {
    /// A guest memory region (SET_MEM_TABLE, ADD_MEM_REG).
    GuestMemory,
    /// The inflight region (GET_INFLIGHT_FD, SET_INFLIGHT_FD).
    Inflight,
    /// The dirty log of a live migration (SET_LOG_BASE).
    DirtyLog,
}

impl MappingKind {
    fn code(self) -> usize {
        match self {
            MappingKind::GuestMemory => 1,
            MappingKind::Inflight => 2,
            MappingKind::DirtyLog => 3,
        }
    }

    fn from_code(code: usize) -> Option<MappingKind> {
        match code {
            1 => Some(MappingKind::GuestMemory),
            2 => Some(MappingKind::Inflight),
            3 => Some(MappingKind::DirtyLog),
            _ => None,
        }
    }

    /// Its name in log lines.
    pub fn name(self) -> &'static str {
        match self {
            MappingKind::GuestMemory => "guest memory",
            MappingKind::Inflight => "the inflight region",
            MappingKind::DirtyLog => "the dirty log",
        }
    }
}

/// A fault the handler caught in one of a connection's mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// SIGBUS or SIGSEGV.
    pub signal: i32,
    /// The faulting address.
    pub addr: usize,
    /// The mapping it lay in.
    pub kind: MappingKind,
    /// Start and length of that mapping (now anonymous memory).
    pub mapping: (usize, usize),
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sig = if self.signal == libc::SIGSEGV {
            "SIGSEGV"
        } else {
            "SIGBUS"
        };
        write!(
            f,
            "{sig} at {:#x} in {} (mapping {:#x}+{:#x}, now replaced by anonymous memory): \
             the frontend shrank or removed the file behind it",
            self.addr,
            self.kind.name(),
            self.mapping.0,
            self.mapping.1
        )
    }
}

/// One connection's side of the fault handler: whether a fault broke its
/// memory, what it was, and an eventfd that wakes its control thread.
/// Registry entries point to it; each [`Registration`] holds an `Arc` of it,
/// so it outlives every entry that names it.
#[derive(Debug)]
pub struct FaultOwner {
    broken: Arc<AtomicBool>,
    wake: Option<EventFd>,
    signal: AtomicI32,
    addr: AtomicUsize,
    kind: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
}

impl FaultOwner {
    /// A fresh owner, for a new connection.
    pub fn new() -> Arc<FaultOwner> {
        let wake = EventFd::new(EFD_NONBLOCK)
            .inspect_err(|e| {
                log::warn!(
                    "no eventfd for the fault handler ({e}): a fault in this connection's \
                     memory is noticed at its next message"
                )
            })
            .ok();
        Arc::new(FaultOwner {
            broken: Arc::new(AtomicBool::new(false)),
            wake,
            signal: AtomicI32::new(0),
            addr: AtomicUsize::new(0),
            kind: AtomicUsize::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
        })
    }

    /// The flag the handler sets, for the memory maps the IOThreads read
    /// (a request on broken memory fails).
    pub fn broken_flag(&self) -> Arc<AtomicBool> {
        self.broken.clone()
    }

    /// The eventfd the handler writes when it breaks this owner's memory.
    pub fn wake_fd(&self) -> Option<i32> {
        self.wake.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// The fault that broke this owner's memory, if one did.
    pub fn fault(&self) -> Option<Fault> {
        if !self.broken.load(Ordering::Acquire) {
            return None;
        }
        Some(Fault {
            signal: self.signal.load(Ordering::Relaxed),
            addr: self.addr.load(Ordering::Relaxed),
            kind: MappingKind::from_code(self.kind.load(Ordering::Relaxed))?,
            mapping: (
                self.start.load(Ordering::Relaxed),
                self.len.load(Ordering::Relaxed),
            ),
        })
    }

    /// Records a fault (called from the signal handler: atomics and one
    /// `write`, nothing else).
    fn record(&self, signal: i32, addr: usize, hit: &Entry) {
        self.signal.store(signal, Ordering::Relaxed);
        self.addr.store(addr, Ordering::Relaxed);
        self.kind.store(hit.kind, Ordering::Relaxed);
        self.start.store(hit.start, Ordering::Relaxed);
        self.len.store(hit.len, Ordering::Relaxed);
        self.broken.store(true, Ordering::Release);
        if let Some(fd) = self.wake_fd() {
            let one = 1u64;
            // SAFETY: write(2) is async-signal-safe; it reads 8 bytes from a
            // live stack value into an eventfd this owner keeps open.
            unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
        }
    }
}

/// Slots in the registry: a connection maps at most 509 guest memory
/// regions, an inflight region and a dirty log, and old maps live on while
/// requests hold them; 8192 covers 15 exports at the slot limit at once.
pub const SLOTS: usize = 8192;

/// The registry has no free slot: the mapping is refused (it could not be
/// protected).
#[derive(Debug, thiserror::Error)]
#[error("the fault handler's registry is full ({SLOTS} mappings)")]
pub struct RegistryFull;

/// One registry slot. `seq` is odd while the slot is being written; a reader
/// takes the fields only between two equal, even readings of it.
struct Slot {
    claimed: AtomicBool,
    seq: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    kind: AtomicUsize,
    owner: AtomicPtr<FaultOwner>,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            claimed: AtomicBool::new(false),
            seq: AtomicUsize::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            kind: AtomicUsize::new(0),
            owner: AtomicPtr::new(std::ptr::null_mut()),
        }
    }
}

/// What a lookup found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    start: usize,
    len: usize,
    kind: usize,
    owner: *const FaultOwner,
}

/// Mappings the handler may replace: a fixed array, written by the control
/// plane (under `claimed`, slot by slot) and read by the handler without a
/// lock.
struct Registry<const N: usize> {
    slots: [Slot; N],
}

impl<const N: usize> Registry<N> {
    const fn new() -> Self {
        Registry {
            slots: [const { Slot::new() }; N],
        }
    }

    /// Enters `[start, start + len)`; the index of its slot.
    fn insert(
        &self,
        start: usize,
        len: usize,
        kind: MappingKind,
        owner: *const FaultOwner,
    ) -> Result<usize, RegistryFull> {
        let i = self
            .slots
            .iter()
            .position(|s| {
                s.claimed
                    .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            })
            .ok_or(RegistryFull)?;
        let s = &self.slots[i];
        s.seq.fetch_add(1, Ordering::Relaxed); // odd: being written
        fence(Ordering::Release);
        s.start.store(start, Ordering::Relaxed);
        s.len.store(len, Ordering::Relaxed);
        s.kind.store(kind.code(), Ordering::Relaxed);
        s.owner.store(owner.cast_mut(), Ordering::Relaxed);
        s.seq.fetch_add(1, Ordering::Release); // even: readable
        Ok(i)
    }

    /// Empties slot `i` and gives it back.
    fn remove(&self, i: usize) {
        let s = &self.slots[i];
        s.seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        s.len.store(0, Ordering::Relaxed);
        s.owner.store(std::ptr::null_mut(), Ordering::Relaxed);
        s.seq.fetch_add(1, Ordering::Release);
        s.claimed.store(false, Ordering::Release);
    }

    /// The entry holding `addr` (async-signal-safe: loads only). A slot
    /// being written is skipped: the mapping that faulted is registered
    /// and in use by the faulting thread, so its slot is not changing.
    fn lookup(&self, addr: usize) -> Option<Entry> {
        self.slots.iter().find_map(|s| {
            let before = s.seq.load(Ordering::Acquire);
            if before % 2 == 1 {
                return None;
            }
            let e = Entry {
                start: s.start.load(Ordering::Relaxed),
                len: s.len.load(Ordering::Relaxed),
                kind: s.kind.load(Ordering::Relaxed),
                owner: s.owner.load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            let stable = s.seq.load(Ordering::Relaxed) == before;
            let inside = addr.wrapping_sub(e.start) < e.len;
            (stable && inside && !e.owner.is_null()).then_some(e)
        })
    }
}

static REGISTRY: Registry<SLOTS> = Registry::new();

/// A mapping's entry in the registry: removed when this is dropped.
///
/// Drop it *before* unmapping the mapping (the holders declare it ahead of
/// their `MmapRegion`, whose `Drop` unmaps: fields drop in declaration
/// order). The other order would leave, for a moment, an entry naming an
/// address range the kernel may hand to an unrelated mapping, whose genuine
/// fault the handler would then paper over with zeros. In this order a fault
/// in the short window between the two is not found and ends the process,
/// which is sound, and cannot happen anyway: nothing accesses a mapping
/// whose last holder is dropping it.
#[derive(Debug)]
pub struct Registration {
    slot: usize,
    /// Keeps the owner the entry points to alive while the entry exists.
    _owner: Arc<FaultOwner>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        REGISTRY.remove(self.slot);
    }
}

/// Enters the mapping `[start, start + len)` of `owner`'s connection in the
/// registry, until the returned [`Registration`] is dropped.
pub fn register(
    start: *const u8,
    len: usize,
    kind: MappingKind,
    owner: &Arc<FaultOwner>,
) -> Result<Registration, RegistryFull> {
    let slot = REGISTRY.insert(start as usize, len, kind, Arc::as_ptr(owner))?;
    Ok(Registration {
        slot,
        _owner: owner.clone(),
    })
}

/// The handlers that were in place before [`install`] (Rust's stack
/// overflow reporter, normally), for the faults that are not ours.
static PREVIOUS: [OnceLock<libc::sigaction>; 2] = [OnceLock::new(), OnceLock::new()];

fn previous(sig: libc::c_int) -> Option<&'static libc::sigaction> {
    match sig {
        libc::SIGBUS => PREVIOUS[0].get(),
        libc::SIGSEGV => PREVIOUS[1].get(),
        _ => None,
    }
}

/// Installs the SIGBUS and SIGSEGV handler, once per process, before any
/// thread installs a seccomp filter (a filter does not allow `sigaction` for
/// other signals).
pub fn install() -> io::Result<()> {
    static DONE: OnceLock<Result<(), i32>> = OnceLock::new();
    let r = DONE.get_or_init(|| {
        for (i, sig) in [libc::SIGBUS, libc::SIGSEGV].into_iter().enumerate() {
            // SAFETY: a zeroed sigaction is a valid value; the handler makes
            // only async-signal-safe calls, and runs on the thread's
            // alternate stack where it has one (SA_ONSTACK), so a fault from
            // a stack overflow still gets a stack to run on.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_fault as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut sa.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &sa, &mut old) != 0 {
                    return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
                }
                // The old action of a second install would be our own.
                let _ = PREVIOUS[i].set(old);
            }
        }
        Ok(())
    });
    r.map_err(io::Error::from_raw_os_error)
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: installed with SA_SIGINFO: the kernel hands a valid siginfo_t.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // si_code > 0: raised by the kernel for an access (kill(2) and the like
    // give si_code <= 0, and their si_addr is not an address).
    if code > 0 {
        if let Some(hit) = REGISTRY.lookup(addr) {
            // SAFETY: mmap(2) is async-signal-safe. MAP_FIXED replaces
            // exactly the registered mapping (page-aligned start and length,
            // as mmap returned them) with private anonymous memory: no
            // other mapping is touched, and every later access to the range,
            // the faulting one included, reads and writes zeros.
            let p = unsafe {
                libc::mmap(
                    hit.start as *mut libc::c_void,
                    hit.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    // NORESERVE: a region of many GiB must not fail on
                    // the commit limit; the pages are only ever touched
                    // until the connection closes.
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                // SAFETY: an entry's owner lives while the entry exists (its
                // Registration holds an Arc), and the entry exists: the
                // faulting thread holds the mapping, whose holder holds the
                // Registration.
                let owner = unsafe { &*hit.owner };
                owner.record(sig, addr, &hit);
                return;
            }
        }
    }
    not_ours(sig, info, ctx);
}

/// A fault outside every registered mapping: whatever handled it before
/// handles it (Rust's handler reports a stack overflow and aborts, or
/// restores the default action and returns), else the default action is
/// restored; returning then repeats the faulting access, which now ends the
/// process as it would have without this handler.
fn not_ours(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    if let Some(prev) = previous(sig) {
        let h = prev.sa_sigaction;
        if h != libc::SIG_DFL && h != libc::SIG_IGN && prev.sa_flags & libc::SA_SIGINFO != 0 {
            // SAFETY: `h` was installed with SA_SIGINFO, so it has this
            // signature; it is called with the arguments the kernel gave us.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(h) };
            f(sig, info, ctx);
            return;
        }
    }
    // SAFETY: sigaction(2) and raise(3) are async-signal-safe; the struct is
    // a zeroed sigaction with SIG_DFL (0).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(sig, &sa, std::ptr::null_mut());
        // A signal someone sent: the access will not repeat, send it again.
        if (*info).si_code <= 0 {
            libc::raise(sig);
        }
    }
}

/// Bytes of the alternate signal stack a thread gets (plus a guard page).
const ALT_STACK_SIZE: usize = 64 * 1024;

/// A thread's alternate signal stack, given back when the thread ends.
struct AltStack {
    base: *mut libc::c_void,
    len: usize,
}

impl Drop for AltStack {
    fn drop(&mut self) {
        // SAFETY: disables this thread's alternate stack (no signal handler
        // runs on it while this destructor does), then unmaps the stack
        // this struct mapped.
        unsafe {
            let off = libc::stack_t {
                ss_sp: std::ptr::null_mut(),
                ss_flags: libc::SS_DISABLE,
                ss_size: 0,
            };
            libc::sigaltstack(&off, std::ptr::null_mut());
            libc::munmap(self.base, self.len);
        }
    }
}

thread_local! {
    static ALT_STACK: RefCell<Option<AltStack>> = const { RefCell::new(None) };
}

/// Gives the calling thread an alternate signal stack if it has none (Rust's
/// std gives its threads one when it installed its own handler first; this
/// does not rely on that). Every thread that may touch frontend memory calls
/// it at setup ([`crate::seccomp::apply`] does).
pub fn ensure_alt_stack() -> io::Result<()> {
    // SAFETY: sigaltstack(NULL, &old) only writes the current setting.
    let current = unsafe {
        let mut old: libc::stack_t = std::mem::zeroed();
        if libc::sigaltstack(std::ptr::null(), &mut old) != 0 {
            return Err(io::Error::last_os_error());
        }
        old
    };
    if current.ss_flags & libc::SS_DISABLE == 0 {
        return Ok(());
    }
    // SAFETY: sysconf takes no pointer.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let len = ALT_STACK_SIZE + page;
    // SAFETY: a fresh anonymous mapping, then the lowest page made a guard
    // (an overflow of the handler's stack faults instead of overwriting
    // memory); the stack is used only by this thread's handlers and unmapped
    // by AltStack's Drop after it is disabled.
    unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        );
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = AltStack { base, len };
        libc::mprotect(base, page, libc::PROT_NONE);
        let ss = libc::stack_t {
            ss_sp: base.cast::<u8>().add(page).cast(),
            ss_flags: 0,
            ss_size: ALT_STACK_SIZE,
        };
        if libc::sigaltstack(&ss, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
        ALT_STACK.with(|s| *s.borrow_mut() = Some(stack));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::FromRawFd;

    fn owner() -> Arc<FaultOwner> {
        FaultOwner::new()
    }

    #[test]
    fn entries_are_found_by_any_address_inside_and_gone_once_removed() {
        let r: Registry<4> = Registry::new();
        let (a, b) = (owner(), owner());
        let ia = r
            .insert(0x10000, 0x2000, MappingKind::GuestMemory, Arc::as_ptr(&a))
            .unwrap();
        let ib = r
            .insert(0x40000, 0x1000, MappingKind::DirtyLog, Arc::as_ptr(&b))
            .unwrap();
        assert_ne!(ia, ib);
        let found = |addr| r.lookup(addr).map(|e| (e.start, e.kind, e.owner));
        let ka = MappingKind::GuestMemory.code();
        let kb = MappingKind::DirtyLog.code();
        assert_eq!(found(0x10000), Some((0x10000, ka, Arc::as_ptr(&a))));
        assert_eq!(found(0x11fff), Some((0x10000, ka, Arc::as_ptr(&a))));
        assert_eq!(found(0x40800), Some((0x40000, kb, Arc::as_ptr(&b))));
        for outside in [0, 0xffff, 0x12000, 0x3ffff, 0x41000, usize::MAX] {
            assert_eq!(found(outside), None, "{outside:#x}");
        }
        r.remove(ia);
        assert_eq!(found(0x10000), None);
        assert!(found(0x40000).is_some());
        // The freed slot is used again.
        let ic = r
            .insert(0x80000, 0x1000, MappingKind::Inflight, Arc::as_ptr(&a))
            .unwrap();
        assert_eq!(ic, ia);
        assert!(found(0x80fff).is_some());
    }

    #[test]
    fn a_full_registry_refuses_and_takes_entries_again_once_one_is_removed() {
        let r: Registry<3> = Registry::new();
        let o = owner();
        let p = Arc::as_ptr(&o);
        let slots: Vec<usize> = (0..3)
            .map(|i| {
                r.insert(i * 0x1000, 0x1000, MappingKind::GuestMemory, p)
                    .unwrap()
            })
            .collect();
        assert!(r
            .insert(0x9000, 0x1000, MappingKind::GuestMemory, p)
            .is_err());
        r.remove(slots[1]);
        assert!(r
            .insert(0x9000, 0x1000, MappingKind::GuestMemory, p)
            .is_ok());
        assert!(r.lookup(0x9000).is_some());
        assert!(r.lookup(0x1000).is_none());
    }

    /// Readers never see an entry torn between two registrations: while
    /// other threads keep entering and removing mappings (the same slots
    /// over and over), a lookup in a mapping that stays finds exactly it,
    /// and a lookup where nothing stays finds nothing or a whole entry.
    #[test]
    fn lookups_racing_registrations_see_whole_entries() {
        static R: Registry<8> = Registry::new();
        // Below the 64 KiB between starts: no entry covers another's start.
        let len_of = |start: usize| ((start >> 16) & 0xff) * 16 + 16;
        let keep = owner();
        let churn = owner();
        let kept = R
            .insert(
                0x100_0000,
                0x1000,
                MappingKind::GuestMemory,
                Arc::as_ptr(&keep),
            )
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..2usize)
            .map(|t| {
                let (stop, churn) = (stop.clone(), churn.clone());
                std::thread::spawn(move || {
                    let mut n = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        // Each entry's length encodes its start, so a torn
                        // read shows as a mismatch.
                        let start = 0x200_0000 + ((n * 2 + t) % 64) * 0x10000;
                        let len = len_of(start);
                        if let Ok(i) =
                            R.insert(start, len, MappingKind::Inflight, Arc::as_ptr(&churn))
                        {
                            R.remove(i);
                        }
                        n += 1;
                    }
                })
            })
            .collect();
        for i in 0..200_000usize {
            let e = R
                .lookup(0x100_0800)
                .expect("the kept mapping is always found");
            assert_eq!((e.start, e.len), (0x100_0000, 0x1000));
            assert_eq!(e.owner, Arc::as_ptr(&keep));
            let addr = 0x200_0000 + (i % 64) * 0x10000;
            if let Some(e) = R.lookup(addr) {
                assert_eq!(e.start, addr);
                assert_eq!(e.len, len_of(addr));
                assert_eq!(e.owner, Arc::as_ptr(&churn));
            }
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap();
        }
        R.remove(kept);
    }

    /// A memfd that cannot be sealed, `pages` long, mapped shared.
    fn unsealable_mapping(pages: usize) -> (File, *mut u8, usize) {
        // SAFETY: a NUL-terminated name; no MFD_ALLOW_SEALING.
        let fd = unsafe { libc::memfd_create(c"vqblk-fault-test".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd we own.
        let file = unsafe { File::from_raw_fd(fd) };
        let len = pages * 4096;
        file.set_len(len as u64).unwrap();
        // SAFETY: a shared mapping of the file's `len` bytes.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (file, p.cast(), len)
    }

    fn read_at(p: *mut u8, off: usize) -> u8 {
        // SAFETY: within a live mapping of the caller; a page beyond the
        // file's end faults, which is what the tests provoke.
        unsafe { p.add(off).read_volatile() }
    }

    /// The whole path in this process: a registered mapping whose file is
    /// truncated faults, the handler replaces it, the access reads zeros, the
    /// owner records the fault and its eventfd is written.
    #[test]
    fn a_fault_in_a_registered_mapping_is_survived_and_reported() {
        install().unwrap();
        ensure_alt_stack().unwrap();
        let (file, p, len) = unsealable_mapping(4);
        // SAFETY: within the mapping.
        unsafe { p.add(3 * 4096).write_volatile(7) };
        let o = owner();
        let reg = register(p, len, MappingKind::GuestMemory, &o).unwrap();
        assert!(o.fault().is_none());
        file.set_len(4096).unwrap();
        assert_eq!(read_at(p, 3 * 4096 + 5), 0, "the access completes on zeros");
        let f = o.fault().expect("the fault is recorded");
        assert_eq!(f.signal, libc::SIGBUS);
        assert_eq!(f.addr, p as usize + 3 * 4096 + 5);
        assert_eq!(f.kind, MappingKind::GuestMemory);
        assert_eq!(f.mapping, (p as usize, len));
        assert!(o.broken_flag().load(Ordering::Acquire));
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into `n` from the owner's eventfd.
        let r = unsafe { libc::read(o.wake_fd().unwrap(), (&mut n as *mut u64).cast(), 8) };
        assert_eq!((r, n), (8, 1));
        // The whole mapping is anonymous now: the page still inside the file
        // reads zeros too, and writes stay in this process.
        assert_eq!(read_at(p, 0), 0);
        drop(reg);
        // SAFETY: unmapping the mapping made above, after its entry is gone.
        unsafe { libc::munmap(p.cast(), len) };
    }

    /// Set for the child processes of the tests below.
    const CHILD: &str = "VQBLK_FAULT_TEST_CHILD";

    /// Run only as the child of `a_fault_elsewhere_still_ends_the_process`:
    /// under the IOThread's seccomp filter, survives a fault in a registered
    /// mapping, then faults in an unregistered one.
    #[test]
    #[ignore = "run in a child process by a_fault_elsewhere_still_ends_the_process"]
    fn faults_in_a_child() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        install().unwrap();
        // Both files are truncated before the filter goes on (ftruncate is
        // not an IOThread's call); the faults come under the filter.
        let (file, p, len) = unsealable_mapping(2);
        let o = owner();
        let reg = register(p, len, MappingKind::Inflight, &o).unwrap();
        file.set_len(0).unwrap();
        let (other, q, _) = unsealable_mapping(2);
        other.set_len(0).unwrap();
        let (p, q) = (p as usize, q as usize);
        std::thread::spawn(move || {
            crate::seccomp::apply(
                crate::seccomp::ThreadKind::IoThread,
                crate::seccomp::SeccompMode::On,
            )
            .unwrap();
            assert_eq!(read_at(p as *mut u8, 4096), 0);
            assert!(o.fault().is_some());
            println!("survived the registered fault");
            read_at(q as *mut u8, 4096);
            println!("survived the unregistered fault");
            drop(reg);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_fault_elsewhere_still_ends_the_process() {
        use std::os::unix::process::ExitStatusExt;
        let out = crate::seccomp::tests::run_in_child("fault::tests::faults_in_a_child", CHILD);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            stdout.contains("survived the registered fault"),
            "{stdout}\n{stderr}"
        );
        assert!(
            !stdout.contains("survived the unregistered fault"),
            "{stdout}"
        );
        // Killed by the fault itself (default action), not by seccomp
        // (SIGSYS, exit 159) nor by an abort.
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGBUS),
            "{:?}\n{stderr}",
            out.status
        );
    }
}
