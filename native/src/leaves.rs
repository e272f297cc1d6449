//! The fs tree's leaves, packed as its items arrive: the same bytes as `treeblocks.LeafPacker`
//! (the Python one, kept as the reference and for `BUI_NATIVE=0`), one call per item and no
//! Python object per item or leaf kept. A leaf is item headers from the front (disk key,
//! data offset, data size), data from the back, zeros between; the sha256 of every item's
//! disk key and data, in order, is the content the fsid derives from.

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;

use std::sync::mpsc::{sync_channel, SyncSender};
use std::thread::JoinHandle;

use sha2::{Digest, Sha256};

pub const NODESIZE: usize = 16384;
pub const HEADER_SIZE: usize = 101;
pub const LEAF_DATA_SIZE: usize = NODESIZE - HEADER_SIZE;
pub const ITEM_SIZE: usize = 25;
pub const DISK_KEY_SIZE: usize = 17;
pub const MAX_ITEM_DATA: usize = LEAF_DATA_SIZE - ITEM_SIZE;
/// spilled payloads are written this many bytes at a time (`SPILL_BUFFER` of writer.py)
const SPILL_BUFFER: usize = 1 << 20;

pub type Key = (u64, u8, u64);

const INODE_ITEM_KEY: u8 = 1;
const INODE_REF_KEY: u8 = 12;
const DIR_ITEM_KEY: u8 = 84;
const DIR_INDEX_KEY: u8 = 96;
const INODE_ITEM_SIZE: usize = 160;
const DIR_ITEM_SIZE: usize = 30;
const NS: i128 = 1_000_000_000;
pub const FILE_EXTENT_ITEM_SIZE: usize = 53;
const FILE_EXTENT_INLINE: u8 = 0;
const FILE_EXTENT_REG: u8 = 1;

/// The kernel's `crc32c(seed, data)`: no inversion before or after (the key hashes below
/// and `extents::extent_data_ref_hash`).
pub(crate) fn raw_crc32c(seed: u32, data: &[u8]) -> u32 {
    !crc32c::crc32c_append(!seed, data)
}

/// `btrfs_name_hash`: a DIR_ITEM's key offset (crc32c seeded with ~1).
pub fn name_hash(name: &[u8]) -> u64 {
    raw_crc32c(!1, name) as u64
}

/// `btrfs_extref_hash`: an INODE_EXTREF's key offset (seeded with the parent's low 32 bits).
pub fn extref_hash(parent: u64, name: &[u8]) -> u64 {
    raw_crc32c(parent as u32, name) as u64
}

/// struct btrfs_dir_item (a DIR_ITEM, DIR_INDEX or XATTR_ITEM's data): the location
/// `(location, INODE_ITEM, 0)` (0 for an xattr), transid, data_len, name_len, type, name, data.
pub fn dir_item(location: u64, location_type: u8, generation: u64, ftype: u8, name: &[u8], data: &[u8]) -> Vec<u8> {
    let mut item = Vec::with_capacity(DIR_ITEM_SIZE + name.len() + data.len());
    item.extend_from_slice(&location.to_le_bytes());
    item.push(location_type);
    item.extend_from_slice(&0u64.to_le_bytes());
    item.extend_from_slice(&generation.to_le_bytes());
    item.extend_from_slice(&(data.len() as u16).to_le_bytes());
    item.extend_from_slice(&(name.len() as u16).to_le_bytes());
    item.push(ftype);
    item.extend_from_slice(name);
    item.extend_from_slice(data);
    item
}

/// struct btrfs_inode_ref: index, name_len, name.
pub fn inode_ref(index: u64, name: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(10 + name.len());
    r.extend_from_slice(&index.to_le_bytes());
    r.extend_from_slice(&(name.len() as u16).to_le_bytes());
    r.extend_from_slice(name);
    r
}

/// struct btrfs_inode_extref: parent, index, name_len, name.
pub fn inode_extref(parent: u64, index: u64, name: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(18 + name.len());
    r.extend_from_slice(&parent.to_le_bytes());
    r.extend_from_slice(&index.to_le_bytes());
    r.extend_from_slice(&(name.len() as u16).to_le_bytes());
    r.extend_from_slice(name);
    r
}

