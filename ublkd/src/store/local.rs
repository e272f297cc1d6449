//! Opening a bundle: manifest.json (its sha256 is the image id), the digests it lists
//! for meta.img and blockmap, and the blockmap's agreement with the manifest.

use crate::format::blockmap::{chunks_in, Blockmap};
use crate::format::digest::{sha256_hex, Sha256Digest};
use crate::format::manifest::{Manifest, BLOCKMAP, MANIFEST, META_IMG};
use crate::util::write_atomic;
use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest as _, Sha256};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

pub struct Bundle {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// `sha256:<hex>` of manifest.json's bytes.
    pub image_id: String,
    pub blockmap: std::sync::Arc<Blockmap>,
    /// meta.img, open, once checked against the manifest (`mount`): the loop devices are
    /// put on this very file, never on one opened again by path.
    pub meta: Option<File>,
}

impl Bundle {
    /// Open and verify a bundle. `verify_meta` also checks meta.img against the manifest
    /// and keeps it open in `meta` (the mount command does; the server, which never reads
    /// meta.img, does not): see [`open_checked_meta`].
    pub fn open(dir: &Path, expect_id: Option<&str>, verify_meta: bool) -> Result<Bundle> {
        let dir = dir
            .canonicalize()
            .with_context(|| format!("bundle {}: not found", dir.display()))?;
        let mpath = dir.join(MANIFEST);
        let mbytes = std::fs::read(&mpath).with_context(|| format!("{}: read", mpath.display()))?;
        let image_id = Sha256Digest::of(&mbytes).to_string();
        if let Some(want) = expect_id {
            let want = Sha256Digest::parse_id(want)?.to_string();
            ensure!(
                want == image_id,
                "{}: image id is {image_id}, expected {want}",
                mpath.display()
            );
        }
        let manifest: Manifest =
            serde_json::from_slice(&mbytes).with_context(|| format!("{}: not a valid manifest", mpath.display()))?;
        manifest.check_format(&mpath.display().to_string())?;
        ensure!(
            manifest.devices.len() == 2 && manifest.devices[0].devid == 1 && manifest.devices[1].devid == 2,
            "{}: devices must list devid 1 and 2",
            mpath.display()
        );

        let check = |name: &str| -> Result<PathBuf> {
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
            Ok(path)
        };
        let meta_path = check(META_IMG)?;
        let meta = if verify_meta {
            let want = Sha256Digest::parse(&manifest.files[META_IMG].sha256)
                .with_context(|| format!("{}: files.meta.img.sha256", mpath.display()))?
                .hex();
            match open_checked_meta(&meta_path, &want)? {
                Ok(f) => Some(f),
                Err(got) => bail!("{}: sha256 is {got}, the manifest says {want}", meta_path.display()),
            }
        } else {
            None
        };
        ensure!(
            std::fs::metadata(&meta_path)?.len() == manifest.devices[0].size,
            "{}: size differs from devices[0].size {}",
            meta_path.display(),
            manifest.devices[0].size
        );
        let bm_path = check(BLOCKMAP)?;
        let bm_bytes = std::fs::read(&bm_path).with_context(|| format!("{}: read", bm_path.display()))?;
        let want = Sha256Digest::parse(&manifest.files[BLOCKMAP].sha256)?.hex();
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
            let want = Sha256Digest::parse(&mp.id)?.hex();
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
            let n = chunks_in(bp.size, blockmap.chunk_size()) as usize;
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
            meta,
        })
    }

    pub fn meta_path(&self) -> PathBuf {
        self.dir.join(META_IMG)
    }

    pub fn pack_paths(&self) -> Vec<PathBuf> {
        self.manifest.packs.iter().map(|p| self.dir.join(&p.path)).collect()
    }
}

// ---------------------------------------------------------------------------------------
// meta.img: hashed, or known good from a verified record

/// Filesystems whose inode numbers and change times the kernel keeps itself, so that a
/// file whose (dev, inode, size, mtime, ctime) did not change still holds the bytes it
/// held when it was hashed. Network and FUSE filesystems report what a server says: a
/// meta.img there is hashed on every mount.
const RECORDED_FS: &[(i64, &str)] = &[
    (0xEF53, "ext2/3/4"),
    (0x5846_5342, "xfs"),
    (0x9123_683E, "btrfs"),
    (0x0102_1994, "tmpfs"),
];

/// A record is only written for a file whose ctime is this much older than the clock,
/// so that a write in the same timestamp tick (coarse or 1 s granularity) cannot leave
/// the ctime unchanged ("racy timestamps").
const RACY_NS: i128 = 2_000_000_000;

