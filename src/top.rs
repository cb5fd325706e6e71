//! `vqblk top`: a live view of the IOThreads and queues, like `top -H`, built
//! on the control socket's `query-iothreads` and `query-exports` (and
//! `query-tune`: with `--iothreads auto`, which IOThreads the online tuner
//! parked and its moves by reason).
//!
//! crossterm draws it: it is the terminal layer ratatui itself sits on, well
//! kept, pure Rust (no curses library to link), and enough for two fixed
//! tables; a widget toolkit would add much code for nothing we use.

use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use crossterm::{cursor, queue, style, terminal};
use serde_json::Value;
use vqblk_daemon::control::client::ControlClient;

/// Options of `vqblk top`.
#[derive(Debug, Args)]
#[command(
    after_help = "Keys: c sort by CPU, i sort by IOPS, n sort by IOThread id, \
    q (or Ctrl-C, Esc) quit."
)]
pub struct TopArgs {
    /// The daemon's control socket (`vqblk serve --control PATH`).
    #[arg(long, value_name = "PATH")]
    pub control: PathBuf,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    pub delay: f64,
}

/// The order of the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sort {
    /// IOThread id (and export/queue order).
    Id,
    /// CPU use, busiest first.
    Cpu,
    /// Requests per second, busiest first.
    Iops,
}

/// The daemon's counters at one moment.
struct Sample {
    at: Instant,
    iothreads: Vec<Value>,
    exports: Vec<Value>,
    /// `query-tune`'s answer (`auto` false: the pool is not tuned online).
    tune: Value,
}

impl Sample {
    fn take(c: &mut ControlClient) -> anyhow::Result<Sample> {
        let list = |v: Value| v.as_array().cloned().unwrap_or_default();
        Ok(Sample {
            at: Instant::now(),
            iothreads: list(c.call("query-iothreads", Value::Null)?),
            exports: list(c.call("query-exports", Value::Null)?),
            tune: c.call("query-tune", Value::Null)?,
        })
    }
}

/// One IOThread's line.
#[derive(Debug, Clone, PartialEq)]
struct ThreadRow {
    id: u64,
    tid: u64,
    cpu_pct: f64,
    iops: f64,
    mbps: f64,
    mode: String,
    hit_pct: Option<f64>,
    naps: f64,
    window_ns: u64,
    /// Under the online tuner: it owns a queue (false: parked).
    active: Option<bool>,
}

/// One queue's line.
#[derive(Debug, Clone, PartialEq)]
struct QueueRow {
    name: String,
    iothread: u64,
    iops: f64,
    mbps: f64,
    errors: u64,
    /// Requests held back by the I/O limits, per second.
    throttled: f64,
    connected: bool,
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(0.0)
}

/// Is the pool tuned online?
fn tuned(s: &Sample) -> bool {
    s.tune["auto"] == Value::Bool(true)
}

/// The online tuner's line: its budget, the moves that failed and those it
/// made by reason (None: the pool is not tuned online).
fn tune_line(tune: &Value) -> Option<String> {
    if tune["auto"] != Value::Bool(true) {
        return None;
    }
    let moves: Vec<String> = tune["moves"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(reason, n)| format!("{reason} {n}"))
        .collect();
    Some(format!(
        "autotune: max {} active  failed {}  moves: {}",
        tune["max-active"],
        tune["failed-moves"],
        moves.join(" ")
    ))
}

