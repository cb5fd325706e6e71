//! Live migration end to end: a Linux guest (QEMU, TCG) on a vqblk
//! disk moves to a second QEMU process while it writes, reads back and
//! compares 4 KiB blocks with O_DIRECT (guest-init.sh `vqblk.mode=migrate`),
//! so the daemon keeps writing guest memory (read data, status bytes, used
//! ring) through every round of the migration.
//!
//! Two `vqblk serve` processes share the image (shared storage, as a SAN or
//! RBD gives two hosts): the source QEMU is on the first, the destination QEMU
//! (`-incoming unix:...`) on the second. The migration runs at a low bandwidth
//! until several dirty-bitmap rounds have passed, then is let go to converge.
//! After the switch-over the guest must keep running on the destination with
//! no verification error, and the image must hold the last block each writer
//! wrote.
//!
//! The dirty log is what makes this work: a page the daemon writes and does
//! not mark reaches the destination stale (above all the used ring, which the
//! guest never writes itself). A daemon built with `DirtyLog::mark` returning
//! at once (`vqblk_daemon::dirty_log`) must make the io_uring cases fail; the
//! null case cannot show a missing mark (docs/migration.md says why).
//!
//! Like tests/guest_e2e.rs these tests never skip, run one at a time, and
//! leave their artefacts under `target/tmp/mig-*-PID/` when they fail.

mod common;

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const MIB: u64 = 1 << 20;
const IMAGE_SIZE: u64 = 64 * MIB;
/// 4 KiB blocks per guest writer (guest-init.sh `vqblk.blocks`).
const BLOCKS: u64 = 16;
/// Guest RAM: small, so that a migration round is short under TCG.
const GUEST_MEM: &str = "160M";
/// The bandwidth of the first rounds (bytes/s): low enough that the guest's
/// I/O dirties pages between rounds.
const SLOW_BANDWIDTH: u64 = 16 * MIB;
/// Dirty-bitmap syncs (the first is at setup) before the migration is let go.
const ROUNDS: u64 = 3;
/// The reader's region (guest-init.sh `vqblk.read_mib`, `vqblk.read_off_mib`),
/// filled with non-zero data by the host first.
const READ_MIB: u64 = 16;
const READ_OFF_MIB: u64 = 16;
/// How long the rounds after the first full pass keep running at the low
/// bandwidth: the first pass sends pages in address order, so a page the
/// device fills during it is mostly sent afterwards anyway; what the dirty log
/// alone can save is what is written after its page was sent.
const HOLD: Duration = Duration::from_secs(8);
/// Guest run time on the null backend (guest seconds): it cannot read the
/// host's stop marker there, so it writes until then and reports.
const NULL_SECONDS: u64 = 45;

// ------------------------------------------------------------------ the kit

/// The guest kernel and initramfs (scripts/build-initramfs.sh), built once.
fn guest_dir() -> &'static Path {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = DIR.get_or_init(|| {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .expect("CARGO_TARGET_TMPDIR has a parent")
            .join("vqblk-guest");
        let out = Command::new(repo.join("scripts/build-initramfs.sh"))
            .arg(&dir)
            .output()
            .map_err(|e| format!("scripts/build-initramfs.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "scripts/build-initramfs.sh failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(dir)
    });
    match r {
        Ok(d) => d,
        Err(e) => panic!("guest kit unavailable (run scripts/install-deps.sh): {e}"),
    }
}

fn serialize() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Scratch dir, timing and failure messages with the logs' tails.
struct Case {
    name: &'static str,
    dir: PathBuf,
    _lock: MutexGuard<'static, ()>,
}

impl Case {
    fn new(name: &'static str) -> Case {
        let lock = serialize();
        let _ = guest_dir();
        let dir = common::scratch(&format!("mig-{name}"));
        eprintln!("[mig] {name}: artefacts in {}", dir.display());
        Case {
            name,
            dir,
            _lock: lock,
        }
    }

