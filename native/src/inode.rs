//! `tree.Inode`, one file object of the merged tree, with its fields held here rather than
//! in Python objects: type, mode and owner as integers, the three timestamps as i64 (None
//! as a flag; values outside i64 are kept as the tuple they came in), one payload for
//! whatever the type carries (a Blob as its four fields, set-aside content as its store,
//! offset and size, anything else as the object given) and the writer's `ino` scratch.
//! The Python API is tree.Inode's (docs/design.md, "The tree"); the extension's own code
//! (place.rs, numbering.rs, fsitems.rs) reads and makes inodes through a borrow.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyTuple, PyType};

use crate::entries::{entries_new, entries_of, Entries};
use pyo3::{intern, PyTraverseError};

pub(crate) const S_IFMT: u32 = 0o170000;
pub(crate) const S_IFREG: u32 = 0o100000;
pub(crate) const S_IFDIR: u32 = 0o040000;
pub(crate) const S_IFLNK: u32 = 0o120000;
pub(crate) const S_IFCHR: u32 = 0o020000;
pub(crate) const S_IFBLK: u32 = 0o060000;
/// content up to this size stays in memory (a reference to set-aside content costs about this)
pub(crate) const ASIDE_MIN: usize = 96;
pub(crate) const PACK_BITS: u32 = 24; // tree._PACK_BITS

const A_NONE: u8 = 1; // atime unset (same as mtime)
const C_NONE: u8 = 2; // ctime unset
const BIG_TIMES: u8 = 4; // the times did not fit: `Extra.times` holds them

/// A Blob's four fields (`tree.Blob`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct BlobFields {
    pub crc: u32,
    pub pack: u32,
    pub size: u64,
    pub offset: u64,
}

/// What an inode's type carries.
pub(crate) enum Payload {
    /// content bytes, a Sparse, a symlink target, a directory's `Entries`, a device
    /// number, or whatever else was set
    Obj(Py<PyAny>),
    Blob(BlobFields),
    /// small content set aside in a `tree.AsideFile`
    Aside {
        store: Py<PyAny>,
        offset: u64,
        size: u64,
    },
    /// emptied by the cyclic GC
    Cleared,
}

/// What few inodes have, kept out of line.
#[derive(Default)]
struct Extra {
    xattrs: Option<Py<PyAny>>,
    times: Option<Py<PyTuple>>, // (mtime, atime or None, ctime or None) outside i64
}

/// One file's fields: an `Inode` object's, or a directory's child held inline in its
/// `Entries` until Python code asks for it (entries.rs).
pub struct InodeData {
    mtime: i64,
    atime: i64,
    ctime: i64,
    extra: Option<Box<Extra>>,
    payload: Payload,
    ino: Option<Py<PyAny>>, // None: 0
    mode: u32,
    uid: u32,
    gid: u32,
    kind: u8, // S_IFMT >> 12
    flags: u8,
}

/// One file object; a hardlink is the same object under several names.
#[pyclass(module = "btrfs_ublk_native")]
pub struct Inode {
    data: InodeData,
}

impl std::ops::Deref for Inode {
    type Target = InodeData;
    fn deref(&self) -> &InodeData {
        &self.data
    }
}

impl std::ops::DerefMut for Inode {
    fn deref_mut(&mut self) -> &mut InodeData {
        &mut self.data
    }
}

impl From<InodeData> for Inode {
    fn from(data: InodeData) -> Self {
        Inode { data }
    }
}

/// The three timestamps as stored.
pub(crate) enum Times<'a> {
    Small(i64, Option<i64>, Option<i64>),
    Big(&'a Py<PyTuple>),
}

static FILE_TYPES: PyOnceLock<Vec<Option<Py<PyAny>>>> = PyOnceLock::new();
static BLOB: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static SPARSE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INT_NEW: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static NO_XATTRS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static LOW_MASK: PyOnceLock<Py<PyAny>> = PyOnceLock::new(); // a Blob's int's low 128 bits

const TREE: &str = "btrfs_ublk_image.tree";

