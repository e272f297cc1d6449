//! O_DIRECT writes of pack 0's content in a layer's native read: streamed content (members
//! larger than `pack::MEM_MAX`) and all content of an uncompressed layer the page cache
//! holds (whose dedup compares read the layer's file, not the pack: `PackCore::put`). The
//! bytes are copied into page-aligned blocks and each full block is written from there by a
//! thread of its own, with `O_DIRECT` on a second open of the pack. A buffered write's kernel side
//! (page-cache folios allocated and copied into, ext4's delayed allocation, the write-back
//! later) cost the synthetic set's build more CPU than the copy into a block that is reused
//! while it is still in the CPU's caches (bench/results/issue23-log.md, "Pack writes
//! without the page cache"; for small members, "Small content without the page cache").
//!
//! Only full aligned blocks go this way; the staged block's partial end is written through
//! the buffered fd when something reads the pack, at a streamed member's end and at the
//! layer's (`PackCore::unstage`). Where the filesystem refuses `O_DIRECT` (the open fails,
//! or the first write is refused with EINVAL) every block is written through the buffered
//! fd instead.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// file offsets and buffers of O_DIRECT writes are multiples of this (4 KiB: every logical
/// block size a Linux filesystem uses for the page cache's own I/O)
pub const ALIGN: u64 = 4096;
/// one write: each waits for the disk before the writer thread issues the next, so larger
/// writes keep it busier while the input is read from it too (the synthetic set cold,
/// against the buffered path: 1 MiB slower in most pairs, 2 MiB even, 4 MiB faster; but
/// since the read's blocks are freed before the writer the staging adds to the build's
/// peak RSS: 4 MiB x 3 took it to 1,030 B per entry, 2 MiB x 3 to 966; bench/results/issue23-log.md)
pub const BLOCK: usize = 2 << 20;
/// blocks queued for the writer thread besides the one being filled: with `BLOCK` this
/// bounds the staging memory (6 MiB), freed when a layer's read ends (1 queued: blocks
/// spilled to the page cache so often that cold builds lost 11-40 %). A block that finds the
/// queue full is written through the buffered fd instead (`PackCore::stage`): the parser
/// never waits for the disk, whose write-back of those pages comes later, as before (a cold
/// build reads the input from the same disk: waiting there made it slower)
const DEPTH: usize = 2;
/// how long a full block waits for the writer before it goes through the buffered fd: a
/// 2 MiB buffered write's fresh page-cache pages cost this VM 1-8 ms of CPU
const ROOM_WAIT: std::time::Duration = std::time::Duration::from_millis(4);

/// `BLOCK` bytes of anonymous memory, page-aligned (mmap: given back to the kernel when
/// dropped, so the staging never stays in the heap the build's later peak RSS counts).
pub struct Aligned {
    ptr: NonNull<u8>,
}

// SAFETY: the mapping is owned by this value alone
unsafe impl Send for Aligned {}

impl Aligned {
    fn new() -> io::Result<Aligned> {
        // SAFETY: a fresh private anonymous mapping
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BLOCK,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast())
            .map(|ptr| Aligned { ptr })
            .ok_or_else(io::Error::last_os_error)
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: BLOCK bytes mapped for as long as self lives
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), BLOCK) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as bytes, and &mut self is the only reference
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), BLOCK) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new, unmapped once
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), BLOCK) };
    }
}

