//! `ublkd recover MNT`: restart a dead server and reattach device 2 without unmounting.

use super::mounts::{lock_mount, mounts_of};
use super::servers::{spawn_server, stop_server};
use crate::args::{UblkArg, DEFAULT_CACHE_MB};
use crate::frontend;
use crate::plumbing::loopdev;
use crate::state::{self, BundleState, LoopRecord};
use crate::types::{Dev2Cache, Frontend};
use anyhow::{ensure, Context, Result};
use std::path::Path;

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
            // the new server polls as the old one did (the device keeps its queues)
            let ublk = UblkArg {
                ublk_poll: Some(old.ublk_poll_mode()),
                ublk_queues: old.ublk_queues,
            };
            let (_r, srv) = spawn_server(&b, Frontend::Ublk, cache_mb, Dev2Cache::Direct, &ublk, Some(id))?;
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
            let (r, srv) = spawn_server(&b, Frontend::Fuse, cache_mb, cache, &UblkArg::default(), None)?;
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
