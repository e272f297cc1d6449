//! Finding a mount's state (by mount point) and locking it; the mounts of a bundle.

use crate::plumbing::mount as mnt;
use crate::state::{self, MountState};
use anyhow::{anyhow, Result};
use std::path::Path;

pub fn mounts_of(key: &str) -> Result<Vec<MountState>> {
    Ok(MountState::all()?.into_iter().filter(|m| m.bundle_key == key).collect())
}

pub fn is_mounted(path: &str) -> Result<bool> {
    Ok(mnt::mounts()?.iter().any(|m| m.mount_point == path))
}

pub fn find_state(mountpoint: &Path) -> Result<MountState> {
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
pub fn lock_mount(mountpoint: &Path) -> Result<(MountState, state::Lock)> {
    let st = find_state(mountpoint)?;
    let l = state::lock(&MountState::lock_path(&st.id), Some(&st.dir()))?;
    let st = MountState::load(&st.dir())
        .map_err(|_| anyhow!("{}: unmounted meanwhile by another ublkd", mountpoint.display()))?;
    Ok((st, l))
}
