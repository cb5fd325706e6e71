//! A throw-away Ceph cluster for the RBD tests (scripts/ceph/start.sh), stopped
//! and wiped when its guard is dropped, also when a test fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use vqblk_daemon::config::{BackendKind, ExportConfig};

use super::scratch;

/// The throw-away cluster; stopped and wiped on drop.
pub struct Cluster {
    /// CEPH_DIR.
    pub dir: PathBuf,
    /// Its ceph.conf.
    pub conf: PathBuf,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts/ceph")
        .join(name)
}

pub fn show(o: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

impl Cluster {
    /// Starts a cluster whose monitor listens on `mon_port` (distinct per test
    /// binary, so they can run at once).
    pub fn start(mon_port: u16) -> Cluster {
        stop_orphans(mon_port);
        let dir =
            std::env::temp_dir().join(format!("vqblk-ceph-{mon_port}-{}", std::process::id()));
        let c = Cluster {
            conf: dir.join("ceph.conf"),
            dir,
        };
        // Bounded: the script's own steps time out, and the whole at 180 s.
        let o = Command::new("timeout")
            .args(["-k", "5", "180"])
            .arg(script("start.sh"))
            .env("CEPH_DIR", &c.dir)
            .env("MON_PORT", mon_port.to_string())
            .output()
            .expect("run scripts/ceph/start.sh");
        // On failure the guard `c` stops what did start.
        assert!(
            o.status.success(),
            "the test cluster did not start: {}",
            show(&o)
        );
        c
    }

    /// Runs the `rbd` CLI against this cluster; panics with its output on failure.
    pub fn rbd(&self, args: &[&str]) -> Output {
        let o = Command::new("timeout")
            .args(["-k", "5", "60", "rbd", "--conf"])
            .arg(&self.conf)
            .args(args)
            .output()
            .expect("run rbd");
        assert!(o.status.success(), "rbd {args:?}: {}", show(&o));
        o
    }

    /// The whole image as bytes (`rbd export`).
    pub fn export_bytes(&self, image: &str) -> Vec<u8> {
        let f = self.dir.join("export.raw");
        let _ = std::fs::remove_file(&f);
        self.rbd(&["export", "--no-progress", image, f.to_str().unwrap()]);
        let data = std::fs::read(&f).unwrap();
        std::fs::remove_file(&f).unwrap();
        data
    }

    pub fn export(&self, image: &str, queues: u16) -> ExportConfig {
        let dir = scratch(&format!("rbd-{}", image.replace(['/', '@'], "-")));
        let mut e = ExportConfig::new(dir.join("disk.sock"));
        e.backend = BackendKind::Rbd;
        e.image = Some(PathBuf::from(format!("rbd:{image}")));
        e.ceph_conf = Some(self.conf.clone());
        e.ceph_op_timeout = Some(20);
        e.queues = queues;
        e
    }
}

/// Stops the clusters an earlier run of a test binary on `mon_port` left
/// behind when it was killed before its guard could (a debugger, a signal, a
/// timeout): its monitor would hold the port and this run's cluster could not
/// start. Such a cluster's directory names the pid of a process that is gone.
fn stop_orphans(mon_port: u16) {
    let prefix = format!("vqblk-ceph-{mon_port}-");
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(&prefix)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        eprintln!(
            "stopping the cluster a killed test run left in {}",
            e.path().display()
        );
        stop(&e.path());
    }
}

/// Stops and wipes the cluster in `dir` (scripts/ceph/stop.sh, bounded).
fn stop(dir: &Path) {
    let _ = Command::new("timeout")
        .args(["-k", "5", "60"])
        .arg(script("stop.sh"))
        .env("CEPH_DIR", dir)
        .status();
}

impl Drop for Cluster {
    fn drop(&mut self) {
        stop(&self.dir);
    }
}
