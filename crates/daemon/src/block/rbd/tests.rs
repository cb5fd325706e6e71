use super::*;

#[test]
fn specs_parse_and_print_back() {
    for (s, pool, ns, image, snap) in [
        ("rbd:rbd/img", "rbd", None, "img", None),
        ("rbd/img", "rbd", None, "img", None),
        ("rbd:p/ns/img", "p", Some("ns"), "img", None),
        ("rbd:p/img@s1", "p", None, "img", Some("s1")),
        ("rbd:p/ns/img@s1", "p", Some("ns"), "img", Some("s1")),
    ] {
        let spec = RbdSpec::parse(s).unwrap();
        assert_eq!(
            spec,
            RbdSpec {
                pool: pool.into(),
                namespace: ns.map(Into::into),
                image: image.into(),
                snap: snap.map(Into::into),
            },
            "{s}"
        );
        let printed = spec.to_string();
        assert_eq!(RbdSpec::parse(&printed).unwrap(), spec);
        assert!(printed.starts_with("rbd:"));
    }
}

#[test]
fn malformed_specs_say_what_is_expected() {
    for s in [
        "rbd:",
        "rbd:img",
        "rbd:/img",
        "rbd:p/",
        "rbd:p//img",
        "rbd:a/b/c/d",
        "rbd:p/img@",
        "rbd:p/img@a/b",
    ] {
        let e = RbdSpec::parse(s).unwrap_err();
        assert!(e.contains("rbd:POOL/IMAGE"), "{s}: {e}");
    }
}

#[test]
fn rbd_images_are_recognised_by_their_prefix() {
    assert!(is_rbd_image(Path::new("rbd:p/i")));
    assert!(!is_rbd_image(Path::new("/var/lib/disk.raw")));
}
