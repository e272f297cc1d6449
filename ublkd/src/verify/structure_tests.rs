//! Unit tests of the structural check (verify/structure.rs): the parser's bounds on
//! crafted superblocks, chunk items and extents.

use super::*;
use crate::format::blockmap::Range;

/// A superblock with a valid checksum: fsid 0x11.., devid `devid`, one system chunk
/// (logical 1 MiB -> devid 1 at 1 MiB, 4 MiB) in its sys_chunk_array.
fn superblock(devid: u64) -> Vec<u8> {
    let mut b = vec![0u8; SUPER_SIZE];
    b[32..48].copy_from_slice(&[0x11; 16]);
    b[48..56].copy_from_slice(&SUPER_OFFSET.to_le_bytes());
    b[64..72].copy_from_slice(MAGIC);
    b[136..144].copy_from_slice(&2u64.to_le_bytes());
    b[144..148].copy_from_slice(&4096u32.to_le_bytes());
    b[148..152].copy_from_slice(&16384u32.to_le_bytes());
    b[DEV_ITEM_OFF..DEV_ITEM_OFF + 8].copy_from_slice(&devid.to_le_bytes());
    b[DEV_ITEM_OFF + 82..DEV_ITEM_OFF + 98].copy_from_slice(&[0x11; 16]);
    let mut arr = Vec::new();
    arr.extend_from_slice(&FIRST_CHUNK_TREE_OBJECTID.to_le_bytes());
    arr.push(CHUNK_ITEM_KEY);
    arr.extend_from_slice(&(1u64 << 20).to_le_bytes());
    let mut c = vec![0u8; 48 + 32];
    c[0..8].copy_from_slice(&(4u64 << 20).to_le_bytes());
    c[24..32].copy_from_slice(&BG_SYSTEM.to_le_bytes());
    c[44..46].copy_from_slice(&1u16.to_le_bytes());
    c[48..56].copy_from_slice(&1u64.to_le_bytes());
    c[56..64].copy_from_slice(&(1u64 << 20).to_le_bytes());
    arr.extend_from_slice(&c);
    b[160..164].copy_from_slice(&(arr.len() as u32).to_le_bytes());
    b[SYS_CHUNK_ARRAY_OFF..SYS_CHUNK_ARRAY_OFF + arr.len()].copy_from_slice(&arr);
    fix_csum(&mut b);
    b
}

fn fix_csum(b: &mut [u8]) {
    let c = crc32c(&b[32..]);
    b[..4].copy_from_slice(&c.to_le_bytes());
}

fn blockmap(ranges: &[(u64, u64)], device_size: u64) -> Blockmap {
    Blockmap {
        chunk_shift: 20,
        device_size,
        packs: Vec::new(),
        ranges: ranges
            .iter()
            .map(|&(dev_offset, length)| Range {
                dev_offset,
                length,
                pack: 0,
                pack_offset: 0,
            })
            .collect(),
        digests: Vec::new(),
        version: 1,
        stored: Vec::new(),
    }
}

#[test]
fn crc32c_known_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
}

#[test]
fn superblock_parses_and_every_defect_is_named() {
    let b = superblock(1);
    let s = parse_super(&b, "t").unwrap();
    assert_eq!((s.dev_item.devid, s.nodesize, s.sys_chunk_array.len()), (1, 16384, 97));
    let err = |b: &[u8]| format!("{:#}", parse_super(b, "t").unwrap_err());
    assert!(err(&b[..100]).contains("100 bytes"));
    let mut x = b.clone();
    x[64] = b'x';
    assert!(err(&x).contains("no btrfs magic"));
    let mut x = b.clone();
    x[2000] ^= 1;
    assert!(err(&x).contains("checksum"));
    let mut x = b.clone();
    x[160..164].copy_from_slice(&5000u32.to_le_bytes());
    fix_csum(&mut x);
    assert!(err(&x).contains("sys_chunk_array_size 5000"));
    let mut x = b.clone();
    x[148..152].copy_from_slice(&12345u32.to_le_bytes());
    fix_csum(&mut x);
    assert!(err(&x).contains("nodesize 12345"));
    let mut x = b.clone();
    x[196] = 1;
    fix_csum(&mut x);
    assert!(err(&x).contains("checksum type 1"));
}

