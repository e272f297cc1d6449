//! Pack 0, the bundle's written pack: appends with CRC-32C deduplication (a match is
//! compared byte by byte, then rolled back), the chunk sha256s on a worker thread that reads
//! each chunk back once it is final, and write-back started as the pack grows.
//!
//! The same rules as `packs.PackWriter` (whose pack-0 side this is): the dedup key is
//! `size << 32 | crc32c`, candidates are compared in the order they were remembered, the
//! first equal one wins, and a chunk is hashed only when no rollback can reach it.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use sha2::{Digest, Sha256};

const COMPARE_STEP: usize = 1 << 20;
/// the pack is handed to the kernel's write-back each time it grew this much (`FLUSH_STEP`)
const FLUSH_STEP: u64 = 16 << 20;
/// chunks go to the hasher this many bytes at a time (`PACK_BUFFER`)
const SUBMIT_BYTES: u64 = 4 << 20;

/// A place of content: pack index and offset in it.
pub type Loc = (u32, u64);

enum Locs {
    One(Loc),
    Many(Vec<Loc>),
}

struct Hasher {
    tx: Option<SyncSender<u64>>,
    thread: Option<JoinHandle<()>>,
    out: Arc<Mutex<HashOut>>,
}

/// The chunk digests so far and the first error.
type HashOut = (Vec<[u8; 32]>, Option<String>);

impl Hasher {
    fn new(file: Arc<File>, chunk_size: u64, out: Arc<Mutex<HashOut>>) -> Hasher {
        let (tx, rx): (SyncSender<u64>, Receiver<u64>) = sync_channel(32);
        let shared = Arc::clone(&out);
        let thread = std::thread::Builder::new()
            .name("pack-sha256".into())
            .spawn(move || {
                let mut buf = vec![0u8; chunk_size as usize];
                let mut since_flush = 0u64;
                let mut flushed_to = 0u64;
                for offset in rx {
                    let got = read_full(&file, &mut buf, offset);
                    let mut guard = shared.lock().unwrap_or_else(|e| e.into_inner());
                    match got {
                        Ok(0) => guard.1 = Some(format!("pack chunk at {offset} is missing")),
                        Ok(n) => guard.0.push(Sha256::digest(&buf[..n]).into()),
                        Err(e) => guard.1 = Some(format!("pack chunk at {offset}: {e}")),
                    }
                    drop(guard);
                    since_flush += chunk_size;
                    if since_flush >= FLUSH_STEP {
                        // start write-back of what is hashed: the disk works beside the CPU
                        // and the final fsync has little left (errors surface there)
                        let end = offset + chunk_size;
                        // SAFETY: a plain syscall on an open fd
                        unsafe {
                            libc::sync_file_range(
                                file.as_raw_fd(),
                                flushed_to as i64,
                                (end - flushed_to) as i64,
                                libc::SYNC_FILE_RANGE_WRITE,
                            );
                        }
                        flushed_to = end;
                        since_flush = 0;
                    }
                }
            })
            .expect("spawn pack-sha256");
        Hasher {
            tx: Some(tx),
            thread: Some(thread),
            out,
        }
    }

