//! FUSE frontend: device 2 as one read-only file, `dev2`, on a FUSE filesystem that is
//! never attached to any mount point. The server creates it with the new mount API
//! (fsopen/fsconfig/fsmount gives a detached mount) and keeps only the mount's root fd
//! (an O_PATH fd); `mount` opens `/proc/<server pid>/fd/<root fd>/dev2` ([`open_for_loop`])
//! and puts a read-only loop device on it. The server never holds `dev2` open
//! itself: closing a FUSE file can send FLUSH to its own server, and a server killed
//! while holding one would wait for itself forever on exit. Nothing is left in any mount table, so a killed
//! server leaves no stale FUSE mount behind: the detached mount goes away with the
//! last file reference.
//!
//! How `dev2` is cached is the server's [`Dev2Cache`] mode, fixed for its life; every
//! loop device on it is attached to match ([`Dev2Cache::loop_direct_io`]).
//!
//! [`Dev2Cache::Page`]: `dev2` is page-cached (no FOPEN_DIRECT_IO) and kept cached
//! across opens (FOPEN_KEEP_CACHE): the file never changes while its server lives and
//! every page in the cache came from a read this server answered after verifying the
//! chunk, so a repeated read is a copy out of the page cache in the loop worker (as for
//! btrfs on a loop device over a local file) instead of a round trip through this
//! server. A read that fails (corrupt or unreachable chunk) leaves no page behind. All
//! of a bundle's loop devices share the one inode, hence one cache; it dies with the
//! server's connection (a recovered server starts with an empty one). The buffered loop
//! device sends one request at a time: cold misses of parallel readers wait in line.
//!
//! [`Dev2Cache::Direct`]: FOPEN_DIRECT_IO under a direct-I/O loop device: every read
//! reaches the server, and with FUSE_ASYNC_DIO many at once (misses overlap).
//!
//! [`Dev2Cache::Passthrough`]: FUSE passthrough (FUSE_PASSTHROUGH, Linux >= 6.9). The
//! server registers one local file holding device 2 whole ([`crate::device::copy`]) with
//! FUSE_DEV_IOC_BACKING_OPEN and answers every open of `dev2` with FOPEN_PASSTHROUGH and
//! that backing id: the kernel then reads (and splices, and maps) the open file from the
//! backing file itself, under a buffered loop device, and no read reaches this server.
//! The kernel ties a backing file to a whole open, never to a range: one file per
//! inode (a second backing file for an inode with passthrough opens is refused with
//! EBUSY), so device 2, which maps ranges of several packs, needs that one copy. The
//! backing id belongs to the connection, not to the server: a restarted server answers
//! new opens with the id the dead one registered ([`Backing::Id`]).

use crate::device::Device2;
use crate::store::source::Fetching;
use crate::types::Dev2Cache;
use anyhow::{Context, Result};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenAccMode,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request,
    WriteFlags,
};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

pub const FILE_NAME: &str = "dev2";
const ROOT: u64 = 1;
const FILE: u64 = 2;
const TTL: Duration = Duration::from_secs(86400);

pub struct DevFs {
    dev: Arc<Device2>,
    cache: Dev2Cache,
    uid: u32,
    gid: u32,
    /// [`Dev2Cache::Passthrough`]: the backing id every open is answered with (set once
    /// the connection's FUSE_INIT allows FUSE_DEV_IOC_BACKING_OPEN).
    backing_id: Arc<OnceLock<u32>>,
    /// This server took over a connection an earlier server initialized (its FUSE_INIT
    /// is a synthetic one, see [`resumed_session`]).
    resumed: bool,
}

/// The backing file of a [`Dev2Cache::Passthrough`] server: `Copy`, device 2 copied
/// whole (to register); `Id`, the id a dead server of this connection registered.
pub enum Backing {
    Copy(File),
    Id(u32),
}

