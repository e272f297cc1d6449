//! `ublkd mount`: check the bundle, lock, start or join its server, mount (ro, ephemeral
//! or rw), with rollback of every step on failure.

use super::devices::{
    all_zero_head, attach_dev2_instance, detach_record, loop_record, open_rw_file, scan_seed, MetaLoop, RO_OPTS,
};
use super::rollback::Rollback;
use super::servers::{ensure_server, request_prefetch};
use super::shared::{claim_fsid, ensure_shared, gc_bundle, shared_is_up, sprout_shared};
use super::umount::teardown_mount;
use crate::args::MountArgs;
use crate::format::trace::{self, Trace};
use crate::frontend;
use crate::plumbing::{btrfs, loopdev, mount as mnt};
use crate::state::{self, BundleState, MountState, ServerRecord};
use crate::store::local::{self, Bundle};
use crate::store::remote;
use crate::types::{Dev2Cache, Ephemeral, Frontend, Mode, Phase};
use crate::util::timing;
use crate::verify::policy::DockerRef;
use crate::verify::signature::Checker;
use crate::verify::structure;
use anyhow::{anyhow, ensure, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Open and check the bundle under the signature policy (docs/signatures.md): a local or
/// http(s) bundle is accepted or refused by its scope before it is read; an oci:// one's
/// manifest is checked as soon as it is fetched, before anything else of the image.
fn open_checked(args: &MountArgs) -> Result<(Bundle, String)> {
    let checker = Checker::load(
        args.policy.as_deref(),
        args.registries_d.as_deref(),
        args.remote.timeout(),
    )?;
    let Some(checker) = checker else {
        return remote::open_bundle(&args.bundle, &args.remote, args.expect_id.as_deref(), None);
    };
    match remote::Location::parse(&args.bundle)? {
        remote::Location::Local(d) => {
            checker.check_unsigned_location(&args.bundle, Some(&d.canonicalize().unwrap_or(d.clone())))?
        }
        remote::Location::Http(_) => checker.check_unsigned_location(&args.bundle, None)?,
        remote::Location::Oci(_) => {}
    }
    let check = |r: &remote::oci::Reference, manifest: &[u8]| -> Result<()> {
        timing("mount: manifest fetched, checking the signature policy");
        let reference = DockerRef::of_repository(&r.registry, &r.repo, &r.reference)?;
        checker.check_oci(&args.bundle, &reference, manifest)?;
        timing("mount: signature policy checked");
        Ok(())
    };
    remote::open_bundle(&args.bundle, &args.remote, args.expect_id.as_deref(), Some(&check))
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
    timing("mount: args parsed");
    let (bundle, location) = open_checked(&args)?;
    timing("mount: bundle opened and checked");
    // checked before anything is locked or attached: a trace for another image is refused
    let prefetch = prefetch_trace(&args, &bundle)?;
    let mode = match (&args.rw, args.ephemeral) {
        (Some(_), _) => Mode::Rw,
        (None, true) => Mode::Ephemeral,
        (None, false) => Mode::Ro,
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
        Some(s) if s.frontend == Frontend::Ublk => {
            (Frontend::Ublk, format!("ublk (the bundle's server, pid {})", s.pid))
        }
        Some(s) => (Frontend::Fuse, format!("fuse (the bundle's server, pid {})", s.pid)),
        None => frontend::choose(args.frontend)?,
    };
    let (dev2_cache, cache_why) = match (args.dev2_cache, running) {
        (Some(c), _) => (c, "requested"),
        (None, Some(s)) => (s.fuse_dev2_cache(), "the bundle's server"),
        (None, None) => {
            let remote = remote::Location::parse(&location)?.is_remote();
            let why = if remote {
                "default for a remote bundle"
            } else {
                "default for a local bundle"
            };
            (Dev2Cache::default_for(remote), why)
        }
    };
    match kind {
        Frontend::Fuse => eprintln!(
            "ublkd: frontend {why}, --dev2-cache {} ({cache_why})",
            dev2_cache.as_str()
        ),
        _ => eprintln!("ublkd: frontend {why}"),
    }

    let mut rb = Rollback::new();
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
        phase: Phase::Mounting,
        mode,
        bundle_key: key.clone(),
        created: state::now(),
        ..Default::default()
    };
    st.save()?;

    timing("mount: locked, state saved");
    // the structural check, before anything is attached: meta.img here, device 2's
    // superblock once the server serves it (below); skipped when a record says this image
    // passed it
    let (check, overlay_inexact) = structure_check_meta(&args, &bundle, &location)?;
    if mode == Mode::Ephemeral {
        // overlayfs when it shows the image exactly, else a sprout (never another tree)
        st.ephemeral = Some(match overlay_inexact {
            None => Ephemeral::Overlay,
            Some(why) => {
                eprintln!("ublkd: ephemeral mount as a btrfs sprout, not overlayfs: {why}");
                st.ephemeral_why = Some(why);
                Ephemeral::Sprout
            }
        });
        st.save()?;
    }
    // a new instance of the image's devices needs meta.img on a loop device: attached
    // while the server starts
    let meta_loop = match &b.shared {
        Some(sh) if st.uses_shared() && shared_is_up(sh)? => None,
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
        &args.ublk,
        &id,
    )?;
    timing("mount: server ready");
    if let Some(pending) = check {
        if let Err(e) = structure_check_dev2(pending, &bundle, &srv, &location) {
            // an attach under way: wait for it, its fd closes (AUTOCLEAR) before the
            // rollback releases the server
            if let Some(m) = meta_loop {
                let _ = m.get();
            }
            return Err(e);
        }
    }
    let _same_fsid = claim_fsid(&b)?;

    let mp = mountpoint.clone();
    let note = match mode {
        Mode::Ro => {
            let shared = ensure_shared(&mut b, &bundle, &srv, meta_loop)?;
            mnt::bind_ro(&shared, &mountpoint)?;
            rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
            format!(" (bind of {})", shared.display())
        }
        Mode::Ephemeral if st.ephemeral == Some(Ephemeral::Sprout) => {
            sprout_shared(&mut b)?;
            // in the state dir (under the run dir, tmpfs on most systems): umount removes it
            let rw = dir.join(EPHEMERAL_SPROUT_FILE);
            let note = mount_rw(&rw, args.rw_size, &bundle, &srv, meta_loop, &mut st, &mut rb)?;
            format!(" (btrfs sprout onto {}{note})", rw.display())
        }
        Mode::Ephemeral => {
            let shared = ensure_shared(&mut b, &bundle, &srv, meta_loop)?;
            let (upper, work) = (dir.join("upper"), dir.join("work"));
            for d in [&upper, &work] {
                std::fs::create_dir(d).with_context(|| format!("{}: mkdir", d.display()))?;
            }
            mnt::overlay(&format!("ublkd-{key}"), &shared, &upper, &work, &mountpoint)?;
            rb.push("umount", move || Ok(mnt::umount(&mp, false)?));
            format!(" (overlay over {}, upper {})", shared.display(), upper.display())
        }
        Mode::Rw => {
            sprout_shared(&mut b)?;
            let rw = args.rw.as_ref().expect("rw mode");
            mount_rw(rw, args.rw_size, &bundle, &srv, meta_loop, &mut st, &mut rb)?
        }
    };
    timing("mount: mounted");
    st.phase = Phase::Mounted;
    st.save()?;
    rb.disarm();
    timing("mount: state saved");
    // the bundle's trace is applied by the mount that starts the server; an explicit
    // --prefetch by any mount
    // a passthrough server copied device 2 whole before READY: nothing to prefetch
    let passthrough = srv.frontend == Frontend::Fuse && srv.fuse_dev2_cache() == Dev2Cache::Passthrough;
    let pf_note = match prefetch {
        Some(_) if passthrough => String::new(),
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

/// An ephemeral sprout's writable device: a file in the mount's state dir.
pub const EPHEMERAL_SPROUT_FILE: &str = "ephemeral-rw.img";

/// The check this ublkd runs, as its records name it.
fn check_id() -> String {
    format!(
        "ublkd {}, structure check {}, btrfs check --readonly",
        env!("CARGO_PKG_VERSION"),
        structure::CHECK_VERSION
    )
}

/// A meta.img that passed the check, waiting for device 2's superblock.
pub struct PendingCheck {
    summary: structure::MetaSummary,
    t0: Instant,
}

/// meta.img's part of the structural check, unless a record says this image id passed it
/// (and `--recheck` is not given): our own walk ([`structure::check_meta`]: bounded,
/// naming the tree, block and item; crafted bytes reach btrfs-progs' parser only once it
/// passed), then `btrfs check --readonly` on the checked open file. Also: why overlayfs would not show
/// the image exactly, if it would not (from the walk or the record).
fn structure_check_meta(
    args: &MountArgs,
    bundle: &Bundle,
    location: &str,
) -> Result<(Option<PendingCheck>, Option<String>)> {
    let id = check_id();
    if !args.recheck {
        if let Some(r) = local::structure_record(&bundle.image_id, &id) {
            eprintln!(
                "ublkd: structural check: passed before ({} ms, record {}), skipped",
                r.ms,
                local::structure_record_path(&bundle.image_id).display()
            );
            return Ok((None, r.overlay_inexact));
        }
    }
    let t0 = Instant::now();
    let meta = bundle.meta.as_ref().context("meta.img was not checked")?;
    let fail = |e: anyhow::Error| anyhow!("{location}: structural check: {e:#}");
    let fd_path = PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        std::os::fd::AsRawFd::as_raw_fd(meta)
    ));
    let m = &bundle.manifest;
    let summary = structure::check_meta(
        meta,
        &m.fsid,
        [&m.devices[0].uuid, &m.devices[1].uuid],
        &bundle.blockmap,
    )
    .map_err(fail)?;
    timing("mount: meta.img structure checked");
    structure::btrfs_check(&fd_path).map_err(fail)?;
    timing("mount: btrfs check passed");
    let inexact = summary.overlay.inexact();
    Ok((Some(PendingCheck { summary, t0 }), inexact))
}

