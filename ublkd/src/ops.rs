//! `mount`, `umount`, `status`, `recover`: the plumbing sequence around a server, with
//! rollback of every step on failure.

use crate::bundle::Bundle;
use crate::frontend::fuse::Dev2Cache;
use crate::frontend::ublk::{PollArg, PollMode};
use crate::frontend::{self, Kind};
use crate::plumbing::{btrfs, loopdev, mount as mnt};
use crate::remote::{self, RemoteArgs};
use crate::server::Ready;
use crate::state::{self, BundleState, LoopRecord, MountState, ServerRecord, SharedMount};
use crate::stats::Snapshot;
use crate::trace::{self, Trace};
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct MountArgs {
    /// Bundle directory (manifest.json, meta.img, blockmap, packs/), the URL of a bundle's
    /// manifest.json (`http(s)://...`), or `oci://REGISTRY[:PORT]/REPO[:TAG|@sha256:DIGEST]`.
    pub bundle: String,
    /// Where to mount the image.
    pub mountpoint: PathBuf,
    /// Writable layer: a file that becomes the sprout's rw device (created sparse if missing;
    /// if it already holds this image's sprout, that filesystem is mounted again).
    #[arg(long)]
    pub rw: Option<PathBuf>,
    /// A writable layer that lives under /run/ublkd/ (overlayfs over the bundle's shared
    /// read-only mount) and is discarded by `umount`.
    #[arg(long, conflicts_with = "rw")]
    pub ephemeral: bool,
    /// Size of a new --rw file (K, M, G, T suffixes).
    #[arg(long, default_value = "10G", value_parser = parse_size)]
    pub rw_size: u64,
    #[arg(long, value_enum, default_value = "auto")]
    pub frontend: Kind,
    /// fuse frontend: how device 2 is cached, for every mount of the bundle (a property
    /// of its server). page: FUSE file in the page cache under buffered loop devices
    /// (warm reads as fast as btrfs on a local loop device, but cold misses reach the
    /// server one at a time). direct: direct I/O end to end (every read reaches the
    /// server, misses in parallel). Default: page for a local bundle, direct for an
    /// http(s)/oci one, where a miss is a network round trip that parallel readers
    /// must not wait for in line. A bundle whose server already runs in another mode is
    /// refused (omit the flag to follow it). Ignored by the ublk frontend (direct I/O).
    #[arg(long, value_enum, value_name = "MODE")]
    pub dev2_cache: Option<Dev2Cache>,
    /// Refuse to mount unless the image id (sha256 of manifest.json) is this.
    #[arg(long)]
    pub expect_id: Option<String>,
    /// Memory for the server's verified chunk cache, in MiB (the bundle's first mount
    /// starts its server; later mounts share it).
    #[arg(long, default_value_t = DEFAULT_CACHE_MB)]
    pub cache_mb: u64,
    /// Registry credentials USER:PASSWORD (also from $UBLKD_REGISTRY_AUTH, else docker's config.json).
    #[arg(long)]
    pub registry_auth: Option<String>,
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// Prefetch trace to apply (default: prefetch.trace beside manifest.json, if any);
    /// its chunks are fetched in the background once the mount is up.
    #[arg(long, value_name = "TRACE")]
    pub prefetch: Option<PathBuf>,
    /// Do not apply the bundle's prefetch.trace.
    #[arg(long, conflicts_with = "prefetch")]
    pub no_prefetch: bool,
    #[command(flatten)]
    pub poll: PollArg,
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let suffix = s[i..].to_ascii_uppercase();
            let m: u64 = match suffix.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => return Err(format!("bad size suffix in {s:?}")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n: u64 = num.trim().parse().map_err(|_| format!("bad size {s:?}"))?;
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} too large"))
}

/// Undo actions, run newest first unless disarmed.
type Undo = Box<dyn FnOnce() -> Result<()>>;
struct Rollback(Vec<(String, Undo)>);

impl Rollback {
    fn push(&mut self, what: impl Into<String>, f: impl FnOnce() -> Result<()> + 'static) {
        self.0.push((what.into(), Box::new(f)));
    }
    fn disarm(mut self) {
        self.0.clear();
    }
}

impl Drop for Rollback {
    fn drop(&mut self) {
        while let Some((what, f)) = self.0.pop() {
            if let Err(e) = f() {
                eprintln!("ublkd: rollback: {what}: {e:#}");
            }
        }
    }
}

fn loop_record(l: &loopdev::LoopDev) -> LoopRecord {
    LoopRecord {
        number: l.number,
        path: l.path.display().to_string(),
        backing: loopdev::backing_file(l.number).unwrap_or_default(),
        direct_io: l.direct_io,
    }
}

