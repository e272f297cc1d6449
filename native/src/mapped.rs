//! A tarball read through windows of a shared mapping (`Source`, `Window`) instead of
//! `pread` into buffers: the reader, the prehash, the parser and the pack's chunk hasher
//! read the page cache in place (the synthetic set's `pread` copied 2.8 GB, ~0.5 s of CPU).
//!
//! A file truncated under a mapping turns the next access of a page past its new end into
//! SIGBUS. A handler installed once (and again whenever a read finds another handler in its
//! place, as Python's `faulthandler.enable()` puts its own) looks the faulting address up in
//! a fixed table of live windows: inside one, it maps zeros from that page to the window's
//! end (the access is retried and reads zeros) and flags the window's source as failed;
//! the read reports it (`Source::failed`) once every window of it is gone. Any other fault,
//! and a SIGBUS sent by `kill`, goes to the handler that was there before (or the default
//! action). The handler only loads and stores atomics and makes one `mmap` system call.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};

/// Live windows at most (a window more is read with `pread`): the reader maps one at a
/// time, and the spans of a few are held downstream (~5 MiB by the pack's chunk hasher).
const SLOTS: usize = 256;

/// One live window: [start, start + len) and its source's failed flag. `seq` is odd while
/// the slot changes: the handler only believes what it read between two equal even values.
struct Slot {
    seq: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    failed: AtomicPtr<AtomicBool>,
}

#[allow(clippy::declare_interior_mutable_const)] // the array's initialiser, copied per slot
const FREE: Slot = Slot {
    seq: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    failed: AtomicPtr::new(std::ptr::null_mut()),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
/// held while a slot is taken or freed
static CLAIM: Mutex<()> = Mutex::new(());

/// The handler found in place when ours was installed: two copies, the live one's index in
/// `PREV_AT` (the other is written while a reinstall happens).
static mut PREV: [std::mem::MaybeUninit<libc::sigaction>; 2] =
    [std::mem::MaybeUninit::zeroed(), std::mem::MaybeUninit::zeroed()];
static PREV_AT: AtomicUsize = AtomicUsize::new(usize::MAX); // MAX: none yet
static INSTALL: Mutex<()> = Mutex::new(());

/// the page size, read before the handler is installed (sysconf is not async-signal safe)
static PAGE: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn page_size() -> usize {
    match PAGE.load(SeqCst) {
        0 => {
            // SAFETY: a plain libc call
            let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) as usize;
            PAGE.store(page, SeqCst);
            page
        }
        page => page,
    }
}

