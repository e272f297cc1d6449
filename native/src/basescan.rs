//! A base image's fs tree read for `build --base` (base.py): what the base's index and
//! layout need of every inode, without a Python object per inode. reader.py's
//! `BundleReader` (kept as the reference, and for bases whose packs are compressed) reads the
//! same items into an `Inode` object each; tests/test_basescan.py compares the two.
//!
//! Python reads and checks each tree block (`Filesystem.leaves`: checksum, bytenr, fsid,
//! level, owner, the pointers' order) and hands the fs tree's leaves here in key order
//! (`FsScan.add_leaf`). Here each leaf's items are checked as `Filesystem.items` checks them
//! and read as `Filesystem.inodes` reads them; `FsScan.index` then walks the names as
//! `BundleReader.walk` does, with `BundleReader.child`'s checks, and finds each regular
//! file's run of pack bytes (`BaseImage._run`) and its extents as the writer places a blob
//! (`BaseImage._placed`). Errors are `ImageError`s worded as the Python reader words them.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::fsitems::image_error;
use crate::leaves::{FILE_EXTENT_ITEM_SIZE, HEADER_SIZE, ITEM_SIZE};

const NRITEMS_AT: usize = 96;
const INODE_ITEM_SIZE: usize = 160;
const DIR_ITEM_SIZE: usize = 30;
const FILE_EXTENT_HEAD: usize = 21;
const FIRST_FREE_OBJECTID: u64 = 256;
const SECTORSIZE: u64 = 4096;

const INODE_ITEM_KEY: u8 = 1;
const INODE_REF_KEY: u8 = 12;
const INODE_EXTREF_KEY: u8 = 13;
const XATTR_ITEM_KEY: u8 = 24;
const DIR_INDEX_KEY: u8 = 96;
const EXTENT_DATA_KEY: u8 = 108;
const ROOT_ITEM_KEY: u8 = 132;

const FILE_EXTENT_INLINE: u8 = 0;
const FILE_EXTENT_REG: u8 = 1;
const FILE_EXTENT_PREALLOC: u8 = 2;
const COMPRESS_ZSTD: u8 = 3;

const S_IFMT: u32 = 0o170000;
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;

type Key = (u64, u8, u64);
/// (file offset, logical, disk bytes, device-2 offset): base.py's `Extents` row
type Placed = (u64, u64, u64, u64);

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}

/// The S_IFMT bits a dir entry's type names (reader.py `_FT_NAMES`).
fn ft_mode(ftype: u8) -> Option<u32> {
    Some(match ftype {
        1 => S_IFREG,
        2 => S_IFDIR,
        3 => 0o020000,
        4 => 0o060000,
        5 => 0o010000,
        6 => 0o140000,
        7 => 0o120000,
        _ => return None,
    })
}

struct Entry {
    index: u64,
    name: Box<[u8]>,
    ino: u64,
    ftype: u8,
}

struct Extent {
    file_offset: u64,
    kind: u8,
    compression: u8,
    disk_bytenr: u64,
    disk_num_bytes: u64,
    offset: u64,
    num_bytes: u64,
}

struct Node {
    ino: u64,
    mode: u32,
    size: u64,
    refs: Vec<(u64, u64, Box<[u8]>)>, // (parent, index, name)
    entries: Vec<Entry>,              // DIR_INDEX order
    extents: Vec<Extent>,
}

/// A DATA or METADATA chunk's mapping: (logical, length, devid, physical) of its first stripe.
type ChunkRow = (u64, u64, u64, u64);

/// `Filesystem.map_logical`: (chunk, devid, physical) of `len` bytes at `logical`, None when
/// they are not all in one chunk.
fn map_logical(chunks: &[ChunkRow], logical: u64, len: u64) -> Option<(ChunkRow, u64)> {
    let i = chunks.partition_point(|c| c.0 <= logical).checked_sub(1)?;
    let c = chunks[i];
    if logical.checked_add(len)? > c.0.saturating_add(c.1) {
        return None;
    }
    Some((c, c.3 + (logical - c.0)))
}

/// The blockmap's ranges as columns (blockmap.py `Ranges`), sorted by device offset.
struct Ranges {
    dev_offset: Vec<u64>,
    length: Vec<u64>,
    pack: Vec<u64>,
    pack_offset: Vec<u64>,
}

