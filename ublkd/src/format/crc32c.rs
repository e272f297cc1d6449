//! crc32c (Castagnoli), as btrfs uses it: tree block checksums ([`super::block_form`],
//! the structural check) and name hashes. The `crc32c` crate computes it (SSE 4.2's
//! `crc32` instruction where the CPU has it, a table otherwise); the build's Python
//! extension compiles this file too (`native/src/blockform.rs`), so both use one CRC.

/// The CRC-32C of `data` (what a tree block's csum field holds, little-endian).
pub fn crc32c(data: &[u8]) -> u32 {
    ::crc32c::crc32c(data)
}

/// The kernel's `crc32c(seed, data)`: no inversion before or after (btrfs' name hash is
/// `crc32c(~1, name)`). The crate's `crc32c_append` continues a finished CRC, inverted
/// before and after, hence the inversions around it.
pub fn crc32c_update(c: u32, data: &[u8]) -> u32 {
    !::crc32c::crc32c_append(!c, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, one bit at a time: reflected polynomial 0x82F63B78.
    fn bytewise(mut c: u32, data: &[u8]) -> u32 {
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
            }
        }
        c
    }

    #[test]
    fn matches_the_definition() {
        // the check value of CRC-32C (RFC 3720, B.4)
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let data: Vec<u8> = (0..4099u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in [0, 1, 7, 8, 63, 64, 4096, 4099] {
            let d = &data[..len];
            assert_eq!(crc32c(d), !bytewise(!0, d), "len {len}");
            for seed in [0, !1, 0xdead_beef] {
                assert_eq!(crc32c_update(seed, d), bytewise(seed, d), "len {len} seed {seed:#x}");
            }
        }
    }
}
