//! sha256 of up to four independent messages at once (the pack's chunk digests).
//!
//! SHA-NI's `sha256rnds2` is latency-bound: one stream runs at ~1.8 GB/s on the AMD EPYC
//! of bench/results/issue23-log.md while the unit could take more. Interleaving the rounds of
//! independent messages in one loop fills its pipeline (a stand-alone loop over 1 MiB
//! messages: 2 lanes 2.0-2.3 GB/s, 4 lanes 3.2-3.4 GB/s, 8 lanes ~3.0 GB/s, as 4 lanes
//! already use every xmm register). Each lane's bytes come as a list of slices (the spans
//! of a pack chunk); a block that straddles two slices is gathered in the lane's tail.
//! Without SHA-NI, and for a single lane, the `sha2` crate's compress runs instead.

use sha2::digest::consts::U64;
use sha2::digest::generic_array::GenericArray;

/// lanes hashed together at most
pub const LANES: usize = 4;

const IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// One message's sha256 in progress: the state after its whole blocks, the bytes fed so
/// far and the last partial block (`len % 64` bytes of `tail`). About 110 bytes: a mark's
/// snapshot of it is a copy.
#[derive(Clone)]
pub struct Lane {
    state: [u32; 8],
    len: u64,
    tail: [u8; 64],
}

impl Default for Lane {
    fn default() -> Lane {
        Lane {
            state: IV,
            len: 0,
            tail: [0; 64],
        }
    }
}

impl Lane {
    /// Bytes fed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The digest of the bytes fed (the lane itself stays as it is).
    pub fn finish(&self) -> [u8; 32] {
        let fill = (self.len % 64) as usize;
        let mut last = [0u8; 128];
        last[..fill].copy_from_slice(&self.tail[..fill]);
        last[fill] = 0x80;
        let n = if fill < 56 { 64 } else { 128 };
        last[n - 8..n].copy_from_slice(&(self.len * 8).to_be_bytes());
        let mut state = self.state;
        compress_one(&mut state, &last[..n]);
        let mut out = [0u8; 32];
        for (o, w) in out.chunks_exact_mut(4).zip(state) {
            o.copy_from_slice(&w.to_be_bytes());
        }
        out
    }
}

/// The `sha2` crate's compress over whole blocks (`data.len()` a multiple of 64).
fn compress_one(state: &mut [u32; 8], data: &[u8]) {
    debug_assert!(data.len() % 64 == 0);
    // SAFETY: GenericArray<u8, U64> is a repr(transparent) [u8; 64] (alignment 1), and
    // `data` holds `len / 64` of them
    let blocks: &[GenericArray<u8, U64>] = unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), data.len() / 64) };
    sha2::compress256(state, blocks);
}

/// Where a lane's next blocks come from in one round.
#[derive(Clone, Copy)]
enum Source {
    /// its tail, gathered full from the ends of slices
    Tail,
    /// this many whole blocks in place in the current slice
    Direct(usize),
}

/// Lane `i` fed the slices of `parts[i]` in order, the lanes' blocks compressed together
/// (`lanes.len() == parts.len() <= LANES`).
pub fn update_lanes(lanes: &mut [&mut Lane], parts: &[&[&[u8]]]) {
    assert!(lanes.len() == parts.len() && lanes.len() <= LANES);
    let k = lanes.len();
    // each lane's place: slice index and offset in it
    let mut at = [(0usize, 0usize); LANES];
    loop {
        let mut active = [0usize; LANES];
        let mut sources = [Source::Tail; LANES];
        let mut n_active = 0;
        let mut blocks = usize::MAX;
        for i in 0..k {
            let lane = &mut *lanes[i];
            let (part, off) = &mut at[i];
            while *part < parts[i].len() && *off == parts[i][*part].len() {
                (*part, *off) = (*part + 1, 0);
            }
            let rest = parts[i].get(*part).map_or(&[][..], |p| &p[*off..]);
            let fill = (lane.len % 64) as usize;
            let source = if fill == 0 && rest.len() >= 64 {
                Source::Direct(rest.len() / 64)
            } else {
                // gather the tail across slices until it is a whole block or the bytes end
                let mut fill = fill;
                while fill < 64 && *part < parts[i].len() {
                    let p = &parts[i][*part][*off..];
                    let n = p.len().min(64 - fill);
                    lane.tail[fill..fill + n].copy_from_slice(&p[..n]);
                    fill += n;
                    lane.len += n as u64;
                    *off += n;
                    if *off == parts[i][*part].len() {
                        (*part, *off) = (*part + 1, 0);
                    }
                }
                if fill < 64 {
                    continue; // this lane's bytes are all in (the rest waits in its tail)
                }
                Source::Tail
            };
            blocks = blocks.min(match source {
                Source::Tail => 1,
                Source::Direct(n) => n,
            });
            active[n_active] = i;
            sources[n_active] = source;
            n_active += 1;
        }
        if n_active == 0 {
            return;
        }
        let mut states = [std::ptr::null_mut::<[u32; 8]>(); LANES];
        let mut data = [std::ptr::null::<u8>(); LANES];
        for j in 0..n_active {
            let i = active[j];
            let lane = &mut *lanes[i];
            states[j] = &mut lane.state;
            data[j] = match sources[j] {
                Source::Tail => lane.tail.as_ptr(),
                Source::Direct(_) => {
                    let (part, off) = at[i];
                    parts[i][part][off..].as_ptr()
                }
            };
        }
        // SAFETY: the states are distinct lanes' and each data pointer has `blocks`
        // whole blocks (a full tail is one; a slice's rest at least `blocks`)
        unsafe { compress_lanes(&states[..n_active], &data[..n_active], blocks) };
        for j in 0..n_active {
            if let Source::Direct(_) = sources[j] {
                let i = active[j];
                at[i].1 += 64 * blocks;
                lanes[i].len += 64 * blocks as u64;
            }
        }
    }
}

