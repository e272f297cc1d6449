//! The tar members of one layer, parsed in one pass over the uncompressed stream, each
//! regular member's data packed as it passes (CRC-32C, deduplication, pack write).
//!
//! The reference semantics are the Python reader's (`sources/tarheader.py`, `sources/tar.py`):
//! this parser implements the common forms exactly (ustar, POSIX prefix, GNU long names,
//! PAX 'x' headers with path/linkpath/size/uid/gid/times/SCHILY xattrs, base-256 numbers)
//! and gives up (`Err`) on anything else: the caller rolls the pack back and the Python
//! reader reads the whole archive, so its results and errors are the only ones there are.

use std::sync::mpsc::SyncSender;

use crate::pack::{PackCore, Put, MEM_MAX};
use crate::stream::{Blocks, Span};

const BLOCK: usize = 512;
const MAX_EXTENSION: u64 = 16 << 20;

pub type R<T> = Result<T, String>;

pub enum Content {
    None,
    Inline(usize, usize),     // offset, length in `Records::data`
    Blob(u32, u64, u32, u64), // crc32c, size, pack, offset
}

pub struct Rec {
    pub name: (usize, usize), // in `Records::names`
    pub link: (usize, usize),
    pub typ: u8,
    pub mode: i64,
    pub uid: i64,
    pub gid: i64,
    pub mtime_ns: i64,
    pub atime_ns: Option<i64>,
    pub ctime_ns: Option<i64>,
    pub xattrs: (usize, usize), // range of `Records::xattrs`
    pub devmajor: i64,
    pub devminor: i64,
    pub content: Content,
}

#[derive(Default)]
pub struct Records {
    pub recs: Vec<Rec>,
    pub names: Vec<u8>,
    pub data: Vec<u8>,
    pub xattrs: Vec<((usize, usize), (usize, usize))>, // name, value in `names`
}

/// Records are kept in segments of about this many members or inline bytes: Python takes
/// them in order, and each segment is freed once taken (the tree grows as they shrink)
const SEGMENT_RECS: usize = 4096;
const SEGMENT_BYTES: usize = 4 << 20;

impl Records {
    fn put_name(&mut self, b: &[u8]) -> (usize, usize) {
        let at = self.names.len();
        self.names.extend_from_slice(b);
        (at, b.len())
    }
}

struct Member {
    name: Vec<u8>,
    typ: u8,
    mode: i64,
    uid: i64,
    gid: i64,
    size: i64,
    mtime: i64,
    linkname: Vec<u8>,
    devmajor: i64,
    devminor: i64,
    pax: Vec<(Vec<u8>, Vec<u8>)>,
    data_start: u64,
}

enum Head {
    Member(Box<Member>),
    End,   // a zero block
    Empty, // the stream ends where a header should start
}

