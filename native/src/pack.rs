//! Pack 0, the bundle's written pack: appends with CRC-32C deduplication (a match is
//! compared byte by byte, in the layer's file the content came from where it has one, else
//! in the pack; then rolled back), the chunk sha256s on a worker thread fed the bytes as
//! they are written (never read back from the pack), and write-back started as the pack
//! grows.
//!
//! The same rules as `packs.PackWriter` (whose pack-0 side this is): the dedup key is
//! `size << 32 | crc32c`, candidates are compared in the order they were remembered, the
//! first equal one wins. The hasher hashes bytes that a rollback may still remove (streamed
//! content found to be a duplicate, a layer handed back to the Python reader): a mark
//! snapshots its state (a sha256 state is ~100 bytes), a rollback restores the snapshot.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::num::NonZeroU32;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::basepacks::BasePackSet;
use crate::direct::{copy_streaming, fence, Aligned, Direct, ALIGN, BLOCK};
use crate::sha256x4::{self, Lane, LANES};
use crate::stream::{Buf, Pool, Span};

const COMPARE_STEP: usize = 1 << 20;
/// content up to this size is gathered in memory and deduplicated before it is written;
/// larger content is written as it streams and rolled back on a match
pub const MEM_MAX: u64 = 4 << 20;
/// the pack is handed to the kernel's write-back each time it grew this much (`FLUSH_STEP`)
const FLUSH_STEP: u64 = 16 << 20;
/// bytes go to the hasher in batches of about this many; with `hash_depth` this bounds the
/// read blocks kept alive for it
const BATCH_BYTES: usize = 512 << 10;
/// batches waiting for the hasher besides those of a lane group (`hash_depth`); the blocks
/// they reference stay allocated meanwhile
const HASH_DEPTH: usize = 2;
/// a lane group's bytes that the hasher's queue takes at most (`hash_depth`)
const GROUP_QUEUED_MAX: u64 = 4 << 20;

/// Batches the hasher's queue holds for chunks of `chunk_size`: a group of `LANES` chunks'
/// worth (up to `GROUP_QUEUED_MAX`) plus `HASH_DEPTH`. The hasher takes a group's batches
/// quickly and then hashes the group in one go; the room for a group's batches keeps the
/// parser going meanwhile, and the reader behind it (the source digest, the longest serial
/// work), where with less room both stop and a core idles (bench/results/issue23-log.md,
/// session 22).
fn hash_depth(chunk_size: u64) -> usize {
    ((LANES as u64 * chunk_size).min(GROUP_QUEUED_MAX) / BATCH_BYTES as u64) as usize + HASH_DEPTH
}

/// content up to this size is gathered with its neighbours and written in one `pwrite` of
/// up to `GATHER_BYTES` where it does not go through the O_DIRECT blocks (`put`): one write
/// per small member cost the parser a syscall and the kernel's per-page work of two
/// partial-page writes per member
const GATHER_MAX: usize = 64 << 10;
const GATHER_BYTES: usize = 512 << 10;
/// the share of a layer's file in the page cache from which its content goes through the
/// O_DIRECT blocks (`warm`)
const WARM: f64 = 0.75;

/// A place of content: pack index and offset in it.
pub type Loc = (u32, u64);

/// `Known::source` of content with no source file to compare it in
const NO_SOURCE: NonZeroU32 = NonZeroU32::MAX;

/// Remembered content: its place in a pack and, where it came from a layer read natively
/// from an uncompressed file, its place in that file (`PackCore::sources`), where dedup
/// compares read it: its pack bytes may have gone to disk with O_DIRECT.
#[derive(Clone, Copy)]
struct Known {
    pack: u32,
    source: NonZeroU32, // 1 + its index in `sources` (the niche keeps `Locs` at 24 bytes)
    offset: u64,
    at: u64, // in the source
}

impl Known {
    fn loc(&self) -> Loc {
        (self.pack, self.offset)
    }
}

/// An index entry: nearly always one content per key (a boxed slice for the rest keeps it
/// small).
enum Locs {
    One(Known),
    Many(Box<[Known]>),
}
const _: () = assert!(std::mem::size_of::<Locs>() == 24);

/// A chunk being gathered: the bytes hashed so far (a mark hashes what came before it) and
/// the spans that follow them, not yet hashed.
#[derive(Default)]
struct Chunk {
    lane: Lane,
    spans: Vec<Span>,
    size: u64, // the lane's bytes and the spans'
}

/// The chunk digests of a byte stream fed in order, with snapshots to return to.
///
/// Complete chunks wait (their spans referenced) until `LANES` of them are hashed together;
/// a mark first hashes everything fed, so its snapshot is a copy of the open chunk's lane
/// and a rollback drops whatever came since.
pub struct ChunkSums {
    chunk_size: u64,
    digests: Vec<[u8; 32]>,
    full: Vec<Chunk>, // complete, fewer than LANES
    cur: Chunk,
    marks: Vec<(usize, Lane)>,
}

impl ChunkSums {
    pub fn new(chunk_size: u64) -> ChunkSums {
        ChunkSums {
            chunk_size,
            digests: Vec::new(),
            full: Vec::new(),
            cur: Chunk::default(),
            marks: Vec::new(),
        }
    }

    /// Bytes written to the pack, in order.
    pub fn update(&mut self, mut span: Span) {
        while span.start < span.end {
            let n = ((self.chunk_size - self.cur.size) as usize).min(span.end - span.start);
            self.cur.size += n as u64;
            let rest = if n < span.end - span.start {
                let mut head = span.clone();
                head.end = span.start + n;
                self.cur.spans.push(head);
                span.start += n;
                Some(span)
            } else {
                self.cur.spans.push(span);
                None
            };
            if self.cur.size == self.chunk_size {
                self.full.push(std::mem::take(&mut self.cur));
                if self.full.len() == LANES {
                    self.hash(false);
                }
            }
            match rest {
                Some(r) => span = r,
                None => return,
            }
        }
    }

    /// The complete chunks hashed (their digests out, in order), and the open chunk's
    /// spans too when `open` (in the same lanes).
    fn hash(&mut self, open: bool) {
        let mut chunks: Vec<&mut Chunk> = self.full.iter_mut().collect();
        if open && !self.cur.spans.is_empty() {
            chunks.push(&mut self.cur);
        }
        for group in chunks.chunks_mut(LANES) {
            let (mut lanes, parts): (Vec<&mut Lane>, Vec<Vec<&[u8]>>) = group
                .iter_mut()
                .map(|c| (&mut c.lane, c.spans.iter().map(Span::bytes).collect()))
                .unzip();
            let parts: Vec<&[&[u8]]> = parts.iter().map(Vec::as_slice).collect();
            sha256x4::update_lanes(&mut lanes, &parts);
        }
        self.digests.extend(self.full.drain(..).map(|c| c.lane.finish()));
        self.cur.spans.clear();
    }

    /// Snapshot number `depth` (the marks below it stay).
    pub fn mark(&mut self, depth: usize) {
        self.hash(true);
        self.marks.truncate(depth);
        self.marks.push((self.digests.len(), self.cur.lane.clone()));
    }

    pub fn release(&mut self, depth: usize) {
        self.marks.truncate(depth);
    }

