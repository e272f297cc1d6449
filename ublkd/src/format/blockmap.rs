//! The bundle's `blockmap` (docs/bundle-format.md, "blockmap (binary, version 1)" and
//! "version 2"): device-2 ranges -> pack ranges, plus the sha256 of every pack chunk, and
//! (version 2, compressed packs) where each chunk's stored bytes are and whether they are
//! a zstd frame. Version 1 is read as version 2 with every chunk stored raw in place.
//!
//! Lookup is a binary search over the sorted ranges; [`Blockmap::segments`] splits a
//! device read into pieces that are either zeros or one contiguous run of one pack.

use anyhow::{bail, ensure, Context, Result};

pub const MAGIC: &[u8; 8] = b"BUIBMAP\0";
pub const VERSION: u32 = 1;
pub const VERSION_COMPRESSED: u32 = 2;
const HEADER_LEN: usize = 64;
const PACK_LEN: usize = 48;
const PACK_LEN_V2: usize = 64;
const CHUNK_LEN: usize = 16;
const PACK_COMPRESSED: u32 = 1;
const CHUNK_ZSTD: u32 = 1;
const RANGE_LEN: usize = 32;
const DIGEST_LEN: usize = 32;

pub type Digest = [u8; 32];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackEntry {
    /// sha256 over the pack's chunk digests (the pack's file name).
    pub id: Digest,
    /// Logical (uncompressed) size: ranges point into these bytes.
    pub size: u64,
    /// Index of this pack's first digest in [`Blockmap::digests`].
    pub first_chunk: u64,
}

/// Where a chunk's bytes are in its pack file, and how they are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredChunk {
    pub offset: u64,
    pub length: u64,
    /// One zstd frame that decompresses to the chunk's logical bytes (else: raw).
    pub zstd: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub dev_offset: u64,
    pub length: u64,
    pub pack: u32,
    pub pack_offset: u64,
}

#[derive(Debug)]
pub struct Blockmap {
    pub chunk_shift: u32,
    pub device_size: u64,
    pub packs: Vec<PackEntry>,
    pub ranges: Vec<Range>,
    /// sha256 of each chunk's STORED bytes.
    pub digests: Vec<Digest>,
    /// Read only by the tests' encoder: the I/O path goes by `stored`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub version: u32,
    /// Parallel to `digests` (version 1: raw chunks at `chunk << chunk_shift`).
    pub stored: Vec<StoredChunk>,
}

/// One piece of a device read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    /// `len` bytes of zeros (nothing mapped there).
    Zero { len: u64 },
    /// `len` bytes of pack `pack` starting at `pack_offset`.
    Pack { pack: u32, pack_offset: u64, len: u64 },
}

impl Segment {
    pub fn len(&self) -> u64 {
        match *self {
            Segment::Zero { len } | Segment::Pack { len, .. } => len,
        }
    }
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

pub fn chunks_in(size: u64, chunk_size: u64) -> u64 {
    size.div_ceil(chunk_size)
}

impl Blockmap {
    pub fn chunk_size(&self) -> u64 {
        1 << self.chunk_shift
    }