    fn submit(&self, offset: u64) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(offset);
        }
    }

    fn stop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let n = file.read_at(&mut buf[done..], offset + done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

fn pread_exact(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: buf is valid for its length
        let n = unsafe {
            libc::pread(
                fd,
                buf[done..].as_mut_ptr().cast(),
                buf.len() - done,
                (offset + done as u64) as i64,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short read of a pack"));
        }
        done += n as usize;
    }
    Ok(())
}

/// What a rollback to a mark restores.
pub struct Mark {
    size: u64,
    remembered: usize,
    bytes_in: u64,
    bytes_deduped: u64,
}

pub struct PackCore {
    file: Arc<File>,
    pub chunk_size: u64,
    pub size: u64,
    submitted: u64, // chunks handed to the hasher
    index: HashMap<u64, Locs>,
    fds: HashMap<u32, RawFd>, // in-place packs (their fds are the Python side's)
    hasher: Hasher,
    pub bytes_in: u64,
    pub bytes_deduped: u64,
    /// keys remembered since the oldest open mark, in order (for a rollback)
    journal: Option<Vec<u64>>,
    scratch: Vec<u8>,
    scratch2: Vec<u8>,
}

pub enum Put {
    New(Loc),
    Dup(Loc),
}

impl PackCore {
    pub fn new(file: File, chunk_size: u64) -> PackCore {
        let file = Arc::new(file);
        let hasher = Hasher::new(Arc::clone(&file), chunk_size, Arc::new(Mutex::new((Vec::new(), None))));
        PackCore {
            file,
            chunk_size,
            size: 0,
            submitted: 0,
            index: HashMap::new(),
            fds: HashMap::new(),
            hasher,
            bytes_in: 0,
            bytes_deduped: 0,
            journal: None,
            scratch: Vec::new(),
            scratch2: Vec::new(),
        }
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn set_pack_fd(&mut self, pack: u32, fd: RawFd) {
        self.fds.insert(pack, fd);
    }

    fn pack_fd(&self, pack: u32) -> io::Result<RawFd> {
        if pack == 0 {
            return Ok(self.fd());
        }
        self.fds
            .get(&pack)
            .copied()
            .ok_or_else(|| io::Error::other(format!("pack {pack} has no open file")))
    }

    pub fn candidates(&self, key: u64) -> Vec<Loc> {
        match self.index.get(&key) {
            None => Vec::new(),
            Some(Locs::One(l)) => vec![*l],
            Some(Locs::Many(v)) => v.clone(),
        }
    }

    pub fn remember(&mut self, key: u64, loc: Loc) {
        match self.index.get_mut(&key) {
            None => {
                self.index.insert(key, Locs::One(loc));
            }
            Some(Locs::Many(v)) => v.push(loc),
            Some(slot @ Locs::One(_)) => {
                let Locs::One(first) = *slot else { unreachable!() };
                *slot = Locs::Many(vec![first, loc]);
            }
        }
        if let Some(j) = &mut self.journal {
            j.push(key);
        }
    }

    fn forget_last(&mut self, key: u64) {
        let remove = match self.index.get_mut(&key) {
            Some(Locs::Many(v)) => {
                v.pop();
                if v.len() == 1 {
                    let only = v[0];
                    self.index.insert(key, Locs::One(only));
                }
                false
            }
            Some(Locs::One(_)) => true,
            None => false,
        };
        if remove {
            self.index.remove(&key);
        }
    }

    /// Is `data` equal to `size` bytes at `loc`?
    fn same_as_buf(&mut self, loc: Loc, data: &[u8]) -> io::Result<bool> {
        let fd = self.pack_fd(loc.0)?;
        let mut done = 0;
        while done < data.len() {
            let n = COMPARE_STEP.min(data.len() - done);
            self.scratch.resize(n, 0);
            pread_exact(fd, &mut self.scratch[..n], loc.1 + done as u64)?;
            if self.scratch[..n] != data[done..done + n] {
                return Ok(false);
            }
            done += n;
        }
        Ok(true)
    }

    /// Are two ranges of packs equal?
    pub fn same_ranges(&mut self, a: Loc, b: Loc, size: u64) -> io::Result<bool> {
        let (fa, fb) = (self.pack_fd(a.0)?, self.pack_fd(b.0)?);
        let mut done = 0u64;
        while done < size {
            let n = (COMPARE_STEP as u64).min(size - done) as usize;
            self.scratch.resize(n, 0);
            self.scratch2.resize(n, 0);
            pread_exact(fa, &mut self.scratch[..n], a.1 + done)?;
            pread_exact(fb, &mut self.scratch2[..n], b.1 + done)?;
            if self.scratch[..n] != self.scratch2[..n] {
                return Ok(false);
            }
            done += n as u64;
        }
        Ok(true)
    }

    /// Content held whole in memory: deduplicated before anything is written.
    pub fn put(&mut self, data: &[u8], crc: u32) -> io::Result<Put> {
        let size = data.len() as u64;
        self.bytes_in += size;
        let key = size << 32 | crc as u64;
        for loc in self.candidates(key) {
            if self.same_as_buf(loc, data)? {
                self.bytes_deduped += size;
                return Ok(Put::Dup(loc));
            }
        }
        let at = self.size;
        self.file.write_all_at(data, at)?;
        self.size += size;
        self.remember(key, (0, at));
        self.submit_final();
        Ok(Put::New((0, at)))
    }

    /// Streamed content: append a piece (see `end_stream`).
    pub fn write_piece(&mut self, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, self.size)?;
        self.size += data.len() as u64;
        Ok(())
    }

    /// Streamed content of `size` bytes appended since `start`: deduplicated (rolled back
    /// on a match) and remembered when `dedupe`.
    pub fn end_stream(&mut self, start: u64, size: u64, crc: u32, dedupe: bool) -> io::Result<Put> {
        self.bytes_in += size;
        let key = size << 32 | crc as u64;
        if dedupe {
            for loc in self.candidates(key) {
                if self.same_ranges(loc, (0, start), size)? {
                    self.file.set_len(start)?;
                    self.size = start;
                    self.bytes_deduped += size;
                    return Ok(Put::Dup(loc));
                }
            }
            self.remember(key, (0, start));
        }
        self.submit_final();
        Ok(Put::New((0, start)))
    }

    fn submit_final(&mut self) {
        let step = (SUBMIT_BYTES / self.chunk_size).max(1);
        if self.size >= (self.submitted + step) * self.chunk_size {
            self.submit(self.size / self.chunk_size);
        }
    }

    fn submit(&mut self, upto: u64) {
        for index in self.submitted..upto {
            self.hasher.submit(index * self.chunk_size);
        }
        self.submitted = self.submitted.max(upto);
    }

    pub fn mark(&mut self) -> Mark {
        let remembered = match &self.journal {
            Some(j) => j.len(),
            None => {
                self.journal = Some(Vec::new());
                0
            }
        };
        Mark {
            size: self.size,
            remembered,
            bytes_in: self.bytes_in,
            bytes_deduped: self.bytes_deduped,
        }
    }

    /// Keep what was added since the mark (the journal closes with the outermost mark).
    pub fn release(&mut self, mark: Mark) {
        if mark.remembered == 0 {
            self.journal = None;
        }
    }

    /// Undo everything since `mark`: file size, remembered keys, counters, chunk digests.
    pub fn rollback(&mut self, mark: Mark) -> io::Result<()> {
        let keys: Vec<u64> = match &mut self.journal {
            Some(j) => j.split_off(mark.remembered),
            None => Vec::new(),
        };
        for key in keys.into_iter().rev() {
            self.forget_last(key);
        }
        if mark.remembered == 0 {
            self.journal = None;
        }
        // chunks past the mark may have been hashed: wait for the hasher, drop them
        let keep = mark.size / self.chunk_size;
        if self.submitted > keep {
            self.hasher.stop();
            let out = Arc::clone(&self.hasher.out);
            let mut guard = out.lock().unwrap_or_else(|e| e.into_inner());
            guard.0.truncate(keep as usize);
            drop(guard);
            self.hasher = Hasher::new(Arc::clone(&self.file), self.chunk_size, out);
            self.submitted = keep;
        }
        self.file.set_len(mark.size)?;
        self.size = mark.size;
        self.bytes_in = mark.bytes_in;
        self.bytes_deduped = mark.bytes_deduped;
        Ok(())
    }

    /// All chunks hashed, the file synced: the chunk digests.
    pub fn finish(&mut self) -> io::Result<Vec<[u8; 32]>> {
        self.submit(self.size.div_ceil(self.chunk_size));
        self.hasher.stop();
        let mut guard = self.hasher.out.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = guard.1.take() {
            return Err(io::Error::other(e));
        }
        let digests = std::mem::take(&mut guard.0);
        drop(guard);
        self.file.sync_all()?;
        Ok(digests)
    }

    pub fn abort(&mut self) {
        self.hasher.stop();
    }
}