#[derive(Clone, Copy, Default)]
struct Seen {
    pax: bool,
    longname: bool,
    longlink: bool,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

fn strip(mut s: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = s {
        if !is_ws(*first) {
            break;
        }
        s = rest;
    }
    while let [rest @ .., last] = s {
        if !is_ws(*last) {
            break;
        }
        s = rest;
    }
    s
}

fn octal(s: &[u8]) -> R<i64> {
    let mut v: i64 = 0;
    for &b in s {
        if !(b'0'..=b'7').contains(&b) {
            return Err("unusual number in a header".into());
        }
        v = v
            .checked_mul(8)
            .and_then(|v| v.checked_add((b - b'0') as i64))
            .ok_or("number too large")?;
    }
    Ok(v)
}

/// `int(field.translate(NUL -> space), 8)` of the reader's fast path: None where Python's
/// int() raises (the careful path takes over); an error where int() might accept what we
/// do not parse (`_`, `0o`, signs).
fn fast_number(field: &[u8]) -> R<Option<i64>> {
    let t: Vec<u8> = field.iter().map(|&b| if b == 0 { b' ' } else { b }).collect();
    let s = strip(&t);
    if s.is_empty() {
        return Ok(None);
    }
    if s.iter().all(|b| (b'0'..=b'7').contains(b)) {
        return octal(s).map(Some);
    }
    if s.iter().any(|b| b"_oO+-".contains(b)) {
        return Err("unusual number in a header".into());
    }
    Ok(None)
}

/// `tarheader.nti`: octal or GNU base-256 (non-negative only here).
fn nti(field: &[u8]) -> R<i64> {
    let first = field[0];
    if first == 0o200 {
        let mut v: i64 = 0;
        for &b in &field[1..] {
            v = v
                .checked_mul(256)
                .and_then(|v| v.checked_add(b as i64))
                .ok_or("number too large")?;
        }
        return Ok(v);
    }
    if first == 0o377 {
        return Err("negative base-256 number".into());
    }
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    let s = strip(&field[..end]);
    if s.is_empty() {
        return Ok(0);
    }
    octal(s)
}

fn nts(s: &[u8]) -> &[u8] {
    let end = s.iter().position(|&b| b == 0).unwrap_or(s.len());
    &s[..end]
}

fn padded(n: u64) -> u64 {
    n.div_ceil(BLOCK as u64) * BLOCK as u64
}

fn rstrip_slash(v: &mut Vec<u8>) {
    while v.last() == Some(&b'/') {
        v.pop();
    }
}

fn checksum_ok(block: &[u8; BLOCK], chk: i64) -> bool {
    let field = &block[148..156];
    let total: i64 = block.iter().map(|&b| b as i64).sum();
    let fsum: i64 = field.iter().map(|&b| b as i64).sum();
    let unsigned = 256 + total - fsum;
    if chk == unsigned {
        return true;
    }
    let Ok(chk2) = nti(field) else { return false };
    if chk2 == unsigned {
        return true;
    }
    let high = block.iter().filter(|&&b| b >= 128).count() as i64 - field.iter().filter(|&&b| b >= 128).count() as i64;
    chk2 == unsigned - 256 * high
}

pub(crate) fn is_regular(t: u8) -> bool {
    matches!(t, b'0' | 0 | b'7')
}

/// PAX records, strictly (`tarheader.parse_pax_records`); a repeated keyword is left to
/// the Python reader.
fn pax_records(payload: &[u8], into: &mut Vec<(Vec<u8>, Vec<u8>)>) -> R<()> {
    let end = payload.len();
    let mut pos = 0;
    while pos < end {
        let window = &payload[pos..end.min(pos + 21)];
        let sp = match window.iter().position(|&b| b == b' ') {
            Some(0) | None => {
                if payload[pos..].iter().all(|&b| b == 0) {
                    return Ok(());
                }
                return Err("invalid PAX record".into());
            }
            Some(i) => pos + i,
        };
        let digits = &payload[pos..sp];
        if !digits.iter().all(u8::is_ascii_digit) {
            return Err("invalid PAX record length".into());
        }
        let len: usize = std::str::from_utf8(digits)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("invalid PAX record length")?;
        let rec_end = pos.checked_add(len).ok_or("invalid PAX record length")?;
        if rec_end > end || rec_end <= sp + 2 || payload[rec_end - 1] != b'\n' {
            return Err("PAX record length does not end at its newline".into());
        }
        let body = &payload[sp + 1..rec_end - 1];
        let eq = match body.iter().position(|&b| b == b'=') {
            Some(i) if i > 0 => sp + 1 + i,
            _ => return Err("PAX record without keyword".into()),
        };
        let key = payload[sp + 1..eq].to_vec();
        if into.iter().any(|(k, _)| *k == key) {
            return Err("repeated PAX keyword".into());
        }
        into.push((key, payload[eq + 1..rec_end - 1].to_vec()));
        pos = rec_end;
    }
    Ok(())
}

fn pax_int(v: &[u8]) -> R<i64> {
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return Err("unusual number in a PAX record".into());
    }
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "PAX number too large".into())
}

/// `tar.parse_pax_time` for plain ASCII values: integer nanoseconds.
fn pax_time(v: &[u8]) -> R<i64> {
    let s = strip(v);
    let (neg, s) = match s.first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (whole, frac) = match s.iter().position(|&b| b == b'.') {
        Some(i) => (&s[..i], &s[i + 1..]),
        None => (s, &s[s.len()..]),
    };
    if whole.is_empty() && frac.is_empty() {
        return Err("invalid PAX time".into());
    }
    if !whole.iter().chain(frac.iter()).all(u8::is_ascii_digit) {
        return Err("invalid PAX time".into());
    }
    let w: i64 = if whole.is_empty() {
        0
    } else {
        std::str::from_utf8(whole)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("PAX time too large")?
    };
    let mut f: i64 = 0;
    for i in 0..9 {
        f = f * 10 + frac.get(i).map_or(0, |d| (d - b'0') as i64);
    }
    let ns = w
        .checked_mul(1_000_000_000)
        .and_then(|v| v.checked_add(f))
        .ok_or("PAX time too large")?;
    Ok(if neg { -ns } else { ns })
}

