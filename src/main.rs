//! `vqblk`: command-line entry point. Parsing and wiring only; the work is in the library.

use clap::{Parser, Subcommand};

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
    Serve(Box<vqblk::cli::ServeArgs>),
    /// Drive a vhost-user-blk socket or a plain file the way fio does.
    Bench(Box<vqblk_bench::BenchArgs>),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Serve(args) => vqblk::cli::run_serve(*args),
        Command::Bench(args) => match vqblk_bench::run(*args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("vqblk bench: {e:#}");
                2
            }
        },
    };
    std::process::exit(code);
}
