//! Leaf helpers every layer may use: atomic file replacement and `timing` lines.

use anyhow::{Context, Result};
use std::fs::File;
use std::path::Path;

/// `RUST_LOG=debug`: where a mount's time goes, as `timing <ms> <step>` lines in
/// CLOCK_REALTIME milliseconds (comparable between `mount` and its server's log).
pub fn timing(step: &str) {
    if log::log_enabled!(log::Level::Debug) {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        log::debug!("timing {:.3} {step}", t.as_secs_f64() * 1e3);
    }
}

/// Replace `path` with `data` atomically: a temp file beside it, renamed over it (the
/// temp file is removed if anything fails).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    write_via_temp(path, data, false)
}

/// [`write_atomic`], with the data on disk (fsync) before the rename: for files that
/// must survive a crash (traces), not for the state files rewritten many times a second.
pub fn write_atomic_synced(path: &Path, data: &[u8]) -> Result<()> {
    write_via_temp(path, data, true)
}

fn write_via_temp(path: &Path, data: &[u8], sync: bool) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let res = (|| -> Result<()> {
        let mut f = File::create(&tmp).with_context(|| format!("{}: create", tmp.display()))?;
        f.write_all(data).with_context(|| format!("{}: write", tmp.display()))?;
        if sync {
            f.sync_all().with_context(|| format!("{}: fsync", tmp.display()))?;
        }
        std::fs::rename(&tmp, path).with_context(|| format!("{}: rename", path.display()))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}
