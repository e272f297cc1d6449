//! Remote bundles (docs/remote.md): `http(s)://.../manifest.json` and
//! `oci://REGISTRY/REPO[:TAG|@DIGEST]`. manifest.json, meta.img and the blockmap are
//! fetched eagerly into the image's cache directory (each checked against its digest
//! before it is renamed into place) and the bundle is opened from there with the local
//! checks of [`Bundle::open`]; pack bytes are fetched lazily by range requests
//! ([`RemotePacks`]) through the persistent chunk cache ([`cache::DiskCache`]).
//! An OCI layer whose mediaType ends in `+zstd` (meta.img as `push` uploads it) is one
//! zstd stream, decompressed as it arrives; the decompressed file is what is checked
//! against manifest.json and cached.
//!
//! Image directory: `<cache dir>/<image id hex>/` = `manifest.json`, `meta.img`,
//! `blockmap`, `oci-manifest.json` (oci), `chunks/`.

pub mod cache;
pub mod http;
pub mod oci;

use crate::bundle::{normalize_id, sha256_hex, Bundle, Manifest};
use crate::stats::Counters;
use crate::verify::source::{LocalPacks, PackSource};
use crate::verify::Fetching;
use anyhow::{anyhow, bail, ensure, Context, Result};
use http::{range_body, range_header, read_body, Failure, Http};
use oci::{Reference, Registry};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options for remote bundles, shared by `mount` and `serve` (`mount` passes them on).
#[derive(clap::Args, Debug, Clone)]
pub struct RemoteArgs {
    /// Persistent cache of remote images [default: $UBLKD_CACHE_DIR, else /var/cache/ublkd].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Bound of one image's chunk cache (K, M, G, T suffixes).
    #[arg(long, default_value = "4G", value_parser = crate::ops::parse_size)]
    pub cache_size: u64,
    /// Seconds a remote fetch may take, retries included, before the read fails with EIO.
    #[arg(long, default_value_t = 30.0)]
    pub fetch_timeout: f64,
    /// Chunks fetched ahead when a remote pack is read sequentially (0: none).
    #[arg(long, default_value_t = 8)]
    pub readahead: u64,
    /// Talk plain HTTP to the registry (loopback registries always are).
    #[arg(long)]
    pub plain_http: bool,
}

/// The registry credentials `USER:PASS` (never put on a command line of the server:
/// `mount` passes them in its environment).
pub const AUTH_ENV: &str = "UBLKD_REGISTRY_AUTH";

impl RemoteArgs {
    /// The same options as command-line arguments (for `mount` -> `serve`).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--cache-size".to_string(),
            self.cache_size.to_string(),
            "--fetch-timeout".into(),
            self.fetch_timeout.to_string(),
            "--readahead".into(),
            self.readahead.to_string(),
            "--cache-dir".into(),
            self.cache_root().display().to_string(),
        ];
        if self.plain_http {
            a.push("--plain-http".into());
        }
        a
    }

    pub fn cache_root(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .or_else(|| std::env::var_os("UBLKD_CACHE_DIR").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("/var/cache/ublkd"))
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.fetch_timeout.max(0.1))
    }
}

pub enum Location {
    Local(PathBuf),
    /// the manifest's URL
    Http(String),
    Oci(Reference),
}

impl Location {
    pub fn parse(s: &str) -> Result<Location> {
        if s.starts_with("http://") || s.starts_with("https://") {
            ensure!(
                !s.ends_with('/') && !s.contains('?') && !s.contains('#'),
                "{s}: expected the URL of a bundle's manifest.json"
            );
            Ok(Location::Http(s.to_string()))
        } else if s.starts_with("oci://") {
            Ok(Location::Oci(Reference::parse(s)?))
        } else {
            ensure!(
                !s.contains("://"),
                "{s}: unsupported location (http://, https://, oci:// or a directory)"
            );
            Ok(Location::Local(PathBuf::from(s)))
        }
    }
}

/// Where the files of a remote bundle are, by bundle-relative path.
pub enum Store {
    /// relative to the directory of the manifest's URL
    Http { http: Http, base: String },
    /// blobs, by the `org.opencontainers.image.title` of the layers
    Oci {
        reg: Registry,
        blobs: HashMap<String, Layer>,
    },
}

/// One layer of the OCI artifact.
pub struct Layer {
    digest: String,
    /// the blob's size (for `+zstd` layers: the compressed size)
    size: u64,
    media_type: String,
}

