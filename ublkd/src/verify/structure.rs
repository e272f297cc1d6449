//! The structural check `mount` runs before the kernel first mounts an image id
//! (docs/ublkd.md, "Structural check before mount"): what `btrfs check` cannot know
//! about a bundle, read from `meta.img` in userspace with bounds on everything.
//!
//! * meta.img's superblock: checksum (crc32c), magic, sizes, devid 1, the manifest's
//!   fsid and device uuid.
//! * The chunk tree (sys_chunk_array, then the tree): every metadata/system chunk lives
//!   on devid 1 only (so every tree block is in meta.img), data chunks are single on
//!   devid 2, inside device 2.
//! * The root tree -> the fs tree: every tree block checksummed, at its own bytenr,
//!   of this fsid, at the level and generation its parent (or root item, or the
//!   superblock) says, keys strictly ascending, items laid out in the leaf as the
//!   kernel's tree-checker wants, no block visited twice (no loops), depth bounded.
//! * Every item of the fs tree ([`super::fs_tree`]): file extents well formed, not
//!   overlapping, and on device-2 bytes the blockmap maps to packs; each inode's nbytes
//!   against its extents; directory and xattr entries.
//! * Device 2's superblock (read through the server, [`check_dev2_super`]) agrees with
//!   meta.img's: fsid, devid 2 and its dev item in meta.img's chunk tree, total bytes.
//!
//! The fs tree walk also notes what overlayfs would not show as the image has it
//! ([`OverlayView`]), so `mount --ephemeral` can choose another way for such images.
//!
//! Crafted input gives an error naming the first problem and where, never a panic.

use super::fs_tree::FsTree;
pub use super::fs_tree::OverlayView;
#[cfg(test)]
use super::fs_tree::{check_extent, covered, name_hash, INODE_ITEM_KEY, XATTR_ITEM_KEY};
#[cfg(test)]
use super::ondisk::Chunk;
use super::ondisk::{
    crc32c, parse_chunk, slice, u16_at, u32_at, u64_at, u8_at, ChunkMap, Key, BG_DATA, BG_METADATA, BG_PROFILES,
    BG_SYSTEM,
};
use crate::format::blockmap::Blockmap;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Changes when what the check checks changes: a record of another version is not
/// believed.
// 2: the record says what overlayfs would hide; 3: generations, leaf item layout,
// inode nbytes, overlapping extents, directory and xattr entries (fs_tree.rs)
pub const CHECK_VERSION: u32 = 3;

pub const SUPER_OFFSET: u64 = 64 * 1024;
pub const SUPER_SIZE: usize = 4096;
const MAGIC: &[u8; 8] = b"_BHRfS_M";
const HEADER_SIZE: usize = 101;
const ITEM_SIZE: usize = 25;
const KEY_PTR_SIZE: usize = 33;
const MAX_LEVEL: u8 = 7;
const SYS_CHUNK_ARRAY_OFF: usize = 811;
const SYS_CHUNK_ARRAY_MAX: usize = 2048;
const DEV_ITEM_OFF: usize = 201;
const DEV_ITEM_SIZE: usize = 98;

const ROOT_TREE_OBJECTID: u64 = 1;
const CHUNK_TREE_OBJECTID: u64 = 3;
const FS_TREE_OBJECTID: u64 = 5;
const DEV_ITEMS_OBJECTID: u64 = 1;
const FIRST_CHUNK_TREE_OBJECTID: u64 = 256;
const ROOT_ITEM_KEY: u8 = 132;
const DEV_ITEM_KEY: u8 = 216;
const CHUNK_ITEM_KEY: u8 = 228;

// ---------------------------------------------------------------------------------------
// superblock

#[derive(Debug, Clone)]
pub struct DevItem {
    pub devid: u64,
    pub total_bytes: u64,
    pub uuid: [u8; 16],
    pub fsid: [u8; 16],
}

impl DevItem {
    fn parse(b: &[u8]) -> Result<DevItem> {
        ensure!(b.len() >= DEV_ITEM_SIZE, "dev item of {} bytes", b.len());
        Ok(DevItem {
            devid: u64_at(b, 0)?,
            total_bytes: u64_at(b, 8)?,
            uuid: slice(b, 66, 16)?.try_into().expect("16"),
            fsid: slice(b, 82, 16)?.try_into().expect("16"),
        })
    }
}

