//! `vqblk serve --metrics`: the Prometheus endpoint scraped while a libblkio
//! client does I/O, linted by `promtool check metrics`, and its counters
//! checked against the client's own count; and the systemd readiness
//! notification (`sd_notify`).

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use common::{scratch, Client};

/// A `vqblk serve` child, killed on drop (a failed assertion leaves nothing running).
struct Serve {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Serve {
    /// A null export with `queues` queues over two IOThreads, metrics on a
    /// free loopback port; `env` is added to the child's environment.
    fn start(dir: &Path, queues: u16, env: &[(&str, &Path)]) -> Serve {
        Serve::start_with(dir, queues, env, &[])
    }

    fn start_with(dir: &Path, queues: u16, env: &[(&str, &Path)], extra: &[&str]) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vqblk"));
        cmd.args(["serve", "--backend", "null", "--size", "64M"])
            .args(["--queues", &queues.to_string()])
            .args(if extra.contains(&"--iothreads") {
                &[][..]
            } else {
                &["--iothreads", "2"][..]
            })
            .args(["--metrics", "127.0.0.1:0", "--log-level", "warn"])
            .arg("--socket")
            .arg(dir.join("disk.sock"))
            .args(extra)
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Serve { child, lines }
    }

    /// The metrics address the daemon printed.
    fn metrics_addr(&self) -> SocketAddr {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(20))
                .expect("the daemon prints its metrics address");
            if let Some(rest) = l.strip_prefix("vqblk: metrics at http://") {
                return rest.trim_end_matches("/metrics").parse().unwrap();
            }
        }
    }

    fn terminate(&mut self) -> i32 {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..200 {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code().unwrap_or(-1);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the daemon did not stop within 10 s of SIGTERM");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET `path`: (status code, body).
fn get(addr: SocketAddr, path: &str) -> (u32, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

/// `promtool check metrics` on `text`: panics with its complaints.
fn promtool_check(text: &str) {
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus, scripts/install-deps.sh)");
    p.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = p.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n{text}"
    );
}

/// Samples of the exposition text: name{labels} -> value.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

/// Sum of the samples of `name` whose labels contain every one of `with`.
fn sum(s: &HashMap<String, f64>, name: &str, with: &[&str]) -> f64 {
    s.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name) && with.iter().all(|w| k.contains(w)))
        .map(|(_, v)| v)
        .sum()
}

