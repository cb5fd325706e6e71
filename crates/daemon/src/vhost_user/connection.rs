//! The backend side of one vhost-user connection: vring state, checked
//! message by message, handed to the IOThreads when a ring starts and taken
//! back when it stops; features, device config and ownership. Guest memory
//! (`mem_table`), the inflight region (`inflight`) and live migration's dirty
//! log (`migration`) have their own files; the message handler below
//! dispatches to them.

use std::fs::File;
use std::io;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use log::{debug, info, warn};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    Backend, Error as VhostError, GpuBackend, Result as VhostResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace};

use super::handover::{InflightState, LogState, RegionState};
use super::memory::{AddrMapping, Sealing};
use super::ExportShared;
use crate::dirty_log::DirtyLog;
use crate::fault::{FaultOwner, MemorySealing};
use crate::inflight::InflightRegion;
use crate::iothread::{Command, GuestMem, GuestMemHandle, QueueAttach, QueueKey};
use crate::virtio::{features, CONFIG_WRITEBACK_OFFSET};

mod handover;
mod inflight;
mod mem_table;
mod migration;

/// Memory slots we accept with CONFIGURE_MEM_SLOTS (QEMU's vhost-user limit is 509 too).
const MAX_MEM_SLOTS: u64 = 509;
/// How long GET_VRING_BASE waits for a queue's in-flight requests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Vring {
    /// Set by a valid SET_VRING_NUM; 0 (unset, or refused) keeps the ring
    /// from starting.
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    addr_set: bool,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    enabled: bool,
    /// Owned by an IOThread right now.
    started: bool,
    /// Guest address to log the used ring at (SET_VRING_ADDR with
    /// VHOST_VRING_F_LOG), None without the flag.
    log_used: Option<u64>,
}

/// The backend side of one vhost-user connection.
pub struct Connection {
    export: Arc<ExportShared>,
    mem: GuestMemHandle,
    mappings: Vec<AddrMapping>,
    vrings: Vec<Vring>,
    owned: bool,
    acked_features: u64,
    /// A region that cannot be sealed against shrinking was logged already.
    told_unsealed: bool,
    /// The inflight region (INFLIGHT_SHMFD): from GET_INFLIGHT_FD or
    /// SET_INFLIGHT_FD; rings started while it is set are tracked in it.
    inflight: Option<InflightRegion>,
    /// The migration dirty log of the last SET_LOG_BASE; the IOThreads
    /// mark it while VHOST_F_LOG_ALL is acked.
    log: Option<Arc<DirtyLog>>,
    /// This connection's side of the fault handler: every mapping the
    /// frontend handed over is registered for it (`crate::fault`).
    faults: Arc<FaultOwner>,
    /// Why the connection must be closed after the current message (memory
    /// refused under `memory-sealing = required`).
    closing: Option<String>,
    /// What an upgrade hands to the next process with the mappings above
    /// (`handover`): each memory region's description and file, in table
    /// order; the inflight region's and the dirty log's.
    region_files: Vec<(RegionState, File)>,
    inflight_file: Option<(InflightState, File)>,
    log_file: Option<(LogState, File)>,
    /// SET_PROTOCOL_FEATURES, if received (the crate keeps its own copy for
    /// its checks; a successor's copy is restored from this).
    acked_protocol: Option<u64>,
}

/// VHOST_F_LOG_ALL: the frontend wants dirty pages logged (vhost-user
/// "Migration"); offered on top of the device's virtio features.
const LOG_ALL: u64 = VhostUserVirtioFeatures::LOG_ALL.bits();

/// A refusal by this handler: the crate answers it with a failing REPLY_ACK
/// (when the frontend asked for one), and the session logs it.
fn invalid(msg: &str) -> VhostError {
    VhostError::ReqHandlerError(io::Error::new(io::ErrorKind::InvalidInput, msg))
}

