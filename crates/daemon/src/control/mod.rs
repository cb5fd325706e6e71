//! The control socket: JSON-RPC 2.0 over a unix stream socket, one JSON
//! object per line (the framing SPDK's `rpc.py` speaks), for operators and
//! for `vqblk ctl` / `vqblk top`.
//!
//! One thread (`vqblk-rpc`) serves every client: it waits in `poll` on the
//! listener, the daemon's shutdown eventfd and at most [`MAX_CLIENTS`]
//! clients, reads what a client sent, and answers each complete line in
//! order. A line longer than [`MAX_REQUEST`] bytes is answered with an error
//! and the client is closed; a client that goes away in the middle of a line
//! is simply forgotten. The thread knows the daemon only through the
//! [`ControlTarget`] the daemon hands it, which reaches the data path the way
//! the export threads do: through `iothread::Command`s (`iothread-set`) and
//! by starting or stopping export threads (`export-add` / `export-del`). It
//! reads counters, never writes them (`stats-reset` keeps a baseline here, so
//! that counters stay monotonic for Prometheus).
//!
//! Methods (named after QMP where QMP has one): see [`methods`].

pub mod client;
pub mod methods;
mod target;
#[cfg(test)]
mod tests;

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use log::{debug, error, warn};
use serde_json::{json, Map, Value};
use vmm_sys_util::eventfd::EventFd;

use crate::seccomp::{SeccompMode, ThreadKind};

pub use methods::METHODS;
pub use target::{
    ControlTarget, ExportView, IoThreadView, QueueMoved, ShareView, ThrottleGroupView, TuneView,
    TunerMove,
};

/// Longest request line, bytes (1 MiB): a longer one is refused and its
/// client closed.
pub const MAX_REQUEST: usize = 1 << 20;
/// Most clients served at once; one more is told so and closed.
pub const MAX_CLIENTS: usize = 16;
/// How long an answer may wait for a client that does not read.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// JSON-RPC 2.0 error codes (section 5.1 of the specification).
pub mod code {
    /// The line is not valid JSON.
    pub const PARSE_ERROR: i64 = -32700;
    /// Valid JSON but not a request object (or too large).
    pub const INVALID_REQUEST: i64 = -32600;
    /// No such method.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// A parameter is missing, unknown or has a bad value; the message names it.
    pub const INVALID_PARAMS: i64 = -32602;
    /// The request was understood but could not be carried out (an image
    /// that cannot be opened, an export in use...).
    pub const FAILED: i64 = -32000;
}

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    /// One of [`code`].
    pub code: i64,
    /// What went wrong; for [`code::INVALID_PARAMS`], starts with the parameter's name.
    pub message: String,
    /// The offending parameter, for [`code::INVALID_PARAMS`].
    pub param: Option<String>,
}

impl RpcError {
    /// An error of `code`.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            param: None,
        }
    }

    /// A bad parameter: the message is `NAME: WHAT`.
    pub fn param(name: &str, what: impl std::fmt::Display) -> Self {
        RpcError {
            code: code::INVALID_PARAMS,
            message: format!("{name}: {what}"),
            param: Some(name.to_string()),
        }
    }

    /// A request that was understood but failed.
    pub fn failed(message: impl Into<String>) -> Self {
        RpcError::new(code::FAILED, message)
    }

    fn to_json(&self) -> Value {
        let mut e = json!({ "code": self.code, "message": self.message });
        if let Some(p) = &self.param {
            e["data"] = json!({ "param": p });
        }
        e
    }
}

/// Starts the control socket's thread on `listener`, serving `target`; it
/// ends when `shutdown` is written.
pub(crate) fn spawn(
    listener: UnixListener,
    target: Arc<dyn ControlTarget>,
    shutdown: Arc<EventFd>,
    seccomp: SeccompMode,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vqblk-rpc".into())
        .spawn(move || {
            if let Err(e) = crate::seccomp::apply(ThreadKind::Rpc, seccomp) {
                error!("{e}: the control socket's thread runs without a filter");
            }
            let mut methods = methods::Methods::new(target);
            serve(&listener, &shutdown, |line| handle_line(&mut methods, line));
        })
}

/// A connected client and the part of a line it sent so far.
struct Client {
    stream: UnixStream,
    pending: Vec<u8>,
}

