//! The fuzzing driver shared by the `fuzz_*` harnesses: a loop on the stable
//! toolchain that feeds random bytes to a harness (which decodes them into a
//! structured case with `arbitrary`), catches panics, and counts executions.
//!
//! Modes, chosen by environment variables:
//! - default (CI): a bounded number of cases from a fixed seed, so a run is
//!   reproducible and takes a few seconds;
//! - `VQBLK_FUZZ_SECONDS=N`: run for N seconds (seed from the clock unless
//!   `VQBLK_FUZZ_SEED` is set, decimal or `0x` hex as the summary prints
//!   it), printing progress every 10 s;
//! - `VQBLK_FUZZ_ITERS=N`: run N cases;
//! - `VQBLK_FUZZ_REPLAY=FILE`: run the one input saved in FILE (findings are
//!   saved under `target/tmp/fuzz-findings/<harness>/`).
//!
//! At the end a summary line is printed (`fuzz <name>: <n> executions in <s>
//! s (<r> exec/s), <k> known-filtered, <f> findings`) that `scripts/fuzz.sh`
//! collects, and the test fails if there was a finding.
#![allow(dead_code)]

use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use std::sync::atomic::{AtomicU64, Ordering};

pub mod guarded;
pub mod ring;

/// Panics in any thread of the process (IOThreads, daemon threads): a panic
/// outside the harness's own thread is a finding too.
static PANICS: AtomicU64 = AtomicU64::new(0);

fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            prev(info);
        }));
    });
}

/// How often each kind of result was seen (what a harness notes with
/// [`note`]): shows at the end of a run whether the inputs reach deep.
static NOTES: std::sync::Mutex<std::collections::BTreeMap<String, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Counts one occurrence of `what` (printed in the summary).
pub fn note(what: impl Into<String>) {
    *NOTES.lock().unwrap().entry(what.into()).or_default() += 1;
}

/// Whether `VQBLK_FUZZ_DEBUG` asks harnesses for more notes.
pub fn debug() -> bool {
    static DEBUG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("VQBLK_FUZZ_DEBUG").is_some())
}

/// Whether `VQBLK_FUZZ_NO_KNOWN` turns the known-defect filters off (to see
/// the known defects reported as findings, or to check they are fixed).
pub fn no_known() -> bool {
    static NO_KNOWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NO_KNOWN.get_or_init(|| std::env::var_os("VQBLK_FUZZ_NO_KNOWN").is_some())
}

/// Whether this run replays one saved input (`VQBLK_FUZZ_REPLAY`).
pub fn replaying() -> bool {
    static REPLAY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REPLAY.get_or_init(|| std::env::var_os("VQBLK_FUZZ_REPLAY").is_some())
}

/// Panics counted so far, in every thread.
pub fn panics() -> u64 {
    PANICS.load(Ordering::SeqCst)
}

/// What one case came to, besides a panic (which is always a finding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Ran and every invariant held.
    Pass,
    /// Ran, but hit one of the known, filed defects its harness excludes by
    /// name (`KNOWN_11_1`...): counted, not a finding.
    Known(&'static str),
    /// An invariant did not hold.
    Finding(String),
}

/// How a harness run is bounded.
enum Budget {
    Cases(u64),
    Time(Duration),
}

/// Largest input handed to a harness, in bytes.
pub const MAX_INPUT: usize = 4096;