#[derive(Debug, Clone)]
pub struct Super {
    pub fsid: [u8; 16],
    pub generation: u64,
    pub root: u64,
    pub chunk_root: u64,
    pub chunk_root_generation: u64,
    pub total_bytes: u64,
    pub num_devices: u64,
    pub nodesize: u32,
    pub root_level: u8,
    pub chunk_root_level: u8,
    pub dev_item: DevItem,
    sys_chunk_array: Vec<u8>,
}

/// Parse and check a 4 KiB superblock (`what` names it in errors).
pub fn parse_super(b: &[u8], what: &str) -> Result<Super> {
    let r = (|| -> Result<Super> {
        ensure!(b.len() >= SUPER_SIZE, "{} bytes, not {SUPER_SIZE}", b.len());
        let b = &b[..SUPER_SIZE];
        ensure!(&b[64..72] == MAGIC, "no btrfs magic");
        let csum_type = u16_at(b, 196)?;
        ensure!(csum_type == 0, "checksum type {csum_type}, only crc32c (0) is checked");
        let want = u32_at(b, 0)?;
        let got = crc32c(&b[32..]);
        ensure!(want == got, "checksum {want:#010x}, computed {got:#010x}");
        ensure!(
            u64_at(b, 48)? == SUPER_OFFSET,
            "bytenr {} is not {SUPER_OFFSET}",
            u64_at(b, 48)?
        );
        let sectorsize = u32_at(b, 144)?;
        let nodesize = u32_at(b, 148)?;
        ensure!(sectorsize == 4096, "sectorsize {sectorsize}, not 4096");
        ensure!(
            nodesize.is_power_of_two() && (4096..=65536).contains(&nodesize),
            "nodesize {nodesize}"
        );
        let sys_len = u32_at(b, 160)? as usize;
        ensure!(
            sys_len <= SYS_CHUNK_ARRAY_MAX,
            "sys_chunk_array_size {sys_len} > {SYS_CHUNK_ARRAY_MAX}"
        );
        let root_level = u8_at(b, 198)?;
        let chunk_root_level = u8_at(b, 199)?;
        ensure!(
            root_level <= MAX_LEVEL && chunk_root_level <= MAX_LEVEL,
            "tree level > {MAX_LEVEL}"
        );
        Ok(Super {
            fsid: slice(b, 32, 16)?.try_into().expect("16"),
            generation: u64_at(b, 72)?,
            root: u64_at(b, 80)?,
            chunk_root: u64_at(b, 88)?,
            chunk_root_generation: u64_at(b, 164)?,
            total_bytes: u64_at(b, 112)?,
            num_devices: u64_at(b, 136)?,
            nodesize,
            root_level,
            chunk_root_level,
            dev_item: DevItem::parse(slice(b, DEV_ITEM_OFF, DEV_ITEM_SIZE)?)?,
            sys_chunk_array: slice(b, SYS_CHUNK_ARRAY_OFF, sys_len)?.to_vec(),
        })
    })();
    r.with_context(|| format!("{what} superblock"))
}

// ---------------------------------------------------------------------------------------
// the meta.img reader

/// What a tree walk calls for every leaf item (key, item data).
type LeafFn<'a, 'c> = dyn FnMut(&mut Meta<'a>, Key, &[u8]) -> Result<()> + 'c;

pub struct Meta<'a> {
    file: &'a File,
    file_size: u64,
    pub sb: Super,
    chunks: ChunkMap,
    visited: HashSet<u64>,
    max_blocks: usize,
}

/// What the meta.img check found, for the device-2 superblock check.
#[derive(Debug)]
pub struct MetaSummary {
    pub sb: Super,
    /// devid 2's item in meta.img's chunk tree.
    pub dev2: DevItem,
    pub extents: u64,
    pub tree_blocks: usize,
    pub overlay: OverlayView,
}

/// Where a tree (or subtree) starts and what its block must say.
#[derive(Debug, Clone, Copy)]
struct Root {
    bytenr: u64,
    level: u8,
    generation: u64,
}

