//! vqblk: a vhost-user-blk storage daemon whose virtqueues are spread over a pool
//! of IOThreads.
//!
//! Layers, from the guest inwards (see ARCHITECTURE.md): the vhost-user
//! transport (`vhost_user`, one control thread per export socket), the
//! request engine ([`iothread`], one event loop per IOThread owning its
//! queues), the device model ([`virtio`]: descriptor chains to requests) over
//! the [`fastpath`] (guest memory and split-ring accesses), and the backends
//! ([`block`]: io_uring, threads, null, rbd). Around them: [`control`] (the
//! JSON-RPC control socket), [`qos`] (I/O limits, throttle groups,
//! reservations and weights), [`poll`] (the polling policies).
//!
//! The public modules are what the binary, the load generator
//! (`vqblk-bench`), the study (`vqblk-study`), the examples and the
//! integration tests use: starting a [`daemon::Daemon`] from a
//! [`config::ServeConfig`] (or [`cli`]'s flags), its typed [`stats`], the
//! [`size`] grammar, and the pure modules the tests drive directly. The
//! transport, the seccomp filters, logging and the Prometheus renderer are
//! internal.

pub mod autotune;
pub(crate) mod blkdev;
pub mod block;
pub mod cli;
pub(crate) mod clock;
pub mod config;
pub mod control;
pub mod daemon;
pub mod dirty_log;
pub mod fastpath;
pub(crate) mod fault;
pub mod inflight;
pub mod iothread;
pub(crate) mod irq;
pub(crate) mod logging;
pub mod mapping;
pub(crate) mod metrics;
pub mod poll;
pub mod qos;
pub(crate) mod seccomp;
pub mod size;
pub mod stats;
pub(crate) mod vhost_user;
pub mod virtio;
