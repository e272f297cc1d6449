//! A base image's packs (`build --base`, base.py): the base's content is read from them for
//! its index (each file's CRC-32C, `BasePacks.crcs`) and for the pack's deduplication
//! compares (pack.rs), and no byte of a chunk is used before the chunk's stored bytes
//! matched their sha256 in the base's blockmap. Each chunk is checked once: the result is
//! kept, so a base build reads a chunk twice (checked, then compared) rather than hashing it
//! at every compare.
//!
//! A chunk is checked and then read again by `pread`. A pack file that changes in between
//! cannot make a wrong image: the new bundle holds the same file (a hard link, else a copy
//! made later), with the base's digests, so a changed chunk fails its digest at every read.
//! A read of a base pack that fails (the file cut short since) counts as a chunk that fails
//! its digest: its content is not the base's, and is written anew.
//!
//! Only packs stored raw (chunk `i` at `i * chunk_size`) are opened here; a base with a
//! compressed pack keeps the Python path (base.py, packs.py).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use sha2::{Digest, Sha256};

use crate::os_err;
use crate::pack::{pread_exact, Loc};

/// What `BasePackSet::visit` hands a range's bytes to, in order.
type Piece<'a> = dyn FnMut(&[u8]) + 'a;

const UNCHECKED: u8 = 0;
const GOOD: u8 = 1;
const BAD: u8 = 2;

struct BasePack {
    file: File,
    size: u64,
    digests: Vec<[u8; 32]>,
    state: Vec<AtomicU8>,
}

/// The base's packs, numbered `first..first + n` in the new image.
pub struct BasePackSet {
    chunk_size: u64,
    first: u32,
    packs: Vec<BasePack>,
}

impl BasePackSet {
    fn pack(&self, pack: u32) -> Option<&BasePack> {
        self.packs.get(pack.checked_sub(self.first)? as usize)
    }

    /// Whether `pack` is one of the base's.
    pub fn holds(&self, pack: u32) -> bool {
        self.pack(pack).is_some()
    }

    pub fn fd(&self, pack: u32) -> Option<RawFd> {
        self.pack(pack).map(|p| p.file.as_raw_fd())
    }

    /// Whether every chunk holding `len` bytes at `loc` matches its digest (false too when
    /// the range passes the pack's end or cannot be read).
    pub fn verified(&self, loc: Loc, len: u64) -> bool {
        self.visit(loc, len, &mut Vec::new(), None).is_some()
    }

    /// The CRC-32C of `len` bytes at `loc`, None where a chunk of them fails its digest.
    fn crc(&self, loc: Loc, len: u64, buf: &mut Vec<u8>) -> Option<u32> {
        let mut crc = 0u32;
        self.visit(
            loc,
            len,
            buf,
            Some(&mut |piece| crc = crc32c::crc32c_append(crc, piece)),
        )?;
        Some(crc)
    }

    /// Checks the chunks holding `len` bytes at `loc` (each read once, whole, for its
    /// digest), and hands `piece` (where there is one) those bytes in order;
    /// None where a chunk fails its digest, cannot be read (the file changed since it was
    /// opened: not the base's bytes, as a failed digest) or the range passes the pack's end.
    fn visit(&self, loc: Loc, len: u64, buf: &mut Vec<u8>, mut piece: Option<&mut Piece>) -> Option<()> {
        let p = self.pack(loc.0)?;
        let (offset, cs) = (loc.1, self.chunk_size);
        if len == 0 {
            return Some(());
        }
        if offset.checked_add(len).is_none_or(|end| end > p.size) {
            return None;
        }
        let fd = p.file.as_raw_fd();
        let end = offset + len;
        for index in offset / cs..=(end - 1) / cs {
            let start = index * cs;
            let (from, to) = (offset.max(start), end.min(start + cs));
            let state = &p.state[index as usize];
            match state.load(Ordering::Relaxed) {
                GOOD => {
                    if let Some(piece) = piece.as_mut() {
                        buf.resize((to - from) as usize, 0);
                        if pread_exact(fd, buf, from).is_err() {
                            return None;
                        }
                        piece(buf);
                    }
                }
                BAD => return None,
                _ => {
                    buf.resize(cs.min(p.size - start) as usize, 0);
                    let good = pread_exact(fd, buf, start).is_ok()
                        && <[u8; 32]>::from(Sha256::digest(&buf[..])) == p.digests[index as usize];
                    state.store(if good { GOOD } else { BAD }, Ordering::Relaxed);
                    if !good {
                        return None;
                    }
                    if let Some(piece) = piece.as_mut() {
                        piece(&buf[(from - start) as usize..(to - start) as usize]);
                    }
                }
            }
        }
        Some(())
    }
}

/// A base image's raw packs for a build on it (base.py `BaseImage`, packs.py `PackWriter`).
#[pyclass(frozen)]
pub struct BasePacks {
    pub set: Arc<BasePackSet>,
}

