//! Where pack bytes come from. Local files today; the trait leaves room for remote
//! packs (HTTP range reads with a local cache) without touching the verified path.

use anyhow::{ensure, Context, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

pub trait PackSource: Send + Sync {
    /// Read exactly `buf.len()` bytes of pack `pack` at `offset` (unverified bytes).
    fn read_at(&self, pack: u32, offset: u64, buf: &mut [u8]) -> std::io::Result<()>;
}

/// Packs as local files, opened once.
pub struct LocalPacks {
    files: Vec<(PathBuf, File)>,
}

impl LocalPacks {
    pub fn open(paths: &[PathBuf], sizes: &[u64]) -> Result<LocalPacks> {
        let mut files = Vec::with_capacity(paths.len());
        for (p, &size) in paths.iter().zip(sizes) {
            let f = File::open(p).with_context(|| format!("pack {}: open", p.display()))?;
            let len = f
                .metadata()
                .with_context(|| format!("pack {}: stat", p.display()))?
                .len();
            ensure!(
                len == size,
                "pack {}: size {len}, the blockmap says {size}",
                p.display()
            );
            files.push((p.clone(), f));
        }
        Ok(LocalPacks { files })
    }
}

impl PackSource for LocalPacks {
    fn read_at(&self, pack: u32, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.files[pack as usize].1.read_exact_at(buf, offset)
    }
}
