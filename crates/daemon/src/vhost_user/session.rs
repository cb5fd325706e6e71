//! The message loop of one frontend connection: wait for a whole message,
//! hand it to the `vhost` crate's parser, and decide after a refusal whether
//! the connection can go on.
//!
//! Two things the crate leaves to us:
//! - It reads a message's payload with a single `recvmsg`, so a legal message
//!   whose payload arrives in a later `write` would be cut short and refused.
//!   We peek at the header and wait (bounded by [`MESSAGE_TIMEOUT`]) until
//!   the whole message is queued on the socket before letting it read.
//! - When a handler refuses a message whose reply carries data (GET_*), or
//!   the crate refuses a message before its REPLY_ACK, no reply is sent and
//!   a frontend waiting for one would wait forever. The protocol has no error
//!   form for those replies, so we close the connection: the frontend sees
//!   the end of the stream at once. Refusals by our own handler of messages
//!   answered by REPLY_ACK are sent as a failing ack and the connection stays.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{info, warn};
use vhost::vhost_user::message::{FrontendReq, MAX_MSG_SIZE};
use vhost::vhost_user::{BackendReqHandler, Error as VhostError};
use vmm_sys_util::eventfd::EventFd;

use super::{Connection, ExportShared};

/// How long the rest of a message may take to arrive once its first byte has.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(2);
/// vhost-user message header: request, flags, payload size (u32 each).
const HEADER_SIZE: usize = 12;

/// How a frontend session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    /// The frontend went away, or was disconnected for a protocol violation.
    Disconnected,
    /// The daemon is shutting down.
    Shutdown,
}

/// Front-end request codes whose reply carries data (vhost-user spec): a
/// refusal cannot be expressed in their reply.
const DATA_REPLIES: [FrontendReq; 10] = [
    FrontendReq::GET_FEATURES,
    FrontendReq::SET_LOG_BASE, // replies when LOG_SHMFD is negotiated
    FrontendReq::GET_VRING_BASE,
    FrontendReq::GET_PROTOCOL_FEATURES,
    FrontendReq::GET_QUEUE_NUM,
    FrontendReq::GET_CONFIG,
    FrontendReq::GET_INFLIGHT_FD,
    FrontendReq::GET_MAX_MEM_SLOTS,
    FrontendReq::GET_SHARED_OBJECT,
    FrontendReq::GET_SHMEM_CONFIG,
];

fn expects_data_reply(code: u32) -> bool {
    DATA_REPLIES.iter().any(|r| *r as u32 == code)
}

/// Waits until `fd` is readable or the shutdown eventfd fires (true), for at
/// most `timeout` (None: forever; a timeout returns false).
pub(crate) fn wait_readable(fd: i32, shutdown: &EventFd, timeout: Option<Duration>) -> bool {
    wait_on(fd, shutdown, None, timeout) != Woken::Readable
}

/// What ended a [`wait_on`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woken {
    /// The fd is readable, or the wait timed out.
    Readable,
    /// The daemon is shutting down (or poll failed).
    Shutdown,
    /// The fault handler broke this connection's memory.
    Fault,
}

/// Waits until `fd` is readable, the shutdown eventfd fires, or the
/// connection's fault eventfd does, for at most `timeout` (None: forever).
fn wait_on(fd: i32, shutdown: &EventFd, fault: Option<i32>, timeout: Option<Duration>) -> Woken {
    let pollfd = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // A negative fd is ignored by poll(2): no fault eventfd, nothing to wait on.
    let mut fds = [
        pollfd(fd),
        pollfd(shutdown.as_raw_fd()),
        pollfd(fault.unwrap_or(-1)),
    ];
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    loop {
        // SAFETY: `fds` is a live array of three pollfd structs.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 3, ms) };
        if r < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return if r < 0 || fds[1].revents != 0 {
            Woken::Shutdown
        } else if fds[2].revents != 0 {
            Woken::Fault
        } else {
            Woken::Readable
        };
    }
}

/// What [`wait_message`] found on the socket.
enum Incoming {
    /// A whole message (or end of stream, or an error the crate will report);
    /// the peeked request code when the header was readable.
    Ready(Option<u32>),
    /// Part of a message, and the rest did not come in time.
    Incomplete { queued: usize, needed: usize },
    /// The daemon is shutting down.
    Shutdown,
    /// The fault handler broke the connection's memory.
    Fault,
}

impl From<Woken> for Option<Incoming> {
    /// What a wait that did not find the socket readable means.
    fn from(w: Woken) -> Option<Incoming> {
        match w {
            Woken::Readable => None,
            Woken::Shutdown => Some(Incoming::Shutdown),
            Woken::Fault => Some(Incoming::Fault),
        }
    }
}

