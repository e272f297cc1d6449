//! containers-policy.json(5), the signature policy of podman and skopeo (docs/signatures.md):
//! its requirements, the scope that applies to an image, and the identity rules that
//! compare a signature's `docker-reference` with the reference ublkd was given. Parsed
//! strictly as containers/image does (unknown fields are errors); requirement types
//! ublkd cannot check (`sigstoreSigned`, `signedBaseLayer`) parse, and refuse an image
//! they apply to.

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// containers/image's transport names for what ublkd mounts: `oci://` references are
/// registry images (`docker`), local bundle directories `dir` (scopes: absolute paths).
pub const DOCKER: &str = "docker";
pub const DIR: &str = "dir";

/// A docker reference normalized as containers/image's `reference.ParseNormalizedNamed`:
/// `busybox` is `docker.io/library/busybox`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DockerRef {
    /// `host[:port]/path`
    pub name: String,
    pub tag: Option<String>,
    /// `sha256:<hex>`
    pub digest: Option<String>,
}

fn valid_path_component(c: &str) -> bool {
    !c.is_empty()
        && c.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && c.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
}

impl DockerRef {
    pub fn parse(s: &str) -> Result<DockerRef> {
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                crate::format::digest::Sha256Digest::parse(d).with_context(|| format!("{s:?}: digest"))?;
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (name, tag) = match rest.rsplit_once(':') {
            Some((n, t)) if !t.contains('/') => (n, Some(t.to_string())),
            _ => (rest, None),
        };
        if let Some(t) = &tag {
            ensure!(
                !t.is_empty() && t.len() <= 128 && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)),
                "{s:?}: invalid tag {t:?}"
            );
        }
        Ok(DockerRef {
            name: normalize_name(name).with_context(|| format!("{s:?} is not a docker reference"))?,
            tag,
            digest,
        })
    }

    /// The repository `registry/repo` (as ublkd's `oci://` references name it) at `reference`
    /// (a tag or `sha256:<hex>`).
    pub fn of_repository(registry: &str, repo: &str, reference: &str) -> Result<DockerRef> {
        let at = if reference.starts_with(crate::format::digest::PREFIX) {
            '@'
        } else {
            ':'
        };
        DockerRef::parse(&format!("{registry}/{repo}{at}{reference}"))
    }

    /// The repository without host: where its signatures live under a lookaside base.
    pub fn path(&self) -> &str {
        self.name.split_once('/').map_or("", |(_, p)| p)
    }

    /// containers/image's `PolicyConfigurationIdentity`: the name with its tag (`latest`
    /// when there is neither tag nor digest) and digest.
    pub fn identity(&self) -> String {
        match (&self.tag, &self.digest) {
            (None, None) => format!("{}:latest", self.name),
            _ => self.to_string(),
        }
    }

    /// containers/image's `PolicyConfigurationNamespaces`: the repository, its parent
    /// namespaces up to the host, then `*.domain` wildcards of the host (port stripped).
    pub fn namespaces(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut name = self.name.as_str();
        loop {
            out.push(name.to_string());
            match name.rfind('/') {
                Some(i) => name = &name[..i],
                None => break,
            }
        }
        let mut host = name.split(':').next().unwrap_or(name);
        while let Some(i) = host.find('.') {
            host = &host[i + 1..];
            out.push(format!("*.{host}"));
        }
        out
    }
}

impl std::fmt::Display for DockerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn normalize_name(name: &str) -> Result<String> {
    let (domain, path) = match name.split_once('/') {
        Some((d, p)) if d.contains('.') || d.contains(':') || d == "localhost" => (d, p.to_string()),
        _ => ("docker.io", name.to_string()),
    };
    let domain = if domain == "index.docker.io" {
        "docker.io"
    } else {
        domain
    };
    let path = if domain == "docker.io" && !path.contains('/') {
        format!("library/{path}")
    } else {
        path
    };
    ensure!(!domain.is_empty(), "empty registry");
    ensure!(
        path.split('/').all(valid_path_component),
        "repository {path:?}: components are lowercase letters, digits and ._-"
    );
    Ok(format!("{domain}/{path}"))
}

