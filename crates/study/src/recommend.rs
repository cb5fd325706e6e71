//! `vqblk recommend`: one IOThread count for the workloads that matter, with the
//! reasoning per cell, and configuration snippets to paste (vqblk, libvirt, QEMU,
//! KubeVirt).

use std::fmt::Write as _;

use anyhow::bail;
use clap::Args;

use crate::matrix::{Cell, Op, Setup};
use crate::merit::{decide, CellMerit, Decision};
use crate::study::{fmt_mb, Study, StudyArgs};
use vqblk_daemon::qos::{BucketKind, ThrottleConfig};
use vqblk_daemon::size::size_label;

/// Options of `vqblk recommend`.
#[derive(Debug, Clone, Args)]
pub struct RecommendArgs {
    /// The results file and how to judge it.
    #[command(flatten)]
    pub study: StudyArgs,
    /// The workloads that matter: operations (read, write, randread, randwrite),
    /// `oltp` (random reads and writes of 32k or less), `streaming` (sequential,
    /// 1m or more) or `all`; comma-separated.
    #[arg(long, default_value = "all")]
    pub workload: String,
    /// Virtqueues in the snippets (default: the sweep's).
    #[arg(long)]
    pub queues: Option<u32>,
    /// I/O limits of the disk, as `vqblk serve --throttle` takes them (QEMU's
    /// keys: `iops-total=2000,bps-total=200000000`): the snippets then carry
    /// them (`--throttle`, `[export.throttle]`, and `<iotune>` /
    /// `throttle-group` for QEMU's own virtio-blk).
    #[arg(long, value_name = "KEY=VALUE,...", value_parser = parse_limits)]
    pub throttle: Option<ThrottleConfig>,
}

/// `--throttle`: the grammar of `vqblk serve --throttle`, and QEMU's rules
/// between the keys (the error names the key), so that a snippet is never
/// printed that `vqblk serve` would refuse.
fn parse_limits(spec: &str) -> Result<ThrottleConfig, String> {
    let t = vqblk_daemon::cli::parse_throttle(spec)?;
    t.validate().map_err(|e| e.to_string())?;
    Ok(t)
}

/// The limits that are set (0 is "no limit" and is left out), in QEMU's order:
/// each kind's rate, burst and burst length, then `iops-size`.
pub fn limit_pairs(t: &ThrottleConfig) -> Vec<(String, u64)> {
    let map = match serde_json::to_value(t) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => return Vec::new(),
    };
    let keys = BucketKind::ALL.iter().flat_map(|k| {
        let k = k.key();
        [k.to_string(), format!("{k}-max"), format!("{k}-max-length")]
    });
    keys.chain(std::iter::once("iops-size".to_string()))
        .filter_map(|k| {
            let v = map.get(&k)?.as_u64()?;
            (v > 0).then_some((k, v))
        })
        .collect()
}

/// libvirt's `<iotune>` element for a vqblk (and QEMU) limit key:
/// `iops-total-max` is `total_iops_sec_max`, `iops-size` is `size_iops_sec`.
pub fn libvirt_iotune_element(key: &str) -> String {
    if key == "iops-size" {
        return "size_iops_sec".into();
    }
    let (unit, rest) = match key.split_once('-') {
        Some(("iops", rest)) => ("iops", rest),
        Some(("bps", rest)) => ("bytes", rest),
        _ => return key.replace('-', "_"),
    };
    let (dir, suffix) = rest.split_once('-').unwrap_or((rest, ""));
    let suffix = suffix.replace('-', "_");
    if suffix.is_empty() {
        format!("{dir}_{unit}_sec")
    } else {
        format!("{dir}_{unit}_sec_{suffix}")
    }
}

/// A selection of cells by workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// As given.
    pub name: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Part {
    All,
    Op(Op),
    Oltp,
    Streaming,
}