    fn fail(&self, msg: impl AsRef<str>) -> ! {
        let mut out = format!(
            "{}: {}\n--- artefacts in {}",
            self.name,
            msg.as_ref(),
            self.dir.display()
        );
        let mut files: Vec<PathBuf> = fs::read_dir(&self.dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        for p in files
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
        {
            let text = String::from_utf8_lossy(&fs::read(p).unwrap_or_default()).into_owned();
            let lines: Vec<&str> = text.lines().collect();
            out += &format!("\n--- {}\n", p.display());
            for l in &lines[lines.len().saturating_sub(20)..] {
                out += &l.chars().take(300).collect::<String>();
                out.push('\n');
            }
        }
        panic!("{out}")
    }

    fn done(self) {
        if std::env::var_os("VQBLK_E2E_KEEP").is_none() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A child process (daemon or QEMU), killed when dropped.
struct Proc {
    child: Child,
    tag: String,
}

impl Proc {
    /// Where the process `tag` writes its stdout and stderr.
    fn log(case: &Case, tag: &str) -> PathBuf {
        case.dir.join(format!("{tag}.log"))
    }

    fn spawn(case: &Case, tag: &str, cmd: &mut Command) -> Proc {
        let log = fs::File::create(Proc::log(case, tag)).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| case.fail(format!("{tag}: cannot start: {e}")));
        Proc {
            child,
            tag: tag.into(),
        }
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL: nothing is drained, the socket file stays behind.
    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        eprintln!("[mig] {} killed (SIGKILL)", self.tag);
    }

    /// SIGTERM, then SIGKILL after `grace`.
    fn stop(&mut self, grace: Duration) {
        if !self.alive() {
            return;
        }
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while self.alive() && t.elapsed() < grace {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.alive() {
            eprintln!("[mig] killing {}", self.tag);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn wait_for(case: &Case, what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ready() {
        if t.elapsed() > limit {
            case.fail(format!("{what}: not within {}s", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ------------------------------------------------------------------ QMP

/// A minimal QMP client: one command at a time, events skipped.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    fn connect(case: &Case, path: &Path) -> Qmp {
        let mut stream = None;
        wait_for(case, "QMP socket", Duration::from_secs(30), || {
            stream = UnixStream::connect(path).ok();
            stream.is_some()
        });
        let s = stream.unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut q = Qmp {
            reader: BufReader::new(s.try_clone().unwrap()),
            writer: s,
        };
        q.line(case); // greeting
        q.cmd(case, "qmp_capabilities", json!({}));
        q
    }

    fn line(&mut self, case: &Case) -> Value {
        let mut l = String::new();
        match self.reader.read_line(&mut l) {
            Ok(n) if n > 0 => serde_json::from_str(&l)
                .unwrap_or_else(|e| case.fail(format!("QMP: bad line {l:?}: {e}"))),
            r => case.fail(format!("QMP: connection lost ({r:?})")),
        }
    }

    fn cmd(&mut self, case: &Case, execute: &str, args: Value) -> Value {
        let msg = json!({"execute": execute, "arguments": args});
        writeln!(self.writer, "{msg}").unwrap_or_else(|e| case.fail(format!("QMP write: {e}")));
        loop {
            let v = self.line(case);
            if let Some(r) = v.get("return") {
                return r.clone();
            }
            if let Some(e) = v.get("error") {
                case.fail(format!("QMP {execute}: {e}"));
            }
        }
    }
}

// ------------------------------------------------------------------ guest I/O

/// guest-init.sh `gen_seq_block`: write `seq` of `writer` to its `block`.
fn seq_block(writer: u64, seq: u64, block: u64) -> Vec<u8> {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    let base = (writer * BLOCKS + block) * 4096;
    let mut out = Vec::with_capacity(4096);
    for k in 0..8u64 {
        let mut line = format!(
            "VQBLK-SEQ w={writer} s={seq} b={block} off={}|",
            base + 512 * k
        )
        .into_bytes();
        line.resize(511, LETTERS[((seq + k) % 26) as usize]);
        line.push(b'\n');
        out.extend_from_slice(&line);
    }
    out
}

/// The reader's region: 64 KiB chunks of 128 sectors, sector `s` of chunk
/// `k` a line "VQBLK-RD k=K s=S|" padded to 512 bytes (guest-init.sh checks
/// each one, so data from another chunk or stale memory is caught).
fn reader_region() -> Vec<u8> {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::with_capacity((READ_MIB * MIB) as usize);
    for k in 0..READ_MIB * 16 {
        for s in 0..128u64 {
            let mut line = format!("VQBLK-RD k={k} s={s}|").into_bytes();
            line.resize(511, LETTERS[((k + s) % 26) as usize]);
            line.push(b'\n');
            out.extend_from_slice(&line);
        }
    }
    out
}

/// Progress lines "vqblk: migrate: w=W s=S at Ts" of a serial log.
fn progress(log: &Path) -> Vec<(u64, u64, f64)> {
    let text = String::from_utf8_lossy(&fs::read(log).unwrap_or_default()).into_owned();
    text.lines()
        .filter_map(|l| {
            let rest = l.split("vqblk: migrate: w=").nth(1)?;
            let (w, rest) = rest.split_once(" s=")?;
            let (s, rest) = rest.split_once(" at ")?;
            let t = rest.trim_end().strip_suffix('s')?;
            Some((w.parse().ok()?, s.parse().ok()?, t.parse().ok()?))
        })
        .collect()
}

/// Sum over writers of the highest sequence number seen, and the guest
/// uptime of the last line.
fn progress_sum(lines: &[(u64, u64, f64)]) -> (u64, f64) {
    let mut best = std::collections::BTreeMap::new();
    for &(w, s, _) in lines {
        let e = best.entry(w).or_insert(0);
        *e = (*e).max(s);
    }
    (best.values().sum(), lines.last().map_or(0.0, |l| l.2))
}

fn result_line(log: &Path) -> Option<Value> {
    let text = String::from_utf8_lossy(&fs::read(log).ok()?).into_owned();
    let json = text
        .lines()
        .rev()
        .find_map(|l| l.split("VQBLK-RESULT ").nth(1))?;
    serde_json::from_str(json.trim()).ok()
}

// ------------------------------------------------------------------ the test body

/// The storage daemon serving the image on both sides.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Server {
    /// `vqblk serve`.
    Vqblk,
    /// `qemu-storage-daemon` (libvhost-user), for the side-by-side figures;
    /// `Setup::backend` and `Setup::iothreads` do not apply to it.
    Qsd,
}

#[derive(Clone, Copy)]
struct Setup {
    server: Server,
    /// `--backend` of both daemons.
    backend: &'static str,
    iothreads: u16,
    queues: u16,
    /// Guest vCPUs (the guest uses min(queues, vCPUs) queues).
    smp: u16,
    writers: u16,
    /// Which daemon is SIGKILLed and restarted during the iterative phase.
    restart: Restart,
}

/// One queue on one IOThread, one vCPU, two writers, vqblk over io_uring,
/// no restart: what each test changes is written beside it.
const ONE_QUEUE: Setup = Setup {
    server: Server::Vqblk,
    backend: "io_uring",
    iothreads: 1,
    queues: 1,
    smp: 1,
    writers: 2,
    restart: Restart::No,
};

/// A daemon killed (SIGKILL) and started again in the middle of a migration.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Restart {
    No,
    /// The source's, while the guest runs and the dirty log is on.
    Source,
    /// The destination's, while its QEMU waits for the incoming state.
    Destination,
}

fn daemon(case: &Case, tag: &str, image: &Path, socket: &Path, s: Setup) -> Proc {
    let mut cmd = match s.server {
        Server::Vqblk => Command::new(env!("CARGO_BIN_EXE_vqblk")),
        Server::Qsd => Command::new("qemu-storage-daemon"),
    };
    if s.server == Server::Qsd {
        // locking=off: the two daemons share the image, as vqblk's do.
        cmd.arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=f,filename={},cache.direct=on,aio=io_uring,locking=off",
                image.display()
            ))
            .args(["--blockdev", "raw,node-name=r,file=f"])
            .args(["--object", "iothread,id=iot0"])
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=r,iothread=iot0,addr.type=unix,addr.path={},\
                 writable=on,num-queues={}",
                socket.display(),
                s.queues
            ));
    } else {
        cmd.arg("serve");
        if s.backend == "null" {
            cmd.args(["--size", &IMAGE_SIZE.to_string()]);
        } else {
            cmd.arg("--image").arg(image);
        }
        cmd.args(["--backend", s.backend])
            .arg("--socket")
            .arg(socket)
            .args(["--queues", &s.queues.to_string()])
            .args(["--iothreads", &s.iothreads.to_string()])
            .args(["--log-level", "debug"]);
    }
    let mut p = Proc::spawn(case, tag, &mut cmd);
    wait_for(
        case,
        &format!("{tag}: socket"),
        Duration::from_secs(20),
        || socket.exists() || !p.alive(),
    );
    if !p.alive() {
        case.fail(format!("{tag}: exited at startup"));
    }
    p
}

fn qemu(
    case: &Case,
    tag: &str,
    socket: &Path,
    qmp: &Path,
    s: Setup,
    incoming: Option<&Path>,
) -> Proc {
    let dir = guest_dir();
    // init_on_alloc=0: Debian kernels zero every page they allocate, which
    // dirties a fresh page-cache page with the CPU just before the device
    // fills it and so hides most unlogged device writes; production guests
    // often run without it.
    // The null backend reads zeroes: nothing to compare, no reader region;
    // the guest stops at vqblk.seconds (it cannot read the stop marker).
    let (read_mib, extra, seconds) = if s.backend == "null" {
        (0, " vqblk.compare=0", NULL_SECONDS)
    } else {
        (READ_MIB, "", 150)
    };
    let append = format!(
        "console=ttyS0 quiet panic=-1 init_on_alloc=0 vqblk.mode=migrate vqblk.writers={} vqblk.blocks={BLOCKS} \
         vqblk.read_mib={read_mib} vqblk.read_off_mib={READ_OFF_MIB}{extra} \
         vqblk.seconds={seconds} vqblk.timeout={}",
        s.writers,
        seconds + 20
    );
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-M", "q35,memory-backend=mem"])
        .args([
            "-object",
            &format!("memory-backend-memfd,id=mem,size={GUEST_MEM},share=on"),
        ])
        .args(["-m", GUEST_MEM, "-smp", &s.smp.to_string(), "-accel", "tcg"])
        .args([
            "-nodefaults",
            "-display",
            "none",
            "-vga",
            "none",
            "-nic",
            "none",
        ])
        .args(["-monitor", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!(
            "file:{}",
            case.dir.join(format!("{tag}-serial.log")).display()
        ))
        .arg("-kernel")
        .arg(dir.join("vmlinuz"))
        .arg("-initrd")
        .arg(dir.join("initramfs.cpio.gz"))
        .args(["-append", &append])
        .arg("-chardev")
        .arg(format!(
            "socket,id=vhost0,path={}{}",
            socket.display(),
            // QEMU reconnects to the restarted daemon, as in production.
            if s.restart == Restart::No {
                ""
            } else {
                ",reconnect-ms=200"
            }
        ))
        .args([
            "-device",
            &format!("vhost-user-blk-pci,chardev=vhost0,num-queues={}", s.queues),
        ])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()));
    if let Some(uri) = incoming {
        cmd.arg("-incoming").arg(format!("unix:{}", uri.display()));
    }
    Proc::spawn(case, tag, &mut cmd)
}

/// QEMU crashed on its own while the guest booted, before the guest's init
/// ran (`scripts/qemu-crashed-at-boot.sh` knows the crashes; `log` is the
/// QEMU process's stderr, `serial` its guest's console).
fn emulator_crashed_at_boot(log: &Path, serial: &Path) -> bool {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/qemu-crashed-at-boot.sh");
    Command::new(script)
        .arg(log)
        .arg(serial)
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts the source QEMU and waits until its guest's I/O runs; booted once
/// more if QEMU crashed on its own at boot ([`emulator_crashed_at_boot`]).
fn boot_source(case: &Case, sock: &Path, qmp: &Path, serial: &Path, s: Setup) -> (Proc, Qmp) {
    for attempt in 1..=2 {
        let mut src = qemu(case, "src", sock, qmp, s, None);
        let qa = Qmp::connect(case, qmp);
        wait_for(
            case,
            "guest I/O on the source",
            Duration::from_secs(120),
            || progress(serial).len() >= 2 * s.writers as usize || !src.alive(),
        );
        if src.alive() {
            return (src, qa);
        }
        let log = Proc::log(case, "src");
        if attempt == 1 && emulator_crashed_at_boot(&log, serial) {
            eprintln!("[mig] source QEMU aborted on its own assertion at boot; booting again");
            // Kept for the record: the next boot writes src.log afresh.
            let _ = fs::rename(&log, case.dir.join("src-aborted.log"));
            let _ = fs::remove_file(qmp);
            continue;
        }
        break;
    }
    case.fail("source QEMU exited before migrating")
}

fn migrate_with_io(name: &'static str, s: Setup) {
    let case = Case::new(name);
    let d = &case.dir;
    let image = d.join("disk.raw");
    let (sock_a, sock_b) = (d.join("a.sock"), d.join("b.sock"));
    let (qmp_a, qmp_b, mig) = (
        d.join("qmp-a.sock"),
        d.join("qmp-b.sock"),
        d.join("mig.sock"),
    );
    let (serial_a, serial_b) = (d.join("src-serial.log"), d.join("dst-serial.log"));
    // The image: sparse, with the reader's region holding non-zero data (a
    // stale page then reads as something else).
    let f = fs::File::create(&image).unwrap();
    f.set_len(IMAGE_SIZE).unwrap();
    f.write_all_at(&reader_region(), READ_OFF_MIB * MIB)
        .unwrap();
    drop(f);
    let mut daemon_a = daemon(&case, "vqblk-a", &image, &sock_a, s);
    let mut daemon_b = daemon(&case, "vqblk-b", &image, &sock_b, s);
    let mut dst = qemu(&case, "dst", &sock_b, &qmp_b, s, Some(&mig));
    let mut qb = Qmp::connect(&case, &qmp_b);
    // The guest is up and its I/O runs.
    let (mut src, mut qa) = boot_source(&case, &sock_a, &qmp_a, &serial_a, s);
    let t0 = Instant::now();
    let before = progress_sum(&progress(&serial_a));
    qa.cmd(
        &case,
        "migrate-set-parameters",
        // A 1 ms downtime limit keeps it from converging until released.
        json!({"max-bandwidth": SLOW_BANDWIDTH, "downtime-limit": 1}),
    );
    qa.cmd(
        &case,
        "migrate",
        json!({"uri": format!("unix:{}", mig.display())}),
    );
    let mut released = false;
    let mut restarted = false;
    let mut second_pass: Option<Instant> = None;
    let info = loop {
        let info = qa.cmd(&case, "query-migrate", json!({}));
        let status = info["status"].as_str().unwrap_or("?").to_string();
        let syncs = info["ram"]["dirty-sync-count"].as_u64().unwrap_or(0);
        if syncs >= 2 && second_pass.is_none() {
            second_pass = Some(Instant::now());
        }
        if s.restart != Restart::No && !restarted && second_pass.is_some() {
            // The iterative phase: the dirty log is on, the guest writes.
            restarted = true;
            let (proc_, sock, tag) = match s.restart {
                Restart::Source => (&mut daemon_a, &sock_a, "vqblk-a-restarted"),
                _ => (&mut daemon_b, &sock_b, "vqblk-b-restarted"),
            };
            proc_.kill9();
            // The killed daemon's socket file stays; the new one binds afresh
            // (QEMU keeps retrying meanwhile).
            let _ = fs::remove_file(sock);
            *proc_ = daemon(&case, tag, &image, sock, s);
            eprintln!(
                "[mig] {name}: {tag} started during the iterative phase (dirty syncs {syncs})"
            );
        }
        let held = second_pass.is_some_and(|t| t.elapsed() >= HOLD);
        if !released && syncs >= ROUNDS && held {
            // Several rounds ran with I/O in flight: now let it converge.
            released = true;
            qa.cmd(
                &case,
                "migrate-set-parameters",
                json!({"max-bandwidth": 4096 * MIB, "downtime-limit": 2000}),
            );
        }
        match status.as_str() {
            "completed" => break info,
            "failed" | "cancelled" => case.fail(format!("migration {status}: {info}")),
            _ => {}
        }
        if t0.elapsed() > Duration::from_secs(150) || !dst.alive() {
            case.fail(format!("migration did not complete: {info}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if s.restart == Restart::Source {
        // What makes a restart lose nothing: QEMU handed the region recording
        // the requests in flight back to the new daemon.
        let log = fs::read_to_string(d.join("vqblk-a-restarted.log")).unwrap_or_default();
        if !log.contains("inflight region handed back by the frontend") {
            case.fail("the restarted source daemon never got the inflight region back");
        }
    }
    let during = progress_sum(&progress(&serial_a));
    let total_ms = info["total-time"].as_u64().unwrap_or(0);
    let syncs = info["ram"]["dirty-sync-count"].as_u64().unwrap_or(0);
    if syncs < ROUNDS {
        case.fail(format!(
            "only {syncs} dirty-bitmap syncs: not several rounds ({info})"
        ));
    }
    let guest_writes = during.0.saturating_sub(before.0);
    eprintln!(
        "[mig] {name}: migrated in {total_ms} ms (downtime {} ms, {} syncs, {} MiB sent); \
         guest writes+verifies during it: >= {guest_writes} ({:.1}/s of guest time)",
        info["downtime"].as_u64().unwrap_or(0),
        syncs,
        info["ram"]["transferred"].as_u64().unwrap_or(0) / MIB,
        guest_writes as f64 / (during.1 - before.1).max(0.1),
    );
    let status = qb.cmd(&case, "query-status", json!({}));
    if status["status"] != "running" {
        case.fail(format!(
            "destination not running after the migration: {status}"
        ));
    }
    // The source is done; the guest must go on verifying on the destination.
    src.stop(Duration::from_secs(5));
    wait_for(
        &case,
        "guest I/O on the destination",
        Duration::from_secs(60),
        || {
            progress(&serial_b).len() >= 2 * s.writers as usize
                || result_line(&serial_b).is_some()
                || !dst.alive()
        },
    );
    if let Some(r) = result_line(&serial_b) {
        case.fail(format!("guest stopped early on the destination: {r}"));
    }
    if !dst.alive() {
        case.fail("destination QEMU exited after the migration");
    }
    let null = s.backend == "null" && s.server == Server::Vqblk;
    if !null {
        // Stop the guest through the shared image: the stop marker in its last 4 KiB.
        let f = fs::OpenOptions::new().write(true).open(&image).unwrap();
        f.write_all_at(b"VQBLK-STOP", IMAGE_SIZE - 4096).unwrap();
        f.sync_data().unwrap();
    }
    wait_for(
        &case,
        "guest result on the destination",
        // The null guest runs out its NULL_SECONDS.
        Duration::from_secs(if null { 120 } else { 60 }),
        || result_line(&serial_b).is_some() || !dst.alive(),
    );
    let r = result_line(&serial_b).unwrap_or_else(|| case.fail("no guest result"));
    if r["ok"] != true {
        case.fail(format!("guest reported failures: {}", r["failures"]));
    }
    if null {
        // Nothing was stored: what is checked is that every request kept
        // completing on the destination (no hang, no I/O error), which a
        // used ring or status byte gone stale would break.
        wait_for(
            &case,
            "destination QEMU exit",
            Duration::from_secs(30),
            || !dst.alive(),
        );
        daemon_a.stop(Duration::from_secs(30));
        daemon_b.stop(Duration::from_secs(30));
        eprintln!("[mig] {name}: PASSED, guest writes {}", r["seq"]);
        drop(qa);
        drop(qb);
        case.done();
        return;
    }
    wait_for(
        &case,
        "destination QEMU exit",
        Duration::from_secs(30),
        || !dst.alive(),
    );
    daemon_a.stop(Duration::from_secs(30));
    daemon_b.stop(Duration::from_secs(30));
    // The image holds each block's last write.
    let seq = r["seq"].as_array().cloned().unwrap_or_default();
    if seq.len() != s.writers as usize {
        case.fail(format!("guest result has {} writers: {r}", seq.len()));
    }
    let img = fs::read(&image).unwrap();
    for w in &seq {
        let (writer, n) = (w["writer"].as_u64().unwrap(), w["writes"].as_u64().unwrap());
        if w["stopped"] != 1 {
            case.fail(format!(
                "writer {writer} ended without the stop marker: {w}"
            ));
        }
        for b in 0..BLOCKS.min(n) {
            let last = b + BLOCKS * ((n - 1 - b) / BLOCKS);
            let at = ((writer * BLOCKS + b) * 4096) as usize;
            if img[at..at + 4096] != seq_block(writer, last, b)[..] {
                case.fail(format!(
                    "writer {writer} block {b}: the image does not hold write {last}: {:?}",
                    String::from_utf8_lossy(&img[at..at + 60])
                ));
            }
        }
    }
    eprintln!(
        "[mig] {name}: PASSED, guest writes {seq:?}, reader {}",
        r["reader"]
    );
    drop(qa);
    drop(qb);
    case.done();
}

#[test]
fn guest_migrates_with_io_running() {
    migrate_with_io("uring", ONE_QUEUE);
}

#[test]
fn guest_migrates_with_io_running_null() {
    migrate_with_io(
        "null",
        Setup {
            backend: "null",
            ..ONE_QUEUE
        },
    );
}

/// The same migration with qemu-storage-daemon (libvhost-user) serving the
/// image on both sides, for the figures side by side (docs/migration.md):
/// `cargo test --release --test guest_migration -- --ignored --nocapture`.
#[test]
#[ignore = "figures: qemu-storage-daemon side by side; run with --ignored"]
fn guest_migrates_with_io_running_qsd() {
    migrate_with_io(
        "qsd",
        Setup {
            server: Server::Qsd,
            ..ONE_QUEUE
        },
    );
}

#[test]
fn guest_migrates_with_io_running_two_queues_two_iothreads() {
    migrate_with_io(
        "uring-2iot",
        Setup {
            iothreads: 2,
            queues: 2,
            smp: 2,
            ..ONE_QUEUE
        },
    );
}

/// The source daemon is SIGKILLed and restarted while the migration copies
/// memory and the guest writes: QEMU reconnects, the new daemon resubmits what
/// was in flight (inflight region) and logs its writes from the start (QEMU
/// hands it the dirty log again), and the guest ends on the destination with
/// every block verified.
#[test]
fn guest_migrates_while_the_source_daemon_restarts() {
    migrate_with_io(
        "uring-restart-src",
        Setup {
            restart: Restart::Source,
            ..ONE_QUEUE
        },
    );
}

/// The destination daemon is SIGKILLed and restarted while its QEMU waits
/// for the incoming state: QEMU reconnects before the switch-over and the
/// guest goes on on the destination with every block verified.
#[test]
fn guest_migrates_while_the_destination_daemon_restarts() {
    migrate_with_io(
        "uring-restart-dst",
        Setup {
            restart: Restart::Destination,
            ..ONE_QUEUE
        },
    );
}

// ------------------------------------------------------------------ the protocol, without QEMU

#[path = "common/frontend.rs"]
mod frontend;

/// VHOST_USER_PROTOCOL_F_LOG_SHMFD.
const PF_LOG_SHMFD: u64 = 1 << 1;
/// VHOST_F_LOG_ALL.
const F_LOG_ALL: u64 = 1 << 26;
const SET_LOG_BASE: u32 = 6;

/// A raw frontend with the dirty-log protocol feature, memory and vring 0.
fn logging_frontend(sock: &Path) -> frontend::Frontend {
    let mut f = frontend::Frontend::connect_when_listening(sock);
    let pf = f.negotiate_with(PF_LOG_SHMFD);
    assert!(pf & PF_LOG_SHMFD != 0, "LOG_SHMFD not offered");
    assert!(f.features & F_LOG_ALL != 0, "VHOST_F_LOG_ALL not offered");
    assert!(f.set_mem_table(&[f.whole_region()]).ok(), "SET_MEM_TABLE");
    assert!(f.setup_ring(0).ok(), "ring setup");
    f
}

/// SET_LOG_BASE with `file`: the daemon's answer (a 16-byte reply on success).
fn set_log_base(
    f: &mut frontend::Frontend,
    file: &fs::File,
    size: u64,
    offset: u64,
) -> frontend::Reply {
    use std::os::fd::AsRawFd;
    let mut p = size.to_le_bytes().to_vec();
    p.extend_from_slice(&offset.to_le_bytes());
    f.call_ack(SET_LOG_BASE, &p, &[file.as_raw_fd()])
}

/// The pages marked in the log file's first `bytes` bytes.
fn marked(file: &fs::File, bytes: usize) -> Vec<u64> {
    let mut buf = vec![0u8; bytes];
    file.read_exact_at(&mut buf, 0).unwrap();
    (0..bytes as u64 * 8)
        .filter(|p| buf[(p / 8) as usize] & (1 << (p % 8)) != 0)
        .collect()
}

/// A raw frontend, as QEMU does when a migration starts: SET_LOG_BASE, LOG_ALL
/// acked, SET_VRING_ADDR with VHOST_VRING_F_LOG on the running ring. A read
/// then marks exactly its data page, its status page and the used ring's page;
/// with LOG_ALL dropped nothing is marked. Short logs and windows beyond the
/// file are refused (the connection closes) and the daemon lives on.
#[test]
fn dirty_log_over_the_protocol() {
    use frontend::{req, Reply, DATA, MEM_SIZE, STATUS, T_IN, USED};
    let dir = common::scratch("mig-protocol");
    let sock = dir.join("d.sock");
    let log = fs::File::create(dir.join("daemon.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_vqblk"))
        .arg("serve")
        .arg("--image")
        .arg(dir.join("disk.raw"))
        .args(["--create", "16M", "--iothreads", "1"])
        .arg("--socket")
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    // Killed when dropped, also when an assertion fails.
    let mut daemon = Proc {
        child,
        tag: "vqblk".into(),
    };
    let daemon_log = || fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
    let needed = (MEM_SIZE / 4096 / 8) as usize;
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("log"))
        .unwrap();
    file.set_len(4096).unwrap();

    let mut f = logging_frontend(&sock);
    match set_log_base(&mut f, &file, needed as u64, 0) {
        Reply::Data(p) if p.len() == 16 => {}
        r => panic!("SET_LOG_BASE: {r:?}\n{}", daemon_log()),
    }
    // The used ring's log address (guest-physical), as QEMU sends it.
    let u = f.mem.user_addr();
    let mut addr = 0u32.to_le_bytes().to_vec();
    addr.extend_from_slice(&1u32.to_le_bytes()); // VHOST_VRING_F_LOG
    for v in [u + frontend::DESC, u + USED, u + frontend::AVAIL, USED] {
        addr.extend_from_slice(&v.to_le_bytes());
    }
    assert!(f.call_ack(req::SET_VRING_ADDR, &addr, &[]).ok());
    assert_eq!(f.request(T_IN, 0, 4096), Some(frontend::S_OK));
    let want = vec![USED / 4096, STATUS / 4096, DATA / 4096];
    assert_eq!(marked(&file, needed), want, "{}", daemon_log());

    // Migration over: LOG_ALL dropped, nothing more is marked.
    file.write_all_at(&vec![0u8; needed], 0).unwrap();
    let features = f.features & !F_LOG_ALL;
    assert!(f
        .call_ack(req::SET_FEATURES, &frontend::u64_payload(features), &[])
        .ok());
    assert_eq!(f.request(T_IN, 8, 4096), Some(frontend::S_OK));
    assert_eq!(marked(&file, needed), Vec::<u64>::new());
    drop(f);

    // Refused: too short for 1 MiB of guest memory, beyond the file, unaligned.
    for (size, offset) in [
        (needed as u64 - 1, 0),
        (needed as u64, 8192),
        (needed as u64, 100),
    ] {
        let mut f = logging_frontend(&sock);
        let r = set_log_base(&mut f, &file, size, offset);
        assert!(r.refused(), "size {size} offset {offset}: {r:?}");
        assert!(daemon.alive(), "daemon died: {}", daemon_log());
    }
    let mut f = logging_frontend(&sock);
    f.check_io(16, 7, "after the refused logs");
    assert!(daemon_log().contains("SET_LOG_BASE refused"));
    drop(daemon);
    let _ = fs::remove_dir_all(&dir);
}
