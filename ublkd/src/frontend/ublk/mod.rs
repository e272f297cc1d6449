//! ublk frontend: device 2 as /dev/ublkbN through libublk, one io handler per queue
//! calling [`Device2::read`]; a read that would wait for a fetch (a remote chunk not in
//! memory) goes to the device's miss workers and is completed when they are done
//! ([`Deferred`]), so hits and other misses are not held up behind it. The device is
//! created with UBLK_F_USER_RECOVERY and UBLK_F_USER_RECOVERY_REISSUE: when the server
//! dies the kernel keeps /dev/ublkbN, queues new I/O and requeues the I/O the dead server
//! had taken, and a new server started with `recover_id` reattaches to it
//! (START/END_USER_RECOVERY) without the filesystem on top noticing.
//!
//! This host's kernel has no ublk_drv; this path runs in the VM harness (tests/vm/).

mod poll;

use crate::args::MAX_UBLK_QUEUES;
use crate::device::Device2;
use crate::types::PollMode;
use anyhow::{anyhow, Context, Result};
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{sys, BufDesc, UblkFlags, UblkIORes};
use poll::{poll_loop, PollWindow, AUTO_POLL_MAX};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

pub struct Options {
    pub nr_queues: u16,
    pub depth: u16,
    pub io_buf_bytes: u32,
    /// Reattach to this existing (quiesced) device instead of adding a new one.
    pub recover_id: Option<i32>,
    /// What the queue thread does between requests. See [`poll_loop`].
    pub poll: PollMode,
}

impl Options {
    /// The queues and polling of `serve` and `ublk-null`: `queues` (`--ublk-queues`) when
    /// given, else ONE when the thread polls (`auto` or a window) and `threads` with
    /// `off`, at most [`MAX_UBLK_QUEUES`] (the kernel gives at most one per CPU anyway).
    /// Why one polling queue: the kernel pins queue N's thread to the CPUs blk-mq maps to
    /// it, the CPUs of the readers it serves, where a polling thread competes with them
    /// and a reader woken elsewhere finds its queue's thread asleep (measured:
    /// docs/ublkd.md, "Queues"); one queue's thread may run on any CPU.
    pub fn new(threads: usize, poll: PollMode, queues: Option<u16>) -> Options {
        let default = if poll == PollMode::Off {
            threads.min(usize::from(MAX_UBLK_QUEUES)) as u16
        } else {
            1
        };
        Options {
            nr_queues: queues.unwrap_or(default).clamp(1, MAX_UBLK_QUEUES),
            poll,
            ..Default::default()
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            nr_queues: 1,
            depth: 64,
            io_buf_bytes: 512 << 10,
            recover_id: None,
            poll: PollMode::Off,
        }
    }
}

/// What a ublk device serves: device 2's read path, or nothing at all (the null target
/// that measures the transport: `ublkd ublk-null`).
pub trait Reads: Send + Sync + 'static {
    fn size(&self) -> u64;
    /// Fill `buf` with the bytes at `off`: `buf.len()` or a negative errno.
    fn read(&self, off: u64, buf: &mut [u8]) -> i32;
    fn reject_write(&self) {}
    /// Whether this read would wait for a fetch (then it is handed to [`Reads::defer`]).
    fn would_wait(&self, _off: u64, _len: usize) -> bool {
        false
    }
    /// Run a read that would wait elsewhere; the queue thread goes on meanwhile.
    fn defer(&self, job: Box<dyn FnOnce() + Send>) {
        job()
    }
}

impl Reads for Device2 {
    fn size(&self) -> u64 {
        Device2::size(self)
    }

    fn read(&self, off: u64, buf: &mut [u8]) -> i32 {
        match Device2::read(self, off, buf) {
            Ok(()) => buf.len() as i32,
            Err(_) => -libc::EIO,
        }
    }

    fn reject_write(&self) {
        Device2::reject_write(self)
    }

    fn would_wait(&self, off: u64, len: usize) -> bool {
        Device2::would_wait(self, off, len)
    }

