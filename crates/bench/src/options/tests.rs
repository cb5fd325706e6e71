//! Unit tests of option parsing and job files.

use super::*;

fn o(k: &str, v: &str) -> RawOption {
    (k.to_string(), Some(v.to_string()))
}

#[test]
fn sizes_use_the_daemons_grammar() {
    let j = |k: &str, v: &str| JobSpec::from_options("x", &[o("target", "file:/x"), o(k, v)]);
    assert_eq!(j("bs", "4KiB").unwrap().bs, 4096);
    assert_eq!(j("bs", "8K").unwrap().bs, 8192);
    assert_eq!(j("size", "2g").unwrap().size, Some(2 << 30));
    assert_eq!(j("offset", "1m").unwrap().offset, 1 << 20);
    assert_eq!(j("offset_increment", "512").unwrap().offset_increment, 512);
    for (k, v) in [("bs", "k"), ("size", "4x"), ("offset", "99999999999p")] {
        let e = j(k, v).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("invalid value '{v}' for option '{k}': a size such as 4096, 4k, 64m or 1g")
        );
    }
}

#[test]
fn times() {
    assert_eq!(parse_time("10"), Some(Duration::from_secs(10)));
    assert_eq!(parse_time("10s"), Some(Duration::from_secs(10)));
    assert_eq!(parse_time("500ms"), Some(Duration::from_millis(500)));
    assert_eq!(parse_time("2m"), Some(Duration::from_secs(120)));
    assert_eq!(parse_time("s"), None);
}

#[test]
fn aliases_and_errors() {
    let j = JobSpec::from_options(
        "x",
        &[
            o("target", "file:/tmp/x"),
            o("readwrite", "randrw"),
            o("rwmixwrite", "30"),
        ],
    )
    .unwrap();
    assert_eq!(j.rw, RwMode::RandRw);
    assert_eq!(j.rwmixread, 70);
    let e = JobSpec::from_options("x", &[o("target", "file:/x"), o("bs", "1000")]).unwrap_err();
    assert!(e.to_string().contains("'bs'"), "{e}");
    let e =
        JobSpec::from_options("x", &[o("target", "file:/x"), o("bssplit", "4k/50")]).unwrap_err();
    assert_eq!(e.to_string(), "unsupported option 'bssplit'");
    let e = JobSpec::from_options("x", &[o("target", "nbd:/x")]).unwrap_err();
    assert!(e.to_string().contains("'target'"));
}

#[test]
fn job_file_inheritance() {
    let text = "; comment\n[global]\ntarget=unix:/s.sock\nbs=8k\ntime_based\nruntime=5\n\n\
                [a]\nrw=randread\n[b]\nrw=write\nbs=4k\n";
    let jobs = jobs_from_sections(&parse_job_file(text).unwrap(), &[]).unwrap();
    assert_eq!(jobs.len(), 2);
    assert_eq!(jobs[0].name, "a");
    assert_eq!(jobs[0].bs, 8192);
    assert!(jobs[0].time_based);
    assert_eq!(jobs[1].bs, 4096);
    assert_eq!(jobs[1].target, Target::Unix("/s.sock".into()));
}

#[test]
fn fio_libblkio_spelling() {
    let text = "[j]\nioengine=libblkio\nlibblkio_driver=virtio-blk-vhost-user\n\
                libblkio_path=/run/d.sock\nthread\n";
    let jobs = jobs_from_sections(&parse_job_file(text).unwrap(), &[]).unwrap();
    assert_eq!(jobs[0].target, Target::Unix("/run/d.sock".into()));
}

#[test]
fn libblkio_wait_mode_defaults_to_block_and_parses_fios_values() {
    let base = [o("target", "unix:/s.sock")];
    assert_eq!(
        JobSpec::from_options("x", &base).unwrap().wait_mode,
        WaitMode::Block
    );
    for (v, m) in [
        ("block", WaitMode::Block),
        ("loop", WaitMode::Loop),
        ("eventfd", WaitMode::Eventfd),
    ] {
        let spec = JobSpec::from_options("x", &[base[0].clone(), o("libblkio_wait_mode", v)]);
        assert_eq!(spec.unwrap().wait_mode, m);
        assert_eq!(m.as_str(), v);
    }
    assert!(
        JobSpec::from_options("x", &[base[0].clone(), o("libblkio_wait_mode", "spin")]).is_err()
    );
    // Job files: a global section's value reaches the job, a job's own wins.
    let text = "[global]\nlibblkio_wait_mode=loop\ntarget=unix:/s.sock\n[a]\n[b]\nlibblkio_wait_mode=block\n";
    let jobs = jobs_from_sections(&parse_job_file(text).unwrap(), &[]).unwrap();
    assert_eq!(
        (jobs[0].wait_mode, jobs[1].wait_mode),
        (WaitMode::Loop, WaitMode::Block)
    );
}

#[test]
fn syntax_errors() {
    assert!(matches!(
        parse_job_file("bs=4k\n"),
        Err(OptionError::Syntax { line: 1, .. })
    ));
    assert!(matches!(
        parse_job_file("[a\n"),
        Err(OptionError::Syntax { line: 1, .. })
    ));
}

#[test]
fn verify_needs_write() {
    let e = JobSpec::from_options(
        "v",
        &[
            o("target", "file:/x"),
            o("rw", "randread"),
            o("verify", "crc32c"),
        ],
    )
    .unwrap_err();
    assert!(e.to_string().contains("rw=write"));
}

#[test]
fn rbd_targets_parse_and_print_back() {
    let t = Target::parse("target", "rbd:pool/ns/img").unwrap();
    assert_eq!(t, Target::Rbd("pool/ns/img".into()));
    assert_eq!(t.to_string(), "rbd:pool/ns/img");
    assert!(!t.is_vhost_user());
    let e = Target::parse("target", "ceph:pool/img")
        .unwrap_err()
        .to_string();
    assert!(e.contains("rbd:POOL/IMAGE"), "{e}");
}