/// Which `docker-reference` a signature must claim (`signedIdentity`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignedIdentity {
    MatchExact,
    /// the default: by tag, exactly that reference; by digest, any tag of the repository
    MatchRepoDigestOrExact,
    MatchRepository,
    ExactReference(DockerRef),
    ExactRepository(String),
    /// a reference under `prefix` is compared, as MatchRepoDigestOrExact, with `signed_prefix` in its place
    RemapIdentity {
        prefix: String,
        signed_prefix: String,
    },
}

impl SignedIdentity {
    pub fn name(&self) -> &'static str {
        match self {
            SignedIdentity::MatchExact => "matchExact",
            SignedIdentity::MatchRepoDigestOrExact => "matchRepoDigestOrExact",
            SignedIdentity::MatchRepository => "matchRepository",
            SignedIdentity::ExactReference(_) => "exactReference",
            SignedIdentity::ExactRepository(_) => "exactRepository",
            SignedIdentity::RemapIdentity { .. } => "remapIdentity",
        }
    }

    /// Does a signature claiming `signed` vouch for `intended` (what ublkd was given)?
    pub fn matches(&self, intended: &DockerRef, signed: &DockerRef) -> bool {
        let name_only = |r: &DockerRef| r.tag.is_none() && r.digest.is_none();
        match self {
            SignedIdentity::MatchExact => !name_only(intended) && !name_only(signed) && intended == signed,
            SignedIdentity::MatchRepoDigestOrExact => repo_digest_or_exact(intended, signed),
            SignedIdentity::MatchRepository => intended.name == signed.name,
            SignedIdentity::ExactReference(r) => !name_only(signed) && r == signed,
            SignedIdentity::ExactRepository(name) => &signed.name == name,
            SignedIdentity::RemapIdentity { prefix, signed_prefix } => {
                let remapped = intended
                    .name
                    .strip_prefix(prefix.as_str())
                    .filter(|rest| rest.is_empty() || rest.starts_with('/') || prefix.ends_with('/'))
                    .map(|rest| DockerRef {
                        name: format!("{signed_prefix}{rest}"),
                        ..intended.clone()
                    });
                repo_digest_or_exact(remapped.as_ref().unwrap_or(intended), signed)
            }
        }
    }
}

fn repo_digest_or_exact(intended: &DockerRef, signed: &DockerRef) -> bool {
    if signed.tag.is_none() && signed.digest.is_none() {
        return false;
    }
    if intended.tag.is_some() {
        intended == signed
    } else if intended.digest.is_some() {
        // the manifest's digest is compared with the signature's separately
        intended.name == signed.name
    } else {
        false
    }
}

/// Where a `signedBy` requirement's keys are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keys {
    Paths(Vec<PathBuf>),
    /// `keyData`: the key file's bytes (armored or binary)
    Data(Vec<u8>),
}

impl Keys {
    /// Each key file's bytes (paths must be absolute: ublkd runs from any directory).
    pub fn load(&self) -> Result<Vec<(String, Vec<u8>)>> {
        match self {
            Keys::Data(d) => Ok(vec![("keyData".to_string(), d.clone())]),
            Keys::Paths(paths) => paths
                .iter()
                .map(|p| {
                    ensure!(p.is_absolute(), "keyPath {}: not an absolute path", p.display());
                    let bytes = std::fs::read(p).with_context(|| format!("keyPath {}", p.display()))?;
                    Ok((p.display().to_string(), bytes))
                })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    InsecureAcceptAnything,
    Reject,
    SignedBy {
        keys: Keys,
        identity: SignedIdentity,
    },
    /// a requirement type ublkd does not check (e.g. `sigstoreSigned`): refuses what it applies to
    Unsupported(String),
}

#[derive(Debug, Clone)]
pub struct Policy {
    pub default: Vec<Requirement>,
    /// transport -> scope -> requirements
    pub transports: BTreeMap<String, BTreeMap<String, Vec<Requirement>>>,
}

fn fields<'a>(v: &'a Value, at: &str, allowed: &[&str]) -> Result<&'a Map<String, Value>> {
    let obj = v.as_object().ok_or_else(|| anyhow!("{at}: expected an object"))?;
    if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        bail!("{at}: unknown field {k:?}");
    }
    Ok(obj)
}

