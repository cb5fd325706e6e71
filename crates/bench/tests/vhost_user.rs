//! `vqblk bench` against a real vhost-user-blk server (qemu-storage-daemon), through
//! libblkio, checking fio's accounting, the JSON layout, verify, and bad input.

mod common;

use std::os::unix::net::{UnixDatagram, UnixListener};

use common::{bench, bench_with_hook, check_dir, corrupt, Qsd};

const MIB: u64 = 1 << 20;

#[test]
fn every_rw_mode_runs_and_accounts_bytes() {
    let q = Qsd::file(8 * MIB);
    let t = q.target();
    for rw in [
        "read",
        "write",
        "randread",
        "randwrite",
        "randrw",
        "readwrite",
    ] {
        let r = bench(&[
            "--target",
            &t,
            "--rw",
            rw,
            "--bs",
            "4k",
            "--iodepth",
            "4",
            "--size",
            "2m",
            "--output-format",
            "json",
        ]);
        assert_eq!(r.code, 0, "rw={rw}: {:?}", r.error);
        let j = r.json();
        let job = &j["jobs"][0];
        let reads = check_dir(&job["read"], 4096);
        let writes = check_dir(&job["write"], 4096);
        // Without time_based each job does `size` bytes exactly once.
        assert_eq!(reads + writes, 512, "rw={rw}");
        match rw {
            "read" | "randread" => assert_eq!(writes, 0),
            "write" | "randwrite" => assert_eq!(reads, 0),
            _ => assert!(reads > 0 && writes > 0, "rw={rw}: {reads}/{writes}"),
        }
    }
}

#[test]
fn readwrite_alias_and_mix() {
    let q = Qsd::null(64 * MIB);
    let r = bench(&[
        "--target",
        &q.target(),
        "--readwrite",
        "randrw",
        "--rwmixread",
        "75",
        "--bs",
        "8k",
        "--size",
        "8m",
        "--output-format",
        "json",
    ]);
    assert_eq!(r.code, 0, "{:?}", r.error);
    let job = &r.json()["jobs"][0];
    let reads = check_dir(&job["read"], 8192);
    let writes = check_dir(&job["write"], 8192);
    assert_eq!(reads + writes, 1024);
    assert!((650..=880).contains(&reads), "{reads} reads of 1024 at 75%");
}

#[test]
fn every_wait_mode_runs() {
    let q = Qsd::null(64 * MIB);
    for mode in ["block", "eventfd", "loop"] {
        let r = bench(&[
            "--target",
            &q.target(),
            "--rw",
            "randread",
            "--bs",
            "4k",
            "--iodepth",
            "8",
            "--size",
            "4m",
            "--libblkio_wait_mode",
            mode,
            "--output-format",
            "json",
        ]);
        assert_eq!(r.code, 0, "wait mode {mode}: {:?}", r.error);
        let j = r.json();
        assert_eq!(
            check_dir(&j["jobs"][0]["read"], 4096),
            1024,
            "wait mode {mode}"
        );
        assert_eq!(j["vqblk"]["targets"][0]["wait_mode"], mode);
    }
}

#[test]
fn json_has_fio_keys_and_server_cpu() {
    let q = Qsd::null(64 * MIB);
    let pid = q.pid().to_string();
    let r = bench(&[
        "--target",
        &q.target(),
        "--rw",
        "randread",
        "--bs",
        "4k",
        "--iodepth",
        "2",
        "--time_based",
        "--runtime",
        "1s",
        "--ramp_time",
        "200ms",
        "--name",
        "probe",
        "--server-pid",
        &pid,
        "--output-format=json",
    ]);
    assert_eq!(r.code, 0, "{:?}", r.error);
    let j = r.json();
    assert!(j["fio version"]
        .as_str()
        .unwrap()
        .starts_with("vqblk-bench-"));
    assert!(j["timestamp"].as_u64().unwrap() > 1_600_000_000);
    let job = &j["jobs"][0];
    assert_eq!(job["jobname"], "probe");
    for dir in ["read", "write", "trim"] {
        let d = &job[dir];
        for k in ["io_bytes", "bw", "bw_bytes", "iops", "runtime", "total_ios"] {
            assert!(d[k].is_number(), "{dir}.{k} missing: {d}");
        }
        for lat in ["clat_ns", "lat_ns"] {
            let l = &d[lat];
            for k in ["min", "max", "mean", "stddev", "N"] {
                assert!(l[k].is_number(), "{dir}.{lat}.{k} missing");
            }
            let p = l["percentile"].as_object().expect("percentile");
            for k in [
                "1.000000",
                "5.000000",
                "10.000000",
                "20.000000",
                "30.000000",
                "40.000000",
                "50.000000",
                "60.000000",
                "70.000000",
                "80.000000",
                "90.000000",
                "95.000000",
                "99.000000",
                "99.500000",
                "99.900000",
                "99.950000",
                "99.990000",
            ] {
                assert!(p[k].is_u64(), "{dir}.{lat}.percentile[{k}] missing");
            }
        }
    }
    let read = &job["read"];
    let ios = check_dir(read, 4096);
    assert!(ios > 100, "{ios}");
    assert_eq!(read["clat_ns"]["N"].as_u64(), Some(ios));
    // Runtime is the measured time (after the ramp), close to 1 s.
    let rt = read["runtime"].as_u64().unwrap();
    assert!((950..2500).contains(&rt), "runtime {rt} ms");
    let p50 = read["clat_ns"]["percentile"]["50.000000"].as_u64().unwrap();
    let p99 = read["clat_ns"]["percentile"]["99.000000"].as_u64().unwrap();
    assert!(p50 <= p99 && p99 <= read["clat_ns"]["max"].as_u64().unwrap());
    assert!(job["usr_cpu"].as_f64().unwrap() + job["sys_cpu"].as_f64().unwrap() > 1.0);
    let vq = &j["vqblk"];
    assert!(vq["server_cpu_s"].as_f64().unwrap() > 0.0, "{vq}");
    assert!(vq["server_cpu_per_io_us"].as_f64().unwrap() > 0.0);
    assert!(vq["client_cpu_per_io_us"].as_f64().unwrap() > 0.0);
    assert_eq!(vq["server_pid"].as_u64(), Some(u64::from(q.pid())));
}

