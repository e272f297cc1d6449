//! The extent tree's data extent items (`extenttree.DataExtentItems`, kept as the reference and
//! for `BUI_NATIVE=0`) made and packed here: an EXTENT_ITEM per data extent with its file
//! extent refs inline (by descending hash) while they fit, else keyed EXTENT_DATA_REF items,
//! merged in key order with the tree's other items (block groups, tree blocks) into leaves
//! (leaves.rs). No Python object per extent: the placer's and the fs tree's columns are
//! read once, the leaves handed back whole.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::blocks::LeafBlocks;
use crate::leaves::{raw_crc32c, Key, Packer, Split};

const EXTENT_ITEM_KEY: u8 = 168;
const EXTENT_DATA_REF_KEY: u8 = 178;
const EXTENT_FLAG_DATA: u64 = 1;
const FS_TREE_OBJECTID: u64 = 5;
/// an EXTENT_ITEM with one flags word, an inline data ref, a keyed one (`writer._*_SIZE`)
const EXTENT_HEAD_SIZE: usize = 24;
const INLINE_DATA_REF_SIZE: usize = 29;
const DATA_REF_SIZE: usize = 28;
/// `ondisk.MAX_EXTENT_ITEM_SIZE`: BTRFS_LEAF_DATA_SIZE / 16 less an item header
const MAX_EXTENT_ITEM_SIZE: usize = (crate::leaves::LEAF_DATA_SIZE >> 4) - crate::leaves::ITEM_SIZE;
/// refs an EXTENT_ITEM holds inline (`writer._INLINE_ROOM`)
const INLINE_ROOM: usize = (MAX_EXTENT_ITEM_SIZE - EXTENT_HEAD_SIZE) / INLINE_DATA_REF_SIZE;

/// `hash_extent_data_ref` (`ondisk.extent_data_ref_hash`): a keyed EXTENT_DATA_REF's key
/// offset, and the order of inline ones.
pub fn extent_data_ref_hash(root: u64, owner: u64, offset: u64) -> u64 {
    let high = raw_crc32c(u32::MAX, &root.to_le_bytes()) as u64;
    let low = raw_crc32c(u32::MAX, &owner.to_le_bytes());
    let low = raw_crc32c(low, &offset.to_le_bytes()) as u64;
    (high << 31) ^ low
}

