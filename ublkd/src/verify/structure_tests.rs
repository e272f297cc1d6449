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

/// One data chunk: logical 1 MiB -> device 2 at 0, 1 MiB.
fn data_chunk() -> ChunkMap {
    let mut chunks = ChunkMap::default();
    chunks
        .insert(Chunk {
            logical: 1 << 20,
            length: 1 << 20,
            ty: BG_DATA,
            stripes: vec![(2, 0)],
        })
        .unwrap();
    chunks
}

#[test]
fn extents_against_chunks_and_blockmap() {
    let mut chunks = data_chunk();
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
    let err = |d: &[u8]| format!("{:#}", check_extent(&chunks, &bm, 0, d).unwrap_err());
    check_extent(&chunks, &bm, 0, &extent(1, 1 << 20, 16384, 0, 16384)).unwrap();
    check_extent(&chunks, &bm, 0, &extent(1, 0, 8192, 0, 8192)).unwrap(); // hole
    assert!(err(&extent(1, (1 << 20) + 16384, 4096, 0, 4096)).contains("mapped by no blockmap range"));
    assert!(err(&extent(1, (1 << 20) + 4096, 16384, 0, 16384)).contains("mapped by no blockmap range"));
    assert!(err(&extent(1, 3 << 20, 4096, 0, 4096)).contains("in no chunk"));
    assert!(err(&extent(1, 4 << 20, 4096, 0, 4096)).contains("not data"));
    assert!(err(&extent(1, 1 << 20, 4096, 4096, 4096)).contains("past its"));
    assert!(err(&extent(1, u64::MAX - 4095, 4096, 0, 4096)).contains("in no chunk"));
    assert!(err(&extent(1, (1 << 20) + 10, 4096, 0, 4096)).contains("not all 4096-aligned"));
    assert!(err(&extent(7, 1 << 20, 4096, 0, 4096)).contains("type 7"));
    assert!(err(&extent(1, 1 << 20, 4096, 0, 4096)[..40]).contains("40 bytes"));
    assert!(err(&[0u8; 10]).contains("10 bytes"));
    let mut inline = vec![0u8; 21 + 5];
    inline[8..16].copy_from_slice(&5u64.to_le_bytes());
    check_extent(&chunks, &bm, 0, &inline).unwrap();
    assert!(format!("{:#}", check_extent(&chunks, &bm, 4096, &inline).unwrap_err()).contains("file offset 4096, not 0"));
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

/// A 16 KiB tree block: fsid 0x11.., generation 1, owner 5, `level`, the given items
/// (key, data; laid out from the block's end as btrfs does) or key pointers (key,
/// child, generation); checksum fixed.
fn tree_block(bytenr: u64, level: u8, items: &[(Key, Vec<u8>)], ptrs: &[(Key, u64, u64)]) -> Vec<u8> {
    let mut b = vec![0u8; 16384];
    b[32..48].copy_from_slice(&[0x11; 16]);
    b[48..56].copy_from_slice(&bytenr.to_le_bytes());
    b[80..88].copy_from_slice(&1u64.to_le_bytes());
    b[88..96].copy_from_slice(&FS_TREE_OBJECTID.to_le_bytes());
    b[96..100].copy_from_slice(&((items.len() + ptrs.len()) as u32).to_le_bytes());
    b[100] = level;
    let put_key = |b: &mut [u8], at: usize, k: Key| {
        b[at..at + 8].copy_from_slice(&k.objectid.to_le_bytes());
        b[at + 8] = k.ty;
        b[at + 9..at + 17].copy_from_slice(&k.offset.to_le_bytes());
    };
    let mut end = 16384 - HEADER_SIZE;
    for (i, (k, d)) in items.iter().enumerate() {
        let at = HEADER_SIZE + i * ITEM_SIZE;
        put_key(&mut b, at, *k);
        end -= d.len();
        b[at + 17..at + 21].copy_from_slice(&(end as u32).to_le_bytes());
        b[at + 21..at + 25].copy_from_slice(&(d.len() as u32).to_le_bytes());
        b[HEADER_SIZE + end..HEADER_SIZE + end + d.len()].copy_from_slice(d);
    }
    for (i, &(k, child, generation)) in ptrs.iter().enumerate() {
        let at = HEADER_SIZE + i * KEY_PTR_SIZE;
        put_key(&mut b, at, k);
        b[at + 17..at + 25].copy_from_slice(&child.to_le_bytes());
        b[at + 25..at + 33].copy_from_slice(&generation.to_le_bytes());
    }
    fix_csum(&mut b);
    b
}

fn key(objectid: u64, ty: u8, offset: u64) -> Key {
    Key { objectid, ty, offset }
}

#[test]
fn tree_block_header_against_its_parent_and_the_superblock() {
    let mut sb = parse_super(&superblock(1), "t").unwrap();
    sb.generation = 1;
    let good = tree_block(16384, 0, &[(key(256, 1, 0), vec![0; 160])], &[]);
    let check = |b: &[u8], generation| check_header(b, 16384, 0, FS_TREE_OBJECTID, generation, &sb, "blk");
    check(&good, 1).unwrap();
    let err = |b: &[u8], generation| format!("{:#}", check(b, generation).unwrap_err());
    assert!(err(&good, 3).contains("blk: generation 1, what points at it says 3"));
    let mut x = good.clone();
    x[80..88].copy_from_slice(&2u64.to_le_bytes());
    fix_csum(&mut x);
    assert!(err(&x, 2).contains("generation 2, newer than the superblock's 1"));
    x[100] = 1;
    assert!(err(&x, 2).contains("checksum")); // not fixed
    fix_csum(&mut x);
    assert!(err(&x, 2).contains("level 1, its parent says 0"));
    let mut x = good.clone();
    x[88] = 7;
    fix_csum(&mut x);
    assert!(err(&x, 1).contains("owner 7, not 5"));
    assert!(
        format!("{:#}", check_header(&good, 32768, 0, 5, 1, &sb, "blk").unwrap_err())
            .contains("header says bytenr 16384")
    );
}

#[test]
fn tree_block_layout_keys_and_item_data() {
    let items = [
        (key(256, 1, 0), vec![1; 160]),
        (key(256, 12, 256), vec![2; 12]),
        (key(257, 1, 0), vec![3; 160]),
    ];
    let leaf = tree_block(16384, 0, &items, &[]);
    let layout = |b: &[u8], first| block_layout(b, b[100], "blk", first);
    let err = |b: &[u8]| format!("{:#}", layout(b, None).unwrap_err());
    match layout(&leaf, Some(key(256, 1, 0))).unwrap() {
        Layout::Leaf(v) => {
            assert_eq!(
                v.iter().map(|&(k, _, size)| (k, size)).collect::<Vec<_>>(),
                vec![(items[0].0, 160), (items[1].0, 12), (items[2].0, 160)]
            );
            assert_eq!(leaf[v[1].1], 2);
        }
        l => panic!("{l:?}"),
    }
    assert!(format!("{:#}", layout(&leaf, Some(key(255, 1, 0))).unwrap_err())
        .contains("first key (256 1 0), its parent says (255 1 0)"));
    let at = |i: usize| HEADER_SIZE + i * ITEM_SIZE;
    // keys: swapped, duplicate
    let mut x = leaf.clone();
    x.copy_within(at(2)..at(2) + 17, at(1));
    x[at(2)..at(2) + 17].copy_from_slice(&leaf[at(1)..at(1) + 17]);
    assert!(
        err(&x).contains("key 2 (256 12 256) not after (257 1 0)"),
        "{}",
        err(&x)
    );
    let mut x = leaf.clone();
    x.copy_within(at(0)..at(0) + 17, at(1));
    assert!(err(&x).contains("key 1 (256 1 0) not after (256 1 0)"));
    // item data: past the leaf, 4 GiB, shifted onto its neighbour's bytes, a gap
    let set = |b: &mut Vec<u8>, i: usize, field: usize, v: u32| {
        b[at(i) + field..at(i) + field + 4].copy_from_slice(&v.to_le_bytes())
    };
    let off1 = u32_at(&leaf, at(1) + 17).unwrap();
    let mut x = leaf.clone();
    set(&mut x, 0, 21, 260);
    assert!(
        err(&x).contains("item 0 (256 1 0): data at 16123+260 outside the leaf"),
        "{}",
        err(&x)
    );
    let mut x = leaf.clone();
    set(&mut x, 2, 21, 0xFFFF_FF00);
    assert!(err(&x).contains("+4294967040 outside the leaf"));
    let mut x = leaf.clone();
    set(&mut x, 1, 17, off1 + 8);
    assert!(
        err(&x).contains("item 1 (256 12 256): data at")
            && err(&x).contains("does not end where the item before starts")
    );
    let mut x = leaf.clone();
    set(&mut x, 1, 17, off1 - 8);
    assert!(err(&x).contains("does not end where the item before starts"));
    let mut x = leaf.clone();
    x[96..100].copy_from_slice(&700u32.to_le_bytes());
    assert!(err(&x).contains("700 items do not fit in a leaf"));
    // nodes: pointers in order, the child's expected generation from its pointer
    let node = tree_block(16384, 1, &[], &[(key(256, 1, 0), 32768, 1), (key(300, 1, 0), 49152, 7)]);
    match layout(&node, None).unwrap() {
        Layout::Node(v) => assert_eq!((v[1].1.bytenr, v[1].1.level, v[1].1.generation), (49152, 0, 7)),
        l => panic!("{l:?}"),
    }
    let node = tree_block(16384, 1, &[], &[(key(300, 1, 0), 32768, 1), (key(256, 1, 0), 49152, 1)]);
    assert!(err(&node).contains("key 1 (256 1 0) not after (300 1 0)"));
    let node = tree_block(16384, 1, &[], &[]);
    assert!(err(&node).contains("a node with no children"));
}

/// One btrfs_dir_item entry of a DIR_ITEM / DIR_INDEX (type `ty`, no data).
fn dir_entry(name: &str, ty: u8) -> Vec<u8> {
    let mut e = xattr_entry(name, b"");
    e[29] = ty;
    e
}

fn inode_with(mode: u32, nbytes: u64) -> Vec<u8> {
    let mut d = inode_item(mode, 0);
    d[24..32].copy_from_slice(&nbytes.to_le_bytes());
    d
}

#[test]
fn fs_tree_inodes_against_their_extents() {
    let chunks = data_chunk();
    let bm = blockmap(&[(0, 1 << 20)], 1 << 20);
    let ed = |ino, off| key(ino, 108, off);
    let run = |items: &[(Key, Vec<u8>)]| -> Result<FsTree> {
        let mut fs = FsTree::default();
        for (k, d) in items {
            fs.item(&chunks, &bm, *k, d).with_context(|| format!("{k}"))?;
        }
        fs.finish()?;
        Ok(fs)
    };
    let err = |items: &[(Key, Vec<u8>)]| format!("{:#}", run(items).err().expect("refused"));
    let reg = |nbytes| (key(257, 1, 0), inode_with(0o100644, nbytes));
    // two extents and a hole between them (NO_HOLES: no item), nbytes their sum
    let two = [
        reg(12288),
        (ed(257, 0), extent(1, 1 << 20, 8192, 0, 8192)),
        (ed(257, 65536), extent(1, (1 << 20) + 8192, 4096, 0, 4096)),
    ];
    assert_eq!(run(&two).unwrap().extents, 2);
    let mut x = two.clone();
    x[0] = reg(16384);
    assert!(err(&x).contains("inode 257: nbytes 16384 but its file extents hold 12288 bytes"));
    let mut x = two.clone();
    x[2].0 = ed(257, 4096);
    assert!(err(&x).contains("file extent at file offset 4096 overlaps the one before it, which ends at 8192"));
    // a hole extent counts nothing; an extent without its inode, or of a directory
    run(&[reg(0), (ed(257, 0), extent(1, 0, 4096, 0, 4096))]).unwrap();
    assert!(err(&[(ed(258, 0), extent(1, 1 << 20, 4096, 0, 4096))]).contains("inode 258, which has no inode item"));
    assert!(err(&[reg(4096), (ed(258, 0), extent(1, 1 << 20, 4096, 0, 4096))])
        .contains("inode 258, which has no inode item"));
    let dir = (key(256, 1, 0), inode_with(0o040755, 0));
    assert!(
        err(&[dir, (ed(256, 0), extent(1, 1 << 20, 4096, 0, 4096))]).contains("of mode 40755, not a file or symlink")
    );
    // encodings
    let mut e = extent(1, 1 << 20, 4096, 0, 4096);
    e[16] = 9;
    assert!(err(&[reg(4096), (ed(257, 0), e.clone())]).contains("compression 9"));
    e[16] = 0;
    e[17] = 1;
    assert!(err(&[reg(4096), (ed(257, 0), e)]).contains("encryption 1"));
    // an inline extent counts its ram_bytes
    let mut inline = vec![0u8; 21 + 5];
    inline[8..16].copy_from_slice(&5u64.to_le_bytes());
    run(&[reg(5), (ed(257, 0), inline)]).unwrap();
}

#[test]
fn directory_and_xattr_entries() {
    assert_eq!(name_hash(b"default"), 2_378_154_706); // docs: btrfs-on-disk notes
    let chunks = ChunkMap::default();
    let bm = blockmap(&[], 1 << 20);
    let item = |k: Key, d: &[u8]| FsTree::default().item(&chunks, &bm, k, d).map_err(|e| format!("{e:#}"));
    let h = name_hash(b"passwd");
    item(key(256, 84, h), &dir_entry("passwd", 1)).unwrap();
    item(key(256, 96, 2), &dir_entry("passwd", 1)).unwrap();
    item(key(257, 24, name_hash(b"user.a")), &xattr_entry("user.a", b"v")).unwrap();
    let mut two = dir_entry("passwd", 1);
    two.extend(dir_entry("passwd", 1));
    item(key(256, 84, h), &two).unwrap(); // colliding names share a DIR_ITEM
    assert!(item(key(256, 96, 2), &two)
        .unwrap_err()
        .contains("dir index with 2 entries, not 1"));
    assert!(item(key(256, 84, h + 1), &dir_entry("passwd", 1))
        .unwrap_err()
        .contains("dir item: entry at 0: name hash"));
    let mut long = dir_entry("passwd", 1);
    long[27..29].copy_from_slice(&200u16.to_le_bytes());
    assert!(item(key(256, 84, h), &long)
        .unwrap_err()
        .contains("name_len 200 + data_len 0 run past the item's 36 bytes"));
    assert!(item(key(256, 84, h), &dir_entry("passwd", 0))
        .unwrap_err()
        .contains("file type 0"));
    assert!(item(key(256, 84, h), &dir_entry("passwd", 8))
        .unwrap_err()
        .contains("file type 8"));
    assert!(item(key(256, 84, h), &[])
        .unwrap_err()
        .contains("dir item with no entry"));
    assert!(item(key(256, 84, h), &dir_entry("passwd", 1)[..20])
        .unwrap_err()
        .contains("cut short"));
    let x = xattr_entry("user.a", b"v");
    assert!(item(key(257, 24, name_hash(b"user.a")), &x[..x.len() - 1])
        .unwrap_err()
        .contains("run past the item"));
    assert!(item(key(257, 24, h + 1), &dir_entry("passwd", 8))
        .unwrap_err()
        .contains("xattr item: entry at 0: name hash"));
    assert!(item(key(257, 24, h), &dir_entry("passwd", 1))
        .unwrap_err()
        .contains("type 1, not 8 (xattr)"));
    let name = "n".repeat(256);
    assert!(item(key(256, 96, 2), &dir_entry(&name, 1))
        .unwrap_err()
        .contains("name_len 256, not 1..=255"));
}
