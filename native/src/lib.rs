//! btrfs_ublk_native: the build's data path for tar layers in Rust (docs/design.md,
//! "Native data path"). Python keeps the spec, the tree, the btrfs writer and the reference
//! tar reader; this module reads a layer once (source digest, inflate, diff_id, tar headers,
//! CRC-32C, deduplication, pack writes, pack chunk digests on their own threads) and hands
//! back compact member records.

mod basepacks;
mod basescan;
mod blockform;
mod blocks;
mod direct;
mod entries;
mod extents;
mod fsitems;
mod inode;
mod leaves;
mod mapped;
mod numbering;
mod pack;
mod place;
mod prehash;
mod sha256x4;
mod stream;
mod tar;

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::FromRawFd;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use std::sync::mpsc::SyncSender;
use std::sync::Arc;

use pack::PackCore;
use stream::{Buf, Span};
use tar::{Content, Parser, Records};

pyo3::create_exception!(btrfs_ublk_native, Unsupported, pyo3::exceptions::PyException);

pub(crate) fn os_err(e: std::io::Error) -> PyErr {
    PyOSError::new_err((e.raw_os_error().unwrap_or(0), e.to_string()))
}

/// Pack 0 of a build (see pack.rs). Any one thread may use it at a time (a build reads its
/// first layer on a thread of its own while the program starts: `early.py`); every use
/// takes `&mut self` (pyo3's borrow flag), so the mutex is never locked, only `get_mut`.
#[pyclass]
struct Pack {
    core: std::sync::Mutex<Option<PackCore>>,
}

impl Pack {
    fn core(&mut self) -> PyResult<&mut PackCore> {
        self.core
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner) // never locked: never poisoned
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("pack is closed"))
    }
}

#[pymethods]
impl Pack {
    /// Writes to `fd` (taken over: closed with the pack), an empty file; `direct`: a layer's
    /// streamed content with O_DIRECT where the filesystem takes it (pack.rs).
    #[new]
    #[pyo3(signature = (fd, chunk_size, direct = true))]
    fn new(fd: i32, chunk_size: u64, direct: bool) -> Self {
        // SAFETY: the caller hands the fd over (os.dup of its own)
        let file = unsafe { File::from_raw_fd(fd) };
        Pack {
            core: std::sync::Mutex::new(Some(PackCore::new(file, chunk_size, direct))),
        }
    }

    /// The pack's fd, every byte appended so far written to it (reads go through it).
    fn fileno(&mut self) -> PyResult<i32> {
        let core = self.core()?;
        core.write_gathered().map_err(os_err)?;
        Ok(core.fd())
    }

    #[getter]
    fn size(&mut self) -> PyResult<u64> {
        Ok(self.core()?.size)
    }

    #[getter]
    fn bytes_in(&mut self) -> PyResult<u64> {
        Ok(self.core()?.bytes_in)
    }

    #[getter]
    fn bytes_deduped(&mut self) -> PyResult<u64> {
        Ok(self.core()?.bytes_deduped)
    }

    #[getter]
    fn bytes_reused(&mut self) -> PyResult<u64> {
        Ok(self.core()?.bytes_reused)
    }

    /// A base image's packs, for byte comparisons of candidates in them.
    fn set_base(&mut self, base: &basepacks::BasePacks) -> PyResult<()> {
        self.core()?.set_base(Arc::clone(&base.set));
        Ok(())
    }

    /// An in-place pack's fd, for byte comparisons of candidates in it.
    fn set_pack_fd(&mut self, pack: u32, fd: i32) -> PyResult<()> {
        self.core()?.set_pack_fd(pack, fd);
        Ok(())
    }

    fn candidates(&mut self, key: u64) -> PyResult<Vec<(u32, u64)>> {
        Ok(self.core()?.candidates(key))
    }

    fn remember(&mut self, key: u64, pack: u32, offset: u64) -> PyResult<()> {
        self.core()?.remember(key, (pack, offset));
        Ok(())
    }

