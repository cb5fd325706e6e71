//! [`ServeCommand`] against the real clap parser of `vqblk serve`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Parser;

use super::*;
use crate::cli::{IoThreadsArg, ServeArgs};

#[derive(Parser)]
struct T {
    #[command(flatten)]
    a: ServeArgs,
}

fn parse(cmd: &ServeCommand) -> ServeArgs {
    let argv = std::iter::once(OsString::from("serve")).chain(cmd.args());
    match T::try_parse_from(argv) {
        Ok(t) => t.a,
        Err(e) => panic!("{:?} does not parse: {e}", cmd.args()),
    }
}

/// Reads parsed flags back into a command. The pattern names every field of
/// `ServeArgs` (no `..`), so a new flag does not compile until it is added here and
/// to `ServeCommand`.
fn back(a: ServeArgs) -> ServeCommand {
    let ServeArgs {
        config,
        image,
        socket,
        name,
        queues,
        queue_size,
        iothreads,
        cpu_budget,
        iothread_pin,
        poll,
        poll_max_ns,
        poll_grow,
        poll_shrink,
        poll_weight,
        map,
        backend,
        cache,
        read_only,
        serial,
        size,
        latency_ns,
        read_zeroes,
        create,
        socket_mode,
        log_level,
        stats_file,
        seccomp,
        memory_sealing,
        bounce_buffer_max,
        takeover,
        control,
        metrics,
        ceph_conf,
        ceph_id,
        ceph_op_timeout,
        shutdown_timeout,
        throttle,
    } = a;
    let bytes = |s: Option<String>| s.map(|s| crate::size::parse_size(&s).unwrap());
    ServeCommand {
        config,
        image,
        socket,
        name,
        queues: Some(queues),
        queue_size: Some(queue_size),
        iothreads: match iothreads {
            IoThreadsArg::Count(n) => Some(n),
            IoThreadsArg::Auto => None,
        },
        iothreads_auto: iothreads == IoThreadsArg::Auto,
        cpu_budget,
        iothread_pins: iothread_pin
            .iter()
            .map(|p| {
                let (id, cpuset) = p.split_once('=').unwrap();
                IoThreadPin {
                    iothread: id.parse().unwrap(),
                    cpuset: cpuset.into(),
                }
            })
            .collect(),
        poll,
        poll_max_ns,
        poll_grow,
        poll_shrink,
        poll_weight,
        map: map.map(|m| crate::mapping::VirtqueueMap::parse_spec(&m).unwrap()),
        backend,
        cache: Some(cache),
        read_only,
        serial,
        size: bytes(size),
        latency_ns,
        read_zeroes,
        create: bytes(create),
        socket_mode: socket_mode.map(|m| u32::from_str_radix(&m, 8).unwrap()),
        log_level: Some(log_level.parse().unwrap()),
        stats_file,
        seccomp,
        memory_sealing,
        bounce_buffer_max: bytes(bounce_buffer_max),
        takeover,
        control,
        metrics,
        ceph_conf,
        ceph_id,
        ceph_op_timeout,
        shutdown_timeout,
        throttle,
    }
}

/// Every field set to a value other than the parser's default.
fn full() -> ServeCommand {
    ServeCommand {
        config: None,
        image: Some("/images/disk with space.raw".into()),
        socket: Some("/run/vqblk/d.sock".into()),
        name: Some("disk0".into()),
        queues: Some(8),
        queue_size: Some(1024),
        iothreads: Some(3),
        // With a count, not both: one --iothreads flag.
        iothreads_auto: false,
        cpu_budget: Some(2.5),
        iothread_pins: vec![
            IoThreadPin {
                iothread: 0,
                cpuset: "0-1".into(),
            },
            IoThreadPin {
                iothread: 2,
                cpuset: "4,6".into(),
            },
        ],
        poll: Some(PollMode::Weighted),
        poll_max_ns: Some(32_000),
        poll_grow: Some(4),
        poll_shrink: Some(3),
        poll_weight: Some(2),
        map: Some(vec![
            Assignment {
                iothread: 0,
                vqs: vec![0, 3, 6],
            },
            Assignment {
                iothread: 1,
                vqs: vec![1, 4, 7],
            },
            Assignment {
                iothread: 2,
                vqs: vec![2, 5],
            },
        ]),
        backend: Some(BackendKind::Threads),
        cache: Some(CacheMode::Writeback),
        read_only: true,
        serial: Some("SN-42".into()),
        size: Some(3 << 30),
        latency_ns: Some(20_000),
        read_zeroes: Some(false),
        create: Some(1 << 30),
        socket_mode: Some(0o660),
        log_level: Some(log::LevelFilter::Debug),
        stats_file: Some("/tmp/stats.json".into()),
        seccomp: Some(crate::seccomp::SeccompMode::Log),
        memory_sealing: Some(crate::fault::MemorySealing::Required),
        bounce_buffer_max: Some(16 << 20),
        takeover: true,
        control: Some("/run/vqblk/control.sock".into()),
        metrics: Some("127.0.0.1:9100".into()),
        ceph_conf: Some("/etc/ceph/other.conf".into()),
        ceph_id: Some("vqblk".into()),
        ceph_op_timeout: Some(7),
        shutdown_timeout: Some(50),
        throttle: Some("iops-total=1000,bps-total-max=2000000".into()),
    }
}

