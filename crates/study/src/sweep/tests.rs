//! Unit tests of the sweep's plan, bench output and formats.

use std::time::Duration;

use clap::Parser;

use super::*;
use crate::matrix::{Cell, Op, Setup};

#[derive(Parser)]
struct P {
    #[command(flatten)]
    a: SweepArgs,
}

/// The plan of `vqblk sweep` with `extra`, for a binary at /x/vqblk on 2 CPUs.
fn plan(extra: &[&str]) -> anyhow::Result<Plan> {
    Plan::new(&args(extra), "/x/vqblk".into(), 2)
}

fn args(extra: &[&str]) -> SweepArgs {
    let mut v = vec!["sweep", "--results", "/dev/null"];
    v.extend_from_slice(extra);
    P::try_parse_from(v).unwrap().a
}

#[test]
fn skip_rule() {
    let (keep, skip) = iothread_columns(&[1, 2, 3, 4, 6, 8, 12, 16], 2, None, 16);
    assert_eq!(keep, vec![1, 2, 3, 4]);
    assert_eq!(skip.len(), 4);
    assert!(skip[0].1.contains("2 x 2 CPUs"));
    let (keep, skip) = iothread_columns(&[1, 2, 8], 64, None, 4);
    assert_eq!(keep, vec![1, 2]);
    assert!(skip[0].1.contains("virtqueues"));
    let (keep, _) = iothread_columns(&[1, 2, 8], 2, Some(8), 16);
    assert_eq!(keep, vec![1, 2, 8]);
}

#[test]
fn null_plan_has_no_native_and_the_baseline_is_poll_off() {
    let p = plan(&["--backend", "null"]).unwrap();
    assert_eq!(
        p.setups,
        vec![
            Setup::Baseline,
            Setup::IoThreads(1),
            Setup::IoThreads(2),
            Setup::IoThreads(4),
            Setup::Auto
        ]
    );
    assert_eq!(p.skipped[0].0, Setup::Native);
    assert!(p.skipped[0].1.starts_with("n/a"));
    let b = shell_join(&p.server_argv(Setup::Baseline).unwrap());
    assert!(
        b.starts_with("/x/vqblk serve --backend null --size 1073741824 --socket "),
        "{b}"
    );
    assert!(b.contains("--queues 4 --iothreads 1 --poll off"), "{b}");
    let s = shell_join(&p.server_argv(Setup::IoThreads(2)).unwrap());
    assert!(s.contains("--iothreads 2") && !s.contains("--poll"), "{s}");
    let a = shell_join(&p.server_argv(Setup::Auto).unwrap());
    assert!(
        a.contains("--iothreads auto") && !a.contains("--poll"),
        "{a}"
    );
    // Only the auto column has a control socket: the sweep asks it what its
    // controller did in each run. Every vqblk column writes a stats file,
    // which the bench reads before and after each run.
    let ctl = p.control_socket().display().to_string();
    assert!(a.contains(&format!("--control {ctl}")), "{a}");
    assert!(
        !s.contains("--control") && !b.contains("--control"),
        "{s} {b}"
    );
    for (argv, setup) in [
        (&a, Setup::Auto),
        (&s, Setup::IoThreads(2)),
        (&b, Setup::Baseline),
    ] {
        let stats = p.stats_file(setup).display().to_string();
        assert!(argv.contains(&format!("--stats-file {stats}")), "{argv}");
    }
    let cell = Cell {
        bs: 4096,
        op: Op::Randread,
        jobs: 1,
        iodepth: 1,
    };
    let ramp_of =
        |argv: Vec<String>| argv[argv.iter().position(|a| a == "--ramp_time").unwrap() + 1].clone();
    let ramp = |s| ramp_of(p.bench_argv(&cell, s, None));
    assert_eq!(ramp(Setup::IoThreads(2)), "250ms");
    assert_eq!(
        ramp(Setup::Auto),
        "4000ms",
        "the tuner gets time to see the load"
    );
    let warmup_ramp = |s| ramp_of(p.warmup_argv(&cell, s, None));
    assert_eq!(warmup_ramp(Setup::IoThreads(2)), "250ms");
    assert_eq!(
        warmup_ramp(Setup::Auto),
        "8000ms",
        "auto's warm-up holds a probe and its verdict"
    );
    let cell = Cell {
        bs: 4096,
        op: Op::Randwrite,
        jobs: 4,
        iodepth: 16,
    };
    let bench = shell_join(&p.bench_argv(&cell, Setup::IoThreads(2), Some(42)));
    assert!(bench.contains("--rw randwrite --bs 4096 --numjobs 4 --iodepth 16 --runtime 1000ms --ramp_time 250ms --time_based --group_reporting --output-format json --server-pid 42"), "{bench}");
    let t = p.command_templates();
    assert!(
        t["serve"].contains("iothreads-K.sock") && t["serve"].contains("--iothreads K"),
        "{}",
        t["serve"]
    );
    assert!(t["bench"].contains("COLUMN.sock"), "{}", t["bench"]);
    assert!(
        t["bench"].contains("--rw OP --bs BS --numjobs JOBS --iodepth DEPTH"),
        "{}",
        t["bench"]
    );
    assert!(!t.contains_key("native"));
}

