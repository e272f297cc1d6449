//! The devices of one instance of an image: loop devices for meta.img, device 2 (on the
//! server's device node) and a writable layer, their records in the state files, the
//! btrfs scan of the seed devices, and taking them down again.

use crate::frontend;
use crate::plumbing::{btrfs, loopdev, mount as mnt};
use crate::state::{LoopRecord, ServerRecord};
use crate::store::local::Bundle;
use anyhow::{anyhow, bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::path::Path;
use std::time::{Duration, Instant};

pub fn loop_record(l: &loopdev::LoopDev) -> LoopRecord {
    LoopRecord {
        number: l.number,
        path: l.path.display().to_string(),
        backing: loopdev::backing_file(l.number).unwrap_or_default(),
        direct_io: l.direct_io,
    }
}

pub fn detach_record(r: &LoopRecord) -> Result<()> {
    // give an AUTOCLEAR device a moment to go away by itself after the last close
    let t = Instant::now();
    while loopdev::backing_file(r.number).as_deref() == Some(r.backing.as_str())
        && t.elapsed() < Duration::from_millis(500)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    loopdev::detach_if(r.number, &r.backing)?;
    Ok(())
}

pub fn open_rw_file(path: &Path, size: u64) -> Result<(File, bool)> {
    match OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => Ok((f, false)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
                .with_context(|| format!("--rw {}: create", path.display()))?;
            f.set_len(size)
                .with_context(|| format!("--rw {}: set size {size}", path.display()))?;
            Ok((f, true))
        }
        Err(e) => Err(e).with_context(|| format!("--rw {}: open", path.display())),
    }
}

pub fn all_zero_head(f: &File) -> Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let n = f.read_at(&mut buf, 0)?;
    Ok(buf[..n].iter().all(|&b| b == 0))
}

pub const RO_OPTS: loopdev::AttachOptions = loopdev::AttachOptions {
    read_only: true,
    direct_io: true,
    block_size: 4096,
    autoclear: true,
};

/// A new device-2 instance: a read-only loop device on the server's device node (the
/// FUSE file, buffered or direct I/O as the server's `--dev2-cache` says, see
/// frontend::fuse; or /dev/ublkbN with direct I/O, that node has its own page cache).
/// Each mounted filesystem needs its own block device; all instances are served by the
/// bundle's one server. `name` goes into lo_file_name (the state dir: tells whose
/// instance it is).
pub fn attach_dev2_instance(srv: &ServerRecord, name: &Path) -> Result<loopdev::LoopDev> {
    let (f, direct_io) = match srv.ublk_id {
        Some(_) => (
            File::open(&srv.device).with_context(|| format!("open the server's device {}", srv.device))?,
            true,
        ),
        None => {
            let cache = srv.fuse_dev2_cache();
            (
                frontend::fuse::open_for_loop(&srv.device, cache)?,
                cache.loop_direct_io(),
            )
        }
    };
    let opts = loopdev::AttachOptions { direct_io, ..RO_OPTS };
    let l = loopdev::attach(&f, name, &opts)?;
    if opts.direct_io && !l.direct_io {
        eprintln!(
            "ublkd: warning: {} on {} runs without direct I/O",
            l.path.display(),
            srv.device
        );
    }
    Ok(l)
}

/// meta.img's loop devices read through the page cache: the pages `mount` just hashed
/// (or asked to be read ahead) serve the kernel's metadata reads, and all mounts of the
/// image share one copy.
pub const META_OPTS: loopdev::AttachOptions = loopdev::AttachOptions {
    direct_io: false,
    ..RO_OPTS
};

/// meta.img on a loop device: the very file `mount` checked against the manifest.
/// Attaching costs an fsync of the backing file (the loop driver does one on every
/// LOOP_CONFIGURE: a disk cache flush on ext4), so it runs in a thread while the server
/// starts; [`MetaLoop::get`] waits for it. An unused or failed attach goes away with
/// its fd (AUTOCLEAR).
pub struct MetaLoop(std::thread::JoinHandle<Result<loopdev::LoopDev>>);

impl MetaLoop {
    pub fn start(bundle: &Bundle) -> Result<MetaLoop> {
        let meta = bundle
            .meta
            .as_ref()
            .context("meta.img was not checked")?
            .try_clone()
            .context("meta.img: dup")?;
        let path = bundle.meta_path();
        Ok(MetaLoop(std::thread::spawn(move || {
            loopdev::attach(&meta, &path, &META_OPTS)
        })))
    }

    pub fn get(self) -> Result<loopdev::LoopDev> {
        self.0.join().map_err(|_| anyhow!("attaching meta.img panicked"))?
    }

    /// The loop device `started` attaches, or (none started) one attached now.
    pub fn get_or_attach(started: Option<MetaLoop>, bundle: &Bundle) -> Result<loopdev::LoopDev> {
        started.map_or_else(|| MetaLoop::start(bundle), Ok)?.get()
    }
}

/// `btrfs device scan` for a new instance of the image's seed devices.
pub fn scan_seed(devs: &[&Path], bundle: &Bundle) -> Result<()> {
    for d in devs {
        btrfs::scan(d).map_err(|e| {
            if e.root_cause()
                .downcast_ref::<std::io::Error>()
                .and_then(|e| e.raw_os_error())
                == Some(libc::EEXIST)
            {
                e.context(format!(
                    "image {} (fsid {}) has an unsprouted mount elsewhere (not made by ublkd?); the kernel allows \
                     one unsprouted mount per image at a time",
                    bundle.image_id, bundle.manifest.fsid
                ))
            } else {
                e
            }
        })?;
    }
    Ok(())
}

pub fn umount_busy_msg(path: &str, lazy: bool) -> Result<()> {
    match mnt::umount(Path::new(path), lazy) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EBUSY) => bail!("umount {path}: target is busy (close files under it, or use --lazy)"),
        Err(e) => Err(e).with_context(|| format!("umount {path}")),
    }
}

pub fn forget_and_detach(loops: &[&Option<LoopRecord>]) -> Result<()> {
    for r in loops.iter().copied().flatten() {
        let _ = btrfs::forget(Path::new(&r.path));
    }
    for r in loops.iter().copied().flatten() {
        detach_record(r).with_context(|| format!("detach {}", r.path))?;
    }
    Ok(())
}
