//! The control socket over a real socket, against an in-process daemon (with
//! its seccomp filters on) and libblkio clients: every method and its errors,
//! malformed and oversized requests, clients vanishing mid-request while I/O
//! runs, export-add / export-del with and without a frontend.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::control_socket::*;
use common::*;
use serde_json::{json, Value};
use vqblk_daemon::config::{BackendKind, ExportConfig};
use vqblk_daemon::control::{code, MAX_REQUEST};
use vqblk_daemon::daemon::Daemon;

/// A daemon with `e` (named "d") over 2 IOThreads and a control socket.
fn start_one(dir: &Path, mut e: ExportConfig) -> (Daemon, PathBuf) {
    e.name = Some("d".into());
    start_with_control(dir, vec![e], vec![])
}

/// A raw connection: send `line` as is, read one answer line.
struct Raw {
    reader: BufReader<UnixStream>,
}

impl Raw {
    fn new(control: &Path) -> Raw {
        let s = UnixStream::connect(control).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw {
            reader: BufReader::new(s),
        }
    }
    fn send(&mut self, bytes: &[u8]) {
        self.reader.get_mut().write_all(bytes).unwrap();
    }
    fn answer(&mut self) -> Value {
        let mut l = String::new();
        assert!(self.reader.read_line(&mut l).unwrap() > 0, "no answer");
        serde_json::from_str(&l).unwrap()
    }
    fn ask(&mut self, line: &str) -> Value {
        self.send(format!("{line}\n").as_bytes());
        self.answer()
    }
}

fn null_export(dir: &Path, queues: u16) -> ExportConfig {
    export(dir, BackendKind::Null, queues, 64 << 20)
}

