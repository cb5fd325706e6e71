//! Tests of the inflight region: layout, validation of hostile regions, and a
//! simulated guest + daemon whose process is killed after every possible number of
//! stores, then restarted on the same memfd.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use vm_memory::Bytes;

use super::*;

// ---------------------------------------------------------------------------
// Layout and validation
// ---------------------------------------------------------------------------

/// The field offsets the region is accessed at are those of the rust-vmm
/// `vhost` crate's description of the layout (its `QueueRegionSplit` header
/// and `DescStateSplit` states, `repr(C, packed)`), which the daemon does
/// not access through: its fields are written one atomic store at a time.
#[test]
fn layout_matches_the_vhost_crate() {
    use std::mem::{offset_of, size_of};
    use vhost::vhost_user::message::{DescStateSplit, QueueRegionSplit};
    assert_eq!(OFF_FEATURES, offset_of!(QueueRegionSplit, features));
    assert_eq!(OFF_VERSION, offset_of!(QueueRegionSplit, version));
    assert_eq!(OFF_DESC_NUM, offset_of!(QueueRegionSplit, desc_num));
    assert_eq!(
        OFF_LAST_BATCH_HEAD,
        offset_of!(QueueRegionSplit, last_batch_head)
    );
    assert_eq!(OFF_USED_IDX, offset_of!(QueueRegionSplit, used_idx));
    // `desc` stands for the array of states that follows the header.
    let states = offset_of!(QueueRegionSplit, desc);
    assert_eq!(QUEUE_HEADER_SIZE, states as u64);
    assert_eq!(DESC_STATE_SIZE, size_of::<DescStateSplit>() as u64);
    assert_eq!(DESC_OFF_INFLIGHT, offset_of!(DescStateSplit, inflight));
    assert_eq!(DESC_OFF_NEXT, offset_of!(DescStateSplit, next));
    assert_eq!(DESC_OFF_COUNTER, offset_of!(DescStateSplit, counter));
    let version = { QueueRegionSplit::new(0, 1).version };
    assert_eq!(REGION_VERSION, version);
}

#[test]
fn inflight_queue_region_size_is_header_plus_states_rounded_to_64() {
    assert_eq!(queue_region_size(1), 64);
    assert_eq!(queue_region_size(2), 64);
    assert_eq!(queue_region_size(3), 64);
    assert_eq!(queue_region_size(4), 128);
    assert_eq!(queue_region_size(128), 2112);
    assert_eq!(queue_region_size(256), 4160);
    assert_eq!(queue_region_size(32768), 524_352);
    for n in 1..=MAX_QUEUE_SIZE {
        let size = queue_region_size(n);
        assert_eq!(size % QUEUE_ALIGN, 0);
        assert!(size >= QUEUE_HEADER_SIZE + DESC_STATE_SIZE * u64::from(n));
        assert!(size < QUEUE_HEADER_SIZE + DESC_STATE_SIZE * u64::from(n) + QUEUE_ALIGN);
        // The stride other backends of the specification compute.
        assert_eq!(size, (16 * u64::from(n) + 2).div_ceil(64) * 64, "n = {n}");
    }
}

#[test]
fn inflight_layout_offsets_and_mmap_size() {
    let layout = InflightLayout::new(4, 128).unwrap();
    assert_eq!(layout.num_queues(), 4);
    assert_eq!(layout.queue_size(), 128);
    assert_eq!(layout.queue_stride(), 2112);
    assert_eq!(layout.queue_offset(0), 0);
    assert_eq!(layout.queue_offset(3), 3 * 2112);
    assert_eq!(layout.mmap_size(), 4 * 2112);
}

