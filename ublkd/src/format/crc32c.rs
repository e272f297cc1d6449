//! crc32c (Castagnoli), as btrfs uses it: tree block checksums ([`super::block_form`],
//! the structural check) and name hashes.

const fn crc_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}
static CRC_TABLE: [u32; 256] = crc_table();

pub fn crc32c(data: &[u8]) -> u32 {
    !crc32c_update(!0, data)
}

/// The kernel's `crc32c(seed, data)`: no inversion before or after.
pub fn crc32c_update(mut c: u32, data: &[u8]) -> u32 {
    for &b in data {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    c
}
