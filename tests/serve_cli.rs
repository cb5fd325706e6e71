//! The `vqblk serve` process: flags, socket mode, signals, exit codes.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn vqblk() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vqblk"))
}

fn wait_for(path: &std::path::Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `vqblk serve` on a 64 MiB null export, 2 queues over 2 IOThreads, with a
/// stats file; returns once the socket exists.
fn null_server(sock: &std::path::Path, stats: &std::path::Path) -> std::process::Child {
    let child = vqblk()
        .args([
            "serve",
            "--backend",
            "null",
            "--size",
            "64M",
            "--queues",
            "2",
            "--iothreads",
            "2",
        ])
        .arg("--socket")
        .arg(sock)
        .arg("--stats-file")
        .arg(stats)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(sock);
    child
}

#[test]
fn sigterm_drains_removes_socket_and_exits_zero() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let dir = scratch(&format!("cli-{sig}"));
        let sock = dir.join("d.sock");
        let stats = dir.join("stats.json");
        let mut child = null_server(&sock, &stats);
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let mut c = Client::connect(&sock, 2).unwrap();
        for q in 0..2 {
            assert_eq!(c.read(q, 0, 0, 4096), 0);
        }
        // Signal with the client still connected: the daemon drains and exits.
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "signal {sig}");
        assert!(!sock.exists(), "socket removed");
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
        let threads = s["iothreads"].as_array().unwrap();
        assert_eq!(threads.len(), 2);
        for t in threads {
            assert_eq!(t["requests"], 1, "{t}");
        }
        drop(c);
    }
}

#[test]
fn socket_mode_flag() {
    let dir = scratch("cli-mode");
    let sock = dir.join("d.sock");
    let mut child = vqblk()
        .args([
            "serve",
            "--backend",
            "null",
            "--size",
            "1M",
            "--socket-mode",
            "0660",
            "--socket",
        ])
        .arg(&sock)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&sock);
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o660
    );
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

#[test]
fn bad_input_exits_2_naming_the_field() {
    let dir = scratch("cli-bad");
    let sock = dir.join("d.sock");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--queues".into(), "0".into()],
            "--queues: 0 is out of range",
        ),
        (
            vec![
                "--queues".into(),
                "4".into(),
                "--map".into(),
                "0:0,1,2".into(),
            ],
            "--map: virtqueue 3 is not assigned",
        ),
        (
            vec![
                "--queues".into(),
                "2".into(),
                "--map".into(),
                "0:0,1;1:1".into(),
            ],
            "--map: virtqueue 1 is assigned twice",
        ),
        (vec!["--map".into(), "zz".into()], "--map: cannot parse"),
        (
            vec![
                "--image".into(),
                dir.join("missing.raw").display().to_string(),
            ],
            "does not exist (pass --create SIZE",
        ),
        (
            vec!["--backend".into(), "null".into()],
            "--size: the null backend needs a size",
        ),
        (
            vec![
                "--log-level".into(),
                "loud".into(),
                "--backend".into(),
                "null".into(),
            ],
            "--log-level",
        ),
    ];
    for (args, want) in cases {
        let out = vqblk()
            .arg("serve")
            .arg("--socket")
            .arg(&sock)
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let cfg = dir.join("bad.toml");
    std::fs::write(
        &cfg,
        "[[export]]\nsocket = \"/tmp/x.sock\"\nimage = \"/i\"\nqueues = 0\n",
    )
    .unwrap();
    let out = vqblk()
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("export[0].queues: 0 is out of range"), "{err}");
}

/// Reservations and weights are enforced: an export that sets either is
/// served (they were refused while the request engine did not enforce them).
#[test]
fn reservations_and_weights_are_served() {
    let dir = scratch("cli-shares");
    let cfg = dir.join("vqblk.toml");
    for (key, extra) in [
        ("reservation-iops", "reservation-iops = 100\n"),
        ("weight", "weight = 3\n"),
    ] {
        // A file image: the share allocator's thread stats it under its
        // seccomp filter.
        let (sock, image) = (
            dir.join(format!("{key}.sock")),
            dir.join(format!("{key}.img")),
        );
        std::fs::write(
            &cfg,
            format!("[[export]]\nsocket = {sock:?}\nimage = {image:?}\ncreate = \"1M\"\n{extra}"),
        )
        .unwrap();
        let mut child = vqblk()
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_for(&sock);
        // A few of the allocator's ticks.
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            child.try_wait().unwrap().is_none(),
            "{key}: the daemon exited"
        );
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert!(status.success(), "{key}: {status}");
    }
}

