//! The persistent chunk cache of a remote image: `<image dir>/chunks/<hh>/<sha256 hex>`,
//! one file per verified pack chunk, named by its digest.
//!
//! * Only verified bytes are put in (the caller checked the digest), written to
//!   `chunks/tmp/` and renamed into place: a torn write never has an entry's name.
//! * Every load re-checks the digest (a crash can leave a renamed file whose data never
//!   reached the disk); a bad entry is removed, counted, and the chunk fetched again.
//! * One bound for the whole cache dir, least recently used first across images: the
//!   limit bounds the chunk files of every image under the cache dir (a chunk shared
//!   by hard links counts once). A server adds up what it wrote since it last looked;
//!   when that and the total it last saw pass the limit, or it wrote 5 % of the limit,
//!   it scans every image's `chunks/` and, over the limit, removes the least recently
//!   used chunks (every name of each: space is freed only when the last link goes) down
//!   to 90 %. So the cache dir exceeds the limit by at most 5 % per running server. The order is the files'
//!   mtimes, which a hit refreshes, so it holds across images and restarts. Servers
//!   of other images notice a removed chunk when they next read it (a miss).
//!
//! One server per image uses the directory (the bundle lock is keyed by image id).
//!
//! Chunks are shared across images by digest: a chunk missing here that another image's
//! cache beside this one (`<cache dir>/<image id>/chunks/`) holds is verified and hard
//! linked in (a copy where links fail), not fetched: a host that read v1 of an image
//! fetches only v2's new chunks (`build --base`).

use crate::stats::Counters;
use anyhow::{Context, Result};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

struct Index {
    /// this image's chunks: digest -> size (the LRU order is the files' mtimes)
    entries: HashMap<[u8; 32], u64>,
    total: u64,
    /// the cache dir's chunk bytes at the last scan, and what this cache wrote since
    seen_total: u64,
    written_since: u64,
}

pub struct DiskCache {
    dir: PathBuf,
    limit: u64,
    index: Mutex<Index>,
    counters: Arc<Counters>,
    tmp_seq: AtomicU64,
}

fn parse_digest(name: &str) -> Option<[u8; 32]> {
    let v = hex::decode(name).ok()?;
    v.try_into().ok()
}

impl DiskCache {
    /// Open (creating) `dir` (`<image dir>/chunks`): leftover temp files are removed,
    /// entries indexed by mtime, and the cache trimmed to `limit` bytes.
    pub fn open(dir: &Path, limit: u64, counters: Arc<Counters>) -> Result<DiskCache> {
        let tmp = dir.join("tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).with_context(|| format!("{}: mkdir", tmp.display()))?;
        let mut index = Index {
            entries: HashMap::new(),
            total: 0,
            seen_total: 0,
            written_since: 0,
        };
        for path in chunk_files(dir) {
            let digest = path.file_name().and_then(|n| parse_digest(&n.to_string_lossy()));
            if let (Some(d), Ok(md)) = (digest, std::fs::metadata(&path)) {
                index.entries.insert(d, md.len());
                index.total += md.len();
            }
        }
        let c = DiskCache {
            dir: dir.to_path_buf(),
            limit,
            index: Mutex::new(index),
            counters,
            tmp_seq: AtomicU64::new(0),
        };
        c.trim_all();
        Ok(c)
    }

    fn path(&self, digest: &[u8; 32]) -> PathBuf {
        let h = hex::encode(digest);
        self.dir.join(&h[..2]).join(h)
    }

    /// The bound on the cache's size in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn contains(&self, digest: &[u8; 32]) -> bool {
        self.index.lock().unwrap().entries.contains_key(digest)
    }

    fn remove(&self, digest: &[u8; 32]) {
        let mut ix = self.index.lock().unwrap();
        if let Some(size) = ix.entries.remove(digest) {
            ix.total -= size;
        }
        let _ = std::fs::remove_file(self.path(digest));
        self.publish(&ix);
    }

    fn publish(&self, ix: &Index) {
        self.counters
            .disk_cache_bytes
            .store(ix.total, std::sync::atomic::Ordering::Relaxed);
    }

