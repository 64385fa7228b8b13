//! Packed containers: the NVMe tier's storage for small files' blocks. Many blocks share one
//! append-only file, `<dir>/packs/<seq as 8 hex>.pack`, so a batch of small blocks costs one
//! write and one file instead of a file (create, write, rename) each, and a directory of a
//! million small files costs a few hundred files on the device, not a million.
//!
//! # Format (little endian)
//!
//! A container is a sequence of entries, each the block-file header with its own magic, then
//! the data:
//!
//! ```text
//! entry = magic (8) | version u32 = 1 | header_len u32 | data_len u64 | data_crc32c u32
//!         | BlockKey::encode() | header_crc32c u32 (of every header byte after the magic) | data
//! magic = b"STRATAPK" (live) | b"STRATAPX" (dead: evicted, removed, dropped, or moved)
//! ```
//!
//! The header checksum leaves the magic out, so marking an entry dead is one 8-byte write that
//! keeps its lengths checked: recovery skips a dead entry by them and never resurrects a block
//! that was evicted or freed before a restart. The whole pages inside a dead entry's data are
//! punched out of the file at once (`fallocate` PUNCH_HOLE), so eviction gives the disk back
//! its space without waiting for compaction — what a full disk needs.
//!
//! # Invariants
//!
//! - An entry's data is never modified while it is live: entries are appended; marking one dead
//!   rewrites its magic and punches its data. A reader that looked an entry up and then lost it
//!   to eviction reads the dead magic or zeros, which fail its checks: a miss, never wrong
//!   bytes. Hence no entry is ever served without that check (no `sendfile` of an entry, no
//!   descriptor passed to a client: a container holds other files too).
//! - One writer appends (the tier's appender mutex); a failed append truncates the file back to
//!   where it was, so a container never holds a half entry under a live magic except after a
//!   crash, which recovery detects (a torn tail fails its header or length check) and cuts off.
//! - Data checksums are checked on every read that is not served zero-copy (as for block
//!   files); recovery reads headers only.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use bytes::Bytes;
use strata_common::BlockKey;

use super::format::{
    FORMAT_VERSION, HEADER_CRC_LEN, Header, MAX_HEADER_LEN, MIN_KEY_LEN, Malformed, le_u32, le_u64,
};

pub(super) const PACKS_DIR: &str = "packs";
const PACK_EXT: &str = "pack";
pub(super) const LIVE_MAGIC: &[u8; 8] = b"STRATAPK";
pub(super) const DEAD_MAGIC: &[u8; 8] = b"STRATAPX";
/// magic, version, header_len, data_len, data_crc — the same fixed part as a block file's.
const FIXED_LEN: usize = 8 + 4 + 4 + 8 + 4;
/// A container is sealed (no more appends) once it holds this many bytes; the next batch opens a
/// new one. Large enough that a directory of small files is a few files, small enough that
/// compacting one moves little.
pub const DEFAULT_CONTAINER_BYTES: u64 = 32 << 20;

/// The file of container `seq`.
pub(super) fn container_path(packs_dir: &Path, seq: u32) -> PathBuf {
    packs_dir.join(format!("{seq:08x}.{PACK_EXT}"))
}

/// The sequence number of a container file's name, if it is one.
fn container_seq(name: &str) -> Option<u32> {
    let hex = name.strip_suffix(&format!(".{PACK_EXT}"))?;
    if hex.len() != 8 {
        return None;
    }
    u32::from_str_radix(hex, 16).ok()
}

/// Length of an entry's header for `key`.
pub(super) fn header_len_for(key: &BlockKey) -> usize {
    FIXED_LEN + key.encode().len() + HEADER_CRC_LEN
}

/// Length of a whole entry (header and data).
pub(super) fn entry_len(key: &BlockKey, size: u64) -> u64 {
    header_len_for(key) as u64 + size
}

