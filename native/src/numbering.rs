//! `numbering.number` (kept as the reference and for `BUI_NATIVE=0`) in one call: which
//! inodes have more than one name, then inode numbers (DFS, sorted names; a directory's new
//! children take consecutive numbers when it is reached; a hardlink reuses its inode's
//! number), dir indexes from 2 in name order, and the first name of each inode, into a
//! `Numbering`'s columns; on a base (`number_on_base`), `number_on_base`'s numbers and
//! dir indexes. The inodes (inode.rs) are read and marked through a borrow: no Python code
//! runs per inode, and children held inline in their directory's entries stay there.

use std::collections::{HashMap, HashSet};

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::entries::Entries;
use crate::fsitems::{image_error, ColumnSink};
use crate::inode::{Inode, InodeData};

const FIRST_FREE_OBJECTID: u64 = 256;

/// Pass 1 of `number`: which inodes have more than one name (marks of this run: whatever
/// `ino` held before is overwritten); the same walk as the Python pass, so the same name is
/// reported for a hardlinked directory.
fn mark_names(
    py: Python<'_>,
    root: &Bound<'_, Inode>,
    once: &Bound<'_, PyAny>,
    more: &Bound<'_, PyAny>,
) -> PyResult<()> {
    root.borrow_mut().set_ino(once.clone().unbind());
    let mut stack = vec![root.borrow().entries(py)?];
    while let Some(dir) = stack.pop() {
        let mut entries = dir.borrow_mut();
        for (name, child) in entries.iter_mut() {
            let mut c = child.data_mut(py)?;
            if c.ino_is(once) {
                if c.is_dir() {
                    let shown = PyBytes::new(py, name).repr()?;
                    return Err(image_error(
                        py,
                        format!("directory {shown} appears twice in the tree (hardlinked dir)"),
                    ));
                }
                c.set_ino(more.clone().unbind());
            } else if !c.ino_is(more) {
                c.set_ino(once.clone().unbind());
                if c.is_dir() {
                    stack.push(c.entries(py)?);
                }
            }
        }
    }
    Ok(())
}

/// Another name `(pino, index, name)` of the inode numbered `mark` (`more_refs[mark]`).
fn add_more_ref(
    more_refs: &Bound<'_, PyDict>,
    mark: &Bound<'_, PyAny>,
    pino: u64,
    index: u64,
    name: &[u8],
) -> PyResult<()> {
    let py = more_refs.py();
    let refs = match more_refs.get_item(mark)? {
        Some(r) => r.cast_into::<PyList>()?,
        None => {
            let r = PyList::empty(py);
            more_refs.set_item(mark, &r)?;
            r
        }
    };
    refs.append((pino, index, PyBytes::new(py, name)))
}

/// `number(tree)` for a build without a base: `root` is the tree's root directory, `num`
/// a fresh `Numbering(root, once)` whose columns are filled; `more` marks (in `Inode.ino`)
/// an inode reached under more than one name. Errors as `number`'s (a hardlinked
/// directory names the name it was found under the second time). Children held inline in
/// their directory's entries stay there: a row names their directory and slot.
#[pyfunction]
pub fn number_inodes(
    py: Python<'_>,
    root: &Bound<'_, Inode>,
    num: &Bound<'_, PyAny>,
    more: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let once = num.getattr("once")?;
    mark_names(py, root, &once, more)?;
    // pass 2: numbers
    let first = FIRST_FREE_OBJECTID;
    root.borrow_mut().set_ino(first.into_pyobject(py)?.into_any().unbind());
    let rows = num.getattr("inodes")?;
    let mut rows = rows.cast::<Rows>()?.borrow_mut();
    let names = num.getattr("name")?;
    let mut names = names.cast::<Names>()?.borrow_mut();
    let more_refs = num.getattr("more_refs")?;
    let more_refs = more_refs.cast::<PyDict>()?;
    let child_base = num.getattr("child_base")?;
    let child_base = child_base.cast::<PyDict>()?;
    let mut parents = ColumnSink::new(num.getattr("parent")?)?;
    let mut indexes = ColumnSink::new(num.getattr("index")?)?;
    let mut count = rows.len() as u64; // rows so far (the root's)
    let mut dirs = vec![(root.borrow().entries(py)?, first)];
    let mut pending = Vec::new();
    while let Some((dir, pino)) = dirs.pop() {
        child_base.set_item(pino, first + count)?;
        let mut entries = dir.borrow_mut();
        pending.clear();
        for (index, slot) in (2u64..).zip(entries.sorted_slots()) {
            let (name, child) = entries.at_mut(slot).expect("a live slot");
            let mut c = child.data_mut(py)?;
            if !c.ino_is(&once) && !c.ino_is(more) {
                let mark = c.ino_obj(py);
                drop(c);
                // numbered already: another name of a hardlinked inode
                add_more_ref(more_refs, &mark, pino, index, name)?;
                continue;
            }
            let ino = first + count;
            if c.is_dir() {
                c.set_ino(ino.into_pyobject(py)?.into_any().unbind());
                pending.push((c.entries(py)?, ino));
            } else if c.ino_is(more) {
                c.set_ino(ino.into_pyobject(py)?.into_any().unbind());
            }
            drop(c);
            rows.push_slot(&dir, slot)?;
            parents.push(pino)?;
            indexes.push(index)?;
            names.push(name)?;
            count += 1;
        }
        drop(entries);
        dirs.extend(pending.drain(..).rev());
    }
    parents.flush()?;
    indexes.flush()?;
    Ok(())
}

