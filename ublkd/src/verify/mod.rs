//! The verified read path: pack chunks are read whole, checked against the blockmap
//! digest, and only then served; verified chunks live in a bounded memory cache.
//!
//! A chunk is looked up in: the memory cache -> the persistent chunk cache (remote
//! bundles; re-verified on load) -> the pack source (then verified, then put in the
//! persistent cache). Every missing chunk gets one slot in the memory cache, claimed by
//! the thread that loads it; concurrent readers of that chunk wait for the slot (single
//! flight), so "verified once before first use" holds under load. Chunks a read spans
//! are loaded by one source read (one range request for remote packs), and sequential
//! reads of a remote pack make a small worker pool fetch the next chunks ahead.
//! A failed load is not cached: every read of a bad chunk re-checks it, fails with EIO
//! and is counted.
//!
//! Compressed packs (blockmap version 2): what is read, verified and put in the
//! persistent cache is a chunk's STORED bytes (a zstd frame); it is decompressed after the
//! digest matched and must give exactly the chunk's logical length. The memory cache
//! holds decompressed chunks.
//!
//! Checks before a mount: [`structure`] (meta.img), [`policy`] and [`signature`] (the
//! containers-policy.json signature policy, docs/signatures.md).

mod fs_tree;
mod ondisk;
pub mod policy;
pub mod signature;
pub mod structure;

use crate::format::blockmap::Blockmap;
use crate::format::trace::AccessLog;
use crate::stats::Counters;
use crate::store::source::Fetching;
use crate::store::source::PackSource;
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Fetches of a remote chunk whose bytes keep failing their digest, before the read fails.
/// 5: a link that corrupts a fraction p of the responses fails a chunk with p^5 (the soak's
/// proxy, p = 2%: 3 attempts, p^3 = 8e-6 per fetch, failed one read in one of four 2-minute
/// runs of ~18,000 chunk fetches); a chunk that is corrupt at the source costs 5 fetches.
const REMOTE_MISMATCH_ATTEMPTS: u32 = 5;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkError {
    /// The pack could not be read (I/O error, short file, remote fetch failed).
    Read(String),
    /// The bytes read do not match the digest.
    Mismatch { pack: u32, chunk: u64 },
    /// Verified stored bytes that do not decompress to the chunk's logical length.
    Decode { pack: u32, chunk: u64, why: String },
}

type Loaded = Result<Arc<Vec<u8>>, ChunkError>;

/// One chunk in the memory cache: empty while its loader works, then the result.
#[derive(Default)]
struct Slot {
    val: Mutex<Option<Loaded>>,
    ready: Condvar,
}

impl Slot {
    fn fill(&self, v: Loaded) {
        *self.val.lock().unwrap() = Some(v);
        self.ready.notify_all();
    }

    fn loading(&self) -> bool {
        self.val.lock().unwrap().is_none()
    }

    fn wait(&self, limit: Option<Duration>) -> Loaded {
        let mut g = self.val.lock().unwrap();
        let deadline = limit.map(|l| std::time::Instant::now() + l);
        loop {
            if let Some(v) = &*g {
                return v.clone();
            }
            match deadline {
                None => g = self.ready.wait(g).unwrap(),
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Err(ChunkError::Read(
                            "timed out waiting for another fetch of the chunk".into(),
                        ));
                    }
                    g = self.ready.wait_timeout(g, left).unwrap().0;
                }
            }
        }
    }
}

struct CacheInner {
    map: HashMap<(u32, u64), (Arc<Slot>, u64)>,
    tick: u64,
}

struct Core {
    blockmap: Arc<Blockmap>,
    source: Box<dyn PackSource>,
    counters: Arc<Counters>,
    capacity: usize,
    cache: Mutex<CacheInner>,
    pack_names: Vec<String>,
    fetching: Fetching,
    /// per pack: (last chunk read, chunks read in sequence up to it)
    streaks: Mutex<HashMap<u32, (u64, u64)>>,
}

pub struct VerifiedChunks {
    core: Arc<Core>,
    pool: Option<crate::pool::Pool>,
    /// First demand access of each chunk (`ublkd record`); prefetches are not noted.
    pub access: AccessLog,
}