#[test]
fn chunk_items_are_bounded() {
    let mut c = vec![0u8; 48 + 32];
    c[0..8].copy_from_slice(&4096u64.to_le_bytes());
    c[44..46].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(parse_chunk(0, &c).unwrap().1, 80);
    c[44..46].copy_from_slice(&1000u16.to_le_bytes()); // stripes past the item
    assert!(format!("{:#}", parse_chunk(0, &c).unwrap_err()).contains("1000 stripes"));
    c[44..46].copy_from_slice(&0u16.to_le_bytes());
    assert!(format!("{:#}", parse_chunk(0, &c).unwrap_err()).contains("no stripes"));
    c[44..46].copy_from_slice(&1u16.to_le_bytes());
    c[0..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(format!("{:#}", parse_chunk(5, &c).unwrap_err()).contains("overflows"));
    assert!(parse_chunk(0, &c[..20]).is_err());
    let mut m = ChunkMap::default();
    let ch = |logical, length| Chunk {
        logical,
        length,
        ty: BG_DATA,
        stripes: vec![(2, logical)],
    };
    m.insert(ch(0, 8192)).unwrap();
    assert!(format!("{:#}", m.insert(ch(4096, 8192)).unwrap_err()).contains("overlaps"));
    assert!(m.find(4096, 4096).is_some() && m.find(4096, 8192).is_none() && m.find(u64::MAX, 2).is_none());
}

fn extent(ty: u8, disk: u64, disk_len: u64, off: u64, num: u64) -> Vec<u8> {
    let mut d = vec![0u8; 53];
    d[8..16].copy_from_slice(&disk_len.to_le_bytes());
    d[20] = ty;
    d[21..29].copy_from_slice(&disk.to_le_bytes());
    d[29..37].copy_from_slice(&disk_len.to_le_bytes());
    d[37..45].copy_from_slice(&off.to_le_bytes());
    d[45..53].copy_from_slice(&num.to_le_bytes());
    d
}

#[test]
fn extents_against_chunks_and_blockmap() {
    let mut chunks = ChunkMap::default();
    // logical 1 MiB -> device 2 at 0, 1 MiB
    chunks
        .insert(Chunk {
            logical: 1 << 20,
            length: 1 << 20,
            ty: BG_DATA,
            stripes: vec![(2, 0)],
        })
        .unwrap();
    chunks
        .insert(Chunk {
            logical: 4 << 20,
            length: 1 << 20,
            ty: BG_METADATA,
            stripes: vec![(1, 0)],
        })
        .unwrap();
    // mapped: [0, 10000) (a file's tail), [12288, 16384)
    let bm = blockmap(&[(0, 10000), (12288, 4096)], 1 << 20);
    let err = |d: &[u8]| format!("{:#}", check_extent(&chunks, &bm, d).unwrap_err());
    check_extent(&chunks, &bm, &extent(1, 1 << 20, 16384, 0, 16384)).unwrap();
    check_extent(&chunks, &bm, &extent(1, 0, 8192, 0, 8192)).unwrap(); // hole
    assert!(err(&extent(1, (1 << 20) + 16384, 4096, 0, 4096)).contains("mapped by no blockmap range"));
    assert!(err(&extent(1, (1 << 20) + 4096, 16384, 0, 16384)).contains("mapped by no blockmap range"));
    assert!(err(&extent(1, 3 << 20, 4096, 0, 4096)).contains("in no chunk"));
    assert!(err(&extent(1, 4 << 20, 4096, 0, 4096)).contains("not data"));
    assert!(err(&extent(1, 1 << 20, 4096, 4096, 4096)).contains("past its"));
    assert!(err(&extent(1, u64::MAX - 10, 4096, 0, 4096)).contains("in no chunk"));
    assert!(err(&extent(7, 1 << 20, 4096, 0, 4096)).contains("type 7"));
    assert!(err(&extent(1, 1 << 20, 4096, 0, 4096)[..40]).contains("40 bytes"));
    assert!(err(&[0u8; 10]).contains("10 bytes"));
    let mut inline = vec![0u8; 21 + 5];
    inline[8..16].copy_from_slice(&5u64.to_le_bytes());
    check_extent(&chunks, &bm, &inline).unwrap();
    inline[8..16].copy_from_slice(&500u64.to_le_bytes());
    assert!(err(&inline).contains("ram_bytes 500"));
    assert!(covered(&bm, u64::MAX - 1, 10).is_err() && covered(&bm, (1 << 20) - 10, 20).is_err());
}

#[test]
fn dev2_super_against_meta() {
    let meta = MetaSummary {
        sb: parse_super(&superblock(1), "meta").unwrap(),
        dev2: DevItem::parse(&superblock(2)[DEV_ITEM_OFF..]).unwrap(),
        extents: 0,
        tree_blocks: 0,
        overlay: OverlayView::default(),
    };
    check_dev2_super(&superblock(2), &meta, 1 << 20).unwrap();
    let e = format!("{:#}", check_dev2_super(&superblock(1), &meta, 1 << 20).unwrap_err());
    assert!(e.contains("devid 1, not 2"), "{e}");
    let mut x = superblock(2);
    x[32] = 0x22;
    fix_csum(&mut x);
    let e = format!("{:#}", check_dev2_super(&x, &meta, 1 << 20).unwrap_err());
    assert!(e.contains("fsid"), "{e}");
}

/// Garbage and bit flips anywhere in a superblock or meta.img: errors, no panic.
#[test]
fn crafted_meta_img_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.img");
    let bm = blockmap(&[(0, 1 << 20)], 1 << 20);
    let base = {
        let mut img = vec![0u8; 6 << 20];
        img[SUPER_OFFSET as usize..SUPER_OFFSET as usize + SUPER_SIZE].copy_from_slice(&superblock(1));
        img
    };
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for i in 0..300 {
        let mut img = base.clone();
        let sb = SUPER_OFFSET as usize;
        for _ in 0..(1 + rnd() % 8) {
            let at = sb + (rnd() % SUPER_SIZE as u64) as usize;
            img[at] = rnd() as u8;
        }
        if i % 2 == 0 {
            fix_csum(&mut img[sb..sb + SUPER_SIZE]);
        }
        std::fs::write(&path, &img).unwrap();
        let f = File::open(&path).unwrap();
        let fsid = "11111111-1111-1111-1111-111111111111";
        assert!(check_meta(&f, fsid, [fsid, fsid], &bm).is_err());
    }
    std::fs::write(&path, &base[..70000]).unwrap();
    let f = File::open(&path).unwrap();
    assert!(check_meta(&f, "x", ["x", "x"], &bm).is_err());
}

