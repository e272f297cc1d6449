//! Prefetch traces (docs/trace-format.md): which pack chunks to fetch first, in order.
//!
//! * [`Trace`]: the file (`btrfs-ublk-image.trace`, format_version 1), read, checked
//!   against a bundle (same image id, chunk size, chunks that exist) and written with
//!   the same bytes as the Python side (`btrfs_ublk_image/trace.py`).
//! * [`AccessLog`]: the first demand access of every pack chunk since the server started
//!   (a bitset + a Vec: each chunk is noted once, so memory is bounded by the number of
//!   chunks); `ublkd record` turns it into a trace.
//!
//! Fetching a trace's chunks is the device's business (`crate::device::prefetch`).

use crate::format::blockmap::{chunks_in, Blockmap};
use crate::format::digest;
use crate::util::write_atomic_synced;
use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

pub const FORMAT: &str = "btrfs-ublk-image.trace";
pub const FORMAT_VERSION: u32 = 1;
/// A trace beside manifest.json that `mount` applies unless told otherwise; also the
/// name of the prefetch request `mount` leaves in the server's directory.
pub const FILE_NAME: &str = crate::format::manifest::PREFETCH_TRACE;
/// What the server writes in its directory on SIGUSR2 (`ublkd record`).
pub const ACCESS_FILE: &str = "access.trace";

/// Fields in sorted order: serde writes them in declaration order, so the compact JSON
/// is byte-identical to what the Python side writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trace {
    pub chunk_size: u64,
    /// (pack index, chunk index within the pack), in fetch order, each at most once.
    pub chunks: Vec<(u32, u64)>,
    pub format: String,
    pub format_version: u32,
    pub image_id: String,
    /// "build" or "record".
    pub source: String,
}

impl Trace {
    pub fn new(image_id: &str, chunk_size: u64, source: &str, chunks: Vec<(u32, u64)>) -> Trace {
        Trace {
            chunk_size,
            chunks,
            format: FORMAT.into(),
            format_version: FORMAT_VERSION,
            image_id: image_id.into(),
            source: source.into(),
        }
    }

    /// Parse and check the structure; errors name `whence`.
    pub fn parse(bytes: &[u8], whence: &str) -> Result<Trace> {
        let v: serde_json::Value =
            serde_json::from_slice(bytes).with_context(|| format!("{whence}: not a trace: invalid JSON"))?;
        ensure!(
            v.get("format").and_then(|f| f.as_str()) == Some(FORMAT),
            "{whence}: not a trace (format is not {FORMAT:?})"
        );
        let ver = v.get("format_version").cloned().unwrap_or_default();
        ensure!(
            ver.as_u64() == Some(FORMAT_VERSION as u64),
            "{whence}: trace format_version {ver} is not supported (this ublkd reads {FORMAT_VERSION})"
        );
        let t: Trace = serde_json::from_value(v).with_context(|| format!("{whence}: invalid trace"))?;
        let hex = digest::strip_prefix(&t.image_id).unwrap_or("");
        ensure!(
            hex.len() == 64 && hex.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')),
            "{whence}: image_id {:?} is not sha256:<64 lowercase hex>",
            t.image_id
        );
        ensure!(
            t.chunk_size >= 4096 && t.chunk_size.is_power_of_two(),
            "{whence}: chunk_size {} is not a power of two >= 4096",
            t.chunk_size
        );
        ensure!(
            t.source == "build" || t.source == "record",
            "{whence}: source {:?} is not one of build, record",
            t.source
        );
        let mut seen = std::collections::HashSet::with_capacity(t.chunks.len());
        for (i, c) in t.chunks.iter().enumerate() {
            ensure!(
                seen.insert(*c),
                "{whence}: chunks[{i}] = [{}, {}] is listed twice",
                c.0,
                c.1
            );
        }
        Ok(t)
    }

    pub fn read(path: &Path) -> Result<Trace> {
        let b = std::fs::read(path).with_context(|| format!("{}: cannot read trace", path.display()))?;
        Self::parse(&b, &path.display().to_string())
    }

    /// The trace belongs to this image: same image id (the error names both), chunk
    /// size, and every chunk exists in the blockmap.
    pub fn check_for(&self, image_id: &str, bm: &Blockmap, whence: &str) -> Result<()> {
        ensure!(
            self.image_id == image_id,
            "{whence}: trace was made for image {}, this bundle is image {image_id}; refusing it",
            self.image_id
        );
        ensure!(
            self.chunk_size == bm.chunk_size(),
            "{whence}: chunk_size {}, the bundle's is {}",
            self.chunk_size,
            bm.chunk_size()
        );
        for (i, &(pack, chunk)) in self.chunks.iter().enumerate() {
            let ok = bm
                .packs
                .get(pack as usize)
                .is_some_and(|p| chunk < chunks_in(p.size, bm.chunk_size()));
            ensure!(
                ok,
                "{whence}: chunks[{i}] = [{pack}, {chunk}] is not a chunk of this bundle's packs"
            );
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = serde_json::to_vec(self).expect("a trace serializes");
        b.push(b'\n');
        b
    }

    /// Write atomically: a temp file in the same directory, fsync, rename.
    pub fn write(&self, path: &Path) -> Result<()> {
        write_atomic_synced(path, &self.encode())
    }
}

/// First demand access of each pack chunk, in order. Noting a chunk already seen is
/// one atomic load; a new one takes a short lock to append.
pub struct AccessLog {
    seen: Vec<AtomicU64>,
    first_chunk: Vec<u64>,
    order: Mutex<Vec<(u32, u64)>>,
}

impl AccessLog {
    pub fn new(bm: &Blockmap) -> AccessLog {
        let n = bm.digests.len();
        AccessLog {
            seen: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            first_chunk: bm.packs.iter().map(|p| p.first_chunk).collect(),
            order: Mutex::new(Vec::new()),
        }
    }

