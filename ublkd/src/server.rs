//! `ublkd serve`: the device-2 server. It opens and verifies the bundle, builds the
//! one [`Device2`] read path, starts a frontend on it, announces itself with one
//! `READY {json}` line on stdout, publishes counters to `<dir>/stats.json`, and runs
//! until SIGTERM/SIGINT (or until its frontend goes away).
//!
//! The serving core (`Device2`: blockmap, verified chunk cache, counters) does not
//! know how many device instances sit on it: a FUSE file can back any number of loop
//! devices, and more ublk devices could be added over the same `Arc<Device2>`.

use crate::args::ServeArgs;
use crate::device::{prefetch, Device2};
use crate::format::blockmap::Segment;
use crate::format::trace;
use crate::frontend;
use crate::plumbing::{btrfs, mount as mnt};
use crate::state::{PASSTHROUGH_FILE, STATS_FILE};
use crate::stats::Counters;
use crate::store::remote::{self, Opened};
use crate::types::{Dev2Cache, Frontend};
use crate::util::{timing, write_atomic};
use crate::verify::VerifiedChunks;
use anyhow::{bail, Context, Result};
use nix::sys::signal::{SigSet, Signal};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// The line `serve` prints once the device is live.
#[derive(Debug, Serialize, Deserialize)]
pub struct Ready {
    pub pid: i32,
    pub frontend: Frontend,
    /// The device-2 node: /dev/ublkbN, or /proc/<pid>/fd/<n> for the FUSE file.
    pub device: String,
    pub ublk_id: Option<i32>,
    pub image_id: String,
    /// fuse: how `dev2` is cached (the loop devices on it must match); ublk: none.
    #[serde(default)]
    pub dev2_cache: Option<Dev2Cache>,
    /// ublk: the device's hw queues, as the kernel made them; fuse: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_queues: Option<u16>,
}

/// The signals a server acts on (and its supervisor passes on): stop; SIGUSR1: start
/// the prefetch `mount` left in --dir; SIGUSR2: write the access trace.
pub const SIGNALS: [Signal; 5] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

enum Event {
    Signal(Signal),
    FrontendEnded(String),
    Ready(Ready),
    Failed(String),
}

pub fn announce(r: &Ready) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {}", serde_json::to_string(r)?)?;
    out.flush()?;
    // nobody reads stdout after this: point it at /dev/null so a closed pipe cannot hurt
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    nix::unistd::dup2(null.as_raw_fd(), 1)?;
    Ok(())
}

