//! The fs tree's items, as the structural check ([`super::structure`]) walks them in key
//! order: what the kernel's tree-checker and `btrfs check` would object to in an item,
//! checked in userspace before the kernel sees it, plus what overlayfs would hide.
//!
//! * EXTENT_DATA: well formed (type, encodings, 4 KiB alignment, inline only at file
//!   offset 0 and within its item), not overlapping the inode's previous extent, of an
//!   inode that has an INODE_ITEM and is a file or symlink; a regular/prealloc extent's
//!   disk range in one data chunk and, on device 2, on bytes the blockmap maps to packs.
//! * Each inode's `nbytes` equals what its extents hold (`btrfs check`'s rule: inline
//!   ram_bytes plus the num_bytes of every extent that is not a hole).
//! * DIR_ITEM, DIR_INDEX, XATTR_ITEM: every entry inside its item, a name of 1..=255
//!   bytes whose hash is the key's offset (DIR_ITEM, XATTR_ITEM), a valid file type,
//!   one entry per DIR_INDEX.

use super::ondisk::{crc32c_update, u16_at, u32_at, u64_at, ChunkMap, Key, BG_DATA};
use crate::format::blockmap::Blockmap;
use anyhow::{bail, ensure, Context, Result};

pub(super) const INODE_ITEM_KEY: u8 = 1;
pub(super) const XATTR_ITEM_KEY: u8 = 24;
const DIR_ITEM_KEY: u8 = 84;
const DIR_INDEX_KEY: u8 = 96;
pub(super) const EXTENT_DATA_KEY: u8 = 108;
const SECTOR: u64 = 4096;
const NAME_LEN_MAX: usize = 255; // BTRFS_NAME_LEN, and XATTR_NAME_MAX
const DIR_ITEM_SIZE: usize = 30; // struct btrfs_dir_item without its name and data
const FT_SYMLINK: u8 = 7;
const FT_XATTR: u8 = 8;
const COMPRESS_MAX: u8 = 3; // BTRFS_COMPRESS_ZSTD
const S_IFMT: u32 = 0o170000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

/// `btrfs_name_hash`: the key offset of a DIR_ITEM or XATTR_ITEM.
pub(super) fn name_hash(name: &[u8]) -> u64 {
    crc32c_update(!1, name) as u64
}

/// The inode whose items the walk is in.
struct Inode {
    ino: u64,
    mode: u32,
    nbytes: u64,
    /// what its extents so far hold (btrfs check's `found_size`)
    found: u64,
    /// the file offset where its last extent ends
    end: u64,
}

/// The fs tree walk's state: fed every leaf item in key order, then [`FsTree::finish`].
#[derive(Default)]
pub(super) struct FsTree {
    inode: Option<Inode>,
    pub extents: u64,
    pub overlay: OverlayView,
}

impl FsTree {
    pub fn item(&mut self, chunks: &ChunkMap, bm: &Blockmap, key: Key, d: &[u8]) -> Result<()> {
        match key.ty {
            INODE_ITEM_KEY => {
                self.finish()?;
                ensure!(key.offset == 0, "inode item with key offset {}", key.offset);
                ensure!(d.len() == 160, "inode item of {} bytes, not 160", d.len());
                self.inode = Some(Inode {
                    ino: key.objectid,
                    mode: u32_at(d, 52)?,
                    nbytes: u64_at(d, 24)?,
                    found: 0,
                    end: 0,
                });
            }
            EXTENT_DATA_KEY => {
                let ino = self
                    .inode
                    .as_mut()
                    .filter(|i| i.ino == key.objectid)
                    .with_context(|| format!("file extent of inode {}, which has no inode item", key.objectid))?;
                ensure!(
                    matches!(ino.mode & S_IFMT, S_IFREG | S_IFLNK),
                    "file extent of inode {} of mode {:o}, not a file or symlink",
                    ino.ino,
                    ino.mode
                );
                ensure!(
                    key.offset >= ino.end,
                    "file extent at file offset {} overlaps the one before it, which ends at {}",
                    key.offset,
                    ino.end
                );
                let span = check_extent(chunks, bm, key.offset, d)?;
                ino.end = key.offset.saturating_add(span.len);
                ino.found = ino.found.saturating_add(span.nbytes);
                self.extents += 1;
            }
            DIR_ITEM_KEY | DIR_INDEX_KEY | XATTR_ITEM_KEY => check_dir_entries(key, d)?,
            _ => {}
        }
        self.overlay.item(key, d)
    }

    /// After the inode's last item: its nbytes against its extents.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(i) = self.inode.take() {
            if matches!(i.mode & S_IFMT, S_IFREG | S_IFLNK) {
                ensure!(
                    i.nbytes == i.found,
                    "inode {}: nbytes {} but its file extents hold {} bytes",
                    i.ino,
                    i.nbytes,
                    i.found
                );
            }
        }
        Ok(())
    }
}

