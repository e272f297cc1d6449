//! The input side of a tar layer: the raw file read once on a thread that also hashes it
//! (the source digest), an inflating thread for gzip/zstd (with the diff_id hashed on a
//! third thread), and `Blocks`, the parser's view of the uncompressed stream.
//!
//! A block is read once into a buffer that is handed on by reference (`Shared`): the parser
//! writes pack content straight from it and the pack's chunk hasher hashes the same bytes
//! (`Span`), so no byte is copied between them; buffers go back to a pool once the last
//! reference drops (fresh memory costs page faults and zeroing on every block).

use std::io::{self, BufRead, Read};
use std::ops::Deref;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use sha2::{Digest, Sha256};

use crate::mapped::{Source, Window};

/// the raw file's read size: blocks small enough that the few in flight stay in the CPU's
/// caches between the read, the two hashes and the pack write (1 MiB blocks: the synthetic
/// set's native read 3.6-3.7 s user and 65 MiB peak RSS; 256 KiB: 3.2-3.3 s, 57 MiB)
pub const IN_SIZE: usize = 256 << 10;
const OUT_SIZE: usize = 1 << 20;
const DEPTH: usize = 8;
/// buffers a pool keeps for reuse: the reader's queue, the parser's block and the pack
/// hasher's queue of spans all hold some
const POOL_KEEP: usize = 48;

/// The sha256 state of a file's first `at` bytes: a digest begun before the read (the
/// prehash, `prehash::Prehash`), which the reader takes over from `at`.
pub struct Started {
    pub hash: Sha256,
    pub at: u64,
}

/// Spare buffers of one size, reused by whoever takes them next.
pub struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
    size: usize,
}

impl Pool {
    pub fn new(size: usize) -> Arc<Pool> {
        Arc::new(Pool {
            free: Mutex::new(Vec::new()),
            size,
        })
    }

    /// A buffer of the pool's size (zeroed once, when first made), empty (`len` 0).
    pub fn get(self: &Arc<Pool>) -> Buf {
        let data = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        Buf {
            data: data.unwrap_or_else(|| vec![0u8; self.size]),
            len: 0,
            pool: Some(Arc::clone(self)),
            mapped: None,
        }
    }
}

/// Bytes `data[..len]`, or `len` bytes of a mapped window from `at`; the buffer returns
/// to its pool when dropped (a window is unmapped with its last block).
pub struct Buf {
    data: Vec<u8>,
    len: usize,
    pool: Option<Arc<Pool>>,
    mapped: Option<(Arc<Window>, usize)>,
}

impl Buf {
    pub fn owned(data: Vec<u8>) -> Buf {
        Buf {
            len: data.len(),
            data,
            pool: None,
            mapped: None,
        }
    }

    /// `len` bytes of `window` from `at`, read in place.
    pub fn mapped(window: Arc<Window>, at: usize, len: usize) -> Buf {
        window.bytes(at, len); // in range
        Buf {
            data: Vec::new(),
            len,
            pool: None,
            mapped: Some((window, at)),
        }
    }

    /// The whole buffer, to fill; then `set_len`.
    pub fn space(&mut self) -> &mut [u8] {
        &mut self.data
    }

    pub fn set_len(&mut self, len: usize) {
        assert!(self.mapped.is_none() && len <= self.data.len());
        self.len = len;
    }
}

impl Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.mapped {
            Some((window, at)) => window.bytes(*at, self.len),
            None => &self.data[..self.len],
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            let mut free = pool.free.lock().unwrap_or_else(|e| e.into_inner());
            if free.len() < POOL_KEEP && self.data.len() == pool.size {
                free.push(std::mem::take(&mut self.data));
            }
        }
    }
}

pub type Shared = Arc<Buf>;

