//! The common tar member placed in the tree without running Python code per member
//! (`sources/tar.py`'s `_place_member` and `LayerContext.place`, kept as the reference and
//! for every other member): a plain regular file, directory or symlink (no xattrs, no `..`
//! in its path, not a whiteout) whose directory is the one `place` resolved last
//! (`LayerContext._last_dir`), or a path of plain directories (which becomes `_last_dir`, as
//! `place` makes it), and whose name is new there (in OCI layers, its path is added
//! to `LayerContext.upper` as `_mark_upper` adds it). Its `Inode` (inode.rs) is made here
//! with the fields `Inode(...)` would give it, small content is set aside as
//! `tree.AsideFile.put` sets it, the undo log gets its entry and progress counts the
//! members in bulk. Anything else goes to the Python callable, in
//! archive order, so the tree, the warnings and the errors are the Python path's.

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySet, PyTuple};

use crate::entries::{entries_new, Child, Entries};
use crate::inode::{BlobFields, Inode, InodeData, Payload, ASIDE_MIN, PACK_BITS, S_IFDIR, S_IFLNK, S_IFREG};
use crate::numbering::Names;
use crate::tar::{is_regular, Content, Rec, Records};
use crate::Members;

const NO_OWNER: i64 = 0xFFFF_FFFF; // (uid_t)-1: root's 0, as tar.py reads it
const NAME_MAX: usize = 255;
const PATH_MAX: usize = 4096; // base.PATH_MAX: a symlink target must be shorter
/// set-aside content handed to the side file this much at a time: a segment's whole
/// (up to 4 MiB), held twice while it is written, showed in the build's peak RSS
const ASIDE_BATCH: usize = 256 << 10;

/// `LayerContext._last_dir` as last read: its path components and the directory's entries.
struct LastDir {
    parts: Vec<Vec<u8>>,
    entries: Option<Py<Entries>>, // None: not a directory's entries now (members go slow)
    resolved: Vec<u8>,
}

/// Places one layer's members (`read_tar`'s `place` callback, one call per segment).
#[pyclass]
pub(crate) struct Placer {
    ctx: Py<PyAny>,
    slow: Py<PyAny>, // one member tuple (as `Members` gives it) -> placed by the Python path
    uid: Option<i64>,
    gid: Option<i64>,
    whiteouts: bool,
    last: Option<LastDir>,
    /// members placed here since progress was last told
    placed: usize,
}

/// The side file's writes not yet handed to it, and where its end is (None: read it again).
struct Aside<'py> {
    store: Bound<'py, PyAny>,
    end: Option<u64>,
    pending: Vec<u8>,
}

impl<'py> Aside<'py> {
    fn flush(&mut self, py: Python<'py>) -> PyResult<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let file = self.store.getattr(intern!(py, "_file"))?;
        file.call_method1(intern!(py, "write"), (PyBytes::new(py, &self.pending),))?;
        self.store.setattr(intern!(py, "_dirty"), true)?;
        let end = self.end.expect("pending bytes have an end") + self.pending.len() as u64;
        self.store.setattr(intern!(py, "_end"), end)?;
        self.end = Some(end);
        self.pending.clear();
        Ok(())
    }
}

/// One `place` call's objects.
struct Call<'py> {
    ctx: Bound<'py, PyAny>,
    tree: Bound<'py, PyAny>,
    aside: Option<Aside<'py>>,
    changes: Option<Bound<'py, PyList>>, // the undo log (the native read may hand back)
    /// the undo log's last entry when it is the names placed here in one directory (its
    /// entries' address): the names of a run of members go into one `Names`
    batch: Option<(usize, Bound<'py, Names>)>,
    upper: Option<Bound<'py, PySet>>, // OCI layers: `LayerContext.upper`
}

