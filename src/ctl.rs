//! `vqblk ctl`: one call on the control socket, printed as a table (or as JSON).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{Map, Value};
use vqblk_daemon::control::client::ControlClient;

/// Options of `vqblk ctl`.
#[derive(Debug, Args)]
#[command(
    after_help = "Parameters are named after the method's: --id 0 --poll-max-ns 0, \
    --export db --queue 3 --iothread 1, --name db --force. A value is a number, true/false \
    or text; a flag without a value is true; --params '{...}' passes a JSON object \
    (e.g. export-add's iothread-vq-mapping).\n\nMethods: query-iothreads, query-exports, \
    iothread-set, export-add, export-del, stats-reset, queue-move, block_set_io_throttle \
    (--export db --iops-total 2000 --bps-total 200000000, or --group NAME; no limit clears), \
    throttle-group-set (--name NAME and limits), query-throttle-groups, share-set \
    (--export db --reservation-iops 3000 --weight 2), tune, query-tune."
)]
pub struct CtlArgs {
    /// The daemon's control socket (`vqblk serve --control PATH`).
    #[arg(long, value_name = "PATH")]
    pub control: PathBuf,
    /// Print the result as JSON (for scripts) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The method to call, e.g. query-iothreads.
    pub method: String,
    /// The method's parameters: --NAME VALUE ...
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "--PARAM VALUE"
    )]
    pub params: Vec<String>,
}

/// Runs `vqblk ctl`; errors (the daemon's message included) exit non-zero.
pub fn run(args: CtlArgs) -> anyhow::Result<i32> {
    let (params, json_after) = parse_params(&args.params)?;
    let mut client = ControlClient::connect(&args.control)
        .with_context(|| format!("--control {}", args.control.display()))?;
    let result = client.call(&args.method, Value::Object(params))?;
    if args.json || json_after {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print!("{}", render(&args.method, &result));
    }
    Ok(0)
}

/// `--name value` pairs as a JSON object; also whether `--json` came after
/// the method.
pub fn parse_params(words: &[String]) -> anyhow::Result<(Map<String, Value>, bool)> {
    let mut map = Map::new();
    let mut json = false;
    let mut i = 0;
    while i < words.len() {
        let Some(flag) = words[i].strip_prefix("--") else {
            bail!("{:?}: parameters are --NAME VALUE", words[i]);
        };
        i += 1;
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag, None),
        };
        let value = match inline {
            Some(v) => Some(v),
            None if i < words.len() && !words[i].starts_with("--") => {
                i += 1;
                Some(words[i - 1].clone())
            }
            None => None,
        };
        match (name, value) {
            ("json", None) => json = true,
            ("params", Some(v)) => match serde_json::from_str(&v) {
                Ok(Value::Object(o)) => map.extend(o),
                _ => bail!("--params: {v:?} is not a JSON object"),
            },
            (name, None) => {
                map.insert(name.into(), Value::Bool(true));
            }
            (name, Some(v)) => {
                map.insert(name.into(), scalar(&v));
            }
        }
    }
    Ok((map, json))
}

/// A command-line value: a number, a boolean, or else text (`null` is the
/// null backend's name, not JSON's null).
fn scalar(v: &str) -> Value {
    match serde_json::from_str::<Value>(v) {
        Ok(x @ (Value::Number(_) | Value::Bool(_))) => x,
        _ => Value::String(v.into()),
    }
}

/// A table of rows of cells, columns padded to their widest cell (numbers
/// right-aligned).
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(&width).enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            let numeric = c.parse::<f64>().is_ok();
            if numeric {
                s.push_str(&format!("{c:>w$}"));
            } else {
                s.push_str(&format!("{c:<w$}"));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        Value::Array(a) => a.iter().map(text).collect::<Vec<_>>().join(","),
        v => v.to_string(),
    }
}

fn mib(v: &Value) -> String {
    format!("{:.1}", v.as_f64().unwrap_or(0.0) / (1 << 20) as f64)
}

/// Limits as `key=value,...` ("-": none).
fn key_values(v: &Value) -> String {
    match v.as_object() {
        Some(o) if !o.is_empty() => o
            .iter()
            .map(|(k, v)| format!("{k}={}", text(v)))
            .collect::<Vec<_>>()
            .join(","),
        _ => "-".into(),
    }
}

/// An export's limits column: its own, or its group's name.
fn limits(e: &Value) -> String {
    match &e["throttle-group"] {
        Value::String(g) => format!("group {g}"),
        _ => key_values(&e["throttle"]),
    }
}

/// An export's share column: its reservation and weight, and the IOPS cap
/// the share allocator gives it now (`-`: none of them).
fn share(e: &Value) -> String {
    let mut parts = Vec::new();
    if let Some(r) = e["reservation-iops"].as_u64() {
        parts.push(format!("reservation={r}"));
    }
    if let Some(w) = e["weight"].as_u64() {
        parts.push(format!("weight={w}"));
    }
    if let Some(c) = e["share"]["cap-iops"].as_f64() {
        parts.push(format!("cap={c:.0}"));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(",")
    }
}