impl DevFs {
    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, perm, size, nlink) = if ino == ROOT {
            (FileType::Directory, 0o555, 0, 2)
        } else {
            (FileType::RegularFile, 0o444, self.dev.size(), 1)
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

fn answer_read(dev: &Device2, offset: u64, len: usize, reply: ReplyData) {
    let mut buf = vec![0u8; len];
    match dev.read(offset, &mut buf) {
        Ok(()) => reply.data(&buf),
        Err(e) => {
            log::debug!("read [{offset}, +{len}): {e}");
            reply.error(Errno::EIO)
        }
    }
}

impl Filesystem for DevFs {
    /// FUSE_ASYNC_DIO lets the direct-I/O loop device of [`Dev2Cache::Direct`] reach us
    /// as many requests in flight (without it each loop-issued read waits for the
    /// previous one).
    fn init(&mut self, _req: &Request, config: &mut fuser::KernelConfig) -> std::io::Result<()> {
        if let Err(missing) = config.add_capabilities(fuser::InitFlags::FUSE_ASYNC_DIO) {
            log::warn!("FUSE kernel lacks {missing:?}: device-2 reads are serialized");
        }
        // a resumed server's FUSE_INIT is synthetic: the connection already has it
        if self.cache == Dev2Cache::Passthrough && !self.resumed {
            config
                .add_capabilities(fuser::InitFlags::FUSE_PASSTHROUGH)
                .map_err(|_| {
                    std::io::Error::other(
                        "--dev2-cache passthrough: the kernel offers no FUSE_PASSTHROUGH (Linux >= 6.9 needed)",
                    )
                })?;
            // the kernel's maximum: the copy may sit on a stacked filesystem (the cache
            // directory on overlayfs, as in the VM guest, failed with ELOOP at 1); no
            // filesystem may then stack on this one, and none does (loop devices do not count)
            let _ = config.set_max_stack_depth(2);
        }
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent.0 == ROOT && name == FILE_NAME {
            reply.entry(&TTL, &self.attr(FILE), Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino.0 {
            ROOT | FILE => reply.attr(&TTL, &self.attr(ino.0)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino.0 != FILE {
            return reply.error(Errno::EISDIR);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            self.dev.reject_write();
            return reply.error(Errno::EROFS);
        }
        let flags = match self.cache {
            Dev2Cache::Page => FopenFlags::FOPEN_KEEP_CACHE,
            Dev2Cache::Direct => FopenFlags::FOPEN_DIRECT_IO,
            Dev2Cache::Passthrough => {
                let Some(&id) = self.backing_id.get() else {
                    log::error!("open of {FILE_NAME} before its backing file was registered");
                    return reply.error(Errno::EIO);
                };
                // SAFETY: an id registered on this connection and never closed (the
                // connection's end releases it); into_raw below keeps it open.
                let backing = unsafe { reply.wrap_backing(id) };
                reply.opened_passthrough(FileHandle(0), FopenFlags::empty(), &backing);
                backing.into_raw();
                return;
            }
        };
        reply.opened(FileHandle(0), flags);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino.0 != FILE {
            return reply.error(Errno::EISDIR);
        }
        let devsize = self.dev.size();
        if offset >= devsize {
            return reply.data(&[]);
        }
        let len = (size as u64).min(devsize - offset) as usize;
        if self.dev.would_wait(offset, len) {
            // a miss of a remote bundle: answered from a miss worker when its chunks are
            // verified, while this session thread goes on with the next request
            let dev = self.dev.clone();
            self.dev.defer(move || answer_read(&dev, offset, len, reply));
        } else {
            answer_read(&self.dev, offset, len, reply);
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.dev.reject_write();
        reply.error(Errno::EROFS);
    }

    /// ENOSYS makes the kernel stop sending FLUSH for good (fc->no_flush): a close()
    /// of the file then never waits for this server.
    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS);
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        reply.ok();
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino.0 != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (FILE, FileType::RegularFile, FILE_NAME),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*ino), (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

fn sys_fsopen(name: &str) -> Result<OwnedFd> {
    let c = CString::new(name).unwrap();
    // SAFETY: fsopen(2) with a valid C string; returns a new fd or -1.
    let r = unsafe {
        libc::syscall(libc::SYS_fsopen, c.as_ptr(), 1 /* FSOPEN_CLOEXEC */)
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("fsopen(\"fuse\") (kernel without the new mount API?)");
    }
    // SAFETY: r is a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

fn sys_fsconfig_str(fsfd: &OwnedFd, key: &str, value: &str) -> Result<()> {
    let k = CString::new(key).unwrap();
    let v = CString::new(value).unwrap();
    // SAFETY: FSCONFIG_SET_STRING (1) with valid C strings.
    let r = unsafe { libc::syscall(libc::SYS_fsconfig, fsfd.as_raw_fd(), 1, k.as_ptr(), v.as_ptr(), 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("fsconfig fuse {key}={value}"));
    }
    Ok(())
}

fn sys_fsconfig_create(fsfd: &OwnedFd) -> Result<()> {
    // SAFETY: FSCONFIG_CMD_CREATE (6) takes no key/value.
    let r = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fsfd.as_raw_fd(),
            6,
            std::ptr::null::<u8>(),
            std::ptr::null::<u8>(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("fsconfig fuse FSCONFIG_CMD_CREATE");
    }
    Ok(())
}

fn sys_fsmount(fsfd: &OwnedFd) -> Result<OwnedFd> {
    // FSMOUNT_CLOEXEC; MOUNT_ATTR_RDONLY | NOSUID | NODEV | NOEXEC
    // SAFETY: fsmount(2) on a configured fs context.
    let r = unsafe { libc::syscall(libc::SYS_fsmount, fsfd.as_raw_fd(), 1, 0x1 | 0x2 | 0x4 | 0x8) };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("fsmount fuse");
    }
    // SAFETY: r is a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

/// Open the server's `dev2` (`path`, see the module comment) for a loop device of a
/// server in mode `cache`. Page: the loop device is attached WITHOUT direct I/O, and
/// POSIX_FADV_RANDOM marks this open file (the loop device keeps it) so that a loop
/// request reads exactly its own range: no readahead on the FUSE file, which would
/// fetch and verify chunks nobody asked for (btrfs already reads ahead on its own
/// files, and its request sizes are what reach us). Direct: a plain open.
pub fn open_for_loop(path: &str, cache: Dev2Cache) -> Result<File> {
    let f = File::open(path).with_context(|| format!("open the server's device {path}"))?;
    // passthrough: the kernel reads the backing file through its own open file, whose
    // readahead is the backing filesystem's (as for btrfs on a loop device over a file)
    if cache != Dev2Cache::Page {
        return Ok(f);
    }
    // SAFETY: posix_fadvise on an fd we own; returns an errno value, not -1.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    if r != 0 {
        return Err(std::io::Error::from_raw_os_error(r)).with_context(|| format!("{path}: posix_fadvise RANDOM"));
    }
    Ok(f)
}

/// Local packs behind a [`Dev2Cache::Page`] frontend: verify the next chunk while the reader is served
/// once a pack is read sequentially (three chunks in a row, the rule remote packs use,
/// so reading one 1 MiB file still loads only the chunks it touches). The buffered loop
/// device hands us one request at a time, so without it a cold sequential read waits
/// for each chunk's read and sha256 in turn (measured: ~0.55x the throughput of the
/// direct-I/O loop device, which kept several requests in flight). One chunk, not more:
/// every chunk read ahead is pack I/O for data perhaps never read (`chroot MNT
/// /bin/true` on Debian: 7 chunks without, 8 with one, 11 with four). Remote packs keep
/// their own setting.
pub fn tune_fetching(fetching: &mut Fetching) {
    if fetching.disk.is_none() {
        fetching.readahead = 1;
        fetching.workers = 1;
    }
}

/// A running FUSE frontend. `root` is the detached mount's root (O_PATH); the session
/// threads run until the connection ends (server exit). `backing_id`: the passthrough
/// backing id every open gets ([`Dev2Cache::Passthrough`]).
pub struct FuseFrontend {
    pub root: OwnedFd,
    pub session: std::thread::JoinHandle<std::io::Result<()>>,
    pub backing_id: Option<u32>,
}

/// A FUSE connection and its detached mount, made by [`connect`]: `fuse` is the
/// `/dev/fuse` fd (the connection lives while any process holds it), `root` the
/// mount's root (O_PATH).
pub struct Connection {
    pub fuse: OwnedFd,
    pub root: OwnedFd,
}

/// A connection a supervisor holds and hands to this server (by inheritance):
/// `resume` when an earlier server already answered its FUSE_INIT (it died; the
/// requests it had taken are still queued on the shared fd, see [`resend`]).
pub struct Inherited {
    pub conn: Connection,
    pub resume: bool,
}

/// Create the FUSE filesystem (fsopen/fsconfig/fsmount: a detached mount). The kernel
/// queues FUSE_INIT on `fuse`; whoever serves the connection answers it.
pub fn connect() -> Result<Connection> {
    crate::plumbing::ensure_module("/dev/fuse", "fuse");
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .context("/dev/fuse: open (is the fuse module available?)")?;
    let fuse: OwnedFd = fuse.into();
    let fsfd = sys_fsopen("fuse")?;
    sys_fsconfig_str(&fsfd, "source", "ublkd")?;
    sys_fsconfig_str(&fsfd, "fd", &fuse.as_raw_fd().to_string())?;
    sys_fsconfig_str(&fsfd, "rootmode", "40555")?;
    // SAFETY: trivial getters.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    sys_fsconfig_str(&fsfd, "user_id", &uid.to_string())?;
    sys_fsconfig_str(&fsfd, "group_id", &gid.to_string())?;
    sys_fsconfig_create(&fsfd)?;
    let root = sys_fsmount(&fsfd)?;
    Ok(Connection { fuse, root })
}

/// FUSE_NOTIFY_RESEND (kernel >= 6.9): the kernel moves every request taken from this
/// connection and not yet answered (its processing lists) back to the pending queue,
/// marked with FUSE_UNIQUE_RESEND, so that the server reads them again. Those of a
/// server that died while the connection lived on in its supervisor: their readers
/// waited instead of failing. Device-2 reads are idempotent, so answering one twice
/// could do no harm (a request answered before the death is not in those lists).
fn resend(fuse: &OwnedFd) -> Result<()> {
    const FUSE_NOTIFY_RESEND: i32 = 7;
    // struct fuse_out_header: len, error (= the notify code), unique 0 (= a notification)
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&16u32.to_ne_bytes());
    h[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    // SAFETY: write(2) of a 16-byte buffer to an fd we hold.
    let r = unsafe { libc::write(fuse.as_raw_fd(), h.as_ptr().cast(), h.len()) };
    if r != h.len() as isize {
        return Err(std::io::Error::last_os_error()).context("FUSE_NOTIFY_RESEND (kernel older than 6.9?)");
    }
    Ok(())
}

/// A fuser session on a connection whose FUSE_INIT an earlier server answered. fuser
/// 0.18 has no way to skip its handshake, so it is given one: the session is built on
/// one end of a socket pair holding a synthetic FUSE_INIT (its reply goes to the other
/// end and is dropped), then `dup2` puts the real connection on that very fd number,
/// which the session reads and writes from then on.
fn resumed_session(fs: DevFs, fuse: &OwnedFd, config: fuser::Config) -> Result<fuser::Session<DevFs>> {
    let mut sv = [0i32; 2];
    // SAFETY: socketpair(2) into a 2-int array.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error()).context("socketpair for the FUSE handshake");
    }
    // SAFETY: two fresh fds we own.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    // struct fuse_in_header (40 bytes) + struct fuse_init_in (64 bytes), protocol 7.31
    const FUSE_INIT: u32 = 26;
    let mut m = [0u8; 104];
    m[0..4].copy_from_slice(&104u32.to_ne_bytes());
    m[4..8].copy_from_slice(&FUSE_INIT.to_ne_bytes());
    m[8..16].copy_from_slice(&1u64.to_ne_bytes());
    m[40..44].copy_from_slice(&7u32.to_ne_bytes());
    m[44..48].copy_from_slice(&31u32.to_ne_bytes());
    m[48..52].copy_from_slice(&(128u32 << 10).to_ne_bytes());
    // flags: FUSE_ASYNC_DIO, which the connection has (the first server asked for it;
    // this answer goes nowhere), so that `init` does not warn of its absence
    m[52..56].copy_from_slice(&(1u32 << 15).to_ne_bytes());
    // SAFETY: write(2) of our buffer to a socket we own.
    let n = unsafe { libc::write(ours.as_raw_fd(), m.as_ptr().cast(), m.len()) };
    if n != m.len() as isize {
        return Err(std::io::Error::last_os_error()).context("write the synthetic FUSE_INIT");
    }
    let slot = theirs.as_raw_fd();
    let session =
        fuser::Session::from_fd(fs, theirs, fuser::SessionACL::All, config).context("FUSE handshake (resumed)")?;
    drop(ours);
    // SAFETY: dup2 onto the fd the session owns: atomically the same number, now the
    // connection (the socket end is closed by it).
    if unsafe { libc::dup2(fuse.as_raw_fd(), slot) } != slot {
        return Err(std::io::Error::last_os_error()).context("dup2 the FUSE connection into the session");
    }
    Ok(session)
}

/// Serve device 2 over FUSE: on a new connection ([`connect`]), or on one a supervisor
/// holds ([`Inherited`]). A supervised server reads every request through the one
/// shared fd (no FUSE_DEV_IOC_CLONE): a cloned fd is this process's alone, and when it
/// dies the kernel fails the requests taken through it (ECONNABORTED) where those
/// taken through the shared one wait for [`resend`].
pub fn start(
    dev: Arc<Device2>,
    threads: usize,
    cache: Dev2Cache,
    inherited: Option<Inherited>,
    backing: Option<Backing>,
) -> Result<FuseFrontend> {
    if (cache == Dev2Cache::Passthrough) != backing.is_some() {
        anyhow::bail!("--dev2-cache passthrough needs a backing file (and only it)");
    }
    let (conn, resume, supervised) = match inherited {
        Some(i) => (i.conn, i.resume, true),
        None => (connect()?, false, false),
    };
    let mut config = fuser::Config::default();
    config.n_threads = Some(threads.max(1));
    config.clone_fd = !supervised;
    // SAFETY: trivial getters.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let backing_id = Arc::new(OnceLock::new());
    let fs = DevFs {
        dev,
        cache,
        uid,
        gid,
        backing_id: backing_id.clone(),
        resumed: resume,
    };
    let Connection { fuse, root } = conn;
    // BACKING_OPEN goes through the connection once its FUSE_INIT is answered
    let fuse_dev = fuse.try_clone().context("dup the FUSE connection")?;
    let (session, resend_on) = if resume {
        (resumed_session(fs, &fuse, config)?, Some(fuse))
    } else {
        let s = fuser::Session::from_fd(fs, fuse, fuser::SessionACL::All, config).context("FUSE handshake")?;
        (s, None)
    };
    match backing {
        Some(Backing::Copy(file)) => {
            let id = fuser::BackingId::create_raw(&fuse_dev, &file)
                .context("FUSE_DEV_IOC_BACKING_OPEN of the copy of device 2 (ELOOP: --cache-dir is on a filesystem stacked twice)")?;
            // the kernel holds the file from now on; our fd on it is not needed
            let _ = backing_id.set(id);
        }
        Some(Backing::Id(id)) => {
            let _ = backing_id.set(id);
        }
        None => {}
    }
    drop(fuse_dev);
    let session = std::thread::Builder::new()
        .name("fuse".into())
        .spawn(move || session.run())?;
    if let Some(fuse) = resend_on {
        resend(&fuse)?;
    }

    // check the file is there (stat only: no open, see the module comment)
    let name = CString::new(FILE_NAME).unwrap();
    // SAFETY: fstatat on the detached mount's root fd with a valid C string and buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatat(root.as_raw_fd(), name.as_ptr(), &mut st, 0) } != 0 {
        return Err(std::io::Error::last_os_error()).context("stat dev2 on the FUSE mount");
    }
    Ok(FuseFrontend {
        root,
        session,
        backing_id: backing_id.get().copied(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plumbing::loopdev;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    use std::path::Path;

    /// `len` bytes at `offset` of `file` (opened O_DIRECT) into an aligned buffer.
    fn read_direct(file: &std::fs::File, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
        let mut buf = vec![0u8; len + 4096];
        let skip = buf.as_ptr().align_offset(4096);
        file.read_exact_at(&mut buf[skip..skip + len], offset)?;
        Ok(buf[skip..skip + len].to_vec())
    }

    /// Root only: serve a synthetic device over FUSE in mode `cache` and read it back
    /// through a real read-only loop device attached as `mount` does, opened O_DIRECT
    /// (so every read reaches the loop device): a 4 KiB read reaches the server as
    /// exactly 4 KiB (no readahead on the FUSE file); a repeated read, also after
    /// another open of the file, comes from the FUSE file's page cache (page) or from
    /// the server again (direct).
    fn reads_back_through_a_loop_device(cache: Dev2Cache) {
        // SAFETY: trivial getter.
        if unsafe { libc::geteuid() } != 0
            || !Path::new("/dev/fuse").exists()
            || !Path::new("/dev/loop-control").exists()
        {
            eprintln!("skipped: needs root, /dev/fuse and /dev/loop-control");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let (dev, expect, _) = crate::device::tests::synthetic(tmp.path(), 12);
        let dev = Arc::new(dev);
        let backing = (cache == Dev2Cache::Passthrough)
            .then(|| Backing::Copy(crate::device::copy::copy_whole(&dev, &tmp.path().join("copy")).unwrap()));
        let fe = start(dev.clone(), 2, cache, None, backing).unwrap();
        let dev2 = format!("/proc/self/fd/{}/{FILE_NAME}", fe.root.as_raw_fd());
        let file = open_for_loop(&dev2, cache).unwrap();
        assert_eq!(file.metadata().unwrap().len(), expect.len() as u64);
        let opts = loopdev::AttachOptions {
            read_only: true,
            direct_io: cache.loop_direct_io(),
            block_size: 4096,
            autoclear: true,
        };
        let l = loopdev::attach(&file, Path::new("ublkd-unit-test"), &opts).unwrap();
        drop(file);
        let backing = loopdev::backing_file(l.number).unwrap();
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&l.path)
            .unwrap();
        let served = || dev.counters.snapshot().bytes_served;
        let at = 0;
        let one = read_direct(&direct, at as u64, 4096);
        let served_one = served();
        let first = read_direct(&direct, 0, expect.len());
        let served_first = served();
        // another open (another mount's loop device) keeps the cache (FOPEN_KEEP_CACHE)
        let another = open_for_loop(&dev2, cache).unwrap();
        let second = read_direct(&direct, 0, expect.len());
        let served_second = served();
        // a read-only loop device refuses writes (open for write or the write itself)
        let write = std::fs::OpenOptions::new()
            .write(true)
            .open(&l.path)
            .and_then(|w| w.write_all_at(&[0u8; 4096], 0).and_then(|_| w.sync_all()));
        let direct_io = l.direct_io;
        drop((l.file, direct, another));
        loopdev::detach_if(l.number, &backing).unwrap();
        assert!(one.unwrap() == expect[at..at + 4096], "4 KiB read differs");
        assert!(first.unwrap() == expect, "device bytes differ from the synthetic image");
        assert!(second.unwrap() == expect, "device bytes differ on the second read");
        assert!(write.is_err(), "a read-only loop device must refuse writes");
        assert_eq!(direct_io, cache.loop_direct_io(), "the loop device's direct I/O flag");
        let len = expect.len() as u64;
        if cache == Dev2Cache::Passthrough {
            let s = dev.counters.snapshot();
            assert_eq!((s.reads, served_second), (0, 0), "no read reaches a passthrough server");
            return;
        }
        assert_eq!(
            served_one, 4096,
            "a 4 KiB read must reach the server as 4 KiB (no readahead)"
        );
        match cache {
            Dev2Cache::Page => {
                assert_eq!(
                    served_first, len,
                    "the first whole read is served once, less what the page cache already held"
                );
                assert_eq!(
                    served_second, served_first,
                    "a repeated read must come from the page cache"
                );
            }
            Dev2Cache::Passthrough => unreachable!(),
            Dev2Cache::Direct => {
                assert_eq!(served_first, 4096 + len, "every read reaches the server");
                assert_eq!(served_second, 4096 + 2 * len, "every read reaches the server");
            }
        }
    }

    #[test]
    fn page_cached_device_reads_back_through_a_loop_device() {
        reads_back_through_a_loop_device(Dev2Cache::Page);
    }

    #[test]
    fn direct_io_device_reads_back_through_a_loop_device() {
        reads_back_through_a_loop_device(Dev2Cache::Direct);
    }

    #[test]
    fn passthrough_device_reads_back_through_a_loop_device() {
        reads_back_through_a_loop_device(Dev2Cache::Passthrough);
    }
}
