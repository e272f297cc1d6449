//! State under /run/ublkd (or $UBLKD_RUN_DIR):
//! * `bundles/b-<key>/`: one per served bundle (key = image id): `state.json`
//!   ([`BundleState`]: the server, the shared read-only mount), `stats.json` (rewritten
//!   by the server), `server.log`, `seed/` (the shared mount), `seed-rw.img`;
//!   `bundles/b-<key>.lock` serializes every change to that bundle and its mounts.
//! * `mounts/m-<id>/`: one per mount point: `state.json` ([`MountState`]), the
//!   overlay `upper/` and `work/` of an `--ephemeral` mount;
//!   `mounts/m-<id>.lock` serializes changes to that mount point.
//!
//! Lock order: mount point, then bundle. Lock files sit beside the directories and
//! are removed by the holder when the directory goes; [`lock`] re-checks that the file
//! it locked is still the one at the path, so a waiter never holds a stale lock.

use crate::format::digest::{self, sha256_hex};
use crate::types::{Dev2Cache, Ephemeral, Frontend, Mode, Phase, PollMode};
use crate::util::write_atomic;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// A bundle's or a mount's state in its directory.
pub const STATE_FILE: &str = "state.json";
/// The server's counters in its bundle's directory (rewritten by the server).
pub const STATS_FILE: &str = "stats.json";
/// The server's stderr in its bundle's directory.
pub const SERVER_LOG: &str = "server.log";
/// A supervisor's restarts of its server ([`Restarts`]), in the bundle's directory.
pub const RESTARTS_FILE: &str = "restarts.json";
/// `--dev2-cache passthrough`: the backing id the server registered on the FUSE
/// connection (`{"backing_id": N}`), for a restarted server on the same connection.
pub const PASSTHROUGH_FILE: &str = "passthrough.json";

/// What `serve --supervise` writes to `restarts.json` each time it starts a new server
/// after one died, and `status` shows.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
#[serde(default)]
pub struct Restarts {
    /// servers started after one died (the first one is not counted)
    pub count: u64,
    /// when the last one died (unix ms), how ("killed by SIGKILL", "exited with status 101")
    pub last_ms: u64,
    pub last_cause: String,
    /// from that death to the new server's READY (ms): how long readers waited
    pub last_downtime_ms: u64,
    pub max_downtime_ms: u64,
    /// the supervisor gave up (a new server failed to start several times in a row)
    pub gave_up: bool,
    /// pid of the server that runs now (the supervisor's child)
    pub server_pid: i32,
}

impl Restarts {
    pub fn load(dir: &Path) -> Restarts {
        std::fs::read(dir.join(RESTARTS_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        write_atomic(&dir.join(RESTARTS_FILE), &serde_json::to_vec(self)?)
    }
}

pub fn run_dir() -> PathBuf {
    std::env::var_os("UBLKD_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/ublkd"))
}

pub fn mounts_dir() -> PathBuf {
    run_dir().join("mounts")
}

pub fn bundles_dir() -> PathBuf {
    run_dir().join("bundles")
}

/// Directory name for a bundle: derived from its image id (one server per image).
pub fn bundle_key(image_id: &str) -> String {
    let hex = digest::strip_prefix(image_id).unwrap_or(image_id);
    format!("b-{}", &hex[..16.min(hex.len())])
}

/// The shared mount of a bundle that read-only and `--ephemeral` mounts use: the image
/// mounted once, sprouted onto a small scratch device (so that the image's own fsid is
/// free for further sprouts) and remounted read-only.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct SharedMount {
    pub path: String,
    pub meta_loop: Option<LoopRecord>,
    pub dev2_loop: Option<LoopRecord>,
    /// ublk: the server's /dev/ublkbN, which the shared mount uses itself (no
    /// device-2 loop device then).
    #[serde(default)]
    pub dev2_node: Option<String>,
    pub rw_loop: Option<LoopRecord>,
    pub rw_path: Option<String>,
    /// "mounting" until it is up and read-only, then "mounted".
    pub phase: Phase,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct BundleState {
    pub key: String,
    pub bundle: String,
    pub image_id: String,
    pub name: String,
    pub fsid: String,
    pub server: Option<ServerRecord>,
    pub shared: Option<SharedMount>,
    pub created: u64,
    /// Extra `serve` arguments for this bundle's server (remote bundles: the cache and
    /// fetch options its first mount was given); `recover` starts the server with them.
    #[serde(default)]
    pub serve_args: Vec<String>,
}

impl BundleState {
    pub fn dir_of(key: &str) -> PathBuf {
        bundles_dir().join(key)
    }

