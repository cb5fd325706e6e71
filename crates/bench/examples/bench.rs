//! `vqblk bench` without the daemon: `cargo run -p vqblk-bench --example bench -- ARGS`.
//! Same wiring as `vqblk`'s `main.rs`, for developing the bench crate on its own.

fn main() {
    let args = match vqblk_bench::parse_args(std::env::args_os().skip(1)) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    let code = match vqblk_bench::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vqblk bench: {e:#}");
            2
        }
    };
    std::process::exit(code);
}
