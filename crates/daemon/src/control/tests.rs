//! Unit tests of the request envelope and parameter handling (the methods
//! themselves are tested over a real socket in tests/control.rs).

use serde_json::{json, Map, Value};

use super::methods::{since, Params};
use super::{code, parse_request};

fn params(v: Value) -> Params {
    match v {
        Value::Object(m) => Params::new(m),
        _ => Params::new(Map::new()),
    }
}

#[test]
fn the_envelope_is_checked() {
    let ok = parse_request(json!({"jsonrpc": "2.0", "id": 7, "method": "m", "params": {"a": 1}}))
        .unwrap();
    assert_eq!((ok.0, ok.1.as_str(), ok.2.len()), (Some(json!(7)), "m", 1));
    let err = |v: Value| parse_request(v).unwrap_err().1;
    assert_eq!(err(json!([1])).code, code::INVALID_REQUEST);
    assert_eq!(err(json!(3)).code, code::INVALID_REQUEST);
    assert!(err(json!({"id": 1, "method": "m"}))
        .message
        .starts_with("jsonrpc"));
    assert!(err(json!({"jsonrpc": "2.0", "id": 1}))
        .message
        .starts_with("method"));
    let e = err(json!({"jsonrpc": "2.0", "id": 1, "method": "m", "params": [1]}));
    assert_eq!(
        (e.code, e.param.as_deref()),
        (code::INVALID_PARAMS, Some("params"))
    );
    assert!(err(json!({"jsonrpc": "2.0", "id": {}, "method": "m"}))
        .message
        .starts_with("id"));
    // A notification has no id.
    let n = parse_request(json!({"jsonrpc": "2.0", "method": "m"})).unwrap();
    assert_eq!(n.0, None);
}

#[test]
fn parameters_are_named_in_errors() {
    let mut p = params(json!({"id": "x", "queue": 70000, "force": 1, "extra": 0}));
    let e = p.req_u64("id", 3).unwrap_err();
    assert_eq!(
        (e.code, e.param.as_deref()),
        (code::INVALID_PARAMS, Some("id"))
    );
    assert!(e.message.starts_with("id: "), "{}", e.message);
    let e = p.req_u64("queue", u16::MAX as u64).unwrap_err();
    assert!(e.message.contains("out of range"), "{}", e.message);
    assert_eq!(p.flag("force").unwrap_err().param.as_deref(), Some("force"));
    assert_eq!(
        p.req_str("name").unwrap_err().param.as_deref(),
        Some("name")
    );
    assert_eq!(p.finish("m").unwrap_err().param.as_deref(), Some("extra"));
    let mut p = params(json!({"n": 3, "s": "a", "b": true}));
    assert_eq!(p.u64("n", 3).unwrap(), Some(3));
    assert_eq!(p.str("s").unwrap().as_deref(), Some("a"));
    assert!(p.flag("b").unwrap());
    p.finish("m").unwrap();
}

#[test]
fn stats_reset_subtracts_a_baseline_and_keeps_gauges() {
    let snap = |requests: u64, window: u64, q: u64| -> crate::stats::DaemonSnapshot {
        let mut v = json!({
            "iothreads": [{
                "name": "vqblk-iot0", "tid": 1, "cpu_seconds": 2.0, "requests": requests,
                "kick_wakeups": 0, "completion_wakeups": 0, "passes": 0, "notifications": 0,
                "errors": 0, "poll_window_ns": window, "poll_attempts": 0, "poll_hits": 0,
                "naps": 0, "poll_seconds": 0.0, "sleep_seconds": 0.0,
                "queues": [{"export": "d", "queue": 0, "requests": q, "reads": q, "writes": 0,
                            "flushes": 0, "other": 0, "errors": 0, "bytes_read": 4096 * q,
                            "bytes_written": 0}]
            }]
        });
        v["iothreads"][0]["cpu_seconds"] = json!(requests as f64 / 10.0);
        serde_json::from_value(v).unwrap()
    };
    let base = snap(10, 500, 4);
    let now = since(&snap(25, 800, 9), Some(&base));
    let t = &now.iothreads[0];
    assert_eq!((t.requests, t.poll_window_ns), (15, 800));
    assert!((t.cpu_seconds - 1.5).abs() < 1e-9);
    assert_eq!(
        (t.queues[0].requests, t.queues[0].bytes_read),
        (5, 5 * 4096)
    );
    assert_eq!(since(&snap(25, 800, 9), None), snap(25, 800, 9));
}
