//! `vqblk sweep | report | recommend` end to end, through the real binary: the
//! daemon and the load generator are the same executable users run.

mod common;

use std::path::Path;

use common::{vqblk, vqblk_ok};
use vqblk_study::matrix::Setup;
use vqblk_study::results::Results;

/// A matrix small enough for seconds: 2 cells x (baseline, 1, 2) IOThreads.
fn tiny_matrix(dir: &Path, ops: &str) -> String {
    let p = dir.join("tiny.toml");
    std::fs::write(
        &p,
        format!("ops = [{ops}]\nsizes = [\"4k\"]\njobs = [1, 2]\niodepth = [4]\niothreads = [\"baseline\", 1, 2]\nruntime = \"200ms\"\nramp-time = \"50ms\"\n"),
    )
    .unwrap();
    p.display().to_string()
}

fn sweep_args<'a>(matrix: &'a str, results: &'a str, storage: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "sweep",
        "--matrix",
        matrix,
        "--results",
        results,
        "--warmups",
        "1",
    ];
    if !storage.contains(&"--repeats") {
        v.extend(["--repeats", "2"]);
    }
    v.extend_from_slice(storage);
    v
}

#[test]
fn null_sweep_report_recommend_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let m = tiny_matrix(d, "\"randread\"");
    let res = d.join("r.jsonl");
    let res_s = res.to_str().unwrap();
    // The serving and benching executable named explicitly (the other tests use
    // the default, the running executable).
    let bin = common::vqblk_bin().canonicalize().unwrap();
    let bin_s = bin.to_str().unwrap();
    vqblk_ok(
        d,
        &sweep_args(
            &m,
            res_s,
            &["--backend", "null", "--size", "64M", "--vqblk", bin_s],
        ),
    );

    let r = Results::read(&res).unwrap();
    let servers: Vec<_> = r.servers.iter().map(|s| s.argv[0].as_str()).collect();
    assert!(
        !servers.is_empty() && servers.iter().all(|a| *a == bin_s),
        "{servers:?}"
    );
    assert_eq!(r.headers.len(), 1);
    let h = &r.headers[0];
    assert_eq!(h.storage.kind, "null");
    assert_eq!(h.queues, 2, "as many queues as the largest job count");
    assert!(h.vqblk_version.starts_with("vqblk "), "{}", h.vqblk_version);
    assert!(h.host.nproc >= 1 && !h.host.kernel.is_empty());
    assert!(h.commands["baseline"].contains("--iothreads 1 --poll off"));
    assert_eq!(
        r.runs.len(),
        2 * 3 * 2,
        "2 cells x 3 columns x 2 measured runs (warm-ups not recorded)"
    );
    assert!(r
        .runs
        .iter()
        .all(|x| x.mb_s > 0.0 && x.iops > 0.0 && x.p99_us.is_some()));
    assert!(
        r.runs.iter().all(|x| x.server_cpu_s.is_some()),
        "server CPU is measured"
    );
    assert_eq!(
        r.setups(),
        vec![Setup::Baseline, Setup::IoThreads(1), Setup::IoThreads(2)]
    );
    assert!(r
        .skips
        .iter()
        .any(|s| s.setup == "native" && s.reason.starts_with("n/a")));
    assert_eq!(r.servers.len(), 3, "one server per column");
    assert!(r
        .servers
        .iter()
        .any(|s| s.argv.join(" ").contains("--queues 2 --iothreads 2")));

    // Resume: nothing left to do, nothing measured again.
    let out = vqblk(
        d,
        &sweep_args(&m, res_s, &["--backend", "null", "--size", "64M"]),
    );
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("0 runs to do"));
    assert_eq!(Results::read(&res).unwrap().runs.len(), 12);

    // Resume after losing the last three runs (a sweep killed mid-way).
    let text = std::fs::read_to_string(&res).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    for _ in 0..3 {
        let i = lines
            .iter()
            .rposition(|l| l.contains("\"type\":\"run\""))
            .unwrap();
        lines.remove(i);
    }
    std::fs::write(&res, lines.join("\n") + "\n").unwrap();
    let out = vqblk(
        d,
        &sweep_args(&m, res_s, &["--backend", "null", "--size", "64M"]),
    );
    assert!(out.status.success());
    let r = Results::read(&res).unwrap();
    assert_eq!(
        r.runs.len(),
        12,
        "exactly the three missing runs were measured again"
    );
    assert_eq!(r.headers.len(), 3);

    // A different storage in the same results file is refused.
    let out = vqblk(
        d,
        &sweep_args(&m, res_s, &["--backend", "null", "--size", "128M"]),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("use another results file"));

    // Report: every format into a directory, and Markdown on stdout.
    let out_dir = d.join("report");
    vqblk_ok(d, &["report", res_s, "--out", out_dir.to_str().unwrap()]);
    for f in ["report.md", "report.csv", "report.json", "report.html"] {
        assert!(out_dir.join(f).metadata().unwrap().len() > 100, "{f}");
    }
    let md = vqblk_ok(d, &["report", res_s]);
    assert!(md.contains("## Best improvement over baseline with additional IOThreads"));
    assert!(md.contains("## Minimum IOThread count to achieve 90% of best performance"));
    assert!(md.contains("| size | op | 1/4 | 2/4 |"), "{md}");
    assert!(md.contains("| 4k | randread |"));
    assert!(md.contains("**4k Total**"));
    assert!(
        !md.contains("Ratio of best performance to native"),
        "no native column for null"
    );
    let csv = vqblk_ok(d, &["report", res_s, "--format", "csv"]);
    assert!(csv.starts_with(
        "kind,size,bs,op,jobs,iodepth,baseline_mb_s,iothreads_1_mb_s,iothreads_2_mb_s,best_mb_s"
    ));
    assert_eq!(csv.lines().filter(|l| l.starts_with("cell,")).count(), 2);
    assert_eq!(csv.lines().filter(|l| l.starts_with("total,")).count(), 2);
    let json: serde_json::Value =
        serde_json::from_str(&vqblk_ok(d, &["report", res_s, "--format", "json"])).unwrap();
    assert_eq!(json["cells"].as_array().unwrap().len(), 2);
    assert!(
        json["cells"][0]["setups"]["iothreads=2"]["p99_us"]
            .as_f64()
            .unwrap()
            > 0.0
    );

    // Recommend: per-cell reasoning, a decision, and the snippets.
    let rec = vqblk_ok(d, &["recommend", res_s, "--workload", "randread"]);
    assert!(rec.contains("Decision: "), "{rec}");
    assert!(rec.contains("randread 4k jobs=2 iodepth=4"));
    for s in [
        "vqblk serve --image",
        "<iothreads>",
        "<iothreadpin",
        "iothread-vq-mapping",
        "supplementalPoolThreadCount",
        "blockMultiQueue: true",
    ] {
        assert!(rec.contains(s), "missing {s}");
    }
    let out = vqblk(d, &["recommend", res_s, "--workload", "write"]);
    assert_eq!(out.status.code(), Some(2), "no cell matches");

    // With limits: the snippets carry them; limits vqblk serve would refuse are
    // refused here, naming the key.
    let rec = vqblk_ok(
        d,
        &[
            "recommend",
            res_s,
            "--workload",
            "randread",
            "--throttle",
            "iops-total=2000",
        ],
    );
    for s in [
        " --throttle iops-total=2000\n",
        "[export.throttle]\niops-total = 2000\n",
        "<total_iops_sec>2000</total_iops_sec>",
    ] {
        assert!(rec.contains(s), "missing {s} in {rec}");
    }
    let out = vqblk(
        d,
        &[
            "recommend",
            res_s,
            "--throttle",
            "iops-total=100,iops-read=50",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "invalid limits");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--throttle") && err.contains("iops-read"),
        "{err}"
    );
}

