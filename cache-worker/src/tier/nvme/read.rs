//! Checked reads of an NVMe tier's ready blocks: a whole block against its header and data
//! checksum (a packed entry against its entry header), a range against the chunk checksums it
//! touches — or unchecked, once this process verified the block. A block that fails a check is
//! dropped from the index, its storage given back, and counted as corrupt; one whose storage
//! vanished is dropped without being counted. Either is a miss. A read drops only the copy it
//! looked up (the generation it read), never a newer one written or moved since.

use std::fs::File;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use strata_common::BlockKey;

use super::format::{Malformed, ReadOutcome, header_len_for, read_block, read_block_range, remove_quietly};
use super::index::{Ready, Slot};
use super::{Shared, pack};
#[cfg(doc)]
use crate::tier::Tier;

impl Shared {
    /// Blocking: reads the block of a ready entry, dropping it if it is missing or corrupt.
    pub(super) fn read_checked(
        &self,
        key: &BlockKey,
        entry: Ready,
        file: Option<Arc<File>>,
    ) -> io::Result<Option<Bytes>> {
        let outcome = match (entry.packed, file) {
            (None, _) => read_block(&self.block_path(key), key)?,
            (Some(at), Some(file)) => match pack::read_entry(&file, at.offset, key, entry.size)? {
                pack::EntryRead::Hit(data) => ReadOutcome::Hit(data),
                pack::EntryRead::Dead => ReadOutcome::Missing,
                pack::EntryRead::Corrupt(reason) => ReadOutcome::Corrupt(reason),
            },
            (Some(_), None) => ReadOutcome::Missing,
        };
        match outcome {
            ReadOutcome::Hit(data) if data.len() as u64 == entry.size => {
                if !entry.verified
                    && let Some(Slot::Ready(ready)) = self.lock().slots.get_mut(key)
                    && ready.generation == entry.generation
                {
                    ready.verified = true;
                }
                Ok(Some(data))
            }
            // A valid file of another length means the file was replaced behind our back; the
            // index's accounting would be wrong, so treat it like any other bad file.
            ReadOutcome::Hit(_) => {
                self.drop_corrupt(key, entry.generation, "length differs from index");
                Ok(None)
            }
            ReadOutcome::Corrupt(reason) => {
                self.drop_corrupt(key, entry.generation, reason);
                Ok(None)
            }
            ReadOutcome::Missing => {
                let retired = {
                    let mut index = self.lock();
                    (index.ready_generation(key) == Some(entry.generation))
                        .then(|| index.retire(key))
                        .flatten()
                };
                if let Some(ready) = retired {
                    tracing::debug!(block = %key, tier = "nvme", "block file vanished; dropped from index");
                    if let Some(at) = ready.packed {
                        self.drop_if_empty(at.container);
                    }
                    self.lock().clear_busy(key);
                    self.settled.notify_waiters();
                }
                Ok(None)
            }
        }
    }

