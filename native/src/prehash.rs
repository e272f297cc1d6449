//! A tarball's source digest begun while the program starts (`Prehash`): the command
//! starts it as soon as the spec's YAML is parsed, before pydantic and the build's modules
//! are imported, on a thread of its own (the second core is idle then); the layer's native
//! read (`read_tar(..., prehash=)`) takes the running hash over (`Digesting`, which goes
//! on beside the parser to the file's end), so no byte is hashed twice.
//!
//! The prehash reads its own fd of the file; `same_file` compares the reader's fd with the
//! device, inode, size and mtime the prehash saw when it opened the file (the caller checks
//! before and after the read: a file changed in between is an error, not a wrong digest).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use pyo3::prelude::*;
use sha2::{Digest, Sha256};

use crate::mapped::Source;
use crate::stream::{Started, WINDOW};

/// the read size, the reader's: a stop waits for at most one
const STEP: usize = crate::stream::IN_SIZE;

/// What identifies the file's content for the check: a write changes the mtime.
#[derive(Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileId {
    fn of(meta: &std::fs::Metadata) -> FileId {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        }
    }
}

/// A file's sha256 on a thread of its own, from a state already reached (`Started`) to
/// `end` (or the file's end): the source digest runs beside the parser rather than ahead
/// of it in the reader, so neither waits for the other where one is the slower (the
/// digest through large members, the parser through small ones). Dropped, it stops at its
/// next step and is joined.
pub struct Digesting {
    stop: Arc<AtomicBool>,
    at: Arc<AtomicU64>,
    thread: Option<JoinHandle<Started>>,
}