    /// Parse and validate a whole blockmap file. Every structural rule of the format is
    /// checked here so that the I/O path can index without further checks.
    pub fn parse(b: &[u8]) -> Result<Blockmap> {
        ensure!(b.len() >= HEADER_LEN, "truncated header ({} bytes)", b.len());
        ensure!(&b[0..8] == MAGIC, "bad magic {:?} (not a blockmap)", &b[0..8]);
        let version = u32_at(b, 8);
        ensure!(
            version == VERSION || version == VERSION_COMPRESSED,
            "unsupported blockmap version {version} (this ublkd reads {VERSION} and {VERSION_COMPRESSED})"
        );
        let v2 = version == VERSION_COMPRESSED;
        let pack_len = if v2 { PACK_LEN_V2 } else { PACK_LEN };
        let chunk_shift = u32_at(b, 12);
        ensure!(
            (12..=30).contains(&chunk_shift),
            "chunk_shift {chunk_shift} out of range 12..=30"
        );
        let device_size = u64_at(b, 16);
        ensure!(
            device_size % 4096 == 0,
            "device_size {device_size} is not a multiple of 4096"
        );
        let n_packs = u32_at(b, 24) as usize;
        let n_ranges = u64_at(b, 32);
        let n_ranges = usize::try_from(n_ranges).context("n_ranges too large")?;
        let packs_end = HEADER_LEN
            .checked_add(n_packs.checked_mul(pack_len).context("n_packs too large")?)
            .context("n_packs too large")?;
        let ranges_end = packs_end
            .checked_add(n_ranges.checked_mul(RANGE_LEN).context("n_ranges too large")?)
            .context("n_ranges too large")?;
        ensure!(
            b.len() >= ranges_end,
            "truncated: {n_packs} packs and {n_ranges} ranges need {ranges_end} bytes, file has {}",
            b.len()
        );
        let chunk_size = 1u64 << chunk_shift;

        let mut packs = Vec::with_capacity(n_packs);
        let mut heads_v2 = Vec::with_capacity(n_packs); // (stored_size, flags)
        let mut expect_first = 0u64;
        for i in 0..n_packs {
            let o = HEADER_LEN + i * pack_len;
            if v2 {
                heads_v2.push((u64_at(b, o + 48), u32_at(b, o + 56)));
            }
            let p = PackEntry {
                id: b[o..o + 32].try_into().unwrap(),
                size: u64_at(b, o + 32),
                first_chunk: u64_at(b, o + 40),
            };
            ensure!(
                p.first_chunk == expect_first,
                "pack {i}: first_chunk {} but {} digests precede it",
                p.first_chunk,
                expect_first
            );
            expect_first += chunks_in(p.size, chunk_size);
            packs.push(p);
        }
        let n_digests = usize::try_from(expect_first).context("too many digests")?;
        let digests_end = n_digests
            .checked_mul(DIGEST_LEN)
            .and_then(|n| n.checked_add(ranges_end))
            .context("too many digests")?;
        let table_len = if v2 { CHUNK_LEN } else { 0 };
        let file_end = n_digests
            .checked_mul(table_len)
            .and_then(|n| n.checked_add(digests_end))
            .context("too many digests")?;
        ensure!(
            b.len() == file_end,
            "size {} but header, packs, ranges and {n_digests} digests make {file_end} bytes",
            b.len()
        );

        let mut ranges = Vec::with_capacity(n_ranges);
        let mut prev_end = 0u64;
        for i in 0..n_ranges {
            let o = packs_end + i * RANGE_LEN;
            let r = Range {
                dev_offset: u64_at(b, o),
                length: u64_at(b, o + 8),
                pack: u32_at(b, o + 16),
                pack_offset: u64_at(b, o + 24),
            };
            let flags = u32_at(b, o + 20);
            ensure!(flags == 0, "range {i}: unknown flags {flags:#x}");
            ensure!(r.length > 0, "range {i}: length 0");
            ensure!(
                r.dev_offset % 4096 == 0,
                "range {i}: dev_offset {} not 4096-aligned",
                r.dev_offset
            );
            ensure!(
                r.dev_offset >= prev_end,
                "range {i}: dev_offset {} overlaps or precedes the previous range (ends at {prev_end})",
                r.dev_offset
            );
            let end = r.dev_offset.checked_add(r.length).context("range end overflows")?;
            ensure!(
                end <= device_size,
                "range {i}: ends at {end}, past device_size {device_size}"
            );
            let pack = packs
                .get(r.pack as usize)
                .with_context(|| format!("range {i}: pack index {} but only {n_packs} packs", r.pack))?;
            let pend = r.pack_offset.checked_add(r.length).context("pack range overflows")?;
            ensure!(
                pend <= pack.size,
                "range {i}: pack bytes [{}, {pend}) past pack {} size {}",
                r.pack_offset,
                r.pack,
                pack.size
            );
            prev_end = end;
            ranges.push(r);
        }

        let mut digests = Vec::with_capacity(n_digests);
        for i in 0..n_digests {
            let o = ranges_end + i * DIGEST_LEN;
            digests.push(b[o..o + DIGEST_LEN].try_into().unwrap());
        }
        let mut stored = Vec::with_capacity(n_digests);
        for (i, p) in packs.iter().enumerate() {
            let n = chunks_in(p.size, chunk_size);
            // stored chunks are contiguous and in order; a raw one is exactly its content
            let mut at = 0u64;
            for c in 0..n {
                let logical = chunk_size.min(p.size - c * chunk_size);
                let sc = if v2 {
                    let o = digests_end + (p.first_chunk + c) as usize * CHUNK_LEN;
                    let flags = u32_at(b, o + 12);
                    ensure!(flags & !CHUNK_ZSTD == 0, "pack {i} chunk {c}: unknown flags {flags:#x}");
                    StoredChunk {
                        offset: u64_at(b, o),
                        length: u64::from(u32_at(b, o + 8)),
                        zstd: flags & CHUNK_ZSTD != 0,
                    }
                } else {
                    StoredChunk {
                        offset: at,
                        length: logical,
                        zstd: false,
                    }
                };
                ensure!(
                    sc.offset == at && sc.length > 0 && (sc.zstd || sc.length == logical),
                    "pack {i} chunk {c}: bad stored extent (offset {}, length {}, zstd {})",
                    sc.offset,
                    sc.length,
                    sc.zstd
                );
                ensure!(
                    !sc.zstd || heads_v2[i].1 & PACK_COMPRESSED != 0,
                    "pack {i} chunk {c}: a zstd frame in a pack not flagged compressed"
                );
                at += sc.length;
                stored.push(sc);
            }
            if v2 {
                ensure!(
                    heads_v2[i].0 == at,
                    "pack {i}: stored size {} but its chunks take {at} bytes",
                    heads_v2[i].0
                );
            }
        }
        Ok(Blockmap {
            chunk_shift,
            device_size,
            packs,
            ranges,
            digests,
            version,
            stored,
        })
    }

