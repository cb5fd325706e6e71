//! Upgrade without reconnect: a running daemon hands each export's listening
//! socket and live vhost-user connection to its successor (`vqblk serve
//! --takeover`), so the frontend never sees the connection close.
//!
//! The protocol's data is `vhost_user::handover` (pure).
//!
//! Every export listens, besides its socket, on an abstract unix socket
//! named after it (`listener_name`: no file to clean up, gone with the
//! process). The successor connects there, both ends check that the other
//! runs as the same user (`SO_PEERCRED`: the fds give access to guest
//! memory), and it says hello (`Hello`: magic, state format, version, the
//! export's shape). The export thread answers between two vhost-user
//! messages: a refusal (another version or shape) leaves it serving, and
//! the successor falls back to waiting for the socket, as before handovers
//! existed (the frontend then reconnects). Accepted, it stops reading
//! messages, drains every ring, and sends a `Handover` (the connection's
//! state) followed by the fds (`SCM_RIGHTS`, `FDS_PER_MESSAGE` per
//! message): the listener, then the connection's. Its thread then ends; the
//! successor resumes the message loop on the same socket (what the frontend
//! sent meanwhile is still queued on it) and sends the old process SIGTERM,
//! which then stops as usual without removing the socket it handed over.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use log::{info, warn};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::vhost_user::handover::{
    decode, encode, frame_len, listener_name, ConnectionState, Handover, Hello, Verdict,
    FDS_PER_MESSAGE, FORMAT,
};
use crate::vhost_user::{ExportShared, Session, Successor};

/// How long either side waits for the other's handshake message.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the successor waits for the state: the predecessor drains the
/// rings first (GET_VRING_BASE waits up to 60 s for a queue).
const STATE_TIMEOUT: Duration = Duration::from_secs(90);
/// Binding the handover socket is tried this many times, 20 ms apart, while
/// another process holds the name.
const BIND_TRIES: u32 = 10;

/// This process's effective uid, read once by a thread allowed to ask
/// (the export threads' seccomp filter does not allow `geteuid`).
static OUR_UID: OnceLock<u32> = OnceLock::new();

fn our_uid() -> u32 {
    // SAFETY: geteuid takes no argument and cannot fail.
    *OUR_UID.get_or_init(|| unsafe { libc::geteuid() })
}

