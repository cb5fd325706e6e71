//! What one process hands the next during an upgrade without reconnect
//! (`vqblk serve --takeover`), as data: the handshake that decides whether
//! the successor can take the connections at all, the state of a live
//! vhost-user connection, the order of the file descriptors that travel with
//! it (`SCM_RIGHTS`), and the framing of the messages. Pure: no socket is
//! touched here (`daemon::handover` moves the bytes and the fds).
//!
//! The rings are drained before the state is taken (nothing is in flight),
//! so the state needs no request: each ring's next avail index is the one
//! the drain stopped at, and its used index is read back from guest memory
//! by the successor, as on any ring start.

use serde::{Deserialize, Serialize};

/// First field of every handshake: not a vqblk handover otherwise.
pub const MAGIC: &str = "vqblk-handover";
/// Version of the state below; a change of any field's meaning bumps it.
pub const FORMAT: u32 = 1;
/// Largest message (a connection with every memory slot in use stays far below).
pub const MAX_MESSAGE: usize = 1 << 20;
/// Fds sent per `sendmsg` (the kernel takes up to 253; one vhost-user message
/// carries at most 32, so every path that handles fds is sized for that).
pub const FDS_PER_MESSAGE: usize = 16;

/// The successor introduces itself: which binary it is and the shape of the
/// export it would serve on that socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`MAGIC`].
    pub magic: String,
    /// [`FORMAT`] of the sender.
    pub format: u32,
    /// The sender's `vqblk` version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// Queues of the export (the guest's driver sized itself for them).
    pub queues: u16,
    /// Largest queue size a ring may have.
    pub max_queue_size: u16,
}

impl Hello {
    /// This binary's hello for an export of `queues` queues of at most
    /// `max_queue_size`.
    pub fn ours(queues: u16, max_queue_size: u16) -> Hello {
        Hello {
            magic: MAGIC.into(),
            format: FORMAT,
            version: env!("CARGO_PKG_VERSION").into(),
            queues,
            max_queue_size,
        }
    }

    /// Whether a process saying `self` can take over from one saying `ours`:
    /// the same magic, state format and binary version (a state written by
    /// another version may mean something else even at the same format), and
    /// the same device shape (the guest's driver keeps the one it saw). The
    /// error says why not, for both logs.
    pub fn check_against(&self, ours: &Hello) -> Result<(), String> {
        if self.magic != ours.magic {
            return Err("not a vqblk handover".into());
        }
        if self.format != ours.format || self.version != ours.version {
            return Err(format!(
                "version mismatch: the successor is vqblk {} (state format {}), \
                 this daemon vqblk {} (format {})",
                self.version, self.format, ours.version, ours.format
            ));
        }
        if (self.queues, self.max_queue_size) != (ours.queues, ours.max_queue_size) {
            return Err(format!(
                "the successor's export has {} queues of at most {}, this one {} of at most {}",
                self.queues, self.max_queue_size, ours.queues, ours.max_queue_size
            ));
        }
        Ok(())
    }
}

/// The answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// The handover follows: a [`Handover`] message and its fds.
    Accept,
    /// No handover; the sender keeps serving (the successor falls back to
    /// waiting for the socket, and the frontend reconnects).
    Refuse(String),
}

/// The export's listening socket (always the first fd), and its frontend
/// connection when one was live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handover {
    /// [`FORMAT`].
    pub format: u32,
    /// The connected frontend, if any.
    pub connection: Option<ConnectionState>,
}

impl Handover {
    /// How many fds travel with this message (listener first).
    pub fn fd_count(&self) -> usize {
        1 + self
            .connection
            .as_ref()
            .map_or(0, ConnectionState::fd_count)
    }
}

/// One guest memory region (vhost-user `VhostUserMemoryRegion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionState {
    /// Guest physical address.
    pub guest_phys_addr: u64,
    /// Size in bytes.
    pub memory_size: u64,
    /// The frontend's virtual address of the region.
    pub user_addr: u64,
    /// Offset of the region in its file.
    pub mmap_offset: u64,
}

/// The inflight region's description (vhost-user `VhostUserInflight`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InflightState {
    /// Bytes mapped.
    pub mmap_size: u64,
    /// Offset in the file.
    pub mmap_offset: u64,
    /// Queues it describes.
    pub num_queues: u16,
    /// Their size.
    pub queue_size: u16,
}

/// The dirty log's description (vhost-user `VhostUserLog`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogState {
    /// Bytes mapped.
    pub mmap_size: u64,
    /// Offset in the file.
    pub mmap_offset: u64,
}

