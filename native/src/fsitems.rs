//! The writer's per-inode loop (`fstree.fs_tree_items`, kept as the reference and for
//! `BUI_NATIVE=0`) in one call: every inode's INODE_ITEM, INODE_REF/EXTREF, XATTR_ITEM,
//! DIR_ITEM, DIR_INDEX and EXTENT_DATA items, packed as they are made (leaves.rs). The
//! inodes (inode.rs) are read through a borrow (no Python code runs per inode), set-aside
//! small files are read back from their file in large reads while they come in order, and
//! a build without a base or btrfs-zstd places its data extents here too (`DataPlacer.place`
//! for the others). Same items, errors and messages as the Python loop.

use std::collections::HashMap;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyAssertionError, PyOSError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyRange};

use crate::entries::Entries;
use crate::inode::{self, BlobFields, Payload, Times, S_IFBLK, S_IFCHR, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG};
use crate::leaves::{self, InodeFields, Packer};
use crate::numbering::{Names, Rows};

const S_IFIFO: u32 = 0o010000;
const S_IFSOCK: u32 = 0o140000;

const FIRST_FREE_OBJECTID: u64 = 256;
const INODE_REF_KEY: u8 = 12;
const INODE_EXTREF_KEY: u8 = 13;
const XATTR_ITEM_KEY: u8 = 24;
const EXTENT_DATA_KEY: u8 = 108;
const FT_XATTR: u8 = 8;
const MAX_INLINE: usize = 4095; // writer.MAX_INLINE: sectorsize - 1
const LINK_MAX: usize = 65535;
/// `ondisk.MAX_XATTR_SIZE`: a leaf's data less one item header and a dir item
const MAX_XATTR_SIZE: usize = leaves::MAX_ITEM_DATA - 30;

const SECTORSIZE: u64 = 4096;
const MAX_EXTENT_SIZE: u64 = 128 << 20;
const CHUNK_ALIGN: u64 = 1 << 20;
const MAX_CHUNK_SIZE: u64 = 1 << 30;
const SUPER_MIRRORS: [u64; 3] = [64 << 10, 64 << 20, 256 << 30];
/// a set-aside file is read this much at a time while its contents are asked for in order
const ASIDE_WINDOW: usize = 1 << 20;

fn ftype_of(mode_type: u32) -> u8 {
    match mode_type {
        S_IFREG => 1,
        S_IFDIR => 2,
        S_IFCHR => 3,
        S_IFBLK => 4,
        S_IFIFO => 5,
        S_IFSOCK => 6,
        S_IFLNK => 7,
        _ => 0,
    }
}

pub(crate) fn image_error(py: Python<'_>, msg: String) -> PyErr {
    match py
        .import("btrfs_ublk_image.errors")
        .and_then(|m| m.getattr("ImageError"))
    {
        Ok(cls) => PyErr::from_value(match cls.call1((msg,)) {
            Ok(e) => e,
            Err(e) => return e,
        }),
        Err(e) => e,
    }
}

/// `layout.device_ranges`: the physical ranges a chunk may occupy, <= 1 GiB, never over a
/// superblock mirror (the whole MiB holding one is skipped).
struct DeviceRanges {
    cur: u64,
}

impl DeviceRanges {
    fn next_range(&mut self) -> (u64, u64) {
        loop {
            let cur = self.cur;
            let nxt = SUPER_MIRRORS.iter().copied().find(|&m| m >= cur);
            let limit = match nxt {
                None => cur + MAX_CHUNK_SIZE,
                Some(m) => (cur + MAX_CHUNK_SIZE).min(m),
            };
            let out = (limit > cur).then_some((cur, limit));
            if out.is_some() {
                self.cur = limit;
            }
            if nxt == Some(self.cur) {
                self.cur += CHUNK_ALIGN;
            }
            if let Some(r) = out {
                return r;
            }
        }
    }
}

/// Values appended to a Python `array("Q")` column a batch at a time: the column holds
/// them, with no second copy of it made here.
pub(crate) struct ColumnSink<'py> {
    array: Bound<'py, PyAny>,
    pending: Vec<u64>,
    flushed: usize, // values already in the array (from this call)
    base: usize,    // values the array held before
}

/// rows appended to a column per `array.frombytes` call
const SINK_BATCH: usize = 8192;