/// Who asked for chunks: loads are counted apart (`demand_chunk_loads`, `prefetch_*`,
/// `readahead_chunks`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Why {
    Demand,
    Prefetch,
    Readahead,
}

impl Core {
    /// The slot of `key`, and whether the caller created it (and must fill it).
    fn slot(&self, key: (u32, u64)) -> (Arc<Slot>, bool) {
        let mut c = self.cache.lock().unwrap();
        c.tick += 1;
        let tick = c.tick;
        if let Some((slot, used)) = c.map.get_mut(&key) {
            *used = tick;
            return (slot.clone(), false);
        }
        let slot = Arc::new(Slot::default());
        self.insert(&mut c, key, slot.clone(), tick);
        (slot, true)
    }

    fn insert(&self, c: &mut CacheInner, key: (u32, u64), slot: Arc<Slot>, tick: u64) {
        if c.map.len() >= self.capacity {
            // evict the least recently used loaded entry (the cache is small: a scan is fine)
            let old = c
                .map
                .iter()
                .filter(|(_, (s, _))| !s.loading())
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k);
            if let Some(old) = old {
                c.map.remove(&old);
            }
        }
        c.map.insert(key, (slot, tick));
    }

    /// Claim the chunks of `pack` in `chunks` that are not in memory (and, with
    /// `skip_on_disk`, not in the persistent cache either): new slots the caller fills.
    fn claim(&self, pack: u32, chunks: std::ops::Range<u64>, skip_on_disk: bool) -> Vec<(u64, Arc<Slot>)> {
        let mut c = self.cache.lock().unwrap();
        let mut out = Vec::new();
        for chunk in chunks {
            if c.map.contains_key(&(pack, chunk)) {
                continue;
            }
            if skip_on_disk {
                if let Some(d) = &self.fetching.disk {
                    if d.contains(self.blockmap.digest(pack, chunk)) {
                        continue;
                    }
                }
            }
            c.tick += 1;
            let (slot, tick) = (Arc::new(Slot::default()), c.tick);
            self.insert(&mut c, (pack, chunk), slot.clone(), tick);
            out.push((chunk, slot));
        }
        out
    }

    fn forget(&self, key: (u32, u64), slot: &Arc<Slot>) {
        let mut c = self.cache.lock().unwrap();
        if let Some((s, _)) = c.map.get(&key) {
            if Arc::ptr_eq(s, slot) {
                c.map.remove(&key);
            }
        }
    }

    fn fail(&self, pack: u32, chunk: u64, slot: &Arc<Slot>, e: ChunkError) {
        match &e {
            ChunkError::Mismatch { .. } => {
                Counters::add(&self.counters.verify_failures, 1);
                let (s, en) = self.blockmap.chunk_bounds(pack, chunk);
                log::error!(
                    "verification failed: pack {} chunk {chunk} (bytes [{s}, {en})): sha256 does not match the blockmap; failing the read with EIO",
                    self.pack_names[pack as usize]
                );
            }
            ChunkError::Decode { why, .. } => {
                Counters::add(&self.counters.verify_failures, 1);
                log::error!(
                    "pack {} chunk {chunk}: {why}; failing the read with EIO",
                    self.pack_names[pack as usize]
                );
            }
            ChunkError::Read(msg) => log::error!("{msg}"),
        }
        // not cached: the next read tries again
        self.forget((pack, chunk), slot);
        slot.fill(Err(e));
    }

    /// [`Core::fill`], then count the chunks loaded by `why`.
    fn fill_for(&self, pack: u32, owned: Vec<(u64, Arc<Slot>)>, why: Why) {
        let slots: Vec<Arc<Slot>> = owned.iter().map(|(_, s)| s.clone()).collect();
        self.fill(pack, owned);
        for s in slots {
            if let Some(Ok(data)) = &*s.val.lock().unwrap() {
                let c = &self.counters;
                match why {
                    Why::Demand => Counters::add(&c.demand_chunk_loads, 1),
                    Why::Prefetch => {
                        Counters::add(&c.prefetch_chunks, 1);
                        Counters::add(&c.prefetch_bytes, data.len() as u64);
                    }
                    Why::Readahead => Counters::add(&c.readahead_chunks, 1),
                }
            }
        }
    }

    /// Load claimed chunks of one pack: from the persistent cache where it has them, the
    /// rest from the source, one read per run of adjacent chunks; verify; fill the slots.
    fn fill(&self, pack: u32, mut owned: Vec<(u64, Arc<Slot>)>) {
        owned.sort_by_key(|(c, _)| *c);
        let mut need: Vec<(u64, Arc<Slot>)> = Vec::new();
        for (chunk, slot) in owned {
            match self
                .fetching
                .disk
                .as_ref()
                .and_then(|d| d.get(self.blockmap.digest(pack, chunk)))
            {
                // verified by the disk cache against the digest on load
                Some(data) => match self.decode(pack, chunk, data) {
                    Ok(d) => slot.fill(Ok(Arc::new(d))),
                    Err(e) => self.fail(pack, chunk, &slot, e),
                },
                None => need.push((chunk, slot)),
            }
        }
        for run in need.chunk_by(|a, b| b.0 == a.0 + 1) {
            self.fill_run(pack, run, 1);
        }
    }

    /// Verified stored bytes of a chunk -> its logical bytes (a zstd frame decompressed to
    /// exactly the chunk's length; raw bytes as they are).
    fn decode(&self, pack: u32, chunk: u64, stored: Vec<u8>) -> Result<Vec<u8>, ChunkError> {
        if !self.blockmap.stored(pack, chunk).zstd {
            return Ok(stored);
        }
        let (s, e) = self.blockmap.chunk_bounds(pack, chunk);
        let want = (e - s) as usize;
        let bad = |why: String| ChunkError::Decode { pack, chunk, why };
        // capacity = the logical length: a frame that would give more fails here
        let out = zstd::bulk::decompress(&stored, want).map_err(|e| bad(format!("zstd: {e}")))?;
        if out.len() != want {
            return Err(bad(format!("decompresses to {} bytes, not its {want}", out.len())));
        }
        Ok(out)
    }

    /// Attempt `attempt` (from 1) at a run of adjacent chunks. A remote chunk whose bytes do not match its digest
    /// is fetched again (up to [`REMOTE_MISMATCH_ATTEMPTS`] in all, counted in
    /// `verify_failures` each time): a response corrupted on the way (a proxy, a flaky
    /// link) then costs a round trip, not a failed read; a chunk that stays wrong fails.
    fn fill_run(&self, pack: u32, run: &[(u64, Arc<Slot>)], attempt: u32) {
        // stored chunks are contiguous: adjacent chunks are one read of stored bytes
        let start = self.blockmap.stored(pack, run[0].0).offset;
        let last = self.blockmap.stored(pack, run[run.len() - 1].0);
        let end = last.offset + last.length;
        let mut buf = vec![0u8; (end - start) as usize];
        if let Err(e) = self.source.read_at(pack, start, &mut buf) {
            let msg = format!("pack {}: read [{start}, {end}): {e}", self.pack_names[pack as usize]);
            for (chunk, slot) in run {
                self.fail(pack, *chunk, slot, ChunkError::Read(msg.clone()));
            }
            return;
        }
        Counters::add(&self.counters.pack_bytes_read, buf.len() as u64);
        let mut again: Vec<(u64, Arc<Slot>)> = Vec::new();
        for (chunk, slot) in run {
            let sc = self.blockmap.stored(pack, *chunk);
            let data = &buf[(sc.offset - start) as usize..(sc.offset + sc.length - start) as usize];
            let digest = self.blockmap.digest(pack, *chunk);
            if Sha256::digest(data).as_slice() != digest {
                if self.fetching.disk.is_some() && attempt < REMOTE_MISMATCH_ATTEMPTS {
                    Counters::add(&self.counters.verify_failures, 1);
                    log::warn!(
                        "pack {} chunk {chunk}: sha256 does not match the blockmap (attempt {attempt}): fetching it again",
                        self.pack_names[pack as usize]
                    );
                    again.push((*chunk, slot.clone()));
                    continue;
                }
                self.fail(pack, *chunk, slot, ChunkError::Mismatch { pack, chunk: *chunk });
                continue;
            }
            match self.decode(pack, *chunk, data.to_vec()) {
                Ok(logical) => {
                    Counters::add(&self.counters.chunks_verified, 1);
                    if let Some(d) = &self.fetching.disk {
                        // the stored bytes: the digest check on load still applies
                        d.put(digest, data);
                    }
                    slot.fill(Ok(Arc::new(logical)));
                }
                Err(e) => self.fail(pack, *chunk, slot, e),
            }
        }
        for run in again.chunk_by(|a, b| b.0 == a.0 + 1) {
            self.fill_run(pack, run, attempt + 1);
        }
    }

    /// Fetch the chunks `chunks` of `pack` that neither cache holds, in this thread, as
    /// one source read per run of adjacent chunks (readahead, prefetching).
    fn fetch_missing(&self, pack: u32, chunks: std::ops::Range<u64>, why: Why) {
        let owned = self.claim(pack, chunks, true);
        if !owned.is_empty() {
            self.fill_for(pack, owned, why);
        }
    }

    /// Record a read of chunks `[first, last]` of `pack`; the length of the sequential
    /// run it continues.
    fn streak(&self, pack: u32, first: u64, last: u64) -> u64 {
        let mut s = self.streaks.lock().unwrap();
        let e = s.entry(pack).or_insert((u64::MAX, 0));
        if e.0 != u64::MAX && (first == e.0 || first == e.0 + 1) {
            e.1 += last.saturating_sub(e.0);
        } else if e.0 != last {
            e.1 = last - first + 1;
        }
        e.0 = last;
        e.1
    }
}