fn detach_record(r: &LoopRecord) -> Result<()> {
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

fn server_log_tail(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// `--cache-mb` when not given (and for servers recorded before the value was kept).
pub const DEFAULT_CACHE_MB: u64 = 256;

/// Start `ublkd serve` in the background (own session, log in `dir/server.log`) and wait
/// for its READY line.
fn spawn_server(
    b: &BundleState,
    kind: Kind,
    cache_mb: u64,
    dev2_cache: Dev2Cache,
    ublk_poll: PollMode,
    recover: Option<i32>,
) -> Result<(Ready, ServerRecord)> {
    let (bundle, dir, image_id) = (b.bundle.as_str(), &b.dir(), b.image_id.as_str());
    let exe = std::env::current_exe().context("locate the ublkd executable")?;
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
        .with_context(|| format!("{}: open", dir.join("server.log").display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve")
        .arg(bundle)
        .args(["--frontend", kind.as_str(), "--expect-id", image_id])
        .arg("--dir")
        .arg(dir)
        .args(["--cache-mb", &cache_mb.to_string()])
        .args(["--dev2-cache", dev2_cache.as_str()])
        .args(&b.serve_args);
    if let Some(id) = recover {
        cmd.args(["--ublk-recover", &id.to_string()]);
    }
    if kind == Kind::Ublk {
        cmd.arg(format!("--ublk-poll={ublk_poll}"));
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log));
    // SAFETY: setsid is async-signal-safe; the server must not die with our terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("start ublkd serve")?;
    crate::timing("server spawned");
    let pid = child.id() as i32;
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    let ready = line
        .strip_prefix("READY ")
        .and_then(|j| serde_json::from_str::<Ready>(j.trim()).ok());
    match ready {
        Some(r) => {
            let start_time = state::proc_start_time(pid).unwrap_or(0);
            let rec = ServerRecord {
                pid,
                start_time,
                frontend: r.frontend.clone(),
                device: r.device.clone(),
                ublk_id: r.ublk_id,
                dev2_cache: r.dev2_cache,
                cache_mb: Some(cache_mb),
                ublk_poll: r.ublk_id.and(Some(ublk_poll)),
                ublk_poll_us: None,
            };
            // the server outlives us; it is reaped by init once we exit
            std::mem::forget(child);
            Ok((r, rec))
        }
        None => {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "ublkd serve did not start; its log ({}):\n{}",
                dir.join("server.log").display(),
                server_log_tail(dir)
            )
        }
    }
}

/// Stop a server: SIGTERM, then SIGKILL. Only a process whose pid and start time match.
fn stop_server(s: &ServerRecord) -> Result<()> {
    if !state::server_alive(s) {
        return Ok(());
    }
    let pid = nix::unistd::Pid::from_raw(s.pid);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let t = Instant::now();
    while state::server_alive(s) {
        if t.elapsed() > Duration::from_secs(10) {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            std::thread::sleep(Duration::from_millis(100));
            ensure!(!state::server_alive(s), "server pid {} does not exit", s.pid);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn ublk_dev_exists(id: i32) -> bool {
    Path::new(&format!("/dev/ublkc{id}")).exists() || Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists()
}

fn open_rw_file(path: &Path, size: u64) -> Result<(File, bool)> {
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

fn all_zero_head(f: &File) -> Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let n = f.read_at(&mut buf, 0)?;
    Ok(buf[..n].iter().all(|&b| b == 0))
}

const RO_OPTS: loopdev::AttachOptions = loopdev::AttachOptions {
    read_only: true,
    direct_io: true,
    block_size: 4096,
    autoclear: true,
};

/// Size of the scratch device the shared mount is sprouted onto (sparse; it only ever
/// receives the relocated SYSTEM chunk and a little metadata before going read-only).
const SHARED_SCRATCH_SIZE: u64 = 1 << 30;

/// A new device-2 instance: a read-only loop device on the server's device node (the
/// FUSE file, buffered or direct I/O as the server's `--dev2-cache` says, see
/// frontend::fuse; or /dev/ublkbN with direct I/O, that node has its own page cache).
/// Each mounted filesystem needs its own block device; all instances are served by the
/// bundle's one server. `name` goes into lo_file_name (the state dir: tells whose
/// instance it is).
fn attach_dev2_instance(srv: &ServerRecord, name: &Path) -> Result<loopdev::LoopDev> {
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
const META_OPTS: loopdev::AttachOptions = loopdev::AttachOptions {
    direct_io: false,
    ..RO_OPTS
};

/// meta.img on a loop device: the very file `mount` checked against the manifest.
/// Attaching costs an fsync of the backing file (the loop driver does one on every
/// LOOP_CONFIGURE: a disk cache flush on ext4), so it runs in a thread while the server
/// starts; [`MetaLoop::get`] waits for it. An unused or failed attach goes away with
/// its fd (AUTOCLEAR).
struct MetaLoop(std::thread::JoinHandle<Result<loopdev::LoopDev>>);

impl MetaLoop {
    fn start(bundle: &Bundle) -> Result<MetaLoop> {
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

    fn get(self) -> Result<loopdev::LoopDev> {
        self.0.join().map_err(|_| anyhow!("attaching meta.img panicked"))?
    }

    /// The loop device `started` attaches, or (none started) one attached now.
    fn get_or_attach(started: Option<MetaLoop>, bundle: &Bundle) -> Result<loopdev::LoopDev> {
        started.map_or_else(|| MetaLoop::start(bundle), Ok)?.get()
    }
}

/// `btrfs device scan` for a new instance of the image's seed devices.
fn scan_seed(devs: &[&Path], bundle: &Bundle) -> Result<()> {
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

fn mounts_of(key: &str) -> Result<Vec<MountState>> {
    Ok(MountState::all()?.into_iter().filter(|m| m.bundle_key == key).collect())
}

fn is_mounted(path: &str) -> Result<bool> {
    Ok(mnt::mounts()?.iter().any(|m| m.mount_point == path))
}

/// A ublk server that died leaves I/O queued (USER_RECOVERY): delete its device first
/// so that unmounts see errors instead of waiting forever.
fn fail_dead_ublk(b: &BundleState) -> Result<()> {
    if let Some(srv) = &b.server {
        if let (Some(id), false) = (srv.ublk_id, state::server_alive(srv)) {
            if ublk_dev_exists(id) {
                frontend::ublk::delete(id, true)?;
            }
        }
    }
    Ok(())
}

fn umount_busy_msg(path: &str, lazy: bool) -> Result<()> {
    match mnt::umount(Path::new(path), lazy) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EBUSY) => bail!("umount {path}: target is busy (close files under it, or use --lazy)"),
        Err(e) => Err(e).with_context(|| format!("umount {path}")),
    }
}

fn forget_and_detach(loops: &[&Option<LoopRecord>]) -> Result<()> {
    for r in loops.iter().copied().flatten() {
        let _ = btrfs::forget(Path::new(&r.path));
    }
    for r in loops.iter().copied().flatten() {
        detach_record(r).with_context(|| format!("detach {}", r.path))?;
    }
    Ok(())
}

fn teardown_shared(sh: &SharedMount) -> Result<()> {
    if is_mounted(&sh.path)? {
        umount_busy_msg(&sh.path, false)?;
    }
    forget_and_detach(&[&sh.rw_loop, &sh.meta_loop, &sh.dev2_loop])?;
    if let Some(node) = &sh.dev2_node {
        // the kernel's device list must not keep it for the next image on this node
        let _ = btrfs::forget(Path::new(node));
    }
    if let Some(p) = &sh.rw_path {
        match std::fs::remove_file(p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).context(format!("{p}: remove")),
            _ => {}
        }
    }
    let _ = std::fs::remove_dir(&sh.path);
    Ok(())
}

/// Reference counting by inspection (the caller holds the bundle lock): the shared
/// mount goes when no read-only or ephemeral mount of the bundle is left, the server
/// and the bundle's state when no mount at all is left.
fn gc_bundle(key: &str) -> Result<()> {
    let Some(mut b) = BundleState::load(key) else {
        let _ = std::fs::remove_dir_all(BundleState::dir_of(key));
        return Ok(());
    };
    let users = mounts_of(key)?;
    if let Some(sh) = b.shared.clone() {
        if !users.iter().any(|m| m.mode != "rw") {
            fail_dead_ublk(&b)?;
            teardown_shared(&sh)?;
            b.shared = None;
            b.save()?;
        }
    }
    if users.is_empty() {
        if let Some(srv) = &b.server {
            stop_server(srv)?;
            if let Some(id) = srv.ublk_id {
                if ublk_dev_exists(id) {
                    let _ = frontend::ublk::delete(id, false);
                }
            }
        }
        std::fs::remove_dir_all(b.dir()).with_context(|| format!("{}: remove", b.dir().display()))?;
    }
    Ok(())
}

/// The bundle's server: the running one, or a new one.
fn ensure_server(
    b: &mut BundleState,
    asked: Kind,
    kind: Kind,
    cache_mb: u64,
    dev2_cache: (Dev2Cache, bool),
    ublk_poll: Option<PollMode>,
    me: &str,
) -> Result<ServerRecord> {
    if let Some(s) = &b.server {
        if state::server_alive(s) {
            ensure!(
                asked == Kind::Auto || s.frontend == kind.as_str(),
                "bundle {} is already served by a {} server (pid {}): use --frontend {} or auto",
                b.bundle,
                s.frontend,
                s.pid,
                s.frontend
            );
            let (cache, explicit) = dev2_cache;
            ensure!(
                !explicit || s.ublk_id.is_some() || s.fuse_dev2_cache() == cache,
                "bundle {} is already served with --dev2-cache {} (pid {}; the mode holds for all its mounts): omit \
                 --dev2-cache to follow it, or unmount the bundle's mounts first",
                b.bundle,
                s.fuse_dev2_cache().as_str(),
                s.pid
            );
            ensure!(
                ublk_poll.is_none() || s.ublk_id.is_none() || Some(s.ublk_poll_mode()) == ublk_poll,
                "bundle {} is already served with --ublk-poll={} (pid {}; the mode holds for all its mounts): omit \
                 --ublk-poll to follow it, or unmount the bundle's mounts first",
                b.bundle,
                s.ublk_poll_mode(),
                s.pid
            );
            return Ok(s.clone());
        }
        let others: Vec<String> = mounts_of(&b.key)?
            .into_iter()
            .filter(|m| m.id != me)
            .map(|m| m.mountpoint)
            .collect();
        ensure!(
            others.is_empty(),
            "the server of bundle {} (pid {}) is not running and it still has mounts ({}): run `ublkd recover` on one \
             of them first",
            b.bundle,
            s.pid,
            others.join(", ")
        );
    }
    std::fs::create_dir_all(b.dir()).with_context(|| format!("{}: mkdir", b.dir().display()))?;
    let (_ready, srv) = spawn_server(b, kind, cache_mb, dev2_cache.0, ublk_poll.unwrap_or_default(), None)?;
    b.server = Some(srv.clone());
    b.save()?;
    Ok(srv)
}

/// Is this shared mount mounted and usable as it is?
fn shared_is_up(sh: &SharedMount) -> Result<bool> {
    Ok(sh.phase == "mounted" && is_mounted(&sh.path)?)
}

/// The bundle's shared mount (see [`SharedMount`]): the existing one, or a new one.
fn ensure_shared(
    b: &mut BundleState,
    bundle: &Bundle,
    srv: &ServerRecord,
    meta_loop: Option<MetaLoop>,
) -> Result<PathBuf> {
    if let Some(sh) = b.shared.clone() {
        if shared_is_up(&sh)? {
            return Ok(PathBuf::from(sh.path));
        }
        teardown_shared(&sh).context("clean up a stale shared mount")?;
        b.shared = None;
        b.save()?;
    }
    let dir = b.dir();
    let path = dir.join("seed");
    std::fs::create_dir_all(&path).with_context(|| format!("{}: mkdir", path.display()))?;
    let mut sh = SharedMount {
        path: path.display().to_string(),
        phase: "mounting".into(),
        ..Default::default()
    };
    let save = |b: &mut BundleState, sh: &SharedMount| -> Result<()> {
        b.shared = Some(sh.clone());
        b.save()
    };
    // Until the filesystem holds them, the loop devices live only as long as our fds
    // (AUTOCLEAR), so they are recorded once both are there, before the scan makes
    // the kernel remember them (each save here costs a rename on the run dir's disk).
    let mut holds: Vec<File> = Vec::new();
    // ublk: the first instance of device 2 is /dev/ublkbN itself. A loop device there
    // would add a queue hop (a kernel worker wakeup) to every read; later instances
    // (--rw mounts) need their own block devices and get loop devices on it.
    let dev2 = if srv.ublk_id.is_some() {
        sh.dev2_node = Some(srv.device.clone());
        PathBuf::from(&srv.device)
    } else {
        let d2 = attach_dev2_instance(srv, &dir)?;
        crate::timing("shared: dev2 loop attached");
        sh.dev2_loop = Some(loop_record(&d2));
        holds.push(d2.file);
        d2.path
    };
    let m = MetaLoop::get_or_attach(meta_loop, bundle)?;
    sh.meta_loop = Some(loop_record(&m));
    save(b, &sh)?;
    let meta = m.path.clone();
    holds.push(m.file);
    crate::timing("shared: loops attached");
    scan_seed(&[&meta, &dev2], bundle)?;
    crate::timing("shared: scanned");
    mnt::mount_btrfs(&meta, &path, &[&meta, &dev2], true, "")?;
    crate::timing("shared: mount(2) done");
    sh.phase = "mounted".into();
    save(b, &sh)?;
    drop(holds);
    Ok(path)
}

/// Sprout the bundle's shared mount onto a scratch device and make it read-only again,
/// unless that was done already. Until then the shared mount holds the image's fsid, and
/// the kernel refuses another instance of the image's devices (EEXIST): every step that
/// attaches such an instance (`--rw` mounts, a shared mount of another bundle with the
/// same fsid) calls this first. Deferring it keeps ~100 ms (a transaction on the scratch
/// device) off the first read-only mount.
fn sprout_shared(b: &mut BundleState) -> Result<()> {
    let Some(mut sh) = b.shared.clone() else {
        return Ok(());
    };
    if sh.phase != "mounted" || sh.rw_loop.is_some() {
        return Ok(());
    }
    let path = PathBuf::from(&sh.path);
    let rw_path = b.dir().join("seed-rw.img");
    let _ = std::fs::remove_file(&rw_path);
    sh.rw_path = Some(rw_path.display().to_string());
    b.shared = Some(sh.clone());
    b.save()?;
    let (rwf, _) = open_rw_file(&rw_path, SHARED_SCRATCH_SIZE)?;
    let rl = loopdev::attach(
        &rwf,
        &rw_path,
        &loopdev::AttachOptions {
            read_only: false,
            ..RO_OPTS
        },
    )?;
    sh.rw_loop = Some(loop_record(&rl));
    b.shared = Some(sh.clone());
    b.save()?;
    if let Err(e) = btrfs::add_device(&path, &rl.path) {
        // leave it unsprouted and consistent, so a later attempt starts afresh
        forget_and_detach(&[&sh.rw_loop])?;
        let _ = std::fs::remove_file(&rw_path);
        (sh.rw_loop, sh.rw_path) = (None, None);
        b.shared = Some(sh);
        b.save()?;
        return Err(e).context("sprout the shared mount");
    }
    // ADD_DEV of a seed clears the superblock's read-only flag: nothing may write here
    mnt::remount_ro(&path)?;
    drop(rl.file);
    Ok(())
}

/// Before attaching a new instance of this image's devices: sprout the unsprouted shared
/// mounts of OTHER bundles with the same fsid (another image id of the same filesystem,
/// e.g. the same tree built from a different spec file). Their locks are held until the
/// returned guards drop, so none of them makes a new unsprouted mount meanwhile. Waits at
/// most 30 s for each lock (two such bundles sprouting each other time out instead of
/// deadlocking).
fn claim_fsid(b: &BundleState) -> Result<Vec<state::Lock>> {
    let mut held = Vec::new();
    for other in BundleState::all() {
        if other.key == b.key || other.fsid != b.fsid {
            continue;
        }
        let lock = state::lock_timeout(
            &BundleState::lock_path(&other.key),
            Some(&BundleState::dir_of(&other.key)),
            Duration::from_secs(30),
        )
        .with_context(|| format!("bundle {} has the same fsid {}: lock it", other.bundle, b.fsid))?;
        if let Some(mut o) = BundleState::load(&other.key) {
            sprout_shared(&mut o).with_context(|| format!("bundle {} (same fsid {})", o.bundle, o.fsid))?;
        }
        held.push(lock);
    }
    Ok(held)
}

pub fn mount(args: MountArgs) -> Result<()> {
    let t0 = Instant::now();
    let mountpoint = args
        .mountpoint
        .canonicalize()
        .with_context(|| format!("mount point {}: not found", args.mountpoint.display()))?;
    ensure!(
        mountpoint.is_dir(),
        "mount point {}: not a directory",
        mountpoint.display()
    );
    if let Some(a) = &args.registry_auth {
        // read by the registry client here and inherited by the server (never in its argv)
        std::env::set_var(remote::AUTH_ENV, a);
    }
    crate::timing("mount: args parsed");
    let (bundle, location) = remote::open_bundle(&args.bundle, &args.remote, args.expect_id.as_deref())?;
    crate::timing("mount: bundle opened and checked");
    // checked before anything is locked or attached: a trace for another image is refused
    let prefetch = prefetch_trace(&args, &bundle)?;
    let mode = match (&args.rw, args.ephemeral) {
        (Some(_), _) => "rw",
        (None, true) => "ephemeral",
        (None, false) => "ro",
    };

    let id = state::mount_id(&mountpoint);
    let dir = state::mounts_dir().join(&id);
    let _mlock = state::lock(&MountState::lock_path(&id), Some(&dir))?;
    ensure!(
        !mnt::is_mountpoint(&mountpoint)?,
        "{}: already a mount point",
        mountpoint.display()
    );
    if dir.exists() {
        // left over from a crashed mount or a killed umount: the mount point is not mounted
        eprintln!("ublkd: cleaning up stale state {}", dir.display());
        match MountState::load(&dir) {
            Ok(old) if !old.bundle_key.is_empty() => teardown_mount(&old, false)?,
            _ => std::fs::remove_dir_all(&dir).with_context(|| format!("{}: remove", dir.display()))?,
        }
    }

    let key = state::bundle_key(&bundle.image_id);
    let _block = state::lock(&BundleState::lock_path(&key), Some(&BundleState::dir_of(&key)))?;
    let mut b = BundleState::load(&key).unwrap_or_else(|| BundleState {
        key: key.clone(),
        bundle: location.clone(),
        image_id: bundle.image_id.clone(),
        name: bundle.manifest.name.clone(),
        fsid: bundle.manifest.fsid.clone(),
        created: state::now(),
        ..Default::default()
    });
    if b.server.as_ref().is_none_or(|s| !state::server_alive(s)) {
        // a new server serves from where this mount found the image
        b.bundle = location.clone();
        b.serve_args = match remote::Location::parse(&location)? {
            remote::Location::Local(_) => Vec::new(),
            _ => args.remote.to_args(),
        };
    }
    let running = b.server.as_ref().filter(|s| state::server_alive(s));
    let (kind, why) = match running {
        Some(s) if s.frontend == "ublk" => (Kind::Ublk, format!("ublk (the bundle's server, pid {})", s.pid)),
        Some(s) => (Kind::Fuse, format!("fuse (the bundle's server, pid {})", s.pid)),
        None => frontend::choose(args.frontend)?,
    };
    let (dev2_cache, cache_why) = match (args.dev2_cache, running) {
        (Some(c), _) => (c, "requested"),
        (None, Some(s)) => (s.fuse_dev2_cache(), "the bundle's server"),
        (None, None) => {
            let l = remote::Location::parse(&location)?;
            let why = match l {
                remote::Location::Local(_) => "default for a local bundle",
                _ => "default for a remote bundle",
            };
            (Dev2Cache::default_for(&l), why)
        }
    };
    match kind {
        Kind::Fuse => eprintln!(
            "ublkd: frontend {why}, --dev2-cache {} ({cache_why})",
            dev2_cache.as_str()
        ),
        _ => eprintln!("ublkd: frontend {why}"),
    }

    let mut rb = Rollback(Vec::new());
    {
        let key = key.clone();
        rb.push("release the bundle", move || gc_bundle(&key));
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: mkdir", dir.display()))?;
    {
        let dir = dir.clone();
        rb.push("remove state dir", move || Ok(std::fs::remove_dir_all(&dir)?));
    }
    let mut st = MountState {
        id: id.clone(),
        mountpoint: mountpoint.display().to_string(),
        bundle: location.clone(),
        image_id: bundle.image_id.clone(),
        name: bundle.manifest.name.clone(),
        fsid: bundle.manifest.fsid.clone(),
        rw_path: None,
        phase: "mounting".into(),
        mode: mode.into(),
        bundle_key: key.clone(),
        created: state::now(),
        ..Default::default()
    };
    st.save()?;

    crate::timing("mount: locked, state saved");
    // a new instance of the image's devices needs meta.img on a loop device: attached
    // while the server starts
    let meta_loop = match (mode, &b.shared) {
        ("ro" | "ephemeral", Some(sh)) if shared_is_up(sh)? => None,
        _ => Some(MetaLoop::start(&bundle)?),
    };
    // 1. the bundle's server (shared by all its mounts)
    let had_server = b.server.as_ref().is_some_and(state::server_alive);
    let srv = ensure_server(
        &mut b,
        args.frontend,
        kind,
        args.cache_mb,
        (dev2_cache, args.dev2_cache.is_some()),
        args.poll.ublk_poll,
        &id,
    )?;
    let _same_fsid = claim_fsid(&b)?;
    crate::timing("mount: server ready");

    let mp = mountpoint.clone();
    let note = match mode {
        "ro" => {
            let shared = ensure_shared(&mut b, &bundle, &srv, meta_loop)?;
            mnt::bind_ro(&shared, &mountpoint)?;
            rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
            format!(" (bind of {})", shared.display())
        }
        "ephemeral" => {
            let shared = ensure_shared(&mut b, &bundle, &srv, meta_loop)?;
            let (upper, work) = (dir.join("upper"), dir.join("work"));
            for d in [&upper, &work] {
                std::fs::create_dir(d).with_context(|| format!("{}: mkdir", d.display()))?;
            }
            mnt::overlay(&format!("ublkd-{key}"), &shared, &upper, &work, &mountpoint)?;
            rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
            format!(" (overlay over {}, upper {})", shared.display(), upper.display())
        }
        _ => {
            sprout_shared(&mut b)?;
            mount_rw(&args, &bundle, &srv, meta_loop, &mut st, &mut rb)?
        }
    };
    crate::timing("mount: mounted");
    st.phase = "mounted".into();
    st.save()?;
    rb.disarm();
    crate::timing("mount: state saved");
    // the bundle's trace is applied by the mount that starts the server; an explicit
    // --prefetch by any mount
    let pf_note = match prefetch {
        Some((whence, t)) if args.prefetch.is_some() || !had_server => match request_prefetch(&b, &srv, &t) {
            Ok(()) => format!(
                "; prefetching {} chunks ({} trace {whence}) in the background",
                t.chunks.len(),
                t.source
            ),
            Err(e) => {
                eprintln!("ublkd: warning: prefetch {whence} not started: {e:#}");
                String::new()
            }
        },
        _ => String::new(),
    };
    println!(
        "mounted {} ({}) at {}: {}{}, frontend {}, server pid {} in {:.0} ms{pf_note}",
        location,
        bundle.image_id,
        mountpoint.display(),
        st.mode,
        note,
        kind.as_str(),
        srv.pid,
        t0.elapsed().as_secs_f64() * 1000.0
    );
    Ok(())
}

/// The trace `mount` applies: `--prefetch`, else the bundle's prefetch.trace (unless
/// `--no-prefetch`), checked against the bundle (image id, chunk size, chunk indices).
fn prefetch_trace(args: &MountArgs, bundle: &Bundle) -> Result<Option<(String, Trace)>> {
    let path = match (&args.prefetch, args.no_prefetch) {
        (Some(p), _) => p.clone(),
        (None, true) => return Ok(None),
        (None, false) => {
            let p = bundle.dir.join(trace::FILE_NAME);
            if !p.exists() {
                return Ok(None);
            }
            p
        }
    };
    let whence = path.display().to_string();
    let t = Trace::read(&path)?;
    t.check_for(&bundle.image_id, &bundle.blockmap, &whence)?;
    Ok(Some((whence, t)))
}

/// Hand a trace to the bundle's server: written into its directory, then SIGUSR1.
fn request_prefetch(b: &BundleState, srv: &ServerRecord, t: &Trace) -> Result<()> {
    ensure!(state::server_alive(srv), "the server (pid {}) is not running", srv.pid);
    t.write(&b.dir().join(trace::FILE_NAME))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(srv.pid), nix::sys::signal::Signal::SIGUSR1)
        .with_context(|| format!("signal the server (pid {})", srv.pid))?;
    Ok(())
}

/// `ublkd record MNT -o TRACE`: ask the mount's server for its access trace (SIGUSR2:
/// it writes access.trace in its directory), wait for the new file, copy it to `out`.
pub fn record(mountpoint: &Path, out: &Path) -> Result<()> {
    let (st, _l) = lock_mount(mountpoint)?;
    let b = BundleState::load(&st.bundle_key).context("no bundle state")?;
    let srv = b.server.clone().context("no server recorded")?;
    ensure!(
        state::server_alive(&srv),
        "{}: the server (pid {}) is not running",
        st.mountpoint,
        srv.pid
    );
    let path = b.dir().join(trace::ACCESS_FILE);
    let ino = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
    };
    let before = ino(&path);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(srv.pid), nix::sys::signal::Signal::SIGUSR2)
        .with_context(|| format!("signal the server (pid {})", srv.pid))?;
    // the server writes a new file and renames it: a new inode
    let t0 = Instant::now();
    while ino(&path).is_none() || ino(&path) == before {
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "the server (pid {}) wrote no {} within 10 s; its log ({}):\n{}",
            srv.pid,
            path.display(),
            b.dir().join("server.log").display(),
            server_log_tail(&b.dir())
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let t = Trace::read(&path)?;
    ensure!(
        t.image_id == b.image_id,
        "{}: image id {} differs from the mount's {}",
        path.display(),
        t.image_id,
        b.image_id
    );
    t.write(out).with_context(|| format!("write {}", out.display()))?;
    println!(
        "recorded {} chunks ({} MiB) of {} ({}) to {}",
        t.chunks.len(),
        (t.chunks.len() as u64 * t.chunk_size) >> 20,
        st.mountpoint,
        b.image_id,
        out.display()
    );
    Ok(())
}

/// `--rw`: own device instances (meta.img, device 2, the rw file), native btrfs sprout.
fn mount_rw(
    args: &MountArgs,
    bundle: &Bundle,
    srv: &ServerRecord,
    meta_loop: Option<MetaLoop>,
    st: &mut MountState,
    rb: &mut Rollback,
) -> Result<String> {
    let rw = args.rw.as_ref().expect("rw mode");
    let mountpoint = PathBuf::from(&st.mountpoint);
    let mut holds: Vec<File> = Vec::new(); // loop fds kept open until the fs holds the devices
    let d2 = attach_dev2_instance(srv, &st.dir())?;
    let rec = loop_record(&d2);
    st.dev2_loop = Some(rec.clone());
    st.save()?;
    rb.push(format!("detach {}", rec.path), move || detach_record(&rec));
    let dev2 = d2.path.clone();
    holds.push(d2.file);

    let m = MetaLoop::get_or_attach(meta_loop, bundle)?;
    let rec = loop_record(&m);
    st.meta_loop = Some(rec.clone());
    st.save()?;
    rb.push(format!("detach {}", rec.path), move || detach_record(&rec));
    let meta_dev = m.path.clone();
    holds.push(m.file);

    scan_seed(&[&meta_dev, &dev2], bundle)?;
    {
        let (a, b) = (meta_dev.clone(), dev2.clone());
        rb.push("btrfs device forget", move || {
            let _ = btrfs::forget(&a);
            let _ = btrfs::forget(&b);
            Ok(())
        });
    }

    let mp = mountpoint.clone();
    let (rwf, created) = open_rw_file(rw, args.rw_size)?;
    let rw_abs = rw.canonicalize().unwrap_or_else(|_| rw.clone());
    if created {
        let rw2 = rw_abs.clone();
        rb.push(format!("remove new {}", rw2.display()), move || {
            Ok(std::fs::remove_file(&rw2)?)
        });
    }
    let existing = btrfs::read_super_fsid(&rwf).with_context(|| format!("--rw {}", rw.display()))?;
    if let Some(fsid) = existing {
        ensure!(
            btrfs::uuid_string(&fsid) != bundle.manifest.fsid,
            "--rw {}: holds a btrfs with the image's own fsid, not a sprout",
            rw.display()
        );
    } else {
        ensure!(
            created || all_zero_head(&rwf)?,
            "--rw {}: exists and holds neither a btrfs sprout nor zeros; refusing to overwrite it",
            rw.display()
        );
    }
    let l = loopdev::attach(
        &rwf,
        &rw_abs,
        &loopdev::AttachOptions {
            read_only: false,
            ..RO_OPTS
        },
    )?;
    let rec = loop_record(&l);
    st.rw_loop = Some(rec.clone());
    st.rw_path = Some(rw_abs.display().to_string());
    st.save()?;
    rb.push(format!("detach {}", rec.path), move || detach_record(&rec));
    let rw_dev = l.path.clone();
    holds.push(l.file);
    {
        let d = rw_dev.clone();
        rb.push("btrfs device forget rw", move || {
            let _ = btrfs::forget(&d);
            Ok(())
        });
    }
    let note = if existing.is_some() {
        btrfs::scan(&rw_dev)?;
        // The seeds are registered by the scans above; naming them in device= would
        // make kernels before 6.17 open them for writing in a rw mount, and they are
        // read-only devices: EACCES (seen on 6.12).
        mnt::mount_btrfs(&rw_dev, &mountpoint, &[&rw_dev], false, "").with_context(|| {
            format!(
                "--rw {}: it holds a btrfs (fsid {}) that does not mount as a sprout of this image \
                     (a sprout of another image? see dmesg)",
                rw.display(),
                btrfs::uuid_string(&existing.unwrap_or_default())
            )
        })?;
        rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
        check_seed_is_ours(&mountpoint, bundle).with_context(|| format!("--rw {}", rw.display()))?;
        " (existing sprout)"
    } else {
        mnt::mount_btrfs(&meta_dev, &mountpoint, &[&meta_dev, &dev2], true, "")?;
        rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
        btrfs::add_device(&mountpoint, &rw_dev)?;
        mnt::remount_rw(&mountpoint)?;
        " (new sprout)"
    };
    drop(holds);
    Ok(format!(
        "{note}, devices {} {} {}",
        meta_dev.display(),
        dev2.display(),
        rw_dev.display()
    ))
}

/// After mounting an existing sprout: devid 1 and 2 must be this bundle's devices.
fn check_seed_is_ours(mountpoint: &Path, bundle: &Bundle) -> Result<()> {
    for d in &bundle.manifest.devices {
        let info = btrfs::dev_info(mountpoint, d.devid)?
            .ok_or_else(|| anyhow!("the mounted filesystem has no devid {}", d.devid))?;
        let uuid = btrfs::uuid_string(&info.uuid);
        ensure!(
            uuid.eq_ignore_ascii_case(&d.uuid),
            "devid {} has uuid {uuid}, this image's is {}: the sprout belongs to another image",
            d.devid,
            d.uuid
        );
    }
    Ok(())
}

/// Undo one mount (the caller holds its mount-point lock), then release its share of
/// the bundle. Idempotent: each step checks first.
fn teardown_mount(st: &MountState, lazy: bool) -> Result<()> {
    let key = st.bundle_key.clone();
    let _block = state::lock(&BundleState::lock_path(&key), Some(&BundleState::dir_of(&key)))?;
    if let Some(b) = BundleState::load(&key) {
        fail_dead_ublk(&b)?;
    }
    let mounted = mnt::mounts()?
        .into_iter()
        .any(|m| m.mount_point == st.mountpoint && (m.fstype == "btrfs" || m.fstype == "overlay"));
    if mounted {
        umount_busy_msg(&st.mountpoint, lazy)?;
    }
    forget_and_detach(&[&st.rw_loop, &st.meta_loop, &st.dev2_loop])?;
    std::fs::remove_dir_all(st.dir()).with_context(|| format!("{}: remove", st.dir().display()))?;
    gc_bundle(&key)
}

fn find_state(mountpoint: &Path) -> Result<MountState> {
    let canon = mountpoint.canonicalize().unwrap_or_else(|_| mountpoint.to_path_buf());
    let dir = state::mounts_dir().join(state::mount_id(&canon));
    if let Ok(s) = MountState::load(&dir) {
        return Ok(s);
    }
    let want = canon.display().to_string();
    MountState::all()?
        .into_iter()
        .find(|s| s.mountpoint == want || s.mountpoint == mountpoint.display().to_string())
        .ok_or_else(|| {
            anyhow!(
                "{}: not mounted by ublkd (no state under {})",
                mountpoint.display(),
                state::mounts_dir().display()
            )
        })
}

/// Find a mount's state and lock its mount point; the state is read again under the lock.
fn lock_mount(mountpoint: &Path) -> Result<(MountState, state::Lock)> {
    let st = find_state(mountpoint)?;
    let l = state::lock(&MountState::lock_path(&st.id), Some(&st.dir()))?;
    let st = MountState::load(&st.dir())
        .map_err(|_| anyhow!("{}: unmounted meanwhile by another ublkd", mountpoint.display()))?;
    Ok((st, l))
}

pub fn umount(mountpoint: &Path, lazy: bool) -> Result<()> {
    let (st, _l) = lock_mount(mountpoint)?;
    ensure!(
        !st.bundle_key.is_empty(),
        "{}: state from an older ublkd",
        st.mountpoint
    );
    teardown_mount(&st, lazy)?;
    println!("unmounted {}", st.mountpoint);
    Ok(())
}

/// Start a new server for a bundle whose server died, and reattach every device-2
/// instance without unmounting: ublk through USER_RECOVERY, fuse by swapping each
/// loop device's backing file (LOOP_CHANGE_FD, allowed on read-only loop devices).
pub fn recover(mountpoint: &Path) -> Result<()> {
    let (st, _l) = lock_mount(mountpoint)?;
    let key = st.bundle_key.clone();
    let _block = state::lock(&BundleState::lock_path(&key), Some(&BundleState::dir_of(&key)))?;
    let mut b = BundleState::load(&key).context("no bundle state")?;
    let old = b.server.clone().context("no server recorded")?;
    ensure!(
        !state::server_alive(&old),
        "server pid {} is alive: nothing to recover",
        old.pid
    );
    // the new server gets the old one's chunk cache size
    let cache_mb = old.cache_mb.unwrap_or(DEFAULT_CACHE_MB);
    match old.ublk_id {
        Some(id) => {
            frontend::ublk::begin_recovery(id)?;
            // the new server polls as the old one did
            let (_r, srv) = spawn_server(
                &b,
                Kind::Ublk,
                cache_mb,
                Dev2Cache::Direct,
                old.ublk_poll_mode(),
                Some(id),
            )?;
            b.server = Some(srv);
        }
        None => {
            // the new server caches `dev2` as the old one did: the loop devices keep
            // their direct-I/O flag across LOOP_CHANGE_FD
            let mut loops: Vec<LoopRecord> = b.shared.iter().filter_map(|s| s.dev2_loop.clone()).collect();
            loops.extend(mounts_of(&key)?.into_iter().filter_map(|m| m.dev2_loop));
            let cache = match old.dev2_cache {
                Some(c) => c,
                // a record from before the choice: the loop devices tell
                None if loops.iter().any(|l| !l.direct_io) => Dev2Cache::Page,
                None => Dev2Cache::Direct,
            };
            let (r, srv) = spawn_server(&b, Kind::Fuse, cache_mb, cache, PollMode::Off, None)?;
            let f = frontend::fuse::open_for_loop(&r.device, cache)?;
            for l in &loops {
                if let Err(e) = loopdev::change_fd(l.number, &f) {
                    let _ = stop_server(&srv);
                    return Err(e).with_context(|| format!("reattach {}", l.path));
                }
            }
            b.server = Some(srv);
        }
    }
    b.save()?;
    println!(
        "recovered {} (bundle {}): server pid {}",
        st.mountpoint,
        b.bundle,
        b.server.as_ref().unwrap().pid
    );
    Ok(())
}

#[derive(serde::Serialize)]
struct StatusEntry<'a> {
    mountpoint: &'a str,
    bundle: &'a str,
    bundle_key: &'a str,
    name: &'a str,
    image_id: &'a str,
    mode: &'a str,
    phase: &'a str,
    rw_path: &'a Option<String>,
    /// ephemeral: the overlay's upper directory
    upper: Option<String>,
    /// ro/ephemeral: the bundle's shared mount
    shared: Option<&'a str>,
    frontend: &'a str,
    mounted: bool,
    server_pid: Option<i32>,
    server_alive: bool,
    /// fuse: the server's `--dev2-cache` mode (page/direct)
    dev2_cache: Option<&'static str>,
    /// the server's `--cache-mb` (none for servers recorded before it was kept)
    cache_mb: Option<u64>,
    /// ublk: the server's `--ublk-poll` mode (auto, off, or a window in microseconds)
    ublk_poll: Option<PollMode>,
    devices: Vec<String>,
    /// the bundle server's counters (shared by every mount of the bundle)
    #[serde(flatten)]
    stats: Snapshot,
}

/// A fuse server's `dev2` mode for status; none for ublk (always direct I/O).
fn server_dev2_cache(s: &ServerRecord) -> Option<&'static str> {
    (s.frontend == Kind::Fuse.as_str()).then(|| s.fuse_dev2_cache().as_str())
}

fn loop_desc(kind: &str, r: &LoopRecord) -> String {
    format!("{kind}={}{}", r.path, if r.direct_io { " (dio)" } else { "" })
}

pub fn status(json: bool) -> Result<()> {
    let states = MountState::all()?;
    let bundles = BundleState::all();
    let mounts = mnt::mounts()?;
    let nobundle = BundleState::default();
    let mut entries = Vec::new();
    for st in &states {
        let b = bundles.iter().find(|b| b.key == st.bundle_key).unwrap_or(&nobundle);
        let stats: Snapshot = std::fs::read(b.dir().join("stats.json"))
            .ok()
            .and_then(|x| serde_json::from_slice(&x).ok())
            .unwrap_or_default();
        let server_dev = b.server.as_ref().map(|s| s.device.as_str()).unwrap_or("-");
        let shared = b.shared.as_ref().filter(|_| st.mode != "rw");
        let mut devices: Vec<String> = Vec::new();
        let (meta, dev2, rw) = match shared {
            Some(sh) => (&sh.meta_loop, &sh.dev2_loop, &sh.rw_loop),
            None => (&st.meta_loop, &st.dev2_loop, &st.rw_loop),
        };
        if let Some(r) = meta {
            devices.push(loop_desc("meta", r));
        }
        if let Some(r) = dev2 {
            devices.push(format!("{} on {server_dev}", loop_desc("dev2", r)));
        }
        if let Some(node) = shared.and_then(|sh| sh.dev2_node.as_ref()) {
            devices.push(format!("dev2={node}"));
        }
        if let Some(r) = rw {
            devices.push(loop_desc(if shared.is_some() { "scratch" } else { "rw" }, r));
        }
        entries.push(StatusEntry {
            mountpoint: &st.mountpoint,
            bundle: &st.bundle,
            bundle_key: &st.bundle_key,
            name: &st.name,
            image_id: &st.image_id,
            mode: &st.mode,
            phase: &st.phase,
            rw_path: &st.rw_path,
            upper: (st.mode == "ephemeral").then(|| st.dir().join("upper").display().to_string()),
            shared: shared.map(|s| s.path.as_str()),
            frontend: b.server.as_ref().map_or("", |s| s.frontend.as_str()),
            mounted: mounts
                .iter()
                .any(|m| m.mount_point == st.mountpoint && (m.fstype == "btrfs" || m.fstype == "overlay")),
            server_pid: b.server.as_ref().map(|s| s.pid),
            server_alive: b.server.as_ref().is_some_and(state::server_alive),
            dev2_cache: b.server.as_ref().and_then(server_dev2_cache),
            cache_mb: b.server.as_ref().and_then(|s| s.cache_mb),
            ublk_poll: b
                .server
                .as_ref()
                .filter(|s| s.ublk_id.is_some())
                .map(ServerRecord::ublk_poll_mode),
            devices,
            stats,
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    if entries.is_empty() && bundles.is_empty() {
        println!("no ublkd mounts");
    }
    // grouped by bundle: its server, counters and shared mount, then its mounts
    for b in &bundles {
        let mine: Vec<&StatusEntry> = entries.iter().filter(|e| e.bundle_key == b.key).collect();
        println!("bundle {} [{}]", b.bundle, b.name);
        println!("  image    {}", b.image_id);
        match &b.server {
            Some(s) => println!(
                "  server   {} pid {} ({}), device {}{}{}{}",
                s.frontend,
                s.pid,
                if state::server_alive(s) {
                    "running"
                } else {
                    "NOT RUNNING"
                },
                s.device,
                server_dev2_cache(s).map_or(String::new(), |c| format!(", dev2-cache {c}")),
                s.cache_mb.map_or(String::new(), |m| format!(", chunk cache {m} MiB")),
                s.ublk_id
                    .map_or(String::new(), |_| format!(", --ublk-poll={}", s.ublk_poll_mode())),
            ),
            None => println!("  server   -"),
        }
        if let Some(sh) = &b.shared {
            let devs: Vec<String> = [
                ("meta", &sh.meta_loop),
                ("dev2", &sh.dev2_loop),
                ("scratch", &sh.rw_loop),
            ]
            .iter()
            .filter_map(|(k, r)| r.as_ref().map(|r| loop_desc(k, r)))
            .chain(sh.dev2_node.iter().map(|n| format!("dev2={n}")))
            .collect();
            println!("  shared   {} ({}) {}", sh.path, sh.phase, devs.join(" "));
        }
        if let Some(e) = mine.first() {
            println!(
                "  served   {} bytes in {} reads; {} chunks verified, {} verification failures, {} read errors, {} pack bytes read, {} cache hits",
                e.stats.bytes_served, e.stats.reads, e.stats.chunks_verified, e.stats.verify_failures, e.stats.read_errors, e.stats.pack_bytes_read, e.stats.cache_hits
            );
            if !b.serve_args.is_empty() {
                let s = &e.stats;
                println!(
                    "  fetched  {} bytes in {} requests ({} failed), latency mean {:.1} ms max {:.1} ms; \
                     chunk cache {} hits {} misses {} bad, {} bytes; {} chunks read ahead",
                    s.fetch_bytes,
                    s.fetch_requests,
                    s.fetch_errors,
                    s.fetch_latency_us_mean as f64 / 1000.0,
                    s.fetch_latency_us_max as f64 / 1000.0,
                    s.disk_cache_hits,
                    s.disk_cache_misses,
                    s.disk_cache_corrupt,
                    s.disk_cache_bytes,
                    s.readahead_chunks
                );
            }
            let s = &e.stats;
            println!("  demand   {} chunks loaded for device reads", s.demand_chunk_loads);
            if s.prefetch_total > 0 {
                println!(
                    "  prefetch {}/{} chunks done ({}), {} fetched ({} bytes), {} errors",
                    s.prefetch_done,
                    s.prefetch_total,
                    if s.prefetch_done < s.prefetch_total {
                        "running"
                    } else {
                        "finished"
                    },
                    s.prefetch_chunks,
                    s.prefetch_bytes,
                    s.prefetch_errors
                );
            }
        }
        println!("  mounts   {}", mine.len());
        for e in &mine {
            let what = match e.mode {
                "rw" => format!("rw {} [{}]", e.rw_path.as_deref().unwrap_or("-"), e.devices.join(" ")),
                "ephemeral" => format!("ephemeral, upper {}", e.upper.as_deref().unwrap_or("-")),
                m => m.to_string(),
            };
            println!(
                "    {} {} ({})",
                e.mountpoint,
                what,
                if e.mounted { "mounted" } else { e.phase }
            );
        }
    }
    for e in entries
        .iter()
        .filter(|e| !bundles.iter().any(|b| b.key == e.bundle_key))
    {
        println!("{} ({}, {}): no bundle state", e.mountpoint, e.mode, e.phase);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(super::parse_size("10G"), Ok(10 << 30));
        assert_eq!(super::parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(super::parse_size("4096"), Ok(4096));
        assert!(super::parse_size("1X").is_err());
    }
}