/// What `mount` wrote after hashing a meta.img whose sha256 matched its manifest: the
/// identity and times of the file it hashed. Kept in `<run dir>/verified/<sha256>.json`
/// (root's, 0700): while the same file still shows the same identity and times, it has
/// not been written since, and it is not hashed again.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct MetaRecord {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl MetaRecord {
    fn of(md: &std::fs::Metadata) -> MetaRecord {
        use std::os::unix::fs::MetadataExt;
        MetaRecord {
            dev: md.dev(),
            ino: md.ino(),
            size: md.len(),
            mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
            ctime_ns: md.ctime() as i128 * 1_000_000_000 + md.ctime_nsec() as i128,
        }
    }
}

fn records_dir() -> PathBuf {
    crate::state::run_dir().join("verified")
}

/// The filesystem type of an open file, if records are trusted there.
fn recorded_fs(f: &File) -> Option<&'static str> {
    use std::os::fd::AsRawFd;
    // SAFETY: fstatfs fills the struct we own.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatfs(f.as_raw_fd(), &mut sfs) } != 0 {
        return None;
    }
    RECORDED_FS
        .iter()
        .find(|(magic, _)| sfs.f_type as i64 == *magic)
        .map(|(_, name)| *name)
}

fn read_record<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    use std::os::unix::fs::MetadataExt;
    let f = File::open(path).ok()?;
    let md = f.metadata().ok()?;
    // only a record written by us (root) counts
    // SAFETY: trivial getter.
    if md.uid() != unsafe { libc::geteuid() } || md.mode() & 0o022 != 0 {
        return None;
    }
    serde_json::from_reader(std::io::BufReader::new(f)).ok()
}

fn write_record<T: serde::Serialize>(path: &Path, rec: &T) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = path.parent().expect("records live in a directory");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("{}: mkdir", dir.display()))?;
    write_atomic(path, &serde_json::to_vec(rec)?)
}

/// Open meta.img and check it against `want` (sha256 hex from the manifest): `Ok(file)`
/// when it matches, `Err(actual sha256)` when it does not. A file with a verified record
/// that still matches it is not read; otherwise it is hashed through the opened file,
/// and a record is written when the hash matched, the file did not change while it was
/// hashed, its filesystem is in [`RECORDED_FS`] and its ctime is not racy.
pub fn open_checked_meta(path: &Path, want: &str) -> Result<std::result::Result<File, String>> {
    let mut f = File::open(path).with_context(|| format!("{}: open", path.display()))?;
    let before = MetaRecord::of(&f.metadata().with_context(|| format!("{}: stat", path.display()))?);
    let fs = recorded_fs(&f);
    let rec_path = records_dir().join(format!("{want}.json"));
    if fs.is_some() && read_record(&rec_path).as_ref() == Some(&before) {
        log::debug!(
            "{}: verified record {} matches: not hashed",
            path.display(),
            rec_path.display()
        );
        // the kernel reads its trees from here right after: start reading it now
        // SAFETY: fadvise on an fd we own.
        unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_WILLNEED) };
        return Ok(Ok(f));
    }
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).with_context(|| format!("{}: read", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let got = hex::encode(h.finalize());
    if got != want {
        let _ = std::fs::remove_file(&rec_path);
        return Ok(Err(got));
    }
    let after = MetaRecord::of(&f.metadata().with_context(|| format!("{}: stat", path.display()))?);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    if fs.is_some() && after == before && after.ctime_ns < now - RACY_NS {
        if let Err(e) = write_record(&rec_path, &after) {
            log::warn!("{}: verified record not written: {e:#}", rec_path.display());
        }
    }
    Ok(Ok(f))
}

// ---------------------------------------------------------------------------------------
// the structural check's record: keyed by image id, beside the meta.img records

/// What `mount` writes after an image passed the structural check
/// (`crate::verify::structure`): `<run dir>/verified/image-<image id hex>.json`, same
/// directory and ownership rules as the meta.img records. The image id pins manifest,
/// meta.img and blockmap (their sha256 are in the manifest), so the record holds for every
/// copy of the image; it is believed only for the same check version.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StructureRecord {
    /// `ublkd <version>, structure check <n>, btrfs check --readonly`
    pub check: String,
    /// when it passed (seconds since the epoch)
    pub checked: u64,
    /// what it took, ms
    pub ms: u64,
    /// why overlayfs would not show this image exactly (`OverlayView::inexact`); none:
    /// it would
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay_inexact: Option<String>,
}

pub fn structure_record_path(image_id: &str) -> PathBuf {
    let hex = image_id.strip_prefix("sha256:").unwrap_or(image_id);
    records_dir().join(format!("image-{hex}.json"))
}

/// The record of a passed check of this image by check `check`, if there is one.
pub fn structure_record(image_id: &str, check: &str) -> Option<StructureRecord> {
    read_record::<StructureRecord>(&structure_record_path(image_id)).filter(|r| r.check == check)
}

pub fn write_structure_record(image_id: &str, rec: &StructureRecord) -> Result<()> {
    write_record(&structure_record_path(image_id), rec)
}
