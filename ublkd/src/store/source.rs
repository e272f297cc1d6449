//! Where pack bytes come from: local files ([`LocalPacks`]) or a remote store
//! (`crate::store::remote::RemotePacks`), and how the verified path fetches from it
//! ([`Fetching`]).

use super::cache::DiskCache;
use anyhow::{ensure, Context, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

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

/// How chunks of remote packs are fetched (the default, for local packs: none of it).
#[derive(Default)]
pub struct Fetching {
    /// The persistent chunk cache.
    pub disk: Option<DiskCache>,
    /// Chunks fetched ahead once a pack is read sequentially (3 chunks in a row).
    pub readahead: u64,
    /// Readahead worker threads.
    pub workers: usize,
    /// Longest a reader waits for a chunk another thread fetches (the fetch itself
    /// gives up at the fetch timeout; this only guards against a lost wakeup).
    pub wait_limit: Option<Duration>,
}