/// `tree.split_path` for the paths it handles without climbing: None when a component is
/// `..` (the Python path resolves those).
fn split_plain(path: &[u8]) -> Option<Vec<&[u8]>> {
    let mut parts = Vec::new();
    for comp in path.split(|&b| b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => return None,
            _ => parts.push(comp),
        }
    }
    Some(parts)
}

#[pymethods]
impl Placer {
    #[new]
    #[pyo3(signature = (ctx, uid, gid, whiteouts, slow))]
    fn new(ctx: Py<PyAny>, uid: Option<i64>, gid: Option<i64>, whiteouts: bool, slow: Py<PyAny>) -> Self {
        Placer {
            ctx,
            slow,
            uid,
            gid,
            whiteouts,
            last: None,
            placed: 0,
        }
    }

    /// Place every member left in `members`, in order.
    fn place(&mut self, py: Python<'_>, members: &Bound<'_, Members>) -> PyResult<()> {
        self.last = None; // other Python threads may have run since the last segment
        let ctx = self.ctx.bind(py).clone();
        let upper = ctx.getattr(intern!(py, "upper"))?;
        let upper = if upper.is_none() {
            None
        } else {
            Some(upper.cast_into::<PySet>()?)
        };
        let changes = ctx.getattr(intern!(py, "_changes"))?;
        let changes = if changes.is_none() {
            None
        } else {
            Some(
                changes
                    .cast_into::<PyList>()
                    .map_err(|_| PyTypeError::new_err("LayerContext._changes: not a list"))?,
            )
        };
        let mut call = Call {
            tree: ctx.getattr(intern!(py, "tree"))?,
            ctx,
            aside: None,
            changes,
            batch: None,
            upper,
        };
        let mut m = members.borrow_mut();
        let result = (|| -> PyResult<()> {
            while let Some(seg) = m.segments.front() {
                for r in &seg.recs[m.next..] {
                    if !self.fast(py, &mut call, seg, r)? {
                        if let Some(a) = call.aside.as_mut() {
                            a.flush(py)?; // the Python path may put content too
                            a.end = None;
                        }
                        self.last = None; // the Python path may change it
                        call.batch = None; // its changes come after this batch's
                        self.tell_progress(py, &call.ctx)?;
                        self.slow.bind(py).call1((crate::member_tuple(py, seg, r)?,))?;
                    }
                }
                m.pop_front();
            }
            Ok(())
        })();
        if let Some(a) = call.aside.as_mut() {
            a.flush(py)?;
        }
        self.tell_progress(py, &call.ctx)?;
        result
    }
}

impl Placer {
    fn tell_progress(&mut self, py: Python<'_>, ctx: &Bound<'_, PyAny>) -> PyResult<()> {
        if self.placed == 0 {
            return Ok(());
        }
        let progress = ctx.getattr(intern!(py, "progress"))?;
        if !progress.is_none() {
            progress.call_method1(intern!(py, "add_file"), (self.placed,))?;
        }
        self.placed = 0;
        Ok(())
    }

    /// `ctx._last_dir`'s components and entries (read again after the Python path ran).
    fn last_dir(&mut self, py: Python<'_>, ctx: &Bound<'_, PyAny>) -> PyResult<Option<&LastDir>> {
        // only Python code changes it, and none runs between two members placed here
        if self.last.is_some() {
            return Ok(self.last.as_ref());
        }
        let now = ctx.getattr(intern!(py, "_last_dir"))?;
        if now.is_none() {
            return Ok(None);
        }
        {
            let t = now.cast::<PyTuple>()?;
            let parts: Vec<Vec<u8>> = t.get_item(0)?.extract()?;
            // `node.entries` as `place` reads it: the dict of a directory only
            let node = t.get_item(1)?.cast_into::<Inode>()?;
            let node = node.borrow();
            let entries = if node.is_dir() {
                Some(node.entries(py)?.unbind())
            } else {
                None
            };
            // `_mark_upper`'s key of the directory: its resolved components joined
            let resolved: Vec<Vec<u8>> = t.get_item(2)?.extract()?;
            let resolved = resolved.join(&b'/');
            self.last = Some(LastDir {
                parts,
                entries,
                resolved,
            });
        }
        Ok(self.last.as_ref())
    }