    /// Back to snapshot `depth` (dropped with the ones above it).
    pub fn rollback(&mut self, depth: usize) {
        if let Some((n, lane)) = self.marks.get(depth).cloned() {
            self.digests.truncate(n);
            self.full.clear();
            self.cur = Chunk {
                size: lane.len(),
                lane,
                spans: Vec::new(),
            };
        }
        self.marks.truncate(depth);
    }

    /// The digests, the last (short) chunk's included.
    pub fn finish(mut self) -> Vec<[u8; 32]> {
        self.hash(true);
        if self.cur.size > 0 {
            self.digests.push(self.cur.lane.finish());
        }
        self.digests
    }
}

enum Job {
    Bytes(Vec<Span>),
    Mark(usize),
    Release(usize),
    Rollback(usize),
    /// hash what is held (a layer's read is over: its blocks go back before the writer)
    Settle,
}

/// `ChunkSums` on a thread of its own (the second core), fed batches of spans.
struct Hasher {
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<ChunkSums>>,
}

impl Hasher {
    fn new(chunk_size: u64) -> Hasher {
        let (tx, rx) = sync_channel::<Job>(hash_depth(chunk_size));
        let thread = std::thread::Builder::new()
            .name("pack-sha256".into())
            .spawn(move || {
                let mut sums = ChunkSums::new(chunk_size);
                for job in rx {
                    match job {
                        Job::Bytes(spans) => {
                            for s in spans {
                                sums.update(s);
                            }
                        }
                        Job::Mark(d) => sums.mark(d),
                        Job::Release(d) => sums.release(d),
                        Job::Rollback(d) => sums.rollback(d),
                        Job::Settle => sums.hash(true),
                    }
                }
                if crate::native_times() {
                    eprintln!("native pack-sha256: {:?} CPU", crate::thread_cpu());
                }
                sums
            })
            .expect("spawn pack-sha256");
        Hasher {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    fn send(&self, job: Job) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(job); // a dead hasher is reported by `finish`
        }
    }

    fn finish(&mut self) -> io::Result<ChunkSums> {
        self.tx = None;
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(sums)) => Ok(sums),
            _ => Err(io::Error::other("the pack hasher thread failed")),
        }
    }
}

/// Starts the pack's write-back on a thread of its own: `sync_file_range` may wait for the
/// disk (block allocation, a full request queue), and neither the parser nor the hasher
/// (which the parser waits for) should. The disk works beside the CPU and the final fsync
/// has little left; errors surface there.
struct Flusher {
    tx: Option<SyncSender<(u64, u64)>>,
    thread: Option<JoinHandle<()>>,
}

impl Flusher {
    fn new(file: Arc<File>) -> Flusher {
        let (tx, rx) = sync_channel::<(u64, u64)>(4);
        let thread = std::thread::Builder::new()
            .name("pack-flush".into())
            .spawn(move || {
                for (from, to) in rx {
                    // SAFETY: a plain syscall on an open fd
                    unsafe {
                        libc::sync_file_range(
                            file.as_raw_fd(),
                            from as i64,
                            (to - from) as i64,
                            libc::SYNC_FILE_RANGE_WRITE,
                        );
                    }
                }
            })
            .expect("spawn pack-flush");
        Flusher {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    /// Start write-back of `from..to`; false when the flusher is busy (never waits: the
    /// next request covers the range).
    fn request(&self, from: u64, to: u64) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.try_send((from, to)).is_ok())
    }

    fn stop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Is most of `fd` from `start` on in the page cache (`WARM`)? A cold read shares the disk
/// with the pack's writes: buffered small content is written back after the read, while
/// the disk is idle (the synthetic set cold with it through the O_DIRECT blocks: 0 of 4
/// pairs faster, 8.75 against 8.01 s); and its dedup compares would read the disk where the
/// input's pages went (issue23-log.md, "Small content without the page cache").
fn warm(fd: RawFd, start: u64) -> bool {
    // SAFETY: a zeroed stat is valid; fstat fills it on the caller's open fd
    let (r, st) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut st), st)
    };
    if r != 0 {
        return false;
    }
    let len = (st.st_size as u64).saturating_sub(start);
    crate::stream::cached_bytes(fd, start, len).is_some_and(|n| n as f64 >= WARM * len as f64)
}

/// Are the bytes of `spans` equal to as many read by `read(buf, offset)` from `at` on?
fn same_as_read(
    spans: &[Span],
    mut at: u64,
    scratch: &mut Vec<u8>,
    mut read: impl FnMut(&mut [u8], u64) -> io::Result<()>,
) -> io::Result<bool> {
    for span in spans {
        let data = span.bytes();
        let mut done = 0;
        while done < data.len() {
            let n = COMPARE_STEP.min(data.len() - done);
            scratch.resize(n, 0);
            read(&mut scratch[..n], at)?;
            if scratch[..n] != data[done..done + n] {
                return Ok(false);
            }
            done += n;
            at += n as u64;
        }
    }
    Ok(true)
}

pub(crate) fn pread_exact(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
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
    bytes_reused: u64,
    depth: usize, // the hasher's snapshot
}

pub struct PackCore {
    file: Arc<File>,
    pub size: u64,
    index: HashMap<u64, Locs>,
    fds: HashMap<u32, RawFd>, // in-place packs (their fds are the Python side's)
    /// a base image's packs (`build --base`): compared only where their chunks are verified
    base: Option<Arc<BasePackSet>>,
    /// the uncompressed files of the layers read natively (`begin_layer`), open until the
    /// pack is finished: remembered content is compared where it lies in them
    sources: Vec<File>,
    /// the layer being read: its `Known::source` and the file offset of its stream's start
    source: Option<(NonZeroU32, u64)>,
    hasher: Hasher,
    flusher: Flusher,
    /// bytes written but not yet handed to the hasher (all after the newest mark)
    pending: Vec<Span>,
    pending_bytes: usize,
    /// bytes that came without a shared block (Python's pieces), gathered for the hasher
    copied: Option<Buf>,
    copies: Arc<Pool>,
    marks: usize, // open marks (the hasher's snapshots)
    flushed: u64, // write-back started up to here
    pub bytes_in: u64,
    pub bytes_deduped: u64,
    /// content found in the base image's packs (not written)
    pub bytes_reused: u64,
    /// keys remembered since the oldest open mark, in order (for a rollback)
    journal: Option<Vec<u64>>,
    scratch: Vec<u8>,
    scratch2: Vec<u8>,
    /// the pack's last bytes, from `gathered_at` to `size`, not yet written to the file;
    /// only while a layer is read natively (`begin_layer`): Python's appends, whose readers
    /// may read the file by another fd, are written at once
    gathering: bool,
    gathered: Vec<u8>,
    gathered_at: u64,
    /// streamed content's O_DIRECT writer (None: every write is buffered)
    direct: Option<Direct>,
    /// while a layer's native read stages content (`staging`): the block it is copied
    /// into, its file offset (a multiple of `ALIGN`) and how many bytes it holds; the
    /// pack's bytes from there to `size` are in it, the full blocks before it written or
    /// queued
    staged: Option<(u64, Aligned, usize)>,
    /// the pack's size when the staged block began: the bytes before it are on file
    staged_from: u64,
    /// full staged blocks written through the buffered fd (the direct writer was behind)
    pub spilled: u64,
    /// time the writer waited for the hasher to take a batch (`BUI_NATIVE_TIMES`)
    pub hash_wait: std::time::Duration,
}

