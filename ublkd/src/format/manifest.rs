//! manifest.json (docs/bundle-format.md): the fields ublkd uses, and the names of a
//! bundle's files.

use serde::Deserialize;
use std::collections::BTreeMap;

/// The bundle's manifest; its sha256 is the image id.
pub const MANIFEST: &str = "manifest.json";
/// Device 1 (metadata), a btrfs image.
pub const META_IMG: &str = "meta.img";
/// The binary blockmap (see [`crate::format::blockmap`]).
pub const BLOCKMAP: &str = "blockmap";
/// A trace beside manifest.json that `mount` applies unless told otherwise.
pub const PREFETCH_TRACE: &str = "prefetch.trace";

/// `format` of a bundle manifest.
pub const FORMAT: &str = "btrfs-ublk-image.bundle";
/// The `format_version` this ublkd reads.
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Deserialize)]
pub struct DeviceInfo {
    pub devid: u64,
    pub uuid: String,
    pub size: u64,
}

#[derive(Debug, Deserialize)]
pub struct FileInfo {
    pub sha256: String,
    pub size: u64,
}

#[derive(Debug, Deserialize)]
pub struct PackInfo {
    pub id: String,
    pub size: u64,
    pub path: String,
}

/// The fields of manifest.json that ublkd uses (others are ignored).
#[derive(Debug, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    #[serde(default)]
    pub name: String,
    pub fsid: String,
    pub devices: Vec<DeviceInfo>,
    pub files: BTreeMap<String, FileInfo>,
    pub packs: Vec<PackInfo>,
    pub chunk_size: u64,
}
