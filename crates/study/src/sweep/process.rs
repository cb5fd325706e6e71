//! The child processes of a sweep: the server of a column and each bench run.

use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use wait_timeout::ChildExt;

/// How long a server may take to create its socket.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a server may take to exit cleanly after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// A running server (vqblk serve or qemu-storage-daemon), its output in a log file.
pub(super) struct ServerProc {
    child: Child,
    log: PathBuf,
}

impl ServerProc {
    /// Starts `argv` and waits until it listens on `socket`.
    pub(super) fn start(argv: &[OsString], socket: &Path, log: &Path) -> anyhow::Result<Self> {
        let _ = std::fs::remove_file(socket);
        let out = File::create(log)?;
        let name = Path::new(&argv[0]).display().to_string();
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        let mut s = ServerProc {
            child,
            log: log.to_path_buf(),
        };
        let deadline = Instant::now() + LISTEN_TIMEOUT;
        loop {
            if let Some(st) = s.child.try_wait()? {
                bail!("{name} exited ({st}) before listening:\n{}", s.log_tail());
            }
            if socket.exists() {
                return Ok(s);
            }
            if Instant::now() > deadline {
                s.stop();
                bail!(
                    "{name} did not create {} within {} s:\n{}",
                    socket.display(),
                    LISTEN_TIMEOUT.as_secs(),
                    s.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Process id (what `vqblk bench --server-pid` measures the CPU of).
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the server still runs.
    pub(super) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The last 15 lines of its log.
    pub(super) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGTERM (clean exit: drain, sync), SIGKILL after [`STOP_TIMEOUT`].
    pub(super) fn stop(&mut self) -> Option<ExitStatus> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st);
        }
        // SAFETY: kill(2) only sends a signal; the pid is our own child's, which has
        // not been reaped (try_wait just saw it running), so it names no other process.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        if let Ok(Some(st)) = self.child.wait_timeout(STOP_TIMEOUT) {
            return Some(st);
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Reads a child's pipe to the end on its own thread, so a full pipe never blocks it.
fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    })
}

/// Runs a command with a time limit; returns stdout, or an error with stderr.
pub(super) fn run_with_timeout(argv: &[String], limit: Duration) -> anyhow::Result<String> {
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", argv[0]))?;
    let out = drain(child.stdout.take().expect("stdout is piped"));
    let err = drain(child.stderr.take().expect("stderr is piped"));
    let status = child.wait_timeout(limit)?;
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    match status {
        None => bail!("timed out after {} s: {}", limit.as_secs(), err.trim()),
        Some(st) if !st.success() => bail!("{st}: {}", err.trim()),
        Some(_) => Ok(out),
    }
}