/// struct btrfs_extent_data_ref: root, objectid (the inode), offset (file offset the extent
/// is mapped at), count.
fn data_ref(out: &mut Vec<u8>, ino: u64, offset: u64) {
    out.extend_from_slice(&FS_TREE_OBJECTID.to_le_bytes());
    out.extend_from_slice(&ino.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
}

/// The values of a u64 `array` (copied: the caller may drop or change it after).
fn column(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    if obj.len()? == 0 {
        return Ok(Vec::new()); // an empty array's buffer need not be aligned
    }
    let buf: PyBuffer<u64> = PyBuffer::get(obj).map_err(|e| PyTypeError::new_err(format!("{name}: {e}")))?;
    buf.to_vec(obj.py())
}

/// `extenttree.DataExtentItems` natively: the data extents (logical, disk bytes; in logical
/// order, `order` when given) and their file extent refs grouped by extent.
#[pyclass(unsendable)]
pub struct DataExtents {
    logical: Vec<u64>,
    disk_bytes: Vec<u64>,
    order: Option<Vec<u64>>,
    generation: u64,
    /// extent `e`'s refs are `ino[start[e]..start[e + 1]]` (inode) and `offset[..]`
    start: Vec<u64>,
    ino: Vec<u64>,
    offset: Vec<u64>,
}

/// An item's data in the merged stream: another item's (borrowed) or a data extent's (made).
enum Item<'a> {
    Other(&'a [u8]),
    Data(Vec<u8>),
}

impl DataExtents {
    fn extents(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.logical.len();
        let (ordered, plain) = match &self.order {
            Some(o) => (Some(o.iter().map(|&e| e as usize)), None),
            None => (None, Some(0..n)),
        };
        ordered.into_iter().flatten().chain(plain.into_iter().flatten())
    }

    /// Every item of extent `e` (`DataExtentItems.items`) to `emit(key, size, data)`, in key
    /// order; with `sizes_only` no data is made and keyed refs get a stand-in offset of 0
    /// (`DataExtentItems.sizes`).
    fn items_of(
        &self,
        e: usize,
        sizes_only: bool,
        emit: &mut dyn FnMut(Key, usize, Option<Vec<u8>>) -> PyResult<()>,
    ) -> PyResult<()> {
        let logical = self.logical[e];
        let (lo, hi) = (self.start[e] as usize, self.start[e + 1] as usize);
        let nrefs = hi - lo;
        let key = (logical, EXTENT_ITEM_KEY, self.disk_bytes[e]);
        let inline = nrefs <= INLINE_ROOM;
        if sizes_only {
            if inline {
                return emit(key, EXTENT_HEAD_SIZE + nrefs * INLINE_DATA_REF_SIZE, None);
            }
            emit(key, EXTENT_HEAD_SIZE, None)?;
            for _ in 0..nrefs {
                emit((logical, EXTENT_DATA_REF_KEY, 0), DATA_REF_SIZE, None)?;
            }
            return Ok(());
        }
        let mut head = Vec::with_capacity(EXTENT_HEAD_SIZE + if inline { nrefs * INLINE_DATA_REF_SIZE } else { 0 });
        head.extend_from_slice(&(nrefs as u64).to_le_bytes());
        head.extend_from_slice(&self.generation.to_le_bytes());
        head.extend_from_slice(&EXTENT_FLAG_DATA.to_le_bytes());
        let refs = (lo..hi).map(|r| (self.ino[r], self.offset[r]));
        if nrefs == 1 {
            // nearly every extent: one inline ref, no order to sort out
            for (ino, off) in refs {
                head.push(EXTENT_DATA_REF_KEY);
                data_ref(&mut head, ino, off);
            }
            return emit(key, head.len(), Some(head));
        }
        let mut hashed: Vec<(u64, u64, u64)> = refs
            .map(|(ino, off)| (extent_data_ref_hash(FS_TREE_OBJECTID, ino, off), ino, off))
            .collect();
        if inline {
            hashed.sort_unstable_by(|a, b| b.cmp(a)); // inline data refs: descending hash (tree-checker)
            for &(_, ino, off) in &hashed {
                head.push(EXTENT_DATA_REF_KEY);
                data_ref(&mut head, ino, off);
            }
            return emit(key, head.len(), Some(head));
        }
        emit(key, head.len(), Some(head))?;
        hashed.sort_unstable();
        let mut used = std::collections::HashSet::with_capacity(nrefs);
        let mut keyed: Vec<(u64, u64, u64)> = Vec::with_capacity(nrefs);
        for (h, ino, off) in hashed {
            let mut h = h;
            while !used.insert(h) {
                h = h.wrapping_add(1); // a hash collision takes the next free offset, as the kernel does
            }
            keyed.push((h, ino, off));
        }
        keyed.sort_unstable();
        for (h, ino, off) in keyed {
            let mut data = Vec::with_capacity(DATA_REF_SIZE);
            data_ref(&mut data, ino, off);
            emit((logical, EXTENT_DATA_REF_KEY, h), DATA_REF_SIZE, Some(data))?;
        }
        Ok(())
    }

    /// The data extents' items merged with `others` (sorted; on equal keys the data extent's
    /// first, as `heapq.merge` gives them), to `sink(key, size, data)` in key order.
    fn merged<'a>(
        &self,
        others: &'a [(Key, usize, Option<&'a [u8]>)],
        sizes_only: bool,
        sink: &mut dyn FnMut(Key, usize, Item<'a>) -> PyResult<()>,
    ) -> PyResult<()> {
        let mut rest = others.iter().peekable();
        for e in self.extents() {
            if e >= self.logical.len() {
                return Err(PyValueError::new_err(format!(
                    "data extent order names row {e} of {}",
                    self.logical.len()
                )));
            }
            let mut emit = |key: Key, size: usize, data: Option<Vec<u8>>| -> PyResult<()> {
                while let Some(&&(k, s, d)) = rest.peek() {
                    if k >= key {
                        break;
                    }
                    sink(k, s, Item::Other(d.unwrap_or(&[])))?;
                    rest.next();
                }
                sink(key, size, Item::Data(data.unwrap_or_default()))
            };
            self.items_of(e, sizes_only, &mut emit)?;
        }
        for &(k, s, d) in rest {
            sink(k, s, Item::Other(d.unwrap_or(&[])))?;
        }
        Ok(())
    }
}