impl VerifiedChunks {
    /// `cache_bytes` bounds the verified chunks kept in memory (at least 4 chunks).
    pub fn new(
        blockmap: Arc<Blockmap>,
        source: Box<dyn PackSource>,
        counters: Arc<Counters>,
        cache_bytes: u64,
        pack_names: Vec<String>,
    ) -> VerifiedChunks {
        let capacity = (cache_bytes >> blockmap.chunk_shift).max(4) as usize;
        let access = AccessLog::new(&blockmap);
        VerifiedChunks {
            core: Arc::new(Core {
                blockmap,
                source,
                counters,
                capacity,
                cache: Mutex::new(CacheInner {
                    map: HashMap::new(),
                    tick: 0,
                }),
                pack_names,
                fetching: Fetching::default(),
                streaks: Mutex::new(HashMap::new()),
            }),
            pool: None,
            access,
        }
    }

    /// Remote packs: a persistent cache, readahead (see [`Fetching`]).
    pub fn with_fetching(mut self, fetching: Fetching) -> VerifiedChunks {
        if fetching.readahead > 0 && fetching.workers > 0 {
            self.pool = Some(crate::pool::Pool::new("fetch", fetching.workers));
        }
        Arc::get_mut(&mut self.core)
            .expect("with_fetching before first use")
            .fetching = fetching;
        self
    }

