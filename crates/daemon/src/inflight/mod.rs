//! Inflight I/O tracking: the shared region that lets a restarted daemon resubmit
//! exactly the requests a dead one had popped but not completed (vhost-user
//! specification, "Inflight I/O tracking", protocol feature
//! `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`, messages `GET_INFLIGHT_FD` and
//! `SET_INFLIGHT_FD`).
//!
//! This module is the region logic alone: layout, validation of a region the
//! frontend hands back, the data-path bookkeeping and the recovery algorithm. It knows
//! no socket, no virtqueue and no thread; the vhost-user handler and the IOThread
//! call it.
//!
//! # Layout (split virtqueues)
//!
//! The region is one block per queue, back to back, queue `i` at
//! `i * queue_region_size(queue_size)`. A queue block is a 16-byte header followed by
//! one 16-byte state per descriptor of the queue, all fields native-endian:
//!
//! | offset | field             | meaning                                                  |
//! |--------|-------------------|----------------------------------------------------------|
//! | 0      | `u64 features`    | must be 0                                                |
//! | 8      | `u16 version`     | 0 = never initialised, 1 = this layout                   |
//! | 10     | `u16 desc_num`    | number of descriptor states (the queue size)             |
//! | 12     | `u16 last_batch_head` | head of the list of the last used batch              |
//! | 14     | `u16 used_idx`    | used-ring `idx` once the last batch was fully recorded  |
//! | 16 + 16*i | descriptor `i`: `u8 inflight`, 5 bytes padding, `u16 next`, `u64 counter` | |
//!
//! The block is rounded up to 64 bytes (a cache line, so that two queues served by
//! two IOThreads never share one). This is the same per-queue size that
//! libvhost-user and DPDK compute (their formula `align64(16 * n + 2)` equals
//! `align64(16 + 16 * n)` for every `n`), so the region QEMU keeps is laid out the
//! way any backend of the specification expects. QEMU itself never looks inside:
//! it only keeps the memfd and hands it back.
//!
//! # What is written when (per queue, one writer: the IOThread owning the queue)
//!
//! When a head `i` is popped from the available ring, *before* the request is
//! executed ([`InflightQueue::begin`]):
//! 1. `desc[i].counter = counter; counter += 1` (the counter is private, the value
//!    in the region is the record);
//! 2. `desc[i].inflight = 1`.
//!
//! When used entries are supplied, for a batch of one or more heads:
//! 1. for each head `i` of the batch ([`InflightQueue::stage_used`]):
//!    `desc[i].next = last_batch_head; last_batch_head = i`;
//! 2. the caller writes the used elements and publishes the used ring's `idx`
//!    **once for the whole batch** (one store of `idx`);
//! 3. ([`InflightQueue::commit_used`]) `desc[i].inflight = 0` for each head of the
//!    batch, then `used_idx = idx`.
//!
//! All stores into the region are atomic `Release` stores, which keeps them in
//! program order with respect to each other and to the queue layer's `Release`
//! store of the used `idx` (neither the compiler nor the CPU may move an earlier
//! store after a later `Release` store). A process that is killed stops at an
//! instruction boundary and every store before that boundary reaches the shared
//! memory; so a crash leaves the region in exactly one of the states between two
//! consecutive stores of the sequence above.
//!
//! # Why every crash point is recoverable
//!
//! On reconnect ([`InflightRegion::attach_queue`]) the backend reads the used
//! ring's `idx` and runs the specification's recovery:
//! - if the region's `used_idx` differs from the ring's `idx`, the crash landed
//!   between publishing a batch (step 2) and recording it (end of step 3): the
//!   difference is the batch size, the batch is the first that many entries of the
//!   list from `last_batch_head`, and their `inflight` flags are cleared (again,
//!   harmlessly, if some already were); then `used_idx = idx`;
//! - every descriptor still flagged in flight is resubmitted, in `counter` order,
//!   i.e. the order the dead process popped them.
//!
//! Crash points, in order:
//! - during `begin` before `inflight = 1`: the head is not recorded; it is not
//!   counted either when the next available index is recomputed
//!   (`used idx + heads in flight`), so it is popped again from the available ring;
//! - after `begin`: recorded, resubmitted;
//! - during staging (step 1) or while writing used elements without publishing
//!   `idx`: the guest saw nothing; `used_idx` still equals the ring, the list is
//!   ignored, the heads are still flagged and resubmitted;
//! - after publishing `idx`, during or before step 3: the guest saw the batch;
//!   `used_idx` lags by the batch size, the batch's flags are cleared, none of it
//!   is executed again;
//! - after step 3: consistent.
//!
//! Publishing a batch with one store of `idx` matters: if `idx` moved in several
//! steps for one staged list, a crash between them would make recovery take the
//! *last* staged heads as published. With `virtio-queue`'s `add_used` (one `idx`
//! store per element) a batch is therefore one head: `stage_used`, `add_used`,
//! `commit_used`.
//!
//! Two rules for the caller follow from the recomputed available index: every head
//! that is popped goes through [`InflightQueue::begin`] before it is executed, and
//! every used element goes through [`InflightQueue::stage_used`] (error
//! completions included). Resubmitted heads keep their record (flag and counter)
//! and must not be begun again; they are completed like any other head.
//!
//! # Trust
//!
//! The frontend owns the memfd and can write into it at any time. Nothing read
//! from the region is trusted beyond memory safety: sizes come from the validated
//! layout, every head read from the region is bounds-checked against the queue
//! size, list walks are bounded by the batch size, and the data path reads
//! nothing from the region except the `next` links of its own batch.