impl Connection {
    /// A fresh connection state for `export`.
    pub fn new(export: Arc<ExportShared>) -> Self {
        let n = export.map.num_queues() as usize;
        Connection {
            export,
            mem: GuestMemHandle::new(GuestMem::default()),
            mappings: Vec::new(),
            vrings: (0..n).map(|_| Vring::default()).collect(),
            owned: false,
            acked_features: 0,
            told_unsealed: false,
            inflight: None,
            log: None,
            faults: FaultOwner::new(),
            closing: None,
            region_files: Vec::new(),
            inflight_file: None,
            log_file: None,
            acked_protocol: None,
        }
    }

    /// The eventfd the fault handler writes when it breaks this connection's
    /// memory: the session waits on it with the socket.
    pub fn fault_wake_fd(&self) -> Option<i32> {
        self.faults.wake_fd()
    }

    /// Why this connection must be closed now, if it must: a fault broke its
    /// memory, or memory it was handed was refused under
    /// `memory-sealing = required`.
    pub fn closing(&self) -> Option<String> {
        if let Some(f) = self.faults.fault() {
            return Some(format!("memory fault: {f}"));
        }
        self.closing.clone()
    }

    /// Applies the memory-sealing policy to a file the frontend handed over
    /// (`what` names it for the log): under `required`, an unsealable file
    /// is refused and the connection closed after this message; otherwise it
    /// is said once per connection.
    fn sealing_policy(&mut self, sealing: Sealing, what: &str) -> VhostResult<()> {
        if sealing != Sealing::Unsealed {
            return Ok(());
        }
        if self.export.memory_sealing == MemorySealing::Required {
            let why = format!(
                "{what} cannot be sealed against shrinking (memory-sealing = required); \
                 the frontend must share it as a sealable memfd (QEMU: memory-backend-memfd)"
            );
            // The session logs the refusal and the disconnection.
            self.closing = Some(why.clone());
            return Err(invalid(&why));
        }
        if !self.told_unsealed {
            self.told_unsealed = true;
            info!(
                "{}: {what} cannot be sealed against shrinking: a frontend that \
                 truncates it ends its own connection (memory-sealing = preferred)",
                self.export.device.name
            );
        }
        Ok(())
    }

    /// Device setup (memory, vrings, config writes) needs SET_OWNER first
    /// (vhost-user spec: SET_OWNER makes this frontend the owner of the
    /// session); feature negotiation may come before it, as QEMU does.
    fn owner(&self) -> VhostResult<()> {
        if self.owned {
            Ok(())
        } else {
            Err(VhostError::InvalidOperation(
                "device setup before SET_OWNER",
            ))
        }
    }

    fn vring(&mut self, index: u32) -> VhostResult<&mut Vring> {
        self.vrings
            .get_mut(index as usize)
            .ok_or_else(|| invalid(&format!("vring {index} out of range")))
    }

    fn key(&self, queue: u16) -> QueueKey {
        QueueKey {
            export: self.export.index,
            queue,
        }
    }

    /// The rings an IOThread serves now.
    fn started_rings(&self) -> Vec<u16> {
        (0..self.vrings.len() as u16)
            .filter(|&i| self.vrings[i as usize].started)
            .collect()
    }

    /// Sends the IOThread of each ring in `indexes` the command `command`
    /// makes for the ring's key and a sender, and waits until each has
    /// answered through it (to `what`): a change the frontend is answered
    /// about only once every thread applies it.
    fn tell_rings(
        &self,
        indexes: &[u16],
        what: &str,
        command: impl Fn(QueueKey, SyncSender<()>) -> Command,
    ) {
        let (tx, rx) = sync_channel(indexes.len());
        // Routed under the export's lock, held until every thread answers: a
        // queue-move cannot take a ring away between the send and the answer.
        let routes = self.export.map.lock();
        for &index in indexes {
            self.export.iothreads[routes.thread_of(index)]
                .send(command(self.key(index), tx.clone()));
        }
        drop(tx);
        for _ in indexes {
            if rx.recv_timeout(DRAIN_TIMEOUT).is_err() {
                warn!(
                    "{}: an IOThread did not {what} in time",
                    self.export.device.name
                );
                return;
            }
        }
    }