impl Workload {
    /// Parses `randread,randwrite`, `oltp`, `streaming`, `all`.
    pub fn parse(s: &str) -> anyhow::Result<Workload> {
        let mut parts = Vec::new();
        for w in s.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            parts.push(match w {
                "all" => Part::All,
                "oltp" => Part::Oltp,
                "streaming" => Part::Streaming,
                op => match op.parse::<Op>() {
                    Ok(o) => Part::Op(o),
                    Err(_) => bail!(
                        "--workload: {w:?} is not read, write, randread, randwrite, oltp, streaming or all"
                    ),
                },
            });
        }
        if parts.is_empty() {
            bail!("--workload: empty");
        }
        Ok(Workload {
            name: s.to_string(),
            parts,
        })
    }

    /// Whether a cell belongs to the workload.
    pub fn matches(&self, c: &Cell) -> bool {
        self.parts.iter().any(|p| match p {
            Part::All => true,
            Part::Op(o) => c.op == *o,
            Part::Oltp => matches!(c.op, Op::Randread | Op::Randwrite) && c.bs <= 32 * 1024,
            Part::Streaming => matches!(c.op, Op::Read | Op::Write) && c.bs >= 1 << 20,
        })
    }

    /// In words.
    pub fn describe(&self) -> String {
        let words: Vec<String> = self
            .parts
            .iter()
            .map(|p| match p {
                Part::All => "every cell".into(),
                Part::Op(o) => o.to_string(),
                Part::Oltp => "oltp (randread and randwrite, 32k or less)".into(),
                Part::Streaming => "streaming (read and write, 1m or more)".into(),
            })
            .collect();
        words.join(" + ")
    }
}

