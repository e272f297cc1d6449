//! Unit tests of the verified chunk store.

use super::*;
use crate::device::tests::synthetic_parts;
use crate::store::cache::DiskCache;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

/// A source that counts its reads and can be slowed down.
struct Counting {
    inner: Box<dyn PackSource>,
    reads: Arc<AtomicU64>,
    delay: Duration,
}

impl PackSource for Counting {
    fn read_at(&self, pack: u32, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        self.inner.read_at(pack, offset, buf)
    }
}

fn counted(tmp: &std::path::Path, delay: Duration, fetching: Fetching) -> (VerifiedChunks, Vec<u8>, Arc<AtomicU64>) {
    let (bm, src, pack, _) = synthetic_parts(tmp, 12);
    let reads = Arc::new(AtomicU64::new(0));
    let src = Counting {
        inner: src,
        reads: reads.clone(),
        delay,
    };
    let vc = VerifiedChunks::new(
        Arc::new(bm),
        Box::new(src),
        Arc::new(Counters::default()),
        64 << 12,
        vec!["p0".into()],
    )
    .with_fetching(fetching);
    (vc, pack, reads)
}

#[test]
fn concurrent_readers_of_one_chunk_cause_one_read() {
    let tmp = tempfile::tempdir().unwrap();
    let (vc, pack, reads) = counted(tmp.path(), Duration::from_millis(200), Fetching::default());
    let vc = Arc::new(vc);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let vc = vc.clone();
            std::thread::spawn(move || vc.chunk(0, 2).unwrap())
        })
        .collect();
    for t in threads {
        assert_eq!(&t.join().unwrap()[..], &pack[2 * 4096..3 * 4096]);
    }
    assert_eq!(reads.load(Ordering::SeqCst), 1);
}

#[test]
fn a_read_over_several_chunks_is_one_source_read() {
    let tmp = tempfile::tempdir().unwrap();
    let (vc, pack, reads) = counted(tmp.path(), Duration::ZERO, Fetching::default());
    let mut out = vec![0u8; 3 * 4096];
    vc.read_pack(0, 100, &mut out).unwrap();
    assert_eq!(out, pack[100..100 + 3 * 4096]);
    assert_eq!(reads.load(Ordering::SeqCst), 1, "chunks 0..=3 in one read");
}

#[test]
fn sequential_reads_fetch_ahead_and_the_disk_cache_serves_a_new_instance() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let fetching = |c: &std::path::Path| Fetching {
        disk: Some(DiskCache::open(c, 1 << 30, Arc::new(Counters::default())).unwrap()),
        readahead: 2,
        workers: 2,
        wait_limit: Some(Duration::from_secs(10)),
    };
    let (vc, pack, reads) = counted(tmp.path(), Duration::ZERO, fetching(&cache));
    for c in 0..3u64 {
        assert_eq!(
            &vc.chunk(0, c).unwrap()[..],
            &pack[(c as usize) * 4096..(c as usize + 1) * 4096]
        );
        let mut b = [0u8; 1];
        vc.read_pack(0, c * 4096, &mut b).unwrap();
    }
    // the third chunk in sequence started a readahead of chunks 3 and 4 (one read)
    let t = std::time::Instant::now();
    while vc.core.counters.snapshot().readahead_chunks < 2 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(vc.core.counters.snapshot().readahead_chunks, 2);
    while reads.load(Ordering::SeqCst) < 4 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(reads.load(Ordering::SeqCst), 4);
    drop(vc);
    // a new instance (a restarted server) reads chunks 0..5 without the source
    let (vc, pack, reads) = counted(tmp.path(), Duration::ZERO, fetching(&cache));
    for c in 0..5u64 {
        assert_eq!(
            &vc.chunk(0, c).unwrap()[..],
            &pack[(c as usize) * 4096..(c as usize + 1) * 4096]
        );
    }
    assert_eq!(reads.load(Ordering::SeqCst), 0);
}