    pub fn note(&self, pack: u32, chunk: u64) {
        let i = (self.first_chunk[pack as usize] + chunk) as usize;
        let (word, bit) = (&self.seen[i / 64], 1u64 << (i % 64));
        if word.load(Relaxed) & bit != 0 {
            return;
        }
        if word.fetch_or(bit, Relaxed) & bit == 0 {
            self.order.lock().unwrap().push((pack, chunk));
        }
    }

    pub fn snapshot(&self) -> Vec<(u32, u64)> {
        self.order.lock().unwrap().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "sha256:abababababababababababababababababababababababababababababababab";

    #[test]
    fn round_trip_and_python_bytes() {
        let t = Trace::new(ID, 1 << 20, "record", vec![(0, 3), (0, 0), (0, 7)]);
        let b = t.encode();
        // the exact bytes btrfs_ublk_image/trace.py writes (tests/test_trace_format.py)
        let want = format!(
            "{{\"chunk_size\":1048576,\"chunks\":[[0,3],[0,0],[0,7]],\"format\":\"btrfs-ublk-image.trace\",\
             \"format_version\":1,\"image_id\":\"{ID}\",\"source\":\"record\"}}\n"
        );
        assert_eq!(String::from_utf8(b.clone()).unwrap(), want);
        assert_eq!(Trace::parse(&b, "t").unwrap(), t);
    }

    #[test]
    fn bad_traces_are_refused_by_name() {
        let good = String::from_utf8(Trace::new(ID, 1 << 20, "build", vec![(0, 1)]).encode()).unwrap();
        for (from, to, msg) in [
            (
                "\"format\":\"btrfs-ublk-image.trace\"",
                "\"format\":\"x\"",
                "not a trace",
            ),
            (
                "\"format_version\":1",
                "\"format_version\":2",
                "format_version 2 is not supported",
            ),
            (
                "\"source\":\"build\"",
                "\"source\":\"guess\"",
                "not one of build, record",
            ),
            ("[[0,1]]", "[[0,1],[0,1]]", "listed twice"),
            ("[[0,1]]", "[[0,-1]]", "invalid trace"),
            ("1048576", "1000", "not a power of two"),
            ("\"source\"", "\"extra\":1,\"source\"", "invalid trace"),
            ("sha256:ab", "sha256:AB", "not sha256:<64 lowercase hex>"),
        ] {
            let bad = good.replacen(from, to, 1);
            assert_ne!(bad, good);
            let e = format!("{:#}", Trace::parse(bad.as_bytes(), "x.trace").unwrap_err());
            assert!(e.starts_with("x.trace: ") && e.contains(msg), "{to}: {e}");
        }
    }

    #[test]
    fn check_against_a_blockmap() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, _, _) = crate::device::tests::synthetic(tmp.path(), 12);
        let bm = dev.chunks.blockmap();
        let n = chunks_in(bm.packs[0].size, bm.chunk_size());
        let t = Trace::new(ID, 4096, "record", vec![(0, n - 1), (0, 0)]);
        t.check_for(ID, bm, "t").unwrap();
        let other = "sha256:0000000000000000000000000000000000000000000000000000000000000000";
        let e = format!("{:#}", t.check_for(other, bm, "t").unwrap_err());
        assert!(
            e.contains(&format!("made for image {ID}, this bundle is image {other}")),
            "{e}"
        );
        let e = format!(
            "{:#}",
            Trace::new(ID, 4096, "record", vec![(0, n)])
                .check_for(ID, bm, "t")
                .unwrap_err()
        );
        assert!(e.contains("is not a chunk"), "{e}");
        let e = format!(
            "{:#}",
            Trace::new(ID, 8192, "record", vec![])
                .check_for(ID, bm, "t")
                .unwrap_err()
        );
        assert!(e.contains("chunk_size 8192"), "{e}");
    }

    #[test]
    fn access_log_keeps_first_access_order_once() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, _, _) = crate::device::tests::synthetic(tmp.path(), 12);
        let log = AccessLog::new(dev.chunks.blockmap());
        for (p, c) in [(0, 3), (0, 1), (0, 3), (0, 5), (0, 1), (0, 0)] {
            log.note(p, c);
        }
        assert_eq!(log.snapshot(), vec![(0, 3), (0, 1), (0, 5), (0, 0)]);
    }
}