/// Rates between two samples (counters that went down, after a
/// `stats-reset`, count as zero).
fn rows(old: &Sample, new: &Sample, sort: Sort) -> (Vec<ThreadRow>, Vec<QueueRow>) {
    let dt = new.at.duration_since(old.at).as_secs_f64().max(1e-3);
    let delta =
        |a: Option<&Value>, b: &Value, k: &str| (num(b, k) - a.map_or(0.0, |a| num(a, k))).max(0.0);
    let mut threads: Vec<ThreadRow> = new
        .iothreads
        .iter()
        .map(|t| {
            let o = old.iothreads.iter().find(|o| o["id"] == t["id"]);
            let attempts = delta(o, t, "poll-attempts");
            ThreadRow {
                id: t["id"].as_u64().unwrap_or(0),
                tid: t["thread-id"].as_u64().unwrap_or(0),
                cpu_pct: delta(o, t, "cpu-seconds") / dt * 100.0,
                iops: delta(o, t, "requests") / dt,
                mbps: (delta(o, t, "bytes-read") + delta(o, t, "bytes-written")) / dt / 1e6,
                mode: t["poll"]["mode"].as_str().unwrap_or("?").to_string(),
                hit_pct: (attempts > 0.0).then(|| delta(o, t, "poll-hits") / attempts * 100.0),
                naps: delta(o, t, "naps") / dt,
                window_ns: t["poll-window-ns"].as_u64().unwrap_or(0),
                active: tuned(new).then(|| t["active"] == Value::Bool(true)),
            }
        })
        .collect();
    let mut queues = Vec::new();
    for e in &new.exports {
        let name = e["name"].as_str().unwrap_or("?");
        let old_e = old.exports.iter().find(|o| o["name"] == e["name"]);
        for q in e["queues"].as_array().into_iter().flatten() {
            let o = old_e
                .and_then(|o| o["queues"].as_array())
                .and_then(|qs| qs.iter().find(|x| x["queue"] == q["queue"]));
            queues.push(QueueRow {
                name: format!("{name}/{}", q["queue"]),
                iothread: q["iothread"].as_u64().unwrap_or(0),
                iops: delta(o, q, "requests") / dt,
                mbps: (delta(o, q, "bytes-read") + delta(o, q, "bytes-written")) / dt / 1e6,
                errors: q["errors"].as_u64().unwrap_or(0),
                throttled: delta(o, q, "throttled") / dt,
                connected: e["connected"] == Value::Bool(true),
            });
        }
    }
    let desc = |a: f64, b: f64| b.total_cmp(&a);
    match sort {
        Sort::Id => {}
        Sort::Cpu => threads.sort_by(|a, b| desc(a.cpu_pct, b.cpu_pct)),
        Sort::Iops => threads.sort_by(|a, b| desc(a.iops, b.iops)),
    }
    if sort != Sort::Id {
        queues.sort_by(|a, b| desc(a.iops, b.iops));
    }
    (threads, queues)
}