#[test]
fn serve_columns_are_typed_serve_commands() {
    use vqblk_daemon::config::BackendKind;
    use vqblk_daemon::poll::PollMode;
    let p = plan(&["--backend", "null", "--size", "64m", "--poll", "weighted"]).unwrap();
    let base = p.serve_command(Setup::Baseline).unwrap();
    assert_eq!(base.backend, Some(BackendKind::Null));
    assert_eq!(base.size, Some(64 << 20));
    assert_eq!((base.iothreads, base.poll), (Some(1), Some(PollMode::Off)));
    assert_eq!(base.queues, Some(4));
    assert_eq!(base.socket, Some(p.socket(Setup::Baseline)));
    let two = p.serve_command(Setup::IoThreads(2)).unwrap();
    assert_eq!(
        (two.iothreads, two.poll),
        (Some(2), Some(PollMode::Weighted))
    );
    assert_eq!(
        two.socket,
        Some(p.socket(Setup::IoThreads(2))),
        "every column's server runs for the whole sweep, on its own socket"
    );
    assert_ne!(p.socket(Setup::IoThreads(2)), p.socket(Setup::Baseline));
    assert_eq!(
        p.bench_argv(&p.matrix.cells()[0], Setup::IoThreads(2), None)[3],
        format!("unix:{}", p.socket(Setup::IoThreads(2)).display())
    );
    assert_eq!(
        p.server_argv(Setup::IoThreads(2)).unwrap(),
        two.argv(std::path::Path::new("/x/vqblk"))
    );
    assert!(p.serve_command(Setup::Native).is_none());
    let e = P::try_parse_from(["sweep", "--results", "/r", "--poll", "sometimes"]);
    assert!(e.is_err(), "--poll is checked when parsed");
}

#[test]
fn the_vqblk_executable_is_explicit_or_the_running_one() {
    let a = args(&["--backend", "null", "--vqblk", "/opt/vqblk"]);
    assert_eq!(a.vqblk_exe().unwrap(), std::path::Path::new("/opt/vqblk"));
    let p = Plan::new(&a, a.vqblk_exe().unwrap(), 2).unwrap();
    assert!(
        shell_join(&p.server_argv(Setup::IoThreads(1)).unwrap()).starts_with("/opt/vqblk serve ")
    );
    assert!(p.bench_argv(&p.matrix.cells()[0], Setup::IoThreads(1), None)[0] == "/opt/vqblk");
    let d = args(&["--backend", "null"]);
    assert_eq!(d.vqblk_exe().unwrap(), std::env::current_exe().unwrap());
}

#[test]
fn qsd_baseline_command() {
    let p = plan(&["--backend", "null", "--baseline", "qemu-storage-daemon"]).unwrap();
    let q = p.server_argv(Setup::Baseline).unwrap();
    assert_eq!(q[0], "qemu-storage-daemon");
    assert_eq!(
        q[2],
        "driver=null-co,node-name=d,size=1073741824,read-zeroes=on"
    );
    assert!(q[6]
        .to_str()
        .unwrap()
        .ends_with("writable=on,num-queues=4,iothread=iot0"));
}

