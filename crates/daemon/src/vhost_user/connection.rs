//! The backend side of one vhost-user connection: vring and memory state,
//! checked message by message, handed to the IOThreads when a ring starts.

use std::fs::File;
use std::io;
use std::sync::mpsc::sync_channel;
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
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryBackend, GuestRegionMmap};

use super::memory::{
    check_disjoint, check_region, seal_against_shrinking, vmm_va_to_gpa, AddrMapping, Sealing,
};
use super::ExportShared;
use crate::dirty_log::DirtyLog;
use crate::inflight::{InflightLayout, InflightRegion};
use crate::iothread::{
    Command, GuestMem, GuestMemHandle, InflightTracking, QueueAttach, QueueKey, QueueLog,
};
use crate::virtio::{features, CONFIG_WRITEBACK_OFFSET};

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
        }
    }

    /// The dirty log queue `index` marks: the mapped log while the frontend
    /// acks VHOST_F_LOG_ALL (vhost-user "Dirty logging"), else None.
    fn queue_log(&self, index: u16) -> Option<QueueLog> {
        if self.acked_features & LOG_ALL == 0 {
            return None;
        }
        self.log.as_ref().map(|log| QueueLog {
            log: log.clone(),
            used: self.vrings[index as usize].log_used,
        })
    }

    /// Tells the IOThreads of every running ring whether to log (and where),
    /// without stopping the rings, and waits until they apply it: the frontend
    /// hears back only then, so no completion after its message goes unmarked.
    fn push_log(&self) {
        let indexes: Vec<u16> = (0..self.vrings.len() as u16)
            .filter(|&i| self.vrings[i as usize].started)
            .collect();
        self.push_log_to(&indexes);
    }

    fn push_log_to(&self, indexes: &[u16]) {
        let (tx, rx) = sync_channel(indexes.len());
        // Routed under the export's lock, held until every switch applies: a
        // queue-move cannot take a ring away between the send and the switch.
        let routes = self.export.map.lock();
        for &index in indexes {
            self.export.iothreads[routes.thread_of(index)].send(Command::SetLog {
                key: self.key(index),
                log: self.queue_log(index),
                applied: tx.clone(),
            });
        }
        drop(tx);
        for _ in indexes {
            if rx.recv_timeout(DRAIN_TIMEOUT).is_err() {
                warn!(
                    "{}: an IOThread did not switch dirty logging in time",
                    self.export.device.name
                );
                return;
            }
        }
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

    /// Checks the regions of a memory message against their files and
    /// against each other's and `existing`'s frontend addresses; returns
    /// `existing` with the new regions' mappings appended.
    fn check_regions(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: &[File],
        existing: Vec<AddrMapping>,
    ) -> VhostResult<Vec<AddrMapping>> {
        let name = self.export.device.name.clone();
        let refuse = |e: super::memory::RegionError| {
            warn!("{name}: memory region refused: {e}");
            invalid(&e.to_string())
        };
        let mut mappings = existing;
        for (i, (r, file)) in regions.iter().zip(files).enumerate() {
            let sealing = check_region(i, r, file).map_err(refuse)?;
            let m = AddrMapping::of(r);
            check_disjoint(i, &m, &mappings).map_err(refuse)?;
            mappings.push(m);
            if sealing == Sealing::Unsealed && !self.told_unsealed {
                self.told_unsealed = true;
                info!(
                    "{}: guest memory region {i} cannot be sealed against shrinking \
                     (file-backed memory): a frontend that truncates it can crash the daemon",
                    name
                );
            }
        }
        Ok(mappings)
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

    fn vmm_va_to_gpa(&self, va: u64) -> VhostResult<u64> {
        vmm_va_to_gpa(&self.mappings, va).ok_or_else(|| {
            invalid(&format!(
                "vring address {va:#x} is not in any memory region"
            ))
        })
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

    /// Attaches a starting ring to the inflight region, if there is one, and
    /// runs the recovery (vhost-user "Inflight I/O tracking"): the ring continues
    /// from the avail index the region proves was reached, which overrides
    /// SET_VRING_BASE (after a backend crash the frontend rebuilds that from the
    /// used index, which out-of-order completions make wrong), and the heads
    /// left in flight go to the IOThread to be executed again first.
    fn attach_inflight(
        &self,
        index: u16,
        queue: &mut Queue,
        used_idx: u16,
    ) -> VhostResult<Option<InflightTracking>> {
        let Some(region) = &self.inflight else {
            return Ok(None);
        };
        let name = &self.export.device.name;
        let layout = region.layout();
        if index >= layout.num_queues() || queue.size() > layout.queue_size() {
            return Err(invalid(&format!(
                "vring {index} of size {} is not covered by the inflight region \
                 ({} queues of {})",
                queue.size(),
                layout.num_queues(),
                layout.queue_size()
            )));
        }
        let (record, recovery) = region.attach_queue(index, used_idx).map_err(|e| {
            warn!("{name}: vring {index}: {e}");
            invalid(&e.to_string())
        })?;
        if queue.next_avail() != recovery.next_avail_idx || !recovery.resubmit.is_empty() {
            info!(
                "{name}: vring {index}: inflight recovery: {} requests to execute again, \
                 next avail index {} (the frontend said {})",
                recovery.resubmit.len(),
                recovery.next_avail_idx,
                queue.next_avail()
            );
        }
        queue.set_next_avail(recovery.next_avail_idx);
        Ok(Some(InflightTracking {
            record,
            resubmit: recovery.resubmit,
        }))
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

    /// An inflight region may describe at most the export's queues, of at most
    /// the largest queue size a ring may have.
    fn check_inflight_shape(&self, num_queues: u16, queue_size: u16) -> VhostResult<()> {
        let max_queue = self.export.max_queue_size;
        if usize::from(num_queues) > self.vrings.len() || queue_size > max_queue {
            return Err(invalid(&format!(
                "inflight region for {num_queues} queues of {queue_size}: the export has {} \
                 queues of at most {max_queue}",
                self.vrings.len()
            )));
        }
        Ok(())
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
    }

    /// Post-copy migration (the frontend wants page faults served) is not
    /// supported: PAGEFAULT is never offered, and a frontend asking anyway is
    /// refused with a clear log line.
    fn refuse_postcopy(&self) -> VhostError {
        warn!(
            "{}: post-copy migration is not supported (use pre-copy live migration)",
            self.export.device.name
        );
        VhostError::InvalidOperation("post-copy migration not supported")
    }

    fn publish_memory(&mut self, mem: GuestMem) {
        // Running IOThreads pick the new map up at their next pass; in-flight
        // requests keep the old one alive through their own Arc.
        self.mem.lock().unwrap().replace(mem);
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
        // The crate already bounds the table (32 regions, one fd each, 4 KiB
        // message); every region is checked against its file before mapping.
        if ctx.len() != files.len() {
            return Err(invalid("one fd per memory region"));
        }
        let mappings = self.check_regions(ctx, &files, Vec::new())?;
        let mut regions = Vec::new();
        for (region, file) in ctx.iter().zip(files) {
            let r = GuestRegionMmap::new(
                region.mmap_region(file)?,
                GuestAddress(region.guest_phys_addr),
            )
            .ok_or_else(|| invalid("memory region overflows"))?;
            regions.push(r);
        }
        let mem = GuestMem::from_regions(regions).map_err(|e| {
            warn!("{}: memory table refused: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        self.publish_memory(mem);
        self.mappings = mappings;
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

    fn set_protocol_features(&mut self, _features: u64) -> VhostResult<()> {
        // The crate keeps the acked set (it decides on REPLY_ACK itself);
        // nothing here depends on it.
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
        self.check_inflight_shape(inflight.num_queues, inflight.queue_size)?;
        let layout = InflightLayout::new(inflight.num_queues, inflight.queue_size)
            .map_err(|e| invalid(&e.to_string()))?;
        let (region, file) = InflightRegion::create(layout).map_err(|e| {
            warn!("{}: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        debug!(
            "{}: inflight region of {} bytes for {} queues of {}",
            self.export.device.name,
            layout.mmap_size(),
            layout.num_queues(),
            layout.queue_size()
        );
        self.inflight = Some(region);
        let reply = VhostUserInflight::new(
            layout.mmap_size(),
            0,
            layout.num_queues(),
            layout.queue_size(),
        );
        Ok((reply, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VhostResult<()> {
        self.owner()?;
        if self.vrings.iter().any(|v| v.started) {
            return Err(invalid("SET_INFLIGHT_FD while rings are running"));
        }
        self.check_inflight_shape(inflight.num_queues, inflight.queue_size)?;
        // Validated before mapping: a short or oversized file is refused, never
        // mapped (touching past its end would raise SIGBUS).
        let region = InflightRegion::from_file(
            &file,
            inflight.mmap_offset,
            inflight.mmap_size,
            inflight.num_queues,
            inflight.queue_size,
        )
        .map_err(|e| {
            warn!("{}: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        self.inflight = Some(region);
        Ok(())
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
        if self.mappings.len() as u64 >= MAX_MEM_SLOTS {
            warn!(
                "{}: memory region refused: all {MAX_MEM_SLOTS} slots are in use",
                self.export.device.name
            );
            return Err(invalid("no free memory slot"));
        }
        let mappings = self.check_regions(
            std::slice::from_ref(region),
            std::slice::from_ref(&fd),
            self.mappings.clone(),
        )?;
        let r = Arc::new(
            GuestRegionMmap::new(
                region.mmap_region(fd)?,
                GuestAddress(region.guest_phys_addr),
            )
            .ok_or_else(|| invalid("memory region overflows"))?,
        );
        let mem = self.mem.memory().insert_region(r).map_err(|e| {
            warn!("{}: memory region refused: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        self.publish_memory(mem);
        self.mappings = mappings;
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VhostResult<()> {
        self.owner()?;
        let (mem, _) = self
            .mem
            .memory()
            .remove_region(GuestAddress(region.guest_phys_addr), region.memory_size)
            .map_err(|e| VhostError::ReqHandlerError(io::Error::other(e)))?;
        self.publish_memory(mem);
        self.mappings
            .retain(|m| m.gpa_base != region.guest_phys_addr);
        Ok(())
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
        let name = &self.export.device.name;
        // The log must cover every guest address the daemon may write.
        let mem_end = self.mem.memory().last_addr().0.saturating_add(1);
        // As for guest memory: sealed against shrinking where possible, then
        // checked against its size, so a truncation cannot SIGBUS the daemon.
        if seal_against_shrinking(&file) == Sealing::Unsealed {
            info!("{name}: the dirty log's file cannot be sealed against shrinking");
        }
        let mapped =
            DirtyLog::map(&file, log.mmap_size, log.mmap_offset, mem_end).map_err(|e| {
                warn!("{name}: SET_LOG_BASE refused: {e}");
                invalid(&e.to_string())
            })?;
        debug!(
            "{name}: dirty log of {} bytes mapped ({} pages of guest memory)",
            log.mmap_size,
            mapped.pages()
        );
        // A new log (QEMU resizes it when memory changes) replaces the old one
        // on every running ring; the old mapping goes with its last holder.
        self.log = Some(Arc::new(mapped));
        self.push_log();
        Ok(())
    }
}
