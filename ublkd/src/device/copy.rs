//! Device 2 copied whole into a local file: the backing file of `--dev2-cache
//! passthrough` (`crate::frontend::fuse`), which the kernel reads in place of the server.

use super::{Device2, ReadError};
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// Write device 2 into a new unnamed file (O_TMPFILE) in `dir`: every mapped range from
/// verified pack chunks (loaded as prefetches, in device order), zero ranges left as
/// holes. Unnamed, so nothing can open it by path and no crash leaves it behind: it
/// lives while an fd or the kernel's passthrough reference holds it. A copy, not a
/// reflink: the bytes written are the ones verified (a clone of the pack's extents
/// would be taken from the file after its check).
pub fn copy_whole(dev: &Device2, dir: &Path) -> Result<File> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: mkdir", dir.display()))?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o400)
        .custom_flags(libc::O_TMPFILE)
        .open(dir)
        .with_context(|| format!("{}: O_TMPFILE for the copy of device 2", dir.display()))?;
    f.set_len(dev.size())
        .with_context(|| format!("{}: size the copy of device 2", dir.display()))?;
    let bm = dev.chunks.blockmap();
    let shift = bm.chunk_shift;
    for r in &bm.ranges {
        let (mut pos, end, mut at) = (r.pack_offset, r.pack_offset + r.length, r.dev_offset);
        while pos < end {
            let chunk = pos >> shift;
            let data = dev
                .chunks
                .chunk_for_copy(r.pack, chunk)
                .map_err(|e| anyhow::anyhow!("copy of device 2: {}", ReadError::Chunk(e)))?;
            let within = (pos - (chunk << shift)) as usize;
            let take = (data.len().saturating_sub(within) as u64).min(end - pos) as usize;
            if take == 0 {
                bail!("copy of device 2: pack {} ends before offset {pos}", r.pack);
            }
            f.write_all_at(&data[within..within + take], at)
                .with_context(|| format!("{}: write the copy of device 2", dir.display()))?;
            pos += take as u64;
            at += take as u64;
        }
    }
    // written out before the server is READY: otherwise the writeback of the whole copy
    // (ext4 flushes dirty pages within 30 s anyway) competes with the first reads
    f.sync_data()
        .with_context(|| format!("{}: write out the copy of device 2", dir.display()))?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// The copy reads back as the device: every byte of the synthetic image (mapped
    /// ranges and holes), and its chunks count as prefetches, not device reads.
    #[test]
    fn copy_equals_the_device() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, expect, _) = crate::device::tests::synthetic(tmp.path(), 12);
        let mut f = copy_whole(&dev, &tmp.path().join("copies")).unwrap();
        let mut got = Vec::new();
        f.read_to_end(&mut got).unwrap();
        assert!(got == expect, "the copy differs from the device");
        let s = dev.counters.snapshot();
        assert_eq!((s.reads, s.bytes_served, s.cache_misses), (0, 0, 0));
        assert!(s.prefetch_chunks > 0, "chunks are loaded as prefetches");
        // unnamed: nothing was left in the directory
        assert_eq!(std::fs::read_dir(tmp.path().join("copies")).unwrap().count(), 0);
    }

    /// A corrupt chunk fails the copy, naming the pack and chunk.
    #[test]
    fn corrupt_chunk_fails_the_copy() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, _, pack) = crate::device::tests::synthetic(tmp.path(), 12);
        // pack chunk 3 is mapped (device [12288, 16384)); nothing is loaded yet
        let mut b = std::fs::read(&pack).unwrap();
        b[3 * 4096 + 7] ^= 0xff;
        std::fs::write(&pack, &b).unwrap();
        let e = copy_whole(&dev, &tmp.path().join("copies")).unwrap_err();
        assert!(format!("{e:#}").contains("chunk 3 failed verification"), "{e:#}");
    }
}