    /// The verified bytes of a cached chunk, or None (not cached, unreadable or bad).
    pub fn get(&self, digest: &[u8; 32]) -> Option<Vec<u8>> {
        if !self.contains(digest) {
            let found = self.take_from_other_images(digest);
            if found.is_none() {
                Counters::add(&self.counters.disk_cache_misses, 1);
            }
            return found;
        }
        let path = self.path(digest);
        let mut file = None;
        let read = std::fs::File::open(&path).and_then(|mut f| {
            let mut data = Vec::new();
            f.read_to_end(&mut data)?;
            file = Some(f);
            Ok(data)
        });
        let data = match read {
            Ok(d) => d,
            Err(e) => {
                log::warn!("chunk cache {}: {e}; fetching it again", path.display());
                self.remove(digest);
                Counters::add(&self.counters.disk_cache_misses, 1);
                return None;
            }
        };
        if Sha256::digest(&data).as_slice() != digest {
            log::error!(
                "chunk cache {}: sha256 does not match its name (torn write or disk corruption); removed",
                path.display()
            );
            Counters::add(&self.counters.disk_cache_corrupt, 1);
            Counters::add(&self.counters.disk_cache_misses, 1);
            self.remove(digest);
            return None;
        }
        // keep the LRU order across restarts (futimens: the read's descriptor will do)
        if let Some(f) = file {
            let _ = f.set_modified(SystemTime::now());
        }
        Counters::add(&self.counters.disk_cache_hits, 1);
        Some(data)
    }

    /// The image caches beside this one (`<cache dir>/<64 hex>/chunks`).
    fn other_images(&self) -> Vec<PathBuf> {
        let (Some(image), Some(root)) = (self.dir.parent(), self.dir.parent().and_then(Path::parent)) else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir(root) else {
            return Vec::new();
        };
        let mut out: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().len() == 64 && e.path() != image)
            .map(|e| e.path().join(self.dir.file_name().unwrap_or_default()))
            .collect();
        out.sort();
        out
    }

    /// A chunk another image's cache holds: verified, then linked (else copied) into this
    /// cache and counted as shared; None when no other image has it intact.
    fn take_from_other_images(&self, digest: &[u8; 32]) -> Option<Vec<u8>> {
        let h = hex::encode(digest);
        for other in self.other_images() {
            let src = other.join(&h[..2]).join(&h);
            let Ok(data) = std::fs::read(&src) else {
                continue;
            };
            if Sha256::digest(&data).as_slice() != digest {
                continue; // that cache's own load removes it
            }
            let path = self.path(digest);
            let dir_made = path.parent().is_some_and(|p| std::fs::create_dir_all(p).is_ok());
            // linked and indexed under the lock, as in `put`
            let mut ix = self.index.lock().unwrap();
            if dir_made && std::fs::hard_link(&src, &path).is_ok() {
                // another name of a file the cache dir holds: no bytes added to the bound
                if ix.entries.insert(*digest, data.len() as u64).is_none() {
                    ix.total += data.len() as u64;
                }
                self.publish(&ix);
                drop(ix);
                // the LRU order is the file's mtime, shared by its names
                if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
            } else {
                drop(ix);
                self.put(digest, &data);
            }
            Counters::add(&self.counters.disk_cache_hits, 1);
            Counters::add(&self.counters.disk_cache_shared_bytes, data.len() as u64);
            return Some(data);
        }
        None
    }

    /// Add a chunk whose digest the caller has verified. Failures only cost the cache.
    pub fn put(&self, digest: &[u8; 32], data: &[u8]) {
        if self.contains(digest) || data.len() as u64 > self.limit {
            return;
        }
        let path = self.path(digest);
        let seq = self.tmp_seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self
            .dir
            .join("tmp")
            .join(format!("{}.{}.{seq}", hex::encode(digest), std::process::id()));
        let written = std::fs::create_dir_all(path.parent().unwrap()).and_then(|()| std::fs::write(&tmp, data));
        // named and indexed under the lock: a trim scanning at the same time must not
        // remove a file the index does not list yet (the index would then count it)
        let mut ix = self.index.lock().unwrap();
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &path)) {
            drop(ix);
            let _ = std::fs::remove_file(&tmp);
            log::warn!("chunk cache {}: {e}; not cached", path.display());
            return;
        }
        if ix.entries.insert(*digest, data.len() as u64).is_none() {
            ix.total += data.len() as u64;
            ix.written_since += data.len() as u64;
        }
        self.publish(&ix);
        // others write too: look again after every 5 % of the bound written here
        let over = ix.seen_total + ix.written_since > self.limit || ix.written_since > self.limit / 20;
        drop(ix);
        if over {
            self.trim_all();
        }
    }

    /// Scan every image's chunk cache under the cache dir and, when their files (each
    /// inode once) pass `limit` bytes, remove the least recently used (by mtime) down to
    /// 90 % of it: every name of each, so that its space is freed. Removal by another
    /// server at the same time is harmless (a missing file is skipped).
    fn trim_all(&self) {
        use std::os::unix::fs::MetadataExt;
        let mut ix = self.index.lock().unwrap();
        // inode -> (size, mtime, names)
        let mut files: HashMap<(u64, u64), (u64, SystemTime, Vec<PathBuf>)> = HashMap::new();
        for chunks in std::iter::once(self.dir.clone()).chain(self.other_images()) {
            for path in chunk_files(&chunks) {
                let Ok(md) = std::fs::metadata(&path) else {
                    continue;
                };
                let mtime = md.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                let e = files
                    .entry((md.dev(), md.ino()))
                    .or_insert_with(|| (md.len(), mtime, Vec::new()));
                e.2.push(path);
            }
        }
        let mut total: u64 = files.values().map(|f| f.0).sum();
        if total > self.limit {
            let mut by_age: Vec<_> = files.into_values().collect();
            by_age.sort_by_key(|f| f.1);
            // down to 90 %: an eviction scan per insert would be wasteful once full
            let target = self.limit - self.limit / 10;
            for (size, _, names) in by_age {
                if total <= target {
                    break;
                }
                for name in names {
                    let _ = std::fs::remove_file(&name);
                    let own = name.parent().and_then(Path::parent) == Some(self.dir.as_path());
                    let digest = name.file_name().and_then(|n| parse_digest(&n.to_string_lossy()));
                    if let (true, Some(d)) = (own, digest) {
                        if let Some(s) = ix.entries.remove(&d) {
                            ix.total -= s;
                        }
                    }
                }
                total -= size;
            }
        }
        ix.seen_total = total;
        ix.written_since = 0;
        self.publish(&ix);
    }
}

