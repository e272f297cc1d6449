//! OCI distribution client: `oci://REGISTRY[:PORT]/REPO[:TAG|@sha256:DIGEST]`, manifests
//! by tag or digest, blobs by digest (whole or by range). Anonymous first; a 401 with a
//! `Bearer realm=..,service=..,scope=..` challenge gets a token from the realm (with the
//! basic credentials if any) and the request is sent again; a `Basic` challenge gets the
//! credentials.

use super::http::{classify, Failure, Http};
use crate::format::digest::{self, Sha256Digest};
use anyhow::{bail, ensure, Result};
use std::sync::Mutex;
use std::time::Duration;

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const ARTIFACT_TYPE: &str = "application/vnd.btrfs-ublk-image.bundle.v1";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.btrfs-ublk-image.manifest.v1+json";
pub const TITLE: &str = "org.opencontainers.image.title";
pub const TRACE_ARTIFACT_TYPE: &str = "application/vnd.btrfs-ublk-image.trace.v1";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repo: String,
    /// a tag, or `sha256:<hex>`
    pub reference: String,
}

impl Reference {
    pub fn parse(loc: &str) -> Result<Reference> {
        let rest = loc
            .strip_prefix("oci://")
            .ok_or_else(|| anyhow::anyhow!("{loc}: not an oci:// location"))?;
        let Some((registry, path)) = rest.split_once('/') else {
            bail!("{loc}: expected oci://REGISTRY/REPO[:TAG|@sha256:DIGEST]");
        };
        let (repo, reference) = if let Some((r, d)) = path.split_once('@') {
            Sha256Digest::parse_id(d).map_err(|e| anyhow::anyhow!("{loc}: digest: {e}"))?;
            (r, d.to_string())
        } else {
            match path.rsplit_once(':') {
                Some((r, t)) if !t.contains('/') => (r, t.to_string()),
                _ => (path, "latest".to_string()),
            }
        };
        let ok_repo = !repo.is_empty()
            && repo.split('/').all(|c| {
                !c.is_empty()
                    && c.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
            });
        ensure!(ok_repo, "{loc}: repository {repo:?} is not a valid OCI repository name");
        let ok_tag = digest::strip_prefix(&reference).is_some()
            || (!reference.is_empty()
                && reference.len() <= 128
                && reference
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)));
        ensure!(ok_tag, "{loc}: tag {reference:?} is not a valid OCI tag");
        ensure!(!registry.is_empty(), "{loc}: no registry");
        Ok(Reference {
            registry: registry.to_string(),
            repo: repo.to_string(),
            reference,
        })
    }

    /// Loopback registries speak plain HTTP, others HTTPS (unless `--plain-http`).
    pub fn base_url(&self, plain_http: bool) -> String {
        let host = self
            .registry
            .rsplit_once(':')
            .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
            .map_or(self.registry.as_str(), |(h, _)| h);
        let loopback = matches!(host, "127.0.0.1" | "localhost" | "[::1]");
        let scheme = if plain_http || loopback { "http" } else { "https" };
        format!("{scheme}://{}", self.registry)
    }
}