/// Our handler is the one installed for SIGBUS (installing it, the current one chained).
fn ensure_handler() -> io::Result<()> {
    let _held = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    // the page size known before the handler may need it
    page_size();
    // SAFETY: sigaction with a null new action only reads the current one into `cur`
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut cur) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if cur.sa_sigaction == on_sigbus as *const () as usize {
        return Ok(());
    }
    let next = match PREV_AT.load(SeqCst) {
        0 => 1,
        _ => 0,
    };
    // SAFETY: the slot not in use by the handler (PREV_AT names the other), written under
    // INSTALL before it is published
    unsafe { (*std::ptr::addr_of_mut!(PREV))[next].write(cur) };
    PREV_AT.store(next, SeqCst);
    // SAFETY: a handler that is async-signal safe (atomics and one mmap); the mask blocks
    // nothing more than SIGBUS itself while it runs
    let mut ours: libc::sigaction = unsafe { std::mem::zeroed() };
    ours.sa_sigaction = on_sigbus as *const () as usize;
    ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
    unsafe { libc::sigemptyset(&mut ours.sa_mask) };
    if unsafe { libc::sigaction(libc::SIGBUS, &ours, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel's siginfo for this signal
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // si_code > 0: raised by the kernel for an access (not kill, tgkill or sigqueue)
    if code > 0 && mend(addr) {
        return; // the access is retried, on zeros
    }
    chain(sig, info, ctx);
}

/// A fault at `addr` inside a live window: zeros mapped from its page to the window's end,
/// the source flagged. False when no live window holds `addr`.
fn mend(addr: usize) -> bool {
    for slot in TABLE.iter() {
        let seq = slot.seq.load(SeqCst);
        if seq & 1 == 1 {
            continue; // changing: not the faulting thread's window, which it holds
        }
        let start = slot.start.load(SeqCst);
        let len = slot.len.load(SeqCst);
        let failed = slot.failed.load(SeqCst);
        if slot.seq.load(SeqCst) != seq || len == 0 || addr < start || addr >= start + len {
            continue;
        }
        let page = addr & !(page_size() - 1);
        // SAFETY: errno saved and restored around the call; the range is the window's,
        // which the faulting thread holds (it cannot be unmapped meanwhile)
        unsafe {
            let errno = *libc::__errno_location();
            let p = libc::mmap(
                page as *mut libc::c_void,
                start + len - page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            );
            *libc::__errno_location() = errno;
            if p == libc::MAP_FAILED {
                return false;
            }
            if !failed.is_null() {
                (*failed).store(true, SeqCst);
            }
        }
        return true;
    }
    false
}

/// The signal to the handler that was installed before ours (or its default action): that
/// handler is put back in our place first (the next read installs ours again), so a handler
/// that restores its own predecessor (faulthandler does, and that may be ours) and raises
/// the signal again cannot make a loop of the two.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let at = PREV_AT.swap(usize::MAX, SeqCst);
    // SAFETY: PREV[at] was written before PREV_AT named it; sigaction and raise are
    // async-signal safe; the previous handler is called as it was installed to be called
    unsafe {
        let prev = if at < 2 {
            (*std::ptr::addr_of!(PREV))[at].assume_init()
        } else {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            dfl
        };
        libc::sigaction(sig, &prev, std::ptr::null_mut());
        if (*info).si_code > 0 {
            return; // the access is retried and faults into that handler (or the default)
        }
        // sent (kill, tgkill, sigqueue): delivered to it as it would have been
        match prev.sa_sigaction {
            libc::SIG_IGN => {}
            libc::SIG_DFL => {
                libc::raise(sig); // delivered once we return
            }
            handler if prev.sa_flags & libc::SA_SIGINFO != 0 => {
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(handler);
                f(sig, info, ctx);
            }
            handler => {
                let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
                f(sig);
            }
        }
    }
}

/// A file read through windows (`map`); `failed` once a window's page was gone (the file
/// truncated under it).
pub struct Source {
    fd: RawFd,
    /// the file's size when the read began: windows end there
    pub size: u64,
    failed: AtomicBool,
    live: Mutex<usize>,
    gone: Condvar,
}

impl Source {
    /// The regular file `fd` (the caller's, open for as long as the source) to be read
    /// through windows; None where it cannot be (not a regular file, empty, no handler).
    pub fn new(fd: RawFd) -> Option<Arc<Source>> {
        // SAFETY: fstat fills `st`
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size <= 0 {
            return None;
        }
        ensure_handler().ok()?;
        Some(Arc::new(Source {
            fd,
            size: st.st_size as u64,
            failed: AtomicBool::new(false),
            live: Mutex::new(0),
            gone: Condvar::new(),
        }))
    }

    /// A window of the file's bytes [offset, offset + len) (`offset` page-aligned, the end
    /// at most `size`); None when it cannot be mapped (the caller reads with `pread`).
    pub fn map(self: &Arc<Source>, offset: u64, len: usize) -> Option<Arc<Window>> {
        debug_assert!(offset % page_size() as u64 == 0 && offset + len as u64 <= self.size);
        // SAFETY: a new read-only mapping of the caller's fd
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                self.fd,
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        let Some(slot) = claim(ptr as usize, len, &self.failed) else {
            // SAFETY: the mapping just made, never handed out
            unsafe { libc::munmap(ptr, len) };
            return None;
        };
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Some(Arc::new(Window {
            ptr: ptr.cast(),
            len,
            slot,
            source: Arc::clone(self),
        }))
    }

    /// A page of a window was gone when read (zeros were read in its place).
    pub fn failed(&self) -> bool {
        self.failed.load(SeqCst)
    }