/// Runs `harness` over random inputs decoded as `C`; `default_cases` is the
/// CI budget. Panics at the end if there was a finding.
pub fn run<C, F>(name: &str, default_cases: u64, mut harness: F)
where
    C: for<'a> Arbitrary<'a> + Debug,
    F: FnMut(&C) -> Outcome,
{
    count_panics();
    if let Ok(path) = std::env::var("VQBLK_FUZZ_REPLAY") {
        let bytes = std::fs::read(&path).expect("VQBLK_FUZZ_REPLAY file");
        let case = decode::<C>(&bytes).expect("the saved input decodes");
        println!("replaying {path}: {case:#?}");
        println!("outcome: {:?}", harness(&case));
        return;
    }
    let env_u64 = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let budget = match (env_u64("VQBLK_FUZZ_SECONDS"), env_u64("VQBLK_FUZZ_ITERS")) {
        (Some(s), _) => Budget::Time(Duration::from_secs(s)),
        (None, Some(n)) => Budget::Cases(n),
        (None, None) => Budget::Cases(default_cases),
    };
    // The summary prints the seed in hex: take it back in hex too (a value
    // that does not parse is an error, not a silently random seed).
    let seed = std::env::var("VQBLK_FUZZ_SEED").ok().map(|v| {
        let parsed = match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => v.parse::<u64>().ok(),
        };
        parsed.unwrap_or_else(|| panic!("VQBLK_FUZZ_SEED={v}: not a decimal or 0x-hex u64"))
    });
    let seed = seed.unwrap_or(match budget {
        // CI: the same cases every run.
        Budget::Cases(_) => 0x005e_ed0f_b10c,
        Budget::Time(_) => fastrand::u64(..),
    });
    let mut rng = fastrand::Rng::with_seed(seed);
    let started = Instant::now();
    let mut last_report = started;
    let (mut execs, mut known, mut undecodable) = (0u64, 0u64, 0u64);
    let mut findings: Vec<String> = Vec::new();
    let mut buf = Vec::with_capacity(MAX_INPUT);
    loop {
        match budget {
            Budget::Cases(n) if execs >= n => break,
            Budget::Time(d) if started.elapsed() >= d => break,
            _ => {}
        }
        // Mostly short inputs: a structured case needs few bytes, and a
        // short input leaves the rest of the fields at their defaults.
        let len = match rng.u8(..4) {
            0 => rng.usize(..64),
            1 | 2 => rng.usize(..512),
            _ => rng.usize(..MAX_INPUT),
        };
        buf.clear();
        buf.extend((0..len).map(|_| rng.u8(..)));
        execs += 1;
        let Ok(case) = decode::<C>(&buf) else {
            undecodable += 1;
            continue;
        };
        let before = panics();
        let mut outcome = catch_unwind(AssertUnwindSafe(|| harness(&case)))
            .unwrap_or_else(|p| Outcome::Finding(format!("panic: {}", panic_text(&p))));
        if panics() != before && !matches!(outcome, Outcome::Finding(_)) {
            outcome = Outcome::Finding("a thread panicked (see stderr)".into());
        }
        match outcome {
            Outcome::Pass => {}
            Outcome::Known(_) => known += 1,
            Outcome::Finding(what) => {
                let file = save(name, seed, execs, &buf);
                eprintln!(
                    "FINDING in fuzz {name} (seed {seed:#x}, case {execs}): {what}\n  \
                     input saved to {}\n  replay: VQBLK_FUZZ_REPLAY={} cargo test --release \
                     --test fuzz_{name} -- --nocapture\n  case: {case:?}",
                    file.display(),
                    file.display()
                );
                findings.push(what);
                if findings.len() >= 10 {
                    eprintln!("fuzz {name}: 10 findings, stopping");
                    break;
                }
            }
        }
        if matches!(budget, Budget::Time(_)) && last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            let s = started.elapsed().as_secs_f64();
            println!(
                "fuzz {name}: {execs} executions, {:.0} exec/s, {} findings",
                execs as f64 / s,
                findings.len()
            );
        }
    }
    let s = started.elapsed().as_secs_f64();
    println!(
        "fuzz {name}: {execs} executions in {s:.1} s ({:.0} exec/s), seed {seed:#x}, \
         {known} known-filtered, {undecodable} undecodable, {} findings",
        execs as f64 / s.max(1e-9),
        findings.len()
    );
    let notes = NOTES.lock().unwrap();
    if !notes.is_empty() {
        let list: Vec<String> = notes.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("fuzz {name}: results: {}", list.join(" "));
    }
    assert!(findings.is_empty(), "fuzz {name}: findings: {findings:#?}");
}

/// Decodes a case the way the loop does.
pub fn decode<C: for<'a> Arbitrary<'a>>(bytes: &[u8]) -> arbitrary::Result<C> {
    C::arbitrary_take_rest(Unstructured::new(bytes))
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".into())
}

fn save(name: &str, seed: u64, case: u64, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz-findings")
        .join(name);
    let _ = std::fs::create_dir_all(&dir);
    let file = dir.join(format!("{seed:016x}-{case}.bin"));
    let _ = std::fs::write(&file, bytes);
    file
}

/// The saved inputs under `tests/fuzz/corpus/<name>/` (findings kept as
/// regression cases, with a name saying what each one is), sorted by name.
pub fn corpus(name: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/corpus")
        .join(name);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "bin"))
                .map(|p| {
                    let bytes = std::fs::read(&p).unwrap();
                    (p.file_name().unwrap().to_string_lossy().into_owned(), bytes)
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Asserts a regression case passes: no finding, and no known defect either
/// (the regression tests of known defects are `#[ignore]`d until fixed).
pub fn check_case<C: Debug>(case: &C, outcome: Outcome) {
    if outcome != Outcome::Pass {
        panic!("regression: {outcome:?}\ncase: {case:#?}");
    }
}
