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

/// The directory of a bundle's patch base (format_version 2: the lineage's first
/// meta.img and blockmap, which its `<name>.patch` files patch).
pub const PATCH_BASE_DIR: &str = "base";
/// A patch's name: `<name>.patch`.
pub const PATCH_SUFFIX: &str = ".patch";

/// `format` of a bundle manifest.
pub const FORMAT: &str = "btrfs-ublk-image.bundle";
/// The newest `format_version` this ublkd reads (it reads 1 and 2 too): 2 adds
/// `patches`, 3 makes meta.img's patch between block forms ([`super::block_form`]).
pub const FORMAT_VERSION: u32 = 3;

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

/// A patch (format_version 2): `<name>.patch` (this size and sha256), one zstd frame
/// whose dictionary is the patch base `base/<name>` (`base`), makes the file `<name>`.
#[derive(Debug, Deserialize)]
pub struct PatchInfo {
    pub sha256: String,
    pub size: u64,
    pub base: FileInfo,
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
    /// format_version 2: meta.img and blockmap as patches (docs/bundle-format.md)
    #[serde(default)]
    pub patches: BTreeMap<String, PatchInfo>,
    pub packs: Vec<PackInfo>,
    pub chunk_size: u64,
}

impl Manifest {
    /// Whether `name`'s patch is made between block forms (format_version 3, meta.img).
    pub fn in_block_form(&self, name: &str) -> bool {
        self.format_version == 3 && name == META_IMG
    }

    /// `format`, `format_version` (1 to 3) and, with 2 or 3, `patches` naming meta.img and
    /// blockmap (1 has none); `whence` names the manifest in errors.
    pub fn check_format(&self, whence: &str) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.format == FORMAT,
            "{whence}: format is {:?}, not \"{FORMAT}\"",
            self.format
        );
        anyhow::ensure!(
            (1..=FORMAT_VERSION).contains(&self.format_version),
            "{whence}: format_version {} is not supported (this ublkd reads 1 to {FORMAT_VERSION})",
            self.format_version
        );
        let names: Vec<&str> = self.patches.keys().map(String::as_str).collect();
        let want: &[&str] = if self.format_version == 1 {
            &[]
        } else {
            &[BLOCKMAP, META_IMG]
        };
        anyhow::ensure!(
            names == want,
            "{whence}: format_version {} must have patches for {want:?}, not {names:?}",
            self.format_version
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(version: u32, patches: &str) -> Manifest {
        serde_json::from_str(&format!(
            "{{\"format\":\"{FORMAT}\",\"format_version\":{version},\"fsid\":\"x\",\
             \"devices\":[],\"files\":{{}},\"packs\":[],\"chunk_size\":1048576{patches}}}"
        ))
        .unwrap()
    }

    #[test]
    fn versions_1_to_3_and_their_patches() {
        let p = "{\"sha256\":\"sha256:00\",\"size\":1,\"base\":{\"sha256\":\"sha256:00\",\"size\":1}}";
        let both = format!(",\"patches\":{{\"meta.img\":{p},\"blockmap\":{p}}}");
        manifest(1, "").check_format("m").unwrap();
        manifest(2, &both).check_format("m").unwrap();
        manifest(3, &both).check_format("m").unwrap();
        assert!(manifest(3, &both).in_block_form(META_IMG));
        assert!(!manifest(3, &both).in_block_form(BLOCKMAP));
        assert!(!manifest(2, &both).in_block_form(META_IMG));
        for (v, patches, want) in [
            (1, both.as_str(), "format_version 1 must have patches for []"),
            (2, "", "format_version 2 must have patches"),
            (3, "", "format_version 3 must have patches"),
            (4, "", "format_version 4 is not supported (this ublkd reads 1 to 3)"),
        ] {
            let err = manifest(v, patches).check_format("m").unwrap_err().to_string();
            assert!(err.starts_with("m: ") && err.contains(want), "{err}");
        }
        let one = format!(",\"patches\":{{\"meta.img\":{p}}}");
        assert!(manifest(2, &one).check_format("m").is_err());
    }
}
