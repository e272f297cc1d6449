//! Where the files of a remote bundle are ([`Store`]: relative to a manifest's URL, or
//! an OCI artifact's layers by title), its packs read by range requests
//! ([`RemotePacks`]), and meta.img and blockmap fetched whole (or made from a patch
//! base and a patch) into the image directory ([`ensure_file`]).

use super::http::{self, range_body, range_header, Failure, Http};
use super::oci::Registry;
use crate::format::block_form;
use crate::format::digest::{sha256_hex, Sha256Digest};
use crate::format::manifest::{FileInfo, Manifest, PatchInfo, META_IMG, PATCH_BASE_DIR, PATCH_SUFFIX};
use crate::stats::Counters;
use crate::store::local::open_checked_meta;
use crate::store::source::PackSource;
use anyhow::{anyhow, bail, ensure, Context, Result};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    pub digest: String,
    /// the blob's size (for `+zstd` layers: the compressed size)
    pub size: u64,
    pub media_type: String,
}

impl Store {
    pub fn http(&self) -> &Http {
        match self {
            Store::Http { http, .. } => http,
            Store::Oci { reg, .. } => &reg.http,
        }
    }

    pub fn url(&self, rel: &str) -> Result<String, Failure> {
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
    pub fn zstd_size(&self, rel: &str) -> Option<u64> {
        match self {
            Store::Http { .. } => None,
            Store::Oci { blobs, .. } => blobs
                .get(rel)
                .filter(|l| l.media_type.ends_with("+zstd"))
                .map(|l| l.size),
        }
    }

    pub fn get(
        &self,
        rel: &str,
        headers: &[(&str, &str)],
        timeout: Option<Duration>,
    ) -> Result<ureq::Response, Failure> {
        let url = self.url(rel)?;
        match self {
            Store::Http { http, .. } => http.get(&url, headers, timeout).map_err(|e| http::classify(&url, *e)),
            Store::Oci { reg, .. } => reg.get(&url, headers, timeout),
        }
    }
}

/// Packs on a remote store, read by range requests (retried until the fetch timeout).
pub struct RemotePacks {
    pub store: Arc<Store>,
    pub paths: Vec<String>,
    pub timeout: Duration,
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

/// meta.img or blockmap in the image directory: kept if its size (and with `verify`, its
/// sha256) match the manifest, else downloaded (format_version 2: made from its patch
/// base and patch, [`patched`]) to a temporary file, checked, renamed into place.
/// (`serve` does not hash a cached meta.img: it never reads it.)
pub fn ensure_file(
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
    let want = Sha256Digest::parse(&info.sha256)
        .with_context(|| format!("{location}: files.{name}.sha256 is not sha256:<hex>"))?
        .hex();
    let path = dir.join(name);
    if std::fs::metadata(&path).is_ok_and(|md| md.len() == info.size) {
        if !verify {
            return Ok(None);
        }
        if name == META_IMG {
            if let Ok(f) = open_checked_meta(&path, &want)? {
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
    match m.patches.get(name) {
        Some(p) => patched(store, location, dir, name, info, p, m.in_block_form(name), timeout)?,
        None => fetch_checked(store, location, name, info, &path, timeout)?,
    }
    if !verify {
        return Ok(None);
    }
    // hashed as it arrived (or was made); this is the file the loop device gets
    Ok(Some(
        std::fs::File::open(&path).with_context(|| format!("{}: open", path.display()))?,
    ))
}

/// The store's file `rel` downloaded to `path` through a temporary file beside it,
/// checked against `info` (size and sha256; a `+zstd` layer after decompression) before
/// it is renamed into place.
fn fetch_checked(
    store: &Store,
    location: &str,
    rel: &str,
    info: &FileInfo,
    path: &Path,
    timeout: Duration,
) -> Result<()> {
    let want = Sha256Digest::parse(&info.sha256)
        .with_context(|| format!("{location}: the sha256 of {rel} is not sha256:<hex>"))?
        .hex();
    let url = store.url(rel).map_err(|f| anyhow!("{f:?}"))?;
    let tmp = temp_beside(path);
    let http = store.http();
    let zstd_size = store.zstd_size(rel);
    let res = http.retry(&url, Instant::now() + timeout, |_| {
        // no overall deadline for a whole file: a stalled transfer fails after the
        // read timeout (= the fetch timeout) and is retried
        let resp = store.get(rel, &[], None)?;
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
        bail!("{location}: fetching {rel}: {m}");
    }
    std::fs::rename(&tmp, path).with_context(|| format!("{}: rename", path.display()))?;
    Ok(())
}

fn temp_beside(path: &Path) -> std::path::PathBuf {
    let name = path.file_name().map_or_else(Default::default, |n| n.to_string_lossy());
    path.with_file_name(format!("{name}.tmp.{}", std::process::id()))
}

/// `name` (meta.img or blockmap, format_version 2) made from its patch base and its patch
/// (docs/bundle-format.md). The patch base is this image's copy, else another image's
/// under the cache dir (a host that ran an earlier version of the lineage holds it: only
/// the patch moves), else it is fetched into `base/`. What is used is checked: the patch
/// base and the patch against their sha256 in the manifest, the file they make against
/// `files` before it is renamed into place. `block_forms`: the patch is made between the
/// files' block forms (format_version 3's meta.img).
#[allow(clippy::too_many_arguments)]
fn patched(
    store: &Store,
    location: &str,
    dir: &Path,
    name: &str,
    info: &FileInfo,
    p: &PatchInfo,
    block_forms: bool,
    timeout: Duration,
) -> Result<()> {
    let base_rel = format!("{PATCH_BASE_DIR}/{name}");
    let mut base = match find_patch_base(dir, name, &p.base) {
        Some(bytes) => bytes,
        None => {
            let path = dir.join(&base_rel);
            let parent = dir.join(PATCH_BASE_DIR);
            std::fs::create_dir_all(&parent).with_context(|| format!("{}: mkdir", parent.display()))?;
            fetch_checked(store, location, &base_rel, &p.base, &path, timeout)?;
            std::fs::read(&path).with_context(|| format!("{}: read", path.display()))?
        }
    };
    let patch_rel = format!("{name}{PATCH_SUFFIX}");
    let patch_path = dir.join(&patch_rel);
    let patch_info = FileInfo {
        sha256: p.sha256.clone(),
        size: p.size,
    };
    fetch_checked(store, location, &patch_rel, &patch_info, &patch_path, timeout)?;
    let patch = std::fs::read(&patch_path).with_context(|| format!("{}: read", patch_path.display()))?;
    let _ = std::fs::remove_file(&patch_path); // used once: the file it makes is kept
    let path = dir.join(name);
    let tmp = temp_beside(&path);
    if block_forms {
        block_form::transform(&mut base, false);
    }
    let res = apply_patch(&base, &patch, info, block_forms, &tmp)
        .and_then(|()| std::fs::rename(&tmp, &path).with_context(|| format!("{}: rename", path.display())));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.with_context(|| format!("{location}: {patch_rel} against {base_rel}"))
}

/// The bytes of `name`'s patch base if this host holds it: `dir/base/<name>`, else a file
/// `<name>` or `base/<name>` of another image directory under the cache dir (`dir`'s
/// parent) with its size and sha256. The bytes returned are the bytes hashed.
fn find_patch_base(dir: &Path, name: &str, want: &FileInfo) -> Option<Vec<u8>> {
    let want_hex = Sha256Digest::parse(&want.sha256).ok()?.hex();
    let own = dir.join(PATCH_BASE_DIR).join(name);
    let others = std::fs::read_dir(dir.parent()?)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|d| d != dir)
        .flat_map(|d| [d.join(name), d.join(PATCH_BASE_DIR).join(name)]);
    std::iter::once(own)
        .chain(others)
        .filter(|c| std::fs::metadata(c).is_ok_and(|md| md.is_file() && md.len() == want.size))
        .find_map(|c| {
            let bytes = std::fs::read(&c).ok()?;
            (sha256_hex(&bytes) == want_hex).then(|| {
                log::info!("{}: patch base found in {}", dir.display(), c.display());
                bytes
            })
        })
}

/// The file `patch` makes of `base` (a zstd frame with `base` as its raw-content
/// dictionary, `zstd --patch-from`), written to `tmp` and checked against `info`. With
/// `block_forms`, `base` is a block form and so is what the frame makes: the file is
/// its inverse.
fn apply_patch(base: &[u8], patch: &[u8], info: &FileInfo, block_forms: bool, tmp: &Path) -> Result<()> {
    let want = Sha256Digest::parse(&info.sha256)?.hex();
    let mut d = zstd::stream::read::Decoder::with_dictionary(patch, base).context("zstd")?;
    // the writer sizes the window to span the patch base (up to zstd's maximum)
    d.window_log_max(31).context("zstd")?;
    let mut out = Vec::with_capacity(usize::try_from(info.size).unwrap_or(0).min(1 << 30));
    d.take(info.size + 1)
        .read_to_end(&mut out)
        .context("not a zstd patch of its base")?;
    if block_forms {
        block_form::transform(&mut out, true);
    }
    let total = out.len() as u64;
    let got = sha256_hex(&out);
    let mut f = std::fs::File::create(tmp).with_context(|| format!("{}: create", tmp.display()))?;
    f.write_all(&out).with_context(|| format!("{}: write", tmp.display()))?;
    ensure!(
        total == info.size && got == want,
        "makes {total} bytes with sha256 {got}, the manifest says {} bytes with {want}",
        info.size
    );
    f.sync_all().with_context(|| format!("{}: fsync", tmp.display()))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

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
    fn a_patch_applies_to_its_base_only() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let base: Vec<u8> = (0..200_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut new = base.clone();
        new[1000..1010].copy_from_slice(b"0123456789");
        // what `zstd --patch-from` (patch.py) writes: the base as a raw-content dictionary
        let patch = zstd::bulk::Compressor::with_dictionary(19, &base)
            .unwrap()
            .compress(&new)
            .unwrap();
        assert!(patch.len() < 1000, "{}", patch.len());
        let info = FileInfo {
            sha256: format!("sha256:{}", sha256_hex(&new)),
            size: new.len() as u64,
        };
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        apply_patch(&base, &patch, &info, false, &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), new);
        // another base: other bytes (or no frame at all), refused by the digest
        let other: Vec<u8> = base.iter().map(|b| !b).collect();
        let err = format!("{:#}", apply_patch(&other, &patch, &info, false, &out).unwrap_err());
        assert!(err.contains("the manifest says") || err.contains("zstd"), "{err}");
        let short = FileInfo { size: 100, ..info };
        let err = format!("{:#}", apply_patch(&base, &patch, &short, false, &out).unwrap_err());
        assert!(err.contains("makes 101 bytes"), "{err}");
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