/// A compressed pack (blockmap version 2) of 4 chunks of 4096 bytes: chunk 2 random
/// (stored raw), the others zstd frames; `frames[i]` overrides chunk i's stored bytes.
/// -> (chunks, logical pack bytes).
fn compressed(
    tmp: &std::path::Path,
    frames: &[(usize, Vec<u8>)],
    disk: Option<DiskCache>,
) -> (VerifiedChunks, Vec<u8>) {
    use crate::format::blockmap::{encode, PackEntry, Range, StoredChunk, VERSION_COMPRESSED};
    let mut x = 7u64;
    let logical: Vec<u8> = (0..4 * 4096u64)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (2 * 4096..3 * 4096).contains(&i) {
                (x >> 24) as u8
            } else {
                b"ublk pack "[(i % 10) as usize]
            }
        })
        .collect();
    let (mut file, mut stored, mut digests) = (Vec::new(), Vec::new(), Vec::new());
    for (i, c) in logical.chunks(4096).enumerate() {
        let (body, zstd) = match frames.iter().find(|(k, _)| *k == i) {
            Some((_, f)) => (f.clone(), true),
            None if i == 2 => (c.to_vec(), false),
            None => (zstd::bulk::compress(c, 3).unwrap(), true),
        };
        stored.push(StoredChunk {
            offset: file.len() as u64,
            length: body.len() as u64,
            zstd,
        });
        digests.push(<[u8; 32]>::from(Sha256::digest(&body)));
        file.extend_from_slice(&body);
    }
    let mut h = Sha256::new();
    for d in &digests {
        h.update(d);
    }
    let path = tmp.join("pack");
    std::fs::write(&path, &file).unwrap();
    let bm = Blockmap {
        chunk_shift: 12,
        device_size: 8 * 4096,
        packs: vec![PackEntry {
            id: h.finalize().into(),
            size: logical.len() as u64,
            first_chunk: 0,
        }],
        ranges: vec![Range {
            dev_offset: 0,
            length: logical.len() as u64,
            pack: 0,
            pack_offset: 0,
        }],
        digests,
        version: VERSION_COMPRESSED,
        stored,
    };
    let bm = Blockmap::parse(&encode(&bm)).unwrap();
    assert!(bm.stored(0, 0).zstd && !bm.stored(0, 2).zstd);
    let src = crate::store::source::LocalPacks::open(&[path], &[file.len() as u64]).unwrap();
    let vc = VerifiedChunks::new(
        Arc::new(bm),
        Box::new(src),
        Arc::new(Counters::default()),
        64 << 12,
        vec!["p0".into()],
    )
    .with_fetching(Fetching {
        disk,
        ..Fetching::default()
    });
    (vc, logical)
}

#[test]
fn compressed_chunks_are_verified_then_decompressed_and_cached_as_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let disk = DiskCache::open(&tmp.path().join("c"), 1 << 30, Arc::new(Counters::default())).unwrap();
    let (vc, logical) = compressed(tmp.path(), &[], Some(disk));
    let mut out = vec![0u8; logical.len() - 100];
    vc.read_pack(0, 50, &mut out).unwrap();
    assert_eq!(out, logical[50..logical.len() - 50]);
    assert_eq!(vc.core.counters.snapshot().chunks_verified, 4);
    // the persistent cache holds the stored bytes (its digest check on load holds)
    let frame = std::fs::read(tmp.path().join("pack")).unwrap();
    let sc = *vc.blockmap().stored(0, 0);
    let d = vc.blockmap().digest(0, 0);
    let cached = vc.core.fetching.disk.as_ref().unwrap().get(d).unwrap();
    assert_eq!(cached, frame[sc.offset as usize..(sc.offset + sc.length) as usize]);
    drop(vc);
    // a new instance serves every chunk from the persistent cache, decompressed
    let disk = DiskCache::open(&tmp.path().join("c"), 1 << 30, Arc::new(Counters::default())).unwrap();
    let tmp2 = tempfile::tempdir().unwrap();
    let (vc, _) = compressed(tmp2.path(), &[], Some(disk));
    std::fs::write(tmp2.path().join("pack"), b"").unwrap(); // the source is gone
    for c in 0..4u64 {
        assert_eq!(
            &vc.chunk(0, c).unwrap()[..],
            &logical[(c as usize) * 4096..(c as usize + 1) * 4096]
        );
    }
}