    /// The expected digest of chunk `chunk` of pack `pack`.
    pub fn digest(&self, pack: u32, chunk: u64) -> &Digest {
        let p = &self.packs[pack as usize];
        &self.digests[(p.first_chunk + chunk) as usize]
    }

    /// Where chunk `chunk` of pack `pack` is stored in the pack file.
    pub fn stored(&self, pack: u32, chunk: u64) -> &StoredChunk {
        let p = &self.packs[pack as usize];
        &self.stored[(p.first_chunk + chunk) as usize]
    }

    /// The pack file's size.
    pub fn stored_size(&self, pack: u32) -> u64 {
        let p = &self.packs[pack as usize];
        let n = chunks_in(p.size, self.chunk_size());
        if n == 0 {
            return 0;
        }
        let last = self.stored(pack, n - 1);
        last.offset + last.length
    }

    /// Logical byte range `[start, end)` of chunk `chunk` in pack `pack`.
    pub fn chunk_bounds(&self, pack: u32, chunk: u64) -> (u64, u64) {
        let size = self.packs[pack as usize].size;
        let start = chunk << self.chunk_shift;
        (start, (start + self.chunk_size()).min(size))
    }

    /// Index of the last range with `dev_offset <= off`.
    fn find(&self, off: u64) -> Option<usize> {
        let idx = self.ranges.partition_point(|r| r.dev_offset <= off);
        idx.checked_sub(1)
    }

