//! `mount`'s signature check (docs/signatures.md): the containers-policy.json requirements
//! that apply to what is mounted, and for `signedBy` the containers/image "simple signing"
//! signatures of the OCI manifest the reference names, read from the lookaside storage
//! that containers-registries.d(5) configures (what `skopeo copy --sign-by` and
//! `skopeo standalone-sign` write, and podman verifies). A signature is an OpenPGP
//! signed message; it is verified by `gpg` against a temporary keyring holding only the
//! policy's keys (containers/image does the same through gpgme), then its JSON payload
//! must name this manifest's digest and an identity the policy accepts.

use super::policy::{dir_namespaces, DockerRef, Policy, Requirement, SignedIdentity, DIR, DOCKER};
use crate::format::digest::Sha256Digest;
use crate::stats::Counters;
use crate::store::remote::http::{fetch_optional, Http};
use anyhow::{anyhow, bail, ensure, Context, Result};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

pub const DEFAULT_POLICY: &str = "/etc/containers/policy.json";
pub const DEFAULT_REGISTRIES_D: &str = "/etc/containers/registries.d";
/// containers/image's lookaside storage when registries.d names none (for root).
pub const DEFAULT_LOOKASIDE: &str = "file:///var/lib/containers/sigstore";
/// containers/image reads at most this many signatures of one manifest...
const MAX_SIGNATURES: usize = 128;
/// ...of at most this size each.
const MAX_SIGNATURE_BYTES: u64 = 4 << 20;
/// The `critical.type` of a simple signing payload.
const SIGNATURE_TYPE: &str = "atomic container signature";

/// A loaded policy and where signatures are looked up.
pub struct Checker {
    pub policy_path: PathBuf,
    policy: Policy,
    registries_d: PathBuf,
    timeout: Duration,
}

impl Checker {
    /// `--policy FILE` (must exist), else /etc/containers/policy.json when it exists
    /// (none: None, nothing is checked).
    pub fn load(policy: Option<&Path>, registries_d: Option<&Path>, timeout: Duration) -> Result<Option<Checker>> {
        let path = match policy {
            Some(p) => p.to_path_buf(),
            None if Path::new(DEFAULT_POLICY).exists() => PathBuf::from(DEFAULT_POLICY),
            None => return Ok(None),
        };
        Ok(Some(Checker {
            policy: Policy::load(&path)?,
            policy_path: path,
            registries_d: registries_d.map_or_else(|| PathBuf::from(DEFAULT_REGISTRIES_D), Path::to_path_buf),
            timeout,
        }))
    }

    fn refuse(&self, location: &str, scope: &str, why: impl std::fmt::Display) -> anyhow::Error {
        anyhow!(
            "{location}: refused by the signature policy {} ({scope}): {why}",
            self.policy_path.display()
        )
    }