/// Appends one live entry for `key` to `buf`.
pub(super) fn encode_entry(buf: &mut Vec<u8>, key: &BlockKey, data: &[u8]) {
    let key_enc = key.encode();
    let header_len = FIXED_LEN + key_enc.len() + HEADER_CRC_LEN;
    let start = buf.len();
    buf.extend_from_slice(LIVE_MAGIC);
    buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    buf.extend_from_slice(&(header_len as u32).to_le_bytes());
    buf.extend_from_slice(&(data.len() as u64).to_le_bytes());
    buf.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    buf.extend_from_slice(&key_enc);
    let crc = crc32c::crc32c(&buf[start + LIVE_MAGIC.len()..]);
    buf.extend_from_slice(&crc.to_le_bytes());
    buf.extend_from_slice(data);
}

/// Whether the entry is live or marked dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Liveness {
    Live,
    Dead,
}

/// Validates an entry's fixed prefix (at least `FIXED_LEN` bytes): its liveness and header length.
fn prefix_of(prefix: &[u8]) -> Result<(Liveness, usize), Malformed> {
    if prefix.len() < FIXED_LEN {
        return Err("truncated entry header");
    }
    let liveness = match &prefix[..8] {
        m if m == LIVE_MAGIC => Liveness::Live,
        m if m == DEAD_MAGIC => Liveness::Dead,
        _ => return Err("bad entry magic"),
    };
    if le_u32(prefix, 8) != FORMAT_VERSION {
        return Err("unsupported entry format version");
    }
    let header_len = le_u32(prefix, 12) as usize;
    if !(FIXED_LEN + MIN_KEY_LEN + HEADER_CRC_LEN..=MAX_HEADER_LEN).contains(&header_len) {
        return Err("bad entry header length");
    }
    Ok((liveness, header_len))
}

/// Parses and checksums a whole entry header at the start of `buf`.
pub(super) fn parse_entry_header(buf: &[u8]) -> Result<(Liveness, Header), Malformed> {
    let (liveness, header_len) = prefix_of(buf)?;
    let header = buf.get(..header_len).ok_or("truncated entry header")?;
    let (body, crc) = header.split_at(header_len - HEADER_CRC_LEN);
    if crc32c::crc32c(&body[8..]) != le_u32(crc, 0) {
        return Err("entry header checksum mismatch");
    }
    let key_enc = &body[FIXED_LEN..];
    match BlockKey::decode(key_enc) {
        Some((key, used)) if used == key_enc.len() => {
            let header = Header {
                version: FORMAT_VERSION,
                header_len,
                data_len: le_u64(body, 16),
                data_crc: le_u32(body, 24),
                key,
            };
            Ok((liveness, header))
        }
        _ => Err("malformed key in entry"),
    }
}

/// What a read of one entry found.
pub(super) enum EntryRead {
    Hit(Bytes),
    /// Marked dead (evicted or moved after the caller looked it up): a miss.
    Dead,
    Corrupt(Malformed),
}

/// Reads and fully validates the entry of `key` (`size` data bytes) at `offset` of `file`.
pub(super) fn read_entry(file: &File, offset: u64, key: &BlockKey, size: u64) -> io::Result<EntryRead> {
    let header_len = header_len_for(key);
    let total = header_len as u64 + size;
    let Ok(total) = usize::try_from(total) else { return Ok(EntryRead::Corrupt("entry too large")) };
    let mut buf = vec![0u8; total];
    let mut done = 0;
    while done < total {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => return Ok(EntryRead::Corrupt("container ends inside the entry")),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let (liveness, header) = match parse_entry_header(&buf) {
        Ok(parsed) => parsed,
        Err(reason) => return Ok(EntryRead::Corrupt(reason)),
    };
    if liveness == Liveness::Dead {
        return Ok(EntryRead::Dead);
    }
    if header.key != *key || header.header_len != header_len {
        return Ok(EntryRead::Corrupt("key mismatch"));
    }
    if header.data_len != size {
        return Ok(EntryRead::Corrupt("length mismatch"));
    }
    let data = Bytes::from(buf).slice(header_len..);
    if crc32c::crc32c(&data) != header.data_crc {
        return Ok(EntryRead::Corrupt("data checksum mismatch"));
    }
    Ok(EntryRead::Hit(data))
}

/// Marks the entry at `offset` (a header of `header_len` bytes, then `data_len` bytes of data)
/// dead and punches the whole pages of its data out of the file (see the module docs). A file
/// system that cannot punch holes keeps the bytes until compaction; the entry is dead either way.
pub(super) fn mark_dead(file: &File, offset: u64, header_len: u64, data_len: u64) -> io::Result<()> {
    file.write_all_at(DEAD_MAGIC, offset)?;
    const PAGE: u64 = 4096;
    let start = (offset + header_len).div_ceil(PAGE) * PAGE;
    let end = (offset + header_len + data_len) / PAGE * PAGE;
    if end > start {
        punch_hole(file, start, end - start);
    }
    Ok(())
}

fn punch_hole(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else { return };
    // SAFETY: the descriptor is open for the duration of the call (borrowed from `file`); the
    // call only changes the file's contents in the range, which holds no live entry.
    let rc = unsafe {
        libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len)
    };
    if rc != 0 {
        tracing::debug!(tier = "nvme", error = %io::Error::last_os_error(), "cannot punch a dead entry out of its container");
    }
}