impl Store {
    fn http(&self) -> &Http {
        match self {
            Store::Http { http, .. } => http,
            Store::Oci { reg, .. } => &reg.http,
        }
    }

    fn url(&self, rel: &str) -> Result<String, Failure> {
        match self {
            Store::Http { base, .. } => Ok(format!("{base}{rel}")),
            Store::Oci { reg, blobs } => blobs
                .get(rel)
                .map(|l| reg.url("blobs", &l.digest))
                .ok_or_else(|| Failure::Permanent(format!("{}: the artifact has no layer {rel:?}", reg.base))),
        }
    }

    /// The file `rel` travels as one zstd stream (an OCI layer whose mediaType ends in
    /// `+zstd`: meta.img as `btrfs-ublk-image push` uploads it); -> its compressed size.
    fn zstd_size(&self, rel: &str) -> Option<u64> {
        match self {
            Store::Http { .. } => None,
            Store::Oci { blobs, .. } => blobs
                .get(rel)
                .filter(|l| l.media_type.ends_with("+zstd"))
                .map(|l| l.size),
        }
    }

    fn get(&self, rel: &str, headers: &[(&str, &str)], timeout: Option<Duration>) -> Result<ureq::Response, Failure> {
        let url = self.url(rel)?;
        match self {
            Store::Http { http, .. } => http.get(&url, headers, timeout).map_err(|e| http::classify(&url, *e)),
            Store::Oci { reg, .. } => reg.get(&url, headers, timeout),
        }
    }
}

/// Packs on a remote store, read by range requests (retried until the fetch timeout).
pub struct RemotePacks {
    store: Arc<Store>,
    paths: Vec<String>,
    timeout: Duration,
}

impl PackSource for RemotePacks {
    fn read_at(&self, pack: u32, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let rel = &self.paths[pack as usize];
        let url = self
            .store
            .url(rel)
            .map_err(|f| std::io::Error::other(format!("{f:?}")))?;
        let len = buf.len() as u64;
        let range = range_header(offset, offset + len);
        let http = self.store.http();
        let data = http
            .retry(&url, Instant::now() + self.timeout, |left| {
                let resp = self.store.get(rel, &[("Range", &range)], Some(left))?;
                range_body(&url, resp, offset, len, &http.counters)
            })
            .map_err(std::io::Error::other)?;
        buf.copy_from_slice(&data);
        Ok(())
    }
}

/// An opened bundle, local or remote, with the source of its packs (for `serve`).
pub struct Opened {
    pub bundle: Bundle,
    /// what the user named: the canonical bundle directory, or the URL
    pub location: String,
    pub source: Box<dyn PackSource>,
    pub fetching: Fetching,
}

struct Resolved {
    bundle: Bundle,
    location: String,
    /// remote bundles: where the packs are
    store: Option<Arc<Store>>,
}

/// `mount`: open and check the bundle at `location`; a remote one's manifest (or tag) is
/// fetched again, meta.img and blockmap only when the image directory lacks them.
/// Returns the bundle and the location to record (a local bundle's canonical directory).
pub fn open_bundle(location: &str, args: &RemoteArgs, expect_id: Option<&str>) -> Result<(Bundle, String)> {
    let r = resolve(location, args, expect_id, true, true, Arc::new(Counters::default()))?;
    Ok((r.bundle, r.location))
}

/// `serve`: the bundle and its pack source. A remote image given by its id is opened
/// from its image directory as cached by `mount` (no network needed to start).
pub fn open_for_serving(
    location: &str,
    args: &RemoteArgs,
    expect_id: Option<&str>,
    counters: Arc<Counters>,
) -> Result<Opened> {
    let r = resolve(location, args, expect_id, false, expect_id.is_none(), counters.clone())?;
    let Some(store) = r.store else {
        let bm = &r.bundle.blockmap;
        let sizes: Vec<u64> = (0..bm.packs.len() as u32).map(|i| bm.stored_size(i)).collect();
        let source = Box::new(LocalPacks::open(&r.bundle.pack_paths(), &sizes)?);
        return Ok(Opened {
            bundle: r.bundle,
            location: r.location,
            source,
            fetching: Fetching::default(),
        });
    };
    let disk = cache::DiskCache::open(&r.bundle.dir.join("chunks"), args.cache_size, counters)?;
    let timeout = args.timeout();
    let paths = r.bundle.manifest.packs.iter().map(|p| p.path.clone()).collect();
    Ok(Opened {
        bundle: r.bundle,
        location: r.location,
        source: Box::new(RemotePacks { store, paths, timeout }),
        fetching: Fetching {
            disk: Some(disk),
            readahead: args.readahead,
            workers: 4,
            wait_limit: Some(timeout * 2 + Duration::from_secs(5)),
        },
    })
}