    /// `LayerContext._resolve_dir`'s fast path, as `place` takes it: `dir` made of plain
    /// directories all the way from the root, which becomes `_last_dir` (its components
    /// given and resolved the same list). False (nothing changed): the Python path resolves
    /// it (symlinks, missing directories, a file in the way).
    fn resolve_plain(&mut self, py: Python<'_>, call: &Call<'_>, dir: &[&[u8]]) -> PyResult<bool> {
        let mut node = call.tree.getattr(intern!(py, "root"))?.cast_into::<Inode>()?;
        if !node.borrow().is_dir() {
            return Ok(false);
        }
        let names = PyList::empty(py);
        for comp in dir {
            let entries = node.borrow().entries(py)?;
            // a child held inline is never a directory (`fast` makes directories objects)
            let Some(child) = entries
                .borrow()
                .get(comp)
                .and_then(|c| c.object())
                .map(|o| o.bind(py).clone())
            else {
                return Ok(false);
            };
            if !child.borrow().is_dir() {
                return Ok(false);
            }
            names.append(PyBytes::new(py, comp))?;
            node = child;
        }
        let entries = node.borrow().entries(py)?;
        call.ctx.setattr(
            intern!(py, "_last_dir"),
            PyTuple::new(py, [names.as_any(), &node, names.as_any()])?,
        )?;
        self.last = Some(LastDir {
            parts: dir.iter().map(|c| c.to_vec()).collect(),
            entries: Some(entries.unbind()),
            resolved: dir.join(&b'/'),
        });
        Ok(true)
    }