    /// Blocking: a range of an unpacked ready block (see [`Tier::get_range`]), dropping the
    /// block if what the range touches is corrupt.
    pub(super) fn read_range_checked(
        &self,
        key: &BlockKey,
        entry: Ready,
        range: std::ops::Range<u64>,
    ) -> io::Result<Option<Bytes>> {
        let path = self.block_path(key);
        if entry.verified {
            use std::os::unix::fs::FileExt;
            let file = match File::open(&path) {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            let mut data = vec![0u8; (range.end - range.start) as usize];
            return match file.read_exact_at(&mut data, header_len_for(key) as u64 + range.start) {
                Ok(()) => Ok(Some(Bytes::from(data))),
                // Evicted and replaced by a shorter file under our feet: a miss.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
                Err(e) => Err(e),
            };
        }
        match read_block_range(&path, key, range)? {
            ReadOutcome::Hit(data) => Ok(Some(data)),
            ReadOutcome::Corrupt(reason) => {
                self.drop_corrupt(key, entry.generation, reason);
                Ok(None)
            }
            // The whole-block read settles the index for a vanished file.
            ReadOutcome::Missing => self.read_checked(key, entry, None).map(|_| None),
        }
    }

    pub(super) fn drop_corrupt(&self, key: &BlockKey, generation: u64, reason: Malformed) {
        let (packed, size) = {
            let mut index = self.lock();
            // Another generation means the entry was evicted and rewritten (or moved) while we
            // read: what we read may be the old copy, and the new one is not ours to delete.
            if index.ready_generation(key) != Some(generation) {
                return;
            }
            match index.retire(key) {
                Some(r) => (r.packed, r.size),
                None => return,
            }
        };
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(block = %key, tier = "nvme", reason, packed = packed.is_some(), "corrupt block dropped");
        match packed {
            None => remove_quietly(&self.block_path(key), "corrupt block file"),
            Some(at) => {
                if let Err(e) = self.mark_dead(at, key, size) {
                    tracing::warn!(block = %key, tier = "nvme", error = %e, "could not mark a corrupt entry dead");
                }
            }
        }
        self.lock().clear_busy(key);
        self.settled.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::NvmeTier;
    use super::super::format::CHECKSUM_CHUNK;
    use super::super::testing::{HEADER_BYTE, assert_dropped_as_corrupt, data_for, flip_byte, key};
    use super::*;
    use crate::tier::{Tier, TierEvent};

    #[tokio::test]
    async fn flipped_data_byte_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 500)).await.unwrap();
        tier.put(&key(2), data_for(2, 500)).await.unwrap();
        let path = tier.block_path(&key(1));
        let len = fs::metadata(&path).unwrap().len() as usize;
        flip_byte(&path, len - 100);
        assert_dropped_as_corrupt(&tier, &key(1)).await;
        assert_eq!(tier.usage().used_bytes, 500);
        assert_eq!(tier.get(&key(2)).await.unwrap(), Some(data_for(2, 500)));
    }

    #[tokio::test]
    async fn a_range_of_an_unverified_block_checks_only_the_chunks_it_touches() {
        let dir = tempfile::tempdir().unwrap();
        let len = 4 * (1 << 20) + 100; // the last chunk is short
        let data = data_for(1, len);
        {
            let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
            tier.put(&key(1), data.clone()).await.unwrap();
            tier.put(&key(2), data_for(2, len)).await.unwrap();
            // Written by this process: verified, read without a check.
            assert_eq!(tier.get_range(&key(1), 5..70_000).await.unwrap().unwrap(), data.slice(5..70_000));
        }
        // Reopened: nothing is verified; ranges are checked chunk by chunk.
        let tier = NvmeTier::open(dir.path(), 64 << 20).unwrap();
        let c = CHECKSUM_CHUNK as usize;
        for range in [0..1, c - 1..c + 1, 1000..300_000, len - 100..len, len - 1..len, 7..7, 0..len] {
            let got = tier.get_range(&key(1), range.start as u64..range.end as u64).await.unwrap();
            assert_eq!(got.unwrap(), data.slice(range.clone()), "{range:?}");
        }
        assert!(tier.get_range(&key(1), 0..len as u64 + 1).await.is_err(), "a range past the block");
        // A range read does not verify the block: only a whole read does.
        assert!(tier.open_verified(&key(1)).is_none());

        // Bit rot in chunk 10: ranges elsewhere are intact and served; one touching it drops
        // the block.
        let path = tier.block_path(&key(1));
        flip_byte(&path, header_len_for(&key(1)) + 10 * c + 5);
        assert_eq!(tier.get_range(&key(1), 0..4096).await.unwrap().unwrap(), data.slice(0..4096));
        assert_eq!(
            tier.get_range(&key(1), (9 * c) as u64..(10 * c) as u64).await.unwrap().unwrap(),
            data.slice(9 * c..10 * c)
        );
        assert_eq!(tier.get_range(&key(1), (10 * c + 4) as u64..(10 * c + 5) as u64).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 1);
        assert!(!path.exists(), "the corrupt block's file is deleted");
        assert!(!tier.contains(&key(1)));

        // A whole read checks the whole-data checksum, combined from the chunks' at write.
        assert_eq!(tier.get(&key(2)).await.unwrap().unwrap(), data_for(2, len));
        assert!(tier.open_verified(&key(2)).is_some(), "a whole read verifies the block");
    }

    #[tokio::test]
    async fn missing_file_is_a_miss_not_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        tier.put(&key(1), data_for(1, 10)).await.unwrap();
        tier.drain_events();
        fs::remove_file(tier.block_path(&key(1))).unwrap();
        assert_eq!(tier.get(&key(1)).await.unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 0);
        assert!(!tier.contains(&key(1)));
        assert_eq!(tier.usage().used_bytes, 0);
        assert_eq!(tier.drain_events(), vec![TierEvent::Removed { key: key(1) }]);
    }

    #[tokio::test]
    async fn stale_reads_never_drop_a_newer_copy() {
        // A get that looked the block up, then lost a race with eviction and a re-put, must
        // neither count nor delete the new copy, whatever it finds on disk.
        let dir = tempfile::tempdir().unwrap();
        let tier = NvmeTier::open(dir.path(), 1 << 20).unwrap();
        let k = key(1);
        tier.put(&k, data_for(1, 64)).await.unwrap();
        let stale = tier.shared.lock().touch(&k).unwrap();
        tier.remove(&k).await.unwrap();
        tier.put(&k, data_for(1, 64)).await.unwrap();
        let path = tier.block_path(&k);

        flip_byte(&path, HEADER_BYTE);
        assert_eq!(tier.shared.read_checked(&k, stale, None).unwrap(), None);
        assert_eq!(tier.corrupt_blocks(), 0);
        assert!(path.exists() && tier.contains(&k));

        fs::remove_file(&path).unwrap();
        assert_eq!(tier.shared.read_checked(&k, stale, None).unwrap(), None);
        assert!(tier.contains(&k), "stale miss dropped the current entry");

        // The current generation is handled as usual.
        assert_eq!(tier.get(&k).await.unwrap(), None);
        assert!(!tier.contains(&k));
        assert_eq!(tier.corrupt_blocks(), 0);
    }
}