/// `tree.FileType`'s members by S_IFMT >> 12.
fn file_types(py: Python<'_>) -> PyResult<&Vec<Option<Py<PyAny>>>> {
    FILE_TYPES.get_or_try_init(py, || {
        let mut out: Vec<Option<Py<PyAny>>> = (0..16).map(|_| None).collect();
        for member in py.import(TREE)?.getattr("FileType")?.try_iter()? {
            let member = member?;
            let v: u32 = member.extract()?;
            out[(v >> 12) as usize & 15] = Some(member.unbind());
        }
        Ok(out)
    })
}

pub(crate) fn blob_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    BLOB.import(py, TREE, "Blob")
}

pub(crate) fn sparse_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    SPARSE.import(py, TREE, "Sparse")
}

/// A `tree.Blob` of these fields (its int made here: `Blob.__new__` would run Python code).
pub(crate) fn blob_object(py: Python<'_>, b: BlobFields) -> PyResult<Bound<'_, PyAny>> {
    let low = b.crc as u128 | (b.size as u128) << 32 | (b.pack as u128) << 96 | ((b.offset & 0xff) as u128) << 120;
    let high = b.offset >> 8;
    let mut value = low.into_pyobject(py)?.into_any();
    if high != 0 {
        value = high.into_pyobject(py)?.into_any().lshift(128)?.bitor(value)?;
    }
    let int_new = INT_NEW.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.get_type::<pyo3::types::PyInt>().getattr("__new__")?.unbind())
    })?;
    int_new.bind(py).call1((blob_type(py)?, value))
}

/// A Blob's fields from its int (offset, pack (24 bits), size (64), crc (32)); None when
/// the offset does not fit in 64 bits.
pub(crate) fn blob_fields(blob: &Bound<'_, PyAny>) -> PyResult<Option<BlobFields>> {
    let py = blob.py();
    let mask = LOW_MASK.get_or_try_init(py, || {
        Ok::<_, PyErr>(1u128.into_pyobject(py)?.lshift(128)?.sub(1)?.unbind())
    })?;
    let low: u128 = blob.bitand(mask.bind(py))?.extract()?;
    let Ok(high) = blob.rshift(128)?.extract::<u64>() else {
        return Ok(None);
    };
    if high >> 56 != 0 {
        return Ok(None);
    }
    Ok(Some(BlobFields {
        crc: low as u32,
        size: (low >> 32) as u64,
        pack: ((low >> 96) as u32) & ((1 << PACK_BITS) - 1),
        offset: (high << 8) | (low >> 120) as u64,
    }))
}

/// The payload for regular file content: a Blob's fields when it is one.
fn content_payload(value: &Bound<'_, PyAny>) -> PyResult<Payload> {
    if value.get_type().is(blob_type(value.py())?) {
        if let Some(b) = blob_fields(value)? {
            return Ok(Payload::Blob(b));
        }
    }
    Ok(Payload::Obj(value.clone().unbind()))
}

fn default_payload(py: Python<'_>, kind: u32) -> PyResult<Payload> {
    Ok(Payload::Obj(match kind {
        S_IFDIR => entries_new(py)?.into_any().unbind(),
        S_IFREG | S_IFLNK => PyBytes::new(py, b"").into_any().unbind(),
        _ => 0i64.into_pyobject(py)?.into_any().unbind(),
    }))
}

/// A directory's payload from a mapping: a `tree.Entries` as it is, another mapping copied
/// into one.
fn entries_payload(value: &Bound<'_, PyAny>) -> PyResult<Payload> {
    if value.cast::<Entries>().is_ok() {
        return Ok(Payload::Obj(value.clone().unbind()));
    }
    Ok(Payload::Obj(entries_of(value)?.into_any().unbind()))
}

/// S_IFMT >> 12 of a FileType value.
fn kind_of(value: &Bound<'_, PyAny>) -> PyResult<u8> {
    let v: u32 = value.extract()?;
    let k = (v >> 12) as usize & 15;
    if v & !S_IFMT != 0 || file_types(value.py())?[k].is_none() {
        return Err(PyValueError::new_err(format!("{v} is not a valid FileType")));
    }
    Ok(k as u8)
}

/// An optional time in i64, or None when it does not fit (or is not an int).
fn small_time(t: &Bound<'_, PyAny>) -> Option<Option<i64>> {
    if t.is_none() {
        return Some(None);
    }
    t.extract::<i64>().ok().map(Some)
}