    /// How many chunks the caches hold (a prefetch longer than this would evict its
    /// start): the persistent cache's bound when there is one, else the memory cache's.
    pub fn capacity_chunks(&self) -> usize {
        match &self.core.fetching.disk {
            Some(d) => (d.limit() / self.core.blockmap.chunk_size()).max(1) as usize,
            None => self.core.capacity,
        }
    }

    /// Drop every chunk the memory cache holds (a passthrough server, whose reads never
    /// reach it, after copying device 2). A chunk being loaded stays with its waiters.
    pub fn clear(&self) {
        self.core.cache.lock().unwrap().map.clear();
    }

    /// Number of chunks currently cached (tests).
    #[cfg(test)]
    pub fn cache_len(&self) -> usize {
        self.core.cache.lock().unwrap().map.len()
    }

    pub fn blockmap(&self) -> &Blockmap {
        &self.core.blockmap
    }

    /// Whether chunks come over the network (a fetch can take a round trip or more).
    pub fn remote(&self) -> bool {
        self.core.fetching.disk.is_some()
    }

    /// Whether chunk `chunk` of `pack` is verified and in memory: a read of it costs a
    /// copy, never a wait.
    pub fn resident(&self, pack: u32, chunk: u64) -> bool {
        let c = self.core.cache.lock().unwrap();
        c.map
            .get(&(pack, chunk))
            .is_some_and(|(slot, _)| slot.val.try_lock().is_ok_and(|v| matches!(&*v, Some(Ok(_)))))
    }