/// Creates the file of a new container.
pub(super) fn create(packs_dir: &Path, seq: u32) -> io::Result<File> {
    let path = container_path(packs_dir, seq);
    let open = || OpenOptions::new().read(true).write(true).create_new(true).open(&path);
    match open() {
        Ok(file) => Ok(file),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(packs_dir)?;
            open()
        }
        Err(e) => Err(e),
    }
}

/// Appends `buf` (whole entries) at `at`, the container's current end; on failure the file is
/// cut back to `at`, so no partial entry stays behind a live magic.
pub(super) fn append(file: &File, at: u64, buf: &[u8]) -> io::Result<()> {
    match file.write_all_at(buf, at) {
        Ok(()) => Ok(()),
        Err(e) => {
            if let Err(cut) = file.set_len(at) {
                tracing::warn!(tier = "nvme", error = %cut, "could not cut a failed append back");
            }
            Err(e)
        }
    }
}

/// A live entry found by [`scan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Found {
    pub key: BlockKey,
    pub size: u64,
    pub offset: u64,
}

/// What [`scan`] made of one container file.
#[derive(Debug)]
pub(super) struct Scanned {
    pub file: File,
    /// Length after any torn tail was cut off.
    pub len: u64,
    pub mtime: SystemTime,
    pub live: Vec<Found>,
    /// Corrupt entries skipped (and marked dead): their header failed its checksum, but their
    /// lengths led to an entry that checks out.
    pub skipped: u64,
    /// Why the tail was cut, if it was (a torn or corrupt entry and everything after it).
    pub cut: Option<Malformed>,
}

/// Reads every entry header of a container (not the data). A corrupt entry is skipped when the
/// lengths in its prefix lead to an entry that checks out (bit rot inside one header); otherwise
/// the file is cut at it (a torn tail, or garbage).
pub(super) fn scan(path: &Path) -> io::Result<Scanned> {
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    let meta = file.metadata()?;
    let file_len = meta.len();
    let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    let mut live = Vec::new();
    let mut pos = 0u64;
    let mut skipped = 0;
    let mut cut = None;
    let mut buf = Vec::new();
    while pos < file_len {
        let reason = match read_header_at(&file, pos, file_len, &mut buf)? {
            Ok((liveness, header)) => {
                let end = pos + header.header_len as u64 + header.data_len;
                if end > file_len {
                    "container ends inside an entry"
                } else {
                    if liveness == Liveness::Live {
                        live.push(Found { key: header.key, size: header.data_len, offset: pos });
                    }
                    pos = end;
                    continue;
                }
            }
            Err(reason) => reason,
        };
        // Its prefix may still say where the next entry is; trust it only if one is there (or
        // the file ends right there after an entry already marked dead).
        if let Some((liveness, next)) = next_after_corrupt(&buf, pos, file_len) {
            let dead = liveness == Liveness::Dead;
            let next_checks_out = if next == file_len {
                dead
            } else {
                read_header_at(&file, next, file_len, &mut Vec::new())?.is_ok()
            };
            if next_checks_out {
                // A dead entry's header going bad loses nothing: only a live one is counted.
                if !dead {
                    let header_len = le_u32(&buf, 12) as u64;
                    mark_dead(&file, pos, header_len, next - pos - header_len)?;
                    skipped += 1;
                }
                pos = next;
                continue;
            }
        }
        cut = Some(reason);
        break;
    }
    if cut.is_some() {
        file.set_len(pos)?;
    }
    Ok(Scanned { file, len: pos, mtime, live, skipped, cut })
}