/// A base directory's entries (name, inode number, dir index), sorted by name.
fn base_dir(entries: &Bound<'_, PyAny>) -> PyResult<Vec<(Vec<u8>, u64, u64)>> {
    let mut out = Vec::with_capacity(entries.len()?);
    for item in entries.call_method0(intern!(entries.py(), "items"))?.try_iter()? {
        let item = item?;
        let item = item.cast::<PyTuple>()?;
        let name = item.get_item(0)?;
        let (ino, index): (u64, u64) = item.get_item(1)?.extract()?;
        out.push((name.cast::<PyBytes>()?.as_bytes().to_vec(), ino, index));
    }
    out.sort_unstable();
    Ok(out)
}

/// One row of a numbering on a base before the rows are put in number order.
struct BaseRow {
    ino: u64,
    dir: u32,  // the directory's place in `held`
    slot: u32, // the child's slot in its entries
    parent: u64,
    index: u64,
    name: (usize, usize), // its place in the names' buffer
}

/// `number_on_base(num, base, more)` with pass 1 of `number` before it: `base_dirs` is
/// `BaseLayout.dirs` (base directory inode -> name -> (inode number, dir index)), `max_ino`
/// `BaseLayout.max_ino`. The same numbers, dir indexes (`num.dir_indexes`), `more_refs`,
/// rows in number order (`num.inos`) and errors as the Python function's; every inode's
/// `ino` holds its number, as there.
#[pyfunction]
pub fn number_on_base(
    py: Python<'_>,
    root: &Bound<'_, Inode>,
    num: &Bound<'_, PyAny>,
    more: &Bound<'_, PyAny>,
    base_dirs: &Bound<'_, PyAny>,
    max_ino: u64,
) -> PyResult<()> {
    let once = num.getattr("once")?;
    mark_names(py, root, &once, more)?;
    let first = FIRST_FREE_OBJECTID;
    root.borrow_mut().set_ino(first.into_pyobject(py)?.into_any().unbind());
    // how many names each base inode had: only a number with one is given to a new name
    let mut named: HashMap<u64, u32> = HashMap::new();
    for entries in base_dirs.call_method0("values")?.try_iter()? {
        for was in entries?.call_method0("values")?.try_iter()? {
            let (ino, _): (u64, u64) = was?.extract()?;
            *named.entry(ino).or_default() += 1;
        }
    }
    let mut taken: HashSet<u64> = HashSet::from([first]);
    let mut next_ino = max_ino.max(first) + 1;
    let more_refs = num.getattr("more_refs")?;
    let more_refs = more_refs.cast::<PyDict>()?;
    let dir_indexes = num.getattr("dir_indexes")?;
    let dir_indexes = dir_indexes.cast::<PyDict>()?;
    let array = py.import("array")?.getattr("array")?;
    let mut held: Vec<Bound<'_, Entries>> = Vec::new();
    let mut rows: Vec<BaseRow> = Vec::new();
    let mut name_buf: Vec<u8> = Vec::new();
    let mut dirs = vec![(root.borrow().entries(py)?, first)];
    let mut pending = Vec::new();
    let mut dir_index_col: Vec<u8> = Vec::new();
    while let Some((dir, pino)) = dirs.pop() {
        let dir_at = u32::try_from(held.len()).map_err(|_| PyValueError::new_err("more than 2**32 directories"))?;
        held.push(dir.clone());
        let old_obj = base_dirs.call_method1(intern!(py, "get"), (pino,))?;
        let old = if old_obj.is_none() {
            Vec::new()
        } else {
            base_dir(&old_obj)?
        };
        let mut next_index = old.iter().map(|o| o.2).max().map_or(2, |m| m + 1);
        let mut entries = dir.borrow_mut();
        // (number, dir index) of the names this directory lost, popped from the end
        let mut freed: Vec<(u64, u64)> = old
            .iter()
            .filter(|(n, ino, _)| !entries.contains(n) && named.get(ino) == Some(&1))
            .map(|&(_, ino, index)| (ino, index))
            .rev()
            .collect();
        pending.clear();
        dir_index_col.clear();
        for slot in entries.sorted_slots() {
            let (name, child) = entries.at_mut(slot).expect("a live slot");
            let was = old
                .binary_search_by(|o| o.0.as_slice().cmp(name))
                .ok()
                .map(|i| (old[i].1, old[i].2));
            let mut c = child.data_mut(py)?;
            let numbered = !c.ino_is(&once) && !c.ino_is(more); // another name's inode
            let mut lost = None;
            if was.is_none() && !numbered {
                while freed.last().is_some_and(|f| taken.contains(&f.0)) {
                    freed.pop();
                }
                lost = freed.pop();
            }
            let index = match (was, lost) {
                (Some((_, index)), _) | (None, Some((_, index))) => index,
                (None, None) => {
                    next_index += 1;
                    next_index - 1
                }
            };
            dir_index_col.extend_from_slice(&index.to_ne_bytes());
            if numbered {
                let mark = c.ino_obj(py);
                drop(c);
                add_more_ref(more_refs, &mark, pino, index, name)?;
                continue;
            }
            let ino = match (was, lost) {
                (Some((ino, _)), _) if !taken.contains(&ino) => ino,
                (_, Some((ino, _))) => ino,
                _ => {
                    next_ino += 1;
                    next_ino - 1
                }
            };
            taken.insert(ino);
            c.set_ino(ino.into_pyobject(py)?.into_any().unbind());
            if c.is_dir() {
                pending.push((c.entries(py)?, ino));
            }
            drop(c);
            rows.push(BaseRow {
                ino,
                dir: dir_at,
                slot,
                parent: pino,
                index,
                name: (name_buf.len(), name.len()),
            });
            name_buf.extend_from_slice(name);
        }
        drop(entries);
        dir_indexes.set_item(pino, array.call1(("Q", PyBytes::new(py, &dir_index_col)))?)?;
        dirs.extend(pending.drain(..).rev());
    }
    // rows in number order: the fs tree's items are made in that order
    rows.sort_unstable_by_key(|r| r.ino);
    num.setattr("inos", array.call1(("Q", PyBytes::new(py, &first.to_ne_bytes())))?)?;
    let inodes = num.getattr("inodes")?;
    let mut inodes = inodes.cast::<Rows>()?.borrow_mut();
    let names = num.getattr("name")?;
    let mut names = names.cast::<Names>()?.borrow_mut();
    let mut inos = ColumnSink::new(num.getattr("inos")?)?;
    let mut parents = ColumnSink::new(num.getattr("parent")?)?;
    let mut indexes = ColumnSink::new(num.getattr("index")?)?;
    for r in &rows {
        inodes.push_slot(&held[r.dir as usize], r.slot)?;
        inos.push(r.ino)?;
        parents.push(r.parent)?;
        indexes.push(r.index)?;
        names.push(&name_buf[r.name.0..r.name.0 + r.name.1])?;
    }
    inos.flush()?;
    parents.flush()?;
    indexes.flush()?;
    Ok(())
}

