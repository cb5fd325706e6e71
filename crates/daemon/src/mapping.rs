//! Virtqueue to IOThread mapping: which IOThread owns which virtqueue of an export.
//!
//! This is a pure policy module (no threads, no I/O), modelled on QEMU's
//! `iothread-vq-mapping` property of virtio-blk: every virtqueue is owned by
//! exactly one IOThread, either round-robin over a list of IOThreads or through an
//! explicit list of `(iothread, vqs)` assignments.

use std::fmt;

/// Why a mapping was rejected. Each message says what would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// The export has no IOThread to run its queues on.
    #[error("no IOThread to map the queues onto (list at least one IOThread)")]
    NoThreads,
    /// An IOThread index is not part of the pool.
    #[error("IOThread {thread} does not exist (the pool has IOThreads 0..={max})", max = pool.saturating_sub(1))]
    UnknownThread {
        /// The IOThread index that was named.
        thread: usize,
        /// Number of IOThreads in the pool.
        pool: usize,
    },
    /// A queue index is not below the export's queue count.
    #[error("virtqueue {queue} is out of range (the export has queues 0..={max})", max = num_queues.saturating_sub(1))]
    QueueOutOfRange {
        /// The queue index that was named.
        queue: u16,
        /// Number of queues of the export.
        num_queues: u16,
    },
    /// A queue was assigned to two IOThreads (or twice to the same one).
    #[error("virtqueue {queue} is assigned twice (to IOThread {first} and IOThread {second})")]
    Duplicate {
        /// The queue index.
        queue: u16,
        /// The first IOThread it was given to.
        first: usize,
        /// The second IOThread it was given to.
        second: usize,
    },
    /// A queue was left without an IOThread.
    #[error("virtqueue {queue} is not assigned to any IOThread (every queue 0..={max} needs one)", max = num_queues.saturating_sub(1))]
    Unassigned {
        /// The queue index.
        queue: u16,
        /// Number of queues of the export.
        num_queues: u16,
    },
    /// The textual form could not be parsed.
    #[error("cannot parse mapping {spec:?}: {reason} (expected IOTHREAD:VQ,VQ;IOTHREAD:VQ,... e.g. \"0:0,2;1:1,3\")")]
    Syntax {
        /// The text that was given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// One explicit assignment: an IOThread and the virtqueues it owns.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Assignment {
    /// Index of the IOThread in the pool.
    pub iothread: usize,
    /// Virtqueue indexes owned by that IOThread.
    pub vqs: Vec<u16>,
}

/// The owner IOThread of every virtqueue of one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtqueueMap {
    owner: Vec<usize>,
}

impl VirtqueueMap {
    /// Queue `i` goes to `threads[i mod threads.len()]`, as QEMU does when an
    /// export lists IOThreads without `vqs`.
    pub fn round_robin(num_queues: u16, threads: &[usize], pool: usize) -> Result<Self, MapError> {
        if threads.is_empty() {
            return Err(MapError::NoThreads);
        }
        for &thread in threads {
            if thread >= pool {
                return Err(MapError::UnknownThread { thread, pool });
            }
        }
        let owner = (0..num_queues as usize)
            .map(|q| threads[q % threads.len()])
            .collect();
        Ok(VirtqueueMap { owner })
    }

