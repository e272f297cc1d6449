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
use crate::inode::Inode;

const FIRST_FREE_OBJECTID: u64 = 256;

/// A directory's entries (name -> Inode).
fn entries<'py>(node: &Bound<'py, Inode>) -> PyResult<Bound<'py, Entries>> {
    node.borrow().entries(node.py())
}

/// `_number(tree)` for a build without a base: `root` is the tree's root directory, `num`
/// a fresh `_Numbering(root, once)` whose columns are filled; `more` marks (in `Inode.ino`)
/// an inode reached under more than one name. Errors as `_number`'s (a hardlinked
/// directory names the name it was found under the second time).
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
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        let entries = entries(&dir)?;
        let entries = entries.borrow();
        for (name, child) in entries.iter() {
            let child = child.bind(py);
            let mut c = child.borrow_mut();
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
                    drop(c);
                    stack.push(child.clone());
                }
            }
        }
    }
    // pass 2: numbers
    let first = FIRST_FREE_OBJECTID;
    root.borrow_mut().set_ino(first.into_pyobject(py)?.into_any().unbind());
    let inodes = num.getattr("inodes")?;
    let inodes = inodes.cast::<PyList>()?;
    let names = num.getattr("name")?;
    let mut names = names.cast::<Names>()?.borrow_mut();
    let more_refs = num.getattr("more_refs")?;
    let more_refs = more_refs.cast::<PyDict>()?;
    let child_base = num.getattr("child_base")?;
    let child_base = child_base.cast::<PyDict>()?;
    let mut parents = ColumnSink::new(num.getattr("parent")?)?;
    let mut indexes = ColumnSink::new(num.getattr("index")?)?;
    let mut count = inodes.len() as u64; // rows so far (the root's)
    let mut dirs = vec![(root.clone(), first)];
    let mut pending = Vec::new();
    while let Some((dir, pino)) = dirs.pop() {
        child_base.set_item(pino, first + count)?;
        let entries = entries(&dir)?;
        let entries = entries.borrow();
        let children = entries.sorted();
        pending.clear();
        for (index, &(name, child)) in (2u64..).zip(&children) {
            let child = child.bind(py);
            let mut c = child.borrow_mut();
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
                pending.push((child.clone(), ino));
            } else if c.ino_is(more) {
                c.set_ino(ino.into_pyobject(py)?.into_any().unbind());
            }
            drop(c);
            inodes.append(child)?;
            parents.push(pino)?;
            indexes.push(index)?;
            names.push(name)?;
            count += 1;
        }
        dirs.extend(pending.drain(..).rev());
    }
    parents.flush()?;
    indexes.flush()?;
    Ok(())
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
        let n = self.ends.len() as isize;
        let at = if row < 0 { row + n } else { row };
        if !(0..n).contains(&at) {
            return Err(PyIndexError::new_err("name row out of range"));
        }
        Ok(PyBytes::new(py, self.get(at as usize)))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let names = PyList::new(py, (0..self.len()).map(|i| PyBytes::new(py, self.get(i))))?;
        names.try_iter().map(|i| i.into_any())
    }

    fn append(&mut self, name: &Bound<'_, PyBytes>) -> PyResult<()> {
        self.push(name.as_bytes())
    }
}
