//! An in-process daemon with a control socket, and calls on that socket
//! through the daemon's own client (the one `vqblk ctl` uses).

use std::path::{Path, PathBuf};

use serde_json::Value;
use vqblk_daemon::config::{ControlConfig, ExportConfig, ServeConfig, ThrottleGroupConfig};
use vqblk_daemon::control::client::{ClientError, ControlClient};
use vqblk_daemon::daemon::Daemon;

/// A daemon over 2 IOThreads (so an export's queues live on both) with
/// `exports`, the throttle groups `groups` and a control socket in `dir`;
/// returns the daemon and the control socket's path.
pub fn start_with_control(
    dir: &Path,
    exports: Vec<ExportConfig>,
    groups: Vec<ThrottleGroupConfig>,
) -> (Daemon, PathBuf) {
    let _ = vqblk_daemon::cli::init_logging("warn");
    let control = dir.join("control.sock");
    let mut cfg = ServeConfig {
        exports,
        control: Some(ControlConfig {
            socket: control.clone(),
            mode: None,
        }),
        throttle_groups: groups,
        ..Default::default()
    };
    cfg.iothreads.count = 2;
    (Daemon::start(&cfg).expect("daemon starts"), control)
}

/// One call on a fresh connection.
pub fn call(control: &Path, method: &str, params: Value) -> Result<Value, ClientError> {
    ControlClient::connect(control)
        .unwrap()
        .call(method, params)
}

/// The result of a call that must succeed.
pub fn ok(control: &Path, method: &str, params: Value) -> Value {
    call(control, method, params).unwrap_or_else(|e| panic!("{method}: {e}"))
}

/// The error object (code, message) of a call that must fail.
pub fn rpc_err(control: &Path, method: &str, params: Value) -> (i64, String) {
    match call(control, method, params) {
        Err(ClientError::Rpc { code, message }) => (code, message),
        other => panic!("{method}: expected an error, got {other:?}"),
    }
}