/// One vring as the frontend set it up, stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct VringState {
    /// SET_VRING_NUM (0: unset).
    pub size: u16,
    /// Guest addresses of the descriptor table, avail and used rings.
    pub desc: u64,
    /// Avail ring.
    pub avail: u64,
    /// Used ring.
    pub used: u64,
    /// A valid SET_VRING_ADDR was received.
    pub addr_set: bool,
    /// Where the ring goes on: the next avail index after the drain (or
    /// SET_VRING_BASE's, for a ring that never started).
    pub next_avail: u16,
    /// SET_VRING_ENABLE.
    pub enabled: bool,
    /// A kick fd travels for this ring.
    pub kick: bool,
    /// A call fd travels for this ring.
    pub call: bool,
    /// The used ring's guest address in the dirty log (VHOST_VRING_F_LOG).
    pub log_used: Option<u64>,
}

/// A live vhost-user connection, stopped. Its fds follow in the order of
/// [`ConnectionState::fd_count`]: the connected socket, one per memory region,
/// the inflight region's, the dirty log's, then each ring's kick and call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionState {
    /// SET_OWNER was received.
    pub owned: bool,
    /// Virtio features the frontend acked (SET_FEATURES).
    pub acked_features: u64,
    /// Protocol features it acked (SET_PROTOCOL_FEATURES), if it did.
    pub acked_protocol_features: Option<u64>,
    /// Guest memory, in table order.
    pub regions: Vec<RegionState>,
    /// INFLIGHT_SHMFD region.
    pub inflight: Option<InflightState>,
    /// Dirty log of SET_LOG_BASE.
    pub log: Option<LogState>,
    /// Every vring of the export, by index.
    pub vrings: Vec<VringState>,
}

impl ConnectionState {
    /// Fds of this connection: its socket, its regions, inflight, log, kicks, calls.
    pub fn fd_count(&self) -> usize {
        1 + self.regions.len()
            + usize::from(self.inflight.is_some())
            + usize::from(self.log.is_some())
            + self
                .vrings
                .iter()
                .map(|v| usize::from(v.kick) + usize::from(v.call))
                .sum::<usize>()
    }
}

/// Why a handover message is unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// The length prefix is over [`MAX_MESSAGE`].
    #[error("handover message of {0} bytes (at most {MAX_MESSAGE})")]
    TooLong(usize),
    /// Not the JSON expected.
    #[error("handover message: {0}")]
    Json(String),
}

/// A message as it goes on the wire: its length (u32, little endian), then
/// its JSON.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let json = serde_json::to_vec(msg).expect("handover messages serialize");
    let mut out = (json.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out
}

/// The length a 4-byte prefix announces, if acceptable.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let n = u32::from_le_bytes(prefix) as usize;
    if n > MAX_MESSAGE {
        return Err(FrameError::TooLong(n));
    }
    Ok(n)
}

/// Parses a message body (after its prefix).
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Json(e.to_string()))
}