    /// Starts the ring if it has everything (vhost-user spec: a ring starts
    /// when its kick fd arrives, and processes only while enabled).
    fn maybe_start(&mut self, index: u16) -> VhostResult<()> {
        let event_idx = self.acked_features & features::RING_EVENT_IDX != 0;
        let protocol = self.acked_features & features::VHOST_USER_PROTOCOL_FEATURES != 0;
        let v = &mut self.vrings[index as usize];
        // Without PROTOCOL_FEATURES rings are enabled as soon as they start.
        let enabled = v.enabled || !protocol;
        // No valid SET_VRING_NUM yet (or the last one was refused): the ring
        // waits; it must not start at the queue's default size.
        if v.started || !enabled || v.kick.is_none() || !v.addr_set || v.size == 0 {
            return Ok(());
        }
        let mut queue =
            Queue::new(self.export.max_queue_size).map_err(|_| invalid("queue size"))?;
        queue.set_size(v.size);
        if queue.size() != v.size {
            return Err(invalid(&format!("vring {index}: size {} refused", v.size)));
        }
        // The crate's `set_*_address` would log a misaligned address and keep
        // the old one (0): the ring would run on guest address 0. Refuse it.
        let misaligned = |what: &str, e| invalid(&format!("vring {index}: {what}: {e}"));
        queue
            .try_set_desc_table_address(GuestAddress(v.desc))
            .map_err(|e| misaligned("descriptor table", e))?;
        queue
            .try_set_avail_ring_address(GuestAddress(v.avail))
            .map_err(|e| misaligned("avail ring", e))?;
        queue
            .try_set_used_ring_address(GuestAddress(v.used))
            .map_err(|e| misaligned("used ring", e))?;
        queue.set_event_idx(event_idx);
        queue.set_next_avail(v.base);
        let mem = self.mem.memory();
        // The used index lives in guest memory: continue from it (after a
        // reconnection the frontend's SET_VRING_BASE only restores avail).
        let used_idx = queue
            .used_idx(&*mem, std::sync::atomic::Ordering::Acquire)
            .map_err(|_| invalid(&format!("vring {index}: used ring not in guest memory")))?;
        queue.set_next_used(used_idx.0);
        queue.set_ready(true);
        if !queue.is_valid(&*mem) {
            return Err(invalid(&format!(
                "vring {index}: addresses or size invalid for guest memory"
            )));
        }
        let inflight = self.attach_inflight(index, &mut queue, used_idx.0)?;
        let v = &mut self.vrings[index as usize];
        let kick = v
            .kick
            .as_ref()
            .unwrap()
            .try_clone()
            .map_err(VhostError::ReqHandlerError)?;
        let call = v
            .call
            .as_ref()
            .map(File::try_clone)
            .transpose()
            .map_err(VhostError::ReqHandlerError)?;
        v.started = true;
        let attach = QueueAttach {
            key: self.key(index),
            queue,
            kick,
            call,
            mem: self.mem.clone(),
            device: self.export.device.clone(),
            inflight,
            log: self.queue_log(index),
        };
        // Routed under the export's lock: a queue-move waits for the ring
        // to reach its owner's channel.
        let export = self.export.clone();
        let routes = export.map.lock();
        let owner = routes.thread_of(index);
        debug!(
            "{}: vring {index} started on IOThread {owner}",
            export.device.name
        );
        export.iothreads[owner].send(Command::Attach(Box::new(attach)));
        Ok(())
    }

    /// Stops the ring if an IOThread owns it, waiting for its requests, and
    /// records where it stopped.
    fn stop(&mut self, index: u16) {
        if !self.vrings[index as usize].started {
            return;
        }
        let (tx, rx) = sync_channel(1);
        // The export's lock is held until the drain is answered: a
        // queue-move cannot take the ring away meanwhile.
        let export = self.export.clone();
        let routes = export.map.lock();
        export.iothreads[routes.thread_of(index)].send(Command::Detach {
            key: self.key(index),
            reply: tx,
        });
        let v = &mut self.vrings[index as usize];
        v.started = false;
        match rx.recv_timeout(DRAIN_TIMEOUT) {
            Ok(next_avail) => v.base = next_avail,
            Err(_) => warn!(
                "{}: vring {index} did not drain in time",
                self.export.device.name
            ),
        }
        drop(routes);
    }

