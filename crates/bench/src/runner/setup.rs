//! Before a run: open every distinct target once, give each job clone its region of the
//! device (checked against the device's size and block size), and start one engine per
//! clone (for vhost-user: one virtqueue each).

use crate::engine::blkio::{BlkioDevice, DESCRIPTORS_PER_REQUEST};
use crate::engine::rbd::RbdDevice;
use crate::engine::uring::NativeDevice;
use crate::engine::Engine;
use crate::job::Region;
use crate::options::{JobSpec, Target};
use crate::report::TargetInfo;

use super::{auto_queue_size, Plan, RunError};

/// One job clone after planning.
#[derive(Debug, Clone)]
pub(super) struct JobClone {
    /// Index of its job in the plan.
    pub(super) job: usize,
    /// Which clone of the job (0..numjobs).
    pub(super) index: u32,
    /// Its part of the device.
    pub(super) region: Region,
    /// Index of its device in [`Devices`].
    pub(super) device: usize,
}

/// An opened target.
pub(super) enum Device {
    Blkio(BlkioDevice),
    Native(NativeDevice),
    Rbd(RbdDevice),
}

impl Device {
    fn capacity(&self) -> u64 {
        match self {
            Device::Blkio(d) => d.capacity,
            Device::Native(d) => d.capacity,
            Device::Rbd(d) => d.capacity,
        }
    }

    fn request_alignment(&self) -> u64 {
        match self {
            Device::Blkio(d) => d.request_alignment,
            Device::Native(d) => d.request_alignment,
            Device::Rbd(_) => 512,
        }
    }
}

/// Key of a device: native targets opened with and without O_DIRECT are distinct.
pub(super) type DeviceKey = (Target, bool);

/// Every distinct target of a plan, opened once, in order of first use.
pub(super) struct Devices {
    pub(super) keys: Vec<DeviceKey>,
    pub(super) list: Vec<Device>,
}

/// The key of the device a job runs on.
pub(super) fn device_key(spec: &JobSpec) -> DeviceKey {
    (
        spec.target.clone(),
        spec.target.is_vhost_user() || spec.direct,
    )
}

