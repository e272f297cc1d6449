//! The control verbs, one module each ([`mount`], [`umount`], [`status`], [`recover`],
//! [`record`]), on shared mechanisms: [`rollback`] (undo of a failed mount),
//! [`devices`] (the loop devices of an image instance), [`servers`] (a bundle's server
//! process: start, stop, find), [`shared`] (a bundle's shared read-only mount and its
//! reference counting) and [`mounts`] (finding and locking a mount's state).

pub mod devices;
pub mod mount;
pub mod mounts;
pub mod record;
pub mod recover;
pub mod rollback;
pub mod servers;
pub mod shared;
pub mod status;
pub mod umount;