/// A range of a shared block.
#[derive(Clone)]
pub struct Span {
    pub block: Shared,
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn whole(block: Shared) -> Span {
        Span {
            end: block.len(),
            block,
            start: 0,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.block[self.start..self.end]
    }
}

pub type Block = Result<Shared, String>;

/// sha256 of a stream and its length (hex digest, bytes).
pub type Digested = Result<(String, u64), String>;

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn pread(fd: i32, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    loop {
        // SAFETY: buf is valid for its length
        let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), offset as i64) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// How far ahead of the reader the kernel is asked to read (`POSIX_FADV_WILLNEED`), in
/// steps of `AHEAD_STEP`.
const AHEAD: u64 = 64 << 20;
const AHEAD_STEP: u64 = 8 << 20;

/// Asks the kernel to read `fd` ahead of the positions it is told (`at`), on a thread of
/// its own: a cold read's page-cache work (allocating and inserting pages, submitting the
/// I/O) is done there, on the other core, instead of in the reader's `pread`s, where it
/// was on the read's critical path. Dropped, it stops and is joined (the fd is the
/// caller's: no hint may reach it after the read).
///
/// A cold read that takes over a prehash starts at the offset the prehash reached and keeps
/// that lead (`ahead_from`).
struct Readahead {
    tx: Option<SyncSender<u64>>,
    thread: Option<JoinHandle<()>>,
    next: u64,
}

impl Readahead {
    fn new(fd: i32, end: Option<u64>, start: u64, frontier: u64) -> Readahead {
        let (tx, rx) = sync_channel::<u64>(1);
        let (mut advised, lead) = ahead_from(fd, start, frontier);
        let thread = std::thread::Builder::new()
            .name("tar-ahead".into())
            .spawn(move || {
                for at in rx {
                    let until = end.map_or(at + lead, |e| (at + lead).min(e));
                    while advised < until {
                        let from = advised.max(at);
                        // SAFETY: a plain syscall on the caller's open fd
                        let r = unsafe {
                            libc::posix_fadvise(fd, from as i64, AHEAD_STEP as i64, libc::POSIX_FADV_WILLNEED)
                        };
                        if r != 0 {
                            return; // only a hint: the reads go on without it
                        }
                        advised = from + AHEAD_STEP;
                    }
                }
            })
            .expect("spawn tar-ahead");
        Readahead {
            tx: Some(tx),
            thread: Some(thread),
            next: 0,
        }
    }

    /// The reader is at `at`.
    fn at(&mut self, at: u64) {
        if at >= self.next {
            self.next = at + AHEAD_STEP;
            if let Some(tx) = &self.tx {
                let _ = tx.try_send(at); // busy: the next step's position will do
            }
        }
    }
}

/// Where the read-ahead starts and how far past the reader it stays. Read from `start`, with
/// a prehash that reached `frontier`: the reader first goes through the pages the prehash
/// read, and a window of `AHEAD` past it asked the disk for nothing meanwhile (the synthetic
/// set cold: ~0.5 s, with ~650 MB prehashed), so where the pages past the frontier are not
/// cached the window starts there and keeps that lead. Where they are (a warm build), as
/// without a prehash: warm builds with the lead taken always were faster than main in only 9
/// of 33 pairs (issue23-log.md, "The cold build against the disk").
fn ahead_from(fd: i32, start: u64, frontier: u64) -> (u64, u64) {
    let cold = frontier > start && cached_bytes(fd, frontier, AHEAD).is_some_and(|n| n < AHEAD / 2);
    if crate::native_times() {
        eprintln!(
            "native read-ahead: prehashed to {} MiB, {}",
            frontier >> 20,
            if cold { "cold: from there" } else { "from the reader" }
        );
    }
    if cold {
        (frontier, AHEAD + (frontier - start))
    } else {
        (start, AHEAD)
    }
}

/// Bytes of `fd`'s pages in the page cache among the `len` bytes at `off` (`cachestat`,
/// Linux 6.5; None without it).
pub(crate) fn cached_bytes(fd: i32, off: u64, len: u64) -> Option<u64> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    const SYS_CACHESTAT: libc::c_long = 451; // one number on every architecture
    let range = Range { off, len };
    let mut stat = Stat::default();
    // SAFETY: both structs are valid for the call, laid out as the kernel's
    let r = unsafe { libc::syscall(SYS_CACHESTAT, fd, &range, &mut stat, 0) };
    (r == 0).then(|| stat.nr_cache * crate::mapped::page_size() as u64)
}