/// Whether a corrupt entry at `pos` is marked live or dead and where the entry after it starts,
/// by the lengths in its prefix (in `buf`, as [`read_header_at`] left it), if the prefix is
/// sound and that is inside the file.
fn next_after_corrupt(buf: &[u8], pos: u64, file_len: u64) -> Option<(Liveness, u64)> {
    let (liveness, header_len) = prefix_of(buf).ok()?;
    let data_len = le_u64(buf, 16);
    let next = pos.checked_add(header_len as u64)?.checked_add(data_len)?;
    (next <= file_len).then_some((liveness, next))
}

fn read_header_at(
    file: &File,
    pos: u64,
    file_len: u64,
    buf: &mut Vec<u8>,
) -> io::Result<Result<(Liveness, Header), Malformed>> {
    buf.clear();
    if file_len - pos < FIXED_LEN as u64 {
        return Ok(Err("truncated entry header"));
    }
    buf.resize(FIXED_LEN, 0);
    file.read_exact_at(buf, pos)?;
    let header_len = match prefix_of(buf) {
        Ok((_, len)) => len,
        Err(reason) => return Ok(Err(reason)),
    };
    if (file_len - pos) < header_len as u64 {
        return Ok(Err("truncated entry header"));
    }
    buf.resize(header_len, 0);
    file.read_exact_at(&mut buf[FIXED_LEN..], pos + FIXED_LEN as u64)?;
    Ok(parse_entry_header(buf))
}

/// The live entries of a container read whole into `buf`, with their offsets, in order; the
/// walk ends at the first entry that does not check out (what follows it is not trusted).
pub(super) fn walk(buf: &[u8]) -> impl Iterator<Item = (u64, Header)> + '_ {
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        while pos < buf.len() {
            let (liveness, header) = parse_entry_header(&buf[pos..]).ok()?;
            let end =
                pos.checked_add(header.header_len)?.checked_add(usize::try_from(header.data_len).ok()?)?;
            if end > buf.len() {
                return None;
            }
            let at = pos as u64;
            pos = end;
            if liveness == Liveness::Live {
                return Some((at, header));
            }
        }
        None
    })
}

