//! Kernel plumbing done in-process: loop devices, btrfs ioctls, mount(2).
pub mod btrfs;
pub mod loopdev;
pub mod mount;