/// Where a run of rows' inodes are.
enum Holder {
    /// slots of a directory's entries (children held inline or objects)
    Dir(Py<Entries>),
    /// one row: this object
    Object(Py<Inode>),
}

/// `Numbering.inodes`: row -> inode without an object per inode. A directory's children
/// numbered together are one run (the directory's entries, and each row's slot in them);
/// an inode appended from Python is a run of its own. Python code reading a row gets the
/// `Inode` object (a child held inline is promoted); the extension reads the fields in
/// place. The tree must not change between numbering and writing (slots would move).
#[pyclass(module = "btrfs_ublk_native")]
#[derive(Default)]
pub struct Rows {
    runs: Vec<(u32, Holder)>, // (first row, holder), by first row
    slots: Vec<u32>,          // row -> its slot in its run's entries (0 for an object)
}

impl Rows {
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    fn next_row(&self) -> PyResult<u32> {
        u32::try_from(self.slots.len()).map_err(|_| PyValueError::new_err("more than 2**32 inodes"))
    }

    /// One more row: slot `slot` of `dir`.
    pub(crate) fn push_slot(&mut self, dir: &Bound<'_, Entries>, slot: u32) -> PyResult<()> {
        let row = self.next_row()?;
        let same = matches!(self.runs.last(), Some((_, Holder::Dir(d))) if d.as_ptr() == dir.as_ptr());
        if !same {
            self.runs.push((row, Holder::Dir(dir.clone().unbind())));
        }
        self.slots.push(slot);
        Ok(())
    }

    fn push_object(&mut self, inode: Py<Inode>) -> PyResult<()> {
        let row = self.next_row()?;
        self.runs.push((row, Holder::Object(inode)));
        self.slots.push(0);
        Ok(())
    }

