//! libvirt end to end: the domain XML of docs/qemu.md (`<disk type='vhostuser'>`,
//! memfd shared memory) run by the real libvirt against `vqblk serve`.
//!
//! `scripts/run-guest-libvirt.sh` starts libvirt's daemons when they are not
//! running, creates a transient TCG domain booting the test guest (the kit of
//! `tests/guest_e2e.rs`: a Debian kernel and `scripts/guest-init.sh`), and
//! reports the guest's `VQBLK-RESULT`. The guest writes patterns on every
//! queue and reads them back; the host then checks the image
//! (`scripts/check-image.py`). Never skipped: a missing libvirt is a failure
//! (`scripts/install-deps.sh` installs it).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const SERIAL: &str = "VQBLK-LIBVIRT";
const QUEUES: u16 = 2;
const WRITERS: u32 = 2;
const REGION_KIB: u32 = 1024;
const SEED: u32 = 7;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `vqblk serve`, killed when dropped.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_socket(path: &Path, daemon: &mut Daemon, log: &Path) {
    let t = Instant::now();
    while !path.exists() {
        if let Ok(Some(st)) = daemon.0.try_wait() {
            panic!(
                "vqblk serve exited ({st}) before binding its socket:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no socket after 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_libvirt_domain_with_a_vhostuser_disk_boots_and_its_writes_land() {
    // QEMU runs as libvirt's qemu user: it must reach the socket.
    let dir = tempfile::Builder::new()
        .prefix("vqblk-libvirt-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let image = dir.path().join("disk.raw");
    let socket = dir.path().join("disk.sock");
    let log = dir.path().join("daemon.log");
    let guest_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("vqblk-guest");
    let mut daemon = Daemon(
        Command::new(env!("CARGO_BIN_EXE_vqblk"))
            .arg("serve")
            .args(["--image".as_ref(), image.as_os_str()])
            .args(["--create", "256M"])
            .args(["--socket".as_ref(), socket.as_os_str()])
            .args(["--socket-mode", "0666"])
            .args(["--queues", &QUEUES.to_string(), "--iothreads", "2"])
            .args(["--serial", SERIAL])
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for_socket(&socket, &mut daemon, &log);

    let append = format!(
        "vqblk.mode=rw vqblk.queues={QUEUES} vqblk.mq_queues={QUEUES} vqblk.serial={SERIAL} \
         vqblk.writers={WRITERS} vqblk.region_kib={REGION_KIB} vqblk.seed={SEED} vqblk.timeout=280"
    );
    let xml = dir.path().join("domain.xml");
    let out = Command::new(repo().join("scripts/run-guest-libvirt.sh"))
        .args(["--socket".as_ref(), socket.as_os_str()])
        .args(["--queues", &QUEUES.to_string()])
        .args(["--append", &append])
        .args(["--guest-dir".as_ref(), guest_dir.as_os_str()])
        .args(["--xml-out".as_ref(), xml.as_os_str()])
        .args(["--timeout", "300"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let diag = || {
        format!(
            "run-guest-libvirt.sh: {}\n{stderr}\ndaemon log:\n{}",
            out.status,
            fs::read_to_string(&log).unwrap_or_default()
        )
    };
    assert!(out.status.success(), "{}", diag());
    let r: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", diag()));
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["serial"], SERIAL, "{r}");
    assert_eq!(r["mq_queues"], QUEUES, "{r}");
    let writers = r["writers"].as_array().map_or(0, |w| w.len());
    assert_eq!(writers, WRITERS as usize, "{r}");

    // The XML libvirt accepted is the one docs/qemu.md shows: a vhostuser disk
    // on the socket, with shared memfd memory.
    let xml = fs::read_to_string(&xml).unwrap();
    for want in [
        "<disk type='vhostuser' device='disk'>",
        "<source type='memfd'/>",
        "<access mode='shared'/>",
    ] {
        assert!(xml.contains(want), "{want} not in:\n{xml}");
    }

    // What the guest wrote is in the image.
    drop(daemon);
    let check = Command::new("python3")
        .arg(repo().join("scripts/check-image.py"))
        .arg(&image)
        .args(["--writers", &WRITERS.to_string()])
        .args(["--region-kib", &REGION_KIB.to_string()])
        .args(["--seed", &SEED.to_string()])
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "check-image.py: {}\n{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
}
