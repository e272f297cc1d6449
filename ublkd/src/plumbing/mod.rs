//! Kernel plumbing done in-process: loop devices, btrfs ioctls, mount(2).
pub mod btrfs;
pub mod loopdev;
pub mod mount;

/// Make sure a control node exists, loading its module once if it does not
/// (`modprobe` is the one external command ublkd runs; no udev needed for these).
pub fn ensure_module(node: &str, module: &str) {
    if std::path::Path::new(node).exists() {
        return;
    }
    let _ = std::process::Command::new("modprobe")
        .arg(module)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}