impl<'a> Meta<'a> {
    /// A tree block at `logical`, checked against what points at it: `level`, `owner` and
    /// `generation` (its parent's key pointer, root item or the superblock).
    fn read_block(&mut self, logical: u64, level: u8, owner: u64, generation: u64, tree: &str) -> Result<Vec<u8>> {
        let ns = self.sb.nodesize as u64;
        let where_ = format!("{tree} tree block {logical}");
        ensure!(
            self.visited.insert(logical),
            "{where_}: visited twice (a loop or a shared block)"
        );
        ensure!(
            self.visited.len() <= self.max_blocks,
            "{where_}: more than {} tree blocks",
            self.max_blocks
        );
        let c = self
            .chunks
            .find(logical, ns)
            .with_context(|| format!("{where_}: in no chunk"))?;
        ensure!(
            c.ty & (BG_METADATA | BG_SYSTEM) != 0 && c.ty & BG_DATA == 0,
            "{where_}: in a chunk of type {:#x}, not metadata",
            c.ty
        );
        let (devid, phys) = c.stripes[0];
        ensure!(devid == 1, "{where_}: on devid {devid}, not in meta.img");
        let phys = phys.saturating_add(logical - c.logical);
        ensure!(
            phys.checked_add(ns).is_some_and(|e| e <= self.file_size),
            "{where_}: physical {phys} past the end of meta.img ({})",
            self.file_size
        );
        let mut b = vec![0u8; ns as usize];
        self.file
            .read_exact_at(&mut b, phys)
            .with_context(|| format!("{where_}: read at {phys}"))?;
        check_header(&b, logical, level, owner, generation, &self.sb, &where_)?;
        Ok(b)
    }

    /// Walk a tree depth first; `leaf_item(key, data)` sees every leaf item in key order.
    fn walk(&mut self, root: Root, owner: u64, tree: &str, leaf_item: &mut LeafFn<'a, '_>) -> Result<()> {
        self.walk_block(root, owner, tree, None, leaf_item)
    }

    fn walk_block(
        &mut self,
        Root {
            bytenr,
            level,
            generation,
        }: Root,
        owner: u64,
        tree: &str,
        first_key: Option<Key>,
        leaf_item: &mut LeafFn<'a, '_>,
    ) -> Result<()> {
        let b = self.read_block(bytenr, level, owner, generation, tree)?;
        let where_ = format!("{tree} tree block {bytenr}");
        // the whole block's layout and key order first (as the kernel's tree-checker
        // does), then its items or children: the first problem is the block's own
        match block_layout(&b, level, &where_, first_key)? {
            Layout::Leaf(items) => {
                for (i, (key, at, size)) in items.into_iter().enumerate() {
                    leaf_item(self, key, &b[at..at + size]).with_context(|| format!("{where_}: item {i} {key}"))?;
                }
            }
            Layout::Node(children) => {
                for (key, child) in children {
                    self.walk_block(child, owner, tree, Some(key), leaf_item)?;
                }
            }
        }
        Ok(())
    }
}

/// A tree block's header against what points at it (`level`, `owner`, `generation`: its
/// parent's key pointer, a root item or the superblock) and the superblock.
fn check_header(
    b: &[u8],
    logical: u64,
    level: u8,
    owner: u64,
    generation: u64,
    sb: &Super,
    where_: &str,
) -> Result<()> {
    let want = u32_at(b, 0)?;
    let got = crc32c(&b[32..]);
    ensure!(want == got, "{where_}: checksum {want:#010x}, computed {got:#010x}");
    ensure!(
        u64_at(b, 48)? == logical,
        "{where_}: header says bytenr {}",
        u64_at(b, 48)?
    );
    ensure!(b[32..48] == sb.fsid, "{where_}: fsid is not the filesystem's");
    ensure!(b[100] == level, "{where_}: level {}, its parent says {level}", b[100]);
    let o = u64_at(b, 88)?;
    ensure!(o == owner, "{where_}: owner {o}, not {owner}");
    // the kernel's verify_parent_transid: a block of another generation than its parent
    // names is a stale or forged one
    let g = u64_at(b, 80)?;
    ensure!(
        g == generation,
        "{where_}: generation {g}, what points at it says {generation}"
    );
    ensure!(
        g <= sb.generation,
        "{where_}: generation {g}, newer than the superblock's {}",
        sb.generation
    );
    Ok(())
}

/// What a tree block holds, its layout checked.
#[derive(Debug)]
enum Layout {
    /// (key, data position in the block, data size) of each item
    Leaf(Vec<(Key, usize, usize)>),
    /// (key, child) of each key pointer
    Node(Vec<(Key, Root)>),
}

