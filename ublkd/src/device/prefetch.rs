//! Prefetch: a couple of low-priority threads that fetch a trace's chunks in order
//! through the verified path, counted apart from demand reads.

use super::Device2;
use crate::format::trace::{Trace, FILE_NAME};
use crate::stats::Counters;
use anyhow::{bail, Result};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// Prefetch threads: low priority (nice 10) so demand reads, served by the frontend's
/// threads, win the CPU; each fetch goes through the verified path like a demand read.
pub const PREFETCH_WORKERS: usize = 2;

/// Most chunks the prefetcher loads in one go (one range request when remote).
pub const PREFETCH_RUN: u64 = 16;

/// The trace's chunks as runs of adjacent chunks of one pack (at most `max` long), in
/// trace order: each run is fetched as one request.
pub fn runs(chunks: &[(u32, u64)], max: u64) -> Vec<(u32, std::ops::Range<u64>)> {
    let mut out: Vec<(u32, std::ops::Range<u64>)> = Vec::new();
    for &(pack, chunk) in chunks {
        match out.last_mut() {
            Some((p, r)) if *p == pack && r.end == chunk && r.end - r.start < max => r.end += 1,
            _ => out.push((pack, chunk..chunk + 1)),
        }
    }
    out
}

/// Start fetching `trace`'s chunks in the background (at most as many as the chunk
/// cache holds: more would evict the first ones). Returns false if a prefetch is
/// already running (the request is dropped).
pub fn start_prefetch(dev: Arc<Device2>, trace: Trace, running: Arc<AtomicBool>) -> bool {
    if running.swap(true, Relaxed) {
        return false;
    }
    let mut chunks = trace.chunks;
    let cap = dev.chunks.capacity_chunks();
    if chunks.len() > cap {
        log::warn!(
            "prefetch: the trace lists {} chunks, the cache holds {cap}: prefetching the first {cap}",
            chunks.len()
        );
        chunks.truncate(cap);
    }
    let c = &dev.counters;
    c.prefetch_total.store(chunks.len() as u64, Relaxed);
    c.prefetch_done.store(0, Relaxed);
    log::info!("prefetch: {} chunks ({} trace)", chunks.len(), trace.source);
    let chunks = Arc::new(runs(&chunks, PREFETCH_RUN));
    let next = Arc::new(AtomicUsize::new(0));
    let left = Arc::new(AtomicUsize::new(PREFETCH_WORKERS));
    for w in 0..PREFETCH_WORKERS {
        let (wdev, wchunks, wnext, wleft, wrunning) =
            (dev.clone(), chunks.clone(), next.clone(), left.clone(), running.clone());
        let spawned = std::thread::Builder::new().name(format!("prefetch{w}")).spawn(move || {
            // SAFETY: setpriority on this thread's own tid.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
            loop {
                let i = wnext.fetch_add(1, Relaxed);
                let Some((pack, run)) = wchunks.get(i).cloned() else {
                    break;
                };
                let failed = wdev.chunks.prefetch_run(pack, run.clone());
                if failed > 0 {
                    Counters::add(&wdev.counters.prefetch_errors, failed as u64);
                    log::warn!("prefetch: pack {pack} chunks {run:?}: {failed} failed");
                }
                Counters::add(&wdev.counters.prefetch_done, run.end - run.start);
            }
            if wleft.fetch_sub(1, Relaxed) == 1 {
                let s = wdev.counters.snapshot();
                log::info!(
                    "prefetch: done, {} chunks ({} fetched, {} bytes, {} errors)",
                    s.prefetch_done,
                    s.prefetch_chunks,
                    s.prefetch_bytes,
                    s.prefetch_errors
                );
                wrunning.store(false, Relaxed);
            }
        });
        if let Err(e) = spawned {
            log::error!("prefetch: cannot start a worker: {e}");
            if left.fetch_sub(1, Relaxed) == 1 {
                running.store(false, Relaxed);
            }
        }
    }
    true
}

/// Read the prefetch request a `mount` left in the server's directory and start it.
pub fn start_requested(dev: &Arc<Device2>, dir: &Path, image_id: &str, running: &Arc<AtomicBool>) -> Result<()> {
    let path = dir.join(FILE_NAME);
    let t = Trace::read(&path)?;
    t.check_for(image_id, dev.chunks.blockmap(), &path.display().to_string())?;
    if !start_prefetch(dev.clone(), t, running.clone()) {
        bail!("a prefetch is already running; request ignored");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "sha256:abababababababababababababababababababababababababababababababab";

    #[test]
    fn runs_group_adjacent_chunks_of_one_pack_in_trace_order() {
        let t = [(0, 5), (0, 6), (0, 7), (1, 8), (0, 8), (0, 2), (0, 3), (0, 4), (0, 5)];
        assert_eq!(runs(&t, 16), vec![(0, 5..8), (1, 8..9), (0, 8..9), (0, 2..6)]);
        assert_eq!(runs(&t[..3], 2), vec![(0, 5..7), (0, 7..8)]);
        assert!(runs(&[], 4).is_empty());
    }

    #[test]
    fn prefetch_fills_the_cache_and_demand_reads_then_load_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, expect, _) = crate::device::tests::synthetic(tmp.path(), 12);
        let dev = Arc::new(dev);
        let chunks: Vec<(u32, u64)> = vec![(0, 1), (0, 2), (0, 3)];
        let running = Arc::new(AtomicBool::new(false));
        assert!(start_prefetch(
            dev.clone(),
            Trace::new(ID, 4096, "record", chunks),
            running.clone()
        ));
        let t = std::time::Instant::now();
        while running.load(Relaxed) {
            assert!(t.elapsed().as_secs() < 10, "prefetch did not finish");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let s = dev.counters.snapshot();
        assert_eq!((s.prefetch_total, s.prefetch_done, s.prefetch_chunks), (3, 3, 3));
        assert_eq!(s.prefetch_bytes, 3 * 4096);
        assert_eq!(s.demand_chunk_loads, 0);
        assert!(dev.chunks.access.snapshot().is_empty(), "prefetches are not recorded");
        // device [4096, 4096 + 2*4096) maps to pack [4096, 12288): chunks 1 and 2
        let mut b = vec![0u8; 8192];
        dev.read(4096, &mut b).unwrap();
        assert_eq!(b, expect[4096..12288]);
        let s = dev.counters.snapshot();
        assert_eq!(s.demand_chunk_loads, 0, "prefetched chunks are served from the cache");
        assert_eq!(dev.chunks.access.snapshot(), vec![(0, 1), (0, 2)]);
        // a chunk not prefetched is a demand load
        dev.read(0x10000, &mut b[..4096]).unwrap(); // chunk 16 (4 KiB chunks), never prefetched
        assert_eq!(dev.counters.snapshot().demand_chunk_loads, 1);
    }
}
