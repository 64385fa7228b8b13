//! Block files: where a key's file sits, what is in it, and the reads and writes that check it.
//! Functions of paths and bytes only — no index, no lock — so the units that call them decide
//! what a failed check means: a miss and a dropped block on a read, a file discarded at `open`.
//!
//! # On-disk format (little endian)
//!
//! ```text
//! magic b"STRATABK" (8) | version u32 = 2 | header_len u32 | data_len u64 | data_crc32c u32
//! | BlockKey::encode() | header_crc32c u32 (of every preceding header byte) | data
//! | chunk_crc32c u32 per 64 KiB of data (the last chunk may be shorter)
//! ```
//!
//! The chunk checksums let a read of part of a block it has not verified check only the
//! 64 KiB chunks the range touches ([`Tier::get_range`]): a 4 KiB read of a block after a
//! restart reads and checks 64 KiB, not 4 MiB. Version 1 files (no chunk checksums, written
//! before them) are still read; a range of one is read by checking the whole block. The data
//! starts right after the header in both, so where a block's bytes sit does not depend on the
//! version.
//!
//! The full key is in the header because the file name is only a hash: a read checks that the
//! file holds the block that was asked for. `header_len` lets [`NvmeTier::open`] read just the
//! header of each file, so a restart costs one small read per block, not a read of the cache.
//! A container entry has the same header under its own magic (see [`pack`]).

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use bytes::Bytes;
use strata_common::BlockKey;

#[cfg(doc)]
use super::{NvmeTier, pack};
#[cfg(doc)]
use crate::tier::Tier;

const MAGIC: &[u8; 8] = b"STRATABK";
/// The format of container entries, and of block files written before chunk checksums.
pub(super) const FORMAT_VERSION: u32 = 1;
/// The format of block files written now: version 1 plus the chunk checksums after the data.
const CHUNKED_FORMAT_VERSION: u32 = 2;
/// Bytes of data one chunk checksum covers.
pub const CHECKSUM_CHUNK: u64 = 64 << 10;
/// magic, version, header_len, data_len, data_crc.
pub(super) const FIXED_LEN: usize = 8 + 4 + 4 + 8 + 4;
pub(super) const HEADER_CRC_LEN: usize = 4;
/// The smallest key encoding: two empty strings and an index.
pub(super) const MIN_KEY_LEN: usize = 4 + 4 + 8;
/// Bounds what `open` will allocate for a header found on disk; real keys are far smaller.
pub(super) const MAX_HEADER_LEN: usize = 1 << 20;
pub(super) const BLOCKS_DIR: &str = "blocks";
pub(super) const BLOCK_EXT: &str = "blk";
pub(super) const TMP_SUFFIX: &str = ".tmp";

/// The file name of a key, relative to the blocks directory.
pub(super) fn block_path_in(blocks_dir: &Path, key: &BlockKey) -> PathBuf {
    let hex = format!("{:032x}", key.storage_id());
    blocks_dir.join(&hex[..2]).join(format!("{hex}.{BLOCK_EXT}"))
}

pub(super) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(TMP_SUFFIX);
    PathBuf::from(name)
}

pub(super) fn header_len_for(key: &BlockKey) -> usize {
    FIXED_LEN + key.encode().len() + HEADER_CRC_LEN
}

/// The header and the chunk-checksum trailer of a block file (format 2). One pass over the
/// data: the whole-data checksum is combined from the chunks'.
pub(super) fn encode_block(key: &BlockKey, data: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut trailer = Vec::with_capacity(trailer_len(data.len() as u64));
    let mut data_crc = 0;
    for chunk in data.chunks(CHECKSUM_CHUNK as usize) {
        let crc = crc32c::crc32c(chunk);
        trailer.extend_from_slice(&crc.to_le_bytes());
        data_crc = crc32c::crc32c_combine(data_crc, crc, chunk.len());
    }
    (encode_header(key, CHUNKED_FORMAT_VERSION, data.len() as u64, data_crc), trailer)
}

