use super::*;

fn r(s: &str) -> DockerRef {
    DockerRef::parse(s).unwrap()
}

#[test]
fn references_normalize_as_containers_image() {
    assert_eq!(r("busybox").to_string(), "docker.io/library/busybox");
    assert_eq!(r("busybox").identity(), "docker.io/library/busybox:latest");
    assert_eq!(r("index.docker.io/user/app:1").to_string(), "docker.io/user/app:1");
    assert_eq!(r("localhost/app:1").name, "localhost/app");
    let d = format!("sha256:{}", "ab".repeat(32));
    let x = r(&format!("127.0.0.1:5000/images/app@{d}"));
    assert_eq!(
        (x.name.as_str(), x.tag.as_deref(), x.path()),
        ("127.0.0.1:5000/images/app", None, "images/app")
    );
    assert_eq!(x.identity(), format!("127.0.0.1:5000/images/app@{d}"));
    assert_eq!(DockerRef::of_repository("127.0.0.1:5000", "images/app", &d).unwrap(), x);
    assert_eq!(
        DockerRef::of_repository("127.0.0.1:5000", "images/app", "v1")
            .unwrap()
            .to_string(),
        "127.0.0.1:5000/images/app:v1"
    );
    assert!(DockerRef::parse("r.example/App:v1").is_err());
    assert!(DockerRef::parse("r.example/app:v/1").is_err());
    assert!(DockerRef::parse("r.example/app@sha256:12").is_err());
}

#[test]
fn namespaces_from_repository_to_wildcard_domains() {
    assert_eq!(
        r("reg.example.com:5000/team/app:v1").namespaces(),
        [
            "reg.example.com:5000/team/app",
            "reg.example.com:5000/team",
            "reg.example.com:5000",
            "*.example.com",
            "*.com"
        ]
    );
    assert_eq!(dir_namespaces(Path::new("/srv/images/app")), ["/srv/images", "/srv"]);
}

const KEY: &str = r#""keyType": "GPGKeys", "keyPath": "/k.gpg""#;

fn policy(text: &str) -> Policy {
    Policy::parse(text.as_bytes()).unwrap()
}

#[test]
fn scopes_pick_the_most_specific() {
    let p = policy(&format!(
        r#"{{"default": [{{"type": "reject"}}],
            "transports": {{"docker": {{
                "reg.example.com/team/app:v1": [{{"type": "insecureAcceptAnything"}}],
                "reg.example.com/team": [{{"type": "signedBy", {KEY}}}],
                "*.example.com": [{{"type": "reject"}}, {{"type": "insecureAcceptAnything"}}],
                "": [{{"type": "insecureAcceptAnything"}}]}},
              "dir": {{"/srv/images": [{{"type": "insecureAcceptAnything"}}]}}}}}}"#
    ));
    let pick = |s: &str| {
        let x = r(s);
        p.requirements(DOCKER, &x.identity(), &x.namespaces()).1
    };
    assert_eq!(
        pick("reg.example.com/team/app:v1"),
        r#"transports.docker["reg.example.com/team/app:v1"]"#
    );
    assert_eq!(
        pick("reg.example.com/team/app:v2"),
        r#"transports.docker["reg.example.com/team"]"#
    );
    assert_eq!(
        pick("reg.example.com/team/sub/x:v2"),
        r#"transports.docker["reg.example.com/team"]"#
    );
    assert_eq!(
        pick("reg.example.com/other:v1"),
        r#"transports.docker["*.example.com"]"#
    );
    assert_eq!(pick("other.org/x:v1"), r#"transports.docker[""]"#);
    let (reqs, _) = p.requirements(
        DOCKER,
        "reg.example.com/team/app:v9",
        &r("reg.example.com/team/app:v9").namespaces(),
    );
    assert_eq!(
        reqs,
        [Requirement::SignedBy {
            keys: Keys::Paths(vec!["/k.gpg".into()]),
            identity: SignedIdentity::MatchRepoDigestOrExact
        }]
    );
    let d = Path::new("/srv/images/app");
    assert_eq!(
        p.requirements(DIR, "/srv/images/app", &dir_namespaces(d)).1,
        r#"transports.dir["/srv/images"]"#
    );
    assert_eq!(
        p.requirements(DIR, "/home/x", &dir_namespaces(Path::new("/home/x"))).1,
        "default"
    );
    assert_eq!(p.requirements("", "", &[]).0, [Requirement::Reject]);
}