fn resolve(
    location: &str,
    args: &RemoteArgs,
    expect_id: Option<&str>,
    verify_meta: bool,
    refresh: bool,
    counters: Arc<Counters>,
) -> Result<Resolved> {
    let loc = Location::parse(location)?;
    if let Location::Local(dir) = &loc {
        let bundle = Bundle::open(dir, expect_id, verify_meta)?;
        return Ok(Resolved {
            location: bundle.dir.display().to_string(),
            bundle,
            store: None,
        });
    }
    let http = Http::new(counters, args.timeout());
    let root = args.cache_root();
    let cached = expect_id
        .filter(|_| !refresh)
        .map(normalize_id)
        .transpose()?
        .map(|id| root.join(id.trim_start_matches("sha256:")))
        .filter(|d| d.join("manifest.json").exists());
    let (dir, store) = match (&loc, cached) {
        (Location::Http(url), cached) => {
            let base = format!("{}/", url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b));
            let store = Store::Http { http, base };
            let dir = match cached {
                Some(d) => d,
                None => {
                    let mbytes = fetch_manifest_at(&store, url, Instant::now() + args.timeout())?;
                    let dir = image_dir(&root, url, &mbytes, expect_id)?;
                    let trace = store.url(crate::trace::FILE_NAME).map_err(|f| anyhow!("{f:?}"))?;
                    let got = fetch_optional(store.http(), &trace, &[], args.timeout());
                    keep_trace(&dir, &trace, got);
                    dir
                }
            };
            (dir, store)
        }
        (Location::Oci(r), cached) => {
            let creds = std::env::var(AUTH_ENV)
                .ok()
                .or_else(|| oci::docker_config_auth(&r.registry));
            let reg = Registry::new(http, r, args.plain_http, creds.as_deref())?;
            let (dir, oci_manifest) = match cached.filter(|d| d.join("oci-manifest.json").exists()) {
                Some(d) => {
                    let m = std::fs::read(d.join("oci-manifest.json"))
                        .with_context(|| format!("{}: read", d.join("oci-manifest.json").display()))?;
                    (d, m)
                }
                None => {
                    let (mbytes, config) = oci_resolve(&reg, r, args.timeout())?;
                    let dir = image_dir(&root, location, &config, expect_id)?;
                    crate::state::write_atomic(&dir.join("oci-manifest.json"), &mbytes)?;
                    let got = oci_trace(&reg, &sha256_hex(&mbytes), args.timeout());
                    keep_trace(&dir, &format!("{location} (referrers)"), got);
                    (dir, mbytes)
                }
            };
            let blobs = oci_layers(location, &oci_manifest)?;
            (dir, Store::Oci { reg, blobs })
        }
        (Location::Local(_), _) => unreachable!(),
    };
    let manifest: Manifest = serde_json::from_slice(&std::fs::read(dir.join("manifest.json"))?)
        .with_context(|| format!("{location}: manifest.json is not a valid manifest"))?;
    let mut meta = None;
    for name in ["meta.img", "blockmap"] {
        let checked = ensure_file(&store, location, &dir, name, &manifest, args.timeout(), verify_meta)?;
        if name == "meta.img" {
            meta = checked;
        }
    }
    // ensure_file checked meta.img: Bundle::open need not check it again
    let mut bundle =
        Bundle::open(&dir, expect_id, false).with_context(|| format!("{location} (cached in {})", dir.display()))?;
    bundle.meta = meta;
    for (i, p) in bundle.manifest.packs.iter().enumerate() {
        ensure!(
            !p.path.starts_with('/') && !p.path.split('/').any(|c| c == ".." || c.is_empty()),
            "{location}: pack {i} has the path {:?}, not a bundle-relative path",
            p.path
        );
        if let Store::Oci { blobs, .. } = &store {
            let layer = blobs
                .get(&p.path)
                .with_context(|| format!("{location}: the artifact has no layer titled {:?}", p.path))?;
            ensure!(
                layer.size == p.size,
                "{location}: layer {:?} ({}) has {} bytes, the manifest says {}",
                p.path,
                layer.digest,
                layer.size,
                p.size
            );
        }
    }
    Ok(Resolved {
        bundle,
        location: location.to_string(),
        store: Some(Arc::new(store)),
    })
}

