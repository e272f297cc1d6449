//! Frontends expose [`crate::device::Device2`] to the kernel as a block device
//! (ublk) or as a file a loop device can sit on (FUSE). Which one: [`Frontend`].

pub mod fuse;
pub mod ublk;

use crate::types::Frontend;
use anyhow::{bail, Result};
use std::path::Path;

/// `modprobe ublk_drv` unless /dev/ublk-control is already there (failure is fine: the
/// caller checks for the control node). Skipped when the running kernel has no module
/// directory (modprobe cannot succeed there, and forking it cost ~18 ms of every mount).
fn load_ublk_drv() {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let modules = Path::new("/lib/modules").join(release.trim());
    if !Path::new("/dev/ublk-control").exists() && modules.is_dir() {
        let _ = std::process::Command::new("modprobe")
            .arg("ublk_drv")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Resolve `auto`: try `modprobe ublk_drv`, use ublk when /dev/ublk-control exists.
pub fn choose(kind: Frontend) -> Result<(Frontend, String)> {
    match kind {
        Frontend::Fuse => Ok((Frontend::Fuse, "fuse (requested)".into())),
        Frontend::Ublk => {
            load_ublk_drv();
            if !Path::new("/dev/ublk-control").exists() {
                bail!("--frontend ublk: /dev/ublk-control does not exist (no ublk_drv in this kernel?); use --frontend fuse");
            }
            Ok((Frontend::Ublk, "ublk (requested)".into()))
        }
        Frontend::Auto => {
            load_ublk_drv();
            if Path::new("/dev/ublk-control").exists() {
                Ok((Frontend::Ublk, "ublk (auto: /dev/ublk-control exists)".into()))
            } else {
                Ok((Frontend::Fuse, "fuse (auto: no /dev/ublk-control)".into()))
            }
        }
    }
}
