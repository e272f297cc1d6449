//! Device 2 as a byte array: the one read path every frontend (FUSE file, ublk queue)
//! calls. It knows nothing about how many device instances are served from it.

pub mod copy;
pub mod prefetch;

use crate::format::blockmap::Segment;
use crate::pool::Pool;
use crate::stats::Counters;
use crate::verify::VerifiedChunks;
use std::sync::Arc;

pub struct Device2 {
    pub chunks: VerifiedChunks,
    pub counters: Arc<Counters>,
    /// Remote bundles: where frontends hand reads that would wait for a fetch, so that
    /// hits and other misses go on meanwhile ([`Device2::would_wait`]).
    misses: Option<Pool>,
}

/// Reads of a remote bundle waiting for fetches at once: as many as readers ask for
/// (the kernel's queues hold fewer), each a thread blocked on the network.
const MISS_WORKERS: usize = 128;

/// Why a device read failed; frontends turn every case into EIO.
#[derive(Debug)]
pub enum ReadError {
    OutOfRange,
    Chunk(crate::verify::ChunkError),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::OutOfRange => write!(f, "read past the end of device 2"),
            ReadError::Chunk(crate::verify::ChunkError::Read(m)) => write!(f, "{m}"),
            ReadError::Chunk(crate::verify::ChunkError::Mismatch { pack, chunk }) => {
                write!(f, "pack {pack} chunk {chunk} failed verification")
            }
            ReadError::Chunk(crate::verify::ChunkError::Decode { pack, chunk, why }) => {
                write!(f, "pack {pack} chunk {chunk}: {why}")
            }
        }
    }
}

impl Device2 {
    pub fn new(chunks: VerifiedChunks, counters: Arc<Counters>) -> Device2 {
        let misses = chunks.remote().then(|| Pool::new("miss", MISS_WORKERS));
        Device2 {
            chunks,
            counters,
            misses,
        }
    }

    /// Whether a read of `len` bytes at `offset` would wait for a fetch: the bundle is
    /// remote and a chunk the read needs is not verified in memory. A frontend hands
    /// such a read to [`Device2::defer`] instead of blocking its queue.
    pub fn would_wait(&self, offset: u64, len: usize) -> bool {
        if self.misses.is_none() {
            return false;
        }
        let bm = self.chunks.blockmap();
        let Ok(segs) = bm.segments(offset, len as u64) else {
            return false; // fails at once, in the read itself
        };
        let shift = bm.chunk_shift;
        !segs.iter().all(|s| match s {
            Segment::Zero { .. } => true,
            Segment::Pack { pack, pack_offset, .. } => {
                let (first, last) = (pack_offset >> shift, (pack_offset + s.len().max(1) - 1) >> shift);
                (first..=last).all(|c| self.chunks.resident(*pack, c))
            }
        })
    }

    /// Run `job` (a read that would wait) on the miss workers.
    pub fn defer(&self, job: impl FnOnce() + Send + 'static) {
        match &self.misses {
            Some(p) => p.run(job),
            None => job(),
        }
    }

    pub fn size(&self) -> u64 {
        self.chunks.blockmap().device_size
    }