/// The screen's lines for a terminal of `width` x `height`.
fn screen(
    control: &str,
    (threads, queues): &(Vec<ThreadRow>, Vec<QueueRow>),
    tune: &Value,
    sort: Sort,
    width: usize,
    height: usize,
) -> Vec<String> {
    let total_iops: f64 = threads.iter().map(|t| t.iops).sum();
    let total_cpu: f64 = threads.iter().map(|t| t.cpu_pct).sum();
    let mut lines = vec![
        format!("vqblk top - {control} - sort {sort:?} (c cpu, i iops, n id, q quit)"),
        format!(
            "IOThreads: {}  queues: {}  total: {total_iops:.0} IOPS, {total_cpu:.1}% CPU",
            threads.len(),
            queues.len()
        ),
    ];
    lines.extend(tune_line(tune));
    // A STATE column (active or parked) only under the online tuner.
    let state = |s: &str| match tune_line(tune) {
        Some(_) => format!(" {s:<6}"),
        None => String::new(),
    };
    lines.push(String::new());
    lines.push(format!(
        "{:>3} {:>7} {:>6} {:>8} {:>7}  {:<8} {:>5} {:>7} {:>9}{}",
        "IOT",
        "TID",
        "CPU%",
        "IOPS",
        "MB/s",
        "POLL",
        "HIT%",
        "NAPS/s",
        "WINDOW-NS",
        state("STATE")
    ));
    // Room for the IOThreads, then at least the queue header and one queue.
    let thread_room = height.saturating_sub(lines.len() + 3).max(1);
    for t in threads.iter().take(thread_room) {
        let hit = t.hit_pct.map_or("-".into(), |h| format!("{h:.1}"));
        let active = match t.active {
            Some(true) => "active",
            Some(false) => "parked",
            None => "-",
        };
        lines.push(format!(
            "{:>3} {:>7} {:>6.1} {:>8.0} {:>7.1}  {:<8} {:>5} {:>7.0} {:>9}{}",
            t.id,
            t.tid,
            t.cpu_pct,
            t.iops,
            t.mbps,
            t.mode,
            hit,
            t.naps,
            t.window_ns,
            state(active)
        ));
    }
    if threads.len() > thread_room {
        lines.pop();
        lines.push(format!(
            "... {} more IOThreads",
            threads.len() - thread_room + 1
        ));
    }
    lines.push(String::new());
    lines.push(format!(
        "{:<20} {:>3} {:>8} {:>7} {:>7} {:>7}  {:<4}",
        "EXPORT/QUEUE", "IOT", "IOPS", "MB/s", "ERRORS", "THROT/s", "CONN"
    ));
    for q in queues {
        if lines.len() >= height {
            break;
        }
        lines.push(format!(
            "{:<20} {:>3} {:>8.0} {:>7.1} {:>7} {:>7.0}  {:<4}",
            q.name,
            q.iothread,
            q.iops,
            q.mbps,
            q.errors,
            q.throttled,
            if q.connected { "yes" } else { "no" }
        ));
    }
    lines.truncate(height);
    for l in &mut lines {
        if l.chars().count() > width {
            *l = l.chars().take(width).collect();
        }
    }
    lines
}

/// Raw mode and the alternate screen while it lives; the terminal is
/// restored when it is dropped (on `q`, Ctrl-C, an error or a panic).
struct Terminal;

impl Terminal {
    fn enter() -> io::Result<Terminal> {
        terminal::enable_raw_mode()?;
        let t = Terminal;
        crossterm::execute!(io::stdout(), terminal::EnterAlternateScreen, cursor::Hide)?;
        Ok(t)
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = crossterm::execute!(io::stdout(), cursor::Show, terminal::LeaveAlternateScreen);
        let _ = terminal::disable_raw_mode();
    }
}

fn draw(lines: &[String]) -> io::Result<()> {
    let mut out = io::stdout().lock();
    queue!(out, terminal::Clear(terminal::ClearType::All))?;
    for (i, l) in lines.iter().enumerate() {
        queue!(out, cursor::MoveTo(0, i as u16), style::Print(l))?;
    }
    out.flush()
}

/// What a key asks for.
enum Key {
    Quit,
    Sort(Sort),
    Redraw,
    Nothing,
}

fn key(e: Event) -> Key {
    match e {
        Event::Key(k) if k.kind != KeyEventKind::Release => match k.code {
            KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => Key::Quit,
            KeyCode::Char('q') | KeyCode::Char('Q') | KeyCode::Esc => Key::Quit,
            KeyCode::Char('c') => Key::Sort(Sort::Cpu),
            KeyCode::Char('i') => Key::Sort(Sort::Iops),
            KeyCode::Char('n') => Key::Sort(Sort::Id),
            _ => Key::Nothing,
        },
        Event::Resize(..) => Key::Redraw,
        _ => Key::Nothing,
    }
}

/// What the terminal has for us.
enum Input {
    /// Nothing within the time given.
    None,
    /// Bytes to read (keys, or a reply crossterm asked for).
    Ready,
    /// It hung up or is gone.
    HungUp,
}

