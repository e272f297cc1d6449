//! Counters the server keeps and publishes (stats.json in its state directory).

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Default)]
pub struct Counters {
    pub reads: AtomicU64,
    pub bytes_served: AtomicU64,
    pub read_errors: AtomicU64,
    pub writes_rejected: AtomicU64,
    pub chunks_verified: AtomicU64,
    pub verify_failures: AtomicU64,
    pub pack_bytes_read: AtomicU64,
    pub cache_hits: AtomicU64,
    // prefetch (src/trace.rs): chunks loaded on demand vs by the prefetcher
    pub demand_chunk_loads: AtomicU64,
    pub prefetch_total: AtomicU64,
    pub prefetch_done: AtomicU64,
    pub prefetch_chunks: AtomicU64,
    pub prefetch_bytes: AtomicU64,
    pub prefetch_errors: AtomicU64,
}

#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Snapshot {
    pub reads: u64,
    pub bytes_served: u64,
    pub read_errors: u64,
    pub writes_rejected: u64,
    pub chunks_verified: u64,
    pub verify_failures: u64,
    pub pack_bytes_read: u64,
    pub cache_hits: u64,
    /// Pack chunks loaded (read + verified) for device reads.
    pub demand_chunk_loads: u64,
    /// Chunks of the running/last prefetch trace, and how many of them are done.
    pub prefetch_total: u64,
    pub prefetch_done: u64,
    /// Chunks (and their bytes) the prefetcher loaded itself (the rest were cached already).
    pub prefetch_chunks: u64,
    pub prefetch_bytes: u64,
    pub prefetch_errors: u64,
}

impl Counters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            reads: self.reads.load(Relaxed),
            bytes_served: self.bytes_served.load(Relaxed),
            read_errors: self.read_errors.load(Relaxed),
            writes_rejected: self.writes_rejected.load(Relaxed),
            chunks_verified: self.chunks_verified.load(Relaxed),
            verify_failures: self.verify_failures.load(Relaxed),
            pack_bytes_read: self.pack_bytes_read.load(Relaxed),
            cache_hits: self.cache_hits.load(Relaxed),
            demand_chunk_loads: self.demand_chunk_loads.load(Relaxed),
            prefetch_total: self.prefetch_total.load(Relaxed),
            prefetch_done: self.prefetch_done.load(Relaxed),
            prefetch_chunks: self.prefetch_chunks.load(Relaxed),
            prefetch_bytes: self.prefetch_bytes.load(Relaxed),
            prefetch_errors: self.prefetch_errors.load(Relaxed),
        }
    }
}
