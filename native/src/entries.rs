//! A directory's entries (name -> `Inode`) held here: the names' bytes in one buffer per
//! directory, each entry a 16-byte slot (where its name is, its child) in insertion order,
//! and a hash table of slot numbers. A `bytes` object is made for a name only when Python
//! code asks for it. `tree.Entries` is the Python subclass that adds `MutableMapping`'s
//! methods (keys, items, values, pop, update, ...); the extension makes directories'
//! entries of that class (`entries_new`).

use std::hash::BuildHasher;
use std::sync::OnceLock;

use hashbrown::HashTable;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyType};
use pyo3::PyTraverseError;

use crate::inode::Inode;

/// One entry: its name's place in `names`; None once it is removed.
struct Slot {
    at: u32,
    len: u32,
    child: Option<Py<Inode>>,
}

#[pyclass(module = "btrfs_ublk_native", subclass)]
pub struct Entries {
    names: Vec<u8>,
    slots: Vec<Slot>,
    index: HashTable<u32>, // slot numbers by name
    live: usize,
}

static HASHER: OnceLock<std::hash::RandomState> = OnceLock::new();
static ENTRIES_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn hash(name: &[u8]) -> u64 {
    HASHER.get_or_init(std::hash::RandomState::new).hash_one(name)
}

fn entries_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    ENTRIES_TYPE.import(py, "btrfs_ublk_image.tree", "Entries")
}

/// A new, empty `tree.Entries`.
pub(crate) fn entries_new(py: Python<'_>) -> PyResult<Bound<'_, Entries>> {
    Ok(entries_type(py)?.call0()?.cast_into::<Entries>()?)
}

/// A new `tree.Entries` of the name -> Inode pairs of `mapping` (`Entries(mapping)`).
pub(crate) fn entries_of<'py>(mapping: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Entries>> {
    Ok(entries_type(mapping.py())?.call1((mapping,))?.cast_into::<Entries>()?)
}

/// A slot's name in `names`.
fn slot_name<'a>(names: &'a [u8], s: &Slot) -> &'a [u8] {
    &names[s.at as usize..(s.at + s.len) as usize]
}

impl Entries {
    fn empty() -> Self {
        Entries {
            names: Vec::new(),
            slots: Vec::new(),
            index: HashTable::new(),
            live: 0,
        }
    }

    fn find(&self, name: &[u8]) -> Option<u32> {
        let (names, slots) = (&self.names, &self.slots);
        self.index
            .find(hash(name), |&i| slot_name(names, &slots[i as usize]) == name)
            .copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.live
    }

    pub(crate) fn get(&self, name: &[u8]) -> Option<&Py<Inode>> {
        self.find(name).and_then(|i| self.slots[i as usize].child.as_ref())
    }

    pub(crate) fn contains(&self, name: &[u8]) -> bool {
        self.find(name).is_some()
    }

    /// Set `name`'s child: a name already there keeps its place, a new one goes last.
    pub(crate) fn insert(&mut self, name: &[u8], child: Py<Inode>) -> PyResult<()> {
        if let Some(i) = self.find(name) {
            self.slots[i as usize].child = Some(child);
            return Ok(());
        }
        let too_big = || PyValueError::new_err("a directory's names exceed 4 GiB");
        let at = u32::try_from(self.names.len()).map_err(|_| too_big())?;
        let len = u32::try_from(name.len()).map_err(|_| too_big())?;
        at.checked_add(len).ok_or_else(too_big)?;
        let slot = u32::try_from(self.slots.len()).map_err(|_| too_big())?;
        self.names.extend_from_slice(name);
        self.slots.push(Slot {
            at,
            len,
            child: Some(child),
        });
        let (names, slots) = (&self.names, &self.slots);
        self.index
            .insert_unique(hash(name), slot, |&i| hash(slot_name(names, &slots[i as usize])));
        self.live += 1;
        Ok(())
    }

