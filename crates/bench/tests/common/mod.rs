//! Test helpers: a real vhost-user-blk peer (qemu-storage-daemon) and a way to run the
//! bench through its library API, capturing the report and the exit code.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A qemu-storage-daemon exporting one vhost-user-blk socket; killed on drop.
pub struct Qsd {
    child: Child,
    /// Temporary directory holding the socket and the image.
    pub dir: tempfile::TempDir,
    /// The socket.
    pub sock: PathBuf,
    /// The raw image (file backend only).
    pub image: Option<PathBuf>,
}

fn need(tool: &str) {
    let ok = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{tool} is required by these tests and was not found or does not run \
         (install the qemu-system-common / qemu-utils packages); refusing to skip"
    );
}

impl Qsd {
    /// A raw image of `size` bytes on a file backend (O_DIRECT, io_uring).
    pub fn file(size: u64) -> Self {
        need("qemu-img");
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("disk.raw");
        let st = Command::new("qemu-img")
            .args(["create", "-q", "-f", "raw"])
            .arg(&image)
            .arg(size.to_string())
            .status()
            .expect("run qemu-img");
        assert!(st.success(), "qemu-img create failed");
        let blockdev = format!(
            "driver=file,node-name=f,filename={},cache.direct=on,aio=io_uring",
            image.display()
        );
        Self::spawn(dir, &blockdev, Some(image))
    }

    /// A null backend of `size` bytes that reads zeroes.
    pub fn null(size: u64) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let blockdev = format!("driver=null-co,node-name=f,size={size},read-zeroes=on");
        Self::spawn(dir, &blockdev, None)
    }

    fn spawn(dir: tempfile::TempDir, blockdev: &str, image: Option<PathBuf>) -> Self {
        need("qemu-storage-daemon");
        let sock = dir.path().join("vhost.sock");
        let export = format!(
            "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=on,num-queues=4",
            sock.display()
        );
        let child = Command::new("qemu-storage-daemon")
            .args(["--blockdev", blockdev, "--export", &export])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn qemu-storage-daemon");
        let mut q = Qsd {
            child,
            dir,
            sock,
            image,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !q.sock.exists() {
            if let Ok(Some(st)) = q.child.try_wait() {
                panic!("qemu-storage-daemon exited early: {st}");
            }
            assert!(
                Instant::now() < deadline,
                "qemu-storage-daemon did not create {}",
                q.sock.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        q
    }

    /// `unix:SOCK`.
    pub fn target(&self) -> String {
        format!("unix:{}", self.sock.display())
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Qsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Outcome of one bench run.
pub struct Run {
    /// Exit code as `vqblk` would return it (2 for an error).
    pub code: i32,
    /// What the report printed.
    pub stdout: String,
    /// The error, for code 2.
    pub error: Option<String>,
}

impl Run {
    /// The report parsed as JSON (panics with the output otherwise).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}); code {} error {:?}:\n{}",
                self.code, self.error, self.stdout
            )
        })
    }
}

/// Runs `vqblk bench ARGS` through the library, with a hook between verify passes.
pub fn bench_with_hook(args: &[&str], hook: &mut dyn FnMut() -> anyhow::Result<()>) -> Run {
    let parsed = match vqblk_bench::parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            return Run {
                code: e.exit_code(),
                stdout: String::new(),
                error: Some(e.to_string()),
            }
        }
    };
    let mut out = Vec::new();
    let r = vqblk_bench::run_to(&parsed, &mut out, hook);
    Run {
        code: vqblk_bench::exit_code(&r),
        stdout: String::from_utf8_lossy(&out).into_owned(),
        error: r.err().map(|e| format!("{e:#}")),
    }
}

/// Runs `vqblk bench ARGS` through the library.
pub fn bench(args: &[&str]) -> Run {
    bench_with_hook(args, &mut || Ok(()))
}

/// Inverts every bit of `len` bytes at `offset` of `path`, so each of them differs from
/// what was there whatever the verify pass wrote. (Writing a fixed pattern instead
/// left a one-byte corruption undetected whenever the payload byte already had that
/// value: one run in 256.)
pub fn corrupt(path: &Path, offset: u64, len: usize) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open image");
    let mut bytes = vec![0u8; len];
    f.read_exact_at(&mut bytes, offset).expect("read image");
    for b in &mut bytes {
        *b = !*b;
    }
    f.write_all_at(&bytes, offset).expect("corrupt");
    f.sync_all().expect("sync");
}

/// Checks fio's invariant for one direction object and returns `total_ios`.
pub fn check_dir(d: &Value, bs: u64) -> u64 {
    let ios = d["total_ios"].as_u64().expect("total_ios");
    let bytes = d["io_bytes"].as_u64().expect("io_bytes");
    assert_eq!(ios * bs, bytes, "total_ios * bs != io_bytes in {d}");
    ios
}
