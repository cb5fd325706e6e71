//! `vqblk bench`: a fio-compatible load generator.
//!
//! It drives any vhost-user-blk socket through the `blkio` crate (libblkio's
//! `virtio-blk-vhost-user` driver, as fio's libblkio engine does), or a plain file or
//! block device through io_uring as the baseline without virtualization, and reports in
//! fio's formats plus the client's and the server's CPU cost per I/O.
//!
//! Layers: [`options`] turns flags or a job file into [`options::JobSpec`]s; [`job`]
//! generates offsets and directions; [`engine`] moves requests (libblkio or io_uring);
//! [`runner`] runs one thread per job clone and collects a [`report::Report`]; [`stats`]
//! and [`output`] turn it into fio's figures ([`units`] for numbers people read);
//! [`verify`] checks data.

pub mod cpu;
pub mod engine;
pub mod job;
pub mod options;
pub mod output;
pub mod report;
pub mod runner;
pub mod server_stats;
pub mod stats;
pub mod units;
pub mod verify;

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, ValueEnum};

use options::{jobs_from_sections, parse_job_file, JobSpec, OutputFormat, RawOption};
use runner::Plan;

/// A preset workload that expands to fio options (explicit flags override it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// Database-like: 8k random, 70% reads, iodepth 16, 30 s.
    Oltp,
    /// Streaming: 1m sequential reads, iodepth 8, 30 s.
    SeqThroughput,
    /// Small random reads: 4k, iodepth 32, 30 s.
    SmallRandom,
}

impl Profile {
    /// The fio options this profile stands for.
    pub fn options(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Profile::Oltp => &[
                ("rw", "randrw"),
                ("rwmixread", "70"),
                ("bs", "8k"),
                ("iodepth", "16"),
                ("time_based", "1"),
                ("runtime", "30s"),
            ],
            Profile::SeqThroughput => &[
                ("rw", "read"),
                ("bs", "1m"),
                ("iodepth", "8"),
                ("time_based", "1"),
                ("runtime", "30s"),
            ],
            Profile::SmallRandom => &[
                ("rw", "randread"),
                ("bs", "4k"),
                ("iodepth", "32"),
                ("time_based", "1"),
                ("runtime", "30s"),
            ],
        }
    }
}