pub enum Put {
    New(Loc),
    Dup(Loc),
}

impl PackCore {
    /// `direct`: streamed content is written with O_DIRECT where the filesystem takes it.
    pub fn new(file: File, chunk_size: u64, direct: bool) -> PackCore {
        let file = Arc::new(file);
        let direct = if direct { Direct::open(&file) } else { None };
        let hasher = Hasher::new(chunk_size);
        let flusher = Flusher::new(Arc::clone(&file));
        PackCore {
            file,
            size: 0,
            index: HashMap::new(),
            fds: HashMap::new(),
            base: None,
            sources: Vec::new(),
            source: None,
            hasher,
            flusher,
            pending: Vec::new(),
            pending_bytes: 0,
            copied: None,
            copies: Pool::new(BATCH_BYTES),
            marks: 0,
            flushed: 0,
            bytes_in: 0,
            bytes_deduped: 0,
            bytes_reused: 0,
            journal: None,
            scratch: Vec::new(),
            scratch2: Vec::new(),
            gathering: false,
            gathered: Vec::new(),
            gathered_at: 0,
            direct,
            staged: None,
            staged_from: 0,
            spilled: 0,
            hash_wait: std::time::Duration::ZERO,
        }
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn set_pack_fd(&mut self, pack: u32, fd: RawFd) {
        self.fds.insert(pack, fd);
    }

    /// The base image's packs; their content is remembered by the caller (`remember`).
    pub fn set_base(&mut self, base: Arc<BasePackSet>) {
        self.base = Some(base);
    }

    fn pack_fd(&self, pack: u32) -> io::Result<RawFd> {
        if pack == 0 {
            return Ok(self.fd());
        }
        if let Some(fd) = self.base.as_ref().and_then(|b| b.fd(pack)) {
            return Ok(fd);
        }
        self.fds
            .get(&pack)
            .copied()
            .ok_or_else(|| io::Error::other(format!("pack {pack} has no open file")))
    }

    pub fn candidates(&self, key: u64) -> Vec<Loc> {
        self.known(key).iter().map(Known::loc).collect()
    }

    fn known(&self, key: u64) -> Vec<Known> {
        match self.index.get(&key) {
            None => Vec::new(),
            Some(Locs::One(k)) => vec![*k],
            Some(Locs::Many(v)) => v.to_vec(),
        }
    }

    /// Content at `loc` (compared in its pack).
    pub fn remember(&mut self, key: u64, loc: Loc) {
        self.remember_known(
            key,
            Known {
                pack: loc.0,
                source: NO_SOURCE,
                offset: loc.1,
                at: 0,
            },
        );
    }

    fn remember_known(&mut self, key: u64, known: Known) {
        match self.index.get_mut(&key) {
            None => {
                self.index.insert(key, Locs::One(known));
            }
            Some(slot @ Locs::Many(_)) => {
                let Locs::Many(v) = std::mem::replace(slot, Locs::Many(Box::new([]))) else {
                    unreachable!()
                };
                *slot = Locs::Many([&v[..], &[known]].concat().into());
            }
            Some(slot @ Locs::One(_)) => {
                let Locs::One(first) = *slot else { unreachable!() };
                *slot = Locs::Many(Box::new([first, known]));
            }
        }
        if let Some(j) = &mut self.journal {
            j.push(key);
        }
    }

    fn forget_last(&mut self, key: u64) {
        let remove = match self.index.get_mut(&key) {
            Some(slot @ Locs::Many(_)) => {
                let Locs::Many(v) = std::mem::replace(slot, Locs::Many(Box::new([]))) else {
                    unreachable!()
                };
                *slot = match &v[..v.len() - 1] {
                    [only] => Locs::One(*only),
                    rest => Locs::Many(rest.into()),
                };
                false
            }
            Some(Locs::One(_)) => true,
            None => false,
        };
        if remove {
            self.index.remove(&key);
        }
    }

    /// `buf.len()` bytes of pack `pack` at `offset` (pack 0's gathered bytes from memory).
    fn read_at(&self, pack: u32, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let fd = self.pack_fd(pack)?;
        let end = offset + buf.len() as u64;
        if pack != 0 || self.gathered.is_empty() || end <= self.gathered_at {
            return pread_exact(fd, buf, offset);
        }
        let split = self.gathered_at.saturating_sub(offset) as usize;
        pread_exact(fd, &mut buf[..split], offset)?;
        let from = (offset + split as u64 - self.gathered_at) as usize;
        let n = buf.len() - split;
        let src = self
            .gathered
            .get(from..from + n)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "short read of a pack"))?;
        buf[split..].copy_from_slice(src);
        Ok(())
    }

    /// The gathered and staged bytes written to the file (before anything reads the file by
    /// its fd).
    pub fn write_gathered(&mut self) -> io::Result<()> {
        self.unstage()?;
        if !self.gathered.is_empty() {
            self.file.write_all_at(&self.gathered, self.gathered_at)?;
            self.gathered.clear();
        }
        Ok(())
    }

    /// A layer is read natively: small content is gathered until `end_layer`. `source`: the
    /// uncompressed file it is read from (the fd stays the caller's; a duplicate is kept)
    /// and the file offset of the stream's start; where the page cache holds most of the
    /// file (`WARM`), its content goes through the O_DIRECT blocks whatever its size
    /// (`put`), compared where it lies in the file.
    pub fn begin_layer(&mut self, source: Option<(RawFd, u64)>) {
        self.gathering = true;
        self.source = source.filter(|&(fd, start)| warm(fd, start)).and_then(|(fd, start)| {
            // SAFETY: the caller's fd is open for the call
            let file = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
                .try_clone_to_owned()
                .ok()?; // no duplicate (no fds left): compared in the pack, written buffered
            self.sources.push(File::from(file));
            Some((NonZeroU32::new(self.sources.len() as u32)?, start))
        });
    }

    /// A layer's read is over: the gathered bytes written and their buffer freed, the
    /// hasher's held spans hashed (the build's peak RSS comes later, in the writer: the
    /// read blocks' pool is freed only once no span references a block of it; synthetic
    /// set 91-92 MB instead of 95-97).
    pub fn end_layer(&mut self) -> io::Result<()> {
        self.gathering = false;
        self.source = None;
        self.write_gathered()?;
        self.gathered = Vec::new();
        self.hand_over(true);
        self.hasher.send(Job::Settle);
        if let Some(d) = &mut self.direct {
            d.release_memory();
            if crate::native_times() {
                eprintln!(
                    "native pack: {} MiB written with O_DIRECT, {} MiB of full blocks through the page cache, {:?} waiting for the writer{}",
                    d.queued >> 20,
                    self.spilled >> 20,
                    d.room_wait,
                    if d.refused() { " (O_DIRECT refused)" } else { "" }
                );
            }
        }
        Ok(())
    }

    /// Streamed bytes of a layer's native read (and all of an uncompressed layer's content)
    /// go through an aligned block to the O_DIRECT writer (not where O_DIRECT was refused).
    fn staging(&self) -> bool {
        self.gathering && self.direct.as_ref().is_some_and(|d| !d.refused())
    }

    /// `data` appended through the staged block (started at the aligned offset at or below
    /// the pack's end, its first bytes read back from the file); each full block queued.
    fn stage(&mut self, mut data: &[u8]) -> io::Result<()> {
        let Some(direct) = &mut self.direct else {
            return Err(io::Error::other("the pack has no direct writer"));
        };
        let (mut at, mut block, mut fill) = match self.staged.take() {
            Some(s) => s,
            None => {
                // gathered bytes are written first (the head below may lie in them)
                let at = self.size & !(ALIGN - 1);
                let fill = (self.size - at) as usize;
                self.staged_from = self.size;
                let mut block = direct.block()?;
                pread_exact(self.file.as_raw_fd(), &mut block.bytes_mut()[..fill], at)?;
                (at, block, fill)
            }
        };
        while !data.is_empty() {
            let n = (BLOCK - fill).min(data.len());
            copy_streaming(&mut block.bytes_mut()[fill..fill + n], &data[..n]);
            fill += n;
            data = &data[n..];
            self.size += n as u64;
            if fill == BLOCK {
                fence();
                if direct.has_room() {
                    direct.submit(at, block)?;
                    block = direct.block()?;
                } else {
                    // the disk is behind: to the page cache, written back later
                    self.file.write_all_at(block.bytes(), at)?;
                    self.spilled += BLOCK as u64;
                }
                at += BLOCK as u64;
                fill = 0;
            }
        }
        self.staged = Some((at, block, fill));
        Ok(())
    }

    /// The staged bytes on file: the queued blocks written, the partial one through the
    /// buffered fd (the pack's page cache then holds the end the next append joins).
    fn unstage(&mut self) -> io::Result<()> {
        let staged = self.staged.take();
        if staged.is_some() {
            fence(); // the tail below is read by this thread's write
        }
        let Some(direct) = &mut self.direct else {
            return Ok(());
        };
        // every queued block, also after a failed append (a rollback truncates next)
        let drained = direct.drain();
        let Some((at, block, fill)) = staged else {
            return drained;
        };
        let tail = drained.and_then(|()| self.file.write_all_at(&block.bytes()[..fill], at));
        direct.recycle(block);
        tail
    }

    /// Whether `size` bytes at `loc` may be compared: not in a base pack, or in chunks that
    /// match their digests (a corrupt base chunk: not the same bytes, written anew).
    fn comparable(&self, loc: Loc, size: u64) -> bool {
        match &self.base {
            Some(base) if base.holds(loc.0) => base.verified(loc, size),
            _ => true,
        }
    }

    /// A compare that read `pack`: where that is a base pack whose read failed, not the
    /// same bytes (its file changed since its chunks were checked: the content is written
    /// anew, as where a chunk fails its digest).
    fn unless_base_unread(&self, pack: u32, same: io::Result<bool>) -> io::Result<bool> {
        match same {
            Err(_) if self.base.as_ref().is_some_and(|b| b.holds(pack)) => Ok(false),
            same => same,
        }
    }

    /// A duplicate of the content at `loc` was found: counted as reused (in the base's
    /// packs) or deduplicated.
    fn count_match(&mut self, loc: Loc, size: u64) {
        if self.base.as_ref().is_some_and(|b| b.holds(loc.0)) {
            self.bytes_reused += size;
        } else {
            self.bytes_deduped += size;
        }
    }

    /// Are the bytes of `spans` equal to as many bytes at `loc`?
    fn same_as_spans(&mut self, loc: Loc, spans: &[Span]) -> io::Result<bool> {
        let size: u64 = spans.iter().map(|s| (s.end - s.start) as u64).sum();
        if !self.comparable(loc, size) {
            return Ok(false);
        }
        self.unstage()?;
        let mut scratch = std::mem::take(&mut self.scratch);
        let same = same_as_read(spans, loc.1, &mut scratch, |buf, at| self.read_at(loc.0, buf, at));
        self.scratch = scratch;
        self.unless_base_unread(loc.0, same)
    }

    /// Are the bytes of `spans` equal to the remembered content's? Compared in its source
    /// file where it has one (in the page cache: the layer's read just went through it),
    /// else, or where that file is shorter now, in its pack.
    fn same_as_known(&mut self, known: &Known, spans: &[Span]) -> io::Result<bool> {
        if let Some(file) = self.sources.get(known.source.get() as usize - 1) {
            let fd = file.as_raw_fd();
            let mut scratch = std::mem::take(&mut self.scratch);
            let same = same_as_read(spans, known.at, &mut scratch, |buf, at| pread_exact(fd, buf, at));
            self.scratch = scratch;
            if let Ok(same) = same {
                return Ok(same);
            }
        }
        self.same_as_spans(known.loc(), spans)
    }

    /// Are two ranges of packs equal?
    pub fn same_ranges(&mut self, a: Loc, b: Loc, size: u64) -> io::Result<bool> {
        if !(self.comparable(a, size) && self.comparable(b, size)) {
            return Ok(false);
        }
        self.unstage()?;
        let (mut sa, mut sb) = (std::mem::take(&mut self.scratch), std::mem::take(&mut self.scratch2));
        let mut done = 0u64;
        let mut same = Ok(true);
        while done < size {
            let n = (COMPARE_STEP as u64).min(size - done) as usize;
            sa.resize(n, 0);
            sb.resize(n, 0);
            let read = self.read_at(a.0, &mut sa[..n], a.1 + done).map(|()| true);
            let read = match self.unless_base_unread(a.0, read) {
                Ok(true) => self.read_at(b.0, &mut sb[..n], b.1 + done).map(|()| true),
                other => other,
            };
            match self.unless_base_unread(b.0, read) {
                Ok(true) => {}
                other => {
                    same = other;
                    break;
                }
            }
            if sa[..n] != sb[..n] {
                same = Ok(false);
                break;
            }
            done += n as u64;
        }
        (self.scratch, self.scratch2) = (sa, sb);
        same
    }

    /// Content in shared blocks, all of it at hand: deduplicated before anything is
    /// written (when `dedupe`), then written and hashed from the blocks. `origin`: where it
    /// lies in the stream of the layer being read (`begin_layer`).
    pub fn put(&mut self, spans: &[Span], crc: u32, dedupe: bool, origin: Option<u64>) -> io::Result<Put> {
        let size: u64 = spans.iter().map(|s| (s.end - s.start) as u64).sum();
        self.bytes_in += size;
        let key = size << 32 | crc as u64;
        if dedupe {
            for known in self.known(key) {
                if self.same_as_known(&known, spans)? {
                    self.count_match(known.loc(), size);
                    return Ok(Put::Dup(known.loc()));
                }
            }
        }
        let at = self.size;
        let mut known = Known {
            pack: 0,
            source: NO_SOURCE,
            offset: at,
            at: 0,
        };
        if let (Some((source, start)), Some(origin), true) = (self.source, origin, self.staging()) {
            // compared in the source from now on: to the O_DIRECT blocks with the streams
            (known.source, known.at) = (source, start + origin);
            if !self.gathered.is_empty() {
                self.write_gathered()?;
            }
            for span in spans {
                self.stage(span.bytes())?;
                self.hash_later(span.clone());
            }
        } else if self.gathering && size as usize <= GATHER_MAX {
            self.unstage()?;
            if self.gathered.len() + size as usize > GATHER_BYTES {
                self.write_gathered()?;
            }
            if self.gathered.is_empty() {
                self.gathered_at = self.size;
            }
            for span in spans {
                self.gathered.extend_from_slice(span.bytes());
                self.size += (span.end - span.start) as u64;
                self.hash_later(span.clone());
            }
        } else {
            self.unstage()?;
            for span in spans {
                self.write_span(span.clone())?;
            }
        }
        if dedupe {
            self.remember_known(key, known);
        }
        self.final_size();
        Ok(Put::New((0, at)))
    }

    /// Streamed content starts: the pack may be rolled back to here (`end_stream`).
    pub fn begin_stream(&mut self) -> Mark {
        self.mark()
    }

    /// Streamed content: append a piece of a shared block.
    pub fn write_span(&mut self, span: Span) -> io::Result<()> {
        if self.staging() {
            if !self.gathered.is_empty() {
                self.write_gathered()?;
            }
            self.stage(span.bytes())?;
        } else {
            self.write_gathered()?;
            let data = span.bytes();
            self.file.write_all_at(data, self.size)?;
            self.size += data.len() as u64;
        }
        self.hash_later(span);
        Ok(())
    }

    /// Written bytes of a shared block on their way to the hasher.
    fn hash_later(&mut self, span: Span) {
        self.seal_copied();
        self.pending_bytes += span.end - span.start;
        self.pending.push(span);
        self.hand_over(false);
    }

    /// Streamed content: append a piece held elsewhere (copied for the hasher).
    pub fn write_piece(&mut self, mut data: &[u8]) -> io::Result<()> {
        self.write_gathered()?;
        self.file.write_all_at(data, self.size)?;
        self.size += data.len() as u64;
        while !data.is_empty() {
            let mut buf = match self.copied.take() {
                Some(b) => b,
                None => self.copies.get(),
            };
            let at = buf.len();
            let n = (BATCH_BYTES - at).min(data.len());
            buf.space()[at..at + n].copy_from_slice(&data[..n]);
            buf.set_len(at + n);
            data = &data[n..];
            self.pending_bytes += n;
            self.copied = Some(buf);
            if at + n == BATCH_BYTES {
                self.seal_copied();
            }
        }
        self.hand_over(false);
        Ok(())
    }

    fn seal_copied(&mut self) {
        if let Some(buf) = self.copied.take() {
            self.pending.push(Span::whole(Arc::new(buf)));
        }
    }

    /// Pending bytes to the hasher once a batch is full (or `now`).
    fn hand_over(&mut self, now: bool) {
        if self.pending_bytes >= BATCH_BYTES || (now && self.pending_bytes > 0) {
            self.seal_copied();
            let t = std::time::Instant::now();
            self.hasher.send(Job::Bytes(std::mem::take(&mut self.pending)));
            self.hash_wait += t.elapsed();
            self.pending_bytes = 0;
        }
    }

    /// Streamed content of `size` bytes appended since `mark` (`begin_stream`):
    /// deduplicated (rolled back on a match) and remembered when `dedupe`.
    pub fn end_stream(&mut self, mark: Mark, size: u64, crc: u32, dedupe: bool) -> io::Result<Put> {
        let start = mark.size;
        let key = size << 32 | crc as u64;
        self.unstage()?;
        if dedupe {
            for loc in self.candidates(key) {
                if self.same_ranges(loc, (0, start), size)? {
                    self.rollback(mark)?;
                    self.bytes_in += size;
                    self.count_match(loc, size);
                    return Ok(Put::Dup(loc));
                }
            }
        }
        self.release(mark);
        self.bytes_in += size;
        if dedupe {
            self.remember(key, (0, start));
        }
        self.final_size();
        Ok(Put::New((0, start)))
    }

    /// The pack's size is final (no rollback but an outer mark's can reach it): start its
    /// write-back every `FLUSH_STEP`.
    fn final_size(&mut self) {
        let written = if self.gathered.is_empty() {
            self.size
        } else {
            self.gathered_at
        };
        if written >= self.flushed + FLUSH_STEP && self.flusher.request(self.flushed, written) {
            self.flushed = written;
        }
    }

    pub fn mark(&mut self) -> Mark {
        let remembered = match &self.journal {
            Some(j) => j.len(),
            None => {
                self.journal = Some(Vec::new());
                0
            }
        };
        // what is pending precedes the mark: hashed before the snapshot
        self.hand_over(true);
        let depth = self.marks;
        self.hasher.send(Job::Mark(depth));
        self.marks += 1;
        Mark {
            size: self.size,
            remembered,
            bytes_in: self.bytes_in,
            bytes_deduped: self.bytes_deduped,
            bytes_reused: self.bytes_reused,
            depth,
        }
    }

    /// Keep what was added since the mark (the journal closes with the outermost mark).
    pub fn release(&mut self, mark: Mark) {
        if mark.remembered == 0 && mark.depth == 0 {
            self.journal = None;
        }
        self.hasher.send(Job::Release(mark.depth));
        self.marks = mark.depth;
    }

    /// Undo everything since `mark`: file size, remembered keys, counters, chunk digests.
    pub fn rollback(&mut self, mark: Mark) -> io::Result<()> {
        if self.staged.is_some() && mark.size > self.staged_from {
            // the staged bytes before the mark are kept: written as `unstage` does
            self.unstage()?;
        }
        // staged and queued bytes all lie after the mark: their writes finish, their
        // errors (a full disk) are cut off with them
        self.staged = None;
        if let Some(d) = &mut self.direct {
            let _ = d.drain();
        }
        // written first: the file is then cut where the mark was, wherever that lies
        self.write_gathered()?;
        let keys: Vec<u64> = match &mut self.journal {
            Some(j) => j.split_off(mark.remembered),
            None => Vec::new(),
        };
        for key in keys.into_iter().rev() {
            self.forget_last(key);
        }
        if mark.depth == 0 {
            self.journal = None;
        }
        // everything pending came after the newest mark, so after this one: never hashed
        self.pending.clear();
        self.pending_bytes = 0;
        self.copied = None;
        self.hasher.send(Job::Rollback(mark.depth));
        self.marks = mark.depth;
        self.file.set_len(mark.size)?;
        self.size = mark.size;
        self.flushed = self.flushed.min(mark.size);
        self.bytes_in = mark.bytes_in;
        self.bytes_deduped = mark.bytes_deduped;
        self.bytes_reused = mark.bytes_reused;
        Ok(())
    }

    /// All chunks hashed, the file synced: the chunk digests.
    pub fn finish(&mut self) -> io::Result<Vec<[u8; 32]>> {
        self.write_gathered()?;
        if let Some(d) = &mut self.direct {
            d.stop();
        }
        self.hand_over(true);
        self.flusher.stop();
        let sums = self.hasher.finish()?;
        self.file.sync_all()?;
        Ok(sums.finish())
    }

    pub fn abort(&mut self) {
        self.staged = None;
        if let Some(d) = &mut self.direct {
            d.stop();
        }
        self.gathered.clear();
        self.pending.clear();
        self.flusher.stop();
        let _ = self.hasher.finish();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use sha2::{Digest, Sha256};
    use std::io::Read;

    #[test]
    fn hash_queue_takes_a_lane_group() {
        // 64 KiB chunks: a group (256 KiB) is less than a batch
        assert_eq!(hash_depth(64 << 10), HASH_DEPTH);
        assert_eq!(hash_depth(1 << 20), 4 * 2 + HASH_DEPTH);
        // larger chunks: the room stays that of a 4 MiB group
        assert_eq!(hash_depth(16 << 20), hash_depth(1 << 20));
    }

    /// xorshift64*: reproducible test data without a dependency
    pub(crate) struct Rng(pub u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    fn shared(data: &[u8]) -> Span {
        Span::whole(Arc::new(Buf::owned(data.to_vec())))
    }

    /// Content as the parser hands it: cut into spans of separate blocks.
    fn spans_of(data: &[u8], rng: &mut Rng) -> Vec<Span> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < data.len() {
            let n = (1 + rng.below(data.len() as u64) as usize).min(data.len() - at);
            out.push(shared(&data[at..at + n]));
            at += n;
        }
        out
    }

    fn crc(data: &[u8]) -> u32 {
        crc32c::crc32c(data)
    }

    /// An empty pack file of this process in the temporary directory (the test removes it).
    pub(crate) fn temp_pack(name: &str) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!("pack-{name}-{}", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        (path, file)
    }

    /// Small content is held back and written in batches while a layer is read: reads of
    /// the pack (dedup compares, ranges across the written and the held-back bytes) see
    /// every byte appended, and the file has them all once the layer ends.
    #[test]
    fn gathered_bytes_are_read_back_before_they_are_written() {
        let mut rng = Rng(7);
        let (path, file) = temp_pack("gather");
        let mut core = PackCore::new(file, 1 << 20, true);
        core.begin_layer(None);
        let big = rng.bytes(GATHER_MAX + 1000); // written at once
        let small = rng.bytes(3000); // gathered
        let mut all = Vec::new();
        for data in [&big, &small] {
            assert!(matches!(
                core.put(&[shared(data)], crc(data), true, None).unwrap(),
                Put::New(_)
            ));
            all.extend_from_slice(data);
        }
        assert!(!core.gathered.is_empty());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), big.len() as u64);
        // a range across the written and the gathered bytes, equal and then not
        let at = big.len() - 100;
        let across = all[at..at + 600].to_vec();
        assert!(core.same_as_spans((0, at as u64), &[shared(&across)]).unwrap());
        let mut changed = across.clone();
        changed[550] ^= 1;
        assert!(!core.same_as_spans((0, at as u64), &[shared(&changed)]).unwrap());
        // a duplicate of the gathered content is found in memory
        let put = core.put(&[shared(&small)], crc(&small), true, None).unwrap();
        assert!(matches!(put, Put::Dup((0, o)) if o == big.len() as u64));
        // reading past the end is an error, not bytes
        let mut buf = vec![0u8; 10];
        assert!(core.read_at(0, &mut buf, all.len() as u64 - 5).is_err());
        core.end_layer().unwrap();
        assert!(core.gathered.is_empty() && core.gathered.capacity() == 0);
        assert_eq!(std::fs::read(&path).unwrap(), all);
        // outside a layer's native read, content is written at once
        let more = rng.bytes(100);
        core.put(&[shared(&more)], crc(&more), true, None).unwrap();
        all.extend_from_slice(&more);
        assert_eq!(std::fs::read(&path).unwrap(), all);
        let digests = core.finish().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(digests, vec![<[u8; 32]>::from(Sha256::digest(&all))]);
    }

    /// The pack's chunk digests computed as the bytes are written equal sha256 of the
    /// file's chunks read back (what the hasher did before), through duplicates rolled
    /// back after streaming, failed streams, and a whole layer rolled back and released.
    #[test]
    fn chunk_digests_match_the_file_through_rollbacks() {
        for seed in 1..=6u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let chunk = [4096u64, 1000, 1 << 20][(seed % 3) as usize];
            let (path, file) = temp_pack(&format!("test-{seed}"));
            let mut core = PackCore::new(file, chunk, seed % 3 != 0);
            if seed % 2 == 1 {
                core.begin_layer(None); // small content gathered, the rest as Python appends
            }
            let mut contents: Vec<Vec<u8>> = Vec::new();
            let mut layer: Option<(Mark, usize)> = None;
            for step in 0..300 {
                if step % 50 == 10 {
                    layer = Some((core.mark(), contents.len()));
                } else if step % 50 == 40 {
                    let (mark, n) = layer.take().unwrap();
                    if step % 100 == 40 {
                        core.rollback(mark).unwrap();
                        contents.truncate(n);
                    } else {
                        core.release(mark);
                    }
                }
                let reuse = !contents.is_empty() && rng.below(4) == 0;
                let data = if reuse {
                    contents[rng.below(contents.len() as u64) as usize].clone()
                } else {
                    let n = [1usize, 100, 5000, 70_000, 300_000][rng.below(5) as usize];
                    let len = 1 + rng.below(n as u64) as usize;
                    rng.bytes(len)
                };
                let known = contents.contains(&data);
                let put = match rng.below(4) {
                    0 | 1 => {
                        let spans = spans_of(&data, &mut rng);
                        core.put(&spans, crc(&data), true, None).unwrap()
                    }
                    2 => {
                        let mark = core.begin_stream();
                        for (i, s) in spans_of(&data, &mut rng).into_iter().enumerate() {
                            if i % 2 == 0 {
                                core.write_span(s).unwrap();
                            } else {
                                core.write_piece(s.bytes()).unwrap();
                            }
                        }
                        core.end_stream(mark, data.len() as u64, crc(&data), true).unwrap()
                    }
                    _ => {
                        // a stream that fails half way (truncated input): rolled back
                        let mark = core.begin_stream();
                        core.write_piece(&data[..data.len() / 2]).unwrap();
                        core.rollback(mark).unwrap();
                        continue;
                    }
                };
                assert_eq!(matches!(put, Put::Dup(_)), known);
                if !known {
                    contents.push(data);
                }
            }
            let size = core.size;
            let digests = core.finish().unwrap();
            let mut all = Vec::new();
            File::open(&path).unwrap().read_to_end(&mut all).unwrap();
            std::fs::remove_file(&path).unwrap();
            assert_eq!(all.len() as u64, size);
            let expect: Vec<[u8; 32]> = all.chunks(chunk as usize).map(|c| Sha256::digest(c).into()).collect();
            assert_eq!(digests, expect, "seed {seed}, chunk {chunk}");
        }
    }

    /// Several contents under one key are candidates in the order remembered; a rollback
    /// forgets those remembered since its mark, back to one.
    #[test]
    fn several_contents_per_key_through_rollbacks() {
        let (path, file) = temp_pack("index");
        let mut core = PackCore::new(file, 1 << 20, false);
        core.remember(7, (0, 10));
        for more in [vec![(0, 20)], vec![(0, 20), (1, 30)]] {
            let mark = core.mark();
            for &loc in &more {
                core.remember(7, loc);
            }
            core.remember(8, (0, 40));
            assert_eq!(core.candidates(7), [vec![(0, 10)], more].concat());
            core.rollback(mark).unwrap();
            assert_eq!(core.candidates(7), vec![(0, 10)]);
            assert!(core.candidates(8).is_empty());
        }
        core.finish().unwrap();
        std::fs::remove_file(&path).unwrap();
    }

    /// Content of a layer read from an uncompressed file, whatever its size, goes through
    /// the O_DIRECT blocks (not where they are refused: gathered and written buffered) and
    /// its duplicates are found by comparing the file's bytes (the staged block stays, the
    /// pack is not read), also after the layer; a remembered place whose source bytes
    /// differ is no match, one whose source is shorter now is compared in the pack. A
    /// stream that starts inside a staged block and is rolled back keeps the bytes before
    /// it; the file holds every byte kept, its last partial block included, and the chunk
    /// digests match.
    #[test]
    fn layer_content_compared_in_its_source() {
        for refuse in [false, true] {
            let mut rng = Rng(if refuse { 23 } else { 29 });
            // the source: contents one after another (as a tar's members, without headers)
            let contents: Vec<Vec<u8>> = (0..400)
                .map(|i| {
                    let most = [100u64, 5000, 70_000][i % 3];
                    let len = 1 + rng.below(most) as usize;
                    rng.bytes(len)
                })
                .collect();
            let lead = 777u64; // the stream starts here in the file
            let mut source = vec![0u8; lead as usize];
            let mut at = Vec::new();
            for c in &contents {
                at.push(source.len() as u64 - lead);
                source.extend_from_slice(c);
            }
            let (src_path, src) = temp_pack(&format!("source-{refuse}"));
            src.write_all_at(&source, 0).unwrap();
            let (path, file) = temp_pack(&format!("sourced-{refuse}"));
            let mut core = PackCore::new(file, 1 << 20, true);
            if refuse {
                core.direct = Some(Direct::refusing(&core.file));
            }
            core.begin_layer(Some((src.as_raw_fd(), lead)));
            let mut all: Vec<u8> = Vec::new();
            let mut placed: Vec<Loc> = Vec::new();
            for (i, c) in contents.iter().enumerate() {
                let put = core.put(&spans_of(c, &mut rng), crc(c), true, Some(at[i])).unwrap();
                assert!(matches!(put, Put::New((0, o)) if o == all.len() as u64));
                placed.push((0, all.len() as u64));
                all.extend_from_slice(c);
            }
            assert!(refuse || core.staged.is_some());
            // duplicates, their first copies mostly on disk: compared in the source
            for i in (0..contents.len()).step_by(7) {
                let c = &contents[i];
                let put = core.put(&[shared(c)], crc(c), true, Some(at[i])).unwrap();
                assert!(matches!(put, Put::Dup(l) if l == placed[i]));
            }
            assert!(refuse || core.staged.is_some(), "no read of the pack");
            // streams begun inside the staged block, failed and rolled back (within the
            // block, and past it)
            for n in [100, BLOCK + 99] {
                let mark = core.begin_stream();
                core.write_span(shared(&rng.bytes(n))).unwrap();
                core.rollback(mark).unwrap();
            }
            let last = rng.bytes(10_000);
            let put = core.put(&[shared(&last)], crc(&last), true, Some(0)).unwrap();
            assert!(matches!(put, Put::New((0, o)) if o == all.len() as u64));
            all.extend_from_slice(&last);
            core.end_layer().unwrap();
            // after the layer: a duplicate (Python's append) is compared in the source
            let c = &contents[3];
            let put = core.put(&[shared(c)], crc(c), true, None).unwrap();
            assert!(matches!(put, Put::Dup(l) if l == placed[3]));
            // `last` was remembered at the stream's offset 0, where the source holds other
            // bytes: no match there, so it is written again (refused: it was gathered,
            // remembered without its source, and compared in the pack)
            let put = core.put(&[shared(&last)], crc(&last), true, None).unwrap();
            assert_eq!(matches!(put, Put::New(_)), !refuse);
            if !refuse {
                all.extend_from_slice(&last);
            }
            // the source cut short: compared in the pack
            src.set_len(lead + at[5]).unwrap();
            let c = &contents[6];
            let put = core.put(&[shared(c)], crc(c), true, None).unwrap();
            assert!(matches!(put, Put::Dup(l) if l == placed[6]));
            // refused: the blocks queued before the writer met the refusal went through the
            // buffered fd, the rest was gathered
            let d = core.direct.as_ref().unwrap();
            assert_eq!(d.refused(), refuse);
            assert!(refuse || d.queued + core.spilled >= 2 * BLOCK as u64, "{}", d.queued);
            let digests = core.finish().unwrap();
            let written = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            std::fs::remove_file(&src_path).unwrap();
            assert!(written == all, "refuse {refuse}: the file differs");
            let expect: Vec<[u8; 32]> = all.chunks(1 << 20).map(|c| Sha256::digest(c).into()).collect();
            assert_eq!(digests, expect);
        }
    }

    /// A layer whose file the page cache holds (just written) is compared in that file and
    /// its small content staged for the O_DIRECT blocks; the same file synced and dropped
    /// from the page cache (a cold read) is neither: its small content is gathered and
    /// written buffered, and its duplicates are compared in the pack.
    #[test]
    fn a_cold_layer_file_takes_the_buffered_path() {
        let mut rng = Rng(31);
        let contents: Vec<Vec<u8>> = (0..64)
            .map(|_| {
                let len = 1 + rng.below(30_000) as usize;
                rng.bytes(len)
            })
            .collect();
        // on disk (a tmpfs /tmp keeps its pages: nothing would be cold there)
        let src_path = std::path::Path::new("/var/tmp").join(format!("pack-coldsource-{}", std::process::id()));
        let src = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&src_path)
            .unwrap();
        let mut at = Vec::new();
        let mut size = 0u64;
        for c in &contents {
            src.write_all_at(c, size).unwrap();
            at.push(size);
            size += c.len() as u64;
        }
        let fd = src.as_raw_fd();
        if crate::stream::cached_bytes(fd, 0, size).is_none() {
            std::fs::remove_file(&src_path).unwrap();
            panic!("this test needs cachestat (Linux 6.5): the build's warm/cold choice uses it");
        }
        assert!(warm(fd, 0), "a file just written is in the page cache");
        src.sync_all().unwrap();
        // SAFETY: a plain syscall on an open fd
        assert_eq!(unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) }, 0);
        assert!(
            !warm(fd, 0),
            "{}: the page cache kept a synced file after DONTNEED",
            src_path.display()
        );
        for layer_warm in [true, false] {
            if !layer_warm {
                // SAFETY: as above
                unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
            } else {
                let mut back = vec![0u8; size as usize];
                src.read_exact_at(&mut back, 0).unwrap(); // in the page cache again
            }
            assert_eq!(warm(fd, 0), layer_warm);
            let (path, file) = temp_pack(&format!("coldlayer-{layer_warm}"));
            let mut core = PackCore::new(file, 1 << 20, true);
            core.begin_layer(Some((fd, 0)));
            assert_eq!(core.source.is_some(), layer_warm);
            let mut all: Vec<u8> = Vec::new();
            for (i, c) in contents.iter().enumerate() {
                let put = core.put(&[shared(c)], crc(c), true, Some(at[i])).unwrap();
                assert!(matches!(put, Put::New((0, o)) if o == all.len() as u64));
                all.extend_from_slice(c);
            }
            assert_eq!(core.staged.is_some(), layer_warm, "staged for O_DIRECT");
            assert_eq!(core.gathered.is_empty(), layer_warm, "gathered for a buffered write");
            let c = &contents[9];
            let put = core.put(&[shared(c)], crc(c), true, Some(at[9])).unwrap();
            assert!(matches!(put, Put::Dup((0, o)) if o == at[9]));
            core.end_layer().unwrap();
            core.finish().unwrap();
            let written = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            assert!(written == all, "warm {layer_warm}: the file differs");
        }
        std::fs::remove_file(&src_path).unwrap();
    }

    /// Streamed content through the O_DIRECT blocks (as the filesystem takes them, and
    /// where the writes are refused): the file holds every byte appended, in order, through
    /// streams that span blocks, duplicates found after they went to disk (rolled back,
    /// the next stream starting inside a written block), small content gathered between
    /// streams, a failed stream and a whole layer rolled back; the chunk digests match.
    #[test]
    fn streamed_content_through_direct_blocks() {
        for (refuse, spill) in [(false, false), (true, false), (false, true)] {
            let mut rng = Rng(if refuse { 11 } else { 5 });
            let (path, file) = temp_pack(&format!("direct-{refuse}-{spill}"));
            let mut core = PackCore::new(file, 1 << 20, true);
            if refuse {
                core.direct = Some(Direct::refusing(&core.file));
            }
            if let (true, Some(d)) = (spill, &mut core.direct) {
                d.depth = 0; // the writer always behind: every full block to the page cache
            }
            assert!(core.direct.is_some(), "this test's filesystem takes O_DIRECT");
            core.begin_layer(None);
            let mut all: Vec<u8> = Vec::new();
            let stream = |core: &mut PackCore, data: &[u8], rng: &mut Rng| {
                let mark = core.begin_stream();
                let mut at = 0;
                while at < data.len() {
                    let n = (1 + rng.below(300_000) as usize).min(data.len() - at);
                    core.write_span(shared(&data[at..at + n])).unwrap();
                    at += n;
                }
                core.end_stream(mark, data.len() as u64, crc(data), true).unwrap()
            };
            let big = rng.bytes(3 * BLOCK + 12_345);
            let small = rng.bytes(777);
            for data in [&small, &big, &small] {
                let put = if data.len() > 1000 {
                    stream(&mut core, data, &mut rng)
                } else {
                    core.put(&[shared(data)], crc(data), true, None).unwrap()
                };
                if let Put::New(_) = put {
                    all.extend_from_slice(data);
                }
            }
            // a duplicate of the streamed content: compared with what went to disk, rolled back
            let put = stream(&mut core, &big, &mut rng);
            assert!(matches!(put, Put::Dup((0, 777))), "{refuse}");
            assert_eq!(core.size, all.len() as u64);
            // the next stream starts inside a block written before the rollback
            let other = rng.bytes(BLOCK + 5);
            assert!(matches!(stream(&mut core, &other, &mut rng), Put::New(_)));
            all.extend_from_slice(&other);
            // a stream that fails after full blocks were queued: rolled back
            let mark = core.begin_stream();
            core.write_span(shared(&rng.bytes(2 * BLOCK + 3))).unwrap();
            core.rollback(mark).unwrap();
            // a layer rolled back whole after streams went to disk
            let layer = core.mark();
            let gone = rng.bytes(2 * BLOCK);
            assert!(matches!(stream(&mut core, &gone, &mut rng), Put::New(_)));
            core.rollback(layer).unwrap();
            let last = rng.bytes(BLOCK / 2);
            assert!(matches!(stream(&mut core, &last, &mut rng), Put::New(_)));
            all.extend_from_slice(&last);
            core.end_layer().unwrap();
            let queued = core.direct.as_ref().map_or(0, |d| d.queued);
            // refused: the blocks queued before the writer met the refusal went through the
            // buffered fd, the later streams were not staged;
            // else the blocks the writer had no room for went through it
            let spilled = core.spilled;
            match (refuse, spill) {
                (true, _) => assert!((1..=4).contains(&(queued / BLOCK as u64)) && spilled == 0, "{queued}"),
                (_, true) => assert!(queued == 0 && spilled >= 6 * BLOCK as u64, "{spilled}"),
                _ => assert!(queued >= BLOCK as u64 && queued + spilled >= 6 * BLOCK as u64),
            }
            assert_eq!(core.direct.as_ref().unwrap().refused(), refuse);
            let digests = core.finish().unwrap();
            let file = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            assert!(file == all, "refuse {refuse}: the file differs");
            let expect: Vec<[u8; 32]> = all.chunks(1 << 20).map(|c| Sha256::digest(c).into()).collect();
            assert_eq!(digests, expect);
        }
    }

    /// `ChunkSums` against a model (the bytes kept, with the lengths the marks saw):
    /// spans of any length, nested marks released or rolled back (landing inside chunks
    /// still gathered, inside complete chunks waiting for their lanes, or on a boundary),
    /// and settles between, give sha256 of each chunk of the bytes kept.
    #[test]
    fn chunk_sums_match_a_model_through_nested_rollbacks() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let chunk = [64u64, 100, 1000, 4096, 1 << 16][(seed % 5) as usize];
            let mut sums = ChunkSums::new(chunk);
            let mut kept: Vec<u8> = Vec::new();
            let mut marks: Vec<usize> = Vec::new(); // kept.len() at each open mark
            for _ in 0..400 {
                match rng.below(10) {
                    0 if marks.len() < 4 => {
                        sums.mark(marks.len());
                        marks.push(kept.len());
                    }
                    1 if !marks.is_empty() => {
                        let depth = rng.below(marks.len() as u64) as usize;
                        sums.release(depth);
                        marks.truncate(depth);
                    }
                    2 | 3 if !marks.is_empty() => {
                        let depth = rng.below(marks.len() as u64) as usize;
                        sums.rollback(depth);
                        kept.truncate(marks[depth]);
                        marks.truncate(depth);
                    }
                    4 => sums.hash(true),
                    _ => {
                        let most = [10, 300, 3 * chunk][rng.below(3) as usize];
                        let len = 1 + rng.below(most) as usize;
                        let data = rng.bytes(len);
                        for span in spans_of(&data, &mut rng) {
                            sums.update(span);
                        }
                        kept.extend_from_slice(&data);
                    }
                }
            }
            let expect: Vec<[u8; 32]> = kept.chunks(chunk as usize).map(|c| Sha256::digest(c).into()).collect();
            assert_eq!(sums.finish(), expect, "seed {seed}, chunk {chunk}");
        }
    }
}