impl Ranges {
    /// `BlockMap.lookup`: the row holding device-2 byte `offset`.
    fn lookup(&self, offset: u64) -> Option<usize> {
        let i = self.dev_offset.partition_point(|&d| d <= offset).checked_sub(1)?;
        (offset < self.dev_offset[i].saturating_add(self.length[i])).then_some(i)
    }
}

/// The fs tree of a base, read leaf by leaf (module docs).
#[pyclass(module = "btrfs_ublk_native")]
pub struct FsScan {
    meta_path: String,
    nodesize: usize,
    nodes: Vec<Node>,
    by_ino: HashMap<u64, usize>,
}

impl FsScan {
    fn leaf_error(&self, py: Python<'_>, bytenr: u64, what: String) -> PyErr {
        image_error(py, format!("{}: fs tree block {bytenr}: {what}", self.meta_path))
    }

    fn tree_error(&self, py: Python<'_>, what: String) -> PyErr {
        image_error(py, format!("{}: fs tree: {what}", self.meta_path))
    }

    /// `_dir_items`: (location key, type, name, data) of each dir item packed in `data`.
    fn dir_items<'a>(&self, py: Python<'_>, data: &'a [u8]) -> PyResult<Vec<(Key, u8, &'a [u8])>> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < data.len() {
            if pos + DIR_ITEM_SIZE > data.len() {
                return Err(self.tree_error(py, "truncated dir item".into()));
            }
            let loc = (u64_at(data, pos), data[pos + 8], u64_at(data, pos + 9));
            let data_len = u16_at(data, pos + 25) as usize;
            let name_len = u16_at(data, pos + 27) as usize;
            let ftype = data[pos + 29];
            pos += DIR_ITEM_SIZE;
            if pos + name_len + data_len > data.len() {
                return Err(self.tree_error(py, "dir item name/data past the item's end".into()));
            }
            out.push((loc, ftype, &data[pos..pos + name_len]));
            pos += name_len + data_len;
        }
        Ok(out)
    }

    /// One item, as `Filesystem.inodes` reads it.
    fn item(&mut self, py: Python<'_>, (oid, kind, off): Key, data: &[u8]) -> PyResult<()> {
        if kind == INODE_ITEM_KEY {
            if data.len() < INODE_ITEM_SIZE {
                return Err(self.tree_error(py, format!("INODE_ITEM of {oid} is {} bytes", data.len())));
            }
            self.by_ino.insert(oid, self.nodes.len());
            self.nodes.push(Node {
                ino: oid,
                mode: u32_at(data, 52),
                size: u64_at(data, 16),
                refs: Vec::new(),
                entries: Vec::new(),
                extents: Vec::new(),
            });
            return Ok(());
        }
        let current = self.nodes.last().is_some_and(|n| n.ino == oid);
        if !current {
            if kind == ROOT_ITEM_KEY || oid < FIRST_FREE_OBJECTID {
                return Ok(()); // the fs tree's own items (none expected) and orphans
            }
            return Err(self.tree_error(py, format!("item ({oid}, {kind}, {off}) has no INODE_ITEM")));
        }
        let short = |s: &Self| s.tree_error(py, format!("item ({oid}, {kind}, {off}) is too short"));
        match kind {
            INODE_REF_KEY | INODE_EXTREF_KEY => {
                let head = if kind == INODE_REF_KEY { 10 } else { 18 };
                let mut refs = Vec::new();
                let mut pos = 0;
                while pos < data.len() {
                    if pos + head > data.len() {
                        return Err(short(self));
                    }
                    let (parent, index, n) = if kind == INODE_REF_KEY {
                        (off, u64_at(data, pos), u16_at(data, pos + 8) as usize)
                    } else {
                        (
                            u64_at(data, pos),
                            u64_at(data, pos + 8),
                            u16_at(data, pos + 16) as usize,
                        )
                    };
                    pos += head;
                    let name = &data[pos..(pos + n).min(data.len())];
                    refs.push((parent, index, Box::from(name)));
                    pos += n;
                }
                self.nodes.last_mut().unwrap().refs.extend(refs);
            }
            XATTR_ITEM_KEY => {
                self.dir_items(py, data)?; // checked; a base's xattrs are not indexed
            }
            DIR_INDEX_KEY => {
                let items = self.dir_items(py, data)?;
                if items.len() != 1 {
                    let n = items.len();
                    return Err(self.tree_error(py, format!("DIR_INDEX ({oid}, {off}) holds {n} names")));
                }
                let (loc, ftype, name) = items[0];
                if loc.1 != INODE_ITEM_KEY {
                    let name = PyBytes::new(py, name).repr()?;
                    return Err(self.tree_error(py, format!("{name} in {oid} is a subvolume (unsupported)")));
                }
                let entry = Entry {
                    index: off,
                    name: Box::from(name),
                    ino: loc.0,
                    ftype,
                };
                self.nodes.last_mut().unwrap().entries.push(entry);
            }
            EXTENT_DATA_KEY => {
                let extent = self.extent(py, off, data)?;
                self.nodes.last_mut().unwrap().extents.push(extent);
            }
            _ => {}
        }
        Ok(())
    }

    /// `_file_extent`.
    fn extent(&self, py: Python<'_>, file_offset: u64, data: &[u8]) -> PyResult<Extent> {
        if data.len() < FILE_EXTENT_HEAD {
            return Err(self.tree_error(py, format!("file extent at {file_offset} is too short")));
        }
        let (compression, encryption, kind) = (data[16], data[17], data[20]);
        if encryption != 0 {
            return Err(self.tree_error(py, "encrypted extent (unsupported)".into()));
        }
        if kind == FILE_EXTENT_INLINE {
            if compression != 0 {
                return Err(self.tree_error(py, "compressed inline extent (unsupported)".into()));
            }
            let n = (data.len() - FILE_EXTENT_HEAD) as u64;
            return Ok(Extent {
                file_offset,
                kind,
                compression: 0,
                disk_bytenr: 0,
                disk_num_bytes: 0,
                offset: 0,
                num_bytes: n,
            });
        }
        if kind != FILE_EXTENT_REG && kind != FILE_EXTENT_PREALLOC {
            return Err(self.tree_error(py, format!("unknown file extent type {kind}")));
        }
        if data.len() < FILE_EXTENT_ITEM_SIZE {
            return Err(self.tree_error(py, format!("file extent at {file_offset} is too short")));
        }
        if compression != 0 && compression != COMPRESS_ZSTD {
            let msg = format!("extent compression {compression} (only zstd is supported)");
            return Err(self.tree_error(py, msg));
        }
        Ok(Extent {
            file_offset,
            kind,
            compression,
            disk_bytenr: u64_at(data, 21),
            disk_num_bytes: u64_at(data, 29),
            offset: u64_at(data, 37),
            num_bytes: u64_at(data, 45),
        })
    }

    /// `BundleReader.child`: the inode `entry` of directory `parent` names, checked.
    fn child(&self, py: Python<'_>, parent: &Node, entry: &Entry) -> PyResult<&Node> {
        let name = || PyBytes::new(py, &entry.name).repr().map(|r| r.to_string());
        let Some(&i) = self.by_ino.get(&entry.ino) else {
            let (p, ino) = (parent.ino, entry.ino);
            return Err(self.tree_error(py, format!("{} in directory {p} -> missing inode {ino}", name()?)));
        };
        let child = &self.nodes[i];
        if ft_mode(entry.ftype) != Some(child.mode & S_IFMT) {
            let (ft, ino, mode) = (entry.ftype, entry.ino, child.mode);
            let msg = format!(
                "{}: dir entry type {ft} differs from inode {ino}'s mode {mode:o}",
                name()?
            );
            return Err(self.tree_error(py, msg));
        }
        let matching = |r: &(u64, u64, Box<[u8]>)| r.0 == parent.ino && r.1 == entry.index && *r.2 == *entry.name;
        if !child.refs.iter().any(matching) {
            let (p, ino) = (parent.ino, entry.ino);
            let msg = format!("{} in directory {p}: inode {ino} has no matching INODE_REF", name()?);
            return Err(self.tree_error(py, msg));
        }
        Ok(child)
    }

    /// `BundleReader.walk`'s inodes after the root, depth first, entries in DIR_INDEX order.
    fn walk(&self, py: Python<'_>, root: &Node, mut visit: impl FnMut(&Node)) -> PyResult<()> {
        let mut stack: Vec<(&Node, usize)> = vec![(root, 0)];
        let mut seen_dirs: HashSet<u64> = HashSet::from([root.ino]);
        while let Some((node, i)) = stack.pop() {
            let Some(entry) = node.entries.get(i) else {
                continue;
            };
            stack.push((node, i + 1));
            let child = self.child(py, node, entry)?;
            visit(child);
            if child.mode & S_IFMT == S_IFDIR {
                if !seen_dirs.insert(child.ino) {
                    // the path: each frame's entry before its next one
                    let mut path = Vec::new();
                    for (n, next) in &stack {
                        path.push(b'/');
                        path.extend_from_slice(&n.entries[next - 1].name);
                    }
                    let path = PyBytes::new(py, &path).repr()?;
                    return Err(image_error(py, format!("{}: directory loop at {path}", self.meta_path)));
                }
                stack.push((child, 0));
            }
        }
        Ok(())
    }
}