/// One btrfs_dir_item of an XATTR_ITEM: location key, transid, data_len, name_len, type.
fn xattr_entry(name: &str, value: &[u8]) -> Vec<u8> {
    let mut e = vec![0u8; 30];
    e[25..27].copy_from_slice(&(value.len() as u16).to_le_bytes());
    e[27..29].copy_from_slice(&(name.len() as u16).to_le_bytes());
    e[29] = 8; // BTRFS_FT_XATTR
    e.extend_from_slice(name.as_bytes());
    e.extend_from_slice(value);
    e
}

fn inode_item(mode: u32, rdev: u64) -> Vec<u8> {
    let mut d = vec![0u8; 160];
    d[52..56].copy_from_slice(&mode.to_le_bytes());
    d[56..64].copy_from_slice(&rdev.to_le_bytes());
    d
}

#[test]
fn overlay_view_notes_overlayfs_names_and_whiteouts() {
    let key = |objectid, ty| Key {
        objectid,
        ty,
        offset: 0,
    };
    let mut v = OverlayView::default();
    // names that overlayfs (trusted mode) shows as they are
    for n in ["user.overlay.opaque", "trusted.overlayx", "security.a", "user.a"] {
        v.item(key(257, XATTR_ITEM_KEY), &xattr_entry(n, b"y")).unwrap();
    }
    v.item(key(258, INODE_ITEM_KEY), &inode_item(0o020644, 0x103)).unwrap(); // char 1:3
    v.item(key(259, INODE_ITEM_KEY), &inode_item(0o100644, 0)).unwrap();
    assert_eq!(v, OverlayView::default());
    assert_eq!(v.inexact(), None);
    // two entries in one item (colliding name hashes): the second is overlayfs's
    let mut two = xattr_entry("user.a", b"1");
    two.extend(xattr_entry("trusted.overlay.opaque", b"y"));
    v.item(key(260, XATTR_ITEM_KEY), &two).unwrap();
    v.item(key(261, INODE_ITEM_KEY), &inode_item(0o020000, 0)).unwrap();
    assert_eq!((v.overlay_xattrs, v.whiteouts), (1, 1));
    let why = v.inexact().unwrap();
    assert!(
        why.contains("1 xattr(s) named trusted.overlay.* and 1 character device(s) 0:0"),
        "{why}"
    );
    assert!(why.contains("first: inode 260: xattr trusted.overlay.opaque"), "{why}");
    // cut short or running past the item: an error, never a panic
    let e = xattr_entry("trusted.overlay.x", b"y");
    for cut in [&e[..20], &e[..e.len() - 1]] {
        assert!(v.item(key(262, XATTR_ITEM_KEY), cut).is_err());
    }
    assert!(v.item(key(263, INODE_ITEM_KEY), &[0u8; 100]).is_err());
}