/// Every btrfs_dir_item of a DIR_ITEM, DIR_INDEX or XATTR_ITEM (entries whose names'
/// hashes collide share one DIR_ITEM / XATTR_ITEM).
fn check_dir_entries(key: Key, d: &[u8]) -> Result<()> {
    let what = match key.ty {
        XATTR_ITEM_KEY => "xattr item",
        DIR_INDEX_KEY => "dir index",
        _ => "dir item",
    };
    let mut at = 0;
    let mut n = 0;
    while at < d.len() {
        ensure!(
            d.len() - at >= DIR_ITEM_SIZE,
            "{what}: entry at {at} is cut short ({} bytes left of the item)",
            d.len() - at
        );
        let data_len = u16_at(d, at + 25)? as usize;
        let name_len = u16_at(d, at + 27)? as usize;
        let ty = d[at + 29];
        let name_at = at + DIR_ITEM_SIZE;
        ensure!(
            name_at + name_len + data_len <= d.len(),
            "{what}: entry at {at}: name_len {name_len} + data_len {data_len} run past the item's {} bytes",
            d.len()
        );
        ensure!(
            (1..=NAME_LEN_MAX).contains(&name_len),
            "{what}: entry at {at}: name_len {name_len}, not 1..={NAME_LEN_MAX}"
        );
        if key.ty == XATTR_ITEM_KEY {
            ensure!(
                ty == FT_XATTR,
                "{what}: entry at {at}: type {ty}, not {FT_XATTR} (xattr)"
            );
        } else {
            ensure!(
                (1..=FT_SYMLINK).contains(&ty),
                "{what}: entry at {at}: file type {ty}, not 1..={FT_SYMLINK}"
            );
            ensure!(data_len == 0, "{what}: entry at {at}: {data_len} bytes of data");
        }
        let name = &d[name_at..name_at + name_len];
        if key.ty != DIR_INDEX_KEY {
            let h = name_hash(name);
            ensure!(
                h == key.offset,
                "{what}: entry at {at}: name hash {h:#x}, its key says {:#x}",
                key.offset
            );
        }
        n += 1;
        at = name_at + name_len + data_len;
    }
    ensure!(n >= 1, "{what} with no entry");
    ensure!(key.ty != DIR_INDEX_KEY || n == 1, "{what} with {n} entries, not 1");
    Ok(())
}

/// What one EXTENT_DATA adds to its inode: the file bytes it spans and what it counts in
/// the inode's nbytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ExtentSpan {
    pub len: u64,
    pub nbytes: u64,
}

/// One EXTENT_DATA item at `file_offset`: well formed; a regular or prealloc extent's
/// disk range in one data chunk and, on device 2, inside bytes the blockmap maps to packs.
pub(super) fn check_extent(chunks: &ChunkMap, bm: &Blockmap, file_offset: u64, d: &[u8]) -> Result<ExtentSpan> {
    ensure!(d.len() >= 21, "file extent of {} bytes", d.len());
    let (compression, encryption, other) = (d[16], d[17], u16_at(d, 18)?);
    ensure!(
        compression <= COMPRESS_MAX,
        "file extent: compression {compression}, not 0..={COMPRESS_MAX}"
    );
    ensure!(
        encryption == 0 && other == 0,
        "file extent: encryption {encryption}, other encoding {other} (not 0)"
    );
    let ram = u64_at(d, 8)?;
    match d[20] {
        0 => {
            ensure!(file_offset == 0, "inline extent at file offset {file_offset}, not 0");
            ensure!(
                ram < SECTOR,
                "inline extent: ram_bytes {ram}, more than a sector less one"
            );
            if compression == 0 {
                ensure!(
                    ram == (d.len() - 21) as u64,
                    "inline extent: ram_bytes {ram}, {} bytes inline",
                    d.len() - 21
                );
            }
            Ok(ExtentSpan { len: ram, nbytes: ram })
        }
        1 | 2 => {
            ensure!(d.len() == 53, "file extent of {} bytes, not 53", d.len());
            let disk = u64_at(d, 21)?;
            let disk_len = u64_at(d, 29)?;
            let off = u64_at(d, 37)?;
            let num = u64_at(d, 45)?;
            ensure!(
                [file_offset, disk, disk_len, off, num].iter().all(|v| v % SECTOR == 0),
                "file extent: file offset {file_offset}, disk {disk} (+{disk_len}), offset {off}, \
                 {num} bytes: not all {SECTOR}-aligned"
            );
            ensure!(num > 0, "file extent of 0 bytes");
            if disk == 0 {
                return Ok(ExtentSpan { len: num, nbytes: 0 }); // a hole
            }
            ensure!(disk_len > 0, "file extent of 0 disk bytes");
            ensure!(
                off.checked_add(num).is_some_and(|e| e <= ram),
                "file extent: offset {off} + {num} bytes past its {ram} bytes"
            );
            if compression == 0 {
                ensure!(
                    ram == disk_len,
                    "uncompressed file extent: ram_bytes {ram} != disk_num_bytes {disk_len}"
                );
            }
            let c = chunks
                .find(disk, disk_len)
                .with_context(|| format!("file extent at disk {disk} (+{disk_len}): in no chunk"))?;
            ensure!(
                c.ty & BG_DATA != 0,
                "file extent at disk {disk}: in a chunk of type {:#x}, not data",
                c.ty
            );
            let phys = c.stripes[0].1 + (disk - c.logical);
            covered(bm, phys, disk_len).with_context(|| {
                format!(
                    "file extent at disk {disk} (+{disk_len}) = device 2 bytes {phys}..{}",
                    phys + disk_len
                )
            })?;
            Ok(ExtentSpan { len: num, nbytes: num })
        }
        t => bail!("file extent of type {t}"),
    }
}