impl Digesting {
    /// Hashes `file` (its own fd: it closes when the thread ends) on from `started`.
    pub fn spawn(file: File, started: Started, end: Option<u64>, name: &str) -> io::Result<Digesting> {
        let stop = Arc::new(AtomicBool::new(false));
        let at = Arc::new(AtomicU64::new(started.at));
        let (flag, pos) = (Arc::clone(&stop), Arc::clone(&at));
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || hash_range(&file, started, end, &flag, &pos))?;
        Ok(Digesting {
            stop,
            at,
            thread: Some(thread),
        })
    }

    /// How far it has hashed.
    pub fn at(&self) -> u64 {
        self.at.load(Ordering::Relaxed)
    }

    /// Waits for it to reach its end (`stop`: stops it at its next step first): the state
    /// reached; None if it panicked (a panicked hash is no digest: the caller hashes it all).
    pub fn finish(mut self, stop: bool) -> Option<Started> {
        if stop {
            self.stop.store(true, Ordering::Relaxed);
        }
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for Digesting {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where a taken prehash stands: still hashing, or done (at its limit or the file's end).
pub enum Begun {
    Running(Digesting),
    At(Started),
}

enum State {
    Running(Digesting),
    Done(Started),
    Gone,
}

impl State {
    /// The thread stopped (`stop`: at its next step; else at its limit or the file's end)
    /// and joined: the state it reached.
    fn finish(&mut self, stop: bool) -> Option<Started> {
        match std::mem::replace(self, State::Gone) {
            State::Running(d) => d.finish(stop),
            State::Done(s) => Some(s),
            State::Gone => None,
        }
    }
}

/// A file's sha256 begun on a thread (`Prehash(path, limit=None)`; `limit`: stop after
/// that many bytes, for tests). Raises OSError when the file cannot be opened.
#[pyclass(module = "btrfs_ublk_native", frozen)]
pub struct Prehash {
    state: Mutex<State>,
    id: FileId,
    taken: AtomicBool,
}

/// `file` hashed on from `started` to `end` (or its end), until `stop`; the state reached,
/// `pos` following it. The bytes up to the file's size at the start are read in place
/// through a mapping (no copy out of the page cache), any past it with `pread`. A read
/// that fails ends the hash where it is: the caller finds it short and reads the rest
/// itself (and reports the error).
pub(crate) fn hash_range(
    file: &File,
    started: Started,
    end: Option<u64>,
    stop: &AtomicBool,
    pos: &AtomicU64,
) -> Started {
    let Started { mut hash, mut at } = started;
    let done = |at: u64| end.is_some_and(|e| at >= e);
    if let Some(source) = Source::new(file.as_raw_fd()) {
        let mapped_end = end.map_or(source.size, |e| e.min(source.size));
        while at < mapped_end && !stop.load(Ordering::Relaxed) {
            let from = at & !(WINDOW - 1);
            let len = (mapped_end - from).min(WINDOW) as usize;
            let Some(window) = source.map(from, len) else {
                break; // read with pread from here
            };
            let mut done = (at - from) as usize;
            while done < len && !stop.load(Ordering::Relaxed) {
                let n = (len - done).min(STEP);
                let before = hash.clone();
                hash.update(window.bytes(done, n));
                if source.failed() {
                    // a page was gone (the file truncated): the state before this step,
                    // whose bytes were the file's
                    return Started { hash: before, at };
                }
                done += n;
                at += n as u64;
                pos.store(at, Ordering::Relaxed);
            }
        }
    }
    let mut buf = vec![0u8; STEP];
    while !stop.load(Ordering::Relaxed) && !done(at) {
        let want = end.map_or(STEP as u64, |e| (e - at).min(STEP as u64)) as usize;
        match file.read_at(&mut buf[..want], at) {
            Ok(0) => break,
            Ok(n) => {
                hash.update(&buf[..n]);
                at += n as u64;
                pos.store(at, Ordering::Relaxed);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    Started { hash, at }
}

#[pymethods]
impl Prehash {
    #[new]
    #[pyo3(signature = (path, limit=None))]
    fn new(path: PathBuf, limit: Option<u64>) -> PyResult<Prehash> {
        // only a regular file is read: a FIFO is not even opened (a reader's open, even a
        // non-blocking one, lets a waiting writer's open return and its writes go nowhere),
        // and O_NONBLOCK keeps an open raced by a swap for a FIFO from waiting for a writer
        if !std::fs::metadata(&path)?.is_file() {
            return Err(io::Error::other("not a regular file").into());
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(io::Error::other("not a regular file").into());
        }
        let begun = Started {
            hash: Sha256::new(),
            at: 0,
        };
        let digesting = Digesting::spawn(file, begun, limit, "prehash")?;
        Ok(Prehash {
            state: Mutex::new(State::Running(digesting)),
            id: FileId::of(&meta),
            taken: AtomicBool::new(false),
        })
    }

    /// Is `fd` the file this prehash read, unchanged (device, inode, size, mtime)?
    fn same_file(&self, fd: i32) -> PyResult<bool> {
        // SAFETY: the caller's open fd, borrowed: ManuallyDrop keeps it open
        let file = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        Ok(self.id == FileId::of(&file.metadata()?))
    }

    /// A reader took the digest over (tests).
    #[getter]
    fn taken(&self) -> bool {
        self.taken.load(Ordering::Relaxed)
    }

    /// Waits for the hash to reach its limit or the file's end; the bytes hashed (tests).
    fn wait(&self, py: Python<'_>) -> u64 {
        py.detach(|| {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            match state.finish(false) {
                Some(s) => {
                    let at = s.at;
                    *state = State::Done(s);
                    at
                }
                None => 0,
            }
        })
    }

    /// Stops the thread (its fd closes); a later `read_tar` hashes the file itself.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            self.state.lock().unwrap_or_else(|e| e.into_inner()).finish(true);
        });
    }
}

impl Drop for Prehash {
    fn drop(&mut self) {
        self.state.get_mut().unwrap_or_else(|e| e.into_inner()).finish(true);
    }
}

impl Prehash {
    /// The hash as it stands, running or done: the reader's to go on with (once).
    pub fn take(&self) -> Option<Begun> {
        let state = std::mem::replace(&mut *self.state.lock().unwrap_or_else(|e| e.into_inner()), State::Gone);
        let begun = match state {
            State::Running(d) => Some(Begun::Running(d)),
            State::Done(s) => Some(Begun::At(s)),
            State::Gone => None,
        };
        self.taken.store(begun.is_some(), Ordering::Relaxed);
        begun
    }
}
