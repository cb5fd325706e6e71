//! Hybrid polling for the adaptive mode: when to nap, how long to spin after, and
//! what a nap costs on this host.
//!
//! Each source learns its own rhythm ([`Rhythm`]), the mean and deviation of the gap
//! between its events (a queue's kicks; the completions, i.e. the device's latency;
//! gaps up to [`NAP_HORIZON_NS`]). The thread sleeps, notifications armed, with a
//! precise timer, until one timer overshoot before the earliest
//! `last event + gap - 2 dev` among the active sources ([`nap_at`]), then spins for
//! the overshoot plus 4 deviations, at most `poll-max-ns` ([`spin_ns`]). The
//! device's completions, whose gaps may scatter wider, are planned for with a
//! spin of the overshoot plus 3 deviations beyond `poll-max-ns` if that spin
//! is at most three quarters of their gap; any other source whose gaps scatter
//! too widely for a bounded spin is not planned for (`Rhythm::spin_for`).
//! After a pass that answered a guest, such a queue may send its next
//! requests at once: no nap. The
//! overshoot and the thread CPU one nap costs are measured by the IOThread
//! ([`NapTiming`]), not assumed; a nap must save [`MIN_NAP_SAVING_NS`] and a quarter
//! of its length over spinning through the same time. Naps may reach past
//! `poll-max-ns`, which bounds only spinning: an 80 us device is caught at the end
//! of a 70 us nap instead of by a wake-up.

use super::{
    ewma, jacobson, DEFAULT_NAP_CPU_NS, DEVICE_SOURCE, DEV_SHIFT, MEAN_SHIFT, MIN_NAP_NS,
    MIN_NAP_SAVING_NS, NAP_HORIZON_NS, NAP_SAMPLE_SPIN_NS,
};

/// Overshoot samples of a nap are capped at 1 ms (a preempted thread is not a
/// property of the timer).
pub(super) const NAP_SAMPLE_CAP_NS: u64 = 1_000_000;

/// The rhythm of one source: when its last event came and the mean gap between its
/// events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Rhythm {
    /// Time of the source's last event (0: none yet).
    last_at: u64,
    /// Mean of the time between its events (inter-arrivals up to
    /// [`NAP_HORIZON_NS`]; 0: no sample yet).
    gap_ns: u64,
    /// Mean deviation of the time between its events.
    gap_dev: u64,
}

impl Rhythm {
    /// The source had an event at `now_ns` (> 0): its gap since the previous one
    /// feeds the estimator unless it is longer than [`NAP_HORIZON_NS`] (an idle
    /// period). A second call with the same time is ignored.
    pub(super) fn observe(&mut self, now_ns: u64) {
        if self.last_at == now_ns {
            return;
        }
        let gap = now_ns.saturating_sub(self.last_at);
        if self.last_at != 0 && gap <= NAP_HORIZON_NS {
            jacobson(&mut self.gap_ns, &mut self.gap_dev, gap.max(1));
        }
        self.last_at = now_ns;
    }

    /// How long the spin after a nap planned for this source must last, or
    /// `None` if the source is not planned for.
    ///
    /// - A source whose spin, `late` + 4 deviations and the saving, fits in
    ///   `poll_max_ns` is caught by a bounded spin.
    /// - The device's completions (`device`) may scatter wider: a disk behind
    ///   this VM's virtual controller completes a queue-depth-16 batch
    ///   every 350 +- 60 us, and a wake-up added to each batch cost a tenth of
    ///   busy polling's IOPS. They are planned for with a spin of `late` + 3
    ///   deviations, beyond `poll-max-ns`, if that spin is at most three
    ///   quarters of their gap: as a nap, it must save a quarter of what
    ///   spinning through costs. Events later than the spin end a sleep.
    /// - Any other source that scatters wider is not planned for. A network
    ///   device (RBD completions at 300 +- 80 us) would end each nap in a
    ///   spin of `poll-max-ns` in vain nearly every time (measured: 5%
    ///   hits, 32 us of CPU per request), or in one of most of its gap; a
    ///   queue's kicks follow the thread's own answers (rule 3), not a
    ///   rhythm. Their events end a nap or a sleep as any notification does.
    ///   So does the device's where the spin would be longer (RBD at 300 +-
    ///   80 us with this VM's 60 us wake-up).
    fn spin_for(&self, late: u64, poll_max_ns: u64, device: bool) -> Option<u64> {
        let bounded = late
            .saturating_add(4 * self.gap_dev)
            .saturating_add(MIN_NAP_SAVING_NS);
        if bounded <= poll_max_ns {
            return Some(bounded);
        }
        let long = late
            .saturating_add(3 * self.gap_dev)
            .saturating_add(MIN_NAP_SAVING_NS);
        (device && long <= self.gap_ns - self.gap_ns / 4).then_some(long)
    }
}