#[pymethods]
impl DataExtents {
    /// `logical`, `disk_bytes`: the placer's columns (one row per data extent); `order`: the
    /// rows in logical order (None: as they are); `refs`: the fs tree's file extent refs
    /// (extent row, inode, file offset), three u64 arrays of one row per ref.
    #[new]
    fn new(
        logical: &Bound<'_, PyAny>,
        disk_bytes: &Bound<'_, PyAny>,
        order: Option<&Bound<'_, PyAny>>,
        refs: (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>),
        generation: u64,
    ) -> PyResult<Self> {
        let logical = column(logical, "logical")?;
        let disk_bytes = column(disk_bytes, "disk_bytes")?;
        let n = logical.len();
        if disk_bytes.len() != n {
            return Err(PyValueError::new_err("data extent columns differ in length"));
        }
        let order = order.map(|o| column(o, "order")).transpose()?;
        if order.as_ref().is_some_and(|o| o.len() != n) {
            return Err(PyValueError::new_err(
                "data extent order differs in length from its columns",
            ));
        }
        let (ref_extent, ref_ino, ref_offset) = (
            column(&refs.0, "ref_extent")?,
            column(&refs.1, "ref_ino")?,
            column(&refs.2, "ref_offset")?,
        );
        if ref_ino.len() != ref_extent.len() || ref_offset.len() != ref_extent.len() {
            return Err(PyValueError::new_err("file extent ref columns differ in length"));
        }
        // refs grouped by extent, in the order they came (a counting sort)
        let mut start = vec![0u64; n + 1];
        for &e in &ref_extent {
            let slot = start
                .get_mut(e as usize + 1)
                .ok_or_else(|| PyValueError::new_err(format!("file extent ref to extent {e} of {n}")))?;
            *slot += 1;
        }
        for e in 0..n {
            start[e + 1] += start[e];
        }
        let mut fill = start[..n].to_vec();
        let mut ino = vec![0u64; ref_extent.len()];
        let mut offset = vec![0u64; ref_extent.len()];
        for ((&e, &i), &o) in ref_extent.iter().zip(&ref_ino).zip(&ref_offset) {
            let at = &mut fill[e as usize];
            ino[*at as usize] = i;
            offset[*at as usize] = o;
            *at += 1;
        }
        Ok(DataExtents {
            logical,
            disk_bytes,
            order,
            generation,
            start,
            ino,
            offset,
        })
    }

    /// The first key of each leaf of the extent tree: these items (sizes only, keyed refs at
    /// a stand-in offset, as `DataExtentItems.sizes`) merged with `others` ((key, item size),
    /// sorted), split as `treeblocks.split_leaves` does with `breaks`.
    #[pyo3(signature = (others, breaks=Vec::new()))]
    fn leaf_firsts(&self, others: Vec<(Key, usize)>, breaks: Vec<Key>) -> PyResult<Vec<Key>> {
        let others: Vec<(Key, usize, Option<&[u8]>)> = others.into_iter().map(|(k, s)| (k, s, None)).collect();
        let mut split = Split::new(breaks);
        let mut firsts = Vec::new();
        let mut first: Option<Key> = None;
        self.merged(&others, true, &mut |key, size, _| {
            if split.starts_leaf(first, key, size).map_err(crate::add_err)? {
                firsts.extend(first);
                first = Some(key);
            }
            Ok(())
        })?;
        firsts.push(first.unwrap_or((0, 0, 0))); // an empty tree is one empty leaf
        Ok(firsts)
    }