pub struct Parser<'a> {
    pub src: Blocks,
    pub pack: &'a mut PackCore,
    pub keep_inline: u64,
    pub whiteouts: bool,
    pub out: Records,
    /// full segments go here as they fill (Python places them while the parser goes on);
    /// a closed receiver (Python stopped on an error) stops the parser
    pub sink: SyncSender<Records>,
    pub content_bytes: u64,
    /// the pack write that stopped the parser: the caller raises it (an OSError such as a
    /// full disk) instead of handing the archive back to the Python reader
    pub pack_error: Option<std::io::Error>,
    next_header: u64,
    spans: Vec<Span>,
    pub packing: std::time::Duration, // in pack writes and dedup compares (BUI_NATIVE_TIMES)
    pub handing: std::time::Duration, // waiting for Python to take a segment (BUI_NATIVE_TIMES)
}

impl<'a> Parser<'a> {
    pub fn new(
        src: Blocks,
        pack: &'a mut PackCore,
        keep_inline: u64,
        whiteouts: bool,
        sink: SyncSender<Records>,
    ) -> Self {
        Parser {
            src,
            pack,
            keep_inline,
            whiteouts,
            out: Records::default(),
            sink,
            content_bytes: 0,
            pack_error: None,
            next_header: 0,
            spans: Vec::new(),
            packing: Default::default(),
            handing: Default::default(),
        }
    }

    /// A pack write's error, kept for the caller (`pack_error`), as the parser's stop message.
    fn pack_failed(&mut self, e: std::io::Error) -> String {
        let msg = format!("pack: {e}");
        self.pack_error = Some(e);
        msg
    }

    fn upstream(&mut self, what: &str) -> String {
        match self.src.take_error() {
            Some(e) => e,
            None => what.to_string(),
        }
    }

