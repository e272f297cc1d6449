//! `ublkd umount MNT [--lazy]`: undo one mount, then release its share of the bundle.

use super::devices::{forget_and_detach, umount_busy_msg};
use super::mounts::lock_mount;
use super::servers::fail_dead_ublk;
use super::shared::gc_bundle;
use crate::plumbing::mount as mnt;
use crate::state::{self, BundleState, MountState};
use anyhow::{ensure, Context, Result};
use std::path::Path;

/// Undo one mount (the caller holds its mount-point lock), then release its share of
/// the bundle. Idempotent: each step checks first.
pub fn teardown_mount(st: &MountState, lazy: bool) -> Result<()> {
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