/// Command-line options of `vqblk bench`, in fio's vocabulary (`--rw=randread --bs=4k`).
/// Job options are kept as written and go through the same parser as a job file.
#[derive(Debug, Clone, Default, Args)]
pub struct BenchArgs {
    /// fio job file: `[global]` plus one section per job. Job options given as flags
    /// apply as if written in `[global]`, after the file's own.
    #[arg(value_name = "JOBFILE")]
    pub jobfile: Option<PathBuf>,
    /// Target: `unix:/path.sock` (vhost-user-blk), `file:/path` or `dev:/dev/name`.
    #[arg(long)]
    pub target: Option<String>,
    /// Job name.
    #[arg(long)]
    pub name: Option<String>,
    /// fio spelling of the target: `libblkio` (with --libblkio_path) or `io_uring`
    /// (with --filename).
    #[arg(long)]
    pub ioengine: Option<String>,
    /// fio spelling: only `virtio-blk-vhost-user` is supported.
    #[arg(long = "libblkio_driver")]
    pub libblkio_driver: Option<String>,
    /// fio spelling of a vhost-user-blk socket path.
    #[arg(long = "libblkio_path")]
    pub libblkio_path: Option<String>,
    /// fio spelling of a file or block device path.
    #[arg(long)]
    pub filename: Option<String>,
    /// Accepted for fio compatibility: jobs always run as threads.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "1")]
    pub thread: Option<String>,
    /// read, write, randread, randwrite, randrw or readwrite.
    #[arg(long, visible_alias = "readwrite")]
    pub rw: Option<String>,
    /// Percentage of reads for randrw/readwrite (default 50).
    #[arg(long)]
    pub rwmixread: Option<String>,
    /// Percentage of writes for randrw/readwrite.
    #[arg(long)]
    pub rwmixwrite: Option<String>,
    /// Block size: a multiple of 512 (4k, 64k, 1m).
    #[arg(long, visible_alias = "blocksize")]
    pub bs: Option<String>,
    /// Job threads (one virtqueue or io_uring each).
    #[arg(long)]
    pub numjobs: Option<String>,
    /// Requests in flight per job thread.
    #[arg(long)]
    pub iodepth: Option<String>,
    /// Requests queued before each submission (default 1: each as soon as it
    /// is queued, as fio; 0 = iodepth).
    #[arg(long = "iodepth_batch_submit", visible_alias = "iodepth_batch")]
    pub iodepth_batch_submit: Option<String>,
    /// Measured run time (10, 10s, 500ms, 2m).
    #[arg(long)]
    pub runtime: Option<String>,
    /// Warm-up time not counted in the results.
    #[arg(long = "ramp_time")]
    pub ramp_time: Option<String>,
    /// Run for `runtime` even when `size` is done (`--time_based` or `--time_based=0|1`).
    #[arg(long = "time_based", num_args = 0..=1, require_equals = true, default_missing_value = "1")]
    pub time_based: Option<String>,
    /// Region per job thread (default: device size minus offset).
    #[arg(long)]
    pub size: Option<String>,
    /// Start of the region.
    #[arg(long)]
    pub offset: Option<String>,
    /// Added to offset for each successive job thread.
    #[arg(long = "offset_increment")]
    pub offset_increment: Option<String>,
    /// `crc32c`: write every block with a checked header, then read back and verify.
    #[arg(long)]
    pub verify: Option<String>,
    /// O_DIRECT for file:/dev: targets (default 1).
    #[arg(long)]
    pub direct: Option<String>,
    /// vhost-user completion wait: block, eventfd or loop (fio's libblkio_wait_mode).
    #[arg(long = "libblkio_wait_mode")]
    pub libblkio_wait_mode: Option<String>,
    /// vhost-user virtqueue size (power of two; default fits iodepth, at least 256).
    #[arg(long = "queue_size")]
    pub queue_size: Option<String>,
    /// Seed of the offset generator.
    #[arg(long)]
    pub randseed: Option<String>,
    /// Report all job threads as one group (`--group_reporting` or `=0|1`).
    #[arg(long = "group_reporting", num_args = 0..=1, require_equals = true, default_missing_value = "1")]
    pub group_reporting: Option<String>,
    /// normal or json.
    #[arg(long = "output-format", default_value = "normal")]
    pub output_format: String,
    /// Server process whose CPU time is measured (all its threads).
    #[arg(long = "server-pid")]
    pub server_pid: Option<u32>,
    /// With --server-pid of a `vqblk serve`: its --stats-file. The server is
    /// asked (SIGUSR1) to rewrite it before and after the run, and the JSON
    /// output gets the per-IOThread counters of the run (`vqblk.server_iothreads`).
    #[arg(long = "server-stats", value_name = "FILE", requires = "server_pid")]
    pub server_stats: Option<PathBuf>,
    /// With verify: create this file after the write pass and start the read pass only
    /// once it has been removed (lets a test or an operator act in between).
    #[arg(long = "verify_pause_file")]
    pub verify_pause_file: Option<PathBuf>,
    /// Preset workload, expanded to fio options (printed on stderr).
    #[arg(long, value_enum)]
    pub profile: Option<Profile>,
    /// How long to wait for the vhost-user handshake.
    #[arg(long = "connect-timeout", default_value = "10s")]
    pub connect_timeout: String,
    /// Print the parsed job descriptions as JSON and exit without running.
    #[arg(long = "parse-only")]
    pub parse_only: bool,
}

#[derive(Parser)]
#[command(name = "vqblk bench", no_binary_name = true)]
struct Standalone {
    #[command(flatten)]
    args: BenchArgs,
}

/// Parses `vqblk bench` arguments (without the program and subcommand names), for tests
/// and embedders.
pub fn parse_args<I, T>(args: I) -> Result<BenchArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    Standalone::try_parse_from(args).map(|s| s.args)
}