    /// Waits until every window is unmapped (no access can fault any more); then `failed`
    /// is final.
    pub fn wait_unmapped(&self) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        while *live > 0 {
            live = self.gone.wait(live).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A free slot made to describe [start, start + len).
fn claim(start: usize, len: usize, failed: &AtomicBool) -> Option<usize> {
    let _held = CLAIM.lock().unwrap_or_else(|e| e.into_inner());
    let i = TABLE.iter().position(|s| s.len.load(SeqCst) == 0)?;
    set(&TABLE[i], start, len, failed as *const AtomicBool as *mut AtomicBool);
    Some(i)
}

fn unclaim(i: usize) {
    let _held = CLAIM.lock().unwrap_or_else(|e| e.into_inner());
    set(&TABLE[i], 0, 0, std::ptr::null_mut());
}

/// A slot's fields changed while its `seq` is odd (CLAIM held).
fn set(slot: &Slot, start: usize, len: usize, failed: *mut AtomicBool) {
    slot.seq.fetch_add(1, SeqCst);
    slot.start.store(start, SeqCst);
    slot.len.store(len, SeqCst);
    slot.failed.store(failed, SeqCst);
    slot.seq.fetch_add(1, SeqCst);
}

/// Mapped bytes of a `Source`; unmapped when the last reference drops.
pub struct Window {
    ptr: *const u8,
    len: usize,
    slot: usize,
    source: Arc<Source>,
}

// SAFETY: a read-only mapping, unmapped only by its drop
unsafe impl Send for Window {}
unsafe impl Sync for Window {}

impl Window {
    /// The window's bytes [at, at + n).
    pub fn bytes(&self, at: usize, n: usize) -> &[u8] {
        assert!(at + n <= self.len);
        // SAFETY: inside the live mapping; a page truncated away reads as zeros (the
        // handler), so the slice stays valid for the window's life
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), n) }
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        unclaim(self.slot); // before the range may be reused by another mapping
                            // SAFETY: the mapping this window made; nothing refers to it any more
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        let mut live = self.source.live.lock().unwrap_or_else(|e| e.into_inner());
        *live -= 1;
        if *live == 0 {
            self.source.gone.notify_all();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// A file of `len` bytes (`i % 251 + 1`) in the temporary directory (the test removes it).
    pub(crate) fn temp(name: &str, len: usize) -> (std::path::PathBuf, std::fs::File) {
        let (path, mut f) = crate::pack::tests::temp_pack(&format!("mapped-{name}"));
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
        f.write_all(&data).unwrap();
        (path, f)
    }

    /// the tests that fill the table (or count on a free slot) run one at a time
    pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

    #[test]
    fn reads_the_file_in_place() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (path, f) = temp("read", 3 << 20);
        let src = Source::new(f.as_raw_fd()).unwrap();
        assert_eq!(src.size, 3 << 20);
        let w = src.map(1 << 20, 2 << 20).unwrap();
        let b = w.bytes(5, 10);
        assert_eq!(
            b,
            &(0..10)
                .map(|i| ((1 << 20) + 5 + i) % 251 + 1)
                .map(|x| x as u8)
                .collect::<Vec<_>>()[..]
        );
        drop(w);
        src.wait_unmapped();
        assert!(!src.failed());
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_truncated_file_reads_zeros_and_fails_the_source() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (path, f) = temp("trunc", 4 << 20);
        let src = Source::new(f.as_raw_fd()).unwrap();
        let w = src.map(0, 4 << 20).unwrap();
        let before: u64 = w.bytes(0, 4 << 20).iter().map(|&b| b as u64).sum();
        assert!(before > 0 && !src.failed());
        f.set_len((1 << 20) + 100).unwrap(); // pages from 1 MiB + 4 KiB on are gone
                                             // read on another thread, as the parser or the chunk hasher would
        let w2 = Arc::clone(&w);
        let tail = std::thread::spawn(move || w2.bytes(3 << 20, 1 << 20).iter().any(|&b| b != 0))
            .join()
            .unwrap();
        assert!(!tail, "a page past the end read as zeros");
        assert!(src.failed());
        // what is still in the file reads as it is
        assert_eq!(w.bytes(1 << 20, 100)[0], ((1 << 20) % 251 + 1) as u8);
        drop(w);
        src.wait_unmapped();
        assert!(src.failed());
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_full_table_maps_no_more_and_frees_every_slot() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (path, f) = temp("slots", 1 << 16);
        let src = Source::new(f.as_raw_fd()).unwrap();
        let windows: Vec<_> = (0..SLOTS).map_while(|_| src.map(0, 1 << 16)).collect();
        assert_eq!(windows.len(), SLOTS);
        assert!(src.map(0, 1 << 16).is_none(), "a window past the table's slots");
        drop(windows);
        src.wait_unmapped();
        let again: Vec<_> = (0..SLOTS).map_while(|_| src.map(0, 1 << 16)).collect();
        assert_eq!(again.len(), SLOTS);
        drop(again);
        std::fs::remove_file(path).unwrap();
    }
}