#[test]
fn normal_output_reads_like_fio() {
    let q = Qsd::null(64 * MIB);
    let r = bench(&["--target", &q.target(), "--rw", "randread", "--size", "1m"]);
    assert_eq!(r.code, 0, "{:?}", r.error);
    for needle in [
        "read: IOPS=",
        "clat percentiles",
        "99.99th=[",
        "Run status group 0",
        "cpu          :",
    ] {
        assert!(r.stdout.contains(needle), "no '{needle}' in:\n{}", r.stdout);
    }
}

#[test]
fn numjobs_use_one_queue_each_and_group() {
    let q = Qsd::null(64 * MIB);
    let r = bench(&[
        "--target",
        &q.target(),
        "--rw",
        "randread",
        "--numjobs",
        "3",
        "--size",
        "1m",
        "--group_reporting",
        "--output-format",
        "json",
    ]);
    assert_eq!(r.code, 0, "{:?}", r.error);
    let j = r.json();
    assert_eq!(j["jobs"].as_array().unwrap().len(), 1);
    assert_eq!(j["jobs"][0]["job_threads"], 3);
    assert_eq!(check_dir(&j["jobs"][0]["read"], 4096), 3 * 256);
    assert_eq!(j["vqblk"]["targets"][0]["num_queues"], 3);

    let r = bench(&[
        "--target",
        &q.target(),
        "--rw",
        "randread",
        "--numjobs",
        "2",
        "--size",
        "1m",
        "--output-format",
        "json",
    ]);
    assert_eq!(r.json()["jobs"].as_array().unwrap().len(), 2);
}

#[test]
fn verify_passes_on_a_clean_run() {
    let q = Qsd::file(8 * MIB);
    let r = bench(&[
        "--target",
        &q.target(),
        "--rw",
        "randwrite",
        "--bs",
        "4k",
        "--iodepth",
        "16",
        "--verify",
        "crc32c",
        "--output-format",
        "json",
    ]);
    assert_eq!(r.code, 0, "{:?}\n{}", r.error, r.stdout);
    let j = r.json();
    assert_eq!(j["vqblk"]["verify"]["blocks_checked"], 2048);
    assert_eq!(j["vqblk"]["verify"]["errors"], 0);
    assert_eq!(check_dir(&j["jobs"][0]["write"], 4096), 2048);
    assert_eq!(check_dir(&j["jobs"][0]["read"], 4096), 2048);
}

#[test]
fn verify_reports_the_corrupted_block() {
    let q = Qsd::file(8 * MIB);
    let image = q.image.clone().unwrap();
    let bad = 37 * 4096 + 1000;
    let mut hook = || {
        corrupt(&image, bad, 16);
        Ok(())
    };
    let r = bench_with_hook(
        &[
            "--target",
            &q.target(),
            "--rw",
            "write",
            "--bs",
            "4k",
            "--iodepth",
            "4",
            "--size",
            "1m",
            "--verify",
            "crc32c",
            "--output-format",
            "json",
        ],
        &mut hook,
    );
    assert_eq!(r.code, 1, "{:?}", r.error);
    let v = &r.json()["vqblk"]["verify"];
    assert_eq!(v["errors"], 1, "{v}");
    let m = &v["mismatches"][0];
    assert_eq!(m["offset"], 37 * 4096);
    assert_eq!(m["first_bad_byte"], 1000);
    assert_ne!(m["expected_crc"], m["found_crc"]);
}

