//! Counters the server keeps and publishes (stats.json in its state directory).

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

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
    pub cache_misses: AtomicU64,
    pub disk_cache_hits: AtomicU64,
    pub disk_cache_misses: AtomicU64,
    pub disk_cache_corrupt: AtomicU64,
    pub disk_cache_bytes: AtomicU64,
    pub disk_cache_shared_bytes: AtomicU64,
    pub fetch_requests: AtomicU64,
    pub fetch_bytes: AtomicU64,
    pub fetch_errors: AtomicU64,
    pub fetch_ok: AtomicU64,
    pub fetch_latency_us_total: AtomicU64,
    pub fetch_latency_us_max: AtomicU64,
    pub readahead_chunks: AtomicU64,
    // prefetch (src/device/prefetch.rs): chunks loaded on demand vs by the prefetcher
    pub demand_chunk_loads: AtomicU64,
    pub prefetch_total: AtomicU64,
    pub prefetch_done: AtomicU64,
    pub prefetch_chunks: AtomicU64,
    pub prefetch_bytes: AtomicU64,
    pub prefetch_errors: AtomicU64,
}

/// What `stats.json` holds. Counters of remote packs (`fetch_*`, `disk_cache_*`) stay 0
/// for a local bundle; fields missing in an older file read as 0.
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
    /// memory cache of verified chunks
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// persistent chunk cache (remote bundles)
    pub disk_cache_hits: u64,
    pub disk_cache_misses: u64,
    /// entries that failed their digest on load (removed, fetched again)
    pub disk_cache_corrupt: u64,
    pub disk_cache_bytes: u64,
    /// bytes of chunks found in another image's cache (same digest), not fetched
    pub disk_cache_shared_bytes: u64,
    /// HTTP requests made, body bytes received, failed attempts
    pub fetch_requests: u64,
    pub fetch_bytes: u64,
    pub fetch_errors: u64,
    /// successful fetches and their latency (request start to last body byte)
    pub fetch_ok: u64,
    pub fetch_latency_us_mean: u64,
    pub fetch_latency_us_max: u64,
    /// chunks fetched ahead of demand (sequential readahead)
    pub readahead_chunks: u64,
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

    pub fn record_latency(&self, d: Duration) {
        let us = d.as_micros() as u64;
        Self::add(&self.fetch_ok, 1);
        Self::add(&self.fetch_latency_us_total, us);
        self.fetch_latency_us_max.fetch_max(us, Relaxed);
    }

    /// Go on from an earlier server's counters (a supervisor's restart): `stats.json`
    /// then counts for the bundle, not for one server process. The prefetch progress
    /// fields are not carried over (a prefetch does not survive its server).
    pub fn resume(&self, s: &Snapshot) {
        let set = |c: &AtomicU64, v: u64| c.store(v, Relaxed);
        set(&self.reads, s.reads);
        set(&self.bytes_served, s.bytes_served);
        set(&self.read_errors, s.read_errors);
        set(&self.writes_rejected, s.writes_rejected);
        set(&self.chunks_verified, s.chunks_verified);
        set(&self.verify_failures, s.verify_failures);
        set(&self.pack_bytes_read, s.pack_bytes_read);
        set(&self.cache_hits, s.cache_hits);
        set(&self.cache_misses, s.cache_misses);
        set(&self.disk_cache_hits, s.disk_cache_hits);
        set(&self.disk_cache_misses, s.disk_cache_misses);
        set(&self.disk_cache_corrupt, s.disk_cache_corrupt);
        set(&self.disk_cache_bytes, s.disk_cache_bytes);
        set(&self.fetch_requests, s.fetch_requests);
        set(&self.fetch_bytes, s.fetch_bytes);
        set(&self.fetch_errors, s.fetch_errors);
        set(&self.fetch_ok, s.fetch_ok);
        set(&self.fetch_latency_us_total, s.fetch_latency_us_mean * s.fetch_ok);
        set(&self.fetch_latency_us_max, s.fetch_latency_us_max);
        set(&self.readahead_chunks, s.readahead_chunks);
        set(&self.demand_chunk_loads, s.demand_chunk_loads);
    }

    pub fn snapshot(&self) -> Snapshot {
        let ok = self.fetch_ok.load(Relaxed);
        Snapshot {
            reads: self.reads.load(Relaxed),
            bytes_served: self.bytes_served.load(Relaxed),
            read_errors: self.read_errors.load(Relaxed),
            writes_rejected: self.writes_rejected.load(Relaxed),
            chunks_verified: self.chunks_verified.load(Relaxed),
            verify_failures: self.verify_failures.load(Relaxed),
            pack_bytes_read: self.pack_bytes_read.load(Relaxed),
            cache_hits: self.cache_hits.load(Relaxed),
            cache_misses: self.cache_misses.load(Relaxed),
            disk_cache_hits: self.disk_cache_hits.load(Relaxed),
            disk_cache_misses: self.disk_cache_misses.load(Relaxed),
            disk_cache_corrupt: self.disk_cache_corrupt.load(Relaxed),
            disk_cache_bytes: self.disk_cache_bytes.load(Relaxed),
            disk_cache_shared_bytes: self.disk_cache_shared_bytes.load(Relaxed),
            fetch_requests: self.fetch_requests.load(Relaxed),
            fetch_bytes: self.fetch_bytes.load(Relaxed),
            fetch_errors: self.fetch_errors.load(Relaxed),
            fetch_ok: ok,
            fetch_latency_us_mean: self.fetch_latency_us_total.load(Relaxed).checked_div(ok).unwrap_or(0),
            fetch_latency_us_max: self.fetch_latency_us_max.load(Relaxed),
            readahead_chunks: self.readahead_chunks.load(Relaxed),
            demand_chunk_loads: self.demand_chunk_loads.load(Relaxed),
            prefetch_total: self.prefetch_total.load(Relaxed),
            prefetch_done: self.prefetch_done.load(Relaxed),
            prefetch_chunks: self.prefetch_chunks.load(Relaxed),
            prefetch_bytes: self.prefetch_bytes.load(Relaxed),
            prefetch_errors: self.prefetch_errors.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resumed_counters_go_on_from_the_snapshot() {
        let a = Counters::default();
        for (i, c) in [&a.reads, &a.fetch_errors, &a.verify_failures, &a.bytes_served]
            .iter()
            .enumerate()
        {
            Counters::add(c, 10 + i as u64);
        }
        a.record_latency(Duration::from_millis(3));
        a.record_latency(Duration::from_millis(5));
        let b = Counters::default();
        b.resume(&a.snapshot());
        assert_eq!(b.snapshot(), a.snapshot());
        Counters::add(&b.fetch_errors, 1);
        b.record_latency(Duration::from_millis(4));
        let s = b.snapshot();
        assert_eq!((s.fetch_errors, s.fetch_ok, s.fetch_latency_us_mean), (12, 3, 4000));
    }
}