    fn defer(&self, job: Box<dyn FnOnce() + Send>) {
        Device2::defer(self, job)
    }
}

/// Reads a queue handed to miss workers come back through here: a worker records (tag,
/// result) and bumps the eventfd; the queue thread, which keeps an io_uring read of the
/// eventfd posted (a target I/O, tag [`EVENTFD_TAG`]), completes them when it fires.
/// This is libublk's advice for I/O finished in another context.
struct Deferred {
    efd: std::os::fd::OwnedFd,
    done: std::sync::Mutex<Vec<(u16, i32)>>,
}

/// The target-I/O tag of the eventfd read (real tags are below the queue depth).
const EVENTFD_TAG: u16 = u16::MAX;

impl Deferred {
    fn new() -> std::io::Result<Deferred> {
        // SAFETY: eventfd returns a new fd or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let efd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Deferred {
            efd,
            done: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// From a worker: the read of `tag` finished with `res`.
    fn finish(&self, tag: u16, res: i32) {
        self.done.lock().unwrap().push((tag, res));
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our eventfd; it cannot block (the count never nears
        // its maximum: the queue thread drains it).
        unsafe { libc::write(std::os::fd::AsRawFd::as_raw_fd(&self.efd), one.as_ptr().cast(), 8) };
    }

    /// Post the io_uring read of the eventfd into `counter` (8 bytes that live as long
    /// as the queue).
    fn arm(&self, counter: *mut u8) {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.efd);
        let sqe = io_uring::opcode::Read::new(io_uring::types::Fd(fd), counter, 8)
            .build()
            .user_data(UblkIOCtx::build_user_data(EVENTFD_TAG, 0, 0, true));
        // The submission queue is as deep as the queue has tags, so it is full right after
        // the fetch commands are queued (or a batch of commits): submit those, then push.
        // SAFETY: the fd and the counter outlive the read (both live as long as the queue).
        let pushed = libublk::io::with_task_io_ring_mut(|r| {
            unsafe { r.submission().push(&sqe) }.is_ok()
                || (r.submit().is_ok() && unsafe { r.submission().push(&sqe) }.is_ok())
        });
        if !pushed {
            log::error!("ublk queue: cannot post the eventfd read: deferred reads never complete");
        }
    }

    fn take(&self) -> Vec<(u16, i32)> {
        std::mem::take(&mut *self.done.lock().unwrap())
    }
}

/// Completes every read at once without touching the buffer: the ceiling of the ublk
/// transport (the kernel still copies the buffer into the request's pages).
pub struct Null(pub u64);

impl Reads for Null {
    fn size(&self) -> u64 {
        self.0
    }