fn encode_header(key: &BlockKey, version: u32, data_len: u64, data_crc: u32) -> Vec<u8> {
    let key_enc = key.encode();
    let header_len = FIXED_LEN + key_enc.len() + HEADER_CRC_LEN;
    let mut header = Vec::with_capacity(header_len);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&version.to_le_bytes());
    header.extend_from_slice(&(header_len as u32).to_le_bytes());
    header.extend_from_slice(&data_len.to_le_bytes());
    header.extend_from_slice(&data_crc.to_le_bytes());
    header.extend_from_slice(&key_enc);
    let crc = crc32c::crc32c(&header);
    header.extend_from_slice(&crc.to_le_bytes());
    header
}

/// Bytes of the chunk checksums after `data_len` bytes of data (format 2).
pub(super) fn trailer_len(data_len: u64) -> usize {
    data_len.div_ceil(CHECKSUM_CHUNK) as usize * 4
}

/// Bytes after the data in a block file of `version`.
fn trailer_len_of(version: u32, data_len: u64) -> u64 {
    if version == CHUNKED_FORMAT_VERSION { trailer_len(data_len) as u64 } else { 0 }
}

pub(super) fn le_u32(buf: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(raw)
}

pub(super) fn le_u64(buf: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(raw)
}

/// Why a block file was rejected; logged as the `reason` field.
pub(super) type Malformed = &'static str;

/// Validates the fixed prefix (at least `FIXED_LEN` bytes) and returns the full header length.
fn header_len_of(prefix: &[u8]) -> std::result::Result<usize, Malformed> {
    if prefix.len() < FIXED_LEN {
        return Err("truncated header");
    }
    if &prefix[..MAGIC.len()] != MAGIC {
        return Err("bad magic");
    }
    if !matches!(le_u32(prefix, 8), FORMAT_VERSION | CHUNKED_FORMAT_VERSION) {
        return Err("unsupported format version");
    }
    let header_len = le_u32(prefix, 12) as usize;
    if !(FIXED_LEN + MIN_KEY_LEN + HEADER_CRC_LEN..=MAX_HEADER_LEN).contains(&header_len) {
        return Err("bad header length");
    }
    Ok(header_len)
}

pub(super) struct Header {
    pub(super) version: u32,
    pub(super) header_len: usize,
    pub(super) data_len: u64,
    pub(super) data_crc: u32,
    pub(super) key: BlockKey,
}

/// Parses and checksums the header at the start of `buf`.
fn parse_header(buf: &[u8]) -> std::result::Result<Header, Malformed> {
    let header_len = header_len_of(buf)?;
    let header = buf.get(..header_len).ok_or("truncated header")?;
    let (body, crc) = header.split_at(header_len - HEADER_CRC_LEN);
    if crc32c::crc32c(body) != le_u32(crc, 0) {
        return Err("header checksum mismatch");
    }
    let key_enc = &body[FIXED_LEN..];
    match BlockKey::decode(key_enc) {
        Some((key, used)) if used == key_enc.len() => Ok(Header {
            version: le_u32(body, 8),
            header_len,
            data_len: le_u64(body, 16),
            data_crc: le_u32(body, 24),
            key,
        }),
        _ => Err("malformed key"),
    }
}

pub(super) enum ReadOutcome {
    Hit(Bytes),
    Missing,
    Corrupt(Malformed),
}

/// Reads and fully validates one block file.
pub(super) fn read_block(path: &Path, key: &BlockKey) -> io::Result<ReadOutcome> {
    let buf = match fs::read(path) {
        Ok(buf) => buf,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ReadOutcome::Missing),
        Err(e) => return Err(e),
    };
    let header = match parse_header(&buf) {
        Ok(header) => header,
        Err(reason) => return Ok(ReadOutcome::Corrupt(reason)),
    };
    if header.key != *key {
        return Ok(ReadOutcome::Corrupt("key mismatch"));
    }
    let data_end = header.header_len as u64 + header.data_len;
    if buf.len() as u64 != data_end + trailer_len_of(header.version, header.data_len) {
        return Ok(ReadOutcome::Corrupt("length mismatch"));
    }
    // Slicing the buffer hands out the data without copying it past the header.
    let data = Bytes::from(buf).slice(header.header_len..data_end as usize);
    if crc32c::crc32c(&data) != header.data_crc {
        return Ok(ReadOutcome::Corrupt("data checksum mismatch"));
    }
    Ok(ReadOutcome::Hit(data))
}

