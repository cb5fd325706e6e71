//! vqblk: a vhost-user-blk storage daemon whose virtqueues are spread over a pool
//! of IOThreads.
//!
//! Layers, from the guest inwards (see ARCHITECTURE.md):
//! - [`vhost_user`]: the vhost-user protocol, one control thread per export socket;
//! - [`iothread`]: the request engine, one event loop per IOThread owning its queues;
//! - [`virtio`]: descriptor chains to requests, and the device model;
//! - [`block`]: backends that execute block operations (io_uring, threads, null).
//! - [`control`]: the JSON-RPC control socket (`vqblk ctl`, `vqblk top`).
//! - [`qos`]: I/O limits, throttle groups, reservations and weights (pure).

pub(crate) mod blkdev;
pub mod block;
pub mod cli;
pub(crate) mod clock;
pub mod config;
pub mod control;
pub mod daemon;
pub mod dirty_log;
pub mod fastpath;
pub mod inflight;
pub mod iothread;
pub mod logging;
pub mod mapping;
pub mod metrics;
pub mod poll;
pub mod qos;
pub mod seccomp;
pub mod size;
pub mod stats;
pub mod vhost_user;
pub mod virtio;