    /// Append `pieces` (exactly `size` bytes, else ValueError with the count), deduplicated
    /// when `dedupe`: (crc32c, pack, offset) of the content (an earlier copy's place when
    /// it was a duplicate).
    fn append(
        &mut self,
        py: Python<'_>,
        pieces: &Bound<'_, PyAny>,
        size: u64,
        dedupe: bool,
    ) -> PyResult<(u32, u32, u64)> {
        let core = self.core()?;
        let mut crc = 0u32;
        let mut got = 0u64;
        if size <= pack::MEM_MAX {
            // gathered, then deduplicated before anything is written (no rollback to hash)
            let mut data = Vec::with_capacity(size as usize);
            for piece in pieces.try_iter()? {
                let piece = piece?;
                let b = piece.cast::<PyBytes>()?.as_bytes();
                got += b.len() as u64;
                if got > size {
                    break;
                }
                data.extend_from_slice(b);
            }
            if got != size {
                return Err(PyValueError::new_err(got));
            }
            let crc = crc32c::crc32c(&data);
            let span = Span::whole(Arc::new(Buf::owned(data)));
            let put = py.detach(|| core.put(&[span], crc, dedupe, None)).map_err(os_err)?;
            let (pack::Put::New(loc) | pack::Put::Dup(loc)) = put;
            return Ok((crc, loc.0, loc.1));
        }
        let mark = core.begin_stream();
        let mut take = || -> PyResult<()> {
            for piece in pieces.try_iter()? {
                let piece = piece?;
                let b = piece.cast::<PyBytes>()?.as_bytes();
                crc = crc32c::crc32c_append(crc, b);
                got += b.len() as u64;
                core.write_piece(b).map_err(os_err)?;
            }
            if got != size {
                return Err(PyValueError::new_err(got));
            }
            Ok(())
        };
        if let Err(e) = take() {
            core.rollback(mark).map_err(os_err)?;
            return Err(e);
        }
        let put = py.detach(|| core.end_stream(mark, size, crc, dedupe)).map_err(os_err)?;
        let (pack::Put::New(loc) | pack::Put::Dup(loc)) = put;
        Ok((crc, loc.0, loc.1))
    }

    /// Are `size` bytes at (pack_a, a) and (pack_b, b) equal?
    fn same_bytes(&mut self, pack_a: u32, a: u64, pack_b: u32, b: u64, size: u64) -> PyResult<bool> {
        self.core()?.same_ranges((pack_a, a), (pack_b, b), size).map_err(os_err)
    }

    /// Hash the last chunks, sync the file: the chunk digests.
    fn finish(&mut self, py: Python<'_>) -> PyResult<Vec<Py<PyBytes>>> {
        let core = self.core()?;
        let digests = py.detach(|| core.finish()).map_err(os_err)?;
        let out = digests.iter().map(|d| PyBytes::new(py, d).unbind()).collect();
        self.core = std::sync::Mutex::new(None);
        Ok(out)
    }

    /// Stop the threads and close the file (error paths).
    fn abort(&mut self) {
        if let Some(mut core) = self
            .core
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            core.abort();
        }
    }
}

/// The members of a layer read by `read_tar`, one tuple each, in archive order:
/// (name, type, mode, uid, gid, mtime_ns, atime_ns, ctime_ns, xattrs or None, linkname,
/// devmajor, devminor, content) with content None, bytes (inline) or (crc32c, size, pack,
/// offset). Records are freed as they are taken. Sendable: an exception raised while
/// placing them may end its life on another thread (``early.py``'s read).
#[pyclass]
pub(crate) struct Members {
    pub(crate) segments: VecDeque<Records>,
    pub(crate) next: usize, // in the first segment
}

impl Members {
    /// The first segment taken: freed, and given back to the system (the tree that grows
    /// meanwhile is Python's, in its own arenas, which would not reuse malloc's free pages).
    pub(crate) fn pop_front(&mut self) {
        self.segments.pop_front();
        self.next = 0;
        // SAFETY: a plain libc call
        unsafe { libc::malloc_trim(0) };
    }
}