impl InodeData {
    /// An inode as the tar placer makes it (no xattrs, `ino` 0).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn placed(
        kind: u32,
        mode: u32,
        uid: u32,
        gid: u32,
        mtime: i64,
        atime: Option<i64>,
        ctime: Option<i64>,
        payload: Payload,
    ) -> InodeData {
        let mut i = InodeData {
            mtime: 0,
            atime: 0,
            ctime: 0,
            extra: None,
            payload,
            ino: None,
            mode,
            uid,
            gid,
            kind: (kind >> 12) as u8,
            flags: 0,
        };
        i.set_small_times(mtime, atime, ctime);
        i
    }

    /// Visit the Python objects held (an `Inode`'s or its `Entries`' `__traverse__`).
    pub(crate) fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(e) = &self.extra {
            visit.call(&e.xattrs)?;
            visit.call(&e.times)?;
        }
        match &self.payload {
            Payload::Obj(o) => visit.call(o)?,
            Payload::Aside { store, .. } => visit.call(store)?,
            Payload::Blob(_) | Payload::Cleared => {}
        }
        visit.call(&self.ino)
    }

    /// Drop the Python objects held (the cyclic GC's `__clear__`).
    pub(crate) fn clear(&mut self) {
        if let Some(e) = self.extra.as_mut() {
            e.xattrs = None;
            if e.times.take().is_some() {
                self.flags = 0; // times of 0
                self.mtime = 0;
            }
        }
        self.extra = None;
        self.payload = Payload::Cleared;
        self.ino = None;
    }

    /// What stands in for fields moved out (never read: the slot holds their object next).
    pub(crate) fn placeholder() -> InodeData {
        InodeData::placed(0, 0, 0, 0, 0, None, None, Payload::Cleared)
    }

    /// `Inode.__repr__`.
    pub(crate) fn repr(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Inode({}, mode={:#o}, uid={}, gid={})",
            self.type_name(py)?,
            self.mode,
            self.uid,
            self.gid
        ))
    }

    /// The type's S_IFMT bits.
    pub(crate) fn kind(&self) -> u32 {
        (self.kind as u32) << 12
    }

    pub(crate) fn is_dir(&self) -> bool {
        self.kind() == S_IFDIR
    }

    pub(crate) fn perm(&self) -> u32 {
        self.mode
    }

    pub(crate) fn owner(&self) -> (u32, u32) {
        (self.uid, self.gid)
    }

    pub(crate) fn payload(&self) -> &Payload {
        &self.payload
    }

    pub(crate) fn xattrs_obj(&self) -> Option<&Py<PyAny>> {
        self.extra.as_ref().and_then(|e| e.xattrs.as_ref())
    }

    /// A directory's entries (name -> Inode).
    pub(crate) fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, Entries>> {
        match &self.payload {
            Payload::Obj(o) => o
                .bind(py)
                .clone()
                .cast_into::<Entries>()
                .map_err(|_| PyTypeError::new_err("directory entries are not Entries")),
            _ => Err(PyTypeError::new_err("directory entries are not Entries")),
        }
    }

    /// Whether `ino` is `mark` (the numbering's marks are objects of their own).
    pub(crate) fn ino_is(&self, mark: &Bound<'_, PyAny>) -> bool {
        self.ino.as_ref().is_some_and(|i| i.as_ptr() == mark.as_ptr())
    }

    pub(crate) fn ino_obj<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        match &self.ino {
            Some(i) => i.bind(py).clone(),
            None => 0i64.into_pyobject(py).expect("an int").into_any(),
        }
    }

    pub(crate) fn set_ino(&mut self, value: Py<PyAny>) {
        self.ino = Some(value);
    }

    pub(crate) fn times(&self) -> Times<'_> {
        if self.flags & BIG_TIMES != 0 {
            if let Some(t) = self.extra.as_ref().and_then(|e| e.times.as_ref()) {
                return Times::Big(t);
            }
        }
        Times::Small(
            self.mtime,
            (self.flags & A_NONE == 0).then_some(self.atime),
            (self.flags & C_NONE == 0).then_some(self.ctime),
        )
    }

    fn extra_mut(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Default::default)
    }

    /// Drop the out-of-line part when it holds nothing.
    fn trim_extra(&mut self) {
        if self
            .extra
            .as_ref()
            .is_some_and(|e| e.xattrs.is_none() && e.times.is_none())
        {
            self.extra = None;
        }
    }

    fn set_small_times(&mut self, m: i64, a: Option<i64>, c: Option<i64>) {
        self.mtime = m;
        self.atime = a.unwrap_or(0);
        self.ctime = c.unwrap_or(0);
        self.flags = if a.is_none() { A_NONE } else { 0 } | if c.is_none() { C_NONE } else { 0 };
        if let Some(e) = self.extra.as_mut() {
            e.times = None;
        }
        self.trim_extra();
    }

    /// Set the times from Python values: natively when they fit in i64, else kept as given.
    pub(crate) fn set_times(
        &mut self,
        m: &Bound<'_, PyAny>,
        a: &Bound<'_, PyAny>,
        c: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        if let (Some(Some(mv)), Some(av), Some(cv)) = (small_time(m), small_time(a), small_time(c)) {
            self.set_small_times(mv, av, cv);
            return Ok(());
        }
        let t = PyTuple::new(m.py(), [m, a, c])?;
        self.extra_mut().times = Some(t.unbind());
        self.flags = BIG_TIMES;
        Ok(())
    }

    /// (mtime, atime or None, ctime or None) as Python values.
    pub(crate) fn times_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        match self.times() {
            Times::Big(t) => Ok(t.bind(py).clone()),
            Times::Small(m, a, c) => (m, a, c).into_pyobject(py),
        }
    }

    fn times_item<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        match self.times() {
            Times::Big(t) => t.bind(py).get_item(i),
            Times::Small(m, a, c) => Ok(match i {
                0 => m.into_pyobject(py)?.into_any(),
                1 => a.into_pyobject(py)?,
                _ => c.into_pyobject(py)?,
            }),
        }
    }

    fn set_time(&mut self, py: Python<'_>, i: usize, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = self.times_tuple(py)?;
        let mut v = [t.get_item(0)?, t.get_item(1)?, t.get_item(2)?];
        v[i] = value.clone();
        self.set_times(&v[0], &v[1], &v[2])
    }

    fn set_xattrs(&mut self, value: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let value = match value {
            Some(v) if !v.is_none() && v.is_truthy()? => Some(v.clone().unbind()),
            _ => None,
        };
        if value.is_some() {
            self.extra_mut().xattrs = value;
        } else if let Some(e) = self.extra.as_mut() {
            e.xattrs = None;
            self.trim_extra();
        }
        Ok(())
    }

    fn type_name(&self, py: Python<'_>) -> PyResult<String> {
        self.file_type(py)?.getattr(intern!(py, "name"))?.extract()
    }

    fn file_type<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(file_types(py)?[self.kind as usize]
            .as_ref()
            .expect("a valid kind")
            .bind(py)
            .clone())
    }

    fn check(&self, py: Python<'_>, want: u32, what: &str) -> PyResult<()> {
        if self.kind() != want {
            return Err(PyValueError::new_err(format!(
                "a {} inode has no {what}",
                self.type_name(py)?
            )));
        }
        Ok(())
    }

    /// The payload as Python reads it (a Blob made from its fields; set-aside content as
    /// its place, not read).
    fn payload_obj<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(match &self.payload {
            Payload::Obj(o) => Some(o.bind(py).clone()),
            Payload::Blob(b) => Some(blob_object(py, *b)?),
            Payload::Aside { .. } | Payload::Cleared => None,
        })
    }
}