#[test]
fn policies_parse_strictly_naming_the_problem() {
    let bad = |text: &str, want: &str| {
        let e = format!("{:#}", Policy::parse(text.as_bytes()).unwrap_err());
        assert!(e.contains(want), "{e}");
    };
    bad(r#"{"transports": {}}"#, "no \"default\"");
    bad(r#"{"default": []}"#, "default: an empty list");
    bad(
        r#"{"default": [{"type": "reject"}], "extra": 1}"#,
        "unknown field \"extra\"",
    );
    bad(
        r#"{"default": [{"type": "reject", "x": 1}]}"#,
        "default[0]: unknown field \"x\"",
    );
    bad(
        r#"{"default": [{"type": "signedBy", "keyType": "GPGKeys"}]}"#,
        "exactly one of keyPath",
    );
    bad(
        r#"{"default": [{"type": "signedBy", "keyType": "GPGKeys", "keyPath": "/a", "keyData": "YQ=="}]}"#,
        "exactly one of keyPath",
    );
    bad(
        r#"{"default": [{"type": "signedBy", "keyType": "X509Certificates", "keyPath": "/a"}]}"#,
        "keyType",
    );
    bad(
        r#"{"default": [{"type": "signedBy", "keyType": "GPGKeys", "keyPath": "/a", "signedIdentity": {"type": "matchAll"}}]}"#,
        "unknown signedIdentity type",
    );
    bad(
        r#"{"default": [{"type": "signedBy", "keyType": "GPGKeys", "keyPath": "/a", "signedIdentity": {"type": "exactReference"}}]}"#,
        "needs \"dockerReference\"",
    );
    bad(r#"{"default": [{"keyPath": "/a"}]}"#, "needs a \"type\"");
    bad("{", "not JSON");
    // requirement types ublkd does not check parse, and refuse what they apply to
    let p = policy(r#"{"default": [{"type": "sigstoreSigned", "keyPath": "/c.pub"}]}"#);
    assert_eq!(p.default, [Requirement::Unsupported("sigstoreSigned".into())]);
    let p = policy(r#"{"default": [{"type": "signedBy", "keyType": "GPGKeys", "keyData": "YWJj"}]}"#);
    assert_eq!(
        p.default,
        [Requirement::SignedBy {
            keys: Keys::Data(b"abc".to_vec()),
            identity: SignedIdentity::MatchRepoDigestOrExact
        }]
    );
    assert!(Keys::Paths(vec!["rel/k.gpg".into()]).load().is_err());
}

#[test]
fn signed_identities() {
    let d = format!("sha256:{}", "ab".repeat(32));
    let by_tag = r("reg.example/a/app:v1");
    let by_digest = r(&format!("reg.example/a/app@{d}"));
    let m = SignedIdentity::MatchRepoDigestOrExact;
    assert!(m.matches(&by_tag, &r("reg.example/a/app:v1")));
    assert!(!m.matches(&by_tag, &r("reg.example/a/app:v2")));
    assert!(
        !m.matches(&by_tag, &r("reg.example/a/app")),
        "name-only signatures never match"
    );
    assert!(m.matches(&by_digest, &r("reg.example/a/app:v2")));
    assert!(!m.matches(&by_digest, &r("reg.example/a/other:v1")));
    assert!(SignedIdentity::MatchExact.matches(&by_tag, &r("reg.example/a/app:v1")));
    assert!(!SignedIdentity::MatchExact.matches(&by_digest, &r("reg.example/a/app:v1")));
    assert!(SignedIdentity::MatchRepository.matches(&by_tag, &r("reg.example/a/app:v7")));
    assert!(!SignedIdentity::MatchRepository.matches(&by_tag, &r("reg.example/b/app:v1")));
    let exact = SignedIdentity::ExactReference(r("mirror.example/app:v1"));
    assert!(exact.matches(&by_tag, &r("mirror.example/app:v1")));
    assert!(!exact.matches(&by_tag, &r("reg.example/a/app:v1")));
    let repo = SignedIdentity::ExactRepository("mirror.example/app".into());
    assert!(repo.matches(&by_digest, &r("mirror.example/app:v3")));
    let remap = SignedIdentity::RemapIdentity {
        prefix: "reg.example/a".into(),
        signed_prefix: "upstream.example/b".into(),
    };
    assert!(remap.matches(&by_tag, &r("upstream.example/b/app:v1")));
    assert!(!remap.matches(&by_tag, &r("reg.example/a/app:v1")));
    let not_at_boundary = SignedIdentity::RemapIdentity {
        prefix: "reg.example/a/ap".into(),
        signed_prefix: "x.example/y".into(),
    };
    assert!(not_at_boundary.matches(&by_tag, &r("reg.example/a/app:v1")));
}