    /// Every queue must be assigned exactly once.
    pub fn explicit(
        num_queues: u16,
        assignments: &[Assignment],
        pool: usize,
    ) -> Result<Self, MapError> {
        if assignments.is_empty() {
            return Err(MapError::NoThreads);
        }
        let mut owner: Vec<Option<usize>> = vec![None; num_queues as usize];
        for a in assignments {
            if a.iothread >= pool {
                return Err(MapError::UnknownThread {
                    thread: a.iothread,
                    pool,
                });
            }
            for &queue in &a.vqs {
                let slot = owner
                    .get_mut(queue as usize)
                    .ok_or(MapError::QueueOutOfRange { queue, num_queues })?;
                if let Some(first) = *slot {
                    return Err(MapError::Duplicate {
                        queue,
                        first,
                        second: a.iothread,
                    });
                }
                *slot = Some(a.iothread);
            }
        }
        let owner = owner
            .into_iter()
            .enumerate()
            .map(|(q, t)| {
                t.ok_or(MapError::Unassigned {
                    queue: q as u16,
                    num_queues,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(VirtqueueMap { owner })
    }

    /// Parses the command-line form `IOTHREAD:VQ,VQ;IOTHREAD:VQ,...`.
    pub fn parse_spec(spec: &str) -> Result<Vec<Assignment>, MapError> {
        let syntax = |reason: String| MapError::Syntax {
            spec: spec.to_string(),
            reason,
        };
        let mut out = Vec::new();
        for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (thread, vqs) = part
                .split_once(':')
                .ok_or_else(|| syntax(format!("{part:?} has no ':'")))?;
            let iothread = thread
                .trim()
                .parse()
                .map_err(|_| syntax(format!("{thread:?} is not an IOThread index")))?;
            let vqs = vqs
                .split(',')
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(|v| {
                    v.parse()
                        .map_err(|_| syntax(format!("{v:?} is not a virtqueue index")))
                })
                .collect::<Result<Vec<u16>, _>>()?;
            if vqs.is_empty() {
                return Err(syntax(format!("IOThread {iothread} lists no virtqueues")));
            }
            out.push(Assignment { iothread, vqs });
        }
        if out.is_empty() {
            return Err(syntax("it is empty".into()));
        }
        Ok(out)
    }

    /// Number of virtqueues mapped.
    pub fn num_queues(&self) -> u16 {
        self.owner.len() as u16
    }

    /// The IOThread that owns `queue`.
    pub fn thread_of(&self, queue: u16) -> usize {
        self.owner[queue as usize]
    }

    /// Gives `queue` to `thread` (`queue-move`); returns its previous owner.
    /// `pool` is the number of IOThreads.
    pub fn set_thread(
        &mut self,
        queue: u16,
        thread: usize,
        pool: usize,
    ) -> Result<usize, MapError> {
        if thread >= pool {
            return Err(MapError::UnknownThread { thread, pool });
        }
        let num_queues = self.num_queues();
        let owner = self
            .owner
            .get_mut(queue as usize)
            .ok_or(MapError::QueueOutOfRange { queue, num_queues })?;
        Ok(std::mem::replace(owner, thread))
    }

    /// The virtqueues owned by `thread`, in increasing order.
    pub fn queues_of(&self, thread: usize) -> Vec<u16> {
        (0..self.num_queues())
            .filter(|&q| self.thread_of(q) == thread)
            .collect()
    }

    /// The IOThreads that own at least one queue, in increasing order.
    pub fn threads(&self) -> Vec<usize> {
        let mut t = self.owner.clone();
        t.sort_unstable();
        t.dedup();
        t
    }
}

impl fmt::Display for VirtqueueMap {
    /// Prints the mapping in the `--map` syntax.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .threads()
            .into_iter()
            .map(|t| {
                let q: Vec<String> = self.queues_of(t).iter().map(u16::to_string).collect();
                format!("{t}:{}", q.join(","))
            })
            .collect();
        write!(f, "{}", parts.join(";"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_spreads_queues() {
        let m = VirtqueueMap::round_robin(8, &[0, 1, 2, 3], 4).unwrap();
        assert_eq!(m.queues_of(0), vec![0, 4]);
        assert_eq!(m.queues_of(3), vec![3, 7]);
        assert_eq!(m.to_string(), "0:0,4;1:1,5;2:2,6;3:3,7");
    }

    #[test]
    fn round_robin_over_subset_and_more_threads_than_queues() {
        let m = VirtqueueMap::round_robin(3, &[2, 5], 6).unwrap();
        assert_eq!(m.thread_of(0), 2);
        assert_eq!(m.thread_of(1), 5);
        assert_eq!(m.thread_of(2), 2);
        let m = VirtqueueMap::round_robin(2, &[0, 1, 2, 3], 4).unwrap();
        assert_eq!(m.threads(), vec![0, 1]);
    }

    #[test]
    fn round_robin_rejects_bad_threads() {
        assert_eq!(
            VirtqueueMap::round_robin(2, &[], 4),
            Err(MapError::NoThreads)
        );
        assert_eq!(
            VirtqueueMap::round_robin(2, &[0, 4], 4),
            Err(MapError::UnknownThread { thread: 4, pool: 4 })
        );
    }

    #[test]
    fn explicit_mapping_like_qemu() {
        let a = VirtqueueMap::parse_spec("0:0,2;1:1,3").unwrap();
        let m = VirtqueueMap::explicit(4, &a, 2).unwrap();
        assert_eq!(m.queues_of(0), vec![0, 2]);
        assert_eq!(m.queues_of(1), vec![1, 3]);
    }

    #[test]
    fn explicit_mapping_errors() {
        let a = VirtqueueMap::parse_spec("0:0,2;1:1").unwrap();
        assert_eq!(
            VirtqueueMap::explicit(4, &a, 2),
            Err(MapError::Unassigned {
                queue: 3,
                num_queues: 4
            })
        );
        let a = VirtqueueMap::parse_spec("0:0,1;1:1,2,3").unwrap();
        assert_eq!(
            VirtqueueMap::explicit(4, &a, 2),
            Err(MapError::Duplicate {
                queue: 1,
                first: 0,
                second: 1
            })
        );
        let a = VirtqueueMap::parse_spec("0:0,1,2,3,4").unwrap();
        assert_eq!(
            VirtqueueMap::explicit(4, &a, 2),
            Err(MapError::QueueOutOfRange {
                queue: 4,
                num_queues: 4
            })
        );
        let a = VirtqueueMap::parse_spec("7:0").unwrap();
        assert_eq!(
            VirtqueueMap::explicit(1, &a, 2),
            Err(MapError::UnknownThread { thread: 7, pool: 2 })
        );
    }

    #[test]
    fn a_queue_changes_owner_and_bad_indexes_are_refused() {
        let mut m = VirtqueueMap::round_robin(4, &[0, 1], 3).unwrap();
        assert_eq!(m.set_thread(1, 2, 3), Ok(1));
        assert_eq!(m.thread_of(1), 2);
        assert_eq!(m.to_string(), "0:0,2;1:3;2:1");
        assert_eq!(m.set_thread(1, 2, 3), Ok(2), "same owner: nothing changes");
        assert_eq!(
            m.set_thread(4, 0, 3),
            Err(MapError::QueueOutOfRange {
                queue: 4,
                num_queues: 4
            })
        );
        assert_eq!(
            m.set_thread(0, 3, 3),
            Err(MapError::UnknownThread { thread: 3, pool: 3 })
        );
        assert_eq!(m.thread_of(0), 0, "a refused move changes nothing");
    }

    #[test]
    fn spec_syntax_errors_name_the_part() {
        for bad in ["", "0", "x:1", "0:a", "0:"] {
            let e = VirtqueueMap::parse_spec(bad).unwrap_err();
            assert!(matches!(e, MapError::Syntax { .. }), "{bad}: {e}");
        }
        let msg = VirtqueueMap::parse_spec("0:a").unwrap_err().to_string();
        assert!(msg.contains("\"a\" is not a virtqueue index"), "{msg}");
    }
}