fn string(obj: &Map<String, Value>, at: &str, key: &str) -> Result<Option<String>> {
    obj.get(key)
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| anyhow!("{at}.{key}: expected a string"))
        })
        .transpose()
}

fn parse_identity(v: &Value, at: &str) -> Result<SignedIdentity> {
    let ty = v.get("type").and_then(Value::as_str).unwrap_or_default();
    let need = |o: &Map<String, Value>, k: &str| -> Result<String> {
        string(o, at, k)?.ok_or_else(|| anyhow!("{at}: {ty} needs {k:?}"))
    };
    Ok(match ty {
        "matchExact" => {
            fields(v, at, &["type"])?;
            SignedIdentity::MatchExact
        }
        "matchRepoDigestOrExact" => {
            fields(v, at, &["type"])?;
            SignedIdentity::MatchRepoDigestOrExact
        }
        "matchRepository" => {
            fields(v, at, &["type"])?;
            SignedIdentity::MatchRepository
        }
        "exactReference" => {
            let o = fields(v, at, &["type", "dockerReference"])?;
            let r = DockerRef::parse(&need(o, "dockerReference")?).with_context(|| at.to_string())?;
            ensure!(
                r.tag.is_some() || r.digest.is_some(),
                "{at}: dockerReference {r} has no tag or digest"
            );
            SignedIdentity::ExactReference(r)
        }
        "exactRepository" => {
            let o = fields(v, at, &["type", "dockerRepository"])?;
            let r = DockerRef::parse(&need(o, "dockerRepository")?).with_context(|| at.to_string())?;
            ensure!(
                r.tag.is_none() && r.digest.is_none(),
                "{at}: dockerRepository {r} is not a repository"
            );
            SignedIdentity::ExactRepository(r.name)
        }
        "remapIdentity" => {
            let o = fields(v, at, &["type", "prefix", "signedPrefix"])?;
            SignedIdentity::RemapIdentity {
                prefix: need(o, "prefix")?,
                signed_prefix: need(o, "signedPrefix")?,
            }
        }
        t => bail!("{at}: unknown signedIdentity type {t:?}"),
    })
}

fn parse_requirement(v: &Value, at: &str) -> Result<Requirement> {
    let ty = v
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("{at}: a requirement needs a \"type\""))?;
    Ok(match ty {
        "insecureAcceptAnything" => {
            fields(v, at, &["type"])?;
            Requirement::InsecureAcceptAnything
        }
        "reject" => {
            fields(v, at, &["type"])?;
            Requirement::Reject
        }
        "signedBy" => {
            let o = fields(
                v,
                at,
                &["type", "keyType", "keyPath", "keyPaths", "keyData", "signedIdentity"],
            )?;
            let key_type = string(o, at, "keyType")?;
            ensure!(
                key_type.as_deref() == Some("GPGKeys"),
                "{at}: keyType {key_type:?}: ublkd supports \"GPGKeys\" (containers/image's only working keyType)"
            );
            let path = string(o, at, "keyPath")?;
            let paths = o
                .get("keyPaths")
                .map(|p| {
                    p.as_array()
                        .filter(|a| !a.is_empty())
                        .and_then(|a| {
                            a.iter()
                                .map(|s| s.as_str().map(PathBuf::from))
                                .collect::<Option<Vec<_>>>()
                        })
                        .ok_or_else(|| anyhow!("{at}.keyPaths: expected a non-empty list of strings"))
                })
                .transpose()?;
            let data = string(o, at, "keyData")?;
            let keys = match (path, paths, data) {
                (Some(p), None, None) => Keys::Paths(vec![PathBuf::from(p)]),
                (None, Some(ps), None) => Keys::Paths(ps),
                (None, None, Some(d)) => Keys::Data(
                    crate::store::remote::oci::unbase64(&d).ok_or_else(|| anyhow!("{at}.keyData: not base64"))?,
                ),
                _ => bail!("{at}: signedBy needs exactly one of keyPath, keyPaths, keyData"),
            };
            let identity = match o.get("signedIdentity") {
                Some(i) => parse_identity(i, &format!("{at}.signedIdentity"))?,
                None => SignedIdentity::MatchRepoDigestOrExact,
            };
            Requirement::SignedBy { keys, identity }
        }
        t => Requirement::Unsupported(t.to_string()),
    })
}

