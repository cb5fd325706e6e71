//! The request path's own access to guest memory and split rings: the one
//! place where the daemon does by hand what rust-vmm's `vm-memory` and
//! `virtio-queue` do, because doing it through them costs a measured share
//! of every request. Nothing else in the daemon reads a ring field or a
//! descriptor by hand; the name is the fence: a `fastpath::` path at a call
//! site says that the code bypasses the crates, and that this module answers
//! for it.
//!
//! # What it replaces
//!
//! | here | in place of | why theirs costs |
//! |---|---|---|
//! | [`GuestMem`] (`mem.rs`) | vm-memory's `GuestMemoryMmap` as the map's type (its regions and accessors are kept inside) | `find_region` binary-searches the regions through each region's `Arc`; here a scan of an inline table of each region's bounds and host address |
//! | [`SmallAccess`] (`mem.rs`) | vm-memory's `Bytes::read_slice`/`read_obj`/`write_obj` and `GuestMemory::load`/`store` for a range in one region | they walk any range region by region through generic iterators (`try_access`, `get_slices`); here a bounds check against the table and one volatile load or store on a slice made from its host address (not the region's `get_slice`, which goes through the region's `Arc` and checks again: 208 instructions more per read at QD16), vm-memory's accessor for anything else |
//! | [`SplitRing`] (`ring.rs`) | virtio-queue's `QueueT::avail_idx`, the avail entry read of `iter`/`pop_descriptor_chain`, `add_used`, `needs_notification`, `enable_notification`/`disable_notification` | each ring field goes through vm-memory's generic accessors (`enable_notification`, before every sleep of the thread: 255 instructions there, 165 here) |
//! | [`HeadChain`] (`chain.rs`) | virtio-queue's `DescriptorChain` iterator | the same, per descriptor (here the table is found in its region once per chain: 33 instructions per 4k read less than a lookup per descriptor); and its constructor is crate-private, so it cannot walk a head that was not popped (a request resubmitted after a restart) |
//!
//! virtio-queue's `Queue` is still the ring's state (addresses, size,
//! features, next avail and next used indexes), and its setup checks and its
//! `Descriptor` type are used as they are.
//!
//! # Why
//!
//! Server instructions per 4k request, null backend, QD16, counted by
//! callgrind with `scripts/instructions-per-request.sh` (within a few
//! instructions the same count for the same binary, whatever the machine
//! does):
//!
//! | | read | write |
//! |---|---|---|
//! | with this module | 2,069 | 2,132 |
//! | without: the crates' `pop_descriptor_chain`, `add_used`, `avail_idx`, `needs_notification` and accessors over vm-memory's region lookup | 3,970 | 4,013 |
//!
//! The second row was measured beside the first at an earlier build (2,646
//! and 2,693 with this module then): about 1,300 instructions, a third of
//! the daemon's own work per request then. The variant without it changes
//! only what the table's left column names (the queue layer pops and
//! publishes through virtio-queue, `GuestMem` answers every access through
//! vm-memory); the null backend's memset of read data is not counted.
//!
//! # What keeps it equivalent to the crates
//!
//! - `fastpath::mem::tests`: `lookup_finds_the_same_region_as_vm_memory`
//!   (the bounds table against vm-memory's lookup),
//!   `one_region_covers_exactly_one_region` (the direct path's slices
//!   against the region's own `get_slice`, up to a region's last byte and
//!   no further) and
//!   `small_accesses_match_vm_memory` (every access against vm-memory's,
//!   byte for byte and error for error: inside a region, at its last bytes,
//!   across adjacent regions, into holes, at the end of the address space);
//! - `fastpath::ring::tests`: the layout, the EVENT_IDX rule against its
//!   definition, and [`SplitRing`]'s loads and stores (the notification
//!   toggles included) against virtio-queue's own on a `MockSplitQueue`;
//! - `fastpath::chain::tests`: [`HeadChain`] against the chain virtio-queue
//!   pops, well-formed and broken chains, over vm-memory's map and over
//!   `GuestMem` (a table in one region, across two, past the end of memory);
//! - `virtio::request::tests`: every parser test parses its chain twice,
//!   with the production parser (`parse_head`: [`HeadChain`]) and with the
//!   oracle (virtio-queue's popped chain over vm-memory's accessors), and
//!   requires the same result;
//! - `tests/fuzz_parser.rs`: the same comparison over random descriptor
//!   tables in memory with holes and guard pages, the production side over
//!   [`GuestMem`]; `tests/fuzz_queue.rs`: a whole IOThread on random rings
//!   writes only into device-writable descriptors and the used ring, and
//!   completes every popped head once. `scripts/fuzz.sh` runs both for as
//!   long as asked.
//!
//! This module knows neither the device model nor the IOThreads: the
//! request parser (`virtio::request`) and the queue layer (`iothread`) use
//! it.

mod chain;
mod mem;
mod ring;

pub use chain::HeadChain;
pub use mem::{GuestMem, SmallAccess};
pub use ring::{event_idx_wants_call, used_ring_len, SplitRing};