/// Device 2's superblock, read through the bundle's server, against meta.img's; then the
/// record that this image passed.
fn structure_check_dev2(p: PendingCheck, bundle: &Bundle, srv: &ServerRecord, location: &str) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let fail = |e: anyhow::Error| anyhow!("{location}: structural check: {e:#}");
    let mut sb = vec![0u8; structure::SUPER_SIZE];
    File::open(&srv.device)
        .and_then(|f| f.read_exact_at(&mut sb, structure::SUPER_OFFSET))
        .with_context(|| format!("device 2 ({}): read the superblock", srv.device))
        .map_err(fail)?;
    structure::check_dev2_super(&sb, &p.summary, bundle.blockmap.device_size).map_err(fail)?;
    let ms = p.t0.elapsed().as_millis() as u64;
    eprintln!(
        "ublkd: structural check: passed in {ms} ms ({} tree blocks, {} file extents)",
        p.summary.tree_blocks, p.summary.extents
    );
    let rec = local::StructureRecord {
        check: check_id(),
        checked: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        ms,
        overlay_inexact: p.summary.overlay.inexact(),
    };
    if let Err(e) = local::write_structure_record(&bundle.image_id, &rec) {
        log::warn!("structural check record not written: {e:#}");
    }
    timing("mount: structural check passed");
    Ok(())
}

/// The trace `mount` applies: `--prefetch`, else the bundle's prefetch.trace (unless
/// `--no-prefetch`), checked against the bundle (image id, chunk size, chunk indices).
pub fn prefetch_trace(args: &MountArgs, bundle: &Bundle) -> Result<Option<(String, Trace)>> {
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

/// `--rw` and ephemeral sprouts: own device instances (meta.img, device 2, the rw file
/// `rw`, made `rw_size` bytes if new), native btrfs sprout.
pub fn mount_rw(
    rw: &Path,
    rw_size: u64,
    bundle: &Bundle,
    srv: &ServerRecord,
    meta_loop: Option<MetaLoop>,
    st: &mut MountState,
    rb: &mut Rollback,
) -> Result<String> {
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
    let (rwf, created) = open_rw_file(rw, rw_size)?;
    let rw_abs = rw.canonicalize().unwrap_or_else(|_| rw.to_path_buf());
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
pub fn check_seed_is_ours(mountpoint: &Path, bundle: &Bundle) -> Result<()> {
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