/// A GET of an optional document: Ok(None) on 404.
fn fetch_optional(
    http: &Http,
    url: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<Option<Vec<u8>>, String> {
    http.retry(url, Instant::now() + timeout, |left| {
        match http.get(url, headers, Some(left)).map_err(|e| *e) {
            Ok(r) => read_small(url, r, &http.counters).map(Some),
            Err(ureq::Error::Status(404, _)) => Ok(None),
            Err(e) => Err(http::classify(url, e)),
        }
    })
}

/// The remote bundle's prefetch trace (docs/trace-format.md) as `prefetch.trace` in the
/// image directory, where `mount` looks for it (and checks it); none: no file. A failed
/// lookup only costs the prefetch.
fn keep_trace(dir: &Path, whence: &str, got: Result<Option<Vec<u8>>, String>) {
    let path = dir.join(crate::trace::FILE_NAME);
    match got {
        Ok(Some(bytes)) => {
            if let Err(e) = crate::state::write_atomic(&path, &bytes) {
                log::warn!("{whence}: keeping the trace: {e:#}");
            }
        }
        Ok(None) => {
            let _ = std::fs::remove_file(&path);
        }
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            eprintln!("ublkd: warning: prefetch trace {whence}: {e}; mounting without it");
        }
    }
}

/// The last trace referrer of the bundle manifest `manifest_hex`, through the OCI 1.1
/// referrers tag schema (tag `sha256-<hex>` = an image index of referrers; docs/remote.md).
fn oci_trace(reg: &Registry, manifest_hex: &str, timeout: Duration) -> Result<Option<Vec<u8>>, String> {
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
    let url = reg.url("manifests", &format!("sha256-{manifest_hex}"));
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
    if format!("sha256:{}", sha256_hex(&m)) != digest {
        return Err(format!("{murl}: the manifest does not match its digest"));
    }
    let m: serde_json::Value = serde_json::from_slice(&m).map_err(|e| format!("{murl}: {e}"))?;
    if m["subject"]["digest"].as_str() != Some(&format!("sha256:{manifest_hex}")) {
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
    if format!("sha256:{}", sha256_hex(&bytes)) != ldigest {
        return Err(format!("{burl}: the trace does not match its digest"));
    }
    Ok(Some(bytes))
}

/// GET the manifest by its own URL (its name on the server may differ from manifest.json).
fn fetch_manifest_at(store: &Store, url: &str, deadline: Instant) -> Result<Vec<u8>> {
    let http = store.http();
    http.retry(url, deadline, |left| {
        let r = http.get(url, &[], Some(left)).map_err(|e| http::classify(url, *e))?;
        read_small(url, r, &http.counters)
    })
    .map_err(|m| anyhow!(m))
}

/// Bound of a JSON document fetched whole (manifests, a config blob, a trace).
const SMALL_MAX: u64 = 64 << 20;

/// A small JSON document (manifest.json, an OCI manifest, a trace): at most [`SMALL_MAX`].
fn read_small(url: &str, r: ureq::Response, counters: &Counters) -> Result<Vec<u8>, Failure> {
    let mut buf = Vec::new();
    let res = r.into_reader().take(SMALL_MAX).read_to_end(&mut buf);
    Counters::add(&counters.fetch_bytes, buf.len() as u64);
    res.map_err(|e| Failure::Transient(format!("{url}: reading the body: {e}")))?;
    Ok(buf)
}

/// The image directory of the manifest `mbytes` (fetched from `location`), checked against
/// `--expect-id`, with manifest.json written into it.
fn image_dir(root: &Path, location: &str, mbytes: &[u8], expect_id: Option<&str>) -> Result<PathBuf> {
    let hex = sha256_hex(mbytes);
    let id = format!("sha256:{hex}");
    if let Some(want) = expect_id {
        let want = normalize_id(want)?;
        ensure!(want == id, "{location}: image id is {id}, expected {want}");
    }
    let dir = root.join(&hex);
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: mkdir", dir.display()))?;
    let mpath = dir.join("manifest.json");
    if std::fs::read(&mpath).ok().as_deref() != Some(mbytes) {
        crate::state::write_atomic(&mpath, mbytes)?;
    }
    Ok(dir)
}

/// meta.img or blockmap in the image directory: kept if its size (and with `verify`, its
/// sha256) match the manifest, else downloaded to a temporary file, checked, renamed into
/// place. (`serve` does not hash a cached meta.img: it never reads it.)
fn ensure_file(
    store: &Store,
    location: &str,
    dir: &Path,
    name: &str,
    m: &Manifest,
    timeout: Duration,
    verify: bool,
) -> Result<Option<std::fs::File>> {
    let info = m
        .files
        .get(name)
        .with_context(|| format!("{location}: manifest.json: files has no {name:?}"))?;
    let want = info
        .sha256
        .strip_prefix("sha256:")
        .with_context(|| format!("{location}: files.{name}.sha256 is not sha256:<hex>"))?
        .to_ascii_lowercase();
    let path = dir.join(name);
    if std::fs::metadata(&path).is_ok_and(|md| md.len() == info.size) {
        if !verify {
            return Ok(None);
        }
        if name == "meta.img" {
            if let Ok(f) = crate::bundle::open_checked_meta(&path, &want)? {
                return Ok(Some(f));
            }
        } else if std::fs::read(&path).is_ok_and(|b| sha256_hex(&b) == want) {
            // small, and Bundle::open reads and hashes it anyway: no verified record
            return Ok(None);
        }
        log::warn!(
            "{}: cached copy does not match the manifest; fetching it again",
            path.display()
        );
    }
    let url = store.url(name).map_err(|f| anyhow!("{f:?}"))?;
    let tmp = dir.join(format!("{name}.tmp.{}", std::process::id()));
    let http = store.http();
    let zstd_size = store.zstd_size(name);
    let res = http.retry(&url, Instant::now() + timeout, |_| {
        // no overall deadline for a whole file: a stalled transfer fails after the
        // read timeout (= the fetch timeout) and is retried
        let resp = store.get(name, &[], None)?;
        let mut f = std::fs::File::create(&tmp).map_err(|e| Failure::Permanent(format!("{}: {e}", tmp.display())))?;
        // what came over the wire (counted in fetch_bytes), and whether reading it failed
        let seen = WireState::default();
        let wire = Wire {
            inner: resp.into_reader(),
            counters: &http.counters,
            seen: &seen,
        };
        let (mut r, what): (Box<dyn Read + '_>, &str) = match zstd_size {
            // one zstd stream (of at most the layer's size), decompressed as it arrives
            Some(csize) => {
                let d = zstd::stream::read::Decoder::new(wire.take(csize + 1))
                    .map_err(|e| Failure::Permanent(format!("{url}: zstd: {e}")))?;
                (Box::new(d.take(info.size + 1)), "decompressed to ")
            }
            None => (Box::new(wire.take(info.size + 1)), ""),
        };
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = match r.read(&mut buf) {
                Ok(n) => n,
                Err(e) if seen.failed.get() || zstd_size.is_none() => {
                    return Err(Failure::Transient(format!("{url}: reading the body: {e}")))
                }
                // the bytes arrived but are no zstd stream of the layer's size: fetching
                // again will not help
                Err(e) => {
                    let csize = zstd_size.unwrap_or(0);
                    return Err(Failure::Permanent(if seen.bytes.get() > csize {
                        format!("{url}: more than the {csize} bytes of the layer's descriptor (refused)")
                    } else {
                        format!("{url}: the zstd-compressed blob does not decompress ({e}) after {total} bytes")
                    }));
                }
            };
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            f.write_all(&buf[..n])
                .map_err(|e| Failure::Permanent(format!("{}: {e}", tmp.display())))?;
            total += n as u64;
            if total > info.size {
                // bounded: never more than the manifest's size (+1) is read or written
                return Err(Failure::Permanent(format!(
                    "{url}: {what}more than the {} bytes the manifest says (refused)",
                    info.size
                )));
            }
        }
        let got = hex::encode(h.finalize());
        if total != info.size || got != want {
            return Err(Failure::Permanent(format!(
                "{url}: {what}{total} bytes with sha256 {got}, the manifest says {} bytes with {want}",
                info.size
            )));
        }
        f.sync_all()
            .map_err(|e| Failure::Permanent(format!("{}: {e}", tmp.display())))?;
        Ok(())
    });
    if let Err(m) = res {
        let _ = std::fs::remove_file(&tmp);
        bail!("{location}: fetching {name}: {m}");
    }
    std::fs::rename(&tmp, &path).with_context(|| format!("{}: rename", path.display()))?;
    if !verify {
        return Ok(None);
    }
    // hashed as it arrived; this is the file the loop device gets
    Ok(Some(
        std::fs::File::open(&path).with_context(|| format!("{}: open", path.display()))?,
    ))
}

