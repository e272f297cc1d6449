//! The fs tree's leaf blocks written straight from the leaf spill file (`treeblocks.serialize`'s
//! leaf loop with `unspill`, kept as the reference and for `BUI_NATIVE=0`): each payload
//! read back a window at a time, given its header (`ondisk.pack_block`: fsid, address,
//! flags, chunk tree uuid, generation, owner, item count, level 0) and CRC-32C, and written
//! to meta.img, runs of adjacent blocks in one write. No Python object per leaf.

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;

use pyo3::exceptions::PyValueError;
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

/// One leaf block: the header for `bytenr` before `payload`, its CRC-32C in front.
fn leaf_block(out: &mut Vec<u8>, payload: &[u8], nritems: u32, bytenr: u64, head: &[u8; HEADER_SIZE - CSUM_SIZE]) {
    let at = out.len();
    out.extend_from_slice(&[0u8; CSUM_SIZE]);
    out.extend_from_slice(head);
    out[at + CSUM_SIZE + 16..at + CSUM_SIZE + 24].copy_from_slice(&bytenr.to_le_bytes());
    out[at + HEADER_SIZE - 5..at + HEADER_SIZE - 1].copy_from_slice(&nritems.to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32c::crc32c(&out[at + CSUM_SIZE..at + NODESIZE]);
    out[at..at + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Write the leaves (`leaves`: each (offset of its payload in the spill file, item count),
/// in order) as level-0 blocks of tree `owner`, leaf `i` at `places[i]` ((address, offset
/// in meta.img)).
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
    if leaves.len() != places.len() {
        return Err(PyValueError::new_err(
            "write_spilled_leaves: leaves and places differ in number",
        ));
    }
    // the header after the checksum; bytenr and nritems are set per block
    let mut head = [0u8; HEADER_SIZE - CSUM_SIZE];
    head[..16].copy_from_slice(&fsid);
    head[24..32].copy_from_slice(&HEADER_FLAGS.to_le_bytes());
    head[32..48].copy_from_slice(&chunk_tree_uuid);
    head[48..56].copy_from_slice(&generation.to_le_bytes());
    head[56..64].copy_from_slice(&owner.to_le_bytes());
    // nritems at 64..68, level (0) at 68
    let (spill, out) = (borrowed(spill_fd), borrowed(out_fd));
    py.detach(|| -> std::io::Result<()> {
        let mut window: Vec<u8> = Vec::with_capacity(WINDOW);
        let mut window_at = 0u64;
        let mut blocks: Vec<u8> = Vec::with_capacity(WINDOW + NODESIZE);
        let mut blocks_at = 0u64; // where `blocks` goes in meta.img
        for (i, (&(spilled_at, nritems), &(bytenr, physical))) in leaves.iter().zip(&places).enumerate() {
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
                    std::io::Error::new(e.kind(), format!("leaf spill file: short read at {spilled_at}: {e}"))
                })?;
                window_at = spilled_at;
            }
            if !blocks.is_empty() && (physical != blocks_at + blocks.len() as u64 || blocks.len() >= WINDOW) {
                out.write_all_at(&blocks, blocks_at)?;
                blocks.clear();
            }
            if blocks.is_empty() {
                blocks_at = physical;
            }
            let from = (spilled_at - window_at) as usize;
            leaf_block(
                &mut blocks,
                &window[from..from + LEAF_DATA_SIZE],
                nritems,
                bytenr,
                &head,
            );
        }
        if !blocks.is_empty() {
            out.write_all_at(&blocks, blocks_at)?;
        }
        Ok(())
    })
    .map_err(crate::os_err)
}
