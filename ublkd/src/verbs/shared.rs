//! A bundle's shared mount (see [`SharedMount`]): made by its first read-only or
//! ephemeral mount, sprouted when another instance of the image needs its fsid, and
//! released by reference counting by inspection ([`gc_bundle`]).

use super::devices::{
    attach_dev2_instance, forget_and_detach, loop_record, open_rw_file, scan_seed, umount_busy_msg, MetaLoop, RO_OPTS,
};
use super::mounts::{is_mounted, mounts_of};
use super::servers::{fail_dead_ublk, stop_server, ublk_dev_exists};
use crate::frontend;
use crate::plumbing::{btrfs, loopdev, mount as mnt};
use crate::state::{self, BundleState, MountState, ServerRecord, SharedMount};
use crate::store::local::Bundle;
use crate::types::Phase;
use crate::util::timing;
use anyhow::{Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Size of the scratch device the shared mount is sprouted onto (sparse; it only ever
/// receives the relocated SYSTEM chunk and a little metadata before going read-only).
pub const SHARED_SCRATCH_SIZE: u64 = 1 << 30;

pub fn teardown_shared(sh: &SharedMount) -> Result<()> {
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
pub fn gc_bundle(key: &str) -> Result<()> {
    let Some(mut b) = BundleState::load(key) else {
        let _ = std::fs::remove_dir_all(BundleState::dir_of(key));
        return Ok(());
    };
    let users = mounts_of(key)?;
    if let Some(sh) = b.shared.clone() {
        if !users.iter().any(MountState::uses_shared) {
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

/// Is this shared mount mounted and usable as it is?
pub fn shared_is_up(sh: &SharedMount) -> Result<bool> {
    Ok(sh.phase == Phase::Mounted && is_mounted(&sh.path)?)
}

/// The bundle's shared mount (see [`SharedMount`]): the existing one, or a new one.
pub fn ensure_shared(
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
        phase: Phase::Mounting,
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
        timing("shared: dev2 loop attached");
        sh.dev2_loop = Some(loop_record(&d2));
        holds.push(d2.file);
        d2.path
    };
    let m = MetaLoop::get_or_attach(meta_loop, bundle)?;
    sh.meta_loop = Some(loop_record(&m));
    save(b, &sh)?;
    let meta = m.path.clone();
    holds.push(m.file);
    timing("shared: loops attached");
    scan_seed(&[&meta, &dev2], bundle)?;
    timing("shared: scanned");
    mnt::mount_btrfs(&meta, &path, &[&meta, &dev2], true, "")?;
    timing("shared: mount(2) done");
    sh.phase = Phase::Mounted;
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
pub fn sprout_shared(b: &mut BundleState) -> Result<()> {
    let Some(mut sh) = b.shared.clone() else {
        return Ok(());
    };
    if sh.phase != Phase::Mounted || sh.rw_loop.is_some() {
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
pub fn claim_fsid(b: &BundleState) -> Result<Vec<state::Lock>> {
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