#[pymethods]
impl Inode {
    #[new]
    #[pyo3(signature = (
        r#type, mode=0o644, uid=0, gid=0, mtime_ns=None, atime_ns=None, ctime_ns=None,
        xattrs=None, rdev=None, target=None, content=None, entries=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        r#type: &Bound<'_, PyAny>,
        mode: u32,
        uid: u32,
        gid: u32,
        mtime_ns: Option<&Bound<'_, PyAny>>,
        atime_ns: Option<&Bound<'_, PyAny>>,
        ctime_ns: Option<&Bound<'_, PyAny>>,
        xattrs: Option<&Bound<'_, PyAny>>,
        rdev: Option<&Bound<'_, PyAny>>,
        target: Option<&Bound<'_, PyAny>>,
        content: Option<&Bound<'_, PyAny>>,
        entries: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let kind = kind_of(r#type)?;
        let k = (kind as u32) << 12;
        let given = |v: Option<&Bound<'_, PyAny>>| v.map(|v| v.clone().unbind());
        let payload = match k {
            S_IFREG => match content {
                Some(c) => content_payload(c)?,
                None => default_payload(py, k)?,
            },
            S_IFDIR => match entries.filter(|e| !e.is_none()) {
                Some(e) => entries_payload(e)?,
                None => default_payload(py, k)?,
            },
            S_IFLNK => match given(target) {
                Some(t) => Payload::Obj(t),
                None => default_payload(py, k)?,
            },
            S_IFCHR | S_IFBLK => match given(rdev) {
                Some(r) => Payload::Obj(r),
                None => default_payload(py, k)?,
            },
            _ => default_payload(py, k)?,
        };
        let mut inode = InodeData::placed(k, mode, uid, gid, 0, None, None, payload);
        let none = py.None().into_bound(py);
        let zero = 0i64.into_pyobject(py)?.into_any();
        inode.set_times(
            mtime_ns.unwrap_or(&zero),
            atime_ns.unwrap_or(&none),
            ctime_ns.unwrap_or(&none),
        )?;
        inode.set_xattrs(xattrs)?;
        Ok(inode.into())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        self.data.repr(py)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.data.traverse(&visit)
    }