/// A block's items or key pointers: inside the block, keys strictly ascending, the first
/// one its parent's (`first_key`); a leaf's item data laid out as the kernel's
/// tree-checker wants it.
fn block_layout(b: &[u8], level: u8, where_: &str, first_key: Option<Key>) -> Result<Layout> {
    let n = u32_at(b, 96)? as usize;
    let body = b.len() - HEADER_SIZE;
    let mut prev: Option<Key> = None;
    if level == 0 {
        ensure!(n * ITEM_SIZE <= body, "{where_}: {n} items do not fit in a leaf");
        let mut items = Vec::with_capacity(n);
        let mut data_end = body;
        for i in 0..n {
            let at = HEADER_SIZE + i * ITEM_SIZE;
            let key = Key::parse(b, at)?;
            let (off, size) = (u32_at(b, at + 17)? as usize, u32_at(b, at + 21)? as usize);
            ensure!(
                off >= n * ITEM_SIZE && off.checked_add(size).is_some_and(|e| e <= body),
                "{where_}: item {i} {key}: data at {off}+{size} outside the leaf"
            );
            // item 0's data ends the leaf, each next item's ends where the one before
            // starts (no gaps, no shared bytes)
            ensure!(
                off + size == data_end,
                "{where_}: item {i} {key}: data at {off}+{size} does not end where the item before \
                 starts ({data_end})"
            );
            data_end = off;
            check_order(where_, i, key, prev, first_key)?;
            prev = Some(key);
            items.push((key, HEADER_SIZE + off, size));
        }
        Ok(Layout::Leaf(items))
    } else {
        ensure!(n >= 1, "{where_}: a node with no children");
        ensure!(n * KEY_PTR_SIZE <= body, "{where_}: {n} pointers do not fit in a node");
        let mut children = Vec::with_capacity(n);
        for i in 0..n {
            let at = HEADER_SIZE + i * KEY_PTR_SIZE;
            let key = Key::parse(b, at)?;
            check_order(where_, i, key, prev, first_key)?;
            prev = Some(key);
            let child = Root {
                bytenr: u64_at(b, at + 17)?,
                level: level - 1,
                generation: u64_at(b, at + 25)?,
            };
            children.push((key, child));
        }
        Ok(Layout::Node(children))
    }
}

fn check_order(where_: &str, i: usize, key: Key, prev: Option<Key>, first: Option<Key>) -> Result<()> {
    if let Some(p) = prev {
        ensure!(key > p, "{where_}: key {i} {key} not after {p}");
    } else if let Some(f) = first {
        ensure!(key == f, "{where_}: first key {key}, its parent says {f}");
    }
    Ok(())
}