/// Measured cost of a timed nap on this host: how late it ends and how much
/// thread CPU it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct NapTiming {
    /// Mean of how late a timed nap ends (0 = not measured yet: the wake-up latency
    /// stands in).
    late_ns: u64,
    /// Mean deviation of the lateness.
    late_dev: u64,
    /// Thread CPU time one nap costs.
    cpu_ns: u64,
    /// Sleeps without a timer since the lateness was last measured.
    unsampled: u32,
    /// When the thread started spinning without a measured nap since (0:
    /// not yet, or a nap was measured since).
    spin_since_ns: u64,
    /// The last measured nap came out far below the estimate: measure
    /// again at the next spin.
    sample_next_spin: bool,
}

impl Default for NapTiming {
    fn default() -> Self {
        NapTiming {
            late_ns: 0,
            late_dev: 0,
            cpu_ns: DEFAULT_NAP_CPU_NS,
            unsampled: 0,
            spin_since_ns: 0,
            sample_next_spin: false,
        }
    }
}

impl NapTiming {
    /// How late a nap may end: mean + 2 deviations, or `wakeup_ns` until measured.
    pub(super) fn late_ns(&self, wakeup_ns: u64) -> u64 {
        if self.late_ns == 0 {
            wakeup_ns
        } else {
            self.late_ns + 2 * self.late_dev
        }
    }

    /// How late a nap typically ends, once measured.
    pub(super) fn measured_late_ns(&self) -> Option<u64> {
        (self.late_ns != 0).then_some(self.late_ns)
    }

    /// How late a nap typically ends: the mean, or `wakeup_ns` until measured.
    fn mean_late_ns(&self, wakeup_ns: u64) -> u64 {
        if self.late_ns == 0 {
            wakeup_ns
        } else {
            self.late_ns
        }
    }

    /// Thread CPU time of one nap.
    pub(super) fn cpu_ns(&self) -> u64 {
        self.cpu_ns
    }

    /// Sets the thread CPU time of one nap.
    pub(super) fn set_cpu_ns(&mut self, cpu_ns: u64) {
        self.cpu_ns = cpu_ns;
    }

    /// A nap of `requested_ns` ended by its timer after `elapsed_ns`: see
    /// [`super::PollPolicy::observe_nap`].
    pub(super) fn observe(&mut self, requested_ns: u64, elapsed_ns: u64) {
        self.unsampled = 0;
        let mut x = elapsed_ns
            .saturating_sub(requested_ns)
            .clamp(1, NAP_SAMPLE_CAP_NS);
        // A nap far below the estimate (mean + 2 deviations): the estimate
        // is on its way down (a high calibration), and one sample moves it
        // by an eighth (its deviation by a quarter of the error); a thread
        // that spins measures again at its next spin rather than after
        // another stretch.
        self.sample_next_spin = x < self.late_ns(0) / 2;
        self.spin_since_ns = 0;
        if self.late_ns > 0 {
            // A nap that was preempted says little about the timer: one sample
            // moves the estimate by at most 3/8 of itself.
            x = x.min(4 * self.late_ns.max(1_000));
        }
        if self.late_ns == 0 {
            self.late_ns = x;
            self.late_dev = x / 2;
            return;
        }
        let err = x.abs_diff(self.late_ns);
        self.late_dev = ewma(self.late_dev, err, DEV_SHIFT);
        self.late_ns = ewma(self.late_ns, x, MEAN_SHIFT).max(1);
    }