impl<'py> ColumnSink<'py> {
    pub(crate) fn new(array: Bound<'py, PyAny>) -> PyResult<Self> {
        let base = array.len()?;
        Ok(ColumnSink {
            array,
            pending: Vec::with_capacity(SINK_BATCH),
            flushed: 0,
            base,
        })
    }

    pub(crate) fn push(&mut self, v: u64) -> PyResult<()> {
        self.pending.push(v);
        if self.pending.len() >= SINK_BATCH {
            self.flush()?;
        }
        Ok(())
    }

    pub(crate) fn flush(&mut self) -> PyResult<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let raw = PyBytes::new_with(self.array.py(), self.pending.len() * 8, |b| {
            for (chunk, v) in b.chunks_exact_mut(8).zip(&self.pending) {
                chunk.copy_from_slice(&v.to_ne_bytes());
            }
            Ok(())
        })?;
        self.array.call_method1(intern!(self.array.py(), "frombytes"), (raw,))?;
        self.flushed += self.pending.len();
        self.pending.clear();
        Ok(())
    }

    /// Value `i` of those pushed in this call.
    fn get(&self, i: usize) -> PyResult<u64> {
        if i >= self.flushed {
            return Ok(self.pending[i - self.flushed]);
        }
        let buf: PyBuffer<u64> = PyBuffer::get(&self.array)?;
        let ptr = buf
            .as_slice_ptr()
            .ok_or_else(|| PyTypeError::new_err("placer column is not contiguous"))?;
        // SAFETY: the buffer is held (the array can neither resize nor go) while the value
        // is read, and no Python code runs meanwhile
        let all = unsafe { ptr.as_ref() };
        all.get(self.base + i)
            .copied()
            .ok_or_else(|| PyAssertionError::new_err(format!("column row {i} out of range")))
    }
}

/// `DataPlacer.place` for a fresh placer without a base or encoded extents: extents in
/// first-use order, chunk after chunk, appended to the placer's columns; its state goes
/// back to it at the end.
struct Placer<'py> {
    // logical, disk bytes, file offset, device offset, length, pack, pack offset
    cols: [ColumnSink<'py>; 7],
    rows: usize,
    chunks: Vec<(u64, u64, u64)>, // closed chunks: logical, length, physical
    ranges: DeviceRanges,
    next_logical: u64,
    cur: u64,
    end: u64,
    chunk_phys: u64,
    chunk_logical: u64,
    used: u64,
    /// a Blob -> its first row and number of rows
    first: HashMap<BlobFields, (u32, u32)>,
}

const LOGICAL: usize = 0;
const DISK_BYTES: usize = 1;
const FILE_OFFSET: usize = 2;
const PLACER_COLUMNS: [&str; 7] = [
    "logical",
    "disk_bytes",
    "file_offset",
    "dev_offset",
    "length",
    "pack",
    "pack_offset",
];

impl<'py> Placer<'py> {
    fn new(placer: &Bound<'py, PyAny>, start: u64) -> PyResult<Self> {
        let col = |name: &str| ColumnSink::new(placer.getattr(name)?);
        Ok(Placer {
            cols: [
                col(PLACER_COLUMNS[0])?,
                col(PLACER_COLUMNS[1])?,
                col(PLACER_COLUMNS[2])?,
                col(PLACER_COLUMNS[3])?,
                col(PLACER_COLUMNS[4])?,
                col(PLACER_COLUMNS[5])?,
                col(PLACER_COLUMNS[6])?,
            ],
            rows: 0,
            chunks: Vec::new(),
            ranges: DeviceRanges { cur: start },
            next_logical: placer.getattr("_logical")?.extract()?,
            cur: 0,
            end: 0,
            chunk_phys: 0,
            chunk_logical: 0,
            used: 0,
            first: HashMap::new(),
        })
    }

    fn next_chunk(&mut self) {
        self.close_chunk();
        let (phys, end) = self.ranges.next_range();
        self.chunk_phys = phys;
        self.end = end;
        self.cur = phys;
        self.chunk_logical = self.next_logical;
    }

    fn close_chunk(&mut self) {
        if self.end != 0 {
            let length = (self.cur - self.chunk_phys).div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
            if length != 0 {
                self.chunks.push((self.chunk_logical, length, self.chunk_phys));
                self.next_logical += length;
            }
        }
    }

