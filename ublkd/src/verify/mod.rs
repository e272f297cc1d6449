//! The verified read path: pack chunks are read whole, checked against the blockmap
//! digest, and only then served; verified chunks live in a bounded cache.
//!
//! Concurrent readers of the same missing chunk wait for one verification (a per-chunk
//! `OnceLock`), so "verified once before first use" holds under load. A failed
//! verification is not cached: every read of a bad chunk re-checks it, fails with EIO
//! and is counted.

pub mod source;

use crate::blockmap::Blockmap;
use crate::stats::Counters;
use crate::trace::AccessLog;
use sha2::{Digest as _, Sha256};
use source::PackSource;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkError {
    /// The pack could not be read (I/O error, short file).
    Read(String),
    /// The bytes read do not match the digest.
    Mismatch { pack: u32, chunk: u64 },
}

type Slot = Arc<OnceLock<Result<Arc<Vec<u8>>, ChunkError>>>;

struct CacheInner {
    map: HashMap<(u32, u64), (Slot, u64)>,
    tick: u64,
}

pub struct VerifiedChunks {
    blockmap: Arc<Blockmap>,
    source: Box<dyn PackSource>,
    counters: Arc<Counters>,
    capacity: usize,
    cache: Mutex<CacheInner>,
    pack_names: Vec<String>,
    /// First demand access of each chunk (`ublkd record`); prefetches are not noted.
    pub access: AccessLog,
}

/// Who asked for a chunk: loads are counted apart (`demand_chunk_loads`, `prefetch_*`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Why {
    Demand,
    Prefetch,
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
            blockmap,
            source,
            counters,
            capacity,
            cache: Mutex::new(CacheInner {
                map: HashMap::new(),
                tick: 0,
            }),
            pack_names,
            access,
        }
    }

    /// How many chunks the cache holds (a prefetch longer than this would evict its start).
    pub fn capacity_chunks(&self) -> usize {
        self.capacity
    }

    /// Number of chunks currently cached (tests).
    #[cfg(test)]
    pub fn cache_len(&self) -> usize {
        self.cache.lock().unwrap().map.len()
    }

    pub fn blockmap(&self) -> &Blockmap {
        &self.blockmap
    }

    fn slot(&self, key: (u32, u64)) -> (Slot, bool) {
        let mut c = self.cache.lock().unwrap();
        c.tick += 1;
        let tick = c.tick;
        if let Some((slot, used)) = c.map.get_mut(&key) {
            *used = tick;
            return (slot.clone(), true);
        }
        if c.map.len() >= self.capacity {
            // evict the least recently used entry (the cache is small: a scan is fine)
            if let Some(old) = c.map.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| *k) {
                c.map.remove(&old);
            }
        }
        let slot: Slot = Arc::new(OnceLock::new());
        c.map.insert(key, (slot.clone(), tick));
        (slot, false)
    }

    fn forget(&self, key: (u32, u64), slot: &Slot) {
        let mut c = self.cache.lock().unwrap();
        if let Some((s, _)) = c.map.get(&key) {
            if Arc::ptr_eq(s, slot) {
                c.map.remove(&key);
            }
        }
    }

    fn load(&self, pack: u32, chunk: u64) -> Result<Arc<Vec<u8>>, ChunkError> {
        let (start, end) = self.blockmap.chunk_bounds(pack, chunk);
        let mut buf = vec![0u8; (end - start) as usize];
        self.source.read_at(pack, start, &mut buf).map_err(|e| {
            ChunkError::Read(format!(
                "pack {}: read [{start}, {end}): {e}",
                self.pack_names[pack as usize]
            ))
        })?;
        Counters::add(&self.counters.pack_bytes_read, buf.len() as u64);
        let got = Sha256::digest(&buf);
        if got.as_slice() != self.blockmap.digest(pack, chunk) {
            return Err(ChunkError::Mismatch { pack, chunk });
        }
        Counters::add(&self.counters.chunks_verified, 1);
        Ok(Arc::new(buf))
    }

    /// The verified bytes of chunk `chunk` of pack `pack`, for a device read.
    pub fn chunk(&self, pack: u32, chunk: u64) -> Result<Arc<Vec<u8>>, ChunkError> {
        self.access.note(pack, chunk);
        self.get(pack, chunk, Why::Demand)
    }

    /// Bring a chunk into the cache ahead of use, through the same verified path.
    pub fn prefetch(&self, pack: u32, chunk: u64) -> Result<(), ChunkError> {
        self.get(pack, chunk, Why::Prefetch).map(|_| ())
    }

    fn get(&self, pack: u32, chunk: u64, why: Why) -> Result<Arc<Vec<u8>>, ChunkError> {
        let key = (pack, chunk);
        let (slot, hit) = self.slot(key);
        let mut loaded_here = false;
        let res = slot
            .get_or_init(|| {
                loaded_here = true;
                self.load(pack, chunk)
            })
            .clone();
        if hit && !loaded_here && why == Why::Demand {
            Counters::add(&self.counters.cache_hits, 1);
        }
        if let (true, Ok(data)) = (loaded_here, &res) {
            match why {
                Why::Demand => Counters::add(&self.counters.demand_chunk_loads, 1),
                Why::Prefetch => {
                    Counters::add(&self.counters.prefetch_chunks, 1);
                    Counters::add(&self.counters.prefetch_bytes, data.len() as u64);
                }
            }
        }
        if let Err(e) = &res {
            if loaded_here {
                match e {
                    ChunkError::Mismatch { .. } => {
                        Counters::add(&self.counters.verify_failures, 1);
                        let (s, en) = self.blockmap.chunk_bounds(pack, chunk);
                        log::error!(
                            "verification failed: pack {} chunk {chunk} (bytes [{s}, {en})): sha256 does not match the blockmap; failing the read with EIO",
                            self.pack_names[pack as usize]
                        );
                    }
                    ChunkError::Read(msg) => log::error!("{msg}"),
                }
            }
            self.forget(key, &slot);
        }
        res
    }

    /// Copy verified pack bytes `[pack_offset, pack_offset + out.len())` into `out`.
    pub fn read_pack(&self, pack: u32, pack_offset: u64, out: &mut [u8]) -> Result<(), ChunkError> {
        let shift = self.blockmap.chunk_shift;
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
                    self.pack_names[pack as usize]
                )));
            }
            out[done..done + take].copy_from_slice(&data[within..within + take]);
            done += take;
            pos += take as u64;
        }
        Ok(())
    }
}