    fn read(&self, _off: u64, buf: &mut [u8]) -> i32 {
        buf.len() as i32
    }
}

/// (offset, length) of `tag`'s request when it is a read that would wait for a fetch.
fn read_that_would_wait<R: Reads>(dev: &R, q: &UblkQueue, tag: u16, buf_len: usize) -> Option<(u64, usize)> {
    let iod = q.get_iod(tag);
    let (off, len) = (iod.start_sector << 9, (iod.nr_sectors as usize) << 9);
    (iod.op_flags & 0xff == sys::UBLK_IO_OP_READ && len <= buf_len && dev.would_wait(off, len)).then_some((off, len))
}

fn handle<R: Reads>(dev: &R, q: &UblkQueue, tag: u16, buf: &mut [u8]) -> i32 {
    let iod = q.get_iod(tag);
    let op = iod.op_flags & 0xff;
    let off = iod.start_sector << 9;
    let len = (iod.nr_sectors as usize) << 9;
    match op {
        sys::UBLK_IO_OP_READ => {
            if len > buf.len() {
                return -libc::EINVAL;
            }
            dev.read(off, &mut buf[..len])
        }
        sys::UBLK_IO_OP_FLUSH => 0,
        _ => {
            dev.reject_write();
            -libc::EROFS
        }
    }
}

fn queue_fn<R: Reads>(qid: u16, udev: &UblkDev, dev: Arc<R>, poll: PollMode) {
    if poll != PollMode::Off {
        // the spin checks IORING_SQ_TASKRUN in memory instead of entering the kernel
        let ring = libublk::ublk_init_task_ring(|cell| {
            if cell.get().is_none() {
                let r = io_uring::IoUring::builder()
                    .setup_cqsize(udev.tgt.cq_depth.into())
                    .setup_coop_taskrun()
                    .setup_taskrun_flag()
                    .build(udev.tgt.sq_depth.into())
                    .map_err(libublk::UblkError::IOError)?;
                let _ = cell.set(std::cell::RefCell::new(r));
            }
            Ok(())
        });
        if let Err(e) = ring {
            log::error!("ublk queue {qid}: io_uring setup failed: {e}");
            return;
        }
    }
    let bufs = Rc::new(udev.alloc_queue_io_bufs());
    let bufs2 = bufs.clone();
    let deferred = match Deferred::new() {
        Ok(d) => Arc::new(d),
        Err(e) => {
            log::error!("ublk queue {qid}: eventfd: {e}");
            return;
        }
    };
    // the eventfd read's target: leaked (8 bytes per queue), so that a read still posted
    // when the ring is torn down never writes to freed memory
    let counter_ptr = (Box::leak(Box::new(0u64)) as *mut u64).cast::<u8>();
    let d2 = deferred.clone();
    let complete = move |q: &UblkQueue, tag: u16, res: i32| {
        let b = &bufs2[tag as usize];
        if let Err(e) = q.complete_io_cmd_unified(tag, BufDesc::Slice(b.as_slice()), Ok(UblkIORes::Result(res))) {
            log::error!("ublk queue {qid}: complete tag {tag}: {e}");
        }
    };
    let bufs3 = bufs.clone();
    let handler = move |q: &UblkQueue, tag: u16| {
        if tag == EVENTFD_TAG {
            // reads finished by miss workers
            for (t, res) in d2.take() {
                complete(q, t, res);
            }
            d2.arm(counter_ptr);
            return;
        }
        let b = &bufs3[tag as usize];
        // SAFETY: each tag's buffer is used by exactly one in-flight command: by this
        // queue thread, or by the one miss worker its read was handed to, until the
        // command is completed; the kernel reads it after that.
        let slice = unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr(), b.len()) };
        if let Some((off, len)) = read_that_would_wait(&*dev, q, tag, slice.len()) {
            let (dev, done, ptr) = (dev.clone(), d2.clone(), slice.as_mut_ptr() as usize);
            dev.clone().defer(Box::new(move || {
                // SAFETY: see above: this worker owns the tag's buffer until completion.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
                done.finish(tag, dev.read(off, buf));
            }));
            return;
        }
        let res = handle(&*dev, q, tag, slice);
        complete(q, tag, res);
    };
    let queue = match UblkQueue::new(qid, udev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
    {
        Ok(q) => q,
        Err(e) => {
            log::error!("ublk queue {qid}: setup failed: {e}");
            return;
        }
    };
    deferred.arm(counter_ptr);
    match poll {
        PollMode::Off => queue.wait_and_handle_io(move |q, tag, _io| handler(q, tag)),
        PollMode::Fixed(us) => {
            let us = Duration::from_micros(us);
            poll_loop(&queue, handler, || us, |_| {})
        }
        PollMode::Auto => {
            let w = std::cell::RefCell::new(PollWindow::new(AUTO_POLL_MAX));
            poll_loop(
                &queue,
                handler,
                || w.borrow().window(),
                |gap| w.borrow_mut().arrived(gap),
            )
        }
    }
}

/// With one hw queue the kernel gives the device mq-deadline (with several: none); its
/// reads are 4 KiB-aligned random reads a scheduler only adds a lock and a queue to, and
/// the loop devices it is compared with run without one (loop opts out of the default).
fn no_scheduler(bdev: &str) {
    let name = bdev.rsplit('/').next().unwrap_or(bdev);
    let f = format!("/sys/block/{name}/queue/scheduler");
    if let Err(e) = std::fs::write(&f, "none") {
        log::warn!("{f}: set none: {e}");
    }
}