#[test]
fn a_frame_of_the_wrong_length_fails_its_chunk_only() {
    let tmp = tempfile::tempdir().unwrap();
    let half = zstd::bulk::compress(&b"ublk pack ".repeat(205)[..2048], 3).unwrap();
    let (vc, logical) = compressed(tmp.path(), &[(1, half)], None);
    assert!(matches!(
        vc.chunk(0, 1),
        Err(ChunkError::Decode { pack: 0, chunk: 1, .. })
    ));
    assert_eq!(vc.core.counters.snapshot().verify_failures, 1);
    assert_eq!(&vc.chunk(0, 0).unwrap()[..], &logical[..4096]);
    assert_eq!(&vc.chunk(0, 3).unwrap()[..], &logical[3 * 4096..]);
    // not cached: a second read fails again (and is counted again)
    assert!(vc.chunk(0, 1).is_err());
    assert_eq!(vc.core.counters.snapshot().verify_failures, 2);
}

/// A remote-like source (a disk cache, as remote bundles have) whose first `bad` reads
/// come back with one byte flipped.
struct Flaky {
    inner: Box<dyn PackSource>,
    bad: AtomicU64,
}

impl PackSource for Flaky {
    fn read_at(&self, pack: u32, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_at(pack, offset, buf)?;
        if self.bad.load(Ordering::SeqCst) > 0 {
            self.bad.fetch_sub(1, Ordering::SeqCst);
            buf[buf.len() / 2] ^= 0xff;
        }
        Ok(())
    }
}

fn flaky(tmp: &std::path::Path, bad: u64) -> (VerifiedChunks, Vec<u8>) {
    let (bm, src, pack, _) = synthetic_parts(tmp, 12);
    let counters = Arc::new(Counters::default());
    let disk = DiskCache::open(&tmp.join("cache"), 1 << 30, counters.clone()).unwrap();
    let fetching = Fetching {
        disk: Some(disk),
        ..Fetching::default()
    };
    let src = Flaky {
        inner: src,
        bad: AtomicU64::new(bad),
    };
    let vc =
        VerifiedChunks::new(Arc::new(bm), Box::new(src), counters, 64 << 12, vec!["p0".into()]).with_fetching(fetching);
    (vc, pack)
}

#[test]
fn a_remote_chunk_corrupted_on_the_way_is_fetched_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (vc, pack) = flaky(tmp.path(), REMOTE_MISMATCH_ATTEMPTS as u64 - 1);
    assert_eq!(&vc.chunk(0, 2).unwrap()[..], &pack[2 * 4096..3 * 4096]);
    let s = vc.core.counters.snapshot();
    assert_eq!(
        s.verify_failures,
        REMOTE_MISMATCH_ATTEMPTS as u64 - 1,
        "each bad answer counted"
    );
    assert_eq!(s.chunks_verified, 1);
}

#[test]
fn a_remote_chunk_that_stays_corrupt_fails_after_its_attempts() {
    let tmp = tempfile::tempdir().unwrap();
    let (vc, pack) = flaky(tmp.path(), REMOTE_MISMATCH_ATTEMPTS as u64);
    assert!(matches!(
        vc.chunk(0, 2),
        Err(ChunkError::Mismatch { pack: 0, chunk: 2 })
    ));
    assert_eq!(
        vc.core.counters.snapshot().verify_failures,
        REMOTE_MISMATCH_ATTEMPTS as u64
    );
    // not cached: the next read fetches it again (now good)
    assert_eq!(&vc.chunk(0, 2).unwrap()[..], &pack[2 * 4096..3 * 4096]);
}
