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

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{info, warn};
use vhost::vhost_user::message::{FrontendReq, MAX_MSG_SIZE};
use vhost::vhost_user::{BackendReqHandler, Error as VhostError};
use vmm_sys_util::eventfd::EventFd;

use super::handover::ConnectionState;
use super::{Connection, ExportShared};

/// How long the rest of a message may take to arrive once its first byte has.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(2);
/// vhost-user message header: request, flags, payload size (u32 each).
const HEADER_SIZE: usize = 12;

/// How a frontend session ended.
#[derive(Debug)]
pub enum SessionEnd {
    /// The frontend went away, or was disconnected for a protocol violation.
    Disconnected,
    /// The daemon is shutting down.
    Shutdown,
    /// A successor took the connection (an upgrade): its rings are drained
    /// and stopped, and what it needs is here, to be sent.
    HandedOver(Box<Departure>),
}

/// A connection on its way to the next process: the channel the successor
/// knocked on, the connection's state and its fds (the connected socket
/// first, then in [`ConnectionState`]'s order).
#[derive(Debug)]
pub struct Departure {
    /// To the successor, after the handshake.
    pub channel: UnixStream,
    /// The stopped connection.
    pub state: ConnectionState,
    /// Its fds.
    pub files: Vec<File>,
}

/// A process that may take this export's connection over (an upgrade):
/// the session watches [`Successor::fd`] between messages, and when it is
/// readable asks [`Successor::knock`], which does the handshake.
pub trait Successor {
    /// Readable when a successor knocks; None once closed.
    fn fd(&self) -> Option<RawFd>;
    /// Answers the knock; the channel to a successor that is to get the
    /// connection now, None when it was refused (the session goes on).
    fn knock(&mut self) -> Option<UnixStream>;
    /// Stops listening for successors (the daemon is stopping).
    fn close(&mut self);
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

/// What [`wait_message`] found on the socket.
enum Incoming {
    /// A whole message (or end of stream, or an error the crate will report);
    /// the peeked request code when the header was readable.
    Ready(Option<u32>),
    /// Part of a message, and the rest did not come in time.
    Incomplete { queued: usize, needed: usize },
    /// The daemon is shutting down.
    Shutdown,
    /// A successor knocked (between messages).
    Knock,
    /// The fault handler broke the connection's memory.
    Fault,
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

/// Waits until `fd` (true) or `knock` (false) is readable; None when the
/// shutdown eventfd fires first.
pub(crate) fn wait_frontend(fd: i32, knock: Option<RawFd>, shutdown: &EventFd) -> Option<bool> {
    match wait_any(fd, knock, None, shutdown, None) {
        Wake::Frontend => Some(true),
        Wake::Knock => Some(false),
        Wake::Fault | Wake::Shutdown => None,
    }
}

/// What ended a [`wait_any`].
enum Wake {
    /// The frontend's fd is readable (or the wait timed out).
    Frontend,
    /// A successor knocked.
    Knock,
    /// The fault handler broke the connection's memory (`crate::fault`).
    Fault,
    /// The daemon is shutting down (or poll failed).
    Shutdown,
}

/// Waits until `fd`, `knock`, the connection's `fault` eventfd or the
/// shutdown eventfd is readable, for at most `timeout` (None: forever).
/// Shutdown first, then a fault, then the frontend: a knock waits for the
/// message being handled.
fn wait_any(
    fd: i32,
    knock: Option<RawFd>,
    fault: Option<RawFd>,
    shutdown: &EventFd,
    timeout: Option<Duration>,
) -> Wake {
    // poll(2) ignores a negative fd: an absent knock or fault fd.
    let mut fds = [
        fd,
        knock.unwrap_or(-1),
        fault.unwrap_or(-1),
        shutdown.as_raw_fd(),
    ]
    .map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    loop {
        // SAFETY: `fds` is a live array of four pollfd structs.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 4, ms) };
        if r < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return if r < 0 || fds[3].revents != 0 {
            Wake::Shutdown
        } else if fds[2].revents != 0 {
            Wake::Fault
        } else if fds[0].revents != 0 || fds[1].revents == 0 {
            Wake::Frontend
        } else {
            Wake::Knock
        };
    }
}

impl Wake {
    /// What a wait for the frontend that did not find it readable means.
    fn stop(self) -> Option<Incoming> {
        match self {
            Wake::Frontend => None,
            Wake::Knock => Some(Incoming::Knock),
            Wake::Fault => Some(Incoming::Fault),
            Wake::Shutdown => Some(Incoming::Shutdown),
        }
    }
}

/// Waits for a whole message on `fd` without consuming it, or a successor's
/// knock on `knock` before the message's first byte, or a fault.
fn wait_message(
    fd: i32,
    knock: Option<RawFd>,
    fault: Option<RawFd>,
    shutdown: &EventFd,
) -> Incoming {
    if let Some(stop) = wait_any(fd, knock, fault, shutdown, None).stop() {
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
            if let Some(stop) = wait_any(fd, knock, fault, shutdown, None).stop() {
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
        match wait_any(shutdown.as_raw_fd(), None, fault, shutdown, nap) {
            Wake::Fault => return Incoming::Fault,
            Wake::Frontend | Wake::Knock => {}
            Wake::Shutdown => return Incoming::Shutdown,
        }
    }
}

/// The message loop of one frontend connection.
pub struct Session {
    conn: Arc<Mutex<Connection>>,
    handler: BackendReqHandler<Mutex<Connection>>,
    fd: RawFd,
    name: String,
}

impl Session {
    /// A new frontend on `stream`.
    pub fn new(stream: UnixStream, shared: &Arc<ExportShared>) -> Session {
        let conn = Arc::new(Mutex::new(Connection::new(shared.clone())));
        let fd = stream.as_raw_fd();
        Session {
            handler: BackendReqHandler::from_stream(stream, conn.clone()),
            conn,
            fd,
            name: shared.device.name.clone(),
        }
    }

    /// The connection a predecessor handed over (an upgrade), on `stream`,
    /// its rings started where they stopped. Nothing is read from the
    /// stream: the frontend's next message (maybe already queued) is served
    /// by [`Session::serve`].
    pub fn resume(
        stream: UnixStream,
        shared: &Arc<ExportShared>,
        state: &ConnectionState,
        files: Vec<File>,
    ) -> io::Result<Session> {
        let conn = Connection::restore(shared.clone(), state, files).map_err(io::Error::other)?;
        let conn = Arc::new(Mutex::new(conn));
        // The crate keeps the negotiated features (which decide REPLY_ACK and
        // which messages it accepts) in the handler, with no way to set
        // them: the negotiation is replayed to a fresh handler over a socket
        // pair, then the handler's end of the pair is replaced, fd number for
        // fd number, by the frontend's socket.
        let (ours, mut replay) = UnixStream::pair()?;
        let fd = ours.as_raw_fd();
        let mut handler = BackendReqHandler::from_stream(ours, conn.clone());
        replay_negotiation(&mut handler, &mut replay, state)?;
        // SAFETY: dup3 makes `fd`, which the handler's stream owns, refer to
        // the frontend's socket (closing the pair's end, which nothing else
        // refers to); `stream` keeps its own fd, closed when it drops below.
        // The handler's stream stays the only owner of `fd`.
        if unsafe { libc::dup3(stream.as_raw_fd(), fd, libc::O_CLOEXEC) } < 0 {
            return Err(io::Error::last_os_error());
        }
        drop(stream);
        conn.lock()
            .unwrap()
            .start_restored()
            .map_err(io::Error::other)?;
        Ok(Session {
            handler,
            conn,
            fd,
            name: shared.device.name.clone(),
        })
    }

    /// Serves the frontend until it disconnects, breaks the protocol, the
    /// daemon shuts down or `successor` takes the connection; then drains
    /// every started ring.
    pub fn serve(
        mut self,
        shutdown: &EventFd,
        mut successor: Option<&mut dyn Successor>,
    ) -> SessionEnd {
        let name = self.name.clone();
        let fd = self.fd;
        let fault = self.conn.lock().unwrap().fault_wake_fd();
        // A fault in this connection's memory (crate::fault), or memory
        // refused under memory-sealing = required, ends the session like a
        // disconnect.
        let conn = self.conn.clone();
        let closing = move || conn.lock().unwrap().closing();
        let end = loop {
            let knock = successor.as_ref().and_then(|s| s.fd());
            let code = match wait_message(fd, knock, fault, shutdown) {
                Incoming::Fault => match closing() {
                    Some(why) => {
                        warn!("export {name}: closing the connection: {why}");
                        break SessionEnd::Disconnected;
                    }
                    None => continue,
                },
                Incoming::Shutdown => {
                    // Before the drain, which may take long: a successor
                    // started meanwhile can then listen at the same name.
                    if let Some(s) = successor.as_mut() {
                        s.close();
                    }
                    break SessionEnd::Shutdown;
                }
                Incoming::Knock => {
                    let Some(channel) = successor.as_mut().and_then(|s| s.knock()) else {
                        continue;
                    };
                    // No message is read from here on: whatever the frontend
                    // sends stays queued on the socket for the successor.
                    match self.depart(channel) {
                        Ok(d) => return SessionEnd::HandedOver(Box::new(d)),
                        Err(e) => {
                            warn!("export {name}: handover failed, closing the connection: {e}");
                            break SessionEnd::Disconnected;
                        }
                    }
                }
                Incoming::Incomplete { queued, needed } => {
                    warn!(
                        "export {name}: closing the connection: incomplete message \
                         ({queued} of {needed} bytes after {MESSAGE_TIMEOUT:?})"
                    );
                    break SessionEnd::Disconnected;
                }
                Incoming::Ready(code) => code,
            };
            match self.handler.handle_request() {
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
        self.conn.lock().unwrap().stop_all();
        drop(self.handler);
        info!("export {name}: frontend disconnected");
        end
    }

    /// Drains the rings and takes the connection (its socket first).
    fn depart(&mut self, channel: UnixStream) -> io::Result<Departure> {
        let socket = File::from(std::os::fd::OwnedFd::from(
            self.handler.try_clone_connection()?,
        ));
        let (state, files) = self.conn.lock().unwrap().depart();
        info!(
            "export {}: connection handed over (rings drained and stopped)",
            self.name
        );
        Ok(Departure {
            channel,
            state,
            files: std::iter::once(socket).chain(files).collect(),
        })
    }
}

/// Replays the feature negotiation `state` records to `handler` from the
/// frontend's side of a socket pair (`replay`): GET_FEATURES and
/// GET_PROTOCOL_FEATURES (whose answers the handler remembers), then the
/// acked sets; replies are read and dropped.
fn replay_negotiation(
    handler: &mut BackendReqHandler<Mutex<Connection>>,
    replay: &mut UnixStream,
    state: &ConnectionState,
) -> io::Result<()> {
    use std::io::{Read, Write};
    let mut messages = vec![
        (FrontendReq::GET_FEATURES, None),
        (FrontendReq::SET_FEATURES, Some(state.acked_features)),
        (FrontendReq::GET_PROTOCOL_FEATURES, None),
    ];
    if let Some(p) = state.acked_protocol_features {
        messages.push((FrontendReq::SET_PROTOCOL_FEATURES, Some(p)));
    }
    for (req, value) in messages {
        // vhost-user header: request, flags (version 1, no reply wanted), size.
        let mut msg = (req as u32).to_le_bytes().to_vec();
        msg.extend_from_slice(&1u32.to_le_bytes());
        msg.extend_from_slice(&(value.map_or(0u32, |_| 8)).to_le_bytes());
        msg.extend(value.map(u64::to_le_bytes).into_iter().flatten());
        replay.write_all(&msg)?;
        handler
            .handle_request()
            .map_err(|e| io::Error::other(format!("replaying {req:?}: {e}")))?;
        if value.is_none() {
            let mut reply = [0u8; HEADER_SIZE + 8];
            replay.read_exact(&mut reply)?;
        }
    }
    Ok(())
}