    /// Place `r` here if it is the common member; false: the Python path's.
    fn fast<'py>(&mut self, py: Python<'py>, call: &mut Call<'py>, seg: &Records, r: &Rec) -> PyResult<bool> {
        let kind = match r.typ {
            t if is_regular(t) => S_IFREG,
            b'5' => S_IFDIR,
            b'2' => S_IFLNK,
            _ => return Ok(false),
        };
        if r.xattrs.1 != 0 {
            return Ok(false);
        }
        let s = |(at, n): (usize, usize)| &seg.names[at..at + n];
        let path = s(r.name);
        let base = &path[path.iter().rposition(|&b| b == b'/').map_or(0, |i| i + 1)..];
        let Some(parts) = split_plain(path) else {
            return Ok(false);
        };
        let Some((&name, dir)) = parts.split_last() else {
            return Ok(false); // the image root
        };
        if self.whiteouts && (base.starts_with(b".wh.") || name.starts_with(b".wh.")) {
            return Ok(false);
        }
        if name.len() > NAME_MAX || name.contains(&0) {
            return Ok(false); // check_name's error
        }
        let owner = |over: Option<i64>, v: i64| over.unwrap_or(if v == NO_OWNER { 0 } else { v });
        let (uid, gid) = (owner(self.uid, r.uid), owner(self.gid, r.gid));
        let (Ok(uid), Ok(gid)) = (u32::try_from(uid), u32::try_from(gid)) else {
            return Ok(false); // out of range: the error
        };
        let link = s(r.link);
        if kind == S_IFLNK && (link.is_empty() || link.len() >= PATH_MAX || link.contains(&0)) {
            return Ok(false); // the invalid target's error
        }
        let mode = if kind == S_IFLNK {
            0o777
        } else {
            (r.mode & 0o7777) as u32
        };
        // small content worth setting aside: the side file must exist (the Python path makes it)
        let inline = match r.content {
            Content::Inline(at, n) if kind == S_IFREG => Some(&seg.data[at..at + n]),
            _ => None,
        };
        let set_aside = inline.is_some_and(|d| d.len() > ASIDE_MIN);
        if set_aside && call.aside.is_none() {
            let store = call.tree.getattr(intern!(py, "_aside"))?;
            if store.is_none() {
                return Ok(false);
            }
            call.aside = Some(Aside {
                store,
                end: None,
                pending: Vec::new(),
            });
        }
        let same = self.last_dir(py, &call.ctx)?.is_some_and(|last| {
            last.parts.len() == dir.len() && last.parts.iter().zip(dir).all(|(a, b)| a.as_slice() == *b)
        });
        if !same && !self.resolve_plain(py, call, dir)? {
            return Ok(false);
        }
        let last = self.last.as_ref().expect("the directory resolved");
        let Some(entries) = &last.entries else {
            return Ok(false);
        };
        let entries = entries.bind(py).clone();
        let last_resolved = if call.upper.is_some() {
            last.resolved.clone()
        } else {
            Vec::new()
        };
        if entries.borrow().contains(name) {
            return Ok(false);
        }
        let payload = match kind {
            S_IFREG => match r.content {
                Content::None => Payload::Obj(PyBytes::new(py, b"").into_any().unbind()),
                Content::Inline(..) => {
                    let data = inline.expect("inline content");
                    if set_aside {
                        let a = call.aside.as_mut().expect("the side file");
                        let end = match a.end {
                            Some(e) => e,
                            None => a.store.getattr(intern!(py, "_end"))?.extract()?,
                        };
                        let at = end + a.pending.len() as u64;
                        a.end = Some(end);
                        a.pending.extend_from_slice(data);
                        if a.pending.len() >= ASIDE_BATCH {
                            a.flush(py)?;
                        }
                        Payload::Aside {
                            store: a.store.clone().unbind(),
                            offset: at,
                            size: data.len() as u64,
                        }
                    } else {
                        Payload::Obj(PyBytes::new(py, data).into_any().unbind())
                    }
                }
                Content::Blob(crc, size, pack, offset) => {
                    if pack >> PACK_BITS != 0 {
                        return Ok(false); // Blob's error
                    }
                    Payload::Blob(BlobFields {
                        crc,
                        pack,
                        size,
                        offset,
                    })
                }
            },
            S_IFDIR => Payload::Obj(entries_new(py)?.into_any().unbind()),
            _ => Payload::Obj(PyBytes::new(py, link).into_any().unbind()),
        };
        let inode = InodeData::placed(kind, mode, uid, gid, r.mtime_ns, r.atime_ns, r.ctime_ns, payload);
        // a directory is an object (the placer and Python code resolve paths through it);
        // anything else stays in its directory's entries until Python code asks for it
        let child = if kind == S_IFDIR {
            Child::Object(Py::new(py, Inode::from(inode))?)
        } else {
            Child::Inline(inode)
        };
        if let Some(upper) = &call.upper {
            // `LayerContext._mark_upper`: the path and its ancestors, as far as they are new
            let mut path = last_resolved;
            if !path.is_empty() {
                path.push(b'/');
            }
            path.extend_from_slice(name);
            while !path.is_empty() {
                let k = PyBytes::new(py, &path);
                if upper.contains(&k)? {
                    break;
                }
                if let Some(changes) = &call.changes {
                    changes.append(PyTuple::new(py, [upper.as_any(), k.as_any()])?)?;
                }
                upper.add(&k)?;
                path.truncate(path.iter().rposition(|&b| b == b'/').unwrap_or(0));
            }
        }
        if let Some(changes) = &call.changes {
            let here = entries.as_ptr() as usize;
            match &call.batch {
                Some((at, names)) if *at == here => names.borrow_mut().push(name)?,
                _ => {
                    let names = Bound::new(py, Names::default())?;
                    names.borrow_mut().push(name)?;
                    changes.append(PyTuple::new(py, [entries.as_any(), names.as_any()])?)?;
                    call.batch = Some((here, names));
                }
            }
        }
        entries.borrow_mut().insert(py, name, child)?;
        self.placed += 1;
        Ok(true)
    }
}