/// Scraped while two queues do I/O, the text passes promtool; afterwards the
/// counters equal what the client did: requests by type, bytes, one error,
/// nothing in flight, and the latency histogram counted every request.
#[test]
fn scrape_agrees_with_the_clients_io() {
    let dir = scratch("metrics-scrape");
    let d = Serve::start(&dir, 2, &[]);
    let addr = d.metrics_addr();
    let mut c = Client::connect(&dir.join("disk.sock"), 2).unwrap();
    const N: usize = 200;
    let stop = AtomicBool::new(false);
    let scrapes = std::thread::scope(|s| {
        let scraper = s.spawn(|| {
            let mut texts = Vec::new();
            while !stop.load(Ordering::Relaxed) && texts.len() < 1000 {
                let (code, body) = get(addr, "/metrics");
                assert_eq!(code, 200);
                texts.push(body);
                std::thread::sleep(Duration::from_millis(2));
            }
            texts
        });
        for i in 0..N {
            assert_eq!(c.write(0, (i * 4096) as u64, 0, 4096), 0);
            assert_eq!(c.read(1, (i * 8192) as u64, 8192, 8192), 0);
        }
        assert_eq!(c.flush(0), 0);
        // Past the end: refused by the device model.
        assert!(c.read(1, 64 << 20, 0, 4096) < 0);
        stop.store(true, Ordering::Relaxed);
        scraper.join().unwrap()
    });
    assert!(!scrapes.is_empty());
    promtool_check(&scrapes[scrapes.len() / 2]);
    let (code, text) = get(addr, "/metrics");
    assert_eq!(code, 200);
    promtool_check(&text);
    let s = samples(&text);
    let requests = (2 * N + 2) as f64;
    assert_eq!(sum(&s, "vqblk_requests_total", &[]), requests, "{text}");
    // The out-of-range read was refused before its type mattered.
    for (ty, n) in [("read", N), ("write", N), ("flush", 1), ("invalid", 1)] {
        let got = sum(&s, "vqblk_requests_total", &[&format!("type=\"{ty}\"")]);
        assert_eq!(got, n as f64, "{ty} requests");
    }
    let q1 = sum(&s, "vqblk_requests_total", &["queue=\"1\""]);
    assert_eq!(q1, (N + 1) as f64, "queue 1 served the reads");
    assert_eq!(sum(&s, "vqblk_written_bytes_total", &[]), (N * 4096) as f64);
    assert_eq!(sum(&s, "vqblk_read_bytes_total", &[]), (N * 8192) as f64);
    assert_eq!(sum(&s, "vqblk_request_errors_total", &[]), 1.0);
    assert_eq!(
        sum(&s, "vqblk_request_errors_total", &["kind=\"malformed\""]),
        1.0
    );
    assert_eq!(sum(&s, "vqblk_requests_in_flight", &[]), 0.0);
    let export = "export=\"export0\"";
    assert_eq!(
        sum(&s, "vqblk_request_duration_seconds_count", &[export]),
        requests,
        "the histogram counts every request"
    );
    assert_eq!(
        sum(
            &s,
            "vqblk_request_duration_seconds_bucket",
            &[export, "le=\"+Inf\""]
        ),
        requests
    );
    assert_eq!(sum(&s, "vqblk_iothread_requests_total", &[]), requests);
    assert!(sum(&s, "vqblk_iothread_cpu_seconds_total", &[]) > 0.0);
    assert!(s.contains_key("vqblk_iothread_poll_window_seconds{iothread=\"1\"}"));
    // Every request finished puts one entry on its used ring; each check
    // after a publish either calls the driver or counts why it did not.
    assert_eq!(
        sum(&s, "vqblk_iothread_used_publishes_total", &[]),
        requests
    );
    let calls = sum(&s, "vqblk_iothread_notifications_total", &[]);
    let suppressed = sum(&s, "vqblk_iothread_notifications_suppressed_total", &[]);
    assert!(
        calls + suppressed >= 1.0 && calls + suppressed <= requests,
        "{text}"
    );
    assert!(sum(&s, "vqblk_iothread_kicks_total", &[]) >= 1.0, "{text}");
    assert!(s.contains_key("vqblk_iothread_nap_late_seconds{iothread=\"0\"}"));
    assert_eq!(get(addr, "/").0, 404);
    assert_eq!(get(addr, "/metricsx").0, 404);
    drop(c);
    let mut d = d;
    assert_eq!(
        d.terminate(),
        0,
        "clean exit with the metrics server running"
    );
}