/// Every byte of device 2's [off, off+len) mapped by a blockmap range, but for the rest
/// of a 4 KiB block after a range that ends inside it.
pub(super) fn covered(bm: &Blockmap, off: u64, len: u64) -> Result<()> {
    let end = off.checked_add(len).context("overflows")?;
    ensure!(end <= bm.device_size, "past device 2's size {}", bm.device_size);
    let mut at = off;
    // the last range starting at or before `at`
    let mut i = bm.ranges.partition_point(|r| r.dev_offset <= at);
    ensure!(i > 0, "device 2 byte {at} is mapped by no blockmap range");
    i -= 1;
    while at < end {
        let r = bm
            .ranges
            .get(i)
            .with_context(|| format!("device 2 byte {at} is mapped by no blockmap range"))?;
        ensure!(
            r.dev_offset <= at && at < r.dev_offset + r.length,
            "device 2 byte {at} is mapped by no blockmap range"
        );
        // a range need not end on a 4 KiB boundary (a file's last bytes): the rest of
        // that block is zeros the extent may cover
        at = (r.dev_offset + r.length).next_multiple_of(4096);
        i += 1;
    }
    Ok(())
}

/// What an overlayfs over the image (mounted by root without `userxattr`, as
/// `mount --ephemeral` mounts it) would not show as the image has it. Measured on 6.18
/// (docs/ublkd.md, "Ephemeral mounts are exact"): xattrs named `trusted.overlay.*` are
/// overlayfs's own (hidden, or steering it: opaque, redirect, whiteout), and
/// `trusted.overlay.overlay.X` is shown as `trusted.overlay.X`; a character device 0:0
/// is a whiteout (the entry vanishes). `user.overlay.*`, other `trusted.*`, `security.*`
/// and `user.*` show as they are.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OverlayView {
    /// xattrs named `trusted.overlay.*`
    pub overlay_xattrs: u64,
    /// character devices 0:0
    pub whiteouts: u64,
    /// the first of them, as "inode N: xattr NAME" or "inode N: character device 0:0"
    pub first: Option<String>,
}

/// overlayfs's xattr namespace in a mount without `userxattr` (OVL_XATTR_TRUSTED_PREFIX)
pub const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";

impl OverlayView {
    /// None: overlayfs shows the image exactly; else why not, in a sentence.
    pub fn inexact(&self) -> Option<String> {
        let mut what = Vec::new();
        if self.overlay_xattrs > 0 {
            what.push(format!("{} xattr(s) named trusted.overlay.*", self.overlay_xattrs));
        }
        if self.whiteouts > 0 {
            what.push(format!("{} character device(s) 0:0", self.whiteouts));
        }
        let first = self.first.as_ref()?;
        Some(format!(
            "the image has {} (first: {first}), which overlayfs hides or interprets",
            what.join(" and ")
        ))
    }

    fn note(&mut self, what: String) {
        self.first.get_or_insert(what);
    }

    /// One fs tree item: an INODE_ITEM (mode, rdev) or an XATTR_ITEM (one or more
    /// btrfs_dir_item entries with the names of the xattrs whose name hashes collide).
    pub(super) fn item(&mut self, key: Key, d: &[u8]) -> Result<()> {
        match key.ty {
            INODE_ITEM_KEY => {
                ensure!(d.len() == 160, "inode item of {} bytes, not 160", d.len());
                let (mode, rdev) = (u32_at(d, 52)?, u64_at(d, 56)?);
                if mode & 0o170000 == 0o020000 && rdev == 0 {
                    self.whiteouts += 1;
                    self.note(format!("inode {}: character device 0:0", key.objectid));
                }
            }
            XATTR_ITEM_KEY => {
                let mut at = 0;
                while at < d.len() {
                    ensure!(d.len() - at >= 30, "xattr item: entry at {at} is cut short");
                    let data_len = u16::from_le_bytes([d[at + 25], d[at + 26]]) as usize;
                    let name_len = u16::from_le_bytes([d[at + 27], d[at + 28]]) as usize;
                    let end = at + 30 + name_len + data_len;
                    ensure!(end <= d.len(), "xattr item: entry at {at} runs past the item");
                    let name = &d[at + 30..at + 30 + name_len];
                    if name.starts_with(OVERLAY_XATTR_PREFIX) {
                        self.overlay_xattrs += 1;
                        let name = String::from_utf8_lossy(name);
                        self.note(format!("inode {}: xattr {name}", key.objectid));
                    }
                    at = end;
                }
            }
            _ => {}
        }
        Ok(())
    }
}
