//! Shared by the integration tests: where the `vqblk` binary is, and running it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::SystemTime;

fn mtime(p: &Path) -> SystemTime {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// The newest modification time of the files under `dir`, subfolders
/// (`src/sweep/`) included.
fn newest(dir: &Path) -> SystemTime {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                newest(&p)
            } else {
                mtime(&p)
            }
        })
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// The `vqblk` binary: `$VQBLK_BIN`, else the one next to this test's target
/// directory (`<target>/<profile>/vqblk`), else `../../target/{release,debug}/vqblk`.
/// This crate is a library, so `cargo test -p vqblk-study` does not build the binary:
/// `cargo build -p vqblk` (same profile) first, or run `cargo test --workspace`.
/// A binary older than this crate's sources is refused (it would test old code).
pub fn vqblk_bin() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let found = if let Some(p) = std::env::var_os("VQBLK_BIN") {
        PathBuf::from(p)
    } else {
        let exe = std::env::current_exe().expect("test executable path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("<target>/<profile>/deps");
        let mut candidates = vec![profile_dir.join("vqblk")];
        for profile in ["release", "debug"] {
            candidates.push(manifest.join("../../target").join(profile).join("vqblk"));
        }
        match candidates.iter().find(|p| p.is_file()) {
            Some(p) => p.clone(),
            None => panic!(
                "the vqblk binary is missing (looked at {candidates:?}): build it first with \
                 `cargo build -p vqblk` in the same profile and target directory, or set VQBLK_BIN"
            ),
        }
    };
    assert!(
        found.is_file(),
        "VQBLK_BIN={} is not a file",
        found.display()
    );
    let newest_src = newest(&manifest.join("src"));
    assert!(
        mtime(&found) >= newest_src,
        "{} is older than crates/study/src: rebuild it (`cargo build -p vqblk`) so the test runs the current code",
        found.display()
    );
    found
}

/// Runs `vqblk ARGS` in `dir`, returning its output.
pub fn vqblk(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new(vqblk_bin())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run vqblk");
    eprintln!(
        "$ vqblk {}\n[exit {:?}]\n{}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Like [`vqblk`], asserting exit code 0; returns stdout.
pub fn vqblk_ok(dir: &Path, args: &[&str]) -> String {
    let out = vqblk(dir, args);
    assert!(
        out.status.success(),
        "vqblk {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}