/// `BaseImage._run`: (base pack, offset) when the file's bytes are one run of one pack.
fn run(node: &Node, chunks: &[ChunkRow], ranges: &Ranges) -> Option<(u64, u64)> {
    let size = node.size;
    let mut pos = 0u64;
    let mut at: Option<(u64, u64)> = None; // the pack and offset of file byte `pos`
    let mut start: Option<(u64, u64)> = None;
    for ext in &node.extents {
        if ext.kind != FILE_EXTENT_REG || ext.disk_bytenr == 0 || ext.file_offset != pos || ext.compression != 0 {
            return None;
        }
        let length = ext.num_bytes.min(size - pos);
        let logical = ext.disk_bytenr.checked_add(ext.offset)?;
        let mut done = 0u64;
        while done < length {
            let here_logical = logical.checked_add(done)?;
            let (chunk, physical) = map_logical(chunks, here_logical, 1)?;
            if chunk.2 != 2 {
                return None;
            }
            let r = ranges.lookup(physical)?;
            let n = (length - done)
                .min(ranges.dev_offset[r].saturating_add(ranges.length[r]) - physical)
                .min(chunk.0.saturating_add(chunk.1) - here_logical);
            let here = (
                ranges.pack[r],
                ranges.pack_offset[r].checked_add(physical - ranges.dev_offset[r])?,
            );
            if at.is_some_and(|a| a != here) {
                return None;
            }
            start.get_or_insert(here);
            at = Some((here.0, here.1.checked_add(n)?));
            done += n;
        }
        pos += length;
        if pos >= size {
            break;
        }
    }
    if pos != size || size == 0 {
        return None;
    }
    start
}