#[test]
fn inflight_layout_rejects_bad_descriptions() {
    assert!(matches!(
        InflightLayout::new(0, 128),
        Err(InflightError::NoQueues)
    ));
    assert!(matches!(
        InflightLayout::new(1, 0),
        Err(InflightError::QueueSize(0))
    ));
    assert!(matches!(
        InflightLayout::new(1, 32769),
        Err(InflightError::QueueSize(32769))
    ));
    assert!(InflightLayout::new(1, 32768).is_ok());
    let right = InflightLayout::new(2, 256).unwrap().mmap_size();
    assert_eq!(
        InflightLayout::from_description(right, 2, 256).unwrap(),
        InflightLayout::new(2, 256).unwrap()
    );
    for wrong in [0, right - 1, right - 64, right + 1, right + 4096, u64::MAX] {
        match InflightLayout::from_description(wrong, 2, 256) {
            Err(InflightError::SizeMismatch {
                given, expected, ..
            }) => {
                assert_eq!((given, expected), (wrong, right));
            }
            other => panic!("mmap_size {wrong}: {other:?}"),
        }
    }
    let e = InflightLayout::from_description(right + 1, 2, 256).unwrap_err();
    assert!(e.to_string().contains("mmap_size"), "{e}");
}

#[test]
fn inflight_create_gives_a_zeroed_sealed_memfd_of_the_layout_size() {
    let layout = InflightLayout::new(3, 64).unwrap();
    let (region, file) = InflightRegion::create(layout).unwrap();
    assert_eq!(file.metadata().unwrap().len(), layout.mmap_size());
    assert_eq!(region.layout(), layout);
    let bytes = region.bytes();
    assert_eq!(bytes.len() as u64, layout.mmap_size());
    let mut buf = vec![0xffu8; bytes.len()];
    bytes.read_slice(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    // Sealed: the frontend cannot shrink it under our mapping.
    assert!(file.set_len(1).is_err());
}

#[test]
fn inflight_from_file_rejects_short_files_and_unaligned_offsets() {
    let layout = InflightLayout::new(2, 16).unwrap();
    let size = layout.mmap_size();
    let file = tempfile::tempfile().unwrap();
    file.set_len(size - 1).unwrap();
    match InflightRegion::from_file(&file, 0, size, 2, 16) {
        Err(InflightError::FileTooShort { file_len, needed }) => {
            assert_eq!((file_len, needed), (size - 1, size));
        }
        other => panic!("{other:?}"),
    }
    file.set_len(size).unwrap();
    assert!(InflightRegion::from_file(&file, 0, size, 2, 16).is_ok());
    assert!(matches!(
        InflightRegion::from_file(&file, 4096, size, 2, 16),
        Err(InflightError::FileTooShort { .. })
    ));
    assert!(matches!(
        InflightRegion::from_file(&file, 100, size, 2, 16),
        Err(InflightError::Offset(100))
    ));
    assert!(matches!(
        InflightRegion::from_file(&file, 0, size + 64, 2, 16),
        Err(InflightError::SizeMismatch { .. })
    ));
    assert!(matches!(
        InflightRegion::from_file(&file, 0, size, 0, 16),
        Err(InflightError::NoQueues)
    ));
    // At a page offset inside a longer file.
    file.set_len(4096 + size).unwrap();
    assert!(InflightRegion::from_file(&file, 4096, size, 2, 16).is_ok());
}

#[test]
fn inflight_zeroed_region_has_nothing_to_recover_and_is_initialised() {
    let (region, _file) = InflightRegion::create(InflightLayout::new(2, 8).unwrap()).unwrap();
    let (q, rec) = region.attach_queue(1, 700).unwrap();
    assert_eq!(
        rec,
        Recovery {
            resubmit: vec![],
            next_avail_idx: 700,
            fresh: true
        }
    );
    assert_eq!((q.index(), q.queue_size(), q.staged()), (1, 8, 0));
    let base = region.layout().queue_offset(1) as usize;
    let bytes = region.bytes();
    assert_eq!(bytes.load::<u16>(base + 8, Ordering::Relaxed).unwrap(), 1);
    assert_eq!(bytes.load::<u16>(base + 10, Ordering::Relaxed).unwrap(), 8);
    assert_eq!(
        bytes.load::<u16>(base + 14, Ordering::Relaxed).unwrap(),
        700
    );
    // Queue 0 untouched.
    assert_eq!(bytes.load::<u16>(8, Ordering::Relaxed).unwrap(), 0);
    drop(q);
    // Initialised and idle: nothing to recover, not fresh any more.
    let (_q, rec) = region.attach_queue(1, 700).unwrap();
    assert_eq!(
        rec,
        Recovery {
            resubmit: vec![],
            next_avail_idx: 700,
            fresh: false
        }
    );
}

#[test]
fn inflight_a_queue_has_one_writer_at_a_time() {
    let (region, _file) = InflightRegion::create(InflightLayout::new(2, 8).unwrap()).unwrap();
    let (q0, _) = region.attach_queue(0, 0).unwrap();
    assert!(matches!(
        region.attach_queue(0, 0),
        Err(InflightError::QueueBusy(0))
    ));
    let (_q1, _) = region.attach_queue(1, 0).unwrap();
    assert!(matches!(
        region.attach_queue(2, 0),
        Err(InflightError::QueueIndex {
            index: 2,
            num_queues: 2
        })
    ));
    drop(q0);
    assert!(region.attach_queue(0, 0).is_ok());
}

#[test]
fn inflight_data_path_rejects_heads_outside_the_queue() {
    let (region, _file) = InflightRegion::create(InflightLayout::new(1, 8).unwrap()).unwrap();
    let (mut q, _) = region.attach_queue(0, 0).unwrap();
    assert!(matches!(
        q.begin(8),
        Err(InflightError::Head {
            head: 8,
            queue_size: 8
        })
    ));
    assert!(matches!(
        q.stage_used(u16::MAX),
        Err(InflightError::Head { .. })
    ));
    assert!(q.begin(7).is_ok());
}

#[test]
fn inflight_a_discarded_batch_stays_in_flight() {
    let (region, _file) = InflightRegion::create(InflightLayout::new(1, 8).unwrap()).unwrap();
    let (mut q, _) = region.attach_queue(0, 0).unwrap();
    q.begin(1).unwrap();
    q.begin(6).unwrap();
    q.stage_used(6).unwrap();
    // Publishing failed: the used idx stayed at 0.
    q.discard_staged();
    assert_eq!(q.staged(), 0);
    q.stage_used(1).unwrap();
    q.commit_used(1);
    drop(q);
    let (_q, rec) = region.attach_queue(0, 1).unwrap();
    assert_eq!(rec.resubmit, vec![6]);
    assert_eq!(rec.next_avail_idx, 2);
}

/// A queue block initialised, with one head in flight, then `corrupt` applied.
fn corrupted(corrupt: impl FnOnce(&vm_memory::VolatileSlice<'_>)) -> InflightError {
    let (region, _file) = InflightRegion::create(InflightLayout::new(1, 8).unwrap()).unwrap();
    let (mut q, _) = region.attach_queue(0, 10).unwrap();
    q.begin(3).unwrap();
    drop(q);
    corrupt(&region.bytes());
    region.attach_queue(0, 10).unwrap_err()
}

#[test]
fn inflight_attach_rejects_hostile_queue_headers() {
    let e = corrupted(|b| b.store(2u16, 8, Ordering::Relaxed).unwrap());
    assert!(
        matches!(
            e,
            InflightError::Version {
                queue: 0,
                version: 2
            }
        ),
        "{e:?}"
    );
    let e = corrupted(|b| b.store(16u16, 10, Ordering::Relaxed).unwrap());
    assert!(
        matches!(
            e,
            InflightError::DescNum {
                desc_num: 16,
                queue_size: 8,
                ..
            }
        ),
        "{e:?}"
    );
    let e = corrupted(|b| b.store(1u64, 0, Ordering::Relaxed).unwrap());
    assert!(
        matches!(e, InflightError::Features { features: 1, .. }),
        "{e:?}"
    );
    let e = corrupted(|b| b.store(7u8, 16 + 16 * 5, Ordering::Relaxed).unwrap());
    assert!(
        matches!(
            e,
            InflightError::Flag {
                head: 5,
                flag: 7,
                ..
            }
        ),
        "{e:?}"
    );
    // used_idx 10 in the region, ring at 10: move the region back by more than a
    // queue.
    let e = corrupted(|b| b.store(1u16, 14, Ordering::Relaxed).unwrap());
    assert!(
        matches!(
            e,
            InflightError::Batch {
                ring: 10,
                region: 1,
                batch: 9,
                ..
            }
        ),
        "{e:?}"
    );
    // A batch of 2 whose list leaves the queue.
    let e = corrupted(|b| {
        b.store(8u16, 14, Ordering::Relaxed).unwrap();
        b.store(2u16, 12, Ordering::Relaxed).unwrap();
        b.store(200u16, 16 + 16 * 2 + 6, Ordering::Relaxed).unwrap();
    });
    assert!(
        matches!(e, InflightError::BatchList { head: 200, .. }),
        "{e:?}"
    );
    // The queue is released after a failed attach.
    let (region, _file) = InflightRegion::create(InflightLayout::new(1, 8).unwrap()).unwrap();
    region.bytes().store(9u16, 8, Ordering::Relaxed).unwrap();
    assert!(region.attach_queue(0, 0).is_err());
    assert!(matches!(
        region.attach_queue(0, 0),
        Err(InflightError::Version { .. })
    ));
}

#[test]
fn inflight_out_of_order_completion_then_restart_resubmits_in_pop_order() {
    let (region, file) = InflightRegion::create(InflightLayout::new(2, 16).unwrap()).unwrap();
    let (mut q, _) = region.attach_queue(1, 0).unwrap();
    for head in [5, 9, 2, 11, 0] {
        q.begin(head).unwrap();
    }
    // Complete 2 and 11, out of order, one at a time; then 9 and 0 as one batch.
    let mut used = 0u16;
    for head in [11, 2] {
        q.stage_used(head).unwrap();
        used += 1;
        q.commit_used(used);
    }
    // The guest reuses head 2 at once.
    q.begin(2).unwrap();
    q.stage_used(9).unwrap();
    q.stage_used(0).unwrap();
    assert_eq!(q.staged(), 2);
    used += 2;
    q.commit_used(used);
    assert_eq!(q.staged(), 0);
    drop(q);
    drop(region);
    // A new process maps the same memfd.
    let layout = InflightLayout::new(2, 16).unwrap();
    let region = InflightRegion::from_file(&file, 0, layout.mmap_size(), 2, 16).unwrap();
    let (mut q, rec) = region.attach_queue(1, used).unwrap();
    assert_eq!(rec.resubmit, vec![5, 2]);
    assert_eq!(rec.next_avail_idx, used + 2);
    assert!(!rec.fresh);
    // New pops come after the resubmitted ones.
    q.begin(7).unwrap();
    drop(q);
    let (_q, rec) = region.attach_queue(1, used).unwrap();
    assert_eq!(rec.resubmit, vec![5, 2, 7]);
    // Queue 0 of the region was never used.
    let (_q0, rec) = region.attach_queue(0, 0).unwrap();
    assert!(rec.fresh);
}

// ---------------------------------------------------------------------------
// Crash simulation
// ---------------------------------------------------------------------------

/// Whether one more store of the simulated process lands (shared by the used ring
/// writes of the simulation and the queue's region writes).
fn allow(budget: &Option<Arc<AtomicUsize>>) -> bool {
    match budget {
        None => true,
        Some(b) => b
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok(),
    }
}

/// The daemon process: everything here dies with it.
struct Device {
    q: InflightQueue,
    /// Next available-ring position to pop.
    next_avail: usize,
    /// Heads being executed, in pop order.
    executing: Vec<u16>,
    /// Private next used index (wrapping, like the ring's).
    next_used: u16,
    budget: Option<Arc<AtomicUsize>>,
}

/// Guest memory (survives the daemon), the guest's view, and the live daemon.
struct Sim {
    region: InflightRegion,
    queue: u16,
    qsize: u16,
    /// Index of avail position 0 and used position 0.
    base: u16,
    /// Heads the guest made available, by position.
    avail: Vec<u16>,
    /// Used ring elements by position (slots past `used_idx` may hold garbage).
    used: Vec<u16>,
    /// The used ring's published `idx`.
    used_idx: u16,
    /// Avail positions whose completion the guest has seen.
    resolved: Vec<bool>,
    /// Used positions the guest has consumed.
    seen: usize,
    dev: Option<Device>,
}

impl Sim {
    fn new(qsize: u16, base: u16) -> Self {
        let layout = InflightLayout::new(3, qsize).unwrap();
        let (region, _file) = InflightRegion::create(layout).unwrap();
        let mut sim = Self {
            region,
            queue: 2,
            qsize,
            base,
            avail: Vec::new(),
            used: Vec::new(),
            used_idx: base,
            resolved: Vec::new(),
            seen: 0,
            dev: None,
        };
        let rec = sim.start(None).expect("fresh attach");
        assert!(rec.fresh);
        sim
    }

    fn used_pos(&self) -> usize {
        usize::from(self.used_idx.wrapping_sub(self.base))
    }

    /// The guest reads the used ring up to `idx`: each element completes the one
    /// outstanding position holding that head; anything else is a completion the
    /// guest never asked for (a request done twice).
    fn guest_consume(&mut self) {
        while self.seen < self.used_pos() {
            let head = self.used[self.seen];
            let pos = (0..self.avail.len())
                .find(|&p| self.avail[p] == head && !self.resolved[p])
                .unwrap_or_else(|| panic!("head {head} completed but not outstanding"));
            self.resolved[pos] = true;
            self.seen += 1;
        }
    }

    fn outstanding_heads(&self) -> Vec<u16> {
        (0..self.avail.len())
            .filter(|&p| !self.resolved[p])
            .map(|p| self.avail[p])
            .collect()
    }

    /// The guest makes `head` available, if it is not already outstanding.
    fn guest_submit(&mut self, head: u16) -> bool {
        if self.outstanding_heads().contains(&head) {
            return false;
        }
        self.avail.push(head);
        self.resolved.push(false);
        true
    }

    /// Starts a daemon process (attach + recovery) with a store budget. Returns
    /// `None` if the process died during recovery.
    fn start(&mut self, budget: Option<usize>) -> Option<Recovery> {
        self.dev = None;
        let budget = budget.map(|n| Arc::new(AtomicUsize::new(n)));
        let b = budget.clone();
        let (q, rec) = self
            .region
            .attach(self.queue, self.used_idx, move |q| q.crash = b)
            .expect("recoverable region");
        if budget
            .as_ref()
            .is_some_and(|b| b.load(Ordering::Relaxed) == 0)
        {
            // Possibly died mid-recovery: the answer is not to be trusted.
            return None;
        }
        let next_avail = usize::from(rec.next_avail_idx.wrapping_sub(self.base));
        self.dev = Some(Device {
            q,
            next_avail,
            executing: rec.resubmit.clone(),
            next_used: self.used_idx,
            budget,
        });
        Some(rec)
    }

    /// Kills the daemon, lets the guest read the used ring, restarts it (first
    /// with `recovery_budget` stores, killed again if that runs out, then without
    /// limit) and checks the recovery against the guest's view.
    fn crash_and_recover(&mut self, recovery_budget: Option<usize>) -> Recovery {
        self.dev = None;
        self.guest_consume();
        if let Some(n) = recovery_budget {
            if self.start(Some(n)).is_some() {
                self.dev = None;
            }
        }
        let rec = self.start(None).expect("unlimited start");
        self.check(&rec);
        rec
    }

    /// Recovery must resubmit exactly the positions popped and not completed, in
    /// pop order, and pop next a position that was not completed either.
    fn check(&self, rec: &Recovery) {
        let next = usize::from(rec.next_avail_idx.wrapping_sub(self.base));
        assert!(next <= self.avail.len(), "next_avail {next} past the ring");
        let expected: Vec<u16> = (0..next)
            .filter(|&p| !self.resolved[p])
            .map(|p| self.avail[p])
            .collect();
        assert_eq!(rec.resubmit, expected, "resubmitted heads");
        for p in next..self.avail.len() {
            assert!(!self.resolved[p], "position {p} completed but popped again");
        }
    }

    fn dead(&self) -> bool {
        self.dev
            .as_ref()
            .and_then(|d| d.budget.as_ref())
            .is_some_and(|b| b.load(Ordering::Relaxed) == 0)
    }

    /// The daemon pops the next available head, if any.
    fn pop(&mut self) -> bool {
        let dev = self.dev.as_mut().expect("live daemon");
        let Some(&head) = self.avail.get(dev.next_avail) else {
            return false;
        };
        dev.next_avail += 1;
        dev.q.begin(head).unwrap();
        dev.executing.push(head);
        true
    }

    /// The daemon completes `heads` (being executed) as one batch.
    fn complete(&mut self, heads: &[u16]) {
        let dev = self.dev.as_mut().expect("live daemon");
        for &head in heads {
            dev.q.stage_used(head).unwrap();
        }
        for &head in heads {
            let pos = usize::from(dev.next_used.wrapping_sub(self.base));
            if allow(&dev.budget) {
                if pos == self.used.len() {
                    self.used.push(head);
                } else {
                    self.used[pos] = head;
                }
            }
            dev.next_used = dev.next_used.wrapping_add(1);
        }
        if allow(&dev.budget) {
            self.used_idx = dev.next_used;
        }
        dev.q.commit_used(dev.next_used);
        dev.executing.retain(|h| !heads.contains(h));
    }

    /// Pops and completes everything, one at a time, without crashing, and checks
    /// that the guest saw every position completed exactly once.
    fn drain(&mut self) {
        while self.pop() {}
        while let Some(&head) = self.dev.as_ref().unwrap().executing.first() {
            self.complete(&[head]);
        }
        self.guest_consume();
        assert!(
            self.resolved.iter().all(|&r| r),
            "positions never completed: {:?}",
            self.outstanding_heads()
        );
    }
}

/// One scripted run: pops, out-of-order completions, a batch, a head reused by the
/// guest. Stops early if the process runs out of stores.
fn script(sim: &mut Sim) {
    for head in [3, 1, 4, 0, 2] {
        sim.guest_submit(head);
    }
    type Step = Box<dyn Fn(&mut Sim)>;
    let steps: Vec<Step> = vec![
        Box::new(|s| assert!(s.pop())),
        Box::new(|s| assert!(s.pop())),
        Box::new(|s| assert!(s.pop())),
        Box::new(|s| s.complete(&[4])),
        Box::new(|s| {
            // The guest sees 4 and reuses it.
            s.guest_consume();
            assert!(s.guest_submit(4));
        }),
        Box::new(|s| assert!(s.pop())),
        Box::new(|s| assert!(s.pop())),
        Box::new(|s| s.complete(&[1, 0])),
        Box::new(|s| assert!(s.pop())),
        Box::new(|s| s.complete(&[4])),
        Box::new(|s| s.complete(&[3, 2])),
    ];
    for step in steps {
        if sim.dead() {
            return;
        }
        step(sim);
    }
}

/// Number of stores the script makes when nothing crashes.
fn script_stores(qsize: u16, base: u16) -> usize {
    let mut sim = Sim::new(qsize, base);
    let budget = Arc::new(AtomicUsize::new(1_000_000));
    sim.dev.as_mut().unwrap().budget = Some(budget.clone());
    sim.dev.as_mut().unwrap().q.crash = Some(budget.clone());
    script(&mut sim);
    1_000_000 - budget.load(Ordering::Relaxed)
}

/// Runs the script with the process killed after `k` stores.
fn script_crashing_after(qsize: u16, base: u16, k: usize) -> Sim {
    let mut sim = Sim::new(qsize, base);
    let budget = Arc::new(AtomicUsize::new(k));
    sim.dev.as_mut().unwrap().budget = Some(budget.clone());
    sim.dev.as_mut().unwrap().q.crash = Some(budget);
    script(&mut sim);
    sim
}

#[test]
fn inflight_crash_after_every_store_recovers_exactly_the_unfinished_heads() {
    for base in [0, 65533] {
        let total = script_stores(8, base);
        // 5 begins (2 stores) + 6 heads completed (stage 2, used element 1,
        // clear 1) + 4 batches (idx 1, used_idx 1) + the reused head's begin.
        assert_eq!(total, 5 * 2 + 6 * 4 + 4 * 2 + 2);
        let mut resubmitted = std::collections::BTreeSet::new();
        for k in 0..=total {
            let mut sim = script_crashing_after(8, base, k);
            let rec = sim.crash_and_recover(None);
            resubmitted.insert(rec.resubmit.clone());
            // A second crash right after recovery changes nothing.
            let again = sim.crash_and_recover(None);
            assert_eq!(again, rec, "k = {k}");
            sim.drain();
        }
        // The crash points do reach different states.
        assert!(resubmitted.len() >= 6, "{resubmitted:?}");
        assert!(resubmitted.contains(&vec![]));
        assert!(resubmitted.contains(&vec![3, 2]));
    }
}

#[test]
fn inflight_crash_during_recovery_is_recovered_the_same() {
    let total = script_stores(8, 0);
    for k in 0..=total {
        let reference = script_crashing_after(8, 0, k).crash_and_recover(None);
        for k2 in 0..40 {
            let mut sim = script_crashing_after(8, 0, k);
            let rec = sim.crash_and_recover(Some(k2));
            assert_eq!(rec.resubmit, reference.resubmit, "k = {k}, k2 = {k2}");
            assert_eq!(rec.next_avail_idx, reference.next_avail_idx);
            sim.drain();
        }
    }
}

#[test]
fn inflight_crash_between_publish_and_clear_never_resubmits_the_batch() {
    // Stop right after the used idx store of a batch of two: their flags are
    // still set in the region, the used_idx lags by 2.
    let mut sim = Sim::new(8, 0);
    for head in [6, 2, 5] {
        sim.guest_submit(head);
        sim.pop();
    }
    let budget = Arc::new(AtomicUsize::new(2 * 2 + 2 + 1));
    sim.dev.as_mut().unwrap().budget = Some(budget.clone());
    sim.dev.as_mut().unwrap().q.crash = Some(budget);
    sim.complete(&[5, 6]);
    assert_eq!(sim.used_idx, 2);
    let region = sim.region.clone();
    let bytes = region.bytes();
    let base = region.layout().queue_offset(2) as usize;
    assert_eq!(bytes.load::<u16>(base + 14, Ordering::Relaxed).unwrap(), 0);
    assert_eq!(
        bytes
            .load::<u8>(base + 16 + 16 * 5, Ordering::Relaxed)
            .unwrap(),
        1
    );
    let rec = sim.crash_and_recover(None);
    assert_eq!(rec.resubmit, vec![2]);
    assert_eq!(rec.next_avail_idx, 3);
    assert_eq!(bytes.load::<u16>(base + 14, Ordering::Relaxed).unwrap(), 2);
    assert_eq!(
        bytes
            .load::<u8>(base + 16 + 16 * 5, Ordering::Relaxed)
            .unwrap(),
        0
    );
    sim.drain();
}

/// A small deterministic generator (xorshift64*), so that failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn inflight_random_workloads_with_repeated_kills_lose_and_repeat_nothing() {
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let qsize = [4u16, 8, 16][rng.below(3)];
        let base = [0u16, 65530, 40000][rng.below(3)];
        let mut sim = Sim::new(qsize, base);
        for _epoch in 0..8 {
            if rng.below(4) != 0 {
                let budget = Arc::new(AtomicUsize::new(rng.below(60)));
                sim.dev.as_mut().unwrap().budget = Some(budget.clone());
                sim.dev.as_mut().unwrap().q.crash = Some(budget);
            }
            for _ in 0..40 {
                if sim.dead() {
                    break;
                }
                match rng.below(4) {
                    0 => {
                        sim.guest_consume();
                        let head = rng.below(usize::from(sim.qsize)) as u16;
                        sim.guest_submit(head);
                    }
                    1 => {
                        sim.pop();
                    }
                    _ => {
                        let executing = sim.dev.as_ref().unwrap().executing.clone();
                        if executing.is_empty() {
                            continue;
                        }
                        let mut batch = Vec::new();
                        for _ in 0..1 + rng.below(3) {
                            let head = executing[rng.below(executing.len())];
                            if !batch.contains(&head) {
                                batch.push(head);
                            }
                        }
                        sim.complete(&batch);
                    }
                }
            }
            let recovery_budget = (rng.below(3) == 0).then(|| rng.below(30));
            sim.crash_and_recover(recovery_budget);
        }
        sim.drain();
    }
}