/// `--latency-ns` gives the null backend a device's latency, in vqblk and in
/// qemu-storage-daemon's null-co alike, and the header records it.
#[test]
fn null_latency_reaches_every_server_and_the_header() {
    let p = plan(&["--backend", "null", "--latency-ns", "50000"]).unwrap();
    for s in [Setup::Baseline, Setup::IoThreads(2), Setup::Auto] {
        let a = shell_join(&p.server_argv(s).unwrap());
        assert!(a.contains("--latency-ns 50000"), "{a}");
    }
    let st = p.target.storage();
    assert_eq!(st.latency_ns, Some(50000));
    assert!(
        st.describe().contains("after 50000 ns"),
        "{}",
        st.describe()
    );
    let q = plan(&[
        "--backend",
        "null",
        "--latency-ns",
        "50000",
        "--baseline",
        "qemu-storage-daemon",
    ])
    .unwrap();
    let b = q.server_argv(Setup::Baseline).unwrap();
    assert!(
        b[2].to_str().unwrap().ends_with(",latency-ns=50000"),
        "{b:?}"
    );
    let e = P::try_parse_from(["sweep", "--results", "/dev/null", "--latency-ns", "5"])
        .err()
        .expect("--latency-ns needs --backend null");
    assert!(e.to_string().contains("--backend"), "{e}");
}

#[test]
fn image_plan_runs_native_on_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.raw");
    let e = plan(&["--image", img.to_str().unwrap()]).unwrap_err();
    assert!(format!("{e:#}").contains("--create"));
    let p = plan(&["--image", img.to_str().unwrap(), "--create", "8m"]).unwrap();
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 8 << 20);
    let data = std::fs::read(&img).unwrap();
    assert!(
        data.iter().filter(|&&b| b == 0).count() < data.len() / 10,
        "filled, not sparse"
    );
    assert_eq!(p.setups[0], Setup::Native);
    let cell = Cell {
        bs: 4096,
        op: Op::Read,
        jobs: 1,
        iodepth: 1,
    };
    let n = p.bench_argv(&cell, Setup::Native, None);
    assert_eq!(
        n[3],
        format!("file:{}", img.canonicalize().unwrap().display())
    );
    let s = shell_join(&p.server_argv(Setup::IoThreads(1)).unwrap());
    assert!(s.contains("--cache none"), "{s}");
    let e = plan(&[
        "--image",
        img.to_str().unwrap(),
        "--size",
        "1G",
        "--matrix",
        "seeds",
    ]);
    assert!(format!("{:#}", e.unwrap_err()).contains("too small"));
}

#[test]
fn flags_are_validated() {
    let e = |a: &[&str]| format!("{:#}", Plan::new(&args(a), "/x".into(), 2).unwrap_err());
    assert!(e(&[]).contains("--image PATH, --device PATH or --backend null"));
    assert!(e(&["--backend", "null", "--repeats", "0"]).contains("--repeats"));
    assert!(e(&["--backend", "null", "--runtime", "abc"]).contains("--runtime"));
    assert!(e(&["--backend", "null", "--matrix", "/nonexistent.toml"]).contains("--matrix"));
}