    pub fn dir(&self) -> PathBuf {
        Self::dir_of(&self.key)
    }

    pub fn lock_path(key: &str) -> PathBuf {
        bundles_dir().join(format!("{key}.lock"))
    }

    pub fn save(&self) -> Result<()> {
        let dir = self.dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("{}: mkdir", dir.display()))?;
        write_atomic(&dir.join(STATE_FILE), &serde_json::to_vec_pretty(self)?)
    }

    pub fn load(key: &str) -> Option<BundleState> {
        let b = std::fs::read(Self::dir_of(key).join(STATE_FILE)).ok()?;
        serde_json::from_slice(&b).ok()
    }

    pub fn all() -> Vec<BundleState> {
        let mut out: Vec<BundleState> = std::fs::read_dir(bundles_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| Self::load(&e.file_name().to_string_lossy()))
            .collect();
        out.sort_by(|a, b| a.bundle.cmp(&b.bundle).then(a.key.cmp(&b.key)));
        out
    }
}

/// Directory name for a mount point: stable, short, filesystem-safe.
pub fn mount_id(mountpoint: &Path) -> String {
    let h = sha256_hex(mountpoint.as_os_str().as_encoded_bytes());
    format!("m-{}", &h[..16])
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct LoopRecord {
    pub number: u32,
    pub path: String,
    /// What /sys/block/loopN/loop/backing_file said right after attaching.
    pub backing: String,
    pub direct_io: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ServerRecord {
    pub pid: i32,
    /// Field 22 of /proc/PID/stat: with the pid, identifies the process across pid reuse.
    pub start_time: u64,
    pub frontend: Frontend,
    /// The device-2 node the server exposes (/dev/ublkbN, or the FUSE file).
    pub device: String,
    #[serde(default)]
    pub ublk_id: Option<i32>,
    /// fuse: how the server caches `dev2` (`--dev2-cache`); none for ublk, and in
    /// records written before the choice existed (their FUSE file was direct I/O).
    #[serde(default)]
    pub dev2_cache: Option<Dev2Cache>,
    /// The server's `--cache-mb`, so that `recover` starts its successor with the same;
    /// none in records written before it was kept.
    #[serde(default)]
    pub cache_mb: Option<u64>,
    /// ublk: the server's `--ublk-poll` mode (`auto`, `off`, or microseconds of a fixed
    /// window); none in records written before the mode was kept (see `ublk_poll_us`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_poll: Option<PollMode>,
    /// Records of session 4's ublkd: its `--ublk-poll=US` (none: it slept). Read only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_poll_us: Option<u64>,
    /// ublk: the device's hw queues (what the server announced); none for fuse and in
    /// records written before the count was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_queues: Option<u16>,
}

impl ServerRecord {
    /// The ublk server's polling mode; an old record's: a fixed window or off, as then.
    pub fn ublk_poll_mode(&self) -> PollMode {
        self.ublk_poll
            .unwrap_or_else(|| self.ublk_poll_us.map_or(PollMode::Off, PollMode::Fixed))
    }

    /// The mode of a fuse server's `dev2`, which every loop device on it follows.
    pub fn fuse_dev2_cache(&self) -> Dev2Cache {
        self.dev2_cache.unwrap_or(Dev2Cache::Direct)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct MountState {
    pub id: String,
    pub mountpoint: String,
    pub bundle: String,
    pub image_id: String,
    pub name: String,
    pub fsid: String,
    pub meta_loop: Option<LoopRecord>,
    pub dev2_loop: Option<LoopRecord>,
    pub rw_loop: Option<LoopRecord>,
    pub rw_path: Option<String>,
    /// "mounting" until the filesystem is up, then "mounted".
    pub phase: Phase,
    /// "ro" (bind mount of the bundle's shared mount), "ephemeral" (overlayfs over it,
    /// upper and work dirs in this state dir; or see `ephemeral`), "rw" (own devices,
    /// native sprout).
    pub mode: Mode,
    /// Key of the bundle (`bundles/<key>/`) whose server and shared mount this uses.
    #[serde(default)]
    pub bundle_key: String,
    pub created: u64,
    /// ephemeral mounts: how (none in state from before it was recorded: overlay)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral: Option<Ephemeral>,
    /// ephemeral sprouts: why overlayfs was not used
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_why: Option<String>,
}

impl MountState {
    /// Does this mount stand on the bundle's shared mount (ro, ephemeral overlay)? The
    /// others have their own device instances.
    pub fn uses_shared(&self) -> bool {
        match self.mode {
            Mode::Ro => true,
            Mode::Ephemeral => self.ephemeral != Some(Ephemeral::Sprout),
            Mode::Rw => false,
        }
    }

    pub fn dir(&self) -> PathBuf {
        mounts_dir().join(&self.id)
    }

    pub fn lock_path(id: &str) -> PathBuf {
        mounts_dir().join(format!("{id}.lock"))
    }

    pub fn save(&self) -> Result<()> {
        let dir = self.dir();
        write_atomic(&dir.join(STATE_FILE), &serde_json::to_vec_pretty(self)?)
    }

    pub fn load(dir: &Path) -> Result<MountState> {
        let p = dir.join(STATE_FILE);
        let b = std::fs::read(&p).with_context(|| format!("{}: read", p.display()))?;
        serde_json::from_slice(&b).with_context(|| format!("{}: parse", p.display()))
    }

    pub fn all() -> Result<Vec<MountState>> {
        let mut out = Vec::new();
        let rd = match std::fs::read_dir(mounts_dir()) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e).context("read /run/ublkd/mounts"),
        };
        for e in rd {
            let e = e?;
            if !e.path().is_dir() {
                continue;
            }
            if let Ok(s) = MountState::load(&e.path()) {
                out.push(s);
            }
        }
        out.sort_by(|a, b| a.mountpoint.cmp(&b.mountpoint));
        Ok(out)
    }
}

/// An flock(2) held until dropped. With `gone_with`, the lock file is removed on drop
/// (still under the lock) when that directory no longer exists.
pub struct Lock {
    #[allow(dead_code)]
    file: File,
    path: PathBuf,
    gone_with: Option<PathBuf>,
}

impl Drop for Lock {
    fn drop(&mut self) {
        if let Some(d) = &self.gone_with {
            if !d.exists() {
                remove_lock_file(&self.path);
            }
        }
    }
}

/// Take an exclusive flock on `path` (created if missing). The file may be removed by a
/// holder (see [`Lock`]): after locking, the inode at the path must still be the one
/// locked, otherwise try again on the new file.
pub fn lock(path: &Path, gone_with: Option<&Path>) -> Result<Lock> {
    lock_until(path, gone_with, None)
}

/// [`lock`], giving up with an error after `wait`.
pub fn lock_timeout(path: &Path, gone_with: Option<&Path>, wait: std::time::Duration) -> Result<Lock> {
    lock_until(path, gone_with, Some(std::time::Instant::now() + wait))
}

fn lock_until(path: &Path, gone_with: Option<&Path>, deadline: Option<std::time::Instant>) -> Result<Lock> {
    use std::os::unix::fs::MetadataExt;
    loop {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("{}: mkdir", parent.display()))?;
        }
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("{}: open", path.display()))?;
        let op = if deadline.is_some() {
            libc::LOCK_EX | libc::LOCK_NB
        } else {
            libc::LOCK_EX
        };
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(f.as_raw_fd(), op) } != 0 {
            let err = std::io::Error::last_os_error();
            match deadline {
                Some(d) if err.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                    anyhow::ensure!(
                        std::time::Instant::now() < d,
                        "{}: still locked by another ublkd after waiting",
                        path.display()
                    );
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
                _ => return Err(err).with_context(|| format!("{}: flock", path.display())),
            }
        }
        let held = f.metadata()?;
        match std::fs::metadata(path) {
            Ok(m) if m.ino() == held.ino() && m.dev() == held.dev() => {
                return Ok(Lock {
                    file: f,
                    path: path.to_path_buf(),
                    gone_with: gone_with.map(Path::to_path_buf),
                })
            }
            _ => continue,
        }
    }
}

/// Remove a lock file while holding its lock (waiters then retry on a new file).
pub fn remove_lock_file(path: &Path) {
    let _ = std::fs::remove_file(path);
}

/// Start time of a process (field 22 of /proc/PID/stat), None if it does not exist.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    after.split(' ').nth(19)?.parse().ok()
}

/// Is the recorded server still that very process (and not a zombie)?
pub fn server_alive(s: &ServerRecord) -> bool {
    if s.pid <= 0 {
        return false;
    }
    let stat = match std::fs::read_to_string(format!("/proc/{}/stat", s.pid)) {
        Ok(x) => x,
        Err(_) => return false,
    };
    let zombie = stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3)) == Some("Z");
    !zombie && proc_start_time(s.pid) == Some(s.start_time)
}

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
