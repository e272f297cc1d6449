//! Remote bundles (docs/remote.md): `http(s)://.../manifest.json` and
//! `oci://REGISTRY/REPO[:TAG|@DIGEST]`. manifest.json, meta.img and the blockmap are
//! fetched eagerly into the image's cache directory (each checked against its digest
//! before it is renamed into place) and the bundle is opened from there with the local
//! checks of [`Bundle::open`]; pack bytes are fetched lazily by range requests
//! ([`RemotePacks`]) through the persistent chunk cache ([`DiskCache`]).
//! An OCI layer whose mediaType ends in `+zstd` (meta.img as `push` uploads it) is one
//! zstd stream, decompressed as it arrives; the decompressed file is what is checked
//! against manifest.json and cached.
//!
//! A bundle with patches (format_version 2) gets its meta.img and blockmap from its patch
//! base (found in any image directory of the cache dir, else fetched into `base/`) and
//! the small patches ([`files::ensure_file`]).
//!
//! Image directory: `<cache dir>/<image id hex>/` = `manifest.json`, `meta.img`,
//! `blockmap`, `oci-manifest.json` (oci), `chunks/`, `base/` (a patch base it fetched).
//!
//! * [`http`]: the HTTP client (retries, deadlines, bodies);
//! * [`oci`]: the OCI distribution client (references, auth);
//! * [`artifact`]: a bundle as an OCI artifact (its manifest, layers, trace referrer);
//! * [`files`]: where a remote bundle's files are ([`Store`]), its packs read by range.

pub mod artifact;
pub mod files;
pub mod http;
pub mod oci;

use crate::args::RemoteArgs;
use crate::format::digest::Sha256Digest;
use crate::format::manifest::{Manifest, BLOCKMAP, MANIFEST, META_IMG};
use crate::stats::Counters;
use crate::store::cache::DiskCache;
use crate::store::local::Bundle;
use crate::store::source::{Fetching, LocalPacks, PackSource};
use crate::util::write_atomic;
use anyhow::{anyhow, ensure, Context, Result};
pub use artifact::ManifestCheck;
use artifact::{oci_layers, oci_resolve, oci_trace};
use files::{ensure_file, RemotePacks, Store};
use http::{fetch_optional, read_small, Http};
use oci::{Reference, Registry};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An image directory's copy of the OCI manifest (oci:// bundles).
pub const OCI_MANIFEST: &str = "oci-manifest.json";
/// An image directory's persistent chunk cache.
pub const CHUNKS_DIR: &str = "chunks";

/// The registry credentials `USER:PASS` (never put on a command line of the server:
/// `mount` passes them in its environment).
pub const AUTH_ENV: &str = "UBLKD_REGISTRY_AUTH";

pub enum Location {
    Local(PathBuf),
    /// the manifest's URL
    Http(String),
    Oci(Reference),
}

impl Location {
    /// http(s) or oci: packs fetched over the network.
    pub fn is_remote(&self) -> bool {
        !matches!(self, Location::Local(_))
    }

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
pub fn open_bundle(
    location: &str,
    args: &RemoteArgs,
    expect_id: Option<&str>,
    check: Option<ManifestCheck>,
) -> Result<(Bundle, String)> {
    let r = resolve(
        location,
        args,
        expect_id,
        true,
        true,
        Arc::new(Counters::default()),
        check,
    )?;
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
    let r = resolve(
        location,
        args,
        expect_id,
        false,
        expect_id.is_none(),
        counters.clone(),
        None,
    )?;
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
    let disk = DiskCache::open(&r.bundle.dir.join(CHUNKS_DIR), args.cache_size, counters)?;
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
    check: Option<ManifestCheck>,
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
        .map(Sha256Digest::parse_id)
        .transpose()?
        .map(|id| root.join(id.hex()))
        .filter(|d| d.join(MANIFEST).exists());
    let (dir, store) = match (&loc, cached) {
        (Location::Http(url), cached) => {
            let base = format!("{}/", url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b));
            let store = Store::Http { http, base };
            let dir = match cached {
                Some(d) => d,
                None => {
                    let mbytes = fetch_manifest_at(&store, url, Instant::now() + args.timeout())?;
                    let dir = image_dir(&root, url, &mbytes, expect_id)?;
                    let trace = store
                        .url(crate::format::trace::FILE_NAME)
                        .map_err(|f| anyhow!("{f:?}"))?;
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
            let (dir, oci_manifest) = match cached.filter(|d| d.join(OCI_MANIFEST).exists()) {
                Some(d) => {
                    let m = std::fs::read(d.join(OCI_MANIFEST))
                        .with_context(|| format!("{}: read", d.join(OCI_MANIFEST).display()))?;
                    (d, m)
                }
                None => {
                    let (mbytes, config) = oci_resolve(&reg, r, args.timeout(), check)?;
                    let dir = image_dir(&root, location, &config, expect_id)?;
                    write_atomic(&dir.join(OCI_MANIFEST), &mbytes)?;
                    let got = oci_trace(&reg, &Sha256Digest::of(&mbytes), args.timeout());
                    keep_trace(&dir, &format!("{location} (referrers)"), got);
                    (dir, mbytes)
                }
            };
            let blobs = oci_layers(location, &oci_manifest)?;
            (dir, Store::Oci { reg, blobs })
        }
        (Location::Local(_), _) => unreachable!(),
    };
    let manifest: Manifest = serde_json::from_slice(&std::fs::read(dir.join(MANIFEST))?)
        .with_context(|| format!("{location}: manifest.json is not a valid manifest"))?;
    manifest.check_format(&format!("{location}: manifest.json"))?;
    let mut meta = None;
    for name in [META_IMG, BLOCKMAP] {
        let checked = ensure_file(&store, location, &dir, name, &manifest, args.timeout(), verify_meta)?;
        if name == META_IMG {
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

/// The remote bundle's prefetch trace (docs/trace-format.md) as `prefetch.trace` in the
/// image directory, where `mount` looks for it (and checks it); none: no file. A failed
/// lookup only costs the prefetch.
fn keep_trace(dir: &Path, whence: &str, got: Result<Option<Vec<u8>>, String>) {
    let path = dir.join(crate::format::trace::FILE_NAME);
    match got {
        Ok(Some(bytes)) => {
            if let Err(e) = write_atomic(&path, &bytes) {
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

/// GET the manifest by its own URL (its name on the server may differ from manifest.json).
fn fetch_manifest_at(store: &Store, url: &str, deadline: Instant) -> Result<Vec<u8>> {
    let http = store.http();
    http.retry(url, deadline, |left| {
        let r = http.get(url, &[], Some(left)).map_err(|e| http::classify(url, *e))?;
        read_small(url, r, &http.counters)
    })
    .map_err(|m| anyhow!(m))
}

/// The image directory of the manifest `mbytes` (fetched from `location`), checked against
/// `--expect-id`, with manifest.json written into it.
fn image_dir(root: &Path, location: &str, mbytes: &[u8], expect_id: Option<&str>) -> Result<PathBuf> {
    let id = Sha256Digest::of(mbytes);
    let hex = id.hex();
    if let Some(want) = expect_id {
        let want = Sha256Digest::parse_id(want)?;
        ensure!(want == id, "{location}: image id is {id}, expected {want}");
    }
    let dir = root.join(&hex);
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: mkdir", dir.display()))?;
    let mpath = dir.join(MANIFEST);
    if std::fs::read(&mpath).ok().as_deref() != Some(mbytes) {
        write_atomic(&mpath, mbytes)?;
    }
    Ok(dir)
}
