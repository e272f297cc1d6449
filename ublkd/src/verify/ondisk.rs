//! btrfs on-disk primitives the structural check's modules share ([`super::structure`],
//! [`super::fs_tree`]): crc32c, bounded little-endian reads of crafted bytes, keys, and
//! chunks (logical -> device) with their block group types.

use anyhow::{ensure, Context, Result};

pub(super) const BG_DATA: u64 = 1;
pub(super) const BG_SYSTEM: u64 = 2;
pub(super) const BG_METADATA: u64 = 4;
/// RAID/DUP profile bits of a block group type.
pub(super) const BG_PROFILES: u64 = 0x7f8;

pub use crate::format::crc32c::{crc32c, crc32c_update};

// ---------------------------------------------------------------------------------------
// bounded little-endian reads: every read of crafted bytes goes through these

pub(super) fn u8_at(b: &[u8], off: usize) -> Result<u8> {
    b.get(off).copied().with_context(|| format!("truncated at byte {off}"))
}
pub(super) fn u16_at(b: &[u8], off: usize) -> Result<u16> {
    Ok(u16::from_le_bytes(slice(b, off, 2)?.try_into().expect("2 bytes")))
}
pub(super) fn u32_at(b: &[u8], off: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(slice(b, off, 4)?.try_into().expect("4 bytes")))
}
pub(super) fn u64_at(b: &[u8], off: usize) -> Result<u64> {
    Ok(u64::from_le_bytes(slice(b, off, 8)?.try_into().expect("8 bytes")))
}
pub(super) fn slice(b: &[u8], off: usize, len: usize) -> Result<&[u8]> {
    off.checked_add(len)
        .and_then(|end| b.get(off..end))
        .with_context(|| format!("truncated: {len} bytes at {off} past the end ({})", b.len()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    pub objectid: u64,
    pub ty: u8,
    pub offset: u64,
}

impl Key {
    pub(super) fn parse(b: &[u8], off: usize) -> Result<Key> {
        Ok(Key {
            objectid: u64_at(b, off)?,
            ty: u8_at(b, off + 8)?,
            offset: u64_at(b, off + 9)?,
        })
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({} {} {})", self.objectid, self.ty, self.offset)
    }
}

// ---------------------------------------------------------------------------------------
// chunks: logical -> (devid, physical)

#[derive(Debug, Clone)]
pub struct Chunk {
    pub logical: u64,
    pub length: u64,
    pub ty: u64,
    /// (devid, physical offset) of each stripe
    pub stripes: Vec<(u64, u64)>,
}

/// Parse a chunk item at `b` (the item's bytes, possibly followed by more); returns the
/// chunk and its size in bytes.
pub(super) fn parse_chunk(logical: u64, b: &[u8]) -> Result<(Chunk, usize)> {
    let length = u64_at(b, 0)?;
    let ty = u64_at(b, 24)?;
    let n = u16_at(b, 44)? as usize;
    ensure!(n >= 1, "chunk at {logical}: no stripes");
    let size = 48 + 32 * n;
    ensure!(
        size <= b.len(),
        "chunk at {logical}: {n} stripes past the end of its item"
    );
    ensure!(length > 0, "chunk at {logical}: length 0");
    ensure!(
        logical.checked_add(length).is_some(),
        "chunk at {logical}: length {length} overflows"
    );
    let stripes = (0..n)
        .map(|i| Ok((u64_at(b, 48 + 32 * i)?, u64_at(b, 56 + 32 * i)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok((
        Chunk {
            logical,
            length,
            ty,
            stripes,
        },
        size,
    ))
}

#[derive(Debug, Default)]
pub struct ChunkMap(pub(super) Vec<Chunk>);

impl ChunkMap {
    pub(super) fn insert(&mut self, c: Chunk) -> Result<()> {
        if let Some(old) = self.0.iter().find(|o| o.logical == c.logical) {
            ensure!(
                old.length == c.length && old.ty == c.ty && old.stripes == c.stripes,
                "chunk at {} differs between sys_chunk_array and chunk tree",
                c.logical
            );
            return Ok(());
        }
        ensure!(
            !self
                .0
                .iter()
                .any(|o| o.logical < c.logical + c.length && c.logical < o.logical + o.length),
            "chunk at {} (+{}) overlaps another chunk",
            c.logical,
            c.length
        );
        self.0.push(c);
        Ok(())
    }

    pub(super) fn find(&self, logical: u64, len: u64) -> Option<&Chunk> {
        self.0
            .iter()
            .find(|c| logical >= c.logical && logical.checked_add(len).is_some_and(|e| e <= c.logical + c.length))
    }
}