#[test]
fn queries_and_protocol_errors() {
    let dir = scratch("ctl-proto");
    let (daemon, control) = start_one(&dir, null_export(&dir, 2));
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&control).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "control socket mode");

    let threads = ok(&control, "query-iothreads", Value::Null);
    let threads = threads.as_array().unwrap();
    assert_eq!(threads.len(), 2);
    for (i, t) in threads.iter().enumerate() {
        assert_eq!(t["id"], json!(i));
        assert!(t["thread-id"].as_u64().unwrap() > 0);
        assert_eq!(t["poll"]["mode"], "adaptive");
        assert_eq!(t["queues"], json!([{"export": "d", "queue": i}]));
        for k in [
            "requests",
            "bytes-read",
            "cpu-seconds",
            "poll-window-ns",
            "poll-hits",
            "naps",
            "kick-wakeups",
            "completion-wakeups",
            "kicks",
            "used-publishes",
            "notifications",
            "notifications-suppressed",
            "nap-late-ns",
            "nap-cpu-ns",
            "poll-trials",
            "poll-trials-slept",
        ] {
            assert!(t[k].is_number(), "{k} in {t}");
        }
    }
    let exports = ok(&control, "query-exports", json!({}));
    let e = &exports[0];
    assert_eq!(
        (&e["name"], &e["connected"], &e["backend"]),
        (&json!("d"), &json!(false), &json!("null"))
    );
    assert_eq!(e["queues"][1]["iothread"], 1);

    let mut raw = Raw::new(&control);
    // Malformed JSON, then the same connection still works.
    let a = raw.ask("{\"jsonrpc\": \"2.0\", ");
    assert_eq!(a["error"]["code"], code::PARSE_ERROR);
    assert_eq!(a["id"], Value::Null);
    let a = raw.ask(r#"{"jsonrpc":"2.0","id":"x","method":"no-such-method"}"#);
    assert_eq!(
        (a["error"]["code"].as_i64(), &a["id"]),
        (Some(code::METHOD_NOT_FOUND), &json!("x"))
    );
    let a = raw.ask(r#"{"jsonrpc":"1.0","id":1,"method":"query-exports"}"#);
    assert_eq!(a["error"]["code"], code::INVALID_REQUEST);
    let a = raw.ask(r#"[{"jsonrpc":"2.0","id":1,"method":"query-exports"}]"#);
    assert_eq!(a["error"]["code"], code::INVALID_REQUEST);
    let a = raw.ask(r#"{"jsonrpc":"2.0","id":2,"method":"query-exports","params":{"verbose":1}}"#);
    assert_eq!(a["error"]["code"], code::INVALID_PARAMS);
    assert_eq!(a["error"]["data"]["param"], "verbose");
    // A notification gets no answer: the next answer is the next request's.
    raw.send(b"{\"jsonrpc\":\"2.0\",\"method\":\"stats-reset\"}\n");
    let a = raw.ask(r#"{"jsonrpc":"2.0","id":3,"method":"query-iothreads"}"#);
    assert_eq!(
        (a["id"].as_i64(), a["result"].as_array().map(Vec::len)),
        (Some(3), Some(2))
    );
    // Two requests in one write, answered in order.
    raw.send(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"stats-reset\"}\n{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"stats-reset\"}\n");
    assert_eq!(
        (raw.answer()["id"].as_i64(), raw.answer()["id"].as_i64()),
        (Some(4), Some(5))
    );

    // Bad parameters name the parameter.
    for (method, params, param) in [
        ("iothread-set", json!({"id": 2}), "id"),
        ("iothread-set", json!({}), "id"),
        (
            "iothread-set",
            json!({"id": 0, "poll": "sometimes"}),
            "poll",
        ),
        (
            "iothread-set",
            json!({"id": 0, "poll-max-ns": -1}),
            "poll-max-ns",
        ),
        (
            "iothread-set",
            json!({"id": 0, "poll-weight": 1000000}),
            "poll-weight",
        ),
        ("export-del", json!({}), "name"),
        ("export-del", json!({"name": "nope"}), "name"),
        ("export-del", json!({"name": "d", "force": "yes"}), "force"),
        (
            "export-add",
            json!({"socket": "/tmp/x.sock", "backend": "null", "size": "1M"}),
            "name",
        ),
        (
            "export-add",
            json!({"name": "x", "backend": "null", "size": "1M"}),
            "socket",
        ),
        (
            "export-add",
            json!({"name": "x", "socket": "/tmp/x", "queues": "many"}),
            "queues",
        ),
        (
            "export-add",
            json!({"name": "x", "socket": "/tmp/x", "colour": "red"}),
            "colour",
        ),
        (
            "export-add",
            json!({"name": "x", "socket": "/tmp/x", "backend": "null", "size": "1M", "queues": 0}),
            "queues",
        ),
        (
            "export-add",
            json!({"name": "d", "socket": dir.join("x.sock"), "backend": "null", "size": "1M"}),
            "name",
        ),
        ("queue-move", json!({"queue": 0, "iothread": 1}), "export"),
        (
            "queue-move",
            json!({"export": "nope", "queue": 0, "iothread": 1}),
            "export",
        ),
        (
            "queue-move",
            json!({"export": "d", "queue": 2, "iothread": 1}),
            "queue",
        ),
        (
            "queue-move",
            json!({"export": "d", "queue": 0, "iothread": 2}),
            "iothread",
        ),
        ("queue-move", json!({"export": "d", "queue": 0}), "iothread"),
        ("stats-reset", json!({"all": true}), "all"),
    ] {
        let (c, m) = rpc_err(&control, method, params.clone());
        assert_eq!(c, code::INVALID_PARAMS, "{method} {params}: {m}");
        assert!(
            m.starts_with(&format!("{param}: ")),
            "{method} {params}: {m}"
        );
    }
    // Valid parameters: the queue (not started: no frontend) changes owner,
    // and query-exports shows the live mapping.
    let moved = ok(
        &control,
        "queue-move",
        json!({"export": "d", "queue": 1, "iothread": 0}),
    );
    assert_eq!(moved["from"], 1, "{moved}");
    assert_eq!(moved["to"], 0, "{moved}");
    assert_eq!(moved["handed-over"], false, "{moved}");
    let exports = ok(&control, "query-exports", json!({}));
    let q1 = &exports[0]["queues"][1];
    assert_eq!(q1["iothread"], 0, "query-exports after the move: {exports}");

    // Oversized: an error, then the connection is closed.
    let mut big = Raw::new(&control);
    let junk = vec![b'a'; MAX_REQUEST + 4096];
    // The daemon may close before reading everything: ignore write errors.
    let _ = big.reader.get_mut().write_all(&junk);
    let a = big.answer();
    assert_eq!(a["error"]["code"], code::INVALID_REQUEST);
    let mut rest = Vec::new();
    assert_eq!(
        big.reader.read_to_end(&mut rest).unwrap_or(0),
        0,
        "closed after the error"
    );
    // At most MAX_CLIENTS at once: one more is told so and closed.
    let others: Vec<Raw> = (1..vqblk_daemon::control::MAX_CLIENTS)
        .map(|_| Raw::new(&control))
        .collect();
    let mut extra = Raw::new(&control);
    let a = extra.answer();
    assert!(
        a["error"]["message"].as_str().unwrap().contains("too many"),
        "{a}"
    );
    drop(others);
    // The first raw connection is still served.
    let a = raw.ask(r#"{"jsonrpc":"2.0","id":9,"method":"query-exports"}"#);
    assert_eq!(a["result"][0]["name"], "d");
    drop(daemon);
    assert!(!control.exists(), "control socket removed at shutdown");
}

/// I/O shows in the per-queue and per-IOThread counters; stats-reset starts
/// them from zero without touching the daemon's own (monotonic) counters;
/// iothread-set changes a running IOThread's polling, visible in query-iothreads.
#[test]
fn counters_stats_reset_and_iothread_set() {
    let dir = scratch("ctl-counters");
    let (daemon, control) = start_one(&dir, null_export(&dir, 2));
    let mut c = Client::connect(&dir.join("disk.sock"), 2).unwrap();
    for i in 0..10 {
        assert_eq!(c.write(0, i * 4096, 0, 4096), 0);
    }
    for i in 0..4 {
        assert_eq!(c.read(1, i * 4096, 0, 8192), 0);
    }
    let e = &ok(&control, "query-exports", Value::Null)[0];
    assert_eq!(e["connected"], true);
    let q = &e["queues"];
    assert_eq!(
        (q[0]["requests"].as_u64(), q[0]["bytes-written"].as_u64()),
        (Some(10), Some(40960))
    );
    assert_eq!(
        (q[1]["requests"].as_u64(), q[1]["bytes-read"].as_u64()),
        (Some(4), Some(32768))
    );
    let t = ok(&control, "query-iothreads", Value::Null);
    assert_eq!(
        (t[0]["requests"].as_u64(), t[1]["requests"].as_u64()),
        (Some(10), Some(4))
    );

    assert_eq!(ok(&control, "stats-reset", Value::Null), json!({}));
    let q = &ok(&control, "query-exports", Value::Null)[0]["queues"];
    assert_eq!(
        (q[0]["requests"].as_u64(), q[1]["requests"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(c.write(0, 0, 0, 4096), 0);
    let q = &ok(&control, "query-exports", Value::Null)[0]["queues"];
    assert_eq!(q[0]["requests"], 1);
    // The daemon's own counters never went backwards.
    assert_eq!(daemon.stats().iothreads[0].requests, 11);

    let set = ok(
        &control,
        "iothread-set",
        json!({"id": 1, "poll": "classic", "poll-max-ns": 0, "poll-grow": 4}),
    );
    assert_eq!(set["mode"], "classic");
    let t = &ok(&control, "query-iothreads", Value::Null)[1];
    assert_eq!(
        (
            &t["poll"]["mode"],
            &t["poll"]["poll-max-ns"],
            &t["poll"]["poll-grow"]
        ),
        (&json!("classic"), &json!(0), &json!(4))
    );
    // poll-weight alone switches between QEMU's algorithms, as in the configuration.
    let set = ok(
        &control,
        "iothread-set",
        json!({"id": 1, "poll-weight": 2, "poll-max-ns": 50000}),
    );
    assert_eq!(
        (&set["mode"], &set["poll-weight"], &set["poll-grow"]),
        (&json!("weighted"), &json!(2), &json!(4))
    );
    // IOThread 0 untouched; both keep serving, whatever their mode.
    assert_eq!(
        ok(&control, "query-iothreads", Value::Null)[0]["poll"]["mode"],
        "adaptive"
    );
    for mode in ["busy", "off", "adaptive"] {
        ok(&control, "iothread-set", json!({"id": 1, "poll": mode}));
        assert_eq!(
            c.read(1, 0, 0, 4096),
            0,
            "queue 1 served with polling {mode}"
        );
    }
    drop(c);
    drop(daemon);
}

/// export-add takes the keys of a TOML [[export]]; a libblkio client then
/// attaches and does I/O. export-del is refused while it is connected, and a
/// forced one disconnects it (its rings drained) and removes the socket.
#[test]
fn export_add_io_and_export_del() {
    let dir = scratch("ctl-exports");
    let (daemon, control) = start_one(&dir, null_export(&dir, 1));
    let sock = dir.join("e2.sock");
    let image = dir.join("e2.raw");
    let added = ok(
        &control,
        "export-add",
        json!({
            "name": "e2", "socket": sock, "image": image, "create": "8M", "queues": 2,
            "iothread-vq-mapping": [{"iothread": 1, "vqs": [0, 1]}],
        }),
    );
    assert_eq!(added, json!({"name": "e2"}));
    let (c, m) = rpc_err(
        &control,
        "export-add",
        json!({"name": "e3", "socket": sock, "backend": "null", "size": "1M"}),
    );
    assert!(
        c == code::INVALID_PARAMS && m.starts_with("socket: "),
        "{m}"
    );
    let (c, m) = rpc_err(
        &control,
        "export-add",
        json!({"name": "e3", "socket": dir.join("e3.sock"), "image": dir.join("missing.raw")}),
    );
    assert_eq!(c, code::FAILED, "{m}");
    assert!(!dir.join("e3.sock").exists());

    let mut client = Client::connect(&sock, 2).unwrap();
    assert_eq!(client.capacity, 8 << 20);
    for q in 0..2 {
        client.buf()[..4096].fill(0x40 + q as u8);
        assert_eq!(client.write(q, q as u64 * 4096, 0, 4096), 0);
        client.buf()[..4096].fill(0);
        assert_eq!(client.read(q, q as u64 * 4096, 0, 4096), 0);
        assert!(client.buf()[..4096].iter().all(|&b| b == 0x40 + q as u8));
    }
    let exports = ok(&control, "query-exports", Value::Null);
    let e2 = exports
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "e2")
        .unwrap();
    assert_eq!(
        (
            &e2["connected"],
            &e2["queues"][0]["iothread"],
            &e2["queues"][1]["requests"]
        ),
        (&json!(true), &json!(1), &json!(2))
    );
    let t = ok(&control, "query-iothreads", Value::Null);
    assert_eq!(
        t[1]["queues"],
        json!([{"export": "e2", "queue": 0}, {"export": "e2", "queue": 1}])
    );

    // Refused while connected: the export keeps serving.
    let (c, m) = rpc_err(&control, "export-del", json!({"name": "e2"}));
    assert!(c == code::FAILED && m.contains("force"), "{m}");
    assert_eq!(client.write(0, 0, 0, 4096), 0);
    ok(&control, "export-del", json!({"name": "e2", "force": true}));
    assert!(!sock.exists(), "socket removed");
    let names: Vec<Value> = ok(&control, "query-exports", Value::Null)
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].clone())
        .collect();
    assert_eq!(names, vec![json!("d")]);
    drop(client);
    // Not connected: removed without force; the image was flushed and stays.
    let added = ok(
        &control,
        "export-add",
        json!({"name": "e2", "socket": sock, "image": image, "backend": "threads"}),
    );
    assert_eq!(added["name"], "e2");
    let mut client = Client::connect(&sock, 1).unwrap();
    assert_eq!(client.read(0, 4096, 0, 4096), 0);
    assert!(
        client.buf()[..4096].iter().all(|&b| b == 0x41),
        "data written before the delete"
    );
    drop(client);
    let t = Instant::now();
    // The frontend's disconnect reaches the export thread asynchronously.
    loop {
        match call(&control, "export-del", json!({"name": "e2"})) {
            Ok(_) => break,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(10), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!sock.exists());
    assert_eq!(daemon.sockets(), vec![dir.join("disk.sock")]);
    drop(daemon);
}

/// Control clients that send half a request and vanish, garbage, oversized
/// lines and floods of queries never disturb a libblkio client's I/O.
#[test]
fn vanishing_control_clients_do_not_disturb_io() {
    let dir = scratch("ctl-vanish");
    let (daemon, control) = start_one(&dir, export(&dir, BackendKind::IoUring, 2, 16 << 20));
    let stop = Arc::new(AtomicBool::new(false));
    let sock = dir.join("disk.sock");
    let io = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&sock, 2).unwrap();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) || n < 200 {
                let (q, b) = (n % 2, n % 512);
                for (i, x) in c.buf()[..4096].iter_mut().enumerate() {
                    *x = pattern(q, n, i);
                }
                assert_eq!(c.write(q, b as u64 * 4096, 0, 4096), 0);
                assert_eq!(c.read(q, b as u64 * 4096, 8192, 4096), 0);
                let (w, r) = c.buf().split_at(8192);
                assert_eq!(&w[..4096], &r[..4096], "request {n}");
                n += 1;
            }
            n
        })
    };
    // The client connects from its own thread: the flood starts once it is
    // in, so that "still connected" below is about the flood.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ok(&control, "query-exports", Value::Null)[0]["connected"] != true {
        assert!(Instant::now() < deadline, "the client did not connect");
        std::thread::sleep(Duration::from_millis(10));
    }
    let t = Instant::now();
    let mut rounds = 0;
    while t.elapsed() < Duration::from_millis(700) {
        // Half a request, then gone.
        let mut s = UnixStream::connect(&control).unwrap();
        s.write_all(br#"{"jsonrpc":"2.0","id":1,"method":"query-ex"#)
            .unwrap();
        drop(s);
        // A whole request whose answer is never read.
        let mut s = UnixStream::connect(&control).unwrap();
        s.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"query-iothreads\"}\n")
            .unwrap();
        drop(s);
        // Garbage and an oversized line.
        let mut s = UnixStream::connect(&control).unwrap();
        let _ = s.write_all(&[0xff; 300]);
        let _ = s.write_all(&vec![b'x'; MAX_REQUEST + 1]);
        drop(s);
        assert_eq!(
            ok(&control, "query-exports", Value::Null)[0]["connected"],
            true
        );
        rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let n = io.join().expect("the I/O client saw no error");
    assert!(rounds > 0 && n >= 200);
    // Every request was counted once.
    let q = &ok(&control, "query-exports", Value::Null)[0]["queues"];
    assert_eq!(
        q[0]["requests"].as_u64().unwrap() + q[1]["requests"].as_u64().unwrap(),
        2 * n as u64
    );
    assert_eq!(
        q[0]["errors"].as_u64().unwrap() + q[1]["errors"].as_u64().unwrap(),
        0
    );
    drop(daemon);
}