/// The container files under `packs_dir`, with their sequence numbers, in sequence order;
/// anything else there is left alone.
pub(super) fn list(packs_dir: &Path) -> io::Result<Vec<(u32, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(packs_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if let Some(seq) = entry.file_name().to_str().and_then(container_seq) {
            out.push((seq, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> BlockKey {
        BlockKey::new(format!("s3://b/small/f{i}#bs4194304"), format!("etag-{i}"), 0)
    }

    fn data(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i as usize * 13 + j * 3) as u8).collect()
    }

    fn write(dir: &Path, entries: &[(BlockKey, Vec<u8>)]) -> (File, Vec<u64>) {
        let file = create(dir, 1).unwrap();
        let mut buf = Vec::new();
        let mut offsets = Vec::new();
        for (k, d) in entries {
            offsets.push(buf.len() as u64);
            encode_entry(&mut buf, k, d);
        }
        append(&file, 0, &buf).unwrap();
        (file, offsets)
    }

    #[test]
    fn entries_round_trip_and_dead_marks_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let entries: Vec<_> = (0..5).map(|i| (key(i), data(i, i as usize * 100))).collect();
        let (file, offsets) = write(dir.path(), &entries);
        for (i, (k, d)) in entries.iter().enumerate() {
            match read_entry(&file, offsets[i], k, d.len() as u64).unwrap() {
                EntryRead::Hit(got) => assert_eq!(&got[..], &d[..]),
                _ => panic!("entry {i} not read back"),
            }
            assert_eq!(entry_len(k, d.len() as u64), header_len_for(k) as u64 + d.len() as u64);
        }
        mark_dead(&file, offsets[2], header_len_for(&key(2)) as u64, 200).unwrap();
        assert!(matches!(read_entry(&file, offsets[2], &key(2), 200).unwrap(), EntryRead::Dead));
        let scanned = scan(&container_path(dir.path(), 1)).unwrap();
        assert_eq!(scanned.cut, None);
        let keys: Vec<_> = scanned.live.iter().map(|f| f.key.clone()).collect();
        assert_eq!(keys, vec![key(0), key(1), key(3), key(4)]);
        assert_eq!(scanned.live[2], Found { key: key(3), size: 300, offset: offsets[3] });
        // Another key at that offset is not this block.
        assert!(matches!(read_entry(&file, offsets[3], &key(4), 300).unwrap(), EntryRead::Corrupt(_)));
    }

    #[test]
    fn a_torn_tail_is_cut_and_the_entries_before_it_kept() {
        let dir = tempfile::tempdir().unwrap();
        let entries: Vec<_> = (0..3).map(|i| (key(i), data(i, 1000))).collect();
        let (file, offsets) = write(dir.path(), &entries);
        let full = file.metadata().unwrap().len();
        // A crash in the middle of the last entry's data.
        file.set_len(full - 10).unwrap();
        let scanned = scan(&container_path(dir.path(), 1)).unwrap();
        assert_eq!(scanned.live.len(), 2);
        assert!(scanned.cut.is_some());
        assert_eq!(scanned.len, offsets[2]);
        assert_eq!(file.metadata().unwrap().len(), offsets[2], "the torn entry is cut off");
        // Garbage where a header should be cuts there too.
        let file = create(dir.path(), 2).unwrap();
        let mut buf = Vec::new();
        encode_entry(&mut buf, &key(9), &data(9, 50));
        let good = buf.len() as u64;
        buf.extend_from_slice(&[0xAB; 64]);
        append(&file, 0, &buf).unwrap();
        let scanned = scan(&container_path(dir.path(), 2)).unwrap();
        assert_eq!((scanned.live.len(), scanned.len), (1, good));
        assert_eq!(scanned.cut, Some("bad entry magic"));
    }

    #[test]
    fn a_flipped_data_byte_is_corrupt_and_a_flipped_header_byte_cuts_on_scan() {
        let dir = tempfile::tempdir().unwrap();
        let entries: Vec<_> = (0..2).map(|i| (key(i), data(i, 64))).collect();
        let (file, offsets) = write(dir.path(), &entries);
        let flip = |at: u64| {
            let mut b = [0u8; 1];
            file.read_exact_at(&mut b, at).unwrap();
            file.write_all_at(&[b[0] ^ 0xff], at).unwrap();
        };
        flip(offsets[1] - 1);
        assert!(matches!(read_entry(&file, offsets[0], &key(0), 64).unwrap(), EntryRead::Corrupt(_)));
        flip(offsets[1] + 20);
        let scanned = scan(&container_path(dir.path(), 1)).unwrap();
        assert_eq!(scanned.live.len(), 1, "headers only: the data flip is found on read");
        assert_eq!(scanned.cut, Some("entry header checksum mismatch"));
    }

    #[test]
    fn names_round_trip() {
        let dir = Path::new("/x/packs");
        let p = container_path(dir, 0x1234);
        assert_eq!(p, dir.join("00001234.pack"));
        assert_eq!(container_seq("00001234.pack"), Some(0x1234));
        assert_eq!(container_seq("1234.pack"), None);
        assert_eq!(container_seq("00001234.pack.tmp"), None);
    }
}
