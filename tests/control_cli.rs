//! `vqblk ctl` and `vqblk top` against a `vqblk serve --control` process.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

fn vqblk() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vqblk"))
}

/// `vqblk serve` on a null export "db" (2 queues over 2 IOThreads) with a
/// control socket; killed and reaped when dropped.
struct Server {
    child: Child,
    control: PathBuf,
}

impl Server {
    fn start(dir: &Path) -> Server {
        let control = dir.join("control.sock");
        let child = vqblk()
            .args([
                "serve",
                "--backend",
                "null",
                "--size",
                "64M",
                "--queues",
                "2",
            ])
            .args(["--iothreads", "2", "--name", "db", "--log-level", "warn"])
            .arg("--socket")
            .arg(dir.join("db.sock"))
            .arg("--control")
            .arg(&control)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !control.exists() {
            assert!(t.elapsed() < Duration::from_secs(10), "no control socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        Server { child, control }
    }

    fn ctl(&self, args: &[&str]) -> Output {
        vqblk()
            .arg("ctl")
            .arg("--control")
            .arg(&self.control)
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn ctl_prints_tables_json_and_errors() {
    let dir = scratch("ctl-cli");
    let server = Server::start(&dir);
    let o = server.ctl(&["query-iothreads"]);
    assert!(o.status.success(), "{o:?}");
    let lines: Vec<String> = stdout(&o).lines().map(String::from).collect();
    assert!(lines[0].starts_with("ID  TID"), "{lines:?}");
    assert!(
        lines[0].contains("PUBLISHES") && lines[0].contains("CALLS/SUPP"),
        "{lines:?}"
    );
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(
        lines[1].contains("adaptive") && lines[1].ends_with("db/0"),
        "{lines:?}"
    );

    let o = server.ctl(&["query-exports", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).expect("--json prints JSON");
    assert_eq!(v[0]["name"], "db");
    assert_eq!(v[0]["queues"][1]["iothread"], 1);
    let o = server.ctl(&["--json", "query-exports"]);
    assert!(serde_json::from_slice::<Value>(&o.stdout).is_ok());
    let o = server.ctl(&["query-exports"]);
    let table = stdout(&o);
    assert!(
        table.starts_with("EXPORT") && table.lines().count() == 3,
        "{table}"
    );

    let o = server.ctl(&[
        "iothread-set",
        "--id",
        "0",
        "--poll-max-ns",
        "0",
        "--poll",
        "classic",
    ]);
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains("mode: classic"));
    let o = server.ctl(&["query-iothreads", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (&v[0]["poll"]["mode"], &v[0]["poll"]["poll-max-ns"]),
        (&Value::from("classic"), &Value::from(0))
    );

    // Errors: the daemon's message (naming the parameter) and exit 1.
    let o = server.ctl(&["iothread-set", "--id", "7"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("id: 7 is out of range"), "{err}");
    let o = server.ctl(&[
        "queue-move",
        "--export",
        "db",
        "--queue",
        "9",
        "--iothread",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("queue: "));
    let o = server.ctl(&["frobnicate"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown method"));
    // export-add / export-del from the command line.
    let e2 = dir.join("e2.sock");
    let o = server.ctl(&[
        "export-add",
        "--name",
        "e2",
        "--backend",
        "null",
        "--size",
        "1M",
        "--socket",
        e2.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{o:?}");
    assert!(e2.exists());
    let o = server.ctl(&["export-del", "--name", "e2"]);
    assert_eq!(stdout(&o), "ok\n");
    assert!(!e2.exists());
    // No daemon there: exit 2.
    let o = vqblk()
        .args(["ctl", "--control"])
        .arg(dir.join("none.sock"))
        .arg("query-exports")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}

/// A tmux session of 80x24 running `vqblk top`; killed when dropped.
struct Tmux(String);

impl Tmux {
    fn capture(&self) -> String {
        let o = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    fn alive(&self) -> bool {
        Command::new("tmux")
            .args(["has-session", "-t", &self.0])
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
    }
    fn keys(&self, k: &str) {
        Command::new("tmux")
            .args(["send-keys", "-t", &self.0, k])
            .status()
            .unwrap();
    }
    /// Waits until the pane shows `what` (or panics with what it shows).
    fn wait_for(&self, what: &str) -> String {
        let t = Instant::now();
        loop {
            let s = self.capture();
            if s.contains(what) {
                return s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{what:?} never shown:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    fn wait_gone(&self) {
        let t = Instant::now();
        while self.alive() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "vqblk top did not exit:\n{}",
                self.capture()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .stderr(Stdio::null())
            .status();
    }
}

fn top_in_tmux(name: &str, control: &Path) -> Tmux {
    // The pane closes when top exits, which is how the tests see it exit;
    // a marker file says it exited 0.
    let done = control.with_extension(format!("{name}.exit"));
    let _ = std::fs::remove_file(&done);
    let cmd = format!(
        "{} top --control {} --delay 0.2; echo $? > {}",
        env!("CARGO_BIN_EXE_vqblk"),
        control.display(),
        done.display()
    );
    let session = format!("vqblk-top-{name}-{}", std::process::id());
    let ok = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "24",
            "-s",
            &session,
            &cmd,
        ])
        .status()
        .unwrap()
        .success();
    assert!(ok, "tmux new-session");
    Tmux(session)
}

#[test]
fn top_shows_the_iothreads_sorts_and_quits() {
    if Command::new("tmux").arg("-V").output().is_err() {
        panic!("tmux is needed (scripts/install-deps.sh installs it)");
    }
    let dir = scratch("ctl-top");
    let server = Server::start(&dir);
    // Some I/O, so that the rates are not all zero.
    let mut c = Client::connect(&dir.join("db.sock"), 2).unwrap();
    let tmux = top_in_tmux("q", &server.control);
    let screen = tmux.wait_for("EXPORT/QUEUE");
    assert!(screen.contains("IOThreads: 2"), "{screen}");
    assert!(
        screen.contains("CPU%") && screen.contains("HIT%") && screen.contains("NAPS/s"),
        "{screen}"
    );
    assert!(
        screen.contains("db/0") && screen.contains("db/1"),
        "{screen}"
    );
    assert!(screen.lines().all(|l| l.chars().count() <= 80));
    for i in 0..200 {
        assert_eq!(c.write(i % 2, 0, 0, 4096), 0);
    }
    tmux.keys("i");
    tmux.wait_for("sort Iops");
    tmux.keys("c");
    tmux.wait_for("sort Cpu");
    tmux.keys("q");
    tmux.wait_gone();
    let exit = std::fs::read_to_string(server.control.with_extension("q.exit")).unwrap();
    assert_eq!(exit.trim(), "0");

    // Ctrl-C quits too (raw mode turns it into a key).
    let tmux = top_in_tmux("c", &server.control);
    tmux.wait_for("EXPORT/QUEUE");
    tmux.keys("C-c");
    tmux.wait_gone();
    let exit = std::fs::read_to_string(server.control.with_extension("c.exit")).unwrap();
    assert_eq!(exit.trim(), "0");

    // SIGTERM ends it cleanly too (exit 0, terminal restored), not by the
    // signal's default action (exit 143, the terminal left in raw mode).
    let tmux = top_in_tmux("t", &server.control);
    tmux.wait_for("EXPORT/QUEUE");
    // Anchored: the shell that runs it in the pane has the same words.
    let pattern = format!(
        "^{} top --control {} ",
        env!("CARGO_BIN_EXE_vqblk"),
        server.control.display()
    );
    let ok = Command::new("pkill")
        .args(["-TERM", "-f", &pattern])
        .status()
        .unwrap()
        .success();
    assert!(ok, "pkill found no vqblk top");
    tmux.wait_gone();
    let exit = std::fs::read_to_string(server.control.with_extension("t.exit")).unwrap();
    assert_eq!(exit.trim(), "0", "vqblk top ended by SIGTERM");

    // Its window goes away without a signal reaching it (the shell in the
    // pane is killed, tmux closes the terminal): it must exit, not spin on
    // the dead terminal (crossterm 0.29 loops there forever, a CPU at 100%).
    let tmux = top_in_tmux("h", &server.control);
    tmux.wait_for("EXPORT/QUEUE");
    let top = format!(
        "^{} top --control {} ",
        env!("CARGO_BIN_EXE_vqblk"),
        server.control.display()
    );
    // The pane's shell is top's parent.
    let pid = Command::new("pgrep").args(["-f", &top]).output().unwrap();
    let pid = String::from_utf8_lossy(&pid.stdout).trim().to_string();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let ppid = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap();
    assert!(Command::new("kill")
        .args(["-KILL", ppid])
        .status()
        .unwrap()
        .success());
    let t = Instant::now();
    while Command::new("pgrep")
        .args(["-f", &top])
        .stdout(Stdio::null())
        .status()
        .unwrap()
        .success()
    {
        if t.elapsed() > Duration::from_secs(10) {
            let _ = Command::new("pkill").args(["-KILL", "-f", &top]).status();
            panic!("vqblk top still runs 10 s after its terminal went away");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(c);
}
