//! The daemon as the control socket sees it: [`ControlTarget`] over
//! [`DaemonState`], and the daemon's errors as the control socket's refusals
//! (each naming the parameter at fault, or a failure).

use std::sync::atomic::Ordering;

use super::queue_move::MoveError;
use super::{DaemonError, DaemonState, DelError, ExportLimits};
use crate::config::ExportConfig;
use crate::control::{
    ControlTarget, ExportView, IoThreadView, QueueMoved, RpcError, ShareView, ThrottleGroupView,
    TuneView,
};
use crate::iothread::Command;
use crate::poll::{PollMode, PollParams};
use crate::qos::ThrottleLimits;
use crate::stats::DaemonSnapshot;

impl ControlTarget for DaemonState {
    fn set_tune(&self, export: &str, on: bool) -> Result<(), RpcError> {
        let Some(t) = &self.tuning else {
            return Err(RpcError::failed(
                "the IOThread pool is not tuned online (start with --iothreads auto)",
            ));
        };
        if !self
            .exports
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.name == export)
        {
            return Err(RpcError::param(
                "export",
                format!("no export is named {export:?}"),
            ));
        }
        t.set(export, on);
        log::info!(
            "autotune: export {export}: tuning {}",
            if on { "on" } else { "off" }
        );
        Ok(())
    }

    fn tune(&self) -> Option<TuneView> {
        let t = self.tuning.as_ref()?;
        let exports = self.exports.lock().unwrap();
        Some(TuneView {
            max_active: t.params.max_active,
            on: exports
                .iter()
                .filter(|e| t.is_on(&e.name))
                .map(|e| e.name.clone())
                .collect(),
            moves: t.moves(),
            failed: t.failed(),
            recent: t.recent(),
        })
    }

    fn stats(&self) -> DaemonSnapshot {
        DaemonState::stats(self)
    }

    fn iothreads(&self) -> Vec<IoThreadView> {
        self.info
            .iter()
            .map(|i| IoThreadView {
                cpus: i.cpus.clone(),
                poll: *i.poll.lock().unwrap(),
            })
            .collect()
    }

    fn exports(&self) -> Vec<ExportView> {
        let shares = self.shares.board.reading();
        let exports = self.exports.lock().unwrap();
        exports
            .iter()
            .map(|e| ExportView {
                share: shares
                    .exports
                    .iter()
                    .find(|(name, _, _)| *name == e.name)
                    .map(|(_, device, cap)| ShareView {
                        device: device.clone(),
                        cap_iops: *cap,
                        device_capacity_iops: shares
                            .devices
                            .iter()
                            .find(|(d, _)| d == device)
                            .and_then(|(_, c)| *c),
                    }),
                name: e.name.clone(),
                socket: e.socket.clone(),
                config: e.config.clone(),
                size_bytes: e.device.disk.size(),
                map: e.map(),
                connected: e.connected.load(Ordering::Acquire),
                limits: match &e.limits {
                    ExportLimits::Own(l) => Some(*l),
                    _ => None,
                },
                throttle_group: match &e.limits {
                    ExportLimits::Group(g) => Some(g.clone()),
                    _ => None,
                },
            })
            .collect()
    }

    fn set_poll(&self, id: usize, mode: PollMode, params: PollParams) {
        let mut current = self.info[id].poll.lock().unwrap();
        self.iothreads[id].send(Command::SetPoll { mode, params });
        *current = (mode, params);
    }

    fn add_export(&self, config: &ExportConfig) -> Result<String, RpcError> {
        DaemonState::add_export(self, config).map_err(|e| match e {
            DaemonError::Config(e) => RpcError::param(&e.field, e.message),
            e => RpcError::failed(e.to_string()),
        })
    }

    fn del_export(&self, name: &str, force: bool) -> Result<(), RpcError> {
        DaemonState::del_export(self, name, force).map_err(|e| match e {
            DelError::NoSuchExport(_) => RpcError::param("name", e),
            DelError::InUse(_) => RpcError::failed(e.to_string()),
        })
    }

    fn move_queue(
        &self,
        export: &str,
        queue: u16,
        iothread: usize,
    ) -> Result<QueueMoved, RpcError> {
        match DaemonState::move_queue(self, export, queue, iothread) {
            Ok(m) => Ok(m),
            Err(e @ MoveError::UnknownExport { .. }) => Err(RpcError::param("export", e)),
            Err(e @ MoveError::Queue { .. }) => Err(RpcError::param("queue", e)),
            Err(e @ MoveError::IoThread { .. }) => Err(RpcError::param("iothread", e)),
            Err(e) => Err(RpcError::failed(e.to_string())),
        }
    }

    fn set_io_throttle(
        &self,
        export: &str,
        limits: ThrottleLimits,
        group: Option<&str>,
    ) -> Result<(), RpcError> {
        self.set_export_limits(export, limits, group)
            .map_err(|e| RpcError::param(&e.field, e.message))
    }

    fn set_share(
        &self,
        export: &str,
        reservation_iops: Option<u64>,
        weight: Option<u32>,
    ) -> Result<(), RpcError> {
        self.set_export_share(export, reservation_iops, weight)
            .map_err(|e| RpcError::param(&e.field, e.message))
    }

    fn set_throttle_group(&self, name: &str, limits: ThrottleLimits) -> Result<(), RpcError> {
        self.set_group_limits(name, limits)
            .map_err(|e| RpcError::param(&e.field, e.message))
    }

    fn throttle_groups(&self) -> Vec<ThrottleGroupView> {
        self.groups_view()
            .into_iter()
            .map(|(name, limits, members)| ThrottleGroupView {
                name,
                limits,
                members,
            })
            .collect()
    }
}