fn stats_writer(counters: Arc<Counters>, dir: PathBuf) {
    std::thread::Builder::new()
        .name("stats".into())
        .spawn(move || {
            let mut last = None;
            loop {
                let s = counters.snapshot();
                if last.as_ref() != Some(&s) {
                    if let Ok(b) = serde_json::to_vec(&s) {
                        let _ = write_atomic(&dir.join(STATS_FILE), &b);
                    }
                    last = Some(s);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
        .expect("spawn stats thread");
}

pub fn open_device(opened: Opened, counters: Arc<Counters>, cache_mb: u64) -> Arc<Device2> {
    let names = opened.bundle.manifest.packs.iter().map(|p| p.path.clone()).collect();
    let bm = opened.bundle.blockmap.clone();
    let chunks =
        VerifiedChunks::new(bm, opened.source, counters.clone(), cache_mb << 20, names).with_fetching(opened.fetching);
    Arc::new(Device2::new(chunks, counters))
}

pub fn serve(args: ServeArgs) -> Result<()> {
    let kind = match args.frontend {
        Frontend::Auto => frontend::choose(Frontend::Auto)?.0,
        k => k,
    };
    if kind == Frontend::Ublk {
        // before any thread exists: unshare(CLONE_NEWNS) fails in a threaded process
        isolate_mount_namespace()?;
    }
    // signals are taken synchronously by one thread; block them before any thread starts
    let mut set = SigSet::empty();
    for s in SIGNALS {
        set.add(s);
    }
    set.thread_block().context("block signals")?;
    // SAFETY: ignoring SIGPIPE is always sound.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };

    timing("serve: signals set up");
    let counters = Arc::new(Counters::default());
    if let (true, Some(dir)) = (args.resume_stats, &args.dir) {
        if let Some(s) = std::fs::read(dir.join(STATS_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
        {
            counters.resume(&s);
        }
    }
    let mut opened = remote::open_for_serving(&args.bundle, &args.remote, args.expect_id.as_deref(), counters.clone())?;
    let dev2_cache = match args.dev2_cache {
        Some(c) => c,
        None => Dev2Cache::default_for(remote::Location::parse(&opened.location)?.is_remote()),
    };
    if kind == Frontend::Fuse && dev2_cache == Dev2Cache::Page {
        frontend::fuse::tune_fetching(&mut opened.fetching);
    }
    timing("serve: bundle opened");
    let location = opened.location.clone();
    let bundle_ranges = opened.bundle.blockmap.ranges.len();
    let image_id = opened.bundle.image_id.clone();
    let dev = open_device(opened, counters.clone(), args.cache_mb);
    // a passthrough server copies every chunk (or, restarted, needs none)
    if !(kind == Frontend::Fuse && dev2_cache == Dev2Cache::Passthrough) {
        warm_superblock_chunk(&dev);
    }
    if let Some(dir) = &args.dir {
        std::fs::create_dir_all(dir).with_context(|| format!("{}: mkdir", dir.display()))?;
        stats_writer(counters.clone(), dir.clone());
    }
    log::info!(
        "serving {location} ({image_id}), device 2 = {} bytes, {bundle_ranges} ranges, frontend {}, dev2 cache {}",
        dev.size(),
        kind.as_str(),
        dev2_cache.as_str()
    );

    let (tx, rx) = mpsc::channel::<Event>();
    {
        let tx = tx.clone();
        let (dev, dir, image_id) = (dev.clone(), args.dir.clone(), image_id.clone());
        let prefetching = Arc::new(AtomicBool::new(false));
        std::thread::Builder::new().name("signals".into()).spawn(move || loop {
            let res = match set.wait() {
                Ok(Signal::SIGUSR1) => dir
                    .as_deref()
                    .context("no --dir to read a prefetch request from")
                    .and_then(|d| prefetch::start_requested(&dev, d, &image_id, &prefetching)),
                Ok(Signal::SIGUSR2) => dir
                    .as_deref()
                    .context("no --dir to write the access trace into")
                    .and_then(|d| write_access_trace(&dev, d, &image_id)),
                Ok(sig) => {
                    let _ = tx.send(Event::Signal(sig));
                    Ok(())
                }
                Err(_) => Ok(()),
            };
            if let Err(e) = res {
                log::error!("{e:#}");
            }
        })?;
    }
    let pid = std::process::id() as i32;

    match kind {
        Frontend::Fuse => {
            let inherited = match (args.fuse_fd, args.fuse_root_fd) {
                // SAFETY: fds the supervisor opened and left open for us (clap makes the
                // two flags come together); nothing else in this process owns them.
                (Some(fuse), Some(root)) => Some(frontend::fuse::Inherited {
                    conn: unsafe {
                        frontend::fuse::Connection {
                            fuse: OwnedFd::from_raw_fd(fuse),
                            root: OwnedFd::from_raw_fd(root),
                        }
                    },
                    resume: args.fuse_resume,
                }),
                _ => None,
            };
            let backing = if dev2_cache == Dev2Cache::Passthrough {
                Some(passthrough_backing(&dev, &args)?)
            } else {
                None
            };
            let fe = frontend::fuse::start(dev.clone(), args.threads, dev2_cache, inherited, backing)?;
            timing("serve: fuse frontend up");
            if let (Some(id), Some(dir)) = (fe.backing_id, &args.dir) {
                let b = serde_json::to_vec(&PassthroughRecord { backing_id: id })?;
                write_atomic(&dir.join(PASSTHROUGH_FILE), &b)?;
            }
            let device = format!("/proc/{pid}/fd/{}/{}", fe.root.as_raw_fd(), frontend::fuse::FILE_NAME);
            announce(&Ready {
                pid,
                frontend: Frontend::Fuse,
                device,
                ublk_id: None,
                image_id,
                dev2_cache: Some(dev2_cache),
                ublk_queues: None,
            })?;
            let tx2 = tx.clone();
            let session = fe.session;
            std::thread::spawn(move || {
                let r = session.join();
                let _ = tx2.send(Event::FrontendEnded(format!("FUSE session ended: {r:?}")));
            });
            let ev = rx.recv().context("event channel")?;
            match ev {
                Event::Signal(s) => log::info!("{s}: stopping"),
                Event::FrontendEnded(m) => log::info!("{m}"),
                _ => {}
            }
            // exiting closes /dev/fuse: a loop device still on dev2 gets EIO from now on
            write_final(&args.dir, &counters);
            Ok(())
        }
        Frontend::Ublk => {
            let stopper = frontend::ublk::Stopper::default();
            let opts = frontend::ublk::Options {
                recover_id: args.ublk_recover,
                ..frontend::ublk::Options::new(args.threads, args.ublk.mode(), args.ublk.ublk_queues)
            };
            let tx_ready = tx.clone();
            let tx_end = tx.clone();
            let st = stopper.clone();
            let d = dev.clone();
            let img = image_id.clone();
            let worker = std::thread::Builder::new().name("ublk".into()).spawn(move || {
                let ready = move |path: String, id: i32, queues: u16| {
                    let _ = tx_ready.send(Event::Ready(Ready {
                        pid,
                        frontend: Frontend::Ublk,
                        device: path,
                        ublk_id: Some(id),
                        image_id: img,
                        dev2_cache: None,
                        ublk_queues: Some(queues),
                    }));
                };
                let r = frontend::ublk::run(d, opts, ready, st);
                let _ = tx_end.send(match r {
                    Ok(()) => Event::FrontendEnded("ublk device stopped".into()),
                    Err(e) => Event::Failed(format!("{e:#}")),
                });
            })?;
            let mut live: Option<String> = None;
            loop {
                match rx.recv().context("event channel")? {
                    Event::Ready(r) => {
                        announce(&r)?;
                        live = Some(r.device);
                    }
                    Event::Signal(s) => {
                        log::info!("{s}: stopping, deleting the ublk device");
                        if let Some(bdev) = live.as_deref().filter(|b| frontend::ublk::claimed(b)) {
                            log::warn!(
                                "{bdev} is still open (mounted?): it is deleted once its last user closes it; \
                                 reads fail with EIO until then"
                            );
                        }
                        stopper.stop();
                        let _ = worker.join();
                        stopper.delete();
                        break;
                    }
                    Event::FrontendEnded(m) => {
                        log::info!("{m}");
                        break;
                    }
                    Event::Failed(m) => {
                        if live.is_some() {
                            log::error!("{m}");
                            break;
                        }
                        bail!("{m}");
                    }
                }
            }
            write_final(&args.dir, &counters);
            Ok(())
        }
        Frontend::Auto => unreachable!(),
    }
}

/// What `<dir>/passthrough.json` holds.
#[derive(Serialize, Deserialize)]
struct PassthroughRecord {
    backing_id: u32,
}

/// The backing file of a `--dev2-cache passthrough` server: on a connection resumed
/// from a dead server, the backing id that one recorded (its file is still the
/// kernel's, and every open of the inode must use that one); otherwise device 2 copied
/// whole into the cache directory (an unnamed file), then the chunk cache emptied (no
/// read will reach this server).
fn passthrough_backing(dev: &Device2, args: &ServeArgs) -> Result<frontend::fuse::Backing> {
    if let (true, Some(dir)) = (args.fuse_resume, &args.dir) {
        if let Some(r) = std::fs::read(dir.join(PASSTHROUGH_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<PassthroughRecord>(&b).ok())
        {
            return Ok(frontend::fuse::Backing::Id(r.backing_id));
        }
    }
    let file = crate::device::copy::copy_whole(dev, &args.remote.cache_root())?;
    dev.chunks.clear();
    timing("serve: device 2 copied for passthrough");
    Ok(frontend::fuse::Backing::Copy(file))
}

/// Device 2's superblock (64 KiB in) is the first thing every mount reads (`btrfs device
/// scan`, then `mount`): load and verify its pack chunk in the background while the
/// frontend starts, as a prefetch (not a demand load; the scan's read still counts as
/// an access for `record`).
fn warm_superblock_chunk(dev: &Arc<Device2>) {
    let bm = dev.chunks.blockmap();
    let Ok(segs) = bm.segments(btrfs::SUPER_OFFSET, 4096) else {
        return;
    };
    let Some(Segment::Pack { pack, pack_offset, .. }) = segs.into_iter().next() else {
        return;
    };
    let chunk = pack_offset >> bm.chunk_shift;
    let dev = dev.clone();
    let _ = std::thread::Builder::new()
        .name("warm".into())
        .spawn(move || dev.chunks.prefetch_run(pack, chunk..chunk + 1));
}

/// A ublk server must not share a mount namespace with users of its device (libublk
/// README, "Mount namespace caveat": teardown can deadlock). Give the server its own
/// namespace (slave, so host unmounts still propagate where the host shares them) and
/// drop its copies of other images' btrfs mounts so it does not pin them.
fn isolate_mount_namespace() -> Result<()> {
    use nix::mount::MsFlags;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).context("unshare(CLONE_NEWNS)")?;
    nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .context("make / rslave in the server's mount namespace")?;
    for m in mnt::mounts()? {
        let image_dev = m.source.starts_with("/dev/loop") || m.source.starts_with("/dev/ublkb");
        if m.fstype == "btrfs" && image_dev && m.mount_point != "/" {
            let _ = mnt::umount(Path::new(&m.mount_point), true);
        }
    }
    Ok(())
}

/// `ublkd record`: the chunks read on demand since the server started, first access
/// first, as a trace (source "record") in `<dir>/access.trace`.
fn write_access_trace(dev: &Device2, dir: &Path, image_id: &str) -> Result<()> {
    let chunks = dev.chunks.access.snapshot();
    let n = chunks.len();
    let t = trace::Trace::new(image_id, dev.chunks.blockmap().chunk_size(), "record", chunks);
    t.write(&dir.join(trace::ACCESS_FILE))?;
    log::info!(
        "access trace: {n} chunks written to {}",
        dir.join(trace::ACCESS_FILE).display()
    );
    Ok(())
}

fn write_final(dir: &Option<PathBuf>, counters: &Counters) {
    if let Some(d) = dir {
        if let Ok(b) = serde_json::to_vec(&counters.snapshot()) {
            let _ = write_atomic(&Path::new(d).join(STATS_FILE), &b);
        }
    }
}