#[pymethods]
impl BasePacks {
    /// `paths[i]` is pack `first + i`, `sizes[i]` its size, `digests[i]` its chunk digests
    /// (32 bytes each, one per `chunk_size` bytes, the last chunk short).
    #[new]
    fn new(paths: Vec<String>, sizes: Vec<u64>, digests: Vec<Vec<u8>>, chunk_size: u64, first: u32) -> PyResult<Self> {
        if chunk_size == 0 || paths.len() != sizes.len() || paths.len() != digests.len() {
            return Err(PyValueError::new_err("base packs: mismatched paths, sizes and digests"));
        }
        let mut packs = Vec::with_capacity(paths.len());
        for ((path, size), table) in paths.iter().zip(sizes).zip(digests) {
            let chunks = size.div_ceil(chunk_size) as usize;
            if table.len() != chunks * 32 {
                return Err(PyValueError::new_err(format!(
                    "{path}: {} chunk digests for {chunks} chunks",
                    table.len() / 32
                )));
            }
            let file =
                File::open(path).map_err(|e| os_err(io::Error::new(e.kind(), format!("{path}: cannot open: {e}"))))?;
            packs.push(BasePack {
                file,
                size,
                digests: table
                    .chunks_exact(32)
                    .map(|d| d.try_into().expect("32 bytes"))
                    .collect(),
                state: (0..chunks).map(|_| AtomicU8::new(UNCHECKED)).collect(),
            });
        }
        Ok(BasePacks {
            set: Arc::new(BasePackSet {
                chunk_size,
                first,
                packs,
            }),
        })
    }

    /// Per run (pack, offset, size): the CRC-32C of its bytes, None where a chunk of them
    /// fails its digest or cannot be read (that content is not indexed: it is written anew).
    fn crcs(&self, py: Python<'_>, runs: Vec<(u32, u64, u64)>) -> Vec<Option<u32>> {
        let set = &self.set;
        // on as many threads as there are CPUs (up to 4), each taking the next file (files in
        // walk order: a chunk's small files are mostly taken one after another)
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
        let next = std::sync::atomic::AtomicUsize::new(0);
        let runs = &runs;
        py.detach(|| {
            let mut out = vec![None; runs.len()];
            std::thread::scope(|scope| {
                let workers: Vec<_> = (0..threads)
                    .map(|_| {
                        scope.spawn(|| {
                            let (mut buf, mut done) = (Vec::new(), Vec::new());
                            loop {
                                let i = next.fetch_add(1, Ordering::Relaxed);
                                let Some(&(pack, offset, size)) = runs.get(i) else {
                                    return done;
                                };
                                done.push((i, set.crc((pack, offset), size, &mut buf)));
                            }
                        })
                    })
                    .collect();
                for worker in workers {
                    for (i, crc) in worker.join().expect("a CRC thread panicked") {
                        out[i] = crc;
                    }
                }
            });
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::tests::{temp_pack, Rng};
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn pack_set(data: &[u8], chunk: u64, first: u32, name: &str) -> (std::path::PathBuf, BasePackSet) {
        let (path, mut file) = temp_pack(name);
        file.write_all(data).unwrap();
        let digests = data
            .chunks(chunk as usize)
            .map(|c| <[u8; 32]>::from(Sha256::digest(c)))
            .collect::<Vec<_>>();
        let n = digests.len();
        let set = BasePackSet {
            chunk_size: chunk,
            first,
            packs: vec![BasePack {
                file: File::open(&path).unwrap(),
                size: data.len() as u64,
                digests,
                state: (0..n).map(|_| AtomicU8::new(UNCHECKED)).collect(),
            }],
        };
        (path, set)
    }

    /// A range is verified only where every chunk it touches matches its digest; a chunk
    /// changed after the table was made fails every range that touches it, and only those.
    #[test]
    fn ranges_are_verified_by_their_chunks() {
        let mut rng = Rng(7);
        let data = rng.bytes(10 * 4096 + 100);
        let (path, set) = pack_set(&data, 4096, 3, "base-verify");
        assert!(set.holds(3) && !set.holds(2) && !set.holds(4));
        assert!(!set.verified((2, 0), 1)); // not a base pack
        assert!(set.verified((3, 4000), 200)); // chunks 0 and 1
        assert!(!set.verified((3, data.len() as u64 - 10), 11)); // past the end
        assert!(set.verified((3, 40960), 100)); // the short last chunk

        // chunk 5 changed on disk: unchecked chunks read it as it is now
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(b"x", 5 * 4096 + 17).unwrap();
        assert!(!set.verified((3, 5 * 4096 - 1), 2));
        assert!(!set.verified((3, 6 * 4096 - 1), 1)); // checked once: still bad
        assert!(set.verified((3, 6 * 4096), 4096));
        let mut buf = Vec::new();
        let whole = crc32c::crc32c(&data[4096..3 * 4096]);
        assert_eq!(set.crc((3, 4096), 2 * 4096, &mut buf), Some(whole));
        assert_eq!(set.crc((3, 4 * 4096), 2 * 4096, &mut buf), None);
        // the file cut short since it was opened: unchecked chunks past its end fail, a
        // checked one's bytes cannot be read (not the base's bytes either), neither errs
        file.set_len(7 * 4096).unwrap();
        assert!(!set.verified((3, 8 * 4096), 10));
        assert!(set.verified((3, 6 * 4096), 10)); // checked before: no read
        assert_eq!(set.crc((3, 6 * 4096 + 10), 4096, &mut buf), None);
        std::fs::remove_file(&path).unwrap();
    }
}