    /// Every member, then the rest of the stream read (and so hashed and checked).
    pub fn run(&mut self, lenient_end: bool) -> R<()> {
        let mut members = 0u64;
        loop {
            let skip = self.next_header - self.src.offset;
            if skip > 0 && self.src.skip(skip) != skip {
                if let Some(e) = self.src.take_error() {
                    return Err(e);
                }
                if lenient_end {
                    return Ok(());
                }
                return Err("unexpected end of data".into());
            }
            match self.member(0, Seen::default())? {
                Head::End => break,
                Head::Empty => {
                    if let Some(e) = self.src.take_error() {
                        return Err(e);
                    }
                    if lenient_end && members > 0 {
                        return Ok(());
                    }
                    return Err("the archive ends without an end-of-archive marker".into());
                }
                Head::Member(m) => {
                    self.emit(*m)?;
                    members += 1;
                }
            }
        }
        self.src.drain();
        match self.src.take_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn member(&mut self, depth: u32, seen: Seen) -> R<Head> {
        let start = self.src.offset;
        let mut block = [0u8; BLOCK];
        let n = self.src.read_into(&mut block);
        if n == 0 {
            return if depth == 0 {
                Ok(Head::Empty)
            } else {
                Err(self.upstream("archive ends after an extension header"))
            };
        }
        if n != BLOCK {
            return Err(self.upstream("truncated header"));
        }
        if block.iter().all(|&b| b == 0) {
            return if depth == 0 {
                Ok(Head::End)
            } else {
                Err("end marker after an extension header".into())
            };
        }
        let fields: [&[u8]; 6] = [
            &block[100..108],
            &block[108..116],
            &block[116..124],
            &block[124..136],
            &block[136..148],
            &block[148..156],
        ];
        let mut nums = [0i64; 6];
        let mut fast = true;
        for (i, f) in fields.iter().enumerate() {
            match fast_number(f)? {
                Some(v) => nums[i] = v,
                None => {
                    fast = false;
                    break;
                }
            }
        }
        if !fast {
            for (i, f) in fields.iter().enumerate() {
                nums[i] = nti(f)?;
            }
        }
        let [mode, uid, gid, size, mtime, chk] = nums;
        if !checksum_ok(&block, chk) {
            return Err(format!("bad checksum in the header at byte {start}"));
        }
        let typ = block[156];
        match typ {
            b'x' | b'X' => {
                if seen.pax {
                    return Err("repeated PAX header".into());
                }
                let payload = self.extension(size as u64)?;
                let mut pax = Vec::new();
                pax_records(&payload, &mut pax)?;
                let Head::Member(mut m) = self.member(depth + 1, Seen { pax: true, ..seen })? else {
                    unreachable!()
                };
                for (k, v) in &pax {
                    match k.as_slice() {
                        b"path" => {
                            m.name = v.clone();
                            rstrip_slash(&mut m.name);
                        }
                        b"linkpath" => m.linkname = v.clone(),
                        b"size" => m.size = pax_int(v)?,
                        b"uid" => m.uid = pax_int(v)?,
                        b"gid" => m.gid = pax_int(v)?,
                        _ if k.starts_with(b"GNU.sparse.")
                            || k.starts_with(b"LIBARCHIVE.xattr.")
                            || k.starts_with(b"SCHILY.acl.") =>
                        {
                            return Err("GNU sparse, LIBARCHIVE xattr or ACL PAX records".into());
                        }
                        _ => {}
                    }
                }
                m.pax = pax;
                Ok(Head::Member(m))
            }
            b'L' | b'K' => {
                if (typ == b'L' && seen.longname) || (typ == b'K' && seen.longlink) {
                    return Err("repeated GNU long name".into());
                }
                let payload = self.extension(size as u64)?;
                let text = nts(&payload).to_vec();
                let next = if typ == b'L' {
                    Seen { longname: true, ..seen }
                } else {
                    Seen { longlink: true, ..seen }
                };
                let Head::Member(mut m) = self.member(depth + 1, next)? else {
                    unreachable!()
                };
                // a PAX path/linkpath beats a GNU long name, whichever comes first
                let pax_has = |key: &[u8]| m.pax.iter().any(|(k, _)| k.as_slice() == key);
                if typ == b'L' {
                    if !pax_has(b"path") {
                        m.name = text;
                    }
                } else if !pax_has(b"linkpath") {
                    m.linkname = text;
                }
                if m.typ == b'5' && m.name.last() == Some(&b'/') {
                    m.name.pop();
                }
                Ok(Head::Member(m))
            }
            b'0' | 0 | b'7' | b'1' | b'2' | b'3' | b'4' | b'5' | b'6' => {
                let mut typ = typ;
                let mut name = nts(&block[0..100]).to_vec();
                if typ == 0 && name.last() == Some(&b'/') {
                    typ = b'5';
                }
                if typ == b'5' {
                    rstrip_slash(&mut name);
                }
                if block[345] != 0 {
                    if &block[257..263] != b"ustar\0" {
                        return Err("prefix field in a non-POSIX header".into());
                    }
                    let mut full = nts(&block[345..500]).to_vec();
                    full.push(b'/');
                    full.extend_from_slice(&name);
                    name = full;
                }
                let linkname = nts(&block[157..257]).to_vec();
                let (mut devmajor, mut devminor) = (0, 0);
                if typ == b'3' || typ == b'4' {
                    devmajor = nti(&block[329..337])?;
                    devminor = nti(&block[337..345])?;
                }
                if size < 0 {
                    return Err("negative size".into());
                }
                let data_start = self.src.offset;
                Ok(Head::Member(Box::new(Member {
                    name,
                    typ,
                    mode,
                    uid,
                    gid,
                    size,
                    mtime,
                    linkname,
                    devmajor,
                    devminor,
                    pax: Vec::new(),
                    data_start,
                })))
            }
            _ => Err(format!("member type {typ:#04x} (left to the Python reader)")),
        }
    }

    fn extension(&mut self, size: u64) -> R<Vec<u8>> {
        if size > MAX_EXTENSION {
            return Err("extension header too large".into());
        }
        let mut payload = Vec::with_capacity(padded(size) as usize);
        if self.src.read_append(padded(size) as usize, &mut payload) != padded(size) as usize {
            return Err(self.upstream("truncated extension header"));
        }
        payload.truncate(size as usize);
        Ok(payload)
    }

    fn emit(&mut self, m: Member) -> R<()> {
        if m.size < 0 {
            return Err("negative size".into());
        }
        let size = m.size as u64;
        let regular = is_regular(m.typ);
        // every member's data is skipped but a hard link's (as tarheader.py, GNU tar)
        self.next_header = m.data_start + if m.typ != b'1' { padded(size) } else { 0 };
        let base = match m.name.iter().rposition(|&b| b == b'/') {
            Some(i) => &m.name[i + 1..],
            None => &m.name[..],
        };
        let whiteout = self.whiteouts && base.starts_with(b".wh.");
        let (mut mtime_ns, mut atime_ns, mut ctime_ns) = (None, None, None);
        let xstart = self.out.xattrs.len();
        for (k, v) in &m.pax {
            match k.as_slice() {
                b"mtime" => mtime_ns = Some(pax_time(v)?),
                b"atime" => atime_ns = Some(pax_time(v)?),
                b"ctime" => ctime_ns = Some(pax_time(v)?),
                _ => {
                    if let Some(xname) = k.strip_prefix(b"SCHILY.xattr.") {
                        if xname.is_empty() || xname.len() > 255 || xname.contains(&0) || v.len() > 65535 {
                            return Err("unusual xattr".into());
                        }
                        let n = self.out.put_name(xname);
                        let val = self.out.put_name(v);
                        self.out.xattrs.push((n, val));
                    }
                }
            }
        }
        let mtime_ns = match mtime_ns {
            Some(t) => t,
            None => m.mtime.checked_mul(1_000_000_000).ok_or("mtime too large")?,
        };
        let content = if regular && !whiteout {
            self.content_bytes += size;
            self.content(size)?
        } else {
            Content::None
        };
        let name = self.out.put_name(&m.name);
        let link = self.out.put_name(&m.linkname);
        self.out.recs.push(Rec {
            name,
            link,
            typ: m.typ,
            mode: m.mode,
            uid: m.uid,
            gid: m.gid,
            mtime_ns,
            atime_ns,
            ctime_ns,
            xattrs: (xstart, self.out.xattrs.len() - xstart),
            devmajor: m.devmajor,
            devminor: m.devminor,
            content,
        });
        if self.out.recs.len() >= SEGMENT_RECS || self.out.data.len() + self.out.names.len() >= SEGMENT_BYTES {
            let t = std::time::Instant::now();
            self.sink
                .send(std::mem::take(&mut self.out))
                .map_err(|_| "stopped: the members' placement failed".to_string())?;
            self.handing += t.elapsed();
        }
        Ok(())
    }

    fn content(&mut self, size: u64) -> R<Content> {
        if size <= self.keep_inline {
            let at = self.out.data.len();
            if self.src.read_append(size as usize, &mut self.out.data) as u64 != size {
                return Err(self.upstream("truncated member data"));
            }
            self.pack.bytes_in += size;
            return Ok(Content::Inline(at, size as usize));
        }
        if size <= MEM_MAX {
            // by reference to the blocks it lies in: written and hashed from them
            let mut spans = std::mem::take(&mut self.spans);
            let origin = self.src.offset;
            if !self.src.spans(size as usize, &mut spans) {
                return Err(self.upstream("truncated member data"));
            }
            let crc = spans.iter().fold(0, |c, s| crc32c::crc32c_append(c, s.bytes()));
            let t = std::time::Instant::now();
            let put = match self.pack.put(&spans, crc, true, Some(origin)) {
                Ok(put) => put,
                Err(e) => return Err(self.pack_failed(e)),
            };
            self.packing += t.elapsed();
            spans.clear(); // the blocks' references
            self.spans = spans;
            let (Put::New(loc) | Put::Dup(loc)) = put;
            return Ok(Content::Blob(crc, size, loc.0, loc.1));
        }
        let mark = self.pack.begin_stream();
        let mut crc = 0u32;
        let mut left = size;
        while left > 0 {
            let Some(s) = self.src.span(left.min(1 << 20) as usize) else {
                return Err(self.upstream("truncated member data"));
            };
            crc = crc32c::crc32c_append(crc, s.bytes());
            left -= (s.end - s.start) as u64;
            let t = std::time::Instant::now();
            if let Err(e) = self.pack.write_span(s) {
                return Err(self.pack_failed(e));
            }
            self.packing += t.elapsed();
        }
        let (Put::New(loc) | Put::Dup(loc)) = match self.pack.end_stream(mark, size, crc, true) {
            Ok(put) => put,
            Err(e) => return Err(self.pack_failed(e)),
        };
        Ok(Content::Blob(crc, size, loc.0, loc.1))
    }
}
