//! A `vqblk serve` child process whose stderr goes to a log file, for the
//! tests that kill, restart or upgrade the daemon itself.

use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A `vqblk serve` process, killed when dropped.
pub struct ServeProcess {
    pub child: Child,
    pub log: PathBuf,
}

impl ServeProcess {
    /// `vqblk serve ARGS`, logging to `dir/daemon-RUN.log`.
    pub fn spawn<I, S>(dir: &Path, run: u32, args: I) -> ServeProcess
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let log = dir.join(format!("daemon-{run}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_vqblk"))
            .arg("serve")
            .args(args)
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap())
            .spawn()
            .unwrap();
        ServeProcess { child, log }
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to 10 s for `needle` in the log.
    pub fn logged(&self, needle: &str) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if self.log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Waits up to `limit` for the process to exit on its own.
    pub fn exited_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// SIGKILL (`Child::kill`): no drain, no cleanup, the socket file stays.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