/// One member's tuple, as `Members` hands it over.
pub(crate) fn member_tuple<'py>(py: Python<'py>, seg: &Records, r: &tar::Rec) -> PyResult<Bound<'py, PyTuple>> {
    let s = |(at, n): (usize, usize)| &seg.names[at..at + n];
    let xattrs: Bound<'py, PyAny> = if r.xattrs.1 == 0 {
        py.None().into_bound(py)
    } else {
        let d = PyDict::new(py);
        for (k, v) in &seg.xattrs[r.xattrs.0..r.xattrs.0 + r.xattrs.1] {
            d.set_item(PyBytes::new(py, s(*k)), PyBytes::new(py, s(*v)))?;
        }
        d.into_any()
    };
    let content: Bound<'py, PyAny> = match r.content {
        Content::None => py.None().into_bound(py),
        Content::Inline(at, n) => PyBytes::new(py, &seg.data[at..at + n]).into_any(),
        Content::Blob(crc, size, pack, offset) => (crc, size, pack, offset).into_pyobject(py)?.into_any(),
    };
    let items: Vec<Bound<'py, PyAny>> = vec![
        PyBytes::new(py, s(r.name)).into_any(),
        PyBytes::new(py, &[r.typ]).into_any(),
        r.mode.into_pyobject(py)?.into_any(),
        r.uid.into_pyobject(py)?.into_any(),
        r.gid.into_pyobject(py)?.into_any(),
        r.mtime_ns.into_pyobject(py)?.into_any(),
        r.atime_ns.into_pyobject(py)?.into_any(),
        r.ctime_ns.into_pyobject(py)?.into_any(),
        xattrs,
        PyBytes::new(py, s(r.link)).into_any(),
        r.devmajor.into_pyobject(py)?.into_any(),
        r.devminor.into_pyobject(py)?.into_any(),
        content,
    ];
    PyTuple::new(py, items)
}

#[pymethods]
impl Members {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __len__(&self) -> usize {
        self.segments.iter().map(|s| s.recs.len()).sum::<usize>() - self.next
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        while self.segments.front().is_some_and(|s| self.next >= s.recs.len()) {
            self.pop_front();
        }
        let Some(seg) = self.segments.front() else {
            return Ok(None);
        };
        let r = &seg.recs[self.next];
        self.next += 1;
        member_tuple(py, seg, r).map(Some)
    }
}

fn detect(head: &[u8]) -> Result<&'static str, String> {
    if head.starts_with(b"\x1f\x8b") {
        return Ok("gzip");
    }
    if head.starts_with(b"\x28\xb5\x2f\xfd") {
        return Ok("zstd");
    }
    if head.len() >= 512 && head[..512].iter().all(|&b| b == 0) {
        return Ok("none");
    }
    if head.len() >= 512 {
        // a valid header checksum: an uncompressed tar (the parser checks it again)
        return Ok("none");
    }
    Err("not a tar, gzip or zstd stream (left to the Python reader)".into())
}

/// Segments of member records the parser may have ready before Python has placed them
/// (each up to 4,096 records): enough to keep both sides busy, few enough for the memory.
const SEGMENTS_AHEAD: usize = 2;

/// Read the tar layer in `fd` (from `start`, to its end or `length` bytes) into `pack`,
/// calling `place` with the members (a `Members` iterator) one segment at a time while the
/// read goes on (on a thread of its own, the GIL released): returns (raw sha256 hex,
/// uncompressed sha256 hex, compression, raw bytes, content bytes). Raises Unsupported (the
/// pack rolled back to where it was) for any archive it does not read exactly as the
/// Python reader would, errors included: members already placed are the caller's to undo.
/// An exception from `place` stops the read and is raised as it is.
#[pyfunction]
#[pyo3(signature = (pack, fd, start, length, keep_inline, whiteouts, diff_id, lenient_end, place, prehash=None))]
#[allow(clippy::too_many_arguments)]
fn read_tar<'py>(
    py: Python<'py>,
    pack: &Bound<'py, Pack>,
    fd: i32,
    start: u64,
    length: Option<u64>,
    keep_inline: u64,
    whiteouts: bool,
    diff_id: bool,
    lenient_end: bool,
    place: &Bound<'py, PyAny>,
    prehash: Option<&Bound<'py, prehash::Prehash>>,
) -> PyResult<Bound<'py, PyTuple>> {
    // the file's digest begun at start-up (from offset 0: the whole file's)
    let started = prehash
        .filter(|_| start == 0 && length.is_none())
        .and_then(|p| p.get().take(py));
    let layer = Layer {
        fd,
        start,
        length,
        keep_inline,
        whiteouts,
        diff_id,
        lenient_end,
    };
    let mut guard = pack.borrow_mut();
    let core = guard.core()?;
    let (sink, segments) = std::sync::mpsc::sync_channel::<Records>(SEGMENTS_AHEAD);
    let (result, placed) = std::thread::scope(|s| {
        let reader = std::thread::Builder::new()
            .name("tar-parse".into())
            .spawn_scoped(s, || run(core, &layer, started, sink))
            .expect("spawn tar-parse");
        let mut placed = Ok(());
        let mut rx = Some(segments);
        let (mut waiting, mut placing) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        let cpu0 = thread_cpu();
        let t0 = std::time::Instant::now();
        while let Some(r) = rx.take() {
            let t = std::time::Instant::now();
            // the receiver moves in and out: a shared one is not Send
            let (r, got) = py.detach(move || {
                let got = r.recv();
                (r, got)
            });
            waiting += t.elapsed();
            let Ok(seg) = got else {
                break; // the parser is done
            };
            let t = std::time::Instant::now();
            let members = Members {
                segments: VecDeque::from([seg]),
                next: 0,
            };
            placed = Bound::new(py, members).and_then(|m| place.call1((m,))).map(|_| ());
            placing += t.elapsed();
            if placed.is_err() {
                break; // the receiver dropped: the parser stops at its next segment
            }
            rx = Some(r);
        }
        if native_times() {
            eprintln!(
                "native read_tar: placement {placing:?} ({:?} CPU), waiting for segments {waiting:?}, placement done at {:?}",
                thread_cpu() - cpu0,
                t0.elapsed()
            );
        }
        let result = py.detach(|| reader.join());
        (result, placed)
    });
    placed?;
    match result {
        Ok(Ok((raw, unc, kind, nbytes, content_bytes))) => PyTuple::new(
            py,
            [
                raw.into_pyobject(py)?.into_any(),
                unc.into_pyobject(py)?.into_any(),
                kind.into_pyobject(py)?.into_any(),
                nbytes.into_pyobject(py)?.into_any(),
                content_bytes.into_pyobject(py)?.into_any(),
            ],
        ),
        Ok(Err(Failure::Unsupported(msg))) => Err(Unsupported::new_err(msg)),
        Ok(Err(Failure::Os(e))) => Err(os_err(e)),
        Err(_) => Err(PyValueError::new_err("the tar parser thread panicked")),
    }
}