/// Bytes queued on a unix stream socket (all of them, across writes).
fn queued_bytes(fd: i32) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the pointer we pass.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    if r < 0 {
        0
    } else {
        n as usize
    }
}

/// Waits for a whole message on `fd` without consuming it (or for the
/// shutdown or fault eventfd).
fn wait_message(fd: i32, shutdown: &EventFd, fault: Option<i32>) -> Incoming {
    if let Some(stop) = wait_on(fd, shutdown, fault, None).into() {
        return stop;
    }
    let mut deadline = Instant::now() + MESSAGE_TIMEOUT;
    loop {
        let mut hdr = [0u8; HEADER_SIZE];
        // SAFETY: recv into a live buffer of HEADER_SIZE bytes; MSG_PEEK
        // without a control buffer leaves any attached fds queued.
        let n = unsafe {
            libc::recv(
                fd,
                hdr.as_mut_ptr() as *mut libc::c_void,
                HEADER_SIZE,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n <= 0 {
            let again = n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock;
            if !again {
                // End of stream, or an error: the crate's read reports it.
                return Incoming::Ready(None);
            }
            // Nothing queued after all: wait for the next message afresh.
            if let Some(stop) = wait_on(fd, shutdown, fault, None).into() {
                return stop;
            }
            deadline = Instant::now() + MESSAGE_TIMEOUT;
            continue;
        }
        let queued = queued_bytes(fd);
        let (code, needed) = if n as usize == HEADER_SIZE {
            let code = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
            let size = u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize;
            if size > MAX_MSG_SIZE {
                // The crate refuses the header before reading a payload.
                return Incoming::Ready(Some(code));
            }
            (Some(code), HEADER_SIZE + size)
        } else {
            (None, HEADER_SIZE)
        };
        if queued >= needed {
            return Incoming::Ready(code);
        }
        if Instant::now() >= deadline {
            return Incoming::Incomplete { queued, needed };
        }
        // The socket stays readable while part of a message is queued, so
        // poll would not wait: nap briefly instead (bounded by the deadline).
        let nap = Some(Duration::from_millis(1));
        if let Some(stop) = wait_on(shutdown.as_raw_fd(), shutdown, fault, nap).into() {
            return stop;
        }
    }
}

/// Serves one frontend until it disconnects, breaks the protocol, or the
/// daemon shuts down; then drains every started ring.
pub fn serve_frontend(
    stream: UnixStream,
    shared: &Arc<ExportShared>,
    shutdown: &EventFd,
) -> SessionEnd {
    let name = shared.device.name.clone();
    let conn = Arc::new(Mutex::new(Connection::new(shared.clone())));
    let fd = stream.as_raw_fd();
    let fault = conn.lock().unwrap().fault_wake_fd();
    let mut handler = BackendReqHandler::from_stream(stream, conn.clone());
    // A fault in this connection's memory (crate::fault), or memory refused
    // under memory-sealing = required, ends the session like a disconnect.
    let closing = || conn.lock().unwrap().closing();
    let end = loop {
        let code = match wait_message(fd, shutdown, fault) {
            Incoming::Shutdown => break SessionEnd::Shutdown,
            Incoming::Fault => match closing() {
                Some(why) => {
                    warn!("export {name}: closing the connection: {why}");
                    break SessionEnd::Disconnected;
                }
                None => continue,
            },
            Incoming::Incomplete { queued, needed } => {
                warn!(
                    "export {name}: closing the connection: incomplete message \
                     ({queued} of {needed} bytes after {MESSAGE_TIMEOUT:?})"
                );
                break SessionEnd::Disconnected;
            }
            Incoming::Ready(code) => code,
        };
        match handler.handle_request() {
            Ok(()) => {}
            Err(VhostError::Disconnected) => break SessionEnd::Disconnected,
            // Our handler refused a message answered by REPLY_ACK: the
            // frontend was told (if it asked) and the stream is intact.
            Err(e @ (VhostError::ReqHandlerError(_) | VhostError::InvalidOperation(_)))
                if !code.is_some_and(expects_data_reply) =>
            {
                warn!("export {name}: request refused: {e}")
            }
            Err(e) => {
                let what = code.map_or("unreadable".to_string(), |c| format!("request {c}"));
                warn!("export {name}: closing the connection: {what}: {e}");
                break SessionEnd::Disconnected;
            }
        }
        if let Some(why) = closing() {
            warn!("export {name}: closing the connection: {why}");
            break SessionEnd::Disconnected;
        }
    };
    // Drain: every started ring waits for its in-flight requests.
    conn.lock().unwrap().stop_all();
    drop(handler);
    info!("export {name}: frontend disconnected");
    end
}
