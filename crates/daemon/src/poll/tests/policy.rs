//! Parameters, the constant modes (off, busy), and changes at run time.

use super::*;

#[test]
fn defaults_match_qemu() {
    let p = PollParams::default();
    assert_eq!(p.poll_max_ns, 32_768);
    assert_eq!(p.poll_grow, 0);
    assert_eq!(p.poll_shrink, 0);
    assert_eq!(p.poll_weight, 3);
    assert_eq!(p.qemu_mode(), PollMode::Weighted);
    assert_eq!(params(32_768, 0, 0, 0).qemu_mode(), PollMode::Classic);
    assert_eq!(p.validate(), Ok(()));
    let a = AdaptiveParams::default();
    assert_eq!(
        (
            a.wakeup_ns,
            a.margin_pct,
            a.miss_limit,
            a.latency_budget_pct
        ),
        (15_000, 50, 3, 2)
    );
}

#[test]
fn params_deserialize_kebab_case_with_defaults() {
    let p: PollParams = toml::from_str("poll-max-ns = 50000\npoll-weight = 2").unwrap();
    assert_eq!(p, params(50_000, 0, 0, 2));
    let p: PollParams = serde_json::from_str(r#"{"poll-grow": 4, "poll-shrink": 8}"#).unwrap();
    assert_eq!(p, params(32_768, 4, 8, 3));
    assert!(toml::from_str::<PollParams>("poll-max = 1").is_err());
    let a: AdaptiveParams = toml::from_str("wakeup-ns = 20000").unwrap();
    assert_eq!(a.wakeup_ns, 20_000);
    assert_eq!(a.margin_pct, 50);
    let m: PollMode = serde_json::from_str(r#""adaptive""#).unwrap();
    assert_eq!(m, PollMode::Adaptive);
    use clap::ValueEnum;
    assert_eq!(
        PollMode::from_str("weighted", false),
        Ok(PollMode::Weighted)
    );
    assert_eq!(PollMode::value_variants().len(), 5);
}

#[test]
fn weight_out_of_range_is_rejected_and_clamped() {
    let err = params(32_768, 0, 0, 64).validate().unwrap_err();
    assert_eq!(err, PollParamsError::Weight(64));
    assert!(err.to_string().contains("poll-weight = 64"));
    assert!(err.to_string().contains("0 to 63"));
    // Never panics on the shift even if not validated.
    let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 200), 1);
    p.update(5_000, &[0], false);
    p.update(5_000, &[0], false);
    assert_eq!(p.poll_ns(), 5_000);
}

// ---- off / busy ---------------------------------------------------------

#[test]
fn off_and_busy_are_constant() {
    for max in [0, 32_768] {
        let mut off = PollPolicy::new(PollMode::Off, params(max, 0, 0, 0), 2);
        let mut busy = PollPolicy::new(PollMode::Busy, params(max, 0, 0, 0), 2);
        for (b, ev, hit) in [
            (1_000, &[0][..], true),
            (1_000_000, &[][..], false),
            (7, &[1][..], false),
        ] {
            off.update(b, ev, hit);
            busy.update(b, ev, hit);
            assert_eq!(off.poll_ns(), 0);
            assert_eq!(busy.poll_ns(), u64::MAX);
        }
    }
    let mut busy = PollPolicy::new(PollMode::Busy, PollParams::default(), 1);
    let r = simulate(&mut busy, &[1_000, 500_000, 8_000]);
    assert_eq!(
        r,
        SimResult {
            poll_cpu_ns: 509_000,
            wasted_cpu_ns: 0,
            sleeps: 0,
            hits: 3,
            added_latency_ns: 0
        }
    );
    let mut off = PollPolicy::new(PollMode::Off, PollParams::default(), 1);
    let r = simulate(&mut off, &[1_000, 500_000, 8_000]);
    assert_eq!(
        r,
        SimResult {
            poll_cpu_ns: 0,
            wasted_cpu_ns: 0,
            sleeps: 3,
            hits: 0,
            added_latency_ns: 45_000
        }
    );
}

#[test]
fn poll_max_zero_never_polls() {
    for mode in [PollMode::Classic, PollMode::Weighted, PollMode::Adaptive] {
        let mut p = PollPolicy::new(mode, params(0, 0, 0, 3), 2);
        for _ in 0..50 {
            p.update(2_000, &[0, 1], true);
            assert_eq!(p.poll_ns(), 0, "{mode:?}");
        }
        let r = simulate(&mut p, &[100; 100]);
        assert_eq!(r.hits, 0, "{mode:?}");
        assert_eq!(r.poll_cpu_ns, 0, "{mode:?}");
    }
}

#[test]
fn set_num_sources_shrinking_and_growing() {
    for mode in [PollMode::Classic, PollMode::Adaptive] {
        let mut p = PollPolicy::new(mode, PollParams::default(), 2);
        for _ in 0..50 {
            p.update(3_000, &[0], true);
            p.update(25_000, &[1], true);
        }
        let both = p.poll_ns();
        assert!(both >= 25_000, "{mode:?} {both}");
        p.set_num_sources(1);
        assert_eq!(p.num_sources(), 1);
        assert!(
            p.poll_ns() < both,
            "{mode:?}: removed source no longer counts"
        );
        assert_eq!(p.source_poll_ns(1), None);
        p.set_num_sources(3);
        assert_eq!(
            p.source_poll_ns(1),
            Some(0),
            "{mode:?}: re-added source is fresh"
        );
        assert_eq!(p.source_poll_ns(2), Some(0));
        p.update(3_000, &[2], true);
        assert!(p.source_poll_ns(2).unwrap() > 0);
    }
    // Weighted keeps its IOThread window; the removed source's average is gone.
    let mut p = PollPolicy::new(PollMode::Weighted, PollParams::default(), 2);
    p.update(20_000, &[1], false);
    p.set_num_sources(1);
    assert_eq!(p.poll_ns(), 20_000);
    p.set_num_sources(2);
    assert_eq!(p.source_poll_ns(1), Some(0));
    // Zero sources: nothing to poll for.
    let mut p = PollPolicy::new(PollMode::Classic, PollParams::default(), 1);
    p.update(10_000, &[0], false);
    p.set_num_sources(0);
    assert_eq!(p.poll_ns(), 0);
    p.update(10_000, &[0], false);
    assert_eq!(p.poll_ns(), 0);
}

#[test]
fn set_params_resets_state() {
    let mut p = classic(32_768, 0, 0);
    p.update(10_000, &[0], false);
    p.update(10_000, &[0], false);
    assert_eq!(p.poll_ns(), 8_000);
    p.set_params(params(100_000, 4, 0, 0));
    assert_eq!(p.poll_ns(), 0);
    assert_eq!(p.params().poll_max_ns, 100_000);
    p.update(50_000, &[0], false);
    p.update(50_000, &[0], false);
    assert_eq!(p.poll_ns(), 16_000);
}