#[test]
fn verify_pause_file_lets_the_image_change_between_passes() {
    let q = Qsd::file(8 * MIB);
    let image = q.image.clone().unwrap();
    let pause = q.dir.path().join("pause");
    // Two job threads on disjoint halves; corrupt one block in the second half.
    let bad_block = 4 * MIB + 5 * 8192;
    let p2 = pause.clone();
    let corrupter = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !p2.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "pause file never appeared"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        corrupt(&image, bad_block + 8000, 8);
        std::fs::remove_file(&p2).unwrap();
    });
    let r = bench(&[
        "--target",
        &q.target(),
        "--rw",
        "randwrite",
        "--bs",
        "8k",
        "--numjobs",
        "2",
        "--size",
        "4m",
        "--offset_increment",
        "4m",
        "--verify",
        "crc32c",
        "--verify_pause_file",
        pause.to_str().unwrap(),
    ]);
    corrupter.join().unwrap();
    assert_eq!(r.code, 1, "{:?}\n{}", r.error, r.stdout);
    assert!(
        r.stdout
            .contains(&format!("bad block at offset {bad_block}:")),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("1024 blocks checked, 1 bad"),
        "{}",
        r.stdout
    );
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let q = Qsd::file(8 * MIB);
    let t = q.target();
    let dir = tempfile::tempdir().unwrap();
    let silent = dir.path().join("silent.sock");
    let _listener = UnixListener::bind(&silent).unwrap();
    let dgram = dir.path().join("dgram.sock");
    let _dgram = UnixDatagram::bind(&dgram).unwrap();
    let regular = dir.path().join("regular");
    std::fs::write(&regular, b"x").unwrap();
    let missing = dir.path().join("missing.sock");
    let silent_t = format!("unix:{}", silent.display());
    let dgram_t = format!("unix:{}", dgram.display());
    let regular_t = format!("unix:{}", regular.display());
    let missing_t = format!("unix:{}", missing.display());
    let jobfile = dir.path().join("bad.fio");
    std::fs::write(&jobfile, format!("[j]\ntarget={t}\nbssplit=4k/50\n")).unwrap();
    let jobfile_s = jobfile.to_str().unwrap().to_string();

    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--target", &missing_t], "cannot reach the socket"),
        (vec!["--target", &regular_t], "not a Unix socket"),
        (vec!["--target", &dgram_t], "Protocol wrong type"),
        (
            vec!["--target", &silent_t, "--connect-timeout", "1s"],
            "no vhost-user answer",
        ),
        (vec!["--target", &t, "--size", "16m"], "past the end"),
        (vec!["--target", &t, "--offset", "8m"], "past the end"),
        (vec!["--target", &t, "--bs", "1000"], "multiple of 512"),
        (
            vec!["--target", &t, "--iodepth", "64", "--queue_size", "64"],
            "iodepth 64 is larger",
        ),
        (vec!["--target", &t, "--queue_size", "100"], "power of two"),
        (vec!["--target", &t, "--numjobs", "5"], "offers 4"),
        (vec!["--target", &t, "--rw", "sideways"], "'rw'"),
        (
            vec!["--target", &t, "--verify", "crc32c", "--rw", "read"],
            "rw=write",
        ),
        (vec!["--target", &t, "--time_based"], "needs a runtime"),
        (vec![&jobfile_s], "unsupported option 'bssplit'"),
        (vec!["--target", "nbd:/x"], "'target'"),
        (
            vec!["--target", &t, "--output-format", "xml"],
            "normal or json",
        ),
    ];
    for (args, needle) in cases {
        let r = bench(&args);
        assert_eq!(
            r.code, 2,
            "{args:?}: expected exit 2, got {} ({:?})",
            r.code, r.error
        );
        let e = r.error.unwrap();
        assert!(e.contains(needle), "{args:?}: error '{e}' lacks '{needle}'");
        assert!(!e.contains('\n'), "{args:?}: error is not one line: {e}");
    }
    // The server is still fine afterwards.
    let r = bench(&["--target", &t, "--size", "64k"]);
    assert_eq!(r.code, 0, "{:?}", r.error);
}

#[test]
fn job_file_runs_two_jobs() {
    let q = Qsd::null(64 * MIB);
    let dir = tempfile::tempdir().unwrap();
    let jf = dir.path().join("two.fio");
    std::fs::write(
        &jf,
        format!(
            "[global]\nioengine=libblkio\nlibblkio_driver=virtio-blk-vhost-user\n\
             libblkio_path={}\nthread\nbs=4k\nsize=1m\n\n[reader]\nrw=randread\n\n\
             [writer]\nrw=write\niodepth=4\n",
            q.sock.display()
        ),
    )
    .unwrap();
    let r = bench(&[jf.to_str().unwrap(), "--output-format", "json"]);
    assert_eq!(r.code, 0, "{:?}", r.error);
    let j = r.json();
    let jobs = j["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2);
    assert_eq!(jobs[0]["jobname"], "reader");
    assert_eq!(check_dir(&jobs[0]["read"], 4096), 256);
    assert_eq!(jobs[1]["jobname"], "writer");
    assert_eq!(check_dir(&jobs[1]["write"], 4096), 256);
}
