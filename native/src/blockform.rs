//! meta.img's *block form* and its inverse (patch.py `_block_form`, kept as the reference
//! and for `BUI_NATIVE=0`; docs/bundle-format.md, "The block form"): what a delta build's
//! meta.img patch is made between and a pull applies it to. The same bytes as the Python
//! function, computed in place in the new bytes object.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

const SUPER_INFO_OFFSET: usize = 64 * 1024;
const SUPER_INFO_SIZE: usize = 4096;
const SUPER_MIRRORS: [u64; 3] = [64 * 1024, 64 * 1024 * 1024, 256 * (1 << 30)];
const NODESIZE_AT: usize = SUPER_INFO_OFFSET + 0x94;
const FSID_AT: usize = SUPER_INFO_OFFSET + 0x20;
const NRITEMS_AT: usize = 96;
const LEVEL_AT: usize = 100;
const CTU_AT: usize = 64;
const HEADER_SIZE: usize = 101;
const ITEM_SIZE: usize = 25;
const ZERO_ID: [u8; 16] = [0; 16];
const ONES_ID: [u8; 16] = [0xff; 16];

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// `img`'s block form (`inverse`: the file from its block form), transformed in place.
pub fn transform(img: &mut [u8], inverse: bool) {
    if img.len() < SUPER_INFO_OFFSET + SUPER_INFO_SIZE {
        return;
    }
    let ns = u32_at(img, NODESIZE_AT) as usize;
    if !(4096..=65536).contains(&ns) || !ns.is_power_of_two() {
        return;
    }
    let fsid: [u8; 16] = img[FSID_AT..FSID_AT + 16].try_into().unwrap();
    // the fsid field's cycle (0 -> all ones -> fsid -> 0); without it tree blocks keep it
    let cycle = fsid != ZERO_ID && fsid != ONES_ID;
    let tree_id = if cycle && inverse { ZERO_ID } else { fsid };
    // the cycle's other steps (fsid -> 0 is a tree block's)
    let step = |field: [u8; 16]| -> [u8; 16] {
        match (inverse, field) {
            (true, f) if f == ONES_ID => ZERO_ID,
            (true, f) if f == fsid => ONES_ID,
            (false, f) if f == ZERO_ID => ONES_ID,
            (false, f) if f == ONES_ID => fsid,
            (_, f) => f,
        }
    };
    let most = (ns - HEADER_SIZE) / ITEM_SIZE;
    let mut first_ctu: Option<[u8; 16]> = None;
    let mut at = 0;
    while at + ns <= img.len() {
        let blk = &mut img[at..at + ns];
        let (start, end) = (at as u64, (at + ns) as u64);
        at += ns;
        if SUPER_MIRRORS
            .iter()
            .any(|&s| start < s + SUPER_INFO_SIZE as u64 && s < end)
        {
            continue;
        }
        let field: [u8; 16] = blk[32..48].try_into().unwrap();
        if field != tree_id {
            if cycle {
                blk[32..48].copy_from_slice(&step(field));
            }
            continue;
        }
        let mut csum = if inverse { 0 } else { crc32c::crc32c(&blk[32..]) };
        if cycle {
            blk[32..48].copy_from_slice(if inverse { &fsid } else { &ZERO_ID });
            match first_ctu {
                None => first_ctu = Some(blk[CTU_AT..CTU_AT + 16].try_into().unwrap()),
                Some(first) => {
                    for (b, f) in blk[CTU_AT..CTU_AT + 16].iter_mut().zip(first) {
                        *b ^= f;
                    }
                }
            }
        }
        if blk[LEVEL_AT] == 0 {
            let n = (u32_at(blk, NRITEMS_AT) as usize).min(most);
            // where the first item's data ends: the leaf's end
            let mut data_end = (ns - HEADER_SIZE) as u32;
            for i in 0..n {
                let item = HEADER_SIZE + i * ITEM_SIZE;
                let (offset, size) = (u32_at(blk, item + 17), u32_at(blk, item + 21));
                if inverse {
                    data_end = offset.wrapping_add(data_end).wrapping_sub(size);
                    put_u32(blk, item + 17, data_end);
                } else {
                    put_u32(blk, item + 17, offset.wrapping_sub(data_end).wrapping_add(size));
                    data_end = offset;
                }
            }
        }
        if inverse {
            csum = crc32c::crc32c(&blk[32..]);
        }
        let stored = u32_at(blk, 0);
        put_u32(blk, 0, stored ^ csum);
    }
}

/// patch.py `block_form` (`inverse`: `from_block_form`).
#[pyfunction]
pub fn block_form<'py>(py: Python<'py>, img: &[u8], inverse: bool) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, img.len(), |out| {
        out.copy_from_slice(img);
        transform(out, inverse);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::tests::Rng;

    /// Noise in every block, with tree-block fsid fields (the fsid, 0, all ones, other ids)
    /// and leaf levels here and there, comes back from its block form; tree blocks' checksums
    /// of valid blocks become 0.
    #[test]
    fn the_inverse_gives_the_bytes_back() {
        let ns = 16384;
        for seed in 1..6u64 {
            let mut rng = Rng(seed);
            let mut img = rng.bytes(ns * 40);
            img[NODESIZE_AT..NODESIZE_AT + 4].copy_from_slice(&(ns as u32).to_le_bytes());
            let fsid: [u8; 16] = match seed {
                1 => ZERO_ID,
                2 => ONES_ID,
                _ => img[FSID_AT..FSID_AT + 16].try_into().unwrap(),
            };
            img[FSID_AT..FSID_AT + 16].copy_from_slice(&fsid);
            let ids = [fsid, ZERO_ID, ONES_ID, [7; 16]];
            for b in (0..40).filter(|&b| b * ns != SUPER_INFO_OFFSET) {
                let blk = &mut img[b * ns..(b + 1) * ns];
                blk[32..48].copy_from_slice(&ids[rng.below(4) as usize]);
                if rng.below(2) == 0 {
                    blk[LEVEL_AT] = 0;
                }
                if b % 3 == 0 && blk[32..48] == fsid {
                    // a valid checksum: 0 in the block form
                    let csum = crc32c::crc32c(&blk[32..]);
                    blk[..4].copy_from_slice(&csum.to_le_bytes());
                }
            }
            let mut form = img.clone();
            transform(&mut form, false);
            assert_ne!(form, img);
            let valid = |b: &usize| b % 3 == 0 && b * ns != SUPER_INFO_OFFSET && img[b * ns + 32..b * ns + 48] == fsid;
            for b in (0..40).filter(valid) {
                assert_eq!(form[b * ns..b * ns + 4], [0; 4], "block {b}");
            }
            transform(&mut form, true);
            assert_eq!(form, img, "seed {seed}");
        }
    }
}