fn parse_list(v: &Value, at: &str) -> Result<Vec<Requirement>> {
    let list = v
        .as_array()
        .ok_or_else(|| anyhow!("{at}: expected a list of requirements"))?;
    ensure!(!list.is_empty(), "{at}: an empty list of requirements");
    list.iter()
        .enumerate()
        .map(|(i, r)| parse_requirement(r, &format!("{at}[{i}]")))
        .collect()
}

impl Policy {
    pub fn parse(bytes: &[u8]) -> Result<Policy> {
        let v: Value = serde_json::from_slice(bytes).context("not JSON")?;
        let top = fields(&v, "policy", &["default", "transports"])?;
        let default = parse_list(
            top.get("default")
                .ok_or_else(|| anyhow!("no \"default\" requirements"))?,
            "default",
        )?;
        let mut transports = BTreeMap::new();
        if let Some(t) = top.get("transports") {
            let t = t.as_object().ok_or_else(|| anyhow!("transports: expected an object"))?;
            for (name, scopes) in t {
                let scopes = scopes
                    .as_object()
                    .ok_or_else(|| anyhow!("transports.{name}: expected an object"))?;
                let mut out = BTreeMap::new();
                for (scope, reqs) in scopes {
                    out.insert(
                        scope.clone(),
                        parse_list(reqs, &format!("transports.{name}[{scope:?}]"))?,
                    );
                }
                transports.insert(name.clone(), out);
            }
        }
        Ok(Policy { default, transports })
    }

    pub fn load(path: &Path) -> Result<Policy> {
        let bytes = std::fs::read(path).with_context(|| format!("policy {}", path.display()))?;
        Policy::parse(&bytes).with_context(|| format!("policy {}", path.display()))
    }

    /// The requirements for an image of `transport` with `identity` and `namespaces` (most
    /// specific first), as containers/image picks them: the identity's scope, the first
    /// namespace scope, the transport's `""` scope, else `default`. -> (them, where from).
    pub fn requirements(&self, transport: &str, identity: &str, namespaces: &[String]) -> (&[Requirement], String) {
        if let Some(scopes) = self.transports.get(transport) {
            for scope in std::iter::once(identity).chain(namespaces.iter().map(String::as_str)) {
                if let Some(r) = scopes.get(scope) {
                    return (r, format!("transports.{transport}[{scope:?}]"));
                }
            }
            if let Some(r) = scopes.get("") {
                return (r, format!("transports.{transport}[\"\"]"));
            }
        }
        (&self.default, "default".to_string())
    }
}

/// A local directory's `dir`-transport namespaces: its parents, `/` excluded (as
/// containers/image's; its identity is the path itself).
pub fn dir_namespaces(dir: &Path) -> Vec<String> {
    dir.ancestors()
        .skip(1)
        .filter(|p| p.as_os_str().len() > 1)
        .map(|p| p.display().to_string())
        .collect()
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