#[test]
fn file_sweep_runs_native_and_writes_only_inside_the_image() {
    let dir = tempfile::tempdir_in(
        // O_DIRECT needs a real filesystem: the target directory, not a tmpfs /tmp.
        env!("CARGO_TARGET_TMPDIR"),
    )
    .unwrap();
    let d = dir.path();
    let m = tiny_matrix(d, "\"randwrite\", \"read\"");
    let img = d.join("disk.raw");
    let res = d.join("f.jsonl");
    vqblk_ok(
        d,
        &sweep_args(
            &m,
            res.to_str().unwrap(),
            &[
                "--image",
                img.to_str().unwrap(),
                "--create",
                "32M",
                "--repeats",
                "1",
            ],
        ),
    );
    assert_eq!(
        img.metadata().unwrap().len(),
        32 << 20,
        "writes stay inside the image"
    );
    let r = Results::read(&res).unwrap();
    assert_eq!(r.headers[0].storage.kind, "image");
    assert_eq!(
        r.setups(),
        vec![
            Setup::Native,
            Setup::Baseline,
            Setup::IoThreads(1),
            Setup::IoThreads(2)
        ]
    );
    assert_eq!(r.runs.len(), 4 * 4, "4 cells x 4 columns x 1 run");
    assert!(r
        .runs
        .iter()
        .filter(|x| x.setup() == Setup::Native)
        .all(|x| x.argv.iter().any(|a| a.starts_with("file:")) && x.server_cpu_s.is_none()));
    assert!(r
        .servers
        .iter()
        .all(|s| s.argv.join(" ").contains("--cache none")));
    let md = vqblk_ok(d, &["report", res.to_str().unwrap()]);
    assert!(
        md.contains("## Ratio of best performance to native"),
        "{md}"
    );
}

