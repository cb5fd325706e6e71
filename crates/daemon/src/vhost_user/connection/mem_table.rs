//! The guest memory of a connection: the table of SET_MEM_TABLE and the
//! single regions of ADD_MEM_REG / REM_MEM_REG (CONFIGURE_MEM_SLOTS), each
//! region checked against its file and the others before it is mapped
//! ([`crate::vhost_user::memory`]), then published to the IOThreads; and the
//! frontend-address translation of SET_VRING_ADDR.

use std::fs::File;
use std::io;
use std::sync::Arc;

use log::warn;
use vhost::vhost_user::message::{VhostUserMemoryRegion, VhostUserSingleMemoryRegion};
use vhost::vhost_user::{Error as VhostError, Result as VhostResult};
use vm_memory::{
    GuestAddress, GuestAddressSpace, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap,
};

use super::{invalid, Connection, MAX_MEM_SLOTS};
use crate::fault::{self, MappingKind};
use crate::iothread::{Command, GuestMem};
use crate::vhost_user::handover::RegionState;
use crate::vhost_user::memory::{
    check_disjoint, check_region, vmm_va_to_gpa, AddrMapping, RegionError,
};

impl Connection {
    /// SET_MEM_TABLE: replaces guest memory with `regions`, one file each.
    pub(super) fn replace_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
    ) -> VhostResult<()> {
        // The crate already bounds the table (32 regions, one fd each, 4 KiB
        // message); every region is checked against its file before mapping.
        if ctx.len() != files.len() {
            return Err(invalid("one fd per memory region"));
        }
        let mappings = self.check_regions(ctx, &files, Vec::new())?;
        let kept = keep_files(ctx, &files)?;
        let mut regions = Vec::new();
        for (region, file) in ctx.iter().zip(files) {
            let r = GuestRegionMmap::new(
                region.mmap_region(file)?,
                GuestAddress(region.guest_phys_addr),
            )
            .ok_or_else(|| invalid("memory region overflows"))?;
            regions.push(r);
        }
        let mut mem = GuestMem::from_regions(regions).map_err(|e| {
            warn!("{}: memory table refused: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        // Registered before any thread but this one can touch the regions.
        let all: Vec<_> = mem.iter().map(|r| r.start_addr()).collect();
        for start in all {
            self.register_region(&mut mem, start)?;
        }
        self.publish_memory(mem);
        self.mappings = mappings;
        self.region_files = kept;
        Ok(())
    }

    /// ADD_MEM_REG: adds one region to guest memory, in a free slot.
    pub(super) fn add_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
    ) -> VhostResult<()> {
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
        let kept = keep_files(std::slice::from_ref(region), std::slice::from_ref(&fd))?;
        let r = Arc::new(
            GuestRegionMmap::new(
                region.mmap_region(fd)?,
                GuestAddress(region.guest_phys_addr),
            )
            .ok_or_else(|| invalid("memory region overflows"))?,
        );
        let start = r.start_addr();
        let mut mem = self.mem.memory().insert_region(r).map_err(|e| {
            warn!("{}: memory region refused: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        self.register_region(&mut mem, start)?;
        self.publish_memory(mem);
        self.mappings = mappings;
        self.region_files.extend(kept);
        Ok(())
    }

    /// REM_MEM_REG: removes the region at the guest address of `region`.
    pub(super) fn remove_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
    ) -> VhostResult<()> {
        let (mem, _) = self
            .mem
            .memory()
            .remove_region(GuestAddress(region.guest_phys_addr), region.memory_size)
            .map_err(|e| VhostError::ReqHandlerError(io::Error::other(e)))?;
        self.publish_memory(mem);
        self.mappings
            .retain(|m| m.gpa_base != region.guest_phys_addr);
        self.region_files
            .retain(|(r, _)| r.guest_phys_addr != region.guest_phys_addr);
        Ok(())
    }

    /// Checks the regions of a memory message against their files and
    /// against each other's and `existing`'s frontend addresses; returns
    /// `existing` with the new regions' mappings appended.
    pub(super) fn check_regions(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: &[File],
        existing: Vec<AddrMapping>,
    ) -> VhostResult<Vec<AddrMapping>> {
        let name = self.export.device.name.clone();
        let refuse = |e: RegionError| {
            warn!("{name}: memory region refused: {e}");
            invalid(&e.to_string())
        };
        let mut mappings = existing;
        for (i, (r, file)) in regions.iter().zip(files).enumerate() {
            let sealing = check_region(i, r, file).map_err(refuse)?;
            let m = AddrMapping::of(r);
            check_disjoint(i, &m, &mappings).map_err(refuse)?;
            mappings.push(m);
            self.sealing_policy(sealing, &format!("guest memory region {i}"))?;
        }
        Ok(mappings)
    }

    /// Enters the mapping of `mem`'s region at `start` in the fault
    /// handler's registry, for as long as a map holds the region, and makes
    /// `mem` carry this connection's broken flag.
    fn register_region(&self, mem: &mut GuestMem, start: GuestAddress) -> VhostResult<()> {
        let region = mem
            .find_region(start)
            .ok_or_else(|| invalid("memory region vanished"))?;
        let (host, len) = (region.as_ptr(), region.len() as usize);
        let reg =
            fault::register(host, len, MappingKind::GuestMemory, &self.faults).map_err(|e| {
                warn!("{}: memory region refused: {e}", self.export.device.name);
                invalid(&e.to_string())
            })?;
        mem.add_companion(start, Arc::new(reg));
        mem.set_broken_flag(self.faults.broken_flag());
        Ok(())
    }

    pub(super) fn vmm_va_to_gpa(&self, va: u64) -> VhostResult<u64> {
        vmm_va_to_gpa(&self.mappings, va).ok_or_else(|| {
            invalid(&format!(
                "vring address {va:#x} is not in any memory region"
            ))
        })
    }

    /// Replaces the map the IOThreads read, and waits until each thread
    /// serving a ring of this connection has let go of the older map it may
    /// have loaded for its next pass (a kick looked at, or a pass under
    /// way): every request the frontend makes available once answered is
    /// popped with the new map. Requests in flight keep the map they were
    /// popped with alive until they are retired.
    pub(super) fn publish_memory(&mut self, mem: GuestMem) {
        self.mem.lock().unwrap().replace(mem);
        let indexes = self.started_rings();
        self.tell_rings(&indexes, "take the new memory map", |key, applied| {
            Command::NewMemory { key, applied }
        });
    }
}

/// Each region's description with a copy of its fd, kept for an upgrade's
/// handover (the mapping does not keep the file).
fn keep_files(
    regions: &[VhostUserMemoryRegion],
    files: &[File],
) -> VhostResult<Vec<(RegionState, File)>> {
    regions
        .iter()
        .zip(files)
        .map(|(r, f)| {
            let state = RegionState {
                guest_phys_addr: r.guest_phys_addr,
                memory_size: r.memory_size,
                user_addr: r.user_addr,
                mmap_offset: r.mmap_offset,
            };
            Ok((state, f.try_clone().map_err(VhostError::ReqHandlerError)?))
        })
        .collect()
}