/// The loop of the control thread: accept, read, answer, until `shutdown`.
fn serve(
    listener: &UnixListener,
    shutdown: &EventFd,
    mut handle: impl FnMut(&[u8]) -> Option<Value>,
) {
    let mut clients: Vec<Client> = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let mut fds: Vec<libc::pollfd> = [shutdown.as_raw_fd(), listener.as_raw_fd()]
            .into_iter()
            .chain(clients.iter().map(|c| c.stream.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfds.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            error!("control socket: poll failed: {e}; closing it");
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        // Clients first (their indexes match `fds[2..]`), newest last, so
        // that removing one does not shift the others still to be looked at.
        for i in (0..clients.len()).rev() {
            if fds[2 + i].revents == 0 {
                continue;
            }
            if !serve_client(&mut clients[i], &mut chunk, &mut handle) {
                debug!("control socket: client closed");
                clients.swap_remove(i);
            }
        }
        if fds[1].revents != 0 {
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
                    if clients.len() >= MAX_CLIENTS {
                        let e = RpcError::failed(format!(
                            "too many control clients (at most {MAX_CLIENTS})"
                        ));
                        let _ = send(&stream, &reply(Value::Null, Err(e)));
                    } else {
                        clients.push(Client {
                            stream,
                            pending: Vec::new(),
                        });
                    }
                }
                Err(e) => warn!("control socket: accept failed: {e}"),
            }
        }
    }
}

/// Reads what the client sent and answers every complete line. Returns
/// false when the client is gone (or must be closed).
fn serve_client(
    c: &mut Client,
    chunk: &mut [u8],
    handle: &mut impl FnMut(&[u8]) -> Option<Value>,
) -> bool {
    let n = match c.stream.read(chunk) {
        Ok(0) => return false,
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return true,
        Err(_) => return false,
    };
    c.pending.extend_from_slice(&chunk[..n]);
    let mut start = 0;
    while let Some(end) = c.pending[start..].iter().position(|&b| b == b'\n') {
        let line = &c.pending[start..start + end];
        start += end + 1;
        if line.len() > MAX_REQUEST {
            return refuse_oversized(c);
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if let Some(answer) = handle(line) {
            if send(&c.stream, &answer).is_err() {
                return false;
            }
        }
    }
    c.pending.drain(..start);
    if c.pending.len() > MAX_REQUEST {
        return refuse_oversized(c);
    }
    true
}

fn refuse_oversized(c: &Client) -> bool {
    let e = RpcError::new(
        code::INVALID_REQUEST,
        format!("request longer than {MAX_REQUEST} bytes; closing the connection"),
    );
    let _ = send(&c.stream, &reply(Value::Null, Err(e)));
    false
}

fn send(mut stream: &UnixStream, answer: &Value) -> io::Result<()> {
    let mut line = serde_json::to_vec(answer).map_err(io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)
}

/// A JSON-RPC response object.
fn reply(id: Value, result: Result<Value, RpcError>) -> Value {
    match result {
        Ok(r) => json!({ "jsonrpc": "2.0", "id": id, "result": r }),
        Err(e) => json!({ "jsonrpc": "2.0", "id": id, "error": e.to_json() }),
    }
}

/// Answers one request line (None: a notification, which gets no answer).
fn handle_line(methods: &mut methods::Methods, line: &[u8]) -> Option<Value> {
    let request: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => {
            let e = RpcError::new(code::PARSE_ERROR, format!("parse error: {e}"));
            return Some(reply(Value::Null, Err(e)));
        }
    };
    let (id, method, params) = match parse_request(request) {
        Ok(r) => r,
        Err((id, e)) => return Some(reply(id.unwrap_or(Value::Null), Err(e))),
    };
    let result = methods.call(&method, params);
    if let Err(e) = &result {
        debug!("control socket: {method}: {}", e.message);
    }
    // No id: a notification (JSON-RPC 2.0, section 4.1), done without answer.
    id.map(|id| reply(id, result))
}

type ParsedRequest = (Option<Value>, String, Map<String, Value>);

/// Checks the envelope: `jsonrpc`, `method`, `params` (named only), `id`.
pub(super) fn parse_request(v: Value) -> Result<ParsedRequest, (Option<Value>, RpcError)> {
    let invalid = |m: &str| RpcError::new(code::INVALID_REQUEST, m);
    let mut obj = match v {
        Value::Object(o) => o,
        Value::Array(_) => return Err((None, invalid("batch requests are not supported"))),
        _ => return Err((None, invalid("a request is a JSON object"))),
    };
    let id = obj.remove("id");
    if let Some(bad) = id
        .as_ref()
        .filter(|i| !(i.is_string() || i.is_number() || i.is_null()))
    {
        let e = invalid(&format!("id: {bad} is not a string, a number or null"));
        return Err((None, e));
    }
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err((id, invalid("jsonrpc: must be \"2.0\"")));
    }
    let method = match obj.remove("method") {
        Some(Value::String(m)) => m,
        _ => return Err((id, invalid("method: missing or not a string"))),
    };
    let params = match obj.remove("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(p)) => p,
        Some(_) => {
            let e = RpcError::param("params", "must be an object (named parameters)");
            return Err((id, e));
        }
    };
    Ok((id, method, params))
}