/// struct btrfs_file_extent_item of a regular extent referenced whole: `ram` bytes of file
/// data in `disk_num_bytes` at `disk_bytenr` (`ondisk.pack_file_extent_reg`).
pub fn file_extent_reg(
    generation: u64,
    disk_bytenr: u64,
    disk_num_bytes: u64,
    ram: u64,
    compression: u8,
) -> [u8; FILE_EXTENT_ITEM_SIZE] {
    let mut item = [0u8; FILE_EXTENT_ITEM_SIZE];
    item[..8].copy_from_slice(&generation.to_le_bytes());
    item[8..16].copy_from_slice(&ram.to_le_bytes()); // ram_bytes
    item[16] = compression; // then encryption 0, other_encoding 0
    item[20] = FILE_EXTENT_REG;
    item[21..29].copy_from_slice(&disk_bytenr.to_le_bytes());
    item[29..37].copy_from_slice(&disk_num_bytes.to_le_bytes());
    // offset into the extent 0, then num_bytes
    item[45..53].copy_from_slice(&ram.to_le_bytes());
    item
}

/// An inline file extent item: its header and the data (`ondisk.pack_file_extent_inline`).
pub fn file_extent_inline(generation: u64, data: &[u8]) -> Vec<u8> {
    let mut item = Vec::with_capacity(21 + data.len());
    item.extend_from_slice(&generation.to_le_bytes());
    item.extend_from_slice(&(data.len() as u64).to_le_bytes());
    item.extend_from_slice(&[0, 0, 0, 0, FILE_EXTENT_INLINE]);
    item.extend_from_slice(data);
    item
}

/// An INODE_ITEM's fields (times in ns since the epoch, negative before it).
pub struct InodeFields {
    pub generation: u64,
    pub size: u64,
    pub nbytes: u64,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub rdev: u64,
    pub flags: u64,
    pub atime_ns: i128,
    pub ctime_ns: i128,
    pub mtime_ns: i128,
    pub otime_ns: i128,
}

/// A packed leaf: first key, item count, and its payload (kept) or where it was spilled.
pub struct Leaf {
    pub first_key: Key,
    pub nritems: u32,
    pub payload: Option<Vec<u8>>,
    pub spilled_at: i64,
}

pub struct Packer {
    keys: Vec<Key>,
    ends: Vec<usize>, // end of each item's data in `data`
    data: Vec<u8>,
    pub leaves: Vec<Leaf>,
    /// the spill file (the caller's fd, not closed here), where the next payload goes, and
    /// the payloads not written yet
    spill: Option<ManuallyDrop<File>>,
    spill_pos: u64,
    spill_buf: Vec<u8>,
    spill_nritems: Vec<u32>, // the item count of each leaf in `spill_buf`
    /// with a spill file: the thread that hashes the spilled leaves' items and writes them
    spiller: Option<Spiller>,
    digest: Option<Sha256>,
    /// where the current leaf ends (its first key is `keys[0]`)
    split: Split,
}

/// Where leaves end (`treeblocks.split_leaves`): when the next item does not fit, or, in a
/// build with a base, before each of `breaks` (sorted: the base's leaves' first keys).
pub struct Split {
    used: usize,
    breaks: Vec<Key>,
    /// the first break after the current leaf's first key
    next_break: usize,
}

impl Split {
    pub fn new(breaks: Vec<Key>) -> Split {
        Split {
            used: 0,
            breaks,
            next_break: 0,
        }
    }

    /// Whether an item (`key`, `size` bytes of data) begins a leaf: the first item (`first`,
    /// the current leaf's first key, None), or one that does not fit after the current
    /// leaf's; it is counted in the leaf it goes to. An InvalidInput error for an item
    /// larger than a leaf holds.
    pub fn starts_leaf(&mut self, first: Option<Key>, key: Key, size: usize) -> io::Result<bool> {
        if size > MAX_ITEM_DATA {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("item of {size} bytes does not fit in a {NODESIZE}-byte leaf"),
            ));
        }
        let need = ITEM_SIZE + size;
        let new = match first {
            None => true,
            Some(first) => self.used + need > LEAF_DATA_SIZE || self.ends_before(first, key),
        };
        self.used = if new { need } else { self.used + need };
        Ok(new)
    }

    /// Whether a leaf begun at `first` must end before `key`: a base's leaf began at a key
    /// after `first` and at or before `key`.
    fn ends_before(&mut self, first: Key, key: Key) -> bool {
        if self.breaks.is_empty() {
            return false;
        }
        while self.next_break < self.breaks.len() && self.breaks[self.next_break] <= first {
            self.next_break += 1;
        }
        self.next_break < self.breaks.len() && self.breaks[self.next_break] <= key
    }
}