/// Two exports from one TOML file share one pool of IOThreads.
#[test]
fn config_file_exports_share_the_pool() {
    let dir = scratch("cli-toml");
    let cfg = dir.join("vqblk.toml");
    let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
    std::fs::write(
        &cfg,
        format!(
            "[iothreads]\ncount = 2\n\n[[export]]\nname = \"a\"\nbackend = \"null\"\nsize = \"16M\"\nsocket = \"{}\"\nqueues = 2\n\n\
             [[export]]\nname = \"b\"\nimage = \"{}\"\ncreate = \"16M\"\nsocket = \"{}\"\nqueues = 2\n\
             iothread-vq-mapping = [{{ iothread = 1, vqs = [0] }}, {{ iothread = 0, vqs = [1] }}]\n",
            a.display(),
            dir.join("b.raw").display(),
            b.display()
        ),
    )
    .unwrap();
    let stats = dir.join("stats.json");
    let mut child = vqblk()
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--stats-file")
        .arg(&stats)
        .spawn()
        .unwrap();
    wait_for(&a);
    wait_for(&b);
    {
        let mut ca = Client::connect(&a, 2).unwrap();
        let mut cb = Client::connect(&b, 2).unwrap();
        for q in 0..2 {
            assert_eq!(ca.read(q, 0, 0, 4096), 0);
            assert_eq!(cb.write(q, 4096 * q as u64, 0, 4096), 0);
        }
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let served = |t: usize| -> Vec<(String, u64)> {
        s["iothreads"][t]["queues"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| {
                (
                    q["export"].as_str().unwrap().to_string(),
                    q["queue"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(served(0), vec![("a".into(), 0), ("b".into(), 1)]);
    assert_eq!(served(1), vec![("a".into(), 1), ("b".into(), 0)]);
}

/// Runs `vqblk bench --output-format json` with `args` against the null
/// server on `sock` (with its pid and stats file), stops the server, and
/// returns the report, the client's read count and the requests the
/// report's `server_iothreads` say the server served.
fn bench_with_server_stats(name: &str, args: &[&str]) -> (serde_json::Value, u64, u64) {
    let dir = scratch(name);
    let sock = dir.join("d.sock");
    let stats = dir.join("stats.json");
    let mut child = null_server(&sock, &stats);
    let out = vqblk()
        .args(["bench", "--rw", "randread", "--bs", "4k"])
        .args(args)
        .args(["--output-format", "json", "--group_reporting"])
        .arg(format!("--target=unix:{}", sock.display()))
        .arg(format!("--server-pid={}", child.id()))
        .arg("--server-stats")
        .arg(&stats)
        .output()
        .unwrap();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ios = j["jobs"][0]["read"]["total_ios"].as_u64().unwrap();
    let served = j["vqblk"]["server_iothreads"]
        .as_array()
        .expect("server_iothreads")
        .iter()
        .map(|t| t["requests"].as_u64().unwrap())
        .sum();
    (j, ios, served)
}

/// `vqblk bench --server-pid --server-stats` reports the run's per-IOThread
/// counters of a vqblk server: they add up to the client's I/O count.
#[test]
fn bench_reports_server_iothread_counters() {
    let (j, ios, served) = bench_with_server_stats(
        "cli-bench-stats",
        &["--numjobs", "2", "--iodepth", "4", "--size", "1M"],
    );
    assert_eq!(ios, 2 * 256, "two jobs x 1 MiB / 4 KiB");
    let threads = j["vqblk"]["server_iothreads"].as_array().unwrap();
    assert_eq!(threads.len(), 2);
    assert_eq!(served, ios, "{threads:?}");
    assert!(
        threads.iter().all(|t| t["requests"].as_u64().unwrap() > 0),
        "both IOThreads served"
    );
}

/// The server's counters cover the measured part of a run, as its CPU time
/// does: not the `ramp_time` before it (a ramp as long as the run doubled
/// them).
#[test]
fn bench_server_counters_leave_out_the_ramp() {
    let (_, ios, served) = bench_with_server_stats(
        "cli-bench-stats-ramp",
        &[
            "--iodepth",
            "1",
            "--time_based",
            "--runtime",
            "1s",
            "--ramp_time",
            "1s",
        ],
    );
    assert!(ios > 1000, "the client measured {ios} reads");
    let ratio = served as f64 / ios as f64;
    assert!(
        (0.7..1.3).contains(&ratio),
        "the server counted {served} requests where the client measured {ios}"
    );
}