#[test]
fn bench_json_is_read() {
    let text = r#"{"jobs":[{"error":0,"read":{"iops":1000.0,"bw_bytes":4096000,"runtime":1000,
        "clat_ns":{"percentile":{"50.000000":12000,"99.000000":50000}}},"write":{"iops":0,"bw_bytes":0}}],
        "vqblk":{"elapsed_s":1.0,"server_cpu_s":0.5}}"#;
    let m = parse_bench_json(text, Op::Randread).unwrap();
    assert_eq!(
        (m.iops, m.bw_bytes, m.p50_us, m.p99_us, m.server_cpu_s),
        (1000.0, 4096000.0, Some(12.0), Some(50.0), Some(0.5))
    );
    assert_eq!(parse_bench_json(text, Op::Write).unwrap().bw_bytes, 0.0);
    assert!(m.server_threads.is_empty());
    // Per-thread CPU, threads of one name summed.
    let text = text.replace(
        r#""server_cpu_s":0.5"#,
        r#""server_cpu_s":0.5,"server_threads":[{"tid":7,"name":"vqblk-iot0","cpu_s":0.25,"wait_s":0.5,"last_cpu":1},
            {"tid":8,"name":"vqblk-iot1","cpu_s":0.125,"wait_s":0.0,"last_cpu":0},{"tid":9,"name":"vqblk-iot0","cpu_s":0.0625,"wait_s":0.25,"last_cpu":0}]"#,
    );
    let m = parse_bench_json(&text, Op::Randread).unwrap();
    let cpus: Vec<_> = m.server_threads_cpu.clone().into_iter().collect();
    assert_eq!(
        cpus,
        [("vqblk-iot0".to_string(), 1), ("vqblk-iot1".to_string(), 0)],
        "of two threads named alike, the busier's"
    );
    let waits: Vec<_> = m.server_threads_wait.clone().into_iter().collect();
    assert_eq!(
        waits,
        [("vqblk-iot0".to_string(), 0.75)],
        "summed; none left out"
    );
    let threads: Vec<_> = m.server_threads.into_iter().collect();
    assert_eq!(
        threads,
        [
            ("vqblk-iot0".to_string(), 0.3125),
            ("vqblk-iot1".to_string(), 0.125)
        ]
    );
    assert_eq!(m.iothread_counters, None, "no --server-stats");
    // The IOThreads' counters over the run (`--server-stats`), summed; the
    // nap lateness is the largest of a thread that served requests.
    let text = text.replace(
        r#""server_cpu_s":0.5"#,
        r#""server_cpu_s":0.5,"server_iothreads":[
            {"name":"vqblk-iot0","requests":9,"passes":10,"completion_wakeups":20,"kick_wakeups":0,
             "naps":0,"poll_hits":5,"nap_late_ns":1000},
            {"name":"vqblk-iot1","requests":3,"passes":30,"completion_wakeups":60,"kick_wakeups":0,
             "naps":0,"poll_hits":15,"nap_late_ns":2000},
            {"name":"vqblk-iot2","requests":0,"passes":0,"completion_wakeups":0,"kick_wakeups":0,
             "naps":0,"poll_hits":0,"nap_late_ns":9000}]"#,
    );
    let c = parse_bench_json(&text, Op::Randread)
        .unwrap()
        .iothread_counters
        .unwrap();
    assert_eq!(
        (
            c.passes,
            c.completion_wakeups,
            c.kick_wakeups,
            c.poll_hits,
            c.nap_late_ns
        ),
        (40, 80, 0, 20, 2000)
    );
    assert!(parse_bench_json("{\"jobs\":[]}", Op::Read).is_err());
    assert!(
        parse_bench_json(r#"{"jobs":[{"error":1,"error_text":"EIO"}]}"#, Op::Read)
            .unwrap_err()
            .to_string()
            .contains("EIO")
    );
}

#[test]
fn time_formats() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(1_795_304_876), "2026-11-21T23:47:56Z");
    assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(hms(Duration::from_secs(7)), "7s");
    assert_eq!(hms(Duration::from_secs(245)), "4m05s");
    assert_eq!(hms(Duration::from_secs(3723)), "1h02m03s");
}

#[test]
fn qsd_reads_rbd_images_with_its_own_driver() {
    let b = plan::qsd_rbd_blockdev("pool/ns/img");
    assert!(
        b.starts_with("driver=rbd,node-name=d,pool=pool,image=img,cache.direct=on,namespace=ns"),
        "{b}"
    );
    let b = plan::qsd_rbd_blockdev("rbd/img");
    assert!(
        b.starts_with("driver=rbd,node-name=d,pool=rbd,image=img,cache.direct=on"),
        "{b}"
    );
}