/// Spilled leaves, a buffer at a time: their payloads, item counts and spill file offset.
type SpillBatch = (Vec<u8>, Vec<u32>, u64);

/// A thread that takes the spill file's writes and the items' sha256 off the packing
/// thread (the writer's main thread): batches in order, a few in flight.
struct Spiller {
    tx: Option<SyncSender<SpillBatch>>,
    handle: Option<JoinHandle<io::Result<Option<Sha256>>>>,
}

/// with the spiller, payloads go to it this many bytes at a time, and one batch waits
/// for it: with the one it works on and the one being filled, less memory than
/// `SPILL_BUFFER` (the build's peak RSS is this writer's)
const SPILL_BATCH: usize = 256 << 10;
const SPILL_QUEUE: usize = 1;

impl Spiller {
    fn start(fd: i32, mut digest: Option<Sha256>) -> io::Result<Spiller> {
        let (tx, rx) = sync_channel::<SpillBatch>(SPILL_QUEUE);
        // SAFETY: the fd stays open for the packer's life, which the thread does not outlive
        // (finish and Drop join it); ManuallyDrop: never closed here
        let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        let handle = std::thread::Builder::new()
            .name("fs-tree-spill".into())
            .spawn(move || {
                for (buf, nritems, pos) in rx {
                    if let Some(h) = &mut digest {
                        for (leaf, &n) in buf.chunks_exact(LEAF_DATA_SIZE).zip(&nritems) {
                            hash_items(h, leaf, n as usize);
                        }
                    }
                    file.write_all_at(&buf, pos)?;
                }
                Ok(digest)
            })?;
        Ok(Spiller {
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    /// The thread's result once every batch is through (its error if a write failed).
    fn join(&mut self) -> io::Result<Option<Sha256>> {
        self.tx = None;
        match self.handle.take() {
            Some(h) => h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("fs tree spill thread panicked"))),
            None => Ok(None),
        }
    }
}

impl Drop for Spiller {
    fn drop(&mut self) {
        let _ = self.join(); // never leave the thread writing to a descriptor being closed
    }
}

/// Hash a leaf payload's items (disk key, then data) as `Packer::flush` packed them.
fn hash_items(h: &mut Sha256, leaf: &[u8], nritems: usize) {
    for head in leaf[..nritems * ITEM_SIZE].chunks_exact(ITEM_SIZE) {
        let offset = u32::from_le_bytes(head[17..21].try_into().expect("4 bytes")) as usize;
        let size = u32::from_le_bytes(head[21..25].try_into().expect("4 bytes")) as usize;
        h.update(&head[..DISK_KEY_SIZE]);
        h.update(&leaf[offset..offset + size]);
    }
}

fn disk_key(key: Key) -> [u8; DISK_KEY_SIZE] {
    let mut out = [0u8; DISK_KEY_SIZE];
    out[..8].copy_from_slice(&key.0.to_le_bytes());
    out[8] = key.1;
    out[9..].copy_from_slice(&key.2.to_le_bytes());
    out
}

impl Packer {
    /// `spill_fd`: payloads go to this file (from offset 0) instead of memory; `digest`:
    /// hash every item's disk key and data.
    pub fn new(spill_fd: Option<i32>, digest: bool, breaks: Vec<Key>) -> Packer {
        let digest = digest.then(Sha256::new);
        // with a spill file, its writes and the digest go to a thread of their own (where one
        // cannot be started, they stay on this one)
        let (spiller, digest) = match spill_fd {
            Some(fd) => match Spiller::start(fd, digest.clone()) {
                Ok(s) => (Some(s), None),
                Err(_) => (None, digest),
            },
            None => (None, digest),
        };
        Packer {
            keys: Vec::new(),
            ends: Vec::new(),
            data: Vec::with_capacity(LEAF_DATA_SIZE),
            leaves: Vec::new(),
            // SAFETY: the fd stays open for the packer's life (the caller's spill file);
            // ManuallyDrop: never closed here
            spill: spill_fd.map(|fd| ManuallyDrop::new(unsafe { File::from_raw_fd(fd) })),
            spill_pos: 0,
            spill_buf: Vec::new(),
            spill_nritems: Vec::new(),
            spiller,
            digest,
            split: Split::new(breaks),
        }
    }