/// Prepare a quiesced device for a new server (START_USER_RECOVERY).
pub fn begin_recovery(id: i32) -> Result<()> {
    let ctrl = UblkCtrl::new_simple(id).map_err(|e| anyhow!("ublk device {id}: {e}"))?;
    let info = ctrl.dev_info();
    if info.flags & sys::UBLK_F_USER_RECOVERY as u64 == 0 {
        return Err(anyhow!("ublk device {id} was not created with UBLK_F_USER_RECOVERY"));
    }
    ctrl.start_user_recover()
        .map_err(|e| anyhow!("ublk device {id}: START_USER_RECOVERY: {e}"))?;
    Ok(())
}

/// Delete a ublk device. Pending and later I/O fails. `in_use`: the device may still
/// be open (a mounted filesystem after its server died): use DEL_DEV_ASYNC, since the
/// plain DEL_DEV waits until every opener has closed it, which would deadlock an
/// umount that runs after it.
pub fn delete(id: i32, in_use: bool) -> Result<()> {
    let ctrl = UblkCtrl::new_simple(id).map_err(|e| anyhow!("ublk device {id}: {e}"))?;
    let res = if in_use { ctrl.del_dev_async() } else { ctrl.del_dev() };
    res.map_err(|e| anyhow!("ublk device {id}: delete: {e}"))?;
    Ok(())
}

/// Run the device until it is killed (`stop` flips, see [`Stopper`]). `ready` is called
/// once /dev/ublkbN is live, with its path, id and hw queues (as the kernel made them: a
/// recovered device keeps its own).
pub fn run<R: Reads>(
    dev: Arc<R>,
    opts: Options,
    ready: impl FnOnce(String, i32, u16) + Send + Sync + 'static,
    stopper: Stopper,
) -> Result<()> {
    let recovering = opts.recover_id.is_some();
    let ctrl = UblkCtrlBuilder::default()
        .name("ublkd")
        .id(opts.recover_id.unwrap_or(-1))
        .nr_queues(opts.nr_queues)
        .depth(opts.depth)
        .io_buf_bytes(opts.io_buf_bytes)
        // REISSUE: reads the dead server had taken are requeued for the next one (without
        // it they fail with EIO); device-2 reads are idempotent
        .ctrl_flags((sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE) as u64)
        .dev_flags(if recovering {
            UblkFlags::UBLK_DEV_F_RECOVER_DEV
        } else {
            UblkFlags::UBLK_DEV_F_ADD_DEV
        })
        .build()
        .map_err(|e| anyhow!("create ublk device: {e}"))?;
    let ctrl = Arc::new(ctrl);
    *stopper.0.lock().unwrap() = Some(ctrl.clone());
    let size = dev.size();
    let tgt_init = move |udev: &mut UblkDev| {
        udev.set_default_params(size);
        let p = &mut udev.tgt.params;
        p.basic.attrs = sys::UBLK_ATTR_READ_ONLY;
        p.basic.logical_bs_shift = 12;
        Ok(())
    };
    let d = dev.clone();
    let poll = opts.poll;
    let q_handler = move |qid, udev: &_| queue_fn(qid, udev, d.clone(), poll);
    let on_live = move |c: &UblkCtrl| {
        let info = c.dev_info();
        let (path, id, queues) = (c.get_bdev_path(), info.dev_id as i32, info.nr_hw_queues);
        if queues == 1 {
            no_scheduler(&path);
        }
        ready(path, id, queues)
    };
    ctrl.run_target(tgt_init, q_handler, on_live)
        .map_err(|e| anyhow!("ublk device: {e}"))
        .context("run ublk target")?;
    Ok(())
}

/// Does someone hold `bdev` exclusively (a mounted filesystem)? A best-effort probe
/// for the log: an exclusive open fails with EBUSY then.
pub fn claimed(bdev: &str) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let r = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(bdev);
    matches!(r, Err(e) if e.raw_os_error() == Some(libc::EBUSY))
}