/// Reads only the header of a block file found by `open`.
pub(super) fn scan_block(
    path: &Path,
) -> io::Result<std::result::Result<(BlockKey, u64, SystemTime), Malformed>> {
    let mut file = File::open(path)?;
    let meta = file.metadata()?;
    let mut buf = vec![0u8; FIXED_LEN];
    if meta.len() < FIXED_LEN as u64 {
        return Ok(Err("truncated header"));
    }
    file.read_exact(&mut buf)?;
    let header_len = match header_len_of(&buf) {
        Ok(len) => len,
        Err(reason) => return Ok(Err(reason)),
    };
    if header_len as u64 > meta.len() {
        return Ok(Err("truncated header"));
    }
    buf.resize(header_len, 0);
    file.read_exact(&mut buf[FIXED_LEN..])?;
    let header = match parse_header(&buf) {
        Ok(header) => header,
        Err(reason) => return Ok(Err(reason)),
    };
    if header.header_len as u64 + header.data_len + trailer_len_of(header.version, header.data_len)
        != meta.len()
    {
        return Ok(Err("length mismatch"));
    }
    // Without an mtime the block just counts as oldest, which only matters for eviction order.
    let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    Ok(Ok((header.key, header.data_len, mtime)))
}

/// Reads `range` of the data of one block file, checking only the chunks it touches (format 2;
/// a format 1 file is read and checked whole). `Hit` holds exactly the range.
pub(super) fn read_block_range(
    path: &Path,
    key: &BlockKey,
    range: std::ops::Range<u64>,
) -> io::Result<ReadOutcome> {
    use std::os::unix::fs::FileExt;
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ReadOutcome::Missing),
        Err(e) => return Err(e),
    };
    let file_len = file.metadata()?.len();
    let header_len = header_len_for(key);
    if file_len < header_len as u64 {
        return Ok(ReadOutcome::Corrupt("truncated header"));
    }
    let mut head = vec![0u8; header_len];
    file.read_exact_at(&mut head, 0)?;
    let header = match parse_header(&head) {
        Ok(header) if header.header_len == header_len => header,
        Ok(_) => return Ok(ReadOutcome::Corrupt("key mismatch")),
        Err(reason) => return Ok(ReadOutcome::Corrupt(reason)),
    };
    if header.key != *key {
        return Ok(ReadOutcome::Corrupt("key mismatch"));
    }
    let data_end = header_len as u64 + header.data_len;
    if file_len != data_end + trailer_len_of(header.version, header.data_len) {
        return Ok(ReadOutcome::Corrupt("length mismatch"));
    }
    if range.end > header.data_len || range.start > range.end {
        return Ok(ReadOutcome::Corrupt("range past the block"));
    }
    if header.version != CHUNKED_FORMAT_VERSION {
        return Ok(match read_block(path, key)? {
            ReadOutcome::Hit(data) => ReadOutcome::Hit(data.slice(range.start as usize..range.end as usize)),
            other => other,
        });
    }
    let first = range.start / CHECKSUM_CHUNK;
    let last = range.end.div_ceil(CHECKSUM_CHUNK).max(first + 1);
    let chunks_start = first * CHECKSUM_CHUNK;
    let chunks_end = (last * CHECKSUM_CHUNK).min(header.data_len);
    let mut data = vec![0u8; (chunks_end - chunks_start) as usize];
    file.read_exact_at(&mut data, header_len as u64 + chunks_start)?;
    let mut crcs = vec![0u8; ((last - first) * 4) as usize];
    if !crcs.is_empty() {
        file.read_exact_at(&mut crcs, data_end + first * 4)?;
    }
    for (chunk, crc) in data.chunks(CHECKSUM_CHUNK as usize).zip(crcs.chunks_exact(4)) {
        if crc32c::crc32c(chunk) != le_u32(crc, 0) {
            return Ok(ReadOutcome::Corrupt("chunk checksum mismatch"));
        }
    }
    let from = (range.start - chunks_start) as usize;
    Ok(ReadOutcome::Hit(Bytes::from(data).slice(from..from + (range.end - range.start) as usize)))
}