/// `BaseImage._placed`: the file's extents as the writer places a blob, else None.
fn placed(node: &Node, chunks: &[ChunkRow]) -> Option<Vec<Placed>> {
    let (size, mut pos) = (node.size, 0u64);
    let mut out = Vec::new();
    for ext in &node.extents {
        let disk = ext.disk_num_bytes;
        if ext.kind != FILE_EXTENT_REG
            || ext.compression != 0
            || ext.offset != 0
            || ext.num_bytes != disk
            || ext.file_offset != pos
            || disk % SECTORSIZE != 0
            || pos >= size
        {
            return None;
        }
        let (chunk, physical) = map_logical(chunks, ext.disk_bytenr, disk)?;
        if chunk.2 != 2 {
            return None;
        }
        out.push((pos, ext.disk_bytenr, disk, physical));
        pos = pos.checked_add(disk)?;
    }
    (!out.is_empty() && size <= pos && pos < size.saturating_add(SECTORSIZE)).then_some(out)
}

/// What `FsScan.index` returns: the runs (pack, offset, size) and their extents as placed,
/// every directory's names, and the largest inode number.
/// (base.py's `Extents`: a tuple of rows, None where the content is placed anew)
type Index = (Vec<(u32, u64, u64)>, Vec<Option<Py<PyTuple>>>, Py<PyDict>, u64);