    /// Fill `buf` with device bytes at `offset`. Either every byte is correct or the
    /// read fails: partially filled buffers are never handed out as success.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        Counters::add(&self.counters.reads, 1);
        let res = self.read_inner(offset, buf);
        match &res {
            Ok(()) => Counters::add(&self.counters.bytes_served, buf.len() as u64),
            Err(_) => Counters::add(&self.counters.read_errors, 1),
        }
        res
    }

    fn read_inner(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let segs = self
            .chunks
            .blockmap()
            .segments(offset, buf.len() as u64)
            .map_err(|_| ReadError::OutOfRange)?;
        let mut pos = 0usize;
        for s in segs {
            let len = s.len() as usize;
            let out = &mut buf[pos..pos + len];
            match s {
                Segment::Zero { .. } => out.fill(0),
                Segment::Pack { pack, pack_offset, .. } => self
                    .chunks
                    .read_pack(pack, pack_offset, out)
                    .map_err(ReadError::Chunk)?,
            }
            pos += len;
        }
        Ok(())
    }

    /// Device 2 is immutable: count and refuse.
    pub fn reject_write(&self) {
        Counters::add(&self.counters.writes_rejected, 1);
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::format::blockmap::{encode, Blockmap, PackEntry, Range};
    use crate::store::source::{LocalPacks, PackSource};
    use sha2::{Digest as _, Sha256};
    use std::path::{Path, PathBuf};

    /// A synthetic pack in `dir`: 5 chunks and a bit of pseudo-random bytes, mapped by a
    /// few ranges with holes. Returns (blockmap, its source, the pack bytes, pack path).
    pub fn synthetic_parts(dir: &Path, chunk_shift: u32) -> (Blockmap, Box<dyn PackSource>, Vec<u8>, PathBuf) {
        let chunk = 1usize << chunk_shift;
        let pack_len = 5 * chunk + 1234;
        let mut x = 0x1234_5678_9abc_def0u64;
        let pack: Vec<u8> = (0..pack_len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let digests: Vec<[u8; 32]> = pack.chunks(chunk).map(|c| Sha256::digest(c).into()).collect();
        let mut h = Sha256::new();
        for d in &digests {
            h.update(d);
        }
        let id: [u8; 32] = h.finalize().into();
        let path = dir.join(hex::encode(id));
        std::fs::write(&path, &pack).unwrap();
        let device_size = 0x20000.max(32 * chunk as u64);
        let ranges = vec![
            Range {
                dev_offset: chunk as u64,
                length: 2 * chunk as u64 + 17,
                pack: 0,
                pack_offset: 4096,
            },
            Range {
                dev_offset: 8 * chunk as u64,
                length: 3 * chunk as u64,
                pack: 0,
                pack_offset: 2 * chunk as u64 + 1234,
            },
            Range {
                dev_offset: 0x10000.max(16 * chunk as u64),
                length: 4096,
                pack: 0,
                pack_offset: 0,
            },
        ];
        let bm = Blockmap {
            chunk_shift,
            device_size,
            packs: vec![PackEntry {
                id,
                size: pack_len as u64,
                first_chunk: 0,
            }],
            ranges,
            digests,
            version: crate::format::blockmap::VERSION,
            stored: vec![],
        };
        let bm = Blockmap::parse(&encode(&bm)).unwrap();
        let src = LocalPacks::open(std::slice::from_ref(&path), &[pack_len as u64]).unwrap();
        (bm, Box::new(src), pack, path)
    }

    /// A synthetic bundle-less device over [`synthetic_parts`]. Returns (device, expected
    /// device bytes, pack path).
    pub fn synthetic(dir: &Path, chunk_shift: u32) -> (Device2, Vec<u8>, PathBuf) {
        let chunk = 1u64 << chunk_shift;
        let (bm, src, pack, path) = synthetic_parts(dir, chunk_shift);
        let mut expect = vec![0u8; bm.device_size as usize];
        for r in &bm.ranges {
            let (d, p, l) = (r.dev_offset as usize, r.pack_offset as usize, r.length as usize);
            expect[d..d + l].copy_from_slice(&pack[p..p + l]);
        }
        let counters = Arc::new(Counters::default());
        let chunks = VerifiedChunks::new(Arc::new(bm), src, counters.clone(), 2 * chunk, vec!["p0".into()]);
        (Device2::new(chunks, counters), expect, path)
    }

    #[test]
    fn reads_match_and_cache_is_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, expect, _) = synthetic(tmp.path(), 12);
        let size = dev.size() as usize;
        // every aligned 4 KiB block, then odd-sized unaligned reads
        for off in (0..size).step_by(4096) {
            let mut b = vec![0xAAu8; 4096];
            dev.read(off as u64, &mut b).unwrap();
            assert_eq!(b, expect[off..off + 4096], "block at {off}");
        }
        for (off, len) in [(1usize, 10000usize), (4095, 3), (size - 5000, 5000), (12345, 40000)] {
            let mut b = vec![0u8; len];
            dev.read(off as u64, &mut b).unwrap();
            assert_eq!(b, expect[off..off + len]);
        }
        let mut b = vec![0u8; 4096];
        assert!(dev.read(size as u64 - 4095, &mut b).is_err());
        let s = dev.counters.snapshot();
        assert_eq!(s.verify_failures, 0);
        assert!(s.chunks_verified >= 6, "every pack chunk was needed at least once");
        assert!(dev.chunks.cache_len() <= 4);
    }

    #[test]
    fn corrupt_chunk_fails_with_error_and_is_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, expect, path) = synthetic(tmp.path(), 12);
        // flip one byte in pack chunk 3 (pack bytes [12288, 16384)); device offsets that
        // map there: range 2 covers pack [4096, 4096 + 2*4096 + 17) at dev 4096
        let mut pack = std::fs::read(&path).unwrap();
        pack[3 * 4096 + 7] ^= 0xff;
        std::fs::write(&path, &pack).unwrap();
        // pack chunk 3 = pack [12288, 16384) = device [4096 + 8192, ...) = dev 12288
        let mut b = vec![0u8; 4096];
        assert!(dev.read(12288, &mut b).is_err());
        assert!(dev.read(12288, &mut b).is_err());
        assert_eq!(dev.counters.snapshot().verify_failures, 2);
        // other data still reads fine
        dev.read(4096, &mut b).unwrap();
        assert_eq!(b, expect[4096..8192]);
        dev.read(0, &mut b).unwrap();
        assert_eq!(b, expect[0..4096]);
    }
}
