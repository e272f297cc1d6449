//! A bundle as an OCI artifact (docs/remote.md): its image manifest (or that of a
//! runnable image naming it), the config blob (= manifest.json), the layers by title,
//! and the prefetch trace among its referrers.

use super::files::Layer;
use super::http::{read_body, read_small, Failure, SMALL_MAX};
use super::oci::{self, Reference, Registry};
use crate::format::digest::{self, Sha256Digest};
use anyhow::{anyhow, ensure, Context, Result};
use serde::Deserialize;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The last trace referrer of the bundle manifest `manifest_hex`, through the OCI 1.1
/// referrers tag schema (tag `sha256-<hex>` = an image index of referrers; docs/remote.md).
pub fn oci_trace(reg: &Registry, manifest: &Sha256Digest, timeout: Duration) -> Result<Option<Vec<u8>>, String> {
    const INDEX: &str = "application/vnd.oci.image.index.v1+json";
    let get = |url: &str, accept: &str| {
        reg.http.retry(url, Instant::now() + timeout, |left| {
            match reg.get(url, &[("Accept", accept)], Some(left)) {
                Ok(r) => read_small(url, r, &reg.http.counters).map(Some),
                Err(Failure::Permanent(m)) if m.contains("HTTP 404") => Ok(None),
                Err(f) => Err(f),
            }
        })
    };
    let url = reg.url("manifests", &format!("sha256-{}", manifest.hex()));
    let Some(index) = get(&url, INDEX)? else {
        return Ok(None);
    };
    let index: serde_json::Value = serde_json::from_slice(&index).map_err(|e| format!("{url}: {e}"))?;
    let Some(desc) = index["manifests"].as_array().and_then(|m| {
        m.iter()
            .rfind(|d| d["artifactType"].as_str() == Some(oci::TRACE_ARTIFACT_TYPE))
    }) else {
        return Ok(None);
    };
    let digest = desc["digest"]
        .as_str()
        .ok_or(format!("{url}: a referrer without digest"))?;
    let murl = reg.url("manifests", digest);
    let m = get(&murl, oci::MANIFEST_MEDIA_TYPE)?.ok_or(format!("{murl}: HTTP 404"))?;
    if Sha256Digest::of(&m).to_string() != digest {
        return Err(format!("{murl}: the manifest does not match its digest"));
    }
    let m: serde_json::Value = serde_json::from_slice(&m).map_err(|e| format!("{murl}: {e}"))?;
    if m["subject"]["digest"].as_str() != Some(manifest.to_string().as_str()) {
        return Err(format!("{murl}: its subject is not the bundle's manifest"));
    }
    let layer = &m["layers"][0];
    let (Some(ldigest), Some(size @ ..=SMALL_MAX)) = (layer["digest"].as_str(), layer["size"].as_u64()) else {
        return Err(format!("{murl}: no trace layer (of at most {SMALL_MAX} bytes)"));
    };
    let burl = reg.url("blobs", ldigest);
    let bytes = reg.http.retry(&burl, Instant::now() + timeout, |left| {
        let r = reg.get(&burl, &[], Some(left))?;
        read_body(&burl, r, size, &reg.http.counters)
    })?;
    if Sha256Digest::of(&bytes).to_string() != ldigest {
        return Err(format!("{burl}: the trace does not match its digest"));
    }
    Ok(Some(bytes))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: String,
    digest: String,
    size: u64,
    #[serde(default)]
    annotations: HashMap<String, String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OciManifest {
    schema_version: u32,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    artifact_type: Option<String>,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

fn parse_oci_manifest(location: &str, bytes: &[u8]) -> Result<OciManifest> {
    let m: OciManifest = serde_json::from_slice(bytes)
        .with_context(|| format!("{location}: the registry's manifest is not an OCI image manifest"))?;
    ensure!(
        m.schema_version == 2 && m.media_type.as_deref().is_none_or(|t| t == oci::MANIFEST_MEDIA_TYPE),
        "{location}: manifest mediaType {:?} schemaVersion {}, expected {} schemaVersion 2",
        m.media_type,
        m.schema_version,
        oci::MANIFEST_MEDIA_TYPE
    );
    ensure!(
        m.artifact_type.as_deref() == Some(oci::ARTIFACT_TYPE),
        "{location}: not a btrfs-ublk-image bundle (artifactType {:?}, expected {})",
        m.artifact_type,
        oci::ARTIFACT_TYPE
    );
    ensure!(
        m.config.media_type == oci::CONFIG_MEDIA_TYPE,
        "{location}: config mediaType {:?}, expected {}",
        m.config.media_type,
        oci::CONFIG_MEDIA_TYPE
    );
    Sha256Digest::parse_id(&m.config.digest).with_context(|| format!("{location}: config digest"))?;
    Ok(m)
}

/// Bundle-relative path (layer title) -> its layer.
pub fn oci_layers(location: &str, bytes: &[u8]) -> Result<HashMap<String, Layer>> {
    let m = parse_oci_manifest(location, bytes)?;
    let mut out = HashMap::new();
    for l in m.layers {
        let title = l
            .annotations
            .get(oci::TITLE)
            .with_context(|| format!("{location}: layer {} has no {} annotation", l.digest, oci::TITLE))?;
        Sha256Digest::parse_id(&l.digest).with_context(|| format!("{location}: layer {title:?} digest"))?;
        out.insert(
            title.clone(),
            Layer {
                digest: l.digest,
                size: l.size,
                media_type: l.media_type,
            },
        );
    }
    Ok(out)
}

/// The annotation of a runnable image (`push --image`) naming its bundle artifact's
/// manifest digest in the same repository.
const RUNNABLE_BUNDLE: &str = "dev.btrfs-ublk-image.bundle";

/// The manifest at `reference` (a tag, or a digest it must hash to).
fn oci_manifest_bytes(reg: &Registry, location: &str, reference: &str, deadline: Instant) -> Result<Vec<u8>> {
    let url = reg.url("manifests", reference);
    let bytes = reg
        .http
        .retry(&url, deadline, |left| {
            let resp = reg.get(&url, &[("Accept", oci::MANIFEST_MEDIA_TYPE)], Some(left))?;
            read_small(&url, resp, &reg.http.counters)
        })
        .map_err(|m| anyhow!("{location}: {m}"))?;
    if digest::strip_prefix(reference).is_some() {
        let got = Sha256Digest::of(&bytes).to_string();
        ensure!(got == reference, "{url}: the manifest's digest is {got}");
    }
    Ok(bytes)
}

/// The bundle digest a runnable image's manifest names; None for anything else.
fn runnable_image_bundle(manifest: &[u8]) -> Option<String> {
    let m: serde_json::Value = serde_json::from_slice(manifest).ok()?;
    if m["artifactType"].as_str() == Some(oci::ARTIFACT_TYPE) {
        return None;
    }
    Sha256Digest::parse_id(m["annotations"][RUNNABLE_BUNDLE].as_str()?)
        .ok()
        .map(|d| d.to_string())
}

/// What `mount` checks of the OCI manifest an `oci://` reference names (its bytes as
/// fetched) before anything else of the image is fetched: the signature policy.
pub type ManifestCheck<'a> = &'a dyn Fn(&Reference, &[u8]) -> Result<()>;

/// Tag (or digest) -> (OCI manifest bytes, config blob bytes = the bundle's manifest.json).
/// `check` sees the manifest the reference names (a runnable image's, or the bundle's)
/// before anything else is fetched; the bundle a runnable image names is fetched by its
/// digest, so a check of the runnable manifest covers it.
pub fn oci_resolve(
    reg: &Registry,
    r: &Reference,
    timeout: Duration,
    check: Option<ManifestCheck>,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let location = format!("oci://{}/{}:{}", r.registry, r.repo, r.reference);
    let deadline = Instant::now() + timeout;
    let mut mbytes = oci_manifest_bytes(reg, &location, &r.reference, deadline)?;
    if let Some(check) = check {
        check(r, &mbytes)?;
    }
    if let Some(bundle) = runnable_image_bundle(&mbytes) {
        // a runnable image (`push --image`, docs/containerd.md): mount the bundle it names
        log::info!("{location}: a runnable image; mounting its bundle {bundle}");
        mbytes = oci_manifest_bytes(reg, &location, &bundle, deadline)?;
    }
    let m = parse_oci_manifest(&location, &mbytes)?;
    ensure!(
        m.config.size <= SMALL_MAX,
        "{location}: config blob of {} bytes (a manifest.json is far smaller)",
        m.config.size
    );
    let curl = reg.url("blobs", &m.config.digest);
    let config = reg
        .http
        .retry(&curl, deadline, |left| {
            let resp = reg.get(&curl, &[], Some(left))?;
            read_body(&curl, resp, m.config.size, &reg.http.counters)
        })
        .map_err(|e| anyhow!("{location}: config blob: {e}"))?;
    let got = Sha256Digest::of(&config).to_string();
    ensure!(
        got == m.config.digest,
        "{curl}: sha256 is {got}, the manifest's config descriptor says {}",
        m.config.digest
    );
    Ok((mbytes, config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runnable_images_name_their_bundle() {
        let d = format!("sha256:{}", "ab".repeat(32));
        let image = format!(r#"{{"schemaVersion":2,"annotations":{{"{RUNNABLE_BUNDLE}":"{d}"}}}}"#);
        assert_eq!(runnable_image_bundle(image.as_bytes()), Some(d.clone()));
        let bundle = format!(
            r#"{{"artifactType":"{}","annotations":{{"{RUNNABLE_BUNDLE}":"{d}"}}}}"#,
            oci::ARTIFACT_TYPE
        );
        assert_eq!(runnable_image_bundle(bundle.as_bytes()), None);
        assert_eq!(runnable_image_bundle(br#"{"annotations":{}}"#), None);
        let bad = format!(r#"{{"annotations":{{"{RUNNABLE_BUNDLE}":"sha256:xyz"}}}}"#);
        assert_eq!(runnable_image_bundle(bad.as_bytes()), None);
        assert_eq!(runnable_image_bundle(b"not json"), None);
    }
}
