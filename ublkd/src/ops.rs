//! `mount`, `umount`, `status`, `recover`: the plumbing sequence around a server, with
//! rollback of every step on failure.

use crate::bundle::Bundle;
use crate::frontend::{self, Kind};
use crate::plumbing::{btrfs, loopdev, mount as mnt};
use crate::server::Ready;
use crate::state::{self, LoopRecord, MountState, ServerRecord};
use crate::stats::Snapshot;
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct MountArgs {
    /// Bundle directory (manifest.json, meta.img, blockmap, packs/).
    pub bundle: PathBuf,
    /// Where to mount the image.
    pub mountpoint: PathBuf,
    /// Writable layer: a file that becomes the sprout's rw device (created sparse if missing;
    /// if it already holds this image's sprout, that filesystem is mounted again).
    #[arg(long)]
    pub rw: Option<PathBuf>,
    /// Size of a new --rw file (K, M, G, T suffixes).
    #[arg(long, default_value = "10G", value_parser = parse_size)]
    pub rw_size: u64,
    #[arg(long, value_enum, default_value = "auto")]
    pub frontend: Kind,
    /// Refuse to mount unless the image id (sha256 of manifest.json) is this.
    #[arg(long)]
    pub expect_id: Option<String>,
    /// Memory for the server's verified chunk cache, in MiB.
    #[arg(long, default_value_t = 256)]
    pub cache_mb: u64,
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

/// Start `ublkd serve` in the background (own session, log in `dir/server.log`) and wait
/// for its READY line.
fn spawn_server(
    bundle: &Path,
    kind: Kind,
    dir: &Path,
    image_id: &str,
    cache_mb: u64,
    recover: Option<i32>,
) -> Result<(Ready, ServerRecord)> {
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
        .args(["--cache-mb", &cache_mb.to_string()]);
    if let Some(id) = recover {
        cmd.args(["--ublk-recover", &id.to_string()]);
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
    let bundle = Bundle::open(&args.bundle, args.expect_id.as_deref(), true)?;
    let (kind, why) = frontend::choose(args.frontend)?;
    eprintln!("ublkd: frontend {why}");

    let _global = state::global_lock()?;
    ensure!(
        !mnt::is_mountpoint(&mountpoint)?,
        "{}: already a mount point",
        mountpoint.display()
    );
    let id = state::mount_id(&mountpoint);
    let dir = state::mounts_dir().join(&id);
    if dir.exists() {
        // left over from a crashed mount or a killed umount: the mount point is not mounted
        eprintln!("ublkd: cleaning up stale state {}", dir.display());
        if let Ok(old) = MountState::load(&dir) {
            teardown(&old, false)?;
        } else {
            std::fs::remove_dir_all(&dir).with_context(|| format!("{}: remove", dir.display()))?;
        }
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: mkdir", dir.display()))?;
    let _lock = state::lock(&dir.join("lock"))?;
    let mut rb = Rollback(Vec::new());
    {
        let dir = dir.clone();
        rb.push("remove state dir", move || Ok(std::fs::remove_dir_all(&dir)?));
    }
    let mut st = MountState {
        id: id.clone(),
        mountpoint: mountpoint.display().to_string(),
        bundle: bundle.dir.display().to_string(),
        image_id: bundle.image_id.clone(),
        name: bundle.manifest.name.clone(),
        fsid: bundle.manifest.fsid.clone(),
        rw_path: None,
        phase: "mounting".into(),
        mode: if args.rw.is_some() { "rw".into() } else { "ro".into() },
        created: state::now(),
        ..Default::default()
    };
    st.save()?;

    // 1. the device-2 server
    let (ready, srv) = spawn_server(&bundle.dir, kind, &dir, &bundle.image_id, args.cache_mb, None)?;
    st.server = Some(srv.clone());
    st.save()?;
    {
        let srv = srv.clone();
        rb.push(format!("stop server {}", srv.pid), move || {
            stop_server(&srv)?;
            if let Some(id) = srv.ublk_id {
                if ublk_dev_exists(id) {
                    frontend::ublk::delete(id, false)?;
                }
            }
            Ok(())
        });
    }

    // 2. device 2 as a block device
    let mut holds: Vec<File> = Vec::new(); // loop fds kept open until the fs holds the devices
    let dev2: PathBuf = match kind {
        Kind::Fuse => {
            let f =
                File::open(&ready.device).with_context(|| format!("open the server's device file {}", ready.device))?;
            let l = loopdev::attach(
                &f,
                // lo_file_name = the state dir: tells whose device-2 loop this is
                // (the kernel reports every FUSE dev2 file as "/dev2")
                &dir,
                &loopdev::AttachOptions {
                    read_only: true,
                    direct_io: true,
                    block_size: 4096,
                    autoclear: true,
                },
            )?;
            if !l.direct_io {
                eprintln!(
                    "ublkd: warning: {} on the FUSE file runs without direct I/O",
                    l.path.display()
                );
            }
            let rec = loop_record(&l);
            st.dev2_loop = Some(rec.clone());
            st.save()?;
            rb.push(format!("detach {}", rec.path), move || detach_record(&rec));
            let p = l.path.clone();
            holds.push(l.file);
            p
        }
        _ => PathBuf::from(&ready.device),
    };

    // 3. meta.img, read-only
    let meta_path = bundle.meta_path();
    let meta = File::open(&meta_path).with_context(|| format!("{}: open", meta_path.display()))?;
    let l = loopdev::attach(
        &meta,
        &meta_path,
        &loopdev::AttachOptions {
            read_only: true,
            direct_io: true,
            block_size: 4096,
            autoclear: true,
        },
    )?;
    let rec = loop_record(&l);
    st.meta_loop = Some(rec.clone());
    st.save()?;
    rb.push(format!("detach {}", rec.path), move || detach_record(&rec));
    let meta_dev = l.path.clone();
    holds.push(l.file);

    // 4. register both with btrfs
    for d in [&meta_dev, &dev2] {
        btrfs::scan(d).map_err(|e| {
            if e.root_cause()
                .downcast_ref::<std::io::Error>()
                .and_then(|e| e.raw_os_error())
                == Some(libc::EEXIST)
            {
                e.context(format!(
                    "image {} (fsid {}) already has an unsprouted mount on other devices; the kernel allows one \
                     unsprouted mount per image at a time: mount this one with --rw, or unmount the other",
                    bundle.image_id, bundle.manifest.fsid
                ))
            } else {
                e
            }
        })?;
    }
    {
        let (a, b) = (meta_dev.clone(), dev2.clone());
        rb.push("btrfs device forget", move || {
            let _ = btrfs::forget(&a);
            let _ = btrfs::forget(&b);
            Ok(())
        });
    }

    // 5. mount (and sprout)
    let mp = mountpoint.clone();
    let mut sprout_note = String::new();
    match &args.rw {
        None => {
            mnt::mount_btrfs(&meta_dev, &mountpoint, &[&meta_dev, &dev2], true, "")?;
            rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
        }
        Some(rw) => {
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
                    direct_io: true,
                    block_size: 4096,
                    autoclear: true,
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
            if existing.is_some() {
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
                check_seed_is_ours(&mountpoint, &bundle).with_context(|| format!("--rw {}", rw.display()))?;
                sprout_note = " (existing sprout)".into();
            } else {
                mnt::mount_btrfs(&meta_dev, &mountpoint, &[&meta_dev, &dev2], true, "")?;
                rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
                btrfs::add_device(&mountpoint, &rw_dev)?;
                mnt::remount_rw(&mountpoint)?;
                sprout_note = " (new sprout)".into();
            }
        }
    }
    st.phase = "mounted".into();
    st.save()?;
    rb.disarm();
    drop(holds);
    println!(
        "mounted {} ({}) at {}: {}{}, frontend {}, devices {} {}{} in {:.0} ms",
        bundle.dir.display(),
        bundle.image_id,
        mountpoint.display(),
        st.mode,
        sprout_note,
        kind.as_str(),
        meta_dev.display(),
        dev2.display(),
        st.rw_loop.as_ref().map(|r| format!(" {}", r.path)).unwrap_or_default(),
        t0.elapsed().as_secs_f64() * 1000.0
    );
    Ok(())
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

/// Undo everything a mount set up, in order. Idempotent: each step checks first.
fn teardown(st: &MountState, lazy: bool) -> Result<()> {
    let mountpoint = Path::new(&st.mountpoint);
    let server_alive = st.server.as_ref().is_some_and(state::server_alive);
    // a dead ublk server leaves I/O queued (USER_RECOVERY): delete the device first so
    // that the unmount below sees errors instead of waiting forever
    if let Some(srv) = &st.server {
        if let (Some(id), false) = (srv.ublk_id, server_alive) {
            if ublk_dev_exists(id) {
                frontend::ublk::delete(id, true)?;
            }
        }
    }
    let ours: Vec<String> = [&st.meta_loop, &st.rw_loop]
        .iter()
        .filter_map(|r| r.as_ref().map(|r| r.path.clone()))
        .collect();
    let mounted = mnt::mounts()?
        .into_iter()
        .any(|m| m.mount_point == st.mountpoint && m.fstype == "btrfs" && ours.contains(&m.source));
    if mounted {
        match mnt::umount(mountpoint, lazy) {
            Ok(()) => {}
            Err(nix::errno::Errno::EBUSY) => bail!(
                "umount {}: target is busy (close files under it, or use --lazy)",
                st.mountpoint
            ),
            Err(e) => return Err(e).with_context(|| format!("umount {}", st.mountpoint)),
        }
    }
    for r in [&st.rw_loop, &st.meta_loop, &st.dev2_loop].into_iter().flatten() {
        let _ = btrfs::forget(Path::new(&r.path));
    }
    if let Some(srv) = &st.server {
        if srv.ublk_id.is_none() {
            // fuse: detach device 2's loop before stopping the server (no EIO on the way out)
        }
    }
    for r in [&st.rw_loop, &st.meta_loop, &st.dev2_loop].into_iter().flatten() {
        detach_record(r).with_context(|| format!("detach {}", r.path))?;
    }
    if let Some(srv) = &st.server {
        stop_server(srv)?;
        if let Some(id) = srv.ublk_id {
            if ublk_dev_exists(id) {
                let _ = frontend::ublk::delete(id, false);
            }
        }
    }
    std::fs::remove_dir_all(st.dir()).with_context(|| format!("{}: remove", st.dir().display()))?;
    Ok(())
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

pub fn umount(mountpoint: &Path, lazy: bool) -> Result<()> {
    let _global = state::global_lock()?;
    let st = find_state(mountpoint)?;
    let _lock = state::lock(&st.dir().join("lock"))?;
    teardown(&st, lazy)?;
    println!("unmounted {}", st.mountpoint);
    Ok(())
}

/// Start a new server for a mount whose server died, and reattach device 2 without
/// unmounting: ublk through USER_RECOVERY, fuse by swapping the loop device's backing
/// file (LOOP_CHANGE_FD, allowed on read-only loop devices).
pub fn recover(mountpoint: &Path) -> Result<()> {
    let _global = state::global_lock()?;
    let mut st = find_state(mountpoint)?;
    let _lock = state::lock(&st.dir().join("lock"))?;
    let old = st.server.clone().context("no server recorded")?;
    ensure!(
        !state::server_alive(&old),
        "server pid {} is alive: nothing to recover",
        old.pid
    );
    let dir = st.dir();
    match old.ublk_id {
        Some(id) => {
            frontend::ublk::begin_recovery(id)?;
            let (_r, srv) = spawn_server(Path::new(&st.bundle), Kind::Ublk, &dir, &st.image_id, 256, Some(id))?;
            st.server = Some(srv);
        }
        None => {
            let l = st.dev2_loop.clone().context("no device-2 loop recorded")?;
            let (r, srv) = spawn_server(Path::new(&st.bundle), Kind::Fuse, &dir, &st.image_id, 256, None)?;
            let f = File::open(&r.device).with_context(|| format!("open {}", r.device))?;
            if let Err(e) = loopdev::change_fd(l.number, &f) {
                let _ = stop_server(&srv);
                return Err(e);
            }
            st.dev2_loop = Some(LoopRecord {
                backing: loopdev::backing_file(l.number).unwrap_or_default(),
                ..l
            });
            st.server = Some(srv);
        }
    }
    st.save()?;
    println!(
        "recovered {}: server pid {}",
        st.mountpoint,
        st.server.as_ref().unwrap().pid
    );
    Ok(())
}

#[derive(serde::Serialize)]
struct StatusEntry<'a> {
    mountpoint: &'a str,
    bundle: &'a str,
    name: &'a str,
    image_id: &'a str,
    mode: &'a str,
    phase: &'a str,
    rw_path: &'a Option<String>,
    frontend: &'a str,
    mounted: bool,
    server_pid: Option<i32>,
    server_alive: bool,
    devices: Vec<String>,
    #[serde(flatten)]
    stats: Snapshot,
}

pub fn status(json: bool) -> Result<()> {
    let states = MountState::all()?;
    let mounts = mnt::mounts()?;
    let mut entries = Vec::new();
    for st in &states {
        let stats: Snapshot = std::fs::read(st.dir().join("stats.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let mut devices: Vec<String> = Vec::new();
        if let Some(r) = &st.meta_loop {
            devices.push(format!("meta={}", r.path));
        }
        if let Some(s) = &st.server {
            match &st.dev2_loop {
                Some(r) => devices.push(format!(
                    "dev2={} (fuse{})",
                    r.path,
                    if r.direct_io { ", dio" } else { "" }
                )),
                None => devices.push(format!("dev2={}", s.device)),
            }
        }
        if let Some(r) = &st.rw_loop {
            devices.push(format!("rw={}", r.path));
        }
        entries.push(StatusEntry {
            mountpoint: &st.mountpoint,
            bundle: &st.bundle,
            name: &st.name,
            image_id: &st.image_id,
            mode: &st.mode,
            phase: &st.phase,
            rw_path: &st.rw_path,
            frontend: st.server.as_ref().map_or("", |s| s.frontend.as_str()),
            mounted: mounts
                .iter()
                .any(|m| m.mount_point == st.mountpoint && m.fstype == "btrfs"),
            server_pid: st.server.as_ref().map(|s| s.pid),
            server_alive: st.server.as_ref().is_some_and(state::server_alive),
            devices,
            stats,
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    if entries.is_empty() {
        println!("no ublkd mounts");
    }
    for e in &entries {
        println!(
            "{} ({}, {})",
            e.mountpoint,
            e.mode,
            if e.mounted { "mounted" } else { e.phase }
        );
        println!("  bundle   {} [{}]", e.bundle, e.name);
        println!("  image    {}", e.image_id);
        println!(
            "  server   {} pid {} ({})",
            e.frontend,
            e.server_pid.map_or("-".into(), |p| p.to_string()),
            if e.server_alive { "running" } else { "NOT RUNNING" }
        );
        println!("  devices  {}", e.devices.join(" "));
        println!(
            "  served   {} bytes in {} reads; {} chunks verified, {} verification failures, {} read errors, {} pack bytes read",
            e.stats.bytes_served, e.stats.reads, e.stats.chunks_verified, e.stats.verify_failures, e.stats.read_errors, e.stats.pack_bytes_read
        );
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