/// The reasoning: a table of the selected cells and of the candidate counts.
pub fn reasoning(
    study: &Study,
    cells: &[(Cell, &CellMerit)],
    d: &Decision,
    threshold: f64,
) -> String {
    let mut o = String::new();
    let setups = study.setups();
    let name = |s: &Setup| match s {
        Setup::Native => "native".to_string(),
        Setup::Baseline => "0".to_string(),
        Setup::IoThreads(k) => k.to_string(),
        Setup::Auto => "auto".to_string(),
    };
    let _ = writeln!(
        o,
        "Per cell: MB/s per column (0 = baseline); * = reaches {:.0}% of the cell's best; fewest = fewest IOThreads that do.",
        threshold * 100.0
    );
    let _ = write!(o, "{:<34}", "cell");
    for s in &setups {
        let _ = write!(o, "{:>9}", name(s));
    }
    let _ = writeln!(o, "{:>9}{:>8}", "best", "fewest");
    for (c, m) in cells {
        let _ = write!(o, "{:<34}", c.to_string());
        for s in &setups {
            let v = match (m.mean(*s), m.best) {
                (Some(v), Some(b)) if *s != Setup::Native && v >= threshold * b * (1.0 - 1e-9) => {
                    format!("{}*", fmt_mb(v))
                }
                (Some(v), _) => fmt_mb(v),
                (None, _) => "n/a".into(),
            };
            let _ = write!(o, "{v:>9}");
        }
        let best = m.best.map(fmt_mb).unwrap_or_else(|| "n/a".into());
        let fewest = m
            .min_iothreads
            .map(|k| k.to_string())
            .unwrap_or_else(|| "n/a".into());
        let noisy = if m.is_noisy() { "  (noisy)" } else { "" };
        let _ = writeln!(o, "{best:>9}{fewest:>8}{noisy}");
    }
    let auto: Vec<f64> = cells.iter().filter_map(|(_, m)| m.auto_vs_best()).collect();
    if let (Some(lo), Some(hi)) = (
        auto.iter().copied().reduce(f64::min),
        auto.iter().copied().reduce(f64::max),
    ) {
        let reaches = |r: f64| r >= threshold * (1.0 - 1e-9);
        let reach = auto.iter().filter(|&&r| reaches(r)).count();
        // Cells short of it where the repeats of auto and of the best count
        // overlap: the order of the two may be the host's doing.
        let noise = cells
            .iter()
            .filter(|(_, m)| {
                m.auto_vs_best().is_some_and(|r| !reaches(r)) && m.auto_within_noise() == Some(true)
            })
            .count();
        let _ = writeln!(
            o,
            "\nauto (`--iothreads auto`, tuned online): {lo:.2} to {hi:.2} of each cell's best fixed count; \
             it reaches {:.0}% of the best in {reach} of {} cells{}.",
            threshold * 100.0,
            auto.len(),
            if noise > 0 {
                format!(
                    ", and in {noise} more its repeats overlap the best count's (within the noise)"
                )
            } else {
                String::new()
            }
        );
    }
    let _ = writeln!(
        o,
        "\nPer IOThread count: the worst selected cell, as a fraction of its own best."
    );
    for c in &d.candidates {
        let label = if c.count == 0 {
            "0 (baseline)".to_string()
        } else {
            c.count.to_string()
        };
        let partial = if c.covered < d.cells {
            format!(
                "  [measured for {} of {} cells: not eligible]",
                c.covered, d.cells
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "  {label:<13} worst {:>4.0}% ({})  mean {:>4.0}%{partial}",
            c.worst * 100.0,
            c.worst_cell,
            c.mean * 100.0
        );
    }
    o
}

/// The snippets for `k` IOThreads (0 = the baseline suffices) and `queues` queues,
/// for a raw image file or, with `rbd` (`POOL/IMAGE`), an RBD image; with
/// `limits` (`--throttle`), the disk's I/O limits in each.
pub fn snippets(
    k: u32,
    queues: u32,
    nproc: u32,
    rbd: Option<&str>,
    limits: Option<&ThrottleConfig>,
) -> String {
    let kk = k.max(1);
    let queues = queues.max(kk);
    let limits = limits.map(limit_pairs).unwrap_or_default();
    let mut o = String::new();
    vqblk_snippets(&mut o, k, kk, queues, rbd, &limits);
    vhost_user_snippets(&mut o, queues, &limits);
    libvirt_virtio_blk_snippet(&mut o, k, kk, queues, nproc, rbd, &limits);
    qemu_virtio_blk_snippet(&mut o, kk, queues, rbd, &limits);
    kubevirt_snippet(&mut o, kk, &limits);
    o
}

/// `vqblk serve` with `kk` IOThreads, as flags and as a configuration file; polling
/// off when the baseline (`k` = 0) sufficed; the export's `limits`, if any.
fn vqblk_snippets(
    o: &mut String,
    k: u32,
    kk: u32,
    queues: u32,
    rbd: Option<&str>,
    limits: &[(String, u64)],
) {
    let (image, backend) = match rbd {
        Some(spec) => (format!("rbd:{spec}"), "backend = \"rbd\"\n"),
        None => ("/var/lib/vqblk/disk.raw".to_string(), ""),
    };
    let note = if k == 0 {
        "# The baseline (one IOThread, no polling) was as good as more IOThreads.\n"
    } else {
        ""
    };
    let poll = if k == 0 { " --poll off" } else { "" };
    let throttle = if limits.is_empty() {
        String::new()
    } else {
        let pairs: Vec<String> = limits.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!(" --throttle {}", pairs.join(","))
    };
    let _ = writeln!(o, "--- vqblk serve (flags)\n{note}vqblk serve --image {image} --socket /run/vqblk/disk.sock --queues {queues} --iothreads {kk}{poll}{throttle}\n");
    let _ = writeln!(
        o,
        "--- vqblk serve --config vqblk.toml\n{note}[iothreads]\ncount = {kk}"
    );
    if k == 0 {
        let _ = writeln!(o, "poll = \"off\"");
    }
    let _ = writeln!(
        o,
        "\n[[export]]\nname = \"disk\"\n{backend}image = \"{image}\"\nsocket = \"/run/vqblk/disk.sock\"\nqueues = {queues}\n"
    );
    if !limits.is_empty() {
        let _ = writeln!(o, "[export.throttle]");
        for (k, v) in limits {
            let _ = writeln!(o, "{k} = {v}");
        }
        let _ = writeln!(o);
    }
}

/// Attaching the vqblk socket to a guest, with QEMU and with libvirt; with
/// `limits`, where they live.
fn vhost_user_snippets(o: &mut String, queues: u32, limits: &[(String, u64)]) {
    let (qemu_note, libvirt_note) = if limits.is_empty() {
        (String::new(), String::new())
    } else {
        (
            "# QEMU's throttling.* does not apply to a vhost-user-blk device (vqblk does its I/O):\n\
             # the limits are vqblk's, in --throttle or [export.throttle] above.\n"
                .to_string(),
            // An XML comment may not hold "--": no flag names here.
            "<!-- libvirt refuses <iotune> on a vhostuser disk (vqblk, not QEMU, does its I/O):\n     \
             the limits are vqblk's, in its [export.throttle] table above. -->\n"
                .to_string(),
        )
    };
    let _ = writeln!(
        o,
        "--- attach the vqblk socket (QEMU)\n{qemu_note}-object memory-backend-memfd,id=mem,size=4G,share=on -M q35,memory-backend=mem \\\n  \
         -chardev socket,id=c0,path=/run/vqblk/disk.sock,reconnect-ms=1000 \\\n  -device vhost-user-blk-pci,chardev=c0,num-queues={queues}\n"
    );
    let _ = writeln!(
        o,
        "--- attach the vqblk socket (libvirt)\n{libvirt_note}<memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>\n\
         <disk type='vhostuser' device='disk'>\n  <driver name='qemu' type='raw' queues='{queues}'/>\n  \
         <source type='unix' path='/run/vqblk/disk.sock'><reconnect enabled='yes' timeout='10'/></source>\n  \
         <target dev='vdb' bus='virtio'/>\n</disk>\n"
    );
}

/// QEMU's own virtio-blk with `kk` IOThreads in libvirt domain XML, pinned
/// round-robin over `nproc` host CPUs; `limits` as `<iotune>`, which QEMU
/// enforces for a disk it serves itself.
fn libvirt_virtio_blk_snippet(
    o: &mut String,
    k: u32,
    kk: u32,
    queues: u32,
    nproc: u32,
    rbd: Option<&str>,
    limits: &[(String, u64)],
) {
    let _ = writeln!(
        o,
        "--- or QEMU's own virtio-blk with the same count: libvirt domain XML"
    );
    if k == 0 {
        let _ = writeln!(
            o,
            "<!-- The baseline sufficed: one IOThread is plenty (or none at all). -->"
        );
    }
    let _ = writeln!(o, "<iothreads>{kk}</iothreads>\n<iothreadids>");
    for i in 1..=kk {
        let _ = writeln!(o, "  <iothread id='{i}'/>");
    }
    let _ = writeln!(
        o,
        "</iothreadids>\n<cputune>\n  <!-- pin IOThreads to host CPUs that do not run vCPUs -->"
    );
    for i in 1..=kk {
        let _ = writeln!(
            o,
            "  <iothreadpin iothread='{i}' cpuset='{}'/>",
            (i - 1) % nproc.max(1)
        );
    }
    let (disk_type, io) = match rbd {
        Some(_) => ("network", ""),
        None => ("file", " io='native'"),
    };
    let _ = writeln!(
        o,
        "</cputune>\n<disk type='{disk_type}' device='disk'>\n  <driver name='qemu' type='raw' cache='none'{io} queues='{queues}'>\n    <iothreads>"
    );
    for i in 1..=kk {
        let _ = writeln!(o, "      <iothread id='{i}'/>");
    }
    let source = match rbd {
        // cephx: add <auth username='NAME'><secret type='ceph' uuid='...'/></auth>.
        Some(spec) => format!(
            "<source protocol='rbd' name='{spec}'>\n    <host name='MONITOR-HOST' port='3300'/>\n  </source>"
        ),
        None => "<source file='/var/lib/libvirt/images/disk.raw'/>".to_string(),
    };
    let _ = writeln!(
        o,
        "    </iothreads>\n  </driver>\n  {source}\n  <target dev='vda' bus='virtio'/>"
    );
    if !limits.is_empty() {
        let _ = writeln!(o, "  <iotune>");
        for (k, v) in limits {
            let e = libvirt_iotune_element(k);
            let _ = writeln!(o, "    <{e}>{v}</{e}>");
        }
        let _ = writeln!(o, "  </iotune>");
    }
    let _ = writeln!(o, "</disk>\n");
}

/// QEMU's own virtio-blk with `kk` IOThreads on the command line; `limits` as a
/// `throttle-group` object and a `throttle` node over the disk.
fn qemu_virtio_blk_snippet(
    o: &mut String,
    kk: u32,
    queues: u32,
    rbd: Option<&str>,
    limits: &[(String, u64)],
) {
    let blockdev = match rbd.map(|s| s.split_once('/').unwrap_or((s, ""))) {
        Some((pool, image)) => format!(
            "{{\"driver\":\"rbd\",\"pool\":\"{pool}\",\"image\":\"{image}\",\"node-name\":\"d0\",\"cache\":{{\"direct\":true}}}}"
        ),
        None => "{\"driver\":\"file\",\"filename\":\"/var/lib/images/disk.raw\",\"node-name\":\"d0\",\"cache\":{\"direct\":true},\"aio\":\"native\"}".to_string(),
    };
    let objects: Vec<String> = (0..kk)
        .map(|i| format!("-object iothread,id=iot{i}"))
        .collect();
    let mapping: Vec<String> = (0..kk)
        .map(|i| format!("{{\"iothread\":\"iot{i}\"}}"))
        .collect();
    let (throttle, drive) = if limits.is_empty() {
        (String::new(), "d0")
    } else {
        let keys: Vec<String> = limits.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        (
            format!(
                "-object '{{\"qom-type\":\"throttle-group\",\"id\":\"tg0\",\"limits\":{{{}}}}}' \\\n  \
                 -blockdev '{{\"driver\":\"throttle\",\"node-name\":\"t0\",\"throttle-group\":\"tg0\",\"file\":\"d0\"}}' \\\n  ",
                keys.join(",")
            ),
            "t0",
        )
    };
    let _ = writeln!(
        o,
        "--- QEMU command line (virtio-blk, iothread-vq-mapping: queues round-robin over the IOThreads)\n{} \\\n  \
         -blockdev '{blockdev}' \\\n  {throttle}\
         -device '{{\"driver\":\"virtio-blk-pci\",\"drive\":\"{drive}\",\"num-queues\":{queues},\"iothread-vq-mapping\":[{}]}}'\n",
        objects.join(" "),
        mapping.join(",")
    );
}

/// A KubeVirt VirtualMachine with `kk` supplemental IOThreads.
fn kubevirt_snippet(o: &mut String, kk: u32, limits: &[(String, u64)]) {
    let note = if limits.is_empty() {
        ""
    } else {
        "# KubeVirt's API has no per-disk I/O limit: the limits above do not carry over.\n"
    };
    let _ = writeln!(
        o,
        "--- KubeVirt VirtualMachine (spec.template.spec)\n{note}domain:\n  ioThreadsPolicy: supplementalPool\n  ioThreads:\n    supplementalPoolThreadCount: {kk}\n  \
         devices:\n    blockMultiQueue: true\n    disks:\n    - name: data\n      disk:\n        bus: virtio"
    );
}

/// `vqblk recommend`.
pub fn run(args: RecommendArgs) -> anyhow::Result<i32> {
    let study = args.study.load()?;
    let w = Workload::parse(&args.workload)?;
    let cells = selected_cells(&study, &w);
    if cells.is_empty() {
        bail!("--workload {}: no measured cell matches", w.name);
    }
    let threshold = args.study.threshold;
    let d = decide(&cells, threshold);
    let h = study.results.header();
    let mut o = String::new();
    let _ = writeln!(o, "vqblk recommend: {}", args.study.results.display());
    if let Some(h) = h {
        let _ = writeln!(o, "storage: {}", h.storage.describe());
        let _ = writeln!(
            o,
            "host: {} CPUs, {}, kernel {}",
            h.host.nproc, h.host.cpu_model, h.host.kernel
        );
    }
    selection_summary(&mut o, &study, &w, &cells, threshold);
    o.push_str(&reasoning(&study, &cells, &d, threshold));
    let Some(k) = d.count else {
        bail!("no IOThread count was measured for every selected cell");
    };
    decision_lines(&mut o, &d, k, threshold);
    noise_caution(&mut o, &cells, args.study.noise);
    let queues = args.queues.or(h.map(|h| h.queues)).unwrap_or(k.max(1));
    let nproc = h.map(|h| h.host.nproc).unwrap_or(1);
    let rbd = h
        .filter(|h| h.storage.kind == "rbd")
        .and_then(|h| h.storage.path.as_ref())
        .map(|p| p.to_string_lossy().trim_start_matches("rbd:").to_string());
    let _ = writeln!(
        o,
        "\n{}",
        snippets(k, queues, nproc, rbd.as_deref(), args.throttle.as_ref())
    );
    print!("{o}");
    Ok(0)
}

/// The measured cells of the workload, in the study's order.
fn selected_cells<'a>(study: &'a Study, w: &Workload) -> Vec<(Cell, &'a CellMerit)> {
    study
        .merits
        .iter()
        .filter(|(c, m)| w.matches(c) && m.best.is_some())
        .map(|(c, m)| (*c, m))
        .collect()
}