    fn __clear__(&mut self) {
        self.data.clear();
    }

    #[getter]
    fn get_mode(&self) -> u32 {
        self.mode
    }

    #[setter]
    fn set_mode(&mut self, value: u32) {
        self.mode = value;
    }

    #[getter]
    fn get_uid(&self) -> u32 {
        self.uid
    }

    #[setter]
    fn set_uid(&mut self, value: u32) {
        self.uid = value;
    }

    #[getter]
    fn get_gid(&self) -> u32 {
        self.gid
    }

    #[setter]
    fn set_gid(&mut self, value: u32) {
        self.gid = value;
    }

    #[getter(r#type)]
    fn get_type<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.file_type(py)
    }

    /// Setting the type resets the payload to the new type's empty one.
    #[setter(r#type)]
    fn set_type(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.kind = kind_of(value)?;
        self.payload = default_payload(py, self.kind())?;
        Ok(())
    }

    #[getter]
    fn get_mtime_ns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.times_item(py, 0)
    }

    #[setter]
    fn set_mtime_ns(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.set_time(py, 0, value)
    }

    #[getter]
    fn get_atime_ns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.times_item(py, 1)
    }

    #[setter]
    fn set_atime_ns(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.set_time(py, 1, value)
    }

    #[getter]
    fn get_ctime_ns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.times_item(py, 2)
    }

    #[setter]
    fn set_ctime_ns(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.set_time(py, 2, value)
    }

    /// (type, mode, uid, gid, xattrs or None) in one go (the writer reads them all).
    fn meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let x = match self.xattrs_obj() {
            Some(x) => x.bind(py).clone(),
            None => py.None().into_bound(py),
        };
        (self.file_type(py)?, self.mode, self.uid, self.gid, x).into_pyobject(py)
    }

    /// (mtime_ns, atime_ns, ctime_ns) in one go.
    #[pyo3(name = "times")]
    fn py_times<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        self.times_tuple(py)
    }

    /// An empty mapping when there are none; set a new mapping to change them.
    #[getter]
    fn get_xattrs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match self.xattrs_obj() {
            Some(x) => Ok(x.bind(py).clone()),
            None => Ok(NO_XATTRS.import(py, TREE, "_NO_XATTRS")?.clone()),
        }
    }

    #[setter(xattrs)]
    fn set_xattrs_py(&mut self, value: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        self.set_xattrs(value)
    }

    /// Regular files' content (bytes, a Blob or a Sparse; set-aside content read back);
    /// empty on other types.
    #[getter]
    fn get_content<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if self.kind() != S_IFREG {
            return Ok(PyBytes::new(py, b"").into_any());
        }
        if let Payload::Aside { store, offset, size } = &self.payload {
            return store.bind(py).call_method1(intern!(py, "read"), (*offset, *size));
        }
        Ok(self
            .payload_obj(py)?
            .unwrap_or_else(|| PyBytes::new(py, b"").into_any()))
    }

    #[setter]
    fn set_content(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.check(py, S_IFREG, "content")?;
        self.payload = content_payload(value)?;
        Ok(())
    }

    #[getter]
    fn get_target<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match &self.payload {
            Payload::Obj(o) if self.kind() == S_IFLNK => Ok(o.bind(py).clone()),
            _ => Ok(PyBytes::new(py, b"").into_any()),
        }
    }

    #[setter]
    fn set_target(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.check(py, S_IFLNK, "target")?;
        self.payload = Payload::Obj(value.clone().unbind());
        Ok(())
    }

    #[getter]
    fn get_entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match &self.payload {
            Payload::Obj(o) if self.is_dir() => Ok(o.bind(py).clone()),
            _ => Ok(entries_new(py)?.into_any()),
        }
    }

    /// A mapping other than `tree.Entries` is copied into one.
    #[setter]
    fn set_entries(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.check(py, S_IFDIR, "entries")?;
        self.payload = entries_payload(value)?;
        Ok(())
    }

    #[getter]
    fn get_rdev<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match &self.payload {
            Payload::Obj(o) if matches!(self.kind(), S_IFCHR | S_IFBLK) => Ok(o.bind(py).clone()),
            _ => Ok(0i64.into_pyobject(py)?.into_any()),
        }
    }

    #[setter]
    fn set_rdev(&mut self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        if !matches!(self.kind(), S_IFCHR | S_IFBLK) {
            return Err(PyValueError::new_err(format!(
                "a {} inode has no device number",
                self.type_name(py)?
            )));
        }
        self.payload = Payload::Obj(value.clone().unbind());
        Ok(())
    }

    /// Content size (regular files) or target length (symlinks); 0 for other types.
    #[getter]
    fn get_size(&self, py: Python<'_>) -> PyResult<u64> {
        let obj_size = |o: &Py<PyAny>| -> PyResult<u64> {
            let o = o.bind(py);
            if o.is_instance(blob_type(py)?)? || o.is_instance(sparse_type(py)?)? {
                return o.getattr(intern!(py, "size"))?.extract();
            }
            Ok(o.len()? as u64)
        };
        match (self.kind(), &self.payload) {
            (S_IFREG, Payload::Blob(b)) => Ok(b.size),
            (S_IFREG, Payload::Aside { size, .. }) => Ok(*size),
            (S_IFREG, Payload::Obj(o)) => obj_size(o),
            (S_IFLNK, Payload::Obj(o)) => Ok(o.bind(py).len()? as u64),
            _ => Ok(0),
        }
    }

    #[getter]
    fn get_st_mode(&self) -> u32 {
        self.kind() | (self.mode & 0o7777)
    }

    /// The writer's scratch while it writes an image: a mark, or the inode number of a
    /// directory or hardlinked file.
    #[getter]
    fn get_ino<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.ino_obj(py)
    }

    #[setter(ino)]
    fn set_ino_py(&mut self, value: &Bound<'_, PyAny>) {
        self.ino = Some(value.clone().unbind());
    }

    /// Move in-memory content (worth moving) to ``store`` (a ``tree.AsideFile``); it reads
    /// back unchanged.
    fn set_content_aside(slf: &Bound<'_, Self>, store: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = {
            let me = slf.borrow();
            match &me.payload {
                Payload::Obj(o) if me.kind() == S_IFREG => match o.bind(slf.py()).cast_exact::<PyBytes>() {
                    Ok(b) if b.as_bytes().len() > ASIDE_MIN => b.clone(),
                    _ => return Ok(()),
                },
                _ => return Ok(()),
            }
        };
        let offset: u64 = store.call_method1(intern!(slf.py(), "put"), (&data,))?.extract()?;
        slf.borrow_mut().payload = Payload::Aside {
            store: store.clone().unbind(),
            offset,
            size: data.as_bytes().len() as u64,
        };
        Ok(())
    }

    /// (offset, size) of set-aside content in its store; None when the content is not set
    /// aside.
    fn aside_at(&self) -> Option<(u64, u64)> {
        match &self.payload {
            Payload::Aside { offset, size, .. } => Some((*offset, *size)),
            _ => None,
        }
    }

    /// What ``take_metadata`` replaces, for ``restore_metadata`` (a layer's placement
    /// undone): (type, mode, uid, gid, xattrs or None, times).
    fn saved_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let m = self.meta(py)?;
        PyTuple::new(
            py,
            [
                m.get_item(0)?,
                m.get_item(1)?,
                m.get_item(2)?,
                m.get_item(3)?,
                m.get_item(4)?,
                self.times_tuple(py)?.into_any(),
            ],
        )
    }

    /// Back to what ``saved_metadata`` saved (the payload stays).
    fn restore_metadata(&mut self, saved: &Bound<'_, PyTuple>) -> PyResult<()> {
        let (t, mode, uid, gid, x, times): (Bound<'_, PyAny>, u32, u32, u32, Bound<'_, PyAny>, Bound<'_, PyTuple>) =
            saved.extract()?;
        self.kind = kind_of(&t)?;
        (self.mode, self.uid, self.gid) = (mode, uid, gid);
        self.set_xattrs(Some(&x))?;
        self.set_times(&times.get_item(0)?, &times.get_item(1)?, &times.get_item(2)?)
    }

    /// Mode, owner, times and xattrs of ``other`` (a later layer's entry for this directory).
    fn take_metadata(slf: &Bound<'_, Self>, other: &Bound<'_, Inode>) -> PyResult<()> {
        let py = slf.py();
        let (mode, uid, gid, x, times) = {
            let o = other.borrow();
            (
                o.mode,
                o.uid,
                o.gid,
                o.xattrs_obj().map(|x| x.clone_ref(py)),
                o.times_tuple(py)?,
            )
        };
        let mut me = slf.borrow_mut();
        (me.mode, me.uid, me.gid) = (mode, uid, gid);
        me.set_xattrs(x.as_ref().map(|x| x.bind(py)))?;
        me.set_times(&times.get_item(0)?, &times.get_item(1)?, &times.get_item(2)?)
    }
}

