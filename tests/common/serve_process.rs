//! A `vqblk serve` child process whose stderr goes to a log file, for the
//! tests that kill, restart or upgrade the daemon itself.

use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

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
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
