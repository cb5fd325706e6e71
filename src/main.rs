//! `vqblk`: command-line entry point. Parsing and wiring only; the work is in the library.

use clap::{Parser, Subcommand};

mod ctl;
mod top;

#[derive(Parser)]
#[command(
    name = "vqblk",
    version,
    about = "vhost-user-blk storage daemon with IOThread virtqueue mapping"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve disk images over vhost-user-blk.
    Serve(Box<vqblk_daemon::cli::ServeArgs>),
    /// Drive a vhost-user-blk socket or a plain file the way fio does.
    Bench(Box<vqblk_bench::BenchArgs>),
    /// Run the IOThread study (every IOThread count x workload cell) and record the results.
    Sweep(Box<vqblk_study::SweepArgs>),
    /// Turn sweep results into Markdown/CSV/JSON/HTML tables and charts.
    Report(Box<vqblk_study::ReportArgs>),
    /// Recommend an IOThread count and print configuration snippets.
    Recommend(Box<vqblk_study::RecommendArgs>),
    /// Call a method of a running daemon's control socket (JSON-RPC).
    Ctl(Box<ctl::CtlArgs>),
    /// Live view of a running daemon's IOThreads and queues.
    Top(Box<top::TopArgs>),
}

fn exit_code(what: &str, r: anyhow::Result<i32>) -> i32 {
    r.unwrap_or_else(|e| {
        eprintln!("vqblk {what}: {e:#}");
        2
    })
}

/// `vqblk ctl`: a failed call prints the daemon's message and exits 1;
/// a usage or connection error exits 2.
fn ctl_exit(r: anyhow::Result<i32>) -> i32 {
    r.unwrap_or_else(|e| {
        eprintln!("vqblk ctl: {e:#}");
        match e.downcast_ref::<vqblk_daemon::control::client::ClientError>() {
            Some(vqblk_daemon::control::client::ClientError::Rpc { .. }) => 1,
            _ => 2,
        }
    })
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Serve(args) => vqblk_daemon::cli::run_serve(*args),
        Command::Bench(args) => exit_code("bench", vqblk_bench::run(*args)),
        Command::Sweep(args) => exit_code("sweep", vqblk_study::run_sweep(*args)),
        Command::Report(args) => exit_code("report", vqblk_study::run_report(*args)),
        Command::Recommend(args) => exit_code("recommend", vqblk_study::run_recommend(*args)),
        Command::Ctl(args) => ctl_exit(ctl::run(*args)),
        Command::Top(args) => exit_code("top", top::run(*args)),
    };
    std::process::exit(code);
}
