//! mount(2)/umount2(2) and /proc/self/mountinfo.

use anyhow::{Context, Result};
use nix::mount::{MntFlags, MsFlags};
use std::path::Path;

/// Mount btrfs from `source`, naming every device with `device=` options.
pub fn mount_btrfs(source: &Path, target: &Path, devices: &[&Path], read_only: bool, extra: &str) -> Result<()> {
    let mut opts: Vec<String> = devices.iter().map(|d| format!("device={}", d.display())).collect();
    if !extra.is_empty() {
        opts.push(extra.to_string());
    }
    let data = opts.join(",");
    let flags = if read_only {
        MsFlags::MS_RDONLY
    } else {
        MsFlags::empty()
    };
    nix::mount::mount(Some(source), target, Some("btrfs"), flags, Some(data.as_str())).with_context(|| {
        format!(
            "mount -t btrfs -o {}{data} {} {}",
            if read_only { "ro," } else { "" },
            source.display(),
            target.display()
        )
    })
}

pub fn remount_rw(target: &Path) -> Result<()> {
    nix::mount::mount(None::<&str>, target, None::<&str>, MsFlags::MS_REMOUNT, None::<&str>)
        .with_context(|| format!("mount -o remount,rw {}", target.display()))
}

pub fn umount(target: &Path, lazy: bool) -> nix::Result<()> {
    nix::mount::umount2(target, if lazy { MntFlags::MNT_DETACH } else { MntFlags::empty() })
}

#[derive(Debug, Clone)]
pub struct MountInfo {
    pub mount_point: String,
    pub fstype: String,
    pub source: String,
}

fn unescape(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn mounts() -> Result<Vec<MountInfo>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").context("/proc/self/mountinfo: read")?;
    let mut out = Vec::new();
    for line in text.lines() {
        let (left, right) = match line.split_once(" - ") {
            Some(x) => x,
            None => continue,
        };
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if l.len() < 5 || r.len() < 2 {
            continue;
        }
        out.push(MountInfo {
            mount_point: unescape(l[4]),
            fstype: r[0].to_string(),
            source: unescape(r[1]),
        });
    }
    Ok(out)
}

pub fn is_mountpoint(path: &Path) -> Result<bool> {
    let p = path.to_string_lossy();
    Ok(mounts()?.iter().any(|m| m.mount_point == p))
}

/// `mount -o remount,ro`: the superblock goes read-only (btrfs syncs first).
pub fn remount_ro(target: &Path) -> Result<()> {
    nix::mount::mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .with_context(|| format!("mount -o remount,ro {}", target.display()))
}

/// A read-only bind mount of `source` on `target` (`mount --bind -o ro`).
pub fn bind_ro(source: &Path, target: &Path) -> Result<()> {
    nix::mount::mount(Some(source), target, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .with_context(|| format!("mount --bind {} {}", source.display(), target.display()))?;
    let r = nix::mount::mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    );
    if let Err(e) = r {
        let _ = umount(target, false);
        return Err(e).with_context(|| format!("mount -o remount,bind,ro {}", target.display()));
    }
    Ok(())
}

/// overlayfs with one lower directory: `mount -t overlay SOURCE -o lowerdir=..,upperdir=..,workdir=..`.
pub fn overlay(source: &str, lower: &Path, upper: &Path, work: &Path, target: &Path) -> Result<()> {
    let esc = |p: &Path| {
        p.display()
            .to_string()
            .replace('\\', "\\\\")
            .replace(':', "\\:")
            .replace(',', "\\,")
    };
    let data = format!("lowerdir={},upperdir={},workdir={}", esc(lower), esc(upper), esc(work));
    nix::mount::mount(
        Some(source),
        target,
        Some("overlay"),
        MsFlags::empty(),
        Some(data.as_str()),
    )
    .with_context(|| format!("mount -t overlay -o {data} {source} {}", target.display()))
}