#[test]
fn every_field_round_trips_through_the_parser() {
    let cmd = full();
    assert_eq!(back(parse(&cmd)), cmd);
    let config = ServeCommand {
        config: Some("/etc/vqblk.toml".into()),
        ..Default::default()
    };
    assert_eq!(
        parse(&config).config,
        Some(PathBuf::from("/etc/vqblk.toml"))
    );
}

#[test]
fn every_enum_value_round_trips() {
    for mode in PollMode::value_variants() {
        let cmd = ServeCommand {
            poll: Some(*mode),
            ..Default::default()
        };
        assert_eq!(parse(&cmd).poll, Some(*mode));
    }
    for kind in BackendKind::value_variants() {
        let cmd = ServeCommand {
            backend: Some(*kind),
            ..Default::default()
        };
        assert_eq!(parse(&cmd).backend, Some(*kind));
    }
    for cache in CacheMode::value_variants() {
        let cmd = ServeCommand {
            cache: Some(*cache),
            ..Default::default()
        };
        assert_eq!(parse(&cmd).cache, *cache);
    }
    for policy in crate::fault::MemorySealing::value_variants() {
        let cmd = ServeCommand {
            memory_sealing: Some(*policy),
            ..Default::default()
        };
        assert_eq!(parse(&cmd).memory_sealing, Some(*policy));
    }
    for level in log::LevelFilter::iter() {
        let cmd = ServeCommand {
            log_level: Some(level),
            ..Default::default()
        };
        let parsed = parse(&cmd);
        assert_eq!(parsed.log_level.parse::<log::LevelFilter>(), Ok(level));
        assert!(crate::cli::init_logging(&parsed.log_level).is_ok());
    }
}

#[test]
fn parsed_fields_equal_the_inputs() {
    // The columns the study's sweep starts: a null export and an image export.
    let null = ServeCommand {
        backend: Some(BackendKind::Null),
        size: Some(1 << 30),
        socket: Some("/tmp/s.sock".into()),
        queues: Some(4),
        iothreads: Some(1),
        poll: Some(PollMode::Off),
        log_level: Some(log::LevelFilter::Warn),
        ..Default::default()
    };
    let a = parse(&null);
    assert_eq!(a.backend, Some(BackendKind::Null));
    assert_eq!(a.size.as_deref(), Some("1073741824"));
    assert_eq!(a.socket.as_deref(), Some(Path::new("/tmp/s.sock")));
    assert_eq!((a.queues, a.iothreads), (4, IoThreadsArg::Count(1)));
    assert_eq!(a.poll, Some(PollMode::Off));
    assert_eq!(a.log_level, "warn");
    assert_eq!(a.image, None);
    let (cfg, default) = a.to_config().unwrap();
    assert!(!default);
    cfg.validate().unwrap();
    assert_eq!(cfg.exports[0].backend, BackendKind::Null);

    let image = ServeCommand {
        image: Some("/d.raw".into()),
        cache: Some(CacheMode::None),
        socket: Some("/s".into()),
        queues: Some(2),
        iothreads: Some(2),
        ..Default::default()
    };
    let a = parse(&image);
    assert_eq!(a.image.as_deref(), Some(Path::new("/d.raw")));
    assert_eq!(a.cache, CacheMode::None);
    assert_eq!(
        (a.queues, a.iothreads, a.poll),
        (2, IoThreadsArg::Count(2), None)
    );
    let (cfg, _) = a.to_config().unwrap();
    let plans = cfg.validate().unwrap();
    assert_eq!(plans[0].map.to_string(), "0:0;1:1");
}

#[test]
fn an_empty_command_gets_the_daemon_defaults() {
    let cmd = ServeCommand::default();
    assert!(cmd.args().is_empty());
    let a = parse(&cmd);
    assert_eq!(
        (a.queues, a.queue_size, a.iothreads),
        (1, 256, IoThreadsArg::Count(1))
    );
    assert_eq!(a.cache, CacheMode::None);
    assert_eq!(a.log_level, "info");
    assert!(!a.read_only && a.poll.is_none() && a.backend.is_none());
}

#[test]
fn argv_and_command_start_with_serve() {
    let cmd = ServeCommand {
        queues: Some(2),
        ..Default::default()
    };
    let argv = cmd.argv(Path::new("/x/vqblk"));
    assert_eq!(
        argv,
        ["/x/vqblk", "serve", "--queues", "2"].map(OsString::from)
    );
    let c = cmd.command("/x/vqblk");
    assert_eq!(c.get_program(), "/x/vqblk");
    assert_eq!(c.get_args().collect::<Vec<_>>(), ["serve", "--queues", "2"]);
}
