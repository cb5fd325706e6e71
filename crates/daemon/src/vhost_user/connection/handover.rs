//! A connection leaving for the next process of an upgrade, and arriving in
//! it: [`Connection::depart`] drains every ring and takes the state and the
//! fds; [`Connection::restore`] rebuilds the same connection from them,
//! through the checks a frontend's messages go through (memory regions
//! against their files, the inflight region and the dirty log against their
//! shapes), and [`Connection::start_restored`] starts the rings where they
//! stopped.

use std::fs::File;
use std::sync::Arc;

use vhost::vhost_user::message::{VhostUserInflight, VhostUserLog, VhostUserMemoryRegion};
use vhost::vhost_user::Result as VhostResult;

use super::{invalid, Connection, Vring};
use crate::vhost_user::handover::{ConnectionState, VringState};
use crate::vhost_user::ExportShared;

impl Connection {
    /// Stops every ring (each drains: its requests complete and their used
    /// entries are published, as for GET_VRING_BASE) and takes the state and
    /// fds of the connection, in [`ConnectionState`]'s fd order without the
    /// socket. Nothing is in flight afterwards; the connection is left
    /// without rings, memory files or regions to hand over again.
    pub(crate) fn depart(&mut self) -> (ConnectionState, Vec<File>) {
        self.stop_all();
        let mut files = Vec::new();
        let regions = std::mem::take(&mut self.region_files)
            .into_iter()
            .map(|(r, f)| {
                files.push(f);
                r
            })
            .collect();
        let inflight = self.inflight_file.take().map(|(s, f)| {
            files.push(f);
            s
        });
        let log = self.log_file.take().map(|(s, f)| {
            files.push(f);
            s
        });
        let vrings = self
            .vrings
            .iter_mut()
            .map(|v| {
                let kick = v.kick.take();
                let call = v.call.take();
                let state = VringState {
                    size: v.size,
                    desc: v.desc,
                    avail: v.avail,
                    used: v.used,
                    addr_set: v.addr_set,
                    next_avail: v.base,
                    enabled: v.enabled,
                    kick: kick.is_some(),
                    call: call.is_some(),
                    log_used: v.log_used,
                };
                files.extend(kick);
                files.extend(call);
                state
            })
            .collect();
        let state = ConnectionState {
            owned: self.owned,
            acked_features: self.acked_features,
            acked_protocol_features: self.acked_protocol,
            regions,
            inflight,
            log,
            vrings,
        };
        (state, files)
    }

    /// The connection `state` describes, over `files` (in its fd order,
    /// without the socket), for `export`; its rings are set up but not
    /// started (the crate's own feature state is restored first, then
    /// [`Connection::start_restored`]). Refused like the messages it
    /// replaces when a region, the inflight region or the log does not fit.
    pub(crate) fn restore(
        export: Arc<ExportShared>,
        state: &ConnectionState,
        files: Vec<File>,
    ) -> VhostResult<Connection> {
        let mut conn = Connection::new(export);
        if state.vrings.len() != conn.vrings.len() {
            return Err(invalid(&format!(
                "handover of {} vrings to an export of {}",
                state.vrings.len(),
                conn.vrings.len()
            )));
        }
        let mut files = files.into_iter();
        let mut next = |what: &str| files.next().ok_or_else(|| invalid(what));
        conn.owned = state.owned;
        conn.acked_features = state.acked_features;
        conn.acked_protocol = state.acked_protocol_features;
        if !state.regions.is_empty() {
            let ctx: Vec<VhostUserMemoryRegion> = state
                .regions
                .iter()
                .map(|r| {
                    VhostUserMemoryRegion::new(
                        r.guest_phys_addr,
                        r.memory_size,
                        r.user_addr,
                        r.mmap_offset,
                    )
                })
                .collect();
            let region_files = ctx
                .iter()
                .map(|_| next("memory region fd"))
                .collect::<VhostResult<Vec<_>>>()?;
            conn.replace_mem_table(&ctx, region_files)?;
        }
        if let Some(i) = state.inflight {
            let desc =
                VhostUserInflight::new(i.mmap_size, i.mmap_offset, i.num_queues, i.queue_size);
            let file = next("inflight fd")?;
            conn.adopt_inflight(&desc, file)?;
        }
        if let Some(l) = state.log {
            let file = next("log fd")?;
            conn.map_log(&VhostUserLog::new(l.mmap_size, l.mmap_offset), file)?;
        }
        for (v, s) in conn.vrings.iter_mut().zip(&state.vrings) {
            *v = Vring {
                size: s.size,
                desc: s.desc,
                avail: s.avail,
                used: s.used,
                addr_set: s.addr_set,
                base: s.next_avail,
                kick: s.kick.then(|| next("kick fd")).transpose()?,
                call: s.call.then(|| next("call fd")).transpose()?,
                enabled: s.enabled,
                started: false,
                log_used: s.log_used,
            };
        }
        if next("").is_ok() {
            return Err(invalid("handover with more fds than its state names"));
        }
        Ok(conn)
    }

    /// Starts every ring of a restored connection that was running (it has
    /// everything a start needs): at the next avail index the drain stopped
    /// at, the used index read back from guest memory.
    pub(crate) fn start_restored(&mut self) -> VhostResult<()> {
        for i in 0..self.vrings.len() {
            self.maybe_start(i as u16)?;
        }
        Ok(())
    }
}
