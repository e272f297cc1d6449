//! btrfs ioctls: device scan/forget on /dev/btrfs-control, device add, device info.

use anyhow::{Context, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}

#[repr(C)]
pub struct DevInfoArgs {
    pub devid: u64,
    pub uuid: [u8; 16],
    pub bytes_used: u64,
    pub total_bytes: u64,
    pub fsid: [u8; 16],
    unused: [u64; 377],
    pub path: [u8; 1024],
}

const _: () = assert!(std::mem::size_of::<VolArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<DevInfoArgs>() == 4096);

const fn iow(nr: u64, size: usize) -> libc::c_ulong {
    ((1u64 << 30) | ((size as u64) << 16) | (0x94 << 8) | nr) as libc::c_ulong
}
const fn iowr(nr: u64, size: usize) -> libc::c_ulong {
    ((3u64 << 30) | ((size as u64) << 16) | (0x94 << 8) | nr) as libc::c_ulong
}
const BTRFS_IOC_SCAN_DEV: libc::c_ulong = iow(4, 4096);
const BTRFS_IOC_FORGET_DEV: libc::c_ulong = iow(5, 4096);
const BTRFS_IOC_ADD_DEV: libc::c_ulong = iow(10, 4096);
const BTRFS_IOC_DEV_INFO: libc::c_ulong = iowr(30, 4096);

fn vol_args(dev: &Path) -> Box<VolArgs> {
    let mut a = Box::new(VolArgs { fd: 0, name: [0; 4088] });
    let b = dev.as_os_str().as_encoded_bytes();
    let n = b.len().min(4087);
    a.name[..n].copy_from_slice(&b[..n]);
    a
}

fn vol_ioctl(fd: &File, req: libc::c_ulong, dev: &Path) -> std::io::Result<()> {
    let mut a = vol_args(dev);
    // SAFETY: VolArgs is the kernel's btrfs_ioctl_vol_args layout and lives across the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, &mut *a as *mut VolArgs) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn control() -> Result<File> {
    super::ensure_module("/dev/btrfs-control", "btrfs");
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/btrfs-control")
        .context("/dev/btrfs-control: open (is btrfs available?)")
}

/// `btrfs device scan DEV`: register a device with the kernel.
pub fn scan(dev: &Path) -> Result<()> {
    vol_ioctl(&control()?, BTRFS_IOC_SCAN_DEV, dev).with_context(|| format!("btrfs device scan {}", dev.display()))
}

/// `btrfs device scan --forget DEV`: drop a registered, unmounted device.
pub fn forget(dev: &Path) -> Result<()> {
    vol_ioctl(&control()?, BTRFS_IOC_FORGET_DEV, dev).with_context(|| format!("btrfs device forget {}", dev.display()))
}

/// `btrfs device add DEV MNT`.
pub fn add_device(mountpoint: &Path, dev: &Path) -> Result<()> {
    let f = File::open(mountpoint).with_context(|| format!("{}: open", mountpoint.display()))?;
    vol_ioctl(&f, BTRFS_IOC_ADD_DEV, dev)
        .with_context(|| format!("btrfs device add {} {}", dev.display(), mountpoint.display()))
}

/// Device `devid` of the filesystem mounted at `mountpoint` (seed devices included).
pub fn dev_info(mountpoint: &Path, devid: u64) -> Result<Option<Box<DevInfoArgs>>> {
    let f = File::open(mountpoint).with_context(|| format!("{}: open", mountpoint.display()))?;
    // SAFETY: all-zero is a valid DevInfoArgs; the ioctl fills it.
    let mut a: Box<DevInfoArgs> = Box::new(unsafe { std::mem::zeroed() });
    a.devid = devid;
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BTRFS_IOC_DEV_INFO as _, &mut *a as *mut DevInfoArgs) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENODEV) {
            return Ok(None);
        }
        return Err(e).with_context(|| format!("{}: BTRFS_IOC_DEV_INFO devid {devid}", mountpoint.display()));
    }
    Ok(Some(a))
}

pub const SUPER_OFFSET: u64 = 65536;
pub const MAGIC: &[u8; 8] = b"_BHRfS_M";

/// The fsid in the primary superblock of `file`, or None when it holds no btrfs.
pub fn read_super_fsid(file: &File) -> Result<Option<[u8; 16]>> {
    use std::os::unix::fs::FileExt;
    let mut sb = [0u8; 4096];
    match file.read_exact_at(&mut sb, SUPER_OFFSET) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e).context("read superblock"),
    }
    if &sb[64..72] != MAGIC {
        return Ok(None);
    }
    Ok(Some(sb[32..48].try_into().unwrap()))
}

pub fn uuid_string(u: &[u8; 16]) -> String {
    let h = hex::encode(u);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}