/// Check meta.img (open, its sha256 already checked) against the manifest's fsid and
/// devid-1 uuid and the blockmap. Errors name the first problem.
pub fn check_meta(file: &File, fsid: &str, dev_uuids: [&str; 2], blockmap: &Blockmap) -> Result<MetaSummary> {
    let file_size = file.metadata().context("meta.img: stat")?.len();
    let mut sbb = vec![0u8; SUPER_SIZE];
    file.read_exact_at(&mut sbb, SUPER_OFFSET)
        .context("meta.img: read the superblock")?;
    let sb = parse_super(&sbb, "meta.img")?;
    ensure!(
        uuid_eq(&sb.fsid, fsid),
        "meta.img superblock: fsid {} but the manifest says {fsid}",
        uuid(&sb.fsid)
    );
    ensure!(
        sb.num_devices == 2,
        "meta.img superblock: {} devices, not 2",
        sb.num_devices
    );
    ensure!(
        sb.dev_item.devid == 1,
        "meta.img superblock: devid {}, not 1",
        sb.dev_item.devid
    );
    ensure!(
        sb.dev_item.fsid == sb.fsid,
        "meta.img superblock: its dev item's fsid is not the filesystem's"
    );
    ensure!(
        uuid_eq(&sb.dev_item.uuid, dev_uuids[0]),
        "meta.img superblock: device uuid {} but the manifest's devid 1 is {}",
        uuid(&sb.dev_item.uuid),
        dev_uuids[0]
    );
    let nodesize = sb.nodesize as u64;
    let mut m = Meta {
        file,
        file_size,
        sb: sb.clone(),
        chunks: ChunkMap::default(),
        visited: HashSet::new(),
        max_blocks: (file_size / nodesize) as usize,
    };
    // the system chunks, from the superblock
    let arr = sb.sys_chunk_array.clone();
    let mut at = 0;
    while at < arr.len() {
        let key = Key::parse(&arr, at).context("meta.img superblock: sys_chunk_array")?;
        ensure!(
            key.ty == CHUNK_ITEM_KEY,
            "meta.img superblock: sys_chunk_array key {key} is not a chunk"
        );
        let (c, size) = parse_chunk(key.offset, &arr[at + 17..]).context("meta.img superblock: sys_chunk_array")?;
        m.chunks.insert(c)?;
        at += 17 + size;
    }
    // the chunk tree
    let mut dev_items: Vec<DevItem> = Vec::new();
    let chunk_root = Root {
        bytenr: sb.chunk_root,
        level: sb.chunk_root_level,
        generation: sb.chunk_root_generation,
    };
    m.walk(chunk_root, CHUNK_TREE_OBJECTID, "chunk", &mut |m, key, data| {
        match key.ty {
            CHUNK_ITEM_KEY => {
                ensure!(
                    key.objectid == FIRST_CHUNK_TREE_OBJECTID,
                    "chunk item of objectid {}",
                    key.objectid
                );
                let (c, size) = parse_chunk(key.offset, data)?;
                ensure!(
                    size == data.len(),
                    "chunk item of {} bytes, its stripes make {size}",
                    data.len()
                );
                m.chunks.insert(c)?;
            }
            DEV_ITEM_KEY => {
                ensure!(
                    key.objectid == DEV_ITEMS_OBJECTID,
                    "dev item of objectid {}",
                    key.objectid
                );
                ensure!(data.len() == DEV_ITEM_SIZE, "dev item of {} bytes", data.len());
                let d = DevItem::parse(data)?;
                ensure!(
                    d.devid == key.offset,
                    "dev item {} under key offset {}",
                    d.devid,
                    key.offset
                );
                dev_items.push(d);
            }
            _ => {}
        }
        Ok(())
    })?;
    // every chunk: metadata only on devid 1, data single on devid 2 inside device 2
    for c in &m.chunks.0 {
        let where_ = format!("chunk tree: chunk at {} (+{}, type {:#x})", c.logical, c.length, c.ty);
        if c.ty & BG_DATA != 0 {
            ensure!(
                c.ty & (BG_METADATA | BG_SYSTEM) == 0,
                "{where_}: mixed data and metadata"
            );
            ensure!(
                c.ty & BG_PROFILES == 0 && c.stripes.len() == 1,
                "{where_}: not a single-profile chunk"
            );
            let (devid, phys) = c.stripes[0];
            ensure!(devid == 2, "{where_}: data on devid {devid}, not 2");
            ensure!(
                phys.checked_add(c.length).is_some_and(|e| e <= blockmap.device_size),
                "{where_}: physical {phys} past device 2's size {}",
                blockmap.device_size
            );
        } else {
            for &(devid, phys) in &c.stripes {
                ensure!(devid == 1, "{where_}: metadata on devid {devid}, not 1 (meta.img)");
                ensure!(
                    phys.checked_add(c.length).is_some_and(|e| e <= file_size),
                    "{where_}: physical {phys} past the end of meta.img ({file_size})"
                );
            }
        }
    }
    let dev_item = |id: u64| {
        dev_items
            .iter()
            .find(|d| d.devid == id)
            .cloned()
            .with_context(|| format!("chunk tree: no dev item for devid {id}"))
    };
    let dev1 = dev_item(1)?;
    let dev2 = dev_item(2)?;
    ensure!(
        dev1.uuid == sb.dev_item.uuid,
        "chunk tree: devid 1's uuid differs from the superblock's"
    );
    ensure!(
        uuid_eq(&dev2.uuid, dev_uuids[1]),
        "chunk tree: devid 2's uuid {} but the manifest says {}",
        uuid(&dev2.uuid),
        dev_uuids[1]
    );
    ensure!(
        dev2.total_bytes <= blockmap.device_size,
        "chunk tree: devid 2 has {} bytes, device 2 is {}",
        dev2.total_bytes,
        blockmap.device_size
    );
    // the root tree -> the fs tree's root
    let mut fs_root: Option<Root> = None;
    let root = Root {
        bytenr: sb.root,
        level: sb.root_level,
        generation: sb.generation,
    };
    m.walk(root, ROOT_TREE_OBJECTID, "root", &mut |_, key, data| {
        if key.objectid == FS_TREE_OBJECTID && key.ty == ROOT_ITEM_KEY {
            ensure!(data.len() >= 239, "root item of {} bytes", data.len());
            let level = u8_at(data, 238)?;
            ensure!(level <= MAX_LEVEL, "fs tree level {level}");
            fs_root = Some(Root {
                bytenr: u64_at(data, 176)?,
                level,
                generation: u64_at(data, 160)?,
            });
        }
        Ok(())
    })?;
    let fs_root = fs_root.context("root tree: no root item for the fs tree (5)")?;
    // the fs tree: every item (fs_tree.rs)
    let mut fs = FsTree::default();
    m.walk(fs_root, FS_TREE_OBJECTID, "fs", &mut |m, key, data| {
        fs.item(&m.chunks, blockmap, key, data)
    })?;
    fs.finish().context("fs tree")?;
    let tree_blocks = m.visited.len();
    Ok(MetaSummary {
        sb,
        dev2,
        extents: fs.extents,
        tree_blocks,
        overlay: fs.overlay,
    })
}