/// Print where the native read's time goes (`BUI_NATIVE_TIMES` set)?
pub(crate) fn native_times() -> bool {
    std::env::var_os("BUI_NATIVE_TIMES").is_some()
}

/// The calling thread's CPU time (`BUI_NATIVE_TIMES`).
pub(crate) fn thread_cpu() -> std::time::Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a plain syscall filling `ts`
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

enum Failure {
    Unsupported(String),
    Os(std::io::Error),
}

type Done = (String, String, &'static str, u64, u64);

/// One layer to read: `read_tar`'s arguments.
struct Layer {
    fd: i32,
    start: u64,
    length: Option<u64>,
    keep_inline: u64,
    whiteouts: bool,
    diff_id: bool,
    lenient_end: bool,
}

fn run(
    core: &mut PackCore,
    layer: &Layer,
    started: Option<stream::Started>,
    sink: SyncSender<Records>,
) -> Result<Done, Failure> {
    let Layer {
        fd,
        start,
        length,
        keep_inline,
        whiteouts,
        diff_id,
        lenient_end,
    } = *layer;
    let mut head = vec![0u8; 512];
    let want = length.map_or(512, |l| l.min(512) as usize);
    // SAFETY: head is valid for `want` bytes
    let n = unsafe { libc::pread(fd, head.as_mut_ptr().cast(), want, start as i64) };
    if n <= 0 {
        return Err(Failure::Unsupported("empty or unreadable".into()));
    }
    head.truncate(n as usize);
    let kind = detect(&head).map_err(Failure::Unsupported)?;
    let mark = core.mark();
    // an uncompressed stream's offsets are the file's, from `start`
    core.begin_layer((kind == "none").then_some((fd, start)));
    let (raw_rx, reader, mapping) = stream::spawn_reader(fd, start, length, started);
    let mut hasher = None;
    let mut inflater = None;
    let blocks = if kind == "none" {
        raw_rx
    } else {
        let diff = if diff_id {
            let (tx, h) = stream::spawn_hasher();
            hasher = Some(h);
            Some(tx)
        } else {
            None
        };
        let (rx, h) = stream::spawn_inflater(kind, raw_rx, diff);
        inflater = Some(h);
        rx
    };
    let mut parser = Parser::new(stream::Blocks::new(blocks), core, keep_inline, whiteouts, sink);
    let t0 = std::time::Instant::now();
    let parsed = parser.run(lenient_end);
    if native_times() {
        eprintln!(
            "native read_tar: {:?} total, {:?} waiting for input, {:?} writing the pack (of which {:?} waiting for the pack hasher), {:?} waiting for placement",
            t0.elapsed(),
            parser.src.waited,
            parser.packing,
            parser.pack.hash_wait,
            parser.handing
        );
    }
    let Parser {
        src,
        out,
        sink,
        content_bytes,
        mut pack_error,
        ..
    } = parser;
    drop(src); // stops the threads upstream on an early end
    if let Some(h) = inflater {
        let _ = h.join();
    }
    let raw = reader.join().unwrap_or_else(|_| Err("reader thread panicked".into()));
    let unc = hasher.map(|h| h.join().unwrap_or_else(|_| Err("hasher thread panicked".into())));
    // the gathered small members written before the layer's end is reported
    let parsed = parsed.and_then(|()| {
        core.end_layer().map_err(|e| {
            let msg = format!("pack: {e}");
            pack_error = Some(e);
            msg
        })
    });
    let outcome = parsed.and_then(|()| {
        let (raw_hex, nbytes) = raw?;
        let unc_hex = match unc {
            Some(u) => u?.0,
            None => raw_hex.clone(),
        };
        Ok((raw_hex, unc_hex, nbytes))
    });
    // every byte read from the mapping was the file's (the pack's chunk hasher, which
    // `end_layer` told to hash what it holds, drops the last blocks)
    let outcome = outcome.and_then(|done| match &mapping {
        Some(m) => {
            m.wait_unmapped();
            if m.failed() {
                return Err(stream::SHRANK.to_string());
            }
            Ok(done)
        }
        None => Ok(done),
    });
    match outcome {
        Ok((raw_hex, unc_hex, nbytes)) => {
            core.release(mark);
            if !out.recs.is_empty() && sink.send(out).is_err() {
                // Python stopped placing (its error is what the caller raises)
                return Err(Failure::Unsupported("stopped: the members' placement failed".into()));
            }
            Ok((raw_hex, unc_hex, kind, nbytes, content_bytes))
        }
        Err(msg) => {
            // zeros read in place of a page truncated away may have ended the parse early
            // (as an end-of-archive marker) or broken it: the cause is the file's change
            let msg = match &mapping {
                Some(m) if m.failed() => stream::SHRANK.to_string(),
                _ => msg,
            };
            core.rollback(mark).map_err(Failure::Os)?;
            core.end_layer().map_err(Failure::Os)?;
            // a pack write that failed (a full disk) fails the same way in the Python
            // reader: raised here, not handed back to be read again
            Err(match pack_error {
                Some(e) => Failure::Os(e),
                None => Failure::Unsupported(msg),
            })
        }
    }
}

/// An item too large for a leaf (ValueError, as `treeblocks.LeafPacker`), or the spill
/// file's error.
pub(crate) fn add_err(e: std::io::Error) -> PyErr {
    match e.kind() {
        std::io::ErrorKind::InvalidInput => PyValueError::new_err(e.to_string()),
        _ => os_err(e),
    }
}

/// The fs tree's leaves packed as items are added (see leaves.rs): `treeblocks.LeafPacker`'s
/// bytes, for the writer's hot loop.
#[pyclass(unsendable)]
pub(crate) struct LeafPacker {
    pub(crate) inner: leaves::Packer,
    pub(crate) done: bool,
}

#[pymethods]
impl LeafPacker {
    /// `spill_fd`: payloads go to this file (the caller's, kept open while packing) from
    /// offset 0; `digest`: hash every item's disk key and data; `breaks`: a leaf also ends
    /// before each of these keys (sorted; a build with a base: its leaves' first keys).
    #[new]
    #[pyo3(signature = (spill_fd, digest, breaks=Vec::new()))]
    fn new(spill_fd: Option<i32>, digest: bool, breaks: Vec<leaves::Key>) -> Self {
        LeafPacker {
            inner: leaves::Packer::new(spill_fd, digest, breaks),
            done: false,
        }
    }

    /// One item, in key order; ValueError for an item larger than a leaf holds.
    fn add(&mut self, key: leaves::Key, data: &[u8]) -> PyResult<()> {
        if self.done {
            return Err(PyValueError::new_err("leaf packer is finished"));
        }
        self.inner.add(key, data).map_err(add_err)
    }

    /// INODE_ITEM (times in ns) and, given `inode_ref` (parent, index, name), the INODE_REF
    /// of an inode with one name: `ondisk.pack_inode_item` and `pack_inode_ref`'s bytes.
    #[pyo3(signature = (ino, generation, size, nbytes, nlink, uid, gid, mode, rdev, flags, atime_ns, ctime_ns, mtime_ns, otime_ns, inode_ref))]
    #[allow(clippy::too_many_arguments)]
    fn add_inode(
        &mut self,
        ino: u64,
        generation: u64,
        size: u64,
        nbytes: u64,
        nlink: u32,
        uid: u32,
        gid: u32,
        mode: u32,
        rdev: u64,
        flags: u64,
        atime_ns: i128,
        ctime_ns: i128,
        mtime_ns: i128,
        otime_ns: i128,
        inode_ref: Option<(u64, u64, Bound<'_, PyBytes>)>,
    ) -> PyResult<()> {
        if self.done {
            return Err(PyValueError::new_err("leaf packer is finished"));
        }
        let fields = leaves::InodeFields {
            generation,
            size,
            nbytes,
            nlink,
            uid,
            gid,
            mode,
            rdev,
            flags,
            atime_ns,
            ctime_ns,
            mtime_ns,
            otime_ns,
        };
        let r = inode_ref.as_ref().map(|(p, i, n)| (*p, *i, n.as_bytes()));
        self.inner.add_inode(ino, &fields, r).map_err(add_err)
    }

    /// A directory's DIR_ITEMs and DIR_INDEXes: `names` in sorted order, the children's
    /// inode numbers and BTRFS_FT_* types.
    fn add_dir(
        &mut self,
        ino: u64,
        generation: u64,
        names: Vec<Bound<'_, PyBytes>>,
        inos: Vec<u64>,
        ftypes: &[u8],
    ) -> PyResult<()> {
        if self.done {
            return Err(PyValueError::new_err("leaf packer is finished"));
        }
        if inos.len() != names.len() || ftypes.len() != names.len() {
            return Err(PyValueError::new_err(
                "add_dir: names, inos and ftypes differ in length",
            ));
        }
        let entries: Vec<(&[u8], u64, u8)> = names
            .iter()
            .zip(&inos)
            .zip(ftypes)
            .map(|((n, &i), &t)| (n.as_bytes(), i, t))
            .collect();
        self.inner.add_dir(ino, generation, &entries).map_err(add_err)
    }

    /// The leaves, each (first key, item count, payload or b"" when spilled, spill offset
    /// or -1), and the items' sha256 (None without `digest`).
    #[allow(clippy::type_complexity)]
    fn finish<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<(
        Vec<(leaves::Key, u32, Bound<'py, PyBytes>, i64)>,
        Option<Bound<'py, PyBytes>>,
    )> {
        if self.done {
            return Err(PyValueError::new_err("leaf packer is finished"));
        }
        self.done = true;
        let digest = self.inner.finish().map_err(os_err)?;
        let leaves = std::mem::take(&mut self.inner.leaves)
            .into_iter()
            .map(|l| {
                let payload = PyBytes::new(py, l.payload.as_deref().unwrap_or(b""));
                (l.first_key, l.nritems, payload, l.spilled_at)
            })
            .collect();
        Ok((leaves, digest.map(|d| PyBytes::new(py, &d))))
    }
}

#[pymodule]
fn btrfs_ublk_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Pack>()?;
    m.add_class::<basepacks::BasePacks>()?;
    m.add_class::<basescan::FsScan>()?;
    m.add_class::<Members>()?;
    m.add_class::<place::Placer>()?;
    m.add_class::<inode::Inode>()?;
    m.add_class::<entries::Entries>()?;
    m.add_function(wrap_pyfunction!(inode::clamp_tree_times, m)?)?;
    m.add_class::<prehash::Prehash>()?;
    m.add_class::<LeafPacker>()?;
    m.add_function(wrap_pyfunction!(read_tar, m)?)?;
    m.add_function(wrap_pyfunction!(fsitems::fs_tree_items, m)?)?;
    m.add_function(wrap_pyfunction!(numbering::number_inodes, m)?)?;
    m.add_function(wrap_pyfunction!(numbering::number_on_base, m)?)?;
    m.add_class::<numbering::Names>()?;
    m.add_class::<numbering::Rows>()?;
    m.add_class::<extents::DataExtents>()?;
    m.add_function(wrap_pyfunction!(extents::data_free_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(blocks::write_spilled_leaves, m)?)?;
    m.add_function(wrap_pyfunction!(blockform::block_form, m)?)?;
    m.add("Unsupported", m.py().get_type::<Unsupported>())?;
    Ok(())
}