impl Drop for Readahead {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The mapped windows' size and alignment in the file: a window's pages count in the RSS
/// while a block of it is held (by the reader's queue, the parser, the chunk hasher).
pub const WINDOW: u64 = 4 << 20;

/// What a read reports when a page of its mapping was gone (`Source::failed`).
pub const SHRANK: &str = "the file changed under the read: part of it was gone when read (truncated)";

/// Reads `fd` from `start` (to its end, or `length` bytes) on a thread, hashing every byte
/// (those `started` hashed already, from offset 0: from where it stopped); the blocks go to
/// the returned receiver. The fd stays the caller's. The file's bytes up to its size when
/// the read begins are read in place through windows of a mapping (`mapped::Source`,
/// returned: once its blocks are all dropped, `failed` says whether any read zeros in place
/// of a page truncated away), the rest (or all, where it cannot be mapped) with pread.
pub fn spawn_reader(
    fd: i32,
    start: u64,
    length: Option<u64>,
    started: Option<Started>,
) -> (Receiver<Block>, JoinHandle<Digested>, Option<Arc<Source>>) {
    let (tx, rx) = sync_channel::<Block>(DEPTH);
    let source = Source::new(fd);
    let mapping = source.clone();
    let handle = std::thread::Builder::new()
        .name("tar-read".into())
        .spawn(move || {
            let (mut hash, mut hashed) = match started {
                Some(s) => (s.hash, s.at),
                None => (Sha256::new(), start),
            };
            let mut at = start;
            let mut total = 0u64;
            let pool = Pool::new(IN_SIZE);
            let mut ahead = Readahead::new(fd, length.map(|l| start + l), start, hashed);
            let mut map_end = mapping
                .as_ref()
                .map_or(0, |m| length.map_or(m.size, |l| (start + l).min(m.size)));
            let mut window: Option<(Arc<Window>, u64, u64)> = None; // and its file range
            let fail = |msg: String| {
                let _ = tx.send(Err(msg.clone()));
                Err(msg)
            };
            loop {
                let want = match length {
                    Some(l) => (l - total).min(IN_SIZE as u64) as usize,
                    None => IN_SIZE,
                };
                if want == 0 {
                    break;
                }
                ahead.at(at);
                let mut block = None;
                if let Some(m) = mapping.as_ref().filter(|_| at < map_end) {
                    if window.as_ref().is_none_or(|w| at >= w.2) {
                        let from = at & !(WINDOW - 1);
                        let to = (from + WINDOW).min(map_end);
                        window = m.map(from, (to - from) as usize).map(|w| (w, from, to));
                    }
                    match &window {
                        Some((w, from, to)) => {
                            let n = (want as u64).min(to - at) as usize;
                            block = Some(Buf::mapped(Arc::clone(w), (at - from) as usize, n));
                        }
                        None => map_end = 0, // no window: pread from here on
                    }
                }
                let buf = match block {
                    Some(b) => b,
                    None => {
                        let mut buf = pool.get();
                        match pread(fd, &mut buf.space()[..want], at) {
                            Ok(n) => buf.set_len(n),
                            Err(e) => return fail(format!("read error: {e}")),
                        }
                        buf
                    }
                };
                let n = buf.len();
                if n == 0 {
                    break;
                }
                if at + n as u64 > hashed {
                    hash.update(&buf[(hashed.max(at) - at) as usize..]);
                    hashed = at + n as u64;
                }
                if mapping.as_ref().is_some_and(|m| m.failed()) {
                    return fail(SHRANK.into());
                }
                at += n as u64;
                total += n as u64;
                if at >= window.as_ref().map_or(0, |w| w.2) {
                    window = None; // unmapped with its last block
                }
                if tx.send(Ok(Arc::new(buf))).is_err() {
                    return Err("stopped".into());
                }
            }
            if hashed > at {
                return fail(format!("read {at} bytes, {hashed} hashed before: the file is shorter"));
            }
            if let Some(l) = length {
                if total != l {
                    return fail(format!("read {total} of {l} bytes"));
                }
            }
            Ok((hex(&hash.finalize()), total))
        })
        .expect("spawn tar-read");
    (rx, handle, source)
}

/// sha256 of the blocks sent to the returned sender, on a thread.
pub fn spawn_hasher() -> (SyncSender<Shared>, JoinHandle<Digested>) {
    let (tx, rx) = sync_channel::<Shared>(DEPTH);
    let handle = std::thread::Builder::new()
        .name("diff-sha256".into())
        .spawn(move || {
            let mut hash = Sha256::new();
            let mut total = 0u64;
            for block in rx {
                hash.update(&block[..]);
                total += block.len() as u64;
            }
            Ok((hex(&hash.finalize()), total))
        })
        .expect("spawn diff-sha256");
    (tx, handle)
}

/// `Read`/`BufRead` over a channel of blocks (a decompressor's input).
pub struct ChanReader {
    rx: Receiver<Block>,
    cur: Shared,
    pos: usize,
}

impl ChanReader {
    pub fn new(rx: Receiver<Block>) -> ChanReader {
        ChanReader {
            rx,
            cur: Arc::new(Buf::owned(Vec::new())),
            pos: 0,
        }
    }
}

impl Read for ChanReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let avail = self.fill_buf()?;
        let n = avail.len().min(out.len());
        out[..n].copy_from_slice(&avail[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for ChanReader {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        while self.pos >= self.cur.len() {
            match self.rx.recv() {
                Ok(Ok(b)) => {
                    self.cur = b;
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(io::Error::other(e)),
                Err(_) => return Ok(&[]),
            }
        }
        Ok(&self.cur[self.pos..])
    }

    fn consume(&mut self, n: usize) {
        self.pos += n;
    }
}

/// Inflates gzip members (zero padding between and after them skipped, as
/// `gunzip.ThreadedGunzip` does) or zstd frames on a thread.
pub fn spawn_inflater(
    kind: &'static str,
    input: Receiver<Block>,
    diff: Option<SyncSender<Shared>>,
) -> (Receiver<Block>, JoinHandle<()>) {
    let (tx, rx) = sync_channel::<Block>(DEPTH);
    let handle = std::thread::Builder::new()
        .name("inflate".into())
        .spawn(move || {
            let mut input = ChanReader::new(input);
            let result = if kind == "gzip" {
                gunzip(&mut input, &tx, diff.as_ref())
            } else {
                unzstd(&mut input, &tx, diff.as_ref())
            };
            if let Err(e) = result {
                let _ = tx.send(Err(format!("{kind}: {e}")));
            }
        })
        .expect("spawn inflate");
    (rx, handle)
}

fn pump(mut r: impl Read, tx: &SyncSender<Block>, diff: Option<&SyncSender<Shared>>) -> io::Result<()> {
    let pool = Pool::new(OUT_SIZE);
    loop {
        let mut buf = pool.get();
        let mut n = 0;
        while n < OUT_SIZE {
            let got = r.read(&mut buf.space()[n..])?;
            if got == 0 {
                break;
            }
            n += got;
        }
        if n == 0 {
            return Ok(());
        }
        buf.set_len(n);
        let block = Arc::new(buf);
        if let Some(d) = diff {
            d.send(Arc::clone(&block)).map_err(|_| io::Error::other("stopped"))?;
        }
        tx.send(Ok(block)).map_err(|_| io::Error::other("stopped"))?;
    }
}

fn gunzip(input: &mut ChanReader, tx: &SyncSender<Block>, diff: Option<&SyncSender<Shared>>) -> io::Result<()> {
    loop {
        pump(flate2::bufread::GzDecoder::new(&mut *input), tx, diff)?;
        // between members: zero padding, then another member or the end
        loop {
            let avail = input.fill_buf()?;
            if avail.is_empty() {
                return Ok(());
            }
            let zeros = avail.iter().take_while(|&&b| b == 0).count();
            let all = zeros == avail.len();
            input.consume(zeros);
            if !all {
                break;
            }
        }
        let avail = input.fill_buf()?;
        if avail[0] != 0x1f || (avail.len() > 1 && avail[1] != 0x8b) {
            return Err(io::Error::other("not a gzipped file after a member"));
        }
    }
}

fn unzstd(input: &mut ChanReader, tx: &SyncSender<Block>, diff: Option<&SyncSender<Shared>>) -> io::Result<()> {
    pump(zstd::stream::read::Decoder::with_buffer(input)?, tx, diff)
}

/// The parser's view of the uncompressed stream.
pub struct Blocks {
    rx: Receiver<Block>,
    cur: Shared,
    pos: usize,
    pub offset: u64, // stream offset of cur[pos]
    error: Option<String>,
    pub waited: std::time::Duration,
}

impl Blocks {
    pub fn new(rx: Receiver<Block>) -> Blocks {
        Blocks {
            rx,
            cur: Arc::new(Buf::owned(Vec::new())),
            pos: 0,
            offset: 0,
            error: None,
            waited: Default::default(),
        }
    }

    /// Bytes are available (false at the end or on an upstream error, kept in `error`).
    fn fill(&mut self) -> bool {
        while self.pos >= self.cur.len() {
            if self.error.is_some() {
                return false;
            }
            let t = std::time::Instant::now();
            let got = self.rx.recv();
            self.waited += t.elapsed();
            match got {
                Ok(Ok(b)) => {
                    self.cur = b;
                    self.pos = 0;
                }
                Ok(Err(e)) => {
                    self.error = Some(e);
                    return false;
                }
                Err(_) => return false,
            }
        }
        true
    }

    pub fn take_error(&mut self) -> Option<String> {
        self.error.take()
    }

    /// Up to `max` bytes of the current block (empty at the end).
    pub fn slice(&mut self, max: usize) -> &[u8] {
        if !self.fill() {
            return &[];
        }
        let n = max.min(self.cur.len() - self.pos);
        let s = &self.cur[self.pos..self.pos + n];
        self.pos += n;
        self.offset += n as u64;
        s
    }

    /// Up to `max` bytes of the current block, by reference (None at the end).
    pub fn span(&mut self, max: usize) -> Option<Span> {
        if !self.fill() {
            return None;
        }
        let n = max.min(self.cur.len() - self.pos);
        let span = Span {
            block: Arc::clone(&self.cur),
            start: self.pos,
            end: self.pos + n,
        };
        self.pos += n;
        self.offset += n as u64;
        Some(span)
    }

    /// Exactly `n` bytes by reference, in as many spans as blocks they lie in (None when
    /// the stream ends first).
    pub fn spans(&mut self, n: usize, out: &mut Vec<Span>) -> bool {
        out.clear();
        let mut done = 0;
        while done < n {
            match self.span(n - done) {
                Some(s) => {
                    done += s.end - s.start;
                    out.push(s);
                }
                None => return false,
            }
        }
        true
    }

    /// Fills `out` as far as the stream goes; returns how much.
    pub fn read_into(&mut self, out: &mut [u8]) -> usize {
        let mut done = 0;
        while done < out.len() {
            let s = self.slice(out.len() - done);
            if s.is_empty() {
                break;
            }
            let n = s.len();
            out[done..done + n].copy_from_slice(s);
            done += n;
        }
        done
    }

    /// Appends `n` bytes to `out` as far as the stream goes; returns how many.
    pub fn read_append(&mut self, n: usize, out: &mut Vec<u8>) -> usize {
        let mut done = 0;
        while done < n {
            let s = self.slice(n - done);
            if s.is_empty() {
                break;
            }
            out.extend_from_slice(s);
            done += s.len();
        }
        done
    }

    pub fn skip(&mut self, n: u64) -> u64 {
        let mut done = 0u64;
        while done < n {
            let s = self.slice((n - done).min(usize::MAX as u64) as usize);
            if s.is_empty() {
                break;
            }
            done += s.len() as u64;
        }
        done
    }

    /// Reads to the end (the compressed stream's end is checked, every raw byte hashed).
    pub fn drain(&mut self) {
        while !self.slice(usize::MAX).is_empty() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapped::tests::{temp, SERIAL};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    /// The blocks and the digest of `fd` read from `start` (`length` bytes or to the end).
    fn read_all(fd: i32, start: u64, length: Option<u64>) -> (Vec<u8>, Digested) {
        let (rx, reader, _) = spawn_reader(fd, start, length, None);
        let mut got = Vec::new();
        for block in rx {
            got.extend_from_slice(&block.unwrap());
        }
        (got, reader.join().unwrap())
    }

    #[test]
    fn mapped_or_not_the_same_bytes_and_digest() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // past a window (4 MiB) and not a multiple of a block or a page
        let len = (9 << 20) + 12_345;
        let (path, f) = temp("stream", len);
        let data = std::fs::read(&path).unwrap();
        for (start, length) in [
            (0, None),
            (7_777, None),
            (4_096, Some((5 << 20) + 3)),
            (len as u64, None),
        ] {
            let want = &data[start as usize..length.map_or(len, |l| start as usize + l as usize)];
            let (got, digest) = read_all(f.as_raw_fd(), start, length);
            assert!(got == want, "bytes from {start}");
            assert_eq!(digest.unwrap(), (hex(&Sha256::digest(want)), want.len() as u64));
        }
        // the table's slots all taken: the reader reads with pread, the same bytes
        let (other, g) = temp("stream-slots", 1 << 16);
        let src = Source::new(g.as_raw_fd()).unwrap();
        let held: Vec<_> = std::iter::from_fn(|| src.map(0, 1 << 16)).collect();
        let (got, digest) = read_all(f.as_raw_fd(), 0, None);
        assert!(got == data);
        assert_eq!(digest.unwrap().0, hex(&Sha256::digest(&data)));
        drop(held);
        std::fs::remove_file(path).unwrap();
        std::fs::remove_file(other).unwrap();
    }

    /// The read-ahead starts past the prehash only where the kernel says the pages there are
    /// not cached: a file just written is (warm: from the reader, as without a prehash);
    /// synced and dropped from the page cache it is not (cold: from the frontier, with its lead).
    #[test]
    fn read_ahead_starts_at_an_uncached_frontier() {
        let (path, file) = crate::pack::tests::temp_pack("readahead");
        let size = 2 * AHEAD;
        let block = vec![7u8; 1 << 20];
        for at in (0..size).step_by(block.len()) {
            file.write_all_at(&block, at).unwrap();
        }
        let fd = file.as_raw_fd();
        let Some(cached) = cached_bytes(fd, AHEAD, AHEAD) else {
            std::fs::remove_file(&path).unwrap();
            return; // a kernel before 6.5: no cachestat, the read-ahead is the reader's
        };
        assert_eq!(cached, AHEAD);
        assert_eq!(ahead_from(fd, 0, AHEAD), (0, AHEAD));
        file.sync_all().unwrap();
        // SAFETY: a plain syscall on an open fd
        assert_eq!(unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) }, 0);
        let after = cached_bytes(fd, AHEAD, AHEAD).unwrap();
        std::fs::remove_file(&path).unwrap();
        if after >= AHEAD / 2 {
            return; // a filesystem that keeps its pages (tmpfs): nothing to tell apart
        }
        assert_eq!(ahead_from(fd, 0, AHEAD), (AHEAD, 2 * AHEAD));
        assert_eq!(ahead_from(fd, 0, 0), (0, AHEAD)); // no prehash
        assert_eq!(ahead_from(fd, AHEAD, AHEAD), (AHEAD, AHEAD)); // nothing prehashed past the start
    }
}