    /// Stops every ring (disconnect, reset).
    pub fn stop_all(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop(i as u16);
        }
    }

    fn reset(&mut self) {
        self.stop_all();
        for v in &mut self.vrings {
            *v = Vring::default();
        }
        self.acked_features = 0;
        // A reset device starts over with a fresh region (QEMU frees its copy).
        self.inflight = None;
        self.log = None;
        self.inflight_file = None;
        self.log_file = None;
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.stop_all();
    }
}

impl VhostUserBackendReqHandlerMut for Connection {
    fn set_owner(&mut self) -> VhostResult<()> {
        if self.owned {
            return Err(VhostError::InvalidOperation("already claimed"));
        }
        self.owned = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VhostResult<()> {
        self.reset();
        self.owned = false;
        Ok(())
    }

    fn reset_device(&mut self) -> VhostResult<()> {
        self.reset();
        Ok(())
    }

    fn get_features(&mut self) -> VhostResult<u64> {
        Ok(self.export.geometry.features() | LOG_ALL)
    }

    fn set_features(&mut self, features: u64) -> VhostResult<()> {
        if features & !(self.export.geometry.features() | LOG_ALL) != 0 {
            return Err(invalid(&format!(
                "frontend acked unknown features {features:#x}"
            )));
        }
        let logging = (self.acked_features ^ features) & LOG_ALL != 0;
        self.acked_features = features;
        // vhost-user "Migration": logging is on while VHOST_F_LOG_ALL is
        // acked; QEMU switches it with SET_FEATURES on running rings.
        if logging {
            info!(
                "{}: dirty logging {} (live migration)",
                self.export.device.name,
                if features & LOG_ALL != 0 { "on" } else { "off" }
            );
            self.push_log();
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy: Option<bool>,
    ) -> VhostResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        self.owner()?;
        if postcopy.is_some() {
            return Err(self.refuse_postcopy());
        }
        self.replace_mem_table(ctx, files)?;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhostResult<()> {
        self.owner()?;
        let max = self.export.max_queue_size as u32;
        let v = self.vring(index)?;
        if num == 0 || num > max || !num.is_power_of_two() {
            // The ring stays unstartable until a valid size arrives.
            v.size = 0;
            return Err(invalid(&format!(
                "vring {index}: size {num} is not a power of two in 1..={max}"
            )));
        }
        v.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> VhostResult<()> {
        self.owner()?;
        self.vring(index)?;
        let (d, u, a) = (
            self.vmm_va_to_gpa(descriptor)?,
            self.vmm_va_to_gpa(used)?,
            self.vmm_va_to_gpa(available)?,
        );
        // vhost-user "Dirty logging": with VHOST_VRING_F_LOG the used ring's
        // writes are logged at `log` (a guest-physical address). QEMU sends
        // this again on running rings when a migration starts and ends.
        let log_used = flags
            .contains(VhostUserVringAddrFlags::VHOST_VRING_F_LOG)
            .then_some(log);
        let v = self.vring(index)?;
        // Virtio 1.2, 2.7 (virtqueue alignment): descriptor table 16 bytes,
        // avail ring 2, used ring 4. A refused address leaves the ring
        // unstartable until a valid SET_VRING_ADDR.
        v.addr_set = false;
        for (what, addr, align) in [
            ("descriptor table", d, 16),
            ("avail ring", a, 2),
            ("used ring", u, 4),
        ] {
            if addr % align != 0 {
                return Err(invalid(&format!(
                    "vring {index}: {what} address {addr:#x} is not {align}-byte aligned"
                )));
            }
        }
        let relog = v.started && v.log_used != log_used;
        (v.desc, v.used, v.avail, v.addr_set, v.log_used) = (d, u, a, true, log_used);
        if relog {
            self.push_log_to(&[index as u16]);
        }
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhostResult<()> {
        self.owner()?;
        self.vring(index)?.base = base as u16;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhostResult<VhostUserVringState> {
        // Out of range: no reply can say so; the session closes the connection.
        self.vring(index)?;
        // vhost-user spec: the backend stops the ring on GET_VRING_BASE.
        self.stop(index as u16);
        let v = self.vring(index)?;
        v.kick = None;
        v.call = None;
        v.enabled = false;
        Ok(VhostUserVringState::new(index, v.base as u32))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        self.owner()?;
        let idx = index as u16;
        // A new kick fd for a running ring: restart it with the new fd.
        self.vring(index as u32)?;
        self.stop(idx);
        self.vrings[idx as usize].kick = fd;
        self.maybe_start(idx)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        self.owner()?;
        let started = self.vring(index as u32)?.started;
        if started {
            let call = fd
                .as_ref()
                .map(File::try_clone)
                .transpose()
                .map_err(VhostError::ReqHandlerError)?;
            let routes = self.export.map.lock();
            self.export.iothreads[routes.thread_of(index as u16)].send(Command::SetCall {
                key: self.key(index as u16),
                call,
            });
        }
        self.vrings[index as usize].call = fd;
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VhostResult<()> {
        self.owner()?;
        self.vring(index as u32)?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhostResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            // Not PAGEFAULT: post-copy migration is not supported.
            | VhostUserProtocolFeatures::LOG_SHMFD)
    }

    fn set_protocol_features(&mut self, features: u64) -> VhostResult<()> {
        // The crate keeps the acked set (it decides on REPLY_ACK itself);
        // only an upgrade's handover needs it here.
        self.acked_protocol = Some(features);
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhostResult<u64> {
        Ok(self.vrings.len() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhostResult<()> {
        self.owner()?;
        self.vring(index)?.enabled = enable;
        if enable {
            self.maybe_start(index as u16)
        } else {
            self.stop(index as u16);
            Ok(())
        }
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<Vec<u8>> {
        let writeback = !self.export.device.writethrough();
        let cfg = self.export.geometry.config_space(writeback);
        let cfg = cfg.bytes();
        let (o, s) = (offset as usize, size as usize);
        // Reads past our struct return zeroes, like a device with a longer config.
        let mut out = vec![0u8; s];
        if o < cfg.len() {
            let n = s.min(cfg.len() - o);
            out[..n].copy_from_slice(&cfg[o..o + n]);
        }
        Ok(out)
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<()> {
        self.owner()?;
        // Only the writeback byte is writable (virtio spec 5.2.5, CONFIG_WCE).
        if offset as usize == CONFIG_WRITEBACK_OFFSET && buf.len() == 1 {
            let writethrough = buf[0] == 0;
            self.export.device.set_writethrough(writethrough);
            info!(
                "{}: guest set cache mode to {}",
                self.export.device.name,
                if writethrough {
                    "writethrough"
                } else {
                    "writeback"
                }
            );
            return Ok(());
        }
        Err(invalid(&format!(
            "config write of {} bytes at {offset} refused",
            buf.len()
        )))
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VhostResult<()> {
        Err(VhostError::InvalidOperation("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhostResult<File> {
        Err(VhostError::InvalidOperation("shared objects not supported"))
    }

    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> VhostResult<(VhostUserInflight, File)> {
        self.owner()?;
        self.create_inflight(inflight)
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VhostResult<()> {
        self.owner()?;
        self.adopt_inflight(inflight, file)
    }

    fn get_max_mem_slots(&mut self) -> VhostResult<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy: Option<bool>,
    ) -> VhostResult<Option<VhostUserMemoryRegionBase>> {
        self.owner()?;
        if postcopy.is_some() {
            return Err(self.refuse_postcopy());
        }
        self.add_region(region, fd)?;
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VhostResult<()> {
        self.owner()?;
        self.remove_region(region)
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhostResult<Option<File>> {
        Err(VhostError::InvalidOperation(
            "device state transfer not supported",
        ))
    }

    fn check_device_state(&mut self) -> VhostResult<()> {
        Err(VhostError::InvalidOperation(
            "device state transfer not supported",
        ))
    }

    fn get_shmem_config(&mut self) -> VhostResult<VhostUserShMemConfig> {
        Err(VhostError::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VhostResult<()> {
        self.owner()?;
        self.map_log(log, file)
    }
}