pub(super) fn write_block_file(tmp: &Path, header: &[u8], data: &[u8], trailer: &[u8]) -> io::Result<()> {
    let mut file = match File::create(tmp) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // Shard directories are created on first use (or were removed behind our back).
            if let Some(parent) = tmp.parent() {
                fs::create_dir_all(parent)?;
            }
            File::create(tmp)?
        }
        Err(e) => return Err(e),
    };
    file.write_all(header)?;
    file.write_all(data)?;
    file.write_all(trailer)
}

/// Deletes a file whose absence is what we want anyway; failures are logged, not returned.
pub(super) fn remove_quietly(path: &Path, what: &'static str) {
    if let Err(e) = fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), tier = "nvme", error = %e, what, "could not delete file");
    }
}

#[cfg(test)]
mod tests {
    use std::fs::{self, File};

    use super::super::NvmeTier;
    use super::super::testing::{HEADER_BYTE, assert_dropped_as_corrupt, data_for, flip_byte, key};
    use super::*;
    use crate::tier::Tier;

    #[tokio::test]
    async fn a_corrupt_chunk_checksum_drops_the_block() {
        let dir = tempfile::tempdir().unwrap();
        let data = data_for(3, 200_000);
        NvmeTier::open(dir.path(), 1 << 20).unwrap().put(&key(3), data.clone()).await.unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        let path = tier.block_path(&key(3));
        // The second of four chunk checksums, after the data.
        flip_byte(&path, header_len_for(&key(3)) + data.len() + 4 + 1);
        assert_eq!(tier.get_range(&key(3), 0..10).await.unwrap().unwrap(), data.slice(0..10));
        assert_eq!(tier.get_range(&key(3), 70_000..70_010).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
    }

    #[tokio::test]
    async fn format_1_block_files_are_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let data = data_for(4, 300_000);
        let path = block_path_in(&dir.path().join(BLOCKS_DIR), &key(4));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        let header = encode_header(&key(4), FORMAT_VERSION, data.len() as u64, crc32c::crc32c(&data));
        fs::write(&path, [&header[..], &data[..]].concat()).unwrap();

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert!(tier.contains(&key(4)), "open indexes a format 1 file");
        assert_eq!(
            tier.get_range(&key(4), 70_000..70_100).await.unwrap().unwrap(),
            data.slice(70_000..70_100)
        );
        assert_eq!(tier.get(&key(4)).await.unwrap().unwrap(), data);
        let span = tier.open_verified(&key(4)).expect("verified by the whole read");
        assert_eq!((span.offset, span.len), (header.len() as u64, data.len() as u64));

        // Its data checksum still guards it.
        flip_byte(&path, header.len() + 123);
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(tier.get_range(&key(4), 0..10).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
    }

    #[tokio::test]
    async fn corrupt_header_is_dropped_on_get() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 500)).await.unwrap();
        flip_byte(&tier.block_path(&key(1)), HEADER_BYTE);
        assert_dropped_as_corrupt(&tier, &key(1)).await;
        assert_eq!(tier.usage().used_bytes, 0);
    }

    #[tokio::test]
    async fn truncated_file_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 500)).await.unwrap();
        let path = tier.block_path(&key(1));
        let file = File::options().write(true).open(&path).unwrap();
        file.set_len(file.metadata().unwrap().len() - 1).unwrap();
        drop(file);
        assert_dropped_as_corrupt(&tier, &key(1)).await;
    }

    #[tokio::test]
    async fn wrong_key_in_file_is_dropped() {
        // What a storage-id collision would look like: the file under B's name holds A.
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 64)).await.unwrap();
        tier.put(&key(2), data_for(2, 64)).await.unwrap();
        fs::copy(tier.block_path(&key(1)), tier.block_path(&key(2))).unwrap();
        assert_dropped_as_corrupt(&tier, &key(2)).await;
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(data_for(1, 64)));
    }
}