    /// One item, in key order: an InvalidInput error for one larger than a leaf holds, others
    /// from writing the spill file.
    pub fn add(&mut self, key: Key, data: &[u8]) -> io::Result<()> {
        if self.split.starts_leaf(self.keys.first().copied(), key, data.len())? && !self.keys.is_empty() {
            self.flush()?;
        }
        self.keys.push(key);
        self.data.extend_from_slice(data);
        self.ends.push(self.data.len());
        Ok(())
    }

    /// INODE_ITEM (struct btrfs_inode_item, 160 bytes) and, for an inode of one name, its
    /// INODE_REF (`inode_ref`: parent, index, name): `ondisk.pack_inode_item`'s bytes.
    pub fn add_inode(&mut self, ino: u64, f: &InodeFields, inode_ref: Option<(u64, u64, &[u8])>) -> io::Result<()> {
        let mut item = [0u8; INODE_ITEM_SIZE];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            item[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        put(&f.generation.to_le_bytes()); // generation
        put(&f.generation.to_le_bytes()); // transid
        put(&f.size.to_le_bytes());
        put(&f.nbytes.to_le_bytes());
        put(&0u64.to_le_bytes()); // block_group
        put(&f.nlink.to_le_bytes());
        put(&f.uid.to_le_bytes());
        put(&f.gid.to_le_bytes());
        put(&f.mode.to_le_bytes());
        put(&f.rdev.to_le_bytes());
        put(&f.flags.to_le_bytes());
        put(&0u64.to_le_bytes()); // sequence
        put(&[0u8; 32]); // reserved
        for ns in [f.atime_ns, f.ctime_ns, f.mtime_ns, f.otime_ns] {
            // floor division, the seconds two's complement (Python's divmod and `& U64`)
            put(&(ns.div_euclid(NS) as u64).to_le_bytes());
            put(&(ns.rem_euclid(NS) as u32).to_le_bytes());
        }
        debug_assert_eq!(at, INODE_ITEM_SIZE);
        self.add((ino, INODE_ITEM_KEY, 0), &item)?;
        if let Some((parent, index, name)) = inode_ref {
            self.add((ino, INODE_REF_KEY, parent), &self::inode_ref(index, name))?;
        }
        Ok(())
    }

    /// A directory's entries, given in name order: DIR_ITEMs by name hash (names of one hash
    /// in one item, in name order), then DIR_INDEXes from 2 in name order, each a struct
    /// btrfs_dir_item with the child's INODE_ITEM key as its location.
    pub fn add_dir(&mut self, ino: u64, generation: u64, entries: &[(&[u8], u64, u8)]) -> io::Result<()> {
        self.add_dir_indexed(ino, generation, entries, None)
    }

    /// `add_dir` with the entries' dir indexes given (a base's: not 2, 3, ... in name
    /// order): the DIR_INDEXes in index order (`treeblocks.add_dir_items`).
    pub fn add_dir_indexed(
        &mut self,
        ino: u64,
        generation: u64,
        entries: &[(&[u8], u64, u8)],
        indexes: Option<&[u64]>,
    ) -> io::Result<()> {
        let packed: Vec<Vec<u8>> = entries
            .iter()
            .map(|&(name, child, ftype)| dir_item(child, INODE_ITEM_KEY, generation, ftype, name, b""))
            .collect();
        let mut by_hash: Vec<(u64, usize)> = entries
            .iter()
            .enumerate()
            .map(|(i, &(name, _, _))| (name_hash(name), i))
            .collect();
        by_hash.sort_by_key(|&(h, _)| h); // stable: one hash's names stay in name order
        let mut i = 0;
        while i < by_hash.len() {
            let h = by_hash[i].0;
            let mut j = i + 1;
            while j < by_hash.len() && by_hash[j].0 == h {
                j += 1;
            }
            if j == i + 1 {
                self.add((ino, DIR_ITEM_KEY, h), &packed[by_hash[i].1])?;
            } else {
                let joined: Vec<u8> = by_hash[i..j]
                    .iter()
                    .flat_map(|&(_, k)| packed[k].iter().copied())
                    .collect();
                self.add((ino, DIR_ITEM_KEY, h), &joined)?;
            }
            i = j;
        }
        match indexes {
            None => {
                for (index, item) in packed.iter().enumerate() {
                    self.add((ino, DIR_INDEX_KEY, index as u64 + 2), item)?;
                }
            }
            Some(indexes) => {
                let mut order: Vec<(u64, &Vec<u8>)> = indexes.iter().copied().zip(&packed).collect();
                order.sort();
                for (index, item) in order {
                    self.add((ino, DIR_INDEX_KEY, index), item)?;
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut payload = vec![0u8; LEAF_DATA_SIZE];
        let mut end = LEAF_DATA_SIZE;
        let mut start = 0usize;
        for (i, (&key, &item_end)) in self.keys.iter().zip(&self.ends).enumerate() {
            let item = &self.data[start..item_end];
            start = item_end;
            end -= item.len();
            let dk = disk_key(key);
            let head = &mut payload[i * ITEM_SIZE..(i + 1) * ITEM_SIZE];
            head[..DISK_KEY_SIZE].copy_from_slice(&dk);
            head[17..21].copy_from_slice(&(end as u32).to_le_bytes());
            head[21..25].copy_from_slice(&(item.len() as u32).to_le_bytes());
            payload[end..end + item.len()].copy_from_slice(item);
            if let Some(h) = &mut self.digest {
                h.update(dk); // else the spiller hashes the items
                h.update(item);
            }
        }
        assert!(end >= self.keys.len() * ITEM_SIZE, "leaf overflow");
        let first_key = self.keys.first().copied().unwrap_or((0, 0, 0));
        let nritems = self.keys.len() as u32;
        if self.spill.is_some() {
            let at = self.spill_pos + self.spill_buf.len() as u64;
            self.spill_buf.extend_from_slice(&payload);
            self.spill_nritems.push(nritems);
            let batch = if self.spiller.is_some() {
                SPILL_BATCH
            } else {
                SPILL_BUFFER
            };
            if self.spill_buf.len() >= batch {
                self.write_spill()?;
            }
            self.leaves.push(Leaf {
                first_key,
                nritems,
                payload: None,
                spilled_at: at as i64,
            });
        } else {
            self.leaves.push(Leaf {
                first_key,
                nritems,
                payload: Some(payload),
                spilled_at: -1,
            });
        }
        self.keys.clear();
        self.ends.clear();
        self.data.clear();
        Ok(())
    }

    fn write_spill(&mut self) -> io::Result<()> {
        if let Some(spiller) = &mut self.spiller {
            if self.spill_buf.is_empty() {
                return Ok(());
            }
            let buf = std::mem::take(&mut self.spill_buf);
            let len = buf.len() as u64;
            let batch = (buf, std::mem::take(&mut self.spill_nritems), self.spill_pos);
            let sent = spiller.tx.as_ref().map(|tx| tx.send(batch).is_ok());
            if sent != Some(true) {
                // the thread stopped: its error
                spiller.join()?;
                return Err(io::Error::other("fs tree spill thread stopped"));
            }
            self.spill_pos += len;
            self.spill_buf.reserve(SPILL_BATCH);
            return Ok(());
        }
        self.spill_nritems.clear();
        if let Some(f) = &self.spill {
            f.write_all_at(&self.spill_buf, self.spill_pos)?;
            self.spill_pos += self.spill_buf.len() as u64;
            self.spill_buf.clear();
        }
        Ok(())
    }

    /// The last leaf packed (an empty tree is one empty leaf), spilled payloads written:
    /// the sha256 of the items (when asked for).
    pub fn finish(&mut self) -> io::Result<Option<[u8; 32]>> {
        if !self.keys.is_empty() || self.leaves.is_empty() {
            self.flush()?;
        }
        self.write_spill()?;
        if let Some(mut spiller) = self.spiller.take() {
            self.digest = spiller.join()?;
        }
        Ok(self.digest.take().map(|h| h.finalize().into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_of_one_leaf() {
        let mut p = Packer::new(None, true, Vec::new());
        p.add((256, 1, 0), b"abc").unwrap();
        p.add((256, 12, 256), b"de").unwrap();
        let digest = p.finish().unwrap().unwrap();
        assert_eq!(p.leaves.len(), 1);
        let leaf = &p.leaves[0];
        assert_eq!((leaf.first_key, leaf.nritems), ((256, 1, 0), 2));
        let pl = leaf.payload.as_ref().unwrap();
        assert_eq!(pl.len(), LEAF_DATA_SIZE);
        // item 0: data at the very end, item 1 before it
        assert_eq!(&pl[17..21], &((LEAF_DATA_SIZE - 3) as u32).to_le_bytes());
        assert_eq!(&pl[LEAF_DATA_SIZE - 3..], b"abc");
        assert_eq!(&pl[25 + 17..25 + 21], &((LEAF_DATA_SIZE - 5) as u32).to_le_bytes());
        assert_eq!(&pl[LEAF_DATA_SIZE - 5..LEAF_DATA_SIZE - 3], b"de");
        assert!(pl[50..LEAF_DATA_SIZE - 5].iter().all(|&b| b == 0));
        let mut h = Sha256::new();
        h.update(&pl[..17]);
        h.update(b"abc");
        h.update(&pl[25..42]);
        h.update(b"de");
        assert_eq!(digest, <[u8; 32]>::from(h.finalize()));
    }

    #[test]
    fn leaves_split_when_full_and_empty_tree_is_one_leaf() {
        let mut p = Packer::new(None, false, Vec::new());
        for i in 0..3 {
            p.add((i, 1, 0), &vec![7u8; MAX_ITEM_DATA / 2]).unwrap();
        }
        p.finish().unwrap();
        assert_eq!(p.leaves.iter().map(|l| l.nritems).collect::<Vec<_>>(), vec![1, 1, 1]);
        let mut empty = Packer::new(None, false, Vec::new());
        empty.finish().unwrap();
        assert_eq!(empty.leaves.len(), 1);
        assert_eq!(empty.leaves[0].nritems, 0);
        assert!(Packer::new(None, false, Vec::new())
            .add((1, 1, 0), &vec![0u8; MAX_ITEM_DATA + 1])
            .is_err());
    }

    #[test]
    fn spilled_leaves_and_digest_are_the_kept_ones() {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        // more leaves than one spill buffer holds, through the spill thread and kept
        let path = std::env::temp_dir().join(format!("leaves-spill-test-{}", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut spilled = Packer::new(Some(file.as_raw_fd()), true, Vec::new());
        let mut kept = Packer::new(None, true, Vec::new());
        for i in 0..2000u64 {
            let data = vec![(i % 251) as u8; (i as usize * 37) % 3000];
            spilled.add((256 + i, 1, i), &data).unwrap();
            kept.add((256 + i, 1, i), &data).unwrap();
        }
        let (a, b) = (spilled.finish().unwrap(), kept.finish().unwrap());
        assert!(a.is_some() && a == b);
        assert!(kept.leaves.len() > SPILL_BUFFER / LEAF_DATA_SIZE * 3);
        const { assert!(SPILL_BATCH < SPILL_BUFFER) };
        let mut all = Vec::new();
        (&file).read_to_end(&mut all).unwrap();
        assert_eq!(all.len(), kept.leaves.len() * LEAF_DATA_SIZE);
        for (s, k) in spilled.leaves.iter().zip(&kept.leaves) {
            assert_eq!((s.first_key, s.nritems), (k.first_key, k.nritems));
            let at = s.spilled_at as usize;
            assert_eq!(&all[at..at + LEAF_DATA_SIZE], k.payload.as_deref().unwrap());
        }
    }

    #[test]
    fn leaves_end_before_a_break_or_when_full() {
        let mut p = Packer::new(None, false, vec![(1, 1, 0), (3, 1, 5), (9, 1, 0)]);
        for i in 0..8 {
            p.add((i, 1, 0), b"x").unwrap();
        }
        for i in 8..12 {
            p.add((i, 1, 0), &vec![7u8; MAX_ITEM_DATA / 2]).unwrap();
        }
        p.finish().unwrap();
        let firsts: Vec<Key> = p.leaves.iter().map(|l| l.first_key).collect();
        assert_eq!(
            firsts,
            vec![(0, 1, 0), (1, 1, 0), (4, 1, 0), (9, 1, 0), (10, 1, 0), (11, 1, 0)]
        );
    }
}