    /// The rows of a blob's extents (`size` bytes at `offset` of pack `pack`).
    fn place(&mut self, key: BlobFields) -> PyResult<std::ops::Range<usize>> {
        let (size, pack, offset) = (key.size, key.pack as u64, key.offset);
        if let Some(&(first, n)) = self.first.get(&key) {
            return Ok(first as usize..(first + n) as usize);
        }
        if size == 0 {
            return Ok(0..0);
        }
        let first = self.rows;
        let mut done = 0;
        while done < size {
            if self.cur >= self.end {
                self.next_chunk();
            }
            let disk = (size - done)
                .div_ceil(SECTORSIZE)
                .saturating_mul(SECTORSIZE)
                .min(MAX_EXTENT_SIZE)
                .min(self.end - self.cur);
            let length = disk.min(size - done);
            let row = [
                self.chunk_logical + (self.cur - self.chunk_phys),
                disk,
                done,
                self.cur,
                length,
                pack,
                offset + done,
            ];
            for (col, v) in self.cols.iter_mut().zip(row) {
                col.push(v)?;
            }
            self.rows += 1;
            self.cur += disk;
            self.used += disk;
            done += length;
        }
        let rows = u32::try_from(self.rows).map_err(|_| PyAssertionError::new_err("too many data extents"))?;
        self.first.insert(key, (first as u32, rows - first as u32));
        Ok(first..self.rows)
    }
}

/// A Blob's fields (`inode::blob_fields`), its offset in 64 bits.
fn blob_fields(blob: &Bound<'_, PyAny>) -> PyResult<BlobFields> {
    inode::blob_fields(blob)?.ok_or_else(|| pyo3::exceptions::PyOverflowError::new_err("blob offset out of range"))
}

/// A blob as an inode holds it: its fields, or a `tree.Blob` (a Sparse's segments).
enum BlobRef<'a, 'py> {
    Fields(BlobFields),
    Obj(&'a Bound<'py, PyAny>),
}

/// An inode's payload, held while its items are made.
enum Held<'py> {
    Obj(Bound<'py, PyAny>),
    Blob(BlobFields),
    Aside(Bound<'py, PyAny>, u64, u64),
    Cleared,
}

/// One row of the placer's columns: logical, disk bytes, file offset, ram bytes, compression.
type Row = (u64, u64, u64, u64, u8);

/// Where the extents' rows come from: the native placer, or `DataPlacer.place` (a base's
/// extents, btrfs-zstd) with its columns read after each call.
enum Placement<'py> {
    Native(Box<Placer<'py>>),
    Python {
        place: Bound<'py, PyAny>,
        placer: Bound<'py, PyAny>,
    },
}

/// Rows `start..stop` of one of the placer's `array` columns.
fn read_rows<T: pyo3::buffer::Element + Copy>(
    placer: &Bound<'_, PyAny>,
    name: &str,
    start: usize,
    stop: usize,
) -> PyResult<Vec<T>> {
    let buf: PyBuffer<T> = PyBuffer::get(&placer.getattr(name)?)?;
    let ptr = buf
        .as_slice_ptr()
        .ok_or_else(|| PyTypeError::new_err(format!("placer column {name} is not contiguous")))?;
    // SAFETY: the buffer is held (the array cannot resize or go) and no Python code runs
    // while the rows are copied out
    let all = unsafe { ptr.as_ref() };
    let rows = all
        .get(start..stop)
        .ok_or_else(|| PyAssertionError::new_err(format!("placer rows {start}..{stop} outside column {name}")))?;
    Ok(rows.to_vec())
}

impl Placement<'_> {
    fn rows(
        &mut self,
        py: Python<'_>,
        blob: BlobRef<'_, '_>,
        encoded: bool,
        out: &mut Vec<(usize, Row)>,
    ) -> PyResult<()> {
        out.clear();
        match self {
            Placement::Native(p) => {
                let key = match blob {
                    BlobRef::Fields(f) => f,
                    BlobRef::Obj(b) => blob_fields(b)?,
                };
                for row in p.place(key)? {
                    let c = &p.cols;
                    out.push((
                        row,
                        (
                            c[LOGICAL].get(row)?,
                            c[DISK_BYTES].get(row)?,
                            c[FILE_OFFSET].get(row)?,
                            0,
                            0,
                        ),
                    ));
                }
            }
            Placement::Python { place, placer } => {
                let rows = match blob {
                    BlobRef::Fields(f) => place.call1((inode::blob_object(py, f)?,))?,
                    BlobRef::Obj(b) => place.call1((b,))?,
                };
                let rows = rows.cast::<PyRange>()?;
                let start: usize = rows.getattr(intern!(rows.py(), "start"))?.extract()?;
                let stop: usize = rows.getattr(intern!(rows.py(), "stop"))?.extract()?;
                if start == stop {
                    return Ok(());
                }
                let logical: Vec<u64> = read_rows(placer, "logical", start, stop)?;
                let disk: Vec<u64> = read_rows(placer, "disk_bytes", start, stop)?;
                let file_offset: Vec<u64> = read_rows(placer, "file_offset", start, stop)?;
                let (num, comp) = if encoded {
                    (
                        read_rows(placer, "num_bytes", start, stop)?,
                        read_rows(placer, "compression", start, stop)?,
                    )
                } else {
                    (vec![0u64; stop - start], vec![0u8; stop - start])
                };
                for i in 0..stop - start {
                    out.push((start + i, (logical[i], disk[i], file_offset[i], num[i], comp[i])));
                }
            }
        }
        Ok(())
    }
}