impl BenchArgs {
    /// Job options given as flags, as `key=value` pairs in a fixed order (profile first).
    pub fn job_options(&self) -> Vec<RawOption> {
        let mut v: Vec<RawOption> = Vec::new();
        if let Some(p) = self.profile {
            for (k, val) in p.options() {
                v.push((k.to_string(), Some(val.to_string())));
            }
        }
        let fields: [(&str, &Option<String>); 26] = [
            ("target", &self.target),
            ("name", &self.name),
            ("ioengine", &self.ioengine),
            ("libblkio_driver", &self.libblkio_driver),
            ("libblkio_path", &self.libblkio_path),
            ("filename", &self.filename),
            ("thread", &self.thread),
            ("rw", &self.rw),
            ("rwmixread", &self.rwmixread),
            ("rwmixwrite", &self.rwmixwrite),
            ("bs", &self.bs),
            ("numjobs", &self.numjobs),
            ("iodepth", &self.iodepth),
            ("iodepth_batch_submit", &self.iodepth_batch_submit),
            ("runtime", &self.runtime),
            ("ramp_time", &self.ramp_time),
            ("time_based", &self.time_based),
            ("size", &self.size),
            ("offset", &self.offset),
            ("offset_increment", &self.offset_increment),
            ("verify", &self.verify),
            ("direct", &self.direct),
            ("libblkio_wait_mode", &self.libblkio_wait_mode),
            ("queue_size", &self.queue_size),
            ("randseed", &self.randseed),
            ("group_reporting", &self.group_reporting),
        ];
        for (k, val) in fields {
            if let Some(val) = val {
                v.push((k.to_string(), Some(val.clone())));
            }
        }
        v
    }
}

/// Turns arguments into a [`Plan`]: from the job file when one is given, else one job
/// from the flags.
pub fn plan_from_args(args: &BenchArgs) -> anyhow::Result<Plan> {
    let output_format = OutputFormat::parse(&args.output_format)?;
    let connect_timeout = options::parse_time(&args.connect_timeout)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "invalid value '{}' for option 'connect-timeout': a time such as 10s",
                args.connect_timeout
            )
        })?;
    let flags = args.job_options();
    let jobs: Vec<JobSpec> = match &args.jobfile {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("job file {}", path.display()))?;
            let sections =
                parse_job_file(&text).with_context(|| format!("job file {}", path.display()))?;
            jobs_from_sections(&sections, &flags)
                .with_context(|| format!("job file {}", path.display()))?
        }
        None => vec![JobSpec::from_options(options::DEFAULT_JOB_NAME, &flags)?],
    };
    Ok(Plan {
        jobs,
        output_format,
        server_pid: args.server_pid,
        server_stats: args.server_stats.clone(),
        verify_pause_file: args.verify_pause_file.clone(),
        connect_timeout,
        progress: output_format == OutputFormat::Normal,
    })
}

/// Runs the benchmark and returns the process exit code: 0 clean, 1 verify mismatch or
/// I/O error. An `Err` is a usage or setup error (the caller prints it, exits 2).
pub fn run(args: BenchArgs) -> anyhow::Result<i32> {
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    run_to(&args, &mut lock, &mut || Ok(()))
}

/// [`run`] writing its report to `out`, with a hook called between the verify write
/// and read passes.
pub fn run_to(
    args: &BenchArgs,
    out: &mut dyn Write,
    between_verify_passes: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<i32> {
    let plan = plan_from_args(args)?;
    if let Some(p) = args.profile {
        let expanded: Vec<String> = p
            .options()
            .iter()
            .map(|(k, v)| format!("--{k}={v}"))
            .collect();
        eprintln!(
            "vqblk bench: profile {}: {}",
            p.to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_default(),
            expanded.join(" ")
        );
    }
    if args.parse_only {
        let text = serde_json::to_string_pretty(&output::PlanEcho { jobs: &plan.jobs })?;
        writeln!(out, "{text}")?;
        return Ok(0);
    }
    let report = runner::execute(&plan, between_verify_passes)?;
    let text = match plan.output_format {
        OutputFormat::Json => {
            let mut v = serde_json::to_value(output::to_json(&report))?;
            if let Some(d) = &report.server_iothreads {
                v["vqblk"]["server_iothreads"] = serde_json::to_value(d)?;
            }
            let mut t = serde_json::to_string_pretty(&v)?;
            t.push('\n');
            t
        }
        OutputFormat::Normal => output::render_normal(&report),
    };
    out.write_all(text.as_bytes())?;
    out.flush()?;
    for j in &report.jobs {
        if let Some(e) = &j.error {
            eprintln!("vqblk bench: job '{}': {e}", j.name);
        }
    }
    if let Some(v) = &report.verify {
        for m in &v.mismatches {
            eprintln!("vqblk bench: {m}");
        }
        if v.errors > 0 {
            eprintln!(
                "vqblk bench: verify failed: {} of {} blocks bad",
                v.errors, v.blocks_checked
            );
        }
    }
    Ok(report.exit_code())
}

/// The exit code `vqblk` uses for a result of [`run`] (2 for an `Err`).
pub fn exit_code(result: &anyhow::Result<i32>) -> i32 {
    match result {
        Ok(c) => *c,
        Err(_) => 2,
    }
}