    /// Remove `name`; its child, if it was there.
    pub(crate) fn remove(&mut self, name: &[u8]) -> Option<Py<Inode>> {
        let (names, slots) = (&self.names, &self.slots);
        let found = self
            .index
            .find_entry(hash(name), |&i| slot_name(names, &slots[i as usize]) == name)
            .ok()?;
        let (i, _) = found.remove();
        let child = self.slots[i as usize].child.take();
        self.live -= 1;
        // removed slots and their names are dropped once they are most of the buffers
        if self.slots.len() > 16 && self.live * 2 < self.slots.len() {
            self.compact();
        }
        child
    }

    fn compact(&mut self) {
        let old_names = std::mem::take(&mut self.names);
        let old_slots = std::mem::take(&mut self.slots);
        self.index.clear();
        self.live = 0;
        for mut s in old_slots {
            if let Some(child) = s.child.take() {
                self.insert(slot_name(&old_names, &s), child)
                    .expect("smaller than before");
            }
        }
    }

    /// (name, child) in insertion order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &Py<Inode>)> {
        self.slots
            .iter()
            .filter_map(|s| s.child.as_ref().map(|c| (slot_name(&self.names, s), c)))
    }

    /// (name, child) sorted by name (bytewise, as `sorted` sorts bytes).
    pub(crate) fn sorted(&self) -> Vec<(&[u8], &Py<Inode>)> {
        let mut v: Vec<_> = self.iter().collect();
        v.sort_unstable_by(|a, b| a.0.cmp(b.0));
        v
    }

    /// The names' total length in bytes.
    pub(crate) fn names_len(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| s.child.is_some())
            .map(|s| s.len as u64)
            .sum()
    }
}

#[pymethods]
impl Entries {
    /// Empty, or the name -> Inode pairs of `entries` (a mapping).
    #[new]
    #[pyo3(signature = (entries=None))]
    fn new(entries: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut me = Entries::empty();
        if let Some(m) = entries.filter(|m| !m.is_none()) {
            for item in m.call_method0("items")?.try_iter()? {
                let (name, child): (Bound<'_, PyBytes>, Bound<'_, Inode>) = item?.extract()?;
                me.insert(name.as_bytes(), child.unbind())?;
            }
        }
        Ok(me)
    }

    fn __len__(&self) -> usize {
        self.live
    }

    fn __contains__(&self, name: &Bound<'_, PyAny>) -> bool {
        name.cast::<PyBytes>().is_ok_and(|n| self.contains(n.as_bytes()))
    }

    fn __getitem__<'py>(&self, name: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Inode>> {
        let py = name.py();
        let found = name.cast::<PyBytes>().ok().and_then(|n| self.get(n.as_bytes()));
        match found {
            Some(c) => Ok(c.bind(py).clone()),
            None => Err(PyKeyError::new_err(name.clone().unbind())),
        }
    }

    fn __setitem__(&mut self, name: &Bound<'_, PyBytes>, child: &Bound<'_, Inode>) -> PyResult<()> {
        self.insert(name.as_bytes(), child.clone().unbind())
    }

    fn __delitem__(&mut self, name: &Bound<'_, PyAny>) -> PyResult<()> {
        match name.cast::<PyBytes>().ok().and_then(|n| self.remove(n.as_bytes())) {
            Some(_) => Ok(()),
            None => Err(PyKeyError::new_err(name.clone().unbind())),
        }
    }

    /// The names, in insertion order (a list's iterator: the entries may change meanwhile).
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let names = PyList::new(py, self.iter().map(|(n, _)| PyBytes::new(py, n)))?;
        names.try_iter().map(|i| i.into_any())
    }

    #[pyo3(name = "get", signature = (name, default=None))]
    fn py_get<'py>(&self, name: &Bound<'py, PyAny>, default: Option<Bound<'py, PyAny>>) -> Bound<'py, PyAny> {
        let py = name.py();
        match name.cast::<PyBytes>().ok().and_then(|n| self.get(n.as_bytes())) {
            Some(c) => c.bind(py).clone().into_any(),
            None => default.unwrap_or_else(|| py.None().into_bound(py)),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let mut parts = Vec::with_capacity(self.live);
        for (n, c) in self.iter() {
            parts.push(format!("{}: {}", PyBytes::new(py, n).repr()?, c.bind(py).repr()?));
        }
        Ok(format!("Entries({{{}}})", parts.join(", ")))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for s in &self.slots {
            visit.call(&s.child)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        *self = Entries::empty();
    }
}