/// The columns interleave within each cell: a cell's runs of every column are
/// done together, repeat `i` starts at the `i`-th column, and a resumed sweep
/// does only the runs missing from the results (with the warm-ups of the columns
/// that miss some).
#[test]
fn columns_interleave_within_each_cell() {
    use std::collections::{BTreeMap, BTreeSet};

    use super::runner::{order, Step};
    let cell = |jobs| Cell {
        bs: 4096,
        op: Op::Randread,
        jobs,
        iodepth: 1,
    };
    let (b, one, two) = (Setup::Baseline, Setup::IoThreads(1), Setup::IoThreads(2));
    let cells = [cell(1), cell(4)];
    let setups = [b, one, two];
    let steps = order(&cells, &setups, &BTreeMap::new(), 3, 1);
    assert_eq!(steps.len(), 2 * 3 * (1 + 3));
    let mut seen: Vec<Cell> = steps.iter().map(|s| s.cell).collect();
    seen.dedup();
    assert_eq!(
        seen, cells,
        "each cell's runs are contiguous, in matrix order"
    );
    for half in steps.chunks(12) {
        let warmups: Vec<(Setup, Option<u32>)> =
            half[..3].iter().map(|s| (s.setup, s.run)).collect();
        assert_eq!(warmups, [(b, None), (one, None), (two, None)]);
        let measured: Vec<(u32, Setup)> = half[3..]
            .iter()
            .map(|s| (s.run.expect("measured"), s.setup))
            .collect();
        assert_eq!(
            measured,
            [
                (1, b),
                (1, one),
                (1, two),
                (2, one),
                (2, two),
                (2, b),
                (3, two),
                (3, b),
                (3, one)
            ],
            "the first column rotates with the repeat"
        );
    }

    let mut done = BTreeMap::new();
    done.insert((cell(1), b), BTreeSet::from([1, 2, 3]));
    done.insert((cell(1), one), BTreeSet::from([1, 3]));
    done.insert((cell(1), two), BTreeSet::from([1, 2, 3]));
    done.insert((cell(4), two), BTreeSet::from([2]));
    let steps = order(&cells, &setups, &done, 3, 1);
    let step = |c, setup, run| Step {
        cell: c,
        setup,
        run,
    };
    assert_eq!(
        steps[..2],
        [step(cell(1), one, None), step(cell(1), one, Some(2))],
        "only the missing run, after its column's warm-up"
    );
    assert_eq!(steps.len(), 2 + 12 - 1);
    assert!(!steps.contains(&step(cell(4), two, Some(2))));
    assert_eq!(steps[2..5].iter().filter(|s| s.run.is_none()).count(), 3);

    assert!(order(&cells, &setups, &BTreeMap::new(), 2, 0)
        .iter()
        .all(|s| s.run.is_some()));
    let all: BTreeMap<_, _> = cells
        .iter()
        .flat_map(|&c| setups.map(|s| ((c, s), BTreeSet::from([1, 2]))))
        .collect();
    assert!(
        order(&cells, &setups, &all, 2, 1).is_empty(),
        "nothing left to do"
    );
}

#[test]
fn a_run_records_what_the_controller_did_during_it() {
    use serde_json::json;
    let threads = |active: &[bool]| {
        json!(active
            .iter()
            .map(|a| json!({ "id": 0, "active": a }))
            .collect::<Vec<_>>())
    };
    let before = measure::TuneState::parse(
        &json!({ "auto": true, "moves": { "balance": 2, "park": 1 }, "failed-moves": 0 }),
        &threads(&[true, false]),
    )
    .unwrap();
    let after = measure::TuneState::parse(
        &json!({ "auto": true, "moves": { "balance": 5, "park": 1, "wake": 1 },
                 "failed-moves": 1 }),
        &threads(&[true, true]),
    )
    .unwrap();
    let d = before.until(&after);
    let moves: Vec<_> = d.moves.iter().map(|(r, n)| (r.as_str(), *n)).collect();
    assert_eq!(moves, [("balance", 3), ("wake", 1)]);
    assert_eq!((d.failed_moves, d.active_iothreads), (1, 2));
    // A daemon that does not tune has nothing to record.
    assert_eq!(
        measure::TuneState::parse(&json!({ "auto": false }), &threads(&[true])),
        None
    );
}

/// The announced time and the ETA before the first run count each run with
/// its column's ramp: `auto`'s runs ramp 4 s and its warm-up 8 s where the
/// quick matrix ramps 0.25 s.
#[test]
fn the_estimate_counts_autos_longer_ramps() {
    use std::collections::BTreeMap;

    use super::runner::{estimate_s, order};
    let p = plan(&["--backend", "null"]).unwrap();
    let cell = Cell {
        bs: 4096,
        op: Op::Randread,
        jobs: 1,
        iodepth: 1,
    };
    let one = [Setup::IoThreads(1)];
    let fixed = estimate_s(&p, &order(&[cell], &one, &BTreeMap::new(), 2, 1));
    assert!((fixed - 3.0 * 1.3).abs() < 1e-9, "{fixed}");
    let auto = [Setup::Auto];
    let auto = estimate_s(&p, &order(&[cell], &auto, &BTreeMap::new(), 2, 1));
    let expected = (1.0 + 8.0 + 0.05) + 2.0 * (1.0 + 4.0 + 0.05);
    assert!((auto - expected).abs() < 1e-9, "{auto}");
}