#[test]
fn qemu_storage_daemon_baseline() {
    assert!(
        Path::new("/usr/bin/qemu-storage-daemon").exists(),
        "qemu-storage-daemon is missing: run scripts/install-deps.sh (qemu-utils)"
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = d.join("m.toml");
    std::fs::write(&p, "ops = [\"randread\"]\nsizes = [4096]\njobs = [2]\niodepth = [1]\niothreads = [\"baseline\", 2]\nruntime = 0.2\nramp-time = 0\n").unwrap();
    let res = d.join("q.jsonl");
    vqblk_ok(
        d,
        &[
            "sweep",
            "--matrix",
            p.to_str().unwrap(),
            "--results",
            res.to_str().unwrap(),
            "--backend",
            "null",
            "--size",
            "64M",
            "--baseline",
            "qemu-storage-daemon",
            "--repeats",
            "1",
            "--warmups",
            "0",
        ],
    );
    let r = Results::read(&res).unwrap();
    assert_eq!(r.runs.len(), 2);
    let qsd = r.servers.iter().find(|s| s.setup == "baseline").unwrap();
    assert_eq!(qsd.argv[0], "qemu-storage-daemon");
    assert!(qsd
        .argv
        .join(" ")
        .contains("driver=null-co,node-name=d,size=67108864,read-zeroes=on"));
    assert!(r.runs.iter().all(|x| x.mb_s > 0.0));
}

/// `auto` is a column of the matrix: its server runs `--iothreads auto`, its
/// runs ramp long enough for the tuner, and the report and the
/// recommendation compare it with the best fixed count.
#[test]
fn auto_column_is_swept_reported_and_compared() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let m = d.join("auto.toml");
    std::fs::write(
        &m,
        "ops = [\"randread\"]\nsizes = [\"4k\"]\njobs = [2]\niodepth = [4]\n\
         iothreads = [1, \"auto\"]\nruntime = \"200ms\"\nramp-time = \"50ms\"\n",
    )
    .unwrap();
    let res = d.join("a.jsonl");
    let (m_s, res_s) = (m.to_str().unwrap(), res.to_str().unwrap());
    vqblk_ok(
        d,
        &[
            "sweep",
            "--matrix",
            m_s,
            "--results",
            res_s,
            "--warmups",
            "0",
            "--repeats",
            "1",
            "--backend",
            "null",
            "--size",
            "64M",
        ],
    );
    let r = Results::read(&res).unwrap();
    let auto: Vec<_> = r.servers.iter().filter(|s| s.setup == "auto").collect();
    assert_eq!(auto.len(), 1, "{:?}", r.servers);
    assert!(auto[0].argv.join(" ").contains("--iothreads auto"));
    let run = r
        .runs
        .iter()
        .find(|x| x.setup == "auto")
        .expect("an auto run");
    assert!(run.mb_s > 0.0);
    assert!(
        run.argv.join(" ").contains("--ramp_time 4000ms"),
        "{:?}",
        run.argv
    );
    // What the controller did during the run, asked through its control
    // socket, and which server threads worked.
    let tune = run
        .tune
        .as_ref()
        .expect("the auto run's controller figures");
    assert!((1..=2).contains(&tune.active_iothreads), "{tune:?}");
    assert!(
        run.server_threads
            .keys()
            .any(|t| t.starts_with("vqblk-iot")),
        "{:?}",
        run.server_threads
    );
    let fixed = r.runs.iter().find(|x| x.setup == "iothreads=1").unwrap();
    assert!(fixed.tune.is_none());
    assert!(fixed.server_threads.contains_key("vqblk-iot0"), "{fixed:?}");
    // Every vqblk column's IOThreads counted their passes during the run.
    for run in [run, fixed] {
        let c = run.iothread_counters.as_ref().expect("IOThread counters");
        assert!(c.passes > 0, "{run:?}");
    }
    // The servers' logs are kept beside the results, `auto`'s at info
    // level (its controller's decisions).
    let auto_log = std::fs::read_to_string(d.join("a.logs").join("auto.log")).unwrap();
    assert!(auto_log.contains("level=INFO"), "{auto_log}");
    assert!(d.join("a.logs").join("iothreads-1.log").exists());
    let md = vqblk_ok(d, &["report", res_s]);
    assert!(
        md.contains("auto against the best fixed IOThread count"),
        "{md}"
    );
    let rec = vqblk_ok(d, &["recommend", res_s]);
    assert!(
        rec.contains("auto (`--iothreads auto`, tuned online):"),
        "{rec}"
    );
}

#[test]
fn dry_run_applies_the_skip_rule() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let res = d.join("x.jsonl");
    let out = vqblk(
        d,
        &[
            "sweep",
            "--matrix",
            "seeds",
            "--backend",
            "null",
            "--results",
            res.to_str().unwrap(),
            "--dry-run",
            "--max-iothreads",
            "4",
        ],
    );
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "144 cells x columns [baseline, iothreads=1, iothreads=2, iothreads=3, iothreads=4, auto]"
        ),
        "{err}"
    );
    for k in [6, 8, 12, 16] {
        assert!(
            err.contains(&format!(
                "iothreads={k}: skipped: {k} IOThreads > --max-iothreads 4"
            )),
            "{err}"
        );
    }
    assert!(err.contains("native: n/a"));
    let cmds = String::from_utf8_lossy(&out.stdout);
    assert!(
        cmds.contains("serve: ") && cmds.contains("--queues 16 --iothreads K"),
        "{cmds}"
    );
    assert!(!res.exists(), "a dry run writes nothing");
    // A device with write cells needs --force.
    let out = vqblk(
        d,
        &[
            "sweep",
            "--device",
            "/dev/null",
            "--results",
            res.to_str().unwrap(),
            "--dry-run",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
}
