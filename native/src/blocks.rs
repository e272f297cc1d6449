//! Leaf blocks written to meta.img without a Python object per leaf (`treeblocks.serialize`'s
//! leaf loop, kept as the reference and for `BUI_NATIVE=0`): each payload given its header
//! (`ondisk.pack_block`: fsid, address, flags, chunk tree uuid, generation, owner, item
//! count, level 0) and CRC-32C, runs of adjacent blocks in one write. The fs tree's
//! payloads are read back from its spill file a window at a time; the extent tree's come
//! from its packer (extents.rs).

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;

use pyo3::prelude::*;

use crate::leaves::{HEADER_SIZE, LEAF_DATA_SIZE, NODESIZE};

const CSUM_SIZE: usize = 32;
/// BTRFS_HEADER_FLAG_WRITTEN | BTRFS_MIXED_BACKREF_REV << 56
const HEADER_FLAGS: u64 = 1 | (1 << 56);
/// payloads read, and blocks written, this many bytes at a time
const WINDOW: usize = 1 << 20;

/// A caller's fd, used for the call (never closed here).
fn borrowed(fd: i32) -> ManuallyDrop<File> {
    // SAFETY: the caller keeps the fd open for the call; ManuallyDrop: never closed here
    ManuallyDrop::new(unsafe { File::from_raw_fd(fd) })
}

/// Leaf blocks of one tree to meta.img: each payload given its header (`ondisk.pack_block`)
/// and CRC-32C, runs of adjacent blocks in one write.
pub struct LeafBlocks {
    out: ManuallyDrop<File>,
    /// the header after the checksum; bytenr and nritems are set per block
    head: [u8; HEADER_SIZE - CSUM_SIZE],
    /// where each block goes: (address, offset in meta.img), in order
    places: Vec<(u64, u64)>,
    written: usize,
    blocks: Vec<u8>,
    blocks_at: u64, // where `blocks` goes in meta.img
}

impl LeafBlocks {
    /// `out_fd`: meta.img (the caller's, kept open for the call); `places`: the tree's block
    /// addresses and their offsets in meta.img, the leaves taking the first ones.
    pub fn new(
        out_fd: i32,
        places: Vec<(u64, u64)>,
        owner: u64,
        generation: u64,
        fsid: [u8; 16],
        chunk_tree_uuid: [u8; 16],
    ) -> LeafBlocks {
        let mut head = [0u8; HEADER_SIZE - CSUM_SIZE];
        head[..16].copy_from_slice(&fsid);
        head[24..32].copy_from_slice(&HEADER_FLAGS.to_le_bytes());
        head[32..48].copy_from_slice(&chunk_tree_uuid);
        head[48..56].copy_from_slice(&generation.to_le_bytes());
        head[56..64].copy_from_slice(&owner.to_le_bytes());
        // nritems at 64..68, level (0) at 68
        LeafBlocks {
            out: borrowed(out_fd),
            head,
            places,
            written: 0,
            blocks: Vec::with_capacity(WINDOW + NODESIZE),
            blocks_at: 0,
        }
    }

    /// The next leaf (`payload`: LEAF_DATA_SIZE bytes).
    pub fn put(&mut self, payload: &[u8], nritems: u32) -> io::Result<()> {
        let Some(&(bytenr, physical)) = self.places.get(self.written) else {
            return Err(io::Error::other(format!(
                "more leaves than the {} blocks planned",
                self.places.len()
            )));
        };
        self.written += 1;
        let pending = self.blocks.len() as u64;
        if pending != 0 && (physical != self.blocks_at + pending || self.blocks.len() >= WINDOW) {
            self.flush()?;
        }
        if self.blocks.is_empty() {
            self.blocks_at = physical;
        }
        let out = &mut self.blocks;
        let at = out.len();
        out.extend_from_slice(&[0u8; CSUM_SIZE]);
        out.extend_from_slice(&self.head);
        out[at + CSUM_SIZE + 16..at + CSUM_SIZE + 24].copy_from_slice(&bytenr.to_le_bytes());
        out[at + HEADER_SIZE - 5..at + HEADER_SIZE - 1].copy_from_slice(&nritems.to_le_bytes());
        out.extend_from_slice(payload);
        let crc = crc32c::crc32c(&out[at + CSUM_SIZE..at + NODESIZE]);
        out[at..at + 4].copy_from_slice(&crc.to_le_bytes());
        Ok(())
    }

    /// Write what is pending: the blocks' count.
    pub fn flush(&mut self) -> io::Result<usize> {
        if !self.blocks.is_empty() {
            self.out.write_all_at(&self.blocks, self.blocks_at)?;
            self.blocks.clear();
        }
        Ok(self.written)
    }
}

/// Write the leaves (`leaves`: each (offset of its payload in the spill file, item count),
/// in order) as level-0 blocks of tree `owner`, leaf `i` at `places[i]` ((address, offset
/// in meta.img); the tree's nodes take the places after the leaves').
#[pyfunction]
#[pyo3(signature = (spill_fd, out_fd, leaves, places, owner, generation, fsid, chunk_tree_uuid))]
#[allow(clippy::too_many_arguments)]
pub fn write_spilled_leaves(
    py: Python<'_>,
    spill_fd: i32,
    out_fd: i32,
    leaves: Vec<(u64, u32)>,
    places: Vec<(u64, u64)>,
    owner: u64,
    generation: u64,
    fsid: [u8; 16],
    chunk_tree_uuid: [u8; 16],
) -> PyResult<()> {
    let mut blocks = LeafBlocks::new(out_fd, places, owner, generation, fsid, chunk_tree_uuid);
    let spill = borrowed(spill_fd);
    py.detach(|| -> io::Result<()> {
        let mut window: Vec<u8> = Vec::with_capacity(WINDOW);
        let mut window_at = 0u64;
        for (i, &(spilled_at, nritems)) in leaves.iter().enumerate() {
            let end = spilled_at + LEAF_DATA_SIZE as u64;
            if spilled_at < window_at || end > window_at + window.len() as u64 {
                // the next leaves' payloads, while they lie one after another in the file
                let mut want = LEAF_DATA_SIZE as u64;
                for &(next, _) in &leaves[i + 1..] {
                    if next != spilled_at + want || want as usize + LEAF_DATA_SIZE > WINDOW {
                        break;
                    }
                    want += LEAF_DATA_SIZE as u64;
                }
                window.resize(want as usize, 0);
                spill.read_exact_at(&mut window, spilled_at).map_err(|e| {
                    io::Error::new(e.kind(), format!("leaf spill file: short read at {spilled_at}: {e}"))
                })?;
                window_at = spilled_at;
            }
            let from = (spilled_at - window_at) as usize;
            blocks.put(&window[from..from + LEAF_DATA_SIZE], nritems)?;
        }
        blocks.flush().map(|_| ())
    })
    .map_err(crate::os_err)
}
