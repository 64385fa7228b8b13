//! Opening an NVMe tier's directory: the block files' headers and the containers' entry
//! headers are read (not the data) to rebuild the index. Temporary files are deleted; malformed
//! files, files under another key's name and torn container tails are discarded and counted as
//! corrupt; a key found twice keeps its newest copy; over the capacity the oldest blocks go.
//! [`NvmeTier::open_with`](super::NvmeTier::open_with) documents what a caller sees.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use strata_common::BlockKey;

use super::format::{BLOCK_EXT, TMP_SUFFIX, block_path_in, remove_quietly, scan_block};
use super::index::{Container, Index, PackAt};
use super::pack;

/// Where a block found by `open` is stored, ordered for ties of equal mtimes: files by path,
/// then entries by container and offset (their write order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Place {
    File(PathBuf),
    Packed(u32, u64),
}

/// A block found by `open`.
struct Recovered {
    mtime: SystemTime,
    place: Place,
    key: BlockKey,
    size: u64,
}

/// Scans the tier's directory (creating what is missing) and rebuilds its index: returns it with
/// the number of corrupt blocks and files found.
pub(super) fn recover(
    dir: &Path,
    blocks_dir: &Path,
    packs_dir: &Path,
    capacity_bytes: u64,
) -> io::Result<(Index, u64)> {
    fs::create_dir_all(blocks_dir)?;
    fs::create_dir_all(packs_dir)?;

    let mut found = Vec::new();
    let mut corrupt = 0u64;
    for shard in fs::read_dir(blocks_dir)? {
        let shard = shard?;
        if !shard.file_type()?.is_dir() {
            continue;
        }
        for entry in fs::read_dir(shard.path())? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.ends_with(TMP_SUFFIX) {
                remove_quietly(&path, "temporary block file");
                continue;
            }
            if !name.ends_with(&format!(".{BLOCK_EXT}")) {
                continue;
            }
            let reason = match scan_block(&path) {
                Ok(Ok((key, size, mtime))) if block_path_in(blocks_dir, &key) == path => {
                    found.push(Recovered { mtime, place: Place::File(path), key, size });
                    continue;
                }
                Ok(Ok(_)) => "file name does not match key",
                Ok(Err(reason)) => reason,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => {
                    tracing::warn!(path = %path.display(), tier = "nvme", error = %e, "unreadable block file");
                    "unreadable"
                }
            };
            tracing::warn!(path = %path.display(), tier = "nvme", reason, "corrupt block dropped");
            remove_quietly(&path, "corrupt block file");
            corrupt += 1;
        }
    }

    let mut containers: HashMap<u32, Container> = HashMap::new();
    let mut next_container = 0u32;
    for (seq, path) in pack::list(packs_dir)? {
        next_container = next_container.max(seq.saturating_add(1));
        let scanned = match pack::scan(&path) {
            Ok(scanned) => scanned,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                tracing::warn!(path = %path.display(), tier = "nvme", error = %e, "unreadable container dropped");
                remove_quietly(&path, "unreadable container");
                corrupt += 1;
                continue;
            }
        };
        if let Some(reason) = scanned.cut {
            tracing::warn!(path = %path.display(), tier = "nvme", reason, at = scanned.len, "container tail cut off");
            corrupt += 1;
        }
        if scanned.skipped > 0 {
            tracing::warn!(path = %path.display(), tier = "nvme", entries = scanned.skipped, "corrupt container entries dropped");
            corrupt += scanned.skipped;
        }
        for f in scanned.live {
            found.push(Recovered {
                mtime: scanned.mtime,
                place: Place::Packed(seq, f.offset),
                key: f.key,
                size: f.size,
            });
        }
        containers.insert(
            seq,
            Container {
                file: Arc::new(scanned.file),
                len: scanned.len,
                live_bytes: 0,
                live_entries: 0,
                sealed: true,
            },
        );
    }

    // Oldest first: over capacity the oldest go, and main is filled in this order so its
    // first pass evicts the least recently written first.
    found.sort_by(|a, b| (a.mtime, &a.place).cmp(&(b.mtime, &b.place)));
    let discard = |containers: &HashMap<u32, Container>, r: &Recovered, what: &'static str| match &r.place {
        Place::File(path) => remove_quietly(path, what),
        Place::Packed(seq, offset) => {
            let header_len = pack::header_len_for(&r.key) as u64;
            if let Some(c) = containers.get(seq)
                && let Err(e) = pack::mark_dead(&c.file, *offset, header_len, r.size)
            {
                tracing::warn!(block = %r.key, tier = "nvme", error = %e, what, "could not mark an entry dead");
            }
        }
    };
    // A key found twice keeps its newest copy.
    let mut newest: HashMap<&BlockKey, usize> = HashMap::new();
    for (i, r) in found.iter().enumerate() {
        newest.insert(&r.key, i);
    }
    let keep: Vec<bool> = found.iter().enumerate().map(|(i, r)| newest[&r.key] == i).collect();
    drop(newest);
    let mut total: u64 = found.iter().zip(&keep).filter(|(_, k)| **k).map(|(r, _)| r.size).sum();
    let mut evicted = 0u64;
    let mut index = Index::new(capacity_bytes);
    for (r, kept) in found.into_iter().zip(keep) {
        if !kept {
            discard(&containers, &r, "older copy of a block");
            continue;
        }
        if total > capacity_bytes {
            discard(&containers, &r, "block over capacity");
            total -= r.size;
            evicted += 1;
            continue;
        }
        let packed = match r.place {
            Place::File(_) => None,
            Place::Packed(seq, offset) => {
                if let Some(c) = containers.get_mut(&seq) {
                    c.live_bytes += pack::entry_len(&r.key, r.size);
                    c.live_entries += 1;
                }
                Some(PackAt { container: seq, offset })
            }
        };
        index.insert_recovered(r.key, r.size, packed);
    }
    let empty: Vec<u32> = containers.iter().filter(|(_, c)| c.live_entries == 0).map(|(s, _)| *s).collect();
    for seq in empty {
        containers.remove(&seq);
        remove_quietly(&pack::container_path(packs_dir, seq), "empty container");
    }
    index.containers = containers;
    index.next_container = next_container;
    tracing::info!(
        dir = %dir.display(),
        tier = "nvme",
        blocks = index.policy.len(),
        used_bytes = index.policy.used(),
        containers = index.containers.len(),
        dead_bytes = index.dead_bytes(),
        capacity_bytes,
        corrupt,
        evicted,
        "nvme tier opened"
    );
    Ok((index, corrupt))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fs::File;
    use std::time::Duration;

    use super::super::NvmeTier;
    use super::super::format::tmp_path;
    use super::super::testing::{
        HEADER_BYTE, block_files, data_for, files_with_suffix, flip_byte, key, key_set, replay, small_key,
        small_puts,
    };
    use super::*;
    use crate::tier::{Tier, TierEvent};

    #[tokio::test]
    async fn reopen_keeps_blocks_and_reports_them() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        for i in 0..3 {
            tier.put(&key(i), data_for(i, 100 * i as usize)).await.unwrap();
        }
        let before = key_set(&tier);
        drop(tier);

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(key_set(&tier), before);
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, before);
        for i in 0..3 {
            assert_eq!(tier.get(&key(i)).await.unwrap(), Some(data_for(i, 100 * i as usize)));
        }
        assert_eq!(tier.usage().used_bytes, 300);
        assert_eq!(tier.corrupt_blocks(), 0);
    }

    #[tokio::test]
    async fn malformed_files_are_dropped_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        for i in 0..4 {
            tier.put(&key(i), data_for(i, 300)).await.unwrap();
        }
        flip_byte(&tier.block_path(&key(0)), HEADER_BYTE);
        let truncated = File::options().write(true).open(tier.block_path(&key(1))).unwrap();
        truncated.set_len(20).unwrap();
        drop(truncated);
        // A valid block under a name that is not its key's.
        let misplaced = tier.block_path(&key(2)).with_file_name(format!("{:032x}.blk", 7u128));
        fs::rename(tier.block_path(&key(2)), &misplaced).unwrap();
        drop(tier);

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(tier.corrupt_blocks(), 3);
        assert_eq!(key_set(&tier), [(key(3), 300)].into_iter().collect());
        assert_eq!(block_files(dir.path()), [tier.block_path(&key(3))].into_iter().collect());
        assert_eq!(tier.drain_events(), vec![TierEvent::Added { key: key(3), size: 300 }]);
        assert_eq!(tier.get(&key(3)).await.unwrap(), Some(data_for(3, 300)));
    }

    #[tokio::test]
    async fn tmp_leftovers_are_removed_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 10)).await.unwrap();
        let path = tier.block_path(&key(1));
        drop(tier);
        let beside = tmp_path(&path);
        fs::write(&beside, b"half a blo").unwrap();
        fs::create_dir_all(dir.path().join("blocks/ab")).unwrap();
        let lone = dir.path().join("blocks/ab/abababababababababababababababab.blk.tmp");
        fs::write(&lone, b"").unwrap();

        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert!(!beside.exists() && !lone.exists());
        assert!(files_with_suffix(dir.path(), ".tmp").is_empty());
        assert_eq!(tier.corrupt_blocks(), 0);
        assert_eq!(tier.get(&key(1)).await.unwrap(), Some(data_for(1, 10)));
    }

    #[tokio::test]
    async fn open_evicts_oldest_mtime_over_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        let now = SystemTime::now();
        for (i, age_secs) in [(0u64, 10u64), (1, 30), (2, 20)] {
            tier.put(&key(i), data_for(i, 100)).await.unwrap();
            let file = File::options().write(true).open(tier.block_path(&key(i))).unwrap();
            file.set_modified(now - Duration::from_secs(age_secs)).unwrap();
        }
        drop(tier);

        let tier = NvmeTier::open(dir.path(), 200).unwrap();
        assert_eq!(key_set(&tier), [(key(0), 100), (key(2), 100)].into_iter().collect());
        assert_eq!(block_files(dir.path()).len(), 2);
        assert!(!tier.block_path(&key(1)).exists());
        assert_eq!(tier.corrupt_blocks(), 0);
        let mut replayed = BTreeMap::new();
        replay(&mut replayed, tier.drain_events());
        assert_eq!(replayed, key_set(&tier));
        // Recovered blocks start in mtime order: 2 is older than 0, so it goes first.
        tier.put(&key(5), data_for(5, 100)).await.unwrap();
        assert!(tier.contains(&key(0)) && !tier.contains(&key(2)));
    }

    #[tokio::test]
    async fn evicted_and_removed_entries_stay_gone_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        // Room for 10 blocks of 1000 bytes.
        let tier = NvmeTier::open(dir.path(), 10_000).unwrap();
        for r in tier.put_many(small_puts(0..10, |_| 1000)).await {
            r.unwrap();
        }
        for r in tier.put_many(small_puts(10..14, |_| 1000)).await {
            r.unwrap();
        }
        tier.remove(&small_key(12)).await.unwrap();
        let kept = key_set(&tier);
        assert_eq!(kept.len(), 9, "4 evicted for the second batch, 1 removed");
        drop(tier);
        let tier = NvmeTier::open(dir.path(), 10_000).unwrap();
        assert_eq!(key_set(&tier), kept, "no evicted or removed block comes back");
        assert_eq!(tier.get(&small_key(12)).await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_corrupt_header_inside_a_container_costs_that_entry_alone_on_restart() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        for r in tier.put_many(small_puts(0..5, |_| 3000)).await {
            r.unwrap();
        }
        let (path, offset, _) = tier.locate(&small_key(1)).unwrap();
        let start = offset as usize - pack::header_len_for(&small_key(1));
        flip_byte(&path, start + HEADER_BYTE);
        drop(tier);
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(tier.corrupt_blocks(), 1);
        let keys: Vec<u64> = key_set(&tier).keys().map(|k| k.version[5..].parse().unwrap()).collect();
        assert_eq!(keys, vec![0, 2, 3, 4]);
        // A torn tail (a crash in the middle of an append) cuts the last entry only.
        let (path, offset, len) = tier.locate(&small_key(4)).unwrap();
        drop(tier);
        File::options().write(true).open(&path).unwrap().set_len(offset + len - 1).unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(key_set(&tier).len(), 3);
        assert_eq!(tier.get(&small_key(3)).await.unwrap(), Some(data_for(3, 3000)));
    }
}