/// `blocks` whole blocks at each `data[j]` compressed into `*states[j]`.
///
/// # Safety
/// Each `states[j]` is valid and distinct, each `data[j]` readable for `64 * blocks` bytes.
unsafe fn compress_lanes(states: &[*mut [u32; 8]], data: &[*const u8], blocks: usize) {
    #[cfg(target_arch = "x86_64")]
    if states.len() > 1 && ni::available() {
        match states.len() {
            2 => return ni::compress::<2>(states, data, blocks),
            3 => return ni::compress::<3>(states, data, blocks),
            4 => return ni::compress::<4>(states, data, blocks),
            _ => {}
        }
    }
    for (&s, &d) in states.iter().zip(data) {
        compress_one(&mut *s, std::slice::from_raw_parts(d, 64 * blocks));
    }
}

#[cfg(target_arch = "x86_64")]
mod ni {
    use std::arch::x86_64::*;

    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
        0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
        0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
        0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
        0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
        0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
        0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];

    /// SHA-NI and the SSE it needs (std caches the CPUID answer).
    pub fn available() -> bool {
        is_x86_feature_detected!("sha")
            && is_x86_feature_detected!("sse2")
            && is_x86_feature_detected!("ssse3")
            && is_x86_feature_detected!("sse4.1")
    }

    /// The next four message words: W[i..i+4] from the four before them.
    #[inline(always)]
    unsafe fn schedule(w0: __m128i, w1: __m128i, w2: __m128i, w3: __m128i) -> __m128i {
        let t = _mm_add_epi32(_mm_sha256msg1_epu32(w0, w1), _mm_alignr_epi8(w3, w2, 4));
        _mm_sha256msg2_epu32(t, w3)
    }

    /// `blocks` blocks of each lane, the lanes' rounds interleaved.
    ///
    /// # Safety
    /// As `compress_lanes`, with `states.len() == data.len() == N`, on a CPU with SHA-NI.
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub unsafe fn compress<const N: usize>(states: &[*mut [u32; 8]], data: &[*const u8], blocks: usize) {
        let bswap = _mm_set_epi64x(0x0c0d_0e0f_0809_0a0b, 0x0405_0607_0001_0203);
        let mut abef = [_mm_setzero_si128(); N];
        let mut cdgh = [_mm_setzero_si128(); N];
        for j in 0..N {
            // the state words a..h as the rounds want them: ABEF and CDGH
            let p = states[j] as *const __m128i;
            let dcba = _mm_shuffle_epi32(_mm_loadu_si128(p), 0xb1);
            let efgh = _mm_shuffle_epi32(_mm_loadu_si128(p.add(1)), 0x1b);
            abef[j] = _mm_alignr_epi8(dcba, efgh, 8);
            cdgh[j] = _mm_blend_epi16(efgh, dcba, 0xf0);
        }
        for b in 0..blocks {
            let (abef0, cdgh0) = (abef, cdgh);
            let mut w = [[_mm_setzero_si128(); 4]; N];
            for j in 0..N {
                let p = data[j].add(64 * b) as *const __m128i;
                for (q, wq) in w[j].iter_mut().enumerate() {
                    *wq = _mm_shuffle_epi8(_mm_loadu_si128(p.add(q)), bswap);
                }
            }
            for i in 0..16 {
                let k = _mm_loadu_si128(K.as_ptr().add(4 * i) as *const __m128i);
                let mut t = [_mm_setzero_si128(); N];
                for j in 0..N {
                    if i >= 4 {
                        let wj = &mut w[j];
                        wj[i % 4] = schedule(wj[i % 4], wj[(i + 1) % 4], wj[(i + 2) % 4], wj[(i + 3) % 4]);
                    }
                    t[j] = _mm_add_epi32(w[j][i % 4], k);
                }
                for j in 0..N {
                    cdgh[j] = _mm_sha256rnds2_epu32(cdgh[j], abef[j], t[j]);
                }
                for j in 0..N {
                    abef[j] = _mm_sha256rnds2_epu32(abef[j], cdgh[j], _mm_shuffle_epi32(t[j], 0x0e));
                }
            }
            for j in 0..N {
                abef[j] = _mm_add_epi32(abef[j], abef0[j]);
                cdgh[j] = _mm_add_epi32(cdgh[j], cdgh0[j]);
            }
        }
        for j in 0..N {
            let feba = _mm_shuffle_epi32(abef[j], 0x1b);
            let dchg = _mm_shuffle_epi32(cdgh[j], 0xb1);
            let p = states[j] as *mut __m128i;
            _mm_storeu_si128(p, _mm_blend_epi16(feba, dchg, 0xf0));
            _mm_storeu_si128(p.add(1), _mm_alignr_epi8(dchg, feba, 8));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::tests::Rng;
    use sha2::{Digest, Sha256};

    /// Cut into slices of random lengths (empty ones included), block-aligned or not.
    fn cut<'a>(data: &'a [u8], rng: &mut Rng) -> Vec<&'a [u8]> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < data.len() {
            let n = match rng.below(4) {
                0 => 0,
                1 => 64 * rng.below(40) as usize,
                2 => rng.below(200) as usize,
                _ => rng.below(20_000) as usize,
            }
            .min(data.len() - at);
            out.push(&data[at..at + n]);
            at += n;
        }
        if rng.below(2) == 0 {
            out.push(&data[at..]);
        }
        out
    }

    /// 1-4 lanes of unequal lengths, fed in several calls (each a random cut of the
    /// message, some lanes fed nothing in a call), give sha2's digests (the SHA-NI lanes
    /// where the CPU has it; one lane is always sha2's compress).
    #[test]
    fn lanes_match_sha2() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let pool: Vec<u8> = (0..600_000).map(|_| rng.next() as u8).collect();
        for round in 0..400 {
            let k = 1 + round % LANES;
            let msgs: Vec<&[u8]> = (0..k)
                .map(|_| {
                    let len = match rng.below(3) {
                        0 => rng.below(130),
                        1 => rng.below(5000),
                        _ => rng.below(300_000),
                    } as usize;
                    let at = rng.below((pool.len() - len) as u64) as usize;
                    &pool[at..at + len]
                })
                .collect();
            let mut lanes: Vec<Lane> = vec![Lane::default(); k];
            let mut fed = vec![0usize; k];
            while fed.iter().zip(&msgs).any(|(f, m)| f < &m.len()) {
                let pieces: Vec<Vec<&[u8]>> = (0..k)
                    .map(|i| {
                        let left = msgs[i].len() - fed[i];
                        let n = if rng.below(3) == 0 {
                            left
                        } else {
                            rng.below(left as u64 + 1) as usize
                        };
                        let piece = &msgs[i][fed[i]..fed[i] + n];
                        fed[i] += n;
                        cut(piece, &mut rng)
                    })
                    .collect();
                let parts: Vec<&[&[u8]]> = pieces.iter().map(|p| &p[..]).collect();
                let mut refs: Vec<&mut Lane> = lanes.iter_mut().collect();
                update_lanes(&mut refs, &parts);
            }
            for (lane, msg) in lanes.iter().zip(&msgs) {
                assert_eq!(lane.len(), msg.len() as u64);
                let want: [u8; 32] = Sha256::digest(msg).into();
                assert_eq!(lane.finish(), want, "round {round}, {k} lanes, {} bytes", msg.len());
            }
        }
    }

    /// The padding's edge lengths (a tail of 55, 56, 63, 64 bytes), fed in two halves.
    #[test]
    fn one_lane_edges() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
        for len in [0usize, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 300] {
            let mut lane = Lane::default();
            update_lanes(&mut [&mut lane], &[&[&data[..len / 2]]]);
            update_lanes(&mut [&mut lane], &[&[&data[len / 2..len]]]);
            let want: [u8; 32] = Sha256::digest(&data[..len]).into();
            assert_eq!(lane.finish(), want, "{len} bytes");
        }
    }
}
