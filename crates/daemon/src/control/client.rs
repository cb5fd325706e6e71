//! A client of the control socket, for `vqblk ctl`, `vqblk top` and tests.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

/// How long a call may wait for its answer (`export-del` with `force` waits
/// for the frontend's requests to drain).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be reached, written or read.
    #[error("control socket: {0}")]
    Io(#[from] io::Error),
    /// The answer is not a JSON-RPC response.
    #[error("control socket: bad answer: {0}")]
    Protocol(String),
    /// The daemon answered with an error object.
    #[error("{message} (error {code})")]
    Rpc {
        /// JSON-RPC error code.
        code: i64,
        /// The daemon's message (names the parameter for bad parameters).
        message: String,
    },
}

/// A connection to a control socket.
pub struct ControlClient {
    reader: BufReader<UnixStream>,
    next_id: u64,
}

impl ControlClient {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> io::Result<ControlClient> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(CALL_TIMEOUT))?;
        Ok(ControlClient {
            reader: BufReader::new(stream),
            next_id: 1,
        })
    }

    /// Calls `method` with named `params` (an object, or null for none) and
    /// returns its result.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut req = json!({ "jsonrpc": "2.0", "id": id, "method": method });
        if !params.is_null() {
            req["params"] = params;
        }
        let mut line =
            serde_json::to_vec(&req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        line.push(b'\n');
        self.reader.get_mut().write_all(&line)?;
        let mut answer = String::new();
        if self.reader.read_line(&mut answer)? == 0 {
            return Err(ClientError::Protocol(
                "the daemon closed the connection".into(),
            ));
        }
        let v: Value =
            serde_json::from_str(&answer).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if let Some(e) = v.get("error") {
            return Err(ClientError::Rpc {
                code: e["code"].as_i64().unwrap_or(0),
                message: e["message"].as_str().unwrap_or("").to_string(),
            });
        }
        if v["id"] != json!(id) {
            return Err(ClientError::Protocol(format!(
                "answer to another request: {v}"
            )));
        }
        v.get("result")
            .cloned()
            .ok_or_else(|| ClientError::Protocol(format!("no result: {v}")))
    }
}