/// The abstract unix socket name a daemon listens on for its successor, for
/// the export socket at `socket` (an absolute path, symlinks of its folder
/// resolved, so both processes derive the same name). Names longer than the
/// 107 bytes an abstract address holds use a hash of the path instead.
pub fn listener_name(socket: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let bytes = socket.as_os_str().as_bytes();
    let plain = format!("vqblk-handover:{}", socket.display());
    if plain.len() <= 100 && std::str::from_utf8(bytes).is_ok() {
        return plain;
    }
    // FNV-1a: the same in every build (std's hasher may change between Rust
    // releases, and the two processes may be built by different ones).
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("vqblk-handover:#{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn state() -> ConnectionState {
        ConnectionState {
            owned: true,
            acked_features: 1 << 32 | 1 << 30,
            acked_protocol_features: Some(0x2c0b),
            regions: vec![
                RegionState {
                    guest_phys_addr: 0,
                    memory_size: 1 << 30,
                    user_addr: 0x7f00_0000_0000,
                    mmap_offset: 0,
                },
                RegionState {
                    guest_phys_addr: 1 << 32,
                    memory_size: 1 << 20,
                    user_addr: 0x7f80_0000_0000,
                    mmap_offset: 4096,
                },
            ],
            inflight: Some(InflightState {
                mmap_size: 4160,
                mmap_offset: 0,
                num_queues: 2,
                queue_size: 128,
            }),
            log: None,
            vrings: vec![
                VringState {
                    size: 128,
                    desc: 0x1000,
                    avail: 0x2000,
                    used: 0x3000,
                    addr_set: true,
                    next_avail: 65_535,
                    enabled: true,
                    kick: true,
                    call: true,
                    log_used: Some(0x3000),
                },
                VringState {
                    kick: true,
                    ..VringState::default()
                },
            ],
        }
    }

    #[test]
    fn a_handover_survives_the_wire() {
        let h = Handover {
            format: FORMAT,
            connection: Some(state()),
        };
        let wire = encode(&h);
        let n = frame_len(wire[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, wire.len() - 4);
        assert_eq!(decode::<Handover>(&wire[4..]).unwrap(), h);
        let idle = Handover {
            format: FORMAT,
            connection: None,
        };
        assert_eq!(decode::<Handover>(&encode(&idle)[4..]).unwrap(), idle);
    }

    #[test]
    fn fds_are_counted_in_their_order() {
        let mut s = state();
        // Socket, 2 regions, inflight, kick+call of ring 0, kick of ring 1.
        assert_eq!(s.fd_count(), 1 + 2 + 1 + 2 + 1);
        s.log = Some(LogState {
            mmap_size: 4096,
            mmap_offset: 0,
        });
        assert_eq!(s.fd_count(), 8);
        let h = Handover {
            format: FORMAT,
            connection: Some(s),
        };
        assert_eq!(h.fd_count(), 9, "listener first");
        let idle = Handover {
            format: FORMAT,
            connection: None,
        };
        assert_eq!(idle.fd_count(), 1);
    }

    #[test]
    fn the_handshake_refuses_another_version_or_shape() {
        let ours = Hello::ours(4, 256);
        assert_eq!(Hello::ours(4, 256).check_against(&ours), Ok(()));
        let other = Hello {
            version: "0.0.0-other".into(),
            ..ours.clone()
        };
        let e = other.check_against(&ours).unwrap_err();
        assert!(
            e.contains("version mismatch") && e.contains("0.0.0-other"),
            "{e}"
        );
        let newer = Hello {
            format: FORMAT + 1,
            ..ours.clone()
        };
        assert!(newer.check_against(&ours).is_err());
        let stranger = Hello {
            magic: "hello".into(),
            ..ours.clone()
        };
        assert_eq!(
            stranger.check_against(&ours),
            Err("not a vqblk handover".into())
        );
        let e = Hello::ours(2, 256).check_against(&ours).unwrap_err();
        assert!(e.contains("2 queues"), "{e}");
        assert!(Hello::ours(4, 128).check_against(&ours).is_err());
    }

    #[test]
    fn verdicts_and_hellos_parse_from_what_another_build_writes() {
        let v: Verdict = decode(br#"{"refuse":"busy"}"#).unwrap();
        assert_eq!(v, Verdict::Refuse("busy".into()));
        assert_eq!(decode::<Verdict>(br#""accept""#).unwrap(), Verdict::Accept);
        let h: Hello = decode(
            br#"{"magic":"vqblk-handover","format":1,"version":"9","queues":1,"max_queue_size":8}"#,
        )
        .unwrap();
        assert_eq!(h.queues, 1);
        assert!(decode::<Hello>(b"{}").is_err());
        assert!(decode::<Handover>(b"not json").is_err());
    }

    #[test]
    fn oversized_frames_are_refused() {
        assert_eq!(
            frame_len((MAX_MESSAGE as u32).to_le_bytes()),
            Ok(MAX_MESSAGE)
        );
        assert_eq!(
            frame_len((MAX_MESSAGE as u32 + 1).to_le_bytes()),
            Err(FrameError::TooLong(MAX_MESSAGE + 1))
        );
    }

    #[test]
    fn listener_names_fit_an_abstract_address_and_differ_by_path() {
        let a = listener_name(Path::new("/run/vqblk/vm1.sock"));
        assert_eq!(a, "vqblk-handover:/run/vqblk/vm1.sock");
        assert_ne!(a, listener_name(Path::new("/run/vqblk/vm2.sock")));
        let long = format!("/{}/vm.sock", "d".repeat(200));
        let h = listener_name(Path::new(&long));
        assert!(h.len() < 107, "{h}");
        assert_eq!(h, listener_name(Path::new(&long)), "stable");
        let other = format!("/{}/vm2.sock", "d".repeat(200));
        assert_ne!(h, listener_name(Path::new(&other)));
    }
}