    /// The verified bytes of chunk `chunk` of pack `pack`, for a device read.
    pub fn chunk(&self, pack: u32, chunk: u64) -> Result<Arc<Vec<u8>>, ChunkError> {
        self.access.note(pack, chunk);
        self.get(pack, chunk, Why::Demand)
    }

    /// The verified bytes of chunk `chunk` of pack `pack`, loaded as a prefetch (not a
    /// device read: no access noted, no demand counters), for a copy of device 2 whole.
    pub fn chunk_for_copy(&self, pack: u32, chunk: u64) -> Result<Arc<Vec<u8>>, ChunkError> {
        self.get(pack, chunk, Why::Prefetch)
    }

    /// Bring the chunks `chunks` of `pack` that no cache holds into the caches, loaded
    /// together (one range request when remote), verified. -> how many failed.
    pub fn prefetch_run(&self, pack: u32, chunks: std::ops::Range<u64>) -> usize {
        let owned = self.core.claim(pack, chunks, true);
        let slots: Vec<Arc<Slot>> = owned.iter().map(|(_, s)| s.clone()).collect();
        if !owned.is_empty() {
            self.core.fill_for(pack, owned, Why::Prefetch);
        }
        slots
            .iter()
            .filter(|s| !matches!(&*s.val.lock().unwrap(), Some(Ok(_))))
            .count()
    }

    fn get(&self, pack: u32, chunk: u64, why: Why) -> Result<Arc<Vec<u8>>, ChunkError> {
        let (slot, owned) = self.core.slot((pack, chunk));
        if owned {
            if why == Why::Demand {
                Counters::add(&self.core.counters.cache_misses, 1);
            }
            self.core.fill_for(pack, vec![(chunk, slot.clone())], why);
        } else if why == Why::Demand {
            Counters::add(&self.core.counters.cache_hits, 1);
        }
        slot.wait(self.core.fetching.wait_limit)
    }

    /// After a read of chunks `[first, last]`: on the third chunk in sequence, have a
    /// worker fetch the next `readahead` chunks (those neither cache holds).
    fn readahead(&self, pack: u32, first: u64, last: u64) {
        let Some(pool) = &self.pool else { return };
        let ahead = self.core.fetching.readahead;
        if self.core.streak(pack, first, last) < 3 {
            return;
        }
        let pe = &self.core.blockmap.packs[pack as usize];
        let n = crate::format::blockmap::chunks_in(pe.size, self.core.blockmap.chunk_size());
        let range = (last + 1).min(n)..(last + 1 + ahead).min(n);
        if range.is_empty() {
            return;
        }
        // cheap check first: nothing to do once the window is in memory
        {
            let c = self.core.cache.lock().unwrap();
            if range.clone().all(|k| c.map.contains_key(&(pack, k))) {
                return;
            }
        }
        let core = self.core.clone();
        pool.try_run(move || core.fetch_missing(pack, range, Why::Readahead));
    }

    /// Copy verified pack bytes `[pack_offset, pack_offset + out.len())` into `out`.
    pub fn read_pack(&self, pack: u32, pack_offset: u64, out: &mut [u8]) -> Result<(), ChunkError> {
        let shift = self.core.blockmap.chunk_shift;
        if out.is_empty() {
            return Ok(());
        }
        let (first, last) = (pack_offset >> shift, (pack_offset + out.len() as u64 - 1) >> shift);
        if last > first {
            // every chunk the read needs, loaded together (one range request when remote)
            let owned = self.core.claim(pack, first..last + 1, false);
            if !owned.is_empty() {
                Counters::add(&self.core.counters.cache_misses, owned.len() as u64);
                self.core.fill_for(pack, owned, Why::Demand);
            }
        }
        self.readahead(pack, first, last);
        let mut pos = pack_offset;
        let mut done = 0usize;
        while done < out.len() {
            let chunk = pos >> shift;
            let data = self.chunk(pack, chunk)?;
            let within = (pos - (chunk << shift)) as usize;
            let take = (data.len() - within).min(out.len() - done);
            if take == 0 {
                return Err(ChunkError::Read(format!(
                    "pack {}: read past its end at {pos}",
                    self.core.pack_names[pack as usize]
                )));
            }
            out[done..done + take].copy_from_slice(&data[within..within + take]);
            done += take;
            pos += take as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