    /// The extent tree's leaf blocks: these items merged with `others` ((key, data), sorted),
    /// packed as `treeblocks.iter_leaves` does with `breaks` and written to meta.img as
    /// blocks.rs does (`out_fd`, `places`, ...: `write_spilled_leaves`' arguments). Returns
    /// each leaf's first key.
    #[pyo3(signature = (others, breaks, out_fd, places, owner, generation, fsid, chunk_tree_uuid))]
    #[allow(clippy::too_many_arguments)]
    fn write_leaves(
        &self,
        others: Vec<(Key, Bound<'_, PyBytes>)>,
        breaks: Vec<Key>,
        out_fd: i32,
        places: Vec<(u64, u64)>,
        owner: u64,
        generation: u64,
        fsid: [u8; 16],
        chunk_tree_uuid: [u8; 16],
    ) -> PyResult<Vec<Key>> {
        let others: Vec<(Key, usize, Option<&[u8]>)> = others
            .iter()
            .map(|(k, d)| (*k, d.as_bytes().len(), Some(d.as_bytes())))
            .collect();
        let mut packer = Packer::new(None, false, breaks);
        let mut blocks = LeafBlocks::new(out_fd, places, owner, generation, fsid, chunk_tree_uuid);
        let mut firsts = Vec::new();
        let mut written = |packer: &mut Packer| -> PyResult<()> {
            // each leaf as soon as it is full: the tree's leaves never sit in memory together
            for leaf in packer.leaves.drain(..) {
                firsts.push(leaf.first_key);
                blocks
                    .put(leaf.payload.as_deref().unwrap_or(&[]), leaf.nritems)
                    .map_err(crate::os_err)?;
            }
            Ok(())
        };
        self.merged(&others, false, &mut |key, _, item| {
            let data: &[u8] = match &item {
                Item::Other(d) => d,
                Item::Data(d) => d,
            };
            packer.add(key, data).map_err(crate::add_err)?;
            written(&mut packer)
        })?;
        packer.finish().map_err(crate::os_err)?;
        written(&mut packer)?;
        blocks.flush().map_err(crate::os_err)?;
        Ok(firsts)
    }
}

/// `DataPlacer.block_groups`: the free ranges (logical, length) of each DATA chunk (given
/// as (logical, end), in logical order) around the data extents in it (`logical`,
/// `disk_bytes`, in logical order by `order` when given): the gaps between its extents and
/// its tail. An AssertionError names an extent in no chunk.
#[pyfunction]
#[pyo3(signature = (logical, disk_bytes, order, chunks))]
pub fn data_free_ranges(
    logical: &Bound<'_, PyAny>,
    disk_bytes: &Bound<'_, PyAny>,
    order: Option<&Bound<'_, PyAny>>,
    chunks: Vec<(u64, u64)>,
) -> PyResult<Vec<Vec<(u64, u64)>>> {
    let logical = column(logical, "logical")?;
    let disk_bytes = column(disk_bytes, "disk_bytes")?;
    let order = order.map(|o| column(o, "order")).transpose()?;
    let n = logical.len();
    if disk_bytes.len() != n || order.as_ref().is_some_and(|o| o.len() != n) {
        return Err(PyValueError::new_err("data extent columns differ in length"));
    }
    let row = |i: usize| -> PyResult<usize> {
        let r = order.as_ref().map_or(i, |o| o[i] as usize);
        (r < n)
            .then_some(r)
            .ok_or_else(|| PyValueError::new_err(format!("data extent order names row {r} of {n}")))
    };
    let mut out = Vec::with_capacity(chunks.len());
    let mut i = 0;
    for (start, end) in chunks {
        // `free_ranges`: the gaps before, between and after the extents taken in the chunk
        let mut free = Vec::new();
        let mut at = start;
        while i < n {
            let r = row(i)?;
            if logical[r] >= end {
                break;
            }
            if logical[r] > at {
                free.push((at, logical[r] - at));
            }
            at = at.max(logical[r] + disk_bytes[r]);
            i += 1;
        }
        if at < end {
            free.push((at, end - at));
        }
        out.push(free);
    }
    if i < n {
        return Err(pyo3::exceptions::PyAssertionError::new_err(format!(
            "data extent at logical {} is in no chunk",
            logical[row(i)?]
        )));
    }
    Ok(out)
}