/// Device 2's superblock (4 KiB read at [`SUPER_OFFSET`] of device 2) against meta.img's.
pub fn check_dev2_super(b: &[u8], meta: &MetaSummary, device_size: u64) -> Result<()> {
    let s = parse_super(b, "device 2")?;
    ensure!(
        s.fsid == meta.sb.fsid,
        "device 2 superblock: fsid {} is not meta.img's {}",
        uuid(&s.fsid),
        uuid(&meta.sb.fsid)
    );
    ensure!(
        s.dev_item.devid == 2,
        "device 2 superblock: devid {}, not 2",
        s.dev_item.devid
    );
    ensure!(
        s.dev_item.fsid == s.fsid,
        "device 2 superblock: its dev item's fsid is not the filesystem's"
    );
    ensure!(
        s.generation == meta.sb.generation,
        "device 2 superblock: generation {} but meta.img's is {}",
        s.generation,
        meta.sb.generation
    );
    ensure!(
        s.dev_item.uuid == meta.dev2.uuid,
        "device 2 superblock: device uuid {} but meta.img's chunk tree says {}",
        uuid(&s.dev_item.uuid),
        uuid(&meta.dev2.uuid)
    );
    ensure!(
        s.dev_item.total_bytes == meta.dev2.total_bytes && s.dev_item.total_bytes <= device_size,
        "device 2 superblock: devid 2 has {} bytes, meta.img's chunk tree says {} (device 2 is {device_size})",
        s.dev_item.total_bytes,
        meta.dev2.total_bytes
    );
    ensure!(
        s.total_bytes == meta.sb.total_bytes,
        "device 2 superblock: total bytes {} but meta.img's {}",
        s.total_bytes,
        meta.sb.total_bytes
    );
    ensure!(
        s.num_devices == meta.sb.num_devices,
        "device 2 superblock: {} devices, meta.img's says {}",
        s.num_devices,
        meta.sb.num_devices
    );
    Ok(())
}

pub fn uuid(u: &[u8; 16]) -> String {
    let h = hex::encode(u);
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

fn uuid_eq(u: &[u8; 16], s: &str) -> bool {
    uuid(u).eq_ignore_ascii_case(s)
}

/// `btrfs check --readonly` of meta.img (the oracle): all metadata is on devid 1 and
/// data is NODATASUM, so it needs no device 2. `path` names the checked file (e.g. a
/// /proc/PID/fd link to the open meta.img).
pub fn btrfs_check(path: &std::path::Path) -> Result<()> {
    let out = std::process::Command::new("btrfs")
        // --force: another image of this fsid (a twin build) may be mounted; --readonly
        // never writes, and it reads this file, not the mounted devices
        .args(["check", "--readonly", "--force"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .context("btrfs check: could not run it (btrfs-progs installed?)")?;
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
        let first = text
            .lines()
            .find(|l| {
                let l = l.to_ascii_lowercase();
                l.contains("error") || l.contains("fail") || l.contains("bad") || l.contains("mismatch")
            })
            .or_else(|| text.lines().last())
            .unwrap_or("")
            .trim()
            .to_string();
        bail!("btrfs check --readonly failed ({}): {first}", out.status);
    }
    Ok(())
}

#[cfg(test)]
#[path = "structure_tests.rs"]
mod tests;