mod queue;
#[cfg(test)]
mod tests;

pub use queue::InflightQueue;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

#[cfg(test)]
use vm_memory::VolatileMemory;
use vm_memory::{FileOffset, MmapRegion};

use crate::fault::{self, FaultOwner, MappingKind, Registration, RegistryFull};

/// Region format version written in each queue header (the specification's 1).
pub const REGION_VERSION: u16 = 1;
/// Size of a queue header: `features`, `version`, `desc_num`, `last_batch_head`,
/// `used_idx`.
pub const QUEUE_HEADER_SIZE: u64 = 16;
/// Size of one descriptor state: `inflight`, padding, `next`, `counter`.
pub const DESC_STATE_SIZE: u64 = 16;
/// Alignment of each queue block inside the region.
pub const QUEUE_ALIGN: u64 = 64;
/// Largest split virtqueue size (virtio 1.2, 2.7: "Queue Size ... 32768").
pub const MAX_QUEUE_SIZE: u16 = 32768;

// Field offsets inside a queue block.
const OFF_FEATURES: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
// Field offsets inside a descriptor state.
const DESC_OFF_INFLIGHT: usize = 0;
const DESC_OFF_NEXT: usize = 6;
const DESC_OFF_COUNTER: usize = 8;

/// Errors of the inflight region: a bad region or description from the frontend,
/// or a failure to create or map the memfd.
#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    /// The description names no queue.
    #[error("inflight region: num_queues is 0 (expected at least 1)")]
    NoQueues,
    /// The queue size is 0 or larger than a split virtqueue can be.
    #[error("inflight region: queue_size {0} is not in 1..={MAX_QUEUE_SIZE}")]
    QueueSize(u16),
    /// `mmap_size` is not the size this layout needs (short, or oversized: a
    /// different layout whose queue blocks would sit elsewhere).
    #[error(
        "inflight region: mmap_size {given} is not the {expected} bytes that \
         {num_queues} queues of {queue_size} descriptors take"
    )]
    SizeMismatch {
        /// `mmap_size` as given.
        given: u64,
        /// The size the layout needs.
        expected: u64,
        /// `num_queues` as given.
        num_queues: u16,
        /// `queue_size` as given.
        queue_size: u16,
    },
    /// `mmap_offset` cannot be mapped (mmap needs a page-aligned offset).
    #[error("inflight region: mmap_offset {0} is not a multiple of the page size")]
    Offset(u64),
    /// The file is shorter than `mmap_offset + mmap_size`: touching the end of the
    /// mapping would raise SIGBUS.
    #[error("inflight region: the file holds {file_len} bytes, fewer than mmap_offset + mmap_size = {needed}")]
    FileTooShort {
        /// Length of the file given.
        file_len: u64,
        /// `mmap_offset + mmap_size`.
        needed: u64,
    },
    /// A queue index at or past `num_queues`.
    #[error("inflight region: queue {index} does not exist (the region has {num_queues})")]
    QueueIndex {
        /// The index asked for.
        index: u16,
        /// Queues in the region.
        num_queues: u16,
    },
    /// The queue is already attached to a live [`InflightQueue`].
    #[error("inflight region: queue {0} is already attached")]
    QueueBusy(u16),
    /// A queue header with a version this daemon does not know.
    #[error(
        "inflight region: queue {queue} has version {version} (expected 0 or {REGION_VERSION})"
    )]
    Version {
        /// Queue index.
        queue: u16,
        /// Version found.
        version: u16,
    },
    /// A queue header whose descriptor count is not the queue size.
    #[error(
        "inflight region: queue {queue} holds {desc_num} descriptor states, expected {queue_size}"
    )]
    DescNum {
        /// Queue index.
        queue: u16,
        /// `desc_num` found.
        desc_num: u16,
        /// The layout's queue size.
        queue_size: u16,
    },
    /// A queue header with feature bits (the specification defines none).
    #[error("inflight region: queue {queue} has unknown feature bits {features:#x}")]
    Features {
        /// Queue index.
        queue: u16,
        /// `features` found.
        features: u64,
    },
    /// A descriptor whose `inflight` flag is neither 0 nor 1.
    #[error("inflight region: queue {queue} descriptor {head} has inflight flag {flag} (expected 0 or 1)")]
    Flag {
        /// Queue index.
        queue: u16,
        /// Descriptor index.
        head: u16,
        /// Flag found.
        flag: u8,
    },
    /// The used ring is further ahead of the region's `used_idx` than a queue can
    /// hold: not a batch this daemon published.
    #[error(
        "inflight region: queue {queue} used ring idx {ring} is {batch} entries past \
         the region's used_idx {region}, more than the {queue_size} a batch can hold"
    )]
    Batch {
        /// Queue index.
        queue: u16,
        /// The used ring's `idx`.
        ring: u16,
        /// The region's `used_idx`.
        region: u16,
        /// `ring - region`, wrapping.
        batch: u16,
        /// The layout's queue size.
        queue_size: u16,
    },
    /// The last-batch list leads outside the queue.
    #[error("inflight region: queue {queue} last-batch list reaches head {head}, outside a queue of {queue_size}")]
    BatchList {
        /// Queue index.
        queue: u16,
        /// The out-of-range head.
        head: u16,
        /// The layout's queue size.
        queue_size: u16,
    },
    /// A head outside the queue given to the data path.
    #[error("inflight queue: head {head} is outside a queue of {queue_size}")]
    Head {
        /// The head given.
        head: u16,
        /// The layout's queue size.
        queue_size: u16,
    },
    /// Creating, sizing or inspecting the memfd failed.
    #[error("inflight region: {what}")]
    Io {
        /// The step that failed.
        what: &'static str,
        /// The error from the system.
        #[source]
        source: std::io::Error,
    },
    /// Mapping the memfd failed.
    #[error("inflight region: mapping the memfd")]
    Map(#[source] vm_memory::mmap::MmapRegionError),
}

