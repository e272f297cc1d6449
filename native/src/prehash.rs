//! A tarball's source digest begun while the program starts (`Prehash`): the command
//! starts it as soon as the spec's YAML is parsed, before pydantic and the build's modules
//! are imported, on a thread of its own (the second core is idle then); the layer's native
//! read (`read_tar(..., prehash=)`) takes it over: the sha256 state and the offset it
//! reached. The reader hashes only from there, so no byte is hashed twice.
//!
//! The prehash reads its own fd of the file; `same_file` compares the reader's fd with the
//! device, inode, size and mtime the prehash saw when it opened the file (the caller checks
//! before and after the read: a file changed in between is an error, not a wrong digest).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
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

enum State {
    Running {
        stop: Arc<AtomicBool>,
        thread: JoinHandle<Started>,
    },
    Done(Started),
    Gone,
}

impl State {
    /// The thread stopped (`stop`: at its next step; else at its limit or the file's end)
    /// and joined: the state it reached.
    fn finish(&mut self, stop: bool) -> Option<Started> {
        match std::mem::replace(self, State::Gone) {
            State::Running { stop: flag, thread } => {
                if stop {
                    flag.store(true, Ordering::Relaxed);
                }
                thread.join().ok() // a panicked hash is no prehash: the reader hashes it all
            }
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

fn hash_file(file: &File, stop: &AtomicBool, limit: Option<u64>) -> Started {
    let mut hash = Sha256::new();
    let mut at = 0u64;
    // in place through a mapping, as the reader reads (no copy out of the page cache)
    if let Some(source) = Source::new(file.as_raw_fd()) {
        let end = limit.map_or(source.size, |l| l.min(source.size));
        while at < end && !stop.load(Ordering::Relaxed) {
            let len = (end - at).min(WINDOW) as usize;
            let Some(window) = source.map(at, len) else {
                break; // the reader reads the rest (mapped or not)
            };
            let mut done = 0;
            while done < len && !stop.load(Ordering::Relaxed) {
                let n = (len - done).min(STEP);
                let before = hash.clone();
                hash.update(window.bytes(done, n));
                if source.failed() {
                    // a page was gone (the file truncated): the state before this step,
                    // whose bytes were the file's; the reader reads on from there
                    return Started { hash: before, at };
                }
                done += n;
                at += n as u64;
            }
        }
        return Started { hash, at };
    }
    let mut buf = vec![0u8; STEP];
    while !stop.load(Ordering::Relaxed) {
        let want = limit.map_or(STEP as u64, |l| (l - at).min(STEP as u64)) as usize;
        if want == 0 {
            break;
        }
        match file.read_at(&mut buf[..want], at) {
            Ok(0) => break,
            Ok(n) => {
                hash.update(&buf[..n]);
                at += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break, // the reader reads the rest itself (and reports the error)
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
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("prehash".into())
            .spawn(move || hash_file(&file, &flag, limit))?; // the fd closes when it ends
        Ok(Prehash {
            state: Mutex::new(State::Running { stop, thread }),
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
    /// The state reached, the thread stopped: the reader's to go on with (once).
    pub fn take(&self, py: Python<'_>) -> Option<Started> {
        let started = py.detach(|| self.state.lock().unwrap_or_else(|e| e.into_inner()).finish(true));
        self.taken.store(started.is_some(), Ordering::Relaxed);
        started
    }
}
