//! An IOThread's control commands ([`Command`]): a ring attached, released
//! (GET_VRING_BASE, disconnect, `queue-move`), a new call fd, polling knobs,
//! a dirty log, I/O limits, stop. They arrive on the thread's channel with a
//! wake-up eventfd and are handled between passes, so no lock is taken on the
//! data path.

use super::*;

impl IoThread {
    pub(super) fn handle_commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            self.commanded = true;
            match cmd {
                Command::Attach(a) => self.attach(*a),
                Command::Detach { key, reply } => {
                    // Never attached here: nothing to drain (the reply is dropped).
                    self.release(key, Release::Detach(reply));
                }
                Command::Handover { key, to, reply } => {
                    let inflight = self
                        .queues
                        .find(key)
                        .and_then(|id| self.queues.get(id))
                        .map(|q| q.inflight);
                    match inflight {
                        Some(drained) => self.release(
                            key,
                            Release::Handover {
                                to,
                                reply,
                                drained,
                                since: Instant::now(),
                            },
                        ),
                        // Not served here (the ring is not started): nothing moves.
                        None => {
                            let _ = reply.send(None);
                        }
                    }
                }
                Command::SetCall { key, call } => {
                    if let Some(q) = self.queues.find(key).and_then(|id| self.queues.get_mut(id)) {
                        q.call = call;
                    }
                }
                Command::SetPoll { mode, params } => {
                    self.policy = PollPolicy::new(mode, params, self.queues.len() + 1);
                    // Adaptive naps need the host's nap cost (about 1 ms to measure).
                    if mode == PollMode::Adaptive {
                        self.calibrate_naps();
                    }
                    debug!("{}: polling now {mode:?} {params:?}", self.name);
                }
                Command::SetLog { key, log, applied } => {
                    self.queues.set_log(key, log);
                    let _ = applied.send(());
                }
                Command::NewMemory { key, applied } => {
                    if let Some(q) = self.queues.find(key).and_then(|id| self.queues.get_mut(id)) {
                        q.forget_pass_memory();
                    }
                    let _ = applied.send(());
                }
                Command::SetThrottle { device, throttle } => {
                    for (_, q) in self.queues.iter_mut() {
                        if Arc::ptr_eq(&q.device, &device) {
                            q.set_throttle(throttle.clone());
                        }
                    }
                    self.timer_dirty = true;
                }
                Command::Stop => {
                    self.stopping = true;
                    // A drain does not wait for the limits.
                    for (id, q) in self.queues.iter_mut() {
                        q.submit_held(id, &mut self.executor);
                    }
                    // Stop accepting guest work: detach-style drain of every queue.
                    for (_, q) in self.queues.iter() {
                        let _ = self.epoll.ctl(
                            ControlOperation::Delete,
                            q.kick.as_raw_fd(),
                            EpollEvent::default(),
                        );
                    }
                }
            }
        }
    }

    /// Stops popping queue `key` and stops watching its kick fd; once its
    /// in-flight requests are done, [`Self::finish_pass`] lets it go as
    /// `why` says. A queue not served here is left alone.
    /// A request held back by the limits is submitted at once: a drain does
    /// not wait for them (QEMU's drain does the same).
    pub(super) fn release(&mut self, key: QueueKey, why: Release) {
        let Some(id) = self.queues.find(key) else {
            return;
        };
        if let Some(q) = self.queues.get_mut(id) {
            q.submit_held(id, &mut self.executor);
            self.timer_dirty = true;
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                q.kick.as_raw_fd(),
                EpollEvent::default(),
            );
            q.release(why);
        }
    }

    pub(super) fn attach(&mut self, a: QueueAttach) {
        let id = self.queues.next_free();
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            a.kick.as_raw_fd(),
            EpollEvent::new(
                EventSet::IN | EventSet::EDGE_TRIGGERED,
                TOKEN_KICK_BASE + id.0 as u64,
            ),
        ) {
            error!(
                "{}: cannot watch kick fd of {}/q{}: {e}",
                self.name, a.device.name, a.key.queue
            );
            return;
        }
        let counters = self.stats.queue(&a.device.name, a.key.queue);
        // Room for a full queue in flight, made now rather than per request.
        self.executor.reserve(usize::from(a.queue.size()));
        debug!(
            "{}: serving {} queue {}",
            self.name, a.device.name, a.key.queue
        );
        let id = self.queues.insert(QueueSlot::new(a, counters));
        self.policy.set_num_sources(self.queues.len() + 1);
        // Requests may have been queued before the kick fd was handed over
        // (outside a pass: a clock of its own).
        let now = monotonic_ns();
        self.process_queue(id, true, now);
        self.complete_all(now);
        self.finish_pass();
    }
}
