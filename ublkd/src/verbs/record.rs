//! `ublkd record MNT -o TRACE`: the chunks a mount's server read on demand, as a trace.

use super::mounts::lock_mount;
use super::servers::server_log_tail;
use crate::format::trace::{self, Trace};
use crate::state::{self, BundleState, SERVER_LOG};
use anyhow::{ensure, Context, Result};
use std::path::Path;
use std::time::{Duration, Instant};

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
            b.dir().join(SERVER_LOG).display(),
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