pub struct Registry {
    pub http: Http,
    pub base: String,
    pub repo: String,
    creds: Option<(String, String)>,
    /// the `Authorization` value that worked last (a bearer token or basic credentials)
    auth: Mutex<Option<String>>,
}

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64 (padding optional) -> bytes; None if not base64.
pub fn unbase64(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for b in text.trim_end_matches('=').bytes() {
        let v = match b {
            b'A'..=b'Z' => b - b'A',
            b'a'..=b'z' => b - b'a' + 26,
            b'0'..=b'9' => b - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = acc << 6 | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// `USER:PASS` for `registry` from docker's config.json (`$DOCKER_CONFIG/config.json`,
/// else `~/.docker/config.json`: `auths[registry].auth`, as `docker login` and skopeo
/// write it); None when there is none. Credential helpers are not used.
pub fn docker_config_auth(registry: &str) -> Option<String> {
    let path = match std::env::var_os("DOCKER_CONFIG") {
        Some(d) => std::path::PathBuf::from(d).join("config.json"),
        None => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".docker/config.json"),
    };
    docker_config_auth_in(&std::fs::read(path).ok()?, registry)
}

fn docker_config_auth_in(config: &[u8], registry: &str) -> Option<String> {
    let doc: serde_json::Value = serde_json::from_slice(config).ok()?;
    doc["auths"].as_object()?.iter().find_map(|(key, entry)| {
        let host = key.trim_start_matches("https://").trim_start_matches("http://");
        if host.trim_end_matches('/') != registry {
            return None;
        }
        let auth = String::from_utf8(unbase64(entry["auth"].as_str()?)?).ok()?;
        auth.contains(':').then_some(auth)
    })
}

/// `Bearer realm="x",service="y"` -> ("bearer", {realm: x, service: y}).
fn parse_challenge(h: &str) -> (String, Vec<(String, String)>) {
    let (scheme, rest) = h.trim().split_once(' ').unwrap_or((h.trim(), ""));
    let mut params = Vec::new();
    let mut s = rest.trim();
    while !s.is_empty() {
        let Some((k, after)) = s.split_once('=') else { break };
        let (v, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"').unwrap_or(q.len());
            (&q[..end], q.get(end + 1..).unwrap_or(""))
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (&after[..end], &after[end..])
        };
        params.push((k.trim().to_ascii_lowercase(), v.to_string()));
        s = next.trim_start_matches([',', ' ']);
    }
    (scheme.to_ascii_lowercase(), params)
}

impl Registry {
    pub fn new(http: Http, r: &Reference, plain_http: bool, creds: Option<&str>) -> Result<Registry> {
        let creds = match creds {
            Some(c) => {
                let (u, p) = c
                    .split_once(':')
                    .ok_or_else(|| anyhow::anyhow!("registry credentials must be USER:PASSWORD"))?;
                Some((u.to_string(), p.to_string()))
            }
            None => None,
        };
        Ok(Registry {
            http,
            base: r.base_url(plain_http),
            repo: r.repo.clone(),
            creds,
            auth: Mutex::new(None),
        })
    }

    /// `/v2/<repo>/<kind>/<reference>` on this registry.
    pub fn url(&self, kind: &str, reference: &str) -> String {
        format!("{}/v2/{}/{kind}/{reference}", self.base, self.repo)
    }

    /// A GET with the current credentials; on 401, authenticate once and try again.
    pub fn get(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        timeout: Option<Duration>,
    ) -> Result<ureq::Response, Failure> {
        let mut authenticated = false;
        loop {
            let auth = self.auth.lock().unwrap().clone();
            let mut h: Vec<(&str, &str)> = headers.to_vec();
            if let Some(a) = &auth {
                h.push(("Authorization", a));
            }
            match self.http.get(url, &h, timeout).map_err(|e| *e) {
                Ok(r) => return Ok(r),
                Err(ureq::Error::Status(401, resp)) if !authenticated => {
                    let challenge = resp.header("www-authenticate").unwrap_or("").to_string();
                    self.authenticate(url, &challenge, timeout)?;
                    authenticated = true;
                }
                Err(e) => return Err(classify(url, e)),
            }
        }
    }

    fn authenticate(&self, url: &str, challenge: &str, timeout: Option<Duration>) -> Result<(), Failure> {
        let (scheme, params) = parse_challenge(challenge);
        let param = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let basic = self
            .creds
            .as_ref()
            .map(|(u, p)| format!("Basic {}", base64(format!("{u}:{p}").as_bytes())));
        let value = match scheme.as_str() {
            "basic" => basic.ok_or_else(|| {
                Failure::Permanent(format!(
                    "{url}: the registry asks for credentials (--registry-auth USER:PASS or UBLKD_REGISTRY_AUTH)"
                ))
            })?,
            "bearer" => {
                let realm = param("realm").ok_or_else(|| {
                    Failure::Permanent(format!("{url}: Bearer challenge without realm: {challenge:?}"))
                })?;
                let mut q: Vec<String> = Vec::new();
                for k in ["service", "scope"] {
                    if let Some(v) = param(k) {
                        q.push(format!("{k}={}", urlencode(v)));
                    }
                }
                let sep = if realm.contains('?') { '&' } else { '?' };
                let token_url = if q.is_empty() {
                    realm.to_string()
                } else {
                    format!("{realm}{sep}{}", q.join("&"))
                };
                let mut h: Vec<(&str, &str)> = Vec::new();
                if let Some(b) = &basic {
                    h.push(("Authorization", b));
                }
                let resp = self.http.get(&token_url, &h, timeout).map_err(|e| match *e {
                    ureq::Error::Status(401 | 403, _) => Failure::Permanent(format!(
                        "{token_url}: the token service refused {} (HTTP 401/403)",
                        if basic.is_some() {
                            "the credentials"
                        } else {
                            "anonymous access"
                        }
                    )),
                    e => classify(&token_url, e),
                })?;
                let body: serde_json::Value = serde_json::from_reader(std::io::Read::take(resp.into_reader(), 1 << 20))
                    .map_err(|e| Failure::Transient(format!("{token_url}: token response: {e}")))?;
                let token = body
                    .get("token")
                    .or_else(|| body.get("access_token"))
                    .and_then(|t| t.as_str())
                    .ok_or_else(|| Failure::Permanent(format!("{token_url}: token response has no token")))?;
                format!("Bearer {token}")
            }
            _ => {
                return Err(Failure::Permanent(format!(
                    "{url}: HTTP 401 with an unsupported challenge {challenge:?}"
                )))
            }
        };
        *self.auth.lock().unwrap() = Some(value);
        Ok(())
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        let r = Reference::parse("oci://127.0.0.1:5000/a/b:v1").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repo.as_str(), r.reference.as_str()),
            ("127.0.0.1:5000", "a/b", "v1")
        );
        assert_eq!(r.base_url(false), "http://127.0.0.1:5000");
        let r = Reference::parse("oci://reg.example:443/img").unwrap();
        assert_eq!(r.reference, "latest");
        assert_eq!(r.base_url(false), "https://reg.example:443");
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("oci://reg.example/img@{d}")).unwrap();
        assert_eq!(r.reference, d);
        assert!(Reference::parse("oci://reg.example/Img:x").is_err());
        assert!(Reference::parse("oci://reg.example").is_err());
        assert!(Reference::parse("oci://reg.example/img@sha256:12").is_err());
    }

    #[test]
    fn challenges_and_base64() {
        let (s, p) = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        );
        assert_eq!(s, "bearer");
        assert_eq!(p[0], ("realm".into(), "https://auth.example/token".into()));
        assert_eq!(p[2], ("scope".into(), "repository:a/b:pull".into()));
        assert_eq!(base64(b"user:pass"), "dXNlcjpwYXNz");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b"a"), "YQ==");
        for text in [&b"user:pass"[..], b"ab", b"a", b"u:p:q"] {
            assert_eq!(unbase64(&base64(text)).as_deref(), Some(text));
        }
        assert_eq!(unbase64("!!"), None);
    }

    #[test]
    fn docker_config() {
        let cfg = br#"{"auths": {"https://reg.example:5000/": {"auth": "dXNlcjpwYXNz"}, "x": {"auth": "YQ=="}}}"#;
        assert_eq!(
            docker_config_auth_in(cfg, "reg.example:5000").as_deref(),
            Some("user:pass")
        );
        assert_eq!(docker_config_auth_in(cfg, "other"), None);
        assert_eq!(docker_config_auth_in(cfg, "x"), None); // not USER:PASS
        assert_eq!(docker_config_auth_in(b"{", "x"), None);
    }
}
