//! Loop devices through /dev/loop-control and the LOOP_* ioctls (linux/loop.h).

use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_CHANGE_FD: libc::c_ulong = 0x4C06;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

pub const LO_FLAGS_READ_ONLY: u32 = 1;
pub const LO_FLAGS_AUTOCLEAR: u32 = 4;
pub const LO_FLAGS_DIRECT_IO: u32 = 16;

#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// An attached loop device. Holding `file` keeps an AUTOCLEAR device alive; dropping it
/// after the filesystem has opened the device hands the lifetime to the kernel.
pub struct LoopDev {
    pub number: u32,
    pub path: PathBuf,
    pub file: File,
    pub direct_io: bool,
}

pub struct AttachOptions {
    pub read_only: bool,
    pub direct_io: bool,
    pub block_size: u32,
    pub autoclear: bool,
}

fn ioctl(fd: &impl AsRawFd, req: libc::c_ulong, arg: libc::c_ulong) -> std::io::Result<i32> {
    // SAFETY: plain ioctl on an fd we own; arg is either an integer or a pointer to a
    // properly sized repr(C) struct that outlives the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Attach `backing` (already open with the right access mode) to a free loop device.
/// `name` is recorded as lo_file_name (informational).
pub fn attach(backing: &File, name: &Path, opts: &AttachOptions) -> Result<LoopDev> {
    super::ensure_module("/dev/loop-control", "loop");
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .context("/dev/loop-control: open (is the loop module available?)")?;
    let mut flags = 0;
    if opts.read_only {
        flags |= LO_FLAGS_READ_ONLY;
    }
    if opts.autoclear {
        flags |= LO_FLAGS_AUTOCLEAR;
    }
    for _attempt in 0..20 {
        let n = ioctl(&ctl, LOOP_CTL_GET_FREE, 0).context("/dev/loop-control: LOOP_CTL_GET_FREE")? as u32;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match OpenOptions::new().read(true).write(!opts.read_only).open(&path) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                // udev-less systems: the node appears a moment after GET_FREE
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("{}: open", path.display())),
        };
        let try_flags = |f: u32| -> std::io::Result<i32> {
            let mut info: LoopInfo64 = unsafe { std::mem::zeroed() };
            info.lo_flags = f;
            let nb = name.as_os_str().as_encoded_bytes();
            let k = nb.len().min(63);
            info.lo_file_name[..k].copy_from_slice(&nb[..k]);
            let cfg = LoopConfig {
                fd: backing.as_raw_fd() as u32,
                block_size: opts.block_size,
                info,
                reserved: [0; 8],
            };
            ioctl(&dev, LOOP_CONFIGURE, &cfg as *const LoopConfig as libc::c_ulong)
        };
        let mut res = try_flags(flags | if opts.direct_io { LO_FLAGS_DIRECT_IO } else { 0 });
        if opts.direct_io && matches!(res.as_ref().map_err(|e| e.raw_os_error()), Err(Some(libc::EINVAL))) {
            log::warn!(
                "{}: direct I/O refused for {}, attaching without it",
                path.display(),
                name.display()
            );
            res = try_flags(flags);
        }
        match res {
            Ok(_) => {
                let direct_io = std::fs::read_to_string(format!("/sys/block/loop{n}/loop/dio"))
                    .map(|s| s.trim() == "1")
                    .unwrap_or(false);
                return Ok(LoopDev {
                    number: n,
                    path,
                    file: dev,
                    direct_io,
                });
            }
            // somebody else took this device between GET_FREE and CONFIGURE: try another
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("{}: LOOP_CONFIGURE with {}", path.display(), name.display()))
            }
        }
    }
    bail!("no free loop device after 20 attempts")
}

/// The backing file the kernel reports for /dev/loopN (None when not attached).
pub fn backing_file(number: u32) -> Option<String> {
    std::fs::read_to_string(format!("/sys/block/loop{number}/loop/backing_file"))
        .ok()
        .map(|s| s.trim_end_matches('\n').to_string())
}

/// Detach /dev/loopN if it is still attached to `expect_backing` (checked first, so
/// a number reused by somebody else is never touched). Returns whether it detached.
pub fn detach_if(number: u32, expect_backing: &str) -> Result<bool> {
    match backing_file(number) {
        Some(b) if b == expect_backing => {}
        _ => return Ok(false),
    }
    let path = format!("/dev/loop{number}");
    let dev = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("{path}: open")),
    };
    match ioctl(&dev, LOOP_CLR_FD, 0) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(false),
        Err(e) => Err(e).with_context(|| format!("{path}: LOOP_CLR_FD")),
    }
}

/// Swap the backing file of a read-only loop device (same size), used to reattach
/// device 2 to a restarted FUSE server without unmounting.
pub fn change_fd(number: u32, backing: &File) -> Result<()> {
    let path = format!("/dev/loop{number}");
    let dev = File::open(&path).with_context(|| format!("{path}: open"))?;
    ioctl(&dev, LOOP_CHANGE_FD, backing.as_raw_fd() as libc::c_ulong)
        .with_context(|| format!("{path}: LOOP_CHANGE_FD"))?;
    Ok(())
}