/// A response body, its bytes counted in `fetch_bytes` as they arrive.
struct Wire<'a, R> {
    inner: R,
    counters: &'a Counters,
    seen: &'a WireState,
}

/// What a [`Wire`] saw, for the reader of what a decoder made of its bytes.
#[derive(Default)]
struct WireState {
    /// a read of the connection failed (not the decoder)
    failed: std::cell::Cell<bool>,
    bytes: std::cell::Cell<u64>,
}

impl<R: Read> Read for Wire<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf).inspect_err(|_| self.seen.failed.set(true))?;
        Counters::add(&self.counters.fetch_bytes, n as u64);
        self.seen.bytes.set(self.seen.bytes.get() + n as u64);
        Ok(n)
    }
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
    normalize_id(&m.config.digest).with_context(|| format!("{location}: config digest"))?;
    Ok(m)
}

/// Bundle-relative path (layer title) -> its layer.
fn oci_layers(location: &str, bytes: &[u8]) -> Result<HashMap<String, Layer>> {
    let m = parse_oci_manifest(location, bytes)?;
    let mut out = HashMap::new();
    for l in m.layers {
        let title = l
            .annotations
            .get(oci::TITLE)
            .with_context(|| format!("{location}: layer {} has no {} annotation", l.digest, oci::TITLE))?;
        normalize_id(&l.digest).with_context(|| format!("{location}: layer {title:?} digest"))?;
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
    if reference.starts_with("sha256:") {
        let got = format!("sha256:{}", sha256_hex(&bytes));
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
    normalize_id(m["annotations"][RUNNABLE_BUNDLE].as_str()?).ok()
}

/// Tag (or digest) -> (OCI manifest bytes, config blob bytes = the bundle's manifest.json).
fn oci_resolve(reg: &Registry, r: &Reference, timeout: Duration) -> Result<(Vec<u8>, Vec<u8>)> {
    let location = format!("oci://{}/{}:{}", r.registry, r.repo, r.reference);
    let deadline = Instant::now() + timeout;
    let mut mbytes = oci_manifest_bytes(reg, &location, &r.reference, deadline)?;
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
    let got = format!("sha256:{}", sha256_hex(&config));
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
    use std::net::TcpListener;

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

    fn packs_at(addr: std::net::SocketAddr, timeout: Duration) -> (RemotePacks, Arc<Counters>) {
        let counters = Arc::new(Counters::default());
        let store = Store::Http {
            http: Http::new(counters.clone(), timeout),
            base: format!("http://{addr}/"),
        };
        let packs = RemotePacks {
            store: Arc::new(store),
            paths: vec!["packs/p".into()],
            timeout,
        };
        (packs, counters)
    }

    #[test]
    fn a_silent_server_fails_the_read_at_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // accept connections and never answer
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in l.incoming() {
                held.push(s);
            }
        });
        let (packs, _) = packs_at(addr, Duration::from_millis(700));
        let t = Instant::now();
        let err = packs.read_at(0, 0, &mut [0u8; 4096]).unwrap_err();
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(600) && took < Duration::from_secs(3),
            "{took:?}: {err}"
        );
    }

    #[test]
    fn a_refused_connection_is_retried_with_backoff_until_the_deadline() {
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let (packs, counters) = packs_at(addr, Duration::from_millis(800));
        let t = Instant::now();
        let err = packs.read_at(0, 0, &mut [0u8; 4096]).unwrap_err();
        let took = t.elapsed();
        assert!(took < Duration::from_secs(2), "{took:?}");
        let s = counters.snapshot();
        assert!(s.fetch_requests >= 3 && s.fetch_errors == s.fetch_requests, "{s:?}");
        assert!(err.to_string().contains("fetch timeout"), "{err}");
        // the server is down: the next fetch makes one attempt and fails at once
        let t = Instant::now();
        let err = packs.read_at(0, 0, &mut [0u8; 4096]).unwrap_err();
        assert!(t.elapsed() < Duration::from_millis(300), "{:?}", t.elapsed());
        assert!(err.to_string().contains("failing fast"), "{err}");
    }
}