/// What was selected (workload, cell count, block sizes) and the threshold.
fn selection_summary(
    o: &mut String,
    study: &Study,
    w: &Workload,
    cells: &[(Cell, &CellMerit)],
    threshold: f64,
) {
    let sizes: Vec<String> = {
        let mut s: Vec<u64> = cells.iter().map(|(c, _)| c.bs).collect();
        s.dedup();
        s.into_iter().map(size_label).collect()
    };
    let _ = writeln!(
        o,
        "workload: {} -> {} of {} cells (sizes {})\nthreshold: {:.0}% of each cell's best\n",
        w.describe(),
        cells.len(),
        study.merits.len(),
        sizes.join(", "),
        threshold * 100.0
    );
}

/// The decision for `k` IOThreads, and why: the fewest that meet the threshold, or
/// the one that comes closest when none does.
fn decision_lines(o: &mut String, d: &Decision, k: u32, threshold: f64) {
    let _ = writeln!(o);
    if d.meets_threshold {
        let what = if k == 0 {
            "the baseline (0 IOThreads)".to_string()
        } else {
            format!("{k} IOThread(s)")
        };
        let _ = writeln!(
            o,
            "Decision: {what}: the fewest with which every selected cell reaches {:.0}% of its best.",
            threshold * 100.0
        );
    } else {
        let c = d
            .candidates
            .iter()
            .find(|c| c.count == k)
            .expect("chosen from candidates");
        let _ = writeln!(
            o,
            "Decision: {k} IOThread(s): no measured count gets every selected cell to {:.0}% of its best \
             (throughput is not monotonic in the IOThread count here); {k} gets the worst cell closest ({:.0}%, {}).",
            threshold * 100.0,
            c.worst * 100.0,
            c.worst_cell
        );
    }
}

