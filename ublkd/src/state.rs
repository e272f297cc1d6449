//! State under /run/ublkd (or $UBLKD_RUN_DIR): one directory per mount,
//! `mounts/<id>/`, holding `state.json` (written by `mount`, read by `umount` and
//! `status`), `stats.json` (rewritten by the server), `server.log` and a `lock` file.
//! A global `lock` file serializes mount/umount bookkeeping.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

pub fn run_dir() -> PathBuf {
    std::env::var_os("UBLKD_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/ublkd"))
}

pub fn mounts_dir() -> PathBuf {
    run_dir().join("mounts")
}

/// Directory name for a mount point: stable, short, filesystem-safe.
pub fn mount_id(mountpoint: &Path) -> String {
    let h = crate::bundle::sha256_hex(mountpoint.as_os_str().as_encoded_bytes());
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
    pub frontend: String,
    /// The device-2 node the server exposes (/dev/ublkbN, or the FUSE file).
    pub device: String,
    #[serde(default)]
    pub ublk_id: Option<i32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct MountState {
    pub id: String,
    pub mountpoint: String,
    pub bundle: String,
    pub image_id: String,
    pub name: String,
    pub fsid: String,
    pub server: Option<ServerRecord>,
    pub meta_loop: Option<LoopRecord>,
    pub dev2_loop: Option<LoopRecord>,
    pub rw_loop: Option<LoopRecord>,
    pub rw_path: Option<String>,
    /// "mounting" until the filesystem is up, then "mounted".
    pub phase: String,
    pub mode: String,
    pub created: u64,
}

impl MountState {
    pub fn dir(&self) -> PathBuf {
        mounts_dir().join(&self.id)
    }

    pub fn save(&self) -> Result<()> {
        let dir = self.dir();
        write_atomic(&dir.join("state.json"), &serde_json::to_vec_pretty(self)?)
    }

    pub fn load(dir: &Path) -> Result<MountState> {
        let p = dir.join("state.json");
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
            if let Ok(s) = MountState::load(&e.path()) {
                out.push(s);
            }
        }
        out.sort_by(|a, b| a.mountpoint.cmp(&b.mountpoint));
        Ok(out)
    }
}

pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, data).with_context(|| format!("{}: write", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("{}: rename", path.display()))?;
    Ok(())
}

/// An flock(2) held until dropped.
pub struct Lock(#[allow(dead_code)] File);

pub fn lock(path: &Path) -> Result<Lock> {
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
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("{}: flock", path.display()));
    }
    Ok(Lock(f))
}

pub fn global_lock() -> Result<Lock> {
    lock(&run_dir().join("lock"))
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