/// `src` copied to `dst` (as long) with non-temporal stores where the CPU has them: the
/// staged bytes are next read by the disk's DMA, not the CPU, so filling the caches with
/// them (and reading each destination line in first) only cost time: the synthetic set's
/// copy took 0.47 s of CPU with `copy_from_slice` (4.3 GB/s), evicting what the hashers read.
/// `fence` must follow before another thread or the device reads `dst`.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // up to the first 16-byte aligned destination byte, and the rest after the last
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let body = (dst.len() - head) & !15;
        dst[..head].copy_from_slice(&src[..head]);
        let mut i = head;
        while i < head + body {
            // SAFETY: SSE2 is part of x86_64; i..i+16 lies in both slices, dst + i is
            // 16-byte aligned (head), the load is unaligned
            unsafe {
                let v = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                _mm_stream_si128(dst.as_mut_ptr().add(i).cast::<__m128i>(), v);
            }
            i += 16;
        }
        dst[i..].copy_from_slice(&src[i..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// The non-temporal stores of `copy_streaming` made visible before what follows.
pub fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// A block written (back for reuse) and the write's error.
type Done = (Aligned, Option<io::Error>);

/// The O_DIRECT writer of one pack: blocks in, written blocks back.
pub struct Direct {
    tx: Option<SyncSender<(u64, Aligned)>>,
    back: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    refused: Arc<AtomicBool>,
    in_flight: usize,
    /// `DEPTH` (tests: 0, every full block through the page cache)
    pub depth: usize,
    spare: Vec<Aligned>,
    /// the first error of a write taken back by `has_room` (reported by `drain`)
    failed: Option<io::Error>,
    /// bytes queued for writing (`BUI_NATIVE_TIMES`, tests)
    pub queued: u64,
    /// time `has_room` waited for the writer (`BUI_NATIVE_TIMES`)
    pub room_wait: std::time::Duration,
}

impl Direct {
    /// A second open of `file` with O_DIRECT; None where the filesystem refuses it (or
    /// /proc is not there to reopen the file by).
    pub fn open(file: &Arc<File>) -> Option<Direct> {
        let path = format!("/proc/self/fd/{}", file.as_raw_fd());
        let dio = File::options()
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(path)
            .ok()?;
        Some(Direct::start(dio, Arc::clone(file), None))
    }

    /// The writer thread: `dio` takes the blocks until it refuses one with EINVAL, then
    /// `buffered` takes them all (`refuse`: the error every O_DIRECT write gets, in tests).
    fn start(dio: File, buffered: Arc<File>, refuse: Option<i32>) -> Direct {
        let (tx, rx) = sync_channel::<(u64, Aligned)>(DEPTH);
        let (back_tx, back) = channel::<Done>();
        let refused = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&refused);
        let thread = std::thread::Builder::new()
            .name("pack-direct".into())
            .spawn(move || {
                for (offset, block) in rx {
                    let mut r = Err(io::Error::from_raw_os_error(libc::EINVAL));
                    if !flag.load(Ordering::Relaxed) {
                        r = match refuse {
                            Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                            // a short write's rest is misaligned: EINVAL, then buffered
                            None => dio.write_all_at(block.bytes(), offset),
                        };
                        if matches!(&r, Err(e) if e.raw_os_error() == Some(libc::EINVAL)) {
                            flag.store(true, Ordering::Relaxed);
                        }
                    }
                    if flag.load(Ordering::Relaxed) {
                        r = buffered.write_all_at(block.bytes(), offset);
                    }
                    if back_tx.send((block, r.err())).is_err() {
                        return;
                    }
                }
            })
            .expect("spawn pack-direct");
        Direct {
            tx: Some(tx),
            back,
            thread: Some(thread),
            refused,
            in_flight: 0,
            depth: DEPTH,
            spare: Vec::new(),
            failed: None,
            queued: 0,
            room_wait: std::time::Duration::ZERO,
        }
    }

    /// The filesystem refused O_DIRECT: blocks are written through the buffered fd.
    pub fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// A block to fill: a spare one or a new one (at most `DEPTH` + 1 are ever made: one is
    /// filled while the others are queued).
    pub fn block(&mut self) -> io::Result<Aligned> {
        match self.spare.pop() {
            Some(b) => Ok(b),
            None => Aligned::new(),
        }
    }

    fn take_back(&mut self) -> io::Result<()> {
        let (block, err) = self
            .back
            .recv()
            .map_err(|_| io::Error::other("the pack's direct writer thread failed"))?;
        self.in_flight -= 1;
        self.spare.push(block);
        err.map_or(Ok(()), Err)
    }

    /// Has the writer room for another block? (The blocks it is done with taken back; with
    /// none, the first waited for up to `ROOM_WAIT`.)
    pub fn has_room(&mut self) -> bool {
        let mut wait = Some(ROOM_WAIT).filter(|_| self.depth > 0);
        loop {
            let got = match self.back.try_recv() {
                Ok(done) => Some(done),
                Err(_) if self.in_flight >= self.depth => wait.take().and_then(|w| {
                    let t = std::time::Instant::now();
                    let done = self.back.recv_timeout(w).ok();
                    self.room_wait += t.elapsed();
                    done
                }),
                Err(_) => None,
            };
            let Some((block, err)) = got else {
                return self.in_flight < self.depth;
            };
            self.in_flight -= 1;
            self.spare.push(block);
            if self.failed.is_none() {
                self.failed = err;
            }
        }
    }

    /// Queue the full `block` for writing at `offset` (a multiple of `ALIGN`; `has_room`).
    pub fn submit(&mut self, offset: u64, block: Aligned) -> io::Result<()> {
        debug_assert_eq!(offset % ALIGN, 0);
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| io::Error::other("the pack's direct writer is stopped"))?;
        tx.send((offset, block))
            .map_err(|_| io::Error::other("the pack's direct writer thread failed"))?;
        self.in_flight += 1;
        self.queued += BLOCK as u64;
        Ok(())
    }

    /// Every queued block written: the first error among them.
    pub fn drain(&mut self) -> io::Result<()> {
        let mut first = self.failed.take().map_or(Ok(()), Err);
        while self.in_flight > 0 {
            let r = self.take_back();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    pub fn recycle(&mut self, block: Aligned) {
        self.spare.push(block);
    }

    /// The spare blocks unmapped (a layer's read is over).
    pub fn release_memory(&mut self) {
        self.spare.clear();
    }

    pub fn stop(&mut self) {
        self.tx = None;
        while self.in_flight > 0 && self.take_back().is_ok() {}
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.spare.clear();
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
impl Direct {
    /// A writer whose O_DIRECT writes are refused with EINVAL, as some filesystems do at
    /// the first write rather than at the open (the refusal injected: this machine's
    /// filesystems either take O_DIRECT writes or refuse the open).
    pub fn refusing(file: &Arc<File>) -> Direct {
        let path = format!("/proc/self/fd/{}", file.as_raw_fd());
        let dio = File::options().write(true).open(path).expect("reopen");
        Direct::start(dio, Arc::clone(file), Some(libc::EINVAL))
    }
}
