//! Blocks: the unit of caching. A block is immutable and named by the file it belongs to, the
//! file's version in the UFS and its index, so a changed object can never be served from the
//! blocks of its previous version.

use std::fmt;

use xxhash_rust::xxh3::{xxh3_64, xxh3_128};

/// Identity of one cached block.
///
/// `file` is the UFS identity of the object ([`file_identity`]: UFS URI, object path and block
/// size), not the Strata path, so two mounts of one bucket share blocks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    pub file: String,
    pub version: String,
    pub index: u64,
}

impl BlockKey {
    pub fn new(file: impl Into<String>, version: impl Into<String>, index: u64) -> Self {
        Self { file: file.into(), version: version.into(), index }
    }

    /// Stable encoding used for hashing and in on-disk headers:
    /// `u32 len | file | u32 len | version | u64 index`, little endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.file.len() + self.version.len());
        out.extend_from_slice(&(self.file.len() as u32).to_le_bytes());
        out.extend_from_slice(self.file.as_bytes());
        out.extend_from_slice(&(self.version.len() as u32).to_le_bytes());
        out.extend_from_slice(self.version.as_bytes());
        out.extend_from_slice(&self.index.to_le_bytes());
        out
    }

    /// Inverse of [`encode`](Self::encode); `None` for malformed input.
    pub fn decode(buf: &[u8]) -> Option<(Self, usize)> {
        let mut pos: usize = 0;
        let mut take = |n: usize| -> Option<&[u8]> {
            let s = buf.get(pos..pos.checked_add(n)?)?;
            pos += n;
            Some(s)
        };
        let file_len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let file = std::str::from_utf8(take(file_len)?).ok()?.to_string();
        let version_len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let version = std::str::from_utf8(take(version_len)?).ok()?.to_string();
        let index = u64::from_le_bytes(take(8)?.try_into().ok()?);
        Some((Self { file, version, index }, pos))
    }

    /// 64-bit placement hash (stable across processes, platforms and releases).
    pub fn placement_hash(&self) -> u64 {
        xxh3_64(&self.encode())
    }

    /// 128-bit name for storage (file names on NVMe).
    pub fn storage_id(&self) -> u128 {
        xxh3_128(&self.encode())
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}#{}", self.file, self.version, self.index)
    }
}

/// The identity blocks of a UFS object are keyed by: the mount's UFS URI joined with the
/// object's relative path, and the block size — block `i` of a file cut in 1 MiB blocks holds
/// other bytes than block `i` of the same file cut in 4 MiB blocks, so two mounts of one bucket
/// share blocks only when their block sizes agree. The size is the digits after the last
/// `#bs`, so the string is unambiguous whatever the path contains.
pub fn file_identity(ufs_uri: &str, rel_path: &str, block_size: u64) -> String {
    format!("{}/{}#bs{}", ufs_uri.trim_end_matches('/'), rel_path, block_size)
}

/// The prefix of the file identities of everything at or under `rel` (relative to the mount)
/// on the mount at `uri`: what pins and frees name (see [`identity_under`]).
pub fn identity_prefix(ufs_uri: &str, rel: &str) -> String {
    format!("{}/{}", ufs_uri.trim_end_matches('/'), rel.trim_matches('/'))
}

/// Whether a file identity falls under an [`identity_prefix`]: the file itself, or below it at
/// a `/` (so a prefix of `a/b` covers `a/b/c` and the file `a/b`, never `a/bc`).
pub fn identity_under(prefix: &str, file_identity: &str) -> bool {
    match file_identity.strip_prefix(prefix) {
        None => false,
        Some(rest) => prefix.ends_with('/') || rest.starts_with('/') || rest.starts_with("#bs"),
    }
}

/// Whether a file of `file_size` bytes on a mount with `block_size` and `pack_threshold` is a
/// small file: one block (so its block is the whole file) under the threshold. Workers pack
/// small files' blocks into containers on NVMe; warmup loads them in batches.
pub fn is_small_file(file_size: u64, block_size: u64, pack_threshold: u64) -> bool {
    file_size < pack_threshold && file_size <= block_size
}

/// The block size a [`file_identity`] was made with (the digits after its last `#bs`).
pub fn identity_block_size(file_identity: &str) -> Option<u64> {
    file_identity.rsplit_once("#bs")?.1.parse().ok()
}

/// Whether a block of `len` bytes is a whole small file (see [`is_small_file`]), judged from its
/// key alone: block 0 shorter than its identity's block size is the whole file. What a worker
/// that receives a block without its file's size (a hand-off) decides by.
pub fn is_small_file_block(key: &BlockKey, len: u64, pack_threshold: u64) -> bool {
    key.index == 0
        && identity_block_size(&key.file).is_some_and(|bs| len < bs)
        && is_small_file(len, u64::MAX, pack_threshold)
}