/// Small files' content set aside in a file (`tree.AsideFile`), read back: while the asks
/// follow each other in the file, a window of `ASIDE_WINDOW` bytes at a time, else each alone.
struct AsideReader {
    fd: i32,
    window: Vec<u8>,
    at: u64,
    prev_end: u64,
}

impl AsideReader {
    fn read(&mut self, offset: u64, size: usize) -> PyResult<&[u8]> {
        let inside = offset >= self.at && offset + size as u64 <= self.at + self.window.len() as u64;
        if !inside {
            let want = if offset == self.prev_end {
                ASIDE_WINDOW.max(size)
            } else {
                size
            };
            self.window.resize(want, 0);
            let mut got = 0;
            while got < want {
                // SAFETY: the window has `want` bytes; the fd is the set-aside file's, open
                // while its tree lives (the caller holds the tree)
                let n = unsafe {
                    libc::pread(
                        self.fd,
                        self.window[got..].as_mut_ptr().cast(),
                        want - got,
                        (offset + got as u64) as libc::off_t,
                    )
                };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(crate::os_err(e));
                }
                if n == 0 {
                    break;
                }
                got += n as usize;
            }
            self.window.truncate(got);
            self.at = offset;
            if got < size {
                return Err(PyOSError::new_err(format!("set-aside content: short read at {offset}")));
            }
        }
        self.prev_end = offset + size as u64;
        let start = (offset - self.at) as usize;
        Ok(&self.window[start..start + size])
    }
}

/// The three timestamps of an inode: mtime, atime, ctime, the latter two mtime when unset.
fn times(t: Times<'_>, py: Python<'_>) -> PyResult<(i128, i128, i128)> {
    match t {
        Times::Small(m, a, c) => Ok((m as i128, a.unwrap_or(m) as i128, c.unwrap_or(m) as i128)),
        Times::Big(t) => {
            let (m, a, c): (i128, Option<i128>, Option<i128>) = t.bind(py).extract()?;
            Ok((m, a.unwrap_or(m), c.unwrap_or(m)))
        }
    }
}

/// `fstree.kernel_rdev`: the kernel's dev_t, MKDEV(major, minor) = major << 20 | minor.
fn kernel_rdev(rdev: u64) -> u64 {
    ((libc::major(rdev) as u64) << 20) | libc::minor(rdev) as u64
}

/// A dict of int -> int read whole (a few entries per directory).
fn int_map(d: &Bound<'_, PyDict>) -> PyResult<HashMap<u64, u64>> {
    d.iter().map(|(k, v)| Ok((k.extract()?, v.extract()?))).collect()
}

/// A u64 `array` column's values (the numbering's), borrowed for the call.
struct Column {
    buf: PyBuffer<u64>,
}