    /// A local bundle directory (transport `dir`, scopes by path) or an http(s) manifest
    /// URL (no transport: `default`): accepted or rejected outright; signatures are only
    /// looked up for oci:// references.
    pub fn check_unsigned_location(&self, location: &str, local_dir: Option<&Path>) -> Result<()> {
        let (reqs, scope) = match local_dir {
            Some(d) => self
                .policy
                .requirements(DIR, &d.display().to_string(), &dir_namespaces(d)),
            None => self.policy.requirements("", "", &[]),
        };
        for r in reqs {
            match r {
                Requirement::InsecureAcceptAnything => {}
                Requirement::Reject => return Err(self.refuse(location, &scope, "the policy rejects it")),
                Requirement::SignedBy { .. } => {
                    return Err(self.refuse(
                        location,
                        &scope,
                        "it requires signatures, which ublkd looks up for oci:// references only",
                    ))
                }
                Requirement::Unsupported(t) => {
                    return Err(self.refuse(
                        location,
                        &scope,
                        format!("requirement type {t:?} is not supported by ublkd"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// The OCI manifest `manifest` (its bytes as fetched) that `reference` names: every
    /// requirement of its scope must accept it; `signedBy` needs one signature that
    /// verifies with a policy key, names this manifest's digest and an identity the
    /// requirement accepts for `reference`.
    pub fn check_oci(&self, location: &str, reference: &DockerRef, manifest: &[u8]) -> Result<()> {
        let (reqs, scope) = self
            .policy
            .requirements(DOCKER, &reference.identity(), &reference.namespaces());
        let digest = Sha256Digest::of(manifest);
        let refuse = |why: String| self.refuse(location, &scope, why);
        // read once, for every signedBy requirement of the scope
        let mut signatures: Option<Vec<(String, Vec<u8>)>> = None;
        for r in reqs {
            match r {
                Requirement::InsecureAcceptAnything => {}
                Requirement::Reject => return Err(refuse("the policy rejects it".into())),
                Requirement::Unsupported(t) => {
                    return Err(refuse(format!("requirement type {t:?} is not supported by ublkd")))
                }
                Requirement::SignedBy { keys, identity } => {
                    if signatures.is_none() {
                        let base = self.lookaside(reference).map_err(|e| refuse(format!("{e:#}")))?;
                        let sigs = self
                            .signatures(&base, reference, &digest)
                            .map_err(|e| refuse(format!("{e:#}")))?;
                        if sigs.is_empty() {
                            let url = signature_url(&base, reference, &digest, 1);
                            return Err(refuse(format!(
                                "manifest {digest} has no signature (looked up at {url})"
                            )));
                        }
                        signatures = Some(sigs);
                    }
                    let keys = keys.load().map_err(|e| refuse(format!("{e:#}")))?;
                    let keyring = Keyring::new(&keys).map_err(|e| refuse(format!("{e:#}")))?;
                    let mut why = Vec::new();
                    for (url, sig) in signatures.iter().flatten() {
                        match accept(&keyring, sig, &digest, reference, identity) {
                            Ok(()) => {
                                why.clear();
                                break;
                            }
                            Err(e) => why.push(format!("{url}: {e:#}")),
                        }
                    }
                    if !why.is_empty() {
                        return Err(refuse(why.join("; ")));
                    }
                    log::info!(
                        "{location}: manifest {digest} signed as the policy {} requires",
                        self.policy_path.display()
                    );
                }
            }
        }
        Ok(())
    }

    fn lookaside(&self, reference: &DockerRef) -> Result<String> {
        let config = Registries::load(&self.registries_d)?;
        Ok(config
            .lookaside(reference)
            .unwrap_or_else(|| DEFAULT_LOOKASIDE.to_string()))
    }

    /// `signature-1`, `signature-2`, ... of the manifest until the first missing one.
    fn signatures(&self, base: &str, reference: &DockerRef, digest: &Sha256Digest) -> Result<Vec<(String, Vec<u8>)>> {
        let http = Http::new(Arc::new(Counters::default()), self.timeout);
        let mut out = Vec::new();
        for n in 1..=MAX_SIGNATURES {
            let url = signature_url(base, reference, digest, n);
            let got = if let Some(path) = url.strip_prefix("file://") {
                match std::fs::read(path) {
                    Ok(b) => Some(b),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => bail!("{url}: {e}"),
                }
            } else if url.starts_with("http://") || url.starts_with("https://") {
                fetch_optional(&http, &url, &[], self.timeout).map_err(|e| anyhow!(e))?
            } else {
                bail!("lookaside {base:?}: ublkd reads file://, http:// and https:// lookaside storage");
            };
            let Some(bytes) = got else { break };
            ensure!(
                bytes.len() as u64 <= MAX_SIGNATURE_BYTES,
                "{url}: a signature of more than {MAX_SIGNATURE_BYTES} bytes"
            );
            out.push((url, bytes));
        }
        Ok(out)
    }
}

/// containers/image's lookaside layout: `BASE/<repository path>@sha256=<hex>/signature-<n>`.
pub fn signature_url(base: &str, r: &DockerRef, digest: &Sha256Digest, n: usize) -> String {
    format!(
        "{}/{}@sha256={}/signature-{n}",
        base.trim_end_matches('/'),
        r.path(),
        digest.hex()
    )
}

/// One signature: made by a policy key, for this manifest digest, with an accepted identity.
fn accept(
    keyring: &Keyring,
    sig: &[u8],
    digest: &Sha256Digest,
    reference: &DockerRef,
    identity: &SignedIdentity,
) -> Result<()> {
    let payload = keyring.verify(sig)?;
    let p = Payload::parse(&payload)?;
    ensure!(
        p.digest == digest.to_string(),
        "signs manifest {}, not this manifest {digest}",
        p.digest
    );
    let signed = DockerRef::parse(&p.reference).context("critical.identity.docker-reference")?;
    ensure!(
        identity.matches(reference, &signed),
        "signed for {signed}, which signedIdentity {} does not accept for {reference}",
        identity.name()
    );
    Ok(())
}

/// The `critical` part of a simple signing payload (containers-signature(5)); like
/// containers/image, no other fields in `critical`, `image` or `identity`.
#[derive(Debug, PartialEq, Eq)]
pub struct Payload {
    pub digest: String,
    pub reference: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPayload {
    critical: RawCritical,
    /// required, as in containers/image; what it holds (creator, timestamp) is not checked
    #[allow(dead_code)]
    optional: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCritical {
    #[serde(rename = "type")]
    ty: String,
    image: RawImage,
    identity: RawIdentity,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawImage {
    #[serde(rename = "docker-manifest-digest")]
    digest: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIdentity {
    #[serde(rename = "docker-reference")]
    reference: String,
}

impl Payload {
    pub fn parse(bytes: &[u8]) -> Result<Payload> {
        let raw: RawPayload =
            serde_json::from_slice(bytes).context("the signed payload is not a simple signing payload")?;
        ensure!(
            raw.critical.ty == SIGNATURE_TYPE,
            "signed payload of type {:?}, expected {SIGNATURE_TYPE:?}",
            raw.critical.ty
        );
        Ok(Payload {
            digest: raw.critical.image.digest,
            reference: raw.critical.identity.reference,
        })
    }
}

/// A temporary GnuPG home holding only the policy's keys; removed when dropped.
pub struct Keyring {
    home: PathBuf,
    /// primary key fingerprints of the imported keys
    fingerprints: BTreeSet<String>,
}

impl Drop for Keyring {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.home);
    }
}

fn gpg(home: &Path) -> Command {
    let mut c = Command::new("gpg");
    c.arg("--homedir")
        .arg(home)
        .args([
            "--batch",
            "--no-tty",
            "--no-autostart",
            "--no-auto-key-retrieve",
            "--no-options",
        ])
        .stdin(Stdio::null());
    c
}

fn status_lines(bytes: &[u8]) -> Vec<Vec<String>> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|l| l.strip_prefix("[GNUPG:] "))
        .map(|l| l.split(' ').map(str::to_string).collect())
        .collect()
}

impl Keyring {
    /// `keys`: (where from, key file bytes, armored or binary).
    pub fn new(keys: &[(String, Vec<u8>)]) -> Result<Keyring> {
        let template = std::env::temp_dir().join("ublkd-gpg.XXXXXX");
        let home = nix::unistd::mkdtemp(&template).with_context(|| format!("{}: mkdtemp", template.display()))?;
        let mut ring = Keyring {
            home,
            fingerprints: BTreeSet::new(),
        };
        for (whence, bytes) in keys {
            let path = ring.home.join("import");
            std::fs::write(&path, bytes).with_context(|| format!("{}: write", path.display()))?;
            let out = gpg(&ring.home)
                .args(["--status-fd", "1", "--import"])
                .arg(&path)
                .output()
                .context("running gpg (package gnupg)")?;
            let before = ring.fingerprints.len();
            for l in status_lines(&out.stdout) {
                if l.first().map(String::as_str) == Some("IMPORT_OK") && l.len() >= 3 {
                    ring.fingerprints.insert(l[2].to_ascii_uppercase());
                }
            }
            ensure!(
                ring.fingerprints.len() > before,
                "{whence}: gpg imported no key from it: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(ring)
    }

    /// The payload of the signed message `sig` if exactly one good signature by one of
    /// the keyring's keys is on it (expired or revoked keys and bad signatures fail).
    pub fn verify(&self, sig: &[u8]) -> Result<Vec<u8>> {
        let dir = self.home.join("verify");
        std::fs::create_dir_all(&dir)?;
        let (input, output, status) = (dir.join("sig"), dir.join("payload"), dir.join("status"));
        let _ = std::fs::remove_file(&output);
        std::fs::write(&input, sig)?;
        let out = gpg(&self.home)
            .args(["--trust-model", "always", "--status-file"])
            .arg(&status)
            .arg("--output")
            .arg(&output)
            .arg("--decrypt")
            .arg(&input)
            .output()
            .context("running gpg (package gnupg)")?;
        let lines = status_lines(&std::fs::read(&status).unwrap_or_default());
        let has = |k: &str| lines.iter().find(|l| l.first().map(String::as_str) == Some(k));
        let count = lines
            .iter()
            .filter(|l| l.first().map(String::as_str) == Some("NEWSIG"))
            .count();
        for (bad, what) in [
            ("BADSIG", "a bad signature: the signed data was altered"),
            ("EXPKEYSIG", "made by an expired key"),
            ("REVKEYSIG", "made by a revoked key"),
            ("EXPSIG", "an expired signature"),
        ] {
            if let Some(l) = has(bad) {
                bail!("{what} (gpg {bad} {})", l[1..].join(" "));
            }
        }
        if let Some(l) = has("ERRSIG") {
            let why = if l.get(6).map(String::as_str) == Some("9") {
                "signed by a key that is not in the policy"
            } else {
                "cannot be checked"
            };
            bail!("{why} (gpg ERRSIG, key ID {})", l.get(1).map_or("?", String::as_str));
        }
        let gpg_said = String::from_utf8_lossy(&out.stderr)
            .lines()
            .rfind(|l| l.starts_with("gpg: "))
            .unwrap_or("gpg: (no message)")
            .trim()
            .to_string();
        ensure!(count != 0, "not a signed message ({gpg_said})");
        ensure!(count == 1, "{count} signatures in it, expected exactly one");
        let valid = has("VALIDSIG").ok_or_else(|| anyhow!("not a valid signature ({gpg_said})"))?;
        ensure!(
            out.status.success() && has("GOODSIG").is_some(),
            "a good signature in a message gpg refuses ({gpg_said})"
        );
        let primary = valid.last().map(|f| f.to_ascii_uppercase()).unwrap_or_default();
        ensure!(
            self.fingerprints.contains(&primary),
            "signed by key {primary}, not a key of the policy"
        );
        std::fs::read(&output).context("gpg wrote no payload")
    }
}

/// containers-registries.d(5): where each repository's signatures are.
#[derive(Default)]
struct Registries {
    default_docker: Option<Namespace>,
    docker: BTreeMap<String, Namespace>,
}

#[derive(Deserialize, Default, Clone)]
struct Namespace {
    lookaside: Option<String>,
    /// the name before containers/image 5.21
    sigstore: Option<String>,
}

impl Namespace {
    fn read_url(&self) -> Option<String> {
        self.lookaside
            .clone()
            .or_else(|| self.sigstore.clone())
            .filter(|s| !s.is_empty())
    }
}

#[derive(Deserialize)]
struct RegistriesFile {
    #[serde(rename = "default-docker")]
    default_docker: Option<Namespace>,
    docker: Option<BTreeMap<String, Namespace>>,
}

impl Registries {
    /// Every `*.yaml` in `dir` (none: an empty configuration); a namespace or
    /// `default-docker` defined twice is an error, as in containers/image.
    fn load(dir: &Path) -> Result<Registries> {
        let mut out = Registries::default();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(out);
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml") && p.is_file())
            .collect();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).with_context(|| format!("{}", f.display()))?;
            if text.trim().is_empty() {
                continue;
            }
            let parsed: RegistriesFile =
                serde_yaml::from_str(&text).with_context(|| format!("{}: not a registries.d file", f.display()))?;
            if let Some(d) = parsed.default_docker {
                ensure!(
                    out.default_docker.is_none(),
                    "{}: default-docker is defined in more than one file of {}",
                    f.display(),
                    dir.display()
                );
                out.default_docker = Some(d);
            }
            for (k, v) in parsed.docker.unwrap_or_default() {
                ensure!(
                    !out.docker.contains_key(&k),
                    "{}: docker namespace {k:?} is defined in more than one file of {}",
                    f.display(),
                    dir.display()
                );
                out.docker.insert(k, v);
            }
        }
        Ok(out)
    }

    /// The lookaside URL for reads: the reference's identity, then its namespaces, then
    /// `default-docker` (containers/image's order); None: not configured.
    fn lookaside(&self, r: &DockerRef) -> Option<String> {
        std::iter::once(r.identity())
            .chain(r.namespaces())
            .filter_map(|k| self.docker.get(&k).and_then(Namespace::read_url))
            .next()
            .or_else(|| self.default_docker.as_ref().and_then(Namespace::read_url))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_parsed_strictly() {
        let d = format!("sha256:{}", "ab".repeat(32));
        let good = format!(
            r#"{{"critical":{{"identity":{{"docker-reference":"r.example/a:v1"}},"image":{{"docker-manifest-digest":"{d}"}},"type":"atomic container signature"}},"optional":{{"creator":"x"}}}}"#
        );
        let p = Payload::parse(good.as_bytes()).unwrap();
        assert_eq!(
            (p.digest.as_str(), p.reference.as_str()),
            (d.as_str(), "r.example/a:v1")
        );
        assert!(Payload::parse(good.replace("atomic container signature", "other").as_bytes()).is_err());
        assert!(Payload::parse(good.replace(r#""type""#, r#""extra":1,"type""#).as_bytes()).is_err());
        assert!(Payload::parse(good.replace(r#","optional":{"creator":"x"}"#, "").as_bytes()).is_err());
    }

    #[test]
    fn lookaside_configuration() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("a.yaml"),
            "default-docker:\n  sigstore: file:///sigs/default\ndocker:\n  r.example/team:\n    lookaside: https://sigs.example/team\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("b.yaml"),
            "docker:\n  r.example/team/app:v2:\n    lookaside: file:///v2\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("ignored.txt"), "docker: [").unwrap();
        let c = Registries::load(dir.path()).unwrap();
        let r = |s: &str| DockerRef::parse(s).unwrap();
        assert_eq!(
            c.lookaside(&r("r.example/team/app:v1")).as_deref(),
            Some("https://sigs.example/team")
        );
        assert_eq!(c.lookaside(&r("r.example/team/app:v2")).as_deref(), Some("file:///v2"));
        assert_eq!(
            c.lookaside(&r("r.example/other:v1")).as_deref(),
            Some("file:///sigs/default")
        );
        let digest = Sha256Digest::of(b"m");
        assert_eq!(
            signature_url("https://sigs.example/team/", &r("r.example/team/app:v1"), &digest, 2),
            format!("https://sigs.example/team/team/app@sha256={}/signature-2", digest.hex())
        );
        std::fs::write(dir.path().join("c.yaml"), "default-docker:\n  lookaside: file:///x\n").unwrap();
        let e = Registries::load(dir.path()).err().unwrap();
        assert!(
            format!("{e:#}").contains("default-docker is defined in more than one file"),
            "{e:#}"
        );
        assert!(Registries::load(Path::new("/nonexistent"))
            .unwrap()
            .lookaside(&r("a.b/c:d"))
            .is_none());
    }
}
