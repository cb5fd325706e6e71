//! Quality of service between the exports of one daemon: limits, groups of
//! exports sharing limits, and reservations with weights (docs/qos.md).
//!
//! - [`throttle`]: per-export limits with QEMU's keys and semantics
//!   (`iops-total`, `bps-read-max`, `iops-size`, ...), validated by QEMU's
//!   rules, and the leaky buckets that admit a request or say until when it
//!   must wait ([`ThrottleState`]);
//! - [`group`]: the same buckets shared by queues on several IOThreads without
//!   a lock ([`SharedThrottle`], [`ThrottleGroup`]), with the bound on how far
//!   the sharing can pass a limit;
//! - [`mclock`]: reservation / weight / limit scheduling between the exports
//!   of one backing device;
//! - [`shares`]: reservations and weights enforced as per-export IOPS caps
//!   that a share allocator recomputes every tick from what each export
//!   did, and the [`Gate`] a queue asks (limits and cap together);
//! - [`sim`]: the scheduler and the share allocator on a device whose
//!   capacity changes (`examples/qos_sim.rs`).
//!
//! Everything here is pure: no thread, no clock (time comes in as ns), no
//! lock. The request engine asks for the head request of a queue and, when
//! told to wait, sleeps on a timer until then.

pub mod group;
pub mod mclock;
pub mod shares;
pub mod sim;
pub mod throttle;

pub use group::{SharedThrottle, ThrottleGroup};
pub use mclock::{ClientParams, Dispatch, MClock};
pub use shares::{Gate, ShareAllocator, ShareCap};
pub use throttle::{
    Admission, BucketKind, BucketLimit, Direction, LimitError, ThrottleConfig, ThrottleLimits,
    ThrottleState,
};

#[cfg(test)]
mod tests;
