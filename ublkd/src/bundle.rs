//! Opening a bundle: manifest.json (its sha256 is the image id), the digests it lists
//! for meta.img and blockmap, and the blockmap's agreement with the manifest.

use crate::blockmap::Blockmap;
use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

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

pub struct Bundle {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// `sha256:<hex>` of manifest.json's bytes.
    pub image_id: String,
    pub blockmap: std::sync::Arc<Blockmap>,
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = File::open(path).with_context(|| format!("{}: open", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).with_context(|| format!("{}: read", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
    Ok((hex::encode(h.finalize()), total))
}

fn strip_sha(s: &str) -> Result<&str> {
    let hex = s
        .strip_prefix("sha256:")
        .with_context(|| format!("digest {s:?} does not start with sha256:"))?;
    ensure!(
        hex.len() == 64 && hex.bytes().all(|c| c.is_ascii_hexdigit()),
        "digest {s:?} is not 64 hex digits"
    );
    Ok(hex)
}

/// Normalize a user-given image id (`sha256:<hex>` or bare hex) to `sha256:<hex>`.
pub fn normalize_id(id: &str) -> Result<String> {
    let with = if id.starts_with("sha256:") {
        id.to_string()
    } else {
        format!("sha256:{id}")
    };
    Ok(format!("sha256:{}", strip_sha(&with)?.to_ascii_lowercase()))
}

impl Bundle {
    /// Open and verify a bundle. `verify_meta` also hashes meta.img (the mount command
    /// does; the server, which never reads meta.img, does not).
    pub fn open(dir: &Path, expect_id: Option<&str>, verify_meta: bool) -> Result<Bundle> {
        let dir = dir
            .canonicalize()
            .with_context(|| format!("bundle {}: not found", dir.display()))?;
        let mpath = dir.join("manifest.json");
        let mbytes = std::fs::read(&mpath).with_context(|| format!("{}: read", mpath.display()))?;
        let image_id = format!("sha256:{}", sha256_hex(&mbytes));
        if let Some(want) = expect_id {
            let want = normalize_id(want)?;
            ensure!(
                want == image_id,
                "{}: image id is {image_id}, expected {want}",
                mpath.display()
            );
        }
        let manifest: Manifest =
            serde_json::from_slice(&mbytes).with_context(|| format!("{}: not a valid manifest", mpath.display()))?;
        ensure!(
            manifest.format == "btrfs-ublk-image.bundle",
            "{}: format is {:?}, not \"btrfs-ublk-image.bundle\"",
            mpath.display(),
            manifest.format
        );
        ensure!(
            manifest.format_version == 1,
            "{}: format_version {} is not supported (this ublkd reads 1)",
            mpath.display(),
            manifest.format_version
        );
        ensure!(
            manifest.devices.len() == 2 && manifest.devices[0].devid == 1 && manifest.devices[1].devid == 2,
            "{}: devices must list devid 1 and 2",
            mpath.display()
        );

        let check = |name: &str, hash: bool| -> Result<PathBuf> {
            let info = manifest
                .files
                .get(name)
                .with_context(|| format!("{}: files has no {name:?}", mpath.display()))?;
            let path = dir.join(name);
            let meta = std::fs::metadata(&path).with_context(|| format!("{}: stat", path.display()))?;
            ensure!(
                meta.len() == info.size,
                "{}: size {} but the manifest says {}",
                path.display(),
                meta.len(),
                info.size
            );
            if hash {
                let want =
                    strip_sha(&info.sha256).with_context(|| format!("{}: files.{name}.sha256", mpath.display()))?;
                let (got, _) = sha256_file(&path)?;
                ensure!(
                    got == want,
                    "{}: sha256 is {got}, the manifest says {want}",
                    path.display()
                );
            }
            Ok(path)
        };
        let meta_path = check("meta.img", verify_meta)?;
        ensure!(
            std::fs::metadata(&meta_path)?.len() == manifest.devices[0].size,
            "{}: size differs from devices[0].size {}",
            meta_path.display(),
            manifest.devices[0].size
        );
        let bm_path = check("blockmap", false)?;
        let bm_bytes = std::fs::read(&bm_path).with_context(|| format!("{}: read", bm_path.display()))?;
        let want = strip_sha(&manifest.files["blockmap"].sha256)?;
        let got = sha256_hex(&bm_bytes);
        ensure!(
            got == want,
            "{}: sha256 is {got}, the manifest says {want}",
            bm_path.display()
        );
        let blockmap =
            Blockmap::parse(&bm_bytes).with_context(|| format!("{}: invalid blockmap", bm_path.display()))?;

        ensure!(
            blockmap.device_size == manifest.devices[1].size,
            "{}: device_size {} but the manifest's device 2 size is {}",
            bm_path.display(),
            blockmap.device_size,
            manifest.devices[1].size
        );
        ensure!(
            blockmap.chunk_size() == manifest.chunk_size,
            "{}: chunk size {} but the manifest says {}",
            bm_path.display(),
            blockmap.chunk_size(),
            manifest.chunk_size
        );
        ensure!(
            blockmap.packs.len() == manifest.packs.len(),
            "{}: {} packs but the manifest lists {}",
            bm_path.display(),
            blockmap.packs.len(),
            manifest.packs.len()
        );
        for (i, (bp, mp)) in blockmap.packs.iter().zip(&manifest.packs).enumerate() {
            let want = strip_sha(&mp.id)?;
            ensure!(
                hex::encode(bp.id) == want,
                "pack {i}: blockmap id {} but the manifest says {want}",
                hex::encode(bp.id)
            );
            // the manifest gives the pack FILE's size: stored (compressed) bytes
            let stored = blockmap.stored_size(i as u32);
            ensure!(
                stored == mp.size,
                "pack {i} ({}): blockmap stored size {stored} but the manifest says {}",
                mp.path,
                mp.size
            );
            // the pack id is sha256 over its chunk digests: check the digest table against it
            let first = bp.first_chunk as usize;
            let n = crate::blockmap::chunks_in(bp.size, blockmap.chunk_size()) as usize;
            let mut h = Sha256::new();
            for d in &blockmap.digests[first..first + n] {
                h.update(d);
            }
            ensure!(
                h.finalize().as_slice() == bp.id,
                "pack {i} ({}): its chunk digests do not hash to its id",
                mp.path
            );
            if mp.path.contains("://") {
                bail!("pack {i}: remote pack {} is not supported yet", mp.path);
            }
        }
        Ok(Bundle {
            dir,
            manifest,
            image_id,
            blockmap: blockmap.into(),
        })
    }

    pub fn meta_path(&self) -> PathBuf {
        self.dir.join("meta.img")
    }

    pub fn pack_paths(&self) -> Vec<PathBuf> {
        self.manifest.packs.iter().map(|p| self.dir.join(&p.path)).collect()
    }
}
