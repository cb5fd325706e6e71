//! The HTML report in a real browser: headless Chromium renders it (no network, no
//! script), the DOM has the tables and one SVG chart per cell, and the screenshot is
//! not blank. Chromium comes from Debian through scripts/install-deps.sh.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vqblk_study::matrix::{Cell, Op, Setup};
use vqblk_study::merit::Options;
use vqblk_study::report::{render, Format};
use vqblk_study::results::{Record, Results, Run, Skip};
use vqblk_study::study::Study;

const CHROMIUM: &str = "/usr/bin/chromium";

/// A hand-made study: 2 ops x 2 sizes x 2 job counts, native, baseline, 1/2/4 IOThreads.
fn study() -> Study {
    let mut r = Results::default();
    for (bs, op, jobs) in [
        (4096, Op::Randread, 1),
        (4096, Op::Randread, 4),
        (4096, Op::Randwrite, 1),
        (4096, Op::Randwrite, 4),
        (1 << 20, Op::Read, 1),
        (1 << 20, Op::Read, 4),
        (1 << 20, Op::Write, 1),
        (1 << 20, Op::Write, 4),
    ] {
        let cell = Cell {
            bs,
            op,
            jobs,
            iodepth: 16,
        };
        let scale = if bs == 4096 { 100.0 } else { 1000.0 };
        for (setup, k, f) in [
            (Setup::Native, None, 3.0),
            (Setup::Baseline, Some(0), 1.0),
            (Setup::IoThreads(1), Some(1), 1.4),
            (Setup::IoThreads(2), Some(2), 1.9),
            (
                Setup::IoThreads(4),
                Some(4),
                2.0 * f64::from(jobs).sqrt() / 2.0,
            ),
        ] {
            for run in 1..=2 {
                let wobble = if op == Op::Randwrite && jobs == 4 && run == 2 {
                    1.3
                } else {
                    1.0
                };
                let mb = scale * f * wobble;
                r.push(Record::Run(Box::new(Run {
                    cell,
                    setup: setup.label(),
                    iothreads: k,
                    run,
                    iops: mb * 1e6 / bs as f64,
                    bw_bytes: mb * 1e6,
                    mb_s: mb,
                    p50_us: Some(20.0),
                    p99_us: Some(80.0),
                    server_cpu_s: k.map(|_| 0.5),
                    server_cpu_pct: k.map(|_| 50.0),
                    elapsed_s: 1.0,
                    time: "2026-01-01T00:00:00Z".into(),
                    server_threads: Default::default(),
                    server_threads_wait: Default::default(),
                    server_threads_cpu: Default::default(),
                    tune: None,
                    iothread_counters: None,
                    argv: vec!["vqblk".into(), "bench".into()],
                })));
            }
        }
    }
    r.push(Record::Skip(Skip {
        setup: "iothreads=8".into(),
        iothreads: Some(8),
        reason: "skipped: 8 IOThreads > 2 x 2 CPUs <test>".into(),
    }));
    Study::new(r, Options::default())
}

/// Runs chromium with the given extra flags on `file`, killing it after 90 s.
fn chromium(profile: &Path, extra: &[String], file: &Path) -> std::process::Output {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: run scripts/install-deps.sh (installs Debian's chromium)"
    );
    let mut child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(format!("file://{}", file.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let deadline = Instant::now() + Duration::from_secs(90);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("chromium did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn html_report_renders_in_headless_chromium() {
    let s = study();
    let html = render(&s, Format::Html).unwrap();
    // Self-contained: no scripts, no external resources (the SVG namespace is a name, not a fetch).
    assert!(!html.contains("<script"));
    assert!(!html.contains("<link"));
    assert!(
        !html
            .replace("xmlns=\"http://www.w3.org/2000/svg\"", "")
            .contains("http"),
        "no external URL"
    );
    assert!(html.contains("&lt;test&gt;"), "text is escaped");

    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("report.html");
    std::fs::write(&page, &html).unwrap();

    let dom = chromium(
        &dir.path().join("profile-dom"),
        &["--dump-dom".into()],
        &page,
    );
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(
        dom.contains("<h1>vqblk IOThread study</h1>"),
        "chromium did not render the page: {dom:.300}"
    );
    assert_eq!(
        dom.matches("<figure class=\"chart\">").count(),
        8,
        "one chart per cell"
    );
    assert_eq!(dom.matches("<svg").count(), 8);
    assert_eq!(dom.matches("class=\"ref-native\"").count(), 8);
    assert_eq!(dom.matches("class=\"ref-baseline\"").count(), 8);
    assert_eq!(dom.matches("class=\"point\"").count(), 8 * 3);
    for id in ["table-0", "table-1", "table-2", "table-3"] {
        assert!(dom.contains(&format!("id=\"{id}\"")), "{id}");
    }
    assert!(dom.contains("Ratio of best performance to native"));
    assert!(dom.contains("4k Total"));
    assert!(dom.contains("(noisy)"), "the wobbling cells are flagged");

    let png = dir.path().join("shot.png");
    let out = chromium(
        &dir.path().join("profile-shot"),
        &[
            format!("--screenshot={}", png.display()),
            "--window-size=1200,1600".into(),
        ],
        &page,
    );
    assert!(
        png.exists(),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let decoder = png::Decoder::new(std::fs::File::open(&png).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (1200, 1600));
    let channels = info.line_size / info.width as usize;
    assert!(channels >= 3, "{:?}", info.color_type);
    let pixels = buf[..info.buffer_size()].chunks(channels);
    let (mut ink, mut blue, mut total) = (0usize, 0usize, 0usize);
    for p in pixels {
        total += 1;
        if p[0] < 240 || p[1] < 240 || p[2] < 240 {
            ink += 1;
        }
        // The series colour #1f5fbf.
        if p[2] > 150 && p[0] < 90 && p[1] < 130 {
            blue += 1;
        }
    }
    let frac = ink as f64 / total as f64;
    assert!(
        frac > 0.01,
        "the screenshot is blank ({ink} of {total} pixels not white)"
    );
    assert!(frac < 0.9, "the screenshot is nearly all ink ({frac:.2})");
    eprintln!("screenshot: {ink} of {total} pixels not white, {blue} in the series colour");
}