/// Requests held by the null backend's latency show in the in-flight gauge
/// while they wait, and land in the latency bucket that holds that latency.
#[test]
fn in_flight_gauge_and_latency_buckets() {
    let dir = scratch("metrics-latency");
    // 120 ms: above the 0.1 s bound, 80 ms below the 0.2 s one.
    let d = Serve::start_with(&dir, 1, &[], &["--latency-ns", "120000000"]);
    let addr = d.metrics_addr();
    let mut c = Client::connect(&dir.join("disk.sock"), 1).unwrap();
    const N: usize = 8;
    let p = c.region.addr as *const u8;
    for i in 0..N {
        c.queues[0].write((i * 4096) as u64, p, 4096, i, blkio::ReqFlags::empty());
    }
    let mut none: Vec<std::mem::MaybeUninit<blkio::Completion>> = Vec::new();
    c.queues[0].do_io(&mut none, 0, None, None).unwrap();
    let gauge = "vqblk_requests_in_flight";
    let mut seen = 0.0;
    for _ in 0..100 {
        seen = sum(&samples(&get(addr, "/metrics").1), gauge, &[]);
        if seen == N as f64 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(seen, N as f64, "{gauge} while the requests wait");
    for (_, ret) in Client::wait(&mut c.queues[0], N) {
        assert_eq!(ret, 0);
    }
    let text = get(addr, "/metrics").1;
    promtool_check(&text);
    let s = samples(&text);
    assert_eq!(sum(&s, gauge, &[]), 0.0);
    let bucket = |le: &str| {
        sum(
            &s,
            "vqblk_request_duration_seconds_bucket",
            &[&format!("le=\"{le}\"")],
        )
    };
    assert_eq!(bucket("0.1"), 0.0, "{text}");
    assert_eq!(bucket("0.2"), N as f64, "{text}");
    let mean = sum(&s, "vqblk_request_duration_seconds_sum", &[]) / N as f64;
    assert!((0.12..0.2).contains(&mean), "mean latency {mean}");
}

/// With `--iothreads auto` the scrape shows the tuner: which IOThreads are
/// active (one owns the queues of a fresh export, the other is parked) and
/// its moves by reason; a pool that is not tuned has none of these.
#[test]
fn a_tuned_pool_shows_its_active_set_and_moves() {
    let dir = scratch("metrics-tuned");
    let d = Serve::start_with(&dir, 2, &[], &["--iothreads", "auto"]);
    let addr = d.metrics_addr();
    let mut text = String::new();
    // The tuner publishes when it starts and then once a second.
    for _ in 0..100 {
        text = get(addr, "/metrics").1;
        if text.contains("vqblk_iothread_active{") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    promtool_check(&text);
    let s = samples(&text);
    let active = |t: &str| {
        s.get(&format!("vqblk_iothread_active{{iothread=\"{t}\"}}"))
            .copied()
    };
    assert_eq!(active("0"), Some(1.0), "{text}");
    assert_eq!(active("1"), Some(0.0), "{text}");
    for reason in ["balance", "activate", "park", "budget", "probe", "revert"] {
        assert!(
            s.contains_key(&format!(
                "vqblk_autotune_moves_total{{reason=\"{reason}\"}}"
            )),
            "{reason}: {text}"
        );
    }
    assert!(
        s.contains_key("vqblk_autotune_failed_moves_total"),
        "{text}"
    );
    drop(d);
    let fixed = Serve::start(&dir, 2, &[]);
    let text = get(fixed.metrics_addr(), "/metrics").1;
    assert!(!text.contains("vqblk_autotune_"), "{text}");
    assert!(!text.contains("vqblk_iothread_active"), "{text}");
}

/// With NOTIFY_SOCKET set, the daemon sends READY=1 once its sockets listen,
/// and STOPPING=1 when told to stop.
#[test]
fn sd_notify_ready_once_the_sockets_listen() {
    let dir = scratch("metrics-notify");
    let notify = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut d = Serve::start(&dir, 1, &[("NOTIFY_SOCKET", &notify)]);
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).expect("READY=1 within 20 s");
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), "READY=1\n");
    // Ready means listening: both sockets accept at once.
    UnixStream::connect(dir.join("disk.sock")).expect("export socket listens");
    let addr = d.metrics_addr();
    assert_eq!(get(addr, "/metrics").0, 200);
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let n = sock.recv(&mut buf).expect("STOPPING=1 within 20 s");
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), "STOPPING=1\n");
    assert_eq!(d.terminate(), 0);
}

/// A bad --metrics value is refused naming the flag, before anything starts.
#[test]
fn bad_metrics_address_names_the_flag() {
    let dir = scratch("metrics-bad");
    let out = Command::new(env!("CARGO_BIN_EXE_vqblk"))
        .args([
            "serve",
            "--backend",
            "null",
            "--size",
            "1M",
            "--metrics",
            "nowhere",
        ])
        .arg("--socket")
        .arg(dir.join("s.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--metrics: \"nowhere\" is not ADDR:PORT"),
        "{err}"
    );
}
