//! Where the files of a remote bundle are ([`Store`]: relative to a manifest's URL, or
//! an OCI artifact's layers by title), its packs read by range requests
//! ([`RemotePacks`]), and meta.img and blockmap fetched whole into the image directory
//! ([`ensure_file`]).

use super::http::{self, range_body, range_header, Failure, Http};
use super::oci::Registry;
use crate::format::digest::{sha256_hex, Sha256Digest};
use crate::format::manifest::{Manifest, META_IMG};
use crate::stats::Counters;
use crate::store::local::open_checked_meta;
use crate::store::source::PackSource;
use anyhow::{anyhow, bail, Context, Result};
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
/// sha256) match the manifest, else downloaded to a temporary file, checked, renamed into
/// place. (`serve` does not hash a cached meta.img: it never reads it.)
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