/// A caution when some selected cells are noisy (repeats differ by more than `noise`).
fn noise_caution(o: &mut String, cells: &[(Cell, &CellMerit)], noise: f64) {
    let noisy = cells.iter().filter(|(_, m)| m.is_noisy()).count();
    if noisy > 0 {
        let _ = writeln!(
            o,
            "Caution: {noisy} of the {} cells are noisy (repeats differ by more than {:.0}%); re-run with longer --runtime or more --repeats before relying on small differences.",
            cells.len(),
            noise * 100.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads() {
        let c = |op, bs| Cell {
            bs,
            op,
            jobs: 1,
            iodepth: 1,
        };
        let oltp = Workload::parse("oltp").unwrap();
        assert!(oltp.matches(&c(Op::Randwrite, 4096)));
        assert!(!oltp.matches(&c(Op::Randwrite, 1 << 20)));
        assert!(!oltp.matches(&c(Op::Read, 4096)));
        let s = Workload::parse("streaming,randread").unwrap();
        assert!(s.matches(&c(Op::Write, 1 << 20)) && s.matches(&c(Op::Randread, 4096)));
        assert!(!s.matches(&c(Op::Write, 4096)));
        assert!(Workload::parse("all").unwrap().matches(&c(Op::Read, 512)));
        assert!(format!("{:#}", Workload::parse("trim").unwrap_err()).contains("trim"));
        assert!(Workload::parse(" , ").is_err());
    }

    #[test]
    fn snippets_for_four_iothreads() {
        let s = snippets(4, 8, 2, None, None);
        assert!(s.contains("--queues 8 --iothreads 4\n"));
        assert!(s.contains("[iothreads]\ncount = 4\n"));
        assert!(s.contains("<iothreads>4</iothreads>"));
        assert_eq!(s.matches("<iothreadpin ").count(), 4);
        assert!(s.contains("<iothreadpin iothread='3' cpuset='0'/>"));
        assert!(s.contains("<driver name='qemu' type='raw' cache='none' io='native' queues='8'>"));
        assert!(s.contains("-object iothread,id=iot0 -object iothread,id=iot1 -object iothread,id=iot2 -object iothread,id=iot3"));
        assert!(s.contains("\"num-queues\":8,\"iothread-vq-mapping\":[{\"iothread\":\"iot0\"},{\"iothread\":\"iot1\"},{\"iothread\":\"iot2\"},{\"iothread\":\"iot3\"}]"));
        assert!(
            s.contains("ioThreadsPolicy: supplementalPool")
                && s.contains("supplementalPoolThreadCount: 4")
        );
        assert!(s.contains("blockMultiQueue: true"));
        assert!(s.contains("vhost-user-blk-pci,chardev=c0,num-queues=8"));
    }

    #[test]
    fn snippets_for_an_rbd_image() {
        let s = snippets(2, 4, 2, Some("rbd/vm1"), None);
        assert!(
            s.contains("vqblk serve --image rbd:rbd/vm1 --socket"),
            "{s}"
        );
        assert!(
            s.contains("backend = \"rbd\"\nimage = \"rbd:rbd/vm1\""),
            "{s}"
        );
        assert!(s.contains("<disk type='network' device='disk'>"), "{s}");
        assert!(
            s.contains("<driver name='qemu' type='raw' cache='none' queues='4'>"),
            "{s}"
        );
        assert!(s.contains("<source protocol='rbd' name='rbd/vm1'>"), "{s}");
        assert!(
            s.contains("\"driver\":\"rbd\",\"pool\":\"rbd\",\"image\":\"vm1\""),
            "{s}"
        );
        assert!(!s.contains("disk.raw"), "{s}");
    }

    #[test]
    fn snippets_for_the_baseline() {
        let s = snippets(0, 4, 2, None, None);
        assert!(s.contains("--iothreads 1 --poll off"));
        assert!(s.contains("poll = \"off\""));
        assert!(s.contains("<iothreads>1</iothreads>"));
        // More IOThreads than queues would leave threads idle: queues grow to match.
        assert!(snippets(4, 2, 2, None, None).contains("--queues 4 --iothreads 4"));
    }
    /// The limits of docs/qos.md's example, written out of QEMU's order.
    const LIMITS: &str = "iops-size=16384,bps-total=200000000,iops-total-max-length=30,\
                          throttling.iops-total=2000,iops-total-max=10000";

    /// The lines of snippet `title` (from its `--- ` header to the next).
    fn section<'a>(s: &'a str, title: &str) -> &'a str {
        let start = s.find(&format!("--- {title}\n")).expect(title) + title.len() + 5;
        let end = s[start..].find("--- ").map_or(s.len(), |e| start + e);
        &s[start..end]
    }

    #[test]
    fn limits_in_qemu_order_without_zeroes() {
        let t = parse_limits(LIMITS).unwrap();
        let pairs = limit_pairs(&t);
        let pairs: Vec<(&str, u64)> = pairs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        assert_eq!(
            pairs,
            [
                ("bps-total", 200_000_000),
                ("iops-total", 2000),
                ("iops-total-max", 10000),
                ("iops-total-max-length", 30),
                ("iops-size", 16384),
            ]
        );
        // 0 is "no limit", as in QEMU: nothing to print.
        let t = parse_limits("iops-read=0,bps-write=1000").unwrap();
        assert_eq!(limit_pairs(&t), [("bps-write".to_string(), 1000)]);
    }

    #[test]
    fn limits_refused_as_vqblk_serve_refuses_them() {
        // QEMU's rules between keys, naming the key.
        let e = parse_limits("iops-total=100,iops-read=50").unwrap_err();
        assert!(e.contains("iops-read"), "{e}");
        let e = parse_limits("iops-total-max=100").unwrap_err();
        assert!(e.contains("iops-total-max"), "{e}");
        // The grammar of --throttle.
        assert!(parse_limits("iops-totl=100")
            .unwrap_err()
            .contains("iops-totl"));
        assert!(parse_limits("iops-total=fast")
            .unwrap_err()
            .contains("iops-total"));
        assert!(parse_limits("iops-total").is_err());
    }

    #[test]
    fn every_limit_key_has_its_libvirt_element() {
        let cases = [
            ("iops-total", "total_iops_sec"),
            ("iops-read", "read_iops_sec"),
            ("iops-write", "write_iops_sec"),
            ("bps-total", "total_bytes_sec"),
            ("bps-read", "read_bytes_sec"),
            ("bps-write", "write_bytes_sec"),
            ("iops-total-max", "total_iops_sec_max"),
            ("iops-read-max", "read_iops_sec_max"),
            ("iops-write-max", "write_iops_sec_max"),
            ("bps-total-max", "total_bytes_sec_max"),
            ("bps-read-max", "read_bytes_sec_max"),
            ("bps-write-max", "write_bytes_sec_max"),
            ("iops-total-max-length", "total_iops_sec_max_length"),
            ("iops-read-max-length", "read_iops_sec_max_length"),
            ("iops-write-max-length", "write_iops_sec_max_length"),
            ("bps-total-max-length", "total_bytes_sec_max_length"),
            ("bps-read-max-length", "read_bytes_sec_max_length"),
            ("bps-write-max-length", "write_bytes_sec_max_length"),
            ("iops-size", "size_iops_sec"),
        ];
        for (key, element) in cases {
            assert_eq!(libvirt_iotune_element(key), element, "{key}");
        }
        // Every limit key (each kind's rate, burst, burst length; iops-size) is in
        // the table above.
        let mut every = 0;
        for kind in BucketKind::ALL {
            for suffix in ["", "-max", "-max-length"] {
                let key = format!("{}{suffix}", kind.key());
                assert!(cases.iter().any(|(k, _)| *k == key), "{key}");
                every += 1;
            }
        }
        assert_eq!(every + 1, cases.len());
    }

    #[test]
    fn snippets_with_limits_are_what_vqblk_serve_accepts() {
        use clap::Parser;
        #[derive(Parser)]
        struct Serve {
            #[command(flatten)]
            a: vqblk_daemon::cli::ServeArgs,
        }
        let t = parse_limits(LIMITS).unwrap();
        let s = snippets(2, 4, 2, None, Some(&t));

        // The flags, through vqblk serve's own parser and validation.
        let flags = section(&s, "vqblk serve (flags)");
        let line = flags
            .lines()
            .find(|l| l.starts_with("vqblk serve "))
            .unwrap();
        assert!(
            line.ends_with(
                " --throttle bps-total=200000000,iops-total=2000,iops-total-max=10000,\
                 iops-total-max-length=30,iops-size=16384"
            ),
            "{line}"
        );
        let argv = line.split_whitespace().skip(1);
        let (cfg, _) = Serve::try_parse_from(argv).unwrap().a.to_config().unwrap();
        let plans = cfg.validate().unwrap();
        assert_eq!(
            plans[0].throttle.as_ref().map(|l| l.to_config()),
            Some(t.clone())
        );

        // The configuration file, through the daemon's TOML parser and validation.
        let toml = section(&s, "vqblk serve --config vqblk.toml");
        assert!(
            toml.contains("[export.throttle]\nbps-total = 200000000\n"),
            "{toml}"
        );
        let cfg = vqblk_daemon::config::ServeConfig::from_toml(toml).unwrap();
        assert_eq!(cfg.exports[0].throttle, Some(t.clone()));
        let plans = cfg.validate().unwrap();
        assert_eq!(plans[0].throttle.as_ref().map(|l| l.to_config()), Some(t));

        // Attached as vhost-user, QEMU's and libvirt's limits do not apply: said so,
        // in a comment XML allows (no "--" inside).
        let libvirt = section(&s, "attach the vqblk socket (libvirt)");
        assert!(
            libvirt.contains("libvirt refuses <iotune> on a vhostuser disk"),
            "{libvirt}"
        );
        let comment = &libvirt[libvirt.find("<!--").unwrap() + 4..libvirt.find("-->").unwrap()];
        assert!(!comment.contains("--"), "{comment}");
        assert!(!libvirt.contains("<iotune>\n"), "{libvirt}");
        let qemu = section(&s, "attach the vqblk socket (QEMU)");
        assert!(
            qemu.contains("# QEMU's throttling.* does not apply"),
            "{qemu}"
        );

        // QEMU's own virtio-blk enforces them itself: <iotune>, a throttle node.
        let xml = section(
            &s,
            "or QEMU's own virtio-blk with the same count: libvirt domain XML",
        );
        assert!(
            xml.contains(
                "<target dev='vda' bus='virtio'/>\n  <iotune>\n    <total_bytes_sec>200000000</total_bytes_sec>\n    \
                 <total_iops_sec>2000</total_iops_sec>\n    <total_iops_sec_max>10000</total_iops_sec_max>\n    \
                 <total_iops_sec_max_length>30</total_iops_sec_max_length>\n    <size_iops_sec>16384</size_iops_sec>\n  \
                 </iotune>\n</disk>"
            ),
            "{xml}"
        );
        assert!(s.contains(
            "-object '{\"qom-type\":\"throttle-group\",\"id\":\"tg0\",\"limits\":{\"bps-total\":200000000,\
             \"iops-total\":2000,\"iops-total-max\":10000,\"iops-total-max-length\":30,\"iops-size\":16384}}'"
        ), "{s}");
        assert!(s.contains(
            "-blockdev '{\"driver\":\"throttle\",\"node-name\":\"t0\",\"throttle-group\":\"tg0\",\"file\":\"d0\"}'"
        ));
        assert!(
            s.contains("{\"driver\":\"virtio-blk-pci\",\"drive\":\"t0\""),
            "{s}"
        );
        assert!(s.contains("KubeVirt's API has no per-disk I/O limit"));
    }

    #[test]
    fn snippets_without_limits_carry_none() {
        let s = snippets(2, 4, 2, None, None);
        for absent in ["throttle", "iotune", "I/O limit"] {
            assert!(!s.contains(absent), "{absent} in {s}");
        }
        assert!(s.contains("\"drive\":\"d0\""));
        // Limits that are all "no limit" are no limits.
        let zero = parse_limits("iops-total=0").unwrap();
        assert_eq!(snippets(2, 4, 2, None, Some(&zero)), s);
    }
}
