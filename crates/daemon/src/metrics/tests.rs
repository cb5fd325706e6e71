use super::*;
use crate::stats::{ErrorKind, IoThreadStats};

fn line<'a>(text: &'a str, start: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line {start}\n{text}"))
}

/// Per-queue counters come out with export/queue/iothread labels, requests
/// refused before their type count as `invalid`, and the histogram of an
/// export sums its queues over IOThreads, cumulatively.
#[test]
fn render_labels_types_and_sums_histograms() {
    let a = IoThreadStats::new("vqblk-iot0".into());
    let b = IoThreadStats::new("vqblk-iot1".into());
    let q0 = a.queue("db", 0);
    q0.reads.add(3);
    q0.requests.add(4);
    q0.popped.add(6);
    q0.bytes_read.add(12288);
    q0.error(ErrorKind::Malformed);
    for ns in [800, 1_500, 1_500, 40_000] {
        q0.latency.observe(ns);
    }
    let q1 = b.queue("db", 1);
    q1.writes.add(1);
    q1.requests.add(1);
    q1.popped.add(1);
    q1.latency.observe(3_000_000_000);
    b.kick_wakeups.add(7);
    b.poll_window_ns.set(4_000);
    let text = render(&[a.snapshot(), b.snapshot()]);
    let req = r#"vqblk_requests_total{export="db",queue="0",iothread="0""#;
    assert!(line(&text, &format!(r#"{req},type="read"}}"#)).ends_with(" 3"));
    assert!(line(&text, &format!(r#"{req},type="invalid"}}"#)).ends_with(" 1"));
    assert!(line(
        &text,
        r#"vqblk_requests_in_flight{export="db",queue="0",iothread="0"}"#
    )
    .ends_with(" 2"));
    assert!(line(
        &text,
        r#"vqblk_request_errors_total{export="db",queue="0",iothread="0",kind="malformed"}"#
    )
    .ends_with(" 1"));
    let h = "vqblk_request_duration_seconds";
    assert!(line(
        &text,
        &format!(r#"{h}_bucket{{export="db",le="0.000001"}}"#)
    )
    .ends_with(" 1"));
    assert!(line(
        &text,
        &format!(r#"{h}_bucket{{export="db",le="0.000002"}}"#)
    )
    .ends_with(" 3"));
    assert!(line(&text, &format!(r#"{h}_bucket{{export="db",le="0.00005"}}"#)).ends_with(" 4"));
    assert!(line(&text, &format!(r#"{h}_bucket{{export="db",le="10"}}"#)).ends_with(" 5"));
    assert!(line(&text, &format!(r#"{h}_bucket{{export="db",le="+Inf"}}"#)).ends_with(" 5"));
    assert!(line(&text, &format!(r#"{h}_count{{export="db"}}"#)).ends_with(" 5"));
    assert!(line(
        &text,
        r#"vqblk_iothread_wakeups_total{iothread="1",cause="kick"}"#
    )
    .ends_with(" 7"));
    assert!(
        line(&text, r#"vqblk_iothread_poll_window_seconds{iothread="1"}"#).ends_with(" 0.000004")
    );
    assert!(text.contains("# TYPE vqblk_request_duration_seconds histogram"));
    assert!(text.contains("# TYPE vqblk_requests_in_flight gauge"));
}

/// Without queues (no frontend yet) only the per-IOThread families appear;
/// an empty family would make the encoder fail.
#[test]
fn render_without_queues() {
    let a = IoThreadStats::new("vqblk-iot0".into());
    let text = render(&[a.snapshot()]);
    assert!(text.contains(r#"vqblk_iothread_requests_total{iothread="0"} 0"#));
    assert!(!text.contains("vqblk_requests_total"));
    assert!(!text.contains("vqblk_request_duration_seconds"));
}

/// The hand-back counters an operator reads (publishes, calls, calls the
/// driver did not want, kicks) are counters; the measured nap figures and the
/// polling window are gauges.
#[test]
fn render_handback_counters_and_gauges() {
    let a = IoThreadStats::new("vqblk-iot0".into());
    a.used_publishes.add(40);
    a.notifications.add(9);
    a.notifications_suppressed.add(31);
    a.kicks.add(12);
    a.nap_late_ns.set(6_000);
    a.nap_cpu_ns.set(2_500);
    let text = render(&[a.snapshot()]);
    for (name, v) in [
        ("vqblk_iothread_used_publishes_total", " 40"),
        ("vqblk_iothread_notifications_total", " 9"),
        ("vqblk_iothread_notifications_suppressed_total", " 31"),
        ("vqblk_iothread_kicks_total", " 12"),
    ] {
        assert!(text.contains(&format!("# TYPE {name} counter")), "{name}");
        assert!(
            line(&text, &format!(r#"{name}{{iothread="0"}}"#)).ends_with(v),
            "{name}"
        );
    }
    for (name, v) in [
        ("vqblk_iothread_nap_late_seconds", " 0.000006"),
        ("vqblk_iothread_nap_cpu_seconds", " 0.0000025"),
        ("vqblk_iothread_poll_window_seconds", " 0"),
    ] {
        assert!(text.contains(&format!("# TYPE {name} gauge")), "{name}");
        assert!(
            line(&text, &format!(r#"{name}{{iothread="0"}}"#)).ends_with(v),
            "{name}"
        );
    }
}

/// Requests held back by the I/O limits and the time they waited, per queue.
#[test]
fn render_throttled_counters() {
    let a = IoThreadStats::new("vqblk-iot0".into());
    let q = a.queue("db", 2);
    q.throttled.add(5);
    q.throttled_ns.add(1_500_000_000);
    let text = render(&[a.snapshot()]);
    let l = r#"{export="db",queue="2",iothread="0"}"#;
    assert!(line(&text, &format!("vqblk_queue_throttled_requests_total{l}")).ends_with(" 5"));
    assert!(line(&text, &format!("vqblk_queue_throttled_seconds_total{l}")).ends_with(" 1.5"));
    assert!(text.contains("# TYPE vqblk_queue_throttled_seconds_total counter"));
}

/// The share allocator's caps per export and capacity estimates per
/// device; an uncapped export and an unmeasured device have no sample.
#[test]
fn render_share_caps_and_estimates() {
    assert_eq!(render_shares(&ShareReading::default()), "");
    let text = render_shares(&ShareReading {
        exports: vec![
            ("db".into(), "fs-8:1".into(), Some(4750.0)),
            ("batch".into(), "fs-8:1".into(), None),
        ],
        devices: vec![("fs-8:1".into(), Some(10000.0)), ("rbd".into(), None)],
    });
    assert!(line(
        &text,
        r#"vqblk_export_share_cap_iops{export="db",device="fs-8:1"}"#
    )
    .ends_with(" 4750"));
    assert!(!text.contains(r#"export="batch""#), "{text}");
    assert!(line(
        &text,
        r#"vqblk_device_capacity_estimate_iops{device="fs-8:1"}"#
    )
    .ends_with(" 10000"));
    assert!(text.contains("# TYPE vqblk_device_capacity_estimate_iops gauge"));
    assert!(!text.contains(r#"device="rbd""#), "{text}");
}

/// The online tuner's moves by reason and failed moves are counters, each
/// IOThread's state a 0/1 gauge.
#[test]
fn render_tune_moves_and_active_set() {
    let text = render_tune(&TuneReading {
        moves: vec![("balance", 3), ("activate", 1), ("park", 2), ("budget", 0)],
        failed: 1,
        active: vec![true, false, true],
    });
    for (reason, v) in [("balance", 3), ("activate", 1), ("park", 2), ("budget", 0)] {
        assert!(
            line(
                &text,
                &format!(r#"vqblk_autotune_moves_total{{reason="{reason}"}}"#)
            )
            .ends_with(&format!(" {v}")),
            "{text}"
        );
    }
    assert!(line(&text, "vqblk_autotune_failed_moves_total ").ends_with(" 1"));
    assert!(line(&text, r#"vqblk_iothread_active{iothread="0"}"#).ends_with(" 1"));
    assert!(line(&text, r#"vqblk_iothread_active{iothread="1"}"#).ends_with(" 0"));
    assert!(line(&text, r#"vqblk_iothread_active{iothread="2"}"#).ends_with(" 1"));
    assert!(text.contains("# TYPE vqblk_autotune_moves_total counter"));
    assert!(text.contains("# TYPE vqblk_autotune_failed_moves_total counter"));
    assert!(text.contains("# TYPE vqblk_iothread_active gauge"));
}