    /// A sleep without a timer: how many there were since the lateness was
    /// last measured, this one included.
    pub(super) fn sleep_unsampled(&mut self) -> u32 {
        self.unsampled = self.unsampled.saturating_add(1);
        self.unsampled
    }

    /// A spin without a nap before it, at `now_ns`: whether the thread has
    /// spun [`NAP_SAMPLE_SPIN_NS`] since the lateness was last measured (or
    /// since the last such answer); the first call starts the count.
    pub(super) fn spin_unsampled(&mut self, now_ns: u64) -> bool {
        let now_ns = now_ns.max(1);
        let due = std::mem::take(&mut self.sample_next_spin)
            || (self.spin_since_ns != 0
                && now_ns.saturating_sub(self.spin_since_ns) >= NAP_SAMPLE_SPIN_NS);
        if due || self.spin_since_ns == 0 {
            self.spin_since_ns = now_ns;
        }
        due
    }

    /// Sets the lateness from a calibration (typical value and spread).
    pub(super) fn set_late(&mut self, typical_ns: u64, spread_ns: u64) {
        self.unsampled = 0;
        self.spin_since_ns = 0;
        self.sample_next_spin = false;
        self.late_ns = typical_ns.clamp(1, NAP_SAMPLE_CAP_NS);
        self.late_dev = spread_ns.min(NAP_SAMPLE_CAP_NS);
    }
}

/// How long to nap from `now_ns` given the sources' rhythms, indexed as the
/// policy's sources ([`DEVICE_SOURCE`] the device's), 0: do not nap;
/// `answered`: the pass before handed completions to a guest. See
/// [`super::PollPolicy::nap_at`].
pub(super) fn nap_at<'a>(
    rhythms: impl IntoIterator<Item = &'a Rhythm>,
    timing: &NapTiming,
    wakeup_ns: u64,
    poll_max_ns: u64,
    now_ns: u64,
    answered: bool,
) -> u64 {
    let late = timing.late_ns(wakeup_ns);
    let mut earliest = u64::MAX;
    for (i, r) in rhythms.into_iter().enumerate() {
        if r.last_at == 0 || now_ns.saturating_sub(r.last_at) >= NAP_HORIZON_NS {
            continue;
        }
        if r.gap_ns == 0 {
            return 0;
        }
        let device = i == DEVICE_SOURCE;
        if r.spin_for(late, poll_max_ns, device).is_none() {
            // A queue without a rhythm to plan for, just answered, may send
            // its next requests at once.
            if answered && !device {
                return 0;
            }
            continue;
        }
        let due = (r.last_at + r.gap_ns).saturating_sub(2 * r.gap_dev);
        earliest = earliest.min(due);
    }
    if earliest == u64::MAX {
        return 0;
    }
    let nap = earliest.saturating_sub(late).saturating_sub(now_ns);
    // CPU saved against spinning through the nap's whole length; it must be
    // worth the risk of a late timer: 2 us, and a quarter of the length.
    let length = nap + timing.mean_late_ns(wakeup_ns);
    let saving = length.saturating_sub(timing.cpu_ns);
    if nap < MIN_NAP_NS || saving < MIN_NAP_SAVING_NS.max(length / 4) {
        0
    } else {
        nap.min(NAP_HORIZON_NS)
    }
}

/// How long to spin after a nap, given the rhythms indexed as in
/// [`nap_at`]; see [`super::PollPolicy::nap_spin_ns`].
pub(super) fn spin_ns<'a>(
    rhythms: impl IntoIterator<Item = &'a Rhythm>,
    timing: &NapTiming,
    wakeup_ns: u64,
    poll_max_ns: u64,
) -> u64 {
    let late = timing.late_ns(wakeup_ns);
    // The longest spin among the sources a nap plans for (see `nap_at`); an
    // unplanned source's spread would stretch every spin to poll-max-ns.
    let floor = (late + MIN_NAP_SAVING_NS).min(poll_max_ns);
    rhythms
        .into_iter()
        .enumerate()
        .filter(|(_, r)| r.last_at != 0 && r.gap_ns != 0)
        .filter_map(|(i, r)| r.spin_for(late, poll_max_ns, i == DEVICE_SOURCE))
        .fold(floor, u64::max)
}