/// The uid and pid of the process at the other end of `fd`.
fn peer(fd: RawFd) -> io::Result<(u32, i32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`, a live
    // ucred of that size, and sets `len`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.uid, cred.pid))
}

/// Refuses a peer running as another user.
fn same_user(stream: &UnixStream) -> io::Result<i32> {
    let (uid, pid) = peer(stream.as_raw_fd())?;
    if uid != our_uid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "process {pid} runs as uid {uid}, this daemon as {}",
                our_uid()
            ),
        ));
    }
    Ok(pid)
}

fn address(socket: &Path) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(listener_name(socket).as_bytes())
}

/// Reads one length-prefixed message, giving up at `deadline` (poll, then
/// read what is there: no socket option needed, which the export threads'
/// filter does not allow).
fn read_frame(stream: &mut UnixStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut prefix = [0u8; 4];
    read_within(stream, &mut prefix, deadline)?;
    let n = frame_len(prefix).map_err(io::Error::other)?;
    let mut body = vec![0u8; n];
    read_within(stream, &mut body, deadline)?;
    Ok(body)
}

fn read_within(stream: &mut UnixStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::ErrorKind::TimedOut.into());
        }
        // Readable: this read does not block.
        match stream.read(buf)? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

/// Where an export waits for its successor.
pub(crate) struct HandoverPort {
    /// None once closed (the daemon stops).
    listener: Option<UnixListener>,
    ours: Hello,
    export: String,
    /// Set once the export's socket belongs to the successor: this daemon's
    /// stop must not remove it.
    handed_over: Arc<AtomicBool>,
}

impl HandoverPort {
    /// Listens for a successor of export `export` on `socket`, whose shape
    /// is `queues` queues of at most `max_queue_size`.
    pub(crate) fn bind(
        socket: &Path,
        export: &str,
        queues: u16,
        max_queue_size: u16,
    ) -> io::Result<HandoverPort> {
        our_uid();
        let addr = address(socket)?;
        // A predecessor that could not hand over (the reconnect path) stops
        // listening at the name when its stop begins, a moment after it
        // released the socket this daemon waited for.
        let mut tries = 0;
        let listener = loop {
            match UnixListener::bind_addr(&addr) {
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && tries < BIND_TRIES => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                r => break r?,
            }
        };
        Ok(HandoverPort {
            listener: Some(listener),
            ours: Hello::ours(queues, max_queue_size),
            export: export.into(),
            handed_over: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The flag set once the export is handed over.
    pub(crate) fn handed_over(&self) -> Arc<AtomicBool> {
        self.handed_over.clone()
    }

    fn handshake(&mut self) -> io::Result<Option<UnixStream>> {
        let Some(listener) = &self.listener else {
            return Ok(None);
        };
        let (mut stream, _) = listener.accept()?;
        let pid = same_user(&stream)?;
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let hello: Hello = decode(&read_frame(&mut stream, deadline)?).map_err(io::Error::other)?;
        let verdict = match hello.check_against(&self.ours) {
            Ok(()) => Verdict::Accept,
            Err(why) => {
                warn!(
                    "export {}: handover to process {pid} refused: {why}; this daemon \
                     keeps serving (the successor waits for the socket)",
                    self.export
                );
                Verdict::Refuse(why)
            }
        };
        stream.write_all(&encode(&verdict))?;
        if verdict != Verdict::Accept {
            return Ok(None);
        }
        info!(
            "export {}: handing over to process {pid} (vqblk {})",
            self.export, hello.version
        );
        Ok(Some(stream))
    }

    /// Sends the export's `listener` and its connection (if any) to the
    /// successor on `channel`; consumes the port, so that the successor can
    /// listen for its own successor at the same name. False when the
    /// sending failed: the successor got nothing usable, this daemon keeps
    /// the listener (a departed connection is closed; its frontend
    /// reconnects here).
    pub(crate) fn hand_over(
        self,
        mut channel: UnixStream,
        listener: &UnixListener,
        connection: Option<(ConnectionState, Vec<File>)>,
    ) -> bool {
        let HandoverPort {
            listener: port,
            export,
            handed_over,
            ..
        } = self;
        drop(port);
        let (state, files) = match connection {
            Some((state, files)) => (Some(state), files),
            None => (None, Vec::new()),
        };
        let msg = Handover {
            format: FORMAT,
            connection: state,
        };
        let fds: Vec<RawFd> = std::iter::once(listener.as_raw_fd())
            .chain(files.iter().map(File::as_raw_fd))
            .collect();
        // Before the last byte leaves: the successor stops this process as
        // soon as it has everything, and the stop must find the socket given.
        handed_over.store(true, Ordering::Release);
        let sent = channel.write_all(&encode(&msg)).and_then(|()| {
            for chunk in fds.chunks(FDS_PER_MESSAGE) {
                // One byte carries each batch of fds (a stream socket passes
                // fds only along with data).
                channel
                    .send_with_fds(&[&[0u8][..]], chunk)
                    .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
            }
            Ok(())
        });
        match sent {
            Ok(()) => {
                info!(
                    "export {export}: handed over ({} fds); the successor serves it",
                    fds.len()
                );
                true
            }
            Err(e) => {
                handed_over.store(false, Ordering::Release);
                warn!("export {export}: handover failed: {e}");
                false
            }
        }
    }
}

impl Successor for HandoverPort {
    fn fd(&self) -> Option<RawFd> {
        self.listener.as_ref().map(AsRawFd::as_raw_fd)
    }

    fn close(&mut self) {
        self.listener = None;
    }

    fn knock(&mut self) -> Option<UnixStream> {
        match self.handshake() {
            Ok(channel) => channel,
            Err(e) => {
                warn!("export {}: handover request: {e}", self.export);
                None
            }
        }
    }
}

/// What a predecessor handed over for one export.
#[derive(Debug)]
pub struct Arrival {
    /// The export's listening socket.
    pub listener: UnixListener,
    /// Its live connection: the socket, the state and the other fds.
    pub connection: Option<(UnixStream, ConnectionState, Vec<File>)>,
    /// The process that handed it over (it is to be stopped).
    pub predecessor: i32,
}

/// Asks the daemon serving `socket` (an export of `queues` queues of at most
/// `max_queue_size`) to hand it over. None when no daemon listens for a
/// successor there (none runs, or a version without handovers) or it
/// refuses; the caller then waits for the socket as before.
pub fn receive(socket: &Path, queues: u16, max_queue_size: u16) -> io::Result<Option<Arrival>> {
    let Ok(mut stream) = UnixStream::connect_addr(&address(socket)?) else {
        return Ok(None);
    };
    let predecessor = same_user(&stream)?;
    stream.write_all(&encode(&Hello::ours(queues, max_queue_size)))?;
    let verdict: Verdict = decode(&read_frame(
        &mut stream,
        Instant::now() + HANDSHAKE_TIMEOUT,
    )?)
    .map_err(io::Error::other)?;
    if let Verdict::Refuse(why) = verdict {
        info!(
            "takeover: process {predecessor} refused to hand {} over: {why}",
            socket.display()
        );
        return Ok(None);
    }
    let body = read_frame(&mut stream, Instant::now() + STATE_TIMEOUT)?;
    let msg: Handover = decode(&body).map_err(io::Error::other)?;
    if msg.format != FORMAT {
        return Err(io::Error::other(format!(
            "handover state format {} (this binary reads {FORMAT})",
            msg.format
        )));
    }
    let mut files = receive_fds(&stream, msg.fd_count())?.into_iter();
    let listener = UnixListener::from(OwnedFd::from(files.next().expect("counted")));
    let connection = match msg.connection {
        Some(state) => {
            let socket = UnixStream::from(OwnedFd::from(files.next().expect("counted")));
            Some((socket, state, files.collect()))
        }
        None => None,
    };
    Ok(Some(Arrival {
        listener,
        connection,
        predecessor,
    }))
}

/// The session of a handed-over connection, its rings started where the
/// predecessor stopped them; None (the connection closed: the frontend
/// reconnects to the handed-over listener) when it cannot be restored.
pub(crate) fn resume(
    connection: Option<(UnixStream, ConnectionState, Vec<File>)>,
    shared: &Arc<ExportShared>,
) -> Option<Session> {
    let (stream, state, files) = connection?;
    let name = &shared.device.name;
    match Session::resume(stream, shared, &state, files) {
        Ok(s) => {
            info!("export {name}: connection taken over, rings resumed");
            Some(s)
        }
        Err(e) => {
            warn!("export {name}: the handed-over connection cannot be resumed: {e}");
            None
        }
    }
}

/// Receives `count` fds, [`FDS_PER_MESSAGE`] per message.
fn receive_fds(stream: &UnixStream, count: usize) -> io::Result<Vec<File>> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut files = Vec::with_capacity(count);
    while files.len() < count {
        let want = (count - files.len()).min(FDS_PER_MESSAGE);
        let mut byte = [0u8; 1];
        let mut iov = [libc::iovec {
            iov_base: byte.as_mut_ptr() as *mut libc::c_void,
            iov_len: 1,
        }];
        let mut raw = [-1 as RawFd; FDS_PER_MESSAGE];
        // SAFETY: the one iovec points at `byte`, live and writable for its
        // length; `raw` has room for FDS_PER_MESSAGE fds.
        let (n, got) = unsafe { stream.recv_with_fds(&mut iov, &mut raw[..want]) }
            .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        // SAFETY: the first `got` entries are fds the kernel just installed
        // in this process for us (SCM_RIGHTS); nothing else owns them.
        files.extend(
            raw[..got]
                .iter()
                .map(|&fd| unsafe { File::from_raw_fd(fd) }),
        );
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if got == 0 {
            return Err(io::Error::other("a handover message came without its fds"));
        }
    }
    Ok(files)
}