#[pymethods]
impl FsScan {
    #[new]
    fn new(meta_path: String, nodesize: usize) -> Self {
        FsScan {
            meta_path,
            nodesize,
            nodes: Vec::new(),
            by_ino: HashMap::new(),
        }
    }

    /// One leaf of the fs tree (after the ones before it in key order), read at `bytenr`,
    /// whose parent's pointer names `first` (None: the root is this leaf).
    fn add_leaf(&mut self, py: Python<'_>, block: &[u8], bytenr: u64, first: Option<Key>) -> PyResult<()> {
        let nodesize = self.nodesize.min(block.len());
        if nodesize < HEADER_SIZE {
            return Err(self.leaf_error(py, bytenr, format!("{} bytes, no header", block.len())));
        }
        let nritems = u32_at(block, NRITEMS_AT) as usize;
        if HEADER_SIZE + nritems * ITEM_SIZE > nodesize {
            return Err(self.leaf_error(py, bytenr, format!("{nritems} items do not fit")));
        }
        let mut prev: Option<Key> = None;
        for i in 0..nritems {
            let at = HEADER_SIZE + i * ITEM_SIZE;
            let key = (u64_at(block, at), block[at + 8], u64_at(block, at + 9));
            let (doff, size) = (u32_at(block, at + 17) as usize, u32_at(block, at + 21) as usize);
            if prev.is_some_and(|p| key <= p) {
                return Err(self.leaf_error(py, bytenr, format!("item {i}: keys out of order")));
            }
            if i == 0 && first.is_some_and(|f| f != key) {
                let msg = "first key differs from its parent's pointer".to_string();
                return Err(self.leaf_error(py, bytenr, msg));
            }
            let start = HEADER_SIZE + doff;
            if start + size > nodesize {
                return Err(self.leaf_error(py, bytenr, format!("item {i}: data outside the block")));
            }
            prev = Some(key);
            self.item(py, key, &block[start..start + size])?;
        }
        Ok(())
    }

    /// The base's index and layout inputs (base.py `_index`, `_make_layout`), from its root
    /// directory `root_dirid`: every regular file whose bytes are one run of one pack, in
    /// walk order, once per inode, its pack numbered from `first`; `chunks` as
    /// (logical, length, devid, physical) sorted by logical; the blockmap's ranges as columns.
    #[allow(clippy::too_many_arguments)]
    fn index(
        &self,
        py: Python<'_>,
        root_dirid: u64,
        chunks: Vec<ChunkRow>,
        dev_offset: Vec<u64>,
        length: Vec<u64>,
        pack: Vec<u64>,
        pack_offset: Vec<u64>,
        first: u32,
    ) -> PyResult<Index> {
        let root = match self.by_ino.get(&root_dirid) {
            Some(&i) if self.nodes[i].mode & S_IFMT == S_IFDIR => &self.nodes[i],
            _ => {
                return Err(image_error(
                    py,
                    format!("{}: fs tree has no root directory", self.meta_path),
                ))
            }
        };
        let ranges = Ranges {
            dev_offset,
            length,
            pack,
            pack_offset,
        };
        let mut seen: HashSet<u64> = HashSet::new();
        let (mut runs, mut places) = (Vec::new(), Vec::new());
        self.walk(py, root, |node| {
            if node.mode & S_IFMT != S_IFREG || !seen.insert(node.ino) {
                return;
            }
            if let Some((p, offset)) = run(node, &chunks, &ranges) {
                runs.push((p as u32 + first, offset, node.size));
                places.push(placed(node, &chunks));
            }
        })?;
        let dirs = PyDict::new(py);
        for node in self.nodes.iter().filter(|n| n.mode & S_IFMT == S_IFDIR) {
            let names = PyDict::new(py);
            for e in &node.entries {
                names.set_item(PyBytes::new(py, &e.name), (e.ino, e.index))?;
            }
            dirs.set_item(node.ino, names)?;
        }
        let max_ino = self.nodes.iter().map(|n| n.ino).max().unwrap_or(0);
        let places = places
            .into_iter()
            .map(|p| p.map(|rows| PyTuple::new(py, rows).map(Bound::unbind)).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        Ok((runs, places, dirs.unbind(), max_ino))
    }
}