/// The human form of a method's result.
pub fn render(method: &str, result: &Value) -> String {
    let empty = Vec::new();
    let list = result.as_array().unwrap_or(&empty);
    match method {
        "query-iothreads" => {
            let rows: Vec<Vec<String>> = list
                .iter()
                .map(|t| {
                    let queues: Vec<String> = t["queues"]
                        .as_array()
                        .unwrap_or(&empty)
                        .iter()
                        .map(|q| format!("{}/{}", text(&q["export"]), q["queue"]))
                        .collect();
                    vec![
                        text(&t["id"]),
                        text(&t["thread-id"]),
                        text(&t["cpus"]),
                        text(&t["poll"]["mode"]),
                        text(&t["poll"]["poll-max-ns"]),
                        text(&t["requests"]),
                        mib(&t["bytes-read"]),
                        mib(&t["bytes-written"]),
                        format!("{:.2}", t["cpu-seconds"].as_f64().unwrap_or(0.0)),
                        text(&t["poll-hits"]),
                        text(&t["naps"]),
                        format!("{}/{}", t["kick-wakeups"], t["completion-wakeups"]),
                        text(&t["kicks"]),
                        text(&t["used-publishes"]),
                        format!("{}/{}", t["notifications"], t["notifications-suppressed"]),
                        if queues.is_empty() {
                            "-".into()
                        } else {
                            queues.join(",")
                        },
                    ]
                })
                .collect();
            table(
                &[
                    "ID",
                    "TID",
                    "CPUS",
                    "POLL",
                    "MAX-NS",
                    "REQUESTS",
                    "READ-MIB",
                    "WRITE-MIB",
                    "CPU-S",
                    "POLL-HITS",
                    "NAPS",
                    "WAKE-K/C",
                    "KICKS",
                    "PUBLISHES",
                    "CALLS/SUPP",
                    "QUEUES",
                ],
                &rows,
            )
        }
        "query-exports" => {
            let mut rows = Vec::new();
            for e in list {
                for q in e["queues"].as_array().unwrap_or(&empty) {
                    rows.push(vec![
                        text(&e["name"]),
                        if e["connected"] == Value::Bool(true) {
                            "yes"
                        } else {
                            "no"
                        }
                        .into(),
                        text(&e["backend"]),
                        text(&q["queue"]),
                        text(&q["iothread"]),
                        text(&q["requests"]),
                        text(&q["errors"]),
                        mib(&q["bytes-read"]),
                        mib(&q["bytes-written"]),
                        text(&q["throttled"]),
                        limits(e),
                        share(e),
                        text(&e["socket"]),
                    ]);
                }
            }
            table(
                &[
                    "EXPORT",
                    "CONNECTED",
                    "BACKEND",
                    "QUEUE",
                    "IOTHREAD",
                    "REQUESTS",
                    "ERRORS",
                    "READ-MIB",
                    "WRITE-MIB",
                    "THROTTLED",
                    "LIMITS",
                    "SHARE",
                    "SOCKET",
                ],
                &rows,
            )
        }
        "query-throttle-groups" => {
            let rows: Vec<Vec<String>> = list
                .iter()
                .map(|g| {
                    vec![
                        text(&g["name"]),
                        key_values(&g["limits"]),
                        text(&g["members"]),
                    ]
                })
                .collect();
            table(&["GROUP", "LIMITS", "MEMBERS"], &rows)
        }
        _ => match result {
            Value::Object(o) if o.is_empty() => "ok\n".into(),
            Value::Object(o) => o
                .iter()
                .map(|(k, v)| format!("{k}: {}\n", text(v)))
                .collect(),
            v => format!("{}\n", text(v)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parameters_become_a_json_object() {
        let (m, json) = parse_params(&words(
            "--export db --queue 3 --force --json --poll-max-ns=0 --backend null --params {\"a\":[1]}",
        ))
        .unwrap();
        assert!(json);
        assert_eq!(
            Value::Object(m),
            json!({"export": "db", "queue": 3, "force": true, "poll-max-ns": 0, "backend": "null", "a": [1]})
        );
        assert!(parse_params(&words("db")).is_err());
        assert!(parse_params(&words("--params 3")).is_err());
    }

    #[test]
    fn tables_align_columns() {
        let t = table(&["A", "LONGER"], &[vec!["xyz".into(), "7".into()]]);
        assert_eq!(t, "A    LONGER\nxyz       7\n");
        assert_eq!(render("stats-reset", &json!({})), "ok\n");
        assert_eq!(render("export-add", &json!({"name": "d"})), "name: d\n");
        let groups = json!([{"name": "g", "limits": {"iops-total": 5}, "members": ["a", "b"]}]);
        assert_eq!(
            render("query-throttle-groups", &groups),
            "GROUP  LIMITS        MEMBERS\ng      iops-total=5  a,b\n"
        );
    }

    #[test]
    fn exports_show_their_share() {
        let export = |extra: Value| {
            let mut e = json!({"name": "db", "connected": true, "backend": "file",
                "socket": "/s", "queues": [{"queue": 0, "iothread": 0}]});
            e.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            e
        };
        let t = render(
            "query-exports",
            &json!([export(json!({"reservation-iops": 3000, "weight": 2,
                "share": {"device": "fs-1", "cap-iops": 4500.4}}))]),
        );
        let (head, row) = t.split_once('\n').unwrap();
        let col = words(head).iter().position(|h| h == "SHARE").unwrap();
        assert_eq!(words(row)[col], "reservation=3000,weight=2,cap=4500", "{t}");
        let t = render("query-exports", &json!([export(json!({}))]));
        let row = t.lines().nth(1).unwrap();
        assert_eq!(words(row)[col], "-", "{t}");
    }
}