/// Waits up to `timeout` for input on the terminal (stdin), with poll(2)
/// rather than crossterm: crossterm 0.29's `event::poll` loops forever,
/// without returning, on a terminal that has hung up (its reads return EOF or
/// EIO), which would leave `top` spinning a CPU after its window closed.
fn wait_input(timeout: Duration) -> Input {
    let mut p = libc::pollfd {
        fd: libc::STDIN_FILENO,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid, initialized pollfd that outlives the call.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis().min(1000) as libc::c_int) };
    if n <= 0 {
        // Timeout, or EINTR (a signal: the caller checks its flag).
        return Input::None;
    }
    if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        Input::HungUp
    } else {
        Input::Ready
    }
}

/// Runs `vqblk top` until `q`, Ctrl-C, SIGTERM or SIGHUP, or until its
/// terminal goes away.
pub fn run(args: TopArgs) -> anyhow::Result<i32> {
    if !(0.1..=3600.0).contains(&args.delay) {
        anyhow::bail!(
            "--delay: {} is out of range (0.1..=3600 seconds)",
            args.delay
        );
    }
    let delay = Duration::from_secs_f64(args.delay);
    let name = args.control.display().to_string();
    let mut client =
        ControlClient::connect(&args.control).with_context(|| format!("--control {name}"))?;
    let mut old = Sample::take(&mut client)?;
    let mut new = Sample::take(&mut client)?;
    // SIGTERM and SIGHUP (a closed terminal) end it like `q`: the terminal
    // is restored on the way out, which their default action would skip.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP] {
        signal_hook::flag::register(sig, stop.clone()).context("signal handler")?;
    }
    let _terminal = Terminal::enter()?;
    let mut sort = Sort::Id;
    loop {
        let (w, h) = terminal::size().unwrap_or((80, 24));
        draw(&screen(
            &name,
            &rows(&old, &new, sort),
            &new.tune,
            sort,
            w as usize,
            h as usize,
        ))?;
        let next = Instant::now() + delay;
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(0);
            }
            let left = next.saturating_duration_since(Instant::now());
            // In slices, so that a signal is noticed within 100 ms.
            if left.is_zero() {
                break;
            }
            match wait_input(left.min(Duration::from_millis(100))) {
                Input::None => continue,
                // The terminal went away (its window closed without a
                // SIGHUP reaching us): nothing to restore, nobody to show.
                Input::HungUp => return Ok(0),
                Input::Ready => {}
            }
            if !event::poll(Duration::ZERO)? {
                continue;
            }
            match key(event::read()?) {
                Key::Quit => return Ok(0),
                Key::Sort(s) => sort = s,
                Key::Redraw | Key::Nothing => continue,
            }
            let (w, h) = terminal::size().unwrap_or((80, 24));
            draw(&screen(
                &name,
                &rows(&old, &new, sort),
                &new.tune,
                sort,
                w as usize,
                h as usize,
            ))?;
        }
        old = std::mem::replace(&mut new, Sample::take(&mut client)?);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(at: Instant, requests: u64, cpu: f64, q1: u64) -> Sample {
        let thread = |id: u64, r: u64, c: f64| {
            json!({"id": id, "thread-id": 100 + id, "cpu-seconds": c, "requests": r,
                   "bytes-read": r * 4096, "bytes-written": 0, "poll-attempts": r,
                   "poll-hits": r / 2, "naps": 0, "poll-window-ns": 500,
                   "poll": {"mode": "adaptive"}})
        };
        Sample {
            at,
            iothreads: vec![thread(0, requests, cpu), thread(1, 0, cpu * 2.0)],
            exports: vec![json!({"name": "db", "connected": true, "queues": [
                {"queue": 0, "iothread": 0, "requests": requests, "bytes-read": 0,
                 "bytes-written": 0, "errors": 0},
                {"queue": 1, "iothread": 1, "requests": q1, "bytes-read": 0,
                 "bytes-written": 0, "errors": 2, "throttled": q1 / 2}]})],
            tune: json!({"auto": false}),
        }
    }

    #[test]
    fn rates_and_sorting() {
        let t0 = Instant::now();
        let old = sample(t0, 1000, 1.0, 0);
        let new = sample(t0 + Duration::from_secs(2), 3000, 1.5, 100);
        let (threads, queues) = rows(&old, &new, Sort::Id);
        assert_eq!(threads[0].iops, 1000.0);
        assert!((threads[0].cpu_pct - 25.0).abs() < 1e-6);
        assert_eq!(threads[0].hit_pct, Some(50.0));
        assert_eq!(threads[1].hit_pct, None);
        assert!((threads[0].mbps - 1000.0 * 4096.0 / 1e6).abs() < 1e-6);
        assert_eq!((queues[1].iops, queues[1].errors), (50.0, 2));
        assert_eq!(queues[1].throttled, 25.0, "held back per second");
        let (threads, _) = rows(&old, &new, Sort::Cpu);
        assert_eq!(threads[0].id, 1, "IOThread 1 used more CPU");
        let (threads, queues) = rows(&old, &new, Sort::Iops);
        assert_eq!((threads[0].id, queues[0].name.as_str()), (0, "db/0"));
        // After a stats-reset the counters go down: no negative rates.
        let (threads, _) = rows(
            &new,
            &sample(t0 + Duration::from_secs(3), 10, 0.0, 0),
            Sort::Id,
        );
        assert_eq!((threads[0].iops, threads[0].cpu_pct), (0.0, 0.0));
    }

    #[test]
    fn the_screen_fits_80x24() {
        let t0 = Instant::now();
        let mut new = sample(t0 + Duration::from_secs(1), 10, 1.0, 0);
        let many: Vec<Value> = (0..40)
            .map(|q| json!({"queue": q, "iothread": 0}))
            .collect();
        new.exports[0]["queues"] = Value::Array(many);
        let r = rows(&sample(t0, 0, 0.0, 0), &new, Sort::Id);
        let untuned = json!({"auto": false});
        let lines = screen(
            "/run/a-rather-long/control.sock",
            &r,
            &untuned,
            Sort::Id,
            80,
            24,
        );
        assert_eq!(lines.len(), 24);
        assert!(lines.iter().all(|l| l.chars().count() <= 80));
        assert!(lines[4].starts_with("  0     100"), "{:?}", lines[4]);
        let tiny = screen("s", &r, &untuned, Sort::Id, 40, 6);
        assert!(tiny.len() <= 6 && tiny.iter().all(|l| l.chars().count() <= 40));
        assert!(!lines
            .iter()
            .any(|l| l.contains("autotune") || l.contains("STATE")));
    }

    /// Under the online tuner: each IOThread's state (active owns a queue,
    /// parked does not) and a line of the moves by reason, still in 80
    /// columns.
    #[test]
    fn the_tuned_pool_shows_its_state_and_moves() {
        let t0 = Instant::now();
        let old = sample(t0, 0, 0.0, 0);
        let mut new = sample(t0 + Duration::from_secs(1), 10, 1.0, 0);
        new.iothreads[0]["active"] = json!(true);
        new.iothreads[1]["active"] = json!(false);
        new.tune = json!({"auto": true, "max-active": 2, "failed-moves": 1,
            "moves": {"balance": 3, "activate": 1, "park": 2, "budget": 0}});
        let r = rows(&old, &new, Sort::Id);
        assert_eq!(
            r.0.iter().map(|t| t.active).collect::<Vec<_>>(),
            vec![Some(true), Some(false)]
        );
        let lines = screen("ctl.sock", &r, &new.tune, Sort::Id, 80, 24);
        assert!(lines.iter().all(|l| l.chars().count() <= 80), "{lines:#?}");
        assert_eq!(
            lines[2],
            "autotune: max 2 active  failed 1  moves: activate 1 balance 3 budget 0 park 2"
        );
        assert!(lines[4].ends_with(" STATE "), "{:?}", lines[4]);
        assert!(lines[5].ends_with(" active"), "{:?}", lines[5]);
        assert!(lines[6].ends_with(" parked"), "{:?}", lines[6]);
    }
}