    fn holder(&self, row: usize) -> PyResult<(&Holder, u32)> {
        if row >= self.slots.len() {
            return Err(PyIndexError::new_err("inode row out of range"));
        }
        let run = self.runs.partition_point(|(first, _)| *first as usize <= row) - 1;
        Ok((&self.runs[run].1, self.slots[row]))
    }

    /// `f` of row `row`'s fields, read in place.
    pub(crate) fn with_data<R>(
        &self,
        py: Python<'_>,
        row: usize,
        f: impl FnOnce(&InodeData) -> PyResult<R>,
    ) -> PyResult<R> {
        match self.holder(row)? {
            (Holder::Object(o), _) => {
                let inode = o.bind(py).try_borrow()?;
                f(&inode)
            }
            (Holder::Dir(d), slot) => {
                let entries = d.bind(py).try_borrow()?;
                let (_, child) = entries
                    .at(slot)
                    .ok_or_else(|| PyIndexError::new_err("a numbered entry is gone"))?;
                let data = child.data(py)?;
                f(&data)
            }
        }
    }
}

/// A Python sequence index (negative from the end) into `len` rows; IndexError outside.
fn sequence_index(row: isize, len: usize, what: &str) -> PyResult<usize> {
    let at = if row < 0 { row + len as isize } else { row };
    if !(0..len as isize).contains(&at) {
        return Err(PyIndexError::new_err(format!("{what} out of range")));
    }
    Ok(at as usize)
}

#[pymethods]
impl Rows {
    /// Empty, or the given inodes' rows.
    #[new]
    #[pyo3(signature = (inodes=None))]
    fn new(inodes: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut me = Rows::default();
        if let Some(inodes) = inodes {
            for inode in inodes.try_iter()? {
                me.push_object(inode?.cast_into::<Inode>()?.unbind())?;
            }
        }
        Ok(me)
    }

    fn __len__(&self) -> usize {
        self.slots.len()
    }

    /// Row `row`'s `Inode` (promoted when held inline: the same object every time).
    fn __getitem__<'py>(&self, py: Python<'py>, row: isize) -> PyResult<Bound<'py, Inode>> {
        match self.holder(sequence_index(row, self.slots.len(), "inode row")?)? {
            (Holder::Object(o), _) => Ok(o.bind(py).clone()),
            (Holder::Dir(d), slot) => Ok(d.bind(py).try_borrow_mut()?.object_at(py, slot)?.into_bound(py)),
        }
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.borrow();
        let inodes = PyList::empty(py);
        for row in 0..me.slots.len() as isize {
            inodes.append(me.__getitem__(py, row)?)?;
        }
        inodes.try_iter().map(|i| i.into_any())
    }

    fn append(&mut self, inode: &Bound<'_, Inode>) -> PyResult<()> {
        self.push_object(inode.clone().unbind())
    }

    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        for (_, h) in &self.runs {
            match h {
                Holder::Dir(d) => visit.call(d)?,
                Holder::Object(o) => visit.call(o)?,
            }
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        *self = Rows::default();
    }
}

/// `Numbering.name`: the first name of each inode, row by row, in one buffer (a `bytes`
/// object is made only when Python code reads a row).
#[pyclass(module = "btrfs_ublk_native")]
#[derive(Default)]
pub struct Names {
    bytes: Vec<u8>,
    ends: Vec<u32>,
}

impl Names {
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    pub(crate) fn get(&self, row: usize) -> &[u8] {
        let start = if row == 0 { 0 } else { self.ends[row - 1] as usize };
        &self.bytes[start..self.ends[row] as usize]
    }

    pub(crate) fn push(&mut self, name: &[u8]) -> PyResult<()> {
        let end = u32::try_from(self.bytes.len() + name.len())
            .map_err(|_| PyValueError::new_err("the image's names exceed 4 GiB"))?;
        self.bytes.extend_from_slice(name);
        self.ends.push(end);
        Ok(())
    }
}

#[pymethods]
impl Names {
    #[new]
    #[pyo3(signature = (names=None))]
    fn new(names: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut me = Names::default();
        if let Some(names) = names {
            for name in names.try_iter()? {
                me.push(name?.cast::<PyBytes>()?.as_bytes())?;
            }
        }
        Ok(me)
    }

    fn __len__(&self) -> usize {
        self.ends.len()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, row: isize) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(
            py,
            self.get(sequence_index(row, self.ends.len(), "name row")?),
        ))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let names = PyList::new(py, (0..self.len()).map(|i| PyBytes::new(py, self.get(i))))?;
        names.try_iter().map(|i| i.into_any())
    }

    fn append(&mut self, name: &Bound<'_, PyBytes>) -> PyResult<()> {
        self.push(name.as_bytes())
    }
}