/// One block's share of a byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSlice {
    pub index: u64,
    /// Offset inside the block.
    pub offset: u64,
    pub len: u64,
}

/// Number of blocks of a file (0 for an empty file).
pub fn block_count(file_size: u64, block_size: u64) -> u64 {
    file_size.div_ceil(block_size)
}

/// Length of block `index` of a file (the last block may be short).
pub fn block_len(file_size: u64, block_size: u64, index: u64) -> u64 {
    let start = index.saturating_mul(block_size);
    file_size.saturating_sub(start).min(block_size)
}

/// Splits `[offset, offset+len)` of a file into per-block slices, clamped to the file size.
pub fn block_slices(file_size: u64, block_size: u64, offset: u64, len: u64) -> Vec<BlockSlice> {
    assert!(block_size > 0, "block size must be positive");
    let end = offset.saturating_add(len).min(file_size);
    let mut out = Vec::new();
    let mut pos = offset;
    while pos < end {
        let index = pos / block_size;
        let in_block = pos % block_size;
        let take = (block_size - in_block).min(end - pos);
        out.push(BlockSlice { index, offset: in_block, len: take });
        pos += take;
    }
    out
}

/// Versions of files written to a write-back mount and not yet uploaded start with this: their
/// bytes are in the holders' journals, not in the UFS (docs/WRITEBACK.md).
pub const WRITE_BACK_VERSION_PREFIX: &str = "wb-";

/// The write id of a write-back version, if `version` is one.
pub fn write_back_id(version: &str) -> Option<&str> {
    version.strip_prefix(WRITE_BACK_VERSION_PREFIX).filter(|id| !id.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn key_encoding_round_trips() {
        let key = BlockKey::new("file:///tmp/a b/ü", "m123-s9", 7);
        let enc = key.encode();
        let (dec, used) = BlockKey::decode(&enc).unwrap();
        assert_eq!(dec, key);
        assert_eq!(used, enc.len());
        assert!(BlockKey::decode(&enc[..enc.len() - 1]).is_none());
        assert_ne!(key.storage_id(), BlockKey::new("file:///tmp/a b/ü", "m124-s9", 7).storage_id());
    }

    #[test]
    fn identity_depends_on_block_size() {
        assert_eq!(file_identity("s3://b/p/", "x#bs1", 2), "s3://b/p/x#bs1#bs2");
        assert_ne!(file_identity("s3://b", "x", 1 << 20), file_identity("s3://b", "x", 4 << 20));
    }

    #[test]
    fn small_files_are_one_block_under_the_threshold() {
        assert!(is_small_file(0, 4 << 20, 1 << 20));
        assert!(is_small_file((1 << 20) - 1, 4 << 20, 1 << 20));
        assert!(!is_small_file(1 << 20, 4 << 20, 1 << 20), "the threshold itself is not small");
        assert!(!is_small_file(300 << 10, 256 << 10, 1 << 20), "two blocks are not one small file");
        assert!(!is_small_file(10, 4 << 20, 0), "a threshold of 0 packs nothing");
        let id = file_identity("s3://b/p", "x#bs7", 4 << 20);
        assert_eq!(identity_block_size(&id), Some(4 << 20));
        assert!(is_small_file_block(&BlockKey::new(id.clone(), "v", 0), 1000, 1 << 20));
        assert!(!is_small_file_block(&BlockKey::new(id.clone(), "v", 1), 1000, 1 << 20));
        assert!(
            !is_small_file_block(&BlockKey::new(id.clone(), "v", 0), 4 << 20, 8 << 20),
            "a full first block"
        );
        assert!(!is_small_file_block(&BlockKey::new("no-size", "v", 0), 10, 1 << 20));
    }

    #[test]
    fn last_block_is_short() {
        assert_eq!(block_count(0, 4), 0);
        assert_eq!(block_count(9, 4), 3);
        assert_eq!(block_len(9, 4, 2), 1);
        assert_eq!(block_len(9, 4, 3), 0);
    }

    proptest! {
        #[test]
        fn slices_tile_the_range(size in 0u64..10_000, bs in 1u64..700, off in 0u64..12_000, len in 0u64..12_000) {
            let slices = block_slices(size, bs, off, len);
            let mut pos = off;
            for s in &slices {
                prop_assert_eq!(s.index * bs + s.offset, pos);
                prop_assert!(s.len > 0 && s.offset + s.len <= block_len(size, bs, s.index));
                pos += s.len;
            }
            let expected_end = if off >= size { off } else { off.saturating_add(len).min(size) };
            prop_assert_eq!(pos, expected_end);
        }
    }
}
