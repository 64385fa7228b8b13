//! Helpers the NVMe tier's tests share: keys and their data, what is on disk, event replay.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use strata_common::BlockKey;

use super::format::{BLOCKS_DIR, FIXED_LEN, le_u32, le_u64};
use super::{NvmeTier, pack};
use crate::tier::{BlockPut, PutParams, Tier, TierEvent};

pub(super) fn key(i: u64) -> BlockKey {
    BlockKey::new(format!("s3://bucket/dir/obj{i}"), "etag-1", i)
}

pub(super) fn data_for(i: u64, len: usize) -> Bytes {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect::<Vec<_>>().into()
}

pub(super) fn files_with_suffix(dir: &Path, suffix: &str) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let Ok(shards) = fs::read_dir(dir.join(BLOCKS_DIR)) else {
        return out;
    };
    for shard in shards {
        let shard = shard.unwrap();
        if !shard.file_type().unwrap().is_dir() {
            continue;
        }
        for entry in fs::read_dir(shard.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.to_str().unwrap().ends_with(suffix) {
                out.insert(path);
            }
        }
    }
    out
}

pub(super) fn block_files(dir: &Path) -> BTreeSet<PathBuf> {
    files_with_suffix(dir, ".blk")
}

pub(super) fn key_set(tier: &NvmeTier) -> BTreeMap<BlockKey, u64> {
    tier.keys().into_iter().collect()
}

pub(super) fn replay(state: &mut BTreeMap<BlockKey, u64>, events: Vec<TierEvent>) {
    for ev in events {
        match ev {
            TierEvent::Added { key, size } => {
                assert!(state.insert(key, size).is_none(), "Added for a key already present");
            }
            TierEvent::Removed { key } => {
                assert!(state.remove(&key).is_some(), "Removed for an absent key");
            }
        }
    }
}

/// Inverts one byte of a file in place.
pub(super) fn flip_byte(path: &Path, offset: usize) {
    let mut buf = fs::read(path).unwrap();
    buf[offset] ^= 0xff;
    fs::write(path, buf).unwrap();
}

/// An offset inside the key's file name, i.e. in the checksummed header.
pub(super) const HEADER_BYTE: usize = FIXED_LEN + 4 + 1;

pub(super) async fn assert_dropped_as_corrupt(tier: &NvmeTier, k: &BlockKey) {
    let path = tier.block_path(k);
    assert_eq!(tier.get(k).await.unwrap(), None);
    assert_eq!(tier.corrupt_blocks(), 1);
    assert!(!path.exists(), "corrupt file must be deleted");
    assert!(!tier.contains(k));
    assert!(tier.drain_events().contains(&TierEvent::Removed { key: k.clone() }));
    // Already gone: a second read is a plain miss, not a second corruption.
    assert_eq!(tier.get(k).await.unwrap(), None);
    assert_eq!(tier.corrupt_blocks(), 1);
}

pub(super) fn small_key(i: u64) -> BlockKey {
    BlockKey::new(format!("s3://bucket/small/f{i:05}#bs4194304"), format!("etag-{i}"), 0)
}

pub(super) fn small_puts(range: std::ops::Range<u64>, len: impl Fn(u64) -> usize) -> Vec<BlockPut> {
    range
        .map(|i| BlockPut {
            key: small_key(i),
            data: data_for(i, len(i)),
            params: PutParams { packed: true },
        })
        .collect()
}

pub(super) fn container_files(dir: &Path) -> Vec<PathBuf> {
    pack::list(&dir.join(pack::PACKS_DIR)).unwrap().into_iter().map(|(_, p)| p).collect()
}

/// The live entries of every container, read from disk without repairing anything: every
/// live entry must check out; a dead one only needs its lengths (a corrupt entry dropped on
/// a read is marked dead with its bad header).
pub(super) fn container_entries(dir: &Path) -> BTreeMap<BlockKey, u64> {
    let mut out = BTreeMap::new();
    for (_, path) in pack::list(&dir.join(pack::PACKS_DIR)).unwrap() {
        let buf = fs::read(&path).unwrap();
        let mut pos = 0;
        while pos < buf.len() {
            let entry = &buf[pos..];
            if &entry[..8] == pack::DEAD_MAGIC {
                pos += le_u32(entry, 12) as usize + le_u64(entry, 16) as usize;
                continue;
            }
            let (_, header) = pack::parse_entry_header(entry).expect("a live container entry went bad");
            assert!(out.insert(header.key, header.data_len).is_none(), "a key live twice on disk");
            pos += header.header_len + header.data_len as usize;
        }
        assert_eq!(pos, buf.len(), "a container ends inside an entry: {path:?}");
    }
    out
}