/// Size in bytes of one queue's block for a queue of `queue_size` descriptors:
/// header plus descriptor states, rounded up to [`QUEUE_ALIGN`].
pub fn queue_region_size(queue_size: u16) -> u64 {
    let raw = QUEUE_HEADER_SIZE + DESC_STATE_SIZE * u64::from(queue_size);
    raw.div_ceil(QUEUE_ALIGN) * QUEUE_ALIGN
}

/// Shape of an inflight region: how many queues, of how many descriptors. Built
/// only from validated values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InflightLayout {
    num_queues: u16,
    queue_size: u16,
}

impl InflightLayout {
    /// The layout for `num_queues` queues of `queue_size` descriptors, as asked by
    /// `GET_INFLIGHT_FD`. Both come from the frontend and are checked.
    pub fn new(num_queues: u16, queue_size: u16) -> Result<Self, InflightError> {
        if num_queues == 0 {
            return Err(InflightError::NoQueues);
        }
        if queue_size == 0 || queue_size > MAX_QUEUE_SIZE {
            return Err(InflightError::QueueSize(queue_size));
        }
        Ok(Self {
            num_queues,
            queue_size,
        })
    }

    /// The layout of a region handed back by `SET_INFLIGHT_FD`: `mmap_size` must be
    /// exactly the size [`InflightLayout::new`] would have given (a short region
    /// would be read past its end, an oversized one was laid out by someone else).
    pub fn from_description(
        mmap_size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Self, InflightError> {
        let layout = Self::new(num_queues, queue_size)?;
        let expected = layout.mmap_size();
        if mmap_size != expected {
            return Err(InflightError::SizeMismatch {
                given: mmap_size,
                expected,
                num_queues,
                queue_size,
            });
        }
        Ok(layout)
    }

    /// Number of queues.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Descriptors per queue.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// Size of one queue block (the stride between queues).
    pub fn queue_stride(&self) -> u64 {
        queue_region_size(self.queue_size)
    }

    /// Offset of queue `index`'s block from the start of the region.
    pub fn queue_offset(&self, index: u16) -> u64 {
        u64::from(index) * self.queue_stride()
    }

    /// Total size of the region: the `mmap_size` of the `GET_INFLIGHT_FD` reply.
    pub fn mmap_size(&self) -> u64 {
        u64::from(self.num_queues) * self.queue_stride()
    }
}

/// A mapped inflight region: the memfd shared with the frontend, with one block
/// per queue. Cheap to clone (the mapping is shared); the mapping lives as long as
/// the last clone or [`InflightQueue`] of it.
#[derive(Clone)]
pub struct InflightRegion {
    inner: Arc<RegionInner>,
}

struct RegionInner {
    /// The mapping's entry in the fault handler's registry: declared before
    /// `map`, so it is removed before the mapping goes (`crate::fault`).
    fault: OnceLock<Registration>,
    map: MmapRegion<()>,
    layout: InflightLayout,
    /// One flag per queue: set while an [`InflightQueue`] writes that block, so two
    /// writers never share one queue.
    attached: Box<[AtomicBool]>,
}

impl std::fmt::Debug for InflightRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InflightRegion")
            .field("layout", &self.inner.layout)
            .finish_non_exhaustive()
    }
}

