//! Frontends expose [`crate::device::Device2`] to the kernel as a block device
//! (ublk) or as a file a loop device can sit on (FUSE).

pub mod fuse;
pub mod ublk;

use anyhow::{bail, Result};
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Auto,
    Ublk,
    Fuse,
}

impl Kind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::Auto => "auto",
            Kind::Ublk => "ublk",
            Kind::Fuse => "fuse",
        }
    }
}

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
pub fn choose(kind: Kind) -> Result<(Kind, String)> {
    match kind {
        Kind::Fuse => Ok((Kind::Fuse, "fuse (requested)".into())),
        Kind::Ublk => {
            load_ublk_drv();
            if !Path::new("/dev/ublk-control").exists() {
                bail!("--frontend ublk: /dev/ublk-control does not exist (no ublk_drv in this kernel?); use --frontend fuse");
            }
            Ok((Kind::Ublk, "ublk (requested)".into()))
        }
        Kind::Auto => {
            load_ublk_drv();
            if Path::new("/dev/ublk-control").exists() {
                Ok((Kind::Ublk, "ublk (auto: /dev/ublk-control exists)".into()))
            } else {
                Ok((Kind::Fuse, "fuse (auto: no /dev/ublk-control)".into()))
            }
        }
    }
}
