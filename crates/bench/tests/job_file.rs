//! A job file and the equivalent flags must describe the same workload.

use vqblk_bench::{parse_args, plan_from_args};

fn jobs(args: &[&str]) -> Vec<vqblk_bench::options::JobSpec> {
    plan_from_args(&parse_args(args).unwrap()).unwrap().jobs
}

#[test]
fn job_file_and_flags_are_identical() {
    let dir = tempfile::tempdir().unwrap();
    let jf = dir.path().join("w.fio");
    std::fs::write(
        &jf,
        "; same as the flags below\n[global]\ntarget=unix:/run/x.sock\nbs=16k\n\
         iodepth=32\ntime_based\nruntime=10s\nramp_time=2\n\n[oltp]\nreadwrite=randrw\n\
         rwmixread=70\nnumjobs=2\nsize=256m\noffset=1m\nlibblkio_wait_mode=loop\n\
         group_reporting\n",
    )
    .unwrap();
    let from_file = jobs(&[jf.to_str().unwrap()]);
    let from_flags = jobs(&[
        "--name=oltp",
        "--target=unix:/run/x.sock",
        "--rw=randrw",
        "--rwmixread=70",
        "--bs=16k",
        "--iodepth=32",
        "--numjobs=2",
        "--time_based",
        "--runtime=10",
        "--ramp_time=2s",
        "--size=256m",
        "--offset=1m",
        "--libblkio_wait_mode=loop",
        "--group_reporting",
    ]);
    assert_eq!(from_file, from_flags);
    assert_eq!(from_file[0].bs, 16384);
    assert_eq!(
        from_file[0].runtime,
        Some(std::time::Duration::from_secs(10))
    );
}

#[test]
fn flags_apply_as_global_to_a_job_file() {
    let dir = tempfile::tempdir().unwrap();
    let jf = dir.path().join("w.fio");
    std::fs::write(
        &jf,
        "[global]\nbs=8k\n[a]\nrw=read\n[b]\nrw=write\nbs=64k\n",
    )
    .unwrap();
    let j = jobs(&[
        jf.to_str().unwrap(),
        "--target",
        "file:/tmp/x",
        "--bs",
        "4k",
    ]);
    assert_eq!(j.len(), 2);
    assert_eq!(j[0].bs, 4096, "flags override [global]");
    assert_eq!(j[1].bs, 65536, "a section overrides flags");
    assert!(j.iter().all(|j| j.target.to_string() == "file:/tmp/x"));
}

#[test]
fn profiles_expand_and_yield_to_flags() {
    let j = jobs(&["--profile", "oltp", "--target", "file:/tmp/x", "--bs", "4k"]);
    assert_eq!(j[0].rw, vqblk_bench::options::RwMode::RandRw);
    assert_eq!(j[0].rwmixread, 70);
    assert_eq!(j[0].bs, 4096);
    assert!(j[0].time_based);
}

#[test]
fn fio_command_line_spelling_is_accepted() {
    let a = jobs(&[
        "--name=j",
        "--ioengine=libblkio",
        "--libblkio_driver=virtio-blk-vhost-user",
        "--libblkio_path=/run/x.sock",
        "--thread",
        "--rw=randread",
    ]);
    let b = jobs(&["--name=j", "--target=unix:/run/x.sock", "--rw=randread"]);
    assert_eq!(a, b);
    let e = plan_from_args(
        &parse_args(["--libblkio_driver=virtio-blk-vfio-pci", "--target=unix:/x"]).unwrap(),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("'libblkio_driver'"));
}