/// Opens every distinct target of the plan once.
pub(super) fn open_devices(plan: &Plan) -> Result<Devices, RunError> {
    let mut keys: Vec<DeviceKey> = Vec::new();
    for j in &plan.jobs {
        let k = device_key(j);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut list = Vec::with_capacity(keys.len());
    for (target, direct) in &keys {
        list.push(match target {
            Target::Unix(p) => Device::Blkio(BlkioDevice::connect(p, plan.connect_timeout)?),
            Target::Rbd(p) => Device::Rbd(RbdDevice::open(&p.to_string_lossy())?),
            Target::File(p) | Target::Dev(p) => Device::Native(NativeDevice::open(
                p,
                matches!(target, Target::Dev(_)),
                *direct,
                create_len(&plan.jobs, target),
            )?),
        });
    }
    Ok(Devices { keys, list })
}

/// A missing file is laid out up to the end of the furthest region a job gives a size.
fn create_len(jobs: &[JobSpec], target: &Target) -> Option<u64> {
    jobs.iter()
        .filter(|j| &j.target == target)
        .filter_map(|j| {
            let size = j.size?;
            let last = u64::from(j.numjobs - 1) * j.offset_increment;
            Some(j.offset + last + size)
        })
        .max()
}

/// The region of clone `k` of job `j` on a device of `cap` bytes whose requests must be
/// aligned to `align`: from `offset + k * offset_increment`, `size` bytes (or up to the
/// end), rounded down to whole blocks.
pub(super) fn clone_region(j: &JobSpec, k: u32, cap: u64, align: u64) -> Result<Region, RunError> {
    let start = j.offset + u64::from(k) * j.offset_increment;
    let fail = |what: String| Err(RunError::Config(format!("job '{}'{what}", j.name)));
    if !start.is_multiple_of(align) {
        return fail(format!(
            ": offset {start} is not a multiple of {}'s block size {align}",
            j.target
        ));
    }
    if start >= cap {
        return fail(format!(
            " (clone {k}): offset {start} is at or past the end of {} ({cap} bytes)",
            j.target
        ));
    }
    let len = match j.size {
        Some(s) if start + s > cap => {
            return fail(format!(
                " (clone {k}): size {s} at offset {start} ends past the end of {} \
                 ({cap} bytes); reduce size or offset",
                j.target
            ))
        }
        Some(s) => s,
        None => cap - start,
    };
    let len = len / j.bs * j.bs;
    if len == 0 {
        return fail(format!(
            " (clone {k}): the region at offset {start} holds no block of {} bytes",
            j.bs
        ));
    }
    Ok(Region {
        start,
        len,
        bs: j.bs,
    })
}

/// Every job clone with its region, checked against its device.
pub(super) fn plan_clones(plan: &Plan, devices: &Devices) -> Result<Vec<JobClone>, RunError> {
    let mut clones = Vec::new();
    for (ji, j) in plan.jobs.iter().enumerate() {
        let di = devices
            .keys
            .iter()
            .position(|k| *k == device_key(j))
            .unwrap_or(0);
        let dev = &devices.list[di];
        let align = dev.request_alignment();
        if !j.bs.is_multiple_of(align) {
            return Err(RunError::Config(format!(
                "job '{}': bs {} is not a multiple of {}'s block size {align}",
                j.name, j.bs, j.target
            )));
        }
        for k in 0..j.numjobs {
            clones.push(JobClone {
                job: ji,
                index: k,
                region: clone_region(j, k, dev.capacity(), align)?,
                device: di,
            });
        }
    }
    Ok(clones)
}

/// Engines (one per clone) and descriptions of the targets they run on.
type Started = (Vec<Box<dyn Engine>>, Vec<TargetInfo>);

/// One engine per clone, in clone order, and a description of each target.
pub(super) fn start_engines(
    plan: &Plan,
    clones: &[JobClone],
    devices: Devices,
) -> Result<Started, RunError> {
    let mut engines: Vec<Option<Box<dyn Engine>>> = (0..clones.len()).map(|_| None).collect();
    let mut targets = Vec::new();
    for (di, dev) in devices.list.into_iter().enumerate() {
        let mine: Vec<usize> = (0..clones.len())
            .filter(|&c| clones[c].device == di)
            .collect();
        let jobs_here: Vec<&JobSpec> = mine.iter().map(|&c| &plan.jobs[clones[c].job]).collect();
        let target = devices.keys[di].0.to_string();
        let (started, info) = match dev {
            Device::Blkio(d) => start_blkio(d, &jobs_here, target)?,
            Device::Native(d) => start_native(d, &jobs_here, target)?,
            Device::Rbd(d) => start_rbd(d, &jobs_here, target)?,
        };
        for (&c, e) in mine.iter().zip(started) {
            engines[c] = Some(e);
        }
        targets.push(info);
    }
    let engines = engines
        .into_iter()
        .map(|e| e.ok_or_else(|| RunError::Config("internal: a job has no engine".into())))
        .collect::<Result<_, _>>()?;
    Ok((engines, targets))
}

/// The virtqueue size for the clones of `jobs` on one socket offering `max_queues`:
/// the largest explicit `queue_size`, else one that fits the deepest job.
pub(super) fn blkio_queue_size(
    jobs: &[&JobSpec],
    max_queues: u32,
    target: &str,
) -> Result<u32, RunError> {
    let nq = jobs.len() as u32;
    if nq > max_queues {
        return Err(RunError::Config(format!(
            "{target}: {nq} job threads need {nq} queues but the device offers {max_queues} \
             (num-queues of the export); lower numjobs"
        )));
    }
    let explicit = jobs.iter().filter_map(|j| j.queue_size).max();
    let max_depth = jobs.iter().map(|j| j.iodepth).max().unwrap_or(1);
    let qs = explicit.unwrap_or_else(|| auto_queue_size(max_depth));
    let fits = qs / DESCRIPTORS_PER_REQUEST;
    if let Some(j) = jobs.iter().find(|j| j.iodepth > fits) {
        return Err(RunError::Config(format!(
            "job '{}': iodepth {} is larger than what a queue of {qs} entries holds \
             ({fits} requests: libblkio uses {DESCRIPTORS_PER_REQUEST} descriptors \
             per request); raise queue_size to {} or lower iodepth",
            j.name,
            j.iodepth,
            auto_queue_size(j.iodepth)
        )));
    }
    Ok(qs)
}

/// Starts one virtqueue per clone on a vhost-user-blk socket.
fn start_blkio(
    d: BlkioDevice,
    jobs: &[&JobSpec],
    target: String,
) -> Result<(Vec<Box<dyn Engine>>, TargetInfo), RunError> {
    let qs = blkio_queue_size(jobs, d.max_queues, &target)?;
    let wait_mode = jobs[0].wait_mode;
    if jobs.iter().any(|j| j.wait_mode != wait_mode) {
        return Err(RunError::Config(format!(
            "{target}: all jobs on one socket must use the same libblkio_wait_mode"
        )));
    }
    let info = TargetInfo {
        target,
        engine: format!("libblkio {}", crate::engine::blkio::DRIVER),
        capacity: d.capacity,
        request_alignment: d.request_alignment,
        queue_size: Some(qs),
        num_queues: Some(jobs.len() as u32),
        max_queues: Some(d.max_queues),
        wait_mode: Some(wait_mode),
        direct: None,
    };
    let queues: Vec<(u32, u64)> = jobs.iter().map(|j| (j.iodepth, j.bs)).collect();
    let engines = d
        .start(&queues, qs, wait_mode)?
        .into_iter()
        .map(|e| Box::new(e) as Box<dyn Engine>)
        .collect();
    Ok((engines, info))
}

/// Sets up one io_uring per clone on a file or block device.
fn start_native(
    d: NativeDevice,
    jobs: &[&JobSpec],
    target: String,
) -> Result<(Vec<Box<dyn Engine>>, TargetInfo), RunError> {
    let mut engines: Vec<Box<dyn Engine>> = Vec::with_capacity(jobs.len());
    for j in jobs {
        engines.push(Box::new(d.engine(j.iodepth, j.bs)?));
    }
    let info = TargetInfo {
        target,
        engine: "io_uring".into(),
        capacity: d.capacity,
        request_alignment: d.request_alignment,
        queue_size: None,
        num_queues: None,
        max_queues: None,
        wait_mode: None,
        direct: Some(d.direct),
    };
    Ok((engines, info))
}

/// Sets up one librbd engine per clone on an RBD image.
fn start_rbd(
    d: RbdDevice,
    jobs: &[&JobSpec],
    target: String,
) -> Result<(Vec<Box<dyn Engine>>, TargetInfo), RunError> {
    let mut engines: Vec<Box<dyn Engine>> = Vec::with_capacity(jobs.len());
    for j in jobs {
        engines.push(Box::new(d.engine(j.iodepth, j.bs)?));
    }
    let info = TargetInfo {
        target,
        engine: "librbd".into(),
        capacity: d.capacity,
        request_alignment: 512,
        queue_size: None,
        num_queues: None,
        max_queues: None,
        wait_mode: None,
        direct: None,
    };
    Ok((engines, info))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(opts: &[(&str, &str)]) -> JobSpec {
        let mut o: Vec<_> = vec![("target".to_string(), Some("file:/x".to_string()))];
        o.extend(
            opts.iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string()))),
        );
        JobSpec::from_options("j", &o).unwrap()
    }

    #[test]
    fn keys_separate_direct() {
        let mut a = job(&[]);
        let b = a.clone();
        a.direct = false;
        assert_ne!(device_key(&a), device_key(&b));
    }

    #[test]
    fn regions_follow_offset_increment_and_round_to_blocks() {
        let j = job(&[("bs", "4k"), ("offset", "1m"), ("offset_increment", "2m")]);
        let r = clone_region(&j, 1, (8 << 20) + 1000, 512).unwrap();
        assert_eq!((r.start, r.len, r.bs), (3 << 20, 5 << 20, 4096));
        let j = job(&[("size", "1m"), ("numjobs", "3"), ("offset_increment", "1m")]);
        assert_eq!(clone_region(&j, 2, 3 << 20, 512).unwrap().start, 2 << 20);
        let e = clone_region(&j, 3, 3 << 20, 512).unwrap_err().to_string();
        assert!(e.contains("at or past the end"), "{e}");
    }

    #[test]
    fn regions_that_do_not_fit_say_why() {
        let j = job(&[("size", "2m")]);
        let e = clone_region(&j, 0, 1 << 20, 512).unwrap_err().to_string();
        assert!(e.contains("ends past the end"), "{e}");
        let j = job(&[("offset", "512")]);
        let e = clone_region(&j, 0, 1 << 20, 4096).unwrap_err().to_string();
        assert!(e.contains("not a multiple"), "{e}");
        let j = job(&[("bs", "8k")]);
        let e = clone_region(&j, 0, 4096, 512).unwrap_err().to_string();
        assert!(e.contains("holds no block"), "{e}");
    }

    #[test]
    fn create_len_covers_the_furthest_region() {
        let j = job(&[("size", "1m"), ("numjobs", "2"), ("offset_increment", "4m")]);
        assert_eq!(
            create_len(std::slice::from_ref(&j), &j.target),
            Some(5 << 20)
        );
        assert_eq!(create_len(&[job(&[])], &j.target), None);
    }

    #[test]
    fn queue_size_fits_the_deepest_job() {
        let a = job(&[("iodepth", "100")]);
        let b = job(&[("iodepth", "4")]);
        assert_eq!(blkio_queue_size(&[&a, &b], 2, "t").unwrap(), 512);
        let e = blkio_queue_size(&[&a, &b], 1, "t").unwrap_err().to_string();
        assert!(e.contains("lower numjobs"), "{e}");
        let small = job(&[("iodepth", "100"), ("queue_size", "256")]);
        let e = blkio_queue_size(&[&small], 1, "t").unwrap_err().to_string();
        assert!(e.contains("raise queue_size to 512"), "{e}");
    }
}