/// Lets the signal thread kill the device so the queue threads return.
#[derive(Clone, Default)]
pub struct Stopper(Arc<std::sync::Mutex<Option<Arc<UblkCtrl>>>>);

impl Stopper {
    /// Run `f` on the device's control handle from this thread. libublk's control ring
    /// is per thread and only set up by a UblkCtrl constructor: a thread other than the
    /// one that built the device (the signal or main thread) opens its own handle first.
    fn with_ctrl(&self, f: impl FnOnce(&UblkCtrl)) {
        if let Some(c) = self.0.lock().unwrap().as_ref() {
            let _ = UblkCtrl::new_simple(c.dev_info().dev_id as i32);
            f(c);
        }
    }

    /// Stop serving and delete the device (a clean shutdown).
    pub fn stop(&self) {
        self.with_ctrl(|c| {
            let _ = c.kill_dev();
        });
    }

    /// Delete the (stopped) device without waiting for its openers: the plain DEL_DEV
    /// waits until the last one closes it, which for a filesystem still mounted on it
    /// is its umount, so a server SIGTERMed under a mount would never exit. The kernel
    /// frees the device when the last opener is gone; until then reads fail (EIO).
    pub fn delete(&self) {
        self.with_ctrl(|c| {
            let _ = c.del_dev_async();
        });
    }
}

/// `ublkd ublk-null`: serve a null device of `size` bytes with the same queue setup as
/// device 2 until SIGTERM/SIGINT, then delete it. Prints the device path once it is live.
/// The benchmark's transport ceiling (docs/benchmarks.md); not for production use.
pub fn serve_null(size: u64, opts: Options) -> Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().context("block signals")?;
    let stopper = Stopper::default();
    let st = stopper.clone();
    let worker = std::thread::spawn(move || {
        let ready = |path: String, _id: i32, _queues: u16| {
            use std::io::Write as _;
            let mut out = std::io::stdout();
            let _ = writeln!(out, "{path}");
            let _ = out.flush();
        };
        run(Arc::new(Null(size)), opts, ready, st)
    });
    let _ = set.wait();
    stopper.stop();
    let res = worker.join().map_err(|_| anyhow!("ublk null target thread panicked"))?;
    stopper.delete();
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_uses_one_queue_unless_asked_and_off_keeps_threads() {
        let q = |threads, poll, asked| {
            let o = Options::new(threads, poll, asked);
            assert_eq!(o.poll, poll);
            assert_eq!(o.depth, Options::default().depth);
            o.nr_queues
        };
        // off: --threads queues, at most 4
        assert_eq!(q(4, PollMode::Off, None), 4);
        assert_eq!(q(9, PollMode::Off, None), 4);
        assert_eq!(q(0, PollMode::Off, None), 1);
        // polling: one queue
        assert_eq!(q(4, PollMode::Auto, None), 1);
        assert_eq!(q(4, PollMode::Fixed(250), None), 1);
        // --ublk-queues wins in every mode
        assert_eq!(q(4, PollMode::Auto, Some(2)), 2);
        assert_eq!(q(4, PollMode::Off, Some(1)), 1);
        assert_eq!(q(1, PollMode::Fixed(250), Some(3)), 3);
        let o = Options {
            recover_id: Some(3),
            ..Options::new(4, PollMode::Auto, None)
        };
        assert_eq!((o.nr_queues, o.recover_id), (1, Some(3)));
    }

    #[test]
    fn poll_mode_round_trips_as_text() {
        for m in [PollMode::Off, PollMode::Auto, PollMode::Fixed(2000)] {
            assert_eq!(m.to_string().parse::<PollMode>(), Ok(m));
            let j = serde_json::to_string(&m).unwrap();
            assert_eq!(serde_json::from_str::<PollMode>(&j).unwrap(), m);
        }
        assert_eq!(serde_json::to_string(&PollMode::Fixed(7)).unwrap(), "\"7\"");
        assert!("-1".parse::<PollMode>().is_err());
        assert!(serde_json::from_str::<PollMode>("\"fast\"").is_err());
    }
}
