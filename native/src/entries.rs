//! A directory's entries (name -> `Inode`) held here: the names' bytes in one buffer per
//! directory, each entry a 16-byte slot (where its name is, its child) in insertion order,
//! and a hash table of slot numbers. A `bytes` object is made for a name only when Python
//! code asks for it. `tree.Entries` is the Python subclass that adds `MutableMapping`'s
//! methods (keys, items, values, pop, update, ...); the extension makes directories'
//! entries of that class (`entries_new`).

use std::hash::BuildHasher;
use std::ptr::NonNull;
use std::sync::OnceLock;

use hashbrown::HashTable;
use pyo3::exceptions::{PyIndexError, PyKeyError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyType};
use pyo3::PyTraverseError;

use crate::inode::{Inode, InodeData};

/// A child to place in a slot: an `Inode` object, or an inode's fields held here until
/// Python code asks for it (then they move into a new `Inode` that the slot holds from then
/// on, so every access gives the same object).
pub(crate) enum Child {
    Inline(InodeData),
    Object(Py<Inode>),
}

/// A slot's child, read.
#[derive(Clone, Copy)]
pub(crate) enum ChildRef<'a> {
    Inline(&'a InodeData),
    Object(&'a Py<Inode>),
}

/// A slot's child, its fields to change.
pub(crate) enum ChildMut<'a> {
    Inline(&'a mut InodeData),
    Object(&'a Py<Inode>),
}

/// An inode's fields read through either kind of child.
pub(crate) enum DataRef<'a, 'py> {
    Inline(&'a InodeData),
    Object(PyRef<'py, Inode>),
}

/// An inode's fields changed through either kind of child.
pub(crate) enum DataMut<'a, 'py> {
    Inline(&'a mut InodeData),
    Object(PyRefMut<'py, Inode>),
}

impl std::ops::Deref for DataRef<'_, '_> {
    type Target = InodeData;
    fn deref(&self) -> &InodeData {
        match self {
            DataRef::Inline(d) => d,
            DataRef::Object(o) => o,
        }
    }
}

impl std::ops::Deref for DataMut<'_, '_> {
    type Target = InodeData;
    fn deref(&self) -> &InodeData {
        match self {
            DataMut::Inline(d) => d,
            DataMut::Object(o) => o,
        }
    }
}

impl std::ops::DerefMut for DataMut<'_, '_> {
    fn deref_mut(&mut self) -> &mut InodeData {
        match self {
            DataMut::Inline(d) => d,
            DataMut::Object(o) => &mut *o,
        }
    }
}

impl<'a> ChildRef<'a> {
    /// The fields (an object's borrowed: an error while it is borrowed mutably).
    pub(crate) fn data<'py>(self, py: Python<'py>) -> PyResult<DataRef<'a, 'py>> {
        Ok(match self {
            ChildRef::Inline(d) => DataRef::Inline(d),
            ChildRef::Object(o) => DataRef::Object(o.bind(py).try_borrow()?),
        })
    }

    /// The object, when the child is one.
    pub(crate) fn object(self) -> Option<&'a Py<Inode>> {
        match self {
            ChildRef::Object(o) => Some(o),
            ChildRef::Inline(_) => None,
        }
    }

    fn traverse(self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        match self {
            ChildRef::Inline(d) => d.traverse(visit),
            ChildRef::Object(o) => visit.call(o),
        }
    }
}

impl<'a> ChildMut<'a> {
    pub(crate) fn data_mut<'py>(self, py: Python<'py>) -> PyResult<DataMut<'a, 'py>> {
        Ok(match self {
            ChildMut::Inline(d) => DataMut::Inline(d),
            ChildMut::Object(o) => DataMut::Object(o.bind(py).try_borrow_mut()?),
        })
    }
}

/// A slot's child in one word (the slot stays 16 bytes): an object's own pointer (a strong
/// reference), or with the low bit set, a box from Python's small-object allocator holding
/// an inline child's fields. A build boxes one per file, and malloc's slower path for so many
/// small blocks cost more CPU than the `Inode` objects did (pymalloc: no header either, 88
/// bytes take 96). Both pointers are at least 8-byte aligned, so the bit is free. Dropped
/// only with the GIL held: it lives in an `Entries` (freed by its dealloc or its methods) or
/// in code holding the GIL. All of its unsafe code is here.
pub(crate) struct ChildPtr(NonNull<u8>);

const INLINE: usize = 1;

// SAFETY: it owns its `InodeData` or its reference as a Box or a `Py` would (both Send, Sync)
unsafe impl Send for ChildPtr {}
unsafe impl Sync for ChildPtr {}

impl ChildPtr {
    fn new(_py: Python<'_>, child: Child) -> ChildPtr {
        match child {
            Child::Object(o) => {
                // SAFETY: an object's pointer, not null; the reference moves into the word
                let p = unsafe { NonNull::new_unchecked(o.into_ptr().cast::<u8>()) };
                debug_assert_eq!(p.as_ptr() as usize & INLINE, 0);
                ChildPtr(p)
            }
            Child::Inline(d) => {
                let layout = std::alloc::Layout::new::<InodeData>();
                // SAFETY: the GIL is held (`_py`); pymalloc's blocks are 16-byte aligned
                let p = unsafe { pyo3::ffi::PyMem_Malloc(layout.size()) }.cast::<InodeData>();
                let Some(p) = NonNull::new(p) else {
                    std::alloc::handle_alloc_error(layout)
                };
                // SAFETY: fresh memory of `InodeData`'s size and alignment
                unsafe { p.as_ptr().write(d) };
                ChildPtr(p.cast::<u8>().map_addr(|a| a | INLINE))
            }
        }
    }

    /// The inline box, when the word holds one.
    fn inline(&self) -> Option<NonNull<InodeData>> {
        let a = self.0.addr().get();
        (a & INLINE != 0).then(|| {
            self.0
                .with_addr(std::num::NonZeroUsize::new(a & !INLINE).expect("a box's address"))
                .cast::<InodeData>()
        })
    }

    /// The object's reference, borrowed from the word (`Py` is one pointer, transparent).
    fn object(&self) -> &Py<Inode> {
        debug_assert!(self.inline().is_none());
        // SAFETY: an untagged word is a `Py<Inode>`'s pointer, owned by this word
        unsafe { &*(&self.0 as *const NonNull<u8>).cast::<Py<Inode>>() }
    }

    fn get(&self) -> ChildRef<'_> {
        match self.inline() {
            // SAFETY: owned and initialised since `new`
            Some(p) => ChildRef::Inline(unsafe { p.as_ref() }),
            None => ChildRef::Object(self.object()),
        }
    }

    fn get_mut(&mut self) -> ChildMut<'_> {
        match self.inline() {
            // SAFETY: owned and initialised since `new`, borrowed mutably through `self`
            Some(mut p) => ChildMut::Inline(unsafe { p.as_mut() }),
            None => ChildMut::Object(self.object()),
        }
    }

    /// The child as an `Inode` object, made of its fields when it is held inline.
    fn promote(&mut self, py: Python<'_>) -> PyResult<Py<Inode>> {
        if let ChildMut::Inline(d) = self.get_mut() {
            // the fields move out; an empty inode stands in until the object holds them
            let data = std::mem::replace(d, InodeData::placeholder());
            let o = Py::new(py, Inode::from(data))?;
            // the box (with the placeholder) goes; the word holds the object from here on
            *self = ChildPtr::new(py, Child::Object(o));
        }
        Ok(self.object().clone_ref(py))
    }
}

impl Drop for ChildPtr {
    fn drop(&mut self) {
        match self.inline() {
            // SAFETY: owned; dropped with the GIL held (see the type's doc)
            Some(p) => unsafe {
                std::ptr::drop_in_place(p.as_ptr());
                pyo3::ffi::PyMem_Free(p.as_ptr().cast());
            },
            // SAFETY: the word owns the reference; it is read out once, here
            None => drop(unsafe { std::ptr::read(self.object()) }),
        }
    }
}

/// One entry: its name's place in `names`, its child; None once it is removed.
struct Slot {
    at: u32,
    len: u32,
    child: Option<ChildPtr>,
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

    pub(crate) fn get(&self, name: &[u8]) -> Option<ChildRef<'_>> {
        self.find(name)
            .and_then(|i| self.slots[i as usize].child.as_ref().map(ChildPtr::get))
    }

    pub(crate) fn contains(&self, name: &[u8]) -> bool {
        self.find(name).is_some()
    }

    /// Slot `slot`'s name and child (None: no such slot, or removed).
    pub(crate) fn at(&self, slot: u32) -> Option<(&[u8], ChildRef<'_>)> {
        let s = self.slots.get(slot as usize)?;
        Some((slot_name(&self.names, s), s.child.as_ref()?.get()))
    }

    pub(crate) fn at_mut(&mut self, slot: u32) -> Option<(&[u8], ChildMut<'_>)> {
        let s = self.slots.get_mut(slot as usize)?;
        Some((slot_name(&self.names, s), s.child.as_mut()?.get_mut()))
    }

    /// Slot `slot`'s child as an `Inode` object (promoted when it is held inline).
    pub(crate) fn object_at(&mut self, py: Python<'_>, slot: u32) -> PyResult<Py<Inode>> {
        match self.slots.get_mut(slot as usize).and_then(|s| s.child.as_mut()) {
            Some(c) => c.promote(py),
            None => Err(PyIndexError::new_err("no entry in this slot")),
        }
    }

    /// Set `name`'s child: a name already there keeps its place, a new one goes last.
    pub(crate) fn insert(&mut self, py: Python<'_>, name: &[u8], child: Child) -> PyResult<()> {
        self.insert_ptr(name, ChildPtr::new(py, child))
    }

    fn insert_ptr(&mut self, name: &[u8], child: ChildPtr) -> PyResult<()> {
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
    pub(crate) fn remove(&mut self, name: &[u8]) -> Option<ChildPtr> {
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
                self.insert_ptr(slot_name(&old_names, &s), child)
                    .expect("smaller than before");
            }
        }
    }

    /// (name, child) in insertion order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], ChildRef<'_>)> {
        self.slots
            .iter()
            .filter_map(|s| s.child.as_ref().map(|c| (slot_name(&self.names, s), c.get())))
    }

    /// (name, child) in insertion order, the children to change.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (&[u8], ChildMut<'_>)> {
        let names = &self.names;
        self.slots.iter_mut().filter_map(move |s| {
            let name = slot_name(names, s);
            s.child.as_mut().map(|c| (name, c.get_mut()))
        })
    }

    /// The slots of the live entries, sorted by name (bytewise, as `sorted` sorts bytes).
    pub(crate) fn sorted_slots(&self) -> Vec<u32> {
        // sorted as (name, slot) pairs: a comparison reads the names without going
        // through the slots
        let mut v: Vec<(&[u8], u32)> = (0u32..)
            .zip(&self.slots)
            .filter(|(_, s)| s.child.is_some())
            .map(|(i, s)| (slot_name(&self.names, s), i))
            .collect();
        v.sort_unstable_by(|a, b| a.0.cmp(b.0));
        v.into_iter().map(|(_, i)| i).collect()
    }

    /// (name, child) sorted by name.
    pub(crate) fn sorted(&self) -> Vec<(&[u8], ChildRef<'_>)> {
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
    fn new(py: Python<'_>, entries: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut me = Entries::empty();
        if let Some(m) = entries.filter(|m| !m.is_none()) {
            for item in m.call_method0("items")?.try_iter()? {
                let (name, child): (Bound<'_, PyBytes>, Bound<'_, Inode>) = item?.extract()?;
                me.insert(py, name.as_bytes(), Child::Object(child.unbind()))?;
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

    fn __getitem__<'py>(&mut self, name: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Inode>> {
        let py = name.py();
        match name.cast::<PyBytes>().ok().and_then(|n| self.find(n.as_bytes())) {
            Some(i) => Ok(self.object_at(py, i)?.into_bound(py)),
            None => Err(PyKeyError::new_err(name.clone().unbind())),
        }
    }

    fn __setitem__(&mut self, name: &Bound<'_, PyBytes>, child: &Bound<'_, Inode>) -> PyResult<()> {
        self.insert(name.py(), name.as_bytes(), Child::Object(child.clone().unbind()))
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
    fn py_get<'py>(
        &mut self,
        name: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = name.py();
        match name.cast::<PyBytes>().ok().and_then(|n| self.find(n.as_bytes())) {
            Some(i) => Ok(self.object_at(py, i)?.into_bound(py).into_any()),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let mut parts = Vec::with_capacity(self.live);
        for (n, c) in self.iter() {
            parts.push(format!("{}: {}", PyBytes::new(py, n).repr()?, c.data(py)?.repr(py)?));
        }
        Ok(format!("Entries({{{}}})", parts.join(", ")))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (_, c) in self.iter() {
            c.traverse(&visit)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        *self = Entries::empty();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_two_words_and_its_child_one() {
        // an object child is its pointer in the slot, an inline child one box of its fields
        assert_eq!(std::mem::size_of::<ChildPtr>(), 8);
        assert_eq!(std::mem::size_of::<Slot>(), 16);
    }
}
