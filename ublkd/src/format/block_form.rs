//! meta.img's block form (docs/bundle-format.md, "The block form"): what a
//! format_version 3 bundle's `meta.img.patch` is made between. In every block of
//! `nodesize` bytes at a multiple of it, clear of the superblock copies, whose header
//! carries the superblock's fsid (a tree block): the checksum's first 4 bytes are XORed
//! with the CRC-32C of the bytes after the checksum, a leaf's item data offsets are
//! stored as differences from the packed position, the fsid becomes 0 and the chunk
//! tree uuid is XORed with the first tree block's. Other blocks' fsid fields cycle
//! (0 -> all ones -> fsid -> 0), so the inverse tells tree blocks (0 there) from the
//! rest and the transform is reversible for any file. patch.py's `_block_form` is the
//! same transform; the builder's extension compiles this file too (native/src/blockform.rs).

use super::crc32c::crc32c;

const SUPER_OFFSET: usize = 64 * 1024;
const SUPER_SIZE: usize = 4096;
const SUPER_MIRRORS: [u64; 3] = [64 * 1024, 64 * 1024 * 1024, 256 * 1024 * 1024 * 1024];
const HEADER_SIZE: usize = 101;
const ITEM_SIZE: usize = 25;
const NRITEMS_AT: usize = 96;
const LEVEL_AT: usize = 100;
/// the header's chunk tree uuid
const CTU_AT: usize = 64;
const ZERO_ID: [u8; 16] = [0; 16];
const ONES_ID: [u8; 16] = [0xff; 16];

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// `img` turned into its block form in place (`inverse`: back from it).
pub fn transform(img: &mut [u8], inverse: bool) {
    if img.len() < SUPER_OFFSET + SUPER_SIZE {
        return;
    }
    let ns = u32_at(img, SUPER_OFFSET + 0x94) as usize;
    if !(4096..=65536).contains(&ns) || !ns.is_power_of_two() {
        return;
    }
    let mut fsid = [0u8; 16];
    fsid.copy_from_slice(&img[SUPER_OFFSET + 0x20..SUPER_OFFSET + 0x30]);
    // the fsid field's cycle; without it (an fsid of 0 or all ones) tree blocks keep it
    let cycle = fsid != ZERO_ID && fsid != ONES_ID;
    let tree_id = if cycle && inverse { ZERO_ID } else { fsid };
    let most = (ns - HEADER_SIZE) / ITEM_SIZE;
    let mut first_ctu: Option<[u8; 16]> = None;
    for (i, blk) in img.chunks_exact_mut(ns).enumerate() {
        let at = (i * ns) as u64;
        let near_super = SUPER_MIRRORS
            .iter()
            .any(|&s| at < s + SUPER_SIZE as u64 && s < at + ns as u64);
        if near_super {
            continue;
        }
        let field: [u8; 16] = blk[32..48].try_into().expect("16 bytes");
        if field != tree_id {
            if cycle {
                // the cycle's other steps (fsid -> 0 is a tree block's)
                let to = match (inverse, field) {
                    (false, ZERO_ID) => Some(ONES_ID),
                    (false, ONES_ID) => Some(fsid),
                    (true, ONES_ID) => Some(ZERO_ID),
                    (true, f) if f == fsid => Some(ONES_ID),
                    _ => None,
                };
                if let Some(to) = to {
                    blk[32..48].copy_from_slice(&to);
                }
            }
            continue;
        }
        let mut csum = if inverse { 0 } else { crc32c(&blk[32..]) };
        if cycle {
            blk[32..48].copy_from_slice(if inverse { &fsid } else { &ZERO_ID });
            match first_ctu {
                None => first_ctu = Some(blk[CTU_AT..CTU_AT + 16].try_into().expect("16 bytes")),
                Some(r) => blk[CTU_AT..CTU_AT + 16].iter_mut().zip(r).for_each(|(b, r)| *b ^= r),
            }
        }
        if blk[LEVEL_AT] == 0 {
            let n = (u32_at(blk, NRITEMS_AT) as usize).min(most);
            // where the first item's data ends: the leaf's end
            let mut end = (ns - HEADER_SIZE) as u32;
            for item in 0..n {
                let off_at = HEADER_SIZE + item * ITEM_SIZE + 17;
                let (off, size) = (u32_at(blk, off_at), u32_at(blk, off_at + 4));
                if inverse {
                    end = off.wrapping_add(end).wrapping_sub(size);
                    put_u32(blk, off_at, end);
                } else {
                    put_u32(blk, off_at, off.wrapping_sub(end).wrapping_add(size));
                    end = off;
                }
            }
        }
        if inverse {
            csum = crc32c(&blk[32..]);
        }
        let stored = u32_at(blk, 0);
        put_u32(blk, 0, stored ^ csum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A meta.img-like file: zeros, a superblock (nodesize 4096), two leaves with packed
    /// items and valid checksums, a block of zeros.
    fn image() -> Vec<u8> {
        let ns = 4096;
        let mut img = vec![0u8; SUPER_OFFSET + 4 * ns];
        let fsid = [7u8; 16];
        img[SUPER_OFFSET + 0x20..SUPER_OFFSET + 0x30].copy_from_slice(&fsid);
        put_u32(&mut img, SUPER_OFFSET + 0x94, ns as u32);
        for (b, sizes) in [(1usize, [10u32, 30, 0]), (2, [100, 5, 60])] {
            let blk = &mut img[SUPER_OFFSET + b * ns..SUPER_OFFSET + (b + 1) * ns];
            blk[32..48].copy_from_slice(&fsid);
            blk[CTU_AT..CTU_AT + 16].copy_from_slice(&[3u8; 16]);
            put_u32(blk, NRITEMS_AT, 3);
            let mut end = (ns - HEADER_SIZE) as u32;
            for (i, s) in sizes.iter().enumerate() {
                end -= s;
                put_u32(blk, HEADER_SIZE + i * ITEM_SIZE + 17, end);
                put_u32(blk, HEADER_SIZE + i * ITEM_SIZE + 21, *s);
                blk[HEADER_SIZE + i * ITEM_SIZE] = b as u8 + i as u8; // a key byte
            }
            let c = crc32c(&blk[32..]);
            put_u32(blk, 0, c);
        }
        img
    }

    #[test]
    fn packed_offsets_and_valid_checksums_become_zero_and_come_back() {
        let img = image();
        let mut form = img.clone();
        transform(&mut form, false);
        for b in 1..=2 {
            let blk = &form[SUPER_OFFSET + b * 4096..];
            assert_eq!(u32_at(blk, 0), 0);
            assert_eq!(blk[32..48], ZERO_ID);
            for i in 0..3 {
                assert_eq!(u32_at(blk, HEADER_SIZE + i * ITEM_SIZE + 17), 0);
            }
        }
        // the chunk tree uuid: the first tree block's as it is, the next one's XORed with it
        assert_eq!(form[SUPER_OFFSET + 4096 + CTU_AT..][..16], [3u8; 16]);
        assert_eq!(form[SUPER_OFFSET + 2 * 4096 + CTU_AT..][..16], ZERO_ID);
        assert_eq!(form[SUPER_OFFSET..][..4096], img[SUPER_OFFSET..][..4096]);
        // blocks of zeros: only their fsid field changes, to all ones (the cycle's step)
        for at in (0..SUPER_OFFSET).step_by(4096).chain([SUPER_OFFSET + 3 * 4096]) {
            let (got, was) = (&form[at..at + 4096], &img[at..at + 4096]);
            assert_eq!(got[32..48], ONES_ID);
            assert!(got[..32] == was[..32] && got[48..] == was[48..]);
        }
        transform(&mut form, true);
        assert_eq!(form, img);
        // any bytes come back, whatever they hold
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut noise = image();
        for b in noise[SUPER_OFFSET + 4096..].iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        // tree blocks (leaves), fields of 0, all ones, and other bytes
        for b in 1..4 {
            let at = SUPER_OFFSET + b * 4096;
            match b {
                1 | 2 => noise.copy_within(SUPER_OFFSET + 0x20..SUPER_OFFSET + 0x30, at + 32),
                _ => noise[at + 32..at + 48].copy_from_slice(&ONES_ID),
            }
            noise[at + LEVEL_AT] = 0;
        }
        let mut back = noise.clone();
        transform(&mut back, false);
        assert_ne!(back, noise);
        transform(&mut back, true);
        assert_eq!(back, noise);
        // an fsid of 0 or all ones: no cycle, tree blocks keep the field
        for fsid in [ZERO_ID, ONES_ID] {
            let mut odd = noise.clone();
            odd[SUPER_OFFSET + 0x20..SUPER_OFFSET + 0x30].copy_from_slice(&fsid);
            let mut back = odd.clone();
            transform(&mut back, false);
            assert_ne!(back, odd);
            transform(&mut back, true);
            assert_eq!(back, odd);
        }
    }
}
