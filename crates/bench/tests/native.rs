//! The native baseline: a plain file through io_uring, with and without O_DIRECT.

mod common;

use common::{bench, check_dir, corrupt};

#[test]
fn file_modes_with_and_without_o_direct() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("disk.raw");
    let target = format!("file:{}", f.display());
    // A missing file is laid out (written) to the region's size first.
    for direct in ["1", "0"] {
        for rw in ["read", "randwrite", "randrw"] {
            let r = bench(&[
                "--target",
                &target,
                "--size",
                "4m",
                "--rw",
                rw,
                "--bs",
                "4k",
                "--iodepth",
                "8",
                "--direct",
                direct,
                "--output-format",
                "json",
            ]);
            assert_eq!(r.code, 0, "direct={direct} rw={rw}: {:?}", r.error);
            let j = r.json();
            let job = &j["jobs"][0];
            let n = check_dir(&job["read"], 4096) + check_dir(&job["write"], 4096);
            assert_eq!(n, 1024, "direct={direct} rw={rw}");
            assert_eq!(j["vqblk"]["targets"][0]["engine"], "io_uring");
            assert_eq!(j["vqblk"]["targets"][0]["direct"], direct == "1");
        }
    }
    assert_eq!(std::fs::metadata(&f).unwrap().len(), 4 << 20);
}

#[test]
fn file_time_based() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("disk.raw");
    let r = bench(&[
        "--target",
        &format!("file:{}", f.display()),
        "--size",
        "2m",
        "--rw",
        "randread",
        "--time_based",
        "--runtime",
        "500ms",
        "--output-format",
        "json",
    ]);
    assert_eq!(r.code, 0, "{:?}", r.error);
    let read = &r.json()["jobs"][0]["read"];
    // Time based: the 512 blocks are read over and over.
    assert!(check_dir(read, 4096) > 512);
    let rt = read["runtime"].as_u64().unwrap();
    assert!((480..1500).contains(&rt), "runtime {rt}");
}

#[test]
fn file_verify_detects_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("disk.raw");
    let target = format!("file:{}", f.display());
    let args = [
        "--target",
        &target,
        "--size",
        "1m",
        "--rw",
        "randwrite",
        "--bs",
        "4k",
        "--iodepth",
        "4",
        "--verify",
        "crc32c",
        "--output-format",
        "json",
    ];
    let r = bench(&args);
    assert_eq!(r.code, 0, "{:?}", r.error);
    let f2 = f.clone();
    let mut hook = move || {
        corrupt(&f2, 200 * 4096 + 4000, 1);
        Ok(())
    };
    let r = common::bench_with_hook(&args, &mut hook);
    assert_eq!(r.code, 1);
    let v = &r.json()["vqblk"]["verify"];
    assert_eq!(v["errors"], 1);
    assert_eq!(v["mismatches"][0]["offset"], 200 * 4096);
}

#[test]
fn file_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("small.raw");
    std::fs::write(&f, vec![0u8; 1 << 20]).unwrap();
    let t = format!("file:{}", f.display());
    let missing = format!("file:{}", dir.path().join("nope").display());
    let dev_t = format!("dev:{}", f.display());
    for (args, needle) in [
        (vec!["--target", t.as_str(), "--size", "2m"], "past the end"),
        (vec!["--target", missing.as_str()], "give size="),
        (vec!["--target", dev_t.as_str()], "not a block device"),
        (
            vec!["--target", t.as_str(), "--direct", "maybe"],
            "'direct'",
        ),
    ] {
        let r = bench(&args);
        assert_eq!(r.code, 2, "{args:?}");
        assert!(
            r.error.as_deref().unwrap().contains(needle),
            "{args:?}: {:?}",
            r.error
        );
    }
}

#[test]
fn ramp_time_is_not_counted_and_size_is_done_once() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("disk.raw");
    let r = bench(&[
        "--target",
        &format!("file:{}", f.display()),
        "--size",
        "1m",
        "--rw",
        "randread",
        "--ramp_time",
        "200ms",
        "--iodepth",
        "4",
        "--direct",
        "0",
        "--output-format",
        "json",
    ]);
    assert_eq!(r.code, 0, "{:?}", r.error);
    let read = &r.json()["jobs"][0]["read"];
    // The ramp wraps over the region as often as it likes; the measured pass is one
    // pass over the 256 blocks, no more, no less.
    assert_eq!(check_dir(read, 4096), 256);
}
