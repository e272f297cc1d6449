//! `writer._number` without a base (kept as the reference and for `BUI_NATIVE=0`) in one
//! call: which inodes have more than one name, then inode numbers (DFS, sorted names; a
//! directory's new children take consecutive numbers when it is reached; a hardlink
//! reuses its inode's number), dir indexes from 2 in name order, and the first name of
//! each inode, into a `_Numbering`'s columns. The inodes (inode.rs) are read and marked
//! through a borrow: no Python code runs per inode.

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::entries::Entries;
use crate::fsitems::{image_error, ColumnSink};
use crate::inode::{Inode, InodeData};

const FIRST_FREE_OBJECTID: u64 = 256;

/// `_number(tree)` for a build without a base: `root` is the tree's root directory, `num`
/// a fresh `_Numbering(root, once)` whose columns are filled; `more` marks (in `Inode.ino`)
/// an inode reached under more than one name. Errors as `_number`'s (a hardlinked
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
    // pass 1: which inodes have more than one name (marks of this run: whatever `ino` held
    // before is overwritten); the same walk as the Python pass, so the same name is reported
    root.borrow_mut().set_ino(once.clone().unbind());
    let mut stack = vec![root.borrow().entries(py)?];
    while let Some(dir) = stack.pop() {
        let mut entries = dir.borrow_mut();
        for (name, child) in entries.iter_mut() {
            let mut c = child.data_mut(py)?;
            if c.ino_is(&once) {
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
                let refs = match more_refs.get_item(&mark)? {
                    Some(r) => r.cast_into::<PyList>()?,
                    None => {
                        let r = PyList::empty(py);
                        more_refs.set_item(&mark, &r)?;
                        r
                    }
                };
                refs.append((pino, index, PyBytes::new(py, name)))?;
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

/// Where a run of rows' inodes are.
enum Holder {
    /// slots of a directory's entries (children held inline or objects)
    Dir(Py<Entries>),
    /// one row: this object
    Object(Py<Inode>),
}

/// `_Numbering.inodes`: row -> inode without an object per inode. A directory's children
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

/// `_Numbering.name`: the first name of each inode, row by row, in one buffer (a `bytes`
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