/// No timestamp under `root` later than `limit_ns` (SOURCE_DATE_EPOCH clamping): every
/// inode reached from the root directory once, its times rewritten in place.
#[pyfunction]
pub fn clamp_tree_times(root: &Bound<'_, Inode>, limit_ns: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = root.py();
    let limit = limit_ns.extract::<i64>().ok();
    clamp(&mut root.borrow_mut(), limit, limit_ns)?;
    let mut todo = if root.borrow().is_dir() {
        vec![root.borrow().entries(py)?]
    } else {
        vec![]
    };
    let mut seen = std::collections::HashSet::new();
    while let Some(dir) = todo.pop() {
        if !seen.insert(dir.as_ptr() as usize) {
            continue;
        }
        let mut entries = dir.borrow_mut();
        for (_, child) in entries.iter_mut() {
            let mut c = child.data_mut(py)?;
            clamp(&mut c, limit, limit_ns)?;
            if c.is_dir() {
                todo.push(c.entries(py)?);
            }
        }
    }
    Ok(())
}

/// One inode's times clamped to the limit (`limit`: the limit when it fits in i64).
fn clamp(node: &mut InodeData, limit: Option<i64>, limit_ns: &Bound<'_, PyAny>) -> PyResult<()> {
    if let (Times::Small(m, a, c), Some(l)) = (node.times(), limit) {
        if m > l || a.is_some_and(|a| a > l) || c.is_some_and(|c| c > l) {
            node.set_small_times(m.min(l), a.map(|a| a.min(l)), c.map(|c| c.min(l)));
        }
        return Ok(());
    }
    // times or limit outside i64: compared as Python ints
    let py = limit_ns.py();
    let t = node.times_tuple(py)?;
    let mut v = [t.get_item(0)?, t.get_item(1)?, t.get_item(2)?];
    let mut later = false;
    for x in v.iter_mut() {
        if !x.is_none() && x.gt(limit_ns)? {
            *x = limit_ns.clone();
            later = true;
        }
    }
    if later {
        node.set_times(&v[0], &v[1], &v[2])?;
    }
    Ok(())
}