/// The chunk files of one image's cache (`chunks/<hh>/<64 hex>`).
fn chunk_files(chunks: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in std::fs::read_dir(chunks).into_iter().flatten().flatten() {
        if sub.file_name().len() != 2 {
            continue;
        }
        for e in std::fs::read_dir(sub.path()).into_iter().flatten().flatten() {
            if parse_digest(&e.file_name().to_string_lossy()).is_some() {
                out.push(e.path());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(i: u8) -> (Vec<u8>, [u8; 32]) {
        let data = vec![i; 1000];
        let d: [u8; 32] = Sha256::digest(&data).into();
        (data, d)
    }

    #[test]
    fn put_get_evict_reload_and_reject_corruption() {
        let tmp = tempfile::tempdir().unwrap();
        let counters = Arc::new(Counters::default());
        let c = DiskCache::open(tmp.path(), 3500, counters.clone()).unwrap();
        let chunks: Vec<_> = (0..5u8).map(chunk).collect();
        for (data, d) in &chunks[..3] {
            c.put(d, data);
            tick();
        }
        assert_eq!(c.get(&chunks[0].1).as_deref(), Some(&chunks[0].0[..]));
        tick();
        // a fourth entry exceeds 3500 bytes: the least recently used (chunk 1) goes
        c.put(&chunks[3].1, &chunks[3].0);
        assert!(!c.contains(&chunks[1].1) && !c.path(&chunks[1].1).exists());
        assert!(c.contains(&chunks[0].1) && c.contains(&chunks[3].1));
        drop(c);
        // persistent: a new instance finds the entries
        let c = DiskCache::open(tmp.path(), 3500, counters.clone()).unwrap();
        assert_eq!(c.get(&chunks[3].1).as_deref(), Some(&chunks[3].0[..]));
        // a corrupted entry is never returned, and is removed
        let p = c.path(&chunks[0].1);
        let mut bad = std::fs::read(&p).unwrap();
        bad[10] ^= 1;
        std::fs::write(&p, bad).unwrap();
        assert_eq!(c.get(&chunks[0].1), None);
        assert!(!p.exists());
        assert_eq!(counters.snapshot().disk_cache_corrupt, 1);
        // leftover temp files go at open
        std::fs::write(tmp.path().join("tmp").join("x"), b"torn").unwrap();
        drop(c);
        let _c = DiskCache::open(tmp.path(), 3500, counters).unwrap();
        assert_eq!(std::fs::read_dir(tmp.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn the_published_total_is_the_files_on_disk_under_concurrent_puts() {
        let tmp = tempfile::tempdir().unwrap();
        let counters = Arc::new(Counters::default());
        let c = Arc::new(DiskCache::open(tmp.path(), 20_000, counters.clone()).unwrap());
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for i in 0..400u32 {
                        let data = [t.to_le_bytes(), i.to_le_bytes()].concat().repeat(125);
                        c.put(&Sha256::digest(&data).into(), &data);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let on_disk: u64 = chunk_files(tmp.path())
            .iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(counters.snapshot().disk_cache_bytes, on_disk);
        assert!(on_disk <= 20_000);
    }

    /// Past the file timestamps' granularity (a kernel tick), so that mtimes order uses.
    fn tick() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    #[test]
    fn one_bound_for_the_cache_dir_least_recently_used_across_images() {
        let tmp = tempfile::tempdir().unwrap();
        let image = |c: char| tmp.path().join(c.to_string().repeat(64)).join("chunks");
        let ca = Arc::new(Counters::default());
        let a = DiskCache::open(&image('a'), 3500, ca.clone()).unwrap();
        let b = DiskCache::open(&image('b'), 3500, Arc::new(Counters::default())).unwrap();
        let c: Vec<_> = (0..5u8).map(chunk).collect();
        a.put(&c[0].1, &c[0].0);
        tick();
        a.put(&c[1].1, &c[1].0);
        tick();
        b.put(&c[2].1, &c[2].0);
        tick();
        // shared by a hard link: no bytes added, and it is now the most recently used
        assert!(b.get(&c[0].1).is_some());
        tick();
        // 4000 bytes in the cache dir: a's chunk 1, the least recently used of all, goes
        b.put(&c[3].1, &c[3].0);
        assert!(!a.path(&c[1].1).exists());
        for (cache, i) in [(&a, 0), (&b, 0), (&b, 2), (&b, 3)] {
            assert!(cache.path(&c[i].1).exists(), "chunk {i}");
        }
        // a's server learns it when it reads it: a miss, fetched again
        let misses = ca.snapshot().disk_cache_misses;
        assert_eq!(a.get(&c[1].1), None);
        assert_eq!(ca.snapshot().disk_cache_misses, misses + 1);
        assert!(!a.contains(&c[1].1));
        // a shared chunk that is the oldest goes under both names (its space is freed)
        let old = std::fs::File::options().write(true).open(a.path(&c[0].1)).unwrap();
        old.set_modified(SystemTime::UNIX_EPOCH).unwrap();
        a.put(&c[4].1, &c[4].0);
        assert!(!a.path(&c[0].1).exists() && !b.path(&c[0].1).exists());
        assert!(a.path(&c[4].1).exists() && b.path(&c[2].1).exists() && b.path(&c[3].1).exists());
    }

    #[test]
    fn a_hit_refreshes_the_chunks_mtime() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&tmp.path().join("chunks"), 1 << 20, Arc::new(Counters::default())).unwrap();
        let (data, digest) = chunk(7);
        cache.put(&digest, &data);
        let path = cache.path(&digest);
        std::fs::File::open(&path)
            .unwrap()
            .set_modified(SystemTime::UNIX_EPOCH)
            .unwrap();
        assert_eq!(cache.get(&digest).as_deref(), Some(&data[..]));
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert!(mtime > SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(86400));
    }

    #[test]
    fn chunks_are_shared_with_other_images_by_digest_verified() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let image = |c: char| tmp.path().join(c.to_string().repeat(64)).join("chunks");
        let ca = Arc::new(Counters::default());
        let cb = Arc::new(Counters::default());
        let a = DiskCache::open(&image('a'), 1 << 20, ca).unwrap();
        let b = DiskCache::open(&image('b'), 1 << 20, cb.clone()).unwrap();
        let (one, d1) = chunk(1);
        let (two, d2) = chunk(2);
        a.put(&d1, &one);
        a.put(&d2, &two);
        // b finds chunk 1 in a's cache: the same file (a hard link), counted as shared
        assert_eq!(b.get(&d1).as_deref(), Some(&one[..]));
        assert!(b.contains(&d1));
        let ino = |c: &DiskCache, d| std::fs::metadata(c.path(d)).unwrap().ino();
        assert_eq!(ino(&a, &d1), ino(&b, &d1));
        let s = cb.snapshot();
        assert_eq!(
            (s.disk_cache_hits, s.disk_cache_misses, s.disk_cache_shared_bytes),
            (1, 0, 1000)
        );
        // a corrupt entry of a's is not taken; a chunk no image has is a miss
        let p = a.path(&d2);
        let mut bad = std::fs::read(&p).unwrap();
        bad[0] ^= 1;
        std::fs::write(&p, bad).unwrap();
        assert_eq!(b.get(&d2), None);
        assert_eq!(b.get(&chunk(3).1), None);
        assert!(!b.contains(&d2));
        assert_eq!(cb.snapshot().disk_cache_misses, 2);
    }
}
