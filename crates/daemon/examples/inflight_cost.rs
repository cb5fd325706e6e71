//! What inflight tracking adds to one request on the data path: the IOThread's
//! `begin` at pop and `stage_used` + `commit_used` at publish, on a real
//! (memfd-backed, shared) region, timed over many requests with QD16-like
//! out-of-order completion. Compare the figure with the server CPU per request
//! of the serve benchmark (docs/bench.md).
//!
//!     cargo run --release -p vqblk-daemon --example inflight_cost

use std::time::Instant;

use vqblk_daemon::inflight::{InflightLayout, InflightRegion};

fn main() {
    const QUEUE_SIZE: u16 = 256;
    const DEPTH: u16 = 16;
    const REQUESTS: u64 = 20_000_000;
    let layout = InflightLayout::new(1, QUEUE_SIZE).expect("layout");
    let (region, _file) = InflightRegion::create(layout).expect("region");
    let (mut q, _) = region.attach_queue(0, 0).expect("attach");
    let mut runs = Vec::new();
    for _ in 0..5 {
        let mut used_idx: u16 = 0;
        let t = Instant::now();
        for n in 0..REQUESTS {
            // Heads cycle through the ring; completions come back DEPTH behind.
            let head = (n % u64::from(QUEUE_SIZE)) as u16;
            q.begin(head).expect("begin");
            if n >= u64::from(DEPTH) {
                let done = ((n - u64::from(DEPTH)) % u64::from(QUEUE_SIZE)) as u16;
                q.stage_used(done).expect("stage");
                used_idx = used_idx.wrapping_add(1);
                q.commit_used(used_idx);
            }
        }
        runs.push(t.elapsed().as_nanos() as f64 / REQUESTS as f64);
        // Drain what is left so the next run starts clean.
        for k in (REQUESTS - u64::from(DEPTH))..REQUESTS {
            q.stage_used((k % u64::from(QUEUE_SIZE)) as u16)
                .expect("stage");
            used_idx = used_idx.wrapping_add(1);
            q.commit_used(used_idx);
        }
    }
    runs.sort_by(f64::total_cmp);
    println!(
        "inflight tracking: {:.1} ns per request (median of 5 runs of {REQUESTS}; min {:.1}, max {:.1})",
        runs[2], runs[0], runs[4]
    );
}