    /// Split the device read `[off, off + len)` into zero and pack segments, in order.
    /// Fails if the read goes past `device_size`.
    pub fn segments(&self, off: u64, len: u64) -> Result<Vec<Segment>> {
        let end = off.checked_add(len).context("read range overflows")?;
        if end > self.device_size {
            bail!("read [{off}, {end}) past device size {}", self.device_size);
        }
        let mut out = Vec::new();
        let mut pos = off;
        let mut idx = self.find(off);
        while pos < end {
            // is pos inside range idx?
            if let Some(i) = idx {
                let r = &self.ranges[i];
                let r_end = r.dev_offset + r.length;
                if pos < r_end {
                    let take = r_end.min(end) - pos;
                    out.push(Segment::Pack {
                        pack: r.pack,
                        pack_offset: r.pack_offset + (pos - r.dev_offset),
                        len: take,
                    });
                    pos += take;
                    continue;
                }
            }
            let next = idx.map_or(0, |i| i + 1);
            match self.ranges.get(next) {
                // the next range starts here: continue inside it
                Some(r) if r.dev_offset <= pos => idx = Some(next),
                // zeros up to the next range (or the end of the read)
                r => {
                    let take = r.map_or(u64::MAX, |r| r.dev_offset).min(end) - pos;
                    push_zero(&mut out, take);
                    pos += take;
                }
            }
        }
        Ok(out)
    }
}

fn push_zero(out: &mut Vec<Segment>, len: u64) {
    if let Some(Segment::Zero { len: l }) = out.last_mut() {
        *l += len;
    } else {
        out.push(Segment::Zero { len });
    }
}

/// Serialize a blockmap (tests; the builder is the real writer).
#[cfg(test)]
pub fn encode(bm: &Blockmap) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&bm.version.to_le_bytes());
    v.extend_from_slice(&bm.chunk_shift.to_le_bytes());
    v.extend_from_slice(&bm.device_size.to_le_bytes());
    v.extend_from_slice(&(bm.packs.len() as u32).to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&(bm.ranges.len() as u64).to_le_bytes());
    v.extend_from_slice(&[0u8; 24]);
    let v2 = bm.version == VERSION_COMPRESSED;
    for p in &bm.packs {
        v.extend_from_slice(&p.id);
        v.extend_from_slice(&p.size.to_le_bytes());
        v.extend_from_slice(&p.first_chunk.to_le_bytes());
        if v2 {
            let n = chunks_in(p.size, bm.chunk_size()) as usize;
            let chunks = &bm.stored[p.first_chunk as usize..p.first_chunk as usize + n];
            let stored: u64 = chunks.iter().map(|c| c.length).sum();
            let flags = if chunks.iter().any(|c| c.zstd) {
                PACK_COMPRESSED
            } else {
                0
            };
            v.extend_from_slice(&stored.to_le_bytes());
            v.extend_from_slice(&flags.to_le_bytes());
            v.extend_from_slice(&0u32.to_le_bytes());
        }
    }
    for r in &bm.ranges {
        v.extend_from_slice(&r.dev_offset.to_le_bytes());
        v.extend_from_slice(&r.length.to_le_bytes());
        v.extend_from_slice(&r.pack.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&r.pack_offset.to_le_bytes());
    }
    for d in &bm.digests {
        v.extend_from_slice(d);
    }
    if v2 {
        for c in &bm.stored {
            v.extend_from_slice(&c.offset.to_le_bytes());
            v.extend_from_slice(&(c.length as u32).to_le_bytes());
            v.extend_from_slice(&u32::from(c.zstd).to_le_bytes());
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Blockmap {
        Blockmap {
            chunk_shift: 12,
            device_size: 64 * 4096,
            packs: vec![PackEntry {
                id: [1; 32],
                size: 3 * 4096 + 100,
                first_chunk: 0,
            }],
            ranges: vec![
                Range {
                    dev_offset: 4096,
                    length: 4096,
                    pack: 0,
                    pack_offset: 0,
                },
                Range {
                    dev_offset: 8192,
                    length: 100,
                    pack: 0,
                    pack_offset: 4096,
                },
                Range {
                    dev_offset: 10 * 4096,
                    length: 4096,
                    pack: 0,
                    pack_offset: 8192,
                },
            ],
            digests: vec![[2; 32], [3; 32], [4; 32], [5; 32]],
            version: VERSION,
            stored: vec![],
        }
    }

    #[test]
    fn roundtrip_and_segments() {
        let bytes = encode(&sample());
        let bm = Blockmap::parse(&bytes).unwrap();
        assert_eq!(bm.ranges, sample().ranges);
        assert_eq!(bm.digest(0, 3), &[5; 32]);
        assert_eq!(bm.chunk_bounds(0, 3), (3 * 4096, 3 * 4096 + 100));
        assert_eq!(bm.segments(0, 4096).unwrap(), vec![Segment::Zero { len: 4096 }]);
        assert_eq!(
            bm.segments(4000, 4096 + 200).unwrap(),
            vec![
                Segment::Zero { len: 96 },
                Segment::Pack {
                    pack: 0,
                    pack_offset: 0,
                    len: 4096
                },
                Segment::Pack {
                    pack: 0,
                    pack_offset: 4096,
                    len: 100
                },
                Segment::Zero { len: 4 },
            ]
        );
        assert_eq!(
            bm.segments(8192 + 50, 9 * 4096).unwrap(),
            vec![
                Segment::Pack {
                    pack: 0,
                    pack_offset: 4096 + 50,
                    len: 50
                },
                Segment::Zero {
                    len: 10 * 4096 - 8192 - 100
                },
                Segment::Pack {
                    pack: 0,
                    pack_offset: 8192,
                    len: 4096
                },
                Segment::Zero { len: 50 },
            ]
        );
        assert_eq!(bm.segments(63 * 4096, 4096).unwrap(), vec![Segment::Zero { len: 4096 }]);
        assert!(bm.segments(63 * 4096, 4097).is_err());
    }

    #[test]
    fn rejects_bad_maps() {
        let mut s = sample();
        s.ranges[1].dev_offset = 4096 + 2048; // overlap
        assert!(Blockmap::parse(&encode(&s)).is_err());
        let mut s = sample();
        s.ranges[2].pack_offset = 3 * 4096; // past pack end
        assert!(Blockmap::parse(&encode(&s)).is_err());
        let mut b = encode(&sample());
        b.pop();
        assert!(Blockmap::parse(&b).is_err());
        let mut b = encode(&sample());
        b[0] = b'X';
        assert!(Blockmap::parse(&b).is_err());
    }
}