impl Column {
    fn new(obj: &Bound<'_, PyAny>) -> PyResult<Column> {
        let buf: PyBuffer<u64> = PyBuffer::get(obj)?;
        if buf.as_slice_ptr().is_none() {
            return Err(PyTypeError::new_err("numbering column is not contiguous"));
        }
        Ok(Column { buf })
    }

    fn slice(&self) -> &[u64] {
        let ptr = self.buf.as_slice_ptr().expect("checked contiguous");
        // SAFETY: the buffer is held for the column's life (the array can neither resize nor
        // go), and nothing writes the numbering's columns while the fs tree is made
        unsafe { ptr.as_ref() }
    }
}

/// `fstree.fs_tree_items`'s loop over `num` (a `Numbering`): every item into `packer`,
/// data extents from `placer` (natively when `native_placement`: a fresh placer without a
/// base or encoded extents: its rows are appended to its columns, its state handed back).
/// The file extent refs (extent row, inode, file offset) are appended to `refs`' three
/// `array("Q")`s. Returns the stats (files,
/// directories, symlinks, devices, hardlinks, inline files, content bytes) and, with
/// native placement, the placer's closed chunks and state (chunks as (logical, length,
/// physical), cursor, end, chunk physical, chunk logical, next logical, used).
#[pyfunction]
#[pyo3(signature = (packer, num, placer, native_placement, imax, encoded, generation, reg_flags, refs))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn fs_tree_items<'py>(
    py: Python<'py>,
    mut packer: PyRefMut<'py, crate::LeafPacker>,
    num: &Bound<'py, PyAny>,
    placer: &Bound<'py, PyAny>,
    native_placement: bool,
    imax: usize,
    encoded: bool,
    generation: u64,
    reg_flags: u64,
    refs: (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>),
) -> PyResult<(
    (u64, u64, u64, u64, u64, u64, u64),
    Option<(Vec<(u64, u64, u64)>, (u64, u64, u64, u64, u64, u64))>,
)> {
    if packer.done {
        return Err(pyo3::exceptions::PyValueError::new_err("leaf packer is finished"));
    }
    let (blob_cls, sparse_cls) = (inode::blob_type(py)?, inode::sparse_type(py)?);
    let p: &mut Packer = &mut packer.inner;
    let gen = generation;
    let inodes = num.getattr("inodes")?;
    let inodes = inodes.cast::<Rows>()?.borrow();
    let names = num.getattr("name")?;
    let names = names.cast::<Names>()?.borrow();
    let parent_col = Column::new(&num.getattr("parent")?)?;
    let index_col = Column::new(&num.getattr("index")?)?;
    let (parents, indexes) = (parent_col.slice(), index_col.slice());
    let inos_obj = num.getattr("inos")?;
    let inos_col = if inos_obj.is_none() {
        None
    } else {
        Some(Column::new(&inos_obj)?)
    };
    let inos = inos_col.as_ref().map(|c| c.slice());
    let n_inodes = inodes.len();
    if parents.len() != n_inodes
        || indexes.len() != n_inodes
        || names.len() != n_inodes
        || inos.is_some_and(|i| i.len() != n_inodes)
    {
        return Err(PyAssertionError::new_err("numbering columns differ in length"));
    }
    let once = num.getattr("once")?;
    let child_base = int_map(num.getattr("child_base")?.cast::<PyDict>()?)?;
    let dir_indexes = num.getattr("dir_indexes")?;
    let dir_indexes = dir_indexes.cast::<PyDict>()?;
    // hardlinks: ino -> its other names (parent ino, index, name)
    let mut more_refs: HashMap<u64, Vec<(u64, u64, Vec<u8>)>> = HashMap::new();
    for (k, v) in num.getattr("more_refs")?.cast::<PyDict>()?.iter() {
        let refs: Vec<(u64, u64, Vec<u8>)> = v.extract()?;
        more_refs.insert(k.extract()?, refs);
    }
    let mut placement = if native_placement {
        let start: u64 = py
            .import("btrfs_ublk_image.btrfs.layout")?
            .getattr("DEVICE_START")?
            .extract()?;
        let placer = Placer::new(placer, start)?;
        Placement::Native(Box::new(placer))
    } else {
        Placement::Python {
            place: placer.getattr("place")?,
            placer: placer.clone(),
        }
    };
    let mut asides: Vec<(usize, AsideReader)> = Vec::new();

    let (ref_extent, ref_ino, ref_offset) = refs;
    let (mut ref_extent, mut ref_ino, mut ref_offset) = (
        ColumnSink::new(ref_extent)?,
        ColumnSink::new(ref_ino)?,
        ColumnSink::new(ref_offset)?,
    );
    let (mut files, mut directories, mut symlinks, mut devices) = (0u64, 0u64, 0u64, 0u64);
    let (mut hardlinks, mut inline_files, mut content_bytes) = (0u64, 0u64, 0u64);
    let mut rows: Vec<(usize, Row)> = Vec::new();
    let mut file_extents: Vec<(leaves::Key, Vec<u8>)> = Vec::new();
    let mut inline: Vec<u8> = Vec::new();
    let first_ino = FIRST_FREE_OBJECTID;

    for n in 0..n_inodes {
        let ino = match inos {
            None => first_ino + n as u64,
            Some(i) => i[n],
        };
        // the fields copied out: no borrow is held while Python code (a Python placer) runs
        let (mode_type, perm, (uid, gid), xattrs, payload, (mtime, atime, ctime)) = inodes.with_data(py, n, |i| {
            let payload = match i.payload() {
                Payload::Obj(o) => Held::Obj(o.bind(py).clone()),
                Payload::Blob(b) => Held::Blob(*b),
                Payload::Aside { store, offset, size } => Held::Aside(store.bind(py).clone(), *offset, *size),
                Payload::Cleared => Held::Cleared,
            };
            let xattrs = i.xattrs_obj().map(|x| x.bind(py).clone());
            Ok((i.kind(), i.perm(), i.owner(), xattrs, payload, times(i.times(), py)?))
        })?;
        let more = more_refs.get(&ino);
        let nlink = 1 + more.map_or(0, |m| m.len());
        let (mut size, mut nbytes, mut flags, mut rdev) = (0u64, 0u64, 0u64, 0u64);
        let mut entries: Option<Bound<'py, Entries>> = None;
        file_extents.clear();
        match mode_type & S_IFMT {
            S_IFREG => {
                files += 1;
                flags = reg_flags;
                // a sparse file: extents for its data segments only, holes have no item
                let mut segments: Vec<(u64, BlobRef<'_, 'py>)> = Vec::new();
                let sparse: Vec<(u64, Bound<'py, PyAny>)>;
                inline.clear();
                match &payload {
                    Held::Blob(b) => {
                        size = b.size;
                        segments.push((0, BlobRef::Fields(*b)));
                    }
                    Held::Obj(o) if o.is_instance(blob_cls)? => {
                        size = blob_fields(o)?.size;
                        segments.push((0, BlobRef::Obj(o)));
                    }
                    Held::Obj(o) if o.is_instance(sparse_cls)? => {
                        size = o.getattr(intern!(py, "size"))?.extract()?;
                        sparse = o.getattr(intern!(py, "segments"))?.extract()?;
                        segments.extend(sparse.iter().map(|(at, b)| (*at, BlobRef::Obj(b))));
                    }
                    Held::Aside(store, offset, len) => {
                        let key = store.as_ptr() as usize;
                        let at = match asides.iter().position(|(k, _)| *k == key) {
                            Some(i) => i,
                            None => {
                                let fd: i32 = store.call_method0("fileno")?.extract()?;
                                asides.push((
                                    key,
                                    AsideReader {
                                        fd,
                                        window: Vec::new(),
                                        at: 0,
                                        prev_end: u64::MAX,
                                    },
                                ));
                                asides.len() - 1
                            }
                        };
                        inline.extend_from_slice(asides[at].1.read(*offset, *len as usize)?);
                    }
                    Held::Obj(o) => inline.extend_from_slice(o.cast::<PyBytes>()?.as_bytes()),
                    Held::Cleared => {}
                }
                for (seg_offset, blob) in segments {
                    placement.rows(py, blob, encoded, &mut rows)?;
                    for &(row, (logical, disk, file_offset, num_bytes, comp)) in &rows {
                        let offset = seg_offset + file_offset;
                        let (held, item) = if encoded {
                            (num_bytes, leaves::file_extent_reg(gen, logical, disk, num_bytes, comp))
                        } else {
                            (disk, leaves::file_extent_reg(gen, logical, disk, disk, 0))
                        };
                        file_extents.push(((ino, EXTENT_DATA_KEY, offset), item.to_vec()));
                        ref_extent.push(row as u64)?;
                        ref_ino.push(ino)?;
                        ref_offset.push(offset)?;
                        nbytes += held;
                    }
                }
                if !inline.is_empty() {
                    if inline.len() > imax {
                        return Err(PyAssertionError::new_err(
                            "in-memory content larger than the inline limit",
                        ));
                    }
                    size = inline.len() as u64;
                    nbytes = size;
                    inline_files += 1;
                    file_extents.push(((ino, EXTENT_DATA_KEY, 0), leaves::file_extent_inline(gen, &inline)));
                }
                content_bytes += size;
                hardlinks += nlink as u64 - 1;
            }
            S_IFLNK => {
                symlinks += 1;
                let target = match &payload {
                    Held::Obj(o) => o.cast::<PyBytes>()?.as_bytes(),
                    _ => return Err(PyTypeError::new_err("symlink target is not bytes")),
                };
                if target.is_empty() || target.len() > MAX_INLINE {
                    return Err(image_error(
                        py,
                        format!("symlink target of inode {ino} is empty or longer than {MAX_INLINE} bytes"),
                    ));
                }
                size = target.len() as u64;
                nbytes = size;
                file_extents.push(((ino, EXTENT_DATA_KEY, 0), leaves::file_extent_inline(gen, target)));
            }
            S_IFDIR => {
                directories += 1;
                let Held::Obj(e) = &payload else {
                    return Err(PyTypeError::new_err("directory entries are not Entries"));
                };
                let e = e.cast::<Entries>()?.clone();
                size = 2 * e.borrow().names_len();
                entries = Some(e);
            }
            t => {
                devices += 1;
                if t == S_IFCHR || t == S_IFBLK {
                    rdev = match &payload {
                        Held::Obj(o) => kernel_rdev(o.extract()?),
                        _ => 0,
                    };
                }
            }
        }
        if nlink > LINK_MAX {
            return Err(image_error(
                py,
                format!("inode {ino} has {nlink} hardlinks; btrfs allows {LINK_MAX}"),
            ));
        }
        let is_dir = mode_type & S_IFMT == S_IFDIR;
        let fields = InodeFields {
            generation: gen,
            size,
            nbytes,
            nlink: if is_dir { 1 } else { nlink as u32 },
            uid,
            gid,
            mode: (mode_type & S_IFMT) | (perm & 0o7777),
            rdev,
            flags,
            atime_ns: atime,
            ctime_ns: ctime,
            mtime_ns: mtime,
            otime_ns: mtime,
        };
        let name = names.get(n);
        let one_ref = (nlink == 1).then(|| (parents[n], indexes[n], name));
        p.add_inode(ino, &fields, one_ref).map_err(crate::add_err)?;
        if let Some(more) = more.filter(|_| nlink != 1) {
            // names per parent dir in one INODE_REF item while it fits in a leaf, the rest
            // in INODE_EXTREF items (EXTENDED_IREF), as the kernel does when a ref item is full
            let mut refs: Vec<(u64, u64, &[u8])> = vec![(parents[n], indexes[n], name)];
            refs.extend(more.iter().map(|(pa, i, nm)| (*pa, *i, nm.as_slice())));
            refs.sort();
            let mut by_parent: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
            let mut extrefs: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
            for (parent, index, nm) in refs {
                let r = leaves::inode_ref(index, nm);
                let data = by_parent.entry(parent).or_default();
                if data.len() + r.len() <= leaves::MAX_ITEM_DATA {
                    data.extend_from_slice(&r);
                } else {
                    let h = leaves::extref_hash(parent, nm);
                    extrefs
                        .entry(h)
                        .or_default()
                        .extend_from_slice(&leaves::inode_extref(parent, index, nm));
                }
            }
            for (parent, data) in &by_parent {
                if !data.is_empty() {
                    p.add((ino, INODE_REF_KEY, *parent), data).map_err(crate::add_err)?;
                }
            }
            for (h, data) in &extrefs {
                p.add((ino, INODE_EXTREF_KEY, *h), data).map_err(crate::add_err)?;
            }
        }
        let xattrs = match xattrs {
            Some(x) if x.is_truthy()? => Some(x),
            _ => None,
        };
        if let Some(xattrs) = xattrs {
            let mut by_hash: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
            for item in xattrs.call_method0(intern!(py, "items"))?.try_iter()? {
                let (xname, value): (Bound<'py, PyBytes>, Bound<'py, PyBytes>) = item?.extract()?;
                let (xname, value) = (xname.as_bytes(), value.as_bytes());
                if xname.len() + value.len() > MAX_XATTR_SIZE || xname.is_empty() || xname.len() > 255 {
                    let shown = PyBytes::new(py, &xname[..xname.len().min(60)]).repr()?;
                    return Err(image_error(
                        py,
                        format!("xattr {shown} of inode {ino}: name or value too large"),
                    ));
                }
                by_hash
                    .entry(leaves::name_hash(xname))
                    .or_default()
                    .extend_from_slice(&leaves::dir_item(0, 0, gen, FT_XATTR, xname, value));
            }
            for (h, data) in &by_hash {
                p.add((ino, XATTR_ITEM_KEY, *h), data).map_err(crate::add_err)?;
            }
        }
        let held = entries.as_ref().map(|e| e.borrow());
        if let Some(e) = held.as_ref().filter(|e| e.len() != 0) {
            // no Python code runs while the entries are borrowed
            let children = e.sorted();
            let mut child_inos: Vec<u64> = Vec::with_capacity(children.len());
            let mut ftypes: Vec<u8> = Vec::with_capacity(children.len());
            // `Numbering.child_inos`: with a base every inode holds its number; else a
            // directory's new children numbered from its child_base, in name order
            let mut k = if inos.is_some() {
                0
            } else {
                *child_base
                    .get(&ino)
                    .ok_or_else(|| PyAssertionError::new_err(format!("directory {ino} has no child_base")))?
            };
            for (_, child) in &children {
                let child = child.data(py)?;
                let c = if inos.is_some() {
                    child.ino_obj(py).extract::<u64>()?
                } else if child.ino_is(&once) {
                    k += 1;
                    k - 1
                } else {
                    let c: u64 = child.ino_obj(py).extract()?;
                    if c == k {
                        k += 1;
                    }
                    c
                };
                child_inos.push(c);
                ftypes.push(ftype_of(child.kind()));
            }
            let dir_entries: Vec<(&[u8], u64, u8)> = children
                .iter()
                .zip(&child_inos)
                .zip(&ftypes)
                .map(|(((nm, _), &c), &t)| (*nm, c, t))
                .collect();
            let given = if dir_indexes.is_empty() {
                None
            } else {
                dir_indexes.get_item(ino)?
            };
            // a base's indexes, unless they are 2, 3, ... in name order anyway
            let mut indexes: Option<Vec<u64>> = None;
            if let Some(ix) = given {
                let ix: Vec<u64> = PyBuffer::<u64>::get(&ix)?.to_vec(py)?;
                if ix.len() != dir_entries.len() {
                    return Err(PyAssertionError::new_err(format!(
                        "directory {ino}: dir indexes differ in number from entries"
                    )));
                }
                if !ix.iter().enumerate().all(|(i, &x)| x == i as u64 + 2) {
                    indexes = Some(ix);
                }
            }
            p.add_dir_indexed(ino, gen, &dir_entries, indexes.as_deref())
                .map_err(crate::add_err)?;
        }
        for (key, data) in &file_extents {
            p.add(*key, data).map_err(crate::add_err)?;
        }
    }
    for sink in [&mut ref_extent, &mut ref_ino, &mut ref_offset] {
        sink.flush()?;
    }
    let stats = (
        files,
        directories,
        symlinks,
        devices,
        hardlinks,
        inline_files,
        content_bytes,
    );
    let placed = match placement {
        Placement::Native(mut pl) => {
            for col in pl.cols.iter_mut() {
                col.flush()?;
            }
            let state = (
                pl.cur,
                pl.end,
                pl.chunk_phys,
                pl.chunk_logical,
                pl.next_logical,
                pl.used,
            );
            Some((std::mem::take(&mut pl.chunks), state))
        }
        Placement::Python { .. } => None,
    };
    Ok((stats, placed))
}