impl InflightRegion {
    /// Creates a zeroed memfd sized for `layout` and maps it: the answer to
    /// `GET_INFLIGHT_FD` (reply `mmap_size = layout.mmap_size()`, `mmap_offset = 0`).
    /// The file is sealed against shrinking and growing, so that neither side can
    /// make the mapping fault later. The caller sends the returned file to the
    /// frontend and keeps the region.
    pub fn create(layout: InflightLayout) -> Result<(Self, File), InflightError> {
        let name = c"vqblk-inflight";
        // SAFETY: `name` is a valid NUL-terminated string; memfd_create takes no
        // other pointer and returns a new descriptor or -1.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(InflightError::Io {
                what: "memfd_create",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(layout.mmap_size())
            .map_err(|source| InflightError::Io {
                what: "sizing the memfd",
                source,
            })?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS on a descriptor we own takes an integer argument and
        // touches no memory of ours.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(InflightError::Io {
                what: "sealing the memfd",
                source: std::io::Error::last_os_error(),
            });
        }
        let region = Self::map_file(&file, 0, layout)?;
        Ok((region, file))
    }

    /// Maps a region handed back by `SET_INFLIGHT_FD` after checking its
    /// description (`mmap_size`, `num_queues`, `queue_size`, page-aligned
    /// `mmap_offset`) and that the file is long enough. Queue headers are checked
    /// when each queue is attached.
    pub fn from_file(
        file: &File,
        mmap_offset: u64,
        mmap_size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Self, InflightError> {
        let layout = InflightLayout::from_description(mmap_size, num_queues, queue_size)?;
        // SAFETY: sysconf takes no pointer.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = u64::try_from(page).unwrap_or(4096).max(1);
        if !mmap_offset.is_multiple_of(page) {
            return Err(InflightError::Offset(mmap_offset));
        }
        let file_len = file
            .metadata()
            .map_err(|source| InflightError::Io {
                what: "reading the memfd's size",
                source,
            })?
            .len();
        let needed = mmap_offset.saturating_add(mmap_size);
        if file_len < needed {
            return Err(InflightError::FileTooShort { file_len, needed });
        }
        Self::map_file(file, mmap_offset, layout)
    }

    fn map_file(file: &File, offset: u64, layout: InflightLayout) -> Result<Self, InflightError> {
        let dup = file.try_clone().map_err(|source| InflightError::Io {
            what: "duplicating the memfd",
            source,
        })?;
        // mmap_size is at most 65535 * (16 + 16 * 32768) bytes, about 34 GiB: it fits
        // a 64-bit usize; on a 32-bit host the conversion fails instead of truncating.
        let size =
            usize::try_from(layout.mmap_size()).map_err(|_| InflightError::SizeMismatch {
                given: layout.mmap_size(),
                expected: layout.mmap_size(),
                num_queues: layout.num_queues,
                queue_size: layout.queue_size,
            })?;
        let map = MmapRegion::from_file(FileOffset::new(dup, offset), size)
            .map_err(InflightError::Map)?;
        let attached = (0..layout.num_queues)
            .map(|_| AtomicBool::new(false))
            .collect();
        Ok(Self {
            inner: Arc::new(RegionInner {
                fault: OnceLock::new(),
                map,
                layout,
                attached,
            }),
        })
    }

    /// Enters the mapping in the fault handler's registry for `owner` (once;
    /// later calls do nothing): a frontend that shrinks the region's file
    /// under it breaks its own connection instead of the process
    /// (`crate::fault`).
    pub fn register_faults(&self, owner: &Arc<FaultOwner>) -> Result<(), RegistryFull> {
        if self.inner.fault.get().is_none() {
            let map = &self.inner.map;
            let r = fault::register(map.as_ptr(), map.size(), MappingKind::Inflight, owner)?;
            let _ = self.inner.fault.set(r);
        }
        Ok(())
    }

    /// The region's layout.
    pub fn layout(&self) -> InflightLayout {
        self.inner.layout
    }

    /// Attaches queue `index` once its ring is known, with `ring_used_idx` the
    /// `idx` field of the queue's used ring as the guest sees it now. Checks the
    /// queue's header, initialises a block never used (version 0), runs the
    /// recovery algorithm, and returns the queue's data-path view and what to
    /// resubmit. A queue can be attached by one [`InflightQueue`] at a time.
    ///
    /// Recovery only clears flags the used ring proves completed and rewrites
    /// `used_idx`; running it again after a crash in the middle gives the same
    /// result.
    pub fn attach_queue(
        &self,
        index: u16,
        ring_used_idx: u16,
    ) -> Result<(InflightQueue, Recovery), InflightError> {
        self.attach(index, ring_used_idx, |_| {})
    }

    /// [`attach_queue`](Self::attach_queue), with `prepare` run on the view before
    /// recovery (tests arm their crash budget there).
    fn attach(
        &self,
        index: u16,
        ring_used_idx: u16,
        prepare: impl FnOnce(&mut InflightQueue),
    ) -> Result<(InflightQueue, Recovery), InflightError> {
        let layout = self.inner.layout;
        if index >= layout.num_queues {
            return Err(InflightError::QueueIndex {
                index,
                num_queues: layout.num_queues,
            });
        }
        if self.inner.attached[usize::from(index)].swap(true, Ordering::AcqRel) {
            return Err(InflightError::QueueBusy(index));
        }
        let mut queue = InflightQueue::new(self.clone(), index);
        prepare(&mut queue);
        // On error `queue` is dropped, which releases the attachment.
        let recovery = queue.recover(ring_used_idx)?;
        Ok((queue, recovery))
    }

    /// The mapping, for the queue views.
    fn mapping(&self) -> &MmapRegion<()> {
        &self.inner.map
    }

    fn release(&self, index: u16) {
        self.inner.attached[usize::from(index)].store(false, Ordering::Release);
    }

    /// Bytes of the whole mapping, for tests that inspect or corrupt a region.
    #[cfg(test)]
    fn bytes(&self) -> vm_memory::VolatileSlice<'_> {
        self.inner
            .map
            .get_slice(0, self.inner.map.len())
            .expect("whole mapping")
    }
}

/// What a restarted backend must do on a queue before popping anything new.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Heads to execute again, in the order they were originally popped. They stay
    /// recorded in flight; complete each like any other head, do not `begin` them.
    pub resubmit: Vec<u16>,
    /// The available-ring index to pop from next: the used `idx` plus the heads in
    /// flight (every popped head is either completed in the used ring or recorded
    /// in flight, so this is how far the dead process had popped, minus any head
    /// it popped without recording, which is thus popped again).
    pub next_avail_idx: u16,
    /// The queue block had never been used (version 0) and was initialised.
    pub fresh: bool,
}
